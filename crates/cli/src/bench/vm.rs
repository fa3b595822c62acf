//! `dsec bench vm`: the `microvm` and `vm` substrates measured through HTTP from a separate
//! process, printed as JSON with the targets next to the figures.
//!
//! The bench starts `dsec server` as a child on fresh state dirs (the VM cache, `DSEC_VM_CACHE`,
//! passes through, so a warm cache is reused) and measures in one run:
//! - `snapshot`: the first create of a key nobody has used (a random guest RAM size), which
//!   boots the template to agent-ready and saves it, for `microvm` and `vm`;
//! - `create_from_snapshot`: creates of the default key (a restore) and their deletes;
//! - `exec_true`: exec `/bin/true` in a microvm, a vm and, as the peer, a container;
//! - `pss_per_idle_clone` and `max_idle_microvms`: QEMU's proportional set size per idle
//!   clone, and how many idle microvms the host holds at once (all answering an exec);
//! - `plain_boot`: the peer for the snapshot boot, a bare `qemu-system-x86_64 -M microvm` boot
//!   of the same kernel until it panics for want of a root filesystem.
//!
//! Every sandbox the bench made is destroyed at the end, on error paths too, and the daemon is
//! stopped; snapshots made for the random keys are removed from the cache afterwards.

use std::collections::BTreeSet;
use std::hash::{BuildHasher, Hasher};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::{json, Map, Value};

use super::api::{start_daemon, Client};
use super::{dist, emit, us, BenchArgs};

/// Target: create from snapshot, p50.
const TARGET_CREATE_P50_MS: f64 = 150.0;
/// Target: exec `/bin/true`, p50.
const TARGET_EXEC_P50_MS: f64 = 20.0;
/// Target: PSS per idle clone.
const TARGET_PSS_MIB: f64 = 60.0;
/// Target: idle microvms held at once.
const TARGET_IDLE: usize = 50;
/// Idle microvms the density step tries to hold.
const HOLD_MAX: usize = 60;
/// The density step stops when the host has less than this available.
const MIN_AVAILABLE: u64 = 2 << 30;
/// What the guest kernel prints when it found no root filesystem (the plain boot's end).
const BOOT_MARKER: &[u8] = b"Kernel panic";
/// Clock ticks per second of `/proc/<pid>/stat` (USER_HZ, 100 on every Linux architecture
/// that matters here).
const USER_HZ: u64 = 100;

/// The daemon, its client, and every sandbox created and not yet deleted.
struct Bench {
    c: Client,
    /// The daemon's `<run dir>/sandboxes`: `<id>/qemu.pid` lives there.
    sandboxes_dir: PathBuf,
    live: Vec<String>,
}

impl Bench {
    /// Creates a sandbox; returns its id and the wall time in microseconds.
    fn create(&mut self, body: &Value) -> anyhow::Result<(String, u64)> {
        let t = Instant::now();
        let v = self.c.ok("POST", "/v1/sandboxes", Some(body))?;
        let took = us(t);
        let id = v["id"].as_str().context("id")?.to_owned();
        self.live.push(id.clone());
        Ok((id, took))
    }

    /// Deletes a sandbox; returns the wall time in microseconds.
    fn delete(&mut self, id: &str) -> anyhow::Result<u64> {
        let t = Instant::now();
        self.c.ok("DELETE", &format!("/v1/sandboxes/{id}"), None)?;
        let took = us(t);
        self.live.retain(|l| l != id);
        Ok(took)
    }

    /// Deletes every live sandbox in one batch; returns (deleted, failed, milliseconds).
    fn delete_all(&mut self) -> (usize, usize, u64) {
        if self.live.is_empty() {
            return (0, 0, 0);
        }
        let t = Instant::now();
        let ids = std::mem::take(&mut self.live);
        let v = self.c.ok(
            "POST",
            "/v1/sandboxes/batch-delete",
            Some(&json!({"ids": ids})),
        );
        let ms = t.elapsed().as_millis() as u64;
        let mut failed = Vec::new();
        match v {
            Ok(v) => {
                for item in v["items"].as_array().into_iter().flatten() {
                    if item["ok"] != true {
                        if let Some(id) = item["id"].as_str() {
                            failed.push(id.to_owned());
                        }
                    }
                }
            }
            Err(_) => failed = ids.clone(),
        }
        // One more try, one by one, for whatever the batch did not take.
        let mut still = 0;
        for id in &failed {
            if self
                .c
                .ok("DELETE", &format!("/v1/sandboxes/{id}"), None)
                .is_err()
            {
                still += 1;
            }
        }
        (ids.len() - still, still, ms)
    }

    /// QEMU's pid of VM sandbox `id`: its `qemu.pid` file, else the supervisor pid the API
    /// reports (QEMU is a VM sandbox's supervisor).
    fn qemu_pid(&self, id: &str) -> Option<u32> {
        std::fs::read_to_string(self.sandboxes_dir.join(id).join("qemu.pid"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .or_else(|| {
                let v = self
                    .c
                    .ok("GET", &format!("/v1/sandboxes/{id}"), None)
                    .ok()?;
                v["supervisor_pid"].as_u64().map(|p| p as u32)
            })
    }
}

/// Memory of one process from `smaps_rollup`, in KiB.
#[derive(Default, Clone, Copy)]
struct Mem {
    pss: u64,
    rss: u64,
    pss_anon: u64,
    pss_file: u64,
}

fn proc_mem(pid: u32) -> Option<Mem> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    let get = |k: &str| -> u64 {
        s.lines()
            .find_map(|l| l.strip_prefix(k))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    Some(Mem {
        pss: get("Pss:"),
        rss: get("Rss:"),
        pss_anon: get("Pss_Anon:"),
        pss_file: get("Pss_File:"),
    })
}

/// utime + stime of a process, in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let Some(rest) = s.rfind(')').map(|i| &s[i + 1..]) else {
        return 0;
    };
    // After the command: state is field 3; utime and stime are fields 14 and 15.
    let f: Vec<&str> = rest.split_whitespace().collect();
    let n = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    n(11) + n(12)
}

/// A `/proc/meminfo` value in bytes.
fn meminfo(key: &str) -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .unwrap_or(0)
        * 1024
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}

/// Sums the memory of the QEMU processes of `ids`: (processes found, total).
fn qemu_mem(b: &Bench, ids: &[String]) -> (usize, Mem, Vec<u32>) {
    let mut total = Mem::default();
    let mut pids = Vec::new();
    for id in ids {
        if let Some(m) = b.qemu_pid(id).and_then(|p| proc_mem(p).map(|m| (p, m))) {
            pids.push(m.0);
            let m = m.1;
            total.pss += m.pss;
            total.rss += m.rss;
            total.pss_anon += m.pss_anon;
            total.pss_file += m.pss_file;
        }
    }
    (pids.len(), total, pids)
}

fn mem_json(n: usize, m: Mem) -> Value {
    let per = |kb: u64| kb as f64 / 1024.0 / n.max(1) as f64;
    json!({
        "qemu_processes": n,
        "pss_total_mib": m.pss as f64 / 1024.0,
        "pss_per_clone_mib": per(m.pss),
        "pss_anon_per_clone_mib": per(m.pss_anon),
        "pss_file_per_clone_mib": per(m.pss_file),
        "rss_per_clone_mib": per(m.rss),
    })
}

/// CPU use of `pids` over `window`, in percent of one CPU.
fn cpu_percent(pids: &[u32], window: Duration) -> f64 {
    let before: u64 = pids.iter().map(|&p| cpu_ticks(p)).sum();
    std::thread::sleep(window);
    let after: u64 = pids.iter().map(|&p| cpu_ticks(p)).sum();
    after.saturating_sub(before) as f64 / USER_HZ as f64 / window.as_secs_f64() * 100.0
}

/// A random number in `lo..=hi` (std's hasher keys are random per process).
fn random_in(lo: u64, hi: u64) -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(std::process::id().into());
    lo + h.finish() % (hi - lo + 1)
}

fn snap_dirs(cache: &Path) -> BTreeSet<String> {
    entries(cache, "snap")
}

/// Names in `<cache>/<sub>`.
fn entries(cache: &Path, sub: &str) -> BTreeSet<String> {
    std::fs::read_dir(cache.join(sub))
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// The complete snapshot whose RAM file is `memory_mib` large, preferring one that appeared
/// since `before`: (directory, made in this run).
fn find_snapshot(
    cache: &Path,
    before: &BTreeSet<String>,
    memory_mib: u64,
) -> Option<(PathBuf, bool)> {
    let fits = |name: &String| {
        let dir = cache.join("snap").join(name);
        let ram = std::fs::metadata(dir.join("ram")).map_or(0, |m| m.len());
        ram == memory_mib << 20 && dir.join("complete").exists()
    };
    let now = snap_dirs(cache);
    now.iter()
        .filter(|n| !before.contains(*n))
        .find(|n| fits(n))
        .map(|n| (cache.join("snap").join(n), true))
        .or_else(|| {
            now.iter()
                .find(|n| fits(n))
                .map(|n| (cache.join("snap").join(n), false))
        })
}

/// Boot and save times of a snapshot made in this run: the node writes the boot time into
/// `complete`; the save is the state file's life from creation to last write.
fn snapshot_times(dir: &Path) -> (Option<u64>, Option<u64>) {
    let boot = std::fs::read_to_string(dir.join("complete"))
        .ok()
        .and_then(|s| s.trim().parse().ok());
    let save = std::fs::metadata(dir.join("state")).ok().and_then(|m| {
        let d = m.modified().ok()?.duration_since(m.created().ok()?).ok()?;
        Some(d.as_millis() as u64)
    });
    (boot, save)
}

/// First create of a key no sandbox used yet: boot + snapshot + restore.
fn cold_snapshot(
    b: &mut Bench,
    cache: &Path,
    substrate: &str,
    memory_mib: u64,
    made: &mut Vec<PathBuf>,
) -> anyhow::Result<Value> {
    let before = snap_dirs(cache);
    let (id, wall) = b.create(&json!({
        "substrate": substrate,
        "limits": {"memory_max": memory_mib << 20},
    }))?;
    let t = Instant::now();
    b.c.exec_true(&id)?;
    let exec = us(t);
    b.delete(&id)?;
    let wall_ms = wall / 1000;
    let found = find_snapshot(cache, &before, memory_mib);
    let (built, boot_ms, save_ms) = match &found {
        Some((dir, true)) => {
            made.push(dir.clone());
            let (boot, save) = snapshot_times(dir);
            (Some(true), boot, save)
        }
        Some((_, false)) => (Some(false), None, None),
        None => (None, None, None),
    };
    Ok(json!({
        "memory_mib": memory_mib,
        "snapshot_built_in_this_run": built,
        "first_create_wall_ms": wall_ms,
        "boot_to_agent_ready_ms": boot_ms,
        "save_ms": save_ms,
        "rest_of_create_ms": boot_ms.map(|b| wall_ms.saturating_sub(b + save_ms.unwrap_or(0))),
        "first_exec_true_us": exec,
        "snapshot_dir": found.map(|(d, _)| d.display().to_string()),
    }))
}

/// N creates of the default key (after a warm-up create), each followed by an exec and a
/// delete.
fn creates(b: &mut Bench, substrate: &str, n: usize, settle: Duration) -> anyhow::Result<Value> {
    let body = json!({"substrate": substrate});
    let (id, warm) = b.create(&body)?;
    b.c.exec_true(&id)?;
    b.delete(&id)?;
    let (mut create, mut first_exec, mut first_wall, mut delete) = (vec![], vec![], vec![], vec![]);
    for _ in 0..n {
        std::thread::sleep(settle);
        let (id, took) = b.create(&body)?;
        create.push(took);
        let t = Instant::now();
        first_wall.push(b.c.exec_true(&id)?);
        first_exec.push(us(t));
        delete.push(b.delete(&id)?);
    }
    Ok(json!({
        "warm_up_create_us": warm,
        "create": dist(create),
        "first_exec_true_after_create": dist(first_exec),
        "first_exec_true_process_wall": dist(first_wall),
        "delete": dist(delete),
    }))
}

/// A warm pool of `n` microvms (`host@microvm`): acquire latency (a pool hit), and the first
/// exec in an acquired VM (the pool ran one command in each, so its translation cache is warm).
fn pooled(b: &mut Bench, n: usize) -> anyhow::Result<Value> {
    let pool = "/v1/pools/host@microvm";
    b.c.ok("PUT", pool, Some(&json!({"min": n, "max": n})))?;
    let result = (|| -> anyhow::Result<Value> {
        let (mut acquire, mut first_exec, mut first_wall) = (vec![], vec![], vec![]);
        for _ in 0..n {
            let deadline = Instant::now() + Duration::from_secs(120);
            while b.c.ok("GET", pool, None)?["ready"].as_u64().unwrap_or(0) < n as u64 {
                if Instant::now() > deadline {
                    bail!("the microvm pool did not fill");
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let (id, took) = b.create(&json!({"substrate": "microvm"}))?;
            acquire.push(took);
            let t = Instant::now();
            first_wall.push(b.c.exec_true(&id)?);
            first_exec.push(us(t));
            b.delete(&id)?;
        }
        let st = b.c.ok("GET", pool, None)?;
        Ok(json!({
            "pool": "host@microvm",
            "acquire_pool_hit": dist(acquire),
            "first_exec_true_after_acquire": dist(first_exec),
            "first_exec_true_process_wall": dist(first_wall),
            "hits": st["hits"],
        }))
    })();
    let _ = b.c.ok("PUT", pool, Some(&json!({"min": 0, "max": 0})));
    result
}

/// Exec `/bin/true` `n` times in a microvm, a vm and a container, interleaved, with the HTTP
/// floor (`GET /livez`).
fn execs(b: &mut Bench, n: usize) -> anyhow::Result<Value> {
    let subs = ["microvm", "vm", "container"];
    let mut ids = Vec::new();
    for s in subs {
        let (id, _) = b.create(&json!({"substrate": s}))?;
        for _ in 0..3 {
            b.c.exec_true(&id)?;
        }
        ids.push(id);
    }
    let mut lat = vec![Vec::with_capacity(n); subs.len()];
    let mut wall = vec![Vec::with_capacity(n); subs.len()];
    let mut livez = Vec::with_capacity(n);
    for _ in 0..n {
        for (i, id) in ids.iter().enumerate() {
            let t = Instant::now();
            wall[i].push(b.c.exec_true(id)?);
            lat[i].push(us(t));
        }
        let t = Instant::now();
        b.c.ok("GET", "/livez", None)?;
        livez.push(us(t));
    }
    for id in &ids {
        b.delete(id)?;
    }
    let mut out = Map::new();
    for ((s, l), w) in subs.iter().zip(lat).zip(wall) {
        out.insert((*s).into(), json!(dist(l)));
        // The process alone, inside the sandbox: the rest is HTTP, the node and the channel
        // to the agent (virtio-serial for VMs).
        out.insert(format!("{s}_process_wall"), json!(dist(w)));
    }
    out.insert("http_floor_livez".into(), json!(dist(livez)));
    Ok(Value::Object(out))
}

/// K idle microvms: PSS and RSS of their QEMUs, the host's MemAvailable; then more up to
/// [`HOLD_MAX`], all answering an exec at the end.
fn density(b: &mut Bench, k: usize, out: &mut Map<String, Value>) -> anyhow::Result<()> {
    let body = json!({"substrate": "microvm"});
    let avail_before = meminfo("MemAvailable");
    let mut held: Vec<String> = Vec::new();
    let mut create = vec![];
    for _ in 0..k {
        let (id, took) = b.create(&body)?;
        create.push(took);
        held.push(id);
    }
    std::thread::sleep(Duration::from_secs(2));
    let avail_after = meminfo("MemAvailable");
    let (n, m, pids) = qemu_mem(b, &held);
    let cpu = cpu_percent(&pids, Duration::from_secs(2));
    let mut pss = mem_json(n, m);
    pss["clones"] = json!(held.len());
    pss["create"] = json!(dist(create));
    pss["mem_available_before_mib"] = json!(mib(avail_before));
    pss["mem_available_after_mib"] = json!(mib(avail_after));
    pss["mem_available_drop_per_clone_mib"] =
        json!(mib(avail_before.saturating_sub(avail_after)) / held.len().max(1) as f64);
    pss["idle_cpu_percent_of_one_cpu_all_clones"] = json!(cpu);
    out.insert("pss_per_idle_clone".into(), pss);

    // Hold more, up to HOLD_MAX.
    let mut stopped_by = Value::Null;
    let mut create = vec![];
    while held.len() < HOLD_MAX {
        let avail = meminfo("MemAvailable");
        if avail < MIN_AVAILABLE {
            stopped_by = json!(format!("MemAvailable {:.0} MiB < 2 GiB", mib(avail)));
            break;
        }
        match b.create(&body) {
            Ok((id, took)) => {
                create.push(took);
                held.push(id);
            }
            Err(e) => {
                stopped_by = json!(format!("{e:#}"));
                break;
            }
        }
    }
    std::thread::sleep(Duration::from_secs(2));
    let avail_full = meminfo("MemAvailable");
    let (n, m, pids) = qemu_mem(b, &held);
    let cpu = cpu_percent(&pids, Duration::from_secs(2));
    let mut exec = vec![];
    let mut failed = 0;
    for id in &held {
        let t = Instant::now();
        match b.c.exec_true(id) {
            Ok(_) => exec.push(us(t)),
            Err(_) => failed += 1,
        }
    }
    let answering = exec.len();
    let mut v = json!({
        "held_at_once": held.len(),
        "target": HOLD_MAX,
        "stopped_by": stopped_by,
        "answering_exec_true": answering,
        "exec_failed": failed,
        "exec_true_all_held": dist(exec),
        "create_beyond_k": dist(create),
        "mem_available_before_mib": mib(avail_before),
        "mem_available_all_held_mib": mib(avail_full),
        "mem_available_drop_per_clone_mib":
            mib(avail_before.saturating_sub(avail_full)) / held.len().max(1) as f64,
        "idle_cpu_percent_of_one_cpu_all_clones": cpu,
    });
    v["memory"] = mem_json(n, m);
    let (deleted, del_failed, ms) = b.delete_all();
    v["destroy_all"] = json!({"deleted": deleted, "failed": del_failed, "ms": ms});
    out.insert("max_idle_microvms".into(), v);
    Ok(())
}

/// The guest kernel of the VM cache (`kernel/kernel.json`, paths relative to its directory).
fn guest_kernel(cache: &Path) -> anyhow::Result<PathBuf> {
    let dir = cache.join("kernel");
    let rec: Value = serde_json::from_slice(
        &std::fs::read(dir.join("kernel.json")).context("read kernel/kernel.json")?,
    )?;
    Ok(dir.join(rec["kernel"].as_str().context("kernel.json: kernel")?))
}

/// One plain `-M microvm` boot of `kernel`: microseconds until the serial output shows
/// [`BOOT_MARKER`].
fn plain_boot(kernel: &Path, append: &str, timeout: Duration) -> anyhow::Result<u64> {
    let t = Instant::now();
    let mut child = Command::new("qemu-system-x86_64")
        .args([
            "-M", "microvm", "-accel", "tcg", "-cpu", "max", "-m", "256M",
        ])
        .args(["-nodefaults", "-no-user-config", "-display", "none"])
        .args(["-no-reboot", "-serial", "stdio", "-kernel"])
        .arg(kernel)
        .args(["-append", append])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .context("start qemu-system-x86_64")?;
    let mut out = child.stdout.take().context("stdout")?;
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            match out.read(&mut chunk) {
                Ok(0) | Err(_) => {
                    let _ = tx.send(None);
                    return;
                }
                Ok(n) => {
                    let from = buf.len().saturating_sub(BOOT_MARKER.len());
                    buf.extend_from_slice(&chunk[..n]);
                    if buf[from..]
                        .windows(BOOT_MARKER.len())
                        .any(|w| w == BOOT_MARKER)
                    {
                        let _ = tx.send(Some(us(t)));
                        return;
                    }
                }
            }
        }
    });
    let got = rx.recv_timeout(timeout);
    let _ = child.kill();
    let _ = child.wait();
    let _ = reader.join();
    match got {
        Ok(Some(took)) => Ok(took),
        Ok(None) => bail!("qemu exited before the kernel printed {BOOT_MARKER:?}"),
        Err(_) => bail!("no {BOOT_MARKER:?} within {timeout:?}"),
    }
}

/// The plain-boot peer: 3 boots (up to 5 attempts) of each command line.
fn plain_boots(cache: &Path) -> anyhow::Result<Value> {
    let kernel = guest_kernel(cache)?;
    // The node boots its templates with the TSC frequency given (TCG boots sometimes hang in
    // calibration without it); the peer gets the same, so only the snapshot path differs.
    let khz = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("cpu MHz"))
                .and_then(|l| l.split(':').nth(1))
                .and_then(|v| v.trim().parse::<f64>().ok())
        })
        .map_or(0, |mhz| (mhz * 1000.0) as u64);
    let tsc = if khz > 0 {
        format!(" tsc_early_khz={khz} lpj={}", khz * 4)
    } else {
        String::new()
    };
    let mut out = Map::new();
    out.insert("kernel".into(), json!(kernel.display().to_string()));
    for (name, append) in [
        ("verbose", format!("console=ttyS0 panic=-1 pci=off{tsc}")),
        (
            "quiet",
            format!("console=ttyS0 quiet panic=-1 pci=off{tsc}"),
        ),
    ] {
        let mut v = vec![];
        let mut errors = vec![];
        for _ in 0..5 {
            if v.len() == 3 {
                break;
            }
            match plain_boot(&kernel, &append, Duration::from_secs(60)) {
                Ok(t) => v.push(t),
                Err(e) => errors.push(format!("{e:#}")),
            }
        }
        out.insert(
            name.into(),
            json!({"append": append, "to_marker": dist(v), "errors": errors}),
        );
    }
    Ok(Value::Object(out))
}

/// QEMU processes whose command line names `base` (the bench daemon's dirs): killed.
fn kill_leftover_qemus(base: &str) -> usize {
    let mut killed = 0;
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let cmd = String::from_utf8_lossy(&cmd);
        if cmd.starts_with("/usr/bin/qemu-system") || cmd.starts_with("qemu-system") {
            if !cmd.contains(base) {
                continue;
            }
            if let Some(p) = rustix::process::Pid::from_raw(pid) {
                if rustix::process::kill_process(p, rustix::process::Signal::KILL).is_ok() {
                    killed += 1;
                }
            }
        }
    }
    killed
}

fn p50_ms(v: &Value) -> Option<f64> {
    v["p50_us"].as_u64().map(|u| u as f64 / 1000.0)
}

fn p99_ms(v: &Value) -> Option<f64> {
    v["p99_us"].as_u64().map(|u| u as f64 / 1000.0)
}

/// Every measurement; results land in `out` as they are made, so a failure keeps them.
fn measure(
    b: &mut Bench,
    args: &BenchArgs,
    cache: &Path,
    made: &mut Vec<PathBuf>,
    out: &mut Map<String, Value>,
) -> anyhow::Result<()> {
    let settle = Duration::from_millis(args.settle_ms);
    // The default keys first: VM runtime start-up (QEMU, kernel, initramfs, root image) and
    // their snapshots, so that the cold figures below are the boot + save alone.
    let mut first = Map::new();
    for s in ["microvm", "vm"] {
        let dirs = ["snap", "initrd", "root"];
        let before: Vec<_> = dirs.iter().map(|d| entries(cache, d)).collect();
        let (id, took) = b.create(&json!({"substrate": s}))?;
        b.c.exec_true(&id)?;
        b.delete(&id)?;
        let mut v = json!({"wall_ms": took / 1000});
        // What this create had to build first (the rest of the wall time is the boot).
        for (d, before) in dirs.iter().zip(&before) {
            v[format!("new_{d}_in_cache")] = json!(entries(cache, d).difference(before).count());
        }
        first.insert(s.into(), v);
    }
    out.insert("first_create_default_key".into(), Value::Object(first));

    let mut snap = Map::new();
    let micro_mib = random_in(201, 250);
    snap.insert(
        "microvm".into(),
        cold_snapshot(b, cache, "microvm", micro_mib, made)?,
    );
    let vm_mib = random_in(251, 300);
    snap.insert("vm".into(), cold_snapshot(b, cache, "vm", vm_mib, made)?);
    out.insert("snapshot".into(), Value::Object(snap));

    let n_micro = args.iterations.clamp(3, 20);
    let n_vm = args.iterations.clamp(3, 10);
    let mut cr = Map::new();
    cr.insert("microvm".into(), creates(b, "microvm", n_micro, settle)?);
    cr.insert("vm".into(), creates(b, "vm", n_vm, settle)?);
    out.insert("create_from_snapshot".into(), Value::Object(cr));
    out.insert("pooled_microvm".into(), pooled(b, 5)?);

    out.insert("exec_true".into(), execs(b, args.iterations.clamp(10, 50))?);

    if args.idle > 0 {
        density(b, args.idle.min(20), out)?;
    }
    Ok(())
}

/// Runs the VM benchmark.
pub fn run(args: &BenchArgs) -> anyhow::Result<ExitCode> {
    let cache = std::env::var_os(dsec_node::substrate::vm::CACHE_ENV).map_or_else(
        || dsec_node::substrate::vm::DEFAULT_CACHE.into(),
        PathBuf::from,
    );
    let host_qemus_before = count_qemus();
    let d = start_daemon("vm", &[])?;
    // start_daemon's layout: the state dirs below `<base>`, VM sandboxes under `<run>/sandboxes/`.
    let base = format!("/tmp/dsec-bench-vm-{}", std::process::id());
    let mut b = Bench {
        c: Client::new(&d.url, &d.key, Duration::from_secs(180)),
        sandboxes_dir: d.run.join("sandboxes"),
        live: Vec::new(),
    };
    let mut out = Map::new();
    let ready_before = b.c.ok("GET", "/readyz", None)?;
    let mut made = Vec::new();
    let result = measure(&mut b, args, &cache, &mut made, &mut out);
    if let Err(e) = &result {
        out.insert("error".into(), json!(format!("{e:#}")));
    }
    let ready = b.c.ok("GET", "/readyz", None).unwrap_or(Value::Null);
    let (deleted, failed, _) = b.delete_all();
    let daemon_rss_kb = std::fs::read_to_string(format!("/proc/{}/status", d.child.id()))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok());
    // Stops the daemon (after destroying whatever it still holds).
    drop(d);
    let leftovers = kill_leftover_qemus(&base);
    out.insert(
        "cleanup".into(),
        json!({"deleted_at_end": deleted, "delete_failed_at_end": failed,
               "leftover_qemus_killed": leftovers,
               "daemon_rss_kb_at_end": daemon_rss_kb}),
    );

    // The peer, on a node without the bench's VMs.
    if result.is_ok() {
        match plain_boots(&cache) {
            Ok(v) => {
                out.insert("plain_boot".into(), v);
            }
            Err(e) => {
                out.insert("plain_boot".into(), json!({"error": format!("{e:#}")}));
            }
        }
    }
    // Snapshots of the random keys serve nobody after this run.
    let mut removed = vec![];
    for dir in &made {
        if std::fs::remove_dir_all(dir).is_ok() {
            removed.push(dir.display().to_string());
        }
    }
    out.insert("removed_cold_snapshots".into(), json!(removed));

    let r = Value::Object(out.clone());
    let create_micro = &r["create_from_snapshot"]["microvm"]["create"];
    let exec_micro = &r["exec_true"]["microvm"];
    let pss = r["pss_per_idle_clone"]["pss_per_clone_mib"].as_f64();
    let held = r["max_idle_microvms"]["held_at_once"].as_u64();
    let answering = r["max_idle_microvms"]["answering_exec_true"].as_u64();
    let met = |v: Option<f64>, target: f64| v.map(|v| v <= target);
    let summary = json!({
        "accel": ready["vm"]["accel"].as_str().or(ready_before["vm"]["accel"].as_str()),
        "create_from_snapshot_p50_ms": {
            "microvm": p50_ms(create_micro),
            "microvm_p99": p99_ms(create_micro),
            "vm": p50_ms(&r["create_from_snapshot"]["vm"]["create"]),
            "vm_p99": p99_ms(&r["create_from_snapshot"]["vm"]["create"]),
            "target_microvm": TARGET_CREATE_P50_MS,
            "met": met(p50_ms(create_micro), TARGET_CREATE_P50_MS),
        },
        "exec_true_p50_ms": {
            "microvm": p50_ms(exec_micro),
            "microvm_p99": p99_ms(exec_micro),
            "vm": p50_ms(&r["exec_true"]["vm"]),
            "vm_p99": p99_ms(&r["exec_true"]["vm"]),
            "container_peer": p50_ms(&r["exec_true"]["container"]),
            "container_peer_p99": p99_ms(&r["exec_true"]["container"]),
            "http_floor": p50_ms(&r["exec_true"]["http_floor_livez"]),
            "microvm_process_wall_in_guest": p50_ms(&r["exec_true"]["microvm_process_wall"]),
            "vm_process_wall_in_guest": p50_ms(&r["exec_true"]["vm_process_wall"]),
            "container_process_wall": p50_ms(&r["exec_true"]["container_process_wall"]),
            "target_microvm": TARGET_EXEC_P50_MS,
            "met": met(p50_ms(exec_micro), TARGET_EXEC_P50_MS),
        },
        "pss_per_idle_clone_mib": {
            "microvm": pss,
            "rss_per_clone_mib": r["pss_per_idle_clone"]["rss_per_clone_mib"],
            "at_max_held": r["max_idle_microvms"]["memory"]["pss_per_clone_mib"],
            "target": TARGET_PSS_MIB,
            "met": met(pss, TARGET_PSS_MIB),
        },
        "max_idle_microvms": {
            "held_at_once": held,
            "answering_exec_true": answering,
            "target": TARGET_IDLE,
            "met": held.zip(answering).map(|(h, a)| h >= TARGET_IDLE as u64 && a == h),
        },
        "boot_ms": {
            "snapshot_boot_to_agent_ready_microvm": r["snapshot"]["microvm"]["boot_to_agent_ready_ms"],
            "snapshot_save_microvm": r["snapshot"]["microvm"]["save_ms"],
            "snapshot_boot_to_agent_ready_vm": r["snapshot"]["vm"]["boot_to_agent_ready_ms"],
            "snapshot_save_vm": r["snapshot"]["vm"]["save_ms"],
            "plain_microvm_boot_to_panic_p50": p50_ms(&r["plain_boot"]["verbose"]["to_marker"]),
            "plain_microvm_boot_to_panic_quiet_p50": p50_ms(&r["plain_boot"]["quiet"]["to_marker"]),
        },
    });
    let doc = json!({
        "bench": "vm",
        "mem_total_mib": mib(meminfo("MemTotal")),
        "vm_cache": cache.display().to_string(),
        "vm": if ready.is_null() { ready_before["vm"].clone() } else { ready["vm"].clone() },
        "other_qemu_processes_on_host": {"at_start": host_qemus_before, "at_end": count_qemus()},
        "iterations": args.iterations,
        "results": r,
        "summary": summary,
    });
    let code = emit(args, doc)?;
    result?;
    Ok(code)
}

/// QEMU processes on the host (other users' VMs compete for the same CPUs).
fn count_qemus() -> usize {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            std::fs::read(e.path().join("cmdline")).is_ok_and(|c| {
                c.starts_with(b"/usr/bin/qemu-system") || c.starts_with(b"qemu-system")
            })
        })
        .count()
}
