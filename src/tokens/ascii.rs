//! Pre-tokenisation of ASCII text without the regex: the same pieces as the patterns in
//! `tokens.rs`, found by looking at bytes.
//!
//! On ordinary text the regex search for each piece was about half of counting's time
//! (`perf` under `examples/bench_overhead.rs`): a piece is a few bytes, and every search pays
//! the meta regex's dispatch and the lazy DFA's start-up. Most request text is ASCII, where
//! the patterns reduce to a handful of byte classes. [`piece_len`] walks those classes and
//! answers only when every byte it had to look at is ASCII; the moment a decision depends on
//! a non-ASCII byte (a letter, digit, mark or space of another script could continue or end
//! the piece) it answers `None` and the caller asks the regex. So it never has to know
//! Unicode's classes, and agreeing with the regex is a property of ASCII only, which the tests
//! check on random text built to cross every class boundary.
//!
//! The patterns, as alternatives tried in order at the start of the text (leftmost-first), and
//! the rules below that mirror them:
//!
//! | cl100k | o200k |
//! |---|---|
//! | `(?i:'s\|'t\|'re\|'ve\|'m\|'ll\|'d)` | |
//! | `[^\r\n\p{L}\p{N}]?\p{L}+` | `[^\r\n\p{L}\p{N}]?` upper`*` lower`+` contraction`?`, then upper`+` lower`*` contraction`?` |
//! | `\p{N}{1,3}` | `\p{N}{1,3}` |
//! | ` ?[^\s\p{L}\p{N}]+[\r\n]*` | ` ?[^\s\p{L}\p{N}]+[\r\n/]*` |
//! | `\s*[\r\n]+`, `\s+$`, then `\s+(?!\S)`, then `\s+` | the same |

use super::Encoding;

/// What an ASCII byte is to the patterns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Class {
    Upper,
    Lower,
    Digit,
    /// `\r` or `\n`.
    Newline,
    /// White space other than a newline: space, tab, vertical tab, form feed.
    Space,
    /// Everything else: punctuation, symbols, control characters.
    Other,
}

/// The class of the byte at `i`: `Ok(None)` past the end, `Err(())` for a non-ASCII byte,
/// whose class only the regex knows.
fn class(text: &[u8], i: usize) -> Result<Option<Class>, ()> {
    let Some(&byte) = text.get(i) else {
        return Ok(None);
    };
    Ok(Some(match byte {
        b'A'..=b'Z' => Class::Upper,
        b'a'..=b'z' => Class::Lower,
        b'0'..=b'9' => Class::Digit,
        b'\r' | b'\n' => Class::Newline,
        b' ' | b'\t' | 0x0b | 0x0c => Class::Space,
        0x80.. => return Err(()),
        _ => Class::Other,
    }))
}

fn is_letter(class: Class) -> bool {
    matches!(class, Class::Upper | Class::Lower)
}

/// Where the run of bytes of `in_run` classes starting at `from` ends. `Err` if it ends at a
/// non-ASCII byte, which might belong to the run.
fn run_end(text: &[u8], from: usize, in_run: impl Fn(Class) -> bool) -> Result<usize, ()> {
    let mut i = from;
    while let Some(class) = class(text, i)? {
        if !in_run(class) {
            break;
        }
        i += 1;
    }
    Ok(i)
}

/// The length of an `'s|'t|'re|'ve|'m|'ll|'d` contraction (any case) at `at`, if there is one.
/// `Err` if a non-ASCII byte decides it: case-insensitive `s` also matches `ſ` (U+017F).
fn contraction(text: &[u8], at: usize) -> Result<Option<usize>, ()> {
    if text.get(at) != Some(&b'\'') {
        return Ok(None);
    }
    let lower = |i: usize| -> Result<Option<u8>, ()> {
        match text.get(i) {
            None => Ok(None),
            Some(byte) if byte.is_ascii() => Ok(Some(byte.to_ascii_lowercase())),
            Some(_) => Err(()),
        }
    };
    Ok(match lower(at + 1)? {
        Some(b's' | b't' | b'm' | b'd') => Some(2),
        Some(first @ (b'r' | b'v' | b'l')) => {
            let second = if first == b'l' { b'l' } else { b'e' };
            (lower(at + 2)? == Some(second)).then_some(3)
        }
        _ => None,
    })
}

/// The length of the piece at the start of `text`, if deciding it took ASCII bytes only;
/// `None` sends the caller to the regex (also for an empty `text`).
pub fn piece_len(encoding: Encoding, text: &[u8]) -> Option<usize> {
    piece(encoding, text).ok().flatten()
}

fn piece(encoding: Encoding, text: &[u8]) -> Result<Option<usize>, ()> {
    let Some(first) = class(text, 0)? else {
        return Ok(None);
    };
    // The letter patterns: an optional leading character (anything but a letter, a digit or a
    // newline), then letters; where the letters start, if these patterns can match at all.
    let may_lead = !is_letter(first) && first != Class::Digit && first != Class::Newline;
    let letters_from = if is_letter(first) {
        Some(0)
    } else if may_lead && class(text, 1)?.is_some_and(is_letter) {
        Some(1)
    } else {
        None
    };
    match encoding {
        // A model's own tokenizer cuts with its regex only.
        Encoding::Model(_) => return Ok(None),
        Encoding::Cl100kBase => {
            // The contractions come first, on their own.
            if let Some(len) = contraction(text, 0)? {
                return Ok(Some(len));
            }
            // `[^\r\n\p{L}\p{N}]?\p{L}+`
            if let Some(from) = letters_from {
                return Ok(Some(run_end(text, from, is_letter)?));
            }
        }
        Encoding::O200kBase => {
            if let Some(from) = letters_from {
                // upper* lower+ | upper+ lower*: ASCII letters are one case or the other, so
                // both alternatives end where the lower-case run after the upper-case run ends,
                // and either may take a contraction after it.
                let upper_end = run_end(text, from, |c| c == Class::Upper)?;
                let end = run_end(text, upper_end, |c| c == Class::Lower)?;
                let suffix = contraction(text, end)?.unwrap_or(0);
                return Ok(Some(end + suffix));
            }
        }
    }
    // `\p{N}{1,3}`
    if first == Class::Digit {
        let mut end = 1;
        while end < 3 && class(text, end)? == Some(Class::Digit) {
            end += 1;
        }
        if end < 3 {
            // A digit of another script after the run would extend it.
            class(text, end)?;
        }
        return Ok(Some(end));
    }
    // ` ?[^\s\p{L}\p{N}]+` then `[\r\n]*` (cl100k) or `[\r\n/]*` (o200k)
    let symbols_from = if first == Class::Other {
        Some(0)
    } else if text[0] == b' ' && class(text, 1)? == Some(Class::Other) {
        Some(1)
    } else {
        None
    };
    if let Some(from) = symbols_from {
        let end = run_end(text, from, |c| c == Class::Other)?;
        let slash_too = encoding == Encoding::O200kBase;
        let trailing = text[end..]
            .iter()
            .take_while(|&&b| b == b'\r' || b == b'\n' || (slash_too && b == b'/'))
            .count();
        return Ok(Some(end + trailing));
    }
    // White space: `\s*[\r\n]+`, `\s+$`, `\s+(?!\S)`, `\s+`. The whole run must be known: a
    // non-ASCII space (U+00A0, U+3000, ...) would extend it.
    debug_assert!(matches!(first, Class::Newline | Class::Space));
    let mut run = 0;
    let mut past_last_newline = None;
    while let Some(class) = class(text, run)? {
        match class {
            Class::Newline => past_last_newline = Some(run + 1),
            Class::Space => {}
            _ => break,
        }
        run += 1;
    }
    if past_last_newline.is_some() {
        return Ok(past_last_newline);
    }
    if run == text.len() || run == 1 {
        return Ok(Some(run));
    }
    // Give the last white-space byte back to the piece that follows (tiktoken's ` word`).
    Ok(Some(run - 1))
}
