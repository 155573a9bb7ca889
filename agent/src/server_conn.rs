//! Opening one AgentService stream to a proxy-server: TCP, TLS (mTLS when
//! the agent has a certificate), HTTP/2, then the `Connect` call with our
//! identity in metadata and a bounded wait for the server's headers.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use hyper_util::rt::TokioIo;
use konnectivity_mux::outbound::Writer;
use konnectivity_mux::{Extensions, flow};
use konnectivity_proto::metadata::{
    AGENT_ID, AGENT_IDENTIFIERS, AGENT_INSTANCE, PROBE, RESUME, RESUME_TOKEN, RESUMED, SERVER_COUNT,
    SERVER_ID, instance_id,
};
use konnectivity_proto::wire::agent_service_client::AgentServiceClient;
use konnectivity_proto::{AgentIdentifiers, Packet, PacketType};
use tokio::sync::oneshot;
use tokio_rustls::TlsConnector;
use tonic::metadata::{AsciiMetadataValue, MetadataMap};

use crate::metrics::{AgentMetrics, Segment};
use tonic::transport::{Channel, Endpoint, Uri};
use tonic::{Request, Streaming};

/// The metadata key upstream agents send their ServiceAccount token under.
const AUTHORIZATION: &str = "authorization";

/// How long to wait for TCP + TLS + HTTP/2 set-up.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long to wait for the server's response headers. Upstream agents wait
/// forever; a server that accepts but never answers must not wedge us.
const HEADERS_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a probed server may take to answer before its connection is
/// given up. Generous: a busy server answers in milliseconds, and a false
/// alarm costs every tunnel on the connection.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub(crate) enum ConnectError {
    #[error("connecting to proxy-server {address}: {source}")]
    Transport {
        address: String,
        source: tonic::transport::Error,
    },
    #[error("connecting to proxy-server {address}: {source}")]
    Dial { address: String, source: io::Error },
    #[error("proxy-server {address} refused the agent stream: {status}")]
    Refused { address: String, status: tonic::Status },
    #[error("proxy-server {address} ({server_id}) refused to resume the agent's lost stream: {}", status.message())]
    ResumeRefused {
        address: String,
        server_id: String,
        status: tonic::Status,
    },
    #[error("proxy-server {address} sent no response headers within {limit:?}")]
    HeadersTimeout { address: String, limit: Duration },
    #[error("proxy-server {address} sent bad {key:?} metadata: {problem}")]
    BadMetadata {
        address: String,
        key: &'static str,
        problem: String,
    },
    #[error("reading the ServiceAccount token --service-account-token-path {path}: {source}", path = path.display())]
    TokenFile { path: PathBuf, source: io::Error },
    #[error("the ServiceAccount token in --service-account-token-path {path} is empty or not printable ASCII", path = path.display())]
    BadToken { path: PathBuf },
    #[error("invalid {what} for metadata: {value:?}")]
    BadOwnMetadata { what: &'static str, value: String },
}

/// Where and how to reach the server.
#[derive(Clone)]
pub(crate) struct ServerTarget {
    pub host: String,
    pub port: u16,
    pub tls: Arc<rustls::ClientConfig>,
    pub agent_id: String,
    pub identifiers: AgentIdentifiers,
    /// SO_MARK for the connection when the node role captures traffic.
    pub mark: Option<u32>,
    /// HTTP/2 ping interval (`--keepalive-time`); an unanswered ping ends the
    /// connection, so a half-dead server is left for a reconnect.
    pub keepalive: Option<Duration>,
    /// `--probe-interval`: how a server of ours is watched, by PINGs when
    /// it negotiated [`konnectivity_proto::ALPN_PINGS`], else by probes.
    pub probe_interval: Duration,
    /// `--service-account-token-path`, read afresh for every stream.
    pub token_path: Option<PathBuf>,
    /// `--resume-timeout` is not zero: offer resume (docs/resume.md).
    pub resume: bool,
    /// The one address of `host` to dial, when the agent dials each of a
    /// name's addresses (`--dial-every-address`); the certificate is still
    /// checked against `host`.
    pub resolved: Option<std::net::SocketAddr>,
}

/// An open AgentService stream.
pub(crate) struct ServerStream {
    pub server_id: String,
    pub server_count: u32,
    pub inbound: Streaming<Packet>,
    /// Takes the writer whose packets the stream sends (its session's).
    pub body: oneshot::Sender<Writer>,
    /// What the server agreed to beyond upstream's protocol: with flow
    /// control ([`flow`]) it is one of ours, which also answers probes.
    pub extensions: Extensions,
    /// With resume: the token that resumes this stream's session, when it
    /// is a new one.
    pub resume_token: Option<String>,
    /// The stream resumed the session of a token the agent offered.
    pub resumed: bool,
    /// The connection the stream runs on, for probes.
    pub channel: Channel,
    /// The connection is watched by PINGs every `--probe-interval`: the
    /// server negotiated [`konnectivity_proto::ALPN_PINGS`].
    pub pinged: bool,
}

/// A stream's request body: the packets of the writer its session hands
/// over once it has the stream (a new session, or one resuming). A stream
/// given up before that (a duplicate) ends with STREAM_END when `resume`
/// was negotiated, so the server does not keep it for a resume.
fn deferred_body(
    metrics: Arc<AgentMetrics>,
    resume: Arc<std::sync::atomic::AtomicBool>,
) -> (oneshot::Sender<Writer>, impl futures_util::Stream<Item = Packet>) {
    use futures_util::future::Either;
    let (body, writer) = oneshot::channel();
    let packets = futures_util::stream::once(writer)
        .flat_map(move |writer| match writer {
            Ok(writer) => Either::Left(writer),
            Err(_) => {
                let deliberate = resume.load(std::sync::atomic::Ordering::Acquire);
                Either::Right(futures_util::stream::iter(
                    deliberate.then(|| Packet::from(konnectivity_proto::Frame::StreamEnd)),
                ))
            }
        })
        .inspect(move |packet: &Packet| {
            if let Ok(kind) = PacketType::try_from(packet.r#type) {
                metrics.packet(Segment::FromAgent, kind);
            }
        });
    (body, packets)
}

/// What a probe learned: the connection answers, and the server's count now.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ProbeAnswer {
    pub server_count: u32,
}

impl ServerTarget {
    pub(crate) fn address(&self) -> String {
        let named = if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        };
        match self.resolved {
            Some(addr) if addr.ip().to_string() != self.host.trim_matches(['[', ']']) => {
                format!("{named} ({addr})")
            }
            _ => named,
        }
    }

    /// This target, dialed at `addr` (one of `host`'s addresses).
    pub(crate) fn at(&self, addr: std::net::SocketAddr) -> ServerTarget {
        ServerTarget {
            resolved: Some(addr),
            port: addr.port(),
            ..self.clone()
        }
    }

    /// Opens a stream on a new connection, offering the `resume_tokens` of
    /// lost streams; `metrics` counts the packets the agent sends on it.
    pub(crate) async fn connect(
        &self,
        metrics: &Arc<AgentMetrics>,
        resume_tokens: &[String],
    ) -> Result<ServerStream, ConnectError> {
        // Before dialing: without a token the server would refuse us anyway.
        let mut metadata = self.metadata(false).await?;
        if self.resume {
            metadata.insert(RESUME, AsciiMetadataValue::from_static("1"));
            if let Ok(instance) = AsciiMetadataValue::try_from(instance_id()) {
                metadata.insert(AGENT_INSTANCE, instance);
            }
            for token in resume_tokens {
                if let Ok(value) = AsciiMetadataValue::try_from(token.as_str()) {
                    metadata.append(RESUME_TOKEN, value);
                }
            }
        }
        let (channel, pinged) = self.dial().await?;
        let negotiated = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (body, packets) = deferred_body(metrics.clone(), negotiated.clone());
        let response = match self.call(&channel, metadata, packets, HEADERS_TIMEOUT).await {
            Err(ConnectError::Refused { address, status })
                if status.message().starts_with("resume refused") =>
            {
                let server_id = status
                    .metadata()
                    .get(SERVER_ID)
                    .and_then(|value| value.to_str().ok())
                    .unwrap_or_default()
                    .to_owned();
                return Err(ConnectError::ResumeRefused {
                    address,
                    server_id,
                    status,
                });
            }
            other => other?,
        };
        let headers = self.headers(response.metadata())?;
        let metadata = response.metadata();
        let resume_offered = self.resume && metadata.get(RESUME).is_some_and(|value| value == "1");
        let extensions = match headers.extensions {
            Extensions::FlowControl if resume_offered => Extensions::Resume,
            other => other,
        };
        let resume_token = metadata
            .get(RESUME_TOKEN)
            .filter(|_| resume_offered)
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned);
        let resumed = resume_offered && metadata.get(RESUMED).is_some_and(|value| value == "1");
        negotiated.store(extensions.resume(), std::sync::atomic::Ordering::Release);
        Ok(ServerStream {
            server_id: headers.server_id,
            server_count: headers.server_count,
            extensions,
            resume_token,
            resumed,
            inbound: response.into_inner(),
            body,
            channel,
            pinged,
        })
    }

    /// Checks that the server behind `channel` still answers, without a new
    /// connection: a probe stream gets the usual headers back and ends. Only
    /// for servers that negotiated flow control (ours); upstream servers
    /// would register the probe as an agent stream.
    pub(crate) async fn probe(&self, channel: &Channel) -> Result<ProbeAnswer, ConnectError> {
        let metadata = self.metadata(true).await?;
        let response = self
            .call(channel, metadata, tokio_stream::empty::<Packet>(), PROBE_TIMEOUT)
            .await?;
        let headers = self.headers(response.metadata())?;
        Ok(ProbeAnswer {
            server_count: headers.server_count,
        })
    }

    /// TCP, TLS and HTTP/2 to the server's address; and whether the
    /// connection is watched by PINGs every `--probe-interval`, which the
    /// TLS handshake tells (ALPN) before HTTP/2 is set up.
    async fn dial(&self) -> Result<(Channel, bool), ConnectError> {
        let address = self.address();
        let first = tokio::time::timeout(CONNECT_TIMEOUT, self.tls_connection())
            .await
            .unwrap_or_else(|_| {
                Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no TCP and TLS connection within {CONNECT_TIMEOUT:?}"),
                ))
            })
            .map_err(|source| ConnectError::Dial {
                address: address.clone(),
                source,
            })?;
        let pinged = first.get_ref().1.alpn_protocol() == Some(konnectivity_proto::ALPN_PINGS);
        // The URI only fills :authority; the connector below does the dialing.
        let authority = match self.host.contains(':') {
            true => format!("[{}]:{}", self.host.trim_matches(['[', ']']), self.port),
            false => format!("{}:{}", self.host, self.port),
        };
        let endpoint = Endpoint::from_shared(format!("http://{authority}"))
            .map_err(|source| ConnectError::Transport {
                address: address.clone(),
                source,
            })?
            .connect_timeout(CONNECT_TIMEOUT)
            .initial_stream_window_size(Some(8 * 1024 * 1024))
            .initial_connection_window_size(Some(16 * 1024 * 1024))
            .max_frame_size(Some(konnectivity_proto::H2_MAX_FRAME_SIZE));
        // Pings even while no tunnel is open: the stream itself must stay
        // alive. A server that welcomes them is pinged every probe interval
        // (or --keepalive-time, if shorter), and given the probe's 5 s.
        let pings = match (pinged, self.keepalive) {
            (true, keepalive) => Some((
                keepalive.map_or(self.probe_interval, |interval| interval.min(self.probe_interval)),
                PROBE_TIMEOUT,
            )),
            (false, Some(interval)) => {
                Some((interval, konnectivity_plumbing::net::keepalive_timeout(interval)))
            }
            (false, None) => None,
        };
        let endpoint = match pings {
            Some((interval, timeout)) => endpoint
                .http2_keep_alive_interval(interval)
                .keep_alive_timeout(timeout)
                .keep_alive_while_idle(true),
            None => endpoint,
        };
        // HTTP/2 runs on the connection just made; should the channel
        // need another (it dials again for a call after its connection
        // failed), it makes one the same way.
        let first = Arc::new(std::sync::Mutex::new(Some(first)));
        let target = self.clone();
        let channel = endpoint
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let first = first
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .take();
                let target = target.clone();
                async move {
                    let tls = match first {
                        Some(tls) => tls,
                        None => target.tls_connection().await?,
                    };
                    Ok::<_, io::Error>(TokioIo::new(tls))
                }
            }))
            .await
            .map_err(|source| ConnectError::Transport { address, source })?;
        Ok((channel, pinged))
    }

    /// TCP (marked, to the resolved address if there is one) and TLS.
    async fn tls_connection(&self) -> io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
        let name = konnectivity_client::net::server_name(&self.host)?;
        let tcp = match self.resolved {
            Some(addr) => {
                konnectivity_client::net::connect_marked(&addr.ip().to_string(), addr.port(), self.mark)
                    .await?
            }
            None => {
                konnectivity_client::net::connect_marked(
                    self.host.trim_matches(['[', ']']),
                    self.port,
                    self.mark,
                )
                .await?
            }
        };
        TlsConnector::from(self.tls.clone()).connect(name, tcp).await
    }

    /// The metadata of every stream we open: identity, identifiers, the
    /// flow-control offer, the token, and the probe marker for probes.
    async fn metadata(&self, probe: bool) -> Result<MetadataMap, ConnectError> {
        let mut metadata = MetadataMap::new();
        metadata.insert(
            AGENT_ID,
            self.agent_id.parse().map_err(|_| ConnectError::BadOwnMetadata {
                what: "--agent-id",
                value: self.agent_id.clone(),
            })?,
        );
        metadata.insert(flow::HEADER, AsciiMetadataValue::from_static(flow::VERSION));
        if !self.identifiers.is_empty() {
            let text = self.identifiers.to_string();
            metadata.insert(
                AGENT_IDENTIFIERS,
                text.parse().map_err(|_| ConnectError::BadOwnMetadata {
                    what: "--agent-identifiers",
                    value: text.clone(),
                })?,
            );
        }
        if let Some(path) = &self.token_path {
            metadata.insert(AUTHORIZATION, bearer(path).await?);
        }
        if probe {
            metadata.insert(PROBE, AsciiMetadataValue::from_static("1"));
        }
        Ok(metadata)
    }

    /// Calls `Connect` and waits up to `limit` for the server's headers.
    async fn call<S>(
        &self,
        channel: &Channel,
        metadata: MetadataMap,
        packets: S,
        limit: Duration,
    ) -> Result<tonic::Response<Streaming<Packet>>, ConnectError>
    where
        S: futures_util::Stream<Item = Packet> + Send + 'static,
    {
        let address = self.address();
        let mut request = Request::new(packets);
        *request.metadata_mut() = metadata;
        let mut client = AgentServiceClient::new(channel.clone());
        tokio::time::timeout(limit, client.connect(request))
            .await
            .map_err(|_| ConnectError::HeadersTimeout {
                address: address.clone(),
                limit,
            })?
            .map_err(|status| ConnectError::Refused { address, status })
    }

    fn headers(&self, metadata: &MetadataMap) -> Result<Headers, ConnectError> {
        let bad = |key, problem: &str| ConnectError::BadMetadata {
            address: self.address(),
            key,
            problem: problem.to_owned(),
        };
        let server_id = metadata
            .get(SERVER_ID)
            .ok_or_else(|| bad(SERVER_ID, "missing"))?
            .to_str()
            .map_err(|_| bad(SERVER_ID, "not ASCII"))?
            .to_owned();
        let server_count = match metadata.get(SERVER_COUNT) {
            None => 1,
            Some(value) => value
                .to_str()
                .ok()
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| bad(SERVER_COUNT, "not a number"))?,
        };
        let flow_control = metadata
            .get(flow::HEADER)
            .is_some_and(|value| value == flow::VERSION);
        Ok(Headers {
            server_id,
            server_count,
            extensions: match flow_control {
                true => Extensions::FlowControl,
                false => Extensions::Upstream,
            },
        })
    }
}

/// What a server's response headers say.
struct Headers {
    server_id: String,
    server_count: u32,
    extensions: Extensions,
}

/// `Bearer <token>` from the token file, as it is now.
async fn bearer(path: &Path) -> Result<AsciiMetadataValue, ConnectError> {
    let token = tokio::fs::read_to_string(path)
        .await
        .map_err(|source| ConnectError::TokenFile {
            path: path.to_owned(),
            source,
        })?;
    let token = token.trim();
    if token.is_empty() {
        return Err(ConnectError::BadToken {
            path: path.to_owned(),
        });
    }
    format!("Bearer {token}")
        .parse()
        .map_err(|_| ConnectError::BadToken {
            path: path.to_owned(),
        })
}
