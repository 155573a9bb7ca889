//! One connection's two ends, and the table of them a stream's session keeps.
//!
//! A connection on an agent stream has a *route* (kept in the session's
//! table: where DATA from the stream goes, through the receive window) and a
//! *port* (held by the consumer: the task that writes the bytes out to a
//! socket or a client, returning credit as it does). The producer, the task
//! that reads the connection's own socket, sends through the send window.
//!
//! With resume (docs/resume.md) the table also keeps the connections this
//! side closed until the peer confirms the close, and reconciles both sides'
//! connections when a stream resumes an earlier one ([`Connections::resume`]).

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures_util::FutureExt;
use konnectivity_proto::{ConnectId, Frame, ResumeEntry};
use tokio::time::Sleep;

use crate::extensions::Extensions;
use crate::flow::{self, Credit, ReceiveCredit, ReceiveGate, Refused, SendWindow, Waited};
use crate::mailbox::{self, mailbox};
use crate::replay::{Arrival, OffsetError, arrival};

/// Creates one connection's route, port and send window (for its producer).
/// `extensions`: what both ends of the stream negotiated ([`flow`],
/// [`crate::replay`]). `M` is what the consumer receives: DATA converts into
/// it, and the session may send other messages (a dial's answer, why the
/// connection closed) with [`Route::send`].
pub fn connection<M>(extensions: Extensions) -> (Route<M>, Port<M>, SendWindow) {
    let (to_consumer, from_stream) = mailbox();
    let (gate, credit) = flow::receive_window(extensions);
    let window = SendWindow::new(extensions);
    let route = Route {
        to_consumer,
        gate,
        window: window.clone(),
        received: extensions.resume().then_some(0),
    };
    (route, Port { from_stream, credit }, window)
}

/// One connection's route, port and send window continuing what another
/// process kept (a hand-over, docs/handover.md): it had written out
/// `written` bytes of the peer's, and holds `in_hand` more, received whole
/// and not yet written (the rest of a packet it was writing); `window`
/// continues its sending side ([`SendWindow::restored`]). On the resume the
/// peer hears both: it sends again from `written + in_hand`, and the
/// consumer returns `in_hand` as credit once it has written those bytes.
pub fn restored_connection<M>(
    written: u64,
    in_hand: usize,
    window: SendWindow,
) -> (Route<M>, Port<M>, SendWindow) {
    let (to_consumer, from_stream) = mailbox();
    let (gate, credit) = flow::receive_window_from(written);
    if in_hand > 0 {
        // Counted in the window as the predecessor counted it.
        let _ = gate.admit_negotiated(in_hand);
    }
    let route = Route {
        to_consumer,
        gate,
        window: window.clone(),
        received: Some(written + in_hand as u64),
    };
    (route, Port { from_stream, credit }, window)
}

/// What a connection's table entry holds to hand over: where its two
/// directions stand.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Position {
    /// The peer's bytes written out here (acknowledged or about to be).
    pub written: u64,
    /// The peer has written out this many of ours...
    pub acknowledged: u64,
    /// ...and these packets were sent after them, unacknowledged.
    pub unacknowledged: Vec<Bytes>,
}

/// A connection this side closed and the peer has not confirmed, to hand
/// over: why, and what it sent that may still be needed.
#[derive(Debug)]
pub struct ClosingPosition {
    pub id: ConnectId,
    pub error: Option<String>,
    /// With resume: the peer's acknowledged bytes and the packets after.
    pub sent: Option<(u64, Vec<Bytes>)>,
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
    /// With resume: DATA bytes received so far.
    received: Option<u64>,
}

impl<M> Route<M> {
    /// Sends the consumer a message outside the window (not DATA); whether
    /// the consumer is still there.
    pub fn send(&self, message: M) -> bool {
        self.to_consumer.send(message).is_ok()
    }

    /// Where the connection stands, to hand it over; `None` unless it can
    /// resume. Read once its consumer and producer have stopped.
    pub fn position(&self) -> Option<Position> {
        let (acknowledged, unacknowledged) = self.window.position()?;
        Some(Position {
            written: self.gate.written(),
            acknowledged,
            unacknowledged,
        })
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
    /// The next message, or `None` once the route is gone. It never
    /// acknowledges a quiet connection: a consumer of DATA uses
    /// [`Port::recv_or_quiet`].
    pub async fn recv(&mut self) -> Option<M> {
        self.from_stream.recv().await
    }

    /// Stops receiving: the route's later sends fail (its owner learns the
    /// consumer is gone), and what was delivered and not read is returned,
    /// in one step, so that no message falls between the two.
    pub fn close(mut self) -> impl Iterator<Item = M> {
        self.from_stream.close().into_iter()
    }

    /// [`Port::recv`], but with resume a connection quiet for
    /// [`flow::QUIET_ACK_AFTER`] gets the credit to acknowledge what it
    /// wrote instead ([`ReceiveCredit::or_quiet`]).
    pub fn recv_or_quiet(&mut self) -> RecvOrQuiet<'_, M> {
        RecvOrQuiet {
            port: self,
            quiet: None,
        }
    }

    /// `len` bytes of DATA from this port have left our buffers (written to
    /// the socket, or to the client). Returns the credit to send the peer in
    /// a WINDOW_UPDATE, once enough has gathered.
    pub fn written(&mut self, len: usize) -> Option<Credit> {
        self.credit.consumed(len)
    }
}

/// [`Port::recv_or_quiet`]'s future: a named one of two words, as it sits in
/// every idle tunnel's task (an `async fn` held the wait twice over).
#[derive(Debug)]
pub struct RecvOrQuiet<'a, M> {
    port: &'a mut Port<M>,
    /// Armed (boxed) only while the connection owes an acknowledgement.
    quiet: Option<Pin<Box<Sleep>>>,
}

impl<M> Future for RecvOrQuiet<'_, M> {
    type Output = Waited<Option<M>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        if let Poll::Ready(message) = this.port.from_stream.poll_recv(cx) {
            return Poll::Ready(Waited::Arrived(message));
        }
        if !this.port.credit.owes_acknowledgement() {
            return Poll::Pending;
        }
        let quiet = this
            .quiet
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(flow::QUIET_ACK_AFTER)));
        std::task::ready!(quiet.as_mut().poll(cx));
        Poll::Ready(Waited::Quiet(this.port.credit.acknowledge_all()))
    }
}

/// What became of DATA the stream carried for a connection.
#[derive(Debug)]
pub enum Delivery<M, S> {
    /// It is in the consumer's buffer.
    Delivered,
    /// With resume: bytes already received, sent again; dropped.
    Duplicate,
    /// No connection has that id: it ended, or never was.
    Unknown,
    /// The consumer is gone; the connection is still in the table, for the
    /// caller to end as its side does.
    ConsumerGone,
    /// The peer broke the protocol (more than its window, or with resume
    /// bytes out of order): the connection is out of the table, handed
    /// back to be ended.
    Violation { entry: Entry<M, S>, error: Refused },
}

/// A connection in the table: its route and what the session keeps with it.
#[derive(Debug)]
pub struct Entry<M, S> {
    pub route: Route<M>,
    pub state: S,
}

/// A connection this side closed, kept until the peer confirms the close:
/// with resume, what it sent and the peer may not have.
#[derive(Debug)]
struct Closing {
    window: Option<SendWindow>,
    /// Why, when the close carries an error (a CLOSE_RSP's), to say again.
    error: Option<String>,
}

/// The connections of one stream, by id. `S` is what each end's session
/// keeps per connection (metrics guards, the tasks to stop, the tunnel's
/// record); it is dropped with the connection.
#[derive(Debug)]
pub struct Connections<M, S> {
    entries: HashMap<ConnectId, Entry<M, S>>,
    closing: HashMap<ConnectId, Closing>,
}

impl<M, S> Default for Connections<M, S> {
    fn default() -> Self {
        Connections {
            entries: HashMap::new(),
            closing: HashMap::new(),
        }
    }
}

/// RESUME entries per packet: a few hundred KiB at most.
const RESUME_CHUNK: usize = 16 * 1024;

/// What a resume changes, for the session to carry out in this order: send
/// `resend` (DATA the peer lacks), send the close again for `close_again`
/// (closed here, still open there; with its error) and a close for
/// `unknown` (open there, gone here), and end `gone` and `refused` here.
#[derive(Debug)]
pub struct ResumePlan<M, S> {
    pub resend: Vec<Frame>,
    pub close_again: Vec<(ConnectId, Option<String>)>,
    pub unknown: Vec<ConnectId>,
    /// Open here, unknown to the peer (its dial answer was lost, say).
    pub gone: Vec<(ConnectId, Entry<M, S>)>,
    /// Positions no packet we sent explains: the connection cannot resume.
    pub refused: Vec<(ConnectId, Entry<M, S>, OffsetError)>,
}

impl<M, S> ResumePlan<M, S> {
    /// DATA bytes the plan sends again.
    pub fn resent_bytes(&self) -> usize {
        self.resend
            .iter()
            .map(|frame| match frame {
                Frame::Data { data, .. } => data.len(),
                _ => 0,
            })
            .sum()
    }
}

impl<M: From<Bytes>, S> Connections<M, S> {
    /// Adds a connection; one already under `id` is displaced and returned
    /// (a peer that reuses an id ends the old connection).
    pub fn insert(&mut self, id: ConnectId, route: Route<M>, state: S) -> Option<Entry<M, S>> {
        self.closing.remove(&id);
        self.entries.insert(id, Entry { route, state })
    }

    /// Takes a connection out of the table and forgets it.
    pub fn remove(&mut self, id: ConnectId) -> Option<Entry<M, S>> {
        self.entries.remove(&id)
    }

    /// Takes a connection out of the table because this side closes it:
    /// until the peer confirms ([`Connections::confirm`]), DATA still in
    /// flight for it is dropped quietly, and with resume what it sent is
    /// kept in case the close is lost with the stream. `error` is the
    /// close's error text, if it carries one.
    pub fn close(&mut self, id: ConnectId, error: Option<String>) -> Option<Entry<M, S>> {
        let entry = self.entries.remove(&id)?;
        let window = &entry.route.window;
        let resumable = window.resumable();
        let window = resumable.then(|| window.clone());
        let error = error.filter(|_| resumable);
        self.closing.insert(id, Closing { window, error });
        Some(entry)
    }

    /// Adds a connection this side closed in another process, unconfirmed
    /// when it was handed over ([`Connections::take_closing`]).
    pub fn insert_closing(&mut self, closing: ClosingPosition) {
        let window = closing
            .sent
            .map(|(acknowledged, packets)| SendWindow::restored(acknowledged, packets));
        let error = closing.error;
        self.closing.insert(closing.id, Closing { window, error });
    }

    /// Takes out every connection this side closed and the peer has not
    /// confirmed, to hand them over.
    pub fn take_closing(&mut self) -> Vec<ClosingPosition> {
        self.closing
            .drain()
            .map(|(id, closing)| ClosingPosition {
                id,
                sent: closing.window.and_then(|window| window.position()),
                error: closing.error,
            })
            .collect()
    }

    /// Takes out every open connection, to hand them over.
    pub fn take_open(&mut self) -> Vec<(ConnectId, Entry<M, S>)> {
        self.entries.drain().collect()
    }

    /// Marks `id` closed by this side even though it is not in the table
    /// (its dial answer came after the dial was given up, say).
    pub fn closing_without_entry(&mut self, id: ConnectId) {
        self.closing.insert(
            id,
            Closing {
                window: None,
                error: None,
            },
        );
    }

    /// The peer confirmed a close of ours; whether it was one.
    pub fn confirm(&mut self, id: ConnectId) -> bool {
        self.closing.remove(&id).is_some()
    }

    /// Whether this side closed `id` and awaits the peer's confirmation.
    pub fn is_closing(&self, id: ConnectId) -> bool {
        self.closing.contains_key(&id)
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

    /// Closed here and not yet confirmed.
    pub fn closing_len(&self) -> usize {
        self.closing.len()
    }

    /// Ends every connection: the stream is gone.
    pub fn clear(&mut self) {
        self.entries.clear();
        self.closing.clear();
    }

    /// The peer returned send credit (WINDOW_UPDATE). Unknown ids are
    /// connections that just ended: nothing to do. With resume, a position
    /// no packet explains ends the connection: it is handed back.
    pub fn grant(
        &mut self,
        id: ConnectId,
        bytes: u32,
        written: Option<u64>,
    ) -> Result<(), (Entry<M, S>, OffsetError)> {
        let Some(entry) = self.entries.get(&id) else {
            return Ok(());
        };
        match entry.route.window.grant(bytes, written) {
            Ok(()) => Ok(()),
            Err(error) => Err((self.entries.remove(&id).expect("looked up above"), error)),
        }
    }

    /// Routes DATA from the stream to its connection's consumer. With flow
    /// control this never waits (a peer within its window always fits);
    /// with an upstream peer it waits while the consumer's buffer is full,
    /// as upstream does, holding `while_blocked()`'s guard meanwhile (a
    /// gauge, say), so a stalled stream can be seen. With resume, `offset`
    /// places the bytes: those already received are dropped, a gap is a
    /// violation.
    pub async fn deliver<G>(
        &mut self,
        id: ConnectId,
        data: Bytes,
        offset: Option<u64>,
        while_blocked: impl FnOnce() -> G,
    ) -> Delivery<M, S> {
        let Some(entry) = self.entries.get_mut(&id) else {
            return Delivery::Unknown;
        };
        if let Some(received) = entry.route.received {
            let placed = match offset {
                None => Err(Refused::Unnumbered),
                Some(offset) => arrival(received, offset, data.len()).map_err(Refused::from),
            };
            match placed {
                Ok(Arrival::Next) => entry.route.received = Some(received + data.len() as u64),
                Ok(Arrival::Duplicate) => return Delivery::Duplicate,
                Err(error) => return self.violation(id, error),
            }
        }
        let entry = &self.entries[&id];
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
            Err(error) => self.violation(id, error),
        }
    }

    fn violation(&mut self, id: ConnectId, error: Refused) -> Delivery<M, S> {
        match self.entries.remove(&id) {
            Some(entry) => Delivery::Violation { entry, error },
            None => Delivery::Unknown,
        }
    }

    /// What this side holds, for the RESUME list it sends: each open
    /// connection with what it received and wrote out, and each it closed
    /// without a confirmation.
    pub fn resume_list(&self) -> Vec<ResumeEntry> {
        let open = self.entries.iter().map(|(id, entry)| ResumeEntry {
            connect_id: *id,
            received: entry.route.received.unwrap_or(0),
            written: entry.route.gate.written(),
            closing: false,
        });
        let closing = self.closing.keys().map(|id| ResumeEntry {
            connect_id: *id,
            received: 0,
            written: 0,
            closing: true,
        });
        open.chain(closing).collect()
    }

    /// The RESUME list as the packets that carry it, the last one marked
    /// (one empty packet when there is nothing to list).
    pub fn resume_frames(&self) -> Vec<Frame> {
        let list = self.resume_list();
        if list.is_empty() {
            return vec![Frame::Resume {
                connections: Vec::new(),
                last: true,
            }];
        }
        let count = list.len().div_ceil(RESUME_CHUNK);
        list.chunks(RESUME_CHUNK)
            .enumerate()
            .map(|(index, chunk)| Frame::Resume {
                connections: chunk.to_vec(),
                last: index + 1 == count,
            })
            .collect()
    }

    /// Reconciles this side's connections with the peer's RESUME list
    /// (docs/resume.md, "Reconciling"): what the peer received is resent
    /// from where it stopped, what it wrote out releases credit, closes it
    /// missed are sent again, and each side's connections the other no
    /// longer has are ended.
    pub fn resume(&mut self, peer: &[ResumeEntry]) -> ResumePlan<M, S> {
        let mut plan = ResumePlan {
            resend: Vec::new(),
            close_again: Vec::new(),
            unknown: Vec::new(),
            gone: Vec::new(),
            refused: Vec::new(),
        };
        let mut listed = HashSet::with_capacity(peer.len());
        for theirs in peer {
            let id = theirs.connect_id;
            if !listed.insert(id) {
                // Listed twice: the first entry counts (a peer cannot make
                // us send a connection's bytes again more than once).
                continue;
            }
            if let Some(entry) = self.entries.get(&id) {
                let window = &entry.route.window;
                let resumed = window.grant(0, Some(theirs.written)).and_then(|()| {
                    if theirs.closing {
                        // It closed; its close and last bytes follow. It
                        // needs nothing more from us.
                        Ok(Vec::new())
                    } else {
                        window.resend_since(id, theirs.received)
                    }
                });
                match resumed {
                    Ok(frames) => plan.resend.extend(frames),
                    Err(error) => {
                        let entry = self.entries.remove(&id).expect("looked up above");
                        plan.refused.push((id, entry, error));
                    }
                }
            } else if let Some(closing) = self.closing.get(&id) {
                if theirs.closing {
                    // Both closed it: nothing left to confirm.
                    self.closing.remove(&id);
                    continue;
                }
                // Our close was lost with the stream: the bytes it missed,
                // then the close again.
                if let Some(window) = &closing.window {
                    let resent = window
                        .grant(0, Some(theirs.written))
                        .and_then(|()| window.resend_since(id, theirs.received));
                    // Positions we cannot explain: the close alone still ends it.
                    if let Ok(frames) = resent {
                        plan.resend.extend(frames);
                    }
                }
                plan.close_again.push((id, closing.error.clone()));
            } else if !theirs.closing {
                plan.unknown.push(id);
            }
        }
        // Ours the peer does not list: a close of ours it already took, or
        // a connection it never had.
        self.closing.retain(|id, _| listed.contains(id));
        let gone: Vec<ConnectId> = self
            .entries
            .keys()
            .filter(|id| !listed.contains(id))
            .copied()
            .collect();
        for id in gone {
            let entry = self.entries.remove(&id).expect("listed above");
            plan.gone.push((id, entry));
        }
        plan
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flow::{WINDOW, WindowClosed, cost};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    fn id(n: i64) -> ConnectId {
        ConnectId::new(n).unwrap()
    }

    /// A connection handed to another process mid-way (a packet sent and
    /// not acknowledged, a packet from the peer half written) resumes there
    /// exactly: the peer sends again from the end of the packet in hand,
    /// and this side sends again what the peer lacks.
    #[tokio::test]
    async fn a_connection_handed_over_resumes_where_its_predecessor_stood() {
        let mut agent: Connections<Bytes, ()> = Connections::default();
        let mut server: Connections<Bytes, ()> = Connections::default();
        let (route, mut port, window) = connection(Extensions::Resume);
        agent.insert(id(1), route, ());
        let (server_route, _server_port, server_window) = connection(Extensions::Resume);
        server.insert(id(1), server_route, ());
        // The agent sends three packets; the server receives only the first.
        let mut sent = Vec::new();
        for data in ["aaa", "bb", "c"] {
            window.reserve(data.len()).await.unwrap();
            sent.push(window.data(id(1), Bytes::from(data)));
        }
        let Frame::Data { data, offset, .. } = sent[0].clone() else {
            unreachable!()
        };
        assert!(matches!(
            server.deliver(id(1), data, offset, || ()).await,
            Delivery::Delivered
        ));
        // The server sends two; the agent writes the first and holds the second.
        for data in ["xyz", "12"] {
            server_window.reserve(data.len()).await.unwrap();
            let Frame::Data { data, offset, .. } = server_window.data(id(1), Bytes::from(data)) else {
                unreachable!()
            };
            assert!(matches!(
                agent.deliver(id(1), data, offset, || ()).await,
                Delivery::Delivered
            ));
        }
        assert_eq!(port.recv().await.unwrap(), "xyz");
        let _ = port.written(3);
        let in_hand = port.recv().await.unwrap();

        let mut taken = agent.take_open();
        assert_eq!(taken.len(), 1);
        let (taken_id, entry) = taken.pop().unwrap();
        let position = entry.route.position().unwrap();
        assert_eq!((position.written, position.acknowledged), (3, 0));
        assert_eq!(position.unacknowledged, ["aaa", "bb", "c"]);
        drop((entry, port));

        let mut successor: Connections<Bytes, ()> = Connections::default();
        let window = SendWindow::restored(position.acknowledged, position.unacknowledged);
        let (route, mut port, _window) = restored_connection(position.written, in_hand.len(), window);
        successor.insert(taken_id, route, ());
        let ours = successor.resume_list();
        assert_eq!((ours[0].received, ours[0].written), (5, 3));
        let plan = server.resume(&ours);
        assert!(
            plan.resend.is_empty(),
            "the server sends again from the end of the packet in hand"
        );
        let plan = successor.resume(&server.resume_list());
        let resent: Vec<_> = plan
            .resend
            .iter()
            .map(|frame| match frame {
                Frame::Data { data, offset, .. } => (offset.unwrap(), data.clone()),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(resent, [(3, Bytes::from("bb")), (5, Bytes::from("c"))]);
        // The packet in hand, once written, counts.
        let _ = port.written(in_hand.len());
        assert_eq!(successor.resume_list()[0].written, 5);
    }

    #[tokio::test]
    async fn data_reaches_the_consumer_and_credit_returns_in_batches() {
        let mut table: Connections<Bytes, ()> = Connections::default();
        let (route, mut port, _) = connection(Extensions::FlowControl);
        table.insert(id(1), route, ());
        let mut returned = 0u64;
        for _ in 0..64 {
            let delivery = table
                .deliver(id(1), Bytes::from(vec![7; 65536]), None, || ())
                .await;
            assert!(matches!(delivery, Delivery::Delivered));
            let data = port.recv().await.unwrap();
            assert_eq!(data.len(), 65536);
            returned += u64::from(port.written(data.len()).map_or(0, |credit| credit.bytes));
        }
        assert!(returned > 0, "credit must come back");
        assert!(returned <= 64 * u64::from(cost(65536)));
    }

    /// With resume the peer keeps what it sent until we acknowledge it: a
    /// connection that goes quiet must acknowledge all it wrote, or the
    /// peer keeps up to a quarter of the window for as long as it is quiet.
    #[tokio::test(start_paused = true)]
    async fn with_resume_a_quiet_port_acknowledges_everything_written() {
        let mut table: Connections<Bytes, ()> = Connections::default();
        let (route, mut port, _) = connection(Extensions::Resume);
        table.insert(id(1), route, ());
        for (offset, len) in [(0, 10), (10, 20)] {
            let delivery = table
                .deliver(id(1), Bytes::from(vec![7; len]), Some(offset), || ())
                .await;
            assert!(matches!(delivery, Delivery::Delivered));
        }
        for _ in 0..2 {
            let Waited::Arrived(Some(data)) = port.recv_or_quiet().await else {
                panic!("DATA was queued");
            };
            // No acknowledgement per packet.
            assert_eq!(port.written(data.len()), None);
        }
        // Quiet for a second: everything written is acknowledged.
        let started = tokio::time::Instant::now();
        let quiet = tokio::time::timeout(Duration::from_secs(10), port.recv_or_quiet()).await;
        let Ok(Waited::Quiet(credit)) = quiet else {
            panic!("a quiet connection must acknowledge what it wrote: {quiet:?}");
        };
        assert_eq!(started.elapsed(), flow::QUIET_ACK_AFTER);
        assert_eq!(credit.written, Some(30));
        assert_eq!(credit.bytes, cost(10) + cost(20));
        // Then it waits without a limit: nothing is owed.
        let waiting = tokio::time::timeout(Duration::from_secs(3600), port.recv_or_quiet()).await;
        assert!(waiting.is_err(), "nothing more to acknowledge");
        // Without resume nothing needs acknowledging early.
        let (route, mut port, _) = connection(Extensions::FlowControl);
        table.insert(id(2), route, ());
        table.deliver(id(2), Bytes::from(vec![7; 10]), None, || ()).await;
        let Waited::Arrived(Some(data)) = port.recv_or_quiet().await else {
            panic!()
        };
        assert_eq!(port.written(data.len()), None);
        let waiting = tokio::time::timeout(Duration::from_secs(3600), port.recv_or_quiet()).await;
        assert!(waiting.is_err(), "flow control alone never acknowledges early");
    }

    #[tokio::test]
    async fn unknown_ids_and_gone_consumers_are_told_apart() {
        let mut table: Connections<Bytes, ()> = Connections::default();
        assert!(matches!(
            table.deliver(id(9), Bytes::from_static(b"x"), None, || ()).await,
            Delivery::Unknown
        ));
        let (route, port, _) = connection(Extensions::FlowControl);
        table.insert(id(1), route, ());
        drop(port);
        assert!(matches!(
            table.deliver(id(1), Bytes::from_static(b"x"), None, || ()).await,
            Delivery::ConsumerGone
        ));
        assert!(table.contains(id(1)), "the caller decides how it ends");
    }

    #[tokio::test]
    async fn an_overrun_takes_the_connection_out_of_the_table() {
        let mut table: Connections<Bytes, &str> = Connections::default();
        let (route, _port, _) = connection(Extensions::FlowControl);
        table.insert(id(1), route, "state");
        let fits = WINDOW as usize / cost(65536) as usize;
        for _ in 0..fits {
            let delivery = table
                .deliver(id(1), Bytes::from(vec![0; 65536]), None, || ())
                .await;
            assert!(matches!(delivery, Delivery::Delivered));
        }
        match table
            .deliver(id(1), Bytes::from(vec![0; 65536]), None, || ())
            .await
        {
            Delivery::Violation { entry, error } => {
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
        let (route, mut port, _) = connection(Extensions::Upstream);
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
        table.deliver(id(1), chunk.clone(), None, hook).await;
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
                table.deliver(id(1), chunk.clone(), None, hook).await;
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
        let (route, _port, window) = connection(Extensions::FlowControl);
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
        let (route, _port, window) = connection(Extensions::FlowControl);
        table.insert(id(1), route, ());
        window.reserve(WINDOW as usize - 64).await.unwrap();
        table.grant(id(2), WINDOW, None).unwrap();
        let still_blocked = tokio::time::timeout(std::time::Duration::from_millis(20), window.reserve(1));
        assert!(still_blocked.await.is_err());
        table.grant(id(1), 1024, None).unwrap();
        window.reserve(1).await.unwrap();
    }

    fn numbered(frame: &Frame) -> (ConnectId, u64, usize) {
        match frame {
            Frame::Data {
                connect_id,
                data,
                offset,
            } => (*connect_id, offset.unwrap(), data.len()),
            other => panic!("expected DATA, got {other:?}"),
        }
    }

    /// One direction of a resumable connection across a cut: the sender's
    /// packets are numbered, the receiver takes each once and in order, and
    /// after the cut exactly what the receiver lacks is sent again.
    #[tokio::test]
    async fn a_resumed_connection_gets_exactly_what_it_lacks() {
        let mut sender: Connections<Bytes, ()> = Connections::default();
        let (route, _port, window) = connection(Extensions::Resume);
        sender.insert(id(1), route, ());
        let mut receiver: Connections<Bytes, ()> = Connections::default();
        let (route, mut port, _) = connection(Extensions::Resume);
        receiver.insert(id(1), route, ());

        let mut frames = Vec::new();
        for n in 0..4u8 {
            window.reserve(1000).await.unwrap();
            frames.push(window.data(id(1), Bytes::from(vec![n; 1000])));
        }
        // The first two arrive; the cut loses the others.
        for frame in &frames[..2] {
            let Frame::Data { data, offset, .. } = frame.clone() else {
                unreachable!()
            };
            assert!(matches!(
                receiver.deliver(id(1), data, offset, || ()).await,
                Delivery::Delivered
            ));
        }
        // A gap is a violation, a repeat a duplicate.
        let Frame::Data { data, offset, .. } = frames[0].clone() else {
            unreachable!()
        };
        assert!(matches!(
            receiver.deliver(id(1), data, offset, || ()).await,
            Delivery::Duplicate
        ));
        let list = receiver.resume_list();
        assert_eq!(
            list,
            vec![ResumeEntry {
                connect_id: id(1),
                received: 2000,
                written: 0,
                closing: false
            }]
        );
        let plan = sender.resume(&list);
        let resent: Vec<_> = plan.resend.iter().map(numbered).collect();
        assert_eq!(resent, vec![(id(1), 2000, 1000), (id(1), 3000, 1000)]);
        assert!(plan.gone.is_empty() && plan.unknown.is_empty() && plan.close_again.is_empty());
        for frame in plan.resend {
            let Frame::Data { data, offset, .. } = frame else {
                unreachable!()
            };
            assert!(matches!(
                receiver.deliver(id(1), data, offset, || ()).await,
                Delivery::Delivered
            ));
        }
        // The late copies of the lost packets (still queued before the cut) are dropped.
        for frame in &frames[2..] {
            let Frame::Data { data, offset, .. } = frame.clone() else {
                unreachable!()
            };
            assert!(matches!(
                receiver.deliver(id(1), data, offset, || ()).await,
                Delivery::Duplicate
            ));
        }
        let mut got = Vec::new();
        for _ in 0..4 {
            let chunk = port.recv().await.unwrap();
            got.push(chunk[0]);
        }
        assert_eq!(got, vec![0, 1, 2, 3], "nothing lost, nothing doubled, order kept");

        // Bytes out of order, or without a position, end the connection.
        let (route, _port, _) = connection::<Bytes>(Extensions::Resume);
        receiver.insert(id(2), route, ());
        let delivery = receiver
            .deliver(id(2), Bytes::from_static(b"x"), Some(5), || ())
            .await;
        assert!(matches!(
            delivery,
            Delivery::Violation {
                error: Refused::Gap(_),
                ..
            }
        ));
        let (route, _port, _) = connection::<Bytes>(Extensions::Resume);
        receiver.insert(id(3), route, ());
        let delivery = receiver
            .deliver(id(3), Bytes::from_static(b"x"), None, || ())
            .await;
        assert!(matches!(
            delivery,
            Delivery::Violation {
                error: Refused::Unnumbered,
                ..
            }
        ));
    }

    /// Reconciling two sides' lists: a close lost with the stream is sent
    /// again after the bytes before it; closes both sides made, or the peer
    /// already took, are forgotten; connections one side no longer has end
    /// on the other; a position that names unsent bytes refuses only that
    /// connection.
    #[tokio::test]
    async fn reconciling_closes_and_connections_one_side_lacks() {
        let mut ours: Connections<Bytes, &str> = Connections::default();
        let mut windows = HashMap::new();
        for n in 1..=6 {
            let (route, _port, window) = connection(Extensions::Resume);
            ours.insert(id(n), route, "state");
            window.reserve(10).await.unwrap();
            let _ = window.data(id(n), Bytes::from_static(b"0123456789"));
            windows.insert(n, window);
        }
        // 1: we closed it, the peer still has it open (our close was lost).
        ours.close(id(1), None);
        // 2: we closed it, and so did the peer.
        ours.close(id(2), None);
        // 3: we closed it, and the peer already took the close.
        ours.close(id(3), None);
        // 4: open on both. 5: open here, unknown to the peer. 6: the peer
        // claims bytes we never sent.
        let entry = |n, received, written, closing| ResumeEntry {
            connect_id: id(n),
            received,
            written,
            closing,
        };
        let peer = [
            entry(1, 4, 0, false),
            entry(2, 0, 0, true),
            entry(4, 10, 10, false),
            entry(6, 99, 0, false),
            // 7: open on the peer, unknown here. 8: the peer closed it and we
            // already took the close.
            entry(7, 0, 0, false),
            entry(8, 0, 0, true),
        ];
        let plan = ours.resume(&peer);
        // 1's bytes are resent from where the peer stopped... which is inside
        // the packet: positions fall between packets, so nothing is resent,
        // but the close goes again.
        assert!(plan.resend.is_empty());
        assert_eq!(plan.close_again, vec![(id(1), None)]);
        assert_eq!(plan.unknown, vec![id(7)]);
        assert_eq!(
            plan.gone.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
            vec![id(5)]
        );
        assert_eq!(plan.refused.len(), 1);
        assert_eq!(plan.refused[0].0, id(6));
        assert!(matches!(
            plan.refused[0].2,
            OffsetError::BeyondSent {
                claimed: 99,
                sent: 10
            }
        ));
        // Still waiting for the peer to confirm 1; 2 and 3 are settled.
        assert!(ours.is_closing(id(1)));
        assert!(!ours.is_closing(id(2)) && !ours.is_closing(id(3)));
        assert_eq!(ours.len(), 1, "only 4 is still open");
        assert_eq!(windows[&4].unacknowledged(), 0, "the peer wrote 4's bytes out");

        // A close lost after its bytes: both go again, in order.
        let (route, _port, window) = connection::<Bytes>(Extensions::Resume);
        ours.insert(id(9), route, "state");
        window.reserve(10).await.unwrap();
        let _ = window.data(id(9), Bytes::from_static(b"last bytes"));
        ours.close(id(9), Some("connection reset by peer".to_owned()));
        let plan = ours.resume(&[entry(4, 10, 10, false), entry(9, 0, 0, false)]);
        assert_eq!(
            plan.resend.iter().map(numbered).collect::<Vec<_>>(),
            vec![(id(9), 0, 10)]
        );
        assert_eq!(
            plan.close_again,
            vec![(id(9), Some("connection reset by peer".to_owned()))]
        );
        assert!(ours.confirm(id(9)));
        assert!(
            !ours.is_closing(id(1)),
            "the peer no longer listed 1: it took the close"
        );
    }

    #[test]
    fn the_resume_list_travels_in_packets_the_last_one_marked() {
        let mut table: Connections<Bytes, ()> = Connections::default();
        assert_eq!(
            table.resume_frames(),
            vec![Frame::Resume {
                connections: Vec::new(),
                last: true
            }]
        );
        let mut ports = Vec::new();
        for n in 1..=(RESUME_CHUNK as i64 + 1) {
            let (route, port, _) = connection(Extensions::Resume);
            table.insert(id(n), route, ());
            ports.push(port);
        }
        let frames = table.resume_frames();
        let shape: Vec<(usize, bool)> = frames
            .iter()
            .map(|frame| match frame {
                Frame::Resume { connections, last } => (connections.len(), *last),
                other => panic!("expected RESUME, got {other:?}"),
            })
            .collect();
        assert_eq!(shape, vec![(RESUME_CHUNK, false), (1, true)]);
    }
}
