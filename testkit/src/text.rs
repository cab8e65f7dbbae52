//! Texts to count. tollgate remembers the counts of short pieces it has seen, so what a text
//! costs it depends on how its words repeat: prose's common words (`prose_words`) cost little,
//! made-up words (`made_up_words`) about ten times as much, slowly enough that a test or
//! benchmark can see a count take time.

/// `bytes` bytes of words of 1 to 10 random lowercase letters, one space after each, from a
/// fixed seed: the same text every time.
pub fn made_up_words(bytes: usize) -> String {
    let mut next = xorshift(0x9E37_79B9_7F4A_7C15);
    let mut text = String::with_capacity(bytes + 11);
    while text.len() < bytes {
        for _ in 0..1 + next() % 10 {
            text.push(char::from(b'a' + (next() % 26) as u8));
        }
        text.push(' ');
    }
    text.truncate(bytes);
    text
}

/// `bytes` bytes of the ASCII words of `COMMON_WORDS` picked at random, one space after each
/// and now and then a comma or a full stop, from a fixed seed: the same text every time.
pub fn prose_words(bytes: usize) -> String {
    let ascii: Vec<&str> = COMMON_WORDS
        .iter()
        .copied()
        .filter(|w| w.is_ascii())
        .collect();
    let mut next = xorshift(0x9E37_79B9_7F4A_7C15);
    let mut text = String::with_capacity(bytes + 16);
    while text.len() < bytes {
        text.push_str(ascii[(next() % ascii.len() as u64) as usize]);
        text.push_str(match next() % 12 {
            0 => ". ",
            1 => ", ",
            _ => " ",
        });
    }
    text.truncate(bytes);
    text
}

/// Common English words, a few about what tollgate does, contractions and accented words:
/// `bench_tokens`' prose, and `prose_words`' (the ASCII ones).
pub const COMMON_WORDS: &[&str] = &[
    "the",
    "of",
    "and",
    "to",
    "in",
    "a",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "had",
    "they",
    "you",
    "were",
    "their",
    "one",
    "all",
    "we",
    "can",
    "her",
    "has",
    "there",
    "been",
    "if",
    "more",
    "when",
    "will",
    "would",
    "who",
    "so",
    "no",
    "request",
    "model",
    "tenant",
    "queue",
    "latency",
    "throughput",
    "fairness",
    "budget",
    "token",
    "inference",
    "gateway",
    "scheduler",
    "priority",
    "capacity",
    "admission",
    "deadline",
    "streaming",
    "response",
    "prompt",
    "completion",
    "cluster",
    "replica",
    "memory",
    "cache",
    "weighted",
    "because",
    "however",
    "therefore",
    "although",
    "meanwhile",
    "approximately",
    "significant",
    "don't",
    "it's",
    "we'll",
    "they've",
    "I'm",
    "isn't",
    "naïve",
    "café",
    "résumé",
    "Zürich",
];

/// A xorshift64 generator from `seed` (not zero): fast, and the same numbers every run.
fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut state = seed;
    move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    }
}
