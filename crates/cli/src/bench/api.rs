//! `dsec bench api`: the node daemon measured through HTTP from a separate process.
//!
//! The bench starts `dsec server` as a child process on fresh state dirs and drives it as a
//! client would: create (pool hit and pool miss) + exec `true` + delete at several
//! concurrencies, exec throughput over 64 sandboxes, 1,000 sandboxes by batch create and batch
//! delete, and the daemon's RSS. The peer measured in the same run is the HTTP floor: a
//! `GET /livez` round trip on the same connection pool.

use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use dsec_testkit as testkit;
use serde_json::{json, Map, Value};

use super::{dist, emit, us, BenchArgs, Dist};

testkit::daemon_type!(
    /// A `dsec server` child on fresh state dirs (benches of the daemon share it). Dropped, it
    /// destroys every sandbox the bench made, then stops and its dirs go.
    pub(crate) struct Daemon
);

impl Daemon {
    /// Destroys every sandbox the bench made (sandboxes outlive their daemon by design, so a
    /// bench that stops early must not leave its abusers running).
    fn destroy_everything(&self) {
        let c = Client::new(&self.url, &self.key, Duration::from_secs(60));
        let _ = c.set_pool(0, 0);
        for _ in 0..3 {
            let Ok(v) = c.ok("GET", "/v1/sandboxes?limit=1000", None) else {
                return;
            };
            let ids: Vec<&str> = v["items"]
                .as_array()
                .map(|a| a.iter().filter_map(|i| i["id"].as_str()).collect())
                .unwrap_or_default();
            if ids.is_empty() {
                break;
            }
            let _ = c.ok(
                "POST",
                "/v1/sandboxes/batch-delete",
                Some(&json!({"ids": ids})),
            );
        }
        // Pooled ones go once the pool is sized 0.
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            match c.ok("GET", "/v1/pools/host", None) {
                Ok(p) if p["ready"] == 0 && p["creating"] == 0 => break,
                Ok(_) => std::thread::sleep(Duration::from_millis(50)),
                Err(_) => break,
            }
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.destroy_everything();
        // Then the fixture's own drop: SIGTERM, SIGKILL after 30 s, the state dirs removed.
    }
}

/// Starts `dsec server` (this executable) with `extra` flags on dirs named after `tag`.
pub(crate) fn start_daemon(tag: &str, extra: &[&str]) -> anyhow::Result<Daemon> {
    let base = std::path::PathBuf::from(format!("/tmp/dsec-bench-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base)?;
    let d = testkit::Server::new(std::env::current_exe()?, &base.join("d"), &base.join("r"))
        .args(&["--pool-max", "0"])
        .args(extra)
        .remove_on_drop(&base)
        .start()
        .context("start dsec server")?;
    Ok(Daemon(d))
}

/// A blocking HTTP client of the bench's daemon (shared by the API and VM benches).
#[derive(Clone)]
pub(crate) struct Client(testkit::Http);

impl Client {
    /// A client of `url` with API key `key`; every call gives up after `timeout`.
    pub(crate) fn new(url: &str, key: &str, timeout: Duration) -> Self {
        Self(testkit::Http::new(url, Some(key), Some(timeout)))
    }

    pub(crate) fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> anyhow::Result<(u16, Value)> {
        Ok(self.0.call(method, path, body)?)
    }

    pub(crate) fn ok(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> anyhow::Result<Value> {
        let (s, v) = self.call(method, path, body)?;
        if !(200..300).contains(&s) {
            bail!("{method} {path}: {s} {v}");
        }
        Ok(v)
    }

    fn create(&self) -> anyhow::Result<(String, bool)> {
        let v = self.ok("POST", "/v1/sandboxes", Some(&json!({})))?;
        let id = v["id"].as_str().context("id")?.to_owned();
        Ok((id, v["pooled"] == true))
    }

    /// Runs `/bin/true` in `id`; returns the process's own wall time as the sandbox measured
    /// it (spawn to exit, microseconds; 0 when not reported).
    pub(crate) fn exec_true(&self, id: &str) -> anyhow::Result<u64> {
        let v = self.ok(
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            Some(&json!({"argv": ["/bin/true"]})),
        )?;
        if v["status"] != "ok" {
            bail!("exec true in {id}: {v}");
        }
        Ok(v["wall_us"].as_u64().unwrap_or(0))
    }

    fn set_pool(&self, min: usize, max: usize) -> anyhow::Result<()> {
        self.ok(
            "PUT",
            "/v1/pools/host",
            Some(&json!({"min": min, "max": max})),
        )?;
        Ok(())
    }

    fn wait_pool(&self, ready: u64) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let p = self.ok("GET", "/v1/pools/host", None)?;
            if p["ready"].as_u64() >= Some(ready) && p["creating"] == 0 {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("pool did not fill: {p}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn rss_kb(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// Latencies of one worker: create, exec, delete, whole cycle.
type Samples = (Vec<u64>, Vec<u64>, Vec<u64>, Vec<u64>);

/// Runs `threads` workers doing `per_thread` create + exec + delete cycles each.
fn cycles(c: &Client, threads: usize, per_thread: usize) -> anyhow::Result<Value> {
    let errors = Arc::new(AtomicU64::new(0));
    let hits = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    let results: Vec<Samples> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|_| {
                let c = c.clone();
                let errors = Arc::clone(&errors);
                let hits = Arc::clone(&hits);
                s.spawn(move || {
                    let (mut cr, mut ex, mut de, mut all) = (vec![], vec![], vec![], vec![]);
                    for _ in 0..per_thread {
                        let t = Instant::now();
                        let Ok((id, hit)) = c.create() else {
                            errors.fetch_add(1, Ordering::Relaxed);
                            continue;
                        };
                        cr.push(us(t));
                        if hit {
                            hits.fetch_add(1, Ordering::Relaxed);
                        }
                        let te = Instant::now();
                        if c.exec_true(&id).is_err() {
                            errors.fetch_add(1, Ordering::Relaxed);
                        }
                        ex.push(us(te));
                        let td = Instant::now();
                        if c.ok("DELETE", &format!("/v1/sandboxes/{id}"), None)
                            .is_err()
                        {
                            errors.fetch_add(1, Ordering::Relaxed);
                        }
                        de.push(us(td));
                        all.push(us(t));
                    }
                    (cr, ex, de, all)
                })
            })
            .collect();
        hs.into_iter().filter_map(|h| h.join().ok()).collect()
    });
    let wall = t0.elapsed();
    let (mut cr, mut ex, mut de, mut all) = (vec![], vec![], vec![], vec![]);
    for (a, b, c2, d) in results {
        cr.extend(a);
        ex.extend(b);
        de.extend(c2);
        all.extend(d);
    }
    let n = all.len();
    Ok(json!({
        "concurrency": threads,
        "create": dist(cr),
        "exec_true": dist(ex),
        "delete": dist(de),
        "cycle": dist(all),
        "cycles_per_s": n as f64 / wall.as_secs_f64(),
        "pool_hits": hits.load(Ordering::Relaxed),
        "errors": errors.load(Ordering::Relaxed),
    }))
}

/// Forks the pids controller refused (after copying the address space) in these sandboxes'
/// cgroups so far: the sum of their `pids.events` `max` counts.
fn forks_refused_after_copy(ids: &[String]) -> u64 {
    let Ok(cgroups) = dsec_sys::cgroup::CgroupManager::detect("dsec") else {
        return 0;
    };
    ids.iter()
        .filter_map(|id| cgroups.open(id)?.pids_refused())
        .sum()
}

/// A victim latency of one of the "beside" results, in ms.
fn ms(out: &Map<String, Value>, key: &str, q: &str) -> f64 {
    out[key]["beside"][q].as_u64().unwrap_or(0) as f64 / 1000.0
}

/// The ids of a batch create's answer.
fn batch_ids(v: &Value) -> anyhow::Result<Vec<String>> {
    Ok(v["items"]
        .as_array()
        .context("items")?
        .iter()
        .filter_map(|i| i["sandbox"]["id"].as_str().map(str::to_owned))
        .collect())
}

/// `n` execs of `true` in `id`, back to back.
fn quiet(c: &Client, id: &str, n: usize) -> anyhow::Result<Vec<u64>> {
    let mut l = vec![];
    for _ in 0..n {
        let t = Instant::now();
        c.exec_true(id)?;
        l.push(us(t));
    }
    Ok(l)
}

/// The HTTP floor (peer) and exec `true` on one sandbox, interleaved; answers exec's figure.
fn exec_vs_floor(c: &Client, n: usize, out: &mut Map<String, Value>) -> anyhow::Result<Dist> {
    let (id, _) = c.create()?;
    let (mut livez, mut exec) = (vec![], vec![]);
    for _ in 0..n {
        let t = Instant::now();
        c.ok("GET", "/livez", None)?;
        livez.push(us(t));
        let t = Instant::now();
        c.exec_true(&id)?;
        exec.push(us(t));
    }
    c.ok("DELETE", &format!("/v1/sandboxes/{id}"), None)?;
    let livez = dist(livez);
    let exec = dist(exec);
    out.insert(
        "exec_true_vs_http_floor".into(),
        json!({"exec_true": &exec, "livez": &livez,
               "ratio_p50": exec.p50_us as f64 / livez.p50_us.max(1) as f64}),
    );
    Ok(exec)
}

/// Pool hit: sequential acquires from a full pool, each followed by exec + delete.
fn acquire_pool_hit(c: &Client, n: usize, out: &mut Map<String, Value>) -> anyhow::Result<()> {
    c.set_pool(8, 64)?;
    c.wait_pool(8)?;
    let mut acquire = vec![];
    for _ in 0..n {
        c.wait_pool(8)?;
        let t = Instant::now();
        let (id, hit) = c.create()?;
        let took = us(t);
        if hit {
            acquire.push(took);
        }
        c.ok("DELETE", &format!("/v1/sandboxes/{id}"), None)?;
    }
    out.insert("acquire_pool_hit".into(), json!(dist(acquire)));
    Ok(())
}

/// Cycles at concurrency 1, 16, 64, with a pool (hits while it keeps up) and without.
fn cycles_by_concurrency(c: &Client, n: usize, out: &mut Map<String, Value>) -> anyhow::Result<()> {
    let mut with_pool = Map::new();
    let mut without = Map::new();
    for conc in [1usize, 16, 64] {
        let per = (n / conc).clamp(3, 200);
        c.set_pool(conc.max(8), 128)?;
        c.wait_pool(conc.max(8) as u64)?;
        with_pool.insert(conc.to_string(), cycles(c, conc, per)?);
        c.set_pool(0, 0)?;
        c.wait_pool(0)?;
        without.insert(conc.to_string(), cycles(c, conc, per)?);
    }
    out.insert("cycle_pool".into(), Value::Object(with_pool));
    out.insert("cycle_no_pool".into(), Value::Object(without));
    Ok(())
}

/// Exec throughput over 64 sandboxes, one client thread each, for 5 s.
fn exec_throughput(c: &Client, out: &mut Map<String, Value>) -> anyhow::Result<()> {
    let v = c.ok("POST", "/v1/sandboxes/batch", Some(&json!({"count": 64})))?;
    let ids = batch_ids(&v)?;
    let errors = AtomicU64::new(0);
    let dur = Duration::from_secs(5);
    let t0 = Instant::now();
    let lat: Vec<Vec<u64>> = std::thread::scope(|s| {
        let hs: Vec<_> = ids
            .iter()
            .map(|id| {
                let c = c.clone();
                let errors = &errors;
                s.spawn(move || {
                    let mut l = vec![];
                    while t0.elapsed() < dur {
                        let t = Instant::now();
                        if c.exec_true(id).is_err() {
                            errors.fetch_add(1, Ordering::Relaxed);
                        }
                        l.push(us(t));
                    }
                    l
                })
            })
            .collect();
        hs.into_iter().filter_map(|h| h.join().ok()).collect()
    });
    let wall = t0.elapsed();
    let all: Vec<u64> = lat.into_iter().flatten().collect();
    out.insert(
        "exec_throughput_64_sandboxes".into(),
        json!({"sandboxes": ids.len(), "execs": all.len(),
               "execs_per_s": all.len() as f64 / wall.as_secs_f64(),
               "errors": errors.load(Ordering::Relaxed), "latency": dist(all)}),
    );
    c.ok(
        "POST",
        "/v1/sandboxes/batch-delete",
        Some(&json!({"ids": ids})),
    )?;
    Ok(())
}

/// R-13: exec latency on a quiet sandbox while 20 others abuse the node (CPU spin, fork bombs,
/// memory bombs), against the same measurement without them. The node moves sandboxes that
/// never sleep to the batch CPU class within a few of its 100 ms ticks (`cpu_share`), so the
/// first second after the abusers start is reported on its own (`first_second`) and the
/// promise is on the execs after it (`abused`, 5 × `n` of them, as is `calm`). Answers the quiet
/// sandbox (the victim, still running) and its calm figure.
fn beside_abusers(
    c: &Client,
    n: usize,
    out: &mut Map<String, Value>,
) -> anyhow::Result<(String, Dist)> {
    let (victim, _) = c.create()?;
    let calm = dist(quiet(c, &victim, 5 * n)?);
    let v = c.ok(
        "POST",
        "/v1/sandboxes/batch",
        Some(&json!({"count": 20, "spec": {"labels": {"bench": "abuse"}, "limits": {"memory_max": 67108864, "pids_max": 64}}})),
    )?;
    let abusers = batch_ids(&v)?;
    let mut abuse_start_errors = 0u32;
    for (i, id) in abusers.iter().enumerate() {
        let script = match i % 4 {
            0 | 1 => "while :; do :; done",
            2 => "f() { f | f & }; f",
            _ => "/usr/bin/python3 -c 'a=[]\nwhile 1: a.append(bytearray(1<<20))' ; while :; do :; done",
        };
        if c.ok(
            "POST",
            &format!("/v1/sandboxes/{id}/processes"),
            Some(&json!({"shell": script})),
        )
        .is_err()
        {
            abuse_start_errors += 1;
        }
    }
    let started = Instant::now();
    let mut first = vec![];
    while started.elapsed() < Duration::from_secs(1) {
        let t = Instant::now();
        c.exec_true(&victim)?;
        first.push(us(t));
    }
    let first = dist(first);
    let abused = dist(quiet(c, &victim, 5 * n)?);
    let batch = batch_sandboxes(c);
    c.ok(
        "POST",
        "/v1/sandboxes/batch-delete",
        Some(&json!({"labels": {"bench": "abuse"}})),
    )?;
    out.insert(
        "exec_true_under_20_abusers".into(),
        json!({"calm": &calm, "first_second": &first, "abused": &abused,
               "abusers": abusers.len(),
               "abusers_that_failed_to_start": abuse_start_errors,
               "batch_sandboxes_at_end": batch,
               "ratio_p50": abused.p50_us as f64 / calm.p50_us.max(1) as f64,
               "ratio_p99": abused.p99_us as f64 / calm.p99_us.max(1) as f64,
               "first_second_ratio_p99": first.p99_us as f64 / calm.p99_us.max(1) as f64}),
    );
    Ok((victim, calm))
}

/// The node's `dsec_cpu_batch_sandboxes` gauge, if `/metrics` has it.
fn batch_sandboxes(c: &Client) -> Option<u64> {
    c.0.text("/metrics")
        .lines()
        .find_map(|l| l.strip_prefix("dsec_cpu_batch_sandboxes "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|v| v as u64)
}

/// The fork bombs' `pids_max` and `memory_max`.
const BOMB_PIDS_MAX: u64 = 64;
const BOMB_MEMORY_MAX: u64 = 256 << 20;

/// `n` execs of `true` in `id`, one every 20 ms, that count their failures rather than stop at
/// the first, and stop starting new ones after `deadline`: the victim's latency (each call's),
/// how many failed and the first failure, and the forks `bombs` had refused after the copy per
/// second meanwhile.
fn paced(c: &Client, id: &str, n: usize, bombs: &[String], deadline: Duration) -> Value {
    let refused_before = forks_refused_after_copy(bombs);
    let t0 = Instant::now();
    let (mut l, mut errors, mut first_error) = (vec![], 0u32, None);
    for _ in 0..n {
        if t0.elapsed() > deadline {
            break;
        }
        let t = Instant::now();
        if let Err(e) = c.exec_true(id) {
            errors += 1;
            first_error.get_or_insert_with(|| format!("{e:#}"));
        }
        l.push(us(t));
        std::thread::sleep(Duration::from_millis(20));
    }
    let refused_per_s =
        (forks_refused_after_copy(bombs) - refused_before) as f64 / t0.elapsed().as_secs_f64();
    json!({"victim": dist(l), "errors": errors, "first_error": first_error,
           "forks_refused_after_copy_per_s": refused_per_s})
}

/// G-23: the victim beside 20 fork bombs, in sandboxes with a user namespace (the default, where
/// RLIMIT_NPROC refuses a fork before its address space is copied): back to back, then paced
/// (one exec every 20 ms); then beside 20 bombs in the admin's `"userns": false` sandboxes
/// (forks refused by `pids.max` only, after the copy), paced only and for at most a minute:
/// there a victim's exec can wait minutes behind the bombs' copies (the shared files' mapping
/// lock, threat model G-23), which is recorded, not a reason to abort the run.
fn beside_fork_bombs(
    c: &Client,
    n: usize,
    victim: &str,
    calm: &Dist,
    out: &mut Map<String, Value>,
) -> anyhow::Result<()> {
    for (key, userns) in [
        ("exec_true_beside_20_fork_bombs", true),
        ("exec_true_beside_20_fork_bombs_no_userns", false),
    ] {
        let v = c.ok(
            "POST",
            "/v1/sandboxes/batch",
            Some(
                &json!({"count": 20, "spec": {"labels": {"bench": "bombs"}, "userns": userns,
                         "limits": {"memory_max": BOMB_MEMORY_MAX, "pids_max": BOMB_PIDS_MAX}}}),
            ),
        )?;
        let bombs = batch_ids(&v)?;
        let mut start_errors = 0u32;
        for id in &bombs {
            let bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass";
            if c.ok(
                "POST",
                &format!("/v1/sandboxes/{id}/processes"),
                Some(&json!({"argv": ["/usr/bin/python3", "-c", bomb]})),
            )
            .is_err()
            {
                start_errors += 1;
            }
        }
        std::thread::sleep(Duration::from_millis(500));
        let mut m = json!({"calm": calm, "bombs": bombs.len(),
                   "bombs_that_failed_to_start": start_errors,
                   "pids_max": BOMB_PIDS_MAX, "memory_max": BOMB_MEMORY_MAX});
        if userns {
            let refused_before = forks_refused_after_copy(&bombs);
            let t = Instant::now();
            let beside = dist(quiet(c, victim, n)?);
            let refused_per_s = (forks_refused_after_copy(&bombs) - refused_before) as f64
                / t.elapsed().as_secs_f64();
            m["beside"] = json!(&beside);
            m["forks_refused_after_copy_per_s"] = json!(refused_per_s);
            m["ratio_p50"] = json!(beside.p50_us as f64 / calm.p50_us.max(1) as f64);
            m["ratio_p99"] = json!(beside.p99_us as f64 / calm.p99_us.max(1) as f64);
        }
        m["paced_20ms"] = paced(c, victim, n, &bombs, Duration::from_secs(60));
        c.ok(
            "POST",
            "/v1/sandboxes/batch-delete",
            Some(&json!({"labels": {"bench": "bombs"}})),
        )?;
        out.insert(key.into(), m);
    }
    Ok(())
}

/// 1,000 sandboxes by batch create, then batch delete, and the daemon's RSS (`pid`) meanwhile.
fn batch_1000(
    c: &Client,
    pid: u32,
    rss_start: u64,
    out: &mut Map<String, Value>,
) -> anyhow::Result<()> {
    let count = 1000;
    let rss_idle = rss_kb(pid);
    let t = Instant::now();
    let v = c.ok(
        "POST",
        "/v1/sandboxes/batch",
        Some(&json!({"count": count, "spec": {"labels": {"bench": "1000"}}})),
    )?;
    let create_s = t.elapsed().as_secs_f64();
    let made = v["items"]
        .as_array()
        .map_or(0, |a| a.iter().filter(|i| i["ok"] == true).count());
    let rss_full = rss_kb(pid);
    let t = Instant::now();
    let v = c.ok(
        "POST",
        "/v1/sandboxes/batch-delete",
        Some(&json!({"labels": {"bench": "1000"}})),
    )?;
    let delete_s = t.elapsed().as_secs_f64();
    let deleted = v["items"]
        .as_array()
        .map_or(0, |a| a.iter().filter(|i| i["ok"] == true).count());
    out.insert(
        "batch_1000".into(),
        json!({"created": made, "create_s": create_s, "deleted": deleted, "delete_s": delete_s}),
    );
    out.insert(
        "daemon_rss".into(),
        json!({"start_kb": rss_start, "idle_kb": rss_idle, "with_1000_kb": rss_full,
               "per_sandbox_kb": (rss_full.saturating_sub(rss_idle)) as f64 / made.max(1) as f64}),
    );
    Ok(())
}

/// Notes on stderr where the bench is (wall clock, to line up with the daemon's logs).
fn phase(name: &str) {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    eprintln!("bench api: {name} at {:.3}", t.as_secs_f64());
}

/// Runs the API benchmark.
pub fn run(args: &BenchArgs) -> anyhow::Result<ExitCode> {
    let d = start_daemon("api", &[])?;
    let c = Client::new(&d.url, &d.key, Duration::from_secs(120));
    let n = args.iterations.max(20);
    let mut out = Map::new();
    let rss_start = rss_kb(d.child.id());

    // Warm-up.
    for _ in 0..5 {
        let (id, _) = c.create()?;
        c.exec_true(&id)?;
        c.ok("DELETE", &format!("/v1/sandboxes/{id}"), None)?;
    }
    phase("exec_vs_floor");
    let exec = exec_vs_floor(&c, n, &mut out)?;
    phase("acquire_pool_hit");
    acquire_pool_hit(&c, n, &mut out)?;
    phase("cycles");
    cycles_by_concurrency(&c, n, &mut out)?;
    phase("exec_throughput");
    exec_throughput(&c, &mut out)?;
    phase("beside_abusers");
    let (victim, calm) = beside_abusers(&c, n, &mut out)?;
    phase("beside_fork_bombs");
    beside_fork_bombs(&c, n, &victim, &calm, &mut out)?;
    c.ok("DELETE", &format!("/v1/sandboxes/{victim}"), None)?;
    phase("batch_1000");
    batch_1000(&c, d.child.id(), rss_start, &mut out)?;

    let ratios = json!({
        "acquire_pool_hit_p50_ms": out["acquire_pool_hit"]["p50_us"].as_u64().unwrap_or(0) as f64 / 1000.0,
        "exec_true_p50_ms": exec.p50_us as f64 / 1000.0,
        "execs_per_s_at_64": out["exec_throughput_64_sandboxes"]["execs_per_s"],
        "beside_20_fork_bombs_p50_ms": ms(&out, "exec_true_beside_20_fork_bombs", "p50_us"),
        "beside_20_fork_bombs_p99_ms": ms(&out, "exec_true_beside_20_fork_bombs", "p99_us"),
        "beside_20_fork_bombs_no_userns_paced_errors": out
            .get("exec_true_beside_20_fork_bombs_no_userns")
            .and_then(|v| v["paced_20ms"].get("errors").cloned()),
    });
    let doc = json!({
        "bench": "api",

        "iterations": n,
        "results": Value::Object(out),
        "summary": ratios,
    });
    emit(args, doc)
}
