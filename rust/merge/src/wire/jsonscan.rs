//! Byte offsets in JSON text, for recognising the conversation a harness resends: where a
//! top-level value sits and where the elements of an array begin and end. Structural only
//! (strings, escapes, nesting): the caller decodes the bytes it takes from here with a real
//! JSON decoder, which validates them. Python reference: polar_fast/json_spans_reference.py.

#[inline]
fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && matches!(b[i], b' ' | b'\t' | b'\n' | b'\r') {
        i += 1;
    }
    i
}

/// End (one past the closing quote) of the string whose opening quote is at `i`.
fn string_end(b: &[u8], i: usize) -> Option<usize> {
    let mut j = i + 1;
    loop {
        // memchr-style scan for the next quote or backslash
        let k = j + b.get(j..)?.iter().position(|&c| c == b'"' || c == b'\\')?;
        if b[k] == b'"' {
            return Some(k + 1);
        }
        j = k + 2; // a backslash escapes exactly the next byte (\uXXXX's digits need no care)
    }
}

/// End of the value starting at `i` (no leading whitespace), or None when the text ends first
/// or holds an unbalanced bracket. Scalars end at the next delimiter.
pub fn value_end(b: &[u8], i: usize) -> Option<usize> {
    match *b.get(i)? {
        b'"' => string_end(b, i),
        b'{' | b'[' => {
            let mut stack: Vec<u8> = vec![b[i]];
            let mut j = i + 1;
            while let Some(top) = stack.last().copied() {
                let c = *b.get(j)?;
                match c {
                    b'"' => {
                        j = string_end(b, j)?;
                        continue;
                    }
                    b'{' | b'[' => stack.push(c),
                    b'}' | b']' => {
                        if (top == b'{') != (c == b'}') {
                            return None;
                        }
                        stack.pop();
                    }
                    _ => {}
                }
                j += 1;
            }
            Some(j)
        }
        b',' | b']' | b'}' | b':' => None,
        _ => {
            let mut j = i;
            while j < b.len() && !matches!(b[j], b',' | b']' | b'}' | b' ' | b'\t' | b'\n' | b'\r') {
                j += 1;
            }
            Some(j)
        }
    }
}

/// (start, end) of the value of top-level key `key` in the object `b`, or None when `b` is not
/// an object, has no such key, has it twice, or spells any top-level key with an escape (a
/// decoder could read that as `key` where a byte search would not).
pub fn top_level_value(b: &[u8], key: &[u8]) -> Option<(usize, usize)> {
    let mut i = skip_ws(b, 0);
    if b.get(i) != Some(&b'{') {
        return None;
    }
    i = skip_ws(b, i + 1);
    if b.get(i) == Some(&b'}') {
        return None;
    }
    let mut found = None;
    loop {
        if b.get(i) != Some(&b'"') {
            return None;
        }
        let key_end = string_end(b, i)?;
        let name = &b[i + 1..key_end - 1];
        if name.contains(&b'\\') {
            return None;
        }
        i = skip_ws(b, key_end);
        if b.get(i) != Some(&b':') {
            return None;
        }
        i = skip_ws(b, i + 1);
        let end = value_end(b, i)?;
        if name == key {
            if found.is_some() {
                return None;
            }
            found = Some((i, end));
        }
        i = skip_ws(b, end);
        match b.get(i) {
            Some(b',') => i = skip_ws(b, i + 1),
            Some(b'}') => return found,
            _ => return None,
        }
    }
}

/// The elements of an array: their (start, end) offsets and the offset of the closing `]`.
/// `at` is the offset of the opening `[` (`after_item` false) or the end of an element of that
/// array (`after_item` true: scanning resumes there). None when the text is not such an array.
pub fn array_items(b: &[u8], at: usize, after_item: bool) -> Option<(Vec<(usize, usize)>, usize)> {
    let mut items = Vec::new();
    let mut i;
    if after_item {
        i = skip_ws(b, at);
        match b.get(i) {
            Some(b']') => return Some((items, i)),
            Some(b',') => i = skip_ws(b, i + 1),
            _ => return None,
        }
    } else {
        if b.get(at) != Some(&b'[') {
            return None;
        }
        i = skip_ws(b, at + 1);
        if b.get(i) == Some(&b']') {
            return Some((items, i));
        }
    }
    loop {
        let end = value_end(b, i)?;
        items.push((i, end));
        i = skip_ws(b, end);
        match b.get(i) {
            Some(b',') => i = skip_ws(b, i + 1),
            Some(b']') => return Some((items, i)),
            _ => return None,
        }
    }
}

/// Length of the longest common prefix of `a` and `b`, compared 8 bytes at a time.
pub fn common_prefix_len(a: &[u8], b: &[u8]) -> usize {
    let n = a.len().min(b.len());
    let mut i = 0;
    while i + 8 <= n {
        let x = u64::from_ne_bytes(a[i..i + 8].try_into().unwrap());
        let y = u64::from_ne_bytes(b[i..i + 8].try_into().unwrap());
        if x != y {
            break;
        }
        i += 8;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_messages_and_items() {
        let b = br#" {"model": "m", "messages": [ {"a": "x\"]"} , [1, {}], "s" ], "tools": []} "#;
        let (s, e) = top_level_value(b, b"messages").unwrap();
        assert_eq!(b[s], b'[');
        assert_eq!(b[e - 1], b']');
        let (items, close) = array_items(b, s, false).unwrap();
        let texts: Vec<&[u8]> = items.iter().map(|&(s, e)| &b[s..e]).collect();
        assert_eq!(texts, vec![&br#"{"a": "x\"]"}"#[..], b"[1, {}]", br#""s""#]);
        assert_eq!(close, e - 1);
        let (rest, close2) = array_items(b, items[0].1, true).unwrap();
        assert_eq!(rest, items[1..].to_vec());
        assert_eq!(close2, close);
    }

    #[test]
    fn refuses_what_it_cannot_read_exactly() {
        assert_eq!(top_level_value(br#"{"messages": [], "messages": []}"#, b"messages"), None);
        assert_eq!(top_level_value(br#"{"m\u0065ssages": [1]}"#, b"messages"), None);
        assert_eq!(top_level_value(br#"[{"messages": []}]"#, b"messages"), None);
        assert_eq!(top_level_value(br#"{"messages": [1, 2}"#, b"messages"), None);
        assert_eq!(array_items(br#"[1, 2"#, 0, false), None);
        assert_eq!(array_items(br#"[1 2]"#, 0, false), None);
    }

    #[test]
    fn common_prefix() {
        assert_eq!(common_prefix_len(b"abcdefghijkl", b"abcdefghijXl"), 10);
        assert_eq!(common_prefix_len(b"abc", b"abcdef"), 3);
        assert_eq!(common_prefix_len(b"", b"x"), 0);
    }
}
