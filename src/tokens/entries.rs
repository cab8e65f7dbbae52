//! The set of a vocabulary's entries, asked whether a pre-tokenised piece is one entry, and so
//! one token: for a short piece when the thread's memo (`piece_memo`) does not know it, and for
//! every piece over 15 bytes.
//!
//! Before the memo, nearly every piece of ordinary text was asked, and this lookup was a large
//! part of counting. A set of byte slices hashes the piece byte by byte and confirms a hit with
//! a `memcmp` call through the entry's pointer; counting a decision's 4 KB English prompt, those were about
//! half of counting's time (docs/benchmarks.md, "Two cuts, before and after"). Almost every
//! piece is short, so entries of up to [`SHORT_BYTES`] bytes are kept packed, with their
//! length, in one `u128` each ([`short_key`]): hashing and comparing a key is a few
//! instructions on registers. The few longer entries stay in a set of slices.

use rustc_hash::FxHashSet;

/// The longest entry kept packed: 15 bytes and the length byte fill a `u128`.
const SHORT_BYTES: usize = 15;

/// A vocabulary's entries, by their bytes.
#[derive(Default)]
pub struct EntrySet {
    short: FxHashSet<u128>,
    long: FxHashSet<&'static [u8]>,
}

impl EntrySet {
    /// Whether `piece` is one of the entries.
    #[inline]
    pub fn contains(&self, piece: &[u8]) -> bool {
        if piece.len() <= SHORT_BYTES {
            self.short.contains(&short_key(piece))
        } else {
            self.long.contains(piece)
        }
    }

    /// Whether the piece packed as `key` (by [`short_key_in`]) is one of the entries.
    #[inline]
    pub fn contains_short(&self, key: u128) -> bool {
        self.short.contains(&key)
    }

    /// Adds one entry; `false` if it was there already.
    pub fn insert(&mut self, entry: &'static [u8]) -> bool {
        if entry.len() <= SHORT_BYTES {
            self.short.insert(short_key(entry))
        } else {
            self.long.insert(entry)
        }
    }

    /// How many distinct entries the set holds.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.short.len() + self.long.len()
    }

    /// The length in bytes of the longest entry; 0 for an empty set.
    pub fn longest(&self) -> usize {
        match self.long.iter().map(|entry| entry.len()).max() {
            Some(longest) => longest,
            // Byte 15 of a packed key is the entry's length.
            None => self
                .short
                .iter()
                .map(|&key| (key >> 120) as usize)
                .max()
                .unwrap_or(0),
        }
    }
}

impl FromIterator<&'static [u8]> for EntrySet {
    fn from_iter<I: IntoIterator<Item = &'static [u8]>>(entries: I) -> EntrySet {
        let mut set = EntrySet::default();
        set.extend(entries);
        set
    }
}

impl Extend<&'static [u8]> for EntrySet {
    fn extend<I: IntoIterator<Item = &'static [u8]>>(&mut self, entries: I) {
        for entry in entries {
            self.insert(entry);
        }
    }
}

/// The packed key of the `len` bytes of `text` from `at` ([`short_key`]'s); `None` where the
/// piece is longer than [`SHORT_BYTES`]. Where `text` holds 16 bytes from `at` (all but a
/// text's last few pieces) the key is read by one 16-byte load and a mask, so the piece's
/// length decides no branch.
#[inline]
pub fn short_key_in(text: &[u8], at: usize, len: usize) -> Option<u128> {
    if len > SHORT_BYTES {
        return None;
    }
    Some(match text.get(at..at + 16) {
        Some(window) => {
            let bytes = u128::from_le_bytes(window.try_into().expect("16 bytes"));
            let piece = bytes & ((1u128 << (len * 8)) - 1);
            piece | (len as u128) << 120
        }
        None => short_key(&text[at..at + len]),
    })
}

/// `bytes` (at most [`SHORT_BYTES`] of them) as one number: byte `i` in bits `8i..8i+8`, the
/// length in the top byte, zeros between. Two slices get the same key only if they are equal.
///
/// Read with overlapping loads rather than copied into a buffer: a copy of a length known
/// only at run time is a `memcpy` call, which is what the packed keys are there to avoid.
#[inline]
pub(super) fn short_key(bytes: &[u8]) -> u128 {
    let len = bytes.len();
    debug_assert!(len <= SHORT_BYTES);
    let low: u64;
    let mut high: u64 = 0;
    if len >= 8 {
        low = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
        if len > 8 {
            // The last 8 bytes end at byte `len`; shifted down, the ones before byte 8 fall
            // off and the rest land at their places from byte 8.
            let last = u64::from_le_bytes(bytes[len - 8..].try_into().expect("8 bytes"));
            high = last >> ((16 - len) * 8);
        }
    } else if len >= 4 {
        // The first and the last 4 bytes; where they overlap they hold the same bytes.
        let first = u32::from_le_bytes(bytes[..4].try_into().expect("4 bytes"));
        let last = u32::from_le_bytes(bytes[len - 4..].try_into().expect("4 bytes"));
        low = u64::from(first) | u64::from(last) << ((len - 4) * 8);
    } else if len > 0 {
        // Bytes 0, len / 2 and len - 1 cover lengths 1 to 3.
        let middle = len / 2;
        low = u64::from(bytes[0])
            | u64::from(bytes[middle]) << (middle * 8)
            | u64::from(bytes[len - 1]) << ((len - 1) * 8);
    } else {
        low = 0;
    }
    high |= (len as u64) << 56;
    u128::from(high) << 64 | u128::from(low)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The key as its definition says, built by copying into a buffer.
    fn key_by_copy(bytes: &[u8]) -> u128 {
        let mut key = [0u8; 16];
        key[..bytes.len()].copy_from_slice(bytes);
        key[15] = bytes.len() as u8;
        u128::from_le_bytes(key)
    }

    #[test]
    fn short_key_places_every_byte_and_the_length() {
        // Distinct non-zero bytes, so a byte in the wrong place or lost shows.
        let bytes: Vec<u8> = (1..=SHORT_BYTES as u8)
            .map(|b| b.wrapping_mul(37) | 1)
            .collect();
        for len in 0..=SHORT_BYTES {
            for start in 0..=(SHORT_BYTES - len) {
                let piece = &bytes[start..start + len];
                assert_eq!(short_key(piece), key_by_copy(piece), "{piece:?}");
            }
        }
        let zeros = [0u8; SHORT_BYTES];
        for len in 0..=SHORT_BYTES {
            assert_eq!(short_key(&zeros[..len]), key_by_copy(&zeros[..len]));
        }
        let ones = [0xffu8; SHORT_BYTES];
        for len in 0..=SHORT_BYTES {
            assert_eq!(short_key(&ones[..len]), key_by_copy(&ones[..len]));
        }
    }

    /// Slices that differ only in trailing zero bytes, or are prefixes of one another, are
    /// different entries.
    #[test]
    fn keys_tell_lengths_and_trailing_zeros_apart() {
        let zeros: &'static [u8] = &[0; SHORT_BYTES + 2];
        let set: EntrySet = [&zeros[..1], &zeros[..3], b"ab".as_slice()]
            .into_iter()
            .collect();
        let cases: &[(&[u8], bool)] = &[
            (&zeros[..0], false),
            (&zeros[..1], true),
            (&zeros[..2], false),
            (&zeros[..3], true),
            (&zeros[..4], false),
            (b"a", false),
            (b"ab", true),
            (b"ab\0", false),
            (b"abc", false),
        ];
        for &(piece, expected) in cases {
            assert_eq!(set.contains(piece), expected, "{piece:?}");
        }
    }

    /// The key read from a text is the piece's own key, and answers as the piece does, at every
    /// place and length: away from the text's end (one load) and within 16 bytes of it (the
    /// slice's key); a piece over 15 bytes has no key (the count loop asks the slice).
    #[test]
    fn keys_read_in_place_answer_as_the_piece() {
        let text: &'static [u8] =
            b" the quick brown fox, fifteen bytes!! sixteen bytes!!! \xff\x00\x00 the end\x00";
        // Every piece that starts at an even byte is an entry; most at odd bytes are not.
        let set: EntrySet = (0..text.len())
            .step_by(2)
            .flat_map(|at| (1..=(text.len() - at).min(20)).map(move |len| &text[at..at + len]))
            .collect();
        let mut answers = [0usize; 2];
        for at in 0..=text.len() {
            for len in 0..=(text.len() - at).min(20) {
                let expected = set.contains(&text[at..at + len]);
                match short_key_in(text, at, len) {
                    Some(key) => {
                        assert_eq!(key, key_by_copy(&text[at..at + len]), "at {at}, len {len}");
                        assert_eq!(set.contains_short(key), expected, "at {at}, len {len}");
                        answers[usize::from(expected)] += 1;
                    }
                    None => assert!(len > SHORT_BYTES, "at {at}, len {len}"),
                }
            }
        }
        assert!(answers[0] > 100 && answers[1] > 100, "{answers:?}");
    }

    #[test]
    fn short_and_long_entries_are_found_and_counted_once() {
        let entries: [&'static [u8]; 6] = [
            b"a",
            b" the",
            b"fifteen bytes!!",
            b"sixteen bytes!!!",
            b"a much longer entry than sixteen bytes",
            b" the",
        ];
        let set: EntrySet = entries.into_iter().collect();
        assert_eq!(set.len(), 5);
        assert_eq!(set.longest(), entries[4].len());
        for entry in entries {
            assert!(set.contains(entry), "{entry:?}");
        }
        for missing in [
            b"".as_slice(),
            b" th",
            b"fifteen bytes!?",
            b"sixteen bytes!!?",
            b"a much longer entry than sixteen byte",
        ] {
            assert!(!set.contains(missing), "{missing:?}");
        }
        let short_only: EntrySet = [b"ab".as_slice(), b"abcdefghijklmno"].into_iter().collect();
        assert_eq!(short_only.longest(), 15);
        assert_eq!(EntrySet::default().longest(), 0);
        assert_eq!(EntrySet::default().len(), 0);
    }
}
