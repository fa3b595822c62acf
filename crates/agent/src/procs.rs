//! Background processes: the table of handles, each process's pump thread, and the requests
//! that follow a process's output.
//!
//! A background process keeps the request that started it (for `ProcList`) and the ids of the
//! requests that follow it (a streaming `Spawn`, `ProcAttach`). Its pump thread sends every
//! output chunk to each follower as an `Output` event and, when the process was reaped, its
//! result as `ExecDone`; a follower costs no thread of its own (the request that made it is
//! answered with `Attached` and returns). The handle is forgotten once a `ProcWait` or a
//! follower was given the result, so exited processes do not fill the table.
//!
//! Lock order: a process's `state`, then the connection's writer (events to followers are sent
//! under `state`, so an `Attached` always precedes the first `Output` its follower sees).

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use dsec_api::agent::{Event, ProcInfo};
use dsec_api::exec::{ExecRequest, ExecResult, PtySize, MAX_TIMEOUT_MS};
use dsec_api::ErrorCode;
use dsec_sys::proc;

use crate::exec::{self, StdinFeed, SIGKILL};
use crate::files::Root;
use crate::out::Out;
use crate::reaper::{lock, ExitSlot, Reaper};

/// Most live background process handles.
pub const MAX_HANDLES: usize = 1024;
/// Most requests following one process at once.
pub const MAX_FOLLOWERS: usize = 64;

/// Failures of background-process requests.
#[derive(Debug, thiserror::Error)]
pub enum ProcsError {
    /// No such handle (never given, or forgotten after its result was delivered).
    #[error("handle {handle} not found")]
    NoHandle {
        /// The handle.
        handle: u64,
    },
    /// The table is full.
    #[error("more than {MAX_HANDLES} background processes")]
    TooMany,
    /// The process has as many followers as it may.
    #[error("more than {MAX_FOLLOWERS} requests follow handle {handle}")]
    TooManyFollowers {
        /// The handle.
        handle: u64,
    },
    /// A signal number out of range.
    #[error("signal {signal} not in 1..=64")]
    BadSignal {
        /// The number asked for.
        signal: i32,
    },
    /// Signalling the process group failed.
    #[error("signal handle {handle}")]
    Signal {
        /// The handle.
        handle: u64,
        /// Cause.
        #[source]
        source: proc::ProcError,
    },
    /// A resize of a process without a terminal.
    #[error("handle {handle} has no terminal")]
    NoTerminal {
        /// The handle.
        handle: u64,
    },
    /// A terminal size out of bounds.
    #[error("{0}")]
    BadSize(String),
    /// `TIOCSWINSZ` failed.
    #[error("resize the terminal of handle {handle}")]
    Resize {
        /// The handle.
        handle: u64,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// No thread for the pump.
    #[error("start the pump thread of pid {pid}")]
    PumpThread {
        /// The process.
        pid: i32,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
}

impl ProcsError {
    /// The wire code.
    pub fn code(&self) -> ErrorCode {
        match self {
            ProcsError::NoHandle { .. } => ErrorCode::HandleNotFound,
            ProcsError::TooMany
            | ProcsError::TooManyFollowers { .. }
            | ProcsError::PumpThread { .. } => ErrorCode::ResourceExhausted,
            ProcsError::BadSignal { .. }
            | ProcsError::NoTerminal { .. }
            | ProcsError::BadSize(_) => ErrorCode::InvalidRequest,
            ProcsError::Signal { .. } | ProcsError::Resize { .. } => ErrorCode::Internal,
        }
    }
}

/// A background process.
struct BgProc {
    handle: u64,
    pid: i32,
    slot: Arc<ExitSlot>,
    feed: Arc<StdinFeed>,
    /// What `ProcList` shows of it.
    info: ProcInfo,
    /// Its terminal's master, when it runs on one (for resizes).
    terminal: Option<File>,
    state: Mutex<Followed>,
    done: Condvar,
}

/// What changes while a background process runs.
#[derive(Default)]
struct Followed {
    /// Set once the process was reaped and its output drained.
    result: Option<ExecResult>,
    /// Ids of the requests following it, in the order they came.
    followers: Vec<u64>,
}

impl BgProc {
    fn running(&self) -> bool {
        self.slot.get().is_none()
    }
}

type Table = Arc<Mutex<HashMap<u64, Arc<BgProc>>>>;

/// The background processes of the agent.
pub struct Procs {
    table: Table,
    next_handle: AtomicU64,
}

impl Default for Procs {
    fn default() -> Self {
        Self {
            table: Arc::default(),
            next_handle: AtomicU64::new(1),
        }
    }
}

impl Procs {
    fn get(&self, handle: u64) -> Result<Arc<BgProc>, ProcsError> {
        lock(&self.table)
            .get(&handle)
            .cloned()
            .ok_or(ProcsError::NoHandle { handle })
    }

    /// Forgets every handle (their processes were or are being killed). Followers still get
    /// the result from the pumps.
    pub fn clear(&self) {
        lock(&self.table).clear();
    }

    /// Drops every follower without a word: the connection their requests came on is gone.
    pub fn forget_followers(&self) {
        let all: Vec<Arc<BgProc>> = lock(&self.table).values().cloned().collect();
        for p in all {
            lock(&p.state).followers.clear();
        }
    }

    /// `Spawn`: starts `req` in the background with `body` as its first stdin. Answers
    /// `Started`, or with `req.stream` `Attached` (the request then follows the process).
    pub fn spawn(
        &self,
        out: &Arc<Out>,
        id: u64,
        req: &ExecRequest,
        body: Vec<u8>,
        root: &Root,
        reaper: &Reaper,
    ) {
        if lock(&self.table).len() >= MAX_HANDLES {
            return out.error(id, ErrorCode::ResourceExhausted, &ProcsError::TooMany);
        }
        let started = exec::build_command(req, root).and_then(|(mut cmd, program)| {
            if let Some(size) = req.pty {
                cmd.pty(size.rows, size.cols);
            }
            exec::start(reaper, &cmd, &program)
        });
        let mut running = match started {
            Ok(r) => r,
            Err(e) => return out.error(id, e.code(), &e),
        };
        running.pty = req.pty.is_some();
        let handle = self.next_handle.fetch_add(1, Ordering::SeqCst);
        let feed = Arc::new(StdinFeed::new(body, req.stdin_closed));
        let bg = Arc::new(BgProc {
            handle,
            pid: running.pid,
            slot: Arc::clone(&running.slot),
            feed: Arc::clone(&feed),
            info: ProcInfo {
                handle,
                pid: running.pid,
                command: req.command.clone(),
                env: req.env.clone(),
                cwd: req.cwd.clone(),
                tag: req.tag.clone(),
                pty: req.pty.is_some(),
            },
            terminal: if req.pty.is_some() {
                running.stdin_pipe()
            } else {
                None
            },
            state: Mutex::new(Followed {
                result: None,
                followers: if req.stream { vec![id] } else { Vec::new() },
            }),
            done: Condvar::new(),
        });
        // Held until the answer is out: the pump's first chunk waits for it.
        let mut st = lock(&bg.state);
        let limits = exec::limits_for(req, running.started);
        let cpu = req.cpu_limit_ms;
        let (bg2, out2, table) = (Arc::clone(&bg), Arc::clone(out), Arc::clone(&self.table));
        let pumped = std::thread::Builder::new()
            .name(format!("bg-{}", running.pid))
            .spawn(move || {
                let mut sink = |stream, bytes: &[u8]| {
                    let st = lock(&bg2.state);
                    for &f in &st.followers {
                        out2.send(f, &Event::Output { stream }, bytes);
                    }
                };
                let pumped = running.pump(&feed, &limits, &mut sink);
                let res = exec::finish(&running, pumped, cpu);
                let followed = {
                    let mut st = lock(&bg2.state);
                    let followers = std::mem::take(&mut st.followers);
                    for &f in &followers {
                        out2.send(f, &Event::ExecDone(res.clone()), &[]);
                    }
                    st.result = Some(res);
                    !followers.is_empty()
                };
                bg2.done.notify_all();
                if followed {
                    lock(&table).remove(&bg2.handle);
                }
            });
        if let Err(source) = pumped {
            let _ = proc::killpg(bg.pid, SIGKILL);
            st.followers.clear();
            drop(st);
            let e = ProcsError::PumpThread {
                pid: bg.pid,
                source,
            };
            return out.error(id, e.code(), &e);
        }
        {
            let mut t = lock(&self.table);
            if t.len() >= MAX_HANDLES {
                // Filled by concurrent spawns meanwhile.
                drop(t);
                let _ = proc::killpg(bg.pid, SIGKILL);
                st.followers.clear();
                drop(st);
                return out.error(id, ErrorCode::ResourceExhausted, &ProcsError::TooMany);
            }
            t.insert(handle, Arc::clone(&bg));
        }
        let pid = bg.pid;
        let ev = if req.stream {
            Event::Attached { handle, pid }
        } else {
            Event::Started { handle, pid }
        };
        out.send(id, &ev, &[]);
        drop(st);
    }

    /// `ProcAttach`: `Attached`, then the process's output, then its result (at once when it
    /// has exited: the handle is then forgotten).
    pub fn attach(&self, out: &Out, id: u64, handle: u64) {
        let p = match self.get(handle) {
            Ok(p) => p,
            Err(e) => return out.error(id, e.code(), &e),
        };
        let mut st = lock(&p.state);
        if st.result.is_none() && st.followers.len() >= MAX_FOLLOWERS {
            drop(st);
            let e = ProcsError::TooManyFollowers { handle };
            return out.error(id, e.code(), &e);
        }
        out.send(id, &Event::Attached { handle, pid: p.pid }, &[]);
        match &st.result {
            Some(r) => {
                out.send(id, &Event::ExecDone(r.clone()), &[]);
                drop(st);
                lock(&self.table).remove(&handle);
            }
            None => st.followers.push(id),
        }
    }

    /// `ProcDetach`: the request `attach` stops following `handle` (it gets `Detached`; a
    /// request that follows no more is left alone); answers `Ok`.
    pub fn detach(&self, out: &Out, id: u64, handle: u64, attach: u64) {
        let p = match self.get(handle) {
            Ok(p) => p,
            Err(e) => return out.error(id, e.code(), &e),
        };
        {
            let mut st = lock(&p.state);
            if let Some(i) = st.followers.iter().position(|&f| f == attach) {
                st.followers.remove(i);
                out.send(attach, &Event::Detached, &[]);
            }
        }
        out.send(id, &Event::Ok, &[]);
    }

    /// `ProcList`: the processes still running, by handle.
    pub fn list(&self, out: &Out, id: u64) {
        let mut items: Vec<ProcInfo> = lock(&self.table)
            .values()
            .filter(|p| p.running())
            .map(|p| p.info.clone())
            .collect();
        items.sort_by_key(|i| i.handle);
        out.send(id, &Event::Procs { items }, &[]);
    }

    /// `ProcResize`: a new size of the process's terminal.
    pub fn resize(&self, out: &Out, id: u64, handle: u64, size: PtySize) {
        let r = self.get(handle).and_then(|p| {
            size.validate().map_err(ProcsError::BadSize)?;
            let t = p
                .terminal
                .as_ref()
                .ok_or(ProcsError::NoTerminal { handle })?;
            dsec_sys::spawn::set_window_size(t.as_fd(), size.rows, size.cols)
                .map_err(|source| ProcsError::Resize { handle, source })
        });
        match r {
            Ok(()) => out.send(id, &Event::Ok, &[]),
            Err(e) => out.error(id, e.code(), &e),
        }
    }

    /// `ProcStatus`.
    pub fn status(&self, out: &Out, id: u64, handle: u64) {
        match self.get(handle) {
            Ok(p) => out.send(
                id,
                &Event::ProcStatus {
                    running: p.running(),
                    pid: p.pid,
                },
                &[],
            ),
            Err(e) => out.error(id, e.code(), &e),
        }
    }

    /// `ProcSignal`: `signal` to the process's group.
    pub fn signal(&self, out: &Out, id: u64, handle: u64, signal: i32) {
        let r = self.get(handle).and_then(|p| {
            if !(1..=64).contains(&signal) {
                return Err(ProcsError::BadSignal { signal });
            }
            proc::killpg(p.pid, signal).map_err(|source| ProcsError::Signal { handle, source })
        });
        match r {
            Ok(_) => out.send(id, &Event::Ok, &[]),
            Err(e) => out.error(id, e.code(), &e),
        }
    }

    /// `ProcStdin`: queues `body` (and the end of input when `eof`).
    pub fn stdin(&self, out: &Out, id: u64, handle: u64, body: &[u8], eof: bool) {
        let p = match self.get(handle) {
            Ok(p) => p,
            Err(e) => return out.error(id, e.code(), &e),
        };
        match p.feed.push(body, eof) {
            Ok(()) => {
                p.slot.wake();
                out.send(id, &Event::Ok, &[]);
            }
            Err(e) => out.error(id, e.code(), &e),
        }
    }

    /// `ProcWait`: the result (the handle is then forgotten), or the status once `timeout_ms`
    /// passed. Blocks its thread.
    pub fn wait(&self, out: &Out, id: u64, handle: u64, timeout_ms: u64) {
        let p = match self.get(handle) {
            Ok(p) => p,
            Err(e) => return out.error(id, e.code(), &e),
        };
        let deadline = Instant::now() + Duration::from_millis(timeout_ms.min(MAX_TIMEOUT_MS));
        let mut g = lock(&p.state);
        loop {
            if let Some(r) = g.result.as_ref() {
                let r = r.clone();
                drop(g);
                lock(&self.table).remove(&handle);
                return out.send(id, &Event::ExecDone(r), &[]);
            }
            let now = Instant::now();
            if now >= deadline {
                drop(g);
                return out.send(
                    id,
                    &Event::ProcStatus {
                        running: p.running(),
                        pid: p.pid,
                    },
                    &[],
                );
            }
            g = p
                .done
                .wait_timeout(g, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}
