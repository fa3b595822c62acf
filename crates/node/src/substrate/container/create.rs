//! Creating a container sandbox.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use dsec_shim::proto::{
    LaunchConfig, LaunchFailure, LaunchStep, NodeMsg, SpawnRequest, SupervisorMsg, MAX_MSG,
};
use dsec_sys::ipc::{self, PidFd};

use super::spawner::{IdleShell, Reply};
use crate::agent_client::AgentConn;
use crate::sandbox::{Limits, SandboxSpec, State};
use crate::substrate::{Backend, OnShell, Runtime, RuntimeError, Sandbox};

type Env = Vec<(String, String)>;

/// How long a create may take before it is declared failed.
const CREATE_DEADLINE: Duration = Duration::from_secs(30);

/// Directories writable inside a sandbox whose root is read-only.
pub const SCRATCH_DIRS: &[&str] = &["/tmp", "/var/tmp", "/root", "/home", "/workspace"];

/// Latency of each create phase, microseconds.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Phases {
    /// Until the supervisor reported the init exec'd (fork, cgroup, clone, mounts, exec).
    pub launch_us: u64,
    /// Until the agent said hello.
    pub hello_us: u64,
    /// Inside the supervisor: creating and configuring the cgroup.
    pub cgroup_us: u64,
    /// Inside the supervisor: clone, namespaces, mounts, privilege drop, exec of the agent.
    pub clone_exec_us: u64,
}

static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A fresh sandbox id: `sb-` + 16 hex digits, unique per node (in a cluster, the first four
/// are the node's number: `dsec_cluster::ids`).
pub fn new_id() -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mix = (t ^ (u64::from(std::process::id()) << 40)).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ n;
    // In a cluster the first four digits are the node's number (gateways route by it).
    let mix = match crate::member::number() {
        0 => mix,
        number => dsec_cluster::ids::with_number(number, mix),
    };
    format!("sb-{mix:016x}")
}

/// Whether `id` has the form [`new_id`] makes (`sb-` + 16 lowercase hex digits).
pub fn valid_id(id: &str) -> bool {
    id.len() == 19
        && id.starts_with("sb-")
        && id[3..]
            .bytes()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

impl Runtime {
    pub(crate) fn lowerdirs(&self, template: &str) -> Result<(Vec<String>, Env), RuntimeError> {
        self.container_template(template)
            .map(|(dirs, env, _, _)| (dirs, env))
    }

    /// A template's lower directories (topmost first), environment, working directory
    /// (`None`: `/`) and user (`None`: root).
    #[allow(clippy::type_complexity)]
    fn container_template(
        &self,
        template: &str,
    ) -> Result<(Vec<String>, Env, Option<String>, Option<String>), RuntimeError> {
        if template == "host" {
            return Ok((
                vec![self.host_mask.display().to_string(), "/".into()],
                Vec::new(),
                None,
                None,
            ));
        }
        let t = self
            .templates
            .get(template)
            .map_err(RuntimeError::Template)?;
        // A template built on the host's (a committed snapshot of a `host` sandbox) takes the
        // mask the runtime staged off the root's file system, as `host` does.
        let dirs = self
            .templates
            .lowerdirs(&t)
            .into_iter()
            .map(|p| {
                if p == self.host_mask_src {
                    self.host_mask.display().to_string()
                } else {
                    p.display().to_string()
                }
            })
            .collect();
        let workdir = (t.workdir != "/" && !t.workdir.is_empty()).then(|| t.workdir.clone());
        Ok((dirs, t.env.clone(), workdir, t.user.clone()))
    }

    /// The base environment of every command in sandbox `id`: defaults, then the template's,
    /// then the request's.
    pub(crate) fn sandbox_env(
        &self,
        id: &str,
        template_env: Env,
        spec: &SandboxSpec,
    ) -> Vec<(String, String)> {
        let mut env: Vec<(String, String)> = vec![
            (
                "PATH".into(),
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
            ),
            ("HOME".into(), "/root".into()),
            ("LANG".into(), "C.UTF-8".into()),
            ("TERM".into(), "xterm".into()),
            ("HOSTNAME".into(), id.to_owned()),
            ("DSEC_SANDBOX_ID".into(), id.to_owned()),
        ];
        for (k, v) in template_env.into_iter().chain(spec.env.clone()) {
            env.retain(|(ek, _)| *ek != k);
            env.push((k, v));
        }
        env
    }

    /// Creates a sandbox and waits until its agent is ready.
    pub fn create(&self, spec: &SandboxSpec) -> Result<(Sandbox, Phases), RuntimeError> {
        self.create_with_id(&new_id(), spec)
    }

    /// Like [`Runtime::create`], with an id from [`new_id`] the caller already
    /// recorded (so that a crash between the two leaves a record naming what to clean up).
    pub fn create_with_id(
        &self,
        id: &str,
        spec: &SandboxSpec,
    ) -> Result<(Sandbox, Phases), RuntimeError> {
        self.create_early(id, spec, None)
    }

    /// Like [`Runtime::create_with_id`]; a container launched in a pre-built shell calls
    /// `on_shell` with the shell's init pid as soon as the launch request is sent, while the
    /// launch runs: that init is the sandbox's, already in its namespaces (the caller checks
    /// it against [`Sandbox::init_pid`]). Not called otherwise.
    pub fn create_early(
        &self,
        id: &str,
        spec: &SandboxSpec,
        on_shell: Option<OnShell>,
    ) -> Result<(Sandbox, Phases), RuntimeError> {
        if !valid_id(id) {
            return Err(RuntimeError::Invalid(format!("invalid sandbox id {id:?}")));
        }
        if spec.substrate.is_vm() {
            return self.create_vm(id, spec);
        }
        let made = self.create_container(id, spec, on_shell);
        if made.is_err() {
            // Whatever the failed create made (its cgroup in every hierarchy, its runtime
            // directory) goes with it, whichever step failed.
            self.cleanup_leftovers(id, &self.sandbox_run_dir(id));
        }
        made
    }

    fn create_container(
        &self,
        id: &str,
        spec: &SandboxSpec,
        on_shell: Option<OnShell>,
    ) -> Result<(Sandbox, Phases), RuntimeError> {
        let t0 = Instant::now();
        let (lowerdirs, template_env, workdir, user) = self.container_template(&spec.template)?;
        let lowerdirs = spec.layers.iter().cloned().chain(lowerdirs).collect();
        let id = id.to_owned();
        let run_dir = self.cfg.run_dir.join("sandboxes").join(&id);
        let env = self.sandbox_env(&id, template_env, spec);
        let config = LaunchConfig {
            id: id.clone(),
            lowerdirs,
            stage: self.stage.display().to_string(),
            run_dir: run_dir.display().to_string(),
            limits: Limits {
                // /dev/shm pages are charged to the sandbox's memory and outlive their writer:
                // keep them well below the memory limit so that the sandbox stays manageable.
                shm_bytes: spec.limits.shm_bytes.min(spec.limits.memory_max / 4),
                ..Limits::clone(&spec.limits)
            },
            writable_root: spec.writable_root,
            scratch: SCRATCH_DIRS.iter().map(|s| (*s).to_string()).collect(),
            env,
            // The supervisor leases the ids (a range of its own, host-wide).
            userns: spec.userns,
            workdir,
            user,
            ids: None,
        };
        let req = self.new_req();
        let request = SpawnRequest { req, config };
        let bytes =
            serde_json::to_vec(&request).map_err(|e| RuntimeError::Invalid(e.to_string()))?;
        // Pre-built shells have a user namespace: a sandbox without one is made by the spawner.
        if !spec.layers.is_empty() || spec.writable_root {
            self.prefer(&request.config);
        }
        let handed = if request.config.userns {
            self.hand_to_shell(
                &bytes,
                &request.config.lowerdirs,
                request.config.writable_root,
                on_shell,
            )
        } else {
            None
        };
        let reply = match handed {
            Some(reply_sock) => wait_reply(&reply_sock),
            None => self.spawn_via_spawner(req, &request),
        };
        let (msg, mut fds) = match reply {
            Ok(r) => r,
            Err(failure) => {
                self.cleanup_leftovers(&id, &run_dir);
                return Err(RuntimeError::Launch { id, failure });
            }
        };
        let launch_us = t0.elapsed().as_micros() as u64;
        let (sup_pid, init_pid, sup_phases, configured_by) = match msg {
            SupervisorMsg::Launched {
                sup_pid,
                init_pid,
                phases_us,
                configure_id,
                ..
            } => (sup_pid, init_pid, phases_us, configure_id),
            SupervisorMsg::Failed { failure, .. } => {
                return Err(RuntimeError::Launch { id, failure })
            }
            other => {
                return Err(RuntimeError::Launch {
                    id,
                    failure: LaunchFailure::new(LaunchStep::Reply, format!("unexpected {other:?}")),
                })
            }
        };
        let (Some(control), Some(agent_fd)) = (fds.pop(), fds.pop()) else {
            return Err(RuntimeError::Launch {
                id,
                failure: LaunchFailure::new(LaunchStep::Reply, "supervisor sent no descriptors"),
            });
        };
        let sup = PidFd::open(sup_pid).map_err(|e| RuntimeError::Launch {
            id: id.clone(),
            failure: LaunchFailure::io(LaunchStep::Pidfd, &e),
        })?;
        let mut sandbox = Sandbox {
            id,
            spec: spec.clone(),
            state: State::Creating,
            agent: AgentConn::new(agent_fd),
            backend: Backend::Container { control },
            sup,
            init_pid,
            run_dir,
            oom_kills: 0,
        };
        let id = sandbox.id.clone();
        // The supervisor sent the agent its `Configure` before answering (the agent of a
        // pre-built shell started before this request and reopens the root it was pivoted onto);
        // its answer, after the agent's greeting, means the agent is ready.
        let configured = sandbox
            .agent
            .await_reply(configured_by, Duration::from_secs(10));
        let ready = configured.and_then(|()| {
            if sandbox.agent.greeted() {
                Ok(())
            } else {
                Err(crate::agent_client::AgentError::Unexpected(
                    "no hello from the agent".into(),
                ))
            }
        });
        if let Err(source) = ready {
            let _ = sandbox.destroy(self);
            return Err(RuntimeError::Agent { id, source });
        }
        sandbox.state = sandbox.state.transition(State::Ready)?;
        let hello_us = t0.elapsed().as_micros() as u64;
        Ok((
            sandbox,
            Phases {
                launch_us,
                hello_us,
                cgroup_us: sup_phases.0,
                clone_exec_us: sup_phases.1,
            },
        ))
    }
}

/// Waits (bounded) for a supervisor's answer on a per-create reply socket.
fn wait_reply(sock: &OwnedFd) -> Result<Reply, LaunchFailure> {
    let reply_err = |e: std::io::Error| LaunchFailure::io(LaunchStep::Reply, &e);
    if !ipc::poll_readable(sock.as_fd(), CREATE_DEADLINE).map_err(reply_err)? {
        return Err(LaunchFailure::new(
            LaunchStep::Timeout,
            "no answer from the supervisor",
        ));
    }
    let (buf, fds) = ipc::recv_msg(sock.as_fd(), MAX_MSG).map_err(reply_err)?;
    if buf.is_empty() {
        return Err(LaunchFailure::new(
            LaunchStep::Reply,
            "the supervisor closed the reply socket",
        ));
    }
    let msg = serde_json::from_slice::<SupervisorMsg>(&buf)
        .map_err(|e| LaunchFailure::new(LaunchStep::Reply, e.to_string()))?;
    Ok((msg, fds))
}

impl Runtime {
    /// Sends the request straight to an idle pre-built shell (then calls `on_shell` with its
    /// init's pid); returns the socket its answer will come on, or `None` when no shell took
    /// it.
    fn hand_to_shell(
        &self,
        request: &[u8],
        lowerdirs: &[String],
        writable_root: bool,
        on_shell: Option<OnShell>,
    ) -> Option<OwnedFd> {
        loop {
            // A shell built for this root, else one built for the likely root, else any.
            let take_preferred = |exact: bool| -> Option<IdleShell> {
                let mut p = self.spawner.preferred.lock().ok()?;
                let at = p
                    .iter()
                    .position(|((l, w), _)| !exact || (l == lowerdirs && *w == writable_root))?;
                p.remove(at).map(|(_, fd)| fd)
            };
            let ((shell, init_pid), taken) = match take_preferred(true) {
                Some(s) => (s, NodeMsg::PreferredTaken),
                None => match self.spawner.shells.lock().ok()?.pop_front() {
                    Some(s) => (s, NodeMsg::ShellTaken),
                    None => (take_preferred(false)?, NodeMsg::PreferredTaken),
                },
            };
            // Whatever happens, that shell is used up: the spawner builds a replacement.
            self.notify_spawner(&taken);
            let (ours, theirs) = ipc::seqpacket_pair().ok()?;
            if ipc::send_with_fds(shell.as_fd(), request, &[theirs.as_fd()]).is_ok() {
                if let Some(f) = on_shell.filter(|_| init_pid > 0) {
                    f(init_pid);
                }
                return Some(ours);
            }
            // A shell that failed to build has exited; try the next one.
        }
    }

    /// Asks the spawner to pre-build some idle shells with the root of `config` (a create from
    /// a snapshot: more are likely to follow, a tree search's forks; a writable root, as every
    /// E2B sandbox has) when it would match such a root (the defaults but for the layers and
    /// the writable root) and is not the one preferred already.
    fn prefer(&self, config: &LaunchConfig) {
        let likely = &self.likely;
        let alike = config.userns
            && config.limits.disk_bytes == likely.disk_bytes
            && config.limits.disk_inodes == likely.disk_inodes
            && config.scratch == likely.scratch;
        if !alike {
            return;
        }
        let Ok(mut hint) = self.spawner.hint.lock() else {
            return;
        };
        let key = (config.lowerdirs.clone(), config.writable_root);
        if hint.as_ref() == Some(&key) {
            return;
        }
        *hint = Some(key);
        let rootfs = dsec_sys::launch::RootfsSpec {
            lowerdirs: config.lowerdirs.clone(),
            writable_root: config.writable_root,
            ..likely.clone()
        };
        self.notify_spawner(&NodeMsg::Prefer {
            rootfs: Some(rootfs),
        });
    }

    /// Asks the spawner to fork a supervisor for this request and waits for its answer.
    fn spawn_via_spawner(&self, req: u64, request: &SpawnRequest) -> Result<Reply, LaunchFailure> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.spawner
            .pending
            .lock()
            .map_err(|_| LaunchFailure::new(LaunchStep::Spawner, "spawner state poisoned"))?
            .insert(req, tx);
        let bytes = serde_json::to_vec(&NodeMsg::Spawn(Box::new(request.clone())))
            .map_err(|e| LaunchFailure::new(LaunchStep::Spawner, e.to_string()))?;
        let sent = ipc::send_with_fds(self.spawner.sock.as_fd(), &bytes, &[]);
        let reply = sent
            .map_err(|e| LaunchFailure {
                message: format!("spawner unavailable: {e}"),
                ..LaunchFailure::io(LaunchStep::Spawner, &e)
            })
            .and_then(|()| {
                rx.recv_timeout(CREATE_DEADLINE).map_err(|e| match e {
                    mpsc::RecvTimeoutError::Timeout => LaunchFailure::new(
                        LaunchStep::Timeout,
                        format!("no answer from the spawner within {CREATE_DEADLINE:?}"),
                    ),
                    // The spawner went away (its reader failed every waiter).
                    mpsc::RecvTimeoutError::Disconnected => LaunchFailure::new(
                        LaunchStep::Spawner,
                        "the spawner went away before answering",
                    ),
                })
            });
        if reply.is_err() {
            if let Ok(mut p) = self.spawner.pending.lock() {
                p.remove(&req);
            }
        }
        reply
    }

    fn notify_spawner(&self, msg: &NodeMsg) {
        if let Ok(bytes) = serde_json::to_vec(msg) {
            let _ = ipc::send_with_fds(self.spawner.sock.as_fd(), &bytes, &[]);
        }
    }
}
