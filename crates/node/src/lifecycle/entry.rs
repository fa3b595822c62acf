//! One sandbox the node owns: its record, its runtime handle, its deadline.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::{watch, OwnedMutexGuard};

use crate::clock::now_ms;
use crate::sandbox::State;
use crate::store::SandboxRecord;
use crate::substrate::Sandbox;

/// One sandbox the node owns.
#[derive(Debug)]
pub struct Entry {
    /// Sandbox id.
    pub id: String,
    pub(super) rec: Mutex<SandboxRecord>,
    /// The runtime handle; `None` once destroyed.
    pub(super) live: Arc<tokio::sync::Mutex<Option<Sandbox>>>,
    pub(super) watch: watch::Sender<(State, u64)>,
    /// The earlier of the TTL and the lease expiry, on the monotonic clock: a wall-clock jump
    /// neither kills a sandbox early nor keeps it late.
    pub(super) deadline: Mutex<Option<Instant>>,
    /// Host pids of the supervisor and the sandbox init (shown to the admin tenant).
    pub(super) pids: Mutex<Option<(i32, i32)>>,
    /// A destroy was asked for: a create in progress gives up instead of finishing.
    pub(super) doomed: AtomicBool,
    /// Destroys the sweeper tried and that failed (bounded by [`MAX_SWEEP_DESTROYS`]).
    pub(super) sweep_failures: std::sync::atomic::AtomicU32,
}

/// The monotonic instant of a record's earliest expiry (TTL or lease).
pub(super) fn deadline_of(r: &SandboxRecord) -> Option<Instant> {
    let at = match (r.expires_at_ms, r.lease_expires_at_ms) {
        (Some(a), Some(b)) => a.min(b),
        (Some(a), None) | (None, Some(a)) => a,
        (None, None) => return None,
    };
    let left = at.saturating_sub(now_ms());
    Some(Instant::now() + std::time::Duration::from_millis(left))
}

impl Entry {
    pub(super) fn new(rec: SandboxRecord, sandbox: Option<Sandbox>) -> Arc<Self> {
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

    pub(super) fn set_pids(&self, sb: Option<&Sandbox>) {
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
