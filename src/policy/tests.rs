//! Unit tests for `Policy::from_config`: the default is usable, every problem is reported with
//! its field path (all of them at once, one per line), and API keys are found by their plaintext
//! although only their hashes are configured.

use std::collections::BTreeMap;

use sha2::{Digest, Sha256};

use super::*;
use crate::budget::{Quantity, WindowLimit};
use crate::config::{ApiKeyConfig, ModelLimitConfig, TierConfig, TierOverride};
use crate::tokens::EncodingRule;

fn sha256_hex(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

fn api_key(key: &str, tenant: &str, tier: Option<&str>) -> ApiKeyConfig {
    ApiKeyConfig {
        sha256: sha256_hex(key),
        tenant: tenant.to_owned(),
        tier: tier.map(str::to_owned),
    }
}

fn free(config: &mut Config) -> &mut TierConfig {
    config
        .tiers
        .get_mut("free")
        .expect("the built-in free tier")
}

/// The default config changed by `edit` is refused, with exactly one line per entry of
/// `expected`, each line starting with that entry (the field path, and usually the value).
#[track_caller]
fn check_problems(edit: impl FnOnce(&mut Config), expected: &[&str]) {
    let mut config = Config::default();
    edit(&mut config);
    let message = match Policy::from_config(&config) {
        Ok(_) => panic!("expected {expected:?}, but the config was accepted"),
        Err(ConfigError(message)) => message,
    };
    let lines: Vec<&str> = message.lines().collect();
    for want in expected {
        let matching = lines.iter().filter(|l| l.starts_with(want)).count();
        assert_eq!(
            matching, 1,
            "expected one problem starting with {want:?} in:\n{message}"
        );
    }
    assert_eq!(
        lines.len(),
        expected.len(),
        "expected only {expected:?}, got:\n{message}"
    );
}

/// The default config changed by `edit` is accepted.
#[track_caller]
fn check_valid(edit: impl FnOnce(&mut Config)) -> Policy {
    let mut config = Config::default();
    edit(&mut config);
    match Policy::from_config(&config) {
        Ok(policy) => policy,
        Err(e) => panic!("expected a valid config, got:\n{e}"),
    }
}

#[test]
fn default_config_is_valid() {
    let policy = check_valid(|_| {});
    let names: Vec<&str> = policy.tiers.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["free", "premium", "standard"]);
    assert_eq!(policy.tiers[policy.default_tier].name, "free");
    assert_eq!(policy.tier_named("premium"), Some(1));
    assert_eq!(policy.tier_named("gold"), None);
    assert!(!policy.identity.has_api_keys());
    assert_eq!(policy.identity.user_header, "x-user-id");
    assert_eq!(policy.identity.tier_header, "x-user-tier");
    assert_eq!(
        policy.inference_paths,
        ["/v1/chat/completions", "/v1/completions"]
    );
    assert_eq!(policy.counting.max_body_bytes, 8 * 1024 * 1024);
    assert!(policy.inject_stream_usage);
}

#[test]
fn default_output_tokens_defaults_to_the_output_ceiling() {
    let policy = check_valid(|c| {
        free(c).max_output_tokens = 300;
        c.tiers.get_mut("premium").unwrap().default_output_tokens = Some(100);
    });
    let tier = |name| &policy.tiers[policy.tier_named(name).unwrap()];
    assert_eq!(tier("free").default_output_tokens, 300);
    assert_eq!(tier("premium").default_output_tokens, 100);
    assert_eq!(tier("premium").max_output_tokens, 4_096);
}

#[test]
fn header_names_are_lowercased() {
    let policy = check_valid(|c| {
        c.identity.user_header = "X-User-Id".to_owned();
        c.identity.tier_header = "X-Plan".to_owned();
    });
    assert_eq!(policy.identity.user_header, "x-user-id");
    assert_eq!(policy.identity.tier_header, "x-plan");
}

#[test]
fn token_ceilings_must_be_positive_and_sane() {
    check_problems(
        |c| free(c).max_input_tokens = 0,
        &["tiers.free.max_input_tokens: 0 is out of range"],
    );
    // Without token budgets, which huge ceilings would also contradict (see below).
    check_problems(
        |c| {
            free(c).tokens_per_hour = None;
            free(c).max_input_tokens = 10_000_001;
        },
        &["tiers.free.max_input_tokens: 10000001 is out of range"],
    );
    check_problems(
        |c| {
            free(c).tokens_per_hour = None;
            free(c).max_output_tokens = 10_000_001;
        },
        &["tiers.free.max_output_tokens: 10000001 is out of range"],
    );
    // A zero output ceiling also makes the implied default output zero.
    check_problems(
        |c| free(c).max_output_tokens = 0,
        &[
            "tiers.free.max_output_tokens: 0 is out of range",
            "tiers.free.default_output_tokens: 0 must be between 1 and",
        ],
    );
    check_valid(|c| {
        free(c).tokens_per_hour = None;
        free(c).max_input_tokens = 10_000_000;
        free(c).max_output_tokens = 10_000_000;
    });
    check_valid(|c| {
        free(c).max_input_tokens = 1;
        free(c).max_output_tokens = 1;
    });
}

#[test]
fn default_output_tokens_must_fit_under_the_ceiling() {
    check_problems(
        |c| free(c).default_output_tokens = Some(4_097),
        &[
            "tiers.free.default_output_tokens: 4097 must be between 1 and tiers.free.max_output_tokens (4096)",
        ],
    );
    check_problems(
        |c| free(c).default_output_tokens = Some(0),
        &["tiers.free.default_output_tokens: 0 must be between 1"],
    );
    check_valid(|c| free(c).default_output_tokens = Some(4_096));
}

#[test]
fn default_tier_must_be_one_of_the_tiers() {
    check_problems(
        |c| c.default_tier = "gold".to_owned(),
        &[r#"default_tier: "gold" is not one of the tiers (free, premium, standard)"#],
    );
    check_problems(
        |c| c.tiers.clear(),
        &[
            "tiers: at least one tier is required",
            r#"default_tier: "free" is not one of the tiers"#,
        ],
    );
}

#[test]
fn tier_names_are_short_lowercase_words() {
    let with_tier = |name: &str| {
        let name = name.to_owned();
        move |c: &mut Config| {
            c.tiers.insert(name, TierConfig::default());
        }
    };
    check_problems(with_tier("Gold"), &["tiers.Gold: tier names are"]);
    check_problems(with_tier("gold tier"), &["tiers.gold tier: tier names are"]);
    check_problems(with_tier(""), &["tiers.: tier names are"]);
    check_problems(
        with_tier(&"g".repeat(65)),
        &[&format!("tiers.{}:", "g".repeat(65))],
    );
    check_problems(with_tier("géld"), &["tiers.géld: tier names are"]);
    check_valid(with_tier(&"g".repeat(64)));
    check_valid(with_tier("gold-2_b"));
}

#[test]
fn api_key_hashes_are_64_lowercase_hex_digits() {
    let with_hash = |sha256: String| {
        move |c: &mut Config| {
            c.identity.api_keys = vec![ApiKeyConfig {
                sha256,
                tenant: "alice".to_owned(),
                tier: None,
            }];
        }
    };
    let good = sha256_hex("sk-alice");
    check_problems(
        with_hash(good.to_uppercase()),
        &[&format!(
            "identity.api_keys[0].sha256: {:?} is not 64 lowercase hex digits",
            good.to_uppercase()
        )],
    );
    check_problems(
        with_hash(good[..63].to_owned()),
        &["identity.api_keys[0].sha256: "],
    );
    check_problems(
        with_hash(format!("{good}0")),
        &["identity.api_keys[0].sha256: "],
    );
    check_problems(
        with_hash(format!("{}g", &good[..63])),
        &["identity.api_keys[0].sha256: "],
    );
    check_problems(
        with_hash("sk-alice".to_owned()),
        &["identity.api_keys[0].sha256: \"sk-alice\" is not 64 lowercase hex digits"],
    );
    check_valid(with_hash(good));
}

#[test]
fn api_key_must_name_a_known_tier_and_a_tenant() {
    check_problems(
        |c| c.identity.api_keys = vec![api_key("sk-a", "alice", Some("gold"))],
        &[r#"identity.api_keys[0].tier: "gold" is not one of the tiers"#],
    );
    check_problems(
        |c| c.identity.api_keys = vec![api_key("sk-a", "", None)],
        &["identity.api_keys[0].tenant: must not be empty"],
    );
}

#[test]
fn duplicate_api_key_hashes_are_refused() {
    check_problems(
        |c| {
            c.identity.api_keys = vec![
                api_key("sk-a", "alice", None),
                api_key("sk-b", "bob", None),
                api_key("sk-a", "mallory", Some("premium")),
            ]
        },
        &["identity.api_keys[2].sha256: the same key hash appears twice"],
    );
}

#[test]
fn some_way_to_identify_a_request_is_required() {
    check_problems(
        |c| c.identity.user_header = String::new(),
        &["identity: user_header is empty and there are no api_keys"],
    );
    check_valid(|c| {
        c.identity.user_header = String::new();
        c.identity.api_keys = vec![api_key("sk-a", "alice", None)];
    });
}

#[test]
fn header_names_must_be_tokens() {
    check_problems(
        |c| c.identity.user_header = "x user".to_owned(),
        &[r#"identity.user_header: "x user" is not a valid header name"#],
    );
    check_problems(
        |c| c.identity.tier_header = "x-tier:".to_owned(),
        &[r#"identity.tier_header: "x-tier:" is not a valid header name"#],
    );
}

#[test]
fn inference_paths_are_absolute_and_carry_no_query() {
    check_problems(
        |c| c.routes.inference_paths = vec!["/v1/chat/completions".into(), "v1/completions".into()],
        &[r#"routes.inference_paths[1]: "v1/completions" must start with '/'"#],
    );
    check_problems(
        |c| c.routes.inference_paths = vec!["/v1/completions?x=1".into()],
        &["routes.inference_paths[0]: "],
    );
    check_problems(
        |c| c.routes.inference_paths = vec![String::new()],
        &["routes.inference_paths[0]: "],
    );
    check_problems(
        |c| c.routes.inference_paths.clear(),
        &["routes.inference_paths: at least one path is required"],
    );
}

#[test]
fn listen_addresses_are_ip_and_port() {
    check_problems(
        |c| c.listen.grpc_addr = "0.0.0.0".to_owned(),
        &[r#"listen.grpc_addr: "0.0.0.0" is not an IP:port address"#],
    );
    check_problems(
        |c| c.listen.admin_addr = "localhost:9464".to_owned(),
        &[r#"listen.admin_addr: "localhost:9464" is not an IP:port address"#],
    );
    check_valid(|c| c.listen.grpc_addr = "[::1]:0".to_owned());
}

#[test]
fn sizes_and_encoding_patterns_must_be_usable() {
    check_problems(
        |c| c.tokens.max_body_bytes = 0,
        &["tokens.max_body_bytes: must be positive"],
    );
    check_problems(
        |c| c.response.max_buffered_json_bytes = 0,
        &["response.max_buffered_json_bytes: must be positive"],
    );
    check_problems(
        |c| c.tokens.large_body_max_wait_ms = 0,
        &["tokens.large_body_max_wait_ms: 0 must be between 1 and \
             scheduler.envoy_max_message_timeout_ms (30000)"],
    );
    check_problems(
        |c| c.tokens.large_body_max_wait_ms = 30_001,
        &[
            "tokens.large_body_max_wait_ms: 30001 must be between 1 and \
             scheduler.envoy_max_message_timeout_ms (30000)",
        ],
    );
    check_valid(|c| c.tokens.large_body_max_wait_ms = 30_000);
    check_problems(
        |c| c.tokens.large_body_threads = 513,
        &[
            "tokens.large_body_threads: 513 is over 512, the most threads the runtime runs for \
             blocking work",
        ],
    );
    check_valid(|c| c.tokens.large_body_threads = 512);
    check_problems(
        |c| c.response.summary_wait_ms = 0,
        &["response.summary_wait_ms: must be between 1 and 60000"],
    );
    check_problems(
        |c| c.response.summary_wait_ms = 60_001,
        &["response.summary_wait_ms: must be between 1 and 60000"],
    );
    check_problems(
        |c| c.tokens.encodings = vec![EncodingRule::builtin("", Encoding::O200kBase)],
        &["tokens.encodings[0].pattern: must not be empty"],
    );
    // A rule names one of OpenAI's encodings or a model's tokenizer file: exactly one.
    fn with(
        encoding: Option<Encoding>,
        tokenizer: Option<&'static str>,
        template: Option<&'static str>,
    ) -> impl FnOnce(&mut Config) {
        move |c: &mut Config| {
            c.tokens.encodings = vec![EncodingRule {
                pattern: "m*".to_owned(),
                encoding,
                tokenizer_file: tokenizer.map(Into::into),
                chat_template_file: template.map(Into::into),
            }]
        }
    }
    check_problems(
        with(None, None, None),
        &["tokens.encodings[0]: name an encoding or a tokenizer_file"],
    );
    check_problems(
        with(Some(Encoding::O200kBase), Some("/t.json"), None),
        &["tokens.encodings[0]: name either encoding or tokenizer_file, not both"],
    );
    check_problems(
        with(Some(Encoding::O200kBase), None, Some("/c.json")),
        &["tokens.encodings[0].chat_template_file: only with tokenizer_file"],
    );
}

#[test]
fn tier_scheduling_fields_must_be_usable() {
    check_problems(
        |c| free(c).weight = 0,
        &["tiers.free.weight: 0 is out of range"],
    );
    check_problems(
        |c| free(c).weight = 10_001,
        &["tiers.free.weight: 10001 is out of range"],
    );
    check_valid(|c| free(c).weight = 10_000);
    check_problems(
        |c| free(c).queue_deadline_ms = 0,
        &["tiers.free.queue_deadline_ms: 0 must be positive"],
    );
    // The deadline plus Envoy's margin must fit under Envoy's max_message_timeout.
    check_valid(|c| {
        c.scheduler.envoy_max_message_timeout_ms = 3_000;
        for tier in c.tiers.values_mut() {
            tier.queue_deadline_ms = 2_500;
        }
    });
    check_problems(
        |c| {
            c.scheduler.envoy_max_message_timeout_ms = 3_000;
            for tier in c.tiers.values_mut() {
                tier.queue_deadline_ms = 2_000;
            }
            free(c).queue_deadline_ms = 2_501;
        },
        &[
            "tiers.free.queue_deadline_ms: 2501 must be positive and, plus 500 ms of margin, within scheduler.envoy_max_message_timeout_ms (3000)",
        ],
    );
}

#[test]
fn absurd_queue_deadline_is_a_problem_not_a_panic() {
    // `queue_deadline_ms + margin` must not overflow (a panic in debug builds, a wrap-around to
    // 499 accepting an endless deadline in release builds): the check uses a saturating add.
    check_problems(
        |c| free(c).queue_deadline_ms = u64::MAX,
        &["tiers.free.queue_deadline_ms: 18446744073709551615 must be positive"],
    );
}

#[test]
fn scheduler_budget_and_reservations_must_be_usable() {
    check_problems(
        |c| c.scheduler.initial_limit = 0,
        &["scheduler.initial_limit: must be at least 1"],
    );
    let reserve = |shares: &[(&str, u32)]| {
        let shares: BTreeMap<String, u32> =
            shares.iter().map(|(t, p)| (t.to_string(), *p)).collect();
        move |c: &mut Config| c.scheduler.reservations = shares
    };
    check_valid(reserve(&[("alice", 60), ("bob", 40)]));
    check_problems(
        reserve(&[("alice", 60), ("bob", 41)]),
        &["scheduler.reservations: the shares add up to 101%, over 100%"],
    );
    check_problems(
        reserve(&[("alice", 0)]),
        &["scheduler.reservations.alice: 0 is not a percentage in 1..=100"],
    );
    check_problems(
        reserve(&[("alice", 101)]),
        &[
            "scheduler.reservations.alice: 101 is not a percentage",
            "scheduler.reservations: the shares add up to 101%",
        ],
    );
}

#[test]
fn the_queued_body_cap_must_hold_at_least_the_largest_body() {
    let cap = |cap: usize, max_body: usize| {
        move |c: &mut Config| {
            c.scheduler.max_queued_body_bytes = cap;
            c.tokens.max_body_bytes = max_body;
        }
    };
    for (queued_cap, max_body) in [(8 << 20, 8 << 20), (1 << 30, 8 << 20), (1024, 1024)] {
        let policy = check_valid(cap(queued_cap, max_body));
        assert_eq!(policy.scheduling.max_queued_body_bytes, queued_cap);
    }
    check_problems(
        cap((8 << 20) - 1, 8 << 20),
        &["scheduler.max_queued_body_bytes: 8388607 is less than tokens.max_body_bytes (8388608)"],
    );
    check_problems(
        cap(0, 1),
        &["scheduler.max_queued_body_bytes: 0 is less than tokens.max_body_bytes (1)"],
    );
    assert_eq!(
        check_valid(|_| {}).scheduling.max_queued_body_bytes,
        256 << 20,
        "the default"
    );
}

#[test]
fn engine_metrics_settings_must_be_usable() {
    let scraping = |edit: fn(&mut crate::config::EngineMetricsConfig)| {
        move |c: &mut Config| {
            c.control.engine.metrics_urls = vec!["http://10.0.0.7:8000/metrics".to_owned()];
            edit(&mut c.control.engine);
        }
    };
    check_valid(scraping(|_| {}));
    check_problems(
        scraping(|e| e.metrics_urls.push("https://vllm/metrics".to_owned())),
        &[
            r#"control.engine.metrics_urls[1]: "https://vllm/metrics" must be http://HOST[:PORT]/PATH"#,
        ],
    );
    check_problems(
        scraping(|e| e.kv_cache_threshold = 1.5),
        &["control.engine.kv_cache_threshold: 1.5 must be in (0, 1]"],
    );
    check_problems(
        scraping(|e| e.queue_depth_threshold = 0),
        &["control.engine.queue_depth_threshold: 0 must be at least 1"],
    );
    check_problems(
        scraping(|e| e.scrape_timeout_ms = 1_000),
        &[
            "control.engine.scrape_timeout_ms: 1000 must be positive and under control.tick_ms (1000)",
        ],
    );
    check_problems(
        scraping(|e| {
            e.kv_cache_usage_metrics.clear();
            e.waiting_metrics.clear();
        }),
        &[
            "control.engine.kv_cache_usage_metrics: [] and control.engine.waiting_metrics cannot both be empty",
        ],
    );
    // Not scraping: the scrape's settings do not constrain a fast tick.
    check_valid(|c| c.control.tick_ms = 50);
}

#[test]
fn control_loop_settings_must_be_usable() {
    check_valid(|c| c.control.decrease_step = Some(4));
    check_problems(
        |c| c.control.tick_ms = 0,
        &["control.tick_ms: 0 must be positive"],
    );
    check_problems(
        |c| c.control.upstream_target_p99_ttft_ms = 0,
        &["control.upstream_target_p99_ttft_ms: 0 must be positive"],
    );
    check_problems(
        |c| c.control.min_samples = 0,
        &["control.min_samples: 0 must be at least 1"],
    );
    check_problems(
        |c| {
            c.control.signal = ControlSignal::Gateway;
            c.control.cooldown_ticks = 0;
        },
        &["control.cooldown_ticks: 0 must be at least 1 with signal: gateway"],
    );
    check_valid(|c| {
        c.control.signal = ControlSignal::Gateway;
        c.control.cooldown_ticks = 3;
        // Only the signal's own target is checked against the SLO.
        c.control.upstream_target_p99_ttft_ms = 5_000;
    });
    check_problems(
        |c| c.control.upstream_target_p99_ttft_ms = 2_001,
        &[
            "control.upstream_target_p99_ttft_ms: 2001 must be at most control.target_p99_ttft_ms (2000)",
        ],
    );
    check_problems(
        |c| c.control.window_ms = c.control.tick_ms - 1,
        &["control.window_ms: 999 must be at least control.tick_ms"],
    );
    check_problems(
        |c| c.control.band = 1.0,
        &["control.band: 1 must be in [0, 1)"],
    );
    check_problems(|c| c.control.band = f64::NAN, &["control.band: NaN"]);
    check_problems(
        |c| c.control.decrease_factor = 1.0,
        &["control.decrease_factor: 1 must be in (0, 1)"],
    );
    check_problems(
        |c| c.control.decrease_step = Some(0),
        &["control.decrease_step: 0 must be positive when set"],
    );
    check_problems(
        |c| c.control.floor = 0,
        &["control.floor: 0 must be at least 1"],
    );
    check_problems(
        |c| c.control.ceiling = c.control.floor - 1,
        &["control.ceiling: 31 must be at least control.floor"],
    );
    check_problems(
        |c| c.control.demand_fraction = 0.0,
        &["control.demand_fraction: 0 must be in (0, 1]"],
    );
    check_valid(|c| c.control.demand_fraction = 1.0);
    // The checks the controller's typed settings once had of their own, here once.
    check_problems(
        |c| c.control.target_p99_ttft_ms = 0,
        &[
            "control.target_p99_ttft_ms: 0 must be positive",
            "control.upstream_target_p99_ttft_ms: 1000 must be at most control.target_p99_ttft_ms (0)",
        ],
    );
    check_problems(
        |c| c.control.band = -0.1,
        &["control.band: -0.1 must be in [0, 1)"],
    );
    check_problems(
        |c| c.control.increase_step = 0,
        &["control.increase_step: 0 must be positive"],
    );
    check_problems(
        |c| c.control.decrease_factor = 0.0,
        &["control.decrease_factor: 0 must be in (0, 1)"],
    );
    check_problems(
        |c| c.control.demand_fraction = 1.5,
        &["control.demand_fraction: 1.5 must be in (0, 1]"],
    );
}

#[test]
fn absurd_lease_renewal_is_a_problem_not_a_panic() {
    // A check written as `lease_renew_ms * 2 <= lease_ttl_ms` would overflow here (a panic in
    // debug builds, a wrap-around accepting a renewal period longer than the lease in release
    // builds); the check compares with `lease_ttl_ms / 2` instead.
    check_problems(
        |c| c.store.lease_renew_ms = u64::MAX,
        &["store.lease_renew_ms: 18446744073709551615 must be positive and at most half"],
    );
}

fn window(
    name: &str,
    quantity: Quantity,
    window_ms: u64,
    bucket_ms: u64,
    limit: u64,
) -> WindowLimit {
    WindowLimit {
        name: name.to_owned(),
        quantity,
        window_ms,
        bucket_ms,
        limit,
    }
}

#[test]
fn budgets_become_rolling_windows() {
    let policy = check_valid(|c| {
        let free = free(c);
        free.tokens_per_minute = Some(30_000);
        free.tokens_per_day = Some(1_000_000);
        free.requests_per_minute = Some(1);
        free.model_limits = vec![ModelLimitConfig {
            pattern: "gpt-4o*".to_owned(),
            tokens_per_minute: None,
            tokens_per_hour: Some(50_000),
            tokens_per_day: None,
            requests_per_minute: Some(5),
        }];
    });
    let free = &policy.tiers[policy.tier_named("free").unwrap()];
    use Quantity::*;
    assert_eq!(
        *free.windows,
        [
            window("tokens_minute", Tokens, 60_000, 5_000, 30_000),
            window("tokens_hour", Tokens, 3_600_000, 60_000, 100_000),
            window("tokens_day", Tokens, 86_400_000, 900_000, 1_000_000),
            window("requests_minute", Requests, 60_000, 5_000, 1),
        ]
    );
    assert_eq!(
        free.model_windows,
        [(
            "gpt-4o*".to_owned(),
            vec![
                window("model0_tokens_hour", Tokens, 3_600_000, 60_000, 50_000),
                window("model0_requests_minute", Requests, 60_000, 5_000, 5),
            ]
        )]
    );
    // A request counts against the tier's windows, then those of the model limits it matches;
    // one that matches none shares the tier's windows rather than copying them.
    let other = free.windows_for("llama-3-8b");
    assert!(Arc::ptr_eq(&other, &free.windows));
    let matched = free.windows_for("gpt-4o-mini");
    let names: Vec<&str> = matched.iter().map(|w| w.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "tokens_minute",
            "tokens_hour",
            "tokens_day",
            "requests_minute",
            "model0_tokens_hour",
            "model0_requests_minute"
        ]
    );
}

#[test]
fn default_tiers_have_hourly_token_budgets_and_a_concurrency_cap() {
    let policy = check_valid(|_| {});
    for (name, tokens_per_hour) in [
        ("free", 100_000),
        ("standard", 200_000),
        ("premium", 500_000),
    ] {
        let tier = &policy.tiers[policy.tier_named(name).unwrap()];
        let hourly = window(
            "tokens_hour",
            Quantity::Tokens,
            3_600_000,
            60_000,
            tokens_per_hour,
        );
        assert_eq!(*tier.windows, [hourly], "{name}");
        assert_eq!(tier.max_concurrent, Some(3), "{name}");
    }
}

#[test]
fn token_budgets_must_admit_the_largest_request() {
    // The default free tier admits 16000 input + 4096 output tokens.
    check_valid(|c| free(c).tokens_per_hour = Some(20_096));
    check_problems(
        |c| free(c).tokens_per_hour = Some(20_095),
        &[
            "tiers.free.tokens_per_hour: 20095 is below the largest request the tier admits (max_input_tokens + max_output_tokens = 20096)",
        ],
    );
    check_problems(
        |c| free(c).tokens_per_minute = Some(0),
        &["tiers.free.tokens_per_minute: 0 would refuse every request"],
    );
    check_problems(
        |c| free(c).requests_per_minute = Some(0),
        &["tiers.free.requests_per_minute: 0 would refuse every request"],
    );
    // Requests are counted, not tokens: one a minute is a policy, not a contradiction.
    check_valid(|c| free(c).requests_per_minute = Some(1));
    check_problems(
        |c| free(c).max_concurrent = Some(0),
        &["tiers.free.max_concurrent: 0 would refuse every request"],
    );
    check_problems(
        |c| {
            free(c).model_limits = vec![ModelLimitConfig {
                pattern: String::new(),
                tokens_per_minute: Some(10),
                tokens_per_hour: None,
                tokens_per_day: None,
                requests_per_minute: None,
            }]
        },
        &[
            "tiers.free.model_limits[0].pattern: must not be empty",
            "tiers.free.model_limits[0].tokens_per_minute: 10 is below the largest request",
        ],
    );
}

#[test]
fn tenant_overrides_apply_over_every_tier() {
    let policy = check_valid(|c| {
        c.tenants.insert(
            "alice".to_owned(),
            TierOverride {
                max_input_tokens: Some(100),
                tokens_per_hour: Some(1_000_000),
                ..TierOverride::default()
            },
        );
    });
    for name in ["free", "premium"] {
        let id = policy.tier_named(name).unwrap();
        let alice = policy.tier_for("alice", id);
        assert_eq!(alice.name, name);
        assert_eq!(alice.max_input_tokens, 100, "{name}");
        assert_eq!(alice.max_output_tokens, 4_096, "{name}");
        assert_eq!(alice.windows[0].limit, 1_000_000, "{name}");
        assert_eq!(policy.tier_for("bob", id), &policy.tiers[id], "{name}");
        assert_eq!(policy.tier_for("Alice", id), &policy.tiers[id], "{name}");
    }
}

#[test]
fn tenant_override_problems_name_the_tenant_and_the_tier() {
    check_problems(
        |c| {
            c.tenants.insert(
                "alice".to_owned(),
                TierOverride {
                    weight: Some(0),
                    ..TierOverride::default()
                },
            );
        },
        &[
            "tenants.alice (over tier free).weight: 0 is out of range",
            "tenants.alice (over tier premium).weight: 0 is out of range",
            "tenants.alice (over tier standard).weight: 0 is out of range",
        ],
    );
}

#[test]
fn store_settings_must_be_usable() {
    check_valid(|c| c.store.redis_url = Some("rediss://:secret@redis:6380/1".to_owned()));
    check_problems(
        |c| c.store.redis_url = Some("http://redis:6379".to_owned()),
        &[r#"store.redis_url: "http://redis:6379" must start with redis:// or rediss://"#],
    );
    check_problems(
        |c| c.store.timeout_ms = 0,
        &["store.timeout_ms: must be positive"],
    );
    check_valid(|c| {
        c.store.lease_ttl_ms = 10_000;
        c.store.lease_renew_ms = 5_000;
    });
    check_problems(
        |c| {
            c.store.lease_ttl_ms = 10_000;
            c.store.lease_renew_ms = 5_001;
        },
        &[
            "store.lease_renew_ms: 5001 must be positive and at most half of store.lease_ttl_ms (10000)",
        ],
    );
    check_problems(
        |c| c.store.lease_renew_ms = 0,
        &["store.lease_renew_ms: 0 must be positive"],
    );
    check_problems(
        |c| c.store.breaker_failures = 0,
        &["store.breaker_failures: must be at least 1"],
    );
}

#[test]
fn every_problem_is_reported_at_once() {
    check_problems(
        |c| {
            free(c).max_input_tokens = 0;
            c.default_tier = "gold".to_owned();
            c.identity.user_header = String::new();
            c.routes.inference_paths = vec!["chat".into()];
            c.listen.admin_addr = "nowhere".to_owned();
        },
        &[
            "tiers.free.max_input_tokens: 0",
            "default_tier: \"gold\"",
            "identity: user_header is empty",
            "routes.inference_paths[0]: \"chat\"",
            "listen.admin_addr: \"nowhere\"",
        ],
    );
}

#[test]
fn owner_of_key_finds_a_configured_key_by_its_plaintext() {
    let policy = check_valid(|c| {
        c.identity.api_keys = vec![
            api_key("sk-alice", "alice", None),
            api_key("sk-bob", "bob", Some("premium")),
        ];
    });
    let premium = policy.tier_named("premium").unwrap();
    let owner = |key: &str| policy.identity.owner_of_key(key.as_bytes()).cloned();
    let owned = |tenant: &str, tier| {
        Some(ApiKeyOwner {
            tenant: tenant.to_owned(),
            tier,
        })
    };
    assert!(policy.identity.has_api_keys());
    assert_eq!(owner("sk-alice"), owned("alice", policy.default_tier));
    assert_eq!(owner("sk-bob"), owned("bob", premium));
    assert_eq!(owner("sk-carol"), None);
    assert_eq!(owner("sk-alice "), None);
    assert_eq!(owner(""), None);
    // The configured hash is not itself a key.
    assert_eq!(owner(&sha256_hex("sk-alice")), None);
}

#[test]
fn encoding_rules_from_the_config_come_before_the_built_in_table() {
    let policy = check_valid(|c| {
        c.tokens.encodings = vec![EncodingRule::builtin("llama*", Encoding::O200kBase)];
    });
    assert_eq!(policy.encoding_for("llama-3-70b"), Encoding::O200kBase);
    assert_eq!(policy.encoding_for("gpt-4o-mini"), Encoding::O200kBase);
    assert_eq!(policy.encoding_for("gpt-4"), Encoding::Cl100kBase);
    assert_eq!(policy.encoding_for("mistral"), Encoding::Cl100kBase);
}

#[test]
fn settings_that_do_nothing_are_warned_of_not_refused() {
    fn engines(c: &mut Config) {
        c.control.engine.metrics_urls = vec!["http://10.0.0.7:8000/metrics".to_owned()];
    }
    type Case = (&'static str, fn(&mut Config), &'static [&'static str]);
    let cases: [Case; 6] = [
        ("defaults", |_| {}, &[]),
        (
            "fleet settings without Redis",
            |c| c.fleet.sync_ms = 100,
            &["fleet.* is set but store.redis_url is not"],
        ),
        (
            "fleet settings with Redis",
            |c| {
                c.fleet.sync_ms = 100;
                c.store.redis_url = Some("redis://127.0.0.1:6379".to_owned());
            },
            &[],
        ),
        ("engines read by the controller", engines, &[]),
        (
            "controller off, no engines",
            |c| c.control.enabled = false,
            &[],
        ),
        (
            "controller off, engines set",
            |c| {
                engines(c);
                c.control.enabled = false;
            },
            &["control.engine.metrics_urls", "control.enabled is false"],
        ),
    ];
    for (name, edit, expected) in cases {
        let warnings = check_valid(edit).warnings();
        if expected.is_empty() {
            assert!(warnings.is_empty(), "{name}: {warnings:?}");
        } else {
            assert_eq!(warnings.len(), 1, "{name}: {warnings:?}");
            for part in expected {
                assert!(
                    warnings[0].contains(part),
                    "{name}: {part:?} in {warnings:?}"
                );
            }
        }
    }
}

#[test]
fn fleet_settings_are_checked() {
    type Case = (fn(&mut Config), &'static [&'static str]);
    let cases: [Case; 5] = [
        (|c| c.fleet.name = "a{b}".to_owned(), &["fleet.name:"]),
        (|c| c.fleet.name = String::new(), &["fleet.name:"]),
        (|c| c.fleet.member_ttl_ms = 1_500, &["fleet.member_ttl_ms:"]),
        (
            |c| {
                c.fleet.sync_ms = 0;
                c.fleet.fallback_replicas = 0;
            },
            &["fleet.sync_ms:", "fleet.fallback_replicas:"],
        ),
        (|c| c.fleet.leader_ttl_ms = 500, &["fleet.leader_ttl_ms:"]),
    ];
    for (edit, expected) in cases {
        check_problems(edit, expected);
    }
}

#[test]
fn the_policy_hash_covers_what_replicas_must_share_and_nothing_of_their_own() {
    let base = check_valid(|_| {}).hash;
    let same: [fn(&mut Config); 4] = [
        |c| c.listen.grpc_addr = "0.0.0.0:9".to_owned(),
        |c| c.store.redis_url = Some("redis://elsewhere:6379".to_owned()),
        |c| c.fleet.member_id = "pod-7".to_owned(),
        |c| c.shutdown.drain_deadline_ms = 1,
    ];
    for edit in same {
        assert_eq!(check_valid(edit).hash, base, "a replica's own setting");
    }
    let different: [fn(&mut Config); 5] = [
        |c| c.tiers.get_mut("free").unwrap().weight = 7,
        |c| c.scheduler.initial_limit = 64,
        |c| c.control.floor = 8,
        |c| c.fleet.sync_ms = 100,
        |c| {
            c.tenants.insert("team-a".to_owned(), Default::default());
        },
    ];
    for edit in different {
        assert_ne!(check_valid(edit).hash, base, "a shared setting");
    }
    assert_eq!(base.len(), 32, "16 bytes in hex");
}

#[test]
fn headroom_settings_are_checked_and_off_means_none() {
    // (window_ms, margin_sigmas) -> the problems, none for a valid pair.
    let table: [(u64, f64, &[&str]); 6] = [
        (10_000, 3.0, &[]),
        (1, 0.0, &[]),
        (60_000, 10.0, &[]),
        (
            0,
            3.0,
            &["scheduler.headroom.window_ms: must be at least 1"],
        ),
        (
            10_000,
            10.5,
            &["scheduler.headroom.margin_sigmas: 10.5 is not in 0..=10"],
        ),
        (
            10_000,
            f64::NAN,
            &["scheduler.headroom.margin_sigmas: NaN is not in 0..=10"],
        ),
    ];
    for (window_ms, sigmas, problems) in table {
        let edit = |c: &mut Config| {
            c.scheduler.headroom.enabled = true;
            c.scheduler.headroom.window_ms = window_ms;
            c.scheduler.headroom.margin_sigmas = sigmas;
        };
        if problems.is_empty() {
            let headroom = check_valid(edit).scheduling.headroom.expect("enabled");
            assert_eq!(
                (headroom.window, headroom.sigmas),
                (Duration::from_millis(window_ms), sigmas)
            );
        } else {
            check_problems(edit, problems);
        }
    }
    assert_eq!(
        check_valid(|_| {}).scheduling.headroom,
        Some(Headroom {
            window: Duration::from_secs(10),
            sigmas: 3.0,
            pace: true,
        }),
        "on by default"
    );
    assert_eq!(
        check_valid(|c| c.scheduler.headroom.enabled = false)
            .scheduling
            .headroom,
        None,
        "off means none"
    );
}
