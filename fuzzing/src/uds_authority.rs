//! The Unix-socket listener's HTTP/2 layer (`TolerantAuthority`), fed the
//! client's side of a connection in reads of a size the input chooses.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use konnectivity_server::hooks::TolerantAuthority;
use tokio::io::{AsyncRead, AsyncReadExt, ReadBuf};

/// The input's first byte is the read size (1 to 256 bytes), the rest the
/// bytes a client writes. Whatever they are, what h2 receives does not
/// depend on where reads end, and nothing is lost: a stream the layer
/// cannot rewrite reaches h2 as it came, and when the client leaves
/// mid-frame h2 still sees every byte it sent.
pub fn uds_authority(data: &[u8]) {
    let Some((&step, stream)) = data.split_first() else {
        return;
    };
    let whole = through_layer(stream, stream.len().max(1), 64 * 1024);
    let split = through_layer(stream, usize::from(step) + 1, usize::from(step % 32) + 1);
    assert_eq!(whole, split, "the output depends on how reads split the input");
    // Every byte after the 24-byte preface belongs to a frame; the layer
    // only rewrites header blocks, so a stream without any passes as it is.
    let has_header_block = frame_kinds(stream).any(|kind| kind == 0x1 || kind == 0x9);
    if !has_header_block {
        assert_eq!(whole, stream, "frames other than header blocks pass unchanged");
    }
}

/// What h2 reads from the layer when the client's bytes arrive `step` at a
/// time and h2 reads into a buffer of `capacity` bytes.
fn through_layer(stream: &[u8], step: usize, capacity: usize) -> Vec<u8> {
    let mut layer = TolerantAuthority::new(Chunked { rest: stream, step });
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let mut out = Vec::new();
        let mut buf = vec![0u8; capacity];
        loop {
            let n = layer.read(&mut buf).await.expect("in-memory reads do not fail");
            if n == 0 {
                return out;
            }
            out.extend_from_slice(&buf[..n]);
        }
    })
}

/// The frame types in `stream` after the preface, as far as headers parse.
fn frame_kinds(stream: &[u8]) -> impl Iterator<Item = u8> + '_ {
    let mut at = 24;
    std::iter::from_fn(move || {
        let header = stream.get(at..at + 9)?;
        let length = usize::from(header[0]) << 16 | usize::from(header[1]) << 8 | usize::from(header[2]);
        at += 9 + length;
        Some(header[3])
    })
}

/// An in-memory client that delivers at most `step` bytes a read.
struct Chunked<'a> {
    rest: &'a [u8],
    step: usize,
}

impl AsyncRead for Chunked<'_> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let n = self.step.min(self.rest.len()).min(buf.remaining());
        let (now, later) = self.rest.split_at(n);
        buf.put_slice(now);
        self.rest = later;
        Poll::Ready(Ok(()))
    }
}
