//! Running commands: building the [`Spawn`] (argv/shell, env, confined cwd, CPU rlimit, own
//! process group), the per-process pump (stdin feed, capped head+tail capture, streaming, wall
//! timeout, output flood kill) and the mapping of an exit to an [`ExecResult`].
//!
//! The pump polls the stdout/stderr pipes and a wake pipe the reaper writes to when the main
//! process is reaped; it then drains what is readable for a few milliseconds and returns, so a
//! grandchild holding the pipes open never delays the result.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, ErrorKind, PipeReader, Read, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::RwLock;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dsec_api::exec::{Captured, ExecRequest, ExecResult, ExecStatus, Stream, OUTPUT_KILL_FACTOR};
use dsec_api::ErrorCode;
use dsec_sys::proc::{self, ChildSetup, Interest, WaitStatus};
use dsec_sys::spawn::Spawn;

use crate::files::{FileError, Root};
use crate::reaper::{lock, ExitSlot, Reaper, Spawned};

/// SIGKILL.
pub const SIGKILL: i32 = libc::SIGKILL;
/// Bytes read from a pipe at once (also the largest streamed `Output` chunk).
const READ_CHUNK: usize = 64 << 10;
/// Most stdin bytes queued for a background process.
const MAX_STDIN_QUEUE: usize = 32 << 20;
/// How long to keep draining pipes after the main process was reaped.
const DRAIN_GRACE: Duration = Duration::from_millis(20);
/// How long to wait for more bytes during the drain before giving up.
const DRAIN_IDLE: Duration = Duration::from_millis(3);
/// Environment variable naming the agent's root (tests only); never passed to children.
pub const ROOT_ENV: &str = "DSEC_AGENT_ROOT";

/// Per-command limits from `Configure` (0 = none). The agent itself runs with a larger open-files
/// limit (it needs descriptors for every command's pipes); the sandbox's is applied per command.
static COMMAND_NOFILE: AtomicU64 = AtomicU64::new(0);
static COMMAND_FSIZE: AtomicU64 = AtomicU64::new(0);

/// The base environment of commands once the node configured one (`None`: the agent's own).
static BASE_ENV: RwLock<Option<Vec<(String, String)>>> = RwLock::new(None);

/// The working directory of commands that name none (`None`: `/`).
static BASE_CWD: RwLock<Option<String>> = RwLock::new(None);

/// Applies a `Configure` request: base environment, working directory and limits of later
/// commands.
pub fn configure(
    env: Vec<(String, String)>,
    nofile: Option<u64>,
    fsize: Option<u64>,
    workdir: Option<String>,
) {
    COMMAND_NOFILE.store(nofile.unwrap_or(0), Ordering::Relaxed);
    COMMAND_FSIZE.store(fsize.unwrap_or(0), Ordering::Relaxed);
    if let Ok(mut g) = BASE_ENV.write() {
        *g = Some(env);
    }
    if let Ok(mut g) = BASE_CWD.write() {
        *g = workdir.filter(|w| w != "/");
    }
}

fn command_nofile() -> Option<u64> {
    match COMMAND_NOFILE.load(Ordering::Relaxed) {
        0 => None,
        n => Some(n),
    }
}

/// Errors starting or feeding a command.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// The request violates a bound.
    #[error("invalid exec request: {0}")]
    Invalid(String),
    /// The working directory could not be resolved.
    #[error("resolve cwd")]
    Cwd(#[source] FileError),
    /// fork/exec failed.
    #[error("spawn {program:?}")]
    Spawn {
        /// argv[0] or the shell.
        program: String,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// Too much stdin queued.
    #[error("stdin queue exceeds {MAX_STDIN_QUEUE} bytes")]
    StdinFull,
    /// Stdin was already closed.
    #[error("stdin is closed")]
    StdinClosed,
    /// The user to run as is unknown or malformed.
    #[error("{0}")]
    User(String),
}

impl ExecError {
    /// The wire code.
    pub fn code(&self) -> ErrorCode {
        match self {
            ExecError::Invalid(_) | ExecError::StdinClosed | ExecError::User(_) => {
                ErrorCode::InvalidRequest
            }
            ExecError::Cwd(e) => e.code(),
            ExecError::Spawn { .. } => ErrorCode::SpawnFailed,
            ExecError::StdinFull => ErrorCode::TooLarge,
        }
    }
}

/// Head + tail capture of one stream.
#[derive(Debug)]
pub struct Capture {
    cap: usize,
    head: Vec<u8>,
    tail: VecDeque<u8>,
    total: u64,
}

impl Capture {
    /// A capture keeping at most `cap` bytes.
    pub fn new(cap: u64) -> Self {
        let cap = usize::try_from(cap).unwrap_or(usize::MAX);
        Self {
            cap,
            head: Vec::new(),
            tail: VecDeque::new(),
            total: 0,
        }
    }

    /// Records bytes.
    pub fn push(&mut self, mut data: &[u8]) {
        self.total += data.len() as u64;
        let head_cap = self.cap / 2;
        if self.head.len() < head_cap {
            let n = (head_cap - self.head.len()).min(data.len());
            self.head.extend_from_slice(&data[..n]);
            data = &data[n..];
        }
        let tail_cap = self.cap - head_cap;
        if tail_cap == 0 {
            return;
        }
        if data.len() >= tail_cap {
            self.tail.clear();
            self.tail.extend(&data[data.len() - tail_cap..]);
            return;
        }
        let overflow = (self.tail.len() + data.len()).saturating_sub(tail_cap);
        self.tail.drain(..overflow);
        self.tail.extend(data);
    }

    /// Bytes seen so far.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// The wire form.
    pub fn finish(self) -> Captured {
        let truncated = self.total > (self.head.len() + self.tail.len()) as u64;
        let mut data = self.head;
        data.extend(self.tail);
        Captured {
            data,
            total: self.total,
            truncated,
        }
    }
}

/// Stdin bytes waiting to be written to a process, shared between the pump and `ProcStdin`.
#[derive(Debug, Default)]
pub struct StdinFeed {
    state: Mutex<FeedState>,
}

#[derive(Debug, Default)]
struct FeedState {
    buf: VecDeque<u8>,
    eof: bool,
    closed: bool,
}

impl StdinFeed {
    /// A feed holding `initial`, closed after it when `eof`.
    pub fn new(initial: Vec<u8>, eof: bool) -> Self {
        Self {
            state: Mutex::new(FeedState {
                buf: initial.into(),
                eof,
                closed: false,
            }),
        }
    }

    /// Writes `data` straight into `pipe` (a non-blocking duplicate of the pump's stdin) when
    /// nothing is queued ahead of it, queueing what the pipe does not take. True when bytes
    /// were queued (the caller then wakes the pump). Saves the pump a wake-up per input.
    pub fn push_direct(&self, data: &[u8], pipe: &File) -> Result<bool, ExecError> {
        let mut s = lock(&self.state);
        if s.closed || s.eof {
            return Err(ExecError::StdinClosed);
        }
        let mut rest = data;
        if s.buf.is_empty() {
            let mut w = pipe;
            while !rest.is_empty() {
                match w.write(rest) {
                    Ok(n) => rest = &rest[n..],
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    // Full (the pump writes the rest) or broken (the pump finds out).
                    Err(_) => break,
                }
            }
        }
        if rest.is_empty() {
            return Ok(false);
        }
        if s.buf.len() + rest.len() > MAX_STDIN_QUEUE {
            return Err(ExecError::StdinFull);
        }
        s.buf.extend(rest);
        Ok(true)
    }

    /// Queues bytes (and maybe end-of-file); the caller wakes the pump.
    pub fn push(&self, data: &[u8], eof: bool) -> Result<(), ExecError> {
        let mut s = lock(&self.state);
        if s.closed || s.eof {
            return Err(ExecError::StdinClosed);
        }
        if s.buf.len() + data.len() > MAX_STDIN_QUEUE {
            return Err(ExecError::StdinFull);
        }
        s.buf.extend(data);
        s.eof = eof;
        Ok(())
    }
}

/// Builds the command for `req`: program, env (agent env + request env, minus agent-internal
/// variables), confined cwd, CPU limit, piped stdio, own process group.
pub fn build_command(req: &ExecRequest, root: &Root) -> Result<(Spawn, String), ExecError> {
    req.validate().map_err(ExecError::Invalid)?;
    let (mut cmd, program) = match &req.command {
        dsec_api::exec::Command::Argv(argv) => {
            let mut c = Spawn::new(&argv[0]);
            c.args(&argv[1..]);
            (c, argv[0].clone())
        }
        dsec_api::exec::Command::Shell(s) => {
            let mut c = Spawn::new("/bin/sh");
            c.arg("-c").arg(s);
            (c, "/bin/sh".to_owned())
        }
    };
    prepare(
        &mut cmd,
        &req.env,
        req.cwd.as_deref(),
        req.cpu_limit_ms,
        root,
    )?;
    as_user(&mut cmd, req.user.as_deref(), &req.env, root)?;
    Ok((cmd, program))
}

/// Common child set-up for execs, background processes and sessions.
pub fn prepare(
    cmd: &mut Spawn,
    env: &std::collections::BTreeMap<String, String>,
    cwd: Option<&str>,
    cpu_limit_ms: Option<u64>,
    root: &Root,
) -> Result<(), ExecError> {
    let dir = match cwd {
        Some(c) => root.open_dir(c).map_err(ExecError::Cwd)?,
        // The template's workdir, or `/` where the sandbox has none such.
        None => match BASE_CWD.read().ok().and_then(|g| g.clone()) {
            Some(w) => match root.open_dir(&w) {
                Ok(d) => d,
                Err(_) => root.open_dir("/").map_err(ExecError::Cwd)?,
            },
            None => root.open_dir("/").map_err(ExecError::Cwd)?,
        },
    };
    if let Some(base) = BASE_ENV.read().ok().and_then(|g| g.clone()) {
        cmd.env_clear().envs(base);
    }
    cmd.env_remove(ROOT_ENV).envs(env);
    cmd.setup(ChildSetup {
        cwd: Some(dir),
        cpu_limit_secs: cpu_limit_ms.map(|ms| ms.div_ceil(1000)),
        nofile: command_nofile(),
        fsize: match COMMAND_FSIZE.load(Ordering::Relaxed) {
            0 => None,
            n => Some(n),
        },
        ..ChildSetup::default()
    });
    Ok(())
}

/// Runs the command as `user` (else the sandbox's default user; root when it has none):
/// its ids, and `HOME`, `USER`, `LOGNAME` unless `env` sets them; every capability the agent
/// holds is cleared in the command.
pub fn as_user(
    cmd: &mut Spawn,
    user: Option<&str>,
    env: &std::collections::BTreeMap<String, String>,
    root: &Root,
) -> Result<(), ExecError> {
    cmd.setup_mut().drop_caps = crate::users::drop_caps();
    let Some(name) = crate::users::effective(user) else {
        return Ok(());
    };
    let u = crate::users::resolve(root, &name).map_err(|e| ExecError::User(e.to_string()))?;
    for (k, v) in u.env() {
        if !env.contains_key(&k) {
            cmd.envs([(k, v)]);
        }
    }
    cmd.setup_mut().user = Some(u.credentials());
    Ok(())
}

/// A started process with its pipes.
pub struct Running {
    /// Pid (= process group id).
    pub pid: i32,
    /// Spawn time.
    pub started: Instant,
    /// Exit delivery.
    pub slot: Arc<ExitSlot>,
    wake: PipeReader,
    /// Stdin and stdout are a terminal's master (see [`dsec_sys::spawn::Spawn::pty`]): the
    /// end of input is a `^D`, not a close.
    pub pty: bool,
    stdin: Option<File>,
    stdout: Option<File>,
    stderr: Option<File>,
}

impl Running {
    /// A duplicate of the child's stdin pipe (non-blocking), for [`StdinFeed::push_direct`].
    pub fn stdin_pipe(&self) -> Option<File> {
        let fd = self.stdin.as_ref()?.as_fd().try_clone_to_owned().ok()?;
        Some(File::from(fd))
    }
}

/// Spawns `cmd` through the reaper.
pub fn start(reaper: &Reaper, cmd: &Spawn, program: &str) -> Result<Running, ExecError> {
    let spawn_err = |source| ExecError::Spawn {
        program: program.to_owned(),
        source,
    };
    let Spawned {
        child,
        slot,
        wake,
        started,
    } = reaper.spawn(cmd).map_err(spawn_err)?;
    let pid = child.pid;
    let (stdin, stdout, stderr) = (Some(child.stdin), Some(child.stdout), Some(child.stderr));
    for fd in [
        stdin.as_ref().map(|s| s.as_fd()),
        stdout.as_ref().map(|s| s.as_fd()),
        stderr.as_ref().map(|s| s.as_fd()),
    ]
    .into_iter()
    .flatten()
    {
        if let Err(e) = proc::set_nonblocking(fd) {
            let _ = proc::killpg(pid, SIGKILL);
            return Err(spawn_err(io::Error::other(e)));
        }
    }
    Ok(Running {
        pid,
        started,
        slot,
        wake,
        pty: false,
        stdin,
        stdout,
        stderr,
    })
}

/// Limits the pump enforces.
pub struct PumpLimits {
    /// Kill the group when this passes.
    pub deadline: Option<Instant>,
    /// Captured bytes per stream.
    pub cap: u64,
    /// Kill the group when a stream exceeds this many bytes.
    pub kill_after: Option<u64>,
}

/// Why the pump killed the group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Kills {
    /// Wall timeout.
    pub timeout: bool,
    /// Output flood.
    pub output: bool,
}

/// What the pump returns once the main process was reaped.
pub struct Pumped {
    /// Captured stdout.
    pub stdout: Capture,
    /// Captured stderr.
    pub stderr: Capture,
    /// What we killed the group for.
    pub kills: Kills,
}

fn read_some(r: &mut impl Read, buf: &mut [u8]) -> Option<usize> {
    loop {
        match r.read(buf) {
            Ok(n) => return Some(n),
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) if e.kind() == ErrorKind::WouldBlock => return None,
            Err(_) => return Some(0),
        }
    }
}

impl Running {
    /// Runs the pump until the main process is reaped, feeding `feed` to stdin and passing each
    /// output chunk to `sink` (when given) as well as capturing it.
    pub fn pump(
        &mut self,
        feed: &StdinFeed,
        limits: &PumpLimits,
        sink: &mut dyn FnMut(Stream, &[u8]),
    ) -> Pumped {
        let mut out = Capture::new(limits.cap);
        let mut err = Capture::new(limits.cap);
        let mut kills = Kills::default();
        let mut deadline = limits.deadline;
        let mut buf = vec![0u8; READ_CHUNK];
        let mut drain_until: Option<Instant> = None;
        // A terminal's input line holds bytes after its last newline (a `^D` then only ends
        // the line; a second one is the end of input).
        let mut line_open = false;
        loop {
            let exited = self.slot.get().is_some();
            if exited && drain_until.is_none() {
                drain_until = Some(Instant::now() + DRAIN_GRACE);
                self.stdin = None;
            }
            // Stdin: write what is queued; close on eof.
            let mut want_write = false;
            if let Some(stdin) = self.stdin.as_mut() {
                let mut s = lock(&feed.state);
                while !s.buf.is_empty() {
                    let (a, _) = s.buf.as_slices();
                    match stdin.write(a) {
                        Ok(n) => {
                            if n > 0 {
                                line_open = a[n - 1] != b'\n';
                            }
                            s.buf.drain(..n);
                        }
                        Err(e) if e.kind() == ErrorKind::Interrupted => {}
                        Err(e) if e.kind() == ErrorKind::WouldBlock => {
                            want_write = true;
                            break;
                        }
                        Err(_) => {
                            s.buf.clear();
                            s.closed = true;
                            break;
                        }
                    }
                }
                if s.closed || (s.buf.is_empty() && s.eof) {
                    if self.pty && !s.closed {
                        let eof: &[u8] = if line_open { b"\x04\x04" } else { b"\x04" };
                        let _ = stdin.write(eof);
                    }
                    s.closed = true;
                    want_write = false;
                    drop(s);
                    self.stdin = None;
                }
            }
            if self.stdout.is_none() && self.stderr.is_none() && exited {
                break;
            }
            let timeout = match (drain_until, deadline) {
                (Some(_), _) => Some(DRAIN_IDLE),
                (None, Some(d)) => Some(d.saturating_duration_since(Instant::now())),
                (None, None) => None,
            };
            let ready = {
                let mut fds: Vec<(BorrowedFd<'_>, Interest)> =
                    vec![(self.wake.as_fd(), Interest::Read)];
                if let Some(s) = &self.stdout {
                    fds.push((s.as_fd(), Interest::Read));
                }
                if let Some(s) = &self.stderr {
                    fds.push((s.as_fd(), Interest::Read));
                }
                if let (true, Some(s)) = (want_write, &self.stdin) {
                    fds.push((s.as_fd(), Interest::Write));
                }
                match proc::poll(&fds, timeout) {
                    Ok(r) => r.into_iter().any(|b| b),
                    Err(_) => {
                        std::thread::sleep(Duration::from_millis(5));
                        true
                    }
                }
            };
            // Drain the wake pipe.
            let mut junk = [0u8; 64];
            while read_some(&mut self.wake, &mut junk).is_some_and(|n| n > 0) {}
            let mut got = false;
            for stream in [Stream::Stdout, Stream::Stderr] {
                let (pipe, cap) = match stream {
                    Stream::Stdout => (&mut self.stdout, &mut out),
                    Stream::Stderr => (&mut self.stderr, &mut err),
                };
                if let Some(p) = pipe.as_mut() {
                    match read_some(p, &mut buf) {
                        Some(0) => *pipe = None,
                        Some(n) => {
                            got = true;
                            cap.push(&buf[..n]);
                            sink(stream, &buf[..n]);
                        }
                        None => {}
                    }
                }
            }
            if let Some(until) = drain_until {
                if (!ready && !got) || Instant::now() >= until {
                    break;
                }
            }
            if let Some(limit) = limits.kill_after {
                if !kills.output && (out.total() > limit || err.total() > limit) {
                    kills.output = true;
                    let _ = proc::killpg(self.pid, SIGKILL);
                }
            }
            if let Some(d) = deadline {
                if Instant::now() >= d {
                    kills.timeout = !kills.output;
                    deadline = None;
                    let _ = proc::killpg(self.pid, SIGKILL);
                }
            }
        }
        lock(&feed.state).closed = true;
        self.stdout = None;
        self.stderr = None;
        Pumped {
            stdout: out,
            stderr: err,
            kills,
        }
    }
}

/// Maps a reaped exit plus what we did to the process to an [`ExecResult`].
pub fn result(
    started: Instant,
    exit: &crate::reaper::Exit,
    pumped: Pumped,
    cpu_limit_ms: Option<u64>,
) -> ExecResult {
    let cpu_us = exit.rusage.utime_us + exit.rusage.stime_us;
    let (exit_code, signal) = match exit.status {
        WaitStatus::Exited(c) => (Some(c), None),
        WaitStatus::Signaled(s) => (None, Some(s)),
    };
    let cpu_killed = match exit.status {
        WaitStatus::Signaled(libc::SIGXCPU) => cpu_limit_ms.is_some(),
        WaitStatus::Signaled(libc::SIGKILL) => {
            cpu_limit_ms.is_some_and(|ms| cpu_us >= ms.saturating_mul(1000))
        }
        _ => false,
    };
    let status = if pumped.kills.output {
        ExecStatus::OutputLimit
    } else if pumped.kills.timeout || cpu_killed {
        ExecStatus::Timeout
    } else {
        match exit.status {
            WaitStatus::Exited(0) => ExecStatus::Ok,
            WaitStatus::Exited(_) => ExecStatus::NonzeroExit,
            WaitStatus::Signaled(_) => ExecStatus::Killed,
        }
    };
    ExecResult {
        status,
        exit_code,
        signal,
        wall_us: exit
            .at
            .saturating_duration_since(started)
            .as_micros()
            .min(u64::MAX as u128) as u64,
        cpu_us,
        peak_rss_kb: exit.rusage.maxrss_kb,
        stdout: pumped.stdout.finish(),
        stderr: pumped.stderr.finish(),
    }
}

/// The limits an exec request asks for.
pub fn limits_for(req: &ExecRequest, started: Instant) -> PumpLimits {
    let cap = req.effective_output_limit();
    PumpLimits {
        deadline: req.timeout_ms.map(|ms| started + Duration::from_millis(ms)),
        cap,
        kill_after: Some(cap.max(64 << 10).saturating_mul(OUTPUT_KILL_FACTOR)),
    }
}

/// Runs `req` to completion: spawn, pump, wait for the reap, build the result.
pub fn run(
    req: &ExecRequest,
    stdin: Vec<u8>,
    root: &Root,
    reaper: &Reaper,
    sink: &mut dyn FnMut(Stream, &[u8]),
) -> Result<ExecResult, ExecError> {
    let (cmd, program) = build_command(req, root)?;
    let mut running = start(reaper, &cmd, &program)?;
    drop(cmd);
    let feed = StdinFeed::new(stdin, true);
    let limits = limits_for(req, running.started);
    let pumped = running.pump(&feed, &limits, sink);
    Ok(finish(&running, pumped, req.cpu_limit_ms))
}

/// Waits for the reap (the pump only returns after it) and builds the result.
pub fn finish(running: &Running, pumped: Pumped, cpu_limit_ms: Option<u64>) -> ExecResult {
    let exit = loop {
        if let Some(e) = running.slot.wait(Duration::from_secs(3600)) {
            break e;
        }
    };
    result(running.started, &exit, pumped, cpu_limit_ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capture_keeps_head_and_tail() {
        let mut c = Capture::new(10);
        for chunk in [&b"0123"[..], b"456789", b"abcdef"] {
            c.push(chunk);
        }
        let got = c.finish();
        assert_eq!(got.total, 16);
        assert!(got.truncated);
        assert_eq!(got.data, b"01234bcdef");
    }

    #[test]
    fn capture_small_output_untruncated() {
        let mut c = Capture::new(10);
        c.push(b"hello");
        let got = c.finish();
        assert!(!got.truncated);
        assert_eq!(got.data, b"hello");
    }
}
