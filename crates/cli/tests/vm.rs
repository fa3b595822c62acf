//! `dsec server` with VM sandboxes (`microvm`): what the daemon's own process table and the VM
//! cache look like after VMs come and go. Slow under TCG (the first run builds the VM cache:
//! kernel, initramfs, root image, template snapshot).
//!
//! Needs root (cgroups, QEMU); CI runs as root.

use std::path::Path;
use std::time::Duration;

use dsec_testkit as testkit;
use serde_json::{json, Value};

testkit::daemon_type!(
    /// A daemon of these tests on its own state dirs (removed when it drops).
    struct Daemon
);

impl Daemon {
    fn start(tag: &str) -> Self {
        let (data, run) = testkit::dirs("dvm", tag);
        Self::of(
            testkit::Server::test(env!("CARGO_BIN_EXE_dsec"), &data, &run),
            &data,
        )
    }

    /// The daemon `server` starts on the state dir `data`.
    fn of(server: testkit::Server, data: &Path) -> Self {
        let d = server
            .args(&["--pool-max", "0"])
            .timeout(Duration::from_secs(600))
            .remove_on_drop(data.parent().unwrap_or(data))
            .start()
            .expect("start dsec server");
        Self(d)
    }

    /// [`testkit::Daemon::req`]; a POST without body sends `null`.
    fn req(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let body = body.or_else(|| (method == "POST").then_some(Value::Null));
        self.0.req(method, path, body.as_ref())
    }

    fn stop(mut self) {
        self.0.stop();
    }
}

/// The children of `pid` (every thread's) that are zombies: exited, not yet waited for.
fn zombie_children(pid: u32) -> Vec<String> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("tasks")
        .flatten()
    {
        let children = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
        for child in children.split_whitespace() {
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{child}/stat")) else {
                continue;
            };
            if stat
                .rsplit_once(") ")
                .is_some_and(|(_, r)| r.starts_with('Z'))
            {
                out.push(stat.trim().to_owned());
            }
        }
    }
    out
}

/// Every QEMU the daemon starts is reaped: the template boot's, each sandbox's, the one a reset
/// replaces. After N creates, resets and destroys the daemon has no zombie child (each used to
/// stay `[qemu-system-x86] <defunct>` until the daemon exited).
#[test]
fn vm_creates_resets_and_destroys_leave_no_zombie_children() {
    let d = Daemon::start("zombies");
    const N: usize = 3;
    for i in 0..N {
        let (s, v) = d.req(
            "POST",
            "/v1/sandboxes",
            Some(json!({"substrate": "microvm"})),
        );
        assert_eq!(s, 201, "create {i}: {v}");
        let id = v["id"].as_str().expect("id").to_owned();
        let (s, v) = d.req(
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            Some(json!({"shell": "echo ok"})),
        );
        assert_eq!(
            (s, v["stdout"]["data"].as_str()),
            (200, Some("ok\n")),
            "{v}"
        );
        let (s, v) = d.req("POST", &format!("/v1/sandboxes/{id}/reset"), None);
        assert_eq!(s, 200, "reset {i}: {v}");
        let (s, v) = d.req("DELETE", &format!("/v1/sandboxes/{id}"), None);
        assert_eq!(s, 200, "delete {i}: {v}");
    }
    let zombies = zombie_children(d.child.id());
    assert!(
        zombies.is_empty(),
        "zombie children of the daemon: {zombies:#?}"
    );
    d.stop();
}

/// `dsec vm gc` on a cache of its own: entries of the earlier format (ext4 root images) and
/// unused entries go, an entry a process holds open stays, and the answer says what was freed.
#[test]
fn vm_gc_removes_unused_and_old_format_entries_and_reports_bytes() {
    let cache = tempfile::tempdir().expect("cache dir");
    let c = cache.path();
    for d in ["root", "rootfs/src", "initrd", "snap/s1"] {
        std::fs::create_dir_all(c.join(d)).expect("mkdir");
    }
    std::fs::write(c.join("root/host-old.ext4"), vec![1u8; 1 << 20]).expect("legacy image");
    std::fs::write(c.join("rootfs/unused.sqfs"), vec![2u8; 256 << 10]).expect("image");
    std::fs::write(c.join("rootfs/held.sqfs"), vec![3u8; 64 << 10]).expect("image");
    std::fs::write(c.join("rootfs/src/k"), "unused.sqfs").expect("pointer");
    std::fs::write(c.join("initrd/i.cpio"), vec![4u8; 4096]).expect("initrd");
    let held = std::fs::File::open(c.join("rootfs/held.sqfs")).expect("hold");
    let gc = |args: &[&str]| -> (Value, Vec<(String, String)>) {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_dsec"))
            .args(["vm", "gc"])
            .args(args)
            .env("DSEC_VM_CACHE", c)
            .output()
            .expect("dsec vm gc");
        assert!(out.status.success(), "{out:?}");
        let v: Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
        let mut removed: Vec<(String, String)> = v["removed"]
            .as_array()
            .expect("removed")
            .iter()
            .map(|r| {
                let p = r["path"].as_str().unwrap_or_default();
                let name = Path::new(p)
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned());
                (
                    name.unwrap_or_default(),
                    r["reason"].as_str().unwrap_or_default().to_owned(),
                )
            })
            .collect();
        removed.sort();
        (v, removed)
    };
    // Runs gc with `args`: it removes exactly `want` (name, reason) and frees at least
    // `min_freed` bytes.
    let gc_removes = |args: &[&str], want: [(&str, &str); 2], min_freed: u64| {
        let (v, removed) = gc(args);
        let want: Vec<(String, String)> = want
            .iter()
            .map(|&(name, reason)| (name.to_owned(), reason.to_owned()))
            .collect();
        assert_eq!(removed, want, "{v}");
        let freed = v["bytes_freed"].as_u64().expect("bytes_freed");
        assert!(freed >= min_freed, "{v}");
        v
    };
    // Under a bound the cache already fits: only the earlier format goes.
    let legacy = [("host-old.ext4", "legacy"), ("s1", "legacy")];
    gc_removes(&["--max-bytes", "100M"], legacy, 1 << 20);
    // Without one: everything no process uses.
    let v = gc_removes(
        &[],
        [("i.cpio", "idle"), ("unused.sqfs", "idle")],
        256 << 10,
    );
    assert_eq!(
        (v["kept"].as_u64(), v["in_use"].as_u64()),
        (Some(1), Some(1)),
        "{v}"
    );
    assert!(c.join("rootfs/held.sqfs").exists());
    assert!(
        !c.join("rootfs/src/k").exists(),
        "the pointer to a removed image goes"
    );
    drop(held);
}

/// A VM create that has to prepare its template's snapshot shows `"phase": "preparing"` while
/// it does, and the server log names each step. The daemon gets a VM cache of its own (hard
/// links to the shared cache's kernel and root images, when there are any), so the template
/// boot happens in this test whatever the shared cache holds.
#[test]
fn a_create_that_prepares_its_snapshot_shows_the_preparing_phase() {
    // Short: QEMU's sockets go under it (108 bytes at most).
    let cache = std::path::PathBuf::from(format!("/var/cache/dt{}", std::process::id()));
    let log = std::path::PathBuf::from(format!("/tmp/dvm-phase-{}.log", std::process::id()));
    let _cleanup = Cleanup(vec![cache.clone(), log.clone()]);
    let _ = std::fs::remove_dir_all(&cache);
    std::fs::create_dir_all(&cache).expect("cache dir");
    let shared = Path::new("/var/cache/dsec/vm");
    for sub in ["kernel", "rootfs"] {
        if shared.join(sub).is_dir() {
            let st = std::process::Command::new("cp")
                .arg("-al")
                .arg(shared.join(sub))
                .arg(cache.join(sub))
                .status()
                .expect("cp -al");
            assert!(st.success(), "hard-link the shared {sub}");
        }
    }
    let (data, run) = testkit::dirs("dvm", "phase");
    let cache_env = cache.display().to_string();
    let server = testkit::Server::test(env!("CARGO_BIN_EXE_dsec"), &data, &run)
        .env("DSEC_VM_CACHE", &cache_env)
        .log_to(&log);
    let d = Daemon::of(server, &data);
    let phases = std::thread::scope(|s| {
        let create = s.spawn(|| {
            d.req(
                "POST",
                "/v1/sandboxes",
                Some(json!({"substrate": "microvm"})),
            )
        });
        let mut seen = Vec::new();
        while !create.is_finished() {
            let (_, v) = d.req("GET", "/v1/sandboxes?state=creating", None);
            for it in v["items"].as_array().into_iter().flatten() {
                seen.push((it["state"].to_string(), it["phase"].to_string()));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let (s, v) = create.join().expect("create");
        assert_eq!(s, 201, "{v}");
        assert!(v["phase"].is_null(), "a made sandbox has no phase: {v}");
        let (s, v) = d.req(
            "DELETE",
            &format!("/v1/sandboxes/{}", v["id"].as_str().expect("id")),
            None,
        );
        assert_eq!(s, 200, "{v}");
        seen
    });
    assert!(
        phases.contains(&("\"creating\"".to_owned(), "\"preparing\"".to_owned())),
        "{phases:?}"
    );
    d.stop();
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        text.contains(r#""msg":"vm: preparing","phase":"template boot""#),
        "{text}"
    );
    assert!(
        text.contains(r#""msg":"vm: prepared","phase":"template boot""#),
        "{text}"
    );
}

/// Removes its paths when dropped (a failed test too).
struct Cleanup(Vec<std::path::PathBuf>);

impl Drop for Cleanup {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_dir_all(p);
            let _ = std::fs::remove_file(p);
        }
    }
}
