//! Egress sessions handed to the agent that replaces this one
//! (docs/handover.md, "Egress connections").
//!
//! An agent stream's session holds the connections the server had the agent
//! dial: kube-apiserver's `exec`, `logs -f`, `port-forward`, webhook calls.
//! With resume, all of its state is the stream's token and, per connection,
//! the endpoint socket and where each direction stands; a successor given
//! those resumes the stream at the server as if it had been lost, and the
//! server re-binds every connection to it. The session stops for that where
//! its state is whole (between packets from the server; what an endpoint
//! read and could not send yet, and the rest of a packet it was writing,
//! travel along), and is handed over whole, or not at all.

use std::net::SocketAddr;
use std::os::fd::OwnedFd;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

/// How the agent's egress sessions travel with the node role: the signal
/// and collection this agent's sessions answer when a successor asks, and
/// where the sessions this agent inherits go (to the agent's server loop).
#[derive(Clone)]
pub struct EgressHandover {
    pub handoff: std::sync::Arc<crate::handoff::HandOff<HandedSession>>,
    pub inherited: tokio::sync::mpsc::UnboundedSender<HandedSession>,
}

/// Says once, in the log and the metrics, what became of the sessions at a
/// hand-over: `sent` of `of` went, and the rest stayed here.
pub fn report_sent(
    metrics: &crate::metrics::NodeMetrics,
    sent: usize,
    of: usize,
    not_resumable: usize,
    busy: usize,
) {
    metrics.sessions_handed_over(sent, of - sent, not_resumable, busy);
    tracing::info!(
        handed_over = sent,
        not_sent = of - sent,
        not_resumable,
        busy,
        "egress sessions (agent streams and their connections) handed to the newer agent; the rest stay here \
         until their connections end or --drain-timeout (not resumable: the server offered no resume or \
         --resume-timeout=0; busy: did not stop within 2 s, a dial still pending or its stream being resumed)"
    );
}

/// How long a hand-over waits for the sessions to stop: each lets the dials
/// the server sent before its DRAIN arrive and finish first.
pub const COLLECT_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// What the successor needs to resume a session's stream.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionState {
    /// The server the stream was to (the token's server).
    pub server_id: String,
    /// The stream's resume token.
    pub token: String,
    /// The agent id the stream announced: the server resumes a session
    /// only for the identity that opened it.
    pub agent_id: String,
    /// The address the stream was dialed at, when servers are dialed each
    /// at its own (`--dial-every-address`).
    pub address: Option<SocketAddr>,
    /// The id the session gives its next connection.
    pub next_connect_id: i64,
}

/// One connection of a handed session.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointState {
    /// The connection's id at the server.
    pub connect_id: i64,
    /// Bytes of the endpoint's the server has written out.
    pub acknowledged: u64,
    /// The lengths of the packets sent after those and not yet
    /// acknowledged, in order; they travel with the bytes.
    #[serde(skip)]
    pub unacknowledged: Vec<usize>,
    /// Bytes read from the endpoint and not yet sent (after the packets).
    pub unsent: usize,
    /// Bytes of the server's written out to the endpoint.
    pub written: u64,
    /// The length of a packet from the server received whole and not yet
    /// all written out (0: none)...
    pub in_hand: usize,
    /// ...and how much of it is still to write (after the unsent bytes).
    pub in_hand_rest: usize,
    /// This side closed the connection and the server has not confirmed:
    /// no socket travels, only what the server may still need.
    #[serde(default)]
    pub closing: bool,
    /// The close's error, when it carries one.
    #[serde(default)]
    pub error: Option<String>,
}

impl EndpointState {
    /// The bytes that travel with the state: the packets, the unsent
    /// bytes, then the rest of the packet in hand.
    pub fn data_len(&self) -> usize {
        self.unacknowledged.iter().sum::<usize>() + self.unsent + self.in_hand_rest
    }
}

/// A connection of a handed session.
pub struct HandedEndpoint {
    pub state: EndpointState,
    /// What [`EndpointState::data_len`] counts, in one buffer.
    pub data: Bytes,
    /// The endpoint's socket; none for a connection being closed.
    pub socket: Option<OwnedFd>,
}

/// A handed connection's bytes, cut back into what they were.
#[derive(Debug, PartialEq, Eq)]
pub struct EndpointData {
    pub unacknowledged: Vec<Bytes>,
    pub unsent: Bytes,
    pub in_hand_rest: Bytes,
}

impl HandedEndpoint {
    /// The data cut back into its parts; `None` when they do not add up.
    pub fn parts(&self) -> Option<EndpointData> {
        let state = &self.state;
        if self.data.len() != state.data_len() || state.in_hand_rest > state.in_hand {
            return None;
        }
        let mut all = self.data.clone();
        let unacknowledged = state
            .unacknowledged
            .iter()
            .map(|len| all.split_to(*len))
            .collect();
        let unsent = all.split_to(state.unsent);
        Some(EndpointData {
            unacknowledged,
            unsent,
            in_hand_rest: all,
        })
    }
}

impl std::fmt::Debug for HandedEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandedEndpoint")
            .field("state", &self.state)
            .field("data", &self.data.len())
            .finish_non_exhaustive()
    }
}

/// An egress session on its way to the successor.
#[derive(Debug)]
pub struct HandedSession {
    pub state: SessionState,
    pub endpoints: Vec<HandedEndpoint>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_data_is_cut_back_into_its_parts() {
        let state = EndpointState {
            connect_id: 3,
            acknowledged: 10,
            unacknowledged: vec![2, 1],
            unsent: 3,
            written: 4,
            in_hand: 5,
            in_hand_rest: 2,
            closing: false,
            error: None,
        };
        let endpoint = HandedEndpoint {
            state: state.clone(),
            data: Bytes::from_static(b"abcdefxy"),
            socket: None,
        };
        assert_eq!(
            endpoint.parts().unwrap(),
            EndpointData {
                unacknowledged: vec![Bytes::from_static(b"ab"), Bytes::from_static(b"c")],
                unsent: Bytes::from_static(b"def"),
                in_hand_rest: Bytes::from_static(b"xy"),
            }
        );
        let short = HandedEndpoint {
            state,
            data: Bytes::from_static(b"abc"),
            socket: None,
        };
        assert!(short.parts().is_none());
    }
}
