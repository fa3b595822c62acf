//! The node's DNS for sandboxes with egress: every query a sandbox sends to port 53, to any
//! address, is redirected here by the kernel (`dns` chain). A name the sandbox's policy does
//! not allow is refused; an allowed one is resolved upstream, its IPv4 answers checked (no
//! rebinding onto private space) and pinned for the sandbox before the answer is handed over.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, UdpSocket};

use super::wire::{self, qtype, rcode, Query};
use super::Egress;

/// How long the upstream resolver has to answer (twice over UDP, then the sandbox's own
/// resolver retries).
const UPSTREAM_TIMEOUT: Duration = Duration::from_millis(1500);
/// Queries answered at once, all sandboxes together (more wait).
const IN_FLIGHT: usize = 256;
/// How long a TCP client may take to send its query.
const TCP_IDLE: Duration = Duration::from_secs(5);

/// Serves UDP queries on `sock` until the node stops.
pub(super) async fn serve_udp(eg: Arc<Egress>, sock: UdpSocket) {
    let sock = Arc::new(sock);
    let slots = Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT));
    let mut buf = vec![0u8; wire::MAX_MESSAGE];
    loop {
        let (n, from) = match sock.recv_from(&mut buf).await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(error = %e, "egress dns: receive failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let Ok(permit) = Arc::clone(&slots).try_acquire_owned() else {
            eg.stats.dns_dropped.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        let (eg, sock, msg) = (Arc::clone(&eg), Arc::clone(&sock), buf[..n].to_vec());
        tokio::spawn(async move {
            if let Some(answer) = answer(&eg, from, &msg).await {
                let _ = sock.send_to(&answer, from).await;
            }
            drop(permit);
        });
    }
}

/// Serves TCP queries (RFC 7766: two-byte length, then the message) on `l`.
pub(super) async fn serve_tcp(eg: Arc<Egress>, l: TcpListener) {
    super::proxy::accept_each(eg, l, IN_FLIGHT, |eg, mut s, from| async move {
        // One query per connection is enough for resolvers' TCP fallback.
        let read = async {
            let len = s.read_u16().await? as usize;
            if len == 0 || len > wire::MAX_MESSAGE {
                return Err(std::io::Error::other("bad length"));
            }
            let mut msg = vec![0u8; len];
            s.read_exact(&mut msg).await?;
            Ok::<_, std::io::Error>(msg)
        };
        if let Ok(Ok(msg)) = tokio::time::timeout(TCP_IDLE, read).await {
            if let Some(a) = answer(&eg, from, &msg).await {
                let mut out = Vec::with_capacity(a.len() + 2);
                out.extend_from_slice(&(a.len() as u16).to_be_bytes());
                out.extend_from_slice(&a);
                let _ = s.write_all(&out).await;
            }
        }
    })
    .await;
}

/// The answer to `msg` from `from`, or `None` to stay silent (not a sandbox of ours, not a
/// query).
async fn answer(eg: &Arc<Egress>, from: SocketAddr, msg: &[u8]) -> Option<Vec<u8>> {
    let IpAddr::V4(src) = from.ip() else {
        return None;
    };
    let q = wire::parse_query(msg).ok()?;
    eg.stats.dns_queries.fetch_add(1, Ordering::Relaxed);
    let (id, policy) = eg.policy_of(src)?;
    let verdict = super::policy::name_verdict(&policy, &q.name);
    let pin = match verdict {
        super::policy::NameVerdict::Deny => {
            eg.denied(&id, &q.name);
            return Some(wire::respond(msg, &q, rcode::REFUSED));
        }
        super::policy::NameVerdict::Pin(ports) => Some(ports),
        super::policy::NameVerdict::Open => None,
    };
    // Sandboxes have IPv4 only: AAAA answers nothing, so resolvers go to A at once.
    if q.qtype == qtype::AAAA {
        return Some(wire::respond(msg, &q, rcode::NOERROR));
    }
    let resp = match upstream(eg.upstream, msg, &q).await {
        Some(r) => r,
        None => return Some(wire::respond(msg, &q, rcode::SERVFAIL)),
    };
    let Ok(parsed) = wire::parse_answer(&resp, &q) else {
        return Some(wire::respond(msg, &q, rcode::SERVFAIL));
    };
    // No rebinding: an answer naming an address the sandbox may never reach (or private space
    // its rules do not list) is refused whole.
    let never = eg.never_nets();
    if let Some((bad, _)) = parsed
        .a
        .iter()
        .find(|(a, _)| !super::policy::answer_allowed(&policy, &never, *a))
    {
        eg.denied(&id, &format!("{} -> {bad}", q.name));
        return Some(wire::respond(msg, &q, rcode::REFUSED));
    }
    if let Some(ports) = pin {
        let addrs: Vec<Ipv4Addr> = parsed.a.iter().map(|(a, _)| *a).collect();
        if !addrs.is_empty() {
            let (eg2, id2, name) = (Arc::clone(eg), id.clone(), q.name.clone());
            let pinned = tokio::task::spawn_blocking(move || eg2.pin(&id2, &name, &addrs, &ports))
                .await
                .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
            if let Err(e) = pinned {
                tracing::warn!(sandbox = %id, name = %q.name, error = %e, "egress: pin failed");
                return Some(wire::respond(msg, &q, rcode::SERVFAIL));
            }
        }
    }
    Some(resp)
}

/// Asks the upstream resolver (its id replaced by ours, put back in the answer).
async fn upstream(to: SocketAddr, msg: &[u8], q: &Query) -> Option<Vec<u8>> {
    let sock = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).await.ok()?;
    sock.connect(to).await.ok()?;
    let mut out = msg.to_vec();
    let ours: u16 = rand_id();
    wire::set_id(&mut out, ours);
    let mut buf = vec![0u8; wire::MAX_MESSAGE];
    for _ in 0..2 {
        sock.send(&out).await.ok()?;
        let deadline = tokio::time::Instant::now() + UPSTREAM_TIMEOUT;
        loop {
            match tokio::time::timeout_at(deadline, sock.recv(&mut buf)).await {
                Ok(Ok(n)) if n >= 12 && buf[..2] == ours.to_be_bytes() => {
                    let mut r = buf[..n].to_vec();
                    wire::set_id(&mut r, q.id);
                    return Some(r);
                }
                Ok(Ok(_)) => continue,
                Ok(Err(_)) => return None,
                Err(_) => break,
            }
        }
    }
    None
}

fn rand_id() -> u16 {
    let mut b = [0u8; 2];
    let _ = getrandom::fill(&mut b);
    u16::from_be_bytes(b)
}
