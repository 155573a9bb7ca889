//! Watches as kube-apiserver serves them and node clients hold them, for the
//! cluster scale run: a stand-in that streams a small JSON event on every
//! watch at random intervals (exponential, mean as the client asks), each
//! stamped with the moment it was written; and a client that holds one
//! watch, measures each event's delay, and watches again when its
//! connection ends, as client-go's reflector does.

use std::net::SocketAddr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

/// Now on the machine's monotonic clock, in nanoseconds: the same clock in
/// every process, so that a stamp written by the stand-in is comparable
/// with the moment a client reads it.
pub fn now_ns() -> u64 {
    let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).expect("a monotonic clock");
    now.tv_sec() as u64 * 1_000_000_000 + now.tv_nsec() as u64
}

/// A small generator for the intervals (xorshift64*): nothing here needs
/// more, and every watch has its own.
struct Intervals(u64);

impl Intervals {
    fn next_unit(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let value = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d);
        // In (0, 1]: a logarithm of it is finite.
        ((value >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    }

    /// The next wait of a Poisson process with mean `mean`.
    fn next(&mut self, mean: Duration) -> Duration {
        mean.mul_f64(-self.next_unit().ln()).min(mean * 20)
    }
}

/// The stand-in kube-apiserver: serves watches on `addr` until killed.
/// Prints `ready` once it listens.
pub async fn serve(addr: SocketAddr) -> anyhow::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    println!("ready");
    let mut seed = now_ns() | 1;
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                eprintln!("accept: {error}");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        tokio::spawn(serve_watch(stream, Intervals(seed | 1)));
    }
}

/// One watch: the request (`WATCH <mean interval in ms>`), then an event at
/// once (the watch is established) and one after each random interval.
async fn serve_watch(stream: TcpStream, mut intervals: Intervals) {
    let _ = stream.set_nodelay(true);
    let (read, mut write) = stream.into_split();
    let mut request = String::new();
    if BufReader::new(read).read_line(&mut request).await.is_err() {
        return;
    }
    let Some(mean) = request
        .strip_prefix("WATCH ")
        .and_then(|ms| ms.trim().parse::<u64>().ok())
        .map(Duration::from_millis)
    else {
        return;
    };
    let mut version = 0u64;
    loop {
        version += 1;
        let event = format!(
            "{{\"type\":\"MODIFIED\",\"object\":{{\"kind\":\"ConfigMap\",\"apiVersion\":\"v1\",\"metadata\":\
             {{\"name\":\"bench\",\"namespace\":\"kube-system\",\"resourceVersion\":\"{version}\"}},\
             \"data\":{{\"sent\":\"{}\"}}}}}}\n",
            now_ns()
        );
        if write.write_all(event.as_bytes()).await.is_err() {
            return;
        }
        tokio::time::sleep(intervals.next(mean)).await;
    }
}

/// What a set of watch clients saw.
#[derive(Default)]
pub struct WatchStats {
    /// Watches established now.
    pub up: AtomicUsize,
    /// Watches asked for more than [`STUCK_AFTER`] ago and neither answered
    /// nor ended: hangs, not clients in backoff.
    pub stuck: AtomicUsize,
    /// Watches established, ever (first and again).
    pub established: AtomicU64,
    /// Watches whose connection ended.
    pub broken: AtomicU64,
    /// Each event's delay, in microseconds, since the last reset.
    samples: Mutex<Vec<u32>>,
}

impl WatchStats {
    fn sample(&self, delay_ns: u64) {
        let micros = (delay_ns / 1000).min(u32::MAX as u64) as u32;
        self.samples.lock().unwrap().push(micros);
    }

    /// The delays so far, emptied.
    pub fn take_samples(&self) -> Vec<u32> {
        std::mem::take(&mut *self.samples.lock().unwrap())
    }
}

/// Holds a watch through `addr` with events every `mean` on average,
/// watching again whenever the connection ends, after client-go's
/// reflector's backoff ([`ReflectorBackoff`]). Runs until the task is
/// dropped.
pub async fn hold(addr: SocketAddr, mean: Duration, stats: std::sync::Arc<WatchStats>) {
    let mut backoff = ReflectorBackoff::new(Intervals(now_ns() | 1));
    loop {
        if let Ok(stream) = TcpStream::connect(addr).await {
            let _ = stream.set_nodelay(true);
            watch_once(stream, mean, &stats).await;
        }
        tokio::time::sleep(backoff.next()).await;
    }
}

/// How long client-go's reflector waits before it lists and watches again
/// after a watch ended: `wait.NewExponentialBackoffManager(800ms, 30s, 2m,
/// 2.0, 1.0)`, an exponential backoff from 800 ms doubling to 30 s, each
/// wait stretched by up to as much again at random, and back to 800 ms once
/// two minutes passed since the last wait began. (A fixed second, which this
/// run used first, had 50,000 clients retrying twice a second against node
/// agents whose tunnels were still coming back after a server restart: load
/// no kubelet makes.)
struct ReflectorBackoff {
    random: Intervals,
    next: Duration,
    last: Option<Instant>,
}

impl ReflectorBackoff {
    const INITIAL: Duration = Duration::from_millis(800);
    const CAP: Duration = Duration::from_secs(30);
    const RESET_AFTER: Duration = Duration::from_secs(120);

    fn new(random: Intervals) -> ReflectorBackoff {
        ReflectorBackoff {
            random,
            next: Self::INITIAL,
            last: None,
        }
    }

    fn next(&mut self) -> Duration {
        if self.last.is_some_and(|last| last.elapsed() > Self::RESET_AFTER) {
            self.next = Self::INITIAL;
        }
        self.last = Some(Instant::now());
        let wait = self.next.mul_f64(1.0 + self.random.next_unit());
        self.next = (self.next * 2).min(Self::CAP);
        wait
    }
}

async fn watch_once(mut stream: TcpStream, mean: Duration, stats: &WatchStats) {
    let request = format!("WATCH {}\n", mean.as_millis());
    if stream.write_all(request.as_bytes()).await.is_err() {
        return;
    }
    let mut lines = BufReader::new(stream).lines();
    // The answer (the watch's first line); counted as stuck while it is
    // late. (`next_line` is cancel safe: nothing read is lost to the timeout.)
    let answer = match tokio::time::timeout(STUCK_AFTER, lines.next_line()).await {
        Ok(answer) => answer,
        Err(_) => {
            stats.stuck.fetch_add(1, Ordering::Relaxed);
            let answer = lines.next_line().await;
            stats.stuck.fetch_sub(1, Ordering::Relaxed);
            answer
        }
    };
    if !matches!(answer, Ok(Some(_))) {
        return;
    }
    stats.up.fetch_add(1, Ordering::Relaxed);
    stats.established.fetch_add(1, Ordering::Relaxed);
    while let Ok(Some(line)) = lines.next_line().await {
        let received = now_ns();
        if let Some(sent) = sent_stamp(&line) {
            stats.sample(received.saturating_sub(sent));
        }
    }
    stats.up.fetch_sub(1, Ordering::Relaxed);
    stats.broken.fetch_add(1, Ordering::Relaxed);
}

/// How long a watch waits for its answer before it counts as stuck: well
/// past the node agent's 10 s bound on a dial, after which the client is
/// reset and watches again.
pub(crate) const STUCK_AFTER: Duration = Duration::from_secs(30);

/// The stamp in an event's `"sent":"…"`.
fn sent_stamp(line: &str) -> Option<u64> {
    let start = line.find("\"sent\":\"")? + 8;
    let rest = &line[start..];
    rest[..rest.find('"')?].parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 0.8–1.6 s, then doubling within its jitter up to 30–60 s.
    #[test]
    fn the_reflector_backoff_doubles_from_800_ms_to_30_s() {
        let mut backoff = ReflectorBackoff::new(Intervals(7));
        let waits: Vec<Duration> = (0..9).map(|_| backoff.next()).collect();
        for (n, wait) in waits.iter().enumerate() {
            let base = ReflectorBackoff::INITIAL
                .mul_f64(2f64.powi(n as i32))
                .min(ReflectorBackoff::CAP);
            assert!(
                *wait >= base && *wait <= base * 2,
                "wait {n}: {wait:?} not in [{base:?}, {:?}]",
                base * 2
            );
        }
    }

    #[test]
    fn intervals_average_their_mean() {
        let mut intervals = Intervals(12345);
        let mean = Duration::from_millis(100);
        let total: Duration = (0..20_000).map(|_| intervals.next(mean)).sum();
        let average = total / 20_000;
        assert!(
            average > Duration::from_millis(95) && average < Duration::from_millis(105),
            "{average:?}"
        );
    }

    #[test]
    fn the_stamp_is_read_back() {
        assert_eq!(sent_stamp(r#"{"data":{"sent":"123456"}}"#), Some(123456));
        assert_eq!(sent_stamp(r#"{"data":{}}"#), None);
    }
}
