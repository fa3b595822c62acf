//! The soak's clients: a mixed workload (creates, some with an idempotency key, deletes, execs,
//! a Python session, trajectory steps, file writes, `/run_code`, pool churn) on a few threads,
//! each keeping its sandboxes, trajectory and session across daemon restarts. Every answer the
//! daemon acknowledged and promised to keep (a trajectory step's answer, a keyed request's
//! outcome) goes into the ledger, to be checked after every restart.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, RwLock};
use std::time::Duration;

use dsec_testkit::{Http, Reply};
use serde_json::json;

use super::Rng;

/// A trajectory step the daemon answered (its answer carried `Dsec-Step`).
#[derive(Debug, Clone)]
pub(super) struct AckedStep {
    pub(super) trajectory: String,
    pub(super) step: u64,
    pub(super) sandbox: String,
    pub(super) method: &'static str,
    pub(super) path: String,
    pub(super) body: Vec<u8>,
    pub(super) status: u16,
    pub(super) answer: Vec<u8>,
}

/// A request with an `Idempotency-Key` whose outcome the daemon answered (below 500: a server
/// error is not an outcome and is not kept).
#[derive(Debug, Clone)]
pub(super) struct AckedKey {
    pub(super) key: String,
    pub(super) method: &'static str,
    pub(super) path: String,
    pub(super) body: Vec<u8>,
    pub(super) status: u16,
    pub(super) answer: Vec<u8>,
}

/// What the clients saw.
#[derive(Debug, Default)]
pub(super) struct Ledger {
    pub(super) steps: Vec<AckedStep>,
    pub(super) keys: Vec<AckedKey>,
    /// Error answers by code (`transport` when none came: the daemon was down).
    pub(super) errors: BTreeMap<String, u64>,
    /// Operations by kind.
    pub(super) ops: BTreeMap<&'static str, u64>,
    /// Answers that were wrong (an exec's output, a file read back, a session's state).
    pub(super) wrong: Vec<String>,
    /// Every sandbox id an answer named (the cgroups of these are this daemon's).
    pub(super) ids: BTreeSet<String>,
}

/// A trajectory a client is writing.
#[derive(Debug, Clone)]
struct Traj {
    id: String,
    sandbox: String,
    next: u64,
    /// The step last sent and not answered (the daemon died): sent again as it was.
    pending: Option<(&'static str, String, Vec<u8>)>,
}

/// One client's state, kept across cycles.
#[derive(Debug)]
pub(super) struct Worker {
    idx: usize,
    rng: Rng,
    n: u64,
    sandboxes: Vec<String>,
    traj: Option<Traj>,
    /// Sandbox, session, the value of its counter.
    session: Option<(String, u64, u64)>,
    /// A keyed request that got no answer (the daemon died): sent again, with its key, once
    /// the daemon answers.
    unanswered: Option<(String, &'static str, String, Vec<u8>)>,
}

impl Worker {
    pub(super) fn new(idx: usize, seed: u64) -> Self {
        Self {
            idx,
            rng: Rng::new(seed ^ (idx as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)),
            n: 0,
            sandboxes: Vec::new(),
            traj: None,
            session: None,
            unanswered: None,
        }
    }
}

/// What the clients share: the current daemon's client, the stop flag, the ledger.
pub(super) struct Shared {
    pub(super) http: RwLock<Http>,
    pub(super) stop: AtomicBool,
    pub(super) tag: String,
    pub(super) ledger: Mutex<Ledger>,
}

/// The error code of an answer: the problem's `code`, `http_<status>` otherwise.
pub(super) fn code_of(r: &Reply) -> String {
    r.json()["code"]
        .as_str()
        .map_or_else(|| format!("http_{}", r.status), str::to_owned)
}

impl Shared {
    pub(super) fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn client(&self) -> Http {
        self.http.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// One request; `None` (counted as `transport`) when no answer came, and error answers
    /// counted by code.
    fn send(
        &self,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
        key: Option<&str>,
    ) -> Option<Reply> {
        let headers: Vec<(&str, &str)> = key.map(|k| ("Idempotency-Key", k)).into_iter().collect();
        match self.client().send(method, path, body, &headers) {
            Ok(r) => {
                if r.status >= 400 {
                    *self.ledger().errors.entry(code_of(&r)).or_default() += 1;
                }
                Some(r)
            }
            Err(_) => {
                *self.ledger().errors.entry("transport".into()).or_default() += 1;
                std::thread::sleep(Duration::from_millis(100));
                None
            }
        }
    }

    fn count(&self, op: &'static str) {
        *self.ledger().ops.entry(op).or_default() += 1;
    }

    fn wrong(&self, what: String) {
        self.ledger().wrong.push(what);
    }

    /// Records a keyed request's outcome when the daemon gave one.
    fn keyed(&self, key: Option<&str>, method: &'static str, path: &str, body: &[u8], r: &Reply) {
        if let Some(key) = key.filter(|_| r.status < 500) {
            self.ledger().keys.push(AckedKey {
                key: key.to_owned(),
                method,
                path: path.to_owned(),
                body: body.to_vec(),
                status: r.status,
                answer: r.body.clone(),
            });
        }
    }
}

/// Runs `w`'s share of the workload until the stop flag is set.
pub(super) fn work(s: &Shared, w: &mut Worker) {
    while !s.stop.load(Ordering::Relaxed) {
        w.n += 1;
        if w.unanswered.is_some() {
            retry_keyed(s, w);
            continue;
        }
        match w.rng.below(12) {
            0 | 1 if w.sandboxes.len() < 3 => create(s, w),
            0 | 1 => delete(s, w),
            2 | 3 => exec(s, w),
            4..=6 => step(s, w),
            7 => write_file(s, w),
            8 => session(s, w),
            9 => run_code(s, w),
            10 if w.idx == 0 => pool(s, w),
            _ => exec(s, w),
        }
    }
}

/// Forgets `id` when the answer says it is gone or broken (a kill's victim).
fn drop_if_gone(w: &mut Worker, id: &str, r: &Reply) {
    let code = code_of(r);
    if r.status >= 400
        && matches!(
            code.as_str(),
            "sandbox_not_found" | "invalid_transition" | "agent_unavailable" | "internal"
        )
    {
        w.sandboxes.retain(|s| s != id);
        if w.session.as_ref().is_some_and(|(sb, _, _)| sb == id) {
            w.session = None;
        }
    }
}

/// Sends the unanswered keyed request again: the retry after a crash that idempotency keys
/// exist for. Its answer is an outcome to keep like any other.
fn retry_keyed(s: &Shared, w: &mut Worker) {
    let Some((key, method, path, body)) = w.unanswered.take() else {
        return;
    };
    s.count("keyed_retry");
    let Some(r) = s.send(method, &path, Some(&body), Some(&key)) else {
        w.unanswered = Some((key, method, path, body));
        return;
    };
    s.keyed(Some(&key), method, &path, &body, &r);
    if method == "POST" && r.status == 201 {
        if let Some(id) = r.json()["id"].as_str() {
            s.ledger().ids.insert(id.to_owned());
            w.sandboxes.push(id.to_owned());
        }
    }
}

fn create(s: &Shared, w: &mut Worker) {
    s.count("create");
    let key = (w.rng.below(2) == 0).then(|| format!("{}-c{}-{}", s.tag, w.idx, w.n));
    let body = json!({"labels": {"chaos": s.tag}}).to_string().into_bytes();
    let Some(r) = s.send("POST", "/v1/sandboxes", Some(&body), key.as_deref()) else {
        w.unanswered = key.map(|k| (k, "POST", "/v1/sandboxes".to_owned(), body));
        return;
    };
    s.keyed(key.as_deref(), "POST", "/v1/sandboxes", &body, &r);
    if r.status == 201 {
        if let Some(id) = r.json()["id"].as_str() {
            s.ledger().ids.insert(id.to_owned());
            w.sandboxes.push(id.to_owned());
        }
    }
}

fn delete(s: &Shared, w: &mut Worker) {
    s.count("delete");
    let id = w.sandboxes.remove(0);
    if w.session.as_ref().is_some_and(|(sb, _, _)| *sb == id) {
        w.session = None;
    }
    let key = (w.rng.below(2) == 0).then(|| format!("{}-d{}-{}", s.tag, w.idx, w.n));
    let path = format!("/v1/sandboxes/{id}");
    match s.send("DELETE", &path, None, key.as_deref()) {
        Some(r) => s.keyed(key.as_deref(), "DELETE", &path, b"", &r),
        None => w.unanswered = key.map(|k| (k, "DELETE", path, Vec::new())),
    }
}

/// One of `w`'s sandboxes, made if it has none.
fn some_sandbox(s: &Shared, w: &mut Worker) -> Option<String> {
    if w.sandboxes.is_empty() {
        create(s, w);
    }
    let i = w.rng.below(w.sandboxes.len().max(1) as u64) as usize;
    w.sandboxes.get(i).cloned()
}

fn exec(s: &Shared, w: &mut Worker) {
    let Some(id) = some_sandbox(s, w) else { return };
    s.count("exec");
    let n = w.n;
    let body = json!({"shell": format!("echo $(({n} * 3))")}).to_string();
    let path = format!("/v1/sandboxes/{id}/exec");
    let Some(r) = s.send("POST", &path, Some(body.as_bytes()), None) else {
        return;
    };
    let v = r.json();
    if r.status == 200 && v["status"] == "ok" && v["stdout"]["data"] != format!("{}\n", n * 3) {
        s.wrong(format!("exec in {id}: {v}"));
    }
    drop_if_gone(w, &id, &r);
}

/// The next step of `w`'s trajectory: an exec, or one time in four a file write.
fn next_step(w: &mut Worker, t: &Traj) -> (&'static str, String, Vec<u8>) {
    let (id, sb, n) = (&t.id, &t.sandbox, t.next);
    if w.rng.below(4) == 0 {
        let path = format!("/v1/sandboxes/{sb}/files?path=/tmp/{id}-{n}&trajectory={id}&step={n}");
        ("PUT", path, format!("step {n} of {id}\n").into_bytes())
    } else {
        let body = json!({"shell": format!("echo {id}:{n}"), "trajectory": id, "step": n});
        let path = format!("/v1/sandboxes/{sb}/exec");
        ("POST", path, body.to_string().into_bytes())
    }
}

fn step(s: &Shared, w: &mut Worker) {
    if w.traj.is_none() {
        let Some(sandbox) = some_sandbox(s, w) else {
            return;
        };
        w.traj = Some(Traj {
            id: format!("{}-t{}-{}", s.tag, w.idx, w.n),
            sandbox,
            next: 1,
            pending: None,
        });
    }
    let Some(mut t) = w.traj.take() else { return };
    s.count("trajectory_step");
    let (method, path, body) = match t.pending.take() {
        Some(p) => p,
        None => next_step(w, &t),
    };
    let Some(r) = s.send(method, &path, Some(&body), None) else {
        t.pending = Some((method, path, body));
        w.traj = Some(t);
        return;
    };
    let logged = r
        .headers
        .get("dsec-step")
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    let Some(step) = logged else {
        // Unknown outcome, a sandbox gone, a full disk: this trajectory ends here.
        drop_if_gone(w, &t.sandbox, &r);
        return;
    };
    let replayed = r.headers.get("dsec-replayed").is_some();
    let v = r.json();
    if method == "POST" && r.status == 200 && !replayed && v["status"] == "ok" {
        let want = format!("{}:{}\n", t.id, step);
        if v["stdout"]["data"] != want.as_str() {
            s.wrong(format!("step {step} of {}: {v}", t.id));
        }
    }
    s.ledger().steps.push(AckedStep {
        trajectory: t.id.clone(),
        step,
        sandbox: t.sandbox.clone(),
        method,
        path,
        body,
        status: r.status,
        answer: r.body.clone(),
    });
    if r.status >= 400 {
        drop_if_gone(w, &t.sandbox, &r);
        if !w.sandboxes.contains(&t.sandbox) {
            return;
        }
    }
    t.next = step + 1;
    w.traj = Some(t);
}

fn write_file(s: &Shared, w: &mut Worker) {
    let Some(id) = some_sandbox(s, w) else { return };
    s.count("file_write");
    let data = format!("{} {} {}\n", s.tag, w.idx, w.rng.next()).repeat(1 + w.n as usize % 50);
    let path = format!(
        "/v1/sandboxes/{id}/files?path=/tmp/chaos-{}&parents=true",
        w.n
    );
    let Some(r) = s.send("PUT", &path, Some(data.as_bytes()), None) else {
        return;
    };
    if r.status != 204 {
        drop_if_gone(w, &id, &r);
        return;
    }
    let read = format!("/v1/sandboxes/{id}/files?path=/tmp/chaos-{}", w.n);
    if let Some(r) = s.send("GET", &read, None, None) {
        if r.status == 200 && r.body != data.as_bytes() {
            s.wrong(format!("file read back from {id}: {} bytes", r.body.len()));
        }
    }
}

fn session(s: &Shared, w: &mut Worker) {
    let Some((id, sess, n)) = w.session.clone() else {
        let Some(id) = some_sandbox(s, w) else { return };
        s.count("session_open");
        let path = format!("/v1/sandboxes/{id}/sessions");
        let body = json!({"kind": "python"}).to_string();
        let Some(r) = s.send("POST", &path, Some(body.as_bytes()), None) else {
            return;
        };
        match r.json()["session"].as_u64() {
            Some(sess) if r.status == 201 => w.session = Some((id, sess, 0)),
            _ => drop_if_gone(w, &id, &r),
        }
        return;
    };
    s.count("session_run");
    let path = format!("/v1/sandboxes/{id}/sessions/{sess}/run");
    let input = if n == 0 {
        "n = 1\nprint(n)"
    } else {
        "n += 1\nprint(n)"
    };
    let body = json!({"input": input}).to_string();
    let Some(r) = s.send("POST", &path, Some(body.as_bytes()), None) else {
        // It may or may not have run: the counter is unknown now.
        w.session = None;
        return;
    };
    let v = r.json();
    if r.status == 200 && v["status"] == "ok" {
        if v["stdout"]["data"] != format!("{}\n", n + 1) {
            s.wrong(format!("session {sess} of {id} after {n}: {v}"));
        }
        w.session = Some((id, sess, n + 1));
    } else {
        // The session is gone (its sandbox or agent was killed, or it was not adopted).
        w.session = None;
        drop_if_gone(w, &id, &r);
    }
}

fn run_code(s: &Shared, w: &mut Worker) {
    s.count("run_code");
    let (a, b) = (w.rng.below(1000), w.rng.below(1000));
    let body = json!({"code": format!("print({a} + {b})"), "language": "python"}).to_string();
    let Some(r) = s.send("POST", "/run_code", Some(body.as_bytes()), None) else {
        return;
    };
    let v = r.json();
    if r.status == 200 && v["status"] == "Success" {
        if v["run_result"]["stdout"] != format!("{}\n", a + b) {
            s.wrong(format!("/run_code {a} + {b}: {v}"));
        }
    } else {
        let code = v["status"].as_str().unwrap_or("none");
        *s.ledger()
            .errors
            .entry(format!("run_code_{code}"))
            .or_default() += 1;
    }
}

fn pool(s: &Shared, w: &mut Worker) {
    s.count("pool_resize");
    let body = json!({"min": w.rng.below(3), "max": 4}).to_string();
    s.send("PUT", "/v1/pools/host", Some(body.as_bytes()), None);
}
