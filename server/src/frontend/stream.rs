//! The byte streams frontends serve, over a Unix socket or TCP with TLS, and
//! how a tunnel reads them: in chunks, without a buffer while it waits.

use std::future::Future;
use std::io;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::FutureExt;
use konnectivity_mux::chunk::{SMALL_READ, packet};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadHalf, WriteHalf};
use tokio::net::{TcpStream, UnixStream, tcp, unix};
use tokio_rustls::server::TlsStream;

/// A frontend connection, split into the halves a tunnel pumps. When the
/// tunnel breaks (the agent vanished) it is aborted: the client must see
/// an error rather than a clean end of stream it could mistake for a
/// complete response.
pub(crate) trait FrontendStream: AsyncRead + AsyncWrite + Unpin + Send + 'static {
    type Reader: ChunkReader;
    type Writer: AsyncWrite + Unpin + Send;

    fn into_halves(self) -> (Self::Reader, Self::Writer);

    /// Ends the connection with a TCP reset (a Unix socket has none: the
    /// peer sees end of stream).
    fn abort(reader: Self::Reader, writer: Self::Writer);
}

/// Reads a connection in chunks, `None` at end of stream.
pub(crate) trait ChunkReader: Send + Unpin {
    fn read_chunk(&mut self) -> impl Future<Output = io::Result<Option<Bytes>>> + Send;
}

/// A socket half that reads what is ready now, without waiting.
trait TryRead {
    fn try_read(&self, buf: &mut [u8]) -> io::Result<usize>;
    fn try_read_buf(&self, buf: &mut BytesMut) -> io::Result<usize>;
}

/// Reads what is ready now, through a small buffer on the stack of this
/// call rather than in the waiting task.
fn read_ready(half: &impl TryRead) -> io::Result<Option<Bytes>> {
    konnectivity_mux::chunk::read_ready(|first| half.try_read(first), |chunk| half.try_read_buf(chunk))
}

/// An idle tunnel on a socket whose readiness tokio tracks waits for
/// readiness alone, holding no buffer.
macro_rules! read_when_ready {
    ($half:ty) => {
        impl TryRead for $half {
            fn try_read(&self, buf: &mut [u8]) -> io::Result<usize> {
                <$half>::try_read(self, buf)
            }
            fn try_read_buf(&self, buf: &mut BytesMut) -> io::Result<usize> {
                <$half>::try_read_buf(self, buf)
            }
        }

        impl ChunkReader for $half {
            async fn read_chunk(&mut self) -> io::Result<Option<Bytes>> {
                loop {
                    self.readable().await?;
                    match read_ready(self) {
                        Err(error) if error.kind() == io::ErrorKind::WouldBlock => continue,
                        result => return result,
                    }
                }
            }
        }
    };
}

read_when_ready!(unix::OwnedReadHalf);
read_when_ready!(tcp::OwnedReadHalf);

fn reset_on_drop(stream: &TcpStream) {
    let _ = socket2::SockRef::from(stream).set_linger(Some(Duration::ZERO));
}

impl FrontendStream for UnixStream {
    type Reader = unix::OwnedReadHalf;
    type Writer = unix::OwnedWriteHalf;

    fn into_halves(self) -> (Self::Reader, Self::Writer) {
        self.into_split()
    }

    fn abort(_reader: Self::Reader, _writer: Self::Writer) {}
}

impl FrontendStream for TcpStream {
    type Reader = tcp::OwnedReadHalf;
    type Writer = tcp::OwnedWriteHalf;

    fn into_halves(self) -> (Self::Reader, Self::Writer) {
        self.into_split()
    }

    fn abort(reader: Self::Reader, writer: Self::Writer) {
        if let Ok(stream) = reader.reunite(writer) {
            reset_on_drop(&stream);
        }
    }
}

/// TLS hides readiness behind rustls' own buffer, so a TLS tunnel waits
/// with its small buffer in the task: the first read waits, the rest take
/// only what is ready.
impl ChunkReader for ReadHalf<TlsStream<TcpStream>> {
    async fn read_chunk(&mut self) -> io::Result<Option<Bytes>> {
        let mut first = [0u8; SMALL_READ];
        let n = self.read(&mut first).await?;
        Ok(packet(&first[..n], |chunk| {
            match self.read_buf(chunk).now_or_never() {
                Some(Ok(read)) => read,
                _ => 0,
            }
        }))
    }
}

impl FrontendStream for TlsStream<TcpStream> {
    type Reader = ReadHalf<TlsStream<TcpStream>>;
    type Writer = WriteHalf<TlsStream<TcpStream>>;

    fn into_halves(self) -> (Self::Reader, Self::Writer) {
        tokio::io::split(self)
    }

    fn abort(reader: Self::Reader, writer: Self::Writer) {
        reset_on_drop(reader.unsplit(writer).get_ref().0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use konnectivity_proto::DATA_CHUNK;
    use tokio::io::AsyncWriteExt;

    #[tokio::test]
    async fn chunks_keep_every_byte_and_bulk_travels_in_large_packets() {
        let (client, server) = UnixStream::pair().unwrap();
        let (mut reader, _writer) = server.into_halves();
        let (_, mut client) = client.into_split();
        // A small write comes out as a packet of exactly its size.
        client.write_all(b"ping").await.unwrap();
        assert_eq!(reader.read_chunk().await.unwrap().unwrap(), &b"ping"[..]);

        let data: Vec<u8> = (0..3 * DATA_CHUNK + 123).map(|i| (i % 251) as u8).collect();
        let writer = tokio::spawn(async move {
            client.write_all(&data).await.unwrap();
            data
        });
        let mut received = Vec::new();
        let mut packets = 0;
        while received.len() < 3 * DATA_CHUNK + 123 {
            let chunk = reader.read_chunk().await.unwrap().unwrap();
            assert!(chunk.len() <= DATA_CHUNK);
            received.extend_from_slice(&chunk);
            packets += 1;
        }
        let data = writer.await.unwrap();
        assert_eq!(received, data);
        // The writer ended: the reader sees end of stream.
        assert_eq!(reader.read_chunk().await.unwrap(), None);
        // A socket buffer holds a few hundred KiB at most, so the reader
        // may see the bytes in more reads than DATA_CHUNKs; bulk must not
        // travel in small ones.
        assert!(
            received.len() / packets >= 32 * 1024,
            "{packets} packets for {} bytes",
            received.len()
        );
    }
}
