//! Snapshots, forks, restores and the snapshot tree of container sandboxes, through a real
//! `dsec server` (docs/api.md, *Snapshots*).
//!
//! Needs root (namespaces, cgroups, mounts); CI runs as root.

use std::path::Path;

use dsec_testkit as testkit;
use serde_json::{json, Value};

testkit::daemon_type!(
    /// A daemon of these tests.
    struct Daemon
);

impl Daemon {
    fn fresh(test: &str, env: &[(&str, &str)]) -> Self {
        let (data, run) = testkit::dirs("dsn", test);
        let base = data.parent().expect("a base").to_owned();
        Self::with(
            testkit::Server::test(env!("CARGO_BIN_EXE_dsec"), &data, &run).remove_on_drop(&base),
            env,
        )
    }

    fn at(data: &Path, run: &Path, env: &[(&str, &str)]) -> Self {
        Self::with(
            testkit::Server::test(env!("CARGO_BIN_EXE_dsec"), data, run),
            env,
        )
    }

    fn with(s: testkit::Server, env: &[(&str, &str)]) -> Self {
        let d = s
            .args(&["--pool-max", "0"])
            .envs(env)
            .start()
            .expect("start dsec server");
        Self(d)
    }

    fn ok(&self, method: &str, path: &str, body: Value) -> Value {
        let (s, v) = self.req(method, path, Some(&body));
        assert!((200..300).contains(&s), "{method} {path}: {s} {v}");
        v
    }

    fn create(&self, spec: Value) -> String {
        self.ok("POST", "/v1/sandboxes", spec)["id"]
            .as_str()
            .expect("id")
            .to_owned()
    }

    /// The stdout of `sh -c shell` in sandbox `id`.
    fn sh(&self, id: &str, shell: &str) -> String {
        let v = self.ok(
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            json!({"shell": shell}),
        );
        assert_eq!(v["exit_code"], 0, "{shell}: {v}");
        v["stdout"]["data"].as_str().unwrap_or_default().to_owned()
    }

    fn snapshot(&self, id: &str) -> Value {
        self.ok("POST", &format!("/v1/sandboxes/{id}/snapshots"), json!({}))
    }

    /// Snapshot layers on disk.
    fn layers(&self) -> usize {
        std::fs::read_dir(self.data.join("snapshots/layers")).map_or(0, |d| d.count())
    }

    fn delete(&self, id: &str) {
        let (s, v) = self.req("DELETE", &format!("/v1/sandboxes/{id}"), None);
        assert!(s == 204 || s == 200, "delete {id}: {s} {v}");
    }
}

fn sid(v: &Value) -> String {
    v["id"].as_str().expect("an id").to_owned()
}

/// Files written after a snapshot are gone after a restore (processes too); a reset comes
/// back to the snapshot restored; the snapshot's view says what it holds.
#[test]
fn restore_rolls_files_back() {
    let d = Daemon::fresh("restore", &[]);
    let id = d.create(json!({}));
    d.sh(
        &id,
        "echo one > /workspace/a && mkdir -p /tmp/d && echo x > /tmp/d/x",
    );
    let s1 = d.snapshot(&id);
    assert_eq!(s1["parent"], Value::Null);
    assert_eq!(s1["memory"], false);
    assert_eq!(s1["template"], "host");
    assert!(s1["size_bytes"].as_u64() >= Some(6), "{s1}");
    d.sh(
        &id,
        "echo two > /workspace/b && rm /workspace/a && sleep 300 &",
    );
    let v = d.ok(
        "POST",
        &format!("/v1/sandboxes/{id}/restore"),
        json!({"snapshot": sid(&s1)}),
    );
    assert_eq!(v["snapshot"], s1["id"]);
    assert_eq!(
        d.sh(
            &id,
            "cat /workspace/a; ls /workspace; cat /tmp/d/x; pgrep sleep || echo none"
        ),
        "one\na\nx\nnone\n"
    );
    d.sh(&id, "echo three > /workspace/c");
    d.ok("POST", &format!("/v1/sandboxes/{id}/reset"), json!({}));
    assert_eq!(
        d.sh(&id, "ls /workspace"),
        "a\n",
        "a reset comes back to the snapshot"
    );
    // Another tenant sees nothing of it.
    let (s, t) = d.req("POST", "/v1/tenants", Some(&json!({"name": "other"})));
    assert_eq!(s, 201, "{t}");
    let other = d.http().with_key(t["api_key"].as_str());
    let (s, v) = other.req("GET", &format!("/v1/snapshots/{}", sid(&s1)), None);
    assert_eq!((s, v["code"].as_str()), (404, Some("snapshot_not_found")));
    let (s, v) = other.req(
        "POST",
        "/v1/sandboxes",
        Some(&json!({"snapshot": s1["id"]})),
    );
    assert_eq!((s, v["code"].as_str()), (404, Some("snapshot_not_found")));
    d.delete(&id);
}

/// Forks start from the snapshot and diverge without seeing each other; a writable root's
/// files are captured too; deleting the tree leaves no layer on disk.
#[test]
fn forks_diverge_and_the_tree_is_collected() {
    let d = Daemon::fresh("fork", &[]);
    let id = d.create(json!({"writable_root": true}));
    d.sh(
        &id,
        "echo base > /etc/dsec-base && mkdir /workspace && echo w > /workspace/w",
    );
    let f = d.ok(
        "POST",
        &format!("/v1/sandboxes/{id}/fork"),
        json!({"count": 3, "labels": {"run": "t"}}),
    );
    let forks: Vec<String> = f["sandboxes"]
        .as_array()
        .expect("sandboxes")
        .iter()
        .map(sid)
        .collect();
    assert_eq!(forks.len(), 3, "{f}");
    let root = sid(&f["snapshot"]);
    for (i, k) in forks.iter().enumerate() {
        assert_eq!(d.sh(k, "cat /etc/dsec-base /workspace/w"), "base\nw\n");
        d.sh(k, &format!("echo {i} > /workspace/mine"));
    }
    for (i, k) in forks.iter().enumerate() {
        assert_eq!(d.sh(k, "cat /workspace/mine"), format!("{i}\n"));
    }
    // A snapshot of a fork stands on the fork's snapshot.
    let child = d.snapshot(&forks[0]);
    assert_eq!(child["parent"].as_str(), Some(root.as_str()));
    let tree = d.ok("GET", &format!("/v1/snapshots/{root}/tree"), json!(null));
    assert_eq!(tree["children"][0]["id"], child["id"], "{tree}");
    let listed = d.ok("GET", &format!("/v1/snapshots?root={root}"), json!(null));
    assert_eq!(listed["items"].as_array().map(Vec::len), Some(2));
    let by_label = d.ok("GET", "/v1/snapshots?label=run=t", json!(null));
    assert_eq!(by_label["items"].as_array().map(Vec::len), Some(1));
    // Refused while snapshots and sandboxes stand on it.
    let (s, v) = d.req("DELETE", &format!("/v1/snapshots/{root}"), None);
    assert_eq!(
        (s, v["code"].as_str()),
        (409, Some("invalid_transition")),
        "{v}"
    );
    assert!(d.layers() >= 2);
    let v = d.ok(
        "DELETE",
        &format!("/v1/snapshots/{root}?recursive=true"),
        json!(null),
    );
    assert_eq!(v["deleted"].as_array().map(Vec::len), Some(2));
    // The forks still run on the layers, which go with the last of them.
    assert_eq!(d.sh(&forks[1], "cat /workspace/w"), "w\n");
    for k in forks.iter().chain([&id]) {
        d.delete(k);
    }
    assert_eq!(d.layers(), 0, "every layer is collected");
}

/// A tenant's snapshots are bounded by `max_snapshot_bytes`; a refused snapshot leaves no
/// layer behind.
#[test]
fn snapshot_quota() {
    let d = Daemon::fresh("quota", &[]);
    let (s, t) = d.req(
        "POST",
        "/v1/tenants",
        Some(&json!({"name": "small", "max_snapshot_bytes": 4096})),
    );
    assert_eq!(s, 201, "{t}");
    let h = d.http().with_key(t["api_key"].as_str());
    let (s, v) = h.req("POST", "/v1/sandboxes", Some(&json!({})));
    assert_eq!(s, 201, "{v}");
    let id = sid(&v);
    let (s, v) = h.req(
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(&json!({"shell": "head -c 3000 /dev/zero > /workspace/f"})),
    );
    assert_eq!(s, 200, "{v}");
    let (s, v) = h.req(
        "POST",
        &format!("/v1/sandboxes/{id}/snapshots"),
        Some(&json!({})),
    );
    assert_eq!(s, 201, "{v}");
    let (s, v) = h.req(
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(&json!({"shell": "head -c 3000 /dev/zero > /workspace/g"})),
    );
    assert_eq!(s, 200, "{v}");
    let (s, v) = h.req(
        "POST",
        &format!("/v1/sandboxes/{id}/snapshots"),
        Some(&json!({})),
    );
    assert_eq!(
        (s, v["code"].as_str()),
        (429, Some("quota_exceeded")),
        "{v}"
    );
    assert_eq!(d.layers(), 1);
    let (s, _) = h.req("DELETE", &format!("/v1/sandboxes/{id}"), None);
    assert!(s == 200 || s == 204);
}

/// kill -9 between a snapshot's layer and its record leaves no snapshot and, once the node is
/// back, no layer.
#[test]
fn kill9_during_a_snapshot_leaves_none() {
    let (data, run, _cleanup) = testkit::dirs_removed_on_drop("dsn", "kill9");
    let mut d = Daemon::at(&data, &run, &[("DSEC_FAILPOINT", "snapshot:before_record")]);
    let id = d.create(json!({}));
    d.sh(&id, "echo a > /workspace/a");
    let (s, _) = d.req(
        "POST",
        &format!("/v1/sandboxes/{id}/snapshots"),
        Some(&json!({})),
    );
    assert_eq!(s, 0, "the daemon died at the failpoint");
    d.kill9();
    assert_eq!(d.layers(), 1, "the layer was written");
    drop(d);
    let d = Daemon::at(&data, &run, &[]);
    let v = d.ok("GET", "/v1/snapshots", json!(null));
    assert_eq!(v["items"], json!([]));
    assert_eq!(d.layers(), 0, "collected at start");
    // The sandbox lived on and can still be snapshotted.
    let s = d.snapshot(&id);
    assert_eq!(d.layers(), 1, "{s}");
    d.delete(&id);
}

/// A chain deeper than the flatten depth keeps every file, and a create from its leaf sees
/// them all.
#[test]
fn a_deep_chain_is_flattened() {
    let d = Daemon::fresh("deep", &[]);
    let id = d.create(json!({}));
    let mut leaf = Value::Null;
    for i in 0..20 {
        let drop_last = if i > 0 {
            format!("; rm /workspace/f{}", i - 1)
        } else {
            String::new()
        };
        d.sh(&id, &format!("echo {i} > /workspace/f{i}{drop_last}"));
        leaf = d.snapshot(&id);
        d.ok(
            "POST",
            &format!("/v1/sandboxes/{id}/restore"),
            json!({"snapshot": leaf["id"]}),
        );
    }
    // Past the flatten depth (16) a chain is merged, in the background, into one layer that
    // it (and the next snapshots) then stand on.
    let flat = testkit::cluster::wait(std::time::Duration::from_secs(30), || {
        let v = d.ok("GET", &format!("/v1/snapshots/{}", sid(&leaf)), json!(null));
        v["depth"].as_u64().is_some_and(|n| n <= 16)
    });
    assert!(flat, "the leaf's chain was flattened");
    let k = d.create(json!({"snapshot": leaf["id"]}));
    assert_eq!(d.sh(&k, "ls /workspace | sort -V | tr '\\n' ' '"), "f19 ");
    assert_eq!(d.sh(&k, "cat /workspace/f19"), "19\n");
    d.delete(&k);
    d.delete(&id);
}

/// `dsec snapshot` and `dsec sandbox create --snapshot` against the daemon.
#[test]
fn the_cli_drives_snapshots() {
    let d = Daemon::fresh("cli", &[]);
    let dsec = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_dsec"))
            .args(args)
            .env("DSEC_URL", &d.url)
            .env("DSEC_API_KEY", &d.key)
            .output()
            .expect("run dsec");
        assert!(out.status.success(), "dsec {args:?}: {out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let id = d.create(json!({}));
    d.sh(&id, "echo c > /workspace/c");
    let sn = dsec(&["snapshot", "create", &id, "-l", "k=v"])
        .trim()
        .to_owned();
    assert!(sn.starts_with("sn-"), "{sn}");
    let made = dsec(&["sandbox", "create", "--snapshot", &sn])
        .trim()
        .to_owned();
    assert_eq!(d.sh(&made, "cat /workspace/c"), "c\n");
    let forks = dsec(&["snapshot", "fork", &id, "-n", "2"]);
    assert_eq!(forks.lines().count(), 2, "{forks}");
    d.sh(&id, "rm /workspace/c");
    dsec(&["snapshot", "restore", &id, &sn]);
    assert_eq!(d.sh(&id, "cat /workspace/c"), "c\n");
    assert!(dsec(&["snapshot", "list", "-l", "k=v"]).contains(&sn));
    assert!(dsec(&["snapshot", "tree", &sn]).starts_with(&sn));
    for k in forks.lines().chain([made.as_str()]) {
        d.delete(k);
    }
    let gone = dsec(&["snapshot", "rm", "-r", &sn]);
    assert!(gone.contains(&sn), "{gone}");
    d.delete(&id);
}

/// A snapshot committed as a template: its layers above the template's, stored and
/// content-addressed like an import's; sandboxes of it (and pools) see the snapshot's files.
#[test]
fn a_snapshot_commits_as_a_template() {
    let d = Daemon::fresh("commit", &[]);
    let id = d.create(json!({"writable_root": true}));
    d.sh(
        &id,
        "mkdir -p /workspace/app && echo hello > /workspace/app/x && rm -f /etc/motd",
    );
    let sn = d.snapshot(&id);
    let body = serde_json::to_vec(
        &json!({"name": "app", "snapshot": sn["id"], "workdir": "/workspace/app",
        "env": {"PATH": "/usr/bin:/bin", "APP": "1"}, "user": "nobody"}),
    )
    .expect("json");
    let r = d
        .http()
        .send(
            "POST",
            "/v1/templates",
            Some(&body),
            &[("content-type", "application/json")],
        )
        .expect("commit");
    let t = r.json();
    assert_eq!(r.status, 201, "{t}");
    assert_eq!(
        (&t["source"]["kind"], &t["source"]["id"]),
        (&json!("snapshot"), &sn["id"]),
        "{t}"
    );
    let k = d.create(json!({"template": "app"}));
    assert_eq!(
        d.sh(&k, "cat /workspace/app/x; test -e /etc/motd || echo gone"),
        "hello\ngone\n"
    );
    // The snapshot may go: the template holds its own copy of the layers.
    d.delete(&k);
    d.delete(&id);
    d.ok(
        "DELETE",
        &format!("/v1/snapshots/{}", sid(&sn)),
        json!(null),
    );
    let k = d.create(json!({"template": "app"}));
    assert_eq!(d.sh(&k, "cat /workspace/app/x"), "hello\n");
    // The template's workdir, environment and user hold in its sandboxes (a command may
    // still name another user).
    assert_eq!(
        d.sh(&k, "pwd; echo $APP; cat x; id -un"),
        "/workspace/app\n1\nhello\nnobody\n"
    );
    let (s, v) = d.req(
        "POST",
        &format!("/v1/sandboxes/{k}/exec"),
        Some(&json!({"shell": "id -u", "user": "root"})),
    );
    assert_eq!((s, v["stdout"]["data"].as_str()), (200, Some("0\n")), "{v}");
    d.delete(&k);
    let (s, v) = d.req("DELETE", "/v1/templates/app", None);
    assert_eq!(s, 204, "{v}");
}

/// `dsec template build`: a Dockerfile's steps as layers, its WORKDIR/ENV in the template's
/// sandboxes, a second build all from the cache, a failing RUN reported by its line.
#[test]
fn a_dockerfile_builds_a_template() {
    let d = Daemon::fresh("build", &[]);
    let ctx = d.data.parent().expect("base").join("ctx");
    std::fs::create_dir_all(ctx.join("data")).expect("ctx");
    std::fs::write(ctx.join("app.txt"), "app\n").expect("app.txt");
    std::fs::write(ctx.join("data/d.txt"), "data\n").expect("d.txt");
    std::fs::write(
        ctx.join("Dockerfile"),
        "ARG GREETING=hello\nFROM host\n# the app\nENV APP_HOME=/srv/app\nWORKDIR $APP_HOME\n\
         COPY app.txt ./\nCOPY data /srv/app/data\nRUN echo \"$GREETING from build\" \\\n  > built.txt\n\
         USER 1000\nLABEL purpose=test\n",
    )
    .expect("Dockerfile");
    let cache = d.data.parent().expect("base").join("cache");
    let build = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_dsec"))
            .args(["template", "build"])
            .args(args)
            .env("DSEC_URL", &d.url)
            .env("DSEC_API_KEY", &d.key)
            .env("XDG_CACHE_HOME", &cache)
            .output()
            .expect("run dsec")
    };
    let out = build(&[
        "-t",
        "built",
        "--build-arg",
        "GREETING=hi",
        ctx.to_str().expect("utf-8"),
    ]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{out:?}");
    assert!(text.contains("Successfully built template built"), "{text}");
    let k = d.create(json!({"template": "built"}));
    assert_eq!(
        d.sh(
            &k,
            "pwd; cat app.txt data/d.txt built.txt; echo $APP_HOME; id -u"
        ),
        "/srv/app\napp\ndata\nhi from build\n/srv/app\n1000\n"
    );
    d.delete(&k);
    let (s, t) = d.req("GET", "/v1/templates/built", None);
    assert_eq!((s, t["user"].as_str()), (200, Some("1000")), "{t}");
    // host's two layers and one per WORKDIR, COPY, COPY, RUN.
    assert_eq!(t["layers"].as_array().map(Vec::len), Some(6), "{t}");
    let (s, _) = d.req("DELETE", "/v1/templates/built", None);
    assert_eq!(s, 204);
    // Again: every step from the cache.
    let out = build(&[
        "-t",
        "built",
        "--build-arg",
        "GREETING=hi",
        ctx.to_str().expect("utf-8"),
    ]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(text.matches("Using cache").count(), 4, "{text}");
    // A failing RUN names its line.
    std::fs::write(
        ctx.join("Dockerfile.bad"),
        "FROM host\nRUN true\nRUN exit 3\n",
    )
    .expect("bad");
    let bad = ctx.join("Dockerfile.bad");
    let out = build(&[
        "-t",
        "bad",
        "-f",
        bad.to_str().expect("utf-8"),
        ctx.to_str().expect("utf-8"),
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("Dockerfile:3: RUN exit 3: exit code 3"),
        "{err}"
    );
    let (s, _) = d.req("GET", "/v1/templates/bad", None);
    assert_eq!(s, 404);
    let (_, v) = d.req("GET", "/v1/sandboxes", None);
    assert_eq!(
        v["items"].as_array().map(Vec::len),
        Some(0),
        "no build sandbox is left: {v}"
    );
}

/// A microVM's snapshot holds the whole guest: a fork (and a create from it) keeps a Python
/// session's variable and a background process; a restore rolls the guest back in place; a
/// reset comes back to the snapshot restored; deleting the tree leaves no layer.
#[test]
fn vm_snapshots_keep_processes_and_memory() {
    let d = Daemon::fresh("vm", &[]);
    let id = d.create(json!({"substrate": "microvm"}));
    d.sh(&id, "echo disk > /workspace/a; (sleep 1000 &)");
    let (s, v) = d.req(
        "POST",
        &format!("/v1/sandboxes/{id}/sessions"),
        Some(&json!({"kind": "python"})),
    );
    assert_eq!(s, 201, "{v}");
    let session = v["session"].as_u64().expect("session");
    let run = |sb: &str, input: &str| {
        let v = d.ok(
            "POST",
            &format!("/v1/sandboxes/{sb}/sessions/{session}/run"),
            json!({ "input": input }),
        );
        v["stdout"]["data"].as_str().unwrap_or_default().to_owned()
    };
    run(&id, "x = 41");
    let f = d.ok(
        "POST",
        &format!("/v1/sandboxes/{id}/fork"),
        json!({"count": 2}),
    );
    let snap = f["snapshot"].clone();
    assert_eq!(
        (snap["memory"].as_bool(), snap["substrate"].as_str()),
        (Some(true), Some("microvm"))
    );
    for k in f["sandboxes"].as_array().expect("sandboxes") {
        let k = sid(k);
        assert_eq!(run(&k, "print(x + 1)"), "42\n");
        assert_eq!(
            d.sh(
                &k,
                "cat /workspace/a; pgrep -x sleep >/dev/null && echo sleeping; hostname"
            ),
            format!("disk\nsleeping\n{k}\n")
        );
        d.delete(&k);
    }
    run(&id, "x = 0");
    d.sh(&id, "rm /workspace/a");
    d.ok(
        "POST",
        &format!("/v1/sandboxes/{id}/restore"),
        json!({"snapshot": snap["id"]}),
    );
    assert_eq!(run(&id, "print(x)"), "41\n");
    assert_eq!(d.sh(&id, "cat /workspace/a"), "disk\n");
    run(&id, "x = 7");
    d.ok("POST", &format!("/v1/sandboxes/{id}/reset"), json!({}));
    assert_eq!(
        run(&id, "print(x)"),
        "41\n",
        "a reset comes back to the snapshot"
    );
    // A container cannot be restored to a VM's snapshot.
    let c = d.create(json!({}));
    let (s, v) = d.req(
        "POST",
        &format!("/v1/sandboxes/{c}/restore"),
        Some(&json!({"snapshot": snap["id"]})),
    );
    assert_eq!(
        (s, v["code"].as_str()),
        (400, Some("invalid_request")),
        "{v}"
    );
    d.delete(&c);
    d.delete(&id);
    d.ok(
        "DELETE",
        &format!("/v1/snapshots/{}?recursive=true", sid(&snap)),
        json!(null),
    );
    assert_eq!(d.layers(), 0);
}

/// A snapshot (and a fork) with `trajectory` + `step` is a logged step: replayed, never
/// retaken; the snapshot records its trajectory and step.
#[test]
fn snapshots_are_trajectory_steps() {
    let d = Daemon::fresh("traj", &[]);
    let id = d.create(json!({}));
    let body = json!({"trajectory": "tj-snap", "step": 1, "labels": {"k": "v"}});
    let s1 = d.ok(
        "POST",
        &format!("/v1/sandboxes/{id}/snapshots"),
        body.clone(),
    );
    assert_eq!(
        (s1["trajectory"].as_str(), s1["step"].as_u64()),
        (Some("tj-snap"), Some(1)),
        "{s1}"
    );
    let again = d.ok("POST", &format!("/v1/sandboxes/{id}/snapshots"), body);
    assert_eq!(again["id"], s1["id"], "replayed, not retaken");
    let listed = d.ok("GET", &format!("/v1/snapshots?sandbox={id}"), json!(null));
    assert_eq!(listed["items"].as_array().map(Vec::len), Some(1));
    let f = d.ok(
        "POST",
        &format!("/v1/sandboxes/{id}/fork"),
        json!({"count": 1, "trajectory": "tj-snap", "step": 2}),
    );
    let fs = d.ok(
        "GET",
        &format!("/v1/snapshots/{}", sid(&f["snapshot"])),
        json!(null),
    );
    assert_eq!(
        (fs["trajectory"].as_str(), fs["step"].as_u64()),
        (Some("tj-snap"), Some(2)),
        "{fs}"
    );
    let recs = d.ok("GET", "/v1/trajectories/tj-snap/records", json!(null));
    let text = recs.to_string();
    assert!(
        text.contains("\"snapshot\"") && text.contains("\"fork\""),
        "{recs}"
    );
    for k in f["sandboxes"].as_array().expect("sandboxes") {
        d.delete(&sid(k));
    }
    d.delete(&id);
}
