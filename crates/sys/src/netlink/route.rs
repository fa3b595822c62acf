//! rtnetlink (`NETLINK_ROUTE`): veth pairs, IPv4 addresses and routes, link names and byte
//! counters, in the caller's network namespace or in a process's.
//!
//! Links are named in requests (`IFLA_IFNAME`), which the kernel resolves in the socket's own
//! namespace. Addresses and routes need a link's index: [`Route`] keeps the indexes it learnt
//! (from the echo of the links it creates or brings up, and from lookups), so that a sandbox's
//! setup is one round trip per call; an index that went stale (`ENODEV`: the link was deleted,
//! e.g. with its namespace) is looked up again and the request retried once.

use std::collections::HashMap;
use std::fmt;
use std::io;
use std::net::Ipv4Addr;

use super::{
    attr, attr_text, i32_at, invalid_input, Ack, Builder, Msg, NetlinkError, Socket, NLM_F_ACK,
    NLM_F_CREATE, NLM_F_DUMP, NLM_F_ECHO, NLM_F_EXCL, NLM_F_REQUEST,
};

const NETLINK_ROUTE: libc::c_int = 0;
const RTM_NEWLINK: u16 = 16;
const RTM_DELLINK: u16 = 17;
const RTM_GETLINK: u16 = 18;
const RTM_NEWADDR: u16 = 20;
const RTM_NEWROUTE: u16 = 24;
const IFLA_IFNAME: u16 = 3;
const IFLA_LINK: u16 = 5;
const IFLA_LINKINFO: u16 = 18;
const IFLA_NET_NS_PID: u16 = 19;
const IFLA_STATS64: u16 = 23;
const IFLA_EXT_MASK: u16 = 29;
const IFLA_INFO_KIND: u16 = 1;
const IFLA_INFO_DATA: u16 = 2;
const VETH_INFO_PEER: u16 = 1;
const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
const RTA_DST: u16 = 1;
const RTA_OIF: u16 = 4;
const RTA_GATEWAY: u16 = 5;
const RTA_TABLE: u16 = 15;
const RTEXT_FILTER_SKIP_STATS: u32 = 1 << 3;
const IFF_UP: u32 = 1;
const AF_UNSPEC: u8 = 0;
const AF_INET: u8 = 2;
const RT_TABLE_MAIN: u8 = 254;
const RTPROT_STATIC: u8 = 4;
const RT_SCOPE_UNIVERSE: u8 = 0;
const RT_SCOPE_LINK: u8 = 253;
const RTN_UNICAST: u8 = 1;
const RTNH_F_ONLINK: u32 = 4;
const IFINFOMSG_LEN: usize = 16;
/// Bytes 16..24 and 24..32 of `struct rtnl_link_stats64`.
const STATS64_RX_BYTES: usize = 16;
const STATS64_TX_BYTES: usize = 24;
/// The cache of indexes is dropped whole past this size (links that vanished with their
/// namespace are never removed from it one by one).
const CACHE_MAX: usize = 4096;

fn ifinfomsg(flags: u32, change: u32) -> [u8; IFINFOMSG_LEN] {
    let mut m = [0u8; IFINFOMSG_LEN];
    m[0] = AF_UNSPEC;
    m[8..12].copy_from_slice(&flags.to_ne_bytes());
    m[12..16].copy_from_slice(&change.to_ne_bytes());
    m
}

/// A link message's index and name (`None` if malformed or nameless).
pub(super) fn parse_link(payload: &[u8]) -> Option<(u32, String)> {
    let index = u32::try_from(i32_at(payload, 4)?).ok()?;
    let name = attr(payload.get(IFINFOMSG_LEN..)?, IFLA_IFNAME).map(attr_text)?;
    Some((index, name))
}

/// A link message's received and sent bytes (`IFLA_STATS64`).
pub(super) fn parse_stats(payload: &[u8]) -> Option<(u64, u64)> {
    let s = attr(payload.get(IFINFOMSG_LEN..)?, IFLA_STATS64)?;
    let at = |off: usize| Some(u64::from_ne_bytes(s.get(off..off + 8)?.try_into().ok()?));
    Some((at(STATS64_RX_BYTES)?, at(STATS64_TX_BYTES)?))
}

/// A link message's `IFLA_LINK`: for a veth, its peer's index (in the peer's namespace).
fn parse_iflink(payload: &[u8]) -> Option<u32> {
    let v = attr(payload.get(IFINFOMSG_LEN..)?, IFLA_LINK)?;
    Some(u32::from_ne_bytes(v.get(..4)?.try_into().ok()?)).filter(|i| *i > 0)
}

/// Remembers link `name` at `index` in `cache` (bounded: a full cache starts over).
fn cache_link(cache: &mut HashMap<String, u32>, name: String, index: u32) {
    if cache.len() >= CACHE_MAX {
        cache.clear();
    }
    cache.insert(name, index);
}

/// A looked-up link: its index, and its received and sent bytes when asked for.
type Found = (u32, Option<(u64, u64)>);

fn check_name(name: &str) -> io::Result<()> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.contains('\0') {
        return Err(invalid_input(format!("invalid link name {name:?}")));
    }
    Ok(())
}

fn check_prefix(prefix: u8) -> io::Result<()> {
    if prefix > 32 {
        return Err(invalid_input(format!(
            "invalid IPv4 prefix length {prefix}"
        )));
    }
    Ok(())
}

fn no_link(name: &str, what: String) -> io::Error {
    NetlinkError {
        errno: libc::ENODEV,
        request: what,
        message: Some(format!("no link named {name}")),
    }
    .into_io()
}

/// An rtnetlink socket in one network namespace (see the [module](self) documentation).
pub struct Route {
    sock: Socket,
    index: HashMap<String, u32>,
}

impl fmt::Debug for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Route").field("sock", &self.sock).finish()
    }
}

impl Route {
    /// A `NETLINK_ROUTE` socket in the caller's network namespace.
    pub fn open() -> io::Result<Route> {
        Ok(Route {
            sock: Socket::open(NETLINK_ROUTE)?,
            index: HashMap::new(),
        })
    }

    /// A `NETLINK_ROUTE` socket in the network namespace of process `pid`, made there by the
    /// calling thread, which goes back to its own namespace at once; the socket keeps working
    /// in that namespace from any thread.
    pub fn open_in(pid: i32) -> io::Result<Route> {
        Ok(Route {
            sock: Socket::open_in(pid, NETLINK_ROUTE)?,
            index: HashMap::new(),
        })
    }

    /// Sends the message in `b` (sequence number `seq`) and returns the kernel's answer;
    /// links echoed back are remembered.
    fn exchange(&mut self, b: &Builder, seq: u32) -> io::Result<Ack> {
        let cache = &mut self.index;
        self.sock.request(b, seq, &mut |m: &Msg<'_>| {
            if m.ty == RTM_NEWLINK {
                if let Some((index, name)) = parse_link(m.payload) {
                    cache_link(cache, name, index);
                }
            }
            Ok(())
        })
    }

    /// Creates a veth pair: `name` in this socket's namespace and its peer `peer` directly in
    /// the network namespace of process `peer_pid`. Fails with `EEXIST` if `name` exists.
    /// Answers the peer's index in its namespace (for [`Route::remember`] on a socket there),
    /// `None` if the kernel did not say. (The ends cannot be brought up as they are made: a
    /// veth opens only once it has its peer, `ENOTCONN`.)
    pub fn add_veth(&mut self, name: &str, peer: &str, peer_pid: i32) -> io::Result<Option<u32>> {
        check_name(name)?;
        check_name(peer)?;
        let pid = u32::try_from(peer_pid)
            .map_err(|_| invalid_input(format!("invalid pid {peer_pid}")))?;
        self.index.remove(name);
        let seq = self.sock.seqs(1);
        let mut b = Builder::new();
        let flags = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL | NLM_F_ECHO;
        b.begin(RTM_NEWLINK, flags, seq);
        b.bytes(&ifinfomsg(0, 0));
        b.attr_str(IFLA_IFNAME, name);
        let info = b.nest(IFLA_LINKINFO);
        b.attr_str(IFLA_INFO_KIND, "veth");
        let data = b.nest(IFLA_INFO_DATA);
        let p = b.nest(VETH_INFO_PEER);
        b.bytes(&ifinfomsg(0, 0));
        b.attr_str(IFLA_IFNAME, peer);
        b.attr_u32(IFLA_NET_NS_PID, pid);
        b.nest_end(p);
        b.nest_end(data);
        b.nest_end(info);
        b.end();
        // The echo of the new link names its peer's index (`IFLA_LINK`).
        let (cache, mut peer_index) = (&mut self.index, None);
        let ack = self.sock.request(&b, seq, &mut |m: &Msg<'_>| {
            if m.ty == RTM_NEWLINK {
                if let Some((index, n)) = parse_link(m.payload) {
                    if n == name {
                        peer_index = parse_iflink(m.payload);
                    }
                    cache_link(cache, n, index);
                }
            }
            Ok(())
        })?;
        ack.check(|| {
            format!("RTM_NEWLINK veth {name} (peer {peer} in the netns of pid {peer_pid})")
        })?;
        Ok(peer_index)
    }

    /// Remembers that link `name` has index `index` in this socket's namespace (a veth peer
    /// just made there, see [`Route::add_veth`]): calls on it need no lookup. A wrong
    /// index is found out (`ENODEV`) and looked up again.
    pub fn remember(&mut self, name: &str, index: u32) {
        cache_link(&mut self.index, name.to_string(), index);
    }

    /// Brings link `name` up.
    pub fn set_up(&mut self, name: &str) -> io::Result<()> {
        check_name(name)?;
        let seq = self.sock.seqs(1);
        let mut b = Builder::new();
        b.begin(RTM_NEWLINK, NLM_F_REQUEST | NLM_F_ACK | NLM_F_ECHO, seq);
        b.bytes(&ifinfomsg(IFF_UP, IFF_UP));
        b.attr_str(IFLA_IFNAME, name);
        b.end();
        self.exchange(&b, seq)?
            .check(|| format!("RTM_NEWLINK {name} up"))
    }

    /// Takes link `name` down (the kernel drops the routes through it).
    pub fn set_down(&mut self, name: &str) -> io::Result<()> {
        check_name(name)?;
        let seq = self.sock.seqs(1);
        let mut b = Builder::new();
        b.begin(RTM_NEWLINK, NLM_F_REQUEST | NLM_F_ACK | NLM_F_ECHO, seq);
        b.bytes(&ifinfomsg(0, IFF_UP));
        b.attr_str(IFLA_IFNAME, name);
        b.end();
        self.exchange(&b, seq)?
            .check(|| format!("RTM_NEWLINK {name} down"))
    }

    /// Adds the IPv4 address `addr/prefix` to link `name` (`EEXIST` if it has it).
    pub fn add_addr4(&mut self, name: &str, addr: Ipv4Addr, prefix: u8) -> io::Result<()> {
        check_prefix(prefix)?;
        let what = || format!("RTM_NEWADDR {addr}/{prefix} dev {name}");
        self.with_index(name, &what, &mut |this, index| {
            let seq = this.sock.seqs(1);
            let mut b = Builder::new();
            b.begin(
                RTM_NEWADDR,
                NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL,
                seq,
            );
            let mut ifa = [0u8; 8];
            ifa[0] = AF_INET;
            ifa[1] = prefix;
            ifa[4..8].copy_from_slice(&index.to_ne_bytes());
            b.bytes(&ifa);
            b.attr(IFA_LOCAL, &addr.octets());
            b.attr(IFA_ADDRESS, &addr.octets());
            b.end();
            this.exchange(&b, seq)
        })
    }

    /// Adds the IPv4 route `dst/prefix` (main table, protocol static) out of link `dev`,
    /// through gateway `via` (scope universe) or directly (scope link). `onlink` marks the
    /// gateway as reachable on `dev` whatever its addresses (`RTNH_F_ONLINK`), e.g. a default
    /// route via an address on no subnet of `dev`. `dev` must be up.
    pub fn add_route4(
        &mut self,
        dst: Ipv4Addr,
        prefix: u8,
        via: Option<Ipv4Addr>,
        dev: &str,
        onlink: bool,
    ) -> io::Result<()> {
        check_prefix(prefix)?;
        let what = || {
            let via = via.map(|g| format!(" via {g}")).unwrap_or_default();
            let on = if onlink { " onlink" } else { "" };
            format!("RTM_NEWROUTE {dst}/{prefix}{via} dev {dev}{on}")
        };
        self.with_index(dev, &what, &mut |this, index| {
            let seq = this.sock.seqs(1);
            let mut b = Builder::new();
            b.begin(
                RTM_NEWROUTE,
                NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL,
                seq,
            );
            let scope = if via.is_some() {
                RT_SCOPE_UNIVERSE
            } else {
                RT_SCOPE_LINK
            };
            let flags = if onlink { RTNH_F_ONLINK } else { 0 };
            let mut rtm = [
                AF_INET,
                prefix,
                0,
                0,
                RT_TABLE_MAIN,
                RTPROT_STATIC,
                scope,
                RTN_UNICAST,
                0,
                0,
                0,
                0,
            ];
            rtm[8..12].copy_from_slice(&flags.to_ne_bytes());
            b.bytes(&rtm);
            b.attr_u32(RTA_TABLE, u32::from(RT_TABLE_MAIN));
            if prefix > 0 {
                b.attr(RTA_DST, &dst.octets());
            }
            if let Some(g) = via {
                b.attr(RTA_GATEWAY, &g.octets());
            }
            b.attr_u32(RTA_OIF, index);
            b.end();
            this.exchange(&b, seq)
        })
    }

    /// Runs `f` with the index of link `name` (remembered, or looked up); when a remembered
    /// index is stale (`ENODEV`), looks it up again and runs `f` once more.
    fn with_index(
        &mut self,
        name: &str,
        what: &dyn Fn() -> String,
        f: &mut dyn FnMut(&mut Self, u32) -> io::Result<Ack>,
    ) -> io::Result<()> {
        check_name(name)?;
        if let Some(index) = self.index.get(name).copied() {
            let ack = f(self, index)?;
            if ack.errno != libc::ENODEV {
                return ack.check(what);
            }
            self.index.remove(name);
        }
        let Some(index) = self.lookup(name, RTEXT_FILTER_SKIP_STATS)?.map(|(i, _)| i) else {
            return Err(no_link(name, what()));
        };
        f(self, index)?.check(what)
    }

    /// `RTM_GETLINK` of link `name`: its index and counters (`None` without the link).
    fn lookup(&mut self, name: &str, ext_mask: u32) -> io::Result<Option<Found>> {
        check_name(name)?;
        let seq = self.sock.seqs(1);
        let mut b = Builder::new();
        b.begin(RTM_GETLINK, NLM_F_REQUEST | NLM_F_ACK, seq);
        b.bytes(&ifinfomsg(0, 0));
        b.attr_str(IFLA_IFNAME, name);
        b.attr_u32(IFLA_EXT_MASK, ext_mask);
        b.end();
        let mut found = None;
        let ack = self.sock.request(&b, seq, &mut |m: &Msg<'_>| {
            if m.ty == RTM_NEWLINK {
                if let Some((index, n)) = parse_link(m.payload) {
                    if n == name {
                        found = Some((index, parse_stats(m.payload)));
                    }
                }
            }
            Ok(())
        })?;
        if ack.errno == libc::ENODEV {
            self.index.remove(name);
            return Ok(None);
        }
        ack.check(|| format!("RTM_GETLINK {name}"))?;
        if let Some((index, _)) = found {
            self.remember(name, index);
        }
        Ok(found)
    }

    /// Deletes link `name` (a veth: both ends). `Ok(false)` if there is no such link.
    pub fn del_link(&mut self, name: &str) -> io::Result<bool> {
        check_name(name)?;
        self.index.remove(name);
        let seq = self.sock.seqs(1);
        let mut b = Builder::new();
        b.begin(RTM_DELLINK, NLM_F_REQUEST | NLM_F_ACK, seq);
        b.bytes(&ifinfomsg(0, 0));
        b.attr_str(IFLA_IFNAME, name);
        b.end();
        let ack = self.sock.request(&b, seq, &mut |_| Ok(()))?;
        if ack.errno == libc::ENODEV {
            return Ok(false);
        }
        ack.check(|| format!("RTM_DELLINK {name}"))?;
        Ok(true)
    }

    /// The names of all links of this socket's namespace.
    pub fn links(&mut self) -> io::Result<Vec<String>> {
        let mut names = Vec::new();
        self.dump_links(RTEXT_FILTER_SKIP_STATS, &mut |payload| {
            if let Some((_, name)) = parse_link(payload) {
                names.push(name);
            }
        })?;
        Ok(names)
    }

    /// The bytes every link whose name starts with `prefix` received and sent
    /// (`IFLA_STATS64`), by name: one dump, however many links.
    pub fn links_stats(&mut self, prefix: &str) -> io::Result<HashMap<String, (u64, u64)>> {
        let mut out = HashMap::new();
        self.dump_links(0, &mut |payload| {
            if let (Some((_, name)), Some(stats)) = (parse_link(payload), parse_stats(payload)) {
                if name.starts_with(prefix) {
                    out.insert(name, stats);
                }
            }
        })?;
        Ok(out)
    }

    /// Dumps every link of this socket's namespace (`RTM_GETLINK`, `IFLA_EXT_MASK` `mask`) to
    /// `f`, one link message's payload at a time.
    fn dump_links(&mut self, mask: u32, f: &mut dyn FnMut(&[u8])) -> io::Result<()> {
        let seq = self.sock.seqs(1);
        let mut b = Builder::new();
        b.begin(RTM_GETLINK, NLM_F_REQUEST | NLM_F_ACK | NLM_F_DUMP, seq);
        b.bytes(&ifinfomsg(0, 0));
        b.attr_u32(IFLA_EXT_MASK, mask);
        b.end();
        let ack = self.sock.request(&b, seq, &mut |m: &Msg<'_>| {
            if m.ty == RTM_NEWLINK {
                f(m.payload);
            }
            Ok(())
        })?;
        ack.check(|| "RTM_GETLINK dump".into())
    }

    /// The index of link `name` in this socket's namespace (`None` without the link); always
    /// asked of the kernel.
    pub fn index(&mut self, name: &str) -> io::Result<Option<u32>> {
        Ok(self.lookup(name, RTEXT_FILTER_SKIP_STATS)?.map(|(i, _)| i))
    }

    /// The bytes link `name` received and sent (`IFLA_STATS64`); `None` without the link.
    pub fn link_stats(&mut self, name: &str) -> io::Result<Option<(u64, u64)>> {
        match self.lookup(name, 0)? {
            None => Ok(None),
            Some((_, Some(stats))) => Ok(Some(stats)),
            Some((_, None)) => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("netlink RTM_GETLINK {name}: no IFLA_STATS64 in the reply"),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_messages_parse() {
        let mut b = Builder::new();
        let mut m = ifinfomsg(IFF_UP, 0);
        m[4..8].copy_from_slice(&7i32.to_ne_bytes());
        b.bytes(&m);
        b.attr_str(IFLA_IFNAME, "veth7");
        let mut stats = [0u8; 200];
        stats[16..24].copy_from_slice(&11u64.to_ne_bytes());
        stats[24..32].copy_from_slice(&22u64.to_ne_bytes());
        b.attr(IFLA_STATS64, &stats);
        assert_eq!(parse_link(b.as_bytes()), Some((7, "veth7".into())));
        assert_eq!(parse_stats(b.as_bytes()), Some((11, 22)));
        assert_eq!(parse_link(&b.as_bytes()[..10]), None);
        assert_eq!(parse_stats(&b.as_bytes()[..40]), None);
    }

    #[test]
    fn bad_arguments_are_refused_before_asking() {
        let mut r = Route::open().expect("open");
        let long = "x".repeat(16);
        for name in ["", long.as_str(), "a\0b"] {
            let e = r.set_up(name).expect_err("bad name");
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{name:?}");
        }
        let e = r
            .add_addr4("lo", Ipv4Addr::LOCALHOST, 33)
            .expect_err("bad prefix");
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn loopback_is_seen() {
        let mut r = Route::open().expect("open");
        assert!(r.links().expect("links").iter().any(|l| l == "lo"));
        assert_eq!(r.index("lo").expect("index"), Some(1));
        assert!(r.link_stats("lo").expect("stats").is_some());
        assert_eq!(r.index("dsec-none0").expect("index"), None);
        assert_eq!(r.link_stats("dsec-none0").expect("stats"), None);
        assert!(!r.del_link("dsec-none0").expect("del"));
        let e = r
            .add_addr4("dsec-none0", Ipv4Addr::new(10, 9, 9, 9), 32)
            .expect_err("no link");
        assert_eq!(super::super::errno(&e), Some(libc::ENODEV));
    }
}
