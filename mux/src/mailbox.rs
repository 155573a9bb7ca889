//! A mailbox: an unbounded queue from one or more senders to one receiver
//! that holds nothing until a message arrives, and then only what is in
//! flight.
//!
//! For what every idle connection or session keeps: tokio's mpsc channel
//! allocates its first block of 32 slots and half a KiB of cache-padded
//! state when it is made, over a kilobyte per connection held by every idle
//! tunnel on both ends. Its users bound what is in it: a connection's route
//! hands its consumer DATA within the receive window; a resumable session
//! receives the streams that take it over, one per resume.

use std::collections::VecDeque;
use std::future::poll_fn;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

/// A mailbox's two ends.
pub fn mailbox<M>() -> (Sender<M>, Receiver<M>) {
    let shared = Arc::new(Mutex::new(Queue {
        messages: VecDeque::new(),
        waiting: None,
        senders: 1,
        receiver_gone: false,
    }));
    (
        Sender {
            shared: shared.clone(),
        },
        Receiver { shared },
    )
}

#[derive(Debug)]
struct Queue<M> {
    messages: VecDeque<M>,
    /// The receiver, waiting for a message.
    waiting: Option<Waker>,
    /// Senders alive: the receiver sees the end once none is.
    senders: usize,
    receiver_gone: bool,
}

fn lock<M>(shared: &Mutex<Queue<M>>) -> MutexGuard<'_, Queue<M>> {
    // Nothing panics while holding the lock; a poisoned queue is still whole.
    shared.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

pub struct Sender<M> {
    shared: Arc<Mutex<Queue<M>>>,
}

// By hand: a mailbox is shown by its state, whatever its messages are.
impl<M> std::fmt::Debug for Sender<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("mailbox::Sender").finish_non_exhaustive()
    }
}

impl<M> std::fmt::Debug for Receiver<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let queue = lock(&self.shared);
        f.debug_struct("mailbox::Receiver")
            .field("messages", &queue.messages.len())
            .field("senders", &queue.senders)
            .finish()
    }
}

impl<M> Clone for Sender<M> {
    fn clone(&self) -> Self {
        lock(&self.shared).senders += 1;
        Sender {
            shared: self.shared.clone(),
        }
    }
}

impl<M> Sender<M> {
    /// Queues `message`; hands it back if the receiver is gone.
    pub fn send(&self, message: M) -> Result<(), M> {
        let waiting = {
            let mut queue = lock(&self.shared);
            if queue.receiver_gone {
                return Err(message);
            }
            queue.messages.push_back(message);
            queue.waiting.take()
        };
        if let Some(waker) = waiting {
            waker.wake();
        }
        Ok(())
    }
}

impl<M> Drop for Sender<M> {
    fn drop(&mut self) {
        let waiting = {
            let mut queue = lock(&self.shared);
            queue.senders -= 1;
            match queue.senders {
                0 => queue.waiting.take(),
                _ => None,
            }
        };
        if let Some(waker) = waiting {
            waker.wake();
        }
    }
}

pub struct Receiver<M> {
    shared: Arc<Mutex<Queue<M>>>,
}

impl<M> Receiver<M> {
    /// The next message; `None` once every sender is gone and every message
    /// sent was received.
    pub async fn recv(&mut self) -> Option<M> {
        poll_fn(|cx| self.poll_recv(cx)).await
    }

    /// Stops receiving, in one step: the sender's later sends fail, and
    /// what it sent and was not received is returned.
    pub fn close(&mut self) -> VecDeque<M> {
        let mut queue = lock(&self.shared);
        queue.receiver_gone = true;
        queue.waiting = None;
        std::mem::take(&mut queue.messages)
    }

    /// [`Receiver::recv`], polled by hand.
    pub fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<M>> {
        let mut queue = lock(&self.shared);
        if let Some(message) = queue.messages.pop_front() {
            return Poll::Ready(Some(message));
        }
        if queue.senders == 0 {
            return Poll::Ready(None);
        }
        match &mut queue.waiting {
            Some(waker) => waker.clone_from(cx.waker()),
            none => *none = Some(cx.waker().clone()),
        }
        Poll::Pending
    }
}

impl<M> Drop for Receiver<M> {
    fn drop(&mut self) {
        // Messages still queued go now, not when the sender goes.
        let dropped = {
            let mut queue = lock(&self.shared);
            queue.receiver_gone = true;
            queue.waiting = None;
            std::mem::take(&mut queue.messages)
        };
        drop(dropped);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn messages_arrive_in_order_then_the_end() {
        let (sender, mut receiver) = mailbox();
        for n in 0..100 {
            sender.send(n).unwrap();
        }
        drop(sender);
        for n in 0..100 {
            assert_eq!(receiver.recv().await, Some(n));
        }
        assert_eq!(receiver.recv().await, None);
    }

    #[tokio::test]
    async fn a_waiting_receiver_wakes_for_a_message_and_for_the_end() {
        let (sender, mut receiver) = mailbox();
        let waiting = tokio::spawn(async move { (receiver.recv().await, receiver.recv().await) });
        tokio::task::yield_now().await;
        sender.send("one").unwrap();
        tokio::task::yield_now().await;
        drop(sender);
        assert_eq!(waiting.await.unwrap(), (Some("one"), None));
    }

    #[tokio::test]
    async fn the_end_comes_when_the_last_sender_goes() {
        let (sender, mut receiver) = mailbox();
        let other = sender.clone();
        let waiting = tokio::spawn(async move { (receiver.recv().await, receiver.recv().await) });
        drop(sender);
        tokio::task::yield_now().await;
        other.send("from the clone").unwrap();
        drop(other);
        assert_eq!(waiting.await.unwrap(), (Some("from the clone"), None));
    }

    #[test]
    fn sending_to_a_gone_receiver_hands_the_message_back_and_queued_ones_are_dropped() {
        let (sender, receiver) = mailbox();
        let queued = Arc::new(());
        sender.send(queued.clone()).unwrap();
        drop(receiver);
        assert_eq!(
            Arc::strong_count(&queued),
            1,
            "queued messages go with the receiver"
        );
        let message = Arc::new(());
        assert!(sender.send(message.clone()).is_err());
    }
}
