//! A tenant's `max_sandboxes` across the cluster, exact: every node that adds a sandbox of a
//! tenant with a quota first reserves it in etcd, on one record per tenant
//! (`usage/<tenant name>`: each node's count), with a compare-and-swap on the record's revision,
//! so two nodes (placed on by two gateways) never both take the last slot. A node releases on
//! destroy, and sets its own count to what it holds at start (recovery and fencing included)
//! and every [`RECONCILE_EVERY`] reports, so a crash between a reservation and its create
//! leaks nothing for long. A node found lost no longer counts: a reservation that would be
//! refused first drops the counts of nodes without a live report.

use std::collections::BTreeMap;

use dsec_cluster::etcd::EtcdError;
use dsec_cluster::model;

use super::Member;

/// How many reports pass between two reconciliations of this node's counts.
pub(super) const RECONCILE_EVERY: u64 = 30;

/// Most compare-and-swap rounds a reservation tries before it answers `unavailable`.
const ROUNDS: usize = 50;

type Counts = BTreeMap<String, u64>;

impl Member {
    /// Applies `change` to the usage record of `tenant` until the swap holds; `change` answers
    /// `false` to give up (nothing written).
    fn swap_usage(
        &self,
        tenant: &str,
        mut change: impl FnMut(&mut Counts) -> Result<bool, EtcdError>,
    ) -> Result<bool, EtcdError> {
        let key = model::usage_key(tenant);
        for _ in 0..ROUNDS {
            let (mut counts, rev) = match self.etcd.get(&key)? {
                Some(kv) => (
                    serde_json::from_slice::<Counts>(&kv.value).unwrap_or_default(),
                    kv.mod_revision,
                ),
                None => (Counts::new(), 0),
            };
            if !change(&mut counts)? {
                return Ok(false);
            }
            counts.retain(|_, n| *n > 0);
            let body = serde_json::to_vec(&counts).unwrap_or_default();
            if self.etcd.compare_and_put(&key, &body, rev)? {
                return Ok(true);
            }
        }
        Err(EtcdError::Parse {
            path: key,
            body: format!("no swap held in {ROUNDS} rounds"),
        })
    }

    /// Reserves `n` sandboxes of `tenant` (whose quota is `max`) on this node: `false` when
    /// the cluster holds `max` already.
    pub fn reserve(&self, tenant: &str, max: u64, n: u64) -> Result<bool, EtcdError> {
        let me = self.cfg.name.clone();
        let mut pruned = false;
        self.swap_usage(tenant, |counts| {
            let total = |c: &Counts| c.values().sum::<u64>();
            if total(counts) + n > max && !pruned {
                // Nodes that were lost hold nothing any more.
                let (live, _) = self.etcd.prefix(&model::nodes_prefix())?;
                let live: Vec<String> = live
                    .iter()
                    .filter_map(|kv| kv.key.rsplit('/').next().map(str::to_owned))
                    .collect();
                counts.retain(|node, _| *node == me || live.contains(node));
                pruned = true;
            }
            if total(counts) + n > max {
                return Ok(false);
            }
            *counts.entry(me.clone()).or_default() += n;
            Ok(true)
        })
    }

    /// Releases `n` sandboxes of `tenant` on this node.
    pub fn release(&self, tenant: &str, n: u64) -> Result<(), EtcdError> {
        let me = self.cfg.name.clone();
        self.swap_usage(tenant, |counts| {
            let c = counts.entry(me.clone()).or_default();
            *c = c.saturating_sub(n);
            Ok(true)
        })
        .map(|_| ())
    }

    /// Sets this node's count of every tenant with a quota to what it holds (`held`, by
    /// tenant name), and to 0 in the records of tenants it holds none of.
    pub(super) fn reconcile_usage(&self, held: &BTreeMap<String, u64>) -> Result<(), EtcdError> {
        let (records, _) = self.etcd.prefix(&model::usage_prefix())?;
        let mut tenants: Vec<String> = records
            .iter()
            .filter_map(|kv| kv.key.rsplit('/').next().map(str::to_owned))
            .collect();
        tenants.extend(held.keys().cloned());
        tenants.sort();
        tenants.dedup();
        let me = self.cfg.name.clone();
        for t in tenants {
            let want = held.get(&t).copied().unwrap_or(0);
            let now = records
                .iter()
                .find(|kv| kv.key == model::usage_key(&t))
                .and_then(|kv| serde_json::from_slice::<Counts>(&kv.value).ok())
                .and_then(|c| c.get(&me).copied())
                .unwrap_or(0);
            if now != want {
                self.swap_usage(&t, |counts| {
                    counts.insert(me.clone(), want);
                    Ok(true)
                })?;
            }
        }
        Ok(())
    }
}

impl crate::lifecycle::ClusterQuota for Member {
    fn reserve(&self, tenant: &str, max: u64, n: u64) -> Result<bool, String> {
        Member::reserve(self, tenant, max, n).map_err(|e| e.to_string())
    }

    fn release(&self, tenant: &str, n: u64) {
        if let Err(e) = Member::release(self, tenant, n) {
            tracing::warn!(tenant = %tenant, error = %e, "cluster: releasing a quota reservation failed (the next reconciliation fixes it)");
        }
    }
}
