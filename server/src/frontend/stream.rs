//! The byte streams frontends serve, over a Unix socket or TCP with TLS.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpStream, UnixStream};

/// A frontend connection that can be aborted: when the tunnel breaks (the
/// agent vanished), the client must see an error rather than a clean end of
/// stream it could mistake for a complete response.
pub(crate) trait FrontendStream: AsyncRead + AsyncWrite + Unpin + Send + 'static {
    /// Arranges for the connection to end with a TCP reset when dropped.
    fn abort_on_drop(&self);
}

impl FrontendStream for UnixStream {
    fn abort_on_drop(&self) {
        // A Unix socket has no reset; the peer sees end of stream.
    }
}

impl FrontendStream for TcpStream {
    fn abort_on_drop(&self) {
        let _ = socket2::SockRef::from(self).set_linger(Some(Duration::ZERO));
    }
}

impl FrontendStream for tokio_rustls::server::TlsStream<TcpStream> {
    fn abort_on_drop(&self) {
        self.get_ref().0.abort_on_drop();
    }
}
