//! Messages between the node, the spawner and the per-sandbox supervisors (`dsec-shim`).
//!
//! All travel as one JSON document per `SOCK_SEQPACKET` message; descriptors ride along as
//! `SCM_RIGHTS`. The node → spawner socket carries [`SpawnRequest`]s; each supervisor answers its
//! request on the same socket (a seqpacket message is atomic, so concurrent supervisors never
//! interleave) with a [`SupervisorMsg::Launched`] plus two descriptors: the agent socket and the
//! supervisor's control socket.

use serde::{Deserialize, Serialize};

use crate::sandbox::Limits;

/// Largest control message.
pub const MAX_MSG: usize = 64 << 10;

/// Everything a supervisor needs to launch (and relaunch) one sandbox.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LaunchConfig {
    /// Sandbox id (also the cgroup name and hostname).
    pub id: String,
    /// Overlay lower directories, topmost first.
    pub lowerdirs: Vec<String>,
    /// Stage directory for the private tmpfs.
    pub stage: String,
    /// Per-sandbox runtime directory (supervisor socket, exit record).
    pub run_dir: String,
    /// Limits.
    pub limits: Limits,
    /// Writable root (writes land in the private upper) instead of read-only + scratch dirs.
    pub writable_root: bool,
    /// Writable scratch directories when the root is read-only.
    pub scratch: Vec<String>,
    /// Environment of the agent (the base environment of every exec).
    pub env: Vec<(String, String)>,
    /// Map root inside to this unprivileged host uid/gid range (user namespace).
    pub userns: Option<(u32, u32, u32)>,
}

/// Node → spawner.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SpawnRequest {
    /// Correlation id.
    pub req: u64,
    /// What to launch.
    pub config: LaunchConfig,
}

/// Node → spawner.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
pub enum NodeMsg {
    /// Launch a sandbox with a freshly forked supervisor.
    Spawn(Box<SpawnRequest>),
    /// The node used (or found dead) one idle shell: build a replacement.
    ShellTaken,
}

/// Supervisor → node.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
pub enum SupervisorMsg {
    /// The sandbox init exec'd the agent. Fds: agent socket, control socket.
    Launched {
        /// Correlation id of the spawn request (0 for a relaunch).
        req: u64,
        /// Supervisor pid.
        sup_pid: i32,
        /// Sandbox init pid (host pid namespace).
        init_pid: i32,
        /// Supervisor-side phase latencies, microseconds: cgroup create, then clone → agent exec'd.
        #[serde(default)]
        phases_us: (u64, u64),
        /// The supervisor sent the agent its `Configure` (environment, per-command limits, root
        /// reopen) with this request id before answering; the node awaits the agent's answer.
        configure_id: u64,
    },
    /// The spawner holds a new idle shell. Fd: the shell's request socket (`SOCK_SEQPACKET`),
    /// to which the node sends one [`SpawnRequest`] with a reply socket attached.
    ShellReady,
    /// An idle shell could not be built (the spawner should build another).
    ShellFailed,
    /// Launch failed; the supervisor has cleaned up and exits.
    Failed {
        /// Correlation id.
        req: u64,
        /// The failing step and cause.
        message: String,
    },
    /// Reset finished: a fresh init is running. Fd: the new agent socket.
    ResetDone {
        /// New init pid.
        init_pid: i32,
        /// The request the supervisor sent the agent before answering, whose answer is the
        /// health check the node awaits: `ReopenRoot` after an in-place reset, `Configure` to a
        /// relaunched agent.
        await_id: u64,
    },
    /// The sandbox init exited on its own (crash, OOM of the agent, killed from outside).
    Exited {
        /// Raw wait status.
        status: i32,
    },
    /// Destroy finished; the supervisor exits after sending this.
    Destroyed,
    /// An operation failed.
    Error {
        /// What failed.
        message: String,
    },
}

/// Node → supervisor (control socket).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum ControlMsg {
    /// Kill the sandbox tree and start a fresh init on a fresh writable layer.
    Reset,
    /// Kill the sandbox tree, remove every trace (cgroup, run dir) and exit.
    Destroy,
}
