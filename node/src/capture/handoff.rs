//! Established captured connections handed to the agent that replaces this
//! one (docs/handover.md, "Established connections").
//!
//! Every resumable captured connection watches one signal
//! ([`crate::handoff::HandOff`]). When a successor asks for the
//! connections, each stops where its state is whole: between two packets
//! from the server (never inside a write to its client), with
//! whatever it read from its client and could not yet send kept aside. It
//! then gives its socket and that state here, and the hand-over sends them
//! on; the successor resumes each on its own node tunnel with the stream's
//! token, as after a lost stream. A connection that cannot stop in time (a
//! client that does not read, a stream being resumed) stays with this agent
//! and drains as before.

use std::os::fd::OwnedFd;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

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
}
