//! The part of a call record the merge reads, decoded straight from msgpack.
//!
//! The Python side encodes `list[CallRecord]` with msgspec: an array of maps keyed by field name.
//! A small hand-written reader decodes the five fields the merge needs and skips every other
//! value, so records can grow freely. Token arrays dominate the payload, and reading them in a
//! tight loop is several times faster than going through a generic deserialiser.

use super::error::{MergeError, Result};

/// One call, validated: `tokens` is prompt + completion, the first `n_prompt` being the prompt.
/// Buffers are recycled from call to call (see `CallReader::read_into` and `Trie::insert`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Call {
    pub rollout_id: String,
    pub tokens: Vec<u32>,
    pub n_prompt: usize,
    pub logprobs: Vec<f32>,
    pub policy_version: i32,
}

const MAX_TOKEN: i64 = 1 << 31;

impl Call {
    /// Build from loosely typed parts (the Python-object path), with the decoder's checks.
    pub fn new(c: usize, rollout_id: String, prompt: &[i64], completion: &[i64], logprobs: &[f64], version: i64) -> Result<Call> {
        let mut tokens = Vec::with_capacity(prompt.len() + completion.len());
        for (i, &t) in prompt.iter().chain(completion).enumerate() {
            tokens.push(check_token(c, i, t)?);
        }
        let call = Call {
            rollout_id,
            tokens,
            n_prompt: prompt.len(),
            logprobs: logprobs.iter().map(|&x| x as f32).collect(),
            policy_version: check_version(c, version)?,
        };
        call.check_lengths(c)?;
        Ok(call)
    }

    pub fn prompt(&self) -> &[u32] {
        &self.tokens[..self.n_prompt]
    }

    pub fn completion(&self) -> &[u32] {
        &self.tokens[self.n_prompt..]
    }

    fn check_lengths(&self, c: usize) -> Result<()> {
        let n = self.tokens.len() - self.n_prompt;
        if n != self.logprobs.len() {
            return Err(MergeError::new(format!("call {c}: {n} completion ids but {} logprobs", self.logprobs.len())));
        }
        Ok(())
    }
}

fn check_token(c: usize, i: usize, t: i64) -> Result<u32> {
    if (0..MAX_TOKEN).contains(&t) {
        Ok(t as u32)
    } else {
        Err(MergeError::new(format!("call {c}: token id {t} at position {i} is out of range")))
    }
}

fn check_version(c: usize, v: i64) -> Result<i32> {
    i32::try_from(v).map_err(|_| MergeError::new(format!("call {c}: policy_version {v} is out of range")))
}

/// Streams call records out of a msgpack array without materialising them all: each call is read
/// into a caller-owned buffer, so decoding a group touches little more memory than its payload.
pub struct CallReader<'a> {
    r: Reader<'a>,
    remaining: usize,
    index: usize,
}

impl<'a> CallReader<'a> {
    pub fn new(payload: &'a [u8]) -> Result<Self> {
        let mut r = Reader { buf: payload, pos: 0 };
        let remaining = r.array_len()?;
        Ok(CallReader { r, remaining, index: 0 })
    }

    /// Read the next call into `call`; false once every record has been read.
    pub fn read_into(&mut self, call: &mut Call) -> Result<bool> {
        if self.remaining == 0 {
            if self.r.pos != self.r.buf.len() {
                let extra = self.r.buf.len() - self.r.pos;
                return Err(MergeError::new(format!("{extra} trailing bytes after the call records")));
            }
            return Ok(false);
        }
        self.r.call(self.index, call)?;
        self.remaining -= 1;
        self.index += 1;
        Ok(true)
    }
}

pub fn decode_calls(payload: &[u8]) -> Result<Vec<Call>> {
    let mut reader = CallReader::new(payload)?;
    let mut calls = Vec::new();
    let mut call = Call::default();
    while reader.read_into(&mut call)? {
        calls.push(std::mem::take(&mut call));
    }
    Ok(calls)
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn fail<T>(&self, what: &str) -> Result<T> {
        Err(MergeError::new(format!("malformed msgpack at byte {}: {what}", self.pos)))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.buf.len() - self.pos < n {
            return self.fail("unexpected end of input");
        }
        let out = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    fn byte(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }

    fn be(&mut self, n: usize) -> Result<u64> {
        Ok(self.take(n)?.iter().fold(0u64, |acc, &b| (acc << 8) | b as u64))
    }

    fn array_len(&mut self) -> Result<usize> {
        match self.byte()? {
            m @ 0x90..=0x9f => Ok((m & 0x0f) as usize),
            0xdc => Ok(self.be(2)? as usize),
            0xdd => Ok(self.be(4)? as usize),
            _ => self.fail("expected an array"),
        }
    }

    fn map_len(&mut self) -> Result<usize> {
        match self.byte()? {
            m @ 0x80..=0x8f => Ok((m & 0x0f) as usize),
            0xde => Ok(self.be(2)? as usize),
            0xdf => Ok(self.be(4)? as usize),
            _ => self.fail("expected a map (a call record)"),
        }
    }

    fn str(&mut self) -> Result<&'a str> {
        let n = match self.byte()? {
            m @ 0xa0..=0xbf => (m & 0x1f) as usize,
            0xd9 => self.be(1)? as usize,
            0xda => self.be(2)? as usize,
            0xdb => self.be(4)? as usize,
            _ => return self.fail("expected a string"),
        };
        let bytes = self.take(n)?;
        std::str::from_utf8(bytes).or_else(|_| self.fail("string is not UTF-8"))
    }

    fn int(&mut self) -> Result<i64> {
        let m = self.byte()?;
        Ok(match m {
            0x00..=0x7f => m as i64,
            0xe0..=0xff => m as i8 as i64,
            0xcc => self.be(1)? as i64,
            0xcd => self.be(2)? as i64,
            0xce => self.be(4)? as i64,
            0xcf => i64::try_from(self.be(8)?).or_else(|_| self.fail("integer too large"))?,
            0xd0 => self.be(1)? as u8 as i8 as i64,
            0xd1 => self.be(2)? as u16 as i16 as i64,
            0xd2 => self.be(4)? as u32 as i32 as i64,
            0xd3 => self.be(8)? as i64,
            _ => return self.fail("expected an integer"),
        })
    }

    fn float(&mut self) -> Result<f64> {
        match self.buf.get(self.pos) {
            Some(0xcb) => {
                self.pos += 1;
                Ok(f64::from_bits(self.be(8)?))
            }
            Some(0xca) => {
                self.pos += 1;
                Ok(f32::from_bits(self.be(4)? as u32) as f64)
            }
            _ => Ok(self.int()? as f64), // msgspec writes integral floats as floats; accept ints too
        }
    }

    /// Token ids appended to `out`; `c` and `first` only name a bad id in the error.
    fn tokens(&mut self, out: &mut Vec<u32>, c: usize, first: usize) -> Result<usize> {
        let n = self.array_len()?;
        out.reserve(n.min(self.buf.len() - self.pos));
        let mut i = 0;
        while i < n {
            // uint16 and fixint cover nearly every id of a 32k-256k vocabulary: decode runs of
            // them without the general path
            let rest = &self.buf[self.pos..];
            let mut used = 0;
            while i < n {
                match rest.get(used) {
                    Some(&m) if m < 0x80 => {
                        out.push(m as u32);
                        used += 1;
                    }
                    Some(0xcd) if used + 3 <= rest.len() => {
                        out.push(u16::from_be_bytes([rest[used + 1], rest[used + 2]]) as u32);
                        used += 3;
                    }
                    _ => break,
                }
                i += 1;
            }
            self.pos += used;
            if i < n {
                let t = self.int()?;
                out.push(check_token(c, first + i, t)?);
                i += 1;
            }
        }
        Ok(n)
    }

    fn floats(&mut self, out: &mut Vec<f32>) -> Result<()> {
        let n = self.array_len()?;
        out.reserve(n.min(self.buf.len() - self.pos));
        for _ in 0..n {
            out.push(self.float()? as f32);
        }
        Ok(())
    }

    fn skip(&mut self) -> Result<()> {
        let m = self.byte()?;
        let n = match m {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => 0,
            0x80..=0x8f => return self.skip_items(2 * (m & 0x0f) as usize),
            0x90..=0x9f => return self.skip_items((m & 0x0f) as usize),
            0xa0..=0xbf => (m & 0x1f) as usize,
            0xc4 | 0xd9 => self.be(1)? as usize,
            0xc5 | 0xda => self.be(2)? as usize,
            0xc6 | 0xdb => self.be(4)? as usize,
            0xc7 => self.be(1)? as usize + 1,
            0xc8 => self.be(2)? as usize + 1,
            0xc9 => self.be(4)? as usize + 1,
            0xca => 4,
            0xcb => 8,
            0xcc | 0xd0 => 1,
            0xcd | 0xd1 => 2,
            0xce | 0xd2 => 4,
            0xcf | 0xd3 => 8,
            0xd4 => 2,
            0xd5 => 3,
            0xd6 => 5,
            0xd7 => 9,
            0xd8 => 17,
            0xdc => return { let k = self.be(2)? as usize; self.skip_items(k) },
            0xdd => return { let k = self.be(4)? as usize; self.skip_items(k) },
            0xde => return { let k = self.be(2)? as usize; self.skip_items(2 * k) },
            0xdf => return { let k = self.be(4)? as usize; self.skip_items(2 * k) },
            0xc1 => return self.fail("reserved byte 0xc1"),
        };
        self.take(n).map(|_| ())
    }

    fn skip_items(&mut self, n: usize) -> Result<()> {
        for _ in 0..n {
            self.skip()?;
        }
        Ok(())
    }

    fn call(&mut self, c: usize, call: &mut Call) -> Result<()> {
        call.tokens.clear();
        call.logprobs.clear();
        call.rollout_id.clear();
        // msgspec writes fields in declaration order: prompt, then completion, appended to the
        // same buffer; the other order is handled by rotating once
        let (mut n_prompt, mut n_completion) = (None, None);
        let (mut have_rollout, mut have_logprobs, mut version) = (false, false, None);
        let fields = self.map_len()?;
        for _ in 0..fields {
            match self.str()? {
                "rollout_id" => {
                    call.rollout_id.push_str(self.str()?);
                    have_rollout = true;
                }
                "prompt_ids" => {
                    let before = call.tokens.len();
                    let n = self.tokens(&mut call.tokens, c, 0)?;
                    if before > 0 {
                        call.tokens.rotate_right(n);
                    }
                    n_prompt = Some(n);
                }
                "completion_ids" => {
                    let at = call.tokens.len();
                    n_completion = Some(self.tokens(&mut call.tokens, c, at)?);
                }
                "completion_logprobs" => {
                    self.floats(&mut call.logprobs)?;
                    have_logprobs = true;
                }
                "policy_version" => version = Some(check_version(c, self.int()?)?),
                _ => self.skip()?,
            }
        }
        let missing = |name: &str| MergeError::new(format!("call record {c}: missing field {name:?}"));
        call.n_prompt = n_prompt.ok_or_else(|| missing("prompt_ids"))?;
        n_completion.ok_or_else(|| missing("completion_ids"))?;
        call.policy_version = version.ok_or_else(|| missing("policy_version"))?;
        if !have_rollout {
            return Err(missing("rollout_id"));
        }
        if !have_logprobs {
            return Err(missing("completion_logprobs"));
        }
        call.check_lengths(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_every_int_width_and_skips_unknown_fields() {
        // [{"x": [nil, {"a": 1}], "rollout_id": "r", "prompt_ids": [1, 200, 70000, 4294967295],
        //   "completion_ids": [-1], "completion_logprobs": [-0.5], "policy_version": 3}]
        let mut b = vec![0x91, 0x86, 0xa1, b'x', 0x92, 0xc0, 0x81, 0xa1, b'a', 0x01];
        b.extend([0xaa]);
        b.extend(b"rollout_id");
        b.extend([0xa1, b'r', 0xaa]);
        b.extend(b"prompt_ids");
        b.extend([0x94, 0x01, 0xcc, 200, 0xce, 0x00, 0x01, 0x11, 0x70, 0xce, 0xff, 0xff, 0xff, 0xff]);
        b.extend([0xae]);
        b.extend(b"completion_ids");
        b.extend([0x91, 0xff, 0xb3]);
        b.extend(b"completion_logprobs");
        b.extend([0x91, 0xcb]);
        b.extend((-0.5f64).to_bits().to_be_bytes());
        b.extend([0xae]);
        b.extend(b"policy_version");
        b.push(0x03);
        let err = decode_calls(&b).unwrap_err().0;
        assert!(err.contains("token id 4294967295 at position 3"), "{err}");
        let at = b.iter().position(|&x| x == 0xce).unwrap() + 5; // the last id: 0xffffffff -> 5
        b[at..at + 5].copy_from_slice(&[0xce, 0, 0, 0, 5]);
        let err = decode_calls(&b).unwrap_err().0;
        assert!(err.contains("token id -1 at position 4"), "{err}");
        let at = b.iter().position(|&x| x == 0xff).unwrap();
        b[at] = 0x09;
        let calls = decode_calls(&b).unwrap();
        assert_eq!(calls[0].prompt(), [1, 200, 70000, 5]);
        assert_eq!(calls[0].completion(), [9]);
        assert_eq!(calls[0].logprobs, vec![-0.5]);
        assert_eq!((calls[0].rollout_id.as_str(), calls[0].policy_version), ("r", 3));
    }

    #[test]
    fn truncated_or_foreign_input_is_an_error() {
        assert!(decode_calls(&[0x91, 0x81]).is_err());
        assert!(decode_calls(&[0x91, 0x80]).unwrap_err().0.contains("missing field"));
        assert!(decode_calls(&[0xc1]).is_err());
        assert!(decode_calls(&[0x90, 0x00]).unwrap_err().0.contains("trailing"));
        assert_eq!(decode_calls(&[0x90]).unwrap(), vec![]);
    }
}
