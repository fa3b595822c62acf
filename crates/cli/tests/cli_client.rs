//! The `dsec sandbox|pool|tenant` client against a real `dsec server`: output, exit codes of
//! commands and of dsec's own failures, and the hints it prints.
//!
//! Needs root (namespaces, cgroups, mounts); CI runs as root.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use dsec_testkit as testkit;
use serde_json::Value;

testkit::daemon_type!(
    /// A daemon of these tests, driven through the `dsec` client.
    struct Daemon
);

/// What one `dsec` invocation did.
struct Out {
    code: i32,
    stdout: Vec<u8>,
    stderr: String,
}

impl Out {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.stdout)
            .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {}", self.text()))
    }
}

impl std::fmt::Debug for Out {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exit {}\n--- stdout\n{}\n--- stderr\n{}",
            self.code,
            self.text(),
            self.stderr
        )
    }
}

/// Runs `dsec ARGS` against `url` with `key`, feeding `stdin`.
fn dsec_at(url: &str, key: Option<&str>, args: &[&str], stdin: &[u8]) -> Out {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_dsec"));
    cmd.args(args)
        .env("DSEC_URL", url)
        .env_remove("DSEC_API_KEY")
        .env_remove("DSEC_DATA_DIR")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(k) = key {
        cmd.env("DSEC_API_KEY", k);
    }
    let mut child = cmd.spawn().expect("spawn dsec");
    let mut input = child.stdin.take().expect("stdin");
    let data = stdin.to_vec();
    let feeder = std::thread::spawn(move || {
        let _ = input.write_all(&data);
    });
    let out = child.wait_with_output().expect("wait dsec");
    let _ = feeder.join();
    Out {
        code: out.status.code().unwrap_or(-1),
        stdout: out.stdout,
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

impl Daemon {
    fn start(data: &Path, run: &Path) -> Self {
        Self::start_with(data, run, &["--pool-max", "0"])
    }

    fn start_with(data: &Path, run: &Path, args: &[&str]) -> Self {
        let d = testkit::Server::test(env!("CARGO_BIN_EXE_dsec"), data, run)
            .args(&["--drain-seconds", "10"])
            .args(args)
            .start()
            .expect("start dsec server");
        Self(d)
    }

    /// `dsec ARGS` with the admin key.
    fn dsec(&self, args: &[&str]) -> Out {
        dsec_at(&self.url, Some(&self.key), args, b"")
    }

    /// `dsec ARGS` with the admin key, asserting exit 0.
    fn ok(&self, args: &[&str]) -> Out {
        let out = self.dsec(args);
        assert_eq!(out.code, 0, "dsec {args:?}: {out:?}");
        out
    }

    /// Ids `dsec sandbox list --json` shows for `key`.
    fn listed(&self, key: &str) -> BTreeSet<String> {
        let out = dsec_at(&self.url, Some(key), &["sandbox", "list", "--json"], b"");
        assert_eq!(out.code, 0, "list: {out:?}");
        out.json()
            .as_array()
            .expect("an array")
            .iter()
            .map(|s| s["id"].as_str().expect("id").to_owned())
            .collect()
    }

    /// Destroys the admin's sandboxes, checks nothing is left and stops the daemon (SIGTERM,
    /// exit 0).
    fn finish(mut self) {
        for id in self.listed(&self.key.clone()) {
            self.ok(&["sandbox", "kill", &id]);
        }
        let left = self.run_dirs();
        assert!(left.is_empty(), "left on the machine: {left:?}");
        self.stop();
        self.remove_dirs();
    }
}

#[test]
fn sandbox_lifecycle_output_and_exit_codes() {
    let (data, run) = testkit::dirs("dcl", "life");
    let d = Daemon::start(&data, &run);

    let id = d
        .ok(&[
            "sandbox",
            "create",
            "--memory",
            "256M",
            "--label",
            "suite=cli",
            "--env",
            "GREETING=hello",
        ])
        .text()
        .trim()
        .to_owned();
    assert!(id.starts_with("sb-"), "an id: {id}");

    // list: the table and the JSON items.
    let table = d.ok(&["sandbox", "list"]).text();
    let mut lines = table.lines();
    let header: Vec<&str> = lines.next().expect("header").split_whitespace().collect();
    assert_eq!(
        header,
        ["ID", "STATE", "TEMPLATE", "SUBSTRATE", "AGE", "LABELS"]
    );
    let row: Vec<&str> = lines.next().expect("a row").split_whitespace().collect();
    assert_eq!(row[0], id);
    assert_eq!(row[1], "running");
    assert_eq!(row[2], "host");
    assert_eq!(row[3], "container");
    assert_eq!(row[5], "suite=cli");
    assert_eq!(lines.next(), None, "one sandbox: {table}");
    assert_eq!(d.listed(&d.key), BTreeSet::from([id.clone()]));
    let filtered = d.ok(&["sandbox", "list", "--json", "--label", "suite=other"]);
    assert_eq!(filtered.json(), serde_json::json!([]));

    // get: key: value and JSON.
    let got = d.ok(&["sandbox", "get", &id]).text();
    assert!(
        got.lines()
            .any(|l| l.starts_with("id:") && l.ends_with(id.as_str())),
        "{got}"
    );
    assert!(
        got.lines()
            .any(|l| l.starts_with("limits.memory_max:") && l.ends_with("256M")),
        "{got}"
    );
    assert_eq!(
        d.ok(&["sandbox", "get", &id, "--json"]).json()["id"],
        id.as_str()
    );

    // exec: output on the right streams, exit codes propagated.
    let out = d.ok(&[
        "sandbox",
        "exec",
        &id,
        "--",
        "sh",
        "-c",
        "echo $GREETING; echo err >&2",
    ]);
    assert_eq!(out.text(), "hello\n");
    assert_eq!(out.stderr, "err\n");
    let out = d.dsec(&["sandbox", "exec", &id, "--shell", "echo before; exit 3"]);
    assert_eq!(out.code, 3, "{out:?}");
    assert_eq!(out.text(), "before\n");
    let out = d.dsec(&[
        "sandbox",
        "exec",
        &id,
        "--timeout",
        "1",
        "--",
        "sleep",
        "30",
    ]);
    assert_eq!(out.code, 124, "{out:?}");
    assert!(out.stderr.contains("timed out"), "{out:?}");
    let out = d.ok(&[
        "sandbox",
        "exec",
        &id,
        "--cwd",
        "/tmp",
        "--env",
        "X=1",
        "--",
        "sh",
        "-c",
        "pwd; echo $X",
    ]);
    assert_eq!(out.text(), "/tmp\n1\n");
    let fed = dsec_at(
        &d.url,
        Some(&d.key),
        &["sandbox", "exec", &id, "--stdin", "-", "--", "wc", "-c"],
        b"12345",
    );
    assert_eq!((fed.code, fed.text().trim()), (0, "5"), "{fed:?}");

    // exec --stream: output as it arrives, then the exit code.
    let out = d.dsec(&[
        "sandbox",
        "exec",
        &id,
        "--stream",
        "--shell",
        "echo one; sleep 0.2; echo two >&2; echo three; exit 5",
    ]);
    assert_eq!(out.code, 5, "{out:?}");
    assert_eq!(out.text(), "one\nthree\n");
    assert_eq!(out.stderr, "two\n");
    let out = d.dsec(&[
        "sandbox",
        "exec",
        &id,
        "--stream",
        "--timeout",
        "500ms",
        "--",
        "sleep",
        "30",
    ]);
    assert_eq!(out.code, 124, "{out:?}");

    // files: a binary roundtrip through write/read, ls, rm.
    let bytes: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
    let local = data.parent().expect("base").join("blob.bin");
    std::fs::write(&local, &bytes).expect("write blob");
    d.ok(&[
        "sandbox",
        "files",
        &id,
        "write",
        "/tmp/x/blob.bin",
        "-p",
        "--from",
        local.to_str().expect("utf-8"),
    ]);
    let read = d.ok(&["sandbox", "files", &id, "read", "/tmp/x/blob.bin"]);
    assert!(
        read.stdout == bytes,
        "read back {} bytes",
        read.stdout.len()
    );
    let piped = dsec_at(
        &d.url,
        Some(&d.key),
        &[
            "sandbox",
            "files",
            &id,
            "write",
            "/tmp/x/p.bin",
            "--mode",
            "600",
        ],
        &[0, 159, 146, 150, 255],
    );
    assert_eq!(piped.code, 0, "{piped:?}");
    let back = d.ok(&["sandbox", "files", &id, "read", "/tmp/x/p.bin"]);
    assert_eq!(back.stdout, [0, 159, 146, 150, 255]);
    let ls = d.ok(&["sandbox", "files", &id, "ls", "/tmp/x"]).text();
    assert!(
        ls.contains("blob.bin") && ls.contains("70000") && ls.contains("0600"),
        "{ls}"
    );
    let tar = d.ok(&["sandbox", "files", &id, "download", "/tmp/x"]);
    assert!(
        tar.stdout.len() > 70_000,
        "a tar: {} bytes",
        tar.stdout.len()
    );
    let tar_path = data.parent().expect("base").join("x.tar");
    // `dsec sandbox files ID <op> <path> <flag> <file>`, asserting its exit code.
    let files = |op: &str, path: &str, flag: &str, file: &Path, code: i32| {
        let file = file.to_str().expect("utf-8");
        let out = d.dsec(&["sandbox", "files", &id, op, path, flag, file]);
        assert_eq!(out.code, code, "{op} {path}: {out:?}");
        out
    };
    let to_file = files("download", "/tmp/x", "-o", &tar_path, 0);
    assert!(to_file.stdout.is_empty(), "{to_file:?}");
    assert_eq!(
        std::fs::read(&tar_path).expect("read tar").len(),
        tar.stdout.len(),
        "-o writes the same archive"
    );
    let nothing = data.parent().expect("base").join("nothing.tar");
    files("download", "/no/such/dir", "-o", &nothing, 3);
    assert!(!nothing.exists(), "no file is made for a failed download");
    files("upload", "/tmp/y", "--tar", &tar_path, 0);
    let copy = d.ok(&["sandbox", "files", &id, "read", "/tmp/y/blob.bin"]);
    assert!(copy.stdout == bytes, "the tar roundtrip keeps the bytes");
    d.ok(&["sandbox", "files", &id, "rm", "/tmp/x", "-r"]);
    let gone = d.dsec(&["sandbox", "files", &id, "read", "/tmp/x/blob.bin"]);
    assert_eq!(gone.code, 3, "{gone:?}");

    // reset: the writable layer is fresh.
    d.ok(&["sandbox", "reset", &id]);
    let after = d.dsec(&["sandbox", "files", &id, "read", "/tmp/y/blob.bin"]);
    assert_eq!(after.code, 3, "{after:?}");

    // kill by id, then a batch by label.
    assert_eq!(d.ok(&["sandbox", "kill", &id]).text(), format!("{id}\n"));
    assert!(d.listed(&d.key).is_empty());
    let batch = d
        .ok(&["sandbox", "create", "--count", "3", "--label", "set=b"])
        .text();
    let made: BTreeSet<String> = batch.lines().map(str::to_owned).collect();
    assert_eq!(made.len(), 3, "{batch}");
    assert_eq!(d.listed(&d.key), made);
    let killed = d.ok(&["sandbox", "kill", "--label", "set=b"]).text();
    assert_eq!(
        killed.lines().map(str::to_owned).collect::<BTreeSet<_>>(),
        made
    );
    let table = d.ok(&["sandbox", "list"]).text();
    assert_eq!(table.lines().count(), 1, "only the header: {table}");
    assert_eq!(
        d.ok(&["sandbox", "list", "--json"]).json(),
        serde_json::json!([])
    );

    d.finish();
}

#[test]
fn failures_name_their_fix_and_exit_with_documented_codes() {
    let (data, run) = testkit::dirs("dcl", "err");
    let d = Daemon::start(&data, &run);

    let bad = dsec_at(&d.url, Some("not-a-key"), &["sandbox", "list"], b"");
    assert_eq!(bad.code, 4, "{bad:?}");
    assert!(bad.stderr.contains("dsec: unauthorized: "), "{bad:?}");
    assert!(bad.stderr.contains("(request "), "{bad:?}");
    assert!(
        bad.stderr.contains("--api-key") && bad.stderr.contains("DSEC_API_KEY"),
        "{bad:?}"
    );

    // Without --api-key the admin key is read from <data-dir>/admin.key.
    let own = dsec_at(
        &d.url,
        None,
        &[
            "--data-dir",
            data.to_str().expect("utf-8"),
            "sandbox",
            "list",
            "--json",
        ],
        b"",
    );
    assert_eq!(own.code, 0, "{own:?}");

    let missing = d.dsec(&["sandbox", "get", "sb-0000000000000000"]);
    assert_eq!(missing.code, 3, "{missing:?}");
    assert!(missing.stderr.contains("sandbox_not_found"), "{missing:?}");
    assert!(missing.stderr.contains("dsec sandbox list"), "{missing:?}");
    let exec_missing = d.dsec(&["sandbox", "exec", "sb-0000000000000000", "--", "true"]);
    assert_eq!(exec_missing.code, 3, "{exec_missing:?}");

    let usage = d.dsec(&["sandbox", "create", "--memory", "12Q"]);
    assert_eq!(usage.code, 2, "{usage:?}");
    let invalid = d.dsec(&["sandbox", "create", "--template", "../x"]);
    assert_eq!(invalid.code, 2, "{invalid:?}");
    assert!(invalid.stderr.contains("invalid_request"), "{invalid:?}");

    // A tenant with a quota: its key sees none of the admin's sandboxes; the second create is
    // refused with quota_exceeded (exit 5); admin-only calls are forbidden (exit 4).
    let key = d
        .ok(&[
            "tenant",
            "create",
            "tenant-a",
            "--max-sandboxes",
            "1",
            "--max-memory",
            "1G",
        ])
        .text()
        .trim()
        .to_owned();
    assert!(!key.is_empty());
    let tenants = d.ok(&["tenant", "list"]).text();
    assert!(
        tenants.contains("tenant-a") && tenants.contains("1G"),
        "{tenants}"
    );
    let t = |args: &[&str]| dsec_at(&d.url, Some(&key), args, b"");
    let first = t(&["sandbox", "create"]);
    assert_eq!(first.code, 0, "{first:?}");
    let sb = first.text().trim().to_owned();
    let over = t(&["sandbox", "create"]);
    assert_eq!(over.code, 5, "{over:?}");
    assert!(over.stderr.contains("quota_exceeded"), "{over:?}");
    assert!(over.stderr.contains("dsec sandbox rm"), "{over:?}");
    let admin_only = t(&["tenant", "list"]);
    assert_eq!(admin_only.code, 4, "{admin_only:?}");
    // The admin tenant is the operator: it reaches every tenant's sandboxes.
    let theirs = d.dsec(&["sandbox", "get", &sb]);
    assert_eq!(
        theirs.code, 0,
        "the admin sees a tenant's sandbox: {theirs:?}"
    );
    assert_eq!(t(&["sandbox", "kill", &sb]).code, 0);
    assert!(d.listed(&key).is_empty());

    // pools
    let set = d
        .ok(&["pool", "set", "host", "--min", "0", "--max", "2"])
        .text();
    assert!(set.contains("host"), "{set}");
    let pools = d.ok(&["pool", "list"]).text();
    assert!(pools.starts_with("TEMPLATE"), "{pools}");

    d.finish();
}

#[test]
fn unreachable_daemon_exits_6_with_a_hint() {
    let port = testkit::free_port();
    let url = format!("http://127.0.0.1:{port}");
    let out = dsec_at(&url, Some("k"), &["sandbox", "list"], b"");
    assert_eq!(out.code, 6, "{out:?}");
    assert!(out.stderr.contains("cannot reach the daemon"), "{out:?}");
    assert!(out.stderr.contains("dsec server"), "{out:?}");
    let exec = dsec_at(
        &url,
        Some("k"),
        &["sandbox", "exec", "sb-1", "--stream", "--", "true"],
        b"",
    );
    assert_eq!(exec.code, 6, "{exec:?}");
}

/// The tar layer dirs of the node's layer store.
fn layer_dirs(data: &Path) -> BTreeSet<String> {
    testkit::entry_names(&data.join("layers"))
}

/// `dsec template rm` through the daemon: refused while a sandbox uses the template, then the
/// template's own layers go and a layer another template shares stays.
#[test]
fn template_rm_removes_the_layers_no_other_template_uses() {
    let (data, run) = testkit::dirs("dcl", "tpl");
    let d = Daemon::start(&data, &run);
    let base = data.parent().expect("base").to_owned();
    let shared = testkit::rootfs_tarball(&base, "shared", "shared\n");
    let own = testkit::rootfs_tarball(&base, "own", "own\n");
    let before = layer_dirs(&data);
    // `push` tells a plain root filesystem from an image without --rootfs.
    for (name, tarball) in [("one", &shared), ("two", &shared), ("solo", &own)] {
        let out = d.ok(&["template", "push", name, tarball.to_str().expect("utf-8")]);
        assert!(out.stderr.contains("a root filesystem tarball"), "{out:?}");
    }
    let added: BTreeSet<String> = layer_dirs(&data).difference(&before).cloned().collect();
    assert_eq!(added.len(), 2, "one layer per distinct tarball: {added:?}");

    let id = d
        .ok(&["sandbox", "create", "--template", "solo"])
        .text()
        .trim()
        .to_owned();
    let busy = d.dsec(&["template", "rm", "solo"]);
    assert_eq!(busy.code, 7, "in use is a conflict: {busy:?}");
    assert!(busy.stderr.contains("in use"), "{busy:?}");
    assert_eq!(layer_dirs(&data), &before | &added, "nothing removed");
    d.ok(&["sandbox", "rm", &id]);

    let solo_layers = layer_dirs(&data);
    d.ok(&["template", "rm", "solo"]);
    let after_solo = layer_dirs(&data);
    assert_eq!(
        solo_layers.difference(&after_solo).count(),
        1,
        "solo's layer is gone"
    );
    d.ok(&["template", "rm", "one"]);
    assert_eq!(
        layer_dirs(&data),
        after_solo,
        "the layer `two` shares stays"
    );
    let out = d.ok(&["sandbox", "create", "--template", "two"]);
    let twin = out.text().trim().to_owned();
    let motd = d.ok(&["sandbox", "files", &twin, "read", "/etc/motd"]);
    assert_eq!(motd.text(), "shared\n");
    d.ok(&["sandbox", "rm", &twin]);
    d.ok(&["template", "rm", "two"]);
    assert_eq!(layer_dirs(&data), before, "every imported layer is gone");

    let missing = d.dsec(&["template", "rm", "two"]);
    assert_eq!(missing.code, 3, "{missing:?}");
    let builtin = d.dsec(&["template", "rm", "host"]);
    assert_eq!(builtin.code, 2, "{builtin:?}");
    d.finish();
}

/// A known path asked with a method it does not take answers 405 as a problem document with
/// a stable code and an `Allow` header; an unknown path 404 `not_found`.
#[test]
fn wrong_methods_answer_problem_documents() {
    let (data, run) = testkit::dirs("dcl", "405");
    let d = Daemon::start(&data, &run);
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into();
    let ask = |method: &str, path: &str| {
        let req = ureq::http::Request::builder()
            .method(method)
            .uri(format!("{}{path}", d.url))
            .header("X-API-Key", &d.key)
            .body(Vec::new())
            .expect("request");
        let mut r = agent.run(req).expect("http");
        let allow = r
            .headers()
            .get("allow")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let ct = r
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        let body: Value = serde_json::from_slice(&r.body_mut().read_to_vec().unwrap_or_default())
            .unwrap_or(Value::Null);
        (r.status().as_u16(), ct, allow, body)
    };
    let (s, ct, allow, v) = ask("PUT", "/v1/sandboxes");
    assert_eq!((s, ct.as_str()), (405, "application/problem+json"), "{v}");
    assert_eq!(v["code"], "method_not_allowed", "{v}");
    assert_eq!(v["status"], 405, "{v}");
    assert!(
        v["request_id"].as_str().is_some_and(|r| !r.is_empty()),
        "{v}"
    );
    let allow = allow.expect("an Allow header");
    let methods: BTreeSet<&str> = allow.split(',').map(str::trim).collect();
    assert!(
        methods.contains("GET") && methods.contains("POST") && !methods.contains("PUT"),
        "{allow}"
    );
    // Every path of the API document: PATCH is taken nowhere.
    let (_, _, _, doc) = ask("GET", "/openapi.json");
    for path in doc["paths"].as_object().expect("paths").keys() {
        let concrete = testkit::concrete_path(path).replace("{key}", "k");
        let (s, ct, allow, v) = ask("PATCH", &concrete);
        assert_eq!(
            (s, ct.as_str(), v["code"].as_str()),
            (405, "application/problem+json", Some("method_not_allowed")),
            "PATCH {path}: {v}"
        );
        assert!(
            allow.is_some_and(|a| !a.is_empty()),
            "PATCH {path}: no Allow"
        );
    }
    let (s, ct, _, v) = ask("GET", "/v1/no-such-thing");
    assert_eq!(
        (s, ct.as_str(), v["code"].as_str()),
        (404, "application/problem+json", Some("not_found")),
        "{v}"
    );
    d.finish();
}

/// `dsec sandbox list` shows the substrate and the age since the tenant got the sandbox (a
/// pooled one was built earlier); `dsec sandbox rm --all` destroys every sandbox of the key's
/// tenant; `dsec server --shutdown-sandboxes` destroys the rest (the pool's) on SIGTERM.
#[test]
fn list_ages_rm_all_and_shutdown_sandboxes() {
    let (data, run) = testkit::dirs("dcl", "all");
    let mut d = Daemon::start_with(
        &data,
        &run,
        &["--pool-min", "1", "--pool-max", "2", "--shutdown-sandboxes"],
    );
    let ready = |d: &Daemon| d.ok(&["pool", "list", "--json"]).json()[0]["ready"].as_u64();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while ready(&d) != Some(1) {
        assert!(
            std::time::Instant::now() < deadline,
            "the pool fills: {:?}",
            d.ok(&["pool", "list"])
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    // The pooled sandbox is at least 3 s old when it is handed over.
    std::thread::sleep(std::time::Duration::from_secs(3));
    let first = d.ok(&["sandbox", "create", "--json"]).json();
    assert_eq!(first["pooled"], true, "{first}");
    assert!(
        first["acquired_at"].as_str() > first["created_at"].as_str(),
        "acquired after it was built: {first}"
    );
    let second = d
        .ok(&["sandbox", "create", "--label", "k=v"])
        .text()
        .trim()
        .to_owned();
    let table = d.ok(&["sandbox", "list"]).text();
    let rows: Vec<Vec<&str>> = table
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(rows.len(), 2, "{table}");
    for row in &rows {
        assert_eq!(row[3], "container", "{table}");
        assert!(
            matches!(row[4], "0s" | "1s" | "2s"),
            "age since acquisition: {table}"
        );
    }
    let removed: BTreeSet<String> = d
        .ok(&["sandbox", "rm", "--all"])
        .text()
        .lines()
        .map(str::to_owned)
        .collect();
    let first_id = first["id"].as_str().expect("id").to_owned();
    assert_eq!(removed, BTreeSet::from([first_id, second]));
    assert!(d.listed(&d.key).is_empty());
    assert_eq!(
        d.ok(&["sandbox", "rm", "--all"]).text(),
        "",
        "nothing left to remove"
    );

    // One more of the admin's, plus the pool's: SIGTERM destroys them all, nothing is left.
    d.ok(&["sandbox", "create"]);
    // The pool refills in the background: wait for its new sandbox.
    let t0 = std::time::Instant::now();
    let mut mine = d.run_dirs();
    while mine.len() < 2 && t0.elapsed() < std::time::Duration::from_secs(20) {
        std::thread::sleep(std::time::Duration::from_millis(50));
        mine = d.run_dirs();
    }
    assert!(mine.len() >= 2, "the admin's and the pool's: {mine:?}");
    d.stop();
    let left = d.run_dirs();
    assert!(
        left.is_empty(),
        "sandboxes left after --shutdown-sandboxes: {left:?}"
    );
    let cgroups: Vec<String> = dsec_sys::cgroup::CgroupManager::detect("dsec")
        .and_then(|m| m.list())
        .unwrap_or_default()
        .into_iter()
        .filter(|c| mine.contains(c))
        .collect();
    assert!(cgroups.is_empty(), "cgroups left: {cgroups:?}");
    let _ = std::fs::remove_dir_all(data.parent().expect("base"));
}
