//! What a sender keeps of one connection's DATA until the peer has written it
//! out, so that a stream cut under the connection loses nothing
//! (docs/resume.md).
//!
//! Each direction of a connection numbers its bytes from 0. The sender keeps
//! every packet it sent and the peer has not yet written out: references to
//! the packets' buffers, never copies. Flow control already bounds them: at
//! most one window of DATA is unacknowledged. An idle connection keeps
//! nothing.
//!
//! The peer acknowledges with the absolute count of bytes it has written out
//! (WINDOW_UPDATE's `written`), so a repeated or late acknowledgement is
//! harmless; the credit the sender gets back is the cost of exactly the
//! packets the acknowledgement releases.

use std::collections::VecDeque;

use bytes::Bytes;

/// A DATA packet sent and not yet written out by the peer.
#[derive(Debug, Clone)]
struct Sent {
    offset: u64,
    data: Bytes,
}

impl Sent {
    fn end(&self) -> u64 {
        self.offset + self.data.len() as u64
    }
}

/// A peer's position that no packet we sent can explain: it claims bytes we
/// never sent, or fewer than it already acknowledged, or a position inside
/// a packet (peers receive and write whole packets).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum OffsetError {
    #[error("the peer claims {claimed} bytes but only {sent} were sent")]
    BeyondSent { claimed: u64, sent: u64 },
    #[error("the peer claims {claimed} bytes but had already written out {acknowledged}")]
    BeforeAcknowledged { claimed: u64, acknowledged: u64 },
    #[error("the peer's position {claimed} falls inside the packet at {packet_offset}")]
    InsidePacket { claimed: u64, packet_offset: u64 },
}

/// One direction of one connection, on its sending side.
#[derive(Debug, Default)]
pub struct Replay {
    /// The offset of the next byte to send.
    next: u64,
    /// What the peer has written out (acknowledged).
    acknowledged: u64,
    /// Sent and not acknowledged, in order; empty when idle (no allocation).
    unacknowledged: VecDeque<Sent>,
}

impl Replay {
    /// Records a packet about to be sent; returns its offset.
    pub fn record(&mut self, data: &Bytes) -> u64 {
        let offset = self.next;
        self.next += data.len() as u64;
        self.unacknowledged.push_back(Sent {
            offset,
            data: data.clone(),
        });
        offset
    }

    /// Bytes sent so far.
    pub fn sent(&self) -> u64 {
        self.next
    }

    /// A replay that continues one another process kept (a hand-over,
    /// docs/handover.md): the peer has written out `acknowledged` bytes,
    /// and `packets` were sent after them and not yet acknowledged. Packet
    /// boundaries are kept: the peer acknowledges whole packets.
    pub fn restore(acknowledged: u64, packets: Vec<Bytes>) -> Replay {
        let mut replay = Replay {
            next: acknowledged,
            acknowledged,
            unacknowledged: VecDeque::new(),
        };
        for data in &packets {
            replay.record(data);
        }
        replay
    }

    /// What the peer has written out so far.
    pub fn acknowledged(&self) -> u64 {
        self.acknowledged
    }

    /// The packets sent and not yet acknowledged, in order (references to
    /// their buffers).
    pub fn unacknowledged_packets(&self) -> Vec<Bytes> {
        self.unacknowledged.iter().map(|sent| sent.data.clone()).collect()
    }

    /// Bytes sent and not yet acknowledged.
    pub fn unacknowledged_bytes(&self) -> u64 {
        self.next - self.acknowledged
    }

    /// The peer has written out `written` bytes: releases the packets that
    /// covers and returns their window cost (by flow control's `cost` of a
    /// packet's length), the credit the sender gets back. An
    /// acknowledgement at or before an earlier one releases nothing.
    pub fn acknowledge(&mut self, written: u64, cost: impl Fn(usize) -> u32) -> Result<u32, OffsetError> {
        if written > self.next {
            return Err(OffsetError::BeyondSent {
                claimed: written,
                sent: self.next,
            });
        }
        if written <= self.acknowledged {
            return Ok(0);
        }
        self.check_boundary(written)?;
        let mut credit = 0u32;
        while let Some(front) = self.unacknowledged.front()
            && front.end() <= written
        {
            credit = credit.saturating_add(cost(front.data.len()));
            self.unacknowledged.pop_front();
        }
        self.acknowledged = written;
        if self.unacknowledged.is_empty() {
            // Give the ring's memory back: an idle connection keeps nothing.
            self.unacknowledged = VecDeque::new();
        }
        Ok(credit)
    }

    /// The packets to send again to a peer that has received `received`
    /// bytes: every packet from that position on, as (offset, data).
    pub fn since(&self, received: u64) -> Result<Vec<(u64, Bytes)>, OffsetError> {
        if received > self.next {
            return Err(OffsetError::BeyondSent {
                claimed: received,
                sent: self.next,
            });
        }
        if received < self.acknowledged {
            return Err(OffsetError::BeforeAcknowledged {
                claimed: received,
                acknowledged: self.acknowledged,
            });
        }
        self.check_boundary(received)?;
        Ok(self
            .unacknowledged
            .iter()
            .filter(|sent| sent.offset >= received && sent.end() > received)
            .map(|sent| (sent.offset, sent.data.clone()))
            .collect())
    }

    /// `position` must fall between packets.
    fn check_boundary(&self, position: u64) -> Result<(), OffsetError> {
        match self
            .unacknowledged
            .iter()
            .find(|sent| sent.offset < position && position < sent.end())
        {
            Some(inside) => Err(OffsetError::InsidePacket {
                claimed: position,
                packet_offset: inside.offset,
            }),
            None => Ok(()),
        }
    }
}

/// Where DATA from the peer stands against what this side has received.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrival {
    /// The next bytes, in order.
    Next,
    /// Bytes already received (sent again after a resume): drop them.
    Duplicate,
}

/// DATA that does not continue what was received: bytes are missing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("DATA at offset {offset} when {received} bytes were received: bytes are missing")]
pub struct Gap {
    pub offset: u64,
    pub received: u64,
}

/// Places DATA of `len` bytes at `offset` against `received`.
pub fn arrival(received: u64, offset: u64, len: usize) -> Result<Arrival, Gap> {
    let end = offset.saturating_add(len as u64);
    if offset == received {
        Ok(Arrival::Next)
    } else if end <= received && offset < received {
        Ok(Arrival::Duplicate)
    } else {
        Err(Gap { offset, received })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Flow control's measure: payload plus a fixed cost per packet.
    fn cost(len: usize) -> u32 {
        len as u32 + 64
    }

    fn packet(len: usize, fill: u8) -> Bytes {
        Bytes::from(vec![fill; len])
    }

    #[test]
    fn acknowledgements_release_whole_packets_and_return_their_cost() {
        let mut replay = Replay::default();
        assert_eq!(replay.record(&packet(100, 1)), 0);
        assert_eq!(replay.record(&packet(50, 2)), 100);
        assert_eq!(replay.record(&packet(10, 3)), 150);
        assert_eq!(replay.sent(), 160);
        assert_eq!(replay.acknowledge(100, cost), Ok(cost(100)));
        assert_eq!(replay.unacknowledged_bytes(), 60);
        // Repeated, older and equal acknowledgements release nothing.
        assert_eq!(replay.acknowledge(100, cost), Ok(0));
        assert_eq!(replay.acknowledge(0, cost), Ok(0));
        assert_eq!(replay.acknowledge(160, cost), Ok(cost(50) + cost(10)));
        assert_eq!(replay.unacknowledged_bytes(), 0);
        assert_eq!(
            replay.unacknowledged.capacity(),
            0,
            "an idle connection keeps no memory"
        );
    }

    #[test]
    fn what_is_sent_again_starts_where_the_peer_stopped_and_shares_the_buffers() {
        let mut replay = Replay::default();
        let first = packet(100, 1);
        let second = packet(50, 2);
        replay.record(&first);
        replay.record(&second);
        let again = replay.since(100).unwrap();
        assert_eq!(again.len(), 1);
        assert_eq!(again[0].0, 100);
        assert_eq!(again[0].1.as_ptr(), second.as_ptr(), "a reference, not a copy");
        assert_eq!(replay.since(0).unwrap().len(), 2);
        assert!(replay.since(150).unwrap().is_empty());
    }

    #[test]
    fn positions_no_packet_explains_are_refused() {
        let mut replay = Replay::default();
        replay.record(&packet(100, 1));
        replay.record(&packet(100, 2));
        assert_eq!(
            replay.since(201),
            Err(OffsetError::BeyondSent {
                claimed: 201,
                sent: 200
            })
        );
        assert_eq!(
            replay.acknowledge(250, cost),
            Err(OffsetError::BeyondSent {
                claimed: 250,
                sent: 200
            })
        );
        assert_eq!(
            replay.since(150),
            Err(OffsetError::InsidePacket {
                claimed: 150,
                packet_offset: 100
            })
        );
        assert_eq!(replay.acknowledge(100, cost), Ok(cost(100)));
        assert_eq!(
            replay.since(50),
            Err(OffsetError::BeforeAcknowledged {
                claimed: 50,
                acknowledged: 100
            })
        );
        // A refused position changed nothing.
        assert_eq!(replay.since(100).unwrap().len(), 1);
    }

    /// A replay handed to another process continues exactly: the same
    /// offsets, the same packet boundaries, the same acknowledgements.
    #[test]
    fn a_restored_replay_continues_where_the_first_one_stood() {
        let mut first = Replay::default();
        first.record(&packet(100, 1));
        first.record(&packet(50, 2));
        first.record(&packet(10, 3));
        first.acknowledge(100, cost).unwrap();
        let mut restored = Replay::restore(first.acknowledged(), first.unacknowledged_packets());
        assert_eq!(restored.sent(), 160);
        assert_eq!(restored.unacknowledged_bytes(), 60);
        assert_eq!(restored.since(100).unwrap(), first.since(100).unwrap());
        assert_eq!(
            restored.since(120),
            Err(OffsetError::InsidePacket {
                claimed: 120,
                packet_offset: 100
            })
        );
        assert_eq!(restored.record(&packet(5, 4)), 160);
        assert_eq!(restored.acknowledge(150, cost), Ok(cost(50)));
        assert_eq!(restored.since(150).unwrap().len(), 2);
    }

    #[test]
    fn arrivals_are_next_duplicate_or_a_gap() {
        assert_eq!(arrival(0, 0, 10), Ok(Arrival::Next));
        assert_eq!(arrival(10, 0, 10), Ok(Arrival::Duplicate));
        assert_eq!(arrival(10, 5, 5), Ok(Arrival::Duplicate));
        assert_eq!(
            arrival(10, 11, 1),
            Err(Gap {
                offset: 11,
                received: 10
            })
        );
        // Straddling what was received: peers resend whole packets, so this is a gap too.
        assert_eq!(
            arrival(10, 5, 10),
            Err(Gap {
                offset: 5,
                received: 10
            })
        );
        // Empty DATA at the current position is in order; before it, a duplicate.
        assert_eq!(arrival(10, 10, 0), Ok(Arrival::Next));
        assert_eq!(arrival(10, 3, 0), Ok(Arrival::Duplicate));
    }
}
