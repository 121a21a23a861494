//! Lists of int32 ids encoded byte for byte as msgspec encodes `list(ids)`, straight from the
//! ids, so a caller with an `array("i")` never builds a Python int per id.
//! Python reference: msgspec itself (tests/test_records.py, tests/test_engines.py).

/// MessagePack of `ids` as an array: the shortest encoding of its length and of each int.
pub fn msgpack_int32s(ids: impl ExactSizeIterator<Item = i32>) -> Vec<u8> {
    let n = ids.len();
    let mut out = Vec::with_capacity(5 + 3 * n);
    if n < 16 {
        out.push(0x90 | n as u8);
    } else if n < 1 << 16 {
        out.push(0xdc);
        out.extend_from_slice(&(n as u16).to_be_bytes());
    } else {
        out.push(0xdd);
        out.extend_from_slice(&(n as u32).to_be_bytes());
    }
    for v in ids {
        match v {
            0..=127 => out.push(v as u8),
            -32..=-1 => out.push(v as i8 as u8),
            128..=255 => out.extend_from_slice(&[0xcc, v as u8]),
            256..=65535 => {
                out.push(0xcd);
                out.extend_from_slice(&(v as u16).to_be_bytes());
            }
            65536.. => {
                out.push(0xce);
                out.extend_from_slice(&(v as u32).to_be_bytes());
            }
            -128..=-33 => out.extend_from_slice(&[0xd0, v as i8 as u8]),
            -32768..=-129 => {
                out.push(0xd1);
                out.extend_from_slice(&(v as i16).to_be_bytes());
            }
            _ => {
                out.push(0xd2);
                out.extend_from_slice(&v.to_be_bytes());
            }
        }
    }
    out
}

/// JSON of `ids` as msgspec writes it: `[1,2,3]`, no spaces.
pub fn json_int32s(ids: impl ExactSizeIterator<Item = i32>) -> Vec<u8> {
    // One pass into a buffer sized for the widest ids: measuring each id first costs more in
    // mispredicted branches than the spare capacity does.
    let mut out = Vec::with_capacity(2 + 12 * ids.len());
    let mut digits = itoa::Buffer::new();
    out.push(b'[');
    for v in ids {
        out.extend_from_slice(digits.format(v).as_bytes());
        out.push(b',');
    }
    match out.last_mut() {
        Some(last @ b',') => *last = b']',
        _ => out.push(b']'),
    }
    out
}

/// Native-endian int32 bytes of token ids, for `array("i").frombytes`.
pub fn ne_int32_bytes(ids: &[u32]) -> Vec<u8> {
    ids.iter().flat_map(|&id| (id as i32).to_ne_bytes()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn msgpack_picks_the_shortest_forms() {
        assert_eq!(msgpack_int32s([].into_iter()), vec![0x90]);
        assert_eq!(msgpack_int32s([1, -1, 200].into_iter()), vec![0x93, 0x01, 0xff, 0xcc, 200]);
        assert_eq!(msgpack_int32s([70000].into_iter()), vec![0x91, 0xce, 0, 1, 0x11, 0x70]);
        let long = msgpack_int32s(std::iter::repeat(0).take(16));
        assert_eq!(&long[..3], &[0xdc, 0, 16]);
    }

    #[test]
    fn json_has_no_spaces() {
        assert_eq!(json_int32s([].into_iter()), b"[]".to_vec());
        assert_eq!(json_int32s([1, -20, 300].into_iter()), b"[1,-20,300]".to_vec());
    }
}
