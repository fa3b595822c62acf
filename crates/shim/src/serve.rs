//! A supervisor serving its running sandbox: resets (in place, or by relaunching the init),
//! destroy, the init's exit, and a restarted node reconnecting on `sup.sock`.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::time::{Duration, Instant};

use dsec_api::agent::Request;
use dsec_api::error::chain;
use dsec_sys::cgroup::Cgroup;
use dsec_sys::ipc::{self, PidFd};
use dsec_sys::launch;

use crate::agent::{configure_request, send_agent_request, CONFIGURE_ID};
use crate::ctx::{send, SpawnerCtx};
use crate::init::{clear_ipc, container_spec, fresh_init, kill_all_but_init, Init, WARM_PATHS};
use crate::proto::{ControlMsg, LaunchConfig, SupervisorMsg, MAX_MSG};

/// How long after a reset or an activation the old root is released.
const RELEASE_DELAY: Duration = Duration::from_millis(20);

/// How long after an in-place reset the root of the next one is built: after the old root is
/// released, so that neither competes with the sandbox's first commands on its fresh root.
const SPARE_DELAY: Duration = Duration::from_millis(30);

/// What a supervisor holds for its launched sandbox.
pub(crate) struct Supervised<'a> {
    pub(crate) ctx: &'a SpawnerCtx,
    pub(crate) cfg: LaunchConfig,
    pub(crate) cgroup: Cgroup,
    pub(crate) init: Init,
    /// The node's control socket; `None` while no node is connected.
    pub(crate) control: Option<OwnedFd>,
    /// `sup.sock`, where a restarted node reconnects.
    pub(crate) listener: Option<UnixListener>,
    pub(crate) run_dir: &'a Path,
    pub(crate) reset_state: launch::ResetState,
}

/// The serve loop's state besides the sandbox.
struct Loop<'a> {
    sb: Supervised<'a>,
    /// Inits killed by a relaunch, not yet reaped.
    dying: Vec<PidFd>,
    /// Request ids the supervisor uses on the agent socket: far from the node's own counter.
    agent_req_id: u64,
    /// Roots replaced by a reset or an activation, released at `release_at`.
    old_roots: Vec<OwnedFd>,
    release_at: Option<Instant>,
    /// The root of the next in-place reset, built while the sandbox runs once it has been reset
    /// (a sandbox that is reset once is in a reuse loop): the reset then only pivots.
    spare: Option<launch::RootTree>,
    spare_at: Option<Instant>,
}

/// What the serve loop does after an event.
enum Flow {
    /// Handle the next ready descriptor.
    Next,
    /// Poll again.
    Poll,
    /// The sandbox is gone: wait for the node's destroy, then clean up and exit.
    AwaitDestroy,
    /// Clean up and exit.
    Destroy,
}

/// Serves the sandbox until it is destroyed; returns the process exit code. `old_placeholder`:
/// the placeholder root a pre-built shell left, released shortly.
pub(crate) fn serve(sb: Supervised<'_>, old_placeholder: Option<OwnedFd>) -> i32 {
    let old_roots: Vec<OwnedFd> = old_placeholder.into_iter().collect();
    let mut l = Loop {
        sb,
        dying: Vec::new(),
        agent_req_id: CONFIGURE_ID,
        release_at: (!old_roots.is_empty()).then(|| Instant::now() + RELEASE_DELAY),
        old_roots,
        spare: None,
        spare_at: None,
    };
    loop {
        let Some(ready) = l.wait() else { continue };
        let has_control = l.sb.control.is_some();
        for idx in ready {
            let flow = if idx == 0 {
                l.init_exited()
            } else if idx == 1 && has_control {
                l.control_message()
            } else {
                l.reconnect()
            };
            match flow {
                Flow::Next => {}
                Flow::Poll => break,
                Flow::AwaitDestroy => {
                    return wait_for_destroy(l.sb.control, l.sb.cgroup, l.sb.run_dir)
                }
                Flow::Destroy => return destroy(l.sb.control, l.sb.cgroup, l.sb.run_dir),
            }
        }
    }
}

impl Loop<'_> {
    /// Does the work that is due, then waits for the init, the control socket or a reconnect;
    /// returns which are ready (0: the init, then the control socket if any, then `sup.sock`).
    fn wait(&mut self) -> Option<Vec<usize>> {
        // Reap inits killed by a reset.
        while ipc::try_reap().is_some() {}
        self.dying.retain(|p| p.is_alive());
        // Old roots are released a little after the answer: tearing a mount tree and its
        // tmpfs down right away competes for the CPU with the sandbox's next commands.
        if self.release_at.is_some_and(|t| Instant::now() >= t) {
            self.old_roots.clear();
            self.release_at = None;
        }
        if self.spare_at.is_some_and(|t| Instant::now() >= t) {
            self.spare_at = None;
            if self.spare.is_none() {
                let spec = container_spec(self.sb.ctx, &self.sb.cfg, &self.sb.init.agent_host);
                // A failure here only means the next reset builds its root itself.
                self.spare =
                    launch::build_root_tree(&spec.rootfs, &mut self.sb.reset_state, WARM_PATHS)
                        .ok();
            }
        }
        let mut wait = if self.dying.is_empty() {
            None
        } else {
            Some(Duration::from_millis(50))
        };
        for t in [self.release_at, self.spare_at].into_iter().flatten() {
            let left = t.saturating_duration_since(Instant::now());
            wait = Some(wait.map_or(left, |w| w.min(left)));
        }
        let mut fds: Vec<BorrowedFd<'_>> = vec![self.sb.init.pidfd.as_fd()];
        if let Some(c) = &self.sb.control {
            fds.push(c.as_fd());
        }
        if let Some(l) = &self.sb.listener {
            fds.push(l.as_fd());
        }
        ipc::poll_many(&fds, wait).ok()
    }

    /// Sends `msg` to the node, if one is connected.
    fn reply(&self, msg: &SupervisorMsg, fds: &[BorrowedFd<'_>]) {
        if let Some(c) = &self.sb.control {
            let _ = send(c.as_fd(), msg, fds);
        }
    }

    /// The init exited: record its status and tell the node.
    fn init_exited(&mut self) -> Flow {
        let status = ipc::wait_pid(self.sb.init.pidfd.pid()).unwrap_or(-1);
        let _ = std::fs::write(self.sb.run_dir.join("exit"), status.to_string());
        self.reply(&SupervisorMsg::Exited { status }, &[]);
        // The sandbox is gone; wait for the node to destroy it (or for our socket to close) so
        // that it can read the record. Clean what we own now.
        let _ = self.sb.cgroup.kill_all();
        Flow::AwaitDestroy
    }

    /// A message from the node on the control socket.
    fn control_message(&mut self) -> Flow {
        let Some(c) = &self.sb.control else {
            return Flow::Next;
        };
        let buf = match ipc::recv_msg(c.as_fd(), MAX_MSG) {
            Ok((buf, _)) => buf,
            Err(_) => Vec::new(),
        };
        if buf.is_empty() {
            // Node closed the control socket (restart or crash): keep the sandbox, wait for a
            // reconnect on sup.sock.
            self.sb.control = None;
            return Flow::Poll;
        }
        match serde_json::from_slice::<ControlMsg>(&buf) {
            // In place only when the agent really left nothing else running (a compromised
            // agent could lie about KillAll). In place: every process of the sandbox but the
            // agent is killed here, from outside (the agent is not trusted to do it), then the
            // root is swapped underneath the agent. A tree that will not die falls back to a
            // relaunch.
            Ok(ControlMsg::Reset)
                if kill_all_but_init(&self.sb.cgroup, self.sb.init.pidfd.pid())
                    && clear_ipc(&mut self.sb.init, &mut self.sb.reset_state) =>
            {
                self.reset_in_place();
                Flow::Next
            }
            Ok(ControlMsg::Reset) => self.relaunch(),
            Ok(ControlMsg::Restore { lowerdirs }) => {
                // The spare root was built for the old layers.
                self.spare = None;
                self.sb.cfg.lowerdirs = lowerdirs;
                if kill_all_but_init(&self.sb.cgroup, self.sb.init.pidfd.pid())
                    && clear_ipc(&mut self.sb.init, &mut self.sb.reset_state)
                {
                    self.reset_in_place();
                    Flow::Next
                } else {
                    self.relaunch()
                }
            }
            Ok(ControlMsg::Upper) => {
                let (uid, gid) = self.sb.reset_state.root_ids();
                match self.sb.reset_state.upper() {
                    Some(fd) => self.reply(&SupervisorMsg::Upper { uid, gid }, &[fd]),
                    None => self.reply(
                        &SupervisorMsg::Error {
                            message: "this sandbox's root was not built by its supervisor \
                                      (no user namespace): it cannot be snapshotted"
                                .into(),
                        },
                        &[],
                    ),
                }
                Flow::Next
            }
            Ok(ControlMsg::Destroy) => {
                let _ = self.sb.init.pidfd.signal(9);
                let _ = ipc::wait_pid(self.sb.init.pidfd.pid());
                for d in self.dying.drain(..) {
                    let _ = ipc::wait_pid(d.pid());
                }
                Flow::Destroy
            }
            Err(e) => {
                let msg = SupervisorMsg::Error {
                    message: format!("bad control message: {e}"),
                };
                self.reply(&msg, &[]);
                Flow::Next
            }
        }
    }

    /// Swaps the root underneath the running agent (every other process is gone).
    fn reset_in_place(&mut self) {
        // The agent's `ReopenRoot` goes out before the pivot, so that its answer overlaps the
        // pivot: it drops its handles and sessions (their processes are gone) and reopens the
        // root at its next use, which comes after the node's answer, after the pivot. The node
        // is waiting on us, so it writes nothing to the agent socket meanwhile. An agent that
        // cannot be written to is broken: end it, so that the node's wait ends on its closed
        // socket.
        self.agent_req_id += 1;
        if !send_agent_request(
            &self.sb.init.agent_host,
            self.agent_req_id,
            &Request::ReopenRoot,
        ) {
            let _ = self.sb.init.pidfd.signal(9);
        }
        let spec = container_spec(self.sb.ctx, &self.sb.cfg, &self.sb.init.agent_host);
        let state = &mut self.sb.reset_state;
        let pivoted = match self.spare.take().filter(|t| t.matches(&spec.rootfs, state)) {
            Some(tree) => launch::enter_root_tree(tree, &self.sb.init.pidfd, state),
            None => launch::reset_in_place(&spec, &self.sb.init.pidfd, state),
        };
        match pivoted {
            Ok(old_root) => {
                let done = SupervisorMsg::ResetDone {
                    init_pid: self.sb.init.pidfd.pid(),
                    await_id: self.agent_req_id,
                };
                self.reply(&done, &[]);
                // The old writable layer is freed later, off the path of the answer and of the
                // sandbox's next commands.
                self.old_roots.push(old_root);
                self.release_at
                    .get_or_insert(Instant::now() + RELEASE_DELAY);
                self.spare_at.get_or_insert(Instant::now() + SPARE_DELAY);
            }
            Err(e) => {
                let message = chain(&e);
                self.reply(&SupervisorMsg::Error { message }, &[]);
            }
        }
    }

    /// Kills the init and launches a fresh one in fresh namespaces.
    fn relaunch(&mut self) -> Flow {
        let _ = self.sb.init.pidfd.signal(9);
        let state = &mut self.sb.reset_state;
        match fresh_init(self.sb.ctx, &self.sb.cfg, &self.sb.cgroup, state) {
            Ok((new, placeholder)) => {
                let old = std::mem::replace(&mut self.sb.init, new);
                self.dying.push(old.pidfd);
                if let Some(root) = placeholder {
                    self.old_roots.push(root);
                    self.release_at
                        .get_or_insert(Instant::now() + RELEASE_DELAY);
                }
                // A new agent: configure it like the first one.
                self.agent_req_id += 1;
                let msg = if send_agent_request(
                    &self.sb.init.agent_host,
                    self.agent_req_id,
                    &configure_request(&self.sb.cfg),
                ) {
                    SupervisorMsg::ResetDone {
                        init_pid: self.sb.init.pidfd.pid(),
                        await_id: self.agent_req_id,
                    }
                } else {
                    SupervisorMsg::Error {
                        message: "could not configure the relaunched agent".into(),
                    }
                };
                self.reply(&msg, &[self.sb.init.agent_host.as_fd()]);
                Flow::Next
            }
            Err(failure) => {
                self.reply(
                    &SupervisorMsg::Error {
                        message: failure.to_string(),
                    },
                    &[],
                );
                let _ = ipc::wait_pid(self.sb.init.pidfd.pid());
                Flow::Destroy
            }
        }
    }

    /// A reconnecting node: hand it the agent socket and a fresh control socket over the
    /// accepted stream.
    fn reconnect(&mut self) -> Flow {
        let Some(l) = &self.sb.listener else {
            return Flow::Next;
        };
        if let Ok((stream, _)) = l.accept() {
            // Only the node: a process of another uid or pid namespace that reaches the socket
            // (a permission slip, an escaped sandbox process) is hung up on with nothing.
            let node = ipc::peer_cred(stream.as_fd()).is_ok_and(|c| c.is_host_peer());
            if !node {
                return Flow::Poll;
            }
            if let Ok((node_end, ours)) = ipc::seqpacket_pair() {
                let msg = SupervisorMsg::Launched {
                    req: 0,
                    sup_pid: std::process::id() as i32,
                    init_pid: self.sb.init.pidfd.pid(),
                    phases_us: (0, 0),
                    configure_id: CONFIGURE_ID,
                };
                let fds = [self.sb.init.agent_host.as_fd(), node_end.as_fd()];
                if send(stream.as_fd(), &msg, &fds).is_ok() {
                    self.sb.control = Some(ours);
                }
            }
        }
        Flow::Poll
    }
}

/// Waits (bounded) for the node's destroy of a sandbox whose init is gone, then destroys.
fn wait_for_destroy(control: Option<OwnedFd>, cgroup: Cgroup, run_dir: &Path) -> i32 {
    if let Some(c) = &control {
        // Bounded: the node destroys promptly; if it does not, clean up anyway.
        if let Ok(true) = ipc::poll_readable(c.as_fd(), Duration::from_secs(30)) {
            let _ = ipc::recv_msg(c.as_fd(), MAX_MSG);
        }
    }
    destroy(control, cgroup, run_dir)
}

/// Removes the sandbox's cgroup and runtime directory and tells the node; the exit code.
fn destroy(control: Option<OwnedFd>, cgroup: Cgroup, run_dir: &Path) -> i32 {
    let _ = cgroup.kill_all();
    let _ = cgroup.remove();
    let _ = std::fs::remove_dir_all(run_dir);
    if let Some(c) = &control {
        let _ = send(c.as_fd(), &SupervisorMsg::Destroyed, &[]);
    }
    0
}
