//! The node role's metrics, in the agent's registry
//! (`konnectivity_network_proxy_agent_*`; none of them upstream's).

use konnectivity_telemetry::metrics::{GoCounter, Labels, Resumes, register};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// What became of a captured connection (node role).
#[derive(Clone, Copy, Debug)]
pub enum CaptureOutcome {
    Tunneled,
    /// Its original destination is not in the capture map: closed, never forwarded.
    UnknownDestination,
    /// The node tunnel is not connected: reset so the client retries.
    TunnelUnavailable,
    /// The server or control-plane agent could not reach the target.
    DialFailed,
}

#[derive(Debug, Default)]
pub struct NodeMetrics {
    /// Captured connections being tunneled now.
    pub captured_connections_open: Gauge,
    /// Whether the node tunnel is connected and answers (PINGs, probes).
    pub node_tunnel_up: Gauge,
    captured: Family<Labels, GoCounter>,
    handover: Family<Labels, GoCounter>,
    taken_over: Family<Labels, GoCounter>,
    sessions_handover: Family<Labels, GoCounter>,
    sessions_taken_over: Family<Labels, GoCounter>,
    /// Captured connections carried over to a new stream of the node
    /// tunnel: the agent's resume counters, shared with its agent streams.
    pub resumes: Resumes,
}

impl NodeMetrics {
    /// The node role's families, registered in the agent's `registry`.
    pub fn register(registry: &mut Registry, resumes: Resumes) -> NodeMetrics {
        let metrics = NodeMetrics {
            resumes,
            ..NodeMetrics::default()
        };
        register(
            registry,
            "captured_connections_open",
            "Captured node connections being tunneled now.",
            metrics.captured_connections_open.clone(),
        );
        register(
            registry,
            "node_tunnel_up",
            "1 while the node tunnel to the server's node frontend is connected and answers (its HTTP/2 PINGs, and a probe stream every 30 s), 0 while it does not (node role).",
            metrics.node_tunnel_up.clone(),
        );
        register(
            registry,
            "captured_connections_total",
            "Captured node connections, by outcome.",
            metrics.captured.clone(),
        );
        register(
            registry,
            "captured_connections_handover_total",
            "Established captured connections at hand-overs to a newer agent, by outcome: handed_over, not_sent (the exchange failed; reset), not_resumable and busy (kept by this agent until they end).",
            metrics.handover.clone(),
        );
        register(
            registry,
            "captured_connections_taken_over_total",
            "Established captured connections taken over from the previous agent, by outcome: resumed, failed (reset).",
            metrics.taken_over.clone(),
        );
        register(
            registry,
            "egress_sessions_handover_total",
            "Agent-stream sessions (each with its egress connections) at hand-overs to a newer agent, by outcome: handed_over, not_sent (the exchange failed; reset), not_resumable and busy (kept by this agent until their connections end).",
            metrics.sessions_handover.clone(),
        );
        register(
            registry,
            "egress_sessions_taken_over_total",
            "Agent-stream sessions taken over from the previous agent, by outcome: resumed, failed (their connections closed).",
            metrics.sessions_taken_over.clone(),
        );
        metrics
    }

    /// A hand-over to a newer agent: what became of the connections.
    pub fn handed_over(&self, sent: usize, not_sent: usize, not_resumable: usize, busy: usize) {
        count_handover(&self.handover, sent, not_sent, not_resumable, busy);
    }

    /// Connections taken over from the previous agent.
    pub fn taken_over(&self, resumed: usize, failed: usize) {
        count_taken_over(&self.taken_over, resumed, failed);
    }

    /// A hand-over to a newer agent: what became of the egress sessions.
    pub fn sessions_handed_over(&self, sent: usize, not_sent: usize, not_resumable: usize, busy: usize) {
        count_handover(&self.sessions_handover, sent, not_sent, not_resumable, busy);
    }

    /// Egress sessions taken over from the previous agent.
    pub fn sessions_taken_over(&self, resumed: usize, failed: usize) {
        count_taken_over(&self.sessions_taken_over, resumed, failed);
    }

    pub fn captured(&self, outcome: CaptureOutcome) {
        let outcome = match outcome {
            CaptureOutcome::Tunneled => "tunneled",
            CaptureOutcome::UnknownDestination => "unknown_destination",
            CaptureOutcome::TunnelUnavailable => "tunnel_unavailable",
            CaptureOutcome::DialFailed => "dial_failed",
        };
        self.captured.get_or_create(&vec![("outcome", outcome)]).inc();
    }
}

fn count_handover(
    family: &Family<Labels, GoCounter>,
    sent: usize,
    not_sent: usize,
    not_resumable: usize,
    busy: usize,
) {
    for (outcome, count) in [
        ("handed_over", sent),
        ("not_sent", not_sent),
        ("not_resumable", not_resumable),
        ("busy", busy),
    ] {
        family
            .get_or_create(&vec![("outcome", outcome)])
            .inc_by(count as u64);
    }
}

fn count_taken_over(family: &Family<Labels, GoCounter>, resumed: usize, failed: usize) {
    for (outcome, count) in [("resumed", resumed), ("failed", failed)] {
        family
            .get_or_create(&vec![("outcome", outcome)])
            .inc_by(count as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The node role's families under the agent's prefix, as Go's client
    /// writes them (a counter's TYPE line with its `_total`).
    #[test]
    fn the_node_families_are_written_under_the_agents_prefix() {
        let mut registry = Registry::with_prefix("konnectivity_network_proxy_agent");
        let metrics = NodeMetrics::register(&mut registry, Resumes::default());
        metrics.captured(CaptureOutcome::Tunneled);
        metrics.captured(CaptureOutcome::TunnelUnavailable);
        metrics.node_tunnel_up.set(1);
        let text = konnectivity_telemetry::metrics::encode(&registry);
        for line in [
            "# TYPE konnectivity_network_proxy_agent_captured_connections_total counter\n",
            "konnectivity_network_proxy_agent_captured_connections_total{outcome=\"tunneled\"} 1\n",
            "konnectivity_network_proxy_agent_captured_connections_total{outcome=\"tunnel_unavailable\"} 1\n",
            "konnectivity_network_proxy_agent_node_tunnel_up 1\n",
            "konnectivity_network_proxy_agent_captured_connections_open 0\n",
        ] {
            assert!(text.contains(line), "{line:?} missing from:\n{text}");
        }
    }
}
