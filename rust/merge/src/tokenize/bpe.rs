//! Byte-level BPE encoding that reproduces HF `tokenizers` `encode(text, add_special_tokens=False)`
//! id for id, for the tokenizers modern LLMs ship (GPT-2/SmolLM2, Qwen2/3, Llama-3).
//!
//! The pipeline is HF's: split on added tokens that match the raw text (leftmost-longest, with
//! `lstrip`/`rstrip`), normalize each remaining segment (NFC or nothing), split on added tokens
//! that match normalized text, pre-tokenize (pretokenize.rs), then BPE each pre-token's bytes with
//! HF's own merge order (a min-heap on (rank, position), stale entries checked by new id). A
//! tokenizer.json with any part this module does not reproduce exactly is rejected with an error
//! naming that part; nothing is approximated.
//!
//! Words are cached (pre-token bytes -> ids, bounded), since tool outputs repeat words.

use std::borrow::Cow;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::Mutex;

use aho_corasick::{AhoCorasick, MatchKind};
use rustc_hash::FxHashMap;
use serde_json::Value;
use unicode_normalization_alignments::UnicodeNormalization;

use super::pretokenize::{split_digits, Pattern};

/// Words longer than this (bytes) are not cached, as in HF.
const CACHE_MAX_WORD_BYTES: usize = 256;
/// The cache is cleared when it holds this many words.
const CACHE_MAX_WORDS: usize = 1 << 16;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    Split(Pattern),
    Digits { individual: bool },
    ByteLevel { add_prefix_space: bool, use_regex: bool },
}

#[derive(Clone, Copy, Debug)]
struct Added {
    id: u32,
    lstrip: bool,
    rstrip: bool,
}

/// One trie of added tokens (HF keeps two: raw-text and normalized-text ones).
struct AddedSet {
    matcher: AhoCorasick,
    tokens: Vec<Added>, // by pattern index
}

enum Segment {
    Text(usize, usize),
    Token(u32),
}

impl AddedSet {
    fn new(patterns: Vec<(String, Added)>) -> Result<Option<AddedSet>, String> {
        if patterns.is_empty() {
            return Ok(None);
        }
        let matcher = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(patterns.iter().map(|(p, _)| p))
            .map_err(|e| format!("added tokens: {e}"))?;
        Ok(Some(AddedSet { matcher, tokens: patterns.into_iter().map(|(_, a)| a).collect() }))
    }

    /// HF `AddedVocabulary::find_matches`: text and token segments in order (text ones may be
    /// empty; a token's stripped whitespace is dropped).
    fn split(&self, s: &str, out: &mut Vec<Segment>) {
        let mut offset = 0;
        for m in self.matcher.find_iter(s) {
            let tok = self.tokens[m.pattern().as_usize()];
            let mut start = m.start();
            let mut stop = m.end();
            if tok.lstrip {
                let ws_start = s[..start].trim_end_matches(char::is_whitespace).len();
                start = ws_start.max(offset);
            }
            if tok.rstrip {
                stop = s.len() - s[stop..].trim_start_matches(char::is_whitespace).len();
            }
            if offset < start {
                out.push(Segment::Text(offset, start));
            }
            out.push(Segment::Token(tok.id));
            offset = stop;
        }
        if offset < s.len() {
            out.push(Segment::Text(offset, s.len()));
        }
    }
}

/// The BPE model over bytes: each byte's byte-level character id, and the merges.
struct Model {
    byte_ids: [Option<u32>; 256],
    merges: FxHashMap<u64, (u32, u32)>, // (left id, right id) -> (rank, new id)
    /// `ignore_merges`: a word that is itself in the vocabulary maps to its id directly.
    whole_words: Option<FxHashMap<Vec<u8>, u32>>,
}

#[derive(Default)]
struct Scratch {
    segments: Vec<Segment>,
    inner: Vec<Segment>,
    pieces: Vec<(usize, usize)>,
    next: Vec<(usize, usize)>,
    words: Vec<(usize, usize)>,
    symbols: Vec<Symbol>,
    heap: BinaryHeap<Reverse<(u32, u32, u32)>>, // (rank, pos, new id), min first
}

#[derive(Clone, Copy)]
struct Symbol {
    id: u32,
    prev: i32,
    next: i32,
    live: bool,
}

#[inline]
fn pair_key(a: u32, b: u32) -> u64 {
    ((a as u64) << 32) | b as u64
}

impl Model {
    /// HF `BPE::merge_word` + `Word::merge_all` (no dropout), pushing the ids onto `out`.
    fn merge(&self, word: &[u8], s: &mut Scratch, out: &mut Vec<u32>) {
        let symbols = &mut s.symbols;
        symbols.clear();
        for &b in word {
            // A byte without a vocabulary entry is dropped, as HF does without unk/byte_fallback.
            if let Some(id) = self.byte_ids[b as usize] {
                let i = symbols.len() as i32;
                symbols.push(Symbol { id, prev: i - 1, next: i + 1, live: true });
            }
        }
        if let Some(last) = symbols.last_mut() {
            last.next = -1;
        }
        let heap = &mut s.heap;
        heap.clear();
        for (pos, w) in symbols.windows(2).enumerate() {
            if let Some(&(rank, new_id)) = self.merges.get(&pair_key(w[0].id, w[1].id)) {
                heap.push(Reverse((rank, pos as u32, new_id)));
            }
        }
        while let Some(Reverse((_, pos, new_id))) = heap.pop() {
            let pos = pos as usize;
            if !symbols[pos].live || symbols[pos].next == -1 {
                continue;
            }
            let next_pos = symbols[pos].next as usize;
            let right = symbols[next_pos];
            match self.merges.get(&pair_key(symbols[pos].id, right.id)) {
                Some(&(_, id)) if id == new_id => {}
                _ => continue, // expired entry
            }
            symbols[pos].id = new_id;
            symbols[pos].next = right.next;
            symbols[next_pos].live = false;
            if right.next >= 0 {
                symbols[right.next as usize].prev = pos as i32;
            }
            let cur = symbols[pos];
            if cur.prev >= 0 {
                let prev = cur.prev as usize;
                if let Some(&(rank, id)) = self.merges.get(&pair_key(symbols[prev].id, cur.id)) {
                    heap.push(Reverse((rank, prev as u32, id)));
                }
            }
            if cur.next >= 0 {
                let next = cur.next as usize;
                if let Some(&(rank, id)) = self.merges.get(&pair_key(cur.id, symbols[next].id)) {
                    heap.push(Reverse((rank, pos as u32, id)));
                }
            }
        }
        out.extend(symbols.iter().filter(|s| s.live).map(|s| s.id));
    }
}

type Cache = FxHashMap<Box<[u8]>, Box<[u32]>>;

/// A byte-level BPE tokenizer read from a tokenizer.json.
pub struct BpeEncoder {
    raw_added: Option<AddedSet>,
    normalized_added: Option<AddedSet>,
    nfc: bool,
    steps: Vec<Step>,
    model: Model,
    cache: Mutex<Cache>,
}

/// GPT-2's byte -> printable character table.
pub fn byte_chars() -> [char; 256] {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut out = ['\0'; 256];
    let mut n = 0;
    for b in 0..256u32 {
        out[b as usize] = if printable(b) {
            char::from_u32(b).unwrap()
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap()
        };
    }
    out
}

fn unsupported(what: impl std::fmt::Display) -> String {
    format!("unsupported tokenizer: {what}")
}

fn flag(v: &Value, key: &str, default: bool) -> Result<bool, String> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => Err(unsupported(format!("{key}={other}"))),
    }
}

fn type_of(v: &Value) -> &str {
    v.get("type").and_then(Value::as_str).unwrap_or("?")
}

fn parse_normalizer(v: &Value) -> Result<bool, String> {
    match v {
        Value::Null => Ok(false),
        _ if type_of(v) == "NFC" => Ok(true),
        _ => Err(unsupported(format!("normalizer {}", type_of(v)))),
    }
}

fn parse_step(v: &Value) -> Result<Step, String> {
    match type_of(v) {
        "ByteLevel" => Ok(Step::ByteLevel {
            add_prefix_space: flag(v, "add_prefix_space", true)?,
            use_regex: flag(v, "use_regex", true)?,
        }),
        "Digits" => Ok(Step::Digits { individual: flag(v, "individual_digits", false)? }),
        "Split" => {
            let behavior = v.get("behavior").and_then(Value::as_str).unwrap_or("?");
            if behavior != "Isolated" || flag(v, "invert", false)? {
                return Err(unsupported(format!("Split behavior {behavior} (invert {:?})", v.get("invert"))));
            }
            let regex = v.get("pattern").and_then(|p| p.get("Regex")).and_then(Value::as_str);
            let regex = regex.ok_or_else(|| unsupported(format!("Split pattern {:?}", v.get("pattern"))))?;
            Pattern::from_regex(regex)
                .map(Step::Split)
                .ok_or_else(|| unsupported(format!("Split regex {regex:?}")))
        }
        other => Err(unsupported(format!("pre_tokenizer {other}"))),
    }
}

fn parse_pre_tokenizer(v: &Value) -> Result<Vec<Step>, String> {
    let steps = match type_of(v) {
        "Sequence" => v
            .get("pretokenizers")
            .and_then(Value::as_array)
            .ok_or_else(|| unsupported("pre_tokenizer Sequence without a list"))?
            .iter()
            .map(parse_step)
            .collect::<Result<Vec<_>, _>>()?,
        _ => vec![parse_step(v)?],
    };
    // ByteLevel turns bytes into characters: it must come once, last (a byte-level tokenizer).
    let byte_level = steps.iter().filter(|s| matches!(s, Step::ByteLevel { .. })).count();
    if byte_level != 1 || !matches!(steps.last(), Some(Step::ByteLevel { .. })) {
        return Err(unsupported("pre_tokenizer is not a byte-level one ending in ByteLevel"));
    }
    Ok(steps)
}

fn parse_model(m: &Value) -> Result<(Model, FxHashMap<String, u32>), String> {
    if type_of(m) != "BPE" {
        return Err(unsupported(format!("model {}", type_of(m))));
    }
    match m.get("dropout") {
        None | Some(Value::Null) => {}
        Some(d) if d.as_f64() == Some(0.0) => {}
        Some(d) => return Err(unsupported(format!("BPE dropout {d}"))),
    }
    for key in ["continuing_subword_prefix", "end_of_word_suffix"] {
        match m.get(key) {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) if s.is_empty() => {}
            Some(v) => return Err(unsupported(format!("BPE {key} {v}"))),
        }
    }
    let vocab_json =
        m.get("vocab").and_then(Value::as_object).ok_or_else(|| unsupported("BPE without a vocab"))?;
    let mut vocab = FxHashMap::default();
    for (tok, id) in vocab_json {
        let id = id
            .as_u64()
            .filter(|&i| i <= u32::MAX as u64)
            .ok_or_else(|| unsupported(format!("vocab id {id}")))?;
        vocab.insert(tok.clone(), id as u32);
    }
    let chars = byte_chars();
    let mut byte_ids = [None; 256];
    for (b, c) in chars.iter().enumerate() {
        byte_ids[b] = vocab.get(c.to_string().as_str()).copied();
    }
    if byte_ids.iter().any(Option::is_none) {
        // HF would then use unk / byte fallback; only the plain "drop the byte" case is reproduced.
        if !matches!(m.get("unk_token"), None | Some(Value::Null)) || flag(m, "byte_fallback", false)? {
            return Err(unsupported("BPE unk_token/byte_fallback with an incomplete byte alphabet"));
        }
    }
    let merges_json =
        m.get("merges").and_then(Value::as_array).ok_or_else(|| unsupported("BPE without merges"))?;
    let mut merges = FxHashMap::default();
    merges.reserve(merges_json.len());
    for (rank, merge) in merges_json.iter().enumerate() {
        let (a, b) = match merge {
            Value::String(s) => match s.split(' ').collect::<Vec<_>>()[..] {
                [a, b] => (a, b),
                _ => return Err(unsupported(format!("merge {s:?}"))),
            },
            Value::Array(pair) => match &pair[..] {
                [Value::String(a), Value::String(b)] => (a.as_str(), b.as_str()),
                _ => return Err(unsupported(format!("merge {merge}"))),
            },
            _ => return Err(unsupported(format!("merge {merge}"))),
        };
        let id = |t: &str| {
            vocab.get(t).copied().ok_or_else(|| unsupported(format!("merge token {t:?} not in vocab")))
        };
        let new_id = id(&format!("{a}{b}"))?;
        // later duplicates win, as in HF's map
        merges.insert(pair_key(id(a)?, id(b)?), (rank as u32, new_id));
    }
    let whole_words = if flag(m, "ignore_merges", false)? {
        let reverse: FxHashMap<char, u8> = chars.iter().enumerate().map(|(b, &c)| (c, b as u8)).collect();
        let words = vocab.iter().filter_map(|(tok, &id)| {
            let bytes: Option<Vec<u8>> = tok.chars().map(|c| reverse.get(&c).copied()).collect();
            bytes.map(|b| (b, id))
        });
        Some(words.collect())
    } else {
        None
    };
    Ok((Model { byte_ids, merges, whole_words }, vocab))
}

/// The two added-token tries, with HF's id assignment checked against the file's ids.
fn parse_added(
    v: &Value,
    vocab: &FxHashMap<String, u32>,
    nfc: bool,
) -> Result<(Option<AddedSet>, Option<AddedSet>), String> {
    let list = match v {
        Value::Null => return Ok((None, None)),
        Value::Array(list) => list,
        _ => return Err(unsupported("added_tokens")),
    };
    let mut raw = Vec::new();
    let mut normalized = Vec::new();
    let mut seen = FxHashMap::default();
    let mut next_id = vocab.len() as u64;
    for t in list {
        let content = t
            .get("content")
            .and_then(Value::as_str)
            .ok_or_else(|| unsupported("added token without content"))?;
        if content.is_empty() {
            continue;
        }
        if flag(t, "single_word", false)? {
            return Err(unsupported(format!("added token {content:?} with single_word")));
        }
        let file_id = t.get("id").and_then(Value::as_u64);
        let id = match vocab.get(content) {
            Some(&id) => id as u64,
            None => {
                next_id += 1;
                next_id - 1
            }
        };
        if file_id != Some(id) || id > u32::MAX as u64 {
            return Err(unsupported(format!("added token {content:?} id {file_id:?} (HF would give {id})")));
        }
        if seen.insert(content.to_string(), id).is_some() {
            return Err(unsupported(format!("added token {content:?} listed twice")));
        }
        let added =
            Added { id: id as u32, lstrip: flag(t, "lstrip", false)?, rstrip: flag(t, "rstrip", false)? };
        if flag(t, "normalized", !flag(t, "special", false)?)? {
            let pattern = if nfc { content.nfc().map(|(c, _)| c).collect() } else { content.to_string() };
            normalized.push((pattern, added));
        } else {
            raw.push((content.to_string(), added));
        }
    }
    let distinct = |p: &Vec<(String, Added)>| {
        p.iter().map(|(s, _)| s).collect::<std::collections::HashSet<_>>().len() == p.len()
    };
    if !distinct(&normalized) {
        return Err(unsupported("two normalized added tokens normalize alike"));
    }
    Ok((AddedSet::new(raw)?, AddedSet::new(normalized)?))
}

impl BpeEncoder {
    pub fn from_json(tokenizer_json: &str) -> Result<BpeEncoder, String> {
        let j: Value = serde_json::from_str(tokenizer_json).map_err(|e| format!("tokenizer.json: {e}"))?;
        for key in ["truncation", "padding"] {
            if !matches!(j.get(key), None | Some(Value::Null)) {
                return Err(unsupported(format!("{key} is set")));
            }
        }
        let (model, vocab) = parse_model(j.get("model").unwrap_or(&Value::Null))?;
        let nfc = parse_normalizer(j.get("normalizer").unwrap_or(&Value::Null))?;
        let steps = parse_pre_tokenizer(j.get("pre_tokenizer").unwrap_or(&Value::Null))?;
        let (raw_added, normalized_added) =
            parse_added(j.get("added_tokens").unwrap_or(&Value::Null), &vocab, nfc)?;
        Ok(BpeEncoder { raw_added, normalized_added, nfc, steps, model, cache: Mutex::new(Cache::default()) })
    }

    /// The ids of `text`, as HF `encode(text, add_special_tokens=False).ids`.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3);
        let mut scratch = Scratch::default();
        // A busy cache (another thread encoding) is skipped rather than waited for.
        let mut guard = self.cache.try_lock().ok();
        let cache = guard.as_deref_mut();
        self.encode_into(text, &mut scratch, cache, &mut out);
        out
    }

    fn encode_into(&self, text: &str, s: &mut Scratch, mut cache: Option<&mut Cache>, out: &mut Vec<u32>) {
        let mut segments = std::mem::take(&mut s.segments);
        segments.clear();
        match &self.raw_added {
            Some(set) => set.split(text, &mut segments),
            None => segments.push(Segment::Text(0, text.len())),
        }
        let mut inner = std::mem::take(&mut s.inner);
        for seg in &segments {
            let (a, b) = match *seg {
                Segment::Token(id) => {
                    out.push(id);
                    continue;
                }
                Segment::Text(a, b) => (a, b),
            };
            let normalized: Cow<str> = if self.nfc && !text[a..b].is_ascii() {
                Cow::Owned(text[a..b].nfc().map(|(c, _)| c).collect())
            } else {
                Cow::Borrowed(&text[a..b])
            };
            let normalized = normalized.as_ref();
            inner.clear();
            match &self.normalized_added {
                Some(set) => set.split(normalized, &mut inner),
                None => inner.push(Segment::Text(0, normalized.len())),
            }
            for piece in &inner {
                match *piece {
                    Segment::Token(id) => out.push(id),
                    Segment::Text(a, b) if a < b => {
                        self.pre_tokenize(&normalized[a..b], s, cache.as_deref_mut(), out)
                    }
                    Segment::Text(..) => {}
                }
            }
        }
        s.segments = segments;
        s.inner = inner;
    }

    /// The pre-tokenizer steps over one segment, then the model over each word.
    fn pre_tokenize(&self, text: &str, s: &mut Scratch, mut cache: Option<&mut Cache>, out: &mut Vec<u32>) {
        let mut pieces = std::mem::take(&mut s.pieces);
        let mut next = std::mem::take(&mut s.next);
        let mut words = std::mem::take(&mut s.words);
        pieces.clear();
        pieces.push((0, text.len()));
        for step in &self.steps {
            match *step {
                Step::Split(pattern) => {
                    next.clear();
                    for &(a, b) in &pieces {
                        pattern.split(&text[a..b], a, &mut next);
                    }
                    std::mem::swap(&mut pieces, &mut next);
                }
                Step::Digits { individual } => {
                    next.clear();
                    for &(a, b) in &pieces {
                        split_digits(&text[a..b], a, individual, &mut next);
                    }
                    std::mem::swap(&mut pieces, &mut next);
                }
                Step::ByteLevel { add_prefix_space, use_regex } => {
                    for &(a, b) in &pieces {
                        let piece = &text[a..b];
                        let prefixed;
                        let piece = if add_prefix_space && !piece.starts_with(' ') {
                            prefixed = format!(" {piece}");
                            prefixed.as_str()
                        } else {
                            piece
                        };
                        words.clear();
                        if use_regex {
                            Pattern::Gpt2.split(piece, 0, &mut words);
                        } else {
                            words.push((0, piece.len()));
                        }
                        for &(wa, wb) in &words {
                            self.encode_word(&piece.as_bytes()[wa..wb], s, cache.as_deref_mut(), out);
                        }
                    }
                }
            }
        }
        s.pieces = pieces;
        s.next = next;
        s.words = words;
    }

    fn encode_word(&self, word: &[u8], s: &mut Scratch, cache: Option<&mut Cache>, out: &mut Vec<u32>) {
        if let Some(whole) = &self.model.whole_words {
            if let Some(&id) = whole.get(word) {
                out.push(id);
                return;
            }
        }
        if word.len() == 1 {
            out.extend(self.model.byte_ids[word[0] as usize]);
            return;
        }
        let Some(cache) = cache.filter(|_| word.len() < CACHE_MAX_WORD_BYTES) else {
            self.model.merge(word, s, out);
            return;
        };
        if let Some(ids) = cache.get(word) {
            out.extend_from_slice(ids);
            return;
        }
        let start = out.len();
        self.model.merge(word, s, out);
        if cache.len() >= CACHE_MAX_WORDS {
            cache.clear();
        }
        cache.insert(word.into(), out[start..].into());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A toy byte-level tokenizer: the 256 byte characters, then the given merges.
    fn toy(merges: &[(&str, &str)], pre_tokenizer: Value, added: Value) -> Result<BpeEncoder, String> {
        let mut vocab = serde_json::Map::new();
        for c in byte_chars() {
            let n = vocab.len();
            vocab.insert(c.to_string(), json!(n));
        }
        for (a, b) in merges {
            let n = vocab.len();
            vocab.entry(format!("{a}{b}")).or_insert(json!(n));
        }
        let j = json!({
            "added_tokens": added, "normalizer": null, "pre_tokenizer": pre_tokenizer,
            "model": {"type": "BPE", "vocab": vocab, "merges": merges.iter().map(|(a, b)| format!("{a} {b}")).collect::<Vec<_>>()},
        });
        BpeEncoder::from_json(&j.to_string())
    }

    fn byte_level() -> Value {
        json!({"type": "ByteLevel", "add_prefix_space": false, "use_regex": true})
    }

    #[test]
    fn merges_follow_rank_then_position() {
        let enc = toy(&[("b", "c"), ("a", "b"), ("a", "bc")], byte_level(), json!(null)).unwrap();
        // "abc": (b,c) rank 0 first, then (a,bc)
        assert_eq!(enc.encode("abc"), vec![258]);
        // "aaa" has no merges; "abab" merges both (a,b) left to right
        assert_eq!(enc.encode("aaa"), vec![97, 97, 97]);
        assert_eq!(enc.encode("abab"), vec![257, 257]);
    }

    #[test]
    fn equal_ranks_merge_leftmost_first() {
        let enc = toy(&[("a", "a")], byte_level(), json!(null)).unwrap();
        assert_eq!(enc.encode("aaa"), vec![256, 97]);
        assert_eq!(enc.encode("aaaa"), vec![256, 256]);
    }

    #[test]
    fn byte_level_maps_spaces_and_non_ascii() {
        let enc = toy(&[("Ġ", "a")], byte_level(), json!(null)).unwrap();
        assert_eq!(enc.encode(" a"), vec![256]);
        let chars = byte_chars();
        let e_acute: Vec<u32> = "é".bytes().map(|b| chars[b as usize] as u32).collect();
        assert_eq!(e_acute.len(), 2);
        assert_eq!(enc.encode("é").len(), 2);
    }

    #[test]
    fn added_tokens_split_first_and_strip() {
        let added = json!([
            {"id": 256, "content": "<x>", "single_word": false, "lstrip": true, "rstrip": false, "normalized": false, "special": true},
            {"id": 257, "content": "<xy>", "single_word": false, "lstrip": false, "rstrip": true, "normalized": false, "special": true},
        ]);
        let enc = toy(&[], byte_level(), added).unwrap();
        assert_eq!(enc.encode("a  <x>b"), vec![97, 256, 98]);
        assert_eq!(enc.encode("<xy>  b<x"), vec![257, 98, 60, 120]);
    }

    #[test]
    fn rejects_what_it_does_not_reproduce() {
        let toy = |m: &[(&str, &str)], p, a| toy(m, p, a).map(|_| ());
        let metaspace = json!({"type": "Metaspace", "replacement": "▁"});
        assert!(toy(&[], metaspace, json!(null)).unwrap_err().contains("Metaspace"));
        let split = json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "\\w+"}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "use_regex": false}]});
        assert!(toy(&[], split, json!(null)).unwrap_err().contains("Split regex"));
        let single = json!([{"id": 256, "content": "<x>", "single_word": true, "lstrip": false, "rstrip": false, "normalized": false, "special": true}]);
        assert!(toy(&[], byte_level(), single).unwrap_err().contains("single_word"));
    }
}
