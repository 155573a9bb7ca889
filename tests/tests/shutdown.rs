//! `--graceful-shutdown-timeout`: on SIGTERM the server stops accepting,
//! lets open tunnels finish, and exits when they have, or at the deadline.

use std::time::{Duration, Instant};

use crate::support::cluster::Setup;
use crate::support::connect::via_uds;
use crate::support::targets;
use tokio::io::AsyncReadExt;

async fn start(timeout: &str) -> (Setup, targets::Target) {
    start_mode("http-connect", timeout).await
}

async fn start_mode(mode: &str, timeout: &str) -> (Setup, targets::Target) {
    let flags = [format!("--graceful-shutdown-timeout={timeout}")];
    (
        Setup::with_flags(mode, true, &flags, &[]).await,
        targets::blob().await,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_tunnels_finish_after_sigterm_and_the_server_exits_when_they_end() {
    let (mut setup, target) = start("30s").await;
    let server = &mut setup.server;
    let uds = server.uds_path().to_owned();
    let mut open = via_uds(&uds, &target.addr.to_string())
        .await
        .unwrap()
        .expect("CONNECT accepted");

    server.proc.signal("TERM");
    // New clients are refused at once...
    let refused = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            if via_uds(&uds, &target.addr.to_string()).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(refused.is_ok(), "the frontend must stop accepting after SIGTERM");
    // ...while the open tunnel still moves bytes both ways, intact.
    let (sent, received) = targets::push(&mut open, 16 << 20, 1).await.unwrap();
    assert_eq!(sent, received);
    let pulled = targets::pull(&mut open, 16 << 20, 2).await.unwrap();
    assert_eq!(pulled, targets::pattern_digest(16 << 20, 2));
    assert!(
        server.proc.wait_exit(Duration::from_millis(300)).await.is_none(),
        "the server waits while a tunnel is open"
    );

    drop(open);
    let closed = Instant::now();
    let status = server.proc.wait_exit(Duration::from_secs(5)).await;
    assert!(status.is_some(), "the server exits once its last tunnel ended");
    assert!(
        closed.elapsed() < Duration::from_secs(3),
        "took {:?}",
        closed.elapsed()
    );
}

/// The gRPC frontend drains as HTTP/2 does: GOAWAY on the client's
/// connection, so a new dial on it fails at once while the open Proxy
/// stream carries on; the server exits when that stream ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_clients_get_goaway_and_their_open_tunnels_finish() {
    let (mut setup, target) = start_mode("grpc", "30s").await;
    let server = &mut setup.server;
    let tunnel = konnectivity_client::Tunnel::connect_uds(server.uds_path())
        .await
        .unwrap();
    let mut open = tunnel.dial(&target.addr.to_string()).await.unwrap();

    server.proc.signal("TERM");
    let refused = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            if tunnel.dial(&target.addr.to_string()).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(
        refused.is_ok(),
        "new dials on the open connection must fail after SIGTERM"
    );
    let (sent, received) = targets::push(&mut open, 16 << 20, 3).await.unwrap();
    assert_eq!(sent, received);
    assert!(
        server.proc.wait_exit(Duration::from_millis(300)).await.is_none(),
        "the server waits while a Proxy stream is open"
    );

    drop(open);
    drop(tunnel);
    let closed = Instant::now();
    let status = server.proc.wait_exit(Duration::from_secs(5)).await;
    assert!(
        status.is_some(),
        "the server exits once its last Proxy stream ended"
    );
    assert!(
        closed.elapsed() < Duration::from_secs(3),
        "took {:?}",
        closed.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tunnels_still_open_at_the_deadline_are_cut() {
    let (mut setup, target) = start("1s").await;
    let server = &mut setup.server;
    let mut open = via_uds(server.uds_path(), &target.addr.to_string())
        .await
        .unwrap()
        .expect("CONNECT accepted");
    let signalled = Instant::now();
    server.proc.signal("TERM");
    let status = server.proc.wait_exit(Duration::from_secs(5)).await;
    assert!(status.is_some(), "the server exits at the deadline");
    let waited = signalled.elapsed();
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(4),
        "exited after {waited:?}"
    );
    // The client sees its tunnel end rather than hang.
    let mut byte = [0u8; 1];
    let end = tokio::time::timeout(Duration::from_secs(5), open.read(&mut byte)).await;
    assert!(matches!(end, Ok(Ok(0)) | Ok(Err(_))), "{end:?}");
}
