//! Translation between Envoy's ext_proc messages and tollgate's own values. The only file that
//! builds or reads protobuf types.

use envoy_types::pb::envoy::config::core::v3::{
    HeaderMap, HeaderValue, HeaderValueOption, header_value_option::HeaderAppendAction,
};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::{
    ProcessingMode, processing_mode::BodySendMode, processing_mode::HeaderSendMode,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse,
    TrailersResponse, body_mutation, processing_response::Response,
};
/// Envoy's message and tollgate's answer, as the stream loop passes them through unread.
pub use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;

use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Message;

use envoy_types::pb::envoy::config::core::v3::Metadata;
pub use envoy_types::pb::envoy::service::accesslog::v3::StreamAccessLogsMessage;
use envoy_types::pb::envoy::service::accesslog::v3::stream_access_logs_message::LogEntries;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};

use crate::pipeline::Forward;
use crate::reply::LocalReply;
use crate::request::Header;

/// One of Envoy's messages, in tollgate's terms.
pub enum Inbound {
    RequestHeaders {
        headers: EnvoyHeaders,
        end_of_stream: bool,
    },
    RequestBody {
        body: Vec<u8>,
        end_of_stream: bool,
    },
    RequestTrailers,
    ResponseHeaders {
        headers: EnvoyHeaders,
        end_of_stream: bool,
    },
    ResponseBody {
        body: Vec<u8>,
        end_of_stream: bool,
    },
    ResponseTrailers,
    /// A `ProcessingRequest` that carries none of the above.
    Empty,
}

impl Inbound {
    /// The message's name in Envoy's protocol, for errors.
    pub fn name(&self) -> &'static str {
        match self {
            Inbound::RequestHeaders { .. } => "request_headers",
            Inbound::RequestBody { .. } => "request_body",
            Inbound::RequestTrailers => "request_trailers",
            Inbound::ResponseHeaders { .. } => "response_headers",
            Inbound::ResponseBody { .. } => "response_body",
            Inbound::ResponseTrailers => "response_trailers",
            Inbound::Empty => "an empty ProcessingRequest",
        }
    }
}

/// Reads one of Envoy's messages, and whether Envoy will send this stream's response body,
/// from the filter configuration it reports in the first message (`protocol_config`): `None`
/// on later messages, or from an Envoy that does not report it.
pub fn inbound(message: ProcessingRequest) -> (Inbound, Option<bool>) {
    // The raw value, not prost's getter, which reads a mode newer than this build as NONE.
    let sends_response_body = message
        .protocol_config
        .as_ref()
        .map(|config| config.response_body_mode != BodySendMode::None as i32);
    let inbound = match message.request {
        Some(Message::RequestHeaders(headers)) => Inbound::RequestHeaders {
            end_of_stream: headers.end_of_stream,
            headers: EnvoyHeaders(headers.headers),
        },
        Some(Message::RequestBody(body)) => Inbound::RequestBody {
            body: body.body,
            end_of_stream: body.end_of_stream,
        },
        Some(Message::RequestTrailers(_)) => Inbound::RequestTrailers,
        Some(Message::ResponseHeaders(headers)) => Inbound::ResponseHeaders {
            end_of_stream: headers.end_of_stream,
            headers: EnvoyHeaders(headers.headers),
        },
        Some(Message::ResponseBody(body)) => Inbound::ResponseBody {
            body: body.body,
            end_of_stream: body.end_of_stream,
        },
        Some(Message::ResponseTrailers(_)) => Inbound::ResponseTrailers,
        None => Inbound::Empty,
    };
    (inbound, sends_response_body)
}

/// The dynamic-metadata namespace reports on a response travel in (`pipeline::reports`): the
/// admission sets `tag` there, and Envoy's Lua and json_to_metadata filters write the upstream's
/// `prompt_tokens` and `completion_tokens`, and `done` for a proper end
/// (envoy/front-proxy-reports.yaml).
pub const REPORTS_NAMESPACE: &str = "tollgate";
const TAG_KEY: &str = "tag";
/// The dynamic-metadata namespace an admitted request's budget headers travel in when its
/// response is reported on, keyed by header name, for Envoy to add to the client's response.
pub const RESPONSE_HEADERS_NAMESPACE: &str = "tollgate.response_headers";

/// The report tag Envoy forwarded with a message (the first-token filter's
/// `forwarding_namespaces`).
fn forwarded_tag(message: &ProcessingRequest) -> Option<String> {
    let namespace = message
        .metadata_context
        .as_ref()?
        .filter_metadata
        .get(REPORTS_NAMESPACE)?;
    string_field(namespace, TAG_KEY).map(str::to_owned)
}

/// A message on the first-token filter's stream: the message, whether Envoy sent it in
/// observability mode (no answer wanted), and the report tag it forwarded.
pub fn first_token_message(message: ProcessingRequest) -> (Inbound, bool, Option<String>) {
    let observing = message.observability_mode;
    let tag = forwarded_tag(&message);
    (inbound(message).0, observing, tag)
}

/// What the HTTP entries of one of Envoy's access log messages say about their responses: each
/// one's report tag, status and usage. TCP entries carry no HTTP response: none.
pub fn summaries(
    message: StreamAccessLogsMessage,
) -> impl Iterator<Item = (Option<String>, crate::pipeline::Summary)> {
    let entries = match message.log_entries {
        Some(LogEntries::HttpLogs(entries)) => entries.log_entry,
        _ => Vec::new(),
    };
    entries.into_iter().map(|entry| {
        let metadata = entry
            .common_properties
            .as_ref()
            .and_then(|common| common.metadata.as_ref());
        let response = entry.response.as_ref();
        let status = response
            .and_then(|response| response.response_code)
            .map(|code| code.value);
        let body_bytes = response.map_or(0, |response| response.response_body_bytes);
        summary_of(metadata, status, body_bytes)
    })
}

/// What an access log entry's metadata, status and body size say about a response.
fn summary_of(
    metadata: Option<&Metadata>,
    status: Option<u32>,
    body_bytes: u64,
) -> (Option<String>, crate::pipeline::Summary) {
    let namespace = metadata.and_then(|m| m.filter_metadata.get(REPORTS_NAMESPACE));
    let tag = namespace.and_then(|n| string_field(n, TAG_KEY).map(str::to_owned));
    let usage = namespace.and_then(|n| {
        Some(crate::observe::response::Usage {
            prompt_tokens: count_field(n, "prompt_tokens")?,
            completion_tokens: count_field(n, "completion_tokens")?,
        })
    });
    let finished = namespace
        .and_then(|n| n.fields.get("done")?.kind.as_ref())
        .is_some_and(|kind| matches!(kind, Kind::BoolValue(true)));
    let status = status.and_then(|s| u16::try_from(s).ok()).unwrap_or(0);
    (
        tag,
        crate::pipeline::Summary {
            status,
            usage,
            finished,
            body_bytes,
        },
    )
}

fn string_field<'a>(fields: &'a Struct, key: &str) -> Option<&'a str> {
    match fields.fields.get(key)?.kind.as_ref()? {
        Kind::StringValue(value) => Some(value),
        _ => None,
    }
}

/// A token count Envoy wrote as a number (or, by a parser's `STRING` type, as its text); None
/// for anything that is not a whole, non-negative count.
fn count_field(fields: &Struct, key: &str) -> Option<u64> {
    let number = match fields.fields.get(key)?.kind.as_ref()? {
        Kind::NumberValue(number) => *number,
        Kind::StringValue(text) => text.trim().parse().ok()?,
        _ => return None,
    };
    (number >= 0.0 && number.fract() == 0.0 && number <= u64::MAX as f64).then_some(number as u64)
}

/// Envoy's header map, read through tollgate's `Header`.
pub struct EnvoyHeaders(Option<HeaderMap>);

impl EnvoyHeaders {
    /// Every header, borrowed.
    pub fn list(&self) -> Vec<Header<'_>> {
        headers(self.0.as_ref())
    }

    /// One header's value.
    pub fn get(&self, name: &str) -> Option<&[u8]> {
        header(self.0.as_ref(), name)
    }

    /// The HTTP status of a response's headers; 0 if it is missing or not a number.
    pub fn status(&self) -> u16 {
        self.get(":status")
            .and_then(|s| std::str::from_utf8(s).ok())
            .and_then(|s| s.parse().ok())
            .unwrap_or(0)
    }
}

/// Borrows Envoy's header map as tollgate `Header`s. Envoy sends values in `raw_value` (bytes);
/// older versions used `value`, so fall back to it when `raw_value` is empty.
fn headers(map: Option<&HeaderMap>) -> Vec<Header<'_>> {
    map.map(|m| {
        m.headers
            .iter()
            .map(|h| Header {
                name: h.key.as_str(),
                value: if h.raw_value.is_empty() {
                    h.value.as_bytes()
                } else {
                    &h.raw_value
                },
            })
            .collect()
    })
    .unwrap_or_default()
}

/// Looks one header up in Envoy's header map.
fn header<'a>(map: Option<&'a HeaderMap>, name: &str) -> Option<&'a [u8]> {
    map?.headers.iter().find(|h| h.key == name).map(|h| {
        if h.raw_value.is_empty() {
            h.value.as_bytes()
        } else {
            h.raw_value.as_slice()
        }
    })
}

/// CONTINUE on request headers, removing the client's copies of headers tollgate owns.
pub fn request_headers_continue(remove: Vec<String>) -> ProcessingResponse {
    let header_mutation = (!remove.is_empty()).then(|| HeaderMutation {
        set_headers: Vec::new(),
        remove_headers: remove,
    });
    respond(Response::RequestHeaders(HeadersResponse {
        response: Some(CommonResponse {
            header_mutation,
            ..CommonResponse::default()
        }),
    }))
}

/// CONTINUE on request headers and tell Envoy to send nothing more for this request: a route
/// tollgate does not govern costs no further round trips (honoured when the filter sets
/// `allow_mode_override`; otherwise tollgate answers the later phases with CONTINUE).
pub fn request_headers_pass_through() -> ProcessingResponse {
    ProcessingResponse {
        mode_override: Some(ProcessingMode {
            request_header_mode: HeaderSendMode::Default as i32,
            response_header_mode: HeaderSendMode::Skip as i32,
            request_body_mode: BodySendMode::None as i32,
            response_body_mode: BodySendMode::None as i32,
            request_trailer_mode: HeaderSendMode::Skip as i32,
            response_trailer_mode: HeaderSendMode::Skip as i32,
        }),
        ..request_headers_continue(Vec::new())
    }
}

/// CONTINUE on the request body with tollgate's upstream headers (the admission's and the
/// budget's) and the rewritten body, if there is one.
pub fn request_body_admit(forward: Forward<'_>) -> ProcessingResponse {
    let mut set_headers: Vec<HeaderValueOption> = forward
        .headers
        .iter()
        .chain(forward.budget_headers.iter())
        .map(|(name, value)| set_header(name, value.as_bytes()))
        .collect();
    let body_mutation = forward.body.map(|body| {
        // The rewritten body has a new length; a stale content-length would make the upstream
        // read too little or wait for bytes that never come.
        set_headers.push(set_header(
            "content-length",
            body.len().to_string().as_bytes(),
        ));
        BodyMutation {
            mutation: Some(body_mutation::Mutation::Body(body)),
        }
    });
    // The tag goes into the stream's dynamic metadata, where the first-token filter and the
    // access log read it back (the filter's `receiving_namespaces` must list the namespace).
    // So do the budget headers: a reported-on response's headers are not shown to tollgate, so
    // Envoy adds them to the client's response itself, from this namespace
    // (`response_headers_to_add`). A namespace of their own: the first-token filter forwards
    // `REPORTS_NAMESPACE` only, and need not carry them.
    let dynamic_metadata = forward.report_tag.map(|tag| {
        let namespace = |fields| Value {
            kind: Some(Kind::StructValue(Struct { fields })),
        };
        let tagged = [(TAG_KEY.to_owned(), string_value(tag))].into();
        let mut namespaces = Struct {
            fields: [(REPORTS_NAMESPACE.to_owned(), namespace(tagged))].into(),
        };
        if !forward.budget_headers.is_empty() {
            let headers = forward
                .budget_headers
                .iter()
                .map(|(name, value)| ((*name).to_owned(), string_value(value)))
                .collect();
            namespaces
                .fields
                .insert(RESPONSE_HEADERS_NAMESPACE.to_owned(), namespace(headers));
        }
        namespaces
    });
    ProcessingResponse {
        dynamic_metadata,
        ..respond(Response::RequestBody(BodyResponse {
            response: Some(CommonResponse {
                header_mutation: Some(HeaderMutation {
                    set_headers,
                    remove_headers: Vec::new(),
                }),
                body_mutation,
                ..CommonResponse::default()
            }),
        }))
    }
}

fn string_value(text: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(text.to_owned())),
    }
}

/// CONTINUE on the response headers, adding `headers` for the client.
pub fn response_headers_continue(headers: &[(&'static str, String)]) -> ProcessingResponse {
    let header_mutation = (!headers.is_empty()).then(|| HeaderMutation {
        set_headers: headers
            .iter()
            .map(|(name, value)| set_header(name, value.as_bytes()))
            .collect(),
        remove_headers: Vec::new(),
    });
    respond(Response::ResponseHeaders(HeadersResponse {
        response: Some(CommonResponse {
            header_mutation,
            ..CommonResponse::default()
        }),
    }))
}

/// A local reply in place of the upstream's response.
pub fn immediate(reply: &LocalReply) -> ProcessingResponse {
    let mut set_headers = vec![
        set_header("content-type", b"application/json"),
        set_header("x-tollgate-reason", reply.reason.as_str().as_bytes()),
    ];
    set_headers.extend(
        reply
            .all_headers()
            .map(|(name, value)| set_header(name, value.as_bytes())),
    );
    respond(Response::ImmediateResponse(ImmediateResponse {
        status: Some(HttpStatus {
            code: i32::from(reply.status()),
        }),
        headers: Some(HeaderMutation {
            set_headers,
            remove_headers: Vec::new(),
        }),
        body: reply.body(),
        grpc_status: None,
        // Shows up in Envoy's %RESPONSE_CODE_DETAILS% access-log field.
        details: format!("tollgate_{}", reply.reason.as_str()),
    }))
}

/// Asks Envoy to keep waiting for the answer to the message in flight (a queued request's
/// body) for `timeout` instead of its `message_timeout`. Envoy acts on this field first and
/// ignores the rest of the message; it allows one per processing state, up to
/// `max_message_timeout`.
pub fn override_message_timeout(timeout: std::time::Duration) -> ProcessingResponse {
    ProcessingResponse {
        override_message_timeout: Some(envoy_types::pb::google::protobuf::Duration {
            seconds: timeout.as_secs() as i64,
            nanos: timeout.subsec_nanos() as i32,
        }),
        ..ProcessingResponse::default()
    }
}

/// Which message a plain CONTINUE answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    RequestBody,
    RequestTrailers,
    ResponseBody,
    ResponseTrailers,
}

/// An unmodified CONTINUE for whatever phase `message` is; None for an empty message, which
/// has no phase to continue.
pub fn continue_as_is(message: &Inbound) -> Option<ProcessingResponse> {
    Some(match message {
        Inbound::RequestHeaders { .. } => request_headers_continue(Vec::new()),
        Inbound::RequestBody { .. } => continue_unchanged(Phase::RequestBody),
        Inbound::RequestTrailers => continue_unchanged(Phase::RequestTrailers),
        Inbound::ResponseHeaders { .. } => response_headers_continue(&[]),
        Inbound::ResponseBody { .. } => continue_unchanged(Phase::ResponseBody),
        Inbound::ResponseTrailers => continue_unchanged(Phase::ResponseTrailers),
        Inbound::Empty => return None,
    })
}

/// An unmodified CONTINUE for `phase`.
pub fn continue_unchanged(phase: Phase) -> ProcessingResponse {
    let common = || {
        Some(CommonResponse {
            ..CommonResponse::default()
        })
    };
    respond(match phase {
        Phase::RequestBody => Response::RequestBody(BodyResponse { response: common() }),
        Phase::ResponseBody => Response::ResponseBody(BodyResponse { response: common() }),
        Phase::RequestTrailers => Response::RequestTrailers(TrailersResponse::default()),
        Phase::ResponseTrailers => Response::ResponseTrailers(TrailersResponse::default()),
    })
}

fn respond(response: Response) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(response),
        ..ProcessingResponse::default()
    }
}

fn set_header(name: &str, value: &[u8]) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: name.to_owned(),
            value: String::new(),
            raw_value: value.to_vec(),
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..HeaderValueOption::default()
    }
}
