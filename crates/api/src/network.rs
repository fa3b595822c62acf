//! A sandbox's network egress policy (`"network"` on a create, `PUT /v1/sandboxes/{id}/network`)
//! and a tenant's ceiling (`"egress_ceiling"`): parsed, checked and compared here, enforced by
//! the node.

use std::fmt;
use std::net::Ipv4Addr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Most rules in one list.
pub const MAX_RULES: usize = 256;

/// `{"egress": …}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkSpec {
    /// Where the sandbox may connect to.
    #[serde(default)]
    pub egress: Egress,
}

impl NetworkSpec {
    /// Whether the sandbox has any path out (`egress` other than `none`).
    pub fn enabled(&self) -> bool {
        self.egress != Egress::None
    }
}

/// Where a sandbox may connect to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Egress {
    /// Nowhere: only its loopback (the default).
    #[default]
    None,
    /// The public internet (never the node, other sandboxes, link-local or private ranges
    /// unless listed).
    All,
    /// The destinations listed.
    Allow(AllowList),
}

/// `{"allow": […], "deny": […]?, "bandwidth_bps"?, "max_connections"?}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AllowList {
    /// Names (`*.` wildcards), addresses and CIDRs, each with an optional `:port` or
    /// `:low-high`.
    pub allow: Vec<Rule>,
    /// Taken out of `allow`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deny: Vec<Rule>,
    /// Most bytes per second each way.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bandwidth_bps: Option<u64>,
    /// Most open connections.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<u32>,
    /// Networks no sandbox otherwise reaches (link-local and cloud metadata, reserved space, the
    /// node's `--egress-never` list, the cluster's etcd and gateways) that this one may:
    /// addresses and CIDRs only, with optional ports. Allowed separately, by an admin: the admin
    /// tenant may list them; another tenant only those its ceiling's own `reserved` covers.
    /// Never the node itself or other sandboxes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reserved: Vec<Rule>,
}

/// One destination: a name pattern or an IPv4 network, and ports.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Rule {
    /// What it names.
    pub dest: Dest,
    /// Ports, inclusive (`None`: every port).
    pub ports: Option<(u16, u16)>,
}

/// A rule's destination.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Dest {
    /// A DNS name, lower case, or `*.suffix` (any name under `suffix`, not `suffix` itself).
    Name(String),
    /// An IPv4 network (an address is a `/32`).
    Net(Ipv4Addr, u8),
}

/// A policy that cannot be accepted: its `code` is stable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NetworkError {
    /// The policy is malformed (`invalid_argument`).
    #[error("network: {0}")]
    Invalid(String),
    /// The policy reaches outside the tenant's ceiling (`forbidden`).
    #[error("network: {0} is outside the tenant's egress ceiling")]
    Forbidden(String),
}

impl Rule {
    /// Parses `pypi.org`, `*.pythonhosted.org`, `github.com:443`, `10.20.0.0/16`,
    /// `1.2.3.4:8000-9000`.
    pub fn parse(s: &str) -> Result<Rule, NetworkError> {
        let bad = |why: &str| NetworkError::Invalid(format!("{s:?}: {why}"));
        let s = s.trim();
        if s.is_empty() || s.len() > 300 {
            return Err(bad("a rule is 1 to 300 characters"));
        }
        if s.contains(':') && s.matches(':').count() > 1 {
            return Err(bad("IPv6 destinations are not supported"));
        }
        let (dest, ports) = match s.split_once(':') {
            Some((d, p)) => (d, Some(parse_ports(p).ok_or_else(|| bad("bad port"))?)),
            None => (s, None),
        };
        let dest = if let Some((a, len)) = dest.split_once('/') {
            let a: Ipv4Addr = a.parse().map_err(|_| bad("bad network address"))?;
            let len: u8 = len
                .parse()
                .ok()
                .filter(|l| *l <= 32)
                .ok_or_else(|| bad("bad prefix length"))?;
            Dest::Net(network(a, len), len)
        } else if let Ok(a) = dest.parse::<Ipv4Addr>() {
            Dest::Net(a, 32)
        } else {
            Dest::Name(
                parse_name(dest)
                    .ok_or_else(|| bad("not a DNS name, `*.name`, an IPv4 address or a CIDR"))?,
            )
        };
        Ok(Rule { dest, ports })
    }

    /// Whether every destination of `other` is one of `self`'s.
    pub fn covers(&self, other: &Rule) -> bool {
        let ports = match (self.ports, other.ports) {
            (None, _) => true,
            (Some(_), None) => false,
            (Some((a, b)), Some((c, d))) => a <= c && d <= b,
        };
        ports
            && match (&self.dest, &other.dest) {
                (Dest::Name(p), Dest::Name(n)) => {
                    p == n || p.strip_prefix("*.").is_some_and(|s| under(n, s))
                }
                (Dest::Net(a, l), Dest::Net(b, m)) => l <= m && network(*b, *l) == *a,
                _ => false,
            }
    }

    /// Whether this rule allows the name `name` (lower case).
    pub fn matches_name(&self, name: &str) -> bool {
        match &self.dest {
            Dest::Name(p) => p == name || p.strip_prefix("*.").is_some_and(|s| under(name, s)),
            Dest::Net(..) => false,
        }
    }

    /// Whether this rule's network holds `a`.
    pub fn holds(&self, a: Ipv4Addr) -> bool {
        matches!(self.dest, Dest::Net(n, l) if network(a, l) == n)
    }
}

/// Whether `name` is strictly under `suffix` (`a.b.c` under `b.c`, or under `*.b.c` as a
/// pattern `*.c`).
fn under(name: &str, suffix: &str) -> bool {
    let suffix = suffix.strip_prefix("*.").unwrap_or(suffix);
    name.len() > suffix.len() + 1
        && name.ends_with(suffix)
        && name.as_bytes()[name.len() - suffix.len() - 1] == b'.'
}

/// `a` with the bits past `len` cleared.
pub fn network(a: Ipv4Addr, len: u8) -> Ipv4Addr {
    let mask = if len == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(len))
    };
    Ipv4Addr::from(u32::from(a) & mask)
}

fn parse_ports(p: &str) -> Option<(u16, u16)> {
    let (a, b) = match p.split_once('-') {
        Some((a, b)) => (a.parse().ok()?, b.parse().ok()?),
        None => {
            let a = p.parse().ok()?;
            (a, a)
        }
    };
    (a >= 1 && a <= b).then_some((a, b))
}

/// A DNS name or `*.name`, lower-cased; `None` when it is neither.
fn parse_name(s: &str) -> Option<String> {
    let s = s.strip_suffix('.').unwrap_or(s).to_ascii_lowercase();
    let body = s.strip_prefix("*.").unwrap_or(&s);
    let ok = !body.is_empty()
        && body.len() <= 253
        // (`*.tld` names a whole top-level domain; a name alone has a dot.)
        && (body.contains('.') || s.starts_with("*."))
        && body.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && l.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
        && !body.bytes().all(|b| b.is_ascii_digit() || b == b'.');
    ok.then_some(s)
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.dest {
            Dest::Name(n) => write!(f, "{n}")?,
            Dest::Net(a, 32) => write!(f, "{a}")?,
            Dest::Net(a, l) => write!(f, "{a}/{l}")?,
        }
        match self.ports {
            None => Ok(()),
            Some((a, b)) if a == b => write!(f, ":{a}"),
            Some((a, b)) => write!(f, ":{a}-{b}"),
        }
    }
}

impl Serialize for Rule {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Rule {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Rule::parse(&s).map_err(serde::de::Error::custom)
    }
}

impl Serialize for Egress {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Egress::None => s.serialize_str("none"),
            Egress::All => s.serialize_str("all"),
            Egress::Allow(l) => l.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for Egress {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Word(String),
            List(AllowList),
        }
        match Raw::deserialize(d).map_err(|_| {
            serde::de::Error::custom(
                "egress is \"none\", \"all\" or {\"allow\": [...], \"deny\"?, \"reserved\"?, \"bandwidth_bps\"?, \"max_connections\"?}",
            )
        })? {
            Raw::Word(w) if w == "none" => Ok(Egress::None),
            Raw::Word(w) if w == "all" => Ok(Egress::All),
            Raw::Word(w) => Err(serde::de::Error::custom(format!(
                "egress {w:?}: expected \"none\", \"all\" or an allow list"
            ))),
            Raw::List(l) => {
                l.check().map_err(serde::de::Error::custom)?;
                Ok(Egress::Allow(l))
            }
        }
    }
}

impl AllowList {
    /// Bounds: list lengths, caps above zero.
    pub fn check(&self) -> Result<(), NetworkError> {
        if self.allow.len() + self.deny.len() + self.reserved.len() > MAX_RULES {
            return Err(NetworkError::Invalid(format!(
                "at most {MAX_RULES} rules in allow, deny and reserved together"
            )));
        }
        if let Some(r) = self
            .reserved
            .iter()
            .find(|r| matches!(r.dest, Dest::Name(_)))
        {
            return Err(NetworkError::Invalid(format!(
                "reserved {r}: addresses and CIDRs only, no names"
            )));
        }
        if self.bandwidth_bps == Some(0) || self.max_connections == Some(0) {
            return Err(NetworkError::Invalid(
                "bandwidth_bps and max_connections must be above 0 (leave them out for no cap)"
                    .into(),
            ));
        }
        Ok(())
    }
}

impl Egress {
    /// Checks that `self` lies within `ceiling`: `Forbidden` names what does not.
    pub fn within(&self, ceiling: &Egress) -> Result<(), NetworkError> {
        match (ceiling, self) {
            (_, Egress::None) => Ok(()),
            (Egress::All, Egress::Allow(p)) => match p.reserved.first() {
                // `all` is the public internet: reserved networks are allowed separately.
                Some(r) => Err(NetworkError::Forbidden(format!("reserved {r}"))),
                None => Ok(()),
            },
            (Egress::All, _) => Ok(()),
            (Egress::None, _) => Err(NetworkError::Forbidden("any egress".into())),
            (Egress::Allow(_), Egress::All) => {
                Err(NetworkError::Forbidden("egress \"all\"".into()))
            }
            (Egress::Allow(c), Egress::Allow(p)) => {
                for r in &p.allow {
                    if !c.allow.iter().any(|cr| cr.covers(r)) {
                        return Err(NetworkError::Forbidden(r.to_string()));
                    }
                }
                for r in &p.reserved {
                    if !c.reserved.iter().any(|cr| cr.covers(r)) {
                        return Err(NetworkError::Forbidden(format!("reserved {r}")));
                    }
                }
                let capped = |cap: Option<u64>, asked: Option<u64>| match (cap, asked) {
                    (Some(c), Some(a)) => a <= c,
                    (Some(_), None) => false,
                    (None, _) => true,
                };
                if !capped(c.bandwidth_bps, p.bandwidth_bps) {
                    return Err(NetworkError::Forbidden("bandwidth_bps".into()));
                }
                if !capped(
                    c.max_connections.map(u64::from),
                    p.max_connections.map(u64::from),
                ) {
                    return Err(NetworkError::Forbidden("max_connections".into()));
                }
                Ok(())
            }
        }
    }

    /// The caps a ceiling imposes on a policy that names none (the ceiling's own).
    pub fn capped_by(mut self, ceiling: &Egress) -> Egress {
        if let (Egress::Allow(p), Egress::Allow(c)) = (&mut self, ceiling) {
            p.bandwidth_bps = p.bandwidth_bps.or(c.bandwidth_bps);
            p.max_connections = p.max_connections.or(c.max_connections);
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(s: &str) -> Rule {
        Rule::parse(s).expect(s)
    }

    #[test]
    fn rules_parse_and_print_back() {
        for s in [
            "pypi.org",
            "*.pythonhosted.org",
            "github.com:443",
            "10.20.0.0/16",
            "1.2.3.4",
            "1.2.3.4:8000-9000",
        ] {
            assert_eq!(r(s).to_string(), s);
        }
        assert_eq!(r("PyPI.org.").to_string(), "pypi.org");
        assert_eq!(r("10.20.3.4/16").to_string(), "10.20.0.0/16");
        for bad in [
            "",
            "localhost",
            "a..b",
            "-a.b",
            "a.b:0",
            "a.b:9-3",
            "a.b:x",
            "::1",
            "fe80::/10",
            "1.2.3.4/33",
            "a b.c",
            "*.",
            "*.-a",
            "1.2.3",
        ] {
            assert!(Rule::parse(bad).is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn names_match_exactly_or_strictly_under_a_wildcard() {
        assert!(r("pypi.org").matches_name("pypi.org"));
        assert!(!r("pypi.org").matches_name("x.pypi.org"));
        let w = r("*.pythonhosted.org");
        assert!(w.matches_name("files.pythonhosted.org"));
        assert!(w.matches_name("a.b.pythonhosted.org"));
        assert!(!w.matches_name("pythonhosted.org"));
        assert!(!w.matches_name("evilpythonhosted.org"));
    }

    #[test]
    fn coverage() {
        assert!(r("*.example.com").covers(&r("a.example.com:443")));
        assert!(r("*.example.com").covers(&r("*.a.example.com")));
        assert!(r("*.test").covers(&r("pypi.test")));
        assert!(!r("*.example.com").covers(&r("example.com")));
        assert!(!r("a.example.com:443").covers(&r("a.example.com")));
        assert!(r("10.0.0.0/8").covers(&r("10.20.0.0/16:22")));
        assert!(!r("10.20.0.0/16").covers(&r("10.0.0.0/8")));
        assert!(!r("10.0.0.0/8").covers(&r("example.com")));
    }

    #[test]
    fn egress_json_and_ceilings() {
        let p = |s: &str| serde_json::from_str::<NetworkSpec>(s);
        assert_eq!(
            p(r#"{"egress":"none"}"#).map(|n| n.egress).ok(),
            Some(Egress::None)
        );
        assert_eq!(p(r#"{}"#).map(|n| n.egress).ok(), Some(Egress::None));
        assert_eq!(
            p(r#"{"egress":"all"}"#).map(|n| n.egress).ok(),
            Some(Egress::All)
        );
        assert!(p(r#"{"egress":"some"}"#).is_err());
        assert!(p(r#"{"egress":{"allow":["::1"]}}"#).is_err());
        assert!(p(r#"{"egress":{"allow":[],"bandwidth_bps":0}}"#).is_err());
        let l = p(r#"{"egress":{"allow":["pypi.org","10.0.0.0/8:443"],"max_connections":5}}"#)
            .expect("list");
        let back = serde_json::to_value(&l).expect("json");
        assert_eq!(back["egress"]["allow"][1], "10.0.0.0/8:443");
        let ceiling = p(r#"{"egress":{"allow":["*.org","10.0.0.0/8"],"max_connections":9}}"#)
            .expect("ceiling")
            .egress;
        assert!(l.egress.within(&ceiling).is_ok());
        assert!(l.egress.within(&Egress::All).is_ok());
        assert!(matches!(
            l.egress.within(&Egress::None),
            Err(NetworkError::Forbidden(_))
        ));
        assert!(Egress::All.within(&ceiling).is_err());
        assert!(Egress::None.within(&Egress::None).is_ok());
        let wider = p(r#"{"egress":{"allow":["github.com"]}}"#)
            .expect("x")
            .egress;
        assert_eq!(
            wider.within(&ceiling),
            Err(NetworkError::Forbidden("github.com".into()))
        );
        let uncapped = p(r#"{"egress":{"allow":["pypi.org"]}}"#).expect("x").egress;
        assert!(uncapped.within(&ceiling).is_err());
        let capped = uncapped.capped_by(&ceiling);
        assert!(capped.within(&ceiling).is_ok());
    }

    #[test]
    fn reserved_networks_are_allowed_separately() {
        let p = |s: &str| serde_json::from_str::<NetworkSpec>(s).map(|n| n.egress);
        assert!(p(r#"{"egress":{"allow":[],"reserved":["metadata.internal"]}}"#).is_err());
        let meta =
            p(r#"{"egress":{"allow":[],"reserved":["169.254.169.254:80"]}}"#).expect("reserved");
        assert_eq!(
            serde_json::to_value(&meta).expect("json")["reserved"][0],
            "169.254.169.254:80"
        );
        // `all` is the public internet, not reserved space; a ceiling grants it by name.
        assert_eq!(
            meta.within(&Egress::All),
            Err(NetworkError::Forbidden(
                "reserved 169.254.169.254:80".into()
            ))
        );
        let ceiling =
            p(r#"{"egress":{"allow":["*.org"],"reserved":["169.254.0.0/16"]}}"#).expect("ceiling");
        assert!(meta.within(&ceiling).is_ok());
        let narrow =
            p(r#"{"egress":{"allow":["*.org"],"reserved":["169.254.169.253"]}}"#).expect("ceiling");
        assert!(meta.within(&narrow).is_err());
    }
}
