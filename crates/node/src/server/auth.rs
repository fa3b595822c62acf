//! API keys and tenants: keys are random, shown once, and stored only as their sha256.

use sha2::{Digest as _, Sha256};

use super::error::ApiResult;
use crate::clock::now_ms;
use crate::store::{Store, Tenant};

/// `n` random bytes as hex.
fn random_hex(n: usize) -> String {
    let mut b = vec![0u8; n];
    // getrandom only fails when the kernel has no entropy source at all.
    getrandom::fill(&mut b).unwrap_or_else(|_| {
        let t = now_ms().to_le_bytes();
        for (i, x) in b.iter_mut().enumerate() {
            *x = t[i % 8] ^ (i as u8).wrapping_mul(151);
        }
    });
    hex::encode(b)
}

/// A fresh request id.
pub fn random_id() -> String {
    random_hex(8)
}

/// sha256 of a key, hex.
pub fn hash_key(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

/// Creates a tenant with a fresh API key; returns it and the key (shown once).
pub fn new_tenant(
    store: &Store,
    name: &str,
    admin: bool,
    max_sandboxes: Option<u64>,
    max_memory_bytes: Option<u64>,
    max_snapshot_bytes: Option<u64>,
    egress_ceiling: Option<dsec_api::network::Egress>,
) -> ApiResult<(Tenant, String)> {
    let t = Tenant {
        id: format!("tn-{}", random_hex(8)),
        name: name.to_owned(),
        admin,
        max_sandboxes,
        max_memory_bytes,
        max_snapshot_bytes,
        created_at_ms: now_ms(),
        egress_ceiling,
    };
    store.insert_tenant(&t)?;
    let key = format!("dsk_{}", random_hex(24));
    store.insert_key(&hash_key(&key), &t.id, now_ms())?;
    Ok((t, key))
}
