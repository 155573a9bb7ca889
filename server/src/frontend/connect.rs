//! The HTTP CONNECT frontend, as kube-apiserver's `HTTPConnect` egress dialer
//! uses it: one `CONNECT host:port HTTP/1.1` per connection, answered with
//! exactly `HTTP/1.1 200 Connection Established\r\n\r\n` and then raw bytes.
//!
//! The request head is parsed here (with `httparse`) rather than by a full
//! HTTP server so that the success line is byte-exact and nothing the client
//! sends after the head is lost or buffered away from the tunnel.

use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use konnectivity_plumbing::lifecycle::Hold;
use konnectivity_proto::{DialId, DialTarget};
use konnectivity_telemetry::metrics::GaugeGuard;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::stream::{ChunkReader, FrontendStream};
use crate::metrics::ServerMetrics;
use crate::tunnel::{Dialer, RemoteEnd, TunnelConn, TunnelEnd};

/// The success line; Go's client reads exactly this, and nothing may follow
/// it before the tunneled bytes.
pub(crate) const ESTABLISHED: &[u8] = b"HTTP/1.1 200 Connection Established\r\n\r\n";

/// What every HTTP/2 (and so gRPC) client sends first.
pub(crate) const HTTP2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// The longest request head accepted.
pub const MAX_HEAD: usize = 16 * 1024;
/// How long a client may take to send its request head.
pub(crate) const HEAD_TIMEOUT: Duration = Duration::from_secs(30);

/// A request that cannot be tunneled, with the status it is answered with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("method {0} is not allowed: this proxy only supports CONNECT")]
    NotConnect(String),
    #[error("malformed request: {0}")]
    Malformed(String),
    #[error("CONNECT target {0:?} is not host:port")]
    BadTarget(String),
    #[error("request head larger than {MAX_HEAD} bytes")]
    TooLarge,
    #[error("request head not received within {HEAD_TIMEOUT:?}")]
    Timeout,
    #[error("connection closed before the request head was complete")]
    Incomplete,
    /// A gRPC (HTTP/2) client: kube-apiserver's egress set to GRPC while
    /// this server runs `--mode=http-connect`.
    #[error(
        "this proxy-server serves HTTP CONNECT (--mode=http-connect) and the client speaks HTTP/2 (gRPC): \
         run the server with --mode=grpc, or set the client (kube-apiserver's egress selector) to HTTPConnect"
    )]
    Http2,
}

impl RequestError {
    pub fn http_status(&self) -> u16 {
        match self {
            RequestError::NotConnect(_) => 405,
            RequestError::Malformed(_) | RequestError::BadTarget(_) | RequestError::Incomplete => 400,
            RequestError::TooLarge => 431,
            RequestError::Timeout => 408,
            // Answered in HTTP/2 (see `write_http2_refusal`); counted as a
            // bad request.
            RequestError::Http2 => 400,
        }
    }
}

/// A parsed CONNECT request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectRequest {
    /// `host:port` to dial.
    pub target: DialTarget,
    /// Bytes the client sent after the head; they belong to the tunnel.
    pub early_data: Bytes,
}

/// Parses a request head from the start of `buf`. `Ok(None)` means more
/// bytes are needed. Pure, so it is unit-tested and fuzzed on its own.
pub fn parse_head(buf: &[u8]) -> Result<Option<(ConnectRequest, usize)>, RequestError> {
    // HTTP/2's connection preface, which httparse would call malformed.
    let preface = &HTTP2_PREFACE[..buf.len().min(HTTP2_PREFACE.len())];
    if buf.len() >= 3 && buf.starts_with(preface) {
        return if buf.len() >= HTTP2_PREFACE.len() {
            Err(RequestError::Http2)
        } else {
            Ok(None)
        };
    }
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut request = httparse::Request::new(&mut headers);
    let head_len = match request.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) if buf.len() >= MAX_HEAD => {
            return Err(RequestError::TooLarge);
        }
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => return Err(RequestError::TooLarge),
        Err(error) => return Err(RequestError::Malformed(error.to_string())),
    };
    if head_len > MAX_HEAD {
        return Err(RequestError::TooLarge);
    }
    let method = request.method.unwrap_or_default();
    if method != "CONNECT" {
        return Err(RequestError::NotConnect(method.to_owned()));
    }
    let text = request.path.unwrap_or_default();
    let target = DialTarget::parse_strict(text).map_err(|_| RequestError::BadTarget(text.to_owned()))?;
    Ok(Some((
        ConnectRequest {
            target,
            early_data: Bytes::copy_from_slice(&buf[head_len..]),
        },
        head_len,
    )))
}

/// Reads the request head, bounded in size and time.
/// Reads the request head into `buf`, which keeps what was read (for an
/// HTTP/2 client, what followed its preface).
async fn read_request<S: FrontendStream>(
    stream: &mut S,
    buf: &mut BytesMut,
) -> Result<ConnectRequest, RequestError> {
    let read = async {
        loop {
            if stream.read_buf(buf).await.map_err(|_| RequestError::Incomplete)? == 0 {
                return Err(RequestError::Incomplete);
            }
            if let Some((request, _)) = parse_head(buf)? {
                return Ok(request);
            }
        }
    };
    tokio::time::timeout(HEAD_TIMEOUT, read)
        .await
        .map_err(|_| RequestError::Timeout)?
}

fn reason_phrase(status: u16) -> &'static str {
    match status {
        400 => "Bad Request",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Error",
    }
}

async fn write_error<S: FrontendStream>(stream: &mut S, status: u16, message: &str) {
    let body = format!("{message}\n");
    let response = format!(
        "HTTP/1.1 {status} {}\r\nContent-Type: text/plain; charset=utf-8\r\nX-Content-Type-Options: nosniff\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        reason_phrase(status),
        body.len()
    );
    let _ = stream.write_all(response.as_bytes()).await;
    let _ = stream.shutdown().await;
    discard_input(stream).await;
}

/// Reads and discards what the client sends, a bounded amount for a bounded
/// time, until it closes. Closing a socket with unread bytes makes the
/// kernel send a reset, which can destroy an answer before the client reads
/// it (a client whose head was too large has usually sent more). The buffer
/// is on the heap: in the future it would make every tunnel's task 4 KiB
/// larger, as the task is as large as its largest state.
async fn discard_input<S: FrontendStream>(stream: &mut S) {
    let mut sink = vec![0u8; 4096];
    let drain = async {
        let mut left = LINGER_BYTES;
        while left > 0 {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    };
    let _ = tokio::time::timeout(LINGER_TIME, drain).await;
}

/// Refuses an HTTP/2 client in its own protocol: the server's preface (an
/// empty SETTINGS frame), then, once the client has opened its first stream
/// (or a second has passed), a GOAWAY with HTTP_1_1_REQUIRED and `message` as
/// its debug data, which gRPC clients report for that stream. Sent before the
/// client's request, the GOAWAY would race it: a client that has not yet
/// handed its request to the connection reports only "connection closed".
/// `read` holds what was read so far, the preface first.
async fn write_http2_refusal<S: FrontendStream>(stream: &mut S, mut read: BytesMut, message: &str) {
    let frame = |kind: u8, payload: &[u8]| {
        let length = (payload.len() as u32).to_be_bytes();
        let mut frame = vec![length[1], length[2], length[3], kind, 0, 0, 0, 0, 0];
        frame.extend_from_slice(payload);
        frame
    };
    const SETTINGS: u8 = 0x4;
    const HEADERS: u8 = 0x1;
    const GOAWAY: u8 = 0x7;
    const HTTP_1_1_REQUIRED: u32 = 0xd;
    if stream.write_all(&frame(SETTINGS, &[])).await.is_err() || stream.flush().await.is_err() {
        return;
    }
    let _ = read.split_to(HTTP2_PREFACE.len().min(read.len()));
    let first_stream = async {
        let mut left = LINGER_BYTES;
        loop {
            // Skip whole frames until a HEADERS frame begins.
            while read.len() >= 9 {
                if read[3] == HEADERS {
                    return;
                }
                let length = usize::from(read[0]) << 16 | usize::from(read[1]) << 8 | usize::from(read[2]);
                if read.len() < 9 + length {
                    break;
                }
                let _ = read.split_to(9 + length);
            }
            match stream.read_buf(&mut read).await {
                Ok(0) | Err(_) => return,
                Ok(n) if n >= left => return,
                Ok(n) => left -= n,
            }
        }
    };
    let _ = tokio::time::timeout(FIRST_STREAM_WAIT, first_stream).await;
    let mut goaway = 0u32.to_be_bytes().to_vec();
    goaway.extend_from_slice(&HTTP_1_1_REQUIRED.to_be_bytes());
    goaway.extend_from_slice(message.as_bytes());
    let _ = stream.write_all(&frame(GOAWAY, &goaway)).await;
    let _ = stream.flush().await;
    // The client closes once it has read the GOAWAY; closing first could
    // reset the connection before it has.
    discard_input(stream).await;
    let _ = stream.shutdown().await;
}

/// How long a refused HTTP/2 client is given to open its first stream.
const FIRST_STREAM_WAIT: Duration = Duration::from_secs(1);

/// How much of a refused client's further input is read before closing,
/// and for how long at most.
const LINGER_BYTES: usize = 256 * 1024;
const LINGER_TIME: Duration = Duration::from_secs(2);

/// Serves one CONNECT connection from request to close, keeping the
/// server's drain waiting (`_drain`) until then.
pub(crate) async fn serve<S: FrontendStream>(mut stream: S, dialer: Dialer, _drain: Hold) {
    let _open = GaugeGuard::new(&dialer.metrics.http_connections);
    let mut head = BytesMut::with_capacity(1024);
    let request = match read_request(&mut stream, &mut head).await {
        Ok(request) => {
            // Parsed: the request keeps what followed the head. An idle
            // tunnel holds no read buffer.
            drop(head);
            request
        }
        Err(RequestError::Http2) => {
            let error = RequestError::Http2;
            tracing::warn!(%error, "refused a gRPC client");
            dialer.metrics.connect_rejected(error.http_status());
            write_http2_refusal(&mut stream, head, &error.to_string()).await;
            return;
        }
        Err(error) => {
            tracing::debug!(%error, "rejected CONNECT request");
            dialer.metrics.connect_rejected(error.http_status());
            write_error(&mut stream, error.http_status(), &error.to_string()).await;
            return;
        }
    };
    let connection = match dialer.dial(&request.target, DialId::random()).await {
        Ok(connection) => connection,
        Err(error) => {
            tracing::info!(target = %request.target, %error, "CONNECT dial failed");
            let message = format!("dial to {} failed: {error}", request.target);
            write_error(&mut stream, error.http_status(), &message).await;
            return;
        }
    };
    if stream.write_all(ESTABLISHED).await.is_err() {
        return;
    }
    pump(stream, connection, request.early_data, &dialer.metrics).await;
}

/// Copies bytes both ways until either side ends. There is no half-close in
/// the protocol: the first end, either way, ends both directions.
async fn pump<S: FrontendStream>(
    stream: S,
    connection: TunnelConn,
    early_data: Bytes,
    metrics: &ServerMetrics,
) {
    let (mut reader, mut writer) = stream.into_halves();
    let (sender, mut receiver, life) = connection.split();

    let client_to_agent = async {
        // A send fails only once the connection is gone on the agent's
        // side; the other direction then learns how, so this one waits.
        let sent = async |chunk| {
            if sender.send(chunk).await.is_err() {
                std::future::pending::<()>().await;
            }
        };
        if !early_data.is_empty() {
            sent(early_data).await;
        }
        loop {
            match reader.read_chunk().await {
                Ok(Some(chunk)) => sent(chunk).await,
                Ok(None) => return TunnelEnd::ClientClosed,
                // A TLS client that hung up without close_notify has closed,
                // not failed: many do.
                Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => {
                    return TunnelEnd::ClientClosed;
                }
                Err(_) => return TunnelEnd::ClientError,
            }
        }
    };
    let agent_to_client = async {
        loop {
            match receiver.recv().await {
                Ok(data) => {
                    // Flush every chunk: over TLS, write_all can return with the
                    // last records still in rustls' buffer, and with no further
                    // write they would never reach the client.
                    let started = Instant::now();
                    if writer.write_all(&data).await.is_err() || writer.flush().await.is_err() {
                        return Err(TunnelEnd::ClientError);
                    }
                    metrics
                        .frontend_write_duration
                        .observe(started.elapsed().as_secs_f64());
                }
                Err(end) => return Ok(end),
            }
        }
    };
    let remote_end = tokio::select! {
        end = client_to_agent => Err(end),
        end = agent_to_client => end,
    };
    // Dropping the sender closes the connection on the agent.
    drop(sender);
    match remote_end {
        Ok(RemoteEnd::Closed) => {
            life.end(TunnelEnd::TargetClosed);
            let _ = writer.shutdown().await;
        }
        Ok(end) => {
            // In the tunnel's span, for its ids: an instrumented pump would
            // make every idle tunnel's task larger.
            life.span().in_scope(|| {
                tracing::info!(
                    error = end.error(),
                    "tunnel broke; resetting the client connection"
                )
            });
            life.end(end.tunnel_end());
            S::abort(reader, writer);
        }
        Err(client_end) => life.end(client_end),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Option<(ConnectRequest, usize)>, RequestError> {
        parse_head(text.as_bytes())
    }

    #[test]
    fn connect_as_kube_apiserver_sends_it() {
        let (request, len) = parse("CONNECT 10.0.0.5:10250 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            .unwrap()
            .unwrap();
        assert_eq!(request.target.as_str(), "10.0.0.5:10250");
        assert!(request.early_data.is_empty());
        assert_eq!(len, 52);
    }

    #[test]
    fn bytes_after_the_head_are_kept_for_the_tunnel() {
        let (request, _) = parse("CONNECT a:1 HTTP/1.1\r\n\r\n\x16\x03\x01hello")
            .unwrap()
            .unwrap();
        assert_eq!(&request.early_data[..], b"\x16\x03\x01hello");
    }

    #[test]
    fn partial_head_asks_for_more() {
        assert_eq!(parse("CONNECT a:1 HTTP/1.1\r\nHost: x\r\n"), Ok(None));
    }

    #[test]
    fn an_http2_client_is_recognised_by_its_preface() {
        assert_eq!(
            parse("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
            Err(RequestError::Http2)
        );
        // Not yet the whole preface: wait for the rest.
        assert_eq!(parse("PRI * HTTP/2.0\r\n"), Ok(None));
        assert!(RequestError::Http2.to_string().contains("--mode=grpc"));
    }

    #[test]
    fn other_methods_are_405() {
        let error = parse("GET / HTTP/1.1\r\n\r\n").unwrap_err();
        assert_eq!(error, RequestError::NotConnect("GET".into()));
        assert_eq!(error.http_status(), 405);
    }

    #[test]
    fn bad_targets_are_400() {
        for target in ["nohost", ":80", "a:0", "a:99999", "a:x", "fd00::1:80", "a/b:80"] {
            let error = parse(&format!("CONNECT {target} HTTP/1.1\r\n\r\n")).unwrap_err();
            assert_eq!(error, RequestError::BadTarget(target.into()), "{target}");
            assert_eq!(error.http_status(), 400);
        }
        assert!(parse("CONNECT [fd00::1]:443 HTTP/1.1\r\n\r\n").unwrap().is_some());
    }

    #[test]
    fn garbage_is_malformed() {
        let error = parse("\x00\x01\x02 junk\r\n\r\n").unwrap_err();
        assert!(matches!(error, RequestError::Malformed(_)));
        assert_eq!(error.http_status(), 400);
    }

    #[test]
    fn oversized_heads_are_refused() {
        let mut head = String::from("CONNECT a:1 HTTP/1.1\r\n");
        while head.len() < MAX_HEAD {
            head.push_str("X-Filler: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n");
        }
        assert_eq!(parse(&head), Err(RequestError::TooLarge));
    }
}
