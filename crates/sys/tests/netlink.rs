//! Integration tests of `dsec_sys::netlink` against the real kernel. Run as root; never
//! skipped.
//!
//! - rtnetlink: a veth pair between the host and a fresh network namespace (a `unshare -n
//!   sleep` process), addresses, a host route and an onlink default route in the namespace,
//!   then a TCP connection from the namespace to the host side; counters, listing, deletion,
//!   typed errors; and the time of a sandbox's whole setup.
//! - nftables: a table of its own made with the `nft` binary, sets of the shapes the node
//!   uses; elements added (single, range, with timeout), re-added, listed, deleted.
//!
//! Everything made is removed by `Drop` guards, also when an assertion fails.

use std::io::{ErrorKind, Read};
use std::net::{Ipv4Addr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dsec_sys::netlink::errno;
use dsec_sys::netlink::nft::{concat, ipv4, port, Element, Nft};
use dsec_sys::netlink::route::Route;

/// A number unlike those of other tests and runs.
fn unique() -> u32 {
    static N: AtomicU32 = AtomicU32::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let mut x =
        nanos ^ std::process::id().rotate_left(16) ^ N.fetch_add(1, Ordering::Relaxed) << 24;
    x ^= x >> 15;
    x = x.wrapping_mul(0x2c1b_3c6d);
    x ^ (x >> 12)
}

/// A process in a network namespace of its own, and the host links to delete; killed and
/// deleted when dropped.
struct Netns {
    child: Child,
    links: Vec<String>,
}

impl Netns {
    fn new() -> Netns {
        let child = Command::new("unshare")
            .args(["-n", "sleep", "30"])
            .spawn()
            .expect("spawn unshare");
        let ns = Netns {
            child,
            links: vec![],
        };
        let own = std::fs::read_link("/proc/self/ns/net").expect("own netns");
        let deadline = Instant::now() + Duration::from_secs(5);
        while std::fs::read_link(format!("/proc/{}/ns/net", ns.pid()))
            .ok()
            .as_ref()
            == Some(&own)
        {
            assert!(
                Instant::now() < deadline,
                "unshare did not make its namespace"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        ns
    }

    fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).expect("pid")
    }

    /// Runs a command in the namespace; returns whether it succeeded and its output.
    fn run(&self, cmd: &[&str]) -> (bool, String) {
        let pid = self.pid().to_string();
        let out = Command::new("nsenter")
            .args(["-t", &pid, "-n", "--"])
            .args(cmd)
            .stderr(Stdio::inherit())
            .output()
            .expect("nsenter");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if let Ok(mut r) = Route::open() {
            for l in &self.links {
                let _ = r.del_link(l);
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Host `10.250.x.y` and peer `10.250.x.y+1`.
fn addresses() -> (Ipv4Addr, Ipv4Addr) {
    let r = unique();
    let x = (r >> 8) as u8;
    let y = (r % 60) as u8 * 4 + 1;
    (
        Ipv4Addr::new(10, 250, x, y),
        Ipv4Addr::new(10, 250, x, y + 1),
    )
}

/// A sandbox's setup, as the node does it.
fn setup(
    r: &mut Route,
    veth: &str,
    pid: i32,
    host: Ipv4Addr,
    peer: Ipv4Addr,
) -> std::io::Result<()> {
    let peer_index = r.add_veth(veth, "eth0", pid)?;
    r.add_addr4(veth, host, 32)?;
    r.set_up(veth)?;
    r.add_route4(peer, 32, None, veth, false)?;
    let mut inside = Route::open_in(pid)?;
    // The new link's echo names the peer's index there: no lookup needed.
    let looked_up = inside.index("eth0")?;
    assert!(
        peer_index.is_some() && peer_index == looked_up,
        "{peer_index:?} vs {looked_up:?}"
    );
    if let Some(i) = peer_index {
        inside.remember("eth0", i);
    }
    inside.add_addr4("eth0", peer, 32)?;
    inside.set_up("eth0")?;
    inside.add_route4(Ipv4Addr::UNSPECIFIED, 0, Some(host), "eth0", true)
}

#[test]
fn veth_addresses_routes_and_a_connection() {
    let mut ns = Netns::new();
    let veth = format!("dst{:08x}", unique());
    ns.links.push(veth.clone());
    let (host, peer) = addresses();
    let mut r = Route::open().expect("open");
    setup(&mut r, &veth, ns.pid(), host, peer).expect("setup");

    let (_, routes) = ns.run(&["ip", "-4", "route", "show"]);
    assert!(
        routes.contains(&format!("default via {host} dev eth0 proto static onlink")),
        "{routes}"
    );
    let out = Command::new("ip")
        .args(["-4", "route", "show", "dev", &veth])
        .output()
        .expect("ip");
    let host_routes = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        host_routes.contains(&format!("{peer} proto static scope link")),
        "{host_routes}"
    );

    // A TCP connection from the namespace to the host side's address.
    let l = TcpListener::bind((host, 0)).expect("bind on the host side");
    let p = l.local_addr().expect("addr").port();
    let script = format!("echo hello >/dev/tcp/{host}/{p}");
    let (ok, _) = ns.run(&["timeout", "5", "bash", "-c", &script]);
    assert!(ok, "no connection from the namespace to {host}:{p}");
    let (mut s, from) = l.accept().expect("accept");
    assert_eq!(from.ip(), peer);
    let mut got = String::new();
    s.read_to_string(&mut got).expect("read");
    assert_eq!(got, "hello\n");

    assert!(r.links().expect("links").contains(&veth));
    assert!(r.index(&veth).expect("index").is_some());
    let (rx, tx) = r.link_stats(&veth).expect("stats").expect("the link");
    assert!(rx > 0 && tx > 0, "rx {rx} tx {tx}");
    let here = || std::fs::read_link("/proc/thread-self/ns/net").expect("this thread's netns");
    let before = here();
    let mut inside = Route::open_in(ns.pid()).expect("open_in");
    assert_eq!(
        here(),
        before,
        "the caller's thread came back to its namespace"
    );
    assert!(inside.links().expect("links").contains(&"eth0".to_string()));
    let (prx, ptx) = inside.link_stats("eth0").expect("stats").expect("eth0");
    assert_eq!((prx, ptx), (tx, rx), "the peer counts the other way round");
    // The dump of every link with the prefix sees the same link (counts only grow).
    let all = r.links_stats(&veth).expect("dump");
    let &(drx, dtx) = all.get(&veth).expect("the link in the dump");
    assert!(drx >= rx && dtx >= tx, "{all:?}");
    assert!(all.keys().all(|n| n.starts_with(&veth)));

    // Typed errors.
    let e = r.add_veth(&veth, "eth1", ns.pid()).expect_err("twice");
    assert_eq!(
        (e.kind(), errno(&e)),
        (ErrorKind::AlreadyExists, Some(libc::EEXIST)),
        "{e}"
    );
    assert!(e.to_string().contains(&veth), "{e}");
    let e = r.add_addr4(&veth, host, 32).expect_err("address twice");
    assert_eq!(errno(&e), Some(libc::EEXIST), "{e}");
    let e = Route::open_in(i32::MAX).expect_err("no such process");
    assert_eq!(e.kind(), ErrorKind::NotFound);

    assert!(r.del_link(&veth).expect("del"));
    assert!(!r.del_link(&veth).expect("del again"));
    assert!(!r.links().expect("links").contains(&veth));
    assert_eq!(r.link_stats(&veth).expect("stats"), None);
    assert!(!inside.links().expect("links").contains(&"eth0".to_string()));
    // The name is free again, and the stale index it had is not used.
    setup(&mut r, &veth, ns.pid(), host, peer).expect("setup again");
}

#[test]
fn setup_time() {
    let mut ns = Netns::new();
    let veth = format!("dsb{:08x}", unique());
    ns.links.push(veth.clone());
    let (host, peer) = addresses();
    let mut r = Route::open().expect("open");
    let (mut host_side, mut open, mut inside_side, mut veths) = (vec![], vec![], vec![], vec![]);
    for _ in 0..50 {
        let t0 = Instant::now();
        r.add_veth(&veth, "eth0", ns.pid()).expect("veth");
        veths.push(t0.elapsed());
        r.add_addr4(&veth, host, 32).expect("addr");
        r.set_up(&veth).expect("up");
        r.add_route4(peer, 32, None, &veth, false).expect("route");
        let t1 = Instant::now();
        let mut inside = Route::open_in(ns.pid()).expect("open_in");
        let t2 = Instant::now();
        inside.add_addr4("eth0", peer, 32).expect("addr");
        inside.set_up("eth0").expect("up");
        inside
            .add_route4(Ipv4Addr::UNSPECIFIED, 0, Some(host), "eth0", true)
            .expect("route");
        let t3 = Instant::now();
        host_side.push(t1 - t0);
        open.push(t2 - t1);
        inside_side.push(t3 - t2);
        assert!(r.del_link(&veth).expect("del"));
    }
    let median = |v: &mut Vec<Duration>| {
        v.sort();
        v[v.len() / 2].as_micros()
    };
    let (h, o, i) = (
        median(&mut host_side),
        median(&mut open),
        median(&mut inside_side),
    );
    let v = median(&mut veths);
    println!(
        "setup of a sandbox's veth, median of 50: host side {h} µs (add_veth {v} µs), \
         open_in {o} µs, inside {i} µs, total {} µs ({} µs without open_in)",
        h + o + i,
        h + i
    );
}

/// A table `inet dsec_nltest_…` made with the `nft` binary; deleted when dropped.
struct Table(String);

const SETS: &str = "
    set plain { type ipv4_addr; flags timeout; }
    set cat { type ipv4_addr . ipv4_addr . inet_service; flags interval, timeout; }
    set bind { type ifname . ipv4_addr; }
";

impl Table {
    fn new() -> Table {
        let t = Table(format!(
            "dsec_nltest_{}_{:08x}",
            std::process::id(),
            unique()
        ));
        nft_stdin(&format!("table inet {} {{ {SETS} }}", t.0));
        t
    }

    fn list(&self, set: &str) -> String {
        let out = Command::new("nft")
            .args(["list", "set", "inet", &self.0, set])
            .output()
            .expect("nft list");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

fn nft_stdin(script: &str) {
    use std::io::Write;
    let mut c = Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .spawn()
        .expect("nft");
    c.stdin
        .take()
        .expect("stdin")
        .write_all(script.as_bytes())
        .expect("write");
    assert!(
        c.wait().expect("wait").success(),
        "nft -f - failed on {script}"
    );
}

impl Drop for Table {
    fn drop(&mut self) {
        let _ = Command::new("nft")
            .args(["delete", "table", "inet", &self.0])
            .status();
    }
}

fn el(key: Vec<u8>, key_end: Option<Vec<u8>>, timeout_ms: Option<u64>) -> Element {
    Element {
        key,
        key_end,
        timeout_ms,
    }
}

fn v4(a: [u8; 4]) -> [u8; 4] {
    ipv4(Ipv4Addr::from(a))
}

#[test]
fn set_elements_single_range_timeout() {
    let t = Table::new();
    let mut n = Nft::open().expect("open");
    let plain = [
        el(v4([10, 0, 0, 1]).to_vec(), None, None),
        el(v4([10, 0, 0, 2]).to_vec(), None, Some(60_000)),
    ];
    n.add_elements(&t.0, "plain", &plain).expect("add plain");
    let l = t.list("plain");
    assert!(
        l.contains("10.0.0.1") && l.contains("10.0.0.2 timeout 1m"),
        "{l}"
    );

    let one = concat(&[&v4([10, 1, 0, 5]), &v4([1, 2, 3, 4]), &port(443)]);
    assert_eq!(one, [10, 1, 0, 5, 1, 2, 3, 4, 1, 0xbb, 0, 0]);
    let start = concat(&[&v4([10, 1, 0, 2]), &v4([198, 18, 0, 0]), &port(0)]);
    let end = concat(&[&v4([10, 1, 0, 2]), &v4([198, 18, 0, 255]), &port(65535)]);
    let cat = [
        el(one.clone(), Some(one.clone()), None),
        el(start.clone(), Some(end.clone()), Some(120_000)),
    ];
    n.add_elements(&t.0, "cat", &cat).expect("add cat");
    let l = t.list("cat");
    assert!(l.contains("10.1.0.5 . 1.2.3.4 . 443"), "{l}");
    assert!(
        l.contains("10.1.0.2 . 198.18.0.0/24 . 0-65535 timeout 2m"),
        "{l}"
    );

    let mut name = [0u8; 16];
    name[..4].copy_from_slice(b"dst1");
    let bind = [el(concat(&[&name, &v4([10, 1, 0, 7])]), None, None)];
    n.add_elements(&t.0, "bind", &bind).expect("add bind");
    let l = t.list("bind");
    assert!(l.contains("\"dst1\" . 10.1.0.7"), "{l}");

    // Re-adding is no error; a new timeout replaces the old one.
    let mut again = plain.clone();
    again[1].timeout_ms = Some(3_600_000);
    n.add_elements(&t.0, "plain", &again).expect("re-add plain");
    n.add_elements(&t.0, "cat", &cat).expect("re-add cat");
    n.add_elements(&t.0, "bind", &bind).expect("re-add bind");
    let l = t.list("plain");
    assert!(
        l.contains("10.0.0.2 timeout 1h"),
        "the timeout was not refreshed: {l}"
    );

    let listed = n.list_elements(&t.0, "cat").expect("list");
    assert_eq!(listed.len(), 2, "{listed:?}");
    assert!(listed
        .iter()
        .any(|e| e.key == one && e.key_end.as_ref() == Some(&one) && e.timeout_ms.is_none()));
    assert!(listed.iter().any(|e| e.key == start
        && e.key_end.as_ref() == Some(&end)
        && e.timeout_ms.is_some_and(|t| t > 100_000 && t <= 120_000)));
    assert_eq!(n.list_elements(&t.0, "bind").expect("list"), bind);

    // An overlapping range clashes.
    let half = concat(&[&v4([10, 1, 0, 2]), &v4([198, 18, 0, 127]), &port(65535)]);
    let e = n
        .add_elements(&t.0, "cat", &[el(start.clone(), Some(half), None)])
        .expect_err("clash");
    assert_eq!(errno(&e), Some(libc::EEXIST), "{e}");

    // Deleting: present ones go, missing ones are no error.
    let missing = el(v4([10, 0, 0, 9]).to_vec(), None, None);
    n.del_elements(&t.0, "plain", &[plain[0].clone(), missing.clone()])
        .expect("del plain");
    let l = t.list("plain");
    assert!(!l.contains("10.0.0.1") && l.contains("10.0.0.2"), "{l}");
    n.del_elements(&t.0, "cat", &cat[1..]).expect("del range");
    n.del_elements(&t.0, "cat", &cat).expect("del again");
    assert_eq!(n.list_elements(&t.0, "cat").expect("list"), vec![]);
    n.del_elements(&t.0, "bind", &bind).expect("del bind");
    assert!(!t.list("bind").contains("dst1"));

    let e = n
        .del_elements(&t.0, "nosuchset", std::slice::from_ref(&missing))
        .expect_err("no set");
    assert_eq!(errno(&e), Some(libc::ENOENT), "{e}");
    let e = n
        .add_elements("dsec_nltest_none", "plain", &[missing])
        .expect_err("no table");
    assert_eq!(errno(&e), Some(libc::ENOENT), "{e}");
}

#[test]
fn long_lists_are_split() {
    let t = Table::new();
    let mut n = Nft::open().expect("open");
    let elems: Vec<Element> = (0..20_000u32)
        .map(|i| {
            el(
                v4((0x0a64_0000 + i).to_be_bytes()).to_vec(),
                None,
                Some(600_000),
            )
        })
        .collect();
    let t0 = Instant::now();
    n.add_elements(&t.0, "plain", &elems).expect("add");
    let added = t0.elapsed();
    assert_eq!(
        n.list_elements(&t.0, "plain").expect("list").len(),
        elems.len()
    );
    n.add_elements(&t.0, "plain", &elems).expect("re-add");
    let t0 = Instant::now();
    n.del_elements(&t.0, "plain", &elems[..10_000])
        .expect("del half");
    let deleted = t0.elapsed();
    n.del_elements(&t.0, "plain", &elems)
        .expect("del all, half missing");
    assert_eq!(n.list_elements(&t.0, "plain").expect("list"), vec![]);
    println!("20000 elements added in {added:?}; 10000 deleted in {deleted:?}");
}

#[test]
fn several_sets_in_one_transaction() {
    let t = Table::new();
    let mut n = Nft::open().expect("open");
    let plain: Vec<Element> = (0..3000u32)
        .map(|i| el(v4((0x0a65_0000 + i).to_be_bytes()).to_vec(), None, None))
        .collect();
    let mut name = [0u8; 16];
    name[..4].copy_from_slice(b"dst2");
    let bind = [el(concat(&[&name, &v4([10, 1, 0, 8])]), None, None)];
    let none: &[Element] = &[];
    // A list too long for one batch, an empty one, then a set of its own: all of them in.
    n.add_to_sets(&t.0, &[("plain", &plain), ("cat", none), ("bind", &bind)])
        .expect("add");
    assert_eq!(n.list_elements(&t.0, "plain").expect("list").len(), 3000);
    assert_eq!(n.list_elements(&t.0, "bind").expect("list"), bind);

    // A refusal in a later set of a batch leaves the earlier sets of that batch as they were.
    let start = concat(&[&v4([10, 1, 0, 3]), &v4([198, 18, 0, 0]), &port(0)]);
    let end = concat(&[&v4([10, 1, 0, 3]), &v4([198, 18, 0, 255]), &port(65535)]);
    n.add_elements(&t.0, "cat", &[el(start.clone(), Some(end), None)])
        .expect("a range");
    let half = concat(&[&v4([10, 1, 0, 3]), &v4([198, 18, 0, 127]), &port(65535)]);
    let new_plain = [el(v4([10, 0, 0, 77]).to_vec(), None, None)];
    let clash = [el(start, Some(half), None)];
    let e = n
        .add_to_sets(&t.0, &[("plain", &new_plain), ("cat", &clash)])
        .expect_err("clash");
    assert_eq!(errno(&e), Some(libc::EEXIST), "{e}");
    assert!(!t.list("plain").contains("10.0.0.77"), "half applied");

    n.del_from_sets(&t.0, &[("plain", &plain), ("bind", &bind)])
        .expect("del");
    assert_eq!(n.list_elements(&t.0, "plain").expect("list"), vec![]);
    assert_eq!(n.list_elements(&t.0, "bind").expect("list"), vec![]);
    assert_eq!(n.list_elements(&t.0, "cat").expect("list").len(), 1);
}
