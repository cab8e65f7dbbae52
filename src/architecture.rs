//! ARCHITECTURE.md's invariants about the code's shape, checked on the source text: which
//! module may import which, where protobuf and gRPC may appear, and that deciding code reads no
//! clock. Test code (`tests.rs` files and `mod tests` blocks) is left out: tests may reach
//! anywhere.

use std::path::{Path, PathBuf};

/// The house, from the bottom up: a module may import modules on lower floors only. Modules on
/// one floor do not import each other.
const FLOORS: &[&[&str]] = &[
    &["lifecycle", "tokens"],
    &["observe"],
    &["config", "scheduler"],
    &["budget"],
    &["control", "reply"],
    &["policy"],
    &["request", "fleet"],
    &["admission", "live"],
    &["pipeline"],
    &["extproc", "admin"],
];

/// Deciding code: pure functions of their arguments, `now` included.
const DECIDING: &[&str] = &[
    "src/request.rs",
    "src/admission.rs",
    "src/tokens.rs",
    "src/tokens/ascii.rs",
    "src/tokens/count_cache.rs",
    "src/tokens/entries.rs",
    "src/tokens/model.rs",
    "src/tokens/template.rs",
    "src/policy.rs",
    "src/reply.rs",
    "src/reply/rate_limit.rs",
    "src/observe/response.rs",
    "src/control.rs",
    "src/control/engine.rs",
    "src/control/window.rs",
    "src/scheduler/fair.rs",
    "src/budget/window.rs",
    "src/budget/breaker.rs",
    "src/fleet/share.rs",
];

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// A module's own source files (`src/m.rs` and everything under `src/m/`), test files left out.
fn files_of(module: &str) -> Vec<PathBuf> {
    let mut files = vec![src().join(format!("{module}.rs"))];
    let mut dirs = vec![src().join(module)];
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs")
                && path.file_name().is_some_and(|n| n != "tests.rs")
            {
                files.push(path);
            }
        }
    }
    files.retain(|f| f.exists());
    files
}

/// A file's code, without its `#[cfg(test)] mod tests { … }` block (which closes the file by
/// convention here) and without comments.
fn code_of(path: &Path) -> String {
    let text = std::fs::read_to_string(path).expect("a source file");
    let text = match text.find("#[cfg(test)]\nmod tests {") {
        Some(at) => &text[..at],
        None => &text[..],
    };
    text.lines()
        .map(|line| match line.find("//") {
            Some(at) => &line[..at],
            None => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn floor_of(module: &str) -> Option<usize> {
    FLOORS.iter().position(|floor| floor.contains(&module))
}

/// The modules `code` names as `crate::module`, or as `super::module` in a module's top file
/// (`src/m.rs`), where `super` is the crate root.
fn imports(code: &str, top_file: bool) -> Vec<String> {
    let roots: &[&str] = if top_file {
        &["crate::", "super::"]
    } else {
        &["crate::"]
    };
    let mut found: Vec<String> = roots
        .iter()
        .flat_map(|root| {
            code.match_indices(root).map(move |(at, _)| {
                code[at + root.len()..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect()
            })
        })
        .collect();
    found.sort();
    found.dedup();
    found
}

#[test]
fn every_module_of_the_library_is_on_a_floor() {
    let lib = std::fs::read_to_string(src().join("lib.rs")).unwrap();
    for line in lib.lines() {
        if let Some(module) = line
            .strip_prefix("pub mod ")
            .and_then(|rest| rest.strip_suffix(';'))
        {
            assert!(
                floor_of(module).is_some(),
                "module {module} is on no floor of architecture::FLOORS: place it"
            );
        }
    }
}

#[test]
fn no_module_imports_one_above_it_or_beside_it() {
    let mut wrong = Vec::new();
    for (floor, modules) in FLOORS.iter().enumerate() {
        for module in *modules {
            for file in files_of(module) {
                let top_file = file == src().join(format!("{module}.rs"));
                for import in imports(&code_of(&file), top_file) {
                    if import == *module {
                        continue;
                    }
                    match floor_of(&import) {
                        Some(other) if other < floor => {}
                        _ => wrong.push(format!(
                            "{} (floor {floor}) imports crate::{import}",
                            file.display()
                        )),
                    }
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports against the floors:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn only_the_ext_proc_adapter_knows_protobuf_and_grpc() {
    // convert reads and builds the messages; service is the gRPC codec that decodes them, and
    // access_log the access log service's glue (its generated server and empty answer); lib.rs
    // builds the gRPC server.
    let protobuf_allowed = [
        "extproc/convert.rs",
        "extproc/service.rs",
        "extproc/access_log.rs",
    ];
    let grpc_allowed = [
        "extproc.rs",
        "extproc/convert.rs",
        "extproc/service.rs",
        "extproc/access_log.rs",
        "lib.rs",
    ];
    let mut wrong = Vec::new();
    for floor in FLOORS {
        for module in *floor {
            for file in files_of(module).into_iter().chain([src().join("lib.rs")]) {
                let name = file
                    .strip_prefix(src())
                    .unwrap()
                    .to_string_lossy()
                    .into_owned();
                let code = code_of(&file);
                if !protobuf_allowed.contains(&name.as_str())
                    && (code.contains("envoy_types") || code.contains("prost"))
                {
                    wrong.push(format!("{name} names envoy_types or prost"));
                }
                if !grpc_allowed.contains(&name.as_str()) && code.contains("tonic") {
                    wrong.push(format!("{name} names tonic"));
                }
            }
        }
    }
    wrong.sort();
    wrong.dedup();
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn deciding_code_reads_no_clock_and_does_no_io() {
    // Naming `Instant` as a type is fine; reading the clock, sleeping or spawning is not.
    let forbidden = [
        "Instant::now",
        "SystemTime::now",
        ".elapsed()",
        "sleep",
        "spawn",
        "std::fs",
        "TcpStream",
        "UdpSocket",
        "to_socket_addrs",
        "async fn",
        ".await",
    ];
    let mut wrong = Vec::new();
    for file in DECIDING {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
        assert!(
            path.exists(),
            "{file} is listed as deciding code but does not exist"
        );
        let code = code_of(&path);
        for what in forbidden {
            if code.contains(what) {
                wrong.push(format!("{file} uses {what}"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "deciding code must take `now` as an argument:\n{}",
        wrong.join("\n")
    );
}
