//! The example upstream (`examples/upstream.rs`: fixed pacing, or `--engine vllm`, a simulated
//! vLLM) as a child process on a port of its own choosing.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

use crate::process::{Proc, files_dir};

/// A running upstream; killed (and reaped) on drop.
pub struct Upstream {
    pub addr: SocketAddr,
    proc: Proc,
    /// Holds the log when the upstream has a temp dir of its own; removed after the process.
    _dir: Option<tempfile::TempDir>,
}

impl Upstream {
    /// Starts `binary --addr 127.0.0.1:0 <args>` with its stderr in `<dir>/upstream.log` (in a
    /// temp dir of its own when `dir` is `None`), and reads the address it bound from its first
    /// line (`upstream listening on <addr>`), so no port can be taken in between.
    pub fn start<S: AsRef<str>>(
        binary: &Path,
        args: impl IntoIterator<Item = S>,
        dir: Option<&Path>,
    ) -> Result<Upstream> {
        let (own_dir, dir) = files_dir(dir, "tollgate-upstream-")?;
        let mut command = Command::new(binary);
        command.args(["--addr", "127.0.0.1:0"]);
        for arg in args {
            command.arg(arg.as_ref());
        }
        let mut proc = Proc::spawn(
            "upstream",
            command.stdout(Stdio::piped()),
            dir.join("upstream.log"),
        )?;
        let mut line = String::new();
        BufReader::new(proc.take_stdout().context("the upstream's stdout")?)
            .read_line(&mut line)
            .context("read the upstream's first line")?;
        match line.trim().strip_prefix("upstream listening on ") {
            Some(addr) => Ok(Upstream {
                addr: addr
                    .parse()
                    .with_context(|| format!("the upstream's address {addr:?}"))?,
                proc,
                _dir: own_dir,
            }),
            None => {
                proc.check_alive()?;
                bail!("unexpected first line from the upstream: {line:?}");
            }
        }
    }

    pub fn proc(&self) -> &Proc {
        &self.proc
    }
}
