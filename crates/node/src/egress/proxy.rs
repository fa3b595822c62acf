//! The in-band check of connections to addresses a sandbox reached through a name: the kernel
//! redirects its TCP connections to ports 80 and 443 of a pinned address (`named4`) here; the
//! first bytes must be a TLS ClientHello whose SNI, or an HTTP request whose `Host`, is a name
//! its policy allows for that port, else the connection is closed (no domain fronting onto an
//! allowed name's address). Then the node connects to the original destination and relays.
//! If the node is gone, such connections are refused: the check fails closed.

use std::net::{IpAddr, SocketAddr, SocketAddrV4};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};

use super::policy::{name_verdict, NameVerdict};
use super::Egress;

/// Most bytes read before the name must be known.
const MAX_HEAD: usize = 16 * 1024;
/// How long a client has to send them.
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the destination has to accept.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Relayed connections at once, all sandboxes together.
const MAX_RELAYS: usize = 4096;

/// What the first bytes of a connection name.
#[derive(Debug, PartialEq, Eq)]
pub enum Head {
    /// More bytes are needed.
    Partial,
    /// A TLS ClientHello with this server name (lower case), or none.
    Tls(Option<String>),
    /// An HTTP request with this `Host` (lower case, port removed), or none.
    Http(Option<String>),
    /// Neither.
    Other,
}

/// Reads a TLS ClientHello's server name (RFC 8446 §4.1.2, RFC 6066 §3) or an HTTP request's
/// `Host` from the first bytes of a connection. Bounds-checked throughout.
pub fn parse_head(b: &[u8]) -> Head {
    if b.is_empty() {
        return Head::Partial;
    }
    if b[0] == 0x16 {
        return tls_sni(b);
    }
    if b[0].is_ascii_uppercase() {
        return http_host(b);
    }
    Head::Other
}

fn tls_sni(b: &[u8]) -> Head {
    // Record: type(1) version(2) length(2); handshake: type(1) length(3).
    if b.len() < 9 {
        return Head::Partial;
    }
    let rec_len = usize::from(u16::from_be_bytes([b[3], b[4]]));
    if b[5] != 0x01 {
        return Head::Other;
    }
    let hs_len = (usize::from(b[6]) << 16) | (usize::from(b[7]) << 8) | usize::from(b[8]);
    // A ClientHello split over several records is not taken apart: it must fit in the first.
    if hs_len + 4 > rec_len || rec_len > MAX_HEAD {
        return Head::Other;
    }
    if b.len() < 5 + rec_len {
        return Head::Partial;
    }
    let hello = &b[9..5 + rec_len.min(hs_len + 4)];
    match sni_of(hello) {
        Some(name) => Head::Tls(name),
        None => Head::Other,
    }
}

/// A cursor over a byte slice.
struct Cur<'a>(&'a [u8]);

impl<'a> Cur<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (h, t) = self.0.split_at(n);
        self.0 = t;
        Some(h)
    }
    fn u8(&mut self) -> Option<usize> {
        self.take(1).map(|b| usize::from(b[0]))
    }
    fn u16(&mut self) -> Option<usize> {
        self.take(2)
            .map(|b| usize::from(u16::from_be_bytes([b[0], b[1]])))
    }
}

/// The server name of a ClientHello body: `Some(None)` when it has none, `None` when it is
/// malformed.
fn sni_of(hello: &[u8]) -> Option<Option<String>> {
    let mut c = Cur(hello);
    c.take(2 + 32)?; // legacy_version, random
    let n = c.u8()?;
    c.take(n)?; // session id
    let n = c.u16()?;
    c.take(n)?; // cipher suites
    let n = c.u8()?;
    c.take(n)?; // compression methods
    if c.0.is_empty() {
        return Some(None);
    }
    let n = c.u16()?;
    let mut ext = Cur(c.take(n)?);
    while !ext.0.is_empty() {
        let kind = ext.u16()?;
        let n = ext.u16()?;
        let body = ext.take(n)?;
        if kind != 0 {
            continue;
        }
        let mut list = Cur(body);
        let n = list.u16()?;
        let mut names = Cur(list.take(n)?);
        while !names.0.is_empty() {
            let t = names.u8()?;
            let n = names.u16()?;
            let name = names.take(n)?;
            if t == 0 {
                return valid_name(name).map(Some);
            }
        }
        return Some(None);
    }
    Some(None)
}

/// A host name's bytes, lower-cased, if they are a plausible DNS name.
fn valid_name(b: &[u8]) -> Option<String> {
    let ok = !b.is_empty()
        && b.len() <= 253
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'_'));
    ok.then(|| String::from_utf8_lossy(b).to_ascii_lowercase())
        .map(|s| s.trim_end_matches('.').to_owned())
}

fn http_host(b: &[u8]) -> Head {
    let Some(end) = b.windows(4).position(|w| w == b"\r\n\r\n") else {
        return if b.len() >= MAX_HEAD {
            Head::Other
        } else {
            Head::Partial
        };
    };
    let head = &b[..end];
    let mut lines = head.split(|c| *c == b'\n');
    let first = lines.next().unwrap_or_default();
    if !first.ends_with(b"\r") || !first.windows(5).any(|w| w == b"HTTP/") {
        return Head::Other;
    }
    let mut host = None;
    for l in lines {
        let l = l.strip_suffix(b"\r").unwrap_or(l);
        let Some(colon) = l.iter().position(|c| *c == b':') else {
            return Head::Other;
        };
        if l[..colon].eq_ignore_ascii_case(b"host") {
            if host.is_some() {
                // Two Host headers: which one the server takes is its business, not ours.
                return Head::Other;
            }
            let v = l[colon + 1..].trim_ascii();
            let v = match v.iter().rposition(|c| *c == b':') {
                Some(p) if v[p + 1..].iter().all(u8::is_ascii_digit) => &v[..p],
                _ => v,
            };
            match valid_name(v) {
                Some(n) => host = Some(n),
                None => return Head::Other,
            }
        }
    }
    Head::Http(host)
}

/// Accepts connections on `l` until the node stops, each handled by `handle` in a task of
/// its own, at most `max` at once (more are closed at once).
pub(super) async fn accept_each<F, Fut>(eg: Arc<Egress>, l: TcpListener, max: usize, handle: F)
where
    F: Fn(Arc<Egress>, TcpStream, SocketAddr) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let slots = Arc::new(tokio::sync::Semaphore::new(max));
    loop {
        let Ok((s, from)) = l.accept().await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let Ok(permit) = Arc::clone(&slots).try_acquire_owned() else {
            continue;
        };
        let work = handle(Arc::clone(&eg), s, from);
        tokio::spawn(async move {
            work.await;
            drop(permit);
        });
    }
}

/// Serves redirected connections on `l` until the node stops.
pub(super) async fn serve(eg: Arc<Egress>, l: TcpListener) {
    accept_each(eg, l, MAX_RELAYS, |eg, s, from| async move {
        let _ = relay(&eg, s, from).await;
    })
    .await;
}

async fn relay(eg: &Arc<Egress>, mut s: TcpStream, from: SocketAddr) -> std::io::Result<()> {
    let IpAddr::V4(src) = from.ip() else {
        return Ok(());
    };
    let Some((id, policy)) = eg.policy_of(src) else {
        return Ok(());
    };
    let dst: SocketAddrV4 = dsec_sys::net::original_dst(&s)?;
    if dst.ip() == &eg.table.gateway {
        return Ok(()); // addressed to the relay itself: nothing to relay to
    }
    let mut head = Vec::with_capacity(2048);
    let name = tokio::time::timeout(HEAD_TIMEOUT, async {
        let mut buf = [0u8; 4096];
        loop {
            match parse_head(&head) {
                Head::Partial => {}
                Head::Tls(n) | Head::Http(n) => return n,
                Head::Other => return None,
            }
            let n = s.read(&mut buf).await.ok()?;
            if n == 0 || head.len() + n > MAX_HEAD {
                return None;
            }
            head.extend_from_slice(&buf[..n]);
        }
    })
    .await
    .ok()
    .flatten();
    let allowed = name
        .as_deref()
        .is_some_and(|n| match name_verdict(&policy, n) {
            NameVerdict::Pin(ports) => ports
                .iter()
                .any(|&(a, b)| a <= dst.port() && dst.port() <= b),
            NameVerdict::Open => true,
            NameVerdict::Deny => false,
        });
    if !allowed {
        let what = match &name {
            Some(n) => format!("{n} at {dst}"),
            None => format!("{dst} (no server name)"),
        };
        eg.denied(&id, &what);
        return Ok(());
    }
    let mut up = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(SocketAddr::V4(dst)))
        .await
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
    let _ = up.set_nodelay(true);
    let _ = s.set_nodelay(true);
    tokio::io::AsyncWriteExt::write_all(&mut up, &head).await?;
    tokio::io::copy_bidirectional_with_sizes(&mut s, &mut up, 64 * 1024, 64 * 1024).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal ClientHello with `sni` (or none).
    fn hello(sni: Option<&str>) -> Vec<u8> {
        let mut body = vec![0x03, 0x03];
        body.extend_from_slice(&[7u8; 32]);
        body.push(0); // session id
        body.extend_from_slice(&[0, 2, 0x13, 0x01]); // one suite
        body.extend_from_slice(&[1, 0]); // null compression
        let mut ext = Vec::new();
        if let Some(n) = sni {
            let n = n.as_bytes();
            let mut list = vec![0u8];
            list.extend_from_slice(&(n.len() as u16).to_be_bytes());
            list.extend_from_slice(n);
            let mut e = (list.len() as u16).to_be_bytes().to_vec();
            e.extend_from_slice(&list);
            ext.extend_from_slice(&[0, 0]);
            ext.extend_from_slice(&(e.len() as u16).to_be_bytes());
            ext.extend_from_slice(&e);
        }
        ext.splice(0..0, [0x00, 0x2b, 0, 3, 2, 3, 4]); // supported_versions first
        body.extend_from_slice(&(ext.len() as u16).to_be_bytes());
        body.extend_from_slice(&ext);
        let mut hs = vec![1u8, 0, 0, 0];
        hs[1..4].copy_from_slice(&(body.len() as u32).to_be_bytes()[1..]);
        hs.extend_from_slice(&body);
        let mut rec = vec![0x16, 3, 1];
        rec.extend_from_slice(&(hs.len() as u16).to_be_bytes());
        rec.extend_from_slice(&hs);
        rec
    }

    #[test]
    fn tls_server_names() {
        let h = hello(Some("PyPI.test"));
        assert_eq!(parse_head(&h), Head::Tls(Some("pypi.test".into())));
        assert_eq!(parse_head(&hello(None)), Head::Tls(None));
        for n in 0..h.len() {
            assert_eq!(parse_head(&h[..n]), Head::Partial, "a prefix of {n} bytes");
        }
        let mut bad = h.clone();
        let last = bad.len() - 3;
        bad[last] = b'/';
        assert_eq!(parse_head(&bad), Head::Other);
    }

    #[test]
    fn http_hosts() {
        let p = |s: &str| parse_head(s.as_bytes());
        assert_eq!(
            p("GET / HTTP/1.1\r\nHost: PyPI.test:8080\r\n\r\n"),
            Head::Http(Some("pypi.test".into()))
        );
        assert_eq!(p("GET / HTTP/1.0\r\nAccept: */*\r\n\r\n"), Head::Http(None));
        assert_eq!(p("GET / HTTP/1.1\r\nHost: a.test\r\n"), Head::Partial);
        assert_eq!(
            p("GET / HTTP/1.1\r\nHost: a.test\r\nHost: b.test\r\n\r\n"),
            Head::Other
        );
        assert_eq!(p("GET / HTTP/1.1\r\nHost: a test\r\n\r\n"), Head::Other);
        assert_eq!(p("SSH-2.0-OpenSSH\r\n"), Head::Partial);
        assert_eq!(parse_head(b"\x00\x01"), Head::Other);
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(b in proptest::collection::vec(proptest::num::u8::ANY, 0..600)) {
            let _ = parse_head(&b);
            let mut t = vec![0x16, 3, 1];
            t.extend_from_slice(&b);
            let _ = parse_head(&t);
        }
    }
}
