//! The chaos soak, short: `dsec bench chaos --cycles 5` (the daemon killed with SIGKILL and
//! restarted five times under a mixed workload, supervisors and agents killed, the data dir
//! filled to `ENOSPC` once, the daemon's clock stepped once) must end with every invariant
//! held: nothing orphaned or missing, no acknowledged trajectory record lost or changed, every
//! idempotency key replaying its outcome, every survivor answering. The full soak is
//! `dsec bench chaos --cycles 100` (docs/SPECIFICATION.md).
//!
//! Needs root (namespaces, cgroups, a tmpfs mount); CI runs as root.

use std::process::Command;

use serde_json::Value;

#[test]
fn chaos_soak_keeps_every_invariant() {
    let cycles = 5u64;
    let out = Command::new(env!("CARGO_BIN_EXE_dsec"))
        .args(["bench", "chaos", "--threads", "2", "--cycles"])
        .arg(cycles.to_string())
        .output()
        .expect("run dsec bench chaos");
    let text = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let doc: Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("no JSON report ({e}): {text}\nstderr: {stderr}"));
    let n = |k: &str| doc[k].as_u64().unwrap_or(u64::MAX);
    let ctx = format!("seed {} report: {doc:#}", doc["seed"]);
    assert_eq!(doc["ok"], true, "{ctx}");
    assert!(out.status.success(), "{ctx}");
    assert_eq!(n("cycles"), cycles, "{ctx}");
    assert_eq!(n("restarts"), cycles, "{ctx}");
    assert_eq!(doc["kills"]["daemon"].as_u64(), Some(cycles), "{ctx}");
    for zero in [
        "orphans_found",
        "missing_found",
        "lost_records",
        "changed_records",
        "idempotency_lost",
        "survivors_failed",
        "wrong_answers",
    ] {
        assert_eq!(n(zero), 0, "{zero}: {ctx}");
    }
    for some in [
        "acked_records_checked",
        "idempotency_checked",
        "survivors_checked",
    ] {
        assert!(n(some) > 0, "{some}: {ctx}");
    }
    assert_eq!(doc["enospc"]["serves_without_restart"], true, "{ctx}");
    assert_eq!(
        doc["clock_steps"].as_array().map(Vec::len),
        Some(2),
        "{ctx}"
    );
}
