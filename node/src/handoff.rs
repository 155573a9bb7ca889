//! What hands established connections to the agent that replaces this one
//! (docs/handover.md): one signal every connection of a kind watches, and
//! the collection of what stopped for the successor within a deadline.
//!
//! When a successor asks, each connection stops where its state is whole
//! and promises itself; the hand-over takes what was promised in time. A
//! connection that cannot stop in time (a client not reading, a stream
//! being resumed) stays with this agent and drains as before; one that
//! cannot resume at all is only counted.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::watch;

/// What a hand-over collected, and what it left with this agent.
pub struct Collected<T> {
    pub connections: Vec<T>,
    /// Connections whose stream cannot resume (an upstream server, or
    /// `--resume-timeout=0`): they stay and drain.
    pub not_resumable: usize,
    /// Resumable connections that did not stop in time.
    pub busy: usize,
}

/// The signal every connection of one kind watches, and what they give:
/// captured connections (`T` = [`crate::capture::handoff::HandedConnection`])
/// and egress sessions (`T` = [`crate::sessions::HandedSession`]).
pub struct HandOff<T> {
    requested: watch::Sender<bool>,
    collecting: Mutex<Collecting<T>>,
    /// Resumable connections being relayed now.
    resumable: AtomicUsize,
    /// Connections that are not.
    plain: AtomicUsize,
}

struct Collecting<T> {
    /// Connections are taken (between the request and the deadline).
    open: bool,
    /// Connections that stopped to be handed over.
    promised: usize,
    given: Vec<T>,
}

/// Counts a relayed connection while it lives (a connection handed over
/// stopped counting when it promised).
pub struct Carried<T> {
    handoff: Arc<HandOff<T>>,
    resumable: bool,
    handed_over: bool,
}

impl<T> Carried<T> {
    /// The connection that promised itself ([`HandOff::promise`]) gives
    /// itself to the successor.
    pub fn give(mut self, connection: T) {
        self.handed_over = true;
        self.handoff.collecting().given.push(connection);
    }
}

impl<T> Drop for Carried<T> {
    fn drop(&mut self) {
        match (self.handed_over, self.resumable) {
            (true, _) => 0,
            (false, true) => self.handoff.resumable.fetch_sub(1, Ordering::AcqRel),
            (false, false) => self.handoff.plain.fetch_sub(1, Ordering::AcqRel),
        };
    }
}

impl<T> HandOff<T> {
    pub fn new() -> Arc<HandOff<T>> {
        Arc::new(HandOff {
            requested: watch::Sender::new(false),
            collecting: Mutex::new(Collecting {
                open: false,
                promised: 0,
                given: Vec::new(),
            }),
            resumable: AtomicUsize::new(0),
            plain: AtomicUsize::new(0),
        })
    }

    /// The signal a connection watches: `true` once a successor asks.
    pub fn signal(&self) -> watch::Receiver<bool> {
        self.requested.subscribe()
    }

    /// Counts a connection being relayed until the guard is dropped.
    pub fn carry(self: &Arc<Self>, resumable: bool) -> Carried<T> {
        match resumable {
            true => self.resumable.fetch_add(1, Ordering::AcqRel),
            false => self.plain.fetch_add(1, Ordering::AcqRel),
        };
        Carried {
            handoff: self.clone(),
            resumable,
            handed_over: false,
        }
    }

    fn collecting(&self) -> std::sync::MutexGuard<'_, Collecting<T>> {
        self.collecting.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A resumable connection that stopped asks to be handed over: `true`
    /// binds it to [`Carried::give`] its state at once; `false` (too late)
    /// means it carries on here.
    pub fn promise(&self) -> bool {
        let mut collecting = self.collecting();
        if collecting.open {
            collecting.promised += 1;
            self.resumable.fetch_sub(1, Ordering::AcqRel);
        }
        collecting.open
    }

    /// Asks every connection to stop and waits, at most `wait`, until every
    /// resumable one has given itself. Blocking: the hand-over runs on a
    /// thread of its own.
    pub fn collect(&self, wait: Duration) -> Collected<T> {
        self.collecting().open = true;
        self.requested.send_replace(true);
        let deadline = Instant::now() + wait;
        while self.resumable.load(Ordering::Acquire) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
        let (promised, busy) = {
            let mut collecting = self.collecting();
            collecting.open = false;
            (collecting.promised, self.resumable.load(Ordering::Acquire))
        };
        // A connection that promised gives itself without waiting for
        // anything; this only covers the moment in between.
        let deadline = Instant::now() + Duration::from_secs(1);
        while self.collecting().given.len() < promised && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        let connections = std::mem::take(&mut self.collecting().given);
        Collected {
            busy,
            not_resumable: self.plain.load(Ordering::Acquire),
            connections,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Connections that stop give themselves; a resumable one that does not
    /// stop in time is counted busy and can no longer promise; plain ones
    /// are counted and never asked.
    #[test]
    fn a_collection_takes_what_stopped_in_time_and_counts_the_rest() {
        let handoff = HandOff::new();
        let mut signal = handoff.signal();
        let stopping = handoff.carry(true);
        let stuck = handoff.carry(true);
        let _plain = handoff.carry(false);
        assert!(!handoff.promise(), "nothing is taken before a successor asks");
        let connection = {
            let handoff = handoff.clone();
            std::thread::spawn(move || {
                while !*signal.borrow_and_update() {
                    std::thread::sleep(Duration::from_millis(1));
                }
                assert!(handoff.promise());
                stopping.give(7u32);
            })
        };
        let collected = handoff.collect(Duration::from_millis(200));
        connection.join().unwrap();
        assert_eq!(collected.connections.len(), 1);
        assert_eq!(collected.busy, 1);
        assert_eq!(collected.not_resumable, 1);
        assert!(!handoff.promise(), "too late: it carries on here");
        drop(stuck);
    }
}
