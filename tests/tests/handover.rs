//! Replacing the node agent without a failed connection (root, containerd).
//!
//! A node as a cluster has one (support::cri_node): containerd's pods, the
//! node agent capturing the node's and the pods' connections to the VIP.
//! Clients in the node's namespace and in a pod's keep connecting through
//! the VIP, each connection a TLS handshake and a request, 200 a second in
//! all, while the agent is replaced five times: as a DaemonSet rollout with
//! maxSurge does it (the new agent starts beside the old one, takes its role
//! over, and the old one is then told to stop), and as a crash does it
//! (SIGKILL, and a new agent started).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::support::containerd::{Pod, containerd_or_skip};
use crate::support::cri_node::Node;
use crate::support::kas::*;
use crate::support::load::{Attempt, Load, Target, failures};
use crate::support::netns::{connect_tcp_in, root_or_skip};
use crate::support::procs::Proc;
use crate::support::targets;
use crate::support::wait_until;

pub(crate) const REPLACEMENTS: usize = 5;
/// Connections a second from each of the two namespaces.
const RATE: u32 = 100;

fn load_from(node: &Node, netns: PathBuf) -> Load {
    Load::start(Target {
        netns,
        addr: format!("{VIP}:443").parse().unwrap(),
        server_name: VIP.to_owned(),
        tls: node.topology.pki.client_tls(None, &[]),
        expect: VERSION_BODY.to_owned(),
        per_second: RATE,
        limit: Duration::from_secs(180),
    })
}

fn node_netns(node: &Node) -> PathBuf {
    Path::new("/var/run/netns").join(&node.topology.node.name)
}

/// The descriptors a process holds.
fn descriptors(pid: u32) -> Vec<String> {
    let mut fds: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .map(|fd| {
            std::fs::read_link(fd.path())
                .map(|target| target.display().to_string())
                .unwrap_or_default()
        })
        .collect();
    fds.sort();
    fds
}

/// The node agents of the test whose directory is `dir` running: those
/// given its hand-over socket (other tests' node agents run on this machine
/// too).
pub(crate) fn node_agents(dir: &Path) -> Vec<u32> {
    let flag = format!("--handover-socket={}", dir.join("handover.sock").display());
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|cmdline| {
                    let cmdline = String::from_utf8_lossy(&cmdline);
                    cmdline.split('\0').any(|arg| arg == flag) && !cmdline.contains("unshare")
                })
                .unwrap_or(false)
        })
        .collect()
}

/// Waits until `agent`'s log says it took the node role over.
pub(crate) async fn took_over(agent: &Proc) {
    wait_until(
        Duration::from_secs(40),
        "the new agent to take the node role over",
        || async { agent.log_text().contains("took the node role over") },
    )
    .await;
}

/// The tables named konnectivity in `netns`.
fn tables(netns: &Path) -> usize {
    let output = std::process::Command::new("nsenter")
        .arg(format!("--net={}", netns.display()))
        .args(["nft", "list", "tables"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter(|line| line.trim() == "table inet konnectivity")
        .count()
}

async fn assert_one_agent_and_one_set_of_rules(node: &Node, pods: &[Pod]) {
    wait_until(
        Duration::from_secs(40),
        "exactly one node agent to remain",
        || async { node_agents(node.dir()).len() == 1 },
    )
    .await;
    assert_eq!(tables(&node_netns(node)), 1, "one table on the node");
    for pod in pods {
        let netns = node.containerd.netns_of(pod).await;
        assert_eq!(tables(&netns), 1, "one table in pod {}", pod.id);
        assert!(node.record_of(pod).is_file(), "pod {} is recorded", pod.id);
    }
}

fn report(name: &str, attempts: &[Attempt]) {
    let failed = failures(attempts);
    eprintln!(
        "{name}: {} connections attempted, {} failed",
        attempts.len(),
        failed.len()
    );
}

/// What the rolling replacements did to the clients.
struct Rolling {
    attempted: usize,
    failed: Vec<String>,
}

/// Replaces the node agent `REPLACEMENTS` times as a DaemonSet rollout with
/// maxSurge does, under the load from the node and from `pods[0]`, a pod
/// created during each replacement (added to `pods`); with `download`, a
/// 200 MiB download through the VIP spans them and is checked.
async fn replace_rolling(node: &mut Node, pods: &mut Vec<Pod>, download: bool) -> Rolling {
    let pod_netns = node.containerd.netns_of(&pods[0]).await;
    let from_node = load_from(node, node_netns(node));
    let from_pod = load_from(node, pod_netns.clone());
    // Long-lived connections from the pod (the old agent hands them over
    // from the pod's own listener), each a numbered line every 10 ms.
    let _streams = targets::blob_on(
        tokio::net::TcpListener::from_std(node.topology.control_plane.bind_tcp(STREAMS)).unwrap(),
    )
    .await;
    let stop = Arc::new(AtomicBool::new(false));
    let long_lived: Vec<_> = (0..5)
        .map(|_| {
            let stream = connect_tcp_in(pod_netns.clone(), STREAMS_VIP).unwrap();
            tokio::spawn(targets::numbered_lines(stream, stop.clone()))
        })
        .collect();
    // Slowed so that it spans every replacement, checksummed as it arrives.
    let downloading = download.then(|| {
        node.topology.node.spawn_program(
            "sh",
            &[
                "-c".to_owned(),
                format!(
                    "curl -sS --limit-rate 20M --cacert {} https://{VIP}/files/blob | sha256sum > {}",
                    node.topology.pki.ca.display(),
                    node.dir().join("blob.sha256").display()
                ),
            ],
            node.dir(),
        )
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut replaced = Vec::new();
    for n in 0..REPLACEMENTS {
        // The DaemonSet's surge pod starts beside the old one; kubelet
        // creates a pod meanwhile.
        let old = node.agent.take().unwrap();
        node.start_agent();
        let name = format!("during-{n}");
        // A request that reached the old agent as it handed over fails with
        // "try again" (docs/handover.md); kubelet's pod worker retries a
        // failed RunPodSandbox, and so does this, at most twice.
        let adding = async {
            let mut retries = 0;
            loop {
                match node.containerd.run_pod(&name, "default").await {
                    Err(status) if status.message().contains("try again") && retries < 2 => {
                        retries += 1;
                        println!(
                            "RunPodSandbox during replacement {n}: {}; retrying",
                            status.message()
                        );
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                    done => break done,
                }
            }
        };
        let (added, ()) = tokio::join!(adding, took_over(node.agent.as_ref().unwrap()));
        pods.push(added.unwrap_or_else(|status| panic!("RunPodSandbox during replacement {n}: {status}")));
        // Ready: the old pod is deleted, and its agent told to stop.
        node.topology.wait_node_ready().await;
        old.signal("TERM");
        replaced.push(old);
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    if let Some(downloading) = downloading {
        let sum = node.dir().join("blob.sha256");
        wait_until(Duration::from_secs(60), "the download to finish", || async {
            std::fs::read_to_string(&sum).is_ok_and(|sum| !sum.is_empty())
        })
        .await;
        drop(downloading);
        let sum = std::fs::read_to_string(&sum).unwrap();
        assert!(
            sum.starts_with(&node.topology.blob_sha256),
            "200 MiB arrived changed: {sum}"
        );
    }
    let (node_attempts, pod_attempts) = (from_node.finish(), from_pod.finish());
    report("from the node", &node_attempts);
    report("from a pod", &pod_attempts);
    stop.store(true, Ordering::Relaxed);
    for (i, connection) in long_lived.into_iter().enumerate() {
        let lines = connection
            .await
            .unwrap()
            .unwrap_or_else(|broke| panic!("the pod's long-lived connection {i}: {broke}"));
        assert!(lines.len() > 100, "{} lines", lines.len());
    }
    let seconds = node_attempts.last().unwrap().started.as_secs_f64();
    assert!(
        (node_attempts.len() + pod_attempts.len()) as f64 >= 1.8 * f64::from(RATE) * seconds,
        "the load ran at 200 a second"
    );
    // Each old agent exits once its connections are done, and leaves the
    // rules to its successor.
    for old in &replaced {
        let pid = old.pid();
        wait_until(
            Duration::from_secs(40),
            "a replaced agent to exit",
            || async move {
                std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .map_or(true, |stat| stat.contains(") Z "))
            },
        )
        .await;
        assert!(
            !old.log_text().contains("capture rules removed"),
            "a replaced agent leaves the rules to its successor"
        );
    }
    Rolling {
        attempted: node_attempts.len() + pod_attempts.len(),
        failed: failures(&node_attempts)
            .into_iter()
            .chain(failures(&pod_attempts))
            .collect(),
    }
}

/// What the kills did to the clients.
struct Killed {
    attempted: usize,
    failed: usize,
    /// The longest a failed connection took to fail.
    slowest_failure: Duration,
    /// From each new process' start until a captured connection from the
    /// node, and from the pod, worked again.
    recoveries: Vec<(Duration, Duration)>,
}

/// Kills the node agent `REPLACEMENTS` times (SIGKILL) and starts a new one
/// at once, under the load from the node and from `pods[0]`; a pod is
/// created after each (added to `pods`).
async fn replace_by_killing(node: &mut Node, pods: &mut Vec<Pod>) -> Killed {
    let pod_netns = node.containerd.netns_of(&pods[0]).await;
    let from_node = load_from(node, node_netns(node));
    let from_pod = load_from(node, pod_netns);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut restarts = Vec::new();
    for n in 0..REPLACEMENTS {
        node.kill_agent();
        restarts.push(from_node.began.elapsed());
        node.start_agent();
        node.topology.wait_node_ready().await;
        // kubelet retries a pod whose ADD failed meanwhile; now it starts.
        pods.push(
            node.containerd
                .run_pod(&format!("after-{n}"), "default")
                .await
                .unwrap_or_else(|status| panic!("RunPodSandbox after restart {n}: {status}")),
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let (node_attempts, pod_attempts) = (from_node.finish(), from_pod.finish());
    report("from the node", &node_attempts);
    report("from a pod", &pod_attempts);
    let recovered = |attempts: &[Attempt], restart: Duration| {
        attempts
            .iter()
            .find(|a| a.started >= restart && a.outcome.is_ok())
            .map(|a| a.started + a.took - restart)
            .expect("connections work again")
    };
    let failed: Vec<&Attempt> = node_attempts
        .iter()
        .chain(&pod_attempts)
        .filter(|a| a.outcome.is_err())
        .collect();
    Killed {
        attempted: node_attempts.len() + pod_attempts.len(),
        failed: failed.len(),
        slowest_failure: failed.iter().map(|a| a.took).max().unwrap_or_default(),
        recoveries: restarts
            .iter()
            .map(|restart| {
                (
                    recovered(&node_attempts, *restart),
                    recovered(&pod_attempts, *restart),
                )
            })
            .collect(),
    }
}

/// A node with its agent, and a captured pod whose clients are loaded.
async fn node_with_a_pod(blob: bool) -> (Node, Vec<Pod>) {
    let node = Node::start(true, blob).await;
    let pod = node.containerd.run_pod("client", "default").await.unwrap();
    node.assert_reaches_the_api_server(&pod, "the first pod").await;
    (node, vec![pod])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_replacement_of_the_node_agent_fails_no_connection() {
    if !containerd_or_skip("a_rolling_replacement_of_the_node_agent_fails_no_connection") {
        return;
    }
    let (mut node, mut pods) = node_with_a_pod(true).await;
    let agent_pid = node.agent.as_ref().unwrap().pid();
    let before_pod = descriptors(agent_pid).len();
    pods.push(node.containerd.run_pod("client-2", "default").await.unwrap());
    let per_pod = descriptors(agent_pid).len() - before_pod;
    let baseline = descriptors(agent_pid);

    let rolling = replace_rolling(&mut node, &mut pods, true).await;
    assert!(
        rolling.failed.is_empty(),
        "failed connections:\n{}",
        rolling.failed.join("\n")
    );
    assert_one_agent_and_one_set_of_rules(&node, &pods).await;
    // The survivor holds what the first agent held, and the descriptors of
    // the pods added since, nothing more.
    let survivor = descriptors(node.agent.as_ref().unwrap().pid());
    assert_eq!(
        survivor.len(),
        baseline.len() + REPLACEMENTS * per_pod,
        "descriptors: first agent {baseline:#?}\nsurvivor {survivor:#?}"
    );
    // And it serves the pods added during the replacements.
    node.assert_reaches_the_api_server(pods.last().unwrap(), "a pod added during a replacement")
        .await;
    // The admin listener was handed over with the rest: no successor could
    // have bound its port while its predecessor held it.
    let (status, metrics) = node.topology.node.http_get(NODE_AGENT_ADMIN, "/metrics");
    assert_eq!(status, 200, "{metrics}");
    assert!(
        metrics.contains("konnectivity_network_proxy_agent_node_tunnel_up 1"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_node_agent_is_replaced_with_refusals_meanwhile_never_hangs() {
    if !containerd_or_skip("a_killed_node_agent_is_replaced_with_refusals_meanwhile_never_hangs") {
        return;
    }
    let (mut node, mut pods) = node_with_a_pod(false).await;
    let killed = replace_by_killing(&mut node, &mut pods).await;
    // While no agent runs, a captured connection is refused at once (the
    // rules redirect to a port nothing listens on): it never hangs.
    assert!(
        killed.slowest_failure < Duration::from_secs(1),
        "the slowest failed connection took {:?}",
        killed.slowest_failure
    );
    for (n, (node_recovery, pod_recovery)) in killed.recoveries.iter().enumerate() {
        eprintln!(
            "restart {n}: captured connections work again {node_recovery:?} (node) and {pod_recovery:?} (pod) after the new agent started"
        );
    }
    assert_one_agent_and_one_set_of_rules(&node, &pods).await;
}

/// `hack/bench.sh --handover`: both scenarios three times each, from a
/// release build, as one Markdown table (not a test: ignored unless asked).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a benchmark: hack/bench.sh --handover runs it"]
async fn handover_benchmark() {
    assert!(
        containerd_or_skip("handover_benchmark"),
        "the benchmark needs root and containerd"
    );
    const RUNS: usize = 3;
    let go_client = crate::support::foreign::grpc_go_client().expect("the grpc-go client builds");
    let (mut rolling, mut killed, mut established) = (Vec::new(), Vec::new(), Vec::new());
    let (mut egress_grpc, mut egress_connect) = (Vec::new(), Vec::new());
    for _ in 0..RUNS {
        let (mut node, mut pods) = node_with_a_pod(false).await;
        rolling.push(replace_rolling(&mut node, &mut pods, false).await);
        let (mut node, mut pods) = node_with_a_pod(false).await;
        killed.push(replace_by_killing(&mut node, &mut pods).await);
        established.push(replace_rolling_with_established_connections().await);
        let grpc = Frontend::Grpc {
            go_client: go_client.clone(),
        };
        egress_grpc.push(replace_plain_egress_agent("grpc", grpc).await.0);
        egress_connect.push(replace_plain_egress_agent("http-connect", Frontend::Connect).await);
    }
    let ms = |d: Duration| format!("{:.0}", d.as_secs_f64() * 1000.0);
    let median = |mut values: Vec<Duration>| {
        values.sort();
        values[values.len() / 2]
    };
    let row = |figure: &str, cells: Vec<String>| println!("| {figure} | {} |", cells.join(" | "));
    println!(
        "\n| node agent replaced {REPLACEMENTS} times, {} connections/s (TLS + request) from the node and a pod | {} |",
        2 * RATE,
        (1..=RUNS)
            .map(|n| format!("run {n}"))
            .collect::<Vec<_>>()
            .join(" | ")
    );
    println!("|---|{}", "---:|".repeat(RUNS));
    row(
        "rolling (maxSurge hand-over): connections attempted",
        rolling.iter().map(|r| r.attempted.to_string()).collect(),
    );
    row(
        "rolling: connections failed",
        rolling.iter().map(|r| r.failed.len().to_string()).collect(),
    );
    row(
        "SIGKILL + new agent: connections attempted",
        killed.iter().map(|k| k.attempted.to_string()).collect(),
    );
    row(
        "SIGKILL: connections refused meanwhile",
        killed.iter().map(|k| k.failed.to_string()).collect(),
    );
    row(
        "SIGKILL: slowest refusal, ms",
        killed.iter().map(|k| ms(k.slowest_failure)).collect(),
    );
    row(
        "SIGKILL: recovery from the new process' start, node, ms (median of 5; max)",
        killed
            .iter()
            .map(|k| {
                let all: Vec<Duration> = k.recoveries.iter().map(|r| r.0).collect();
                format!("{} ({})", ms(median(all.clone())), ms(*all.iter().max().unwrap()))
            })
            .collect(),
    );
    row(
        "rolling, established connections (20 lines every 10 ms, 1 GiB download, 100 new/s): broken",
        established.iter().map(|_| "0".to_owned()).collect(),
    );
    row(
        "rolling, established: pause of a connection during a hand-over, ms (p50; max of 100)",
        established
            .iter()
            .map(|e| {
                let mut pauses = e.pauses.clone();
                pauses.sort();
                format!(
                    "{} ({})",
                    ms(pauses[pauses.len() / 2]),
                    ms(*pauses.last().unwrap())
                )
            })
            .collect(),
    );
    row(
        "rolling, established: a line's round trip otherwise, ms (p50)",
        established
            .iter()
            .map(|e| format!("{:.1}", e.round_trip.as_secs_f64() * 1000.0))
            .collect(),
    );
    row(
        "egress agent rolled (`--egress-handover`), 100 new/s, 20 lines every 10 ms, 1 GiB: new connections failed, gRPC / CONNECT",
        egress_grpc
            .iter()
            .zip(&egress_connect)
            .map(|(grpc, (connect, _))| format!("{} / {}", grpc.failed.len(), connect.failed.len()))
            .collect(),
    );
    row(
        "egress, HTTP CONNECT: pause of a connection during a hand-over, ms (p50; max of 100)",
        egress_connect
            .iter()
            .map(|(_, pauses)| p50_and_max(pauses.clone()))
            .collect(),
    );
    row(
        "egress, gRPC: grpc-go's longest wait for a line over the five hand-overs, ms",
        egress_grpc
            .iter()
            .map(|grpc| grpc.longest_ms.to_string())
            .collect(),
    );
    row(
        "SIGKILL: recovery, pod, ms (median of 5; max)",
        killed
            .iter()
            .map(|k| {
                let all: Vec<Duration> = k.recoveries.iter().map(|r| r.1).collect();
                format!("{} ({})", ms(median(all.clone())), ms(*all.iter().max().unwrap()))
            })
            .collect(),
    );
}

/// A new agent that cannot reach the server (a bad address, a bad
/// certificate) never takes the role over: the old one carries on, and
/// /readyz, which both pods are probed on, says "not ready" while the new
/// one waits, so the rollout stops at the new pod instead of deleting the
/// old. Once the new agent is gone, the old one is ready again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_agent_that_cannot_reach_the_server_never_takes_over() {
    if !crate::support::netns::root_or_skip("a_new_agent_that_cannot_reach_the_server_never_takes_over") {
        return;
    }
    let topology = build(false).await;
    let _old = topology.start_node_agent(&[]);
    topology.wait_node_ready().await;
    // The same agent, but its node frontend port is one nobody serves.
    let mut broken = topology.start_node_agent(&["--node-frontend-port=8099".to_owned()]);
    let node = &topology.node;
    wait_until(
        Duration::from_secs(10),
        "/readyz to say a newer agent is taking over",
        || async {
            let (status, body) = node.http_get(NODE_AGENT_HEALTH, "/readyz");
            status == 503 && body.contains("a newer agent is taking the node role over")
        },
    )
    .await;
    // The old agent still captures.
    let version = topology.version_through_vip();
    assert!(version.status.success(), "{}", text(&version));
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        !broken.log_text().contains("took the node role over"),
        "{}",
        broken.log_text()
    );
    broken.kill();
    wait_until(
        Duration::from_secs(10),
        "the old agent to be ready again",
        || async { node.http_get(NODE_AGENT_HEALTH, "/readyz").0 == 200 },
    )
    .await;
    let version = topology.version_through_vip();
    assert!(version.status.success(), "{}", text(&version));
}

/// Downloads `len` pattern bytes, read at most `per_second` bytes a second
/// so that the transfer spans the replacements; their SHA-256.
async fn slow_download(
    mut stream: impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    len: u64,
    seed: u64,
    per_second: u64,
) -> Result<[u8; 32], String> {
    use sha2::Digest;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    stream
        .write_all(&targets::header(b'G', len, seed))
        .await
        .map_err(|e| e.to_string())?;
    let began = std::time::Instant::now();
    let mut hasher = sha2::Sha256::new();
    let mut buf = vec![0u8; 256 * 1024];
    let mut received = 0u64;
    while received < len {
        let want = (len - received).min(buf.len() as u64) as usize;
        let n = stream
            .read(&mut buf[..want])
            .await
            .map_err(|e| format!("after {received} bytes: {e}"))?;
        if n == 0 {
            return Err(format!("the download ended after {received} of {len} bytes"));
        }
        hasher.update(&buf[..n]);
        received += n as u64;
        let due = Duration::from_secs_f64(received as f64 / per_second as f64);
        if let Some(ahead) = due.checked_sub(began.elapsed()) {
            tokio::time::sleep(ahead).await;
        }
    }
    Ok(hasher.finalize().into())
}

/// The agent's live heap (bytes allocated and not freed).
const HEAP: &str = "konnectivity_network_proxy_agent_runtime_heap_bytes";

/// What rolling replacements with established connections did.
struct Established {
    /// New connections attempted (none may fail).
    attempted: usize,
    /// Lines that went through the long-lived connections.
    lines: usize,
    /// For each replacement and long-lived connection, the longest round
    /// trip of a line sent while the replacement ran: the pause the
    /// hand-over cost the connection.
    pauses: Vec<Duration>,
    /// A line's round trip outside replacements (median).
    round_trip: Duration,
    /// Each old agent's hand-over line.
    handed: Vec<String>,
}

/// Rolling replacement `n` of the node agent, as a DaemonSet rollout with
/// maxSurge does it: a successor started beside `agent` with `args` takes
/// the role over and resumes every established connection it is given;
/// once it is ready, `agent` gets SIGTERM and exits with nothing left to
/// drain, and one agent runs. The successor, and its log.
pub(crate) async fn roll_with_connections(
    topology: &Topology,
    agent: &mut Proc,
    args: &[String],
    n: usize,
) -> (Proc, String) {
    let successor = topology.start_node_agent(args);
    took_over(&successor).await;
    let log = successor.log_text();
    assert!(
        log.contains("established connections taken over from the previous agent, every one resumed"),
        "replacement {n}: the new agent did not resume every connection it took over:\n{}",
        log.lines()
            .filter(|line| line.contains("taken over") || line.contains("resum") || line.contains("server"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    topology.wait_node_ready().await;
    agent.signal("TERM");
    let status = agent.wait_exit(Duration::from_secs(20)).await;
    assert!(status.is_some(), "replacement {n}: the old agent did not exit");
    let old = agent.log_text();
    assert!(
        old.contains("open connections done; exiting"),
        "replacement {n}: the old agent had connections left to drain:\n{old}"
    );
    assert_eq!(
        node_agents(topology.dir.path()).len(),
        1,
        "replacement {n}: one agent runs"
    );
    (successor, log)
}

/// Five rolling replacements of the node agent (the successor starts beside
/// it, takes the role over, and the old one gets SIGTERM once the new one is
/// ready), with `--drain-timeout=5s` so that no connection can outlive a
/// replacement by draining, under load: 100 new connections a second through
/// the `kubernetes` VIP (TLS and a request), 20 long-lived connections each
/// carrying a numbered line every 10 ms, and a 1 GiB download. Asserts that
/// each old agent handed its established connections to its successor,
/// which resumed them at the server: no new connection fails, no long-lived
/// one breaks, no line goes missing or doubled, the download's SHA-256 is
/// intact; each old agent exits at its SIGTERM without draining anything,
/// one agent runs after each replacement, and the last one holds about the
/// descriptors and live heap the first one held.
async fn replace_rolling_with_established_connections() -> Established {
    const LONG_LIVED: usize = 20;
    const DOWNLOAD: u64 = 1 << 30;
    // About 25 s of transfer: it spans all five replacements.
    const DOWNLOAD_RATE: u64 = 40 << 20;
    let topology = build(false).await;
    let streams = targets::blob_on(
        tokio::net::TcpListener::from_std(topology.control_plane.bind_tcp(STREAMS)).unwrap(),
    )
    .await;
    let args = ["--drain-timeout=5s".to_owned(), STREAMS_CAPTURE.to_owned()];
    let mut agent = topology.start_node_agent(&args);
    topology.wait_node_ready().await;

    let load = Load::start(Target {
        netns: Path::new("/var/run/netns").join(&topology.node.name),
        addr: format!("{VIP}:443").parse().unwrap(),
        server_name: VIP.to_owned(),
        tls: topology.pki.client_tls(None, &[]),
        expect: VERSION_BODY.to_owned(),
        per_second: RATE,
        limit: Duration::from_secs(180),
    });
    let stop = Arc::new(AtomicBool::new(false));
    let mut long_lived = Vec::new();
    for _ in 0..LONG_LIVED {
        let stream = topology.node.connect_tcp(STREAMS_VIP).unwrap();
        long_lived.push(tokio::spawn(targets::numbered_lines(stream, stop.clone())));
    }
    let download = tokio::spawn(slow_download(
        topology.node.connect_tcp(STREAMS_VIP).unwrap(),
        DOWNLOAD,
        7,
        DOWNLOAD_RATE,
    ));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let first_fds = descriptors(agent.pid()).len();
    let first_heap = topology.node.metric(NODE_AGENT_HEALTH, HEAP).unwrap();

    let mut handed = Vec::new();
    let mut replacing = Vec::new();
    for n in 0..REPLACEMENTS {
        let began = Instant::now();
        let (successor, _) = roll_with_connections(&topology, &mut agent, &args, n).await;
        let log = agent.log_text();
        let line = log
            .lines()
            .find(|line| line.contains("established connections handed to the newer agent"))
            .unwrap_or_else(|| panic!("replacement {n}: no hand-over line in\n{log}"))
            .to_owned();
        handed.push(line);
        replacing.push((began, Instant::now()));
        agent = successor;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let last_fds = descriptors(agent.pid()).len();
    let last_heap = topology.node.metric(NODE_AGENT_HEALTH, HEAP).unwrap();
    stop.store(true, Ordering::Relaxed);
    let round_trips = targets::lines_of(long_lived, &format!("hand-overs:\n{}", handed.join("\n"))).await;
    let digest = download
        .await
        .unwrap()
        .unwrap_or_else(|broke| panic!("the download: {broke}\nhand-overs:\n{}", handed.join("\n")));
    assert_eq!(
        digest,
        targets::pattern_digest(DOWNLOAD, 7),
        "1 GiB arrived changed"
    );
    let attempts = load.finish();
    report("new connections", &attempts);
    let failed = failures(&attempts);
    assert!(
        failed.is_empty(),
        "failed new connections:\n{}",
        failed.join("\n")
    );
    println!("hand-overs:\n{}", handed.join("\n"));
    println!(
        "descriptors: first agent {first_fds}, last {last_fds}; live heap KiB: first {:.0}, last {:.0}",
        first_heap / 1024.0,
        last_heap / 1024.0
    );
    for line in &handed {
        assert!(
            line.contains("busy=0") && line.contains("not_resumable=0") && line.contains("not_sent=0"),
            "every established connection was handed over: {line}"
        );
    }
    assert!(
        last_fds <= first_fds + 4,
        "descriptors: first agent {first_fds}, last {last_fds}"
    );
    // Both measured under the same load (the download's window, the lines,
    // the new connections): what was handed over holds no more than the
    // first agent held for the same connections.
    assert!(
        last_heap <= first_heap * 1.5 + 4.0 * 1024.0 * 1024.0,
        "live heap: first agent {first_heap} bytes, last {last_heap}"
    );
    let taken = topology
        .node
        .metric(
            NODE_AGENT_HEALTH,
            "konnectivity_network_proxy_agent_captured_connections_taken_over_total{outcome=\"resumed\"}",
        )
        .unwrap_or(0.0);
    assert!(
        taken >= LONG_LIVED as f64,
        "the last agent counts what it took over: {taken}"
    );
    drop(streams);
    let during = |at: Instant| {
        replacing
            .iter()
            .any(|(began, ended)| at >= *began && at <= *ended)
    };
    let pauses = targets::pauses_during(&replacing, &round_trips);
    let mut outside: Vec<Duration> = round_trips
        .iter()
        .flatten()
        .filter(|(at, _)| !during(*at))
        .map(|(_, took)| *took)
        .collect();
    outside.sort();
    Established {
        attempted: attempts.len(),
        lines: round_trips.iter().map(Vec::len).sum(),
        pauses,
        round_trip: outside[outside.len() / 2],
        handed,
    }
}

/// See [`replace_rolling_with_established_connections`]. Without the
/// hand-over of established connections, the first old agent drains for
/// `--drain-timeout` and exits with every long-lived connection still open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_replacements_hand_established_connections_over() {
    if !root_or_skip("rolling_replacements_hand_established_connections_over") {
        return;
    }
    let rolled = replace_rolling_with_established_connections().await;
    let mut pauses = rolled.pauses.clone();
    pauses.sort();
    println!(
        "{} new connections, {} lines through long-lived connections; {} hand-overs; pause p50 {:?}, max {:?}; \
         round trip otherwise p50 {:?}",
        rolled.attempted,
        rolled.lines,
        rolled.handed.len(),
        pauses[pauses.len() / 2],
        pauses.last().unwrap(),
        rolled.round_trip
    );
}

/// What a crash loses is what the dead process held, and no more: a node
/// agent killed (SIGKILL) with 20 established connections takes their
/// sockets with it, so each client sees its connection end at once (no
/// hang); the server ends their streams, and the connections behind them,
/// as soon as the node's next agent opens a stream (not after
/// `--agent-resume-timeout`, a minute); and the next agent's connections
/// work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_node_agents_established_connections_end_at_once_and_only_they() {
    const DROPPED: &str = "konnectivity_network_proxy_server_resume_dropped_connections_total";
    if !root_or_skip("a_killed_node_agents_established_connections_end_at_once_and_only_they") {
        return;
    }
    let topology = build(false).await;
    let _streams = targets::blob_on(
        tokio::net::TcpListener::from_std(topology.control_plane.bind_tcp(STREAMS)).unwrap(),
    )
    .await;
    let args = [STREAMS_CAPTURE.to_owned()];
    let mut agent = topology.start_node_agent(&args);
    topology.wait_node_ready().await;
    let stop = Arc::new(AtomicBool::new(false));
    let mut long_lived = Vec::new();
    for _ in 0..20 {
        let stream = topology.node.connect_tcp(STREAMS_VIP).unwrap();
        long_lived.push(tokio::spawn(targets::numbered_lines(stream, stop.clone())));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let dropped_before = topology
        .control_plane
        .metric(SERVER_HEALTH, DROPPED)
        .unwrap_or(0.0);

    agent.kill();
    let killed = Instant::now();
    for (i, connection) in long_lived.into_iter().enumerate() {
        let ended = tokio::time::timeout(Duration::from_secs(5), connection)
            .await
            .unwrap_or_else(|_| panic!("connection {i} hangs after its agent was killed"))
            .unwrap();
        assert!(ended.is_err(), "connection {i} went on without its agent");
    }
    let ended_after = killed.elapsed();
    assert!(
        ended_after < Duration::from_secs(2),
        "the clients saw their connections end {ended_after:?} after the kill"
    );

    let agent = topology.start_node_agent(&args);
    topology.wait_node_ready().await;
    // The new agent's connection works, and its stream tells the server the
    // node's agent process changed.
    let stop = Arc::new(AtomicBool::new(false));
    let working = tokio::spawn(targets::numbered_lines(
        topology.node.connect_tcp(STREAMS_VIP).unwrap(),
        stop.clone(),
    ));
    let started = Instant::now();
    let control_plane = &topology.control_plane;
    wait_until(
        Duration::from_secs(10),
        "the server to end the dead agent's 20 streams",
        || async { control_plane.metric(SERVER_HEALTH, DROPPED).unwrap_or(0.0) >= dropped_before + 20.0 },
    )
    .await;
    let dropped_after = started.elapsed();
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    let lines = working.await.unwrap().expect("the new agent's connection works");
    assert!(lines.len() >= 10, "{} lines", lines.len());
    let dropped = control_plane.metric(SERVER_HEALTH, DROPPED).unwrap_or(0.0) - dropped_before;
    assert_eq!(dropped, 20.0, "exactly the dead agent's connections were ended");
    println!(
        "clients saw the end {ended_after:?} after the kill; the server ended the dead agent's streams \
         {dropped_after:?} after the new agent's first connection"
    );
    drop(agent);
}

/// A connection whose client does not read while it is handed over cannot
/// stop between two packets (the old agent's write to the client does not
/// finish): it stays with the old agent, counted `busy`, and carries on
/// there, intact, until that agent exits; the others go to the successor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_whose_client_does_not_read_stays_with_the_old_agent() {
    use tokio::io::AsyncWriteExt;
    if !root_or_skip("a_connection_whose_client_does_not_read_stays_with_the_old_agent") {
        return;
    }
    const LEN: u64 = 64 << 20;
    let topology = build(false).await;
    let _streams = targets::blob_on(
        tokio::net::TcpListener::from_std(topology.control_plane.bind_tcp(STREAMS)).unwrap(),
    )
    .await;
    let args = [STREAMS_CAPTURE.to_owned(), "--drain-timeout=60s".to_owned()];
    let mut old = topology.start_node_agent(&args);
    topology.wait_node_ready().await;
    // A download nobody reads yet: the windows and socket buffers fill, and
    // the old agent's write to the client waits.
    let mut stalled = topology.node.connect_tcp(STREAMS_VIP).unwrap();
    stalled.write_all(&targets::header(b'G', LEN, 5)).await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let reading = tokio::spawn(targets::numbered_lines(
        topology.node.connect_tcp(STREAMS_VIP).unwrap(),
        stop.clone(),
    ));
    tokio::time::sleep(Duration::from_secs(1)).await;

    let successor = topology.start_node_agent(&args);
    took_over(&successor).await;
    let log = old.log_text();
    let line = log
        .lines()
        .find(|line| line.contains("established connections handed to the newer agent"))
        .unwrap_or_else(|| panic!("no hand-over line in\n{log}"))
        .to_owned();
    assert!(
        line.contains("handed_over=1") && line.contains("busy=1"),
        "the reading connection went, the stalled one stayed: {line}"
    );
    // The stalled download, read now, arrives whole through the old agent.
    let digest = tokio::time::timeout(Duration::from_secs(60), targets::read_digest(&mut stalled, LEN))
        .await
        .expect("the download goes on")
        .expect("the download arrives whole");
    assert_eq!(digest, targets::pattern_digest(LEN, 5));
    stop.store(true, Ordering::Relaxed);
    let lines = reading.await.unwrap().expect("the handed-over connection works");
    assert!(lines.len() > 50, "{} lines", lines.len());
    // The old agent, told to stop, exits once its last connection is done.
    drop(stalled);
    old.signal("TERM");
    assert!(
        old.wait_exit(Duration::from_secs(20)).await.is_some(),
        "the old agent exits once its kept connection ended"
    );
    drop(successor);
}

/// An egress connection's two directions, whichever frontend opened it.
trait Duplex: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Duplex for S {}

/// How kube-apiserver reaches the server's socket: gRPC (grpc-go's client
/// holds the long-lived tunnels), or HTTP CONNECT.
#[derive(Clone)]
enum Frontend {
    Grpc { go_client: PathBuf },
    Connect,
}

/// An egress connection to `address` through the server's socket at `uds`,
/// opened as kube-apiserver opens one in `frontend`'s mode (in gRPC mode a
/// tunnel of its own, as konnectivity-client's).
async fn egress_connection(
    frontend: &Frontend,
    uds: &Path,
    address: &str,
) -> Result<Box<dyn Duplex>, String> {
    match frontend {
        Frontend::Grpc { .. } => {
            let tunnel = konnectivity_client::Tunnel::connect_uds(uds)
                .await
                .map_err(|e| format!("connect: {e}"))?;
            let stream = tunnel.dial(address).await.map_err(|e| format!("dial: {e}"))?;
            Ok(Box::new(stream))
        }
        Frontend::Connect => match crate::support::connect::via_uds(uds, address).await {
            Ok(Ok(stream)) => Ok(Box::new(stream)),
            Ok(Err(refused)) => Err(format!("CONNECT refused: {}", refused.head)),
            Err(error) => Err(format!("CONNECT: {error}")),
        },
    }
}

/// One new egress connection: a dial, a line echoed back.
async fn egress_round_trip(frontend: Frontend, uds: PathBuf, address: String) -> Result<(), String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let attempt = async {
        let mut stream = egress_connection(&frontend, &uds, &address).await?;
        stream
            .write_all(&targets::header(b'E', 0, 0))
            .await
            .map_err(|e| e.to_string())?;
        stream.write_all(b"ping\n").await.map_err(|e| e.to_string())?;
        let mut answer = [0u8; 5];
        stream
            .read_exact(&mut answer)
            .await
            .map_err(|e| format!("read: {e}"))?;
        match &answer {
            b"ping\n" => Ok(()),
            other => Err(format!("echoed {other:?}")),
        }
    };
    tokio::time::timeout(Duration::from_secs(10), attempt)
        .await
        .map_err(|_| "no answer within 10 s".to_owned())?
}

/// What a long-lived egress connection saw.
struct LinesSeen {
    echoed: u64,
    longest_ms: u64,
    /// When each line was sent and how long it took to come back (CONNECT
    /// mode; grpc-go's client reports the longest wait only).
    round_trips: Vec<(Instant, Duration)>,
}

/// A long-lived egress connection echoing a numbered line every 10 ms: in
/// gRPC mode grpc-go's client for 25 s, in CONNECT mode until `stop`.
async fn egress_lines(
    frontend: Frontend,
    uds: PathBuf,
    address: String,
    stop: Arc<AtomicBool>,
) -> Result<LinesSeen, String> {
    match frontend {
        Frontend::Grpc { go_client } => {
            let mut command = tokio::process::Command::new(go_client);
            command
                .arg("-socket")
                .arg(&uds)
                .arg("-echo")
                .arg(&address)
                .arg("-lines")
                .arg("25s")
                .kill_on_drop(true);
            let output = crate::support::foreign::run_client(command, "lines:").await;
            let summary = output.split("lines: ").nth(1).unwrap_or_default();
            let echoed = summary.split(' ').next().and_then(|n| n.parse().ok());
            let longest = summary
                .split("longest wait ")
                .nth(1)
                .and_then(|rest| rest.trim().strip_suffix("ms"))
                .and_then(|ms| ms.parse().ok());
            let (echoed, longest_ms) = echoed
                .zip(longest)
                .ok_or_else(|| format!("no summary in {output}"))?;
            Ok(LinesSeen {
                echoed,
                longest_ms,
                round_trips: Vec::new(),
            })
        }
        Frontend::Connect => {
            let stream = egress_connection(&Frontend::Connect, &uds, &address).await?;
            let round_trips = targets::numbered_lines(stream, stop).await?;
            let longest = round_trips.iter().map(|(_, took)| took.as_millis() as u64).max();
            Ok(LinesSeen {
                echoed: round_trips.len() as u64,
                longest_ms: longest.unwrap_or(0),
                round_trips,
            })
        }
    }
}

/// kube-apiserver's egress load on an agent being replaced, through the
/// server's socket to `address` (an echo and blob target): 100 new
/// connections a second (each a dial and an echoed line), 20 long-lived
/// connections each echoing a numbered line every 10 ms ([`egress_lines`]),
/// and a 1 GiB download read at 40 MiB/s, so that it spans the replacements.
struct EgressLoad {
    lines: Vec<tokio::task::JoinHandle<Result<LinesSeen, String>>>,
    download: tokio::task::JoinHandle<Result<[u8; 32], String>>,
    stop: Arc<AtomicBool>,
    new_connections: tokio::task::JoinHandle<(usize, Vec<String>)>,
}

/// What the egress load saw.
struct EgressOutcome {
    attempted: usize,
    failed: Vec<String>,
    echoed: u64,
    longest_ms: u64,
    /// Each long-lived connection's lines (CONNECT mode).
    round_trips: Vec<Vec<(Instant, Duration)>>,
}

const EGRESS_LONG_LIVED: usize = 20;
const EGRESS_DOWNLOAD: u64 = 1 << 30;

impl EgressLoad {
    fn start(frontend: Frontend, uds: &Path, address: &str) -> EgressLoad {
        let stop = Arc::new(AtomicBool::new(false));
        let lines = (0..EGRESS_LONG_LIVED)
            .map(|_| {
                tokio::spawn(egress_lines(
                    frontend.clone(),
                    uds.to_owned(),
                    address.to_owned(),
                    stop.clone(),
                ))
            })
            .collect();
        let download = {
            let (frontend, uds, address) = (frontend.clone(), uds.to_owned(), address.to_owned());
            tokio::spawn(async move {
                let stream = egress_connection(&frontend, &uds, &address).await?;
                slow_download(stream, EGRESS_DOWNLOAD, 13, 40 << 20).await
            })
        };
        let new_connections = {
            let (uds, address, stop) = (uds.to_owned(), address.to_owned(), stop.clone());
            tokio::spawn(async move {
                let mut attempts = tokio::task::JoinSet::new();
                let mut every = tokio::time::interval(Duration::from_millis(10));
                let mut attempted = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    every.tick().await;
                    attempted += 1;
                    attempts.spawn(egress_round_trip(frontend.clone(), uds.clone(), address.clone()));
                }
                let mut failed = Vec::new();
                while let Some(outcome) = attempts.join_next().await {
                    if let Err(error) = outcome.unwrap() {
                        failed.push(error);
                    }
                }
                (attempted, failed)
            })
        };
        EgressLoad {
            lines,
            download,
            stop,
            new_connections,
        }
    }

    /// Stops the new and the CONNECT mode's long-lived connections, waits
    /// for the rest, and asserts that the long-lived ones and the download
    /// came through whole (`handed`, the hand-over lines, go into the
    /// failure).
    async fn finish(self, handed: &[String]) -> EgressOutcome {
        self.stop.store(true, Ordering::Relaxed);
        let (attempted, failed) = self.new_connections.await.unwrap();
        let handed = handed.join("\n");
        let mut longest_ms = 0u64;
        let mut echoed = 0u64;
        let mut round_trips = Vec::new();
        for (i, connection) in self.lines.into_iter().enumerate() {
            let seen = tokio::time::timeout(Duration::from_secs(60), connection)
                .await
                .expect("the long-lived connection finishes")
                .unwrap_or_else(|broke| panic!("long-lived connection {i}: {broke}\nhand-overs:\n{handed}"))
                .unwrap_or_else(|broke| panic!("long-lived connection {i}: {broke}\nhand-overs:\n{handed}"));
            echoed += seen.echoed;
            longest_ms = longest_ms.max(seen.longest_ms);
            round_trips.push(seen.round_trips);
        }
        let digest = self
            .download
            .await
            .unwrap()
            .unwrap_or_else(|broke| panic!("the download: {broke}\nhand-overs:\n{handed}"));
        assert_eq!(
            digest,
            targets::pattern_digest(EGRESS_DOWNLOAD, 13),
            "1 GiB arrived changed"
        );
        EgressOutcome {
            attempted,
            failed,
            echoed,
            longest_ms,
            round_trips,
        }
    }
}

impl EgressOutcome {
    /// Prints the figures and asserts: no new connection failed, no line
    /// waited a second, every hand-over handed every session, and the last
    /// agent holds about the first one's descriptors and live heap (both
    /// read under the same load).
    fn assert_whole(&self, handed: &[String], descriptors: (usize, usize), heap: (f64, f64)) {
        let (first_fds, last_fds) = descriptors;
        let (first_heap, last_heap) = heap;
        println!(
            "new connections: {} attempted, {} failed; lines: {} echoed on {EGRESS_LONG_LIVED} connections, \
             longest wait {} ms; descriptors: first agent {first_fds}, last {last_fds}; live heap KiB: first {:.0}, \
             last {:.0}\nhand-overs:\n{}",
            self.attempted,
            self.failed.len(),
            self.echoed,
            self.longest_ms,
            first_heap / 1024.0,
            last_heap / 1024.0,
            handed.join("\n")
        );
        assert!(
            self.failed.is_empty(),
            "failed new connections:\n{}",
            self.failed.join("\n")
        );
        // The first agent has one session; each later one also the session
        // its predecessor handed over (it ends once its connections have).
        for line in handed {
            assert!(
                !line.contains("handed_over=0")
                    && line.contains("busy=0")
                    && line.contains("not_sent=0")
                    && line.contains("not_resumable=0"),
                "every agent stream's session was handed over: {line}"
            );
        }
        assert!(
            self.longest_ms < 1000,
            "the long-lived connections' lines paused {} ms during the hand-overs (budget: under 1 s)",
            self.longest_ms
        );
        assert!(
            last_fds <= first_fds + 4,
            "descriptors: first agent {first_fds}, last {last_fds}"
        );
        assert!(
            last_heap <= first_heap * 1.5 + 4.0 * 1024.0 * 1024.0,
            "live heap: first agent {first_heap} bytes, last {last_heap}"
        );
    }

    /// For each replacement (`replacing`: when each began and ended) and
    /// long-lived connection, the longest round trip of a line sent while
    /// it ran: the pause the hand-over cost the connection (CONNECT mode).
    fn pauses(&self, replacing: &[(Instant, Instant)]) -> Vec<Duration> {
        targets::pauses_during(replacing, &self.round_trips)
    }
}

/// The old agent's hand-over line for its egress sessions, once it exited
/// at its SIGTERM with nothing left to drain.
fn egress_handover_line(n: usize, log: &str) -> String {
    let line = log
        .lines()
        .find(|line| line.contains("egress sessions (agent streams and their connections) handed"))
        .unwrap_or_else(|| panic!("replacement {n}: no egress hand-over line in\n{log}"))
        .to_owned();
    assert!(
        log.contains("open connections done; exiting"),
        "replacement {n}: the old agent had connections left to drain ({line}):\n{log}"
    );
    line
}

/// Five rolling replacements of a node agent that is also its node's egress
/// agent, with `--drain-timeout=5s` so that nothing can outlive a
/// replacement by draining, under kube-apiserver's egress load
/// ([`EgressLoad`], gRPC mode) to a target on the node. Each old agent hands
/// its agent stream's session to its successor, which resumes it at the
/// server: no new connection fails, no line goes missing, doubled or out of
/// order or waits a second, the download's SHA-256 is intact, each old
/// agent exits at its SIGTERM with nothing left to drain, one agent runs
/// after each replacement, and the last holds about the first one's
/// descriptors. Without the hand-over of egress sessions the first old
/// agent drains for the 5 s and exits with every long-lived connection open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_replacements_hand_egress_sessions_over() {
    const EGRESS_TARGET: &str = "10.222.0.1:7100";
    if !root_or_skip("rolling_replacements_hand_egress_sessions_over") {
        return;
    }
    let Some(go_client) = crate::support::foreign::grpc_go_client() else {
        return;
    };
    let topology = build(false).await;
    let _target =
        targets::blob_on(tokio::net::TcpListener::from_std(topology.node.bind_tcp(EGRESS_TARGET)).unwrap())
            .await;
    let args = ["--drain-timeout=5s".to_owned()];
    let mut agent = topology.start_node_agent(&args);
    topology.wait_node_ready().await;
    let dir = topology.dir.path().to_owned();
    let load = EgressLoad::start(
        Frontend::Grpc { go_client },
        &dir.join("kas-egress.sock"),
        EGRESS_TARGET,
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    let first_fds = descriptors(agent.pid()).len();
    let first_heap = topology.node.metric(NODE_AGENT_HEALTH, HEAP).unwrap();

    let mut handed = Vec::new();
    for n in 0..REPLACEMENTS {
        let successor = topology.start_node_agent(&args);
        took_over(&successor).await;
        topology.wait_node_ready().await;
        agent.signal("TERM");
        let status = agent.wait_exit(Duration::from_secs(20)).await;
        assert!(status.is_some(), "replacement {n}: the old agent did not exit");
        handed.push(egress_handover_line(n, &agent.log_text()));
        assert_eq!(node_agents(&dir).len(), 1, "replacement {n}: one agent runs");
        agent = successor;
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let last_fds = descriptors(agent.pid()).len();
    let last_heap = topology.node.metric(NODE_AGENT_HEALTH, HEAP).unwrap();
    let outcome = load.finish(&handed).await;
    outcome.assert_whole(&handed, (first_fds, last_fds), (first_heap, last_heap));
    drop(agent);
}

/// Five rolling replacements of a plain egress agent (no node role) as an
/// egress DaemonSet with maxSurge rolls it: each successor starts beside the
/// old agent with `--egress-handover` and the same `--handover-socket`,
/// takes its agent stream's session over once it holds a stream of its own,
/// and the old agent then gets SIGTERM (`--drain-timeout=5s`). Under
/// kube-apiserver's egress load ([`EgressLoad`]) through the server's socket
/// in `mode`; asserts what [`EgressOutcome::assert_whole`] does. Loopback
/// only: no root needed.
async fn replace_plain_egress_agent(mode: &str, frontend: Frontend) -> (EgressOutcome, Vec<Duration>) {
    let handover_dir = crate::support::TempDir::new("konn-egress-handover");
    let args = vec![
        "--egress-handover".to_owned(),
        format!(
            "--handover-socket={}",
            handover_dir.path().join("handover.sock").display()
        ),
        "--drain-timeout=5s".to_owned(),
    ];
    let mut setup = crate::support::cluster::Setup::start(mode, true, &args).await;
    let target = targets::blob().await;
    let load = EgressLoad::start(frontend, setup.server.uds_path(), &target.addr.to_string());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let first_fds = descriptors(setup.agent.proc.pid()).len();
    let heap = |port| async move { crate::support::scrape::metric(port, HEAP).await.unwrap() };
    let first_heap = heap(setup.agent.health_port).await;

    let mut handed = Vec::new();
    let mut replacing = Vec::new();
    for n in 0..REPLACEMENTS {
        let began = Instant::now();
        let successor = setup.start_agent("agent-1", &args);
        wait_until(
            Duration::from_secs(20),
            "the successor to take the sessions over",
            || async {
                successor
                    .proc
                    .log_text()
                    .contains("took the previous agent's sessions over")
            },
        )
        .await;
        let mut old = std::mem::replace(&mut setup.agent, successor);
        old.proc.signal("TERM");
        let status = old.proc.wait_exit(Duration::from_secs(20)).await;
        assert!(status.is_some(), "replacement {n}: the old agent did not exit");
        handed.push(egress_handover_line(n, &old.proc.log_text()));
        replacing.push((began, Instant::now()));
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let last_fds = descriptors(setup.agent.proc.pid()).len();
    let last_heap = heap(setup.agent.health_port).await;
    let outcome = load.finish(&handed).await;
    outcome.assert_whole(&handed, (first_fds, last_fds), (first_heap, last_heap));
    let pauses = outcome.pauses(&replacing);
    (outcome, pauses)
}

/// [`replace_plain_egress_agent`] with kube-apiserver in gRPC mode (grpc-go
/// holds the long-lived tunnels).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_replacements_of_a_plain_egress_agent_hand_its_sessions_over() {
    let Some(go_client) = crate::support::foreign::grpc_go_client() else {
        return;
    };
    replace_plain_egress_agent("grpc", Frontend::Grpc { go_client }).await;
}

/// Pauses in milliseconds: the median, and the longest in parentheses.
fn p50_and_max(mut pauses: Vec<Duration>) -> String {
    pauses.sort();
    let ms = |d: &Duration| format!("{:.0}", d.as_secs_f64() * 1000.0);
    match (pauses.get(pauses.len() / 2), pauses.last()) {
        (Some(p50), Some(max)) => format!("{} ({})", ms(p50), ms(max)),
        _ => "-".to_owned(),
    }
}

/// [`replace_plain_egress_agent`] with kube-apiserver in HTTP CONNECT mode
/// over the server's socket (each connection a CONNECT as kube-apiserver
/// writes it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_replacements_of_a_plain_egress_agent_hand_http_connect_tunnels_over() {
    replace_plain_egress_agent("http-connect", Frontend::Connect).await;
}
