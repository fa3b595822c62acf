//! Durability tests of the trajectory log's storage engine: L-01 (random crash points), F-11
//! (corrupt tail vs corruption in the middle), F-12 (fsync, write and short-write faults by
//! injection), group commit and backpressure, plus reads, replay lookups, live subscription and
//! retention, and compaction (C-01: crash points during compaction; concurrent appends and reads;
//! failures between its write, rename and directory sync).
//!
//! L-01 re-executes this test binary as a child running [`l01_child_appender`] (selected by the
//! `DSEC_TRAJLOG_L01_DIR` environment variable; without it that test does nothing) and kills it
//! with SIGKILL at random moments; C-01 does the same with [`c01_child_compactor`].

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{self, BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use dsec_node::trajlog::{
    CompactionReport, Config, Entry, FsStorage, LogError, Lsn, Record, RecordKind, RecoveryReport,
    SegmentFile, Storage, TrajLog,
};

#[path = "common/trajlog.rs"]
mod shared;
use shared::{open_configured, read_all};

// ---------------------------------------------------------------------------------------------
// helpers

/// The payload every test derives from `(trajectory, step)`, so any record can be checked alone.
fn payload(trajectory: &str, step: u64) -> Vec<u8> {
    let pad = (step * 7 + trajectory.len() as u64) % 180;
    format!(
        "{{\"trajectory\":\"{trajectory}\",\"step\":{step},\"pad\":\"{}\"}}",
        "x".repeat(pad as usize)
    )
    .into_bytes()
}

fn record(trajectory: &str, step: u64, kind: RecordKind) -> Record {
    Record::new(trajectory, step, kind, payload(trajectory, step))
}

/// Reopens the log of `cfg`, which must not be corrupt.
fn reopen_clean(cfg: Config) -> (TrajLog, RecoveryReport) {
    let (log, report) = TrajLog::open(cfg).expect("reopen");
    assert!(!report.is_corrupt(), "{report:?}");
    (log, report)
}

/// Asserts the next append (an intent of `trajectory` at `step`) gets `lsn`.
fn assert_next_append(log: &TrajLog, trajectory: &str, step: u64, lsn: Lsn) {
    assert_eq!(
        log.append_blocking(record(trajectory, step, RecordKind::Intent))
            .expect("append"),
        lsn
    );
}

/// Asserts the log is lsns `first..first+n` with no gap and every payload as generated.
fn assert_contiguous_and_well_formed(entries: &[Entry], first: u64) {
    for (i, e) in entries.iter().enumerate() {
        assert_eq!(e.lsn, Lsn(first + i as u64), "lsn gap at index {i}");
        assert_eq!(
            e.payload,
            payload(&e.trajectory, e.step),
            "payload of {}",
            e.lsn
        );
    }
}

/// A small deterministic generator (xorshift64*), seeded from the clock and printed on failure.
struct Rng(u64);

impl Rng {
    fn seeded() -> Rng {
        let seed = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
            | 1;
        eprintln!("rng seed {seed}");
        Rng(seed)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

// ---------------------------------------------------------------------------------------------
// fault injection (F-12)

/// Faults to inject into the writer's file operations. Counters are of calls made so far.
#[derive(Default)]
struct Plan {
    writes: AtomicU64,
    syncs: AtomicU64,
    /// The n-th `write` call (1-based) fails.
    fail_write_at: Option<u64>,
    /// The n-th `write` call writes all but the last byte of its buffer and the next call
    /// fails.
    partial_write_at: Option<u64>,
    /// The n-th `fdatasync` call (1-based) fails.
    fail_sync_at: Option<u64>,
    /// Each `write` writes at most this many bytes (0: no limit).
    max_write: usize,
    /// Each `fdatasync` first sleeps this long.
    sync_delay: Duration,
}

struct Faulty(Arc<Plan>);

struct FaultyFile {
    inner: Box<dyn SegmentFile>,
    plan: Arc<Plan>,
    fail_next_write: bool,
}

impl Storage for Faulty {
    fn create(&self, path: &Path) -> io::Result<Box<dyn SegmentFile>> {
        Ok(Box::new(FaultyFile {
            inner: FsStorage.create(path)?,
            plan: self.0.clone(),
            fail_next_write: false,
        }))
    }

    fn open_append(&self, path: &Path) -> io::Result<Box<dyn SegmentFile>> {
        Ok(Box::new(FaultyFile {
            inner: FsStorage.open_append(path)?,
            plan: self.0.clone(),
            fail_next_write: false,
        }))
    }
}

impl SegmentFile for FaultyFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.plan.writes.fetch_add(1, Ordering::SeqCst) + 1;
        if self.fail_next_write || self.plan.fail_write_at == Some(n) {
            return Err(io::Error::other("injected write error"));
        }
        if self.plan.partial_write_at == Some(n) {
            self.fail_next_write = true;
            return self.inner.write(&buf[..buf.len() - 1]);
        }
        let len = match self.plan.max_write {
            0 => buf.len(),
            m => buf.len().min(m),
        };
        self.inner.write(&buf[..len])
    }

    fn sync_data(&mut self) -> io::Result<()> {
        std::thread::sleep(self.plan.sync_delay);
        let n = self.plan.syncs.fetch_add(1, Ordering::SeqCst) + 1;
        if self.plan.fail_sync_at == Some(n) {
            return Err(io::Error::other("injected fdatasync error (EIO)"));
        }
        self.inner.sync_data()
    }
}

fn open_faulty(dir: &Path, plan: Plan) -> (TrajLog, Arc<Plan>) {
    let plan = Arc::new(plan);
    let (log, report) =
        TrajLog::open_with_storage(Config::new(dir), Arc::new(Faulty(plan.clone()))).expect("open");
    assert!(!report.is_corrupt());
    (log, plan)
}

/// One append's outcome: (trajectory, step, result).
type Outcome = (String, u64, Result<Lsn, LogError>);

/// An F-12 case: opens a log in a fresh directory over storage faulty by `plan` and runs
/// [`hammer`] on it; the log must then be poisoned by the operation `poisoned` names (`None`:
/// not poisoned), and `live` checks the open log, the plan's counters, the outcomes and the
/// acknowledged appends; then the log is closed, `closed` checks its directory and the plan,
/// and every acknowledged append must survive a reopen.
fn f12_case(
    plan: Plan,
    threads: usize,
    per_thread: u64,
    poisoned: Option<&str>,
    live: impl FnOnce(&TrajLog, &Plan, &[Outcome], &[Ack]),
    closed: impl FnOnce(&Path, &Plan),
) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (log, plan) = open_faulty(tmp.path(), plan);
    let outcomes = hammer(&log, threads, per_thread);
    let acked = acked(&outcomes);
    assert_eq!(log.stats().poisoned, poisoned);
    live(&log, &plan, &outcomes, &acked);
    drop(log);
    closed(tmp.path(), &plan);
    assert_acked_recovered(tmp.path(), &acked);
}

/// The acknowledged appends among `outcomes`.
fn acked(outcomes: &[Outcome]) -> Vec<Ack> {
    outcomes
        .iter()
        .filter_map(|(t, s, r)| r.as_ref().ok().map(|l| (t.clone(), *s, *l)))
        .collect()
}

/// Runs `threads` appenders of `per_thread` records each; returns every outcome in completion
/// order as (trajectory, step, result).
fn hammer(log: &TrajLog, threads: usize, per_thread: u64) -> Vec<Outcome> {
    let out = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for t in 0..threads {
            let out = &out;
            s.spawn(move || {
                let traj = format!("h{t}");
                for step in 0..per_thread {
                    let r = log.append_blocking(record(&traj, step, RecordKind::Intent));
                    out.lock().expect("lock").push((traj.clone(), step, r));
                }
            });
        }
    });
    out.into_inner().expect("lock")
}

/// A multi-thread tokio runtime of `workers` threads.
fn runtime(workers: usize) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .expect("runtime")
}

/// Runs `tasks` async appenders of `steps` records each (trajectories `<prefix><task>`) and
/// waits for them all.
async fn append_async(log: &Arc<TrajLog>, prefix: &str, tasks: u64, steps: u64) {
    let mut handles = Vec::new();
    for t in 0..tasks {
        let log = log.clone();
        let traj = format!("{prefix}{t}");
        handles.push(tokio::spawn(async move {
            for step in 0..steps {
                log.append(record(&traj, step, RecordKind::Intent))
                    .await
                    .expect("append");
            }
        }));
    }
    for h in handles {
        h.await.expect("task");
    }
}

/// Asserts every acknowledged record is in the log at `dir` after reopening with the real file
/// system, and that the log is a contiguous, well-formed prefix.
fn assert_acked_recovered(dir: &Path, acked: &[(String, u64, Lsn)]) {
    let (log, _) = reopen_clean(Config::new(dir));
    let all = read_all(&log);
    assert_contiguous_and_well_formed(&all, 1);
    let by_lsn: HashMap<Lsn, &Entry> = all.iter().map(|e| (e.lsn, e)).collect();
    for (traj, step, lsn) in acked {
        let e = by_lsn
            .get(lsn)
            .unwrap_or_else(|| panic!("acked {lsn} lost"));
        assert_eq!((&e.trajectory, e.step), (traj, *step));
    }
}

// ---------------------------------------------------------------------------------------------
// L-01

const L01_DIR: &str = "DSEC_TRAJLOG_L01_DIR";
const L01_ROUND: &str = "DSEC_TRAJLOG_L01_ROUND";
const L01_THREADS: u64 = 8;

/// Opens the log of a crash test's child (its directory in `dir_var`, `segment_bytes` per
/// segment) and returns it with the round in `round_var`; `None` unless run as that child.
fn open_child_log(dir_var: &str, round_var: &str, segment_bytes: u64) -> Option<(TrajLog, String)> {
    let dir = std::env::var(dir_var).ok()?;
    let round = std::env::var(round_var).unwrap_or_default();
    let mut cfg = Config::new(&dir);
    cfg.segment_bytes = segment_bytes;
    let (log, report) = TrajLog::open(cfg).expect("child open");
    assert!(!report.is_corrupt(), "{report:?}");
    Some((log, round))
}

/// A child's append: prints `ACK <lsn> <trajectory> <step> END` once it is acknowledged.
fn append_and_ack(log: &TrajLog, traj: &str, step: u64, kind: RecordKind) {
    let lsn = log
        .append_blocking(record(traj, step, kind))
        .expect("child append");
    let line = format!("ACK {lsn} {traj} {step} END\n");
    let mut out = io::stdout().lock();
    out.write_all(line.as_bytes()).expect("stdout");
    out.flush().expect("flush");
}

/// Runs `threads` appenders on `s`, trajectory `<prefix><n>` for the n-th, each appending
/// records of `kind(step)` and acknowledging them with [`append_and_ack`] until killed.
fn spawn_ackers<'s>(
    s: &'s std::thread::Scope<'s, '_>,
    log: &'s TrajLog,
    prefix: &str,
    threads: u64,
    kind: fn(u64) -> RecordKind,
) {
    for t in 0..threads {
        let traj = format!("{prefix}{t}");
        s.spawn(move || {
            for step in 0.. {
                append_and_ack(log, &traj, step, kind(step));
            }
        });
    }
}

/// The L-01 child: appends from several threads until killed, printing each acknowledged record
/// as `ACK <lsn> <trajectory> <step> END`. Does nothing unless [`L01_DIR`] is set.
#[test]
#[ignore = "the child process of l01_crash_points_keep_a_prefix_with_every_acked_record"]
fn l01_child_appender() {
    let Some((log, round)) = open_child_log(L01_DIR, L01_ROUND, 512 << 10) else {
        return;
    };
    let kind = |step: u64| {
        if step.is_multiple_of(2) {
            RecordKind::Intent
        } else {
            RecordKind::Result
        }
    };
    std::thread::scope(|s| spawn_ackers(s, &log, &format!("r{round}-t"), L01_THREADS, kind));
}

/// One acknowledged append a child reported: (trajectory, step, lsn).
type Ack = (String, u64, Lsn);

/// Runs test `name` of this binary as a child (its log in `dir`, passed in `dir_var`, round
/// `round` in `round_var`) and collects the `ACK <lsn> <trajectory> <step> END` lines it
/// prints, until it dies.
fn spawn_acking_child(
    exe: &Path,
    name: &str,
    dir: &Path,
    dir_var: &str,
    round_var: &str,
    round: u64,
) -> (Child, std::thread::JoinHandle<Vec<Ack>>) {
    let mut child = Command::new(exe)
        .args([
            "--exact",
            name,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(dir_var, dir)
        .env(round_var, round.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn child");
    let stdout = child.stdout.take().expect("piped stdout");
    let reader = std::thread::spawn(move || {
        let mut acks = Vec::new();
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            let f: Vec<&str> = line.split(' ').collect();
            if let ["ACK", lsn, traj, step, "END"] = f[..] {
                let lsn = Lsn(lsn.parse().expect("lsn"));
                acks.push((traj.to_owned(), step.parse::<u64>().expect("step"), lsn));
            }
        }
        acks
    });
    (child, reader)
}

/// L-01: SIGKILL the appending child at random moments; after each kill the recovered log is a
/// contiguous lsn prefix holding every acknowledged record byte-for-byte, and each trajectory's
/// steps are contiguous from 0 (an appender only moves on after an ack).
#[test]
fn l01_crash_points_keep_a_prefix_with_every_acked_record() {
    const TARGET: u64 = 100_000;
    let started = Instant::now();
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("log");
    let exe = std::env::current_exe().expect("current_exe");
    let mut rng = Rng::seeded();
    let mut acked_total = 0u64;
    let mut rounds = 0u64;
    let mut in_log = 0u64;
    while (in_log < TARGET || rounds < 5) && rounds < 200 {
        rounds += 1;
        let (mut child, reader) =
            spawn_acking_child(&exe, "l01_child_appender", &dir, L01_DIR, L01_ROUND, rounds);
        // Kill somewhere between start-up (recovery included) and well into the appends.
        std::thread::sleep(Duration::from_millis(30 + rng.below(400)));
        child.kill().expect("SIGKILL child");
        let status = child.wait().expect("wait child");
        assert!(!status.success(), "child exited by itself: {status}");
        let acks = reader.join().expect("reader");
        acked_total += acks.len() as u64;

        let (log, report) = TrajLog::open(Config::new(&dir)).expect("reopen");
        assert!(!report.is_corrupt(), "round {rounds}: {report:?}");
        let all = read_all(&log);
        assert_contiguous_and_well_formed(&all, 1);
        let by_lsn: HashMap<Lsn, &Entry> = all.iter().map(|e| (e.lsn, e)).collect();
        for (traj, step, lsn) in &acks {
            let e = by_lsn
                .get(lsn)
                .unwrap_or_else(|| panic!("round {rounds}: acked {lsn} {traj} {step} lost"));
            assert_eq!((&e.trajectory, e.step), (traj, *step), "round {rounds}");
        }
        let mut steps: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
        for e in &all {
            steps.entry(&e.trajectory).or_default().push(e.step);
        }
        for (traj, s) in steps {
            assert!(
                s.iter().enumerate().all(|(i, &x)| x == i as u64),
                "trajectory {traj} has a step gap"
            );
        }
        in_log = all.len() as u64;
        drop(log);
    }
    eprintln!(
        "L-01: {rounds} kills, {acked_total} acked, {in_log} records in the log, {:?}",
        started.elapsed()
    );
    assert!(in_log >= TARGET, "only {in_log} appends in {rounds} rounds");
}

// ---------------------------------------------------------------------------------------------
// F-11

fn fill(dir: &Path, n: u64) -> Vec<Lsn> {
    let (log, _) = TrajLog::open(Config::new(dir)).expect("open");
    (0..n)
        .map(|i| {
            log.append_blocking(record(&format!("f{}", i % 4), i / 4, RecordKind::Result))
                .expect("append")
        })
        .collect()
}

fn only_segment(dir: &Path) -> std::path::PathBuf {
    let mut segs: Vec<_> = std::fs::read_dir(dir)
        .expect("read_dir")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "log"))
        .collect();
    assert_eq!(segs.len(), 1);
    segs.remove(0)
}

/// F-11: a torn or garbage tail is cut at the last valid record; everything before it, i.e.
/// every acknowledged record, is kept, and the log continues from there.
#[test]
fn f11_corrupt_tail_keeps_longest_valid_prefix() {
    for damage in ["torn", "garbage", "zeros", "flip-last"] {
        let tmp = tempfile::tempdir().expect("tempdir");
        let acked = fill(tmp.path(), 50);
        let seg = only_segment(tmp.path());
        let mut bytes = std::fs::read(&seg).expect("read");
        let full = bytes.len();
        let expected = match damage {
            "torn" => {
                bytes.truncate(full - 5);
                49
            }
            "garbage" => {
                bytes.extend_from_slice(b"DSLG\xff\xff\x00\x01 not a record at all");
                50
            }
            "zeros" => {
                bytes.extend_from_slice(&[0; 4096]);
                50
            }
            _ => {
                bytes[full - 1] ^= 1;
                49
            }
        };
        std::fs::write(&seg, &bytes).expect("write");
        let (log, report) = TrajLog::open(Config::new(tmp.path())).expect("reopen");
        assert!(!report.is_corrupt(), "{damage}: {report:?}");
        assert!(report.truncated_bytes > 0, "{damage}");
        assert_eq!(report.records, expected, "{damage}");
        let all = read_all(&log);
        assert_contiguous_and_well_formed(&all, 1);
        assert_eq!(all.len() as u64, expected);
        assert!(acked[..expected as usize].iter().all(|l| l.0 <= expected));
        let next = log
            .append_blocking(record("after", 0, RecordKind::Intent))
            .expect("append after repair");
        assert_eq!(next, Lsn(expected + 1), "{damage}");
    }
}

/// F-11: a bad record followed by valid ones is corruption, not a torn tail: it is reported,
/// the records after it are not silently skipped over (nor served), the damaged file is kept
/// aside, and only the prefix before it is live.
#[test]
fn f11_corruption_in_the_middle_is_reported_not_skipped() {
    let tmp = tempfile::tempdir().expect("tempdir");
    fill(tmp.path(), 50);
    let seg = only_segment(tmp.path());
    let (log, _) = TrajLog::open(Config::new(tmp.path())).expect("open");
    let victim = read_all(&log)
        .into_iter()
        .find(|e| e.lsn == Lsn(20))
        .expect("lsn 20");
    drop(log);
    let mut bytes = std::fs::read(&seg).expect("read");
    let at = bytes
        .windows(victim.payload.len())
        .position(|w| w == victim.payload.as_slice())
        .expect("payload on disk");
    bytes[at + 3] ^= 0x20;
    std::fs::write(&seg, &bytes).expect("write");

    let (log, report) = TrajLog::open(Config::new(tmp.path())).expect("reopen");
    let c = report
        .corruption
        .clone()
        .expect("corruption must be reported");
    assert_eq!(c.expected_lsn, Lsn(20));
    assert_eq!(c.defect, "crc");
    assert_eq!(c.segment, seg);
    assert_eq!(report.records, 19);
    assert_eq!(report.quarantined.len(), 1);
    assert!(report.quarantined_bytes > 0);
    assert_eq!(
        std::fs::read(&report.quarantined[0]).expect("quarantined copy"),
        bytes,
        "the damaged file is kept as it was"
    );
    let all = read_all(&log);
    assert_contiguous_and_well_formed(&all, 1);
    assert_eq!(all.len(), 19);
    drop(log);
    // Reopening again finds a clean log: the report was the one-time signal, the file is aside.
    let (_, again) = TrajLog::open(Config::new(tmp.path())).expect("reopen twice");
    assert!(!again.is_corrupt());
}

// ---------------------------------------------------------------------------------------------
// F-12

/// F-12: the 5th fdatasync fails. Every appender of that batch and every later one gets
/// `Poisoned`; nothing is acknowledged after the failure; the fsync is not retried; every
/// record acknowledged before it survives a reopen.
#[test]
fn f12_fsync_failure_is_fatal_and_nothing_is_acknowledged() {
    let plan = Plan {
        fail_sync_at: Some(5),
        sync_delay: Duration::from_millis(2),
        ..Plan::default()
    };
    let live = |log: &TrajLog, _: &Plan, outcomes: &[Outcome], acked: &[Ack]| {
        let failed = outcomes.iter().filter(|(_, _, r)| r.is_err()).count();
        assert!(failed > 0);
        for (_, _, r) in outcomes {
            if let Err(e) = r {
                assert!(
                    matches!(e, LogError::Poisoned { op: "fdatasync" }),
                    "unexpected error {e}"
                );
            }
        }
        let stats = log.stats();
        assert_eq!(stats.fsyncs, 4, "four good fsyncs");
        assert_eq!(stats.appends, acked.len() as u64);
        // Nothing after the failure: all acks are from the first four batches, lsn-contiguous.
        let mut lsns: Vec<u64> = acked.iter().map(|a| a.2 .0).collect();
        lsns.sort_unstable();
        assert_eq!(lsns, (1..=acked.len() as u64).collect::<Vec<_>>());
        // Each appender stops at its first error, so no thread saw an ack after a failure.
        let mut first_err: HashMap<&str, u64> = HashMap::new();
        for (t, s, r) in outcomes {
            if r.is_err() {
                let e = first_err.entry(t).or_insert(*s);
                *e = (*e).min(*s);
            }
        }
        for (t, s, _) in acked {
            if let Some(&e) = first_err.get(t.as_str()) {
                assert!(*s < e, "{t} step {s} acked after its step {e} failed");
            }
        }
        assert!(matches!(
            log.append_blocking(record("late", 0, RecordKind::Intent)),
            Err(LogError::Poisoned { .. })
        ));
    };
    f12_case(plan, 16, 40, Some("fdatasync"), live, |_, plan| {
        assert_eq!(
            plan.syncs.load(Ordering::SeqCst),
            5,
            "fdatasync is never retried"
        );
    });
}

/// F-12: a failed write poisons the log like a failed fsync.
#[test]
fn f12_write_error_poisons_the_log() {
    let plan = Plan {
        fail_write_at: Some(3),
        ..Plan::default()
    };
    let live = |_: &TrajLog, plan: &Plan, outcomes: &[Outcome], _: &[Ack]| {
        assert!(outcomes
            .iter()
            .any(|(_, _, r)| matches!(r, Err(LogError::Poisoned { op: "write" }))));
        assert_eq!(
            plan.syncs.load(Ordering::SeqCst),
            2,
            "no sync after the failed write"
        );
    };
    f12_case(plan, 4, 20, Some("write"), live, |_, _| {});
}

/// F-12: a write that stops one byte short and then fails leaves a torn record; the log is
/// poisoned and recovery cuts the torn bytes, keeping every acknowledged record (the complete
/// but unacknowledged records of that batch may be recovered: their outcome was unknown).
#[test]
fn f12_partial_write_then_error_is_a_torn_tail() {
    let plan = Plan {
        partial_write_at: Some(4),
        ..Plan::default()
    };
    f12_case(
        plan,
        4,
        20,
        Some("write"),
        |_, _, _, _| {},
        |dir, _| {
            let (_, report) = TrajLog::open(Config::new(dir)).expect("reopen");
            assert!(report.truncated_bytes > 0, "{report:?}");
        },
    );
}

/// F-12: short writes (the kernel accepting 7 bytes at a time) are completed, not mistaken for
/// failures, and the records come back intact.
#[test]
fn f12_short_writes_are_completed() {
    let plan = Plan {
        max_write: 7,
        ..Plan::default()
    };
    let live = |_: &TrajLog, plan: &Plan, outcomes: &[Outcome], _: &[Ack]| {
        for (_, _, r) in outcomes {
            r.as_ref().expect("no failure");
        }
        assert!(plan.writes.load(Ordering::SeqCst) > 100);
    };
    f12_case(plan, 4, 25, None, live, |_, _| {});
}

// ---------------------------------------------------------------------------------------------
// group commit and backpressure

/// 64 concurrent async appenders share fsyncs: fewer fsyncs than appends.
#[test]
fn group_commit_batches_64_concurrent_appenders() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (log, _) = TrajLog::open(Config::new(tmp.path())).expect("open");
    let log = Arc::new(log);
    runtime(4).block_on(append_async(&log, "g", 64, 50));
    let s = log.stats();
    eprintln!("group commit: {s:?}");
    assert_eq!(s.appends, 64 * 50);
    assert_eq!(s.batches, s.fsyncs);
    assert!(
        s.fsyncs < s.appends,
        "{} fsyncs for {} appends",
        s.fsyncs,
        s.appends
    );
    assert_eq!(read_all(&log).len(), 64 * 50);
}

/// A tiny queue in front of slow storage: appenders wait instead of queueing, so the queue never
/// holds more than its bound (records and bytes), for blocking and async appenders alike.
#[test]
fn backpressure_bounds_the_queue_under_slow_storage() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let plan = Arc::new(Plan {
        sync_delay: Duration::from_millis(3),
        ..Plan::default()
    });
    let mut cfg = Config::new(tmp.path());
    cfg.queue_records = 4;
    cfg.queue_bytes = 1024;
    cfg.max_batch_records = 2;
    let (log, _) = TrajLog::open_with_storage(cfg, Arc::new(Faulty(plan.clone()))).expect("open");
    let log = Arc::new(log);
    let done = Arc::new(AtomicBool::new(false));
    let max_depth = Arc::new(AtomicUsize::new(0));
    let max_bytes = Arc::new(AtomicUsize::new(0));
    let sampler = {
        let (log, done, max_depth, max_bytes) = (
            log.clone(),
            done.clone(),
            max_depth.clone(),
            max_bytes.clone(),
        );
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                let s = log.stats();
                max_depth.fetch_max(s.queue_depth, Ordering::Relaxed);
                max_bytes.fetch_max(s.queue_bytes, Ordering::Relaxed);
                std::thread::sleep(Duration::from_micros(200));
            }
        })
    };
    let rt = runtime(2);
    std::thread::scope(|s| {
        for t in 0..16 {
            let log = &log;
            s.spawn(move || {
                for step in 0..10 {
                    log.append_blocking(record(&format!("b{t}"), step, RecordKind::Intent))
                        .expect("append");
                }
            });
        }
        rt.block_on(append_async(&log, "a", 16, 10));
    });
    done.store(true, Ordering::Relaxed);
    sampler.join().expect("sampler");
    let s = log.stats();
    eprintln!(
        "backpressure: {s:?}, sampled max depth {} bytes {}",
        max_depth.load(Ordering::Relaxed),
        max_bytes.load(Ordering::Relaxed)
    );
    assert_eq!(s.appends, 320);
    assert!(
        s.queue_high_water <= 4,
        "queue grew to {}",
        s.queue_high_water
    );
    assert!(s.queue_high_water >= 2, "the queue was never contended");
    assert!(max_depth.load(Ordering::Relaxed) <= 4);
    assert!(max_bytes.load(Ordering::Relaxed) <= 1024);
}

// ---------------------------------------------------------------------------------------------
// reads, replay lookups, subscription, retention

#[test]
fn reads_page_by_step_and_step_lookup_serves_replay() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (log, _) = TrajLog::open(Config::new(tmp.path())).expect("open");
    for step in 0..10 {
        log.append_blocking(record("r", step, RecordKind::Intent))
            .expect("intent");
        if step != 7 {
            log.append_blocking(record("r", step, RecordKind::Result))
                .expect("result");
        }
    }
    log.append_blocking(Record::new(
        "r",
        3,
        RecordKind::Annotation,
        b"{\"reward\":1}".to_vec(),
    ))
    .expect("annotation");
    let page = log.read("r", 2, 4).expect("read");
    let keys: Vec<_> = page.iter().map(|e| (e.step, e.kind)).collect();
    assert_eq!(
        keys,
        vec![
            (2, RecordKind::Intent),
            (2, RecordKind::Result),
            (3, RecordKind::Intent),
            (3, RecordKind::Result)
        ]
    );
    let s = log.trajectory("r").expect("summary");
    assert_eq!(
        (s.intents, s.results, s.annotations, s.last_step),
        (10, 9, 1, 9)
    );
    assert_eq!((s.first_lsn, s.last_lsn), (Lsn(1), Lsn(20)));
    let done = log.step("r", 4).expect("step").expect("known");
    assert_eq!(done.result.expect("result").payload, payload("r", 4));
    let unknown = log.step("r", 7).expect("step").expect("known");
    assert!(unknown.intent.is_some() && unknown.result.is_none());
    assert!(log.step("r", 10).expect("step").is_none());
    assert!(log.read("nope", 0, 10).expect("read").is_empty());
    drop(log);
    // The index is rebuilt identically by recovery.
    let (log, _) = TrajLog::open(Config::new(tmp.path())).expect("reopen");
    assert_eq!(log.trajectory("r"), Some(s));
    assert_eq!(log.read("r", 2, 4).expect("read"), page);
}

#[test]
fn subscribers_see_new_records_in_lsn_order() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (log, _) = TrajLog::open(Config::new(tmp.path())).expect("open");
    let log = Arc::new(log);
    let mut rx = log.subscribe();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        for step in 0..5 {
            log.append(record("s", step, RecordKind::Intent))
                .await
                .expect("append");
        }
        for step in 0..5 {
            let e = tokio::time::timeout(Duration::from_secs(5), rx.recv())
                .await
                .expect("in time")
                .expect("entry");
            assert_eq!((e.lsn, e.step), (Lsn(step + 1), step));
            assert_eq!(e.payload, payload("s", step));
        }
    });
}

#[test]
fn retention_deletes_old_segments_but_never_the_active_one() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut cfg = Config::new(tmp.path());
    cfg.segment_bytes = 2048;
    cfg.retention_max_bytes = Some(8192);
    let (log, _) = TrajLog::open(cfg.clone()).expect("open");
    for i in 0..300 {
        log.append_blocking(record(&format!("k{}", i % 3), i, RecordKind::Result))
            .expect("append");
    }
    let before = log.stats();
    assert!(before.segments > 8, "{before:?}");
    let r = log.enforce_retention().expect("retention");
    let after = log.stats();
    assert!(!r.deleted.is_empty());
    assert!(after.segment_bytes <= 8192, "{after:?}");
    assert_eq!(after.segments, before.segments - r.deleted.len());
    // What is left is a contiguous suffix ending at the last record, and reads still work.
    let all = read_all(&log);
    let first = all.first().expect("records left").lsn.0;
    assert!(first > r.deleted.last().expect("deleted").0);
    assert_contiguous_and_well_formed(&all, first);
    assert_eq!(all.last().expect("last").lsn, Lsn(300));
    assert_eq!(after.indexed, all.len() as u64);

    // Age: seen from an hour later, every segment is older than a second; all but the active
    // one go.
    let mut aged = cfg;
    aged.retention_max_bytes = None;
    aged.retention_max_age = Some(Duration::from_secs(1));
    drop(log);
    let (log, report) = TrajLog::open(aged).expect("reopen");
    assert!(!report.is_corrupt());
    let r = log
        .enforce_retention_at(SystemTime::now() + Duration::from_secs(3600))
        .expect("retention");
    assert!(!r.deleted.is_empty());
    let s = log.stats();
    assert_eq!(s.segments, 1, "only the active segment stays");
    let all = read_all(&log);
    assert_contiguous_and_well_formed(&all, all.first().map_or(1, |e| e.lsn.0));
    assert_next_append(&log, "k0", 1000, Lsn(301));
    drop(log);
    let (log, report) = TrajLog::open(Config::new(tmp.path())).expect("reopen after retention");
    assert!(!report.is_corrupt(), "{report:?}");
    assert_eq!(log.stats().next_lsn, Lsn(302));
}

#[test]
fn open_temp_in_gives_a_working_log() {
    let parent = tempfile::tempdir().expect("tempdir");
    let (log, dir) = TrajLog::open_temp_in(parent.path(), Config::new("")).expect("open");
    assert_eq!(log.dir(), dir.path());
    assert_next_append(&log, "t", 0, Lsn(1));
    let s = log.stats();
    assert_eq!((s.appends, s.fsyncs, s.next_lsn), (1, 1, Lsn(2)));
    assert!(s.bytes_written > 0);
}

// ---------------------------------------------------------------------------------------------
// compaction

/// The first lsn of the newest segment file in `dir` (the active segment).
fn active_first(dir: &Path) -> Lsn {
    std::fs::read_dir(dir)
        .expect("read_dir")
        .filter_map(|e| {
            let name = e.expect("entry").file_name().into_string().ok()?;
            let digits = name.strip_prefix("seg-")?.strip_suffix(".log")?;
            digits.parse().ok().map(Lsn)
        })
        .max()
        .expect("a segment")
}

/// Whether a segment file starts with a compacted-segment header.
fn compacted_segments(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .expect("read_dir")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "log"))
        .filter(|p| std::fs::read(p).expect("read").starts_with(b"DSLC"))
        .count()
}

/// The records of `before` that compaction of `finished` must keep: all but those of a finished
/// trajectory below the active segment.
fn survivors(before: &[Entry], finished: &dyn Fn(&str) -> bool, active: Lsn) -> Vec<Entry> {
    before
        .iter()
        .filter(|e| !finished(&e.trajectory) || e.lsn >= active)
        .cloned()
        .collect()
}

fn small_segments(dir: &Path) -> Config {
    let mut cfg = Config::new(dir);
    cfg.segment_bytes = 2048;
    cfg
}

/// Compaction drops exactly the finished trajectories' records from sealed segments and keeps
/// every other record (lsn, step, kind, payload) in order, before and after a reopen; the index
/// rebuilt by recovery equals the one compaction left; lsns are not reused.
#[test]
fn compaction_drops_finished_trajectories_and_keeps_the_rest() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (log, _) = TrajLog::open(small_segments(tmp.path())).expect("open");
    for i in 0..400u64 {
        let kind = [
            RecordKind::Intent,
            RecordKind::Result,
            RecordKind::Annotation,
        ][i as usize % 3];
        log.append_blocking(record(&format!("k{}", i % 6), i / 6, kind))
            .expect("append");
    }
    let before = read_all(&log);
    let before_stats = log.stats();
    let finished = |t: &str| t == "k1" || t == "k4";
    let active = active_first(tmp.path());
    let r = log.compact(&finished).expect("compact");
    let expected = survivors(&before, &finished, active);
    assert_eq!(
        r.records_dropped as usize,
        before.len() - expected.len(),
        "{r:?}"
    );
    assert!(r.segments_rewritten > 0 && r.bytes_reclaimed > 0, "{r:?}");
    assert_eq!(r.segments_deleted, 0, "{r:?}");
    let after = read_all(&log);
    assert_eq!(after, expected);
    let stats = log.stats();
    assert_eq!(stats.indexed, expected.len() as u64);
    assert_eq!(
        stats.segment_bytes,
        before_stats.segment_bytes - r.bytes_reclaimed
    );
    let summaries = log.trajectories();
    assert_eq!(
        summaries.len(),
        6,
        "k1/k4 still have records in the active segment"
    );

    // Idempotent: nothing left to drop.
    let again = log.compact(&finished).expect("compact again");
    assert_eq!(again, CompactionReport::default());
    drop(log);

    let (log, report) = reopen_clean(small_segments(tmp.path()));
    assert_eq!(report.truncated_bytes, 0);
    assert_eq!(read_all(&log), expected);
    assert_eq!(
        log.trajectories(),
        summaries,
        "recovery rebuilds the same index"
    );
    assert_eq!(log.stats().next_lsn, Lsn(401));
    assert_next_append(&log, "k0", 999, Lsn(401));
}

/// Trajectories whose records are all in sealed segments disappear from `trajectories()`;
/// segments left empty at the head are deleted, in the middle kept as a bare header; next_lsn
/// never goes down; retention deletes compacted segments like any other.
#[test]
fn compaction_deletes_empty_segments_and_never_lowers_next_lsn() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (log, _) = TrajLog::open(small_segments(tmp.path())).expect("open");
    for (traj, n) in [
        ("gone-a", 60u64),
        ("keep", 30),
        ("gone-b", 100),
        ("tail", 40),
    ] {
        for step in 0..n {
            log.append_blocking(record(traj, step, RecordKind::Result))
                .expect("append");
        }
    }
    let before = read_all(&log);
    let segments = log.stats().segments;
    let finished = |t: &str| t.starts_with("gone-");
    let r = log.compact(&finished).expect("compact");
    assert!(r.segments_deleted > 0, "the gone-a head segments go: {r:?}");
    assert!(r.segments_rewritten > 0, "{r:?}");
    assert_eq!(r.records_dropped, 160);
    assert_eq!(log.stats().segments, segments - r.segments_deleted);
    let ids: Vec<String> = log.trajectories().into_iter().map(|t| t.id).collect();
    assert_eq!(ids, vec!["keep".to_owned(), "tail".to_owned()]);
    assert_eq!(
        read_all(&log),
        survivors(&before, &finished, active_first(tmp.path()))
    );
    assert!(compacted_segments(tmp.path()) > 0);
    drop(log);

    let (log, report) = reopen_clean(small_segments(tmp.path()));
    assert_eq!(report.next_lsn, Lsn(231));
    assert_eq!(read_all(&log).len(), 70);

    // Everything but the active segment finished: only it stays; lsns continue above 230.
    let r = log.compact(&|_| true).expect("compact all");
    assert!(r.segments_deleted > 0, "{r:?}");
    assert_eq!(log.stats().segments, 1);
    drop(log);
    let (log, _) = reopen_clean(small_segments(tmp.path()));
    assert_next_append(&log, "new", 0, Lsn(231));
}

/// Retention over compacted segments (bare headers included) keeps a valid log.
#[test]
fn retention_works_with_compacted_segments() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut cfg = small_segments(tmp.path());
    let (log, _) = TrajLog::open(cfg.clone()).expect("open");
    for i in 0..300u64 {
        log.append_blocking(record(&format!("r{}", i % 3), i, RecordKind::Result))
            .expect("append");
    }
    log.compact(&|t| t == "r1").expect("compact");
    drop(log);
    cfg.retention_max_bytes = Some(6000);
    let (log, _) = reopen_clean(cfg.clone());
    let r = log.enforce_retention().expect("retention");
    assert!(!r.deleted.is_empty());
    assert!(log.stats().segment_bytes <= 6000);
    let all = read_all(&log);
    assert!(all.windows(2).all(|w| w[0].lsn < w[1].lsn));
    assert!(all
        .iter()
        .all(|e| e.payload == payload(&e.trajectory, e.step)));
    drop(log);
    let (log, _) = reopen_clean(Config::new(tmp.path()));
    assert_eq!(log.stats().next_lsn, Lsn(301));
}

/// A compacted segment keeps its original modification time, so age-based retention still
/// sees when its records were written.
#[test]
fn compaction_keeps_segment_modification_times() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (log, _) = TrajLog::open(small_segments(tmp.path())).expect("open");
    for i in 0..100u64 {
        log.append_blocking(record(&format!("m{}", i % 2), i, RecordKind::Result))
            .expect("append");
    }
    let mtimes = || -> BTreeMap<std::path::PathBuf, SystemTime> {
        std::fs::read_dir(tmp.path())
            .expect("read_dir")
            .map(|e| e.expect("entry").path())
            .map(|p| {
                let m = std::fs::metadata(&p)
                    .and_then(|m| m.modified())
                    .expect("mtime");
                (p, m)
            })
            .collect()
    };
    let before = mtimes();
    std::thread::sleep(Duration::from_millis(20));
    let r = log.compact(&|t| t == "m1").expect("compact");
    assert!(r.segments_rewritten > 0);
    assert_eq!(mtimes(), before);
}

/// Appends and reads run while compaction loops: every acknowledged record of a live
/// trajectory is readable with its payload at every moment, reads never fail, and the finished
/// trajectories shrink to what is in the active segment.
#[test]
fn compaction_runs_concurrently_with_appends_and_reads() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let log = open_configured(tmp.path(), |cfg| cfg.segment_bytes = 4096);
    for step in 0..200u64 {
        for t in 0..4 {
            log.append_blocking(record(&format!("done-{t}"), step, RecordKind::Result))
                .expect("append");
        }
    }
    let acked: Vec<AtomicU64> = (0..4).map(|_| AtomicU64::new(0)).collect();
    let stop = AtomicBool::new(false);
    let reports = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for (t, acked) in acked.iter().enumerate() {
            let (log, stop) = (&log, &stop);
            s.spawn(move || {
                let traj = format!("live-{t}");
                let mut step = 0;
                while !stop.load(Ordering::Relaxed) {
                    log.append_blocking(record(&traj, step, RecordKind::Intent))
                        .expect("append");
                    step += 1;
                    acked.store(step, Ordering::Release);
                }
            });
        }
        for r in 0..3 {
            let (log, stop, acked) = (&log, &stop, &acked);
            s.spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    for (t, acked) in acked.iter().enumerate() {
                        let n = acked.load(Ordering::Acquire);
                        let traj = format!("live-{t}");
                        let got = log.read(&traj, 0, usize::MAX).expect("read live");
                        assert!(got.len() as u64 >= n, "reader {r}: {traj} lost records");
                        for (i, e) in got.iter().enumerate() {
                            assert_eq!(e.step, i as u64);
                            assert_eq!(e.payload, payload(&traj, e.step));
                        }
                        let step = log.step(&traj, n.saturating_sub(1)).expect("step");
                        assert!(n == 0 || step.is_some_and(|s| s.intent.is_some()));
                        let done = log.read(&format!("done-{t}"), 0, usize::MAX).expect("read");
                        assert!(done
                            .iter()
                            .all(|e| e.payload == payload(&e.trajectory, e.step)));
                    }
                }
            });
        }
        let (log, stop, reports) = (&log, &stop, &reports);
        s.spawn(move || {
            for _ in 0..40 {
                let r = log.compact(&|t| t.starts_with("done-")).expect("compact");
                reports.lock().expect("lock").push(r);
                std::thread::sleep(Duration::from_millis(5));
            }
            stop.store(true, Ordering::Relaxed);
        });
    });
    let reports = reports.into_inner().expect("lock");
    let dropped: u64 = reports.iter().map(|r| r.records_dropped).sum();
    assert!(dropped > 0, "{reports:?}");
    let all = read_all(&log);
    let active = active_first(tmp.path());
    assert!(all
        .iter()
        .all(|e| !e.trajectory.starts_with("done-") || e.lsn >= active));
    assert_eq!(all.len() as u64 + dropped, log.stats().next_lsn.0 - 1);
    drop(log);
    let (log, _) = reopen_clean(Config::new(tmp.path()));
    assert_eq!(read_all(&log), all);
}

/// Faults injected into compaction's own file operations.
struct CompactionFaults {
    /// `write_durable`, `rename` or `sync_dir`: fails on its `at`-th call (1-based).
    op: &'static str,
    at: u64,
    calls: AtomicU64,
}

impl CompactionFaults {
    fn hit(&self, op: &str) -> io::Result<()> {
        if op == self.op && self.calls.fetch_add(1, Ordering::SeqCst) + 1 == self.at {
            return Err(io::Error::other(format!("injected {op} failure")));
        }
        Ok(())
    }
}

impl Storage for CompactionFaults {
    fn create(&self, path: &Path) -> io::Result<Box<dyn SegmentFile>> {
        FsStorage.create(path)
    }

    fn open_append(&self, path: &Path) -> io::Result<Box<dyn SegmentFile>> {
        FsStorage.open_append(path)
    }

    fn write_durable(&self, path: &Path, data: &[u8], modified: SystemTime) -> io::Result<()> {
        self.hit("write_durable")?;
        FsStorage.write_durable(path, data, modified)
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.hit("rename")?;
        FsStorage.rename(from, to)
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        self.hit("sync_dir")?;
        FsStorage.sync_dir(dir)
    }
}

/// A failure at any step of compaction (the temp file's write/fsync, the rename, the directory
/// fsync) returns an error and leaves a consistent log: reads return every surviving record,
/// no temporary file stays, a later compaction finishes the job, and recovery finds no
/// corruption.
#[test]
fn compaction_failures_at_each_step_leave_a_consistent_log() {
    for op in ["write_durable", "rename", "sync_dir"] {
        for at in [1u64, 3] {
            let tmp = tempfile::tempdir().expect("tempdir");
            let storage = Arc::new(CompactionFaults {
                op,
                at,
                calls: AtomicU64::new(0),
            });
            let (log, _) =
                TrajLog::open_with_storage(small_segments(tmp.path()), storage).expect("open");
            for i in 0..200u64 {
                log.append_blocking(record(&format!("x{}", i % 4), i / 4, RecordKind::Result))
                    .expect("append");
            }
            let before = read_all(&log);
            let finished = |t: &str| t == "x2";
            let expected = survivors(&before, &finished, active_first(tmp.path()));
            let err = log.compact(&finished).expect_err("injected failure");
            assert!(matches!(err, LogError::Io { .. }), "{op}@{at}: {err}");
            let now = read_all(&log);
            assert!(
                expected.iter().all(|e| now.contains(e)),
                "{op}@{at}: a surviving record is gone"
            );
            assert!(now.iter().all(|e| before.contains(e)), "{op}@{at}");
            let leftovers = std::fs::read_dir(tmp.path())
                .expect("read_dir")
                .filter(|e| {
                    e.as_ref()
                        .expect("entry")
                        .file_name()
                        .to_string_lossy()
                        .ends_with(".compacting")
                })
                .count();
            assert_eq!(leftovers, 0, "{op}@{at}");
            log.compact(&finished).expect("retry");
            assert_eq!(read_all(&log), expected, "{op}@{at}");
            drop(log);
            let (log, report) = TrajLog::open(small_segments(tmp.path())).expect("reopen");
            assert!(!report.is_corrupt(), "{op}@{at}: {report:?}");
            assert_eq!(read_all(&log), expected, "{op}@{at}");
        }
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]

    /// For any records, segment size and set of finished trajectories: compaction keeps exactly
    /// the survivors, recovery agrees, and next_lsn is unchanged.
    #[test]
    fn compaction_keeps_exactly_the_survivors(
        trajs in proptest::collection::vec(0u8..5, 1..120),
        finished_mask in 0u8..32,
        segment_bytes in 200u64..1500,
    ) {
        let tmp = tempfile::tempdir().expect("tempdir");
        let mut cfg = Config::new(tmp.path());
        cfg.segment_bytes = segment_bytes;
        let (log, _) = TrajLog::open(cfg.clone()).expect("open");
        let mut steps = [0u64; 5];
        for &t in &trajs {
            let traj = format!("p{t}");
            log.append_blocking(record(&traj, steps[t as usize], RecordKind::Result))
                .expect("append");
            steps[t as usize] += 1;
        }
        let before = read_all(&log);
        let finished = |id: &str| {
            let t: u32 = id[1..].parse().expect("id");
            finished_mask & (1 << t) != 0
        };
        let expected = survivors(&before, &finished, active_first(tmp.path()));
        let r = log.compact(&finished).expect("compact");
        proptest::prop_assert_eq!(r.records_dropped as usize, before.len() - expected.len());
        proptest::prop_assert_eq!(&read_all(&log), &expected);
        let summaries = log.trajectories();
        drop(log);
        let (log, report) = TrajLog::open(cfg).expect("reopen");
        proptest::prop_assert!(!report.is_corrupt(), "{:?}", report);
        proptest::prop_assert_eq!(&read_all(&log), &expected);
        proptest::prop_assert_eq!(log.trajectories(), summaries);
        proptest::prop_assert_eq!(log.stats().next_lsn, Lsn(trajs.len() as u64 + 1));
    }
}

// ---------------------------------------------------------------------------------------------
// C-01

const C01_DIR: &str = "DSEC_TRAJLOG_C01_DIR";
const C01_ROUND: &str = "DSEC_TRAJLOG_C01_ROUND";

/// C-01: trajectories `c<round>-t<odd>` are the finished ones.
fn c01_finished(trajectory: &str) -> bool {
    trajectory
        .rsplit_once("-t")
        .and_then(|(_, t)| t.parse::<u64>().ok())
        .is_some_and(|t| t % 2 == 1)
}

/// The C-01 child: appends from four threads and compacts in a loop until killed, printing each
/// acknowledged record as `ACK <lsn> <trajectory> <step> END`. Does nothing unless [`C01_DIR`]
/// is set.
#[test]
#[ignore = "the child process of the C-01 compaction crash test"]
fn c01_child_compactor() {
    let Some((log, round)) = open_child_log(C01_DIR, C01_ROUND, 8 << 10) else {
        return;
    };
    std::thread::scope(|s| {
        let log = &log;
        spawn_ackers(s, log, &format!("c{round}-t"), 4, |_| RecordKind::Intent);
        s.spawn(move || loop {
            log.compact(&c01_finished).expect("child compact");
        });
    });
}

/// C-01: SIGKILL a child that appends and compacts at random moments; after each kill recovery
/// reports no corruption, every acknowledged record of an unfinished trajectory is there
/// byte-for-byte (its steps contiguous from 0), lsns only increase, and no lsn is reused.
#[test]
fn c01_crash_during_compaction_loses_no_surviving_record() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("log");
    let exe = std::env::current_exe().expect("current_exe");
    let mut rng = Rng::seeded();
    let mut max_acked = Lsn(0);
    let mut compacted_seen = 0;
    let mut all_acks: Vec<Ack> = Vec::new();
    for round in 1..=12u64 {
        let (mut child, reader) =
            spawn_acking_child(&exe, "c01_child_compactor", &dir, C01_DIR, C01_ROUND, round);
        std::thread::sleep(Duration::from_millis(50 + rng.below(400)));
        assert!(
            child.try_wait().expect("try_wait").is_none(),
            "round {round}: the child died before the kill"
        );
        child.kill().expect("SIGKILL child");
        let status = child.wait().expect("wait child");
        assert!(!status.success(), "child exited by itself: {status}");
        let acks = reader.join().expect("reader");
        max_acked = acks
            .iter()
            .map(|a| a.2)
            .max()
            .unwrap_or(Lsn(0))
            .max(max_acked);
        all_acks.extend(acks);
        compacted_seen += compacted_segments(&dir);

        let (log, report) = TrajLog::open(Config::new(&dir)).expect("reopen");
        assert!(!report.is_corrupt(), "round {round}: {report:?}");
        let all = read_all(&log);
        assert!(all.windows(2).all(|w| w[0].lsn < w[1].lsn));
        assert!(all
            .iter()
            .all(|e| e.payload == payload(&e.trajectory, e.step)));
        let by_lsn: HashMap<Lsn, &Entry> = all.iter().map(|e| (e.lsn, e)).collect();
        for (traj, step, lsn) in all_acks.iter().filter(|a| !c01_finished(&a.0)) {
            let e = by_lsn
                .get(lsn)
                .unwrap_or_else(|| panic!("round {round}: acked {lsn} {traj} {step} lost"));
            assert_eq!((&e.trajectory, e.step), (traj, *step), "round {round}");
        }
        let mut steps: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
        for e in all.iter().filter(|e| !c01_finished(&e.trajectory)) {
            steps.entry(&e.trajectory).or_default().push(e.step);
        }
        for (traj, s) in steps {
            assert!(
                s.iter().enumerate().all(|(i, &x)| x == i as u64),
                "round {round}: trajectory {traj} has a step gap"
            );
        }
        let live: HashSet<&str> = all.iter().map(|e| e.trajectory.as_str()).collect();
        assert!(live.iter().all(|t| log.trajectory(t).is_some()));
        assert!(
            log.stats().next_lsn > max_acked,
            "round {round}: next lsn {} not above acked {max_acked}",
            log.stats().next_lsn
        );
    }
    eprintln!(
        "C-01: {} acks, highest {max_acked}, {compacted_seen} compacted segments seen",
        all_acks.len()
    );
    assert!(compacted_seen > 0, "no compaction happened before a kill");
}
