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

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use konnectivity_plumbing::lifecycle::Watcher;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tonic::transport::Channel;

use crate::metrics::AgentMetrics;
use crate::server_conn::{ConnectError, ServerStream, ServerTarget};
use crate::session::{self, SessionSettings, StreamEnd};
use konnectivity_node::sessions::{HandedSession, SessionState};
use konnectivity_plumbing::backoff::Backoff;

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

/// Which held stream a report is about: by server id when the servers
/// share one address, by address when each is dialed at its own.
#[derive(Clone, Debug, PartialEq, Eq)]
enum StreamKey {
    Server(String),
    Address(SocketAddr),
}

/// What the tasks of held connections report to the loop.
enum Report {
    /// The stream to this server ended, and its session with it.
    Ended(StreamKey),
    /// The stream to this server was lost; its session waits for a stream
    /// that resumes it (docs/resume.md).
    Lost(StreamKey),
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
    // Sessions whose stream was lost, by server: dialed for at once and
    // until a stream reaches that server again (behind a load balancer, as
    // many dials as it takes) or the session gives up.
    let mut parked: HashMap<String, SessionTask> = HashMap::new();
    // Until a server says otherwise there is one.
    let mut announced: u32 = 1;
    let apply = |report: Report,
                 held: &mut HashMap<String, SessionTask>,
                 parked: &mut HashMap<String, SessionTask>,
                 announced: &mut u32| match report {
        Report::Ended(key) => {
            if let StreamKey::Server(server_id) = key {
                held.remove(&server_id);
                parked.remove(&server_id);
            }
        }
        Report::Lost(key) => {
            if let StreamKey::Server(server_id) = key
                && let Some(task) = held.remove(&server_id)
            {
                parked.insert(server_id, task);
            }
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
        if settings.stopping.as_ref().is_some_and(Watcher::is_signaled) || settings.handed_over() {
            // The agent is exiting, or a successor took its sessions: the
            // sessions left end their streams or drain; no new stream is
            // opened meanwhile.
            std::future::pending::<()>().await;
        }
        while let Ok(report) = reports.try_recv() {
            apply(report, &mut held, &mut parked, &mut announced);
        }
        let now_wanted = count_source.wanted(announced);
        if now_wanted != wanted {
            wanted = now_wanted;
            metrics.known_server_count.set(wanted as i64);
        }
        if held.len() >= wanted && !parked.is_empty() {
            // As many servers as there are are held, none of them the lost
            // stream's: that server is gone (replaced by a restart, say),
            // and its connections with it.
            for (server_id, _) in parked.drain() {
                tracing::info!(%server_id, held = held.len(), "the lost stream's server is not among the servers now held; its connections close");
            }
        }
        if held.len() >= wanted && parked.is_empty() {
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
                    apply(report, &mut held, &mut parked, &mut announced);
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
        let tokens: Vec<String> = parked.values().filter_map(SessionTask::resume_token).collect();
        match target.connect(&metrics, &tokens).await {
            Ok(stream) => {
                announced = stream.server_count;
                wanted = count_source.wanted(announced);
                metrics.known_server_count.set(wanted as i64);
                let stream = match parked.remove(&stream.server_id) {
                    Some(task) => match task.resume(stream, &target, sync.probe_interval, &report_tx) {
                        Resumed::Yes(task) => {
                            held.insert(task.server_id.clone(), task);
                            backoff.reset();
                            continue;
                        }
                        // Not resumed (this server no longer resumes): the
                        // lost stream's session ends; this one is new.
                        Resumed::Not(stream) => *stream,
                        Resumed::SessionEnded => continue,
                    },
                    None => stream,
                };
                if held.contains_key(&stream.server_id) {
                    tracing::debug!(server_id = %stream.server_id, "already connected to this server; closing the duplicate");
                    drop(stream);
                    tokio::time::sleep(wait_after(Dialed::Duplicate, &mut backoff)).await;
                    continue;
                } else {
                    tracing::info!(
                        server_id = %stream.server_id,
                        server_count = stream.server_count,
                        flow_control = stream.extensions.flow_control(),
                        connected = held.len() + 1,
                        "connected to proxy-server"
                    );
                    let server_id = stream.server_id.clone();
                    let task = start_session(
                        stream,
                        &target,
                        StreamKey::Server(server_id.clone()),
                        &settings,
                        sync.probe_interval,
                        &metrics,
                        &drain,
                        &report_tx,
                    );
                    held.insert(server_id, task);
                    backoff.reset();
                    if held.len() >= wanted && parked.is_empty() {
                        continue;
                    }
                }
            }
            Err(ConnectError::ResumeRefused { server_id, .. }) if parked.contains_key(&server_id) => {
                // The server has no session for it any more (its resume
                // timeout ran out, or it restarted): give the lost stream
                // up and connect afresh at once.
                tracing::warn!(%server_id, "proxy-server refused to resume the lost stream; its connections close");
                parked.remove(&server_id);
                continue;
            }
            Err(error) => log_connect_failure(&target, &error),
        }
        tokio::time::sleep(wait_after(Dialed::Failed, &mut backoff)).await;
    }
}

/// How a dial for one more server ended, for [`wait_after`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dialed {
    /// Reached a server already held: behind a balancer, as likely as not.
    Duplicate,
    /// Reached no server (or reached a new one while more are wanted: the
    /// backoff was reset then, and this is its first step).
    Failed,
}

/// The wait before the next dial. Reaching a server already held is no
/// failure: the next dial comes a --sync-interval (jittered) later, as
/// upstream's agent does, however many came before. Backing off instead
/// left an agent behind a balancer, after a few unlucky picks, dialing
/// every --sync-interval-cap for the server it lacked; real failures back
/// off by half each time, up to the cap.
fn wait_after(dialed: Dialed, backoff: &mut Backoff) -> Duration {
    if dialed == Dialed::Duplicate {
        backoff.reset();
    }
    backoff.next_delay()
}

/// Serves the sessions the previous agent handed over (docs/handover.md,
/// "Egress connections") as they arrive: each on a stream of its own to the
/// server its token names, until its connections have all ended.
pub(crate) async fn serve_inherited(
    mut inherited: mpsc::UnboundedReceiver<HandedSession>,
    target: ServerTarget,
    settings: SessionSettings,
    probe_interval: Duration,
    metrics: Arc<AgentMetrics>,
    backoff: Backoff,
) {
    let mut sessions = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            handed = inherited.recv() => match handed {
                Some(handed) => {
                    let retiring = retire(handed, target.clone(), settings.clone(), probe_interval, metrics.clone(), backoff.clone());
                    sessions.spawn(retiring);
                }
                None => break,
            },
            Some(_) = sessions.join_next(), if !sessions.is_empty() => {}
        }
    }
    while sessions.join_next().await.is_some() {}
}

/// Resumes one inherited session: dials, as the agent that opened it, until
/// a stream reaches its server and resumes it (within `--resume-timeout`),
/// again whenever that stream is lost, and serves it until it ends.
async fn retire(
    handed: HandedSession,
    target: ServerTarget,
    settings: SessionSettings,
    probe_interval: Duration,
    metrics: Arc<AgentMetrics>,
    mut backoff: Backoff,
) {
    let state = handed.state.clone();
    let target = ServerTarget {
        agent_id: state.agent_id.clone(),
        resume: true,
        ..target
    };
    let target = match state.address {
        Some(addr) => target.at(addr),
        None => target,
    };
    let timeout = settings.resume_timeout;
    let lost = Arc::new(tokio::sync::Notify::new());
    let (attach, attachments) = mpsc::channel(1);
    let resume = session::Resume {
        timeout,
        attachments,
        on_lost: {
            let lost = lost.clone();
            Box::new(move || lost.notify_one())
        },
        handover: Some(state.clone()),
    };
    let span = tracing::info_span!("server stream", server_id = %state.server_id, handed_over = true);
    let session = tracing::Instrument::instrument(
        session::run_inherited(handed, settings, metrics.clone(), resume),
        span.clone(),
    );
    tokio::pin!(session);
    // Probes' server counts have nowhere to go: this stream is not counted.
    let (reports, _) = mpsc::unbounded_channel();
    let dialing = async move {
        let mut resumed = false;
        'dialing: loop {
            let deadline = Instant::now() + timeout;
            loop {
                match target.connect(&metrics, std::slice::from_ref(&state.token)).await {
                    Ok(stream) if stream.resumed && stream.server_id == state.server_id => {
                        let _ = attach
                            .send(attached(stream, &target, probe_interval, &reports))
                            .await;
                        if !resumed {
                            resumed = true;
                            metrics.node.sessions_taken_over(1, 0);
                        }
                        backoff.reset();
                        break;
                    }
                    // Another server behind the address: this one ends with
                    // STREAM_END as it drops, and the address is dialed again.
                    Ok(stream) => {
                        tracing::debug!(server_id = %stream.server_id, "reached another server than the handed session's; dialing again")
                    }
                    Err(ConnectError::ResumeRefused { .. }) => {
                        tracing::warn!(
                            "proxy-server refused to resume the session handed over; its connections close"
                        );
                        break 'dialing;
                    }
                    Err(error) => log_connect_failure(&target, &error),
                }
                if Instant::now() >= deadline {
                    break 'dialing;
                }
                tokio::time::sleep(backoff.next_delay()).await;
            }
            lost.notified().await;
        }
        if !resumed {
            metrics.node.sessions_taken_over(0, 1);
        }
    };
    let reason = tokio::select! {
        reason = &mut session => reason,
        // Given up: the session ends as its attachments close.
        () = dialing => session.await,
    };
    span.in_scope(|| match &reason {
        StreamEnd::Failed(_) => tracing::warn!(%reason, "session handed over by the previous agent ended"),
        _ => tracing::info!(%reason, "session handed over by the previous agent ended"),
    });
}

/// The agent's flags, named when its connection to a server fails.
pub(crate) const AGENT_TLS_FLAGS: konnectivity_plumbing::tls::ClientFlags =
    konnectivity_plumbing::tls::ClientFlags {
        ca: "ca-cert",
        cert: "agent-cert",
        key: "agent-key",
        host: "proxy-server-host",
    };

fn log_connect_failure(target: &ServerTarget, error: &ConnectError) {
    match konnectivity_plumbing::tls::explain_client_failure(error, &target.host, AGENT_TLS_FLAGS) {
        Some(problem) => {
            tracing::warn!(%problem, server = %target.address(), "cannot connect to proxy-server: TLS refused")
        }
        None => {
            tracing::warn!(error = %konnectivity_plumbing::error_chain(error), "cannot connect to proxy-server")
        }
    }
}

/// One server address the agent dials directly.
struct Slot {
    /// The name it was found under: the server's certificate must carry it.
    host: String,
    state: SlotState,
    /// When to dial it next while idle.
    retry_at: Instant,
    backoff: Backoff,
    /// Whether the last look-up still returned it; an address that is gone
    /// is forgotten once its stream ends.
    listed: bool,
}

enum SlotState {
    Idle,
    /// A dial is out; with the session of the lost stream it should
    /// resume, if any.
    Dialing(Option<SessionTask>),
    /// Holding a stream to this server (dropping the task ends it).
    Held(SessionTask),
    /// The stream was lost; its session waits for a stream that resumes it.
    Parked(SessionTask),
}

impl SlotState {
    /// Nothing is held or dialed for the slot now: it may be dialed.
    fn waiting(&self) -> bool {
        matches!(self, SlotState::Idle | SlotState::Parked(_))
    }
}

/// Holds one stream to every address of `hosts` (`--proxy-server-host` with
/// several hosts, or `--dial-every-address`): each address is a server,
/// dialed directly, so no load balancer is needed in front of them. Each
/// address has its own backoff; the names are looked up again every
/// `rediscover_every`, so servers that join (a headless Service gaining an
/// endpoint) are dialed and those that left are forgotten.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn serve_each(
    target: ServerTarget,
    hosts: Vec<crate::config::ServerAddress>,
    settings: SessionSettings,
    sync: SyncSettings,
    metrics: Arc<AgentMetrics>,
    drain: Watcher,
    backoff: Backoff,
) {
    let (report_tx, mut reports) = mpsc::unbounded_channel::<Report>();
    let (attempt_tx, mut attempts) =
        mpsc::unbounded_channel::<(SocketAddr, Result<ServerStream, ConnectError>)>();
    let mut slots: BTreeMap<SocketAddr, Slot> = BTreeMap::new();
    let mut next_lookup = Instant::now();
    loop {
        if settings.stopping.as_ref().is_some_and(Watcher::is_signaled) || settings.handed_over() {
            // The agent is exiting, or a successor took its sessions: the
            // sessions left end their streams or drain; no new stream is
            // opened meanwhile.
            std::future::pending::<()>().await;
        }
        let now = Instant::now();
        if now >= next_lookup {
            let found = look_up(&hosts).await;
            for slot in slots.values_mut() {
                slot.listed = false;
            }
            for (addr, host) in found {
                let slot = slots.entry(addr).or_insert_with(|| {
                    tracing::info!(%addr, %host, "proxy-server address found");
                    Slot {
                        host,
                        state: SlotState::Idle,
                        retry_at: now,
                        backoff: backoff.clone(),
                        listed: true,
                    }
                });
                slot.listed = true;
            }
            slots.retain(|addr, slot| {
                let keep = slot.listed || !matches!(slot.state, SlotState::Idle);
                if !keep {
                    tracing::info!(%addr, "proxy-server address no longer listed; forgotten");
                }
                keep
            });
            metrics.known_server_count.set(slots.len() as i64);
            next_lookup = now + sync.rediscover_every;
        }
        for (addr, slot) in slots.iter_mut() {
            if slot.state.waiting() && slot.retry_at <= now {
                let parked = match std::mem::replace(&mut slot.state, SlotState::Idle) {
                    SlotState::Parked(task) => Some(task),
                    _ => None,
                };
                let tokens: Vec<String> = parked.iter().filter_map(SessionTask::resume_token).collect();
                slot.state = SlotState::Dialing(parked);
                let dial = ServerTarget {
                    host: slot.host.clone(),
                    ..target.clone()
                }
                .at(*addr);
                let (addr, attempts, metrics) = (*addr, attempt_tx.clone(), metrics.clone());
                tokio::spawn(async move {
                    let _ = attempts.send((addr, dial.connect(&metrics, &tokens).await));
                });
            }
        }
        let wake_at = slots
            .values()
            .filter(|slot| slot.state.waiting())
            .map(|slot| slot.retry_at)
            .fold(next_lookup, Instant::min);
        tokio::select! {
            Some(report) = reports.recv() => match report {
                Report::Ended(StreamKey::Address(addr)) => {
                    if let Some(slot) = slots.get_mut(&addr) {
                        match &mut slot.state {
                            SlotState::Held(_) | SlotState::Parked(_) => {
                                slot.state = SlotState::Idle;
                                slot.retry_at = Instant::now() + slot.backoff.next_delay();
                            }
                            // The lost session gave up (its --resume-timeout
                            // ran out) while a dial to resume it is out: the
                            // dial's stream is a new one, or, if the server
                            // resumed the session on it, dropped (below).
                            SlotState::Dialing(parked) => *parked = None,
                            SlotState::Idle => {}
                        }
                    }
                }
                Report::Lost(StreamKey::Address(addr)) => {
                    if let Some(slot) = slots.get_mut(&addr)
                        && let SlotState::Held(task) = std::mem::replace(&mut slot.state, SlotState::Idle)
                    {
                        // Dialed again at once.
                        slot.state = SlotState::Parked(task);
                        slot.retry_at = Instant::now();
                        slot.backoff.reset();
                    }
                }
                _ => {}
            },
            Some((addr, result)) = attempts.recv() => {
                let held_elsewhere = slots_ids(&slots, addr);
                let Some(slot) = slots.get_mut(&addr) else { continue };
                let parked = match std::mem::replace(&mut slot.state, SlotState::Idle) {
                    SlotState::Dialing(parked) => parked,
                    _ => None,
                };
                let dial = ServerTarget { host: slot.host.clone(), ..target.clone() }.at(addr);
                let result = match (parked, result) {
                    (Some(task), Ok(stream)) => match task.resume(stream, &dial, sync.probe_interval, &report_tx) {
                        Resumed::Yes(task) => {
                            slot.state = SlotState::Held(task);
                            slot.backoff.reset();
                            continue;
                        }
                        Resumed::Not(stream) => Ok(*stream),
                        Resumed::SessionEnded => {
                            slot.retry_at = Instant::now();
                            continue;
                        }
                    },
                    (Some(_), Err(ConnectError::ResumeRefused { server_id, .. })) => {
                        tracing::warn!(%addr, %server_id, "proxy-server refused to resume the lost stream; its connections close");
                        slot.retry_at = Instant::now();
                        continue;
                    }
                    (Some(task), Err(error)) => {
                        log_connect_failure(&dial, &error);
                        slot.state = SlotState::Parked(task);
                        slot.retry_at = Instant::now() + slot.backoff.next_delay();
                        continue;
                    }
                    (None, Ok(stream)) if stream.resumed => {
                        // Resumed a session that gave up meanwhile (see
                        // Report::Ended): dropping the stream tells the
                        // server; dialed again at once.
                        tracing::info!(server_id = %stream.server_id, "the server resumed a lost stream whose session had given up; connecting afresh");
                        slot.retry_at = Instant::now();
                        continue;
                    }
                    (None, result) => result,
                };
                match result {
                    Ok(stream) => {
                        let duplicate = held_elsewhere.contains(&stream.server_id);
                        if duplicate {
                            // Two addresses of one server (IPv4 and IPv6):
                            // one stream is enough; look again much later.
                            tracing::info!(%addr, server_id = %stream.server_id, "address leads to a server already held; not keeping a second stream");
                            slot.state = SlotState::Idle;
                            slot.retry_at = Instant::now() + sync.rediscover_every;
                        } else {
                            tracing::info!(
                                %addr,
                                server_id = %stream.server_id,
                                flow_control = stream.extensions.flow_control(),
                                "connected to proxy-server"
                            );
                            let task = start_session(
                                stream,
                                &dial,
                                StreamKey::Address(addr),
                                &settings,
                                sync.probe_interval,
                                &metrics,
                                &drain,
                                &report_tx,
                            );
                            slot.state = SlotState::Held(task);
                            slot.backoff.reset();
                        }
                    }
                    Err(error) => {
                        log_connect_failure(&dial, &error);
                        slot.state = SlotState::Idle;
                        slot.retry_at = Instant::now() + slot.backoff.next_delay();
                    }
                }
            }
            () = tokio::time::sleep_until(wake_at.into()) => {}
        }
    }
}

/// The server ids held through addresses other than `except`.
fn slots_ids(slots: &BTreeMap<SocketAddr, Slot>, except: SocketAddr) -> HashSet<String> {
    slots
        .iter()
        .filter(|(addr, _)| **addr != except)
        .filter_map(|(_, slot)| match &slot.state {
            SlotState::Held(task) => Some(task.server_id.clone()),
            _ => None,
        })
        .collect()
}

/// Every address of every host, with the host it came from; a host that
/// does not resolve is logged and skipped (its servers may come back).
async fn look_up(hosts: &[crate::config::ServerAddress]) -> Vec<(SocketAddr, String)> {
    let mut found = Vec::new();
    for address in hosts {
        match tokio::net::lookup_host((address.host.as_str(), address.port)).await {
            Ok(addrs) => found.extend(addrs.map(|addr| (addr, address.host.clone()))),
            Err(error) => tracing::warn!(host = %address.host, %error, "cannot look up proxy-server host"),
        }
    }
    found
}

/// Serves `stream` in a task of its own, probing the server when it is one
/// of ours; reports `key` as lost when the stream is lost and its session
/// waits for a resume, and as ended when the session ends.
#[allow(clippy::too_many_arguments)]
fn start_session(
    stream: ServerStream,
    target: &ServerTarget,
    key: StreamKey,
    settings: &SessionSettings,
    probe_interval: Duration,
    metrics: &Arc<AgentMetrics>,
    drain: &Watcher,
    reports: &mpsc::UnboundedSender<Report>,
) -> SessionTask {
    let extensions = stream.extensions;
    let server_id = stream.server_id.clone();
    let (attach, attachments) = mpsc::channel(1);
    let resume_token = stream.resume_token.clone().filter(|_| extensions.resume());
    let resume = resume_token.as_ref().map(|token| {
        let (reports, key) = (reports.clone(), key.clone());
        session::Resume {
            timeout: settings.resume_timeout,
            attachments,
            on_lost: Box::new(move || {
                let _ = reports.send(Report::Lost(key.clone()));
            }),
            handover: Some(SessionState {
                server_id: server_id.clone(),
                token: token.clone(),
                agent_id: target.agent_id.clone(),
                address: target.resolved,
                next_connect_id: 0,
            }),
        }
    });
    let attached = attached(stream, target, probe_interval, reports);
    let run = session::run(
        attached,
        extensions,
        settings.clone(),
        metrics.clone(),
        drain.clone(),
        resume,
    );
    let reports = reports.clone();
    // The server's id on every line the session logs, so that its tunnels
    // line up with that server's logs.
    let span = tracing::info_span!("server stream", server_id = %server_id);
    let task = tokio::spawn(tracing::Instrument::instrument(
        async move {
            let reason = run.await;
            match &reason {
                StreamEnd::ServerWentAway(_) => {
                    tracing::info!(%reason, "proxy-server stream ended; reconnecting")
                }
                StreamEnd::Failed(_) => {
                    tracing::warn!(%reason, "lost proxy-server stream")
                }
                StreamEnd::Stopping | StreamEnd::Retired => {
                    tracing::info!(%reason, "proxy-server stream ended")
                }
                StreamEnd::HandedOver => tracing::info!(%reason, "proxy-server stream handed over"),
            }
            let _ = reports.send(Report::Ended(key));
        },
        span,
    ));
    SessionTask {
        task,
        server_id,
        resume: resume_token.map(|token| (token, attach)),
    }
}

/// What a session serves of `stream`: its packets, its body, and the probes
/// of its connection (for servers that are ours), which tell when the stream
/// is lost while its packets have merely stopped.
fn attached(
    stream: ServerStream,
    target: &ServerTarget,
    probe_interval: Duration,
    reports: &mpsc::UnboundedSender<Report>,
) -> session::Attached {
    // A connection watched by PINGs (ours, negotiated by ALPN) fails its
    // stream by itself when they go unanswered; its probes only ask, now and
    // then, for the server's count and whether its service still answers.
    let every = match stream.pinged {
        true => PINGED_PROBE_INTERVAL.max(probe_interval),
        false => probe_interval,
    };
    let probe = stream.extensions.flow_control().then(|| Probe {
        target: target.clone(),
        channel: stream.channel.clone(),
        every,
    });
    let reports = reports.clone();
    session::Attached {
        inbound: Box::pin(stream.inbound),
        body: stream.body,
        lost: Box::pin(async move { watch_server(probe, &reports).await }),
    }
}

/// How often a connection watched by PINGs is also probed by a stream. A
/// probe stream costs the server a request, its headers and its
/// authentication: once a second at 5,000 agents it took half a CPU of the
/// server in `hack/bench.sh --scale` (README, "Scale").
const PINGED_PROBE_INTERVAL: Duration = Duration::from_secs(30);

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

/// What became of a stream offered to a lost session.
enum Resumed {
    /// The session serves it.
    Yes(SessionTask),
    /// The server did not resume the session on it (the session ends); the
    /// stream is a new one.
    Not(Box<ServerStream>),
    /// The server resumed it, but the session had ended: the stream is
    /// dropped, and the server is dialed again at once.
    SessionEnded,
}

/// A session's task; dropping it (the agent stopping, or giving up a lost
/// stream) ends the session.
struct SessionTask {
    task: JoinHandle<()>,
    server_id: String,
    /// With resume: the token that resumes the session, and where a stream
    /// that resumes it goes.
    resume: Option<(String, mpsc::Sender<session::Attached>)>,
}

impl SessionTask {
    fn resume_token(&self) -> Option<String> {
        self.resume.as_ref().map(|(token, _)| token.clone())
    }

    /// Hands `stream` to this lost session, if the server resumed it on
    /// that stream; otherwise the session ends and the stream is handed back.
    fn resume(
        self,
        stream: ServerStream,
        target: &ServerTarget,
        probe_interval: Duration,
        reports: &mpsc::UnboundedSender<Report>,
    ) -> Resumed {
        let Some((_, attach)) = self.resume.as_ref().filter(|_| stream.resumed) else {
            return Resumed::Not(Box::new(stream));
        };
        // The session may have given up while the dial was under way (its
        // --resume-timeout ran out): the server resumed a session this agent
        // no longer has. Dropping the stream tells the server; holding the
        // ended task in its place would leave that server undialed for good
        // (its report that it ended came while the dial was under way).
        if self.task.is_finished()
            || attach
                .try_send(attached(stream, target, probe_interval, reports))
                .is_err()
        {
            tracing::info!(server_id = %self.server_id, "the server resumed a lost stream whose session had given up; connecting afresh");
            return Resumed::SessionEnded;
        }
        tracing::info!(server_id = %self.server_id, "reached the server of the lost stream again; resumed it");
        Resumed::Yes(self)
    }
}

impl Drop for SessionTask {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dial behind a balancer that reaches a server already held is tried
    /// again a --sync-interval later, the tenth time as the first; failures
    /// back off to the cap.
    #[test]
    fn only_failed_dials_back_off() {
        let (interval, cap) = (Duration::from_secs(1), Duration::from_secs(10));
        let mut backoff = Backoff::new(interval, cap);
        for _ in 0..10 {
            let wait = wait_after(Dialed::Duplicate, &mut backoff);
            assert!(wait < interval.mul_f64(1.2), "a duplicate's wait: {wait:?}");
        }
        let waits: Vec<Duration> = (0..10)
            .map(|_| wait_after(Dialed::Failed, &mut backoff))
            .collect();
        assert!(waits[9] >= cap, "the tenth failure's wait: {:?}", waits[9]);
    }

    fn source(max: bool, leases: Option<u32>) -> ServerCountSource {
        ServerCountSource {
            max,
            leases: leases.map(|count| watch::channel(count).1),
        }
    }

    /// Upstream's aggregate counter: without Leases the servers' count;
    /// with Leases, `default` takes the Leases' count alone and `max` the
    /// larger of the two; never fewer than one.
    #[test]
    fn the_server_count_combines_as_upstreams() {
        let cases = [
            // (max, Lease count, announced by the servers, wanted)
            (false, None, 3, 3),
            (true, None, 3, 3),
            (false, None, 0, 1),
            (false, Some(2), 5, 2),
            (false, Some(4), 1, 4),
            (true, Some(2), 5, 5),
            (true, Some(4), 1, 4),
            (true, Some(0), 0, 1),
            (false, Some(0), 3, 1),
        ];
        for (max, leases, announced, wanted) in cases {
            assert_eq!(
                source(max, leases).wanted(announced),
                wanted,
                "max={max} leases={leases:?} announced={announced}"
            );
        }
    }
}
