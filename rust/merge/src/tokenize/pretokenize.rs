//! The pre-tokenizer regexes of byte-level BPE tokenizers, as hand-written matchers that return
//! the same pieces as HF `tokenizers` (Oniguruma, `SplitDelimiterBehavior::Isolated`).
//!
//! Only three patterns are known, by their exact text; any other is rejected by the caller. Each
//! alternative of a pattern covers a character class, so the matches tile the text (no gaps), and
//! the matcher at a position is the leftmost-first alternative written out by hand. Characters are
//! classified with tables read off the installed `tokenizers` (bpe_unicode.rs), not with Rust's
//! own Unicode version, so new code points fall where Oniguruma puts them.

use super::bpe_unicode::{LETTER, NUMBER, SPACE};

/// GPT-2's pattern, used by `ByteLevel(use_regex=true)`.
pub const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Qwen2 / Qwen2.5 / Qwen3 `Split` pattern: digits one at a time.
pub const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama-3 `Split` pattern: digits in runs of at most three.
pub const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pattern {
    Gpt2,
    /// The Qwen2 / Llama-3 family; `max_digits` is 1 or 3.
    Cl100k {
        max_digits: usize,
    },
}

impl Pattern {
    pub fn from_regex(regex: &str) -> Option<Pattern> {
        match regex {
            GPT2 => Some(Pattern::Gpt2),
            QWEN2 => Some(Pattern::Cl100k { max_digits: 1 }),
            LLAMA3 => Some(Pattern::Cl100k { max_digits: 3 }),
            _ => None,
        }
    }

    /// Append the pieces of `s` (byte ranges, in order, covering it) to `out`.
    pub fn split(self, s: &str, base: usize, out: &mut Vec<(usize, usize)>) {
        let mut i = 0;
        while i < s.len() {
            let end = match self {
                Pattern::Gpt2 => gpt2_match(s, i),
                Pattern::Cl100k { max_digits } => cl100k_match(s, i, max_digits),
            };
            out.push((base + i, base + end));
            i = end;
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    Letter,
    Number,
    Space,
    Other,
}

fn in_table(table: &[(u32, u32)], c: u32) -> bool {
    table
        .binary_search_by(|&(lo, hi)| {
            if hi < c {
                std::cmp::Ordering::Less
            } else if lo > c {
                std::cmp::Ordering::Greater
            } else {
                std::cmp::Ordering::Equal
            }
        })
        .is_ok()
}

pub fn class(c: char) -> Class {
    let u = c as u32;
    if u < 0x80 {
        return match c {
            'a'..='z' | 'A'..='Z' => Class::Letter,
            '0'..='9' => Class::Number,
            '\t'..='\r' | ' ' => Class::Space,
            _ => Class::Other,
        };
    }
    if in_table(SPACE, u) {
        Class::Space
    } else if in_table(LETTER, u) {
        Class::Letter
    } else if in_table(NUMBER, u) {
        Class::Number
    } else {
        Class::Other
    }
}

#[inline]
fn char_at(s: &str, i: usize) -> Option<(char, usize)> {
    s[i..].chars().next().map(|c| (c, i + c.len_utf8()))
}

/// End of the run of `k` characters starting at `i`.
fn run(s: &str, mut i: usize, k: Class) -> usize {
    while let Some((c, n)) = char_at(s, i) {
        if class(c) != k {
            break;
        }
        i = n;
    }
    i
}

/// End of the run of at most `max` characters of class `k` starting at `i`.
fn run_max(s: &str, mut i: usize, k: Class, max: usize) -> usize {
    for _ in 0..max {
        match char_at(s, i) {
            Some((c, n)) if class(c) == k => i = n,
            _ => break,
        }
    }
    i
}

/// `\s+(?!\S)|\s+` at `i` (a whitespace character): the whole run when it ends the text, else the
/// run minus its last character (which then leads the next piece), or one character alone.
fn trailing_space(s: &str, i: usize) -> usize {
    let mut last = i;
    let mut j = i;
    while let Some((c, n)) = char_at(s, j) {
        if class(c) != Class::Space {
            break;
        }
        last = j;
        j = n;
    }
    if j == s.len() || last == i {
        j
    } else {
        last
    }
}

/// Contraction after an apostrophe at `i`: `'s|'t|'re|'ve|'m|'ll|'d`, ASCII case folded when
/// `fold`; Oniguruma's `(?i)` also folds U+017F LATIN SMALL LETTER LONG S to `s`.
fn contraction(s: &str, i: usize, fold: bool) -> Option<usize> {
    let (c2, n2) = char_at(s, i + 1)?;
    let low = |c: char| if fold { c.to_ascii_lowercase() } else { c };
    match low(c2) {
        's' | 't' | 'm' | 'd' => return Some(n2),
        '\u{17F}' if fold => return Some(n2),
        'r' | 'v' | 'l' => {}
        _ => return None,
    }
    let (c3, n3) = char_at(s, n2)?;
    match (low(c2), low(c3)) {
        ('r', 'e') | ('v', 'e') | ('l', 'l') => Some(n3),
        _ => None,
    }
}

fn gpt2_match(s: &str, i: usize) -> usize {
    let (c, n1) = char_at(s, i).expect("i < s.len()");
    if c == '\'' {
        if let Some(end) = contraction(s, i, false) {
            return end;
        }
    }
    if c == ' ' {
        // ` ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+`: the space joins a following non-space run
        if let Some((c2, _)) = char_at(s, n1) {
            let k = class(c2);
            if k != Class::Space {
                return run(s, n1, k);
            }
        }
    }
    match class(c) {
        Class::Space => trailing_space(s, i),
        k => run(s, i, k),
    }
}

fn cl100k_match(s: &str, i: usize, max_digits: usize) -> usize {
    let (c, n1) = char_at(s, i).expect("i < s.len()");
    if c == '\'' {
        if let Some(end) = contraction(s, i, true) {
            return end;
        }
    }
    let k = class(c);
    // `[^\r\n\p{L}\p{N}]?\p{L}+`
    if k == Class::Letter {
        return run(s, n1, Class::Letter);
    }
    if k != Class::Number && c != '\r' && c != '\n' {
        if let Some((c2, _)) = char_at(s, n1) {
            if class(c2) == Class::Letter {
                return run(s, n1, Class::Letter);
            }
        }
    }
    // `\p{N}{1,3}` or `\p{N}`
    if k == Class::Number {
        return run_max(s, i, Class::Number, max_digits);
    }
    // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
    let other_from = if c == ' ' {
        match char_at(s, n1) {
            Some((c2, _)) if class(c2) == Class::Other => Some(n1),
            _ => None,
        }
    } else if k == Class::Other {
        Some(i)
    } else {
        None
    };
    if let Some(j) = other_from {
        let mut end = run(s, j, Class::Other);
        while let Some((c, n)) = char_at(s, end) {
            if c != '\r' && c != '\n' {
                break;
            }
            end = n;
        }
        return end;
    }
    // `\s*[\r\n]+`: through the last line break of the whitespace run, if it has one
    debug_assert_eq!(k, Class::Space);
    let mut j = i;
    let mut after_break = None;
    while let Some((c, n)) = char_at(s, j) {
        if class(c) != Class::Space {
            break;
        }
        if c == '\r' || c == '\n' {
            after_break = Some(n);
        }
        j = n;
    }
    after_break.unwrap_or_else(|| trailing_space(s, i))
}

/// HF `Digits`: every numeric character (`char::is_numeric`) alone, or each run of them.
pub fn split_digits(s: &str, base: usize, individual: bool, out: &mut Vec<(usize, usize)>) {
    let mut start = 0;
    let mut iter = s.char_indices().peekable();
    while let Some((i, c)) = iter.next() {
        if !c.is_numeric() {
            continue;
        }
        let mut end = i + c.len_utf8();
        if !individual {
            while let Some(&(j, d)) = iter.peek() {
                if !d.is_numeric() {
                    break;
                }
                end = j + d.len_utf8();
                iter.next();
            }
        }
        if start < i {
            out.push((base + start, base + i));
        }
        out.push((base + i, base + end));
        start = end;
    }
    if start < s.len() {
        out.push((base + start, base + s.len()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(p: Pattern, s: &str) -> Vec<&str> {
        let mut out = Vec::new();
        p.split(s, 0, &mut out);
        out.into_iter().map(|(a, b)| &s[a..b]).collect()
    }

    const QWEN: Pattern = Pattern::Cl100k { max_digits: 1 };
    const LLAMA: Pattern = Pattern::Cl100k { max_digits: 3 };

    #[test]
    fn gpt2_words_contractions_and_numbers() {
        assert_eq!(
            pieces(Pattern::Gpt2, "I'm here, it's 2024!"),
            ["I", "'m", " here", ",", " it", "'s", " 2024", "!"]
        );
        assert_eq!(pieces(Pattern::Gpt2, "'S 'x ''s"), ["'", "S", " '", "x", " ''", "s"]);
        assert_eq!(pieces(Pattern::Gpt2, "héllo wörld ١٢٣"), ["héllo", " wörld", " ١٢٣"]);
    }

    #[test]
    fn gpt2_whitespace_runs_leave_their_last_space_to_the_next_word() {
        assert_eq!(pieces(Pattern::Gpt2, "a   b"), ["a", "  ", " b"]);
        assert_eq!(pieces(Pattern::Gpt2, "a\n\nb"), ["a", "\n", "\n", "b"]);
        assert_eq!(pieces(Pattern::Gpt2, "a \n b  "), ["a", " \n", " b", "  "]);
        assert_eq!(pieces(Pattern::Gpt2, "\t\tx"), ["\t", "\t", "x"]);
        assert_eq!(pieces(Pattern::Gpt2, "  "), ["  "]);
        assert_eq!(pieces(Pattern::Gpt2, "x\u{3000}\u{3000}y"), ["x", "\u{3000}", "\u{3000}", "y"]);
    }

    #[test]
    fn cl100k_letters_take_one_leading_non_letter() {
        assert_eq!(pieces(QWEN, "\"hello\" (world)"), ["\"hello", "\"", " (", "world", ")"]);
        assert_eq!(pieces(QWEN, "\thello\nworld"), ["\thello", "\n", "world"]);
        assert_eq!(pieces(QWEN, "I'M HE'LL"), ["I", "'M", " HE", "'LL"]);
        assert_eq!(pieces(QWEN, "it'ſ"), ["it", "'ſ"]);
    }

    #[test]
    fn cl100k_digits() {
        assert_eq!(pieces(QWEN, "x12345"), ["x", "1", "2", "3", "4", "5"]);
        assert_eq!(pieces(LLAMA, "x12345 6"), ["x", "123", "45", " ", "6"]);
    }

    #[test]
    fn cl100k_line_breaks() {
        assert_eq!(pieces(QWEN, "a;\n\nb"), ["a", ";\n\n", "b"]);
        assert_eq!(pieces(QWEN, "a  \n  \n  b"), ["a", "  \n  \n", " ", " b"]);
        assert_eq!(pieces(QWEN, "a \r\n"), ["a", " \r\n"]);
        assert_eq!(pieces(QWEN, "a   b   "), ["a", "  ", " b", "   "]);
        assert_eq!(pieces(QWEN, " {\n"), [" {\n"]);
    }

    #[test]
    fn digits_pre_tokenizer() {
        let split = |s: &str, ind| {
            let mut out = Vec::new();
            split_digits(s, 0, ind, &mut out);
            out.into_iter().map(|(a, b)| s[a..b].to_string()).collect::<Vec<_>>()
        };
        assert_eq!(split("a12b3", true), ["a", "1", "2", "b", "3"]);
        assert_eq!(split("a12b3", false), ["a", "12", "b", "3"]);
        assert_eq!(split("12", false), ["12"]);
    }
}
