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
use std::time::Duration;

use crate::support::containerd::{Pod, containerd_or_skip};
use crate::support::cri_node::Node;
use crate::support::kas::*;
use crate::support::load::{Attempt, Load, Target, failures};
use crate::support::procs::Proc;
use crate::support::wait_until;

const REPLACEMENTS: usize = 5;
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

/// The node agents of `node` running: those given its hand-over socket
/// (other tests' node agents run on this machine too).
fn node_agents(node: &Node) -> Vec<u32> {
    let flag = format!("--handover-socket={}", node.dir().join("handover.sock").display());
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
async fn took_over(agent: &Proc) {
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
        || async { node_agents(node).len() == 1 },
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_replacement_of_the_node_agent_fails_no_connection() {
    if !containerd_or_skip("a_rolling_replacement_of_the_node_agent_fails_no_connection") {
        return;
    }
    let mut node = Node::start(true, true).await;
    let first = node.containerd.run_pod("client", "default").await.unwrap();
    node.assert_reaches_the_api_server(&first, "the first pod").await;
    let agent_pid = node.agent.as_ref().unwrap().pid();
    let before_pod = descriptors(agent_pid).len();
    let mut pods = vec![first];
    let second = node.containerd.run_pod("client-2", "default").await.unwrap();
    let per_pod = descriptors(agent_pid).len() - before_pod;
    pods.push(second);
    let baseline = descriptors(agent_pid);

    let pod_netns = node.containerd.netns_of(&pods[0]).await;
    let from_node = load_from(&node, node_netns(&node));
    let from_pod = load_from(&node, pod_netns);
    // A 200 MiB download through the VIP, slowed so that it spans every
    // replacement, checksummed as it arrives.
    let download = node.topology.node.spawn_program(
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
    );
    tokio::time::sleep(Duration::from_secs(1)).await;

    let mut replaced = Vec::new();
    for n in 0..REPLACEMENTS {
        // The DaemonSet's surge pod starts beside the old one; kubelet
        // creates a pod meanwhile.
        let old = node.agent.take().unwrap();
        node.start_agent();
        let name = format!("during-{n}");
        let adding = node.containerd.run_pod(&name, "default");
        let (added, ()) = tokio::join!(adding, took_over(node.agent.as_ref().unwrap()));
        pods.push(added.unwrap_or_else(|status| panic!("RunPodSandbox during replacement {n}: {status}")));
        // Ready: the old pod is deleted, and its agent told to stop.
        node.topology.wait_node_ready().await;
        old.signal("TERM");
        replaced.push(old);
        tokio::time::sleep(Duration::from_secs(1)).await;
    }

    wait_until(Duration::from_secs(60), "the download to finish", || async {
        std::fs::read_to_string(node.dir().join("blob.sha256")).is_ok_and(|sum| !sum.is_empty())
    })
    .await;
    drop(download);
    let sum = std::fs::read_to_string(node.dir().join("blob.sha256")).unwrap();
    assert!(
        sum.starts_with(&node.topology.blob_sha256),
        "200 MiB arrived changed: {sum}"
    );
    let (node_attempts, pod_attempts) = (from_node.finish(), from_pod.finish());
    report("from the node", &node_attempts);
    report("from a pod", &pod_attempts);
    let failed: Vec<String> = failures(&node_attempts)
        .into_iter()
        .chain(failures(&pod_attempts))
        .collect();
    assert!(failed.is_empty(), "failed connections:\n{}", failed.join("\n"));
    let seconds = node_attempts.last().unwrap().started.as_secs_f64();
    assert!(
        (node_attempts.len() + pod_attempts.len()) as f64 >= 1.8 * f64::from(RATE) * seconds,
        "the load ran at 200 a second"
    );

    // Each old agent exits once its connections are done.
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
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_node_agent_is_replaced_with_refusals_meanwhile_never_hangs() {
    if !containerd_or_skip("a_killed_node_agent_is_replaced_with_refusals_meanwhile_never_hangs") {
        return;
    }
    let mut node = Node::start(true, false).await;
    let pod = node.containerd.run_pod("client", "default").await.unwrap();
    node.assert_reaches_the_api_server(&pod, "the first pod").await;
    let pod_netns = node.containerd.netns_of(&pod).await;
    let from_node = load_from(&node, node_netns(&node));
    let from_pod = load_from(&node, pod_netns);
    tokio::time::sleep(Duration::from_secs(1)).await;

    let mut restarts = Vec::new();
    let mut pods = vec![pod];
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
    for attempts in [&node_attempts, &pod_attempts] {
        for attempt in attempts.iter().filter(|a| a.outcome.is_err()) {
            assert!(
                attempt.took < Duration::from_secs(1),
                "a connection while no agent runs is refused at once, never hangs: {attempt:?}"
            );
        }
    }
    // From the new process' start until captured connections work again,
    // from the node and from the pod.
    for (n, restart) in restarts.iter().enumerate() {
        let recovered = |attempts: &[Attempt]| {
            attempts
                .iter()
                .find(|a| a.started >= *restart && a.outcome.is_ok())
                .map(|a| a.started + a.took - *restart)
                .expect("connections work again")
        };
        eprintln!(
            "restart {n}: captured connections work again {:?} (node) and {:?} (pod) after the new agent started",
            recovered(&node_attempts),
            recovered(&pod_attempts)
        );
    }
    assert_one_agent_and_one_set_of_rules(&node, &pods).await;
}
