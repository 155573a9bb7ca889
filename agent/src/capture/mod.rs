//! The node role: transparent capture of node processes' connections to the
//! API server's service VIP, tunneled to a control-plane agent.
//!
//! [`map`] says what is captured, [`nft`] installs the REDIRECT rules,
//! [`listener`] accepts and tunnels the captured connections.

pub mod listener;
pub mod map;
pub mod nft;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use konnectivity_client::Tunnel;
use tokio::net::TcpListener;
use tokio::sync::watch;

use self::listener::CaptureContext;
use self::map::CaptureMap;
use crate::Backoff;
use crate::cni::pods::{PodSettings, Pods};
use crate::metrics::AgentMetrics;

/// Everything the node role needs from the agent's configuration.
#[derive(Clone)]
pub struct NodeSettings {
    pub captures: CaptureMap,
    pub capture_port: u16,
    pub mark: u32,
    pub server_host: String,
    pub node_frontend_port: u16,
    pub tls: Arc<rustls::ClientConfig>,
    pub sync_interval: Duration,
    pub sync_interval_cap: Duration,
    /// Pod capture: the CNI socket and the state directory.
    pub cni: Option<CniSettings>,
}

#[derive(Clone, Debug)]
pub struct CniSettings {
    pub socket: std::path::PathBuf,
    pub state_dir: std::path::PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    #[error("installing the capture rules: {0}")]
    Rules(#[from] nft::NftError),
    #[error("cannot listen on {addr} for captured connections (--capture-port): {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot listen on the CNI socket {path} (--cni-socket): {source}")]
    CniSocket { path: String, source: std::io::Error },
    #[error(transparent)]
    Pods(#[from] crate::cni::pods::PodError),
}

/// Readiness of the node role: rules installed and the tunnel connected.
#[derive(Default)]
pub struct NodeReadiness {
    pub rules_installed: AtomicBool,
    pub tunnel_connected: AtomicBool,
}

impl NodeReadiness {
    pub fn is_ready(&self) -> bool {
        self.rules_installed.load(Ordering::Relaxed) && self.tunnel_connected.load(Ordering::Relaxed)
    }
}

/// Installs the rules, opens the capture listeners and keeps the node
/// tunnel; runs until dropped. The rules stay when the process dies, so a
/// restarted agent resumes capturing; [`remove_rules`] takes them away on a
/// clean shutdown.
pub async fn run(
    settings: NodeSettings,
    metrics: Arc<AgentMetrics>,
    readiness: Arc<NodeReadiness>,
) -> Result<(), CaptureError> {
    // REDIRECT in the output hook sends to the loopback address of the family.
    let mut addrs = vec![SocketAddr::new(
        IpAddr::V4(Ipv4Addr::LOCALHOST),
        settings.capture_port,
    )];
    if settings.captures.entries().iter().any(|c| c.vip.is_ipv6()) {
        addrs.push(SocketAddr::new(
            IpAddr::V6(Ipv6Addr::LOCALHOST),
            settings.capture_port,
        ));
    }
    let mut listeners = Vec::new();
    for addr in addrs {
        listeners.push(
            TcpListener::bind(addr)
                .await
                .map_err(|source| CaptureError::Listen { addr, source })?,
        );
    }
    let ruleset = nft::render(&settings.captures, settings.capture_port, settings.mark);
    tokio::task::spawn_blocking(move || nft::apply(&ruleset))
        .await
        .expect("nft task does not panic")?;
    readiness.rules_installed.store(true, Ordering::Relaxed);
    tracing::info!(port = settings.capture_port, captures = ?settings.captures.entries(), "capture rules installed");

    let (tunnel_tx, tunnel_rx) = watch::channel(None);
    let context = Arc::new(CaptureContext {
        map: settings.captures.clone(),
        tunnel: tunnel_rx,
        metrics,
    });
    let mut tasks = tokio::task::JoinSet::new();
    for listener in listeners {
        tasks.spawn(listener::serve(listener, context.clone()));
    }
    if let Some(cni) = &settings.cni {
        let pods = Arc::new(Pods::new(
            PodSettings {
                ruleset: nft::render(&settings.captures, settings.capture_port, settings.mark),
                capture_port: settings.capture_port,
                ipv6: settings.captures.entries().iter().any(|c| c.vip.is_ipv6()),
                state_dir: cni.state_dir.clone(),
                // The agent runs in the host's network namespace (hostNetwork).
                host_netns: "/proc/self/ns/net".into(),
            },
            context.clone(),
        )?);
        pods.restore().await;
        let socket = crate::cni::server::bind(&cni.socket).map_err(|source| CaptureError::CniSocket {
            path: cni.socket.display().to_string(),
            source,
        })?;
        tracing::info!(socket = %cni.socket.display(), "CNI socket open");
        tasks.spawn(crate::cni::server::serve(socket, pods, readiness.clone()));
    }
    tasks.spawn(keep_tunnel(settings, tunnel_tx, readiness));
    while tasks.join_next().await.is_some() {}
    Ok(())
}

/// Connects the node tunnel, retrying with the agent's backoff. Once made,
/// the HTTP/2 channel re-establishes itself when the connection drops.
async fn keep_tunnel(
    settings: NodeSettings,
    tunnel: watch::Sender<Option<Tunnel>>,
    readiness: Arc<NodeReadiness>,
) {
    let mut backoff = Backoff::new(settings.sync_interval, settings.sync_interval_cap);
    loop {
        match Tunnel::connect_tls_marked(
            &settings.server_host,
            settings.node_frontend_port,
            settings.tls.clone(),
            Some(settings.mark),
        )
        .await
        {
            Ok(connected) => {
                tracing::info!(server = %settings.server_host, port = settings.node_frontend_port, "node tunnel connected");
                let _ = tunnel.send(Some(connected.with_dial_timeout(Duration::from_secs(10))));
                readiness.tunnel_connected.store(true, Ordering::Relaxed);
                return;
            }
            Err(error) => {
                tracing::warn!(error = %konnectivity_plumbing::error_chain(&error), "cannot connect the node tunnel");
            }
        }
        tokio::time::sleep(backoff.next_delay()).await;
    }
}

/// Removes the capture rules (clean shutdown).
pub fn remove_rules() -> Result<(), nft::NftError> {
    nft::remove()
}
