//! A bounded soak on loopback: for SOAK_SECONDS (60 by default), eight
//! clients keep mixing small and bulk checksummed transfers, cancelled
//! transfers and dials abandoned mid-handshake through one server, while
//! the second of its two agents is killed and restarted every 7 s. At the
//! end it reports totals, and holds the system to: no corrupted byte ever
//! delivered, only the errors an agent's death explains, every gauge back at
//! zero, and the server and the surviving agent back at their descriptors
//! and tasks, with memory bounded.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support::cluster::Setup;
use crate::support::connect::via_uds;
use crate::support::targets::{self, pattern_digest};
use tokio::io::AsyncReadExt;

const CLIENTS: u64 = 8;
const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;

#[derive(Default, Debug)]
struct Totals {
    connections: u64,
    completed: u64,
    bytes_verified: u64,
    corrupted: u64,
    cancelled: u64,
    abandoned_dials: u64,
    agent_restarts: u64,
    errors: BTreeMap<String, u64>,
}

/// A small deterministic generator: each client's sequence is reproducible.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// What went wrong, by kind, for the report.
fn kind(error: &std::io::Error) -> String {
    format!("io {:?}", error.kind())
}

async fn one_transfer(socket: &std::path::Path, target: &str, len: u64, seed: u64, totals: &Mutex<Totals>) {
    totals.lock().unwrap().connections += 1;
    let mut tunnel = match via_uds(socket, target).await {
        Ok(Ok(tunnel)) => tunnel,
        Ok(Err(refused)) => {
            *totals
                .lock()
                .unwrap()
                .errors
                .entry(format!("CONNECT {}", refused.status))
                .or_default() += 1;
            return;
        }
        Err(error) => {
            *totals.lock().unwrap().errors.entry(kind(&error)).or_default() += 1;
            return;
        }
    };
    let result = async {
        let (sent, received) = targets::push(&mut tunnel, len, seed).await?;
        let pulled = targets::pull(&mut tunnel, len, seed).await?;
        Ok::<_, std::io::Error>((sent == received) && pulled == pattern_digest(len, seed))
    }
    .await;
    let mut totals = totals.lock().unwrap();
    match result {
        Ok(true) => {
            totals.completed += 1;
            totals.bytes_verified += 2 * len;
        }
        Ok(false) => totals.corrupted += 1,
        Err(error) => *totals.errors.entry(kind(&error)).or_default() += 1,
    }
}

async fn client(
    id: u64,
    socket: std::path::PathBuf,
    target: String,
    until: Instant,
    totals: Arc<Mutex<Totals>>,
) {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (id + 1));
    while Instant::now() < until {
        let seed = rng.next();
        match rng.next() % 10 {
            // Mostly small exchanges, as kube-apiserver's are.
            0..=5 => one_transfer(&socket, &target, 64 * KIB, seed, &totals).await,
            6 | 7 => one_transfer(&socket, &target, 16 * MIB, seed, &totals).await,
            // A pull given up part way (kubectl logs -f interrupted).
            8 => {
                totals.lock().unwrap().connections += 1;
                if let Ok(Ok(mut tunnel)) = via_uds(&socket, &target).await {
                    let _ = targets::request_pull(&mut tunnel, 1 << 40, seed).await;
                    let mut some = vec![0u8; 256 * 1024];
                    let _ = tunnel.read_exact(&mut some).await;
                }
                totals.lock().unwrap().cancelled += 1;
            }
            // A client that goes away in the middle of its CONNECT.
            _ => {
                totals.lock().unwrap().connections += 1;
                let dial = via_uds(&socket, &target);
                let _ = tokio::time::timeout(Duration::from_micros(rng.next() % 2000), dial).await;
                totals.lock().unwrap().abandoned_dials += 1;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_with_agent_restarts_corrupts_nothing_and_leaks_nothing() {
    let seconds: u64 = std::env::var("SOAK_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let setup = Setup::start("http-connect", true, &[]).await;
    let mut second = setup.start_agent("agent-2", &[]);
    setup.server.wait_backends(2).await;
    let target = targets::blob().await;
    let target = target.addr.to_string();
    let socket = setup.server.uds_path().to_owned();

    // Warm up at the soak's own concurrency so the baseline has what it
    // needs: twice 5 s, the baseline's memory the higher of the two.
    let mut warm_ups = Vec::new();
    for round in 0..2 {
        let totals = Arc::new(Mutex::new(Totals::default()));
        let warm = Instant::now() + Duration::from_secs(5);
        let warmups: Vec<_> = (0..CLIENTS)
            .map(|id| {
                tokio::spawn(client(
                    100 * (round + 1) + id,
                    socket.clone(),
                    target.clone(),
                    warm,
                    totals.clone(),
                ))
            })
            .collect();
        for warmup in warmups {
            warmup.await.unwrap();
        }
        setup.assert_gauges_return_to_zero().await;
        warm_ups.push(setup.baseline().await);
    }
    let baseline = warm_ups.pop().unwrap().highest(warm_ups.pop().unwrap());

    let totals = Arc::new(Mutex::new(Totals::default()));
    let started = Instant::now();
    let until = started + Duration::from_secs(seconds);
    let clients: Vec<_> = (0..CLIENTS)
        .map(|id| tokio::spawn(client(id, socket.clone(), target.clone(), until, totals.clone())))
        .collect();
    // Every 7 s the second agent dies (SIGKILL) and a new one takes its
    // place, while the first carries on.
    while Instant::now() + Duration::from_secs(7) < until {
        tokio::time::sleep(Duration::from_secs(7)).await;
        second.proc.kill();
        second = setup.start_agent("agent-2", &[]);
        totals.lock().unwrap().agent_restarts += 1;
    }
    for client in clients {
        client.await.unwrap();
    }
    let elapsed = started.elapsed();
    setup.server.wait_backends(2).await;
    setup.assert_gauges_return_to_zero().await;

    {
        let totals = totals.lock().unwrap();
        eprintln!(
            "soak {elapsed:?}: {} connections, {} transfers verified ({} MiB), {} cancelled, {} dials abandoned, \
         {} agent restarts, {} corrupted, errors {:?}",
            totals.connections,
            totals.completed,
            totals.bytes_verified / MIB,
            totals.cancelled,
            totals.abandoned_dials,
            totals.agent_restarts,
            totals.corrupted,
            totals.errors
        );
        assert_eq!(totals.corrupted, 0, "corrupted bytes were delivered");
        assert!(totals.completed > 100, "too little got through to call it a soak");
        // Errors come only from transfers that ran through the killed agent:
        // resets and early ends, at most a handful per restart.
        for (kind, count) in &totals.errors {
            assert!(
                matches!(
                    kind.as_str(),
                    "io ConnectionReset" | "io UnexpectedEof" | "io BrokenPipe" | "CONNECT 502"
                ),
                "unexpected error kind {kind} ({count} times)"
            );
        }
        let errors: u64 = totals.errors.values().sum();
        assert!(
            errors <= (totals.agent_restarts + 1) * CLIENTS,
            "{errors} errors for {} restarts",
            totals.agent_restarts
        );
    }
    // The server and the agent that lived through it all: the same
    // descriptors and tasks, and the heap at most 25% (and a slack) above
    // the warm-up's. Not 10% as elsewhere: under this mix of concurrent bulk
    // transfers resident memory after identical rounds moved between -5% and
    // +20% with no trend (eight rounds of 8 x 16 MiB push+pull: 17.2, 17.0,
    // 17.0, 17.7, 20.9, 18.5, 18.4, 18.5 MiB), and the heap moves with the
    // buffers of eight live connections; a leak shows as growth with time
    // (SOAK_SECONDS).
    let mut now = setup.resources().await;
    for _ in 0..150 {
        if now.back_within(&baseline, 25) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        now = setup.resources().await;
    }
    eprintln!("after the warm-up {baseline:?}\nafter the soak    {now:?}");
    assert_eq!(
        (now.server_fds, now.agent_fds),
        (baseline.server_fds, baseline.agent_fds),
        "descriptors leaked"
    );
    assert_eq!(
        (now.server_tasks, now.agent_tasks),
        (baseline.server_tasks, baseline.agent_tasks),
        "tasks leaked"
    );
    for (after, before, who) in [
        (now.server_heap_kib, baseline.server_heap_kib, "server"),
        (now.agent_heap_kib, baseline.agent_heap_kib, "agent"),
    ] {
        assert!(
            crate::support::cluster::memory_within(after, before, 25),
            "{who} heap {after} KiB after the soak, more than 25% above the {before} KiB after the warm-up"
        );
    }
}
