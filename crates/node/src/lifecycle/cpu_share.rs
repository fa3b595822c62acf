//! Sandboxes that wait before sandboxes that spin: the node's CPU-share governor.
//!
//! Every sandbox's cgroup has the weight its spec asks for (100 by default), so beside 20
//! sandboxes that spin a quiet one gets 1/21 of the CPU when it wakes, and each of the several
//! wake-ups of one exec (agent, fork, `exec`, reply) waits behind the spinners' time slices:
//! tens to hundreds of milliseconds.
//!
//! Every [`TICK`] the governor measures each active sandbox's *demand*: how long its threads
//! ran plus waited to run (`/proc/<tid>/schedstat`), as a fraction of the tick. A thread that
//! spins is runnable the whole tick (demand ≥ 1 whatever share it gets); one that serves
//! requests sleeps between them. Only threads that did not sleep in the tick count (no
//! voluntary context switch: a thread that served a call and waited for the next did, however
//! long it waited for a CPU on a loaded host). While tasks wait for a CPU (host PSI), a sandbox
//! with one such thread whose demand reached [`HUNGRY`], or whose such threads' demands add up
//! to [`SWARM`] (a fork bomb's children), moves to the *batch class*: `cpu.idle` (Linux 5.15+) and
//! [`BATCH_CPU_WEIGHT`]. An idle group is preempted as soon as a task of a non-idle group wakes
//! on its CPU, so a quiet sandbox's wake-ups no longer queue behind the spinners' slices; the
//! weight alone (older kernels) only shortens that queue. Per thread, not per
//! sandbox: a sandbox that serves calls back to back waits for a CPU at each of its wake-ups,
//! and those waits add up to most of a tick on a busy node, but no thread of it is runnable the
//! whole tick. Demand, not CPU time used: a batch sandbox
//! gets little CPU (that is the point), so what it uses says nothing of what it wants. The
//! kernel adds a thread's wait to its `schedstat` only when the thread next gets a CPU, so a
//! starved batch sandbox can show no demand for a tick; it gets its own weight back only after
//! [`CALM_TICKS`] ticks in a row with demand under [`CALM`] and none of its threads runnable
//! (state `R`) at the sample.
//!
//! The scheduler stays work-conserving (a spinner alone still gets every idle CPU), batch
//! sandboxes share the CPU equally among themselves, and a sandbox that sleeps between its
//! calls never waits behind one that never sleeps.
//!
//! Cost: one file read per tick while the sandboxes together use under a quarter of a CPU;
//! otherwise one read per sandbox, plus one per thread of the sandboxes that used at least
//! [`ACTIVE`] of a CPU in the tick (and of batch ones).
//!
//! Holds ([`CpuShares::hold`]) pin a sandbox to the batch weight whatever it wants: the function
//! runner holds a zygote whose call has become a long one.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use dsec_sys::cgroup::CpuPartition;

use super::Node;

/// How often the governor samples.
pub const TICK: Duration = Duration::from_millis(100);

/// The `cpu.weight` of a sandbox in the batch class (v1: `cpu.shares` 10).
pub const BATCH_CPU_WEIGHT: u64 = 1;

/// Demand (fraction of a tick) from which a sandbox is batch: a thread runnable all the tick.
pub const HUNGRY: f64 = 0.95;

/// Demand (in ticks) of a sandbox's threads together from which it is batch.
pub const SWARM: f64 = 2.0;

/// Demand under which a tick is calm for a batch sandbox.
pub const CALM: f64 = 0.5;

/// Calm ticks in a row after which a batch sandbox gets its own weight back.
pub const CALM_TICKS: u32 = 3;

/// Below this much CPU in a tick (fraction of one CPU) across all sandboxes, nothing is scanned.
const IDLE: f64 = 0.25;

/// A thread whose run-plus-wait time in a tick is under this fraction of it is not looked at
/// further (one file read instead of two): it cannot move its sandbox's class.
const SLIGHT: f64 = 0.02;

/// A sandbox that used this much CPU in a tick (fraction of one CPU) has its threads sampled.
const ACTIVE: f64 = 0.01;

/// The host's tasks waited for a CPU for at least this fraction of a tick: the sandboxes contend.
const CONTENDED: f64 = 0.05;

/// Where the kernel reports how long tasks waited for a CPU (PSI).
const CPU_PRESSURE: &str = "/proc/pressure/cpu";

/// What one tick decided.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Decision {
    /// To move to the batch weight.
    pub demote: Vec<String>,
    /// To give their own weight back.
    pub restore: Vec<String>,
}

/// What one tick sampled of the sandboxes.
#[derive(Debug, Default)]
pub struct Sample {
    /// Run-plus-wait time in the tick (ns) of each sandbox sampled at both ends of it: of its
    /// threads together, and of its most demanding thread.
    pub demand: HashMap<String, Demand>,
    /// The batch sandboxes with a thread running or waiting to run at the sample.
    pub runnable: HashSet<String>,
}

/// A sandbox's demand in one tick (ns).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Demand {
    /// Of its threads together.
    pub sum: u64,
    /// Of its most demanding thread.
    pub peak: u64,
}

/// Decides one tick: `window` is the tick's length (ns), `batch` the sandboxes at the batch
/// weight now with the calm ticks each has had in a row (updated here), `contended` whether
/// tasks waited for a CPU in the tick. A batch sandbox that was not sampled (it used under
/// [`ACTIVE`]) had a calm tick.
pub fn classify(
    s: &Sample,
    window: u64,
    batch: &mut HashMap<String, u32>,
    contended: bool,
) -> Decision {
    let w = window as f64;
    let mut d = Decision::default();
    for (id, calm) in batch.iter_mut() {
        let quiet =
            !s.runnable.contains(id) && s.demand.get(id).is_none_or(|u| (u.sum as f64) < CALM * w);
        *calm = if quiet { *calm + 1 } else { 0 };
        if *calm >= CALM_TICKS {
            d.restore.push(id.clone());
        }
    }
    if contended {
        for (id, u) in &s.demand {
            let hungry = u.peak as f64 >= HUNGRY * w || u.sum as f64 >= SWARM * w;
            if !batch.contains_key(id) && hungry {
                d.demote.push(id.clone());
            }
        }
    }
    d.demote.sort();
    d.restore.sort();
    d
}

/// The governor's state (see the module docs).
#[derive(Debug, Default)]
pub struct CpuShares {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// When the last tick sampled.
    at: Option<Instant>,
    /// The base cgroup's CPU time at the last tick.
    total: Option<u64>,
    /// The host's CPU pressure (`some` total, µs) at the last tick.
    pressure: Option<u64>,
    /// Each sandbox's CPU time at the last tick (empty after an idle tick).
    usage: HashMap<String, u64>,
    /// Run-plus-wait time and voluntary switches of each thread of the sandboxes sampled at
    /// the last tick.
    threads: HashMap<String, HashMap<i32, (u64, u64)>>,
    /// At the batch weight because of their demand, with their calm ticks in a row.
    batch: HashMap<String, u32>,
    /// Pinned to the batch weight by [`CpuShares::hold`].
    held: HashSet<String>,
    /// The node's CPU partition, when it has one.
    part: Option<Partition>,
}

/// The CPU partition's state: while any sandbox is in the batch class, the batch sandboxes'
/// threads run on CPUs of their own and the node and every other sandbox on the rest.
#[derive(Debug)]
struct Partition {
    cpusets: CpuPartition,
    /// The split now: the quiet cpuset has the CPUs before the first index, the batch one
    /// those from the second on (see [`split`]).
    split: (usize, usize),
    /// The threads of each batch sandbox moved to the batch cpuset.
    moved: HashMap<String, HashSet<i32>>,
}

impl Inner {
    fn batch_len(&self) -> usize {
        self.held.len()
            + self
                .batch
                .keys()
                .filter(|id| !self.held.contains(*id))
                .count()
    }

    fn demoted(&self, id: &str) -> bool {
        self.batch.contains_key(id) || self.held.contains(id)
    }
}

impl CpuShares {
    /// Pins sandbox `id` to the batch weight until [`release`](Self::release). False when its
    /// cgroup is gone.
    pub fn hold(&self, node: &Node, id: &str) -> bool {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let was = g.demoted(id);
        g.held.insert(id.to_owned());
        let ok = was || set_batch(node, id, true, BATCH_CPU_WEIGHT);
        g.place(node);
        ok
    }

    /// Ends a [`hold`](Self::hold): the sandbox gets its own weight back at once (its owner
    /// knows the work that spun is over; if something in it still spins, the next ticks find
    /// it again).
    pub fn release(&self, node: &Node, id: &str) {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if g.held.remove(id) {
            g.batch.remove(id);
            restore(node, id);
            g.place(node);
        }
    }

    /// Gives the governor the node's CPU partition (see [`start_partition`]).
    pub fn set_partition(&self, cpusets: CpuPartition) {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let n = cpusets.cpus().len();
        g.part = Some(Partition {
            cpusets,
            split: (n, 0),
            moved: HashMap::new(),
        });
    }

    /// Ends the partition: every thread of the node and its sandboxes back on every CPU.
    pub fn dissolve_partition(&self) {
        let part = self
            .inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .part
            .take();
        // Dropping the cpusets dissolves them.
        drop(part);
    }

    /// One tick: samples, decides, writes the weights that change. Blocking (file reads).
    pub fn tick(&self, node: &Node) {
        let t0 = Instant::now();
        self.tick_inner(node);
        node.metrics.cpu_tick.observe_duration(t0.elapsed());
    }

    fn tick_inner(&self, node: &Node) {
        let total = node.rt.cgroups().base_cpu_usage_ns();
        let pressure = cpu_pressure_us();
        let at = Instant::now();
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let window =
            g.at.replace(at)
                .map_or(TICK, |before| at - before)
                .as_nanos()
                .max(1) as u64;
        let w = window as f64;
        let used_all = match (g.total, total) {
            (Some(a), Some(b)) => b.saturating_sub(a),
            _ => 0,
        };
        let contended = match (g.pressure, pressure) {
            (Some(a), Some(b)) => b.saturating_sub(a) as f64 * 1000.0 >= CONTENDED * w,
            // Without PSI: the sandboxes used a whole CPU between them.
            _ => used_all >= window,
        };
        (g.total, g.pressure) = (total, pressure);
        if (used_all as f64) < IDLE * w && g.batch.is_empty() {
            g.usage.clear();
            g.threads.clear();
            // A hold released since: the partition ends.
            g.size(0.0);
            return;
        }
        let (usage, threads, sampled) = sample(node, &g, w);
        let batch_used: u64 = usage
            .iter()
            .filter(|(id, _)| g.demoted(id))
            .filter_map(|(id, now)| Some(now.saturating_sub(*g.usage.get(id)?)))
            .sum();
        (g.usage, g.threads) = (usage, threads);
        // Gone sandboxes leave the sets.
        let live: HashSet<String> = g.usage.keys().cloned().collect();
        g.batch.retain(|id, _| live.contains(id));
        g.held.retain(|id| live.contains(id));
        let d = classify(&sampled, window, &mut g.batch, contended);
        for id in d.demote {
            if !g.held.contains(&id) && set_batch(node, &id, true, BATCH_CPU_WEIGHT) {
                node.metrics.cpu_demotions.inc();
                tracing::debug!(sandbox = %id, "cpu: batch class");
            }
            g.batch.insert(id, 0);
        }
        for id in d.restore {
            g.batch.remove(&id);
            if !g.held.contains(&id) {
                restore(node, &id);
                tracing::debug!(sandbox = %id, "cpu: own weight back");
            }
        }
        node.metrics.cpu_batch.set(g.batch_len() as f64);
        g.size(used_all.saturating_sub(batch_used) as f64 / w);
        g.place(node);
    }
}

impl Inner {
    /// Sizes the partition: while any sandbox is batch, the quiet cpuset gets the CPUs the
    /// other sandboxes used in the tick (`quiet_used`, in CPUs) rounded up, plus one for the
    /// node, and at least one CPU is left to each side; otherwise every CPU is both's.
    fn size(&mut self, quiet_used: f64) {
        let any = self.batch_len() > 0;
        let Some(p) = self.part.as_mut() else {
            return;
        };
        let cpus = p.cpusets.cpus();
        let want = split(cpus.len(), any, quiet_used);
        if want == p.split {
            return;
        }
        match p.cpusets.set(&cpus[..want.0], &cpus[want.1..]) {
            Ok(()) => p.split = want,
            Err(e) => tracing::warn!(error = %e, "cpu partition: resize"),
        }
    }

    /// Moves the batch sandboxes' threads not moved yet to the batch cpuset, and the threads
    /// of sandboxes that left the batch class back.
    fn place(&mut self, node: &Node) {
        let batch: HashSet<String> = self.batch.keys().chain(self.held.iter()).cloned().collect();
        let threads = &self.threads;
        let Some(p) = self.part.as_mut() else {
            return;
        };
        let tids = |id: &str| -> Vec<i32> {
            match threads.get(id) {
                Some(m) => m.keys().copied().collect(),
                None => node
                    .rt
                    .cgroups()
                    .open(id)
                    .and_then(|cg| cg.threads())
                    .unwrap_or_default(),
            }
        };
        let left: Vec<String> = p
            .moved
            .keys()
            .filter(|id| !batch.contains(*id))
            .cloned()
            .collect();
        for id in left {
            p.moved.remove(&id);
            // Read now: a thread born since the last sample is in the batch cpuset too.
            let now = node.rt.cgroups().open(&id).and_then(|cg| cg.threads());
            for tid in now.unwrap_or_default() {
                let _ = p.cpusets.place(tid, false);
            }
        }
        for id in batch {
            let now: HashSet<i32> = tids(&id).into_iter().collect();
            let moved = p.moved.entry(id).or_default();
            moved.retain(|t| now.contains(t));
            for tid in now {
                if moved.insert(tid) {
                    let _ = p.cpusets.place(tid, true);
                }
            }
        }
    }
}

/// How `n` CPUs are split: the quiet cpuset gets those before the first index, the batch one
/// those from the second on. Without batch sandboxes (`any`) both get all. Otherwise the quiet
/// side gets what the other sandboxes used (`quiet_used`, in CPUs) rounded up plus one for the
/// node, and the batch side the rest, at least one. (Letting the quiet side keep every CPU
/// when it used most of its share was measured and dropped: see perf-notes, *CPU share*.)
fn split(n: usize, any: bool, quiet_used: f64) -> (usize, usize) {
    if !any || n < 2 {
        return (n, 0);
    }
    let q = (quiet_used.max(0.0).ceil() as usize + 1).clamp(1, n - 1);
    (q, q)
}

/// The node's CPU partition: its two cpusets made and the node's own process in the quiet
/// one, so that everything it starts from now on is too. `None` (the batch class still
/// applies, by `cpu.idle` alone) with one CPU, without a v1 `cpuset` hierarchy, or with
/// `DSEC_CPU_SHARES=off` or `DSEC_CPU_PARTITION=off`. Call before the node starts processes.
pub fn start_partition() -> Option<CpuPartition> {
    let off = |k: &str| std::env::var(k).is_ok_and(|v| v == "off");
    if off("DSEC_CPU_SHARES") || off("DSEC_CPU_PARTITION") {
        return None;
    }
    let root = CpuPartition::v1_root()?;
    match CpuPartition::create(&root, dsec_shim::CGROUP_BASE, std::process::id() as i32) {
        Ok(p) if p.cpus().len() >= 2 => {
            p.sweep();
            Some(p)
        }
        Ok(_) => None,
        Err(e) => {
            tracing::warn!(error = %e, "cpu partition: not made; the batch class is cpu.idle alone");
            None
        }
    }
}

/// Samples every sandbox's CPU time and, for the active and batch ones, their threads'
/// run-plus-wait time (and, for batch ones, whether a thread is runnable). Answers the new
/// usage and thread maps and the [`Sample`].
#[allow(clippy::type_complexity)]
fn sample(
    node: &Node,
    g: &Inner,
    w: f64,
) -> (
    HashMap<String, u64>,
    HashMap<String, HashMap<i32, (u64, u64)>>,
    Sample,
) {
    let (mut usage, mut threads, mut out) = (HashMap::new(), HashMap::new(), Sample::default());
    for e in node.entries() {
        let Some(cg) = node.rt.cgroups().open(&e.id) else {
            continue;
        };
        let Some(cpu) = cg.cpu_usage_ns() else {
            continue;
        };
        usage.insert(e.id.clone(), cpu);
        let used = g.usage.get(&e.id).map(|b| cpu.saturating_sub(*b));
        let active = used.is_some_and(|u| u as f64 >= ACTIVE * w);
        let batch = g.batch.contains_key(&e.id);
        if !active && !batch {
            continue;
        }
        let before = g.threads.get(&e.id);
        let mut now = HashMap::new();
        let mut d = Demand::default();
        let tids = cg.threads().unwrap_or_default();
        for &tid in &tids {
            let Some(t) = dsec_sys::proc::sched_time_ns(tid) else {
                continue;
            };
            // A thread new since the last sample was born in the tick: all its time counts.
            let (b, bv) = before.and_then(|m| m.get(&tid)).copied().unwrap_or((0, 0));
            let dt = t.saturating_sub(b);
            if (dt as f64) < SLIGHT * w {
                // Too little to matter: its switches are not read (it keeps the last count
                // read, so a later tick compares against one at least as old).
                now.insert(tid, (t, bv));
                continue;
            }
            let Some(v) = dsec_sys::proc::voluntary_switches(tid) else {
                continue;
            };
            now.insert(tid, (t, v));
            if v > bv {
                // It slept in the tick: it waits for work, whatever it waited for a CPU.
                continue;
            }
            d.sum = d.sum.saturating_add(dt);
            d.peak = d.peak.max(dt);
        }
        // A batch sandbox that showed little demand may only be starved: the kernel adds a
        // wait to `schedstat` when the thread next runs, so look for a thread waiting now.
        if batch
            && (d.sum as f64) < CALM * w
            && tids
                .iter()
                .any(|&tid| dsec_sys::proc::runnable(tid) == Some(true))
        {
            out.runnable.insert(e.id.clone());
        }
        if before.is_some() {
            out.demand.insert(e.id.clone(), d);
        }
        threads.insert(e.id.clone(), now);
    }
    (usage, threads, out)
}

/// The host's CPU pressure: how long, in µs since boot, some task waited for a CPU (the `some`
/// line's `total` of [`CPU_PRESSURE`]); `None` without PSI.
fn cpu_pressure_us() -> Option<u64> {
    let text = std::fs::read_to_string(CPU_PRESSURE).ok()?;
    parse_pressure(&text)
}

/// The `total=` of the `some` line of a PSI file.
fn parse_pressure(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("some "))?;
    line.split_whitespace()
        .find_map(|f| f.strip_prefix("total="))?
        .parse()
        .ok()
}

/// Gives sandbox `id` the weight its spec asks for.
fn restore(node: &Node, id: &str) {
    if let Some(e) = node.entry(id) {
        set_batch(node, id, false, e.record().spec.limits.cpu_weight);
    }
}

/// Moves sandbox `id` to the batch class (`on`) or back to `weight`; false when its cgroup is
/// gone.
fn set_batch(node: &Node, id: &str, on: bool, weight: u64) -> bool {
    let Some(cg) = node.rt.cgroups().open(id) else {
        return false;
    };
    // `cpu.idle` where the kernel has it (5.15+), and the lowest weight either way.
    let idle = cg.set_cpu_idle(on).is_ok();
    let weight = if on { BATCH_CPU_WEIGHT } else { weight };
    let w = cg
        .set_limits(&dsec_sys::cgroup::CgroupLimits {
            cpu_weight: Some(weight),
            ..Default::default()
        })
        .is_ok();
    idle || w
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn the_quiet_side_gets_what_it_used_plus_one_and_leaves_batch_one() {
        assert_eq!(split(2, false, 0.0), (2, 0));
        assert_eq!(split(2, true, 0.0), (1, 1));
        assert_eq!(split(2, true, 1.7), (1, 1));
        assert_eq!(split(16, true, 0.2), (2, 2));
        assert_eq!(split(16, true, 4.4), (6, 6));
        assert_eq!(split(16, true, 40.0), (15, 15));
        assert_eq!(split(1, true, 0.0), (1, 0));
        assert_eq!(split(16, false, 5.0), (16, 0));
    }

    #[test]
    fn pressure_parses_the_some_total() {
        let t = "some avg10=0.00 avg60=0.45 avg300=4.53 total=13214928850\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n";
        assert_eq!(parse_pressure(t), Some(13214928850));
        assert_eq!(parse_pressure("full total=3\n"), None);
        assert_eq!(parse_pressure("some total=x\n"), None);
    }

    /// Sandboxes with one thread of demand `u` each.
    fn sample(d: &[(&str, u64)], runnable: &[&str]) -> Sample {
        Sample {
            demand: d
                .iter()
                .map(|(i, u)| (i.to_string(), Demand { sum: *u, peak: *u }))
                .collect(),
            runnable: runnable.iter().map(|s| s.to_string()).collect(),
        }
    }

    fn batch(v: &[&str]) -> HashMap<String, u32> {
        v.iter().map(|s| (s.to_string(), 0)).collect()
    }

    #[test]
    fn spinners_go_batch_and_the_quiet_one_does_not() {
        // A spinner is runnable the whole tick whatever share it gets; a fork bomb's threads
        // add up to more; the quiet sandbox ran and waited for part of it.
        let mut s = sample(&[("quiet", 60 * MS), ("spin", 100 * MS)], &[]);
        let swarm = |sum| Demand { sum, peak: 10 * MS };
        s.demand.insert("bomb".into(), swarm(3_000 * MS));
        // Back to back calls on a busy node: waits add up to most of the tick, no thread
        // is runnable all of it.
        s.demand.insert("calls".into(), swarm(190 * MS));
        let got = classify(&s, 100 * MS, &mut HashMap::new(), true);
        assert_eq!(got.demote, vec!["bomb".to_string(), "spin".to_string()]);
        assert!(got.restore.is_empty());
    }

    #[test]
    fn no_contention_demotes_no_one() {
        let s = sample(&[("spin", 100 * MS)], &[]);
        let got = classify(&s, 100 * MS, &mut HashMap::new(), false);
        assert_eq!(got, Decision::default());
    }

    #[test]
    fn a_batch_sandbox_gets_its_weight_back_after_calm_ticks_in_a_row() {
        // "starved" got no CPU in the tick, so its schedstat shows nothing, but a thread of it
        // is runnable; "calm" sleeps; "idle" used too little to be sampled; "busy" ran a lot.
        let mut b = batch(&["starved", "calm", "idle", "busy"]);
        let s = sample(
            &[("starved", 0), ("calm", 20 * MS), ("busy", 99 * MS)],
            &["starved"],
        );
        for _ in 1..CALM_TICKS {
            assert_eq!(classify(&s, 100 * MS, &mut b, true), Decision::default());
        }
        let got = classify(&s, 100 * MS, &mut b, false);
        assert_eq!(got.restore, vec!["calm".to_string(), "idle".to_string()]);
        // A busy tick starts the count again.
        let mut b = batch(&["calm"]);
        let busy = sample(&[("calm", 80 * MS)], &[]);
        let calm = sample(&[("calm", 10 * MS)], &[]);
        classify(&calm, 100 * MS, &mut b, true);
        classify(&busy, 100 * MS, &mut b, true);
        for _ in 1..CALM_TICKS {
            assert!(classify(&calm, 100 * MS, &mut b, true).restore.is_empty());
        }
        assert_eq!(classify(&calm, 100 * MS, &mut b, true).restore.len(), 1);
    }
}
