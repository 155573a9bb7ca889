//! Packets counted by the leg they travelled, and stream errors by gRPC
//! code, with upstream's families and labels.

use konnectivity_proto::PacketType;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use crate::metrics::counter::GoCounter;
use crate::metrics::registry::{Labels, register};

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

/// Upstream's seven packet types and our extensions' WINDOW_UPDATE,
/// RESUME and STREAM_END.
const PACKET_TYPES: usize = 10;
const ALL_PACKET_TYPES: [PacketType; PACKET_TYPES] = [
    PacketType::DialReq,
    PacketType::DialRsp,
    PacketType::CloseReq,
    PacketType::CloseRsp,
    PacketType::Data,
    PacketType::DialCls,
    PacketType::Drain,
    PacketType::WindowUpdate,
    PacketType::Resume,
    PacketType::StreamEnd,
];

/// Index of a packet type in [`ALL_PACKET_TYPES`].
fn packet_index(kind: PacketType) -> usize {
    match kind {
        PacketType::DialReq => 0,
        PacketType::DialRsp => 1,
        PacketType::CloseReq => 2,
        PacketType::CloseRsp => 3,
        PacketType::Data => 4,
        PacketType::DialCls => 5,
        PacketType::Drain => 6,
        PacketType::WindowUpdate => 7,
        PacketType::Resume => 8,
        PacketType::StreamEnd => 9,
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
    use crate::metrics::registry::encode;

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
