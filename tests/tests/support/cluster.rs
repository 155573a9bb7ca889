//! A proxy-server with one connected proxy-agent, and checks on both.

use std::time::Duration;

use super::certs::Pki;
use super::procs::{Agent, Server};
use super::scrape::metric;
use super::{TempDir, wait_until};

/// A server (in `mode`) with one connected agent.
pub struct Setup {
    pub dir: TempDir,
    pub pki: Pki,
    pub server: Server,
    pub agent: Agent,
}

impl Setup {
    pub async fn start(mode: &str, uds: bool, agent_extra: &[String]) -> Setup {
        Setup::with_flags(mode, uds, &[], agent_extra).await
    }

    /// As [`Setup::start`], with extra flags for the server too.
    pub async fn with_flags(mode: &str, uds: bool, server_extra: &[String], agent_extra: &[String]) -> Setup {
        let dir = TempDir::new("konn-egress");
        let pki = Pki::new(dir.path());
        let server = Server::start(dir.path(), &pki, mode, uds, server_extra).await;
        let agent = Agent::start(dir.path(), &pki, server.agent_port, "agent-1", agent_extra);
        server.wait_backends(1).await;
        Setup {
            dir,
            pki,
            server,
            agent,
        }
    }

    /// Waits until every gauge of open or pending connections on the server
    /// and the agent reads zero.
    pub async fn assert_gauges_return_to_zero(&self) {
        let server = self.server.health_port;
        let agent = self.agent.health_port;
        let zero = |port: u16, series: &'static str| async move { metric(port, series).await == Some(0.0) };
        // This family only has a sample once a Proxy stream was served.
        let zero_or_absent =
            |port: u16, series: &'static str| async move { metric(port, series).await.unwrap_or(0.0) == 0.0 };
        wait_until(
            Duration::from_secs(10),
            "connection gauges to return to 0",
            || async move {
                zero(
                    server,
                    "konnectivity_network_proxy_server_established_connections",
                )
                .await
                    && zero(server, "konnectivity_network_proxy_server_pending_backend_dials").await
                    && zero(server, "konnectivity_network_proxy_server_http_connections").await
                    && zero_or_absent(
                        server,
                        "konnectivity_network_proxy_server_grpc_connections{service_method=\"Proxy\"}",
                    )
                    .await
                    && zero(
                        agent,
                        "konnectivity_network_proxy_agent_open_endpoint_connections",
                    )
                    .await
            },
        )
        .await;
    }

    /// Another agent for this setup's server (with the same certificates),
    /// e.g. a second one, or one replacing a killed agent.
    pub fn start_agent(&self, id: &str, extra: &[String]) -> Agent {
        Agent::start(self.dir.path(), &self.pki, self.server.agent_port, id, extra)
    }

    /// Open file descriptors and live runtime tasks of server and agent.
    pub async fn resources(&self) -> Resources {
        Resources {
            server_fds: open_fds(self.server.proc.pid()),
            agent_fds: open_fds(self.agent.proc.pid()),
            server_tasks: metric(
                self.server.health_port,
                "konnectivity_network_proxy_server_runtime_alive_tasks",
            )
            .await
            .unwrap_or(-1.0),
            agent_tasks: metric(
                self.agent.health_port,
                "konnectivity_network_proxy_agent_runtime_alive_tasks",
            )
            .await
            .unwrap_or(-1.0),
            server_heap_kib: heap_kib(
                self.server.health_port,
                "konnectivity_network_proxy_server_runtime_heap_bytes",
            )
            .await,
            agent_heap_kib: heap_kib(
                self.agent.health_port,
                "konnectivity_network_proxy_agent_runtime_heap_bytes",
            )
            .await,
        }
    }

    /// Resources to compare against later: taken once the descriptor counts
    /// have held still, so a socket of a connection that just ended, still
    /// closing, is not counted into the baseline.
    pub async fn baseline(&self) -> Resources {
        settled_fds(self.server.proc.pid()).await;
        settled_fds(self.agent.proc.pid()).await;
        // Tasks settle too: a connection's task can outlive its descriptor
        // by a moment (its end being logged and counted), and a baseline
        // read then counts one task too many (seen in CI: 11 against 10).
        let counts = |r: &Resources| (r.server_fds, r.agent_fds, r.server_tasks, r.agent_tasks);
        let mut last = self.resources().await;
        let mut still = 0;
        for _ in 0..200 {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let now = self.resources().await;
            if counts(&now) == counts(&last) {
                still += 1;
                if still >= 5 {
                    return now;
                }
            } else {
                still = 0;
            }
            last = now;
        }
        last
    }

    /// Waits until resources are back to `baseline`: the same descriptors
    /// and tasks (the exact signs of a leak), and the heap at most
    /// 10% (and a slack) above it (see [`memory_back_to`]).
    pub async fn assert_resources_return_to(&self, baseline: &Resources) {
        self.wait_back_to(baseline, "server and agent", Resources::back_to)
            .await;
    }

    /// As [`Setup::assert_resources_return_to`], for the server alone (the
    /// agent beside it may be a new process, as after an agent crash).
    pub async fn assert_server_returns_to(&self, baseline: &Resources) {
        self.wait_back_to(baseline, "server", Resources::server_back_to)
            .await;
    }

    /// As [`Setup::assert_resources_return_to`], for the agent alone (the
    /// server may be a new process).
    pub async fn assert_agent_returns_to(&self, baseline: &Resources) {
        self.wait_back_to(baseline, "agent", Resources::agent_back_to)
            .await;
    }

    async fn wait_back_to(&self, baseline: &Resources, who: &str, back: fn(&Resources, &Resources) -> bool) {
        let mut last = None;
        let deadline = std::time::Instant::now() + Duration::from_secs(15);
        while std::time::Instant::now() < deadline {
            let now = self.resources().await;
            if back(&now, baseline) {
                return;
            }
            last = Some(now);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("{who} resources did not return to baseline {baseline:?}: last {last:?}");
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Resources {
    pub server_fds: usize,
    pub agent_fds: usize,
    pub server_tasks: f64,
    pub agent_tasks: f64,
    pub server_heap_kib: u64,
    pub agent_heap_kib: u64,
}

impl Resources {
    /// Descriptors and tasks exactly as in `baseline`, the heap at
    /// most 10% (and a slack) above it (below is fine: see [`memory_back_to`]).
    pub fn back_to(&self, baseline: &Resources) -> bool {
        self.back_within(baseline, 10)
    }

    /// [`Resources::back_to`] with memory allowed `percent` above the baseline.
    pub fn back_within(&self, baseline: &Resources, percent: u64) -> bool {
        self.server_back_within(baseline, percent) && self.agent_back_within(baseline, percent)
    }

    /// [`Resources::back_to`] for the server's figures only.
    pub fn server_back_to(&self, baseline: &Resources) -> bool {
        self.server_back_within(baseline, 10)
    }

    /// [`Resources::back_to`] for the agent's figures only.
    pub fn agent_back_to(&self, baseline: &Resources) -> bool {
        self.agent_back_within(baseline, 10)
    }

    fn server_back_within(&self, baseline: &Resources, percent: u64) -> bool {
        self.server_fds == baseline.server_fds
            && self.server_tasks == baseline.server_tasks
            && memory_within(self.server_heap_kib, baseline.server_heap_kib, percent)
    }

    fn agent_back_within(&self, baseline: &Resources, percent: u64) -> bool {
        self.agent_fds == baseline.agent_fds
            && self.agent_tasks == baseline.agent_tasks
            && memory_within(self.agent_heap_kib, baseline.agent_heap_kib, percent)
    }

    /// A baseline from two warm-up rounds: the same descriptors and tasks
    /// (else something leaked already), and the higher heap of the two,
    /// since between identical rounds it moves with the capacity live
    /// connections' buffers last grew to (see [`HEAP_SLACK_KIB`]). A leak
    /// shows as growth beyond that.
    pub fn highest(self, other: Resources) -> Resources {
        let counts = |r: &Resources| (r.server_fds, r.agent_fds, r.server_tasks, r.agent_tasks);
        assert_eq!(
            counts(&self),
            counts(&other),
            "descriptors or tasks differ between two warm-up rounds"
        );
        Resources {
            server_heap_kib: self.server_heap_kib.max(other.server_heap_kib),
            agent_heap_kib: self.agent_heap_kib.max(other.agent_heap_kib),
            ..self
        }
    }
}

/// Heap `now` (KiB) is back to `before`: at most 10% and [`HEAP_SLACK_KIB`]
/// above it.
///
/// The heap, not resident memory: resident memory also holds what the
/// allocator caches, which after identical rounds moved by ±20% of a 14 MiB
/// process with no trend and failed checks on fresh clones; the heap moves
/// only with what the program holds. Less than the baseline is no leak.
/// Baselines are taken after a warm-up at the test's own concurrency: the
/// runtime keeps the I/O tables, and h2 the stream tables, its peak needed,
/// which a first round grows once and later ones reuse.
pub fn memory_back_to(now: u64, before: u64) -> bool {
    memory_within(now, before, 10)
}

/// What a round may leave on the heap beyond `percent`: the buffers of a
/// live connection keep the capacity they last grew to (h2's read buffer
/// holds a whole frame, up to 256 KiB, and keeps its size), which after
/// identical rounds differed by up to 190 KiB. A leak worth finding, the
/// buffers or queues of connections that ended, is MiBs.
pub const HEAP_SLACK_KIB: u64 = 1024;

/// `now` is at most `percent` and [`HEAP_SLACK_KIB`] above `before`.
pub fn memory_within(now: u64, before: u64, percent: u64) -> bool {
    now * 100 <= before * (100 + percent) + HEAP_SLACK_KIB * 100
}

/// The heap a process holds (bytes allocated and not freed, its
/// `runtime_heap_bytes`), in KiB; 0 if it does not answer.
pub async fn heap_kib(health_port: u16, family: &str) -> u64 {
    metric(health_port, family)
        .await
        .map_or(0, |bytes| bytes as u64 / 1024)
}

/// The descriptor count once it has held still for a quarter second:
/// sockets of connections that just ended may take a moment to close.
pub async fn settled_fds(pid: u32) -> usize {
    let mut last = open_fds(pid);
    let mut still = 0;
    for _ in 0..200 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = open_fds(pid);
        if now == last {
            still += 1;
            if still >= 5 {
                break;
            }
        } else {
            still = 0;
            last = now;
        }
    }
    last
}

pub fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// A listener whose accept queue is full: the kernel drops further SYNs,
/// so a dial to it hangs until the dialer's timeout. Keep all three alive.
pub fn unanswering_listener() -> (socket2::Socket, std::net::TcpStream, std::net::SocketAddr) {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    socket
        .bind(&"127.0.0.1:0".parse::<std::net::SocketAddr>().unwrap().into())
        .unwrap();
    socket.listen(0).unwrap();
    let addr = socket.local_addr().unwrap().as_socket().unwrap();
    let filler = std::net::TcpStream::connect(addr).unwrap();
    (socket, filler, addr)
}
