//! A fake internet for egress tests, so that they never contact a real outside address: a
//! network namespace of its own (`dsecfake-<n>`) joined to the host by a veth pair (`dsf-<n>`
//! on the host, `eth0` inside), addresses from 198.18.<n>.0/24 (RFC 2544's benchmarking range),
//! and one Python process (`fakenet.py`, standard library only) serving inside it:
//!
//! - DNS on UDP and TCP port 53 at 198.18.n.53, A records from `<dir>/zone.json`, which is
//!   re-read on every query ([`FakeNet::set_name`] changes an answer at run time, for DNS
//!   rebinding tests); AAAA and other types of a known name: NOERROR without records; unknown
//!   names: NXDOMAIN; TTL 5 s.
//! - HTTP on port 80 and HTTPS on port 443 of all its addresses: `GET /whoami` (JSON: the
//!   `server` address it was reached on, the `host` header, the `client` address, the
//!   `scheme`), `GET /bytes/<n>` (n bytes), and a PEP 503 package index at `/simple/` whose one
//!   project, `dsecprobe`, has one pure-Python wheel ([`WHEEL`], `import dsecprobe;
//!   dsecprobe.VALUE == 42`) at `/packages/<wheel>`. The HTTPS certificate names [`CERT_NAMES`]
//!   and is signed by a CA made at start, whose certificate is [`FakeNet::ca_pem`].
//!
//! The host keeps 198.18.n.1/24 on `dsf-<n>`, so it reaches the servers directly; the default
//! route inside goes back to it, so answers to masqueraded sandbox traffic find their way.
//!
//! Needs root and the `ip` (iproute2), `python3` and `openssl` commands.

use std::fs;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The server script, written to the fixture's dir at start.
const SCRIPT: &str = include_str!("../fakenet.py");

/// How many `n` (third octets of 198.18.n.0/24) there are to choose from.
const SLOTS: u32 = 200;

/// How long [`FakeNet::start`] waits for the server to have bound all its listeners.
const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// How long a dropped fixture's server has between SIGTERM and SIGKILL.
const TERM_GRACE: Duration = Duration::from_secs(2);

/// File name of the one wheel of the package index (project `dsecprobe`, version 1.0).
pub const WHEEL: &str = "dsecprobe-1.0-py3-none-any.whl";

/// The names the HTTPS server's certificate is valid for.
pub const CERT_NAMES: [&str; 5] = [
    "pypi.test",
    "*.pythonhosted.test",
    "github.test",
    "evil.test",
    "other.test",
];

/// Spreads the `n` tried first over the fixtures of one process.
static NEXT: AtomicU32 = AtomicU32::new(0);

/// A running fake internet. Dropping it stops the server and removes the namespace, the link
/// and the dir.
pub struct FakeNet {
    /// The third octet of its subnet, 198.18.n.0/24; unique among the live fixtures of the
    /// machine (held by the namespace's name).
    pub n: u8,
    /// Its network namespace, `dsecfake-<n>` (`ip netns exec <ns> ...` runs a command in it).
    pub ns: String,
    /// The host's end of the veth pair, `dsf-<n>`, with 198.18.n.1/24.
    pub host_if: String,
    /// Its temp dir, `<temp>/dsec-fakenet-<n>-<pid>`: the zone, the CA, the wheel, the log.
    pub dir: PathBuf,
    /// The server, `ip netns exec <ns> python3 fakenet.py ...` (`ip` execs python3).
    child: Option<Child>,
    /// Serializes the read-modify-write of the zone file.
    zone: Mutex<()>,
}

impl FakeNet {
    /// Makes the namespace, the link and the addresses, starts the server and waits (20 s at
    /// most) until it listens. On error, whatever was made is removed again. First removes
    /// what fixtures of killed processes left behind.
    pub fn start() -> io::Result<FakeNet> {
        sweep();
        let first = std::process::id().wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed)) % SLOTS;
        let mut last_err = None;
        for i in 0..SLOTS {
            let n = u8::try_from((first + i) % SLOTS).expect("invariant: n < 200");
            let ns = format!("dsecfake-{n}");
            // The namespace's name is the lock on n: adding it fails while another holds it.
            match ip(&["netns", "add", &ns]) {
                Ok(()) => {
                    let mut net = FakeNet {
                        n,
                        ns,
                        host_if: format!("dsf-{n}"),
                        dir: std::env::temp_dir()
                            .join(format!("dsec-fakenet-{n}-{}", std::process::id())),
                        child: None,
                        zone: Mutex::new(()),
                    };
                    net.setup()?;
                    return Ok(net);
                }
                Err(e) => last_err = Some(e),
            }
        }
        Err(io::Error::other(format!(
            "fakenet: no free 198.18.n.0/24 (`ip netns add dsecfake-<n>` failed for every n < \
             {SLOTS}; the last: {})",
            last_err.map(|e| e.to_string()).unwrap_or_default()
        )))
    }

    /// The rest of [`FakeNet::start`], once the namespace is ours.
    fn setup(&mut self) -> io::Result<()> {
        let _ = fs::remove_dir_all(&self.dir);
        fs::create_dir_all(&self.dir)?;
        let script = self.dir.join("fakenet.py");
        fs::write(&script, SCRIPT)?;
        let web = self.web().to_string();
        let other = self.other().to_string();
        let zone = serde_json::json!({
            "pypi.test": [web],
            "files.pythonhosted.test": [web],
            "github.test": [other],
            "evil.test": [other],
            "other.test": [other],
            "rebind.test": [web],
        });
        write_atomically(&self.dir.join("zone.json"), &zone_bytes(&zone)?)?;

        let ns = self.ns.as_str();
        let host_if = self.host_if.as_str();
        let link = [
            "link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", ns,
        ];
        if ip(&link).is_err() {
            // A dsf-<n> left by a fixture that died unclean: ours now that dsecfake-<n> is.
            let _ = ip(&["link", "del", host_if]);
            ip(&link)?;
        }
        let cidr = |host: u8| format!("{}/24", self.addr(host));
        ip(&["addr", "add", &cidr(1), "dev", host_if])?;
        ip(&["link", "set", host_if, "up"])?;
        ip(&["-n", ns, "link", "set", "lo", "up"])?;
        for host in [2, 3, 53] {
            ip(&["-n", ns, "addr", "add", &cidr(host), "dev", "eth0"])?;
        }
        ip(&["-n", ns, "link", "set", "eth0", "up"])?;
        let gateway = self.gateway().to_string();
        ip(&["-n", ns, "route", "add", "default", "via", &gateway])?;

        let log = self.dir.join("server.log");
        let log_file = fs::File::create(&log)?;
        let child = Command::new("ip")
            .args(["netns", "exec", ns, "python3"])
            .arg(&script)
            .arg("--dir")
            .arg(&self.dir)
            .arg("--dns")
            .arg(self.dns().ip().to_string())
            .stdin(Stdio::null())
            .stdout(log_file.try_clone()?)
            .stderr(log_file)
            .spawn()
            .map_err(|e| io::Error::new(e.kind(), format!("fakenet: ip netns exec: {e}")))?;
        let child = self.child.insert(child);

        let ready = self.dir.join("ready");
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if ready.exists() {
                return Ok(());
            }
            let log_text = || fs::read_to_string(&log).unwrap_or_default();
            if let Some(status) = child.try_wait()? {
                return Err(io::Error::other(format!(
                    "fakenet: the server exited ({status}) before it was ready:\n{}",
                    log_text()
                )));
            }
            if Instant::now() > deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "fakenet: the server was not ready within {READY_TIMEOUT:?}:\n{}",
                        log_text()
                    ),
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// 198.18.n.`host`.
    pub fn addr(&self, host: u8) -> Ipv4Addr {
        Ipv4Addr::new(198, 18, self.n, host)
    }

    /// The host's address on the link, 198.18.n.1: the namespace's default gateway, and the
    /// client address the servers see for the host's own requests.
    pub fn gateway(&self) -> Ipv4Addr {
        self.addr(1)
    }

    /// The web server most names point to, 198.18.n.2.
    pub fn web(&self) -> Ipv4Addr {
        self.addr(2)
    }

    /// The other web server (same servers, another address), 198.18.n.3.
    pub fn other(&self) -> Ipv4Addr {
        self.addr(3)
    }

    /// The DNS server, 198.18.n.53:53 (UDP and TCP).
    pub fn dns(&self) -> SocketAddr {
        SocketAddr::V4(SocketAddrV4::new(self.addr(53), 53))
    }

    /// The fake internet's subnet, (198.18.n.0, 24).
    pub fn subnet(&self) -> (Ipv4Addr, u8) {
        (self.addr(0), 24)
    }

    /// Makes the DNS server answer `name`'s A queries with `addrs` (none: NOERROR without
    /// records) from the next query on. Rewrites `zone.json` atomically.
    pub fn set_name(&self, name: &str, addrs: &[Ipv4Addr]) -> io::Result<()> {
        let addrs: Vec<String> = addrs.iter().map(Ipv4Addr::to_string).collect();
        self.edit_zone(|zone| {
            zone.insert(name.to_ascii_lowercase(), serde_json::json!(addrs));
        })
    }

    /// Removes `name` from the zone: its queries are answered NXDOMAIN from the next one on.
    pub fn remove_name(&self, name: &str) -> io::Result<()> {
        self.edit_zone(|zone| {
            zone.remove(&name.to_ascii_lowercase());
        })
    }

    /// Reads the zone, applies `edit`, writes it back atomically.
    fn edit_zone(
        &self,
        edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
    ) -> io::Result<()> {
        let _held = self.zone.lock().unwrap_or_else(|e| e.into_inner());
        let path = self.dir.join("zone.json");
        let mut zone: serde_json::Value = serde_json::from_slice(&fs::read(&path)?)?;
        let map = zone
            .as_object_mut()
            .ok_or_else(|| io::Error::other("fakenet: zone.json is not an object"))?;
        edit(map);
        write_atomically(&path, &zone_bytes(&zone)?)
    }

    /// The certificate (PEM) of the CA that signed the HTTPS server's, `<dir>/ca.pem`: for
    /// `curl --cacert`, `SSL_CERT_FILE`, `PIP_CERT` and the like.
    pub fn ca_pem(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    /// The package index by name, `http://pypi.test/simple/`: for `pip --index-url`, with
    /// `--trusted-host pypi.test` (plain HTTP). The same index answers at
    /// `https://pypi.test/simple/` with [`FakeNet::ca_pem`] as pip's `--cert`. Its one
    /// project is `dsecprobe`, its one file [`WHEEL`].
    pub fn wheel_index(&self) -> String {
        "http://pypi.test/simple/".to_owned()
    }
}

impl Drop for FakeNet {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            if let Ok(None) = child.try_wait() {
                if let Some(pid) = i32::try_from(child.id())
                    .ok()
                    .and_then(rustix::process::Pid::from_raw)
                {
                    let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
                }
                let deadline = Instant::now() + TERM_GRACE;
                while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(10));
                }
                let _ = child.kill();
            }
            let _ = child.wait();
        }
        // The namespace, the lock on n, goes last: the link first (it takes its peer, eth0,
        // along), else a fixture that just took n could lose its new dsf-<n> to us; the dir
        // before it, so that a dir whose process is gone means a namespace nobody holds (see
        // `sweep`).
        let _ = ip(&["link", "del", &self.host_if]);
        let _ = fs::remove_dir_all(&self.dir);
        let _ = ip(&["netns", "del", &self.ns]);
        release_run_netns();
    }
}

/// `ip netns add` mounts `/run/netns` on itself the first time: once the last named namespace
/// is gone, that mount and the directory go too (the machine as it was found). A namespace
/// added meanwhile keeps it busy, and then it stays.
fn release_run_netns() {
    let dir = Path::new("/run/netns");
    let empty = fs::read_dir(dir)
        .map(|mut d| d.next().is_none())
        .unwrap_or(false);
    let mounted = fs::read_to_string("/proc/self/mountinfo")
        .map(|m| m.lines().any(|l| l.split(' ').nth(4) == Some("/run/netns")))
        .unwrap_or(false);
    if empty && mounted {
        let _ = rustix::mount::unmount(dir, rustix::mount::UnmountFlags::empty());
        let _ = fs::remove_dir(dir);
    }
}

/// Removes what the fixtures of processes that are gone (killed before they could drop them)
/// left behind: for each `<temp>/dsec-fakenet-<n>-<pid>` of a dead pid, its link, its dir and
/// its namespace. (Their servers exit by themselves once orphaned.) A sweeper claims a dir by
/// renaming it, so that of two at once only one goes on and frees n.
fn sweep() {
    let tmp = std::env::temp_dir();
    let Ok(entries) = fs::read_dir(&tmp) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some((n, pid)) = name
            .to_str()
            .and_then(|name| name.strip_prefix("dsec-fakenet-"))
            .and_then(|rest| rest.split_once('-'))
        else {
            continue;
        };
        let (Ok(n), Ok(pid)) = (n.parse::<u8>(), pid.parse::<u32>()) else {
            continue;
        };
        if pid == std::process::id() || Path::new("/proc").join(pid.to_string()).exists() {
            continue;
        }
        let claimed = tmp.join(format!(
            "dsec-fakenet-sweep-{n}-{pid}-{}",
            std::process::id()
        ));
        if fs::rename(entry.path(), &claimed).is_err() {
            continue;
        }
        eprintln!("fakenet: removing dsecfake-{n}, left by process {pid}, which is gone");
        let _ = ip(&["link", "del", &format!("dsf-{n}")]);
        let _ = fs::remove_dir_all(&claimed);
        let _ = ip(&["netns", "del", &format!("dsecfake-{n}")]);
        release_run_netns();
    }
}

/// Runs `ip ARGS`, its stderr in the error.
fn ip(args: &[&str]) -> io::Result<()> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| io::Error::new(e.kind(), format!("fakenet: ip: {e}")))?;
    if out.status.success() {
        return Ok(());
    }
    Err(io::Error::other(format!(
        "fakenet: ip {}: {}: {}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    )))
}

/// The zone as the server reads it.
fn zone_bytes(zone: &serde_json::Value) -> io::Result<Vec<u8>> {
    let mut bytes = serde_json::to_vec_pretty(zone)?;
    bytes.push(b'\n');
    Ok(bytes)
}

/// Writes `path` by writing a temp file beside it and renaming it over `path`.
fn write_atomically(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    fs::write(&tmp, bytes)?;
    fs::rename(&tmp, path)
}
