//! Sandbox specifications, limits and the lifecycle state machine.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub use dsec_api::limits::{Limits, LimitsError, MAX_BYTES, NPROC_HEADROOM};

/// How a sandbox is isolated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Substrate {
    /// Namespaces, cgroups, seccomp and overlayfs.
    #[default]
    Container,
    /// A QEMU microVM (`-M microvm`).
    Microvm,
    /// A QEMU q35 virtual machine (PCI, ACPI, more vCPUs).
    Vm,
}

impl Substrate {
    /// The API name.
    pub fn name(self) -> &'static str {
        match self {
            Substrate::Container => "container",
            Substrate::Microvm => "microvm",
            Substrate::Vm => "vm",
        }
    }

    /// Parses an API name (`function` is not a sandbox substrate: it is served by `/v1/run`).
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "container" => Some(Substrate::Container),
            "microvm" => Some(Substrate::Microvm),
            "vm" => Some(Substrate::Vm),
            _ => None,
        }
    }

    /// Whether this is a VM substrate.
    pub fn is_vm(self) -> bool {
        self != Substrate::Container
    }
}

/// What to create.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxSpec {
    /// Template name (`host` by default).
    pub template: String,
    /// Limits.
    pub limits: Limits,
    /// Extra environment for every exec.
    pub env: BTreeMap<String, String>,
    /// Writable root (writes land in the private upper layer) instead of a read-only root with
    /// writable scratch directories.
    pub writable_root: bool,
    /// Run inside a user namespace mapping root to an unprivileged host id range.
    pub userns: bool,
    /// Reuse limits: recycle (destroy + create) after this many acquisitions.
    pub max_uses: u32,
    /// Reuse limits: recycle after this much cumulative acquired time.
    pub max_busy_ms: u64,
    /// How the sandbox is isolated.
    #[serde(default)]
    pub substrate: Substrate,
}

impl Default for SandboxSpec {
    fn default() -> Self {
        Self {
            template: "host".into(),
            limits: Limits::default(),
            env: BTreeMap::new(),
            writable_root: false,
            userns: false,
            max_uses: 100,
            max_busy_ms: 3_600_000,
            substrate: Substrate::Container,
        }
    }
}

/// Lifecycle state of a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    /// Being created.
    Creating,
    /// Created, idle (in a pool or not yet acquired).
    Ready,
    /// Acquired by a user.
    Running,
    /// Tree being killed and writable layer replaced.
    Resetting,
    /// Being destroyed.
    Stopping,
    /// Destroyed; nothing left on the machine.
    Stopped,
    /// Something failed; must be destroyed.
    Failed,
}

/// A refused state change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("invalid transition from {from:?} to {to:?}")]
pub struct InvalidTransition {
    /// Current state.
    pub from: State,
    /// Requested state.
    pub to: State,
}

impl State {
    /// The exhaustive transition function.
    pub fn transition(self, to: State) -> Result<State, InvalidTransition> {
        use State::*;
        let ok = match (self, to) {
            (Creating, Ready | Failed | Stopping) => true,
            (Ready, Running | Stopping | Failed) => true,
            (Running, Resetting | Stopping | Failed) => true,
            (Resetting, Ready | Running | Failed | Stopping) => true,
            (Stopping, Stopped | Failed) => true,
            (Failed, Stopping) => true,
            (Creating | Ready | Running | Resetting | Stopping | Stopped | Failed, _) => false,
        };
        if ok {
            Ok(to)
        } else {
            Err(InvalidTransition { from: self, to })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transitions() {
        assert_eq!(State::Creating.transition(State::Ready), Ok(State::Ready));
        assert!(State::Stopped.transition(State::Running).is_err());
        assert!(State::Ready.transition(State::Resetting).is_err());
        assert_eq!(
            State::Failed.transition(State::Stopping),
            Ok(State::Stopping)
        );
    }
}
