//! The `tollgate` binary's command line: config checking, printing, layering and exit codes.

use std::process::{Command, Output, Stdio};
use std::time::Duration;

fn tollgate(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_tollgate"));
    command.args(args).env("RUST_LOG", "error");
    // Variables from the developer's shell must not leak into the expectations.
    for (key, _) in std::env::vars().filter(|(k, _)| k.starts_with("TOLLGATE__")) {
        command.env_remove(key);
    }
    command
        .envs(env.iter().copied())
        .output()
        .expect("run tollgate")
}

fn write_config(text: &str) -> tempfile::NamedTempFile {
    let file = tempfile::Builder::new().suffix(".yaml").tempfile().unwrap();
    std::fs::write(file.path(), text).unwrap();
    file
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn check_config_accepts_a_valid_file() {
    let file = write_config("tiers:\n  gold:\n    max_input_tokens: 32000\ndefault_tier: gold\n");
    let output = tollgate(&["check-config", file.path().to_str().unwrap()], &[]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(String::from_utf8_lossy(&output.stdout).contains(": ok"));
}

#[test]
fn check_config_warns_of_settings_that_do_nothing_and_still_exits_0() {
    let file = write_config(
        "control:\n  enabled: false\n  engine:\n    metrics_urls: [\"http://127.0.0.1:8000/metrics\"]\n",
    );
    let output = tollgate(&["check-config", file.path().to_str().unwrap()], &[]);
    assert!(output.status.success(), "{}", stderr(&output));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains(": ok"), "{stdout}");
    assert!(
        stdout.contains("warning: control.engine.metrics_urls is set but control.enabled is false"),
        "{stdout}"
    );
    let quiet = write_config("control:\n  enabled: false\n");
    let output = tollgate(&["check-config", quiet.path().to_str().unwrap()], &[]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(
        !String::from_utf8_lossy(&output.stdout).contains("warning"),
        "{}",
        String::from_utf8_lossy(&output.stdout)
    );
}

#[test]
fn a_broken_config_names_the_field_and_value_and_exits_2() {
    let cases = [
        (
            "tiers:\n  free:\n    max_inptu_tokens: 5\n",
            "max_inptu_tokens",
        ),
        ("tiers:\n  free:\n    max_input_tokens: lots\n", "lots"),
        ("listen:\n  grpc_addr: nowhere\n", "listen.grpc_addr"),
        ("default_tier: gold\n", "default_tier"),
        (
            "tiers:\n  free:\n    default_output_tokens: 9000\n",
            "tiers.free.default_output_tokens",
        ),
        ("tiers: [\n", "line 2"),
    ];
    for (text, named) in cases {
        let file = write_config(text);
        let output = tollgate(&["check-config", file.path().to_str().unwrap()], &[]);
        assert_eq!(
            output.status.code(),
            Some(2),
            "{text:?}: {}",
            stderr(&output)
        );
        assert!(
            stderr(&output).contains(named),
            "{text:?} should name {named:?}: {}",
            stderr(&output)
        );
    }
    let output = tollgate(&["check-config", "/nonexistent/tollgate.yaml"], &[]);
    assert_eq!(output.status.code(), Some(2));
    assert!(stderr(&output).contains("/nonexistent/tollgate.yaml"));
}

#[test]
fn print_config_shows_defaults_file_env_and_flags_layered() {
    let file = write_config("tiers:\n  free:\n    max_input_tokens: 1000\n");
    let output = tollgate(
        &["print-config", "--config", file.path().to_str().unwrap()],
        &[
            ("TOLLGATE__LISTEN__ADMIN_ADDR", "127.0.0.1:9999"),
            ("TOLLGATE__TIERS__FREE__MAX_OUTPUT_TOKENS", "77"),
        ],
    );
    assert!(output.status.success(), "{}", stderr(&output));
    let printed: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(
        printed["tiers"]["free"]["max_input_tokens"], 1000,
        "from the file"
    );
    assert_eq!(
        printed["tiers"]["free"]["max_output_tokens"], 77,
        "from the environment"
    );
    assert_eq!(printed["listen"]["admin_addr"], "127.0.0.1:9999");
    assert_eq!(
        printed["listen"]["grpc_addr"], "0.0.0.0:50051",
        "built-in default"
    );

    // The printed config is a valid config file again.
    let again = write_config(&String::from_utf8_lossy(&output.stdout));
    let output = tollgate(&["check-config", again.path().to_str().unwrap()], &[]);
    assert!(output.status.success(), "{}", stderr(&output));

    // An unknown environment key is refused like an unknown file key.
    let output = tollgate(&["print-config"], &[("TOLLGATE__LISTEN__GRPC_ADRR", "x")]);
    assert_eq!(output.status.code(), Some(2));
    assert!(stderr(&output).contains("grpc_adrr"), "{}", stderr(&output));
}

/// Runs the server (no subcommand) on port 0, with `env` set, and expects it to exit by itself
/// within 20 s; kills it and fails otherwise.
fn serve_expecting_exit(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_tollgate"));
    command
        .args(args)
        .args(["--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0"])
        .env("RUST_LOG", "error")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (key, _) in std::env::vars().filter(|(k, _)| k.starts_with("TOLLGATE__")) {
        command.env_remove(key);
    }
    command.envs(env.iter().copied());
    let mut child = command.spawn().expect("run tollgate");
    // 20 s in polls of 20 ms.
    let mut polls = 0;
    while child.try_wait().expect("poll tollgate").is_none() {
        polls += 1;
        if polls > 1_000 {
            let _ = child.kill();
            let output = child.wait_with_output().expect("reap tollgate");
            panic!(
                "tollgate {args:?} kept running instead of exiting: {}",
                stderr(&output)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("tollgate's output")
}

#[test]
fn an_unreadable_redis_password_file_is_a_config_error_at_start_up() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-secret");
    // A directory cannot be read as a file, even by root.
    let directory = dir.path().to_str().unwrap().to_owned();
    for path in [missing.to_str().unwrap(), directory.as_str()] {
        let file = write_config(&format!(
            "store:\n  redis_url: \"redis://127.0.0.1:1\"\n  redis_password_file: \"{path}\"\n"
        ));
        let output = serve_expecting_exit(&["--config", file.path().to_str().unwrap()], &[]);
        assert_eq!(
            output.status.code(),
            Some(2),
            "{path}: exit status 2, as for any config error: {}",
            stderr(&output)
        );
        let message = stderr(&output);
        assert!(
            message.contains("store.redis_password_file") && message.contains(path),
            "{path}: the error names the field and the path: {message}"
        );
    }
    // check-config checks the file's shape, not the Secret, which may be mounted only in the pod.
    let file = write_config(&format!(
        "store:\n  redis_url: \"redis://127.0.0.1:1\"\n  redis_password_file: \"{}\"\n",
        missing.display()
    ));
    let output = tollgate(&["check-config", file.path().to_str().unwrap()], &[]);
    assert!(output.status.success(), "{}", stderr(&output));
}

#[test]
fn a_worker_thread_count_tokio_cannot_use_is_a_config_error_at_start_up() {
    // tokio reads TOKIO_WORKER_THREADS itself when no count is set in code, and panics (exit
    // status 101) on all of these but 1025, which is over tollgate's own cap; tollgate reads it
    // first.
    for value in ["0", "two", "-1", "1025", "", " 2"] {
        let output = serve_expecting_exit(&[], &[("TOKIO_WORKER_THREADS", value)]);
        let message = stderr(&output);
        assert_eq!(
            output.status.code(),
            Some(2),
            "TOKIO_WORKER_THREADS={value:?}: exit status 2, as for any config error: {message}"
        );
        assert!(
            message.contains(&format!("TOKIO_WORKER_THREADS: {value:?} is not a number")),
            "TOKIO_WORKER_THREADS={value:?}: the error names the variable and the value: {message}"
        );
    }
    for value in ["0", "1025", "two"] {
        let output = serve_expecting_exit(&["--worker-threads", value], &[]);
        let message = stderr(&output);
        assert_eq!(
            output.status.code(),
            Some(2),
            "--worker-threads {value}: a usage error: {message}"
        );
        assert!(message.contains("--worker-threads"), "{message}");
    }
}

/// check-config reads the runtime's thread count as a start does, so a variable that would stop
/// the start fails the check (named with the file's own problems), and the flag that overrides
/// it still wins; print-config, which prints the configuration only, does not read it.
#[test]
fn check_config_refuses_a_worker_thread_count_the_start_would() {
    let file = write_config("{}\n");
    let path = file.path().to_str().unwrap();
    // (flags before the command, the variable, passes)
    let cases: [(&[&str], &str, bool); 4] = [
        (&[], "2", true),
        (&[], "0", false),
        (&[], "two", false),
        (&["--worker-threads", "2"], "0", true),
    ];
    for (flags, value, passes) in cases {
        let args = [flags, &["check-config", path][..]].concat();
        let output = tollgate(&args, &[("TOKIO_WORKER_THREADS", value)]);
        let message = stderr(&output);
        if passes {
            assert!(output.status.success(), "{flags:?} {value:?}: {message}");
        } else {
            assert_eq!(output.status.code(), Some(2), "{value:?}: {message}");
            assert!(
                message.contains(&format!("TOKIO_WORKER_THREADS: {value:?} is not a number")),
                "{value:?}: the error names the variable and the value: {message}"
            );
        }
    }
    // A broken file and a broken variable: both named.
    let broken = write_config("scheduler:\n  initial_limit: many\n");
    let output = tollgate(
        &["check-config", broken.path().to_str().unwrap()],
        &[("TOKIO_WORKER_THREADS", "0")],
    );
    let message = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{message}");
    assert!(
        message.contains("initial_limit") && message.contains("TOKIO_WORKER_THREADS"),
        "{message}"
    );
    let output = tollgate(&["print-config"], &[("TOKIO_WORKER_THREADS", "0")]);
    assert!(output.status.success(), "{}", stderr(&output));
}

/// The runtime runs the threads the flag asks for, else the variable, else tokio's default
/// count (the CPUs the process may use), and `tollgate_runtime_worker_threads` says so.
#[tokio::test]
async fn the_runtime_runs_the_worker_threads_asked_for() {
    let default = match std::env::var("TOKIO_WORKER_THREADS") {
        // Inherited from the shell running the tests: the child reads it too.
        Ok(value) => value
            .parse()
            .expect("TOKIO_WORKER_THREADS in the tests' environment"),
        Err(_) => std::thread::available_parallelism().map_or(1, usize::from),
    };
    // (flags, environment, the threads expected)
    type Case = (
        &'static [&'static str],
        &'static [(&'static str, &'static str)],
        usize,
    );
    let cases: [Case; 4] = [
        (&[], &[], default),
        (&[], &[("TOKIO_WORKER_THREADS", "3")], 3),
        (&["--worker-threads", "5"], &[], 5),
        // The flag wins, and the variable it overrides is not read, so not refused.
        (
            &["--worker-threads", "2"],
            &[("TOKIO_WORKER_THREADS", "0")],
            2,
        ),
    ];
    for (args, env, want) in cases {
        let gate = crate::support::process::Tollgate::start_with("{}\n", args, env).await;
        let threads = gate
            .metrics()
            .await
            .value("tollgate_runtime_worker_threads", &[]);
        assert_eq!(threads, want as f64, "{args:?} {env:?}");
    }
}

#[test]
fn print_config_shows_the_issue_defaults() {
    let output = tollgate(&["print-config"], &[]);
    assert!(output.status.success(), "{}", stderr(&output));
    let printed: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let tiers = printed["tiers"].as_object().unwrap();
    assert_eq!(
        tiers.keys().collect::<Vec<_>>(),
        ["free", "premium", "standard"],
        "exactly the three built-in tiers"
    );
    assert_eq!(printed["default_tier"], "free", "requests without a tier");
    // (tier, tokens per hour, weight, queue_max, queue_deadline_ms)
    for (tier, tokens, weight, queue_max, deadline) in [
        ("free", 100_000, 1, 2, 1_000),
        ("standard", 200_000, 2, 8, 2_000),
        ("premium", 500_000, 4, 8, 2_000),
    ] {
        let t = &printed["tiers"][tier];
        assert_eq!(t["tokens_per_hour"], tokens, "{tier}");
        assert_eq!(t["max_concurrent"], 3, "{tier}");
        assert_eq!(t["weight"], weight, "{tier}");
        assert_eq!(t["queue_max"], queue_max, "{tier}");
        assert_eq!(t["queue_deadline_ms"], deadline, "{tier}");
        for window in ["tokens_per_minute", "tokens_per_day", "requests_per_minute"] {
            assert!(t[window].is_null(), "{tier}.{window}: no default");
        }
    }
    assert_eq!(printed["scheduler"]["initial_limit"], 128);
    let control = &printed["control"];
    assert_eq!(control["enabled"], true);
    assert_eq!(control["floor"], 32);
    assert_eq!(control["ceiling"], 256);
    assert_eq!(control["target_p99_ttft_ms"], 2_000);
    assert_eq!(control["band"], 0.2);
    // Where tollgate's controller departs from seed 001's (5 s ticks over 30 s, 3 ticks of
    // cooldown, the gateway's TTFT): docs/lab.md, "The controller's signal".
    assert_eq!(control["signal"], "upstream");
    assert_eq!(control["upstream_target_p99_ttft_ms"], 1_000);
    assert_eq!(control["tick_ms"], 1_000);
    assert_eq!(control["window_ms"], 10_000);
    assert_eq!(control["cooldown_ticks"], 0);
    assert_eq!(control["slow_start"], true);
    assert_eq!(control["min_samples"], 10);
    // The engines' signal is off until their metrics URLs are given; its thresholds are the
    // Inference Extension's, but for the KV cache (docs/lab.md).
    let engine = &control["engine"];
    assert_eq!(engine["metrics_urls"], serde_json::json!([]));
    assert_eq!(engine["kv_cache_threshold"], 0.9);
    assert_eq!(engine["queue_depth_threshold"], 5);
    assert_eq!(engine["scrape_timeout_ms"], 250);
    // The store: in memory unless a Redis URL is given; fail modes as the issue names them.
    let store = &printed["store"];
    assert!(store["redis_url"].is_null());
    assert_eq!(store["budgets_on_error"], "fail_open");
    assert_eq!(store["concurrency_on_error"], "fail_closed");
}

#[test]
fn a_flag_beats_the_environment() {
    let output = tollgate(
        &[
            "--admin-addr",
            "127.0.0.1:7001",
            "--redis-url",
            "redis://from-the-flag:6379",
            "print-config",
        ],
        &[
            ("TOLLGATE__LISTEN__ADMIN_ADDR", "127.0.0.1:7002"),
            ("TOLLGATE__STORE__REDIS_URL", "redis://from-the-env:6379"),
            ("TOLLGATE__LISTEN__GRPC_ADDR", "127.0.0.1:7003"),
        ],
    );
    assert!(output.status.success(), "{}", stderr(&output));
    let printed: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(printed["listen"]["admin_addr"], "127.0.0.1:7001");
    assert_eq!(printed["store"]["redis_url"], "redis://from-the-flag:6379");
    assert_eq!(
        printed["listen"]["grpc_addr"], "127.0.0.1:7003",
        "no flag: the environment wins over the default"
    );
}

#[tokio::test]
async fn healthz_answers_200() {
    let gate = crate::support::process::Tollgate::start("{}\n").await;
    let (status, body) = crate::support::server::http_get(gate.admin, "/healthz").await;
    assert_eq!((status, body.as_str()), (200, "ok\n"));
}
