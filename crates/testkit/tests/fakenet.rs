//! The fake internet of the egress tests, from the host: its DNS (UDP and TCP, answers changed
//! at run time), its web servers (HTTP and HTTPS), its package index (a wheel pip downloads and
//! installs), two at once, and nothing of it left after drop.
//!
//! Needs root and `ip`, `python3` (with pip), `openssl` and `curl`.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use dsec_testkit::fakenet::{FakeNet, WHEEL};
use dsec_testkit::RemoveOnDrop;
use serde_json::Value;

const TIMEOUT: Duration = Duration::from_secs(10);
const A: u16 = 1;
const AAAA: u16 = 28;
const NOERROR: u8 = 0;
const NXDOMAIN: u8 = 3;

/// A DNS query of `name`, type `qtype`, id `id`, recursion desired.
fn query(id: u16, name: &str, qtype: u16) -> Vec<u8> {
    let mut q = Vec::new();
    q.extend_from_slice(&id.to_be_bytes());
    q.extend_from_slice(&0x0100u16.to_be_bytes()); // RD
    q.extend_from_slice(&1u16.to_be_bytes()); // one question
    q.extend_from_slice(&[0; 6]); // no answers, authorities, additionals
    for label in name.split('.') {
        q.push(u8::try_from(label.len()).expect("a short label"));
        q.extend_from_slice(label.as_bytes());
    }
    q.push(0);
    q.extend_from_slice(&qtype.to_be_bytes());
    q.extend_from_slice(&1u16.to_be_bytes()); // IN
    q
}

/// Skips the name at `pos` of `msg` (labels, ending in a zero or a pointer).
fn skip_name(msg: &[u8], mut pos: usize) -> usize {
    loop {
        let len = msg[pos];
        if len & 0xC0 == 0xC0 {
            return pos + 2;
        }
        pos += 1;
        if len == 0 {
            return pos;
        }
        pos += usize::from(len);
    }
}

fn u16_at(msg: &[u8], pos: usize) -> u16 {
    u16::from_be_bytes([msg[pos], msg[pos + 1]])
}

/// (rcode, the A records' addresses and their TTLs) of the answer `msg` to query `id`.
fn parse_answer(id: u16, msg: &[u8]) -> (u8, Vec<(Ipv4Addr, u32)>) {
    assert!(msg.len() >= 12, "short answer: {msg:?}");
    assert_eq!(u16_at(msg, 0), id, "the answer's id");
    let flags = u16_at(msg, 2);
    assert!(flags & 0x8000 != 0, "QR set");
    assert_eq!(u16_at(msg, 4), 1, "the question echoed");
    let rcode = u8::try_from(flags & 0xF).expect("a nibble");
    let answers = u16_at(msg, 6);
    let mut pos = skip_name(msg, 12) + 4;
    let mut addrs = Vec::new();
    for _ in 0..answers {
        pos = skip_name(msg, pos);
        let rtype = u16_at(msg, pos);
        let ttl = u32::from_be_bytes(msg[pos + 4..pos + 8].try_into().expect("4 bytes"));
        let len = usize::from(u16_at(msg, pos + 8));
        pos += 10;
        if rtype == A {
            assert_eq!(len, 4);
            addrs.push((
                Ipv4Addr::new(msg[pos], msg[pos + 1], msg[pos + 2], msg[pos + 3]),
                ttl,
            ));
        }
        pos += len;
    }
    (rcode, addrs)
}

/// Asks `dns` over UDP.
fn resolve_udp(dns: SocketAddr, name: &str, qtype: u16) -> (u8, Vec<Ipv4Addr>) {
    let sock = UdpSocket::bind("0.0.0.0:0").expect("udp socket");
    sock.set_read_timeout(Some(TIMEOUT)).expect("timeout");
    let id = 0x5eed;
    sock.send_to(&query(id, name, qtype), dns)
        .expect("send query");
    let mut buf = [0u8; 1500];
    let (len, from) = sock.recv_from(&mut buf).expect("a DNS answer");
    assert_eq!(from, dns, "answered from the server's address");
    let (rcode, addrs) = parse_answer(id, &buf[..len]);
    for (_, ttl) in &addrs {
        assert_eq!(*ttl, 5, "TTL");
    }
    (rcode, addrs.into_iter().map(|(a, _)| a).collect())
}

/// Asks `dns` over TCP (two queries on one connection).
fn resolve_tcp(dns: SocketAddr, name: &str) -> (u8, Vec<Ipv4Addr>) {
    let mut conn = TcpStream::connect_timeout(&dns, TIMEOUT).expect("DNS over TCP");
    conn.set_read_timeout(Some(TIMEOUT)).expect("timeout");
    let mut last = None;
    for id in [1u16, 2] {
        let q = query(id, name, A);
        let len = u16::try_from(q.len()).expect("short").to_be_bytes();
        conn.write_all(&[&len[..], &q].concat())
            .expect("send query");
        let mut len = [0u8; 2];
        conn.read_exact(&mut len).expect("answer length");
        let mut msg = vec![0u8; usize::from(u16::from_be_bytes(len))];
        conn.read_exact(&mut msg).expect("answer");
        let (rcode, addrs) = parse_answer(id, &msg);
        last = Some((rcode, addrs.into_iter().map(|(a, _)| a).collect()));
    }
    last.expect("two answers")
}

/// `GET path` over HTTP/1.0 from `addr:80` with `Host: host`: (status line, body).
fn http_get(addr: Ipv4Addr, host: &str, path: &str) -> (String, Vec<u8>) {
    let to = SocketAddr::from((addr, 80));
    let mut conn = TcpStream::connect_timeout(&to, TIMEOUT).expect("connect to the web server");
    conn.set_read_timeout(Some(TIMEOUT)).expect("timeout");
    write!(conn, "GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n").expect("send request");
    let mut reply = Vec::new();
    conn.read_to_end(&mut reply).expect("read the answer");
    let end = reply
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("the end of the headers");
    let head = String::from_utf8_lossy(&reply[..end]).into_owned();
    let status = head.lines().next().unwrap_or_default().to_owned();
    let length: usize = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        })
        .expect("a Content-Length");
    let body = reply[end + 4..].to_vec();
    assert_eq!(body.len(), length, "the body is as long as said");
    (status, body)
}

fn json(body: &[u8]) -> Value {
    serde_json::from_slice(body).expect("JSON")
}

/// Runs a command, failing the test with its output unless it succeeds.
fn run(cmd: &mut Command) -> Output {
    // Nothing in these tests may go to a real outside address through a proxy or a configured
    // package index.
    for var in [
        "http_proxy",
        "https_proxy",
        "all_proxy",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
    ] {
        cmd.env_remove(var);
    }
    cmd.env("PIP_CONFIG_FILE", "/dev/null");
    let out = cmd.output().expect("run a command");
    assert!(
        out.status.success(),
        "{cmd:?}: {}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn curl_https(net: &FakeNet, name: &str, addr: Ipv4Addr) -> Value {
    let out = run(Command::new("curl")
        .args([
            "-sS",
            "--fail",
            "--max-time",
            "10",
            "--noproxy",
            "*",
            "--cacert",
        ])
        .arg(net.ca_pem())
        .arg("--resolve")
        .arg(format!("{name}:443:{addr}"))
        .arg(format!("https://{name}/whoami")));
    json(&out.stdout)
}

fn temp_dir(tag: &str) -> (PathBuf, RemoveOnDrop) {
    let dir = std::env::temp_dir().join(format!("dsec-fakenet-test-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create a temp dir");
    (dir.clone(), RemoveOnDrop(dir))
}

/// What is left of a dropped fixture: the netns, the link, the dir, the server process.
fn leftovers(ns: &str, host_if: &str, dir: &Path, server_pid: &str) -> Vec<String> {
    let mut left = Vec::new();
    let list = run(Command::new("ip").args(["netns", "list"]));
    if String::from_utf8_lossy(&list.stdout)
        .lines()
        .any(|l| l.split_whitespace().next() == Some(ns))
    {
        left.push(format!("netns {ns}"));
    }
    let links = run(Command::new("ip").args(["-o", "link", "show"]));
    if String::from_utf8_lossy(&links.stdout)
        .lines()
        .any(|l| l.split(": ").nth(1).and_then(|n| n.split('@').next()) == Some(host_if))
    {
        left.push(format!("link {host_if}"));
    }
    if dir.exists() {
        left.push(format!("dir {}", dir.display()));
    }
    if Path::new("/proc").join(server_pid).exists() {
        left.push(format!("server process {server_pid}"));
    }
    left
}

fn server_pid(net: &FakeNet) -> String {
    std::fs::read_to_string(net.dir.join("ready"))
        .expect("the ready file")
        .trim()
        .to_owned()
}

#[test]
fn dns_web_tls_and_package_index() {
    let net = FakeNet::start().expect("start the fake internet");
    eprintln!(
        "fakenet: n {}, ns {}, link {}, dir {}",
        net.n,
        net.ns,
        net.host_if,
        net.dir.display()
    );
    let (web, other, dns) = (net.web(), net.other(), net.dns());
    assert_eq!(web, Ipv4Addr::new(198, 18, net.n, 2));
    assert_eq!(other, Ipv4Addr::new(198, 18, net.n, 3));
    assert_eq!(dns, SocketAddr::from(([198, 18, net.n, 53], 53)));
    assert_eq!(net.subnet(), (Ipv4Addr::new(198, 18, net.n, 0), 24));
    assert_eq!(net.ns, format!("dsecfake-{}", net.n));
    assert_eq!(net.host_if, format!("dsf-{}", net.n));
    assert_eq!(net.wheel_index(), "http://pypi.test/simple/");

    // DNS: the zone at start, over UDP and TCP; AAAA has no records; unknown names do not exist.
    assert_eq!(resolve_udp(dns, "pypi.test", A), (NOERROR, vec![web]));
    assert_eq!(resolve_udp(dns, "PyPI.Test", A), (NOERROR, vec![web]));
    assert_eq!(
        resolve_udp(dns, "files.pythonhosted.test", A),
        (NOERROR, vec![web])
    );
    assert_eq!(resolve_udp(dns, "github.test", A), (NOERROR, vec![other]));
    assert_eq!(resolve_udp(dns, "evil.test", A), (NOERROR, vec![other]));
    assert_eq!(resolve_udp(dns, "rebind.test", A), (NOERROR, vec![web]));
    assert_eq!(resolve_udp(dns, "pypi.test", AAAA), (NOERROR, vec![]));
    assert_eq!(resolve_udp(dns, "nowhere.test", A), (NXDOMAIN, vec![]));
    assert_eq!(resolve_tcp(dns, "other.test"), (NOERROR, vec![other]));

    // A name changes its answer at run time (DNS rebinding), to one or more addresses, and goes.
    net.set_name("rebind.test", &[Ipv4Addr::new(10, 0, 0, 1)])
        .expect("set_name");
    assert_eq!(
        resolve_udp(dns, "rebind.test", A),
        (NOERROR, vec![Ipv4Addr::new(10, 0, 0, 1)])
    );
    let both = [Ipv4Addr::new(169, 254, 169, 254), web];
    net.set_name("rebind.test", &both).expect("set_name");
    assert_eq!(resolve_udp(dns, "rebind.test", A), (NOERROR, both.to_vec()));
    assert_eq!(resolve_tcp(dns, "rebind.test"), (NOERROR, both.to_vec()));
    net.set_name("new.test", &[other]).expect("set_name");
    assert_eq!(resolve_udp(dns, "new.test", A), (NOERROR, vec![other]));
    net.remove_name("new.test").expect("remove_name");
    assert_eq!(resolve_udp(dns, "new.test", A), (NXDOMAIN, vec![]));
    assert_eq!(resolve_udp(dns, "pypi.test", A), (NOERROR, vec![web]));

    // HTTP: who answered whom, on both addresses.
    let (status, body) = http_get(web, "pypi.test", "/whoami");
    assert!(status.contains(" 200 "), "{status}");
    let who = json(&body);
    assert_eq!(who["server"], web.to_string(), "{who}");
    assert_eq!(who["host"], "pypi.test", "{who}");
    assert_eq!(who["client"], net.gateway().to_string(), "{who}");
    assert_eq!(who["scheme"], "http", "{who}");
    let who = json(&http_get(other, "github.test", "/whoami").1);
    assert_eq!(who["server"], other.to_string(), "{who}");
    assert_eq!(who["host"], "github.test", "{who}");
    let (status, _) = http_get(web, "pypi.test", "/nothing");
    assert!(status.contains(" 404 "), "{status}");

    // Bytes for throughput.
    let (status, body) = http_get(web, "pypi.test", "/bytes/1000000");
    assert!(status.contains(" 200 "), "{status}");
    assert_eq!(body.len(), 1_000_000);
    assert_eq!(http_get(web, "pypi.test", "/bytes/0").1.len(), 0);

    // HTTPS with the fixture's CA, for the certificate's names.
    let who = curl_https(&net, "pypi.test", web);
    assert_eq!(who["server"], web.to_string(), "{who}");
    assert_eq!(who["host"], "pypi.test", "{who}");
    assert_eq!(who["scheme"], "https", "{who}");
    let who = curl_https(&net, "files.pythonhosted.test", web);
    assert_eq!(who["host"], "files.pythonhosted.test", "{who}");
    let who = curl_https(&net, "evil.test", other);
    assert_eq!(who["server"], other.to_string(), "{who}");
    // A name the certificate does not hold is refused.
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "10", "--noproxy", "*", "--cacert"])
        .arg(net.ca_pem())
        .args(["--resolve", &format!("unlisted.test:443:{web}")])
        .arg("https://unlisted.test/whoami")
        .output()
        .expect("curl");
    assert!(!out.status.success(), "a name outside the certificate");

    // The package index: pip downloads the wheel, and installs it (so it is a valid one).
    let (dl, _dl_guard) = temp_dir("dl");
    let (target, _target_guard) = temp_dir("target");
    let pip = |args: &[&str]| {
        run(Command::new("python3")
            .args([
                "-m",
                "pip",
                "--isolated",
                "--disable-pip-version-check",
                "--no-cache-dir",
                "--no-input",
            ])
            .args(args))
    };
    let index = format!("http://{web}/simple/");
    let dl_str = dl.to_str().expect("utf-8 path");
    pip(&[
        "download",
        "--no-deps",
        "--index-url",
        &index,
        "--trusted-host",
        &web.to_string(),
        "dsecprobe",
        "-d",
        dl_str,
    ]);
    let wheel = dl.join(WHEEL);
    assert!(wheel.exists(), "{} downloaded", wheel.display());
    pip(&[
        "install",
        "--no-deps",
        "--no-index",
        "--target",
        target.to_str().expect("utf-8 path"),
        wheel.to_str().expect("utf-8 path"),
    ]);
    let out = run(Command::new("python3")
        .args(["-c", "import dsecprobe; print(dsecprobe.VALUE)"])
        .env("PYTHONPATH", &target));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "42");
    assert!(target.join("dsecprobe-1.0.dist-info/RECORD").exists());

    // Nothing left after drop.
    let (ns, host_if, dir, pid) = (
        net.ns.clone(),
        net.host_if.clone(),
        net.dir.clone(),
        server_pid(&net),
    );
    drop(net);
    let left = leftovers(&ns, &host_if, &dir, &pid);
    assert!(left.is_empty(), "left behind: {left:?}");
}

#[test]
fn two_at_once_then_nothing_left() {
    let a = FakeNet::start().expect("start one fake internet");
    let b = FakeNet::start().expect("start another");
    assert_ne!(a.n, b.n, "two live fixtures share n");
    assert_ne!(a.ns, b.ns);
    assert_ne!(a.dir, b.dir);
    for net in [&a, &b] {
        assert_eq!(
            resolve_udp(net.dns(), "pypi.test", A),
            (NOERROR, vec![net.web()])
        );
        let who = json(&http_get(net.web(), "pypi.test", "/whoami").1);
        assert_eq!(who["server"], net.web().to_string(), "{who}");
    }
    // One's zone is not the other's.
    a.set_name("pypi.test", &[a.other()]).expect("set_name");
    assert_eq!(
        resolve_udp(a.dns(), "pypi.test", A),
        (NOERROR, vec![a.other()])
    );
    assert_eq!(
        resolve_udp(b.dns(), "pypi.test", A),
        (NOERROR, vec![b.web()])
    );
    let gone: Vec<_> = [a, b]
        .map(|net| {
            (
                net.ns.clone(),
                net.host_if.clone(),
                net.dir.clone(),
                server_pid(&net),
            )
        })
        .into_iter()
        .collect();
    for (ns, host_if, dir, pid) in &gone {
        let left = leftovers(ns, host_if, dir, pid);
        assert!(left.is_empty(), "left behind: {left:?}");
    }
}
