//! Pre-tokenisation of ASCII text without the regex: the same pieces as the patterns in
//! `tokens.rs` and the open models' in [`MODEL_PATTERNS`], found by looking at bytes.
//!
//! On ordinary text the regex search for each piece was about half of counting's time
//! (`perf` under `examples/bench_overhead.rs`): a piece is a few bytes, and every search pays
//! the meta regex's dispatch and the lazy DFA's start-up. Most request text is ASCII, where
//! the patterns reduce to a handful of byte classes. [`word_len`] (the common piece, a word,
//! eight bytes at a time) and [`piece_len_byte_by_byte`] (every piece, byte by byte) walk
//! those classes and answer only when every byte they had to look at is ASCII; the moment a
//! decision depends on a non-ASCII byte (a letter, digit, mark or space of another script
//! could continue or end the piece) they answer `None` and the caller asks the regex. So neither
//! has to know Unicode's classes, and agreeing with the regex is a property of ASCII only,
//! which the tests check on random text built to cross every class boundary.
//!
//! The patterns, as alternatives tried in order at the start of the text (leftmost-first), and
//! the rules below that mirror them ([`Split`] says which of each row a pattern has):
//!
//! | cl100k (and Llama 3's, Qwen's) | o200k (and Mistral's Tekken) |
//! |---|---|
//! | `(?i:'s\|'t\|'re\|'ve\|'m\|'ll\|'d)` | |
//! | `[^\r\n\p{L}\p{N}]?\p{L}+` | `[^\r\n\p{L}\p{N}]?` upper`*` lower`+` contraction`?`, |
//! | | then upper`+` lower`*` contraction`?` (Tekken: no contraction) |
//! | `\p{N}{1,3}` (Qwen: `\p{N}`) | `\p{N}{1,3}` (Tekken: `\p{N}`) |
//! | ` ?[^\s\p{L}\p{N}]+[\r\n]*` | ` ?[^\s\p{L}\p{N}]+[\r\n/]*` |
//! | `\s*[\r\n]+`, `\s+$`, then `\s+(?!\S)`, then `\s+` | the same |
//!
//! A model's own pre-tokenizer (`model`) is cut here only when its regex is, character for
//! character, one of the few this module knows ([`ModelPattern::known`]): the regexes that
//! Llama 3, Qwen 2 to 3 and Mistral's Tekken ship, each a variant of OpenAI's two. Any other is
//! cut by its regex alone.

/// How a pre-tokenizer's patterns cut ASCII text: the few ways the patterns this module knows
/// differ (see the table above).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Split {
    letters: Letters,
    /// `\p{N}{1,3}` (3) or `\p{N}` (1).
    max_digits: usize,
    /// Whether a run of symbols takes the `/` after it, as it takes `\r` and `\n` (`[\r\n/]*`).
    slash_after_symbols: bool,
}

/// The letter patterns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Letters {
    /// `(?i:'s|'t|'re|'ve|'m|'ll|'d)` on its own first, then `[^\r\n\p{L}\p{N}]?\p{L}+`.
    AnyCase,
    /// `[^\r\n\p{L}\p{N}]?` upper`*` lower`+` | upper`+` lower`*`, each with an optional
    /// contraction after it or not.
    Cased { contraction_after: bool },
}

impl Split {
    /// tiktoken's cl100k_base, as `tokens.rs` spells it.
    pub const CL100K: Split = Split {
        letters: Letters::AnyCase,
        max_digits: 3,
        slash_after_symbols: false,
    };
    /// tiktoken's o200k_base.
    pub const O200K: Split = Split {
        letters: Letters::Cased {
            contraction_after: true,
        },
        max_digits: 3,
        slash_after_symbols: true,
    };
    /// Qwen 2, 2.5 and 3: cl100k's with one digit a piece.
    const QWEN: Split = Split {
        max_digits: 1,
        ..Split::CL100K
    };
    /// Mistral's Tekken (Nemo and after): o200k's with one digit a piece and no contractions.
    const TEKKEN: Split = Split {
        letters: Letters::Cased {
            contraction_after: false,
        },
        max_digits: 1,
        slash_after_symbols: true,
    };
}

/// A model's pre-tokenizer regex this module cuts ASCII text for.
pub struct ModelPattern {
    /// Whose it is, for reports and messages.
    pub name: &'static str,
    /// As the model's `tokenizer.json` spells it.
    pub pattern: &'static str,
    pub split: Split,
}

impl ModelPattern {
    /// The known pre-tokenizer a model's `tokenizer.json` regex is, if it is one of those this
    /// module knows, exactly as written (then its pieces of ASCII text are cut here without the
    /// regex); `None` for any other.
    pub fn known(pattern: &str) -> Option<&'static ModelPattern> {
        MODEL_PATTERNS.iter().find(|known| known.pattern == pattern)
    }
}

/// The pre-tokenizer regexes of the open models' `tokenizer.json` files this module cuts ASCII
/// text for (the tests build each into the model's splitter and hold the cuts here to it).
pub static MODEL_PATTERNS: [ModelPattern; 3] = [
    ModelPattern {
        name: "Llama 3",
        // cl100k's.
        pattern: concat!(
            "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}",
            "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
        ),
        split: Split::CL100K,
    },
    ModelPattern {
        name: "Qwen 2 to 3",
        pattern: concat!(
            "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}",
            "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
        ),
        split: Split::QWEN,
    },
    ModelPattern {
        name: "Mistral Tekken",
        pattern: concat!(
            "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*",
            "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+",
            "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+",
            "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*",
            "|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
        ),
        split: Split::TEKKEN,
    },
];

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
///
/// The count loops (through `cut_piece` in `tokens.rs`) ask the two halves themselves,
/// [`word_len`] inline; this is what they answer together, which the tests hold to the regex.
#[cfg(test)]
pub fn piece_len(split: Split, text: &[u8]) -> Option<usize> {
    word_len(split, text).or_else(|| piece_len_byte_by_byte(split, text))
}

/// [`piece_len`] without trying [`word_len`] first, for a caller that just did.
pub fn piece_len_byte_by_byte(split: Split, text: &[u8]) -> Option<usize> {
    piece(split, text).ok().flatten()
}

/// The most common piece of ordinary text, a word with or without the space before it
/// (` committee`, `The`), found eight bytes at a time; `None` for any other piece, and where
/// fewer than eight bytes are left to read at a run's end, which [`piece`] then cuts.
///
/// Byte by byte, a word's end was where counting English spent half its time (`perf` of
/// `Counter::next_piece`): the branch on each letter mispredicts where the word ends. Here a
/// run's end is the first byte of an eight-byte load outside the run's class, found by
/// arithmetic on the whole load, so a word of up to seven letters costs one load and no
/// data-dependent branch.
///
/// Only the shapes whose end ASCII decides: a leading space (or none), then letters, ended by
/// an ASCII byte that is neither a letter nor `'` (o200k's contraction suffix; cl100k's
/// letters end at `'` too, but it is left to [`piece`] alike). A non-ASCII byte at the end
/// could be a letter or a mark that continues the word: `None`.
#[inline(always)]
pub fn word_len(split: Split, text: &[u8]) -> Option<usize> {
    let from = usize::from(*text.first()? == b' ');
    if !text.get(from)?.is_ascii_alphabetic() {
        return None;
    }
    let end = match split.letters {
        // `[^\r\n\p{L}\p{N}]?\p{L}+`: the letters of either case.
        Letters::AnyCase => run_end_by_words(text, from, letter_bytes)?,
        // upper`*` lower`+` | upper`+` lower`*`: both end where the lower-case run after the
        // upper-case run ends (see `piece`).
        Letters::Cased { .. } => match cased_word_end(text, from) {
            Some(end) => end,
            None => {
                let upper_end = run_end_by_words(text, from, upper_bytes)?;
                run_end_by_words(text, upper_end, lower_bytes)?
            }
        },
    };
    let after = text[end];
    (after.is_ascii() && after != b'\'').then_some(end)
}

/// Bit 7 of each byte of eight bytes (each at its little-endian place).
const HIGH_BITS: u64 = 0x8080_8080_8080_8080;

/// Bit 7 of each byte of the result is set where that byte of `bytes` is `a` to `z`, clear
/// elsewhere (non-ASCII bytes included).
///
/// With bit 7 cleared a byte is at most 0x7f, so adding 0x1f or 0x05 carries into bit 7 of
/// the same byte exactly when it is at least `a` (0x61) or at least `{` (0x7b), and never
/// into the next byte.
#[inline]
fn lower_bytes(bytes: u64) -> u64 {
    let low_seven = bytes & !HIGH_BITS;
    let from_a = low_seven + 0x1f1f_1f1f_1f1f_1f1f;
    let past_z = low_seven + 0x0505_0505_0505_0505;
    from_a & !past_z & !bytes & HIGH_BITS
}

/// As [`lower_bytes`], for `A` to `Z`: flipping bit 5 swaps the two cases' ranges, and no other
/// byte lands in `a` to `z`.
#[inline]
fn upper_bytes(bytes: u64) -> u64 {
    lower_bytes(bytes ^ 0x2020_2020_2020_2020)
}

/// As [`lower_bytes`], for letters of either case: setting bit 5 brings `A` to `Z` onto `a` to
/// `z`, and no byte outside the two ranges onto them.
#[inline]
fn letter_bytes(bytes: u64) -> u64 {
    lower_bytes(bytes | 0x2020_2020_2020_2020)
}

/// Where upper`*` lower`*` starting at `from` ends, if it ends within the eight bytes loaded
/// there (`None` otherwise, or with fewer than eight bytes left): one load for both runs.
#[inline]
fn cased_word_end(text: &[u8], from: usize) -> Option<usize> {
    let bytes = u64::from_le_bytes(text.get(from..from + 8)?.try_into().ok()?);
    let not_upper = !upper_bytes(bytes) & HIGH_BITS;
    // Every bit below the first byte that is not upper case: the upper-case run.
    let upper_run = not_upper.wrapping_sub(1) & !not_upper;
    let outside = !(lower_bytes(bytes) | upper_run) & HIGH_BITS;
    (outside != 0).then(|| from + outside.trailing_zeros() as usize / 8)
}

/// Where the run of bytes that `in_run` marks, starting at `from`, ends: the first byte not
/// marked. `None` if the run reaches a point with fewer than eight bytes left to load.
#[inline]
fn run_end_by_words(text: &[u8], from: usize, in_run: fn(u64) -> u64) -> Option<usize> {
    let mut at = from;
    loop {
        let bytes = u64::from_le_bytes(text.get(at..at + 8)?.try_into().ok()?);
        let outside = !in_run(bytes) & HIGH_BITS;
        if outside != 0 {
            return Some(at + outside.trailing_zeros() as usize / 8);
        }
        at += 8;
    }
}

fn piece(split: Split, text: &[u8]) -> Result<Option<usize>, ()> {
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
    match split.letters {
        Letters::AnyCase => {
            // The contractions come first, on their own.
            if let Some(len) = contraction(text, 0)? {
                return Ok(Some(len));
            }
            // `[^\r\n\p{L}\p{N}]?\p{L}+`
            if let Some(from) = letters_from {
                return Ok(Some(run_end(text, from, is_letter)?));
            }
        }
        Letters::Cased { contraction_after } => {
            if let Some(from) = letters_from {
                // upper* lower+ | upper+ lower*: ASCII letters are one case or the other, so
                // both alternatives end where the lower-case run after the upper-case run ends,
                // and either may take a contraction after it.
                let upper_end = run_end(text, from, |c| c == Class::Upper)?;
                let end = run_end(text, upper_end, |c| c == Class::Lower)?;
                let suffix = if contraction_after {
                    contraction(text, end)?.unwrap_or(0)
                } else {
                    0
                };
                return Ok(Some(end + suffix));
            }
        }
    }
    // `\p{N}{1,3}` or `\p{N}`
    if first == Class::Digit {
        let mut end = 1;
        while end < split.max_digits && class(text, end)? == Some(Class::Digit) {
            end += 1;
        }
        if end < split.max_digits {
            // A digit of another script after the run would extend it.
            class(text, end)?;
        }
        return Ok(Some(end));
    }
    // ` ?[^\s\p{L}\p{N}]+` then `[\r\n]*` (cl100k) or `[\r\n/]*` (o200k, Tekken)
    let symbols_from = if first == Class::Other {
        Some(0)
    } else if text[0] == b' ' && class(text, 1)? == Some(Class::Other) {
        Some(1)
    } else {
        None
    };
    if let Some(from) = symbols_from {
        let end = run_end(text, from, |c| c == Class::Other)?;
        let slash_too = split.slash_after_symbols;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Each byte value at each place of the eight, among neighbours of every kind: marked
    /// exactly when it is in the class, whatever stands beside it (no carry crosses a byte).
    #[test]
    fn byte_class_masks_mark_each_byte_on_its_own() {
        type Class = (&'static str, fn(u64) -> u64, fn(u8) -> bool);
        let classes: [Class; 3] = [
            ("lower", lower_bytes, |b| b.is_ascii_lowercase()),
            ("upper", upper_bytes, |b| b.is_ascii_uppercase()),
            ("letter", letter_bytes, |b| b.is_ascii_alphabetic()),
        ];
        for (name, mask, is_in) in classes {
            for byte in 0..=255u8 {
                for neighbour in [0x00, 0x1f, 0x40, 0x5a, 0x60, 0x7a, 0x7f, 0x80, 0xff, byte] {
                    for place in 0..8 {
                        let mut bytes = [neighbour; 8];
                        bytes[place] = byte;
                        let marks = mask(u64::from_le_bytes(bytes)).to_le_bytes();
                        for (at, (&b, &marked)) in bytes.iter().zip(&marks).enumerate() {
                            let expected = if is_in(b) { 0x80 } else { 0 };
                            assert_eq!(marked, expected, "{name}: {bytes:?}, byte {at}");
                        }
                    }
                }
            }
        }
    }

    /// Runs that end inside the first load, at a load's edge, in a later load, and too near
    /// the end to load.
    #[test]
    fn runs_end_at_the_first_byte_outside() {
        let cases: &[(&[u8], usize, Option<usize>)] = &[
            (b"abc defgh", 0, Some(3)),
            (b"abcdefgh ijklmnop", 0, Some(8)),
            (b"abcdefgh ijk", 0, None),
            (b"abcdefghijklmnopq,rstuvwxyz", 0, Some(17)),
            (b" abcdefghijklmnop", 1, None),
            (b"abcdefg", 0, None),
            (b"abcdefgh", 0, None),
            (b"ab\xc3\xa9cdefgh", 0, Some(2)),
        ];
        for &(text, from, expected) in cases {
            assert_eq!(
                run_end_by_words(text, from, lower_bytes),
                expected,
                "{:?} from {from}",
                String::from_utf8_lossy(text)
            );
        }
    }
}
