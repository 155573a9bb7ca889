//! Lets gRPC clients on the Unix socket send the `:authority` they send.
//!
//! kube-apiserver's gRPC egress (grpc-go, through konnectivity-client) dials
//! the socket path as its target, and grpc-go then sends that path,
//! percent-encoded, as the `:authority` of every request
//! (`%2Fetc%2Fkubernetes%2F…`); gRPC core clients send the raw path. The
//! `http` crate refuses both as URI authorities, so h2 resets each such
//! stream with PROTOCOL_ERROR before tonic sees it. Upstream's Go server
//! ignores the authority, and on a Unix socket it names nothing: this layer
//! sits between the socket and h2 and removes an `:authority` h2 would
//! refuse, leaving every other byte as the client sent it.
//!
//! Only the Unix-socket listener is wrapped: TCP listeners keep h2's checks
//! as they are (a TLS client that sends a malformed authority is refused).
//! docs/uds-authority.md says why this, and not a patched h2.

mod hpack;
mod huffman;
mod rewrite;

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

pub(crate) use rewrite::Rewriter;

/// How much the slow path reads at once (header blocks are small).
const READ_CHUNK: usize = 8 * 1024;

/// An HTTP/2 server connection whose client side passes through a
/// [`Rewriter`]. Frames other than header blocks are read straight into
/// h2's buffer; only header blocks (and bytes read together with them) are
/// copied.
#[derive(Debug)]
pub struct TolerantAuthority<IO> {
    io: IO,
    rewriter: Rewriter,
    /// Bytes read but not yet rewritten: an incomplete frame.
    held: BytesMut,
    /// Bytes ready for h2, before anything read later.
    ready: BytesMut,
}

impl<IO> TolerantAuthority<IO> {
    pub fn new(io: IO) -> Self {
        TolerantAuthority {
            io,
            rewriter: Rewriter::default(),
            held: BytesMut::new(),
            ready: BytesMut::new(),
        }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for TolerantAuthority<IO> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if !this.ready.is_empty() {
                let n = this.ready.len().min(buf.remaining());
                buf.put_slice(&this.ready[..n]);
                this.ready.advance(n);
                if this.ready.is_empty() {
                    this.ready = BytesMut::new();
                }
                return Poll::Ready(Ok(()));
            }
            if this.held.is_empty() {
                // Fast path: read into h2's buffer and keep what passes.
                let start = buf.filled().len();
                ready!(Pin::new(&mut this.io).poll_read(cx, buf))?;
                let read = &buf.filled()[start..];
                let passed = this.rewriter.pass(read);
                if passed == read.len() {
                    return Poll::Ready(Ok(()));
                }
                this.held.extend_from_slice(&read[passed..]);
                buf.set_filled(start + passed);
                this.rewrite_held();
                if passed > 0 {
                    return Poll::Ready(Ok(()));
                }
            } else {
                // Slow path: complete the held frame.
                this.held.reserve(READ_CHUNK);
                let read = ready!(tokio_util::io::poll_read_buf(
                    Pin::new(&mut this.io),
                    cx,
                    &mut this.held
                ))?;
                if read == 0 {
                    // The client left mid-frame: h2 sees what it sent.
                    this.ready = this.held.split();
                    continue;
                }
                this.rewrite_held();
            }
        }
    }
}

impl<IO> TolerantAuthority<IO> {
    /// Rewrites what it can of `held`, giving back its memory once it is
    /// all rewritten: a connection spends most of its life on DATA, and an
    /// idle one should hold no buffer.
    fn rewrite_held(&mut self) {
        self.rewriter.rewrite(&mut self.held, &mut self.ready);
        if self.held.is_empty() {
            self.held = BytesMut::new();
        }
    }
}

impl<IO> Drop for TolerantAuthority<IO> {
    fn drop(&mut self) {
        if self.rewriter.dropped > 0 {
            tracing::debug!(
                requests = self.rewriter.dropped,
                "connection closed; its :authority (a socket path, as grpc-go and gRPC core send) was left out"
            );
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for TolerantAuthority<IO> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

impl<IO: tonic::transport::server::Connected> tonic::transport::server::Connected for TolerantAuthority<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}
