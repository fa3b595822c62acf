//! Sandbox specifications, limits and the lifecycle state machine.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::capacity::Admitted;

pub use dsec_api::limits::{Limits, LimitsError, MAX_BYTES, NPROC_HEADROOM};
pub use dsec_api::sandbox::{InvalidTransition, State, Substrate};

/// What to create.
/// (Persisted in the sandbox records; unknown fields — the reuse limits records of older nodes
/// carry — are ignored.)
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxSpec {
    /// Template name (`host` by default).
    pub template: String,
    /// Limits, admitted by the node ([`NodeCapacity::admit`]).
    ///
    /// [`NodeCapacity::admit`]: crate::capacity::NodeCapacity::admit
    pub limits: Admitted,
    /// Extra environment for every exec.
    pub env: BTreeMap<String, String>,
    /// Writable root (writes land in the private upper layer) instead of a read-only root with
    /// writable scratch directories.
    pub writable_root: bool,
    /// Run inside a user namespace mapping root to an unprivileged host id range.
    pub userns: bool,
    /// How the sandbox is isolated.
    #[serde(default)]
    pub substrate: Substrate,
    /// The snapshot it was made from or last restored to (`sn-…`), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<String>,
    /// That snapshot's layer directories, topmost first, above the template's: resolved by
    /// the node, never taken from a request.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layers: Vec<String>,
}

impl Default for SandboxSpec {
    fn default() -> Self {
        Self {
            template: "host".into(),
            limits: Admitted::default(),
            env: BTreeMap::new(),
            writable_root: false,
            userns: true,
            substrate: Substrate::Container,
            snapshot: None,
            layers: Vec::new(),
        }
    }
}
