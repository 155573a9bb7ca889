//! The measurements, each run against one route. They only use the public
//! behaviour of a connection: bytes in, bytes out, open, close.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Semaphore;

use crate::route::{Conn, Route};
use crate::stack::Stack;
use crate::targets::Targets;

/// Size of each write in bulk transfers: what a busy client hands the kernel.
const WRITE_SIZE: usize = 256 * 1024;

/// Pushes `bytes` to the sink target over `conn` and waits until the sink
/// confirms it read every one of them; `moved` counts what was written.
async fn push(conn: &mut dyn Conn, bytes: u64, moved: &AtomicU64) -> anyhow::Result<()> {
    let chunk = vec![0xa5_u8; WRITE_SIZE];
    conn.write_all(&bytes.to_be_bytes()).await?;
    let mut left = bytes;
    while left > 0 {
        let n = chunk.len().min(left as usize);
        conn.write_all(&chunk[..n]).await?;
        moved.fetch_add(n as u64, Ordering::Relaxed);
        left -= n as u64;
    }
    conn.flush().await?;
    let mut ack = [0u8; 8];
    conn.read_exact(&mut ack)
        .await
        .context("reading the sink's ack")?;
    if u64::from_be_bytes(ack) != bytes {
        bail!("sink acknowledged {} bytes, not {bytes}", u64::from_be_bytes(ack));
    }
    Ok(())
}

/// Bytes per second of one connection pushing `bytes`.
pub async fn throughput_one(route: &Route, targets: &Targets, bytes: u64) -> anyhow::Result<f64> {
    let mut conn = route.open(targets.sink).await?;
    let started = Instant::now();
    push(&mut *conn, bytes, &AtomicU64::new(0)).await?;
    Ok(bytes as f64 / started.elapsed().as_secs_f64())
}

/// Bytes per second of one connection reading `bytes` from the source
/// target (which writes without end): the download direction.
pub async fn throughput_down(route: &Route, targets: &Targets, bytes: u64) -> anyhow::Result<f64> {
    let mut conn = route.open(targets.source).await?;
    let mut buffer = vec![0u8; WRITE_SIZE];
    let started = Instant::now();
    let mut left = bytes;
    while left > 0 {
        let want = buffer.len().min(left as usize);
        match conn.read(&mut buffer[..want]).await? {
            0 => bail!("the source ended with {left} bytes still to read"),
            n => left -= n as u64,
        }
    }
    Ok(bytes as f64 / started.elapsed().as_secs_f64())
}

/// Aggregate bytes per second of `streams` connections pushing
/// `bytes / streams` each at once.
pub async fn throughput_parallel(
    route: &Route,
    targets: &Targets,
    bytes: u64,
    streams: usize,
) -> anyhow::Result<f64> {
    let mut conns = Vec::new();
    for _ in 0..streams {
        conns.push(route.open(targets.sink).await?);
    }
    let each = bytes / streams as u64;
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for mut conn in conns {
        tasks.spawn(async move { push(&mut *conn, each, &AtomicU64::new(0)).await });
    }
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    Ok((each * streams as u64) as f64 / started.elapsed().as_secs_f64())
}

/// Round trips of `size`-byte messages on one warm connection to the echo
/// target; the first tenth warms up and is not counted.
pub async fn round_trips(
    route: &Route,
    targets: &Targets,
    size: usize,
    count: usize,
) -> anyhow::Result<Vec<Duration>> {
    let mut conn = route.open(targets.echo).await?;
    let message = vec![0x3c_u8; size];
    let mut answer = vec![0u8; size];
    let warm_up = count / 10;
    let mut samples = Vec::with_capacity(count);
    for i in 0..warm_up + count {
        let started = Instant::now();
        conn.write_all(&message).await?;
        conn.read_exact(&mut answer).await?;
        if i >= warm_up {
            samples.push(started.elapsed());
        }
    }
    if answer != message {
        bail!("echo returned different bytes");
    }
    Ok(samples)
}

/// Runs `count` jobs, `concurrency` at a time, and collects their results.
pub async fn concurrently<T, F, Fut>(count: usize, concurrency: usize, job: F) -> anyhow::Result<Vec<T>>
where
    F: Fn() -> Fut,
    Fut: Future<Output = anyhow::Result<T>> + Send + 'static,
    T: Send + 'static,
{
    let permits = Arc::new(Semaphore::new(concurrency));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..count {
        let permit = permits.clone().acquire_owned().await?;
        let run = job();
        tasks.spawn(async move {
            let _permit = permit;
            run.await
        });
    }
    let mut results = Vec::with_capacity(count);
    while let Some(done) = tasks.join_next().await {
        results.push(done??);
    }
    Ok(results)
}

/// Connection set-up: `total` connections opened (the tunnel's dial
/// included) and closed, `concurrency` at a time. Returns connections per
/// second and each open's latency.
pub async fn setups(
    route: &Route,
    targets: &Targets,
    total: usize,
    concurrency: usize,
) -> anyhow::Result<(f64, Vec<Duration>)> {
    let started = Instant::now();
    let latencies = concurrently(total, concurrency, || {
        let (route, echo) = (route.clone(), targets.echo);
        async move {
            let opened = Instant::now();
            let conn = route.open(echo).await?;
            let latency = opened.elapsed();
            drop(conn);
            Ok(latency)
        }
    })
    .await?;
    Ok((total as f64 / started.elapsed().as_secs_f64(), latencies))
}

/// Resident memory of server and agent per idle tunneled connection: the
/// growth while `count` connections to the echo target are held open.
pub async fn memory_per_connection(
    stack: &Stack,
    route: &Route,
    targets: &Targets,
    count: usize,
) -> anyhow::Result<f64> {
    // Warm up first, so that one-time allocations are not counted.
    drop(setups(route, targets, 200, 16).await?);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = stack.resident_bytes()?;
    let mut held = concurrently(count, 64, || {
        let (route, echo) = (route.clone(), targets.echo);
        async move { route.open(echo).await }
    })
    .await?;
    // Prove they are live end to end, then let the processes settle.
    for conn in held.iter_mut().step_by(count / 10 + 1) {
        conn.write_all(b"x").await?;
        let mut byte = [0u8; 1];
        conn.read_exact(&mut byte).await?;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = stack.resident_bytes()?;
    drop(held);
    let per_connection = |after: u64, before: u64| after.saturating_sub(before) as f64 / count as f64;
    let (server, agent) = (
        per_connection(after.0, before.0),
        per_connection(after.1, before.1),
    );
    eprintln!(
        "   per idle connection: server {:.1} KiB, agent {:.1} KiB",
        server / 1024.0,
        agent / 1024.0
    );
    Ok(server + agent)
}

/// What the other connection achieved while one on the same agent stream
/// stalled.
pub struct StallResult {
    /// Bytes per second, or `None` when the transfer did not finish in time.
    pub throughput: Option<f64>,
    pub moved: u64,
}

/// One connection stops reading (its target keeps sending), another one's
/// target stops reading (its client keeps sending); meanwhile a third
/// connection on the same agent stream pushes `bytes` to the sink.
pub async fn beside_stalled(
    route: &Route,
    targets: &Targets,
    bytes: u64,
    limit: Duration,
) -> anyhow::Result<StallResult> {
    let unread = route.open(targets.source).await?;
    let mut unwritable = route.open(targets.blackhole).await?;
    let writer = tokio::spawn(async move {
        let chunk = vec![0u8; WRITE_SIZE];
        while unwritable.write_all(&chunk).await.is_ok() {}
    });
    // Give both time to fill every buffer between them and their peers.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let moved = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let transfer = async {
        // The dial itself crosses the shared agent stream, so it is timed too.
        let mut conn = route.open(targets.sink).await?;
        push(&mut *conn, bytes, &moved).await
    };
    let outcome = tokio::time::timeout(limit, transfer).await;
    writer.abort();
    drop(unread);
    let moved = moved.load(Ordering::Relaxed);
    match outcome {
        Ok(result) => {
            result?;
            Ok(StallResult {
                throughput: Some(bytes as f64 / started.elapsed().as_secs_f64()),
                moved,
            })
        }
        Err(_) => Ok(StallResult {
            throughput: None,
            moved,
        }),
    }
}

/// Figures of the kinds the table reports.
pub fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort_unstable();
    let index = ((samples.len() as f64 - 1.0) * p).round() as usize;
    samples[index.min(samples.len() - 1)]
}

pub fn median(values: &mut [f64]) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    values[values.len() / 2]
}
