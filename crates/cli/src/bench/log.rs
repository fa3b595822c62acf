//! `dsec bench log`: the trajectory log's durable appends, measured in process, with SQLite as
//! the peer in the same run.
//!
//! - Appends: 1, 16 and 64 writer threads, each with its own trajectory, appending 200 B and
//!   64 KiB records with `append_blocking` (durable when it returns). Appends/s over the wall
//!   time, fsyncs/s from the log's counters, per-append latency.
//! - Peer: the same records through SQLite (WAL, `synchronous=FULL`, one `BEGIN IMMEDIATE` …
//!   `COMMIT` per record, a connection per writer, `busy_timeout`), at 1 and 16 writers; the
//!   table has an index on (trajectory, step), as the log has its in-memory index.
//! - The floor: one 200 B write + `fdatasync` on the same file system.
//! - Replay of a 100-step trajectory (an intent and a result per step): `read` of all of it,
//!   and `step` for each of the 100 steps, repeated; the page cache is warm.
//!
//! Record counts scale with `--iterations` (200 by default); each configuration also stops at
//! [`RUN_LIMIT`] so that a full run stays under about a minute on a slow disk. The log lives in
//! a fresh temporary directory under the data dir, or under `/var/tmp` when the data dir is
//! missing or in memory (fsync on tmpfs measures nothing); the file system type is reported.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use dsec_node::trajlog::{Config, Record, RecordKind, TrajLog};
use rusqlite::{params, TransactionBehavior};
use serde_json::{json, Value};

use super::{dist, emit, us, BenchArgs};

/// The longest one append configuration runs.
const RUN_LIMIT: Duration = Duration::from_secs(4);
/// Small and large record payloads.
const SMALL: usize = 200;
const LARGE: usize = 64 << 10;
/// Steps in the replayed trajectory.
const REPLAY_STEPS: u64 = 100;

/// Target: small durable appends/s at 64 writers.
const TARGET_APPENDS_PER_S: f64 = 50_000.0;
/// Target: p99 append latency at 64 writers, and 100-step replay time.
const TARGET_P99_US: u64 = 10_000;

/// One append workload: `writers` threads share `records` appends of `payload` bytes.
#[derive(Debug, Clone, Copy)]
struct Workload {
    writers: usize,
    payload: usize,
    records: usize,
}

impl Workload {
    fn name(&self) -> String {
        let size = if self.payload >= 1024 {
            format!("{}KiB", self.payload >> 10)
        } else {
            format!("{}B", self.payload)
        };
        format!("{size}_w{}", self.writers)
    }
}

/// What the writers of one workload did.
struct Outcome {
    latencies: Vec<u64>,
    /// The fewest and the most appends one writer made (a gap shows unfair locking).
    per_writer: (usize, usize),
    elapsed: Duration,
    hit_limit: bool,
}

impl Outcome {
    fn per_s(&self, n: u64) -> f64 {
        n as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// The figures of workload `w` that made `appends`, and the fields of `extra`.
    fn report(self, w: &Workload, appends: u64, extra: Value) -> Value {
        let mut v = json!({
            "writers": w.writers,
            "payload_bytes": w.payload,
            "appends": appends,
            "seconds": (self.elapsed.as_secs_f64() * 1000.0).round() / 1000.0,
            "appends_per_s": self.per_s(appends).round(),
            "writer_appends_min_max": [self.per_writer.0, self.per_writer.1],
            "stopped_at_time_limit": self.hit_limit,
            "latency": dist(self.latencies),
        });
        if let (Some(o), Value::Object(extra)) = (v.as_object_mut(), extra) {
            o.extend(extra);
        }
        v
    }
}

/// A JSON payload of exactly `size` bytes (`{"out":"xxx…"}`), as a command result would be.
fn payload(size: usize) -> Vec<u8> {
    let mut p = b"{\"out\":\"".to_vec();
    p.resize(size.saturating_sub(2).max(p.len()), b'x');
    p.extend_from_slice(b"\"}");
    p
}

/// Runs `writers` threads that each call `append(writer, seq)` up to `per_writer` times or until
/// [`RUN_LIMIT`], all starting together.
fn drive<S, F>(w: Workload, setup: S) -> anyhow::Result<Outcome>
where
    S: Fn(usize) -> anyhow::Result<F> + Sync,
    F: FnMut(u64) -> anyhow::Result<()> + Send,
{
    let per_writer = w.records.div_ceil(w.writers).max(1);
    let barrier = Barrier::new(w.writers + 1);
    let (start, results) = std::thread::scope(|s| -> anyhow::Result<_> {
        let handles: Vec<_> = (0..w.writers)
            .map(|i| {
                let (barrier, setup) = (&barrier, &setup);
                s.spawn(move || -> anyhow::Result<(Vec<u64>, bool)> {
                    let made = setup(i);
                    barrier.wait();
                    let mut append = made?;
                    let deadline = Instant::now() + RUN_LIMIT;
                    let mut lat = Vec::with_capacity(per_writer);
                    for seq in 0..per_writer as u64 {
                        if Instant::now() >= deadline {
                            return Ok((lat, true));
                        }
                        let t = Instant::now();
                        append(seq)?;
                        lat.push(us(t));
                    }
                    Ok((lat, false))
                })
            })
            .collect();
        barrier.wait();
        let start = Instant::now();
        let results: Vec<_> = handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("writer thread panicked")))
            })
            .collect();
        Ok((start, results))
    })?;
    let elapsed = start.elapsed();
    let mut latencies = Vec::with_capacity(w.records);
    let mut hit_limit = false;
    let mut per_writer = (usize::MAX, 0);
    for r in results {
        let (lat, hit) = r?;
        per_writer = (per_writer.0.min(lat.len()), per_writer.1.max(lat.len()));
        latencies.extend(lat);
        hit_limit |= hit;
    }
    Ok(Outcome {
        latencies,
        per_writer,
        elapsed,
        hit_limit,
    })
}

/// Step and kind of a writer's `seq`-th record: an intent then a result per step.
fn step_kind(seq: u64) -> (u64, RecordKind) {
    let kind = if seq.is_multiple_of(2) {
        RecordKind::Intent
    } else {
        RecordKind::Result
    };
    (seq / 2, kind)
}

fn bench_dsec(parent: &Path, w: Workload) -> anyhow::Result<Value> {
    let (log, tmp) = TrajLog::open_temp_in(parent, Config::new("")).context("open the log")?;
    let body = payload(w.payload);
    // Warm-up: the segment file's first pages and the writer thread.
    for step in 0..8 {
        log.append_blocking(Record::new(
            "warmup",
            step,
            RecordKind::Intent,
            body.clone(),
        ))?;
    }
    let before = log.stats();
    let out = drive(w, |i| {
        let (log, body) = (&log, &body);
        let traj = format!("writer-{i}");
        Ok(move |seq| {
            let (step, kind) = step_kind(seq);
            log.append_blocking(Record::new(&traj, step, kind, body.clone()))?;
            Ok(())
        })
    })?;
    let after = log.stats();
    drop(log);
    drop(tmp);
    let appends = after.appends - before.appends;
    let fsyncs = after.fsyncs - before.fsyncs;
    anyhow::ensure!(
        appends == out.latencies.len() as u64,
        "the log counted {appends} appends, the writers {}",
        out.latencies.len()
    );
    let extra = json!({
        "fsyncs": fsyncs,
        "fsyncs_per_s": out.per_s(fsyncs).round(),
        "appends_per_fsync": round1(appends as f64 / fsyncs.max(1) as f64),
        "mb_per_s": round1(out.per_s(after.bytes_written - before.bytes_written) / 1e6),
    });
    Ok(out.report(&w, appends, extra))
}

fn sqlite_open(path: &Path) -> anyhow::Result<rusqlite::Connection> {
    let c = rusqlite::Connection::open(path).with_context(|| format!("open {}", path.display()))?;
    c.busy_timeout(Duration::from_secs(30))?;
    let mode: String = c.query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))?;
    anyhow::ensure!(mode == "wal", "sqlite refused WAL mode ({mode})");
    c.execute_batch("PRAGMA synchronous=FULL;")?;
    Ok(c)
}

fn sqlite_create(path: &Path) -> anyhow::Result<rusqlite::Connection> {
    let c = sqlite_open(path)?;
    c.execute_batch(
        "CREATE TABLE records (
             lsn INTEGER PRIMARY KEY,
             trajectory TEXT NOT NULL,
             step INTEGER NOT NULL,
             kind TEXT NOT NULL,
             payload BLOB NOT NULL
         );
         CREATE INDEX records_by_step ON records (trajectory, step);",
    )?;
    Ok(c)
}

fn sqlite_insert(
    c: &mut rusqlite::Connection,
    traj: &str,
    step: u64,
    kind: RecordKind,
    body: &[u8],
) -> anyhow::Result<()> {
    let tx = c.transaction_with_behavior(TransactionBehavior::Immediate)?;
    tx.prepare_cached("INSERT INTO records (trajectory, step, kind, payload) VALUES (?, ?, ?, ?)")?
        .execute(params![traj, step as i64, kind.as_str(), body])?;
    tx.commit()?;
    Ok(())
}

fn bench_sqlite(parent: &Path, w: Workload) -> anyhow::Result<Value> {
    let tmp = tempfile::Builder::new()
        .prefix("sqlite-peer-")
        .tempdir_in(parent)?;
    let path = tmp.path().join("log.db");
    let mut first = sqlite_create(&path)?;
    let body = payload(w.payload);
    for step in 0..8 {
        sqlite_insert(&mut first, "warmup", step, RecordKind::Intent, &body)?;
    }
    let out = drive(w, |i| {
        let mut c = sqlite_open(&path)?;
        let (traj, body) = (format!("writer-{i}"), &body);
        Ok(move |seq| {
            let (step, kind) = step_kind(seq);
            sqlite_insert(&mut c, &traj, step, kind, body)
        })
    })?;
    let stored: i64 = first.query_row("SELECT count(*) FROM records", [], |r| r.get(0))?;
    let appends = out.latencies.len() as u64;
    anyhow::ensure!(
        stored as u64 == appends + 8,
        "sqlite holds {stored} rows, the writers made {appends} + 8"
    );
    Ok(out.report(&w, appends, json!({})))
}

/// One 200 B append + `fdatasync` to a plain file: the disk's floor for one durable record.
fn bench_fdatasync(parent: &Path, n: usize) -> anyhow::Result<super::Dist> {
    let mut f = tempfile::tempfile_in(parent)?;
    let body = payload(SMALL);
    let deadline = Instant::now() + RUN_LIMIT;
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        if Instant::now() >= deadline {
            break;
        }
        let t = Instant::now();
        f.write_all(&body)?;
        f.sync_data()?;
        v.push(us(t));
    }
    Ok(dist(v))
}

/// Replay figures for a 100-step trajectory among other records, dsec and SQLite.
fn bench_replay(parent: &Path, reps: usize) -> anyhow::Result<BTreeMap<&'static str, Value>> {
    let (log, tmp) = TrajLog::open_temp_in(parent, Config::new("")).context("open the log")?;
    let db_dir = tempfile::Builder::new()
        .prefix("sqlite-peer-")
        .tempdir_in(parent)?;
    let mut db = sqlite_create(&db_dir.path().join("log.db"))?;
    let intent = payload(SMALL);
    let result = payload(2048);
    // The trajectory interleaved with a neighbour's records, appended from two threads so the
    // fsyncs are shared.
    std::thread::scope(|s| -> anyhow::Result<()> {
        let jobs: Vec<_> = ["replay", "neighbour"]
            .into_iter()
            .map(|traj| {
                let (log, intent, result) = (&log, &intent, &result);
                s.spawn(move || -> anyhow::Result<()> {
                    for step in 0..REPLAY_STEPS {
                        log.append_blocking(Record::new(
                            traj,
                            step,
                            RecordKind::Intent,
                            intent.clone(),
                        ))?;
                        log.append_blocking(Record::new(
                            traj,
                            step,
                            RecordKind::Result,
                            result.clone(),
                        ))?;
                    }
                    Ok(())
                })
            })
            .collect();
        for j in jobs {
            j.join()
                .unwrap_or_else(|_| Err(anyhow::anyhow!("replay writer panicked")))?;
        }
        Ok(())
    })?;
    {
        let tx = db.transaction()?;
        for step in 0..REPLAY_STEPS {
            for traj in ["replay", "neighbour"] {
                let mut ins = tx.prepare_cached(
                    "INSERT INTO records (trajectory, step, kind, payload) VALUES (?, ?, ?, ?)",
                )?;
                ins.execute(params![traj, step as i64, "intent", intent])?;
                ins.execute(params![traj, step as i64, "result", result])?;
            }
        }
        tx.commit()?;
    }

    let (mut read_all, mut lookups, mut lookup_each) = (vec![], vec![], vec![]);
    let (mut sql_read_all, mut sql_lookups) = (vec![], vec![]);
    for _ in 0..reps {
        let t = Instant::now();
        let got = log.read("replay", 0, usize::MAX)?;
        read_all.push(us(t));
        anyhow::ensure!(
            got.len() == 2 * REPLAY_STEPS as usize,
            "read gave {} records",
            got.len()
        );
        let t = Instant::now();
        for step in 0..REPLAY_STEPS {
            let t1 = Instant::now();
            let r = log
                .step("replay", step)?
                .context("a logged step is missing")?;
            lookup_each.push(us(t1));
            anyhow::ensure!(
                r.intent.is_some() && r.result.is_some(),
                "step {step} is incomplete"
            );
        }
        lookups.push(us(t));

        let t = Instant::now();
        let n = db
            .prepare_cached(
                "SELECT lsn, step, kind, payload FROM records WHERE trajectory = ?
                 ORDER BY step, lsn",
            )?
            .query_map(["replay"], |r| r.get::<_, Vec<u8>>(3))?
            .try_fold(0usize, |n, p| p.map(|_| n + 1))?;
        sql_read_all.push(us(t));
        anyhow::ensure!(n == 2 * REPLAY_STEPS as usize, "sqlite gave {n} records");
        let t = Instant::now();
        for step in 0..REPLAY_STEPS {
            let mut q = db.prepare_cached(
                "SELECT kind, payload FROM records WHERE trajectory = ? AND step = ?
                 ORDER BY lsn",
            )?;
            let rows = q
                .query_map(params!["replay", step as i64], |r| r.get::<_, Vec<u8>>(1))?
                .count();
            anyhow::ensure!(rows == 2, "sqlite step {step} has {rows} records");
        }
        sql_lookups.push(us(t));
    }
    drop(log);
    drop(tmp);
    Ok(BTreeMap::from([
        ("dsec_replay_read_100_steps", json!(dist(read_all))),
        ("dsec_replay_step_lookup_100_steps", json!(dist(lookups))),
        ("dsec_replay_step_lookup_one", json!(dist(lookup_each))),
        ("sqlite_replay_read_100_steps", json!(dist(sql_read_all))),
        (
            "sqlite_replay_step_lookup_100_steps",
            json!(dist(sql_lookups)),
        ),
    ]))
}

/// The mount holding `path` (longest matching mount point in `/proc/self/mountinfo`): its mount
/// point, file system type and source.
fn mount_of(path: &Path) -> Option<(PathBuf, String, String)> {
    let path = path.canonicalize().ok()?;
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let unescape = |s: &str| s.replace("\\040", " ").replace("\\011", "\t");
    info.lines()
        .filter_map(|l| {
            let fields: Vec<&str> = l.split(' ').collect();
            let dash = fields.iter().position(|f| *f == "-")?;
            let mount = PathBuf::from(unescape(fields.get(4)?));
            let fstype = (*fields.get(dash + 1)?).to_owned();
            let source = (*fields.get(dash + 2)?).to_owned();
            path.starts_with(&mount).then_some((mount, fstype, source))
        })
        // The last of equally long mount points is the one on top.
        .fold(
            None,
            |best: Option<(PathBuf, String, String)>, m| match &best {
                Some(b) if b.0.as_os_str().len() > m.0.as_os_str().len() => best,
                _ => Some(m),
            },
        )
}

fn in_memory(fstype: &str) -> bool {
    matches!(fstype, "tmpfs" | "ramfs" | "devtmpfs")
}

/// The data dir if it exists on a disk file system, else `/var/tmp`.
fn pick_dir(data_dir: &Path) -> anyhow::Result<(PathBuf, String, String)> {
    for dir in [data_dir, Path::new("/var/tmp")] {
        if let Some((_, fstype, source)) = mount_of(dir) {
            if !in_memory(&fstype) {
                return Ok((dir.to_owned(), fstype, source));
            }
        }
    }
    bail!(
        "neither {} nor /var/tmp is on a disk file system; fsync there would measure nothing",
        data_dir.display()
    )
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

fn appends_per_s(v: &Value) -> Option<f64> {
    v.get("appends_per_s")?.as_f64()
}

/// Runs `dsec bench log`.
pub fn run(args: &BenchArgs, data_dir: &Path) -> anyhow::Result<ExitCode> {
    let (dir, fstype, source) = pick_dir(data_dir)?;
    let it = args.iterations.max(10);
    let mut res: BTreeMap<String, Value> = BTreeMap::new();

    res.insert(
        "disk_write_fdatasync_200B".into(),
        json!(bench_fdatasync(&dir, it * 2)?),
    );
    // Records per configuration: enough for a second or more at the expected rates.
    let workloads = [
        (1, SMALL, it * 25),
        (16, SMALL, it * 250),
        (64, SMALL, it * 750),
        (1, LARGE, it * 10),
        (16, LARGE, it * 25),
        (64, LARGE, it * 50),
    ]
    .map(|(writers, payload, records)| Workload {
        writers,
        payload,
        records,
    });
    for w in workloads {
        res.insert(format!("dsec_append_{}", w.name()), bench_dsec(&dir, w)?);
    }
    for w in workloads.iter().filter(|w| w.writers <= 16) {
        res.insert(
            format!("sqlite_append_{}", w.name()),
            bench_sqlite(&dir, *w)?,
        );
    }
    for (k, v) in bench_replay(&dir, it)? {
        res.insert(k.into(), v);
    }

    let mut ratios = BTreeMap::new();
    for w in workloads.iter().filter(|w| w.writers <= 16) {
        let name = w.name();
        let r = appends_per_s(&res[&format!("dsec_append_{name}")])
            .zip(appends_per_s(&res[&format!("sqlite_append_{name}")]))
            .and_then(|(d, s)| (s > 0.0).then(|| d / s));
        ratios.insert(
            format!("appends_per_s_dsec_over_sqlite_{name}"),
            json!(r.map(round3)),
        );
    }
    // Replay: time, so below 1 means dsec is faster.
    let p50 = |k: &str| res.get(k).and_then(|v| v["p50_us"].as_f64());
    for what in ["read_100_steps", "step_lookup_100_steps"] {
        let r = p50(&format!("dsec_replay_{what}"))
            .zip(p50(&format!("sqlite_replay_{what}")))
            .map(|(d, s)| round3(d / s.max(1.0)));
        ratios.insert(format!("replay_{what}_time_dsec_over_sqlite_p50"), json!(r));
    }

    let w64 = &res["dsec_append_200B_w64"];
    let rate = appends_per_s(w64).unwrap_or(0.0);
    let p99 = w64["latency"]["p99_us"].as_u64().unwrap_or(u64::MAX);
    let replay_p99 = res["dsec_replay_read_100_steps"]["p99_us"]
        .as_u64()
        .unwrap_or(u64::MAX);
    let lookup_p99 = res["dsec_replay_step_lookup_100_steps"]["p99_us"]
        .as_u64()
        .unwrap_or(u64::MAX);
    let targets = json!({
        "small_appends_per_s_at_64_writers": {
            "target": format!(">= {TARGET_APPENDS_PER_S}"), "value": rate,
            "met": rate >= TARGET_APPENDS_PER_S,
        },
        "small_append_p99_us_at_64_writers": {
            "target": format!("<= {TARGET_P99_US}"), "value": p99, "met": p99 <= TARGET_P99_US,
        },
        "replay_read_100_steps_p99_us": {
            "target": format!("<= {TARGET_P99_US}"), "value": replay_p99,
            "met": replay_p99 <= TARGET_P99_US,
        },
        "replay_step_lookup_100_steps_p99_us": {
            "target": format!("<= {TARGET_P99_US}"), "value": lookup_p99,
            "met": lookup_p99 <= TARGET_P99_US,
        },
    });
    let out = json!({
        "benchmark": "log",

        "dir": dir,
        "filesystem": fstype,
        "device": source,
        "sqlite_version": rusqlite::version(),
        "iterations": it,
        "run_limit_s_per_configuration": RUN_LIMIT.as_secs(),
        "results": res,
        "ratios": ratios,
        "targets": targets,
        "notes": {
            "appends": "append_blocking from one thread per writer, each writer its own \
                trajectory, an intent then a result per step; durable when it returns",
            "sqlite": "WAL, synchronous=FULL, BEGIN IMMEDIATE + INSERT + COMMIT per record, \
                a connection per writer, busy_timeout 30 s, index on (trajectory, step)",
            "replay": "100 steps (200 B intent, 2 KiB result) interleaved with another \
                trajectory's; page cache warm; read = one call for all 200 records; \
                step_lookup = 100 step() calls",
        },
    });
    emit(args, out)
}
