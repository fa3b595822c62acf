//! Values shared per key (a lock per idempotency key or trajectory, a once-cell per template),
//! made on first use.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The shared value under `key` of `map`, made (default) on first use: per-key locks and
/// once-cells.
pub fn keyed<K: Eq + std::hash::Hash, V: Default>(
    map: &Mutex<HashMap<K, Arc<V>>>,
    key: K,
) -> Arc<V> {
    let mut map = map
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    Arc::clone(map.entry(key).or_default())
}
