//! The server's Prometheus metrics, under upstream's names
//! (`konnectivity_network_proxy_server_*`).

use std::time::{Duration, Instant};

use konnectivity_proto::PacketType;
pub(crate) use konnectivity_telemetry::metrics::Segment;
use konnectivity_telemetry::metrics::{
    ApiHistograms, ApiLabels, DEFAULT_BUCKETS, GaugeGuard, GoCounter, LATENCY_BUCKETS, Labels,
    PacketCounters, Resumes, StreamErrors, TunnelsEnded, binary_registry, register,
};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Why a dial failed: upstream's `dial_failure_count` reasons, plus one of
/// ours for a failure upstream has no path for.
#[derive(Clone, Copy, Debug)]
pub enum DialFailure {
    /// No agent could be chosen for the destination.
    NoAgent,
    /// The agent reported the error in its DIAL_RSP.
    ErrorResponse,
    /// A DIAL_RSP for a dial nobody waits for.
    UnrecognizedResponse,
    /// The agent dialed, but the frontend was gone before it heard so.
    SendResponse,
    /// The agent closed the dial (DIAL_CLS) or its stream ended first.
    BackendClose,
    /// The frontend cancelled (DIAL_CLS) or went away first.
    FrontendClose,
    /// No DIAL_RSP within --backend-dial-timeout.
    BackendDialTimeout,
    /// Ours: a node client asked for a destination outside the allow-list.
    NodePolicy,
}

impl DialFailure {
    fn label(self) -> &'static str {
        match self {
            DialFailure::NoAgent => "no_agent",
            DialFailure::ErrorResponse => "error_response",
            DialFailure::UnrecognizedResponse => "unrecognized_response",
            DialFailure::SendResponse => "send_rsp",
            DialFailure::BackendClose => "backend_close",
            DialFailure::FrontendClose => "frontend_close",
            DialFailure::BackendDialTimeout => "backend_dial_timeout",
            DialFailure::NodePolicy => "node_policy",
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
    /// How long established connections lasted (upstream master's).
    connection_duration: Histogram,
    /// How long writing a chunk to the frontend client took.
    pub frontend_write_duration: Histogram,
    pub stream_errors: StreamErrors,
    /// Agent streams whose reading waits on one connection's full buffer
    /// (only with agents that did not negotiate flow control).
    full_receive_channels: Family<Labels, Gauge>,
    /// Not upstream's: tasks alive in the runtime, to show nothing leaks.
    pub alive_tasks: Gauge,
    /// Ours: bytes allocated and not freed (`runtime_heap_bytes`).
    pub heap_bytes: Gauge,
    grpc_connections: Family<Labels, Gauge>,
    /// Ours: requests refused by --max-tunnels-per-frontend, by frontend.
    limit_refusals: Family<Labels, GoCounter>,
    /// `tunnels_ended_total{reason}`.
    pub tunnels_ended: TunnelsEnded,
    /// Ours: agent streams' connections resumed (docs/resume.md).
    pub resumes: Resumes,
    /// Ours: CONNECT requests refused before any dial, by HTTP status.
    connect_rejections: Family<Labels, GoCounter>,
    /// Ours: agents' identifier claims by outcome and reason
    /// (`--agent-identifiers-check`).
    identifier_claims: Family<Labels, GoCounter>,
    /// Ours: node tunnel streams opened, by whether the certificate names a
    /// node; and the nodes with streams open.
    node_streams: Family<Labels, GoCounter>,
    node_frontend_nodes: Gauge,
    /// Ours: probe streams of agents answered.
    pub agent_probes: GoCounter,
    dial_failures: Family<Labels, GoCounter>,
    /// The lease garbage collector's (`--enable-lease-controller`): expired
    /// Leases it deleted, and its list and delete calls by outcome.
    culled_leases: GoCounter,
    lease_delete_latency: ApiHistograms,
    lease_deletes: Family<ApiLabels, GoCounter>,
    lease_list_latency: ApiHistograms,
    lease_lists: Family<ApiLabels, GoCounter>,
    packets: PacketCounters,
}

/// Upstream master's `connection_duration_seconds` buckets, 1 s to 24 h.
const CONNECTION_DURATION_BUCKETS: [f64; 12] = [
    1.0, 5.0, 15.0, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 14400.0, 43200.0, 86400.0,
];

impl Default for ServerMetrics {
    fn default() -> Self {
        let mut metrics = ServerMetrics {
            established_connections: Gauge::default(),
            pending_backend_dials: Gauge::default(),
            http_connections: Gauge::default(),
            ready_backend_connections: Gauge::default(),
            ready_backends: Family::default(),
            dial_duration: Histogram::new(LATENCY_BUCKETS),
            connection_duration: Histogram::new(CONNECTION_DURATION_BUCKETS),
            frontend_write_duration: Histogram::new(LATENCY_BUCKETS),
            stream_errors: StreamErrors::default(),
            full_receive_channels: Family::default(),
            alive_tasks: Gauge::default(),
            heap_bytes: Gauge::default(),
            grpc_connections: Family::default(),
            limit_refusals: Family::default(),
            tunnels_ended: TunnelsEnded::default(),
            resumes: Resumes::default(),
            connect_rejections: Family::default(),
            identifier_claims: Family::default(),
            node_streams: Family::default(),
            node_frontend_nodes: Gauge::default(),
            agent_probes: GoCounter::default(),
            dial_failures: Family::default(),
            culled_leases: GoCounter::default(),
            lease_delete_latency: Family::new_with_constructor(|| Histogram::new(DEFAULT_BUCKETS)),
            lease_deletes: Family::default(),
            lease_list_latency: Family::new_with_constructor(|| Histogram::new(DEFAULT_BUCKETS)),
            lease_lists: Family::default(),
            packets: PacketCounters::default(),
            registry: Registry::default(),
        };
        let registry = binary_registry("konnectivity_network_proxy_server", |registry| {
            // Upstream's families, with its HELP texts word for word (v0.36.0;
            // connection_duration_seconds from master).
            register(
                registry,
                "dial_duration_seconds",
                "Latency of dial to the remote endpoint in seconds",
                metrics.dial_duration.clone(),
            );
            register(
                registry,
                "frontend_write_duration_seconds",
                "Latency of write to the frontend in seconds",
                metrics.frontend_write_duration.clone(),
            );
            register(
                registry,
                "connection_duration_seconds",
                "Duration in seconds a proxied end-to-end connection was established (post-dial) before being closed.",
                metrics.connection_duration.clone(),
            );
            register(
                registry,
                "grpc_connections",
                "Number of current grpc connections, partitioned by service method.",
                metrics.grpc_connections.clone(),
            );
            register(
                registry,
                "http_connections",
                "Number of current HTTP CONNECT connections",
                metrics.http_connections.clone(),
            );
            register(
                registry,
                "ready_backend_connections",
                "Number of konnectivity agent connected to the proxy server. DEPRECATED, please use ready_backends",
                metrics.ready_backend_connections.clone(),
            );
            register(
                registry,
                "ready_backends",
                "Number of konnectivity agent connected to the proxy server",
                metrics.ready_backends.clone(),
            );
            register(
                registry,
                "pending_backend_dials",
                "Current number of pending backend dial requests",
                metrics.pending_backend_dials.clone(),
            );
            register(
                registry,
                "established_connections",
                "Current number of established end-to-end connections (post-dial).",
                metrics.established_connections.clone(),
            );
            register(
                registry,
                "full_receive_channels",
                "Number of current connections blocked by a full receive channel, partitioned by service method.",
                metrics.full_receive_channels.clone(),
            );
            register(
                registry,
                "dial_failure_count",
                "Number of dial failures observed. Multiple failures can occur for a single dial request.",
                metrics.dial_failures.clone(),
            );
            register(
                registry,
                "culled_leases_count",
                "Count of expired leases that the lease garbage collection controller has culled.",
                metrics.culled_leases.clone(),
            );
            // Upstream's texts, its typo ("delection") and the list counter's
            // copy of the delete counter's text included.
            register(
                registry,
                "lease_delete_latency_seconds",
                "Latency of lease deletion calls by the garbage collection controller in seconds.",
                metrics.lease_delete_latency.clone(),
            );
            register(
                registry,
                "lease_delete_total",
                "Count of lease delection calls by the garbage collection controller. Labeled by HTTP status code and reason.",
                metrics.lease_deletes.clone(),
            );
            register(
                registry,
                "lease_list_latency_seconds",
                "Latency of lease list calls by the garbage collection controller in seconds.",
                metrics.lease_list_latency.clone(),
            );
            register(
                registry,
                "lease_list_total",
                "Count of lease deletion calls by the garbage collection controller. Labeled by HTTP status code and reason.",
                metrics.lease_lists.clone(),
            );
            metrics.packets = PacketCounters::register(registry, Segment::ALL);
            metrics.stream_errors = StreamErrors::register(registry);
            // Ours.
            register(
                registry,
                "runtime_alive_tasks",
                "Tasks alive in the server's async runtime.",
                metrics.alive_tasks.clone(),
            );
            register(
                registry,
                "runtime_heap_bytes",
                "Bytes the server has allocated and not freed: what a leak grows (resident memory also moves with the allocator's caches).",
                metrics.heap_bytes.clone(),
            );
            metrics.tunnels_ended = TunnelsEnded::register(registry);
            metrics.resumes = Resumes::register(registry);
            register(
                registry,
                "tunnel_limit_refusals_total",
                "Tunnels refused by --max-tunnels-per-frontend, by frontend.",
                metrics.limit_refusals.clone(),
            );
            register(
                registry,
                "http_connect_rejections_total",
                "CONNECT requests refused before any dial (malformed, not CONNECT, head too large or too slow), by HTTP status.",
                metrics.connect_rejections.clone(),
            );
            register(
                registry,
                "agent_identifier_claims_total",
                "Identifiers agents claimed (--agent-identifiers), by outcome (admitted, dropped, refused, unchecked) and reason: whether the node the agent's credential names has them (--agent-identifiers-check).",
                metrics.identifier_claims.clone(),
            );
            register(
                registry,
                "node_frontend_streams_total",
                "Node tunnel streams opened on the node frontend, by identity: node (the client certificate names its node, system:node:NAME) or no_node.",
                metrics.node_streams.clone(),
            );
            register(
                registry,
                "agent_probes_total",
                "Probe streams of agents answered: an agent of ours checking a connection that is not watched by HTTP/2 PINGs, or asking for the server count; nothing is registered.",
                metrics.agent_probes.clone(),
            );
            register(
                registry,
                "node_frontend_nodes",
                "Nodes with node tunnel streams open on the node frontend, as their client certificates name them.",
                metrics.node_frontend_nodes.clone(),
            );
        });
        // Present from the start, so a dashboard sees 0 rather than nothing.
        metrics.full_receive_channels("Connect");
        ServerMetrics { registry, ..metrics }
    }
}

/// An established connection, counted in `established_connections` while
/// it lives and observed in `connection_duration_seconds` when it ends.
#[derive(Debug)]
pub struct Established {
    _open: GaugeGuard,
    duration: Histogram,
    since: Instant,
}

impl Drop for Established {
    fn drop(&mut self) {
        self.duration.observe(self.since.elapsed().as_secs_f64());
    }
}

impl ServerMetrics {
    /// A connection just established (DIAL_RSP without error).
    pub fn established(&self) -> Established {
        Established {
            _open: GaugeGuard::new(&self.established_connections),
            duration: self.connection_duration.clone(),
            since: Instant::now(),
        }
    }

    /// The lease garbage collector deleted an expired Lease.
    pub fn lease_culled(&self) {
        self.culled_leases.inc();
    }

    /// A lease list call of the garbage collector answered `status`.
    pub fn lease_listed(&self, status: http::StatusCode, reason: &str, took: Duration) {
        observe_call(&self.lease_lists, &self.lease_list_latency, status, reason, took);
    }

    /// A lease delete call of the garbage collector answered `status`.
    pub fn lease_deleted(&self, status: http::StatusCode, reason: &str, took: Duration) {
        observe_call(
            &self.lease_deletes,
            &self.lease_delete_latency,
            status,
            reason,
            took,
        );
    }

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

    /// A CONNECT request refused with `status` before any dial.
    pub fn connect_rejected(&self, status: u16) {
        let status = match status {
            400 => "400",
            405 => "405",
            408 => "408",
            431 => "431",
            _ => "other",
        };
        self.connect_rejections
            .get_or_create(&vec![("status", status)])
            .inc();
    }

    /// One identifier claim judged: `outcome` admitted, dropped, refused or
    /// unchecked, for `reason`.
    pub fn identifier_claim(&self, outcome: &'static str, reason: &'static str) {
        self.identifier_claims
            .get_or_create(&vec![("outcome", outcome), ("reason", reason)])
            .inc();
    }

    /// A node tunnel stream opened; `identity` node or no_node.
    pub fn node_stream_opened(&self, identity: &'static str) {
        self.node_streams
            .get_or_create(&vec![("identity", identity)])
            .inc();
    }

    pub fn set_node_frontend_nodes(&self, nodes: usize) {
        self.node_frontend_nodes.set(nodes as i64);
    }

    pub fn limit_refused(&self, frontend: &'static str) {
        self.limit_refusals
            .get_or_create(&vec![("frontend", frontend)])
            .inc();
    }

    /// The gauge of streams of `service_method` blocked on a full receive channel.
    pub fn full_receive_channels(&self, service_method: &'static str) -> Gauge {
        self.full_receive_channels
            .get_or_create(&vec![("service_method", service_method)])
            .clone()
    }

    pub fn packet(&self, segment: Segment, kind: PacketType) {
        self.packets.count(segment, kind);
    }
}

/// Counts a kube-apiserver call and observes its latency, labelled as
/// upstream's server labels them (`http_status_code`, `reason`).
fn observe_call(
    calls: &Family<ApiLabels, GoCounter>,
    latency: &ApiHistograms,
    status: http::StatusCode,
    reason: &str,
    took: Duration,
) {
    let code = status.as_u16().to_string();
    calls
        .get_or_create(&vec![
            ("http_status_code", code.clone()),
            ("reason", reason.to_owned()),
        ])
        .inc();
    latency
        .get_or_create(&vec![("http_status_code", code)])
        .observe(took.as_secs_f64());
}
