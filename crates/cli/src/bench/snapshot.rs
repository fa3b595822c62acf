//! `dsec bench snapshot`: container snapshots, forks, creates from snapshots, restores and
//! deep chains, through a `dsec server` child over HTTP (every figure includes its HTTP round
//! trip). Peers in the same run: `cp -a` of a directory like the sandbox's upper layer, a
//! cold create from the template, a reset.

use std::path::Path;
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use anyhow::Context;
use dsec_testkit as testkit;
use serde_json::{json, Value};

use super::{dist, emit, us, BenchArgs};

testkit::daemon_type!(
    /// The bench's `dsec server` (its dirs go with it).
    struct Daemon
);

impl Daemon {
    fn call(&self, method: &str, path: &str, body: Value) -> anyhow::Result<Value> {
        let (s, v) = self.req(method, path, Some(&body));
        anyhow::ensure!((200..300).contains(&s), "{method} {path}: {s} {v}");
        Ok(v)
    }

    fn create(&self, spec: Value) -> anyhow::Result<String> {
        let v = self.call("POST", "/v1/sandboxes", spec)?;
        Ok(v["id"].as_str().context("an id")?.to_owned())
    }

    fn delete(&self, id: &str) {
        let _ = self.req("DELETE", &format!("/v1/sandboxes/{id}"), None);
    }

    fn sh(&self, id: &str, shell: &str) -> anyhow::Result<()> {
        let v = self.call(
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            json!({ "shell": shell }),
        )?;
        anyhow::ensure!(v["exit_code"] == 0, "{shell}: {v}");
        Ok(())
    }

    /// A snapshot of `id`: its id and the microseconds it took.
    fn snapshot(&self, id: &str) -> anyhow::Result<(String, u64)> {
        let t = Instant::now();
        let v = self.call("POST", &format!("/v1/sandboxes/{id}/snapshots"), json!({}))?;
        let took = us(t);
        Ok((v["id"].as_str().context("an id")?.to_owned(), took))
    }

    fn drop_snapshot(&self, sn: &str) {
        let _ = self.req(
            "DELETE",
            &format!("/v1/snapshots/{sn}?recursive=true"),
            None,
        );
    }
}

/// Writes 100 files of 1 KiB under `dir` (the `cp -a` peer's source).
const HUNDRED: &str = "mkdir -p /workspace/h && for i in $(seq 100); do head -c 1024 /dev/urandom > /workspace/h/f$i; done";

/// `cp -a` of 100 files of 1 KiB from a tmpfs (as a sandbox's upper is) to the data dir's
/// file system (as a snapshot layer is), once: microseconds.
fn cp_a(src: &Path, dest: &Path) -> anyhow::Result<u64> {
    let _ = std::fs::remove_dir_all(dest);
    let t = Instant::now();
    let st = Command::new("cp").arg("-a").arg(src).arg(dest).status()?;
    let took = us(t);
    anyhow::ensure!(st.success(), "cp -a");
    Ok(took)
}

/// Runs the snapshot benchmark.
pub fn run(args: &BenchArgs) -> anyhow::Result<ExitCode> {
    let (data, run, _cleanup) = testkit::dirs_removed_on_drop("dsec-bench-snapshot", "b");
    let d = Daemon(
        testkit::Server::new(std::env::current_exe()?, &data, &run)
            .args(&["--pool-max", "0"])
            .timeout(Duration::from_secs(300))
            .start()?,
    );
    let n = args.iterations.max(5);
    let mut out = serde_json::Map::new();

    // Snapshots of an untouched sandbox and of one that wrote 100 files, with the peer.
    let id = d.create(json!({}))?;
    let mut zero = Vec::new();
    for _ in 0..n {
        let (sn, t) = d.snapshot(&id)?;
        zero.push(t);
        d.drop_snapshot(&sn);
    }
    d.sh(&id, HUNDRED)?;
    let shm = Path::new("/dev/shm").join(format!("dsec-bench-cp-{}", std::process::id()));
    std::fs::create_dir_all(&shm)?;
    for i in 0..100 {
        std::fs::write(shm.join(format!("f{i}")), [7u8; 1024])?;
    }
    let mut hundred = Vec::new();
    let mut cp = Vec::new();
    for _ in 0..n {
        let (sn, t) = d.snapshot(&id)?;
        hundred.push(t);
        d.drop_snapshot(&sn);
        cp.push(cp_a(&shm, &data.join("cp-peer"))?);
    }
    let _ = std::fs::remove_dir_all(&shm);
    let _ = std::fs::remove_dir_all(data.join("cp-peer"));
    let (hundred, cp) = (dist(hundred), dist(cp));
    out.insert("snapshot_0_files".into(), json!(dist(zero)));
    out.insert(
        "snapshot_100_files".into(),
        json!({"snapshot": &hundred, "cp_a_peer": &cp,
               "ratio_p50": hundred.p50_us as f64 / cp.p50_us.max(1) as f64}),
    );

    // Create from a snapshot vs a cold create from the template; restore vs reset.
    let (base, _) = d.snapshot(&id)?;
    let (mut cold, mut from) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let t = Instant::now();
        let a = d.create(json!({}))?;
        cold.push(us(t));
        let t = Instant::now();
        let b = d.create(json!({ "snapshot": base }))?;
        from.push(us(t));
        d.delete(&a);
        d.delete(&b);
    }
    let (cold, from) = (dist(cold), dist(from));
    out.insert(
        "create_from_snapshot".into(),
        json!({"from_snapshot": &from, "cold_create": &cold,
               "ratio_p50": from.p50_us as f64 / cold.p50_us.max(1) as f64}),
    );
    let (mut restore, mut reset) = (Vec::new(), Vec::new());
    for _ in 0..n {
        d.sh(&id, "echo x > /workspace/x")?;
        let t = Instant::now();
        d.call(
            "POST",
            &format!("/v1/sandboxes/{id}/restore"),
            json!({ "snapshot": base }),
        )?;
        restore.push(us(t));
        d.sh(&id, "echo x > /workspace/x")?;
        let t = Instant::now();
        d.call("POST", &format!("/v1/sandboxes/{id}/reset"), json!({}))?;
        reset.push(us(t));
    }
    let (restore, reset) = (dist(restore), dist(reset));
    out.insert(
        "restore".into(),
        json!({"restore": &restore, "reset": &reset,
               "ratio_p50": restore.p50_us as f64 / reset.p50_us.max(1) as f64}),
    );

    // Fork 16: from the request until all 16 answer running.
    let mut forks = Vec::new();
    for _ in 0..(n / 20).max(5) {
        let t = Instant::now();
        let v = d.call(
            "POST",
            &format!("/v1/sandboxes/{id}/fork"),
            json!({"count": 16}),
        )?;
        forks.push(us(t));
        let made = v["sandboxes"].as_array().context("sandboxes")?;
        anyhow::ensure!(made.len() == 16, "fork: {v}");
        for s in made {
            d.delete(s["id"].as_str().unwrap_or_default());
        }
        d.drop_snapshot(v["snapshot"]["id"].as_str().unwrap_or_default());
    }
    out.insert("fork_16_ms".into(), json!(dist(forks)));

    // A chain 100 deep: create from its leaf vs from its root.
    let chain = d.create(json!({}))?;
    let (root, _) = d.snapshot(&chain)?;
    let mut leaf = root.clone();
    for i in 0..99 {
        d.call(
            "POST",
            &format!("/v1/sandboxes/{chain}/restore"),
            json!({ "snapshot": leaf }),
        )?;
        d.sh(&chain, &format!("echo {i} > /workspace/c{i}"))?;
        leaf = d.snapshot(&chain)?.0;
    }
    let flat = testkit::cluster::wait(Duration::from_secs(60), || {
        d.req("GET", &format!("/v1/snapshots/{leaf}"), None).1["depth"]
            .as_u64()
            .is_some_and(|n| n <= 16)
    });
    let (mut at_root, mut at_leaf) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let t = Instant::now();
        let a = d.create(json!({ "snapshot": root }))?;
        at_root.push(us(t));
        let t = Instant::now();
        let b = d.create(json!({ "snapshot": leaf }))?;
        at_leaf.push(us(t));
        d.delete(&a);
        d.delete(&b);
    }
    let (at_root, at_leaf) = (dist(at_root), dist(at_leaf));
    out.insert(
        "chain_100".into(),
        json!({"from_leaf": &at_leaf, "from_root": &at_root, "flattened": flat,
               "ratio_p50": at_leaf.p50_us as f64 / at_root.p50_us.max(1) as f64}),
    );
    out.insert("microvm".into(), microvm(&d, (n / 10).max(5))?);
    d.delete(&chain);
    d.delete(&id);
    d.drop_snapshot(&root);
    d.drop_snapshot(&base);
    let doc = json!({"bench": "snapshot", "iterations": n, "results": Value::Object(out)});
    drop(d);
    emit(args, doc)
}

/// A running microVM's snapshot (its whole state: the guest was made and had a file written
/// and a Python session started) and a sandbox made from it, `n` times each.
fn microvm(d: &Daemon, n: usize) -> anyhow::Result<Value> {
    let id = d.create(json!({"substrate": "microvm"}))?;
    d.sh(&id, "echo x > /workspace/x")?;
    let session = d.call(
        "POST",
        &format!("/v1/sandboxes/{id}/sessions"),
        json!({"kind": "python"}),
    )?["session"]
        .as_u64()
        .context("a session")?;
    d.call(
        "POST",
        &format!("/v1/sandboxes/{id}/sessions/{session}/run"),
        json!({"input": "x = 41"}),
    )?;
    let (mut snaps, mut forks, mut bytes) = (Vec::new(), Vec::new(), 0);
    for _ in 0..n {
        let (sn, t) = d.snapshot(&id)?;
        snaps.push(t);
        bytes = d.req("GET", &format!("/v1/snapshots/{sn}"), None).1["size_bytes"]
            .as_u64()
            .unwrap_or(0);
        let t = Instant::now();
        let k = d.create(json!({ "snapshot": sn }))?;
        forks.push(us(t));
        let v = d.call(
            "POST",
            &format!("/v1/sandboxes/{k}/sessions/{session}/run"),
            json!({"input": "print(x + 1)"}),
        )?;
        anyhow::ensure!(
            v["stdout"]["data"] == "42\n",
            "the fork lost the guest's memory: {v}"
        );
        d.delete(&k);
        d.drop_snapshot(&sn);
    }
    d.delete(&id);
    Ok(
        json!({"snapshot": dist(snaps), "fork_one": dist(forks), "snapshot_bytes": bytes,
              "savevm_peer": "not applicable: savevm needs every writable disk in qcow2 and \
                              the guest's RAM in one of them"}),
    )
}
