//! Resetting a sandbox in place, and its owner lease.

use std::sync::Arc;
use std::time::Instant;

use super::{step, Entry, Error, Node, Result};
use crate::clock::now_ms;
use crate::sandbox::State;
use crate::store::SandboxRecord;

impl Node {
    /// Resets a sandbox: every process killed, a fresh writable layer.
    pub async fn reset(self: &Arc<Self>, e: &Arc<Entry>) -> Result<SandboxRecord> {
        let mut guard = e.lock().await;
        if e.record().state != State::Running {
            return Err(Error::Transition(format!(
                "cannot reset a {:?} sandbox",
                e.record().state
            )));
        }
        self.set_state(e, State::Resetting)?;
        let Some(mut sb) = guard.take() else {
            return Err(Error::NotFound(e.id.clone()));
        };
        let t0 = Instant::now();
        let (sb, result) = tokio::task::spawn_blocking(move || {
            let r = sb.reset().and_then(|()| sb.mark_acquired());
            (sb, r)
        })
        .await
        .map_err(|err| Error::internal(err.to_string()))?;
        e.set_pids(Some(&sb));
        *guard = Some(sb);
        drop(guard);
        self.metrics.reset.observe_duration(t0.elapsed());
        match result {
            Ok(()) => self.set_state(e, State::Running),
            Err(err) => {
                let err = Error::from(err);
                let detail = err.detail();
                let _ = self.update(e, |r| {
                    step(r, State::Failed)?;
                    r.error = Some(detail.clone());
                    Ok(())
                });
                Err(err)
            }
        }
    }

    /// Extends the owner lease.
    pub fn heartbeat(&self, e: &Entry, lease_ms: Option<u64>) -> Result<SandboxRecord> {
        self.update(e, |r| {
            let len = lease_ms.or(r.lease_ms).ok_or_else(|| {
                Error::invalid("the sandbox has no lease; pass lease_ms to start one")
            })?;
            r.lease_ms = Some(len);
            r.lease_expires_at_ms = Some(now_ms() + len);
            Ok(())
        })
    }
}
