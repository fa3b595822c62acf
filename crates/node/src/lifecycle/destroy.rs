//! Destroying a sandbox, and whatever is left of one the node has no record of.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use super::{step, Entry, Error, Node, Result};
use crate::sandbox::{SandboxSpec, State};
use crate::store::SandboxRecord;
use crate::substrate::Runtime;

/// Destroys a sandbox the node has no record of: through its supervisor when it answers,
/// otherwise by removing what is left. Returns whether nothing is left.
pub(super) fn reap_orphan(rt: &Runtime, id: &str) -> bool {
    match rt.adopt(id, SandboxSpec::default(), State::Running) {
        Ok(sb) => sb.destroy(rt).is_ok(),
        Err(_) => rt.cleanup_leftovers(id, &rt.sandbox_run_dir(id)),
    }
}

impl Node {
    /// Destroys a sandbox: `stopping` is persisted first, `stopped` once nothing of it is left.
    pub async fn destroy(self: &Arc<Self>, e: &Arc<Entry>) -> Result<SandboxRecord> {
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
            Some(sb) => sb.destroy(&rt).map_err(Error::from),
            None => {
                if rt.cleanup_leftovers(&id, &run_dir) {
                    Ok(())
                } else {
                    Err(Error::internal("leftovers could not be removed"))
                }
            }
        })
        .await
        .map_err(|err| Error::internal(err.to_string()))?;
        drop(guard);
        if rec.net_addr.is_some() {
            self.detach_network(&e.id).await;
        }
        if let Err(err) = result {
            let _ = self.update(e, |r| {
                step(r, State::Failed)?;
                r.error = Some(err.detail());
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
        // The last sandbox on a deleted snapshot's layers lets them go.
        if let Some(s) = &rec.spec.snapshot {
            if matches!(self.store.snapshot(s), Ok(None)) {
                let _ = self.gc_snapshot_layers().await;
            }
        }
        if let (Some(tenant), Some(_)) = (&rec.tenant, self.quota.get()) {
            if let Ok(Some(t)) = self.store.tenant(tenant) {
                if t.max_sandboxes.is_some() {
                    self.release_in_cluster(&t.name).await;
                }
            }
        }
        Ok(rec)
    }

    /// Destroys every sandbox of the node (`--shutdown-sandboxes`, the end of a benchmark),
    /// again while a pool fill that was in flight adds one, for at most `within`. Returns how
    /// many it destroyed.
    pub async fn destroy_all(self: &Arc<Self>, within: std::time::Duration) -> usize {
        let deadline = tokio::time::Instant::now() + within;
        let mut destroyed = 0usize;
        loop {
            let entries = self.entries();
            if entries.is_empty() || tokio::time::Instant::now() >= deadline {
                break;
            }
            let mut set = tokio::task::JoinSet::new();
            for e in entries {
                let node = Arc::clone(self);
                set.spawn(async move { (e.id.clone(), node.destroy(&e).await) });
            }
            while let Some(done) = set.join_next().await {
                match done {
                    Ok((_, Ok(_))) => destroyed += 1,
                    Ok((id, Err(e))) => {
                        tracing::warn!(sandbox_id = %id, error = %e, "shutdown: destroy failed");
                    }
                    Err(e) => tracing::warn!(error = %e, "shutdown: destroy task failed"),
                }
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        tracing::info!(
            destroyed = %destroyed,
            left = %self.entries().len(),
            "shutdown: sandboxes destroyed",
        );
        destroyed
    }
}
