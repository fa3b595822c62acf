//! The gateway's registration: its addresses under a lease of its own in etcd
//! (`gateways/<id>`), so that every node keeps its sandboxes from reaching them (network
//! egress never reaches the cluster's gateways). Gone with the gateway within [`TTL`].

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Mutex;
use std::time::Duration;

use crate::etcd::{Etcd, EtcdError};
use crate::model;

/// The registration's lease, in seconds.
pub const TTL: i64 = 10;

/// How often the lease is renewed.
pub const RENEW_EVERY: Duration = Duration::from_secs(3);

/// What this gateway tells the cluster of itself.
#[derive(Debug)]
pub struct Registration {
    id: String,
    addrs: Vec<Ipv4Addr>,
    /// The lease.
    lease: Mutex<Option<i64>>,
}

impl Registration {
    /// The registration of a gateway listening on `listen`: that address, or every IPv4
    /// address of the host when it listens on all of them.
    pub fn new(listen: SocketAddr) -> Self {
        let addrs = match listen {
            SocketAddr::V4(a) if !a.ip().is_unspecified() => vec![*a.ip()],
            _ => dsec_sys::net::host_ipv4s().unwrap_or_default(),
        };
        let id = format!(
            "{:016x}",
            u64::from(std::process::id()) << 40 ^ model::now_ms()
        );
        Self {
            id,
            addrs,
            lease: Mutex::new(None),
        }
    }

    /// Renews the lease (called every [`RENEW_EVERY`], off the table's refresh: a call to an
    /// etcd without quorum waits out its timeout); registers again, under a new lease, when
    /// it expired or etcd lost it.
    pub fn renew(&self, etcd: &Etcd) -> Result<(), EtcdError> {
        let mut lease = self.lease.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(id) = *lease {
            if etcd.keep_alive(id)? > 0 {
                return Ok(());
            }
        }
        let id = etcd.grant(TTL)?;
        let body = serde_json::json!({ "addrs": self.addrs }).to_string();
        etcd.put(&model::gateway_key(&self.id), body.as_bytes(), id)?;
        *lease = Some(id);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gateway_on_one_address_registers_that_one() {
        let r = Registration::new("192.0.2.7:8080".parse().expect("addr"));
        assert_eq!(r.addrs, vec![Ipv4Addr::new(192, 0, 2, 7)]);
        let body = serde_json::json!({ "addrs": r.addrs }).to_string();
        assert_eq!(
            model::gateway_addrs(body.as_bytes()),
            vec![Ipv4Addr::new(192, 0, 2, 7)]
        );
        assert!(model::gateway_addrs(b"{\"addrs\": [\"x\", 3]}").is_empty());
    }

    #[test]
    fn a_gateway_on_every_address_registers_the_hosts() {
        let r = Registration::new("0.0.0.0:8080".parse().expect("addr"));
        assert!(r.addrs.iter().all(|a| !a.is_loopback()));
        assert_eq!(
            r.addrs,
            dsec_sys::net::host_ipv4s().expect("host addresses")
        );
    }
}
