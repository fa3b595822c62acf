//! The node's live state and the sandbox lifecycle driven through it, apart from any transport:
//! the HTTP API, the code runner and the CLI all drive sandboxes through [`Node`].
//!
//! Every sandbox the node owns has an [`Entry`]: its record (persisted on every change, before
//! the change is acknowledged) and, while it lives, the runtime [`Sandbox`] behind an async
//! mutex (one agent conversation at a time). Runtime calls block, so they run on tokio's
//! blocking pool. Each operation has its file: [`create`], [`destroy`], [`reset`] (and
//! leases), [`pools`], [`sweep`], [`recover`]; they fail with [`Error`], which the server maps
//! to wire codes in one place.

pub mod cpu_share;
mod create;
mod destroy;
mod entry;
mod error;
pub mod follow;
mod metrics;
pub mod network;
mod pools;
mod recover;
mod reset;
pub mod snapshot;
mod sweep;

pub use create::{ClusterQuota, CreateRequest, TemplateFetcher};
pub use entry::Entry;
pub use error::{chain, Error, Result};
pub use follow::{follow, Follow};
pub use metrics::Metrics;
pub use pools::{parse_pool_name, pool_name, PoolSize};
pub use recover::RecoveryReport;
pub use sweep::MAX_SWEEP_DESTROYS;

use entry::deadline_of;
use pools::PoolState;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde::Serialize;
use tokio::sync::broadcast;

use crate::clock::now_ms;
use crate::sandbox::State;
use crate::store::{SandboxRecord, Store, Tenant};
use crate::substrate::Runtime;

/// Moves a record to `to` through the lifecycle's transition function (the only way states
/// change).
fn step(r: &mut SandboxRecord, to: State) -> Result<()> {
    r.state = r.state.transition(to)?;
    Ok(())
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
    /// What happened besides a state change (`egress_denied`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub event: Option<&'static str>,
    /// Its detail (the name or address refused).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// Shared state of the node daemon.
pub struct Node {
    /// The crash point `DSEC_FAILPOINT` names, read once at start (see [`Node::failpoint`]).
    failpoint: Option<String>,
    /// The container runtime.
    pub rt: Arc<Runtime>,
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
    /// Sandboxes that wait before sandboxes that spin.
    pub cpu_shares: cpu_share::CpuShares,
    /// Its warm pools hold no ready sandbox (the node is drained out of its cluster).
    pools_drained: AtomicBool,
    /// Tenants' quotas across its cluster (in a cluster).
    pub quota: std::sync::OnceLock<Arc<dyn create::ClusterQuota>>,
    /// Where templates it does not hold come from (in a cluster).
    pub fetcher: std::sync::OnceLock<Arc<dyn create::TemplateFetcher>>,
    /// Snapshot layers on disk.
    pub snapshots: crate::snapshot::LayerStore,
    /// Held shared while a snapshot layer is written and recorded, exclusively while
    /// unreferenced layers are collected.
    snapshot_gc: tokio::sync::RwLock<()>,
    /// How egress is set up, once the daemon's flags are read.
    pub egress_config: std::sync::OnceLock<crate::egress::EgressConfig>,
    /// The node's egress, started by the first sandbox that needs a path out.
    egress: Mutex<Option<Arc<crate::egress::Egress>>>,
    /// Networks no sandbox reaches learnt while the node runs (the cluster's gateways; see
    /// [`Node::never_reach`]).
    never_extra: Mutex<Vec<(std::net::Ipv4Addr, u8)>>,
}

/// Counts a request as in flight while it lives.
#[derive(Debug)]
pub struct InFlight(Arc<Node>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node").finish_non_exhaustive()
    }
}

impl Node {
    /// Wraps a started runtime and an open store.
    pub fn new(rt: Arc<Runtime>, store: Store, max_sandboxes: usize) -> Arc<Self> {
        let (events, _) = broadcast::channel(1024);
        Arc::new(Self {
            snapshots: crate::snapshot::LayerStore::open(&rt.config().data_dir),
            snapshot_gc: tokio::sync::RwLock::new(()),
            failpoint: std::env::var("DSEC_FAILPOINT").ok(),
            rt,
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
            sweeps: std::sync::atomic::AtomicU64::new(0),
            cpu_shares: cpu_share::CpuShares::default(),
            fetcher: std::sync::OnceLock::new(),
            quota: std::sync::OnceLock::new(),
            pools_drained: AtomicBool::new(false),
            metrics: Metrics::new(),
            started: Instant::now(),
            in_flight: std::sync::atomic::AtomicUsize::new(0),
            egress_config: std::sync::OnceLock::new(),
            egress: Mutex::new(None),
            never_extra: Mutex::new(Vec::new()),
        })
    }

    /// Kills the process with SIGKILL when `DSEC_FAILPOINT` names this point: the crash tests
    /// (F-01) stop the daemon at each named step of a create exactly as `kill -9` would.
    ///
    /// `DSEC_FAILPOINT=<point>=sleep:<ms>` sleeps there instead (the tests of races, e.g. a
    /// destroy during a create, F-15).
    pub fn failpoint(&self, name: &str) {
        let Some(point) = self.failpoint.as_deref() else {
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
            tracing::warn!(point = %name, "failpoint hit");
            let _ = rustix::process::kill_process(
                rustix::process::getpid(),
                rustix::process::Signal::KILL,
            );
        }
    }

    /// Marks a request in flight until the guard drops.
    pub fn track(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(Arc::clone(self))
    }

    /// The most sandboxes (pools included) this node holds.
    pub fn max_sandboxes(&self) -> usize {
        self.max_sandboxes
    }

    /// Requests being served.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// The tenant of an API key hash (cached).
    pub fn tenant_for_key(&self, hash: &str) -> Result<Option<Tenant>> {
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
    pub fn owned(&self, tenant: &Tenant, id: &str) -> Result<Arc<Entry>> {
        match self.entry(id) {
            Some(e) if e.record().tenant.as_deref() == Some(&tenant.id) => Ok(e),
            _ => Err(Error::NotFound(id.to_string())),
        }
    }

    /// Like [`Node::owned`], but the admin tenant reaches every tenant's sandboxes (operators
    /// inspect and clean up through it).
    pub fn owned_or_admin(&self, tenant: &Tenant, id: &str) -> Result<Arc<Entry>> {
        if tenant.admin {
            return self
                .entry(id)
                .ok_or_else(|| Error::NotFound(id.to_string()));
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
        f: impl FnOnce(&mut SandboxRecord) -> Result<()>,
    ) -> Result<SandboxRecord> {
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
            event: None,
            detail: None,
        });
        Ok(rec)
    }

    fn set_state(&self, e: &Entry, to: State) -> Result<SandboxRecord> {
        self.update(e, |r| {
            r.state = r.state.transition(to)?;
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

    fn check_draining(&self) -> Result<()> {
        if self.draining.load(Ordering::Relaxed) {
            return Err(Error::Draining);
        }
        Ok(())
    }
}
