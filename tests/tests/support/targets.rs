//! Target servers the agent dials, on loopback.

use std::net::SocketAddr;

use sha2::{Digest, Sha256};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use super::Pattern;

const CHUNK: usize = 64 * 1024;

/// A listening target; stops when dropped.
pub struct Target {
    pub addr: SocketAddr,
    task: JoinHandle<()>,
}

impl Drop for Target {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A loopback listener on `ip` (any 127.0.0.0/8 address, or ::1) and a free port,
/// with a backlog for a thousand dials arriving at once: with tokio's
/// default (1024) the kernel falls back to SYN cookies under such a burst
/// and resets some of the connections the agent already has.
pub fn listener_on(ip: std::net::IpAddr) -> TcpListener {
    let socket = match ip {
        std::net::IpAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
        std::net::IpAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
    }
    .unwrap();
    socket.bind(SocketAddr::new(ip, 0)).unwrap();
    socket.listen(4096).unwrap()
}

async fn serve<F, Fut>(handler: F) -> Target
where
    F: Fn(tokio::net::TcpStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    serve_on(listener_on([127, 0, 0, 1].into()), handler)
}

fn serve_on<F, Fut>(listener: TcpListener, handler: F) -> Target
where
    F: Fn(tokio::net::TcpStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        loop {
            match listener.accept().await {
                Ok((stream, _)) => drop(tokio::spawn(handler(stream))),
                // One failed accept (a connection reset while queued, a
                // moment without descriptors) must not close the target.
                Err(error) => {
                    eprintln!("target {addr}: accept failed: {error}");
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
            }
        }
    });
    Target { addr, task }
}

/// An HTTP/1.1 server answering every request with `body`.
pub async fn http(body: &'static str) -> Target {
    serve(move |mut stream| async move {
        let mut head = Vec::new();
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
        let response = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        let _ = stream.write_all(response.as_bytes()).await;
    })
    .await
}

/// A target speaking a tiny test protocol. The client sends one command byte,
/// a length and a seed (8 bytes each, little endian):
/// - `P` push: the client then sends `len` bytes; the target answers with
///   their SHA-256 (the protocol has no half-close, so the length says when
///   the upload is complete);
/// - `G` get: the target sends `len` bytes of [`Pattern`];
/// - `E` echo: the target echoes everything until the client closes;
/// - `R` reset: the target sends `len` bytes of [`Pattern`], waits for one
///   byte from the client (so every byte is known to have arrived), then
///   resets the connection, as a crashing or aborting server would.
pub async fn blob() -> Target {
    blob_on(listener_on([127, 0, 0, 1].into())).await
}

/// [`blob`] on a listener of the caller's choosing.
pub async fn blob_on(listener: TcpListener) -> Target {
    serve_on(listener, |mut stream| async move {
        let mut header = [0u8; 17];
        while stream.read_exact(&mut header).await.is_ok() {
            let len = u64::from_le_bytes(header[1..9].try_into().unwrap());
            let seed = u64::from_le_bytes(header[9..17].try_into().unwrap());
            match header[0] {
                b'P' => {
                    let mut hasher = Sha256::new();
                    let mut buf = vec![0u8; CHUNK];
                    let mut left = len;
                    while left > 0 {
                        let want = left.min(CHUNK as u64) as usize;
                        match stream.read(&mut buf[..want]).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => {
                                hasher.update(&buf[..n]);
                                left -= n as u64;
                            }
                        }
                    }
                    if stream.write_all(&hasher.finalize()).await.is_err() {
                        return;
                    }
                }
                b'G' => {
                    if write_pattern(&mut stream, len, seed).await.is_err() {
                        return;
                    }
                }
                b'R' => {
                    let mut ack = [0u8; 1];
                    if write_pattern(&mut stream, len, seed).await.is_err()
                        || stream.read_exact(&mut ack).await.is_err()
                    {
                        return;
                    }
                    let _ = socket2::SockRef::from(&stream).set_linger(Some(std::time::Duration::ZERO));
                    return;
                }
                b'E' => {
                    let (mut read, mut write) = stream.split();
                    let _ = tokio::io::copy(&mut read, &mut write).await;
                    return;
                }
                _ => return,
            }
        }
    })
}

/// `len` pattern bytes for `seed`, produced in CHUNK-sized pieces (the
/// chunking is part of the pattern, so every producer must use this).
struct PatternChunks {
    pattern: Pattern,
    buf: Vec<u8>,
    left: u64,
}

impl PatternChunks {
    fn new(len: u64, seed: u64) -> Self {
        PatternChunks {
            pattern: Pattern::new(seed),
            buf: vec![0u8; CHUNK],
            left: len,
        }
    }

    fn next_chunk(&mut self) -> Option<&[u8]> {
        if self.left == 0 {
            return None;
        }
        let n = self.left.min(CHUNK as u64) as usize;
        self.left -= n as u64;
        self.pattern.fill(&mut self.buf[..n]);
        Some(&self.buf[..n])
    }
}

/// Writes `len` bytes of the pattern for `seed`, returning their SHA-256.
pub async fn write_pattern<S: AsyncWrite + Unpin>(
    stream: &mut S,
    len: u64,
    seed: u64,
) -> std::io::Result<[u8; 32]> {
    let mut chunks = PatternChunks::new(len, seed);
    let mut hasher = Sha256::new();
    while let Some(chunk) = chunks.next_chunk() {
        hasher.update(chunk);
        stream.write_all(chunk).await?;
    }
    stream.flush().await?;
    Ok(hasher.finalize().into())
}

/// The SHA-256 of `len` pattern bytes for `seed`, as [`write_pattern`] sends them.
pub fn pattern_digest(len: u64, seed: u64) -> [u8; 32] {
    let mut chunks = PatternChunks::new(len, seed);
    let mut hasher = Sha256::new();
    while let Some(chunk) = chunks.next_chunk() {
        hasher.update(chunk);
    }
    hasher.finalize().into()
}

pub fn header(command: u8, len: u64, seed: u64) -> [u8; 17] {
    let mut header = [0u8; 17];
    header[0] = command;
    header[1..9].copy_from_slice(&len.to_le_bytes());
    header[9..17].copy_from_slice(&seed.to_le_bytes());
    header
}

/// Pushes `len` bytes; returns (digest sent, digest the target computed).
pub async fn push<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    len: u64,
    seed: u64,
) -> std::io::Result<([u8; 32], [u8; 32])> {
    let sent = push_without_reply(stream, len, seed).await?;
    let mut received = [0u8; 32];
    stream.read_exact(&mut received).await?;
    Ok((sent, received))
}

/// Sends a push of `len` bytes without waiting for the target's digest;
/// returns the digest of what was sent.
pub async fn push_without_reply<S: AsyncWrite + Unpin>(
    stream: &mut S,
    len: u64,
    seed: u64,
) -> std::io::Result<[u8; 32]> {
    stream.write_all(&header(b'P', len, seed)).await?;
    write_pattern(stream, len, seed).await
}

/// Pulls `len` bytes; returns the digest of what arrived. An early end of
/// stream is an error, so a short transfer cannot pass.
pub async fn pull<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    len: u64,
    seed: u64,
) -> std::io::Result<[u8; 32]> {
    request_pull(stream, len, seed).await?;
    read_digest(stream, len).await
}

/// Reads exactly `len` bytes and returns their SHA-256; an early end of
/// stream is an error.
pub async fn read_digest<S: AsyncRead + Unpin>(stream: &mut S, len: u64) -> std::io::Result<[u8; 32]> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; CHUNK];
    let mut left = len;
    while left > 0 {
        let want = left.min(CHUNK as u64) as usize;
        let n = stream.read(&mut buf[..want]).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        hasher.update(&buf[..n]);
        left -= n as u64;
    }
    Ok(hasher.finalize().into())
}

/// Asks the target to send `len` pattern bytes, without reading them.
pub async fn request_pull<S: AsyncWrite + Unpin>(stream: &mut S, len: u64, seed: u64) -> std::io::Result<()> {
    stream.write_all(&header(b'G', len, seed)).await
}

/// Asks the target to send `len` pattern bytes and reset the connection
/// once the client sends a byte.
pub async fn request_reset<S: AsyncWrite + Unpin>(
    stream: &mut S,
    len: u64,
    seed: u64,
) -> std::io::Result<()> {
    stream.write_all(&header(b'R', len, seed)).await
}

/// Reads the `len` bytes of a [`request_reset`], acknowledges them and
/// returns how the stream ends after that: `Ok(())` for a clean end of
/// stream (wrong: a reset must not look like one), or the read's error.
pub async fn read_until_reset<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    len: u64,
    seed: u64,
) -> std::io::Result<()> {
    assert_eq!(read_digest(stream, len).await?, pattern_digest(len, seed));
    stream.write_all(b"k").await?;
    let mut rest = Vec::new();
    stream.read_to_end(&mut rest).await?;
    assert!(rest.is_empty(), "{} bytes after the pattern", rest.len());
    Ok(())
}

/// A whole [`request_reset`] exchange: returns the error the read ends
/// with; panics if it ends cleanly or hangs.
pub async fn expect_reset<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    len: u64,
    seed: u64,
) -> std::io::Error {
    request_reset(stream, len, seed).await.unwrap();
    tokio::time::timeout(
        std::time::Duration::from_secs(10),
        read_until_reset(stream, len, seed),
    )
    .await
    .expect("the reset must end the read promptly")
    .expect_err("a reset target must fail the read, not end it cleanly")
}

/// Starts an echo exchange.
pub async fn start_echo<S: AsyncWrite + Unpin>(stream: &mut S) -> std::io::Result<()> {
    stream.write_all(&header(b'E', 0, 0)).await
}

/// A long-lived connection through the node agent: numbered lines through
/// the echo target, one every 10 ms, each read back before the next (as
/// `kubectl logs -f` or a watch would see them: every line once, in order).
/// Runs until `stop`; when each line was sent and how long it took to come
/// back, or what broke.
pub async fn numbered_lines(
    mut stream: impl AsyncRead + AsyncWrite + Unpin,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> Result<Vec<(std::time::Instant, std::time::Duration)>, String> {
    use tokio::io::{AsyncBufReadExt, BufReader};
    stream
        .write_all(&header(b'E', 0, 0))
        .await
        .map_err(|e| e.to_string())?;
    let (read, mut write) = tokio::io::split(stream);
    let mut lines = BufReader::new(read).lines();
    let mut round_trips = Vec::new();
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let sent = round_trips.len();
        let started = std::time::Instant::now();
        write
            .write_all(format!("line {sent}\n").as_bytes())
            .await
            .map_err(|e| format!("writing line {sent}: {e}"))?;
        let line = tokio::time::timeout(std::time::Duration::from_secs(10), lines.next_line())
            .await
            .map_err(|_| format!("line {sent} did not come back within 10 s"))?
            .map_err(|e| format!("reading line {sent}: {e}"))?
            .ok_or_else(|| format!("the connection ended at line {sent}"))?;
        if line != format!("line {sent}") {
            return Err(format!(
                "line {sent} came back as {line:?}: a line missing, doubled or out of order"
            ));
        }
        round_trips.push((started, started.elapsed()));
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    Ok(round_trips)
}

/// For each replacement (when it began and ended) and connection (when each
/// line was sent, and its round trip), the longest round trip of a line sent
/// while the replacement ran: the pause the hand-over cost the connection.
pub fn pauses_during(
    replacing: &[(std::time::Instant, std::time::Instant)],
    round_trips: &[Vec<(std::time::Instant, std::time::Duration)>],
) -> Vec<std::time::Duration> {
    let mut pauses = Vec::new();
    for (began, ended) in replacing {
        for lines in round_trips {
            let longest = lines
                .iter()
                .filter(|(at, _)| at >= began && at <= ended)
                .map(|(_, took)| *took)
                .max();
            pauses.extend(longest);
        }
    }
    pauses
}

/// Line-by-line connections ([`numbered_lines`]), told to stop.
pub type Lines = JoinHandle<Result<Vec<(std::time::Instant, std::time::Duration)>, String>>;

/// Waits for each of `connections` (told to stop): the lines of each, or a
/// panic naming the one that broke, and `context` (what happened meanwhile).
pub async fn lines_of(
    connections: Vec<Lines>,
    context: &str,
) -> Vec<Vec<(std::time::Instant, std::time::Duration)>> {
    let mut lines = Vec::new();
    for (i, connection) in connections.into_iter().enumerate() {
        match connection.await.unwrap() {
            Ok(sent) => lines.push(sent),
            Err(broke) => panic!("long-lived connection {i}: {broke}\n{context}"),
        }
    }
    lines
}
