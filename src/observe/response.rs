//! Watching an admitted request's response go by: first byte, usage, and whether it ended
//! properly.
//!
//! Pure and incremental: chunks in, facts out. A stream is complete only when the upstream said
//! so (SSE `data: [DONE]`, or the end of a JSON body); a connection that closes early after a
//! 200 is a truncated stream, not a success (seed 000: vLLM under load closes streams without
//! `[DONE]`, and status-code accounting counted those as successes).

use std::fmt;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

use crate::tokens::Encoding;

/// Token usage as the upstream reported it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

/// How an admitted request's response ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResponseEnd {
    /// The upstream finished the response properly.
    Complete,
    /// A 2xx response that stopped before its proper end (reset, client gone, upstream died).
    Truncated,
    /// The upstream answered with a non-2xx status.
    UpstreamError,
    /// The stream ended before any response arrived.
    NoResponse,
}

impl ResponseEnd {
    pub const ALL: [ResponseEnd; 4] = [
        ResponseEnd::Complete,
        ResponseEnd::Truncated,
        ResponseEnd::UpstreamError,
        ResponseEnd::NoResponse,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ResponseEnd::Complete => "complete",
            ResponseEnd::Truncated => "truncated",
            ResponseEnd::UpstreamError => "upstream_error",
            ResponseEnd::NoResponse => "no_response",
        }
    }
}

impl super::LabelValue for ResponseEnd {
    const ALL: &'static [ResponseEnd] = &ResponseEnd::ALL;

    fn label(self) -> &'static str {
        self.as_str()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BodyFormat {
    /// `text/event-stream`: usage in a `data:` chunk, end marked by `data: [DONE]`.
    EventStream,
    /// Anything else: buffered (bounded) and read as one JSON document at the end.
    Json,
}

/// Longest SSE line kept while waiting for its end; a longer line cannot be a usage chunk
/// worth reading, and keeping it would let an upstream grow our memory without bound.
const MAX_SSE_LINE: usize = 1024 * 1024;

#[derive(Debug)]
pub struct ResponseObserver {
    status: u16,
    format: BodyFormat,
    /// An SSE line not yet ended by `\n`, or the JSON body so far.
    pending: Vec<u8>,
    /// Bytes dropped because `pending` would have grown past its bound.
    overflowed: bool,
    json_limit: usize,
    saw_done: bool,
    usage: Option<Usage>,
    body_bytes: u64,
    ended: bool,
    /// Counts generated text when set, for settling requests whose upstream reports no usage.
    output_encoding: Option<Encoding>,
    output_tokens: u64,
}

impl ResponseObserver {
    /// Starts watching a response with `status` and `content_type` (from the response headers).
    pub fn new(status: u16, content_type: Option<&[u8]>, json_limit: usize) -> ResponseObserver {
        let is_sse = content_type.is_some_and(|ct| {
            ct.len() >= 17 && ct[..17].eq_ignore_ascii_case(b"text/event-stream")
        });
        ResponseObserver {
            status,
            format: if is_sse {
                BodyFormat::EventStream
            } else {
                BodyFormat::Json
            },
            pending: Vec::new(),
            overflowed: false,
            json_limit,
            saw_done: false,
            usage: None,
            body_bytes: 0,
            ended: false,
            output_encoding: None,
            output_tokens: 0,
        }
    }

    /// Also counts the generated text's tokens with `encoding` (`output_tokens`).
    pub fn counting_output(mut self, encoding: Encoding) -> ResponseObserver {
        self.output_encoding = Some(encoding);
        self
    }

    /// Tokens of generated text seen so far (0 unless `counting_output`; 0 too for a JSON body
    /// that reports `usage`, which is what gets charged then).
    pub fn output_tokens(&self) -> u64 {
        self.output_tokens
    }

    /// Feeds one body chunk. Returns true if this chunk carried the first body byte.
    pub fn on_chunk(&mut self, chunk: &[u8], end_of_stream: bool) -> bool {
        let first = self.body_bytes == 0 && !chunk.is_empty();
        self.body_bytes += chunk.len() as u64;
        if self.is_success() {
            match self.format {
                BodyFormat::EventStream => self.scan_event_stream(chunk),
                BodyFormat::Json => self.buffer_json(chunk),
            }
        }
        if end_of_stream {
            self.on_end_of_stream();
        }
        first
    }

    /// The upstream signalled the end (end_of_stream on headers or on the last body chunk).
    pub fn on_end_of_stream(&mut self) {
        if self.ended {
            return;
        }
        self.ended = true;
        match self.format {
            BodyFormat::EventStream => {
                // A final line without a trailing newline still counts.
                let line = std::mem::take(&mut self.pending);
                self.scan_line(&line);
            }
            BodyFormat::Json if self.is_success() && !self.overflowed => {
                // Usage first, without building the document: an upstream nearly always
                // reports it, and then that is all a settle needs.
                self.usage = usage_in(&self.pending);
                // The count only stands in for missing usage (a settle charges usage when
                // there is one), and it runs before Envoy gets its answer to the last chunk.
                // A body `usage_in` refused whole is refused here too, so nothing is counted
                // (as when the document was parsed once for both).
                if self.usage.is_none()
                    && self.output_encoding.is_some()
                    && let Ok(doc) = serde_json::from_slice::<Value>(&self.pending)
                {
                    self.count_output(&doc);
                }
                self.pending = Vec::new();
            }
            BodyFormat::Json => {}
        }
    }

    pub fn usage(&self) -> Option<Usage> {
        self.usage
    }

    pub fn body_bytes(&self) -> u64 {
        self.body_bytes
    }

    /// How the response ended, given that the ext_proc stream is over now.
    pub fn end(&self) -> ResponseEnd {
        if !self.is_success() {
            ResponseEnd::UpstreamError
        } else if !self.ended {
            ResponseEnd::Truncated
        } else {
            match self.format {
                BodyFormat::EventStream if !self.saw_done => ResponseEnd::Truncated,
                _ => ResponseEnd::Complete,
            }
        }
    }

    fn is_success(&self) -> bool {
        (200..300).contains(&self.status)
    }

    fn scan_event_stream(&mut self, mut chunk: &[u8]) {
        while let Some(newline) = chunk.iter().position(|&b| b == b'\n') {
            let (head, rest) = chunk.split_at(newline);
            chunk = &rest[1..];
            if self.pending.is_empty() {
                self.scan_line(head);
            } else {
                let mut line = std::mem::take(&mut self.pending);
                line.extend_from_slice(head);
                self.scan_line(&line);
            }
            self.overflowed = false;
        }
        if self.pending.len() + chunk.len() <= MAX_SSE_LINE {
            self.pending.extend_from_slice(chunk);
        } else {
            self.pending.clear();
            self.overflowed = true;
        }
    }

    fn scan_line(&mut self, line: &[u8]) {
        if self.overflowed {
            return;
        }
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(data) = line.strip_prefix(b"data:") else {
            return;
        };
        let data = data.trim_ascii();
        if data == b"[DONE]" {
            self.saw_done = true;
        } else if self.output_encoding.is_some() {
            if let Ok(chunk) = serde_json::from_slice::<Value>(data) {
                if let Some(usage) = usage_of(&chunk) {
                    self.usage = Some(usage);
                }
                self.count_output(&chunk);
            }
        } else if contains(data, b"\"usage\"") {
            // Without output counting, only chunks mentioning usage need reading (most carry
            // `"usage": null` or nothing), and only for their usage.
            if let Some(usage) = usage_in(data) {
                self.usage = Some(usage);
            }
        }
    }

    fn buffer_json(&mut self, chunk: &[u8]) {
        if self.overflowed {
            return;
        }
        if self.pending.len() + chunk.len() > self.json_limit {
            self.pending = Vec::new();
            self.overflowed = true;
        } else {
            self.pending.extend_from_slice(chunk);
        }
    }
}

impl ResponseObserver {
    /// Adds the tokens of generated text in a chunk or body: chat `delta.content` /
    /// `message.content`, completions `text`.
    fn count_output(&mut self, doc: &Value) {
        let Some(encoding) = self.output_encoding else {
            return;
        };
        let Some(choices) = doc.get("choices").and_then(Value::as_array) else {
            return;
        };
        for choice in choices {
            let text = choice
                .get("delta")
                .or_else(|| choice.get("message"))
                .and_then(|m| m.get("content"))
                .or_else(|| choice.get("text"))
                .and_then(Value::as_str);
            if let Some(text) = text {
                self.output_tokens += encoding.count(text) as u64;
            }
        }
    }
}

/// The usage a parsed document reports: its top-level `usage` member's counts.
fn usage_of(doc: &Value) -> Option<Usage> {
    doc.get("usage").and_then(usage_fields)
}

/// A usage object's counts; `None` unless both are integers from 0 up.
fn usage_fields(usage: &Value) -> Option<Usage> {
    Some(Usage {
        prompt_tokens: usage.get("prompt_tokens")?.as_u64()?,
        completion_tokens: usage.get("completion_tokens")?.as_u64()?,
    })
}

/// The usage a JSON document reports, exactly as parsing it into a `serde_json::Value` and
/// reading it with `usage_of` would: the last of repeated members, as `Value` keeps it, and
/// `None` for a document that is not a JSON object or that the whole parse refuses (invalid
/// UTF-8 or escapes in any string, a number out of range, nesting past serde_json's limit).
/// Only the usage member is built; everything else is checked as the whole parse checks it
/// and dropped ([`Skipped`]), where the whole parse allocated every string, array and object
/// in it, once per response on the request path.
fn usage_in(json: &[u8]) -> Option<Usage> {
    serde_json::from_slice::<UsageMember>(json).ok()?.0
}

/// A JSON object, kept only for its `usage` member ([`usage_in`]).
struct UsageMember(Option<Usage>);

impl<'de> Deserialize<'de> for UsageMember {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<UsageMember, D::Error> {
        struct Members;
        impl<'de> Visitor<'de> for Members {
            type Value = UsageMember;

            fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
                formatter.write_str("a JSON object")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut members: A) -> Result<UsageMember, A::Error> {
                let mut usage = None;
                while let Some(key) = members.next_key::<MemberName>()? {
                    match key {
                        MemberName::Usage => {
                            usage = usage_fields(&members.next_value::<Value>()?);
                        }
                        MemberName::Other => {
                            members.next_value::<Skipped>()?;
                        }
                    }
                }
                Ok(UsageMember(usage))
            }
        }
        deserializer.deserialize_map(Members)
    }
}

/// A member's name, as far as [`UsageMember`] cares; read without allocating where the name
/// has no escapes.
enum MemberName {
    Usage,
    Other,
}

impl<'de> Deserialize<'de> for MemberName {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<MemberName, D::Error> {
        struct Name;
        impl Visitor<'_> for Name {
            type Value = MemberName;

            fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
                formatter.write_str("a member name")
            }

            fn visit_str<E: de::Error>(self, name: &str) -> Result<MemberName, E> {
                Ok(if name == "usage" {
                    MemberName::Usage
                } else {
                    MemberName::Other
                })
            }
        }
        deserializer.deserialize_str(Name)
    }
}

/// Any JSON value, read as the whole parse reads it and then dropped: strings are checked
/// (UTF-8, escapes), numbers converted (out of range is an error), and nesting counts against
/// serde_json's limit. `IgnoredAny` skips with serde_json's faster scan, which checks neither
/// strings nor number ranges, so it took documents the whole parse refuses.
struct Skipped;

impl<'de> Deserialize<'de> for Skipped {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Skipped, D::Error> {
        struct Anything;
        impl<'de> Visitor<'de> for Anything {
            type Value = Skipped;

            fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
                formatter.write_str("any JSON value")
            }

            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Skipped, E> {
                Ok(Skipped)
            }

            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Skipped, E> {
                Ok(Skipped)
            }

            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Skipped, E> {
                Ok(Skipped)
            }

            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Skipped, E> {
                Ok(Skipped)
            }

            fn visit_str<E: de::Error>(self, _: &str) -> Result<Skipped, E> {
                Ok(Skipped)
            }

            fn visit_unit<E: de::Error>(self) -> Result<Skipped, E> {
                Ok(Skipped)
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut items: A) -> Result<Skipped, A::Error> {
                while items.next_element::<Skipped>()?.is_some() {}
                Ok(Skipped)
            }

            fn visit_map<A: MapAccess<'de>>(self, mut members: A) -> Result<Skipped, A::Error> {
                while members.next_entry::<Skipped, Skipped>()?.is_some() {}
                Ok(Skipped)
            }
        }
        deserializer.deserialize_any(Anything)
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[cfg(test)]
mod tests;
