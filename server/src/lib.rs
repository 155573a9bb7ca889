//! proxy-server: serves kube-apiserver's egress through connected agents.
//!
//! Reading order: [`config`] (flags), [`agent_service`] (agents connect),
//! [`backend`] (agent streams and routing), [`tunnel`] (a frontend's dial),
//! [`frontend`] (HTTP CONNECT and listeners), [`health`] and [`metrics`].

mod admission;
mod agent_service;
mod backend;
pub mod config;
mod frontend;
mod health;
mod identity;
mod leases;
mod metrics;
mod nodes;
mod policy;
mod serving;
mod token_auth;
mod tunnel;

/// What the fuzz targets and the integration tests reach inside the server:
/// an agent stream's session with its backend and registry, the frontends'
/// parsers and the flag-value parsers. Not an API: only with the
/// `test-hooks` feature, which the binary is never built with.
#[cfg(feature = "test-hooks")]
pub mod hooks {
    pub use crate::backend::registry::Registry;
    pub use crate::backend::resume::{Attachment, PeerIdentity, Resumption, Takeover};
    pub use crate::backend::session::Resume;
    pub use crate::backend::strategy::{Strategy, parse_strategies};
    pub use crate::backend::{Announced, Backend, BackendId, Command, Event, session};
    pub use crate::frontend::connect::{MAX_HEAD, parse_head};
    pub use crate::frontend::grpc::{resume_client_stream, serve_client, serve_resumable_client};
    pub use crate::frontend::resume::{ClientAttachment, ResponseBody};
    pub use crate::metrics::ServerMetrics;
    pub use crate::policy::{FrontendClass, parse_allowed};
    pub use crate::token_auth::CACHE_TTL as TOKEN_CACHE_TTL;
    pub use crate::tunnel::Dialer;
}

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use konnectivity_kube::KubeClient;
use konnectivity_plumbing::lifecycle::{self, Drained};
use konnectivity_plumbing::limit::Limit;
use konnectivity_plumbing::tls;
use konnectivity_proto::wire::agent_service_server::AgentServiceServer;

use crate::agent_service::AgentServer;
use crate::backend::registry::Registry;
use crate::config::{Config, FrontendListen};
use crate::health::ServerEndpoints;
use crate::metrics::ServerMetrics;
use crate::policy::FrontendClass;
use crate::token_auth::TokenAuthenticator;
use crate::tunnel::Dialer;

pub use crate::serving::ServeError;
use crate::serving::{bind_tcp, grpc_server, keepalive_with_resume, tls_incoming};

/// Binds the agent listener and returns its gRPC server, to be polled. It
/// keeps accepting while the frontends drain: their tunnels need agents.
async fn agent_server(
    config: &Config,
    kube: Option<&Arc<KubeClient>>,
    registry: Arc<Registry>,
    metrics: Arc<ServerMetrics>,
) -> Result<impl Future<Output = Result<(), tonic::transport::Error>> + Send + use<>, ServeError> {
    let listener = bind_tcp("agent listener (--agent-port)", config.agent_addr).await?;
    let tls = tls::server_config(
        &config.agent_identity,
        config.agent_client_ca.as_ref(),
        // Ours first: rustls picks by the server's order (docs/protocol.md).
        &[konnectivity_proto::ALPN_PINGS, b"h2"],
        &config.tls_offer,
    )?;
    let streams = tls_incoming(listener, tls, "agent", None);
    let auth = config.agent_auth.as_ref().map(|auth| {
        let kube = kube.expect("token authentication comes with a kube-apiserver");
        TokenAuthenticator::new(kube.clone(), auth.allowed.clone())
    });
    let admission = admission::Admission::new(
        config.identifiers_check,
        kube.cloned(),
        config.default_route_nodes.clone(),
        registry.clone(),
        metrics.clone(),
    );
    let service = AgentServer::new(config, registry, metrics, admission, auth).map_err(ServeError::Config)?;
    let keepalive = keepalive_with_resume(config.keepalive, config.agent_resume_timeout);
    Ok(grpc_server(keepalive)
        // Many tunneled connections share one agent stream: give it room.
        .initial_stream_window_size(Some(8 * 1024 * 1024))
        .initial_connection_window_size(Some(16 * 1024 * 1024))
        .max_frame_size(Some(konnectivity_proto::H2_MAX_FRAME_SIZE))
        .add_service(AgentServiceServer::new(service))
        .serve_with_incoming(streams))
}

/// Runs the server until `shutdown` resolves or a listener fails; then
/// drains the frontends (see [`drain_tunnels`]).
pub async fn run(config: Config, shutdown: impl Future<Output = ()>) -> Result<(), ServeError> {
    // Every frontend listener and connection watches this: shutting down
    // is triggering it and waiting for them (see `lifecycle`).
    let (trigger, watcher) = lifecycle::channel();
    let metrics = Arc::new(ServerMetrics::default());
    let registry = Arc::new(Registry::new(config.strategies.clone(), metrics.clone()));
    let health = bind_tcp("health listener (--health-port)", config.health_addr).await?;
    // One client, and so one connection (HTTP/2), for the TokenReviews,
    // the Leases and the Nodes.
    let kube = config
        .kube
        .clone()
        .map(|endpoint| Arc::new(KubeClient::new(endpoint)));
    let agent_server = agent_server(&config, kube.as_ref(), registry.clone(), metrics.clone()).await?;
    // Its own task: it outlives the select below, to end agent streams cleanly.
    let mut agent_server = tokio::spawn(agent_server);
    let agents = registry.clone();
    let dialer = Dialer {
        registry: registry.clone(),
        metrics: metrics.clone(),
        timeout: config.backend_dial_timeout,
        class: FrontendClass::Apiserver,
        node_allowed: Arc::new(Vec::new()),
        client_node: None,
        tunnel_limit: Limit::from_flag("max-tunnels-per-frontend", config.max_tunnels_per_frontend),
    };
    let node_task = frontend::start_node(&config, &dialer, &watcher).await?;
    let mut frontend_task = frontend::start(&config, dialer, &watcher).await?;
    // Health is served once every listener is bound: /healthz (or a
    // readiness probe) must not answer before clients can connect.
    let endpoints = Arc::new(ServerEndpoints {
        registry,
        metrics: metrics.clone(),
    });
    let admin_task = konnectivity_telemetry::http::bind_admin(config.admin_addr, "admin-port")
        .await
        .map(|admin| {
            let endpoints = Arc::new(konnectivity_telemetry::http::AdminEndpoints::new(
                endpoints.clone(),
                config.profiling,
            ));
            tokio::spawn(konnectivity_telemetry::http::serve(Arc::new(admin), endpoints))
        });
    let health_task = tokio::spawn(konnectivity_telemetry::http::serve(Arc::new(health), endpoints));
    // Published once clients can connect, as health is.
    let lease_controller = config.leases.as_ref().map(|settings| {
        let kube = kube
            .clone()
            .expect("the Lease controller comes with a kube-apiserver");
        leases::LeaseController::start(kube, settings, &config.server_id, metrics.clone())
    });
    // The one start-up line at -v=0 (the flags follow at -v=1).
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        server_id = %config.server_id,
        agent_addr = %config.agent_addr,
        health_addr = %config.health_addr,
        admin_addr = %config.admin_addr,
        frontend = %config.frontend,
        mode = ?config.mode,
        worker_threads = tokio::runtime::Handle::current().metrics().num_workers(),
        "proxy-server started"
    );

    let mut shut_down = false;
    let result = tokio::select! {
        () = shutdown => {
            shut_down = true;
            Ok(())
        }
        result = &mut agent_server => match result {
            Ok(result) => result.map_err(ServeError::AgentServer),
            Err(join) => Err(ServeError::Config(format!("agent server task failed: {join}"))),
        },
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
        drain_tunnels(trigger, &metrics, config.graceful_shutdown_timeout).await;
    }
    drop(frontend_task);
    drop(node_task);
    end_agent_streams(&agents).await;
    agent_server.abort();
    health_task.abort();
    if let Some(admin) = admin_task {
        admin.abort();
    }
    // Last, as upstream: agents keep counting this server while its
    // tunnels drain.
    if let Some(controller) = lease_controller {
        controller.stop().await;
    }
    result
}

/// Ends every agent stream cleanly and waits, briefly, for the agents to
/// close theirs: a stream cut by the exit would look lost to them, and they
/// would wait for a resume this process cannot give.
async fn end_agent_streams(registry: &Registry) {
    let ended = registry.end_streams();
    if ended == 0 {
        return;
    }
    tracing::info!(streams = ended, "ending agent streams");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
    while !registry.is_empty() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
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
