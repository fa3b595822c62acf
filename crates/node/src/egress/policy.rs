//! What a sandbox's egress policy means for its DNS answers and its kernel rules: pure
//! functions, no I/O.

use std::net::Ipv4Addr;

use dsec_api::network::{network, Dest, Egress, Rule};
use dsec_sys::netlink::nft::{concat, ipv4, port, Element};

/// Networks no sandbox reaches by an `"all"` policy or through a DNS answer (private, shared,
/// loopback, link-local, multicast, reserved) unless one of its rules lists them.
pub const PRIVATE: [(Ipv4Addr, u8); 9] = [
    (Ipv4Addr::new(0, 0, 0, 0), 8),
    (Ipv4Addr::new(10, 0, 0, 0), 8),
    (Ipv4Addr::new(100, 64, 0, 0), 10),
    (Ipv4Addr::new(127, 0, 0, 0), 8),
    (Ipv4Addr::new(169, 254, 0, 0), 16),
    (Ipv4Addr::new(172, 16, 0, 0), 12),
    (Ipv4Addr::new(192, 168, 0, 0), 16),
    (Ipv4Addr::new(224, 0, 0, 0), 4),
    (Ipv4Addr::new(240, 0, 0, 0), 4),
];

/// Networks no sandbox ever reaches, whatever its rules: link-local (cloud metadata),
/// loopback, "this network", multicast and reserved. The node adds its sandboxes' subnet and
/// its own addresses.
pub const NEVER: [(Ipv4Addr, u8); 5] = [
    (Ipv4Addr::new(0, 0, 0, 0), 8),
    (Ipv4Addr::new(127, 0, 0, 0), 8),
    (Ipv4Addr::new(169, 254, 0, 0), 16),
    (Ipv4Addr::new(224, 0, 0, 0), 4),
    (Ipv4Addr::new(240, 0, 0, 0), 4),
];

/// Whether `a` lies in one of `nets`.
pub fn in_nets(nets: &[(Ipv4Addr, u8)], a: Ipv4Addr) -> bool {
    nets.iter().any(|&(n, l)| network(a, l) == n)
}

/// What the node's DNS does with a name a sandbox asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NameVerdict {
    /// Refused: not allowed (or denied).
    Deny,
    /// Resolved upstream; its IPv4 answers are pinned for these ports (disjoint, sorted).
    Pin(Vec<(u16, u16)>),
    /// Resolved upstream, nothing pinned (the policy reaches the public internet anyway).
    Open,
}

/// The verdict for `name` (lower case, no trailing dot) under `policy`.
pub fn name_verdict(policy: &Egress, name: &str) -> NameVerdict {
    match policy {
        Egress::None => NameVerdict::Deny,
        Egress::All => NameVerdict::Open,
        Egress::Allow(l) => {
            if l.deny
                .iter()
                .any(|r| r.matches_name(name) && r.ports.is_none())
            {
                return NameVerdict::Deny;
            }
            let ranges: Vec<(u16, u16)> = l
                .allow
                .iter()
                .filter(|r| r.matches_name(name))
                .map(|r| r.ports.unwrap_or((0, u16::MAX)))
                .collect();
            if ranges.is_empty() {
                NameVerdict::Deny
            } else {
                NameVerdict::Pin(union(ranges))
            }
        }
    }
}

/// Whether a DNS answer's address may be handed to (and pinned for) a sandbox: never one of
/// `never`, and a private one only when a rule of the policy lists its network (no DNS
/// rebinding onto the node's neighbourhood).
pub fn answer_allowed(policy: &Egress, never: &[(Ipv4Addr, u8)], a: Ipv4Addr) -> bool {
    if in_nets(never, a) {
        // Unless a `reserved` rule (allowed by an admin) lists it.
        return matches!(policy, Egress::Allow(l) if l.reserved.iter().any(|r| r.holds(a)));
    }
    if !in_nets(&PRIVATE, a) {
        return true;
    }
    match policy {
        Egress::Allow(l) => l.allow.iter().any(|r| r.holds(a)),
        _ => false,
    }
}

/// The union of port ranges: sorted, disjoint, adjacent ones merged.
pub fn union(mut ranges: Vec<(u16, u16)>) -> Vec<(u16, u16)> {
    ranges.sort_unstable();
    let mut out: Vec<(u16, u16)> = Vec::with_capacity(ranges.len());
    for (a, b) in ranges {
        match out.last_mut() {
            Some(last) if u32::from(a) <= u32::from(last.1) + 1 => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

/// The last address of `net/len`.
fn broadcast(net: Ipv4Addr, len: u8) -> Ipv4Addr {
    let host = if len >= 32 {
        0
    } else {
        u32::MAX >> u32::from(len)
    };
    Ipv4Addr::from(u32::from(net) | host)
}

/// An element of a `ipv4_addr . ipv4_addr . inet_service` interval set: from `sandbox` to
/// `net/len`, ports `ports`.
pub fn element(
    sandbox: Ipv4Addr,
    net: Ipv4Addr,
    len: u8,
    ports: (u16, u16),
    timeout_ms: Option<u64>,
) -> Element {
    let first = network(net, len);
    Element {
        key: concat(&[&ipv4(sandbox), &ipv4(first), &port(ports.0)]),
        key_end: Some(concat(&[
            &ipv4(sandbox),
            &ipv4(broadcast(first, len)),
            &port(ports.1),
        ])),
        timeout_ms,
    }
}

/// The elements a policy's address rules (CIDRs) put in a set: `rules`' networks for
/// `sandbox`, with overlapping port ranges of one network merged (the kernel refuses
/// overlapping elements).
pub fn net_elements(sandbox: Ipv4Addr, rules: &[Rule]) -> Vec<Element> {
    type Net = (Ipv4Addr, u8);
    let mut nets: Vec<(Net, Vec<(u16, u16)>)> = Vec::new();
    for r in rules {
        if let Dest::Net(n, l) = r.dest {
            let ports = r.ports.unwrap_or((0, u16::MAX));
            match nets.iter_mut().find(|(k, _)| *k == (n, l)) {
                Some((_, v)) => v.push(ports),
                None => nets.push(((n, l), vec![ports])),
            }
        }
    }
    // Nested networks (10.0.0.0/8 and 10.1.0.0/16) overlap too: keep only the outermost one
    // when it covers the inner one's ports, else both (the kernel may then refuse the pair,
    // reported by the caller).
    let mut out = Vec::new();
    for (i, ((n, l), ports)) in nets.iter().enumerate() {
        let ports = union(ports.clone());
        let covered = nets.iter().enumerate().any(|(j, ((m, k), p))| {
            j != i
                && *k < *l
                && network(*n, *k) == *m
                && union(p.clone())
                    .iter()
                    .any(|&(a, b)| a == 0 && b == u16::MAX)
        });
        if covered {
            continue;
        }
        for p in ports {
            out.push(element(sandbox, *n, *l, p, None));
        }
    }
    out
}

/// A policy's elements in the table's static sets (address rules only: names are pinned as
/// they resolve): `allow4` (its `allow` and `reserved` rules), `deny4`, `open4` (its
/// `reserved` rules: past `never4`), and whether it reaches the public internet (`all4`).
#[derive(Debug, Clone, Default)]
pub struct Statics {
    /// In `allow4`.
    pub allow: Vec<Element>,
    /// In `deny4`.
    pub deny: Vec<Element>,
    /// In `open4`.
    pub open: Vec<Element>,
    /// In `all4`.
    pub all: bool,
}

/// The static elements of sandbox `sandbox` under `policy`.
pub fn static_elements(sandbox: Ipv4Addr, policy: &Egress) -> Statics {
    match policy {
        Egress::None => Statics::default(),
        Egress::All => Statics {
            all: true,
            ..Statics::default()
        },
        Egress::Allow(l) => {
            let reach: Vec<Rule> = l.allow.iter().chain(&l.reserved).cloned().collect();
            Statics {
                allow: net_elements(sandbox, &reach),
                deny: net_elements(sandbox, &l.deny),
                open: net_elements(sandbox, &l.reserved),
                all: false,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsec_api::network::NetworkSpec;

    fn policy(json: &str) -> Egress {
        serde_json::from_str::<NetworkSpec>(json)
            .expect("policy")
            .egress
    }

    #[test]
    fn names_follow_the_lists() {
        let p = policy(
            r#"{"egress":{"allow":["pypi.org","*.pythonhosted.org","github.com:443","github.com:22","*.github.com"],"deny":["evil.pythonhosted.org"]}}"#,
        );
        assert_eq!(
            name_verdict(&p, "pypi.org"),
            NameVerdict::Pin(vec![(0, 65535)])
        );
        assert_eq!(
            name_verdict(&p, "github.com"),
            NameVerdict::Pin(vec![(22, 22), (443, 443)])
        );
        assert_eq!(name_verdict(&p, "evil.pythonhosted.org"), NameVerdict::Deny);
        assert_eq!(name_verdict(&p, "pythonhosted.org"), NameVerdict::Deny);
        assert_eq!(name_verdict(&p, "example.com"), NameVerdict::Deny);
        assert_eq!(name_verdict(&Egress::All, "example.com"), NameVerdict::Open);
        assert_eq!(name_verdict(&Egress::None, "pypi.org"), NameVerdict::Deny);
    }

    #[test]
    fn answers_never_rebind_onto_private_space() {
        let p = policy(r#"{"egress":{"allow":["a.test","10.20.0.0/16"]}}"#);
        let never = [(Ipv4Addr::new(10, 224, 0, 0), 19)];
        assert!(answer_allowed(&p, &never, Ipv4Addr::new(198, 18, 0, 2)));
        assert!(!answer_allowed(&p, &never, Ipv4Addr::new(10, 0, 0, 1)));
        assert!(answer_allowed(&p, &never, Ipv4Addr::new(10, 20, 3, 4)));
        assert!(!answer_allowed(&p, &never, Ipv4Addr::new(10, 224, 0, 5)));
        assert!(!answer_allowed(
            &Egress::All,
            &never,
            Ipv4Addr::new(192, 168, 1, 1)
        ));
        assert!(in_nets(&NEVER, Ipv4Addr::new(169, 254, 169, 254)));
    }

    #[test]
    fn reserved_rules_reach_past_never() {
        let sb = Ipv4Addr::new(10, 224, 0, 2);
        let p = policy(r#"{"egress":{"allow":["a.test"],"reserved":["169.254.169.254:80"]}}"#);
        let meta = Ipv4Addr::new(169, 254, 169, 254);
        assert!(answer_allowed(&p, &NEVER, meta));
        assert!(!answer_allowed(&p, &NEVER, Ipv4Addr::new(169, 254, 1, 1)));
        let st = static_elements(sb, &p);
        assert_eq!((st.allow.len(), st.open.len()), (1, 1), "{st:?}");
        assert_eq!(&st.open[0].key[4..8], &meta.octets());
    }

    #[test]
    fn ranges_merge() {
        assert_eq!(
            union(vec![(5, 9), (1, 3), (4, 4), (20, 30), (25, 26)]),
            vec![(1, 9), (20, 30)]
        );
        assert_eq!(union(vec![(0, 65535), (443, 443)]), vec![(0, 65535)]);
    }

    #[test]
    fn elements_cover_networks() {
        let sb = Ipv4Addr::new(10, 224, 0, 2);
        let p = policy(
            r#"{"egress":{"allow":["10.20.0.0/16","10.0.0.0/8","1.2.3.4:443","1.2.3.4:80","x.test"]}}"#,
        );
        let Statics {
            allow,
            deny,
            open,
            all,
        } = static_elements(sb, &p);
        assert!(!all && deny.is_empty() && open.is_empty());
        // 10.20/16 is inside 10/8 (every port): one element; 1.2.3.4 twice (80, 443).
        assert_eq!(allow.len(), 3, "{allow:?}");
        let e = &allow[0];
        assert_eq!(&e.key[4..8], &[10, 0, 0, 0]);
        assert_eq!(
            e.key_end.as_deref().map(|k| k[4..8].to_vec()),
            Some(vec![10, 255, 255, 255])
        );
        assert_eq!(&e.key[8..10], &[0, 0]);
        assert_eq!(
            e.key_end.as_deref().map(|k| k[8..10].to_vec()),
            Some(vec![255, 255])
        );
    }
}
