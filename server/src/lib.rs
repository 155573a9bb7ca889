//! proxy-server: serves kube-apiserver's egress through connected agents.
//!
//! Reading order: [`config`] (flags), [`agent_service`] (agents connect),
//! [`backend`] (agent streams and routing), [`tunnel`] (a frontend's dial),
//! [`frontend`] (HTTP CONNECT and listeners), [`health`] and [`metrics`].

pub mod agent_service;
pub mod backend;
pub mod config;
pub mod frontend;
pub mod health;
pub mod metrics;
pub mod policy;
pub mod token_auth;
pub mod tunnel;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use konnectivity_plumbing::kube::KubeClient;
use konnectivity_plumbing::lifecycle::{self, Drained, Watcher};
use konnectivity_plumbing::limit::Limit;
use konnectivity_plumbing::tls::{self, TlsError};
use konnectivity_proto::wire::agent_service_server::AgentServiceServer;
use konnectivity_proto::wire::proxy_service_server::ProxyServiceServer;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_stream::wrappers::ReceiverStream;

use crate::agent_service::AgentServer;
use crate::backend::registry::Registry;
use crate::config::{Config, FrontendListen, Mode, TlsVersions};
use crate::frontend::authority::TolerantAuthority;
use crate::frontend::grpc::ProxyServer;
use crate::frontend::{connect, listen};
use crate::health::ServerEndpoints;
use crate::metrics::ServerMetrics;
use crate::policy::FrontendClass;
use crate::token_auth::TokenAuthenticator;
use crate::tunnel::Dialer;

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

async fn bind_tcp(what: &'static str, addr: SocketAddr) -> Result<TcpListener, ServeError> {
    TcpListener::bind(addr).await.map_err(|source| ServeError::Bind {
        what,
        addr: addr.to_string(),
        source,
    })
}

/// TLS connections from `listener`, handshaken concurrently, as the
/// incoming stream a tonic server takes; with `stop`, it ends when the drain
/// is signalled.
fn tls_incoming(
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

/// Serves a gRPC frontend until the drain is signalled, then sends GOAWAY
/// on each connection and returns once they have all closed, holding the
/// drain until then.
async fn serve_grpc_frontend<IO>(
    server: tonic::transport::server::Router,
    incoming: impl futures_util::Stream<Item = Result<IO, std::io::Error>>,
    watcher: Watcher,
) -> Result<(), tonic::transport::Error>
where
    IO: tokio::io::AsyncRead
        + tokio::io::AsyncWrite
        + tonic::transport::server::Connected
        + Unpin
        + Send
        + 'static,
{
    server
        .serve_with_incoming_shutdown(incoming, watcher.signaled())
        .await
}

/// The gRPC frontend's server: ProxyService only, with windows sized for
/// bulk transfers on a single stream.
fn grpc_frontend(dialer: Dialer, keepalive: Option<Duration>) -> tonic::transport::server::Router {
    grpc_server(keepalive)
        .initial_stream_window_size(Some(4 * 1024 * 1024))
        .initial_connection_window_size(Some(16 * 1024 * 1024))
        .max_frame_size(Some(konnectivity_proto::H2_MAX_FRAME_SIZE))
        .add_service(ProxyServiceServer::new(ProxyServer::new(dialer)))
}

/// A gRPC server that pings its clients every `keepalive` and drops a
/// connection whose ping goes unanswered, so a half-dead peer (a frozen
/// agent, a vanished node) is noticed and its streams end.
fn grpc_server(keepalive: Option<Duration>) -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .http2_keepalive_interval(keepalive)
        .http2_keepalive_timeout(keepalive.map(konnectivity_plumbing::net::keepalive_timeout))
}

/// Runs the server until `shutdown` resolves or a listener fails.
pub async fn run(config: Config, shutdown: impl Future<Output = ()>) -> Result<(), ServeError> {
    // Every frontend listener and connection watches this: shutting down
    // is triggering it and waiting for them (see `lifecycle`).
    let (trigger, watcher) = lifecycle::channel();
    let metrics = Arc::new(ServerMetrics::default());
    let metrics_for_shutdown = metrics.clone();
    let registry = Arc::new(Registry::new(config.strategies.clone(), metrics.clone()));

    let tls13_only = config.tls_versions == TlsVersions::Tls13Only;
    let health = bind_tcp("health listener (--health-port)", config.health_addr).await?;
    let endpoints = Arc::new(ServerEndpoints {
        registry: registry.clone(),
        metrics: metrics.clone(),
    });

    let agent_listener = bind_tcp("agent listener (--agent-port)", config.agent_addr).await?;
    let agent_tls = tls::server_config(
        &config.agent_identity,
        config.agent_client_ca.as_ref(),
        &[b"h2"],
        tls13_only,
    )?;
    // Agents may still connect while the frontends drain: their tunnels need them.
    let agent_streams = tls_incoming(agent_listener, agent_tls, "agent", None);
    let agent_service = AgentServer::new(
        registry.clone(),
        metrics.clone(),
        &config.server_id,
        config.server_count,
        config.control_plane_agent_ids.clone(),
        config
            .agent_auth
            .as_ref()
            .map(|auth| TokenAuthenticator::new(KubeClient::new(auth.kube.clone()), auth.allowed.clone())),
    )
    .map_err(ServeError::Config)?;
    let agent_server = grpc_server(config.keepalive)
        // Many tunneled connections share one agent stream: give it room.
        .initial_stream_window_size(Some(8 * 1024 * 1024))
        .initial_connection_window_size(Some(16 * 1024 * 1024))
        .max_frame_size(Some(konnectivity_proto::H2_MAX_FRAME_SIZE))
        .add_service(AgentServiceServer::new(agent_service))
        .serve_with_incoming(agent_streams);

    let frontend_keepalive = config.frontend_keepalive;
    let dialer = Dialer {
        registry,
        metrics,
        timeout: config.backend_dial_timeout,
        class: FrontendClass::Apiserver,
        node_allowed: Arc::new(Vec::new()),
        tunnel_limit: Limit::from_flag("max-tunnels-per-frontend", config.max_tunnels_per_frontend),
    };
    let node_task = match &config.node_frontend {
        Some(node) => {
            let listener = bind_tcp("node frontend (--node-frontend-port)", node.addr).await?;
            let tls = tls::server_config(
                &config.agent_identity,
                Some(&node.client_ca),
                &[b"h2"],
                tls13_only,
            )?;
            let watcher = watcher.clone();
            let incoming = tls_incoming(listener, tls, "node frontend", Some(watcher.clone()));
            let node_dialer = Dialer {
                class: FrontendClass::Node,
                node_allowed: Arc::new(node.allowed.clone()),
                // Its own count: nodes cannot starve kube-apiserver of tunnels.
                tunnel_limit: Limit::from_flag("max-tunnels-per-frontend", config.max_tunnels_per_frontend),
                ..dialer.clone()
            };
            Some(tokio::spawn(async move {
                let server = grpc_frontend(node_dialer, frontend_keepalive);
                if let Err(error) = serve_grpc_frontend(server, incoming, watcher).await {
                    tracing::error!(%error, "node frontend failed");
                }
            }))
        }
        None => None,
    };
    let mut frontend_task = match (&config.mode, &config.frontend) {
        (
            Mode::HttpConnect,
            FrontendListen::Uds {
                path,
                delete_existing,
            },
        ) => {
            let listener = listen::bind_uds(path, *delete_existing)?;
            let watcher = watcher.clone();
            tokio::spawn(async move {
                listen::accept_uds(listener, watcher, move |stream| {
                    connect::serve(stream, dialer.clone())
                })
                .await;
                Ok(())
            })
        }
        (
            Mode::HttpConnect,
            FrontendListen::Tcp {
                addr,
                identity,
                client_ca,
            },
        ) => {
            let listener = bind_tcp("frontend (--server-port)", *addr).await?;
            let tls = tls::server_config(identity, Some(client_ca), &[b"http/1.1"], tls13_only)?;
            let watcher = watcher.clone();
            tokio::spawn(async move {
                listen::accept_tls(listener, Arc::new(tls), watcher, move |stream| {
                    connect::serve(stream, dialer.clone())
                })
                .await;
                Ok(())
            })
        }
        (
            Mode::Grpc,
            FrontendListen::Uds {
                path,
                delete_existing,
            },
        ) => {
            let listener = listen::bind_uds(path, *delete_existing)?;
            // grpc-go names the socket path as :authority; see the module.
            let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener)
                .map(|stream| stream.map(TolerantAuthority::new));
            let server = grpc_frontend(dialer, frontend_keepalive);
            tokio::spawn(serve_grpc_frontend(server, incoming, watcher.clone()))
        }
        (
            Mode::Grpc,
            FrontendListen::Tcp {
                addr,
                identity,
                client_ca,
            },
        ) => {
            let listener = bind_tcp("frontend (--server-port)", *addr).await?;
            let tls = tls::server_config(identity, Some(client_ca), &[b"h2"], tls13_only)?;
            let incoming = tls_incoming(listener, tls, "frontend", Some(watcher.clone()));
            let server = grpc_frontend(dialer, frontend_keepalive);
            tokio::spawn(serve_grpc_frontend(server, incoming, watcher.clone()))
        }
    };
    // Health is served once every listener is bound: /healthz (or a
    // readiness probe) must not answer before clients can connect.
    let health_task = tokio::spawn(konnectivity_plumbing::http::serve(health, endpoints));
    tracing::info!(
        server_id = %config.server_id,
        agent_addr = %config.agent_addr,
        health_addr = %config.health_addr,
        frontend = ?config.frontend,
        "proxy-server started"
    );

    let mut shut_down = false;
    let result = tokio::select! {
        () = shutdown => {
            shut_down = true;
            Ok(())
        }
        result = agent_server => result.map_err(ServeError::AgentServer),
        result = &mut frontend_task => match result {
            Ok(result) => result.map_err(ServeError::FrontendServer),
            Err(join) => Err(ServeError::Config(format!("frontend task failed: {join}"))),
        },
    };
    // Only the frontends' tasks hold the drain from here on.
    drop(watcher);
    // Stop accepting: new clients are refused (the listening sockets close,
    // the socket file goes, gRPC clients get GOAWAY), while the tunnels
    // already open run on until they end.
    trigger.signal();
    if let FrontendListen::Uds { path, .. } = &config.frontend {
        let _ = std::fs::remove_file(path);
    }
    if shut_down && !config.graceful_shutdown_timeout.is_zero() {
        drain_tunnels(trigger, &metrics_for_shutdown, config.graceful_shutdown_timeout).await;
    }
    drop(frontend_task);
    drop(node_task);
    health_task.abort();
    result
}

/// Waits until every frontend connection has ended (and with it its
/// tunnel), or `limit` passed; what is still open then is cut when the
/// process exits.
async fn drain_tunnels(trigger: lifecycle::Trigger, metrics: &ServerMetrics, limit: Duration) {
    tracing::info!(
        tunnels = metrics.established_connections.get(),
        dials = metrics.pending_backend_dials.get(),
        ?limit,
        "waiting for open tunnels to end (--graceful-shutdown-timeout)"
    );
    match trigger.drain(limit).await {
        Drained::Complete => tracing::info!("all tunnels ended"),
        Drained::TimedOut { remaining } => tracing::warn!(
            connections = remaining,
            tunnels = metrics.established_connections.get(),
            "graceful shutdown timeout reached; cutting open tunnels"
        ),
    }
}
