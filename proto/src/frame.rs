//! A validated, typed view of a [`Packet`].
//!
//! `DIAL_REQ = 0` is the proto3 default, so a packet with no type decodes as a
//! dial request; and upstream v0.36.0 crashes on a DATA packet without payload.
//! Every packet therefore goes through [`Frame::try_from`], which checks that
//! the payload matches the type and that ids are in range.

use bytes::Bytes;

use crate::ids::{ConnectId, DialId};
use crate::target::DialTarget;
use crate::wire::{self, packet::Payload};
use crate::wire::{Packet, PacketType};

/// One protocol message, validated.
#[derive(Clone, Debug, PartialEq)]
pub enum Frame {
    DialRequest {
        protocol: String,
        address: DialTarget,
        dial_id: DialId,
    },
    /// `Ok` carries the new connection's id, `Err` the agent's error text.
    DialResponse {
        dial_id: DialId,
        result: Result<ConnectId, String>,
    },
    CloseRequest {
        connect_id: ConnectId,
    },
    CloseResponse {
        connect_id: ConnectId,
        error: Option<String>,
    },
    Data {
        connect_id: ConnectId,
        data: Bytes,
        /// With resume: where `data` starts in the connection's bytes.
        offset: Option<u64>,
    },
    CloseDial {
        dial_id: DialId,
    },
    Drain,
    /// konnectivity-rs extension (docs/flow-control.md): the receiver
    /// consumed `bytes` more of `connect_id`'s window; with resume,
    /// `written` says how many of its bytes it has written out in all.
    WindowUpdate {
        connect_id: ConnectId,
        bytes: u32,
        written: Option<u64>,
    },
    /// konnectivity-rs extension (docs/resume.md): part of what the sender
    /// holds of its connections as a stream resumes; `last` ends the list.
    Resume {
        connections: Vec<ResumeEntry>,
        last: bool,
    },
    /// konnectivity-rs extension (docs/resume.md): the sender ends the
    /// stream on purpose; its end is not a loss.
    StreamEnd,
}

/// One connection in a [`Frame::Resume`] list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResumeEntry {
    pub connect_id: ConnectId,
    /// DATA bytes received on it, counted from its first.
    pub received: u64,
    /// Of those, the bytes written out.
    pub written: u64,
    /// The sender closed it and has not seen the close confirmed.
    pub closing: bool,
}

/// Why a packet was rejected. The text is what peers and logs see.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PacketError {
    #[error("unknown packet type {0}")]
    UnknownType(i32),
    #[error("packet of type {0:?} carries no matching payload")]
    PayloadMismatch(PacketType),
    #[error("packet of type {kind:?} has invalid connectID {raw}")]
    InvalidConnectId { kind: PacketType, raw: i64 },
    #[error("successful DIAL_RSP for random {0} carries no connectID")]
    DialResponseWithoutConnectId(i64),
    #[error("RESUME says connectID {connect_id} wrote out {written} bytes but received only {received}")]
    ResumeWrittenPastReceived {
        connect_id: i64,
        received: u64,
        written: u64,
    },
}

impl PacketError {
    /// The packet's type, when it had a known one.
    pub fn packet_type(&self) -> Option<PacketType> {
        match self {
            PacketError::UnknownType(_) => None,
            PacketError::PayloadMismatch(kind) | PacketError::InvalidConnectId { kind, .. } => Some(*kind),
            PacketError::DialResponseWithoutConnectId(_) => Some(PacketType::DialRsp),
            PacketError::ResumeWrittenPastReceived { .. } => Some(PacketType::Resume),
        }
    }
}

impl TryFrom<Packet> for Frame {
    type Error = PacketError;

    fn try_from(packet: Packet) -> Result<Self, PacketError> {
        let kind =
            PacketType::try_from(packet.r#type).map_err(|_| PacketError::UnknownType(packet.r#type))?;
        let connect_id = |raw: i64| ConnectId::new(raw).ok_or(PacketError::InvalidConnectId { kind, raw });
        let frame = match (kind, packet.payload) {
            (PacketType::DialReq, Some(Payload::DialRequest(r))) => Frame::DialRequest {
                protocol: r.protocol,
                address: r.address.into(),
                dial_id: DialId::new(r.random),
            },
            (PacketType::DialRsp, Some(Payload::DialResponse(r))) => Frame::DialResponse {
                dial_id: DialId::new(r.random),
                result: if r.error.is_empty() {
                    Ok(ConnectId::new(r.connect_id)
                        .ok_or(PacketError::DialResponseWithoutConnectId(r.random))?)
                } else {
                    Err(r.error)
                },
            },
            (PacketType::CloseReq, Some(Payload::CloseRequest(r))) => Frame::CloseRequest {
                connect_id: connect_id(r.connect_id)?,
            },
            (PacketType::CloseRsp, Some(Payload::CloseResponse(r))) => Frame::CloseResponse {
                connect_id: connect_id(r.connect_id)?,
                error: (!r.error.is_empty()).then_some(r.error),
            },
            (PacketType::Data, Some(Payload::Data(d))) => Frame::Data {
                connect_id: connect_id(d.connect_id)?,
                data: d.data,
                offset: d.offset,
            },
            (PacketType::DialCls, Some(Payload::CloseDial(r))) => Frame::CloseDial {
                dial_id: DialId::new(r.random),
            },
            // Drain has no fields, so a Go peer may send it with or without
            // the empty message.
            (PacketType::Drain, Some(Payload::Drain(_)) | None) => Frame::Drain,
            (PacketType::WindowUpdate, Some(Payload::WindowUpdate(w))) => Frame::WindowUpdate {
                connect_id: connect_id(w.connect_id)?,
                bytes: w.bytes,
                written: w.written,
            },
            (PacketType::StreamEnd, Some(Payload::StreamEnd(_)) | None) => Frame::StreamEnd,
            (PacketType::Resume, Some(Payload::Resume(r))) => Frame::Resume {
                connections: r
                    .connections
                    .into_iter()
                    .map(|c| {
                        if c.written > c.received {
                            return Err(PacketError::ResumeWrittenPastReceived {
                                connect_id: c.connect_id,
                                received: c.received,
                                written: c.written,
                            });
                        }
                        Ok(ResumeEntry {
                            connect_id: connect_id(c.connect_id)?,
                            received: c.received,
                            written: c.written,
                            closing: c.closing,
                        })
                    })
                    .collect::<Result<_, _>>()?,
                last: r.last,
            },
            (kind, _) => return Err(PacketError::PayloadMismatch(kind)),
        };
        Ok(frame)
    }
}

impl From<Frame> for Packet {
    fn from(frame: Frame) -> Packet {
        let (kind, payload) = match frame {
            Frame::DialRequest {
                protocol,
                address,
                dial_id,
            } => (
                PacketType::DialReq,
                Payload::DialRequest(wire::DialRequest {
                    protocol,
                    address: address.into(),
                    random: dial_id.get(),
                }),
            ),
            Frame::DialResponse { dial_id, result } => {
                let (connect_id, error) = match result {
                    Ok(id) => (id.get(), String::new()),
                    Err(error) => (0, error),
                };
                (
                    PacketType::DialRsp,
                    Payload::DialResponse(wire::DialResponse {
                        error,
                        connect_id,
                        random: dial_id.get(),
                    }),
                )
            }
            Frame::CloseRequest { connect_id } => (
                PacketType::CloseReq,
                Payload::CloseRequest(wire::CloseRequest {
                    connect_id: connect_id.get(),
                }),
            ),
            Frame::CloseResponse { connect_id, error } => (
                PacketType::CloseRsp,
                Payload::CloseResponse(wire::CloseResponse {
                    error: error.unwrap_or_default(),
                    connect_id: connect_id.get(),
                }),
            ),
            Frame::Data {
                connect_id,
                data,
                offset,
            } => (
                PacketType::Data,
                Payload::Data(wire::Data {
                    connect_id: connect_id.get(),
                    error: String::new(),
                    data,
                    offset,
                }),
            ),
            Frame::CloseDial { dial_id } => (
                PacketType::DialCls,
                Payload::CloseDial(wire::CloseDial {
                    random: dial_id.get(),
                }),
            ),
            Frame::Drain => (PacketType::Drain, Payload::Drain(wire::Drain {})),
            Frame::WindowUpdate {
                connect_id,
                bytes,
                written,
            } => (
                PacketType::WindowUpdate,
                Payload::WindowUpdate(wire::WindowUpdate {
                    connect_id: connect_id.get(),
                    bytes,
                    written,
                }),
            ),
            Frame::StreamEnd => (PacketType::StreamEnd, Payload::StreamEnd(wire::StreamEnd {})),
            Frame::Resume { connections, last } => (
                PacketType::Resume,
                Payload::Resume(wire::Resume {
                    connections: connections
                        .into_iter()
                        .map(|c| wire::ResumeConnection {
                            connect_id: c.connect_id.get(),
                            received: c.received,
                            written: c.written,
                            closing: c.closing,
                        })
                        .collect(),
                    last,
                }),
            ),
        };
        Packet {
            r#type: kind as i32,
            payload: Some(payload),
        }
    }
}

impl Frame {
    /// The packet type this frame travels as (for metrics and logs).
    pub fn kind(&self) -> PacketType {
        match self {
            Frame::DialRequest { .. } => PacketType::DialReq,
            Frame::DialResponse { .. } => PacketType::DialRsp,
            Frame::CloseRequest { .. } => PacketType::CloseReq,
            Frame::CloseResponse { .. } => PacketType::CloseRsp,
            Frame::Data { .. } => PacketType::Data,
            Frame::CloseDial { .. } => PacketType::DialCls,
            Frame::Drain => PacketType::Drain,
            Frame::WindowUpdate { .. } => PacketType::WindowUpdate,
            Frame::Resume { .. } => PacketType::Resume,
            Frame::StreamEnd => PacketType::StreamEnd,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    fn encode(frame: Frame) -> Vec<u8> {
        Packet::from(frame).encode_to_vec()
    }

    fn decode(bytes: &[u8]) -> Result<Frame, PacketError> {
        Frame::try_from(Packet::decode(bytes).expect("valid protobuf"))
    }

    // Expected bytes are written out by hand from the protobuf encoding rules
    // (tag = field << 3 | wire type; varints; length-delimited submessages),
    // not produced by this code, so a renumbered field fails here.

    #[test]
    fn dial_request_encoding() {
        let frame = Frame::DialRequest {
            protocol: "tcp".into(),
            address: "a:1".into(),
            dial_id: DialId::new(5),
        };
        // type 0 is the proto3 default and is not emitted.
        let expected = [
            0x12, 0x0c, 0x0a, 0x03, b't', b'c', b'p', 0x12, 0x03, b'a', b':', b'1', 0x18, 0x05,
        ];
        assert_eq!(encode(frame.clone()), expected);
        assert_eq!(decode(&expected), Ok(frame));
    }

    #[test]
    fn dial_response_encoding_with_negative_random() {
        let frame = Frame::DialResponse {
            dial_id: DialId::new(-1),
            result: Ok(ConnectId::new(7).unwrap()),
        };
        let mut expected = vec![0x08, 0x01, 0x1a, 0x0d, 0x10, 0x07, 0x18];
        expected.extend([0xff; 9]);
        expected.push(0x01);
        assert_eq!(encode(frame.clone()), expected);
        assert_eq!(decode(&expected), Ok(frame));
    }

    #[test]
    fn dial_response_error_encoding() {
        let frame = Frame::DialResponse {
            dial_id: DialId::new(2),
            result: Err("no".into()),
        };
        let expected = [0x08, 0x01, 0x1a, 0x06, 0x0a, 0x02, b'n', b'o', 0x18, 0x02];
        assert_eq!(encode(frame.clone()), expected);
        assert_eq!(decode(&expected), Ok(frame));
    }

    #[test]
    fn close_request_encoding() {
        let frame = Frame::CloseRequest {
            connect_id: ConnectId::new(9).unwrap(),
        };
        let expected = [0x08, 0x02, 0x2a, 0x02, 0x08, 0x09];
        assert_eq!(encode(frame.clone()), expected);
        assert_eq!(decode(&expected), Ok(frame));
    }

    #[test]
    fn close_response_encoding() {
        let frame = Frame::CloseResponse {
            connect_id: ConnectId::new(3).unwrap(),
            error: Some("x".into()),
        };
        let expected = [0x08, 0x03, 0x32, 0x05, 0x0a, 0x01, b'x', 0x10, 0x03];
        assert_eq!(encode(frame.clone()), expected);
        assert_eq!(decode(&expected), Ok(frame));
    }

    #[test]
    fn data_encoding() {
        let frame = Frame::Data {
            connect_id: ConnectId::new(1).unwrap(),
            data: Bytes::from_static(b"hi"),
            offset: None,
        };
        let expected = [0x08, 0x04, 0x22, 0x06, 0x08, 0x01, 0x1a, 0x02, b'h', b'i'];
        assert_eq!(encode(frame.clone()), expected);
        assert_eq!(decode(&expected), Ok(frame));
    }

    #[test]
    fn data_with_an_offset_encoding() {
        // The offset is proto3 `optional`: 0 is sent, and told from absent.
        for (offset, varint) in [(0u64, vec![0x00]), (300, vec![0xac, 0x02])] {
            let frame = Frame::Data {
                connect_id: ConnectId::new(1).unwrap(),
                data: Bytes::from_static(b"hi"),
                offset: Some(offset),
            };
            // Data field 32 (tag 0x80 0x02, varint) after connectID and data.
            let mut inner = vec![0x08, 0x01, 0x1a, 0x02, b'h', b'i', 0x80, 0x02];
            inner.extend(&varint);
            let mut expected = vec![0x08, 0x04, 0x22, inner.len() as u8];
            expected.extend(inner);
            assert_eq!(encode(frame.clone()), expected);
            assert_eq!(decode(&expected), Ok(frame));
        }
    }

    #[test]
    fn close_dial_encoding() {
        let frame = Frame::CloseDial {
            dial_id: DialId::new(300),
        };
        let expected = [0x08, 0x05, 0x3a, 0x03, 0x08, 0xac, 0x02];
        assert_eq!(encode(frame.clone()), expected);
        assert_eq!(decode(&expected), Ok(frame));
    }

    #[test]
    fn drain_encoding() {
        let expected = [0x08, 0x06, 0x42, 0x00];
        assert_eq!(encode(Frame::Drain), expected);
        assert_eq!(decode(&expected), Ok(Frame::Drain));
        // A Go peer may omit the empty Drain message.
        assert_eq!(decode(&[0x08, 0x06]), Ok(Frame::Drain));
    }

    #[test]
    fn window_update_encoding() {
        let frame = Frame::WindowUpdate {
            connect_id: ConnectId::new(5).unwrap(),
            bytes: 65536,
            written: None,
        };
        // type 32; field 32 (tag 0x82 0x02), 6 bytes: connectID 5, bytes 65536.
        let expected = [0x08, 0x20, 0x82, 0x02, 0x06, 0x08, 0x05, 0x10, 0x80, 0x80, 0x04];
        assert_eq!(encode(frame.clone()), expected);
        assert_eq!(decode(&expected), Ok(frame));

        let frame = Frame::WindowUpdate {
            connect_id: ConnectId::new(5).unwrap(),
            bytes: 0,
            written: Some(2),
        };
        // WindowUpdate field 32 (tag 0x80 0x02, varint 2); bytes 0 is not sent.
        let expected = [0x08, 0x20, 0x82, 0x02, 0x05, 0x08, 0x05, 0x80, 0x02, 0x02];
        assert_eq!(encode(frame.clone()), expected);
        assert_eq!(decode(&expected), Ok(frame));
    }

    #[test]
    fn resume_encoding() {
        let frame = Frame::Resume {
            connections: vec![ResumeEntry {
                connect_id: ConnectId::new(2).unwrap(),
                received: 300,
                written: 1,
                closing: true,
            }],
            last: true,
        };
        // type 33; Packet field 33 (tag 0x8a 0x02); Resume: connections (0x0a)
        // holding connectID 2, received 300, written 1, closing true; last true.
        let expected = [
            0x08, 0x21, 0x8a, 0x02, 0x0d, 0x0a, 0x09, 0x08, 0x02, 0x10, 0xac, 0x02, 0x18, 0x01, 0x20, 0x01,
            0x10, 0x01,
        ];
        assert_eq!(encode(frame.clone()), expected);
        assert_eq!(decode(&expected), Ok(frame));
    }

    #[test]
    fn stream_end_encoding() {
        // type 34; Packet field 34 (tag 0x92 0x02), an empty message.
        let expected = [0x08, 0x22, 0x92, 0x02, 0x00];
        assert_eq!(encode(Frame::StreamEnd), expected);
        assert_eq!(decode(&expected), Ok(Frame::StreamEnd));
        assert_eq!(decode(&[0x08, 0x22]), Ok(Frame::StreamEnd));
    }

    #[test]
    fn a_resume_entry_that_wrote_more_than_it_received_is_rejected() {
        // connectID 2, received 1, written 2.
        let bytes = [
            0x08, 0x21, 0x8a, 0x02, 0x08, 0x0a, 0x06, 0x08, 0x02, 0x10, 0x01, 0x18, 0x02,
        ];
        assert_eq!(
            decode(&bytes),
            Err(PacketError::ResumeWrittenPastReceived {
                connect_id: 2,
                received: 1,
                written: 2
            })
        );
        // connectID 0 names no connection.
        let bytes = [0x08, 0x21, 0x8a, 0x02, 0x02, 0x0a, 0x00];
        assert_eq!(
            decode(&bytes),
            Err(PacketError::InvalidConnectId {
                kind: PacketType::Resume,
                raw: 0
            })
        );
    }

    #[test]
    fn data_without_payload_is_rejected_not_a_crash() {
        assert_eq!(
            decode(&[0x08, 0x04]),
            Err(PacketError::PayloadMismatch(PacketType::Data))
        );
    }

    #[test]
    fn empty_packet_is_not_a_dial_request() {
        assert_eq!(
            decode(&[]),
            Err(PacketError::PayloadMismatch(PacketType::DialReq))
        );
    }

    #[test]
    fn payload_of_another_type_is_rejected() {
        // type CLOSE_REQ with a Data payload.
        let bytes = [0x08, 0x02, 0x22, 0x02, 0x08, 0x01];
        assert_eq!(
            decode(&bytes),
            Err(PacketError::PayloadMismatch(PacketType::CloseReq))
        );
    }

    #[test]
    fn unknown_type_is_rejected() {
        assert_eq!(decode(&[0x08, 0x63]), Err(PacketError::UnknownType(99)));
    }

    #[test]
    fn zero_and_negative_connect_ids_are_rejected() {
        // DATA with connectID 0 (omitted) and CLOSE_REQ with connectID -1.
        assert!(matches!(
            decode(&[0x08, 0x04, 0x22, 0x00]),
            Err(PacketError::InvalidConnectId { raw: 0, .. })
        ));
        let mut close = vec![0x08, 0x02, 0x2a, 0x0b, 0x08];
        close.extend([0xff; 9]);
        close.push(0x01);
        assert!(matches!(
            decode(&close),
            Err(PacketError::InvalidConnectId { raw: -1, .. })
        ));
    }

    #[test]
    fn successful_dial_response_needs_a_connect_id() {
        assert_eq!(
            decode(&[0x08, 0x01, 0x1a, 0x02, 0x18, 0x04]),
            Err(PacketError::DialResponseWithoutConnectId(4))
        );
    }
}
