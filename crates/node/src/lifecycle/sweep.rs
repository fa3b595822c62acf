//! The periodic sweep: dead and expired sandboxes, orphans, pool refills.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use super::destroy::reap_orphan;
use super::{step, Node};
use crate::clock::now_ms;
use crate::sandbox::State;

/// Failed destroys the sweeper retries before it leaves a sandbox `failed` for an operator
/// (its record says why; an explicit DELETE still tries).
pub const MAX_SWEEP_DESTROYS: u32 = 5;

impl Node {
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
                tracing::warn!(sandbox = %r.id, why = %why, "sandbox died");
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
                        tracing::info!(sandbox = %r.id, "sandbox expired");
                    }
                }
                Err(err) => {
                    let tries = e.sweep_failures.fetch_add(1, Ordering::Relaxed) + 1;
                    tracing::warn!(
                        sandbox = %r.id,
                        error = %err.detail(),
                        attempt = %tries,
                        "destroy failed",
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
                tracing::warn!(sandbox = %id, "orphan removed");
            }
            self.sweep_orphan_cgroups().await;
        }
        let now = now_ms();
        let day_ago = now.saturating_sub(24 * 3600 * 1000);
        let hour_ago = now.saturating_sub(3600 * 1000);
        let _ = self.store.purge_idempotent(day_ago);
        let _ = self.store.purge_stopped(hour_ago);
        self.kick_pools();
        n
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
                tracing::warn!(sandbox = %id, "orphan cgroup removed");
                removed.push(id);
            }
        }
        removed
    }
}
