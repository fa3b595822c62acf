//! Process control for `dsec-agent`: subreaping, SIGCHLD handling, `wait4` with rusage, signals,
//! the child set-up of [`crate::spawn::Spawn`] (cwd by fd, rlimits), fd 3 hand-over for
//! [`std::process::Command`],
//! non-blocking pipes and `poll`.
//!
//! Everything here is a thin, safe wrapper; the agent never calls `libc` directly.

use std::collections::HashSet;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::Mutex;
use std::time::Duration;

/// Errors of the process-control wrappers.
#[derive(Debug, thiserror::Error)]
pub enum ProcError {
    /// `prctl(PR_SET_CHILD_SUBREAPER)` failed.
    #[error("set child subreaper")]
    SetSubreaper(#[source] io::Error),
    /// `prctl(PR_SET_DUMPABLE)` failed.
    #[error("mark the process not dumpable")]
    SetNotDumpable(#[source] io::Error),
    /// `setrlimit` failed.
    #[error("set resource limit {resource}")]
    SetRlimit {
        /// The resource.
        resource: libc::__rlimit_resource_t,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// Changing the signal mask failed.
    #[error("block SIGCHLD")]
    BlockSigchld(#[source] io::Error),
    /// Waiting for SIGCHLD failed.
    #[error("wait for SIGCHLD")]
    WaitSigchld(#[source] io::Error),
    /// `wait4` failed.
    #[error("wait4")]
    Wait(#[source] io::Error),
    /// `kill` failed.
    #[error("kill pid {pid} with signal {signal}")]
    Kill {
        /// Target pid (negative: process group).
        pid: i32,
        /// Signal number.
        signal: i32,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `kill(-1)` was refused because the caller is not PID 1 of a pid namespace.
    #[error("kill(-1) refused: this process is pid {pid}, not 1")]
    NotInit {
        /// The caller's pid.
        pid: i32,
    },
    /// Taking ownership of an inherited fd failed.
    #[error("take inherited fd {fd}")]
    TakeFd {
        /// The fd number.
        fd: RawFd,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `fcntl` on a pipe failed.
    #[error("set O_NONBLOCK")]
    SetNonblocking(#[source] io::Error),
    /// `poll` failed.
    #[error("poll")]
    Poll(#[source] io::Error),
}

/// Marks the calling process as a child subreaper: orphaned descendants are re-parented to it.
pub fn set_child_subreaper() -> Result<(), ProcError> {
    // SAFETY: PR_SET_CHILD_SUBREAPER takes one integer argument and touches no memory.
    let rc = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1 as libc::c_ulong, 0, 0, 0) };
    if rc != 0 {
        return Err(ProcError::SetSubreaper(io::Error::last_os_error()));
    }
    Ok(())
}

/// The caller's pid as seen in its pid namespace.
pub fn getpid() -> i32 {
    // SAFETY: getpid has no preconditions and cannot fail.
    unsafe { libc::getpid() }
}

fn sigchld_set() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data; sigemptyset fully initialises it before use.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid, writable sigset_t; SIGCHLD is a valid signal number.
    unsafe {
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGCHLD);
    }
    set
}

/// Blocks SIGCHLD in the calling thread. Call it in `main` before any thread is spawned so every
/// thread inherits the mask and the signal stays pending for [`wait_sigchld`].
/// (`std::process::Command` resets the mask in children.)
pub fn block_sigchld() -> Result<(), ProcError> {
    let set = sigchld_set();
    // SAFETY: `set` is an initialised sigset_t; the old-mask pointer may be null.
    let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    if rc != 0 {
        return Err(ProcError::BlockSigchld(io::Error::from_raw_os_error(rc)));
    }
    Ok(())
}

/// Waits until SIGCHLD is pending (and consumes it) or `timeout` passes. Returns true when a
/// SIGCHLD was received. SIGCHLD must be blocked (see [`block_sigchld`]).
pub fn wait_sigchld(timeout: Duration) -> Result<bool, ProcError> {
    let set = sigchld_set();
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `set` and `ts` are valid for the call; the siginfo pointer may be null.
    let rc = unsafe { libc::sigtimedwait(&set, std::ptr::null_mut(), &ts) };
    if rc >= 0 {
        return Ok(true);
    }
    let err = io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::EAGAIN) | Some(libc::EINTR) => Ok(false),
        _ => Err(ProcError::WaitSigchld(err)),
    }
}

/// How a reaped process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitStatus {
    /// Exited with this code.
    Exited(i32),
    /// Killed by this signal.
    Signaled(i32),
}

/// Resource usage of a reaped process (and its waited-for descendants).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Rusage {
    /// User CPU time, microseconds.
    pub utime_us: u64,
    /// System CPU time, microseconds.
    pub stime_us: u64,
    /// Peak resident set size, KiB.
    pub maxrss_kb: u64,
}

fn tv_us(tv: libc::timeval) -> u64 {
    (tv.tv_sec.max(0) as u64) * 1_000_000 + tv.tv_usec.max(0) as u64
}

/// Reaps one exited child without blocking: `wait4(-1, WNOHANG)`. `Ok(None)` when no child has
/// exited (or there are no children at all).
pub fn reap_any() -> Result<Option<(i32, WaitStatus, Rusage)>, ProcError> {
    loop {
        let mut status: libc::c_int = 0;
        // SAFETY: rusage is plain data, written by the kernel on success.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `status` and `ru` are valid writable locations for the duration of the call.
        let pid = unsafe { libc::wait4(-1, &mut status, libc::WNOHANG, &mut ru) };
        if pid == 0 {
            return Ok(None);
        }
        if pid < 0 {
            let err = io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::ECHILD) => return Ok(None),
                Some(libc::EINTR) => continue,
                _ => return Err(ProcError::Wait(err)),
            }
        }
        let ws = if libc::WIFEXITED(status) {
            WaitStatus::Exited(libc::WEXITSTATUS(status))
        } else if libc::WIFSIGNALED(status) {
            WaitStatus::Signaled(libc::WTERMSIG(status))
        } else {
            // Stopped/continued are not requested (no WUNTRACED/WCONTINUED); keep waiting.
            continue;
        };
        let usage = Rusage {
            utime_us: tv_us(ru.ru_utime),
            stime_us: tv_us(ru.ru_stime),
            maxrss_kb: ru.ru_maxrss.max(0) as u64,
        };
        return Ok(Some((pid, ws, usage)));
    }
}

/// True when the caller has at least one child (running or zombie).
pub fn has_children() -> bool {
    // SAFETY: siginfo_t is plain data written by the kernel.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: `info` is valid and writable; WNOWAIT leaves any zombie in place.
    let rc = unsafe {
        libc::waitid(
            libc::P_ALL,
            0,
            &mut info,
            libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
        )
    };
    !(rc < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ECHILD))
}

/// Sends `signal` to `pid` (must be > 0). `ESRCH` is reported as `Ok(false)`.
pub fn kill(pid: i32, signal: i32) -> Result<bool, ProcError> {
    if pid <= 0 {
        return Err(ProcError::Kill {
            pid,
            signal,
            source: io::Error::from_raw_os_error(libc::EINVAL),
        });
    }
    raw_kill(pid, signal)
}

/// Sends `signal` to process group `pgid` (must be > 1). `ESRCH` is reported as `Ok(false)`.
pub fn killpg(pgid: i32, signal: i32) -> Result<bool, ProcError> {
    if pgid <= 1 {
        return Err(ProcError::Kill {
            pid: -pgid,
            signal,
            source: io::Error::from_raw_os_error(libc::EINVAL),
        });
    }
    raw_kill(-pgid, signal)
}

/// `kill(-1, signal)`: every process the caller may signal except itself. Refused unless the
/// caller is PID 1 (inside a pid namespace that means "everything in the sandbox"; on a host it
/// would mean "the whole machine").
pub fn kill_all_as_init(signal: i32) -> Result<bool, ProcError> {
    let pid = getpid();
    if pid != 1 {
        return Err(ProcError::NotInit { pid });
    }
    raw_kill(-1, signal)
}

fn raw_kill(pid: i32, signal: i32) -> Result<bool, ProcError> {
    // SAFETY: kill touches no memory; callers above restrict `pid` to the intended targets.
    let rc = unsafe { libc::kill(pid, signal) };
    if rc == 0 {
        return Ok(true);
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::ESRCH) {
        return Ok(false);
    }
    Err(ProcError::Kill {
        pid,
        signal,
        source: err,
    })
}

/// What a child does before its exec ([`crate::spawn::Spawn::setup`]).
#[derive(Debug, Default)]
pub struct ChildSetup {
    /// `fchdir` to this directory (opened with `O_CLOEXEC`; closed by exec).
    pub cwd: Option<OwnedFd>,
    /// RLIMIT_CPU in seconds: soft limit (SIGXCPU); the hard limit is one second later (SIGKILL).
    pub cpu_limit_secs: Option<u64>,
    /// RLIMIT_NOFILE (soft and hard) for the command.
    pub nofile: Option<u64>,
    /// RLIMIT_FSIZE (soft and hard) for the command.
    pub fsize: Option<u64>,
    /// Become this user (groups, gid, uid — in that order) before the exec.
    pub user: Option<Credentials>,
    /// Clear every capability set (ambient included) before the exec: the caller holds
    /// capabilities its commands must not (a sandbox's agent keeps those it needs to start a
    /// command as another user).
    pub drop_caps: bool,
}

/// Who a command runs as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credentials {
    /// User id.
    pub uid: u32,
    /// Primary group id.
    pub gid: u32,
    /// Supplementary groups (at most [`MAX_GROUPS`]).
    pub groups: Vec<u32>,
}

/// Most supplementary groups a command gets.
pub const MAX_GROUPS: usize = 64;

/// Whether `setgroups(2)` is refused in the caller's user namespace (`/proc/self/setgroups`
/// is `deny`, as in a sandbox's: its processes keep no supplementary group, so there are none
/// to drop either).
pub fn setgroups_denied() -> bool {
    static DENIED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *DENIED.get_or_init(|| {
        std::fs::read_to_string("/proc/self/setgroups").is_ok_and(|s| s.trim() == "deny")
    })
}

/// Whether capability number `cap` is in the calling thread's bounding set.
pub fn bounding_has(cap: u32) -> bool {
    // SAFETY: prctl with integer arguments only.
    unsafe { libc::prctl(libc::PR_CAPBSET_READ, libc::c_ulong::from(cap)) > 0 }
}

/// Changes the owner of what `fd` refers to (an `O_PATH` descriptor too).
pub fn fchown(fd: std::os::fd::BorrowedFd<'_>, uid: u32, gid: u32) -> io::Result<()> {
    // SAFETY: fchownat with AT_EMPTY_PATH on a valid descriptor and an empty C string.
    if unsafe { libc::fchownat(fd.as_raw_fd(), c"".as_ptr(), uid, gid, libc::AT_EMPTY_PATH) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The calling thread's supplementary groups (at most [`MAX_GROUPS`]).
pub fn thread_groups() -> Vec<u32> {
    let mut g = vec![0u32; MAX_GROUPS];
    // SAFETY: getgroups into a buffer of `g.len()` gids.
    let n = unsafe { libc::getgroups(g.len() as libc::c_int, g.as_mut_ptr()) };
    g.truncate(usize::try_from(n).unwrap_or(0));
    g
}

/// Gives the calling thread back file-system ids equal to its effective ids, and `groups`.
pub fn restore_thread_fs_ids(groups: &[u32]) -> io::Result<()> {
    // SAFETY: no arguments.
    let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
    set_thread_fs_ids(uid, gid, groups)
}

/// The header of `capget`/`capset` (`_LINUX_CAPABILITY_VERSION_3`, the calling thread).
#[repr(C)]
pub(crate) struct CapHeader {
    version: u32,
    pid: i32,
}

impl CapHeader {
    pub(crate) const V3: CapHeader = CapHeader {
        version: 0x2008_0522,
        pid: 0,
    };
}

/// One of the two data structs of `capget`/`capset` (capabilities 0–31, then 32–63).
#[repr(C)]
#[derive(Default, Clone, Copy)]
pub(crate) struct CapData {
    pub(crate) effective: u32,
    pub(crate) permitted: u32,
    pub(crate) inheritable: u32,
}

/// The capabilities of the calling thread: `(effective, permitted)` as bit masks.
pub fn own_caps() -> io::Result<(u64, u64)> {
    let (e, p, _) = capget()?;
    Ok((e, p))
}

fn capget() -> io::Result<(u64, u64, u64)> {
    let mut header = CapHeader::V3;
    let mut data = [CapData::default(); 2];
    // SAFETY: capget with a v3 header and room for two data structs, as the ABI requires.
    let rc = unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    let join = |f: fn(&CapData) -> u32| u64::from(f(&data[0])) | (u64::from(f(&data[1])) << 32);
    Ok((
        join(|d| d.effective),
        join(|d| d.permitted),
        join(|d| d.inheritable),
    ))
}

/// Sets the calling thread's filesystem ids (the ids its file accesses are checked as and what
/// it creates is owned by) and supplementary groups; raw system calls, so only this thread
/// changes. Needs `CAP_SETUID`/`CAP_SETGID` unless the ids are the thread's own.
pub fn set_thread_fs_ids(uid: u32, gid: u32, groups: &[u32]) -> io::Result<()> {
    let rc = if setgroups_denied() {
        0
    } else {
        // SAFETY: setgroups with a valid array of `groups.len()` gids.
        unsafe {
            libc::syscall(
                libc::SYS_setgroups,
                groups.len() as libc::size_t,
                groups.as_ptr(),
            )
        }
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // setfs*id answer the previous id, never an error: read back to check.
    // SAFETY: integer arguments only.
    unsafe {
        libc::syscall(libc::SYS_setfsgid, gid);
        libc::syscall(libc::SYS_setfsuid, uid);
        let now_gid = libc::syscall(libc::SYS_setfsgid, u32::MAX) as u32;
        let now_uid = libc::syscall(libc::SYS_setfsuid, u32::MAX) as u32;
        if now_uid != uid || now_gid != gid {
            return Err(io::Error::from_raw_os_error(libc::EPERM));
        }
    }
    Ok(())
}

/// Makes `fd` the child's fd 3 (without `FD_CLOEXEC`). Used to hand the protocol socket to
/// `dsec-agent`.
pub fn pass_fd3(cmd: &mut Command, fd: OwnedFd) {
    let hook = move || -> io::Result<()> {
        let raw = fd.as_raw_fd();
        if raw == 3 {
            // SAFETY: fcntl on an fd owned by the closure; async-signal-safe.
            if unsafe { libc::fcntl(3, libc::F_SETFD, 0) } != 0 {
                return Err(io::Error::last_os_error());
            }
        // SAFETY: dup2 is async-signal-safe; `raw` is open (owned by the closure) and fd 3 is
        // replaced atomically; the duplicate does not carry FD_CLOEXEC.
        } else if unsafe { libc::dup2(raw, 3) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    };
    // SAFETY: the hook only calls async-signal-safe functions (fcntl, dup2) and does not
    // allocate.
    unsafe {
        cmd.pre_exec(hook);
    }
}

static TAKEN_FDS: Mutex<Option<HashSet<RawFd>>> = Mutex::new(None);

/// Takes ownership of an fd inherited from the parent (e.g. the protocol socket on fd 3), checks
/// that it is open and marks it close-on-exec so children do not inherit it. Each fd number can
/// be taken once per process.
pub fn take_inherited_fd(fd: RawFd) -> Result<OwnedFd, ProcError> {
    let mut taken = TAKEN_FDS.lock().unwrap_or_else(|p| p.into_inner());
    let set = taken.get_or_insert_with(HashSet::new);
    if fd < 0 || set.contains(&fd) {
        return Err(ProcError::TakeFd {
            fd,
            source: io::Error::from_raw_os_error(libc::EBADF),
        });
    }
    // SAFETY: F_SETFD on an arbitrary fd number touches no memory; EBADF if it is not open.
    if unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) } != 0 {
        return Err(ProcError::TakeFd {
            fd,
            source: io::Error::last_os_error(),
        });
    }
    set.insert(fd);
    // SAFETY: the fd is open (fcntl succeeded), was inherited at exec and is owned by nothing
    // else in this process; the TAKEN_FDS registry guarantees a single OwnedFd is ever made.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Sets `O_NONBLOCK` on `fd`.
pub fn set_nonblocking(fd: BorrowedFd<'_>) -> Result<(), ProcError> {
    // SAFETY: F_GETFL/F_SETFL on a borrowed, open fd touch no memory.
    unsafe {
        let flags = libc::fcntl(fd.as_raw_fd(), libc::F_GETFL);
        if flags < 0 {
            return Err(ProcError::SetNonblocking(io::Error::last_os_error()));
        }
        if libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) < 0 {
            return Err(ProcError::SetNonblocking(io::Error::last_os_error()));
        }
    }
    Ok(())
}

/// Interest for [`poll`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Interest {
    /// Readable (or hung up).
    Read,
    /// Writable (or error).
    Write,
}

/// Polls `fds`; returns, per entry, whether it is ready (readable/writable, hung up or in error).
/// `None` timeout blocks indefinitely. EINTR is reported as "nothing ready".
pub fn poll(
    fds: &[(BorrowedFd<'_>, Interest)],
    timeout: Option<Duration>,
) -> Result<Vec<bool>, ProcError> {
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|(fd, i)| libc::pollfd {
            fd: fd.as_raw_fd(),
            events: match i {
                Interest::Read => libc::POLLIN,
                Interest::Write => libc::POLLOUT,
            },
            revents: 0,
        })
        .collect();
    let ms = timeout.map_or(-1, |t| t.as_millis().min(i32::MAX as u128) as libc::c_int);
    // SAFETY: `pfds` is a valid array of `pfds.len()` pollfd structs for the whole call, and the
    // fds are borrowed (open) for its duration.
    let rc = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, ms) };
    if rc < 0 {
        let err = io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EINTR) {
            return Ok(vec![false; fds.len()]);
        }
        return Err(ProcError::Poll(err));
    }
    Ok(pfds.iter().map(|p| p.revents != 0).collect())
}

/// Marks the calling process not dumpable: its `/proc/<pid>/mem`, `environ`, `fd/` and the like
/// are then out of reach of processes without `CAP_SYS_PTRACE`, even under the same uid. The agent
/// does this so that sandboxed code (uid 0 inside, no capabilities) cannot rewrite PID 1's
/// memory through `/proc/1/mem`. Commands it starts become dumpable again at exec.
pub fn set_not_dumpable() -> Result<(), ProcError> {
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0 as libc::c_ulong) } != 0 {
        return Err(ProcError::SetNotDumpable(io::Error::last_os_error()));
    }
    Ok(())
}

/// Sets the calling process's soft and hard limit of `resource` to `value` (lowering needs no
/// privilege); children inherit it.
pub fn set_own_rlimit(resource: libc::__rlimit_resource_t, value: u64) -> Result<(), ProcError> {
    let lim = libc::rlimit {
        rlim_cur: value as libc::rlim_t,
        rlim_max: value as libc::rlim_t,
    };
    // SAFETY: a valid rlimit struct.
    if unsafe { libc::setrlimit(resource, &lim) } != 0 {
        return Err(ProcError::SetRlimit {
            resource,
            source: io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// How long thread `tid` has run plus waited to run on a CPU since it started, in
/// nanoseconds (the first two fields of `/proc/<tid>/schedstat`); `None` once it is gone.
pub fn sched_time_ns(tid: i32) -> Option<u64> {
    parse_schedstat(&std::fs::read_to_string(format!("/proc/{tid}/schedstat")).ok()?)
}

/// How many times thread `tid` gave up its CPU to wait for something (its
/// `voluntary_ctxt_switches`); `None` once it is gone.
pub fn voluntary_switches(tid: i32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{tid}/status")).ok()?;
    parse_voluntary(&text)
}

/// The `voluntary_ctxt_switches` of a `/proc/<tid>/status` text.
fn parse_voluntary(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))?
        .trim()
        .parse()
        .ok()
}

/// Whether thread `tid` is running or waiting to run (state `R` in `/proc/<tid>/stat`); `None`
/// once it is gone.
pub fn runnable(tid: i32) -> Option<bool> {
    parse_stat_state(&std::fs::read_to_string(format!("/proc/{tid}/stat")).ok()?).map(|s| s == 'R')
}

/// The state letter of a `/proc/<tid>/stat` line (the field after the parenthesised name, which
/// may itself hold spaces and parentheses).
fn parse_stat_state(text: &str) -> Option<char> {
    text[text.rfind(')')? + 1..].trim_start().chars().next()
}

/// Run plus wait time of a `schedstat` line (`<run ns> <wait ns> <timeslices>`).
fn parse_schedstat(text: &str) -> Option<u64> {
    let mut f = text.split_whitespace().map(str::parse::<u64>);
    Some(f.next()?.ok()?.saturating_add(f.next()?.ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedstat_is_run_plus_wait() {
        assert_eq!(parse_schedstat("1000 250 7\n"), Some(1250));
        assert_eq!(parse_schedstat("1000\n"), None);
        assert_eq!(parse_schedstat("x 1 2"), None);
        assert!(sched_time_ns(getpid()).is_some());
    }

    #[test]
    fn voluntary_switches_parse() {
        let t = "Name:\tx\nvoluntary_ctxt_switches:\t17\nnonvoluntary_ctxt_switches:\t3\n";
        assert_eq!(parse_voluntary(t), Some(17));
        assert_eq!(parse_voluntary("Name:\tx\n"), None);
        assert!(voluntary_switches(getpid()).is_some());
    }

    #[test]
    fn stat_state_follows_the_last_parenthesis() {
        assert_eq!(parse_stat_state("12 (a) b) R 1 2"), Some('R'));
        assert_eq!(parse_stat_state("12 (sh) S 1"), Some('S'));
        assert_eq!(parse_stat_state("12 (sh"), None);
        // SAFETY: gettid has no preconditions.
        assert_eq!(runnable(unsafe { libc::gettid() }), Some(true));
    }

    #[test]
    fn kill_all_refused_outside_init() {
        if getpid() != 1 {
            assert!(matches!(
                kill_all_as_init(0),
                Err(ProcError::NotInit { .. })
            ));
        }
    }

    #[test]
    fn killpg_rejects_dangerous_targets() {
        assert!(killpg(0, 0).is_err());
        assert!(killpg(1, 0).is_err());
        assert!(kill(-1, 0).is_err());
        assert!(kill(0, 0).is_err());
    }
}
