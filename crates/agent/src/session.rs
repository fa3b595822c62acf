//! Persistent sessions: a shell (`/bin/bash`, else `/bin/sh`) or a Python driver reading inputs on
//! stdin. Each run is followed by a unique end marker printed on stdout (with the exit status)
//! and on stderr; the run's output is everything before the markers. A Python session whose
//! globals define `_dsec_idle` has it called after each run's markers, for work that should not
//! delay the answer (the function substrate's zygote forks its next child there).
//!
//! A pump thread per session reads the interpreter's output. A run registers itself with the
//! pump and writes its input; the pump scans the output for both markers and answers the run
//! itself. The run's thread only watches: the timeout passing kills the session, and so does the
//! interpreter's exit; either way that thread answers. Output while no run is active
//! (background jobs) is dropped.

use std::collections::hash_map::RandomState;
use std::collections::{BTreeMap, HashMap};
use std::hash::BuildHasher;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use dsec_api::agent::SessionKind;
use dsec_api::exec::{ExecResult, ExecStatus, Stream, DEFAULT_OUTPUT_LIMIT};
use dsec_api::ErrorCode;
use dsec_sys::proc::{self, WaitStatus};
use dsec_sys::spawn::Spawn;

use crate::exec::{self, Capture, ExecError, PumpLimits, StdinFeed, SIGKILL};
use crate::files::Root;
use crate::reaper::{lock, ExitSlot, Reaper};

/// Most sessions open at once.
pub const MAX_SESSIONS: usize = 64;
/// Longest input accepted.
const MAX_INPUT: usize = 4 << 20;

const PY_DRIVER: &str = r#"
import sys, json, ast, traceback
g = {"__name__": "__main__", "__builtins__": __builtins__}
rd = sys.stdin.buffer
while True:
    line = rd.readline()
    if not line:
        break
    req = json.loads(line)
    m = req["marker"]
    rc = 0
    tail = ""
    try:
        tree = ast.parse(req["code"], "<input>", "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, "<input>", "exec"), g)
        if last is not None:
            v = eval(compile(last, "<input>", "eval"), g)
            if v is not None:
                # The value leaves with the end marker, in one write, when nothing else of the
                # run is buffered ahead of it.
                if sys.stdout is sys.__stdout__:
                    tail = repr(v) + "\n"
                else:
                    print(repr(v))
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        rc = 1
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:
            pass
    sys.__stdout__.write("%s%s%d%s\n" % (tail, m, rc, m))
    sys.__stdout__.flush()
    sys.__stderr__.write(m + "\n")
    sys.__stderr__.flush()
    idle = g.get("_dsec_idle")
    if idle is not None:
        try:
            idle()
        except BaseException:
            pass
"#;

/// Errors of session requests.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// Unknown (or dead) session id.
    #[error("session {0} not found")]
    NotFound(u64),
    /// Too many sessions.
    #[error("more than {MAX_SESSIONS} sessions are open")]
    TooMany,
    /// Input too long.
    #[error("session input exceeds {MAX_INPUT} bytes")]
    InputTooLarge,
    /// Starting the interpreter failed.
    #[error("start session")]
    Start(#[source] ExecError),
    /// The pump thread could not be started.
    #[error("start session pump thread")]
    Thread(#[source] std::io::Error),
}

impl SessionError {
    /// The wire code.
    pub fn code(&self) -> ErrorCode {
        match self {
            SessionError::NotFound(_) => ErrorCode::HandleNotFound,
            SessionError::TooMany => ErrorCode::ResourceExhausted,
            SessionError::InputTooLarge => ErrorCode::TooLarge,
            SessionError::Start(e) => e.code(),
            SessionError::Thread(_) => ErrorCode::Internal,
        }
    }
}

/// Sends a run's result (to the node).
pub type Reply = Box<dyn FnOnce(ExecResult) + Send>;

/// The run in progress: the pump thread scans the interpreter's output for its markers and,
/// when both are in, answers it itself (no thread wakes up between the marker and the answer).
struct ActiveRun {
    out: Scan,
    err: Scan,
    started: Instant,
    reply: Reply,
}

impl ActiveRun {
    fn push(&mut self, stream: Stream, b: &[u8]) {
        match stream {
            Stream::Stdout => self.out.push(b),
            Stream::Stderr => self.err.push(b),
        }
    }

    fn complete(&self) -> bool {
        self.out.done && self.err.done
    }

    /// The result so far: exit status from the marker (if it came), output captured.
    fn result(self) -> (ExecResult, Reply) {
        let wall_us = self.started.elapsed().as_micros().min(u64::MAX as u128) as u64;
        let exit_code = self.out.rc;
        let res = ExecResult {
            status: status_of(exit_code),
            exit_code,
            signal: None,
            wall_us,
            cpu_us: 0,
            peak_rss_kb: 0,
            stdout: self.out.cap.finish(),
            stderr: self.err.cap.finish(),
        };
        (res, self.reply)
    }
}

/// A run's status from its exit code (none: killed by a signal).
fn status_of(exit_code: Option<i32>) -> ExecStatus {
    match exit_code {
        Some(0) => ExecStatus::Ok,
        Some(_) => ExecStatus::NonzeroExit,
        None => ExecStatus::Killed,
    }
}

/// What the pump thread and the run's thread share.
#[derive(Default)]
struct Shared {
    state: Mutex<SharedState>,
    changed: Condvar,
}

#[derive(Default)]
struct SharedState {
    active: Option<ActiveRun>,
    /// The pump ended (the interpreter exited and its output is drained).
    ended: bool,
}

struct Session {
    kind: SessionKind,
    pid: i32,
    feed: Arc<StdinFeed>,
    /// The interpreter's stdin, written directly when nothing is queued.
    pipe: Option<std::fs::File>,
    slot: Arc<ExitSlot>,
    shared: Arc<Shared>,
    runs: u64,
}

impl Drop for Session {
    fn drop(&mut self) {
        let _ = proc::killpg(self.pid, SIGKILL);
    }
}

/// All open sessions.
#[derive(Default)]
pub struct Sessions {
    map: Mutex<HashMap<u64, Arc<Mutex<Session>>>>,
    next: Mutex<u64>,
}

impl Sessions {
    /// Opens a session.
    pub fn open(
        &self,
        kind: SessionKind,
        env: &BTreeMap<String, String>,
        cwd: Option<&str>,
        root: &Root,
        reaper: &Reaper,
    ) -> Result<u64, SessionError> {
        if lock(&self.map).len() >= MAX_SESSIONS {
            return Err(SessionError::TooMany);
        }
        let (mut cmd, program) = match kind {
            SessionKind::Shell => {
                if std::path::Path::new("/bin/bash").exists() {
                    let mut c = Spawn::new("/bin/bash");
                    c.args(["--noprofile", "--norc"]);
                    (c, "/bin/bash")
                } else {
                    (Spawn::new("/bin/sh"), "/bin/sh")
                }
            }
            SessionKind::Python => {
                let mut c = Spawn::new("/usr/bin/python3");
                c.args(["-u", "-c", PY_DRIVER]);
                (c, "/usr/bin/python3")
            }
        };
        exec::prepare(&mut cmd, env, cwd, None, root).map_err(SessionError::Start)?;
        exec::as_user(&mut cmd, None, env, root).map_err(SessionError::Start)?;
        let mut running = exec::start(reaper, &cmd, program).map_err(SessionError::Start)?;
        let pid = running.pid;
        let slot = Arc::clone(&running.slot);
        let pipe = running.stdin_pipe();
        let feed = Arc::new(StdinFeed::new(Vec::new(), false));
        let shared = Arc::new(Shared::default());
        let pump_feed = Arc::clone(&feed);
        let pump_shared = Arc::clone(&shared);
        let spawned = std::thread::Builder::new()
            .name(format!("session-{pid}"))
            .spawn(move || {
                let limits = PumpLimits {
                    deadline: None,
                    cap: 0,
                    kill_after: None,
                };
                let sh = &pump_shared;
                running.pump(&pump_feed, &limits, &mut |stream, b| {
                    let mut st = lock(&sh.state);
                    // Output while no run is active (background jobs) is dropped.
                    let Some(run) = st.active.as_mut() else {
                        return;
                    };
                    run.push(stream, b);
                    if run.complete() {
                        let run = st.active.take();
                        drop(st);
                        if let Some(run) = run {
                            let (res, reply) = run.result();
                            reply(res);
                        }
                        sh.changed.notify_all();
                    }
                });
                lock(&sh.state).ended = true;
                sh.changed.notify_all();
            });
        if let Err(e) = spawned {
            let _ = proc::killpg(pid, SIGKILL);
            return Err(SessionError::Thread(e));
        }
        let id = {
            let mut n = lock(&self.next);
            *n += 1;
            *n
        };
        let session = Session {
            kind,
            pid,
            feed,
            pipe,
            slot,
            shared,
            runs: 0,
        };
        lock(&self.map).insert(id, Arc::new(Mutex::new(session)));
        Ok(id)
    }

    /// Closes (kills) a session.
    pub fn close(&self, id: u64) -> Result<(), SessionError> {
        lock(&self.map)
            .remove(&id)
            .map(drop)
            .ok_or(SessionError::NotFound(id))
    }

    /// Forgets (and kills) every session.
    pub fn clear(&self) {
        lock(&self.map).clear();
    }

    /// Runs one input; its result goes to `reply` (from the session's pump thread when the end
    /// markers arrive, else from this thread on a timeout or when the interpreter exits). An
    /// error means the run did not start and `reply` is not called.
    pub fn run(
        &self,
        id: u64,
        input: &str,
        timeout_ms: Option<u64>,
        reply: Reply,
    ) -> Result<(), SessionError> {
        if input.len() > MAX_INPUT {
            return Err(SessionError::InputTooLarge);
        }
        let session = lock(&self.map)
            .get(&id)
            .cloned()
            .ok_or(SessionError::NotFound(id))?;
        let mut s = lock(&session);
        if s.slot.get().is_some() || lock(&s.shared.state).ended {
            drop(s);
            lock(&self.map).remove(&id);
            return Err(SessionError::NotFound(id));
        }
        s.runs += 1;
        let nonce = RandomState::new().hash_one((id, s.runs, Instant::now()));
        let marker = format!("__DSEC_{id}_{}_{nonce:016x}__", s.runs);
        let text = match s.kind {
            SessionKind::Shell => format!(
                "eval \"$(cat <<'{marker}IN'\n{input}\n{marker}IN\n)\"\n__dsec_rc=$?; printf '%s%d%s\\n' '{marker}' \"$__dsec_rc\" '{marker}'; printf '%s\\n' '{marker}' >&2\n"
            ),
            SessionKind::Python => {
                let mut line = serde_json::json!({ "code": input, "marker": marker }).to_string();
                line.push('\n');
                line
            }
        };
        let started = Instant::now();
        lock(&s.shared.state).active = Some(ActiveRun {
            out: Scan::new(&marker, true),
            err: Scan::new(&marker, false),
            started,
            reply,
        });
        let queued = match &s.pipe {
            Some(pipe) => s.feed.push_direct(text.as_bytes(), pipe),
            None => s.feed.push(text.as_bytes(), false).map(|()| true),
        };
        match queued {
            Ok(true) => s.slot.wake(),
            Ok(false) => {}
            Err(_) => {
                lock(&s.shared.state).active = None;
                drop(s);
                lock(&self.map).remove(&id);
                return Err(SessionError::NotFound(id));
            }
        }
        // Watch the run: the pump answers it, unless the deadline passes or the session ends.
        let deadline = timeout_ms.map(|ms| started + Duration::from_millis(ms));
        let shared = Arc::clone(&s.shared);
        let mut st = lock(&shared.state);
        let (run, timed_out) = loop {
            if st.active.is_none() {
                return Ok(());
            }
            if st.ended {
                break (st.active.take(), false);
            }
            let wait = deadline.map_or(Duration::from_secs(3600), |d| {
                d.saturating_duration_since(Instant::now())
            });
            if deadline.is_some_and(|d| Instant::now() >= d) {
                break (st.active.take(), true);
            }
            st = match shared.changed.wait_timeout(st, wait) {
                Ok((g, _)) => g,
                Err(poisoned) => poisoned.into_inner().0,
            };
        };
        drop(st);
        let Some(run) = run else {
            return Ok(());
        };
        let (mut res, reply) = run.result();
        let _ = proc::killpg(s.pid, SIGKILL);
        let exit = s.slot.wait(Duration::from_secs(5));
        drop(s);
        lock(&self.map).remove(&id);
        if timed_out {
            res.status = ExecStatus::Timeout;
            res.exit_code = None;
            res.signal = Some(SIGKILL);
        } else {
            match exit.map(|e| e.status) {
                Some(WaitStatus::Exited(c)) => res.exit_code = Some(c),
                Some(WaitStatus::Signaled(sig)) => {
                    res.exit_code = None;
                    res.signal = Some(sig);
                }
                None => {}
            }
            res.status = status_of(res.exit_code);
        }
        reply(res);
        Ok(())
    }
}

/// Scans one stream for the end marker, capturing what precedes it.
struct Scan {
    marker: Vec<u8>,
    with_rc: bool,
    pending: Vec<u8>,
    cap: Capture,
    done: bool,
    rc: Option<i32>,
}

impl Scan {
    fn new(marker: &str, with_rc: bool) -> Self {
        Self {
            marker: marker.as_bytes().to_vec(),
            with_rc,
            pending: Vec::new(),
            cap: Capture::new(DEFAULT_OUTPUT_LIMIT),
            done: false,
            rc: None,
        }
    }

    fn push(&mut self, b: &[u8]) {
        if self.done {
            return;
        }
        self.pending.extend_from_slice(b);
        if let Some(pos) = find(&self.pending, &self.marker) {
            let after = &self.pending[pos + self.marker.len()..];
            if self.with_rc {
                let Some(end) = find(after, &self.marker) else {
                    self.keep_before(pos);
                    return;
                };
                self.rc = std::str::from_utf8(&after[..end])
                    .ok()
                    .and_then(|t| t.parse().ok());
            }
            self.cap.push(&self.pending[..pos]);
            self.pending.clear();
            self.done = true;
            return;
        }
        // Keep a tail that could be the start of a marker.
        let keep = self.marker.len().min(self.pending.len());
        let cut = self.pending.len() - keep;
        self.cap.push(&self.pending[..cut]);
        self.pending.drain(..cut);
    }

    fn keep_before(&mut self, pos: usize) {
        self.cap.push(&self.pending[..pos]);
        self.pending.drain(..pos);
        // Bound what we keep while waiting for the rest of the marker line.
        if self.pending.len() > self.marker.len() * 2 + 32 {
            self.pending.clear();
            self.done = true;
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || hay.len() < needle.len() {
        return None;
    }
    hay.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scan_splits_marker_across_chunks() {
        let mut s = Scan::new("MARK", true);
        for piece in [&b"hello\nMA"[..], b"RK4", b"2MA", b"RK\n"] {
            s.push(piece);
        }
        assert!(s.done);
        assert_eq!(s.rc, Some(42));
        assert_eq!(s.cap.finish().data, b"hello\n");
    }
}
