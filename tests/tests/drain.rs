//! Draining an agent, as an operator does before taking a node away: the
//! first SIGTERM sends DRAIN, the server stops choosing that agent for new
//! dials while another one is available, and connections already open on
//! it carry on until they end.

use std::time::Duration;

use crate::support::cluster::Setup;
use crate::support::connect::via_uds;
use crate::support::scrape::{http_get, metric};
use crate::support::targets::{self, pattern_digest};
use crate::support::wait_until;

const OPEN_ENDPOINTS: &str = "konnectivity_network_proxy_agent_open_endpoint_connections";
const DIALS: &str = "konnectivity_network_proxy_agent_dial_duration_seconds_count";

async fn gauge(port: u16, series: &str) -> f64 {
    metric(port, series).await.unwrap_or(-1.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_agent_gets_no_new_dials_while_its_open_transfer_completes() {
    let setup = Setup::start("http-connect", true, &[]).await;
    let other = setup.start_agent("agent-2", &[]);
    setup.server.wait_backends(2).await;
    let target = targets::blob().await;
    let uds = setup.server.uds_path();

    // One long-lived tunnel; find out which agent carries it.
    let mut open = via_uds(uds, &target.addr.to_string())
        .await
        .unwrap()
        .expect("CONNECT accepted");
    let (sent, received) = targets::push(&mut open, 8 << 20, 1).await.unwrap();
    assert_eq!(sent, received);
    let (first, second) = (setup.agent.health_port, other.health_port);
    let (draining, serving, draining_proc) = if gauge(first, OPEN_ENDPOINTS).await == 1.0 {
        (first, second, &setup.agent.proc)
    } else {
        assert_eq!(
            gauge(second, OPEN_ENDPOINTS).await,
            1.0,
            "one agent carries the tunnel"
        );
        (second, first, &other.proc)
    };

    draining_proc.signal("TERM");
    wait_until(
        Duration::from_secs(5),
        "the agent reports draining",
        || async move { http_get(draining, "/readyz").await.map(|(status, _)| status).ok() == Some(503) },
    )
    .await;
    // DRAIN travels on the agent's stream right after its /readyz turns.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let dials_before = (gauge(draining, DIALS).await, gauge(serving, DIALS).await);
    for seed in 0..20 {
        let mut tunnel = via_uds(uds, &target.addr.to_string())
            .await
            .unwrap()
            .expect("CONNECT accepted while one agent drains");
        let (sent, received) = targets::push(&mut tunnel, 4096, seed).await.unwrap();
        assert_eq!(sent, received);
    }
    assert_eq!(
        gauge(draining, DIALS).await,
        dials_before.0,
        "no new dial may reach the draining agent"
    );
    assert_eq!(gauge(serving, DIALS).await, dials_before.1 + 20.0);

    // The tunnel opened before the drain still works both ways.
    let (sent, received) = targets::push(&mut open, 64 << 20, 2).await.unwrap();
    assert_eq!(sent, received, "pushed bytes arrive intact on the draining agent");
    let pulled = targets::pull(&mut open, 64 << 20, 3).await.unwrap();
    assert_eq!(pulled, pattern_digest(64 << 20, 3), "pulled bytes arrive intact");
    drop(open);
    wait_until(
        Duration::from_secs(5),
        "the draining agent's tunnel closes",
        || async move { gauge(draining, OPEN_ENDPOINTS).await == 0.0 },
    )
    .await;
}
