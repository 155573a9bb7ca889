//! Connections that outlive the agent stream under them (docs/resume.md):
//! the agent's TCP connection to the server is killed (`ss -K`, the socket
//! destroyed under the process, as a reset or a load balancer's cut does)
//! again and again while transfers and a line-by-line stream run through
//! it. Every byte arrives once and in order, no connection fails, and the
//! longest pause stays short.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use crate::support::cluster::Setup;
use crate::support::connect::via_uds;
use crate::support::netns::{kill_connections_to, root_or_skip};
use crate::support::scrape::metric;
use crate::support::targets::{self, pattern_digest};

const MIB: u64 = 1024 * 1024;
const SERVER_RESUMED: &str = "konnectivity_network_proxy_server_resumed_connections_total";
const AGENT_RESUMED: &str = "konnectivity_network_proxy_agent_resumed_connections_total";

/// Cuts the agent's connection to `port` 20 times, 200 ms apart, while
/// transfers run; a cut finds the connection only once the agent has
/// reconnected, so it waits for one each time.
async fn cut_twenty_times(port: u16) {
    let mut cuts = 0;
    let deadline = Instant::now() + Duration::from_secs(120);
    while cuts < 20 {
        assert!(Instant::now() < deadline, "20 cuts did not happen within 120 s");
        tokio::time::sleep(Duration::from_millis(200)).await;
        if kill_connections_to(port) > 0 {
            cuts += 1;
        }
    }
}

/// The download of `len` bytes (pattern `seed`) and the upload, run across
/// the cuts, arrived unchanged.
async fn transfers_intact(
    download: tokio::task::JoinHandle<std::io::Result<[u8; 32]>>,
    upload: tokio::task::JoinHandle<std::io::Result<([u8; 32], [u8; 32])>>,
    len: u64,
    seed: u64,
) {
    let downloaded = tokio::time::timeout(Duration::from_secs(300), download)
        .await
        .expect("the download finishes")
        .unwrap()
        .expect("the download survives the cuts");
    assert_eq!(downloaded, pattern_digest(len, seed), "downloaded bytes changed");
    let (sent, received) = tokio::time::timeout(Duration::from_secs(300), upload)
        .await
        .expect("the upload finishes")
        .unwrap()
        .expect("the upload survives the cuts");
    assert_eq!(sent, received, "uploaded bytes changed");
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

    cut_twenty_times(setup.server.agent_port).await;
    transfers_intact(download, upload, len, 7).await;
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

/// The same through the gRPC frontend, with the clients kube-apiserver's
/// dialer is built on: a grpc-go client (tests/go/kas_client.go, one
/// connection, raw packets, as konnectivity-client) holds a line-by-line
/// echo for 20 s, and our client library downloads and uploads 1 GiB on a
/// connection per tunnel (konnectivity-client's single-use tunnels), while
/// the agent's connection is cut twenty times. Every line comes back once and
/// in order, both digests match, and the longest wait for a line stays under
/// a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_cuts_under_grpc_tunnels_lose_and_double_nothing() {
    if !root_or_skip("twenty_cuts_under_grpc_tunnels_lose_and_double_nothing") {
        return;
    }
    let Some(go_client) = crate::support::foreign::grpc_go_client() else {
        return;
    };
    let setup = Setup::start("grpc", true, &[]).await;
    let target = targets::blob().await;
    let address = target.addr.to_string();
    let uds = setup.server.uds_path().to_owned();
    let len = 1024 * MIB;

    let mut command = tokio::process::Command::new(&go_client);
    command
        .arg("-socket")
        .arg(&uds)
        .arg("-echo")
        .arg(&address)
        .arg("-lines")
        .arg("20s")
        .kill_on_drop(true);
    let lines = tokio::spawn(crate::support::foreign::run_client(command, "lines:"));
    let download = {
        let (uds, address) = (uds.clone(), address.clone());
        tokio::spawn(async move {
            let tunnel = konnectivity_client::Tunnel::connect_uds(&uds).await.unwrap();
            let mut stream = tunnel.dial(&address).await.unwrap();
            targets::pull(&mut stream, len, 17).await
        })
    };
    let upload = {
        let (uds, address) = (uds.clone(), address.clone());
        tokio::spawn(async move {
            let tunnel = konnectivity_client::Tunnel::connect_uds(&uds).await.unwrap();
            let mut stream = tunnel.dial(&address).await.unwrap();
            targets::push(&mut stream, len, 18).await
        })
    };

    cut_twenty_times(setup.server.agent_port).await;
    transfers_intact(download, upload, len, 17).await;
    let output = tokio::time::timeout(Duration::from_secs(60), lines)
        .await
        .expect("the grpc-go client finishes")
        .unwrap();
    let longest_ms: u64 = output
        .split("longest wait ")
        .nth(1)
        .and_then(|rest| rest.trim().strip_suffix("ms"))
        .and_then(|ms| ms.parse().ok())
        .unwrap_or_else(|| panic!("no longest wait in {output}"));
    assert!(
        longest_ms < 1000,
        "the grpc-go client's lines paused {longest_ms} ms (budget: under 1 s)"
    );
    eprintln!("{}", output.trim());
    setup.assert_gauges_return_to_zero().await;
}

/// The node's link silent for 20 s (its veth down in the test's network
/// namespaces: no reset, no FIN, nothing), then for longer than the resume
/// timeout. Both sides notice the silence within 15 s (the agent's probes,
/// the server's pings); the first time the connections resume when the link
/// returns (every line once and in order, a download intact); the second
/// time they close once the timeout runs out, not before, and each process
/// is back to its descriptors and heap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_link_resumes_within_the_timeout_and_closes_cleanly_after_it() {
    use crate::support::cluster::{open_fds, settled_fds};
    use crate::support::split::{READY, SERVER_HEALTH, Split};
    use crate::support::wait_until;

    if !root_or_skip("a_silent_link_resumes_within_the_timeout_and_closes_cleanly_after_it") {
        return;
    }
    // Long enough for a 20 s silence and the reconnection after it.
    const RESUME_TIMEOUT: &str = "30s";

    let split = Split::start(
        "konn-silence",
        &[format!("--agent-resume-timeout={RESUME_TIMEOUT}")],
        &[format!("--resume-timeout={RESUME_TIMEOUT}")],
    )
    .await;
    let Split {
        server,
        agent,
        socket,
        target,
        node,
        control_plane,
        ..
    } = &split;
    let (socket, target) = (socket.clone(), target.clone());
    let cp = control_plane;
    let round_trip = |seed: u64| {
        let (socket, target) = (socket.clone(), target.clone());
        async move {
            let mut tunnel = via_uds(&socket, &target)
                .await
                .unwrap()
                .expect("CONNECT accepted");
            let (sent, received) = targets::push(&mut tunnel, 4 * MIB, seed).await.unwrap();
            assert_eq!(sent, received);
        }
    };
    let mut memory = (0, 0);
    for seed in [1, 2] {
        round_trip(seed).await;
        settled_fds(server.pid()).await;
        settled_fds(agent.pid()).await;
        let now = split.heap_kib();
        memory = (memory.0.max(now.0), memory.1.max(now.1));
    }
    let fds = (open_fds(server.pid()), open_fds(agent.pid()));

    // 1. Twenty seconds of silence, then the link back: everything resumes.
    let stop = Arc::new(AtomicBool::new(false));
    let lines = tokio::spawn(numbered_lines(socket.clone(), target.clone(), stop.clone()));
    let download = {
        let (socket, target) = (socket.clone(), target.clone());
        tokio::spawn(async move {
            let mut tunnel = via_uds(&socket, &target)
                .await
                .unwrap()
                .expect("CONNECT accepted");
            targets::pull(&mut tunnel, 256 * MIB, 5).await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    node.ip(&["link", "set", "veth0", "down"]);
    let cut = Instant::now();
    wait_until(
        Duration::from_secs(15),
        "the server to notice the silent agent",
        || async { cp.metric(SERVER_HEALTH, READY) == Some(0.0) },
    )
    .await;
    let server_noticed = cut.elapsed();
    tokio::time::sleep(Duration::from_secs(20).saturating_sub(cut.elapsed())).await;
    node.ip(&["link", "set", "veth0", "up"]);
    let downloaded = tokio::time::timeout(Duration::from_secs(60), download)
        .await
        .expect("the download finishes after the silence")
        .unwrap()
        .expect("the download survives 20 s of silence");
    assert_eq!(downloaded, pattern_digest(256 * MIB, 5));
    stop.store(true, Ordering::Relaxed);
    let (count, longest) = lines.await.unwrap();
    eprintln!(
        "20 s of silence: the server noticed after {server_noticed:?}; {count} lines, longest wait {longest:?}"
    );
    assert!(count > 0);
    assert!(
        cp.metric(SERVER_HEALTH, SERVER_RESUMED).unwrap_or(0.0) >= 2.0,
        "the server resumed the connections"
    );

    // 2. Silence longer than the resume timeout: the connections end with an
    // error once it runs out, and nothing of them stays.
    let mut tunnel = via_uds(&socket, &target)
        .await
        .unwrap()
        .expect("CONNECT accepted");
    targets::start_echo(&mut tunnel).await.unwrap();
    node.ip(&["link", "set", "veth0", "down"]);
    let cut = Instant::now();
    let ended = tokio::time::timeout(Duration::from_secs(60), async {
        let mut buf = [0u8; 16];
        tokio::io::AsyncReadExt::read(&mut tunnel, &mut buf).await
    })
    .await
    .expect("the connection ends once the resume timeout runs out");
    let after = cut.elapsed();
    assert!(
        after >= Duration::from_secs(25) && after < Duration::from_secs(50),
        "ended after {after:?}, with a 30 s resume timeout"
    );
    // Over a Unix socket a CONNECT tunnel can only end with the end of its
    // stream (no reset), so either is the end, as long as nothing came.
    assert!(
        matches!(ended, Ok(0) | Err(_)),
        "bytes after the silence: {ended:?}"
    );
    node.ip(&["link", "set", "veth0", "up"]);
    wait_until(
        Duration::from_secs(30),
        "the agent back on the server",
        || async { cp.metric(SERVER_HEALTH, READY) == Some(1.0) },
    )
    .await;
    round_trip(3).await;
    split.assert_back_to(fds, memory).await;
    let timed_out = cp.metric(
        SERVER_HEALTH,
        "konnectivity_network_proxy_server_resume_timeouts_total",
    );
    assert!(
        timed_out.unwrap_or(0.0) >= 1.0,
        "the server counts what the timeout closed"
    );
}

/// `hack/bench.sh --resume`: how long data stops flowing when the agent's
/// connection is cut. A 16-byte echo round trip runs back to back through
/// HTTP CONNECT; the agent's connection is killed 50 times, 300 ms apart;
/// each cut's pause is the time from the kill to the end of the first round
/// trip begun after it (so it includes noticing the loss, dialing and the
/// TLS handshake, the resume handshake and the bytes sent again). Prints
/// Markdown rows; run from a release build.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a benchmark: hack/bench.sh --resume runs it"]
async fn resume_benchmark() {
    assert!(
        root_or_skip("resume_benchmark"),
        "the benchmark needs root (ss -K)"
    );
    const CUTS: usize = 50;
    let setup = Setup::start("http-connect", true, &[]).await;
    let target = targets::blob().await;
    let address = target.addr.to_string();
    let tunnel = via_uds(setup.server.uds_path(), &address)
        .await
        .unwrap()
        .expect("CONNECT accepted");
    let (mut read, mut write) = tokio::io::split(tunnel);
    let mut header = vec![b'E'];
    header.extend([0u8; 16]);
    write.write_all(&header).await.unwrap();
    // (begun, completed) of each round trip.
    let completions = Arc::new(std::sync::Mutex::new(Vec::<(Instant, Instant)>::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let echo = {
        let (completions, stop) = (completions.clone(), stop.clone());
        tokio::spawn(async move {
            let mut buf = [0u8; 16];
            while !stop.load(Ordering::Relaxed) {
                let begun = Instant::now();
                write.write_all(&[7u8; 16]).await.unwrap();
                tokio::io::AsyncReadExt::read_exact(&mut read, &mut buf)
                    .await
                    .unwrap();
                completions.lock().unwrap().push((begun, Instant::now()));
            }
        })
    };
    let port = setup.server.agent_port;
    let mut pauses = Vec::new();
    while pauses.len() < CUTS {
        tokio::time::sleep(Duration::from_millis(300)).await;
        // Taken before the kill: the pause includes ss's own few ms.
        let cut = Instant::now();
        if kill_connections_to(port) == 0 {
            continue;
        }
        let resumed = loop {
            let after = completions
                .lock()
                .unwrap()
                .iter()
                .find(|(begun, _)| *begun > cut)
                .map(|(_, completed)| *completed);
            if let Some(at) = after {
                break at;
            }
            assert!(
                cut.elapsed() < Duration::from_secs(30),
                "data did not flow again within 30 s"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        };
        pauses.push(resumed - cut);
        completions.lock().unwrap().clear();
    }
    stop.store(true, Ordering::Relaxed);
    echo.await.unwrap();
    pauses.sort();
    let ms = |d: Duration| format!("{:.1}", d.as_secs_f64() * 1000.0);
    println!("\n| agent connection cut (ss -K) {CUTS} times under a back-to-back 16-byte echo | ms |");
    println!("|---|---:|");
    println!(
        "| time from the cut to data flowing again, p50 | {} |",
        ms(pauses[CUTS / 2])
    );
    println!("| p90 | {} |", ms(pauses[CUTS * 9 / 10]));
    println!("| max | {} |", ms(pauses[CUTS - 1]));
    let resumed = metric(setup.server.health_port, SERVER_RESUMED)
        .await
        .unwrap_or(0.0);
    println!("| connections resumed by the server (one per cut) | {resumed} |");
    assert_eq!(resumed, CUTS as f64, "every cut was resumed");
}

/// The same through a node tunnel: the node agent's TCP connection to the
/// node frontend killed 20 times (`ss -K` in the node's namespace) while a
/// 200 MiB download through the `kubernetes` VIP runs (a watch's long-lived
/// connection, held across every cut) and kubectl asks the API server
/// through the VIP after each cut. The download arrives intact on its one
/// connection, kubectl never fails, and the server counts the resumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_cuts_of_the_node_tunnel_break_no_captured_connection() {
    use crate::support::kas::*;

    if !root_or_skip("twenty_cuts_of_the_node_tunnel_break_no_captured_connection") {
        return;
    }
    const CUTS: usize = 20;
    const NODE_RESUMED: &str = AGENT_RESUMED;
    let topology = std::sync::Arc::new(build(true).await);
    let _agent = topology.start_node_agent(&[]);
    topology.wait_node_ready().await;

    // At 8 MiB/s the 200 MiB last about 25 s: every cut lands in it.
    let download = {
        let topology = topology.clone();
        tokio::task::spawn_blocking(move || {
            topology.node.sh(&format!(
                "curl -sS --max-time 120 --limit-rate 8M --cacert {} https://{VIP}/files/blob | sha256sum",
                topology.pki.ca.display()
            ))
        })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut cuts = 0;
    for cut in 0..CUTS {
        let killed = topology.node.sh(&format!(
            "ss -K -t -n dst {SERVER_IP} dport = :{NODE_FRONTEND_PORT} | tail -n +2 | grep -c ."
        ));
        let killed: usize = String::from_utf8_lossy(&killed.stdout)
            .trim()
            .parse()
            .unwrap_or(0);
        assert!(killed >= 1, "cut {cut}: no node tunnel connection to kill");
        cuts += 1;
        let kubectl = topology.kubectl_get_raw(&topology.node, "/version");
        assert!(
            kubectl.status.success(),
            "kubectl after cut {cut}: {}",
            text(&kubectl)
        );
        assert!(String::from_utf8_lossy(&kubectl.stdout).contains("v1.31.0-konnectivity-standin"));
        tokio::time::sleep(Duration::from_millis(700)).await;
    }
    let download = download.await.unwrap();
    assert!(download.status.success(), "{}", text(&download));
    assert!(
        String::from_utf8_lossy(&download.stdout).starts_with(&topology.blob_sha256),
        "the download through {cuts} cuts of the node tunnel arrived changed or cut short: {}",
        text(&download)
    );
    let resumed = topology
        .control_plane
        .metric(SERVER_HEALTH, SERVER_RESUMED)
        .unwrap_or(0.0);
    let node_resumed = topology
        .node
        .metric(NODE_AGENT_HEALTH, NODE_RESUMED)
        .unwrap_or(0.0);
    assert!(
        resumed >= CUTS as f64 && node_resumed >= CUTS as f64,
        "the download's connection resumed after every cut: server {resumed}, node agent {node_resumed}"
    );
}

/// The node's link silent for 20 s (the cable pulled: no reset, nothing) while
/// a download runs through the `kubernetes` VIP: the server notices the
/// silent node tunnel by its pings, the node agent by its probes, and when
/// the link returns the captured connection resumes on a new tunnel; the
/// download arrives intact on its one connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_captured_connection_survives_twenty_seconds_of_a_silent_node_link() {
    use crate::support::kas::*;

    if !root_or_skip("a_captured_connection_survives_twenty_seconds_of_a_silent_node_link") {
        return;
    }
    // 64 MiB at 4 MiB/s: 16 s of transfer around the 20 s of silence.
    const LEN: u64 = 64 * MIB;
    let topology = Arc::new(build(true).await);
    let _agent = topology.start_node_agent(&[]);
    topology.wait_node_ready().await;
    let blob = topology.dir.path().join("www/files/blob");
    let expected = topology
        .node
        .sh(&format!("head -c {LEN} {} | sha256sum", blob.display()));
    let expected = String::from_utf8_lossy(&expected.stdout).to_string();

    let download = {
        let topology = topology.clone();
        tokio::task::spawn_blocking(move || {
            topology.node.sh(&format!(
                "curl -sS --max-time 120 --limit-rate 4M --range 0-{} --cacert {} https://{VIP}/files/blob | sha256sum",
                LEN - 1,
                topology.pki.ca.display()
            ))
        })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    // The control plane's end goes down, as a cable pulled: the node's end
    // only loses its carrier, and keeps its address and local routes (an
    // interface set down would take the node's own address, which captured
    // connections use, with it).
    topology.control_plane.ip(&["link", "set", "veth0", "down"]);
    tokio::time::sleep(Duration::from_secs(20)).await;
    topology.control_plane.ip(&["link", "set", "veth0", "up"]);
    let download = download.await.unwrap();
    assert!(download.status.success(), "{}", text(&download));
    assert_eq!(
        String::from_utf8_lossy(&download.stdout),
        expected,
        "the download across 20 s of silence arrived changed or cut short: {}",
        text(&download)
    );
    let resumed = topology
        .control_plane
        .metric(SERVER_HEALTH, SERVER_RESUMED)
        .unwrap_or(0.0);
    assert!(
        resumed >= 1.0,
        "the server resumed the captured connection: {resumed}"
    );
}
