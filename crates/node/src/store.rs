//! The node's durable state: embedded SQLite in WAL mode.
//!
//! The store is the durable intent of the node: tenants and their hashed API keys, every
//! sandbox record (written on every state change, before the change is acknowledged), and the
//! outcomes of idempotent requests. `synchronous=NORMAL` under WAL makes every committed
//! transaction survive a crash of the process (kill -9); a power loss may lose the last few
//! transactions, which recovery treats like sandboxes it cannot find.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Mutex;

use rusqlite::{params, Connection, OptionalExtension};
use serde::{Deserialize, Serialize};

use crate::sandbox::{SandboxSpec, State};

/// A failed store operation.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// SQLite failed.
    #[error("store: {0}")]
    Sql(#[from] rusqlite::Error),
    /// A stored record did not parse.
    #[error("store: corrupt record: {0}")]
    Corrupt(String),
    /// The store lock was poisoned by a panic.
    #[error("store: lock poisoned")]
    Poisoned,
}

/// A tenant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tenant {
    /// Stable id (`tn-…`).
    pub id: String,
    /// Unique name.
    pub name: String,
    /// May manage tenants, templates and pools.
    pub admin: bool,
    /// Most live sandboxes at once (`None`: unlimited).
    pub max_sandboxes: Option<u64>,
    /// Most memory (sum of `memory_max` of live sandboxes), bytes.
    pub max_memory_bytes: Option<u64>,
    /// Most bytes of snapshot layers (each snapshot counts its own layer).
    #[serde(default)]
    pub max_snapshot_bytes: Option<u64>,
    /// Creation time, ms since the epoch.
    pub created_at_ms: u64,
    /// The widest network egress its sandboxes may have (`None`: `all` for the admin tenant,
    /// `none` for any other).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_ceiling: Option<dsec_api::network::Egress>,
}

impl Tenant {
    /// Its egress ceiling, the default filled in.
    pub fn ceiling(&self) -> dsec_api::network::Egress {
        self.egress_ceiling.clone().unwrap_or(if self.admin {
            dsec_api::network::Egress::All
        } else {
            dsec_api::network::Egress::None
        })
    }
}

fn is_no_network(n: &dsec_api::network::NetworkSpec) -> bool {
    !n.enabled()
}

/// Everything the node knows about one sandbox.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxRecord {
    /// Sandbox id.
    pub id: String,
    /// Owner (`None` while it waits in a pool).
    pub tenant: Option<String>,
    /// Lifecycle state.
    pub state: State,
    /// Bumped on every change.
    pub version: u64,
    /// What the runtime created it with.
    pub spec: SandboxSpec,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// Environment added to every command (kept out of listings).
    pub env: BTreeMap<String, String>,
    /// Created, ms since the epoch.
    pub created_at_ms: u64,
    /// Handed to its tenant, ms since the epoch: the create for a sandbox made on demand, the
    /// handover for one taken from a warm pool (made earlier); `None` while it waits in a pool.
    #[serde(default)]
    pub acquired_at_ms: Option<u64>,
    /// Destroyed by the node at this time (TTL).
    pub expires_at_ms: Option<u64>,
    /// Owner lease length; `None` when there is no lease.
    pub lease_ms: Option<u64>,
    /// Destroyed by the node unless the lease is renewed before this time.
    pub lease_expires_at_ms: Option<u64>,
    /// Handed out from a warm pool.
    pub pooled: bool,
    /// Why it failed, when it did.
    #[serde(default)]
    pub error: Option<String>,
    /// Idempotency key of the create that made it.
    #[serde(default)]
    pub idem: Option<String>,
    /// Names of `env` entries whose values are secret (masked in the trajectory log).
    #[serde(default)]
    pub secret_env: Vec<String>,
    /// What a `creating` sandbox waits for: `preparing` while the node makes the VM snapshot
    /// it is restored from (kernel, images, template boot: once per host and template).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// What the node fetched to make it (a cluster template it did not hold).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fetched: Option<dsec_api::sandbox::Fetched>,
    /// Its network policy (egress `none` when absent).
    #[serde(default, skip_serializing_if = "is_no_network")]
    pub network: dsec_api::network::NetworkSpec,
    /// Its address on the node's egress subnet, while it has a path out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub net_addr: Option<std::net::Ipv4Addr>,
}

impl SandboxRecord {
    /// The record of a sandbox about to be created from `spec`: `Creating`, version 0, no
    /// owner, nothing else set yet.
    pub fn creating(id: String, spec: SandboxSpec, created_at_ms: u64) -> Self {
        Self {
            id,
            tenant: None,
            state: State::Creating,
            version: 0,
            spec,
            labels: BTreeMap::new(),
            env: BTreeMap::new(),
            created_at_ms,
            acquired_at_ms: None,
            expires_at_ms: None,
            lease_ms: None,
            lease_expires_at_ms: None,
            pooled: false,
            error: None,
            idem: None,
            secret_env: Vec::new(),
            phase: None,
            fetched: None,
            network: dsec_api::network::NetworkSpec::default(),
            net_addr: None,
        }
    }
}

/// A stored outcome of an idempotent request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdemOutcome {
    /// Hash of the request (method, path, body).
    pub request_hash: String,
    /// HTTP status.
    pub status: u16,
    /// Content type of the body.
    pub content_type: String,
    /// Body bytes.
    pub body: Vec<u8>,
}

/// The SQLite store.
#[derive(Debug)]
pub struct Store {
    conn: Mutex<Connection>,
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS tenants (
    id TEXT PRIMARY KEY, name TEXT NOT NULL UNIQUE, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS api_keys (
    hash TEXT PRIMARY KEY, tenant TEXT NOT NULL REFERENCES tenants(id), created_at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY, tenant TEXT, state TEXT NOT NULL, version INTEGER NOT NULL,
    updated_at INTEGER NOT NULL, idem TEXT, record TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS sandboxes_tenant ON sandboxes(tenant, id);
CREATE INDEX IF NOT EXISTS sandboxes_idem ON sandboxes(tenant, idem);
CREATE INDEX IF NOT EXISTS sandboxes_state ON sandboxes(state);
CREATE TABLE IF NOT EXISTS finished_trajectories (
    key TEXT PRIMARY KEY, at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS pools (
    template TEXT PRIMARY KEY, min INTEGER NOT NULL, max INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS snapshots (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, parent TEXT, record TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS snapshots_parent ON snapshots(parent);
CREATE TABLE IF NOT EXISTS idempotency (
    tenant TEXT NOT NULL, key TEXT NOT NULL, request_hash TEXT NOT NULL, status INTEGER NOT NULL,
    content_type TEXT NOT NULL, body BLOB NOT NULL, created_at INTEGER NOT NULL,
    PRIMARY KEY (tenant, key));
";

/// Schema version written to `meta`.
const SCHEMA_VERSION: &str = "1";

fn state_str(s: State) -> &'static str {
    match s {
        State::Creating => "creating",
        State::Ready => "ready",
        State::Running => "running",
        State::Resetting => "resetting",
        State::Stopping => "stopping",
        State::Stopped => "stopped",
        State::Failed => "failed",
        State::Lost => "lost",
    }
}

impl Store {
    /// Opens (creating if needed) the store at `path`.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        Self::init(Connection::open(path)?)
    }

    /// An in-memory store (tests).
    pub fn open_in_memory() -> Result<Self, StoreError> {
        Self::init(Connection::open_in_memory()?)
    }

    fn init(conn: Connection) -> Result<Self, StoreError> {
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        conn.execute_batch(SCHEMA)?;
        conn.execute(
            "INSERT OR IGNORE INTO meta (key, value) VALUES ('schema', ?1)",
            params![SCHEMA_VERSION],
        )?;
        Ok(Self {
            conn: Mutex::new(conn),
        })
    }

    fn with<T>(
        &self,
        f: impl FnOnce(&mut Connection) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let mut c = self.conn.lock().map_err(|_| StoreError::Poisoned)?;
        f(&mut c)
    }

    /// Runs one statement.
    fn execute(&self, sql: &str, params: impl rusqlite::Params) -> Result<usize, StoreError> {
        self.with(|c| Ok(c.execute(sql, params)?))
    }

    /// Stores (or replaces) a snapshot's record.
    pub fn put_snapshot(&self, s: &crate::snapshot::SnapshotRecord) -> Result<(), StoreError> {
        let json = serde_json::to_string(s).map_err(|e| StoreError::Corrupt(e.to_string()))?;
        self.execute(
            "INSERT OR REPLACE INTO snapshots (id, tenant, parent, record) VALUES (?1, ?2, ?3, ?4)",
            params![s.id, s.tenant, s.parent, json],
        )?;
        Ok(())
    }

    /// Snapshot `id`.
    pub fn snapshot(
        &self,
        id: &str,
    ) -> Result<Option<crate::snapshot::SnapshotRecord>, StoreError> {
        self.record("SELECT record FROM snapshots WHERE id = ?1", params![id])
    }

    /// Every snapshot, or a tenant's.
    pub fn snapshots(
        &self,
        tenant: Option<&str>,
    ) -> Result<Vec<crate::snapshot::SnapshotRecord>, StoreError> {
        match tenant {
            Some(t) => self.records(
                "SELECT record FROM snapshots WHERE tenant = ?1 ORDER BY id",
                params![t],
            ),
            None => self.records("SELECT record FROM snapshots ORDER BY id", []),
        }
    }

    /// Deletes snapshots `ids` in one transaction.
    pub fn delete_snapshots(&self, ids: &[String]) -> Result<(), StoreError> {
        self.with(|c| {
            let tx = c.transaction()?;
            for id in ids {
                tx.execute("DELETE FROM snapshots WHERE id = ?1", params![id])?;
            }
            tx.commit()?;
            Ok(())
        })
    }

    /// The JSON record of a one-column query that finds at most one row, parsed.
    fn record<T: for<'de> Deserialize<'de>>(
        &self,
        sql: &str,
        params: impl rusqlite::Params,
    ) -> Result<Option<T>, StoreError> {
        Ok(self.records(sql, params)?.into_iter().next())
    }

    /// The JSON records of every row of a one-column query, parsed.
    fn records<T: for<'de> Deserialize<'de>>(
        &self,
        sql: &str,
        params: impl rusqlite::Params,
    ) -> Result<Vec<T>, StoreError> {
        self.with(|c| {
            let mut st = c.prepare_cached(sql)?;
            let rows = st.query_map(params, |r| r.get::<_, String>(0))?;
            rows.map(|r| parse(&r?)).collect()
        })
    }

    /// Adds a tenant.
    pub fn insert_tenant(&self, t: &Tenant) -> Result<(), StoreError> {
        let rec = serde_json::to_string(t).map_err(|e| StoreError::Corrupt(e.to_string()))?;
        self.execute(
            "INSERT INTO tenants (id, name, record) VALUES (?1, ?2, ?3)",
            params![t.id, t.name, rec],
        )?;
        Ok(())
    }

    /// A tenant by id.
    pub fn tenant(&self, id: &str) -> Result<Option<Tenant>, StoreError> {
        self.record("SELECT record FROM tenants WHERE id = ?1", params![id])
    }

    /// A tenant by name.
    pub fn tenant_by_name(&self, name: &str) -> Result<Option<Tenant>, StoreError> {
        self.record("SELECT record FROM tenants WHERE name = ?1", params![name])
    }

    /// Every tenant, by name.
    pub fn tenants(&self) -> Result<Vec<Tenant>, StoreError> {
        self.records("SELECT record FROM tenants ORDER BY name", [])
    }

    /// Adds an API key (its sha256, hex) for a tenant.
    pub fn insert_key(&self, hash: &str, tenant: &str, now_ms: u64) -> Result<(), StoreError> {
        self.execute(
            "INSERT INTO api_keys (hash, tenant, created_at) VALUES (?1, ?2, ?3)",
            params![hash, tenant, now_ms as i64],
        )?;
        Ok(())
    }

    /// Every API key: its hash and its tenant's id.
    pub fn api_keys(&self) -> Result<Vec<(String, String)>, StoreError> {
        self.with(|c| {
            let mut st = c.prepare_cached("SELECT hash, tenant FROM api_keys ORDER BY hash")?;
            let rows =
                st.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))?;
            Ok(rows.collect::<Result<Vec<_>, _>>()?)
        })
    }

    /// The tenant an API key hash belongs to.
    pub fn tenant_for_key(&self, hash: &str) -> Result<Option<Tenant>, StoreError> {
        self.record(
            "SELECT t.record FROM api_keys k JOIN tenants t ON t.id = k.tenant
                     WHERE k.hash = ?1",
            params![hash],
        )
    }

    /// Inserts or replaces sandbox records in one transaction.
    pub fn put_sandboxes(&self, recs: &[&SandboxRecord], now_ms: u64) -> Result<(), StoreError> {
        self.with(|c| {
            let tx = c.transaction()?;
            {
                let mut st = tx.prepare_cached(
                    "INSERT OR REPLACE INTO sandboxes
                     (id, tenant, state, version, updated_at, idem, record)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
                )?;
                for rec in recs {
                    let json = serde_json::to_string(rec)
                        .map_err(|e| StoreError::Corrupt(e.to_string()))?;
                    st.execute(params![
                        rec.id,
                        rec.tenant,
                        state_str(rec.state),
                        rec.version as i64,
                        now_ms as i64,
                        rec.idem,
                        json
                    ])?;
                }
            }
            tx.commit()?;
            Ok(())
        })
    }

    /// Inserts or replaces one sandbox record.
    pub fn put_sandbox(&self, rec: &SandboxRecord, now_ms: u64) -> Result<(), StoreError> {
        self.put_sandboxes(&[rec], now_ms)
    }

    /// One sandbox record.
    pub fn sandbox(&self, id: &str) -> Result<Option<SandboxRecord>, StoreError> {
        self.record("SELECT record FROM sandboxes WHERE id = ?1", params![id])
    }

    /// The newest sandbox a tenant created with idempotency key `idem`.
    pub fn sandbox_by_idem(
        &self,
        tenant: &str,
        idem: &str,
    ) -> Result<Option<SandboxRecord>, StoreError> {
        self.record(
            "SELECT record FROM sandboxes WHERE tenant = ?1 AND idem = ?2
                     ORDER BY updated_at DESC LIMIT 1",
            params![tenant, idem],
        )
    }

    /// Every sandbox record not in a final state (`stopped`), by id.
    pub fn live_sandboxes(&self) -> Result<Vec<SandboxRecord>, StoreError> {
        self.records(
            "SELECT record FROM sandboxes WHERE state != 'stopped' ORDER BY id",
            [],
        )
    }

    /// A page of a tenant's sandboxes with ids after `after`, by id, at most `limit`.
    pub fn tenant_sandboxes(
        &self,
        tenant: &str,
        after: &str,
        limit: usize,
    ) -> Result<Vec<SandboxRecord>, StoreError> {
        self.records(
            "SELECT record FROM sandboxes WHERE tenant = ?1 AND id > ?2 ORDER BY id LIMIT ?3",
            params![tenant, after, limit as i64],
        )
    }

    /// Deletes `stopped` records last updated before `before_ms`; returns how many.
    pub fn purge_stopped(&self, before_ms: u64) -> Result<usize, StoreError> {
        self.execute(
            "DELETE FROM sandboxes WHERE state = 'stopped' AND updated_at < ?1",
            params![before_ms as i64],
        )
    }

    /// Marks a trajectory (its log key) finished: its records may be compacted away.
    pub fn finish_trajectory(&self, key: &str, now_ms: u64) -> Result<(), StoreError> {
        self.execute(
            "INSERT OR IGNORE INTO finished_trajectories (key, at) VALUES (?1, ?2)",
            params![key, now_ms as i64],
        )?;
        Ok(())
    }

    /// Log keys of the trajectories finished at or before `before_ms`.
    pub fn finished_trajectories(&self, before_ms: u64) -> Result<Vec<String>, StoreError> {
        self.with(|c| {
            let mut st = c.prepare("SELECT key FROM finished_trajectories WHERE at <= ?1")?;
            let rows = st.query_map(params![before_ms as i64], |r| r.get::<_, String>(0))?;
            Ok(rows.collect::<Result<Vec<_>, _>>()?)
        })
    }

    /// Records a template's pool bounds.
    pub fn put_pool(&self, template: &str, min: usize, max: usize) -> Result<(), StoreError> {
        self.execute(
            "INSERT OR REPLACE INTO pools (template, min, max) VALUES (?1, ?2, ?3)",
            params![template, min as i64, max as i64],
        )?;
        Ok(())
    }

    /// Every configured pool: (template, min, max).
    pub fn pools(&self) -> Result<Vec<(String, usize, usize)>, StoreError> {
        self.with(|c| {
            let mut st = c.prepare("SELECT template, min, max FROM pools ORDER BY template")?;
            let rows = st.query_map([], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, i64>(1)? as usize,
                    r.get::<_, i64>(2)? as usize,
                ))
            })?;
            Ok(rows.collect::<Result<Vec<_>, _>>()?)
        })
    }

    /// The stored outcome of an idempotent request.
    pub fn idempotent(&self, tenant: &str, key: &str) -> Result<Option<IdemOutcome>, StoreError> {
        self.with(|c| {
            Ok(c.query_row(
                "SELECT request_hash, status, content_type, body FROM idempotency
                 WHERE tenant = ?1 AND key = ?2",
                params![tenant, key],
                |r| {
                    Ok(IdemOutcome {
                        request_hash: r.get(0)?,
                        status: r.get::<_, i64>(1)? as u16,
                        content_type: r.get(2)?,
                        body: r.get(3)?,
                    })
                },
            )
            .optional()?)
        })
    }

    /// Records the outcome of an idempotent request (the first one wins).
    pub fn put_idempotent(
        &self,
        tenant: &str,
        key: &str,
        out: &IdemOutcome,
        now_ms: u64,
    ) -> Result<(), StoreError> {
        self.execute(
            "INSERT OR IGNORE INTO idempotency
                 (tenant, key, request_hash, status, content_type, body, created_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
            params![
                tenant,
                key,
                out.request_hash,
                i64::from(out.status),
                out.content_type,
                out.body,
                now_ms as i64
            ],
        )?;
        Ok(())
    }

    /// Forgets idempotency outcomes older than `before_ms`; returns how many.
    pub fn purge_idempotent(&self, before_ms: u64) -> Result<usize, StoreError> {
        self.execute(
            "DELETE FROM idempotency WHERE created_at < ?1",
            params![before_ms as i64],
        )
    }
}

fn parse<T: for<'de> Deserialize<'de>>(s: &str) -> Result<T, StoreError> {
    serde_json::from_str(s).map_err(|e| StoreError::Corrupt(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: &str, tenant: Option<&str>, state: State) -> SandboxRecord {
        SandboxRecord {
            tenant: tenant.map(Into::into),
            state,
            version: 1,
            labels: BTreeMap::from([("k".into(), "v".into())]),
            idem: Some(format!("key-{id}")),
            ..SandboxRecord::creating(id.into(), SandboxSpec::default(), 1)
        }
    }

    #[test]
    fn tenants_keys_sandboxes_and_idempotency_persist() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("state.db");
        {
            let s = Store::open(&path)?;
            let t = Tenant {
                id: "tn-1".into(),
                name: "a".into(),
                admin: false,
                max_sandboxes: Some(2),
                max_memory_bytes: None,
                max_snapshot_bytes: None,
                created_at_ms: 5,
                egress_ceiling: None,
            };
            s.insert_tenant(&t)?;
            assert!(s.insert_tenant(&t).is_err(), "names and ids are unique");
            s.insert_key("h1", "tn-1", 5)?;
            assert!(
                s.insert_key("h2", "tn-nope", 5).is_err(),
                "keys need a tenant"
            );
            s.put_sandbox(&rec("sb-1", Some("tn-1"), State::Running), 10)?;
            s.put_sandboxes(
                &[
                    &rec("sb-2", Some("tn-1"), State::Stopped),
                    &rec("sb-3", None, State::Ready),
                ],
                10,
            )?;
            let out = IdemOutcome {
                request_hash: "x".into(),
                status: 201,
                content_type: "application/json".into(),
                body: b"{}".to_vec(),
            };
            s.put_idempotent("tn-1", "k", &out, 10)?;
            let other = IdemOutcome {
                status: 500,
                ..out.clone()
            };
            s.put_idempotent("tn-1", "k", &other, 11)?;
        }
        let s = Store::open(&path)?;
        assert_eq!(s.tenant_for_key("h1")?.map(|t| t.name), Some("a".into()));
        assert!(s.tenant_for_key("h2")?.is_none());
        let live: Vec<String> = s.live_sandboxes()?.into_iter().map(|r| r.id).collect();
        assert_eq!(live, ["sb-1", "sb-3"]);
        let page: Vec<String> = s
            .tenant_sandboxes("tn-1", "sb-1", 10)?
            .into_iter()
            .map(|r| r.id)
            .collect();
        assert_eq!(page, ["sb-2"]);
        assert_eq!(
            s.sandbox_by_idem("tn-1", "key-sb-1")?.map(|r| r.id),
            Some("sb-1".into())
        );
        assert!(s.sandbox_by_idem("tn-2", "key-sb-1")?.is_none());
        assert_eq!(
            s.idempotent("tn-1", "k")?.map(|o| o.status),
            Some(201),
            "the first outcome wins"
        );
        assert_eq!(s.purge_stopped(11)?, 1);
        assert!(s.sandbox("sb-2")?.is_none());
        assert_eq!(s.purge_idempotent(11)?, 1);
        s.put_pool("host", 1, 4)?;
        s.put_pool("host", 2, 8)?;
        assert_eq!(s.pools()?, [("host".to_owned(), 2, 8)]);
        Ok(())
    }
}
