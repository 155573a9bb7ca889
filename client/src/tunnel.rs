//! The connection to the server and the dial handshake.

use std::io;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use futures_util::Stream;
use hyper_util::rt::TokioIo;
use konnectivity_proto::wire::proxy_service_client::ProxyServiceClient;
use konnectivity_proto::{ConnectId, DialId, Frame, Packet};
use tokio::net::UnixStream;
use tokio::sync::mpsc;
use tokio_rustls::TlsConnector;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::Streaming;
use tonic::metadata::{AsciiMetadataValue, MetadataMap};
use tonic::transport::{Channel, Endpoint, Uri};

use crate::stream::TunnelStream;

/// Packets queued towards the server on one stream.
pub(crate) const OUTBOUND_QUEUE: usize = 64;
/// The server's text for "no backend", as upstream servers write it.
const NO_AGENT: &str = "No agent available";

#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("connecting to the proxy-server: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error("proxy-server name {0:?} is not a valid DNS name or IP address")]
    ServerName(String),
}

/// Why a dial produced no connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DialError {
    #[error("no agent available on the proxy-server")]
    NoAgent,
    /// The agent (or server) reported the dial failed; its text unchanged.
    #[error("dial failed: {0}")]
    Failed(String),
    #[error("dial timed out after {0:?}")]
    Timeout(Duration),
    #[error("tunnel closed: {0}")]
    TunnelClosed(String),
}

/// One HTTP/2 connection to a proxy-server's ProxyService.
#[derive(Clone)]
pub struct Tunnel {
    client: ProxyServiceClient<Channel>,
    dial_timeout: Duration,
    /// Cancelled when the connection the tunnel was made with is over.
    closed: CancellationToken,
}

/// HTTP/2 PINGs that watch a connection: one is sent whenever `interval`
/// passes without a frame from the server, streams open or not, and one
/// unanswered for `timeout` closes the connection and fails its streams.
/// The server's HTTP/2 layer answers a PING without a stream or a task of
/// the application: it is the cheapest sign of life a connection can ask
/// for (a probe stream costs the server a request, its headers and its
/// authentication). Our servers welcome them at any rate; gRPC servers in
/// Go (upstream's) close a connection pinged more often than every 30 s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pings {
    pub interval: Duration,
    pub timeout: Duration,
}

fn endpoint() -> Endpoint {
    // The URI only fills :authority; the connectors below do the dialing.
    Endpoint::from_static("http://konnectivity")
        .initial_stream_window_size(Some(4 * 1024 * 1024))
        .initial_connection_window_size(Some(16 * 1024 * 1024))
        .max_frame_size(Some(konnectivity_proto::H2_MAX_FRAME_SIZE))
}

impl Tunnel {
    /// Connects over a Unix socket (`--uds-name` of the server).
    pub async fn connect_uds(path: impl AsRef<Path>) -> Result<Tunnel, ConnectError> {
        let path = path.as_ref().to_owned();
        let closed = CancellationToken::new();
        let first = FirstConnection::new(&closed);
        let channel = endpoint()
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let path = path.clone();
                let first = first.clone();
                async move { Ok::<_, io::Error>(TokioIo::new(first.watch(UnixStream::connect(path).await?))) }
            }))
            .await?;
        Ok(Tunnel::new(channel, closed))
    }

    /// Connects over TCP with TLS; `tls` should carry a client certificate,
    /// since servers require mTLS on TCP frontends. ALPN is set to `h2`.
    pub async fn connect_tls(
        host: &str,
        port: u16,
        tls: Arc<rustls::ClientConfig>,
    ) -> Result<Tunnel, ConnectError> {
        Self::connect_tls_marked(host, port, tls, None, None).await
    }

    /// As [`Tunnel::connect_tls`], with `SO_MARK` on the TCP socket so that
    /// a node agent's own capture rules skip it (needs CAP_NET_ADMIN), and
    /// with `pings` watching it: a connection whose pings go unanswered
    /// fails its streams, which is how a client that resumes them learns of
    /// a silent link (without pings, a stream only waiting for data would
    /// wait forever), and [`Tunnel::closed`] says it is over.
    pub async fn connect_tls_marked(
        host: &str,
        port: u16,
        tls: Arc<rustls::ClientConfig>,
        mark: Option<u32>,
        pings: Option<Pings>,
    ) -> Result<Tunnel, ConnectError> {
        let mut tls = (*tls).clone();
        tls.alpn_protocols = vec![b"h2".to_vec()];
        let connector = TlsConnector::from(Arc::new(tls));
        let name = crate::net::server_name(host).map_err(|_| ConnectError::ServerName(host.to_owned()))?;
        let host = host.trim_matches(['[', ']']).to_owned();
        let mut endpoint = endpoint();
        if let Some(pings) = pings {
            endpoint = endpoint
                .http2_keep_alive_interval(pings.interval)
                .keep_alive_timeout(pings.timeout)
                .keep_alive_while_idle(true);
        }
        let closed = CancellationToken::new();
        let first = FirstConnection::new(&closed);
        let channel = endpoint
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let (connector, name, host) = (connector.clone(), name.clone(), host.clone());
                let first = first.clone();
                async move {
                    let tcp = crate::net::connect_marked(&host, port, mark).await?;
                    Ok::<_, io::Error>(TokioIo::new(first.watch(connector.connect(name, tcp).await?)))
                }
            }))
            .await?;
        Ok(Tunnel::new(channel, closed))
    }

    fn new(channel: Channel, closed: CancellationToken) -> Tunnel {
        Tunnel {
            client: ProxyServiceClient::new(channel),
            dial_timeout: Duration::from_secs(30),
            closed,
        }
    }

    /// Resolves once the connection this tunnel was made with is over: the
    /// server closed it, it failed, or its [`Pings`] went unanswered. (The
    /// channel under a tunnel dials again for the next stream; a caller that
    /// watches a connection replaces the tunnel instead.)
    pub async fn closed(&self) {
        self.closed.cancelled().await;
    }

    /// How long [`Tunnel::dial`] waits for the DIAL_RSP (default 30 s, the
    /// backstop upstream's client uses).
    pub fn with_dial_timeout(mut self, timeout: Duration) -> Tunnel {
        self.dial_timeout = timeout;
        self
    }

    /// Checks that the server still answers on this connection: opens a
    /// `Proxy` stream that asks for nothing and waits, up to `timeout`, for
    /// the server's response headers. It costs the server a stream that ends
    /// at once, and no agent anything. Reconnects the channel if it had dropped.
    ///
    /// The answer is the id the server named itself with (`serverid`), if it
    /// did: our node frontend does, so that a node agent knows which server
    /// of several behind one address a connection reached.
    pub async fn probe(&self, timeout: Duration) -> Result<Option<String>, DialError> {
        let mut client = self.client.clone();
        let call = client.proxy(tokio_stream::empty::<Packet>());
        match tokio::time::timeout(timeout, call).await {
            Ok(Ok(answered)) => Ok(answered
                .metadata()
                .get(konnectivity_proto::metadata::SERVER_ID)
                .and_then(|value| value.to_str().ok())
                .map(str::to_owned)),
            Ok(Err(status)) => Err(DialError::TunnelClosed(status.to_string())),
            Err(_) => Err(DialError::Timeout(timeout)),
        }
    }

    /// Opens a `Proxy` stream with extra request `headers`, whose body is
    /// `body`: the raw form [`Tunnel::dial`] builds on, for callers that
    /// speak our extensions (the node agent's resumable connections). The
    /// answer is the server's packets and its response headers.
    pub async fn open(
        &self,
        headers: Vec<(&'static str, AsciiMetadataValue)>,
        body: impl Stream<Item = Packet> + Send + 'static,
    ) -> Result<(Streaming<Packet>, MetadataMap), tonic::Status> {
        let mut request = tonic::Request::new(body);
        for (key, value) in headers {
            request.metadata_mut().insert(key, value);
        }
        let response = self.client.clone().proxy(request).await?;
        let headers = response.metadata().clone();
        Ok((response.into_inner(), headers))
    }

    /// Dials `address` (`host:port`) through the server and an agent.
    ///
    /// Dropping the returned future before it completes cancels the dial:
    /// the server gets DIAL_CLS and closes the agent's connection if it was
    /// already made.
    pub async fn dial(&self, address: &str) -> Result<TunnelStream, DialError> {
        let dial_id = DialId::random();
        let (outbound, outbound_rx) = mpsc::channel::<Packet>(OUTBOUND_QUEUE);
        let request = Frame::DialRequest {
            protocol: "tcp".to_owned(),
            address: address.into(),
            dial_id,
        };
        outbound.try_send(request.into()).expect("a fresh queue has room");
        let cancel = CancelOnDrop {
            outbound: &outbound,
            dial_id,
            armed: true,
        };
        let handshake = async {
            let response = self
                .client
                .clone()
                .proxy(ReceiverStream::new(outbound_rx))
                .await
                .map_err(|status| DialError::TunnelClosed(status.to_string()))?;
            let mut inbound = response.into_inner();
            let connect_id = dial_response(&mut inbound, dial_id).await?;
            Ok((connect_id, inbound))
        };
        let answer = tokio::time::timeout(self.dial_timeout, handshake).await;
        // Any answer ends the dial on the server; only a timeout leaves it
        // pending there and needs the DIAL_CLS.
        let mut cancel = cancel;
        cancel.armed = answer.is_err();
        drop(cancel);
        let (connect_id, inbound) = answer.map_err(|_| DialError::Timeout(self.dial_timeout))??;
        Ok(TunnelStream::new(connect_id, outbound, inbound))
    }
}

/// Reads the server's packets on a dial's stream up to the answer to
/// `dial_id`: the connection's id, or why there is none.
pub async fn dial_response(inbound: &mut Streaming<Packet>, dial_id: DialId) -> Result<ConnectId, DialError> {
    loop {
        let packet = inbound
            .message()
            .await
            .map_err(|status| DialError::TunnelClosed(status.to_string()))?
            .ok_or_else(|| DialError::TunnelClosed("stream ended before DIAL_RSP".to_owned()))?;
        match Frame::try_from(packet) {
            Ok(Frame::DialResponse { dial_id: id, result }) if id == dial_id => {
                return match result {
                    Ok(connect_id) => Ok(connect_id),
                    Err(error) if error == NO_AGENT => Err(DialError::NoAgent),
                    Err(error) => Err(DialError::Failed(error)),
                };
            }
            Ok(other) => tracing::warn!(kind = ?other.kind(), "unexpected packet before DIAL_RSP"),
            Err(error) => tracing::warn!(%error, "invalid packet before DIAL_RSP"),
        }
    }
}

/// Sends DIAL_CLS when a dial is abandoned (timeout, error, or the caller
/// dropping the future).
struct CancelOnDrop<'a> {
    outbound: &'a mpsc::Sender<Packet>,
    dial_id: DialId,
    armed: bool,
}

impl Drop for CancelOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.outbound.try_send(
                Frame::CloseDial {
                    dial_id: self.dial_id,
                }
                .into(),
            );
        }
    }
}

/// Hands the first connection a channel makes the token that says when it
/// is over; connections the channel dials later are not watched.
#[derive(Clone)]
struct FirstConnection {
    closed: Arc<std::sync::Mutex<Option<CancellationToken>>>,
}

impl FirstConnection {
    fn new(closed: &CancellationToken) -> FirstConnection {
        FirstConnection {
            closed: Arc::new(std::sync::Mutex::new(Some(closed.clone()))),
        }
    }

    fn watch<T>(&self, io: T) -> crate::net::Watched<T> {
        let token = self
            .closed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
            // A later connection: a token nobody waits on.
            .unwrap_or_default();
        crate::net::Watched::new(io, &token)
    }
}
