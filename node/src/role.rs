//! The node role's life: taken over from the agent it replaces or started
//! afresh (rules, capture listeners, pods, the CNI socket), then served
//! until it is handed to the next agent.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::net::{TcpListener, UnixListener};
use tokio::sync::watch;

use crate::capture::listener::{self, CaptureContext};
use crate::capture::nft;
use crate::cni;
use crate::handover;
use crate::metrics::NodeMetrics;
use crate::pods::captured::{PodSettings, Pods};
use crate::readiness::NodeReadiness;
use crate::serving::Serving;
use crate::settings::{CniSettings, NodeSettings};
use crate::tunnel::keep_tunnel;

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
    #[error("cannot listen on {addr} for the health server (--health-server-port): {source}")]
    HealthBind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error(transparent)]
    Pods(#[from] crate::pods::captured::PodError),
    #[error(transparent)]
    Handover(#[from] handover::HandoverError),
}

/// How often an agent waiting to take over says that it still waits.
const TAKEOVER_WAIT_LOG: Duration = Duration::from_secs(30);

/// What serves `/healthz`, `/readyz` and `/metrics` for the agent: the node
/// role owns the listener, as it is handed over with the rest.
pub struct HealthService {
    pub addr: SocketAddr,
    /// The admin listener's (see `AdminEndpoints`).
    pub admin_addr: SocketAddr,
    /// `--enable-profiling`.
    pub profiling: bool,
    pub endpoints: Arc<dyn konnectivity_telemetry::http::Endpoints>,
}

/// Runs the node role: takes it over from the agent answering on
/// `--handover-socket`, or else starts it afresh (rules, capture listeners,
/// pods, the CNI socket); keeps the node tunnel; and hands it all over to
/// the next agent that asks, then returns. The rules stay when the process
/// dies, so a restarted agent resumes capturing; [`remove_rules`] takes them
/// away on a clean shutdown.
pub async fn run(
    settings: NodeSettings,
    metrics: Arc<NodeMetrics>,
    readiness: Arc<NodeReadiness>,
    health: HealthService,
) -> Result<(), CaptureError> {
    let (tunnel_tx, tunnel_rx) = watch::channel(None);
    let context = Arc::new(CaptureContext {
        map: settings.captures.clone(),
        tunnel: tunnel_rx,
        metrics: metrics.clone(),
        resume_timeout: settings.resume_timeout,
        handoff: crate::handoff::HandOff::new(),
        servers: crate::tunnel::ServerTunnels::new(settings.clone()),
    });
    let mut background = tokio::task::JoinSet::new();
    // The tunnel first: an agent taking over must carry what it takes, and
    // one recovering from a crash captures once the tunnel answers.
    background.spawn(keep_tunnel(
        settings.clone(),
        tunnel_tx,
        readiness.clone(),
        metrics.clone(),
    ));
    let predecessor = match settings.handover_socket.clone() {
        Some(path) => tokio::task::spawn_blocking(move || handover::Predecessor::find(&path))
            .await
            .expect("hand-over task does not panic")?,
        None => None,
    };
    let mut role = match predecessor {
        Some(predecessor) => take_over(predecessor, &settings, context, &readiness, health).await?,
        None => start_afresh(&settings, context, &readiness, health).await?,
    };
    role.egress = settings.egress.as_ref().map(|egress| egress.handoff.clone());
    readiness.rules_installed.store(true, Ordering::Relaxed);
    let role = Arc::new(role);
    if let Some(pods) = role.pods.clone() {
        background.spawn(async move {
            loop {
                tokio::time::sleep(POD_SWEEP_INTERVAL).await;
                pods.forget_gone();
                pods.enrol_recorded(false).await;
            }
        });
    }
    if role.handover.is_none() {
        // No successor can ask: run until the agent stops.
        while background.join_next().await.is_some() {}
        return Ok(());
    }
    let (handed_over, done) = tokio::sync::oneshot::channel();
    let serving = role.clone();
    std::thread::Builder::new()
        .name("handover".to_owned())
        .spawn(move || {
            if let Some(listener) = &serving.handover {
                handover::serve(listener, &*serving);
            }
            let _ = handed_over.send(());
        })
        .expect("a thread for the hand-over socket");
    let _ = done.await;
    // Everything stopped accepting in the hand-over; dropping the role
    // closes this process's copies of the sockets, dropping the background
    // tasks ends the tunnel keeper and the pod sweeps. Connections already
    // accepted carry on in their own tasks.
    tracing::info!("handed the node role over to a newer agent");
    Ok(())
}

/// Takes the node role over from the agent answering on the hand-over socket.
async fn take_over(
    predecessor: handover::Predecessor,
    settings: &NodeSettings,
    context: Arc<CaptureContext>,
    readiness: &Arc<NodeReadiness>,
    health: HealthService,
) -> Result<NodeRole, CaptureError> {
    let handover_socket = settings
        .handover_socket
        .clone()
        .expect("a predecessor was found on it");
    tracing::info!(socket = %handover_socket.display(), "another node agent runs: taking its role over once the node tunnel answers");
    // Not before its own tunnel answers: it could only reset what it took.
    // A new agent that cannot reach the server (a bad certificate, a wrong
    // address) so never takes over, and the rollout stops at its pod, which
    // stays unready, while the old agent carries on.
    let mut waited = tokio::time::Instant::now();
    while !readiness.tunnel_connected.load(Ordering::Relaxed) {
        if waited.elapsed() >= TAKEOVER_WAIT_LOG {
            tracing::warn!(problem = %readiness.problem(), "not taking the node role over until the node tunnel answers");
            waited = tokio::time::Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Established connections and egress sessions too, when this agent can
    // resume them.
    let connections = !settings.resume_timeout.is_zero();
    let sessions = connections && settings.egress.is_some();
    let mut inheritance = tokio::task::spawn_blocking(move || predecessor.receive(connections, sessions))
        .await
        .expect("hand-over task does not panic")?;
    let missing = |what: &str| {
        CaptureError::Handover(handover::HandoverError::Exchange(format!(
            "the previous agent handed over no {what}"
        )))
    };
    let tcp = |fd: std::os::fd::OwnedFd| -> std::io::Result<TcpListener> {
        let listener = std::net::TcpListener::from(fd);
        listener.set_nonblocking(true)?;
        TcpListener::from_std(listener)
    };
    let inherited_io = |source: std::io::Error| {
        CaptureError::Handover(handover::HandoverError::Exchange(format!(
            "a socket handed over: {source}"
        )))
    };
    let health_listener = tcp(inheritance
        .take(handover::Role::Health)
        .pop()
        .ok_or_else(|| missing("health listener"))?)
    .map_err(inherited_io)?;
    // A predecessor that could not bind its admin port hands none over.
    let admin_listener = match inheritance.take(handover::Role::Admin).pop() {
        Some(fd) => Some(tcp(fd).map_err(inherited_io)?),
        None => konnectivity_telemetry::http::bind_admin(health.admin_addr, "admin-server-port").await,
    };
    let mut capture = Vec::new();
    for fd in inheritance.take(handover::Role::Capture) {
        capture.push(tcp(fd).map_err(inherited_io)?);
    }
    // The port the listeners are on is the port the rules redirect to.
    let port = capture
        .first()
        .ok_or_else(|| missing("capture listener"))?
        .local_addr()
        .map_err(inherited_io)?
        .port();
    if port != settings.capture_port {
        tracing::warn!(
            serving = port,
            configured = settings.capture_port,
            "--capture-port differs from the port of the listeners taken over: this agent serves those; the configured port applies when an agent starts with no predecessor"
        );
    }
    let handover_listener = inheritance
        .take(handover::Role::Handover)
        .pop()
        .map(socket2::Socket::from)
        .ok_or_else(|| missing("hand-over socket"))?;
    let ruleset = nft::render(&settings.captures, port, settings.mark);
    let inherited_pods = std::mem::take(&mut inheritance.pods);
    let pod_count = inherited_pods.len();
    let cni = match &settings.cni {
        Some(cni) => {
            let pods = Arc::new(Pods::new(
                pod_settings(settings, cni, port, &ruleset),
                context.clone(),
            )?);
            pods.inherit(inherited_pods);
            let listener = inheritance
                .take(handover::Role::Cni)
                .pop()
                .ok_or_else(|| missing("CNI socket"))?;
            let listener = std::os::unix::net::UnixListener::from(listener);
            listener.set_nonblocking(true).map_err(inherited_io)?;
            let listener = UnixListener::from_std(listener).map_err(inherited_io)?;
            Some((listener, pods))
        }
        None => None,
    };
    let previous_ruleset = std::mem::take(&mut inheritance.ruleset);
    let role = NodeRole::serve(
        health,
        (health_listener, admin_listener),
        capture,
        context.clone(),
        cni,
        Some(handover_listener),
        ruleset.clone(),
        readiness,
    );
    // Both agents accept now; the predecessor stops once told, and hands
    // its established connections over.
    let inherited = match tokio::task::spawn_blocking(move || inheritance.confirm())
        .await
        .expect("hand-over task does not panic")
    {
        Ok(inherited) => inherited,
        Err((error, inherited)) => {
            tracing::warn!(%error, "the previous agent did not confirm the hand-over; taking the ownership lock regardless");
            inherited
        }
    };
    // The agent's server loop resumes each session on a stream of its own.
    for session in inherited.sessions {
        match &settings.egress {
            Some(egress) => {
                if let Err(unsent) = egress.inherited.send(session) {
                    handover::reset_session(unsent.0);
                }
            }
            None => handover::reset_session(session),
        }
    }
    continue_connections(inherited.connections, &context).await;
    let ownership = tokio::task::spawn_blocking(move || handover::Ownership::take(&handover_socket))
        .await
        .expect("hand-over task does not panic")?;
    *role.ownership.lock().expect("ownership lock") = Some(ownership);
    if previous_ruleset != ruleset {
        // A new configuration: replace the rules, atomically, on the host
        // and in every pod.
        let host = ruleset.clone();
        tokio::task::spawn_blocking(move || nft::apply(&host))
            .await
            .expect("nft task does not panic")?;
        if let Some(pods) = &role.pods {
            pods.reapply_rules().await;
        }
        tracing::info!("capture rules replaced: the configuration changed");
    }
    tracing::info!(
        pods = pod_count,
        "took the node role over from the previous agent"
    );
    Ok(role)
}

/// Starts the node role with no predecessor: first the ownership lock, then
/// the rules, listeners, pods and the CNI socket.
async fn start_afresh(
    settings: &NodeSettings,
    context: Arc<CaptureContext>,
    readiness: &Arc<NodeReadiness>,
    health: HealthService,
) -> Result<NodeRole, CaptureError> {
    let ownership = match settings.handover_socket.clone() {
        Some(path) => Some(
            tokio::task::spawn_blocking(move || handover::Ownership::take(&path))
                .await
                .expect("hand-over task does not panic")?,
        ),
        None => None,
    };
    let health_listener =
        TcpListener::bind(health.addr)
            .await
            .map_err(|source| CaptureError::HealthBind {
                addr: health.addr,
                source,
            })?;
    let admin_listener =
        konnectivity_telemetry::http::bind_admin(health.admin_addr, "admin-server-port").await;
    // REDIRECT in the output hook sends to the loopback address of the family.
    let mut addrs = vec![SocketAddr::new(
        IpAddr::V4(Ipv4Addr::LOCALHOST),
        settings.capture_port,
    )];
    if captures_ipv6(settings) {
        addrs.push(SocketAddr::new(
            IpAddr::V6(Ipv6Addr::LOCALHOST),
            settings.capture_port,
        ));
    }
    let mut capture = Vec::new();
    for addr in addrs {
        capture.push(
            TcpListener::bind(addr)
                .await
                .map_err(|source| CaptureError::Listen { addr, source })?,
        );
    }
    let ruleset = nft::render(&settings.captures, settings.capture_port, settings.mark);
    let host = ruleset.clone();
    tokio::task::spawn_blocking(move || nft::apply(&host))
        .await
        .expect("nft task does not panic")?;
    tracing::info!(port = settings.capture_port, captures = ?settings.captures.entries(), "capture rules installed");
    let cni = match &settings.cni {
        Some(cni) => {
            let pods = Arc::new(Pods::new(
                pod_settings(settings, cni, settings.capture_port, &ruleset),
                context.clone(),
            )?);
            let restored = pods.restore().await;
            let enrolment = pods.enrol_recorded(true).await;
            // One line, whatever the machine holds: the pinned namespaces
            // that are no pods of ours are counted, never listed or entered.
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
            let listener = cni::socket::bind(&cni.socket).map_err(|source| CaptureError::CniSocket {
                path: cni.socket.display().to_string(),
                source,
            })?;
            tracing::info!(socket = %cni.socket.display(), "CNI socket open");
            Some((listener, pods))
        }
        None => None,
    };
    let handover_listener = match &settings.handover_socket {
        Some(path) => Some(handover::bind(path)?),
        None => None,
    };
    let role = NodeRole::serve(
        health,
        (health_listener, admin_listener),
        capture,
        context,
        cni,
        handover_listener,
        ruleset,
        readiness,
    );
    *role.ownership.lock().expect("ownership lock") = ownership;
    Ok(role)
}

/// How long a successor waits for the connections it took over to resume
/// before it says it holds the role (each takes one round trip to the
/// server; a resume that fails gives up within --resume-timeout).
const TAKEN_OVER_WAIT: Duration = Duration::from_secs(10);

/// Carries on the established connections the previous agent handed over,
/// and waits until their streams resumed (or failed to): the previous agent
/// exits once this one is ready, and its streams must not be the
/// connections' last by then. One log line with the counts.
async fn continue_connections(
    connections: Vec<crate::capture::handoff::HandedConnection>,
    context: &Arc<CaptureContext>,
) {
    if connections.is_empty() {
        return;
    }
    let started = tokio::time::Instant::now();
    let taken = connections.len();
    let mut reports = Vec::with_capacity(taken);
    for connection in connections {
        let (told, report) = tokio::sync::oneshot::channel();
        tokio::spawn(listener::continue_handed(connection, context.clone(), told));
        reports.push(report);
    }
    let (mut resumed, mut failed, mut first_failure) = (0, 0, None);
    let deadline = started + TAKEN_OVER_WAIT;
    for report in reports {
        match tokio::time::timeout_at(deadline, report).await {
            Ok(Ok(Ok(()))) => resumed += 1,
            Ok(Ok(Err(error))) => {
                failed += 1;
                first_failure.get_or_insert(error);
            }
            Ok(Err(_)) => {
                failed += 1;
                first_failure
                    .get_or_insert_with(|| "the connection ended before its stream resumed".to_owned());
            }
            Err(_) => {
                failed += 1;
                first_failure.get_or_insert_with(|| format!("not resumed within {TAKEN_OVER_WAIT:?}"));
            }
        }
    }
    context.metrics.taken_over(resumed, failed);
    match first_failure {
        None => tracing::info!(
            connections = taken,
            took = ?started.elapsed(),
            "established connections taken over from the previous agent, every one resumed"
        ),
        Some(first_failure) => tracing::warn!(
            connections = taken,
            resumed,
            failed,
            %first_failure,
            took = ?started.elapsed(),
            "established connections taken over from the previous agent, some not resumed (reset, or still resuming after the wait)"
        ),
    }
}

fn captures_ipv6(settings: &NodeSettings) -> bool {
    settings
        .captures
        .entries()
        .iter()
        .any(|c| c.destination.is_ipv6())
}

fn pod_settings(settings: &NodeSettings, cni: &CniSettings, port: u16, ruleset: &str) -> PodSettings {
    PodSettings {
        ruleset: ruleset.to_owned(),
        capture_port: port,
        ipv6: captures_ipv6(settings),
        state_dir: cni.state_dir.clone(),
        // The agent runs in the host's network namespace (hostNetwork).
        host_netns: "/proc/self/ns/net".into(),
        agent_socket: cni.socket.clone(),
        netns_dir: cni.netns_dir.clone(),
        cni_cache_dir: cni.cni_cache_dir.clone(),
        cni_conf_dir: cni.cni_conf_dir.clone(),
        exclude_namespaces: cni.exclude_namespaces.clone(),
    }
}

/// The node role's sockets, each served by a task, and what a hand-over
/// needs to pass them on or to carry on.
struct NodeRole {
    runtime: tokio::runtime::Handle,
    health: Serving<TcpListener>,
    admin: Option<Serving<TcpListener>>,
    capture: Vec<Serving<TcpListener>>,
    cni: Option<std::sync::Mutex<Serving<UnixListener>>>,
    pods: Option<Arc<Pods>>,
    /// The established connections, handed over with the rest.
    context: Arc<CaptureContext>,
    /// What the last collection left here: not resumable, busy.
    kept: std::sync::Mutex<(usize, usize)>,
    /// The agent's egress sessions, handed over with the rest.
    egress: Option<Arc<crate::handoff::HandOff<crate::sessions::HandedSession>>>,
    /// What the last collection of sessions left here: not resumable, busy.
    kept_sessions: std::sync::Mutex<(usize, usize)>,
    handover: Option<socket2::Socket>,
    ruleset: String,
    /// Held while this agent owns the rules.
    ownership: std::sync::Mutex<Option<handover::Ownership>>,
    /// Pod changes held during a hand-over.
    held: std::sync::Mutex<Option<tokio::sync::OwnedMutexGuard<()>>>,
    readiness: Arc<NodeReadiness>,
}

impl NodeRole {
    /// Starts accepting on every socket.
    #[allow(clippy::too_many_arguments)]
    fn serve(
        health: HealthService,
        (health_listener, admin_listener): (TcpListener, Option<TcpListener>),
        capture: Vec<TcpListener>,
        context: Arc<CaptureContext>,
        cni: Option<(UnixListener, Arc<Pods>)>,
        handover: Option<socket2::Socket>,
        ruleset: String,
        readiness: &Arc<NodeReadiness>,
    ) -> NodeRole {
        let endpoints = health.endpoints;
        let admin = admin_listener.map(|listener| {
            let endpoints = Arc::new(konnectivity_telemetry::http::AdminEndpoints::new(
                endpoints.clone(),
                health.profiling,
            ));
            Serving::start(listener, |listener| {
                konnectivity_telemetry::http::serve(listener, endpoints)
            })
        });
        let health = Serving::start(health_listener, |listener| {
            konnectivity_telemetry::http::serve(listener, endpoints)
        });
        let capture_context = context.clone();
        let capture = capture
            .into_iter()
            .map(|listener| {
                let context = context.clone();
                Serving::start(listener, |listener| listener::serve(listener, context))
            })
            .collect();
        let (cni, pods) = match cni {
            Some((listener, pods)) => {
                let (serving_pods, serving_readiness) = (pods.clone(), readiness.clone());
                let serving = Serving::start(listener, |listener| {
                    cni::socket::serve(listener, serving_pods, serving_readiness)
                });
                (Some(std::sync::Mutex::new(serving)), Some(pods))
            }
            None => (None, None),
        };
        NodeRole {
            runtime: tokio::runtime::Handle::current(),
            health,
            admin,
            capture,
            cni,
            pods,
            context: capture_context,
            kept: std::sync::Mutex::new((0, 0)),
            egress: None,
            kept_sessions: std::sync::Mutex::new((0, 0)),
            handover,
            ruleset,
            ownership: std::sync::Mutex::new(None),
            held: std::sync::Mutex::new(None),
            readiness: readiness.clone(),
        }
    }

    fn snapshot(&self) -> std::io::Result<handover::Snapshot> {
        use handover::Role;
        let mut sockets = vec![(Role::Health, self.health.duplicate()?)];
        if let Some(admin) = &self.admin {
            sockets.push((Role::Admin, admin.duplicate()?));
        }
        for serving in &self.capture {
            sockets.push((Role::Capture, serving.duplicate()?));
        }
        if let Some(cni) = &self.cni {
            sockets.push((Role::Cni, cni.lock().expect("cni lock").duplicate()?));
        }
        if let Some(listener) = &self.handover {
            use std::os::fd::AsFd;
            sockets.push((Role::Handover, listener.as_fd().try_clone_to_owned()?));
        }
        let pods = match &self.pods {
            Some(pods) => pods.snapshot()?,
            None => Vec::new(),
        };
        Ok(handover::Snapshot {
            sockets,
            pods,
            ruleset: self.ruleset.clone(),
        })
    }
}

impl handover::Handing for NodeRole {
    fn successor_waiting(&self, waiting: bool) {
        self.readiness.successor_waiting.store(waiting, Ordering::Relaxed);
    }

    fn pause(&self) -> Result<handover::Snapshot, String> {
        if let (Some(cni), Some(pods)) = (&self.cni, &self.pods) {
            // New pod requests wait in the CNI socket's queue for the
            // successor; one under way finishes first.
            cni.lock().expect("cni lock").stop();
            *self.held.lock().expect("held lock") = Some(pods.hold_changes(&self.runtime));
        }
        self.snapshot().map_err(|error| {
            self.resume();
            format!("collecting the sockets to hand over: {error}")
        })
    }

    fn resume(&self) {
        if let (Some(cni), Some(pods)) = (&self.cni, &self.pods) {
            let (serving_pods, readiness) = (pods.clone(), self.readiness.clone());
            let _entered = self.runtime.enter();
            cni.lock()
                .expect("cni lock")
                .restart(|listener| cni::socket::serve(listener, serving_pods, readiness));
        }
        self.held.lock().expect("held lock").take();
    }

    fn hand_over(&self) {
        self.health.stop();
        if let Some(admin) = &self.admin {
            admin.stop();
        }
        for serving in &self.capture {
            serving.stop();
        }
        if let Some(pods) = &self.pods {
            pods.stop_serving();
        }
        self.ownership.lock().expect("ownership lock").take();
        self.held.lock().expect("held lock").take();
        self.readiness.set_handed_over();
    }

    fn connections(&self) -> Vec<crate::capture::handoff::HandedConnection> {
        let collected = self.context.handoff.collect(COLLECT_WAIT);
        *self.kept.lock().expect("kept lock") = (collected.not_resumable, collected.busy);
        collected.connections
    }

    fn sessions(&self) -> Vec<crate::sessions::HandedSession> {
        let Some(egress) = &self.egress else {
            return Vec::new();
        };
        let collected = egress.collect(crate::sessions::COLLECT_WAIT);
        *self.kept_sessions.lock().expect("kept lock") = (collected.not_resumable, collected.busy);
        collected.connections
    }

    fn sessions_sent(&self, sent: usize, of: usize) {
        let (not_resumable, busy) = *self.kept_sessions.lock().expect("kept lock");
        crate::sessions::report_sent(&self.context.metrics, sent, of, not_resumable, busy);
    }

    fn connections_sent(&self, sent: usize, of: usize) {
        let (not_resumable, busy) = *self.kept.lock().expect("kept lock");
        self.context
            .metrics
            .handed_over(sent, of - sent, not_resumable, busy);
        tracing::info!(
            handed_over = sent,
            not_sent = of - sent,
            not_resumable,
            busy,
            "established connections handed to the newer agent; the rest stay here until they end or --drain-timeout \
             (not resumable: the server offered no resume or --resume-timeout=0; busy: did not stop within 1 s, \
             a client not reading or a stream being resumed)"
        );
    }
}

/// How long a hand-over waits for the established connections to stop.
const COLLECT_WAIT: Duration = Duration::from_secs(1);
