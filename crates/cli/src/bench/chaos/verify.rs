//! The invariants checked after every restart of the soak's daemon: what the API lists is what
//! is on the machine (no orphan supervisor, spawner, sandbox cgroup, runtime dir, mount or
//! QEMU, and nothing listed missing), every acknowledged trajectory step is in the log byte for
//! byte and replays so, every idempotency key replays its outcome, every surviving sandbox
//! answers an exec.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use dsec_testkit::Http;
use serde_json::{json, Value};

use super::machine::Machine;
use super::workload::{AckedKey, AckedStep, Shared};

/// The tenant the code runner's sandboxes belong to.
const RUN_TENANT: &str = "tn-run";

/// Counts of the checks (summed over the restarts) and what broke.
#[derive(Debug, Default, serde::Serialize)]
pub(super) struct Checks {
    pub(super) acked_records_checked: u64,
    pub(super) replays_checked: u64,
    pub(super) idempotency_checked: u64,
    pub(super) survivors_checked: u64,
    pub(super) pooled_checked: u64,
    pub(super) orphans_found: u64,
    pub(super) missing_found: u64,
    pub(super) lost_records: u64,
    pub(super) changed_records: u64,
    pub(super) idempotency_lost: u64,
    pub(super) survivors_failed: u64,
    /// The first few of every broken invariant, described.
    pub(super) failures: Vec<String>,
}

impl Checks {
    pub(super) fn fail(&mut self, what: String) {
        if self.failures.len() < 40 {
            self.failures.push(what);
        }
    }
}

/// `GET path`, paged by `next_cursor`: every item.
fn list_all(http: &Http, path: &str) -> anyhow::Result<Vec<Value>> {
    let mut out = Vec::new();
    let mut cursor = String::new();
    loop {
        let sep = if path.contains('?') { '&' } else { '?' };
        let (s, v) = http.call(
            "GET",
            &format!("{path}{sep}limit=1000&cursor={cursor}"),
            None,
        )?;
        anyhow::ensure!(s == 200, "GET {path}: {s} {v}");
        out.extend(v["items"].as_array().cloned().unwrap_or_default());
        match v["next_cursor"].as_str() {
            Some(c) => cursor = c.to_owned(),
            None => return Ok(out),
        }
    }
}

/// The sandboxes the API lists (the admin tenant's and the code runner's), by id.
pub(super) fn listed(http: &Http) -> anyhow::Result<BTreeMap<String, Value>> {
    let mut out = BTreeMap::new();
    for path in [
        "/v1/sandboxes".to_owned(),
        format!("/v1/sandboxes?tenant={RUN_TENANT}"),
    ] {
        for v in list_all(http, &path)? {
            if let Some(id) = v["id"].as_str() {
                out.insert(id.to_owned(), v);
            }
        }
    }
    Ok(out)
}

/// The admin's view of sandbox `id` (with `supervisor_pid`, which listings leave out).
pub(super) fn detail(http: &Http, id: &str) -> Option<Value> {
    match http.call("GET", &format!("/v1/sandboxes/{id}"), None) {
        Ok((200, v)) => Some(v),
        _ => None,
    }
}

/// Every sandbox id the daemon has a record of, stopped ones included.
fn recorded(http: &Http) -> anyhow::Result<BTreeSet<String>> {
    let mut out = BTreeSet::new();
    for path in [
        "/v1/sandboxes?state=stopped".to_owned(),
        format!("/v1/sandboxes?tenant={RUN_TENANT}&state=stopped"),
    ] {
        for v in list_all(http, &path)? {
            out.extend(v["id"].as_str().map(str::to_owned));
        }
    }
    Ok(out)
}

/// One comparison of the API with the machine: the disagreements, described.
fn disagreements(
    http: &Http,
    m: &Machine,
    daemon_pid: i32,
    known: &BTreeSet<String>,
) -> anyhow::Result<(Vec<String>, Vec<String>, u64)> {
    let listed = listed(http)?;
    let procs = m.procs();
    let run_dirs = m.run_dirs();
    let mut ids: BTreeSet<String> = known.clone();
    ids.extend(recorded(http)?);
    ids.extend(listed.keys().cloned());
    ids.extend(run_dirs.iter().cloned());
    let cgroups = m.cgroups(&ids);
    let mounts = m.mounts();
    // What is on the machine that the API does not list: a pooled sandbox (no tenant, so in no
    // listing) if the API says so when asked for it, an orphan otherwise.
    let mut on_machine: BTreeSet<String> = run_dirs.clone();
    on_machine.extend(cgroups.iter().cloned());
    let mut orphans = Vec::new();
    let mut pooled = 0u64;
    let listed: BTreeMap<String, Value> = listed
        .into_iter()
        .map(|(id, v)| {
            let v = detail(http, &id).unwrap_or(v);
            (id, v)
        })
        .collect();
    let mut sup_of: BTreeMap<i64, String> = listed
        .iter()
        .filter_map(|(id, v)| Some((v["supervisor_pid"].as_i64()?, id.clone())))
        .collect();
    for id in on_machine.difference(&listed.keys().cloned().collect()) {
        let (s, v) = http.call("GET", &format!("/v1/sandboxes/{id}"), None)?;
        if s == 200
            && v["tenant"].is_null()
            && matches!(v["state"].as_str(), Some("ready" | "creating"))
        {
            pooled += 1;
            if let Some(p) = v["supervisor_pid"].as_i64() {
                sup_of.insert(p, id.clone());
            }
            continue;
        }
        orphans.push(format!(
            "sandbox {id} on the machine (run dir {}, cgroup {}) but not live in the API ({s} {})",
            run_dirs.contains(id),
            cgroups.contains(id),
            v["state"]
        ));
    }
    let spawner_ok = |p: &super::machine::Proc| p.ppid == daemon_pid;
    for p in &procs {
        let bad = match p.comm.as_str() {
            "dsec-sup" => !sup_of.contains_key(&(p.pid as i64)),
            "dsec-spawner" => !spawner_ok(p),
            // Idle pre-built shells belong to the spawner.
            "dsec-shell" => !procs
                .iter()
                .any(|s| s.pid == p.ppid && s.comm == "dsec-spawner" && spawner_ok(s)),
            c if c.starts_with("qemu-system") => true,
            _ => false,
        };
        if bad {
            orphans.push(format!("process {} ({}) parent {}", p.pid, p.comm, p.ppid));
        }
    }
    for mnt in mounts {
        if !listed
            .keys()
            .chain(sup_of.values())
            .any(|id| mnt.contains(id.as_str()))
        {
            orphans.push(format!("mount {mnt}"));
        }
    }
    // Listed and live, but not on the machine.
    let mut missing = Vec::new();
    for (id, v) in &listed {
        if !matches!(v["state"].as_str(), Some("running" | "ready")) {
            continue;
        }
        let sup = v["supervisor_pid"].as_i64().unwrap_or(0) as i32;
        let vm = v["substrate"].as_str().is_some_and(|s| s != "container");
        if !run_dirs.contains(id) || (!vm && !m.is_our_supervisor(sup)) {
            missing.push(format!(
                "{id} listed {} but not on the machine: {v}",
                v["state"]
            ));
        }
    }
    Ok((orphans, missing, pooled))
}

/// The API against the machine, again until they agree (pool refills and teardown after a
/// restart take a moment) or `settle` passes; then what still disagrees counts.
pub(super) fn machine(shared: &Shared, m: &Machine, daemon_pid: i32, c: &mut Checks) {
    let http = shared.client();
    let known = shared.ledger().ids.clone();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match disagreements(&http, m, daemon_pid, &known) {
            Ok((o, mi, pooled)) if o.is_empty() && mi.is_empty() => {
                c.pooled_checked += pooled;
                return;
            }
            Ok((o, mi, _)) if Instant::now() > deadline => {
                c.orphans_found += o.len() as u64;
                c.missing_found += mi.len() as u64;
                for f in o.into_iter().chain(mi) {
                    c.fail(f);
                }
                return;
            }
            Err(e) if Instant::now() > deadline => {
                c.fail(format!("list the sandboxes: {e:#}"));
                return;
            }
            _ => std::thread::sleep(Duration::from_millis(250)),
        }
    }
}

/// Every listed running sandbox of the admin tenant answers an exec.
pub(super) fn survivors(shared: &Shared, c: &mut Checks) {
    let http = shared.client();
    let Ok(all) = listed(&http) else {
        c.fail("list the sandboxes for the survivor check".into());
        return;
    };
    for (id, v) in all {
        if v["state"] != "running" || v["tenant"] == RUN_TENANT {
            continue;
        }
        c.survivors_checked += 1;
        let body = json!({"shell": "echo alive"});
        let r = http.call("POST", &format!("/v1/sandboxes/{id}/exec"), Some(&body));
        match r {
            Ok((200, v)) if v["stdout"]["data"] == "alive\n" => {}
            other => {
                c.survivors_failed += 1;
                c.fail(format!("survivor {id} did not answer an exec: {other:?}"));
            }
        }
    }
}

/// Sends `method path body` again (with `key` as its idempotency key).
fn resend(
    http: &Http,
    method: &str,
    path: &str,
    body: &[u8],
    key: Option<&str>,
) -> Option<dsec_testkit::Reply> {
    let headers: Vec<(&str, &str)> = key.map(|k| ("Idempotency-Key", k)).into_iter().collect();
    http.send(method, path, Some(body), &headers).ok()
}

/// Every acknowledged step is in its trajectory's log with the answer the client got, and
/// those of live sandboxes (`replay` of them) replay byte for byte.
pub(super) fn records(
    shared: &Shared,
    steps: &[AckedStep],
    replay: &BTreeSet<usize>,
    c: &mut Checks,
) {
    let http = shared.client();
    let mut by_traj: BTreeMap<&str, Vec<&AckedStep>> = BTreeMap::new();
    for s in steps {
        by_traj.entry(s.trajectory.as_str()).or_default().push(s);
    }
    for (t, acked) in by_traj {
        let log = match trajectory_log(&http, t) {
            Ok(l) => l,
            Err(e) => {
                c.lost_records += acked.len() as u64;
                c.fail(format!("trajectory {t}: {e:#}"));
                continue;
            }
        };
        for a in acked {
            c.acked_records_checked += 1;
            let results: Vec<&Value> = log
                .iter()
                .filter(|r| r["kind"] == "result" && r["step"].as_u64() == Some(a.step))
                .map(|r| &r["record"])
                .collect();
            let answer = String::from_utf8_lossy(&a.answer);
            let same = |r: &&Value| {
                r["http_status"].as_u64() == Some(a.status as u64) && r["body"] == answer.as_ref()
            };
            if results.is_empty() {
                c.lost_records += 1;
                c.fail(format!("step {} of {t}: no result record", a.step));
            } else if !results.iter().any(same) {
                c.changed_records += 1;
                c.fail(format!(
                    "step {} of {t}: logged {:?}, answered {answer}",
                    a.step, results
                ));
            }
        }
    }
    for (_, a) in steps.iter().enumerate().filter(|(i, _)| replay.contains(i)) {
        c.replays_checked += 1;
        match resend(&http, a.method, &a.path, &a.body, None) {
            Some(r)
                if r.status == a.status
                    && r.body == a.answer
                    && r.headers.get("dsec-replayed").is_some() => {}
            Some(r) => {
                c.changed_records += 1;
                c.fail(format!(
                    "step {} of {} replayed {} {} (was {} {})",
                    a.step,
                    a.trajectory,
                    r.status,
                    String::from_utf8_lossy(&r.body),
                    a.status,
                    String::from_utf8_lossy(&a.answer)
                ));
            }
            None => c.fail(format!(
                "step {} of {}: no answer to the replay",
                a.step, a.trajectory
            )),
        }
    }
}

/// Every record of trajectory `t`.
fn trajectory_log(http: &Http, t: &str) -> anyhow::Result<Vec<Value>> {
    let mut out = Vec::new();
    let mut from = 0u64;
    loop {
        let path = format!("/v1/trajectories/{t}/records?from_step={from}&limit=1000");
        let (s, v) = http.call("GET", &path, None)?;
        anyhow::ensure!(s == 200, "{path}: {s} {v}");
        out.extend(v["items"].as_array().cloned().unwrap_or_default());
        match v["next_from_step"].as_u64() {
            Some(n) if n > from => from = n,
            _ => return Ok(out),
        }
    }
}

/// Every acknowledged idempotency key replays its outcome unchanged.
pub(super) fn keys(shared: &Shared, keys: &[AckedKey], c: &mut Checks) {
    let http = shared.client();
    for k in keys {
        c.idempotency_checked += 1;
        match resend(&http, k.method, &k.path, &k.body, Some(&k.key)) {
            Some(r)
                if r.status == k.status
                    && r.body == k.answer
                    && r.headers.get("idempotent-replayed").is_some() => {}
            other => {
                c.idempotency_lost += 1;
                c.fail(format!(
                    "key {} ({} {}, was {} {}): now {:?}",
                    k.key,
                    k.method,
                    k.path,
                    k.status,
                    String::from_utf8_lossy(&k.answer),
                    other.map(|r| (r.status, String::from_utf8_lossy(&r.body).into_owned()))
                ));
            }
        }
    }
}
