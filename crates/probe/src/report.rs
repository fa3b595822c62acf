//! `dsec-probe report`: every isolation observation of TESTING.md (S-01..S-08, S-10..S-13,
//! C-01, C-03..C-06) made from inside the sandbox, printed as
//! `{"checks":[{"id","pass","detail"}], "all_pass"}` (`--only ID` runs the named checks alone).
//!
//! Nothing here changes the host when the probe is run outside a sandbox: no write into `/proc`
//! files (writability is tested by opening only), no `sethostname` unless the UTS namespace is
//! not the host's, and the zero-argument syscall sweep (S-04) only runs under a seccomp filter.

use std::collections::BTreeMap;
use std::fs;
use std::io::Read;
use std::os::fd::AsFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{json, Value};

use super::sys;
use super::{calls, devices, Check};

/// What the caller knows about the host, from the command line.
#[derive(Debug, Default)]
pub struct Options {
    /// Host namespace inodes by name (`pid`, `mnt`, ...); the fixed inodes of the initial
    /// namespaces are used for names not given.
    pub host_ns: BTreeMap<String, u64>,
    /// The host's hostname.
    pub host_hostname: Option<String>,
    /// TCP ports of host loopback services (the daemon) that must be unreachable.
    pub daemon_ports: Vec<u16>,
    /// Environment variable names that must not be visible.
    pub secret_env: Vec<String>,
    /// Values that must not appear in any visible environment.
    pub secret_values: Vec<String>,
    /// Host paths that must not exist inside.
    pub host_files: Vec<String>,
    /// Most pids the sandbox may show in `/proc`.
    pub max_pids: usize,
    /// The ids of the checks to run; empty for all.
    pub only: Vec<String>,
}

/// Usage text of `report`'s options.
pub const USAGE: &str = "report [--host-ns NAME=INODE[,NAME=INODE...]] [--host-hostname NAME] \
[--daemon-port PORT]... [--secret-env NAME]... [--secret-value VALUE]... [--host-file PATH]... \
[--max-pids N] [--only ID]...";

impl Options {
    /// Parses `report`'s arguments.
    pub fn parse(args: &[String]) -> Result<Options, String> {
        let mut o = Options {
            max_pids: 256,
            ..Options::default()
        };
        let mut it = args.iter();
        while let Some(flag) = it.next() {
            let mut value = || it.next().cloned().ok_or(format!("{flag} needs a value"));
            match flag.as_str() {
                "--host-ns" => {
                    for kv in value()?.split(',').filter(|s| !s.is_empty()) {
                        let (k, v) = kv.split_once('=').ok_or(format!("bad --host-ns {kv:?}"))?;
                        let ino = v.parse().map_err(|_| format!("bad inode in {kv:?}"))?;
                        o.host_ns.insert(k.to_owned(), ino);
                    }
                }
                "--host-hostname" => o.host_hostname = Some(value()?),
                "--daemon-port" => o
                    .daemon_ports
                    .push(value()?.parse().map_err(|_| "bad --daemon-port")?),
                "--secret-env" => o.secret_env.push(value()?),
                "--secret-value" => o.secret_values.push(value()?),
                "--host-file" => o.host_files.push(value()?),
                "--max-pids" => o.max_pids = value()?.parse().map_err(|_| "bad --max-pids")?,
                "--only" => o.only.push(value()?),
                other => return Err(format!("unknown report option {other:?}")),
            }
        }
        Ok(o)
    }
}

/// Runs every check; a check that panics is reported as failed.
pub fn run(o: &Options) -> Value {
    type CheckFn<'a> = (&'static str, Box<dyn Fn() -> Check + 'a>);
    let checks: Vec<CheckFn<'_>> = vec![
        ("S-01", Box::new(s01_credentials)),
        ("S-02", Box::new(|| s02_namespaces(o))),
        ("S-03", Box::new(s03_filesystem)),
        ("S-04", Box::new(s04_syscalls)),
        ("S-05", Box::new(calls::must_deny_check)),
        ("S-06", Box::new(|| s06_network(o))),
        ("S-07", Box::new(s07_proc)),
        ("S-08", Box::new(s08_devices)),
        ("S-10", Box::new(|| s10_secrets(o))),
        ("S-11", Box::new(calls::socket_families_check)),
        ("S-12", Box::new(calls::mknod_check)),
        ("S-13", Box::new(devices::walk_check)),
        ("C-01", Box::new(c01_fds)),
        ("C-03", Box::new(c03_masked_paths)),
        ("C-04", Box::new(c04_sys_and_release_agent)),
        ("C-05", Box::new(c05_tiocsti)),
        ("C-06", Box::new(calls::open_by_handle_check)),
    ];
    let results: Vec<Check> = checks
        .into_iter()
        .filter(|(id, _)| o.only.is_empty() || o.only.iter().any(|x| x == id))
        .map(|(id, f)| {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                    .unwrap_or_default();
                Check {
                    id,
                    pass: false,
                    detail: json!({ "panic": msg }),
                }
            })
        })
        .collect();
    let all_pass = results.iter().all(|c| c.pass);
    json!({ "checks": results, "all_pass": all_pass })
}

fn errno_of(e: &std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or(0)
}

fn proc_status() -> BTreeMap<String, String> {
    fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.to_owned(), v.trim().to_owned()))
        .collect()
}

fn s01_credentials() -> Check {
    let st = proc_status();
    let mut caps = BTreeMap::new();
    let mut caps_zero = true;
    for name in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        let v = st.get(name).cloned().unwrap_or_default();
        caps_zero &= u64::from_str_radix(&v, 16) == Ok(0);
        caps.insert(name, v);
    }
    let nnp = st.get("NoNewPrivs").cloned().unwrap_or_default();
    let seccomp = st.get("Seccomp").cloned().unwrap_or_default();
    let uid_map = fs::read_to_string("/proc/self/uid_map").unwrap_or_default();
    let gid_map = fs::read_to_string("/proc/self/gid_map").unwrap_or_default();
    let identity = uid_map.split_whitespace().collect::<Vec<_>>() == ["0", "0", "4294967295"];
    let euid = sys::geteuid();
    let host_root = identity && euid == 0;
    Check {
        id: "S-01",
        pass: caps_zero && nnp == "1" && seccomp == "2" && !host_root,
        detail: json!({
            "caps": caps, "no_new_privs": nnp, "seccomp": seccomp, "euid": euid,
            "uid_map": uid_map.trim(), "gid_map": gid_map.trim(),
            "initial_user_ns_root": host_root,
        }),
    }
}

/// Inodes of the initial namespaces (fixed by the kernel, `include/linux/proc_ns.h`).
const INIT_NS: [(&str, u64); 6] = [
    ("ipc", 0xEFFF_FFFF),
    ("uts", 0xEFFF_FFFE),
    ("user", 0xEFFF_FFFD),
    ("pid", 0xEFFF_FFFC),
    ("cgroup", 0xEFFF_FFFB),
    ("time", 0xEFFF_FFFA),
];

fn ns_inode(name: &str) -> Option<u64> {
    let link = fs::read_link(format!("/proc/self/ns/{name}")).ok()?;
    let s = link.to_string_lossy();
    s.split_once('[')?.1.trim_end_matches(']').parse().ok()
}

fn visible_pids() -> Vec<u32> {
    let mut pids: Vec<u32> = fs::read_dir("/proc")
        .map(|rd| {
            rd.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect::<Vec<u32>>()
        })
        .unwrap_or_default();
    pids.sort_unstable();
    pids
}

fn cmdline(pid: u32) -> String {
    fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| {
            String::from_utf8_lossy(&b)
                .replace('\0', " ")
                .trim()
                .to_owned()
        })
        .unwrap_or_default()
}

fn s02_namespaces(o: &Options) -> Check {
    let mut host: BTreeMap<String, u64> =
        INIT_NS.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect();
    host.extend(o.host_ns.iter().map(|(k, v)| (k.clone(), *v)));
    let mut ns = BTreeMap::new();
    let mut shared = Vec::new();
    for name in ["cgroup", "ipc", "mnt", "net", "pid", "time", "user", "uts"] {
        let ino = ns_inode(name);
        if let (Some(i), Some(h)) = (ino, host.get(name)) {
            if i == *h {
                shared.push(name);
            }
        }
        ns.insert(name, ino);
    }
    let pids = visible_pids();
    let pids_ok = pids.len() <= o.max_pids;
    let inside = sys::nodename();
    let hostname_differs = o.host_hostname.as_ref().is_none_or(|h| *h != inside);
    // Only try to change the hostname in a UTS namespace that is not the host's.
    let own_uts = ns_inode("uts").is_some_and(|i| Some(&i) != host.get("uts"));
    let sethostname = if own_uts {
        match sys::sethostname("dsec-probe-uts") {
            Ok(()) => {
                let changed = sys::nodename();
                let _ = sys::sethostname(&inside);
                json!({ "result": "ok", "visible_inside": changed })
            }
            Err(e) => json!({ "result": "denied", "errno": e }),
        }
    } else {
        json!({ "result": "skipped: UTS namespace is the host's" })
    };
    Check {
        id: "S-02",
        pass: shared.is_empty() && pids_ok && hostname_differs && own_uts,
        detail: json!({
            "namespaces": ns, "host_namespaces": host, "shared_with_host": shared,
            "visible_pids": pids.iter().take(64).collect::<Vec<_>>(), "pid_count": pids.len(),
            "pid1_cmdline": cmdline(1), "self_pid": sys::getpid(),
            "hostname": inside, "host_hostname": o.host_hostname, "sethostname": sethostname,
        }),
    }
}

/// One line of `/proc/self/mountinfo`.
struct Mount {
    mount_point: String,
    options: Vec<String>,
    fstype: String,
    source: String,
}

fn mounts() -> Vec<Mount> {
    fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            let pre: Vec<&str> = pre.split(' ').collect();
            let post: Vec<&str> = post.split(' ').collect();
            Some(Mount {
                mount_point: pre.get(4)?.replace("\\040", " "),
                options: pre.get(5)?.split(',').map(str::to_owned).collect(),
                fstype: (*post.first()?).to_owned(),
                source: post.get(1).copied().unwrap_or_default().to_owned(),
            })
        })
        .collect()
}

/// Device mounts that need device access: `/dev` itself, devpts, device bind mounts under
/// `/dev`, and masks made by binding `/dev/null` (1:3) over a path (`/proc/keys`, ...).
fn device_mount(m: &Mount) -> bool {
    let char_dev = || {
        fs::symlink_metadata(&m.mount_point)
            .ok()
            .filter(|md| md.file_type().is_char_device())
    };
    m.mount_point == "/dev"
        || m.fstype == "devpts"
        || (m.mount_point.starts_with("/dev/") && char_dev().is_some())
        || char_dev().is_some_and(|md| sys::major_minor(md.rdev()) == (1, 3))
}

fn try_create(dir: &str) -> Value {
    let path = format!("{dir}/.dsec-probe-{}", sys::getpid());
    match fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&path)
    {
        Ok(_) => {
            let _ = fs::remove_file(&path);
            json!("writable")
        }
        Err(e) => json!({ "denied_errno": errno_of(&e) }),
    }
}

fn same_file(a: &Path, b: &Path) -> bool {
    match (fs::metadata(a), fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => false,
    }
}

fn setuid_check() -> (bool, Value) {
    let candidates = [
        "/usr/bin/su",
        "/bin/su",
        "/usr/bin/passwd",
        "/usr/bin/newgrp",
        "/usr/bin/chsh",
    ];
    let found = candidates.iter().find(|p| {
        fs::metadata(p).is_ok_and(|m| m.permissions().mode() & 0o4000 != 0 && m.uid() == 0)
    });
    let Some(bin) = found else {
        return (true, json!({ "result": "no setuid-root binary found" }));
    };
    let euid = sys::geteuid();
    let child = Command::new(bin)
        .env_clear()
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => return (true, json!({ "binary": bin, "spawn_error": e.to_string() })),
    };
    // Credentials are committed at exec, which `spawn` waited for; a zombie keeps its status.
    let st = fs::read_to_string(format!("/proc/{}/status", child.id())).unwrap_or_default();
    let _ = child.kill();
    let _ = child.wait();
    let field = |k: &str| {
        st.lines()
            .find_map(|l| l.strip_prefix(k))
            .map(|v| v.trim().to_owned())
            .unwrap_or_default()
    };
    let uids = field("Uid:");
    let cap_eff = field("CapEff:");
    let child_euid: Option<u32> = uids.split_whitespace().nth(1).and_then(|v| v.parse().ok());
    let ok = match child_euid {
        Some(e) => e == euid && (euid != 0 || u64::from_str_radix(&cap_eff, 16) == Ok(0)),
        None => true,
    };
    (
        ok,
        json!({ "binary": bin, "probe_euid": euid, "child_uids": uids, "child_cap_eff": cap_eff }),
    )
}

fn s03_filesystem() -> Check {
    let ms = mounts();
    let root = ms.iter().rev().find(|m| m.mount_point == "/");
    let root_overlay = root.is_some_and(|m| m.fstype == "overlay");
    let mut violations = Vec::new();
    for m in &ms {
        let has = |o: &str| m.options.iter().any(|x| x == o);
        let mut missing = Vec::new();
        if !has("nosuid") {
            missing.push("nosuid");
        }
        if !has("nodev") && !device_mount(m) {
            missing.push("nodev");
        }
        if !missing.is_empty() {
            violations.push(
                json!({ "mount_point": m.mount_point, "fstype": m.fstype, "missing": missing }),
            );
        }
    }
    let writes = json!({ "/usr": try_create("/usr"), "/etc": try_create("/etc"), "/tmp": try_create("/tmp") });
    let mut mknod = BTreeMap::new();
    let mut mknod_denied = true;
    for (kind, mode, dev) in [
        ("char 1:3", libc::S_IFCHR, sys::makedev(1, 3)),
        ("block 7:0", libc::S_IFBLK, sys::makedev(7, 0)),
    ] {
        for dir in ["/tmp", "/"] {
            let path = format!("{dir}/.dsec-probe-node-{}", sys::getpid()).replace("//", "/");
            let r = sys::mknod(&path, mode | 0o600, dev);
            if r.is_ok() {
                let _ = fs::remove_file(&path);
                mknod_denied = false;
            }
            mknod.insert(
                format!("{kind} in {dir}"),
                r.err().map_or(json!("created"), |e| json!(e)),
            );
        }
    }
    let (setuid_ok, setuid) = setuid_check();
    let dotdot = same_file(Path::new("/../../.."), Path::new("/"));
    let link = format!("/tmp/.dsec-probe-up-{}", sys::getpid());
    let symlink = match std::os::unix::fs::symlink("../../../../../../../..", &link) {
        Ok(()) => {
            let ok = same_file(Path::new(&link), Path::new("/"));
            let _ = fs::remove_file(&link);
            json!(ok)
        }
        Err(e) => json!({ "skipped_errno": errno_of(&e) }),
    };
    let symlink_ok = symlink.as_bool() != Some(false);
    Check {
        id: "S-03",
        pass: root_overlay
            && violations.is_empty()
            && mknod_denied
            && setuid_ok
            && dotdot
            && symlink_ok,
        detail: json!({
            "root": root.map(|m| json!({ "fstype": m.fstype, "source": m.source, "options": m.options })),
            "mount_count": ms.len(),
            "mount_violations": violations,
            "writes": writes,
            "mknod": mknod,
            "setuid": setuid,
            "dotdot_stays_at_root": dotdot,
            "symlink_escape_stays_at_root": symlink,
        }),
    }
}

fn s04_syscalls() -> Check {
    if !sys::seccomp_active() {
        return Check {
            id: "S-04",
            pass: false,
            detail: json!({ "skipped": "no seccomp filter active; the zero-argument sweep only runs under one" }),
        };
    }
    calls::sweep()
}

fn s06_network(o: &Options) -> Check {
    let ifaces: Vec<String> = fs::read_to_string("/proc/net/dev")
        .unwrap_or_default()
        .lines()
        .skip(2)
        .filter_map(|l| l.split_once(':').map(|(n, _)| n.trim().to_owned()))
        .collect();
    let only_lo = ifaces == ["lo"];
    let mut targets: Vec<String> = o
        .daemon_ports
        .iter()
        .map(|p| format!("127.0.0.1:{p}"))
        .collect();
    targets.extend(o.daemon_ports.iter().map(|p| format!("[::1]:{p}")));
    targets.extend(
        [
            "169.254.169.254:80",
            "1.1.1.1:53",
            "8.8.8.8:443",
            "[2606:4700:4700::1111]:53",
        ]
        .map(String::from),
    );
    let mut connects = BTreeMap::new();
    let mut none_connected = true;
    for t in &targets {
        let r = match t.parse::<std::net::SocketAddr>() {
            Ok(addr) => match std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
                Ok(_) => {
                    none_connected = false;
                    json!("connected")
                }
                Err(e) => json!({ "errno": e.raw_os_error(), "error": e.kind().to_string() }),
            },
            Err(e) => json!({ "bad_address": e.to_string() }),
        };
        connects.insert(t.clone(), r);
    }
    let mut raw = BTreeMap::new();
    let mut raw_denied = true;
    for (name, dom, ty, proto) in [
        (
            "AF_PACKET/SOCK_RAW",
            libc::AF_PACKET,
            libc::SOCK_RAW,
            i32::from((libc::ETH_P_ALL as u16).to_be()),
        ),
        (
            "AF_PACKET/SOCK_DGRAM",
            libc::AF_PACKET,
            libc::SOCK_DGRAM,
            i32::from((libc::ETH_P_ALL as u16).to_be()),
        ),
        (
            "AF_INET/SOCK_RAW/ICMP",
            libc::AF_INET,
            libc::SOCK_RAW,
            libc::IPPROTO_ICMP,
        ),
        (
            "AF_INET/SOCK_RAW/RAW",
            libc::AF_INET,
            libc::SOCK_RAW,
            libc::IPPROTO_RAW,
        ),
        (
            "AF_INET6/SOCK_RAW/ICMPV6",
            libc::AF_INET6,
            libc::SOCK_RAW,
            libc::IPPROTO_ICMPV6,
        ),
    ] {
        let r = match sys::socket(dom, ty, proto) {
            Ok(_) => {
                raw_denied = false;
                json!("created")
            }
            Err(e) => json!({ "errno": e }),
        };
        raw.insert(name, r);
    }
    Check {
        id: "S-06",
        pass: only_lo && none_connected && raw_denied,
        detail: json!({ "interfaces": ifaces, "connect": connects, "raw_sockets": raw }),
    }
}

/// Reads up to 64 KiB of `path`: `Err(errno)` when unreadable.
fn read_head(path: &str) -> Result<Vec<u8>, i32> {
    let mut f = fs::File::open(path).map_err(|e| errno_of(&e))?;
    let mut buf = Vec::new();
    f.by_ref()
        .take(64 * 1024)
        .read_to_end(&mut buf)
        .map_err(|e| errno_of(&e))?;
    Ok(buf)
}

fn describe_read(r: &Result<Vec<u8>, i32>) -> Value {
    match r {
        Err(e) => json!({ "unreadable_errno": e }),
        Ok(b) if b.is_empty() => json!("empty"),
        Ok(b) => json!({ "readable_bytes": b.len() }),
    }
}

/// Opens `path` for writing without writing anything: `true` when a real (non-device) file could
/// be opened for writing.
fn writable_for_real(path: &str) -> (bool, Value) {
    match fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
    {
        Ok(f) => match f.metadata() {
            Ok(m) if m.file_type().is_char_device() => (false, json!("masked by a device node")),
            _ => (true, json!("opened for writing")),
        },
        Err(e) => (false, json!({ "denied_errno": errno_of(&e) })),
    }
}

/// Runs `check` on each of `paths`: whether every one passed, and the detail of each by path.
fn check_paths(
    paths: &[&'static str],
    check: impl Fn(&str) -> (bool, Value),
) -> (bool, BTreeMap<&'static str, Value>) {
    let mut pass = true;
    let mut details = BTreeMap::new();
    for &p in paths {
        let (ok, detail) = check(p);
        pass &= ok;
        details.insert(p, detail);
    }
    (pass, details)
}

fn s07_proc() -> Check {
    let (mut pass, mut reads) = check_paths(
        &[
            "/proc/kcore",
            "/proc/keys",
            "/proc/sched_debug",
            "/proc/timer_list",
        ],
        |p| {
            let r = read_head(p);
            (!matches!(&r, Ok(b) if !b.is_empty()), describe_read(&r))
        },
    );
    let ksyms = read_head("/proc/kallsyms");
    let addrs_zero = match &ksyms {
        Ok(b) => String::from_utf8_lossy(b).lines().take(200).all(|l| {
            l.split(' ')
                .next()
                .is_some_and(|a| a.bytes().all(|c| c == b'0'))
        }),
        Err(_) => true,
    };
    pass &= addrs_zero;
    reads.insert(
        "/proc/kallsyms",
        json!({ "read": describe_read(&ksyms), "addresses_all_zero": addrs_zero }),
    );
    let (unwritable, writes) = check_paths(
        &[
            "/proc/sys/kernel/hostname",
            "/proc/sysrq-trigger",
            "/proc/sys/kernel/core_pattern",
            "/proc/sys/vm/drop_caches",
        ],
        |p| {
            let (w, d) = writable_for_real(p);
            (!w, d)
        },
    );
    pass &= unwritable;
    let proc_sys_ro = mounts()
        .iter()
        .rev()
        .find(|m| m.mount_point == "/proc/sys")
        .map(|m| m.options.contains(&"ro".to_owned()));
    Check {
        id: "S-07",
        pass,
        detail: json!({ "reads": reads, "writes": writes, "proc_sys_read_only_mount": proc_sys_ro }),
    }
}

fn describe_node(path: &Path) -> Option<String> {
    let m = fs::symlink_metadata(path).ok()?;
    let ft = m.file_type();
    let (ma, mi) = sys::major_minor(m.rdev());
    Some(if ft.is_char_device() {
        format!("c {ma}:{mi}")
    } else if ft.is_block_device() {
        format!("b {ma}:{mi}")
    } else if ft.is_dir() {
        "d".to_owned()
    } else if ft.is_symlink() {
        format!(
            "l -> {}",
            fs::read_link(path)
                .map(|t| t.display().to_string())
                .unwrap_or_default()
        )
    } else {
        "f".to_owned()
    })
}

fn list_dev() -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![("/dev".to_owned(), 0)];
    while let Some((dir, depth)) = stack.pop() {
        let Ok(rd) = fs::read_dir(&dir) else { continue };
        for e in rd.flatten() {
            let p = e.path();
            let name = p.display().to_string();
            let Some(kind) = describe_node(&p) else {
                continue;
            };
            if kind == "d" && depth < 2 && out.len() < 512 {
                stack.push((name.clone(), depth + 1));
            }
            out.insert(name, kind);
        }
    }
    out
}

fn s08_devices() -> Check {
    let (mut pass, opens) = check_paths(
        &[
            "/dev/kvm",
            "/dev/mem",
            "/dev/kmem",
            "/dev/port",
            "/dev/kmsg",
            "/dev/vda",
            "/dev/sda",
            "/dev/nvme0n1",
            "/dev/loop0",
            "/dev/loop-control",
            "/dev/net/tun",
            "/dev/fuse",
            "/dev/vhost-vsock",
            "/dev/dm-0",
        ],
        |p| {
            let r = fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
                .open(p);
            match r {
                Ok(_) => (false, json!("opened")),
                Err(e) => {
                    let errno = errno_of(&e);
                    let ok = matches!(errno, libc::ENOENT | libc::EACCES | libc::EPERM);
                    (ok, json!({ "errno": errno }))
                }
            }
        },
    );
    let dev = list_dev();
    let block: Vec<&String> = dev
        .iter()
        .filter(|(_, k)| k.starts_with("b "))
        .map(|(n, _)| n)
        .collect();
    pass &= block.is_empty();
    let expected = [
        "/dev/null",
        "/dev/zero",
        "/dev/full",
        "/dev/random",
        "/dev/urandom",
        "/dev/tty",
        "/dev/ptmx",
        "/dev/console",
    ];
    let unexpected_char: Vec<&String> = dev
        .iter()
        .filter(|(n, k)| {
            k.starts_with("c ") && !expected.contains(&n.as_str()) && !n.starts_with("/dev/pts/")
        })
        .map(|(n, _)| n)
        .collect();
    Check {
        id: "S-08",
        pass,
        detail: json!({ "open": opens, "block_devices": block, "unexpected_char_devices": unexpected_char, "dev": dev }),
    }
}

fn s10_secrets(o: &Options) -> Check {
    let env: Vec<(String, String)> = std::env::vars_os()
        .map(|(k, v)| {
            (
                k.to_string_lossy().into_owned(),
                v.to_string_lossy().into_owned(),
            )
        })
        .collect();
    let names_seen: Vec<&String> = o
        .secret_env
        .iter()
        .filter(|n| env.iter().any(|(k, _)| k == *n))
        .collect();
    let values_in: Vec<&String> = env
        .iter()
        .filter(|(_, v)| {
            o.secret_values
                .iter()
                .any(|s| !s.is_empty() && v.contains(s.as_str()))
        })
        .map(|(k, _)| k)
        .collect();
    // Other processes' environments (the agent's, pid 1), where readable.
    let mut leaking_pids = Vec::new();
    for pid in visible_pids() {
        let Ok(raw) = fs::read(format!("/proc/{pid}/environ")) else {
            continue;
        };
        let text = String::from_utf8_lossy(&raw);
        let leak = text.split('\0').any(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            o.secret_env.iter().any(|n| n == k)
                || o.secret_values
                    .iter()
                    .any(|s| !s.is_empty() && v.contains(s.as_str()))
        });
        if leak {
            leaking_pids.push(pid);
        }
    }
    let files_visible: Vec<&String> = o
        .host_files
        .iter()
        .filter(|p| fs::symlink_metadata(p).is_ok())
        .collect();
    let suspicious: Vec<&String> = env
        .iter()
        .map(|(k, _)| k)
        .filter(|k| {
            let u = k.to_uppercase();
            [
                "TOKEN",
                "SECRET",
                "PASSWORD",
                "API_KEY",
                "ACCESS_KEY",
                "CREDENTIAL",
            ]
            .iter()
            .any(|s| u.contains(s))
        })
        .collect();
    Check {
        id: "S-10",
        pass: names_seen.is_empty()
            && values_in.is_empty()
            && leaking_pids.is_empty()
            && files_visible.is_empty(),
        detail: json!({
            "secret_names_visible": names_seen,
            "secret_values_in": values_in,
            "pids_with_secrets_in_environ": leaking_pids,
            "host_files_visible": files_visible,
            "suspicious_env_names": suspicious,
            "env_count": env.len(),
        }),
    }
}

/// Character devices an inherited fd may point at even when the node is not this sandbox's
/// (null, zero, full, random, urandom, tty, ptmx, any pty slave).
fn harmless_char_device(rdev: u64) -> bool {
    matches!(
        sys::major_minor(rdev),
        (1, 3 | 5 | 7 | 8 | 9) | (5, 0 | 2) | (136..=143, _)
    )
}

fn c01_fds() -> Check {
    let fds: Vec<String> = fs::read_dir("/proc/self/fd")
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    let mut pass = true;
    let mut seen = BTreeMap::new();
    for fd in fds {
        let link = format!("/proc/self/fd/{fd}");
        let Ok(target) = fs::read_link(&link) else {
            continue;
        }; // the listing's own fd, closed
        let t = target.to_string_lossy().into_owned();
        let verdict = if ["pipe:", "socket:", "anon_inode:"]
            .iter()
            .any(|p| t.starts_with(p))
        {
            "ok"
        } else if t.starts_with('/') && !t.ends_with(" (deleted)") {
            match fs::metadata(&link) {
                Ok(m) if m.file_type().is_char_device() && harmless_char_device(m.rdev()) => "ok",
                Ok(_) if same_file(Path::new(&link), &target) => "ok",
                _ => "outside",
            }
        } else if t.starts_with("/memfd:") {
            "ok"
        } else {
            "outside"
        };
        pass &= verdict == "ok";
        seen.insert(fd, json!({ "target": t, "verdict": verdict }));
    }
    let cwd = fs::read_link("/proc/self/cwd")
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default();
    let cwd_ok = cwd.starts_with('/') && same_file(Path::new("."), Path::new(&cwd));
    let root = fs::read_link("/proc/self/root")
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default();
    Check {
        id: "C-01",
        pass: pass && cwd_ok && root == "/",
        detail: json!({ "fds": seen, "cwd": cwd, "cwd_inside": cwd_ok, "root": root }),
    }
}

/// How `p` is masked: `/dev/null` bound over a file, an empty read-only tmpfs over a directory,
/// or absent; false for anything else.
fn masked(p: &str) -> (bool, Value) {
    match fs::metadata(p) {
        Err(e) => (true, json!({ "absent_errno": errno_of(&e) })),
        Ok(m) if m.file_type().is_char_device() && sys::major_minor(m.rdev()) == (1, 3) => {
            (true, json!("/dev/null"))
        }
        Ok(m) if m.is_dir() => {
            let empty = fs::read_dir(p)
                .map(|mut d| d.next().is_none())
                .unwrap_or(false);
            let (ty, ro) = sys::fs_type_and_ro(p).unwrap_or((0, false));
            let ok = empty && ro && ty == libc::TMPFS_MAGIC;
            (
                ok,
                json!({ "dir": { "empty": empty, "read_only": ro, "tmpfs": ty == libc::TMPFS_MAGIC } }),
            )
        }
        Ok(m) => (false, json!({ "unmasked": format!("{:?}", m.file_type()) })),
    }
}

fn c03_masked_paths() -> Check {
    let (pass, out) = check_paths(
        &[
            "/proc/acpi",
            "/proc/asound",
            "/proc/kcore",
            "/proc/keys",
            "/proc/latency_stats",
            "/proc/timer_list",
            "/proc/timer_stats",
            "/proc/sched_debug",
            "/proc/scsi",
            "/sys/firmware",
            "/sys/devices/virtual/powercap",
        ],
        masked,
    );
    Check {
        id: "C-03",
        pass,
        detail: json!(out),
    }
}

fn c04_sys_and_release_agent() -> Check {
    let sys_state = match fs::read_dir("/sys") {
        Err(e) => json!({ "absent_errno": errno_of(&e) }),
        Ok(d) => {
            json!({ "entries": d.flatten().take(32).map(|e| e.file_name().to_string_lossy().into_owned()).collect::<Vec<_>>() })
        }
    };
    let sys_ok = sys_state.get("absent_errno").is_some()
        || sys_state
            .get("entries")
            .and_then(Value::as_array)
            .is_some_and(Vec::is_empty);
    let mut agents = vec!["/sys/fs/cgroup/release_agent".to_owned()];
    if let Ok(rd) = fs::read_dir("/sys/fs/cgroup") {
        agents.extend(
            rd.flatten()
                .map(|e| format!("{}/release_agent", e.path().display())),
        );
    }
    let mut writable = Vec::new();
    let mut found = Vec::new();
    for a in &agents {
        if fs::symlink_metadata(a).is_err() {
            continue;
        }
        found.push(a.clone());
        if writable_for_real(a).0 {
            writable.push(a.clone());
        }
    }
    let v1: Vec<String> = mounts()
        .into_iter()
        .filter(|m| m.fstype == "cgroup")
        .map(|m| m.mount_point)
        .collect();
    Check {
        id: "C-04",
        pass: sys_ok && writable.is_empty(),
        detail: json!({ "sys": sys_state, "release_agents": found, "writable_release_agents": writable, "cgroup_v1_mounts": v1 }),
    }
}

fn c05_tiocsti() -> Check {
    let mut tried = Vec::new();
    let mut pass = true;
    let mut record = |what: &str, sti: Result<i32, i32>, linux: Result<i32, i32>| {
        pass &= sti.is_err() && linux == Err(libc::EPERM);
        tried.push(
            json!({ "fd": what, "tiocsti": sti.err().map_or(json!("allowed"), |e| json!(e)),
                           "tioclinux": linux.err().map_or(json!("allowed"), |e| json!(e)) }),
        );
    };
    // fd 0 may be the host terminal: only touch it when a filter stops the call before it runs.
    if sys::seccomp_active() {
        let stdin = std::io::stdin();
        record(
            "0",
            sys::ioctl_with_byte(stdin.as_fd(), libc::TIOCSTI, b'#'),
            sys::ioctl_with_byte(stdin.as_fd(), 0x541c, 0),
        );
    }
    let pty = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOCTTY)
        .open("/dev/ptmx");
    let pty_note = match pty {
        Ok(master) => match sys::unlock_pty(master.as_fd()) {
            Ok(n) => match fs::OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_NOCTTY)
                .open(format!("/dev/pts/{n}"))
            {
                Ok(slave) => {
                    record(
                        &format!("pty slave /dev/pts/{n}"),
                        sys::ioctl_with_byte(slave.as_fd(), libc::TIOCSTI, b'#'),
                        sys::ioctl_with_byte(slave.as_fd(), 0x541c, 0),
                    );
                    json!("tested")
                }
                Err(e) => json!({ "open_slave_errno": errno_of(&e) }),
            },
            Err(e) => json!({ "unlock_errno": e }),
        },
        Err(e) => json!({ "open_ptmx_errno": errno_of(&e) }),
    };
    let any = !tried.is_empty();
    Check {
        id: "C-05",
        pass: pass && any,
        detail: json!({ "tried": tried, "pty": pty_note }),
    }
}
