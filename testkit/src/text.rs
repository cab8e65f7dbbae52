//! Texts to count: made-up words, which tollgate counts slowly enough that a test or benchmark
//! can see the count take time. tollgate remembers the counts of short pieces it has seen, so a
//! text whose words repeat (prose, "hi hi hi") would cost it a fraction as much.

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

/// A xorshift64 generator from `seed` (not zero): fast, and the same numbers every run.
pub fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut state = seed;
    move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    }
}
