//! `--graceful-shutdown-timeout`: on SIGTERM the server stops accepting,
//! lets open tunnels finish, and exits when they have, or at the deadline.

mod support;

use std::time::{Duration, Instant};

use support::TempDir;
use support::certs::Pki;
use support::connect::via_uds;
use support::procs::{Agent, Server};
use support::targets;
use tokio::io::AsyncReadExt;

async fn start(timeout: &str) -> (TempDir, Server, Agent, targets::Target) {
    let dir = TempDir::new("konn-shutdown");
    let pki = Pki::new(dir.path());
    let server = Server::start(
        dir.path(),
        &pki,
        "http-connect",
        true,
        &[format!("--graceful-shutdown-timeout={timeout}")],
    )
    .await;
    let agent = Agent::start(dir.path(), &pki, server.agent_port, "agent-1", &[]);
    server.wait_backends(1).await;
    (dir, server, agent, targets::blob().await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_tunnels_finish_after_sigterm_and_the_server_exits_when_they_end() {
    let (_dir, mut server, _agent, target) = start("30s").await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tunnels_still_open_at_the_deadline_are_cut() {
    let (_dir, mut server, _agent, target) = start("1s").await;
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
