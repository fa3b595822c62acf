//! The code runner: `POST /v1/run`, `POST /v1/run/batch`, `GET /v1/languages`, and
//! SandboxFusion's `POST /run_code` and `GET /v1/ping` (see `docs/api.md`, "Code runner").
//!
//! Python runs on the function substrate: a pool of container sandboxes per template, each with
//! a persistent Python session (the real `/usr/bin/python3`) into which `zygote.py` is loaded
//! once. A call is one session input that forks a limited child from the zygote (see the
//! script). Every other language (and Python with `substrate: "container"`) runs in a pooled
//! container sandbox with a compile and a run phase; the sandbox is reset before it is reused.
//!
//! Sandboxes of the runner belong to the internal `run` tenant; they are counted against the
//! node's `--max-sandboxes` like any other.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine as _;
use dsec_api::agent::{Event, Request as AgentReq, SessionKind};
use dsec_api::exec::{ExecRequest, ExecResult, ExecStatus};
use dsec_api::ErrorCode;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::app::{App, CreateRequest, Entry};
use super::error::{ApiError, ApiResult};
use super::log;
use super::store::Tenant;
use crate::sandbox::Limits;

mod container;
mod fusion;
mod lang;
mod request;

pub use fusion::run_code;
pub use request::{BadRun, MAX_MEMORY_MB, MAX_TIMEOUT_S};
use request::{Fields, RunSpec};

const ZYGOTE: &str = include_str!("zygote.py");
const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

/// Most bytes of files sent with one run (decoded).
pub const MAX_FILES_BYTES: usize = 16 << 20;
/// Most files sent or fetched with one run.
pub const MAX_FILES: usize = 256;
/// Longest code accepted.
pub const MAX_CODE: usize = 1 << 20;
/// Default and largest output kept per stream on the function substrate (its answer travels
/// base64-encoded inside the session's 1 MiB capture).
pub const FUNCTION_OUTPUT_MAX: u64 = 256 << 10;
/// Most items in one batch.
pub const MAX_BATCH: usize = 1000;
/// Runs the anonymous tenant may have in flight at once.
pub const ANONYMOUS_CONCURRENCY: usize = 8;
/// A call that has held its zygote this long is a long one (a short call takes ~1–2 ms, a
/// few more under load): it lets a waiting call start (or take) one more zygote, up to
/// `zygotes_max`, and its zygote sandbox runs at [`LONG_CALL_CPU_WEIGHT`] until it ends. A
/// call waiting behind long ones checks this often whether it may pass.
const LONG_CALL: Duration = Duration::from_millis(25);
/// Where the container substrate puts a run's files.
const WORKDIR: &str = "/tmp/dsec-run";

/// Settings of the runner.
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// Modules the Python zygote imports once (failures ignored).
    pub preload: Vec<String>,
    /// Zygotes (function-substrate sandboxes) each template keeps warm.
    pub zygotes: usize,
    /// Most zygotes per template: more than `zygotes` start only while calls wait (long calls
    /// hold the warm ones), and go again after `retire_after` unused.
    pub zygotes_max: usize,
    /// How long a zygote beyond the warm ones stays idle before it is destroyed.
    pub retire_after: Duration,
    /// `pids.max` of each zygote sandbox: the agent, driver and zygote take 6 tasks, the call
    /// (its processes and threads) the rest. Lower than a sandbox's default (256) because a
    /// fork bomb's cost to other tenants grows with it: every fork, failed ones included (the
    /// pids controller refuses a fork only after its address space is copied), and every exit
    /// takes the write lock of each shared file it maps (the interpreter, libc), the same
    /// files every Python process of the node maps.
    pub pids_max: u64,
    /// Run zygote sandboxes in a user namespace (root inside is an unprivileged host uid), so
    /// that their `RLIMIT_NPROC` ([`crate::sandbox::Limits::nproc`], set at launch and
    /// inherited by the zygote and each call) applies: the kernel checks it before copying the
    /// address space (the pids controller after), and not at all for uid 0 of the initial user
    /// namespace.
    pub userns: bool,
    /// Serve the run endpoints without an API key (as the `anonymous` tenant).
    pub anonymous: bool,
    /// The template of a run that names none.
    pub template: String,
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            preload: [
                "math",
                "json",
                "re",
                "collections",
                "itertools",
                "functools",
                "heapq",
                "bisect",
                "string",
                "random",
                "typing",
                "fractions",
                "decimal",
                "datetime",
            ]
            .iter()
            .map(|s| (*s).to_owned())
            .collect(),
            zygotes: 4,
            zygotes_max: 32,
            retire_after: Duration::from_secs(30),
            pids_max: 64,
            userns: true,
            anonymous: false,
            template: "host".to_owned(),
        }
    }
}

/// Where a run goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Substrate {
    /// A forked child of a warm zygote (Python only).
    Function,
    /// A fresh process in a pooled container sandbox.
    Container,
}

/// The verdict of one phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Verdict {
    /// Ran to its end (any exit code 0).
    Finished,
    /// Wall or CPU limit passed.
    TimeLimitExceeded,
    /// Memory limit hit.
    MemoryLimitExceeded,
    /// Exited non-zero or was killed by a signal.
    RuntimeError,
    /// Wrote more than the output limit.
    OutputLimitExceeded,
}

/// One phase (compile or run).
#[derive(Debug, Clone, Serialize)]
pub struct PhaseResult {
    /// Verdict.
    pub status: Verdict,
    /// Exit code (negative: killed by that signal).
    pub exit_code: Option<i32>,
    /// Standard output (lossy UTF-8).
    pub stdout: String,
    /// Standard error (lossy UTF-8).
    pub stderr: String,
    /// Wall time, seconds.
    pub execution_time: f64,
    /// Peak resident memory, KiB.
    pub memory_kb: u64,
}

/// What a run produced.
#[derive(Debug, Clone, Serialize)]
pub struct RunOutcome {
    /// `Success` when every phase finished with exit code 0, else `Failed`.
    pub status: &'static str,
    /// The compile phase, for compiled languages.
    pub compile_result: Option<PhaseResult>,
    /// The run phase (absent when compiling failed).
    pub run_result: Option<PhaseResult>,
    /// Fetched files, base64.
    pub files: BTreeMap<String, String>,
    /// Which substrate ran it.
    pub substrate: Substrate,
    /// Time the node spent on the run, microseconds.
    pub server_us: u64,
    /// Request fields whose value was outside the node's range, with the value applied
    /// (`run_timeout`, `compile_timeout`: at most [`MAX_TIMEOUT_S`], negative ones 0;
    /// `memory_limit_MB`: at most [`MAX_MEMORY_MB`]).
    pub clamped: BTreeMap<&'static str, f64>,
}

impl Serialize for Substrate {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(match self {
            Substrate::Function => "function",
            Substrate::Container => "container",
        })
    }
}

/// A warm zygote: a sandbox of the `run` tenant and its Python session with the dispatcher
/// loaded.
#[derive(Debug)]
struct Zygote {
    entry: Arc<Entry>,
    session: u64,
    /// When it last went back to the idle queue.
    idle_since: Instant,
}

/// One template's zygotes.
#[derive(Debug)]
struct ZygotePool {
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
    /// When each call holding a permit got it, by call number.
    running: Mutex<HashMap<u64, Instant>>,
    next_call: AtomicU64,
}

/// A call's hold on a zygote of the pool: a warm or burst permit, and its entry in `running`.
struct CallPermit {
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
    /// Returns a ready zygote to the back of the queue.
    fn put(&self, mut z: Zygote) {
        z.idle_since = Instant::now();
        self.idle
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back(z);
    }

    /// A permit to run one call: a warm slot, or, while calls that have run longer than
    /// `LONG_CALL` outnumber the burst permits in use, a burst one (checked at once and
    /// every `LONG_CALL` of waiting). Short calls never count as long, so they queue for the
    /// warm zygotes; each long one lets one waiting call past it.
    async fn permit(self: &Arc<Self>) -> ApiResult<CallPermit> {
        let now = Arc::clone(&self.slots)
            .try_acquire_owned()
            .ok()
            .or_else(|| self.try_burst());
        let permit = match now {
            Some(p) => p,
            None => {
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
            .insert(id, Instant::now());
        Ok(CallPermit {
            pool: Arc::clone(self),
            id,
            _permit: permit,
        })
    }

    /// A burst permit, if calls running longer than `LONG_CALL` outnumber the burst
    /// permits in use.
    fn try_burst(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        let running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        let long = running
            .values()
            .filter(|t| t.elapsed() >= LONG_CALL)
            .count();
        let in_use = self.burst_max - self.burst.available_permits();
        if long <= in_use {
            return None;
        }
        Arc::clone(&self.burst).try_acquire_owned().ok()
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

/// The runner's live state (one per node).
#[derive(Debug)]
pub struct Runner {
    cfg: RunConfig,
    tenant: Tenant,
    anonymous: Option<Tenant>,
    anonymous_slots: Arc<tokio::sync::Semaphore>,
    /// Run slots of tenants with a sandbox quota.
    tenant_slots: Mutex<HashMap<String, Arc<tokio::sync::Semaphore>>>,
    zygotes: Mutex<HashMap<String, Arc<ZygotePool>>>,
    containers: Mutex<HashMap<String, Vec<Arc<Entry>>>>,
    /// Toolchains found per template (probed once per template, in a sandbox of it).
    languages: Mutex<HashMap<String, Arc<tokio::sync::OnceCell<Vec<String>>>>>,
    /// Set when a zygote sandbox could be made without a user namespace but not with one
    /// (say, the run dir is not searchable by the unprivileged host uid): later ones go
    /// without.
    userns_failed: AtomicBool,
}

impl Runner {
    /// A runner whose sandboxes belong to `tenant`; `anonymous` serves keyless requests.
    pub fn new(cfg: RunConfig, tenant: Tenant, anonymous: Option<Tenant>) -> Self {
        Self {
            cfg,
            tenant,
            anonymous,
            anonymous_slots: Arc::new(tokio::sync::Semaphore::new(ANONYMOUS_CONCURRENCY)),
            tenant_slots: Mutex::new(HashMap::new()),
            zygotes: Mutex::new(HashMap::new()),
            containers: Mutex::new(HashMap::new()),
            languages: Mutex::new(HashMap::new()),
            userns_failed: AtomicBool::new(false),
        }
    }

    /// The tenant keyless run requests act as, when enabled.
    pub fn anonymous(&self) -> Option<&Tenant> {
        self.anonymous.as_ref()
    }

    /// The tenant that owns the runner's sandboxes.
    pub fn tenant(&self) -> &Tenant {
        &self.tenant
    }

    fn zygote_pool(&self, template: &str) -> Arc<ZygotePool> {
        let mut m = self.zygotes.lock().unwrap_or_else(|p| p.into_inner());
        Arc::clone(m.entry(template.to_owned()).or_insert_with(|| {
            let burst = self.cfg.zygotes_max.saturating_sub(self.cfg.zygotes.max(1));
            Arc::new(ZygotePool {
                filling: AtomicBool::new(false),
                idle: Mutex::new(VecDeque::new()),
                slots: Arc::new(tokio::sync::Semaphore::new(self.cfg.zygotes.max(1))),
                burst: Arc::new(tokio::sync::Semaphore::new(burst)),
                burst_max: burst,
                running: Mutex::new(HashMap::new()),
                next_call: AtomicU64::new(0),
            })
        }))
    }
}

/// `cpu.weight` of a zygote sandbox while its call has run longer than `LONG_CALL`.
const LONG_CALL_CPU_WEIGHT: u64 = 1;

/// Lowers the CPU weight of a zygote sandbox whose call runs longer than `LONG_CALL`
/// to [`LONG_CALL_CPU_WEIGHT`], and puts it back when the call ends. Short calls (all but
/// abusive or heavy ones) never pay the two cgroup writes; long ones — a snippet spinning to its
/// time limit — yield the CPU to short calls in other zygotes, whose every hand-off would
/// otherwise wait for a spinner's time slice.
struct LongCall {
    state: Arc<Mutex<Watch>>,
    timer: tokio::task::JoinHandle<()>,
    app: Arc<App>,
    entry: Arc<Entry>,
}

/// Where a [`LongCall`] is.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Watch {
    Running,
    Demoted,
    Ended,
}

impl LongCall {
    fn watch(app: &Arc<App>, e: &Arc<Entry>) -> Self {
        let state = Arc::new(Mutex::new(Watch::Running));
        let (app2, id, st) = (Arc::clone(app), e.id.clone(), Arc::clone(&state));
        let timer = tokio::spawn(async move {
            tokio::time::sleep(LONG_CALL).await;
            let mut st = st.lock().unwrap_or_else(|p| p.into_inner());
            if *st == Watch::Running && set_cpu_weight(&app2, &id, LONG_CALL_CPU_WEIGHT) {
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

    /// Ends the watch; true when the call was a long one.
    fn end(self) -> bool {
        self.timer.abort();
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let long = *st == Watch::Demoted;
        if long {
            let weight = self.entry.record().spec.limits.cpu_weight;
            set_cpu_weight(&self.app, &self.entry.id, weight);
        }
        *st = Watch::Ended;
        long
    }
}

/// Sets the `cpu.weight` of sandbox `id`'s cgroup; false when it is gone.
fn set_cpu_weight(app: &App, id: &str, weight: u64) -> bool {
    app.rt.cgroups().open(id).is_some_and(|cg| {
        cg.set_limits(&dsec_sys::cgroup::CgroupLimits {
            cpu_weight: Some(weight),
            ..Default::default()
        })
        .is_ok()
    })
}

/// Runs one agent request on a sandbox, holding it exclusively.
async fn agent_call(
    app: &Arc<App>,
    e: &Arc<Entry>,
    req: AgentReq,
    body: Vec<u8>,
    timeout: Option<Duration>,
) -> ApiResult<Event> {
    let _ = app;
    let mut guard = e.lock().await;
    // On this worker thread (tokio moves its other tasks to another one): a hand-off to the
    // blocking pool and back is a thread wake-up each way. Measured with the calls of `dsec
    // bench run` paced 5 ms apart, node side p50 1.24–1.63 ms against 1.57–1.73 ms.
    tokio::task::block_in_place(move || match guard.as_mut() {
        Some(sb) => Ok(sb.agent().call(&req, &body, timeout, |_, _| {})?.0),
        None => Err(ApiError::no_sandbox("")),
    })
}

async fn sandbox_exec(
    app: &Arc<App>,
    e: &Arc<Entry>,
    req: ExecRequest,
    stdin: Vec<u8>,
) -> ApiResult<ExecResult> {
    let mut guard = e.lock().await;
    let rt = Arc::clone(&app.rt);
    tokio::task::spawn_blocking(move || match guard.as_mut() {
        Some(sb) => sb
            .exec(&rt, &req, &stdin, |_, _| {})
            .map_err(ApiError::from),
        None => Err(ApiError::no_sandbox("")),
    })
    .await
    .map_err(|err| ApiError::internal(err.to_string()))?
}

/// A sandbox of the runner's tenant (from the template's pool when it has one).
async fn runner_sandbox(app: &Arc<App>, template: &str) -> ApiResult<Arc<Entry>> {
    runner_sandbox_with(app, template, Limits::default(), false).await
}

async fn runner_sandbox_with(
    app: &Arc<App>,
    template: &str,
    limits: Limits,
    userns: bool,
) -> ApiResult<Arc<Entry>> {
    let mut labels = BTreeMap::new();
    labels.insert("dsec.run".to_owned(), "1".to_owned());
    let rec = app
        .create(
            app.runner.tenant(),
            CreateRequest {
                template: template.to_owned(),
                labels,
                limits,
                userns,
                ..CreateRequest::default()
            },
        )
        .await?;
    app.entry(&rec.id)
        .ok_or_else(|| ApiError::internal("a runner sandbox vanished after its create"))
}

/// Opens the Python session in `e` and loads the dispatcher into it.
async fn start_zygote(app: &Arc<App>, e: Arc<Entry>) -> ApiResult<Zygote> {
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
    let preload = serde_json::to_string(&app.runner.cfg.preload).unwrap_or_else(|_| "[]".into());
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

async fn new_zygote(app: &Arc<App>, template: &str) -> ApiResult<Zygote> {
    let limits = Limits {
        pids_max: app.runner.cfg.pids_max,
        ..Limits::default()
    };
    let runner = &app.runner;
    let userns = runner.cfg.userns && !runner.userns_failed.load(Ordering::Relaxed);
    let e = match runner_sandbox_with(app, template, limits.clone(), userns).await {
        Err(err) if userns => {
            let e = runner_sandbox_with(app, template, limits, false).await?;
            if !runner.userns_failed.swap(true, Ordering::Relaxed) {
                log::warn(
                    "zygote sandboxes run without a user namespace: a call's process limit \
                     is then checked only after its forks are copied",
                    &[("error", &err.detail)],
                );
            }
            e
        }
        other => other?,
    };
    match start_zygote(app, Arc::clone(&e)).await {
        Ok(z) => Ok(z),
        Err(err) => {
            let _ = app.destroy(&e).await;
            Err(err)
        }
    }
}

/// Returns a zygote to the idle queue once its driver has swept what the last call left and
/// forked the next spare: the session runs one more (empty) input only after that. A zygote
/// that does not answer within 30 s is replaced.
async fn settle_zygote(app: Arc<App>, pool: Arc<ZygotePool>, z: Zygote) {
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
        Ok(Event::ExecDone(r)) if r.exit_code == Some(0) => pool.put(z),
        _ => recycle_zygote(app, pool, z).await,
    }
}

/// Replaces a zygote that died or was tainted: the sandbox is reset (every process killed, a
/// fresh writable layer) and a new session loaded; on failure it is destroyed.
async fn recycle_zygote(app: Arc<App>, pool: Arc<ZygotePool>, z: Zygote) {
    let e = z.entry;
    let again = match app.reset(&e).await {
        Ok(_) => start_zygote(&app, Arc::clone(&e)).await,
        Err(err) => Err(err),
    };
    match again {
        Ok(z) => pool.put(z),
        Err(err) => {
            log::warn(
                "zygote replacement failed",
                &[("sandbox", &e.id), ("error", &err.detail)],
            );
            let _ = app.destroy(&e).await;
        }
    }
}

/// The zygote's answer line.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum ZygoteAnswer {
    /// The zygote is tainted and ran nothing (`{"refused": true}`).
    Refused {
        refused: bool,
    },
    Ran(Ran),
}

/// A call's result.
#[derive(Debug, Deserialize)]
struct Ran {
    verdict: Verdict,
    rc: Option<i32>,
    out: String,
    err: String,
    t: f64,
    kb: u64,
    files: BTreeMap<String, String>,
}

fn lossy_b64(s: &str) -> String {
    B64.decode(s.as_bytes())
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default()
}

/// Starts zygotes in the background until the template has its `zygotes`: calls rotate over
/// them (least recently used first), so each one's next child is forked and warm before its
/// next call even at concurrency 1.
fn fill_zygotes(app: &Arc<App>, template: &str, pool: &Arc<ZygotePool>) {
    if pool.filling.swap(true, Ordering::AcqRel) {
        return;
    }
    // Zygotes started for a burst of long calls go again once unused for a while.
    let (app2, pool2) = (Arc::clone(app), Arc::clone(pool));
    tokio::spawn(async move {
        loop {
            let cfg = &app2.runner.cfg;
            tokio::time::sleep(cfg.retire_after / 4).await;
            for z in pool2.retire(cfg.zygotes, cfg.retire_after) {
                let _ = app2.destroy(&z.entry).await;
            }
        }
    });
    let (app, pool, template) = (Arc::clone(app), Arc::clone(pool), template.to_owned());
    tokio::spawn(async move {
        for _ in 1..app.runner.cfg.zygotes {
            let Ok(permit) = Arc::clone(&pool.slots).try_acquire_owned() else {
                break;
            };
            match new_zygote(&app, &template).await {
                Ok(z) => pool.put(z),
                Err(err) => {
                    log::warn(
                        "zygote start failed",
                        &[("template", &template), ("error", &err.detail)],
                    );
                    break;
                }
            }
            drop(permit);
        }
    });
}

async fn run_function(app: &Arc<App>, spec: &RunSpec) -> ApiResult<RunOutcome> {
    let pool = app.runner.zygote_pool(&spec.template);
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
        // Warm the zygote's next child only while the node has idle zygotes (spare CPU).
        "warm": pool.slots.available_permits() > 1,
    })
    .to_string();
    let literal = serde_json::to_string(&req).unwrap_or_default();
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
        let long = LongCall::watch(app, &z.entry);
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
                    settle_zygote(app2, pool2, z).await;
                    drop(permit);
                });
            } else {
                pool.put(z);
                drop(permit);
            }
        } else {
            // The slot stays taken until the replacement is ready.
            let (app2, pool2) = (Arc::clone(app), Arc::clone(&pool));
            tokio::spawn(async move {
                recycle_zygote(app2, pool2, z).await;
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
fn runtime_killed_by_the_call(r: &ExecResult) -> Option<RunOutcome> {
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

/// Whether `spec`'s template has its language's toolchain (Python always: the function
/// substrate needs it).
async fn available(app: &Arc<App>, spec: &RunSpec) -> ApiResult<bool> {
    if spec.lang.name == "python" {
        return Ok(true);
    }
    let have = languages(app, &spec.template).await?;
    Ok(have.iter().any(|l| l == spec.lang.name))
}

/// The outcome of a run one of whose phases has no time at all (a timeout of 0, or a
/// negative one clamped to it): that phase times out at once without running (SandboxFusion's
/// outcome for it too); a run phase after a compile phase that timed out does not run.
fn timed_out_at_once(spec: &RunSpec) -> Option<RunOutcome> {
    let tle = PhaseResult {
        status: Verdict::TimeLimitExceeded,
        exit_code: None,
        stdout: String::new(),
        stderr: String::new(),
        execution_time: 0.0,
        memory_kb: 0,
    };
    let (compile_result, run_result) =
        if spec.program.compile.is_some() && spec.compile_timeout.is_zero() {
            (Some(tle), None)
        } else if spec.run_timeout.is_zero() {
            (None, Some(tle))
        } else {
            return None;
        };
    Some(RunOutcome {
        status: "Failed",
        compile_result,
        run_result,
        files: BTreeMap::new(),
        substrate: spec.substrate,
        server_us: 0,
        clamped: spec.clamped.clone(),
    })
}

/// Runs a validated request whose toolchain is there.
async fn execute(app: &Arc<App>, spec: &RunSpec) -> ApiResult<RunOutcome> {
    let t0 = Instant::now();
    let mut out = match timed_out_at_once(spec) {
        Some(out) => out,
        None => match spec.substrate {
            Substrate::Function => run_function(app, spec).await?,
            Substrate::Container => container::run_container(app, spec).await?,
        },
    };
    out.server_us = t0.elapsed().as_micros() as u64;
    out.clamped = spec.clamped.clone();
    Ok(out)
}

/// Runs one request of the native API: a language whose toolchain the template lacks is an
/// `invalid_request`.
async fn run_one(app: &Arc<App>, spec: RunSpec) -> ApiResult<RunOutcome> {
    if !available(app, &spec).await? {
        return Err(ApiError::invalid(format!(
            "language {} is not available on template {} (no {} found)",
            spec.lang.name, spec.template, spec.lang.tool
        )));
    }
    execute(app, &spec).await
}

/// The languages whose toolchain is on `template` (probed once per template, in a sandbox of
/// it; a failed probe is not cached).
async fn languages(app: &Arc<App>, template: &str) -> ApiResult<Vec<String>> {
    let cell = Arc::clone(
        app.runner
            .languages
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(template.to_owned())
            .or_default(),
    );
    cell.get_or_try_init(|| async {
        let e = runner_sandbox(app, template).await?;
        let script = lang::probe_script();
        let r = sandbox_exec(
            app,
            &e,
            ExecRequest {
                cwd: Some("/".into()),
                ..container::shell_exec(script, Duration::from_secs(30), 1 << 16)
            },
            Vec::new(),
        )
        .await;
        let _ = app.destroy(&e).await;
        let r = r?;
        Ok(String::from_utf8_lossy(&r.stdout.data)
            .lines()
            .map(str::to_owned)
            .collect())
    })
    .await
    .cloned()
}

/// Holds one of the tenant's run slots while a run lasts: the anonymous tenant may have
/// [`ANONYMOUS_CONCURRENCY`] runs in flight, a tenant with a sandbox quota as many runs as its
/// `max_sandboxes`, others are not limited here (the zygote pools bound the node).
fn anonymous_slot(app: &App, t: &Tenant) -> ApiResult<Option<tokio::sync::OwnedSemaphorePermit>> {
    let (slots, limit) = if app.runner.anonymous().is_some_and(|a| a.id == t.id) {
        (
            Arc::clone(&app.runner.anonymous_slots),
            ANONYMOUS_CONCURRENCY,
        )
    } else if let Some(m) = t.max_sandboxes {
        let m = usize::try_from(m).unwrap_or(usize::MAX).clamp(1, 1 << 16);
        let slots = Arc::clone(
            app.runner
                .tenant_slots
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .entry(t.id.clone())
                .or_insert_with(|| Arc::new(tokio::sync::Semaphore::new(m))),
        );
        (slots, m)
    } else {
        return Ok(None);
    };
    slots.try_acquire_owned().map(Some).map_err(|_| ApiError {
        retry_after: Some(1),
        ..ApiError::new(
            ErrorCode::QuotaExceeded,
            format!("tenant {} may have {limit} runs in flight", t.name),
        )
    })
}

/// `POST /v1/run`: unknown fields are refused (`invalid_request`).
pub async fn run(app: Arc<App>, t: &Tenant, body: &[u8]) -> ApiResult<Value> {
    let spec = request::validate(
        &request::parse_object(body)?,
        Fields::Strict,
        &app.runner.cfg.template,
    )?;
    let _slot = anonymous_slot(&app, t)?;
    let out = run_one(&app, spec).await?;
    Ok(serde_json::to_value(out).unwrap_or_default())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchBody {
    requests: Vec<Value>,
    #[serde(default)]
    concurrency: Option<usize>,
}

/// `POST /v1/run/batch`: items answer in order, each `{"ok":true,"result":…}` or
/// `{"ok":false,"error":{problem}}`.
pub async fn run_batch(app: Arc<App>, t: &Tenant, body: &[u8]) -> ApiResult<Value> {
    let b: BatchBody = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("bad JSON body: {e}")))?;
    if b.requests.len() > MAX_BATCH {
        return Err(ApiError::invalid(format!(
            "at most {MAX_BATCH} requests per batch"
        )));
    }
    let _slot = anonymous_slot(&app, t)?;
    let gate = Arc::new(tokio::sync::Semaphore::new(
        b.concurrency.unwrap_or(64).clamp(1, 256),
    ));
    let mut set = tokio::task::JoinSet::new();
    for (i, v) in b.requests.into_iter().enumerate() {
        let app = Arc::clone(&app);
        let gate = Arc::clone(&gate);
        set.spawn(async move {
            let _p = gate.acquire_owned().await;
            let spec = match v {
                Value::Object(m) => request::validate(&m, Fields::Strict, &app.runner.cfg.template),
                other => Err(BadRun::NotObject { input: other }),
            };
            let r = match spec {
                Ok(spec) => run_one(&app, spec).await,
                Err(e) => Err(e.into()),
            };
            (i, r)
        });
    }
    let mut out = Vec::new();
    while let Some(r) = set.join_next().await {
        let (i, r) = r.map_err(|e| ApiError::internal(e.to_string()))?;
        out.push((
            i,
            match r {
                Ok(o) => json!({"ok": true, "result": o}),
                Err(e) => json!({"ok": false, "error": e.problem()}),
            },
        ));
    }
    out.sort_by_key(|(i, _)| *i);
    Ok(json!({"items": out.into_iter().map(|(_, v)| v).collect::<Vec<_>>()}))
}

/// Forgets what was probed on `template` (it was imported again or deleted).
pub fn forget_languages(app: &App, template: &str) {
    app.runner
        .languages
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(template);
}

/// `GET /v1/languages[?template=NAME]` (default: the runner's, `host` unless set).
pub async fn list_languages(app: Arc<App>, template: Option<String>) -> ApiResult<Value> {
    let template = template.unwrap_or_else(|| app.runner.cfg.template.clone());
    crate::template::validate_name(&template).map_err(|e| ApiError::invalid(e.to_string()))?;
    let have = languages(&app, &template).await?;
    let items: Vec<Value> = lang::LANGS
        .iter()
        .filter(|l| l.name == "python" || have.iter().any(|h| h == l.name))
        .map(|l| {
            json!({
                "name": l.name,
                "aliases": l.aliases,
                "substrates": if l.name == "python" { vec!["function", "container"] } else { vec!["container"] },
                "compiled": l.compile.is_some(),
            })
        })
        .collect();
    Ok(json!({"template": template, "items": items}))
}

/// Destroys runner sandboxes a previous node process left (their sessions died with the
/// agent connections of that process). Zygotes and the language probe start at first use.
pub async fn start(app: Arc<App>) {
    stop(&app).await;
}

/// Destroys the runner's sandboxes when the node stops: zygotes and idle containers are a
/// cache, never adopted by the next start.
pub async fn stop(app: &Arc<App>) {
    let mine = app.runner.tenant().id.clone();
    for e in app.entries() {
        if e.record().tenant.as_deref() == Some(mine.as_str()) {
            let _ = app.destroy(&e).await;
        }
    }
}
