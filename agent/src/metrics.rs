//! The agent's Prometheus metrics, under upstream's names
//! (`konnectivity_network_proxy_agent_*`).

use std::sync::Arc;

use konnectivity_node::metrics::NodeMetrics;
use konnectivity_proto::PacketType;
pub(crate) use konnectivity_telemetry::metrics::Segment;
use konnectivity_telemetry::metrics::{
    ApiHistograms, ApiLabels, GoCounter, LATENCY_BUCKETS, Labels, PacketCounters, Resumes, StreamErrors,
    TunnelsEnded, binary_registry, register,
};
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

/// Which way talking to a server failed (upstream's deprecated
/// `server_connection_failure_count{direction}`).
#[derive(Clone, Copy, Debug)]
pub enum ServerDirection {
    /// Receiving from the server failed.
    FromServer,
    /// Sending to the server failed.
    ToServer,
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
    /// Ours: bytes allocated and not freed (`runtime_heap_bytes`).
    pub heap_bytes: Gauge,
    /// Not upstream's: the node role's.
    pub node: Arc<NodeMetrics>,
    dial_failures: Family<Labels, GoCounter>,
    server_failures: Family<Labels, GoCounter>,
    /// `tunnels_ended_total{reason}`.
    pub tunnels_ended: TunnelsEnded,
    /// Ours: connections resumed on a new server stream (docs/resume.md).
    pub resumes: Resumes,
    packets: PacketCounters,
    pub stream_errors: StreamErrors,
    /// `--count-server-leases`: the lease list and watch calls by outcome.
    lease_lists: Family<ApiLabels, GoCounter>,
    lease_watches: Family<ApiLabels, GoCounter>,
    lease_list_latency: ApiHistograms,
}

/// Upstream agent's lease latency buckets, 5 ms to 30 s.
const LEASE_BUCKETS: [f64; 7] = [0.005, 0.025, 0.1, 0.5, 2.5, 10.0, 30.0];

/// A lease call of the agent: a list or a watch.
#[derive(Clone, Copy, Debug)]
pub enum LeaseCall {
    List,
    Watch,
}

impl Default for AgentMetrics {
    fn default() -> Self {
        let mut metrics = AgentMetrics {
            registry: Registry::default(),
            open_server_connections: Gauge::default(),
            known_server_count: Gauge::default(),
            open_endpoint_connections: Gauge::default(),
            dial_duration: Histogram::new(LATENCY_BUCKETS),
            alive_tasks: Gauge::default(),
            heap_bytes: Gauge::default(),
            node: Arc::default(),
            dial_failures: Family::default(),
            server_failures: Family::default(),
            tunnels_ended: TunnelsEnded::default(),
            resumes: Resumes::default(),
            packets: PacketCounters::default(),
            stream_errors: StreamErrors::default(),
            lease_lists: Family::default(),
            lease_watches: Family::default(),
            lease_list_latency: Family::new_with_constructor(|| Histogram::new(LEASE_BUCKETS)),
        };
        let registry = binary_registry("konnectivity_network_proxy_agent", |registry| {
            // Upstream's families, with its HELP texts word for word (v0.36.0).
            register(
                registry,
                "dial_duration_seconds",
                "Latency of dial to the remote endpoint in seconds",
                metrics.dial_duration.clone(),
            );
            register(
                registry,
                "server_connection_failure_count",
                "Count of failures to send to or receive from the proxy server, labeled by the direction (from_server or to_server). DEPRECATED, please use stream_events_error_total",
                metrics.server_failures.clone(),
            );
            register(
                registry,
                "endpoint_dial_failure_total",
                "Number of failures dialing the remote endpoint, by reason (example: timeout).",
                metrics.dial_failures.clone(),
            );
            register(
                registry,
                "open_server_connections",
                "Current number of open server connections.",
                metrics.open_server_connections.clone(),
            );
            register(
                registry,
                "known_server_count",
                "Current number of servers agent is trying to connect to.",
                metrics.known_server_count.clone(),
            );
            register(
                registry,
                "open_endpoint_connections",
                "Current number of open endpoint connections.",
                metrics.open_endpoint_connections.clone(),
            );
            register(
                registry,
                "lease_lists_total",
                "Count of server lease list calls made by the agent to the k8s apiserver, labeled by HTTP response code and reason",
                metrics.lease_lists.clone(),
            );
            register(
                registry,
                "lease_watches_total",
                "Count of server lease watch calls made by the agent to the k8s apiserver, labeled by HTTP response code and reason",
                metrics.lease_watches.clone(),
            );
            register(
                registry,
                "lease_list_latency_seconds",
                "Latency of server lease listing in seconds",
                metrics.lease_list_latency.clone(),
            );
            metrics.packets = PacketCounters::register(registry, Segment::AGENT);
            metrics.stream_errors = StreamErrors::register(registry);
            // Ours.
            metrics.tunnels_ended = TunnelsEnded::register(registry);
            metrics.resumes = Resumes::register(registry);
            metrics.node = Arc::new(NodeMetrics::register(registry, metrics.resumes.clone()));
            register(
                registry,
                "runtime_alive_tasks",
                "Tasks alive in the agent's async runtime.",
                metrics.alive_tasks.clone(),
            );
            register(
                registry,
                "runtime_heap_bytes",
                "Bytes the agent has allocated and not freed: what a leak grows (resident memory also moves with the allocator's caches).",
                metrics.heap_bytes.clone(),
            );
        });
        AgentMetrics { registry, ..metrics }
    }
}

impl AgentMetrics {
    /// Counts a packet sent (`FromAgent`) or received (`ToAgent`) on a server stream.
    pub fn packet(&self, segment: Segment, kind: PacketType) {
        self.packets.count(segment, kind);
    }

    pub fn server_failure(&self, direction: ServerDirection) {
        let direction = match direction {
            ServerDirection::FromServer => "from_server",
            ServerDirection::ToServer => "to_server",
        };
        self.server_failures
            .get_or_create(&vec![("direction", direction)])
            .inc();
    }

    /// A lease list or watch call answered `status` (upstream counts only
    /// calls that got an answer). Upstream v0.36.0 counts its watches in
    /// `lease_lists_total` by mistake; here each goes to its own family.
    pub fn lease_call(
        &self,
        call: LeaseCall,
        status: http::StatusCode,
        reason: &str,
        took: std::time::Duration,
    ) {
        let code = status.as_u16().to_string();
        let family = match call {
            LeaseCall::List => {
                self.lease_list_latency
                    .get_or_create(&vec![("http_response_code", code.clone())])
                    .observe(took.as_secs_f64());
                &self.lease_lists
            }
            LeaseCall::Watch => &self.lease_watches,
        };
        family
            .get_or_create(&vec![("http_response_code", code), ("reason", reason.to_owned())])
            .inc();
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
