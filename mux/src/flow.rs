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

use std::sync::Arc;

use tokio::sync::Semaphore;

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
/// waits: the HTTP/2 stream is the only flow control then.
#[derive(Clone, Debug)]
pub struct SendWindow(Option<Arc<Semaphore>>);

impl SendWindow {
    pub fn new(negotiated: bool) -> SendWindow {
        SendWindow(negotiated.then(|| Arc::new(Semaphore::new(WINDOW as usize))))
    }

    /// Waits for credit for a packet of `len` bytes and takes it.
    pub async fn reserve(&self, len: usize) -> Result<(), WindowClosed> {
        let Some(window) = &self.0 else {
            return Ok(());
        };
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

    /// The peer returned `bytes` of credit. A peer that returns more than it
    /// was given only lets us send more to it: the excess is capped so the
    /// window never exceeds twice its size.
    pub fn grant(&self, bytes: u32) {
        if let Some(window) = &self.0 {
            let room = (2 * WINDOW as usize).saturating_sub(window.available_permits());
            window.add_permits((bytes as usize).min(room));
        }
    }

    /// The connection ended: wake a sender waiting for credit.
    pub fn close(&self) {
        if let Some(window) = &self.0 {
            window.close();
        }
    }
}

/// The two halves of one connection's receiving window: the gate the
/// stream's router admits DATA through, and the credit its consumer returns.
pub fn receive_window(negotiated: bool) -> (ReceiveGate, ReceiveCredit) {
    let budget = Arc::new(Semaphore::new(WINDOW as usize));
    (
        ReceiveGate {
            budget: budget.clone(),
            negotiated,
        },
        ReceiveCredit {
            budget,
            negotiated,
            unreported: 0,
        },
    )
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
}

/// Admits DATA into a connection's buffer.
#[derive(Debug)]
pub struct ReceiveGate {
    budget: Arc<Semaphore>,
    negotiated: bool,
}

impl ReceiveGate {
    /// Takes room for a packet of `len` bytes. With the extension this never
    /// waits (a peer within its window always fits); without it, it waits
    /// for the consumer, as upstream's bounded channels do.
    pub async fn admit(&self, len: usize) -> Result<(), Refused> {
        let cost = cost(len).min(WINDOW);
        if self.negotiated {
            match self.budget.try_acquire_many(cost) {
                Ok(permit) => permit.forget(),
                Err(tokio::sync::TryAcquireError::Closed) => return Err(Refused::Closed),
                Err(tokio::sync::TryAcquireError::NoPermits) => return Err(Refused::Overrun),
            }
        } else {
            self.budget
                .acquire_many(cost)
                .await
                .map_err(|_| Refused::Closed)?
                .forget();
        }
        Ok(())
    }
}

/// Held by the consumer (the task writing a connection's bytes to its
/// socket); dropping it tells the gate the consumer is gone.
#[derive(Debug)]
pub struct ReceiveCredit {
    budget: Arc<Semaphore>,
    negotiated: bool,
    unreported: u32,
}

impl ReceiveCredit {
    /// `len` bytes left our buffers. Returns the credit to send the peer in
    /// a WINDOW_UPDATE, when enough has gathered.
    pub fn consumed(&mut self, len: usize) -> Option<u32> {
        let cost = cost(len).min(WINDOW);
        self.budget.add_permits(cost as usize);
        if !self.negotiated {
            return None;
        }
        self.unreported += cost;
        (self.unreported >= UPDATE_AFTER).then(|| std::mem::take(&mut self.unreported))
    }
}

impl Drop for ReceiveCredit {
    fn drop(&mut self) {
        self.budget.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_sender_within_its_window_is_always_admitted() {
        let (gate, mut credit) = receive_window(true);
        let send = SendWindow::new(true);
        let mut updates = 0;
        // 64 MiB through a much smaller window: credit must flow back in batches.
        for _ in 0..1024 {
            send.reserve(65536).await.unwrap();
            gate.admit(65536).await.unwrap();
            if let Some(bytes) = credit.consumed(65536) {
                assert!(bytes >= UPDATE_AFTER);
                send.grant(bytes);
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
        let send = SendWindow::new(true);
        let per_packet = cost(65536) as usize;
        let fit = WINDOW as usize / per_packet;
        for _ in 0..fit {
            send.reserve(65536).await.unwrap();
        }
        let blocked = tokio::time::timeout(std::time::Duration::from_millis(50), send.reserve(65536));
        assert!(blocked.await.is_err(), "the sender must wait for credit");

        let (gate, _credit) = receive_window(true);
        for _ in 0..fit {
            gate.admit(65536).await.unwrap();
        }
        assert_eq!(gate.admit(65536).await, Err(Refused::Overrun));
    }

    #[tokio::test]
    async fn closing_wakes_a_waiting_sender_and_a_gone_consumer_refuses() {
        let send = SendWindow::new(true);
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

        let (gate, credit) = receive_window(false);
        drop(credit);
        assert_eq!(gate.admit(1).await, Err(Refused::Closed));
    }

    #[tokio::test]
    async fn without_the_extension_senders_never_wait_and_no_updates_are_sent() {
        let send = SendWindow::new(false);
        for _ in 0..100 {
            send.reserve(65536).await.unwrap();
        }
        let (gate, mut credit) = receive_window(false);
        gate.admit(65536).await.unwrap();
        assert_eq!(credit.consumed(65536), None);
    }
}
