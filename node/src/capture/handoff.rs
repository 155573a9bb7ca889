//! Established captured connections handed to the agent that replaces this
//! one (docs/handover.md, "Established connections").
//!
//! Every resumable captured connection watches one signal. When a successor
//! asks for the connections, each stops where its state is whole: between
//! two packets from the server (never inside a write to its client), with
//! whatever it read from its client and could not yet send kept aside. It
//! then gives its socket and that state here, and the hand-over sends them
//! on; the successor resumes each on its own node tunnel with the stream's
//! token, as after a lost stream. A connection that cannot stop in time (a
//! client that does not read, a stream being resumed) stays with this agent
//! and drains as before.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

/// A captured connection's state as the predecessor held it: everything its
/// successor needs to resume the connection's stream at the server.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnectionState {
    /// The connection's id at the server.
    pub connect_id: i64,
    /// The resumable stream's token (`konnectivity-rs-resume-token`).
    pub token: String,
    /// Bytes of the client's the server has written out (acknowledged).
    pub acknowledged: u64,
    /// The lengths of the packets sent after those and not yet
    /// acknowledged, in order: the server acknowledges whole packets.
    /// Thousands when a client writes small pieces, so they travel with
    /// the bytes rather than in the packet's text.
    #[serde(skip)]
    pub unacknowledged: Vec<usize>,
    /// Bytes read from the client and not yet sent (after the packets).
    pub unsent: usize,
    /// Bytes from the server written out to the client.
    pub written: u64,
    /// The client had closed its side: CLOSE_REQ goes after a resume.
    pub close_requested: bool,
}

impl ConnectionState {
    /// The bytes that travel with the state: the packets, then the unsent.
    pub fn data_len(&self) -> usize {
        self.unacknowledged.iter().sum::<usize>() + self.unsent
    }
}

/// A captured connection on its way to the successor.
pub struct HandedConnection {
    pub state: ConnectionState,
    /// The unacknowledged packets, then the unsent bytes, as
    /// [`ConnectionState`] measures them, in one buffer: the packets are
    /// often tiny, and each its own buffer would cost far more than its
    /// bytes on the way.
    pub data: Bytes,
    /// The client's socket.
    pub socket: OwnedFd,
}

impl std::fmt::Debug for HandedConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandedConnection")
            .field("state", &self.state)
            .field("data", &self.data.len())
            .finish_non_exhaustive()
    }
}

impl HandedConnection {
    /// The data cut back into the packets and the unsent bytes the state
    /// says; `None` when they do not add up.
    pub fn packets(&self) -> Option<(Vec<Bytes>, Option<Bytes>)> {
        if self.data.len() != self.state.data_len() {
            return None;
        }
        let mut all = self.data.clone();
        let packets = self
            .state
            .unacknowledged
            .iter()
            .map(|len| all.split_to(*len))
            .collect();
        Some((packets, (!all.is_empty()).then_some(all)))
    }
}

/// What a hand-over collected, and what it left with this agent.
pub struct Collected<T = HandedConnection> {
    pub connections: Vec<T>,
    /// Connections whose stream cannot resume (an upstream server, or
    /// `--resume-timeout=0`): they stay and drain.
    pub not_resumable: usize,
    /// Resumable connections that did not stop in time.
    pub busy: usize,
}

/// The signal every captured connection watches, and what they give. The
/// egress sessions (`T` = [`crate::sessions::HandedSession`]) are handed
/// over the same way.
pub struct HandOff<T = HandedConnection> {
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
pub struct Carried<T = HandedConnection> {
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

    fn state(packets: &[usize], unsent: usize) -> ConnectionState {
        ConnectionState {
            connect_id: 7,
            token: "token".to_owned(),
            acknowledged: 100,
            unacknowledged: packets.to_vec(),
            unsent,
            written: 5,
            close_requested: false,
        }
    }

    fn handed(state: ConnectionState, data: &'static [u8]) -> HandedConnection {
        let data = Bytes::from_static(data);
        let socket = std::fs::File::open("/dev/null").unwrap().into();
        HandedConnection { state, data, socket }
    }

    #[test]
    fn the_data_is_cut_back_into_the_packets_it_was() {
        let connection = handed(state(&[3, 2], 4), b"abcdefghi");
        let (packets, unsent) = connection.packets().unwrap();
        assert_eq!(packets, [Bytes::from_static(b"abc"), Bytes::from_static(b"de")]);
        assert_eq!(unsent, Some(Bytes::from_static(b"fghi")));
        let short = handed(state(&[3, 2], 4), b"abcd");
        assert!(short.packets().is_none(), "data that does not add up is refused");
        let nothing = handed(state(&[], 0), b"");
        assert_eq!(nothing.packets().unwrap(), (Vec::new(), None));
    }

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
                stopping.give(handed(state(&[], 0), b""));
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
