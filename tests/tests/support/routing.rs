//! Which agent serves a dial: targets on distinct loopback addresses (any
//! 127.0.0.0/8 address is loopback), so that agents' identifiers can name
//! them, and the agent whose own dial counter moved.

use std::path::Path;

use super::connect::{Refused, via_uds};
use super::procs::Agent;
use super::scrape::metric;
use super::targets::{self, Target};

const DIALS: &str = "konnectivity_network_proxy_agent_dial_duration_seconds_count";

/// A blob target on `ip`, and its address as a CONNECT request names it.
pub async fn target_on(ip: &str) -> (Target, String) {
    let target = targets::blob_on(targets::listener_on(ip.parse().unwrap())).await;
    let address = target.addr.to_string();
    (target, address)
}

async fn dial_counts(agents: &[(&'static str, &Agent)]) -> Vec<f64> {
    let mut counts = Vec::new();
    for (_, agent) in agents {
        counts.push(metric(agent.health_port, DIALS).await.unwrap_or(0.0));
    }
    counts
}

/// Dials `address` through the CONNECT frontend at `uds`, moves bytes, and
/// names the one agent of `agents` whose dial counter moved; the server's
/// answer when it refused the dial.
pub async fn served_by(
    uds: &Path,
    agents: &[(&'static str, &Agent)],
    address: &str,
) -> Result<&'static str, Refused> {
    let before = dial_counts(agents).await;
    let mut tunnel = via_uds(uds, address).await.unwrap()?;
    let (sent, received) = targets::push(&mut tunnel, 4096, 1).await.unwrap();
    assert_eq!(sent, received);
    let after = dial_counts(agents).await;
    let moved: Vec<_> = agents
        .iter()
        .zip(before.iter().zip(&after))
        .filter(|(_, (b, a))| a > b)
        .map(|((name, _), _)| *name)
        .collect();
    assert_eq!(moved.len(), 1, "exactly one agent dials {address}: {moved:?}");
    Ok(moved[0])
}
