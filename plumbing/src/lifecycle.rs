//! Drain and shutdown: one trigger, many watchers.
//!
//! Every task that must finish its work before the process stops (a
//! listener, a frontend connection with its tunnel, a gRPC server) holds a
//! [`Watcher`], and clones it for the tasks it starts. Stopping is then one
//! step: [`Trigger::drain`] tells them all, each winds down its own way (a
//! listener stops accepting and closes its socket, a gRPC server sends
//! GOAWAY and waits for its streams, a connection finishes its tunnel) and
//! drops its watcher, and the trigger waits until none is left, or until a
//! deadline. Nothing is polled: the wait ends when the last watcher drops.
//!
//! The agent uses the same signal without the wait: its first SIGTERM tells
//! every server stream to send DRAIN ([`Trigger::signal`]).

use std::convert::Infallible;
use std::time::Duration;

use tokio::sync::{mpsc, watch};

/// Creates a trigger and its first watcher.
pub fn channel() -> (Trigger, Watcher) {
    let (signal, signaled) = watch::channel(false);
    // Never sent on: the channel closes when the last watcher's sender goes.
    let (alive, watchers_gone) = mpsc::channel::<Infallible>(1);
    (
        Trigger {
            signal,
            count: alive.downgrade(),
            watchers_gone,
        },
        Watcher {
            signaled,
            _alive: alive,
        },
    )
}

/// Starts the drain and waits for it.
#[derive(Debug)]
pub struct Trigger {
    signal: watch::Sender<bool>,
    /// Counts the watchers alive without being one.
    count: mpsc::WeakSender<Infallible>,
    /// Ends once every watcher has dropped.
    watchers_gone: mpsc::Receiver<Infallible>,
}

/// How a drain ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drained {
    /// Every watcher finished.
    Complete,
    /// The deadline passed with this many watchers still at work.
    TimedOut { remaining: usize },
}

impl Trigger {
    /// Tells every watcher to wind down, without waiting for them.
    pub fn signal(&self) {
        self.signal.send_replace(true);
    }

    /// Whether the drain has been signalled.
    pub fn is_signaled(&self) -> bool {
        *self.signal.borrow()
    }

    /// How many watchers are alive now.
    pub fn watchers(&self) -> usize {
        self.count.strong_count()
    }

    /// Signals, then waits until every watcher has dropped or `limit` has
    /// passed.
    pub async fn drain(mut self, limit: Duration) -> Drained {
        self.signal();
        match tokio::time::timeout(limit, self.watchers_gone.recv()).await {
            Ok(_) => Drained::Complete,
            Err(_) => Drained::TimedOut {
                remaining: self.watchers(),
            },
        }
    }
}

/// Held by a task for as long as the drain must wait for it.
#[derive(Clone, Debug)]
pub struct Watcher {
    signaled: watch::Receiver<bool>,
    _alive: mpsc::Sender<Infallible>,
}

impl Watcher {
    /// Resolves once the drain is signalled, or the trigger is gone (the
    /// process is stopping without one).
    pub async fn signaled(&self) {
        let mut signaled = self.signaled.clone();
        let _ = signaled.wait_for(|signaled| *signaled).await;
    }

    /// Whether the drain has been signalled.
    pub fn is_signaled(&self) -> bool {
        *self.signaled.borrow()
    }

    /// Holds the drain without watching for it: for a task that only has to
    /// finish (a frontend connection's tunnel), at the size of one pointer
    /// in its state: a watcher in every idle tunnel's task cost 1 KiB each
    /// in hack/bench.sh.
    pub fn hold(&self) -> Hold {
        Hold {
            _alive: self._alive.clone(),
        }
    }
}

/// Keeps the drain waiting while it lives; see [`Watcher::hold`].
#[derive(Debug)]
pub struct Hold {
    _alive: mpsc::Sender<Infallible>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_drain_waits_for_every_watcher_and_no_longer() {
        let (trigger, watcher) = channel();
        let workers: Vec<_> = (0..3u64)
            .map(|n| {
                let watcher = watcher.clone();
                tokio::spawn(async move {
                    watcher.signaled().await;
                    // Each winds down in its own time, then drops its watcher.
                    tokio::time::sleep(Duration::from_millis(20 * n)).await;
                })
            })
            .collect();
        drop(watcher);
        assert_eq!(trigger.watchers(), 3);
        let started = tokio::time::Instant::now();
        assert_eq!(trigger.drain(Duration::from_secs(10)).await, Drained::Complete);
        assert!(
            started.elapsed() >= Duration::from_millis(40),
            "returned before the slowest"
        );
        for worker in workers {
            worker.await.unwrap();
        }
    }

    #[tokio::test]
    async fn a_watcher_that_never_finishes_is_left_at_the_deadline() {
        let (trigger, watcher) = channel();
        let stuck = watcher.hold();
        drop(watcher);
        let drained = trigger.drain(Duration::from_millis(30)).await;
        assert_eq!(drained, Drained::TimedOut { remaining: 1 });
        drop(stuck);
    }

    #[tokio::test]
    async fn signalling_reaches_watchers_made_before_and_after() {
        let (trigger, watcher) = channel();
        assert!(!watcher.is_signaled());
        let waiting = {
            let watcher = watcher.clone();
            tokio::spawn(async move { watcher.signaled().await })
        };
        trigger.signal();
        waiting.await.unwrap();
        assert!(watcher.clone().is_signaled());
        assert!(trigger.is_signaled());
        // A dropped trigger counts as a signal: nobody waits forever.
        let (trigger, watcher) = channel();
        drop(trigger);
        watcher.signaled().await;
    }
}
