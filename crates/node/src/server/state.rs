//! What every API handler reaches: the node, the code runner, the trajectory log, and the
//! idempotency locks of the requests in flight.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::run::Runner;
use super::trajectory::Trajectories;
use crate::lifecycle::Node;

/// Per-(tenant, key) locks so that two identical requests in flight run once.
pub type IdemLocks = Mutex<HashMap<(String, String), Arc<tokio::sync::Mutex<()>>>>;

/// The state every handler and middleware is given (cheap to clone: shared parts only).
#[derive(Clone)]
pub struct AppState {
    /// The node's sandboxes and their lifecycle.
    pub node: Arc<Node>,
    /// The code runner (`/v1/run`, `/run_code`).
    pub runner: Arc<Runner>,
    /// The trajectory log.
    pub trajectories: Arc<Trajectories>,
    /// How long a finished trajectory stays in the log before compaction may drop it.
    pub compact_after: Duration,
    /// Idempotency locks of the requests in flight.
    pub idem: Arc<IdemLocks>,
    /// The node's membership of a cluster, when it joined one.
    pub member: Option<Arc<crate::member::Member>>,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState").finish_non_exhaustive()
    }
}

impl AppState {
    /// Retention, then compaction of the trajectories finished long enough ago.
    pub fn maintain_log(&self) -> super::error::ApiResult<serde_json::Value> {
        self.trajectories.enforce_retention();
        self.trajectories
            .compact_finished(&self.node.store, self.compact_after)
    }
}
