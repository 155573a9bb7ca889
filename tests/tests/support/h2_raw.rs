//! A gRPC request written frame by frame, so a test controls every byte of
//! the request headers, `:authority` above all: no HTTP/2 library lets a
//! client send a value that is not a URI authority (the `http` crate refuses
//! it before it is sent), yet grpc-go and gRPC core send socket paths there.
//! Header fields are HPACK literals without indexing and without Huffman
//! coding (RFC 7541 §6.2.2), the simplest form every decoder must take.

use bytes::{BufMut, BytesMut};
use konnectivity_proto::{Packet, PacketType, wire};
use prost::Message;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const ACK: u8 = 0x1;

/// How the server answered the request.
#[derive(Debug, PartialEq)]
pub enum Answer {
    /// The first packet on the stream (a DIAL_RSP for a DIAL_REQ).
    Packet(Packet),
    /// RST_STREAM with this error code (1 is PROTOCOL_ERROR).
    Reset(u32),
    /// GOAWAY with this error code.
    GoAway(u32),
    /// Response headers ended the stream without a packet.
    Ended,
}

/// The PROTOCOL_ERROR code of RST_STREAM and GOAWAY (RFC 9113 §7).
pub const PROTOCOL_ERROR: u32 = 0x1;
/// ENHANCE_YOUR_CALM: h2's answer to a peer it takes for an attacker.
pub const ENHANCE_YOUR_CALM: u32 = 0xb;
/// CANCEL: what a gRPC client sends when its call is dropped.
const CANCEL: u32 = 0x8;

/// Sends one Proxy request (the headers grpc-go sends, with `authority` as
/// the `:authority`, or none) carrying a DIAL_REQ for `target`, and returns
/// the server's first answer on that stream. Dropping `io` afterwards ends
/// the stream as a vanished client would.
pub async fn dial_with_authority<S>(
    io: &mut S,
    scheme: &str,
    authority: Option<&[u8]>,
    target: &str,
) -> Answer
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    dial_after_cancelled(io, scheme, authority, 0, target).await
}

/// As [`dial_with_authority`], after `cancelled` requests on the same
/// connection, each reset (CANCEL) right after its headers, all in one
/// write: a client whose calls were dropped before the server took them.
pub async fn dial_after_cancelled<S>(
    io: &mut S,
    scheme: &str,
    authority: Option<&[u8]>,
    cancelled: u32,
    target: &str,
) -> Answer
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut out = BytesMut::new();
    out.put_slice(PREFACE);
    frame(&mut out, SETTINGS, 0, 0, &[]);
    // gRPC core pings as soon as it connects (its BDP estimator); h2 must
    // take a PING before the first stream.
    frame(&mut out, PING, 0, 0, b"konnping");
    let headers = request_headers(scheme, authority);
    for n in 0..cancelled {
        let stream = 2 * n + 1;
        frame(&mut out, HEADERS, END_HEADERS, stream, &headers);
        frame(&mut out, RST_STREAM, 0, stream, &CANCEL.to_be_bytes());
    }
    let stream = 2 * cancelled + 1;
    frame(&mut out, HEADERS, END_HEADERS, stream, &headers);
    let packet = Packet {
        r#type: PacketType::DialReq as i32,
        payload: Some(wire::packet::Payload::DialRequest(wire::DialRequest {
            protocol: "tcp".into(),
            address: target.into(),
            random: 42,
        })),
    }
    .encode_to_vec();
    let mut message = BytesMut::new();
    message.put_u8(0);
    message.put_u32(packet.len() as u32);
    message.put_slice(&packet);
    frame(&mut out, DATA, 0, stream, &message);
    io.write_all(&out).await.expect("write the request");
    answer(io, stream).await
}

/// The header block of a Proxy request as grpc-go sends it.
fn request_headers(scheme: &str, authority: Option<&[u8]>) -> BytesMut {
    let mut block = BytesMut::new();
    literal(&mut block, b":method", b"POST");
    literal(&mut block, b":scheme", scheme.as_bytes());
    literal(&mut block, b":path", konnectivity_proto::PROXY_PATH.as_bytes());
    if let Some(authority) = authority {
        literal(&mut block, b":authority", authority);
    }
    literal(&mut block, b"content-type", b"application/grpc");
    literal(&mut block, b"user-agent", b"grpc-go/1.72.0");
    literal(&mut block, b"te", b"trailers");
    block
}

/// The server's first answer on `stream`, answering its SETTINGS and PINGs
/// meanwhile.
async fn answer<S>(io: &mut S, stream_id: u32) -> Answer
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut received = BytesMut::new();
    loop {
        let mut header = [0u8; 9];
        if io.read_exact(&mut header).await.is_err() {
            panic!("the server closed the connection without answering the stream");
        }
        let length = usize::from(header[0]) << 16 | usize::from(header[1]) << 8 | usize::from(header[2]);
        let (kind, flags) = (header[3], header[4]);
        let stream = u32::from_be_bytes(header[5..9].try_into().unwrap()) & 0x7fff_ffff;
        let mut payload = vec![0u8; length];
        io.read_exact(&mut payload).await.expect("read a frame payload");
        match kind {
            SETTINGS if flags & ACK == 0 => {
                let mut ack = BytesMut::new();
                frame(&mut ack, SETTINGS, ACK, 0, &[]);
                io.write_all(&ack).await.expect("acknowledge SETTINGS");
            }
            PING if flags & ACK == 0 => {
                let mut pong = BytesMut::new();
                frame(&mut pong, PING, ACK, 0, &payload);
                io.write_all(&pong).await.expect("answer PING");
            }
            RST_STREAM if stream == stream_id => return Answer::Reset(code(&payload[..4])),
            GOAWAY => return Answer::GoAway(code(&payload[4..8])),
            HEADERS if stream == stream_id && flags & END_STREAM != 0 => return Answer::Ended,
            DATA if stream == stream_id => {
                received.put_slice(&payload);
                if received.len() >= 5 {
                    let size = u32::from_be_bytes(received[1..5].try_into().unwrap()) as usize;
                    if received.len() >= 5 + size {
                        return Answer::Packet(Packet::decode(&received[5..5 + size]).expect("a Packet"));
                    }
                }
            }
            _ => {}
        }
    }
}

/// Ends the connection as newer grpc-go clients do when closed: GOAWAY
/// (NO_ERROR, no stream processed) and the end of what it writes; then
/// reads until the server closes its side too.
pub async fn go_away<S>(io: &mut S)
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut out = BytesMut::new();
    frame(&mut out, GOAWAY, 0, 0, &[0; 8]);
    io.write_all(&out).await.expect("write GOAWAY");
    io.shutdown().await.expect("end the client's side");
    let mut rest = Vec::new();
    io.read_to_end(&mut rest)
        .await
        .expect("the server ends the connection");
}

fn code(bytes: &[u8]) -> u32 {
    u32::from_be_bytes(bytes.try_into().unwrap())
}

fn frame(out: &mut BytesMut, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
    out.put_uint(payload.len() as u64, 3);
    out.put_u8(kind);
    out.put_u8(flags);
    out.put_u32(stream);
    out.put_slice(payload);
}

/// A literal header field without indexing, new name (RFC 7541 §6.2.2).
fn literal(out: &mut BytesMut, name: &[u8], value: &[u8]) {
    out.put_u8(0x00);
    string(out, name);
    string(out, value);
}

/// A string literal, not Huffman-coded, with its length (§5.1, §5.2).
fn string(out: &mut BytesMut, text: &[u8]) {
    if text.len() < 0x7f {
        out.put_u8(text.len() as u8);
    } else {
        out.put_u8(0x7f);
        let mut rest = text.len() - 0x7f;
        while rest >= 0x80 {
            out.put_u8((rest as u8 & 0x7f) | 0x80);
            rest >>= 7;
        }
        out.put_u8(rest as u8);
    }
    out.put_slice(text);
}
