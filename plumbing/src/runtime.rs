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
/// beside the collection that depends on it. mimalloc keeps freed memory for
/// reuse: with the system allocator every encoded 64 KiB packet cost fresh
/// pages (page faults and unmaps were 5% of the CPU time of a bulk transfer).
pub use mimalloc::MiMalloc as Allocator;

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

/// A multi-threaded runtime whose workers collect freed memory when they
/// park (at most every [`COLLECT_INTERVAL`]) and are nudged awake every
/// [`NUDGE_INTERVAL`] so that an idle one does too.
pub fn multi_thread() -> std::io::Result<tokio::runtime::Runtime> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .on_thread_park(collect_when_due)
        .build()?;
    let workers = runtime.metrics().num_workers();
    runtime.spawn(nudge_idle_workers(workers));
    Ok(runtime)
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
