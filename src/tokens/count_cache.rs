//! The token counts of long texts already counted, so a text that comes back is not counted
//! again (`Encoding::count_till_limit_cached`).
//!
//! Texts come back all the time: a chat client resends the whole conversation every turn, an
//! agent resends its growing transcript every step, and an application sends the same system
//! prompt with every request. Counting is linear in the text, so without this a conversation
//! of `n` turns costs `n²` to count, and counting is most of what a decision costs
//! (docs/benchmarks.md, "Where a decision's CPU goes").
//!
//! Each tenant's texts are kept apart (`scope`): a count found costs far less time than one
//! counted, so a shared entry would let one tenant time its requests to learn whether another
//! had sent a given text, as shared prefix caches in inference engines do (vLLM's
//! `cache_salt`). What comes back is mostly a tenant's own anyway: its conversation's earlier
//! turns, its application's system prompt.
//!
//! Exact by construction: an entry keeps the whole text and is found only by comparing it
//! byte for byte, so the hash decides nothing but where to look. It is seeded at random for
//! each process, as the texts are the clients' own (collisions cost a comparison, no more).
//! An entry is a full count, made only when counting reached the end of the text within its
//! limit; a count cut short by its limit is not kept.
//!
//! A text is kept the second time it is counted, not the first. Most texts are seen once (each
//! turn's new message), and keeping those would cost a copy and an allocation per request and
//! push out the texts that do come back. The first sighting leaves only the text's hash, in a
//! fixed table of hashes (`seen`, TinyLFU's "doorkeeper"); a later text with the same hash in
//! that slot is kept. A hash collision there only keeps a text early, which changes no count.
//!
//! Bounded: the texts kept take at most `capacity_bytes`; the tables add 49 bytes a slot and
//! the doorkeeper 8 a slot (at 32 MiB and 512-byte texts, about 8 MiB with the allocator's
//! share).
//! Each shard keeps two generations; once the current one is full it becomes the previous one
//! and the previous one is dropped (outside the lock). A text found in the previous generation
//! moves to the current one, so what keeps coming back stays. Every operation is O(1), amortized
//! (a generation's table grows as it fills), apart from hashing and comparing the text, and
//! from freeing a dropped generation's texts, which each insert has paid for.
//!
//! Per text, not per prompt: OpenAI's recipe counts each message's text on its own, so a
//! conversation's earlier turns are found; a model's chat template renders the conversation
//! into one text that grows every turn, found only when the request is sent again whole.
//!
//! Not a clock, not I/O: what it holds changes which texts are counted, never a count.

use std::hash::BuildHasher;
use std::sync::{Mutex, PoisonError};

use hashbrown::HashTable;

/// Texts shorter than this are counted every time: hashing and looking one up costs about as
/// much as counting it.
pub const MIN_CACHED_BYTES: usize = 512;

/// Independent locks, so the async workers rarely wait on one another.
const SHARDS: usize = 16;

/// Hashes of texts seen once, per shard: the last one of each slot is remembered.
const SEEN_SLOTS: usize = 4096;

/// Counts of texts of at least `MIN_CACHED_BYTES`, keyed by the encoding that counted them.
pub struct CountCache {
    hasher: foldhash::quality::RandomState,
    shards: Box<[Mutex<Shard>]>,
    /// What one generation of one shard may hold, in bytes of text.
    generation_bytes: usize,
}

struct Entry {
    hash: u64,
    encoding: usize,
    scope: u64,
    text: Box<[u8]>,
    tokens: usize,
}

/// What a text is looked up by: the encoding that counts it, the tenant whose it is, and the
/// text itself, with their hash.
struct Key<'t> {
    hash: u64,
    encoding: usize,
    scope: u64,
    text: &'t [u8],
}

impl Key<'_> {
    fn matches(&self, entry: &Entry) -> bool {
        entry.encoding == self.encoding && entry.scope == self.scope && *entry.text == *self.text
    }
}

#[derive(Default)]
struct Generation {
    entries: HashTable<Entry>,
    bytes: usize,
}

struct Shard {
    current: Generation,
    previous: Generation,
    /// The hashes of texts counted once (0: none), each in the slot its hash picks.
    seen: Box<[u64]>,
    /// Texts looked up here: found, or counted (`CountCacheStats`).
    found: u64,
    counted: u64,
}

/// What the cache has done since the process started, for the metrics (read at scrape time).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CountCacheStats {
    /// Texts of `MIN_CACHED_BYTES` to a generation's share whose count was found.
    pub found: u64,
    /// Texts of `MIN_CACHED_BYTES` to a generation's share counted (not kept yet).
    pub counted: u64,
    /// Bytes of text held now.
    pub bytes: u64,
}

impl Default for Shard {
    fn default() -> Shard {
        Shard {
            current: Generation::default(),
            previous: Generation::default(),
            seen: vec![0; SEEN_SLOTS].into_boxed_slice(),
            found: 0,
            counted: 0,
        }
    }
}

impl CountCache {
    /// A cache holding at most `capacity_bytes` of text (split evenly over its shards and
    /// their two generations). A text longer than one generation's share is never kept.
    pub fn new(capacity_bytes: usize) -> CountCache {
        CountCache {
            hasher: foldhash::quality::RandomState::default(),
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            generation_bytes: capacity_bytes / SHARDS / 2,
        }
    }

    /// The scope of `tenant`'s texts: a hash seeded as the texts' are, so one tenant cannot
    /// pick a name that shares another's.
    pub fn scope_of(&self, tenant: &str) -> u64 {
        self.hasher.hash_one(tenant)
    }

    /// `Some(count)` if `text` has at most `limit` tokens in the encoding numbered `encoding`,
    /// else `None`: the answer `count_till_limit(limit)` gives, which is asked only when the
    /// text's count is not kept in `scope`, and kept there when it is a full count.
    pub fn count_till_limit(
        &self,
        encoding: usize,
        scope: u64,
        text: &str,
        limit: usize,
        count_till_limit: impl FnOnce(usize) -> Option<usize>,
    ) -> Option<usize> {
        let text = text.as_bytes();
        // Too short to be worth it, or too long ever to be kept: not even hashed.
        if !(MIN_CACHED_BYTES..=self.generation_bytes).contains(&text.len()) {
            return count_till_limit(limit);
        }
        let key = Key {
            hash: self.hasher.hash_one((encoding, scope, text)),
            encoding,
            scope,
            text,
        };
        let shard = &self.shards[shard_of(key.hash)];
        let slot_before = {
            let mut shard = lock(shard);
            let (found, _dropped) = shard.find(&key, self.generation_bytes);
            if let Some(tokens) = found {
                shard.found += 1;
                drop(shard);
                return (tokens <= limit).then_some(tokens);
            }
            shard.counted += 1;
            shard.see(key.hash)
        };
        let Some(tokens) = count_till_limit(limit) else {
            if super::inline_budget_spent() {
                // Stopped by the inline budget: no count, and the text is asked for again off
                // the workers. Left seen, a one-off costly text would be kept on that second
                // asking. Rare, so undone here rather than looked up twice on every count.
                lock(shard).unsee(key.hash, slot_before);
            }
            return None;
        };
        if slot_before != key.hash {
            return Some(tokens);
        }
        let entry = Entry {
            hash: key.hash,
            encoding,
            scope,
            text: text.into(),
            tokens,
        };
        // A dropped generation's texts are freed after the lock is let go.
        let _dropped = lock(shard).insert(entry, self.generation_bytes);
        Some(tokens)
    }

    /// Texts found and counted so far, and the bytes held now, over every shard.
    pub fn stats(&self) -> CountCacheStats {
        self.shards
            .iter()
            .fold(CountCacheStats::default(), |total, shard| {
                let shard = lock(shard);
                CountCacheStats {
                    found: total.found + shard.found,
                    counted: total.counted + shard.counted,
                    bytes: total.bytes + (shard.current.bytes + shard.previous.bytes) as u64,
                }
            })
    }

    /// Bytes of text held now (for the tests' bound).
    #[cfg(test)]
    fn bytes_held(&self) -> usize {
        self.stats().bytes as usize
    }
}

impl Shard {
    /// The count kept for `key`, moving it to the current generation if it was in the
    /// previous one; with the generation that move pushed out, if any, for the caller to free
    /// once it has let go of the lock.
    fn find(
        &mut self,
        key: &Key<'_>,
        generation_bytes: usize,
    ) -> (Option<usize>, Option<Generation>) {
        if let Some(entry) = self.current.entries.find(key.hash, |e| key.matches(e)) {
            return (Some(entry.tokens), None);
        }
        let Ok(found) = self
            .previous
            .entries
            .find_entry(key.hash, |e| key.matches(e))
        else {
            return (None, None);
        };
        let (entry, _) = found.remove();
        self.previous.bytes -= entry.text.len();
        let tokens = entry.tokens;
        (Some(tokens), self.insert(entry, generation_bytes))
    }

    /// Remembers that a text with this hash was counted, and returns what its slot held: the
    /// hash itself if it was counted before (the last one in its slot).
    fn see(&mut self, hash: u64) -> u64 {
        std::mem::replace(&mut self.seen[hash as usize % SEEN_SLOTS], hash)
    }

    /// Takes back `see(hash)`, which found `slot_before`, unless another text took the slot
    /// since: the count was not made after all.
    fn unsee(&mut self, hash: u64, slot_before: u64) {
        self.counted -= 1;
        let slot = &mut self.seen[hash as usize % SEEN_SLOTS];
        if *slot == hash {
            *slot = slot_before;
        }
    }

    /// Keeps `entry` in the current generation, first making it the previous one if `entry`
    /// would take it past `generation_bytes`; returns the generation that was dropped, if any.
    fn insert(&mut self, entry: Entry, generation_bytes: usize) -> Option<Generation> {
        let hash = entry.hash;
        // Another worker may have counted the same text meanwhile.
        let key = Key {
            hash,
            encoding: entry.encoding,
            scope: entry.scope,
            text: &entry.text,
        };
        if self
            .current
            .entries
            .find(hash, |e| key.matches(e))
            .is_some()
        {
            return None;
        }
        let dropped = (self.current.bytes + entry.text.len() > generation_bytes)
            .then(|| std::mem::replace(&mut self.previous, std::mem::take(&mut self.current)));
        self.current.bytes += entry.text.len();
        self.current
            .entries
            .insert_unique(hash, entry, |entry| entry.hash);
        dropped
    }
}

fn shard_of(hash: u64) -> usize {
    // The table picks buckets with the hash's low bits and control bytes with its top seven;
    // the shard takes bits in between.
    (hash >> 32) as usize % SHARDS
}

fn lock(shard: &Mutex<Shard>) -> std::sync::MutexGuard<'_, Shard> {
    // A panic mid-insert leaves at worst an entry missing or a byte total high: still exact.
    shard.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    const ALICE: u64 = 1;
    const BOB: u64 = 2;

    /// A stand-in counter: one token per 4 bytes, rounded up, and how often it was asked.
    fn quarter_counter(text: &str, calls: &Cell<usize>) -> impl FnOnce(usize) -> Option<usize> {
        let tokens = text.len().div_ceil(4);
        move |limit| {
            calls.set(calls.get() + 1);
            (tokens <= limit).then_some(tokens)
        }
    }

    fn text(seed: usize, len: usize) -> String {
        format!("{seed:08} ")
            .chars()
            .chain("abcdefgh ".chars().cycle())
            .take(len)
            .collect()
    }

    #[test]
    fn answers_as_the_counter_would_and_counts_a_long_text_twice_at_most() {
        let cache = CountCache::new(1 << 20);
        let long = text(1, 1000); // 250 tokens
        let calls = Cell::new(0);
        // (limit, expected, counter asked)
        let table = [
            (10, None, 1),              // cut short: not kept
            (usize::MAX, Some(250), 1), // counted a second time: kept
            (250, Some(250), 0),
            (249, None, 0),
            (0, None, 0),
            (1000, Some(250), 0),
        ];
        for (limit, expected, asked) in table {
            calls.set(0);
            let got =
                cache.count_till_limit(0, ALICE, &long, limit, quarter_counter(&long, &calls));
            assert_eq!((got, calls.get()), (expected, asked), "limit {limit}");
        }
    }

    #[test]
    fn short_texts_encodings_and_tenants_are_kept_apart() {
        let cache = CountCache::new(1 << 20);
        let short = text(2, MIN_CACHED_BYTES - 1);
        let long = text(3, MIN_CACHED_BYTES);
        let calls = Cell::new(0);
        for _ in 0..3 {
            cache.count_till_limit(0, ALICE, &short, 99, quarter_counter(&short, &calls));
        }
        assert_eq!(
            calls.get(),
            3,
            "a text under MIN_CACHED_BYTES is never kept"
        );
        // Each (encoding, tenant) pair counts twice, back to back, then finds.
        for (encoding, scope) in [(0, ALICE), (1, ALICE), (0, BOB)] {
            calls.set(0);
            for _ in 0..3 {
                let got = cache.count_till_limit(
                    encoding,
                    scope,
                    &long,
                    usize::MAX,
                    quarter_counter(&long, &calls),
                );
                assert_eq!(got, Some(MIN_CACHED_BYTES / 4));
            }
            assert_eq!(calls.get(), 2, "encoding {encoding}, scope {scope}");
        }
        let stats = cache.stats();
        assert_eq!(
            (stats.found, stats.counted),
            (3, 6),
            "short texts are not looked up"
        );
        assert_eq!(
            stats.bytes,
            3 * MIN_CACHED_BYTES as u64,
            "one copy per pair"
        );
    }

    #[test]
    fn an_entry_is_found_only_by_its_own_text_encoding_and_scope() {
        // One hash for all of them, as a collision would give: only the comparison tells.
        let mut shard = Shard::default();
        let kept = text(4, 600);
        shard.insert(
            Entry {
                hash: 7,
                encoding: 0,
                scope: ALICE,
                text: kept.as_bytes().into(),
                tokens: 150,
            },
            1 << 20,
        );
        let other = text(5, 600);
        for (encoding, scope, text, expected) in [
            (0, ALICE, kept.as_bytes(), Some(150)),
            (0, ALICE, other.as_bytes(), None),
            (1, ALICE, kept.as_bytes(), None),
            (0, BOB, kept.as_bytes(), None),
            (0, ALICE, &kept.as_bytes()[..599], None),
        ] {
            let key = Key {
                hash: 7,
                encoding,
                scope,
                text,
            };
            assert_eq!(shard.find(&key, 1 << 20).0, expected, "{encoding} {scope}");
        }
    }

    #[test]
    fn holds_at_most_its_capacity_and_keeps_what_comes_back() {
        const CAPACITY: usize = 64 * 1024;
        let cache = CountCache::new(CAPACITY);
        let calls = Cell::new(0);
        let count = |text: &str, calls: &Cell<usize>| {
            let got =
                cache.count_till_limit(0, ALICE, text, usize::MAX, quarter_counter(text, calls));
            assert_eq!(got, Some(text.len().div_ceil(4)), "seed {}", &text[..8]);
            assert!(
                cache.bytes_held() <= CAPACITY,
                "{} bytes held",
                cache.bytes_held()
            );
        };
        let hot = text(0, 600);
        count(&hot, &calls);
        count(&hot, &calls);
        for seed in 1..2000 {
            count(&text(seed, 600), &calls);
            count(&hot, &calls);
        }
        // The text that keeps coming back counted twice, then kept, and it stays; 1999 texts
        // counted once each and never kept (each was seen once).
        assert_eq!(calls.get(), 2001);
        assert!(
            cache.bytes_held() <= 2 * 600,
            "only the text that came back is kept"
        );
        // Texts that all come back, more than fit: held within the capacity, pushing one
        // another out, and still answered right, found or counted.
        let many: Vec<String> = (5000..5200).map(|seed| text(seed, 600)).collect();
        for _ in 0..4 {
            for text in &many {
                count(text, &calls);
            }
        }
        assert!(
            cache.bytes_held() > CAPACITY / 4,
            "{} bytes held",
            cache.bytes_held()
        );
        // Fewer texts than the shards can hold between them (a shard's two generations take 6;
        // 40 over 16 shards leaves at least one shard 2 or fewer): some are found.
        let found_before = cache.stats().found;
        let few: Vec<String> = (6000..6040).map(|seed| text(seed, 600)).collect();
        for _ in 0..4 {
            for text in &few {
                count(text, &calls);
            }
        }
        assert!(cache.stats().found > found_before, "none of the few found");
        // A text longer than a generation's share is counted and not kept.
        let huge = text(9, CAPACITY / SHARDS / 2 + 1);
        calls.set(0);
        for _ in 0..3 {
            count(&huge, &calls);
        }
        assert_eq!(calls.get(), 3);
    }

    #[test]
    fn threads_sharing_it_get_the_counter_s_answers() {
        // 128 texts (64 in each of two scopes) of about 730 bytes over 16 shards whose
        // generations hold 4 KiB: the generations turn over while the threads run, and the
        // two of a shard hold about as much as comes to it.
        let cache = CountCache::new(128 * 1024);
        let texts: Vec<String> = (0..64).map(|seed| text(seed, 700 + seed)).collect();
        std::thread::scope(|scope| {
            for thread in 0..4 {
                let (cache, texts) = (&cache, &texts);
                scope.spawn(move || {
                    for round in 0..50 {
                        for text in texts {
                            let limit = if round % 3 == 0 { 100 } else { usize::MAX };
                            let tokens = text.len().div_ceil(4);
                            let got = cache.count_till_limit(
                                0,
                                (thread % 2) as u64,
                                text,
                                limit,
                                |limit| (tokens <= limit).then_some(tokens),
                            );
                            assert_eq!(got, (tokens <= limit).then_some(tokens));
                        }
                    }
                });
            }
        });
        assert!(cache.stats().found > 0);
    }
}
