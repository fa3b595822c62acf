//! Sandboxes' network egress in the lifecycle: a create with a policy gets its path once the
//! sandbox exists (made or taken from a pool) — or, for a container launched in a pre-built
//! shell, while its launch runs —, a policy changes on a running sandbox, a destroy removes
//! the path, a restart adopts it.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use dsec_api::network::{AllowList, Egress as Policy, NetworkSpec};

use super::{Entry, Error, LifecycleEvent, Node, Result};
use crate::clock::now_ms;
use crate::egress::{Egress, EgressError};
use crate::sandbox::State;
use crate::store::{SandboxRecord, Tenant};
use crate::substrate::{OnShell, Sandbox};

/// A path out being made while its sandbox launches: the init it goes into, and the attach
/// (its address and how long it took).
type EarlyAttach = (
    i32,
    tokio::task::JoinHandle<(
        std::result::Result<std::net::Ipv4Addr, EgressError>,
        std::time::Duration,
    )>,
);

/// Where [`Node::early_network`]'s callback leaves its attach.
pub(super) type EarlySlot = Arc<Mutex<Option<EarlyAttach>>>;

impl From<EgressError> for Error {
    fn from(e: EgressError) -> Self {
        match e {
            EgressError::Unavailable(m) => Error::Unavailable(m),
            EgressError::Full => Error::Unavailable(e.to_string()),
            EgressError::Io(io) => Error::internal(format!("egress: {io}")),
        }
    }
}

/// Checks `net` against `tenant`'s ceiling; answers the policy to apply (the ceiling's caps
/// filled in). Every substrate has egress (a container a veth, a VM a tap).
pub fn admit_network(tenant: &Tenant, net: NetworkSpec) -> Result<NetworkSpec> {
    if !net.enabled() {
        return Ok(net);
    }
    let ceiling = tenant.ceiling();
    let egress = net.egress.capped_by(&ceiling);
    // The admin tenant allows reserved networks itself; another tenant only those its ceiling
    // (set by the admin) grants.
    let checked = match &egress {
        Policy::Allow(l) if tenant.admin && !l.reserved.is_empty() => Policy::Allow(AllowList {
            reserved: Vec::new(),
            ..l.clone()
        }),
        e => e.clone(),
    };
    checked
        .within(&ceiling)
        .map_err(|e| Error::Forbidden(e.to_string()))?;
    Ok(NetworkSpec { egress })
}

/// Most refusals one step's observation lists.
const MAX_STEP_REFUSALS: usize = 32;

/// Collects a sandbox's `egress_denied` events while a step runs (see [`Node::egress_watch`]).
#[derive(Debug)]
pub struct EgressWatch {
    id: String,
    rx: tokio::sync::broadcast::Receiver<LifecycleEvent>,
}

impl EgressWatch {
    /// What was refused the sandbox since the watch began (at most 32, in order).
    pub fn take(mut self) -> Vec<String> {
        let mut out = Vec::new();
        loop {
            match self.rx.try_recv() {
                Ok(ev) => {
                    if ev.sandbox == self.id && ev.event == Some("egress_denied") {
                        if let Some(d) = ev.detail {
                            if out.len() < MAX_STEP_REFUSALS {
                                out.push(d);
                            }
                        }
                    }
                }
                Err(tokio::sync::broadcast::error::TryRecvError::Lagged(_)) => continue,
                Err(_) => return out,
            }
        }
    }
}

impl Node {
    /// Starts collecting sandbox `id`'s refusals (a logged step's observation lists them).
    pub fn egress_watch(&self, id: &str) -> EgressWatch {
        EgressWatch {
            id: id.to_owned(),
            rx: self.events.subscribe(),
        }
    }

    /// The node's egress, started now if no sandbox needed it before.
    pub fn egress(self: &Arc<Self>) -> Result<Arc<Egress>> {
        let mut slot = self.egress.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(eg) = slot.as_ref() {
            return Ok(Arc::clone(eg));
        }
        let mut cfg = self.egress_config.get().cloned().unwrap_or_default();
        cfg.never.extend(
            self.never_extra
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter(),
        );
        let weak = Arc::downgrade(self);
        let on_denied = Box::new(move |id: &str, what: &str| {
            if let Some(node) = weak.upgrade() {
                node.egress_denied(id, what);
            }
        });
        let rt = tokio::runtime::Handle::try_current()
            .map_err(|_| Error::internal("egress started outside the runtime"))?;
        let eg = Egress::start(cfg, &self.rt.config().data_dir, &rt, on_denied)?;
        *slot = Some(Arc::clone(&eg));
        Ok(eg)
    }

    /// Adds `nets` to the networks no sandbox of this node reaches (the cluster's gateways, as
    /// they register): at once if egress runs, from its start otherwise.
    pub fn never_reach(&self, nets: &[(std::net::Ipv4Addr, u8)]) {
        // The slot's lock first, as `egress` takes them: no start in between misses one.
        let slot = self.egress.lock().unwrap_or_else(|p| p.into_inner());
        let mut extra = self.never_extra.lock().unwrap_or_else(|p| p.into_inner());
        let new: Vec<_> = nets
            .iter()
            .copied()
            .filter(|n| !extra.contains(n))
            .collect();
        if new.is_empty() {
            return;
        }
        extra.extend(new.iter().copied());
        if let Some(eg) = slot.as_ref() {
            if let Err(e) = eg.add_never(&new) {
                tracing::warn!(error = %e, "egress: could not add networks no sandbox reaches");
            }
        }
    }

    /// The node's egress if it was started.
    pub fn egress_if_started(&self) -> Option<Arc<Egress>> {
        self.egress
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// An `egress_denied` event (and a count).
    fn egress_denied(&self, id: &str, what: &str) {
        self.metrics.egress_denied.inc();
        let Some(e) = self.entry(id) else { return };
        let rec = e.record();
        tracing::info!(sandbox = %id, denied = %what, "egress denied");
        let _ = self.events.send(LifecycleEvent {
            sandbox: rec.id,
            tenant: rec.tenant,
            state: rec.state,
            version: rec.version,
            at_ms: now_ms(),
            event: Some("egress_denied"),
            detail: Some(what.chars().take(300).collect()),
        });
    }

    /// For a container create that asks for a path out: the callback that starts the attach
    /// as soon as the launch is in a pre-built shell's hands (the shell's namespaces exist
    /// before its sandbox does), and where it leaves it. The veth, addresses and elements are
    /// then made while the sandbox's init and agent start, not after: the attach (~1 ms)
    /// leaves the create's path. `None` when the sandbox gets its path the usual way.
    pub(super) fn early_network(
        self: &Arc<Self>,
        id: &str,
        spec: &crate::sandbox::SandboxSpec,
        net: Option<&NetworkSpec>,
    ) -> Option<(OnShell, EarlySlot)> {
        let net = net.filter(|n| n.enabled())?;
        if spec.substrate.is_vm() || !spec.userns {
            return None;
        }
        let eg = self.egress().ok()?;
        let slot: EarlySlot = Arc::default();
        let (mine, id, policy) = (Arc::clone(&slot), id.to_owned(), net.egress.clone());
        let handle = tokio::runtime::Handle::current();
        let f: OnShell = Box::new(move |pid| {
            let h = handle.spawn_blocking(move || {
                let t0 = Instant::now();
                (eg.attach(&id, pid, &policy), t0.elapsed())
            });
            *mine.lock().unwrap_or_else(|p| p.into_inner()) = Some((pid, h));
        });
        Some((f, slot))
    }

    /// Settles an early attach once the launch is over: `init` is the launched sandbox's init
    /// (`None`: the launch failed). The sandbox's record gets the path (its `net_addr`, which
    /// tells the create it needs no attach after); a path made for an init that is not the
    /// sandbox's, or for a launch that failed, is removed.
    pub(super) async fn settle_early_network(
        &self,
        e: &Arc<Entry>,
        slot: &EarlySlot,
        init: Option<i32>,
        net: &NetworkSpec,
    ) {
        let started = slot.lock().unwrap_or_else(|p| p.into_inner()).take();
        let Some((pid, h)) = started else {
            return;
        };
        let addr = match h.await {
            Ok((Ok(addr), took)) => {
                self.metrics.egress_attach.observe_duration(took);
                Some(addr)
            }
            // (A failed attach removed what it made; the usual attach tries again.)
            Ok((Err(err), _)) => {
                tracing::debug!(sandbox = %e.id, error = %err, "egress: early attach failed");
                return;
            }
            // The attach panicked: whatever it made goes below.
            Err(_) => None,
        };
        if let Some(addr) = addr.filter(|_| init == Some(pid)) {
            if self.record_network(e, net, addr).is_ok() {
                self.metrics.egress_attach_early.inc();
                return;
            }
        }
        self.detach_network(&e.id).await;
    }

    /// Records sandbox `e`'s path out: its policy and address.
    fn record_network(
        &self,
        e: &Arc<Entry>,
        net: &NetworkSpec,
        addr: std::net::Ipv4Addr,
    ) -> Result<SandboxRecord> {
        self.update(e, |r| {
            r.network = net.clone();
            r.net_addr = Some(addr);
            Ok(())
        })
    }

    /// Gives sandbox `e` (made, or just taken from a pool) its path out under `net`; a failure
    /// destroys it (a sandbox is never handed over without the network it asked for).
    pub(super) async fn attach_network(
        self: &Arc<Self>,
        e: &Arc<Entry>,
        net: NetworkSpec,
    ) -> Result<SandboxRecord> {
        let attached = self.attach_now(e, &net).await;
        match attached {
            Ok(addr) => self.record_network(e, &net, addr),
            Err(err) => {
                tracing::warn!(sandbox = %e.id, error = %err, "egress: attach failed");
                let _ = self.destroy(e).await;
                Err(err)
            }
        }
    }

    async fn attach_now(
        self: &Arc<Self>,
        e: &Arc<Entry>,
        net: &NetworkSpec,
    ) -> Result<std::net::Ipv4Addr> {
        let eg = self.egress()?;
        if e.record().spec.substrate.is_vm() {
            return self.attach_vm_now(e, eg, net).await;
        }
        let Some((_, init)) = e.pids() else {
            return Err(Error::NotFound(e.id.clone()));
        };
        let (id, policy) = (e.id.clone(), net.egress.clone());
        let t0 = std::time::Instant::now();
        let addr = tokio::task::spawn_blocking(move || eg.attach(&id, init, &policy))
            .await
            .map_err(|err| Error::internal(err.to_string()))??;
        self.metrics.egress_attach.observe_duration(t0.elapsed());
        Ok(addr)
    }

    /// A VM's path out: its address and elements, then a tap plugged into its QEMU and the
    /// guest's side configured (on a blocking thread, the sandbox locked meanwhile).
    async fn attach_vm_now(
        self: &Arc<Self>,
        e: &Arc<Entry>,
        eg: Arc<Egress>,
        net: &NetworkSpec,
    ) -> Result<std::net::Ipv4Addr> {
        let mut guard = e.lock().await;
        self.plug_vm(e, &mut guard, eg, net).await
    }

    /// [`Node::attach_vm_now`] on the sandbox `live` its caller has locked.
    async fn plug_vm(
        &self,
        e: &Arc<Entry>,
        live: &mut Option<Sandbox>,
        eg: Arc<Egress>,
        net: &NetworkSpec,
    ) -> Result<std::net::Ipv4Addr> {
        let (id, policy) = (e.id.clone(), net.egress.clone());
        let t0 = std::time::Instant::now();
        let eg2 = Arc::clone(&eg);
        let path = tokio::task::spawn_blocking(move || eg2.attach_vm(&id, &policy))
            .await
            .map_err(|err| Error::internal(err.to_string()))??;
        let result = match live.take() {
            None => Err(Error::NotFound(e.id.clone())),
            Some(mut sb) => {
                let plugged = path.clone();
                let (sb, r) = tokio::task::spawn_blocking(move || {
                    let r = sb.attach_vm_net(plugged);
                    (sb, r)
                })
                .await
                .map_err(|err| Error::internal(err.to_string()))?;
                *live = Some(sb);
                r.map_err(Error::from)
            }
        };
        if let Err(err) = result {
            let id = e.id.clone();
            let _ = tokio::task::spawn_blocking(move || eg.detach(&id)).await;
            return Err(err);
        }
        self.metrics.egress_attach.observe_duration(t0.elapsed());
        Ok(path.addr)
    }

    /// Replaces the network policy of a running sandbox of `tenant`: a sandbox without a path
    /// gets one; a container whose policy becomes `none` loses it (a VM keeps its tap, see
    /// [`Node::set_vm_network`]).
    pub async fn set_network(
        self: &Arc<Self>,
        e: &Arc<Entry>,
        tenant: &Tenant,
        net: NetworkSpec,
    ) -> Result<SandboxRecord> {
        let rec = e.record();
        let net = admit_network(tenant, net)?;
        let mut guard = e.lock().await;
        if e.record().state != State::Running {
            return Err(Error::Transition(format!(
                "cannot change the network of a {:?} sandbox",
                e.record().state
            )));
        }
        if rec.spec.substrate.is_vm() {
            return self.set_vm_network(e, &mut guard, net).await;
        }
        match (rec.net_addr.is_some(), net.enabled()) {
            (false, false) => Ok(rec),
            (false, true) => {
                let addr = self.attach_now(e, &net).await?;
                self.update(e, |r| {
                    r.network = net.clone();
                    r.net_addr = Some(addr);
                    Ok(())
                })
            }
            (true, false) => {
                self.detach_network(&e.id).await;
                self.update(e, |r| {
                    r.network = NetworkSpec::default();
                    r.net_addr = None;
                    Ok(())
                })
            }
            (true, true) => {
                let eg = self.egress()?;
                let (id, policy) = (e.id.clone(), net.egress.clone());
                tokio::task::spawn_blocking(move || eg.set_policy(&id, &policy))
                    .await
                    .map_err(|err| Error::internal(err.to_string()))??;
                self.update(e, |r| {
                    r.network = net.clone();
                    Ok(())
                })
            }
        }
    }

    /// A running VM's policy change (`live` locked by the caller). A VM without a tap gets one
    /// plugged into its QEMU. One with a tap keeps it whatever the policy becomes: re-plugging
    /// a running QEMU's NIC left the guest's link dead (its ARP never completed), so `none`
    /// keeps the tap and the address, the table drops everything the guest sends, and the
    /// guest's `eth0` goes down (connections fail at once); opening again brings it back up.
    async fn set_vm_network(
        self: &Arc<Self>,
        e: &Arc<Entry>,
        live: &mut Option<Sandbox>,
        net: NetworkSpec,
    ) -> Result<SandboxRecord> {
        let rec = e.record();
        if rec.net_addr.is_none() {
            if !net.enabled() {
                return Ok(rec);
            }
            let addr = self.plug_vm(e, live, self.egress()?, &net).await?;
            return self.update(e, |r| {
                r.network = net.clone();
                r.net_addr = Some(addr);
                Ok(())
            });
        }
        let eg = self.egress()?;
        let (id, policy) = (e.id.clone(), net.egress.clone());
        let eg2 = Arc::clone(&eg);
        tokio::task::spawn_blocking(move || eg2.set_policy(&id, &policy))
            .await
            .map_err(|err| Error::internal(err.to_string()))??;
        let path = eg
            .vm_path(&e.id)
            .ok_or_else(|| Error::internal(format!("{}: its path out is gone", e.id)))?;
        let Some(mut sb) = live.take() else {
            return Err(Error::NotFound(e.id.clone()));
        };
        let reopen = rec.network.enabled() != net.enabled();
        let (sb, r) = tokio::task::spawn_blocking(move || {
            let r = if reopen {
                sb.reopen_vm_net(path)
            } else {
                // The same guest side; later QEMUs get the new bandwidth cap.
                sb.set_vm_net(Some(path));
                Ok(())
            };
            (sb, r)
        })
        .await
        .map_err(|err| Error::internal(err.to_string()))?;
        *live = Some(sb);
        r?;
        self.update(e, |r| {
            r.network = net.clone();
            Ok(())
        })
    }

    /// Removes sandbox `id`'s path out, if it has one.
    pub(super) async fn detach_network(&self, id: &str) {
        if let Some(eg) = self.egress_if_started() {
            let id = id.to_owned();
            let _ = tokio::task::spawn_blocking(move || eg.detach(&id)).await;
        }
    }

    /// After a restart: starts egress when the previous process had it, takes back the paths
    /// of adopted sandboxes, and removes the node's table when none is left.
    pub(super) async fn adopt_networks(self: &Arc<Self>) {
        let had = crate::egress::index_file(&self.rt.config().data_dir).exists();
        let with_net: Vec<Arc<Entry>> = self
            .entries()
            .into_iter()
            .filter(|e| e.record().net_addr.is_some())
            .collect();
        if !had && with_net.is_empty() {
            return;
        }
        let eg = match self.egress() {
            Ok(eg) => eg,
            Err(err) => {
                tracing::warn!(error = %err, "egress: not restarted; sandboxes with a path out are destroyed");
                for e in with_net {
                    let _ = self.destroy(&e).await;
                }
                return;
            }
        };
        for e in with_net {
            let rec = e.record();
            let Some(addr) = rec.net_addr else { continue };
            let (eg2, id, policy) = (Arc::clone(&eg), rec.id.clone(), rec.network.egress.clone());
            let adopted = tokio::task::spawn_blocking(move || eg2.adopt(&id, addr, &policy))
                .await
                .map_err(|err| Error::internal(err.to_string()))
                .and_then(|r| r.map_err(Error::from));
            if let Err(err) = adopted {
                tracing::warn!(sandbox = %rec.id, error = %err, "egress: not adopted; destroyed");
                let _ = self.destroy(&e).await;
            } else if rec.spec.substrate.is_vm() {
                // Its QEMU kept its tap; a later QEMU of it (reset) gets a new one.
                if let Some(sb) = e.lock().await.as_mut() {
                    sb.set_vm_net(eg.vm_path(&rec.id));
                }
            }
        }
        self.egress_idle_teardown();
    }

    /// Removes the node's egress table when no sandbox has a path out (at a restart that
    /// adopted none, at a stop that leaves none).
    pub fn egress_idle_teardown(&self) {
        let mut slot = self.egress.lock().unwrap_or_else(|p| p.into_inner());
        if slot.as_ref().is_some_and(|eg| eg.attached() == 0) {
            if let Some(eg) = slot.take() {
                eg.teardown();
                Egress::restore_forwarding();
                let _ = std::fs::remove_file(crate::egress::index_file(&self.rt.config().data_dir));
            }
        }
    }
}
