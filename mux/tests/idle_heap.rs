//! What an idle outbound queue keeps on the heap. Every captured connection
//! of a node holds one on the server and one in the node agent, so at
//! 50,000 connections each KiB here is 50 MiB. A test binary of its own:
//! the allocator counts the whole process, and nothing else may allocate
//! while it counts.

use std::task::Context;

use futures_util::Stream;
use konnectivity_mux::outbound::outbound;
use konnectivity_proto::{ConnectId, Frame, Packet};

#[global_allocator]
static ALLOCATOR: konnectivity_plumbing::runtime::Allocator = konnectivity_plumbing::runtime::Allocator;

/// The queue size the server and the node agent give a captured connection.
const QUEUE: usize = 64;
const QUEUES: usize = 1_000;

/// A small DATA packet of connection 1, numbered.
fn data(n: i64) -> Packet {
    Frame::Data {
        connect_id: ConnectId::new(1).unwrap(),
        data: bytes::Bytes::from(n.to_be_bytes().to_vec()),
        offset: None,
    }
    .into()
}

#[test]
fn an_idle_queue_keeps_little_and_a_drained_one_no_more() {
    let mut context = Context::from_waker(std::task::Waker::noop());
    let mut idle = Vec::with_capacity(QUEUES);
    let before = konnectivity_plumbing::sys::heap_bytes();
    for _ in 0..QUEUES {
        let queue = outbound(QUEUE);
        let mut writer = queue.attach();
        // As the stream's first poll does: the writer learns that nothing
        // goes ahead, and finds the queue empty.
        let polled = std::pin::Pin::new(&mut writer).poll_next(&mut context);
        assert!(polled.is_pending());
        idle.push((queue, writer));
    }
    let per_queue = (konnectivity_plumbing::sys::heap_bytes() - before) / QUEUES as i64;
    // tokio's bounded channel kept 3.5 KiB here: its cache-padded state and
    // a first block of 32 packets.
    assert!(per_queue < 512, "an idle queue keeps {per_queue} bytes");
    // A queue that sent one packet, or a burst that filled it, gives its
    // memory back once drained.
    for burst in [1, QUEUE as i64] {
        for (queue, writer) in &mut idle {
            for n in 1..=burst {
                assert!(queue.try_send(data(n)), "room for packet {n}");
            }
            for n in 1..=burst {
                let polled = std::pin::Pin::new(&mut *writer).poll_next(&mut context);
                assert!(matches!(polled, std::task::Poll::Ready(Some(packet)) if packet == data(n)));
            }
        }
        let drained = (konnectivity_plumbing::sys::heap_bytes() - before) / QUEUES as i64;
        assert!(
            drained <= per_queue,
            "a queue drained of {burst} packets keeps {drained} bytes, {per_queue} before"
        );
    }
    drop(idle);
}
