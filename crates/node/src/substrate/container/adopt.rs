//! Re-attaching to sandboxes that outlived the node process that created them.
//!
//! Every supervisor listens on `<run_dir>/sandboxes/<id>/sup.sock`. A restarted node connects,
//! and the supervisor answers with a `Launched` message carrying the agent socket and a fresh
//! control socket: the sandbox continues exactly as it was, processes and files included.

use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

use dsec_sys::ipc::{self, PidFd};

use crate::agent_client::AgentConn;
use crate::sandbox::{SandboxSpec, State};
use crate::substrate::{Backend, Runtime, RuntimeError, Sandbox};
use dsec_shim::proto::{SupervisorMsg, MAX_MSG};

/// How long a supervisor gets to answer a reconnect.
const ADOPT_DEADLINE: Duration = Duration::from_secs(5);

/// How old an empty sandbox cgroup no record of this node names must be before a sweep removes
/// it: twice the longest a create may take, so that no create still sets it up.
pub const ORPHAN_CGROUP_GRACE: Duration = Duration::from_secs(60);

impl Runtime {
    /// The runtime directory of sandbox `id`.
    pub fn sandbox_run_dir(&self, id: &str) -> PathBuf {
        self.cfg.run_dir.join("sandboxes").join(id)
    }

    /// Ids of the sandboxes with a runtime directory on this node (live or left over).
    pub fn sandbox_dirs(&self) -> Vec<String> {
        let mut ids: Vec<String> = std::fs::read_dir(self.cfg.run_dir.join("sandboxes"))
            .map(|rd| {
                rd.flatten()
                    .filter_map(|e| e.file_name().to_str().map(str::to_owned))
                    .filter(|n| n.starts_with("sb-"))
                    .collect()
            })
            .unwrap_or_default();
        ids.sort();
        ids
    }

    /// Names of the sandbox cgroups (`<base>/sb-*`) on this host, in any hierarchy, whoever
    /// made them.
    pub fn sandbox_cgroups(&self) -> Vec<String> {
        self.cgroups
            .list()
            .map(|names| names.into_iter().filter(|n| super::valid_id(n)).collect())
            .unwrap_or_default()
    }

    /// Removes sandbox cgroup `id`, which no live sandbox of this node has, from every
    /// hierarchy. `ours`: this node recorded the sandbox (its create failed or it was
    /// destroyed), so whatever is left in it is killed. Otherwise another node process on this
    /// host may own it, so only an empty cgroup older than [`ORPHAN_CGROUP_GRACE`] goes (an
    /// empty one is dead for any owner, unless a create is setting it up right now). Returns
    /// whether it was removed.
    pub fn remove_orphan_cgroup(&self, id: &str, ours: bool) -> bool {
        let Some(cg) = self.cgroups.open(id) else {
            return false;
        };
        if !ours {
            let idle = cg.is_empty().unwrap_or(false)
                && cg.age().is_some_and(|age| age >= ORPHAN_CGROUP_GRACE);
            if !idle {
                return false;
            }
        }
        let _ = cg.kill_all();
        cg.remove().is_ok()
    }

    /// Reconnects to the supervisor of a sandbox created by an earlier node process. `spec` is
    /// what it was created with (from the node's store); `state` is `Ready` for a sandbox that
    /// waits in a pool, `Running` for one in use. Processes, sessions and files are untouched.
    pub fn adopt(
        &self,
        id: &str,
        spec: SandboxSpec,
        state: State,
    ) -> Result<Sandbox, RuntimeError> {
        if !super::valid_id(id) {
            return Err(RuntimeError::Invalid(format!("invalid sandbox id {id:?}")));
        }
        if spec.substrate.is_vm() {
            return self.adopt_vm(id, spec, state);
        }
        let run_dir = self.sandbox_run_dir(id);
        let sup_err = |message: String| RuntimeError::Supervisor {
            id: id.to_owned(),
            message,
        };
        let stream = UnixStream::connect(run_dir.join("sup.sock"))
            .map_err(|e| sup_err(format!("connect sup.sock: {e}")))?;
        // The listener must be a host process of our uid, and below the supervisor it names.
        let listener = ipc::peer_cred(stream.as_fd()).map_err(|e| sup_err(e.to_string()))?;
        if !listener.is_host_peer() {
            return Err(sup_err(format!(
                "sup.sock is held by pid {} (uid {}), not a supervisor of this node",
                listener.pid, listener.uid
            )));
        }
        if !ipc::poll_readable(stream.as_fd(), ADOPT_DEADLINE)
            .map_err(|e| sup_err(e.to_string()))?
        {
            return Err(sup_err("no answer on sup.sock".into()));
        }
        let mut buf = vec![0u8; MAX_MSG];
        let (n, mut fds) =
            ipc::recv_with_fds(stream.as_fd(), &mut buf).map_err(|e| sup_err(e.to_string()))?;
        if n == 0 {
            return Err(sup_err("sup.sock closed".into()));
        }
        let msg: SupervisorMsg =
            serde_json::from_slice(&buf[..n]).map_err(|e| sup_err(e.to_string()))?;
        let SupervisorMsg::Launched {
            sup_pid, init_pid, ..
        } = msg
        else {
            return Err(sup_err(format!("unexpected {msg:?}")));
        };
        let (Some(control), Some(agent_fd)) = (fds.pop(), fds.pop()) else {
            return Err(sup_err("supervisor sent no descriptors".into()));
        };
        if sup_pid != listener.pid {
            return Err(sup_err(format!(
                "sup.sock is held by pid {}, but its answer names supervisor {sup_pid}",
                listener.pid
            )));
        }
        let sup = PidFd::open(sup_pid).map_err(|e| sup_err(format!("pidfd: {e}")))?;
        let oom_kills = self
            .cgroups()
            .open(id)
            .and_then(|c| c.stats().ok())
            .map_or(0, |s| s.oom_kills);
        let mut sandbox = Sandbox {
            id: id.to_owned(),
            spec,
            state,
            agent: AgentConn::adopted(agent_fd),
            backend: Backend::Container { control },
            sup,
            init_pid,
            run_dir,
            oom_kills,
        };
        sandbox.ping()?;
        Ok(sandbox)
    }
}
