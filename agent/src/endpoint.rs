//! Endpoints: the TCP connections an agent opens on a server's behalf, and
//! the two tasks that move their bytes.

use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use konnectivity_mux::flow::SendWindow;
use konnectivity_mux::outbound::Outbound;
use konnectivity_mux::{Port, Waited};
use konnectivity_proto::{ConnectId, DialTarget, TargetError};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::mpsc;
use tokio::sync::watch;

use crate::metrics::{AgentMetrics, DialFailure};
use konnectivity_client::net::ConnectError;
use konnectivity_telemetry::metrics::TunnelBytes;

/// A failed dial, with error text in the form Go's dialer writes, so that
/// servers (ours and upstream's) classify it the same way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DialError(pub String);

/// Dials `address` within `timeout`.
pub(crate) async fn dial(
    address: &DialTarget,
    timeout: Duration,
    mark: Option<u32>,
    metrics: &AgentMetrics,
) -> Result<TcpStream, DialError> {
    let started = Instant::now();
    let connect = async {
        let port = address.port().map_err(|error| match error {
            TargetError::MissingPort => {
                format!("dial tcp {address}: address {address}: missing port in address")
            }
            _ => format!("dial tcp: address {address}: invalid port"),
        })?;
        konnectivity_client::net::connect(address.host(), port, mark)
            .await
            .map_err(|error| go_dial_error(address.as_str(), &error))
    };
    match tokio::time::timeout(timeout, connect).await {
        Ok(Ok(stream)) => {
            metrics.dial_duration.observe(started.elapsed().as_secs_f64());
            Ok(stream)
        }
        Ok(Err(text)) => {
            metrics.dial_failed(DialFailure::Unknown);
            Err(DialError(text))
        }
        Err(_) => {
            metrics.dial_failed(DialFailure::Timeout);
            Err(DialError(format!("dial tcp {address}: i/o timeout")))
        }
    }
}

/// The error text Go's dialer would write for the same failure.
fn go_dial_error(address: &str, error: &ConnectError) -> String {
    let error = match error {
        ConnectError::Lookup { host, source } => {
            // getaddrinfo's EAI_NONAME and EAI_NODATA are Go's "no such host".
            let detail = source.to_string();
            let detail = detail
                .strip_prefix("failed to lookup address information: ")
                .unwrap_or(&detail);
            let cause = match detail {
                "Name or service not known" | "No address associated with hostname" => "no such host",
                other => other,
            };
            return format!("dial tcp: lookup {host}: {cause}");
        }
        ConnectError::Connect(error) => error,
    };
    let cause = match error.kind() {
        io::ErrorKind::ConnectionRefused => "connect: connection refused".to_owned(),
        io::ErrorKind::ConnectionReset => "connect: connection reset by peer".to_owned(),
        io::ErrorKind::HostUnreachable => "connect: no route to host".to_owned(),
        io::ErrorKind::NetworkUnreachable => "connect: network is unreachable".to_owned(),
        io::ErrorKind::TimedOut => "i/o timeout".to_owned(),
        _ if error.raw_os_error() == Some(24) => "socket: too many open files".to_owned(),
        _ => error.to_string(),
    };
    format!("dial tcp {address}: {cause}")
}

/// What an endpoint's tasks report to their session.
#[derive(Debug)]
pub(crate) struct EndpointClosed {
    pub connect_id: ConnectId,
    pub error: Option<String>,
}

/// What an endpoint's two tasks need of their session's stream.
#[derive(Clone)]
pub(crate) struct StreamHandle {
    pub connect_id: ConnectId,
    /// Packets to the server.
    pub outbound: Outbound,
    /// Where the end of the connection is reported.
    pub closed: mpsc::Sender<EndpointClosed>,
    pub bytes: Arc<TunnelBytes>,
    /// Set when the session is handed to a successor (docs/handover.md):
    /// both tasks stop where their state is whole and give their halves
    /// back. `None` for a session that cannot be handed over.
    pub stop: Option<watch::Receiver<bool>>,
}

/// Resolves once `stop` is set; never without it.
async fn stop_requested(stop: &mut Option<watch::Receiver<bool>>) {
    if let Some(stop) = stop
        && stop.wait_for(|stop| *stop).await.is_ok()
    {
        return;
    }
    std::future::pending().await
}

/// How an endpoint's reader ended.
pub(crate) enum ReaderEnd {
    /// The endpoint or the stream ended (a close was reported if it was the
    /// endpoint).
    Ended,
    /// Stopped for a hand-over: its half, and what it read and could not
    /// yet send.
    Stopped {
        read: OwnedReadHalf,
        unsent: Option<Bytes>,
    },
}

/// How an endpoint's writer ended.
pub(crate) enum WriterEnd {
    Ended,
    /// Stopped for a hand-over: its half, and the packet it was writing
    /// (its whole length, and the rest still to write).
    Stopped {
        write: OwnedWriteHalf,
        in_hand: Option<(usize, Bytes)>,
    },
}

impl StreamHandle {
    async fn report_closed(&self, error: Option<String>) {
        let connect_id = self.connect_id;
        let _ = self.closed.send(EndpointClosed { connect_id, error }).await;
    }
}

/// Reads from the endpoint and sends DATA to the server until the endpoint
/// closes; then reports the close so the session answers with CLOSE_RSP.
/// `unsent`: bytes a predecessor read and did not send, sent first.
pub(crate) async fn pump_from_endpoint(
    read: OwnedReadHalf,
    window: SendWindow,
    mut stream: StreamHandle,
    mut unsent: Option<Bytes>,
) -> ReaderEnd {
    let connect_id = stream.connect_id;
    let error = loop {
        let data = match unsent.take() {
            Some(data) => data,
            None => {
                // Wait for bytes before taking a buffer, and take one the size
                // of what was read: an idle connection then holds no memory at
                // all, and a small packet held for replay pins no large buffer.
                let readable = tokio::select! {
                    biased;
                    () = stop_requested(&mut stream.stop) => None,
                    readable = read.readable() => Some(readable),
                };
                match readable {
                    None => return ReaderEnd::Stopped { read, unsent: None },
                    Some(Err(error)) => break Some(error.to_string()),
                    Some(Ok(())) => {}
                }
                match konnectivity_mux::chunk::read_ready(
                    |first| read.try_read(first),
                    |more| read.try_read_buf(more),
                ) {
                    Ok(None) => break None,
                    Ok(Some(data)) => {
                        stream.bytes.received_from_target(data.len());
                        data
                    }
                    Err(error) if error.kind() == io::ErrorKind::WouldBlock => continue,
                    Err(error) => break Some(error.to_string()),
                }
            }
        };
        let reserved = tokio::select! {
            biased;
            () = stop_requested(&mut stream.stop) => None,
            reserved = window.reserve(data.len()) => Some(reserved),
        };
        match reserved {
            None => {
                return ReaderEnd::Stopped {
                    read,
                    unsent: Some(data),
                };
            }
            Some(Err(_)) => return ReaderEnd::Ended,
            Some(Ok(())) => {}
        }
        // From here the packet is in the replay: a hand-over while it waits
        // for the queue loses nothing (the successor sends it again).
        let packet = window.data(connect_id, data).into();
        let queued = tokio::select! {
            biased;
            () = stop_requested(&mut stream.stop) => None,
            queued = stream.outbound.send(packet) => Some(queued),
        };
        match queued {
            None => return ReaderEnd::Stopped { read, unsent: None },
            Some(Err(_)) => return ReaderEnd::Ended,
            Some(Ok(())) => {}
        }
    };
    stream.report_closed(error).await;
    ReaderEnd::Ended
}

/// Writes what the server sends to the endpoint, returning flow-control
/// credit as the bytes leave. Ends when the session drops the sender
/// (CLOSE_REQ, or the stream ended) after writing what was queued.
/// `in_hand`: a packet a predecessor was writing (its whole length, and the
/// rest to write), written first.
pub(crate) async fn pump_to_endpoint(
    mut write: OwnedWriteHalf,
    mut port: Port<Bytes>,
    mut stream: StreamHandle,
    mut in_hand: Option<(usize, Bytes)>,
) -> WriterEnd {
    loop {
        let (whole, mut rest) = match in_hand.take() {
            Some(in_hand) => in_hand,
            None => {
                let waited = tokio::select! {
                    biased;
                    () = stop_requested(&mut stream.stop) => None,
                    waited = port.recv_or_quiet() => Some(waited),
                };
                let Some(waited) = waited else {
                    return WriterEnd::Stopped { write, in_hand: None };
                };
                match waited {
                    Waited::Arrived(Some(chunk)) => (chunk.len(), chunk),
                    Waited::Arrived(None) => break,
                    // With resume: the server may drop what it kept for replay.
                    Waited::Quiet(credit) => {
                        if stream
                            .outbound
                            .send(credit.frame(stream.connect_id).into())
                            .await
                            .is_err()
                        {
                            return WriterEnd::Ended;
                        }
                        continue;
                    }
                }
            }
        };
        // Written piece by piece, so that a hand-over can stop it between
        // two writes and say exactly what is left.
        while !rest.is_empty() {
            let written = tokio::select! {
                biased;
                () = stop_requested(&mut stream.stop) => None,
                written = write.write(&rest) => Some(written),
            };
            let Some(written) = written else {
                return WriterEnd::Stopped {
                    write,
                    in_hand: Some((whole, rest)),
                };
            };
            match written {
                Ok(0) => {
                    stream
                        .report_closed(Some("write returned 0 bytes".to_owned()))
                        .await;
                    return WriterEnd::Ended;
                }
                Ok(n) => {
                    stream.bytes.sent_to_target(n);
                    bytes::Buf::advance(&mut rest, n);
                }
                Err(error) => {
                    stream.report_closed(Some(error.to_string())).await;
                    return WriterEnd::Ended;
                }
            }
        }
        if let Some(credit) = port.written(whole) {
            let update = credit.frame(stream.connect_id).into();
            if stream.outbound.send(update).await.is_err() {
                return WriterEnd::Ended;
            }
        }
    }
    let _ = write.shutdown().await;
    WriterEnd::Ended
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_read_like_go_dialer_errors() {
        let refused = ConnectError::Connect(io::Error::from(io::ErrorKind::ConnectionRefused));
        assert_eq!(
            go_dial_error("127.0.0.1:1", &refused),
            "dial tcp 127.0.0.1:1: connect: connection refused"
        );
        let emfile = ConnectError::Connect(io::Error::from_raw_os_error(24));
        assert!(go_dial_error("a:1", &emfile).contains("too many open files"));
        let unknown = ConnectError::Lookup {
            host: "x.invalid".into(),
            source: io::Error::other("failed to lookup address information: Name or service not known"),
        };
        assert_eq!(
            go_dial_error("x.invalid:80", &unknown),
            "dial tcp: lookup x.invalid: no such host"
        );
    }

    /// A packet may be held long after it was read (queued, or kept for
    /// replay until acknowledged): a small read must not pin a buffer of
    /// DATA_CHUNK (256 KiB).
    #[tokio::test]
    async fn a_small_read_travels_in_a_buffer_of_its_own_size() {
        use futures_util::StreamExt;
        use konnectivity_mux::Extensions;
        use konnectivity_proto::Frame;

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut target = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        let (endpoint, _) = listener.accept().await.unwrap();
        let (read, _write) = endpoint.into_split();
        let outbound = konnectivity_mux::outbound::outbound(16);
        let mut packets = outbound.attach();
        let (closed, _closed_rx) = mpsc::channel(1);
        let stream = StreamHandle {
            connect_id: ConnectId::FIRST,
            outbound: outbound.clone(),
            closed,
            bytes: Arc::default(),
            stop: None,
        };
        let pump = tokio::spawn(pump_from_endpoint(
            read,
            SendWindow::new(Extensions::FlowControl),
            stream,
            None,
        ));
        target.write_all(b"0123456789").await.unwrap();
        let packet = packets.next().await.unwrap();
        let Ok(Frame::Data { data, .. }) = Frame::try_from(packet) else {
            panic!("expected DATA");
        };
        assert_eq!(data, &b"0123456789"[..]);
        let capacity = bytes::BytesMut::from(data).capacity();
        assert!(capacity < 4096, "10 bytes pin a buffer of {capacity}");
        pump.abort();
    }

    #[tokio::test]
    async fn refused_dial_reports_go_text_and_counts() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap().to_string();
        drop(listener);
        let metrics = AgentMetrics::default();
        let error = dial(&address.as_str().into(), Duration::from_secs(5), None, &metrics)
            .await
            .unwrap_err();
        assert_eq!(
            error.0,
            format!("dial tcp {address}: connect: connection refused")
        );
    }
}
