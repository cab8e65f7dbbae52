//! The `tollgate` binary's command line: config checking, printing, layering and exit codes.

use std::process::{Command, Output};

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
