use super::*;

fn window(name: &str, quantity: Quantity, window_ms: u64, limit: u64) -> WindowLimit {
    WindowLimit {
        name: name.to_owned(),
        quantity,
        window_ms,
        bucket_ms: window_ms / 12,
        limit,
    }
}

fn state(used: u64, limit: u64, reset_ms: u64) -> WindowState {
    WindowState {
        used,
        limit,
        reset_ms,
    }
}

#[test]
fn go_durations() {
    for (ms, text) in [
        (0, "0ms"),
        (12, "12ms"),
        (1_000, "1s"),
        (1_500, "1.5s"),
        (59_999, "59.999s"),
        (360_000, "6m0s"),
        (3_723_000, "1h2m3s"),
        (3_600_000, "1h0m0s"),
        (1_050, "1.05s"),
        (61_010, "1m1.01s"),
        (3_600_001, "1h0m0.001s"),
        (90_061_100, "25h1m1.1s"),
    ] {
        assert_eq!(go_duration(ms), text, "{ms}");
    }
}

/// The digits written in place are what formatting the seconds as a float to three places and
/// trimming its zeros gave (the way it was written before), for every millisecond of the first
/// two minutes and a spread beyond.
#[test]
fn go_durations_match_the_float_formatting() {
    let by_float = |ms: u64| {
        if ms < 1000 {
            return format!("{ms}ms");
        }
        let (hours, rest) = (ms / 3_600_000, ms % 3_600_000);
        let (minutes, rest) = (rest / 60_000, rest % 60_000);
        let seconds = if rest % 1000 == 0 {
            format!("{}s", rest / 1000)
        } else {
            let text = format!("{:.3}", rest as f64 / 1000.0);
            format!("{}s", text.trim_end_matches('0'))
        };
        match (hours, minutes) {
            (0, 0) => seconds,
            (0, m) => format!("{m}m{seconds}"),
            (h, m) => format!("{h}h{m}m{seconds}"),
        }
    };
    for ms in (0..120_000).chain((120_000..400_000_000).step_by(9_973)) {
        assert_eq!(go_duration(ms), by_float(ms), "{ms}");
    }
}

#[test]
fn headers_describe_the_tightest_windows_and_every_policy() {
    let windows = [
        window("tokens_minute", Quantity::Tokens, 60_000, 10_000),
        window("tokens_hour", Quantity::Tokens, 3_600_000, 100_000),
        window("requests_minute", Quantity::Requests, 60_000, 60),
    ];
    let states = [
        state(9_500, 10_000, 4_200),
        state(20_000, 100_000, 1_800_000),
        state(3, 60, 55_000),
    ];
    let headers = rate_limit_headers(&windows, &states, Some((1, 3)));
    let get = |name: &str| {
        headers
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    };
    assert_eq!(
        get("x-ratelimit-limit-tokens"),
        Some("10000"),
        "the minute is tighter"
    );
    assert_eq!(get("x-ratelimit-remaining-tokens"), Some("500"));
    assert_eq!(get("x-ratelimit-reset-tokens"), Some("4.2s"));
    assert_eq!(get("x-ratelimit-limit-requests"), Some("60"));
    assert_eq!(get("x-ratelimit-remaining-requests"), Some("57"));
    assert_eq!(get("x-ratelimit-reset-requests"), Some("55s"));
    assert_eq!(
        get("ratelimit-policy"),
        Some(
            "\"tokens_minute\";q=10000;w=60;qu=\"tokens\", \"tokens_hour\";q=100000;w=3600;qu=\"tokens\", \
             \"requests_minute\";q=60;w=60, \"concurrency\";q=3;qu=\"concurrent-requests\""
        )
    );
    assert_eq!(
        get("ratelimit"),
        Some(
            "\"tokens_minute\";r=500;t=5, \"tokens_hour\";r=80000;t=1800, \
             \"requests_minute\";r=57;t=55, \"concurrency\";r=2"
        )
    );
}

#[test]
fn no_limits_no_headers() {
    assert!(rate_limit_headers(&[], &[], None).is_empty());
}

#[test]
fn refusals_name_the_limit_and_when_to_return() {
    let windows = [window("tokens_hour", Quantity::Tokens, 3_600_000, 100_000)];
    let denied = |retry_after_ms, requested| Denied {
        limit: DeniedLimit::Window(0),
        used: 97_000,
        allowed: 100_000,
        requested,
        retry_after_ms,
        windows: vec![state(97_000, 100_000, 1_847_000)],
    };
    let header = |reply: &LocalReply, name: &str| {
        reply
            .headers
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.clone())
    };

    let soon = refusal(&windows, &denied(Some(30_500), 5_000), Some(3), "free");
    assert_eq!(
        (soon.status(), soon.reason),
        (429, Reason::TokenBudgetExhausted)
    );
    assert_eq!(header(&soon, "retry-after").as_deref(), Some("31"));
    assert_eq!(header(&soon, "retry-after-ms").as_deref(), Some("30500"));
    assert_eq!(header(&soon, "x-should-retry"), None);
    assert!(
        soon.message
            .contains("limit 100000, used 97000, requested 5000"),
        "{}",
        soon.message
    );
    assert!(soon.message.contains("30.5s"), "{}", soon.message);
    assert_eq!(
        header(&soon, "x-ratelimit-remaining-tokens").as_deref(),
        Some("3000")
    );

    let late = refusal(&windows, &denied(Some(1_800_000), 5_000), None, "free");
    assert_eq!(
        header(&late, "x-should-retry").as_deref(),
        Some("false"),
        "30 minutes is not soon"
    );

    let never = refusal(&windows, &denied(None, 150_000), None, "free");
    assert_eq!(never.reason, Reason::RequestExceedsBudget);
    assert_eq!(header(&never, "x-should-retry").as_deref(), Some("false"));
    assert_eq!(header(&never, "retry-after"), None);

    let body: serde_json::Value = serde_json::from_slice(&soon.body()).unwrap();
    assert_eq!(body["error"]["type"], "tokens");
    assert_eq!(body["error"]["code"], "rate_limit_exceeded");
}

#[test]
fn concurrency_refusals_are_about_requests() {
    let denied = Denied {
        limit: DeniedLimit::Concurrency,
        used: 3,
        allowed: 3,
        requested: 1,
        retry_after_ms: Some(1_000),
        windows: vec![],
    };
    let reply = refusal(&[], &denied, Some(3), "standard");
    assert_eq!(reply.reason, Reason::ConcurrencyLimitReached);
    let body: serde_json::Value = serde_json::from_slice(&reply.body()).unwrap();
    assert_eq!(body["error"]["type"], "requests");
    let ratelimit = reply
        .headers
        .iter()
        .find(|(k, _)| *k == "ratelimit")
        .unwrap();
    assert_eq!(ratelimit.1, "\"concurrency\";r=0");
}
