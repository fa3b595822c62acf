//! Integration tests of the `dsec` command line: the real binary, run as root, with its own data
//! dir (a temp dir) and run dir (`/run/dsec-cli-test-<pid>-<n>`) per test. Never skipped.
//!
//! Tests hold [`SERIAL`]: each `dsec run` starts a whole runtime, and the timing assertions must
//! not depend on how many others run at the same time on a small machine.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

static SERIAL: Mutex<()> = Mutex::new(());
static SEQ: AtomicU32 = AtomicU32::new(0);

const RUN_DIR_PREFIX: &str = "dsec-cli-test-";

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Removes a run dir (best effort: a mask tmpfs could still be mounted on it).
fn remove_run_dir(dir: &Path) {
    let _ = Command::new("umount")
        .arg("-l")
        .arg(dir.join("mask"))
        .output();
    let _ = fs::remove_dir_all(dir);
}

/// Removes run dirs of earlier test processes that are gone.
fn sweep_stale_run_dirs() {
    let Ok(entries) = fs::read_dir("/run") else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(RUN_DIR_PREFIX)
            .and_then(|rest| rest.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            remove_run_dir(&e.path());
        }
    }
}

/// One test's environment: a data dir and a run dir, both removed on drop.
struct Env {
    _serial: MutexGuard<'static, ()>,
    data: tempfile::TempDir,
    run_dir: PathBuf,
}

impl Env {
    fn new() -> Self {
        let serial = serial();
        sweep_stale_run_dirs();
        let n = SEQ.fetch_add(1, Ordering::Relaxed);
        let run_dir = PathBuf::from(format!("/run/{RUN_DIR_PREFIX}{}-{n}", std::process::id()));
        remove_run_dir(&run_dir);
        Self {
            _serial: serial,
            data: tempfile::Builder::new()
                .prefix("dsec-cli-data-")
                .tempdir()
                .expect("data tempdir"),
            run_dir,
        }
    }

    /// `dsec --data-dir D --run-dir R <args>`.
    fn dsec(&self, args: &[&str]) -> Output {
        let bin = env!("CARGO_BIN_EXE_dsec");
        Command::new(bin)
            .arg("--data-dir")
            .arg(self.data.path())
            .arg("--run-dir")
            .arg(&self.run_dir)
            .args(args)
            .env_remove("DSEC_AGENT_BIN")
            .env_remove("DSEC_SHIM_BIN")
            .env_remove("DSEC_DATA_DIR")
            .env_remove("DSEC_RUN_DIR")
            .output()
            .unwrap_or_else(|e| panic!("run {bin}: {e}"))
    }

    /// Sandboxes left in the run dir.
    fn sandboxes_left(&self) -> Vec<String> {
        fs::read_dir(self.run_dir.join("sandboxes"))
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Asserts that every sandbox the CLI created is gone.
    fn assert_no_sandbox_left(&self) {
        let left = self.sandboxes_left();
        assert!(left.is_empty(), "sandboxes left behind: {left:?}");
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        remove_run_dir(&self.run_dir);
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn code(out: &Output) -> i32 {
    out.status
        .code()
        .unwrap_or_else(|| panic!("dsec was killed by a signal: {out:?}"))
}

/// Asserts that stderr contains `needle`, showing it when it does not.
fn assert_stderr_has(out: &Output, needle: &str) {
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains(needle),
        "stderr lacks {needle:?}: {stderr:?}"
    );
}

/// Asserts the exit code, showing stdout and stderr when it differs.
fn assert_code(out: &Output, want: i32) {
    assert_eq!(
        code(out),
        want,
        "exit code; stdout {:?}, stderr {:?}",
        text(&out.stdout),
        text(&out.stderr)
    );
}

#[test]
fn cli_finds_its_companion_binaries() {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_dsec"));
    for name in ["dsec-agent", "dsec-shim"] {
        let p = exe.with_file_name(name);
        assert!(
            p.is_file(),
            "{} is missing: build the whole workspace first (`cargo build --workspace`) with \
             the same CARGO_TARGET_DIR",
            p.display()
        );
    }
}

#[test]
fn cli_run_prints_output_and_exits_with_the_command_code() {
    let env = Env::new();
    let out = env.dsec(&[
        "run",
        "--",
        "/bin/sh",
        "-c",
        "echo hi; echo err >&2; exit 3",
    ]);
    assert_code(&out, 3);
    assert_eq!(text(&out.stdout), "hi\n");
    assert_stderr_has(&out, "err\n");
    env.assert_no_sandbox_left();

    let out = env.dsec(&["run", "--", "/bin/true"]);
    assert_code(&out, 0);
    assert!(out.stdout.is_empty());
}

#[test]
fn cli_run_timeout_exits_124_quickly() {
    let env = Env::new();
    let t0 = Instant::now();
    let out = env.dsec(&["run", "--timeout", "200ms", "--", "/bin/sleep", "5"]);
    let took = t0.elapsed();
    assert_code(&out, 124);
    assert!(
        took < Duration::from_secs(4),
        "a 200 ms timeout took {took:?} (runtime start included)"
    );
    assert_stderr_has(&out, "timed out");
    env.assert_no_sandbox_left();
}

#[test]
fn cli_run_oom_exits_137() {
    let env = Env::new();
    let out = env.dsec(&[
        "run",
        "--memory",
        "32M",
        "--timeout",
        "30s",
        "--",
        "/usr/bin/python3",
        "-c",
        "b'x'*(1<<30)",
    ]);
    assert_code(&out, 137);
    assert_stderr_has(&out, "out of memory");
    env.assert_no_sandbox_left();
}

#[test]
fn cli_run_json_prints_the_result() {
    let env = Env::new();
    let out = env.dsec(&["run", "--json", "--", "/bin/echo", "hi"]);
    assert_code(&out, 0);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {:?}", text(&out.stdout)));
    assert_eq!(v["status"], "ok", "{v}");
    assert_eq!(v["exit_code"], 0, "{v}");
    assert_eq!(v["stdout"]["data"], "hi\n", "{v}");
    assert_eq!(v["stdout"]["total"], 3, "{v}");
    assert_eq!(v["stdout"]["truncated"], false, "{v}");

    // A failing command keeps its exit code and says so in the JSON.
    let out = env.dsec(&["run", "--json", "--", "/bin/sh", "-c", "exit 5"]);
    assert_code(&out, 5);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(v["status"], "nonzero_exit", "{v}");
    assert_eq!(v["exit_code"], 5, "{v}");
}

#[test]
fn cli_run_env_reaches_the_command() {
    let env = Env::new();
    let out = env.dsec(&[
        "run",
        "-e",
        "FOO=bar",
        "--env",
        "BAZ=a=b",
        "--",
        "/bin/sh",
        "-c",
        "echo $FOO; echo $BAZ",
    ]);
    assert_code(&out, 0);
    assert_eq!(text(&out.stdout), "bar\na=b\n");
}

#[test]
fn cli_bad_flags_exit_2_naming_the_flag() {
    let env = Env::new();
    let out = env.dsec(&["run", "--memory", "lots", "--", "/bin/true"]);
    assert_code(&out, 2);
    let err = text(&out.stderr);
    assert!(err.contains("--memory"), "{err:?}");
    assert!(err.contains("lots"), "{err:?}");

    let out = env.dsec(&["run", "--timeout", "soon", "--", "/bin/true"]);
    assert_code(&out, 2);
    assert_stderr_has(&out, "--timeout");

    let out = env.dsec(&["run", "-e", "NOEQUALS", "--", "/bin/true"]);
    assert_code(&out, 2);
    assert_stderr_has(&out, "--env");

    let out = env.dsec(&["run", "--no-such-flag", "--", "/bin/true"]);
    assert_code(&out, 2);
    assert_stderr_has(&out, "--no-such-flag");

    // No command at all.
    let out = env.dsec(&["run"]);
    assert_code(&out, 2);
    assert!(!text(&out.stderr).is_empty());
    let out = env.dsec(&["run", "--"]);
    assert_code(&out, 2);

    // Nothing was started for any of them.
    assert!(
        !env.run_dir.exists(),
        "a bad command line started a runtime"
    );
}

#[test]
fn cli_unknown_template_is_an_infrastructure_error() {
    let env = Env::new();
    let out = env.dsec(&["run", "--template", "no-such-template", "--", "/bin/true"]);
    assert_code(&out, 70);
    assert_stderr_has(&out, "create sandbox");
    env.assert_no_sandbox_left();
}

#[test]
fn cli_template_list_shows_host() {
    let env = Env::new();
    let out = env.dsec(&["template", "list"]);
    assert_code(&out, 0);
    let stdout = text(&out.stdout);
    let first = stdout.lines().next().unwrap_or_default();
    assert!(
        first.split('\t').next() == Some("host"),
        "host is listed first: {stdout:?}"
    );
}
