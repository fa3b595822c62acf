//! Reconciling the store with the machine after a start.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use super::destroy::reap_orphan;
use super::{Entry, Node, Result};
use crate::sandbox::State;

/// How a restart found the sandboxes of the previous node process.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RecoveryReport {
    /// Reconnected and running again.
    pub adopted: Vec<String>,
    /// Could not be reconnected (or were mid-change): destroyed, records closed.
    pub reaped: Vec<String>,
    /// On the machine without a record: destroyed.
    pub orphans: Vec<String>,
    /// Sandbox cgroups without a live sandbox, removed (see [`Node::sweep_orphan_cgroups`]).
    pub orphan_cgroups: Vec<String>,
    /// How long recovery took, ms.
    pub took_ms: u64,
}

impl Node {
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
        // Paths out of the adopted sandboxes (the kernel kept enforcing them meanwhile).
        self.adopt_networks().await;
        // Sandbox cgroups no live sandbox has (a create or destroy cut short).
        report.orphan_cgroups = self.sweep_orphan_cgroups().await;
        // Snapshot layers a crash left without a record (or whose last user is gone).
        if let Err(err) = self.gc_snapshot_layers().await {
            tracing::warn!(error = %err, "snapshot layer collection failed");
        }
        report.took_ms = t0.elapsed().as_millis() as u64;
        *self.recovery.lock().unwrap_or_else(|p| p.into_inner()) = report.clone();
        self.ready.store(true, Ordering::Relaxed);
        report
    }
}
