//! Opening one AgentService stream to a proxy-server: TCP, TLS (mTLS when
//! the agent has a certificate), HTTP/2, then the `Connect` call with our
//! identity in metadata and a bounded wait for the server's headers.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use hyper_util::rt::TokioIo;
use konnectivity_proto::metadata::{AGENT_ID, AGENT_IDENTIFIERS, SERVER_COUNT, SERVER_ID};
use konnectivity_proto::wire::agent_service_client::AgentServiceClient;
use konnectivity_proto::{AgentIdentifiers, Packet, PacketType, flow};
use tokio::sync::mpsc;
use tokio_rustls::TlsConnector;
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::AsciiMetadataValue;

use crate::metrics::{AgentMetrics, Segment};
use tonic::transport::{Endpoint, Uri};
use tonic::{Request, Streaming};

/// The metadata key upstream agents send their ServiceAccount token under.
const AUTHORIZATION: &str = "authorization";

/// How long to wait for TCP + TLS + HTTP/2 set-up.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long to wait for the server's response headers. Upstream agents wait
/// forever; a server that accepts but never answers must not wedge us.
const HEADERS_TIMEOUT: Duration = Duration::from_secs(10);
/// Packets queued towards the server on one stream.
const OUTBOUND_QUEUE: usize = 256;

#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("connecting to proxy-server {address}: {source}")]
    Transport {
        address: String,
        source: tonic::transport::Error,
    },
    #[error("proxy-server {address} refused the agent stream: {status}")]
    Refused { address: String, status: tonic::Status },
    #[error("proxy-server {address} sent no response headers within {HEADERS_TIMEOUT:?}")]
    HeadersTimeout { address: String },
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
pub struct ServerTarget {
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
    /// `--service-account-token-path`, read afresh for every stream.
    pub token_path: Option<PathBuf>,
}

/// An open AgentService stream.
pub struct ServerStream {
    pub server_id: String,
    pub server_count: u32,
    pub inbound: Streaming<Packet>,
    pub outbound: mpsc::Sender<Packet>,
    /// The server agreed to per-connection flow control ([`flow`]).
    pub flow_control: bool,
}

impl ServerTarget {
    pub fn address(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// Opens a stream; `metrics` counts the packets the agent sends on it.
    pub async fn connect(&self, metrics: &Arc<AgentMetrics>) -> Result<ServerStream, ConnectError> {
        let address = self.address();
        // Before dialing: without a token the server would refuse us anyway.
        let authorization = match &self.token_path {
            Some(path) => Some(bearer(path).await?),
            None => None,
        };
        let host = self.host.clone();
        let port = self.port;
        let mark = self.mark;
        let connector = TlsConnector::from(self.tls.clone());
        // The URI only fills :authority; the connector below does the dialing.
        let endpoint = Endpoint::from_shared(format!("http://{address}"))
            .map_err(|source| ConnectError::Transport {
                address: address.clone(),
                source,
            })?
            .connect_timeout(CONNECT_TIMEOUT)
            .initial_stream_window_size(Some(8 * 1024 * 1024))
            .initial_connection_window_size(Some(16 * 1024 * 1024))
            .max_frame_size(Some(konnectivity_proto::H2_MAX_FRAME_SIZE));
        let endpoint = match self.keepalive {
            // Pings even while no tunnel is open: the stream itself must stay alive.
            Some(interval) => endpoint
                .http2_keep_alive_interval(interval)
                .keep_alive_timeout(konnectivity_plumbing::net::keepalive_timeout(interval))
                .keep_alive_while_idle(true),
            None => endpoint,
        };
        let channel = endpoint
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let host = host.clone();
                let connector = connector.clone();
                async move {
                    let name = konnectivity_plumbing::tls::server_name(&host)?;
                    let tcp =
                        konnectivity_plumbing::net::connect_marked(host.trim_matches(['[', ']']), port, mark)
                            .await?;
                    let tls = connector.connect(name, tcp).await?;
                    Ok::<_, io::Error>(TokioIo::new(tls))
                }
            }))
            .await
            .map_err(|source| ConnectError::Transport {
                address: address.clone(),
                source,
            })?;

        let (outbound, outbound_rx) = mpsc::channel(OUTBOUND_QUEUE);
        let sent = metrics.clone();
        let packets = ReceiverStream::new(outbound_rx).inspect(move |packet: &Packet| {
            if let Ok(kind) = PacketType::try_from(packet.r#type) {
                sent.packet(Segment::FromAgent, kind);
            }
        });
        let mut request = Request::new(packets);
        let metadata = request.metadata_mut();
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
        if let Some(authorization) = authorization {
            metadata.insert(AUTHORIZATION, authorization);
        }
        let mut client = AgentServiceClient::new(channel);
        let response = tokio::time::timeout(HEADERS_TIMEOUT, client.connect(request))
            .await
            .map_err(|_| ConnectError::HeadersTimeout {
                address: address.clone(),
            })?
            .map_err(|status| ConnectError::Refused {
                address: address.clone(),
                status,
            })?;
        let bad = |key, problem: &str| ConnectError::BadMetadata {
            address: address.clone(),
            key,
            problem: problem.to_owned(),
        };
        let server_id = response
            .metadata()
            .get(SERVER_ID)
            .ok_or_else(|| bad(SERVER_ID, "missing"))?
            .to_str()
            .map_err(|_| bad(SERVER_ID, "not ASCII"))?
            .to_owned();
        let server_count = match response.metadata().get(SERVER_COUNT) {
            None => 1,
            Some(value) => value
                .to_str()
                .ok()
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| bad(SERVER_COUNT, "not a number"))?,
        };
        let flow_control = response
            .metadata()
            .get(flow::HEADER)
            .is_some_and(|value| value == flow::VERSION);
        Ok(ServerStream {
            server_id,
            server_count,
            flow_control,
            inbound: response.into_inner(),
            outbound,
        })
    }
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
