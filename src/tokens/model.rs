//! A model's own tokenizer, built from the Hugging Face `tokenizer.json` it ships with, counting
//! exactly what `tokenizers`' `encode(text, add_special_tokens=False)` counts.
//!
//! # What is accepted
//! Byte-level BPE whose merges rank like its ids, which is every vocabulary converted from
//! tiktoken's format: Llama 3, Qwen 2, 2.5 and 3, Mistral's Tekken (Nemo and after), DeepSeek
//! V3. For those, applying the merges in list order (Hugging Face's rule) and merging the
//! adjacent pair of lowest id first (tiktoken's rule, which `bpe`'s linear-time encoder follows)
//! give the same tokens, and the loader checks the premise: every merge `a b` makes a token `ab`
//! whose id never falls back as the list goes on. SentencePiece tokenizers (Llama 2, Mistral
//! 7B v0.1–v0.3: `Metaspace`, byte fallback) are refused with that reason, as is any other
//! shape this module does not reproduce exactly: a normalizer other than NFC, a pre-tokenizer
//! other than one `Split` regex followed by `ByteLevel` (or `ByteLevel` alone), added tokens that
//! strip white space around them.
//!
//! # How a text is counted
//! 1. Added tokens (`<|im_start|>`, `[INST]`, ...) are cut out first, leftmost-longest, one token
//!    each, as `tokenizers` does: a chat template's output carries them, and a user's text that
//!    spells one is tokenized upstream as that token too.
//! 2. Each stretch between them is normalized (NFC, where the tokenizer says so), split by the
//!    pre-tokenizer's regex (its `\s+(?!\S)` look-ahead rewritten as in `tokens.rs`; ASCII text
//!    is cut without it where the regex is one `ascii` knows: Llama 3's, Qwen's, Tekken's), and
//!    each piece counted by `bpe`'s backtracking encoder, linear in the piece, but for a short
//!    piece the thread's memo knows (`piece_memo`, one per vocabulary) and three exceptions:
//!    - a long piece that cannot fit is refused by its length (`longest_within`);
//!    - a long run of one byte is counted by its period (`count_run`);
//!    - a piece holding an entry that merging makes only in context (Llama 3 has 695: `bpe`,
//!      which needs every entry to make itself, cannot hold them) is cut where no merge can
//!      reach across and merged by the merges list where it must be (`count_cut`,
//!      `merge_by_list`): exact; linear for a list in training order (every merge's result pairs
//!      only in later merges), O(n log n) by a heap otherwise.
//!
//! Loading takes about a second and tens of megabytes per vocabulary, so it happens
//! at start-up (and in `check-config`), never on the request path. A loaded vocabulary lives for
//! the rest of the process (`&'static`): the request path copies a pointer to it.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::panic::{AssertUnwindSafe, catch_unwind};

use aho_corasick::{AhoCorasick, MatchKind};
use bpe::byte_pair_encoding::{BytePairEncoding, find_hash_factor_for_dictionary};
use regex_automata::meta::{Cache, Regex};
use rustc_hash::FxHashMap;
use serde_json::Value;
use unicode_normalization::UnicodeNormalization;

use super::ascii::{ModelPattern, Split};
use super::cut_piece;
use super::entries::{self, EntrySet};
use super::piece_memo::PieceMemo;
use super::template::ChatTemplate;

/// How far past the tokens left `bpe` may run before it gives up (see `count_pieces`).
const BPE_LIMIT_MARGIN: usize = 64;
/// Pieces longer than this are checked for being a run of one byte (`count_run`); shorter
/// ones cost the encoder little however they are made.
const RUN_MIN_BYTES: usize = 4096;
/// The look-ahead alternatives every supported pre-tokenizer regex ends with (tiktoken's
/// patterns and those converted from them).
const LOOKAHEAD_TAIL: &str = "|\\s+(?!\\S)|\\s+";
/// GPT-2's pre-tokenizer, which `ByteLevel` with `use_regex: true` applies.
const GPT2_PATTERN: &str =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

/// A model's vocabulary and pre-tokenizer, and its chat template if one was given.
pub struct ModelVocabulary {
    /// The file it was loaded from, for logs and errors.
    source: String,
    bpe: &'static BytePairEncoding,
    splitter: Regex,
    /// How `ascii` cuts ASCII text as `splitter` does, where the regex is one it knows.
    ascii_split: Option<Split>,
    /// Whose pre-tokenizer that regex is (`ascii::MODEL_PATTERNS`), for reports.
    known_pre_tokenizer: Option<&'static str>,
    nfc: bool,
    /// The added tokens, matched leftmost-longest; `None` if there are none.
    added: Option<AhoCorasick>,
    /// Entries merging never makes from their own bytes, but can make inside a longer piece
    /// (Llama 3's "している": its bytes merge differently alone than after "憶"). `bpe`
    /// cannot hold them, so a piece containing one is merged the slow, exact way (`merges`).
    unreachable: Option<AhoCorasick>,
    /// How many entries `bpe` cannot hold (`bench_tokens` reports it).
    context_only: usize,
    /// For that slow way: the merges by the ids they join, with their place in the list and the
    /// id they make; empty without unreachable entries.
    merges: FxHashMap<(u32, u32), (u32, u32)>,
    /// The id of each byte's one-byte entry, where merging starts.
    byte_ids: [u32; 256],
    /// Bit `a << 8 | b`: bytes `a`, `b` stand side by side inside some entry (`count_cut`).
    joinable: Vec<u64>,
    /// The special tokens `post_processor` adds to one sequence (`add_special_tokens`).
    prompt_special_tokens: u32,
    /// `model.ignore_merges`: a piece that is an entry is that entry, whatever merging would do.
    ignore_merges: bool,
    /// The vocabulary entries a piece may be whole (ignore_merges, or simply a token that BPE
    /// gives back as itself, which the `bpe` constructor checks for every entry).
    whole_tokens: EntrySet,
    /// No token covers more bytes (added tokens included), so a text of `n` bytes has at least
    /// `n / max_token_bytes` tokens.
    max_token_bytes: usize,
    /// For each byte `c`, the block that merging builds a long run of `c` from: the longest of
    /// `c`, `cc`, `cccc`, ... that are all entries (`-`: 64 bytes in Llama 3). See
    /// `count_run`; 0 where a run of `c` is not counted that way.
    run_block: [u16; 256],
    /// For each set of byte classes (`byte_class`), the longest entry made only of bytes of
    /// those classes: a piece has at least `len / longest_within[its classes]` tokens. A long
    /// piece of random letters is refused unread that way when it cannot fit, rather than
    /// merged (Llama 3's may need the slow path).
    longest_within: [u16; 64],
    template: Option<ChatTemplate>,
}

impl std::fmt::Debug for ModelVocabulary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ModelVocabulary({})", self.source)
    }
}

/// Two handles are the same vocabulary only if they point at the same one.
impl PartialEq for ModelVocabulary {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}

impl Eq for ModelVocabulary {}

thread_local! {
    /// One scratch per thread and loaded vocabulary (by address; a process loads a handful), as
    /// `tokens.rs` keeps one per built-in encoding. It grows by one entry per vocabulary the
    /// thread has counted with; vocabularies are never freed (`policy/files.rs`), so it is
    /// bounded by them and small beside them (a 64 KiB memo and a regex cache each).
    static MODEL_SCRATCHES: RefCell<Vec<(usize, Scratch)>> = const { RefCell::new(Vec::new()) };
}

/// What one thread's counting with one vocabulary keeps from piece to piece.
struct Scratch {
    /// The regex's search cache.
    search: Cache,
    /// The counts of short pieces counted lately (`piece_memo`).
    memo: PieceMemo,
}

impl ModelVocabulary {
    /// Builds the vocabulary from the text of a `tokenizer.json`, and the chat template from the
    /// text of a `tokenizer_config.json` if given. `source` names the file in errors. Every
    /// error says what is wrong in words an operator can act on.
    pub fn from_json(
        source: &str,
        tokenizer_json: &str,
        tokenizer_config_json: Option<&str>,
    ) -> Result<ModelVocabulary, String> {
        let json: Value = serde_json::from_str(tokenizer_json)
            .map_err(|e| format!("not a tokenizer.json (invalid JSON: {e})"))?;
        // The template first: it is cheap to check, the vocabulary is not.
        let template = match tokenizer_config_json {
            None => None,
            Some(text) => Some(
                ChatTemplate::from_tokenizer_config(text)
                    .map_err(|problem| format!("chat_template: {problem}"))?,
            ),
        };
        let nfc = match json.get("normalizer") {
            None | Some(Value::Null) => false,
            Some(n) if n.get("type") == Some(&Value::from("NFC")) => true,
            Some(n) => {
                return Err(format!(
                    "normalizer {} is not supported (only none or NFC)",
                    type_of(n)
                ));
            }
        };
        let pattern = split_pattern(json.get("pre_tokenizer").unwrap_or(&Value::Null))?;
        let splitter = splitter(&pattern)?;
        let known = ModelPattern::known(&pattern);
        let model = json
            .get("model")
            .filter(|m| m.get("type") == Some(&Value::from("BPE")))
            .ok_or_else(|| {
                format!(
                    "model {} is not supported (only BPE)",
                    json.get("model").map_or("(missing)".to_owned(), type_of)
                )
            })?;
        for (key, unsupported) in [
            ("byte_fallback", Value::Bool(true)),
            ("fuse_unk", Value::Bool(true)),
        ] {
            if model.get(key) == Some(&unsupported) {
                return Err(format!(
                    "model.{key}: true is SentencePiece-style BPE, which tollgate does not count \
                     exactly"
                ));
            }
        }
        for key in ["continuing_subword_prefix", "end_of_word_suffix", "dropout"] {
            match model.get(key) {
                None | Some(Value::Null) => {}
                Some(Value::String(s)) if s.is_empty() => {}
                Some(other) => return Err(format!("model.{key}: {other} is not supported")),
            }
        }
        let added = added_tokens(&json)?;
        let vocab = model
            .get("vocab")
            .and_then(Value::as_object)
            .ok_or("model.vocab: missing or not an object")?;
        let mut by_id: Vec<(u64, &str)> = Vec::with_capacity(vocab.len());
        for (token, id) in vocab {
            let id = id
                .as_u64()
                .ok_or_else(|| format!("model.vocab[{token:?}]: the id is not a number"))?;
            // Added tokens are cut out before BPE ever sees the text: not mergeable entries.
            if !added.contains(token.as_str()) {
                by_id.push((id, token));
            }
        }
        by_id.sort_unstable();
        let ids: HashMap<&str, u64> = by_id.iter().map(|&(id, token)| (token, id)).collect();
        let merges = check_merges(model.get("merges"), &ids)?;
        let entries = by_id
            .iter()
            .map(|&(_, token)| byte_level_bytes(token))
            .collect::<Result<Vec<Vec<u8>>, String>>()?;
        // Tiktoken-derived vocabularies hold entries that merging never makes from their own
        // bytes. `bpe` refuses such entries, so they stay out of its dictionary; a piece that
        // contains one is merged by `merge_by_list` instead, and `ignore_merges` (a whole piece
        // that is an entry is that entry) applies to them too.
        let ignore_merges = model.get("ignore_merges") == Some(&Value::Bool(true));
        let entries: &'static [Vec<u8>] = Vec::leak(entries);
        let unreachable_ranks = unreachable_entries(entries);
        let dictionary: Vec<Vec<u8>> = entries
            .iter()
            .enumerate()
            .filter(|(rank, _)| unreachable_ranks.binary_search(rank).is_err())
            .map(|(_, entry)| entry.clone())
            .collect();
        let factor = find_hash_factor_for_dictionary(dictionary.iter().cloned());
        // The constructor asserts that every entry encodes to itself; `split_reachable` checked
        // that already, so a failure here is a bug, reported rather than a crash.
        let bpe = catch_unwind(AssertUnwindSafe(|| {
            BytePairEncoding::from_dictionary(dictionary, Some(factor))
        }))
        .map_err(|panic| {
            let what = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_default();
            format!("the vocabulary is not a rank-consistent byte-level BPE ({what})")
        })?;
        let bpe: &'static BytePairEncoding = Box::leak(Box::new(bpe));
        let mut whole_tokens: EntrySet = (0..bpe.num_tokens())
            .map(|id| bpe.token_bytes(id as u32))
            .collect();
        let unreachable_bytes = || unreachable_ranks.iter().map(|&rank| &entries[rank]);
        if ignore_merges {
            whole_tokens.extend(unreachable_bytes().map(Vec::as_slice));
        }
        let (unreachable, merges) = if unreachable_ranks.is_empty() {
            (None, FxHashMap::default())
        } else {
            let matcher = AhoCorasick::builder()
                .match_kind(MatchKind::LeftmostFirst)
                .build(unreachable_bytes())
                .map_err(|e| format!("model.vocab: {e}"))?;
            let mut by_pair = FxHashMap::default();
            for (place, &(left, right, made)) in merges.iter().enumerate() {
                by_pair.entry((left, right)).or_insert((place as u32, made));
            }
            (Some(matcher), by_pair)
        };
        // Which two bytes stand side by side inside some entry: between two that never do, no
        // merge can ever reach across.
        let mut joinable = vec![0u64; 1024];
        for entry in entries.iter() {
            for pair in entry.windows(2) {
                let bit = usize::from(pair[0]) << 8 | usize::from(pair[1]);
                joinable[bit / 64] |= 1 << (bit % 64);
            }
        }
        let mut byte_ids = [0u32; 256];
        let mut has_byte = [false; 256];
        for (&(id, _), bytes) in by_id.iter().zip(entries.iter()) {
            if let [byte] = bytes.as_slice() {
                byte_ids[usize::from(*byte)] = u32::try_from(id).unwrap_or(0);
                has_byte[usize::from(*byte)] = true;
            }
        }
        if let Some(missing) = has_byte.iter().position(|&has| !has) {
            return Err(format!(
                "model.vocab has no entry for the byte {missing:#04x}: not a byte-level BPE"
            ));
        }
        let longest_entry = whole_tokens.longest();
        let longest_added = added.iter().map(|t| t.len()).max().unwrap_or(1);
        let added_matcher = if added.is_empty() {
            None
        } else {
            Some(
                AhoCorasick::builder()
                    .match_kind(MatchKind::LeftmostLongest)
                    .build(added.iter())
                    .map_err(|e| format!("added_tokens: {e}"))?,
            )
        };
        let max_token_bytes = longest_entry.max(longest_added).max(1);
        let mut run_block = [0u16; 256];
        for byte in 0..=255u8 {
            // A run that an entry `bpe` cannot hold may take part in is left to the slow path.
            let run = vec![byte; 2 * max_token_bytes + 2];
            if unreachable.as_ref().is_some_and(|m| m.is_match(&run)) {
                continue;
            }
            let mut block = 1usize;
            while block * 2 <= max_token_bytes && whole_tokens.contains(&run[..block * 2]) {
                block *= 2;
            }
            run_block[usize::from(byte)] = u16::try_from(block).unwrap_or(0);
        }
        let mut longest_exactly = [0u16; 64];
        for entry in entries.iter() {
            let classes = classes_of(entry);
            let len = u16::try_from(entry.len()).unwrap_or(u16::MAX);
            longest_exactly[classes] = longest_exactly[classes].max(len);
        }
        let mut longest_within = [1u16; 64];
        for (set, longest) in longest_within.iter_mut().enumerate() {
            for (subset, &len) in longest_exactly.iter().enumerate() {
                if subset & !set == 0 {
                    *longest = (*longest).max(len);
                }
            }
        }
        Ok(ModelVocabulary {
            source: source.to_owned(),
            bpe,
            splitter,
            ascii_split: known.map(|known| known.split),
            known_pre_tokenizer: known.map(|known| known.name),
            nfc,
            added: added_matcher,
            unreachable,
            context_only: unreachable_ranks.len(),
            merges,
            byte_ids,
            ignore_merges,
            joinable,
            prompt_special_tokens: prompt_special_tokens(json.get("post_processor")),
            whole_tokens,
            max_token_bytes,
            run_block,
            longest_within,
            template,
        })
    }

    /// The special tokens encoding one sequence with `add_special_tokens` adds.
    pub fn prompt_special_tokens(&self) -> u32 {
        self.prompt_special_tokens
    }

    /// Entries merging makes only in context, which `bpe` cannot hold (Llama 3 has some).
    pub fn context_only_entries(&self) -> usize {
        self.context_only
    }

    /// The file it was loaded from.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The chat template, if one was loaded with it.
    pub fn template(&self) -> Option<&ChatTemplate> {
        self.template.as_ref()
    }

    /// Whose pre-tokenizer its regex is, where `ascii` knows it and so cuts ASCII text without
    /// the regex (`ascii::MODEL_PATTERNS`); `None` where the regex cuts everything. The start-up
    /// log, `check-config` and `bench_tokens` report it.
    pub fn known_pre_tokenizer(&self) -> Option<&'static str> {
        self.known_pre_tokenizer
    }

    /// Entries in the BPE vocabulary (added tokens not included).
    pub fn vocabulary_size(&self) -> usize {
        self.bpe.num_tokens()
    }

    /// `Some(count)` if `text` has at most `limit` tokens, else `None` (inclusive, as
    /// `Encoding::count_till_limit`).
    ///
    /// `'static`: each thread keeps a scratch per vocabulary by its address (its memo's counts
    /// are this vocabulary's), which must then never be another's. Vocabularies are loaded once
    /// and never freed (`policy/files.rs` leaks each, interned by its files' contents).
    pub fn count_till_limit(&'static self, text: &str, limit: usize) -> Option<usize> {
        // NFC can shrink a text (decomposed Hangul to a third), so the bound on the raw bytes
        // holds only without it; the pieces, normalized, are bounded again below.
        if !self.nfc && text.len().div_ceil(self.max_token_bytes) > limit {
            return None;
        }
        let mut total = 0usize;
        let mut at = 0;
        if let Some(added) = &self.added {
            for found in added.find_iter(text) {
                total += self.count_stretch(&text[at..found.start()], limit - total)?;
                total += 1;
                if total > limit {
                    return None;
                }
                at = found.end();
            }
        }
        total += self.count_stretch(&text[at..], limit - total)?;
        Some(total)
    }

    /// Counts a stretch without added tokens: normalize, split, count each piece.
    fn count_stretch(&'static self, text: &str, limit: usize) -> Option<usize> {
        if text.is_empty() {
            return Some(0);
        }
        // ASCII text is always in NFC (no ASCII character composes with another), and telling
        // it so is a word-at-a-time scan, where `is_nfc` walks it character by character: about
        // a tenth of counting ASCII code's time with Qwen's tokenizer (docs/benchmarks.md).
        if self.nfc && !text.is_ascii() && !unicode_normalization::is_nfc(text) {
            let normalized: String = text.nfc().collect();
            return self.count_pieces(&normalized, limit);
        }
        self.count_pieces(text, limit)
    }

    fn count_pieces(&'static self, text: &str, limit: usize) -> Option<usize> {
        let key = self as *const ModelVocabulary as usize;
        MODEL_SCRATCHES.with(|scratches| {
            let mut scratches = scratches.borrow_mut();
            let index = match scratches.iter().position(|(k, _)| *k == key) {
                Some(index) => index,
                None => {
                    let scratch = Scratch {
                        search: self.splitter.create_cache(),
                        memo: PieceMemo::new(),
                    };
                    scratches.push((key, scratch));
                    scratches.len() - 1
                }
            };
            let scratch = &mut scratches[index].1;
            let bytes = text.as_bytes();
            let mut total = 0usize;
            let mut at = 0;
            while at < text.len() {
                let start = at;
                let piece = cut_piece(
                    self.ascii_split,
                    &self.splitter,
                    &mut scratch.search,
                    &text[at..],
                );
                at += piece.len();
                let remaining = limit - total;
                let tokens = if piece.len() == 1 {
                    1
                } else if let Some(key) = entries::short_key_in(bytes, start, piece.len()) {
                    // A short piece: the memo first, then counted whole (at most 15 tokens: no
                    // limit, so never None), and remembered. Its count depends on its bytes
                    // alone, however it is reached.
                    scratch
                        .memo
                        .get_or_count(key, || self.count_piece(piece, usize::MAX))?
                } else {
                    if piece.len() > RUN_MIN_BYTES {
                        let longest = usize::from(self.longest_within[classes_of(piece)]);
                        if piece.len().div_ceil(longest) > remaining {
                            return None;
                        }
                    }
                    self.count_piece(piece, remaining)?
                };
                if tokens > remaining {
                    return None;
                }
                total += tokens;
            }
            Some(total)
        })
    }

    /// One piece's tokens, or `None` once they are clearly more than `limit` (the caller
    /// compares exactly).
    fn count_piece(&self, piece: &[u8], limit: usize) -> Option<usize> {
        let holds_unreachable = || {
            self.unreachable
                .as_ref()
                .is_some_and(|matcher| matcher.is_match(piece))
        };
        // One-byte pieces are answered by `count_pieces` itself.
        Some(if let Some(tokens) = self.count_run(piece) {
            tokens
        } else if self.ignore_merges && self.whole_tokens.contains(piece) {
            // Hugging Face looks the whole piece up before merging anything.
            1
        } else if holds_unreachable() {
            // Parts are numbered in u32; no body comes near 4 GiB (tokens.max_body_bytes
            // and Envoy's buffer limit stop it long before), but never misnumber one.
            if piece.len() >= u32::MAX as usize {
                return None;
            }
            self.count_cut(piece, limit)?
        } else if self.whole_tokens.contains(piece) {
            // An entry `bpe` holds merges into itself (its constructor checks).
            1
        } else {
            // `bpe` gives up once it holds more than its limit plus a little slack, which
            // was measured for OpenAI's vocabularies only: a wider margin here, and the
            // caller's exact comparison.
            self.bpe
                .count_till_limit(piece, limit.saturating_add(BPE_LIMIT_MARGIN))?
        })
    }
}

impl ModelVocabulary {
    /// The count of a long run of one byte, the backtracking encoder's slowest input (`-`
    /// repeated: about 0.4 µs a byte), in time independent of its length; `None` for any other
    /// piece. Merging lowest rank first, leftmost first on ties, builds a run of `c` into
    /// blocks from the left: `cc` (every pair, left to right, before anything bigger, whose
    /// rank is higher as it is made of them), then `cccc`, and so on up to the block `B` whose
    /// double is no entry. Merges that mix sizes happen only at the right end, where the one
    /// odd block of each doubling waits, and reach at most an entry's length further left. So
    /// beyond a margin the count grows by one every `B` bytes: count(c^n) = count(c^m) +
    /// (n − m) / B for the `m ≡ n (mod B)` just above the margin, which the encoder counts.
    fn count_run(&self, piece: &[u8]) -> Option<usize> {
        if piece.len() <= RUN_MIN_BYTES {
            return None;
        }
        let byte = piece[0];
        let block = usize::from(self.run_block[usize::from(byte)]);
        if block == 0 || !piece.iter().all(|&b| b == byte) {
            return None;
        }
        let margin = 2 * self.max_token_bytes + 2 * block;
        if piece.len() <= margin + block {
            return None;
        }
        let short = margin + (piece.len() - margin) % block;
        let tokens = self.bpe.count(&piece[..short]);
        Some(tokens + (piece.len() - short) / block)
    }
}

/// The classes of bytes in `bytes`, one bit each (`longest_within`): white space, lowercase,
/// uppercase, digits, other ASCII, and any byte of a non-ASCII character.
fn classes_of(bytes: &[u8]) -> usize {
    bytes.iter().fold(0, |set, &b| set | byte_class(b))
}

fn byte_class(b: u8) -> usize {
    match b {
        b' ' | b'\t' | b'\n' | b'\r' | 0x0b | 0x0c => 1,
        b'a'..=b'z' => 2,
        b'A'..=b'Z' => 4,
        b'0'..=b'9' => 8,
        0..=0x7f => 16,
        _ => 32,
    }
}

/// How many special tokens a post-processor adds to a single sequence: the `SpecialToken`
/// items of a `TemplateProcessing`'s `single` template (alone or in a `Sequence`); none for
/// `ByteLevel` and the others, which add no tokens.
fn prompt_special_tokens(post_processor: Option<&Value>) -> u32 {
    let Some(post) = post_processor else {
        return 0;
    };
    match type_of(post).as_str() {
        "TemplateProcessing" => post
            .get("single")
            .and_then(Value::as_array)
            .map_or(0, |items| {
                items
                    .iter()
                    .filter(|i| i.get("SpecialToken").is_some())
                    .count() as u32
            }),
        "Sequence" => post
            .get("processors")
            .and_then(Value::as_array)
            .map_or(0, |all| {
                all.iter().map(|p| prompt_special_tokens(Some(p))).sum()
            }),
        _ => 0,
    }
}

/// `{"type": ...}` of a tokenizer component, for errors.
fn type_of(component: &Value) -> String {
    component
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("(without a type)")
        .to_owned()
}

/// The one pre-tokenizer regex: `Sequence[Split(regex, Isolated), ByteLevel(use_regex: false)]`
/// or `ByteLevel(use_regex: true)` (GPT-2's regex).
fn split_pattern(pre: &Value) -> Result<String, String> {
    let byte_level_ok = |b: &Value| -> Result<bool, String> {
        if b.get("add_prefix_space") == Some(&Value::Bool(true)) {
            return Err(
                "pre_tokenizer ByteLevel with add_prefix_space: true is not supported".into(),
            );
        }
        Ok(b.get("use_regex") != Some(&Value::Bool(false)))
    };
    match type_of(pre).as_str() {
        "ByteLevel" => {
            if byte_level_ok(pre)? {
                Ok(GPT2_PATTERN.to_owned())
            } else {
                Err("pre_tokenizer ByteLevel without a regex splits nothing: not supported".into())
            }
        }
        "Sequence" => {
            let parts = pre
                .get("pretokenizers")
                .and_then(Value::as_array)
                .ok_or("pre_tokenizer.pretokenizers: missing")?;
            let [split, byte_level] = parts.as_slice() else {
                return Err(format!(
                    "pre_tokenizer: a Sequence of {} parts is not supported (Split, then ByteLevel)",
                    parts.len()
                ));
            };
            if type_of(split) != "Split" || type_of(byte_level) != "ByteLevel" {
                return Err(format!(
                    "pre_tokenizer: Sequence[{}, {}] is not supported (Split, then ByteLevel)",
                    type_of(split),
                    type_of(byte_level)
                ));
            }
            if byte_level_ok(byte_level)? {
                return Err(
                    "pre_tokenizer: ByteLevel after a Split must have use_regex: false".into(),
                );
            }
            if split.get("behavior").and_then(Value::as_str) != Some("Isolated")
                || split.get("invert") == Some(&Value::Bool(true))
            {
                return Err("pre_tokenizer Split: only behavior Isolated, not inverted".into());
            }
            split
                .get("pattern")
                .and_then(|p| p.get("Regex"))
                .and_then(Value::as_str)
                .map(str::to_owned)
                .ok_or_else(|| "pre_tokenizer Split: only a Regex pattern is supported".into())
        }
        "Metaspace" => Err(
            "pre_tokenizer Metaspace is SentencePiece-style (Llama 2, Mistral 7B v0.1-v0.3): not \
             supported"
                .into(),
        ),
        other => Err(format!("pre_tokenizer {other} is not supported")),
    }
}

/// The patterns for `regex_automata`, which has no look-around: `\s+(?!\S)` becomes `\s+$` in
/// the first pattern and `\s+\s` (whose last character `regex_piece` gives back) as the second,
/// exactly as `tokens.rs` spells tiktoken's.
pub(super) fn splitter(pattern: &str) -> Result<Regex, String> {
    let head = pattern.strip_suffix(LOOKAHEAD_TAIL).ok_or_else(|| {
        format!(
            "pre_tokenizer regex {pattern:?} is not supported: it must end with {LOOKAHEAD_TAIL:?}"
        )
    })?;
    let first = format!("{head}|\\s+$");
    Regex::new_many(&[first.as_str(), "\\s+\\s", "\\s+"])
        .map_err(|e| format!("pre_tokenizer regex {pattern:?} is not supported: {e}"))
}

/// The added tokens by content. Tokens that strip white space around them, or must stand alone
/// as a word, would change the text around them: not supported.
fn added_tokens(json: &Value) -> Result<HashSet<&str>, String> {
    let mut added = HashSet::new();
    let Some(list) = json.get("added_tokens").and_then(Value::as_array) else {
        return Ok(added);
    };
    for (i, token) in list.iter().enumerate() {
        let content = token
            .get("content")
            .and_then(Value::as_str)
            .filter(|c| !c.is_empty())
            .ok_or_else(|| format!("added_tokens[{i}].content: missing or empty"))?;
        for flag in ["lstrip", "rstrip", "single_word"] {
            if token.get(flag) == Some(&Value::Bool(true)) {
                return Err(format!(
                    "added_tokens[{i}] ({content:?}): {flag}: true is not supported"
                ));
            }
        }
        added.insert(content);
    }
    Ok(added)
}

/// Every merge `a b` makes a token `ab`, and the ids of the tokens they make never decrease:
/// then merging in list order is merging lowest id first.
/// Returns the merges as ids, `(left, right, made)`, in list order.
fn check_merges(
    merges: Option<&Value>,
    ids: &HashMap<&str, u64>,
) -> Result<Vec<(u32, u32, u32)>, String> {
    let merges = merges
        .and_then(Value::as_array)
        .ok_or("model.merges: missing or not a list")?;
    let mut pairs = Vec::with_capacity(merges.len());
    let id_of = |token: &str, i: usize| -> Result<u32, String> {
        ids.get(token)
            .and_then(|&id| u32::try_from(id).ok())
            .ok_or_else(|| format!("model.merges[{i}]: {token:?} is no token of the vocabulary"))
    };
    let mut last = 0;
    let mut joined = String::new();
    for (i, merge) in merges.iter().enumerate() {
        let (a, b) = match merge {
            Value::String(s) => s
                .split_once(' ')
                .ok_or_else(|| format!("model.merges[{i}]: {s:?} is not two tokens"))?,
            Value::Array(pair) => match pair.as_slice() {
                [Value::String(a), Value::String(b)] => (a.as_str(), b.as_str()),
                _ => return Err(format!("model.merges[{i}]: not two tokens")),
            },
            _ => return Err(format!("model.merges[{i}]: not two tokens")),
        };
        joined.clear();
        joined.push_str(a);
        joined.push_str(b);
        let id = *ids.get(joined.as_str()).ok_or_else(|| {
            format!("model.merges[{i}]: {a:?} + {b:?} makes no token of the vocabulary")
        })?;
        if id < last {
            return Err(format!(
                "model.merges[{i}] makes token {id} after token {last}: merges do not rank like \
                 ids, so tollgate cannot count this vocabulary exactly"
            ));
        }
        last = id;
        pairs.push((id_of(a, i)?, id_of(b, i)?, id as u32));
    }
    Ok(pairs)
}

/// The ranks (ascending) of the entries `bpe` cannot hold: those that merging lowest rank first,
/// over the entries kept so far, does not make from their own bytes. Such an entry can still
/// appear inside a longer piece, where merges reaching across its first or last character change
/// what its bytes merge into; but only where its bytes are, so a piece holding none of them
/// merges the same with or without them (`ModelVocabulary::unreachable`).
fn unreachable_entries(entries: &[Vec<u8>]) -> Vec<usize> {
    let mut rank: HashMap<&[u8], usize> = HashMap::with_capacity(entries.len());
    let mut unreachable = Vec::new();
    for (id, entry) in entries.iter().enumerate() {
        // Its own rank takes part: the last merge makes it.
        rank.insert(entry, id);
        if entry.len() > 1 && !merges_to_itself(entry, &rank) {
            rank.remove(entry.as_slice());
            unreachable.push(id);
        }
    }
    unreachable
}

/// A piece's parts while merging: part i's token, the parts after and before it among those
/// alive (`n` and `u32::MAX` at the ends), and whether it is alive (not yet merged into the part
/// before it).
struct Parts {
    id: Vec<u32>,
    next: Vec<u32>,
    prev: Vec<u32>,
    alive: Vec<bool>,
    /// Parts still alive: the piece's count of tokens once merging ends.
    count: usize,
}

impl Parts {
    /// Bytes the piece had: parts are numbered by their first byte.
    fn len(&self) -> usize {
        self.id.len()
    }

    /// The part after `left`, if `left` is alive and not the last.
    fn right_of(&self, left: u32) -> Option<u32> {
        let right = self.next[left as usize];
        (self.alive[left as usize] && (right as usize) < self.len()).then_some(right)
    }

    /// Merges `left` with the part after it into the token `made`; the parts the merged one
    /// now stands beside: after it, and before it, where there are such.
    fn join(&mut self, left: u32, made: u32) -> (Option<u32>, Option<u32>) {
        let right = self.next[left as usize];
        self.id[left as usize] = made;
        self.alive[right as usize] = false;
        self.count -= 1;
        let after = self.next[right as usize];
        self.next[left as usize] = after;
        let after = ((after as usize) < self.len()).then(|| {
            self.prev[after as usize] = left;
            after
        });
        let before = self.prev[left as usize];
        (after, (before != u32::MAX).then_some(before))
    }
}

/// A pair `merge_by_sweeps` may merge: its left part, the token the merge makes, and how many
/// merges had been made when it was found.
#[derive(Clone, Copy)]
struct Candidate {
    left: u32,
    made: u32,
    found: u32,
}

/// `merge_by_sweeps`' candidates by place in the merges list, lowest place first.
struct Pending {
    slots: Vec<Vec<Candidate>>,
    slot_of: FxHashMap<u32, usize>,
    places: std::collections::BinaryHeap<std::cmp::Reverse<(u32, usize)>>,
    /// Recent places and their slots, by the place's low bits: a piece's candidates come from
    /// a handful of places in turn (`talya` repeated: five), which this finds without hashing.
    recent: [(u32, u32); PENDING_CACHE],
}

/// Entries of `merge_by_sweeps`' cache of the list's answers (indexed by a hash's top 6 bits).
const LOOKUP_CACHE: usize = 64;

/// Entries of `Pending::recent`, a power of two.
const PENDING_CACHE: usize = 32;

impl Default for Pending {
    fn default() -> Pending {
        Pending {
            slots: Vec::new(),
            slot_of: FxHashMap::default(),
            places: std::collections::BinaryHeap::new(),
            recent: [(u32::MAX, 0); PENDING_CACHE],
        }
    }
}

impl Pending {
    fn add(&mut self, place: u32, candidate: Candidate) {
        let recent = place as usize & (PENDING_CACHE - 1);
        let slot = match self.recent[recent] {
            (cached, slot) if cached == place => slot as usize,
            _ => {
                let slot = match self.slot_of.get(&place) {
                    Some(&slot) => slot,
                    None => {
                        let slot = self.slots.len();
                        self.slots.push(Vec::new());
                        self.slot_of.insert(place, slot);
                        self.places.push(std::cmp::Reverse((place, slot)));
                        slot
                    }
                };
                self.recent[recent] = (place, slot as u32);
                slot
            }
        };
        self.slots[slot].push(candidate);
    }

    /// The lowest place with candidates, and its candidates (taken: a place is swept once).
    fn take_lowest(&mut self) -> Option<(u32, Vec<Candidate>)> {
        let std::cmp::Reverse((place, slot)) = self.places.pop()?;
        self.slot_of.remove(&place);
        let recent = place as usize & (PENDING_CACHE - 1);
        if self.recent[recent].0 == place {
            self.recent[recent] = (u32::MAX, 0);
        }
        Some((place, std::mem::take(&mut self.slots[slot])))
    }
}

/// Pieces shorter than this are merged by the heap at once: a sweep's bookkeeping costs more
/// than the heap's log factor on a few hundred bytes.
const SWEEP_MIN_BYTES: usize = 1024;

impl ModelVocabulary {
    /// A piece that holds an entry `bpe` cannot hold, counted exactly and mostly fast: cut
    /// wherever two neighbouring bytes stand side by side in no entry (no merge can reach
    /// across, so each stretch merges as it would alone: the same merges, in the same order),
    /// then each stretch by `bpe`, or by `merge_by_list` if it holds such an entry itself.
    /// Random letters cut every few dozen bytes (a few pairs of lowercase letters stand in no
    /// Llama 3 entry); text made only of joinable pairs is merged whole, O(n log n).
    /// None as soon as the stretches counted pass `limit`: a megabyte of random letters is one
    /// piece, refused at a context's ceiling without counting the rest.
    fn count_cut(&self, piece: &[u8], limit: usize) -> Option<usize> {
        let joinable = |a: u8, b: u8| {
            let bit = usize::from(a) << 8 | usize::from(b);
            self.joinable[bit / 64] & (1 << (bit % 64)) != 0
        };
        let mut total = 0;
        let mut start = 0;
        for end in 1..=piece.len() {
            if end < piece.len() && joinable(piece[end - 1], piece[end]) {
                continue;
            }
            let stretch = &piece[start..end];
            start = end;
            total += if stretch.len() == 1 {
                1
            } else if stretch.len() == piece.len()
                || self
                    .unreachable
                    .as_ref()
                    .is_some_and(|matcher| matcher.is_match(stretch))
            {
                // Uncut, the stretch is the piece, which the caller found holds such an entry.
                self.merge_by_list(stretch)
            } else if self.whole_tokens.contains(stretch) {
                // Not one `bpe` cannot hold (the matcher said so): it merges into itself.
                1
            } else {
                self.bpe.count(stretch)
            };
            if total > limit {
                return None;
            }
        }
        Some(total)
    }

    /// How many tokens merging `piece` as Hugging Face `tokenizers` does leaves: from single
    /// bytes, always the adjacent pair whose merge comes first in the list, leftmost on ties.
    /// Long pieces try `merge_by_sweeps` first, in linear time where the list is in the order
    /// BPE training writes it; the heap (`merge_by_heap`) is exact for any list.
    fn merge_by_list(&self, piece: &[u8]) -> usize {
        if piece.len() >= SWEEP_MIN_BYTES
            && let Some(parts) = self.merge_by_sweeps(piece)
        {
            return parts;
        }
        self.merge_by_heap(piece)
    }

    /// `piece` as single bytes, linked, before any merge.
    fn parts(&self, piece: &[u8]) -> Parts {
        let n = piece.len() as u32;
        Parts {
            id: piece
                .iter()
                .map(|&b| self.byte_ids[usize::from(b)])
                .collect(),
            next: (1..=n).collect(),
            prev: (0..n).map(|i| i.wrapping_sub(1)).collect(),
            alive: vec![true; n as usize],
            count: n as usize,
        }
    }

    /// `merge_by_list` by sweeps: every candidate pair of one place in the list is merged in one
    /// sweep, left to right. That is the heap's order as long as no merge makes a pair that comes
    /// at or before the place being swept (a trained list never does: a merge's result pairs
    /// only in merges learnt after it). None if one does: the caller merges by the heap. Linear
    /// in the piece plus the sorting of a place's candidates, which arrive sorted from one sweep
    /// and need merging only when several sweeps feed one place.
    fn merge_by_sweeps(&self, piece: &[u8]) -> Option<usize> {
        let mut parts = self.parts(piece);
        // When each part's token last changed, in merges made so far. A candidate records the
        // count when it was found: if neither of its parts changed since and they are still
        // neighbours, it is the same pair, with the same place and result, and needs no second
        // look-up in the list.
        let mut changed_at = vec![0u32; parts.len()];
        let mut merges_made = 0u32;
        // The list's answer for recent pairs, by a hash of the pair: a long piece repeats a
        // few pairs many times (`talya` repeated: five), which this answers without the map.
        let mut recent = [(u64::MAX, None::<(u32, u32)>); LOOKUP_CACHE];
        let mut merge_of = |left: u32, right: u32, id: &[u32]| {
            let pair = (id[left as usize], id[right as usize]);
            let key = u64::from(pair.0) << 32 | u64::from(pair.1);
            let index = (key.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 58) as usize;
            match recent[index] {
                (cached, answer) if cached == key => answer,
                _ => {
                    let answer = self.merges.get(&pair).copied();
                    recent[index] = (key, answer);
                    answer
                }
            }
        };
        let mut pending = Pending::default();
        for i in 0..parts.len().saturating_sub(1) as u32 {
            if let Some((place, made)) = merge_of(i, i + 1, &parts.id) {
                let found = 0;
                pending.add(
                    place,
                    Candidate {
                        left: i,
                        made,
                        found,
                    },
                );
            }
        }
        while let Some((place, mut sweep)) = pending.take_lowest() {
            if !sweep.is_sorted_by_key(|c| c.left) {
                sweep.sort_unstable_by_key(|c| c.left);
            }
            for candidate in sweep {
                let left = candidate.left;
                let Some(right) = parts.right_of(left) else {
                    continue;
                };
                if changed_at[left as usize] > candidate.found
                    || changed_at[right as usize] > candidate.found
                {
                    continue;
                }
                merges_made += 1;
                changed_at[left as usize] = merges_made;
                let (after, before) = parts.join(left, candidate.made);
                for (l, r) in [after.map(|a| (left, a)), before.map(|b| (b, left))]
                    .into_iter()
                    .flatten()
                {
                    if let Some((new, made)) = merge_of(l, r, &parts.id) {
                        if new <= place {
                            return None;
                        }
                        let found = merges_made;
                        pending.add(
                            new,
                            Candidate {
                                left: l,
                                made,
                                found,
                            },
                        );
                    }
                }
            }
        }
        Some(parts.count)
    }

    /// `merge_by_list` by a heap of candidate pairs over a linked list of parts: exact for any
    /// list, O(n log n) in the piece's length.
    fn merge_by_heap(&self, piece: &[u8]) -> usize {
        use std::cmp::Reverse;
        use std::collections::BinaryHeap;
        let mut parts = self.parts(piece);
        // A candidate is its place in the list and its left part, packed so the heap orders by
        // place, then leftmost; a pair's place names the pair, so a popped candidate whose left
        // part now pairs at another place is stale.
        let pack = |place: u32, left: u32| (u64::from(place) << 32) | u64::from(left);
        let merge_of = |left: u32, right: u32, id: &[u32]| {
            self.merges
                .get(&(id[left as usize], id[right as usize]))
                .copied()
        };
        let mut heap: BinaryHeap<Reverse<u64>> = (0..parts.len().saturating_sub(1) as u32)
            .filter_map(|i| merge_of(i, i + 1, &parts.id).map(|(place, _)| Reverse(pack(place, i))))
            .collect();
        while let Some(Reverse(packed)) = heap.pop() {
            let (place, left) = ((packed >> 32) as u32, packed as u32);
            let Some(right) = parts.right_of(left) else {
                continue;
            };
            let Some((current, made)) = merge_of(left, right, &parts.id) else {
                continue;
            };
            if current != place {
                continue;
            }
            let (after, before) = parts.join(left, made);
            for (l, r) in [after.map(|a| (left, a)), before.map(|b| (b, left))]
                .into_iter()
                .flatten()
            {
                if let Some((place, _)) = merge_of(l, r, &parts.id) {
                    heap.push(Reverse(pack(place, l)));
                }
            }
        }
        parts.count
    }
}

/// Whether merging `bytes` lowest rank first (leftmost on ties) ends in one token. Quadratic in
/// the entry's length, which is at most a few hundred bytes; run once per entry at load.
fn merges_to_itself(bytes: &[u8], rank: &HashMap<&[u8], usize>) -> bool {
    let mut parts: Vec<&[u8]> = bytes.chunks(1).collect();
    let mut joined = Vec::with_capacity(bytes.len());
    while parts.len() > 1 {
        let mut best: Option<(usize, usize)> = None;
        for i in 0..parts.len() - 1 {
            joined.clear();
            joined.extend_from_slice(parts[i]);
            joined.extend_from_slice(parts[i + 1]);
            if let Some(&r) = rank.get(joined.as_slice())
                && best.is_none_or(|(best_rank, _)| r < best_rank)
            {
                best = Some((r, i));
            }
        }
        let Some((_, i)) = best else {
            return false;
        };
        let start = parts[i].as_ptr() as usize - bytes.as_ptr() as usize;
        let len = parts[i].len() + parts[i + 1].len();
        parts[i] = &bytes[start..start + len];
        parts.remove(i + 1);
    }
    true
}

/// A byte-level token's bytes: GPT-2 shows each byte as a printable character (`bytes_to_unicode`).
fn byte_level_bytes(token: &str) -> Result<Vec<u8>, String> {
    token
        .chars()
        .map(|c| {
            BYTE_LEVEL_DECODE.get(&c).copied().ok_or_else(|| {
                format!(
                    "model.vocab: {token:?} holds {c:?}, which is not a byte-level character: \
                     not a byte-level BPE"
                )
            })
        })
        .collect()
}

static BYTE_LEVEL_DECODE: std::sync::LazyLock<HashMap<char, u8>> = std::sync::LazyLock::new(|| {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut map = HashMap::with_capacity(256);
    let mut next = 256u32;
    for byte in 0..=255u8 {
        let c = if printable(byte) {
            char::from(byte)
        } else {
            let c = char::from_u32(next).expect("256..324 are chars");
            next += 1;
            c
        };
        map.insert(c, byte);
    }
    map
});
