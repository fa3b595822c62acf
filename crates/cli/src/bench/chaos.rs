//! `dsec bench chaos`: a soak of the node daemon under crashes and faults.
//!
//! The bench starts `dsec server` (this executable) on state dirs of its own, the data dir on a
//! small tmpfs, and runs `--cycles` cycles. In each, a few client threads run a mixed workload
//! (`workload.rs`) while the chaos side picks its moments: maybe SIGKILL to one of this
//! daemon's supervisors, maybe to an agent inside one of its sandboxes, then SIGKILL to the
//! daemon itself. The daemon is started again on the same dirs (it adopts the sandboxes whose
//! supervisors survived) and the invariants are checked (`verify.rs`). Once, the data dir is
//! filled to `ENOSPC` for a cycle; once, the daemon's clock is stepped forward 10 minutes at a
//! restart and back at the next (`DSEC_CLOCK_OFFSET_MS`, this process only: the shared host's
//! clock is left alone). VM sandboxes (QEMU) are not part of the workload.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::{Mutex, RwLock};
use std::time::{Duration, Instant};

use anyhow::Context;
use dsec_testkit as testkit;
use serde_json::{json, Value};

use super::{dist, emit, BenchArgs};

mod machine;
mod verify;
mod workload;

use machine::{Machine, Tmpfs};
use workload::{Shared, Worker};

/// The data dir's tmpfs, MiB: room for the store and the trajectory log, small enough to fill.
const DATA_MB: u64 = 256;
/// The daemon's clock step at one restart (and back at the next).
const CLOCK_STEP_MS: i64 = 600_000;

/// A small xorshift generator: the soak's choices, reproducible from `--seed`.
#[derive(Debug, Clone)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed | 1)
    }

    pub(crate) fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number in `0..n` (0 when `n` is 0).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
}

/// The soak's daemon: its dirs, the current process, how it was started.
struct Soak {
    base: PathBuf,
    machine: Machine,
    daemon: Option<testkit::Daemon>,
    generation: u32,
    /// Held for the soak's life; unmounted after the daemon is gone.
    tmpfs: Option<Tmpfs>,
}

impl Soak {
    fn new() -> anyhow::Result<Self> {
        let base = PathBuf::from(format!("/tmp/dsec-bench-chaos-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(base.join("logs"))?;
        let (data, run) = (base.join("d"), base.join("r"));
        let tmpfs = Tmpfs::mount(&data, DATA_MB)?;
        Ok(Self {
            machine: Machine::new(&data, &run),
            base,
            daemon: None,
            generation: 0,
            tmpfs: Some(tmpfs),
        })
    }

    fn log(&self, generation: u32) -> PathBuf {
        self.base
            .join("logs")
            .join(format!("daemon-{generation}.log"))
    }

    /// Starts the daemon (again) with its clock `offset_ms` off, waits until it is ready and
    /// answers its `/readyz` (with the recovery report).
    fn start(&mut self, offset_ms: i64) -> anyhow::Result<Value> {
        self.generation += 1;
        let exe = std::env::current_exe()?;
        let d = testkit::Server::new(exe, &self.machine.data, &self.machine.run)
            .args(&[
                "--pool-max",
                "0",
                "--run-zygotes",
                "1",
                "--shutdown-sandboxes",
            ])
            .env("DSEC_SPAWNER_SHELLS", "2")
            .env("DSEC_CLOCK_OFFSET_MS", &offset_ms.to_string())
            .log_to(&self.log(self.generation))
            .timeout(Duration::from_secs(60))
            .start()
            .with_context(|| format!("start the daemon (generation {})", self.generation))?;
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let (s, v) = d.req("GET", "/readyz", None);
            if s == 200 {
                self.daemon = Some(d);
                return Ok(v);
            }
            anyhow::ensure!(Instant::now() < deadline, "not ready after 120 s: {s} {v}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn daemon(&mut self) -> anyhow::Result<&mut testkit::Daemon> {
        self.daemon.as_mut().context("no daemon")
    }

    /// The last lines of generation `g`'s log.
    fn log_tail(&self, g: u32) -> String {
        let text = std::fs::read_to_string(self.log(g)).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

impl Drop for Soak {
    fn drop(&mut self) {
        // SIGTERM: with `--shutdown-sandboxes` the daemon destroys every sandbox it has.
        if let Some(mut d) = self.daemon.take() {
            if d.running() {
                d.sigterm();
                let deadline = Instant::now() + Duration::from_secs(60);
                while d.running() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
        // Whatever is still there (a soak that failed half-way): this daemon's processes, by
        // their environment, and its sandboxes' cgroups.
        for _ in 0..3 {
            let procs = self.machine.procs();
            if procs.is_empty() {
                break;
            }
            for p in procs {
                machine::kill9(p.pid);
            }
            std::thread::sleep(Duration::from_millis(300));
        }
        let ids = self.machine.run_dirs();
        if let Ok(m) = dsec_sys::cgroup::CgroupManager::detect("dsec") {
            for id in self.machine.cgroups(&ids) {
                if let Some(g) = m.open(&id) {
                    let _ = g.kill_all();
                    let _ = g.remove();
                }
            }
        }
        for m in self.machine.mounts().iter().rev() {
            let _ = std::process::Command::new("umount")
                .args(["-l", m])
                .status();
        }
        drop(self.tmpfs.take());
        testkit::remove_unless_mounted(&self.base);
    }
}

/// What the soak counts besides the checks.
#[derive(Default)]
struct Tally {
    kills: BTreeMap<&'static str, u64>,
    restart_us: Vec<u64>,
    recovery: BTreeMap<&'static str, u64>,
    enospc: Value,
    clock_steps: Vec<Value>,
    unexpected_exits: Vec<String>,
}

/// Kills one of this daemon's supervisors (`agent`: an agent in one of its sandboxes) picked
/// from the API's listing; answers whether it did.
fn kill_one(s: &Shared, m: &Machine, rng: &mut Rng, agent: bool) -> bool {
    let Ok(all) = verify::listed(&s.client()) else {
        return false;
    };
    let live: Vec<&Value> = all.values().filter(|v| v["state"] == "running").collect();
    if live.is_empty() {
        return false;
    }
    let v = live[rng.below(live.len() as u64) as usize];
    let id = v["id"].as_str().unwrap_or_default();
    if agent {
        return m.agent_of(id).is_some_and(machine::kill9);
    }
    let pid = verify::detail(&s.client(), id)
        .and_then(|v| v["supervisor_pid"].as_i64())
        .unwrap_or(0) as i32;
    // Only a supervisor of this daemon, whatever the API said.
    m.is_our_supervisor(pid) && machine::kill9(pid)
}

/// One cycle's fault plan: when to kill what, ms into the cycle.
struct Plan {
    run_ms: u64,
    supervisor_at: Option<u64>,
    agent_at: Option<u64>,
    /// The cycle the data dir is full: when it is freed again.
    free_at: Option<u64>,
}

impl Plan {
    fn draw(rng: &mut Rng, full: bool) -> Self {
        let run_ms = if full { 6000 } else { 800 + rng.below(2200) };
        let at = |rng: &mut Rng| (rng.below(2) == 0).then(|| rng.below(run_ms));
        Self {
            supervisor_at: at(rng),
            agent_at: at(rng),
            free_at: full.then_some(3500),
            run_ms,
        }
    }
}

/// `method path body` must succeed: its answer.
fn must(s: &Shared, method: &str, path: &str, body: Value) -> Result<Value, String> {
    match s.client().call(method, path, Some(&body)) {
        Ok((200..=299, v)) => Ok(v),
        other => Err(format!("{method} {path}: {other:?}")),
    }
}

/// A create, an exec and a delete must succeed (the daemon serves again); then a trajectory
/// step is tried, answering whether it was logged.
fn probe(s: &Shared) -> Result<Result<(), String>, String> {
    let v = must(s, "POST", "/v1/sandboxes", json!({}))?;
    let id = v["id"].as_str().unwrap_or_default().to_owned();
    let exec = format!("/v1/sandboxes/{id}/exec");
    must(s, "POST", &exec, json!({"shell": "true"}))?;
    let traj = format!("{}-probe-{}", s.tag, s.ledger().ops.values().sum::<u64>());
    let step = must(
        s,
        "POST",
        &exec,
        json!({"shell": "true", "trajectory": traj}),
    );
    must(s, "DELETE", &format!("/v1/sandboxes/{id}"), json!({}))?;
    Ok(step.map(|_| ()))
}

/// After the data dir was freed: whether the daemon serves again without a restart (within
/// 10 s), and whether its trajectory log does.
fn after_full(s: &Shared, t: &mut Tally) {
    let t1 = Instant::now();
    let mut last = Err(String::new());
    while t1.elapsed() < Duration::from_secs(10) {
        last = probe(s);
        if last.is_ok() {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    t.enospc["serves_without_restart"] = json!(last.is_ok());
    t.enospc["recovery_ms"] = json!(t1.elapsed().as_millis() as u64);
    match last {
        Err(e) => t.enospc["recovery_error"] = json!(e),
        Ok(Err(e)) => {
            t.enospc["trajectory_log_without_restart"] = json!(false);
            t.enospc["trajectory_log_error"] = json!(e);
        }
        Ok(Ok(())) => t.enospc["trajectory_log_without_restart"] = json!(true),
    }
}

/// The workload on `workers` for one cycle while the chaos side follows `plan`; ends with the
/// daemon killed.
fn cycle(
    soak: &mut Soak,
    shared: &Shared,
    workers: &mut [Worker],
    plan: &Plan,
    rng: &mut Rng,
    t: &mut Tally,
) -> anyhow::Result<()> {
    shared.stop.store(false, Ordering::Relaxed);
    let t0 = Instant::now();
    let g = soak.generation;
    let (m, daemon) = (&soak.machine, soak.daemon.as_mut().context("no daemon")?);
    let mut events: Vec<(u64, &'static str)> = [
        plan.supervisor_at.map(|a| (a, "supervisor")),
        plan.agent_at.map(|a| (a, "agent")),
        plan.free_at.map(|a| (a, "free")),
    ]
    .into_iter()
    .flatten()
    .collect();
    events.sort_unstable();
    let full = plan.free_at.is_some();
    std::thread::scope(|sc| {
        for w in workers.iter_mut() {
            sc.spawn(move || workload::work(shared, w));
        }
        for (at, kind) in events {
            let wait = Duration::from_millis(at).saturating_sub(t0.elapsed());
            std::thread::sleep(wait);
            if kind == "free" {
                free(&m.data, shared, t);
                continue;
            }
            if kill_one(shared, m, rng, kind == "agent") {
                *t.kills.entry(kind).or_default() += 1;
            }
        }
        std::thread::sleep(Duration::from_millis(plan.run_ms).saturating_sub(t0.elapsed()));
        if !full {
            // Under load: requests are in flight when it dies.
            kill_daemon(daemon, g, t);
        }
        shared.stop.store(true, Ordering::Relaxed);
    });
    if full {
        // The cycle of the full disk ends with the daemon serving again without a restart.
        after_full(shared, t);
        kill_daemon(daemon, g, t);
    }
    Ok(())
}

/// SIGKILL to the daemon (generation `g`), noting it if it had exited by itself.
fn kill_daemon(d: &mut testkit::Daemon, g: u32, t: &mut Tally) {
    if !d.running() {
        let st = d.child.try_wait().ok().flatten();
        t.unexpected_exits
            .push(format!("generation {g} exited by itself: {st:?}"));
    }
    d.kill9();
    *t.kills.entry("daemon").or_default() += 1;
}

/// Restarts the daemon (clock `offset_ms` off) and adds its recovery report to the tally.
fn restart(soak: &mut Soak, shared: &Shared, offset_ms: i64, t: &mut Tally) -> anyhow::Result<()> {
    drop(soak.daemon.take());
    let t0 = Instant::now();
    let ready = soak.start(offset_ms)?;
    t.restart_us.push(super::us(t0));
    for k in ["adopted", "reaped", "orphans", "orphan_cgroups"] {
        let n = ready["recovery"][k].as_array().map_or(0, Vec::len) as u64;
        *t.recovery.entry(k).or_default() += n;
    }
    let d = soak.daemon()?;
    *shared.http.write().unwrap_or_else(|p| p.into_inner()) = d.http().clone();
    Ok(())
}

/// Every check after a restart. `new_steps` are the steps acknowledged since the last one:
/// those of live sandboxes are replayed, with a sample of older ones.
fn check(
    soak: &mut Soak,
    shared: &Shared,
    from: usize,
    rng: &mut Rng,
    c: &mut verify::Checks,
) -> anyhow::Result<()> {
    let pid = soak.daemon()?.child.id() as i32;
    verify::machine(shared, &soak.machine, pid, c);
    verify::survivors(shared, c);
    let (steps, keys) = {
        let l = shared.ledger();
        (l.steps.clone(), l.keys.clone())
    };
    let live: BTreeSet<String> = verify::listed(&shared.client())
        .map(|l| l.into_keys().collect())
        .unwrap_or_default();
    let mut replay: BTreeSet<usize> = (from..steps.len()).collect();
    for _ in 0..10 {
        replay.insert(rng.below(steps.len() as u64) as usize);
    }
    replay.retain(|i| steps.get(*i).is_some_and(|s| live.contains(&s.sandbox)));
    verify::records(shared, &steps, &replay, c);
    verify::keys(shared, &keys, c);
    Ok(())
}

/// The file that fills the data dir.
fn filler(data: &std::path::Path) -> PathBuf {
    data.join("chaos-fill")
}

/// Frees the full data dir and notes the errors the clients got while it was full.
fn free(data: &std::path::Path, shared: &Shared, t: &mut Tally) {
    let _ = std::fs::remove_file(filler(data));
    let before = t.enospc["errors_before"].take();
    let during: BTreeMap<String, u64> = shared
        .ledger()
        .errors
        .iter()
        .map(|(k, v)| (k.clone(), v - before[k].as_u64().unwrap_or(0)))
        .filter(|(_, v)| *v > 0)
        .collect();
    if let Some(o) = t.enospc.as_object_mut() {
        o.remove("errors_before");
    }
    let untyped: u64 = during
        .iter()
        .filter(|(k, _)| *k == "internal" || k.starts_with("http_5"))
        .map(|(_, v)| v)
        .sum();
    t.enospc["errors_while_full"] = json!(during);
    t.enospc["untyped_errors_while_full"] = json!(untyped);
}

/// Runs the soak.
pub fn run(args: &BenchArgs) -> anyhow::Result<ExitCode> {
    let cycles = args.cycles.max(1);
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    let mut rng = Rng::new(seed);
    let mut soak = Soak::new()?;
    soak.start(0)?;
    let tag = format!("chaos{}", seed % 100_000);
    let shared = Shared {
        http: RwLock::new(soak.daemon()?.http().clone()),
        stop: false.into(),
        tag,
        ledger: Mutex::new(workload::Ledger::default()),
    };
    let mut workers: Vec<Worker> = (0..args.threads.max(1))
        .map(|i| Worker::new(i, seed))
        .collect();
    let (enospc_at, clock_at) = (cycles / 3, cycles / 2);
    let mut c = verify::Checks::default();
    let mut t = Tally::default();
    let mut offset = 0i64;
    let mut checked_from = 0usize;
    let t0 = Instant::now();
    for n in 0..cycles {
        let full = n == enospc_at;
        let plan = Plan::draw(&mut rng, full);
        if full {
            let bytes = machine::fill(&filler(&soak.machine.data))?;
            let before = shared.ledger().errors.clone();
            t.enospc = json!({"cycle": n, "filled_bytes": bytes, "full_ms": plan.free_at,
                              "errors_before": before});
        }
        cycle(&mut soak, &shared, &mut workers, &plan, &mut rng, &mut t)?;
        if n == clock_at || (n == clock_at + 1 && offset != 0) {
            offset = if offset == 0 { CLOCK_STEP_MS } else { 0 };
            t.clock_steps
                .push(json!({"after_cycle": n, "daemon_clock_offset_ms": offset}));
        }
        if let Err(e) = restart(&mut soak, &shared, offset, &mut t) {
            let g = soak.generation;
            c.fail(format!(
                "{e:#}; log of generation {g}:\n{}",
                soak.log_tail(g)
            ));
            break;
        }
        if n == enospc_at {
            // After the restart the trajectory log takes records again.
            let ok = matches!(probe(&shared), Ok(Ok(())));
            t.enospc["trajectory_log_after_restart"] = json!(ok);
        }
        let steps_now = shared.ledger().steps.len();
        check(&mut soak, &shared, checked_from, &mut rng, &mut c)?;
        checked_from = steps_now;
    }
    let wall_s = t0.elapsed().as_secs_f64();
    report(args, cycles, seed, wall_s, &shared, c, t)
}

/// The JSON report; a non-zero exit when an invariant broke.
#[allow(clippy::too_many_arguments)]
fn report(
    args: &BenchArgs,
    cycles: usize,
    seed: u64,
    wall_s: f64,
    shared: &Shared,
    c: verify::Checks,
    t: Tally,
) -> anyhow::Result<ExitCode> {
    let l = shared.ledger();
    let ok = c.failures.is_empty()
        && l.wrong.is_empty()
        && t.unexpected_exits.is_empty()
        && c.orphans_found == 0
        && c.lost_records == 0
        && c.changed_records == 0
        && c.idempotency_lost == 0
        && c.survivors_failed == 0
        && t.enospc["serves_without_restart"] != false
        && t.enospc["untyped_errors_while_full"] == 0
        && t.enospc["trajectory_log_after_restart"] != false;
    let distinct_steps = l.steps.len();
    let doc = json!({
        "bench": "chaos",
        "ok": ok,
        "cycles": cycles,
        "restarts": t.restart_us.len(),
        "threads": args.threads,
        "seed": seed,
        "wall_s": wall_s,
        "kills": {"daemon": t.kills.get("daemon").copied().unwrap_or(0),
                  "supervisor": t.kills.get("supervisor").copied().unwrap_or(0),
                  "agent": t.kills.get("agent").copied().unwrap_or(0),
                  "qemu": 0},
        "ops": &l.ops,
        "acked_records": distinct_steps,
        "acked_records_checked": c.acked_records_checked,
        "replays_checked": c.replays_checked,
        "idempotency_keys": l.keys.len(),
        "idempotency_checked": c.idempotency_checked,
        "survivors_checked": c.survivors_checked,
        "pooled_checked": c.pooled_checked,
        "orphans_found": c.orphans_found,
        "missing_found": c.missing_found,
        "lost_records": c.lost_records,
        "changed_records": c.changed_records,
        "idempotency_lost": c.idempotency_lost,
        "survivors_failed": c.survivors_failed,
        "wrong_answers": l.wrong.len(),
        "errors": &l.errors,
        "enospc": t.enospc,
        "clock_steps": t.clock_steps,
        "recovery": t.recovery,
        "restart": dist(t.restart_us.clone()),
        "unexpected_exits": t.unexpected_exits,
        "failures": c.failures,
        "wrong": l.wrong.iter().take(20).collect::<Vec<_>>(),
    });
    drop(l);
    emit(args, doc)?;
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
