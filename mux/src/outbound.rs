//! The queue of packets one side sends its peer, which outlives the stream
//! under it (docs/resume.md).
//!
//! Producers (each connection's reader, the session) queue packets with
//! [`Outbound::send`]; the transport stream attached now drains the queue
//! through its [`Writer`]. When a stream is lost the queue stays: producers
//! pause once it is full, and the next stream's writer takes over. A writer
//! first sends what the session puts ahead of everything else (the RESUME
//! list, then what the peer lacks) and opens the queue only when the
//! session says so, so nothing queued before a resume overtakes it; what
//! was queued for the lost stream is dropped when the next one attaches
//! (DATA is kept by [`crate::replay`], control packets are rebuilt from the
//! connection table).
//!
//! The queue is a `VecDeque` under a lock, with a semaphore for its room,
//! rather than tokio's bounded channel: every captured connection of a node
//! has one queue on the server and one in the node agent, mostly idle, and
//! a channel allocates half a KiB of cache-padded state and a first block
//! of 32 packet slots (2.6 KiB) when it is made; that was the largest part
//! of what an idle captured connection cost the server (heaptrack,
//! 2026-12-06; docs/testing.md). This queue allocates when a packet comes
//! and gives the memory back once it is drained.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};

use futures_util::Stream;
use futures_util::task::AtomicWaker;
use konnectivity_proto::{Frame, Packet};
use tokio::sync::Semaphore;

use crate::mailbox::{self, mailbox};

/// The queue is gone: the session has ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the stream's session has ended")]
pub struct QueueClosed;

/// Why the session's own packet was not queued ([`Outbound::send_from_session`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SessionSendError {
    #[error("the stream's session has ended")]
    Closed,
    /// The queue is full and the stream attached now is gone: its writer
    /// was dropped (the transport ended the stream, or its connection died).
    #[error("the stream is gone (its writer was dropped) and the queue is full")]
    StreamGone,
}

/// The sending end producers hold.
#[derive(Debug, Clone)]
pub struct Outbound {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    /// Drained by the attached writer; a std mutex, since it is only held
    /// to push or pop.
    queue: Mutex<Queue>,
    /// The queue's free room, one permit a packet: a producer takes one
    /// before it queues, the writer gives one back for each packet it
    /// takes. Fair, so producers that wait queue in the order they came.
    ///
    /// Closed when the session ends, under the queue's lock: its closed
    /// state is the queue's (producers fail, waiting ones too; writers send
    /// what is queued, then end their streams).
    room: Semaphore,
    /// Bumped by each attach and detach: a writer of an older stream stops.
    generation: AtomicU64,
    /// The generation of the latest attach: a writer older than it was
    /// superseded by a newer stream (see [`Writer::ending_when_superseded`]).
    attached: AtomicU64,
    /// The attached writer's task, woken when its stream is detached.
    writer: AtomicWaker,
    /// The generation whose writer was dropped last, and its wake-up: the
    /// session must not wait for room only a new stream would make.
    dropped: AtomicU64,
    writer_dropped: tokio::sync::Notify,
}

#[derive(Debug, Default)]
struct Queue {
    packets: VecDeque<Packet>,
    /// The attached writer, waiting for a packet. Not `Shared::writer`,
    /// which a lost stream's writer may take over while it is still polled.
    waiting: Option<std::task::Waker>,
}

/// Creates a queue of `capacity` packets.
pub fn outbound(capacity: usize) -> Outbound {
    Outbound {
        shared: Arc::new(Shared {
            queue: Mutex::new(Queue::default()),
            room: Semaphore::new(capacity),
            generation: AtomicU64::new(0),
            attached: AtomicU64::new(0),
            writer: AtomicWaker::new(),
            dropped: AtomicU64::new(0),
            writer_dropped: tokio::sync::Notify::new(),
        }),
    }
}

impl Outbound {
    /// Queues a packet, waiting while the queue is full. The packet is
    /// queued at once when there is room: the future then only reports it.
    pub fn send(&self, packet: Packet) -> Queueing<'_> {
        match self.try_queue(packet) {
            Ok(()) => Queueing::Done(Ok(())),
            Err(Full::Closed) => Queueing::Done(Err(QueueClosed)),
            Err(Full::NoRoom(packet)) => Queueing::Waiting(Box::pin(self.queue_when_room(packet))),
        }
    }

    /// Queues `packet` if there is room now.
    fn try_queue(&self, packet: Packet) -> Result<(), Full> {
        match self.shared.room.try_acquire() {
            Ok(permit) => {
                permit.forget();
                self.push(packet).map_err(|QueueClosed| Full::Closed)
            }
            Err(tokio::sync::TryAcquireError::Closed) => Err(Full::Closed),
            Err(tokio::sync::TryAcquireError::NoPermits) => Err(Full::NoRoom(packet)),
        }
    }

    /// Waits for room, then queues `packet`.
    async fn queue_when_room(&self, packet: Packet) -> Result<(), QueueClosed> {
        let permit = self.shared.room.acquire().await.map_err(|_| QueueClosed)?;
        permit.forget();
        self.push(packet)
    }

    /// Queues `packet` with the room already taken for it.
    fn push(&self, packet: Packet) -> Result<(), QueueClosed> {
        let waiting = {
            let mut queue = lock(&self.shared.queue);
            if self.shared.room.is_closed() {
                return Err(QueueClosed);
            }
            queue.packets.push_back(packet);
            queue.waiting.take()
        };
        if let Some(writer) = waiting {
            writer.wake();
        }
        Ok(())
    }

    /// Queues a packet of the session itself (dial answers, closes, its
    /// control packets): as [`Outbound::send`], except that it stops waiting
    /// for room once the stream attached now is gone. The session reads its
    /// stream in the same task: waiting for room in a queue whose stream is
    /// gone, it would never read the error that tells it the stream was
    /// lost, and every connection of the session would wait with it (the
    /// 5,000-node run: a control-plane agent with 12,462 connections whose
    /// connection to the server had died kept waiting, and so did the
    /// server's session with 22,902 dials pending).
    pub async fn send_from_session(&self, packet: Packet) -> Result<(), SessionSendError> {
        let packet = match self.try_queue(packet) {
            Ok(()) => return Ok(()),
            Err(Full::Closed) => return Err(SessionSendError::Closed),
            Err(Full::NoRoom(packet)) => packet,
        };
        let dropped = self.shared.writer_dropped.notified();
        tokio::pin!(dropped);
        dropped.as_mut().enable();
        let generation = self.shared.generation.load(Ordering::Acquire);
        if self.shared.dropped.load(Ordering::Acquire) == generation {
            return Err(SessionSendError::StreamGone);
        }
        tokio::select! {
            sent = self.queue_when_room(packet) => sent.map_err(|QueueClosed| SessionSendError::Closed),
            () = dropped => Err(SessionSendError::StreamGone),
        }
    }

    /// Queues a packet if there is room now; whether it was queued.
    pub fn try_send(&self, packet: Packet) -> bool {
        self.try_queue(packet).is_ok()
    }

    /// A writer for a new stream that drains the queue at once (a stream
    /// that resumes nothing).
    pub fn attach(&self) -> Writer {
        let (writer, ahead) = self.attach_after(false);
        ahead.open();
        writer
    }

    /// A writer for a stream that resumes an earlier one's connections:
    /// what was queued for the lost stream is dropped, and the writer sends
    /// only what is put [`Ahead`] until that is opened.
    pub fn attach_resuming(&self) -> (Writer, Ahead) {
        self.attach_after(true)
    }

    fn attach_after(&self, drop_queued: bool) -> (Writer, Ahead) {
        let generation = self.shared.generation.fetch_add(1, Ordering::AcqRel) + 1;
        self.shared.attached.store(generation, Ordering::Release);
        self.shared.writer.wake();
        let (dropped, waiting) = {
            let mut queue = lock(&self.shared.queue);
            let dropped = match drop_queued {
                true => std::mem::take(&mut queue.packets).len(),
                false => 0,
            };
            // The superseded writer, if it waits for a packet: it may end
            // its stream now.
            (dropped, queue.waiting.take())
        };
        self.shared.room.add_permits(dropped);
        if let Some(superseded) = waiting {
            superseded.wake();
        }
        // A mailbox, which allocates only when something goes ahead: every
        // new stream attaches a writer.
        let (ahead, first) = mailbox();
        let writer = Writer {
            shared: self.shared.clone(),
            generation,
            first: Some(first),
            ends_when_superseded: false,
        };
        (writer, Ahead(ahead))
    }

    /// The stream is lost: its writer, if still polled, sends nothing more
    /// and never ends the stream cleanly (a clean end would tell the peer
    /// the session ended); the stream goes with its connection.
    pub fn detach(&self) {
        self.shared.generation.fetch_add(1, Ordering::AcqRel);
        self.shared.writer.wake();
    }

    /// The session has ended: producers fail from now on; the attached
    /// writer sends what is queued (a STREAM_END last, say), then ends its
    /// stream cleanly.
    pub fn close(&self) {
        let waiting = {
            let mut queue = lock(&self.shared.queue);
            // Under the lock: a push sees it closed, or is queued before.
            self.shared.room.close();
            queue.waiting.take()
        };
        self.shared.writer.wake();
        if let Some(writer) = waiting {
            writer.wake();
        }
    }

    /// Packets waiting in the queue.
    pub fn queued(&self) -> usize {
        lock(&self.shared.queue).packets.len()
    }
}

/// Why a packet was not queued at once.
enum Full {
    Closed,
    /// No room now: the packet is handed back.
    NoRoom(Packet),
}

/// A packet on its way into the queue ([`Outbound::send`]).
///
/// A small named future rather than an `async fn`: every connection's task
/// awaits one, idle ones included, and an `async fn` would carry the packet
/// and the wait for room inline in each of those tasks (their size is most
/// of what an idle tunnel costs). The wait for room, which is rare, is boxed.
pub enum Queueing<'a> {
    Done(Result<(), QueueClosed>),
    Waiting(Pin<Box<dyn Future<Output = Result<(), QueueClosed>> + Send + 'a>>),
}

impl Future for Queueing<'_> {
    type Output = Result<(), QueueClosed>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.get_mut() {
            Queueing::Done(result) => Poll::Ready(*result),
            Queueing::Waiting(wait) => wait.as_mut().poll(cx),
        }
    }
}

impl std::fmt::Debug for Queueing<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Queueing::Done(result) => f.debug_tuple("Done").field(result).finish(),
            Queueing::Waiting(_) => f.write_str("Waiting"),
        }
    }
}

fn lock(queue: &Mutex<Queue>) -> MutexGuard<'_, Queue> {
    queue.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What goes out ahead of the queue on a resuming stream; [`Ahead::open`]
/// lets the queue follow.
#[derive(Debug)]
pub struct Ahead(mailbox::Sender<Option<Packet>>);

impl Ahead {
    pub fn send(&self, frame: Frame) {
        let _ = self.0.send(Some(frame.into()));
    }

    /// Everything that must go first is sent: the queue follows.
    pub fn open(self) {
        let _ = self.0.send(None);
    }
}

/// The packets for one transport stream: a gRPC response (server) or
/// request (agent) body. Stops when the stream is detached or another one
/// attached; ends (cleanly) only when the session closes the queue.
#[derive(Debug)]
pub struct Writer {
    shared: Arc<Shared>,
    generation: u64,
    /// What goes first, until it says the queue may follow.
    first: Option<mailbox::Receiver<Option<Packet>>>,
    /// See [`Writer::ending_when_superseded`].
    ends_when_superseded: bool,
}

impl Writer {
    /// This writer ends its stream once a newer stream attaches, rather
    /// than holding it open, silent, until the session ends.
    ///
    /// For the server's responses: a stream the session left for a newer
    /// one may still be the one its peer reads. A resume attempt the peer
    /// gave up on (its own timeout ran out) can reach the server after the
    /// peer resumed on a later attempt, and take the connection over; a
    /// superseded response that stayed open left the peer reading a live,
    /// silent stream for good (a watch that never got another event). Ended,
    /// it tells the peer to resume again. The peer's own request bodies
    /// keep the default: there, a request that ends cleanly tells the
    /// server the peer is done with the stream (a node-frontend stream
    /// after its CLOSE_RSP).
    pub fn ending_when_superseded(mut self) -> Writer {
        self.ends_when_superseded = true;
        self
    }

    /// Whether a newer stream has attached since this writer's.
    pub fn is_superseded(&self) -> bool {
        self.shared.attached.load(Ordering::Acquire) > self.generation
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        // Only the stream attached now matters to a waiting session.
        if self.shared.generation.load(Ordering::Acquire) == self.generation {
            self.shared.dropped.store(self.generation, Ordering::Release);
            self.shared.writer_dropped.notify_waiters();
        }
    }
}

impl Stream for Writer {
    type Item = Packet;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Packet>> {
        // Registered before the check, so a detach after it wakes us.
        self.shared.writer.register(cx.waker());
        if self.shared.generation.load(Ordering::Acquire) != self.generation {
            // A lost stream's writer: it ends only with the session, or
            // when superseded if it was asked to.
            let ends = self.shared.room.is_closed() || (self.ends_when_superseded && self.is_superseded());
            return match ends {
                true => Poll::Ready(None),
                false => Poll::Pending,
            };
        }
        if let Some(first) = &mut self.first {
            match first.poll_recv(cx) {
                Poll::Ready(Some(Some(packet))) => return Poll::Ready(Some(packet)),
                Poll::Ready(Some(None)) => self.first = None,
                // The session dropped it without opening: it gave up on
                // this stream.
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Pending => return Poll::Pending,
            }
        }
        let mut queue = lock(&self.shared.queue);
        let Some(packet) = queue.packets.pop_front() else {
            if self.shared.room.is_closed() {
                return Poll::Ready(None);
            }
            match &mut queue.waiting {
                Some(waker) => waker.clone_from(cx.waker()),
                none => *none = Some(cx.waker().clone()),
            }
            return Poll::Pending;
        };
        if queue.packets.is_empty() {
            // Given back: most queues are idle most of the time, and an
            // allocation when the next packet comes costs less than 4 slots
            // (320 bytes) kept by every idle connection that once sent one.
            queue.packets = VecDeque::new();
        }
        drop(queue);
        self.shared.room.add_permits(1);
        Poll::Ready(Some(packet))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt;
    use konnectivity_proto::ConnectId;
    use std::time::Duration;

    fn close(id: i64) -> Packet {
        Frame::CloseRequest {
            connect_id: ConnectId::new(id).unwrap(),
        }
        .into()
    }

    #[test]
    fn queueing_a_packet_adds_little_to_the_task_that_awaits_it() {
        // Each idle tunnel's task holds one of these (docs/testing.md: an
        // async fn here put 0.7 KiB on every idle CONNECT tunnel).
        let outbound = outbound(1);
        let sent = outbound.send(close(1));
        assert!(
            std::mem::size_of_val(&sent) <= 24,
            "{} bytes",
            std::mem::size_of_val(&sent)
        );
        let waiting = outbound.send(close(2));
        assert!(matches!(waiting, Queueing::Waiting(_)));
        assert!(std::mem::size_of_val(&waiting) <= 24);
    }

    /// The session's own send waits for room while its stream lives, and
    /// gives up once the stream's writer is dropped: without that, a full
    /// queue on a dead stream held the session forever. Connection readers'
    /// sends keep waiting for the next stream.
    #[tokio::test]
    async fn the_sessions_send_stops_waiting_when_its_stream_is_gone() {
        let outbound = outbound(1);
        let writer = outbound.attach();
        outbound.send(close(1)).await.unwrap();
        let session = {
            let outbound = outbound.clone();
            tokio::spawn(async move { outbound.send_from_session(close(2)).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!session.is_finished(), "a live stream's full queue is waited on");
        let reader = outbound.send(close(3));
        drop(writer);
        let gone = tokio::time::timeout(Duration::from_secs(1), session).await;
        assert!(
            matches!(gone, Ok(Ok(Err(SessionSendError::StreamGone)))),
            "{gone:?}"
        );
        // Once gone, at once.
        assert_eq!(
            outbound.send_from_session(close(4)).await,
            Err(SessionSendError::StreamGone)
        );
        assert!(
            tokio::time::timeout(Duration::from_millis(50), reader)
                .await
                .is_err(),
            "a connection's reader waits for the next stream"
        );
        // A new stream: the session waits for room again, and gets it.
        let mut next = outbound.attach();
        let sending = outbound.send_from_session(close(5));
        assert_eq!(next.next().await, Some(close(1)));
        assert_eq!(sending.await, Ok(()));
    }

    #[tokio::test]
    async fn a_writer_drains_the_queue_until_another_stream_attaches() {
        let outbound = outbound(8);
        let mut first = outbound.attach();
        outbound.send(close(1)).await.unwrap();
        assert_eq!(first.next().await, Some(close(1)));
        outbound.send(close(2)).await.unwrap();
        outbound.detach();
        let stopped = tokio::time::timeout(std::time::Duration::from_millis(20), first.next());
        assert!(
            stopped.await.is_err(),
            "a detached writer sends nothing, and does not end its stream"
        );
        assert_eq!(outbound.queued(), 1, "the queue stays");
        let mut second = outbound.attach();
        outbound.send(close(3)).await.unwrap();
        assert_eq!(
            second.next().await,
            Some(close(2)),
            "a plain attach sends what was queued"
        );
        assert_eq!(second.next().await, Some(close(3)));
    }

    /// A writer asked to end when superseded ends its stream as soon as a
    /// newer stream attaches, even while it waits for a packet and is not
    /// detached first (the session took a resume while the stream was
    /// alive); a detach alone does not end it, and a default writer holds
    /// its stream open.
    #[tokio::test]
    async fn a_superseded_writer_ends_its_stream_when_asked_to() {
        let outbound = outbound(8);
        let mut live = outbound.attach().ending_when_superseded();
        outbound.send(close(1)).await.unwrap();
        assert_eq!(live.next().await, Some(close(1)));
        let waiting = tokio::spawn(async move {
            let end = live.next().await;
            (end, live.is_superseded())
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished(), "an attached writer waits for packets");
        let (mut newer, ahead) = outbound.attach_resuming();
        ahead.open();
        let ended = tokio::time::timeout(Duration::from_secs(1), waiting).await;
        assert!(
            matches!(ended, Ok(Ok((None, true)))),
            "the superseded stream ends: {ended:?}"
        );
        outbound.send(close(2)).await.unwrap();
        assert_eq!(newer.next().await, Some(close(2)), "the newer one carries on");
        assert!(!newer.is_superseded());

        let outbound = self::outbound(8);
        let mut detached = outbound.attach().ending_when_superseded();
        outbound.detach();
        let held = tokio::time::timeout(Duration::from_millis(20), detached.next());
        assert!(held.await.is_err(), "a detached writer is not superseded");
        let mut plain = outbound.attach();
        let _newest = outbound.attach();
        assert_eq!(detached.next().await, None, "superseded once a stream attaches");
        let held = tokio::time::timeout(Duration::from_millis(20), plain.next());
        assert!(held.await.is_err(), "a default writer holds its stream open");
    }

    #[tokio::test]
    async fn a_resuming_writer_sends_what_goes_ahead_then_the_queue() {
        let outbound = outbound(8);
        let _lost = outbound.attach();
        outbound.send(close(1)).await.unwrap();
        let (mut writer, ahead) = outbound.attach_resuming();
        assert_eq!(
            outbound.queued(),
            0,
            "what was queued for the lost stream is dropped"
        );
        outbound.send(close(2)).await.unwrap();
        ahead.send(Frame::CloseRequest {
            connect_id: ConnectId::new(9).unwrap(),
        });
        assert_eq!(writer.next().await, Some(close(9)));
        let waiting = tokio::time::timeout(std::time::Duration::from_millis(20), writer.next());
        assert!(waiting.await.is_err(), "the queue waits until opened");
        ahead.open();
        assert_eq!(writer.next().await, Some(close(2)));
    }

    /// A lost stream's writer may still be polled (its transport has not
    /// noticed yet): that must not take the wake-up the attached writer
    /// waits for.
    #[tokio::test]
    async fn a_lost_streams_writer_polled_later_does_not_take_the_attached_writers_wake_up() {
        let outbound = outbound(8);
        let mut lost = outbound.attach();
        let mut attached = outbound.attach();
        let waiting = tokio::spawn(async move { attached.next().await });
        tokio::task::yield_now().await;
        let mut context = Context::from_waker(std::task::Waker::noop());
        assert!(Pin::new(&mut lost).poll_next(&mut context).is_pending());
        outbound.send(close(1)).await.unwrap();
        let woken = tokio::time::timeout(Duration::from_secs(1), waiting).await;
        assert_eq!(
            woken.expect("the attached writer is woken").unwrap(),
            Some(close(1))
        );
    }

    #[tokio::test]
    async fn a_waiting_writer_ends_when_its_stream_is_detached() {
        let outbound = outbound(8);
        let mut writer = outbound.attach();
        let waiting = tokio::spawn(async move { writer.next().await });
        tokio::task::yield_now().await;
        outbound.close();
        let ended = tokio::time::timeout(std::time::Duration::from_secs(1), waiting).await;
        assert_eq!(ended.expect("woken").unwrap(), None);
    }

    #[tokio::test]
    async fn a_closed_queue_fails_its_producers() {
        let outbound = outbound(1);
        outbound.send(close(1)).await.unwrap();
        let blocked = {
            let outbound = outbound.clone();
            tokio::spawn(async move { outbound.send(close(2)).await })
        };
        tokio::task::yield_now().await;
        outbound.close();
        assert_eq!(blocked.await.unwrap(), Err(QueueClosed));
        assert_eq!(outbound.send(close(3)).await, Err(QueueClosed));
        // A writer attached now still sends what was queued, then ends.
        let mut writer = outbound.attach();
        assert_eq!(writer.next().await, Some(close(1)));
        assert_eq!(writer.next().await, None);
    }

    #[tokio::test]
    async fn producers_pause_while_no_stream_is_attached() {
        let outbound = outbound(1);
        outbound.send(close(1)).await.unwrap();
        let blocked = tokio::time::timeout(std::time::Duration::from_millis(20), outbound.send(close(2)));
        assert!(blocked.await.is_err(), "a full queue pauses its producers");
        let mut writer = outbound.attach();
        assert_eq!(writer.next().await, Some(close(1)));
    }
}
