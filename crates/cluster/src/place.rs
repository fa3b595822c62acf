//! Where a create goes. Each node that can take the sandbox (not draining, a free slot, the
//! memory) gets a score:
//!
//! - a ready pooled sandbox of the template: +1000 (the create is an acquire);
//! - the template's layers held locally: +100 (a node without them fetches them first);
//! - free capacity: up to +50 (the free fraction of its slots and of its memory, the lower);
//! - the tenant's spread: −30 × the tenant's share of its own sandboxes already on the node.
//!
//! The highest score wins; ties go to the node with more free slots, then by name. A batch of
//! `n` is placed one sandbox at a time against a copy of the reports that each placement
//! updates, so a batch spreads instead of piling onto the best node — in one pass, not `n`
//! round trips.

use std::collections::BTreeMap;

use crate::model::NodeReport;

/// What a create asks for.
#[derive(Debug, Clone)]
pub struct Ask<'a> {
    /// Template name.
    pub template: &'a str,
    /// Tenant id.
    pub tenant: &'a str,
    /// Its `memory_max`, bytes.
    pub memory: u64,
}

/// The score of placing `ask` on `n` (`None`: `n` cannot take it).
pub fn score(n: &NodeReport, ask: &Ask<'_>, tenant_total: u64) -> Option<f64> {
    if n.draining || n.free_slots() == 0 || (n.memory_bytes > 0 && n.free_memory() < ask.memory) {
        return None;
    }
    let mut s = 0.0;
    if n.pools.get(ask.template).copied().unwrap_or(0) > 0 {
        s += 1000.0;
    }
    if ask.template == "host" || n.templates.iter().any(|t| t == ask.template) {
        s += 100.0;
    }
    let slots = n.free_slots() as f64 / n.max_sandboxes.max(1) as f64;
    let mem = if n.memory_bytes == 0 {
        1.0
    } else {
        n.free_memory() as f64 / n.memory_bytes as f64
    };
    s += 50.0 * slots.min(mem);
    let mine = n.tenants.get(ask.tenant).copied().unwrap_or(0) as f64;
    s -= 30.0 * mine / (tenant_total.max(1) as f64);
    Some(s)
}

/// Places `count` sandboxes of `ask` on `nodes`: answers how many go to each node (by name),
/// and how many found no node.
pub fn place(nodes: &[NodeReport], ask: &Ask<'_>, count: usize) -> (BTreeMap<String, u64>, usize) {
    let mut nodes: Vec<NodeReport> = nodes.to_vec();
    let mut tenant_total: u64 = nodes
        .iter()
        .map(|n| n.tenants.get(ask.tenant).copied().unwrap_or(0))
        .sum();
    let mut out = BTreeMap::new();
    let mut unplaced = 0;
    for _ in 0..count {
        let best = nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| score(n, ask, tenant_total + 1).map(|s| (i, s)))
            .max_by(|(a, sa), (b, sb)| {
                sa.total_cmp(sb)
                    .then(nodes[*a].free_slots().cmp(&nodes[*b].free_slots()))
                    .then(nodes[*b].name.cmp(&nodes[*a].name))
            });
        let Some((i, _)) = best else {
            unplaced += 1;
            continue;
        };
        let n = &mut nodes[i];
        n.sandboxes += 1;
        n.memory_allocated_bytes += ask.memory;
        if let Some(p) = n.pools.get_mut(ask.template) {
            *p = p.saturating_sub(1);
        }
        *n.tenants.entry(ask.tenant.to_owned()).or_default() += 1;
        tenant_total += 1;
        *out.entry(n.name.clone()).or_default() += 1;
    }
    (out, unplaced)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, max: u64) -> NodeReport {
        NodeReport {
            name: name.into(),
            max_sandboxes: max,
            memory_bytes: 64 << 30,
            ..Default::default()
        }
    }

    const ASK: Ask<'static> = Ask {
        template: "py",
        tenant: "tn-a",
        memory: 1 << 30,
    };

    #[test]
    fn a_pool_hit_beats_affinity_and_affinity_beats_free_room() {
        let mut a = node("a", 100);
        let mut b = node("b", 100);
        let c = node("c", 1000);
        a.templates = vec!["py".into()];
        b.pools.insert("py".into(), 1);
        let (got, _) = place(&[a.clone(), b, c.clone()], &ASK, 1);
        assert_eq!(got.keys().collect::<Vec<_>>(), ["b"]);
        let (got, _) = place(&[a, c], &ASK, 1);
        assert_eq!(got.keys().collect::<Vec<_>>(), ["a"]);
    }

    #[test]
    fn a_batch_is_spread_and_never_overcommits() {
        let nodes: Vec<NodeReport> = ["a", "b", "c", "d"].iter().map(|n| node(n, 10)).collect();
        let (got, unplaced) = place(&nodes, &ASK, 40);
        assert_eq!(unplaced, 0);
        assert!(got.values().all(|&n| n == 10), "{got:?}");
        let (got, unplaced) = place(&nodes, &ASK, 20);
        assert_eq!(unplaced, 0);
        assert!(got.values().all(|&n| n == 5), "{got:?}");
        let (_, unplaced) = place(&nodes, &ASK, 45);
        assert_eq!(unplaced, 5);
    }

    #[test]
    fn draining_and_full_nodes_take_nothing() {
        let mut a = node("a", 10);
        a.draining = true;
        let mut b = node("b", 10);
        b.sandboxes = 10;
        let mut c = node("c", 10);
        c.memory_allocated_bytes = 64 << 30;
        assert_eq!(place(&[a, b, c], &ASK, 1).1, 1);
    }
}
