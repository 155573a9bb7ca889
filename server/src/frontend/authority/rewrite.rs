//! The client's side of an HTTP/2 connection, frame by frame: every frame
//! but a header block passes unchanged; each header block (HEADERS and its
//! CONTINUATIONs) is decoded with the client's HPACK state and re-encoded as
//! plain literals without the `:authority` field h2 would refuse.
//!
//! Re-encoding every block, rather than editing the one field in place, is
//! what keeps HPACK consistent: the client's encoder may have put the bad
//! `:authority` in its dynamic table and refer to it (or evict around it)
//! later, and only a decoder that follows the client's table can tell. The
//! blocks handed on never use the receiver's dynamic table, so h2's stays
//! empty and nothing depends on what was dropped.
//!
//! Anything this does not understand (a wrong preface, a frame sequence
//! HTTP/2 forbids, a block that does not decode or is too large) makes it
//! stand aside: the bytes held so far and everything after go to h2 as they
//! came, and h2 answers them as it answers any client.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use super::hpack::{self, Decoder, Field};

/// RFC 9113 §3.4.
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEADER_LEN: usize = 9;

const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
const PRIORITY_LEN: usize = 5;

/// The largest frame h2 accepts here: the gRPC frontend's
/// SETTINGS_MAX_FRAME_SIZE. A header frame larger than this is h2's to
/// refuse, so it is passed on rather than buffered.
const MAX_FRAME: usize = konnectivity_proto::H2_MAX_FRAME_SIZE as usize;

/// Frames emitted here are at most the size every HTTP/2 peer accepts
/// (RFC 9113 §4.2), whatever the server announced.
const EMIT_FRAME: usize = 16_384;

/// How much of a header block is decoded before standing aside. h2 refuses
/// header lists above 16 KiB (hyper's default) anyway; this only bounds what
/// a hostile block can make the decoder hold.
const MAX_LIST: usize = 1024 * 1024;

/// The rewriting state of one connection's client-to-server bytes.
#[derive(Debug)]
pub(crate) struct Rewriter {
    /// Bytes of the connection preface still to come.
    preface_left: usize,
    /// Bytes of a passed-through frame's payload still to come.
    payload_left: usize,
    /// A header block waiting for its CONTINUATION frames.
    block: Option<Block>,
    decoder: Decoder,
    /// Set once something did not parse: everything passes unchanged.
    standing_aside: bool,
    /// How many requests had their `:authority` left out.
    pub dropped: u64,
}

/// A header block being gathered.
#[derive(Debug)]
struct Block {
    stream_id: u32,
    flags: u8,
    priority: Option<[u8; PRIORITY_LEN]>,
    fragments: BytesMut,
    /// The frames as they came, for standing aside.
    raw: BytesMut,
}

/// A frame header (RFC 9113 §4.1).
struct FrameHeader {
    length: usize,
    kind: u8,
    flags: u8,
    stream_id: u32,
}

impl FrameHeader {
    fn parse(bytes: &[u8]) -> FrameHeader {
        FrameHeader {
            length: usize::from(bytes[0]) << 16 | usize::from(bytes[1]) << 8 | usize::from(bytes[2]),
            kind: bytes[3],
            flags: bytes[4],
            stream_id: u32::from_be_bytes([bytes[5], bytes[6], bytes[7], bytes[8]]) & 0x7fff_ffff,
        }
    }

    fn write(&self, out: &mut BytesMut) {
        out.put_uint(self.length as u64, 3);
        out.put_u8(self.kind);
        out.put_u8(self.flags);
        out.put_u32(self.stream_id);
    }
}

impl Default for Rewriter {
    fn default() -> Self {
        Rewriter {
            preface_left: PREFACE.len(),
            payload_left: 0,
            block: None,
            decoder: Decoder::new(hpack::DEFAULT_TABLE_SIZE),
            standing_aside: false,
            dropped: 0,
        }
    }
}

impl Rewriter {
    /// How many leading bytes of `input` (bytes that follow everything seen
    /// so far) go to h2 as they are. It stops before a header block frame
    /// and before a frame header that is not complete in `input`; those
    /// bytes are for [`Rewriter::rewrite`].
    pub(crate) fn pass(&mut self, input: &[u8]) -> usize {
        let mut at = 0;
        loop {
            if self.standing_aside {
                return input.len();
            }
            let rest = &input[at..];
            if self.preface_left > 0 {
                let n = self.preface_left.min(rest.len());
                let expected = &PREFACE[PREFACE.len() - self.preface_left..][..n];
                if rest[..n] != *expected {
                    // Not HTTP/2 with prior knowledge: h2 says so itself.
                    self.standing_aside = true;
                    continue;
                }
                self.preface_left -= n;
                at += n;
            } else if self.payload_left > 0 {
                let n = self.payload_left.min(rest.len());
                self.payload_left -= n;
                at += n;
            } else {
                if rest.len() < FRAME_HEADER_LEN {
                    return at;
                }
                let header = FrameHeader::parse(rest);
                if header.kind == HEADERS || header.kind == CONTINUATION || self.block.is_some() {
                    return at;
                }
                self.payload_left = header.length;
                at += FRAME_HEADER_LEN;
            }
            if at == input.len() {
                return at;
            }
        }
    }

    /// Moves what it can from `input` to `output`: passed-through bytes
    /// as they are, complete header blocks rewritten. What stays in `input`
    /// is the start of a frame still incomplete.
    pub(crate) fn rewrite(&mut self, input: &mut BytesMut, output: &mut BytesMut) {
        loop {
            let passed = self.pass(input);
            output.put_slice(&input[..passed]);
            input.advance(passed);
            if input.len() < FRAME_HEADER_LEN {
                return;
            }
            let header = FrameHeader::parse(input);
            if header.length > MAX_FRAME {
                self.stand_aside(output);
                continue;
            }
            if input.len() < FRAME_HEADER_LEN + header.length {
                input.reserve(FRAME_HEADER_LEN + header.length - input.len());
                return;
            }
            let frame = input.split_to(FRAME_HEADER_LEN + header.length).freeze();
            self.header_frame(header, frame, output);
        }
    }

    fn header_frame(&mut self, header: FrameHeader, frame: Bytes, output: &mut BytesMut) {
        let payload = &frame[FRAME_HEADER_LEN..];
        match (&mut self.block, header.kind) {
            (None, HEADERS) => {
                let Some((priority, fragment)) = headers_payload(header.flags, payload) else {
                    output.put_slice(&frame);
                    self.stand_aside(output);
                    return;
                };
                let mut fragments = BytesMut::new();
                fragments.put_slice(fragment);
                self.block = Some(Block {
                    stream_id: header.stream_id,
                    flags: header.flags,
                    priority,
                    fragments,
                    raw: BytesMut::from(&frame[..]),
                });
            }
            (Some(block), CONTINUATION) if block.stream_id == header.stream_id => {
                block.fragments.put_slice(payload);
                block.raw.put_slice(&frame);
                block.flags |= header.flags & END_HEADERS;
            }
            _ => {
                // RFC 9113 §6.10: nothing may interleave with a header
                // block, and a CONTINUATION needs one. h2 answers it.
                self.stand_aside(output);
                output.put_slice(&frame);
                return;
            }
        }
        let block = self.block.as_ref().expect("a block is open");
        if block.raw.len() > MAX_LIST {
            self.stand_aside(output);
        } else if block.flags & END_HEADERS != 0 {
            let block = self.block.take().expect("a block is open");
            self.finish(block, output);
        }
    }

    /// Decodes a complete block and emits it without a bad `:authority`.
    fn finish(&mut self, block: Block, output: &mut BytesMut) {
        let fields = match self.decoder.decode(&block.fragments, MAX_LIST) {
            Ok(fields) => fields,
            Err(error) => {
                tracing::debug!(%error, stream_id = block.stream_id, "header block not rewritten; h2 decides");
                self.block = Some(block);
                self.stand_aside(output);
                return;
            }
        };
        let mut encoded = BytesMut::with_capacity(block.fragments.len() * 2);
        for field in &fields {
            if is_refused_authority(field) {
                self.dropped += 1;
                tracing::trace!(
                    stream_id = block.stream_id,
                    authority = %String::from_utf8_lossy(&field.value),
                    "dropped an :authority h2 would refuse"
                );
                continue;
            }
            hpack::encode_literal(field, &mut encoded);
        }
        emit_block(&block, encoded.freeze(), output);
    }

    /// Gives up on rewriting: what is held goes out as it came.
    fn stand_aside(&mut self, output: &mut BytesMut) {
        if let Some(block) = self.block.take() {
            output.put_slice(&block.raw);
        }
        self.standing_aside = true;
    }
}

/// A HEADERS payload's priority fields and header block fragment, without
/// padding (RFC 9113 §6.2); `None` if the padding does not fit.
fn headers_payload(flags: u8, payload: &[u8]) -> Option<(Option<[u8; PRIORITY_LEN]>, &[u8])> {
    let mut payload = payload;
    let mut padding = 0;
    if flags & PADDED != 0 {
        let (&length, rest) = payload.split_first()?;
        padding = usize::from(length);
        payload = rest;
    }
    let priority = if flags & PRIORITY != 0 {
        let (fields, rest) = payload.split_at_checked(PRIORITY_LEN)?;
        payload = rest;
        Some(fields.try_into().expect("five bytes"))
    } else {
        None
    };
    let fragment = payload.get(..payload.len().checked_sub(padding)?)?;
    Some((priority, fragment))
}

/// What h2 would refuse with PROTOCOL_ERROR: an `:authority` that is not a
/// URI authority (h2 parses it with `http::uri::Authority`). grpc-go sends
/// the percent-encoded socket path, gRPC core the raw one.
fn is_refused_authority(field: &Field) -> bool {
    field.name == ":authority" && http::uri::Authority::from_maybe_shared(field.value.clone()).is_err()
}

/// Emits `encoded` as a HEADERS frame with the block's END_STREAM and
/// priority, and as many CONTINUATION frames as it needs.
fn emit_block(block: &Block, encoded: Bytes, output: &mut BytesMut) {
    let priority_len = block.priority.map_or(0, |_| PRIORITY_LEN);
    let mut rest = encoded;
    let mut first = true;
    loop {
        let room = if first {
            EMIT_FRAME - priority_len
        } else {
            EMIT_FRAME
        };
        let chunk = rest.split_to(rest.len().min(room));
        let last = rest.is_empty();
        let mut flags = if last { END_HEADERS } else { 0 };
        if first {
            flags |= block.flags & (END_STREAM | PRIORITY);
        }
        FrameHeader {
            length: chunk.len() + if first { priority_len } else { 0 },
            kind: if first { HEADERS } else { CONTINUATION },
            flags,
            stream_id: block.stream_id,
        }
        .write(output);
        if let (true, Some(priority)) = (first, block.priority) {
            output.put_slice(&priority);
        }
        output.put_slice(&chunk);
        if last {
            return;
        }
        first = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn literal_block(fields: &[(&str, &str)]) -> BytesMut {
        let mut block = BytesMut::new();
        for (name, value) in fields {
            hpack::encode_literal(
                &Field {
                    name: Bytes::copy_from_slice(name.as_bytes()),
                    value: Bytes::copy_from_slice(value.as_bytes()),
                    sensitive: false,
                },
                &mut block,
            );
        }
        block
    }

    fn frame(kind: u8, flags: u8, stream_id: u32, payload: &[u8]) -> Vec<u8> {
        let mut out = BytesMut::new();
        FrameHeader {
            length: payload.len(),
            kind,
            flags,
            stream_id,
        }
        .write(&mut out);
        out.put_slice(payload);
        out.to_vec()
    }

    /// Feeds `input` in pieces of `step` bytes as the connection wrapper
    /// does: the pass-through prefix of each read, then the rest through
    /// `rewrite`.
    fn run(input: &[u8], step: usize) -> (Vec<u8>, Rewriter) {
        let mut rewriter = Rewriter::default();
        let (mut held, mut output) = (BytesMut::new(), BytesMut::new());
        for piece in input.chunks(step) {
            if held.is_empty() {
                let passed = rewriter.pass(piece);
                output.put_slice(&piece[..passed]);
                held.put_slice(&piece[passed..]);
            } else {
                held.put_slice(piece);
            }
            rewriter.rewrite(&mut held, &mut output);
        }
        assert!(held.is_empty(), "a whole input leaves nothing held");
        (output.to_vec(), rewriter)
    }

    fn blocks(output: &[u8]) -> Vec<Vec<(String, String)>> {
        let mut decoder = Decoder::new(hpack::DEFAULT_TABLE_SIZE);
        let mut at = PREFACE.len();
        let mut result = Vec::new();
        let mut fragments = Vec::new();
        while at < output.len() {
            let header = FrameHeader::parse(&output[at..]);
            let payload = &output[at + FRAME_HEADER_LEN..at + FRAME_HEADER_LEN + header.length];
            if header.kind == HEADERS || header.kind == CONTINUATION {
                let (_, fragment) = headers_payload(header.flags & !PADDED, payload).unwrap();
                fragments.extend_from_slice(if header.kind == HEADERS { fragment } else { payload });
                if header.flags & END_HEADERS != 0 {
                    let fields = decoder.decode(&fragments, usize::MAX).unwrap();
                    result.push(
                        fields
                            .iter()
                            .map(|f| {
                                (
                                    String::from_utf8_lossy(&f.name).into_owned(),
                                    String::from_utf8_lossy(&f.value).into_owned(),
                                )
                            })
                            .collect(),
                    );
                    fragments.clear();
                }
            }
            at += FRAME_HEADER_LEN + header.length;
        }
        assert_eq!(decoder.table_size(), 0, "emitted blocks never index");
        result
    }

    fn request(authority: &str) -> Vec<(&'static str, String)> {
        vec![
            (":method", "POST".into()),
            (":scheme", "http".into()),
            (":path", "/ProxyService/Proxy".into()),
            (":authority", authority.into()),
            ("content-type", "application/grpc".into()),
            ("te", "trailers".into()),
        ]
    }

    fn connection(blocks: &[Vec<u8>], data: &[u8]) -> Vec<u8> {
        let mut input = PREFACE.to_vec();
        input.extend(frame(0x4, 0, 0, &[0, 4, 0, 0, 0xff, 0xff]));
        for (i, block) in blocks.iter().enumerate() {
            let stream = 1 + 2 * i as u32;
            input.extend(frame(HEADERS, END_HEADERS, stream, block));
            input.extend(frame(0x0, 0, stream, data));
        }
        input
    }

    #[test]
    fn drops_only_an_authority_h2_would_refuse_and_passes_everything_else() {
        let data: Vec<u8> = (0..40_000u32).map(|i| (i % 251) as u8).collect();
        let shapes = [
            "%2Ftmp%2Fkas.sock",
            "/tmp/kas.sock",
            "unix:/tmp/kas.sock",
            "localhost",
            "127.0.0.1:8090",
        ];
        let encoded: Vec<Vec<u8>> = shapes
            .iter()
            .map(|authority| {
                let fields = request(authority);
                let pairs: Vec<(&str, &str)> = fields.iter().map(|(n, v)| (*n, v.as_str())).collect();
                literal_block(&pairs).to_vec()
            })
            .collect();
        let input = connection(&encoded, &data);
        for step in [1, 7, 9, 100, 16_384, input.len()] {
            let (output, rewriter) = run(&input, step);
            assert_eq!(rewriter.dropped, 3, "step {step}");
            let decoded = blocks(&output);
            for (shape, fields) in shapes.iter().zip(&decoded) {
                let authority = fields.iter().find(|(n, _)| n == ":authority");
                if http::uri::Authority::try_from(*shape).is_ok() {
                    assert_eq!(authority.map(|(_, v)| v.as_str()), Some(*shape));
                } else {
                    assert_eq!(authority, None, "{shape} is dropped");
                }
                assert_eq!(fields.len(), 6 - usize::from(authority.is_none()));
            }
            // DATA frames come through byte for byte.
            assert_eq!(
                output.windows(data.len()).filter(|w| *w == &data[..]).count(),
                shapes.len()
            );
        }
    }

    #[test]
    fn follows_the_clients_dynamic_table_across_blocks() {
        // Python's hpack, as a client's encoder: the first request indexes
        // every field, the second refers to them (be = the bad authority).
        // Huffman-coded, as most encoders do.
        let first = hpack_bytes("8386 448f 635d 87f3 eb71 6cee 6215 8d76 1fcf af41 8954 5853 4d6a 8b0f 51a3");
        // :method POST, :scheme http, then indexed :path (63) and
        // :authority (62).
        let second = hpack_bytes("8386 bf be");
        let input = connection(&[first, second], b"x");
        let (output, rewriter) = run(&input, 5);
        assert_eq!(rewriter.dropped, 2);
        let decoded = blocks(&output);
        for fields in decoded {
            assert_eq!(
                fields,
                vec![
                    (":method".to_string(), "POST".to_string()),
                    (":scheme".into(), "http".into()),
                    (":path".into(), "/ProxyService/Proxy".into()),
                ]
            );
        }
    }

    fn hpack_bytes(hex: &str) -> Vec<u8> {
        let hex: String = hex.split_whitespace().collect();
        (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn keeps_priority_and_end_stream_and_drops_padding() {
        let block = literal_block(&[(":method", "GET"), (":authority", "%2Fx")]);
        let mut payload = vec![3u8]; // pad length
        payload.extend([0x80, 0, 0, 1, 200]); // exclusive dependency on 1, weight 200
        payload.extend(&block);
        payload.extend([0, 0, 0]);
        let mut input = PREFACE.to_vec();
        input.extend(frame(
            HEADERS,
            END_HEADERS | END_STREAM | PADDED | PRIORITY,
            3,
            &payload,
        ));
        let (output, _) = run(&input, 4);
        let header = FrameHeader::parse(&output[PREFACE.len()..]);
        assert_eq!(header.flags, END_HEADERS | END_STREAM | PRIORITY);
        assert_eq!(header.stream_id, 3);
        let body = &output[PREFACE.len() + FRAME_HEADER_LEN..];
        assert_eq!(&body[..5], &[0x80, 0, 0, 1, 200]);
        assert_eq!(
            blocks(&output),
            vec![vec![(":method".to_string(), "GET".to_string())]]
        );
    }

    #[test]
    fn a_block_split_over_continuations_is_joined_and_a_large_one_split_again() {
        let big = "v".repeat(20_000);
        let block = literal_block(&[(":method", "POST"), (":authority", "/tmp/s"), ("x-big", &big)]);
        let (a, b) = block.split_at(10);
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, 0, 1, a));
        input.extend(frame(CONTINUATION, END_HEADERS, 1, b));
        let (output, rewriter) = run(&input, 1000);
        assert_eq!(rewriter.dropped, 1);
        let kinds: Vec<u8> = {
            let mut at = PREFACE.len();
            let mut kinds = Vec::new();
            while at < output.len() {
                let header = FrameHeader::parse(&output[at..]);
                assert!(header.length <= EMIT_FRAME);
                kinds.push(header.kind);
                at += FRAME_HEADER_LEN + header.length;
            }
            kinds
        };
        assert_eq!(kinds, vec![HEADERS, CONTINUATION]);
        assert_eq!(blocks(&output)[0].len(), 2);
    }

    #[test]
    fn what_it_cannot_parse_reaches_h2_unchanged() {
        // Not HTTP/2 at all.
        let http1 = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec();
        assert_eq!(run(&http1, 3).0, http1);
        // A CONTINUATION interleaved with another frame.
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, 0, 1, &literal_block(&[(":authority", "%2F")])));
        input.extend(frame(0x0, 0, 1, b"data"));
        input.extend(frame(CONTINUATION, END_HEADERS, 1, b""));
        assert_eq!(run(&input, 6).0, input);
        // A block that is not HPACK (index 70 of an empty table).
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, END_HEADERS, 1, &[0xc6]));
        input.extend(frame(0x0, 0, 1, b"after"));
        assert_eq!(run(&input, 2).0, input);
        // Padding longer than the frame.
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, END_HEADERS | PADDED, 1, &[9, 0x82]));
        assert_eq!(run(&input, 50).0, input);
    }
}
