//! The seccomp policy enforced by the kernel (TESTING.md S-04, S-05, S-12, C-05, C-06): each test runs
//! `dsec-probe seccomp-selftest CHECK`, which installs `Filter::build()` on itself and makes one
//! call, and observes the probe's JSON or its death by SIGSYS.

use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Output};

use serde_json::Value;

const PROBE: &str = env!("CARGO_BIN_EXE_dsec-probe");

fn selftest(args: &[&str]) -> Output {
    Command::new(PROBE)
        .arg("seccomp-selftest")
        .args(args)
        .output()
        .expect("spawn dsec-probe")
}

/// Runs a check that must succeed and returns its `result` object.
fn result_of(args: &[&str]) -> Value {
    let out = selftest(args);
    assert!(
        out.status.success(),
        "{args:?}: {:?}, stderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let line = String::from_utf8_lossy(&out.stdout);
    let last = line.lines().last().expect("probe printed JSON");
    let v: Value = serde_json::from_str(last).expect("valid JSON");
    v["result"].clone()
}

fn assert_killed(args: &[&str]) {
    let out = selftest(args);
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGSYS),
        "{args:?} must be killed by SIGSYS; got {:?}, stdout: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout)
    );
}

fn assert_runs(argv: &[&str]) {
    let mut args = vec!["run", "--"];
    args.extend_from_slice(argv);
    let r = result_of(&args);
    assert_eq!(r["ok"], Value::Bool(true), "{argv:?} under the filter: {r}");
}

#[test]
fn s05_allowed_programs_run_under_the_filter() {
    assert_runs(&["/bin/sh", "-c", "true"]);
    assert_runs(&[
        "/bin/sh",
        "-c",
        "echo hi | cat > /dev/null && ls / > /dev/null",
    ]);
    // glibc's pthread_create/posix_spawn try clone3 first and must fall back on ENOSYS.
    assert_runs(&[
        "/usr/bin/python3",
        "-c",
        "import threading, subprocess; t=threading.Thread(target=print); t.start(); t.join(); \
         subprocess.run(['true'], check=True)",
    ]);
}

#[test]
fn s05_clone_with_clone_newnet_is_killed_plain_clone_works() {
    assert_killed(&["clone-newnet"]);
    assert_eq!(result_of(&["clone-plain"])["ok"], Value::Bool(true));
}

#[test]
fn s05_clone3_fails_with_enosys() {
    assert_eq!(result_of(&["clone3"])["errno"], libc::ENOSYS);
}

#[test]
fn s04_unlisted_numbers_fail_with_enosys() {
    for nr in ["400", "1000", "1073741823"] {
        assert_eq!(
            result_of(&["unlisted", nr])["errno"],
            libc::ENOSYS,
            "nr {nr}"
        );
    }
}

#[test]
fn c05_tiocsti_and_tioclinux_fail_with_eperm() {
    let r = result_of(&["tiocsti"]);
    assert_eq!(r["tiocsti"]["errno"], libc::EPERM, "{r}");
    assert_eq!(r["tioclinux"]["errno"], libc::EPERM, "{r}");
    assert_eq!(r["tcgets"]["ret"], 0, "other ioctls still work: {r}");
}

#[test]
fn s05_personality_only_query() {
    let r = result_of(&["personality"]);
    assert!(r["query"]["ret"].is_i64(), "{r}");
    assert_eq!(r["set_linux32"]["errno"], libc::EPERM, "{r}");
}

/// S-12: under the filter, this test process (root with `CAP_MKNOD`, which makes any node
/// without it) makes no character or block device, not even a whiteout; a FIFO it makes.
#[test]
fn s12_mknod_of_device_nodes_fails_with_eperm() {
    let dir = tempfile::tempdir().expect("tempdir");
    let r = result_of(&["mknod", dir.path().to_str().expect("utf-8 path")]);
    for call in ["mknod", "mknodat"] {
        for node in ["char", "block", "whiteout"] {
            let got = &r[format!("{call} {node}")];
            assert_eq!(got["errno"], libc::EPERM, "{call} {node}: {r}");
        }
        assert_eq!(r[format!("{call} fifo")], "made", "{r}");
    }
}

/// S-05 ptrace and unshare, S-04 the i386 `int 0x80` and x32 ABIs, C-06 open_by_handle_at:
/// each is killed by SIGSYS.
#[test]
fn s04_s05_c06_denied_calls_are_killed() {
    for case in ["ptrace", "unshare", "int80", "x32", "open-by-handle"] {
        assert_killed(&[case]);
    }
}

#[test]
fn s04_every_syscall_number_matches_the_policy_table() {
    let r = result_of(&["sweep"]);
    assert_eq!(r["id"], "S-04");
    assert_eq!(
        r["pass"],
        Value::Bool(true),
        "mismatches: {}",
        r["detail"]["mismatches"]
    );
    assert!(r["detail"]["tried"].as_u64().expect("tried") > 400);
}

#[test]
fn s05_must_deny_list_is_denied() {
    let r = result_of(&["must-deny"]);
    assert_eq!(r["pass"], Value::Bool(true), "{}", r["detail"]);
}

#[test]
fn report_prints_stable_json_outside_a_sandbox() {
    let out = Command::new(PROBE)
        .args([
            "report",
            "--host-ns",
            "pid=4026531836",
            "--secret-env",
            "DSEC_NO_SUCH_VAR",
        ])
        .output()
        .expect("spawn dsec-probe");
    assert!(
        out.status.success(),
        "{:?} {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("valid JSON");
    let ids: Vec<&str> = v["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .map(|c| {
            assert!(c["pass"].is_boolean() && !c["detail"].is_null(), "{c}");
            c["id"].as_str().expect("id")
        })
        .collect();
    assert_eq!(
        ids,
        [
            "S-01", "S-02", "S-03", "S-04", "S-05", "S-06", "S-07", "S-08", "S-10", "S-11", "S-12",
            "S-13", "C-01", "C-03", "C-04", "C-05", "C-06"
        ]
    );
    // The test process is no sandbox: at least the seccomp-dependent checks fail.
    assert_eq!(v["all_pass"], Value::Bool(false));
}
