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
    /// `dsec run <opts> -- <argv>`.
    fn run(&self, opts: &[&str], argv: &[&str]) -> Output {
        let args: Vec<&str> = ["run"]
            .iter()
            .chain(opts)
            .chain(&["--"])
            .chain(argv)
            .copied()
            .collect();
        self.dsec(&args)
    }

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
    let out = env.run(&[], &["/bin/sh", "-c", "echo hi; echo err >&2; exit 3"]);
    assert_code(&out, 3);
    assert_eq!(text(&out.stdout), "hi\n");
    assert_stderr_has(&out, "err\n");
    env.assert_no_sandbox_left();

    let out = env.run(&[], &["/bin/true"]);
    assert_code(&out, 0);
    assert!(out.stdout.is_empty());
}

#[test]
fn cli_run_timeout_exits_124_quickly() {
    let env = Env::new();
    let t0 = Instant::now();
    let out = env.run(&["--timeout", "200ms"], &["/bin/sleep", "5"]);
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
    let out = env.run(
        &["--memory", "32M", "--timeout", "30s"],
        &["/usr/bin/python3", "-c", "b'x'*(1<<30)"],
    );
    assert_code(&out, 137);
    assert_stderr_has(&out, "out of memory");
    env.assert_no_sandbox_left();
}

#[test]
fn cli_run_json_prints_the_result() {
    let env = Env::new();
    let out = env.run(&["--json"], &["/bin/echo", "hi"]);
    assert_code(&out, 0);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {:?}", text(&out.stdout)));
    assert_eq!(v["status"], "ok", "{v}");
    assert_eq!(v["exit_code"], 0, "{v}");
    assert_eq!(v["stdout"]["data"], "hi\n", "{v}");
    assert_eq!(v["stdout"]["total"], 3, "{v}");
    assert_eq!(v["stdout"]["truncated"], false, "{v}");

    // A failing command keeps its exit code and says so in the JSON.
    let out = env.run(&["--json"], &["/bin/sh", "-c", "exit 5"]);
    assert_code(&out, 5);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(v["status"], "nonzero_exit", "{v}");
    assert_eq!(v["exit_code"], 5, "{v}");
}

#[test]
fn cli_run_env_reaches_the_command() {
    let env = Env::new();
    let out = env.run(
        &["-e", "FOO=bar", "--env", "BAZ=a=b"],
        &["/bin/sh", "-c", "echo $FOO; echo $BAZ"],
    );
    assert_code(&out, 0);
    assert_eq!(text(&out.stdout), "bar\na=b\n");
}

#[test]
fn cli_bad_flags_exit_2_naming_the_flag() {
    let env = Env::new();
    let out = env.run(&["--memory", "lots"], &["/bin/true"]);
    assert_code(&out, 2);
    let err = text(&out.stderr);
    assert!(err.contains("--memory"), "{err:?}");
    assert!(err.contains("lots"), "{err:?}");

    let out = env.run(&["--timeout", "soon"], &["/bin/true"]);
    assert_code(&out, 2);
    assert_stderr_has(&out, "--timeout");

    let out = env.run(&["-e", "NOEQUALS"], &["/bin/true"]);
    assert_code(&out, 2);
    assert_stderr_has(&out, "--env");

    let out = env.run(&["--no-such-flag"], &["/bin/true"]);
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

/// A missing template is "not found" (3), as for the daemon's commands, not an internal error.
#[test]
fn cli_unknown_template_exits_3() {
    let env = Env::new();
    let out = env.run(&["--template", "no-such-template"], &["/bin/true"]);
    assert_code(&out, 3);
    assert_stderr_has(&out, "template \"no-such-template\" not found");
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

/// The stored layer dirs of `data`.
fn layer_dirs(data: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(data.join("layers"))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// `template import` tells a plain root filesystem tarball (plain or gzip'd) from an image
/// without `--rootfs`, says which flag to use for a directory that is no image, and
/// `template rm --local` removes a template with the layers no other template uses.
#[test]
fn cli_template_import_tells_the_format_and_rm_frees_layers() {
    let env = Env::new();
    let base = env.data.path().join("src");
    for (root, motd) in [("root", "hi\n"), ("other", "other\n")] {
        fs::create_dir_all(base.join(root).join("etc")).expect("root");
        fs::write(base.join(root).join("etc/motd"), motd).expect("motd");
    }
    let tar = base.join("root.tar");
    let tgz = base.join("other.tar.gz");
    for (file, flag, root) in [(&tar, "-cf", "root"), (&tgz, "-czf", "other")] {
        let st = Command::new("tar")
            .arg(flag)
            .arg(file)
            .arg("-C")
            .arg(base.join(root))
            .arg(".")
            .status()
            .expect("tar");
        assert!(st.success());
    }
    let s = |p: &Path| p.to_str().expect("utf-8").to_owned();
    let out = env.dsec(&["template", "import", "plain", &s(&tar)]);
    assert_code(&out, 0);
    assert_stderr_has(&out, "a root filesystem tarball");
    let out = env.dsec(&["template", "import", "zipped", &s(&tgz)]);
    assert_code(&out, 0);
    let out = env.dsec(&["template", "import", "twin", &s(&tar)]);
    assert_code(&out, 0);
    let listed = text(&env.dsec(&["template", "list"]).stdout);
    for name in ["plain", "zipped", "twin"] {
        assert!(listed.contains(name), "{listed}");
    }
    // A directory that is no image layout: exit 2, naming the way to import it.
    let out = env.dsec(&["template", "import", "dir", &s(&base.join("root"))]);
    assert_code(&out, 2);
    assert_stderr_has(&out, "tar -C");

    let layers = layer_dirs(env.data.path());
    assert_eq!(
        layers.len(),
        2,
        "plain and twin share one layer: {layers:?}"
    );
    let out = env.dsec(&["template", "rm", "--local", "plain"]);
    assert_code(&out, 0);
    assert_eq!(layer_dirs(env.data.path()), layers, "twin still uses it");
    assert_code(&env.dsec(&["template", "rm", "--local", "twin"]), 0);
    assert_code(&env.dsec(&["template", "rm", "--local", "zipped"]), 0);
    assert!(layer_dirs(env.data.path()).is_empty());
    assert_code(&env.dsec(&["template", "rm", "--local", "twin"]), 3);
    assert_code(&env.dsec(&["template", "rm", "--local", "host"]), 2);
}

/// `sandbox files download` refuses to write a tar archive to a terminal (before it asks the
/// daemon anything): a usage error, with the way out.
#[test]
fn cli_download_refuses_a_terminal() {
    let port = dsec_testkit::free_port();
    let cmd = format!(
        "{} --url http://127.0.0.1:{port} --api-key k sandbox files sb-0000000000000000 \
         download /tmp",
        env!("CARGO_BIN_EXE_dsec")
    );
    // `script` runs the command with a pseudo-terminal as its stdout.
    let out = Command::new("script")
        .args(["-q", "-e", "-c", &cmd, "/dev/null"])
        .output()
        .expect("run script (bsdutils)");
    let shown = text(&out.stdout);
    assert_eq!(code(&out), 2, "{shown}");
    assert!(
        shown.contains("refusing to write a tar archive to a terminal"),
        "{shown}"
    );
    assert!(shown.contains("-o FILE"), "{shown}");
}

/// Every flag `dsec server --help` lists is in README.md, and the README's command block
/// lists each command once.
#[test]
fn readme_lists_every_server_flag() {
    let help = Command::new(env!("CARGO_BIN_EXE_dsec"))
        .args(["server", "--help"])
        .output()
        .expect("dsec server --help");
    assert_code(&help, 0);
    let readme = fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md"))
        .expect("README.md");
    let mut missing = Vec::new();
    let mut flags = 0;
    for word in text(&help.stdout).split(|c: char| !(c.is_ascii_alphanumeric() || c == '-')) {
        let Some(name) = word.strip_prefix("--") else {
            continue;
        };
        if name.is_empty() || name == "help" || name.starts_with('-') {
            continue;
        }
        flags += 1;
        let flag = format!("--{name}");
        let found = readme.match_indices(&flag).any(|(i, _)| {
            !readme[i + flag.len()..].starts_with(|c: char| c.is_ascii_alphanumeric() || c == '-')
        });
        if !found {
            missing.push(flag);
        }
    }
    assert!(flags >= 15, "{flags} flags in `dsec server --help`");
    assert!(missing.is_empty(), "README.md lacks {missing:?}");
    let block = readme
        .split("## Command line")
        .nth(1)
        .and_then(|r| r.split("```").nth(1))
        .expect("the README's command block");
    let mut seen = std::collections::BTreeSet::new();
    for line in block.lines() {
        let cmd: Vec<&str> = line.split_whitespace().take(3).collect();
        if cmd.first() == Some(&"dsec") {
            let key = cmd.join(" ");
            assert!(seen.insert(key.clone()), "{key} is listed twice: {block}");
        }
    }
}
