//! The binaries the tests and examples run, located in the target dir: the tollgate binary and
//! the example programs (the upstream, the echo ext_proc, the lab).
//!
//! A test binary lives in `target/<profile>/deps/`, an example in `target/<profile>/examples/`:
//! either way the profile directory is two levels up, and the binaries sit there
//! (`target/<profile>/tollgate`, `target/<profile>/examples/<name>`). `cargo run --example` and
//! `cargo test` build neither of them for a program: an example with `test = true` is built by
//! `cargo test` only as a test harness, hence the commands in the errors.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use anyhow::{Context, Result, ensure};

/// `target/<profile>`, the directory of the running test or example's profile.
pub fn profile_dir() -> Result<PathBuf> {
    let exe = std::env::current_exe().context("path of this executable")?;
    exe.parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .with_context(|| {
            format!(
                "{} should live in target/<profile>/deps or target/<profile>/examples",
                exe.display()
            )
        })
}

/// The `cargo build` flag of this profile: `--release` in release, nothing in debug.
fn profile_flag() -> &'static str {
    match profile_dir()
        .ok()
        .and_then(|dir| dir.file_name().map(|name| name == "release"))
    {
        Some(true) => "--release ",
        _ => "",
    }
}

/// The example program `name`: `explicit` if given (a `--upstream-bin` flag), else
/// `target/<profile>/examples/<name>`.
pub fn example(name: &str, explicit: Option<&Path>) -> Result<PathBuf> {
    let path = match explicit {
        Some(path) => path.to_path_buf(),
        None => profile_dir()?.join("examples").join(name),
    };
    ensure!(
        path.is_file(),
        "example {name} is not built at {}: run `cargo build {}--example {name}` first (with \
         the same CARGO_TARGET_DIR; `bash scripts/test.sh` builds the ones the tests run)",
        path.display(),
        profile_flag()
    );
    Ok(path)
}

/// The tollgate binary: `explicit` if given (a `--tollgate-bin` flag, or a test's
/// `CARGO_BIN_EXE_tollgate`), else `target/<profile>/tollgate`.
pub fn tollgate(explicit: Option<&Path>) -> Result<PathBuf> {
    let path = match explicit {
        Some(path) => path.to_path_buf(),
        None => profile_dir()?.join("tollgate"),
    };
    ensure!(
        path.is_file(),
        "{} is missing: run `cargo build {}--bin tollgate` first (with the same \
         CARGO_TARGET_DIR), or pass --tollgate-bin",
        path.display(),
        profile_flag()
    );
    Ok(path)
}

/// A warning when `binary` is older than any file under `sources` (paths relative to the
/// repository root): `cargo run --example` rebuilds only the example, so a stale binary would
/// silently be measured. `rebuild` is the command that brings it up to date.
pub fn stale_warning(binary: &Path, sources: &[&str], rebuild: &str) -> Option<String> {
    let built = std::fs::metadata(binary).and_then(|m| m.modified()).ok()?;
    let root = crate::repo_root();
    let sources: Vec<PathBuf> = sources.iter().map(|path| root.join(path)).collect();
    (newest_mtime(&sources)? > built).then(|| {
        format!(
            "{} is older than its sources ({}); rebuild with `{rebuild}` to measure the current \
             code",
            binary.display(),
            sources
                .iter()
                .filter_map(|path| path.strip_prefix(root).ok())
                .map(|path| path.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )
    })
}

/// Newest modification time of the files under `paths`.
fn newest_mtime(paths: &[PathBuf]) -> Option<SystemTime> {
    let mut newest = None;
    let mut pending: Vec<PathBuf> = paths.to_vec();
    while let Some(path) = pending.pop() {
        let Ok(metadata) = std::fs::metadata(&path) else {
            continue;
        };
        if metadata.is_dir() {
            if let Ok(entries) = std::fs::read_dir(&path) {
                pending.extend(entries.filter_map(|e| e.ok().map(|e| e.path())));
            }
        } else if let Ok(modified) = metadata.modified() {
            newest = newest.max(Some(modified));
        }
    }
    newest
}
