//! The sandbox API's wire types: the one [`Substrate`] enum, lifecycle [`State`] and its
//! transition function, the create spec, the sandbox view and the exec body. The node parses
//! and answers with them, the CLI reads them, the OpenAPI document describes them.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// How a sandbox (or a code run) is isolated: one parameter switches between the four.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Substrate {
    /// A forked child of a pre-warmed interpreter (a zygote) in a pooled container: served by
    /// the code runner (`/v1/run`), not a sandbox of its own.
    Function,
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
            Substrate::Function => "function",
            Substrate::Container => "container",
            Substrate::Microvm => "microvm",
            Substrate::Vm => "vm",
        }
    }

    /// Parses the API name of a sandbox substrate (`function` is not one: it is served by
    /// `/v1/run`).
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
        matches!(self, Substrate::Microvm | Substrate::Vm)
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
    /// Its node was lost (in a cluster, the node's lease expired): terminal. Only a gateway
    /// answers it; a node never holds a sandbox in this state.
    Lost,
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
            (Creating | Ready | Running | Resetting | Stopping | Stopped | Failed | Lost, _) => {
                false
            }
        };
        if ok {
            Ok(to)
        } else {
            Err(InvalidTransition { from: self, to })
        }
    }
}

/// The body of `POST /v1/sandboxes` (and of each item of a batch create).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSpec {
    /// Template name (`host` when absent).
    #[serde(default)]
    pub template: Option<String>,
    /// `container` (default), `microvm` or `vm`.
    #[serde(default)]
    pub substrate: Option<String>,
    /// Limits over the defaults (only the fields given change).
    #[serde(default)]
    pub limits: Option<serde_json::Value>,
    /// Environment of every command.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Environment whose values are kept out of listings and the trajectory log.
    #[serde(default)]
    pub secret_env: BTreeMap<String, String>,
    /// Labels.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Time to live, ms.
    #[serde(default)]
    pub ttl_ms: Option<u64>,
    /// Owner lease, ms (renewed by heartbeats).
    #[serde(default)]
    pub lease_ms: Option<u64>,
    /// A writable root instead of a read-only root with writable scratch directories.
    #[serde(default)]
    pub writable_root: bool,
    /// Root inside mapped to an unprivileged host id range of the sandbox's own (container
    /// substrate). On when absent; `false` (root inside is host root, with every capability
    /// dropped) is for the admin tenant only.
    #[serde(default)]
    pub userns: Option<bool>,
    /// Made from this snapshot (`sn-…`): its template and substrate, its files.
    #[serde(default)]
    pub snapshot: Option<String>,
    /// Network egress (none when absent).
    #[serde(default)]
    pub network: Option<crate::network::NetworkSpec>,
}

/// Layers a node fetched for a create.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fetched {
    /// How many layers.
    pub layers: u32,
    /// Their bytes (uncompressed tar).
    pub bytes: u64,
    /// Where from: `node:<name>` (a peer), `origin` (the cluster's store).
    pub from: Vec<String>,
    /// How long it took, ms.
    pub ms: u64,
}

/// A sandbox as the API shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxView {
    /// Sandbox id.
    pub id: String,
    /// Owner (`None` while it waits in a pool).
    pub tenant: Option<String>,
    /// Template name.
    pub template: String,
    /// How it is isolated.
    pub substrate: Substrate,
    /// Lifecycle state.
    pub state: State,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// Its limits.
    pub limits: crate::limits::Limits,
    /// Whether its root is writable.
    pub writable_root: bool,
    /// Whether it runs in a user namespace.
    pub userns: bool,
    /// Names of the environment it adds to every command (values are not shown).
    pub env_keys: Vec<String>,
    /// Created (RFC 3339).
    pub created_at: String,
    /// Handed to its tenant (RFC 3339).
    pub acquired_at: Option<String>,
    /// TTL expiry (RFC 3339).
    pub expires_at: Option<String>,
    /// Lease expiry (RFC 3339).
    pub lease_expires_at: Option<String>,
    /// Bumped on every change.
    pub version: u64,
    /// Whether it came from a warm pool.
    pub pooled: bool,
    /// Why it failed, if it did.
    pub error: Option<String>,
    /// The step a create is at (`fetching` its template's layers from the cluster; VMs:
    /// `preparing` their snapshot).
    pub phase: Option<String>,
    /// What the node fetched before it could make the sandbox (in a cluster, a template it
    /// did not hold yet).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fetched: Option<Fetched>,
    /// The snapshot it was made from or last restored to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<String>,
    /// Host pid of its supervisor (QEMU for VMs): shown to the admin tenant only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub supervisor_pid: Option<i32>,
    /// Host pid of its init: shown to the admin tenant only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init_pid: Option<i32>,
    /// Its network policy (absent: egress `none`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<crate::network::NetworkSpec>,
    /// Its address on the node's egress subnet, while it has a path out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_address: Option<std::net::Ipv4Addr>,
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

    #[test]
    fn substrate_names_round_trip() {
        for s in [Substrate::Container, Substrate::Microvm, Substrate::Vm] {
            assert_eq!(Substrate::parse(s.name()), Some(s));
        }
        assert_eq!(Substrate::parse("function"), None);
        let json = serde_json::to_string(&Substrate::Function).unwrap_or_default();
        assert_eq!(json, "\"function\"");
    }
}
