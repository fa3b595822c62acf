//! Creating a sandbox: quota and capacity checks, a pool hit or an on-demand launch.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use dsec_api::network::NetworkSpec;

use super::pools::pool_key;
use super::{step, Entry, Error, Node, Result};
use crate::capacity::Admitted;
use crate::clock::now_ms;
use crate::sandbox::{SandboxSpec, State, Substrate};
use crate::store::{SandboxRecord, Tenant};

/// Where a node gets the templates it does not hold (a cluster's member).
pub trait TemplateFetcher: Send + Sync + std::fmt::Debug {
    /// Whether template `name` exists elsewhere (blocking).
    fn knows(&self, name: &str) -> std::result::Result<bool, String>;
    /// Makes template `name` local: `None` when it already was, else what was fetched
    /// (blocking).
    fn fetch(
        &self,
        store: &crate::template::TemplateStore,
        name: &str,
    ) -> std::result::Result<Option<dsec_api::sandbox::Fetched>, String>;
}

/// A tenant's quota across a cluster (its member): reservations made before a node adds a
/// sandbox of a tenant with `max_sandboxes`, released when it is gone.
pub trait ClusterQuota: Send + Sync + std::fmt::Debug {
    /// Reserves `n` sandboxes of tenant `name` whose quota is `max`: `false` when the cluster
    /// holds `max` already (blocking).
    fn reserve(&self, name: &str, max: u64, n: u64) -> std::result::Result<bool, String>;
    /// Releases `n` (blocking; a failure is fixed by the next reconciliation).
    fn release(&self, name: &str, n: u64);
}

/// What a create asks for.
#[derive(Debug, Clone)]
pub struct CreateRequest {
    /// Template name.
    pub template: String,
    /// Substrate.
    pub substrate: Substrate,
    /// Limits, admitted by this node where the request came in.
    pub limits: Admitted,
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
    /// Run in a user namespace (root inside mapped to an unprivileged host id range of the
    /// sandbox's own). On by default; only an admin tenant may turn it off.
    pub userns: bool,
    /// Made from this snapshot (its template and substrate replace the request's).
    pub snapshot: Option<String>,
    /// The snapshot's layer directories, topmost first: resolved by the node.
    pub layers: Vec<String>,
    /// Network egress, admitted against the tenant's ceiling.
    pub network: dsec_api::network::NetworkSpec,
}

impl Default for CreateRequest {
    fn default() -> Self {
        Self {
            template: String::new(),
            substrate: Substrate::default(),
            limits: Admitted::default(),
            env: BTreeMap::new(),
            labels: BTreeMap::new(),
            ttl_ms: None,
            lease_ms: None,
            writable_root: false,
            idem: None,
            secret_env: Vec::new(),
            userns: true,
            snapshot: None,
            layers: Vec::new(),
            network: dsec_api::network::NetworkSpec::default(),
        }
    }
}

impl CreateRequest {
    /// A create of the `host` template with default limits (the one warm pools serve).
    pub fn host() -> Self {
        Self {
            template: "host".into(),
            ..Self::default()
        }
    }
}

impl Node {
    /// Whether template `name` is here, or (in a cluster) can be fetched (blocking).
    pub fn template_known(&self, name: &str) -> Result<()> {
        match self.rt.templates().get(name) {
            Err(crate::template::TemplateError::NotFound { .. }) => {
                if let Some(f) = self.fetcher.get() {
                    if f.knows(name)
                        .map_err(|e| Error::Unavailable(format!("the cluster's store: {e}")))?
                    {
                        return Ok(());
                    }
                }
                Err(crate::template::TemplateError::NotFound {
                    name: name.to_owned(),
                }
                .into())
            }
            r => r.map(|_| ()).map_err(Into::into),
        }
    }

    /// In a cluster, fetches the sandbox's template when the node does not hold it: the
    /// sandbox shows the `fetching` phase meanwhile, and what came from where after.
    async fn fetch_template(self: &Arc<Self>, e: &Arc<Entry>, template: &str) -> Result<()> {
        let Some(m) = self.fetcher.get().cloned() else {
            return Ok(());
        };
        let (rt, name) = (Arc::clone(&self.rt), template.to_owned());
        let held = {
            let (rt, name) = (Arc::clone(&rt), name.clone());
            tokio::task::spawn_blocking(move || name == "host" || rt.templates().get(&name).is_ok())
                .await
                .unwrap_or(false)
        };
        if held {
            return Ok(());
        }
        self.update(e, |r| {
            r.phase = Some("fetching".into());
            Ok(())
        })?;
        let got = tokio::task::spawn_blocking(move || m.fetch(rt.templates(), &name))
            .await
            .map_err(|err| Error::internal(err.to_string()))?;
        let fetched = match got {
            Ok(f) => f,
            Err(err) => return Err(Error::Unavailable(format!("fetch the template: {err}"))),
        };
        self.update(e, |r| {
            r.phase = None;
            r.fetched = fetched;
            Ok(())
        })?;
        Ok(())
    }

    /// Creates (or takes from the pool) a sandbox for `tenant`.
    pub async fn create(
        self: &Arc<Self>,
        tenant: &Tenant,
        mut req: CreateRequest,
    ) -> Result<SandboxRecord> {
        self.check_draining()?;
        self.resolve_snapshot(tenant, &mut req)?;
        if req.template != "host" {
            let (name, node) = (req.template.clone(), Arc::clone(self));
            tokio::task::spawn_blocking(move || node.template_known(&name))
                .await
                .map_err(|e| Error::internal(e.to_string()))??;
        }
        if let Some(key) = &req.idem {
            if let Some(rec) = self.store.sandbox_by_idem(&tenant.id, key)? {
                if rec.state != State::Stopped {
                    return Ok(self.entry(&rec.id).map_or(rec, |e| e.record()));
                }
            }
        }
        let reserved = self.reserve_in_cluster(tenant).await?;
        let net = req.network.clone();
        let mut made = self.create_here(tenant, req).await;
        if let (true, Ok(rec)) = (net.enabled() && !made_with(&made), &made) {
            // The path out comes once the sandbox exists, made or pooled alike (unless it came
            // during the launch); a failure destroys it (its destroy releases its cluster
            // reservation).
            match self.entry(&rec.id) {
                Some(e) => return self.attach_network(&e, net).await,
                None => made = Err(Error::NotFound(rec.id.clone())),
            }
        }
        if reserved && matches!(&made, Err(e) if !matches!(e, Error::Transition(_))) {
            // (A sandbox destroyed while it was made is released by its destroy.)
            self.release_in_cluster(&tenant.name).await;
        }
        made
    }

    /// In a cluster, reserves one sandbox of `tenant` against its `max_sandboxes` across the
    /// cluster: answers whether it reserved (a tenant without a quota needs none).
    async fn reserve_in_cluster(&self, tenant: &Tenant) -> Result<bool> {
        let (Some(max), Some(q)) = (tenant.max_sandboxes, self.quota.get().cloned()) else {
            return Ok(false);
        };
        let name = tenant.name.clone();
        let ok = tokio::task::spawn_blocking(move || q.reserve(&name, max, 1))
            .await
            .map_err(|e| Error::internal(e.to_string()))?
            .map_err(|e| Error::Unavailable(format!("the cluster's store: {e}")))?;
        if !ok {
            return Err(Error::Quota(format!(
                "tenant {} may hold at most {max} sandboxes across the cluster",
                tenant.name
            )));
        }
        Ok(true)
    }

    /// Releases one sandbox of tenant `name` reserved with [`Node::reserve_in_cluster`].
    pub(super) async fn release_in_cluster(&self, name: &str) {
        if let Some(q) = self.quota.get().cloned() {
            let name = name.to_owned();
            let _ = tokio::task::spawn_blocking(move || q.release(&name, 1)).await;
        }
    }

    /// The create itself, once the cluster (if any) granted it.
    async fn create_here(
        self: &Arc<Self>,
        tenant: &Tenant,
        req: CreateRequest,
    ) -> Result<SandboxRecord> {
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
                return Err(Error::Quota(format!(
                    "tenant {} may hold at most {} sandboxes",
                    tenant.name, n
                )));
            }
            if tenant
                .max_memory_bytes
                .is_some_and(|m| mem + req.limits.memory_max > m)
            {
                return Err(Error::Quota(format!(
                    "tenant {} memory quota exceeded",
                    tenant.name
                )));
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
                        return Err(Error::Full(self.max_sandboxes));
                    }
                    let id = crate::substrate::new_id();
                    let spec = SandboxSpec {
                        template: req.template.clone(),
                        limits: req.limits.clone(),
                        writable_root: req.writable_root,
                        substrate: req.substrate,
                        userns: req.userns,
                        snapshot: req.snapshot.clone(),
                        layers: req.layers.clone(),
                        ..SandboxSpec::default()
                    };
                    let mut rec = SandboxRecord::creating(id.clone(), spec, now);
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
                    sb.mark_acquired()?;
                }
                let rec = self.update(&e, |r| {
                    fill(r);
                    r.pooled = true;
                    r.state = r.state.transition(State::Running)?;
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
                self.launch_with(&e, Some(&req.network)).await?;
                self.metrics.acquire_miss.observe_duration(t0.elapsed());
                Ok(e.record())
            }
        }
    }

    /// Runs the runtime create for a `Creating` entry; on success the entry is `Ready` with
    /// its sandbox, on failure it is closed and the error returned.
    pub(super) async fn launch(self: &Arc<Self>, e: &Arc<Entry>) -> Result<()> {
        self.launch_with(e, None).await
    }

    /// [`Node::launch`] for a create that asks for `net`: a container launched in a
    /// pre-built shell gets its path out while it launches (see [`Node::early_network`]).
    pub(super) async fn launch_with(
        self: &Arc<Self>,
        e: &Arc<Entry>,
        net: Option<&NetworkSpec>,
    ) -> Result<()> {
        let spec = e.record().spec;
        let rt = Arc::clone(&self.rt);
        let _slot = self
            .create_slots
            .acquire()
            .await
            .map_err(|_| Error::internal("create slots closed"))?;
        // The entry stays locked until the sandbox is recorded `ready`: a destroy that comes in
        // meanwhile waits, then destroys what was made (destroy wins, nothing is orphaned).
        let mut guard = e.lock().await;
        if e.record().state != State::Creating {
            return Err(Error::Transition(format!(
                "sandbox {} was destroyed while it was created",
                e.id
            )));
        }
        self.failpoint("create:before_launch");
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
        if let Err(err) = self.fetch_template(e, &spec.template).await {
            drop(guard);
            let detail = err.detail();
            let _ = self.update(e, |r| {
                // Nothing of it exists: failed, then closed.
                step(r, State::Failed)?;
                step(r, State::Stopping)?;
                step(r, State::Stopped)?;
                r.phase = None;
                r.error = Some(detail.clone());
                Ok(())
            });
            self.remove(&e.id);
            return Err(err);
        }
        if preparing {
            self.update(e, |r| {
                r.phase = Some("preparing".into());
                Ok(())
            })?;
        }
        let node = Arc::clone(self);
        let (on_shell, early) = self.early_network(&id, &spec, net).unzip();
        let made = tokio::task::spawn_blocking(move || {
            node.failpoint("create:launching");
            let mut made = rt.create_early(&id, &spec, on_shell);
            if let (true, Ok((sb, _))) = (pooled, &mut made) {
                sb.warm_up(&rt);
            }
            made
        })
        .await
        .map_err(|err| Error::internal(err.to_string()))?;
        if preparing {
            self.update(e, |r| {
                r.phase = None;
                Ok(())
            })?;
        }
        if let (Some(slot), Some(net)) = (&early, net) {
            let init = made.as_ref().ok().map(|(sb, _)| sb.init_pid());
            self.settle_early_network(e, slot, init, net).await;
        }
        match made {
            Ok((mut sb, phases)) => {
                self.failpoint("create:after_launch");
                let us = |v: u64| std::time::Duration::from_micros(v);
                match sb.substrate() {
                    // (A function call's sandbox is a container.)
                    Substrate::Container | Substrate::Function => {
                        let m = &self.metrics;
                        for (h, v) in [
                            (&m.phase_launch, phases.launch_us),
                            (&m.phase_hello, phases.hello_us),
                            (&m.phase_cgroup, phases.cgroup_us),
                            (&m.phase_clone_exec, phases.clone_exec_us),
                        ] {
                            h.observe_duration(us(v));
                        }
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
                    sb.mark_acquired()?;
                }
                e.set_pids(Some(&sb));
                *guard = Some(sb);
                if e.doomed.load(Ordering::SeqCst) {
                    // The waiting destroy takes it from here.
                    return Err(Error::Transition(format!(
                        "sandbox {} was destroyed while it was created",
                        e.id
                    )));
                }
                self.set_state(e, State::Ready)?;
                self.failpoint("create:after_ready");
                if for_tenant {
                    self.set_state(e, State::Running)?;
                }
                drop(guard);
                Ok(())
            }
            Err(err) => {
                drop(guard);
                self.metrics.create_failed.inc();
                let err = Error::from(err);
                let detail = err.detail();
                let _ = self.update(e, |r| {
                    // Nothing of it exists: failed, then closed.
                    step(r, State::Failed)?;
                    step(r, State::Stopping)?;
                    step(r, State::Stopped)?;
                    r.error = Some(detail.clone());
                    Ok(())
                });
                self.remove(&e.id);
                tracing::warn!(sandbox = %e.id, error = %detail, "create failed");
                Err(err)
            }
        }
    }
}

/// Whether a create's sandbox got its path out during its launch.
fn made_with(made: &Result<SandboxRecord>) -> bool {
    made.as_ref().is_ok_and(|r| r.net_addr.is_some())
}
