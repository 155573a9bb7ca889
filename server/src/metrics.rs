//! The server's Prometheus metrics, under upstream's names
//! (`konnectivity_network_proxy_server_*`).

use konnectivity_plumbing::metrics::UnsuffixedCounter;
use konnectivity_plumbing::metrics::{LATENCY_BUCKETS, Labels};
use konnectivity_proto::PacketType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Why a dial failed, with upstream's label values where upstream has one.
#[derive(Clone, Copy, Debug)]
pub enum DialFailure {
    /// The agent reported the error.
    Endpoint,
    /// A DIAL_RSP for a dial nobody waits for.
    UnrecognizedResponse,
    /// The frontend went away before the dial completed.
    FrontendClose,
    /// The agent stream ended before the dial completed.
    BackendClose,
    /// No DIAL_RSP within --backend-dial-timeout.
    Timeout,
    /// No backend could be selected.
    NoBackend,
    /// A node client asked for a destination outside the allow-list.
    NodePolicy,
}

impl DialFailure {
    fn label(self) -> &'static str {
        match self {
            DialFailure::Endpoint => "endpoint",
            DialFailure::UnrecognizedResponse => "unrecognized_response",
            DialFailure::FrontendClose => "frontend_close",
            DialFailure::BackendClose => "backend_close",
            DialFailure::Timeout => "timeout",
            DialFailure::NoBackend => "no_backend",
            DialFailure::NodePolicy => "node_policy",
        }
    }
}

/// Which leg of the tunnel a packet travelled on.
#[derive(Clone, Copy, Debug)]
pub enum Segment {
    FromAgent = 0,
    ToAgent = 1,
}

impl Segment {
    const ALL: [Segment; 2] = [Segment::FromAgent, Segment::ToAgent];

    fn label(self) -> &'static str {
        match self {
            Segment::FromAgent => "from_agent",
            Segment::ToAgent => "to_agent",
        }
    }
}

#[derive(Debug)]
pub struct ServerMetrics {
    pub registry: Registry,
    pub established_connections: Gauge,
    pub pending_backend_dials: Gauge,
    pub http_connections: Gauge,
    /// Agent streams connected (upstream's `ready_backend_connections`).
    pub ready_backend_connections: Gauge,
    /// Agents each configured strategy can choose (`ready_backends{proxy_strategy}`).
    ready_backends: Family<Labels, Gauge>,
    pub dial_duration: Histogram,
    pub stream_errors: Counter,
    /// Not upstream's: tasks alive in the runtime, to show nothing leaks.
    pub alive_tasks: Gauge,
    grpc_connections: Family<Labels, Gauge>,
    dial_failures: Family<Labels, UnsuffixedCounter>,
    /// Counters resolved once, indexed by segment then packet type, so the
    /// data path never builds a label set.
    packet_counters: [[Counter; PACKET_TYPES]; 2],
}

/// Upstream's seven packet types and our WINDOW_UPDATE extension.
const PACKET_TYPES: usize = 8;
const ALL_PACKET_TYPES: [PacketType; PACKET_TYPES] = [
    PacketType::DialReq,
    PacketType::DialRsp,
    PacketType::CloseReq,
    PacketType::CloseRsp,
    PacketType::Data,
    PacketType::DialCls,
    PacketType::Drain,
    PacketType::WindowUpdate,
];

/// Index of a packet type in [`ALL_PACKET_TYPES`].
fn packet_index(kind: PacketType) -> usize {
    match kind {
        PacketType::WindowUpdate => 7,
        upstream => upstream as usize,
    }
}

impl Default for ServerMetrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("konnectivity_network_proxy_server");
        let metrics = ServerMetrics {
            established_connections: Gauge::default(),
            pending_backend_dials: Gauge::default(),
            http_connections: Gauge::default(),
            ready_backend_connections: Gauge::default(),
            ready_backends: Family::default(),
            dial_duration: Histogram::new(LATENCY_BUCKETS),
            stream_errors: Counter::default(),
            alive_tasks: Gauge::default(),
            grpc_connections: Family::default(),
            dial_failures: Family::default(),
            packet_counters: Default::default(),
            registry: Registry::default(),
        };
        let stream_packets = Family::<Labels, Counter>::default();
        let mut packet_counters: [[Counter; PACKET_TYPES]; 2] = Default::default();
        for (segment, counters) in packet_counters.iter_mut().enumerate() {
            for (kind, counter) in ALL_PACKET_TYPES.into_iter().zip(counters.iter_mut()) {
                *counter = stream_packets
                    .get_or_create(&vec![
                        ("segment", Segment::ALL[segment].label()),
                        ("packet_type", kind.as_str_name()),
                    ])
                    .clone();
            }
        }
        registry.register(
            "established_connections",
            "Current number of established end-to-end connections",
            metrics.established_connections.clone(),
        );
        registry.register(
            "pending_backend_dials",
            "Current number of pending backend dial requests",
            metrics.pending_backend_dials.clone(),
        );
        registry.register(
            "http_connections",
            "Number of current HTTP CONNECT connections",
            metrics.http_connections.clone(),
        );
        registry.register(
            "ready_backend_connections",
            "Number of konnectivity agent streams connected to this server",
            metrics.ready_backend_connections.clone(),
        );
        registry.register(
            "ready_backends",
            "Number of agents each proxy strategy can choose",
            metrics.ready_backends.clone(),
        );
        registry.register(
            "dial_duration_seconds",
            "Latency of dial to the remote endpoint in seconds",
            metrics.dial_duration.clone(),
        );
        registry.register(
            "stream_errors",
            "Packets and streams rejected as invalid",
            metrics.stream_errors.clone(),
        );
        registry.register(
            "runtime_alive_tasks",
            "Tasks alive in the server's async runtime",
            metrics.alive_tasks.clone(),
        );
        registry.register(
            "grpc_connections",
            "Number of current grpc connections, partitioned by service method",
            metrics.grpc_connections.clone(),
        );
        registry.register(
            "dial_failure_count",
            "Number of dial failures observed, by reason",
            metrics.dial_failures.clone(),
        );
        registry.register(
            "stream_packets",
            "Packets on gRPC streams, by segment and packet type",
            stream_packets,
        );
        ServerMetrics {
            registry,
            packet_counters,
            ..metrics
        }
    }
}

impl ServerMetrics {
    pub fn dial_failed(&self, reason: DialFailure) {
        self.dial_failures
            .get_or_create(&vec![("reason", reason.label())])
            .inc();
    }

    pub fn grpc_connections(&self, service_method: &'static str) -> Gauge {
        self.grpc_connections
            .get_or_create(&vec![("service_method", service_method)])
            .clone()
    }

    /// Sets the number of agents `strategy` (its flag name) can choose.
    pub fn set_ready_backends(&self, strategy: &'static str, count: usize) {
        self.ready_backends
            .get_or_create(&vec![("proxy_strategy", strategy)])
            .set(count as i64);
    }

    pub fn packet(&self, segment: Segment, kind: PacketType) {
        self.packet_counters[segment as usize][packet_index(kind)].inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_packet_type_has_its_own_counter() {
        for (index, kind) in ALL_PACKET_TYPES.into_iter().enumerate() {
            assert_eq!(packet_index(kind), index, "{kind:?}");
        }
        let metrics = ServerMetrics::default();
        metrics.packet(Segment::FromAgent, PacketType::WindowUpdate);
        let text = konnectivity_plumbing::metrics::encode(&metrics.registry);
        assert!(text.contains(r#"packet_type="WINDOW_UPDATE"} 1"#), "{text}");
    }
}
