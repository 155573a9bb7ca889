//! Per-connection flow control on an agent stream: a konnectivity-rs
//! extension to the protocol, used only when both ends announce it.
//!
//! Every connection between a server and an agent shares one gRPC stream.
//! Upstream's protocol has no per-connection flow control, so when one
//! connection's reader stops reading, its buffers fill, the side that routes
//! the stream's packets has to wait for it, and every other connection on
//! the stream stalls with it (dials included).
//!
//! With the extension, each side may have at most [`WINDOW`] units of DATA
//! outstanding per connection and direction; a packet costs its payload plus
//! [`PACKET_COST`] (so tiny packets cannot pile up unbounded). The receiver
//! hands credit back with WINDOW_UPDATE once the bytes have left its buffers
//! (written to the socket), so routing never waits for any one connection.
//!
//! Negotiation: the agent sends the [`HEADER`] metadata with [`VERSION`];
//! a server that knows the extension answers with the same response header.
//! With an upstream peer neither happens, and the receiving side instead
//! waits for the slow connection, exactly as upstream does.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use konnectivity_proto::{ConnectId, Frame};
use tokio::sync::Semaphore;

use crate::extensions::Extensions;
use crate::replay::{OffsetError, Replay};

/// Metadata key announcing the extension (agent request and server
/// response headers).
pub const HEADER: &str = "konnectivity-rs-flow-control";
/// The only version so far.
pub const VERSION: &str = "1";
/// Credit per connection and direction: eight 256 KiB packets in flight, so
/// one connection runs at full speed on a low-latency link (1 MiB cost a
/// tenth of bulk throughput in `hack/bench.sh`); it bounds what a stalled
/// connection holds in memory on the receiving side.
pub const WINDOW: u32 = 2 << 20;
/// What each packet costs beyond its payload.
pub const PACKET_COST: u32 = 64;
/// Credit is returned in batches of at least this much, so WINDOW_UPDATE
/// packets stay a small fraction of the traffic.
const UPDATE_AFTER: u32 = WINDOW / 4;

/// The window cost of a DATA packet carrying `len` bytes.
pub fn cost(len: usize) -> u32 {
    u32::try_from(len).unwrap_or(u32::MAX).saturating_add(PACKET_COST)
}

/// The connection is gone; no more credit will come.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("connection closed while waiting for flow-control credit")]
pub struct WindowClosed;

/// Credit to send DATA on one connection. Without the extension it never
/// waits: the HTTP/2 stream is the only flow control then. With resume it
/// also keeps what was sent until the peer has written it out
/// ([`Replay`]), and credit comes back only with those acknowledgements.
#[derive(Clone, Debug)]
pub struct SendWindow(Option<Arc<SendState>>);

#[derive(Debug)]
struct SendState {
    credit: Semaphore,
    /// With resume only; never held across an await.
    replay: Option<Mutex<Replay>>,
}

impl SendWindow {
    pub fn new(extensions: Extensions) -> SendWindow {
        SendWindow(extensions.flow_control().then(|| {
            Arc::new(SendState {
                credit: Semaphore::new(WINDOW as usize),
                replay: extensions.resume().then(Mutex::default),
            })
        }))
    }

    /// Waits for credit for a packet of `len` bytes and takes it.
    pub async fn reserve(&self, len: usize) -> Result<(), WindowClosed> {
        let Some(state) = &self.0 else {
            return Ok(());
        };
        let window = &state.credit;
        // A packet larger than the whole window could never be sent; ours are
        // at most DATA_CHUNK, far below it.
        let cost = cost(len).min(WINDOW);
        let permits = match window.try_acquire_many(cost) {
            Ok(permits) => permits,
            Err(tokio::sync::TryAcquireError::Closed) => return Err(WindowClosed),
            // The wait for credit is boxed: inline, its state would make the
            // task of every connection larger, idle ones included.
            Err(tokio::sync::TryAcquireError::NoPermits) => Box::pin(window.acquire_many(cost))
                .await
                .map_err(|_| WindowClosed)?,
        };
        permits.forget();
        Ok(())
    }

    /// The DATA packet that carries `data`, once its credit is reserved:
    /// with resume it is numbered and kept until the peer writes it out.
    pub fn data(&self, connect_id: ConnectId, data: Bytes) -> Frame {
        let offset = self.replay().map(|replay| lock(replay).record(&data));
        Frame::Data {
            connect_id,
            data,
            offset,
        }
    }

    /// The peer returned credit (WINDOW_UPDATE). Without resume, `bytes` of
    /// it; a peer that returns more than it was given only lets us send more
    /// to it, so the excess is capped and the window never exceeds twice
    /// its size. With resume, the credit of the packets `written` releases;
    /// an update without `written` returns nothing (a resuming peer always
    /// says it), so what is kept stays bounded by the window.
    pub fn grant(&self, bytes: u32, written: Option<u64>) -> Result<(), OffsetError> {
        let Some(state) = &self.0 else {
            return Ok(());
        };
        let credit = match (&state.replay, written) {
            (None, _) => bytes,
            (Some(replay), Some(written)) => {
                lock(replay).acknowledge(written, |len| cost(len).min(WINDOW))?
            }
            (Some(_), None) => 0,
        };
        let room = (2 * WINDOW as usize).saturating_sub(state.credit.available_permits());
        state.credit.add_permits((credit as usize).min(room));
        Ok(())
    }

    /// With resume: the DATA to send again to a peer that has received
    /// `received` bytes, in order.
    pub fn resend_since(&self, connect_id: ConnectId, received: u64) -> Result<Vec<Frame>, OffsetError> {
        let Some(replay) = self.replay() else {
            return Ok(Vec::new());
        };
        Ok(lock(replay)
            .since(received)?
            .into_iter()
            .map(|(offset, data)| Frame::Data {
                connect_id,
                data,
                offset: Some(offset),
            })
            .collect())
    }

    /// With resume: where the sending side stands, to hand to another
    /// process: the bytes the peer has written out, and the packets sent
    /// after them (shared buffers, not copies).
    pub fn position(&self) -> Option<(u64, Vec<Bytes>)> {
        self.replay().map(|replay| {
            let replay = lock(replay);
            (replay.acknowledged(), replay.unacknowledged_packets())
        })
    }

    /// A resumable window continuing a [`SendWindow::position`] another
    /// process handed over, with the credit those packets left (their cost
    /// comes back as the peer acknowledges them, as it would have there).
    pub fn restored(acknowledged: u64, packets: Vec<Bytes>) -> SendWindow {
        let outstanding: usize = packets
            .iter()
            .map(|data| cost(data.len()).min(WINDOW) as usize)
            .sum();
        SendWindow(Some(Arc::new(SendState {
            credit: Semaphore::new((WINDOW as usize).saturating_sub(outstanding)),
            replay: Some(Mutex::new(Replay::restore(acknowledged, packets))),
        })))
    }

    /// With resume: bytes sent and not yet written out by the peer.
    pub fn unacknowledged(&self) -> u64 {
        self.replay()
            .map_or(0, |replay| lock(replay).unacknowledged_bytes())
    }

    /// Whether it keeps what it sent (the stream negotiated resume).
    pub fn resumable(&self) -> bool {
        self.replay().is_some()
    }

    fn replay(&self) -> Option<&Mutex<Replay>> {
        self.0.as_ref().and_then(|state| state.replay.as_ref())
    }

    /// The connection ended: wake a sender waiting for credit.
    pub fn close(&self) {
        if let Some(state) = &self.0 {
            state.credit.close();
        }
    }
}

/// The replay's lock. Nothing panics while holding it; a poisoned one is
/// still consistent (each method finishes its change before it can fail).
fn lock(replay: &Mutex<Replay>) -> std::sync::MutexGuard<'_, Replay> {
    replay.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The two halves of one connection's receiving window: the gate the
/// stream's router admits DATA through, and the credit its consumer returns.
pub fn receive_window(extensions: Extensions) -> (ReceiveGate, ReceiveCredit) {
    let shared = Arc::new(ReceiveShared {
        budget: Semaphore::new(WINDOW as usize),
        written: AtomicU64::new(0),
    });
    (
        ReceiveGate {
            shared: shared.clone(),
            negotiated: extensions.flow_control(),
        },
        ReceiveCredit {
            shared,
            extensions,
            unreported: 0,
        },
    )
}

/// A resumable receiving window that continues one another process kept,
/// which had written out `written` bytes (a hand-over): the peer is told
/// that count when the connection resumes, and sends again what follows.
pub fn receive_window_from(written: u64) -> (ReceiveGate, ReceiveCredit) {
    let (gate, credit) = receive_window(Extensions::Resume);
    gate.shared.written.store(written, Ordering::Release);
    (gate, credit)
}

/// What the gate and the consumer share.
#[derive(Debug)]
struct ReceiveShared {
    budget: Semaphore,
    /// Bytes the consumer has written out, for a resume to report.
    written: AtomicU64,
}

/// Why DATA was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// The peer sent more than its window: a protocol violation.
    #[error("peer exceeded the flow-control window of {WINDOW} bytes")]
    Overrun,
    /// The consumer is gone.
    #[error("connection closed")]
    Closed,
    /// With resume: DATA that does not continue what was received.
    #[error("{0}")]
    Gap(#[from] crate::replay::Gap),
    /// With resume: DATA without its offset.
    #[error("DATA without an offset on a stream that negotiated resume")]
    Unnumbered,
}

/// Admits DATA into a connection's buffer.
#[derive(Debug)]
pub struct ReceiveGate {
    shared: Arc<ReceiveShared>,
    negotiated: bool,
}

impl ReceiveGate {
    /// Takes room for a packet of `len` bytes. With the extension this never
    /// waits (a peer within its window always fits); without it, it waits
    /// for the consumer, as upstream's bounded channels do.
    pub async fn admit(&self, len: usize) -> Result<(), Refused> {
        let cost = cost(len).min(WINDOW);
        let budget = &self.shared.budget;
        if self.negotiated {
            match budget.try_acquire_many(cost) {
                Ok(permit) => permit.forget(),
                Err(tokio::sync::TryAcquireError::Closed) => return Err(Refused::Closed),
                Err(tokio::sync::TryAcquireError::NoPermits) => return Err(Refused::Overrun),
            }
        } else {
            budget
                .acquire_many(cost)
                .await
                .map_err(|_| Refused::Closed)?
                .forget();
        }
        Ok(())
    }

    /// As [`ReceiveGate::admit`] on a window the peer negotiated, which never
    /// waits: a peer within its window always fits.
    pub fn admit_negotiated(&self, len: usize) -> Result<(), Refused> {
        match self.shared.budget.try_acquire_many(cost(len).min(WINDOW)) {
            Ok(permit) => {
                permit.forget();
                Ok(())
            }
            Err(tokio::sync::TryAcquireError::Closed) => Err(Refused::Closed),
            Err(tokio::sync::TryAcquireError::NoPermits) => Err(Refused::Overrun),
        }
    }

    /// Bytes the consumer has written out so far (kept with resume only).
    pub fn written(&self) -> u64 {
        self.shared.written.load(Ordering::Acquire)
    }
}

/// Credit to return to the peer: a WINDOW_UPDATE's contents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Credit {
    pub bytes: u32,
    /// With resume: the bytes written out in all.
    pub written: Option<u64>,
}

impl Credit {
    pub fn frame(self, connect_id: ConnectId) -> Frame {
        Frame::WindowUpdate {
            connect_id,
            bytes: self.bytes,
            written: self.written,
        }
    }
}

/// Held by the consumer (the task writing a connection's bytes to its
/// socket); dropping it tells the gate the consumer is gone.
#[derive(Debug)]
pub struct ReceiveCredit {
    shared: Arc<ReceiveShared>,
    extensions: Extensions,
    unreported: u32,
}

impl ReceiveCredit {
    /// `len` bytes left our buffers. Returns the credit to send the peer in
    /// a WINDOW_UPDATE, when enough has gathered.
    pub fn consumed(&mut self, len: usize) -> Option<Credit> {
        let cost = cost(len).min(WINDOW);
        self.shared.budget.add_permits(cost as usize);
        if !self.extensions.flow_control() {
            return None;
        }
        let written = self.extensions.resume().then(|| {
            // Only this consumer adds to it.
            let written = self.shared.written.load(Ordering::Relaxed) + len as u64;
            self.shared.written.store(written, Ordering::Release);
            written
        });
        self.unreported += cost;
        (self.unreported >= UPDATE_AFTER).then(|| Credit {
            bytes: std::mem::take(&mut self.unreported),
            written,
        })
    }
}

/// With resume, how long a connection may stay quiet before its receiver
/// acknowledges everything it wrote.
///
/// The peer keeps what it sent until we acknowledge it (docs/resume.md).
/// Acknowledged only every [`UPDATE_AFTER`], a connection that went quiet
/// would keep up to that much of the peer's memory for as long as it stays
/// quiet; thousands of idle watches would keep gigabytes. Acknowledging
/// after every burst instead puts a WINDOW_UPDATE on the path of every
/// round trip (measured: a third slower); after a quiet second it costs a
/// request/response connection nothing and an idle one keeps nothing.
pub const QUIET_ACK_AFTER: Duration = Duration::from_secs(1);

/// What waiting for the next message brought.
#[derive(Debug)]
pub enum Waited<T> {
    Arrived(T),
    /// The connection was quiet for [`QUIET_ACK_AFTER`]: send this credit.
    Quiet(Credit),
}

impl ReceiveCredit {
    /// Waits for `next`, the consumer's next message. With resume and bytes
    /// written but not yet acknowledged, waits at most [`QUIET_ACK_AFTER`]
    /// and then hands back their credit (the caller sends it and waits
    /// again).
    pub async fn or_quiet<F: Future>(&mut self, next: F) -> Waited<F::Output> {
        if !self.owes_acknowledgement() {
            return Waited::Arrived(next.await);
        }
        // Boxed: only a connection that owes an acknowledgement holds it.
        let quiet = Box::pin(tokio::time::sleep(QUIET_ACK_AFTER));
        tokio::select! {
            biased;
            arrived = next => Waited::Arrived(arrived),
            () = quiet => Waited::Quiet(self.acknowledge_all()),
        }
    }

    /// With resume: whether bytes were written and not yet acknowledged.
    pub(crate) fn owes_acknowledgement(&self) -> bool {
        self.extensions.resume() && self.unreported > 0
    }

    /// The credit for everything written so far.
    pub(crate) fn acknowledge_all(&mut self) -> Credit {
        Credit {
            bytes: std::mem::take(&mut self.unreported),
            written: Some(self.shared.written.load(Ordering::Acquire)),
        }
    }
}

impl Drop for ReceiveCredit {
    fn drop(&mut self) {
        self.shared.budget.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_sender_within_its_window_is_always_admitted() {
        let (gate, mut credit) = receive_window(Extensions::FlowControl);
        let send = SendWindow::new(Extensions::FlowControl);
        let mut updates = 0;
        // 64 MiB through a much smaller window: credit must flow back in batches.
        for _ in 0..1024 {
            send.reserve(65536).await.unwrap();
            gate.admit(65536).await.unwrap();
            if let Some(returned) = credit.consumed(65536) {
                assert!(returned.bytes >= UPDATE_AFTER);
                assert_eq!(returned.written, None);
                send.grant(returned.bytes, None).unwrap();
                updates += 1;
            }
        }
        // One update per UPDATE_AFTER of consumed cost, never one per packet.
        let per_update = UPDATE_AFTER.div_ceil(cost(65536));
        assert_eq!(updates, 1024 / per_update);
        assert!(per_update > 1);
    }

    #[tokio::test]
    async fn a_sender_past_its_window_waits_and_an_overrun_is_refused() {
        let send = SendWindow::new(Extensions::FlowControl);
        let per_packet = cost(65536) as usize;
        let fit = WINDOW as usize / per_packet;
        for _ in 0..fit {
            send.reserve(65536).await.unwrap();
        }
        let blocked = tokio::time::timeout(std::time::Duration::from_millis(50), send.reserve(65536));
        assert!(blocked.await.is_err(), "the sender must wait for credit");

        let (gate, _credit) = receive_window(Extensions::FlowControl);
        for _ in 0..fit {
            gate.admit(65536).await.unwrap();
        }
        assert_eq!(gate.admit(65536).await, Err(Refused::Overrun));
    }

    #[tokio::test]
    async fn closing_wakes_a_waiting_sender_and_a_gone_consumer_refuses() {
        let send = SendWindow::new(Extensions::FlowControl);
        send.reserve(WINDOW as usize - PACKET_COST as usize)
            .await
            .unwrap();
        let waiting = {
            let send = send.clone();
            tokio::spawn(async move { send.reserve(1).await })
        };
        tokio::task::yield_now().await;
        send.close();
        assert_eq!(waiting.await.unwrap(), Err(WindowClosed));

        let (gate, credit) = receive_window(Extensions::Upstream);
        drop(credit);
        assert_eq!(gate.admit(1).await, Err(Refused::Closed));
    }

    #[tokio::test]
    async fn without_the_extension_senders_never_wait_and_no_updates_are_sent() {
        let send = SendWindow::new(Extensions::Upstream);
        for _ in 0..100 {
            send.reserve(65536).await.unwrap();
        }
        let (gate, mut credit) = receive_window(Extensions::Upstream);
        gate.admit(65536).await.unwrap();
        assert_eq!(credit.consumed(65536), None);
    }

    /// With resume, credit comes back only with the position the peer has
    /// written out, for exactly the packets it covers; a repeated update
    /// returns nothing more, and an update without a position nothing.
    #[tokio::test]
    async fn with_resume_credit_follows_what_the_peer_wrote_out() {
        let id = ConnectId::new(1).unwrap();
        let send = SendWindow::new(Extensions::Resume);
        let (gate, mut credit) = receive_window(Extensions::Resume);
        let per_packet = cost(65536) as usize;
        let fit = WINDOW as usize / per_packet;
        let mut offsets = Vec::new();
        for _ in 0..fit {
            send.reserve(65536).await.unwrap();
            match send.data(id, Bytes::from(vec![1; 65536])) {
                Frame::Data { offset, .. } => offsets.push(offset.unwrap()),
                other => panic!("expected DATA, got {other:?}"),
            }
        }
        assert_eq!(offsets[..3], [0, 65536, 131072]);
        assert_eq!(send.unacknowledged(), fit as u64 * 65536);
        let blocked = tokio::time::timeout(std::time::Duration::from_millis(20), send.reserve(65536));
        assert!(blocked.await.is_err(), "the window is full");

        // The receiver writes them out; its updates carry the position.
        let mut last = None;
        for _ in 0..fit {
            gate.admit(65536).await.unwrap();
            if let Some(update) = credit.consumed(65536) {
                last = Some(update);
                send.grant(update.bytes, None).unwrap();
            }
        }
        let update = last.expect("at least one update");
        assert!(
            tokio::time::timeout(std::time::Duration::from_millis(20), send.reserve(65536))
                .await
                .is_err(),
            "no credit without a position"
        );
        let written = update.written.unwrap();
        assert_eq!(gate.written(), fit as u64 * 65536);
        send.grant(0, Some(written)).unwrap();
        send.grant(0, Some(written)).unwrap();
        assert_eq!(send.unacknowledged(), fit as u64 * 65536 - written);
        send.reserve(65536).await.unwrap();
        // What is resent starts where the peer says it stopped receiving.
        let again = send.resend_since(id, written).unwrap();
        assert_eq!(again.len() as u64, (fit as u64 * 65536 - written) / 65536);
        assert!(
            send.grant(0, Some(u64::MAX)).is_err(),
            "a position past what was sent"
        );
    }
}
