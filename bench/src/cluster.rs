//! The cluster scale run (`hack/bench.sh --scale`): one proxy-server under
//! the load of a cluster whose every node runs the node agent, on this
//! machine. Per node: a real egress agent stream (the agents' client
//! certificate, its own agent id) and a real node tunnel (its own node
//! certificate), both from the agent's code, in fleet processes
//! ([`crate::node_fleet`]); through the node tunnels, every node's clients'
//! watches (ten per node by default: kubelet's, kube-proxy's, a CNI
//! daemon's, ...) to a stand-in kube-apiserver behind real control-plane
//! agents (the proxy-agent binary), each watch an event every 30 s on
//! average; and kube-apiserver's own dials (HTTP CONNECT on the server's
//! socket, as kube-apiserver dials logs, exec and webhooks), 500 a second,
//! each 1 KiB there and back to an echo target through the nodes' agents.
//!
//! Measured: the server's memory per node and per captured connection; its
//! CPU per 1,000 events a second; the delay an event and a dial take beyond
//! direct TCP in the same run, with the fleet idle (probe watches only) and
//! loaded; how long all nodes take to be back after the server restarts
//! (agent streams, node tunnels, every watch). With the node role every
//! agent proves itself by certificate (control-plane ids need one, and the
//! server takes no ServiceAccount tokens beside a cluster CA, as upstream's
//! does not): a restart costs kube-apiserver no TokenReview, and the line
//! says 0.
//!
//! With `--servers 2` (or more), each server on an address of its own, as
//! control-plane machines without a balancer: every agent holds a stream to
//! each, every node's tunnel one of them (picked by its agent id), and the
//! run ends by killing one server: how long until the others serve every
//! node, what broke, and whether kube-apiserver's dials through another
//! server noticed; then that server starts again.
//!
//! With `--leases`, the servers publish Leases at a stand-in kube-apiserver
//! and every agent counts them, as an HA control plane without
//! `--server-count` ([`crate::leases`]); the run says what each phase cost
//! kube-apiserver in requests. The last line is for scripts:
//! `scale: nodes=N captured=N kib_per_node=X kib_per_captured=X p99_added_ms=X back_after_restart_s=X reviews_per_token=X`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use crate::args::ClusterArgs;
use crate::cpu::{CpuSnapshot, CpuSpent, Group};
use crate::leases::LeaseApi;
use crate::pki::ClusterPki;
use crate::route::Route;
use crate::stack::{self, Layout, Proc, cpu_ticks, raise_descriptor_limit, scrape_at};

/// The server's metrics this run reads.
const AGENTS: &str = "konnectivity_network_proxy_server_ready_backend_connections";
const HEAP: &str = "konnectivity_network_proxy_server_runtime_heap_bytes";
const NODES: &str = "konnectivity_network_proxy_server_node_frontend_nodes";
/// The server's view of a dial: DIAL_REQ sent until the agent's DIAL_RSP.
const DIALS: &str = "konnectivity_network_proxy_server_dial_duration_seconds_count";
const DIALS_WITHIN_HALF_SECOND: &str =
    "konnectivity_network_proxy_server_dial_duration_seconds_bucket{le=\"0.5\"}";
/// Connections carried over to a new stream (agent streams' and node
/// tunnels'), those a resume could not carry over, and those no stream
/// resumed in time: how much a phase's streams were lost and resumed.
const RESUMED: &str = "konnectivity_network_proxy_server_resumed_connections_total";
const RESUME_DROPPED: &str = "konnectivity_network_proxy_server_resume_dropped_connections_total";
const RESUME_TIMEOUTS: &str = "konnectivity_network_proxy_server_resume_timeouts_total";

/// Where the run's servers listen: with one, loopback's usual address; with
/// several, an address each, all on the same ports (as control-plane
/// machines, which the nodes list in --proxy-server-host).
fn server_hosts(servers: u8) -> Vec<String> {
    if servers == 1 {
        return vec!["127.0.0.1".to_owned()];
    }
    (1..=servers).map(|k| format!("127.0.2.{k}")).collect()
}

/// With `--leases`, the agents' one server address: the balancer's.
const BALANCER_HOST: &str = "127.0.2.100";

/// The ports every server of the run listens on, on its own address.
#[derive(Clone, Copy)]
struct ServerPorts {
    agent: u16,
    node: u16,
}

/// A proxy-server under test.
struct ClusterServer {
    name: String,
    proc: Proc,
    /// `--server-wrapper`.
    wrapper: Option<PathBuf>,
    args: Vec<String>,
    /// On the server's own address: a port of 127.0.0.1 left free by a
    /// killed server is soon taken by one of the run's 100,000 outgoing
    /// connections, and the server would not start again.
    health: SocketAddr,
    uds: PathBuf,
}

impl ClusterServer {
    /// Server `k` of the run, on `host`.
    fn start(
        layout: &Layout,
        pki: &ClusterPki,
        args: &ClusterArgs,
        kas: &[SocketAddr],
        (k, host): (usize, &str),
        ports: ServerPorts,
        leases: Option<&LeaseApi>,
    ) -> anyhow::Result<ClusterServer> {
        let (name, uds) = if args.servers == 1 {
            ("proxy-server".to_owned(), layout.work.join("kas.socket"))
        } else {
            (
                format!("proxy-server-{k}"),
                layout.work.join(format!("kas-{k}.socket")),
            )
        };
        let ip: std::net::IpAddr = host.parse().context("a server's address")?;
        let health = SocketAddr::new(ip, stack::free_port()?);
        let server = pki.server();
        let control_plane: Vec<String> = (0..args.control_plane_agents)
            .map(|k| format!("cp-{k}"))
            .collect();
        let allowed: Vec<String> = kas.iter().map(SocketAddr::to_string).collect();
        let mut flags = vec![
            "--mode=http-connect".to_owned(),
            format!("--uds-name={}", uds.display()),
            "--delete-existing-uds-file".to_owned(),
            "--server-port=0".to_owned(),
            format!("--agent-port={}", ports.agent),
            format!("--agent-bind-address={host}"),
            format!("--cluster-cert={}", server.cert.display()),
            format!("--cluster-key={}", server.key.display()),
            format!("--cluster-ca-cert={}", pki.cluster_ca().display()),
            format!("--node-frontend-port={}", ports.node),
            format!("--node-frontend-bind-address={host}"),
            format!("--node-client-ca-cert={}", pki.node_ca().display()),
            format!("--node-allowed-destinations={}", allowed.join(",")),
            format!("--control-plane-agent-ids={}", control_plane.join(",")),
            format!("--health-port={}", health.port()),
            format!("--health-bind-address={host}"),
            format!("--admin-port={}", stack::free_port()?),
            format!("--admin-bind-address={host}"),
        ];
        // Told how many servers there are, or counted by their Leases.
        match leases {
            Some(leases) => flags.extend(crate::leases::server_flags(&leases.kubeconfig)),
            None => flags.push(format!("--server-count={}", args.servers)),
        }
        let proc = spawn_server(layout, &name, args.server_wrapper.as_deref(), &flags)?;
        Ok(ClusterServer {
            name,
            proc,
            wrapper: args.server_wrapper.clone(),
            args: flags,
            health,
            uds,
        })
    }

    /// SIGKILL, and the same server started again on the same ports.
    fn restart(&mut self, layout: &Layout) -> anyhow::Result<()> {
        self.proc.kill_now();
        self.proc = spawn_server(
            layout,
            &format!("{}-restarted", self.name),
            self.wrapper.as_deref(),
            &self.args,
        )?;
        Ok(())
    }

    async fn metric(&self, name: &str) -> Option<f64> {
        self.metrics(&[name]).await.pop().flatten()
    }

    /// Several metrics from one scrape: each scrape costs the server a walk
    /// of its descriptors (`process_open_fds`), 60,000 of them at 5,000 nodes.
    async fn metrics(&self, names: &[&str]) -> Vec<Option<f64>> {
        let text = scrape_at(self.health).await.unwrap_or_default();
        names
            .iter()
            .map(|name| {
                text.lines()
                    .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
                    .and_then(|value| value.trim().parse().ok())
            })
            .collect()
    }
}

/// Settles, then the servers' resident memory and live heap, together.
async fn memory(servers: &[ClusterServer]) -> anyhow::Result<(f64, f64)> {
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (mut resident, mut heap) = (0.0, 0.0);
    for server in servers {
        heap += server
            .metric(HEAP)
            .await
            .with_context(|| format!("{}'s heap metric", server.name))?;
        resident += server.proc.resident_bytes()? as f64;
    }
    Ok((resident, heap))
}

/// The servers' resume counters, summed ([`RESUMED`] and the rest).
#[derive(Clone, Copy, Default)]
struct ResumeCounts {
    resumed: f64,
    dropped: f64,
    timed_out: f64,
}

impl ResumeCounts {
    async fn of(servers: &[ClusterServer]) -> ResumeCounts {
        let mut counts = ResumeCounts::default();
        for server in servers {
            let read = server.metrics(&[RESUMED, RESUME_DROPPED, RESUME_TIMEOUTS]).await;
            let value = |i: usize| read[i].unwrap_or(0.0);
            counts.resumed += value(0);
            counts.dropped += value(1);
            counts.timed_out += value(2);
        }
        counts
    }

    fn since(self, before: ResumeCounts) -> ResumeCounts {
        ResumeCounts {
            resumed: self.resumed - before.resumed,
            dropped: self.dropped - before.dropped,
            timed_out: self.timed_out - before.timed_out,
        }
    }

    fn cells(self) -> String {
        format!(
            "{:.0} / {:.0} / {:.0}",
            self.resumed, self.dropped, self.timed_out
        )
    }
}

/// The servers' CPU time so far, in ticks.
fn servers_cpu_ticks(servers: &[ClusterServer]) -> anyhow::Result<u64> {
    servers.iter().map(|server| cpu_ticks(&server.proc)).sum()
}

/// proxy-server with `flags`, under `wrapper` if given.
fn spawn_server(
    layout: &Layout,
    name: &str,
    wrapper: Option<&std::path::Path>,
    flags: &[String],
) -> anyhow::Result<Proc> {
    let server = layout.bin_dir.join("proxy-server");
    match wrapper {
        Some(wrapper) => {
            let mut wrapped = vec![server.display().to_string()];
            wrapped.extend(flags.iter().cloned());
            stack::spawn(layout, name, wrapper, &wrapped)
        }
        None => stack::spawn(layout, name, &server, flags),
    }
}

/// The fleet processes, through their control ports.
struct Fleets {
    procs: Vec<Proc>,
    controls: Vec<u16>,
}

/// What all fleets said.
#[derive(Default, Debug)]
struct FleetStats {
    tunnels_up: usize,
    bulk_up: usize,
    /// Asked for long ago and not answered (see `watch::WatchStats::stuck`).
    bulk_stuck: usize,
    bulk_broken: u64,
    bulk: Vec<u32>,
    probe_node: Vec<u32>,
    probe_direct: Vec<u32>,
}

impl Fleets {
    async fn ask(&self, command: &str) -> anyhow::Result<Vec<Value>> {
        let mut answers = Vec::new();
        for port in &self.controls {
            let mut stream = TcpStream::connect(("127.0.0.1", *port)).await?;
            stream.write_all(format!("{command}\n").as_bytes()).await?;
            let mut line = String::new();
            BufReader::new(stream).read_line(&mut line).await?;
            answers.push(serde_json::from_str(&line)?);
        }
        Ok(answers)
    }

    async fn stats(&self) -> anyhow::Result<FleetStats> {
        let mut all = FleetStats::default();
        let delays = |value: &Value| -> Vec<u32> {
            value["delays_us"]
                .as_array()
                .map(|list| list.iter().filter_map(|d| d.as_u64()).map(|d| d as u32).collect())
                .unwrap_or_default()
        };
        for answer in self.ask("stats").await? {
            all.tunnels_up += answer["tunnels_up"].as_u64().unwrap_or(0) as usize;
            all.bulk_up += answer["bulk"]["up"].as_u64().unwrap_or(0) as usize;
            all.bulk_stuck += answer["bulk"]["stuck"].as_u64().unwrap_or(0) as usize;
            all.bulk_broken += answer["bulk"]["broken"].as_u64().unwrap_or(0);
            all.bulk.extend(delays(&answer["bulk"]));
            all.probe_node.extend(delays(&answer["probe_node"]));
            all.probe_direct.extend(delays(&answer["probe_direct"]));
        }
        Ok(all)
    }
}

/// Percentiles of delays in microseconds, as milliseconds.
#[derive(Debug, Clone, Copy, Default)]
struct Spread {
    p50: f64,
    p99: f64,
    max: f64,
    count: usize,
}

impl Spread {
    fn of(mut micros: Vec<u32>) -> Spread {
        if micros.is_empty() {
            return Spread::default();
        }
        micros.sort_unstable();
        let at = |q: f64| micros[((micros.len() - 1) as f64 * q) as usize] as f64 / 1000.0;
        Spread {
            p50: at(0.5),
            p99: at(0.99),
            max: at(1.0),
            count: micros.len(),
        }
    }

    fn minus(self, base: Spread) -> Spread {
        Spread {
            p50: self.p50 - base.p50,
            p99: self.p99 - base.p99,
            max: self.max - base.max,
            count: self.count,
        }
    }

    fn cells(self) -> String {
        format!("{:.2} / {:.2} / {:.2}", self.p50, self.p99, self.max)
    }
}

/// One measurement window: the delays of events and dials, and the
/// server's CPU.
struct Window {
    probe_node: Spread,
    probe_direct: Spread,
    bulk: Spread,
    dial_tunnel: Spread,
    dial_direct: Spread,
    dial_failures: usize,
    events_per_second: f64,
    server_cpu: f64,
}

/// kube-apiserver's dials for `length` at `rate` a second, each 1 KiB to the
/// echo target and back, through `route`: their delays (µs) and failures.
async fn dials(route: Route, echo: SocketAddr, rate: u64, length: Duration) -> (Vec<u32>, usize) {
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate as f64));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let ends = Instant::now() + length;
    let mut running = tokio::task::JoinSet::new();
    while Instant::now() < ends {
        tick.tick().await;
        let route = route.clone();
        running.spawn(async move {
            let started = Instant::now();
            let mut conn = route.open(echo).await?;
            let payload = [7u8; 1024];
            conn.write_all(&payload).await?;
            let mut back = [0u8; 1024];
            conn.read_exact(&mut back).await?;
            anyhow::ensure!(back == payload, "the echo came back changed");
            Ok::<_, anyhow::Error>(started.elapsed().as_micros() as u32)
        });
    }
    let (mut delays, mut failed) = (Vec::new(), 0);
    while let Some(done) = running.join_next().await {
        match done {
            Ok(Ok(delay)) => delays.push(delay),
            _ => failed += 1,
        }
    }
    (delays, failed)
}

/// One window: kube-apiserver's dials through the first server (the other
/// servers' sockets serve their own kube-apiservers alike), and the CPU of
/// all servers.
async fn measure(
    servers: &[ClusterServer],
    fleets: &Fleets,
    echo: SocketAddr,
    args: &ClusterArgs,
) -> anyhow::Result<Window> {
    let length = Duration::from_secs(args.measure_s);
    // What was sampled before the window is dropped.
    fleets.stats().await?;
    let (cpu_before, started) = (servers_cpu_ticks(servers)?, Instant::now());
    let half = args.dials_per_second / 2;
    let tunnel = Route::HttpConnect {
        uds: servers[0].uds.clone(),
    };
    let ((mut tunnel_delays, tunnel_failed), (direct_delays, direct_failed)) = tokio::join!(
        dials(tunnel, echo, half.max(1), length),
        dials(Route::Direct, echo, (args.dials_per_second - half).max(1), length),
    );
    let elapsed = started.elapsed().as_secs_f64();
    let server_cpu = (servers_cpu_ticks(servers)? - cpu_before) as f64 / 100.0 / elapsed;
    let stats = fleets.stats().await?;
    let events = stats.bulk.len() + stats.probe_node.len();
    tunnel_delays.shrink_to_fit();
    Ok(Window {
        probe_node: Spread::of(stats.probe_node),
        probe_direct: Spread::of(stats.probe_direct),
        bulk: Spread::of(stats.bulk),
        dial_tunnel: Spread::of(tunnel_delays),
        dial_direct: Spread::of(direct_delays),
        dial_failures: tunnel_failed + direct_failed,
        events_per_second: events as f64 / elapsed,
        server_cpu,
    })
}

/// One server killed while others run.
struct Failover {
    /// Nodes whose tunnel had streams at the server killed.
    nodes_moved: f64,
    /// Watches that broke (their streams lived at the server killed).
    watches_broken: u64,
    /// How long until every node was served by the others, or why not.
    took: String,
    /// kube-apiserver's dials through another server meanwhile.
    dials: Spread,
    dials_failed: usize,
    /// Direct TCP dials meanwhile.
    direct: Spread,
    /// The dials the other server made meanwhile, and how many of them
    /// waited over 0.5 s for the agent's answer (the agent's share).
    server_dials: (f64, f64),
}

/// Kills the last of `servers` (SIGKILL, as a crashed machine's), and waits
/// until the others serve every node: tunnels answering, every watch
/// re-established (a captured connection's stream cannot outlive its
/// server: it lives in that server's memory), while kube-apiserver dials
/// through another server as before.
async fn kill_one(
    servers: &mut [ClusterServer],
    fleets: &Fleets,
    args: &ClusterArgs,
    echo: SocketAddr,
    watches: usize,
) -> anyhow::Result<Failover> {
    let (killed, others) = servers.split_last_mut().context("servers to kill one of")?;
    let nodes_moved = killed.metric(NODES).await.unwrap_or(0.0);
    let broken_before = fleets.stats().await?.bulk_broken;
    killed.proc.kill_now();
    let killed_at = Instant::now();
    let route = Route::HttpConnect {
        uds: others[0].uds.clone(),
    };
    let server_view = || async {
        let all = others[0].metric(DIALS).await.unwrap_or(0.0);
        let quick = others[0].metric(DIALS_WITHIN_HALF_SECOND).await.unwrap_or(0.0);
        (all, all - quick)
    };
    let before = server_view().await;
    // Half through another server, half direct: what the machine itself
    // did meanwhile (every fleet process reconnects and re-watches).
    let half = (args.dials_per_second / 2).max(1);
    let (back, (delays, dials_failed), (direct, _)) = tokio::join!(
        all_back(others, fleets, args, watches, Duration::from_secs(300)),
        dials(route, echo, half, Duration::from_secs(10)),
        dials(Route::Direct, echo, half, Duration::from_secs(10)),
    );
    let after = server_view().await;
    let took = match back {
        Ok(took) => format!("{:.1} s", took.as_secs_f64()),
        Err(error) => {
            eprintln!("   {error}");
            format!("not within {:.0} s: {error}", killed_at.elapsed().as_secs_f64())
        }
    };
    Ok(Failover {
        nodes_moved,
        watches_broken: fleets.stats().await?.bulk_broken - broken_before,
        took,
        dials: Spread::of(delays),
        dials_failed,
        direct: Spread::of(direct),
        server_dials: (after.0 - before.0, after.1 - before.1),
    })
}

/// Descriptors a balancer process is given work for: each relayed stream
/// holds two, and a process may hold 20,000 here; the rest is room for the
/// dials of a storm.
const BALANCER_DESCRIPTORS: usize = 14_000;

/// The balancer processes in front of the servers' agent ports (sharing
/// one address: [`crate::balancer`]), enough for every agent's stream to
/// each server, once they accept.
async fn start_balancers(
    layout: &Layout,
    hosts: &[String],
    ports: ServerPorts,
    agents: usize,
) -> anyhow::Result<Vec<Proc>> {
    let listen = SocketAddr::new(BALANCER_HOST.parse()?, ports.agent);
    let backends: Vec<String> = hosts
        .iter()
        .map(|host| format!("{host}:{}", ports.agent))
        .collect();
    let processes = (2 * agents * hosts.len()).div_ceil(BALANCER_DESCRIPTORS).max(1);
    let mut balancers = Vec::new();
    for k in 0..processes {
        balancers.push(stack::spawn(
            layout,
            &format!("balancer-{k}"),
            &std::env::current_exe()?,
            &[
                "balancer".to_owned(),
                format!("--listen={listen}"),
                format!("--backends={}", backends.join(",")),
            ],
        )?);
    }
    until_accepting("the balancer", listen).await?;
    Ok(balancers)
}

/// The run's processes that are not servers or fleets, for [`cpu_now`].
struct Helpers {
    control_plane: Vec<Proc>,
    kas: Vec<Proc>,
    balancers: Vec<Proc>,
    targets: Proc,
}

/// Every group of the run's processes' CPU so far.
fn cpu_now(servers: &[ClusterServer], fleets: &Fleets, helpers: &Helpers) -> CpuSnapshot {
    CpuSnapshot::take(&[
        Group::of("servers", servers.iter().map(|server| &server.proc)),
        Group::of("node fleets", &fleets.procs),
        Group::of("control-plane agents", &helpers.control_plane),
        Group::of("stand-in kube-apiservers", &helpers.kas),
        Group::of("balancers", &helpers.balancers),
        Group::of("targets", [&helpers.targets]),
    ])
}

/// Waits until `done` holds, polling every 100 ms, at most `limit`: how long it took.
async fn until<F, Fut>(what: &str, limit: Duration, mut done: F) -> anyhow::Result<Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Option<String>>>,
{
    let started = Instant::now();
    let mut last = String::new();
    while started.elapsed() < limit {
        match done().await? {
            None => return Ok(started.elapsed()),
            Some(state) => last = state,
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("{what}: not within {limit:?} ({last})")
}

/// Waits, at most 20 s, until a process just started accepts on `addr`.
async fn until_accepting(what: &str, addr: SocketAddr) -> anyhow::Result<Duration> {
    until(what, Duration::from_secs(20), || async {
        Ok(TcpStream::connect(addr)
            .await
            .err()
            .map(|error| error.to_string()))
    })
    .await
}

/// How often [`all_back`] asks the servers while the nodes are not back.
const SERVER_POLL: Duration = Duration::from_secs(3);

/// What [`all_back`] last read from the servers, and when.
#[derive(Default)]
struct ServersPolled {
    /// Each server's agent streams (`None`: its metrics did not answer).
    agent_streams: Vec<Option<f64>>,
    at: Option<Instant>,
}

/// Every node back: agent streams at every one of `servers` (each agent
/// holds one to each), node tunnels answering, and (when `watches`) every
/// bulk watch established.
async fn all_back(
    servers: &[ClusterServer],
    fleets: &Fleets,
    args: &ClusterArgs,
    watches: usize,
    limit: Duration,
) -> anyhow::Result<Duration> {
    let agents = (args.nodes + args.control_plane_agents) as f64;
    // A scrape walks the server's 60,000 descriptors (`process_open_fds`):
    // at one per poll, the harness itself was 2.5% of the server's CPU. The
    // servers are asked when the nodes say they are back, and otherwise
    // only every few seconds, for the progress line.
    let polled = std::cell::RefCell::new(ServersPolled::default());
    until("every node back", limit, || async {
        // A server counts agent streams; a node tunnel is a connection
        // whose streams come and go, so the nodes say whether theirs
        // answers its probes.
        let stats = fleets.stats().await?;
        let nodes_back = stats.tunnels_up == args.nodes && stats.bulk_up >= watches;
        let stale = polled.borrow().at.is_none_or(|at| at.elapsed() >= SERVER_POLL);
        if nodes_back || stale {
            let mut agent_streams = Vec::new();
            for server in servers {
                agent_streams.push(server.metric(AGENTS).await);
            }
            *polled.borrow_mut() = ServersPolled {
                agent_streams,
                at: Some(Instant::now()),
            };
        }
        let at_servers = polled.borrow().agent_streams.clone();
        let back = nodes_back && at_servers.iter().all(|at| *at == Some(agents));
        Ok((!back).then(|| {
            format!(
                "agent streams {at_servers:?} of {agents}, node tunnels answering {} of {}, watches {} of {watches} \
                 ({} asked more than {} s ago and not answered)",
                stats.tunnels_up,
                args.nodes,
                stats.bulk_up,
                stats.bulk_stuck,
                crate::watch::STUCK_AFTER.as_secs()
            )
        }))
    })
    .await
}

pub async fn cluster(args: ClusterArgs) -> anyhow::Result<()> {
    let run_started = Instant::now();
    std::fs::create_dir_all(&args.work)?;
    let watches = args.nodes * args.watches_per_node;
    // The server holds two sockets per node and a few hundred dials.
    let limit = raise_descriptor_limit((2 * args.nodes + 2000) as u64)?;
    if (2 * args.nodes + 2000) as u64 > limit {
        bail!(
            "{} nodes need {} open files in proxy-server; this machine allows {limit} per process",
            args.nodes,
            2 * args.nodes + 2000
        );
    }
    eprintln!("== certificates for {} nodes", args.nodes);
    let hosts = server_hosts(args.servers);
    // Where the agents find the servers: each server's address, or with
    // Leases the balancer's, which the servers' certificate names too.
    let agent_hosts = match args.leases {
        true => vec![BALANCER_HOST.to_owned()],
        false => hosts.clone(),
    };
    let mut names = hosts.clone();
    if args.leases {
        names.push(BALANCER_HOST.to_owned());
    }
    let pki = ClusterPki::make(
        &args.work.join("pki"),
        args.control_plane_agents,
        args.nodes,
        &names,
    )?;
    let layout = Layout {
        bin_dir: args.bin_dir.clone(),
        certs: pki.dir.clone(),
        work: args.work.clone(),
    };
    let kas: Vec<SocketAddr> = (0..args.kas_processes)
        .map(|k| SocketAddr::from(([127, 0, 1, 1 + k as u8], 6443)))
        .collect();
    let mut kas_procs = Vec::new();
    for addr in &kas {
        kas_procs.push(stack::spawn(
            &layout,
            &format!("kas-{}", addr.ip()),
            &std::env::current_exe()?,
            &["kas-standin".to_owned(), format!("--listen={addr}")],
        )?);
    }
    let (targets_proc, targets) = stack::start_targets(&layout)?;
    for addr in &kas {
        until_accepting("the stand-in kube-apiserver", *addr).await?;
    }

    let leases = match args.leases {
        true => Some(LeaseApi::start(&pki, &args.work).await?),
        false => None,
    };
    // What kube-apiserver was asked before each phase (with --leases).
    let lease_calls = || leases.as_ref().map(LeaseApi::calls).unwrap_or_default();
    let mut phases_asked: Vec<(&str, String)> = Vec::new();
    let calls_before_start = lease_calls();

    let ports = ServerPorts {
        agent: stack::free_port()?,
        node: stack::free_port()?,
    };
    let mut servers = Vec::new();
    for (k, host) in hosts.iter().enumerate() {
        servers.push(ClusterServer::start(
            &layout,
            &pki,
            &args,
            &kas,
            (k, host),
            ports,
            leases.as_ref(),
        )?);
    }
    for server in &servers {
        until(&server.name, Duration::from_secs(20), || async {
            Ok(server
                .metric(AGENTS)
                .await
                .is_none()
                .then(|| "no metrics yet".to_owned()))
        })
        .await?;
    }
    let balancers = match args.leases {
        true => start_balancers(&layout, &hosts, ports, args.nodes + args.control_plane_agents).await?,
        false => Vec::new(),
    };
    let bare = memory(&servers).await?;

    eprintln!("== {} control-plane agents", args.control_plane_agents);
    let mut control_plane = Vec::new();
    for k in 0..args.control_plane_agents {
        let pair = pki.control_plane_agent(k);
        // Health and admin on an address of its own, as the servers': a
        // port free on 127.0.0.1 when asked may be another socket's by the
        // time the agent binds it on every address (a 5,000-node run lost a
        // control-plane agent so, and waited 300 s for its stream).
        let own = format!("127.0.3.{}", k + 1);
        let mut flags = vec![
            format!("--proxy-server-host={}", agent_hosts.join(",")),
            format!("--proxy-server-port={}", ports.agent),
            format!("--ca-cert={}", pki.cluster_ca().display()),
            format!("--agent-cert={}", pair.cert.display()),
            format!("--agent-key={}", pair.key.display()),
            format!("--agent-id=cp-{k}"),
            format!("--health-server-host={own}"),
            format!("--health-server-port={}", stack::free_port_on(&own)?),
            format!("--admin-bind-address={own}"),
            format!("--admin-server-port={}", stack::free_port_on(&own)?),
        ];
        if let Some(leases) = &leases {
            flags.extend(crate::leases::agent_flags(&leases.kubeconfig));
        }
        control_plane.push(stack::spawn(
            &layout,
            &format!("cp-{k}"),
            &args.bin_dir.join("proxy-agent"),
            &flags,
        )?);
    }

    let mut helpers = Helpers {
        control_plane,
        kas: kas_procs,
        balancers,
        targets: targets_proc,
    };

    let processes = args.nodes.div_ceil(args.nodes_per_process);
    eprintln!("== {} nodes in {processes} processes", args.nodes);
    let connecting = Instant::now();
    let mut fleets = Fleets {
        procs: Vec::new(),
        controls: Vec::new(),
    };
    // Where the CPU went in each phase that is a storm: the server's share
    // of it is what a control-plane machine of its own would have to do.
    let mut cpu_phases: Vec<(&str, CpuSpent)> = Vec::new();
    let cpu_before_start = cpu_now(&servers, &fleets, &helpers);
    let kas_list: Vec<String> = kas.iter().map(SocketAddr::to_string).collect();
    let mut control_files = Vec::new();
    for first in (0..args.nodes).step_by(args.nodes_per_process) {
        let control = args.work.join(format!("fleet-{first}.port"));
        let mut flags = vec![
            "node-fleet".to_owned(),
            format!("--first={first}"),
            format!("--nodes={}", args.nodes_per_process.min(args.nodes - first)),
            format!("--server-hosts={}", hosts.join(",")),
            format!("--server-port={}", ports.agent),
            format!("--node-frontend-port={}", ports.node),
            format!("--pki={}", pki.dir.display()),
            format!("--kas={}", kas_list.join(",")),
            format!("--watches={}", args.watches_per_node),
            format!("--event-interval-ms={}", args.event_interval_s * 1000),
            format!("--probes={}", if first == 0 { args.probes } else { 0 }),
            format!("--control-file={}", control.display()),
            format!("--warnings={}", args.fleet_warnings),
        ];
        if let Some(leases) = &leases {
            flags.push(format!("--lease-kubeconfig={}", leases.kubeconfig.display()));
            flags.push(format!("--agent-server-host={}", agent_hosts.join(",")));
        }
        fleets.procs.push(stack::spawn(
            &layout,
            &format!("fleet-{first}"),
            &std::env::current_exe()?,
            &flags,
        )?);
        control_files.push(control);
    }
    let port_in = |file: &std::path::Path| std::fs::read_to_string(file).ok()?.trim().parse::<u16>().ok();
    for file in &control_files {
        until("a fleet's control port", Duration::from_secs(120), || async {
            Ok(port_in(file)
                .is_none()
                .then(|| format!("nothing in {}", file.display())))
        })
        .await?;
        fleets.controls.extend(port_in(file));
    }
    all_back(&servers, &fleets, &args, 0, Duration::from_secs(300))
        .await
        .map_err(|error| stack::with_exits(error, &mut helpers.control_plane))
        .map_err(|error| stack::with_exits(error, &mut fleets.procs))?;
    let connected_in = connecting.elapsed();
    cpu_phases.push((
        "every node connecting (agent streams, node tunnels)",
        cpu_now(&servers, &fleets, &helpers).since(&cpu_before_start),
    ));
    let calls_connected = lease_calls();
    phases_asked.push((
        "the servers and every agent starting, until all connected",
        crate::leases::calls_between(&calls_before_start, &calls_connected),
    ));
    let with_nodes = memory(&servers).await?;

    eprintln!(
        "== idle: {} probe watches, {} dials/s",
        args.probes, args.dials_per_second
    );
    let idle = measure(&servers, &fleets, targets.echo, &args).await?;
    // Said at once: a run that goes no further still tells this much.
    eprintln!(
        "   nodes connected in {:.1} s; server per node {:.1} KiB resident, {:.1} KiB heap; CPU idle {:.0}%; \
         event delay node/direct p99 {:.2}/{:.2} ms; dial through/direct p99 {:.2}/{:.2} ms",
        connected_in.as_secs_f64(),
        (with_nodes.0 - bare.0) / 1024.0 / args.nodes as f64,
        (with_nodes.1 - bare.1) / 1024.0 / args.nodes as f64,
        idle.server_cpu * 100.0,
        idle.probe_node.p99,
        idle.probe_direct.p99,
        idle.dial_tunnel.p99,
        idle.dial_direct.p99
    );

    eprintln!("== {watches} watches");
    let resumes_before_opening = ResumeCounts::of(&servers).await;
    let cpu_before_opening = cpu_now(&servers, &fleets, &helpers);
    let opening = Instant::now();
    fleets.ask("open").await?;
    let opened = all_back(&servers, &fleets, &args, watches, Duration::from_secs(300)).await;
    let opened_in = opening.elapsed();
    let opened = match opened {
        Ok(_) => format!("{:.1} s", opened_in.as_secs_f64()),
        // Measured regardless: what the server does when it cannot keep up
        // is the finding.
        Err(error) => {
            eprintln!("   {error}");
            format!("not within {:.0} s: {error}", opened_in.as_secs_f64())
        }
    };
    let resumes_opening = ResumeCounts::of(&servers).await.since(resumes_before_opening);
    cpu_phases.push((
        "every watch opening",
        cpu_now(&servers, &fleets, &helpers).since(&cpu_before_opening),
    ));
    let with_watches = memory(&servers).await?;

    eprintln!("== loaded: {watches} watches, {} dials/s", args.dials_per_second);
    let loaded = measure(&servers, &fleets, targets.echo, &args).await?;

    let calls_before_kill = lease_calls();
    phases_asked.push((
        "the watches opening, and both measurements",
        crate::leases::calls_between(&calls_connected, &calls_before_kill),
    ));
    let failover = if servers.len() > 1 {
        eprintln!("== kill {}", servers[servers.len() - 1].name);
        let cpu_before_kill = cpu_now(&servers, &fleets, &helpers);
        let failover = kill_one(&mut servers, &fleets, &args, targets.echo, watches).await?;
        cpu_phases.push((
            "one server killed, until the others served every node (and 10 s of dials)",
            cpu_now(&servers, &fleets, &helpers).since(&cpu_before_kill),
        ));
        phases_asked.push((
            "one server killed, until the others served every node",
            crate::leases::calls_between(&calls_before_kill, &lease_calls()),
        ));
        Some(failover)
    } else {
        None
    };

    // With several servers, the one killed starts again: every agent's
    // stream to it is back (the node tunnels stay where they moved).
    eprintln!("== restart");
    let broken_before = fleets.stats().await?.bulk_broken;
    let calls_before_restart = lease_calls();
    // The restarted server counts from zero: the others' counts before.
    let resumes_before_restart = ResumeCounts::of(&servers[..servers.len() - 1]).await;
    let cpu_before_restart = cpu_now(&servers, &fleets, &helpers);
    let restarted = Instant::now();
    servers.last_mut().expect("a server").restart(&layout)?;
    let back_after = match all_back(&servers, &fleets, &args, watches, Duration::from_secs(300)).await {
        Ok(_) => restarted.elapsed(),
        Err(error) => {
            eprintln!("{error}");
            Duration::from_secs(300)
        }
    };
    cpu_phases.push((
        "a server restarted, until every node back",
        cpu_now(&servers, &fleets, &helpers).since(&cpu_before_restart),
    ));
    let broken = fleets.stats().await?.bulk_broken - broken_before;
    phases_asked.push((
        "a server restarted, until every node back",
        crate::leases::calls_between(&calls_before_restart, &lease_calls()),
    ));
    let resumes_restart = ResumeCounts::of(&servers).await.since(resumes_before_restart);

    let kib = |bytes: f64| bytes / 1024.0;
    let per_node = |at: (f64, f64), base: (f64, f64)| {
        (
            kib((at.0 - base.0) / args.nodes as f64),
            kib((at.1 - base.1) / args.nodes as f64),
        )
    };
    let (rss_node, heap_node) = per_node(with_nodes, bare);
    // Zero watches (a run of the nodes alone) cost nothing per watch.
    let per_watch = |bytes: f64| {
        if watches == 0 {
            0.0
        } else {
            kib(bytes / watches as f64)
        }
    };
    let (rss_watch, heap_watch) = (
        per_watch(with_watches.0 - with_nodes.0),
        per_watch(with_watches.1 - with_nodes.1),
    );
    let added_idle = idle.probe_node.minus(idle.probe_direct);
    let added_loaded = loaded.probe_node.minus(loaded.probe_direct);
    let dial_added_idle = idle.dial_tunnel.minus(idle.dial_direct);
    let dial_added_loaded = loaded.dial_tunnel.minus(loaded.dial_direct);
    let cpu_per_thousand = if loaded.events_per_second > 0.0 {
        (loaded.server_cpu - idle.server_cpu).max(0.0) / (loaded.events_per_second / 1000.0)
    } else {
        0.0
    };
    // Memory and CPU are the servers' together: with several, each holds
    // every agent's stream and some of the node tunnels.
    let servers_said = if servers.len() == 1 {
        "one server".to_owned()
    } else {
        format!("{} servers together", servers.len())
    };
    println!(
        "| cluster scale figure ({} nodes, {watches} captured watches, {} dials/s, {servers_said}) | value |",
        args.nodes, args.dials_per_second
    );
    println!("|---|---:|");
    println!(
        "| server per node (agent stream + node tunnel): resident / heap | {rss_node:.1} / {heap_node:.1} KiB |"
    );
    println!("| server per captured watch: resident / heap | {rss_watch:.2} / {heap_watch:.2} KiB |");
    println!(
        "| server resident: bare / with nodes / with watches | {:.0} / {:.0} / {:.0} MiB |",
        kib(kib(bare.0)),
        kib(kib(with_nodes.0)),
        kib(kib(with_watches.0))
    );
    println!(
        "| server CPU: idle fleet / loaded ({:.0} events/s) / per 1,000 events/s beyond idle | {:.0}% / {:.0}% / {:.1}% of a CPU |",
        loaded.events_per_second,
        idle.server_cpu * 100.0,
        loaded.server_cpu * 100.0,
        cpu_per_thousand * 100.0
    );
    println!(
        "| event delay, node path, ms p50 / p99 / max: idle fleet | {} |",
        idle.probe_node.cells()
    );
    println!(
        "| event delay, direct TCP, idle fleet | {} |",
        idle.probe_direct.cells()
    );
    println!(
        "| event delay, node path, loaded | {} |",
        loaded.probe_node.cells()
    );
    println!(
        "| event delay, direct TCP, loaded | {} |",
        loaded.probe_direct.cells()
    );
    println!(
        "| event delay added by the node path: idle / loaded (p99) | {:.2} / {:.2} ms |",
        added_idle.p99, added_loaded.p99
    );
    println!(
        "| every watch's events, loaded ({} events) | {} |",
        loaded.bulk.count,
        loaded.bulk.cells()
    );
    println!(
        "| dial + 1 KiB round trip through the server: idle / loaded | {} / {} |",
        idle.dial_tunnel.cells(),
        loaded.dial_tunnel.cells()
    );
    println!(
        "| the same, direct TCP: idle / loaded | {} / {} |",
        idle.dial_direct.cells(),
        loaded.dial_direct.cells()
    );
    println!(
        "| dial delay added (p99): idle / loaded | {:.2} / {:.2} ms |",
        dial_added_idle.p99, dial_added_loaded.p99
    );
    println!(
        "| dials failed: idle / loaded | {} / {} |",
        idle.dial_failures, loaded.dial_failures
    );
    println!(
        "| all nodes connected after start (agent streams + node tunnels) | {:.1} s |",
        connected_in.as_secs_f64()
    );
    println!("| all {watches} watches established | {opened} |");
    println!(
        "| ... connections the servers resumed / dropped at a resume / closed unresumed meanwhile | {} |",
        resumes_opening.cells()
    );
    println!(
        "| every node back after a server restart (streams, tunnels, watches re-established: {broken} broke) | {:.1} s |",
        back_after.as_secs_f64()
    );
    println!(
        "| ... connections the servers resumed / dropped at a resume / closed unresumed meanwhile | {} |",
        resumes_restart.cells()
    );
    if let Some(failover) = &failover {
        println!(
            "| one of {} servers killed: nodes it served (node tunnels with streams) / watches that broke | {:.0} / {} |",
            servers.len(),
            failover.nodes_moved,
            failover.watches_broken
        );
        println!(
            "| ... every node served by the others (tunnels answering, every watch re-established) | {} |",
            failover.took
        );
        println!(
            "| ... kube-apiserver's dials through another server meanwhile: done / failed; ms p50 / p99 / max | {} / {}; {} |",
            failover.dials.count,
            failover.dials_failed,
            failover.dials.cells()
        );
        println!(
            "| ... the same, direct TCP (the machine meanwhile) | {} |",
            failover.direct.cells()
        );
        println!(
            "| ... of the server's dials meanwhile, answered by the agent after 0.5 s | {:.0} of {:.0} |",
            failover.server_dials.1, failover.server_dials.0
        );
    }
    // With the node role, every agent proves itself by certificate (the
    // control-plane ids need one, and the server takes no tokens beside a
    // cluster CA, as upstream's): a restart asks kube-apiserver nothing.
    println!("| kube-apiserver requests (TokenReviews) for a restart | 0 (certificates) |");
    if let Some(leases) = &leases {
        for (phase, asked) in &phases_asked {
            println!("| kube-apiserver requests (Leases): {phase} | {asked} |");
        }
        println!(
            "| server Leases at the end of the run | {} |",
            leases.lease_names().len()
        );
    }
    for (phase, spent) in &cpu_phases {
        println!("| CPU-seconds: {phase} | {} |", spent.cells());
    }
    println!("| run took | {:.0} s |", run_started.elapsed().as_secs_f64());
    let reviews_per_token = 0.0;
    println!(
        "scale: nodes={} captured={watches} kib_per_node={rss_node:.1} kib_per_captured={rss_watch:.2} p99_added_ms={:.2} back_after_restart_s={:.1} reviews_per_token={reviews_per_token:.2}",
        args.nodes,
        added_loaded.p99.max(dial_added_loaded.p99),
        back_after.as_secs_f64()
    );
    drop(helpers);
    Ok(())
}
