//! Messages between the node (host side) and `dsec-agent` (PID 1 inside the sandbox).
//!
//! Every frame carries one message as a JSON header plus an optional binary body (see
//! [`crate::frame`]). The host sends [`Request`]s, each tagged with a host-chosen `id`; the agent
//! answers with one or more [`Event`]s carrying the same `id`. A request is finished by exactly one
//! *terminal* event (see [`Event::is_terminal`]); `Output` and `Data` events may precede it.
//! The agent sends `Hello` with id 0 once, unprompted, when it is ready.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::ErrorCode;
use crate::exec::{ExecRequest, ExecResult, Stream};

/// Version of the message set. Bumped on any incompatible change.
pub const PROTOCOL_VERSION: u8 = 1;

/// Most bytes a file read or tar download sends in one `Data` event.
pub const DATA_CHUNK: usize = 256 << 10;

/// A request from the host, with its correlation id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestEnvelope {
    /// Host-chosen id, echoed on every event answering this request. Never 0.
    pub id: u64,
    /// The request.
    pub req: Request,
}

/// An event from the agent, with the id of the request it answers (0 for `Hello`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventEnvelope {
    /// The id of the request this answers.
    pub id: u64,
    /// The event.
    pub ev: Event,
}

/// Which kind of persistent session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionKind {
    /// A persistent `/bin/bash` (or `/bin/sh`): cwd, env and shell state survive across inputs.
    Shell,
    /// A persistent Python REPL: globals survive across inputs.
    Python,
}

/// Requests the host can make. Where a request carries bytes (stdin, file content, a tar stream)
/// they travel in the frame body, not in the JSON.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "op", deny_unknown_fields)]
pub enum Request {
    /// Liveness check. Answer: `Pong`.
    Ping,
    /// Run a command to completion. Body: stdin bytes (stdin is closed after them).
    /// Answer: optional `Output` events (when `stream`), then `ExecDone`.
    Exec(ExecRequest),
    /// Start a command in the background. Body: initial stdin bytes (stdin stays open).
    /// Answer: `Started`.
    Spawn(ExecRequest),
    /// Status of a background process. Answer: `ProcStatus`.
    ProcStatus {
        /// Handle from `Started`.
        handle: u64,
    },
    /// Send a signal to a background process's process group. Answer: `Ok`.
    ProcSignal {
        /// Handle from `Started`.
        handle: u64,
        /// Signal number (1..=64).
        signal: i32,
    },
    /// Write the body to a background process's stdin; close it when `eof`. Answer: `Ok`.
    ProcStdin {
        /// Handle from `Started`.
        handle: u64,
        /// Close stdin after writing.
        #[serde(default)]
        eof: bool,
    },
    /// Wait for a background process to exit. Answer: `ExecDone`, or `ProcStatus` (still running)
    /// when `timeout_ms` passes first. The handle is forgotten after `ExecDone` was sent.
    ProcWait {
        /// Handle from `Started`.
        handle: u64,
        /// How long to wait.
        timeout_ms: u64,
    },
    /// Open a persistent session. Answer: `SessionOpened`.
    SessionOpen {
        /// Shell or Python.
        kind: SessionKind,
        /// Extra environment for the session.
        #[serde(default)]
        env: BTreeMap<String, String>,
        /// Initial working directory.
        #[serde(default)]
        cwd: Option<String>,
    },
    /// Run one input in a session (shell command or Python code). Answer: `ExecDone` with the
    /// input's exit status (`$?` for a shell; 0 or 1 when Python raised).
    SessionRun {
        /// Session id from `SessionOpened`.
        session: u64,
        /// The input.
        input: String,
        /// Wall limit for this input; the session is killed (and must be reopened) on timeout.
        #[serde(default)]
        timeout_ms: Option<u64>,
    },
    /// Close a session (kills it). Answer: `Ok`.
    SessionClose {
        /// Session id.
        session: u64,
    },
    /// Read a file. Answer: `Data` events (≤ [`DATA_CHUNK`] bytes each), the last with `eof`.
    FileRead {
        /// Path inside the sandbox root.
        path: String,
        /// Most bytes to return.
        #[serde(default)]
        max_bytes: Option<u64>,
    },
    /// Atomically write the body to a file (temp file + rename). Answer: `Ok`.
    FileWrite {
        /// Path inside the sandbox root.
        path: String,
        /// Permission bits (default 0o644).
        #[serde(default)]
        mode: Option<u32>,
        /// Create missing parent directories.
        #[serde(default)]
        parents: bool,
    },
    /// List a directory. Answer: `Listing`.
    FileList {
        /// Path inside the sandbox root.
        path: String,
    },
    /// Stat a path without following a final symlink. Answer: `Stat`.
    FileStat {
        /// Path inside the sandbox root.
        path: String,
    },
    /// Create a directory. Answer: `Ok`.
    Mkdir {
        /// Path inside the sandbox root.
        path: String,
        /// Create parents as needed (and succeed if it exists).
        #[serde(default)]
        parents: bool,
        /// Permission bits (default 0o755).
        #[serde(default)]
        mode: Option<u32>,
    },
    /// Remove a file or (with `recursive`) a directory tree. Answer: `Ok`.
    Remove {
        /// Path inside the sandbox root.
        path: String,
        /// Remove directories recursively.
        #[serde(default)]
        recursive: bool,
    },
    /// Unpack the body (a tar stream) under `path`. Answer: `Ok`.
    TarUpload {
        /// Destination directory inside the sandbox root (created if missing).
        path: String,
    },
    /// Pack `path` as a tar stream. Answer: `Data` events, the last with `eof`.
    TarDownload {
        /// Path inside the sandbox root.
        path: String,
        /// Most bytes of tar stream to produce (the download fails with `too_large` past it).
        #[serde(default)]
        max_bytes: Option<u64>,
    },
    /// Follow a background process from now on. Answer: `Attached`, then `Output` events while
    /// it writes, then `ExecDone` when it exits (at once when it already has), or `Detached` when
    /// `ProcDetach` ends the following first.
    ProcAttach {
        /// Handle from `Started`/`Attached`.
        handle: u64,
    },
    /// Stop following: the request `attach` (a `ProcAttach`, or a `Spawn` with `stream`) ends
    /// with `Detached`; the process goes on. Answer: `Ok`.
    ProcDetach {
        /// Handle of the process.
        handle: u64,
        /// Id of the request that follows it.
        attach: u64,
    },
    /// The background processes still running. Answer: `Procs`.
    ProcList,
    /// Resize the pseudo-terminal of a background process started with `pty`. Answer: `Ok`.
    ProcResize {
        /// Handle of the process.
        handle: u64,
        /// The new size.
        size: crate::exec::PtySize,
    },
    /// Rename (move) a path inside the sandbox root; the destination's parent must exist and an
    /// existing destination file is replaced. Answer: `Ok`.
    FileRename {
        /// Path to move.
        from: String,
        /// Where to.
        to: String,
    },
    /// Watch a directory (inotify). Answer: `Watching`, then `FsEvents` as things change, until
    /// `Unwatch` ends it with `Detached` (or the directory goes: then `Error`).
    Watch {
        /// Directory inside the sandbox root.
        path: String,
        /// Also watch every subdirectory (and those made later).
        #[serde(default)]
        recursive: bool,
    },
    /// End a `Watch` (by the id of its request). Answer: `Ok`.
    Unwatch {
        /// Id of the `Watch` request.
        watch: u64,
    },
    /// Make the users the sandbox lacks: for each `(name, uid)` an entry in `/etc/passwd` and
    /// `/etc/group` (a group of its own with the same id) and a home `/home/<name>` of theirs;
    /// a name the sandbox has keeps its entry. Needs a writable root. Answer: `Ok`.
    EnsureUsers {
        /// Names and uids.
        users: Vec<(String, u32)>,
    },
    /// Make the inner request (a file request: read, write, list, stat, mkdir, remove, rename,
    /// tar, watch) as `user` of the sandbox: its permissions apply, and what it creates is
    /// that user's. Answer: the inner request's.
    AsUser {
        /// A user name of the sandbox (or a numeric uid).
        user: String,
        /// The request.
        req: Box<Request>,
    },
    /// Kill every process in the sandbox except the agent, reap them, forget all handles and
    /// sessions. Used by reset. Answer: `Ok`.
    KillAll,
    /// The sandbox root was replaced underneath the agent (an in-place reset: the supervisor
    /// killed every other process and pivoted the sandbox onto a fresh root): forget all handles
    /// and sessions and reopen the root used to resolve paths. Answer: `Ok`.
    ReopenRoot,
    /// Assigns the agent to a sandbox: reopen the root (it was just pivoted onto the sandbox's
    /// template), replace the base environment of every later command, and set the open-files
    /// limit applied to commands. Sent once after create. Answer: `Ok`.
    Configure {
        /// The base environment (replaces the agent's own).
        env: Vec<(String, String)>,
        /// RLIMIT_NOFILE for commands.
        #[serde(default)]
        nofile: Option<u64>,
        /// RLIMIT_FSIZE (largest file a command may write) for commands.
        #[serde(default)]
        fsize: Option<u64>,
        /// RLIMIT_NPROC of the agent itself, inherited by every command (a sandbox with a user
        /// namespace: the kernel then refuses a fork before it copies anything).
        #[serde(default)]
        nproc: Option<u64>,
        /// The working directory of commands that name none (the template's `workdir`;
        /// `/` when absent or missing in the sandbox).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        workdir: Option<String>,
        /// The user of commands and file requests that name none (the template's `user`; root
        /// when absent).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        user: Option<String>,
    },
    /// VM guests only: gives the guest's NIC `eth0` the address `addr/32` (replacing any it
    /// had), brings it up and routes everything through `gateway` (on-link): the sandbox's path
    /// out (network egress). Answer: `Ok`.
    GuestNet {
        /// The guest's address.
        addr: std::net::Ipv4Addr,
        /// The node's end of the path.
        gateway: std::net::Ipv4Addr,
    },
    /// VM guests only: takes the guest's NIC `eth0` down (its routes go with it), so that a
    /// sandbox whose policy became `none` fails to connect at once rather than time out; the
    /// node's rules drop its packets whatever the guest does. A later `GuestNet` brings it back.
    /// Answer: `Ok`.
    GuestNetOff,
    /// VM guests only: gives a guest restored from its template's snapshot its own identity —
    /// hostname, wall clock (the snapshot's clock is stale), the size of its writable layer —
    /// and mixes the request body (fresh random bytes) into the guest's entropy pool, so clones
    /// of one snapshot share no random state. Answer: `Ok`.
    Identify {
        /// The guest's hostname.
        hostname: String,
        /// The host's wall clock, nanoseconds since the Unix epoch.
        unix_ns: u64,
        /// Size limit of the writable layer in bytes (the disk quota).
        disk_bytes: u64,
        /// Inode limit of the writable layer.
        disk_inodes: u64,
        /// Make `/` read-only except for `scratch` (the default, as in a container).
        #[serde(default)]
        read_only_root: bool,
        /// Directories that stay writable under a read-only root.
        #[serde(default)]
        scratch: Vec<String>,
    },
}

/// Metadata of one path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileStat {
    /// Base name (for listings) or the requested path (for stat).
    pub name: String,
    /// `file`, `dir`, `symlink` or `other`.
    pub kind: FileKind,
    /// Size in bytes.
    pub size: u64,
    /// Permission bits.
    pub mode: u32,
    /// Modification time, seconds since the epoch.
    pub mtime: i64,
    /// Symlink target, for symlinks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_target: Option<String>,
    /// Owner uid, as seen inside the sandbox.
    #[serde(default)]
    pub uid: u32,
    /// Owner gid, as seen inside the sandbox.
    #[serde(default)]
    pub gid: u32,
    /// Owner's name in the sandbox's `/etc/passwd`, when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// Group's name in the sandbox's `/etc/group`, when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
}

/// A running background process (`ProcList`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcInfo {
    /// Handle.
    pub handle: u64,
    /// Pid inside the sandbox.
    pub pid: i32,
    /// What it runs.
    pub command: crate::exec::Command,
    /// The environment the request added.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory the request named.
    #[serde(default)]
    pub cwd: Option<String>,
    /// The request's tag.
    #[serde(default)]
    pub tag: Option<String>,
    /// Started on a pseudo-terminal.
    #[serde(default)]
    pub pty: bool,
}

/// One change seen by a `Watch`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsEvent {
    /// Path relative to the watched directory.
    pub name: String,
    /// What happened.
    pub op: FsOp,
}

/// Kinds of change a `Watch` reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FsOp {
    /// Created (or moved in).
    Create,
    /// Written (closed after writing).
    Write,
    /// Removed.
    Remove,
    /// Moved away.
    Rename,
    /// Metadata changed.
    Chmod,
}

/// Kind of a filesystem object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileKind {
    /// Regular file.
    File,
    /// Directory.
    Dir,
    /// Symbolic link.
    Symlink,
    /// Anything else (fifo, socket, device).
    Other,
}

/// Events the agent sends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "ev", deny_unknown_fields)]
pub enum Event {
    /// Sent once at start-up with id 0: the agent is ready.
    Hello {
        /// The agent's [`PROTOCOL_VERSION`].
        version: u8,
        /// The agent's pid as seen inside the sandbox (1 when it is PID 1).
        pid: i32,
    },
    /// Answer to `Ping`.
    Pong,
    /// Generic success.
    Ok,
    /// A chunk of output from a streaming exec. Body: the bytes.
    Output {
        /// Which stream.
        stream: Stream,
    },
    /// A command finished (terminal).
    ExecDone(ExecResult),
    /// A background process is followed by this request (answer to `ProcAttach`, or `Spawn`
    /// with `stream`); not terminal.
    Attached {
        /// Handle for later `Proc*` requests.
        handle: u64,
        /// Pid inside the sandbox.
        pid: i32,
    },
    /// The following (`ProcAttach`, streaming `Spawn`) or `Watch` was ended by
    /// `ProcDetach`/`Unwatch` (terminal).
    Detached,
    /// Answer to `ProcList`.
    Procs {
        /// Running background processes, by handle.
        items: Vec<ProcInfo>,
    },
    /// A `Watch` is in place; not terminal.
    Watching,
    /// Changes seen by a `Watch`; not terminal.
    FsEvents {
        /// In the order seen.
        events: Vec<FsEvent>,
    },
    /// A background process was started.
    Started {
        /// Handle for later `Proc*` requests.
        handle: u64,
        /// Pid inside the sandbox.
        pid: i32,
    },
    /// State of a background process.
    ProcStatus {
        /// Still running.
        running: bool,
        /// Pid inside the sandbox.
        pid: i32,
    },
    /// A session was opened.
    SessionOpened {
        /// Id for `SessionRun` / `SessionClose`.
        session: u64,
    },
    /// A chunk of file or tar data. Body: the bytes. Terminal when `eof`.
    Data {
        /// Last chunk.
        eof: bool,
    },
    /// Answer to `FileStat`.
    Stat(FileStat),
    /// Answer to `FileList`.
    Listing {
        /// Entries, sorted by name.
        entries: Vec<FileStat>,
    },
    /// The request failed (terminal).
    Error {
        /// Stable code.
        code: ErrorCode,
        /// Human-readable detail.
        message: String,
    },
}

impl Event {
    /// True when no further event will be sent for this request id.
    pub fn is_terminal(&self) -> bool {
        match self {
            Event::Output { .. }
            | Event::Attached { .. }
            | Event::Watching
            | Event::FsEvents { .. } => false,
            Event::Data { eof } => *eof,
            Event::Hello { .. }
            | Event::Pong
            | Event::Ok
            | Event::ExecDone(_)
            | Event::Started { .. }
            | Event::ProcStatus { .. }
            | Event::SessionOpened { .. }
            | Event::Stat(_)
            | Event::Listing { .. }
            | Event::Detached
            | Event::Procs { .. }
            | Event::Error { .. } => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_json_shape_is_stable() {
        let env = RequestEnvelope {
            id: 7,
            req: Request::ProcSignal {
                handle: 3,
                signal: 9,
            },
        };
        let json = serde_json::to_string(&env).expect("serialize");
        assert_eq!(
            json,
            r#"{"id":7,"req":{"op":"proc_signal","handle":3,"signal":9}}"#
        );
        let back: RequestEnvelope = serde_json::from_str(&json).expect("parse");
        assert_eq!(back, env);
    }

    #[test]
    fn unknown_fields_are_rejected() {
        let bad = r#"{"id":1,"req":{"op":"proc_status","handle":1,"extra":1}}"#;
        assert!(serde_json::from_str::<RequestEnvelope>(bad).is_err());
    }
}
