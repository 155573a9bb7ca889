//! The async runtime proxy-server and proxy-agent run on.
//!
//! Its workers hand the memory they freed back to the allocator when they
//! run out of work, so resident memory falls back after a burst of tunnels
//! instead of staying at its peak. The allocator (mimalloc) only sorts out a
//! thread's freed memory when that thread allocates again or asks it to;
//! blocks one worker frees into another's pages wait for that other worker.

use std::cell::Cell;
use std::time::{Duration, Instant};

/// The allocator both binaries install (`#[global_allocator]`), kept here
/// beside the collection that depends on it: mimalloc, which keeps freed
/// memory for reuse (with the system allocator every encoded 64 KiB packet
/// cost fresh pages: page faults and unmaps were 5% of the CPU time of a bulk
/// transfer), counting the live bytes (`crate::sys::heap_bytes`).
pub use crate::sys::CountingAllocator as Allocator;

/// How often, at most, one worker hands freed memory back. Workers park
/// after nearly every burst of work, thousands of times a second under
/// load: collecting on every park put the 1 KiB round trip of
/// `hack/bench.sh` up by 3–6 µs (2–4%); once per 10 ms is indistinguishable
/// from not collecting at all.
const COLLECT_INTERVAL: Duration = Duration::from_millis(10);

/// How often idle workers are woken so that they collect too. An idle
/// process's timers and probes wake one worker; the others would keep what
/// was freed into their pages until traffic comes back.
const NUDGE_INTERVAL: Duration = Duration::from_secs(1);

/// How many threads run the binary's tasks.
#[derive(clap::Args, Debug, Clone)]
#[command(next_help_heading = "konnectivity-rs additions")]
pub struct RuntimeArgs {
    /// Threads that run tunnels and listeners. 0: half the CPUs available to the
    /// process (its cgroup's CPU limit counts), at least one.
    #[arg(long, default_value_t = 0)]
    pub worker_threads: usize,
}

impl RuntimeArgs {
    /// The worker count to start with: `--worker-threads`, or the default.
    ///
    /// Not one per CPU, as tokio's default is: a tunnel's bytes pass through
    /// several tasks in each process (frontend connection, agent stream,
    /// endpoint), and with a worker per CPU tokio spreads them over every
    /// CPU, so each hand-off wakes another CPU and moves the chunk between
    /// caches. The proxy always shares its machine with the peers on the same
    /// path (kube-apiserver beside the server, the targets beside the
    /// agent). Measured with hack/bench.sh --runs 5 on 2 CPUs, one worker each
    /// instead of two: one stream up +35% (CONNECT, our client; +13-17% with
    /// the Go client), new connections +15-23%, dial latency -10-18%, 8
    /// streams +10-16%; download and round trips within noise.
    pub fn workers(&self) -> usize {
        if self.worker_threads > 0 {
            return self.worker_threads;
        }
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        (cpus / 2).max(1)
    }
}

/// A multi-threaded runtime of `workers` threads whose workers collect freed
/// memory when they park (at most every [`COLLECT_INTERVAL`]) and are nudged
/// awake every [`NUDGE_INTERVAL`] so that an idle one does too.
pub fn multi_thread(workers: usize) -> std::io::Result<tokio::runtime::Runtime> {
    no_transparent_huge_pages();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .on_thread_park(collect_when_due)
        .build()?;
    // The count is on the binary's start-up line too (-v=0).
    tracing::debug!(worker_threads = workers, "runtime started");
    runtime.spawn(nudge_idle_workers(workers));
    Ok(runtime)
}

/// Turns transparent huge pages off for this process. mimalloc asks the
/// kernel for them on its eagerly committed arenas (`madvise(MADV_HUGEPAGE)`),
/// so a connection's few touched bytes could pin a 2 MiB page: hack/bench.sh
/// measured an idle single-use gRPC tunnel at 44 KiB of server memory with
/// them and 28 KiB without, and a bare HTTP/2 connection at 36 and 22 KiB;
/// throughput did not change. Memory handed back (`collect_freed_memory`)
/// also returns whole 4 KiB pages, which a huge page would hold. Applies to
/// every later page fault of the process; failing (an old kernel) changes
/// nothing but the figures.
fn no_transparent_huge_pages() {
    if let Err(error) = nix::sys::prctl::set_thp_disable(true) {
        tracing::debug!(%error, "transparent huge pages stay on (PR_SET_THP_DISABLE)");
    }
}

fn collect_when_due() {
    thread_local! {
        static LAST_COLLECT: Cell<Option<Instant>> = const { Cell::new(None) };
    }
    let now = Instant::now();
    LAST_COLLECT.with(|last| {
        if last
            .get()
            .is_none_or(|at| now.duration_since(at) >= COLLECT_INTERVAL)
        {
            last.set(Some(now));
            crate::sys::collect_freed_memory();
        }
    });
}

/// Spawns one empty task per worker every [`NUDGE_INTERVAL`]: the runtime
/// wakes parked workers to pick up new tasks, and each parks again straight
/// away, collecting on the way.
async fn nudge_idle_workers(workers: usize) {
    let mut tick = tokio::time::interval(NUDGE_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tick.tick().await;
        for _ in 0..workers {
            tokio::spawn(async {});
        }
    }
}
