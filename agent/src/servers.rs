//! The agent's connections to proxy-servers. Servers behind one address (a
//! load balancer) each announce their `serverid` and how many there are
//! (`servercount`); the agent keeps dialing the address until it holds a
//! stream to that many distinct servers, so every server can reach it.
//! A second stream to a server it already holds is closed at once.
//!
//! Each held connection to one of our servers is probed every
//! `--probe-interval` with a stream that the server answers at once and
//! does not register ([`PROBE`](konnectivity_proto::metadata::PROBE)): a
//! server that stopped answering is dropped and redialed long before a
//! keepalive would notice, and, with `--sync-forever`, the answers keep the
//! server count current without a new connection. Upstream servers are not
//! probed (they would register each probe as an agent stream).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use konnectivity_plumbing::lifecycle::Watcher;
use konnectivity_plumbing::metrics::GaugeGuard;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tonic::transport::Channel;

use crate::Backoff;
use crate::metrics::AgentMetrics;
use crate::server_conn::ServerTarget;
use crate::session::{self, SessionSettings, StreamEnd};

/// How often and how eagerly the agent re-checks its servers.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SyncSettings {
    /// `--probe-interval`: how often each held connection is probed.
    pub probe_interval: Duration,
    /// `--sync-forever`: keep the server count current after converging.
    pub sync_forever: bool,
    /// With `--sync-forever`, how often a converged agent still dials the
    /// address (`--sync-interval-cap`), to meet a server that counts
    /// differently from those it holds; upstream redials every
    /// `--sync-interval`.
    pub rediscover_every: Duration,
}

/// Where the number of servers to hold comes from: the servers' own
/// `serverCount`, the valid Leases (`--count-server-leases`), or the larger
/// of both (`--server-count-source=max`), as upstream combines them.
pub(crate) struct ServerCountSource {
    /// `--server-count-source=max`.
    pub max: bool,
    /// The Lease count, with `--count-server-leases`.
    pub leases: Option<watch::Receiver<u32>>,
}

impl ServerCountSource {
    /// How many servers to hold, given the count the servers announced.
    fn wanted(&self, announced: u32) -> usize {
        let announced = announced.max(1);
        let count = match &self.leases {
            None => announced,
            Some(leases) if self.max => (*leases.borrow()).max(announced),
            Some(leases) => *leases.borrow(),
        };
        count.max(1) as usize
    }

    /// Resolves when the Lease count changes; never without Leases.
    async fn changed(&mut self) {
        match &mut self.leases {
            Some(leases) => {
                if leases.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
            None => std::future::pending().await,
        }
    }
}

/// What the tasks of held connections report to the loop.
enum Report {
    /// The stream to this server ended.
    Ended(String),
    /// A probe of a held server answered with this count.
    ServerCount(u32),
}

/// Holds streams to `servercount` distinct servers, forever: dials with
/// upstream's backoff while short of them, waits for a loss once converged.
pub(crate) async fn serve(
    target: ServerTarget,
    settings: SessionSettings,
    sync: SyncSettings,
    mut count_source: ServerCountSource,
    metrics: Arc<AgentMetrics>,
    drain: Watcher,
    mut backoff: Backoff,
) {
    let (report_tx, mut reports) = mpsc::unbounded_channel::<Report>();
    let mut held: HashMap<String, SessionTask> = HashMap::new();
    // Until a server says otherwise there is one.
    let mut announced: u32 = 1;
    let apply = |report: Report, held: &mut HashMap<String, SessionTask>, announced: &mut u32| match report {
        Report::Ended(server_id) => {
            held.remove(&server_id);
        }
        Report::ServerCount(count) => {
            if sync.sync_forever && count != *announced {
                tracing::info!(from = *announced, to = count, "server count changed");
                *announced = count;
            }
        }
    };
    let mut wanted = 0;
    loop {
        while let Ok(report) = reports.try_recv() {
            apply(report, &mut held, &mut announced);
        }
        let now_wanted = count_source.wanted(announced);
        if now_wanted != wanted {
            wanted = now_wanted;
            metrics.known_server_count.set(wanted as i64);
        }
        if held.len() >= wanted {
            // Converged: nothing to dial until a stream ends, the count
            // grows, or (with --sync-forever) it is time to look around.
            let rediscover = async {
                if sync.sync_forever {
                    tokio::time::sleep(sync.rediscover_every).await;
                } else {
                    std::future::pending::<()>().await;
                }
            };
            tokio::select! {
                Some(report) = reports.recv() => {
                    apply(report, &mut held, &mut announced);
                    backoff.reset();
                    continue;
                }
                () = count_source.changed() => {
                    backoff.reset();
                    continue;
                }
                () = rediscover => {}
            }
        }
        match target.connect(&metrics).await {
            Ok(stream) => {
                announced = stream.server_count;
                wanted = count_source.wanted(announced);
                metrics.known_server_count.set(wanted as i64);
                if held.contains_key(&stream.server_id) {
                    tracing::debug!(server_id = %stream.server_id, "already connected to this server; closing the duplicate");
                } else {
                    tracing::info!(
                        server_id = %stream.server_id,
                        server_count = stream.server_count,
                        flow_control = stream.flow_control,
                        connected = held.len() + 1,
                        "connected to proxy-server"
                    );
                    let server_id = stream.server_id.clone();
                    let probe = stream.flow_control.then(|| Probe {
                        target: target.clone(),
                        channel: stream.channel.clone(),
                        every: sync.probe_interval,
                    });
                    let run = session::run(
                        stream.inbound,
                        stream.outbound,
                        stream.flow_control,
                        settings.clone(),
                        metrics.clone(),
                        drain.clone(),
                    );
                    let open = GaugeGuard::new(&metrics.open_server_connections);
                    let reports = report_tx.clone();
                    let id = server_id.clone();
                    // The server's id on every line the session logs, so
                    // that its tunnels line up with that server's logs.
                    let span = tracing::info_span!("server stream", server_id = %id);
                    let task = tokio::spawn(tracing::Instrument::instrument(
                        async move {
                            let _open = open;
                            let reason = tokio::select! {
                                reason = run => reason,
                                failure = watch_server(probe, &reports) => failure,
                            };
                            match &reason {
                                StreamEnd::ServerWentAway(_) => {
                                    tracing::info!(%reason, "proxy-server stream ended; reconnecting")
                                }
                                StreamEnd::Failed(_) => {
                                    tracing::warn!(%reason, "lost proxy-server stream")
                                }
                            }
                            let _ = reports.send(Report::Ended(id));
                        },
                        span,
                    ));
                    held.insert(server_id, SessionTask(task));
                    backoff.reset();
                    if held.len() >= wanted {
                        continue;
                    }
                }
            }
            Err(error) => match konnectivity_plumbing::tls::explain_handshake_failure(&error) {
                Some(problem) => {
                    tracing::warn!(%problem, host = %target.host, port = target.port, "cannot connect to proxy-server: TLS refused")
                }
                None => {
                    tracing::warn!(error = %konnectivity_plumbing::error_chain(&error), "cannot connect to proxy-server")
                }
            },
        }
        tokio::time::sleep(backoff.next_delay()).await;
    }
}

/// How to probe one held connection.
struct Probe {
    target: ServerTarget,
    channel: Channel,
    every: Duration,
}

/// Probes the connection until a probe fails, and returns why; never
/// returns for servers that are not probed.
async fn watch_server(probe: Option<Probe>, reports: &mpsc::UnboundedSender<Report>) -> StreamEnd {
    let Some(probe) = probe else {
        return std::future::pending().await;
    };
    loop {
        tokio::time::sleep(probe.every).await;
        // A probe's own wait is bounded by the headers timeout; an interval
        // shorter than that must not let probes pile up, hence in sequence.
        match probe.target.probe(&probe.channel).await {
            Ok(answer) => {
                let _ = reports.send(Report::ServerCount(answer.server_count));
            }
            Err(error) => {
                return StreamEnd::Failed(format!(
                    "probe failed: {}",
                    konnectivity_plumbing::error_chain(&error)
                ));
            }
        }
    }
}

/// A session's task; dropping it (the agent stopping) ends the session.
struct SessionTask(JoinHandle<()>);

impl Drop for SessionTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}
