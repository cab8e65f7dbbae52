//! Unit tests for `ResponseObserver`: how a response ended (only the upstream's own end marker
//! makes a stream complete), the usage it reported, however the body is cut into chunks, and
//! the bounds on what is kept.

use super::*;

const SSE: Option<&str> = Some("text/event-stream");
const JSON: Option<&str> = Some("application/json");
const JSON_LIMIT: usize = 64 * 1024;

/// How the body's end is signalled.
#[derive(Clone, Copy, Debug)]
enum End {
    /// `end_of_stream` on the last chunk.
    OnLastChunk,
    /// A separate end of stream after the chunks (headers-only response, or trailers).
    After,
    /// Never: the stream was cut.
    Never,
}

fn observe(
    status: u16,
    content_type: Option<&str>,
    json_limit: usize,
    chunks: &[&str],
    end: End,
) -> ResponseObserver {
    let mut observer = ResponseObserver::new(status, content_type.map(str::as_bytes), json_limit);
    for (i, chunk) in chunks.iter().enumerate() {
        let last = i + 1 == chunks.len();
        observer.on_chunk(chunk.as_bytes(), last && matches!(end, End::OnLastChunk));
    }
    if matches!(end, End::After) || (chunks.is_empty() && matches!(end, End::OnLastChunk)) {
        observer.on_end_of_stream();
    }
    observer
}

fn usage(prompt_tokens: u64, completion_tokens: u64) -> Option<Usage> {
    Some(Usage {
        prompt_tokens,
        completion_tokens,
    })
}

/// A 200 response of `content_type` in `chunks`, ended by `end`, ends as `expected` with
/// `expected_usage`.
#[track_caller]
fn check(
    content_type: Option<&str>,
    chunks: &[&str],
    end: End,
    expected: ResponseEnd,
    expected_usage: Option<Usage>,
) {
    check_with(
        200,
        content_type,
        JSON_LIMIT,
        chunks,
        end,
        expected,
        expected_usage,
    );
}

#[track_caller]
fn check_with(
    status: u16,
    content_type: Option<&str>,
    json_limit: usize,
    chunks: &[&str],
    end: End,
    expected: ResponseEnd,
    expected_usage: Option<Usage>,
) {
    let observer = observe(status, content_type, json_limit, chunks, end);
    let shown: Vec<String> = chunks
        .iter()
        .map(|c| c.chars().take(80).collect())
        .collect();
    assert_eq!(observer.end(), expected, "{shown:?} {end:?}");
    assert_eq!(observer.usage(), expected_usage, "{shown:?} {end:?}");
    let bytes: usize = chunks.iter().map(|c| c.len()).sum();
    assert_eq!(observer.body_bytes(), bytes as u64);
}

const DELTA: &str = "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}],\"usage\":null}\n\n";
const USAGE: &str = "data: {\"id\":\"c1\",\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":34,\"total_tokens\":46}}\n\n";
const DONE: &str = "data: [DONE]\n\n";

#[test]
fn event_stream_with_done_is_complete_with_its_usage() {
    use End::*;
    use ResponseEnd::*;
    check(
        SSE,
        &[DELTA, DELTA, USAGE, DONE],
        OnLastChunk,
        Complete,
        usage(12, 34),
    );
    check(
        SSE,
        &[&format!("{DELTA}{USAGE}{DONE}")],
        OnLastChunk,
        Complete,
        usage(12, 34),
    );
    check(
        SSE,
        &[DELTA, USAGE, DONE, ""],
        OnLastChunk,
        Complete,
        usage(12, 34),
    );
    check(SSE, &[DELTA, USAGE, DONE], After, Complete, usage(12, 34));
    // Without include_usage the stream still completes.
    check(SSE, &[DELTA, DONE], OnLastChunk, Complete, None);
}

#[test]
fn event_stream_without_done_is_truncated() {
    use End::*;
    use ResponseEnd::*;
    check(SSE, &[DELTA, USAGE], OnLastChunk, Truncated, usage(12, 34));
    check(SSE, &[DELTA], After, Truncated, None);
    check(SSE, &[], OnLastChunk, Truncated, None);
    // [DONE] arrived but the stream never ended properly.
    check(SSE, &[DELTA, USAGE, DONE], Never, Truncated, usage(12, 34));
    check(SSE, &[DELTA], Never, Truncated, None);
}

#[test]
fn done_must_be_a_whole_data_line() {
    use End::*;
    use ResponseEnd::*;
    let quoted = "data: {\"choices\":[{\"delta\":{\"content\":\"data: [DONE]\"}}]}\n\n";
    check(SSE, &[quoted], OnLastChunk, Truncated, None);
    check(SSE, &[": data: [DONE]\n\n"], OnLastChunk, Truncated, None);
    check(SSE, &["event: [DONE]\n\n"], OnLastChunk, Truncated, None);
    check(
        SSE,
        &["data: [DONE] and more\n\n"],
        OnLastChunk,
        Truncated,
        None,
    );
    check(SSE, &["data:[DONE]\n\n"], OnLastChunk, Complete, None);
    check(SSE, &["data:   [DONE]  \n\n"], OnLastChunk, Complete, None);
    // A last line without its newline still counts once the stream ends.
    check(SSE, &[DELTA, "data: [DONE]"], OnLastChunk, Complete, None);
    check(SSE, &[DELTA, "data: [DONE]"], After, Complete, None);
}

#[test]
fn event_stream_lines_may_be_split_anywhere() {
    use End::*;
    use ResponseEnd::*;
    let whole = format!("{DELTA}{USAGE}{DONE}");
    // Every single cut point, including inside `data:` and inside `[DONE]`.
    for cut in 1..whole.len() {
        let (a, b) = whole.split_at(cut);
        check(SSE, &[a, b], OnLastChunk, Complete, usage(12, 34));
    }
    // One byte at a time.
    let bytes: Vec<String> = whole.chars().map(String::from).collect();
    let bytes: Vec<&str> = bytes.iter().map(String::as_str).collect();
    check(SSE, &bytes, OnLastChunk, Complete, usage(12, 34));
    check(
        SSE,
        &["dat", "a: [DO", "NE]", "\n\n"],
        OnLastChunk,
        Complete,
        None,
    );
}

#[test]
fn event_stream_lines_may_end_with_crlf() {
    use End::*;
    use ResponseEnd::*;
    let crlf = |s: &str| s.replace('\n', "\r\n");
    let (delta, usage_chunk, done) = (crlf(DELTA), crlf(USAGE), crlf(DONE));
    check(
        SSE,
        &[&delta, &usage_chunk, &done],
        OnLastChunk,
        Complete,
        usage(12, 34),
    );
    // The \r and the \n in different chunks.
    check(
        SSE,
        &["data: [DONE]\r", "\n\r\n"],
        OnLastChunk,
        Complete,
        None,
    );
}

#[test]
fn usage_comes_from_the_chunk_that_carries_one() {
    use End::*;
    use ResponseEnd::*;
    let other =
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2}}\n\n";
    // Earlier `"usage": null` chunks are ignored, and so is one after the real usage.
    check(
        SSE,
        &[DELTA, DELTA, USAGE, DELTA, DONE],
        OnLastChunk,
        Complete,
        usage(12, 34),
    );
    // vLLM's continuous usage stats: the last report wins.
    check(
        SSE,
        &[other, USAGE, DONE],
        OnLastChunk,
        Complete,
        usage(12, 34),
    );
    check(
        SSE,
        &[USAGE, other, DONE],
        OnLastChunk,
        Complete,
        usage(1, 2),
    );
    // A usage object without the counts is no usage.
    let partial = "data: {\"usage\":{\"total_tokens\":5}}\n\n";
    check(SSE, &[partial, DONE], OnLastChunk, Complete, None);
    let not_json = "data: {\"usage\": {\"prompt_tokens\": 1\n\n";
    check(SSE, &[not_json, DONE], OnLastChunk, Complete, None);
    // Only `data:` lines carry events.
    let commented = ": {\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2}}\n\n";
    check(SSE, &[commented, DONE], OnLastChunk, Complete, None);
}

#[test]
fn event_stream_is_recognised_by_its_media_type() {
    use End::*;
    use ResponseEnd::*;
    let with_params = Some("text/event-stream; charset=utf-8");
    check(
        with_params,
        &[USAGE, DONE],
        OnLastChunk,
        Complete,
        usage(12, 34),
    );
    check(
        Some("Text/Event-Stream"),
        &[DELTA],
        OnLastChunk,
        Truncated,
        None,
    );
    // Not SSE: read as one JSON document, which an event stream is not.
    check(None, &[USAGE, DONE], OnLastChunk, Complete, None);
    check(JSON, &[USAGE, DONE], OnLastChunk, Complete, None);
    check(Some("text/event"), &[DELTA], OnLastChunk, Complete, None);
}

#[test]
fn sse_line_over_a_mebibyte_is_dropped_without_losing_later_lines() {
    use End::*;
    use ResponseEnd::*;
    let half = "x".repeat(MAX_SSE_LINE / 2 + 1);
    let start = "data: {\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2},\"pad\":\"";
    // The long line carries a usage, but it is dropped, not read.
    check(
        SSE,
        &[start, &half, &half, "\"}\n\n", DONE],
        OnLastChunk,
        Complete,
        None,
    );
    check(
        SSE,
        &[start, &half, &half, &half, "\"}\n\n", DONE],
        OnLastChunk,
        Complete,
        None,
    );
    // Lines after it are read as usual.
    check(
        SSE,
        &[start, &half, &half, "\"}\n\n", USAGE, DONE],
        OnLastChunk,
        Complete,
        usage(12, 34),
    );
    check(
        SSE,
        &[start, &half, &half, &format!("\"}}\n\n{USAGE}{DONE}")],
        OnLastChunk,
        Complete,
        usage(12, 34),
    );
    // Lines before it were read already.
    check(
        SSE,
        &[USAGE, start, &half, &half, "\"}\n\n", DONE],
        OnLastChunk,
        Complete,
        usage(12, 34),
    );
}

/// A data line carrying usage (5, 6), padded to `len` bytes.
fn padded_usage_line(len: usize) -> String {
    let (head, tail) = (
        "data: {\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":6},\"pad\":\"",
        "\"}",
    );
    format!("{head}{}{tail}", "x".repeat(len - head.len() - tail.len()))
}

#[test]
fn sse_line_bound_is_inclusive() {
    use End::*;
    use ResponseEnd::*;
    let at_bound = padded_usage_line(MAX_SSE_LINE);
    let (a, b) = at_bound.split_at(MAX_SSE_LINE / 2);
    check(
        SSE,
        &[a, b, "\n\n", DONE],
        OnLastChunk,
        Complete,
        usage(5, 6),
    );
    let over = padded_usage_line(MAX_SSE_LINE + 1);
    let (a, b) = over.split_at(MAX_SSE_LINE / 2);
    check(SSE, &[a, b, "\n\n", DONE], OnLastChunk, Complete, None);
    // A long line that arrives whole, newline included, is never held, so nothing is dropped.
    let whole = format!("{}\n\n", padded_usage_line(2 * MAX_SSE_LINE));
    check(SSE, &[&whole, DONE], OnLastChunk, Complete, usage(5, 6));
}

const JSON_BODY: &str = r#"{"id":"c1","object":"chat.completion","choices":[{"message":{"role":"assistant","content":"Hi"}}],"usage":{"prompt_tokens":9,"completion_tokens":3,"total_tokens":12}}"#;

#[test]
fn json_usage_is_read_at_the_end() {
    use End::*;
    use ResponseEnd::*;
    check(JSON, &[JSON_BODY], OnLastChunk, Complete, usage(9, 3));
    check(None, &[JSON_BODY], OnLastChunk, Complete, usage(9, 3));
    let (a, b) = JSON_BODY.split_at(40);
    check(JSON, &[a, b], OnLastChunk, Complete, usage(9, 3));
    check(JSON, &[a, b], After, Complete, usage(9, 3));
    check(JSON, &[a, b, ""], OnLastChunk, Complete, usage(9, 3));
    // Not read before the end: a cut body is truncated, usage unknown.
    check(JSON, &[JSON_BODY], Never, Truncated, None);
    check(JSON, &[a], Never, Truncated, None);
}

#[test]
fn json_without_usable_usage_is_complete_without_usage() {
    use End::*;
    use ResponseEnd::*;
    check(JSON, &[r#"{"id":"c1"}"#], OnLastChunk, Complete, None);
    check(JSON, &[r#"{"usage":null}"#], OnLastChunk, Complete, None);
    check(
        JSON,
        &[r#"{"usage":{"prompt_tokens":-1,"completion_tokens":3}}"#],
        OnLastChunk,
        Complete,
        None,
    );
    check(JSON, &[&JSON_BODY[..60]], OnLastChunk, Complete, None);
    check(JSON, &["not json"], OnLastChunk, Complete, None);
}

#[test]
fn headers_only_response_is_complete() {
    check(JSON, &[], End::OnLastChunk, ResponseEnd::Complete, None);
    check(None, &[], End::After, ResponseEnd::Complete, None);
    check(JSON, &[], End::Never, ResponseEnd::Truncated, None);
}

#[test]
fn json_over_the_limit_is_complete_without_usage() {
    use End::*;
    use ResponseEnd::*;
    let len = JSON_BODY.len();
    let (a, b) = JSON_BODY.split_at(40);
    check_with(200, JSON, len, &[a, b], OnLastChunk, Complete, usage(9, 3));
    check_with(200, JSON, len - 1, &[a, b], OnLastChunk, Complete, None);
    check_with(
        200,
        JSON,
        len - 1,
        &[JSON_BODY],
        OnLastChunk,
        Complete,
        None,
    );
    // Once over, later chunks do not start a fresh document.
    check_with(
        200,
        JSON,
        30,
        &[a, r#"{"usage":{"prompt_tokens":1,"completion_tokens":1}}"#],
        OnLastChunk,
        Complete,
        None,
    );
}

#[test]
fn non_2xx_is_an_upstream_error_without_usage() {
    use End::*;
    use ResponseEnd::*;
    for status in [100, 199, 300, 304, 400, 429, 500, 503] {
        check_with(
            status,
            JSON,
            JSON_LIMIT,
            &[JSON_BODY],
            OnLastChunk,
            UpstreamError,
            None,
        );
        check_with(
            status,
            SSE,
            JSON_LIMIT,
            &[USAGE, DONE],
            OnLastChunk,
            UpstreamError,
            None,
        );
        check_with(status, JSON, JSON_LIMIT, &[], Never, UpstreamError, None);
    }
    for status in [200, 201, 299] {
        check_with(
            status,
            JSON,
            JSON_LIMIT,
            &[JSON_BODY],
            OnLastChunk,
            Complete,
            usage(9, 3),
        );
    }
}

/// Feeding `chunks` (the last with end_of_stream) reports the first body byte exactly on the
/// chunks marked true in `expected`.
#[track_caller]
fn check_first_byte(content_type: Option<&str>, chunks: &[&str], expected: &[bool]) {
    let mut observer = ResponseObserver::new(200, content_type.map(str::as_bytes), JSON_LIMIT);
    let got: Vec<bool> = chunks
        .iter()
        .enumerate()
        .map(|(i, c)| observer.on_chunk(c.as_bytes(), i + 1 == chunks.len()))
        .collect();
    assert_eq!(got, expected, "{chunks:?}");
}

#[test]
fn first_body_byte_is_reported_once() {
    check_first_byte(SSE, &[DELTA, DELTA, DONE], &[true, false, false]);
    check_first_byte(SSE, &["", "", DELTA, DONE], &[false, false, true, false]);
    check_first_byte(JSON, &["{", "}"], &[true, false]);
    check_first_byte(JSON, &[""], &[false]);
    check_first_byte(JSON, &["", "{}"], &[false, true]);
}

#[test]
fn first_body_byte_is_reported_for_error_responses_too() {
    let mut observer = ResponseObserver::new(500, JSON.map(str::as_bytes), JSON_LIMIT);
    assert!(observer.on_chunk(b"{\"error\":{}}", false));
    assert!(!observer.on_chunk(b" ", true));
    assert_eq!(observer.body_bytes(), 13);
}

#[test]
fn end_of_stream_twice_changes_nothing() {
    let mut observer = observe(200, SSE, JSON_LIMIT, &[USAGE, DONE], End::OnLastChunk);
    observer.on_end_of_stream();
    assert_eq!(observer.end(), ResponseEnd::Complete);
    assert_eq!(observer.usage(), usage(12, 34));
}

#[test]
fn every_end_has_a_distinct_metric_label() {
    let labels: Vec<&str> = ResponseEnd::ALL.iter().map(|e| e.as_str()).collect();
    assert_eq!(
        labels,
        ["complete", "truncated", "upstream_error", "no_response"]
    );
}

static TIKTOKEN_O200K: std::sync::LazyLock<tiktoken_rs::CoreBPE> =
    std::sync::LazyLock::new(|| tiktoken_rs::o200k_base().expect("tiktoken-rs ships o200k_base"));

/// Reference count of each piece of generated text, summed: the upstream streams text in
/// pieces, and each piece is counted as it arrives.
fn o200k(pieces: &[&str]) -> u64 {
    pieces
        .iter()
        .map(|p| TIKTOKEN_O200K.encode_ordinary(p).len() as u64)
        .sum()
}

/// A 200 response of `content_type` in `chunks`, watched with output counting (o200k), counts
/// `expected` generated tokens.
#[track_caller]
fn check_output_tokens(content_type: Option<&str>, chunks: &[&str], expected: u64) {
    let mut observer = ResponseObserver::new(200, content_type.map(str::as_bytes), JSON_LIMIT)
        .counting_output(Encoding::O200kBase);
    for (i, chunk) in chunks.iter().enumerate() {
        observer.on_chunk(chunk.as_bytes(), i + 1 == chunks.len());
    }
    assert_eq!(observer.output_tokens(), expected, "{chunks:?}");
}

/// A chat SSE chunk whose choices' deltas are `delta` objects.
fn chat_chunk(deltas: &[&str]) -> String {
    let choices: Vec<String> = deltas
        .iter()
        .enumerate()
        .map(|(i, d)| format!(r#"{{"index":{i},"delta":{d}}}"#))
        .collect();
    format!("data: {{\"choices\":[{}]}}\n\n", choices.join(","))
}

#[test]
fn generated_text_is_counted_when_asked() {
    let role = chat_chunk(&[r#"{"role":"assistant","content":""}"#]);
    let pieces = ["Hello", ",", " wonderful", " world", "! 日本語"];
    let mut chunks = vec![role];
    chunks.extend(
        pieces
            .iter()
            .map(|p| chat_chunk(&[&format!(r#"{{"content":"{p}"}}"#)])),
    );
    chunks.push(USAGE.to_owned());
    chunks.push(DONE.to_owned());
    let chunks: Vec<&str> = chunks.iter().map(String::as_str).collect();
    check_output_tokens(SSE, &chunks, o200k(&pieces));
    // Every choice of n counts.
    let two = chat_chunk(&[
        r#"{"content":"Hello there"}"#,
        r#"{"content":"General Kenobi"}"#,
    ]);
    check_output_tokens(
        SSE,
        &[&two, DONE],
        o200k(&["Hello there", "General Kenobi"]),
    );
    // Completions stream `text`.
    let text = "data: {\"choices\":[{\"index\":0,\"text\":\"Once upon a time\"}]}\n\n";
    check_output_tokens(SSE, &[text, DONE], o200k(&["Once upon a time"]));
    // Chunks without text count nothing.
    let finish = chat_chunk(&[r#"{"content":null}"#]);
    check_output_tokens(SSE, &[&finish, USAGE, DONE], 0);
}

#[test]
fn generated_text_of_a_json_body_is_counted_at_the_end() {
    // A body that reports usage is charged by it; counting its text would be wasted work.
    let (a, b) = JSON_BODY.split_at(50);
    check_output_tokens(JSON, &[a, b], 0);
    // ...and its usage is read all the same.
    let mut counting = ResponseObserver::new(200, JSON.map(str::as_bytes), JSON_LIMIT)
        .counting_output(Encoding::O200kBase);
    counting.on_chunk(a.as_bytes(), false);
    counting.on_chunk(b.as_bytes(), true);
    assert_eq!(
        counting.usage(),
        Some(Usage {
            prompt_tokens: 9,
            completion_tokens: 3
        })
    );
    let without_usage = JSON_BODY.replace(
        r#","usage":{"prompt_tokens":9,"completion_tokens":3,"total_tokens":12}"#,
        "",
    );
    assert_ne!(without_usage, JSON_BODY);
    let (a, b) = without_usage.split_at(50);
    check_output_tokens(JSON, &[a, b], o200k(&["Hi"]));
    let chat = r#"{"choices":[{"message":{"role":"assistant","content":"The sky is blue because of Rayleigh scattering."}}]}"#;
    check_output_tokens(
        JSON,
        &[chat],
        o200k(&["The sky is blue because of Rayleigh scattering."]),
    );
    let completion =
        r#"{"choices":[{"text":" in a land far away"},{"text":" there lived a dragon"}]}"#;
    check_output_tokens(
        JSON,
        &[completion],
        o200k(&[" in a land far away", " there lived a dragon"]),
    );
}

#[test]
fn generated_text_is_not_counted_unless_asked_or_for_errors() {
    let hello = chat_chunk(&[r#"{"content":"Hello"}"#]);
    let observer = observe(200, SSE, JSON_LIMIT, &[&hello, DONE], End::OnLastChunk);
    assert_eq!(observer.output_tokens(), 0);
    let mut failed = ResponseObserver::new(500, SSE.map(str::as_bytes), JSON_LIMIT)
        .counting_output(Encoding::O200kBase);
    failed.on_chunk(hello.as_bytes(), true);
    assert_eq!(failed.output_tokens(), 0);
}

/// Reading only the usage member gives what parsing the whole document and reading its usage
/// gave, on documents built to tell them apart.
#[test]
fn usage_read_alone_is_the_usage_of_the_whole_document() {
    let whole = |json: &[u8]| {
        serde_json::from_slice::<Value>(json)
            .ok()
            .and_then(|doc| usage_of(&doc))
    };
    const USAGE: &str = r#""usage":{"prompt_tokens":1,"completion_tokens":2}"#;
    // A document and the usage both parses must find in it.
    type Case = (Vec<u8>, Option<(u64, u64)>);
    let cases: Vec<Case> = [
        (JSON_BODY.to_owned(), Some((9, 3))),
        (format!("{{{USAGE}}}"), Some((1, 2))),
        // The last of repeated members, as `Value` keeps it, either way round.
        (
            format!(r#"{{{USAGE},"usage":{{"prompt_tokens":3,"completion_tokens":4}}}}"#),
            Some((3, 4)),
        ),
        (format!(r#"{{{USAGE},"usage":null}}"#), None),
        (format!(r#"{{"usage":null,{USAGE}}}"#), Some((1, 2))),
        // An escaped name is the same name.
        (
            r#"{"us\u0061ge":{"prompt_tokens":7,"completion_tokens":8}}"#.to_owned(),
            Some((7, 8)),
        ),
        // Repeated counts inside usage: the last.
        (
            r#"{"usage":{"prompt_tokens":1,"prompt_tokens":9,"completion_tokens":2}}"#.to_owned(),
            Some((9, 2)),
        ),
        // Only the top level's usage counts.
        (format!(r#"{{"choices":[{{{USAGE}}}]}}"#), None),
        (r#"{"usage":{"prompt_tokens":1}}"#.to_owned(), None),
        (
            r#"{"usage":{"prompt_tokens":1.0,"completion_tokens":2}}"#.to_owned(),
            None,
        ),
        (
            r#"{"usage":{"prompt_tokens":-1,"completion_tokens":2}}"#.to_owned(),
            None,
        ),
        (
            r#"{"usage":{"prompt_tokens":18446744073709551615,"completion_tokens":0}}"#.to_owned(),
            Some((u64::MAX, 0)),
        ),
        (
            r#"{"usage":{"prompt_tokens":18446744073709551616,"completion_tokens":0}}"#.to_owned(),
            None,
        ),
        (r#"{"usage":[1,2]}"#.to_owned(), None),
        (r#"{"usage":"a lot"}"#.to_owned(), None),
        // Not an object, or not JSON: nothing, however usage-like the contents.
        (
            r#"[{"prompt_tokens":1,"completion_tokens":2}]"#.to_owned(),
            None,
        ),
        (format!("[{{{USAGE}}}]"), None),
        (format!("{{{USAGE}}} x"), None),
        (format!("{{{USAGE}"), None),
        (format!(r#"{{{USAGE},"bad":}}"#), None),
        (format!(r#"{{{USAGE},"s":"\x"}}"#), None),
        ("null".to_owned(), None),
        (String::new(), None),
        // What the whole parse refuses in a member it would not use: an unpaired surrogate,
        // numbers out of range, in a value or a nested key.
        (format!(r#"{{{USAGE},"s":"\ud800"}}"#), None),
        (format!(r#"{{{USAGE},"n":1e400}}"#), None),
        (format!(r#"{{{USAGE},"n":-1e400}}"#), None),
        (format!(r#"{{{USAGE},"n":1{}}}"#, "0".repeat(400)), None),
        (format!(r#"{{{USAGE},"o":{{"\udc00":1}}}}"#), None),
        // In range, and valid escapes: fine.
        (
            format!(r#"{{{USAGE},"n":[1e300,-0,0.5e-3,1E2],"s":"\ud83d\ude00\n"}}"#),
            Some((1, 2)),
        ),
        // Trailing white space is allowed by both.
        (format!("{{{USAGE}}}\r\n "), Some((1, 2))),
    ]
    .into_iter()
    .map(|(json, expected)| (json.into_bytes(), expected))
    .chain([
        // Invalid UTF-8 in a string the whole parse builds and this one skips, in a value and
        // in a nested key; then in no string at all.
        (
            [format!(r#"{{{USAGE},"s":""#).as_bytes(), b"\xff\"}"].concat(),
            None,
        ),
        (
            [format!(r#"{{{USAGE},"o":{{""#).as_bytes(), b"\xc3\":1}}"].concat(),
            None,
        ),
        ([format!("{{{USAGE}}}").as_bytes(), b"\xff"].concat(), None),
    ])
    .collect();
    for (json, expected) in &cases {
        let expected = expected.map(|(prompt_tokens, completion_tokens)| Usage {
            prompt_tokens,
            completion_tokens,
        });
        let shown = String::from_utf8_lossy(json);
        assert_eq!(whole(json), expected, "the whole parse of {shown}");
        assert_eq!(usage_in(json), expected, "{shown}");
    }
    // Nested beside the usage, up to and past serde_json's recursion limit: the same answer,
    // the usage while under it and nothing past it (both sides checked, so the comparison
    // covers both answers).
    let nested = |depth: usize| {
        format!(
            r#"{{{USAGE},"x":{}{}}}"#,
            "[".repeat(depth),
            "]".repeat(depth)
        )
    };
    for depth in [100, 126, 127, 128, 1000] {
        let deep = nested(depth);
        assert_eq!(
            usage_in(deep.as_bytes()),
            whole(deep.as_bytes()),
            "nested {depth} deep"
        );
    }
    assert!(usage_in(nested(100).as_bytes()).is_some());
    assert!(usage_in(nested(1000).as_bytes()).is_none());
}
