//! Replays of ext_proc traffic recorded from real Envoy 1.36, 1.38 and 1.40
//! (`tests/fixtures/recorded/`, format in `proto/README.md`): tollgate in-process, driven over
//! gRPC with each recorded request sequence and no Envoy, must answer as it did when recorded.
//! Answers are compared semantically (`support::recording::describe_response`): status, headers
//! set and removed, body mutations, immediate responses, mode and timeout overrides, and how
//! tollgate ended each stream.
//!
//! Also here: the check that the hand-written recording types match the `.proto`, and the
//! generated "Envoy versions" matrix of docs/conformance.md.

mod scenarios;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    ProcessingRequest, ProcessingResponse, processing_response,
};
use prost::Message as _;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;

use crate::support::recording::{
    self, Event, Header, Recording, StreamEnd, corpus, describe_end, describe_response, event,
    request_phase, stream_end::Kind,
};
use crate::support::server::TestServer;

use self::scenarios::{RECORDED_ENVOY_VERSIONS, scenarios};

/// How long a replay waits for one answer. Queue deadlines in the corpus are at most 5 s.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------------------------
// The replay.

/// One ext_proc stream played against tollgate, as Envoy would.
struct ReplayStream {
    tx: Option<mpsc::Sender<ProcessingRequest>>,
    rx: Streaming<ProcessingResponse>,
}

/// What tollgate did next on a stream, as text comparable to the recording.
enum Next {
    Answer(Box<ProcessingResponse>),
    Closed(StreamEnd),
    TimedOut,
}

impl ReplayStream {
    async fn open(client: &mut ExternalProcessorClient<tonic::transport::Channel>) -> Self {
        let (tx, rx) = mpsc::channel(64);
        let response = client
            .process(ReceiverStream::new(rx))
            .await
            .expect("tollgate accepts the stream");
        ReplayStream {
            tx: Some(tx),
            rx: response.into_inner(),
        }
    }

    async fn next(&mut self) -> Next {
        match tokio::time::timeout(ANSWER_TIMEOUT, self.rx.message()).await {
            Err(_) => Next::TimedOut,
            Ok(Ok(Some(answer))) => Next::Answer(Box::new(answer)),
            Ok(Ok(None)) => Next::Closed(StreamEnd::new(Kind::TollgateClosed, 0, "")),
            Ok(Err(status)) => Next::Closed(StreamEnd::new(
                Kind::TollgateClosed,
                status.code() as i32,
                status.message(),
            )),
        }
    }
}

fn describe_next(next: &Next) -> Vec<String> {
    match next {
        Next::Answer(answer) => describe_response(answer),
        Next::Closed(end) => vec![format!("end {}", describe_end(end))],
        Next::TimedOut => vec![format!("(no answer within {ANSWER_TIMEOUT:?})")],
    }
}

/// A unified-style diff of two short line lists.
fn diff(expected: &[String], actual: &[String]) -> String {
    let mut out = String::new();
    let (e, a): (BTreeSet<&String>, BTreeSet<&String>) =
        (expected.iter().collect(), actual.iter().collect());
    for line in expected {
        let mark = if a.contains(line) { ' ' } else { '-' };
        let _ = writeln!(out, "  {mark} {line}");
    }
    for line in actual {
        if !e.contains(line) {
            let _ = writeln!(out, "  + {line}");
        }
    }
    if e == a && expected != actual {
        let _ = writeln!(out, "  (same lines, different order)");
    }
    out
}

/// Config the recording ran tollgate with.
fn config_of(header: &Header) -> tollgate::config::Config {
    let file = tempfile::Builder::new()
        .suffix(".yaml")
        .tempfile()
        .expect("temp config");
    std::fs::write(file.path(), &header.tollgate_config).expect("write config");
    tollgate::config::load(Some(file.path()), std::iter::empty())
        .unwrap_or_else(|e| panic!("the recording's tollgate config does not load: {e}"))
}

/// Plays `recording` against a fresh tollgate. `Err` is a readable report of the first place
/// tollgate answered differently.
async fn replay(recording: &Recording) -> Result<(), String> {
    let server = TestServer::start(config_of(&recording.header)).await;
    let mut client = server.client().await;
    let mut streams: HashMap<u32, ReplayStream> = HashMap::new();
    // Per stream: the phase of the last request sent and how many answers so far.
    let mut phase: HashMap<u32, &'static str> = HashMap::new();
    let mut answers: HashMap<u32, usize> = HashMap::new();

    let mismatch = |index: usize, event: &Event, what: String| {
        format!(
            "{} / {}: event {} (line {}, stream {}): {what}",
            recording.header.envoy_version,
            recording.header.scenario,
            index,
            index + 2,
            event.stream
        )
    };

    for (index, ev) in recording.events.iter().enumerate() {
        let Some(body) = &ev.event else { continue };
        match body {
            event::Event::Request(bytes) => {
                let request = ProcessingRequest::decode(bytes.as_slice())
                    .map_err(|e| mismatch(index, ev, format!("undecodable request: {e}")))?;
                phase.insert(ev.stream, request_phase(&request));
                let stream = match streams.entry(ev.stream) {
                    std::collections::hash_map::Entry::Occupied(open) => open.into_mut(),
                    std::collections::hash_map::Entry::Vacant(new) => {
                        new.insert(ReplayStream::open(&mut client).await)
                    }
                };
                if let Some(tx) = &stream.tx {
                    // tollgate may have ended the stream already (as the recording will say).
                    let _ = tx.send(request).await;
                }
            }
            event::Event::Response(bytes) => {
                let recorded = ProcessingResponse::decode(bytes.as_slice())
                    .map_err(|e| mismatch(index, ev, format!("undecodable response: {e}")))?;
                let expected = describe_response(&recorded);
                let n = answers.entry(ev.stream).or_default();
                *n += 1;
                let stream = streams
                    .get_mut(&ev.stream)
                    .ok_or_else(|| mismatch(index, ev, "answer before any request".into()))?;
                let next = stream.next().await;
                let actual = describe_next(&next);
                if actual != expected {
                    return Err(mismatch(
                        index,
                        ev,
                        format!(
                            "answer {} (to {}) differs (- recorded, + replayed):\n{}",
                            n,
                            phase.get(&ev.stream).copied().unwrap_or("?"),
                            diff(&expected, &actual)
                        ),
                    ));
                }
            }
            event::Event::End(end) => match end.kind_enum() {
                Kind::EnvoyHalfClosed => {
                    if let Some(stream) = streams.get_mut(&ev.stream) {
                        stream.tx = None;
                    }
                }
                Kind::EnvoyReset | Kind::Timeout | Kind::KindUnspecified => {
                    streams.remove(&ev.stream);
                }
                Kind::TollgateClosed => {
                    let stream = streams
                        .get_mut(&ev.stream)
                        .ok_or_else(|| mismatch(index, ev, "end before any request".into()))?;
                    let expected = vec![format!("end {}", describe_end(end))];
                    let actual = describe_next(&stream.next().await);
                    // tonic reports a server's status message as-is; compare the codes only
                    // when the recorded message came from the recorder's own transport.
                    if actual != expected {
                        return Err(mismatch(
                            index,
                            ev,
                            format!(
                                "stream end differs (- recorded, + replayed):\n{}",
                                diff(&expected, &actual)
                            ),
                        ));
                    }
                }
            },
        }
    }
    drop(streams);
    let _ = server.stop().await;
    Ok(())
}

/// Replays every recording of one Envoy version; fails with every mismatch found.
async fn replay_version(version: &str) {
    let corpus = corpus();
    let (_, files) = corpus
        .iter()
        .find(|(v, _)| v == version)
        .unwrap_or_else(|| {
            panic!(
                "no recordings for Envoy {version} under {}: run scripts/record-corpus.sh",
                recording::corpus_dir().display()
            )
        });
    let expected: BTreeSet<&str> = scenarios().iter().map(|s| s.name).collect();
    let present: BTreeSet<&str> = files.iter().map(|(s, _)| s.as_str()).collect();
    let missing: Vec<&&str> = expected.difference(&present).collect();
    assert!(
        missing.is_empty(),
        "Envoy {version}: scenarios not recorded: {missing:?}"
    );
    let mut failures = Vec::new();
    for (_, path) in files {
        let recording = Recording::read(path);
        assert_eq!(
            recording.header.envoy_version,
            version,
            "{}",
            path.display()
        );
        if let Err(report) = replay(&recording).await {
            failures.push(report);
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} recordings replay differently:\n\n{}",
        failures.len(),
        files.len(),
        failures.join("\n")
    );
}

#[tokio::test]
async fn replay_envoy_1_36() {
    replay_version(RECORDED_ENVOY_VERSIONS[0]).await;
}

#[tokio::test]
async fn replay_envoy_1_38() {
    replay_version(RECORDED_ENVOY_VERSIONS[1]).await;
}

#[tokio::test]
async fn replay_envoy_1_40() {
    replay_version(RECORDED_ENVOY_VERSIONS[2]).await;
}

/// A replay that goes wrong says where and how.
#[tokio::test]
async fn a_replay_mismatch_is_reported_readably() {
    let (_, files) = corpus()
        .into_iter()
        .find(|(v, _)| v == RECORDED_ENVOY_VERSIONS[2])
        .expect("the corpus has Envoy 1.40");
    let path = &files
        .iter()
        .find(|(s, _)| s == "missing_identity_401")
        .expect("missing_identity_401 recorded")
        .1;
    let mut recording = Recording::read(path);
    // Pretend tollgate answered 402 when recorded.
    for ev in &mut recording.events {
        if let Some(event::Event::Response(bytes)) = &mut ev.event {
            let mut response = ProcessingResponse::decode(bytes.as_slice()).unwrap();
            if let Some(processing_response::Response::ImmediateResponse(immediate)) =
                &mut response.response
            {
                immediate.status.as_mut().unwrap().code = 402;
            }
            *bytes = response.encode_to_vec();
        }
    }
    let report = replay(&recording).await.expect_err("a mismatch");
    assert!(report.contains("missing_identity_401"), "{report}");
    assert!(report.contains("- immediate_response: 402"), "{report}");
    assert!(report.contains("+ immediate_response: 401"), "{report}");
}

// ---------------------------------------------------------------------------------------------
// The format: the hand-written types match proto/tollgate/recording/v1/recording.proto.

#[derive(Debug, Default)]
struct ProtoFile {
    /// message name -> (field name, type, number, repeated)
    messages: BTreeMap<String, Vec<(String, String, u32, bool)>>,
    /// enum name -> (value name, number)
    enums: BTreeMap<String, Vec<(String, i32)>>,
}

fn parse_proto(text: &str) -> ProtoFile {
    let mut file = ProtoFile::default();
    // (kind, name) of each open block: "message", "enum" or "oneof".
    let mut scopes: Vec<(&str, String)> = Vec::new();
    for raw in text.lines() {
        let line = raw.split("//").next().unwrap().trim();
        if line.is_empty() || line.starts_with("syntax") || line.starts_with("package") {
            continue;
        }
        let words: Vec<&str> = line
            .split(|c: char| c.is_whitespace() || c == '=' || c == ';')
            .filter(|w| !w.is_empty())
            .collect();
        if line.ends_with('{') {
            scopes.push((
                if words[0] == "message" || words[0] == "enum" || words[0] == "oneof" {
                    words[0]
                } else {
                    panic!("unexpected block in the .proto: {line}")
                },
                words[1].to_owned(),
            ));
            if words[0] == "message" {
                file.messages.entry(words[1].to_owned()).or_default();
            }
            if words[0] == "enum" {
                file.enums.entry(words[1].to_owned()).or_default();
            }
            continue;
        }
        if line == "}" {
            scopes.pop();
            continue;
        }
        let (kind, name) = scopes
            .iter()
            .rev()
            .find(|(k, _)| *k != "oneof")
            .cloned()
            .unwrap_or_else(|| panic!("a declaration outside any message: {line}"));
        if kind == "enum" {
            file.enums
                .get_mut(&name)
                .unwrap()
                .push((words[0].to_owned(), words[1].parse().unwrap()));
        } else {
            let repeated = words[0] == "repeated";
            let w = &words[usize::from(repeated)..];
            file.messages.get_mut(&name).unwrap().push((
                w[1].to_owned(),
                w[0].to_owned(),
                w[2].parse().unwrap(),
                repeated,
            ));
        }
    }
    file
}

/// (field number, wire type) of every field present in an encoded message.
fn wire_fields(mut bytes: &[u8]) -> BTreeSet<(u32, u8)> {
    fn varint(bytes: &mut &[u8]) -> u64 {
        let mut value = 0u64;
        for shift in (0..).step_by(7) {
            let b = bytes[0];
            *bytes = &bytes[1..];
            value |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                break;
            }
        }
        value
    }
    let mut out = BTreeSet::new();
    while !bytes.is_empty() {
        let key = varint(&mut bytes);
        let (number, wire) = ((key >> 3) as u32, (key & 7) as u8);
        match wire {
            0 => {
                varint(&mut bytes);
            }
            2 => {
                let len = varint(&mut bytes) as usize;
                bytes = &bytes[len..];
            }
            other => panic!("unexpected wire type {other}"),
        }
        out.insert((number, wire));
    }
    out
}

fn camel(name: &str) -> String {
    let mut out = String::new();
    let mut upper = false;
    for c in name.chars() {
        if c == '_' {
            upper = true;
        } else if upper {
            out.push(c.to_ascii_uppercase());
            upper = false;
        } else {
            out.push(c);
        }
    }
    out
}

/// (field number, wire type) pairs and JSON names a Rust message type produces.
type RustFields = (BTreeSet<(u32, u8)>, BTreeSet<String>);

#[test]
fn recording_types_match_the_proto() {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("proto/tollgate/recording/v1/recording.proto");
    let proto = parse_proto(&std::fs::read_to_string(&path).unwrap());

    // Every message, with every field set (each oneof case once).
    let end = StreamEnd::new(Kind::EnvoyReset, 1, "cancelled");
    let header = Header {
        format: recording::FORMAT.into(),
        envoy_version: "v".into(),
        scenario: "s".into(),
        description: "d".into(),
        envoy_config: "e".into(),
        tollgate_config: "t".into(),
        time_quantum_us: 7,
        normalizations: vec!["n".into()],
    };
    let events: Vec<Event> = [
        event::Event::Request(vec![1]),
        event::Event::Response(vec![2]),
        event::Event::End(end.clone()),
    ]
    .into_iter()
    .map(|e| Event {
        stream: 3,
        time_us: 4,
        event: Some(e),
        note: "note".into(),
    })
    .collect();
    let mut rust: BTreeMap<&str, RustFields> = BTreeMap::new();
    let mut add = |name: &'static str, bytes: Vec<u8>, json: serde_json::Value| {
        let entry = rust.entry(name).or_default();
        entry.0.extend(wire_fields(&bytes));
        entry
            .1
            .extend(json.as_object().unwrap().keys().map(Clone::clone));
    };
    add(
        "Header",
        header.encode_to_vec(),
        serde_json::to_value(&header).unwrap(),
    );
    for e in &events {
        add("Event", e.encode_to_vec(), serde_json::to_value(e).unwrap());
    }
    add(
        "StreamEnd",
        end.encode_to_vec(),
        serde_json::to_value(&end).unwrap(),
    );

    let proto_messages: BTreeSet<&str> = proto.messages.keys().map(String::as_str).collect();
    let rust_messages: BTreeSet<&str> = rust.keys().copied().collect();
    assert_eq!(proto_messages, rust_messages, "messages");
    for (name, fields) in &proto.messages {
        let wire: BTreeSet<(u32, u8)> = fields
            .iter()
            .map(|(_, ty, number, _)| {
                let wire = match ty.as_str() {
                    "string" | "bytes" => 2,
                    "uint32" | "int32" | "uint64" | "int64" | "bool" => 0,
                    t if proto.enums.contains_key(t) => 0,
                    t if proto.messages.contains_key(t) => 2,
                    t => panic!("{name}: unhandled type {t}"),
                };
                (*number, wire)
            })
            .collect();
        let json: BTreeSet<String> = fields.iter().map(|(f, ..)| camel(f)).collect();
        assert_eq!(
            rust[name.as_str()].0,
            wire,
            "{name}: field numbers and wire types (Rust vs .proto)"
        );
        assert_eq!(
            rust[name.as_str()].1,
            json,
            "{name}: JSON field names (Rust vs .proto)"
        );
    }
    let kinds: Vec<(String, i32)> = Kind::ALL
        .iter()
        .map(|k| (k.proto_name().to_owned(), *k as i32))
        .collect();
    assert_eq!(proto.enums.get("Kind"), Some(&kinds), "StreamEnd.Kind");
    assert_eq!(proto.enums.len(), 1, "enums: {:?}", proto.enums.keys());

    // And a JSON line round-trips.
    let recording = Recording {
        header,
        events: events.clone(),
    };
    let text = recording.to_jsonl();
    assert_eq!(Recording::from_jsonl(&text).unwrap().events, events);
    assert_eq!(
        recording::base64::decode(&recording::base64::encode(b"tollgate!")).unwrap(),
        b"tollgate!"
    );
    assert_eq!(recording::base64::encode(b"ab"), "YWI=");
}

// ---------------------------------------------------------------------------------------------
// docs/conformance.md, "## Envoy versions": generated from the corpus the replays hold tollgate
// to.

const DOC_HEADING: &str = "## Envoy versions";
const BEGIN: &str =
    "<!-- BEGIN generated by tests/it/replay.rs (TOLLGATE_REGENERATE_CONFORMANCE=1) -->";
const END: &str = "<!-- END generated -->";

fn doc_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/conformance.md")
}

/// tollgate's answers on one stream, compactly: `phase:answer` in order (repeats collapsed),
/// then how the stream ended.
fn stream_summary(events: &[&Event]) -> String {
    let mut parts: Vec<(String, usize)> = Vec::new();
    let mut phase = "?";
    let mut ends = Vec::new();
    for ev in events {
        match &ev.event {
            Some(event::Event::Request(bytes)) => {
                if let Ok(request) = ProcessingRequest::decode(bytes.as_slice()) {
                    phase = request_phase(&request);
                }
            }
            Some(event::Event::Response(bytes)) => {
                let Ok(response) = ProcessingResponse::decode(bytes.as_slice()) else {
                    continue;
                };
                // The phase answered, from the answer itself: Envoy may send the next
                // message (e.g. its own 413's headers) before the previous one is answered.
                let answered = match &response.response {
                    Some(processing_response::Response::RequestHeaders(_)) => "H",
                    Some(processing_response::Response::RequestBody(_)) => "B",
                    Some(processing_response::Response::RequestTrailers(_)) => "T",
                    Some(processing_response::Response::ResponseHeaders(_)) => "RH",
                    Some(processing_response::Response::ResponseBody(_)) => "RB",
                    Some(processing_response::Response::ResponseTrailers(_)) => "RT",
                    _ => phase,
                };
                let part = format!("{answered}:{}", answer_summary(&response));
                match parts.last_mut() {
                    Some((last, n)) if *last == part => *n += 1,
                    _ => parts.push((part, 1)),
                }
            }
            Some(event::Event::End(end)) => ends.push(match end.kind_enum() {
                Kind::EnvoyHalfClosed => "Envoy half-close".to_owned(),
                Kind::EnvoyReset => "Envoy reset".to_owned(),
                Kind::Timeout => "still open".to_owned(),
                Kind::TollgateClosed => {
                    format!("tollgate {}", recording::grpc_code_name(end.grpc_code))
                }
                Kind::KindUnspecified => "?".to_owned(),
            }),
            None => {}
        }
    }
    let mut out: Vec<String> = parts
        .into_iter()
        .map(|(p, n)| if n > 1 { format!("{p} ×{n}") } else { p })
        .collect();
    if out.is_empty() {
        out.push("(no answer)".to_owned());
    }
    format!("{}; {}", out.join(", "), ends.join(", "))
}

fn answer_summary(response: &ProcessingResponse) -> String {
    use processing_response::Response;
    let mut out = match &response.response {
        Some(Response::ImmediateResponse(immediate)) => {
            let status = immediate.status.as_ref().map_or(0, |s| s.code);
            let reason = immediate
                .headers
                .iter()
                .flat_map(|h| &h.set_headers)
                .filter_map(|o| o.header.as_ref())
                .find(|h| h.key == "x-tollgate-reason")
                .map(|h| String::from_utf8_lossy(&h.raw_value).into_owned())
                .unwrap_or_default();
            format!("**{status}** {reason}").trim().to_owned()
        }
        Some(
            Response::RequestHeaders(_)
            | Response::RequestBody(_)
            | Response::ResponseHeaders(_)
            | Response::ResponseBody(_),
        ) => {
            let common = match &response.response {
                Some(Response::RequestHeaders(h)) => h.response.as_ref(),
                Some(Response::RequestBody(b)) => b.response.as_ref(),
                Some(Response::ResponseHeaders(h)) => h.response.as_ref(),
                Some(Response::ResponseBody(b)) => b.response.as_ref(),
                _ => None,
            };
            let mut s = "continue".to_owned();
            if let Some(common) = common {
                let set = common
                    .header_mutation
                    .as_ref()
                    .map_or(0, |m| m.set_headers.len());
                let removed = common
                    .header_mutation
                    .as_ref()
                    .map_or(0, |m| m.remove_headers.len());
                if set > 0 {
                    let _ = write!(s, " +{set}h");
                }
                if removed > 0 {
                    let _ = write!(s, " -{removed}h");
                }
                if common.body_mutation.is_some() {
                    s.push_str(" +body");
                }
            }
            s
        }
        Some(other) => format!("{other:?}")
            .split('(')
            .next()
            .unwrap_or("?")
            .to_owned(),
        None => "(empty)".to_owned(),
    };
    if response.mode_override.is_some() {
        out.push_str(" +mode_override");
    }
    if let Some(timeout) = &response.override_message_timeout {
        let _ = write!(
            out,
            " +timeout {}.{}s",
            timeout.seconds,
            timeout.nanos / 100_000_000
        );
    }
    out
}

/// The generated block: one row per scenario and stream, one column per recorded Envoy.
fn conformance_matrix() -> String {
    let corpus = corpus();
    let versions: Vec<&str> = corpus.iter().map(|(v, _)| v.as_str()).collect();
    let mut recordings: BTreeMap<(&str, String), Recording> = BTreeMap::new();
    for (version, files) in &corpus {
        for (scenario, path) in files {
            recordings.insert((version.as_str(), scenario.clone()), Recording::read(path));
        }
    }
    let mut out = String::new();
    let _ = writeln!(out, "{BEGIN}");
    let _ = writeln!(out);
    let _ = write!(out, "| scenario | stream |");
    for v in &versions {
        let _ = write!(out, " Envoy {v} |");
    }
    let _ = writeln!(out);
    let _ = writeln!(out, "|---|---|{}", "---|".repeat(versions.len()));
    for scenario in scenarios() {
        let streams = versions
            .iter()
            .filter_map(|v| recordings.get(&(*v, scenario.name.to_owned())))
            .map(Recording::stream_count)
            .max()
            .unwrap_or(0);
        for stream in 0..streams.max(1) {
            let name = if stream == 0 {
                format!("`{}`", scenario.name)
            } else {
                String::new()
            };
            let _ = write!(out, "| {name} | {stream} |");
            for v in &versions {
                let cell = match recordings.get(&(*v, scenario.name.to_owned())) {
                    None => "(not recorded)".to_owned(),
                    Some(r) if stream >= r.stream_count() => {
                        if stream == 0 {
                            "(no ext_proc stream)".to_owned()
                        } else {
                            "—".to_owned()
                        }
                    }
                    Some(r) => stream_summary(
                        &r.events
                            .iter()
                            .filter(|e| e.stream == stream)
                            .collect::<Vec<_>>(),
                    ),
                };
                let _ = write!(out, " {cell} |");
            }
            let _ = writeln!(out);
        }
    }
    let _ = writeln!(out);
    let _ = writeln!(out, "Scenarios:");
    let _ = writeln!(out);
    for scenario in scenarios() {
        let _ = writeln!(out, "- `{}`: {}", scenario.name, scenario.description);
    }
    let _ = writeln!(out);
    let _ = writeln!(out, "{END}");
    out
}

/// Puts `block` under the "## Envoy versions" heading, replacing an earlier generated block;
/// creates the heading (and the file) when missing.
fn with_matrix(doc: &str, block: &str) -> String {
    if let (Some(begin), Some(end)) = (doc.find(BEGIN), doc.find(END)) {
        let end = end + END.len();
        let end = end + usize::from(doc[end..].starts_with('\n'));
        return format!("{}{block}{}", &doc[..begin], &doc[end..]);
    }
    if let Some(at) = doc.find(DOC_HEADING) {
        let after_heading = at + doc[at..].find('\n').map_or(doc.len() - at, |i| i + 1);
        // After the section's own prose, before the next heading.
        let next = doc[after_heading..]
            .find("\n## ")
            .map_or(doc.len(), |i| after_heading + i + 1);
        let mut before = doc[..next].trim_end().to_owned();
        before.push_str("\n\n");
        return format!("{before}{block}\n{}", &doc[next..]);
    }
    let mut out = doc.trim_end().to_owned();
    if !out.is_empty() {
        out.push_str("\n\n");
    }
    format!("{out}{DOC_HEADING}\n\n{block}")
}

#[test]
fn conformance_doc_has_the_generated_envoy_matrix() {
    let block = conformance_matrix();
    let path = doc_path();
    let doc = std::fs::read_to_string(&path).unwrap_or_default();
    if std::env::var_os("TOLLGATE_REGENERATE_CONFORMANCE").is_some() {
        std::fs::write(&path, with_matrix(&doc, &block)).expect("write docs/conformance.md");
        return;
    }
    assert!(
        doc.contains(&block),
        "docs/conformance.md does not contain the current Envoy-versions matrix; regenerate it \
         with TOLLGATE_REGENERATE_CONFORMANCE=1 cargo test --test it \
         replay::conformance_doc_has_the_generated_envoy_matrix\n\nexpected block:\n{block}"
    );
}
