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

/// A connection whose end can be awaited: `closed` is cancelled when the
/// HTTP/2 client drops it, which it does once the connection is over (the
/// server closed it, an I/O error, or PINGs that went unanswered). A
/// connection that only sits idle otherwise gives no sign of being dead.
pub(crate) struct Watched<T> {
    io: T,
    _closed: tokio_util::sync::DropGuard,
}

impl<T> Watched<T> {
    pub(crate) fn new(io: T, closed: &tokio_util::sync::CancellationToken) -> Watched<T> {
        Watched {
            io,
            _closed: closed.clone().drop_guard(),
        }
    }
}

impl<T: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Watched<T> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Watched<T> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<io::Result<usize>> {
        std::pin::Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> std::task::Poll<io::Result<usize>> {
        std::pin::Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_shutdown(cx)
    }
}
