//! A tunneled connection as an `AsyncRead + AsyncWrite` byte stream.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes};
use futures_util::StreamExt;
use konnectivity_proto::{ConnectId, DATA_CHUNK, Frame, Packet};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::mpsc;
use tokio_util::sync::PollSender;
use tonic::Streaming;

/// How the remote side has ended, once it has.
enum ReadEnd {
    Open,
    /// CLOSE_RSP without error: the remote closed cleanly.
    Closed,
    /// CLOSE_RSP with an error, or the stream broke: reads fail.
    Failed(String),
}

/// One tunneled TCP connection. Reads return DATA from the remote end, end
/// of stream when it closed cleanly, and an error when the tunnel broke
/// (agent gone, server gone). Shutting down the write side closes the
/// connection (the protocol has no half-close). Dropping it closes too.
pub struct TunnelStream {
    connect_id: ConnectId,
    outbound: PollSender<Packet>,
    inbound: Streaming<Packet>,
    /// What is left of the last DATA packet.
    pending: Bytes,
    read_end: ReadEnd,
    close_sent: bool,
}

impl TunnelStream {
    pub(crate) fn new(
        connect_id: ConnectId,
        outbound: mpsc::Sender<Packet>,
        inbound: Streaming<Packet>,
    ) -> Self {
        TunnelStream {
            connect_id,
            outbound: PollSender::new(outbound),
            inbound,
            pending: Bytes::new(),
            read_end: ReadEnd::Open,
            close_sent: false,
        }
    }

    /// The connection's id on its agent stream (for logs).
    pub fn connect_id(&self) -> i64 {
        self.connect_id.get()
    }

    fn on_packet(&mut self, packet: Packet) {
        match Frame::try_from(packet) {
            Ok(Frame::Data { connect_id, data, .. }) if connect_id == self.connect_id => self.pending = data,
            Ok(Frame::CloseResponse { error: None, .. }) => self.read_end = ReadEnd::Closed,
            Ok(Frame::CloseResponse {
                error: Some(error), ..
            }) => self.read_end = ReadEnd::Failed(error),
            Ok(other) => tracing::warn!(kind = ?other.kind(), "unexpected packet on a tunnel stream"),
            Err(error) => tracing::warn!(%error, "invalid packet on a tunnel stream"),
        }
    }
}

impl AsyncRead for TunnelStream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if !this.pending.is_empty() {
                let n = this.pending.len().min(buf.remaining());
                buf.put_slice(&this.pending[..n]);
                this.pending.advance(n);
                return Poll::Ready(Ok(()));
            }
            match &this.read_end {
                ReadEnd::Open => {}
                ReadEnd::Closed => return Poll::Ready(Ok(())),
                ReadEnd::Failed(error) => {
                    return Poll::Ready(Err(io::Error::new(io::ErrorKind::ConnectionReset, error.clone())));
                }
            }
            match ready!(this.inbound.poll_next_unpin(cx)) {
                Some(Ok(packet)) => this.on_packet(packet),
                Some(Err(status)) => {
                    this.read_end = ReadEnd::Failed(format!("tunnel stream failed: {status}"))
                }
                None => this.read_end = ReadEnd::Failed("tunnel stream ended without CLOSE_RSP".to_owned()),
            }
        }
    }
}

impl AsyncWrite for TunnelStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.close_sent || !matches!(this.read_end, ReadEnd::Open) {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        }
        if ready!(this.outbound.poll_reserve(cx)).is_err() {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        }
        let n = buf.len().min(DATA_CHUNK);
        let data = Frame::Data {
            connect_id: this.connect_id,
            data: Bytes::copy_from_slice(&buf[..n]),
            offset: None,
        };
        this.outbound
            .send_item(data.into())
            .map_err(|_| io::Error::from(io::ErrorKind::BrokenPipe))?;
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Written data is already queued on the HTTP/2 stream.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.close_sent {
            return Poll::Ready(Ok(()));
        }
        if ready!(this.outbound.poll_reserve(cx)).is_ok() {
            let close = Frame::CloseRequest {
                connect_id: this.connect_id,
            };
            let _ = this.outbound.send_item(close.into());
        }
        this.close_sent = true;
        Poll::Ready(Ok(()))
    }
}

impl Drop for TunnelStream {
    fn drop(&mut self) {
        // Best effort: even without the CLOSE_REQ, the request stream ending
        // makes the server close the connection on the agent.
        if !self.close_sent
            && let Some(outbound) = self.outbound.get_ref()
        {
            let _ = outbound.try_send(
                Frame::CloseRequest {
                    connect_id: self.connect_id,
                }
                .into(),
            );
        }
    }
}
