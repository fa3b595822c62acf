//! The trajectory log's storage engine: a durable, sequenced, append-only record log with group
//! commit, crash recovery, an in-memory index by trajectory, live subscription and retention.
//!
//! It knows nothing about HTTP or sandboxes: a record is `(trajectory, step, kind, payload)` with
//! opaque payload bytes (JSON, by convention of the callers). See `docs/design.md`, "Trajectory
//! log (storage)", for the on-disk format and the guarantees.
//!
//! ```no_run
//! # async fn demo() -> Result<(), dsec_node::trajlog::LogError> {
//! use dsec_node::trajlog::{Config, Record, RecordKind, TrajLog};
//! let (log, report) = TrajLog::open(Config::new("/var/lib/dsec/trajlog"))?;
//! assert!(!report.is_corrupt());
//! let lsn = log
//!     .append(Record::new("run-7", 0, RecordKind::Intent, b"{\"cmd\":\"ls\"}".to_vec()))
//!     .await?; // durable when this returns
//! let steps = log.read("run-7", 0, 100)?;
//! # let _ = (lsn, steps); Ok(()) }
//! ```
//!
//! Threads: one writer thread owns the active segment file; appenders (any thread or task) talk
//! to it through a bounded queue and a oneshot reply. Readers share the index under a read lock
//! and read payloads with positioned reads (`pread`) from the segment files; they block on disk,
//! so async callers should use `spawn_blocking` for large reads.

mod compaction;
pub mod export;
mod format;
mod index;
mod queue;
mod recovery;
pub mod storage;
mod writer;

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

use tokio::sync::{broadcast, oneshot};

pub use compaction::CompactionReport;
pub use recovery::{Corruption, RecoveryReport};
pub use storage::{FsStorage, SegmentFile, Storage};

use index::{Index, Slot};
use queue::{Pending, Push, Queue};

/// The longest trajectory id, in bytes.
pub const MAX_TRAJECTORY_LEN: usize = 128;
/// The largest payload the format can hold (16 MiB). [`Config::max_payload`] may be lower.
pub const MAX_PAYLOAD: usize = 16 << 20;

/// A log sequence number: global, starting at 1, assigned contiguously in durable order and never
/// reused (compaction and retention leave gaps, never renumber).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Lsn(pub u64);

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// What a record says about its step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RecordKind {
    /// The step is about to run (durable before it runs).
    Intent,
    /// The step's outcome (durable before the API answers).
    Result,
    /// A label, reward or note attached to the step.
    Annotation,
}

impl RecordKind {
    fn to_byte(self) -> u8 {
        match self {
            RecordKind::Intent => 1,
            RecordKind::Result => 2,
            RecordKind::Annotation => 3,
        }
    }

    fn from_byte(b: u8) -> Option<RecordKind> {
        match b {
            1 => Some(RecordKind::Intent),
            2 => Some(RecordKind::Result),
            3 => Some(RecordKind::Annotation),
            _ => None,
        }
    }

    /// `intent`, `result` or `annotation`.
    pub fn as_str(self) -> &'static str {
        match self {
            RecordKind::Intent => "intent",
            RecordKind::Result => "result",
            RecordKind::Annotation => "annotation",
        }
    }
}

/// A record to append. Validated by [`TrajLog::append`]: the trajectory id is 1..=128 bytes of
/// printable ASCII without spaces (`!`..=`~`), the payload at most [`Config::max_payload`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Trajectory id.
    pub trajectory: String,
    /// Step within the trajectory.
    pub step: u64,
    /// Kind.
    pub kind: RecordKind,
    /// Opaque payload (JSON by convention).
    pub payload: Vec<u8>,
}

impl Record {
    /// A record.
    pub fn new(
        trajectory: impl Into<String>,
        step: u64,
        kind: RecordKind,
        payload: Vec<u8>,
    ) -> Record {
        Record {
            trajectory: trajectory.into(),
            step,
            kind,
            payload,
        }
    }
}

/// Whether `id` is a valid trajectory id.
pub fn valid_trajectory(id: &str) -> bool {
    !id.is_empty() && id.len() <= MAX_TRAJECTORY_LEN && id.bytes().all(|b| b.is_ascii_graphic())
}

/// A durable record read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Its sequence number.
    pub lsn: Lsn,
    /// Trajectory id.
    pub trajectory: String,
    /// Step.
    pub step: u64,
    /// Kind.
    pub kind: RecordKind,
    /// Payload bytes as appended.
    pub payload: Vec<u8>,
}

/// The records a replay decision needs for one step: the first intent and the first result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepRecords {
    /// The step's first intent, if any.
    pub intent: Option<Entry>,
    /// The step's first result, if any.
    pub result: Option<Entry>,
}

/// Per-trajectory counters and bounds (over the records still retained).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrajectorySummary {
    /// Trajectory id.
    pub id: String,
    /// Intent records.
    pub intents: u64,
    /// Result records.
    pub results: u64,
    /// Annotation records.
    pub annotations: u64,
    /// Lowest lsn.
    pub first_lsn: Lsn,
    /// Highest lsn.
    pub last_lsn: Lsn,
    /// Highest step.
    pub last_step: u64,
}

/// Counters for metrics and benchmarks. Monotonic except the queue and segment gauges.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogStats {
    /// Records made durable since open.
    pub appends: u64,
    /// Batches committed (each one write + one fdatasync).
    pub batches: u64,
    /// Successful `fdatasync` calls on segments.
    pub fsyncs: u64,
    /// Bytes written to segments since open.
    pub bytes_written: u64,
    /// Records in the queue now.
    pub queue_depth: usize,
    /// Bytes of records in the queue now.
    pub queue_bytes: usize,
    /// The most records ever queued at once.
    pub queue_high_water: usize,
    /// Segment files.
    pub segments: usize,
    /// Total bytes of segment files.
    pub segment_bytes: u64,
    /// The lsn of the next record.
    pub next_lsn: Lsn,
    /// Records in the index.
    pub indexed: u64,
    /// The failed operation, if the log is poisoned.
    pub poisoned: Option<&'static str>,
}

/// Configuration. [`Config::new`] gives the defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// The log's directory (created if missing).
    pub dir: PathBuf,
    /// A segment is closed and a new one started once it reaches this size (64 MiB). A segment
    /// may exceed it by one batch.
    pub segment_bytes: u64,
    /// Queue bound in records (4,096).
    pub queue_records: usize,
    /// Queue bound in bytes of encoded records (64 MiB).
    pub queue_bytes: usize,
    /// Most records per batch (1,024).
    pub max_batch_records: usize,
    /// Most bytes per batch (8 MiB); a larger single record is a batch of its own.
    pub max_batch_bytes: usize,
    /// Largest payload accepted (16 MiB, which is also the format's limit).
    pub max_payload: usize,
    /// Retention: segments whose last write is older than this are deleted (none by default).
    pub retention_max_age: Option<Duration>,
    /// Retention: the oldest segments are deleted while the total is above this (none).
    pub retention_max_bytes: Option<u64>,
    /// Records buffered per live subscriber before it lags (4,096).
    pub subscriber_capacity: usize,
}

impl Config {
    /// Defaults for a log in `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> Config {
        Config {
            dir: dir.into(),
            segment_bytes: 64 << 20,
            queue_records: 4096,
            queue_bytes: 64 << 20,
            max_batch_records: 1024,
            max_batch_bytes: 8 << 20,
            max_payload: MAX_PAYLOAD,
            retention_max_age: None,
            retention_max_bytes: None,
            subscriber_capacity: 4096,
        }
    }

    fn validate(&self) -> Result<(), LogError> {
        let checks = [
            (self.segment_bytes > 0, "config.segment_bytes"),
            (self.queue_records > 0, "config.queue_records"),
            (self.queue_bytes > 0, "config.queue_bytes"),
            (self.max_batch_records > 0, "config.max_batch_records"),
            (self.max_batch_bytes > 0, "config.max_batch_bytes"),
            (self.max_payload <= MAX_PAYLOAD, "config.max_payload"),
            (self.subscriber_capacity > 0, "config.subscriber_capacity"),
        ];
        match checks.iter().find(|(ok, _)| !ok) {
            Some((_, what)) => Err(LogError::Invalid { what }),
            None => Ok(()),
        }
    }
}

/// Why a log operation failed.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// A file operation outside the writer failed (open, recovery, read, retention).
    #[error("trajectory log: {op} {path}")]
    Io {
        /// The operation.
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A write, rotation or fdatasync failed earlier; the log acknowledges nothing more until it
    /// is reopened. For the appenders of the failed batch the outcome is unknown: their records
    /// may or may not be found after recovery.
    #[error("trajectory log is poisoned by a failed {op}")]
    Poisoned {
        /// `write`, `fdatasync` or `create_segment`.
        op: &'static str,
    },
    /// A payload above [`Config::max_payload`].
    #[error("record payload of {size} bytes exceeds the limit of {max}")]
    TooLarge {
        /// Payload size.
        size: usize,
        /// The limit.
        max: usize,
    },
    /// An invalid trajectory id or configuration value.
    #[error("invalid {what}")]
    Invalid {
        /// What is invalid (`trajectory` or `config.<field>`).
        what: &'static str,
    },
    /// The log was closed.
    #[error("trajectory log is closed")]
    Closed,
    /// A record read back from disk failed its check.
    #[error("corrupt record in {path} at offset {offset}")]
    Corrupt {
        /// The segment.
        path: PathBuf,
        /// The frame's offset.
        offset: u64,
    },
}

/// What [`TrajLog::enforce_retention`] deleted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RetentionReport {
    /// The deleted segments, by first lsn.
    pub deleted: Vec<Lsn>,
    /// Their total size.
    pub bytes: u64,
}

#[derive(Default)]
struct Counters {
    appends: AtomicU64,
    batches: AtomicU64,
    fsyncs: AtomicU64,
    bytes: AtomicU64,
}

/// State shared by the handle and the writer thread.
struct Shared {
    config: Config,
    queue: Queue,
    index: RwLock<Index>,
    /// Segment first lsn → length, for retention and stats.
    segments: Mutex<BTreeMap<u64, u64>>,
    active_segment: AtomicU64,
    next_lsn: AtomicU64,
    poisoned: Mutex<Option<&'static str>>,
    stats: Counters,
    events: broadcast::Sender<Arc<Entry>>,
    /// Open read handles by segment. Swapped together with the index (under its write lock)
    /// when compaction replaces a segment file; see [`Shared::files_for`].
    readers: Mutex<HashMap<u64, Arc<File>>>,
    /// Compaction's file operations (the writer holds its own handle to the same storage).
    storage: Arc<dyn Storage>,
    /// Serializes compaction and retention, the two operations that change sealed segments.
    maintenance: Mutex<()>,
}

fn unpoison<T>(r: Result<T, PoisonError<T>>) -> T {
    // Every structure behind these locks is updated in one step, so a panicking holder cannot
    // leave it half-changed.
    r.unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    fn poisoned(&self) -> Option<&'static str> {
        *unpoison(self.poisoned.lock())
    }

    fn poison(&self, op: &'static str) {
        unpoison(self.poisoned.lock()).get_or_insert(op);
    }

    fn read_index(&self) -> RwLockReadGuard<'_, Index> {
        unpoison(self.index.read())
    }

    fn write_index(&self) -> RwLockWriteGuard<'_, Index> {
        unpoison(self.index.write())
    }

    fn lock_segments(&self) -> MutexGuard<'_, BTreeMap<u64, u64>> {
        unpoison(self.segments.lock())
    }

    fn segment_path(&self, first: Lsn) -> PathBuf {
        self.config.dir.join(format::segment_name(first))
    }

    fn reader(&self, segment: Lsn) -> Result<Arc<File>, LogError> {
        let mut readers = unpoison(self.readers.lock());
        if let Some(f) = readers.get(&segment.0) {
            return Ok(f.clone());
        }
        let path = self.segment_path(segment);
        let f = Arc::new(File::open(&path).map_err(|source| LogError::Io {
            op: "open_segment",
            path,
            source,
        })?);
        readers.insert(segment.0, f.clone());
        Ok(f)
    }

    /// The read handles of the segments `slots` live in. Call it under the same index read lock
    /// the slots were taken under: compaction replaces a segment's file, its reader handle and
    /// its index offsets together under the index write lock, so a handle taken here is the file
    /// those offsets refer to (an old, renamed-over file stays readable while a handle is open).
    fn files_for<'a>(
        &self,
        slots: impl IntoIterator<Item = &'a Slot>,
    ) -> Result<HashMap<u64, Arc<File>>, LogError> {
        let mut files = HashMap::new();
        for slot in slots {
            let seg = slot.loc.segment;
            if let std::collections::hash_map::Entry::Vacant(v) = files.entry(seg.0) {
                v.insert(self.reader(seg)?);
            }
        }
        Ok(files)
    }

    fn load(&self, files: &HashMap<u64, Arc<File>>, slot: Slot) -> Result<Entry, LogError> {
        let file = match files.get(&slot.loc.segment.0) {
            Some(f) => f.clone(),
            None => self.reader(slot.loc.segment)?,
        };
        let mut buf = vec![0u8; slot.loc.len as usize];
        let corrupt = || LogError::Corrupt {
            path: self.segment_path(slot.loc.segment),
            offset: slot.loc.offset,
        };
        file.read_exact_at(&mut buf, slot.loc.offset)
            .map_err(|source| LogError::Io {
                op: "read_record",
                path: self.segment_path(slot.loc.segment),
                source,
            })?;
        let (body, n) = format::decode_frame(&buf).map_err(|_| corrupt())?;
        if n != buf.len() {
            return Err(corrupt());
        }
        Ok(Entry {
            lsn: body.lsn,
            trajectory: body.trajectory.to_owned(),
            step: body.step,
            kind: body.kind,
            payload: body.payload.to_vec(),
        })
    }
}

/// An open trajectory log. Share it with `Arc`; dropping it closes it (queued records are still
/// written and answered first).
pub struct TrajLog {
    shared: Arc<Shared>,
    writer: Mutex<Option<JoinHandle<()>>>,
}

impl fmt::Debug for TrajLog {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TrajLog")
            .field("dir", &self.shared.config.dir)
            .finish_non_exhaustive()
    }
}

impl TrajLog {
    /// Opens (creating if needed) the log in `config.dir`, recovers it and starts the writer.
    /// Check [`RecoveryReport::is_corrupt`]: a corrupt log still opens, with the valid prefix.
    pub fn open(config: Config) -> Result<(TrajLog, RecoveryReport), LogError> {
        TrajLog::open_with_storage(config, Arc::new(FsStorage))
    }

    /// Opens a fresh log in a new temporary directory under `parent` (for benchmarks and tests;
    /// `config.dir` is replaced). The directory is removed when the returned guard drops, so
    /// drop the log first.
    pub fn open_temp_in(
        parent: &Path,
        mut config: Config,
    ) -> Result<(TrajLog, tempfile::TempDir), LogError> {
        let dir = tempfile::Builder::new()
            .prefix("trajlog-")
            .tempdir_in(parent)
            .map_err(|source| LogError::Io {
                op: "create_temp_dir",
                path: parent.to_owned(),
                source,
            })?;
        config.dir = dir.path().to_owned();
        let (log, _) = TrajLog::open(config)?;
        Ok((log, dir))
    }

    /// [`open`](TrajLog::open) with the writer's file operations going through `storage` (fault
    /// injection in tests).
    pub fn open_with_storage(
        config: Config,
        storage: Arc<dyn Storage>,
    ) -> Result<(TrajLog, RecoveryReport), LogError> {
        config.validate()?;
        let dir = config.dir.clone();
        std::fs::create_dir_all(&dir).map_err(|source| LogError::Io {
            op: "create_dir",
            path: dir.clone(),
            source,
        })?;
        let recovered = recovery::recover(&dir)?;
        let report = recovered.report.clone();
        let next_lsn = report.next_lsn;
        let mut segments: BTreeMap<u64, u64> = recovered
            .segments
            .iter()
            .map(|s| (s.first.0, s.len))
            .collect();
        // A compacted segment is never appended to: if it is the last one (its successor was
        // lost, or quarantined by recovery), a new segment starts at its end.
        let last_compacted = recovered.segments.last().is_some_and(|s| s.compacted);
        let (active_first, active_len, active) = match segments.last_key_value() {
            Some((&first, &len)) if !last_compacted => {
                let path = dir.join(format::segment_name(Lsn(first)));
                let f = storage.open_append(&path).map_err(|source| LogError::Io {
                    op: "open_segment",
                    path,
                    source,
                })?;
                (Lsn(first), len, f)
            }
            _ => {
                let path = dir.join(format::segment_name(next_lsn));
                let f = storage.create(&path).map_err(|source| LogError::Io {
                    op: "create_segment",
                    path,
                    source,
                })?;
                segments.insert(next_lsn.0, 0);
                (next_lsn, 0, f)
            }
        };
        let (events, _) = broadcast::channel(config.subscriber_capacity);
        let shared = Arc::new(Shared {
            queue: Queue::new(config.queue_records, config.queue_bytes),
            index: RwLock::new(recovered.index),
            segments: Mutex::new(segments),
            active_segment: AtomicU64::new(active_first.0),
            next_lsn: AtomicU64::new(next_lsn.0),
            poisoned: Mutex::new(None),
            stats: Counters::default(),
            events,
            readers: Mutex::new(HashMap::new()),
            storage: storage.clone(),
            maintenance: Mutex::new(()),
            config,
        });
        let w = writer::Writer {
            shared: shared.clone(),
            storage,
            active,
            active_first,
            active_len,
            next_lsn,
            buf: Vec::new(),
        };
        let handle = std::thread::Builder::new()
            .name("trajlog-writer".into())
            .spawn(move || w.run())
            .map_err(|source| LogError::Io {
                op: "spawn_writer",
                path: dir,
                source,
            })?;
        Ok((
            TrajLog {
                shared,
                writer: Mutex::new(Some(handle)),
            },
            report,
        ))
    }

    fn admit(
        &self,
        record: Record,
    ) -> Result<(Pending, oneshot::Receiver<Result<Lsn, LogError>>), LogError> {
        if !valid_trajectory(&record.trajectory) {
            return Err(LogError::Invalid { what: "trajectory" });
        }
        let max = self.shared.config.max_payload;
        if record.payload.len() > max {
            return Err(LogError::TooLarge {
                size: record.payload.len(),
                max,
            });
        }
        if let Some(op) = self.shared.poisoned() {
            return Err(LogError::Poisoned { op });
        }
        let (reply, rx) = oneshot::channel();
        let size = format::frame_len(record.trajectory.len(), record.payload.len());
        Ok((
            Pending {
                record,
                size,
                reply,
            },
            rx,
        ))
    }

    /// Appends a record and returns its lsn once it is durable (written and fdatasync'ed). Waits
    /// while the queue is full. Dropping the future does not withdraw a queued record.
    pub async fn append(&self, record: Record) -> Result<Lsn, LogError> {
        let (mut pending, rx) = self.admit(record)?;
        loop {
            let notified = self.shared.queue.space.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            match self.shared.queue.try_push(pending) {
                Push::Done => break,
                Push::Closed => return Err(LogError::Closed),
                Push::Full(p) => pending = p,
            }
            notified.await;
        }
        rx.await.unwrap_or(Err(LogError::Closed))
    }

    /// [`append`](TrajLog::append) for threads outside an async runtime (it blocks the thread;
    /// calling it from an async task panics).
    pub fn append_blocking(&self, record: Record) -> Result<Lsn, LogError> {
        let (pending, rx) = self.admit(record)?;
        if !self.shared.queue.push_blocking(pending) {
            return Err(LogError::Closed);
        }
        rx.blocking_recv().unwrap_or(Err(LogError::Closed))
    }

    /// Up to `limit` records of `trajectory` with `step >= from_step`, ordered by step then lsn,
    /// with their payloads read from disk. An unknown trajectory gives an empty list.
    pub fn read(
        &self,
        trajectory: &str,
        from_step: u64,
        limit: usize,
    ) -> Result<Vec<Entry>, LogError> {
        let (slots, files) = {
            let index = self.shared.read_index();
            let slots = index.range(trajectory, from_step, limit);
            let files = self.shared.files_for(slots.iter().map(|(_, _, s)| s))?;
            (slots, files)
        };
        slots
            .into_iter()
            .map(|(_, _, slot)| self.shared.load(&files, slot))
            .collect()
    }

    /// The first intent and first result of a step (what a replay decides on), or `None` if the
    /// step has no record.
    pub fn step(&self, trajectory: &str, step: u64) -> Result<Option<StepRecords>, LogError> {
        let (intent, result, files) = {
            let index = self.shared.read_index();
            let Some((intent, result)) = index.step(trajectory, step) else {
                return Ok(None);
            };
            let files = self
                .shared
                .files_for(intent.iter().chain(result.iter()).map(|(_, s)| s))?;
            (intent, result, files)
        };
        let load = |x: Option<(Lsn, Slot)>| x.map(|(_, s)| self.shared.load(&files, s)).transpose();
        Ok(Some(StepRecords {
            intent: load(intent)?,
            result: load(result)?,
        }))
    }

    /// Summaries of every trajectory, sorted by id.
    pub fn trajectories(&self) -> Vec<TrajectorySummary> {
        self.shared.read_index().summaries()
    }

    /// The summary of one trajectory.
    pub fn trajectory(&self, id: &str) -> Option<TrajectorySummary> {
        self.shared.read_index().summary(id)
    }

    /// Every record made durable after this call, in lsn order. To follow a trajectory without a
    /// gap: subscribe, then [`read`](TrajLog::read) the history, then skip streamed records whose
    /// lsn is not above the last one read. A receiver that falls more than
    /// [`Config::subscriber_capacity`] records behind gets `Lagged` and should re-read.
    pub fn subscribe(&self) -> broadcast::Receiver<Arc<Entry>> {
        self.shared.events.subscribe()
    }

    /// Counters and gauges.
    pub fn stats(&self) -> LogStats {
        let c = &self.shared.stats;
        let q = self.shared.queue.occupancy();
        let segs = self.shared.lock_segments();
        LogStats {
            appends: c.appends.load(Ordering::Relaxed),
            batches: c.batches.load(Ordering::Relaxed),
            fsyncs: c.fsyncs.load(Ordering::Relaxed),
            bytes_written: c.bytes.load(Ordering::Relaxed),
            queue_depth: q.depth,
            queue_bytes: q.bytes,
            queue_high_water: q.high_water,
            segments: segs.len(),
            segment_bytes: segs.values().sum(),
            next_lsn: Lsn(self.shared.next_lsn.load(Ordering::Acquire)),
            indexed: self.shared.read_index().records(),
            poisoned: self.shared.poisoned(),
        }
    }

    /// The log's directory.
    pub fn dir(&self) -> &Path {
        &self.shared.config.dir
    }

    /// Deletes whole segments from the oldest on, while a segment's last write is older than
    /// [`Config::retention_max_age`] or the total size is above [`Config::retention_max_bytes`].
    /// The active segment is never deleted, and only a prefix of the log goes, so no gap appears
    /// between segments. Their records leave the index first. Call it periodically.
    pub fn enforce_retention(&self) -> Result<RetentionReport, LogError> {
        self.enforce_retention_at(SystemTime::now())
    }

    /// [`enforce_retention`](TrajLog::enforce_retention) as if the time were `now`.
    pub fn enforce_retention_at(&self, now: SystemTime) -> Result<RetentionReport, LogError> {
        let cfg = &self.shared.config;
        let mut report = RetentionReport::default();
        if cfg.retention_max_age.is_none() && cfg.retention_max_bytes.is_none() {
            return Ok(report);
        }
        let _maintenance = unpoison(self.shared.maintenance.lock());
        let mut segs = self.shared.lock_segments();
        let active = self.shared.active_segment.load(Ordering::Acquire);
        let mut total: u64 = segs.values().sum();
        let candidates: Vec<(u64, u64)> = segs
            .iter()
            .filter(|(&first, _)| first != active)
            .map(|(&f, &l)| (f, l))
            .collect();
        for (first, len) in candidates {
            let path = self.shared.segment_path(Lsn(first));
            let over_size = cfg.retention_max_bytes.is_some_and(|max| total > max);
            let too_old = match cfg.retention_max_age {
                Some(age) => {
                    let mtime = std::fs::metadata(&path)
                        .and_then(|m| m.modified())
                        .map_err(|source| LogError::Io {
                            op: "stat_segment",
                            path: path.clone(),
                            source,
                        })?;
                    now.duration_since(mtime).is_ok_and(|d| d > age)
                }
                None => false,
            };
            if !over_size && !too_old {
                break;
            }
            self.shared.write_index().remove_segment(Lsn(first));
            unpoison(self.shared.readers.lock()).remove(&first);
            std::fs::remove_file(&path).map_err(|source| LogError::Io {
                op: "delete_segment",
                path: path.clone(),
                source,
            })?;
            segs.remove(&first);
            total -= len;
            report.deleted.push(Lsn(first));
            report.bytes += len;
        }
        if !report.deleted.is_empty() {
            storage::sync_dir(&cfg.dir).map_err(|source| LogError::Io {
                op: "sync_dir",
                path: cfg.dir.clone(),
                source,
            })?;
        }
        Ok(report)
    }

    /// Compaction: rewrites every sealed segment (never the active one) that holds records of a
    /// trajectory for which `finished` returns true, without those records. The other records
    /// keep their lsn, bytes and order. A segment left without records is deleted when it is the
    /// oldest one (otherwise it stays as a 24-byte header until it is). `finished` is asked once
    /// per trajectory per call; records of a finished trajectory in the active segment, or
    /// appended later, stay.
    ///
    /// Each segment is written to a temporary file, fsync'ed, renamed over the original and the
    /// directory fsync'ed, so a crash leaves the old or the new segment. Appends continue
    /// meanwhile; readers see each segment either before or after its swap. On an error the
    /// segments already compacted stay compacted and the log stays consistent.
    pub fn compact(&self, finished: &dyn Fn(&str) -> bool) -> Result<CompactionReport, LogError> {
        compaction::compact(&self.shared, finished)
    }

    /// [`compact`](TrajLog::compact) dropping the trajectories in `finished`.
    pub fn compact_trajectories<S: std::hash::BuildHasher>(
        &self,
        finished: &std::collections::HashSet<String, S>,
    ) -> Result<CompactionReport, LogError> {
        self.compact(&|t| finished.contains(t))
    }

    /// Stops accepting records, lets the writer finish what is queued, and joins it. Later
    /// appends get [`LogError::Closed`]; reads keep working.
    pub fn close(&self) {
        self.shared.queue.close();
        let handle = unpoison(self.writer.lock()).take();
        if let Some(h) = handle {
            let _ = h.join();
        }
    }
}

impl Drop for TrajLog {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests;
