//! Keepalives: a server pinging its agents notices one that stopped
//! answering (frozen, or its host gone without a FIN) and drops its stream,
//! instead of choosing it for dials that would hang.

use std::time::Duration;

use crate::support::procs::{Agent, Proc, Server};
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

const PROBES: &str = "konnectivity_network_proxy_server_agent_probes_total";
const AGENT_SERVERS: &str = "konnectivity_network_proxy_agent_open_server_connections";

/// Our server offers, by ALPN, to be pinged at any rate: the agent then
/// watches the connection with HTTP/2 PINGs every --probe-interval, which
/// the server's HTTP/2 layer answers, instead of a probe stream each time
/// (what took half a server CPU at 5,000 agents); and a frozen server is
/// still left within the probe's 5 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_watches_our_server_by_pings_not_probe_streams() {
    let dir = TempDir::new("konn-keepalive");
    let pki = crate::support::certs::Pki::new(dir.path());
    let server = Server::start(dir.path(), &pki, "grpc", true, &[]).await;
    let agent = Agent::start(
        dir.path(),
        &pki,
        server.agent_port,
        "agent-1",
        &["--probe-interval=100ms".into()],
    );
    server.wait_backends(1).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    // A probe stream every 100 ms would be 30 by now.
    assert_eq!(
        metric(server.health_port, PROBES).await,
        Some(0.0),
        "no probe stream within the 30 s between the probes of a pinged connection"
    );
    assert_eq!(metric(agent.health_port, AGENT_SERVERS).await, Some(1.0));

    server.proc.signal("STOP");
    // A PING after 100 ms without a frame, unanswered for 5 s; with room.
    let agent_port = agent.health_port;
    wait_until(
        Duration::from_secs(9),
        "the agent to leave the frozen server",
        || async move { metric(agent_port, AGENT_SERVERS).await == Some(0.0) },
    )
    .await;
    server.proc.signal("CONT");
    wait_until(
        Duration::from_secs(15),
        "the agent back on the thawed server",
        || async move { metric(agent_port, AGENT_SERVERS).await == Some(1.0) },
    )
    .await;
}

/// Upstream's server (grpc-go, keepalive enforcement MinTime 30 s) closes a
/// connection pinged more often: GOAWAY ENHANCE_YOUR_CALM after the third
/// early PING. Our agent, which pings our servers every --probe-interval,
/// pings a server that did not offer it by ALPN no more than
/// --keepalive-time asks (an hour by default), and does not probe it: its
/// one stream stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_does_not_ping_an_upstream_server_more_than_it_allows() {
    let Some(go_server) = crate::support::foreign::grpc_go_agent_server() else {
        return;
    };
    let dir = TempDir::new("konn-keepalive");
    let pki = crate::support::certs::Pki::new(dir.path());
    let port_file = dir.path().join("go-server.port");
    let server = Proc::spawn_named(
        "agent_server",
        go_server.to_str().unwrap(),
        &[
            format!("-cert={}", pki.server.cert.display()),
            format!("-key={}", pki.server.key.display()),
            format!("-port-file={}", port_file.display()),
        ],
        dir.path(),
    );
    wait_until(Duration::from_secs(10), "the Go server's port", || async {
        std::fs::read_to_string(&port_file).is_ok_and(|port| !port.is_empty())
    })
    .await;
    let port: u16 = std::fs::read_to_string(&port_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let agent = Agent::start(
        dir.path(),
        &pki,
        port,
        "agent-1",
        &["--probe-interval=100ms".into()],
    );
    wait_until(Duration::from_secs(15), "the agent's stream", || async {
        server
            .log_text()
            .contains("stream 1 opened: /AgentService/Connect")
    })
    .await;
    // Pings every 100 ms would have had the connection closed within a
    // second, and the agent would be on its second stream.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let log = server.log_text();
    assert!(
        !log.contains("ended") && !log.contains("stream 2"),
        "the agent's one stream stays open:\n{log}\nagent:\n{}",
        agent.proc.log_text()
    );
    assert_eq!(metric(agent.health_port, AGENT_SERVERS).await, Some(1.0));
}
