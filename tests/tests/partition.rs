//! A network partition between node and control plane, longer than the
//! keepalive: the veth between two network namespaces goes down for 8 s and
//! comes back. Without resume (`--agent-resume-timeout=0`, upstream's
//! behaviour; with it, tests/tests/resume.rs) the server must notice the
//! dead agent stream (its pings go unanswered), fail what ran through it
//! with an error rather than a hang or wrong bytes, stop counting the agent
//! as ready, and take the agent back once the link returns, with nothing
//! left behind on either side.

use std::time::{Duration, Instant};

use crate::support::cluster::{open_fds, settled_fds};
use crate::support::connect::via_uds;
use crate::support::netns::root_or_skip;
use crate::support::split::{NODE_IP, READY, SERVER_HEALTH, Split};
use crate::support::targets::{self, pattern_digest};
use crate::support::wait_until;

const MIB: u64 = 1024 * 1024;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_longer_than_the_keepalive_fails_cleanly_and_heals() {
    if !root_or_skip("a_partition_longer_than_the_keepalive_fails_cleanly_and_heals") {
        return;
    }
    let split = Split::start(
        "konn-partition",
        &[
            // Pings every 2 s, each answered within 2 s or the stream is dropped.
            "--keepalive-time=2s".to_owned(),
            "--agent-resume-timeout=0".to_owned(),
        ],
        &[
            format!("--agent-identifiers=ipv4={NODE_IP}"),
            "--probe-interval=500ms".to_owned(),
            "--resume-timeout=0".to_owned(),
        ],
    )
    .await;
    let Split {
        server,
        agent,
        socket,
        target,
        node,
        control_plane,
        ..
    } = &split;
    let (socket, target) = (socket.clone(), target.clone());
    let cp = control_plane;
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
    // The same transfer as after the partition, so the baseline holds what
    // it needs; twice, memory the higher of the two (as Resources::highest).
    let mut memory = (0, 0);
    for seed in [1, 3] {
        transfer(16 * MIB, seed).await.unwrap();
        settled_fds(server.pid()).await;
        settled_fds(agent.pid()).await;
        let now = split.heap_kib();
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

    split.assert_back_to(fds, memory).await;
}
