//! Spawning a command from the agent without copying the agent: `clone(CLONE_VM | CLONE_VFORK)`
//! (what `posix_spawn` does), with the set-up of [`ChildSetup`] applied in the child.
//!
//! `std::process::Command` forks as soon as a `pre_exec` hook is set, and the agent needs one
//! (rlimits, which `posix_spawn` cannot set, and a cwd by descriptor). A fork copies the agent's
//! page tables and write-protects its memory, so the agent then takes a copy-on-write fault on
//! every page it touches until the child has exec'd; measured on this project's machines, a
//! multi-threaded 2 MiB process spawning `/bin/true`: 1.69 ms with fork, 1.15 ms with
//! `CLONE_VFORK`. Here the child runs on its own small stack in the agent's memory, the calling
//! thread waits until the child has exec'd (or failed to), and nothing is copied.
//!
//! The child only makes system calls on data prepared before the clone: it allocates nothing,
//! takes no lock, and writes only its own stack (and `errno`, of the suspended parent thread).
//! All signals are blocked in the calling thread around the clone, so no handler of the agent
//! can run on the child's stack; the child resets every handled signal to its default before
//! it unblocks them.

use std::collections::BTreeMap;
use std::ffi::{CString, OsStr, OsString};
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};

use crate::proc::ChildSetup;

/// Size of the child's stack: it runs one small function of system calls.
const CHILD_STACK: usize = 64 * 1024;

/// `PATH` searched when the command's environment has none (the agent's default).
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// A command to start: program, arguments, environment and child set-up. Its standard streams
/// are pipes (or a pseudo-terminal, see [`Spawn::pty`]) and it always leads a new process
/// group.
#[derive(Debug)]
pub struct Spawn {
    program: OsString,
    args: Vec<OsString>,
    /// `None`: the caller's environment.
    env: Option<BTreeMap<OsString, OsString>>,
    setup: ChildSetup,
    /// Run on a new pseudo-terminal of this size (rows, columns).
    pty: Option<(u16, u16)>,
}

/// A started command: its pid and the parent's ends of its standard streams.
#[derive(Debug)]
pub struct Spawned {
    /// Pid (and process group id).
    pub pid: i32,
    /// Write end of the command's stdin.
    pub stdin: File,
    /// Read end of its stdout.
    pub stdout: File,
    /// Read end of its stderr.
    pub stderr: File,
}

impl Spawn {
    /// `program`: a path (with a `/`, relative to the command's cwd) or a name looked up in the
    /// command's `PATH`.
    pub fn new(program: impl AsRef<OsStr>) -> Self {
        Self {
            program: program.as_ref().to_owned(),
            args: Vec::new(),
            env: None,
            setup: ChildSetup::default(),
            pty: None,
        }
    }

    /// Adds one argument.
    pub fn arg(&mut self, a: impl AsRef<OsStr>) -> &mut Self {
        self.args.push(a.as_ref().to_owned());
        self
    }

    /// Adds arguments.
    pub fn args<I, S>(&mut self, args: I) -> &mut Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        for a in args {
            self.arg(a);
        }
        self
    }

    fn env_map(&mut self) -> &mut BTreeMap<OsString, OsString> {
        self.env
            .get_or_insert_with(|| std::env::vars_os().collect())
    }

    /// Starts from an empty environment.
    pub fn env_clear(&mut self) -> &mut Self {
        self.env = Some(BTreeMap::new());
        self
    }

    /// Sets variables.
    pub fn envs<I, K, V>(&mut self, vars: I) -> &mut Self
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<OsStr>,
        V: AsRef<OsStr>,
    {
        let map = self.env_map();
        for (k, v) in vars {
            map.insert(k.as_ref().to_owned(), v.as_ref().to_owned());
        }
        self
    }

    /// Removes a variable.
    pub fn env_remove(&mut self, k: impl AsRef<OsStr>) -> &mut Self {
        self.env_map().remove(k.as_ref());
        self
    }

    /// What the child does before its exec.
    pub fn setup(&mut self, setup: ChildSetup) -> &mut Self {
        self.setup = setup;
        self
    }

    /// The set-up, to amend.
    pub fn setup_mut(&mut self) -> &mut ChildSetup {
        &mut self.setup
    }

    /// Runs the command on a new pseudo-terminal of `rows` × `cols`: its stdin, stdout and
    /// stderr are the terminal (its controlling terminal: it leads a new session, and so its
    /// own process group); the parent's [`Spawned::stdin`] and [`Spawned::stdout`] are both the
    /// terminal's master (close-on-exec), [`Spawned::stderr`] an empty pipe. `TERM` defaults
    /// to `xterm-256color`.
    pub fn pty(&mut self, rows: u16, cols: u16) -> &mut Self {
        self.pty = Some((rows, cols));
        self
    }

    /// Starts the command. Returns when it has exec'd; an exec that failed (no such program,
    /// not executable) or a set-up step that failed is the error, with the child already reaped.
    /// The caller must keep any other reaper of its children from waiting for this one until
    /// this returns (the agent's reaper holds a gate).
    pub fn spawn(&self) -> io::Result<Spawned> {
        let cstring = |b: &[u8]| CString::new(b).map_err(|_| nul_in_command());
        if self.program.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "empty program name",
            ));
        }
        let mut argv = vec![cstring(self.program.as_bytes())?];
        for a in &self.args {
            argv.push(cstring(a.as_bytes())?);
        }
        let env: Vec<(OsString, OsString)> = match &self.env {
            Some(m) => m.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            None => std::env::vars_os().collect(),
        };
        let mut env = env;
        if self.pty.is_some() && !env.iter().any(|(k, _)| k == "TERM") {
            env.push(("TERM".into(), "xterm-256color".into()));
        }
        let mut envp = Vec::with_capacity(env.len());
        let mut path = None;
        for (k, v) in &env {
            if k == "PATH" {
                path = Some(v.clone());
            }
            let mut kv = k.clone().into_vec();
            kv.push(b'=');
            kv.extend_from_slice(v.as_bytes());
            envp.push(cstring(&kv)?);
        }
        let candidates = candidates(&self.program, path.as_deref())?;
        let argv_ptrs = null_terminated(&argv);
        let envp_ptrs = null_terminated(&envp);
        let cand_ptrs: Vec<*const libc::c_char> = candidates.iter().map(|c| c.as_ptr()).collect();

        // On a terminal, the child's three streams are its slave; the parent's ends are the
        // master twice and an empty pipe (its write end is closed below).
        let terminal = match self.pty {
            Some((rows, cols)) => Some(open_pty(rows, cols)?),
            None => None,
        };
        let ((in_r, in_w), (out_r, out_w)) = match &terminal {
            Some((master, slave)) => (
                (slave.try_clone()?, master.try_clone()?),
                (master.try_clone()?, slave.try_clone()?),
            ),
            None => (pipe()?, pipe()?),
        };
        let (err_r, err_w) = match &terminal {
            Some((_, slave)) => (pipe()?.0, slave.try_clone()?),
            None => pipe()?,
        };
        drop(terminal);
        let (report_r, report_w) = pipe()?;
        let ctx = ChildCtx {
            candidates: &cand_ptrs,
            argv: argv_ptrs.as_ptr(),
            envp: envp_ptrs.as_ptr(),
            stdio: [in_r.as_raw_fd(), out_w.as_raw_fd(), err_w.as_raw_fd()],
            report: report_w.as_raw_fd(),
            pty: self.pty.is_some(),
            cwd: self.setup.cwd.as_ref().map(AsRawFd::as_raw_fd),
            cpu: self.setup.cpu_limit_secs,
            nofile: self.setup.nofile,
            fsize: self.setup.fsize,
            user: self.setup.user.as_ref().map(|c| (c.uid, c.gid)),
            groups: match self.setup.user.as_ref() {
                Some(c) if !crate::proc::setgroups_denied() => {
                    &c.groups[..c.groups.len().min(crate::proc::MAX_GROUPS)]
                }
                _ => &[],
            },
            drop_caps: self.setup.drop_caps,
        };
        // A u128 buffer is 16-byte aligned, as the stack pointer must be.
        let mut stack = vec![0u128; CHILD_STACK / 16];
        let pid = {
            let _blocked = BlockAll::new()?;
            // SAFETY: `stack` outlives the child's use of it (CLONE_VFORK suspends this thread
            // until the child execs or exits, and only then is the buffer dropped); the stack
            // grows down from its end, which is 16-byte aligned; `ctx` and everything it points
            // to live until this function returns; `child_main` only makes system calls (see
            // the module docs).
            unsafe {
                let top = stack.as_mut_ptr().add(stack.len()).cast::<libc::c_void>();
                libc::clone(
                    child_main,
                    top,
                    libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
                    std::ptr::from_ref(&ctx).cast_mut().cast::<libc::c_void>(),
                )
            }
        };
        let clone_err = io::Error::last_os_error();
        drop(stack);
        drop((in_r, out_w, err_w, report_w));
        if pid < 0 {
            return Err(clone_err);
        }
        // The report pipe is close-on-exec: end of file means the exec succeeded, 8 bytes are
        // the failed step and its errno.
        let mut buf = [0u8; 8];
        let mut got = 0;
        while got < buf.len() {
            // SAFETY: reading into the unfilled rest of a stack buffer from an fd we own.
            let n = unsafe {
                libc::read(
                    report_r.as_raw_fd(),
                    buf[got..].as_mut_ptr().cast(),
                    buf.len() - got,
                )
            };
            match n {
                0 => break,
                n if n > 0 => got += n as usize,
                _ if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted => {}
                _ => break,
            }
        }
        if got == buf.len() {
            let mut status = 0;
            // SAFETY: waiting for our own child, which has exited (it wrote its report first).
            unsafe { libc::waitpid(pid, &mut status, 0) };
            let step = u32::from_ne_bytes([buf[0], buf[1], buf[2], buf[3]]);
            let errno = i32::from_ne_bytes([buf[4], buf[5], buf[6], buf[7]]);
            let e = io::Error::from_raw_os_error(errno);
            return Err(match step {
                STEP_EXEC => e,
                _ => io::Error::new(e.kind(), format!("{}: {e}", step_name(step))),
            });
        }
        Ok(Spawned {
            pid,
            stdin: File::from(in_w),
            stdout: File::from(out_r),
            stderr: File::from(err_r),
        })
    }
}

/// The paths an exec of `program` tries, in order (`execvp`'s search, done before the clone).
fn candidates(program: &OsStr, path: Option<&OsStr>) -> io::Result<Vec<CString>> {
    if program.as_bytes().contains(&b'/') {
        return Ok(vec![
            CString::new(program.as_bytes()).map_err(|_| nul_in_command())?
        ]);
    }
    let path = path.map_or(DEFAULT_PATH.as_bytes(), OsStrExt::as_bytes);
    let mut out = Vec::new();
    for dir in path.split(|&b| b == b':') {
        let mut p = if dir.is_empty() {
            b".".to_vec()
        } else {
            dir.to_vec()
        };
        p.push(b'/');
        p.extend_from_slice(program.as_bytes());
        out.push(CString::new(p).map_err(|_| nul_in_command())?);
    }
    Ok(out)
}

fn nul_in_command() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, "a NUL byte in the command")
}

fn null_terminated(v: &[CString]) -> Vec<*const libc::c_char> {
    v.iter()
        .map(|c| c.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect()
}

fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: pipe2 writes two fds into the array on success.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both fds are fresh and owned by nothing else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Opens a new pseudo-terminal of `rows` × `cols`: `(master, slave)`, both close-on-exec.
fn open_pty(rows: u16, cols: u16) -> io::Result<(OwnedFd, OwnedFd)> {
    // SAFETY: posix_openpt takes flags only and returns a new fd or -1.
    let fd = unsafe { libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is fresh and owned by nothing else.
    let master = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: grantpt on the master we own; it touches no memory of ours.
    let granted = unsafe { libc::grantpt(master.as_raw_fd()) } == 0;
    // SAFETY: as above, unlockpt.
    if !granted || unsafe { libc::unlockpt(master.as_raw_fd()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // The slave by the master (no path lookup: the right one even where /dev/pts is another
    // instance), else by its name.
    // SAFETY: TIOCGPTPEER takes open flags and returns a new fd or -1.
    let peer = unsafe {
        libc::ioctl(
            master.as_raw_fd(),
            libc::TIOCGPTPEER,
            libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC,
        )
    };
    let slave = if peer >= 0 {
        // SAFETY: `peer` is fresh and owned by nothing else.
        unsafe { OwnedFd::from_raw_fd(peer) }
    } else {
        let mut name = [0 as libc::c_char; 128];
        // SAFETY: ptsname_r writes at most `name.len()` bytes, NUL included, into `name`.
        let rc = unsafe { libc::ptsname_r(master.as_raw_fd(), name.as_mut_ptr(), name.len()) };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        // SAFETY: `name` holds a NUL-terminated path (ptsname_r succeeded).
        let fd = unsafe {
            libc::open(
                name.as_ptr(),
                libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is fresh and owned by nothing else.
        unsafe { OwnedFd::from_raw_fd(fd) }
    };
    set_window_size(master.as_fd(), rows, cols)?;
    Ok((master, slave))
}

/// Sets the window size of the terminal `fd` (a master or a slave); the terminal's foreground
/// process group gets `SIGWINCH`.
pub fn set_window_size(fd: BorrowedFd<'_>, rows: u16, cols: u16) -> io::Result<()> {
    let ws = libc::winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads one `winsize` from a pointer valid for the call, on a borrowed
    // open fd.
    if unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCSWINSZ, &ws) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Blocks every signal in the calling thread until dropped.
struct BlockAll {
    old: libc::sigset_t,
}

impl BlockAll {
    fn new() -> io::Result<Self> {
        // SAFETY: sigset_t is plain data; sigfillset/pthread_sigmask write only the given sets.
        unsafe {
            let mut all: libc::sigset_t = std::mem::zeroed();
            let mut old: libc::sigset_t = std::mem::zeroed();
            libc::sigfillset(&mut all);
            let rc = libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
            if rc != 0 {
                return Err(io::Error::from_raw_os_error(rc));
            }
            Ok(Self { old })
        }
    }
}

impl Drop for BlockAll {
    fn drop(&mut self) {
        // SAFETY: restores the mask saved by `new`.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &self.old, std::ptr::null_mut()) };
    }
}

/// What the child reads: raw pointers and numbers only, all prepared by the parent.
struct ChildCtx<'a> {
    candidates: &'a [*const libc::c_char],
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
    stdio: [RawFd; 3],
    report: RawFd,
    /// The streams are a terminal: lead a new session with it as its controlling terminal.
    pty: bool,
    cwd: Option<RawFd>,
    cpu: Option<u64>,
    nofile: Option<u64>,
    fsize: Option<u64>,
    /// `(uid, gid)` and the supplementary groups to become.
    user: Option<(u32, u32)>,
    groups: &'a [u32],
    drop_caps: bool,
}

const STEP_SIGMASK: u32 = 1;
const STEP_PGROUP: u32 = 2;
const STEP_STDIO: u32 = 3;
const STEP_RLIMIT: u32 = 4;
const STEP_CWD: u32 = 5;
const STEP_EXEC: u32 = 6;
const STEP_CTTY: u32 = 9;
const STEP_USER: u32 = 7;
const STEP_CAPS: u32 = 8;

fn step_name(step: u32) -> &'static str {
    match step {
        STEP_SIGMASK => "sigprocmask",
        STEP_PGROUP => "setpgid",
        STEP_STDIO => "dup2",
        STEP_RLIMIT => "setrlimit",
        STEP_CWD => "fchdir",
        STEP_CTTY => "setsid/TIOCSCTTY",
        STEP_USER => "setuid",
        STEP_CAPS => "capset",
        _ => "exec",
    }
}

/// The child: set-up, then exec. Only system calls (see the module docs).
extern "C" fn child_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the `ChildCtx` the parent keeps alive across the clone (CLONE_VFORK).
    let ctx = unsafe { &*arg.cast::<ChildCtx<'_>>() };
    let fail = |step: u32| -> libc::c_int {
        let errno = io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO);
        let mut msg = [0u8; 8];
        msg[..4].copy_from_slice(&step.to_ne_bytes());
        msg[4..].copy_from_slice(&errno.to_ne_bytes());
        // SAFETY: write/_exit are async-signal-safe; `msg` is on this stack.
        unsafe {
            libc::write(ctx.report, msg.as_ptr().cast(), msg.len());
            libc::_exit(127)
        }
    };
    // SAFETY: each call is a system call on values prepared by the parent or on this stack;
    // none allocates or takes a lock.
    unsafe {
        // Handlers of the agent must not run here: back to the defaults (ignored signals stay
        // ignored, as across any exec — but SIGPIPE, which the Rust runtime ignores, is reset,
        // as std does).
        // (glibc refuses to change its own two internal signals: they stay, and only fire on
        // thread cancellation and set*id calls, which the child does not make.)
        for sig in 1..=libc::SIGRTMAX() {
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(sig, std::ptr::null(), &mut old) != 0 {
                continue;
            }
            let h = old.sa_sigaction;
            if (h != libc::SIG_DFL && h != libc::SIG_IGN) || sig == libc::SIGPIPE {
                let mut dfl: libc::sigaction = std::mem::zeroed();
                dfl.sa_sigaction = libc::SIG_DFL;
                libc::sigaction(sig, &dfl, std::ptr::null_mut());
            }
        }
        // A new session also makes the child the leader of a new process group.
        if ctx.pty {
            if libc::setsid() < 0 {
                return fail(STEP_CTTY);
            }
        } else if libc::setpgid(0, 0) != 0 {
            return fail(STEP_PGROUP);
        }
        for (target, fd) in ctx.stdio.iter().enumerate() {
            if libc::dup2(*fd, target as libc::c_int) < 0 {
                return fail(STEP_STDIO);
            }
        }
        if ctx.pty && libc::ioctl(0, libc::TIOCSCTTY, 0) != 0 {
            return fail(STEP_CTTY);
        }
        // Commands are the OOM killer's first choice in their sandbox, before the agent (which
        // is also exempted outright where the supervisor holds CAP_SYS_RESOURCE). Raising a
        // score needs no privilege; a failure is not fatal.
        let fd = libc::open(
            c"/proc/self/oom_score_adj".as_ptr(),
            libc::O_WRONLY | libc::O_CLOEXEC,
        );
        if fd >= 0 {
            libc::write(fd, b"1000".as_ptr().cast(), 4);
            libc::close(fd);
        }
        for (resource, value, hard) in [
            (libc::RLIMIT_FSIZE, ctx.fsize, ctx.fsize),
            (libc::RLIMIT_NOFILE, ctx.nofile, ctx.nofile),
        ] {
            if let (Some(soft), Some(hard)) = (value, hard) {
                let lim = libc::rlimit {
                    rlim_cur: soft as libc::rlim_t,
                    rlim_max: hard as libc::rlim_t,
                };
                if libc::setrlimit(resource, &lim) != 0 {
                    return fail(STEP_RLIMIT);
                }
            }
        }
        if let Some(fd) = ctx.cwd {
            if libc::fchdir(fd) != 0 {
                return fail(STEP_CWD);
            }
        }
        if let Some(secs) = ctx.cpu {
            let lim = libc::rlimit {
                rlim_cur: secs as libc::rlim_t,
                rlim_max: secs.saturating_add(1) as libc::rlim_t,
            };
            if libc::setrlimit(libc::RLIMIT_CPU, &lim) != 0 {
                return fail(STEP_RLIMIT);
            }
        }
        // Raw system calls: glibc's set*id would signal the caller's other threads, which
        // share this memory. Groups, then gid, then uid (after which the rest is not allowed).
        if let Some((uid, gid)) = ctx.user {
            if (!ctx.groups.is_empty()
                && libc::syscall(libc::SYS_setgroups, ctx.groups.len(), ctx.groups.as_ptr()) != 0)
                || libc::syscall(libc::SYS_setresgid, gid, gid, gid) != 0
                || libc::syscall(libc::SYS_setresuid, uid, uid, uid) != 0
            {
                return fail(STEP_USER);
            }
        }
        if ctx.drop_caps {
            // Securebits may keep capabilities across the uid change above and across exec
            // (through the ambient set): clear every set explicitly.
            let header = crate::proc::CapHeader::V3;
            let data = [crate::proc::CapData::default(); 2];
            if libc::prctl(
                libc::PR_CAP_AMBIENT,
                libc::PR_CAP_AMBIENT_CLEAR_ALL,
                0,
                0,
                0,
            ) != 0
                || libc::syscall(libc::SYS_capset, &header, data.as_ptr()) != 0
            {
                return fail(STEP_CAPS);
            }
        }
        // The agent blocks SIGCHLD in all its threads (and all signals around this clone); a
        // command starts with an empty mask (otherwise `sleep 1 & wait` in a shell never
        // returns).
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        if libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut()) != 0 {
            return fail(STEP_SIGMASK);
        }
        // execvp's rules: a missing candidate moves on to the next; permission denied is
        // remembered and reported if nothing else runs; any other error stops the search.
        let mut denied = false;
        for &path in ctx.candidates {
            libc::execve(path, ctx.argv, ctx.envp);
            match io::Error::last_os_error().raw_os_error() {
                Some(libc::ENOENT | libc::ENOTDIR) => {}
                Some(libc::EACCES) => denied = true,
                _ => return fail(STEP_EXEC),
            }
        }
        if denied {
            *libc::__errno_location() = libc::EACCES;
        }
        fail(STEP_EXEC)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn output(mut s: Spawned) -> (String, i32) {
        drop(s.stdin);
        let mut out = String::new();
        s.stdout.read_to_string(&mut out).expect("read");
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(s.pid, &mut status, 0) };
        (out, libc::WEXITSTATUS(status))
    }

    #[test]
    fn runs_a_program_found_in_path_with_its_env_and_limits() {
        let mut s = Spawn::new("sh");
        s.args(["-c", "echo $A; ulimit -n; ulimit -t; pwd"])
            .env_clear()
            .envs([("A", "x"), ("PATH", "/usr/bin:/bin")])
            .setup(ChildSetup {
                cwd: Some(OwnedFd::from(File::open("/tmp").expect("open /tmp"))),
                cpu_limit_secs: Some(7),
                nofile: Some(64),
                fsize: None,
                ..ChildSetup::default()
            });
        let (out, code) = output(s.spawn().expect("spawn"));
        assert_eq!((out.as_str(), code), ("x\n64\n7\n/tmp\n", 0));
    }

    #[test]
    fn the_child_leads_its_process_group_and_starts_with_no_blocked_signal() {
        // The programs read their own status (a shell in between may block signals while it
        // forks).
        let mut s = Spawn::new("cut");
        s.args(["-d", " ", "-f5", "/proc/self/stat"]);
        let child = s.spawn().expect("spawn");
        let pid = child.pid;
        assert_eq!(output(child).0, format!("{pid}\n"));
        let mut s = Spawn::new("grep");
        s.args(["SigBlk", "/proc/self/status"]);
        assert_eq!(
            output(s.spawn().expect("spawn")).0,
            "SigBlk:\t0000000000000000\n"
        );
    }

    #[test]
    fn a_pty_child_has_a_controlling_terminal_of_the_size_asked() {
        let mut s = Spawn::new("sh");
        s.args([
            "-c",
            "test -t 0 && test -t 1 && stty size && echo $TERM; \
             read line; echo got $line",
        ])
        .env_clear()
        .envs([("PATH", "/usr/bin:/bin")])
        .pty(33, 101);
        let child = s.spawn().expect("spawn");
        let mut stdin = child.stdin;
        std::io::Write::write_all(&mut stdin, b"hi\n").expect("write");
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        let mut master = child.stdout;
        loop {
            match master.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
                // The slave's last holder exited.
                Err(e) if e.raw_os_error() == Some(libc::EIO) => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => panic!("read: {e}"),
            }
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(child.pid, &mut status, 0) };
        let text = String::from_utf8_lossy(&out).replace('\r', "");
        assert!(text.contains("33 101\nxterm-256color\n"), "{text:?}");
        assert!(text.contains("got hi\n"), "{text:?}");
        assert_eq!(libc::WEXITSTATUS(status), 0, "{text:?}");
        let mut empty = String::new();
        let mut err = child.stderr;
        err.read_to_string(&mut empty).expect("stderr");
        assert_eq!(empty, "");
    }

    #[test]
    fn a_program_that_cannot_run_is_an_error() {
        let e = Spawn::new("dsec-no-such-program")
            .spawn()
            .expect_err("missing");
        assert_eq!(e.kind(), io::ErrorKind::NotFound, "{e}");
        let e = Spawn::new("/nonexistent/x").spawn().expect_err("missing");
        assert_eq!(e.kind(), io::ErrorKind::NotFound, "{e}");
        let dir = std::env::temp_dir().join(format!("dsec-spawn-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let plain = dir.join("plain");
        std::fs::write(&plain, "not a program").expect("write");
        let e = Spawn::new(&plain).spawn().expect_err("not executable");
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{e}");
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(
            Spawn::new("a\0b").spawn().expect_err("nul").kind(),
            io::ErrorKind::InvalidInput
        );
    }
}
