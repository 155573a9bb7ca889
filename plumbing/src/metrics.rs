//! Prometheus metrics written as upstream's Go binaries write them: the text
//! format 0.0.4 of Go's client, with upstream's names and HELP texts.
//!
//! prometheus-client speaks OpenMetrics, which differs from Go's text format
//! in ways parsers notice: a counter's `# TYPE` line omits the `_total` its
//! samples carry (Go's expfmt and Prometheus then read the samples as an
//! untyped family without help), every HELP text gets a period appended, and
//! the exposition ends with `# EOF`. So every family here is registered with
//! [`register`], which writes its name and help exactly as given, counters
//! are [`GoCounter`]s, whose samples carry exactly the family's name, and
//! [`encode`] leaves out `# EOF`.

pub mod process;
mod tunnels;

pub use tunnels::{EndReason, TunnelBytes, TunnelRecord, TunnelsEnded};

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use konnectivity_proto::PacketType;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::Registry;

/// Label sets with static names and values, as all of ours are.
pub type Labels = Vec<(&'static str, &'static str)>;

/// Upstream's dial latency buckets, 1 µs to 12.5 s.
pub const LATENCY_BUCKETS: [f64; 9] = [0.000001, 0.00001, 0.0001, 0.005, 0.025, 0.1, 0.5, 2.5, 12.5];

/// The Go client's default histogram buckets, 5 ms to 10 s, which upstream's
/// lease metrics use.
pub const DEFAULT_BUCKETS: [f64; 11] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

/// Labels of a kube-apiserver call's outcome: an HTTP status code, and for
/// counters the `Status` reason (`Conflict`, …; empty on success).
pub type ApiLabels = Vec<(&'static str, String)>;

/// Histograms by [`ApiLabels`], each made with the family's buckets.
pub type ApiHistograms = Family<ApiLabels, Histogram, fn() -> Histogram>;

/// The content type of [`encode`]'s output (Prometheus text format 0.0.4).
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// A registry for one binary: the process families (unprefixed, as Go's
/// client exposes them) at its root, and a sub-registry with `prefix`
/// (e.g. `konnectivity_network_proxy_server`) for everything else, which
/// `fill` registers.
pub fn binary_registry(prefix: &str, fill: impl FnOnce(&mut Registry)) -> Registry {
    let mut root = Registry::default();
    root.register_collector(Box::new(process::ProcessCollector));
    fill(root.sub_registry_with_prefix(prefix));
    root
}

/// Registers `metric` as the family `name` (after the registry's prefix)
/// with exactly `help` as its HELP text.
pub fn register<M>(registry: &mut Registry, name: &'static str, help: &'static str, metric: M)
where
    M: EncodeMetric + std::fmt::Debug + Send + Sync + 'static,
{
    registry.register_collector(Box::new(Described { name, help, metric }));
}

/// A metric with its family's name and help, encoded without changes.
#[derive(Debug)]
struct Described<M> {
    name: &'static str,
    help: &'static str,
    metric: M,
}

impl<M: EncodeMetric + std::fmt::Debug + Send + Sync + 'static> Collector for Described<M> {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let metric_encoder =
            encoder.encode_descriptor(self.name, self.help, None, self.metric.metric_type())?;
        self.metric.encode(metric_encoder)
    }
}

/// The `/metrics` reply: the registry's text, with `alive_tasks` first set
/// to the number of tasks alive in the current runtime and `heap_bytes` to
/// the bytes allocated and not freed (a leak shows in one or the other).
pub fn reply(registry: &Registry, alive_tasks: &Gauge, heap_bytes: &Gauge) -> crate::http::Reply {
    let tasks = tokio::runtime::Handle::current().metrics().num_alive_tasks();
    alive_tasks.set(tasks as i64);
    heap_bytes.set(crate::sys::heap_bytes());
    crate::http::Reply {
        status: http::StatusCode::OK,
        content_type: CONTENT_TYPE,
        headers: Vec::new(),
        body: encode(registry).into(),
    }
}

/// The registry in the text format 0.0.4 (no OpenMetrics `# EOF`).
pub fn encode(registry: &Registry) -> String {
    let mut text = String::new();
    prometheus_client::encoding::text::encode_registry(&mut text, registry)
        .expect("writing to a String cannot fail");
    text
}

/// A counter as Go's client exposes it: its samples carry exactly the
/// family's name (`…_total` where upstream's name has it, and nothing
/// appended where it does not, as in `dial_failure_count`), and the family
/// is typed `counter`.
#[derive(Clone, Debug, Default)]
pub struct GoCounter(Arc<AtomicU64>);

impl GoCounter {
    pub fn inc(&self) {
        self.inc_by(1);
    }

    pub fn inc_by(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

impl TypedMetric for GoCounter {
    const TYPE: MetricType = MetricType::Counter;
}

impl EncodeMetric for GoCounter {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        // A gauge's sample is the bare family name; the type stays counter.
        encoder.encode_gauge(&self.get())
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

/// Holds a gauge up by one for as long as it lives, so every exit path,
/// including a panic or a dropped future, brings the gauge back down.
#[derive(Debug)]
pub struct GaugeGuard(Gauge);

impl GaugeGuard {
    pub fn new(gauge: &Gauge) -> Self {
        gauge.inc();
        GaugeGuard(gauge.clone())
    }
}

impl Drop for GaugeGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::histogram::Histogram;

    #[test]
    fn families_read_as_gos_client_writes_them() {
        let failures = Family::<Labels, GoCounter>::default();
        let packets = GoCounter::default();
        let latency = Histogram::new([0.5]);
        let registry = binary_registry("konnectivity_network_proxy_server", |registry| {
            register(
                registry,
                "dial_failure_count",
                "Number of dial failures observed. Multiple failures can occur for a single dial request.",
                failures.clone(),
            );
            register(
                registry,
                "stream_packets_total",
                "Count of packets processed",
                packets.clone(),
            );
            register(
                registry,
                "dial_duration_seconds",
                "Latency of dial to the remote endpoint in seconds",
                latency.clone(),
            );
        });
        failures.get_or_create(&vec![("reason", "no_agent")]).inc();
        packets.inc_by(3);
        latency.observe(0.25);
        let text = encode(&registry);
        for line in [
            "# HELP konnectivity_network_proxy_server_dial_failure_count Number of dial failures observed. Multiple failures can occur for a single dial request.\n",
            "# TYPE konnectivity_network_proxy_server_dial_failure_count counter\n",
            "konnectivity_network_proxy_server_dial_failure_count{reason=\"no_agent\"} 1\n",
            "# HELP konnectivity_network_proxy_server_stream_packets_total Count of packets processed\n",
            "# TYPE konnectivity_network_proxy_server_stream_packets_total counter\n",
            "konnectivity_network_proxy_server_stream_packets_total 3\n",
            // No period appended to a help text that has none.
            "# HELP konnectivity_network_proxy_server_dial_duration_seconds Latency of dial to the remote endpoint in seconds\n",
            "konnectivity_network_proxy_server_dial_duration_seconds_count 1\n",
            "# TYPE process_cpu_seconds_total counter\n",
        ] {
            assert!(text.contains(line), "{line:?} missing from:\n{text}");
        }
        assert!(!text.contains("# EOF"), "{text}");
    }
}

/// Which leg of a tunnel a packet travelled on, with upstream's names. The
/// agent sees only the agent legs; the server sees all four.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Segment {
    /// Sent by the agent, received by the server.
    FromAgent = 0,
    /// Sent by the server, received by the agent.
    ToAgent = 1,
    /// Sent by a gRPC frontend client (kube-apiserver), received by the server.
    FromClient = 2,
    /// Sent by the server to a gRPC frontend client.
    ToClient = 3,
}

impl Segment {
    /// The legs an agent's stream has.
    pub const AGENT: &[Segment] = &[Segment::FromAgent, Segment::ToAgent];
    /// Every leg, as the server sees them.
    pub const ALL: &[Segment] = &[
        Segment::FromAgent,
        Segment::ToAgent,
        Segment::FromClient,
        Segment::ToClient,
    ];

    fn label(self) -> &'static str {
        match self {
            Segment::FromAgent => "from_agent",
            Segment::ToAgent => "to_agent",
            Segment::FromClient => "from_client",
            Segment::ToClient => "to_client",
        }
    }
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

/// `stream_packets_total{segment,packet_type}`, with every counter resolved
/// once so the data path never builds a label set.
#[derive(Debug, Clone, Default)]
pub struct PacketCounters {
    counters: [[GoCounter; PACKET_TYPES]; 4],
}

impl PacketCounters {
    /// Registers the family in `registry` (which carries the prefix), with
    /// a series for every packet type on each of `segments`. Counting on
    /// another segment is allowed but shows nowhere.
    pub fn register(registry: &mut Registry, segments: &[Segment]) -> PacketCounters {
        let family = Family::<Labels, GoCounter>::default();
        let mut counters: [[GoCounter; PACKET_TYPES]; 4] = Default::default();
        for &segment in segments {
            let row = &mut counters[segment as usize];
            for (kind, counter) in ALL_PACKET_TYPES.into_iter().zip(row.iter_mut()) {
                *counter = family
                    .get_or_create(&vec![
                        ("segment", segment.label()),
                        ("packet_type", kind.as_str_name()),
                    ])
                    .clone();
            }
        }
        register(
            registry,
            "stream_packets_total",
            "Count of packets processed, by segment and packet type (example: from_client, DIAL_REQ)",
            family,
        );
        PacketCounters { counters }
    }

    pub fn count(&self, segment: Segment, kind: PacketType) {
        self.counters[segment as usize][packet_index(kind)].inc();
    }
}

#[cfg(test)]
mod packet_tests {
    use super::*;

    #[test]
    fn every_packet_type_has_its_own_counter() {
        for (index, kind) in ALL_PACKET_TYPES.into_iter().enumerate() {
            assert_eq!(packet_index(kind), index, "{kind:?}");
        }
        let mut registry = Registry::with_prefix("p");
        let counters = PacketCounters::register(&mut registry, Segment::AGENT);
        counters.count(Segment::ToAgent, PacketType::WindowUpdate);
        counters.count(Segment::FromClient, PacketType::Data);
        let text = encode(&registry);
        assert!(
            text.contains(r#"p_stream_packets_total{segment="to_agent",packet_type="WINDOW_UPDATE"} 1"#),
            "{text}"
        );
        assert!(!text.contains("segment=\"from_client\""), "{text}");
    }

    #[test]
    fn stream_errors_carry_segment_code_and_packet_type() {
        let mut registry = Registry::with_prefix("p");
        let errors = StreamErrors::register(&mut registry);
        errors.count(Segment::FromAgent, tonic::Code::Unavailable, None);
        errors.count(
            Segment::ToClient,
            tonic::Code::InvalidArgument,
            Some(PacketType::DialRsp),
        );
        let text = encode(&registry);
        assert!(
            text.contains(
                r#"p_stream_errors_total{segment="from_agent",code="Unavailable",packet_type="Unknown"} 1"#
            ),
            "{text}"
        );
        assert!(
            text.contains(
                r#"p_stream_errors_total{segment="to_client",code="InvalidArgument",packet_type="DIAL_RSP"} 1"#
            ),
            "{text}"
        );
    }
}

/// `stream_errors_total{segment,code,packet_type}`: failures on a stream, by
/// leg, gRPC status code (Go's names, as upstream prints them) and the
/// packet involved (`Unknown` when none was).
#[derive(Debug, Clone, Default)]
pub struct StreamErrors(Family<Labels, GoCounter>);

impl StreamErrors {
    pub fn register(registry: &mut Registry) -> StreamErrors {
        let family = Family::<Labels, GoCounter>::default();
        register(
            registry,
            "stream_errors_total",
            "Count of gRPC stream errors, by segment, grpc Code, packet type. (example: from_agent, Code.Unavailable, DIAL_RSP)",
            family.clone(),
        );
        StreamErrors(family)
    }

    pub fn count(&self, segment: Segment, code: tonic::Code, packet: Option<PacketType>) {
        let packet_type = packet.map_or("Unknown", |kind| kind.as_str_name());
        self.0
            .get_or_create(&vec![
                ("segment", segment.label()),
                ("code", code_name(code)),
                ("packet_type", packet_type),
            ])
            .inc();
    }
}

/// A gRPC code as grpc-go's `codes.Code.String()` spells it.
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "Canceled",
        Unknown => "Unknown",
        InvalidArgument => "InvalidArgument",
        DeadlineExceeded => "DeadlineExceeded",
        NotFound => "NotFound",
        AlreadyExists => "AlreadyExists",
        PermissionDenied => "PermissionDenied",
        ResourceExhausted => "ResourceExhausted",
        FailedPrecondition => "FailedPrecondition",
        Aborted => "Aborted",
        OutOfRange => "OutOfRange",
        Unimplemented => "Unimplemented",
        Internal => "Internal",
        Unavailable => "Unavailable",
        DataLoss => "DataLoss",
        Unauthenticated => "Unauthenticated",
    }
}
