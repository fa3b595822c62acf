//! Netlink: network links, addresses and routes (rtnetlink), nftables set elements, NFLOG.
//!
//! A small hand-written netlink client. [`route::Route`] speaks rtnetlink (`NETLINK_ROUTE`):
//! veth pairs, IPv4 addresses and routes, link names and byte counters. [`nft::Nft`] speaks
//! nfnetlink (`NETLINK_NETFILTER`): elements of nftables sets, added and removed in batches.
//!
//! This module holds what both share: the socket (`AF_NETLINK`, `SOCK_RAW | SOCK_CLOEXEC`, a
//! 64 KiB receive buffer, a reply timeout), a message builder (4-byte-aligned attributes,
//! nested attributes), and the reading of replies: every request asks for an acknowledgement
//! (`NLM_F_ACK`), replies are matched to their request by sequence number (others are
//! skipped), dumps are read until `NLMSG_DONE`, and a refusal (`NLMSG_ERROR` with a negative
//! code) becomes an [`io::Error`] whose kind is the errno's and whose inner error is a
//! [`NetlinkError`] naming the request ([`errno`] gives the errno back). Everything the kernel
//! sends is parsed with its lengths checked: a malformed reply is an error, never a panic.

use std::fmt;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

pub mod log;
pub mod nft;
pub mod route;

const NLMSG_HDRLEN: usize = 16;
const NLA_HDRLEN: usize = 4;
const NLMSG_NOOP: u16 = 1;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLMSG_OVERRUN: u16 = 4;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_ECHO: u16 = 0x8;
const NLM_F_DUMP: u16 = 0x300;
const NLM_F_EXCL: u16 = 0x200;
const NLM_F_CREATE: u16 = 0x400;
/// On an `NLMSG_ERROR`: the request was not copied back (`NETLINK_CAP_ACK`).
const NLM_F_CAPPED: u16 = 0x100;
/// On an `NLMSG_ERROR`: extended-ack attributes follow.
const NLM_F_ACK_TLVS: u16 = 0x200;
const NLA_F_NESTED: u16 = 0x8000;
const NLA_TYPE_MASK: u16 = 0x3fff;
const NLMSGERR_ATTR_MSG: u16 = 1;
const SOL_NETLINK: libc::c_int = 270;
const NETLINK_CAP_ACK: libc::c_int = 10;
const NETLINK_EXT_ACK: libc::c_int = 11;
const RECV_BUF: usize = 64 * 1024;
/// How long a request waits for its reply before it fails with `TimedOut`.
const REPLY_TIMEOUT_SECS: libc::time_t = 10;

const fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// A request the kernel refused: the inner error of the [`io::Error`]s this module returns
/// for refusals (their kind is the errno's kind).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetlinkError {
    /// The errno the kernel answered with (positive, e.g. `libc::EEXIST`).
    pub errno: i32,
    /// What was asked, e.g. `RTM_NEWLINK veth dst1a2b (peer eth0 in the netns of pid 42)`.
    pub request: String,
    /// The kernel's extended-ack message, when it gave one.
    pub message: Option<String>,
}

impl fmt::Display for NetlinkError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let os = io::Error::from_raw_os_error(self.errno);
        write!(f, "netlink {}: {os}", self.request)?;
        if let Some(m) = &self.message {
            write!(f, " ({m})")?;
        }
        Ok(())
    }
}

impl std::error::Error for NetlinkError {}

impl NetlinkError {
    fn into_io(self) -> io::Error {
        io::Error::new(io::Error::from_raw_os_error(self.errno).kind(), self)
    }
}

/// The errno of an error returned by this module: the kernel's answer to a refused request
/// (see [`NetlinkError`]) or the OS error of a failed system call.
pub fn errno(err: &io::Error) -> Option<i32> {
    err.raw_os_error().or_else(|| {
        err.get_ref()?
            .downcast_ref::<NetlinkError>()
            .map(|e| e.errno)
    })
}

fn malformed(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("netlink: malformed reply ({what})"),
    )
}

fn invalid_input(what: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, what)
}

/// The kernel's answer to one request: `errno` 0 is an acknowledgement.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Ack {
    seq: u32,
    errno: i32,
    message: Option<String>,
}

impl Ack {
    /// `Ok` for an acknowledgement, else the refusal of the request `what` names.
    fn check(self, what: impl FnOnce() -> String) -> io::Result<()> {
        if self.errno == 0 {
            return Ok(());
        }
        Err(NetlinkError {
            errno: self.errno,
            request: what(),
            message: self.message,
        }
        .into_io())
    }
}

/// Builds netlink messages (one or several, back to back) in one buffer.
#[derive(Debug, Default)]
struct Builder {
    buf: Vec<u8>,
    start: usize,
}

impl Builder {
    fn new() -> Self {
        Builder {
            buf: Vec::with_capacity(256),
            start: 0,
        }
    }

    /// Starts a message; [`Builder::end`] writes its length.
    fn begin(&mut self, ty: u16, flags: u16, seq: u32) {
        self.pad();
        self.start = self.buf.len();
        self.buf.extend_from_slice(&0u32.to_ne_bytes());
        self.buf.extend_from_slice(&ty.to_ne_bytes());
        self.buf.extend_from_slice(&flags.to_ne_bytes());
        self.buf.extend_from_slice(&seq.to_ne_bytes());
        self.buf.extend_from_slice(&0u32.to_ne_bytes());
    }

    fn pad(&mut self) {
        self.buf.resize(align4(self.buf.len()), 0);
    }

    /// Appends a fixed header (`ifinfomsg`, `nfgenmsg`...), padded to 4 bytes.
    fn bytes(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
        self.pad();
    }

    fn put_u16_at(&mut self, at: usize, v: u16) {
        if let Some(s) = self.buf.get_mut(at..at + 2) {
            s.copy_from_slice(&v.to_ne_bytes());
        }
    }

    /// Appends an attribute, padded to 4 bytes.
    fn attr(&mut self, ty: u16, data: &[u8]) {
        let len = u16::try_from(NLA_HDRLEN + data.len()).unwrap_or(u16::MAX);
        self.buf.extend_from_slice(&len.to_ne_bytes());
        self.buf.extend_from_slice(&ty.to_ne_bytes());
        self.bytes(data);
    }

    fn attr_u32(&mut self, ty: u16, v: u32) {
        self.attr(ty, &v.to_ne_bytes());
    }

    /// A NUL-terminated string attribute.
    fn attr_str(&mut self, ty: u16, s: &str) {
        let len = u16::try_from(NLA_HDRLEN + s.len() + 1).unwrap_or(u16::MAX);
        self.buf.extend_from_slice(&len.to_ne_bytes());
        self.buf.extend_from_slice(&ty.to_ne_bytes());
        self.buf.extend_from_slice(s.as_bytes());
        self.buf.push(0);
        self.pad();
    }

    /// Opens a nested attribute; returns where it starts, for [`Builder::nest_end`].
    fn nest(&mut self, ty: u16) -> usize {
        let at = self.buf.len();
        self.buf.extend_from_slice(&0u16.to_ne_bytes());
        self.buf.extend_from_slice(&ty.to_ne_bytes());
        at
    }

    fn nest_end(&mut self, at: usize) {
        let len = u16::try_from(self.buf.len() - at).unwrap_or(u16::MAX);
        self.put_u16_at(at, len);
    }

    /// Ends the current message: writes its length.
    fn end(&mut self) {
        let len = u32::try_from(self.buf.len() - self.start).unwrap_or(u32::MAX);
        if let Some(s) = self.buf.get_mut(self.start..self.start + 4) {
            s.copy_from_slice(&len.to_ne_bytes());
        }
    }

    /// The length of the current message so far.
    fn msg_len(&self) -> usize {
        self.buf.len() - self.start
    }

    fn len(&self) -> usize {
        self.buf.len()
    }

    fn as_bytes(&self) -> &[u8] {
        &self.buf
    }
}

fn u16_at(b: &[u8], off: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(off..off + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], off: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(off..off + 4)?.try_into().ok()?))
}

fn i32_at(b: &[u8], off: usize) -> Option<i32> {
    Some(i32::from_ne_bytes(b.get(off..off + 4)?.try_into().ok()?))
}

/// One message of a reply.
#[derive(Debug, Clone, Copy)]
struct Msg<'a> {
    ty: u16,
    flags: u16,
    seq: u32,
    payload: &'a [u8],
}

/// The messages of a datagram; a malformed one is an error that ends the iteration.
struct Messages<'a> {
    rest: &'a [u8],
}

fn messages(buf: &[u8]) -> Messages<'_> {
    Messages { rest: buf }
}

impl<'a> Iterator for Messages<'a> {
    type Item = io::Result<Msg<'a>>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.is_empty() {
            return None;
        }
        let rest = std::mem::take(&mut self.rest);
        let len = u32_at(rest, 0).map_or(0, |l| l as usize);
        if len < NLMSG_HDRLEN || len > rest.len() {
            return Some(Err(malformed("message length")));
        }
        let msg = Msg {
            ty: u16_at(rest, 4)?,
            flags: u16_at(rest, 6)?,
            seq: u32_at(rest, 8)?,
            payload: rest.get(NLMSG_HDRLEN..len)?,
        };
        self.rest = rest.get(align4(len)..).unwrap_or(&[]);
        Some(Ok(msg))
    }
}

/// The attributes in `buf` (type without the nested/byte-order flags, payload); stops at the
/// first malformed one.
struct Attrs<'a> {
    rest: &'a [u8],
}

fn attrs(buf: &[u8]) -> Attrs<'_> {
    Attrs { rest: buf }
}

impl<'a> Iterator for Attrs<'a> {
    type Item = (u16, &'a [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        let rest = std::mem::take(&mut self.rest);
        let len = usize::from(u16_at(rest, 0)?);
        let ty = u16_at(rest, 2)? & NLA_TYPE_MASK;
        if len < NLA_HDRLEN {
            return None;
        }
        let data = rest.get(NLA_HDRLEN..len)?;
        self.rest = rest.get(align4(len)..).unwrap_or(&[]);
        Some((ty, data))
    }
}

/// The payload of the first attribute of type `ty` in `buf`.
fn attr(buf: &[u8], ty: u16) -> Option<&[u8]> {
    attrs(buf).find(|(t, _)| *t == ty).map(|(_, d)| d)
}

/// A string attribute's text (up to its first NUL).
fn attr_text(data: &[u8]) -> String {
    let end = data.iter().position(|&b| b == 0).unwrap_or(data.len());
    String::from_utf8_lossy(data.get(..end).unwrap_or(&[])).into_owned()
}

/// Parses an `NLMSG_ERROR` message: its code and extended-ack message.
fn parse_error(msg: &Msg<'_>) -> io::Result<Ack> {
    let code = i32_at(msg.payload, 0).ok_or_else(|| malformed("short NLMSG_ERROR"))?;
    let mut message = None;
    if msg.flags & NLM_F_ACK_TLVS != 0 {
        let echoed = if msg.flags & NLM_F_CAPPED != 0 {
            NLMSG_HDRLEN
        } else {
            u32_at(msg.payload, 4).map_or(NLMSG_HDRLEN, |l| l as usize)
        };
        let tlvs = msg.payload.get(align4(4 + echoed)..).unwrap_or(&[]);
        message = attr(tlvs, NLMSGERR_ATTR_MSG).map(attr_text);
    }
    Ok(Ack {
        seq: msg.seq,
        errno: code.checked_neg().unwrap_or(i32::MAX),
        message,
    })
}

/// A run of consecutive sequence numbers (wrapping).
#[derive(Debug, Clone, Copy)]
struct Window {
    first: u32,
    count: u32,
}

impl Window {
    fn contains(&self, seq: u32) -> bool {
        seq.wrapping_sub(self.first) < self.count
    }
}

/// What a request waits for: answers to the messages of `all`, of which those in `acked`
/// asked for an acknowledgement (`expect` of them).
#[derive(Debug, Clone, Copy)]
struct Wait {
    all: Window,
    acked: Window,
    expect: usize,
}

impl Wait {
    /// The answer to one message, `seq`.
    fn one(seq: u32) -> Wait {
        let w = Window {
            first: seq,
            count: 1,
        };
        Wait {
            all: w,
            acked: w,
            expect: 1,
        }
    }
}

/// Handles one datagram of replies: data messages go to `on_data`, answers are added to
/// `acks`. Returns whether the wait is over (every acknowledgement is in, a dump is done, or
/// a message that asked for none was refused).
fn take_replies(
    buf: &[u8],
    wait: Wait,
    acks: &mut Vec<Ack>,
    on_data: &mut dyn FnMut(&Msg<'_>) -> io::Result<()>,
) -> io::Result<bool> {
    for msg in messages(buf) {
        let msg = msg?;
        if !wait.all.contains(msg.seq) {
            continue; // a late answer to an earlier request, or a notification
        }
        match msg.ty {
            NLMSG_NOOP => {}
            NLMSG_ERROR => {
                let ack = parse_error(&msg)?;
                let unasked = !wait.acked.contains(ack.seq);
                let refused = ack.errno != 0;
                if unasked && !refused {
                    continue;
                }
                acks.push(ack);
                if unasked {
                    return Ok(true);
                }
            }
            NLMSG_DONE => {
                let code = i32_at(msg.payload, 0).unwrap_or(0);
                acks.push(Ack {
                    seq: msg.seq,
                    errno: code.checked_neg().unwrap_or(i32::MAX),
                    message: None,
                });
                return Ok(true);
            }
            NLMSG_OVERRUN => return Err(malformed("NLMSG_OVERRUN")),
            _ => on_data(&msg)?,
        }
    }
    Ok(acks.len() >= wait.expect)
}

fn set_opt<T>(fd: &OwnedFd, level: libc::c_int, name: libc::c_int, value: &T) -> io::Result<()> {
    let len = libc::socklen_t::try_from(std::mem::size_of::<T>())
        .map_err(|_| invalid_input("socket option too large".into()))?;
    // SAFETY: `value` points to a live `T` of `len` bytes for the duration of the call; the
    // kernel only reads it.
    let r =
        unsafe { libc::setsockopt(fd.as_raw_fd(), level, name, (value as *const T).cast(), len) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A netlink socket of one protocol, in the network namespace it was made in.
struct Socket {
    fd: OwnedFd,
    seq: u32,
    buf: Vec<u8>,
}

impl fmt::Debug for Socket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Socket")
            .field("fd", &self.fd)
            .field("seq", &self.seq)
            .finish()
    }
}

impl Socket {
    /// A socket of protocol `proto` in the calling thread's network namespace.
    fn open(proto: libc::c_int) -> io::Result<Socket> {
        // SAFETY: socket(2) with constant arguments; the result is checked below.
        let fd =
            unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, proto) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a descriptor socket(2) just returned; nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let one: libc::c_int = 1;
        // Errors are not echoed with the whole request; both options are optional.
        let _ = set_opt(&fd, SOL_NETLINK, NETLINK_CAP_ACK, &one);
        let _ = set_opt(&fd, SOL_NETLINK, NETLINK_EXT_ACK, &one);
        let timeout = libc::timeval {
            tv_sec: REPLY_TIMEOUT_SECS,
            tv_usec: 0,
        };
        set_opt(&fd, libc::SOL_SOCKET, libc::SO_RCVTIMEO, &timeout)?;
        Ok(Socket {
            fd,
            seq: 0,
            buf: vec![0; RECV_BUF],
        })
    }

    /// A socket of protocol `proto` made in the network namespace of process `pid`
    /// ([`crate::net::in_netns`]); it stays in that namespace whichever thread uses it.
    fn open_in(pid: i32, proto: libc::c_int) -> io::Result<Socket> {
        crate::net::in_netns(pid, || Socket::open(proto))
    }

    /// Reserves `n` consecutive sequence numbers; returns the first.
    fn seqs(&mut self, n: u32) -> u32 {
        let first = self.seq.wrapping_add(1);
        self.seq = self.seq.wrapping_add(n);
        first
    }

    fn send(&self, data: &[u8]) -> io::Result<()> {
        loop {
            // SAFETY: `data` is valid for reads of its length; send(2) copies it.
            let n = unsafe { libc::send(self.fd.as_raw_fd(), data.as_ptr().cast(), data.len(), 0) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if usize::try_from(n).ok() != Some(data.len()) {
                return Err(io::Error::other("netlink: short send"));
            }
            return Ok(());
        }
    }

    /// Receives one datagram into the buffer; returns its length.
    fn recv(&mut self) -> io::Result<usize> {
        loop {
            // SAFETY: the buffer is valid for writes of its length; with MSG_TRUNC the call
            // returns the datagram's whole length but writes no more than the buffer holds.
            let n = unsafe {
                libc::recv(
                    self.fd.as_raw_fd(),
                    self.buf.as_mut_ptr().cast(),
                    self.buf.len(),
                    libc::MSG_TRUNC,
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                match e.kind() {
                    io::ErrorKind::Interrupted => continue,
                    io::ErrorKind::WouldBlock => {
                        return Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            "netlink: no reply from the kernel",
                        ))
                    }
                    _ => return Err(e),
                }
            }
            let n = usize::try_from(n).unwrap_or(usize::MAX);
            if n > self.buf.len() {
                return Err(malformed("reply larger than the receive buffer"));
            }
            return Ok(n);
        }
    }

    /// Reads replies until `wait` is over; returns the answers (acknowledgements and
    /// refusals), in the order received.
    fn wait(
        &mut self,
        wait: Wait,
        on_data: &mut dyn FnMut(&Msg<'_>) -> io::Result<()>,
    ) -> io::Result<Vec<Ack>> {
        let mut acks = Vec::with_capacity(wait.expect);
        loop {
            let n = self.recv()?;
            let buf = self.buf.get(..n).unwrap_or(&[]);
            if take_replies(buf, wait, &mut acks, on_data)? {
                return Ok(acks);
            }
        }
    }

    /// Sends one message (built with sequence number `seq`, asking for an acknowledgement) and
    /// reads its replies: data messages (a dump's parts, an echo) go to `on_data`; returns the
    /// kernel's answer.
    fn request(
        &mut self,
        msg: &Builder,
        seq: u32,
        on_data: &mut dyn FnMut(&Msg<'_>) -> io::Result<()>,
    ) -> io::Result<Ack> {
        self.send(msg.as_bytes())?;
        let wait = Wait::one(seq);
        self.wait(wait, on_data)?
            .into_iter()
            .next()
            .ok_or_else(|| malformed("no answer"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(ty: u16, flags: u16, seq: u32, payload: &[u8]) -> Vec<u8> {
        let mut b = Builder::new();
        b.begin(ty, flags, seq);
        b.bytes(payload);
        b.end();
        b.buf
    }

    fn noop(_: &Msg<'_>) -> io::Result<()> {
        Ok(())
    }

    #[test]
    fn builder_aligns_and_nests() {
        let mut b = Builder::new();
        b.begin(16, NLM_F_REQUEST, 7);
        b.bytes(&[1, 2, 3]);
        let n = b.nest(5 | NLA_F_NESTED);
        b.attr_str(3, "ab");
        b.attr(4, &[9]);
        b.nest_end(n);
        b.end();
        let buf = b.as_bytes();
        assert_eq!(buf.len() % 4, 0);
        assert_eq!(u32_at(buf, 0), Some(buf.len() as u32));
        let m: Vec<_> = messages(buf).collect::<io::Result<_>>().expect("parse");
        assert_eq!(m.len(), 1);
        assert_eq!((m[0].ty, m[0].seq), (16, 7));
        let (ty, nested) = attrs(&m[0].payload[4..]).next().expect("nest");
        assert_eq!(ty, 5);
        let inner: Vec<_> = attrs(nested).collect();
        assert_eq!(inner, vec![(3, &b"ab\0"[..]), (4, &[9u8][..])]);
    }

    #[test]
    fn errors_carry_errno_and_message() {
        let mut payload = (-libc::EEXIST).to_ne_bytes().to_vec();
        payload.extend_from_slice(&msg(16, 0, 3, &[])[..16]);
        let mut tlv = Builder::new();
        tlv.attr_str(NLMSGERR_ATTR_MSG, "File exists here");
        payload.extend_from_slice(tlv.as_bytes());
        let buf = msg(NLMSG_ERROR, NLM_F_CAPPED | NLM_F_ACK_TLVS, 3, &payload);
        let mut acks = vec![];
        assert!(take_replies(&buf, Wait::one(3), &mut acks, &mut noop).expect("replies"));
        let err = acks
            .remove(0)
            .check(|| "RTM_NEWLINK x".into())
            .expect_err("refused");
        assert_eq!(err.kind(), io::ErrorKind::AlreadyExists);
        assert_eq!(errno(&err), Some(libc::EEXIST));
        assert!(err.to_string().contains("RTM_NEWLINK x"), "{err}");
        assert!(err.to_string().contains("File exists here"), "{err}");
    }

    #[test]
    fn other_sequence_numbers_are_skipped() {
        let mut buf = msg(NLMSG_ERROR, 0, 1, &(-libc::ENOENT).to_ne_bytes());
        buf.extend(msg(NLMSG_ERROR, 0, 2, &0i32.to_ne_bytes()));
        let mut acks = vec![];
        assert!(take_replies(&buf, Wait::one(2), &mut acks, &mut noop).expect("replies"));
        assert_eq!(acks.len(), 1);
        assert_eq!((acks[0].seq, acks[0].errno), (2, 0));
        let mut acks = vec![];
        assert!(!take_replies(&buf, Wait::one(9), &mut acks, &mut noop).expect("replies"));
    }

    #[test]
    fn malformed_replies_are_errors() {
        let mut acks = vec![];
        for bad in [
            &[1u8, 2, 3][..],
            &[200, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0],
        ] {
            assert!(take_replies(bad, Wait::one(1), &mut acks, &mut noop).is_err());
        }
        let short_error = msg(NLMSG_ERROR, 0, 1, &[]);
        assert!(take_replies(&short_error, Wait::one(1), &mut acks, &mut noop).is_err());
    }

    /// xorshift64*, enough to make arbitrary bytes without a dependency.
    fn noise(state: &mut u64) -> u8 {
        *state ^= *state >> 12;
        *state ^= *state << 25;
        *state ^= *state >> 27;
        (state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 56) as u8
    }

    #[test]
    fn parsers_never_panic_on_arbitrary_bytes() {
        let mut st = 0x9e37_79b9_7f4a_7c15u64;
        let valid = msg(NLMSG_ERROR, NLM_F_ACK_TLVS, 1, &[0; 24]);
        for round in 0..20_000 {
            let len = usize::from(noise(&mut st)) % 96;
            let mut buf: Vec<u8> = (0..len).map(|_| noise(&mut st)).collect();
            if round % 2 == 0 {
                // Mostly-valid messages with a few bytes changed reach deeper.
                buf = valid.clone();
                for _ in 0..3 {
                    let i = usize::from(noise(&mut st)) % buf.len();
                    buf[i] = noise(&mut st);
                }
            }
            let mut acks = vec![];
            let mut wait = Wait::one(0);
            (wait.all.count, wait.acked.count, wait.expect) = (u32::MAX, u32::MAX, 2);
            let _ = take_replies(&buf, wait, &mut acks, &mut noop);
            let _ = attrs(&buf).count();
            let _ = route::parse_link(&buf);
            let _ = route::parse_stats(&buf);
            let mut out = vec![];
            nft::parse_elements(&buf, &mut out);
        }
    }
}
