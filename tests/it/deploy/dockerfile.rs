//! The Dockerfile, read without Docker.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

use super::manifests::{base_config, port_of};
use super::{on_path, read, run, stdout_of};

/// The final stage's `USER uid:gid`.
pub(super) fn dockerfile_user() -> (u64, u64) {
    let dockerfile = read("Dockerfile");
    let final_stage = dockerfile.rsplit_once("\nFROM ").expect("stages").1;
    let user = final_stage
        .lines()
        .find_map(|line| line.strip_prefix("USER "))
        .expect("the final stage sets USER");
    let (uid, gid) = user.trim().split_once(':').expect("USER uid:gid");
    (
        uid.parse().expect("a numeric uid"),
        gid.parse().expect("a numeric gid"),
    )
}

/// Proves, without Docker (base images cannot be pulled here; see docs/deploy.md): the Dockerfile
/// builds in a Rust stage with `cargo build --release --locked`, as CI does, on a toolchain no
/// older than Cargo.toml's rust-version; the runtime stage is Debian slim of the builder's release
/// (so the glibc the binary was linked against is there), runs as a numeric non-root user,
/// exposes the config's ports and starts the copied binary; the build context keeps everything
/// cargo reads; and the tollgate binary needs no shared library beyond glibc and libgcc.
#[test]
fn dockerfile_builds_like_ci_and_runs_as_non_root() {
    let dockerfile = read("Dockerfile");
    assert!(
        dockerfile.starts_with("# syntax=docker/dockerfile:1\n"),
        "BuildKit syntax line"
    );
    let froms: Vec<&str> = dockerfile
        .lines()
        .filter_map(|l| l.strip_prefix("FROM "))
        .collect();
    assert_eq!(froms.len(), 2, "two stages: {froms:?}");
    let (builder_image, builder_name) = froms[0].split_once(" AS ").expect("FROM image AS name");
    let rust = builder_image
        .strip_prefix("rust:")
        .expect("the builder is the official Rust image");
    let (toolchain, builder_release) = rust.split_once('-').expect("rust:X.Y-release");
    let minor = |version: &str| -> u32 {
        version
            .split('.')
            .nth(1)
            .and_then(|m| m.parse().ok())
            .unwrap_or_else(|| panic!("not a version: {version}"))
    };
    let cargo_toml = read("Cargo.toml");
    let rust_version = cargo_toml
        .lines()
        .find_map(|l| l.strip_prefix("rust-version = "))
        .expect("rust-version")
        .trim_matches('"');
    assert!(
        minor(toolchain) >= minor(rust_version),
        "toolchain {toolchain} < {rust_version}"
    );
    let runtime = froms[1].split(' ').next().expect("runtime image");
    assert_eq!(
        runtime,
        format!("debian:{builder_release}-slim"),
        "the runtime is the builder's Debian release, slim"
    );
    assert!(
        dockerfile.contains("cargo build --release --locked"),
        "built as CI builds: the committed Cargo.lock, release profile"
    );
    let final_stage = dockerfile.rsplit_once("\nFROM ").expect("stages").1;
    let copy = final_stage
        .lines()
        .find_map(|l| l.strip_prefix(&format!("COPY --from={builder_name} ")))
        .expect("the binary is copied from the builder");
    let installed = copy.split_whitespace().last().expect("destination");
    assert!(
        final_stage.contains(&format!("ENTRYPOINT [\"{installed}\"]")),
        "the entrypoint is the copied binary, in exec form"
    );
    let (uid, gid) = dockerfile_user();
    assert!(uid != 0 && gid != 0, "not root");
    let exposed: BTreeSet<u64> = final_stage
        .lines()
        .filter_map(|l| l.strip_prefix("EXPOSE "))
        .flat_map(|ports| ports.split_whitespace().map(|p| p.parse().expect("a port")))
        .collect();
    let config = base_config();
    assert_eq!(
        exposed,
        BTreeSet::from([
            port_of(&config.listen.grpc_addr),
            port_of(&config.listen.admin_addr)
        ])
    );
    for line in dockerfile.lines() {
        assert!(
            !(line.starts_with("ADD ") && line.contains("://")),
            "no downloads outside package managers: {line}"
        );
    }

    let dockerignore = read(".dockerignore");
    let ignored: Vec<&str> = dockerignore
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    for needed in [".git", "target", ".tools"] {
        assert!(
            ignored.contains(&needed),
            ".dockerignore should leave out {needed}"
        );
    }
    for kept in [
        "Cargo.toml",
        "Cargo.lock",
        "src",
        "tests",
        "examples",
        "tests/it/main.rs",
    ] {
        assert!(
            !ignored
                .iter()
                .any(|pattern| kept.starts_with(pattern.trim_end_matches('/'))),
            ".dockerignore must keep {kept} (cargo reads it)"
        );
    }

    if cfg!(target_os = "linux") {
        let ldd =
            on_path("ldd").unwrap_or_else(|| panic!("ldd is missing: apt-get install libc-bin"));
        let mut command = Command::new(ldd);
        command.arg(env!("CARGO_BIN_EXE_tollgate"));
        let libraries = stdout_of(run(command, None, "ldd"), "ldd tollgate");
        let allowed = [
            "linux-vdso.so.1",
            "libc.so.6",
            "libm.so.6",
            "libgcc_s.so.1",
            "libpthread.so.0",
            "libdl.so.2",
            "librt.so.1",
        ];
        for line in libraries.lines() {
            let library = line.split_whitespace().next().unwrap_or_default();
            let library = Path::new(library)
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default();
            assert!(
                allowed.contains(&library) || library.starts_with("ld-linux"),
                "tollgate links {library}, which debian:{builder_release}-slim may not have \
                 (ldd: {line})"
            );
        }
    }
}
