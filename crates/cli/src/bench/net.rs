//! `dsec bench net`: what network egress costs, each figure beside its peer in the same run.
//!
//! The bench starts a fake internet (`testkit::fakenet`, a network namespace of its own with a
//! DNS server and a Python web server) and a `dsec server` child whose egress resolves names
//! with that DNS, then measures:
//!
//! 1. create + exec `/bin/true` + delete with egress off (`{}`) and on (an allow list of one
//!    name), interleaved against the one daemon (`--pool-max 0`: both pay a cold create), and
//!    the daemon's own `dsec_egress_attach_seconds` histogram;
//! 2. HTTP GETs from a sandbox through the enforcement path (its veth, the node's forward and
//!    NAT rules) against the same `curl` run on the host, which reaches the fake internet
//!    directly: a large download's throughput, from the fake internet's Python server and from
//!    a `sendfile` server this bench starts beside it (so that the path, not a Python write
//!    loop, is what limits), and small requests on one keep-alive connection (to the
//!    `sendfile` server; a few to the Python one, whose answers wait out a delayed ACK);
//! 3. DNS lookups: the same raw UDP query loop in the sandbox (every packet to port 53 goes to
//!    the node's DNS, which forwards an allowed name upstream and pins its answer) and on the
//!    host straight to the fake DNS; the same in a sandbox with `"egress": "all"` (forwarded,
//!    not pinned: the difference is the pin); a refused name; `getaddrinfo` in the sandbox.
//!
//! Host and sandbox run the same binaries (`/usr/bin/curl`, `/usr/bin/python3`: the `host`
//! template is the host's root) with the same arguments, interleaved, their order alternating.

use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use dsec_testkit::fakenet::FakeNet;
use serde_json::{json, Map, Value};

use super::api::{start_daemon, Client, Daemon};
use super::{dist, emit, us, BenchArgs, Dist};

/// The issue's targets: egress-enabled create's extra p50, and throughput through the path
/// against the host's.
const TARGET_CREATE_EXTRA_MS: f64 = 1.0;
const TARGET_THROUGHPUT_RATIO: f64 = 0.8;
/// The phases of figure 1's loop, and the daemon's histogram of a path's attach time.
const PHASES: [&str; 4] = ["create", "exec_true", "delete", "loop"];
const ATTACH: &str = "dsec_egress_attach_seconds";
/// Bytes of one throughput download.
const DOWNLOAD: u64 = 256 << 20;
/// Bytes the `sendfile` server sends its answers from, over and over: few enough to stay in the
/// CPU's caches (a download-sized file would make the receiver's copy a cold read of memory,
/// slower than the fake internet's Python server, which writes one 64 KB buffer over and over).
const BLOB: u64 = 1 << 20;
/// The port of the `sendfile` server in the fake internet.
const FAST_PORT: u16 = 8080;
/// Loops of each kind run first and left out of the figures.
const WARMUP: usize = 5;
/// Bytes of one small answer.
const SMALL: u64 = 100;
/// The allowed and the refused name of the DNS figures.
const ALLOWED: &str = "pypi.test";
const REFUSED: &str = "github.test";
/// How long one command in a sandbox may run.
const EXEC_TIMEOUT_MS: u64 = 120_000;

/// A web server of its own: `GET /bytes/<n>` answered with `sendfile(2)` from a memfd of
/// [`BLOB`] bytes (no byte of a large answer passes through Python), a small answer in one write with `TCP_NODELAY`
/// (the fake internet's server writes headers and body apart, so each small answer on a
/// keep-alive connection waits ~40 ms for the client's delayed ACK), keep-alive, a thread per
/// connection. Prints `ready` once it listens; exits once its parent is gone.
const FAST_SERVER: &str = r#"
import os, socket, sys, threading, time
host, port, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
fd = os.memfd_create("dsec-bench-net")
chunk = bytes(1 << 20)
left = size
while left > 0:
    left -= os.write(fd, chunk[:min(left, len(chunk))])

def serve(conn):
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn:
        f = conn.makefile("rb")
        while True:
            line = f.readline()
            if not line:
                return
            while f.readline() not in (b"\r\n", b"\n", b""):
                pass
            parts = line.split()
            path = (parts[1] if len(parts) > 1 else b"").split(b"?")[0]
            if not path.startswith(b"/bytes/") or not path[7:].isdigit():
                conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                continue
            n = int(path[7:])
            head = (b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
                    b"Content-Length: %d\r\n\r\n" % n)
            if n <= len(chunk):
                conn.sendall(head + chunk[:n])  # one write: no wait on Nagle
                continue
            conn.sendall(head)
            while n > 0:
                k, off = min(n, size), 0
                while off < k:
                    off += os.sendfile(conn.fileno(), fd, off, k - off)
                n -= k

def watch(parent):
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)

threading.Thread(target=watch, args=(os.getppid(),), daemon=True).start()
srv = socket.create_server((host, port), backlog=64)
print("ready", flush=True)
while True:
    c, _ = srv.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"#;

/// `count` lookups of `name` (one line each: microseconds and the answer's rcode, or `-1` for
/// no answer within 3 s): `raw` sends an A query over UDP to `server`:53 and waits for its
/// answer; `gai` calls `getaddrinfo` (the system's resolver, IPv4 only).
const DNS_PROBE: &str = r#"
import socket, struct, sys, time
server, name, count, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect((server, 53))
s.settimeout(3)
qname = b"".join(bytes([len(l)]) + l.encode() for l in name.split(".")) + b"\0"
out = []
for i in range(count):
    qid = (i * 7919 + 17) & 0xFFFF
    msg = struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + qname + struct.pack("!HH", 1, 1)
    rcode = -1
    t = time.perf_counter_ns()
    if mode == "gai":
        try:
            socket.getaddrinfo(name, 80, socket.AF_INET, socket.SOCK_STREAM)
            rcode = 0
        except socket.gaierror:
            rcode = 5
    else:
        s.send(msg)
        try:
            while True:
                r = s.recv(4096)
                if r[:2] == msg[:2]:
                    rcode = r[3] & 0xF
                    break
        except socket.timeout:
            pass
    out.append("%d %d" % ((time.perf_counter_ns() - t) // 1000, rcode))
print("\n".join(out))
"#;

/// Where a command runs: on the host, or in the bench's sandbox through exec.
#[derive(Clone, Copy, PartialEq)]
enum Side {
    /// The host, straight to the fake internet.
    Host,
    /// The sandbox with an allow list (its allowed names' answers are pinned).
    Sandbox,
    /// A sandbox with `"egress": "all"` (names forwarded, nothing pinned).
    OpenSandbox,
}

/// The bench's state: the daemon's client and the sandboxes with egress of figures 2 and 3.
struct Net<'a> {
    c: Client,
    fake: &'a FakeNet,
    sandbox: String,
    /// A sandbox with `"egress": "all"` (the DNS figure's peer without pins).
    open: String,
}

impl Net<'_> {
    /// Runs `sh -c cmd` on `side`; answers its stdout (an error unless it exited 0).
    fn sh(&self, side: Side, cmd: &str) -> anyhow::Result<String> {
        match side {
            Side::Host => {
                let out = Command::new("/bin/sh")
                    .args(["-c", cmd])
                    .stdin(Stdio::null())
                    .output()
                    .context("sh")?;
                if !out.status.success() {
                    bail!(
                        "on the host: {cmd}: {}: {}",
                        out.status,
                        String::from_utf8_lossy(&out.stderr)
                    );
                }
                Ok(String::from_utf8_lossy(&out.stdout).into_owned())
            }
            Side::Sandbox => sandbox_sh(&self.c, &self.sandbox, cmd),
            Side::OpenSandbox => sandbox_sh(&self.c, &self.open, cmd),
        }
    }

    /// The two sides in the order of round `i` (alternating, so that drift is shared).
    fn sides(i: usize) -> [Side; 2] {
        if i.is_multiple_of(2) {
            [Side::Host, Side::Sandbox]
        } else {
            [Side::Sandbox, Side::Host]
        }
    }
}

/// Runs `sh -c cmd` in sandbox `id`; answers its stdout (an error unless it exited 0).
fn sandbox_sh(c: &Client, id: &str, cmd: &str) -> anyhow::Result<String> {
    let v = c.ok(
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(&json!({"shell": cmd, "timeout_ms": EXEC_TIMEOUT_MS, "output_limit": 8 << 20})),
    )?;
    let text = |k: &str| v[k]["data"].as_str().unwrap_or_default().to_owned();
    if v["exit_code"] != 0 {
        bail!(
            "in {id}: {cmd}: {} {}: {}",
            v["status"],
            v["exit_code"],
            text("stderr")
        );
    }
    Ok(text("stdout"))
}

/// `sh -c` quoting of one argument.
fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

fn ratio(a: f64, b: f64) -> f64 {
    a / if b == 0.0 { f64::MIN_POSITIVE } else { b }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// One create (`spec`) + exec `/bin/true` + delete: its phases' and the whole loop's
/// microseconds.
fn one_loop(c: &Client, spec: &Value) -> anyhow::Result<[u64; 4]> {
    let t = Instant::now();
    let v = c.ok("POST", "/v1/sandboxes", Some(spec))?;
    let create = us(t);
    let id = v["id"].as_str().context("id")?.to_owned();
    let te = Instant::now();
    let exec = c.exec_true(&id);
    let exec_us = us(te);
    let td = Instant::now();
    c.ok("DELETE", &format!("/v1/sandboxes/{id}"), None)?;
    let delete = us(td);
    exec?;
    Ok([create, exec_us, delete, us(t)])
}

/// `name_sum` and `name_count` of a Prometheus text exposition (labels summed over).
fn histogram_sum_count(metrics: &str, name: &str) -> (f64, f64) {
    let value = |suffix: &str| -> f64 {
        let key = format!("{name}_{suffix}");
        metrics
            .lines()
            .filter(|l| l.starts_with(&key) && l[key.len()..].starts_with([' ', '{']))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    (value("sum"), value("count"))
}

/// Figure 1: create + exec + delete with egress off and on, interleaved.
fn create_cost(d: &Daemon, c: &Client, args: &BenchArgs, n: usize) -> anyhow::Result<Value> {
    let specs = [
        json!({"labels": {"bench": "net"}}),
        json!({"labels": {"bench": "net"}, "network": {"egress": {"allow": [ALLOWED]}}}),
    ];
    let (h0_sum, h0_count) = histogram_sum_count(&d.http().text("/metrics"), ATTACH);
    let mut samples: [[Vec<u64>; 4]; 2] = Default::default();
    let mut errors = [0usize; 2];
    let mut first_error = None;
    for i in 0..WARMUP + n {
        let order = if i.is_multiple_of(2) { [0, 1] } else { [1, 0] };
        for k in order {
            std::thread::sleep(Duration::from_millis(args.settle_ms));
            match one_loop(c, &specs[k]) {
                Ok(l) if i >= WARMUP => {
                    for (s, x) in samples[k].iter_mut().zip(l) {
                        s.push(x);
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    errors[k] += 1;
                    first_error.get_or_insert_with(|| format!("{e:#}"));
                }
            }
        }
        if (i + 1) % 50 == 0 {
            eprintln!("bench net: create loops {} of {}", i + 1, WARMUP + n);
        }
    }
    let (h_sum, h_count) = histogram_sum_count(&d.http().text("/metrics"), ATTACH);
    let mut m = Map::new();
    let mut p50 = [[0u64; 4]; 2];
    for (k, name) in ["egress_off", "egress_on"].into_iter().enumerate() {
        let mut o = Map::new();
        for (j, phase) in PHASES.into_iter().enumerate() {
            let dd = dist(std::mem::take(&mut samples[k][j]));
            p50[k][j] = dd.p50_us;
            o.insert(phase.into(), json!(dd));
        }
        o.insert("errors".into(), json!(errors[k]));
        m.insert(name.into(), Value::Object(o));
    }
    let diff = |j: usize| ms(p50[1][j]) - ms(p50[0][j]);
    let count = h_count - h0_count;
    m.insert("first_error".into(), json!(first_error));
    for (j, phase) in PHASES.into_iter().enumerate() {
        m.insert(format!("{phase}_p50_diff_ms"), json!(diff(j)));
    }
    m.insert(
        "egress_attach_seconds".into(),
        json!({"sum": h_sum - h0_sum, "count": count,
               "mean_ms": 1000.0 * (h_sum - h0_sum) / count.max(1.0),
               "note": "the daemon's histogram over this figure's egress creates (warm-up included)"}),
    );
    Ok(Value::Object(m))
}

/// The `sendfile` server in the fake internet's namespace; killed when dropped.
struct FastServer(Child);

impl FastServer {
    fn start(fake: &FakeNet) -> anyhow::Result<Self> {
        let mut child = Command::new("ip")
            .args([
                "netns",
                "exec",
                &fake.ns,
                "/usr/bin/python3",
                "-c",
                FAST_SERVER,
            ])
            .args([
                fake.web().to_string(),
                FAST_PORT.to_string(),
                BLOB.to_string(),
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("ip netns exec python3")?;
        let out = child.stdout.take().context("stdout")?;
        let s = Self(child);
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(out), &mut line)?;
        if line.trim() != "ready" {
            bail!("the sendfile server did not start");
        }
        Ok(s)
    }
}

impl Drop for FastServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// CPU time (user + system, all threads, seconds) of process `pid` so far.
fn cpu_s(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, r)| r.split_whitespace().collect())
        .unwrap_or_default();
    // utime and stime are the 14th and 15th fields; the 3rd is the first after the name.
    let tick = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok());
    // In clock ticks of USER_HZ, 100 on x86 Linux (part of its ABI).
    (tick(11).unwrap_or(0.0) + tick(12).unwrap_or(0.0)) / 100.0
}

/// The fake internet's server process (its cmdline names `<dir>/fakenet.py`).
fn fakenet_pid(fake: &FakeNet) -> Option<u32> {
    let script = fake.dir.join("fakenet.py");
    let script = script.to_string_lossy();
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
        let cmd = String::from_utf8_lossy(&cmd);
        (cmd.contains("python") && cmd.contains(script.as_ref())).then_some(pid)
    })
}

/// The curl command of one throughput download of `url`: speed (bytes/s) and total seconds.
fn curl_download(url: &str) -> String {
    format!(
        "/usr/bin/curl -sS --noproxy '*' --max-time 100 -o /dev/null \
         -w '%{{speed_download}} %{{time_total}}\\n' {url}"
    )
}

/// Throughput of `reps` downloads of `url` per side, interleaved; `server` is the serving
/// process, whose CPU use per second of download says whether it, not the path, limits.
fn throughput(net: &Net, url: &str, reps: usize, server: Option<u32>) -> anyhow::Result<Value> {
    let cmd = curl_download(url);
    let mut mbps: [Vec<f64>; 2] = Default::default();
    let mut secs = [0f64; 2];
    let mut server_cpu = [0f64; 2];
    for i in 0..reps + 1 {
        for side in Net::sides(i) {
            let k = usize::from(side == Side::Sandbox);
            let cpu0 = server.map(cpu_s);
            let out = net.sh(side, &cmd)?;
            let mut it = out.split_whitespace().map(str::parse::<f64>);
            let (Some(Ok(speed)), Some(Ok(total))) = (it.next(), it.next()) else {
                bail!("curl: {out}");
            };
            if i == 0 {
                continue; // warm-up
            }
            mbps[k].push(speed / 1e6);
            secs[k] += total;
            if let (Some(pid), Some(c0)) = (server, cpu0) {
                server_cpu[k] += cpu_s(pid) - c0;
            }
        }
    }
    let [host, sandbox] = mbps;
    let side = |v: &Vec<f64>, k: usize| {
        json!({"mb_per_s": v, "median_mb_per_s": median(v.clone()),
               "server_cpu_per_download_s": server.map(|_| ratio(server_cpu[k], secs[k]))})
    };
    let r = ratio(median(sandbox.clone()), median(host.clone()));
    Ok(
        json!({"url": url, "bytes": DOWNLOAD, "downloads_per_side": reps,
              "host": side(&host, 0), "sandbox": side(&sandbox, 1),
              "ratio_sandbox_over_host": r}),
    )
}

/// Small requests: `count` GETs of `url` on one keep-alive connection per side (curl's URL
/// glob), `rounds` times interleaved; per-request latency as curl measured it.
fn small_requests(net: &Net, url: &str, count: usize, rounds: usize) -> anyhow::Result<Value> {
    let cmd = format!(
        "/usr/bin/curl -sS --noproxy '*' --max-time 100 -o /dev/null \
         -w '%{{time_total}} %{{num_connects}}\\n' '{url}?[1-{count}]'"
    );
    let mut lat: [Vec<u64>; 2] = Default::default();
    let mut connects = [0u64; 2];
    for i in 0..rounds + 1 {
        for side in Net::sides(i) {
            let k = usize::from(side == Side::Sandbox);
            let out = net.sh(side, &cmd)?;
            if i == 0 {
                continue; // warm-up
            }
            for l in out.lines() {
                let mut it = l.split_whitespace();
                let t: f64 = it.next().context("time")?.parse()?;
                connects[k] += it.next().and_then(|c| c.parse().ok()).unwrap_or(0);
                lat[k].push((t * 1e6).round() as u64);
            }
        }
    }
    let [host, sandbox] = lat.map(dist);
    Ok(
        json!({"url": url, "requests_per_side": host.count, "connections": connects,
              "ratio_p50": ratio(q_us(&sandbox, 50), q_us(&host, 50)),
              "ratio_p99": ratio(q_us(&sandbox, 99), q_us(&host, 99)),
              "host": host, "sandbox": sandbox}),
    )
}

/// Quantile `q` (50 or 99) of `d` in microseconds, as a float.
fn q_us(d: &Dist, q: u8) -> f64 {
    (if q == 50 { d.p50_us } else { d.p99_us }) as f64
}

/// Runs the DNS probe on `side`: `count` lookups of `name`; their microseconds, and how many
/// answered with another rcode than `want` (or none).
fn dns_probe(
    net: &Net,
    side: Side,
    name: &str,
    count: usize,
    mode: &str,
    want: i64,
) -> anyhow::Result<(Vec<u64>, usize)> {
    let server = net.fake.dns().ip().to_string();
    let cmd = format!(
        "/usr/bin/python3 -c {} {server} {name} {count} {mode}",
        quote(DNS_PROBE)
    );
    let out = net.sh(side, &cmd)?;
    let (mut lat, mut wrong) = (vec![], 0);
    for l in out.lines() {
        let mut it = l.split_whitespace().map(str::parse::<i64>);
        let (Some(Ok(t)), Some(Ok(rc))) = (it.next(), it.next()) else {
            bail!("dns probe: {l}");
        };
        lat.push(t.max(0) as u64);
        wrong += usize::from(rc != want);
    }
    Ok((lat, wrong))
}

/// Figure 3: DNS lookups in the sandbox (through the node's DNS) and on the host (straight to
/// the fake DNS), `rounds` rounds of `count` each, interleaved.
fn dns(net: &Net, count: usize, rounds: usize) -> anyhow::Result<Value> {
    // host raw, sandbox raw, sandbox refused, sandbox getaddrinfo, open sandbox raw.
    let mut lat: [Vec<u64>; 5] = Default::default();
    let mut wrong = [0usize; 5];
    for i in 0..rounds + 1 {
        let n = if i == 0 { 10 } else { count };
        let mut runs = vec![];
        for side in Net::sides(i) {
            if side == Side::Host {
                runs.push((0, dns_probe(net, side, ALLOWED, n, "raw", 0)?));
            } else {
                runs.push((1, dns_probe(net, side, ALLOWED, n, "raw", 0)?));
                runs.push((2, dns_probe(net, side, REFUSED, n, "raw", 5)?));
                runs.push((3, dns_probe(net, side, ALLOWED, n, "gai", 0)?));
                runs.push((4, dns_probe(net, Side::OpenSandbox, ALLOWED, n, "raw", 0)?));
            }
        }
        if i == 0 {
            continue; // warm-up
        }
        for (k, (l, w)) in runs {
            lat[k].extend(l);
            wrong[k] += w;
        }
    }
    let [host, sandbox, refused, gai, open] = lat.map(dist);
    Ok(json!({
        "name": ALLOWED, "refused_name": REFUSED, "lookups_per_side": host.count,
        "ratio_p50": ratio(q_us(&sandbox, 50), q_us(&host, 50)),
        "ratio_p99": ratio(q_us(&sandbox, 99), q_us(&host, 99)),
        "host_raw_udp": host, "sandbox_raw_udp": sandbox,
        "sandbox_refused_raw_udp": refused, "sandbox_getaddrinfo": gai,
        "sandbox_egress_all_raw_udp": open,
        "pin_p50_us": q_us(&sandbox, 50) - q_us(&open, 50),
        "unexpected_answers": {"host": wrong[0], "sandbox": wrong[1],
                               "sandbox_refused": wrong[2], "sandbox_getaddrinfo": wrong[3],
                               "sandbox_egress_all": wrong[4]},
    }))
}

/// Figure 2: throughput (the fake internet's Python server and the `sendfile` server) and
/// small requests (the `sendfile` server's; a few of the Python server's, which show its
/// delayed-ACK wait).
fn http(net: &Net, n: usize, out: &mut Map<String, Value>) -> anyhow::Result<()> {
    let web = net.fake.web();
    let reps = (n / 5).clamp(3, 40);
    eprintln!("bench net: throughput ({reps} x {DOWNLOAD} bytes per side and server)");
    let fast = FastServer::start(net.fake)?;
    let python = throughput(
        net,
        &format!("http://{web}/bytes/{DOWNLOAD}"),
        reps,
        fakenet_pid(net.fake),
    )?;
    let sendfile = throughput(
        net,
        &format!("http://{web}:{FAST_PORT}/bytes/{DOWNLOAD}"),
        reps,
        Some(fast.0.id()),
    )?;
    out.insert(
        "http_throughput".into(),
        json!({"fakenet_python_server": python, "sendfile_server": sendfile}),
    );
    eprintln!("bench net: small requests");
    let url = format!("http://{web}:{FAST_PORT}/bytes/{SMALL}");
    let small = small_requests(net, &url, 200, (n / 20).max(2))?;
    drop(fast);
    let python = small_requests(net, &format!("http://{web}/whoami"), 20, 1)?;
    out.insert(
        "http_small_requests".into(),
        json!({"sendfile_server": small, "fakenet_python_server_whoami": python}),
    );
    Ok(())
}

/// The human summary, on stderr.
fn tell(summary: &Value) {
    let f = |k: &str| summary[k].as_f64().unwrap_or(f64::NAN);
    eprintln!(
        "bench net: create p50 {:.2} ms off, {:.2} ms on (+{:.2} ms; attach mean {:.2} ms); \
         loop p50 +{:.2} ms",
        f("create_p50_off_ms"),
        f("create_p50_on_ms"),
        f("create_p50_diff_ms"),
        f("egress_attach_mean_ms"),
        f("loop_p50_diff_ms"),
    );
    eprintln!(
        "bench net: throughput (sendfile server) host {:.0} MB/s, sandbox {:.0} MB/s, ratio {:.2}; \
         (Python server) host {:.0}, sandbox {:.0}, ratio {:.2}",
        f("throughput_host_mb_per_s"),
        f("throughput_sandbox_mb_per_s"),
        f("throughput_ratio"),
        f("python_server_host_mb_per_s"),
        f("python_server_sandbox_mb_per_s"),
        f("python_server_ratio"),
    );
    eprintln!(
        "bench net: small GET p50 host {:.0} us, sandbox {:.0} us (ratio {:.2}); DNS p50 host \
         {:.0} us, sandbox {:.0} us (ratio {:.2}; egress all, no pin: {:.0} us), refused {:.0} us",
        f("small_get_p50_host_us"),
        f("small_get_p50_sandbox_us"),
        f("small_get_ratio_p50"),
        f("dns_p50_host_us"),
        f("dns_p50_sandbox_us"),
        f("dns_ratio_p50"),
        f("dns_p50_egress_all_sandbox_us"),
        f("dns_refused_p50_us"),
    );
}

/// The summary of the results.
fn summarize(r: &Map<String, Value>) -> Value {
    let c = &r["create_exec_delete"];
    let t = &r["http_throughput"];
    let (s, d) = (&r["http_small_requests"]["sendfile_server"], &r["dns"]);
    let us = |v: &Value| v.as_u64().unwrap_or(0);
    let create_diff = c["create_p50_diff_ms"].as_f64().unwrap_or(f64::NAN);
    let tr = t["sendfile_server"]["ratio_sandbox_over_host"]
        .as_f64()
        .unwrap_or(0.0);
    json!({
        "create_p50_off_ms": ms(us(&c["egress_off"]["create"]["p50_us"])),
        "create_p50_on_ms": ms(us(&c["egress_on"]["create"]["p50_us"])),
        "create_p50_diff_ms": create_diff,
        "loop_p50_diff_ms": c["loop_p50_diff_ms"],
        "egress_attach_mean_ms": c["egress_attach_seconds"]["mean_ms"],
        "throughput_host_mb_per_s": t["sendfile_server"]["host"]["median_mb_per_s"],
        "throughput_sandbox_mb_per_s": t["sendfile_server"]["sandbox"]["median_mb_per_s"],
        "throughput_ratio": tr,
        "python_server_host_mb_per_s": t["fakenet_python_server"]["host"]["median_mb_per_s"],
        "python_server_sandbox_mb_per_s": t["fakenet_python_server"]["sandbox"]["median_mb_per_s"],
        "python_server_ratio": t["fakenet_python_server"]["ratio_sandbox_over_host"],
        "small_get_p50_host_us": s["host"]["p50_us"],
        "small_get_p50_sandbox_us": s["sandbox"]["p50_us"],
        "small_get_ratio_p50": s["ratio_p50"],
        "small_get_ratio_p99": s["ratio_p99"],
        "dns_p50_host_us": d["host_raw_udp"]["p50_us"],
        "dns_p50_sandbox_us": d["sandbox_raw_udp"]["p50_us"],
        "dns_ratio_p50": d["ratio_p50"],
        "dns_ratio_p99": d["ratio_p99"],
        "dns_refused_p50_us": d["sandbox_refused_raw_udp"]["p50_us"],
        "dns_p50_egress_all_sandbox_us": d["sandbox_egress_all_raw_udp"]["p50_us"],
        "target_create_extra_ms_max": TARGET_CREATE_EXTRA_MS,
        "target_throughput_ratio_min": TARGET_THROUGHPUT_RATIO,
        "create_extra_met": create_diff <= TARGET_CREATE_EXTRA_MS,
        "throughput_ratio_met": tr >= TARGET_THROUGHPUT_RATIO,
    })
}

/// Creates a sandbox of `spec`; answers its id.
fn create(c: &Client, spec: &Value) -> anyhow::Result<String> {
    let v = c.ok("POST", "/v1/sandboxes", Some(spec))?;
    Ok(v["id"].as_str().context("id")?.to_owned())
}

/// Runs the network egress benchmark.
pub fn run(args: &BenchArgs) -> anyhow::Result<ExitCode> {
    let n = args.iterations.max(10);
    // Dropped in reverse: the daemon (its sandboxes destroyed first), then the fake internet.
    let fake = FakeNet::start().context("start the fake internet")?;
    let resolver = fake.dns().to_string();
    let d = start_daemon("net", &["--egress-resolver", &resolver])?;
    let c = Client::new(&d.url, &d.key, Duration::from_secs(150));
    let mut results = Map::new();

    eprintln!("bench net: create + exec + delete, egress off and on ({n} each)");
    results.insert("create_exec_delete".into(), create_cost(&d, &c, args, n)?);

    let web = fake.web();
    let spec = json!({"labels": {"bench": "net"},
                      "network": {"egress": {"allow": [format!("{web}/32"), ALLOWED]}}});
    let open = json!({"labels": {"bench": "net"}, "network": {"egress": "all"}});
    let net = Net {
        sandbox: create(&c, &spec)?,
        open: create(&c, &open)?,
        c: c.clone(),
        fake: &fake,
    };
    http(&net, n, &mut results)?;
    eprintln!("bench net: DNS");
    results.insert("dns".into(), dns(&net, n * 2, 5)?);
    for id in [&net.sandbox, &net.open] {
        c.ok("DELETE", &format!("/v1/sandboxes/{id}"), None)?;
    }

    let summary = summarize(&results);
    tell(&summary);
    let doc = json!({
        "bench": "net",
        "iterations": n,
        "warmup": WARMUP,
        "fake_internet": {"web": web.to_string(), "dns": resolver},
        "results": Value::Object(results),
        "summary": summary,
    });
    drop(d);
    drop(fake);
    emit(args, doc)
}
