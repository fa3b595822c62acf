//! Trajectories over the log: exactly-once steps, fast-forward replay, redaction.
//!
//! A step of trajectory T is an action (exec, session input, file write) sent with
//! `trajectory` and optionally `step`. Before it runs, an `intent` record (the redacted action
//! and its digest) is made durable; before the API answers, a `result` record (the exact
//! answer body, or a pointer to it for large ones) is. A client that resumes T re-sends its
//! steps:
//!
//! - a step whose action matches the logged one and that has a result is answered from the
//!   log, byte for byte, without running (fast-forward; `Dsec-Replayed: true`);
//! - a matching step with an intent but no result answers `unknown_outcome` — it may or may
//!   not have run, and the client decides; nothing re-runs silently;
//! - a step whose action differs from the logged one runs live and starts a new branch (the
//!   old records of that step and of every later one no longer count);
//! - the next step after the log's last runs live; a step number beyond that answers
//!   `trajectory_diverged`.
//!
//! The same mechanism makes an exec retry with the same (trajectory, step) exactly-once.
//! Trajectory ids are per tenant: the log key is `<tenant id>/<trajectory>`.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use dsec_api::ErrorCode;
use serde_json::{json, Value};
use sha2::{Digest as _, Sha256};
use tokio::sync::OwnedMutexGuard;

use crate::trajlog::{
    Config, Entry, Lsn, Record, RecordKind, RecoveryReport, TrajLog, TrajectorySummary,
};

use super::error::{ApiError, ApiResult};
use crate::clock::now_ms;
use crate::store::Tenant;

/// Answer bodies up to this size live in the result record; larger ones in a blob file.
const INLINE_BODY: usize = 1 << 20;
/// Longest trajectory id a client may use.
pub const MAX_TRAJECTORY_ID: usize = 100;

/// Secret patterns masked by default (API keys and tokens of common providers).
pub const DEFAULT_PATTERNS: &[&str] = &[
    r"sk-[A-Za-z0-9_-]{20,}",
    r"ghp_[A-Za-z0-9]{36}",
    r"github_pat_[A-Za-z0-9_]{22,}",
    r"AKIA[0-9A-Z]{16}",
    r"xox[baprs]-[A-Za-z0-9-]{10,}",
    r"(?i)bearer\s+[A-Za-z0-9._~+/-]{20,}=*",
    r"-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?-----END [A-Z ]*PRIVATE KEY-----",
];

/// The mask written instead of a secret.
pub const MASK: &str = "[REDACTED]";

/// Masks secrets before anything reaches the log.
#[derive(Debug, Clone)]
pub struct Redactor {
    patterns: Vec<regex::Regex>,
}

impl Redactor {
    /// A redactor for `patterns` (regular expressions).
    pub fn new(patterns: &[String]) -> Result<Self, String> {
        let patterns = patterns
            .iter()
            .map(|p| regex::Regex::new(p).map_err(|e| format!("redaction pattern {p:?}: {e}")))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { patterns })
    }

    /// `text` with every secret value (≥ 4 bytes) and every pattern match masked.
    pub fn redact(&self, text: &str, secrets: &[String]) -> String {
        let mut out = text.to_owned();
        for s in secrets.iter().filter(|s| s.len() >= 4) {
            if out.contains(s.as_str()) {
                out = out.replace(s.as_str(), MASK);
            }
        }
        for p in &self.patterns {
            if p.is_match(&out) {
                out = p.replace_all(&out, MASK).into_owned();
            }
        }
        out
    }
}

/// The live chain of one trajectory: for each step, its current intent and result.
#[derive(Debug, Default, Clone)]
struct Chain {
    steps: BTreeMap<u64, Link>,
}

#[derive(Debug, Clone)]
struct Link {
    intent: Lsn,
    digest: String,
    result: Option<Lsn>,
}

impl Chain {
    fn apply(&mut self, e: &Entry) {
        match e.kind {
            RecordKind::Intent => {
                // A new intent for step k starts a new branch: steps ≥ k of the old one go.
                let _ = self.steps.split_off(&e.step);
                let digest = serde_json::from_slice::<Value>(&e.payload)
                    .ok()
                    .and_then(|v| v["digest"].as_str().map(str::to_owned))
                    .unwrap_or_default();
                self.steps.insert(
                    e.step,
                    Link {
                        intent: e.lsn,
                        digest,
                        result: None,
                    },
                );
            }
            RecordKind::Result => {
                if let Some(l) = self.steps.get_mut(&e.step) {
                    if l.result.is_none() && e.lsn > l.intent {
                        l.result = Some(e.lsn);
                    }
                }
            }
            RecordKind::Annotation => {}
        }
    }

    fn last_step(&self) -> u64 {
        self.steps.keys().next_back().copied().unwrap_or(0)
    }
}

/// What to do with a step.
pub enum Begin {
    /// Answer from the log.
    Replay {
        /// HTTP status of the first answer.
        status: u16,
        /// Its exact body.
        body: Vec<u8>,
        /// The step.
        step: u64,
    },
    /// Run it: the intent is durable; call [`Trajectories::finish`] with the answer.
    Run(Running),
}

/// A step being run (holds the trajectory's lock).
pub struct Running {
    key: String,
    step: u64,
    digest: String,
    secrets: Vec<String>,
    _guard: OwnedMutexGuard<()>,
}

impl Running {
    /// The step number.
    pub fn step(&self) -> u64 {
        self.step
    }
}

/// The node's trajectories.
pub struct Trajectories {
    log: TrajLog,
    blobs: PathBuf,
    redactor: Redactor,
    chains: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    cache: Mutex<HashMap<String, Chain>>,
    /// How the log was found at start.
    pub recovery: RecoveryReport,
}

impl std::fmt::Debug for Trajectories {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trajectories").finish_non_exhaustive()
    }
}

/// Validates a client's trajectory id.
pub fn check_id(id: &str) -> ApiResult<()> {
    let ok = !id.is_empty()
        && id.len() <= MAX_TRAJECTORY_ID
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid(format!(
            "trajectory ids are 1..={MAX_TRAJECTORY_ID} of [A-Za-z0-9._:-]"
        )))
    }
}

fn key(tenant: &Tenant, id: &str) -> String {
    format!("{}/{}", tenant.id, id)
}

fn log_err(e: crate::trajlog::LogError) -> ApiError {
    match e {
        crate::trajlog::LogError::Poisoned { .. } => ApiError::new(
            ErrorCode::ResourceExhausted,
            "the trajectory log failed to sync and accepts nothing more; restart the node",
        ),
        crate::trajlog::LogError::TooLarge { size, max } => ApiError::new(
            ErrorCode::TooLarge,
            format!("log record of {size} bytes exceeds {max}"),
        ),
        other => ApiError::internal(other.to_string()),
    }
}

impl Trajectories {
    /// Opens the log under `dir` (recovering it) with the given redaction patterns.
    pub fn open(
        dir: PathBuf,
        patterns: &[String],
        retention: (Option<std::time::Duration>, Option<u64>),
        segment_bytes: Option<u64>,
    ) -> Result<Self, String> {
        let redactor = Redactor::new(patterns)?;
        let blobs = dir.join("blobs");
        std::fs::create_dir_all(&blobs).map_err(|e| format!("{}: {e}", blobs.display()))?;
        let mut config = Config::new(dir.join("segments"));
        config.retention_max_age = retention.0;
        config.retention_max_bytes = retention.1;
        if let Some(b) = segment_bytes {
            config.segment_bytes = b;
        }
        let (log, recovery) = TrajLog::open(config).map_err(|e| format!("trajectory log: {e}"))?;
        Ok(Self {
            log,
            blobs,
            redactor,
            chains: Mutex::new(HashMap::new()),
            cache: Mutex::new(HashMap::new()),
            recovery,
        })
    }

    /// The log.
    pub fn log(&self) -> &TrajLog {
        &self.log
    }

    /// The log key of a tenant's trajectory (validated), when the log has it.
    pub fn existing_key(&self, tenant: &Tenant, trajectory: &str) -> ApiResult<String> {
        self.existing(tenant, trajectory).map(|(key, _)| key)
    }

    /// The log key and counters of a tenant's trajectory (validated), when the log has it.
    fn existing(
        &self,
        tenant: &Tenant,
        trajectory: &str,
    ) -> ApiResult<(String, TrajectorySummary)> {
        check_id(trajectory)?;
        let key = key(tenant, trajectory);
        match self.log.trajectory(&key) {
            Some(s) => Ok((key, s)),
            None => Err(ApiError::new(
                ErrorCode::TrajectoryNotFound,
                format!("no trajectory {trajectory}"),
            )),
        }
    }

    /// Compacts the log: records of trajectories finished at least `after` ago go.
    pub fn compact_finished(
        &self,
        store: &crate::store::Store,
        after: std::time::Duration,
    ) -> ApiResult<Value> {
        let before = now_ms().saturating_sub(after.as_millis() as u64);
        let finished: std::collections::HashSet<String> =
            store.finished_trajectories(before)?.into_iter().collect();
        if finished.is_empty() {
            return Ok(serde_json::json!({"records_dropped": 0}));
        }
        self.compact(&finished)
    }

    /// Drops the records of `finished` trajectories from sealed log segments.
    pub fn compact(&self, finished: &std::collections::HashSet<String>) -> ApiResult<Value> {
        let r = self.log.compact_trajectories(finished).map_err(log_err)?;
        if r.records_dropped > 0 {
            self.cache.lock().unwrap_or_else(|p| p.into_inner()).clear();
        }
        Ok(json!({
            "segments_rewritten": r.segments_rewritten,
            "segments_deleted": r.segments_deleted,
            "records_dropped": r.records_dropped,
            "bytes_reclaimed": r.bytes_reclaimed,
        }))
    }

    /// Applies the log's retention; forgets cached chains when segments went.
    pub fn enforce_retention(&self) {
        if let Ok(r) = self.log.enforce_retention() {
            if !r.deleted.is_empty() {
                self.cache.lock().unwrap_or_else(|p| p.into_inner()).clear();
            }
        }
    }

    /// The redactor.
    pub fn redactor(&self) -> &Redactor {
        &self.redactor
    }

    fn lock_of(&self, key: &str) -> Arc<tokio::sync::Mutex<()>> {
        super::keyed::keyed(&self.chains, key.to_owned())
    }

    /// The current chain of a trajectory (built from the log once, then kept up to date).
    fn chain(&self, key: &str) -> ApiResult<Chain> {
        if let Some(c) = self
            .cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(key)
        {
            return Ok(c.clone());
        }
        let mut c = Chain::default();
        let mut entries = self.log.read(key, 0, usize::MAX).map_err(log_err)?;
        entries.sort_by_key(|e| e.lsn);
        for e in &entries {
            c.apply(e);
        }
        self.cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key.to_owned(), c.clone());
        Ok(c)
    }

    fn note(&self, key: &str, e: &Entry) {
        if let Some(c) = self
            .cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(key)
        {
            c.apply(e);
        }
    }

    async fn append(&self, rec: Record) -> ApiResult<Entry> {
        let (trajectory, step, kind, payload) = (
            rec.trajectory.clone(),
            rec.step,
            rec.kind,
            rec.payload.clone(),
        );
        let lsn = self.log.append(rec).await.map_err(log_err)?;
        Ok(Entry {
            lsn,
            trajectory,
            step,
            kind,
            payload,
        })
    }

    /// Decides a step: replays it from the log, refuses it, or records its intent and hands
    /// back a [`Running`] to finish. `action` is the request as the client sent it (without
    /// trajectory fields); `secrets` are values to mask.
    #[allow(clippy::too_many_arguments)]
    pub async fn begin(
        &self,
        tenant: &Tenant,
        trajectory: &str,
        step: Option<u64>,
        op: &str,
        sandbox: &str,
        action: &Value,
        secrets: Vec<String>,
    ) -> ApiResult<Begin> {
        check_id(trajectory)?;
        let key = key(tenant, trajectory);
        let guard = self.lock_of(&key).lock_owned().await;
        let chain = self.chain(&key)?;
        let action_text = serde_json::to_string(&json!({"op": op, "action": action}))
            .map_err(|e| ApiError::internal(e.to_string()))?;
        let redacted = self.redactor.redact(&action_text, &secrets);
        let digest = hex::encode(Sha256::digest(redacted.as_bytes()));
        let last = chain.last_step();
        let step = match step {
            None => last + 1,
            Some(0) => return Err(ApiError::invalid("steps are numbered from 1")),
            Some(s) => s,
        };
        if step > last + 1 {
            return Err(ApiError::new(
                ErrorCode::TrajectoryDiverged,
                format!(
                    "step {step} does not continue trajectory {trajectory}: the next step is {}",
                    last + 1
                ),
            ));
        }
        if let Some(link) = chain.steps.get(&step) {
            if link.digest == digest {
                let Some(result) = link.result else {
                    return Err(ApiError::new(
                        ErrorCode::UnknownOutcome,
                        format!(
                            "step {step} of {trajectory} was started but its outcome was never recorded; it may or may not have run"
                        ),
                    ));
                };
                let (status, body) = self.result_body(&key, step, result)?;
                return Ok(Begin::Replay { status, body, step });
            }
            // A different action: a new branch from this step on.
        }
        let intent = json!({
            "op": op,
            "sandbox": sandbox,
            "digest": digest,
            "action": serde_json::from_str::<Value>(&redacted).map_or(Value::Null, |v| v["action"].clone()),
            "at_ms": now_ms(),
        });
        let e = self
            .append(Record::new(
                key.clone(),
                step,
                RecordKind::Intent,
                intent.to_string().into_bytes(),
            ))
            .await?;
        self.note(&key, &e);
        Ok(Begin::Run(Running {
            key,
            step,
            digest,
            secrets,
            _guard: guard,
        }))
    }

    /// Records the answer of a step (durably) and returns the body to send: the redacted one,
    /// which is also what a replay returns.
    pub async fn finish(
        &self,
        run: Running,
        status: u16,
        body: &[u8],
        summary: Value,
    ) -> ApiResult<Vec<u8>> {
        let text = String::from_utf8_lossy(body);
        let body = self.redactor.redact(&text, &run.secrets).into_bytes();
        let mut result = json!({
            "digest": run.digest,
            "http_status": status,
            "finished_at_ms": now_ms(),
            "summary": summary,
        });
        if body.len() <= INLINE_BODY {
            result["body"] = Value::String(String::from_utf8_lossy(&body).into_owned());
        } else {
            let sha = hex::encode(Sha256::digest(&body));
            let path = self.blobs.join(&sha);
            let body2 = body.clone();
            tokio::task::spawn_blocking(move || write_blob(&path, &body2))
                .await
                .map_err(|e| ApiError::internal(e.to_string()))?
                .map_err(|e| ApiError::internal(format!("blob: {e}")))?;
            result["body_blob"] = Value::String(sha);
            result["body_len"] = Value::from(body.len());
        }
        let e = self
            .append(Record::new(
                run.key.clone(),
                run.step,
                RecordKind::Result,
                result.to_string().into_bytes(),
            ))
            .await?;
        self.note(&run.key, &e);
        Ok(body)
    }

    fn result_body(&self, key: &str, step: u64, lsn: Lsn) -> ApiResult<(u16, Vec<u8>)> {
        let entries = self.log.read(key, step, usize::MAX).map_err(log_err)?;
        let e = entries
            .into_iter()
            .find(|e| e.lsn == lsn)
            .ok_or_else(|| ApiError::internal("logged result not found"))?;
        let v: Value = serde_json::from_slice(&e.payload)
            .map_err(|err| ApiError::internal(format!("logged result: {err}")))?;
        let status = v["http_status"].as_u64().unwrap_or(200) as u16;
        if let Some(body) = v["body"].as_str() {
            return Ok((status, body.as_bytes().to_vec()));
        }
        let sha = v["body_blob"].as_str().unwrap_or_default();
        if sha.len() != 64 || !sha.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(ApiError::internal("logged result has no body"));
        }
        let body = std::fs::read(self.blobs.join(sha))
            .map_err(|err| ApiError::internal(format!("blob {sha}: {err}")))?;
        Ok((status, body))
    }

    /// Adds an annotation (reward, labels, free-form data) to a trajectory or one step.
    pub async fn annotate(
        &self,
        tenant: &Tenant,
        trajectory: &str,
        step: u64,
        data: &Value,
    ) -> ApiResult<Lsn> {
        let key = self.existing_key(tenant, trajectory)?;
        let e = self
            .append(Record::new(
                key,
                step,
                RecordKind::Annotation,
                data.to_string().into_bytes(),
            ))
            .await?;
        Ok(e.lsn)
    }

    /// The tenant's trajectories with their counters.
    pub fn list(&self, tenant: &Tenant) -> Vec<Value> {
        let prefix = format!("{}/", tenant.id);
        self.log
            .trajectories()
            .into_iter()
            .filter_map(|s| {
                let id = s.id.strip_prefix(&prefix)?.to_owned();
                Some(json!({
                    "id": id,
                    "intents": s.intents,
                    "results": s.results,
                    "annotations": s.annotations,
                    "acknowledged": s.results,
                    "unknown": s.intents.saturating_sub(s.results),
                    "last_step": s.last_step,
                    "first_lsn": s.first_lsn.0,
                    "last_lsn": s.last_lsn.0,
                }))
            })
            .collect()
    }

    /// One trajectory's counters.
    pub fn summary(&self, tenant: &Tenant, trajectory: &str) -> ApiResult<Value> {
        let (key, s) = self.existing(tenant, trajectory)?;
        let chain = self.chain(&key)?;
        Ok(json!({
            "id": trajectory,
            "intents": s.intents,
            "results": s.results,
            "annotations": s.annotations,
            "acknowledged": s.results,
            "unknown": s.intents.saturating_sub(s.results),
            "last_step": chain.last_step(),
            "first_lsn": s.first_lsn.0,
            "last_lsn": s.last_lsn.0,
        }))
    }

    /// The records of a trajectory from `from` on (at most `limit`), in log order.
    pub fn records(
        &self,
        tenant: &Tenant,
        trajectory: &str,
        from: u64,
        limit: usize,
    ) -> ApiResult<Vec<Value>> {
        let key = self.existing_key(tenant, trajectory)?;
        let mut entries = self.log.read(&key, from, limit).map_err(log_err)?;
        entries.sort_by_key(|e| e.lsn);
        Ok(entries.iter().map(entry_view).collect())
    }

    /// Steps joined for export: the live chain's intent and result of each step plus the
    /// trajectory's annotations.
    pub fn export_rows(&self, tenant: &Tenant, trajectory: &str) -> ApiResult<Vec<Value>> {
        check_id(trajectory)?;
        let key = key(tenant, trajectory);
        let chain = self.chain(&key)?;
        let mut entries = self.log.read(&key, 0, usize::MAX).map_err(log_err)?;
        entries.sort_by_key(|e| e.lsn);
        let by_lsn: HashMap<u64, &Entry> = entries.iter().map(|e| (e.lsn.0, e)).collect();
        let mut step_notes: BTreeMap<u64, Vec<Value>> = BTreeMap::new();
        let mut traj_notes = Vec::new();
        for e in entries.iter().filter(|e| e.kind == RecordKind::Annotation) {
            let v: Value = serde_json::from_slice(&e.payload).unwrap_or(Value::Null);
            if e.step == 0 {
                traj_notes.push(v);
            } else {
                step_notes.entry(e.step).or_default().push(v);
            }
        }
        let mut rows = Vec::new();
        for (step, link) in &chain.steps {
            let intent: Value = by_lsn
                .get(&link.intent.0)
                .and_then(|e| serde_json::from_slice(&e.payload).ok())
                .unwrap_or(Value::Null);
            let result: Value = link
                .result
                .and_then(|l| by_lsn.get(&l.0))
                .and_then(|e| serde_json::from_slice(&e.payload).ok())
                .unwrap_or(Value::Null);
            let observation = match result["body"].as_str() {
                Some(b) => serde_json::from_str::<Value>(b).unwrap_or(Value::String(b.to_owned())),
                None if result.is_null() => Value::Null,
                None => json!({"blob": result["body_blob"], "len": result["body_len"]}),
            };
            let notes = step_notes.get(step).cloned().unwrap_or_default();
            rows.push(json!({
                "trajectory": trajectory,
                "step": step,
                "op": intent["op"],
                "action": intent["action"],
                "observation": observation,
                "http_status": result["http_status"],
                "exit_status": observation["status"],
                "exit_code": observation["exit_code"],
                "wall_us": observation["wall_us"],
                "started_at_ms": intent["at_ms"],
                "finished_at_ms": result["finished_at_ms"],
                "outcome": if result.is_null() { "unknown" } else { "recorded" },
                "annotations": notes,
                "trajectory_annotations": traj_notes,
            }));
        }
        Ok(rows)
    }
}

/// The API view of one log record.
pub fn entry_view(e: &Entry) -> Value {
    let payload: Value = serde_json::from_slice(&e.payload).unwrap_or(Value::Null);
    let trajectory = e
        .trajectory
        .split_once('/')
        .map_or(e.trajectory.as_str(), |(_, t)| t);
    json!({
        "lsn": e.lsn.0,
        "trajectory": trajectory,
        "step": e.step,
        "kind": e.kind.as_str(),
        "record": payload,
    })
}

fn write_blob(path: &std::path::Path, body: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    if path.exists() {
        return Ok(());
    }
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(body)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redaction_masks_secrets_and_patterns() -> Result<(), String> {
        let patterns: Vec<String> = DEFAULT_PATTERNS.iter().map(|p| (*p).to_owned()).collect();
        let r = Redactor::new(&patterns)?;
        let text = "key sk-abcdefghijklmnopqrstuvwx and AKIAABCDEFGHIJKLMNOP and hunter22 ok";
        let out = r.redact(text, &["hunter22".to_owned(), "ab".to_owned()]);
        assert_eq!(out, "key [REDACTED] and [REDACTED] and [REDACTED] ok");
        assert!(Redactor::new(&["(".to_owned()]).is_err());
        Ok(())
    }

    fn entry(lsn: u64, step: u64, kind: RecordKind, digest: &str) -> Entry {
        Entry {
            lsn: Lsn(lsn),
            trajectory: "t".into(),
            step,
            kind,
            payload: json!({"digest": digest}).to_string().into_bytes(),
        }
    }

    #[test]
    fn a_new_intent_starts_a_branch() {
        let mut c = Chain::default();
        for e in [
            entry(1, 1, RecordKind::Intent, "a"),
            entry(2, 1, RecordKind::Result, ""),
            entry(3, 2, RecordKind::Intent, "b"),
            entry(4, 2, RecordKind::Result, ""),
            entry(5, 3, RecordKind::Intent, "c"),
            entry(6, 2, RecordKind::Intent, "b2"),
        ] {
            c.apply(&e);
        }
        assert_eq!(c.last_step(), 2, "step 3 belonged to the old branch");
        assert_eq!(c.steps[&2].digest, "b2");
        assert!(c.steps[&2].result.is_none());
        assert_eq!(c.steps[&1].result, Some(Lsn(2)));
    }
}
