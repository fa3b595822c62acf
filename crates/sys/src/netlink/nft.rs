//! nfnetlink (`NETLINK_NETFILTER`): elements of nftables sets of `inet` tables, added and
//! removed in batches.
//!
//! A batch is `NFNL_MSG_BATCH_BEGIN`, one or more `NFT_MSG_NEWSETELEM`/`DELSETELEM` messages
//! (each at most [`MSG_MAX`] bytes, each asking for an acknowledgement) and
//! `NFNL_MSG_BATCH_END`; the kernel applies a batch whole or not at all. A list too long for
//! one batch ([`BATCH_MAX`] bytes) is sent as several, each applied on its own.
//!
//! Keys are raw bytes in the set's layout: a concatenation (`ipv4_addr . inet_service`) is its
//! fields each padded to 4 bytes ([`concat()`]), addresses and ports in network byte order
//! ([`ipv4`], [`port`]). A range of an interval set of concatenations has its last key in
//! `key_end`.

use std::fmt;
use std::io;
use std::net::Ipv4Addr;

use super::{
    attr, attrs, invalid_input, Ack, Builder, Msg, Socket, Wait, Window, NLA_F_NESTED, NLM_F_ACK,
    NLM_F_CREATE, NLM_F_DUMP, NLM_F_REQUEST,
};

const NETLINK_NETFILTER: libc::c_int = 12;
const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFNL_MSG_BATCH_BEGIN: u16 = 16;
const NFNL_MSG_BATCH_END: u16 = 17;
const NFT_MSG_NEWSETELEM: u16 = 12;
const NFT_MSG_GETSETELEM: u16 = 13;
const NFT_MSG_DELSETELEM: u16 = 14;
const NFT_MSG_DESTROYSETELEM: u16 = 30;
const NFPROTO_UNSPEC: u8 = 0;
const NFPROTO_INET: u8 = 1;
const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
const NFTA_SET_ELEM_LIST_SET: u16 = 2;
const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_SET_ELEM_KEY: u16 = 1;
const NFTA_SET_ELEM_FLAGS: u16 = 3;
const NFTA_SET_ELEM_TIMEOUT: u16 = 4;
const NFTA_SET_ELEM_EXPIRATION: u16 = 5;
const NFTA_SET_ELEM_KEY_END: u16 = 10;
const NFTA_DATA_VALUE: u16 = 1;
const NFT_SET_ELEM_INTERVAL_END: u32 = 1;
/// The longest key the kernel takes (`NFT_DATA_VALUE_MAXLEN`).
const KEY_MAX: usize = 64;
/// The largest message of a batch.
pub const MSG_MAX: usize = 32 * 1024;
/// The largest batch (the default socket send buffer is ~208 KiB).
pub const BATCH_MAX: usize = 128 * 1024;

/// One element of a set.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Element {
    /// The key, in the set's layout (see [`concat()`]); for a range, its first key.
    pub key: Vec<u8>,
    /// A range's last key (interval sets of concatenations).
    pub key_end: Option<Vec<u8>>,
    /// The element's timeout in milliseconds (sets with `flags timeout`). Re-adding an
    /// element with a timeout restarts it. As listed: the time left before it expires.
    pub timeout_ms: Option<u64>,
}

/// A concatenated key: each field padded with zeros to a multiple of 4 bytes (the layout of
/// nftables concatenations, one register per 4 bytes).
pub fn concat(fields: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::with_capacity(fields.iter().map(|f| super::align4(f.len())).sum());
    for f in fields {
        out.extend_from_slice(f);
        out.resize(super::align4(out.len()), 0);
    }
    out
}

/// An IPv4 address as a key field (network byte order).
pub fn ipv4(a: Ipv4Addr) -> [u8; 4] {
    a.octets()
}

/// A port as a key field (network byte order).
pub fn port(p: u16) -> [u8; 2] {
    p.to_be_bytes()
}

/// The `nfgenmsg` header.
fn nfgenmsg(family: u8, res_id: u16) -> [u8; 4] {
    let r = res_id.to_be_bytes();
    [family, 0, r[0], r[1]]
}

/// The bytes element `e` takes in a message.
fn elem_size(e: &Element, with_timeout: bool) -> usize {
    let key = |k: &[u8]| 8 + super::align4(k.len());
    let timeout = if with_timeout && e.timeout_ms.is_some() {
        12
    } else {
        0
    };
    4 + key(&e.key) + e.key_end.as_deref().map_or(0, key) + timeout
}

fn encode_elem(b: &mut Builder, e: &Element, with_timeout: bool) {
    let le = b.nest(NFTA_LIST_ELEM | NLA_F_NESTED);
    let k = b.nest(NFTA_SET_ELEM_KEY | NLA_F_NESTED);
    b.attr(NFTA_DATA_VALUE, &e.key);
    b.nest_end(k);
    if let Some(end) = &e.key_end {
        let k = b.nest(NFTA_SET_ELEM_KEY_END | NLA_F_NESTED);
        b.attr(NFTA_DATA_VALUE, end);
        b.nest_end(k);
    }
    if let (true, Some(t)) = (with_timeout, e.timeout_ms) {
        b.attr(NFTA_SET_ELEM_TIMEOUT, &t.to_be_bytes());
    }
    b.nest_end(le);
}

/// Checks the table's and every set's names and elements.
fn check_sets(table: &str, sets: &[(&str, &[Element])]) -> io::Result<()> {
    for (set, elems) in sets {
        check_names(table, set)?;
        check_elements(elems)?;
    }
    Ok(())
}

/// The sets' names, for an error message (not their elements, which may be thousands).
fn set_names(sets: &[(&str, &[Element])]) -> String {
    sets.iter().map(|(s, _)| *s).collect::<Vec<_>>().join(",")
}

fn check_elements(elems: &[Element]) -> io::Result<()> {
    for e in elems {
        let bad = |k: &[u8]| k.is_empty() || k.len() > KEY_MAX;
        if bad(&e.key) || e.key_end.as_deref().is_some_and(bad) {
            return Err(invalid_input(format!(
                "invalid set element key: 1 to {KEY_MAX} bytes, got {e:?}"
            )));
        }
    }
    Ok(())
}

fn check_names(table: &str, set: &str) -> io::Result<()> {
    for n in [table, set] {
        if n.is_empty() || n.len() > 255 || n.contains('\0') {
            return Err(invalid_input(format!("invalid nftables name {n:?}")));
        }
    }
    Ok(())
}

fn be_u64(d: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(d.try_into().ok()?))
}

/// One listed element (`None` for an interval end of a non-concatenated set, or if malformed).
fn parse_elem(buf: &[u8]) -> Option<Element> {
    let (mut key, mut key_end, mut timeout, mut expires, mut flags) = (None, None, None, None, 0);
    for (ty, d) in attrs(buf) {
        match ty {
            NFTA_SET_ELEM_KEY => key = attr(d, NFTA_DATA_VALUE).map(<[u8]>::to_vec),
            NFTA_SET_ELEM_KEY_END => key_end = attr(d, NFTA_DATA_VALUE).map(<[u8]>::to_vec),
            NFTA_SET_ELEM_TIMEOUT => timeout = be_u64(d),
            NFTA_SET_ELEM_EXPIRATION => expires = be_u64(d),
            NFTA_SET_ELEM_FLAGS => {
                flags = d.try_into().map(u32::from_be_bytes).unwrap_or(0);
            }
            _ => {}
        }
    }
    if flags & NFT_SET_ELEM_INTERVAL_END != 0 {
        return None;
    }
    Some(Element {
        key: key?,
        key_end,
        timeout_ms: expires.or(timeout),
    })
}

/// The elements of an `NFT_MSG_NEWSETELEM` message (as dumped), appended to `out`.
pub(super) fn parse_elements(payload: &[u8], out: &mut Vec<Element>) {
    let Some(list) = payload
        .get(4..)
        .and_then(|a| attr(a, NFTA_SET_ELEM_LIST_ELEMENTS))
    else {
        return;
    };
    for (ty, e) in attrs(list) {
        if ty == NFTA_LIST_ELEM {
            out.extend(parse_elem(e));
        }
    }
}

/// An nfnetlink socket for the sets of `inet` tables.
pub struct Nft {
    sock: Socket,
}

impl fmt::Debug for Nft {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Nft").field("sock", &self.sock).finish()
    }
}

impl Nft {
    /// A `NETLINK_NETFILTER` socket in the caller's network namespace.
    pub fn open() -> io::Result<Nft> {
        Ok(Nft {
            sock: Socket::open(NETLINK_NETFILTER)?,
        })
    }

    /// Adds `elems` to set `set` of table `inet table`. An element already there is no
    /// error (its timeout, if given, restarts); one that clashes with another (an overlapping
    /// range) fails its whole batch with `EEXIST`.
    pub fn add_elements(&mut self, table: &str, set: &str, elems: &[Element]) -> io::Result<()> {
        self.add_to_sets(table, &[(set, elems)])
    }

    /// [`Nft::add_elements`] to several sets of table `inet table` in one transaction (as
    /// few batches as they fit in): all of them or, on a refusal, none of that batch.
    pub fn add_to_sets(&mut self, table: &str, sets: &[(&str, &[Element])]) -> io::Result<()> {
        check_sets(table, sets)?;
        match self.batches(NFT_MSG_NEWSETELEM, table, sets)? {
            None => Ok(()),
            Some(ack) => {
                ack.check(|| format!("NFT_MSG_NEWSETELEM inet {table} {}", set_names(sets)))
            }
        }
    }

    /// Removes those of `elems` that are in set `set` of table `inet table`; the others are no
    /// error.
    pub fn del_elements(&mut self, table: &str, set: &str, elems: &[Element]) -> io::Result<()> {
        self.del_from_sets(table, &[(set, elems)])
    }

    /// [`Nft::del_elements`] from several sets of table `inet table` in one transaction.
    pub fn del_from_sets(&mut self, table: &str, sets: &[(&str, &[Element])]) -> io::Result<()> {
        check_sets(table, sets)?;
        // DESTROYSETELEM (Linux 6.3) ignores missing elements; older kernels refuse the type.
        match self.batches(NFT_MSG_DESTROYSETELEM, table, sets)? {
            None => Ok(()),
            Some(a) if a.errno == libc::EINVAL || a.errno == libc::EOPNOTSUPP => {
                for (set, elems) in sets {
                    self.del_each(table, set, elems)?;
                }
                Ok(())
            }
            Some(a) => {
                a.check(|| format!("NFT_MSG_DESTROYSETELEM inet {table} {}", set_names(sets)))
            }
        }
    }

    /// Removal with DELSETELEM: one missing element fails the whole batch with `ENOENT`, and
    /// then the elements are removed one by one, `ENOENT` ignored.
    fn del_each(&mut self, table: &str, set: &str, elems: &[Element]) -> io::Result<()> {
        let what = || format!("NFT_MSG_DELSETELEM inet {table} {set}");
        match self.batches(NFT_MSG_DELSETELEM, table, &[(set, elems)])? {
            None => return Ok(()),
            Some(a) if a.errno == libc::ENOENT => {}
            Some(a) => return a.check(what),
        }
        for e in elems {
            match self.batches(NFT_MSG_DELSETELEM, table, &[(set, std::slice::from_ref(e))])? {
                Some(a) if a.errno != libc::ENOENT => return a.check(what),
                _ => {}
            }
        }
        Ok(())
    }

    /// Sends the elements of `sets` in as many batches as needed, each waited for; returns the
    /// first refusal (its batch was not applied, nor were the following ones sent).
    fn batches(
        &mut self,
        op: u16,
        table: &str,
        sets: &[(&str, &[Element])],
    ) -> io::Result<Option<Ack>> {
        let add = op == NFT_MSG_NEWSETELEM;
        let flags = NLM_F_REQUEST | NLM_F_ACK | if add { NLM_F_CREATE } else { 0 };
        let ty = (NFNL_SUBSYS_NFTABLES << 8) | op;
        let mut sets = sets.iter().filter(|(_, e)| !e.is_empty());
        let (mut set, mut rest): (&str, &[Element]) = match sets.next() {
            Some((s, e)) => (s, e),
            None => return Ok(None),
        };
        while !rest.is_empty() {
            let mut b = Builder::new();
            let first = self.sock.seqs(1);
            b.begin(NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, first);
            b.bytes(&nfgenmsg(NFPROTO_UNSPEC, NFNL_SUBSYS_NFTABLES));
            b.end();
            let mut msgs = 0u32;
            while !rest.is_empty() && b.len() + MSG_MAX <= BATCH_MAX {
                let seq = self.sock.seqs(1);
                b.begin(ty, flags, seq);
                b.bytes(&nfgenmsg(NFPROTO_INET, 0));
                b.attr_str(NFTA_SET_ELEM_LIST_TABLE, table);
                b.attr_str(NFTA_SET_ELEM_LIST_SET, set);
                let list = b.nest(NFTA_SET_ELEM_LIST_ELEMENTS | NLA_F_NESTED);
                let mut n = 0;
                for e in rest {
                    if n > 0 && b.msg_len() + elem_size(e, add) > MSG_MAX {
                        break;
                    }
                    encode_elem(&mut b, e, add);
                    n += 1;
                }
                b.nest_end(list);
                b.end();
                rest = rest.get(n..).unwrap_or(&[]);
                msgs += 1;
                if rest.is_empty() {
                    if let Some((s, e)) = sets.next() {
                        (set, rest) = (s, e);
                    }
                }
            }
            let last = self.sock.seqs(1);
            b.begin(NFNL_MSG_BATCH_END, NLM_F_REQUEST, last);
            b.bytes(&nfgenmsg(NFPROTO_UNSPEC, NFNL_SUBSYS_NFTABLES));
            b.end();
            self.sock.send(b.as_bytes())?;
            let wait = Wait {
                all: Window {
                    first,
                    count: msgs + 2,
                },
                acked: Window {
                    first: first.wrapping_add(1),
                    count: msgs,
                },
                expect: msgs as usize,
            };
            let acks = self.sock.wait(wait, &mut |_| Ok(()))?;
            if let Some(a) = acks.into_iter().find(|a| a.errno != 0) {
                return Ok(Some(a));
            }
        }
        Ok(None)
    }

    /// The elements of set `set` of table `inet table` (`NFT_MSG_GETSETELEM` dump). The
    /// interval ends of non-concatenated interval sets are left out.
    pub fn list_elements(&mut self, table: &str, set: &str) -> io::Result<Vec<Element>> {
        check_names(table, set)?;
        let seq = self.sock.seqs(1);
        let mut b = Builder::new();
        b.begin(
            (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETSETELEM,
            NLM_F_REQUEST | NLM_F_ACK | NLM_F_DUMP,
            seq,
        );
        b.bytes(&nfgenmsg(NFPROTO_INET, 0));
        b.attr_str(NFTA_SET_ELEM_LIST_TABLE, table);
        b.attr_str(NFTA_SET_ELEM_LIST_SET, set);
        b.end();
        let mut out = Vec::new();
        let want = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWSETELEM;
        let ack = self.sock.request(&b, seq, &mut |m: &Msg<'_>| {
            if m.ty == want {
                parse_elements(m.payload, &mut out);
            }
            Ok(())
        })?;
        ack.check(|| format!("NFT_MSG_GETSETELEM inet {table} {set}"))?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_laid_out_like_nft() {
        let a = ipv4(Ipv4Addr::new(10, 1, 0, 5));
        let b = ipv4(Ipv4Addr::new(1, 2, 3, 4));
        let key = concat(&[&a, &b, &port(443)]);
        assert_eq!(key, [10, 1, 0, 5, 1, 2, 3, 4, 0x01, 0xbb, 0, 0]);
        assert_eq!(
            concat(&[b"eth0\0", &a]),
            [b'e', b't', b'h', b'0', 0, 0, 0, 0, 10, 1, 0, 5]
        );
    }

    #[test]
    fn encoded_elements_parse_back() {
        let e = Element {
            key: vec![1, 2, 3, 4, 5],
            key_end: Some(vec![9; 8]),
            timeout_ms: Some(60_000),
        };
        let mut b = Builder::new();
        b.bytes(&nfgenmsg(NFPROTO_INET, 0));
        let list = b.nest(NFTA_SET_ELEM_LIST_ELEMENTS | NLA_F_NESTED);
        encode_elem(&mut b, &e, true);
        let before = b.len();
        encode_elem(&mut b, &e, false);
        assert_eq!(b.len() - before, elem_size(&e, false));
        b.nest_end(list);
        let mut out = vec![];
        parse_elements(b.as_bytes(), &mut out);
        assert_eq!(out.len(), 2);
        assert_eq!(out[0], e);
        assert_eq!(out[1].timeout_ms, None);
        assert_eq!(elem_size(&e, true), elem_size(&e, false) + 12);
    }

    #[test]
    fn bad_keys_are_refused_before_asking() {
        let mut n = Nft::open().expect("open");
        for key in [vec![], vec![0; 65]] {
            let e = Element {
                key,
                key_end: None,
                timeout_ms: None,
            };
            let err = n.add_elements("t", "s", &[e]).expect_err("bad key");
            assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        }
        assert!(n.add_elements("t", "s", &[]).is_ok());
    }
    /// The path for kernels without DESTROYSETELEM: DELSETELEM, element by element when one
    /// is missing.
    #[test]
    fn delsetelem_fallback_skips_missing() {
        let table = format!("dsec_nltest_fb_{}", std::process::id());
        let script = format!("table inet {table} {{\n set s {{ type ipv4_addr; }}\n}}\n");
        let nft = |args: &[&str], stdin: Option<&str>| {
            use std::io::Write;
            let mut c = std::process::Command::new("nft")
                .args(args)
                .stdin(std::process::Stdio::piped())
                .spawn()
                .expect("nft");
            let mut input = c.stdin.take().expect("stdin");
            input
                .write_all(stdin.unwrap_or("").as_bytes())
                .expect("write");
            drop(input);
            c.wait().expect("wait").success()
        };
        struct Cleanup<F: FnMut()>(F);
        impl<F: FnMut()> Drop for Cleanup<F> {
            fn drop(&mut self) {
                (self.0)();
            }
        }
        let _ = nft(&["delete", "table", "inet", &table], None);
        assert!(nft(&["-f", "-"], Some(&script)));
        let _guard = Cleanup(|| {
            let _ = nft(&["delete", "table", "inet", &table], None);
        });
        let e = |last: u8| Element {
            key: vec![10, 9, 0, last],
            key_end: None,
            timeout_ms: None,
        };
        let mut n = Nft::open().expect("open");
        n.add_elements(&table, "s", &[e(1), e(2)]).expect("add");
        let missing = n
            .batches(NFT_MSG_DELSETELEM, &table, &[("s", &[e(1), e(3)])])
            .expect("batch");
        assert_eq!(missing.map(|a| a.errno), Some(libc::ENOENT));
        assert_eq!(
            n.list_elements(&table, "s").expect("list").len(),
            2,
            "applied whole or not at all"
        );
        n.del_each(&table, "s", &[e(1), e(3)]).expect("del");
        assert_eq!(n.list_elements(&table, "s").expect("list"), vec![e(2)]);
    }
}
