//! The node count a cluster should have, for an external autoscaler to act on (the gateway
//! publishes it in `GET /v1/cluster` and `/metrics`; it never starts or stops a machine).
//!
//! - **Up, at once**, when creates wait (the nodes' create queues, and creates the gateway
//!   refused for capacity in the last [`REFUSED_WINDOW`]): enough nodes for the waiting creates
//!   at the mean slots per node, at least one more; or when use (the highest of CPU, memory
//!   promised and slots) is over [`UP_ABOVE`]: enough nodes to bring it to [`TARGET`].
//! - **Down, slowly**: only once use has stayed under [`DOWN_BELOW`] for [`DOWN_AFTER`], to the
//!   count that brings it to [`TARGET`] (at least one node).
//! - Otherwise the live count.

use std::time::{Duration, Instant};

/// Use above which the cluster grows.
pub const UP_ABOVE: f64 = 0.8;
/// Use below which, sustained, the cluster shrinks.
pub const DOWN_BELOW: f64 = 0.5;
/// How long use must stay below [`DOWN_BELOW`] before the cluster shrinks.
pub const DOWN_AFTER: Duration = Duration::from_secs(300);
/// The use a resize aims at.
pub const TARGET: f64 = 0.7;
/// How long a create refused for capacity counts as waiting (its caller retries).
pub const REFUSED_WINDOW: Duration = Duration::from_secs(10);

/// What the cluster looks like now.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Load {
    /// Live nodes that take placements (not draining).
    pub nodes: u64,
    /// Creates waiting.
    pub queue: u64,
    /// The highest of CPU use, memory promised and slots used, as fractions of the live nodes'.
    pub used: f64,
    /// Mean sandbox slots per live node.
    pub slots_per_node: f64,
}

/// The desired node count, with the memory of how long use has been low.
#[derive(Debug, Default)]
pub struct Desired {
    below_since: Option<Instant>,
}

impl Desired {
    /// The node count the cluster should have, given `load` at `now`.
    pub fn update(&mut self, load: Load, now: Instant) -> u64 {
        let n = load.nodes;
        let sized = |used: f64| ((n as f64 * used / TARGET).ceil() as u64).max(1);
        if load.used < DOWN_BELOW && load.queue == 0 {
            self.below_since.get_or_insert(now);
        } else {
            self.below_since = None;
        }
        if load.queue > 0 {
            let more = (load.queue as f64 / load.slots_per_node.max(1.0)).ceil() as u64;
            return (n + more.max(1)).max(sized(load.used));
        }
        if load.used > UP_ABOVE {
            return sized(load.used).max(n + 1);
        }
        match self.below_since {
            Some(since) if now.duration_since(since) >= DOWN_AFTER => sized(load.used).min(n),
            _ => n.max(1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(nodes: u64, queue: u64, used: f64) -> Load {
        Load {
            nodes,
            queue,
            used,
            slots_per_node: 100.0,
        }
    }

    #[test]
    fn a_queue_or_high_use_grows_the_cluster_at_once() {
        let t = Instant::now();
        let mut d = Desired::default();
        assert_eq!(d.update(load(4, 0, 0.6), t), 4);
        assert_eq!(
            d.update(load(4, 1, 0.6), t),
            5,
            "one waiting create: one more node"
        );
        assert_eq!(
            d.update(load(4, 250, 0.6), t),
            7,
            "250 waiting at 100 a node"
        );
        assert_eq!(
            d.update(load(4, 0, 0.95), t),
            6,
            "95 % of 4 nodes is 70 % of 6"
        );
        assert_eq!(d.update(load(10, 0, 0.81), t), 12);
    }

    #[test]
    fn low_use_shrinks_the_cluster_only_after_five_minutes() {
        let t = Instant::now();
        let mut d = Desired::default();
        assert_eq!(d.update(load(10, 0, 0.2), t), 10);
        assert_eq!(d.update(load(10, 0, 0.2), t + Duration::from_secs(299)), 10);
        assert_eq!(
            d.update(load(10, 0, 0.2), t + DOWN_AFTER),
            3,
            "20 % of 10 is 70 % of 3"
        );
        // A spike restarts the clock.
        assert_eq!(d.update(load(10, 0, 0.6), t + DOWN_AFTER), 10);
        assert_eq!(d.update(load(10, 0, 0.2), t + 2 * DOWN_AFTER), 10);
        // Never below one node.
        let mut d = Desired::default();
        d.update(load(2, 0, 0.0), t);
        assert_eq!(d.update(load(2, 0, 0.0), t + DOWN_AFTER), 1);
        assert_eq!(Desired::default().update(load(0, 0, 0.0), t), 1);
    }
}
