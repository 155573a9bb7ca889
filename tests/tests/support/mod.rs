//! Fixtures shared by the integration tests: certificates, the real
//! binaries as child processes, CONNECT clients, target servers and
//! metric scraping. Everything is on loopback and cleans up on drop.

#![allow(dead_code)]

pub mod balancer;
pub mod certs;
pub mod cluster;
pub mod connect;
pub mod containerd;
pub mod cri_node;
pub mod foreign;
pub mod grpc;
pub mod h2_raw;
pub mod image;
pub mod kas;
/// The stand-in kube-apiserver, a crate of its own: the scale run uses it too.
pub use konnectivity_kube_standin as kube_api;
pub mod load;
pub mod netns;
pub mod procs;
pub mod routing;
pub mod scrape;
pub mod split;
pub mod targets;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// A directory removed when dropped, also when the test panics.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(prefix: &str) -> TempDir {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let path = std::env::temp_dir().join(format!(
            "{prefix}-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&path).expect("create temp dir");
        TempDir(path)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    /// Removes the directory, except when a test is failing: then its
    /// processes' logs (and certificates, configs) are kept for a look, and
    /// the processes, which may be dropped after this, can still print them.
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("kept {} (the test failed)", self.0.display());
            return;
        }
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A port that is free now, in the range the binaries accept (1024-49151)
/// and below the kernel's ephemeral range (32768+), so outgoing connections
/// cannot take it in the meantime. Tests in one process share a counter so
/// they never pick the same one; processes start at different offsets.
pub fn free_port() -> u16 {
    const FIRST: u32 = 20000;
    const SPAN: u32 = 12000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let start = (std::process::id() % 600) * 20;
    for _ in 0..SPAN {
        let offset = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = (FIRST + (start + offset) % SPAN) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok()
            && std::net::TcpListener::bind(("0.0.0.0", port)).is_ok()
        {
            return port;
        }
    }
    panic!("no free port in {FIRST}-{}", FIRST + SPAN);
}

/// Polls `check` every 50 ms until it returns true; panics naming `what`
/// after `limit`.
pub async fn wait_until<F, Fut>(limit: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    loop {
        if check().await {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Polls `check` (done?, value) until done or `limit`; returns the last value.
pub async fn wait_until_or_last<F, Fut, T>(limit: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = (bool, T)>,
{
    let deadline = Instant::now() + limit;
    loop {
        let (done, value) = check().await;
        if done || Instant::now() >= deadline {
            return value;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Deterministic pseudo-random bytes (xorshift), so both ends of a transfer
/// can produce and check the same stream without storing it.
pub struct Pattern(u64);

impl Pattern {
    pub fn new(seed: u64) -> Self {
        Pattern(seed | 1)
    }

    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let mut x = self.0;
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            self.0 = x;
            chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
        }
    }
}
