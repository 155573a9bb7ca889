//! A network partition between node and control plane, longer than the
//! keepalive: the veth between two network namespaces goes down for 8 s and
//! comes back. Without resume (`--agent-resume-timeout=0`, upstream's
//! behaviour; with it, tests/tests/resume.rs) the server must notice the
//! dead agent stream (its pings go unanswered), fail what ran through it
//! with an error rather than a hang or wrong bytes, stop counting the agent
//! as ready, and take the agent back once the link returns, with nothing
//! left behind on either side.

use std::time::{Duration, Instant};

use crate::support::certs::Pki;
use crate::support::cluster::{memory_back_to, open_fds, settled_fds};
use crate::support::connect::via_uds;
use crate::support::netns::{Netns, link, root_or_skip};
use crate::support::targets::{self, pattern_digest};
use crate::support::{TempDir, wait_until};

const SERVER_IP: &str = "10.222.0.2";
const NODE_IP: &str = "10.222.0.1";
const AGENT_PORT: u16 = 8091;
const SERVER_HEALTH: u16 = 8092;
const AGENT_HEALTH: u16 = 8093;
const READY: &str = "konnectivity_network_proxy_server_ready_backend_connections";
const MIB: u64 = 1024 * 1024;
const SERVER_HEAP: &str = "konnectivity_network_proxy_server_runtime_heap_bytes";
const AGENT_HEAP: &str = "konnectivity_network_proxy_agent_runtime_heap_bytes";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_longer_than_the_keepalive_fails_cleanly_and_heals() {
    if !root_or_skip("a_partition_longer_than_the_keepalive_fails_cleanly_and_heals") {
        return;
    }
    let dir = TempDir::new("konn-partition");
    let pki = Pki::new(dir.path());
    let node = Netns::new("node");
    let control_plane = Netns::new("cp");
    link(
        &node,
        &format!("{NODE_IP}/24"),
        &control_plane,
        &format!("{SERVER_IP}/24"),
    );

    let socket = dir.path().join("frontend.sock");
    let server = control_plane.spawn(
        "proxy-server",
        &[
            "--mode=http-connect".to_owned(),
            format!("--uds-name={}", socket.display()),
            "--server-port=0".to_owned(),
            format!("--agent-port={AGENT_PORT}"),
            format!("--health-port={SERVER_HEALTH}"),
            format!("--cluster-cert={}", pki.server.cert.display()),
            format!("--cluster-key={}", pki.server.key.display()),
            format!("--cluster-ca-cert={}", pki.ca.display()),
            // Pings every 2 s, each answered within 2 s or the stream is dropped.
            "--keepalive-time=2s".to_owned(),
            "--agent-resume-timeout=0".to_owned(),
        ],
        dir.path(),
    );
    let agent = node.spawn(
        "proxy-agent",
        &[
            format!("--proxy-server-host={SERVER_IP}"),
            format!("--proxy-server-port={AGENT_PORT}"),
            format!("--ca-cert={}", pki.ca.display()),
            format!("--agent-cert={}", pki.agent.cert.display()),
            format!("--agent-key={}", pki.agent.key.display()),
            "--agent-id=node-agent".to_owned(),
            format!("--agent-identifiers=ipv4={NODE_IP}"),
            format!("--health-server-port={AGENT_HEALTH}"),
            "--sync-interval=100ms".to_owned(),
            "--sync-interval-cap=500ms".to_owned(),
            "--probe-interval=500ms".to_owned(),
            "--resume-timeout=0".to_owned(),
        ],
        dir.path(),
    );
    let cp = &control_plane;
    wait_until(Duration::from_secs(15), "the agent to connect", || async {
        cp.metric(SERVER_HEALTH, READY) == Some(1.0)
    })
    .await;

    // The target lives on the node, where only the agent can reach it.
    let listener = node.bind_tcp(&format!("{NODE_IP}:0"));
    let target = targets::blob_on(tokio::net::TcpListener::from_std(listener).unwrap()).await;
    let target = target.addr.to_string();
    let transfer = |len: u64, seed: u64| {
        let socket = socket.clone();
        let target = target.clone();
        async move {
            let mut tunnel = via_uds(&socket, &target)
                .await?
                .map_err(|r| std::io::Error::other(format!("{r:?}")))?;
            let (sent, received) = targets::push(&mut tunnel, len, seed).await?;
            assert_eq!(sent, received, "pushed bytes changed on the way");
            let pulled = targets::pull(&mut tunnel, len, seed).await?;
            assert_eq!(
                pulled,
                pattern_digest(len, seed),
                "pulled bytes changed on the way"
            );
            Ok::<_, std::io::Error>(())
        }
    };
    // The heap (KiB) of the server and of the agent, from their metrics.
    let heap = || {
        let kib =
            |netns: &Netns, port, family| netns.metric(port, family).map_or(0, |bytes| bytes as u64 / 1024);
        (
            kib(&control_plane, SERVER_HEALTH, SERVER_HEAP),
            kib(&node, AGENT_HEALTH, AGENT_HEAP),
        )
    };
    // The same transfer as after the partition, so the baseline holds what
    // it needs; twice, memory the higher of the two (as Resources::highest).
    let mut memory = (0, 0);
    for seed in [1, 3] {
        transfer(16 * MIB, seed).await.unwrap();
        settled_fds(server.pid()).await;
        settled_fds(agent.pid()).await;
        let now = heap();
        memory = (memory.0.max(now.0), memory.1.max(now.1));
    }
    let fds = (open_fds(server.pid()), open_fds(agent.pid()));

    // An endless pull is running when the link goes down.
    let mut tunnel = via_uds(&socket, &target)
        .await
        .unwrap()
        .expect("CONNECT accepted");
    let running = tokio::spawn(async move { targets::pull(&mut tunnel, u64::MAX / 2, 7).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    node.ip(&["link", "set", "veth0", "down"]);
    let cut = Instant::now();

    let outcome = tokio::time::timeout(Duration::from_secs(10), running)
        .await
        .expect("the transfer hung through the partition")
        .unwrap();
    assert!(outcome.is_err(), "an endless pull cannot complete: {outcome:?}");
    let noticed = cut.elapsed();
    wait_until(
        Duration::from_secs(10),
        "the server to drop the agent",
        || async { cp.metric(SERVER_HEALTH, READY) == Some(0.0) },
    )
    .await;
    for gauge in [
        "konnectivity_network_proxy_server_established_connections",
        "konnectivity_network_proxy_server_pending_backend_dials",
    ] {
        assert_eq!(cp.metric(SERVER_HEALTH, gauge), Some(0.0), "{gauge}");
    }
    // Meanwhile new requests are refused at once, not left hanging.
    let refused = tokio::time::timeout(Duration::from_secs(5), via_uds(&socket, &target))
        .await
        .expect("a dial during the partition hung")
        .unwrap()
        .expect_err("no agent is reachable");
    assert_eq!(refused.status, 500, "{refused:?}");

    let remaining = Duration::from_secs(8).saturating_sub(cut.elapsed());
    tokio::time::sleep(remaining).await;
    node.ip(&["link", "set", "veth0", "up"]);
    wait_until(
        Duration::from_secs(30),
        "the agent back on the server",
        || async { cp.metric(SERVER_HEALTH, READY) == Some(1.0) },
    )
    .await;
    eprintln!(
        "partition noticed after {noticed:?}, healed after {:?}",
        cut.elapsed()
    );
    transfer(16 * MIB, 2).await.unwrap();

    let node_ref = &node;
    let current = || async {
        let endpoints = node_ref.metric(
            AGENT_HEALTH,
            "konnectivity_network_proxy_agent_open_endpoint_connections",
        );
        let now_fds = (open_fds(server.pid()), open_fds(agent.pid()));
        let now_memory = heap();
        let back = endpoints == Some(0.0)
            && now_fds == fds
            && memory_back_to(now_memory.0, memory.0)
            && memory_back_to(now_memory.1, memory.1);
        (back, (endpoints, now_fds, now_memory))
    };
    let (endpoints, now_fds, now_memory) =
        crate::support::wait_until_or_last(Duration::from_secs(15), current).await;
    eprintln!("heap (server, agent) before {memory:?} KiB, after {now_memory:?} KiB");
    assert_eq!(endpoints, Some(0.0), "the agent's endpoint connections");
    assert_eq!(now_fds, fds, "(server, agent) descriptors");
    assert!(
        memory_back_to(now_memory.0, memory.0) && memory_back_to(now_memory.1, memory.1),
        "heap more than 10% above its baseline"
    );
}
