//! Faults, with checksummed transfers running through them: whatever
//! happens, a transfer either arrives with the right SHA-256 or fails with
//! an error, every affected connection ends within a bounded time, and the
//! processes return to their baseline of open files and tasks.

use std::time::{Duration, Instant};

use crate::support::cluster::Setup;
use crate::support::connect::via_uds;
use crate::support::targets::{self, pattern_digest};
use tokio::io::AsyncWriteExt;

const MIB: u64 = 1024 * 1024;

/// Dials, pushes and pulls `len` bytes through a fresh tunnel.
async fn round_trip(setup: &Setup, target: &str, len: u64, seed: u64) {
    let mut tunnel = via_uds(setup.server.uds_path(), target)
        .await
        .unwrap()
        .expect("CONNECT accepted");
    let (sent, received) = targets::push(&mut tunnel, len, seed).await.unwrap();
    assert_eq!(sent, received, "pushed bytes changed on the way");
    let pulled = targets::pull(&mut tunnel, len, seed).await.unwrap();
    assert_eq!(
        pulled,
        pattern_digest(len, seed),
        "pulled bytes changed on the way"
    );
}

/// Opens `count` tunnels at once, each with half a header sent (the target
/// waits for the rest forever), and returns them.
async fn open_idle_tunnels(setup: &Setup, target: &str, count: usize) -> Vec<tokio::net::UnixStream> {
    let mut open = Vec::with_capacity(count);
    while open.len() < count {
        let batch = (count - open.len()).min(250);
        let dials = (0..batch).map(|_| async {
            let mut tunnel = via_uds(setup.server.uds_path(), target)
                .await
                .unwrap()
                .expect("CONNECT accepted");
            tunnel.write_all(&[b'P'; 8]).await.unwrap();
            tunnel
        });
        open.extend(futures_util::future::join_all(dials).await);
    }
    open
}

/// 5,000 tunnels opened at once, each with a few bytes in flight, then all
/// dropped by the client without a word, four times over: the server, the
/// agent and the target side all let go at once, and the last two rounds
/// end with the processes back at the descriptors, tasks and memory of the
/// first two.
///
/// The baseline comes from the first two rounds: the async runtime keeps
/// the I/O tables the first 5,000 needed for reuse, so memory grows once;
/// a leak would grow it every round (see `Resources::highest`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_thousand_abandoned_tunnels_leave_nothing_behind() {
    const TUNNELS: usize = 5000;
    // This process holds both ends' sockets (clients and target).
    konnectivity_plumbing::raise_open_files_limit().unwrap();
    let setup = Setup::start("http-connect", true, &[]).await;
    let target = targets::blob().await;
    let target = target.addr.to_string();
    round_trip(&setup, &target, MIB, 1).await;
    setup.assert_gauges_return_to_zero().await;
    let before = setup.baseline().await;
    let mut warm_ups = Vec::new();
    for _ in 1..=2 {
        drop(open_idle_tunnels(&setup, &target, TUNNELS).await);
        setup.assert_gauges_return_to_zero().await;
        warm_ups.push(setup.baseline().await);
    }
    eprintln!("before any: {before:?}\nafter rounds 1 and 2: {warm_ups:?}");
    let baseline = warm_ups.pop().unwrap().highest(warm_ups.pop().unwrap());
    assert_eq!(
        (baseline.server_fds, baseline.agent_fds),
        (before.server_fds, before.agent_fds)
    );

    for round in 3..=4 {
        let open = open_idle_tunnels(&setup, &target, TUNNELS).await;
        assert_eq!(open.len(), TUNNELS);
        let started = Instant::now();
        drop(open);
        setup.assert_gauges_return_to_zero().await;
        eprintln!(
            "round {round}: {TUNNELS} abandoned tunnels released in {:?}",
            started.elapsed()
        );
        setup.assert_resources_return_to(&baseline).await;
        eprintln!("round {round}: {:?}", setup.resources().await);
    }
    round_trip(&setup, &target, MIB, 2).await;
}

/// The server is killed (SIGKILL) in the middle of a transfer: the client
/// sees an error, never wrong bytes, within seconds; the agent keeps the
/// endpoint connection for a resume until the restarted server says it has
/// no such session, then lets go of it at once (docs/resume.md), and the
/// restarted server carries new transfers intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_mid_transfer_fails_it_cleanly_and_a_restarted_one_serves() {
    let mut setup = Setup::start("http-connect", true, &[]).await;
    let target = targets::blob().await;
    let target = target.addr.to_string();
    round_trip(&setup, &target, 4 * MIB, 1).await;
    setup.assert_gauges_return_to_zero().await;
    // Two warm-up rounds, the agent's memory the higher of the two (as
    // Resources::highest): what a round grows once is in the baseline.
    let mut warm_ups = Vec::new();
    for _ in 1..=2 {
        kill_the_server_mid_transfer(&mut setup, &target).await;
        warm_ups.push(setup.baseline().await);
    }
    let baseline = warm_ups.pop().unwrap().highest(warm_ups.pop().unwrap());
    kill_the_server_mid_transfer(&mut setup, &target).await;
    // The agent kept nothing of the dead servers' streams or their tunnels.
    setup.assert_agent_returns_to(&baseline).await;
}

/// A 64 GiB pull through the tunnel, the server killed under it: the client
/// sees an error within seconds, the agent lets go of the endpoint as soon
/// as the restarted server refuses to resume, and the restarted server
/// carries a new transfer intact.
async fn kill_the_server_mid_transfer(setup: &mut Setup, target: &str) {
    let mut tunnel = via_uds(setup.server.uds_path(), target)
        .await
        .unwrap()
        .expect("CONNECT accepted");
    let len = 64 * 1024 * MIB;
    let transfer = tokio::spawn(async move { targets::pull(&mut tunnel, len, 9).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    setup.server.proc.kill();
    let killed = Instant::now();
    let outcome = tokio::time::timeout(Duration::from_secs(5), transfer)
        .await
        .expect("the client was left hanging after the server died")
        .unwrap();
    assert!(
        outcome.is_err(),
        "a 64 GiB pull cannot have completed: {outcome:?}"
    );
    eprintln!(
        "client saw {:?} after {:?}",
        outcome.unwrap_err(),
        killed.elapsed()
    );

    // The agent closes the endpoint connection the dead stream carried once
    // the restarted server tells it the stream cannot resume.
    setup.server.restart().await;
    crate::support::wait_until(
        Duration::from_secs(10),
        "the agent to release its endpoint",
        || async {
            crate::support::scrape::metric(
                setup.agent.health_port,
                "konnectivity_network_proxy_agent_open_endpoint_connections",
            )
            .await
                == Some(0.0)
        },
    )
    .await;
    setup.server.wait_backends(1).await;
    round_trip(setup, target, 4 * MIB, 3).await;
    setup.assert_gauges_return_to_zero().await;
}
