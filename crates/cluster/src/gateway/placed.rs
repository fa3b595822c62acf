//! This gateway's own recent placements, counted on top of the node reports until a report
//! counts them. Without it, every create between two table refreshes sees the same reports and
//! goes to the same best node: a burst piles onto one node until it refuses. A placement on
//! node N counts while N's last report is older than the placement (plus [`SLACK_MS`] for the
//! clocks of two machines) and at most [`PENDING_FOR`]. Other gateways' placements are seen
//! once the node reports them (a second at most).

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use crate::model::NodeReport;

/// The longest a placement counts: by then the node's report (rewritten every second) does.
const PENDING_FOR: Duration = Duration::from_secs(3);

/// How much later than a placement a report must be written to count it.
const SLACK_MS: u64 = 250;

/// Most placements remembered per node (the oldest go first).
const MAX: usize = 100_000;

/// One placement: whose, how many sandboxes, memory each, when (ms since the epoch).
#[derive(Debug)]
struct One {
    tenant: String,
    count: u64,
    memory: u64,
    at_ms: u64,
}

/// This gateway's recent placements, by node.
#[derive(Debug, Default)]
pub struct Placed {
    recent: Mutex<HashMap<String, VecDeque<One>>>,
}

impl Placed {
    /// Counts `count` sandboxes of `tenant`, `memory` bytes each, placed on `node` at `now_ms`.
    pub fn record(&self, node: &str, tenant: &str, count: u64, memory: u64, now_ms: u64) {
        let mut r = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        let q = r.entry(node.to_owned()).or_default();
        if q.len() == MAX {
            q.pop_front();
        }
        q.push_back(One {
            tenant: tenant.to_owned(),
            count,
            memory,
            at_ms: now_ms,
        });
    }

    /// Uncounts one sandbox of `node` (deleted through this gateway): the newest placement
    /// there that a report may not count yet.
    pub fn forget_one(&self, node: &str) {
        let mut r = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(q) = r.get_mut(node) {
            if let Some(last) = q.back_mut() {
                last.count = last.count.saturating_sub(1);
                if last.count == 0 {
                    q.pop_back();
                }
            }
        }
    }

    /// Adds to `nodes` what their reports do not count yet (and forgets what they do: reports
    /// only get newer).
    pub fn adjust(&self, nodes: &mut [NodeReport], now_ms: u64) {
        let mut r = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        let horizon = now_ms.saturating_sub(PENDING_FOR.as_millis() as u64);
        r.retain(|_, q| {
            while q.front().is_some_and(|o| o.at_ms < horizon) {
                q.pop_front();
            }
            !q.is_empty()
        });
        for n in nodes.iter_mut() {
            let Some(q) = r.get_mut(&n.name) else {
                continue;
            };
            while q
                .front()
                .is_some_and(|o| o.at_ms + SLACK_MS <= n.updated_ms)
            {
                q.pop_front();
            }
            for o in q.iter() {
                n.sandboxes += o.count;
                n.memory_allocated_bytes += o.count * o.memory;
                *n.tenants.entry(o.tenant.clone()).or_default() += o.count;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_placement_counts_until_a_later_report_or_the_horizon() {
        let p = Placed::default();
        let report = |updated_ms| NodeReport {
            name: "a".into(),
            max_sandboxes: 10,
            updated_ms,
            ..Default::default()
        };
        p.record("a", "tn-1", 3, 100, 10_000);
        let mut n = [report(9_900)];
        p.adjust(&mut n, 10_100);
        assert_eq!((n[0].sandboxes, n[0].memory_allocated_bytes), (3, 300));
        assert_eq!(n[0].tenants.get("tn-1"), Some(&3));
        // A report written well after the placement counts it already.
        let mut n = [report(10_400)];
        p.adjust(&mut n, 10_500);
        assert_eq!(n[0].sandboxes, 0);
        // A delete through the gateway uncounts the newest.
        p.record("a", "tn-1", 1, 100, 10_600);
        p.forget_one("a");
        let mut n = [report(10_400)];
        p.adjust(&mut n, 10_700);
        assert_eq!(n[0].sandboxes, 0);
        // Past the horizon it is forgotten.
        let mut n = [report(9_000)];
        p.adjust(&mut n, 10_000 + 3_001);
        assert_eq!(n[0].sandboxes, 0);
    }
}
