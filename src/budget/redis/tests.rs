//! What the Redis store decides without a server: key names and hash tags, argument clamping,
//! decoding the scripts' replies (and refusing bad ones without panicking), and mapping
//! redis-rs errors to `StoreError`. The server-side behaviour is in `tests/it/redis_store.rs`
//! and the shared contract suite.

use super::*;

fn limit(name: &str, quantity: Quantity, limit: u64) -> WindowLimit {
    WindowLimit {
        name: name.into(),
        quantity,
        window_ms: 60_000,
        bucket_ms: 1_000,
        limit,
    }
}

fn two_windows() -> Vec<WindowLimit> {
    vec![
        limit("tokens_minute", Quantity::Tokens, 1_000),
        limit("requests_minute", Quantity::Requests, 10),
    ]
}

/// The hash tag Redis Cluster hashes: the text between the first `{` and the next `}`, if that
/// is not empty; else the whole key.
fn hash_tag(key: &str) -> &str {
    if let Some(open) = key.find('{')
        && let Some(len) = key[open + 1..].find('}')
        && len > 0
    {
        return &key[open + 1..open + 1 + len];
    }
    key
}

const AWKWARD_TENANTS: &[&str] = &[
    "alice",
    "",
    "{",
    "}",
    "}{",
    "{tenant}",
    "a{b}c",
    "{}",
    "ünïcödé ✓",
    "with\0nul and\nnewline",
    "tollgate:{x}:leases",
];

#[test]
fn tenant_tag_is_32_lowercase_hex_characters() {
    for tenant in AWKWARD_TENANTS {
        let tag = tenant_tag(tenant);
        assert_eq!(tag.len(), 32, "{tenant:?} -> {tag}");
        assert!(
            tag.chars()
                .all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c)),
            "{tenant:?} -> {tag}"
        );
        assert_eq!(tag, tenant_tag(tenant), "deterministic");
    }
}

#[test]
fn distinct_tenants_get_distinct_tags() {
    let mut tags: Vec<String> = AWKWARD_TENANTS.iter().map(|t| tenant_tag(t)).collect();
    tags.sort();
    tags.dedup();
    assert_eq!(tags.len(), AWKWARD_TENANTS.len());
}

#[test]
fn every_key_of_a_tenant_hashes_on_its_tag() {
    for tenant in AWKWARD_TENANTS {
        let tag = tenant_tag(tenant);
        let named = TenantKeys::of(tenant);
        let keys = [
            named.leases(),
            named.window("tokens_minute"),
            named.window("requests_day"),
            // Window names are key-safe by contract; even a brace in one cannot move the slot,
            // as only the first `{...}` counts.
            named.window("odd{name}"),
        ];
        for key in &keys {
            assert_eq!(hash_tag(key), tag, "{tenant:?}: {key}");
            assert!(key.starts_with("tollgate:{"), "{key}");
        }
    }
}

#[test]
fn key_layout() {
    let tag = tenant_tag("alice");
    let keys = TenantKeys::of("alice");
    assert_eq!(keys.leases(), format!("tollgate:{{{tag}}}:leases"));
    assert_eq!(
        keys.window("tokens_hour"),
        format!("tollgate:{{{tag}}}:w:tokens_hour")
    );
}

#[test]
fn evalsha_writes_the_keys_the_strings_name() {
    let scripts = Scripts::new();
    let mut windows = two_windows();
    windows.push(limit("odd{name}", Quantity::Tokens, 7));
    for tenant in AWKWARD_TENANTS {
        let keys = TenantKeys::of(tenant);
        // Spelled out, not through `TenantKeys`, which shares `evalsha`'s way of writing them.
        let tag = tenant_tag(tenant);
        for windows in [&windows[..0], &windows[..]] {
            let mut expected = redis::cmd("EVALSHA");
            expected
                .arg(scripts.reserve.get_hash())
                .arg(1 + windows.len())
                .arg(format!("tollgate:{{{tag}}}:leases"));
            for w in windows {
                expected.arg(format!("tollgate:{{{tag}}}:w:{}", w.name));
            }
            let mut command = evalsha(&scripts.reserve, &keys, windows, 1, 1);
            command.arg("lease").arg(exact(u64::MAX));
            expected.arg("lease").arg(exact(u64::MAX));
            assert_eq!(
                command.get_packed_command(),
                expected.get_packed_command(),
                "{tenant:?}, {} windows",
                windows.len()
            );
        }
    }
}

#[test]
fn arguments_are_clamped_to_what_a_lua_number_holds_exactly() {
    assert_eq!(exact(0), 0);
    assert_eq!(exact(123_456), 123_456);
    assert_eq!(exact(MAX_EXACT), MAX_EXACT);
    assert_eq!(exact(MAX_EXACT + 1), MAX_EXACT);
    assert_eq!(exact(u64::MAX), MAX_EXACT);
    // 2^53 - 1 survives a round trip through f64 (Lua's number); 2^53 + 1 would not.
    assert_eq!(MAX_EXACT as f64 as u64, MAX_EXACT);
}

#[test]
fn decodes_a_grant() {
    let windows = two_windows();
    let reply = [1, 1_700_000_000_123, 2, 300, 59_877, 1, 59_877];
    let expected = Reserve::Granted(Granted {
        at_ms: 1_700_000_000_123,
        windows: vec![
            WindowState {
                used: 300,
                limit: 1_000,
                reset_ms: 59_877,
            },
            WindowState {
                used: 1,
                limit: 10,
                reset_ms: 59_877,
            },
        ],
        concurrent: Some(2),
    });
    assert_eq!(decode_reserve(&reply, &windows, Some(4)), Ok(expected));

    // Without a concurrency limit the script sends -1, and the grant says None.
    let reply = [1, 5, -1, 0, 0, 1, 100];
    let Ok(Reserve::Granted(granted)) = decode_reserve(&reply, &windows, None) else {
        panic!("a grant");
    };
    assert_eq!(granted.concurrent, None);
    assert_eq!(granted.windows[0].reset_ms, 0);
}

#[test]
fn decodes_denials() {
    let windows = two_windows();
    let states = [900, 1_000, 3, 2_000];
    let window_states = vec![
        WindowState {
            used: 900,
            limit: 1_000,
            reset_ms: 1_000,
        },
        WindowState {
            used: 3,
            limit: 10,
            reset_ms: 2_000,
        },
    ];

    let reply = [&[0, 7, 1, 900, 1_000, 200, 1_000][..], &states].concat();
    assert_eq!(
        decode_reserve(&reply, &windows, None),
        Ok(Reserve::Denied(Denied {
            limit: DeniedLimit::Window(0),
            used: 900,
            allowed: 1_000,
            requested: 200,
            retry_after_ms: Some(1_000),
            windows: window_states.clone(),
        }))
    );

    // A cost above the whole limit can never fit: -1 is None.
    let reply = [&[0, 7, 1, 900, 1_000, 5_000, -1][..], &states].concat();
    let Ok(Reserve::Denied(denied)) = decode_reserve(&reply, &windows, None) else {
        panic!("a denial");
    };
    assert_eq!(denied.retry_after_ms, None);

    let reply = [&[0, 7, 2, 10, 10, 1, 2_000][..], &states].concat();
    let Ok(Reserve::Denied(denied)) = decode_reserve(&reply, &windows, None) else {
        panic!("a denial");
    };
    assert_eq!(denied.limit, DeniedLimit::Window(1));

    let reply = [&[0, 7, 0, 3, 3, 1, 450][..], &states].concat();
    assert_eq!(
        decode_reserve(&reply, &windows, Some(3)),
        Ok(Reserve::Denied(Denied {
            limit: DeniedLimit::Concurrency,
            used: 3,
            allowed: 3,
            requested: 1,
            retry_after_ms: Some(450),
            windows: window_states,
        }))
    );
}

#[test]
fn bad_replies_are_protocol_errors_not_panics() {
    let windows = two_windows();
    let bad: &[(&str, &[i64], Option<u32>)] = &[
        ("empty", &[], None),
        ("unknown tag", &[2, 0, 0, 0, 0, 0, 0], None),
        ("grant without windows", &[1, 5, -1], None),
        ("grant with one window too few", &[1, 5, -1, 0, 0], None),
        (
            "grant with a window too many",
            &[1, 5, -1, 0, 0, 0, 0, 0, 0],
            None,
        ),
        ("negative usage", &[1, 5, -1, -3, 0, 0, 0], None),
        ("negative time", &[1, -5, -1, 0, 0, 0, 0], None),
        (
            "no lease count under a limit",
            &[1, 5, -1, 0, 0, 0, 0],
            Some(2),
        ),
        ("negative lease count", &[1, 5, -7, 0, 0, 0, 0], Some(2)),
        ("denial too short", &[0, 5, 1, 0, 0], None),
        (
            "denied by window 3 of 2",
            &[0, 5, 3, 0, 0, 0, 0, 0, 0, 0, 0],
            None,
        ),
        (
            "denied by window -1",
            &[0, 5, -1, 0, 0, 0, 0, 0, 0, 0, 0],
            None,
        ),
        (
            "denied by concurrency without a limit",
            &[0, 5, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            None,
        ),
        ("negative retry", &[0, 5, 1, 0, 0, 0, -2, 0, 0, 0, 0], None),
    ];
    for (what, reply, max_concurrent) in bad {
        let result = decode_reserve(reply, &windows, *max_concurrent);
        assert!(
            matches!(result, Err(StoreError::Protocol(_))),
            "{what}: {result:?}"
        );
    }
}

#[test]
fn decodes_usage() {
    let windows = two_windows();
    assert_eq!(
        decode_usage(&[2, 40, 500, 1, 600], &windows),
        Ok(Usage {
            windows: vec![
                WindowState {
                    used: 40,
                    limit: 1_000,
                    reset_ms: 500,
                },
                WindowState {
                    used: 1,
                    limit: 10,
                    reset_ms: 600,
                },
            ],
            leases: 2,
        })
    );
    assert_eq!(
        decode_usage(&[0], &[]),
        Ok(Usage {
            windows: vec![],
            leases: 0
        })
    );
    for bad in [&[][..], &[1, 2][..], &[-1, 0, 0, 0, 0][..]] {
        assert!(
            matches!(decode_usage(bad, &windows), Err(StoreError::Protocol(_))),
            "{bad:?}"
        );
    }
}

/// A server error reply as redis-rs would hand it over.
fn server_error(line: &str) -> RedisError {
    match redis::parse_redis_value(format!("-{line}\r\n").as_bytes()) {
        Ok(redis::Value::ServerError(e)) => e.into(),
        Err(e) => e,
        Ok(other) => panic!("{line:?} parsed as {other:?}"),
    }
}

#[test]
fn errors_map_to_what_the_caller_can_do_about_them() {
    let timeout = Duration::from_millis(50);
    let io = |kind| RedisError::from(std::io::Error::from(kind));
    let cases: Vec<(RedisError, &str)> = vec![
        (io(std::io::ErrorKind::TimedOut), "timeout"),
        (io(std::io::ErrorKind::ConnectionRefused), "unavailable"),
        (io(std::io::ErrorKind::ConnectionReset), "unavailable"),
        (io(std::io::ErrorKind::BrokenPipe), "unavailable"),
        (
            RedisError::from((ErrorKind::UnexpectedReturnType, "not integers")),
            "protocol",
        ),
        (
            server_error("LOADING Redis is loading the dataset"),
            "unavailable",
        ),
        (
            server_error("READONLY You can't write against a read only replica."),
            "unavailable",
        ),
        (
            server_error("OOM command not allowed when used memory > 'maxmemory'."),
            "unavailable",
        ),
        (
            server_error("BUSY Redis is busy running a script."),
            "unavailable",
        ),
        (
            server_error("NOAUTH Authentication required."),
            "unavailable",
        ),
        (
            server_error("ERR user_script:12: attempt to compare nil"),
            "protocol",
        ),
        (
            server_error("WRONGTYPE Operation against a key holding the wrong kind of value"),
            "protocol",
        ),
        (server_error("NOSCRIPT No matching script."), "protocol"),
    ];
    for (error, expected) in cases {
        let got = match store_error(&error, timeout) {
            StoreError::Timeout(t) => {
                assert_eq!(t, timeout);
                "timeout"
            }
            StoreError::Unavailable(_) => "unavailable",
            StoreError::Protocol(_) => "protocol",
        };
        assert_eq!(got, expected, "{error:?}");
    }
}

#[tokio::test]
async fn settings_that_can_never_work_fail_at_connect() {
    let settings = |url: &str| RedisSettings {
        url: url.into(),
        password: None,
        timeout: Duration::from_millis(50),
    };
    for url in [
        "not a url",
        "http://127.0.0.1:6379",
        "redis://127.0.0.1:6379/not-a-db",
    ] {
        let result = RedisStore::connect(settings(url)).await;
        assert!(
            matches!(result, Err(StoreError::Unavailable(_))),
            "{url}: {:?}",
            result.err()
        );
    }
    // Without TLS in the build, rediss:// is refused up front, saying why (a build with TLS
    // connects lazily like redis://).
    if let Err(e) = RedisStore::connect(settings("rediss://127.0.0.1:6379")).await {
        assert!(
            matches!(&e, StoreError::Unavailable(message) if message.contains("TLS")),
            "{e:?}"
        );
    }
    // A URL that parses connects lazily: no server is needed to get a store.
    let store = RedisStore::connect(settings("redis://127.0.0.1:1"))
        .await
        .expect("lazy connect");
    let error = store
        .usage("alice", &two_windows())
        .await
        .expect_err("nothing listens on port 1");
    assert!(
        matches!(error, StoreError::Unavailable(_) | StoreError::Timeout(_)),
        "{error:?}"
    );
}

#[test]
fn a_password_file_overrides_the_url_without_its_newline() {
    let settings = RedisSettings {
        url: "redis://user:fromurl@127.0.0.1:6379/2".into(),
        password: Some("s3cret\n".into()),
        timeout: Duration::from_millis(50),
    };
    let client = client(&settings).expect("valid settings");
    let redis = client.get_connection_info().redis_settings();
    assert_eq!(redis.password(), Some("s3cret"));
    assert_eq!(redis.username(), Some("user"));
    assert_eq!(redis.db(), 2);
}

#[test]
fn every_window_script_starts_with_the_shared_prelude() {
    let scripts = Scripts::new();
    let hashes: Vec<&str> = scripts.all().iter().map(|s| s.get_hash()).collect();
    let mut distinct = hashes.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), 7, "seven distinct scripts: {hashes:?}");
    for body in [RESERVE, SETTLE, RENEW, USAGE] {
        assert!(
            !body.contains("local function now_ms"),
            "helpers live in common.lua"
        );
    }
    assert!(COMMON.contains("local function now_ms"));
    // The fleet scripts keep no windows and are sent as they are.
    for (script, body) in [
        (&scripts.fleet_join, FLEET_JOIN),
        (&scripts.fleet_publish, FLEET_PUBLISH),
        (&scripts.fleet_leave, FLEET_LEAVE),
    ] {
        assert_eq!(script.get_hash(), Script::new(body).get_hash());
    }
}

#[test]
fn debug_output_hides_passwords() {
    let settings = RedisSettings {
        url: "redis://user:hunter2@redis.example:6379/1".into(),
        password: Some("from-a-file".into()),
        timeout: Duration::from_millis(50),
    };
    let shown = format!("{settings:?}");
    assert!(
        !shown.contains("hunter2") && !shown.contains("from-a-file"),
        "{shown}"
    );
    assert!(
        shown.contains("redis://user:***@redis.example:6379/1"),
        "{shown}"
    );

    for (url, expected) in [
        ("redis://127.0.0.1:6379", "redis://127.0.0.1:6379"),
        ("redis://:pw@host", "redis://:***@host"),
        ("redis://user@host/0", "redis://user@host/0"),
        ("redis://u:p@ss@host:1/2", "redis://u:***@host:1/2"),
        ("not a url", "not a url"),
    ] {
        assert_eq!(redacted_url(url), expected, "{url}");
    }
}

#[test]
fn the_batch_metrics_buckets_end_at_the_cap() {
    let cap = super::batch::MAX_BATCH as f64;
    let buckets = crate::observe::BATCH_BUCKETS;
    assert_eq!(buckets[buckets.len() - 2..], [cap - 1.0, cap]);
}
