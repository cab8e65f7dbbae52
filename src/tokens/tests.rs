//! Unit tests for `tokens`: parity with tiktoken-rs (the reference
//! implementation of OpenAI's encodings) over a corpus that covers the
//! pre-tokeniser's corner cases and adversarial bodies, the inclusive boundary
//! of `count_till_limit`, model-to-encoding defaults and rules, and globbing.
//!
//! Nothing here measures time: linearity is checked by making sure huge
//! adversarial inputs finish and agree, never by asserting a duration.

use std::sync::LazyLock;

use tiktoken_rs::CoreBPE;

use super::*;

/// Reference encoders, built once: building one parses a whole vocabulary.
static TIKTOKEN_CL100K: LazyLock<CoreBPE> =
    LazyLock::new(|| tiktoken_rs::cl100k_base().expect("tiktoken-rs ships cl100k_base"));
static TIKTOKEN_O200K: LazyLock<CoreBPE> =
    LazyLock::new(|| tiktoken_rs::o200k_base().expect("tiktoken-rs ships o200k_base"));

const ENCODINGS: [Encoding; 2] = [Encoding::Cl100kBase, Encoding::O200kBase];

fn reference(encoding: Encoding) -> &'static CoreBPE {
    match encoding {
        Encoding::Cl100kBase => &TIKTOKEN_CL100K,
        Encoding::O200kBase => &TIKTOKEN_O200K,
        Encoding::Model(vocabulary) => panic!("no tiktoken reference for {vocabulary:?}"),
    }
}

/// Tiny deterministic generator (Knuth's MMIX LCG) so generated inputs are the
/// same on every run without a rand dependency.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        // The high bits of an LCG are the well-mixed ones.
        (self.0 >> 33) as u32
    }

    fn below(&mut self, bound: usize) -> usize {
        self.next() as usize % bound
    }

    fn pick<'a, T: ?Sized>(&mut self, items: &[&'a T]) -> &'a T {
        items[self.below(items.len())]
    }
}

/// A short, printable description of a possibly huge test input.
fn describe(text: &str) -> String {
    let head: String = text.chars().take(60).collect();
    format!("{head:?} ({} bytes)", text.len())
}

/// Asserts that both encodings count `text` exactly like tiktoken's
/// `encode_ordinary`, and that `count_till_limit` agrees at its boundary.
#[track_caller]
fn check_parity(text: &str) {
    for encoding in ENCODINGS {
        let expected = reference(encoding).encode_ordinary(text).len();
        let counted = encoding.count(text);
        assert_eq!(
            counted,
            expected,
            "{encoding:?} count differs from tiktoken for {}",
            describe(text)
        );
        check_limit_boundary(encoding, text, counted);
    }
}

/// `count_till_limit` is exact and inclusive: Some at the count, None one
/// below it. (Limits above the count, including `usize::MAX`, are in the
/// table test; repeating them for every corpus entry only costs time.)
#[track_caller]
fn check_limit_boundary(encoding: Encoding, text: &str, count: usize) {
    assert_eq!(
        encoding.count_till_limit(text, count),
        Some(count),
        "{encoding:?} count_till_limit at the count for {}",
        describe(text)
    );
    if count > 0 {
        assert_eq!(
            encoding.count_till_limit(text, count - 1),
            None,
            "{encoding:?} count_till_limit one below the count for {}",
            describe(text)
        );
    }
}

const PROSE: &[&str] = &[
    "The quick brown fox jumps over the lazy dog.",
    "It's a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife.",
    "She'll say they'd've known; I'M SURE WE'LL SEE. Don't, won't, can't, SHOULDN'T.",
    "Admission control decides, before a request reaches the model, whether it may proceed.\n\nFairness means each tenant gets its share.",
    "Naïve café owners in Zürich paid €1,234.56 for São Paulo's crème brûlée — really?",
    "Mr. O'Neil's dog (aged 3½) barked at 7:45 a.m.; nobody cared…",
];

const CODE: &[&str] = &[
    "fn main() {\n    let mut total: u64 = 0;\n    for i in 0..10 {\n        total += i * i;\n    }\n    println!(\"{total}\");\n}\n",
    "impl<'a, T: AsRef<str>> Iterator for Splits<'a, T> {\n\ttype Item = &'a str;\n\tfn next(&mut self) -> Option<Self::Item> { None }\n}",
    "def fib(n: int) -> int:\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\nif __name__ == '__main__':\n    print(fib(30))\n",
    "class Foo(Base):\n    def __init__(self, **kwargs):\n        super().__init__(**kwargs)\n        self._cache: dict[str, list[int]] = {}\n",
    "#!/usr/bin/env bash\nset -euo pipefail\nfor f in *.rs; do echo \"$f\" | sed -e 's/\\.rs$//'; done 2>&1 >/dev/null\n",
    "x=>{return a&&b||!c?d:e}//comment\n/* block */ a!==b; c>>>=2; path/to/file.rs:12:34",
];

const JSON: &[&str] = &[
    r#"{"model":"gpt-4o-mini","messages":[{"role":"system","content":"You are helpful."},{"role":"user","content":"Hi!"}],"max_tokens":256,"stream":true}"#,
    "{\n  \"id\": 12345678901234567890,\n  \"nested\": {\"a\": [1, 2.5, -3e10, null, true, false]},\n  \"escaped\": \"line\\nbreak \\u00e9 \\\"quoted\\\"\"\n}",
    r#"[{"k":"v"},{"k":"\ud83d\ude00"},{"":""},[],{}]"#,
];

const CJK: &[&str] = &[
    "我们的服务器会在请求到达模型之前决定是否放行。公平意味着每个租户都能获得自己的份额。",
    "吾輩は猫である。名前はまだ無い。どこで生れたかとんと見当がつかぬ。カタカナとひらがなと漢字。",
    "다람쥐 헌 쳇바퀴에 타고파. 안녕하세요, 세계! 한국어 토큰은 몇 개일까요?",
    "日本語とEnglishと中文が混ざったtext、全角　スペース、半角ｶﾀｶﾅ。",
];

const EMOJI: &[&str] = &[
    "😀😃😄😁😆😅🤣😂🙂🙃",
    "👨‍👩‍👧‍👦 family, 👩🏽‍💻 coder, 🏳️‍🌈 flag, 🧑🏿‍🤝‍🧑🏻 people",
    "🇺🇸🇯🇵🇩🇪🇫🇷🇬🇧🇨🇳🇰🇷 flags, 🏴󠁧󠁢󠁳󠁣󠁴󠁿 Scotland",
    "1️⃣ #️⃣ ❤️ ✌🏾 👍🏻👍🏼👍🏽👍🏾👍🏿",
];

const WHITESPACE: &[&str] = &[
    "",
    " ",
    "  ",
    "\n",
    "a  b   c    d",
    "trailing spaces    ",
    "    leading spaces",
    "tabs\t\t\tand\t \t mixes \r\n\r\n windows\r\rold mac",
    "\u{a0}non-breaking\u{a0}\u{a0}spaces\u{2003}em\u{3000}ideographic\u{200b}zero-width",
    " \n \n \n  \n\n   \t\n",
    "end with newline runs\n\n\n\n",
    "x \ny  \nz   \n",
];

const DIGITS: &[&str] = &[
    "0",
    "12",
    "123",
    "1234",
    "3.14159265358979323846264338327950288419716939937510",
    "phone: +1 (555) 123-4567, ids 0000123 and 99999999999",
    "١٢٣٤٥ ٦٧٨٩ Arabic-Indic digits and ⅷ Roman numerals",
];

const SPECIAL_TOKEN_TEXT: &[&str] = &[
    "<|endoftext|>",
    "before<|endoftext|>after <|endoftext|> <|fim_prefix|><|fim_middle|><|fim_suffix|>",
    "<|endofprompt|><|im_start|>user\nhi<|im_end|>",
    "<|endoftext",
    "|>",
];

const UNICODE_EDGES: &[&str] = &[
    // Decomposed é: NFC normalisation would change the count, tiktoken does not normalise.
    "cafe\u{301} re\u{301}sume\u{301}",
    "e\u{301}\u{302}\u{303}\u{304} stacked marks",
    "ภาษาไทยไม่มีช่องว่างระหว่างคำ",
    "Ελληνικά, Русский, עברית, العربية, हिन्दी, বাংলা",
    "\u{0}\u{1}\u{7f}\u{80}\u{ffff}\u{10ffff} controls and edges",
    "\u{feff}BOM and \u{fffd} replacement",
];

#[test]
fn parity_with_tiktoken_on_fixed_corpus() {
    for group in [
        PROSE,
        CODE,
        JSON,
        CJK,
        EMOJI,
        WHITESPACE,
        DIGITS,
        SPECIAL_TOKEN_TEXT,
        UNICODE_EDGES,
    ] {
        for text in group {
            check_parity(text);
        }
    }
}

#[test]
fn parity_with_tiktoken_on_concatenated_corpus() {
    // Pre-tokenisation boundaries between unlike kinds of text are where
    // regex differences would show, so glue the whole corpus together.
    let all: Vec<&str> = [
        PROSE,
        CODE,
        JSON,
        CJK,
        EMOJI,
        WHITESPACE,
        DIGITS,
        SPECIAL_TOKEN_TEXT,
        UNICODE_EDGES,
    ]
    .concat();
    check_parity(&all.concat());
    check_parity(&all.join("\n"));
    check_parity(&all.join(" "));
}

/// Fragments that exercise every alternative of the cl100k and o200k
/// pre-tokenisation regexes when glued together at random.
const FRAGMENTS: &[&str] = &[
    "a",
    "A",
    "word",
    "Word",
    "WORD",
    "camelCase",
    "snake_case",
    "'s",
    "'T",
    "'re",
    "'LL",
    "'d",
    "'ve",
    "'m",
    "'",
    "\"",
    "0",
    "42",
    "1234567",
    "3.14",
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\r\n",
    "\n\n",
    " \n",
    "\u{a0}",
    "\u{3000}",
    ".",
    ",",
    "!?",
    "...",
    "->",
    "::",
    "/",
    "//",
    "<|",
    "|>",
    "_",
    "__",
    "-",
    "--",
    "==",
    "{",
    "}",
    "()",
    "[]",
    "é",
    "e\u{301}",
    "ß",
    "Ω",
    "中",
    "文字",
    "カナ",
    "한",
    "😀",
    "👍🏽",
    "👨‍👩‍👧",
    "🇯🇵",
    "ก",
    "ไทย",
    "٣",
    "Ⅷ",
    "\u{200d}",
];

#[test]
fn parity_with_tiktoken_on_generated_strings() {
    let mut rng = Lcg(0x746f_6c6c_6761_7465);
    for _ in 0..400 {
        let pieces = 1 + rng.below(40);
        let text: String = (0..pieces).map(|_| rng.pick(FRAGMENTS)).collect();
        check_parity(&text);
    }
}

/// Random non-whitespace chars: the bytes 0x21..=0xff read as Latin-1 code
/// points (letters, digits, punctuation, accented letters, controls), so the
/// pre-tokeniser sees long runs of mixed classes with nowhere to split on.
fn random_bytes_as_chars(rng: &mut Lcg, len: usize) -> String {
    (0..len)
        .map(|_| char::from(0x21 + rng.below(0xff - 0x21 + 1) as u8))
        .filter(|c| !c.is_whitespace())
        .collect()
}

fn random_letters(rng: &mut Lcg, len: usize) -> String {
    (0..len)
        .map(|_| char::from(b'a' + rng.below(26) as u8))
        .collect()
}

/// Random code points from a few scripts, so multi-byte UTF-8 sequences meet
/// BPE merges across char boundaries.
fn random_unicode(rng: &mut Lcg, len: usize) -> String {
    const RANGES: &[(u32, u32)] = &[
        (0x20, 0x7e),
        (0xa0, 0x24f),
        (0x300, 0x36f),
        (0x400, 0x4ff),
        (0xe00, 0xe7f),
        (0x3040, 0x30ff),
        (0x4e00, 0x4fff),
        (0xac00, 0xacff),
        (0x1f300, 0x1f64f),
    ];
    (0..len)
        .filter_map(|_| {
            let (low, high) = RANGES[rng.below(RANGES.len())];
            char::from_u32(low + rng.below((high - low + 1) as usize) as u32)
        })
        .collect()
}

#[test]
fn parity_with_tiktoken_on_random_text() {
    let mut rng = Lcg(42);
    for len in [1, 2, 3, 5, 8, 13, 100, 1_000, 10_000] {
        check_parity(&random_bytes_as_chars(&mut rng, len));
        check_parity(&random_letters(&mut rng, len));
        check_parity(&random_unicode(&mut rng, len));
    }
}

/// 100 KB bodies built to defeat pre-tokenisation: each is one or a few huge
/// pieces, which is where a non-linear BPE merge would blow up.
#[test]
fn parity_with_tiktoken_on_adversarial_bodies() {
    const SIZE: usize = 100_000;
    let mut rng = Lcg(7);
    let bodies = [
        "a".repeat(SIZE),
        "_".repeat(SIZE),
        random_bytes_as_chars(&mut rng, SIZE),
        random_letters(&mut rng, SIZE),
        " ".repeat(SIZE),
        " ".repeat(SIZE) + "x",
        "\n".repeat(SIZE),
        "\n\n\nword".repeat(SIZE / 7),
    ];
    for body in &bodies {
        check_parity(body);
    }
}

/// Smaller bodies of other shapes that stress the pre-tokeniser (runs of
/// digits, alternating whitespace, multi-byte chars) at a size that keeps the
/// debug-build test quick.
#[test]
fn parity_with_tiktoken_on_other_long_pieces() {
    const SIZE: usize = 20_000;
    let mut rng = Lcg(11);
    let bodies = [
        "9".repeat(SIZE),
        "  x".repeat(SIZE / 3),
        " \t".repeat(SIZE / 2) + "end",
        "ab".repeat(SIZE / 2),
        "😀".repeat(SIZE / 4),
        "中".repeat(SIZE / 3),
        random_unicode(&mut rng, SIZE),
    ];
    for body in &bodies {
        check_parity(body);
    }
}

/// Runs of `-`, `/`, `#`, `=` and `*` are what the backtracking encoder finds
/// hardest: both vocabularies hold long tokens of them (80 to 112 bytes), so
/// it tries and abandons many candidates per position. That is
/// also where its working stack could overshoot the final count, so check
/// parity and the limit boundary at lengths around every such token length.
#[test]
fn parity_and_limit_boundary_on_long_token_runs() {
    let lengths = (1..=20).chain([
        31, 32, 33, 47, 48, 49, 63, 64, 65, 71, 72, 73, 75, 76, 77, 79, 80, 81, 95, 96, 97, 111,
        112, 113, 127, 128, 129, 143, 144, 145, 200, 255, 256, 257, 1_000,
    ]);
    for length in lengths {
        for unit in ["-", "/", "#", "=", "*"] {
            check_parity(&unit.repeat(length));
        }
    }
}

static SPACES_256: LazyLock<String> = LazyLock::new(|| " ".repeat(2 * MAX_TOKEN_BYTES));
static SPACES_257: LazyLock<String> = LazyLock::new(|| " ".repeat(2 * MAX_TOKEN_BYTES + 1));

#[test]
fn count_till_limit_table() {
    use Encoding::*;
    // (encoding, text, limit, expected)
    let cases: &[(Encoding, &str, usize, Option<usize>)] = &[
        // "abc" is one cl100k token, so "abc" * k is k tokens in one piece.
        (Cl100kBase, "abcabcabc", 4, Some(3)),
        (Cl100kBase, "abcabcabc", 3, Some(3)),
        (Cl100kBase, "abcabcabc", 2, None),
        (Cl100kBase, "abcabcabcabc", 3, None),
        (Cl100kBase, "hello world", 2, Some(2)),
        (Cl100kBase, "hello world", 1, None),
        (O200kBase, "hello world", 2, Some(2)),
        (O200kBase, "hello world", 1, None),
        // Limit 0: only the empty text fits.
        (Cl100kBase, "", 0, Some(0)),
        (O200kBase, "", 0, Some(0)),
        (Cl100kBase, "a", 0, None),
        (O200kBase, "a", 0, None),
        (Cl100kBase, " ", 0, None),
        // 128 spaces are one token in both vocabularies, the longest there is,
        // so these sit exactly on the byte-length bound that lets
        // count_till_limit answer None without encoding.
        (Cl100kBase, &SPACES_256, 2, Some(2)),
        (O200kBase, &SPACES_256, 2, Some(2)),
        (Cl100kBase, &SPACES_257, 2, None),
        (O200kBase, &SPACES_257, 2, None),
        (Cl100kBase, &SPACES_257, 3, Some(3)),
        (O200kBase, &SPACES_257, 3, Some(3)),
        // Empty text fits any limit.
        (Cl100kBase, "", 5, Some(0)),
        (O200kBase, "", usize::MAX, Some(0)),
        (Cl100kBase, "hello world", usize::MAX, Some(2)),
    ];
    for &(encoding, text, limit, expected) in cases {
        assert_eq!(
            encoding.count_till_limit(text, limit),
            expected,
            "{encoding:?} count_till_limit({}, {limit})",
            describe(text)
        );
    }
    // The expectations above for the space runs assume tiktoken's counts.
    check_parity(&SPACES_256);
    check_parity(&SPACES_257);
}

/// `count_till_limit` relies on `bpe` giving up only once its working stack
/// exceeds the budget by more than 10 tokens; if a stack could overshoot the
/// final count by more, a text of exactly `limit` tokens would be rejected.
/// Every vocabulary entry on its own is the hardest such case we know of, so
/// check each one at exactly its own count (this guards `bpe` upgrades). The
/// same walk checks `MAX_TOKEN_BYTES`, which the byte-length shortcut relies on.
#[test]
fn count_till_limit_is_exact_for_every_vocabulary_entry() {
    for encoding in ENCODINGS {
        let bpe = &encoding.tokenizer().bpe;
        for id in 0..bpe.num_tokens() {
            let id = u32::try_from(id).expect("vocabularies have fewer than 2^32 entries");
            let bytes = bpe.token_bytes(id);
            assert!(
                bytes.len() <= MAX_TOKEN_BYTES,
                "{encoding:?} token {id} is {} bytes long",
                bytes.len()
            );
            let count = bpe.count(bytes);
            assert_eq!(
                bpe.count_till_limit(bytes, count),
                Some(count),
                "{encoding:?} token {id} ({:?})",
                String::from_utf8_lossy(bytes)
            );
        }
    }
}

/// Counting 1 MB with no whitespace must finish (a quadratic merge would not,
/// in a debug build) and the two entry points must agree; the exactness of the
/// same code path on adversarial input is covered against tiktoken at 100 KB.
#[test]
fn megabyte_without_whitespace_is_counted() {
    let body = "a".repeat(1 << 20);
    for encoding in ENCODINGS {
        let count = encoding.count(&body);
        assert_eq!(
            encoding.count_till_limit(&body, usize::MAX),
            Some(count),
            "{encoding:?}"
        );
        assert_eq!(
            encoding.count_till_limit(&body, 16_000),
            None,
            "{encoding:?}"
        );
        // A single piece is bounded below by its byte length over the
        // longest token, so it cannot be tiny.
        assert!(
            count >= body.len() / MAX_TOKEN_BYTES,
            "{encoding:?} counted {count}"
        );
    }
    let smaller = "a".repeat(50_000);
    for encoding in ENCODINGS {
        assert_eq!(
            encoding.count(&smaller),
            reference(encoding).encode_ordinary(&smaller).len(),
            "{encoding:?}"
        );
    }
}

#[test]
fn warm_up_leaves_counts_unchanged() {
    for encoding in ENCODINGS {
        encoding.warm_up();
        encoding.warm_up();
        check_parity(WARM_UP_TEXT);
    }
}

#[test]
fn for_model_default_table() {
    use Encoding::*;
    let cases: &[(&str, Encoding)] = &[
        ("gpt-4o", O200kBase),
        ("gpt-4o-mini", O200kBase),
        ("gpt-4o-2024-08-06", O200kBase),
        ("chatgpt-4o-latest", O200kBase),
        ("gpt-4.1", O200kBase),
        ("gpt-4.1-nano", O200kBase),
        ("gpt-5", O200kBase),
        ("gpt-5-mini", O200kBase),
        ("o1", O200kBase),
        ("o1-preview", O200kBase),
        ("o3-mini", O200kBase),
        ("o4-mini", O200kBase),
        ("gpt-4", Cl100kBase),
        ("gpt-4-turbo", Cl100kBase),
        ("gpt-4-0613", Cl100kBase),
        ("gpt-3.5-turbo", Cl100kBase),
        ("text-embedding-3-small", Cl100kBase),
        ("llama-3", Cl100kBase),
        ("mistral-7b-instruct", Cl100kBase),
        ("", Cl100kBase),
        // Case-sensitive, and a prefix must be a prefix.
        ("GPT-4o", Cl100kBase),
        ("my-gpt-4o", Cl100kBase),
        ("o2", Cl100kBase),
    ];
    for &(model, expected) in cases {
        assert_eq!(Encoding::for_model_default(model), expected, "{model:?}");
    }
}

fn rule(pattern: &str, encoding: Encoding) -> ModelRule {
    ModelRule {
        pattern: pattern.to_owned(),
        encoding,
    }
}

#[test]
fn encoding_for_table() {
    use Encoding::*;
    let rules = [
        rule("llama-3*", O200kBase),
        rule("gpt-4o-legacy*", Cl100kBase),
        rule("*-instruct", O200kBase),
        rule("*-instruct", Cl100kBase),
    ];
    let cases: &[(&str, &[ModelRule], Encoding)] = &[
        // No rules: the defaults.
        ("gpt-4o-mini", &[], O200kBase),
        ("llama-3", &[], Cl100kBase),
        // A rule overrides the default, in both directions.
        ("llama-3", &rules, O200kBase),
        ("llama-3.1-70b", &rules, O200kBase),
        ("gpt-4o-legacy-2024", &rules, Cl100kBase),
        // First matching rule wins over later ones that also match.
        ("mistral-7b-instruct", &rules, O200kBase),
        // No rule matches: the default.
        ("gpt-4o-mini", &rules, O200kBase),
        ("gpt-4", &rules, Cl100kBase),
    ];
    for &(model, rules, expected) in cases {
        assert_eq!(
            encoding_for(model, rules),
            expected,
            "{model:?} with {rules:?}"
        );
    }
}

#[test]
fn encoding_rule_serde() {
    let parsed: EncodingRule =
        serde_json::from_str(r#"{"pattern": "gpt-4o*", "encoding": "o200k_base"}"#)
            .expect("valid rule parses");
    assert_eq!(
        parsed,
        EncodingRule::builtin("gpt-4o*", Encoding::O200kBase)
    );
    let written = serde_json::to_string(&EncodingRule::builtin("*", Encoding::Cl100kBase))
        .expect("serialises");
    assert_eq!(written, r#"{"pattern":"*","encoding":"cl100k_base"}"#);
    let parsed: EncodingRule = serde_json::from_str(
        r#"{"pattern": "qwen*", "tokenizer_file": "/t/tokenizer.json", "chat_template_file": "/t/tokenizer_config.json"}"#,
    )
    .expect("a rule naming a model's files parses");
    assert_eq!(
        parsed.tokenizer_file.as_deref(),
        Some(std::path::Path::new("/t/tokenizer.json"))
    );
    assert_eq!(parsed.encoding, None);
    for invalid in [
        r#"{"pattern": "x", "encoding": "o200k_base", "extra": 1}"#,
        r#"{"pattern": "x", "encoding": "O200kBase"}"#,
        r#"{"pattern": "x", "encoding": "p50k_base"}"#,
        // A model's tokenizer is named by its file, never as an encoding value.
        r#"{"pattern": "x", "encoding": "model"}"#,
    ] {
        assert!(
            serde_json::from_str::<EncodingRule>(invalid).is_err(),
            "{invalid} should be rejected"
        );
    }
}

#[test]
fn glob_match_table() {
    // (pattern, text, expected)
    let cases: &[(&str, &str, bool)] = &[
        ("", "", true),
        ("", "a", false),
        ("*", "", true),
        ("*", "anything at all", true),
        ("**", "", true),
        ("gpt-4", "gpt-4", true),
        ("gpt-4", "gpt-4o", false),
        ("gpt-4", "GPT-4", false),
        ("gpt-4o*", "gpt-4o", true),
        ("gpt-4o*", "gpt-4o-mini", true),
        ("gpt-4o*", "gpt-4", false),
        ("gpt-4o*", "xgpt-4o", false),
        ("*-instruct", "mistral-7b-instruct", true),
        ("*-instruct", "-instruct", true),
        ("*-instruct", "mistral-7b-instruct-v2", false),
        ("*mini*", "o3-mini", true),
        ("*mini*", "gpt-4o-mini-2024", true),
        ("*mini*", "gpt-4o", false),
        ("a*b*c", "abc", true),
        ("a*b*c", "a-b-c", true),
        ("a*b*c", "acb", false),
        ("a*b*c", "abcbc", true),
        ("a*b*c", "abcb", false),
        // Prefix and suffix must not overlap.
        ("ab*ba", "aba", false),
        ("ab*ba", "abba", true),
        ("a*a", "a", false),
        ("a*a", "aa", true),
        ("a**b", "ab", true),
        ("*a*a*a*", "aaa", true),
        ("*a*a*a*", "aa", false),
        // Only `*` is special.
        ("gpt-?", "gpt-4", false),
        ("gpt-?", "gpt-?", true),
        ("[a-z]*", "abc", false),
        ("[a-z]*", "[a-z]", true),
        ("a.c", "abc", false),
        // Multi-byte text and patterns.
        ("模型*", "模型-大", true),
        ("*大", "模型-大", true),
        ("*é*", "café au lait", true),
        ("*é", "cafe\u{301}", false),
    ];
    for &(pattern, text, expected) in cases {
        assert_eq!(
            glob_match(pattern, text),
            expected,
            "glob_match({pattern:?}, {text:?})"
        );
    }
}

/// The classic exponential-backtracking input for naive globbers; the
/// segment-search algorithm answers it after one substring search per `*`.
#[test]
fn glob_match_does_not_backtrack_exponentially() {
    let text = "a".repeat(10_000);
    let pattern = format!("{}b", "a*".repeat(50));
    assert!(!glob_match(&pattern, &text));
    assert!(glob_match(&"a*".repeat(50), &text));
}

/// `Counter` pre-tokenises with its own copy of `bpe-openai`'s patterns and its own search
/// cache: its pieces must be exactly `bpe-openai`'s, on every corpus above and on random text.
#[test]
fn pieces_equal_bpe_openai_splits() {
    let mut rng = Lcg(7);
    let mut texts: Vec<String> = [
        PROSE,
        CODE,
        JSON,
        CJK,
        EMOJI,
        WHITESPACE,
        DIGITS,
        SPECIAL_TOKEN_TEXT,
        UNICODE_EDGES,
        FRAGMENTS,
    ]
    .concat()
    .iter()
    .map(|text| text.to_string())
    .collect();
    for _ in 0..200 {
        let pieces = 1 + rng.below(40);
        texts.push((0..pieces).map(|_| rng.pick(FRAGMENTS)).collect());
    }
    for len in [1, 7, 100, 5_000] {
        texts.push(random_bytes_as_chars(&mut rng, len));
        texts.push(random_unicode(&mut rng, len));
    }
    for encoding in ENCODINGS {
        let counter = encoding.counter();
        let mut cache = counter.splitter.create_cache();
        for text in &texts {
            let expected: Vec<&[u8]> = encoding
                .tokenizer()
                .split(text)
                .map(str::as_bytes)
                .collect();
            let mut pieces = Vec::new();
            let mut at = 0;
            while at < text.len() {
                let piece = counter.next_piece(&mut cache, text, at);
                at += piece.len();
                pieces.push(piece);
            }
            assert_eq!(
                pieces,
                expected,
                "{encoding:?} pieces of {}",
                describe(text)
            );
        }
    }
}

/// The single-entry shortcut: a piece that is a whole vocabulary entry counts 1, as tiktoken
/// counts it, including entries that the backtracking encoder reaches only through merges.
#[test]
fn whole_vocabulary_entries_count_one() {
    for encoding in ENCODINGS {
        let counter = encoding.counter();
        let bpe = &encoding.tokenizer().bpe;
        assert_eq!(counter.whole_tokens.len(), bpe.num_tokens(), "{encoding:?}");
        for id in (0..bpe.num_tokens() as u32).step_by(97) {
            let bytes = bpe.token_bytes(id);
            assert_eq!(bpe.count(bytes), 1, "{encoding:?} entry {id} is one token");
        }
    }
}

/// A pre-tokenizer `ascii` cuts for: the regex it stands in for, and how it cuts.
struct Splitter {
    name: &'static str,
    regex: Regex,
    split: ascii::Split,
}

/// Every pre-tokenizer `ascii` knows: OpenAI's two, as their counters build them, and the open
/// models' regexes (`ascii::MODEL_PATTERNS`), as a model's vocabulary builds them.
fn splitters() -> Vec<Splitter> {
    let builtin = ENCODINGS.map(|encoding| {
        let counter = encoding.counter();
        Splitter {
            name: if encoding == Encoding::Cl100kBase {
                "cl100k_base"
            } else {
                "o200k_base"
            },
            regex: counter.splitter.clone(),
            split: counter.split,
        }
    });
    let models = ascii::MODEL_PATTERNS.iter().map(|known| {
        let found = ascii::ModelPattern::known(known.pattern).map(|found| found.name);
        assert_eq!(found, Some(known.name));
        Splitter {
            name: known.name,
            regex: model::splitter(known.pattern).expect("a known pattern builds"),
            split: known.split,
        }
    });
    // A regex that differs by a character is not one `ascii` knows: the regex cuts it.
    let llama3 = ascii::MODEL_PATTERNS[0].pattern;
    assert!(ascii::ModelPattern::known(&llama3.replace("{1,3}", "{1,2}")).is_none());
    builtin.into_iter().chain(models).collect()
}

/// Walks `text` piece by piece as the regex cuts it and checks that `shortcut` (one of
/// `ascii`'s) cuts each piece it answers for exactly there; how many it answered.
#[track_caller]
fn shortcut_agrees_with_regex(
    splitter: &Splitter,
    cache: &mut Cache,
    text: &str,
    shortcut: fn(ascii::Split, &[u8]) -> Option<usize>,
) -> usize {
    let mut answered = 0;
    let mut at = 0;
    while at < text.len() {
        let rest = &text[at..];
        let expected = regex_piece(&splitter.regex, cache, rest);
        if let Some(len) = shortcut(splitter.split, rest.as_bytes()) {
            assert_eq!(
                &rest.as_bytes()[..len],
                expected,
                "{}: piece at byte {at} of {text:?}",
                splitter.name
            );
            answered += 1;
        }
        at += expected.len();
    }
    answered
}

/// The ASCII fast path (`ascii::piece_len`) cuts exactly where the regex does, for OpenAI's
/// encodings and for each open model's regex it knows (whose digits go one at a time, or whose
/// words take no contraction: a digit run and a word before `'s` tell those apart). Random text
/// from an alphabet that crosses every class boundary the patterns draw: both letter cases
/// and contractions, digits, each kind of ASCII white space, symbols, control bytes, and the
/// non-ASCII characters that could continue or end an ASCII piece (letters of each case,
/// titlecase and modifier letters, a combining mark, `ſ`, which `(?i)s` matches, a digit of
/// another script, non-ASCII spaces and symbols).
#[test]
fn ascii_fast_path_cuts_where_the_regex_does() {
    const ALPHABET: &[&str] = &[
        "a", "z", "A", "Z", "s", "S", "t", "T", "r", "R", "e", "E", "v", "l", "L", "m", "d", "D",
        "x", "'", "'", "0", "7", " ", " ", "\t", "\n", "\r", "\x0b", "\x0c", "/", "!", ".", "-",
        "_", "\x00", "\x1f", "\x7f", "é", "É", "ſ", "\u{301}", "ǅ", "ʰ", "日", "٣", "\u{a0}",
        "\u{3000}", "\u{85}", "€", "😀",
    ];
    let mut rng = Lcg(11);
    for splitter in splitters() {
        let mut cache = splitter.regex.create_cache();
        let mut fast_pieces = 0;
        for _ in 0..40_000 {
            let len = 1 + rng.below(16);
            let text: String = (0..len).map(|_| rng.pick(ALPHABET)).collect();
            fast_pieces +=
                shortcut_agrees_with_regex(&splitter, &mut cache, &text, ascii::piece_len);
        }
        // The fast path must actually have answered, or the comparison proves nothing.
        assert!(fast_pieces > 50_000, "{}: {fast_pieces}", splitter.name);
    }
}

/// The word shortcut (`ascii::word_len`, eight bytes at a time) cuts exactly where the regex
/// does, and counts through it are tiktoken's. Words of 1 to 20 letters, so they end within
/// the first eight-byte load, a later one or past the last whole one; lower case, upper case,
/// capitalized and mixed; with a space before them or not; each followed by a byte that may
/// or may not end one: a contraction, a non-ASCII letter, mark or space, a digit, a symbol,
/// white space, the other case, or the text's end.
#[test]
fn word_shortcut_cuts_where_the_regex_does() {
    const AFTER: &[&str] = &[
        "",
        "",
        " ",
        ",",
        ".",
        "'",
        "'s",
        "'LL",
        "\u{2019}",
        "\n",
        "\r\n",
        "\t",
        "0",
        "42",
        "\u{e9}",
        "\u{c9}",
        "\u{17f}",
        "\u{301}",
        "\u{2b0}",
        "\u{65e5}",
        "\u{a0}",
        "-",
        "_",
        "/",
        "A",
        "a",
        "\u{1f600}",
    ];
    let mut rng = Lcg(17);
    for (round_of, splitter) in splitters().iter().enumerate() {
        let mut cache = splitter.regex.create_cache();
        let mut words = 0;
        for round in 0..20_000 {
            let mut text = String::new();
            for _ in 0..1 + rng.below(6) {
                if rng.below(3) > 0 {
                    text.push(' ');
                }
                let len = 1 + rng.below(20);
                let case = rng.below(4);
                for i in 0..len {
                    let letter = char::from(b'a' + rng.below(26) as u8);
                    let upper = match case {
                        0 => false,
                        1 => true,
                        2 => i == 0,
                        _ => rng.below(2) == 0,
                    };
                    text.push(if upper {
                        letter.to_ascii_uppercase()
                    } else {
                        letter
                    });
                }
                text.push_str(rng.pick(AFTER));
            }
            words += shortcut_agrees_with_regex(splitter, &mut cache, &text, ascii::word_len);
            // tiktoken is slow to build per text: every 20th, both encodings (once).
            if round_of == 0 && round % 20 == 0 {
                check_parity(&text);
            }
        }
        // The shortcut must actually have answered, or the comparison proves nothing.
        // (About 22,000 pieces for cl100k, whose words run through both cases, and 62,000 for
        // o200k, which cuts them where a capital follows lower case.)
        assert!(words > 15_000, "{}: {words}", splitter.name);
    }
}

/// The request path's cached count gives the plain count's answer at every limit, whether
/// the text is counted or found: each corpus glued together, over and under the cache's
/// minimum, in both encodings, and the two encodings kept apart.
#[test]
fn cached_count_answers_as_the_count_does() {
    let corpus: Vec<&str> = [PROSE, CODE, JSON, CJK, EMOJI, WHITESPACE, DIGITS].concat();
    let glued = corpus.join("\n");
    let texts = [
        glued.clone(),
        glued[..(0..count_cache::MIN_CACHED_BYTES)
            .rev()
            .find(|&end| glued.is_char_boundary(end))
            .unwrap_or(0)]
            .to_owned(),
        format!("{glued} and a tail only this text has"),
        PROSE.concat().repeat(8),
    ];
    // A cache of the test's own: the process's is shared with the tests running beside it.
    let cache = count_cache::CountCache::new(32 << 20);
    let scope = CountScope::of("alice");
    for text in &texts {
        for encoding in ENCODINGS {
            let count = encoding.count(text);
            // The plain count's answer on every call: counted (the first two: a text is kept
            // when it comes back), then found, over the limit and under it.
            for limit in [usize::MAX, count + 1, count, count - 1, count / 2, 0] {
                for call in ["first", "second", "third"] {
                    assert_eq!(
                        encoding.count_till_limit_in(&cache, scope, text, limit),
                        encoding.count_till_limit(text, limit),
                        "{encoding:?}, {} bytes, limit {limit} of {count}, {call} call",
                        text.len()
                    );
                }
            }
        }
    }
    // Per long text and encoding, every call from the third on is found, but those at limit
    // 0, which the length alone refuses: 13 of the 18.
    assert_eq!(cache.stats().found, 13 * 3 * 2);
    assert_ne!(
        Encoding::Cl100kBase.count(&glued),
        Encoding::O200kBase.count(&glued),
        "the corpus must tell the encodings apart for the check above to mean anything"
    );
}

/// The per-thread memo of short pieces' counts answers as the encoder does when a piece comes
/// back: texts of words drawn from a pool of 400 (most of them several tokens: random letters,
/// digits, a capital or an apostrophe), so from the first text's second count on (`check_parity`
/// counts each text three times per encoding) nearly every piece is answered by the memo, and thousands of distinct pieces contend for its slots. Each text's
/// count is tiktoken's, and `count_till_limit` agrees at its boundary with the memo warm.
#[test]
fn memo_counts_come_back_exact() {
    let mut rng = Lcg(7);
    let pool: Vec<String> = (0..400)
        .map(|n| {
            let len = 2 + rng.below(11);
            let letters = random_letters(&mut rng, len);
            match n % 5 {
                0 => format!(" {letters}"),
                1 => format!(" {}{}", letters[..1].to_uppercase(), &letters[1..]),
                2 => format!("{letters}'s"),
                3 => format!(" {}", rng.below(1_000_000)),
                _ => letters,
            }
        })
        .collect();
    for _ in 0..30 {
        let text: String = (0..300)
            .map(|_| pool[rng.below(pool.len())].as_str())
            .collect();
        check_parity(&text);
    }
}

/// Counting under an inline budget answers as counting without one, or not at all once the long
/// pieces it encodes would cost more than the budget; either way the thread has no budget
/// afterwards, and a stopped count leaves nothing in the count cache: no lookup, and its text
/// not marked as seen (so a one-off text is not kept when it is counted again off the workers).
#[test]
fn an_inline_budget_stops_a_count_at_the_piece_that_would_overspend_it() {
    let words = "lorem ipsum dolor sit amet ".repeat(600);
    // Long pieces of letters (made up, so not vocabulary entries): a unit per 16 bytes.
    let long_words = "qwzxkvbnmpqwzxkvbnmpqwzxkvbnmpqw ".repeat(100);
    // The first run of 16 `=` is a vocabulary entry, which costs nothing; every run after it
    // takes the space before it, a piece of 17 bytes of punctuation that is no entry: 17 units.
    let runs_of = |n: usize| "================ ".repeat(n);
    // (what, text, budget, counted under it)
    let table: [(&str, String, usize, bool); 8] = [
        ("prose, no long piece", words.clone(), 0, true),
        ("long words within", long_words.clone(), 512, true),
        (
            "long words past a small budget",
            long_words.clone(),
            100,
            false,
        ),
        ("31 runs of 16 within 512 (510)", runs_of(31), 512, true),
        ("32 runs of 16 past 512 (527)", runs_of(32), 512, false),
        ("one run of 600 dashes", "-".repeat(600), 512, false),
        (
            "one run of 600 dashes, a larger budget",
            "-".repeat(600),
            600,
            true,
        ),
        (
            "dashes after prose",
            words.clone() + &"-".repeat(4096),
            512,
            false,
        ),
    ];
    let scope = CountScope::of("alice");
    for encoding in ENCODINGS {
        for (what, text, budget, within) in &table {
            let plain = encoding.count(text);
            // A cache of the row's own, every text over its 512 bytes: the count under the
            // budget is the text's first lookup.
            let cache = count_cache::CountCache::new(32 << 20);
            let lookup = || encoding.count_till_limit_in(&cache, scope, text, usize::MAX);
            let under_budget = within_inline_budget(*budget, lookup);
            assert_eq!(INLINE_BUDGET.get(), InlineBudget::Unbounded, "{what}");
            if *within {
                assert_eq!(under_budget, Some(Some(plain)), "{encoding:?}: {what}");
                assert_eq!(cache.stats().counted, 1, "{encoding:?}: {what}");
                continue;
            }
            assert_eq!(under_budget, None, "{encoding:?}: {what}");
            assert_eq!(
                cache.stats().counted,
                0,
                "{encoding:?}: {what}: a stopped count is no lookup"
            );
            // Asked again off the workers: counted as a first sighting, so not kept until a
            // second.
            assert_eq!(lookup(), Some(plain), "{encoding:?}: {what}");
            assert_eq!(
                (cache.stats().counted, cache.stats().bytes),
                (1, 0),
                "{encoding:?}: {what}: the stopped count did not mark the text as seen"
            );
            assert_eq!(lookup(), Some(plain), "{encoding:?}: {what}");
            assert_eq!(cache.stats().bytes, text.len() as u64, "{what}: kept now");
        }
    }
}

#[test]
fn the_inline_cost_of_a_piece_is_a_unit_a_punctuation_byte_and_one_per_16_others() {
    // (piece, cost)
    let table: [(&[u8], usize); 8] = [
        (b"----------------", 16),
        (b" ================", 17),
        (b"-=-=-=-=-=-=-=-=-=-=", 20),
        (b"abcdefghijklmnop", 1),
        (b"abcdefghijklmnopq", 2),
        (b"internationalization's", 1 + 2),
        (b".getElementsByTagName", 1 + 2),
        ("日本語のテキスト".as_bytes(), 2),
    ];
    for (piece, cost) in table {
        assert_eq!(
            inline_cost(piece),
            cost,
            "{}",
            String::from_utf8_lossy(piece)
        );
    }
}
