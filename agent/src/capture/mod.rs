//! The node role: transparent capture of node processes' connections to the
//! API server's service VIP, tunneled to a control-plane agent.
//!
//! The whole capture subsystem lives here: [`map`] says what is captured,
//! [`nft`] renders and installs the REDIRECT rules (on the host and in each
//! pod), [`listener`] accepts and tunnels the captured connections,
//! [`pods`] keeps the captured pods (and enrols those the runtime recorded on
//! our network), [`cni_socket`] answers the konnectivity-cni plugin, and
//! [`netns`] enters pod namespaces. Installing the plugin on a node is
//! `crate::cni`, which needs none of this.

mod cni_cache;
mod cni_socket;
mod listener;
pub(crate) mod map;
mod netns;
mod nft;
mod pods;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use konnectivity_client::Tunnel;
use tokio::net::TcpListener;
use tokio::sync::watch;

use self::listener::CaptureContext;
use self::map::CaptureMap;
use self::pods::{PodSettings, Pods};
use crate::Backoff;
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
    /// `--pod-netns-dir`; `None` when empty.
    pub netns_dir: Option<std::path::PathBuf>,
    /// `--cni-cache-dir`; `None` when empty.
    pub cni_cache_dir: Option<std::path::PathBuf>,
    /// `--cni-conf-dir`.
    pub cni_conf_dir: std::path::PathBuf,
    /// `--exclude-namespaces`.
    pub exclude_namespaces: Vec<String>,
}

/// How often captured pods are checked for a namespace that went away, and
/// the runtime's pods for one that is not captured.
const POD_SWEEP_INTERVAL: Duration = Duration::from_secs(5);

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
    Pods(#[from] pods::PodError),
}

/// Readiness of the node role: rules installed and the tunnel answering.
#[derive(Default)]
pub struct NodeReadiness {
    pub rules_installed: AtomicBool,
    pub tunnel_connected: AtomicBool,
    /// Why the tunnel is not answering, for `/readyz`.
    tunnel_problem: std::sync::Mutex<String>,
}

impl NodeReadiness {
    pub fn is_ready(&self) -> bool {
        self.rules_installed.load(Ordering::Relaxed) && self.tunnel_connected.load(Ordering::Relaxed)
    }

    /// What is missing, in words, when not ready.
    pub fn problem(&self) -> String {
        if !self.rules_installed.load(Ordering::Relaxed) {
            return "capture rules not installed yet".to_owned();
        }
        let problem = self
            .tunnel_problem
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if problem.is_empty() {
            "node tunnel not connected yet".to_owned()
        } else {
            format!("node tunnel down: {problem}")
        }
    }

    fn tunnel_answered(&self, metrics: &AgentMetrics) {
        self.tunnel_connected.store(true, Ordering::Relaxed);
        metrics.node_tunnel_up.set(1);
    }

    fn tunnel_failed(&self, problem: String, metrics: &AgentMetrics) {
        *self
            .tunnel_problem
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = problem;
        self.tunnel_connected.store(false, Ordering::Relaxed);
        metrics.node_tunnel_up.set(0);
    }
}

/// How often the node tunnel is probed, and how long an answer may take:
/// a tunnel that stops answering is reported within about 3 s.
const TUNNEL_PROBE_INTERVAL: Duration = Duration::from_secs(1);
const TUNNEL_PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// The longest wait between reconnection attempts of the node tunnel.
const TUNNEL_RETRY_CAP: Duration = Duration::from_secs(3);

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
    if settings
        .captures
        .entries()
        .iter()
        .any(|c| c.destination.is_ipv6())
    {
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
        metrics: metrics.clone(),
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
                ipv6: settings
                    .captures
                    .entries()
                    .iter()
                    .any(|c| c.destination.is_ipv6()),
                state_dir: cni.state_dir.clone(),
                // The agent runs in the host's network namespace (hostNetwork).
                host_netns: "/proc/self/ns/net".into(),
                agent_socket: cni.socket.clone(),
                netns_dir: cni.netns_dir.clone(),
                cni_cache_dir: cni.cni_cache_dir.clone(),
                cni_conf_dir: cni.cni_conf_dir.clone(),
                exclude_namespaces: cni.exclude_namespaces.clone(),
            },
            context.clone(),
        )?);
        let restored = pods.restore().await;
        let enrolment = pods.enrol_recorded(true).await;
        // One line, whatever the machine holds: the pinned namespaces that
        // are no pods of ours are counted, never listed or entered.
        tracing::info!(
            restored,
            enrolled = enrolment.enrolled,
            captured_already = enrolment.captured_already,
            excluded = enrolment.excluded,
            not_enrolled = enrolment.failed,
            other_networks = enrolment.not_ours,
            pinned_left_alone = pods.pinned_left_alone(),
            networks = ?enrolment.networks,
            cache = ?cni.cni_cache_dir,
            "pod capture started: recorded pods restored, running pods of our networks enrolled from the runtime's CNI cache; pinned namespaces that are no pods of ours left alone"
        );
        if enrolment.networks.is_empty() && cni.cni_cache_dir.is_some() {
            tracing::info!(conf_dir = %cni.cni_conf_dir.display(), socket = %cni.socket.display(), "no network configuration there chains konnectivity-cni with this agent's socket yet (install-cni's --agent-socket must equal --cni-socket); running pods are enrolled once one does");
        }
        let sweeping = pods.clone();
        tasks.spawn(async move {
            loop {
                tokio::time::sleep(POD_SWEEP_INTERVAL).await;
                sweeping.forget_gone();
                sweeping.enrol_recorded(false).await;
            }
        });
        let socket = cni_socket::bind(&cni.socket).map_err(|source| CaptureError::CniSocket {
            path: cni.socket.display().to_string(),
            source,
        })?;
        tracing::info!(socket = %cni.socket.display(), "CNI socket open");
        tasks.spawn(cni_socket::serve(socket, pods, readiness.clone()));
    }
    tasks.spawn(keep_tunnel(settings, tunnel_tx, readiness, metrics));
    while tasks.join_next().await.is_some() {}
    Ok(())
}

/// Keeps the node tunnel for as long as the agent runs, so that readiness
/// follows it: captured connections are reset while it is down, and
/// `/readyz` says so. The tunnel is probed every second; one that stops
/// answering is replaced by a new connection (the old one's TCP connection
/// may sit in retransmission backoff long after the path is back), retried
/// with the agent's backoff, capped so recovery is seen within seconds.
async fn keep_tunnel(
    settings: NodeSettings,
    tunnel: watch::Sender<Option<Tunnel>>,
    readiness: Arc<NodeReadiness>,
    metrics: Arc<AgentMetrics>,
) {
    let mut backoff = Backoff::new(
        settings.sync_interval,
        settings.sync_interval_cap.min(TUNNEL_RETRY_CAP),
    );
    let mut current: Option<Tunnel> = None;
    loop {
        let was_up = readiness.tunnel_connected.load(Ordering::Relaxed);
        let answer = match &current {
            Some(connected) => connected
                .probe(TUNNEL_PROBE_TIMEOUT)
                .await
                .map_err(|e| e.to_string()),
            None => Err("not connected".to_owned()),
        };
        let answer = match answer {
            Ok(()) => Ok(()),
            Err(problem) => {
                // Not ready from this moment; reconnecting may take a while.
                if was_up {
                    tracing::warn!(%problem, server = %settings.server_host, port = settings.node_frontend_port, "node tunnel stopped answering; captured connections are reset until it is back");
                }
                readiness.tunnel_failed(problem.clone(), &metrics);
                match connect_tunnel(&settings).await {
                    Ok(fresh) => {
                        let _ = tunnel.send(Some(fresh.clone()));
                        current = Some(fresh);
                        Ok(())
                    }
                    // The probe's failure says what went wrong first.
                    Err(error) if current.is_some() => Err(format!("{problem} (reconnecting: {error})")),
                    Err(error) => Err(error),
                }
            }
        };
        match answer {
            Ok(()) => {
                if !was_up {
                    tracing::info!(server = %settings.server_host, port = settings.node_frontend_port, "node tunnel connected");
                }
                readiness.tunnel_answered(&metrics);
                backoff.reset();
                tokio::time::sleep(TUNNEL_PROBE_INTERVAL).await;
            }
            Err(problem) => {
                if current.is_none() {
                    tracing::warn!(%problem, server = %settings.server_host, port = settings.node_frontend_port, "cannot connect the node tunnel");
                }
                readiness.tunnel_failed(problem, &metrics);
                tokio::time::sleep(backoff.next_delay()).await;
            }
        }
    }
}

/// A new connection to the node frontend that has answered a probe.
async fn connect_tunnel(settings: &NodeSettings) -> Result<Tunnel, String> {
    let connect = Tunnel::connect_tls_marked(
        &settings.server_host,
        settings.node_frontend_port,
        settings.tls.clone(),
        Some(settings.mark),
    );
    let connected = match tokio::time::timeout(TUNNEL_PROBE_TIMEOUT, connect).await {
        Ok(Ok(connected)) => connected.with_dial_timeout(Duration::from_secs(10)),
        Ok(Err(error)) => return Err(konnectivity_plumbing::error_chain(&error)),
        Err(_) => return Err(format!("no connection within {TUNNEL_PROBE_TIMEOUT:?}")),
    };
    connected
        .probe(TUNNEL_PROBE_TIMEOUT)
        .await
        .map_err(|e| e.to_string())?;
    Ok(connected)
}

/// Removes the capture rules (clean shutdown).
pub fn remove_rules() -> Result<(), nft::NftError> {
    nft::remove()
}
