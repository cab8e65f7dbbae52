//! Unit tests for `decide_body`: hard limits (body size, input and output ceilings), output
//! defaulting and clamping, the stream usage request, and what goes upstream with an admitted
//! request.
//!
//! Bodies that must be rewritten are compared as JSON values, so key order does not matter.

use std::sync::LazyLock;

use super::*;
use crate::config::{Config, TierConfig};
use crate::request::ApiKind;

/// Tiers with small, distinct limits so every number in a message is attributable.
fn test_config() -> Config {
    let tiers = [
        (
            "free",
            TierConfig {
                max_input_tokens: 50,
                max_output_tokens: 100,
                output_limit: OutputLimitPolicy::Reject,
                default_output_tokens: Some(20),
                ..TierConfig::default()
            },
        ),
        (
            "clamped",
            TierConfig {
                max_input_tokens: 50,
                max_output_tokens: 100,
                output_limit: OutputLimitPolicy::Clamp,
                default_output_tokens: None,
                ..TierConfig::default()
            },
        ),
    ]
    .into_iter()
    .map(|(name, tier)| (name.to_owned(), tier))
    .collect();
    Config {
        default_tier: "free".to_owned(),
        tiers,
        ..Config::default()
    }
}

fn policy_with(edit: impl FnOnce(&mut Config)) -> Policy {
    let mut config = test_config();
    edit(&mut config);
    Policy::from_config(&config).expect("a valid test policy")
}

static POLICY: LazyLock<Policy> = LazyLock::new(|| policy_with(|_| {}));

fn head(policy: &Policy, tier: &str, api: ApiKind) -> InferenceHead {
    InferenceHead {
        identity: Identity {
            tenant: "alice".to_owned(),
            tier: policy.tier_named(tier).expect("a test tier"),
        },
        api,
        spoofed_headers: Vec::new(),
    }
}

fn decide(policy: &Policy, tier: &str, api: ApiKind, body: &str) -> BodyVerdict {
    decide_body(policy, &head(policy, tier, api), body.as_bytes())
}

#[track_caller]
fn admitted(verdict: BodyVerdict) -> Admission {
    match verdict {
        BodyVerdict::Admit(admission) => admission,
        BodyVerdict::Reject(reply) => panic!("expected an admission, got {reply:?}"),
    }
}

#[track_caller]
fn rejected(verdict: BodyVerdict) -> LocalReply {
    match verdict {
        BodyVerdict::Reject(reply) => reply,
        BodyVerdict::Admit(admission) => panic!("expected a rejection, got {admission:?}"),
    }
}

/// A chat body with `fields` added to one short message.
fn chat(fields: &str) -> String {
    format!(r#"{{"model":"gpt-4o","messages":[{{"role":"user","content":"hi"}}]{fields}}}"#)
}

fn json(text: &str) -> Value {
    serde_json::from_str(text).expect("valid test JSON")
}

/// `body` (a chat request of `tier`) is admitted with `max_output_tokens` per choice, and goes
/// upstream as `new_body` (`None`: unchanged).
#[track_caller]
fn check_output(
    policy: &Policy,
    tier: &str,
    body: &str,
    max_output_tokens: u32,
    new_body: Option<&str>,
) {
    let admission = admitted(decide(policy, tier, ApiKind::Chat, body));
    assert_eq!(admission.max_output_tokens, max_output_tokens, "{body}");
    let got = admission
        .new_body
        .map(|b| serde_json::from_slice::<Value>(&b).expect("the rewritten body is JSON"));
    assert_eq!(got, new_body.map(json), "{body}");
}

/// `body` (a `tier` request of kind `api`) is refused for `reason`, blaming `param`, with every
/// one of `fragments` in the message.
#[track_caller]
fn check_reject(
    policy: &Policy,
    tier: &str,
    api: ApiKind,
    body: &str,
    reason: Reason,
    param: Option<&str>,
    fragments: &[&str],
) {
    let reply = rejected(decide(policy, tier, api, body));
    assert_eq!(reply.reason, reason, "{}", reply.message);
    assert_eq!(reply.param, param, "{}", reply.message);
    for fragment in fragments {
        assert!(
            reply.message.contains(fragment),
            "the message should contain {fragment:?}: {}",
            reply.message
        );
    }
}

#[test]
fn absent_output_limit_gets_the_tier_default_written_into_max_tokens() {
    let p = &*POLICY;
    check_output(p, "free", &chat(""), 20, Some(&chat(r#","max_tokens":20"#)));
    check_output(
        p,
        "free",
        &chat(r#","max_tokens":null"#),
        20,
        Some(&chat(r#","max_tokens":20"#)),
    );
    // No default configured: the ceiling is the default.
    check_output(
        p,
        "clamped",
        &chat(""),
        100,
        Some(&chat(r#","max_tokens":100"#)),
    );
}

#[test]
fn output_limit_within_the_ceiling_leaves_the_body_alone() {
    let p = &*POLICY;
    check_output(p, "free", &chat(r#","max_tokens":1"#), 1, None);
    check_output(p, "free", &chat(r#","max_tokens":100"#), 100, None);
    check_output(p, "free", &chat(r#","max_completion_tokens":60"#), 60, None);
    check_output(p, "clamped", &chat(r#","max_tokens":100"#), 100, None);
    // Above the default but within the ceiling is the client's choice.
    check_output(p, "free", &chat(r#","max_tokens":21"#), 21, None);
}

#[test]
fn output_limit_over_the_ceiling_is_refused_naming_the_field_and_both_numbers() {
    use ApiKind::Chat;
    use Reason::OutputTokensExceeded;
    let p = &*POLICY;
    check_reject(
        p,
        "free",
        Chat,
        &chat(r#","max_tokens":101"#),
        OutputTokensExceeded,
        Some("max_tokens"),
        &["max_tokens is 101", "\"free\"", "at most 100"],
    );
    check_reject(
        p,
        "free",
        Chat,
        &chat(r#","max_completion_tokens":5000"#),
        OutputTokensExceeded,
        Some("max_completion_tokens"),
        &["max_completion_tokens is 5000", "at most 100"],
    );
    // max_completion_tokens is the effective one when both are sent.
    check_reject(
        p,
        "free",
        Chat,
        &chat(r#","max_tokens":10,"max_completion_tokens":101"#),
        OutputTokensExceeded,
        Some("max_completion_tokens"),
        &["max_completion_tokens is 101"],
    );
    check_output(
        p,
        "free",
        &chat(r#","max_tokens":1000,"max_completion_tokens":10"#),
        10,
        None,
    );
}

#[test]
fn output_limit_over_the_ceiling_is_clamped_in_the_fields_the_client_used() {
    let p = &*POLICY;
    check_output(
        p,
        "clamped",
        &chat(r#","max_tokens":101"#),
        100,
        Some(&chat(r#","max_tokens":100"#)),
    );
    check_output(
        p,
        "clamped",
        &chat(r#","max_completion_tokens":9999"#),
        100,
        Some(&chat(r#","max_completion_tokens":100"#)),
    );
    check_output(
        p,
        "clamped",
        &chat(r#","max_tokens":9999,"max_completion_tokens":9999"#),
        100,
        Some(&chat(r#","max_tokens":100,"max_completion_tokens":100"#)),
    );
}

#[test]
fn streams_ask_the_upstream_for_usage() {
    let p = &*POLICY;
    let usage = r#","stream_options":{"include_usage":true}"#;
    check_output(
        p,
        "free",
        &chat(r#","stream":true,"max_tokens":5"#),
        5,
        Some(&chat(&format!(r#","stream":true,"max_tokens":5{usage}"#))),
    );
    check_output(
        p,
        "free",
        &chat(r#","stream":true,"max_tokens":5,"stream_options":null"#),
        5,
        Some(&chat(&format!(r#","stream":true,"max_tokens":5{usage}"#))),
    );
    check_output(
        p,
        "free",
        &chat(r#","stream":true,"max_tokens":5,"stream_options":{"include_usage":false}"#),
        5,
        Some(&chat(&format!(r#","stream":true,"max_tokens":5{usage}"#))),
    );
    check_output(
        p,
        "free",
        &chat(r#","stream":true,"max_tokens":5,"stream_options":{"continuous_usage_stats":true}"#),
        5,
        Some(&chat(
            r#","stream":true,"max_tokens":5,"stream_options":{"continuous_usage_stats":true,"include_usage":true}"#,
        )),
    );
    // Together with the default output limit.
    check_output(
        p,
        "free",
        &chat(r#","stream":true"#),
        20,
        Some(&chat(&format!(r#","stream":true,"max_tokens":20{usage}"#))),
    );
}

#[test]
fn streams_that_already_ask_for_usage_are_left_alone() {
    let p = &*POLICY;
    let body = chat(r#","stream":true,"max_tokens":5,"stream_options":{"include_usage":true}"#);
    check_output(p, "free", &body, 5, None);
}

#[test]
fn non_streams_get_no_stream_options() {
    let p = &*POLICY;
    check_output(
        p,
        "free",
        &chat(r#","stream":false,"max_tokens":5"#),
        5,
        None,
    );
    check_output(
        p,
        "free",
        &chat(r#","max_tokens":5,"stream_options":"odd""#),
        5,
        None,
    );
}

#[test]
fn stream_options_that_is_not_an_object_is_refused() {
    for options in [r#""yes""#, "true", "[]", "1"] {
        check_reject(
            &POLICY,
            "free",
            ApiKind::Chat,
            &chat(&format!(
                r#","stream":true,"max_tokens":5,"stream_options":{options}"#
            )),
            Reason::InvalidRequest,
            Some("stream_options"),
            &["stream_options"],
        );
    }
}

#[test]
fn stream_usage_injection_can_be_turned_off() {
    let p = &policy_with(|c| c.response.inject_stream_usage = false);
    check_output(
        p,
        "free",
        &chat(r#","stream":true,"max_tokens":5"#),
        5,
        None,
    );
    check_output(
        p,
        "free",
        &chat(r#","stream":true"#),
        20,
        Some(&chat(r#","stream":true,"max_tokens":20"#)),
    );
}

#[test]
fn admission_carries_identity_cost_and_upstream_headers() {
    let p = &*POLICY;
    let body = chat(r#","max_tokens":7,"n":3"#);
    let input_tokens = admitted(decide(p, "clamped", ApiKind::Chat, &body)).input_tokens;
    let expected = Admission {
        identity: Identity {
            tenant: "alice".to_owned(),
            tier: p.tier_named("clamped").unwrap(),
        },
        model: "gpt-4o".to_owned(),
        encoding: crate::tokens::Encoding::O200kBase,
        stream: false,
        input_tokens,
        max_output_tokens: 7,
        choices: 3,
        upstream_headers: vec![
            ("x-tollgate-tenant", "alice".to_owned()),
            ("x-tollgate-tier", "clamped".to_owned()),
            ("x-tollgate-input-tokens", input_tokens.to_string()),
        ],
        new_body: None,
        chat_template_refused: false,
    };
    assert_eq!(
        decide(p, "clamped", ApiKind::Chat, &body),
        BodyVerdict::Admit(expected)
    );
    // 3 per message + "user" + "hi" + 3 priming, counted by request::parse_body.
    assert_eq!(input_tokens, 8);
}

/// A completions request of `tier` with `prompt_ids` token ids, `max_tokens` and `n` costs
/// `worst_case` tokens at most.
#[track_caller]
fn check_worst_case(tier: &str, prompt_ids: usize, output: &str, worst_case: u64) {
    let ids = vec!["1"; prompt_ids].join(",");
    let body = format!(r#"{{"prompt":[{ids}]{output}}}"#);
    let admission = admitted(decide(&POLICY, tier, ApiKind::Completions, &body));
    assert_eq!(admission.input_tokens as usize, prompt_ids, "{body}");
    assert_eq!(admission.worst_case_tokens(), worst_case, "{body}");
}

#[test]
fn worst_case_is_input_plus_output_per_choice() {
    check_worst_case("free", 10, r#","max_tokens":7"#, 17);
    check_worst_case("free", 10, r#","max_tokens":7,"n":3"#, 10 + 7 * 3);
    check_worst_case("free", 10, r#","n":2"#, 10 + 20 * 2);
    check_worst_case("clamped", 1, r#","max_tokens":5000,"n":128"#, 1 + 100 * 128);
    check_worst_case("free", 50, r#","max_tokens":100,"n":128"#, 50 + 100 * 128);
}

#[test]
fn input_over_the_tier_ceiling_is_refused() {
    let p = &*POLICY;
    let ids = |n| vec!["1"; n].join(",");
    let completions = |n| format!(r#"{{"prompt":[{}],"max_tokens":1}}"#, ids(n));
    assert_eq!(
        admitted(decide(p, "free", ApiKind::Completions, &completions(50))).input_tokens,
        50
    );
    check_reject(
        p,
        "free",
        ApiKind::Completions,
        &completions(51),
        Reason::InputTokensExceeded,
        Some("prompt"),
        &["more than 50", "\"free\""],
    );
    let long = "word ".repeat(200);
    check_reject(
        p,
        "clamped",
        ApiKind::Chat,
        &format!(
            r#"{{"model":"gpt-4o","max_tokens":1,"messages":[{{"role":"user","content":"{long}"}}]}}"#
        ),
        Reason::InputTokensExceeded,
        Some("messages"),
        &["more than 50", "\"clamped\"", "gpt-4o"],
    );
}

#[test]
fn input_ceiling_is_the_tiers() {
    let p = &policy_with(|c| c.tiers.get_mut("clamped").unwrap().max_input_tokens = 60);
    let body = format!(r#"{{"prompt":[{}]}}"#, vec!["1"; 55].join(","));
    let verdict = |tier| match decide(p, tier, ApiKind::Completions, &body) {
        BodyVerdict::Admit(_) => None,
        BodyVerdict::Reject(reply) => Some(reply.reason),
    };
    assert_eq!(verdict("free"), Some(Reason::InputTokensExceeded));
    assert_eq!(verdict("clamped"), None);
}

#[test]
fn body_over_max_body_bytes_is_refused_before_parsing() {
    let p = &policy_with(|c| c.tokens.max_body_bytes = 100);
    let with_user = |user: &str| chat(&format!(r#","max_tokens":5,"user":"{user}""#));
    let padded = |len: usize| with_user(&"x".repeat(len - with_user("").len()));
    assert_eq!(padded(100).len(), 100);
    admitted(decide(p, "free", ApiKind::Chat, &padded(100)));
    check_reject(
        p,
        "free",
        ApiKind::Chat,
        &padded(101),
        Reason::BodyTooLarge,
        None,
        &["101 bytes", "limit is 100"],
    );
    // Not parsed: garbage over the limit is still too large, not malformed.
    check_reject(
        p,
        "free",
        ApiKind::Chat,
        &"{".repeat(101),
        Reason::BodyTooLarge,
        None,
        &[],
    );
    assert_eq!(Reason::BodyTooLarge.status(), 413);
}

#[test]
fn body_errors_from_parsing_are_passed_on() {
    let p = &*POLICY;
    check_reject(
        p,
        "free",
        ApiKind::Chat,
        "{",
        Reason::MalformedJson,
        None,
        &[],
    );
    check_reject(
        p,
        "free",
        ApiKind::Chat,
        &chat(r#","max_tokens":0"#),
        Reason::InvalidMaxTokens,
        Some("max_tokens"),
        &[],
    );
    check_reject(
        p,
        "free",
        ApiKind::Completions,
        &chat(""),
        Reason::InvalidRequest,
        Some("prompt"),
        &[],
    );
}

#[test]
fn rewritten_body_keeps_every_other_field() {
    let body = r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}],"temperature":0.2,
        "top_p":1,"seed":42,"tools":[{"type":"function","function":{"name":"f"}}],
        "response_format":{"type":"json_object"},"logit_bias":{"50256":-100},"user":"u-1"}"#;
    let mut expected = json(body);
    expected["max_tokens"] = 20.into();
    check_output(&POLICY, "free", body, 20, Some(&expected.to_string()));
}
