//! Unit tests for `request`: `classify_head` (routing, identity, tiers, API keys, header checks)
//! and `parse_body` (OpenAI body validation, and input counts that match tiktoken plus OpenAI's
//! chat framing).
//!
//! Requests are written as text, like on the wire: a `METHOD PATH` line, then `name: value`
//! header lines (names lowercase, as Envoy sends them).

use std::sync::LazyLock;

use tiktoken_rs::CoreBPE;

use super::*;
use crate::config::{ApiKeyConfig, Config};
use crate::tokens::EncodingRule;

static TIKTOKEN_CL100K: LazyLock<CoreBPE> =
    LazyLock::new(|| tiktoken_rs::cl100k_base().expect("tiktoken-rs ships cl100k_base"));
static TIKTOKEN_O200K: LazyLock<CoreBPE> =
    LazyLock::new(|| tiktoken_rs::o200k_base().expect("tiktoken-rs ships o200k_base"));

/// Reference counts.
fn o200k(text: &str) -> u32 {
    TIKTOKEN_O200K.encode_ordinary(text).len() as u32
}

fn cl100k(text: &str) -> u32 {
    TIKTOKEN_CL100K.encode_ordinary(text).len() as u32
}

/// OpenAI's chat framing, as configured by default.
const PER_MESSAGE: u32 = 3;
const PER_NAME: u32 = 1;
const REPLY_PRIMING: u32 = 3;
const PER_IMAGE: u32 = 765;

fn policy_with(edit: impl FnOnce(&mut Config)) -> Policy {
    let mut config = Config::default();
    edit(&mut config);
    Policy::from_config(&config).expect("a valid test policy")
}

static DEFAULT_POLICY: LazyLock<Policy> = LazyLock::new(|| policy_with(|_| {}));

/// Keys configured in `KEYED_POLICY`: plaintext, tenant, tier.
const KEYS: &[(&str, &str, Option<&str>)] = &[
    ("sk-alice", "alice-by-key", Some("premium")),
    ("sk-bob", "bob-by-key", None),
];

/// `KEYS` as configuration.
static KEYS_CONFIG: LazyLock<Vec<ApiKeyConfig>> = LazyLock::new(|| {
    use sha2::Digest;
    KEYS.iter()
        .map(|(key, tenant, tier)| ApiKeyConfig {
            sha256: hex::encode(sha2::Sha256::digest(key.as_bytes())),
            tenant: (*tenant).to_owned(),
            tier: tier.map(str::to_owned),
        })
        .collect()
});

static KEYED_POLICY: LazyLock<Policy> =
    LazyLock::new(|| policy_with(|c| c.identity.api_keys = KEYS_CONFIG.clone()));

// ---------------------------------------------------------------------------------------------
// classify_head

/// Splits a request written as text into (name, value) pairs, pseudo-headers first.
fn header_pairs(request: &str) -> Vec<(String, Vec<u8>)> {
    let mut lines = request.lines();
    let start = lines.next().expect("a request line");
    let (method, path) = start.split_once(' ').expect("METHOD PATH");
    let mut pairs = vec![
        (":method".to_owned(), method.as_bytes().to_vec()),
        (":path".to_owned(), path.as_bytes().to_vec()),
    ];
    for line in lines {
        let (name, value) = line.split_once(':').expect("name: value");
        let value = value.strip_prefix(' ').unwrap_or(value);
        pairs.push((name.to_owned(), value.as_bytes().to_vec()));
    }
    pairs
}

fn classify_pairs(
    policy: &Policy,
    pairs: &[(String, Vec<u8>)],
    end_of_stream: bool,
) -> HeadVerdict {
    let headers: Vec<Header<'_>> = pairs
        .iter()
        .map(|(name, value)| Header { name, value })
        .collect();
    classify_head(policy, &headers, end_of_stream)
}

fn classify(policy: &Policy, request: &str) -> HeadVerdict {
    classify_pairs(policy, &header_pairs(request), false)
}

/// What a head verdict boils down to for the routing tests.
#[derive(Debug, PartialEq, Eq)]
enum Route {
    Inference(ApiKind),
    PassThrough,
    Reject(Reason),
}

fn route_of(verdict: HeadVerdict) -> Route {
    match verdict {
        HeadVerdict::Inference(head) => Route::Inference(head.api),
        HeadVerdict::PassThrough => Route::PassThrough,
        HeadVerdict::Reject(reply) => Route::Reject(reply.reason),
    }
}

/// `request` (with an identity header added) routes as `expected`.
#[track_caller]
fn check_route(policy: &Policy, request: &str, expected: Route) {
    let request = format!("{request}\nx-user-id: a");
    assert_eq!(
        route_of(classify(policy, &request)),
        expected,
        "{request:?}"
    );
}

const CHAT: &str = "POST /v1/chat/completions";

#[test]
fn inference_routes_are_post_on_an_exact_path() {
    use ApiKind::*;
    use Route::*;
    let p = &*DEFAULT_POLICY;
    check_route(p, "POST /v1/chat/completions", Inference(Chat));
    check_route(p, "POST /v1/completions", Inference(Completions));
    check_route(p, "POST /v1/chat/completions?v=2", Inference(Chat));
    check_route(p, "POST /v1/completions?", Inference(Completions));
    check_route(p, "GET /v1/chat/completions", PassThrough);
    check_route(p, "post /v1/chat/completions", PassThrough);
    check_route(p, "POST /v1/models", PassThrough);
    check_route(p, "POST /v1/chat/completions/", PassThrough);
    check_route(p, "POST /v1/chat/completionsX", PassThrough);
    check_route(p, "POST /V1/chat/completions", PassThrough);
    check_route(p, "POST /x/v1/chat/completions", PassThrough);
}

#[test]
fn percent_encoded_inference_path_is_still_inference() {
    // vLLM (uvicorn) decodes the path before routing, so `/v1/chat/%63ompletions` reaches the
    // chat endpoint: tollgate must decode it too before matching, or such a request would pass
    // through unadmitted and uncounted.
    use ApiKind::*;
    use Route::*;
    let p = &*DEFAULT_POLICY;
    check_route(p, "POST /v1/chat/%63ompletions", Inference(Chat));
    check_route(p, "POST /v1/chat%2Fcompletions", Inference(Chat));
    check_route(p, "POST /v1/%63ompletions", Inference(Completions));
}

#[test]
fn pass_through_needs_no_identity() {
    let p = &*DEFAULT_POLICY;
    let route = |request| route_of(classify(p, request));
    assert_eq!(route("GET /v1/models"), Route::PassThrough);
    assert_eq!(route("GET /v1/chat/completions"), Route::PassThrough);
    assert_eq!(
        route("POST /health\ncontent-type: text/plain"),
        Route::PassThrough
    );
    // An inference route without identity is refused, not passed through.
    assert_eq!(route(CHAT), Route::Reject(Reason::MissingIdentity));
}

#[test]
fn completions_routes_are_recognised_by_suffix() {
    use ApiKind::*;
    use Route::*;
    let p = &policy_with(|c| {
        c.routes.inference_paths = vec![
            "/openai/v1/chat/completions".into(),
            "/openai/v1/completions".into(),
            "/generate".into(),
        ];
    });
    check_route(p, "POST /openai/v1/chat/completions", Inference(Chat));
    check_route(p, "POST /openai/v1/completions", Inference(Completions));
    check_route(p, "POST /generate", Inference(Chat));
    check_route(p, "POST /v1/chat/completions", PassThrough);
}

/// The identity `headers` (appended to a chat request) resolve to: (tenant, tier name) or the
/// reason for refusing.
#[track_caller]
fn check_identity(policy: &Policy, headers: &str, expected: Result<(&str, &str), Reason>) {
    let request = format!("{CHAT}\ncontent-type: application/json{headers}");
    let got = match classify(policy, &request) {
        HeadVerdict::Inference(head) => Ok((
            head.identity.tenant,
            policy.tiers[head.identity.tier].name.clone(),
        )),
        HeadVerdict::Reject(reply) => Err(reply.reason),
        HeadVerdict::PassThrough => panic!("{request:?} passed through"),
    };
    let expected = expected.map(|(tenant, tier)| (tenant.to_owned(), tier.to_owned()));
    assert_eq!(got, expected, "{headers:?}");
}

#[test]
fn identity_comes_from_the_user_header() {
    let p = &*DEFAULT_POLICY;
    check_identity(p, "\nx-user-id: alice", Ok(("alice", "free")));
    check_identity(p, "\nx-user-id:   alice  ", Ok(("alice", "free")));
    check_identity(
        p,
        "\nx-user-id: ünïcødé-tenant",
        Ok(("ünïcødé-tenant", "free")),
    );
    check_identity(p, "", Err(Reason::MissingIdentity));
    check_identity(p, "\nx-tenant: alice", Err(Reason::MissingIdentity));
}

#[test]
fn user_header_name_comes_from_the_policy() {
    let p = &policy_with(|c| c.identity.user_header = "X-Team".to_owned());
    check_identity(p, "\nx-team: red", Ok(("red", "free")));
    check_identity(p, "\nx-user-id: alice", Err(Reason::MissingIdentity));
}

#[test]
fn tier_comes_from_the_tier_header_or_the_default() {
    let p = &*DEFAULT_POLICY;
    check_identity(
        p,
        "\nx-user-id: a\nx-user-tier: premium",
        Ok(("a", "premium")),
    );
    check_identity(
        p,
        "\nx-user-id: a\nx-user-tier:  standard ",
        Ok(("a", "standard")),
    );
    check_identity(p, "\nx-user-id: a", Ok(("a", "free")));
    check_identity(
        p,
        "\nx-user-id: a\nx-user-tier: gold",
        Err(Reason::UnknownTier),
    );
    check_identity(
        p,
        "\nx-user-id: a\nx-user-tier: Premium",
        Err(Reason::UnknownTier),
    );
    // An empty tier header is no tier: the default, like an absent one.
    check_identity(p, "\nx-user-id: a\nx-user-tier: ", Ok(("a", "free")));

    let p = &policy_with(|c| c.default_tier = "standard".to_owned());
    check_identity(p, "\nx-user-id: a", Ok(("a", "standard")));
}

#[test]
fn unknown_tier_is_refused_with_401_naming_the_tier() {
    let request = format!("{CHAT}\nx-user-id: a\nx-user-tier: gold");
    let HeadVerdict::Reject(reply) = classify(&DEFAULT_POLICY, &request) else {
        panic!("expected a rejection");
    };
    assert_eq!(reply.reason, Reason::UnknownTier);
    assert_eq!(reply.status(), 401);
    assert!(reply.message.contains("\"gold\""), "{}", reply.message);
}

#[test]
fn configured_api_key_wins_over_the_user_header() {
    let p = &*KEYED_POLICY;
    check_identity(
        p,
        "\nauthorization: Bearer sk-alice",
        Ok(("alice-by-key", "premium")),
    );
    check_identity(
        p,
        "\nauthorization: Bearer sk-bob",
        Ok(("bob-by-key", "free")),
    );
    check_identity(
        p,
        "\nauthorization: Bearer sk-alice\nx-user-id: mallory",
        Ok(("alice-by-key", "premium")),
    );
    // The key's tier is what was configured for it; the tier header cannot raise it.
    check_identity(
        p,
        "\nauthorization: Bearer sk-bob\nx-user-tier: premium",
        Ok(("bob-by-key", "free")),
    );
    check_identity(p, "\nx-user-id: carol", Ok(("carol", "free")));
}

#[test]
fn bearer_scheme_is_case_insensitive() {
    let p = &*KEYED_POLICY;
    check_identity(
        p,
        "\nauthorization: bearer sk-alice",
        Ok(("alice-by-key", "premium")),
    );
    check_identity(
        p,
        "\nauthorization: BEARER sk-alice",
        Ok(("alice-by-key", "premium")),
    );
    check_identity(
        p,
        "\nauthorization: Bearer   sk-alice ",
        Ok(("alice-by-key", "premium")),
    );
}

#[test]
fn unknown_bearer_key_is_refused_when_keys_are_configured() {
    let p = &*KEYED_POLICY;
    check_identity(
        p,
        "\nauthorization: Bearer sk-carol",
        Err(Reason::InvalidApiKey),
    );
    // Refused, not quietly charged to whoever the user header names.
    check_identity(
        p,
        "\nauthorization: Bearer sk-carol\nx-user-id: carol",
        Err(Reason::InvalidApiKey),
    );
    check_identity(
        p,
        "\nauthorization: Bearer SK-ALICE",
        Err(Reason::InvalidApiKey),
    );
    // Not a bearer key at all: the user header still identifies.
    check_identity(
        p,
        "\nauthorization: Basic YTpi\nx-user-id: carol",
        Ok(("carol", "free")),
    );
}

#[test]
fn authorization_is_ignored_when_no_keys_are_configured() {
    let p = &*DEFAULT_POLICY;
    check_identity(
        p,
        "\nauthorization: Bearer sk-alice\nx-user-id: bob",
        Ok(("bob", "free")),
    );
    check_identity(
        p,
        "\nauthorization: Bearer sk-alice",
        Err(Reason::MissingIdentity),
    );
}

#[test]
fn api_keys_alone_identify_when_the_user_header_is_off() {
    let p = &policy_with(|c| {
        c.identity.user_header = String::new();
        c.identity.api_keys = KEYS_CONFIG.clone();
    });
    check_identity(
        p,
        "\nauthorization: Bearer sk-bob",
        Ok(("bob-by-key", "free")),
    );
    check_identity(p, "\nx-user-id: bob", Err(Reason::MissingIdentity));
}

#[test]
fn missing_identity_says_how_to_identify() {
    let reply = |policy: &Policy| match classify(policy, CHAT) {
        HeadVerdict::Reject(reply) => reply,
        other => panic!("expected a rejection, got {other:?}"),
    };
    let by_header = reply(&DEFAULT_POLICY);
    assert_eq!(by_header.reason, Reason::MissingIdentity);
    assert_eq!(by_header.status(), 401);
    assert!(
        by_header.message.contains("x-user-id"),
        "{}",
        by_header.message
    );
    let by_key = reply(&KEYED_POLICY);
    assert!(by_key.message.contains("x-user-id"), "{}", by_key.message);
    assert!(by_key.message.contains("Bearer"), "{}", by_key.message);
}

#[test]
fn tenant_must_be_short_printable_utf8() {
    let p = &*DEFAULT_POLICY;
    let max = "t".repeat(256);
    check_identity(p, &format!("\nx-user-id: {max}"), Ok((&max, "free")));
    check_identity(
        p,
        &format!("\nx-user-id: {max}t"),
        Err(Reason::MissingIdentity),
    );
    // The limit is in bytes: 128 two-byte characters fit, 129 do not.
    let wide = "é".repeat(128);
    check_identity(p, &format!("\nx-user-id: {wide}"), Ok((&wide, "free")));
    check_identity(
        p,
        &format!("\nx-user-id: {wide}é"),
        Err(Reason::MissingIdentity),
    );
    check_identity(p, "\nx-user-id: ", Err(Reason::MissingIdentity));
    check_identity(p, "\nx-user-id:    ", Err(Reason::MissingIdentity));
    check_identity(p, "\nx-user-id: al\tice", Err(Reason::MissingIdentity));
    check_identity(p, "\nx-user-id: al\u{7f}ice", Err(Reason::MissingIdentity));
    check_identity(p, "\nx-user-id: al\u{0}ice", Err(Reason::MissingIdentity));
}

#[test]
fn tenant_that_is_not_utf8_is_refused() {
    let mut pairs = header_pairs(CHAT);
    pairs.push(("x-user-id".to_owned(), b"al\xffice".to_vec()));
    let verdict = classify_pairs(&DEFAULT_POLICY, &pairs, false);
    assert_eq!(route_of(verdict), Route::Reject(Reason::MissingIdentity));
}

#[test]
fn headers_that_end_the_stream_leave_no_body_to_admit() {
    let pairs = header_pairs(&format!("{CHAT}\nx-user-id: a"));
    let verdict = classify_pairs(&DEFAULT_POLICY, &pairs, true);
    assert_eq!(route_of(verdict), Route::Reject(Reason::MissingBody));
    // Not an inference route: nothing to check.
    let pairs = header_pairs("GET /v1/models\nx-user-id: a");
    let verdict = classify_pairs(&DEFAULT_POLICY, &pairs, true);
    assert_eq!(route_of(verdict), Route::PassThrough);
}

/// An identified chat request with `header: value` passes the header checks (`None`) or is
/// refused for `expected`.
#[track_caller]
fn check_header(header: &str, value: &str, expected: Option<Reason>) {
    let request = format!("{CHAT}\nx-user-id: a\n{header}: {value}");
    let got = match route_of(classify(&DEFAULT_POLICY, &request)) {
        Route::Inference(_) => None,
        Route::Reject(reason) => Some(reason),
        Route::PassThrough => panic!("{request:?} passed through"),
    };
    assert_eq!(got, expected, "{header}: {value}");
}

#[test]
fn content_type_must_be_json() {
    use Reason::InvalidContentType as Refused;
    let ct = "content-type";
    check_header(ct, "application/json", None);
    check_header(ct, "application/json; charset=utf-8", None);
    check_header(ct, "Application/JSON", None);
    check_header(ct, "application/vnd.foo+json", None);
    check_header(ct, "text/plain", Some(Refused));
    check_header(ct, "application/x-www-form-urlencoded", Some(Refused));
    check_header(ct, "application/jsonl", Some(Refused));
    check_header(ct, "multipart/form-data; boundary=x", Some(Refused));
    // No content-type at all is fine.
    check_header("x-other", "1", None);
}

#[test]
fn content_encoding_must_be_identity() {
    use Reason::UnsupportedContentEncoding as Refused;
    let ce = "content-encoding";
    check_header(ce, "identity", None);
    check_header(ce, "Identity", None);
    check_header(ce, "gzip", Some(Refused));
    check_header(ce, "br", Some(Refused));
}

#[test]
fn unsupported_content_encoding_is_415() {
    let request = format!("{CHAT}\nx-user-id: a\ncontent-encoding: gzip");
    let HeadVerdict::Reject(reply) = classify(&DEFAULT_POLICY, &request) else {
        panic!("expected a rejection");
    };
    assert_eq!(reply.status(), 415);
    assert!(reply.message.contains("gzip"), "{}", reply.message);
}

#[test]
fn client_sent_tollgate_headers_are_collected_for_removal() {
    let request = format!(
        "{CHAT}\nx-user-id: a\nx-tollgate-tenant: someone-else\nx-request-id: 1\nx-tollgate-input-tokens: 1"
    );
    let expected = HeadVerdict::Inference(InferenceHead {
        identity: Identity {
            tenant: "a".to_owned(),
            tier: DEFAULT_POLICY.default_tier,
        },
        api: ApiKind::Chat,
        spoofed_headers: vec![
            "x-tollgate-tenant".to_owned(),
            "x-tollgate-input-tokens".to_owned(),
        ],
    });
    assert_eq!(classify(&DEFAULT_POLICY, &request), expected);
    // They do not stand in for identity.
    let spoofed_only = classify(&DEFAULT_POLICY, &format!("{CHAT}\nx-tollgate-tenant: a"));
    assert_eq!(
        route_of(spoofed_only),
        Route::Reject(Reason::MissingIdentity)
    );
}

// ---------------------------------------------------------------------------------------------
// parse_body: counting

fn parse(api: ApiKind, body: impl AsRef<[u8]>, ceiling: u32) -> Result<ParsedBody, LocalReply> {
    parse_body(&DEFAULT_POLICY, api, body.as_ref(), ceiling, "alice")
}

/// `body` parses and counts `expected` input tokens.
#[track_caller]
fn check_count(api: ApiKind, body: &str, expected: u32) {
    match parse(api, body, u32::MAX) {
        Ok(parsed) => assert_eq!(parsed.input, InputCount::Exact(expected), "{body}"),
        Err(reply) => panic!("{body} was refused: {reply:?}"),
    }
}

/// One chat message's framing and role.
fn message(role: &str) -> u32 {
    PER_MESSAGE + o200k(role)
}

#[test]
fn chat_string_content_is_counted_with_framing() {
    use ApiKind::Chat;
    check_count(
        Chat,
        r#"{"model":"gpt-4o","messages":[{"role":"user","content":"Hello, world!"}]}"#,
        message("user") + o200k("Hello, world!") + REPLY_PRIMING,
    );
    check_count(
        Chat,
        r#"{"model":"gpt-4o","messages":[
            {"role":"system","content":"You are terse."},
            {"role":"user","content":"Why is the sky blue? Explain   in\n\ndetail."}]}"#,
        message("system")
            + o200k("You are terse.")
            + message("user")
            + o200k("Why is the sky blue? Explain   in\n\ndetail.")
            + REPLY_PRIMING,
    );
    check_count(
        Chat,
        r#"{"model":"gpt-4o","messages":[{"role":"user","content":""}]}"#,
        message("user") + REPLY_PRIMING,
    );
    check_count(
        Chat,
        r#"{"model":"gpt-4o","messages":[{"role":"user","content":"<|endoftext|> is text"}]}"#,
        message("user") + o200k("<|endoftext|> is text") + REPLY_PRIMING,
    );
}

#[test]
fn chat_content_parts_count_text_and_a_flat_cost_per_image() {
    use ApiKind::Chat;
    check_count(
        Chat,
        r#"{"model":"gpt-4o","messages":[{"role":"user","content":[
            {"type":"text","text":"What is in this picture?"},
            {"type":"image_url","image_url":{"url":"https://example.com/a-long-url-that-is-not-counted.png"}},
            {"type":"text","text":" And this one?"},
            {"type":"input_image","image_url":"data:image/png;base64,AAAA"}]}]}"#,
        message("user")
            + o200k("What is in this picture?")
            + PER_IMAGE
            + o200k(" And this one?")
            + PER_IMAGE
            + REPLY_PRIMING,
    );
    check_count(
        Chat,
        r#"{"model":"gpt-4o","messages":[{"role":"assistant","content":[
            {"type":"refusal","refusal":"I can't help with that."}]}]}"#,
        message("assistant") + o200k("I can't help with that.") + REPLY_PRIMING,
    );
    check_count(
        Chat,
        r#"{"model":"gpt-4o","messages":[{"role":"user","content":[]}]}"#,
        message("user") + REPLY_PRIMING,
    );
}

#[test]
fn chat_name_costs_its_text_plus_one() {
    check_count(
        ApiKind::Chat,
        r#"{"model":"gpt-4o","messages":[{"role":"user","name":"alice_smith","content":"hi"}]}"#,
        message("user") + o200k("hi") + PER_NAME + o200k("alice_smith") + REPLY_PRIMING,
    );
    check_count(
        ApiKind::Chat,
        r#"{"model":"gpt-4o","messages":[{"role":"user","name":null,"content":"hi"}]}"#,
        message("user") + o200k("hi") + REPLY_PRIMING,
    );
}

/// Compact JSON with keys in sorted order: the text the counter sees whatever map order
/// serde_json keeps.
const TOOL_CALLS: &str = r#"[{"function":{"arguments":"{\"city\":\"Paris\"}","name":"get_weather"},"id":"call_1","type":"function"}]"#;
const TOOLS: &str = r#"[{"function":{"description":"Current weather in a city","name":"get_weather","parameters":{"properties":{"city":{"type":"string"}},"type":"object"}},"type":"function"}]"#;

#[test]
fn chat_tool_calls_count_as_their_json_text() {
    check_count(
        ApiKind::Chat,
        &format!(
            r#"{{"model":"gpt-4o","messages":[{{"role":"assistant","content":null,"tool_calls":{TOOL_CALLS}}}]}}"#
        ),
        message("assistant") + o200k(TOOL_CALLS) + REPLY_PRIMING,
    );
}

#[test]
fn chat_tool_definitions_count_as_their_json_text() {
    check_count(
        ApiKind::Chat,
        &format!(
            r#"{{"model":"gpt-4o","messages":[{{"role":"user","content":"weather?"}}],"tools":{TOOLS}}}"#
        ),
        message("user") + o200k("weather?") + o200k(TOOLS) + REPLY_PRIMING,
    );
    check_count(
        ApiKind::Chat,
        r#"{"model":"gpt-4o","messages":[{"role":"user","content":"x"}],"functions":[{"name":"f"}]}"#,
        message("user") + o200k("x") + o200k(r#"[{"name":"f"}]"#) + REPLY_PRIMING,
    );
    check_count(
        ApiKind::Chat,
        r#"{"model":"gpt-4o","messages":[{"role":"user","content":"x"}],"tools":null}"#,
        message("user") + o200k("x") + REPLY_PRIMING,
    );
}

#[test]
fn completions_prompt_is_counted_without_framing() {
    use ApiKind::Completions;
    let text = "Once upon a time, in a land far, far away";
    check_count(
        Completions,
        &format!(r#"{{"model":"gpt-4o","prompt":"{text}"}}"#),
        o200k(text),
    );
    check_count(
        Completions,
        r#"{"model":"gpt-4o","prompt":["Hello there","General Kenobi!"]}"#,
        o200k("Hello there") + o200k("General Kenobi!"),
    );
    check_count(Completions, r#"{"model":"gpt-4o","prompt":[1,2,3,4,5]}"#, 5);
    check_count(
        Completions,
        r#"{"model":"gpt-4o","prompt":[[1,2],[3],[4,5,6]]}"#,
        6,
    );
    check_count(Completions, r#"{"model":"gpt-4o","prompt":""}"#, 0);
}

/// A text whose count differs between the two encodings (checked below, so the encoding
/// tests cannot pass by accident).
const ENCODING_SENSITIVE: &str = "Wie geht's? 日本語のテキストです。 ✨🚀";

#[test]
fn model_chooses_the_encoding() {
    use ApiKind::Completions;
    let text = ENCODING_SENSITIVE;
    assert_ne!(
        o200k(text),
        cl100k(text),
        "the test text must tell the encodings apart"
    );
    let body = |model: &str| format!(r#"{{{model}"prompt":"{text}"}}"#);
    check_count(Completions, &body(r#""model":"gpt-4o","#), o200k(text));
    check_count(
        Completions,
        &body(r#""model":"gpt-4o-mini-2024-07-18","#),
        o200k(text),
    );
    check_count(Completions, &body(r#""model":"o3-mini","#), o200k(text));
    check_count(Completions, &body(r#""model":"gpt-4","#), cl100k(text));
    check_count(
        Completions,
        &body(r#""model":"gpt-3.5-turbo","#),
        cl100k(text),
    );
    check_count(
        Completions,
        &body(r#""model":"meta-llama/Llama-3-8B","#),
        cl100k(text),
    );
    check_count(Completions, &body(""), cl100k(text));
    check_count(Completions, &body(r#""model":null,"#), cl100k(text));
}

#[test]
fn configured_encoding_rules_choose_the_encoding() {
    let policy = policy_with(|c| {
        c.tokens.encodings = vec![EncodingRule::builtin("*llama*", Encoding::O200kBase)];
    });
    let text = ENCODING_SENSITIVE;
    let body = format!(r#"{{"model":"meta-llama/Llama-3-8B","prompt":"{text}"}}"#);
    let parsed = parse_body(
        &policy,
        ApiKind::Completions,
        body.as_bytes(),
        u32::MAX,
        "alice",
    )
    .unwrap();
    assert_eq!(parsed.encoding, Encoding::O200kBase);
    assert_eq!(parsed.input, InputCount::Exact(o200k(text)));
}

/// `body` counts `exact` tokens: a ceiling of `exact` still counts it, one less is over.
#[track_caller]
fn check_ceiling(api: ApiKind, body: &str, exact: u32) {
    let input = |ceiling| parse(api, body, ceiling).expect("a valid body").input;
    assert_eq!(
        input(exact),
        InputCount::Exact(exact),
        "at the ceiling: {body}"
    );
    assert_eq!(
        input(exact + 1),
        InputCount::Exact(exact),
        "under the ceiling: {body}"
    );
    assert_eq!(
        input(exact - 1),
        InputCount::OverCeiling,
        "over the ceiling: {body}"
    );
    assert_eq!(input(0), InputCount::OverCeiling, "zero ceiling: {body}");
}

#[test]
fn ceiling_is_inclusive() {
    use ApiKind::*;
    let content = "The quick brown fox jumps over the lazy dog.";
    // Over only by the reply priming at the very end.
    check_ceiling(
        Chat,
        &format!(r#"{{"model":"gpt-4o","messages":[{{"role":"user","content":"{content}"}}]}}"#),
        message("user") + o200k(content) + REPLY_PRIMING,
    );
    // Over inside the text.
    check_ceiling(
        Completions,
        &format!(r#"{{"model":"gpt-4","prompt":"{content}"}}"#),
        cl100k(content),
    );
    check_ceiling(
        Completions,
        r#"{"model":"gpt-4","prompt":["one two","three four five"]}"#,
        cl100k("one two") + cl100k("three four five"),
    );
    check_ceiling(Completions, r#"{"prompt":[7,7,7,7,7,7,7]}"#, 7);
    check_ceiling(Completions, r#"{"prompt":[[7,7,7],[7,7],[7,7]]}"#, 7);
    check_ceiling(
        Chat,
        r#"{"model":"gpt-4o","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"u"}}]}]}"#,
        message("user") + PER_IMAGE + REPLY_PRIMING,
    );
}

#[test]
fn megabytes_of_prompt_over_a_small_ceiling_are_over_the_ceiling() {
    let text = "lorem ipsum dolor sit amet ".repeat(100_000);
    let body = format!(r#"{{"model":"gpt-4o","prompt":"{text}"}}"#);
    assert_eq!(
        parse(ApiKind::Completions, &body, 1_000).unwrap().input,
        InputCount::OverCeiling
    );
}

// ---------------------------------------------------------------------------------------------
// parse_body: the rest of the body

#[test]
fn parsed_body_keeps_model_stream_choices_and_the_json() {
    let body = r#"{"model":"gpt-4o","stream":true,"n":3,"temperature":0.5,"messages":[{"role":"user","content":"hi"}]}"#;
    let parsed = parse(ApiKind::Chat, body, u32::MAX).unwrap();
    assert_eq!(parsed.model, "gpt-4o");
    assert_eq!(parsed.encoding, Encoding::O200kBase);
    assert!(parsed.stream);
    assert_eq!(parsed.choices, 3);
    assert_eq!(parsed.max_output, MaxOutput::Absent);
    assert_eq!(
        Value::Object(parsed.json),
        serde_json::from_str::<Value>(body).unwrap()
    );

    let parsed = parse(
        ApiKind::Completions,
        r#"{"prompt":"x","stream":null,"n":null}"#,
        9,
    )
    .unwrap();
    assert_eq!(parsed.model, "");
    assert!(!parsed.stream);
    assert_eq!(parsed.choices, 1);
}

#[test]
fn n_may_be_up_to_128() {
    let choices = |n: u32| {
        let body = format!(r#"{{"prompt":"x","n":{n}}}"#);
        parse(ApiKind::Completions, body, 9).unwrap().choices
    };
    assert_eq!(choices(1), 1);
    assert_eq!(choices(128), 128);
}

/// The output fields of `body` (a completions body with its prompt added) give `expected`.
#[track_caller]
fn check_max_output(fields: &str, expected: MaxOutput) {
    let body = format!(r#"{{"prompt":"x"{fields}}}"#);
    match parse(ApiKind::Completions, &body, 9) {
        Ok(parsed) => assert_eq!(parsed.max_output, expected, "{body}"),
        Err(reply) => panic!("{body} was refused: {reply:?}"),
    }
}

fn given(tokens: u64, max_tokens: bool, max_completion_tokens: bool) -> MaxOutput {
    MaxOutput::Given {
        tokens,
        fields: OutputFields {
            max_tokens,
            max_completion_tokens,
        },
    }
}

#[test]
fn max_output_comes_from_either_field_and_max_completion_tokens_wins() {
    check_max_output("", MaxOutput::Absent);
    check_max_output(r#","max_tokens":null"#, MaxOutput::Absent);
    check_max_output(r#","max_tokens":100"#, given(100, true, false));
    check_max_output(r#","max_completion_tokens":70"#, given(70, false, true));
    check_max_output(
        r#","max_tokens":100,"max_completion_tokens":70"#,
        given(70, true, true),
    );
    check_max_output(
        r#","max_completion_tokens":70,"max_tokens":100"#,
        given(70, true, true),
    );
    check_max_output(
        r#","max_tokens":5,"max_completion_tokens":700"#,
        given(700, true, true),
    );
    check_max_output(
        r#","max_tokens":null,"max_completion_tokens":7"#,
        given(7, false, true),
    );
    check_max_output(r#","max_tokens":1"#, given(1, true, false));
    check_max_output(
        r#","max_tokens":1000000000000"#,
        given(1_000_000_000_000, true, false),
    );
}

/// `body` is refused for `reason`, blaming `param`, with `fragment` in the message.
#[track_caller]
fn check_error(
    api: ApiKind,
    body: impl AsRef<[u8]>,
    reason: Reason,
    param: Option<&str>,
    fragment: &str,
) {
    let body = body.as_ref();
    let shown = String::from_utf8_lossy(body);
    let shown: String = shown.chars().take(120).collect();
    match parse(api, body, u32::MAX) {
        Ok(parsed) => panic!("{shown} was accepted: {parsed:?}"),
        Err(reply) => {
            assert_eq!(reply.reason, reason, "{shown}: {}", reply.message);
            assert_eq!(reply.param, param, "{shown}: {}", reply.message);
            assert!(
                reply.message.contains(fragment),
                "{shown}: the message should contain {fragment:?}: {}",
                reply.message
            );
            assert_eq!(reply.status(), 400, "{shown}");
        }
    }
}

#[test]
fn malformed_json_is_refused() {
    use ApiKind::Chat;
    use Reason::MalformedJson;
    check_error(Chat, "", MalformedJson, None, "not valid JSON");
    check_error(Chat, "{", MalformedJson, None, "not valid JSON");
    check_error(
        Chat,
        r#"{"messages":[{"role":"user","content":"hi"}"#,
        MalformedJson,
        None,
        "",
    );
    check_error(Chat, r#"{"messages":[]} trailing"#, MalformedJson, None, "");
    check_error(Chat, r#"{'messages':[]}"#, MalformedJson, None, "");
    check_error(Chat, b"{\"model\":\"gpt-4\xff\"}", MalformedJson, None, "");
    check_error(Chat, b"\xef\xbb\xbf{}", MalformedJson, None, "");
    let deep = format!(
        r#"{{"messages":{}{}}}"#,
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    check_error(Chat, deep, MalformedJson, None, "recursion limit");
}

#[test]
fn body_must_be_an_object() {
    use ApiKind::*;
    use Reason::InvalidRequest;
    check_error(Chat, "[]", InvalidRequest, None, "JSON object");
    check_error(Chat, "null", InvalidRequest, None, "JSON object");
    check_error(
        Completions,
        r#""prompt""#,
        InvalidRequest,
        None,
        "JSON object",
    );
    check_error(Completions, "42", InvalidRequest, None, "JSON object");
}

#[test]
fn common_fields_must_have_their_types() {
    use ApiKind::*;
    use Reason::InvalidRequest;
    let msgs = r#""messages":[{"role":"user","content":"hi"}]"#;
    check_error(
        Chat,
        format!(r#"{{"model":4,{msgs}}}"#),
        InvalidRequest,
        Some("model"),
        "model",
    );
    check_error(
        Chat,
        format!(r#"{{"model":["gpt-4"],{msgs}}}"#),
        InvalidRequest,
        Some("model"),
        "",
    );
    check_error(
        Chat,
        format!(r#"{{"stream":"yes",{msgs}}}"#),
        InvalidRequest,
        Some("stream"),
        "stream",
    );
    check_error(
        Chat,
        format!(r#"{{"stream":1,{msgs}}}"#),
        InvalidRequest,
        Some("stream"),
        "",
    );
    for n in ["0", "129", "-1", "1.5", "\"2\"", "true"] {
        check_error(
            Chat,
            format!(r#"{{"n":{n},{msgs}}}"#),
            InvalidRequest,
            Some("n"),
            "1 to 128",
        );
    }
    check_error(
        Completions,
        r#"{"prompt":"x","n":1000}"#,
        InvalidRequest,
        Some("n"),
        "",
    );
}

#[test]
fn messages_must_be_a_non_empty_array_of_objects_with_roles() {
    use ApiKind::Chat;
    use Reason::InvalidRequest;
    let m = Some("messages");
    check_error(Chat, r#"{"model":"gpt-4o"}"#, InvalidRequest, m, "array");
    check_error(Chat, r#"{"messages":null}"#, InvalidRequest, m, "array");
    check_error(
        Chat,
        r#"{"messages":[]}"#,
        InvalidRequest,
        m,
        "must not be empty",
    );
    check_error(Chat, r#"{"messages":"hi"}"#, InvalidRequest, m, "array");
    check_error(
        Chat,
        r#"{"messages":{"role":"user"}}"#,
        InvalidRequest,
        m,
        "array",
    );
    check_error(
        Chat,
        r#"{"messages":[1]}"#,
        InvalidRequest,
        m,
        "[0] must be an object",
    );
    check_error(
        Chat,
        r#"{"messages":[{"role":"user","content":"a"},"b"]}"#,
        InvalidRequest,
        m,
        "[1] must be an object",
    );
    check_error(
        Chat,
        r#"{"messages":[{"content":"hi"}]}"#,
        InvalidRequest,
        m,
        "[0].role",
    );
    check_error(
        Chat,
        r#"{"messages":[{"role":7,"content":"hi"}]}"#,
        InvalidRequest,
        m,
        "[0].role",
    );
    check_error(
        Chat,
        r#"{"messages":[{"role":"user","content":"hi","name":7}]}"#,
        InvalidRequest,
        m,
        "[0].name",
    );
    // A completions body on a chat route.
    check_error(Chat, r#"{"prompt":"hi"}"#, InvalidRequest, m, "array");
}

#[test]
fn content_must_be_a_string_or_known_parts() {
    use ApiKind::Chat;
    use Reason::InvalidRequest;
    let m = Some("messages");
    let body = |content: &str| format!(r#"{{"messages":[{{"role":"user","content":{content}}}]}}"#);
    check_error(
        Chat,
        body("42"),
        InvalidRequest,
        m,
        "[0].content must be a string or an array",
    );
    check_error(
        Chat,
        body(r#"{"text":"hi"}"#),
        InvalidRequest,
        m,
        "[0].content",
    );
    check_error(Chat, body("true"), InvalidRequest, m, "[0].content");
    check_error(
        Chat,
        body(r#"["hi"]"#),
        InvalidRequest,
        m,
        "parts must be objects",
    );
    check_error(
        Chat,
        body(r#"[{"text":"hi"}]"#),
        InvalidRequest,
        m,
        "needs a string `type`",
    );
    check_error(
        Chat,
        body(r#"[{"type":5}]"#),
        InvalidRequest,
        m,
        "needs a string `type`",
    );
    check_error(
        Chat,
        body(r#"[{"type":"text"}]"#),
        InvalidRequest,
        m,
        "`text`",
    );
    check_error(
        Chat,
        body(r#"[{"type":"text","text":5}]"#),
        InvalidRequest,
        m,
        "`text`",
    );
    check_error(
        Chat,
        body(r#"[{"type":"refusal"}]"#),
        InvalidRequest,
        m,
        "`refusal`",
    );
    check_error(
        Chat,
        body(r#"[{"type":"input_audio","input_audio":{"data":"AAAA","format":"wav"}}]"#),
        InvalidRequest,
        m,
        r#""input_audio""#,
    );
    check_error(
        Chat,
        body(r#"[{"type":"file"}]"#),
        InvalidRequest,
        m,
        r#""file""#,
    );
}

#[test]
fn prompt_must_be_text_or_token_ids() {
    use ApiKind::Completions;
    use Reason::InvalidRequest;
    let p = Some("prompt");
    let body = |prompt: &str| format!(r#"{{"model":"gpt-4","prompt":{prompt}}}"#);
    check_error(
        Completions,
        r#"{"model":"gpt-4"}"#,
        InvalidRequest,
        p,
        "must be a string",
    );
    check_error(Completions, body("null"), InvalidRequest, p, "");
    check_error(Completions, body("42"), InvalidRequest, p, "");
    check_error(Completions, body("[]"), InvalidRequest, p, "");
    check_error(Completions, body(r#"[1,"a"]"#), InvalidRequest, p, "");
    check_error(Completions, body("[-1]"), InvalidRequest, p, "");
    check_error(Completions, body("[1.5]"), InvalidRequest, p, "");
    check_error(Completions, body("[[]]"), InvalidRequest, p, "");
    check_error(Completions, body("[[1],[]]"), InvalidRequest, p, "");
    check_error(Completions, body(r#"[[1],["a"]]"#), InvalidRequest, p, "");
    check_error(Completions, body(r#"[[1],2]"#), InvalidRequest, p, "");
    check_error(Completions, body(r#"{"text":"hi"}"#), InvalidRequest, p, "");
    // A chat body on a completions route.
    check_error(
        Completions,
        r#"{"messages":[{"role":"user","content":"hi"}]}"#,
        InvalidRequest,
        p,
        "",
    );
}

#[test]
fn max_tokens_must_be_a_positive_integer() {
    use ApiKind::Completions;
    use Reason::InvalidMaxTokens;
    for value in ["0", "-1", "1.5", "10.0", "\"10\"", "true", "[10]", "1e3"] {
        check_error(
            Completions,
            format!(r#"{{"prompt":"x","max_tokens":{value}}}"#),
            InvalidMaxTokens,
            Some("max_tokens"),
            "max_tokens must be a positive integer, got ",
        );
        check_error(
            Completions,
            format!(r#"{{"prompt":"x","max_completion_tokens":{value}}}"#),
            InvalidMaxTokens,
            Some("max_completion_tokens"),
            "max_completion_tokens must be a positive integer",
        );
    }
    // A valid max_completion_tokens does not excuse an invalid max_tokens.
    check_error(
        Completions,
        r#"{"prompt":"x","max_tokens":0,"max_completion_tokens":10}"#,
        InvalidMaxTokens,
        Some("max_tokens"),
        "",
    );
}
