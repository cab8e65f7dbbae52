//! The recording format of `proto/tollgate/recording/v1/recording.proto`: Rust types written by
//! hand with prost's derive macros (no protoc at build time), JSON-lines reading and writing in
//! the proto3 JSON mapping, the normalizations the recorder applies, and the human-readable
//! renderings of ext_proc messages used in notes and replay diffs.
//!
//! `replay::recording_types_match_the_proto` holds these types to the `.proto` file.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, CommonResponse, HeaderMutation, HttpBody, HttpHeaders, ProcessingRequest,
    ProcessingResponse, body_mutation, processing_request, processing_response,
};
use prost::Message as _;
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

/// `Header.format` of every recording this code writes and reads.
pub const FORMAT: &str = "tollgate.recording.v1";

/// Where the recorded corpus lives: `tests/fixtures/recorded/<envoy version>/<scenario>.jsonl`.
pub fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/recorded")
}

/// The first line of a recording (`tollgate.recording.v1.Header`).
#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Header {
    #[prost(string, tag = "1")]
    pub format: String,
    #[prost(string, tag = "2")]
    pub envoy_version: String,
    #[prost(string, tag = "3")]
    pub scenario: String,
    #[prost(string, tag = "4")]
    pub description: String,
    #[prost(string, tag = "5")]
    pub envoy_config: String,
    #[prost(string, tag = "6")]
    pub tollgate_config: String,
    #[prost(uint32, tag = "7")]
    pub time_quantum_us: u32,
    #[prost(string, repeated, tag = "8")]
    pub normalizations: Vec<String>,
}

impl Header {
    /// The config tollgate ran with when this was recorded (`tollgate_config`), loaded as the
    /// binary loads its config file.
    pub fn load_tollgate_config(&self) -> tollgate::config::Config {
        let file = tempfile::Builder::new()
            .suffix(".yaml")
            .tempfile()
            .expect("temp config");
        std::fs::write(file.path(), &self.tollgate_config).expect("write config");
        tollgate::config::load(Some(file.path()), std::iter::empty())
            .unwrap_or_else(|e| panic!("the recording's tollgate config does not load: {e}"))
    }
}

/// Every later line (`tollgate.recording.v1.Event`).
#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Event {
    #[prost(uint32, tag = "1")]
    pub stream: u32,
    #[prost(uint32, tag = "2")]
    pub time_us: u32,
    #[prost(oneof = "event::Event", tags = "3, 4, 5")]
    #[serde(flatten)]
    pub event: Option<event::Event>,
    #[prost(string, tag = "15")]
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub note: String,
}

pub mod event {
    use serde::{Deserialize, Serialize};

    /// The `event` oneof: the case is the direction.
    #[derive(Clone, PartialEq, prost::Oneof, Serialize, Deserialize)]
    #[serde(rename_all = "camelCase")]
    pub enum Event {
        /// A serialized `ProcessingRequest`, Envoy to tollgate.
        #[prost(bytes, tag = "3")]
        #[serde(with = "super::base64")]
        Request(Vec<u8>),
        /// A serialized `ProcessingResponse`, tollgate to Envoy.
        #[prost(bytes, tag = "4")]
        #[serde(with = "super::base64")]
        Response(Vec<u8>),
        #[prost(message, tag = "5")]
        End(super::StreamEnd),
    }
}

/// `tollgate.recording.v1.StreamEnd`.
#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StreamEnd {
    #[prost(enumeration = "stream_end::Kind", tag = "1")]
    #[serde(with = "kind_name")]
    pub kind: i32,
    #[prost(int32, tag = "2")]
    #[serde(default)]
    pub grpc_code: i32,
    #[prost(string, tag = "3")]
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub grpc_message: String,
}

pub mod stream_end {
    /// `StreamEnd.Kind`. Variant names follow the `.proto` (`KIND_UNSPECIFIED`).
    #[allow(clippy::enum_variant_names)]
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
    #[repr(i32)]
    pub enum Kind {
        KindUnspecified = 0,
        EnvoyHalfClosed = 1,
        TollgateClosed = 2,
        EnvoyReset = 3,
        Timeout = 4,
    }

    impl Kind {
        pub const ALL: [Kind; 5] = [
            Kind::KindUnspecified,
            Kind::EnvoyHalfClosed,
            Kind::TollgateClosed,
            Kind::EnvoyReset,
            Kind::Timeout,
        ];

        /// The name in the `.proto` file (and in the JSON mapping).
        pub fn proto_name(self) -> &'static str {
            match self {
                Kind::KindUnspecified => "KIND_UNSPECIFIED",
                Kind::EnvoyHalfClosed => "ENVOY_HALF_CLOSED",
                Kind::TollgateClosed => "TOLLGATE_CLOSED",
                Kind::EnvoyReset => "ENVOY_RESET",
                Kind::Timeout => "TIMEOUT",
            }
        }
    }
}

impl StreamEnd {
    pub fn new(kind: stream_end::Kind, grpc_code: i32, grpc_message: &str) -> StreamEnd {
        StreamEnd {
            kind: kind as i32,
            grpc_code,
            grpc_message: grpc_message.to_owned(),
        }
    }

    pub fn kind_enum(&self) -> stream_end::Kind {
        stream_end::Kind::try_from(self.kind).unwrap_or(stream_end::Kind::KindUnspecified)
    }
}

/// Enum fields in the proto3 JSON mapping: by name.
mod kind_name {
    use serde::{Deserialize, Deserializer, Serializer};

    use super::stream_end::Kind;

    pub fn serialize<S: Serializer>(kind: &i32, serializer: S) -> Result<S::Ok, S::Error> {
        let kind = Kind::try_from(*kind).unwrap_or(Kind::KindUnspecified);
        serializer.serialize_str(kind.proto_name())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<i32, D::Error> {
        let name = String::deserialize(deserializer)?;
        Kind::ALL
            .iter()
            .find(|kind| kind.proto_name() == name)
            .map(|kind| *kind as i32)
            .ok_or_else(|| serde::de::Error::custom(format!("unknown StreamEnd.Kind {name:?}")))
    }
}

/// Bytes in the proto3 JSON mapping: standard base64 with padding.
pub mod base64 {
    use serde::{Deserialize, Deserializer, Serializer};

    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

    pub fn encode(bytes: &[u8]) -> String {
        let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
        for chunk in bytes.chunks(3) {
            let b = [
                chunk[0],
                chunk.get(1).copied().unwrap_or(0),
                chunk.get(2).copied().unwrap_or(0),
            ];
            let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
            for i in 0..4 {
                if i <= chunk.len() {
                    out.push(char::from(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize]));
                } else {
                    out.push('=');
                }
            }
        }
        out
    }

    pub fn decode(text: &str) -> Result<Vec<u8>, String> {
        let mut out = Vec::with_capacity(text.len() / 4 * 3);
        let (mut acc, mut bits) = (0u32, 0u32);
        for c in text.bytes().filter(|&c| c != b'=') {
            let value = match c {
                b'A'..=b'Z' => c - b'A',
                b'a'..=b'z' => c - b'a' + 26,
                b'0'..=b'9' => c - b'0' + 52,
                b'+' | b'-' => 62,
                b'/' | b'_' => 63,
                _ => return Err(format!("invalid base64 character {:?}", char::from(c))),
            };
            acc = (acc << 6) | u32::from(value);
            bits += 6;
            if bits >= 8 {
                bits -= 8;
                out.push((acc >> bits) as u8);
                acc &= (1 << bits) - 1;
            }
        }
        Ok(out)
    }

    pub fn serialize<S: Serializer>(bytes: &[u8], serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&encode(bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<u8>, D::Error> {
        decode(&String::deserialize(deserializer)?).map_err(serde::de::Error::custom)
    }
}

/// A whole recording file.
#[derive(Clone, Debug, PartialEq)]
pub struct Recording {
    pub header: Header,
    pub events: Vec<Event>,
}

impl Recording {
    /// JSON lines: the header, then one event per line; a final newline.
    pub fn to_jsonl(&self) -> String {
        let mut out = serde_json::to_string(&self.header).expect("header serializes");
        out.push('\n');
        for event in &self.events {
            out.push_str(&serde_json::to_string(event).expect("event serializes"));
            out.push('\n');
        }
        out
    }

    pub fn from_jsonl(text: &str) -> Result<Recording, String> {
        let mut lines = text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty());
        let (_, first) = lines.next().ok_or("empty recording")?;
        let header: Header = serde_json::from_str(first).map_err(|e| format!("line 1: {e}"))?;
        if header.format != FORMAT {
            return Err(format!("format {:?}, expected {FORMAT:?}", header.format));
        }
        let events = lines
            .map(|(i, line)| {
                serde_json::from_str::<Event>(line).map_err(|e| format!("line {}: {e}", i + 1))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Recording { header, events })
    }

    pub fn read(path: &Path) -> Recording {
        let text = std::fs::read_to_string(path)
            .unwrap_or_else(|e| panic!("read recording {}: {e}", path.display()));
        Recording::from_jsonl(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    /// Number of ext_proc streams in the recording.
    pub fn stream_count(&self) -> u32 {
        self.events.iter().map(|e| e.stream + 1).max().unwrap_or(0)
    }
}

/// Every recording of the corpus, by Envoy version then scenario (both sorted).
pub fn corpus() -> Vec<(String, Vec<(String, PathBuf)>)> {
    let dir = corpus_dir();
    let mut versions: Vec<(String, Vec<(String, PathBuf)>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .filter_map(Result::ok)
        .filter(|entry| entry.path().is_dir())
        .map(|entry| {
            let version = entry.file_name().to_string_lossy().into_owned();
            let mut files: Vec<(String, PathBuf)> = std::fs::read_dir(entry.path())
                .expect("read a version directory")
                .filter_map(Result::ok)
                .map(|f| f.path())
                .filter(|p| p.extension().is_some_and(|e| e == "jsonl"))
                .map(|p| {
                    let scenario = p.file_stem().unwrap().to_string_lossy().into_owned();
                    (scenario, p)
                })
                .collect();
            files.sort();
            (version, files)
        })
        .collect();
    versions.sort_by_key(|(version, _)| version_key(version));
    versions
}

/// `1.38.3` sorts before `1.40.0`.
pub fn version_key(version: &str) -> Vec<u32> {
    version.split('.').filter_map(|p| p.parse().ok()).collect()
}

// ---------------------------------------------------------------------------------------------
// Normalization (applied by the recorder to what it writes, never to what it forwards).

/// The `:authority` every recording shows: the listener's port in `envoy/front-proxy.yaml`.
pub const NORMALIZED_AUTHORITY: &str = "127.0.0.1:10000";
const NORMALIZED_DATE: &str = "Thu, 01 Jan 1970 00:00:00 GMT";
const NORMALIZED_CREATED: &[u8] = b"1700000000";

/// What [`normalize_request`] does, for `Header.normalizations`.
pub fn normalizations() -> Vec<String> {
    [
        "x-request-id request header: 00000000-0000-4000-8000-<stream number, 12 digits>",
        ":authority and host request headers: 127.0.0.1:10000 (Envoy's listener port varies)",
        "date response header: Thu, 01 Jan 1970 00:00:00 GMT",
        "x-envoy-upstream-service-time response header: 0",
        "\"created\":<10 digits> in response bodies: \"created\":1700000000 (same length)",
        "event times rounded down to time_quantum_us",
    ]
    .map(str::to_owned)
    .to_vec()
}

/// Makes a request Envoy sent reproducible: the values that change from run to run only.
pub fn normalize_request(request: &mut ProcessingRequest, stream: u32) {
    use processing_request::Request;
    let set = |headers: &mut Option<HeaderMap>, name: &str, value: &str| {
        for header in headers.iter_mut().flat_map(|h| h.headers.iter_mut()) {
            if header.key.eq_ignore_ascii_case(name) {
                set_value(header, value);
            }
        }
    };
    match &mut request.request {
        Some(Request::RequestHeaders(h)) => {
            set(
                &mut h.headers,
                "x-request-id",
                &format!("00000000-0000-4000-8000-{stream:012}"),
            );
            set(&mut h.headers, ":authority", NORMALIZED_AUTHORITY);
            set(&mut h.headers, "host", NORMALIZED_AUTHORITY);
        }
        Some(Request::ResponseHeaders(h)) => {
            set(&mut h.headers, "date", NORMALIZED_DATE);
            set(&mut h.headers, "x-envoy-upstream-service-time", "0");
        }
        Some(Request::ResponseBody(body)) => normalize_created(&mut body.body),
        _ => {}
    }
}

fn set_value(header: &mut HeaderValue, value: &str) {
    if header.raw_value.is_empty() && !header.value.is_empty() {
        header.value = value.to_owned();
    } else {
        header.raw_value = value.as_bytes().to_vec();
    }
}

/// `"created":1712345678` (or `"created": 1712345678`) becomes `"created":1700000000`.
fn normalize_created(body: &mut [u8]) {
    const KEY: &[u8] = b"\"created\":";
    let mut i = 0;
    while let Some(at) = find(&body[i..], KEY) {
        let mut start = i + at + KEY.len();
        while body.get(start) == Some(&b' ') {
            start += 1;
        }
        let digits = body[start..]
            .iter()
            .take_while(|b| b.is_ascii_digit())
            .count();
        if digits == NORMALIZED_CREATED.len() {
            body[start..start + digits].copy_from_slice(NORMALIZED_CREATED);
        }
        i = start + digits;
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

// ---------------------------------------------------------------------------------------------
// Renderings.

fn header_value(header: &HeaderValue) -> String {
    if header.raw_value.is_empty() {
        header.value.clone()
    } else {
        String::from_utf8_lossy(&header.raw_value).into_owned()
    }
}

/// `name: value`, for every header of a map.
fn headers_text(headers: &Option<HeaderMap>) -> Vec<String> {
    headers
        .iter()
        .flat_map(|h| &h.headers)
        .map(|h| format!("{}: {}", h.key, header_value(h)))
        .collect()
}

/// A body, as text when it is short UTF-8, else its length and a hash prefix.
pub fn body_text(body: &[u8]) -> String {
    match std::str::from_utf8(body) {
        Ok(text) if body.len() <= 600 => format!("{text:?}"),
        _ => {
            let digest = Sha256::digest(body);
            format!(
                "<{} bytes sha256:{}>",
                body.len(),
                hex::encode(&digest[..6])
            )
        }
    }
}

/// One line for a request from Envoy (the `note` of a request event).
pub fn describe_request(request: &ProcessingRequest) -> String {
    use processing_request::Request;
    let headers = |name: &str, h: &HttpHeaders| {
        let mut line = format!("{name} {}", headers_text(&h.headers).join(", "));
        if h.end_of_stream {
            line.push_str(" [end_of_stream]");
        }
        line
    };
    let body = |name: &str, b: &HttpBody| {
        let mut line = format!("{name} {}", body_text(&b.body));
        if b.end_of_stream {
            line.push_str(" [end_of_stream]");
        }
        line
    };
    let mut line = match &request.request {
        Some(Request::RequestHeaders(h)) => headers("request_headers", h),
        Some(Request::RequestBody(b)) => body("request_body", b),
        Some(Request::RequestTrailers(t)) => {
            format!("request_trailers {}", headers_text(&t.trailers).join(", "))
        }
        Some(Request::ResponseHeaders(h)) => headers("response_headers", h),
        Some(Request::ResponseBody(b)) => body("response_body", b),
        Some(Request::ResponseTrailers(t)) => {
            format!("response_trailers {}", headers_text(&t.trailers).join(", "))
        }
        None => "(no request case)".to_owned(),
    };
    if request.observability_mode {
        line.push_str(" [observability_mode]");
    }
    line
}

/// The phase a request from Envoy is in: `H`, `B`, `T` (request), `RH`, `RB`, `RT` (response).
pub fn request_phase(request: &ProcessingRequest) -> &'static str {
    use processing_request::Request;
    match &request.request {
        Some(Request::RequestHeaders(_)) => "H",
        Some(Request::RequestBody(_)) => "B",
        Some(Request::RequestTrailers(_)) => "T",
        Some(Request::ResponseHeaders(_)) => "RH",
        Some(Request::ResponseBody(_)) => "RB",
        Some(Request::ResponseTrailers(_)) => "RT",
        None => "?",
    }
}

/// Header values that depend on the wall clock, shown with their digits masked so that a
/// replay seconds or days after the recording compares equal.
const CLOCK_HEADERS: [&str; 3] = [
    "x-ratelimit-reset-requests",
    "x-ratelimit-reset-tokens",
    "ratelimit",
];

fn mask_digits(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    let mut in_digits = false;
    for c in value.chars() {
        if c.is_ascii_digit() {
            if !in_digits {
                out.push('#');
            }
            in_digits = true;
        } else {
            out.push(c);
            in_digits = false;
        }
    }
    out
}

fn mutation_lines(mutation: &Option<HeaderMutation>, out: &mut Vec<String>) {
    let Some(mutation) = mutation else { return };
    for option in &mutation.set_headers {
        out.push(set_header_line(option));
    }
    for name in &mutation.remove_headers {
        out.push(format!("  remove {name}"));
    }
}

fn set_header_line(option: &HeaderValueOption) -> String {
    let (key, mut value) = option
        .header
        .as_ref()
        .map(|h| (h.key.clone(), header_value(h)))
        .unwrap_or_default();
    if CLOCK_HEADERS.contains(&key.to_ascii_lowercase().as_str()) {
        value = mask_digits(&value);
    }
    let mut line = format!("  set {key}: {value}");
    if option.append_action != 0 {
        let _ = write!(line, " (append_action {})", option.append_action);
    }
    line
}

fn body_mutation_line(mutation: &Option<BodyMutation>, out: &mut Vec<String>) {
    match mutation.as_ref().and_then(|m| m.mutation.as_ref()) {
        Some(body_mutation::Mutation::Body(body)) => {
            out.push(format!("  replace body {}", body_text(body)));
        }
        Some(body_mutation::Mutation::ClearBody(clear)) => {
            out.push(format!("  clear body {clear}"));
        }
        Some(body_mutation::Mutation::StreamedResponse(streamed)) => out.push(format!(
            "  streamed body {} end_of_stream={}",
            body_text(&streamed.body),
            streamed.end_of_stream
        )),
        None => {}
    }
}

fn common_lines(name: &str, common: &Option<CommonResponse>, out: &mut Vec<String>) {
    let Some(common) = common else {
        out.push(format!("{name}: CONTINUE"));
        return;
    };
    let status = match common.status {
        0 => "CONTINUE".to_owned(),
        1 => "CONTINUE_AND_REPLACE".to_owned(),
        other => format!("status {other}"),
    };
    out.push(format!("{name}: {status}"));
    mutation_lines(&common.header_mutation, out);
    body_mutation_line(&common.body_mutation, out);
    if let Some(trailers) = &common.trailers {
        out.push(format!(
            "  trailers {}",
            headers_text(&Some(trailers.clone())).join(", ")
        ));
    }
    if common.clear_route_cache {
        out.push("  clear_route_cache".to_owned());
    }
}

/// The semantic content of an answer from tollgate, one fact per line: what it answered,
/// headers set and removed (clock-derived values masked), body mutations, immediate responses,
/// mode and timeout overrides. Replays compare these.
pub fn describe_response(response: &ProcessingResponse) -> Vec<String> {
    use processing_response::Response;
    let mut out = Vec::new();
    match &response.response {
        Some(Response::RequestHeaders(h)) => common_lines("request_headers", &h.response, &mut out),
        Some(Response::RequestBody(b)) => common_lines("request_body", &b.response, &mut out),
        Some(Response::ResponseHeaders(h)) => {
            common_lines("response_headers", &h.response, &mut out);
        }
        Some(Response::ResponseBody(b)) => common_lines("response_body", &b.response, &mut out),
        Some(Response::RequestTrailers(t)) => {
            out.push("request_trailers".to_owned());
            mutation_lines(&t.header_mutation, &mut out);
        }
        Some(Response::ResponseTrailers(t)) => {
            out.push("response_trailers".to_owned());
            mutation_lines(&t.header_mutation, &mut out);
        }
        Some(Response::ImmediateResponse(immediate)) => {
            let status = immediate.status.as_ref().map_or(0, |s| s.code);
            out.push(format!("immediate_response: {status}"));
            mutation_lines(&immediate.headers, &mut out);
            if !immediate.body.is_empty() {
                out.push(format!("  body {}", body_text(&immediate.body)));
            }
            if let Some(grpc) = &immediate.grpc_status {
                out.push(format!("  grpc_status {}", grpc.status));
            }
            if !immediate.details.is_empty() {
                out.push(format!("  details {}", immediate.details));
            }
        }
        Some(Response::StreamedImmediateResponse(_)) => {
            out.push("streamed_immediate_response".to_owned());
        }
        None => out.push("(no response case)".to_owned()),
    }
    if let Some(mode) = &response.mode_override {
        out.push(format!(
            "  mode_override request_header={} request_body={} request_trailer={} \
             response_header={} response_body={} response_trailer={}",
            mode.request_header_mode,
            mode.request_body_mode,
            mode.request_trailer_mode,
            mode.response_header_mode,
            mode.response_body_mode,
            mode.response_trailer_mode
        ));
    }
    if let Some(timeout) = &response.override_message_timeout {
        out.push(format!(
            "  override_message_timeout {}.{:03}s",
            timeout.seconds,
            timeout.nanos / 1_000_000
        ));
    }
    if response.dynamic_metadata.is_some() {
        out.push("  dynamic_metadata (set)".to_owned());
    }
    out
}

/// A stream end, as a replay compares it.
pub fn describe_end(end: &StreamEnd) -> String {
    let mut line = end.kind_enum().proto_name().to_owned();
    if end.kind_enum() == stream_end::Kind::TollgateClosed {
        let _ = write!(line, " {}", grpc_code_name(end.grpc_code));
        if !end.grpc_message.is_empty() {
            let _ = write!(line, " {:?}", end.grpc_message);
        }
    }
    line
}

pub fn grpc_code_name(code: i32) -> String {
    format!("{:?}", tonic::Code::from_i32(code))
}

/// The note of an event: one line.
pub fn note(event: &event::Event) -> String {
    match event {
        event::Event::Request(bytes) => match ProcessingRequest::decode(bytes.as_slice()) {
            Ok(request) => describe_request(&request),
            Err(e) => format!("(undecodable request: {e})"),
        },
        event::Event::Response(bytes) => match ProcessingResponse::decode(bytes.as_slice()) {
            Ok(response) => describe_response(&response)
                .iter()
                .map(|l| l.trim())
                .collect::<Vec<_>>()
                .join(" | "),
            Err(e) => format!("(undecodable response: {e})"),
        },
        event::Event::End(end) => format!("end {}", describe_end(end)),
    }
}
