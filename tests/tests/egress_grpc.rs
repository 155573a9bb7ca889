//! Egress through the gRPC ProxyService frontend with the Rust tunnel client
//! (konnectivity-client); other people's clients are in grpc_clients.rs.

use std::time::{Duration, Instant};

use crate::support::TempDir;
use crate::support::certs::Pki;
use crate::support::cluster::{Setup, settled_fds, unanswering_listener};
use crate::support::procs::Server;
use crate::support::scrape::metric;
use crate::support::targets::{self, pattern_digest};
use konnectivity_client::{DialError, Tunnel, TunnelStream};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const GIB: u64 = 1024 * 1024 * 1024;

async fn tunnel(setup: &Setup, uds: bool) -> Tunnel {
    if uds {
        Tunnel::connect_uds(setup.server.uds_path()).await.unwrap()
    } else {
        let tls = setup.pki.client_tls(Some(&setup.pki.client), &[]);
        Tunnel::connect_tls("localhost", setup.server.tcp_port(), tls)
            .await
            .unwrap()
    }
}

async fn gib_each_way(uds: bool) {
    let setup = Setup::start("grpc", uds, &[]).await;
    let target = targets::blob().await;
    let tunnel = tunnel(&setup, uds).await;
    let mut stream = tunnel.dial(&target.addr.to_string()).await.unwrap();

    let (sent, received) = targets::push(&mut stream, GIB, 21).await.unwrap();
    assert_eq!(sent, received, "pushed bytes changed on the way");
    let expected = tokio::task::spawn_blocking(|| pattern_digest(GIB, 22));
    let pulled = targets::pull(&mut stream, GIB, 22).await.unwrap();
    assert_eq!(pulled, expected.await.unwrap(), "pulled bytes changed on the way");

    stream.shutdown().await.unwrap();
    drop(stream);
    setup.assert_gauges_return_to_zero().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_gib_each_way_over_grpc_on_the_unix_socket() {
    gib_each_way(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_gib_each_way_over_grpc_on_mtls_tcp() {
    gib_each_way(false).await;
}

async fn echo_round_trip(mut stream: TunnelStream, seed: u64) -> std::io::Result<()> {
    targets::start_echo(&mut stream).await?;
    let mut payload = vec![0u8; 16 * 1024];
    crate::support::Pattern::new(seed).fill(&mut payload);
    stream.write_all(&payload).await?;
    let mut echoed = vec![0u8; payload.len()];
    stream.read_exact(&mut echoed).await?;
    assert_eq!(echoed, payload, "dial {seed} got someone else's bytes");
    stream.shutdown().await
}

/// kube-apiserver's `exec` and `port-forward` write and read at once. Here
/// the target sends 64 MiB before it reads anything, while the client is
/// already writing 64 MiB: the client's writes fill the window towards the
/// agent, and that must never stop the target's bytes flowing back (which is
/// what lets the target get round to reading).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_writing_while_the_target_sends_never_deadlocks() {
    const LEN: u64 = 64 * 1024 * 1024;
    let setup = Setup::start("grpc", true, &[]).await;
    let target = targets::blob().await;
    let tunnel = tunnel(&setup, true).await;
    let mut stream = tunnel.dial(&target.addr.to_string()).await.unwrap();
    let expected = tokio::task::spawn_blocking(|| pattern_digest(LEN, 32));
    targets::request_pull(&mut stream, LEN, 32).await.unwrap();
    let (mut reader, mut writer) = tokio::io::split(stream);
    let read = async {
        let pulled = targets::read_digest(&mut reader, LEN).await.unwrap();
        let mut pushed = [0u8; 32];
        reader.read_exact(&mut pushed).await.unwrap();
        (pulled, pushed)
    };
    let write = async { targets::push_without_reply(&mut writer, LEN, 31).await.unwrap() };
    let ((pulled, pushed_received), pushed_sent) =
        tokio::time::timeout(Duration::from_secs(60), async { tokio::join!(read, write) })
            .await
            .expect("deadlock: the target's bytes stopped flowing back while the client wrote");
    assert_eq!(pulled, expected.await.unwrap(), "pulled bytes changed on the way");
    assert_eq!(pushed_received, pushed_sent, "pushed bytes changed on the way");
    writer.shutdown().await.unwrap();
    drop((reader, writer));
    setup.assert_gauges_return_to_zero().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_concurrent_dials_over_one_connection_then_nothing_is_left_behind() {
    let setup = Setup::start("grpc", true, &[]).await;
    let target = targets::blob().await;
    let tunnel = tunnel(&setup, true).await;
    // Warm up once so lazily created resources are part of the baseline.
    echo_round_trip(tunnel.dial(&target.addr.to_string()).await.unwrap(), 0)
        .await
        .unwrap();
    setup.assert_gauges_return_to_zero().await;

    // The first two thousands grow the allocator's and runtime's reusable
    // pools and make the baseline; the next two must come back to it.
    let mut baseline: Option<crate::support::cluster::Resources> = None;
    for round in 0..4u64 {
        let mut tasks = Vec::new();
        for seed in 1..=1000u64 {
            let tunnel = tunnel.clone();
            let address = target.addr.to_string();
            tasks.push(tokio::spawn(async move {
                let stream = tunnel.dial(&address).await.map_err(std::io::Error::other)?;
                echo_round_trip(stream, round * 1000 + seed).await
            }));
        }
        for (i, task) in tasks.into_iter().enumerate() {
            task.await.unwrap().unwrap_or_else(|e| panic!("dial {i}: {e}"));
        }
        setup.assert_gauges_return_to_zero().await;
        match (round, baseline.take()) {
            (0, _) => baseline = Some(setup.baseline().await),
            (1, Some(first)) => baseline = Some(first.highest(setup.baseline().await)),
            (_, Some(warm)) => {
                setup.assert_resources_return_to(&warm).await;
                baseline = Some(warm);
            }
            (_, None) => unreachable!("the baseline is set in round 0"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_agents_the_dial_fails_with_no_agent() {
    let dir = TempDir::new("konn-grpc");
    let pki = Pki::new(dir.path());
    let server = Server::start(dir.path(), &pki, "grpc", true, &[]).await;
    let tunnel = Tunnel::connect_uds(server.uds_path()).await.unwrap();
    let error = tunnel
        .dial("127.0.0.1:9")
        .await
        .err()
        .expect("no agent, no tunnel");
    assert_eq!(error, DialError::NoAgent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_target_error_text_reaches_the_caller() {
    let setup = Setup::start("grpc", true, &[]).await;
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let tunnel = tunnel(&setup, true).await;
    let error = tunnel
        .dial(&closed.to_string())
        .await
        .err()
        .expect("nothing listens there");
    assert_eq!(
        error,
        DialError::Failed(format!("dial tcp {closed}: connect: connection refused"))
    );
    setup.assert_gauges_return_to_zero().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_dial_timeout_reaches_the_caller() {
    let setup = Setup::start("grpc", true, &["--dial-timeout=1s".to_owned()]).await;
    let (_listener, _filler, addr) = unanswering_listener();
    let tunnel = tunnel(&setup, true).await;
    let started = Instant::now();
    let error = tunnel
        .dial(&addr.to_string())
        .await
        .err()
        .expect("cannot connect");
    assert_eq!(error, DialError::Failed(format!("dial tcp {addr}: i/o timeout")));
    assert!(started.elapsed() < Duration::from_secs(5));
    setup.assert_gauges_return_to_zero().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_pending_dial_leaves_no_connection_on_the_agent() {
    let setup = Setup::start("grpc", true, &["--dial-timeout=10s".to_owned()]).await;
    let (listener, filler, addr) = unanswering_listener();
    let tunnel = tunnel(&setup, true)
        .await
        .with_dial_timeout(Duration::from_millis(500));
    let error = tunnel.dial(&addr.to_string()).await.err().expect("cancelled");
    assert_eq!(error, DialError::Timeout(Duration::from_millis(500)));

    // Free the accept queue: an agent dial still in progress would now
    // connect on its next SYN retry (about 1 s). None may.
    let (_accepted_filler, _) = listener.accept().unwrap();
    drop(filler);
    listener.set_nonblocking(true).unwrap();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(
        listener.accept().is_err(),
        "the agent connected after the dial was cancelled"
    );
    assert_eq!(
        metric(
            setup.agent.health_port,
            "konnectivity_network_proxy_agent_open_endpoint_connections"
        )
        .await,
        Some(0.0)
    );
    setup.assert_gauges_return_to_zero().await;
}

/// A target that resets its connection (a crash, an abort) must show as an
/// error to the caller, as it would over direct TCP, and not as a clean end
/// a reader could take for a complete answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_that_resets_fails_the_callers_read_with_the_reset() {
    let setup = Setup::start("grpc", true, &[]).await;
    let target = targets::blob().await;
    let tunnel = tunnel(&setup, true).await;
    let mut stream = tunnel.dial(&target.addr.to_string()).await.unwrap();
    let error = targets::expect_reset(&mut stream, 1024 * 1024, 5).await;
    assert_eq!(error.kind(), std::io::ErrorKind::ConnectionReset, "{error}");
    assert!(error.to_string().contains("reset"), "{error}");
    drop(stream);
    setup.assert_gauges_return_to_zero().await;
}

/// The agent killed and not started again: its connections wait for a
/// resume (docs/resume.md) for `--agent-resume-timeout`, here 2 s, and then
/// the caller's read fails naming the agent, never hangs or ends cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_killed_mid_stream_fails_the_callers_read_after_the_resume_timeout() {
    let mut setup = Setup::with_flags("grpc", true, &["--agent-resume-timeout=2s".to_owned()], &[]).await;
    let target = targets::blob().await;
    let tunnel = tunnel(&setup, true).await;
    let mut stream = tunnel.dial(&target.addr.to_string()).await.unwrap();
    targets::request_pull(&mut stream, 64 * GIB, 9).await.unwrap();
    let mut buf = vec![0u8; 64 * 1024];
    let mut received = 0;
    while received < 8 * 1024 * 1024 {
        received += stream.read(&mut buf).await.unwrap();
    }
    setup.agent.proc.kill();
    let killed_at = Instant::now();
    let end = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) => return Ok(()),
                Ok(_) => continue,
                Err(error) => return Err(error),
            }
        }
    })
    .await
    .expect("the read must end promptly, not hang");
    let error = end.expect_err("a broken tunnel must fail the read, not end it cleanly");
    assert!(error.to_string().contains("agent disconnected"), "{error}");
    assert!(killed_at.elapsed() < Duration::from_secs(5));
}

/// kube-apiserver's egress set to HTTPConnect while the server runs
/// `--mode=grpc`: on the Unix socket (the bytes kube-apiserver writes) and on
/// the mTLS port (curl, a real HTTPS-proxy client), the client reads an
/// HTTP/1.1 answer whose status line names the modes, and the server logs
/// it; before, the client read h2's SETTINGS frame as a malformed response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_connect_client_on_the_grpc_frontend_is_told_the_mode() {
    let dir = TempDir::new("konn-mode");
    let pki = Pki::new(dir.path());
    let on_socket = Server::start(dir.path(), &pki, "grpc", true, &[]).await;
    let mut socket = tokio::net::UnixStream::connect(on_socket.uds_path())
        .await
        .unwrap();
    // As k8s.io/apiserver's egress selector writes it.
    socket
        .write_all(b"CONNECT 10.0.0.1:443 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .await
        .unwrap();
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(10), socket.read_to_string(&mut answer))
        .await
        .expect("the server answers and closes")
        .unwrap();
    let status_line = answer.lines().next().unwrap_or_default();
    assert!(
        status_line.starts_with("HTTP/1.1 400 Bad Request: ")
            && status_line.contains("--mode=grpc")
            && status_line.contains("--mode=http-connect"),
        "the status line, which kube-apiserver logs, names the modes: {answer:?}"
    );
    assert!(
        on_socket
            .proc
            .log_text()
            .contains("refused an HTTP/1.1 client on the gRPC frontend"),
        "{}",
        on_socket.proc.log_text()
    );

    let tcp_dir = dir.path().join("tcp");
    std::fs::create_dir_all(&tcp_dir).unwrap();
    let on_port = Server::start(&tcp_dir, &pki, "grpc", false, &[]).await;
    let output = std::process::Command::new("curl")
        .args([
            "--silent",
            "--show-error",
            "--verbose",
            "--max-time",
            "20",
            "--proxytunnel",
        ])
        .args(["--proxy", &format!("https://127.0.0.1:{}", on_port.tcp_port())])
        .args(["--proxy-cacert", &pki.ca.display().to_string()])
        .args(["--proxy-cert", &pki.client.cert.display().to_string()])
        .args(["--proxy-key", &pki.client.key.display().to_string()])
        .arg("http://10.0.0.1:443/")
        .output()
        .expect("curl is installed (hack/test.sh installs it)");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(
        stderr.contains("< HTTP/1.1 400 Bad Request: this proxy-server serves gRPC (--mode=grpc)"),
        "curl shows the status line: {stderr}"
    );
    assert!(
        on_port
            .proc
            .log_text()
            .contains("refused an HTTP/1.1 client on the gRPC frontend")
    );
}

/// kube-apiserver opens an HTTP/2 connection per tunnel (konnectivity-client's
/// single-use tunnel), so at 10,000 open tunnels the server holds 10,000
/// HTTP/2 connections: what an idle one keeps on the server's heap counts.
/// h2 allocated a 16 KiB write buffer and a 4 KiB HPACK decoding buffer for
/// every connection up front and kept them, and room for four streams and
/// four queued frames each way (vendor/README.md); ours takes them only while
/// it encodes, decodes or queues, and room for one stream. 44.3 KiB with
/// crates.io's h2, 16.4 with the buffers taken when used, 13.2 with the
/// frame queues too. The heap, not resident memory, is
/// compared: it is exact, where resident pages depend on what the
/// allocator touched before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_single_use_grpc_tunnel_holds_little_heap_on_the_server() {
    const TUNNELS: usize = 100;
    let setup = Setup::start("grpc", true, &[]).await;
    let target = targets::blob().await;
    let target = target.addr.to_string();
    let open = |count: usize| {
        let (setup, target) = (&setup, &target);
        async move {
            let mut held = Vec::new();
            for seed in 0..count {
                // A connection of its own per tunnel, as kube-apiserver dials.
                let tunnel = tunnel(setup, true).await;
                let mut stream = tunnel.dial(target).await.unwrap();
                let (sent, received) = targets::push(&mut stream, 1024, seed as u64).await.unwrap();
                assert_eq!(sent, received);
                held.push((tunnel, stream));
            }
            held
        }
    };
    // Once first, so that tables the first tunnels grow are in the baseline.
    drop(open(TUNNELS).await);
    let baseline = setup.baseline().await;
    let held = open(TUNNELS).await;
    settled_fds(setup.server.proc.pid()).await;
    let now = setup.resources().await;
    let per_tunnel = (now.server_heap_kib.saturating_sub(baseline.server_heap_kib)) as f64 / TUNNELS as f64;
    eprintln!("server heap per idle single-use tunnel: {per_tunnel:.1} KiB ({baseline:?} -> {now:?})");
    assert!(
        per_tunnel <= 15.0,
        "an idle single-use tunnel holds {per_tunnel:.1} KiB of the server's heap"
    );
    drop(held);
}
