//! Unit tests for `config::load` and the worker threads' variable: the layers (defaults < YAML
//! file < `TOLLGATE__*` variables), list and map parsing from the environment, and errors that
//! name the key and value at fault.
//!
//! The only I/O is the file `load` reads itself, written to a temporary directory.

use std::io::Write;

use super::*;

/// Loads `yaml` (written to a temporary file; `None` means no `--config`) and `env`.
fn load_with(yaml: Option<&str>, env: &[(&str, &str)]) -> Result<Config, ConfigError> {
    let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string()));
    match yaml {
        None => load(None, env),
        Some(yaml) => {
            let mut file = tempfile::Builder::new()
                .suffix(".yaml")
                .tempfile()
                .expect("a temporary file");
            file.write_all(yaml.as_bytes()).expect("write the config");
            load(Some(file.path()), env)
        }
    }
}

/// `yaml` and `env` load to the built-in defaults changed by `expected`.
#[track_caller]
fn check(yaml: Option<&str>, env: &[(&str, &str)], expected: impl FnOnce(&mut Config)) {
    let mut want = Config::default();
    expected(&mut want);
    match load_with(yaml, env) {
        Ok(got) => assert_eq!(got, want),
        Err(e) => panic!("expected a config, got the error: {e}"),
    }
}

/// `yaml` and `env` are refused with a message that contains every one of `fragments`.
#[track_caller]
fn check_error(yaml: Option<&str>, env: &[(&str, &str)], fragments: &[&str]) {
    let message = match load_with(yaml, env) {
        Ok(config) => panic!("expected an error, got {config:?}"),
        Err(ConfigError(message)) => message,
    };
    for fragment in fragments {
        assert!(
            message.contains(fragment),
            "the error should name {fragment:?}: {message}"
        );
    }
}

fn tier(max_input_tokens: u32, max_output_tokens: u32) -> TierConfig {
    TierConfig {
        max_input_tokens,
        max_output_tokens,
        ..TierConfig::default()
    }
}

#[test]
fn no_file_and_no_env_is_the_built_in_default() {
    check(None, &[], |_| {});
}

#[test]
fn default_has_the_three_built_in_tiers_and_defaults_to_free() {
    let config = Config::default();
    assert_eq!(
        config.tiers.keys().collect::<Vec<_>>(),
        ["free", "premium", "standard"]
    );
    assert_eq!(config.default_tier, "free");
}

#[test]
fn empty_or_blank_file_is_the_built_in_default() {
    check(Some(""), &[], |_| {});
    check(Some("{}\n"), &[], |_| {});
    check(Some("# nothing set\n"), &[], |_| {});
}

#[test]
fn file_overrides_one_field_and_keeps_its_siblings() {
    check(Some("listen:\n  grpc_addr: 127.0.0.1:7000\n"), &[], |c| {
        c.listen.grpc_addr = "127.0.0.1:7000".to_owned();
    });
    check(
        Some("response:\n  inject_stream_usage: false\n"),
        &[],
        |c| {
            c.response.inject_stream_usage = false;
        },
    );
    check(
        Some("tokens:\n  max_body_bytes: 1024\n  per_image: 85\n"),
        &[],
        |c| {
            c.tokens.max_body_bytes = 1024;
            c.tokens.per_image = 85;
        },
    );
    check(
        Some("tokens:\n  large_body_threads: 3\n  large_body_max_wait_ms: 250\n"),
        &[],
        |c| {
            c.tokens.large_body_threads = 3;
            c.tokens.large_body_max_wait_ms = 250;
        },
    );
    check(Some("shutdown:\n  drain_deadline_ms: 5\n"), &[], |c| {
        c.shutdown.drain_deadline_ms = 5;
    });
}

#[test]
fn file_tiers_replace_the_built_in_set() {
    let yaml = "
default_tier: gold
tiers:
  gold:
    max_input_tokens: 10
    output_limit: clamp
    default_output_tokens: 7
";
    check(Some(yaml), &[], |c| {
        c.default_tier = "gold".to_owned();
        c.tiers = BTreeMap::from([(
            "gold".to_owned(),
            TierConfig {
                max_input_tokens: 10,
                output_limit: OutputLimitPolicy::Clamp,
                default_output_tokens: Some(7),
                ..TierConfig::default()
            },
        )]);
    });
}

#[test]
fn file_lists_of_api_keys_routes_and_encodings() {
    let yaml = "
identity:
  user_header: ''
  api_keys:
    - sha256: abc
      tenant: alice
    - sha256: def
      tenant: bob
      tier: premium
routes:
  inference_paths: [/v1/chat/completions]
tokens:
  encodings:
    - pattern: llama*
      encoding: o200k_base
";
    check(Some(yaml), &[], |c| {
        c.identity.user_header = String::new();
        c.identity.api_keys = vec![
            ApiKeyConfig {
                sha256: "abc".to_owned(),
                tenant: "alice".to_owned(),
                tier: None,
            },
            ApiKeyConfig {
                sha256: "def".to_owned(),
                tenant: "bob".to_owned(),
                tier: Some("premium".to_owned()),
            },
        ];
        c.routes.inference_paths = vec!["/v1/chat/completions".to_owned()];
        c.tokens.encodings = vec![EncodingRule::builtin(
            "llama*",
            crate::tokens::Encoding::O200kBase,
        )];
    });
}

#[test]
fn file_tenant_overrides_and_store_settings() {
    let yaml = "
tenants:
  Alice:
    max_input_tokens: 100
    output_limit: clamp
store:
  redis_url: redis://redis:6379
  budgets_on_error: fail_closed
";
    check(Some(yaml), &[], |c| {
        c.tenants = BTreeMap::from([(
            "Alice".to_owned(),
            TierOverride {
                max_input_tokens: Some(100),
                output_limit: Some(OutputLimitPolicy::Clamp),
                ..TierOverride::default()
            },
        )]);
        c.store.redis_url = Some("redis://redis:6379".to_owned());
        c.store.budgets_on_error = FailMode::FailClosed;
    });
    check_error(
        Some("tenants:\n  alice:\n    max_inptu_tokens: 1\n"),
        &[],
        &["max_inptu_tokens", "tenants.alice"],
    );
}

#[test]
fn env_overrides_a_scalar() {
    check(
        None,
        &[("TOLLGATE__LISTEN__GRPC_ADDR", "127.0.0.1:7000")],
        |c| {
            c.listen.grpc_addr = "127.0.0.1:7000".to_owned();
        },
    );
    check(None, &[("TOLLGATE__DEFAULT_TIER", "premium")], |c| {
        c.default_tier = "premium".to_owned();
    });
    check(None, &[("TOLLGATE__TOKENS__MAX_BODY_BYTES", "1024")], |c| {
        c.tokens.max_body_bytes = 1024;
    });
    check(
        None,
        &[("TOLLGATE__RESPONSE__INJECT_STREAM_USAGE", "false")],
        |c| {
            c.response.inject_stream_usage = false;
        },
    );
}

#[test]
fn env_naming_a_tier_replaces_the_built_in_tiers() {
    // Documented in `Config::tiers`: naming any tier replaces the built-in set as a whole, so
    // setting one field of `free` leaves only `free` (with defaults for its other fields), and
    // `standard` and `premium` are gone.
    check(
        None,
        &[("TOLLGATE__TIERS__FREE__MAX_INPUT_TOKENS", "100")],
        |c| {
            c.tiers = BTreeMap::from([("free".to_owned(), tier(100, 4_096))]);
        },
    );
}

#[test]
fn env_merges_into_a_tier_from_the_file() {
    let yaml = "
default_tier: gold
tiers:
  gold:
    max_input_tokens: 10
    max_output_tokens: 20
";
    check(
        Some(yaml),
        &[("TOLLGATE__TIERS__GOLD__MAX_INPUT_TOKENS", "30")],
        |c| {
            c.default_tier = "gold".to_owned();
            c.tiers = BTreeMap::from([("gold".to_owned(), tier(30, 20))]);
        },
    );
}

#[test]
fn env_wins_over_the_file() {
    check(
        Some("listen:\n  grpc_addr: 127.0.0.1:1\n  admin_addr: 127.0.0.1:2\n"),
        &[("TOLLGATE__LISTEN__GRPC_ADDR", "127.0.0.1:3")],
        |c| {
            c.listen.grpc_addr = "127.0.0.1:3".to_owned();
            c.listen.admin_addr = "127.0.0.1:2".to_owned();
        },
    );
}

#[test]
fn env_inference_paths_are_a_comma_separated_list() {
    check(
        None,
        &[("TOLLGATE__ROUTES__INFERENCE_PATHS", "/a,/b")],
        |c| {
            c.routes.inference_paths = vec!["/a".to_owned(), "/b".to_owned()];
        },
    );
    check(
        None,
        &[("TOLLGATE__ROUTES__INFERENCE_PATHS", "/only")],
        |c| {
            c.routes.inference_paths = vec!["/only".to_owned()];
        },
    );
}

#[test]
fn env_keys_are_lowercased_but_values_are_not() {
    // The config crate lowercases keys, so a map key set through the environment (a tier name,
    // a tenant in scheduler.reservations) is always lowercase; values keep their case.
    check(
        None,
        &[("TOLLGATE__SCHEDULER__RESERVATIONS__ALICE", "10")],
        |c| {
            c.scheduler.reservations = BTreeMap::from([("alice".to_owned(), 10)]);
        },
    );
    check(
        None,
        &[("TOLLGATE__IDENTITY__USER_HEADER", "X-Team")],
        |c| {
            c.identity.user_header = "X-Team".to_owned();
        },
    );
    check(
        None,
        &[("TOLLGATE__ROUTES__INFERENCE_PATHS", "/V1/A,/b")],
        |c| {
            c.routes.inference_paths = vec!["/V1/A".to_owned(), "/b".to_owned()];
        },
    );
}

#[test]
fn env_sets_optional_and_enum_fields() {
    check(
        None,
        &[("TOLLGATE__TIERS__FREE__DEFAULT_OUTPUT_TOKENS", "64")],
        |c| {
            c.tiers = BTreeMap::from([(
                "free".to_owned(),
                TierConfig {
                    default_output_tokens: Some(64),
                    ..TierConfig::default()
                },
            )]);
        },
    );
    check(
        None,
        &[("TOLLGATE__TIERS__FREE__OUTPUT_LIMIT", "clamp")],
        |c| {
            c.tiers = BTreeMap::from([(
                "free".to_owned(),
                TierConfig {
                    output_limit: OutputLimitPolicy::Clamp,
                    ..TierConfig::default()
                },
            )]);
        },
    );
    check(None, &[("TOLLGATE__SCHEDULER__COST", "tokens")], |c| {
        c.scheduler.cost = FairnessCost::Tokens;
    });
    check(
        Some("scheduler:\n  max_queued_body_bytes: 67108864\n"),
        &[("TOLLGATE__SCHEDULER__MAX_QUEUED_BODY_BYTES", "33554432")],
        |c| c.scheduler.max_queued_body_bytes = 32 << 20,
    );
}

#[test]
fn env_without_the_tollgate_double_underscore_prefix_is_ignored() {
    for name in [
        "LISTEN__GRPC_ADDR",
        "TOLLGATE_LISTEN__GRPC_ADDR",
        "TOLLGATEX__LISTEN__GRPC_ADDR",
        "tollgate__listen__grpc_addr",
        "PATH",
    ] {
        check(None, &[(name, "127.0.0.1:9")], |_| {});
    }
}

#[test]
fn unknown_top_level_key_is_an_error_naming_it() {
    check_error(
        Some("listne:\n  grpc_addr: 127.0.0.1:1\n"),
        &[],
        &["listne"],
    );
    check_error(
        None,
        &[("TOLLGATE__DEFAULT_TEIR", "free")],
        &["default_teir"],
    );
}

#[test]
fn unknown_nested_key_is_an_error_naming_it() {
    check_error(
        Some("tiers:\n  free:\n    max_inptu_tokens: 5\n"),
        &[],
        &["max_inptu_tokens", "tiers.free"],
    );
    check_error(
        Some("identity:\n  api_keys:\n    - sha256: abc\n      tenant: a\n      teir: free\n"),
        &[],
        &["teir", "identity.api_keys[0]"],
    );
    check_error(
        None,
        &[("TOLLGATE__LISTEN__GRPC_ADR", "x")],
        &["grpc_adr", "listen"],
    );
    check_error(
        None,
        &[("TOLLGATE__TIERS__FREE__MAX_INPTU_TOKENS", "5")],
        &["max_inptu_tokens", "tiers.free"],
    );
}

#[test]
fn wrong_type_is_an_error_naming_the_field_and_the_value() {
    check_error(
        Some("tiers:\n  free:\n    max_input_tokens: lots\n"),
        &[],
        &["tiers.free.max_input_tokens", "lots"],
    );
    check_error(
        Some("tiers:\n  free:\n    output_limit: sometimes\n"),
        &[],
        &["tiers.free.output_limit", "sometimes"],
    );
    check_error(
        None,
        &[("TOLLGATE__TIERS__FREE__MAX_INPUT_TOKENS", "lots")],
        &["tiers.free.max_input_tokens", "lots"],
    );
    check_error(
        None,
        &[("TOLLGATE__RESPONSE__INJECT_STREAM_USAGE", "maybe")],
        &["response.inject_stream_usage", "maybe"],
    );
}

#[test]
fn missing_file_is_an_error_naming_the_path() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("absent.yaml");
    let ConfigError(message) = load(Some(&path), []).expect_err("a missing file is an error");
    assert!(
        message.contains(&path.display().to_string()),
        "the error should name {}: {message}",
        path.display()
    );
}

#[test]
fn directory_as_config_file_is_an_error_naming_the_path() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let ConfigError(message) = load(Some(dir.path()), []).expect_err("a directory is an error");
    assert!(
        message.contains(&dir.path().display().to_string()),
        "{message}"
    );
}

#[test]
fn negative_count_is_an_error_naming_the_field() {
    check_error(
        Some("tiers:\n  free:\n    max_input_tokens: -1\n"),
        &[],
        &["tiers.free.max_input_tokens", "-1"],
    );
}

#[test]
fn invalid_yaml_is_an_error_naming_the_file() {
    let mut file = tempfile::Builder::new()
        .suffix(".yaml")
        .tempfile()
        .expect("a temporary file");
    file.write_all(b"listen: [unclosed\n")
        .expect("write the config");
    let ConfigError(message) = load(Some(file.path()), []).expect_err("invalid YAML is an error");
    // The config crate shows the path relative to the working directory, so look for the
    // file's own name.
    let name = file.path().file_name().unwrap().to_string_lossy();
    assert!(
        message.contains(&*name),
        "the error should name {name}: {message}"
    );
}

#[test]
fn the_worker_threads_variable_is_a_count_from_1_to_the_cap() {
    // (value, the count it asks for; None: an error naming the variable and the value)
    let table: [(&str, Option<u16>); 9] = [
        ("1", Some(1)),
        ("2", Some(2)),
        ("1024", Some(MAX_WORKER_THREADS)),
        ("0", None),
        ("1025", None),
        ("-1", None),
        ("two", None),
        ("", None),
        (" 2", None),
    ];
    for (value, want) in table {
        let got = worker_threads_variable(Some(std::ffi::OsStr::new(value)));
        match want {
            Some(count) => assert_eq!(got.ok(), Some(Some(count)), "{value:?}"),
            None => {
                let ConfigError(message) = got.expect_err(value);
                assert!(
                    message.starts_with(&format!("{TOKIO_WORKER_THREADS}: {value:?}")),
                    "{value:?}: {message}"
                );
            }
        }
    }
    assert_eq!(worker_threads_variable(None).ok(), Some(None), "unset");
}
