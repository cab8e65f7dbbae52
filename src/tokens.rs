//! Exact, linear-time token counting for OpenAI's BPE encodings, and for the open models'
//! own byte-level BPE tokenizers loaded from their `tokenizer.json` (`model`, with their chat
//! templates in `template`).
//!
//! Admission decisions are only as fair as the token counts behind them, so the
//! counts here must be the ones the upstream model bills. The invariant: for
//! every input, [`Encoding::count`] equals tiktoken's
//! `encode_ordinary(text).len()` for the same encoding, and special-token text
//! such as `<|endoftext|>` is counted as ordinary text (a client cannot smuggle
//! a control token in, and it costs what it costs upstream).
//!
//! Counting is done with `bpe-openai`'s vocabularies and encoder, whose backtracking BPE is linear in the
//! input length even when pre-tokenisation cannot split the input (a megabyte
//! without a single space), where tiktoken's heap-based merge is one to two
//! orders of magnitude slower. That matters because request bodies are
//! attacker controlled and counted on the request path. Linear is not free,
//! though: long runs of `-`, `/`, `#`, `=` or `*` (both vocabularies hold runs
//! of them up to 80-112 bytes as single tokens) make the encoder try and drop
//! many candidates per byte, at about a microsecond or two per byte in a
//! release build, and since such a body has few tokens the limit given to
//! [`Encoding::count_till_limit`] does not cut that short. Callers must cap body
//! size in bytes before counting, and where they count on a thread others wait for, cap what
//! such pieces may cost ([`within_inline_budget`]); `docs/benchmarks.md` has measured figures.
//!
//! The request path counts through [`Counter`] rather than `bpe_openai::Tokenizer::count`,
//! which does the same steps with two costs per pre-tokenised piece that dominate on ordinary
//! text (measured with `perf` under `examples/bench_decisions.rs`): it takes the regex's search
//! cache from a shared pool for every piece, and it allocates a fresh backtracking encoder for
//! every piece, even a word that is a single vocabulary entry. [`Counter`] keeps one search cache
//! per thread and answers a piece that is a whole vocabulary entry with 1, which is what
//! tiktoken's own `encode_ordinary` does for such a piece before it merges anything. On ASCII
//! text it cuts pieces without the regex (`ascii`), which was half of what remained, and it
//! keeps the counts of short pieces counted lately per thread (`piece_memo`), so a word that
//! comes back is neither looked up among the entries nor counted by the encoder again. A
//! model's own vocabulary (`model`) does both too: `ascii` knows the regexes Llama 3, Qwen and
//! Mistral's Tekken ship, and each vocabulary has a memo of its own per thread.
//!
//! This module is pure: no I/O, no clocks, no async. The count cache remembers answers; it
//! changes none.

use std::cell::{Cell, RefCell};
use std::sync::LazyLock;

use bpe_openai::Tokenizer;
use regex_automata::meta::{Cache, Regex};
use regex_automata::{Anchored, Input};
use serde::{Deserialize, Serialize};

mod ascii;
mod count_cache;
mod entries;
mod model;
mod piece_memo;
mod template;
#[cfg(test)]
mod tests;

use count_cache::CountCache;
pub use count_cache::CountCacheStats;
use entries::EntrySet;
pub use model::ModelVocabulary;
use piece_memo::PieceMemo;
pub use template::ChatTemplate;

/// A BPE token encoding: one of OpenAI's, named in the configuration, or a model's own, loaded
/// from the files a rule names (`EncodingRule::tokenizer_file`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Encoding {
    /// GPT-4, GPT-3.5-turbo and the text-embedding-3 family.
    Cl100kBase,
    /// GPT-4o, GPT-4.1, GPT-5 and the o-series.
    O200kBase,
    /// A model's own tokenizer (Llama 3, Qwen, Mistral's Tekken, ...), loaded at start-up. Not a
    /// configuration value: a rule names the file instead.
    #[serde(skip)]
    Model(&'static ModelVocabulary),
}

/// Model-name globs whose default encoding is o200k; anything else is cl100k.
/// Kept as data (and matched with [`glob_match`]) so the default reads like the
/// config rules that override it.
const O200K_MODEL_PATTERNS: &[&str] = &[
    "gpt-4o*",
    "chatgpt-4o*",
    "gpt-4.1*",
    "gpt-5*",
    "o1*",
    "o3*",
    "o4*",
];

/// No token of either vocabulary is longer than this many bytes (128 spaces is
/// one token in both; the tests check every entry), so a text of `n` bytes has
/// at least `n / MAX_TOKEN_BYTES` tokens, rounded up.
const MAX_TOKEN_BYTES: usize = 128;

/// Whose texts a count found in the cache may come from: one tenant's (`count_cache`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CountScope(u64);

impl CountScope {
    /// The scope of `tenant`'s texts.
    pub fn of(tenant: &str) -> CountScope {
        CountScope(COUNT_CACHE.scope_of(tenant))
    }
}

/// The text the count cache may hold, in bytes: a few thousand long prompts' messages.
const COUNT_CACHE_BYTES: usize = 32 << 20;

/// The counts of long texts already counted on the request path, shared by every worker.
static COUNT_CACHE: LazyLock<CountCache> = LazyLock::new(|| CountCache::new(COUNT_CACHE_BYTES));

/// Whether `text` has more than `limit` tokens in OpenAI's encodings by its length alone (no
/// token is longer than `MAX_TOKEN_BYTES`).
fn over_limit_by_length(text: &str, limit: usize) -> bool {
    text.len().div_ceil(MAX_TOKEN_BYTES) > limit
}

/// Text for [`Encoding::warm_up`] that walks every branch of the
/// pre-tokenisation regexes (letters, contractions, digits, punctuation,
/// whitespace runs, newlines, non-Latin script), so the warm-up call also
/// builds the regex search state a first real request would otherwise build.
const WARM_UP_TEXT: &str =
    "Hello, world! It's 2024-06-01T12:00:00Z.\n\n  fn main() { let x = 42; }  \t\n日本語 😀";

impl Encoding {
    /// Default family choice by model name: o200k for gpt-4o*, o1*/o3*/o4*
    /// (o-series), gpt-4.1*, gpt-5*, chatgpt-4o*; cl100k otherwise.
    pub fn for_model_default(model: &str) -> Encoding {
        if O200K_MODEL_PATTERNS
            .iter()
            .any(|pattern| glob_match(pattern, model))
        {
            Encoding::O200kBase
        } else {
            Encoding::Cl100kBase
        }
    }

    /// Counts tokens of `text` exactly as tiktoken's encode_ordinary would
    /// (special tokens are ordinary text).
    pub fn count(self, text: &str) -> usize {
        self.count_till_limit(text, usize::MAX)
            .unwrap_or(usize::MAX)
    }

    /// Like count, but stops as soon as the count exceeds `limit` and returns
    /// None then. Some(n) with n <= limit otherwise.
    ///
    /// The limit is inclusive: a text of exactly `limit` tokens gives
    /// `Some(limit)`, one more token gives `None`. A text longer than
    /// `128 * limit` bytes is answered `None` without being looked at (no token
    /// is longer than 128 bytes), so the work of a call is bounded by the
    /// limit, not by the body. Otherwise encoding stops at the piece
    /// (pre-tokenisation chunk) where the limit is crossed, and inside it as
    /// soon as the running count is clearly past it. The piece that crosses the
    /// limit is still scanned to its end by the pre-tokeniser, and a
    /// text that stays under the limit costs as much as [`Encoding::count`].
    ///
    /// Exactness at the boundary relies on `bpe`'s internal slack: its
    /// backtracking encoder may hold more tokens mid-piece than the piece
    /// finally needs, and it only gives up once it holds more than the
    /// remaining budget plus 10. The largest such overshoot we measured over
    /// every cl100k and o200k vocabulary entry's prefixes is 6; the boundary
    /// tests in `tokens/tests.rs` pin this down for the crate version in use.
    pub fn count_till_limit(self, text: &str, limit: usize) -> Option<usize> {
        if let Encoding::Model(vocabulary) = self {
            return vocabulary.count_till_limit(text, limit);
        }
        if over_limit_by_length(text, limit) {
            return None;
        }
        self.counter().count_till_limit(text, limit)
    }

    /// [`Encoding::count_till_limit`], answered from the counts of `scope`'s texts already
    /// counted where `text` is one of them (`count_cache`): the same answer, without counting
    /// a long text that comes back (a conversation's earlier turns, a system prompt) again.
    /// The request path counts with this; benchmarks of counting itself use the plain one.
    pub fn count_till_limit_cached(
        self,
        scope: CountScope,
        text: &str,
        limit: usize,
    ) -> Option<usize> {
        self.count_till_limit_in(&COUNT_CACHE, scope, text, limit)
    }

    /// [`Encoding::count_till_limit_cached`] with the counts kept in `cache` (the tests' own).
    fn count_till_limit_in(
        self,
        cache: &CountCache,
        scope: CountScope,
        text: &str,
        limit: usize,
    ) -> Option<usize> {
        // What the plain count refuses without reading the text is not worth a hash either
        // (a model's vocabulary has its own bound, which depends on its normalizer).
        if !matches!(self, Encoding::Model(_)) && over_limit_by_length(text, limit) {
            return None;
        }
        cache.count_till_limit(self.cache_key(), scope.0, text, limit, |limit| {
            self.count_till_limit(text, limit)
        })
    }

    /// What the count cache has done so far (`Encoding::count_till_limit_cached`), for the
    /// metrics.
    pub fn count_cache_stats() -> CountCacheStats {
        COUNT_CACHE.stats()
    }

    /// What tells this encoding's entries apart in the count cache: a model's vocabulary by
    /// its address (vocabularies are loaded once and never freed), OpenAI's by 0 and 1.
    fn cache_key(self) -> usize {
        match self {
            Encoding::Cl100kBase => 0,
            Encoding::O200kBase => 1,
            Encoding::Model(vocabulary) => std::ptr::from_ref(vocabulary) as usize,
        }
    }

    /// The special tokens the tokenizer adds around a prompt encoded with
    /// `add_special_tokens` (its post-processor's template: Mistral's `<s>`); 0 for OpenAI's.
    pub fn prompt_special_tokens(self) -> u32 {
        match self {
            Encoding::Model(vocabulary) => vocabulary.prompt_special_tokens(),
            Encoding::Cl100kBase | Encoding::O200kBase => 0,
        }
    }

    /// The model's chat template, for a model's own tokenizer loaded with one.
    pub fn chat_template(self) -> Option<&'static ChatTemplate> {
        match self {
            Encoding::Model(vocabulary) => vocabulary.template(),
            Encoding::Cl100kBase | Encoding::O200kBase => None,
        }
    }

    /// Forces the lazily built tables so the first request does not pay for
    /// them (call at start-up).
    pub fn warm_up(self) {
        // Deserialising the BPE dictionary, indexing its entries and compiling the regexes
        // happen on first use; counting a small, varied text forces all of them.
        std::hint::black_box(self.count(std::hint::black_box(WARM_UP_TEXT)));
    }

    /// The built-in encodings' counters (a model's own counts by itself, in
    /// `count_till_limit`, before this is reached).
    fn counter(self) -> &'static Counter {
        match self {
            Encoding::Cl100kBase => &CL100K,
            Encoding::O200kBase => &O200K,
            Encoding::Model(vocabulary) => {
                unreachable!("{vocabulary:?} counts by itself, not with a built-in counter")
            }
        }
    }

    /// The `bpe-openai` tokenizer this encoding's [`Counter`] is built on; the tests hold the
    /// two to the same splits and counts.
    fn tokenizer(self) -> &'static Tokenizer {
        match self {
            Encoding::Cl100kBase => bpe_openai::cl100k_base(),
            Encoding::O200kBase => bpe_openai::o200k_base(),
            Encoding::Model(vocabulary) => {
                unreachable!("{vocabulary:?} is not built on bpe-openai")
            }
        }
    }
}

/// The pre-tokenisation patterns, exactly as `bpe-openai` 0.3 builds its tokenizers (tiktoken's
/// patterns with the negative look-ahead `\s+(?!\S)` rewritten as the pattern `\s+\s` whose
/// last character is given back). `tests.rs` checks that the splits equal `bpe-openai`'s.
const CL100K_PATTERNS: [&str; 3] = [
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+$",
    "\\s+\\s",
    "\\s+",
];
const O200K_PATTERNS: [&str; 3] = [
    concat!(
        "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        "|\\p{N}{1,3}",
        "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*",
        "|\\s*[\\r\\n]+",
        "|\\s+$",
    ),
    "\\s+\\s",
    "\\s+",
];
/// Index of the pattern whose match ends with one look-ahead character to give back.
const LOOKAHEAD_PATTERN: usize = 1;

static CL100K: LazyLock<Counter> = LazyLock::new(|| {
    Counter::new(
        Encoding::Cl100kBase,
        ascii::Split::CL100K,
        0,
        &CL100K_PATTERNS,
    )
});
static O200K: LazyLock<Counter> =
    LazyLock::new(|| Counter::new(Encoding::O200kBase, ascii::Split::O200K, 1, &O200K_PATTERNS));

thread_local! {
    /// One scratch per thread and encoding (indexed by the encoding), made on the thread's
    /// first count of that encoding.
    static SCRATCHES: RefCell<[Option<Scratch>; 2]> = const { RefCell::new([None, None]) };
}

/// What one thread's counting of one encoding keeps from piece to piece.
struct Scratch {
    /// The regex's search cache: the lazy DFA it holds warms up once per thread instead of
    /// being taken from and returned to a shared pool for every piece.
    search: Cache,
    /// The counts of short pieces counted lately.
    memo: PieceMemo,
}

/// Counts one encoding's tokens: pre-tokenise, then count each piece with `bpe`'s backtracking
/// encoder, except pieces that are a single vocabulary entry and short pieces the thread's
/// memo knows.
struct Counter {
    tokenizer: &'static Tokenizer,
    /// How `ascii` cuts ASCII text without the regex: as these patterns do.
    split: ascii::Split,
    /// Which of the thread's scratches is this counter's.
    scratch_index: usize,
    splitter: Regex,
    /// Every vocabulary entry's bytes (`entries`: packed, or borrowed from the `'static`
    /// tokenizer where longer than 15 bytes).
    whole_tokens: EntrySet,
}

impl Counter {
    fn new(
        encoding: Encoding,
        split: ascii::Split,
        scratch_index: usize,
        patterns: &[&str],
    ) -> Counter {
        let tokenizer = encoding.tokenizer();
        let bpe = &tokenizer.bpe;
        let whole_tokens = (0..bpe.num_tokens())
            .map(|id| bpe.token_bytes(id as u32))
            .collect();
        Counter {
            tokenizer,
            split,
            scratch_index,
            splitter: Regex::new_many(patterns).expect("the pre-tokenisation patterns compile"),
            whole_tokens,
        }
    }

    /// `Some(count)` if `text` has at most `limit` tokens, else `None`; see
    /// [`Encoding::count_till_limit`] for the early exit.
    fn count_till_limit(&self, text: &str, limit: usize) -> Option<usize> {
        SCRATCHES.with(|scratches| {
            let mut scratches = scratches.borrow_mut();
            let scratch = scratches[self.scratch_index].get_or_insert_with(|| Scratch {
                search: self.splitter.create_cache(),
                memo: PieceMemo::new(),
            });
            let bytes = text.as_bytes();
            let mut total = 0usize;
            let mut at = 0;
            while at < text.len() {
                let start = at;
                at += self.next_piece(&mut scratch.search, text, at).len();
                let piece = &bytes[start..at];
                let remaining = limit - total;
                let tokens = if piece.len() == 1 {
                    1
                } else if let Some(key) = entries::short_key_in(bytes, start, piece.len()) {
                    // A short piece: the memo first, then the entries or the encoder. Counted
                    // whole, not till the limit: at most 15 tokens, and the memo keeps it.
                    scratch.memo.get_or_count(key, || {
                        Some(if self.whole_tokens.contains_short(key) {
                            1
                        } else {
                            self.tokenizer.bpe.count(piece)
                        })
                    })?
                } else if self.whole_tokens.contains(piece) {
                    // Longer than 15 bytes: rare, and counted till the limit.
                    1
                } else {
                    // Charged first: a piece over the budget is not encoded at all.
                    if !charge_inline_budget(piece) {
                        return None;
                    }
                    self.tokenizer.bpe.count_till_limit(piece, remaining)?
                };
                if tokens > remaining {
                    return None;
                }
                total += tokens;
            }
            Some(total)
        })
    }

    /// The piece of `text` that starts at byte `at`, as `bpe-openai`'s splitter cuts it.
    #[inline]
    fn next_piece<'t>(&self, cache: &mut Cache, text: &'t str, at: usize) -> &'t [u8] {
        cut_piece(Some(self.split), &self.splitter, cache, &text[at..])
    }
}

/// What counting on this thread may still spend on long pieces (`within_inline_budget`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum InlineBudget {
    /// No budget: the counting threads, the benchmarks, the tests of counting itself.
    Unbounded,
    /// Cost units left (`inline_cost`).
    Left(usize),
    /// A piece would have gone past it: the count answered as if over its limit.
    Spent,
}

thread_local! {
    static INLINE_BUDGET: Cell<InlineBudget> = const { Cell::new(InlineBudget::Unbounded) };
}

/// Runs `count`, which counts with OpenAI's encodings on this thread, with `budget` cost units
/// for the long pieces the encoder works through (`inline_cost`): `Some` of what it returned,
/// or `None` if a piece would have gone past the budget. That piece was not encoded, and the
/// count stopped there as if over its limit, so what `count` returned is no answer and is
/// dropped; nothing was remembered of it (the piece memo keeps only whole counts, and the count
/// cache neither counts a stopped count as a lookup nor marks its text as seen).
///
/// For counting on an async worker, which every stream shares: a text's cost is not its size.
/// Long runs of `-`, `=`, `/` or `*` cost the encoder up to about a microsecond a byte, where
/// prose costs a few nanoseconds, so 16 KiB of them can hold a thread for 7 to 13 ms
/// (docs/benchmarks.md, "Costly text off the async workers"). A body whose text runs out of the
/// budget is counted on the counting threads instead. The budget lives with the thread for the
/// call, as tokio's cooperative budget lives with a task's poll, so the count loops need no
/// parameter for it. A model's own vocabulary is not charged: with one loaded, bodies of 16 KiB
/// or less are counted inline whatever their text (its slowest text measured, random letters,
/// at 77 to 106 ms per MiB: docs/benchmarks.md, "Open models' tokenizers").
pub fn within_inline_budget<T>(budget: usize, count: impl FnOnce() -> T) -> Option<T> {
    /// Puts the thread back to no budget however `count` ends (a panic included).
    struct Unbound;
    impl Drop for Unbound {
        fn drop(&mut self) {
            INLINE_BUDGET.set(InlineBudget::Unbounded);
        }
    }
    INLINE_BUDGET.set(InlineBudget::Left(budget));
    let _unbound = Unbound;
    let counted = count();
    (INLINE_BUDGET.get() != InlineBudget::Spent).then_some(counted)
}

/// Whether a count under `within_inline_budget` on this thread has been stopped by it.
fn inline_budget_spent() -> bool {
    INLINE_BUDGET.get() == InlineBudget::Spent
}

/// Charges a long piece about to be encoded to the thread's inline budget: false (and the
/// budget spent) if it would go past it.
#[inline]
fn charge_inline_budget(piece: &[u8]) -> bool {
    match INLINE_BUDGET.get() {
        InlineBudget::Unbounded => true,
        InlineBudget::Left(left) => {
            let cost = inline_cost(piece);
            if cost > left {
                INLINE_BUDGET.set(InlineBudget::Spent);
                false
            } else {
                INLINE_BUDGET.set(InlineBudget::Left(left - cost));
                true
            }
        }
        InlineBudget::Spent => false,
    }
}

/// What encoding a long piece (over 15 bytes, not one vocabulary entry) costs the inline
/// budget: a unit for each byte of ASCII punctuation, whose runs the encoder is slowest on (up
/// to 0.8 µs a byte: 1 MiB of `-` in 0.41 to 0.85 s), and a unit per 16 bytes of the rest:
/// letters, digits, other scripts (about 0.08 µs a byte at most: 1 MiB of random letters in 70
/// to 85 ms; docs/benchmarks.md, "Token counting"). So a word led by a `.` or ending in `'s`
/// costs about what the word does.
fn inline_cost(piece: &[u8]) -> usize {
    let punctuation = piece.iter().filter(|b| b.is_ascii_punctuation()).count();
    punctuation + (piece.len() - punctuation).div_ceil(16)
}

/// The piece at the start of `rest`: cut by `ascii` where `split` says how and the text there
/// is ASCII (a word first, inline: most pieces of ordinary text are one), else by `splitter`,
/// a regex built as `CL100K_PATTERNS` is. Both count loops (`Counter`, `ModelVocabulary`) cut
/// this way.
// Always inlined: the count loops are as fast as they were only with it in them.
#[inline(always)]
fn cut_piece<'t>(
    split: Option<ascii::Split>,
    splitter: &Regex,
    cache: &mut Cache,
    rest: &'t str,
) -> &'t [u8] {
    if let Some(split) = split {
        if let Some(len) = ascii::word_len(split, rest.as_bytes()) {
            return &rest.as_bytes()[..len];
        }
        if let Some(len) = ascii::piece_len_byte_by_byte(split, rest.as_bytes()) {
            return &rest.as_bytes()[..len];
        }
    }
    regex_piece(splitter, cache, rest)
}

/// The piece at the start of `rest`, found by a pre-tokenisation regex built as
/// `CL100K_PATTERNS` is: its second pattern stands for tiktoken's `\s+(?!\S)`.
fn regex_piece<'t>(splitter: &Regex, cache: &mut Cache, rest: &'t str) -> &'t [u8] {
    let found = splitter.search_with(cache, &Input::new(rest).anchored(Anchored::Yes));
    // One of the patterns matches any non-empty text at its start (`\s+` takes white
    // space, the first pattern everything else), so this is a safety net: count the rest
    // as one piece rather than loop.
    let Some(found) = found else {
        return rest.as_bytes();
    };
    let mut end = found.end();
    if found.pattern().as_usize() == LOOKAHEAD_PATTERN {
        // `\s+\s` stands for `\s+(?!\S)`: give the last white-space character back.
        let last = rest[..end].chars().next_back().map_or(0, char::len_utf8);
        end -= last;
    }
    if end == 0 {
        // Cannot happen for these patterns (the look-ahead one matches at least two
        // characters); never return an empty piece, which would not advance.
        end = rest.chars().next().map_or(rest.len(), char::len_utf8);
    }
    &rest.as_bytes()[..end]
}

/// Model-matching rule from config: a glob with `*` wildcards (e.g. "gpt-4o*",
/// "*-instruct") mapped to one of OpenAI's encodings, or to a model's own tokenizer files.
/// Exactly one of `encoding` and `tokenizer_file` (`policy` checks it).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EncodingRule {
    /// Glob over the model name; see [`glob_match`].
    pub pattern: String,
    /// One of OpenAI's encodings for models that match `pattern`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encoding: Option<Encoding>,
    /// A Hugging Face `tokenizer.json` (byte-level BPE: Llama 3, Qwen, Mistral's Tekken) for
    /// models that match `pattern`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer_file: Option<std::path::PathBuf>,
    /// The model's `tokenizer_config.json`, whose chat template frames chat requests as the
    /// model sees them. Without it, chats are framed by `tokens.per_message` and friends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template_file: Option<std::path::PathBuf>,
}

impl EncodingRule {
    /// A rule sending `pattern` to one of OpenAI's encodings.
    pub fn builtin(pattern: &str, encoding: Encoding) -> EncodingRule {
        EncodingRule {
            pattern: pattern.to_owned(),
            encoding: Some(encoding),
            tokenizer_file: None,
            chat_template_file: None,
        }
    }
}

/// A rule with its encoding resolved: a model's tokenizer loaded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelRule {
    /// Glob over the model name; see [`glob_match`].
    pub pattern: String,
    pub encoding: Encoding,
}

/// First matching rule wins, else Encoding::for_model_default.
pub fn encoding_for(model: &str, rules: &[ModelRule]) -> Encoding {
    rules
        .iter()
        .find(|rule| glob_match(&rule.pattern, model))
        .map_or_else(|| Encoding::for_model_default(model), |rule| rule.encoding)
}

/// Glob match with `*` (any run, including empty); no other metacharacters;
/// case-sensitive; linear-ish (no exponential backtracking).
///
/// The pattern is cut at each `*` into literal segments: the first must be a
/// prefix of `text`, the last a suffix, and the ones between must occur in
/// order in what is left. Taking the leftmost occurrence of each middle segment
/// is always safe (it leaves the most room for the rest), so there is no
/// backtracking and the cost is that of one substring search per segment.
/// Matching bytes rather than chars is sound because `*` is ASCII and UTF-8 is
/// self-synchronising: a literal segment can only match at char boundaries.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let Some((first, rest)) = pattern.split_once('*') else {
        return pattern == text;
    };
    let (middles, last) = rest.rsplit_once('*').unwrap_or(("", rest));
    if text.len() < first.len() + last.len() || !text.starts_with(first) || !text.ends_with(last) {
        return false;
    }
    let mut unmatched = &text[first.len()..text.len() - last.len()];
    for segment in middles.split('*').filter(|segment| !segment.is_empty()) {
        match unmatched.find(segment) {
            Some(at) => unmatched = &unmatched[at + segment.len()..],
            None => return false,
        }
    }
    true
}
