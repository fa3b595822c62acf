//! `dsec server` under faults (TESTING.md F-01, F-02, F-03, F-04, F-05, F-13, F-15), driven over
//! HTTP like any client. Every test checks afterwards that what the API lists is what is on the
//! machine: the runtime dirs and cgroups of its sandboxes, and nothing else.
//!
//! Needs root (namespaces, cgroups, mounts); CI runs as root.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use dsec_testkit as testkit;
use serde_json::{json, Value};

testkit::daemon_type!(
    /// A daemon of these tests, with the checks they end on.
    struct Daemon
);

impl Daemon {
    fn start(data: &Path, run: &Path, env: &[(&str, &str)]) -> Self {
        Self::start_with(data, run, env, &["--pool-max", "0"])
    }

    /// A daemon in fresh directories named after `test`, with the default arguments.
    fn fresh(test: &str) -> Self {
        let (data, run) = testkit::dirs("dst", test);
        Self::start(&data, &run, &[])
    }

    fn start_with(data: &Path, run: &Path, env: &[(&str, &str)], args: &[&str]) -> Self {
        let d = testkit::Server::test(env!("CARGO_BIN_EXE_dsec"), data, run)
            .args(&["--drain-seconds", "10"])
            .args(args)
            .envs(env)
            .start()
            .expect("start dsec server");
        Self(d)
    }

    fn req(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
        idem: Option<&str>,
    ) -> (u16, Value) {
        self.req_raw(method, path, body.map(|b| b.to_string().into_bytes()), idem)
    }

    fn req_raw(
        &self,
        method: &str,
        path: &str,
        body: Option<Vec<u8>>,
        idem: Option<&str>,
    ) -> (u16, Value) {
        let headers: Vec<(&str, &str)> = idem.map(|k| ("Idempotency-Key", k)).into_iter().collect();
        match self.http().send(method, path, body.as_deref(), &headers) {
            Ok(r) => (r.status, r.json()),
            Err(e) => (0, json!({"transport_error": e.to_string()})),
        }
    }

    fn metrics(&self) -> String {
        self.http().text("/metrics")
    }

    fn create(&self, idem: Option<&str>) -> Value {
        let (s, v) = self.req("POST", "/v1/sandboxes", Some(json!({})), idem);
        assert_eq!(s, 201, "create: {v}");
        v
    }

    /// The id of a sandbox created with `spec`.
    fn create_spec(&self, spec: Value) -> String {
        let (s, v) = self.req("POST", "/v1/sandboxes", Some(spec), None);
        assert_eq!(s, 201, "create: {v}");
        v["id"].as_str().expect("id").to_owned()
    }

    /// Creates `count` sandboxes labelled `labels` in one batch; returns the answer.
    fn batch(&self, count: u64, labels: Value) -> Value {
        let body = json!({"count": count, "spec": {"labels": labels}});
        let (s, v) = self.req("POST", "/v1/sandboxes/batch", Some(body), None);
        assert_eq!(s, 200, "{v}");
        v
    }

    fn exec_ok(&self, id: &str, script: &str) -> String {
        let (s, v) = self.req(
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            Some(json!({"shell": script})),
            None,
        );
        assert_eq!(s, 200, "exec: {v}");
        assert_eq!(v["status"], "ok", "exec: {v}");
        v["stdout"]["data"].as_str().unwrap_or_default().to_owned()
    }

    /// Ids the API lists (every state but stopped).
    fn listed(&self) -> BTreeSet<String> {
        let mut out = BTreeSet::new();
        let mut cursor = String::new();
        loop {
            let (s, v) = self.req(
                "GET",
                &format!("/v1/sandboxes?limit=1000&cursor={cursor}"),
                None,
                None,
            );
            assert_eq!(s, 200, "list: {v}");
            for it in v["items"].as_array().expect("items") {
                out.insert(it["id"].as_str().expect("id").to_owned());
            }
            match v["next_cursor"].as_str() {
                Some(c) => cursor = c.to_owned(),
                None => return out,
            }
        }
    }

    /// Sandboxes on the machine for this node: runtime dirs, and cgroups of those ids or of
    /// ids the API knows.
    fn on_machine(&self, known: &BTreeSet<String>) -> BTreeSet<String> {
        let mut out = self.run_dirs();
        let cgroups = cgroups();
        for id in known.iter().chain(out.clone().iter()) {
            if cgroups.contains(id) {
                out.insert(id.clone());
            }
        }
        out
    }

    fn assert_converged(&self, ctx: &str) -> BTreeSet<String> {
        let listed = self.listed();
        let machine = self.on_machine(&listed);
        assert_eq!(listed, machine, "{ctx}: API list == what is on the machine");
        listed
    }

    /// Destroys every sandbox through the API and stops the daemon; checks nothing is left.
    fn finish(mut self) {
        for id in self.listed() {
            let (s, v) = self.req("DELETE", &format!("/v1/sandboxes/{id}"), None, None);
            assert_eq!(s, 200, "delete {id}: {v}");
        }
        // Pool surplus is destroyed in the background: give it a moment.
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut left = self.on_machine(&BTreeSet::new());
        while !left.is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
            left = self.on_machine(&BTreeSet::new());
        }
        assert!(left.is_empty(), "left on the machine: {left:?}");
        self.stop();
        self.remove_dirs();
    }
}

/// Sandbox cgroup names on this host (every hierarchy).
fn cgroups() -> BTreeSet<String> {
    dsec_sys::cgroup::CgroupManager::detect("dsec")
        .and_then(|m| m.list())
        .map(|l| l.into_iter().collect())
        .unwrap_or_default()
}

#[test]
fn f01_kill9_at_each_create_step_then_retry_with_the_same_key() {
    for point in [
        "create:before_launch",
        "create:after_launch",
        "create:after_ready",
        "create:before_answer",
    ] {
        let (data, run) = testkit::dirs("dst", "f01");
        let mut d = Daemon::start(&data, &run, &[("DSEC_FAILPOINT", point)]);
        let key = format!("f01-{point}");
        let (s, v) = d.req("POST", "/v1/sandboxes", Some(json!({})), Some(&key));
        assert_eq!(s, 0, "{point}: the daemon died before answering: {v}");
        let st = d.child.wait().expect("wait");
        assert!(!st.success(), "{point}: killed");
        let d2 = Daemon::start(&data, &run, &[]);
        // Whatever the crash left is either running and recorded, or gone.
        d2.assert_converged(point);
        let before = d2.listed();
        let v = d2.create(Some(&key));
        let id = v["id"].as_str().expect("id").to_owned();
        assert_eq!(v["state"], "running", "{point}: {v}");
        if !before.is_empty() {
            assert_eq!(
                before,
                BTreeSet::from([id.clone()]),
                "{point}: the retry returns the sandbox the crashed create made"
            );
        }
        assert_eq!(
            d2.listed(),
            BTreeSet::from([id.clone()]),
            "{point}: one sandbox"
        );
        assert_eq!(d2.exec_ok(&id, "echo ok"), "ok\n");
        d2.assert_converged(point);
        drop(d);
        d2.finish();
    }
}

#[test]
fn f02_kill9_six_times_with_50_sandboxes() {
    let (data, run) = testkit::dirs("dst", "f02");
    let mut d = Daemon::start(&data, &run, &[]);
    let v = d.batch(50, json!({"set": "f02"}));
    let made: BTreeSet<String> = v["items"]
        .as_array()
        .expect("items")
        .iter()
        .map(|it| {
            assert_eq!(it["ok"], true, "{it}");
            it["sandbox"]["id"].as_str().expect("id").to_owned()
        })
        .collect();
    assert_eq!(made.len(), 50);
    let first = made.iter().next().expect("one").clone();
    d.exec_ok(&first, "echo kept > /tmp/mark");
    for round in 0..6 {
        d.kill9();
        d = Daemon::start(&data, &run, &[]);
        let listed = d.assert_converged(&format!("round {round}"));
        assert_eq!(listed, made, "round {round}: none lost");
        assert_eq!(
            d.exec_ok(&first, "cat /tmp/mark"),
            "kept\n",
            "state survives"
        );
    }
    let (s, v) = d.req(
        "POST",
        "/v1/sandboxes/batch-delete",
        Some(json!({"labels": {"set": "f02"}})),
        None,
    );
    assert_eq!(s, 200, "{v}");
    assert!(v["items"]
        .as_array()
        .expect("items")
        .iter()
        .all(|i| i["ok"] == true));
    d.finish();
}

#[test]
fn f03_killed_supervisor_is_reaped_and_recorded() {
    let d = Daemon::fresh("f03");
    let id = d.create(None)["id"].as_str().expect("id").to_owned();
    let (_, v) = d.req("GET", &format!("/v1/sandboxes/{id}"), None, None);
    let sup = v["supervisor_pid"]
        .as_i64()
        .expect("the admin sees the supervisor pid");
    let pid = rustix::process::Pid::from_raw(sup as i32).expect("pid");
    rustix::process::kill_process(pid, rustix::process::Signal::KILL).expect("kill supervisor");
    let deadline = Instant::now() + Duration::from_secs(10);
    let v = loop {
        let (_, v) = d.req(
            "GET",
            &format!("/v1/sandboxes/{id}?wait=stopped&timeout=2000"),
            None,
            None,
        );
        if v["state"] == "stopped" || Instant::now() > deadline {
            break v;
        }
    };
    assert_eq!(v["state"], "stopped", "{v}");
    assert!(
        v["error"].as_str().unwrap_or_default().contains("died"),
        "the record says why: {v}"
    );
    assert!(d.on_machine(&BTreeSet::from([id])).is_empty());
    d.finish();
}

#[test]
fn f04_sigterm_drains() {
    let (data, run) = testkit::dirs("dst", "f04");
    let mut d = Daemon::start(&data, &run, &[]);
    let id = d.create(None)["id"].as_str().expect("id").to_owned();
    let path = format!("/v1/sandboxes/{id}/exec");
    let http = d.http().clone();
    let slow = std::thread::spawn(move || {
        let (_, v) = http
            .call(
                "POST",
                &path,
                Some(&json!({"shell": "sleep 1.5; echo done"})),
            )
            .expect("the in-flight exec is answered");
        v
    });
    // Wait until the exec is in flight (a loaded machine may take a while to send it).
    let deadline = Instant::now() + Duration::from_secs(10);
    while !d.metrics().contains("dsec_execs_total 1") {
        assert!(Instant::now() < deadline, "the exec reached the daemon");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(100));
    let t0 = Instant::now();
    d.sigterm();
    std::thread::sleep(Duration::from_millis(200));
    let (s, v) = d.req("POST", "/v1/sandboxes", Some(json!({})), None);
    assert_eq!(s, 503, "no new creates while draining: {v}");
    assert_eq!(v["code"], "draining");
    let v = slow.join().expect("join");
    assert_eq!(
        v["stdout"]["data"], "done\n",
        "in-flight work finished: {v}"
    );
    let st = d.child.wait().expect("wait");
    assert!(st.success(), "exit 0: {st:?}");
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "within the deadline"
    );
    // The sandbox outlived the daemon; the next start adopts it.
    let d = Daemon::start(&data, &run, &[]);
    assert_eq!(d.exec_ok(&id, "echo back"), "back\n");
    d.finish();
}

#[test]
fn f05_full_state_disk_is_resource_exhausted() {
    let (data, run) = testkit::dirs("dst", "f05");
    std::fs::create_dir_all(&data).expect("data dir");
    let st = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=8m", "dsec-f05"])
        .arg(&data)
        .status()
        .expect("mount");
    assert!(st.success(), "mount a small tmpfs as the data dir");
    let d = Daemon::start(&data, &run, &[]);
    let id = d.create(None)["id"].as_str().expect("id").to_owned();
    // Fill the disk to the last byte.
    let filler = data.join("filler");
    let mut f = std::fs::File::create(&filler).expect("filler");
    let chunk = vec![7u8; 64 << 10];
    while std::io::Write::write_all(&mut f, &chunk).is_ok() {}
    let _ = std::io::Write::write_all(&mut f, &[7u8]);
    drop(f);
    let mut codes = BTreeSet::new();
    for _ in 0..5 {
        let (s, v) = d.req(
            "POST",
            "/v1/sandboxes",
            Some(json!({"labels": {"x": "y"}})),
            None,
        );
        codes.insert((s, v["code"].as_str().unwrap_or_default().to_owned()));
    }
    assert!(
        codes.contains(&(503, "resource_exhausted".into())),
        "a full state disk answers resource_exhausted: {codes:?}"
    );
    // The node still serves, and nothing half-made is left running unrecorded.
    assert_eq!(d.exec_ok(&id, "echo alive"), "alive\n");
    // A step that cannot be logged is refused, never run unlogged; the log then takes nothing
    // more until the node restarts, and the node says so: not ready, and why.
    let (s, v) = d.req(
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(json!({"argv": ["/bin/true"], "trajectory": "f05", "step": 1})),
        None,
    );
    assert_eq!(
        (s, v["code"].as_str()),
        (503, Some("resource_exhausted")),
        "{v}"
    );
    let (s, ready) = d.req("GET", "/readyz", None, None);
    assert_eq!(s, 503, "{ready}");
    assert!(ready["trajectory_log_failed"].is_string(), "{ready}");
    std::fs::remove_file(&filler).expect("free the disk");
    let v = d.create(None);
    assert_eq!(v["state"], "running");
    d.assert_converged("after the disk was freed");
    let base = data.parent().map(Path::to_path_buf);
    d.finish();
    let _ = Command::new("umount").arg(&data).status();
    if let Some(b) = base {
        let _ = std::fs::remove_dir_all(b);
    }
}

#[test]
fn f13_retry_storm_with_one_key_has_one_effect() {
    let d = Daemon::fresh("f13");
    let ids: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..16)
            .map(|_| {
                s.spawn(|| {
                    let (st, v) = d.req("POST", "/v1/sandboxes", Some(json!({})), Some("storm"));
                    assert_eq!(st, 201, "{v}");
                    v["id"].as_str().expect("id").to_owned()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("join")).collect()
    });
    let unique: BTreeSet<String> = ids.into_iter().collect();
    assert_eq!(unique.len(), 1, "one sandbox for one key: {unique:?}");
    assert_eq!(d.listed(), unique);
    let (s, v) = d.req(
        "POST",
        "/v1/sandboxes",
        Some(json!({"ttl_ms": 5})),
        Some("storm"),
    );
    assert_eq!((s, v["code"].clone()), (409, json!("idempotency_conflict")));
    d.finish();
}

#[test]
fn f15_destroy_during_create_wins() {
    let (data, run) = testkit::dirs("dst", "f15");
    let d = Daemon::start(
        &data,
        &run,
        &[("DSEC_FAILPOINT", "create:launching=sleep:800")],
    );
    std::thread::scope(|s| {
        let creating = s.spawn(|| d.req("POST", "/v1/sandboxes", Some(json!({})), None));
        let deadline = Instant::now() + Duration::from_secs(5);
        let id = loop {
            let (_, v) = d.req("GET", "/v1/sandboxes?state=creating", None, None);
            if let Some(id) = v["items"][0]["id"].as_str() {
                break id.to_owned();
            }
            assert!(Instant::now() < deadline, "the create shows up as creating");
            std::thread::sleep(Duration::from_millis(20));
        };
        let (s, v) = d.req("DELETE", &format!("/v1/sandboxes/{id}"), None, None);
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["state"], "stopped");
        let (s, v) = creating.join().expect("join");
        assert_eq!(
            (s, v["code"].clone()),
            (409, json!("invalid_transition")),
            "{v}"
        );
        assert!(
            d.on_machine(&BTreeSet::from([id])).is_empty(),
            "nothing orphaned"
        );
    });
    d.finish();
}

#[test]
fn ttl_and_lease_expire_on_the_node() {
    let d = Daemon::fresh("ttl");
    let a = d.create_spec(json!({"ttl_ms": 1500}));
    let b = d.create_spec(json!({"lease_ms": 1500}));
    let c = d.create_spec(json!({"lease_ms": 1500}));
    for _ in 0..6 {
        std::thread::sleep(Duration::from_millis(500));
        let (s, v) = d.req(
            "POST",
            &format!("/v1/sandboxes/{c}/lease"),
            Some(json!({})),
            None,
        );
        if s != 200 {
            let (_, now) = d.req("GET", &format!("/v1/sandboxes/{c}"), None, None);
            panic!("heartbeat: {v}; the sandbox: {now}");
        }
    }
    let state =
        |id: &str| d.req("GET", &format!("/v1/sandboxes/{id}"), None, None).1["state"].clone();
    assert_eq!(state(&a), "stopped", "TTL passed");
    assert_eq!(state(&b), "stopped", "lease not renewed");
    assert_eq!(state(&c), "running", "lease renewed");
    d.assert_converged("after expiry");
    d.finish();
}

#[test]
fn tenants_are_isolated_and_quotas_hold() {
    let d = Daemon::fresh("ten");
    let (s, t) = d.req(
        "POST",
        "/v1/tenants",
        Some(json!({"name": "team-b", "max_sandboxes": 1})),
        None,
    );
    assert_eq!(s, 201, "{t}");
    let b_key = t["api_key"].as_str().expect("key").to_owned();
    let a_id = d.create(None)["id"].as_str().expect("id").to_owned();
    let as_b = d.http().with_key(None);
    let bearer = format!("Bearer {b_key}");
    let b = |method: &str, path: &str, body: Option<Value>| {
        let body = match method {
            "GET" | "DELETE" => None,
            _ => Some(body.unwrap_or(json!({})).to_string().into_bytes()),
        };
        let r = as_b
            .send(method, path, body.as_deref(), &[("Authorization", &bearer)])
            .expect("http");
        (r.status, r.json())
    };
    for (m, p) in [
        ("GET", format!("/v1/sandboxes/{a_id}")),
        ("DELETE", format!("/v1/sandboxes/{a_id}")),
        ("POST", format!("/v1/sandboxes/{a_id}/exec")),
    ] {
        let (s, v) = b(m, &p, Some(json!({"argv": ["true"]})));
        assert_eq!(
            (s, v["code"].clone()),
            (404, json!("sandbox_not_found")),
            "{m} {p}: {v}"
        );
    }
    let (s, v) = b("GET", "/v1/sandboxes", None);
    assert_eq!(s, 200);
    assert_eq!(
        v["items"].as_array().map(Vec::len),
        Some(0),
        "B sees none of A's: {v}"
    );
    let (s, v) = b("POST", "/v1/sandboxes", None);
    assert_eq!(s, 201, "{v}");
    let b_id = v["id"].as_str().expect("id").to_owned();
    let (s, v) = b("POST", "/v1/sandboxes", None);
    assert_eq!(
        (s, v["code"].clone()),
        (429, json!("quota_exceeded")),
        "{v}"
    );
    let (s, _) = b("GET", "/v1/tenants", None);
    assert_eq!(s, 403, "only the admin lists tenants");
    let (s, _) = b(
        "GET",
        &format!("/v1/sandboxes?tenant={}", t["id"].as_str().unwrap_or("")),
        None,
    );
    assert_eq!(s, 403, "only the admin lists another tenant's sandboxes");
    // The admin (operator) sees and can inspect B's sandbox.
    let (s, v) = d.req(
        "GET",
        &format!("/v1/sandboxes?tenant={}", t["id"].as_str().unwrap_or("")),
        None,
        None,
    );
    assert_eq!(s, 200);
    assert_eq!(v["items"][0]["id"], b_id.as_str(), "{v}");
    let (s, _) = d.req("GET", &format!("/v1/sandboxes/{b_id}"), None, None);
    assert_eq!(s, 200);
    let (s, _) = b("DELETE", &format!("/v1/sandboxes/{b_id}"), None);
    assert_eq!(s, 200);
    d.finish();
}

#[test]
fn bad_requests_get_typed_errors() {
    let d = Daemon::fresh("bad");
    // (status, code, the requests that get it, as `METHOD path[ body]`)
    let cases: [(u16, &str, &[&str]); 4] = [
        (
            400,
            "invalid_request",
            &[
                "POST /v1/sandboxes {not json",
                r#"POST /v1/sandboxes {"substrate":"function"}"#,
                r#"POST /v1/sandboxes {"substrate":"firecracker"}"#,
                r#"POST /v1/sandboxes {"limits":{"pids_max":1}}"#,
                r#"POST /v1/sandboxes {"limits":{"bogus":1}}"#,
                r#"POST /v1/sandboxes {"extra":1}"#,
                r#"POST /v1/sandboxes/batch {"count":0}"#,
                "GET /v1/sandboxes?state=bogus",
            ],
        ),
        (
            404,
            "template_not_found",
            &[r#"POST /v1/sandboxes {"template":"nope"}"#],
        ),
        (
            404,
            "sandbox_not_found",
            &["GET /v1/sandboxes/sb-0000000000000000"],
        ),
        (
            404,
            "not_found",
            &["GET /v1/sandboxes/../../etc", "GET /v1/nope"],
        ),
    ];
    for (status, code, requests) in cases {
        for request in requests {
            let mut parts = request.splitn(3, ' ');
            let m = parts.next().expect("method");
            let p = parts.next().expect("path");
            let body = parts.next().map(|b| b.as_bytes().to_vec());
            let (s, v) = d.req_raw(m, p, body, None);
            assert_eq!(
                (s, v["code"].as_str().unwrap_or_default()),
                (status, code),
                "{m} {p}: {v}"
            );
            assert!(
                v["request_id"].as_str().is_some_and(|r| !r.is_empty()),
                "{v}"
            );
        }
    }
    let id = d.create(None)["id"].as_str().expect("id").to_owned();
    for (body, code) in [
        (json!({}), "invalid_request"),
        (json!({"argv": []}), "invalid_request"),
        (
            json!({"argv": ["true"], "shell": "true"}),
            "invalid_request",
        ),
        (
            json!({"argv": ["true"], "stdin_b64": "!!"}),
            "invalid_request",
        ),
        (json!({"argv": ["/nonexistent"]}), "spawn_failed"),
    ] {
        let (_, v) = d.req(
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            Some(body.clone()),
            None,
        );
        assert_eq!(v["code"], code, "{body}: {v}");
    }
    let (_, v) = d.req_raw(
        "GET",
        &format!("/v1/sandboxes/{id}/files?path=/../../etc/shadow"),
        None,
        None,
    );
    assert!(
        matches!(v["code"].as_str(), Some("path_escape" | "not_found")),
        "{v}"
    );
    let (s, _) = d.req("GET", "/openapi.json", None, None);
    assert_eq!(s, 200);
    d.finish();
}

#[test]
fn pool_serves_creates_refills_and_survives_a_restart() {
    let (data, run) = testkit::dirs("dst", "pool");
    let args = ["--pool-min", "2", "--pool-max", "8"];
    let mut d = Daemon::start_with(&data, &run, &[], &args);
    let pool = |d: &Daemon| d.req("GET", "/v1/pools/host", None, None).1;
    let wait_ready = |d: &Daemon, n: u64| {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let p = pool(d);
            if p["ready"].as_u64() == Some(n) && p["creating"].as_u64() == Some(0) {
                return p;
            }
            assert!(Instant::now() < deadline, "pool reaches {n} ready: {p}");
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    wait_ready(&d, 2);
    let v = d.create(None);
    assert_eq!(v["pooled"], true, "served from the pool: {v}");
    let id = v["id"].as_str().expect("id").to_owned();
    assert_eq!(d.exec_ok(&id, "hostname"), format!("{id}\n"));
    let p = wait_ready(&d, 2);
    assert_eq!(p["hits"], 1, "{p}");
    // Non-default limits are not served from the pool.
    let (_, v) = d.req(
        "POST",
        "/v1/sandboxes",
        Some(json!({"limits": {"pids_max": 64}})),
        None,
    );
    assert_eq!(v["pooled"], false, "{v}");
    d.kill9();
    d = Daemon::start_with(&data, &run, &[], &args);
    let (_, ready) = d.req("GET", "/readyz", None, None);
    let adopted = ready["recovery"]["adopted"].as_array().map_or(0, Vec::len);
    assert_eq!(adopted, 4, "2 in use + 2 pooled adopted back: {ready}");
    assert_eq!(ready["recovery"]["reaped"], json!([]), "{ready}");
    let p = wait_ready(&d, 2);
    assert_eq!(p["misses"], 0, "no refill was needed: {p}");
    // Everything on the machine is either listed or in the pool.
    let listed = d.listed();
    let machine = d.on_machine(&listed);
    assert_eq!(machine.len(), listed.len() + 2, "{machine:?} vs {listed:?}");
    let (s, v) = d.req(
        "PUT",
        "/v1/pools/host",
        Some(json!({"min": 0, "max": 0})),
        None,
    );
    assert_eq!(s, 200, "{v}");
    wait_ready(&d, 0);
    d.finish();
}

/// Every operation in `/openapi.json` is routed (an unauthenticated call gets `unauthorized`,
/// not `not_found` or 405), and it is a valid OpenAPI 3.1 skeleton.
#[test]
fn openapi_document_matches_the_router() {
    let d = Daemon::fresh("oapi");
    let (s, doc) = d.req("GET", "/openapi.json", None, None);
    assert_eq!(s, 200);
    assert_eq!(doc["openapi"], "3.1.0");
    let paths = doc["paths"].as_object().expect("paths");
    assert!(paths.len() >= 25, "{} paths", paths.len());
    let mut checked = 0;
    for (path, ops) in paths {
        let concrete = testkit::concrete_path(path);
        for (method, op) in ops.as_object().expect("ops") {
            assert!(
                op["summary"].is_string() && op["responses"].is_object(),
                "{method} {path}"
            );
            // A fresh connection each time: the server may close one whose request body it did
            // not read (it answers 401 before reading), and a pooled reuse would then fail.
            let bare = testkit::Http::new(&d.url, None, Some(Duration::from_secs(120)));
            let body = match method.as_str() {
                "get" | "delete" => None,
                "post" | "put" => Some(&b"{}"[..]),
                other => panic!("method {other}"),
            };
            let r = bare
                .send(&method.to_uppercase(), &concrete, body, &[])
                .expect("http");
            let v = r.json();
            assert_eq!(
                (r.status, v["code"].as_str()),
                (401, Some("unauthorized")),
                "{method} {path} is routed and authenticated"
            );
            checked += 1;
        }
    }
    assert!(checked >= 30, "{checked} operations");
    d.finish();
}

/// Templates through the API: import a root filesystem tarball, create from it, refuse to
/// delete it while in use, delete it after.
#[test]
fn templates_import_use_and_delete() {
    let (data, run) = testkit::dirs("dst", "tpl");
    let d = Daemon::start(&data, &run, &[]);
    let tarball = testkit::rootfs_tarball(
        data.parent().expect("base"),
        "rootfs",
        "from the template\n",
    );
    let body = std::fs::read(&tarball).expect("read tarball");
    let (s, v) = d.req_raw("POST", "/v1/templates?name=tiny", Some(body.clone()), None);
    assert_eq!(s, 201, "{v}");
    assert_eq!(v["name"], "tiny");
    let (s, v) = d.req_raw("POST", "/v1/templates?name=tiny", Some(body), None);
    assert!(
        s >= 400,
        "a second import under the same name is refused: {v}"
    );
    let (_, v) = d.req("GET", "/v1/templates", None, None);
    let names: Vec<&str> = v["items"]
        .as_array()
        .expect("items")
        .iter()
        .filter_map(|t| t["name"].as_str())
        .collect();
    assert!(
        names.contains(&"tiny") && names.contains(&"host"),
        "{names:?}"
    );
    let (s, v) = d.req(
        "POST",
        "/v1/sandboxes",
        Some(json!({"template": "tiny"})),
        None,
    );
    assert_eq!(s, 201, "{v}");
    let id = v["id"].as_str().expect("id").to_owned();
    let r = d
        .http()
        .send(
            "GET",
            &format!("/v1/sandboxes/{id}/files?path=/etc/motd"),
            None,
            &[],
        )
        .expect("read");
    assert_eq!(r.body, b"from the template\n");
    let (s, v) = d.req("DELETE", "/v1/templates/tiny", None, None);
    assert_eq!(
        (s, v["code"].clone()),
        (409, json!("invalid_transition")),
        "in use: {v}"
    );
    let (s, _) = d.req("DELETE", &format!("/v1/sandboxes/{id}"), None, None);
    assert_eq!(s, 200);
    let (s, v) = d.req("DELETE", "/v1/templates/tiny", None, None);
    assert_eq!(s, 204, "{v}");
    let (s, v) = d.req("GET", "/v1/templates/tiny", None, None);
    assert_eq!((s, v["code"].clone()), (404, json!("template_not_found")));
    d.finish();
}

/// Creating and destroying sandboxes through the daemon leaves its descriptors, the host's
/// mount table and the sandbox cgroups where they were.
#[test]
fn leak_counters_return_to_baseline() {
    let d = Daemon::fresh("leak");
    let fds = || {
        std::fs::read_dir(format!("/proc/{}/fd", d.child.id()))
            .map(|r| r.count())
            .unwrap_or(0)
    };
    let host_mounts = || {
        std::fs::read_to_string("/proc/1/mountinfo")
            .map(|m| m.lines().count())
            .unwrap_or(0)
    };
    // One round first, so that lazily opened descriptors (store, pooled connections) exist.
    let warm = d.create(None)["id"].as_str().expect("id").to_owned();
    d.exec_ok(&warm, "true");
    d.req("DELETE", &format!("/v1/sandboxes/{warm}"), None, None);
    let rss_kb = || {
        std::fs::read_to_string(format!("/proc/{}/status", d.child.id()))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let (fd0, mounts0, rss0) = (fds(), host_mounts(), rss_kb());
    for _ in 0..3 {
        let v = d.batch(10, json!({"leak": "1"}));
        for it in v["items"].as_array().expect("items") {
            let id = it["sandbox"]["id"].as_str().expect("id");
            d.exec_ok(id, "echo x > /tmp/x; sleep 0.01 &");
        }
        let (s, _) = d.req(
            "POST",
            "/v1/sandboxes/batch-delete",
            Some(json!({"labels": {"leak": "1"}})),
            None,
        );
        assert_eq!(s, 200);
    }
    assert!(d.listed().is_empty());
    let fd1 = fds();
    assert!(
        fd1 <= fd0 + 2,
        "daemon descriptors: {fd0} before, {fd1} after"
    );
    assert_eq!(
        host_mounts(),
        mounts0,
        "the host's mount table is unchanged"
    );
    let rss1 = rss_kb();
    assert!(
        rss1 <= rss0 + 8 * 1024,
        "daemon RSS {rss0} KiB before, {rss1} KiB after 30 sandboxes came and went"
    );
    assert!(d.on_machine(&BTreeSet::new()).is_empty());
    d.finish();
}

/// The lifecycle event stream and long-polls on the version counter.
#[test]
fn events_stream_and_long_poll() {
    let (data, run) = testkit::dirs("dst", "evt");
    let d = Daemon::start(&data, &run, &[]);
    let http = d.http().clone();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        let Ok(mut r) = http.get_streaming("/v1/events") else {
            return;
        };
        let reader = BufReader::new(r.body_mut().as_reader());
        for line in reader.lines() {
            let Ok(line) = line else { return };
            if let Some(data) = line.strip_prefix("data:") {
                if tx.send(data.trim().to_owned()).is_err() {
                    return;
                }
            }
        }
    });
    std::thread::sleep(Duration::from_millis(200));
    let v = d.create(None);
    let id = v["id"].as_str().expect("id").to_owned();
    let version = v["version"].as_u64().expect("version");
    // A long-poll for a later version returns when the reset bumps it.
    let waiter = {
        let path = format!("/v1/sandboxes/{id}?after_version={version}&timeout=10000");
        let http = d.http().clone();
        std::thread::spawn(move || {
            let t = Instant::now();
            let (_, v) = http.call("GET", &path, None).expect("poll");
            (v, t.elapsed())
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    let (s, _) = d.req("POST", &format!("/v1/sandboxes/{id}/reset"), None, None);
    assert_eq!(s, 200);
    let (v, took) = waiter.join().expect("join");
    assert!(v["version"].as_u64() > Some(version), "{v}");
    assert!(
        took < Duration::from_secs(5),
        "answered on the change, not the timeout"
    );
    d.req("DELETE", &format!("/v1/sandboxes/{id}"), None, None);
    let mut states = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !states.contains(&"stopped".to_owned()) && Instant::now() < deadline {
        if let Ok(ev) = rx.recv_timeout(Duration::from_millis(200)) {
            let ev: Value = serde_json::from_str(&ev).expect("event json");
            if ev["sandbox"] == id.as_str() {
                states.push(ev["state"].as_str().unwrap_or_default().to_owned());
            }
        }
    }
    for s in ["running", "resetting", "stopping", "stopped"] {
        assert!(states.iter().any(|x| x == s), "{s} in {states:?}");
    }
    d.finish();
}

/// A sandbox on the machine with no record (its row lost) is found and destroyed at start;
/// the node-wide limit answers `resource_exhausted`.
#[test]
fn orphans_are_reaped_and_the_node_limit_holds() {
    let (data, run) = testkit::dirs("dst", "orph");
    let mut d = Daemon::start_with(
        &data,
        &run,
        &[],
        &["--pool-max", "0", "--max-sandboxes", "2"],
    );
    let kept = d.create(None)["id"].as_str().expect("id").to_owned();
    let lost = d.create(None)["id"].as_str().expect("id").to_owned();
    let (s, v) = d.req("POST", "/v1/sandboxes", Some(json!({})), None);
    assert_eq!(
        (s, v["code"].clone()),
        (503, json!("resource_exhausted")),
        "{v}"
    );
    d.kill9();
    let db = data.join("state.db");
    let st = Command::new("python3")
        .arg("-c")
        .arg(format!(
            "import sqlite3; c = sqlite3.connect({:?}); c.execute(\"DELETE FROM sandboxes WHERE id = '{lost}'\"); c.commit()",
            db.display().to_string()
        ))
        .status()
        .expect("python3");
    assert!(st.success(), "drop the record");
    let d = Daemon::start(&data, &run, &[]);
    let (_, ready) = d.req("GET", "/readyz", None, None);
    assert_eq!(
        ready["recovery"]["orphans"],
        json!([lost.clone()]),
        "{ready}"
    );
    assert_eq!(
        ready["recovery"]["adopted"],
        json!([kept.clone()]),
        "{ready}"
    );
    assert!(!cgroups().contains(&lost), "the orphan's cgroup is gone");
    d.assert_converged("after the orphan was reaped");
    d.finish();
}

/// F-14, whole-host crash: the daemon and every supervisor die and the runtime dir (a tmpfs
/// on a real host) is gone. The restarted node finds each recorded sandbox missing, closes its
/// record with the reason, and leaves nothing behind.
#[test]
fn f14_whole_host_crash_closes_stale_records() {
    let (data, run) = testkit::dirs("dst", "f14");
    let mut d = Daemon::start(&data, &run, &[]);
    let mut ids = Vec::new();
    for _ in 0..3 {
        let id = d.create(None)["id"].as_str().expect("id").to_owned();
        let (_, v) = d.req("GET", &format!("/v1/sandboxes/{id}"), None, None);
        ids.push((id, v["supervisor_pid"].as_i64().expect("pid")));
    }
    d.kill9();
    for (_, sup) in &ids {
        if let Some(pid) = rustix::process::Pid::from_raw(*sup as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
    }
    std::thread::sleep(Duration::from_millis(300));
    let _ = std::fs::remove_dir_all(&run);
    // cgroups do not survive a reboot either.
    for (id, _) in &ids {
        if let Ok(m) = dsec_sys::cgroup::CgroupManager::detect("dsec") {
            if let Some(cg) = m.open(id) {
                let _ = cg.kill_all();
                let _ = cg.remove();
            }
        }
    }
    let d = Daemon::start(&data, &run, &[]);
    let (_, ready) = d.req("GET", "/readyz", None, None);
    let reaped: BTreeSet<String> = ready["recovery"]["reaped"]
        .as_array()
        .expect("reaped")
        .iter()
        .filter_map(|v| v.as_str().map(str::to_owned))
        .collect();
    let want: BTreeSet<String> = ids.iter().map(|(id, _)| id.clone()).collect();
    assert_eq!(reaped, want, "{ready}");
    assert!(d.listed().is_empty());
    for (id, _) in &ids {
        let (s, v) = d.req("GET", &format!("/v1/sandboxes/{id}"), None, None);
        assert_eq!((s, v["state"].as_str()), (200, Some("stopped")), "{v}");
        assert!(
            v["error"]
                .as_str()
                .is_some_and(|e| e.contains("reaped at restart")),
            "{v}"
        );
    }
    d.assert_converged("after a whole-host crash");
    d.finish();
}

/// G-1 and G-23 through the API: a sandbox runs by default in a user namespace, as an
/// unprivileged host id range of its own, with `RLIMIT_NPROC` = `pids_max` less 4, so a fork
/// bomb's forks beyond it are refused before the kernel copies anything: none reaches the pids
/// controller. The same bomb in a sandbox without the namespace (the admin tenant's opt-out,
/// `"userns": false`) is refused by `pids.max` only, after the copy, thousands of times a
/// second.
/// R-13: a sandbox whose threads never sleep moves to the batch CPU class (`cpu.idle`) while
/// the node's CPUs are contended, a sandbox that serves calls beside it does not, and the
/// spinner gets its own class back once it sleeps again.
#[test]
fn r13_a_sandbox_that_never_sleeps_goes_batch_and_comes_back() {
    let d = Daemon::fresh("cpu");
    let quiet = d.create_spec(json!({}));
    let spinner = d.create_spec(json!({}));
    let cg = |id: &str| {
        dsec_sys::cgroup::CgroupManager::detect("dsec")
            .expect("cgroups")
            .open(id)
            .expect("the sandbox's cgroup")
    };
    assert_eq!(
        cg(&spinner).cpu_idle(),
        Some(false),
        "kernel without cpu.idle"
    );
    // One spinner more than the host has CPUs: they contend whatever the machine.
    let n = std::thread::available_parallelism().map_or(2, |n| n.get()) + 1;
    let (s, v) = d.req(
        "POST",
        &format!("/v1/sandboxes/{spinner}/processes"),
        Some(
            json!({"shell": format!("for i in $(seq {n}); do (while :; do :; done) & done; wait")}),
        ),
        None,
    );
    assert_eq!(s, 201, "spawn: {v}");
    let handle = v["handle"].as_u64().expect("handle");
    let batch = |d: &Daemon| {
        d.metrics()
            .lines()
            .find_map(|l| l.strip_prefix("dsec_cpu_batch_sandboxes "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(-1.0)
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while cg(&spinner).cpu_idle() != Some(true) {
        assert!(Instant::now() < deadline, "the spinner never went batch");
        // The quiet one keeps serving calls all along.
        assert_eq!(d.exec_ok(&quiet, "echo ok"), "ok\n");
    }
    for _ in 0..20 {
        assert_eq!(d.exec_ok(&quiet, "echo ok"), "ok\n");
    }
    assert_eq!(
        cg(&quiet).cpu_idle(),
        Some(false),
        "the quiet sandbox went batch"
    );
    assert_eq!(batch(&d), 1.0);
    assert!(d.metrics().contains("dsec_cpu_demotions_total 1"));
    // The partition: the spinner's processes on CPUs of their own, the quiet one's (and the
    // node's) on the rest.
    let part = Partition::of(&d);
    if let Some(p) = &part {
        p.wait_for(&cg(&spinner), "b");
        p.wait_for(&cg(&quiet), "");
        let (q, b) = (p.cpus(""), p.cpus("b"));
        assert!(!q.is_empty() && !b.is_empty(), "{q:?} {b:?}");
        assert!(q.iter().all(|c| !b.contains(c)), "overlap: {q:?} {b:?}");
    }
    let (s, v) = d.req(
        "POST",
        &format!("/v1/sandboxes/{spinner}/processes/{handle}/signal"),
        Some(json!({"signal": 9})),
        None,
    );
    assert_eq!(s, 204, "signal: {v}");
    let deadline = Instant::now() + Duration::from_secs(20);
    while cg(&spinner).cpu_idle() != Some(false) {
        assert!(
            Instant::now() < deadline,
            "the spinner stayed batch once it slept"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(batch(&d), 0.0);
    if let Some(p) = &part {
        p.wait_for(&cg(&spinner), "");
        assert_eq!(
            p.cpus(""),
            p.cpus("b"),
            "every CPU is the quiet side's again"
        );
    }
    d.finish();
    if let Some(p) = part {
        for suffix in ["", "b"] {
            assert!(!p.dir(suffix).exists(), "left: {}", p.dir(suffix).display());
        }
    }
}

/// A node's CPU partition as the tests see it: `<cpuset root>/dsec/n<pid>` (quiet) and
/// `…b` (batch). `None`, said on stderr, on a host without a v1 `cpuset` hierarchy or with
/// one CPU (the node then does not partition).
struct Partition {
    base: std::path::PathBuf,
    pid: u32,
}

impl Partition {
    fn of(d: &Daemon) -> Option<Self> {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let Some(root) = dsec_sys::cgroup::CpuPartition::v1_root().filter(|_| cpus >= 2) else {
            eprintln!("NOTE: no v1 cpuset hierarchy or one CPU: the CPU partition is not checked");
            return None;
        };
        let p = Self {
            base: root.join("dsec"),
            pid: d.child.id(),
        };
        assert!(p.dir("").is_dir(), "the node made no partition");
        Some(p)
    }

    fn dir(&self, suffix: &str) -> std::path::PathBuf {
        self.base.join(format!("n{}{suffix}", self.pid))
    }

    fn cpus(&self, suffix: &str) -> Vec<u32> {
        let text = std::fs::read_to_string(self.dir(suffix).join("cpuset.cpus")).expect("cpus");
        dsec_sys::cgroup::cpuset::parse_cpu_list(text.trim()).expect("a CPU list")
    }

    /// Waits until every process of `cg` is in the cpuset `n<pid><suffix>`.
    fn wait_for(&self, cg: &dsec_sys::cgroup::Cgroup, suffix: &str) {
        let want = format!("/dsec/n{}{suffix}", self.pid);
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let pids = cg.pids().expect("pids");
            let wrong: Vec<(i32, String)> = pids
                .iter()
                .filter_map(|p| {
                    let at = std::fs::read_to_string(format!("/proc/{p}/cpuset")).ok()?;
                    (at.trim() != want).then(|| (*p, at.trim().to_owned()))
                })
                .collect();
            if !pids.is_empty() && wrong.is_empty() {
                return;
            }
            assert!(Instant::now() < deadline, "not in {want}: {wrong:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

#[test]
fn userns_sandboxes_refuse_forks_before_the_copy() {
    let d = Daemon::fresh("uns");
    let make = |userns: Option<bool>| -> String {
        let mut spec = json!({"limits": {"pids_max": 32}});
        if let Some(u) = userns {
            spec["userns"] = u.into();
        }
        let (s, v) = d.req("POST", "/v1/sandboxes", Some(spec), None);
        assert_eq!(s, 201, "create: {v}");
        assert_eq!(v["userns"], userns.unwrap_or(true), "{v}");
        v["id"].as_str().expect("id").to_owned()
    };
    let (with, without) = (make(None), make(Some(false)));
    let probe =
        "awk '/Max processes/ {print $3}' /proc/self/limits; awk '{print $2}' /proc/self/uid_map";
    let out = d.exec_ok(&with, probe);
    let (nproc, first) = out.split_once('\n').expect("two lines");
    assert_eq!(nproc, "28", "{out}");
    // Root is the first id of a host id range the sandbox holds alone.
    let first: u32 = first.trim().parse().expect("a host id");
    assert!(
        dsec_sys::idrange::IdRangeLease::index_of(first).is_some(),
        "{out}"
    );
    // (Without the namespace the host's RLIMIT_NPROC is inherited; uid 0 is exempt from it.)
    assert!(d.exec_ok(&without, probe).ends_with("\n0\n"));
    let bomb =
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass";
    let refused = |id: &str| -> u64 {
        dsec_sys::cgroup::CgroupManager::detect("dsec")
            .expect("cgroups")
            .open(id)
            .expect("the sandbox's cgroup")
            .pids_refused()
            .expect("pids.events")
    };
    for id in [&with, &without] {
        let (s, v) = d.req(
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            Some(json!({"argv": ["/usr/bin/python3", "-c", bomb], "timeout_ms": 1000})),
            None,
        );
        assert_eq!(s, 200, "exec: {v}");
        assert_eq!(v["status"], "timeout", "{v}");
        // The sandbox is usable again once the bomb is gone.
        assert_eq!(d.exec_ok(id, "echo ok"), "ok\n");
    }
    assert_eq!(
        refused(&with),
        0,
        "forks refused by pids.max in the userns sandbox"
    );
    assert!(refused(&without) > 100, "{}", refused(&without));
    // A reset swaps the root in place: same init, same namespace, same range, a fresh layer.
    let init =
        |id: &str| d.req("GET", &format!("/v1/sandboxes/{id}"), None, None).1["init_pid"].clone();
    let before = init(&with);
    d.exec_ok(&with, "echo x > /tmp/episode");
    let (s, v) = d.req("POST", &format!("/v1/sandboxes/{with}/reset"), None, None);
    assert_eq!(s, 200, "reset: {v}");
    assert_eq!(d.exec_ok(&with, probe), out, "a reset keeps the range");
    assert_eq!(init(&with), before, "the reset was in place");
    assert_eq!(d.exec_ok(&with, "ls /tmp"), "", "a fresh writable layer");
    // A VM guest has its own kernel: the option is refused there.
    let (s, v) = d.req(
        "POST",
        "/v1/sandboxes",
        Some(json!({"userns": true, "substrate": "microvm"})),
        None,
    );
    assert_eq!(s, 400, "{v}");
    assert_eq!(v["code"], "invalid_request", "{v}");
    d.finish();
}
