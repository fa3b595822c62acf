//! Warm pools per template and substrate, sized by the autoscaler, refilled in the background.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use super::{CreateRequest, Entry, Error, Node, Result};
use crate::autoscale::{AutoscaleConfig, Autoscaler};
use crate::clock::now_ms;
use crate::sandbox::{Limits, SandboxSpec, Substrate};
use crate::store::SandboxRecord;

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
pub(super) struct PoolState {
    pub(super) scaler: Autoscaler,
    pub(super) ready: VecDeque<String>,
    pub(super) creating: usize,
}

impl PoolState {
    pub(super) fn new(size: PoolSize) -> Result<Self, String> {
        let scaler = Autoscaler::new(AutoscaleConfig::new(size.min, size.max), Instant::now())
            .map_err(|e| e.to_string())?;
        Ok(Self {
            scaler,
            ready: VecDeque::new(),
            creating: 0,
        })
    }
}

pub(super) fn pool_key(req: &CreateRequest) -> Option<String> {
    (*req.limits == Limits::default()
        && !req.writable_root
        && req.snapshot.is_none()
        && req.userns != req.substrate.is_vm())
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

impl Node {
    /// Sets a template's pool bounds (the size between them follows demand).
    pub fn set_pool(self: &Arc<Self>, template: &str, size: PoolSize) -> Result<()> {
        self.store.put_pool(template, size.min, size.max)?;
        self.configure_pool(template, size)
    }

    /// Sets a pool's bounds in memory only (at start, from the store).
    pub fn configure_pool(self: &Arc<Self>, template: &str, size: PoolSize) -> Result<()> {
        {
            let mut pools = self.pools.lock().unwrap_or_else(|p| p.into_inner());
            let mut fresh = PoolState::new(size).map_err(Error::Invalid)?;
            if let Some(old) = pools.remove(template) {
                fresh.ready = old.ready;
                fresh.creating = old.creating;
            }
            pools.insert(template.to_owned(), fresh);
        }
        self.kick_pools();
        Ok(())
    }

    /// Empties the warm pools and keeps them empty (`true`: the node is drained out of its
    /// cluster and takes no new placements), or lets them refill (`false`).
    pub fn drain_pools(self: &Arc<Self>, drained: bool) {
        if self.pools_drained.swap(drained, Ordering::Relaxed) != drained {
            tracing::info!(drained = %drained, "pools");
            self.kick_pools();
        }
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
            let drained = self.pools_drained.load(Ordering::Relaxed);
            for (t, p) in pools.iter_mut() {
                if drained {
                    surplus.extend(p.ready.drain(..));
                    continue;
                }
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

    async fn fill_one(self: &Arc<Self>, pool: &str) -> Result<String> {
        let (template, substrate) = parse_pool_name(pool)
            .ok_or_else(|| Error::invalid(format!("bad pool name {pool:?}")))?;
        let id = crate::substrate::new_id();
        let spec = SandboxSpec {
            template: template.to_owned(),
            substrate,
            // A container has a user namespace; a VM guest has a kernel of its own.
            userns: !substrate.is_vm(),
            ..SandboxSpec::default()
        };
        let rec = SandboxRecord {
            pooled: true,
            ..SandboxRecord::creating(id.clone(), spec, now_ms())
        };
        self.store.put_sandbox(&rec, now_ms())?;
        let e = Entry::new(rec, None);
        self.insert(Arc::clone(&e));
        self.launch(&e).await?;
        Ok(id)
    }
}
