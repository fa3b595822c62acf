//! The probe's thin wrappers over raw system calls. The probe is single-threaded (it never
//! spawns a thread), which is what makes `fork` without `exec` sound here.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

/// How a forked child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Exited with this code (the probe's children exit with an errno, 0 for success).
    Exited(i32),
    /// Killed by this signal.
    Signaled(i32),
    /// Still running at the deadline; it was SIGKILLed.
    TimedOut,
    /// `fork` itself failed with this errno.
    ForkFailed(i32),
}

impl Outcome {
    /// True if the child was killed by `SIGSYS` (a seccomp `KILL_PROCESS`).
    pub fn killed_by_seccomp(self) -> bool {
        self == Outcome::Signaled(libc::SIGSYS)
    }

    /// A short stable description: `"sigsys"`, `"errno 38"`, `"ok"`, `"signal 14"`, ...
    pub fn describe(self) -> String {
        match self {
            Outcome::Exited(0) => "ok".to_owned(),
            Outcome::Exited(c) => format!("errno {c}"),
            Outcome::Signaled(s) if s == libc::SIGSYS => "sigsys".to_owned(),
            Outcome::Signaled(s) => format!("signal {s}"),
            Outcome::TimedOut => "timeout".to_owned(),
            Outcome::ForkFailed(e) => format!("fork failed: errno {e}"),
        }
    }
}

/// Whether a seccomp filter is on this process (`Seccomp: 2` in `/proc/self/status`): the sign
/// of running in a sandbox, which the checks that touch many system calls or devices wait for.
pub fn seccomp_active() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .any(|l| {
            l.split_once(':')
                .is_some_and(|(k, v)| k == "Seccomp" && v.trim() == "2")
        })
}

/// The calling thread's errno after a failed call.
pub fn errno() -> i32 {
    io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// Exits the calling process with `code` through the raw `exit` system call, which even
/// seccomp strict mode allows. Skips atexit handlers and stdio flushing.
pub fn raw_exit(code: i32) -> ! {
    loop {
        // SAFETY: exit terminates the (single-threaded) process; no Rust state is observed after.
        unsafe { libc::syscall(libc::SYS_exit, code) };
    }
}

/// Runs `f` in a forked child and reports how the child ended. The child exits with `f`'s return
/// value (use an errno, 0 for success). Core dumps are disabled in the child (SIGSYS dumps core),
/// SIGALRM and SIGSYS get their default dispositions, and the child is SIGKILLed after `timeout`.
pub fn in_child(timeout: Duration, f: impl FnOnce() -> i32) -> Outcome {
    // SAFETY: the probe is single-threaded, so the child is a complete copy of the only thread and
    // may allocate and run arbitrary code before it exits through `raw_exit`.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Outcome::ForkFailed(errno());
    }
    if pid == 0 {
        // SAFETY: PR_SET_DUMPABLE takes an integer; resetting dispositions of SIGALRM/SIGSYS and
        // unblocking all signals touches only the child's own signal state.
        unsafe {
            libc::prctl(libc::PR_SET_DUMPABLE, 0 as libc::c_ulong, 0, 0, 0);
            libc::signal(libc::SIGALRM, libc::SIG_DFL);
            libc::signal(libc::SIGSYS, libc::SIG_DFL);
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigprocmask(libc::SIG_SETMASK, &set, std::ptr::null_mut());
        }
        raw_exit(f());
    }
    let deadline = Instant::now() + timeout;
    let mut sleep = Duration::from_micros(50);
    loop {
        let mut status = 0;
        // SAFETY: `status` is a valid writable int; `pid` is our own child.
        let rc = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if rc == pid {
            if libc::WIFEXITED(status) {
                return Outcome::Exited(libc::WEXITSTATUS(status));
            }
            if libc::WIFSIGNALED(status) {
                return Outcome::Signaled(libc::WTERMSIG(status));
            }
        } else if rc < 0 && errno() != libc::EINTR {
            return Outcome::ForkFailed(errno());
        }
        if Instant::now() >= deadline {
            // SAFETY: `pid` is our unreaped child, so the pid cannot have been reused.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            // SAFETY: as above; blocks until the killed child is reaped.
            unsafe { libc::waitpid(pid, &mut status, 0) };
            return Outcome::TimedOut;
        }
        std::thread::sleep(sleep);
        sleep = (sleep * 2).min(Duration::from_millis(5));
    }
}

/// `syscall(nr, args...)`: `Ok(return value)` or `Err(errno)`.
///
/// # Safety
/// The call with these arguments must not invalidate memory or fds the caller still uses: the
/// probe passes null pointers, invalid ids or closed fds, or makes the call in a forked child
/// that exits right after it.
pub unsafe fn raw_syscall(nr: i64, a: [u64; 6]) -> Result<i64, i32> {
    // SAFETY: the caller guarantees the call is harmless to this process's memory and fds.
    let rc = unsafe { libc::syscall(nr, a[0], a[1], a[2], a[3], a[4], a[5]) };
    if rc < 0 {
        Err(errno())
    } else {
        Ok(rc)
    }
}

/// Closes every fd of the calling process (`close_range(0, ~0, 0)`).
pub fn close_all_fds() {
    // Ignoring failure: the caller only wants fewer fds, and old kernels without close_range
    // leave the fds in place, which merely makes fd-taking calls succeed on them.
    // SAFETY: closing fds touches no memory; the callers (forked children) own every fd and
    // use none after this.
    let _ = unsafe { raw_syscall(libc::SYS_close_range, [0, u64::from(u32::MAX), 0, 0, 0, 0]) };
}

/// Arms `ITIMER_REAL` to fire once after `ms` milliseconds.
pub fn arm_alarm_ms(ms: u64) {
    let it = libc::itimerval {
        it_interval: libc::timeval {
            tv_sec: 0,
            tv_usec: 0,
        },
        it_value: libc::timeval {
            tv_sec: (ms / 1000) as libc::time_t,
            tv_usec: ((ms % 1000) * 1000) as libc::suseconds_t,
        },
    };
    // SAFETY: `it` is a valid itimerval; the old-value pointer may be null.
    unsafe { libc::setitimer(libc::ITIMER_REAL, &it, std::ptr::null_mut()) };
}

/// Executes the i386 `getpid` (20) through `int 0x80` and returns the raw result.
pub fn int80_getpid() -> i64 {
    let ret: i64;
    // SAFETY: `int 0x80` with eax=20 is the i386 getpid, which reads no memory; the kernel's
    // compat entry may clobber r8-r11, declared as clobbered outputs. Without IA32 emulation it
    // raises SIGSEGV, and under the dsec filter SIGSYS; callers run it in a forked child.
    unsafe {
        std::arch::asm!(
            "int 0x80",
            inlateout("rax") 20i64 => ret,
            lateout("r8") _, lateout("r9") _, lateout("r10") _, lateout("r11") _,
            options(nostack),
        );
    }
    ret
}

/// `ioctl(fd, request, &int)` with a one-byte/int argument; `Err(errno)` on failure.
pub fn ioctl_with_byte(fd: BorrowedFd<'_>, request: u64, byte: u8) -> Result<i32, i32> {
    let mut arg: libc::c_int = libc::c_int::from(byte);
    // SAFETY: `arg` is a live, writable int for the call; TIOCSTI reads one byte from it and
    // TIOCLINUX reads/writes at most a few bytes of it; `fd` is open.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), request as _, &mut arg as *mut libc::c_int) };
    if rc < 0 {
        Err(errno())
    } else {
        Ok(rc)
    }
}

/// `socket(domain, type | SOCK_CLOEXEC, protocol)`.
pub fn socket(domain: i32, ty: i32, protocol: i32) -> Result<OwnedFd, i32> {
    // SAFETY: socket takes integers only.
    let fd = unsafe { libc::socket(domain, ty | libc::SOCK_CLOEXEC, protocol) };
    if fd < 0 {
        return Err(errno());
    }
    // SAFETY: `fd` was just returned by socket and is owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn cpath(path: &str) -> Result<std::ffi::CString, i32> {
    std::ffi::CString::new(path).map_err(|_| libc::EINVAL)
}

/// `mknod(path, mode, dev)`.
pub fn mknod(path: &str, mode: u32, dev: u64) -> Result<(), i32> {
    let c = cpath(path)?;
    // SAFETY: `c` is NUL-terminated and valid for the call.
    if unsafe { libc::mknod(c.as_ptr(), mode, dev) } != 0 {
        return Err(errno());
    }
    Ok(())
}

/// `sethostname(name)`.
pub fn sethostname(name: &str) -> Result<(), i32> {
    // SAFETY: `name` is valid for `name.len()` bytes for the call.
    if unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) } != 0 {
        return Err(errno());
    }
    Ok(())
}

/// `uname().nodename`.
pub fn nodename() -> String {
    // SAFETY: utsname is plain data, filled by uname on success.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: `u` is a valid writable utsname.
    if unsafe { libc::uname(&mut u) } != 0 {
        return String::new();
    }
    let bytes: Vec<u8> = u
        .nodename
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// `geteuid()`.
pub fn geteuid() -> u32 {
    // SAFETY: geteuid cannot fail and touches no memory.
    unsafe { libc::geteuid() }
}

/// `getpid()`.
pub fn getpid() -> i32 {
    // SAFETY: getpid cannot fail and touches no memory.
    unsafe { libc::getpid() }
}

/// `prctl(PR_SET_DUMPABLE, 0)`: no core dump when seccomp kills this process.
pub fn disable_core_dumps() {
    // SAFETY: PR_SET_DUMPABLE takes an integer argument only.
    unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0 as libc::c_ulong, 0, 0, 0) };
}

/// Unlocks the pty `master` and returns its slave number (`TIOCSPTLCK` 0, `TIOCGPTN`).
pub fn unlock_pty(master: BorrowedFd<'_>) -> Result<u32, i32> {
    let mut unlock: libc::c_int = 0;
    // SAFETY: TIOCSPTLCK reads an int from the live `unlock`; `master` is an open ptmx fd.
    if unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSPTLCK, &mut unlock) } != 0 {
        return Err(errno());
    }
    let mut n: libc::c_uint = 0;
    // SAFETY: TIOCGPTN writes an unsigned int into the live `n`.
    if unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCGPTN, &mut n) } != 0 {
        return Err(errno());
    }
    Ok(n)
}

/// `(statfs.f_type, read-only)` of the filesystem holding `path`.
pub fn fs_type_and_ro(path: &str) -> Result<(i64, bool), i32> {
    let c = cpath(path)?;
    // SAFETY: statfs/statvfs are plain data written by the kernel on success.
    let (mut sf, mut sv): (libc::statfs, libc::statvfs) = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is NUL-terminated; `sf` and `sv` are valid writable structs for the calls.
    if unsafe { libc::statfs(c.as_ptr(), &mut sf) } != 0
        // SAFETY: as above.
        || unsafe { libc::statvfs(c.as_ptr(), &mut sv) } != 0
    {
        return Err(errno());
    }
    Ok((sf.f_type, sv.f_flag & libc::ST_RDONLY != 0))
}

/// `(major, minor)` of a device number (glibc encoding).
/// The `mknod` system call itself (`at` false) or `mknodat(AT_FDCWD, …)` (glibc's `mknod` is
/// `mknodat`, so each number is called by hand).
pub fn mknod_call(at: bool, path: &str, mode: u32, dev: u64) -> Result<(), i32> {
    let c = cpath(path)?;
    // SAFETY: `c` is NUL-terminated and valid for the call; the other arguments are integers.
    let rc = unsafe {
        if at {
            libc::syscall(libc::SYS_mknodat, libc::AT_FDCWD, c.as_ptr(), mode, dev)
        } else {
            libc::syscall(libc::SYS_mknod, c.as_ptr(), mode, dev)
        }
    };
    if rc != 0 {
        return Err(errno());
    }
    Ok(())
}

pub fn major_minor(dev: u64) -> (u64, u64) {
    (
        ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff),
        (dev & 0xff) | ((dev >> 12) & !0xff),
    )
}

/// A device number from `(major, minor)` (glibc encoding).
pub fn makedev(major: u64, minor: u64) -> u64 {
    ((major & 0xfff) << 8) | ((major & !0xfff) << 32) | (minor & 0xff) | ((minor & !0xff) << 12)
}
