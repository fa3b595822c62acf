//! Sandbox limits through `dsec server`, `dsec sandbox create` and `dsec run`: limits outside
//! what the kernel takes or above what the machine has are refused as `invalid_request` before
//! anything is made; a create that fails later removes what it made; a restart removes the
//! sandbox cgroups left without a sandbox.
//!
//! Needs root (namespaces, cgroups, mounts); CI runs as root. Other dsec daemons may run on the
//! machine meanwhile, so cgroup checks look at what appeared during a test, not at the total.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime};

use dsec_sys::cgroup::{CgroupLimits, CgroupManager};
use dsec_testkit as testkit;
use serde_json::{json, Value};

/// The tests of this file run one at a time: one makes sandbox cgroups of no daemon, which the
/// others would take for leaks, and their daemons' start-up sweeps would remove.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

testkit::daemon_type!(
    /// A daemon of these tests.
    struct Daemon
);

impl Daemon {
    fn start(data: &Path, run: &Path) -> Self {
        let d = testkit::Server::test(env!("CARGO_BIN_EXE_dsec"), data, run)
            .args(&["--pool-max", "0", "--drain-seconds", "5"])
            .start()
            .expect("start dsec server");
        Self(d)
    }

    /// Every sandbox record of the node, stopped ones included.
    fn records(&self) -> Vec<Value> {
        let mut out = Vec::new();
        for state in [
            "creating",
            "ready",
            "running",
            "resetting",
            "stopping",
            "stopped",
            "failed",
        ] {
            let (s, v) = self.req("GET", &format!("/v1/sandboxes?state={state}"), None);
            assert_eq!(s, 200, "list {state}: {v}");
            out.extend(v["items"].as_array().cloned().unwrap_or_default());
        }
        out
    }

    fn stop(mut self) {
        // Answering means it serves, its SIGTERM handler included.
        let (s, _) = self.req("GET", "/readyz", None);
        assert_eq!(s, 200);
        self.0.stop();
    }
}

fn manager() -> CgroupManager {
    CgroupManager::detect("dsec").expect("cgroups (tests run as root)")
}

/// Sandbox cgroups on this host, any hierarchy.
fn sandbox_cgroups() -> BTreeSet<String> {
    manager()
        .list()
        .expect("list cgroups")
        .into_iter()
        .filter(|n| n.starts_with("sb-"))
        .collect()
}

/// Sandbox cgroups that appeared since `before` and hold no process: what a failed create
/// left (a live sandbox of another daemon on the machine always has processes).
fn leaked_since(before: &BTreeSet<String>) -> Vec<String> {
    let mgr = manager();
    sandbox_cgroups()
        .difference(before)
        .filter(|n| mgr.open(n).is_some_and(|cg| cg.is_empty().unwrap_or(false)))
        .cloned()
        .collect()
}

fn mem_total() -> u64 {
    let meminfo = std::fs::read_to_string("/proc/meminfo").expect("meminfo");
    dsec_node::capacity::parse_mem_total(&meminfo).expect("MemTotal")
}

fn dsec(args: &[&str], env: &[(&str, &str)]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_dsec"))
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .output()
        .expect("run dsec");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `{"memory_max": 2^64-1}` used to pass validation, fail in the cgroup write (503
/// `resource_exhausted`) and leave the sandbox's cgroup in every hierarchy; `999999T` used to
/// be accepted. Both, and every other limit beyond the kernel or the machine, are
/// `invalid_request` naming the limit, with nothing recorded or made.
#[test]
fn limits_beyond_the_kernel_or_the_machine_are_invalid_and_make_nothing() {
    let _serial = serial();
    let (data, run, _dirs) = testkit::dirs_removed_on_drop("dlm", "bad");
    let d = Daemon::start(&data, &run);
    let cap = dsec_node::capacity::NodeCapacity::detect().expect("capacity");
    let mem = mem_total();
    let tasks = cap.pid_max.min(cap.threads_max);
    let before = sandbox_cgroups();
    let cases: Vec<(Value, &str, Vec<String>)> = vec![
        (json!({"memory_max": u64::MAX}), "memory_max", vec![]),
        (
            json!({"memory_max": 999_999u64 << 40}),
            "memory_max",
            vec![
                (999_999u64 << 40).to_string(),
                mem.to_string(),
                "MemTotal".into(),
            ],
        ),
        (
            json!({"disk_bytes": mem + 1}),
            "disk_bytes",
            vec![(mem + 1).to_string(), mem.to_string()],
        ),
        (
            json!({"cpu_max": f64::from(cap.cpus) + 1.0}),
            "cpu_max",
            vec![format!("at most {} CPUs", cap.cpus)],
        ),
        (
            json!({"pids_max": tasks + 1}),
            "pids_max",
            // Above 2^20 the range every node has answers first.
            if tasks < 1 << 20 {
                vec![format!("at most {tasks} tasks")]
            } else {
                vec!["8..=1048576".into()]
            },
        ),
        (json!({"memory_high": 0}), "memory_high", vec![]),
    ];
    for (limits, name, details) in &cases {
        let (s, v) = d.req("POST", "/v1/sandboxes", Some(&json!({ "limits": limits })));
        assert_eq!(
            (s, v["code"].as_str()),
            (400, Some("invalid_request")),
            "{limits}: {v}"
        );
        let detail = v["detail"].as_str().unwrap_or_default();
        assert!(detail.contains(name), "{limits}: {detail}");
        for want in details {
            assert!(
                detail.contains(want.as_str()),
                "{limits}: {want:?} in {detail}"
            );
        }
    }
    // The CLI says the same with its usage exit code.
    let env = [
        ("DSEC_URL", d.url.as_str()),
        ("DSEC_API_KEY", d.key.as_str()),
    ];
    let (code, stderr) = dsec(&["sandbox", "create", "--memory", "999999T"], &env);
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("memory_max") && stderr.contains("MemTotal"),
        "{stderr}"
    );
    assert_eq!(d.records(), Vec::<Value>::new(), "nothing recorded");
    assert_eq!(d.run_dirs(), BTreeSet::<String>::new(), "no runtime dir");
    assert_eq!(leaked_since(&before), Vec::<String>::new(), "no cgroup");
    // At the machine's edge a sandbox is made.
    let (s, v) = d.req(
        "POST",
        "/v1/sandboxes",
        Some(&json!({"limits": {"memory_max": mem, "cpu_max": f64::from(cap.cpus)}})),
    );
    assert_eq!(s, 201, "{v}");
    let id = v["id"].as_str().expect("id");
    let (s, v) = d.req("DELETE", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(s, 200, "{v}");
    d.stop();
}

/// A create that passes validation and fails in the supervisor (its template's layer is gone)
/// leaves neither cgroup nor runtime dir; its record is closed with the reason.
#[test]
fn a_create_that_fails_after_validation_leaves_nothing() {
    let _serial = serial();
    let (data, run, dirs) = testkit::dirs_removed_on_drop("dlm", "fail");
    let d = Daemon::start(&data, &run);
    let tarball = testkit::rootfs_tarball(&dirs.0, "rootfs", "broken\n");
    let tar = std::fs::read(&tarball).expect("tarball");
    let resp = d
        .http()
        .send("POST", "/v1/templates?name=broken", Some(&tar), &[])
        .expect("import");
    assert_eq!(resp.status, 201);
    // Its one layer disappears from under the store.
    let layers = data.join("layers");
    let mut removed = 0;
    for e in std::fs::read_dir(&layers).expect("layers").flatten() {
        if e.path().join("etc/motd").is_file() {
            std::fs::remove_dir_all(e.path()).expect("remove the layer");
            removed += 1;
        }
    }
    assert_eq!(removed, 1, "the template's layer in {}", layers.display());
    let before = sandbox_cgroups();
    for _ in 0..3 {
        let (s, v) = d.req(
            "POST",
            "/v1/sandboxes",
            Some(&json!({"template": "broken"})),
        );
        assert!(s >= 500, "the create fails: {s} {v}");
    }
    assert_eq!(d.run_dirs(), BTreeSet::<String>::new(), "no runtime dir");
    assert_eq!(leaked_since(&before), Vec::<String>::new(), "no cgroup");
    let records = d.records();
    assert_eq!(records.len(), 3, "{records:?}");
    for r in &records {
        assert_eq!(r["state"], "stopped", "{r}");
        assert!(r["error"].as_str().is_some_and(|e| !e.is_empty()), "{r}");
        assert!(
            manager().open(r["id"].as_str().expect("id")).is_none(),
            "{r}"
        );
    }
    // The host template still works.
    let (s, v) = d.req("POST", "/v1/sandboxes", Some(&json!({})));
    assert_eq!(s, 201, "{v}");
    let (s, _) = d.req(
        "DELETE",
        &format!("/v1/sandboxes/{}", v["id"].as_str().expect("id")),
        None,
    );
    assert_eq!(s, 200);
    d.stop();
}

/// Removes a test cgroup (and kills what is in it) when dropped.
struct CgGuard(String);

impl Drop for CgGuard {
    fn drop(&mut self) {
        if let Some(cg) = manager().open(&self.0) {
            let _ = cg.kill_all();
            let _ = cg.remove();
        }
    }
}

fn test_cgroup(tag: u64, age: Duration) -> CgGuard {
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .expect("clock")
        .subsec_nanos();
    let id = format!(
        "sb-{:016x}",
        (u64::from(std::process::id()) << 32 | u64::from(nanos)) ^ tag << 60
    );
    let cg = manager()
        .create(&id, &CgroupLimits::default())
        .expect("make a sandbox cgroup");
    let at = SystemTime::now() - age;
    for dir in cg.dirs() {
        std::fs::File::open(&dir)
            .and_then(|f| f.set_modified(at))
            .expect("backdate the cgroup");
    }
    CgGuard(id)
}

/// A restart removes the sandbox cgroups no sandbox has (a create cut short): empty ones older
/// than the grace period, in every hierarchy. It leaves alone one that is being set up (young)
/// and one with processes (a sandbox of another daemon on this host).
#[test]
fn a_restart_removes_sandbox_cgroups_without_a_sandbox() {
    let _serial = serial();
    let (data, run, _dirs) = testkit::dirs_removed_on_drop("dlm", "orph");
    let d = Daemon::start(&data, &run);
    d.stop();
    let orphan = test_cgroup(1, Duration::from_secs(600));
    let young = test_cgroup(2, Duration::ZERO);
    let busy = test_cgroup(3, Duration::from_secs(600));
    let mut sleeper = Command::new("sleep").arg("300").spawn().expect("sleep");
    manager()
        .open(&busy.0)
        .expect("busy cgroup")
        .attach(sleeper.id() as i32)
        .expect("attach");
    let dirs = manager().open(&orphan.0).expect("orphan").dirs();
    let d = Daemon::start(&data, &run);
    let (_, ready) = d.req("GET", "/readyz", None);
    let orphans = ready["recovery"]["orphan_cgroups"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert!(orphans.contains(&json!(orphan.0)), "{ready}");
    assert!(
        dirs.iter().all(|p| !p.exists()),
        "gone in every hierarchy: {dirs:?}"
    );
    assert!(manager().open(&young.0).is_some(), "a young cgroup stays");
    assert!(manager().open(&busy.0).is_some(), "a cgroup in use stays");
    assert!(
        sleeper.try_wait().expect("try_wait").is_none(),
        "its process lives"
    );
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    d.stop();
}

/// `dsec run` refuses limits beyond the machine before it makes anything, with the usage
/// exit code.
#[test]
fn dsec_run_refuses_limits_beyond_the_machine() {
    let _serial = serial();
    let (data, run, _dirs) = testkit::dirs_removed_on_drop("dlm", "run");
    let (d, r) = (data.display().to_string(), run.display().to_string());
    let base = ["--data-dir", d.as_str(), "--run-dir", r.as_str(), "run"];
    let cap = dsec_node::capacity::NodeCapacity::detect().expect("capacity");
    let cpus = (cap.cpus + 1).to_string();
    for (flags, name) in [
        (vec!["--memory", "999999T"], "memory_max"),
        (vec!["--disk", "999999T"], "disk_bytes"),
        (vec!["--cpus", cpus.as_str()], "cpu_max"),
    ] {
        let args: Vec<&str> = base
            .iter()
            .copied()
            .chain(flags.iter().copied())
            .chain(["--", "true"])
            .collect();
        let (code, stderr) = dsec(&args, &[]);
        assert_eq!(code, 2, "{flags:?}: {stderr}");
        assert!(
            stderr.contains(name) && stderr.contains("at most"),
            "{flags:?}: {stderr}"
        );
    }
    assert!(!run.exists(), "nothing made in {}", run.display());
}
