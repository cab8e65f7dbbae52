//! What a request is: who sent it, whether it is an inference call, and what its OpenAI body asks
//! for, with the input tokens counted exactly.
//!
//! Pure code: headers and body bytes in, values or a `LocalReply` out. No clock, no I/O, no
//! protobuf (the ext_proc adapter turns Envoy's header map into `Header` slices first).

use std::borrow::Cow;

use serde_json::{Map, Value};

use crate::policy::{Policy, TierId};
use crate::reply::{LocalReply, Reason};
use crate::tokens::{ChatTemplate, CountScope, Encoding};

/// One request header as Envoy sent it. Names are lowercase (HTTP/2 and Envoy normalise them);
/// values are bytes because Envoy sends `raw_value` and nothing guarantees UTF-8.
#[derive(Clone, Copy, Debug)]
pub struct Header<'a> {
    pub name: &'a str,
    pub value: &'a [u8],
}

/// The tenant a request is charged to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    pub tenant: String,
    pub tier: TierId,
}

/// Which OpenAI API the body follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApiKind {
    Chat,
    Completions,
}

/// What the request headers say, for an inference route.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InferenceHead {
    pub identity: Identity,
    pub api: ApiKind,
    /// `x-tollgate-*` headers the client sent: removed so only tollgate's own values go upstream.
    pub spoofed_headers: Vec<String>,
}

/// The verdict on request headers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HeadVerdict {
    /// An inference call with an identity: wait for its body.
    Inference(InferenceHead),
    /// Not an inference route: pass it through untouched.
    PassThrough,
    Reject(LocalReply),
}

/// Longest tenant id accepted; longer ones are almost certainly not ids, and they end up in
/// Redis keys and logs.
const MAX_TENANT_LEN: usize = 256;

/// Classifies a request from its headers alone. `end_of_stream` is Envoy's flag that no body
/// follows.
pub fn classify_head(policy: &Policy, headers: &[Header<'_>], end_of_stream: bool) -> HeadVerdict {
    let find = |name: &str| headers.iter().find(|h| h.name == name).map(|h| h.value);
    let path = find(":path").unwrap_or_default();
    let path = path.split(|&b| b == b'?').next().unwrap_or_default();
    // Match the path the upstream will route on: vLLM (uvicorn) percent-decodes before routing,
    // so `/v1/chat/%63ompletions` must not slip past as a non-inference route.
    let path = percent_decode(path);
    let is_post = find(":method") == Some(b"POST".as_slice());
    let Some(route) = policy
        .inference_paths
        .iter()
        .find(|p| p.as_bytes() == path.as_slice())
        .filter(|_| is_post)
    else {
        return HeadVerdict::PassThrough;
    };
    let api =
        if route.ends_with(&policy.completions_suffix) && !route.ends_with("/chat/completions") {
            ApiKind::Completions
        } else {
            ApiKind::Chat
        };

    let identity = match identify(policy, &find) {
        Ok(identity) => identity,
        Err(reply) => return HeadVerdict::Reject(reply),
    };
    if end_of_stream {
        return HeadVerdict::Reject(LocalReply::new(
            Reason::MissingBody,
            format!("POST {route} needs a JSON body"),
        ));
    }
    if let Some(value) = find("content-type") {
        let media_type = value.split(|&b| b == b';').next().unwrap_or_default();
        let media_type = String::from_utf8_lossy(media_type)
            .trim()
            .to_ascii_lowercase();
        if media_type != "application/json" && !media_type.ends_with("+json") {
            return HeadVerdict::Reject(LocalReply::new(
                Reason::InvalidContentType,
                format!("content-type {media_type:?} is not supported: send application/json"),
            ));
        }
    }
    if let Some(value) = find("content-encoding") {
        let encoding = String::from_utf8_lossy(value).trim().to_ascii_lowercase();
        if encoding != "identity" {
            return HeadVerdict::Reject(LocalReply::new(
                Reason::UnsupportedContentEncoding,
                format!(
                    "content-encoding {encoding:?} is not supported: tokens can only be counted in an uncompressed body"
                ),
            ));
        }
    }
    let spoofed_headers = headers
        .iter()
        .filter(|h| h.name.starts_with("x-tollgate-"))
        .map(|h| h.name.to_owned())
        .collect();
    HeadVerdict::Inference(InferenceHead {
        identity,
        api,
        spoofed_headers,
    })
}

/// Decodes `%XX` escapes as Python's `unquote` does: a malformed escape stays as it is.
fn percent_decode(path: &[u8]) -> Vec<u8> {
    let hex = |b: u8| (b as char).to_digit(16).map(|d| d as u8);
    let mut out = Vec::with_capacity(path.len());
    let mut i = 0;
    while i < path.len() {
        if path[i] == b'%'
            && let (Some(hi), Some(lo)) = (
                path.get(i + 1).copied().and_then(hex),
                path.get(i + 2).copied().and_then(hex),
            )
        {
            out.push(hi << 4 | lo);
            i += 3;
        } else {
            out.push(path[i]);
            i += 1;
        }
    }
    out
}

/// API key first (it is proof), then the identity header set by a trusted layer in front.
fn identify<'a>(
    policy: &Policy,
    find: &impl Fn(&str) -> Option<&'a [u8]>,
) -> Result<Identity, LocalReply> {
    let rules = &policy.identity;
    if rules.has_api_keys()
        && let Some(key) = find("authorization").and_then(bearer_token)
    {
        return match rules.owner_of_key(key) {
            Some(owner) => Ok(Identity {
                tenant: owner.tenant.clone(),
                tier: owner.tier,
            }),
            None => Err(LocalReply::new(
                Reason::InvalidApiKey,
                "the API key in the Authorization header is not known",
            )),
        };
    }
    let missing = || {
        let mut ways = Vec::new();
        if !rules.user_header.is_empty() {
            ways.push(format!("a {} header", rules.user_header));
        }
        if rules.has_api_keys() {
            ways.push("an Authorization: Bearer API key".to_owned());
        }
        LocalReply::new(
            Reason::MissingIdentity,
            format!("no identity: send {}", ways.join(" or ")),
        )
    };
    if rules.user_header.is_empty() {
        return Err(missing());
    }
    let Some(raw_tenant) = find(&rules.user_header) else {
        return Err(missing());
    };
    let tenant = match std::str::from_utf8(raw_tenant).map(str::trim) {
        Ok("") => return Err(missing()),
        Ok(t) if t.len() <= MAX_TENANT_LEN && !t.chars().any(char::is_control) => t,
        _ => {
            return Err(LocalReply::new(
                Reason::MissingIdentity,
                format!(
                    "the {} header must be 1-{MAX_TENANT_LEN} bytes of printable UTF-8",
                    rules.user_header
                ),
            ));
        }
    };
    let tier = match find(&rules.tier_header)
        .filter(|v| !rules.tier_header.is_empty() && !v.trim_ascii().is_empty())
    {
        None => policy.default_tier,
        Some(raw) => {
            let name = String::from_utf8_lossy(raw);
            let name = name.trim();
            match policy.tier_named(name) {
                Some(tier) => tier,
                None => {
                    let known: Vec<_> = policy.tiers.iter().map(|t| t.name.as_str()).collect();
                    return Err(LocalReply::new(
                        Reason::UnknownTier,
                        format!(
                            "tier {name:?} in {} is not one of: {}",
                            rules.tier_header,
                            known.join(", ")
                        ),
                    ));
                }
            }
        }
    };
    Ok(Identity {
        tenant: tenant.to_owned(),
        tier,
    })
}

fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    let (scheme, rest) = value.split_at(value.iter().position(|&b| b == b' ')?);
    scheme
        .eq_ignore_ascii_case(b"bearer")
        .then(|| rest.trim_ascii())
        .filter(|k| !k.is_empty())
}

/// An OpenAI request body, parsed and counted.
#[derive(Clone, Debug, PartialEq)]
pub struct ParsedBody {
    pub json: Map<String, Value>,
    pub model: String,
    pub encoding: Encoding,
    pub stream: bool,
    pub input: InputCount,
    pub max_output: MaxOutput,
    /// `n`: how many completions the upstream generates, each up to the output limit.
    pub choices: u32,
    /// The model's chat template refused this chat (as vLLM would), so it was counted by the
    /// per-message recipe instead.
    pub template_refused: bool,
}

/// Input tokens, counted exactly until the ceiling and no further (a 1 MB prompt over the
/// ceiling costs no more to refuse than one just over it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InputCount {
    Exact(u32),
    OverCeiling,
}

/// The output length the request asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MaxOutput {
    Absent,
    /// The effective value and the field(s) that carry it.
    Given {
        tokens: u64,
        fields: OutputFields,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutputFields {
    pub max_tokens: bool,
    pub max_completion_tokens: bool,
}

/// Parses the body and counts its input tokens, stopping once past `input_ceiling`. Long
/// texts `tenant` sent before are not counted again (`tokens::count_cache`).
pub fn parse_body(
    policy: &Policy,
    api: ApiKind,
    body: &[u8],
    input_ceiling: u32,
    tenant: &str,
) -> Result<ParsedBody, LocalReply> {
    let json: Value = serde_json::from_slice(body).map_err(|e| {
        LocalReply::new(
            Reason::MalformedJson,
            format!("the request body is not valid JSON: {e}"),
        )
    })?;
    let Value::Object(json) = json else {
        return Err(LocalReply::new(
            Reason::InvalidRequest,
            "the request body must be a JSON object",
        ));
    };
    let model = match json.get("model") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(m)) => m.clone(),
        Some(_) => return Err(invalid("model", "must be a string")),
    };
    let encoding = policy.encoding_for(&model);
    let stream = match json.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(invalid("stream", "must be true or false")),
    };
    let choices = match json.get("n") {
        None | Some(Value::Null) => 1,
        Some(v) => match v.as_u64() {
            Some(n @ 1..=128) => n as u32,
            _ => return Err(invalid("n", "must be an integer from 1 to 128")),
        },
    };
    let max_output = max_output(&json)?;

    let mut counter = Counter::new(encoding, CountScope::of(tenant), input_ceiling as u64);
    let mut template_refused = false;
    let within = match (api, encoding.chat_template()) {
        (ApiKind::Chat, Some(template)) => {
            match count_templated_chat(policy, template, &json, &mut counter)? {
                Some(within) => within,
                // The template refused this conversation (as vLLM would): counted by the
                // recipe instead, so the request is still judged on its size.
                None => {
                    template_refused = true;
                    count_chat(policy, &json, &mut counter)?
                }
            }
        }
        (ApiKind::Chat, None) => count_chat(policy, &json, &mut counter)?,
        (ApiKind::Completions, _) => count_prompt(&json, &mut counter)?,
    };
    let input = if within {
        InputCount::Exact(counter.counted as u32)
    } else {
        InputCount::OverCeiling
    };
    Ok(ParsedBody {
        json,
        model,
        encoding,
        stream,
        input,
        max_output,
        choices,
        template_refused,
    })
}

fn invalid(param: &'static str, what: &str) -> LocalReply {
    LocalReply::new(Reason::InvalidRequest, format!("{param}: {what}")).with_param(param)
}

fn max_output(json: &Map<String, Value>) -> Result<MaxOutput, LocalReply> {
    let mut effective = None;
    let mut fields = OutputFields {
        max_tokens: false,
        max_completion_tokens: false,
    };
    // max_completion_tokens is OpenAI's current name and wins when both are present.
    for field in ["max_tokens", "max_completion_tokens"] {
        match json.get(field) {
            None | Some(Value::Null) => {}
            Some(v) => match v.as_u64().filter(|&n| n >= 1) {
                Some(n) => {
                    effective = Some(n);
                    if field == "max_tokens" {
                        fields.max_tokens = true;
                    } else {
                        fields.max_completion_tokens = true;
                    }
                }
                None => {
                    return Err(LocalReply::new(
                        Reason::InvalidMaxTokens,
                        format!("{field} must be a positive integer, got {v}"),
                    )
                    .with_param(if field == "max_tokens" {
                        "max_tokens"
                    } else {
                        "max_completion_tokens"
                    }));
                }
            },
        }
    }
    Ok(match effective {
        None => MaxOutput::Absent,
        Some(tokens) => MaxOutput::Given { tokens, fields },
    })
}

/// Counts into a shrinking allowance; `add` returns false once the allowance is exceeded.
struct Counter {
    encoding: Encoding,
    /// Whose texts' counts may be reused.
    scope: CountScope,
    remaining: u64,
    counted: u64,
    /// Walk the request only to check its shape, counting no text and never running out (a
    /// templated chat checks the messages first, then counts what the template renders).
    shape_only: bool,
}

impl Counter {
    fn new(encoding: Encoding, scope: CountScope, allowance: u64) -> Counter {
        Counter {
            encoding,
            scope,
            remaining: allowance,
            counted: 0,
            shape_only: false,
        }
    }

    fn add_text(&mut self, text: &str) -> bool {
        if self.shape_only {
            return true;
        }
        let limit = usize::try_from(self.remaining).unwrap_or(usize::MAX);
        match self
            .encoding
            .count_till_limit_cached(self.scope, text, limit)
        {
            Some(n) => self.add_fixed(n as u64),
            None => false,
        }
    }

    fn add_fixed(&mut self, n: u64) -> bool {
        if self.shape_only {
            return true;
        }
        if n > self.remaining {
            return false;
        }
        self.remaining -= n;
        self.counted += n;
        true
    }
}

/// A chat as the model's own template renders it (vLLM counts the prompt that way): the
/// messages' shape is checked as `count_chat` checks it, text parts are joined with newlines
/// (as vLLM joins them for a template that takes string content), each image costs
/// `tokens.per_image`, and the rendered prompt is counted with its added tokens. `Ok(None)` when
/// the template refuses the conversation.
fn count_templated_chat(
    policy: &Policy,
    template: &ChatTemplate,
    json: &Map<String, Value>,
    counter: &mut Counter,
) -> Result<Option<bool>, LocalReply> {
    let mut shape = Counter {
        shape_only: true,
        ..Counter::new(counter.encoding, counter.scope, u64::MAX)
    };
    count_chat(policy, json, &mut shape)?;
    let Some(all @ Value::Array(messages)) = json.get("messages") else {
        unreachable!("count_chat refuses a chat without messages");
    };
    let has_parts = |message: &Value| matches!(message.get("content"), Some(Value::Array(_)));
    let mut images = 0u64;
    // Most chats carry string content and go to the template as they are; only one with
    // content parts is copied, to join its text.
    let messages: Cow<'_, Value> = if !messages.iter().any(has_parts) {
        Cow::Borrowed(all)
    } else {
        Cow::Owned(Value::Array(
            messages
                .iter()
                .map(|message| {
                    let Some(Value::Array(parts)) = message.get("content") else {
                        return message.clone();
                    };
                    let mut texts = Vec::new();
                    for part in parts {
                        match part.get("type").and_then(Value::as_str) {
                            Some("text") => texts.extend(part.get("text").and_then(Value::as_str)),
                            Some("refusal") => {
                                texts.extend(part.get("refusal").and_then(Value::as_str));
                            }
                            _ => images += 1,
                        }
                    }
                    let mut message = message.clone();
                    message["content"] = Value::String(texts.join("\n"));
                    message
                })
                .collect(),
        ))
    };
    let tools = json.get("tools").filter(|tools| !tools.is_null());
    let Ok(prompt) = template.render(&messages, tools) else {
        return Ok(None);
    };
    let per_image = u64::from(policy.counting.per_image);
    Ok(Some(
        counter.add_fixed(images * per_image) && counter.add_text(&prompt),
    ))
}

/// OpenAI's chat counting recipe: framing per message, the text of every field that reaches
/// the model, a flat cost per image, and the priming of the reply. Returns false once over.
fn count_chat(
    policy: &Policy,
    json: &Map<String, Value>,
    counter: &mut Counter,
) -> Result<bool, LocalReply> {
    let costs = &policy.counting;
    let messages = match json.get("messages") {
        Some(Value::Array(m)) if !m.is_empty() => m,
        Some(Value::Array(_)) => return Err(invalid("messages", "must not be empty")),
        _ => return Err(invalid("messages", "must be an array of message objects")),
    };
    for (i, message) in messages.iter().enumerate() {
        let Value::Object(message) = message else {
            return Err(invalid("messages", &format!("[{i}] must be an object")));
        };
        let Some(Value::String(role)) = message.get("role") else {
            return Err(invalid("messages", &format!("[{i}].role must be a string")));
        };
        if !(counter.add_fixed(costs.per_message.into()) && counter.add_text(role)) {
            return Ok(false);
        }
        match message.get("content") {
            None | Some(Value::Null) => {}
            Some(Value::String(text)) => {
                if !counter.add_text(text) {
                    return Ok(false);
                }
            }
            Some(Value::Array(parts)) => {
                for part in parts {
                    if !count_part(policy, i, part, counter)? {
                        return Ok(false);
                    }
                }
            }
            Some(_) => {
                return Err(invalid(
                    "messages",
                    &format!("[{i}].content must be a string or an array of content parts"),
                ));
            }
        }
        match message.get("name") {
            None | Some(Value::Null) => {}
            Some(Value::String(name)) => {
                if !(counter.add_fixed(costs.per_name.into()) && counter.add_text(name)) {
                    return Ok(false);
                }
            }
            Some(_) => return Err(invalid("messages", &format!("[{i}].name must be a string"))),
        }
        // Tool calls an assistant made earlier are replayed to the model as text.
        if let Some(calls) = message.get("tool_calls").filter(|v| !v.is_null())
            && !counter.add_text(&calls.to_string())
        {
            return Ok(false);
        }
    }
    // Tool and function definitions reach the model too; their JSON text is a close, slightly
    // high estimate of the model-specific rendering.
    for field in ["tools", "functions"] {
        if let Some(defs) = json.get(field).filter(|v| !v.is_null())
            && !counter.add_text(&defs.to_string())
        {
            return Ok(false);
        }
    }
    Ok(counter.add_fixed(costs.reply_priming.into()))
}

fn count_part(
    policy: &Policy,
    message: usize,
    part: &Value,
    counter: &mut Counter,
) -> Result<bool, LocalReply> {
    let where_ = || format!("[{message}].content[]");
    let Value::Object(part) = part else {
        return Err(invalid(
            "messages",
            &format!("{} parts must be objects", where_()),
        ));
    };
    match part.get("type").and_then(Value::as_str) {
        Some("text") => match part.get("text") {
            Some(Value::String(text)) => Ok(counter.add_text(text)),
            _ => Err(invalid(
                "messages",
                &format!("{} text part needs a string `text`", where_()),
            )),
        },
        Some("refusal") => match part.get("refusal") {
            Some(Value::String(text)) => Ok(counter.add_text(text)),
            _ => Err(invalid(
                "messages",
                &format!("{} refusal part needs a string `refusal`", where_()),
            )),
        },
        Some("image_url" | "input_image") => {
            Ok(counter.add_fixed(policy.counting.per_image.into()))
        }
        Some(other) => Err(invalid(
            "messages",
            &format!(
                "{} content part type {other:?} is not supported (text, image_url, input_image, refusal)",
                where_()
            ),
        )),
        None => Err(invalid(
            "messages",
            &format!("{} content part needs a string `type`", where_()),
        )),
    }
}

/// Completions `prompt`: a string, an array of strings, or pre-tokenized (an array of token ids,
/// or an array of such arrays), whose length is the exact count.
fn count_prompt(json: &Map<String, Value>, counter: &mut Counter) -> Result<bool, LocalReply> {
    let bad = || {
        invalid(
            "prompt",
            "must be a string, an array of strings, an array of token ids, or an array of token-id arrays",
        )
    };
    // vLLM encodes a text prompt with the tokenizer's special tokens (`add_special_tokens`
    // defaults to true for completions): Mistral's `<s>`, for one. Token-id prompts go as given.
    let specials = u64::from(counter.encoding.prompt_special_tokens());
    let mut add_prompt = |text: &str| counter.add_fixed(specials) && counter.add_text(text);
    match json.get("prompt") {
        Some(Value::String(text)) => Ok(add_prompt(text)),
        Some(Value::Array(items)) if !items.is_empty() => {
            if items.iter().all(Value::is_string) {
                Ok(items.iter().filter_map(Value::as_str).all(&mut add_prompt))
            } else if items.iter().all(Value::is_u64) {
                Ok(counter.add_fixed(items.len() as u64))
            } else if items.iter().all(|v| {
                v.as_array()
                    .is_some_and(|ids| !ids.is_empty() && ids.iter().all(Value::is_u64))
            }) {
                Ok(items
                    .iter()
                    .filter_map(Value::as_array)
                    .all(|ids| counter.add_fixed(ids.len() as u64)))
            } else {
                Err(bad())
            }
        }
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests;
