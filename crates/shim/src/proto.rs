//! Messages between the node, the spawner and the per-sandbox supervisors (`dsec-shim`).
//!
//! All travel as one JSON document per `SOCK_SEQPACKET` message; descriptors ride along as
//! `SCM_RIGHTS`. The node → spawner socket carries [`SpawnRequest`]s; each supervisor answers its
//! request on the same socket (a seqpacket message is atomic, so concurrent supervisors never
//! interleave) with a [`SupervisorMsg::Launched`] plus two descriptors: the agent socket and the
//! supervisor's control socket, or a [`SupervisorMsg::Failed`] naming the step that failed.

use serde::{Deserialize, Serialize};

use dsec_api::limits::Limits;

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
    /// A user namespace: root inside mapped to an unprivileged host id range that the
    /// sandbox's supervisor leases for its life (`dsec_sys::idrange`), so that no two live
    /// sandboxes of the host share host ids.
    pub userns: bool,
    /// The working directory of commands that name none (the template's).
    #[serde(default)]
    pub workdir: Option<String>,
    /// The user of commands that name none (the template's; root when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// The leased range (first uid, first gid, count), filled in by the supervisor; never sent.
    #[serde(skip)]
    pub ids: Option<(u32, u32, u32)>,
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
    /// Build some idle shells (at most [`PREFERRED_SHELLS`]) with this root instead of the
    /// likely one: the root of the snapshot creates come from now (`None`: stop).
    Prefer {
        /// The root to pre-build.
        rootfs: Option<dsec_sys::launch::RootfsSpec>,
    },
    /// The node used one idle shell built for a preferred root.
    PreferredTaken,
}

/// Most idle shells built for a preferred root at once (never more than half of them).
pub const PREFERRED_SHELLS: usize = 2;

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
    ShellReady {
        /// The shell's init (host pid namespace), already in the sandbox's namespaces: the
        /// node may plumb its network while the launch runs (0: not told).
        #[serde(default)]
        init_pid: i32,
    },
    /// The spawner holds a new idle shell whose root was built for a preferred root (see
    /// [`NodeMsg::Prefer`]) of these lower directories. Fd: as `ShellReady`.
    PreferredReady {
        /// The lower directories its root was built with.
        lowerdirs: Vec<String>,
        /// Whether its root was built writable.
        #[serde(default)]
        writable_root: bool,
        /// As in `ShellReady`.
        #[serde(default)]
        init_pid: i32,
    },
    /// An idle shell could not be built (the spawner should build another).
    ShellFailed,
    /// Launch failed; the supervisor has cleaned up and exits.
    Failed {
        /// Correlation id.
        req: u64,
        /// The failing step and cause.
        failure: LaunchFailure,
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
    /// The answer to [`ControlMsg::Upper`]. Fd: the upper layer (`O_PATH`, a directory).
    Upper {
        /// Host uid of the sandbox's root (its uids count up from there; 0 without a user
        /// namespace).
        uid: u32,
        /// Host gid of the sandbox's root.
        gid: u32,
    },
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
    /// Send the upper (writable) layer of the sandbox's root, as an `O_PATH` descriptor, for a
    /// snapshot: answered by [`SupervisorMsg::Upper`].
    Upper,
    /// Like `Reset`, onto a root of these lower layers (topmost first) from now on: a rollback
    /// to a snapshot. Later resets come back to them.
    Restore {
        /// Overlay lower directories, topmost first.
        lowerdirs: Vec<String>,
    },
}

/// The step of a launch that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LaunchStep {
    /// Forking the supervisor.
    Fork,
    /// Creating the sandbox's runtime directory.
    RunDir,
    /// Binding the host root for a sandbox with a user namespace.
    HostRoot,
    /// Creating the sandbox's cgroup (or renaming a pre-built shell's).
    CgroupCreate,
    /// Writing the cgroup's limits.
    CgroupLimits,
    /// Moving the sandbox init into its cgroup.
    CgroupAttach,
    /// Creating the sockets between the node, the supervisor and the agent.
    Sockets,
    /// Cloning the sandbox init into its namespaces.
    Clone,
    /// Writing the user namespace's id maps.
    IdMap,
    /// Setting up the init's namespaces (cgroup, time, mount).
    Namespaces,
    /// Building the root: tmpfs, overlay, `/dev`, `/proc`, masks, scratch directories.
    Rootfs,
    /// Switching to the new root (`pivot_root`, or moving a built root onto a pre-built shell).
    Pivot,
    /// Setting the sandbox's hostname.
    Hostname,
    /// The init's descriptors, rlimits and loopback interface.
    Process,
    /// Dropping privileges: ids, capabilities, securebits, seccomp.
    Privileges,
    /// Executing the agent.
    ExecAgent,
    /// Any other setup step of the sandbox init (receiving its parameters, preparing).
    Setup,
    /// Opening a pidfd on the init.
    Pidfd,
    /// Sending the agent its `Configure`.
    Configure,
    /// Reaching the spawner.
    Spawner,
    /// No answer within the create deadline.
    Timeout,
    /// The supervisor's answer was missing, malformed or incomplete.
    Reply,
}

/// What the step does, for messages.
impl std::fmt::Display for LaunchStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LaunchStep::Fork => "forking the supervisor",
            LaunchStep::RunDir => "creating the runtime directory",
            LaunchStep::HostRoot => "binding the host root",
            LaunchStep::CgroupCreate => "creating the cgroup",
            LaunchStep::CgroupLimits => "writing the cgroup limits",
            LaunchStep::CgroupAttach => "attaching the init to its cgroup",
            LaunchStep::Sockets => "creating sockets",
            LaunchStep::Clone => "cloning the sandbox init",
            LaunchStep::IdMap => "writing the user namespace id maps",
            LaunchStep::Namespaces => "setting up namespaces",
            LaunchStep::Rootfs => "building the root filesystem",
            LaunchStep::Pivot => "switching to the sandbox root",
            LaunchStep::Hostname => "setting the hostname",
            LaunchStep::Process => "setting up the init process",
            LaunchStep::Privileges => "dropping privileges",
            LaunchStep::ExecAgent => "executing the agent",
            LaunchStep::Setup => "setting up the sandbox init",
            LaunchStep::Pidfd => "opening the init's pidfd",
            LaunchStep::Configure => "configuring the agent",
            LaunchStep::Spawner => "reaching the spawner",
            LaunchStep::Timeout => "waiting for the supervisor",
            LaunchStep::Reply => "reading the supervisor's answer",
        })
    }
}

/// Why a launch failed: the step, the OS error when there was one, and the cause in words.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LaunchFailure {
    /// The step that failed.
    pub step: LaunchStep,
    /// The OS error number of the failure, if it came from a system call.
    pub errno: Option<i32>,
    /// The cause, with its chain of sources.
    pub message: String,
}

impl LaunchFailure {
    /// A failure of `step` without an OS error.
    pub fn new(step: LaunchStep, message: impl Into<String>) -> Self {
        Self {
            step,
            errno: None,
            message: message.into(),
        }
    }

    /// A failure of `step` caused by `e` (its OS error number, if any).
    pub fn io(step: LaunchStep, e: &std::io::Error) -> Self {
        Self {
            step,
            errno: e.raw_os_error(),
            message: e.to_string(),
        }
    }
}

impl std::fmt::Display for LaunchFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} failed: {}", self.step, self.message)
    }
}

impl std::error::Error for LaunchFailure {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_travels_with_its_step_and_errno() -> Result<(), serde_json::Error> {
        let msg = SupervisorMsg::Failed {
            req: 7,
            failure: LaunchFailure::io(
                LaunchStep::CgroupCreate,
                &std::io::Error::from_raw_os_error(28),
            ),
        };
        let text = serde_json::to_string(&msg)?;
        assert!(text.contains(r#""step":"cgroup_create""#), "{text}");
        assert!(text.contains(r#""errno":28"#), "{text}");
        let SupervisorMsg::Failed { req, failure } = serde_json::from_str(&text)? else {
            panic!("not a failure: {text}");
        };
        assert_eq!(
            (req, failure.step, failure.errno),
            (7, LaunchStep::CgroupCreate, Some(28))
        );
        assert!(failure
            .to_string()
            .starts_with("creating the cgroup failed: "));
        Ok(())
    }
}
