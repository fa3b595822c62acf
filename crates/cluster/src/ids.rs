//! The node number in a sandbox id. A sandbox id is `sb-` and 16 hex digits; on a node of a
//! cluster the first four digits are the node's number (1–65535, claimed once in etcd when the
//! node first joins), so a gateway routes a call to the sandbox's node with no lookup. A node
//! outside a cluster has number 0 and its ids are what they always were.

/// The node number `id` (a sandbox's `sb-…` or a snapshot's `sn-…`) carries (`None`: not
/// such an id, or 0: made outside a cluster).
pub fn node_number(id: &str) -> Option<u16> {
    let hex = id.strip_prefix("sb-").or_else(|| id.strip_prefix("sn-"))?;
    if hex.len() != 16 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    match u16::from_str_radix(&hex[..4], 16).ok()? {
        0 => None,
        n => Some(n),
    }
}

/// `bits` with its top 16 bits replaced by node number `number`.
pub fn with_number(number: u16, bits: u64) -> u64 {
    (u64::from(number) << 48) | (bits & 0x0000_ffff_ffff_ffff)
}

/// The node's number: the one `name` held before, else the lowest free one.
pub fn claim_number(etcd: &crate::etcd::Etcd, name: &str) -> Result<u16, crate::etcd::EtcdError> {
    let (held, _) = etcd.prefix(&crate::model::numbers_prefix())?;
    let mut taken = std::collections::BTreeSet::new();
    for kv in &held {
        let n: Option<u16> = kv.key.rsplit('/').next().and_then(|s| s.parse().ok());
        if kv.value == name.as_bytes() {
            if let Some(n) = n {
                return Ok(n);
            }
        }
        taken.extend(n);
    }
    for n in 1..=u16::MAX {
        if !taken.contains(&n) && etcd.create(&crate::model::number_key(n), name.as_bytes(), 0)? {
            return Ok(n);
        }
    }
    Err(crate::etcd::EtcdError::Parse {
        path: crate::model::numbers_prefix(),
        body: "every node number is taken".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_number_round_trips() {
        let id = format!("sb-{:016x}", with_number(0x2a, 0xdead_beef_0123_4567));
        assert_eq!(id, "sb-002abeef01234567");
        assert_eq!(node_number(&id), Some(0x2a));
        assert_eq!(node_number("sb-0000beef01234567"), None);
        assert_eq!(node_number("sb-002abeef0123456"), None);
        assert_eq!(node_number("tn-002abeef01234567"), None);
        assert_eq!(node_number("sb-002abeef0123456z"), None);
    }
}
