//! proxy-agent: holds a stream to the proxy-server and serves its dials.
//!
//! Reading order: [`config`] (flags), [`server_conn`] (opening a stream),
//! [`session`] (serving one stream), [`endpoint`] (the TCP connections
//! opened for the server), [`health`] and [`metrics`].

pub mod config;
mod endpoint;
mod handover;
mod health;
mod leases;
mod metrics;
mod server_conn;
mod servers;
mod session;

/// What the fuzz targets reach inside the agent: a server stream's session
/// and the capture map's parser. Not an API: only with the `test-hooks`
/// feature, which the binary is never built with.
#[cfg(feature = "test-hooks")]
pub mod hooks {
    pub use crate::metrics::AgentMetrics;
    pub use crate::session::SessionSettings;
    pub use konnectivity_node::capture::map::Capture;

    /// A server stream's session.
    pub mod session {
        pub use crate::session::{Attached, StreamEnd, run};
    }
}

use std::sync::Arc;
use std::time::Duration;

use konnectivity_plumbing::lifecycle::Watcher;
use konnectivity_plumbing::signals::Terminations;
use konnectivity_plumbing::tls::{self, TlsError};

use crate::config::Config;
use crate::health::AgentEndpoints;
use crate::metrics::AgentMetrics;
use crate::server_conn::ServerTarget;
use crate::session::SessionSettings;
use konnectivity_node::readiness::NodeReadiness;
use konnectivity_node::role::{CaptureError, HealthService};
use konnectivity_node::settings::NodeSettings;
use konnectivity_plumbing::backoff::Backoff;
use tokio::sync::watch;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("cannot listen on {addr} for the health server (--health-server-port): {source}")]
    HealthBind {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error(transparent)]
    Capture(#[from] CaptureError),
}

/// How the agent ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// Told to stop (a second signal): a node agent still owns its rules.
    Stopped,
    /// A newer agent took the node role over, rules included.
    HandedOver,
}

/// Runs the agent until it is told to stop, as upstream's: the first
/// SIGTERM or SIGINT drains (every server stream sends DRAIN, so servers
/// stop choosing this agent, and /readyz answers 503), the second ends it.
/// A node agent whose role a newer agent took over drains at once, and ends
/// at the first signal, once the connections it still carries are done or
/// `--drain-timeout` has passed.
pub async fn run(config: Config, signals: &mut Terminations) -> Result<Ended, AgentError> {
    let (drain, watcher) = konnectivity_plumbing::lifecycle::channel();
    let (stop, stopping) = konnectivity_plumbing::lifecycle::channel();
    let metrics = Arc::new(AgentMetrics::default());
    let node_readiness = config.node.as_ref().map(|_| Arc::new(NodeReadiness::default()));
    let drain_timeout = config
        .node
        .as_ref()
        .map(|node| node.drain_timeout)
        .or(config.egress_handover.as_ref().map(|egress| egress.drain_timeout));
    // Turns true when a successor took a plain egress agent's sessions.
    let (egress_handed, egress_handed_over) = watch::channel(false);
    let agent = serve(
        config,
        watcher,
        Some(stopping),
        metrics.clone(),
        node_readiness.clone(),
        Some(egress_handed),
    );
    tokio::pin!(agent);
    let mut agent = Running {
        future: agent,
        done: false,
    };
    let outcome = until_told(
        &mut agent,
        signals,
        &drain,
        (&node_readiness, egress_handed_over),
        &metrics,
        drain_timeout,
    )
    .await;
    // Leaving: every server stream ends cleanly, so that servers know its
    // connections will not resume (docs/resume.md); briefly, at most 1 s.
    stop.signal();
    if !agent.done {
        let streams_closed = async {
            while metrics.open_server_connections.get() > 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        let _ = tokio::time::timeout(Duration::from_secs(1), async {
            tokio::select! {
                _ = agent.future.as_mut() => {}
                () = streams_closed => {}
            }
        })
        .await;
    }
    outcome
}

/// The agent's work, and whether it has returned (it must not be polled again).
struct Running<F> {
    future: std::pin::Pin<F>,
    done: bool,
}

impl<F: std::ops::DerefMut<Target = T>, T: std::future::Future<Output = Result<(), AgentError>>> Running<F> {
    async fn finished(&mut self) -> Result<(), AgentError> {
        let result = self.future.as_mut().await;
        self.done = true;
        result
    }
}

/// Runs until the signals, a hand-over or the agent's end say to stop.
async fn until_told<
    F: std::ops::DerefMut<Target = T>,
    T: std::future::Future<Output = Result<(), AgentError>>,
>(
    agent: &mut Running<F>,
    signals: &mut Terminations,
    drain: &konnectivity_plumbing::lifecycle::Trigger,
    (node_readiness, mut egress_handed_over): (&Option<Arc<NodeReadiness>>, watch::Receiver<bool>),
    metrics: &AgentMetrics,
    drain_timeout: Option<Duration>,
) -> Result<Ended, AgentError> {
    let handed_over = async {
        match &node_readiness {
            Some(readiness) => readiness.handed_over().await,
            None => {
                if egress_handed_over.wait_for(|handed| *handed).await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        }
    };
    tokio::pin!(handed_over);
    let mut signaled = false;
    tokio::select! {
        result = agent.finished() => return result.map(|()| Ended::Stopped),
        signal = signals.next() => {
            tracing::info!(signal, "draining; send the signal again to exit");
            drain.signal();
            signaled = true;
        }
        () = &mut handed_over => {
            tracing::info!("draining: a newer agent took the node role over");
            drain.signal();
        }
    }
    if signaled {
        tokio::select! {
            result = agent.finished() => return result.map(|()| Ended::Stopped),
            signal = signals.next() => {
                tracing::info!(signal, "exiting");
                return Ok(Ended::Stopped);
            }
            () = &mut handed_over => tracing::info!("a newer agent took the node role over"),
        }
    } else {
        tokio::select! {
            result = agent.finished() => return result.map(|()| Ended::HandedOver),
            signal = signals.next() => tracing::info!(signal, "exiting once the open connections end"),
        }
    }
    let limit = drain_timeout.unwrap_or_default();
    tokio::select! {
        result = agent.finished() => result.map(|()| Ended::HandedOver),
        quiet = connections_done(metrics, limit) => {
            if quiet {
                tracing::info!("open connections done; exiting");
            } else {
                tracing::info!(
                    captured = metrics.node.captured_connections_open.get(),
                    endpoints = metrics.open_endpoint_connections.get(),
                    timeout = ?limit,
                    "exiting with connections still open (--drain-timeout)"
                );
            }
            Ok(Ended::HandedOver)
        }
    }
}

/// The agent without its signal handling, for a program that embeds agents
/// (the benchmark's fleet): runs until dropped, or until it fails to start;
/// `drain` signalled does what the first SIGTERM does.
pub async fn run_with_drain(config: Config, drain: Watcher) -> Result<(), AgentError> {
    let metrics = Arc::new(AgentMetrics::default());
    let node_readiness = config.node.as_ref().map(|_| Arc::new(NodeReadiness::default()));
    serve(config, drain, None, metrics, node_readiness, None).await
}

/// Waits until no captured or endpoint connection is open, at most `limit`;
/// whether they all ended.
async fn connections_done(metrics: &AgentMetrics, limit: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if metrics.node.captured_connections_open.get() == 0 && metrics.open_endpoint_connections.get() == 0 {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The agent's work: the server streams (egress), and the node role when
/// configured; ends only when one of them fails to start.
async fn serve(
    config: Config,
    drain: Watcher,
    stopping: Option<Watcher>,
    metrics: Arc<AgentMetrics>,
    node_readiness: Option<Arc<NodeReadiness>>,
    egress_handed: Option<watch::Sender<bool>>,
) -> Result<(), AgentError> {
    let endpoints = Arc::new(AgentEndpoints {
        metrics: metrics.clone(),
        drain: drain.clone(),
        node_readiness: node_readiness.clone(),
    });
    // The node role serves health itself: it hands the listener to the
    // agent that replaces it, with its other sockets.
    let _health = match &config.node {
        Some(_) => None,
        None => {
            let health = tokio::net::TcpListener::bind(config.health_addr)
                .await
                .map_err(|source| AgentError::HealthBind {
                    addr: config.health_addr,
                    source,
                })?;
            let admin = konnectivity_telemetry::http::bind_admin(config.admin_addr, "admin-server-port")
                .await
                .map(|admin| {
                    let endpoints = Arc::new(konnectivity_telemetry::http::AdminEndpoints::new(
                        endpoints.clone(),
                        config.profiling,
                    ));
                    AbortOnDrop(tokio::spawn(konnectivity_telemetry::http::serve(
                        Arc::new(admin),
                        endpoints,
                    )))
                });
            let health = AbortOnDrop(tokio::spawn(konnectivity_telemetry::http::serve(
                Arc::new(health),
                endpoints.clone(),
            )));
            Some((health, admin))
        }
    };
    // Beside h2 (and --alpn-proto), the protocol by which a server of ours
    // says PINGs are welcome (konnectivity_proto::ALPN_PINGS).
    let mut alpn: Vec<&[u8]> = config.alpn.iter().map(|proto| proto.as_bytes()).collect();
    alpn.push(konnectivity_proto::ALPN_PINGS);
    let tls = tls::client_config(config.ca_cert.as_ref(), config.identity.as_ref(), &alpn)?;
    let target = ServerTarget {
        host: config.server_host.clone(),
        port: config.server_port,
        tls: Arc::new(tls),
        agent_id: config.agent_id.clone(),
        identifiers: config.identifiers.clone(),
        mark: config.node.as_ref().map(|node| node.mark),
        keepalive: config.keepalive,
        probe_interval: config.probe_interval,
        token_path: config.token_path.clone(),
        resolved: None,
        resume: !config.resume_timeout.is_zero(),
    };
    // With the node role's hand-over socket, the egress sessions go to the
    // successor with the rest; a plain agent hands them over by itself with
    // --egress-handover (docs/handover.md, "Egress connections").
    let node_handover = config
        .node
        .as_ref()
        .is_some_and(|node| node.handover_socket.is_some());
    let egress_handover = (node_handover || config.egress_handover.is_some()).then(|| {
        let (inherited, arriving) = tokio::sync::mpsc::unbounded_channel();
        let handover = konnectivity_node::sessions::EgressHandover {
            handoff: konnectivity_node::handoff::HandOff::new(),
            inherited,
        };
        (handover, arriving)
    });
    let settings = SessionSettings {
        handoff: egress_handover
            .as_ref()
            .map(|(handover, _)| session::SessionHandOff(handover.handoff.clone())),
        dial_timeout: config.dial_timeout,
        endpoint_limit: konnectivity_plumbing::limit::Limit::from_flag(
            "max-endpoint-connections",
            config.max_endpoint_connections,
        ),
        mark: config.node.as_ref().map(|node| node.mark),
        resume_timeout: config.resume_timeout,
        stopping,
    };
    // The one start-up line at -v=0 (the flags follow at -v=1).
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        agent_id = %config.agent_id,
        server = %config.server_hosts.iter().map(|a| format!("{}:{}", a.host, a.port)).collect::<Vec<_>>().join(","),
        dial_every_address = config.dial_every_address,
        worker_threads = tokio::runtime::Handle::current().metrics().num_workers(),
        "proxy-agent started"
    );

    // On a worker thread of its own rather than in the caller's block_on:
    // every packet wakes this task, and workers wake each other cheaply.
    let backoff = Backoff::new(config.sync_interval, config.sync_interval_cap);
    let (inherited_target, inherited_settings) = (target.clone(), settings.clone());
    let sync = servers::SyncSettings {
        probe_interval: config.probe_interval,
        sync_forever: config.sync_forever,
        rediscover_every: config.sync_interval_cap,
    };
    // Held for as long as the agent runs: dropping it stops the counting.
    let mut lease_count = None;
    let egress = if config.dial_every_address {
        if config.lease_counting.is_some() {
            tracing::warn!(
                "--count-server-leases is not applied: every server address is dialed directly, whatever the count"
            );
        }
        tokio::spawn(servers::serve_each(
            target,
            config.server_hosts.clone(),
            settings,
            sync,
            metrics.clone(),
            drain,
            backoff,
        ))
    } else {
        lease_count = config
            .lease_counting
            .clone()
            .map(|counting| leases::LeaseCount::start(counting, metrics.clone()));
        let count_source = servers::ServerCountSource {
            max: config.server_count_max,
            leases: lease_count.as_ref().map(leases::LeaseCount::subscribe),
        };
        tokio::spawn(servers::serve(
            target,
            settings,
            sync,
            count_source,
            metrics.clone(),
            drain,
            backoff,
        ))
    };
    let mut egress = AbortOnDrop(egress);
    let mut egress_handover_task = None;
    if let (Some(plain), Some((handover, _)), Some(handed)) =
        (&config.egress_handover, &egress_handover, egress_handed)
    {
        egress_handover_task = Some(AbortOnDrop(tokio::spawn(handover::run(
            plain.socket.clone(),
            handover.clone(),
            metrics.clone(),
            handed,
        ))));
    }
    let _egress_handover_task = egress_handover_task;
    let (egress_handover, _inherited) = match egress_handover {
        Some((handover, arriving)) => {
            let inherited = tokio::spawn(servers::serve_inherited(
                arriving,
                inherited_target,
                inherited_settings,
                config.probe_interval,
                metrics.clone(),
                Backoff::new(config.sync_interval, config.sync_interval_cap),
            ));
            (Some(handover), Some(AbortOnDrop(inherited)))
        }
        None => (None, None),
    };
    let _lease_count = lease_count;
    let (Some(node), Some(readiness)) = (&config.node, node_readiness) else {
        let _ = (&mut egress.0).await;
        return Ok(());
    };
    let node_tls = tls::client_config(config.ca_cert.as_ref(), Some(&node.identity), &[b"h2"])?;
    let node_settings = NodeSettings {
        captures: node.captures.clone(),
        capture_port: node.capture_port,
        mark: node.mark,
        server_hosts: NodeSettings::hosts_in_node_order(
            &config
                .server_hosts
                .iter()
                .map(|address| address.host.clone())
                .collect::<Vec<_>>(),
            &config.agent_id,
        ),
        node_frontend_port: node.node_frontend_port,
        tls: Arc::new(node_tls),
        sync_interval: config.sync_interval,
        sync_interval_cap: config.sync_interval_cap,
        cni: node.cni.clone(),
        handover_socket: node.handover_socket.clone(),
        resume_timeout: config.resume_timeout,
        egress: egress_handover,
    };
    let health = HealthService {
        addr: config.health_addr,
        admin_addr: config.admin_addr,
        profiling: config.profiling,
        endpoints,
    };
    tokio::select! {
        result = konnectivity_node::role::run(node_settings, metrics.node.clone(), readiness, health) => result?,
        _ = &mut egress.0 => return Ok(()),
    }
    // Handed over: the server streams drain and carry their connections on.
    let _ = (&mut egress.0).await;
    Ok(())
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
