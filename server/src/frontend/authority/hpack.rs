//! HPACK (RFC 7541): a decoder that follows the client's dynamic table, and
//! the one encoding the rewriter emits, a literal that never touches the
//! receiver's dynamic table.
//!
//! Bounds: the dynamic table is limited to the size the server announced
//! (HTTP/2's default, 4,096 bytes: tonic leaves it unchanged); a header list
//! is decoded only up to a caller's limit, so a small block of references to
//! a large entry cannot make it allocate without bound.

use std::collections::VecDeque;

use bytes::{BufMut, Bytes, BytesMut};

use super::huffman::{self, HuffmanError};

/// SETTINGS_HEADER_TABLE_SIZE's initial value (RFC 9113 §6.5.2), which the
/// server never changes; the client's encoder may use at most this much.
pub(super) const DEFAULT_TABLE_SIZE: usize = 4096;

/// RFC 7541 §4.1: an entry costs its name and value plus 32 bytes.
const ENTRY_OVERHEAD: usize = 32;

/// RFC 7541 Appendix A.
const STATIC_TABLE: [(&str, &str); 61] = [
    (":authority", ""),
    (":method", "GET"),
    (":method", "POST"),
    (":path", "/"),
    (":path", "/index.html"),
    (":scheme", "http"),
    (":scheme", "https"),
    (":status", "200"),
    (":status", "204"),
    (":status", "206"),
    (":status", "304"),
    (":status", "400"),
    (":status", "404"),
    (":status", "500"),
    ("accept-charset", ""),
    ("accept-encoding", "gzip, deflate"),
    ("accept-language", ""),
    ("accept-ranges", ""),
    ("accept", ""),
    ("access-control-allow-origin", ""),
    ("age", ""),
    ("allow", ""),
    ("authorization", ""),
    ("cache-control", ""),
    ("content-disposition", ""),
    ("content-encoding", ""),
    ("content-language", ""),
    ("content-length", ""),
    ("content-location", ""),
    ("content-range", ""),
    ("content-type", ""),
    ("cookie", ""),
    ("date", ""),
    ("etag", ""),
    ("expect", ""),
    ("expires", ""),
    ("from", ""),
    ("host", ""),
    ("if-match", ""),
    ("if-modified-since", ""),
    ("if-none-match", ""),
    ("if-range", ""),
    ("if-unmodified-since", ""),
    ("last-modified", ""),
    ("link", ""),
    ("location", ""),
    ("max-forwards", ""),
    ("proxy-authenticate", ""),
    ("proxy-authorization", ""),
    ("range", ""),
    ("referer", ""),
    ("refresh", ""),
    ("retry-after", ""),
    ("server", ""),
    ("set-cookie", ""),
    ("strict-transport-security", ""),
    ("transfer-encoding", ""),
    ("user-agent", ""),
    ("vary", ""),
    ("via", ""),
    ("www-authenticate", ""),
];

/// One decoded header field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Field {
    pub name: Bytes,
    pub value: Bytes,
    /// Sent as "never indexed" (RFC 7541 §6.2.3), e.g. a credential: an
    /// intermediary must keep it so.
    pub sensitive: bool,
}

impl Field {
    fn size(&self) -> usize {
        self.name.len() + self.value.len() + ENTRY_OVERHEAD
    }
}

/// Why a header block is not valid HPACK (or is over the caller's limit).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum HpackError {
    #[error("the header block ends inside a field")]
    Truncated,
    #[error("an integer in the header block is too large")]
    IntegerOverflow,
    #[error("index {0} is in neither the static nor the dynamic table")]
    InvalidIndex(usize),
    #[error(transparent)]
    Huffman(#[from] HuffmanError),
    #[error("a dynamic table size update to {size} exceeds the {limit} bytes allowed")]
    TableSizeTooLarge { size: usize, limit: usize },
    #[error("a dynamic table size update follows a header field")]
    LateTableSizeUpdate,
    #[error("the header list decodes to more than {0} bytes")]
    ListTooLarge(usize),
}

/// Decodes header blocks as the peer's encoder wrote them, keeping the
/// dynamic table in step with the peer's.
#[derive(Debug)]
pub(super) struct Decoder {
    /// Newest first: index 62 is `table[0]`.
    table: VecDeque<Field>,
    size: usize,
    max_size: usize,
    /// What the peer may raise `max_size` to.
    limit: usize,
}

impl Decoder {
    pub(super) fn new(limit: usize) -> Decoder {
        Decoder {
            table: VecDeque::new(),
            size: 0,
            max_size: limit,
            limit,
        }
    }

    /// Decodes one complete header block. `list_limit` bounds the decoded
    /// list (names, values and 32 bytes a field, as HTTP/2 counts it).
    /// After an error the table is in no known state: the connection's
    /// header compression is lost, as RFC 7541 §2.3.3 says.
    pub(super) fn decode(&mut self, block: &[u8], list_limit: usize) -> Result<Vec<Field>, HpackError> {
        let mut input = Input(block);
        let mut fields = Vec::new();
        let mut list_size = 0;
        while let Some(&first) = input.0.first() {
            let field = if first & 0x80 != 0 {
                // Indexed field (§6.1).
                let index = input.integer(7)?;
                self.entry(index)?
            } else if first & 0xc0 == 0x40 {
                // Literal with incremental indexing (§6.2.1).
                let field = self.literal(&mut input, 6, false)?;
                self.insert(field.clone());
                field
            } else if first & 0xe0 == 0x20 {
                // Dynamic table size update (§6.3): only before any field.
                if !fields.is_empty() {
                    return Err(HpackError::LateTableSizeUpdate);
                }
                let size = input.integer(5)?;
                if size > self.limit {
                    return Err(HpackError::TableSizeTooLarge {
                        size,
                        limit: self.limit,
                    });
                }
                self.max_size = size;
                self.evict_to(size);
                continue;
            } else {
                // Without indexing (0000) or never indexed (0001), §6.2.2-3.
                let sensitive = first & 0x10 != 0;
                self.literal(&mut input, 4, sensitive)?
            };
            list_size += field.size();
            if list_size > list_limit {
                return Err(HpackError::ListTooLarge(list_limit));
            }
            fields.push(field);
        }
        Ok(fields)
    }

    /// The dynamic table's current size, as §4.1 counts it.
    #[cfg(test)]
    pub fn table_size(&self) -> usize {
        self.size
    }

    /// A literal field whose name is indexed (a non-zero `prefix_bits`
    /// integer) or literal.
    fn literal(&self, input: &mut Input, prefix_bits: u8, sensitive: bool) -> Result<Field, HpackError> {
        let name = match input.integer(prefix_bits)? {
            0 => input.string()?,
            index => self.entry(index)?.name,
        };
        let value = input.string()?;
        Ok(Field {
            name,
            value,
            sensitive,
        })
    }

    fn entry(&self, index: usize) -> Result<Field, HpackError> {
        if index == 0 {
            return Err(HpackError::InvalidIndex(0));
        }
        if let Some((name, value)) = STATIC_TABLE.get(index - 1) {
            return Ok(Field {
                name: Bytes::from_static(name.as_bytes()),
                value: Bytes::from_static(value.as_bytes()),
                sensitive: false,
            });
        }
        let field = self
            .table
            .get(index - STATIC_TABLE.len() - 1)
            .ok_or(HpackError::InvalidIndex(index))?;
        Ok(Field {
            sensitive: false,
            ..field.clone()
        })
    }

    /// §4.4: evicts from the oldest end until the entry fits; an entry
    /// larger than the whole table empties it and is not added.
    fn insert(&mut self, field: Field) {
        let size = field.size();
        if size > self.max_size {
            self.table.clear();
            self.size = 0;
            return;
        }
        self.evict_to(self.max_size - size);
        self.size += size;
        self.table.push_front(field);
    }

    fn evict_to(&mut self, size: usize) {
        while self.size > size {
            let oldest = self.table.pop_back().expect("a table with a size has entries");
            self.size -= oldest.size();
        }
    }
}

/// The unread rest of a header block.
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn byte(&mut self) -> Result<u8, HpackError> {
        let (&byte, rest) = self.0.split_first().ok_or(HpackError::Truncated)?;
        self.0 = rest;
        Ok(byte)
    }

    /// §5.1: an integer in the low `prefix_bits` of the first byte,
    /// continued in 7-bit groups while that prefix is all ones.
    fn integer(&mut self, prefix_bits: u8) -> Result<usize, HpackError> {
        let mask = (1usize << prefix_bits) - 1;
        let mut value = usize::from(self.byte()?) & mask;
        if value < mask {
            return Ok(value);
        }
        // Four continuation bytes reach 2^28 plus the prefix, far beyond
        // any size or index this decoder can accept; more is an attack.
        for shift in [0, 7, 14, 21] {
            let byte = self.byte()?;
            value += usize::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(HpackError::IntegerOverflow)
    }

    /// §5.2: a length-prefixed string, Huffman-coded when the high bit of
    /// its first byte is set.
    fn string(&mut self) -> Result<Bytes, HpackError> {
        let huffman_coded = self.0.first().ok_or(HpackError::Truncated)? & 0x80 != 0;
        let length = self.integer(7)?;
        if length > self.0.len() {
            return Err(HpackError::Truncated);
        }
        let (raw, rest) = self.0.split_at(length);
        self.0 = rest;
        if huffman_coded {
            let mut decoded = Vec::with_capacity(length * 8 / 5);
            huffman::decode(raw, &mut decoded)?;
            Ok(Bytes::from(decoded))
        } else {
            Ok(Bytes::copy_from_slice(raw))
        }
    }
}

/// Appends `field` as a literal with a literal name, not Huffman-coded,
/// "without indexing" or, for a sensitive field, "never indexed": the
/// receiver's dynamic table stays empty, so nothing the rewriter emits
/// depends on earlier blocks.
pub(super) fn encode_literal(field: &Field, out: &mut BytesMut) {
    out.put_u8(if field.sensitive { 0x10 } else { 0x00 });
    encode_string(&field.name, out);
    encode_string(&field.value, out);
}

fn encode_string(text: &[u8], out: &mut BytesMut) {
    encode_integer(text.len(), 7, 0x00, out);
    out.put_slice(text);
}

/// §5.1, with `flags` in the first byte's bits above the prefix.
fn encode_integer(value: usize, prefix_bits: u8, flags: u8, out: &mut BytesMut) {
    let mask = (1usize << prefix_bits) - 1;
    if value < mask {
        out.put_u8(flags | value as u8);
        return;
    }
    out.put_u8(flags | mask as u8);
    let mut rest = value - mask;
    while rest >= 0x80 {
        out.put_u8((rest as u8 & 0x7f) | 0x80);
        rest >>= 7;
    }
    out.put_u8(rest as u8);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(text: &str) -> Vec<u8> {
        let text: String = text.split_whitespace().collect();
        (0..text.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
            .collect()
    }

    fn pairs(fields: &[Field]) -> Vec<(String, String)> {
        fields
            .iter()
            .map(|f| {
                (
                    String::from_utf8(f.name.to_vec()).unwrap(),
                    String::from_utf8(f.value.to_vec()).unwrap(),
                )
            })
            .collect()
    }

    fn expect(fields: &[(&str, &str)]) -> Vec<(String, String)> {
        fields
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect()
    }

    fn table(decoder: &Decoder) -> Vec<(String, String)> {
        pairs(&decoder.table.iter().cloned().collect::<Vec<_>>())
    }

    #[test]
    fn decodes_the_requests_of_rfc7541_c4_with_their_dynamic_table() {
        let mut decoder = Decoder::new(DEFAULT_TABLE_SIZE);
        let first = decoder
            .decode(&hex("8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff"), 1 << 20)
            .unwrap();
        assert_eq!(
            pairs(&first),
            expect(&[
                (":method", "GET"),
                (":scheme", "http"),
                (":path", "/"),
                (":authority", "www.example.com")
            ])
        );
        assert_eq!(decoder.size, 57);
        let second = decoder
            .decode(&hex("8286 84be 5886 a8eb 1064 9cbf"), 1 << 20)
            .unwrap();
        assert_eq!(
            pairs(&second)[3..],
            expect(&[(":authority", "www.example.com"), ("cache-control", "no-cache")])
        );
        let third = decoder
            .decode(
                &hex("8287 85bf 4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf"),
                1 << 20,
            )
            .unwrap();
        assert_eq!(
            pairs(&third),
            expect(&[
                (":method", "GET"),
                (":scheme", "https"),
                (":path", "/index.html"),
                (":authority", "www.example.com"),
                ("custom-key", "custom-value")
            ])
        );
        assert_eq!(
            table(&decoder),
            expect(&[
                ("custom-key", "custom-value"),
                ("cache-control", "no-cache"),
                (":authority", "www.example.com")
            ])
        );
        assert_eq!(decoder.size, 164);
    }

    #[test]
    fn evicts_as_rfc7541_c6_shows_with_a_256_byte_table() {
        // Encoded by Python's hpack with its table set to 256 bytes, which
        // it announces with a size update (3fe101) before the C.6.1 block.
        let mut decoder = Decoder::new(DEFAULT_TABLE_SIZE);
        decoder
            .decode(
                &hex(
                    "3fe101 4882 6402 5885 aec3 771a 4b61 96d0 7abe 9410 54d4 44a8 2005 9504 0b81 66e0
                     82a6 2d1b ff6e 919d 29ad 1718 63c7 8f0b 97c8 e9ae 82ae 43d3",
                ),
                1 << 20,
            )
            .unwrap();
        assert_eq!(decoder.size, 222);
        decoder.decode(&hex("4883 640e ffc1 c0bf"), 1 << 20).unwrap();
        let third = decoder
            .decode(
                &hex(
                    "88c1 6196 d07a be94 1054 d444 a820 0595 040b 8166 e084 a62d 1bff c05a 839b d9ab 77ad
                     94e7 821d d7f2 e6c7 b335 dfdf cd5b 3960 d5af 2708 7f36 72c1 ab27 0fb5 291f 9587 3160
                     65c0 03ed 4ee5 b106 3d50 07",
                ),
                1 << 20,
            )
            .unwrap();
        assert_eq!(
            pairs(&third)[5..],
            expect(&[(
                "set-cookie",
                "foo=ASDJKHQKBZXOQWEOPIUAXQWEOIU; max-age=3600; version=1"
            )])
        );
        assert_eq!(
            table(&decoder),
            expect(&[
                (
                    "set-cookie",
                    "foo=ASDJKHQKBZXOQWEOPIUAXQWEOIU; max-age=3600; version=1"
                ),
                ("content-encoding", "gzip"),
                ("date", "Mon, 21 Oct 2013 20:13:22 GMT")
            ])
        );
        assert_eq!(decoder.size, 215);
    }

    #[test]
    fn keeps_never_indexed_fields_sensitive() {
        // 0x10, literal name "password", literal value "secret" (C.2.3).
        let block = hex("1008 7061 7373 776f 7264 0673 6563 7265 74");
        let mut decoder = Decoder::new(DEFAULT_TABLE_SIZE);
        let fields = decoder.decode(&block, 1 << 20).unwrap();
        assert!(fields[0].sensitive);
        assert_eq!(decoder.size, 0, "never-indexed fields stay out of the table");
        let mut out = BytesMut::new();
        encode_literal(&fields[0], &mut out);
        assert_eq!(&out[..], &block[..]);
    }

    #[test]
    fn literals_it_encodes_decode_to_the_same_fields_and_leave_the_table_empty() {
        let long = "v".repeat(300);
        let fields = [
            Field {
                name: Bytes::from_static(b":authority"),
                value: Bytes::from_static(b"localhost"),
                sensitive: false,
            },
            Field {
                name: Bytes::from_static(b"x-long"),
                value: Bytes::from(long),
                sensitive: false,
            },
        ];
        let mut out = BytesMut::new();
        for field in &fields {
            encode_literal(field, &mut out);
        }
        let mut decoder = Decoder::new(DEFAULT_TABLE_SIZE);
        assert_eq!(decoder.decode(&out, 1 << 20).unwrap(), fields);
        assert!(decoder.table.is_empty());
    }

    #[test]
    fn refuses_what_rfc7541_forbids() {
        let mut decoder = Decoder::new(DEFAULT_TABLE_SIZE);
        assert_eq!(
            decoder.decode(&hex("80"), 1 << 20),
            Err(HpackError::InvalidIndex(0))
        );
        assert_eq!(
            decoder.decode(&hex("be"), 1 << 20),
            Err(HpackError::InvalidIndex(62))
        );
        assert_eq!(
            decoder.decode(&hex("4005 61"), 1 << 20),
            Err(HpackError::Truncated)
        );
        assert_eq!(
            decoder.decode(&hex("ff ff ff ff ff 0f"), 1 << 20),
            Err(HpackError::IntegerOverflow)
        );
        let mut too_large = BytesMut::new();
        encode_integer(4097, 5, 0x20, &mut too_large);
        assert_eq!(
            decoder.decode(&too_large, 1 << 20),
            Err(HpackError::TableSizeTooLarge {
                size: 4097,
                limit: 4096
            })
        );
        assert_eq!(
            decoder.decode(&hex("82 20"), 1 << 20),
            Err(HpackError::LateTableSizeUpdate)
        );
        assert_eq!(
            decoder.decode(&hex("0001 61 8100"), 1 << 20),
            Err(HpackError::Huffman(HuffmanError::Padding))
        );
    }

    #[test]
    fn a_block_of_references_to_a_large_entry_stops_at_the_list_limit() {
        let mut block = BytesMut::new();
        // Add a 3,000-byte value to the table, then reference it 100 times.
        block.put_u8(0x40);
        encode_string(b"x-big", &mut block);
        encode_string(&[b'a'; 3000], &mut block);
        block.put_slice(&[0xbe; 100]);
        let mut decoder = Decoder::new(DEFAULT_TABLE_SIZE);
        assert_eq!(
            decoder.decode(&block, 64 * 1024),
            Err(HpackError::ListTooLarge(64 * 1024))
        );
    }
}
