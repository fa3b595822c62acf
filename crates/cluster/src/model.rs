//! What lives in etcd, and under which keys (all under [`ROOT`]).
//!
//! | key | value | lease |
//! |---|---|---|
//! | `nodes/<name>` | [`NodeReport`] (JSON), rewritten every second | the node's |
//! | `numbers/<n>` | the name of the node that holds number `n` | none |
//! | `lost/<name>` | the node's lease id that expired (fencing: a node that finds its name here with its old lease destroys what the cluster declared lost) | none |
//! | `drain/<name>` | set by `dsec cluster drain` | none |
//! | `tenants/<name>` | a tenant's record (JSON), as the first node that had it wrote it | none |
//! | `keys/<sha256>` | the name of the tenant an API key belongs to | none |
//! | `templates/<name>` | a template's record (JSON: its layers' digests, env, workdir), as the node that imported it published it | none |
//! | `pools/<pool>` | a warm pool's bounds (`{"min","max"}`) every node keeps, as last set through any node | none |
//! | `usage/<tenant name>` | for a tenant with `max_sandboxes`: each node's count of its live sandboxes (JSON), swapped on every create and destroy | none |
//! | `secret` | the secret nodes authenticate each other's layer calls with | none |
//! | `idem/<sha256>` | the node a create with an `Idempotency-Key` went to (sha256 of the caller's key and the `Idempotency-Key`) | one of [`IDEM_TTL`] seconds |

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The prefix of every dsec key.
pub const ROOT: &str = "/dsec/";

/// The key of node `name`'s report.
pub fn node_key(name: &str) -> String {
    format!("{ROOT}nodes/{name}")
}

/// The prefix of every node report.
pub fn nodes_prefix() -> String {
    format!("{ROOT}nodes/")
}

/// The key of node number `n`.
pub fn number_key(n: u16) -> String {
    format!("{ROOT}numbers/{n}")
}

/// The prefix of every node number.
pub fn numbers_prefix() -> String {
    format!("{ROOT}numbers/")
}

/// The key of gateway `id`'s registration (`{"addrs": [..]}`, under its lease): nodes keep
/// their sandboxes from reaching these addresses.
pub fn gateway_key(id: &str) -> String {
    format!("{ROOT}gateways/{id}")
}

/// The prefix of every gateway registration.
pub fn gateways_prefix() -> String {
    format!("{ROOT}gateways/")
}

/// The IPv4 addresses of a gateway registration (none when malformed).
pub fn gateway_addrs(value: &[u8]) -> Vec<std::net::Ipv4Addr> {
    serde_json::from_slice::<serde_json::Value>(value)
        .ok()
        .and_then(|v| {
            v["addrs"]
                .as_array()
                .map(|a| a.iter().filter_map(|x| x.as_str()?.parse().ok()).collect())
        })
        .unwrap_or_default()
}

/// The key that asks node `name` to drain.
pub fn drain_key(name: &str) -> String {
    format!("{ROOT}drain/{name}")
}

/// The key of tenant `name`'s record.
pub fn tenant_key(name: &str) -> String {
    format!("{ROOT}tenants/{name}")
}

/// The prefix of every tenant record.
pub fn tenants_prefix() -> String {
    format!("{ROOT}tenants/")
}

/// The key of an API key's hash.
pub fn api_key_key(hash: &str) -> String {
    format!("{ROOT}keys/{hash}")
}

/// The prefix of every API key hash.
pub fn api_keys_prefix() -> String {
    format!("{ROOT}keys/")
}

/// The key of template `name`'s record.
pub fn template_key(name: &str) -> String {
    format!("{ROOT}templates/{name}")
}

/// The prefix of every template record.
pub fn templates_prefix() -> String {
    format!("{ROOT}templates/")
}

/// The key of pool `name`'s bounds.
pub fn pool_key(name: &str) -> String {
    format!("{ROOT}pools/{name}")
}

/// The prefix of every pool's bounds.
pub fn pools_prefix() -> String {
    format!("{ROOT}pools/")
}

/// The key of tenant `name`'s usage record.
pub fn usage_key(name: &str) -> String {
    format!("{ROOT}usage/{name}")
}

/// The prefix of every usage record.
pub fn usage_prefix() -> String {
    format!("{ROOT}usage/")
}

/// The key of the cluster secret.
pub fn secret_key() -> String {
    format!("{ROOT}secret")
}

/// How long a gateway remembers where an idempotent create went, at least (a retry comes
/// within minutes; the node that took the create keeps its outcome for 24 h). A gateway puts
/// every placement of a minute under one lease of this TTL plus that minute, so an idempotent
/// create costs one etcd transaction and a lease grant a minute.
pub const IDEM_TTL: i64 = 600;

/// The key of an idempotent create's placement.
pub fn idem_key(digest: &str) -> String {
    format!("{ROOT}idem/{digest}")
}

/// Milliseconds since the epoch (reports' times).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// What a node publishes about itself.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeReport {
    /// Its name (`--node-name`).
    pub name: String,
    /// Where its API answers (`--advertise`).
    pub url: String,
    /// The number its sandbox ids carry.
    pub number: u16,
    /// When it started, ms since the epoch.
    pub started_ms: u64,
    /// When it wrote this report, ms since the epoch.
    pub updated_ms: u64,
    /// It accepts no new sandboxes.
    pub draining: bool,
    /// Live sandboxes (pooled ones included).
    pub sandboxes: u64,
    /// The most it holds.
    pub max_sandboxes: u64,
    /// Online CPUs.
    pub cpus: f64,
    /// CPUs busy, averaged over the last minute (load average, capped at `cpus`).
    pub cpu_used: f64,
    /// Memory the host has for sandboxes, bytes.
    pub memory_bytes: u64,
    /// The sum of the live sandboxes' `memory_max`, bytes.
    pub memory_allocated_bytes: u64,
    /// Ready pooled sandboxes, by template.
    pub pools: BTreeMap<String, u64>,
    /// Templates whose layers it holds.
    pub templates: Vec<String>,
    /// Creates waiting for a create slot.
    pub creates_waiting: u64,
    /// Live sandboxes by tenant id.
    pub tenants: BTreeMap<String, u64>,
}

impl NodeReport {
    /// Free sandbox slots.
    pub fn free_slots(&self) -> u64 {
        self.max_sandboxes.saturating_sub(self.sandboxes)
    }

    /// Memory not yet promised to a sandbox, bytes.
    pub fn free_memory(&self) -> u64 {
        self.memory_bytes
            .saturating_sub(self.memory_allocated_bytes)
    }
}
