//! Outgoing TCP connections that a node agent's own capture rules skip.

use std::io;

use tokio::net::{TcpSocket, TcpStream};

/// Why [`connect`] failed: the name did not resolve, or no address of it
/// accepted the connection (the last address's error).
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("lookup {host}: {source}")]
    Lookup { host: String, source: io::Error },
    #[error(transparent)]
    Connect(io::Error),
}

/// Resolves `host` and connects to its addresses in turn, with TCP_NODELAY,
/// and with `SO_MARK` set first when `mark` is given (needs CAP_NET_ADMIN).
/// The agent's capture rules return early for this mark, so its own
/// connections never loop back into its capture listener.
pub async fn connect(host: &str, port: u16, mark: Option<u32>) -> Result<TcpStream, ConnectError> {
    let addrs = tokio::net::lookup_host((host, port))
        .await
        .map_err(|source| ConnectError::Lookup {
            host: host.to_owned(),
            source,
        })?;
    let mut last_error = io::Error::new(io::ErrorKind::NotFound, format!("{host}: no addresses"));
    for addr in addrs {
        match connect_addr(addr, mark).await {
            Ok(stream) => return Ok(stream),
            Err(error) => last_error = error,
        }
    }
    Err(ConnectError::Connect(last_error))
}

/// [`connect`] for callers that only need an `io::Error`.
pub async fn connect_marked(host: &str, port: u16, mark: Option<u32>) -> io::Result<TcpStream> {
    connect(host, port, mark).await.map_err(|error| match error {
        ConnectError::Connect(error) => error,
        lookup @ ConnectError::Lookup { .. } => io::Error::other(lookup.to_string()),
    })
}

async fn connect_addr(addr: std::net::SocketAddr, mark: Option<u32>) -> io::Result<TcpStream> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    if let Some(mark) = mark {
        socket2::SockRef::from(&socket).set_mark(mark)?;
    }
    let stream = socket.connect(addr).await?;
    stream.set_nodelay(true)?;
    Ok(stream)
}

/// The TLS server name for `host`: a DNS name, or an IP address with or
/// without IPv6 brackets.
pub fn server_name(host: &str) -> Result<rustls::pki_types::ServerName<'static>, io::Error> {
    rustls::pki_types::ServerName::try_from(host.trim_matches(|c| c == '[' || c == ']').to_owned())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("server name {host:?}: {e}")))
}
