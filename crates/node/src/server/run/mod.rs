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

use dsec_api::sandbox::Substrate;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dsec_api::agent::{Event, Request as AgentReq};
use dsec_api::exec::{ExecRequest, ExecResult};
use dsec_api::ErrorCode;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::error::{ApiError, ApiResult};
use crate::lifecycle::{CreateRequest, Entry, Node};
use crate::sandbox::Limits;
use crate::store::Tenant;

mod container;
mod function;

use function::{run_function, ZygotePool};
mod fusion;
mod lang;
mod request;

pub use fusion::run_code;
pub use request::{BadRun, MAX_MEMORY_MB, MAX_TIMEOUT_S};
use request::{Fields, RunSpec};

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

/// The runner's live state (one per node).
#[derive(Debug)]
pub struct Runner {
    /// The node whose sandboxes it runs code in.
    pub node: Arc<Node>,
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
    /// A runner of `node`'s sandboxes that belong to `tenant`; `anonymous` serves keyless
    /// requests.
    pub fn new(node: Arc<Node>, cfg: RunConfig, tenant: Tenant, anonymous: Option<Tenant>) -> Self {
        Self {
            node,
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
            Arc::new(ZygotePool::new(self.cfg.zygotes.max(1), burst))
        }))
    }
}

/// Runs one agent request on a sandbox, holding it exclusively.
async fn agent_call(
    app: &Arc<Runner>,
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
    app: &Arc<Runner>,
    e: &Arc<Entry>,
    req: ExecRequest,
    stdin: Vec<u8>,
) -> ApiResult<ExecResult> {
    let mut guard = e.lock().await;
    let rt = Arc::clone(&app.node.rt);
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
async fn runner_sandbox(app: &Arc<Runner>, template: &str) -> ApiResult<Arc<Entry>> {
    runner_sandbox_with(app, template, Limits::default(), false).await
}

async fn runner_sandbox_with(
    app: &Arc<Runner>,
    template: &str,
    limits: Limits,
    userns: bool,
) -> ApiResult<Arc<Entry>> {
    // The runner's own limits, admitted here like an API create's.
    let limits = app
        .node
        .rt
        .capacity()
        .admit(limits)
        .map_err(|e| ApiError::invalid(e.to_string()))?;
    let mut labels = BTreeMap::new();
    labels.insert("dsec.run".to_owned(), "1".to_owned());
    let rec = app
        .node
        .create(
            app.tenant(),
            CreateRequest {
                template: template.to_owned(),
                labels,
                limits,
                userns,
                ..CreateRequest::default()
            },
        )
        .await?;
    app.node
        .entry(&rec.id)
        .ok_or_else(|| ApiError::internal("a runner sandbox vanished after its create"))
}

/// Whether `spec`'s template has its language's toolchain (Python always: the function
/// substrate needs it).
async fn available(app: &Arc<Runner>, spec: &RunSpec) -> ApiResult<bool> {
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
async fn execute(app: &Arc<Runner>, spec: &RunSpec) -> ApiResult<RunOutcome> {
    let t0 = Instant::now();
    let mut out = match timed_out_at_once(spec) {
        Some(out) => out,
        None => match spec.substrate {
            Substrate::Function => run_function(app, spec).await?,
            Substrate::Container => container::run_container(app, spec).await?,
            Substrate::Microvm | Substrate::Vm => {
                return Err(ApiError::invalid(
                    "the code runner runs on the function or container substrate",
                ))
            }
        },
    };
    out.server_us = t0.elapsed().as_micros() as u64;
    out.clamped = spec.clamped.clone();
    Ok(out)
}

/// Runs one request of the native API: a language whose toolchain the template lacks is an
/// `invalid_request`.
async fn run_one(app: &Arc<Runner>, spec: RunSpec) -> ApiResult<RunOutcome> {
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
async fn languages(app: &Arc<Runner>, template: &str) -> ApiResult<Vec<String>> {
    let cell = crate::server::keyed::keyed(&app.languages, template.to_owned());
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
        let _ = app.node.destroy(&e).await;
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
fn anonymous_slot(
    app: &Runner,
    t: &Tenant,
) -> ApiResult<Option<tokio::sync::OwnedSemaphorePermit>> {
    let (slots, limit) = if app.anonymous().is_some_and(|a| a.id == t.id) {
        (Arc::clone(&app.anonymous_slots), ANONYMOUS_CONCURRENCY)
    } else if let Some(m) = t.max_sandboxes {
        let m = usize::try_from(m).unwrap_or(usize::MAX).clamp(1, 1 << 16);
        let slots = Arc::clone(
            app.tenant_slots
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
pub async fn run(app: Arc<Runner>, t: &Tenant, body: &[u8]) -> ApiResult<Value> {
    let spec = request::validate(
        &request::parse_object(body)?,
        Fields::Strict,
        &app.cfg.template,
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
pub async fn run_batch(app: Arc<Runner>, t: &Tenant, body: &[u8]) -> ApiResult<Value> {
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
                Value::Object(m) => request::validate(&m, Fields::Strict, &app.cfg.template),
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
pub fn forget_languages(app: &Runner, template: &str) {
    app.languages
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(template);
}

/// `GET /v1/languages[?template=NAME]` (default: the runner's, `host` unless set).
pub async fn list_languages(app: Arc<Runner>, template: Option<String>) -> ApiResult<Value> {
    let template = template.unwrap_or_else(|| app.cfg.template.clone());
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
/// Only those recorded before `started` (taken before the node serves anything): this runs
/// beside the first requests, whose own runner sandboxes may be being created already.
pub async fn start(app: Arc<Runner>, started: u64) {
    let mine = app.tenant().id.clone();
    for e in app.node.entries() {
        let r = e.record();
        if r.tenant.as_deref() == Some(mine.as_str()) && r.created_at_ms < started {
            let _ = app.node.destroy(&e).await;
        }
    }
}

/// Destroys the runner's sandboxes when the node stops: zygotes and idle containers are a
/// cache, never adopted by the next start.
pub async fn stop(app: &Arc<Runner>) {
    let mine = app.tenant().id.clone();
    for e in app.node.entries() {
        if e.record().tenant.as_deref() == Some(mine.as_str()) {
            let _ = app.node.destroy(&e).await;
        }
    }
}
