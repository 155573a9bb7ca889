//! One connection's two ends, and the table of them a stream's session keeps.
//!
//! A connection on an agent stream has a *route* (kept in the session's
//! table: where DATA from the stream goes, through the receive window) and a
//! *port* (held by the consumer: the task that writes the bytes out to a
//! socket or a client, returning credit as it does). The producer, the task
//! that reads the connection's own socket, sends through the send window.

use std::collections::HashMap;

use bytes::Bytes;
use futures_util::FutureExt;
use konnectivity_proto::ConnectId;

use crate::flow::{self, ReceiveCredit, ReceiveGate, Refused, SendWindow};
use crate::mailbox::{self, mailbox};

/// Creates one connection's route, port and send window (for its producer).
/// `flow_control`: both ends of the stream negotiated the extension
/// ([`flow`]). `M` is what the consumer receives: DATA converts into it, and
/// the session may send other messages (a dial's answer, why the connection
/// closed) with [`Route::send`].
pub fn connection<M>(flow_control: bool) -> (Route<M>, Port<M>, SendWindow) {
    let (to_consumer, from_stream) = mailbox();
    let (gate, credit) = flow::receive_window(flow_control);
    let window = SendWindow::new(flow_control);
    let route = Route {
        to_consumer,
        gate,
        window: window.clone(),
    };
    (route, Port { from_stream, credit }, window)
}

/// The session's end of a connection. Dropping it ends the connection for
/// the consumer (its channel closes) and for the producer (a wait for send
/// credit ends with [`flow::WindowClosed`]).
#[derive(Debug)]
pub struct Route<M> {
    /// Unbounded: DATA in it is bounded by `gate`; other messages are one
    /// or two per connection.
    to_consumer: mailbox::Sender<M>,
    gate: ReceiveGate,
    window: SendWindow,
}

impl<M> Route<M> {
    /// Sends the consumer a message outside the window (not DATA); whether
    /// the consumer is still there.
    pub fn send(&self, message: M) -> bool {
        self.to_consumer.send(message).is_ok()
    }
}

impl<M> Drop for Route<M> {
    fn drop(&mut self) {
        // A producer waiting for credit must learn the connection is gone.
        self.window.close();
    }
}

/// The consumer's end of a connection.
#[derive(Debug)]
pub struct Port<M> {
    from_stream: mailbox::Receiver<M>,
    credit: ReceiveCredit,
}

impl<M> Port<M> {
    /// The next message, or `None` once the route is gone.
    pub async fn recv(&mut self) -> Option<M> {
        self.from_stream.recv().await
    }

    /// `len` bytes of DATA from this port have left our buffers (written to
    /// the socket, or to the client). Returns the credit to send the peer in
    /// a WINDOW_UPDATE, once enough has gathered.
    pub fn written(&mut self, len: usize) -> Option<u32> {
        self.credit.consumed(len)
    }
}

/// What became of DATA the stream carried for a connection.
#[derive(Debug)]
pub enum Delivery<M, S> {
    /// It is in the consumer's buffer.
    Delivered,
    /// No connection has that id: it ended, or never was.
    Unknown,
    /// The consumer is gone; the connection is still in the table, for the
    /// caller to end as its side does.
    ConsumerGone,
    /// The peer sent more than its window allowed, a protocol violation:
    /// the connection is out of the table, handed back to be ended.
    Overrun { entry: Entry<M, S>, error: Refused },
}

/// A connection in the table: its route and what the session keeps with it.
#[derive(Debug)]
pub struct Entry<M, S> {
    pub route: Route<M>,
    pub state: S,
}

/// The connections of one stream, by id. `S` is what each end's session
/// keeps per connection (metrics guards, the tasks to stop, the tunnel's
/// record); it is dropped with the connection.
#[derive(Debug)]
pub struct Connections<M, S> {
    entries: HashMap<ConnectId, Entry<M, S>>,
}

impl<M, S> Default for Connections<M, S> {
    fn default() -> Self {
        Connections {
            entries: HashMap::new(),
        }
    }
}

impl<M: From<Bytes>, S> Connections<M, S> {
    /// Adds a connection; one already under `id` is displaced and returned
    /// (a peer that reuses an id ends the old connection).
    pub fn insert(&mut self, id: ConnectId, route: Route<M>, state: S) -> Option<Entry<M, S>> {
        self.entries.insert(id, Entry { route, state })
    }

    pub fn remove(&mut self, id: ConnectId) -> Option<Entry<M, S>> {
        self.entries.remove(&id)
    }

    pub fn contains(&self, id: ConnectId) -> bool {
        self.entries.contains_key(&id)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Ends every connection: the stream is gone.
    pub fn clear(&mut self) {
        self.entries.clear();
    }

    /// The peer returned `bytes` of send credit (WINDOW_UPDATE). Unknown ids
    /// are connections that just ended: nothing to do.
    pub fn grant(&self, id: ConnectId, bytes: u32) {
        if let Some(entry) = self.entries.get(&id) {
            entry.route.window.grant(bytes);
        }
    }

    /// Routes DATA from the stream to its connection's consumer. With flow
    /// control this never waits (a peer within its window always fits);
    /// with an upstream peer it waits while the consumer's buffer is full,
    /// as upstream does, holding `while_blocked()`'s guard meanwhile (a
    /// gauge, say), so a stalled stream can be seen.
    pub async fn deliver<G>(
        &mut self,
        id: ConnectId,
        data: Bytes,
        while_blocked: impl FnOnce() -> G,
    ) -> Delivery<M, S> {
        let Some(entry) = self.entries.get(&id) else {
            return Delivery::Unknown;
        };
        let gate = &entry.route.gate;
        let admitted = match gate.admit(data.len()).now_or_never() {
            Some(admitted) => admitted,
            None => {
                let _blocked = while_blocked();
                gate.admit(data.len()).await
            }
        };
        match admitted {
            Ok(()) if entry.route.to_consumer.send(M::from(data)).is_ok() => Delivery::Delivered,
            Ok(()) | Err(Refused::Closed) => Delivery::ConsumerGone,
            Err(error @ Refused::Overrun) => match self.entries.remove(&id) {
                Some(entry) => Delivery::Overrun { entry, error },
                None => Delivery::Unknown,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flow::{WINDOW, WindowClosed, cost};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn id(n: i64) -> ConnectId {
        ConnectId::new(n).unwrap()
    }

    #[tokio::test]
    async fn data_reaches_the_consumer_and_credit_returns_in_batches() {
        let mut table: Connections<Bytes, ()> = Connections::default();
        let (route, mut port, _) = connection(true);
        table.insert(id(1), route, ());
        let mut returned = 0u64;
        for _ in 0..64 {
            let delivery = table.deliver(id(1), Bytes::from(vec![7; 65536]), || ()).await;
            assert!(matches!(delivery, Delivery::Delivered));
            let data = port.recv().await.unwrap();
            assert_eq!(data.len(), 65536);
            returned += u64::from(port.written(data.len()).unwrap_or(0));
        }
        assert!(returned > 0, "credit must come back");
        assert!(returned <= 64 * u64::from(cost(65536)));
    }

    #[tokio::test]
    async fn unknown_ids_and_gone_consumers_are_told_apart() {
        let mut table: Connections<Bytes, ()> = Connections::default();
        assert!(matches!(
            table.deliver(id(9), Bytes::from_static(b"x"), || ()).await,
            Delivery::Unknown
        ));
        let (route, port, _) = connection(true);
        table.insert(id(1), route, ());
        drop(port);
        assert!(matches!(
            table.deliver(id(1), Bytes::from_static(b"x"), || ()).await,
            Delivery::ConsumerGone
        ));
        assert!(table.contains(id(1)), "the caller decides how it ends");
    }

    #[tokio::test]
    async fn an_overrun_takes_the_connection_out_of_the_table() {
        let mut table: Connections<Bytes, &str> = Connections::default();
        let (route, _port, _) = connection(true);
        table.insert(id(1), route, "state");
        let fits = WINDOW as usize / cost(65536) as usize;
        for _ in 0..fits {
            let delivery = table.deliver(id(1), Bytes::from(vec![0; 65536]), || ()).await;
            assert!(matches!(delivery, Delivery::Delivered));
        }
        match table.deliver(id(1), Bytes::from(vec![0; 65536]), || ()).await {
            Delivery::Overrun { entry, error } => {
                assert_eq!(entry.state, "state");
                assert_eq!(error, Refused::Overrun);
            }
            other => panic!("expected an overrun, got {other:?}"),
        }
        assert!(table.is_empty());
    }

    /// Without flow control (an upstream peer) a full consumer holds up the
    /// stream, and the hook's guard is held exactly while it does.
    #[tokio::test]
    async fn an_upstream_peer_waits_for_a_full_consumer_under_the_hook() {
        let mut table: Connections<Bytes, ()> = Connections::default();
        let (route, mut port, _) = connection(false);
        table.insert(id(1), route, ());
        let blocked = Arc::new(AtomicUsize::new(0));
        struct Held(Arc<AtomicUsize>);
        impl Drop for Held {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::SeqCst);
            }
        }
        let hook = || {
            blocked.fetch_add(1, Ordering::SeqCst);
            Held(blocked.clone())
        };
        let chunk = Bytes::from(vec![0; 1 << 20]);
        table.deliver(id(1), chunk.clone(), hook).await;
        assert_eq!(blocked.load(Ordering::SeqCst), 0, "room for the first MiB");
        let consumer = tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            while let Some(data) = port.recv().await {
                let _ = port.written(data.len());
            }
        });
        let watched = blocked.clone();
        let mut saw_blocked = false;
        let deliveries = async {
            for _ in 0..4 {
                table.deliver(id(1), chunk.clone(), hook).await;
            }
        };
        let watch = async {
            loop {
                if watched.load(Ordering::SeqCst) == 1 {
                    saw_blocked = true;
                }
                tokio::task::yield_now().await;
            }
        };
        tokio::select! {
            () = deliveries => {}
            () = watch => unreachable!(),
        }
        assert!(saw_blocked, "a full consumer must hold the stream under the hook");
        assert_eq!(blocked.load(Ordering::SeqCst), 0, "the guard is released");
        table.clear();
        consumer.await.unwrap();
    }

    #[tokio::test]
    async fn ending_a_connection_wakes_its_producer() {
        let mut table: Connections<Bytes, ()> = Connections::default();
        let (route, _port, window) = connection(true);
        table.insert(id(1), route, ());
        window.reserve(WINDOW as usize - 64).await.unwrap();
        let waiting = tokio::spawn(async move { window.reserve(1).await });
        tokio::task::yield_now().await;
        table.remove(id(1));
        assert_eq!(waiting.await.unwrap(), Err(WindowClosed));
    }

    #[tokio::test]
    async fn grants_reach_the_send_window_of_that_connection_only() {
        let mut table: Connections<Bytes, ()> = Connections::default();
        let (route, _port, window) = connection(true);
        table.insert(id(1), route, ());
        window.reserve(WINDOW as usize - 64).await.unwrap();
        table.grant(id(2), WINDOW);
        let still_blocked = tokio::time::timeout(std::time::Duration::from_millis(20), window.reserve(1));
        assert!(still_blocked.await.is_err());
        table.grant(id(1), 1024);
        window.reserve(1).await.unwrap();
    }
}
