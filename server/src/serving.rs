//! What every listener of the server shares: the error that stops it,
//! binding TCP, TLS handshakes made concurrently, and the gRPC server's
//! keepalive.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use konnectivity_plumbing::lifecycle::Watcher;
use konnectivity_plumbing::tls::{self, TlsError};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_stream::wrappers::ReceiverStream;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot listen on {addr} for the {what}: {source}")]
    Bind {
        what: &'static str,
        addr: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("{0}")]
    Config(String),
    #[error("agent gRPC server failed: {0}")]
    AgentServer(tonic::transport::Error),
    #[error("frontend gRPC server failed: {0}")]
    FrontendServer(tonic::transport::Error),
}

impl ServeError {
    /// Whether the server could not start (what an operator fixes in the
    /// manifest), rather than failing while it ran.
    pub fn at_start_up(&self) -> bool {
        matches!(
            self,
            ServeError::Bind { .. } | ServeError::Tls(_) | ServeError::Config(_)
        )
    }
}

pub(crate) async fn bind_tcp(what: &'static str, addr: SocketAddr) -> Result<TcpListener, ServeError> {
    TcpListener::bind(addr).await.map_err(|source| ServeError::Bind {
        what,
        addr: addr.to_string(),
        source,
    })
}

/// TLS connections from `listener`, handshaken concurrently, as the
/// incoming stream a tonic server takes; with `stop`, it ends when the drain
/// is signalled.
pub(crate) fn tls_incoming(
    listener: TcpListener,
    tls: rustls::ServerConfig,
    what: &'static str,
    stop: Option<Watcher>,
) -> impl futures_util::Stream<Item = Result<tokio_rustls::server::TlsStream<tokio::net::TcpStream>, std::io::Error>>
{
    ReceiverStream::new(tls::accept_tls(
        listener,
        TlsAcceptor::from(Arc::new(tls)),
        what,
        stop,
    ))
    .map(Ok)
}

/// A gRPC server that pings its clients every `keepalive` and drops a
/// connection whose ping goes unanswered, so a half-dead peer (a frozen
/// agent, a vanished node) is noticed and its streams end.
/// How often the connections of peers that resume are pinged; an unanswered
/// ping ends the connection after as long again, so a silent peer is
/// noticed within 10 s.
const RESUME_PING: Duration = Duration::from_secs(5);

/// The keepalive of a listener whose peers may resume (agents, node
/// tunnels): a silent peer (its link gone, its node frozen) must be noticed
/// within seconds, not at the hour-long keepalive, so that its connections
/// wait for a resume rather than for TCP (docs/resume.md).
pub(crate) fn keepalive_with_resume(
    configured: Option<Duration>,
    resume_timeout: Duration,
) -> Option<Duration> {
    match resume_timeout.is_zero() {
        true => configured,
        false => Some(configured.map_or(RESUME_PING, |interval| interval.min(RESUME_PING))),
    }
}

/// The names of the client certificate a gRPC request's TLS connection
/// presented (empty on a Unix socket, or without one).
pub(crate) fn peer_certificate_names<T>(request: &tonic::Request<T>) -> Vec<String> {
    use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
    request
        .extensions()
        .get::<TlsConnectInfo<TcpConnectInfo>>()
        .and_then(TlsConnectInfo::peer_certs)
        .and_then(|certs| certs.first().map(|cert| tls::certificate_names(cert)))
        .unwrap_or_default()
}

pub(crate) fn grpc_server(keepalive: Option<Duration>) -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .http2_keepalive_interval(keepalive)
        .http2_keepalive_timeout(keepalive.map(konnectivity_plumbing::net::keepalive_timeout))
}
