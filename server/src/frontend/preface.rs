//! Tells an HTTP/1.1 client on the gRPC frontend what is wrong.
//!
//! kube-apiserver's egress selector set to `HTTPConnect` while this server
//! runs `--mode=grpc` sends `CONNECT host:port HTTP/1.1`; h2 would answer
//! with its SETTINGS frame, which the client reads as a malformed HTTP
//! response, and nothing would be logged. This layer watches the first bytes
//! a client sends: as long as they are HTTP/2's connection preface they pass
//! to h2 untouched; the first byte that is not, and the client gets an
//! HTTP/1.1 `400` whose reason phrase names `--mode` (kube-apiserver reports
//! the status line, not the body), the server logs a warning, and h2 sees the
//! connection end. After the preface it costs one comparison per read.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::connect::HTTP2_PREFACE;

/// What an HTTP/1.1 client on the gRPC frontend is told: in the reason
/// phrase, which Go's `http.ReadResponse` keeps as the status kube-apiserver
/// logs, and in the body, which curl prints.
pub(crate) const REFUSAL_REASON: &str = "Bad Request: this proxy-server serves gRPC (--mode=grpc) and the client \
     speaks HTTP/1.1 (HTTP CONNECT): run the server with --mode=http-connect, or set the client (kube-apiserver's \
     egress selector) to GRPC";

/// The whole HTTP/1.1 answer to a client that is not speaking HTTP/2.
fn refusal() -> Vec<u8> {
    let body = format!("{REFUSAL_REASON}\n");
    format!(
        "HTTP/1.1 400 {REFUSAL_REASON}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Where a connection is in its first bytes.
#[derive(Debug)]
enum State {
    /// This many bytes of the preface have been seen, all as expected.
    Preface(usize),
    /// The client sent something else: the answer is being written (what
    /// is left of it), then the connection ends.
    Refusing(Vec<u8>, usize),
    /// The answer is written: h2 reads end-of-stream from now on.
    Refused,
    /// The whole preface arrived: everything passes.
    Http2,
}

/// A gRPC frontend connection that answers a non-HTTP/2 client in HTTP/1.1
/// instead of letting h2 answer it in frames it cannot read.
#[derive(Debug)]
pub struct RequireHttp2<IO> {
    io: IO,
    state: State,
    /// What h2 wrote before the client's preface was complete (its own
    /// SETTINGS: h2 writes first), held back so that a client that is not
    /// speaking HTTP/2 reads an HTTP/1.1 answer and nothing else.
    held: Vec<u8>,
}

impl<IO> RequireHttp2<IO> {
    pub fn new(io: IO) -> Self {
        RequireHttp2 {
            io,
            state: State::Preface(0),
            held: Vec::new(),
        }
    }
}

impl<IO: AsyncRead + Unpin> RequireHttp2<IO> {
    /// Reads and drops what the client sent that h2 did not read (the rest
    /// of its request head), without waiting for more: closing a socket
    /// with unread bytes makes the kernel reset the connection, which can
    /// destroy the answer before the client reads it.
    fn discard_unread(&mut self, cx: &mut Context<'_>) {
        let mut scratch = [0u8; 1024];
        for _ in 0..DISCARD_READS {
            let mut sink = ReadBuf::new(&mut scratch);
            match Pin::new(&mut self.io).poll_read(cx, &mut sink) {
                Poll::Ready(Ok(())) if !sink.filled().is_empty() => continue,
                _ => return,
            }
        }
    }
}

/// At most this many reads of 1 KiB are discarded before closing.
const DISCARD_READS: usize = 64;

/// Checks `read`, the bytes that follow `seen` bytes of the preface; returns
/// how many have been seen after it, or `None` at the first that differs.
fn check_preface(seen: usize, read: &[u8]) -> Option<usize> {
    let expected = &HTTP2_PREFACE[seen..];
    let compared = expected.len().min(read.len());
    (read[..compared] == expected[..compared]).then_some(seen + compared)
}

impl<IO: AsyncRead + AsyncWrite + Unpin> AsyncRead for RequireHttp2<IO> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            match &mut this.state {
                State::Http2 => {
                    if !this.held.is_empty() {
                        // Pending or not, h2's next write or flush retries.
                        let _ = this.poll_write_held(cx);
                    }
                    return Pin::new(&mut this.io).poll_read(cx, buf);
                }
                State::Refused => return Poll::Ready(Ok(())),
                State::Refusing(answer, written) => {
                    while *written < answer.len() {
                        match ready!(Pin::new(&mut this.io).poll_write(cx, &answer[*written..])) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => *written += n,
                        }
                    }
                    // Best effort: the client may already be gone.
                    let _ = ready!(Pin::new(&mut this.io).poll_shutdown(cx));
                    this.discard_unread(cx);
                    this.state = State::Refused;
                }
                State::Preface(seen) => {
                    let start = buf.filled().len();
                    ready!(Pin::new(&mut this.io).poll_read(cx, buf))?;
                    let read = &buf.filled()[start..];
                    match check_preface(*seen, read) {
                        Some(seen) if seen == HTTP2_PREFACE.len() => {
                            this.state = State::Http2;
                            // The client waits for h2's SETTINGS; a full
                            // socket buffer is impossible this early, and
                            // h2's next write or flush would retry.
                            let _ = this.poll_write_held(cx);
                        }
                        Some(seen) => this.state = State::Preface(seen),
                        None => {
                            let first_line =
                                String::from_utf8_lossy(read.split(|&b| b == b'\r').next().unwrap_or(read))
                                    .chars()
                                    .take(80)
                                    .collect::<String>();
                            tracing::warn!(
                                request = %first_line,
                                "refused an HTTP/1.1 client on the gRPC frontend: it is set to HTTP CONNECT \
                                 while this server runs --mode=grpc"
                            );
                            // h2 never sees these bytes, nor the client h2's.
                            buf.set_filled(start);
                            this.held = Vec::new();
                            this.state = State::Refusing(refusal(), 0);
                            continue;
                        }
                    }
                    return Poll::Ready(Ok(()));
                }
            }
        }
    }
}

impl<IO: AsyncWrite + Unpin> RequireHttp2<IO> {
    /// Writes what was held back, once the client has shown it speaks
    /// HTTP/2; everything h2 writes later goes after it.
    fn poll_write_held(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while !self.held.is_empty() {
            let written = ready!(Pin::new(&mut self.io).poll_write(cx, &self.held))?;
            if written == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.held.drain(..written);
        }
        self.held = Vec::new();
        Poll::Ready(Ok(()))
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for RequireHttp2<IO> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        match this.state {
            State::Preface(_) => {
                this.held.extend_from_slice(buf);
                Poll::Ready(Ok(buf.len()))
            }
            // Not for a client that is not speaking HTTP/2.
            State::Refusing(..) | State::Refused => Poll::Ready(Ok(buf.len())),
            State::Http2 => {
                ready!(this.poll_write_held(cx))?;
                Pin::new(&mut this.io).poll_write(cx, buf)
            }
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        match this.state {
            State::Preface(_) => {
                for slice in bufs {
                    this.held.extend_from_slice(slice);
                }
                Poll::Ready(Ok(bufs.iter().map(|slice| slice.len()).sum()))
            }
            State::Refusing(..) | State::Refused => {
                Poll::Ready(Ok(bufs.iter().map(|slice| slice.len()).sum()))
            }
            State::Http2 => {
                ready!(this.poll_write_held(cx))?;
                Pin::new(&mut this.io).poll_write_vectored(cx, bufs)
            }
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match this.state {
            // Held until the preface is read; then the read writes it.
            State::Preface(_) | State::Refusing(..) | State::Refused => Poll::Ready(Ok(())),
            State::Http2 => {
                ready!(this.poll_write_held(cx))?;
                Pin::new(&mut this.io).poll_flush(cx)
            }
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

impl<IO: tonic::transport::server::Connected> tonic::transport::server::Connected for RequireHttp2<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn the_preface_passes_in_pieces_and_anything_else_does_not() {
        assert_eq!(check_preface(0, b"PRI * HTTP/2.0\r\n"), Some(16));
        assert_eq!(check_preface(16, b"\r\nSM\r\n\r\n\0\0\x12\x04"), Some(24));
        assert_eq!(check_preface(0, b"P"), Some(1));
        assert_eq!(check_preface(1, b"OST / HTTP/1.1"), None);
        assert_eq!(check_preface(0, b"CONNECT 10.0.0.1:443 HTTP/1.1\r\n"), None);
        assert_eq!(check_preface(0, b"\x16\x03\x01"), None);
    }

    #[tokio::test]
    async fn an_http1_client_reads_the_answer_and_h2_reads_nothing() {
        let (client, server) = tokio::io::duplex(4096);
        let mut server = RequireHttp2::new(server);
        let (mut client_read, mut client_write) = tokio::io::split(client);
        // h2 writes its SETTINGS before it reads anything.
        server.write_all(b"h2's SETTINGS").await.unwrap();
        server.flush().await.unwrap();
        client_write
            .write_all(b"CONNECT 10.0.0.1:443 HTTP/1.1\r\nHost: 10.0.0.1:443\r\n\r\n")
            .await
            .unwrap();
        let mut seen_by_h2 = Vec::new();
        server.read_to_end(&mut seen_by_h2).await.unwrap();
        assert!(seen_by_h2.is_empty());
        server.write_all(b"h2's WINDOW_UPDATE").await.unwrap();
        let mut answer = String::new();
        client_read.read_to_string(&mut answer).await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 400 Bad Request: "), "{answer}");
        assert!(
            answer.contains("--mode=grpc") && answer.ends_with("to GRPC\n"),
            "{answer}"
        );
    }

    #[tokio::test]
    async fn an_http2_client_is_untouched() {
        let (client, server) = tokio::io::duplex(4096);
        let mut server = RequireHttp2::new(server);
        let (mut client_read, mut client_write) = tokio::io::split(client);
        server.write_all(b"h2's SETTINGS;").await.unwrap();
        server.flush().await.unwrap();
        let mut sent = HTTP2_PREFACE.to_vec();
        sent.extend_from_slice(b"\0\0\0\x04\0\0\0\0\0");
        for piece in sent.chunks(5) {
            client_write.write_all(piece).await.unwrap();
        }
        client_write.shutdown().await.unwrap();
        let mut seen_by_h2 = Vec::new();
        server.read_to_end(&mut seen_by_h2).await.unwrap();
        assert_eq!(seen_by_h2, sent);
        server.write_all(b"h2's ACK").await.unwrap();
        server.shutdown().await.unwrap();
        let mut seen_by_client = String::new();
        client_read.read_to_string(&mut seen_by_client).await.unwrap();
        assert_eq!(seen_by_client, "h2's SETTINGS;h2's ACK");
    }
}
