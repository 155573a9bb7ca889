//! Prometheus text exposition with upstream's metric names.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use konnectivity_proto::PacketType;
use prometheus_client::encoding::{EncodeMetric, MetricEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::Registry;

/// Label sets with static names and values, as all of ours are.
pub type Labels = Vec<(&'static str, &'static str)>;

/// Upstream's dial latency buckets, 1 µs to 12.5 s.
pub const LATENCY_BUCKETS: [f64; 9] = [0.000001, 0.00001, 0.0001, 0.005, 0.025, 0.1, 0.5, 2.5, 12.5];

/// The content type of [`encode`]'s output (Prometheus text format 0.0.4,
/// which reads the OpenMetrics `# EOF` line as a comment).
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The `/metrics` reply: the registry's text, with `alive_tasks` first set
/// to the number of tasks alive in the current runtime (a leak shows there).
pub fn reply(registry: &Registry, alive_tasks: &Gauge) -> crate::http::Reply {
    let tasks = tokio::runtime::Handle::current().metrics().num_alive_tasks();
    alive_tasks.set(tasks as i64);
    crate::http::Reply {
        status: http::StatusCode::OK,
        content_type: CONTENT_TYPE,
        body: encode(registry),
    }
}

pub fn encode(registry: &Registry) -> String {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry).expect("writing to a String cannot fail");
    text
}

/// A counter exposed under exactly its registered name.
///
/// prometheus-client appends `_total` to every counter, but some of upstream's
/// counters (e.g. `konnectivity_network_proxy_server_dial_failure_count`) have
/// no such suffix, and dashboards query them by that name.
#[derive(Clone, Debug, Default)]
pub struct UnsuffixedCounter(Arc<AtomicU64>);

impl UnsuffixedCounter {
    pub fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

impl TypedMetric for UnsuffixedCounter {
    const TYPE: MetricType = MetricType::Counter;
}

impl EncodeMetric for UnsuffixedCounter {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
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
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::family::Family;

    #[test]
    fn unsuffixed_counter_keeps_its_name() {
        let mut registry = Registry::with_prefix("konnectivity_network_proxy_server");
        let failures = Family::<Vec<(String, String)>, UnsuffixedCounter>::default();
        registry.register("dial_failure_count", "Dial failures", failures.clone());
        let packets = Counter::<u64>::default();
        registry.register("stream_packets", "Packets", packets.clone());
        failures
            .get_or_create(&vec![("reason".into(), "no_agent".into())])
            .inc();
        packets.inc();
        let text = encode(&registry);
        assert!(
            text.contains("konnectivity_network_proxy_server_dial_failure_count{reason=\"no_agent\"} 1\n"),
            "{text}"
        );
        assert!(text.contains("# TYPE konnectivity_network_proxy_server_dial_failure_count counter"));
        assert!(text.contains("konnectivity_network_proxy_server_stream_packets_total 1\n"));
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
    counters: [[Counter; PACKET_TYPES]; 4],
}

impl PacketCounters {
    /// Registers the family in `registry` (which carries the prefix), with
    /// a series for every packet type on each of `segments`. Counting on
    /// another segment is allowed but shows nowhere.
    pub fn register(registry: &mut Registry, segments: &[Segment]) -> PacketCounters {
        let family = Family::<Labels, Counter>::default();
        let mut counters: [[Counter; PACKET_TYPES]; 4] = Default::default();
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
        registry.register(
            "stream_packets",
            "Count of packets processed, by segment and packet type",
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
        assert!(!text.contains("from_client"), "{text}");
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
pub struct StreamErrors(Family<Labels, Counter>);

impl StreamErrors {
    pub fn register(registry: &mut Registry) -> StreamErrors {
        let family = Family::<Labels, Counter>::default();
        registry.register(
            "stream_errors",
            "Count of gRPC stream errors, by segment, grpc Code, packet type",
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
