//! A node's membership in a cluster (`dsec server --etcd … --node-name … --advertise …`).
//!
//! At start, before it serves, the node claims its number (the one it held before, found under
//! `numbers/`, or the lowest free one, by an etcd transaction) and every sandbox id it makes from
//! then on carries it ([`dsec_cluster::ids`]). Then, every [`REPORT_EVERY`], it renews its lease
//! ([`LEASE_TTL`]) and rewrites its [`NodeReport`] under it.
//!
//! Fencing: if the lease has expired when the node renews it (the node was cut off or stalled
//! for longer than the TTL), the gateways have already answered its sandboxes `lost`; the node
//! destroys them all (at most one owner ever acts for a sandbox after a partition heals), then
//! registers again under a new lease. A node that starts again after its lease expired (its
//! report is gone) does the same with the sandboxes it adopted, before it registers.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dsec_cluster::etcd::{Etcd, EtcdError};
use dsec_cluster::model::{self, NodeReport};

use crate::lifecycle::Node;
use crate::sandbox::State;

pub mod layers;
mod quota;
pub mod s3;

/// The lease's time to live: a node that stops renewing is `lost` this long after.
pub const LEASE_TTL: i64 = 5;

/// How often the node renews its lease and rewrites its report.
pub const REPORT_EVERY: Duration = Duration::from_secs(1);

/// The number this node's sandbox ids carry (0 outside a cluster).
static NUMBER: AtomicU16 = AtomicU16::new(0);

/// This node's number (0 outside a cluster).
pub fn number() -> u16 {
    NUMBER.load(Ordering::Relaxed)
}

/// How the node joins a cluster.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// etcd endpoints, comma-separated.
    pub etcd: String,
    /// This node's name, unique in the cluster.
    pub name: String,
    /// The URL the gateways reach this node's API at (empty: `http://` and the address the
    /// node listens on).
    pub advertise: String,
    /// The cluster's origin store of template layers: a directory every node mounts, or
    /// `s3://bucket/prefix` (`None`: templates move between nodes only, from the nodes that
    /// hold them).
    pub template_store: Option<String>,
}

/// A node in a cluster.
#[derive(Debug)]
pub struct Member {
    cfg: ClusterConfig,
    etcd: Etcd,
    /// Where the gateways reach this node (set once it listens).
    url: std::sync::OnceLock<String>,
    /// The secret nodes authenticate each other's layer calls with.
    secret: String,
    origin: Option<layers::Origin>,
    http: ureq::Agent,
    layers: layers::Layers,
    /// Reports written (every [`quota::RECONCILE_EVERY`]th reconciles the tenants' usage).
    reports: std::sync::atomic::AtomicU64,
    /// What the shared prefixes and the local store looked like at the last sync.
    synced: std::sync::Mutex<Option<SyncedAt>>,
    number: u16,
    started_ms: u64,
    /// The node's report was gone when it joined: its last lease expired, and the cluster
    /// declared the sandboxes it held then lost.
    was_lost: bool,
}

impl Member {
    /// Claims this node's number (blocking); from then on new sandbox ids carry it.
    pub fn join(cfg: ClusterConfig) -> Result<Self, EtcdError> {
        let etcd = Etcd::new(&cfg.etcd);
        let number = dsec_cluster::ids::claim_number(&etcd, &cfg.name)?;
        // A restart within the lease's TTL finds its report still there and keeps its sandboxes.
        let was_lost = etcd.get(&model::node_key(&cfg.name))?.is_none();
        NUMBER.store(number, Ordering::Relaxed);
        let secret = cluster_secret(&etcd)?;
        let origin = match &cfg.template_store {
            Some(spec) => Some(layers::Origin::open(spec).map_err(|e| EtcdError::Parse {
                path: spec.clone(),
                body: format!("the template store: {e}"),
            })?),
            None => None,
        };
        tracing::info!(node = %cfg.name, number = %number, "joined the cluster");
        Ok(Self {
            cfg,
            etcd,
            url: std::sync::OnceLock::new(),
            secret,
            origin,
            http: layers::agent(),
            layers: layers::Layers::default(),
            synced: std::sync::Mutex::new(None),
            reports: std::sync::atomic::AtomicU64::new(0),
            number,
            started_ms: model::now_ms(),
            was_lost,
        })
    }

    /// Advertises `http://{addr}` unless the config names a URL.
    pub fn listening_on(&self, addr: std::net::SocketAddr) {
        let url = if self.cfg.advertise.is_empty() {
            format!("http://{addr}")
        } else {
            self.cfg.advertise.clone()
        };
        let _ = self.url.set(url);
    }

    /// Renews the lease and rewrites the report, forever.
    pub async fn run(self: Arc<Self>, node: Arc<Node>) {
        if self.was_lost {
            let n = node.destroy_all(Duration::from_secs(60)).await;
            if n > 0 {
                tracing::warn!(node = %self.cfg.name, destroyed = %n, "cluster: this node was lost while it was away; its sandboxes were destroyed");
            }
        }
        let mut lease = 0i64;
        loop {
            let (m, n) = (Arc::clone(&self), Arc::clone(&node));
            match tokio::task::spawn_blocking(move || m.renew(&n, lease)).await {
                Ok(Ok(Renewed::Live(l, drained))) => {
                    lease = l;
                    node.drain_pools(drained);
                }
                Ok(Ok(Renewed::Expired)) => {
                    tracing::warn!(node = %self.cfg.name, "cluster: lease expired; destroying the sandboxes the cluster declared lost");
                    node.destroy_all(Duration::from_secs(60)).await;
                    lease = 0;
                    continue;
                }
                Ok(Err(e)) => tracing::warn!(error = %e, "cluster: report failed"),
                Err(_) => {}
            }
            tokio::time::sleep(REPORT_EVERY).await;
        }
    }

    /// Renews `lease` (or grants one when 0) and rewrites the report under it.
    fn renew(&self, node: &Arc<Node>, lease: i64) -> Result<Renewed, EtcdError> {
        if lease != 0 && self.etcd.keep_alive(lease)? <= 0 {
            return Ok(Renewed::Expired);
        }
        let lease = match lease {
            0 => self.etcd.grant(LEASE_TTL)?,
            l => l,
        };
        // Read once a report: what the cluster is told it holds, and what it may publish.
        let templates = node.rt.templates().list().unwrap_or_default();
        self.sync_shared(node, &templates)?;
        if self
            .reports
            .fetch_add(1, Ordering::Relaxed)
            .is_multiple_of(quota::RECONCILE_EVERY)
        {
            self.reconcile_usage(&quota_held(node))?;
        }
        let draining = self.etcd.get(&model::drain_key(&self.cfg.name))?.is_some();
        let report = self.report(node, draining, &templates);
        let body = serde_json::to_vec(&report).unwrap_or_default();
        self.etcd
            .put(&model::node_key(&self.cfg.name), &body, lease)?;
        Ok(Renewed::Live(lease, draining))
    }

    /// Shares tenants, API keys and templates with the cluster ([`Member::share_keys`],
    /// [`Member::publish_missing`]), takes its pools and keeps sandboxes from its gateways
    /// ([`Member::avoid_gateways`]) when something changed since the last time: in etcd (one
    /// one-key read per prefix tells) or here. A quiet cluster costs each node five small reads
    /// a second, whatever the number of tenants and keys.
    fn sync_shared(
        &self,
        node: &Arc<Node>,
        templates: &[crate::template::Template],
    ) -> Result<(), EtcdError> {
        let seen = [
            model::tenants_prefix(),
            model::api_keys_prefix(),
            model::templates_prefix(),
            model::pools_prefix(),
            model::gateways_prefix(),
        ]
        .iter()
        .map(|p| self.etcd.prefix_version(p))
        .collect::<Result<Vec<_>, _>>()?;
        let local = (
            node.store.tenants().map_or(0, |t| t.len()),
            node.store.api_keys().map_or(0, |k| k.len()),
            templates.len(),
        );
        let now = (seen, local);
        if self
            .synced
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            == Some(&now)
        {
            return Ok(());
        }
        self.share_keys(node)?;
        self.publish_missing(node, templates)?;
        self.apply_pools(node)?;
        self.avoid_gateways(node)?;
        *self.synced.lock().unwrap_or_else(|p| p.into_inner()) = Some(now);
        Ok(())
    }

    /// Publishes a pool's bounds (set through this node's API) for every node to keep.
    pub fn publish_pool(&self, pool: &str, min: usize, max: usize) -> Result<(), EtcdError> {
        let body = serde_json::json!({"min": min, "max": max}).to_string();
        self.etcd
            .put(&model::pool_key(pool), body.as_bytes(), 0)
            .map(|_| ())
    }

    /// Keeps this node's sandboxes from reaching the gateways registered in etcd (egress
    /// never reaches the cluster's gateways, wherever they run).
    fn avoid_gateways(&self, node: &Arc<Node>) -> Result<(), EtcdError> {
        let (kvs, _) = self.etcd.prefix(&model::gateways_prefix())?;
        let nets: Vec<_> = kvs
            .iter()
            .flat_map(|kv| model::gateway_addrs(&kv.value))
            .map(|a| (a, 32))
            .collect();
        node.never_reach(&nets);
        Ok(())
    }

    /// Takes the pools' bounds the cluster publishes whose bounds here differ.
    fn apply_pools(&self, node: &Arc<Node>) -> Result<(), EtcdError> {
        let (kvs, _) = self.etcd.prefix(&model::pools_prefix())?;
        let here = node.pool_stats();
        for kv in kvs {
            let Some(pool) = kv.key.rsplit('/').next() else {
                continue;
            };
            let Ok(v) = serde_json::from_slice::<serde_json::Value>(&kv.value) else {
                continue;
            };
            let (Some(min), Some(max)) = (v["min"].as_u64(), v["max"].as_u64()) else {
                continue;
            };
            let same = here.iter().any(|p| {
                p["template"] == pool
                    && p["min"].as_u64() == Some(min)
                    && p["max"].as_u64() == Some(max)
            });
            if same {
                continue;
            }
            let size = crate::lifecycle::PoolSize {
                min: min as usize,
                max: max as usize,
            };
            if let Err(e) = node.set_pool(pool, size) {
                tracing::warn!(pool = %pool, error = %e, "cluster: a published pool was refused");
            }
        }
        Ok(())
    }

    /// Shares tenants and API keys with the cluster, by tenant name: publishes this node's
    /// (the first node to publish a name sets its record) and adds the others' to the local
    /// store, so a key works on every node within a report interval.
    fn share_keys(&self, node: &Node) -> Result<(), EtcdError> {
        let store = &node.store;
        let local = store.tenants().unwrap_or_default();
        let (remote_tenants, _) = self.etcd.prefix(&model::tenants_prefix())?;
        let published: std::collections::BTreeSet<String> = remote_tenants
            .iter()
            .filter_map(|kv| kv.key.rsplit('/').next().map(str::to_owned))
            .collect();
        for t in &local {
            if !published.contains(&t.name) {
                let body = serde_json::to_vec(t).unwrap_or_default();
                self.etcd.create(&model::tenant_key(&t.name), &body, 0)?;
            }
        }
        let names: BTreeMap<String, String> = local
            .iter()
            .map(|t| (t.id.clone(), t.name.clone()))
            .collect();
        let (remote_keys, _) = self.etcd.prefix(&model::api_keys_prefix())?;
        let known: BTreeMap<String, String> = remote_keys
            .iter()
            .filter_map(|kv| {
                let hash = kv.key.rsplit('/').next()?.to_owned();
                Some((hash, String::from_utf8(kv.value.clone()).ok()?))
            })
            .collect();
        let mine = store.api_keys().unwrap_or_default();
        for (hash, tenant) in &mine {
            if let (false, Some(name)) = (known.contains_key(hash), names.get(tenant)) {
                self.etcd
                    .create(&model::api_key_key(hash), name.as_bytes(), 0)?;
            }
        }
        let have: std::collections::BTreeSet<&String> = mine.iter().map(|(h, _)| h).collect();
        for (hash, name) in &known {
            if have.contains(hash) {
                continue;
            }
            let tenant = match store.tenant_by_name(name).ok().flatten() {
                Some(t) => t,
                None => {
                    let Some(rec) = remote_tenants
                        .iter()
                        .find(|kv| kv.key == model::tenant_key(name))
                        .and_then(|kv| {
                            serde_json::from_slice::<crate::store::Tenant>(&kv.value).ok()
                        })
                    else {
                        continue;
                    };
                    if store.insert_tenant(&rec).is_err() {
                        continue;
                    }
                    rec
                }
            };
            let _ = store.insert_key(hash, &tenant.id, crate::clock::now_ms());
        }
        Ok(())
    }

    /// Publishes the templates held here that the cluster has no record of (imported before
    /// the node joined, or whose publication at import failed).
    fn publish_missing(
        &self,
        node: &Node,
        templates: &[crate::template::Template],
    ) -> Result<(), EtcdError> {
        let (known, _) = self.etcd.prefix(&model::templates_prefix())?;
        let store = node.rt.templates();
        for t in templates {
            if t.name == "host"
                || known
                    .iter()
                    .any(|kv| kv.key == model::template_key(&t.name))
            {
                continue;
            }
            if let Err(e) = self.publish(store, t) {
                tracing::warn!(template = %t.name, error = %e, "cluster: publishing a template failed");
            }
        }
        Ok(())
    }

    /// What this node holds now.
    fn report(
        &self,
        node: &Node,
        draining: bool,
        templates: &[crate::template::Template],
    ) -> NodeReport {
        let mut r = NodeReport {
            name: self.cfg.name.clone(),
            url: self.url.get().cloned().unwrap_or_default(),
            number: self.number,
            started_ms: self.started_ms,
            updated_ms: model::now_ms(),
            draining: draining || node.draining.load(Ordering::Relaxed),
            max_sandboxes: node.max_sandboxes() as u64,
            cpus: f64::from(node.rt.capacity().cpus),
            memory_bytes: node.rt.capacity().memory_bytes,
            ..Default::default()
        };
        r.cpu_used = load_average().min(r.cpus);
        let mut pools: BTreeMap<String, u64> = BTreeMap::new();
        for e in node.entries() {
            let rec = e.record();
            if rec.state == State::Stopped {
                continue;
            }
            r.sandboxes += 1;
            r.memory_allocated_bytes += rec.spec.limits.memory_max;
            if rec.pooled && rec.state == State::Ready && rec.tenant.is_none() {
                *pools.entry(rec.spec.template.clone()).or_default() += 1;
            }
            if let Some(t) = &rec.tenant {
                *r.tenants.entry(t.clone()).or_default() += 1;
            }
        }
        r.pools = pools;
        r.templates = templates.iter().map(|t| t.name.clone()).collect();
        r
    }
}

/// The (count, newest mod revision) of the shared prefixes, and the local tenants', keys' and
/// templates' counts.
type SyncedAt = (Vec<(i64, i64)>, (usize, usize, usize));

/// What a renewal found.
enum Renewed {
    /// The lease (new or renewed) is live; the node is drained (or not).
    Live(i64, bool),
    /// The lease had expired.
    Expired,
}

/// This node's live sandboxes of each tenant with a quota, by tenant name.
fn quota_held(node: &Node) -> BTreeMap<String, u64> {
    let tenants: BTreeMap<String, String> = node
        .store
        .tenants()
        .unwrap_or_default()
        .into_iter()
        .filter(|t| t.max_sandboxes.is_some())
        .map(|t| (t.id, t.name))
        .collect();
    let mut held = BTreeMap::new();
    for e in node.entries() {
        let rec = e.record();
        if rec.state == State::Stopped {
            continue;
        }
        if let Some(name) = rec.tenant.as_ref().and_then(|t| tenants.get(t)) {
            *held.entry(name.clone()).or_default() += 1;
        }
    }
    held
}

/// The cluster's secret: the one in etcd, or a new one this node puts there first.
fn cluster_secret(etcd: &Etcd) -> Result<String, EtcdError> {
    let mut b = [0u8; 32];
    getrandom::fill(&mut b).map_err(|e| EtcdError::Parse {
        path: model::secret_key(),
        body: format!("no randomness: {e}"),
    })?;
    etcd.create(&model::secret_key(), hex::encode(b).as_bytes(), 0)?;
    let kv = etcd
        .get(&model::secret_key())?
        .ok_or_else(|| EtcdError::Parse {
            path: model::secret_key(),
            body: "the cluster secret vanished".into(),
        })?;
    Ok(String::from_utf8_lossy(&kv.value).into_owned())
}

/// The one-minute load average (`/proc/loadavg`).
fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(0.0)
}
