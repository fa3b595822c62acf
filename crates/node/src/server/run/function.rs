//! The function substrate: pre-warmed interpreters (zygotes) in pooled container sandboxes of
//! the node. A call goes to a zygote's pre-forked child over the agent's session protocol; a
//! zygote that dies or is tainted is reset and reloaded off the call path; long calls are
//! demoted to the lowest CPU weight.

use crate::lifecycle::Entry;
use crate::sandbox::Limits;
use crate::server::error::{ApiError, ApiResult};
use base64::Engine as _;
use dsec_api::agent::{Event, Request as AgentReq, SessionKind};
use dsec_api::exec::{ExecResult, ExecStatus};
use dsec_api::ErrorCode;
use serde::Deserialize;
use serde_json::json;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::request::RunSpec;
use super::{
    agent_call, runner_sandbox_with, PhaseResult, RunOutcome, Runner, Substrate, Verdict, B64,
};

pub(super) const ZYGOTE: &str = include_str!("zygote.py");
/// A call whose zygote sandbox has used this much CPU time since the call began is a long one
/// (a short call uses ~1–2 ms): it lets a waiting call start (or take) one more zygote, up to
/// `zygotes_max`, and its zygote sandbox runs at the batch CPU weight until it ends. The
/// CPU time is checked every `LONG_CALL` of wall time, and a call waiting behind long ones
/// checks this often whether it may pass. CPU time, not wall time: with 32 calls in flight on
/// 2 CPUs a short call spends 25–40 ms waiting for a CPU, and taking those for long ones
/// demoted them to weight 1 (where they waited longer still) and let waiting calls pass the
/// queue into new zygotes.
pub(super) const LONG_CALL: Duration = Duration::from_millis(25);
/// A warm zygote: a sandbox of the `run` tenant and its Python session with the dispatcher
/// loaded.
#[derive(Debug)]
pub(super) struct Zygote {
    entry: Arc<Entry>,
    session: u64,
    /// When it last went back to the idle queue.
    idle_since: Instant,
}

/// One template's zygotes.
#[derive(Debug)]
pub(super) struct ZygotePool {
    /// Set once the background start of the template's other zygotes began.
    filling: AtomicBool,
    /// Least recently used first: its next child has had the longest to get ready.
    idle: Mutex<VecDeque<Zygote>>,
    /// One per warm zygote (`zygotes`): a call holds one while it runs.
    slots: Arc<tokio::sync::Semaphore>,
    /// One per zygote beyond the warm ones (`zygotes_max - zygotes`), taken only by a call
    /// that waits behind long ones (see `permit`). Every zygote is made by a call (or the
    /// background start) holding a permit of either, and only when none is idle, so there are
    /// never more zygotes than permits.
    burst: Arc<tokio::sync::Semaphore>,
    /// The burst permits there are.
    burst_max: usize,
    /// Each call holding a permit, by call number: whether it is a long one (it has used
    /// [`LONG_CALL`] of CPU time).
    running: Mutex<HashMap<u64, bool>>,
    next_call: AtomicU64,
    /// Calls waiting for a permit: a newcomer does not take a burst permit past them.
    waiting: AtomicU64,
}

/// A call's hold on a zygote of the pool: a warm or burst permit, and its entry in `running`.
pub(super) struct CallPermit {
    pool: Arc<ZygotePool>,
    id: u64,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl Drop for CallPermit {
    fn drop(&mut self) {
        self.pool
            .running
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.id);
    }
}

impl ZygotePool {
    /// A pool that keeps `zygotes` warm and may start `burst` more under load.
    pub(super) fn new(zygotes: usize, burst: usize) -> Self {
        Self {
            filling: AtomicBool::new(false),
            idle: Mutex::new(VecDeque::new()),
            slots: Arc::new(tokio::sync::Semaphore::new(zygotes)),
            burst: Arc::new(tokio::sync::Semaphore::new(burst)),
            burst_max: burst,
            running: Mutex::new(HashMap::new()),
            next_call: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
        }
    }

    /// Returns a ready zygote to the back of the queue.
    fn put(&self, mut z: Zygote) {
        z.idle_since = Instant::now();
        self.idle
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back(z);
    }

    /// A permit to run one call: a warm slot (first come, first served), or, while long calls
    /// (see [`LONG_CALL`]) outnumber the burst permits in use, a burst one (checked at once
    /// when nobody waits, and every `LONG_CALL` of waiting). Short calls never count as long,
    /// however long they wait for a CPU, so they queue for the warm zygotes; each long one
    /// lets one waiting call past it.
    async fn permit(self: &Arc<Self>) -> ApiResult<CallPermit> {
        let now = Arc::clone(&self.slots)
            .try_acquire_owned()
            .ok()
            .or_else(|| {
                (self.waiting.load(Ordering::Acquire) == 0)
                    .then(|| self.try_burst())
                    .flatten()
            });
        let permit = match now {
            Some(p) => p,
            None => {
                self.waiting.fetch_add(1, Ordering::AcqRel);
                let _waiting = Waiting(&self.waiting);
                let slot = Arc::clone(&self.slots).acquire_owned();
                tokio::pin!(slot);
                loop {
                    tokio::select! {
                        p = &mut slot => break p.map_err(|_| ApiError::internal("runner closed"))?,
                        () = tokio::time::sleep(LONG_CALL) => {}
                    }
                    if let Some(p) = self.try_burst() {
                        break p;
                    }
                }
            }
        };
        let id = self.next_call.fetch_add(1, Ordering::Relaxed);
        self.running
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, false);
        Ok(CallPermit {
            pool: Arc::clone(self),
            id,
            _permit: permit,
        })
    }

    /// A burst permit, if long calls outnumber the burst permits in use.
    fn try_burst(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        let running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        let long = running.values().filter(|long| **long).count();
        let in_use = self.burst_max - self.burst.available_permits();
        if long <= in_use {
            return None;
        }
        Arc::clone(&self.burst).try_acquire_owned().ok()
    }

    /// Marks call `id` a long one.
    fn mark_long(&self, id: u64) {
        if let Some(long) = self
            .running
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(&id)
        {
            *long = true;
        }
    }

    /// Idle zygotes beyond the `keep` most recently used, unused for `after`.
    fn retire(&self, keep: usize, after: Duration) -> Vec<Zygote> {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = Vec::new();
        while idle.len() > keep
            && idle
                .front()
                .is_some_and(|z| z.idle_since.elapsed() >= after)
        {
            out.extend(idle.pop_front());
        }
        out
    }

    /// The least recently used ready zygote.
    fn take(&self) -> Option<Zygote> {
        self.idle
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop_front()
    }
}

/// Counts a waiting call out when it stops waiting (with a permit, or cancelled).
struct Waiting<'a>(&'a AtomicU64);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Holds a zygote sandbox whose call has used `LONG_CALL` of CPU time at the batch CPU weight
/// (`lifecycle::cpu_share`), and releases it when the call ends. Short calls (all but
/// abusive or heavy ones) never pay the two cgroup writes; long ones — a snippet spinning to its
/// time limit — yield the CPU to short calls in other zygotes, whose every hand-off would
/// otherwise wait for a spinner's time slice.
pub(super) struct LongCall {
    state: Arc<Mutex<Watch>>,
    timer: tokio::task::JoinHandle<()>,
    app: Arc<Runner>,
    entry: Arc<Entry>,
}

/// Where a [`LongCall`] is.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Watch {
    Running,
    Demoted,
    Ended,
}

impl LongCall {
    fn watch(app: &Arc<Runner>, e: &Arc<Entry>, permit: &CallPermit) -> Self {
        let state = Arc::new(Mutex::new(Watch::Running));
        let (app2, id, st) = (Arc::clone(app), e.id.clone(), Arc::clone(&state));
        let (pool, call) = (Arc::clone(&permit.pool), permit.id);
        let timer = tokio::spawn(async move {
            let cpu = |id: &str| app2.node.rt.cgroups().open(id)?.cpu_usage_ns();
            let base = cpu(&id);
            loop {
                tokio::time::sleep(LONG_CALL).await;
                // Without CPU accounting, wall time decides (as before).
                let used = match (base, cpu(&id)) {
                    (Some(b), Some(now)) => Duration::from_nanos(now.saturating_sub(b)),
                    _ => LONG_CALL,
                };
                if used >= LONG_CALL {
                    break;
                }
            }
            pool.mark_long(call);
            let mut st = st.lock().unwrap_or_else(|p| p.into_inner());
            if *st == Watch::Running && app2.node.cpu_shares.hold(&app2.node, &id) {
                *st = Watch::Demoted;
            }
        });
        Self {
            state,
            timer,
            app: Arc::clone(app),
            entry: Arc::clone(e),
        }
    }

    /// Ends the watch; true when the call was a long one. Its zygote stays in the batch class
    /// until [`release`](Self::release): what the call left (a fork bomb's processes, code
    /// still spinning until the sweep) runs there, not beside other tenants' calls.
    fn end(&self) -> bool {
        self.timer.abort();
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let long = *st == Watch::Demoted;
        if !long {
            *st = Watch::Ended;
        }
        long
    }

    /// Gives the zygote its own CPU class back, once what the call left is swept or the
    /// zygote is gone.
    fn release(self) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if *st == Watch::Demoted {
            self.app
                .node
                .cpu_shares
                .release(&self.app.node, &self.entry.id);
        }
        *st = Watch::Ended;
    }
}

/// Opens the Python session in `e` and loads the dispatcher into it.
pub(super) async fn start_zygote(app: &Arc<Runner>, e: Arc<Entry>) -> ApiResult<Zygote> {
    let ev = agent_call(
        app,
        &e,
        AgentReq::SessionOpen {
            kind: SessionKind::Python,
            env: BTreeMap::new(),
            cwd: Some("/".into()),
        },
        Vec::new(),
        Some(Duration::from_secs(30)),
    )
    .await?;
    let Event::SessionOpened { session } = ev else {
        return Err(ApiError::internal(format!("unexpected {ev:?}")));
    };
    let preload = serde_json::to_string(&app.cfg.preload).unwrap_or_else(|_| "[]".into());
    let input = format!("{ZYGOTE}\n_dsec_init({preload}, True)\n");
    let ev = agent_call(
        app,
        &e,
        AgentReq::SessionRun {
            session,
            input,
            timeout_ms: Some(60_000),
        },
        Vec::new(),
        Some(Duration::from_secs(60)),
    )
    .await?;
    match ev {
        Event::ExecDone(r) if r.exit_code == Some(0) => Ok(Zygote {
            entry: e,
            session,
            idle_since: Instant::now(),
        }),
        Event::ExecDone(r) => Err(ApiError::internal(format!(
            "the zygote did not start: {}",
            String::from_utf8_lossy(&r.stderr.data)
        ))),
        other => Err(ApiError::internal(format!("unexpected {other:?}"))),
    }
}

pub(super) async fn new_zygote(app: &Arc<Runner>, template: &str) -> ApiResult<Zygote> {
    let limits = Limits {
        pids_max: app.cfg.pids_max,
        ..Limits::default()
    };
    let runner: &Runner = app;
    let userns = runner.cfg.userns && !runner.userns_failed.load(Ordering::Relaxed);
    let e = match runner_sandbox_with(app, template, limits.clone(), userns).await {
        Err(err) if userns => {
            let e = runner_sandbox_with(app, template, limits, false).await?;
            if !runner.userns_failed.swap(true, Ordering::Relaxed) {
                tracing::warn!(error = %err.detail, "zygote sandboxes run without a user namespace: a call's process limit \
                     is then checked only after its forks are copied");
            }
            e
        }
        other => other?,
    };
    match start_zygote(app, Arc::clone(&e)).await {
        Ok(z) => Ok(z),
        Err(err) => {
            let _ = app.node.destroy(&e).await;
            Err(err)
        }
    }
}

/// Returns a zygote to the idle queue once its driver has swept what the last call left and
/// forked the next spare: the session runs one more (empty) input only after that. A zygote
/// that does not answer within 30 s is replaced.
/// `long` (the call's watch) gives the zygote its CPU class back once the sweep is done.
pub(super) async fn settle_zygote(
    app: Arc<Runner>,
    pool: Arc<ZygotePool>,
    z: Zygote,
    long: LongCall,
) {
    let ev = agent_call(
        &app,
        &z.entry,
        AgentReq::SessionRun {
            session: z.session,
            input: "None".to_owned(),
            timeout_ms: Some(30_000),
        },
        Vec::new(),
        Some(Duration::from_secs(35)),
    )
    .await;
    match ev {
        Ok(Event::ExecDone(r)) if r.exit_code == Some(0) => {
            long.release();
            pool.put(z);
        }
        _ => recycle_zygote(app, pool, z, Some(long)).await,
    }
}

/// Replaces a zygote that died or was tainted: the sandbox is reset (every process killed, a
/// fresh writable layer) and a new session loaded; on failure it is destroyed.
/// A long call's watch (`long`) gives the zygote its CPU class back once the reset killed what
/// the call left.
pub(super) async fn recycle_zygote(
    app: Arc<Runner>,
    pool: Arc<ZygotePool>,
    z: Zygote,
    long: Option<LongCall>,
) {
    let e = z.entry;
    let reset = app.node.reset(&e).await;
    if let Some(long) = long {
        long.release();
    }
    let again = match reset {
        Ok(_) => start_zygote(&app, Arc::clone(&e)).await,
        Err(err) => Err(err.into()),
    };
    match again {
        Ok(z) => pool.put(z),
        Err(err) => {
            tracing::warn!(sandbox = %e.id, error = %err.detail, "zygote replacement failed");
            let _ = app.node.destroy(&e).await;
        }
    }
}

/// The zygote's answer line.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(super) enum ZygoteAnswer {
    /// The zygote is tainted and ran nothing (`{"refused": true}`).
    Refused {
        refused: bool,
    },
    Ran(Ran),
}

/// A call's result.
#[derive(Debug, Deserialize)]
pub(super) struct Ran {
    verdict: Verdict,
    rc: Option<i32>,
    out: String,
    err: String,
    t: f64,
    kb: u64,
    files: BTreeMap<String, String>,
}

pub(super) fn lossy_b64(s: &str) -> String {
    B64.decode(s.as_bytes())
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default()
}

/// Starts zygotes in the background until the template has its `zygotes`: calls rotate over
/// them (least recently used first), so each one's next child is forked and warm before its
/// next call even at concurrency 1.
pub(super) fn fill_zygotes(app: &Arc<Runner>, template: &str, pool: &Arc<ZygotePool>) {
    if pool.filling.swap(true, Ordering::AcqRel) {
        return;
    }
    // Zygotes started for a burst of long calls go again once unused for a while.
    let (app2, pool2) = (Arc::clone(app), Arc::clone(pool));
    tokio::spawn(async move {
        loop {
            let cfg = &app2.cfg;
            tokio::time::sleep(cfg.retire_after / 4).await;
            for z in pool2.retire(cfg.zygotes, cfg.retire_after) {
                let _ = app2.node.destroy(&z.entry).await;
            }
        }
    });
    let (app, pool, template) = (Arc::clone(app), Arc::clone(pool), template.to_owned());
    tokio::spawn(async move {
        for _ in 1..app.cfg.zygotes {
            let Ok(permit) = Arc::clone(&pool.slots).try_acquire_owned() else {
                break;
            };
            match new_zygote(&app, &template).await {
                Ok(z) => pool.put(z),
                Err(err) => {
                    tracing::warn!(
                        template = %template,
                        error = %err.detail,
                        "zygote start failed",
                    );
                    break;
                }
            }
            drop(permit);
        }
    });
}

/// The call a zygote's driver reads: the JSON of the program, its input and limits, as a
/// Python string literal.
fn call_literal(spec: &RunSpec, warm: bool) -> String {
    let files: BTreeMap<&str, String> = spec
        .files
        .iter()
        .map(|(p, d)| (p.as_str(), B64.encode(d)))
        .collect();
    let timeout = spec.run_timeout.as_secs_f64();
    let req = json!({
        "code": spec.program.code,
        "stdin": B64.encode(&spec.stdin),
        "files": files,
        "fetch": spec.fetch,
        "timeout": timeout,
        "cpu": (timeout.ceil() as u64).max(1),
        "mem": spec.memory_bytes.unwrap_or(0),
        "cap": spec.output_limit,
        "warm": warm,
    })
    .to_string();
    serde_json::to_string(&req).unwrap_or_default()
}

pub(super) async fn run_function(app: &Arc<Runner>, spec: &RunSpec) -> ApiResult<RunOutcome> {
    let pool = app.zygote_pool(&spec.template);
    // Warm the zygote's next child only while the node has idle zygotes (spare CPU).
    let literal = call_literal(spec, pool.slots.available_permits() > 1);
    let budget = spec.run_timeout + Duration::from_secs(10);
    // A zygote whose sweep found a pre-existing file changed refuses its next call: it is
    // replaced and the call goes to another one (the last try to a new one).
    for attempt in 0..3 {
        let permit = pool.permit().await?;
        let idle = match attempt {
            2 => None,
            _ => pool.take(),
        };
        let z = match idle {
            Some(z) => z,
            None => {
                let z = new_zygote(app, &spec.template).await?;
                fill_zygotes(app, &spec.template, &pool);
                z
            }
        };
        let long = LongCall::watch(app, &z.entry, &permit);
        let ev = agent_call(
            app,
            &z.entry,
            AgentReq::SessionRun {
                session: z.session,
                input: format!("_dsec_call({literal})"),
                timeout_ms: Some(budget.as_millis() as u64),
            },
            Vec::new(),
            Some(budget + Duration::from_secs(5)),
        )
        .await;
        let was_long = long.end();
        let answer = match &ev {
            Ok(Event::ExecDone(r)) if r.exit_code == Some(0) => {
                let line = String::from_utf8_lossy(&r.stdout.data);
                serde_json::from_str::<ZygoteAnswer>(line.trim()).ok()
            }
            _ => None,
        };
        if matches!(answer, Some(ZygoteAnswer::Ran(_))) {
            if was_long {
                // What a long call leaves (a fork bomb's processes, say) is swept after its
                // answer; the zygote goes back to the idle queue only once that is done, so
                // that the next call does not wait for it.
                let (app2, pool2) = (Arc::clone(app), Arc::clone(&pool));
                tokio::spawn(async move {
                    settle_zygote(app2, pool2, z, long).await;
                    drop(permit);
                });
            } else {
                long.release();
                pool.put(z);
                drop(permit);
            }
        } else {
            // The slot stays taken until the replacement is ready.
            let (app2, pool2) = (Arc::clone(app), Arc::clone(&pool));
            tokio::spawn(async move {
                recycle_zygote(app2, pool2, z, Some(long)).await;
                drop(permit);
            });
        }
        if answer.is_none() {
            match &ev {
                Ok(Event::ExecDone(r)) => {
                    if let Some(outcome) = runtime_killed_by_the_call(r) {
                        return Ok(outcome);
                    }
                }
                // The zygote's sandbox was gone (its supervisor killed from the host, say) or
                // its agent's connection closed: the sandbox, and with it whatever the call
                // reached, is gone, so the call goes to another zygote (the last try to a new
                // one) instead of failing on a node fault.
                Err(err)
                    if attempt < 2
                        && matches!(
                            err.code,
                            ErrorCode::SandboxNotFound | ErrorCode::AgentUnavailable
                        ) =>
                {
                    continue;
                }
                _ => {}
            }
        }
        let a = match answer {
            Some(ZygoteAnswer::Ran(a)) => a,
            Some(ZygoteAnswer::Refused { refused: true }) => continue,
            _ => {
                let why = match ev {
                    Ok(Event::ExecDone(r)) => format!(
                        "the zygote ended the call abnormally ({:?}): {}",
                        r.status,
                        String::from_utf8_lossy(&r.stderr.data)
                            .chars()
                            .take(500)
                            .collect::<String>()
                    ),
                    Ok(other) => format!("unexpected {other:?}"),
                    Err(e) => e.detail,
                };
                return Err(ApiError::new(ErrorCode::AgentUnavailable, why));
            }
        };
        let run = PhaseResult {
            status: a.verdict,
            exit_code: a.rc,
            stdout: lossy_b64(&a.out),
            stderr: lossy_b64(&a.err),
            execution_time: a.t,
            memory_kb: a.kb,
        };
        return Ok(RunOutcome {
            status: if run.status == Verdict::Finished {
                "Success"
            } else {
                "Failed"
            },
            compile_result: None,
            run_result: Some(run),
            files: a.files,
            substrate: Substrate::Function,
            server_us: 0,
            clamped: BTreeMap::new(),
        });
    }
    Err(ApiError::new(
        ErrorCode::AgentUnavailable,
        "three zygotes in a row refused the call or were gone",
    ))
}

/// The outcome of a call during which the zygote's session (the driver) was killed by a
/// signal. While a call runs, only its code can do that — it may signal every process of the
/// sandbox it can see (they run as one uid), or fill the sandbox's memory until the OOM killer
/// picks one — so it is the call's result (`RuntimeError`, or `MemoryLimitExceeded` for the
/// OOM killer), not a node error: SandboxFusion's clients retry a `SandboxError`, which would
/// run the same code again. The zygote is replaced either way. `None` when the session ended
/// otherwise (a driver fault, a lost agent): that stays an error.
pub(super) fn runtime_killed_by_the_call(r: &ExecResult) -> Option<RunOutcome> {
    let status = match r.status {
        ExecStatus::Killed => Verdict::RuntimeError,
        ExecStatus::Oom => Verdict::MemoryLimitExceeded,
        _ => return None,
    };
    // SIGKILL when the agent reported none.
    let signal = r.signal.unwrap_or(9);
    let run = PhaseResult {
        status,
        exit_code: Some(-signal),
        stdout: String::new(),
        stderr: format!(
            "the call ended the sandbox's Python runtime (its driver was killed by signal \
             {signal}); the runtime has been replaced\n"
        ),
        execution_time: r.wall_us as f64 / 1e6,
        memory_kb: r.peak_rss_kb,
    };
    Some(RunOutcome {
        status: "Failed",
        compile_result: None,
        run_result: Some(run),
        files: BTreeMap::new(),
        substrate: Substrate::Function,
        server_us: 0,
        clamped: BTreeMap::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_call_that_waited_for_a_cpu_is_not_a_long_one() {
        let pool = Arc::new(ZygotePool::new(1, 1));
        let Ok(held) = pool.permit().await else {
            panic!("no permit")
        };
        // Past LONG_CALL by the clock, but no CPU time counted: not long, no burst permit.
        std::thread::sleep(LONG_CALL * 2);
        assert!(pool.try_burst().is_none());
        pool.mark_long(held.id);
        assert!(pool.try_burst().is_some());
    }

    #[tokio::test]
    async fn a_newcomer_does_not_pass_a_waiting_call() {
        let pool = Arc::new(ZygotePool::new(1, 1));
        let Ok(held) = pool.permit().await else {
            panic!("no permit")
        };
        let pool2 = Arc::clone(&pool);
        let first = tokio::spawn(async move { pool2.permit().await.map(|p| p.id) });
        while pool.waiting.load(Ordering::Acquire) == 0 {
            tokio::task::yield_now().await;
        }
        pool.mark_long(held.id);
        // The burst permit the long call frees up goes to the call that waited, not to one
        // that arrives after it.
        let late = tokio::time::timeout(Duration::from_millis(1), pool.permit()).await;
        assert!(late.is_err());
        let Ok(Ok(id)) = first.await else {
            panic!("the first caller got no permit")
        };
        assert_eq!(id, held.id + 1);
    }
}
