//! The protocol connection: a reader loop decoding request frames, one mutex-guarded writer so
//! frames never interleave, and the handlers for every [`Request`]. A request that may block is
//! served by the thread that read it, while an idle worker takes over the reading (bounded).
//! Background processes and the requests following them are in [`crate::procs`].

use std::io::{self, Write};
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

use dsec_api::agent::{Event, Request, DATA_CHUNK, PROTOCOL_VERSION};
use dsec_api::exec::{ExecRequest, ExecStatus, Stream, MAX_TIMEOUT_MS};
use dsec_api::frame::{self, FrameError};
use dsec_api::ErrorCode;
use dsec_sys::proc;

use crate::exec::{self, SIGKILL};
use crate::files::{FileError, Root};
use crate::out::Out;
use crate::procs::Procs;
use crate::reaper::{lock, Reaper};
use crate::session::Sessions;
use crate::tar::TarError;

/// Most requests handled at once.
const MAX_INFLIGHT: usize = 256;
/// How long `KillAll` waits for everything to be reaped.
const KILL_ALL_TIMEOUT: Duration = Duration::from_secs(10);

/// Shared agent state.
pub struct Agent {
    out: Arc<Out>,
    root: RwLock<Arc<Root>>,
    /// Set by `ReopenRoot`: the root is reopened at its next use (see [`Agent::root`]).
    root_stale: AtomicBool,
    root_path: PathBuf,
    reaper: Arc<Reaper>,
    procs: Procs,
    sessions: Sessions,
    inflight: AtomicUsize,
    workers: Arc<Workers>,
    /// Set when the agent is PID 1 of a VM guest.
    guest: Option<crate::guest::Guest>,
}

/// A worker's job: reading the connection. Returns true when the worker has nothing left to do
/// (it handed the reading back to the main thread) and should exit at once.
type Job = Box<dyn FnOnce() -> bool + Send>;

/// The reading half of a connection: a stream with a descriptor to poll.
pub trait Wire: io::Read + AsFd + Send {}
impl<T: io::Read + AsFd + Send> Wire for T {}

/// The reading half of a connection, passed from thread to thread.
pub type Reader = Box<dyn Wire>;

/// Gives the reader of the next connection when one ends (a VM guest waits for its host to
/// come back: its processes, sessions and handles stay), or `None`: the agent then kills
/// everything it started and its service ends.
pub type NextConnection = Box<dyn Fn() -> Option<Reader> + Send + Sync>;

/// The agent's service across connections.
struct Connection {
    next: NextConnection,
    /// Set (under the work queue's lock) when the service ended.
    ended: AtomicBool,
    /// The reading, handed back to the main thread by a worker that read nothing for
    /// [`HAND_BACK`] (so an idle agent keeps the main thread and no worker).
    to_main: Mutex<Option<Reader>>,
}

/// What the reading thread does with a frame.
#[allow(clippy::large_enum_variant)] // one per frame read, moved at once
enum Step {
    /// Serve this request on this thread (the reading passes on).
    Serve((u64, Request, Vec<u8>)),
    /// Answered already; read on.
    Done,
    /// The stream ended.
    End,
}

/// How long a worker reads nothing before it hands the reading back to the main thread.
const HAND_BACK: Duration = Duration::from_secs(1);

/// Threads that take over the reading of the connection when the thread reading it serves a
/// request that may block: an idle one when there is one (no thread creation on the exec
/// path), else a new one. Workers idle for longer than [`WORKER_IDLE`] exit; the main thread
/// follows for the agent's life, so an idle sandbox keeps one thread reading.
#[derive(Default)]
struct Workers {
    queue: Mutex<WorkQueue>,
    ready: Condvar,
}

#[derive(Default)]
struct WorkQueue {
    jobs: std::collections::VecDeque<Job>,
    idle: usize,
    /// The main thread waits for work (the reading can be handed back to it).
    main_waiting: bool,
}

/// How long a worker waits for the next request before it exits.
const WORKER_IDLE: Duration = Duration::from_secs(2);

impl Workers {
    fn run(self: &Arc<Self>, job: Job) -> io::Result<()> {
        let spawn = {
            let mut q = lock(&self.queue);
            q.jobs.push_back(job);
            // Every idle worker takes one queued job; more jobs than idle workers need a new one
            // (a long exec must never delay a concurrent request).
            q.jobs.len() > q.idle
        };
        if !spawn {
            self.ready.notify_one();
            return Ok(());
        }
        let me = Arc::clone(self);
        match std::thread::Builder::new()
            .name("worker".into())
            .spawn(move || me.work())
        {
            Ok(_) => Ok(()),
            Err(e) => {
                // Take the job back out so that it is not left without a worker.
                lock(&self.queue).jobs.pop_back();
                Err(e)
            }
        }
    }

    /// Runs jobs on the calling thread (the main thread: it never exits for idleness) until the
    /// service ends (`None`) or a worker hands the reading back (`Some`).
    fn follow(&self, conn: &Connection) -> Option<Reader> {
        loop {
            let job = {
                let mut q = lock(&self.queue);
                loop {
                    if conn.ended.load(Ordering::SeqCst) {
                        return None;
                    }
                    if let Some(r) = lock(&conn.to_main).take() {
                        return Some(r);
                    }
                    if let Some(j) = q.jobs.pop_front() {
                        break j;
                    }
                    q.idle += 1;
                    q.main_waiting = true;
                    q = match self.ready.wait(q) {
                        Ok(g) => g,
                        Err(poisoned) => poisoned.into_inner(),
                    };
                    q.main_waiting = false;
                    q.idle -= 1;
                }
            };
            job();
        }
    }

    /// Gives the reading back to the main thread when it waits for work; else returns it.
    fn hand_back(&self, conn: &Connection, reader: Reader) -> Option<Reader> {
        let q = lock(&self.queue);
        if !q.main_waiting {
            return Some(reader);
        }
        *lock(&conn.to_main) = Some(reader);
        self.ready.notify_all();
        None
    }

    /// Sets `ended` and wakes every follower.
    fn end(&self, ended: &AtomicBool) {
        let _q = lock(&self.queue);
        ended.store(true, Ordering::SeqCst);
        self.ready.notify_all();
    }

    fn work(&self) {
        loop {
            let job = {
                let mut q = lock(&self.queue);
                loop {
                    if let Some(j) = q.jobs.pop_front() {
                        break Some(j);
                    }
                    q.idle += 1;
                    let (guard, timeout) = match self.ready.wait_timeout(q, WORKER_IDLE) {
                        Ok(r) => r,
                        Err(poisoned) => poisoned.into_inner(),
                    };
                    q = guard;
                    q.idle -= 1;
                    if timeout.timed_out() && q.jobs.is_empty() {
                        break None;
                    }
                }
            };
            match job {
                // Handed the reading back: the main thread reads again.
                Some(j) => {
                    if j() {
                        return;
                    }
                }
                None => return,
            }
        }
    }
}

#[derive(Debug, thiserror::Error)]
enum ReqError {
    #[error("{0}")]
    Msg(String),
}

fn msg(s: impl Into<String>) -> ReqError {
    ReqError::Msg(s.into())
}

impl Agent {
    /// The current sandbox root. After a `ReopenRoot` it is reopened here, at its first use:
    /// the supervisor sends `ReopenRoot` before it pivots the sandbox onto its fresh root (so
    /// that this agent's answer overlaps the pivot) and answers the node only after the pivot,
    /// and the node sends nothing that uses the root before that answer.
    fn root(&self) -> Arc<Root> {
        if self.root_stale.load(Ordering::Acquire) {
            match Root::open(&self.root_path) {
                Ok(r) => {
                    if let Ok(mut g) = self.root.write() {
                        *g = Arc::new(r);
                    }
                    self.root_stale.store(false, Ordering::Release);
                }
                // Still stale: the next use tries again.
                Err(e) => eprintln!("dsec-agent: reopen the root: {e}"),
            }
        }
        match self.root.read() {
            Ok(g) => Arc::clone(&g),
            Err(poisoned) => Arc::clone(&poisoned.into_inner()),
        }
    }

    /// Builds the agent around the protocol socket.
    pub fn new(
        sock: Box<dyn Write + Send>,
        root: Root,
        root_path: PathBuf,
        reaper: Arc<Reaper>,
        guest: Option<crate::guest::Guest>,
    ) -> Agent {
        Agent {
            out: Arc::new(Out {
                w: Mutex::new(sock),
            }),
            guest,
            root: RwLock::new(Arc::new(root)),
            root_stale: AtomicBool::new(false),
            root_path,
            reaper,
            procs: Procs::default(),
            sessions: Sessions::default(),
            inflight: AtomicUsize::new(0),
            workers: Arc::new(Workers::default()),
        }
    }

    /// Serves requests read from `reader`, and from each next connection `next` gives when a
    /// stream ends (each greeted with `Hello`). When `next` gives none, kills everything it
    /// started and returns. The calling thread reads first and later serves as a follower.
    pub fn serve(self: &Arc<Self>, reader: Reader, next: NextConnection) {
        let conn = Arc::new(Connection {
            next,
            ended: AtomicBool::new(false),
            to_main: Mutex::new(None),
        });
        self.hello();
        let mut reader = Some(reader);
        while let Some(r) = reader {
            self.read_requests(r, Arc::clone(&conn), true);
            reader = self.workers.follow(&conn);
        }
    }

    fn hello(&self) {
        self.out.send(
            0,
            &Event::Hello {
                version: PROTOCOL_VERSION,
                pid: proc::getpid(),
            },
            &[],
        );
    }

    /// Reads and dispatches requests, or until a request that may block: then an idle worker
    /// takes over the reading and this thread serves the request (leader and followers: no
    /// thread wakes up between a request's frame and its handler). At the end of a stream the
    /// reading thread asks for the next connection, or ends the agent's service. True when a
    /// worker (`main` false) handed the reading back to the main thread.
    fn read_requests(
        self: &Arc<Self>,
        mut reader: Reader,
        conn: Arc<Connection>,
        main: bool,
    ) -> bool {
        loop {
            if !main && !self.readable_soon(&reader) {
                match self.workers.hand_back(&conn, reader) {
                    Some(r) => reader = r,
                    None => return true,
                }
                continue;
            }
            let request = match frame::read_frame(&mut reader) {
                Ok(Some(raw)) => self.decode(raw),
                Ok(None) => Step::End,
                Err(e) => {
                    eprintln!("dsec-agent: dropping connection: {e}");
                    Step::End
                }
            };
            let (id, req, body) = match request {
                Step::Serve(r) => r,
                Step::Done => continue,
                Step::End => match self.next_connection(&conn) {
                    Some(r) => {
                        reader = r;
                        continue;
                    }
                    None => return false,
                },
            };
            let role = Arc::new(Mutex::new(Some(reader)));
            let (me, theirs, conn2) = (Arc::clone(self), Arc::clone(&role), Arc::clone(&conn));
            let job: Job = Box::new(move || match lock(&theirs).take() {
                Some(reader) => me.read_requests(reader, conn2, false),
                None => false,
            });
            match self.workers.run(job) {
                Ok(()) => {
                    self.handle(id, req, body);
                    self.inflight.fetch_sub(1, Ordering::SeqCst);
                    return false;
                }
                Err(e) => {
                    // No thread for the reading (the sandbox's pids or memory are used up, e.g.
                    // by a fork bomb that is still being swept): the request is served here all
                    // the same, and the reading goes on after it. Refusing it would fail a
                    // caller for what another process in the sandbox did.
                    eprintln!("dsec-agent: no worker thread ({e}); serving inline");
                    let Some(r) = lock(&role).take() else {
                        self.inflight.fetch_sub(1, Ordering::SeqCst);
                        return false;
                    };
                    self.handle(id, req, body);
                    self.inflight.fetch_sub(1, Ordering::SeqCst);
                    reader = r;
                }
            }
        }
    }

    /// Decodes a request frame: answers what needs no thread of its own (and bad headers), or
    /// gives the request to serve; a framing error ends the connection.
    fn decode(&self, raw: frame::RawFrame) -> Step {
        let header = raw.header.clone();
        match raw.into_request() {
            Ok((env, body)) => match self.admit(env.id, env.req, body) {
                Some(r) => Step::Serve(r),
                None => Step::Done,
            },
            Err(e @ (FrameError::BadHeader(_) | FrameError::UnexpectedKind(_))) => {
                let id = serde_json::from_slice::<serde_json::Value>(&header)
                    .ok()
                    .and_then(|v| v.get("id").and_then(serde_json::Value::as_u64));
                match id {
                    Some(id) => self.out.error(id, ErrorCode::InvalidRequest, &e),
                    None => eprintln!("dsec-agent: ignoring request without id: {e}"),
                }
                Step::Done
            }
            Err(e) => {
                eprintln!("dsec-agent: dropping connection: {e}");
                Step::End
            }
        }
    }

    /// Whether a request arrives within [`HAND_BACK`] (a poll error counts as yes: the read
    /// that follows reports it).
    fn readable_soon(&self, reader: &Reader) -> bool {
        proc::poll(&[(reader.as_fd(), proc::Interest::Read)], Some(HAND_BACK))
            .map_or(true, |r| r.into_iter().any(|b| b))
    }

    /// The reader of the next connection (greeted), or `None` after everything started was
    /// killed and the followers were released.
    fn next_connection(&self, conn: &Connection) -> Option<Reader> {
        if let Some(r) = (conn.next)() {
            self.procs.forget_followers();
            self.hello();
            return Some(r);
        }
        let _ = self.kill_all(Duration::from_secs(2));
        self.workers.end(&conn.ended);
        None
    }

    /// Answers quick, non-blocking requests on the reading thread (a thread hand-off would cost
    /// more than the work) and refuses what exceeds [`MAX_INFLIGHT`]; returns the requests that
    /// need a thread of their own, counted in flight.
    fn admit(&self, id: u64, req: Request, body: Vec<u8>) -> Option<(u64, Request, Vec<u8>)> {
        if matches!(req, Request::Ping) {
            self.out.send(id, &Event::Pong, &[]);
            return None;
        }
        if matches!(
            req,
            Request::Configure { .. }
                | Request::ReopenRoot
                | Request::Identify { .. }
                | Request::GuestNet { .. }
                | Request::GuestNetOff
        ) {
            self.handle(id, req, body);
            return None;
        }
        if self.inflight.fetch_add(1, Ordering::SeqCst) >= MAX_INFLIGHT {
            self.inflight.fetch_sub(1, Ordering::SeqCst);
            self.out.error(
                id,
                ErrorCode::ResourceExhausted,
                &msg(format!("more than {MAX_INFLIGHT} requests in flight")),
            );
            return None;
        }
        Some((id, req, body))
    }

    fn handle(&self, id: u64, req: Request, body: Vec<u8>) {
        let out = &self.out;
        let ok = || out.send(id, &Event::Ok, &[]);
        match req {
            Request::Ping => out.send(id, &Event::Pong, &[]),
            Request::Exec(r) => self.exec(id, &r, body),
            Request::Spawn(r) => {
                let root = self.root();
                self.procs.spawn(out, id, &r, body, &root, &self.reaper)
            }
            Request::ProcStatus { handle } => self.procs.status(out, id, handle),
            Request::ProcSignal { handle, signal } => self.procs.signal(out, id, handle, signal),
            Request::ProcStdin { handle, eof } => self.procs.stdin(out, id, handle, &body, eof),
            Request::ProcWait { handle, timeout_ms } => {
                self.procs.wait(out, id, handle, timeout_ms)
            }
            Request::SessionOpen { kind, env, cwd } => {
                match self
                    .sessions
                    .open(kind, &env, cwd.as_deref(), &self.root(), &self.reaper)
                {
                    Ok(session) => out.send(id, &Event::SessionOpened { session }, &[]),
                    Err(e) => out.error(id, e.code(), &e),
                }
            }
            Request::SessionRun {
                session,
                input,
                timeout_ms,
            } => self.session_run(id, session, &input, timeout_ms),
            Request::SessionClose { session } => match self.sessions.close(session) {
                Ok(()) => ok(),
                Err(e) => out.error(id, e.code(), &e),
            },
            Request::FileRead { path, max_bytes } => out.send_data(id, FileError::code, |send| {
                crate::files::read_chunks(&self.root(), &path, max_bytes, DATA_CHUNK, send)
            }),
            Request::FileWrite {
                path,
                mode,
                parents,
            } => {
                match self
                    .root()
                    .write_atomic(&path, &body, mode.unwrap_or(0o644), parents)
                {
                    Ok(()) => ok(),
                    Err(e) => out.error(id, e.code(), &e),
                }
            }
            Request::FileList { path } => match self.root().list(&path) {
                Ok(entries) => out.send(id, &Event::Listing { entries }, &[]),
                Err(e) => out.error(id, e.code(), &e),
            },
            Request::FileStat { path } => match self.root().stat(&path) {
                Ok(st) => out.send(id, &Event::Stat(st), &[]),
                Err(e) => out.error(id, e.code(), &e),
            },
            Request::Mkdir {
                path,
                parents,
                mode,
            } => match self.root().mkdir(&path, parents, mode.unwrap_or(0o755)) {
                Ok(()) => ok(),
                Err(e) => out.error(id, e.code(), &e),
            },
            Request::Remove { path, recursive } => match self.root().remove(&path, recursive) {
                Ok(()) => ok(),
                Err(e) => out.error(id, e.code(), &e),
            },
            Request::TarUpload { path } => match crate::tar::upload(&self.root(), &path, &body) {
                Ok(()) => ok(),
                Err(e) => out.error(id, e.code(), &e),
            },
            Request::TarDownload { path, max_bytes } => out.send_data(id, TarError::code, |send| {
                crate::tar::download(&self.root(), &path, max_bytes, DATA_CHUNK, send)
            }),
            Request::KillAll => match self.kill_all(KILL_ALL_TIMEOUT) {
                Ok(()) => ok(),
                Err(e) => out.error(id, ErrorCode::Internal, &e),
            },
            Request::Configure {
                env,
                nofile,
                fsize,
                nproc,
                workdir,
                user,
            } => self.configure(id, env, (nofile, fsize, nproc), workdir, user),
            Request::EnsureUsers { users } => match crate::users::ensure(&self.root(), &users) {
                Ok(()) => ok(),
                Err(e) => out.error(id, e.code(), &e),
            },
            Request::ProcAttach { handle } => self.procs.attach(out, id, handle),
            Request::ProcDetach { handle, attach } => self.procs.detach(out, id, handle, attach),
            Request::ProcList => self.procs.list(out, id),
            Request::ProcResize { handle, size } => self.procs.resize(out, id, handle, size),
            Request::FileRename { from, to } => self.file_rename(id, &from, &to),
            Request::Watch { path, recursive } => self.watch(id, &path, recursive),
            Request::Unwatch { watch } => self.unwatch(id, watch),
            Request::AsUser { user, req } => self.as_user(id, &user, *req, body),
            Request::Identify {
                hostname,
                unix_ns,
                disk_bytes,
                disk_inodes,
                read_only_root,
                scratch,
            } => match &self.guest {
                None => out.error(
                    id,
                    ErrorCode::InvalidRequest,
                    &msg("identify is for VM guests only"),
                ),
                Some(g) => match g
                    .identify(&hostname, unix_ns, disk_bytes, disk_inodes, &body)
                    .and_then(|()| {
                        if read_only_root {
                            g.read_only_root(&scratch)
                        } else {
                            Ok(())
                        }
                    }) {
                    Ok(()) => ok(),
                    Err(e) => out.error(id, ErrorCode::Internal, &e),
                },
            },
            Request::GuestNet { addr, gateway } => {
                self.guest_net(id, "guest_net", || crate::guest::set_net(addr, gateway))
            }
            Request::GuestNetOff => self.guest_net(id, "guest_net_off", crate::guest::set_net_off),
            Request::ReopenRoot => self.reopen_root(id),
        }
    }

    /// A VM guest's network request `what`: `set` (refused outside a VM guest).
    fn guest_net(&self, id: u64, what: &str, set: impl FnOnce() -> std::io::Result<()>) {
        let out = &self.out;
        if self.guest.is_none() {
            return out.error(
                id,
                ErrorCode::InvalidRequest,
                &msg(format!("{what} is for VM guests only")),
            );
        }
        match set() {
            Ok(()) => out.send(id, &Event::Ok, &[]),
            Err(e) => out.error(id, ErrorCode::Internal, &e),
        }
    }

    fn file_rename(&self, id: u64, from: &str, to: &str) {
        match self.root().rename(from, to) {
            Ok(()) => self.out.send(id, &Event::Ok, &[]),
            Err(e) => self.out.error(id, e.code(), &e),
        }
    }

    fn watch(&self, id: u64, path: &str, recursive: bool) {
        crate::watch::watch(&self.out, self.root(), id, path, recursive)
    }

    fn unwatch(&self, id: u64, watch: u64) {
        crate::watch::unwatch(&self.out, id, watch)
    }

    /// A file request made as a user of the sandbox: this thread's file-system ids are theirs
    /// while it runs (a `Watch` keeps them only for resolving its directory).
    fn as_user(&self, id: u64, user: &str, req: Request, body: Vec<u8>) {
        let file_request = matches!(
            req,
            Request::FileRead { .. }
                | Request::FileWrite { .. }
                | Request::FileList { .. }
                | Request::FileStat { .. }
                | Request::Mkdir { .. }
                | Request::Remove { .. }
                | Request::FileRename { .. }
                | Request::TarUpload { .. }
                | Request::TarDownload { .. }
                | Request::Watch { .. }
        );
        if !file_request {
            return self.out.error(
                id,
                ErrorCode::InvalidRequest,
                &msg("as_user wraps a file request only (commands name their user)"),
            );
        }
        let guard =
            crate::users::resolve(&self.root(), user).and_then(|u| crate::users::AsUser::enter(&u));
        match guard {
            Ok(_guard) => self.handle(id, req, body),
            Err(e) => self.out.error(id, e.code(), &e),
        }
    }

    fn session_run(&self, id: u64, session: u64, input: &str, timeout_ms: Option<u64>) {
        if timeout_ms.is_some_and(|t| t == 0 || t > MAX_TIMEOUT_MS) {
            self.out.error(
                id,
                ErrorCode::InvalidRequest,
                &msg(format!("timeout_ms must be in 1..={MAX_TIMEOUT_MS}")),
            );
            return;
        }
        let to = Arc::clone(&self.out);
        let reply = Box::new(move |r| to.send(id, &Event::ExecDone(r), &[]));
        if let Err(e) = self.sessions.run(session, input, timeout_ms, reply) {
            self.out.error(id, e.code(), &e);
        }
    }

    /// `Configure`: the sandbox's environment and limits, and its root opened afresh.
    fn configure(
        &self,
        id: u64,
        env: Vec<(String, String)>,
        (nofile, fsize, nproc): (Option<u64>, Option<u64>, Option<u64>),
        workdir: Option<String>,
        user: Option<String>,
    ) {
        exec::configure(env, nofile, fsize, workdir);
        crate::users::set_default(user);
        if let Some(n) = nproc {
            if let Err(e) = dsec_sys::proc::set_own_rlimit(libc::RLIMIT_NPROC, n) {
                self.out.error(id, ErrorCode::Internal, &e);
                return;
            }
        }
        match Root::open(&self.root_path) {
            Ok(r) => {
                if let Ok(mut g) = self.root.write() {
                    *g = Arc::new(r);
                }
                self.root_stale.store(false, Ordering::Release);
                self.out.send(id, &Event::Ok, &[]);
            }
            Err(e) => self.out.error(id, ErrorCode::Internal, &e),
        }
    }

    /// `ReopenRoot`, a reset: the supervisor killed every other process of the sandbox, so their
    /// handles and sessions go too; the root is reopened at its next use.
    fn reopen_root(&self, id: u64) {
        self.procs.clear();
        self.sessions.clear();
        crate::watch::end_all();
        // Let go of the old root now: held until the next use it would keep the old writable
        // layer (and all it stores) alive while the sandbox sits idle. /proc stands in (its
        // mount moves into the fresh root, so it pins nothing of the old one) until the next
        // use reopens the root.
        if let Ok(placeholder) = Root::open(std::path::Path::new("/proc")) {
            if let Ok(mut g) = self.root.write() {
                *g = Arc::new(placeholder);
            }
        }
        self.root_stale.store(true, Ordering::Release);
        self.out.send(id, &Event::Ok, &[]);
    }

    fn exec(&self, id: u64, req: &ExecRequest, body: Vec<u8>) {
        let stream = req.stream;
        let mut sink = |s: Stream, b: &[u8]| {
            if stream {
                self.out.send(id, &Event::Output { stream: s }, b);
            }
        };
        // In a VM guest the kernel's OOM killer is the memory limit: a command that failed
        // while it killed something is reported as `oom`, as the cgroup counter does for
        // containers on the host.
        let ooms = self.guest.as_ref().map(|_| crate::guest::oom_kills());
        match exec::run(req, body, &self.root(), &self.reaper, &mut sink) {
            Ok(mut r) => {
                if let Some(before) = ooms {
                    if crate::guest::oom_kills() > before && r.status != ExecStatus::Ok {
                        r.status = ExecStatus::Oom;
                    }
                }
                self.out.send(id, &Event::ExecDone(r), &[])
            }
            Err(e) => self.out.error(id, e.code(), &e),
        }
    }

    /// Kills every process but the agent and waits until all are reaped.
    fn kill_all(&self, timeout: Duration) -> Result<(), ReqError> {
        self.procs.clear();
        self.sessions.clear();
        crate::watch::end_all();
        let is_init = proc::getpid() == 1;
        let deadline = Instant::now() + timeout;
        loop {
            if is_init {
                let _ = proc::kill_all_as_init(SIGKILL);
            } else {
                for pg in self.reaper.pgids() {
                    let _ = proc::killpg(pg, SIGKILL);
                }
                for pid in direct_children() {
                    let _ = proc::kill(pid, SIGKILL);
                }
            }
            if !proc::has_children() {
                self.reaper.prune_pgids();
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(msg("processes survived SIGKILL"));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// Direct children of this process (including re-parented orphans), from procfs.
fn direct_children() -> Vec<i32> {
    let me = std::process::id() as i32;
    let mut out = Vec::new();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return out;
    };
    for t in tasks.flatten() {
        let Ok(s) = std::fs::read_to_string(t.path().join("children")) else {
            continue;
        };
        out.extend(
            s.split_whitespace()
                .filter_map(|p| p.parse::<i32>().ok())
                .filter(|&p| p > 1 && p != me),
        );
    }
    out
}

impl From<io::Error> for ReqError {
    fn from(e: io::Error) -> Self {
        ReqError::Msg(e.to_string())
    }
}
