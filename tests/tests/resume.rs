//! Connections that outlive the agent stream under them (docs/resume.md):
//! the agent's TCP connection to the server is killed (`ss -K`, the socket
//! destroyed under the process, as a reset or a load balancer's cut does)
//! again and again while transfers and a line-by-line stream run through
//! it. Every byte arrives once and in order, no connection fails, and the
//! longest pause stays short.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use crate::support::cluster::Setup;
use crate::support::connect::via_uds;
use crate::support::netns::root_or_skip;
use crate::support::scrape::metric;
use crate::support::targets::{self, pattern_digest};

const MIB: u64 = 1024 * 1024;
const SERVER_RESUMED: &str = "konnectivity_network_proxy_server_resumed_connections_total";
const AGENT_RESUMED: &str = "konnectivity_network_proxy_agent_resumed_connections_total";

/// Kills every TCP connection to `port` on loopback: the agent streams of
/// the server this test started, which alone listens there.
fn cut_agent_connections(port: u16) -> usize {
    let output = std::process::Command::new("ss")
        .args([
            "-K",
            "-t",
            "-n",
            "dst",
            "127.0.0.1",
            "dport",
            "=",
            &format!(":{port}"),
        ])
        .output()
        .expect("ss runs");
    assert!(
        output.status.success(),
        "ss -K: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    // One line per killed socket after the header.
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .skip(1)
        .filter(|line| !line.trim().is_empty())
        .count()
}

/// Numbered lines through an echo connection, one every 10 ms, each read
/// back before the next: as `kubectl logs -f`, every line must arrive once
/// and in order. Returns how many went through and the longest wait for one.
async fn numbered_lines(uds: std::path::PathBuf, target: String, stop: Arc<AtomicBool>) -> (u64, Duration) {
    let tunnel = via_uds(&uds, &target).await.unwrap().expect("CONNECT accepted");
    let (read, mut write) = tokio::io::split(tunnel);
    let mut header = vec![b'E'];
    header.extend([0u8; 16]);
    write.write_all(&header).await.unwrap();
    let mut lines = BufReader::new(read).lines();
    let mut longest = Duration::ZERO;
    let mut sent = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let started = Instant::now();
        write
            .write_all(format!("line {sent}\n").as_bytes())
            .await
            .unwrap();
        let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .unwrap_or_else(|_| panic!("line {sent} did not come back within 30 s"))
            .unwrap_or_else(|error| panic!("the stream failed at line {sent}: {error}"))
            .unwrap_or_else(|| panic!("the stream ended at line {sent}"));
        assert_eq!(
            line,
            format!("line {sent}"),
            "a line missing, doubled or out of order"
        );
        longest = longest.max(started.elapsed());
        sent += 1;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    (sent, longest)
}

/// Twenty cuts of the agent's connection to the server during a 1 GiB
/// download, a 1 GiB upload and a line-by-line echo, all through HTTP
/// CONNECT: the transfers' SHA-256 match, no line is lost or doubled, the
/// longest pause of the echo stays under a second, and both sides count the
/// resumed connections. Fails with `--agent-resume-timeout=0` (upstream's
/// behaviour): the first cut ends every connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_cuts_of_the_agent_stream_lose_and_double_nothing() {
    if !root_or_skip("twenty_cuts_of_the_agent_stream_lose_and_double_nothing") {
        return;
    }
    let setup = Setup::start("http-connect", true, &[]).await;
    let target = targets::blob().await;
    let address = target.addr.to_string();
    let uds = setup.server.uds_path().to_owned();
    let len = 1024 * MIB;

    let download = {
        let (uds, address) = (uds.clone(), address.clone());
        tokio::spawn(async move {
            let mut tunnel = via_uds(&uds, &address).await.unwrap().expect("CONNECT accepted");
            targets::pull(&mut tunnel, len, 7).await
        })
    };
    let upload = {
        let (uds, address) = (uds.clone(), address.clone());
        tokio::spawn(async move {
            let mut tunnel = via_uds(&uds, &address).await.unwrap().expect("CONNECT accepted");
            targets::push(&mut tunnel, len, 8).await
        })
    };
    let stop = Arc::new(AtomicBool::new(false));
    let lines = tokio::spawn(numbered_lines(uds.clone(), address.clone(), stop.clone()));

    // Cuts every 200 ms while the transfers run; a cut finds the agent's
    // connection only once it has reconnected, so wait for one each time.
    let cuts = Arc::new(AtomicU64::new(0));
    let port = setup.server.agent_port;
    let deadline = Instant::now() + Duration::from_secs(120);
    while cuts.load(Ordering::Relaxed) < 20 {
        assert!(Instant::now() < deadline, "20 cuts did not happen within 120 s");
        tokio::time::sleep(Duration::from_millis(200)).await;
        if cut_agent_connections(port) > 0 {
            cuts.fetch_add(1, Ordering::Relaxed);
        }
    }

    let downloaded = tokio::time::timeout(Duration::from_secs(300), download)
        .await
        .expect("the download finishes")
        .unwrap()
        .expect("the download survives the cuts");
    assert_eq!(downloaded, pattern_digest(len, 7), "downloaded bytes changed");
    let (sent, received) = tokio::time::timeout(Duration::from_secs(300), upload)
        .await
        .expect("the upload finishes")
        .unwrap()
        .expect("the upload survives the cuts");
    assert_eq!(sent, received, "uploaded bytes changed");
    stop.store(true, Ordering::Relaxed);
    let (count, longest) = lines.await.unwrap();
    assert!(count > 0);
    assert!(
        longest < Duration::from_secs(1),
        "the echo stream paused {longest:?} (budget: under 1 s)"
    );
    let server_resumed = metric(setup.server.health_port, SERVER_RESUMED)
        .await
        .unwrap_or(0.0);
    let agent_resumed = metric(setup.agent.health_port, AGENT_RESUMED)
        .await
        .unwrap_or(0.0);
    assert!(
        server_resumed >= 20.0,
        "server resumed {server_resumed} connections"
    );
    assert!(agent_resumed >= 20.0, "agent resumed {agent_resumed} connections");
    eprintln!(
        "20 cuts: {count} echo lines, longest pause {longest:?}, server resumed {server_resumed}, agent {agent_resumed}"
    );
    setup.assert_gauges_return_to_zero().await;
}
