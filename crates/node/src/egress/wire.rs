//! DNS messages (RFC 1035), parsed defensively.
//!
//! Queries come from sandboxes (hostile): they must be plain, small, uncompressed and made of
//! ordinary name bytes. Answers come from the upstream resolver: compression is followed (only
//! backwards, a bounded number of jumps), every read is bounds-checked, nothing loops or
//! allocates beyond a small multiple of the message size, and only the addresses that belong to
//! the question's name (directly or through its CNAME chain) are reported.

use std::net::{Ipv4Addr, Ipv6Addr};

/// The largest message accepted (larger ones are refused): UDP answers over 512 bytes need EDNS,
/// queries are small.
pub const MAX_MESSAGE: usize = 4096;

/// The header's size.
const HEADER: usize = 12;
/// A name's largest size on the wire, its final zero byte included (RFC 1035 2.3.4).
const MAX_NAME_WIRE: usize = 255;
/// The most compression pointers followed while reading one name.
const MAX_JUMPS: usize = 128;
/// The longest CNAME chain followed from the question's name.
const MAX_CHAIN: usize = 32;

/// A query as a sandbox sent it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Query {
    /// The message id.
    pub id: u16,
    /// The name asked about: lower-case ASCII, no trailing dot, "" for the root.
    pub name: String,
    /// The question's type (see [`qtype`]).
    pub qtype: u16,
    /// The question's class (see [`qclass`]).
    pub qclass: u16,
    /// Recursion desired.
    pub rd: bool,
}

/// Question and record types.
pub mod qtype {
    /// An IPv4 address.
    pub const A: u16 = 1;
    /// A name server.
    pub const NS: u16 = 2;
    /// An alias.
    pub const CNAME: u16 = 5;
    /// Text.
    pub const TXT: u16 = 16;
    /// An IPv6 address.
    pub const AAAA: u16 = 28;
    /// The EDNS pseudo-record (RFC 6891).
    pub const OPT: u16 = 41;
    /// HTTPS service binding (RFC 9460).
    pub const HTTPS: u16 = 65;
    /// Any type.
    pub const ANY: u16 = 255;
}

/// Question and record classes.
pub mod qclass {
    /// The Internet.
    pub const IN: u16 = 1;
}

/// Response codes.
pub mod rcode {
    /// No error.
    pub const NOERROR: u8 = 0;
    /// The server failed.
    pub const SERVFAIL: u8 = 2;
    /// The name does not exist.
    pub const NXDOMAIN: u8 = 3;
    /// The server refuses to answer.
    pub const REFUSED: u8 = 5;
}

/// Why a message was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WireError {
    /// Shorter than a header.
    #[error("message shorter than a DNS header")]
    TooShort,
    /// Longer than [`MAX_MESSAGE`].
    #[error("message longer than {MAX_MESSAGE} bytes")]
    TooLong,
    /// A response, or an opcode other than QUERY, where a query was expected.
    #[error("not a standard query")]
    NotAQuery,
    /// A query, or an opcode other than QUERY, where a response was expected.
    #[error("not a response to a standard query")]
    NotAResponse,
    /// Not exactly one question.
    #[error("{0} questions (exactly 1 expected)")]
    QuestionCount(u16),
    /// A query with answer or authority records, or more than one additional record.
    #[error("records in a query")]
    UnexpectedRecords,
    /// A query's additional record is not an EDNS OPT record.
    #[error("a query's additional record is not EDNS OPT")]
    NotOpt,
    /// A name refused (why).
    #[error("bad name: {0}")]
    BadName(&'static str),
    /// A compression pointer that does not point strictly backwards, or too many of them.
    #[error("compression pointer loop")]
    PointerLoop,
    /// The message ends before its counted content.
    #[error("message truncated")]
    Truncated,
    /// Bytes after a query's content.
    #[error("bytes after the query")]
    TrailingData,
    /// A response whose id is not the query's.
    #[error("response id does not match the query")]
    IdMismatch,
    /// A response whose question is not the query's.
    #[error("response question does not match the query")]
    QuestionMismatch,
    /// A malformed record (why).
    #[error("bad record: {0}")]
    BadRecord(&'static str),
}

/// What an upstream answered.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Answer {
    /// The response code (the header's 4 bits).
    pub rcode: u8,
    /// IPv4 addresses of the question's name (or its CNAME chain), with their TTLs.
    pub a: Vec<(Ipv4Addr, u32)>,
    /// IPv6 addresses of the question's name (or its CNAME chain), with their TTLs.
    pub aaaa: Vec<(Ipv6Addr, u32)>,
    /// The CNAME chain from the question's name, in order (lower-case, no trailing dot).
    pub cnames: Vec<String>,
    /// The TC bit: the answer did not fit (the client should retry over TCP).
    pub truncated: bool,
}

fn u16_at(msg: &[u8], at: usize) -> Result<u16, WireError> {
    match msg.get(at..at.saturating_add(2)) {
        Some(&[hi, lo]) => Ok(u16::from_be_bytes([hi, lo])),
        _ => Err(WireError::Truncated),
    }
}

fn u32_at(msg: &[u8], at: usize) -> Result<u32, WireError> {
    match msg.get(at..at.saturating_add(4)) {
        Some(&[a, b, c, d]) => Ok(u32::from_be_bytes([a, b, c, d])),
        _ => Err(WireError::Truncated),
    }
}

/// Refuses a label with bytes other than letters, digits, '-' and '_'.
fn check_label(label: &[u8]) -> Result<(), WireError> {
    match label
        .iter()
        .all(|&b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        true => Ok(()),
        false => Err(WireError::BadName(
            "byte other than a letter, digit, '-', '_'",
        )),
    }
}

/// Reads the name at `start`. Returns it in lower-cased wire form (length-prefixed labels,
/// without the final zero byte) and the offset just after the name where it is written.
/// `query` refuses compression pointers and bytes other than letters, digits, '-' and '_'.
/// Otherwise pointers are followed only strictly backwards of the segment being read (so reading
/// always ends), at most [`MAX_JUMPS`] times. Answers' other sections are read this way too.
fn read_name(msg: &[u8], start: usize, query: bool) -> Result<(Vec<u8>, usize), WireError> {
    let mut out = Vec::new();
    let mut pos = start;
    let mut segment = start;
    let mut after = None;
    let mut jumps = 0;
    loop {
        let len = *msg.get(pos).ok_or(WireError::Truncated)?;
        match len & 0xC0 {
            0x00 if len == 0 => return Ok((out, after.unwrap_or(pos + 1))),
            0x00 => {
                let l = usize::from(len);
                let label = msg.get(pos + 1..pos + 1 + l).ok_or(WireError::Truncated)?;
                if out.len() + 1 + l + 1 > MAX_NAME_WIRE {
                    return Err(WireError::BadName("longer than 253 characters"));
                }
                if query {
                    check_label(label)?;
                }
                out.push(len);
                out.extend(label.iter().map(u8::to_ascii_lowercase));
                pos += 1 + l;
            }
            0xC0 => {
                if query {
                    return Err(WireError::BadName("compression pointer in a query"));
                }
                let lo = *msg.get(pos + 1).ok_or(WireError::Truncated)?;
                let target = (usize::from(len & 0x3F) << 8) | usize::from(lo);
                jumps += 1;
                if target >= segment || jumps > MAX_JUMPS {
                    return Err(WireError::PointerLoop);
                }
                after.get_or_insert(pos + 2);
                pos = target;
                segment = target;
            }
            _ => return Err(WireError::BadName("label longer than 63 bytes")),
        }
    }
}

/// The presentation form of a wire name from [`read_name`] (checked like a query's name).
fn presentation(wire: &[u8]) -> Result<String, WireError> {
    let mut out = String::with_capacity(wire.len());
    let mut rest = wire;
    while let Some((&len, tail)) = rest.split_first() {
        let label = tail.get(..usize::from(len)).ok_or(WireError::Truncated)?;
        check_label(label)?;
        if !out.is_empty() {
            out.push('.');
        }
        out.extend(label.iter().map(|&b| char::from(b)));
        rest = &tail[label.len()..];
    }
    Ok(out)
}

/// The lower-cased wire form of a presentation name (no final zero byte): empty labels are
/// skipped, labels longer than 63 bytes are cut at 63 bytes.
fn wire_name(name: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(name.len() + 1);
    for label in name.split('.').filter(|l| !l.is_empty()) {
        let label = &label.as_bytes()[..label.len().min(63)];
        out.push(label.len() as u8);
        out.extend(label.iter().map(u8::to_ascii_lowercase));
    }
    out
}

/// Checks the header's size; returns its flags.
fn header(msg: &[u8]) -> Result<u16, WireError> {
    if msg.len() > MAX_MESSAGE {
        return Err(WireError::TooLong);
    }
    if msg.len() < HEADER {
        return Err(WireError::TooShort);
    }
    u16_at(msg, 2)
}

/// Parses a sandbox's query: one question, an uncompressed name of ordinary bytes, no records
/// but an optional EDNS OPT record (ignored), nothing after. The type and class are not
/// restricted (the caller's policy decides).
pub fn parse_query(msg: &[u8]) -> Result<Query, WireError> {
    let flags = header(msg)?;
    if flags & 0x8000 != 0 || flags & 0x7800 != 0 {
        return Err(WireError::NotAQuery);
    }
    let qdcount = u16_at(msg, 4)?;
    if qdcount != 1 {
        return Err(WireError::QuestionCount(qdcount));
    }
    if u16_at(msg, 6)? != 0 || u16_at(msg, 8)? != 0 || u16_at(msg, 10)? > 1 {
        return Err(WireError::UnexpectedRecords);
    }
    let (wire, pos) = read_name(msg, HEADER, true)?;
    let qtype = u16_at(msg, pos)?;
    let qclass = u16_at(msg, pos + 2)?;
    let mut pos = pos + 4;
    if u16_at(msg, 10)? == 1 {
        // Root owner, type OPT, class (UDP size), TTL (extended rcode, flags), data.
        let owner = *msg.get(pos).ok_or(WireError::Truncated)?;
        if owner != 0 || u16_at(msg, pos + 1)? != qtype::OPT {
            return Err(WireError::NotOpt);
        }
        pos += 11 + usize::from(u16_at(msg, pos + 9)?);
        if pos > msg.len() {
            return Err(WireError::Truncated);
        }
    }
    if pos != msg.len() {
        return Err(WireError::TrailingData);
    }
    Ok(Query {
        id: u16_at(msg, 0)?,
        name: presentation(&wire)?,
        qtype,
        qclass,
        rd: flags & 0x0100 != 0,
    })
}

/// A record's fixed part.
struct Record {
    rtype: u16,
    class: u16,
    ttl: u32,
    /// Where its data starts.
    data: usize,
    /// Its data's length.
    len: usize,
}

/// Reads the fixed part of the record whose owner name ends at `pos`; checks its data is inside.
fn record(msg: &[u8], pos: usize) -> Result<Record, WireError> {
    let len = usize::from(u16_at(msg, pos + 8)?);
    let data = pos + 10;
    if data + len > msg.len() {
        return Err(WireError::Truncated);
    }
    Ok(Record {
        rtype: u16_at(msg, pos)?,
        class: u16_at(msg, pos + 2)?,
        ttl: u32_at(msg, pos + 4)?,
        data,
        len,
    })
}

/// A record of the answer section that may matter.
enum Data {
    V4(Ipv4Addr),
    V6(Ipv6Addr),
    Cname(Vec<u8>),
}

/// Parses the upstream's response to `q`: the same id and question (case-insensitive), then the
/// answer section's class IN records: the CNAME chain that starts at the question's name (at
/// most 32 long; a target in it must be made of letters, digits, '-' and '_') and the A and AAAA
/// records owned by a name of that chain. Other records are ignored; the authority and
/// additional sections are only checked to be well-formed. TTLs with the top bit set count as 0
/// (RFC 2181 8). With the TC bit set, a message that ends early yields the records that fit.
pub fn parse_answer(msg: &[u8], q: &Query) -> Result<Answer, WireError> {
    let flags = header(msg)?;
    if flags & 0x8000 == 0 || flags & 0x7800 != 0 {
        return Err(WireError::NotAResponse);
    }
    if u16_at(msg, 0)? != q.id {
        return Err(WireError::IdMismatch);
    }
    let qdcount = u16_at(msg, 4)?;
    if qdcount != 1 {
        return Err(WireError::QuestionCount(qdcount));
    }
    let (qname, pos) = read_name(msg, HEADER, false)?;
    if qname != wire_name(&q.name)
        || u16_at(msg, pos)? != q.qtype
        || u16_at(msg, pos + 2)? != q.qclass
    {
        return Err(WireError::QuestionMismatch);
    }
    let truncated = flags & 0x0200 != 0;
    let mut found: Vec<(Vec<u8>, u32, Data)> = Vec::new();
    let mut walk = || -> Result<(), WireError> {
        let ancount = u16_at(msg, 6)?;
        let others = u32::from(u16_at(msg, 8)?) + u32::from(u16_at(msg, 10)?);
        let mut pos = pos + 4;
        for _ in 0..ancount {
            let (owner, end) = read_name(msg, pos, false)?;
            let r = record(msg, end)?;
            pos = r.data + r.len;
            let rdata = &msg[r.data..pos];
            let ttl = if r.ttl > i32::MAX as u32 { 0 } else { r.ttl };
            let data = match (r.class, r.rtype) {
                (qclass::IN, qtype::A) => match rdata {
                    &[a, b, c, d] => Data::V4(Ipv4Addr::new(a, b, c, d)),
                    _ => return Err(WireError::BadRecord("A data not 4 bytes")),
                },
                (qclass::IN, qtype::AAAA) => match <[u8; 16]>::try_from(rdata) {
                    Ok(bytes) => Data::V6(Ipv6Addr::from(bytes)),
                    Err(_) => return Err(WireError::BadRecord("AAAA data not 16 bytes")),
                },
                (qclass::IN, qtype::CNAME) => match read_name(msg, r.data, false)? {
                    (target, end) if end == pos => Data::Cname(target),
                    _ => return Err(WireError::BadRecord("CNAME name not its whole data")),
                },
                _ => continue,
            };
            found.push((owner, ttl, data));
        }
        for _ in 0..others {
            pos = read_name(msg, pos, false)?.1;
            let r = record(msg, pos)?;
            pos = r.data + r.len;
        }
        Ok(())
    };
    match walk() {
        Err(WireError::Truncated) if truncated => {}
        other => other?,
    }
    // The chain: from the question's name, each name's (first) CNAME target not seen yet.
    let mut chain = vec![qname];
    let mut answer = Answer {
        rcode: (flags & 0xF) as u8,
        truncated,
        ..Answer::default()
    };
    while chain.len() <= MAX_CHAIN {
        let last = chain.last().map(Vec::as_slice).unwrap_or_default();
        let next = found.iter().find_map(|(owner, _, data)| match data {
            Data::Cname(t) if owner == last && !chain.contains(t) => Some(t),
            _ => None,
        });
        let Some(next) = next else { break };
        answer.cnames.push(presentation(next)?);
        chain.push(next.clone());
    }
    for (owner, ttl, data) in &found {
        match data {
            Data::V4(ip) if chain.contains(owner) => answer.a.push((*ip, *ttl)),
            Data::V6(ip) if chain.contains(owner) => answer.aaaa.push((*ip, *ttl)),
            _ => {}
        }
    }
    Ok(answer)
}

fn push_header(out: &mut Vec<u8>, id: u16, flags: u16, qd: u16, an: u16) {
    for v in [id, flags, qd, an, 0, 0] {
        out.extend_from_slice(&v.to_be_bytes());
    }
}

fn push_question(out: &mut Vec<u8>, name: &str, qtype: u16, qclass: u16) {
    out.extend(wire_name(name));
    out.push(0);
    out.extend_from_slice(&qtype.to_be_bytes());
    out.extend_from_slice(&qclass.to_be_bytes());
}

/// An answer without records to `query` (parsed as `q`): the same id, RD and CD copied (from
/// `query`'s header, or `q` if it has none), RA set, `rcode`, the question re-encoded from `q`.
pub fn respond(query: &[u8], q: &Query, rcode: u8) -> Vec<u8> {
    let (id, copied) = match (u16_at(query, 0), u16_at(query, 2)) {
        (Ok(id), Ok(flags)) => (id, flags & 0x0110),
        _ => (q.id, if q.rd { 0x0100 } else { 0 }),
    };
    let flags = 0x8000 | copied | 0x0080 | u16::from(rcode & 0xF);
    let mut out = Vec::with_capacity(HEADER + q.name.len() + 6);
    push_header(&mut out, id, flags, 1, 0);
    push_question(&mut out, &q.name, q.qtype, q.qclass);
    out
}

/// A class IN query for `name` (a trailing dot is ignored, labels longer than 63 bytes are cut)
/// with RD set.
pub fn encode_query(id: u16, name: &str, qtype: u16) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + name.len() + 6);
    push_header(&mut out, id, 0x0100, 1, 0);
    push_question(&mut out, name, qtype, qclass::IN);
    out
}

/// A NOERROR response to `q` as a resolver would send it: the question, the chain of `cnames`
/// (the first owned by the question's name, each next by the previous target), then the A
/// records `a`, owned by the chain's last name (the question's name if `cnames` is empty). Owner
/// names are compression pointers to the question's name or to an earlier CNAME target.
pub fn encode_answer(q: &Query, a: &[(Ipv4Addr, u32)], cnames: &[&str]) -> Vec<u8> {
    let count = u16::try_from(cnames.len() + a.len()).unwrap_or(u16::MAX);
    let flags = 0x8000 | if q.rd { 0x0100 } else { 0 } | 0x0080;
    let mut out = Vec::with_capacity(HEADER + 64 + 32 * usize::from(count));
    push_header(&mut out, q.id, flags, 1, count);
    push_question(&mut out, &q.name, q.qtype, q.qclass);
    let mut owner = HEADER;
    let push_rr = |out: &mut Vec<u8>, owner: usize, rtype: u16, ttl: u32, data: &[u8]| {
        for v in [0xC000 | (owner as u16 & 0x3FFF), rtype, qclass::IN] {
            out.extend_from_slice(&v.to_be_bytes());
        }
        out.extend_from_slice(&ttl.to_be_bytes());
        out.extend_from_slice(&(data.len() as u16).to_be_bytes());
        out.extend_from_slice(data);
    };
    for cname in cnames {
        let mut target = wire_name(cname);
        target.push(0);
        push_rr(&mut out, owner, qtype::CNAME, 300, &target);
        owner = out.len() - target.len();
    }
    for (ip, ttl) in a {
        push_rr(&mut out, owner, qtype::A, *ttl, &ip.octets());
    }
    out
}

/// Rewrites the id of `msg` (nothing if it is shorter than 2 bytes).
pub fn set_id(msg: &mut [u8], id: u16) {
    if let Some(head) = msg.get_mut(..2) {
        head.copy_from_slice(&id.to_be_bytes());
    }
}

/// Whether `name` is allowed by the policy `pattern`: an exact name, or `*.suffix`, which matches
/// the names with at least one more label ending in `.suffix` (not `suffix` itself; a lone `*`
/// matches every name but the root). Case-insensitive; trailing dots are ignored.
pub fn name_matches(pattern: &str, name: &str) -> bool {
    let pattern = pattern.trim_end_matches('.').as_bytes();
    let name = name.trim_end_matches('.').as_bytes();
    let Some(suffix) = pattern.strip_prefix(b"*") else {
        return pattern.eq_ignore_ascii_case(name);
    };
    let prefix = match suffix {
        [] => name,
        [b'.', rest @ ..] if !rest.is_empty() => {
            let Some(cut) = name.len().checked_sub(suffix.len()) else {
                return false;
            };
            if !name[cut..].eq_ignore_ascii_case(suffix) {
                return false;
            }
            &name[..cut]
        }
        _ => return pattern.eq_ignore_ascii_case(name),
    };
    !prefix.is_empty()
        && !prefix.starts_with(b".")
        && !prefix.ends_with(b".")
        && !prefix.windows(2).any(|w| w == b"..")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use WireError::*;

    fn query(name: &str, qtype: u16) -> Query {
        parse_query(&encode_query(0x1234, name, qtype)).expect("valid query")
    }

    /// A response (id 0x1234) with `question` and `records` written by hand.
    fn response(flags: u16, an: u16, question: &[u8], records: &[u8]) -> Vec<u8> {
        let mut m = Vec::new();
        push_header(&mut m, 0x1234, flags, 1, an);
        m.extend_from_slice(question);
        m.extend_from_slice(records);
        m
    }

    fn rr(owner: &[u8], rtype: u16, class: u16, ttl: u32, data: &[u8]) -> Vec<u8> {
        let mut r = owner.to_vec();
        r.extend_from_slice(&[rtype.to_be_bytes(), class.to_be_bytes()].concat());
        r.extend_from_slice(&ttl.to_be_bytes());
        r.extend_from_slice(&(data.len() as u16).to_be_bytes());
        r.extend_from_slice(data);
        r
    }

    fn bad_name<T>(r: Result<T, WireError>) -> bool {
        matches!(r, Err(BadName(_)))
    }

    const EXAMPLE_Q: &[u8] = b"\x07example\x03com\x00\x00\x01\x00\x01";
    const OK: u16 = 0x8180; // QR, RD, RA, NOERROR

    #[test]
    fn query_round_trip_and_lower_case() {
        let q = parse_query(&encode_query(7, "WWW.Example.COM.", qtype::AAAA)).expect("query");
        let got = (q.id, q.name.as_str(), q.qtype, q.qclass, q.rd);
        assert_eq!(got, (7, "www.example.com", 28, 1, true));
        assert_eq!(query("", qtype::NS).name, "");
        assert_eq!(query("a_b-1.x", qtype::A).name, "a_b-1.x");
    }

    #[test]
    fn query_refusals() {
        let ok = encode_query(1, "example.com", qtype::A);
        let with = |at: usize, v: u8| {
            let mut m = ok.clone();
            m[at] = v;
            parse_query(&m)
        };
        assert_eq!(with(2, 0x81), Err(NotAQuery)); // QR
        assert_eq!(with(2, 0x09), Err(NotAQuery)); // opcode 1
        assert_eq!(with(5, 2), Err(QuestionCount(2)));
        assert_eq!(with(5, 0), Err(QuestionCount(0)));
        assert_eq!(with(7, 1), Err(UnexpectedRecords));
        assert_eq!(with(9, 1), Err(UnexpectedRecords));
        assert_eq!(with(11, 2), Err(UnexpectedRecords));
        assert_eq!(with(11, 1), Err(Truncated)); // an OPT announced, absent
        for v in [b'.', b'*', b' ', 0xE9, 0] {
            assert!(bad_name(with(13, v)), "byte {v}");
        }
        assert!(bad_name(with(12, 0xC0)) && bad_name(with(12, 0x40))); // pointer, 64 bytes
        assert_eq!(parse_query(&[&ok[..], &[0]].concat()), Err(TrailingData));
        assert_eq!(parse_query(&ok[..11]), Err(TooShort));
        let mut huge = ok.clone();
        huge.resize(MAX_MESSAGE + 1, 0);
        assert_eq!(parse_query(&huge), Err(TooLong));
        for n in 0..ok.len() {
            assert!(parse_query(&ok[..n]).is_err(), "prefix {n}");
        }
    }

    #[test]
    fn query_label_and_name_lengths() {
        let l63 = "a".repeat(63);
        assert_eq!(query(&l63, qtype::A).name, l63);
        let mut m = Vec::new();
        push_header(&mut m, 1, 0x0100, 1, 0);
        m.extend_from_slice(&[&[64][..], &[b'a'; 64], &[0, 0, 1, 0, 1]].concat());
        assert!(bad_name(parse_query(&m)));
        // 4 labels of 63: 255 characters; 3 of 63 and one of 61: 253.
        let four = [l63.as_str(); 4].join(".");
        assert!(bad_name(parse_query(&encode_query(1, &four, qtype::A))));
        let at_limit = format!("{l63}.{l63}.{l63}.{}", "b".repeat(61));
        assert_eq!(at_limit.len(), 253);
        assert_eq!(query(&at_limit, qtype::A).name, at_limit);
        let past = format!("{at_limit}b");
        assert!(bad_name(parse_query(&encode_query(1, &past, qtype::A))));
    }

    #[test]
    fn query_with_edns_opt() {
        let mut m = encode_query(9, "example.com", qtype::A);
        m[11] = 1;
        let mut not_opt = m.clone();
        m.extend_from_slice(&rr(&[0], qtype::OPT, 1232, 0, &[0, 10, 0, 2, 1, 2]));
        assert_eq!(parse_query(&m).expect("edns").name, "example.com");
        for n in 0..m.len() {
            assert!(parse_query(&m[..n]).is_err(), "prefix {n}");
        }
        not_opt.extend_from_slice(&rr(&[0], qtype::TXT, 1, 0, &[]));
        assert_eq!(parse_query(&not_opt), Err(NotOpt));
    }

    #[test]
    fn answer_a_records_and_cnames() {
        let q = query("Example.com", qtype::A);
        let ip = |n| Ipv4Addr::new(192, 0, 2, n);
        let a = parse_answer(&encode_answer(&q, &[(ip(1), 60), (ip(2), 30)], &[]), &q);
        let a = a.expect("answer");
        assert_eq!(a.a, [(ip(1), 60), (ip(2), 30)]);
        assert!(a.rcode == 0 && a.aaaa.is_empty() && a.cnames.is_empty() && !a.truncated);
        let m = encode_answer(&q, &[(ip(3), 5)], &["cdn.example.net", "edge.cdn.net"]);
        let a = parse_answer(&m, &q).expect("cname answer");
        assert_eq!(a.cnames, ["cdn.example.net", "edge.cdn.net"]);
        assert_eq!(a.a, [(ip(3), 5)]);
        for n in 0..m.len() {
            assert!(parse_answer(&m[..n], &q).is_err(), "prefix {n}");
        }
    }

    #[test]
    fn answer_by_hand() {
        let q = query("example.com", qtype::AAAA);
        let question = b"\x07EXAMPLE\x03com\x00\x00\x1c\x00\x01";
        let v6: Ipv6Addr = "2001:db8::1".parse().expect("v6");
        let mut records = rr(b"\xc0\x0c", qtype::CNAME, 1, 100, b"\x01w\xc0\x0c");
        let big_ttl = 0x8000_0000;
        records.extend(rr(b"\x01w\xc0\x0c", qtype::AAAA, 1, big_ttl, &v6.octets()));
        records.extend(rr(b"\xc0\x0c", qtype::AAAA, 3, 9, &v6.octets())); // class CH: ignored
        records.extend(rr(b"\x05other\x00", qtype::A, 1, 9, &[10, 0, 0, 1])); // not in the chain
        records.extend(rr(b"\xc0\x0c", qtype::TXT, 1, 9, b"\x02hi")); // other type: ignored
        let a = parse_answer(&response(0x8583, 5, question, &records), &q).expect("answer");
        assert_eq!(
            (a.rcode, &a.cnames[..], &a.aaaa[..]),
            (3, &["w.example.com".into()][..], &[(v6, 0)][..])
        );
        assert!(a.a.is_empty() && !a.truncated);
        let bad = |records: Vec<u8>| parse_answer(&response(OK, 1, question, &records), &q);
        // A record with 5 bytes of data; a CNAME whose name does not fill its data.
        let five = bad(rr(b"\xc0\x0c", qtype::A, 1, 9, &[1, 2, 3, 4, 5]));
        assert!(matches!(five, Err(BadRecord(_))));
        let short = bad(rr(b"\xc0\x0c", qtype::CNAME, 1, 9, b"\xc0\x0c\x00"));
        assert!(matches!(short, Err(BadRecord(_))));
        // A CNAME target with a byte outside the name alphabet.
        let slash = bad(rr(b"\xc0\x0c", qtype::CNAME, 1, 9, b"\x03a/b\x00"));
        assert!(bad_name(slash));
    }

    #[test]
    fn answer_rcode_truncation_and_mismatches() {
        let q = query("example.com", qtype::A);
        let a = parse_answer(&response(0x8182, 0, EXAMPLE_Q, &[]), &q).expect("servfail");
        assert_eq!(a.rcode, rcode::SERVFAIL);
        let a = parse_answer(&response(0x8385, 0, EXAMPLE_Q, &[]), &q).expect("refused");
        assert!(a.truncated && a.rcode == rcode::REFUSED);
        // TC set and the answer section cut: the records that fit.
        let mut recs = rr(b"\xc0\x0c", qtype::A, 1, 9, &[1, 1, 1, 1]);
        recs.extend(rr(b"\xc0\x0c", qtype::A, 1, 9, &[2, 2, 2, 2]));
        let a = parse_answer(&response(0x8380, 2, EXAMPLE_Q, &recs[..20]), &q).expect("tc");
        assert_eq!(a.a, [(Ipv4Addr::new(1, 1, 1, 1), 9)]);
        let m = response(OK, 2, EXAMPLE_Q, &recs[..20]);
        assert_eq!(parse_answer(&m, &q), Err(Truncated));
        let mut m = response(OK, 0, EXAMPLE_Q, &[]);
        set_id(&mut m, 1);
        assert_eq!(parse_answer(&m, &q), Err(IdMismatch));
        let m = response(0x0180, 0, EXAMPLE_Q, &[]);
        assert_eq!(parse_answer(&m, &q), Err(NotAResponse));
        for question in [
            &b"\x07example\x03org\x00\x00\x01\x00\x01"[..],
            b"\x07example\x03com\x00\x00\x1c\x00\x01",
            b"\x07example\x03com\x00\x00\x01\x00\x03",
            b"\x03com\x00\x00\x01\x00\x01",
        ] {
            let m = response(OK, 0, question, &[]);
            assert_eq!(parse_answer(&m, &q), Err(QuestionMismatch));
        }
        let mut m = response(OK, 0, EXAMPLE_Q, &[]);
        m[5] = 0;
        assert_eq!(parse_answer(&m, &q), Err(QuestionCount(0)));
    }

    #[test]
    fn answer_pointer_loops() {
        let q = query("example.com", qtype::A);
        let a = |owner: &[u8]| rr(owner, qtype::A, 1, 9, &[1, 2, 3, 4]);
        let first = (HEADER + EXAMPLE_Q.len()) as u8; // where the record's owner starts
        let cases = [
            (a(&[0xC0, first]), "to itself"),
            (a(&[0xC0, first + 2]), "forward"),
            (a(&[0xC0, 0xFF]), "past the end"),
            (a(&[1, b'x', 0xC0, first]), "to its own start"),
        ];
        for (records, what) in cases {
            let m = response(OK, 1, EXAMPLE_Q, &records);
            assert_eq!(parse_answer(&m, &q), Err(PointerLoop), "{what}");
        }
        // Two names pointing at each other (the CNAME's data and the next record's owner).
        let mut records = rr(b"\xc0\x0c", qtype::CNAME, 1, 9, &[0xC0, first + 14]);
        records.extend(a(&[0xC0, first + 12]));
        let m = response(OK, 2, EXAMPLE_Q, &records);
        assert_eq!(parse_answer(&m, &q), Err(PointerLoop));
        // A question that is a pointer into the header.
        let m = response(OK, 0, b"\xc0\x02\x00\x01\x00\x01", &[]);
        assert!(parse_answer(&m, &q).is_err());
    }

    #[test]
    fn answer_cname_cycle_terminates() {
        let q = query("a.com", qtype::A);
        let question = b"\x01a\x03com\x00\x00\x01\x00\x01";
        let mut records = rr(b"\xc0\x0c", qtype::CNAME, 1, 9, b"\x01b\xc0\x0e");
        records.extend(rr(b"\x01b\xc0\x0e", qtype::CNAME, 1, 9, b"\xc0\x0c"));
        records.extend(rr(b"\x01b\xc0\x0e", qtype::A, 1, 9, &[5, 6, 7, 8]));
        let a = parse_answer(&response(OK, 3, question, &records), &q).expect("cycle");
        assert_eq!(a.cnames, ["b.com"]);
        assert_eq!(a.a, [(Ipv4Addr::new(5, 6, 7, 8), 9)]);
    }

    #[test]
    fn respond_parses_back_and_set_id() {
        let mut raw = encode_query(0xBEEF, "Blocked.Example", qtype::AAAA);
        raw[3] = 0x10; // CD
        let q = parse_query(&raw).expect("query");
        for code in [rcode::NOERROR, rcode::NXDOMAIN, rcode::REFUSED] {
            let mut r = respond(&raw, &q, code);
            let a = parse_answer(&r, &q).expect("response");
            assert!(a.rcode == code && a.a.is_empty() && a.aaaa.is_empty() && a.cnames.is_empty());
            assert_eq!(&r[..4], &[0xBE, 0xEF, 0x81, 0x90 | code]);
            assert_eq!(&r[4..12], &[0, 1, 0, 0, 0, 0, 0, 0]);
            assert_eq!(&r[12..], &raw[12..]);
            set_id(&mut r, 77);
            assert_eq!(parse_answer(&r, &q), Err(IdMismatch));
            let q77 = Query {
                id: 77,
                ..q.clone()
            };
            assert!(parse_answer(&r, &q77).is_ok());
        }
        let r = respond(&[], &Query { rd: false, ..q }, rcode::REFUSED);
        assert_eq!(&r[..4], &[0xBE, 0xEF, 0x80, 0x85]);
        set_id(&mut [0u8][..], 1);
    }

    #[test]
    fn name_matches_table() {
        // A pattern | names it matches | names it does not.
        let table = [
            "example.com | example.com EXAMPLE.com. | www.example.com example.co com",
            "example.com. | example.com | www.example.com",
            "*.example.com | www.example.com a.b.Example.COM www.example.com. | example.com",
            "*.Example.com. | www.example.com | badexample.com .example.com a..example.com",
            "*.example.com | | com www.example.org example.com. xexample.com",
            "* | anything.at.all com |",
            "*example.com | | wwwexample.com example.com",
        ];
        for row in table {
            let [pattern, yes, no] = [0, 1, 2].map(|i| row.split('|').nth(i).unwrap_or_default());
            let pattern = pattern.trim();
            for name in yes.split_whitespace() {
                assert!(name_matches(pattern, name), "{pattern} ~ {name}");
            }
            for name in no.split_whitespace() {
                assert!(!name_matches(pattern, name), "{pattern} !~ {name}");
            }
        }
        assert!(name_matches("", "") && name_matches("", ".") && !name_matches("", "com"));
        assert!(!name_matches("*", "") && !name_matches("*.com", ".com"));
    }

    fn valid_name() -> impl Strategy<Value = String> {
        proptest::collection::vec("[a-zA-Z0-9_-]{1,63}", 0..6)
            .prop_map(|labels| labels.join("."))
            .prop_filter("at most 253 characters", |n| n.len() <= 253)
    }

    proptest! {
        #[test]
        fn parse_query_never_panics(msg in proptest::collection::vec(any::<u8>(), 0..600)) {
            let _ = parse_query(&msg);
        }

        #[test]
        fn parse_answer_never_panics(msg in proptest::collection::vec(any::<u8>(), 0..600)) {
            let q = query("example.com", qtype::A);
            let _ = parse_answer(&msg, &q);
            // After a plausible header and question, so that records are reached.
            let an = u16::from(msg.first().copied().unwrap_or(1));
            let mut m = response(OK, an, EXAMPLE_Q, &msg);
            let _ = parse_answer(&m, &q);
            m[11] = msg.get(1).copied().unwrap_or(0);
            let _ = parse_answer(&m, &q);
        }

        #[test]
        fn parse_answer_survives_mutations(
            flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
            n in 0usize..4,
        ) {
            let q = query("www.example.com", qtype::A);
            let ips: Vec<_> = (0..n as u8).map(|i| (Ipv4Addr::new(10, 0, 0, i), 60)).collect();
            let mut m = encode_answer(&q, &ips, &["a.example.net", "b.example.org"][..n.min(2)]);
            for (at, x) in flips {
                let len = m.len();
                m[at % len] ^= x;
            }
            let _ = parse_answer(&m, &q);
        }

        #[test]
        fn query_round_trip(id in any::<u16>(), name in valid_name(), t in any::<u16>()) {
            let q = parse_query(&encode_query(id, &name, t)).expect("valid query");
            let name = name.to_ascii_lowercase();
            prop_assert_eq!(q, Query { id, name, qtype: t, qclass: 1, rd: true });
        }
    }
}
