//! The probe's checks. `report` runs TESTING.md's observations from inside a sandbox;
//! `selftest` installs dsec's seccomp filter on the probe itself and runs one named check.

pub mod calls;
pub mod report;
pub mod selftest;
pub mod sys;

use serde::Serialize;
use serde_json::Value;

/// One observation, named after its TESTING.md id.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// The TESTING.md id (`S-01`, `C-05`, ...).
    pub id: &'static str,
    /// Whether the observation matches what a sandbox must show.
    pub pass: bool,
    /// What was observed (check-specific).
    pub detail: Value,
}
