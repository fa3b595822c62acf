//! The node's live state and the sandbox lifecycle driven through it.
//!
//! Every sandbox the node owns has an [`Entry`]: its record (persisted on every change, before
//! the change is acknowledged) and, while it lives, the runtime [`Sandbox`] behind an async
//! mutex (one agent conversation at a time). Runtime calls block, so they run on tokio's
//! blocking pool.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use dsec_api::ErrorCode;
use serde::Serialize;
use tokio::sync::{broadcast, watch, OwnedMutexGuard};

use crate::sandbox::{Limits, SandboxSpec, State, Substrate};
use crate::substrate::{ContainerRuntime, Sandbox};

use super::error::{ApiError, ApiResult};
use super::log;
use super::store::{SandboxRecord, Store, Tenant};
use super::trajectory::Trajectories;
use crate::autoscale::{AutoscaleConfig, Autoscaler};
use crate::metrics::{Counter, Histogram, Registry};

/// Milliseconds since the epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Kills the process with SIGKILL when `DSEC_FAILPOINT` names this point: the crash tests
/// (F-01) stop the daemon at each named step of a create exactly as `kill -9` would.
///
/// `DSEC_FAILPOINT=<point>=sleep:<ms>` sleeps there instead (the tests of races, e.g. a
/// destroy during a create, F-15).
pub fn failpoint(name: &str) {
    static POINT: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let point = POINT.get_or_init(|| std::env::var("DSEC_FAILPOINT").ok());
    let Some(point) = point.as_deref() else {
        return;
    };
    if let Some(ms) = point
        .strip_prefix(name)
        .and_then(|rest| rest.strip_prefix("=sleep:"))
        .and_then(|ms| ms.parse::<u64>().ok())
    {
        std::thread::sleep(std::time::Duration::from_millis(ms));
        return;
    }
    if point == name {
        log::warn("failpoint hit", &[("point", name)]);
        let _ =
            rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
    }
}

/// One sandbox the node owns.
#[derive(Debug)]
pub struct Entry {
    /// Sandbox id.
    pub id: String,
    rec: Mutex<SandboxRecord>,
    /// The runtime handle; `None` once destroyed.
    live: Arc<tokio::sync::Mutex<Option<Sandbox>>>,
    watch: watch::Sender<(State, u64)>,
    /// The earlier of the TTL and the lease expiry, on the monotonic clock: a wall-clock jump
    /// neither kills a sandbox early nor keeps it late.
    deadline: Mutex<Option<Instant>>,
    /// Host pids of the supervisor and the sandbox init (shown to the admin tenant).
    pids: Mutex<Option<(i32, i32)>>,
    /// A destroy was asked for: a create in progress gives up instead of finishing.
    doomed: AtomicBool,
    /// Destroys the sweeper tried and that failed (bounded by [`MAX_SWEEP_DESTROYS`]).
    sweep_failures: std::sync::atomic::AtomicU32,
}

/// Failed destroys the sweeper retries before it leaves a sandbox `failed` for an operator
/// (its record says why; an explicit DELETE still tries).
pub const MAX_SWEEP_DESTROYS: u32 = 5;

/// Destroys a sandbox the node has no record of: through its supervisor when it answers,
/// otherwise by removing what is left. Returns whether nothing is left.
fn reap_orphan(rt: &ContainerRuntime, id: &str) -> bool {
    match rt.adopt(id, SandboxSpec::default(), State::Running) {
        Ok(sb) => sb.destroy(rt).is_ok(),
        Err(_) => rt.cleanup_leftovers(id, &rt.sandbox_run_dir(id)),
    }
}

/// Moves a record to `to` through the lifecycle's transition function (the only way states
/// change).
fn step(r: &mut SandboxRecord, to: State) -> ApiResult<()> {
    r.state = r
        .state
        .transition(to)
        .map_err(|t| ApiError::new(ErrorCode::InvalidTransition, t.to_string()))?;
    Ok(())
}

/// The monotonic instant of a record's earliest expiry (TTL or lease).
fn deadline_of(r: &SandboxRecord) -> Option<Instant> {
    let at = match (r.expires_at_ms, r.lease_expires_at_ms) {
        (Some(a), Some(b)) => a.min(b),
        (Some(a), None) | (None, Some(a)) => a,
        (None, None) => return None,
    };
    let left = at.saturating_sub(now_ms());
    Some(Instant::now() + std::time::Duration::from_millis(left))
}

impl Entry {
    fn new(rec: SandboxRecord, sandbox: Option<Sandbox>) -> Arc<Self> {
        let (watch, _) = watch::channel((rec.state, rec.version));
        Arc::new(Self {
            id: rec.id.clone(),
            deadline: Mutex::new(deadline_of(&rec)),
            pids: Mutex::new(sandbox.as_ref().map(|s| (s.supervisor_pid(), s.init_pid()))),
            doomed: AtomicBool::new(false),
            sweep_failures: std::sync::atomic::AtomicU32::new(0),
            rec: Mutex::new(rec),
            live: Arc::new(tokio::sync::Mutex::new(sandbox)),
            watch,
        })
    }

    /// A copy of the record.
    pub fn record(&self) -> SandboxRecord {
        self.rec.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Host pids of the supervisor and the sandbox init, while it lives.
    pub fn pids(&self) -> Option<(i32, i32)> {
        *self.pids.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn set_pids(&self, sb: Option<&Sandbox>) {
        *self.pids.lock().unwrap_or_else(|p| p.into_inner()) =
            sb.map(|s| (s.supervisor_pid(), s.init_pid()));
    }

    /// Subscribes to (state, version) changes.
    pub fn subscribe(&self) -> watch::Receiver<(State, u64)> {
        self.watch.subscribe()
    }

    /// Exclusive use of the live sandbox (waits for the current user).
    pub async fn lock(&self) -> OwnedMutexGuard<Option<Sandbox>> {
        Arc::clone(&self.live).lock_owned().await
    }
}

/// A lifecycle event (also streamed at `/v1/events`).
#[derive(Debug, Clone, Serialize)]
pub struct LifecycleEvent {
    /// Sandbox id.
    pub sandbox: String,
    /// Owner.
    pub tenant: Option<String>,
    /// New state.
    pub state: State,
    /// New version.
    pub version: u64,
    /// When, ms since the epoch.
    pub at_ms: u64,
}

/// Sizing of one template's warm pool.
#[derive(Debug, Clone, Copy, Serialize, serde::Deserialize)]
pub struct PoolSize {
    /// Ready sandboxes kept at least.
    pub min: usize,
    /// Ready sandboxes kept at most.
    pub max: usize,
}

/// One template's warm pool: ready sandboxes (no tenant yet) and its sizing policy.
#[derive(Debug)]
struct PoolState {
    scaler: Autoscaler,
    ready: VecDeque<String>,
    creating: usize,
}

impl PoolState {
    fn new(size: PoolSize) -> Result<Self, String> {
        let scaler = Autoscaler::new(AutoscaleConfig::new(size.min, size.max), Instant::now())
            .map_err(|e| e.to_string())?;
        Ok(Self {
            scaler,
            ready: VecDeque::new(),
            creating: 0,
        })
    }
}

/// What a create asks for.
#[derive(Debug, Clone, Default)]
pub struct CreateRequest {
    /// Template name.
    pub template: String,
    /// Substrate.
    pub substrate: Substrate,
    /// Limits.
    pub limits: Limits,
    /// Environment for every command.
    pub env: BTreeMap<String, String>,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// Time to live.
    pub ttl_ms: Option<u64>,
    /// Owner lease.
    pub lease_ms: Option<u64>,
    /// Writable root.
    pub writable_root: bool,
    /// The request's idempotency key (recorded with the sandbox, so that a retry after a
    /// crash finds the sandbox even when the answer was never recorded).
    pub idem: Option<String>,
    /// Names of `env` entries whose values are secret.
    pub secret_env: Vec<String>,
    /// Run in a user namespace (root inside mapped to an unprivileged host id).
    pub userns: bool,
}

/// How a restart found the sandboxes of the previous node process.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RecoveryReport {
    /// Reconnected and running again.
    pub adopted: Vec<String>,
    /// Could not be reconnected (or were mid-change): destroyed, records closed.
    pub reaped: Vec<String>,
    /// On the machine without a record: destroyed.
    pub orphans: Vec<String>,
    /// Sandbox cgroups without a live sandbox, removed (see [`App::sweep_orphan_cgroups`]).
    pub orphan_cgroups: Vec<String>,
    /// How long recovery took, ms.
    pub took_ms: u64,
}

/// Shared state of the node daemon.
pub struct App {
    /// The container runtime.
    pub rt: Arc<ContainerRuntime>,
    /// Durable state.
    pub store: Store,
    entries: Mutex<HashMap<String, Arc<Entry>>>,
    pools: Mutex<HashMap<String, PoolState>>,
    /// Lifecycle events.
    pub events: broadcast::Sender<LifecycleEvent>,
    /// No new work is accepted.
    pub draining: AtomicBool,
    /// Recovery finished.
    pub ready: AtomicBool,
    /// The last recovery.
    pub recovery: Mutex<RecoveryReport>,
    /// API key hash → tenant.
    keys: Mutex<HashMap<String, Tenant>>,
    /// Creates running on the blocking pool.
    create_slots: tokio::sync::Semaphore,
    /// Metrics.
    pub metrics: Metrics,
    /// Started.
    pub started: Instant,
    in_flight: std::sync::atomic::AtomicUsize,
    /// Most sandboxes (any state but stopped, pools included) this node holds.
    max_sandboxes: usize,
    /// Sweeps run.
    sweeps: std::sync::atomic::AtomicU64,
    /// The trajectory log.
    pub trajectories: Trajectories,
    /// How long a finished trajectory stays in the log before compaction may drop it.
    pub compact_after: std::time::Duration,
    /// The code runner (`/v1/run`, `/run_code`).
    pub runner: super::run::Runner,
}

/// Counts a request as in flight while it lives.
#[derive(Debug)]
pub struct InFlight(Arc<App>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The node's metrics, resolved once (updates never touch the registry lock).
#[derive(Debug)]
pub struct Metrics {
    /// The registry `/metrics` renders.
    pub registry: Registry,
    /// Sandboxes created by the runtime (pool fills included).
    pub created: Counter,
    /// Sandboxes destroyed.
    pub destroyed: Counter,
    /// Runtime creates that failed.
    pub create_failed: Counter,
    /// Commands run (exec API).
    pub execs: Counter,
    /// Sandboxes destroyed by TTL or lease expiry.
    pub expired: Counter,
    /// Sandboxes found dead (supervisor or init gone).
    pub died: Counter,
    /// Commands killed by the seccomp filter (SIGSYS).
    pub seccomp_kills: Counter,
    /// Commands that ended `oom`.
    pub oom_kills: Counter,
    /// API create latency, pool hits.
    pub acquire_hit: Histogram,
    /// API create latency, created on demand.
    pub acquire_miss: Histogram,
    /// Runtime create phases.
    pub phase_launch: Histogram,
    /// Runtime create phases.
    pub phase_hello: Histogram,
    /// Runtime create phases.
    pub phase_cgroup: Histogram,
    /// Runtime create phases.
    pub phase_clone_exec: Histogram,
    /// Exec latency (whole command).
    pub exec: Histogram,
    /// Reset latency.
    pub reset: Histogram,
    /// Destroy latency.
    pub destroy: Histogram,
    /// VM sandboxes created (snapshot restores), microvm.
    pub vm_created_microvm: Counter,
    /// VM sandboxes created (snapshot restores), vm.
    pub vm_created_vm: Counter,
    /// Create latency of VM sandboxes (restore to identified guest).
    pub vm_restore: Histogram,
}

impl Metrics {
    fn new() -> Self {
        let registry = Registry::new();
        let c = |n: &str, h: &str| registry.counter(n, h, &[]).unwrap_or_default();
        let h = |n: &str, help: &str, labels: &[(&str, &str)]| {
            registry.histogram(n, help, labels).unwrap_or_default()
        };
        let phase = |p: &str| {
            h(
                "dsec_create_phase_seconds",
                "Runtime create latency by phase (launch: request to supervisor answer; hello: to agent ready)",
                &[("phase", p)],
            )
        };
        let vm_created = |k: &str| {
            registry
                .counter(
                    "dsec_vm_sandboxes_created_total",
                    "VM sandboxes created by restoring their template's snapshot",
                    &[("substrate", k)],
                )
                .unwrap_or_default()
        };
        Self {
            vm_created_microvm: vm_created("microvm"),
            vm_created_vm: vm_created("vm"),
            vm_restore: h(
                "dsec_vm_restore_seconds",
                "VM create latency: QEMU start, snapshot restore, guest identity",
                &[],
            ),
            created: c(
                "dsec_sandboxes_created_total",
                "Sandboxes created by the runtime",
            ),
            destroyed: c("dsec_sandboxes_destroyed_total", "Sandboxes destroyed"),
            create_failed: c(
                "dsec_sandbox_create_failures_total",
                "Runtime creates that failed",
            ),
            execs: c("dsec_execs_total", "Commands run through the exec API"),
            expired: c(
                "dsec_sandboxes_expired_total",
                "Sandboxes destroyed by TTL or lease expiry",
            ),
            died: c(
                "dsec_sandboxes_died_total",
                "Sandboxes found dead (supervisor or init gone)",
            ),
            seccomp_kills: c(
                "dsec_seccomp_kills_total",
                "Commands killed by the seccomp filter",
            ),
            oom_kills: c("dsec_oom_kills_total", "Commands that ended out of memory"),
            acquire_hit: h(
                "dsec_acquire_seconds",
                "API create latency",
                &[("pool", "hit")],
            ),
            acquire_miss: h(
                "dsec_acquire_seconds",
                "API create latency",
                &[("pool", "miss")],
            ),
            phase_launch: phase("launch"),
            phase_hello: phase("hello"),
            phase_cgroup: phase("cgroup"),
            phase_clone_exec: phase("clone_exec"),
            exec: h("dsec_exec_seconds", "Exec latency", &[]),
            reset: h("dsec_reset_seconds", "Reset latency", &[]),
            destroy: h("dsec_destroy_seconds", "Destroy latency", &[]),
            registry,
        }
    }
}

impl std::fmt::Debug for App {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("App").finish_non_exhaustive()
    }
}

fn pool_key(req: &CreateRequest) -> Option<String> {
    (req.limits == Limits::default() && !req.writable_root && !req.userns)
        .then(|| pool_name(&req.template, req.substrate))
}

/// A pool's name: the template for containers, `<template>@<substrate>` for VMs (`@` cannot
/// occur in a template name).
pub fn pool_name(template: &str, substrate: Substrate) -> String {
    match substrate {
        Substrate::Container => template.to_owned(),
        vm => format!("{template}@{}", vm.name()),
    }
}

/// Splits a pool name into template and substrate; `None` for an unknown substrate.
pub fn parse_pool_name(name: &str) -> Option<(&str, Substrate)> {
    match name.split_once('@') {
        None => Some((name, Substrate::Container)),
        Some((t, s)) => Substrate::parse(s).filter(|s| s.is_vm()).map(|s| (t, s)),
    }
}

impl App {
    /// Wraps a started runtime and an open store.
    pub fn new(
        rt: ContainerRuntime,
        store: Store,
        trajectories: Trajectories,
        max_sandboxes: usize,
        compact_after: std::time::Duration,
        runner: super::run::Runner,
    ) -> Arc<Self> {
        let (events, _) = broadcast::channel(1024);
        Arc::new(Self {
            rt: Arc::new(rt),
            store,
            entries: Mutex::new(HashMap::new()),
            pools: Mutex::new(HashMap::new()),
            events,
            draining: AtomicBool::new(false),
            ready: AtomicBool::new(false),
            recovery: Mutex::new(RecoveryReport::default()),
            keys: Mutex::new(HashMap::new()),
            create_slots: tokio::sync::Semaphore::new(4),
            max_sandboxes,
            trajectories,
            compact_after,
            runner,
            sweeps: std::sync::atomic::AtomicU64::new(0),
            metrics: Metrics::new(),
            started: Instant::now(),
            in_flight: std::sync::atomic::AtomicUsize::new(0),
        })
    }

    /// Marks a request in flight until the guard drops.
    pub fn track(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(Arc::clone(self))
    }

    /// Requests being served.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// The tenant of an API key hash (cached).
    pub fn tenant_for_key(&self, hash: &str) -> ApiResult<Option<Tenant>> {
        if let Some(t) = self
            .keys
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(hash)
        {
            return Ok(Some(t.clone()));
        }
        let t = self.store.tenant_for_key(hash)?;
        if let Some(t) = &t {
            self.keys
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(hash.to_owned(), t.clone());
        }
        Ok(t)
    }

    /// A live entry.
    pub fn entry(&self, id: &str) -> Option<Arc<Entry>> {
        self.entries
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned()
    }

    /// A live entry owned by `tenant` (`sandbox_not_found` otherwise: another tenant's
    /// sandbox does not exist for the caller).
    pub fn owned(&self, tenant: &Tenant, id: &str) -> ApiResult<Arc<Entry>> {
        match self.entry(id) {
            Some(e) if e.record().tenant.as_deref() == Some(&tenant.id) => Ok(e),
            _ => Err(ApiError::no_sandbox(id)),
        }
    }

    /// Like [`App::owned`], but the admin tenant reaches every tenant's sandboxes (operators
    /// inspect and clean up through it).
    pub fn owned_or_admin(&self, tenant: &Tenant, id: &str) -> ApiResult<Arc<Entry>> {
        if tenant.admin {
            return self.entry(id).ok_or_else(|| ApiError::no_sandbox(id));
        }
        self.owned(tenant, id)
    }

    /// Every live entry.
    pub fn entries(&self) -> Vec<Arc<Entry>> {
        self.entries
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect()
    }

    /// The templates the live sandboxes (pooled ones included) were made from: their layers are
    /// mounted and must stay (see `TemplateStore::remove`).
    pub fn templates_in_use(&self) -> std::collections::BTreeSet<String> {
        self.entries()
            .iter()
            .map(|e| e.record().spec.template)
            .collect()
    }

    /// Applies `f` to the record, bumps its version, persists it, then publishes the change.
    pub fn update(
        &self,
        e: &Entry,
        f: impl FnOnce(&mut SandboxRecord) -> ApiResult<()>,
    ) -> ApiResult<SandboxRecord> {
        let rec = {
            let mut r = e.rec.lock().unwrap_or_else(|p| p.into_inner());
            let mut next = r.clone();
            f(&mut next)?;
            next.version += 1;
            self.store.put_sandbox(&next, now_ms())?;
            if (next.expires_at_ms, next.lease_expires_at_ms)
                != (r.expires_at_ms, r.lease_expires_at_ms)
            {
                *e.deadline.lock().unwrap_or_else(|p| p.into_inner()) = deadline_of(&next);
            }
            *r = next.clone();
            next
        };
        e.watch.send_replace((rec.state, rec.version));
        let _ = self.events.send(LifecycleEvent {
            sandbox: rec.id.clone(),
            tenant: rec.tenant.clone(),
            state: rec.state,
            version: rec.version,
            at_ms: now_ms(),
        });
        Ok(rec)
    }

    fn set_state(&self, e: &Entry, to: State) -> ApiResult<SandboxRecord> {
        self.update(e, |r| {
            r.state = r
                .state
                .transition(to)
                .map_err(|t| ApiError::new(ErrorCode::InvalidTransition, t.to_string()))?;
            Ok(())
        })
    }

    fn insert(&self, e: Arc<Entry>) {
        self.entries
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(e.id.clone(), e);
    }

    fn remove(&self, id: &str) {
        self.entries
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        let mut pools = self.pools.lock().unwrap_or_else(|p| p.into_inner());
        for p in pools.values_mut() {
            p.ready.retain(|r| r != id);
        }
    }

    /// Sandboxes and memory a tenant holds now.
    pub fn usage(&self, tenant: &str) -> (u64, u64) {
        let mut n = 0;
        let mut mem = 0;
        for e in self.entries() {
            let r = e.record();
            if r.tenant.as_deref() == Some(tenant) && r.state != State::Stopped {
                n += 1;
                mem += r.spec.limits.memory_max;
            }
        }
        (n, mem)
    }

    fn check_draining(&self) -> ApiResult<()> {
        if self.draining.load(Ordering::Relaxed) {
            return Err(ApiError {
                retry_after: Some(5),
                ..ApiError::new(ErrorCode::Draining, "the node is shutting down")
            });
        }
        Ok(())
    }

    /// Creates (or takes from the pool) a sandbox for `tenant`.
    pub async fn create(
        self: &Arc<Self>,
        tenant: &Tenant,
        req: CreateRequest,
    ) -> ApiResult<SandboxRecord> {
        self.check_draining()?;
        // Limits beyond this machine are refused before anything is recorded or made.
        self.rt
            .capacity()
            .admit(&req.limits)
            .map_err(|e| ApiError::invalid(e.to_string()))?;
        if req.template != "host" {
            let name = req.template.clone();
            let rt = Arc::clone(&self.rt);
            tokio::task::spawn_blocking(move || rt.templates().get(&name))
                .await
                .map_err(|e| ApiError::internal(e.to_string()))??;
        }
        if let Some(key) = &req.idem {
            if let Some(rec) = self.store.sandbox_by_idem(&tenant.id, key)? {
                if rec.state != State::Stopped {
                    return Ok(self.entry(&rec.id).map_or(rec, |e| e.record()));
                }
            }
        }
        let now = now_ms();
        let fill = |r: &mut SandboxRecord| {
            r.idem = req.idem.clone();
            r.secret_env = req.secret_env.clone();
            r.tenant = Some(tenant.id.clone());
            r.acquired_at_ms = Some(now);
            r.labels = req.labels.clone();
            r.env = req.env.clone();
            r.expires_at_ms = req.ttl_ms.map(|t| now + t);
            r.lease_ms = req.lease_ms;
            r.lease_expires_at_ms = req.lease_ms.map(|t| now + t);
        };
        // Quota check and reservation happen under the entries lock: concurrent creates of one
        // tenant cannot both pass the last free slot.
        let pooled = pool_key(&req);
        let reserved = {
            let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
            let (mut n, mut mem) = (0u64, 0u64);
            for e in entries.values() {
                let r = e.record();
                if r.tenant.as_deref() == Some(tenant.id.as_str()) && r.state != State::Stopped {
                    n += 1;
                    mem += r.spec.limits.memory_max;
                }
            }
            if tenant.max_sandboxes.is_some_and(|m| n + 1 > m) {
                return Err(ApiError::new(
                    ErrorCode::QuotaExceeded,
                    format!("tenant {} may hold at most {} sandboxes", tenant.name, n),
                ));
            }
            if tenant
                .max_memory_bytes
                .is_some_and(|m| mem + req.limits.memory_max > m)
            {
                return Err(ApiError::new(
                    ErrorCode::QuotaExceeded,
                    format!("tenant {} memory quota exceeded", tenant.name),
                ));
            }
            // A pool hit: hand over a ready sandbox.
            let hit = pooled.as_ref().and_then(|k| {
                let mut pools = self.pools.lock().unwrap_or_else(|p| p.into_inner());
                let p = pools.get_mut(k)?;
                let id = p.ready.pop_front();
                p.scaler.record_acquire(Instant::now(), id.is_some());
                id.and_then(|id| entries.get(&id).cloned())
            });
            match hit {
                Some(e) => {
                    // Counted against the tenant from now on (persisted with the handover).
                    e.rec.lock().unwrap_or_else(|p| p.into_inner()).tenant =
                        Some(tenant.id.clone());
                    Ok(e)
                }
                None => {
                    if entries.len() >= self.max_sandboxes {
                        return Err(ApiError {
                            retry_after: Some(1),
                            ..ApiError::new(
                                ErrorCode::ResourceExhausted,
                                format!(
                                    "the node holds its maximum of {} sandboxes",
                                    self.max_sandboxes
                                ),
                            )
                        });
                    }
                    let id = crate::substrate::new_id();
                    let mut rec = SandboxRecord {
                        id: id.clone(),
                        tenant: None,
                        state: State::Creating,
                        version: 0,
                        spec: SandboxSpec {
                            template: req.template.clone(),
                            limits: req.limits.clone(),
                            writable_root: req.writable_root,
                            substrate: req.substrate,
                            userns: req.userns,
                            ..SandboxSpec::default()
                        },
                        substrate: req.substrate.name().into(),
                        labels: BTreeMap::new(),
                        env: BTreeMap::new(),
                        created_at_ms: now,
                        acquired_at_ms: None,
                        expires_at_ms: None,
                        lease_ms: None,
                        lease_expires_at_ms: None,
                        pooled: false,
                        error: None,
                        idem: None,
                        secret_env: Vec::new(),
                        phase: None,
                    };
                    fill(&mut rec);
                    let e = Entry::new(rec, None);
                    entries.insert(id, Arc::clone(&e));
                    Err(e)
                }
            }
        };
        let t0 = Instant::now();
        match reserved {
            Ok(e) => {
                // The pool refills in the background.
                self.kick_pools();
                let mut guard = e.lock().await;
                if let Some(sb) = guard.as_mut() {
                    sb.mark_acquired().map_err(ApiError::from)?;
                }
                let rec = self.update(&e, |r| {
                    fill(r);
                    r.pooled = true;
                    r.state = r
                        .state
                        .transition(State::Running)
                        .map_err(|t| ApiError::new(ErrorCode::InvalidTransition, t.to_string()))?;
                    Ok(())
                })?;
                drop(guard);
                self.metrics.acquire_hit.observe_duration(t0.elapsed());
                Ok(rec)
            }
            Err(e) => {
                if pooled.is_some() {
                    self.kick_pools();
                }
                let rec = e.record();
                self.store.put_sandbox(&rec, now)?;
                self.launch(&e).await?;
                self.metrics.acquire_miss.observe_duration(t0.elapsed());
                Ok(e.record())
            }
        }
    }

    /// Runs the runtime create for a `Creating` entry; on success the entry is `Ready` with
    /// its sandbox, on failure it is closed and the error returned.
    async fn launch(self: &Arc<Self>, e: &Arc<Entry>) -> ApiResult<()> {
        let spec = e.record().spec;
        let rt = Arc::clone(&self.rt);
        let _slot = self
            .create_slots
            .acquire()
            .await
            .map_err(|_| ApiError::internal("create slots closed"))?;
        // The entry stays locked until the sandbox is recorded `ready`: a destroy that comes in
        // meanwhile waits, then destroys what was made (destroy wins, nothing is orphaned).
        let mut guard = e.lock().await;
        if e.record().state != State::Creating {
            return Err(ApiError::new(
                ErrorCode::InvalidTransition,
                format!("sandbox {} was destroyed while it was created", e.id),
            ));
        }
        failpoint("create:before_launch");
        let id = e.id.clone();
        let pooled = e.record().tenant.is_none();
        // A VM whose snapshot is not made yet waits for the node to make it (a minute or more
        // the first time on a host): shown as the `preparing` phase while it does.
        let preparing = spec.substrate.is_vm() && {
            let (rt, spec) = (Arc::clone(&rt), spec.clone());
            !tokio::task::spawn_blocking(move || rt.vm_snapshot_loaded(&spec))
                .await
                .unwrap_or(false)
        };
        if preparing {
            self.update(e, |r| {
                r.phase = Some("preparing".into());
                Ok(())
            })?;
        }
        let made = tokio::task::spawn_blocking(move || {
            failpoint("create:launching");
            let mut made = rt.create_with_id(&id, &spec);
            if let (true, Ok((sb, _))) = (pooled, &mut made) {
                sb.warm_up(&rt);
            }
            made
        })
        .await
        .map_err(|err| ApiError::internal(err.to_string()))?;
        if preparing {
            self.update(e, |r| {
                r.phase = None;
                Ok(())
            })?;
        }
        match made {
            Ok((mut sb, phases)) => {
                failpoint("create:after_launch");
                let us = |v: u64| std::time::Duration::from_micros(v);
                match sb.substrate() {
                    Substrate::Container => {
                        self.metrics
                            .phase_launch
                            .observe_duration(us(phases.launch_us));
                        self.metrics
                            .phase_hello
                            .observe_duration(us(phases.hello_us));
                        self.metrics
                            .phase_cgroup
                            .observe_duration(us(phases.cgroup_us));
                        self.metrics
                            .phase_clone_exec
                            .observe_duration(us(phases.clone_exec_us));
                    }
                    Substrate::Microvm => self.metrics.vm_created_microvm.inc(),
                    Substrate::Vm => self.metrics.vm_created_vm.inc(),
                }
                if sb.substrate().is_vm() {
                    self.metrics
                        .vm_restore
                        .observe_duration(us(phases.hello_us));
                }
                self.metrics.created.inc();
                let for_tenant = e.record().tenant.is_some();
                if for_tenant {
                    sb.mark_acquired().map_err(ApiError::from)?;
                }
                e.set_pids(Some(&sb));
                *guard = Some(sb);
                if e.doomed.load(Ordering::SeqCst) {
                    // The waiting destroy takes it from here.
                    return Err(ApiError::new(
                        ErrorCode::InvalidTransition,
                        format!("sandbox {} was destroyed while it was created", e.id),
                    ));
                }
                self.set_state(e, State::Ready)?;
                failpoint("create:after_ready");
                if for_tenant {
                    self.set_state(e, State::Running)?;
                }
                drop(guard);
                Ok(())
            }
            Err(err) => {
                drop(guard);
                self.metrics.create_failed.inc();
                let api = ApiError::from(err);
                let _ = self.update(e, |r| {
                    // Nothing of it exists: failed, then closed.
                    step(r, State::Failed)?;
                    step(r, State::Stopping)?;
                    step(r, State::Stopped)?;
                    r.error = Some(api.detail.clone());
                    Ok(())
                });
                self.remove(&e.id);
                log::warn(
                    "create failed",
                    &[("sandbox", &e.id), ("error", &api.detail)],
                );
                Err(api)
            }
        }
    }

    /// Destroys a sandbox: `stopping` is persisted first, `stopped` once nothing of it is left.
    pub async fn destroy(self: &Arc<Self>, e: &Arc<Entry>) -> ApiResult<SandboxRecord> {
        let t0 = Instant::now();
        e.doomed.store(true, Ordering::SeqCst);
        let mut guard = e.lock().await;
        let rec = e.record();
        if rec.state == State::Stopped {
            return Ok(rec);
        }
        if rec.state != State::Stopping {
            self.update(e, |r| step(r, State::Stopping))?;
        }
        let sb = guard.take();
        e.set_pids(None);
        let rt = Arc::clone(&self.rt);
        let id = e.id.clone();
        let run_dir = self.rt.sandbox_run_dir(&id);
        let result = tokio::task::spawn_blocking(move || match sb {
            Some(sb) => sb.destroy(&rt).map_err(ApiError::from),
            None => {
                if rt.cleanup_leftovers(&id, &run_dir) {
                    Ok(())
                } else {
                    Err(ApiError::internal("leftovers could not be removed"))
                }
            }
        })
        .await
        .map_err(|err| ApiError::internal(err.to_string()))?;
        drop(guard);
        if let Err(err) = result {
            let _ = self.update(e, |r| {
                step(r, State::Failed)?;
                r.error = Some(err.detail.clone());
                Ok(())
            });
            return Err(err);
        }
        self.metrics.destroyed.inc();
        self.metrics.destroy.observe_duration(t0.elapsed());
        let rec = self.update(e, |r| {
            step(r, State::Stopped)?;
            Ok(())
        })?;
        self.remove(&e.id);
        Ok(rec)
    }

    /// Resets a sandbox: every process killed, a fresh writable layer.
    pub async fn reset(self: &Arc<Self>, e: &Arc<Entry>) -> ApiResult<SandboxRecord> {
        let mut guard = e.lock().await;
        if e.record().state != State::Running {
            return Err(ApiError::new(
                ErrorCode::InvalidTransition,
                format!("cannot reset a {:?} sandbox", e.record().state),
            ));
        }
        self.set_state(e, State::Resetting)?;
        let Some(mut sb) = guard.take() else {
            return Err(ApiError::no_sandbox(&e.id));
        };
        let t0 = Instant::now();
        let (sb, result) = tokio::task::spawn_blocking(move || {
            let r = sb.reset().and_then(|()| sb.mark_acquired());
            (sb, r)
        })
        .await
        .map_err(|err| ApiError::internal(err.to_string()))?;
        e.set_pids(Some(&sb));
        *guard = Some(sb);
        drop(guard);
        self.metrics.reset.observe_duration(t0.elapsed());
        match result {
            Ok(()) => self.set_state(e, State::Running),
            Err(err) => {
                let api = ApiError::from(err);
                let _ = self.update(e, |r| {
                    step(r, State::Failed)?;
                    r.error = Some(api.detail.clone());
                    Ok(())
                });
                Err(api)
            }
        }
    }

    /// Extends the owner lease.
    pub fn heartbeat(&self, e: &Entry, lease_ms: Option<u64>) -> ApiResult<SandboxRecord> {
        self.update(e, |r| {
            let len = lease_ms.or(r.lease_ms).ok_or_else(|| {
                ApiError::invalid("the sandbox has no lease; pass lease_ms to start one")
            })?;
            r.lease_ms = Some(len);
            r.lease_expires_at_ms = Some(now_ms() + len);
            Ok(())
        })
    }

    /// Sets a template's pool bounds (the size between them follows demand).
    pub fn set_pool(self: &Arc<Self>, template: &str, size: PoolSize) -> ApiResult<()> {
        self.store.put_pool(template, size.min, size.max)?;
        self.configure_pool(template, size)
    }

    /// Sets a pool's bounds in memory only (at start, from the store).
    pub fn configure_pool(self: &Arc<Self>, template: &str, size: PoolSize) -> ApiResult<()> {
        {
            let mut pools = self.pools.lock().unwrap_or_else(|p| p.into_inner());
            let mut fresh = PoolState::new(size).map_err(ApiError::invalid)?;
            if let Some(old) = pools.remove(template) {
                fresh.ready = old.ready;
                fresh.creating = old.creating;
            }
            pools.insert(template.to_owned(), fresh);
        }
        self.kick_pools();
        Ok(())
    }

    /// Pool statistics.
    pub fn pool_stats(&self) -> Vec<serde_json::Value> {
        let now = Instant::now();
        let pools = self.pools.lock().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<serde_json::Value> = pools
            .iter()
            .map(|(t, p)| {
                let st = p.scaler.stats(now);
                serde_json::json!({
                    "template": t,
                    "min": st.min,
                    "max": st.max,
                    "target": st.target,
                    "ready": p.ready.len(),
                    "creating": p.creating,
                    "hits": st.hits,
                    "misses": st.misses,
                    "hit_rate": st.hit_rate,
                    "acquire_rate": st.acquire_rate_per_s,
                    "refill_ms": st.refill_ms,
                    "peak": st.peak,
                })
            })
            .collect();
        out.sort_by(|a, b| a["template"].as_str().cmp(&b["template"].as_str()));
        out
    }

    /// Applies each pool's plan: starts background creates below target, destroys surplus.
    pub fn kick_pools(self: &Arc<Self>) {
        // Not while recovery may still hand adopted sandboxes back to their pools.
        if self.draining.load(Ordering::Relaxed) || !self.ready.load(Ordering::Relaxed) {
            return;
        }
        let now = Instant::now();
        let mut todo = Vec::new();
        let mut surplus = Vec::new();
        let room = self
            .max_sandboxes
            .saturating_sub(self.entries.lock().unwrap_or_else(|p| p.into_inner()).len());
        {
            let mut pools = self.pools.lock().unwrap_or_else(|p| p.into_inner());
            for (t, p) in pools.iter_mut() {
                let plan = p.scaler.plan(now, p.ready.len(), p.creating);
                // `min` is a floor on ready sandboxes, whatever the watermark says.
                let floor = p
                    .scaler
                    .config()
                    .min
                    .saturating_sub(p.ready.len() + p.creating);
                let create = plan.create.max(floor).min(room.saturating_sub(todo.len()));
                p.creating += create;
                todo.extend(std::iter::repeat_n(t.clone(), create));
                for _ in 0..plan.destroy {
                    if let Some(id) = p.ready.pop_back() {
                        surplus.push(id);
                    }
                }
            }
        }
        for t in todo {
            let app = Arc::clone(self);
            tokio::spawn(async move {
                let t0 = Instant::now();
                let r = app.fill_one(&t).await;
                let mut pools = app.pools.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(p) = pools.get_mut(&t) {
                    p.creating = p.creating.saturating_sub(1);
                    if let Ok(id) = r {
                        p.scaler.record_refill(t0.elapsed());
                        p.ready.push_back(id);
                    }
                }
            });
        }
        for id in surplus {
            if let Some(e) = self.entry(&id) {
                let app = Arc::clone(self);
                tokio::spawn(async move {
                    let _ = app.destroy(&e).await;
                });
            }
        }
    }

    async fn fill_one(self: &Arc<Self>, pool: &str) -> ApiResult<String> {
        let (template, substrate) = parse_pool_name(pool)
            .ok_or_else(|| ApiError::invalid(format!("bad pool name {pool:?}")))?;
        let id = crate::substrate::new_id();
        let rec = SandboxRecord {
            id: id.clone(),
            tenant: None,
            state: State::Creating,
            version: 0,
            spec: SandboxSpec {
                template: template.to_owned(),
                substrate,
                ..SandboxSpec::default()
            },
            substrate: substrate.name().into(),
            labels: BTreeMap::new(),
            env: BTreeMap::new(),
            created_at_ms: now_ms(),
            acquired_at_ms: None,
            expires_at_ms: None,
            lease_ms: None,
            lease_expires_at_ms: None,
            pooled: true,
            error: None,
            idem: None,
            secret_env: Vec::new(),
            phase: None,
        };
        self.store.put_sandbox(&rec, now_ms())?;
        let e = Entry::new(rec, None);
        self.insert(Arc::clone(&e));
        self.launch(&e).await?;
        Ok(id)
    }

    /// Destroys sandboxes whose TTL or lease passed and sandboxes that died (supervisor
    /// killed, init gone), recording why. Returns how many it destroyed.
    pub async fn sweep(self: &Arc<Self>) -> usize {
        let now = Instant::now();
        let mut n = 0;
        for e in self.entries() {
            // A sandbox in use is checked on a later sweep.
            let death = e
                .live
                .try_lock()
                .ok()
                .and_then(|g| g.as_ref().and_then(|sb| sb.death()));
            let r = e.record();
            if let Some(why) = death.filter(|_| matches!(r.state, State::Running | State::Ready)) {
                self.metrics.died.inc();
                log::warn("sandbox died", &[("sandbox", &r.id), ("why", &why)]);
                let _ = self.update(&e, |r| {
                    step(r, State::Failed)?;
                    r.error = Some(format!("the sandbox died: {why}"));
                    Ok(())
                });
            }
            let expired = e
                .deadline
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_some_and(|d| d <= now);
            let state = e.record().state;
            let due = (expired && matches!(state, State::Running | State::Ready))
                || state == State::Failed;
            if !due || e.sweep_failures.load(Ordering::Relaxed) >= MAX_SWEEP_DESTROYS {
                continue;
            }
            match self.destroy(&e).await {
                Ok(_) => {
                    n += 1;
                    if expired {
                        self.metrics.expired.inc();
                        log::info("sandbox expired", &[("sandbox", &r.id)]);
                    }
                }
                Err(err) => {
                    let tries = e.sweep_failures.fetch_add(1, Ordering::Relaxed) + 1;
                    log::warn(
                        "destroy failed",
                        &[
                            ("sandbox", &r.id),
                            ("error", &err.detail),
                            ("attempt", &tries.to_string()),
                        ],
                    );
                }
            }
        }
        // Every 30 sweeps: runtime dirs this node has no entry for (a create or destroy that
        // was cut short) are orphans.
        if self.sweeps.fetch_add(1, Ordering::Relaxed) % 30 == 29 {
            for id in self.rt.sandbox_dirs() {
                if self.entry(&id).is_some() {
                    continue;
                }
                let rt = Arc::clone(&self.rt);
                let oid = id.clone();
                let _ = tokio::task::spawn_blocking(move || reap_orphan(&rt, &oid)).await;
                log::warn("orphan removed", &[("sandbox", &id)]);
            }
            self.sweep_orphan_cgroups().await;
        }
        if self.sweeps.load(Ordering::Relaxed).is_multiple_of(60) {
            let app = Arc::clone(self);
            let _ = tokio::task::spawn_blocking(move || {
                app.trajectories.enforce_retention();
                let _ = app.compact_finished();
            })
            .await;
        }
        let now = now_ms();
        let day_ago = now.saturating_sub(24 * 3600 * 1000);
        let hour_ago = now.saturating_sub(3600 * 1000);
        let _ = self.store.purge_idempotent(day_ago);
        let _ = self.store.purge_stopped(hour_ago);
        self.kick_pools();
        n
    }

    /// Compacts the log: records of trajectories finished at least `compact_after` ago go.
    pub fn compact_finished(&self) -> ApiResult<serde_json::Value> {
        let before = now_ms().saturating_sub(self.compact_after.as_millis() as u64);
        let finished: std::collections::HashSet<String> = self
            .store
            .finished_trajectories(before)?
            .into_iter()
            .collect();
        if finished.is_empty() {
            return Ok(serde_json::json!({"records_dropped": 0}));
        }
        self.trajectories.compact(&finished)
    }

    /// Removes the sandbox cgroups (`dsec/sb-*`, every hierarchy) that no live sandbox of this
    /// node has: those of sandboxes this node recorded (whatever is left in them is killed),
    /// and empty ones no record names that are older than
    /// [`ORPHAN_CGROUP_GRACE`](crate::substrate::ORPHAN_CGROUP_GRACE) (another node process on
    /// this host may own a cgroup that is in use or being set up). Returns their names.
    pub async fn sweep_orphan_cgroups(self: &Arc<Self>) -> Vec<String> {
        let rt = Arc::clone(&self.rt);
        let names = tokio::task::spawn_blocking(move || rt.sandbox_cgroups())
            .await
            .unwrap_or_default();
        let mut removed = Vec::new();
        for id in names {
            if self.entry(&id).is_some() {
                continue;
            }
            let ours = matches!(self.store.sandbox(&id), Ok(Some(_)));
            let rt = Arc::clone(&self.rt);
            let oid = id.clone();
            let gone = tokio::task::spawn_blocking(move || rt.remove_orphan_cgroup(&oid, ours))
                .await
                .unwrap_or(false);
            if gone {
                log::warn("orphan cgroup removed", &[("sandbox", &id)]);
                removed.push(id);
            }
        }
        removed
    }

    /// Reconciles the store with the machine after a start: adopts sandboxes whose
    /// supervisors survived, destroys what it cannot adopt and what has no record.
    pub async fn recover(self: &Arc<Self>) -> RecoveryReport {
        let t0 = Instant::now();
        let mut report = RecoveryReport::default();
        let records = self.store.live_sandboxes().unwrap_or_default();
        let known: std::collections::HashSet<String> =
            records.iter().map(|r| r.id.clone()).collect();
        for rec in records {
            let rt = Arc::clone(&self.rt);
            let id = rec.id.clone();
            let spec = rec.spec.clone();
            let adoptable = matches!(rec.state, State::Running | State::Ready);
            let pooled_ready = rec.state == State::Ready && rec.tenant.is_none();
            let as_state = if pooled_ready {
                State::Ready
            } else {
                State::Running
            };
            let adopted = tokio::task::spawn_blocking(move || rt.adopt(&id, spec, as_state))
                .await
                .ok()
                .and_then(Result::ok);
            let e = Entry::new(rec.clone(), adopted);
            self.insert(Arc::clone(&e));
            let alive = e.lock().await.is_some();
            if alive && adoptable && rec.state == State::Ready && !pooled_ready {
                // Made for a tenant but not yet handed over when the process died: finish the
                // create, so that a retry with its idempotency key finds it running.
                let _ = self.set_state(&e, State::Running);
            }
            if alive && adoptable {
                if pooled_ready {
                    let pooled_again = {
                        let mut pools = self.pools.lock().unwrap_or_else(|p| p.into_inner());
                        pools
                            .get_mut(&rec.spec.template)
                            .map(|p| p.ready.push_back(rec.id.clone()))
                            .is_some()
                    };
                    if !pooled_again {
                        // Its pool is not configured any more.
                        let _ = self.destroy(&e).await;
                        report.reaped.push(rec.id.clone());
                        continue;
                    }
                }
                report.adopted.push(rec.id.clone());
            } else {
                // Mid-change when the previous process died, or gone: its outcome is unknown,
                // so it is destroyed rather than handed out half-made.
                let why = if alive {
                    format!(
                        "reaped at restart: it was {:?} when the node stopped",
                        rec.state
                    )
                } else {
                    "reaped at restart: its supervisor did not answer (gone)".to_owned()
                };
                let _ = self.update(&e, |r| {
                    r.error = Some(why.clone());
                    Ok(())
                });
                let _ = self.destroy(&e).await;
                report.reaped.push(rec.id.clone());
            }
        }
        // Whatever this node made (it has a runtime dir in the node's run dir) but has no
        // record of.
        let orphans: Vec<String> = self.rt.sandbox_dirs();
        for id in orphans.into_iter().filter(|id| !known.contains(id)) {
            let rt = Arc::clone(&self.rt);
            let oid = id.clone();
            let _ = tokio::task::spawn_blocking(move || reap_orphan(&rt, &oid)).await;
            report.orphans.push(id);
        }
        // Sandbox cgroups no live sandbox has (a create or destroy cut short).
        report.orphan_cgroups = self.sweep_orphan_cgroups().await;
        report.took_ms = t0.elapsed().as_millis() as u64;
        *self.recovery.lock().unwrap_or_else(|p| p.into_inner()) = report.clone();
        self.ready.store(true, Ordering::Relaxed);
        report
    }
}
