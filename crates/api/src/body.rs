//! The small request bodies of the sandbox API (the create spec and the exec body are in
//! [`crate::sandbox`] and [`crate::exec`]). Unknown fields are refused; absent optional fields
//! take their defaults.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::agent::SessionKind;

/// `POST /v1/tenants`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewTenant {
    /// 1..=64 of `[A-Za-z0-9_-]`.
    pub name: String,
    /// Most live sandboxes at once.
    pub max_sandboxes: Option<u64>,
    /// Most memory (sum of `memory_max` of live sandboxes), bytes.
    pub max_memory_bytes: Option<u64>,
    /// Most bytes of snapshot layers (each snapshot counts its own layer).
    #[serde(default)]
    pub max_snapshot_bytes: Option<u64>,
    /// The widest network egress its sandboxes may have (`"none"` when absent).
    #[serde(default)]
    pub egress_ceiling: Option<crate::network::Egress>,
}

/// `POST /v1/sandboxes:batch` (create `count` alike).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchCreate {
    /// How many, 1..=1000.
    pub count: usize,
    /// The create spec of each (a [`crate::sandbox::CreateSpec`]).
    pub spec: Option<Value>,
}

/// `POST /v1/sandboxes:batchDelete`: by ids or by labels.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchDelete {
    /// These sandboxes (at most 10,000).
    pub ids: Option<Vec<String>>,
    /// Every sandbox of the caller with all of these labels.
    pub labels: Option<BTreeMap<String, String>>,
}

/// `POST /v1/sandboxes/{id}/lease`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseBody {
    /// The new lease (absent: renew the current one).
    pub lease_ms: Option<u64>,
}

/// `POST /v1/sandboxes/{id}/processes/{pid}/stdin`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StdinBody {
    /// Text to write.
    pub data: Option<String>,
    /// Bytes to write, base64.
    pub data_b64: Option<String>,
    /// Close the process's stdin after writing.
    #[serde(default)]
    pub eof: bool,
}

/// `POST /v1/sandboxes/{id}/processes/{pid}/signal`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignalBody {
    /// The signal number.
    pub signal: i32,
}

/// `POST /v1/sandboxes/{id}/processes/{pid}/wait`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WaitBody {
    /// How long to wait at most.
    pub timeout_ms: Option<u64>,
}

/// `POST /v1/sandboxes/{id}/sessions`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SessionBody {
    /// Shell or Python.
    pub kind: SessionKind,
    /// Environment added for the session.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory.
    pub cwd: Option<String>,
}

/// `POST /v1/sandboxes/{id}/sessions/{sid}/run`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunBody {
    /// The trajectory this input is a step of.
    #[serde(default, alias = "trajectory_id")]
    pub trajectory: Option<String>,
    /// Its step number (a replay when already logged).
    pub step: Option<u64>,
    /// What to send the session.
    pub input: String,
    /// Wall-clock limit, ms.
    pub timeout_ms: Option<u64>,
}

/// `POST /v1/sandboxes/{id}/files/mkdir`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MkdirBody {
    /// The directory.
    pub path: String,
    /// Make missing parents too.
    #[serde(default)]
    pub parents: bool,
    /// Its mode.
    pub mode: Option<u32>,
}

/// `POST /v1/trajectories/{id}/annotations`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AnnotationBody {
    /// The step it is about (absent: the whole trajectory).
    pub step: Option<u64>,
    /// A reward.
    pub reward: Option<f64>,
    /// Labels (at most 64, each 1..=128 bytes).
    #[serde(default)]
    pub labels: Vec<String>,
    /// Free-form data.
    pub data: Option<Value>,
}
