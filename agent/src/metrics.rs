//! The agent's Prometheus metrics, under upstream's names
//! (`konnectivity_network_proxy_agent_*`).

pub use konnectivity_plumbing::metrics::Segment;
use konnectivity_plumbing::metrics::{LATENCY_BUCKETS, Labels, PacketCounters, StreamErrors};
use konnectivity_proto::PacketType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Upstream's reasons for `endpoint_dial_failure_total`, and ours.
#[derive(Clone, Copy, Debug)]
pub enum DialFailure {
    Timeout,
    Unknown,
    /// Ours: refused by --max-endpoint-connections.
    Limit,
}

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

#[derive(Debug)]
pub struct AgentMetrics {
    pub registry: Registry,
    pub open_server_connections: Gauge,
    /// The `servercount` the last server announced.
    pub known_server_count: Gauge,
    pub open_endpoint_connections: Gauge,
    pub dial_duration: Histogram,
    /// Not upstream's: tasks alive in the runtime, to show nothing leaks.
    pub alive_tasks: Gauge,
    /// Not upstream's: captured connections being tunneled now.
    pub captured_connections_open: Gauge,
    captured: Family<Labels, Counter>,
    dial_failures: Family<Labels, Counter>,
    packets: PacketCounters,
    pub stream_errors: StreamErrors,
}

impl Default for AgentMetrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("konnectivity_network_proxy_agent");
        let open_server_connections = Gauge::default();
        let known_server_count = Gauge::default();
        let open_endpoint_connections = Gauge::default();
        let dial_duration = Histogram::new(LATENCY_BUCKETS);
        let dial_failures = Family::<Labels, Counter>::default();
        let alive_tasks = Gauge::default();
        let captured_connections_open = Gauge::default();
        let captured = Family::<Labels, Counter>::default();
        registry.register(
            "captured_connections_open",
            "Captured node connections being tunneled now",
            captured_connections_open.clone(),
        );
        registry.register(
            "captured_connections",
            "Captured node connections, by outcome",
            captured.clone(),
        );
        registry.register(
            "runtime_alive_tasks",
            "Tasks alive in the agent's async runtime",
            alive_tasks.clone(),
        );
        registry.register(
            "open_server_connections",
            "Current number of open connections to proxy-servers",
            open_server_connections.clone(),
        );
        registry.register(
            "known_server_count",
            "Number of proxy-servers the agent should hold connections to",
            known_server_count.clone(),
        );
        registry.register(
            "open_endpoint_connections",
            "Current number of open connections to endpoints",
            open_endpoint_connections.clone(),
        );
        registry.register(
            "dial_duration_seconds",
            "Latency of dials to endpoints in seconds",
            dial_duration.clone(),
        );
        // prometheus-client appends `_total`, giving upstream's
        // `endpoint_dial_failure_total`.
        registry.register(
            "endpoint_dial_failure",
            "Number of failed dials to endpoints, by reason",
            dial_failures.clone(),
        );
        let packets = PacketCounters::register(&mut registry, Segment::AGENT);
        let stream_errors = StreamErrors::register(&mut registry);
        AgentMetrics {
            registry,
            packets,
            stream_errors,
            open_server_connections,
            known_server_count,
            open_endpoint_connections,
            dial_duration,
            alive_tasks,
            captured_connections_open,
            captured,
            dial_failures,
        }
    }
}

impl AgentMetrics {
    /// Counts a packet sent (`FromAgent`) or received (`ToAgent`) on a server stream.
    pub fn packet(&self, segment: Segment, kind: PacketType) {
        self.packets.count(segment, kind);
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

    pub fn dial_failed(&self, reason: DialFailure) {
        let reason = match reason {
            DialFailure::Timeout => "timeout",
            DialFailure::Unknown => "unknown",
            DialFailure::Limit => "limit",
        };
        self.dial_failures.get_or_create(&vec![("reason", reason)]).inc();
    }
}
