//! HPACK's Huffman code (RFC 7541 §5.2, Appendix B), decoding only.
//!
//! The code is canonical: codes of one length are consecutive and ordered by
//! symbol, and each length starts where the previous one ended, shifted left
//! by one bit. So the table is fully described by the length of each
//! symbol's code, and decoding needs only, per length, the first code and
//! how many codes there are (the classic canonical-code decoder).

/// The length in bits of the code of each byte value, then of EOS (256),
/// as RFC 7541 Appendix B lists them.
const CODE_LENGTHS: [u8; 257] = [
    13, 23, 28, 28, 28, 28, 28, 28, 28, 24, 30, 28, 28, 30, 28, 28, 28, 28, 28, 28, 28, 28, 30, 28, 28, 28,
    28, 28, 28, 28, 28, 28, 6, 10, 10, 12, 13, 6, 8, 11, 10, 10, 8, 11, 8, 6, 6, 6, 5, 5, 5, 6, 6, 6, 6, 6,
    6, 6, 7, 8, 15, 6, 12, 10, 13, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 8, 7,
    8, 13, 19, 13, 14, 6, 15, 5, 6, 5, 6, 5, 6, 6, 6, 5, 7, 7, 6, 6, 6, 5, 6, 7, 6, 5, 5, 6, 7, 7, 7, 7, 7,
    15, 11, 14, 13, 28, 20, 22, 20, 20, 22, 22, 22, 23, 22, 23, 23, 23, 23, 23, 24, 23, 24, 24, 22, 23, 24,
    23, 23, 23, 23, 21, 22, 23, 22, 23, 23, 24, 22, 21, 20, 22, 22, 23, 23, 21, 23, 22, 22, 24, 21, 22, 23,
    23, 21, 21, 22, 21, 23, 22, 23, 23, 20, 22, 22, 22, 23, 22, 22, 23, 26, 26, 20, 19, 22, 23, 22, 25, 26,
    26, 26, 27, 27, 26, 24, 25, 19, 21, 26, 27, 27, 26, 27, 24, 21, 21, 26, 26, 28, 27, 27, 27, 20, 24, 20,
    21, 22, 21, 21, 23, 22, 22, 25, 25, 24, 24, 26, 23, 26, 27, 26, 26, 27, 27, 27, 27, 27, 28, 27, 27, 27,
    27, 27, 26, 30,
];

/// The longest code (RFC 7541 Appendix B).
const MAX_LENGTH: usize = 30;
const EOS: u16 = 256;

/// What decoding needs, per code length: the first code of that length,
/// how many codes have it, and where their symbols start in `symbols`
/// (which lists all symbols ordered by code length, then by value).
struct Canonical {
    first_code: [u32; MAX_LENGTH + 1],
    count: [u32; MAX_LENGTH + 1],
    offset: [u16; MAX_LENGTH + 1],
    symbols: [u16; 257],
}

const fn canonical() -> Canonical {
    let mut table = Canonical {
        first_code: [0; MAX_LENGTH + 1],
        count: [0; MAX_LENGTH + 1],
        offset: [0; MAX_LENGTH + 1],
        symbols: [0; 257],
    };
    let mut symbol = 0;
    while symbol < 257 {
        table.count[CODE_LENGTHS[symbol] as usize] += 1;
        symbol += 1;
    }
    let mut code = 0;
    let mut offset = 0;
    let mut length = 1;
    while length <= MAX_LENGTH {
        table.first_code[length] = code;
        table.offset[length] = offset;
        code = (code + table.count[length]) << 1;
        offset += table.count[length] as u16;
        length += 1;
    }
    // Fill `symbols` length by length, each length's in increasing value.
    let mut next = table.offset;
    let mut symbol = 0;
    while symbol < 257 {
        let length = CODE_LENGTHS[symbol] as usize;
        table.symbols[next[length] as usize] = symbol as u16;
        next[length] += 1;
        symbol += 1;
    }
    table
}

static CODE: Canonical = canonical();

/// Why a Huffman-coded string is not valid HPACK.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(super) enum HuffmanError {
    #[error("a Huffman-coded string contains EOS")]
    Eos,
    #[error("a Huffman-coded string ends in padding longer than 7 bits or not all ones")]
    Padding,
}

/// Decodes a Huffman-coded string, appending its bytes to `out`.
pub(super) fn decode(input: &[u8], out: &mut Vec<u8>) -> Result<(), HuffmanError> {
    let mut code: u32 = 0;
    let mut length = 0;
    for byte in input {
        for shift in (0..8).rev() {
            code = (code << 1) | u32::from((byte >> shift) & 1);
            length += 1;
            // A prefix of a longer code is never below the first code of
            // its own length, so one subtraction tells both.
            let index = code.wrapping_sub(CODE.first_code[length]);
            if index < CODE.count[length] {
                let symbol = CODE.symbols[CODE.offset[length] as usize + index as usize];
                if symbol == EOS {
                    return Err(HuffmanError::Eos);
                }
                out.push(symbol as u8);
                code = 0;
                length = 0;
            } else if length == MAX_LENGTH {
                // Every 30-bit sequence is a code, so this cannot happen
                // with the table above; it keeps a malformed table from
                // indexing past the arrays.
                return Err(HuffmanError::Padding);
            }
        }
    }
    // What is left must be a prefix of EOS (all ones), shorter than a byte.
    if length > 7 || code != (1 << length) - 1 {
        return Err(HuffmanError::Padding);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decoded(hex: &str) -> Result<String, HuffmanError> {
        let bytes = hex_bytes(hex);
        let mut out = Vec::new();
        decode(&bytes, &mut out).map(|()| String::from_utf8(out).unwrap())
    }

    pub(crate) fn hex_bytes(hex: &str) -> Vec<u8> {
        let hex: String = hex.split_whitespace().collect();
        (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn decodes_the_strings_of_rfc7541_appendix_c() {
        // C.4.1, C.4.2, C.4.3 and C.6.1.
        assert_eq!(
            decoded("f1e3 c2e5 f23a 6ba0 ab90 f4ff").unwrap(),
            "www.example.com"
        );
        assert_eq!(decoded("a8eb 1064 9cbf").unwrap(), "no-cache");
        assert_eq!(decoded("25a8 49e9 5ba9 7d7f").unwrap(), "custom-key");
        assert_eq!(decoded("25a8 49e9 5bb8 e8b4 bf").unwrap(), "custom-value");
        assert_eq!(decoded("6402").unwrap(), "302");
        assert_eq!(
            decoded("d07a be94 1054 d444 a820 0595 040b 8166 e082 a62d 1bff").unwrap(),
            "Mon, 21 Oct 2013 20:13:21 GMT"
        );
        assert_eq!(
            decoded("9d29 ad17 1863 c78f 0b97 c8e9 ae82 ae43 d3").unwrap(),
            "https://www.example.com"
        );
    }

    #[test]
    fn decodes_a_percent_encoded_socket_path() {
        // As grpc-go sends it for a Unix socket target; '%' has a 6-bit code.
        // Encoded with an independent implementation (Python's hpack).
        assert_eq!(
            decoded(
                "5458 4a92 2a2c 3d6d 8cb6 5454 950a 8b0f 53d5 5148 9377 327d 2c82 d9dc b62a 2c3d 4f55 4522 4ddc c9f4 b20b 6772 d8ba 0e4e a54f"
            ).unwrap(),
            "%2Fetc%2Fkubernetes%2Fkonnectivity-server%2Fkonnectivity-server.socket"
        );
    }

    #[test]
    fn every_byte_value_round_trips_through_the_code_lengths() {
        // Encode with the canonical codes the lengths imply, decode back.
        let mut codes = [0u32; 257];
        for length in 1..=MAX_LENGTH {
            for i in 0..CODE.count[length] {
                let symbol = CODE.symbols[CODE.offset[length] as usize + i as usize];
                codes[symbol as usize] = CODE.first_code[length] + i;
            }
        }
        let input: Vec<u8> = (0..=255).collect();
        let (mut bits, mut pending, mut encoded) = (0u32, 0u64, Vec::new());
        for &byte in &input {
            let length = u32::from(CODE_LENGTHS[byte as usize]);
            pending = (pending << length) | u64::from(codes[byte as usize]);
            bits += length;
            while bits >= 8 {
                encoded.push((pending >> (bits - 8)) as u8);
                bits -= 8;
            }
        }
        if bits > 0 {
            encoded.push(((pending << (8 - bits)) as u8) | ((1u8 << (8 - bits)) - 1));
        }
        let mut out = Vec::new();
        decode(&encoded, &mut out).unwrap();
        assert_eq!(out, input);
        // The all-ones code is EOS, 30 bits long.
        assert_eq!(codes[256], (1 << 30) - 1);
    }

    #[test]
    fn refuses_eos_and_bad_padding() {
        assert_eq!(decoded("ffff fffc"), Err(HuffmanError::Eos));
        // "0" is 00000 (5 bits); padding with zeros instead of ones.
        assert_eq!(decoded("00"), Err(HuffmanError::Padding));
        // A whole byte of padding.
        assert_eq!(decoded("07ff"), Err(HuffmanError::Padding));
        assert_eq!(decoded("07").unwrap(), "0");
    }
}
