//! The token counts of short pieces counted lately, kept per thread and encoding (or model
//! vocabulary).
//!
//! Ordinary text is made of a few thousand distinct words used over and over. Without a memo,
//! every piece asks the vocabulary's entry set (a hash set of about 200,000 packed keys, several
//! MiB) whether it is one entry, and a piece that is not (a rare word, a number, a code
//! identifier) is counted by `bpe`'s encoder each time it comes back. The memo is a
//! direct-mapped table of 4,096 slots (64 KiB): one multiply picks a piece's slot, one load and
//! one compare answer it. A slot holds the piece's packed key and its count, so a hit is exact
//! (the whole key is compared); a miss costs the entry lookup (or the encoder) as before, plus
//! the memo's load and the store that remembers the answer. A piece's count depends on its
//! bytes alone, so nothing the memo remembers can go stale.
//!
//! Only pieces of up to 15 bytes are kept (the packed keys of `entries`): such a piece has at
//! most 15 tokens, so its count fits the four bits its key leaves free.

/// log2 of the slots in a memo: 4,096 slots of 16 bytes, 64 KiB, small enough to stay in a
/// core's L2 beside the work around it.
const SLOTS_LOG2: u32 = 12;
/// Where a slot keeps its count: the top four bits, above the length the key keeps in bits
/// 120 to 123 (a packed length is at most 15).
const COUNT_SHIFT: u32 = 124;
/// The bits of a slot that hold the key.
const KEY_BITS: u128 = !(0xF << COUNT_SHIFT);

/// A direct-mapped table from a short piece's packed key (`entries::short_key_in`) to its
/// token count.
pub struct PieceMemo {
    /// Each slot: a key, with its count in the top four bits; 0 (a count of 0) is empty.
    slots: Box<[u128]>,
}

impl PieceMemo {
    pub fn new() -> PieceMemo {
        PieceMemo {
            slots: vec![0; 1 << SLOTS_LOG2].into_boxed_slice(),
        }
    }

    /// The count remembered for the piece packed as `key`, if its slot holds that piece.
    #[inline]
    pub fn get(&self, key: u128) -> Option<usize> {
        let slot = self.slots[slot_of(key)];
        let count = (slot >> COUNT_SHIFT) as usize;
        (count != 0 && slot & KEY_BITS == key).then_some(count)
    }

    /// The count remembered for the piece packed as `key`, or else `count`'s answer, which is
    /// remembered (a `None` from `count` is passed on, and nothing is remembered): the count
    /// loops' one way to ask the memo.
    #[inline(always)]
    pub fn get_or_count(
        &mut self,
        key: u128,
        count: impl FnOnce() -> Option<usize>,
    ) -> Option<usize> {
        if let Some(known) = self.get(key) {
            return Some(known);
        }
        let counted = count()?;
        self.put(key, counted);
        Some(counted)
    }

    /// Remembers `count` for the piece packed as `key`, in place of whatever its slot held.
    #[inline]
    pub fn put(&mut self, key: u128, count: usize) {
        debug_assert!(
            key & KEY_BITS == key,
            "a packed key leaves its top four bits clear"
        );
        debug_assert!(
            (1..=15).contains(&count),
            "a piece of 1 to 15 bytes has 1 to 15 tokens"
        );
        self.slots[slot_of(key)] = key | (count as u128) << COUNT_SHIFT;
    }
}

/// The slot of `key`: its two halves folded into one word, multiplied by 2^64 / φ, and the
/// product's top bits taken (Fibonacci hashing), so every byte of the piece moves the slot.
#[inline]
fn slot_of(key: u128) -> usize {
    let folded = (key as u64) ^ ((key >> 64) as u64).rotate_left(29);
    (folded.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - SLOTS_LOG2)) as usize
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokens::entries::short_key as key;

    #[test]
    fn answers_only_what_was_put_for_that_very_key() {
        let mut memo = PieceMemo::new();
        let cases: &[(&[u8], usize)] = &[
            (b" the", 1),
            (b"tokenisation", 3),
            (b"fifteen bytes!!", 15),
            (b"\x00\x00", 2),
            (b" th", 1),
        ];
        for &(piece, _) in cases {
            assert_eq!(memo.get(key(piece)), None, "{piece:?} before any put");
        }
        for &(piece, count) in cases {
            memo.put(key(piece), count);
        }
        for &(piece, count) in cases {
            assert_eq!(memo.get(key(piece)), Some(count), "{piece:?}");
        }
        // Keys that differ from a piece only in a byte, the length or trailing zeros, asked
        // with that piece in their own slot: only the key compare can tell them apart.
        for (piece, other) in [
            (b" the".as_slice(), b" thf".as_slice()),
            (b" the", b" the\x00"),
            (b"\x00\x00", b"\x00"),
            (b"\x00\x00", b"\x00\x00\x00"),
            (b" th", b"th"),
        ] {
            let mut memo = PieceMemo::new();
            memo.slots[slot_of(key(other))] = key(piece) | 2 << COUNT_SHIFT;
            assert_eq!(memo.get(key(other)), None, "{other:?} in {piece:?}'s place");
        }
    }

    #[test]
    fn a_slot_taken_by_another_piece_is_a_miss_not_its_count() {
        let mut memo = PieceMemo::new();
        // Find two pieces that share a slot.
        let first = key(b"aa");
        let second = (0u32..)
            .map(|n| key(format!("w{n}").as_bytes()))
            .find(|&other| slot_of(other) == slot_of(first))
            .expect("some piece shares a slot of 4,096");
        memo.put(first, 2);
        memo.put(second, 3);
        assert_eq!(memo.get(first), None);
        assert_eq!(memo.get(second), Some(3));
    }

    #[test]
    fn the_pieces_of_ordinary_text_spread_over_the_slots() {
        // 2,000 distinct short words: with a fair spread, about 1,570 distinct slots are
        // expected (4,096 x (1 - e^(-2000/4096))); a hash that ignored a byte would collapse.
        let slots: std::collections::HashSet<usize> = (0..2000u32)
            .map(|n| slot_of(key(format!(" w{n:04}").as_bytes())))
            .collect();
        assert!(slots.len() > 1_450, "{} distinct slots", slots.len());
        let by_length: std::collections::HashSet<usize> =
            (1..=15).map(|len| slot_of(key(&vec![b'a'; len]))).collect();
        assert!(by_length.len() >= 14, "{by_length:?}");
    }
}
