//! Outgoing TCP connections that a node agent's own capture rules skip.

use std::io;

use tokio::net::{TcpSocket, TcpStream};

/// Connects to `host:port`, trying each resolved address, with `SO_MARK`
/// set first when `mark` is given (needs CAP_NET_ADMIN). The agent's capture
/// rules return early for this mark, so its own connections never loop back
/// into its capture listener.
pub async fn connect_marked(host: &str, port: u16, mark: Option<u32>) -> io::Result<TcpStream> {
    let mut last_error = io::Error::new(io::ErrorKind::NotFound, format!("{host}: no addresses"));
    for addr in tokio::net::lookup_host((host, port)).await? {
        let socket = if addr.is_ipv4() {
            TcpSocket::new_v4()?
        } else {
            TcpSocket::new_v6()?
        };
        if let Some(mark) = mark {
            socket2::SockRef::from(&socket).set_mark(mark)?;
        }
        match socket.connect(addr).await {
            Ok(stream) => {
                stream.set_nodelay(true)?;
                return Ok(stream);
            }
            Err(error) => last_error = error,
        }
    }
    Err(last_error)
}

/// How long an HTTP/2 keepalive ping may go unanswered before the connection
/// counts as dead: the ping interval, at most gRPC's default of 20s.
pub fn keepalive_timeout(interval: std::time::Duration) -> std::time::Duration {
    interval.min(std::time::Duration::from_secs(20))
}
