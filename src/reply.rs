//! The answers clients see when tollgate says no.
//!
//! Every local reply is OpenAI-shaped JSON (`{"error":{"message","type","param","code"}}`) with
//! `content-type: application/json` and an `x-tollgate-reason` header naming the rule, so SDKs
//! parse it like any upstream error and operators can grep for the rule. A refusal is a value
//! (`LocalReply`), not an error: the code that decides returns it, the adapter sends it.

pub mod rate_limit;

/// Why a request was refused. The wire names (`as_str`) are a stable interface: they appear in
/// the `x-tollgate-reason` header and as the `reason` metric label, pre-created for all values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    MissingIdentity,
    InvalidApiKey,
    UnknownTier,
    MissingBody,
    InvalidContentType,
    UnsupportedContentEncoding,
    BodyTooLarge,
    IncompleteBody,
    MalformedJson,
    InvalidRequest,
    InvalidMaxTokens,
    InputTokensExceeded,
    OutputTokensExceeded,
    TokenBudgetExhausted,
    RequestRateExceeded,
    ConcurrencyLimitReached,
    RequestExceedsBudget,
    BudgetStoreUnavailable,
    QueueFull,
    /// Queued requests already hold `scheduler.max_queued_body_bytes` of request bodies.
    QueueBytesFull,
    QueueTimeout,
    /// A large body waited `tokens.large_body_max_wait_ms` for a thread to count it.
    CountingBacklog,
    ShuttingDown,
}

impl Reason {
    pub const ALL: [Reason; 23] = [
        Reason::MissingIdentity,
        Reason::InvalidApiKey,
        Reason::UnknownTier,
        Reason::MissingBody,
        Reason::InvalidContentType,
        Reason::UnsupportedContentEncoding,
        Reason::BodyTooLarge,
        Reason::IncompleteBody,
        Reason::MalformedJson,
        Reason::InvalidRequest,
        Reason::InvalidMaxTokens,
        Reason::InputTokensExceeded,
        Reason::OutputTokensExceeded,
        Reason::TokenBudgetExhausted,
        Reason::RequestRateExceeded,
        Reason::ConcurrencyLimitReached,
        Reason::RequestExceedsBudget,
        Reason::BudgetStoreUnavailable,
        Reason::QueueFull,
        Reason::QueueBytesFull,
        Reason::QueueTimeout,
        Reason::CountingBacklog,
        Reason::ShuttingDown,
    ];

    /// The one table of refusals: every rule's wire name, HTTP status, and the headers it
    /// always carries. Headers that depend on the request (a 429's computed `retry-after` and
    /// rate-limit headers) travel in `LocalReply::headers`.
    const fn rule(self) -> Rule {
        // Overload clears by itself within moments: every 503 tells clients to come back soon.
        const RETRY_SOON: &[(&str, &str)] = &[("retry-after", "1")];
        const NONE: &[(&str, &str)] = &[];
        let (name, status, headers) = match self {
            Reason::MissingIdentity => ("missing_identity", 401, NONE),
            Reason::InvalidApiKey => ("invalid_api_key", 401, NONE),
            Reason::UnknownTier => ("unknown_tier", 401, NONE),
            Reason::MissingBody => ("missing_body", 400, NONE),
            Reason::InvalidContentType => ("invalid_content_type", 400, NONE),
            Reason::UnsupportedContentEncoding => ("unsupported_content_encoding", 415, NONE),
            Reason::BodyTooLarge => ("body_too_large", 413, NONE),
            Reason::IncompleteBody => ("incomplete_body", 413, NONE),
            Reason::MalformedJson => ("malformed_json", 400, NONE),
            Reason::InvalidRequest => ("invalid_request", 400, NONE),
            Reason::InvalidMaxTokens => ("invalid_max_tokens", 400, NONE),
            Reason::InputTokensExceeded => ("input_tokens_exceeded", 400, NONE),
            Reason::OutputTokensExceeded => ("output_tokens_exceeded", 400, NONE),
            Reason::TokenBudgetExhausted => ("token_budget_exhausted", 429, NONE),
            Reason::RequestRateExceeded => ("request_rate_exceeded", 429, NONE),
            Reason::ConcurrencyLimitReached => ("concurrency_limit_reached", 429, NONE),
            Reason::RequestExceedsBudget => ("request_exceeds_budget", 429, NONE),
            Reason::BudgetStoreUnavailable => ("budget_store_unavailable", 503, RETRY_SOON),
            Reason::QueueFull => ("queue_full", 503, RETRY_SOON),
            Reason::QueueBytesFull => ("queue_bytes_full", 503, RETRY_SOON),
            Reason::QueueTimeout => ("queue_timeout", 503, RETRY_SOON),
            Reason::CountingBacklog => ("counting_backlog", 503, RETRY_SOON),
            Reason::ShuttingDown => ("shutting_down", 503, RETRY_SOON),
        };
        Rule {
            name,
            status,
            headers,
        }
    }

    pub fn as_str(self) -> &'static str {
        self.rule().name
    }

    /// The HTTP status this rule answers with.
    pub fn status(self) -> u16 {
        self.rule().status
    }

    /// The headers every reply for this rule carries, besides content-type and
    /// `x-tollgate-reason`.
    pub fn fixed_headers(self) -> &'static [(&'static str, &'static str)] {
        self.rule().headers
    }

    /// OpenAI's `error.type`: for rate limits, which quantity ran out.
    fn error_type(self) -> &'static str {
        match self {
            Reason::TokenBudgetExhausted | Reason::RequestExceedsBudget => return "tokens",
            Reason::RequestRateExceeded | Reason::ConcurrencyLimitReached => return "requests",
            _ => {}
        }
        match self.status() {
            401 => "authentication_error",
            503 => "server_error",
            _ => "invalid_request_error",
        }
    }

    /// OpenAI's `error.code`: their own codes where one exists, else the rule's name.
    fn error_code(self) -> &'static str {
        match self {
            Reason::InvalidApiKey => "invalid_api_key",
            Reason::InputTokensExceeded => "context_length_exceeded",
            Reason::TokenBudgetExhausted
            | Reason::RequestRateExceeded
            | Reason::ConcurrencyLimitReached
            | Reason::RequestExceedsBudget => "rate_limit_exceeded",
            other => other.as_str(),
        }
    }
}

/// `reason`'s label values are the `x-tollgate-reason` names.
impl crate::observe::LabelValue for Reason {
    const ALL: &'static [Reason] = &Reason::ALL;

    fn label(self) -> &'static str {
        self.as_str()
    }
}

/// One row of `Reason::rule`.
struct Rule {
    name: &'static str,
    status: u16,
    headers: &'static [(&'static str, &'static str)],
}

/// A complete local reply: what Envoy sends the client instead of forwarding the request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalReply {
    pub reason: Reason,
    /// What was wrong and, where a limit was hit, the limit and the value.
    pub message: String,
    /// The request field at fault, if any (`error.param`).
    pub param: Option<&'static str>,
    /// Headers computed for this request (a 429's `retry-after` and rate-limit headers); the
    /// reason's fixed ones are in `Reason::fixed_headers`, and `all_headers` yields both.
    pub headers: Vec<(&'static str, String)>,
}

impl LocalReply {
    pub fn new(reason: Reason, message: impl Into<String>) -> LocalReply {
        LocalReply {
            reason,
            message: message.into(),
            param: None,
            headers: Vec::new(),
        }
    }

    pub fn with_param(mut self, param: &'static str) -> LocalReply {
        self.param = Some(param);
        self
    }

    pub fn with_header(mut self, name: &'static str, value: impl Into<String>) -> LocalReply {
        self.headers.push((name, value.into()));
        self
    }

    pub fn status(&self) -> u16 {
        self.reason.status()
    }

    /// Every header of the reply besides content-type and `x-tollgate-reason`: the reason's
    /// fixed ones, then this request's.
    pub fn all_headers(&self) -> impl Iterator<Item = (&'static str, &str)> {
        let fixed = self.reason.fixed_headers().iter().copied();
        fixed.chain(
            self.headers
                .iter()
                .map(|(name, value)| (*name, value.as_str())),
        )
    }

    /// The OpenAI-shaped JSON body.
    pub fn body(&self) -> Vec<u8> {
        let body = serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.reason.error_type(),
                "param": self.param,
                "code": self.reason.error_code(),
            }
        });
        serde_json::to_vec(&body).expect("a JSON value always serializes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_has_a_distinct_wire_name() {
        let mut names: Vec<_> = Reason::ALL.iter().map(|r| r.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Reason::ALL.len());
    }

    #[test]
    fn every_503_and_only_a_503_says_retry_soon() {
        for reason in Reason::ALL {
            let soon = reason.fixed_headers().contains(&("retry-after", "1"));
            assert_eq!(soon, reason.status() == 503, "{reason:?}");
        }
        let reply = LocalReply::new(Reason::QueueFull, "full").with_header("x-extra", "1");
        assert_eq!(
            reply.all_headers().collect::<Vec<_>>(),
            [("retry-after", "1"), ("x-extra", "1")],
            "the table's headers first, then the request's"
        );
    }

    #[test]
    fn body_is_openai_shaped() {
        let reply = LocalReply::new(Reason::InputTokensExceeded, "too long").with_param("messages");
        let v: serde_json::Value = serde_json::from_slice(&reply.body()).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"error": {
                "message": "too long",
                "type": "invalid_request_error",
                "param": "messages",
                "code": "context_length_exceeded",
            }})
        );
        assert_eq!(reply.status(), 400);
    }

    #[test]
    fn statuses_by_class() {
        let table = [
            (Reason::MissingIdentity, 401, "authentication_error"),
            (Reason::BodyTooLarge, 413, "invalid_request_error"),
            (
                Reason::UnsupportedContentEncoding,
                415,
                "invalid_request_error",
            ),
            (Reason::MalformedJson, 400, "invalid_request_error"),
            (Reason::ShuttingDown, 503, "server_error"),
        ];
        for (reason, status, error_type) in table {
            assert_eq!(reason.status(), status, "{reason:?}");
            assert_eq!(reason.error_type(), error_type, "{reason:?}");
        }
    }
}
