//! Resetting a sandbox in place, and its owner lease.

use std::sync::Arc;
use std::time::Instant;

use super::{step, Entry, Error, Node, Result};
use crate::clock::now_ms;
use crate::sandbox::State;
use crate::store::SandboxRecord;
use crate::substrate::{RuntimeError, Sandbox};

impl Node {
    /// Resets a sandbox: every process killed, a fresh writable layer.
    pub async fn reset(self: &Arc<Self>, e: &Arc<Entry>) -> Result<SandboxRecord> {
        self.in_place(e, "reset", Sandbox::reset, &self.metrics.reset, |_| {})
            .await
    }

    /// Runs `op` (a reset, a restore) on a running sandbox, `Resetting` meanwhile; `done`
    /// updates its record once `op` succeeded. A failed `op` leaves it `Failed`.
    pub(super) async fn in_place(
        self: &Arc<Self>,
        e: &Arc<Entry>,
        what: &str,
        op: impl FnOnce(&mut Sandbox) -> std::result::Result<(), RuntimeError> + Send + 'static,
        took: &crate::metrics::Histogram,
        done: impl FnOnce(&mut SandboxRecord),
    ) -> Result<SandboxRecord> {
        let mut guard = e.lock().await;
        if e.record().state != State::Running {
            return Err(Error::Transition(format!(
                "cannot {what} a {:?} sandbox",
                e.record().state
            )));
        }
        self.set_state(e, State::Resetting)?;
        let Some(mut sb) = guard.take() else {
            return Err(Error::NotFound(e.id.clone()));
        };
        let t0 = Instant::now();
        let (sb, result) = tokio::task::spawn_blocking(move || {
            let r = op(&mut sb).and_then(|()| sb.mark_acquired());
            (sb, r)
        })
        .await
        .map_err(|err| Error::internal(err.to_string()))?;
        e.set_pids(Some(&sb));
        *guard = Some(sb);
        drop(guard);
        took.observe_duration(t0.elapsed());
        match result {
            Ok(()) => self.update(e, |r| {
                r.state = r.state.transition(State::Running)?;
                done(r);
                Ok(())
            }),
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
