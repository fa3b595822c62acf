//! The container substrate: namespaces + cgroups + seccomp + overlayfs, one `dsec-agent` per
//! sandbox as PID 1. Each sandbox is supervised by its own `dsec-shim` process (the `dsec-shim`
//! crate, [`shim`]), forked by the spawner ([`spawner`]), so sandboxes survive the node.

pub use dsec_shim as shim;

mod adopt;
pub(crate) mod create;
pub(crate) mod spawner;

use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use dsec_shim::proto::{ControlMsg, SupervisorMsg, MAX_MSG};
use dsec_sys::ipc;

use super::{Backend, Runtime, RuntimeError, Sandbox};
use crate::agent_client::{AgentConn, AgentError};
use crate::sandbox::State;
use spawner::Reply;

pub use adopt::ORPHAN_CGROUP_GRACE;
pub use create::{new_id, valid_id, Phases};

impl Sandbox {
    /// Why a container is not whole any more: its supervisor exited, or reported the end of
    /// the sandbox init on the control socket (nothing else arrives there unasked).
    pub(super) fn container_death(&self, control: &OwnedFd) -> Option<String> {
        if !self.sup.is_alive() {
            return Some("its supervisor exited".into());
        }
        match ipc::poll_readable(control.as_fd(), Duration::ZERO) {
            Ok(false) => None,
            Ok(true) => {
                // The supervisor records the init's wait status next to its socket.
                let status = std::fs::read_to_string(self.run_dir.join("exit"))
                    .ok()
                    .and_then(|s| s.trim().parse::<i32>().ok());
                Some(match status {
                    Some(st) if st & 0x7f == 0 => {
                        format!("the sandbox init exited with code {}", (st >> 8) & 0xff)
                    }
                    Some(st) => format!("the sandbox init was killed by signal {}", st & 0x7f),
                    None => "its supervisor reported the end of the sandbox init".into(),
                })
            }
            Err(_) => Some("its control socket failed".into()),
        }
    }

    fn control_call(&mut self, msg: &ControlMsg, timeout: Duration) -> Result<Reply, RuntimeError> {
        let sup_err = |message: String| RuntimeError::Supervisor {
            id: self.id.clone(),
            message,
        };
        let bytes = serde_json::to_vec(msg).map_err(|e| sup_err(e.to_string()))?;
        let Backend::Container { control } = &self.backend else {
            return Err(sup_err("no supervisor (a VM sandbox)".into()));
        };
        ipc::send_with_fds(control.as_fd(), &bytes, &[]).map_err(|e| sup_err(e.to_string()))?;
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if !ipc::poll_readable(control.as_fd(), left).map_err(|e| sup_err(e.to_string()))? {
                return Err(sup_err(format!("no answer within {timeout:?}")));
            }
            let (buf, fds) =
                ipc::recv_msg(control.as_fd(), MAX_MSG).map_err(|e| sup_err(e.to_string()))?;
            if buf.is_empty() {
                return Err(sup_err("control socket closed".into()));
            }
            let reply: SupervisorMsg =
                serde_json::from_slice(&buf).map_err(|e| sup_err(e.to_string()))?;
            match reply {
                SupervisorMsg::Exited { .. } => continue, // the old init's exit during a reset
                SupervisorMsg::Error { message } => return Err(sup_err(message)),
                other => return Ok((other, fds)),
            }
        }
    }

    /// The upper (writable) layer of the container's root, as an `O_PATH` descriptor, and the
    /// host uid and gid of its root (the layer's files carry host ids from there up).
    pub(super) fn container_upper(&mut self) -> Result<(OwnedFd, (u32, u32)), RuntimeError> {
        let (reply, mut fds) = self.control_call(&ControlMsg::Upper, Duration::from_secs(10))?;
        match (reply, fds.pop()) {
            (SupervisorMsg::Upper { uid, gid }, Some(fd)) => Ok((fd, (uid, gid))),
            (other, _) => Err(RuntimeError::Supervisor {
                id: self.id.clone(),
                message: format!("unexpected {other:?}"),
            }),
        }
    }

    /// Kills every process in the sandbox and starts a fresh init on a fresh writable layer
    /// (above `lowerdirs` from now on, when given); returns when the new agent answered a
    /// ping.
    pub(super) fn reset_container(
        &mut self,
        lowerdirs: Option<Vec<String>>,
    ) -> Result<(), RuntimeError> {
        let id = self.id.clone();
        let agent_err = |source| RuntimeError::Agent {
            id: id.clone(),
            source,
        };
        let msg = match lowerdirs {
            Some(lowerdirs) => ControlMsg::Restore { lowerdirs },
            None => ControlMsg::Reset,
        };
        let (reply, mut fds) = self.control_call(&msg, Duration::from_secs(30))?;
        let SupervisorMsg::ResetDone { init_pid, await_id } = reply else {
            return Err(RuntimeError::Supervisor {
                id: self.id.clone(),
                message: format!("unexpected {reply:?}"),
            });
        };
        if let Some(agent_fd) = fds.pop() {
            // A relaunched init: a new agent on a new socket.
            self.agent = AgentConn::new(agent_fd);
            self.init_pid = init_pid;
        }
        // The supervisor already sent the agent `ReopenRoot` (in place) or `Configure` (a new
        // agent); its answer is the health check.
        self.agent
            .await_reply(await_id, Duration::from_secs(10))
            .map_err(agent_err)?;
        if !self.agent.greeted() {
            return Err(agent_err(AgentError::Unexpected(
                "no hello from the agent".into(),
            )));
        }
        Ok(())
    }

    /// Destroys a container: kills every process, removes its cgroup, mounts (they live only in
    /// its own mount namespace) and runtime directory.
    pub(super) fn destroy_container(mut self, rt: &Runtime) -> Result<(), RuntimeError> {
        let answered = self.control_call(&ControlMsg::Destroy, Duration::from_secs(10));
        // Whatever the supervisor said, make sure it is gone and nothing is left behind.
        if !self
            .sup
            .wait_exit(Duration::from_secs(if answered.is_ok() { 5 } else { 0 }))
            .unwrap_or(false)
        {
            let _ = self.sup.signal(9);
            let _ = self.sup.wait_exit(Duration::from_secs(5));
        }
        let clean = rt.cleanup_leftovers(&self.id, &self.run_dir) && !self.sup.is_alive();
        self.state = self.state.transition(State::Stopped)?;
        // A supervisor that died before the destroy (killed, crashed) cannot answer; the
        // destroy still succeeded when nothing of the sandbox is left.
        match answered {
            Ok(_) => Ok(()),
            Err(_) if clean => Ok(()),
            Err(e) => Err(e),
        }
    }
}
