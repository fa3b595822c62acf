//! NFLOG over nfnetlink: the packets an nftables rule logs to a group (`log group N`), read
//! by the node to report what the kernel refused a sandbox (its source and destination).

use std::io;
use std::net::Ipv4Addr;

use super::{attr, attr_text, messages, Builder, Socket, NLM_F_ACK, NLM_F_REQUEST};

const NFNL_SUBSYS_ULOG: u16 = 4;
const NFULNL_MSG_PACKET: u16 = 0;
const NFULNL_MSG_CONFIG: u16 = 1;
const NFULA_CFG_CMD: u16 = 1;
const NFULA_CFG_MODE: u16 = 2;
const NFULA_CFG_QTHRESH: u16 = 5;
const NFULNL_CFG_CMD_BIND: u8 = 1;
const NFULNL_COPY_PACKET: u8 = 2;
const NFULA_PAYLOAD: u16 = 9;
const NFULA_PREFIX: u16 = 10;
/// Bytes of each packet copied: an IPv4 header with options and the ports after it.
const COPY_RANGE: u32 = 80;

/// A logged IPv4 packet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Logged {
    /// The rule's `log prefix`.
    pub prefix: String,
    /// Source address.
    pub src: Ipv4Addr,
    /// Destination address.
    pub dst: Ipv4Addr,
    /// IP protocol (6 TCP, 17 UDP, …).
    pub proto: u8,
    /// Destination port (TCP, UDP).
    pub dport: Option<u16>,
}

/// A subscription to one NFLOG group.
#[derive(Debug)]
pub struct Log {
    sock: Socket,
}

impl Log {
    /// Binds to `group` (a group has one listener: a second bind fails with `EPERM`). A
    /// listener that just closed may still hold the group for a moment (its socket released
    /// only once a process forked meanwhile has exec'd): `EPERM` is retried for up to 200 ms.
    pub fn bind(group: u16) -> io::Result<Log> {
        let mut tries = 0;
        loop {
            match Self::bind_once(group) {
                Err(e) if super::errno(&e) == Some(libc::EPERM) && tries < 10 => {
                    tries += 1;
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                r => return r,
            }
        }
    }

    fn bind_once(group: u16) -> io::Result<Log> {
        let mut sock = Socket::open(libc::NETLINK_NETFILTER)?;
        let seq = sock.seqs(1);
        let mut b = Builder::new();
        b.begin(
            (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_CONFIG,
            NLM_F_REQUEST | NLM_F_ACK,
            seq,
        );
        let g = group.to_be_bytes();
        b.bytes(&[libc::AF_UNSPEC as u8, 0, g[0], g[1]]);
        b.attr(NFULA_CFG_CMD, &[NFULNL_CFG_CMD_BIND]);
        let mut mode = COPY_RANGE.to_be_bytes().to_vec();
        mode.extend_from_slice(&[NFULNL_COPY_PACKET, 0]);
        b.attr(NFULA_CFG_MODE, &mode);
        // Each packet at once (the kernel otherwise batches them for up to a second).
        b.attr(NFULA_CFG_QTHRESH, &1u32.to_be_bytes());
        b.end();
        sock.request(&b, seq, &mut |_| Ok(()))?
            .check(|| format!("NFULNL_MSG_CONFIG bind group {group}"))?;
        Ok(Log { sock })
    }

    /// Waits for the next datagram (at most the socket's reply timeout: `TimedOut` then) and
    /// answers the packets it logged.
    pub fn receive(&mut self) -> io::Result<Vec<Logged>> {
        let n = self.sock.recv()?;
        let buf = self.sock.buf.get(..n).unwrap_or(&[]);
        Ok(parse(buf))
    }
}

/// The logged IPv4 packets of a datagram; anything else is skipped.
fn parse(buf: &[u8]) -> Vec<Logged> {
    let mut out = Vec::new();
    for m in messages(buf).map_while(Result::ok) {
        if m.ty != (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_PACKET {
            continue;
        }
        let Some(body) = m.payload.get(4..) else {
            continue;
        };
        let prefix = attr(body, NFULA_PREFIX).map(attr_text).unwrap_or_default();
        if let Some(p) = attr(body, NFULA_PAYLOAD).and_then(ipv4) {
            out.push(Logged { prefix, ..p });
        }
    }
    out
}

/// The addresses, protocol and destination port of an IPv4 packet.
fn ipv4(p: &[u8]) -> Option<Logged> {
    if p.len() < 20 || p[0] >> 4 != 4 {
        return None;
    }
    let ihl = usize::from(p[0] & 0x0f) * 4;
    let proto = p[9];
    let src = Ipv4Addr::new(p[12], p[13], p[14], p[15]);
    let dst = Ipv4Addr::new(p[16], p[17], p[18], p[19]);
    let dport = matches!(proto, 6 | 17)
        .then(|| p.get(ihl + 2..ihl + 4))
        .flatten()
        .map(|b| u16::from_be_bytes([b[0], b[1]]));
    Some(Logged {
        prefix: String::new(),
        src,
        dst,
        proto,
        dport,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packets_parse_and_junk_does_not() {
        let mut p = vec![
            0x45, 0, 0, 40, 0, 0, 0, 0, 64, 6, 0, 0, 10, 0, 0, 2, 198, 18, 0, 3,
        ];
        p.extend_from_slice(&[0x9c, 0x40, 0x00, 0x50]);
        let l = ipv4(&p).expect("a packet");
        assert_eq!(
            (l.src, l.dst, l.proto, l.dport),
            (
                Ipv4Addr::new(10, 0, 0, 2),
                Ipv4Addr::new(198, 18, 0, 3),
                6,
                Some(80)
            )
        );
        assert_eq!(ipv4(&p[..19]), None);
        assert_eq!(ipv4(&p[..20]).and_then(|l| l.dport), None);
        for n in 0..p.len() {
            let _ = parse(&p[..n]);
        }
        assert!(parse(&[0xff; 64]).is_empty());
    }

    /// A group bound twice is refused the second time, and bound again once free (as root: CI
    /// is). Other tests fork meanwhile, which once held the closed socket for a moment.
    #[test]
    fn binds_a_group_once() {
        let group = 40000 + (std::process::id() % 20000) as u16;
        let a = Log::bind(group).expect("bind");
        assert!(Log::bind(group).is_err());
        drop(a);
        Log::bind(group).expect("bind again once it is free");
    }
}
