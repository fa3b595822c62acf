//! System calls `dsec-agent` needs when it is PID 1 of a VM guest (the `microvm` and `vm`
//! substrates): mounting the guest's root, loading the virtio modules the initramfs carries,
//! switching root, and taking a fresh identity after a snapshot restore (hostname, clock,
//! entropy).
//!
//! None of this runs on the host: the guest kernel is the isolation boundary there, and the
//! agent is the only process in the guest until it starts commands.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// `MS_RDONLY`.
pub const MS_RDONLY: u64 = libc::MS_RDONLY;
/// `MS_NOSUID`.
pub const MS_NOSUID: u64 = libc::MS_NOSUID;
/// `MS_NODEV`.
pub const MS_NODEV: u64 = libc::MS_NODEV;
/// `MS_NOEXEC`.
pub const MS_NOEXEC: u64 = libc::MS_NOEXEC;
/// `MS_REMOUNT`.
pub const MS_REMOUNT: u64 = libc::MS_REMOUNT;

fn cpath(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

fn cstr(s: &str) -> io::Result<CString> {
    CString::new(s).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

fn ok(rc: libc::c_int) -> io::Result<()> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// `mount(2)`: mounts `source` of type `fstype` on `target` with `flags` and `data`.
pub fn mount(source: &str, target: &Path, fstype: &str, flags: u64, data: &str) -> io::Result<()> {
    let (s, t, f, d) = (cstr(source)?, cpath(target)?, cstr(fstype)?, cstr(data)?);
    // SAFETY: every pointer is a valid NUL-terminated string for the duration of the call.
    ok(unsafe {
        libc::mount(
            s.as_ptr(),
            t.as_ptr(),
            f.as_ptr(),
            flags as libc::c_ulong,
            d.as_ptr().cast(),
        )
    })
}

/// `mount(2)` without a filesystem type or data: moves, binds and bind remounts.
fn mount_flags(source: Option<&Path>, target: &Path, flags: libc::c_ulong) -> io::Result<()> {
    let s = source.map(cpath).transpose()?;
    let t = cpath(target)?;
    // SAFETY: the paths are valid NUL-terminated strings (or null for no source) for the
    // duration of the call; these operations take no fstype or data.
    ok(unsafe {
        libc::mount(
            s.as_ref().map_or(std::ptr::null(), |s| s.as_ptr()),
            t.as_ptr(),
            std::ptr::null(),
            flags,
            std::ptr::null(),
        )
    })
}

/// Moves the mount at `from` to `to` (`MS_MOVE`).
pub fn move_mount(from: &Path, to: &Path) -> io::Result<()> {
    mount_flags(Some(from), to, libc::MS_MOVE)
}

/// Bind-mounts `from` on `to`.
pub fn bind_mount(from: &Path, to: &Path) -> io::Result<()> {
    mount_flags(Some(from), to, libc::MS_BIND)
}

/// Makes the mount at `target` read-only (this mount point only, not its filesystem).
pub fn remount_bind_read_only(target: &Path) -> io::Result<()> {
    mount_flags(
        None,
        target,
        libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY,
    )
}

/// Makes `new_root` the root of the calling process: the initramfs (`rootfs`) cannot be
/// `pivot_root`ed away, so this is the classic `switch_root` sequence — chdir into the new
/// root, move its mount over `/`, chroot to `.`.
pub fn switch_root(new_root: &Path) -> io::Result<()> {
    std::env::set_current_dir(new_root)?;
    move_mount(Path::new("."), Path::new("/"))?;
    let dot = cstr(".")?;
    // SAFETY: valid NUL-terminated path.
    ok(unsafe { libc::chroot(dot.as_ptr()) })?;
    std::env::set_current_dir("/")
}

/// Loads a kernel module from an open `.ko` file (`finit_module(2)`). A module that is already
/// loaded is not an error.
pub fn load_module(file: BorrowedFd<'_>) -> io::Result<()> {
    let params = cstr("")?;
    // SAFETY: a borrowed open fd, a valid empty parameter string and no flags.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_finit_module,
            file.as_raw_fd(),
            params.as_ptr(),
            0 as libc::c_int,
        )
    };
    if rc < 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EEXIST) {
            return Ok(());
        }
        return Err(e);
    }
    Ok(())
}

/// Sets the hostname (UTS namespace of the caller).
pub fn set_hostname(name: &str) -> io::Result<()> {
    // SAFETY: a valid buffer of `name.len()` bytes.
    ok(unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) })
}

/// Sets `CLOCK_REALTIME` to `unix_ns` nanoseconds since the epoch. A guest restored from a
/// snapshot wakes up with the clock of the moment the snapshot was taken.
pub fn set_realtime(unix_ns: u128) -> io::Result<()> {
    let ts = libc::timespec {
        tv_sec: (unix_ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (unix_ns % 1_000_000_000) as libc::c_long,
    };
    // SAFETY: a valid timespec for the duration of the call.
    ok(unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) })
}

/// Mixes `seed` into the kernel's entropy pool and credits it (`RNDADDENTROPY`), so clones of
/// one snapshot do not share their random state. `random` is an open `/dev/random` or
/// `/dev/urandom`.
pub fn add_entropy(random: BorrowedFd<'_>, seed: &[u8]) -> io::Result<()> {
    let seed = &seed[..seed.len().min(512)];
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let words = seed.len().div_ceil(4);
    let mut buf = vec![0u32; 2 + words];
    buf[0] = (seed.len() * 8) as u32;
    buf[1] = seed.len() as u32;
    for (i, chunk) in seed.chunks(4).enumerate() {
        let mut w = [0u8; 4];
        w[..chunk.len()].copy_from_slice(chunk);
        buf[2 + i] = u32::from_ne_bytes(w);
    }
    // RNDADDENTROPY = _IOW('R', 0x03, int[2])
    const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
    // SAFETY: `buf` is a rand_pool_info of the size it declares, valid for the call.
    ok(unsafe { libc::ioctl(random.as_raw_fd(), RNDADDENTROPY as _, buf.as_ptr()) })?;
    // Credited entropy only reaches the CRNG at its next scheduled reseed (up to a minute
    // later): reseed now, so that the very next read differs between clones.
    // RNDRESEEDCRNG = _IO('R', 0x07)
    const RNDRESEEDCRNG: libc::c_ulong = 0x5207;
    // SAFETY: the ioctl takes no argument.
    ok(unsafe { libc::ioctl(random.as_raw_fd(), RNDRESEEDCRNG as _) })
}

/// Brings the loopback interface up (the guest has no other network interface).
pub fn loopback_up() -> io::Result<()> {
    // SAFETY: socket with constant arguments.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: ifreq is plain data; zeroed is valid.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    ifr.ifr_name[0] = b'l' as libc::c_char;
    ifr.ifr_name[1] = b'o' as libc::c_char;
    ifr.ifr_ifru.ifru_flags =
        (libc::IFF_UP | libc::IFF_LOOPBACK | libc::IFF_RUNNING) as libc::c_short;
    // SAFETY: SIOCSIFFLAGS reads a valid ifreq.
    let rc = unsafe { libc::ioctl(fd, libc::SIOCSIFFLAGS, &ifr) };
    let err = io::Error::last_os_error();
    // SAFETY: closing our own socket.
    unsafe { libc::close(fd) };
    if rc < 0 {
        return Err(err);
    }
    Ok(())
}

/// Gives interface `name` the address `addr/32` (replacing the one it had: a guest restored
/// from a running guest's snapshot may carry another) and brings it up.
pub fn set_ipv4_up(name: &str, addr: std::net::Ipv4Addr) -> io::Result<()> {
    if name.is_empty() || name.len() > 15 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "bad interface name",
        ));
    }
    // SAFETY: socket with constant arguments.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: we own the fresh socket; it is closed when `sock` drops.
    let sock = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    let ifreq = || {
        // SAFETY: ifreq is plain data; zeroed is valid.
        let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
        for (d, s) in ifr.ifr_name.iter_mut().zip(name.bytes()) {
            *d = s as libc::c_char;
        }
        ifr
    };
    let sin = |a: std::net::Ipv4Addr| {
        // SAFETY: sockaddr is plain data; zeroed is valid.
        let mut sa: libc::sockaddr = unsafe { std::mem::zeroed() };
        sa.sa_family = libc::AF_INET as libc::sa_family_t;
        // sockaddr_in: the port (2 bytes, 0), then the address.
        for (d, s) in sa.sa_data[2..6].iter_mut().zip(a.octets()) {
            *d = s as libc::c_char;
        }
        sa
    };
    let mut ifr = ifreq();
    ifr.ifr_ifru.ifru_addr = sin(addr);
    // SAFETY: SIOCSIFADDR reads a valid ifreq.
    ok(unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFADDR, &ifr) })?;
    let mut ifr = ifreq();
    ifr.ifr_ifru.ifru_netmask = sin(std::net::Ipv4Addr::BROADCAST);
    // SAFETY: SIOCSIFNETMASK reads a valid ifreq.
    ok(unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFNETMASK, &ifr) })?;
    let mut ifr = ifreq();
    ifr.ifr_ifru.ifru_flags = (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
    // SAFETY: SIOCSIFFLAGS reads a valid ifreq.
    ok(unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &ifr) })
}

/// Whether the host end of a virtio-serial port is connected: `poll` reports `POLLHUP` on the
/// port while it is not.
pub fn port_host_connected(port: BorrowedFd<'_>, timeout_ms: i32) -> io::Result<bool> {
    let mut p = libc::pollfd {
        fd: port.as_raw_fd(),
        events: libc::POLLOUT,
        revents: 0,
    };
    // SAFETY: one valid pollfd for the duration of the call.
    let rc = unsafe { libc::poll(&mut p, 1, timeout_ms) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EINTR) {
            return Ok(false);
        }
        return Err(e);
    }
    Ok(rc > 0 && p.revents & libc::POLLHUP == 0)
}

/// A pressure-stall trigger on the guest's memory (`/proc/pressure/memory`, "full"): it fires
/// when every runnable task of the guest together spent `stall` waiting on memory (reclaim,
/// refaults of evicted file pages) within one `window`. A guest with no swap whose RAM is full
/// of anonymous memory can thrash for minutes before the kernel's OOM killer runs, because
/// evicting and refaulting the root image's file pages counts as reclaim progress; the stall is
/// what shows it at once.
#[derive(Debug)]
pub struct MemoryStallTrigger(std::fs::File);

impl MemoryStallTrigger {
    /// Registers the trigger (the kernel takes a window of 500 ms to 10 s, `stall` below it).
    pub fn new(stall: std::time::Duration, window: std::time::Duration) -> io::Result<Self> {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/proc/pressure/memory")?;
        f.write_all(format!("full {} {}\0", stall.as_micros(), window.as_micros()).as_bytes())?;
        Ok(Self(f))
    }

    /// Blocks until the trigger fires (at most once per window).
    pub fn wait(&self) -> io::Result<()> {
        let mut pfd = libc::pollfd {
            fd: self.0.as_raw_fd(),
            events: libc::POLLPRI,
            revents: 0,
        };
        loop {
            // SAFETY: one valid pollfd for the duration of the call; the fd is owned by `self`.
            let rc = unsafe { libc::poll(&mut pfd, 1, -1) };
            if rc > 0 {
                if pfd.revents & libc::POLLERR != 0 {
                    return Err(io::Error::other("the memory pressure trigger was removed"));
                }
                return Ok(());
            }
            let e = io::Error::last_os_error();
            if rc < 0 && e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}
