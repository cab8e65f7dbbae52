//! The admission decision for one request body: hard limits, output defaulting or clamping,
//! and the body and header rewrites that go upstream with an admitted request.
//!
//! Pure: the policy, the request head and the body bytes in; a `BodyVerdict` out. The budget
//! store and the fair queue plug in after this step, taking the `Admission` it produces.

use serde_json::{Map, Value};

use crate::config::OutputLimitPolicy;
use crate::policy::Policy;
use crate::reply::{LocalReply, Reason};
use crate::request::{self, Identity, InferenceHead, InputCount, MaxOutput, ParsedBody};

/// The verdict on a request body.
#[derive(Clone, Debug, PartialEq)]
pub enum BodyVerdict {
    Admit(Admission),
    Reject(LocalReply),
}

/// An admitted request: what it costs and what to change on its way upstream.
#[derive(Clone, Debug, PartialEq)]
pub struct Admission {
    pub identity: Identity,
    pub model: String,
    /// The model's BPE, to count generated text when the upstream reports no usage.
    pub encoding: crate::tokens::Encoding,
    pub stream: bool,
    pub input_tokens: u32,
    /// Output tokens the upstream may generate per choice, after defaulting or clamping.
    pub max_output_tokens: u32,
    /// How many choices (`n`) it generates.
    pub choices: u32,
    /// Headers to set upstream (client-sent `x-tollgate-*` were removed at the headers phase).
    pub upstream_headers: Vec<(&'static str, String)>,
    /// The rewritten body, if anything had to change.
    pub new_body: Option<Vec<u8>>,
    /// The model's chat template refused the chat; the recipe counted it.
    pub chat_template_refused: bool,
}

impl Admission {
    /// The most tokens this request can cost: what a budget reserves up front.
    pub fn worst_case_tokens(&self) -> u64 {
        let (input, output) = self.reserved_tokens();
        input + output
    }

    /// The reservation split into input (counted) and output (the most it may generate).
    pub fn reserved_tokens(&self) -> (u64, u64) {
        (
            u64::from(self.input_tokens),
            u64::from(self.max_output_tokens) * u64::from(self.choices),
        )
    }
}

pub fn decide_body(policy: &Policy, head: &InferenceHead, body: &[u8]) -> BodyVerdict {
    match admit(policy, head, body) {
        Ok(admission) => BodyVerdict::Admit(admission),
        Err(reply) => BodyVerdict::Reject(reply),
    }
}

fn admit(policy: &Policy, head: &InferenceHead, body: &[u8]) -> Result<Admission, LocalReply> {
    let tier = policy.tier_for(&head.identity.tenant, head.identity.tier);
    let max_body = policy.counting.max_body_bytes;
    if body.len() > max_body {
        return Err(LocalReply::new(
            Reason::BodyTooLarge,
            format!(
                "the request body is {} bytes; the limit is {max_body}",
                body.len()
            ),
        ));
    }
    let ParsedBody {
        mut json,
        model,
        encoding,
        stream,
        input,
        max_output,
        choices,
        template_refused,
    } = request::parse_body(
        policy,
        head.api,
        body,
        tier.max_input_tokens,
        &head.identity.tenant,
    )?;

    let input_tokens = match input {
        InputCount::Exact(n) => n,
        InputCount::OverCeiling => {
            return Err(LocalReply::new(
                Reason::InputTokensExceeded,
                format!(
                    "this request has more than {limit} input tokens (counted for model {model:?}); \
                     tier {tier:?} allows at most {limit}",
                    limit = tier.max_input_tokens,
                    tier = tier.name,
                ),
            )
            .with_param(match head.api {
                request::ApiKind::Chat => "messages",
                request::ApiKind::Completions => "prompt",
            }));
        }
    };

    let mut rewritten = false;
    let max_output_tokens = match max_output {
        MaxOutput::Absent => {
            json.insert("max_tokens".to_owned(), tier.default_output_tokens.into());
            rewritten = true;
            tier.default_output_tokens
        }
        MaxOutput::Given { tokens, .. } if tokens <= u64::from(tier.max_output_tokens) => {
            tokens as u32
        }
        MaxOutput::Given { tokens, fields } => match tier.output_limit {
            OutputLimitPolicy::Reject => {
                let field = if fields.max_completion_tokens {
                    "max_completion_tokens"
                } else {
                    "max_tokens"
                };
                return Err(LocalReply::new(
                    Reason::OutputTokensExceeded,
                    format!(
                        "{field} is {tokens}; tier {:?} allows at most {}",
                        tier.name, tier.max_output_tokens
                    ),
                )
                .with_param(field));
            }
            OutputLimitPolicy::Clamp => {
                for (present, field) in [
                    (fields.max_tokens, "max_tokens"),
                    (fields.max_completion_tokens, "max_completion_tokens"),
                ] {
                    if present {
                        json.insert(field.to_owned(), tier.max_output_tokens.into());
                    }
                }
                rewritten = true;
                tier.max_output_tokens
            }
        },
    };
    if stream && policy.inject_stream_usage {
        rewritten |= request_stream_usage(&mut json)?;
    }

    let new_body = rewritten
        .then(|| serde_json::to_vec(&Value::Object(json)).expect("a JSON value always serializes"));
    Ok(Admission {
        upstream_headers: vec![
            ("x-tollgate-tenant", head.identity.tenant.clone()),
            ("x-tollgate-tier", tier.name.clone()),
            ("x-tollgate-input-tokens", input_tokens.to_string()),
        ],
        identity: head.identity.clone(),
        model,
        encoding,
        stream,
        input_tokens,
        max_output_tokens,
        choices,
        new_body,
        chat_template_refused: template_refused,
    })
}

/// Sets `stream_options.include_usage` so the upstream ends the stream with a usage chunk;
/// returns whether the body changed.
fn request_stream_usage(json: &mut Map<String, Value>) -> Result<bool, LocalReply> {
    let options = json
        .entry("stream_options")
        .or_insert_with(|| Value::Object(Map::new()));
    if options.is_null() {
        *options = Value::Object(Map::new());
    }
    let Value::Object(options) = options else {
        return Err(
            LocalReply::new(Reason::InvalidRequest, "stream_options: must be an object")
                .with_param("stream_options"),
        );
    };
    if options.get("include_usage") == Some(&Value::Bool(true)) {
        return Ok(false);
    }
    options.insert("include_usage".to_owned(), Value::Bool(true));
    Ok(true)
}

#[cfg(test)]
mod tests;
