//! Exec requests and results: one command run inside a sandbox.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Default cap on captured bytes per stream (head + tail kept).
pub const DEFAULT_OUTPUT_LIMIT: u64 = 1 << 20;
/// Hard cap on captured bytes per stream that a request may ask for.
pub const MAX_OUTPUT_LIMIT: u64 = 16 << 20;
/// Total bytes a command may write to one stream before it is killed with `output_limit`.
pub const OUTPUT_KILL_FACTOR: u64 = 64;
/// Longest wall timeout a request may ask for (24 h).
pub const MAX_TIMEOUT_MS: u64 = 24 * 3600 * 1000;
/// Most argv entries / env entries accepted.
pub const MAX_ARGS: usize = 4096;
/// Most bytes of argv + env + shell string accepted.
pub const MAX_COMMAND_BYTES: usize = 1 << 20;

/// What to run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Command {
    /// Execute `argv[0]` (searched in `PATH` when it has no `/`) with these arguments.
    Argv(Vec<String>),
    /// Run this string with `/bin/sh -c`.
    Shell(String),
}

/// A request to run one command.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    /// The command.
    pub command: Command,
    /// Extra environment, added to the sandbox's base environment.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory, resolved strictly inside the sandbox root. Default `/`.
    #[serde(default)]
    pub cwd: Option<String>,
    /// Wall-clock limit in milliseconds; the process group is killed when it passes.
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// CPU-time limit in milliseconds (RLIMIT_CPU, rounded up to whole seconds).
    #[serde(default)]
    pub cpu_limit_ms: Option<u64>,
    /// Bytes kept per stream (half head, half tail). Default [`DEFAULT_OUTPUT_LIMIT`].
    #[serde(default)]
    pub output_limit: Option<u64>,
    /// Send `Output` events while the command runs. On a `Spawn`: the spawn request itself
    /// follows the process (`Attached`, then `Output` events, then `ExecDone`).
    #[serde(default)]
    pub stream: bool,
    /// Run as this user of the sandbox (a name from its `/etc/passwd`, or a numeric uid);
    /// `None`: the sandbox's default user (the template's `user`, else root).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// A caller-chosen tag of a background process, shown by `ProcList` (≤ 256 bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    /// Run on a pseudo-terminal of this size (stdout carries the terminal's output; stderr is
    /// empty). Background processes only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pty: Option<PtySize>,
    /// A background process's stdin is closed once the spawn's body is written (`false`: it
    /// stays open for `ProcStdin`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stdin_closed: bool,
}

/// Checks a user name: 1..=256 bytes of `[A-Za-z0-9._-]` (a POSIX portable name, or a numeric
/// uid).
pub fn validate_user(u: &str) -> Result<(), String> {
    let ok = !u.is_empty()
        && u.len() <= MAX_NAME_BYTES
        && !u.starts_with('-')
        && u.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "invalid user name {:?}",
            u.chars().take(64).collect::<String>()
        ))
    }
}

/// The size of a pseudo-terminal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PtySize {
    /// Rows (1..=4096).
    pub rows: u16,
    /// Columns (1..=4096).
    pub cols: u16,
}

impl PtySize {
    /// Checks the bounds.
    pub fn validate(&self) -> Result<(), String> {
        if (1..=4096).contains(&self.rows) && (1..=4096).contains(&self.cols) {
            Ok(())
        } else {
            Err("pty rows and cols must be in 1..=4096".into())
        }
    }
}

/// Longest user name or tag accepted.
pub const MAX_NAME_BYTES: usize = 256;

impl ExecRequest {
    /// A request for `argv` with every other field defaulted.
    pub fn argv<I, S>(argv: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self::new(Command::Argv(argv.into_iter().map(Into::into).collect()))
    }

    /// A request for a shell string with every other field defaulted.
    pub fn shell(script: impl Into<String>) -> Self {
        Self::new(Command::Shell(script.into()))
    }

    fn new(command: Command) -> Self {
        Self {
            command,
            env: BTreeMap::new(),
            cwd: None,
            timeout_ms: None,
            cpu_limit_ms: None,
            output_limit: None,
            stream: false,
            user: None,
            tag: None,
            pty: None,
            stdin_closed: false,
        }
    }

    /// Checks every bound; returns a message naming the first one violated.
    pub fn validate(&self) -> Result<(), String> {
        let mut bytes = 0usize;
        match &self.command {
            Command::Argv(argv) => {
                if argv.is_empty() {
                    return Err("argv must not be empty".into());
                }
                if argv.len() > MAX_ARGS {
                    return Err(format!("argv has more than {MAX_ARGS} entries"));
                }
                for a in argv {
                    if a.contains('\0') {
                        return Err("argv entries must not contain NUL".into());
                    }
                    bytes += a.len() + 1;
                }
            }
            Command::Shell(s) => {
                if s.contains('\0') {
                    return Err("shell command must not contain NUL".into());
                }
                bytes += s.len();
            }
        }
        if self.env.len() > MAX_ARGS {
            return Err(format!("env has more than {MAX_ARGS} entries"));
        }
        for (k, v) in &self.env {
            if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
                return Err(format!("invalid env entry {k:?}"));
            }
            bytes += k.len() + v.len() + 2;
        }
        if bytes > MAX_COMMAND_BYTES {
            return Err(format!("command and env exceed {MAX_COMMAND_BYTES} bytes"));
        }
        if let Some(cwd) = &self.cwd {
            if cwd.contains('\0') {
                return Err("cwd must not contain NUL".into());
            }
        }
        if self
            .timeout_ms
            .is_some_and(|t| t == 0 || t > MAX_TIMEOUT_MS)
        {
            return Err(format!("timeout_ms must be in 1..={MAX_TIMEOUT_MS}"));
        }
        if self
            .cpu_limit_ms
            .is_some_and(|t| t == 0 || t > MAX_TIMEOUT_MS)
        {
            return Err(format!("cpu_limit_ms must be in 1..={MAX_TIMEOUT_MS}"));
        }
        if self.output_limit.is_some_and(|l| l > MAX_OUTPUT_LIMIT) {
            return Err(format!("output_limit must be at most {MAX_OUTPUT_LIMIT}"));
        }
        if let Some(u) = &self.user {
            validate_user(u)?;
        }
        if let Some(t) = &self.tag {
            if t.len() > MAX_NAME_BYTES || t.contains('\0') {
                return Err(format!(
                    "tag must be at most {MAX_NAME_BYTES} bytes, without NUL"
                ));
            }
        }
        if let Some(p) = &self.pty {
            p.validate()?;
        }
        Ok(())
    }

    /// The effective per-stream output cap.
    pub fn effective_output_limit(&self) -> u64 {
        self.output_limit.unwrap_or(DEFAULT_OUTPUT_LIMIT)
    }
}

/// How a command ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExecStatus {
    /// Exited with code 0.
    Ok,
    /// Exited with a non-zero code.
    NonzeroExit,
    /// Killed because the wall or CPU limit passed.
    Timeout,
    /// Killed by the kernel OOM killer inside the sandbox's memory limit.
    Oom,
    /// Killed by a signal not sent by dsec's limits.
    Killed,
    /// Output exceeded the hard output bound and the command was killed.
    OutputLimit,
}

/// Which output stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stream {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

/// Captured output of one stream. When `truncated`, `data` holds the first half of the cap
/// followed by the last half; `total` is the number of bytes the command wrote.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Captured {
    /// The kept bytes (head then tail when truncated).
    #[serde(with = "bytes_as_array_or_string")]
    pub data: Vec<u8>,
    /// Bytes written in total.
    pub total: u64,
    /// True when bytes were dropped from the middle.
    pub truncated: bool,
}

/// The result of one exec.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecResult {
    /// How it ended.
    pub status: ExecStatus,
    /// Exit code when it exited normally.
    pub exit_code: Option<i32>,
    /// Signal number when it was killed by a signal.
    pub signal: Option<i32>,
    /// Wall time from spawn to main-process exit, microseconds.
    pub wall_us: u64,
    /// User + system CPU time of the process tree that was reaped, microseconds.
    pub cpu_us: u64,
    /// Peak resident set size in KiB (largest reaped process).
    pub peak_rss_kb: u64,
    /// Captured standard output.
    pub stdout: Captured,
    /// Captured standard error.
    pub stderr: Captured,
}

/// Serde helper: bytes travel as a UTF-8 string when valid, otherwise as an array of numbers.
/// Keeps the JSON readable for the common case and lossless for binary output.
mod bytes_as_array_or_string {
    use serde::de::{self, SeqAccess, Visitor};
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        match std::str::from_utf8(v) {
            Ok(text) => s.serialize_str(text),
            Err(_) => s.collect_seq(v.iter()),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Vec<u8>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string or an array of bytes")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Vec<u8>, E> {
                Ok(v.as_bytes().to_vec())
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u8>, A::Error> {
                let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 20));
                while let Some(b) = seq.next_element::<u8>()? {
                    out.push(b);
                }
                Ok(out)
            }
        }
        d.deserialize_any(V)
    }
}

/// The body of `POST /v1/sandboxes/{id}/exec`: a command (argv or shell), its environment,
/// limits and stdin, and optionally the trajectory step it is.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecBody {
    /// The trajectory this command is a step of.
    #[serde(default, alias = "trajectory_id")]
    pub trajectory: Option<String>,
    /// Its step number (a replay when already logged).
    #[serde(default)]
    pub step: Option<u64>,
    /// The command as an argument vector.
    #[serde(default)]
    pub argv: Option<Vec<String>>,
    /// The command as a `sh -c` script.
    #[serde(default)]
    pub shell: Option<String>,
    /// Environment added for this command.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory.
    #[serde(default)]
    pub cwd: Option<String>,
    /// Wall-clock limit, ms.
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// CPU-time limit, ms.
    #[serde(default)]
    pub cpu_limit_ms: Option<u64>,
    /// Most bytes of output kept per stream.
    #[serde(default)]
    pub output_limit: Option<u64>,
    /// Run as this user of the sandbox (default: the template's user, else root).
    #[serde(default)]
    pub user: Option<String>,
    /// Standard input as text.
    #[serde(default)]
    pub stdin: Option<String>,
    /// Standard input as base64.
    #[serde(default)]
    pub stdin_b64: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validate_rejects_empty_argv_and_nul() {
        assert!(ExecRequest::argv(Vec::<String>::new()).validate().is_err());
        assert!(ExecRequest::argv(["a\0b"]).validate().is_err());
        assert!(ExecRequest::shell("true").validate().is_ok());
        let mut r = ExecRequest::shell("true");
        r.timeout_ms = Some(0);
        assert!(r.validate().is_err());
    }

    #[test]
    fn captured_roundtrips_binary_and_text() {
        for data in [b"hello".to_vec(), vec![0xff, 0x00, 0x80]] {
            let c = Captured {
                data: data.clone(),
                total: 3,
                truncated: false,
            };
            let json = serde_json::to_string(&c).expect("serialize");
            let back: Captured = serde_json::from_str(&json).expect("deserialize");
            assert_eq!(back.data, data);
        }
    }
}
