//! What a VM guest's agent keeps of the boot ([`Guest`]: identity, disk quota, read-only root)
//! and its memory guard, the guest's memory limit; used by the connection's handlers.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use dsec_sys::guest::{self, MS_NODEV, MS_NOSUID, MS_REMOUNT};

/// The guest's path out (see `Request::GuestNet`): `eth0` (the virtio NIC every VM has) gets
/// `addr/32`, up, and a default route on-link through `gateway`.
pub fn set_net(addr: std::net::Ipv4Addr, gateway: std::net::Ipv4Addr) -> io::Result<()> {
    guest::set_ipv4_up("eth0", addr)?;
    let mut route = dsec_sys::netlink::route::Route::open()?;
    match route.add_route4(
        std::net::Ipv4Addr::UNSPECIFIED,
        0,
        Some(gateway),
        "eth0",
        true,
    ) {
        // A default route already (a snapshot's, or one the guest's root added).
        Err(e) if dsec_sys::netlink::errno(&e) == Some(libc::EEXIST) => Ok(()),
        r => r,
    }
}

/// Takes `eth0` down (see `Request::GuestNetOff`): its routes go with it, so connections fail
/// at once with no route.
pub fn set_net_off() -> io::Result<()> {
    dsec_sys::netlink::route::Route::open()?.set_down("eth0")
}

/// What the agent keeps of the boot: the writable layer's tmpfs, to resize it.
#[derive(Debug)]
pub struct Guest {
    pub(crate) upper: File,
    /// The writable layer is a disk of its own (its size is the disk quota), not a tmpfs.
    pub(crate) upper_disk: bool,
}

impl Guest {
    /// Takes the identity of a fresh sandbox (see `Request::Identify`).
    pub fn identify(
        &self,
        hostname: &str,
        unix_ns: u64,
        disk_bytes: u64,
        disk_inodes: u64,
        seed: &[u8],
    ) -> io::Result<()> {
        if hostname.is_empty() || hostname.len() > 64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "hostname must be 1..=64 bytes",
            ));
        }
        guest::set_hostname(hostname)?;
        guest::set_realtime(u128::from(unix_ns))?;
        if !seed.is_empty() {
            let random = OpenOptions::new().write(true).open("/dev/urandom")?;
            guest::add_entropy(random.as_fd(), seed)?;
        }
        if self.upper_disk {
            // The disk's size is the quota (the snapshot was made for it).
            return Ok(());
        }
        // The writable layer is a tmpfs in guest RAM: at most half of it, so that filling the
        // disk ends in ENOSPC, not in a guest with no memory left.
        let ram = mem_total();
        let disk_bytes = if ram > 0 {
            disk_bytes.min(ram / 2)
        } else {
            disk_bytes
        };
        let upper = PathBuf::from(format!("/proc/self/fd/{}", raw(&self.upper)));
        guest::mount(
            "tmpfs",
            &upper,
            "tmpfs",
            MS_REMOUNT | MS_NOSUID | MS_NODEV,
            &format!("size={disk_bytes},nr_inodes={disk_inodes}"),
        )
    }
}

impl Guest {
    /// Makes `/` read-only for everything but `scratch` (each becomes a writable bind mount of
    /// itself first), like a container's default root. Per mount point, not per filesystem:
    /// the writable layer stays writable underneath the scratch directories.
    pub fn read_only_root(&self, scratch: &[String]) -> io::Result<()> {
        for dir in scratch {
            if !dir.starts_with('/') || dir.contains("..") {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("bad scratch directory {dir:?}"),
                ));
            }
            fs::create_dir_all(dir)?;
            guest::bind_mount(Path::new(dir), Path::new(dir))?;
        }
        guest::remount_bind_read_only(Path::new("/"))
    }
}

/// Processes the agent's memory guard killed (see [`memory_guard`]).
static GUARD_KILLS: AtomicU64 = AtomicU64::new(0);

/// How long the guest's tasks may all wait on memory within [`STALL_WINDOW`] before the
/// memory guard kills the largest process.
const STALL_LIMIT: Duration = Duration::from_millis(300);
/// The window [`STALL_LIMIT`] is measured over.
const STALL_WINDOW: Duration = Duration::from_secs(1);

/// OOM kills in the guest: the kernel's (`oom_kill` in `/proc/vmstat`) and the memory guard's.
pub fn oom_kills() -> u64 {
    kernel_oom_kills() + GUARD_KILLS.load(Ordering::Relaxed)
}

/// The guest's memory limit, as the kernel's OOM killer would enforce it if it ran in time:
/// when the guest's tasks stall on memory for [`STALL_LIMIT`] of a [`STALL_WINDOW`] (a guest
/// without swap whose RAM is full thrashes on the root image's file pages, evicted and read
/// back, instead of running out), the process with the largest resident set, never the agent,
/// is killed and counted as an OOM kill.
pub(crate) fn memory_guard() {
    let trigger = match guest::MemoryStallTrigger::new(STALL_LIMIT, STALL_WINDOW) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("dsec-agent: no memory guard (the kernel's OOM killer alone): {e}");
            return;
        }
    };
    while trigger.wait().is_ok() {
        if let Some(pid) = largest_process() {
            if dsec_sys::proc::kill(pid, libc::SIGKILL).unwrap_or(false) {
                GUARD_KILLS.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// The process with the largest resident set other than the agent (kernel threads have none).
fn largest_process() -> Option<i32> {
    let me = std::process::id() as i32;
    fs::read_dir("/proc")
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| pid != me && pid != 1)
        .filter_map(|pid| {
            let statm = fs::read_to_string(format!("/proc/{pid}/statm")).ok()?;
            let rss: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
            (rss > 0).then_some((rss, pid))
        })
        .max()
        .map(|(_, pid)| pid)
}

/// The guest kernel's count of OOM kills (`oom_kill` in `/proc/vmstat`).
fn kernel_oom_kills() -> u64 {
    proc_value("/proc/vmstat", "oom_kill ")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Guest RAM in bytes (`MemTotal`).
fn mem_total() -> u64 {
    proc_value("/proc/meminfo", "MemTotal:")
        .and_then(|v| v.trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// The value after `key` on the first line of the `/proc` file `path` that starts with it,
/// trimmed.
fn proc_value(path: &str, key: &str) -> Option<String> {
    let text = fs::read_to_string(path).ok()?;
    let value = text.lines().find_map(|l| l.strip_prefix(key))?;
    Some(value.trim().to_owned())
}

fn raw(f: &File) -> i32 {
    use std::os::fd::AsRawFd;
    f.as_raw_fd()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The guard's victim is a process with a resident set, never the agent (itself) or PID 1.
    #[test]
    fn the_largest_process_is_never_the_agent() {
        let pid = largest_process().expect("a process");
        assert_ne!(pid, std::process::id() as i32);
        assert_ne!(pid, 1);
        let statm = fs::read_to_string(format!("/proc/{pid}/statm")).unwrap_or_default();
        let rss: u64 = statm
            .split_whitespace()
            .nth(1)
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        assert!(rss > 0 || !Path::new(&format!("/proc/{pid}")).exists());
    }
}
