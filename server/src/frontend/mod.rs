//! Frontends: where kube-apiserver (or any tunnel client) connects.

mod authority;
pub(crate) mod connect;
pub(crate) mod grpc;
pub(crate) mod listen;
pub(crate) mod node_clients;
pub(crate) mod preface;
pub(crate) mod resume;
pub(crate) mod stream;

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use konnectivity_plumbing::lifecycle::Watcher;
use konnectivity_plumbing::limit::Limit;
use konnectivity_plumbing::tls;
use konnectivity_proto::wire::proxy_service_server::ProxyServiceServer;
use tokio::task::JoinHandle;

use crate::backend::resume::Resumption;
use crate::config::{Config, FrontendListen, Mode};
use crate::policy::FrontendClass;
use crate::serving::{ServeError, bind_tcp, grpc_server, keepalive_with_resume, tls_incoming};
use crate::tunnel::Dialer;
use authority::RefuseUnparsedAuthorityLayer;
use preface::RequireHttp2;

/// The frontend's listening socket, bound before anything is served.
enum Bound {
    Uds(tokio::net::UnixListener),
    /// With the TLS configuration for `--mode`'s ALPN protocol.
    Tls(tokio::net::TcpListener, Box<rustls::ServerConfig>),
}

/// What a frontend's task returns: only a gRPC server can fail once running.
pub(crate) type FrontendTask = JoinHandle<Result<(), tonic::transport::Error>>;

/// Binds kube-apiserver's frontend (`--mode`, and `--uds-name` or
/// `--server-port`) and serves it on a task of its own until `watcher`'s
/// drain is signalled and its connections have ended.
pub(crate) async fn start(
    config: &Config,
    dialer: Dialer,
    watcher: &Watcher,
) -> Result<FrontendTask, ServeError> {
    let keepalive = config.frontend_keepalive;
    let watcher = watcher.clone();
    let bound = match &config.frontend {
        FrontendListen::Uds {
            path,
            delete_existing,
        } => Bound::Uds(listen::bind_uds(path, *delete_existing)?),
        FrontendListen::Tcp {
            addr,
            identity,
            client_ca,
        } => {
            let alpn: &[&[u8]] = match config.mode {
                Mode::HttpConnect => &[b"http/1.1"],
                Mode::Grpc => &[b"h2"],
            };
            let listener = bind_tcp("frontend (--server-port)", *addr).await?;
            let tls = tls::server_config(identity, Some(client_ca), alpn, &config.tls_offer)?;
            Bound::Tls(listener, Box::new(tls))
        }
    };
    let task = match (&config.mode, bound) {
        (Mode::HttpConnect, Bound::Uds(listener)) => {
            let serve = move |stream, hold| connect::serve(stream, dialer.clone(), hold);
            tokio::spawn(async move {
                listen::accept_uds(listener, watcher, serve).await;
                Ok(())
            })
        }
        (Mode::HttpConnect, Bound::Tls(listener, tls)) => {
            let serve = move |stream, hold| connect::serve(stream, dialer.clone(), hold);
            tokio::spawn(async move {
                listen::accept_tls(listener, Arc::new(*tls), watcher, serve).await;
                Ok(())
            })
        }
        (Mode::Grpc, Bound::Uds(listener)) => {
            // grpc-go names the socket path as :authority; see `authority`.
            let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener)
                .map(|stream| stream.map(RequireHttp2::new));
            let server = grpc_frontend(dialer, keepalive, Authority::AnyOnTheSocket, None);
            tokio::spawn(serve_grpc(server, incoming, watcher))
        }
        (Mode::Grpc, Bound::Tls(listener, tls)) => {
            let incoming = tls_incoming(listener, *tls, "frontend", Some(watcher.clone()))
                .map(|stream| stream.map(RequireHttp2::new));
            let server = grpc_frontend(dialer, keepalive, Authority::WellFormed, None);
            tokio::spawn(serve_grpc(server, incoming, watcher))
        }
    };
    Ok(task)
}

/// Binds the node frontend (`--node-frontend-port`), when configured: gRPC
/// over mTLS, with a dialer of its own class, policy and tunnel count.
pub(crate) async fn start_node(
    config: &Config,
    dialer: &Dialer,
    watcher: &Watcher,
) -> Result<Option<JoinHandle<()>>, ServeError> {
    let Some(node) = &config.node_frontend else {
        return Ok(None);
    };
    let listener = bind_tcp("node frontend (--node-frontend-port)", node.addr).await?;
    let tls = tls::server_config(
        &config.agent_identity,
        Some(&node.client_ca),
        &[b"h2"],
        &config.tls_offer,
    )?;
    let incoming = tls_incoming(listener, tls, "node frontend", Some(watcher.clone()));
    let node_dialer = Dialer {
        class: FrontendClass::Node,
        node_allowed: Arc::new(node.allowed.clone()),
        // Set per stream, from its certificate (grpc::ProxyServer).
        client_node: None,
        // Its own count: nodes cannot starve kube-apiserver of tunnels.
        tunnel_limit: Limit::from_flag("max-tunnels-per-frontend", config.max_tunnels_per_frontend),
        ..dialer.clone()
    };
    // A node tunnel's streams may resume (resume::StreamResume); the
    // agents' streams and theirs share one timeout.
    let resumption = (!config.agent_resume_timeout.is_zero())
        .then(|| Resumption::new(config.agent_resume_timeout, &config.server_id));
    let keepalive = keepalive_with_resume(config.frontend_keepalive, config.agent_resume_timeout);
    let server = grpc_frontend(node_dialer, keepalive, Authority::WellFormed, resumption);
    let watcher = watcher.clone();
    Ok(Some(tokio::spawn(async move {
        if let Err(error) = serve_grpc(server, incoming, watcher).await {
            tracing::error!(%error, "node frontend failed");
        }
    })))
}

/// Which `:authority` a gRPC frontend takes (see `authority`).
enum Authority {
    /// Whatever the client sends: a Unix socket names nothing.
    AnyOnTheSocket,
    /// A URI authority, as over TLS.
    WellFormed,
}

/// A gRPC frontend's server, with its `:authority` check.
type GrpcFrontend = tonic::transport::server::Router<
    tower::layer::util::Stack<RefuseUnparsedAuthorityLayer, tower::layer::util::Identity>,
>;

/// The gRPC frontend's server: ProxyService only, with windows sized for
/// bulk transfers on a single stream.
fn grpc_frontend(
    dialer: Dialer,
    keepalive: Option<Duration>,
    authority: Authority,
    resumption: Option<Arc<Resumption<resume::ClientAttachment>>>,
) -> GrpcFrontend {
    let pending_resets = matches!(dialer.class, FrontendClass::Node).then_some(NODE_PENDING_RESETS);
    grpc_server(keepalive)
        .http2_max_pending_accept_reset_streams(pending_resets)
        .layer(RefuseUnparsedAuthorityLayer {
            refuse: matches!(authority, Authority::WellFormed),
        })
        .initial_stream_window_size(Some(4 * 1024 * 1024))
        .initial_connection_window_size(Some(16 * 1024 * 1024))
        .max_frame_size(Some(konnectivity_proto::H2_MAX_FRAME_SIZE))
        .add_service(ProxyServiceServer::new(grpc::ProxyServer::new(
            dialer, resumption,
        )))
}

/// How many streams a node may cancel before the server has taken them, at
/// once, before h2 takes it for a rapid-reset attack and closes its
/// connection (h2's own limit is 20). A node's tunnel carries every
/// connection of its clients; while the server is slow to take new streams
/// (a busy machine, a storm of reconnecting nodes), the node agent cancels
/// those its clients gave up, and at 20 the 5,000-node runs lost whole node
/// tunnels 3–7 times a run. The peers are nodes that proved who they are;
/// what a cancelled stream holds until it is taken is h2's record of it.
const NODE_PENDING_RESETS: usize = 1_000;

/// Serves a gRPC frontend until the drain is signalled, then sends GOAWAY
/// on each connection and returns once they have all closed, holding the
/// drain until then.
async fn serve_grpc<IO>(
    server: GrpcFrontend,
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
