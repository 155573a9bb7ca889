//! Keepalives: a server pinging its agents notices one that stopped
//! answering (frozen, or its host gone without a FIN) and drops its stream,
//! instead of choosing it for dials that would hang.

use std::time::Duration;

use crate::support::procs::{Agent, Server};
use crate::support::scrape::metric;
use crate::support::{TempDir, wait_until};

const CONNECTED: &str = "konnectivity_network_proxy_server_ready_backend_connections";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_agent_is_dropped_by_keepalive_and_reconnects_when_it_thaws() {
    let dir = TempDir::new("konn-keepalive");
    let pki = crate::support::certs::Pki::new(dir.path());
    let server = Server::start(dir.path(), &pki, "grpc", true, &["--keepalive-time=1s".into()]).await;
    let agent = Agent::start(dir.path(), &pki, server.agent_port, "agent-1", &[]);
    server.wait_backends(1).await;
    let port = server.health_port;

    // Pings every second answered: the agent stays.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(metric(port, CONNECTED).await, Some(1.0), "a live agent is kept");

    agent.proc.signal("STOP");
    wait_until(
        Duration::from_secs(10),
        "the frozen agent's stream is dropped",
        || async move { metric(port, CONNECTED).await == Some(0.0) },
    )
    .await;
    let (status, _) = crate::support::scrape::http_get(port, "/readyz").await.unwrap();
    assert_eq!(status, 500, "no agent left to choose");

    agent.proc.signal("CONT");
    wait_until(
        Duration::from_secs(15),
        "the thawed agent reconnects",
        || async move { metric(port, CONNECTED).await == Some(1.0) },
    )
    .await;
}
