//! How a tunnel cuts a socket's bytes into DATA packets.
//!
//! One rule for every reader (the server's frontends, the agent's endpoint
//! sockets, the node's captured connections): a packet's buffer is never much
//! larger than its bytes. A packet can be held long after it was read: in a
//! peer's queue, and with resume in the replay buffer until the other side
//! acknowledges it. A ten-byte read into a buffer of [`DATA_CHUNK`] would pin
//! 256 KiB for as long, and a connection of many small writes would pin its
//! window (2 MiB of bytes) many hundred times over.

use std::io;

use bytes::{Bytes, BytesMut};
use konnectivity_proto::DATA_CHUNK;

/// The largest read whose bytes are copied into a packet of their own size;
/// a read that fills it goes on into a buffer of up to [`DATA_CHUNK`], so bulk
/// transfers still travel in large packets.
pub const SMALL_READ: usize = 2048;

/// The packet for a first read `first` (`None`: end of stream). A small read
/// is a packet of exactly its size; one that filled [`SMALL_READ`] goes on
/// with `read_more` (what is ready now; 0 when nothing is) into a buffer of
/// up to [`DATA_CHUNK`].
pub fn packet(first: &[u8], mut read_more: impl FnMut(&mut BytesMut) -> usize) -> Option<Bytes> {
    if first.is_empty() {
        return None;
    }
    if first.len() < SMALL_READ {
        return Some(Bytes::copy_from_slice(first));
    }
    let mut chunk = BytesMut::with_capacity(DATA_CHUNK);
    chunk.extend_from_slice(first);
    while chunk.len() < DATA_CHUNK && read_more(&mut chunk) > 0 {}
    Some(chunk.freeze())
}

/// Reads what a socket has ready now into one packet (`None`: end of
/// stream), through a small buffer on the stack of this call, so a task
/// that waits for readiness between reads holds no buffer at all.
/// `try_read` and `try_read_buf` are the socket half's own non-blocking
/// reads; `WouldBlock` from the first comes back as the error.
pub fn read_ready(
    try_read: impl FnOnce(&mut [u8]) -> io::Result<usize>,
    mut try_read_buf: impl FnMut(&mut BytesMut) -> io::Result<usize>,
) -> io::Result<Option<Bytes>> {
    let mut first = [0u8; SMALL_READ];
    let n = try_read(&mut first)?;
    // A later read's error is the next call's to see.
    Ok(packet(&first[..n], |chunk| try_read_buf(chunk).unwrap_or(0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_read_is_a_packet_of_its_own_size() {
        let data = read_ready(
            |buf| {
                buf[..10].copy_from_slice(b"0123456789");
                Ok(10)
            },
            |_| panic!("a small read reads no more"),
        )
        .unwrap()
        .unwrap();
        assert_eq!(data, &b"0123456789"[..]);
        // The buffer behind it is its own size, not DATA_CHUNK: what a
        // replay buffer holding it pins.
        assert!(BytesMut::from(data).capacity() < SMALL_READ);
    }

    #[test]
    fn a_full_read_goes_on_up_to_a_chunk_and_end_of_stream_is_none() {
        let mut more = 3 * DATA_CHUNK;
        let data = read_ready(
            |buf| Ok(buf.len()),
            |chunk| {
                let n = (chunk.capacity() - chunk.len()).min(more).min(7000);
                chunk.extend(std::iter::repeat_n(1u8, n));
                more -= n;
                Ok(n)
            },
        )
        .unwrap()
        .unwrap();
        assert_eq!(data.len(), DATA_CHUNK);
        assert_eq!(read_ready(|_| Ok(0), |_| unreachable!()).unwrap(), None);
        let would_block = read_ready(|_| Err(io::ErrorKind::WouldBlock.into()), |_| unreachable!());
        assert_eq!(would_block.unwrap_err().kind(), io::ErrorKind::WouldBlock);
    }
}
