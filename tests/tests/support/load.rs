//! A steady load of short HTTPS requests from inside a network namespace,
//! as a node's or a pod's clients make them (kubelet's lease renewals, a
//! controller's GETs): a new TCP connection, a TLS handshake and one request
//! per attempt, at a fixed rate. Each attempt is recorded with when it
//! started, how long it took and how it ended, so a test can say which
//! failed, when, and whether a failure was an immediate refusal or a hang.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How long one attempt may take before it counts as hung.
pub const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(5);

/// One attempt.
#[derive(Debug, Clone)]
pub struct Attempt {
    /// Since the load started.
    pub started: Duration,
    pub took: Duration,
    /// `Err` says what failed.
    pub outcome: Result<(), String>,
}

/// A load running on a thread of its own (which entered the namespace).
pub struct Load {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Vec<Attempt>>>,
    pub began: Instant,
}

/// Where the load goes and how often.
pub struct Target {
    /// The namespace the clients run in (a pin or `/proc/PID/ns/net`).
    pub netns: PathBuf,
    pub addr: SocketAddr,
    /// The name the server's certificate is checked against.
    pub server_name: String,
    pub tls: Arc<rustls::ClientConfig>,
    /// What a good answer's body contains.
    pub expect: String,
    pub per_second: u32,
    /// The load stops by itself after this long at most.
    pub limit: Duration,
}

impl Load {
    pub fn start(target: Target) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let began = Instant::now();
        let thread = std::thread::spawn(move || {
            let netns = std::fs::File::open(&target.netns)
                .unwrap_or_else(|e| panic!("{}: {e}", target.netns.display()));
            nix::sched::setns(&netns, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(run(target, stopping, began))
        });
        Load {
            stop,
            thread: Some(thread),
            began,
        }
    }

    /// Stops starting attempts, waits for those under way, and returns all.
    pub fn finish(mut self) -> Vec<Attempt> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().unwrap().join().unwrap()
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

async fn run(target: Target, stop: Arc<AtomicBool>, began: Instant) -> Vec<Attempt> {
    let target = Arc::new(target);
    let mut tick = tokio::time::interval(Duration::from_secs(1) / target.per_second);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut attempts = tokio::task::JoinSet::new();
    while !stop.load(Ordering::Relaxed) && began.elapsed() < target.limit {
        tick.tick().await;
        let target = target.clone();
        attempts.spawn(async move {
            let started = began.elapsed();
            let at = Instant::now();
            let outcome = match tokio::time::timeout(ATTEMPT_TIMEOUT, attempt(&target)).await {
                Ok(outcome) => outcome,
                Err(_) => Err(format!("no answer within {ATTEMPT_TIMEOUT:?}")),
            };
            Attempt {
                started,
                took: at.elapsed(),
                outcome,
            }
        });
    }
    let mut done = Vec::new();
    while let Some(attempt) = attempts.join_next().await {
        done.push(attempt.unwrap());
    }
    done.sort_by_key(|attempt| attempt.started);
    done
}

async fn attempt(target: &Target) -> Result<(), String> {
    let tcp = tokio::net::TcpStream::connect(target.addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let name =
        rustls_pki_types::ServerName::try_from(target.server_name.clone()).map_err(|e| e.to_string())?;
    let mut tls = tokio_rustls::TlsConnector::from(target.tls.clone())
        .connect(name, tcp)
        .await
        .map_err(|e| format!("TLS: {e}"))?;
    tls.write_all(
        format!(
            "GET /version HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
            target.server_name
        )
        .as_bytes(),
    )
    .await
    .map_err(|e| format!("request: {e}"))?;
    let mut answer = Vec::new();
    // nginx closes after the response (Connection: close); a TLS peer may
    // skip close_notify, which rustls reports as an unexpected EOF.
    match tls.read_to_end(&mut answer).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !answer.is_empty() => {}
        Err(e) => return Err(format!("response: {e}")),
    }
    let text = String::from_utf8_lossy(&answer);
    if text.starts_with("HTTP/1.1 200") && text.contains(&target.expect) {
        Ok(())
    } else {
        Err(format!(
            "unexpected answer: {}",
            text.lines().next().unwrap_or_default()
        ))
    }
}

/// The failed attempts of `attempts`, one line each.
pub fn failures(attempts: &[Attempt]) -> Vec<String> {
    attempts
        .iter()
        .filter_map(|a| {
            a.outcome
                .as_ref()
                .err()
                .map(|e| format!("at {:?} after {:?}: {e}", a.started, a.took))
        })
        .collect()
}

/// A namespace's path for a process running in it.
pub fn netns_of_pid(pid: u32) -> PathBuf {
    Path::new("/proc").join(pid.to_string()).join("ns/net")
}
