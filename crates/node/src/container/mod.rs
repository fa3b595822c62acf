//! The container substrate: namespaces + cgroups + seccomp + overlayfs, one `dsec-agent` per
//! sandbox as PID 1.
//!
//! [`ContainerRuntime`] owns the spawner process and hands out [`Sandbox`]es. Each sandbox is
//! supervised by its own `dsec-shim` process (see [`shim`]), so sandboxes survive the node.

pub mod proto;
pub mod shim;

mod adopt;
mod create;
mod exec;
mod vmsub;

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use dsec_api::ErrorCode;
use dsec_sys::cgroup::CgroupManager;
use dsec_sys::ipc::{self, PidFd};

use crate::agent_client::{AgentConn, AgentError};
use crate::capacity::NodeCapacity;
use crate::sandbox::{InvalidTransition, SandboxSpec, State};
use crate::template::TemplateStore;

use proto::{ControlMsg, SupervisorMsg, MAX_MSG};

pub use adopt::ORPHAN_CGROUP_GRACE;
pub use create::{new_id, valid_id, Phases};
pub use vmsub::VmSettings;

/// Errors of the container runtime.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// A runtime file or directory could not be prepared.
    #[error("prepare {path}")]
    Prepare {
        /// The path.
        path: PathBuf,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// A required binary is missing.
    #[error("cannot find {name} (looked in {looked})")]
    MissingBinary {
        /// Binary name.
        name: &'static str,
        /// Where.
        looked: String,
    },
    /// The spawner process could not be started or died.
    #[error("spawner unavailable")]
    Spawner(#[source] io::Error),
    /// cgroups could not be used.
    #[error("cgroups")]
    Cgroup(#[source] dsec_sys::cgroup::CgroupError),
    /// What the node has could not be read.
    #[error("node capacity")]
    Capacity(#[source] crate::capacity::CapacityError),
    /// Templates could not be used.
    #[error("template")]
    Template(#[source] crate::template::TemplateError),
    /// The request is invalid.
    #[error("invalid request: {0}")]
    Invalid(String),
    /// Launching the sandbox failed.
    #[error("launch sandbox {id}: {message}")]
    Launch {
        /// Sandbox id.
        id: String,
        /// What failed.
        message: String,
    },
    /// The supervisor of a sandbox is gone or misbehaved.
    #[error("supervisor of sandbox {id}: {message}")]
    Supervisor {
        /// Sandbox id.
        id: String,
        /// What happened.
        message: String,
    },
    /// The agent failed.
    #[error("agent of sandbox {id}")]
    Agent {
        /// Sandbox id.
        id: String,
        /// Cause.
        #[source]
        source: AgentError,
    },
    /// A lifecycle rule was violated.
    #[error(transparent)]
    Transition(#[from] InvalidTransition),
    /// A VM substrate failed.
    #[error("vm sandbox {id}: {source}")]
    Vm {
        /// Sandbox id.
        id: String,
        /// Cause.
        #[source]
        source: crate::vm::VmError,
    },
}

impl RuntimeError {
    /// The stable code of this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            RuntimeError::Invalid(_) => ErrorCode::InvalidRequest,
            RuntimeError::Template(e) => e.code(),
            RuntimeError::Agent { source, .. } => source.code(),
            RuntimeError::Transition(_) => ErrorCode::InvalidTransition,
            RuntimeError::Vm { source, .. } => source.code(),
            RuntimeError::Launch { .. } => ErrorCode::ResourceExhausted,
            RuntimeError::Prepare { .. }
            | RuntimeError::MissingBinary { .. }
            | RuntimeError::Spawner(_)
            | RuntimeError::Cgroup(_)
            | RuntimeError::Capacity(_)
            | RuntimeError::Supervisor { .. } => ErrorCode::Internal,
        }
    }
}

/// Where the runtime keeps its state and finds its binaries.
#[derive(Debug, Clone)]
pub struct RuntimeConfig {
    /// Persistent data (layers, templates).
    pub data_dir: PathBuf,
    /// Volatile runtime state (stage dir, supervisor sockets).
    pub run_dir: PathBuf,
    /// The `dsec-agent` binary.
    pub agent_bin: PathBuf,
    /// The `dsec-shim` binary.
    pub shim_bin: PathBuf,
}

impl RuntimeConfig {
    /// Defaults: `/var/lib/dsec`, `/run/dsec`, binaries next to the current executable (or in
    /// `DSEC_AGENT_BIN` / `DSEC_SHIM_BIN`).
    pub fn from_env() -> Result<Self, RuntimeError> {
        let data_dir = std::env::var_os("DSEC_DATA_DIR")
            .map_or_else(|| PathBuf::from("/var/lib/dsec"), PathBuf::from);
        let run_dir = std::env::var_os("DSEC_RUN_DIR")
            .map_or_else(|| PathBuf::from("/run/dsec"), PathBuf::from);
        Ok(Self {
            data_dir,
            run_dir,
            agent_bin: find_binary("dsec-agent", "DSEC_AGENT_BIN")?,
            shim_bin: find_binary("dsec-shim", "DSEC_SHIM_BIN")?,
        })
    }
}

/// Finds a companion binary: `$ENV`, then next to the current executable, then its parent
/// directory (cargo puts test binaries in `deps/`).
pub fn find_binary(name: &'static str, env: &str) -> Result<PathBuf, RuntimeError> {
    if let Some(p) = std::env::var_os(env) {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe().map_err(|e| RuntimeError::Prepare {
        path: "/proc/self/exe".into(),
        source: e,
    })?;
    let mut looked = Vec::new();
    let mut dir = exe.parent().map(Path::to_path_buf);
    for _ in 0..2 {
        let Some(d) = dir else { break };
        let cand = d.join(name);
        if cand.is_file() {
            return Ok(cand);
        }
        looked.push(d.display().to_string());
        dir = d.parent().map(Path::to_path_buf);
    }
    Err(RuntimeError::MissingBinary {
        name,
        looked: looked.join(", "),
    })
}

type Reply = (SupervisorMsg, Vec<OwnedFd>);

struct SpawnerLink {
    sock: OwnedFd,
    pending: Mutex<HashMap<u64, mpsc::SyncSender<Reply>>>,
    /// Request sockets of idle pre-built shells, handed over by the spawner.
    shells: Mutex<std::collections::VecDeque<OwnedFd>>,
    child: Mutex<Child>,
}

/// The container substrate of one node.
pub struct ContainerRuntime {
    cfg: RuntimeConfig,
    templates: TemplateStore,
    cgroups: CgroupManager,
    capacity: NodeCapacity,
    spawner: Arc<SpawnerLink>,
    next_req: AtomicU64,
    stage: PathBuf,
    host_mask: PathBuf,
    /// The host mask layer where it is built (the VM substrates build root images from it).
    host_mask_src: PathBuf,
    favordynmods: bool,
    /// The VM substrates, started on first use.
    vms: Mutex<Option<Arc<crate::vm::VmRuntime>>>,
    /// How the VM substrates are run (set before their first use).
    vm_settings: Mutex<vmsub::VmSettings>,
}

impl std::fmt::Debug for ContainerRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ContainerRuntime")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

fn prep_dir(path: &Path) -> Result<(), RuntimeError> {
    std::fs::create_dir_all(path).map_err(|source| RuntimeError::Prepare {
        path: path.to_path_buf(),
        source,
    })
}

impl ContainerRuntime {
    /// Prepares directories, cgroups and the host template, and starts the spawner.
    pub fn start(cfg: RuntimeConfig) -> Result<Self, RuntimeError> {
        ipc::raise_nofile_limit();
        prep_dir(&cfg.data_dir)?;
        prep_dir(&cfg.run_dir)?;
        let stage = cfg.run_dir.join("stage");
        prep_dir(&stage)?;
        prep_dir(&cfg.run_dir.join("sandboxes"))?;
        prep_dir(&cfg.run_dir.join("hostroot"))?;
        let cgroups = CgroupManager::detect(shim::CGROUP_BASE).map_err(RuntimeError::Cgroup)?;
        let favordynmods = cgroups.favor_dynmods().unwrap_or(false);
        let capacity = NodeCapacity::detect().map_err(RuntimeError::Capacity)?;
        let templates =
            TemplateStore::open_with_hidden(&cfg.data_dir, std::slice::from_ref(&cfg.run_dir))
                .map_err(RuntimeError::Template)?;
        // The host template's mask layer cannot be used where it is built (under the data dir on
        // the host root filesystem): overlayfs refuses a lower layer nested inside another lower
        // layer (`/`) of the same filesystem. The spawner copies it onto a small tmpfs mounted in
        // its own private mount namespace, which every supervisor and sandbox inherits: no
        // mount in the host namespace, and it disappears with the last of them.
        let mask_src = templates
            .lowerdirs(&templates.host_template())
            .into_iter()
            .next()
            .ok_or_else(|| RuntimeError::Invalid("host template without a mask layer".into()))?;
        let mask_fs = cfg.run_dir.join("mask");
        prep_dir(&mask_fs)?;
        let host_mask = mask_fs.join(mask_src.file_name().unwrap_or_default());
        // The root most creates ask for: the default template with default limits. Idle shells
        // build it ahead of time; a create with anything else builds its own.
        let defaults = crate::sandbox::Limits::default();
        let likely = dsec_sys::launch::RootfsSpec {
            stage: stage.display().to_string(),
            lowerdirs: vec![host_mask.display().to_string(), "/".into()],
            disk_bytes: defaults.disk_bytes,
            disk_inodes: defaults.disk_inodes,
            shm_bytes: defaults.shm_bytes,
            writable_root: false,
            scratch: create::SCRATCH_DIRS
                .iter()
                .map(|s| (*s).to_string())
                .collect(),
            // Only the spawner knows it; not needed to build a root.
            empty_dir: None,
        };
        let spawner = Arc::new(start_spawner(&cfg, &likely, &mask_src, &host_mask)?);
        let reader = Arc::clone(&spawner);
        std::thread::Builder::new()
            .name("dsec-spawner-rx".into())
            .spawn(move || spawner_reader(&reader))
            .map_err(RuntimeError::Spawner)?;
        Ok(Self {
            cfg,
            templates,
            cgroups,
            capacity,
            spawner,
            next_req: AtomicU64::new(1),
            stage,
            host_mask,
            host_mask_src: mask_src,
            favordynmods,
            vms: Mutex::new(None),
            vm_settings: Mutex::new(vmsub::VmSettings::default()),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &RuntimeConfig {
        &self.cfg
    }

    /// The template store.
    pub fn templates(&self) -> &TemplateStore {
        &self.templates
    }

    /// The cgroup manager.
    pub fn cgroups(&self) -> &CgroupManager {
        &self.cgroups
    }

    /// What this node has: the bounds of a sandbox's limits.
    pub fn capacity(&self) -> &NodeCapacity {
        &self.capacity
    }

    /// Idle pre-built shells the node holds a request socket of (one descriptor each).
    pub fn idle_shells(&self) -> usize {
        self.spawner.shells.lock().map(|s| s.len()).unwrap_or(0)
    }

    /// Whether cgroup attaches avoid the RCU grace period (`favordynmods`).
    pub fn favordynmods(&self) -> bool {
        self.favordynmods
    }
}

impl Drop for ContainerRuntime {
    fn drop(&mut self) {
        // The spawner goes; running sandboxes (their supervisors) are unaffected, and idle
        // shells clean up when the node's ends of their request sockets close.
        if let Ok(mut c) = self.spawner.child.lock() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn start_spawner(
    cfg: &RuntimeConfig,
    likely: &dsec_sys::launch::RootfsSpec,
    mask_src: &Path,
    mask_dst: &Path,
) -> Result<SpawnerLink, RuntimeError> {
    let (ours, theirs) = ipc::seqpacket_pair().map_err(RuntimeError::Spawner)?;
    let mut cmd = std::process::Command::new(&cfg.shim_bin);
    cmd.arg("spawner")
        .env_clear()
        .env("DSEC_AGENT_BIN", &cfg.agent_bin)
        .env("DSEC_STAGE_DIR", cfg.run_dir.join("stage"))
        .env("DSEC_MASK_SRC", mask_src)
        .env("DSEC_MASK_DST", mask_dst)
        .env(
            "DSEC_SHELL_ROOTFS",
            serde_json::to_string(likely).map_err(|e| RuntimeError::Invalid(e.to_string()))?,
        )
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("GLIBC_TUNABLES", SPAWNER_MALLOC_TUNABLES)
        .stdin(std::process::Stdio::null());
    if let Some(n) = std::env::var_os("DSEC_SPAWNER_SHELLS") {
        cmd.env("DSEC_SPAWNER_SHELLS", n);
    }
    dsec_sys::proc::pass_fd3(&mut cmd, theirs);
    let child = cmd.spawn().map_err(RuntimeError::Spawner)?;
    Ok(SpawnerLink {
        sock: ours,
        pending: Mutex::new(HashMap::new()),
        shells: Mutex::new(std::collections::VecDeque::new()),
        child: Mutex::new(child),
    })
}

/// The spawner's (and so every supervisor's) malloc runs without glibc's per-thread cache. A
/// supervisor lives as long as its sandbox, forked from the spawner: each heap page it writes
/// after the fork becomes its own copy, and the cache kept freed chunks apart, scattered over
/// pages that `malloc_trim` could then not give back. Without it a supervisor holds 55 KiB of
/// private memory instead of 78 (`smaps`, 1,000 idle sandboxes); its allocations are few and
/// off every hot path. Sandboxed processes never see the variable (their environment is built
/// from scratch).
pub const SPAWNER_MALLOC_TUNABLES: &str = "glibc.malloc.tcache_count=0";

fn spawner_reader(link: &SpawnerLink) {
    let mut buf = vec![0u8; MAX_MSG];
    loop {
        let (n, fds) = match ipc::recv_with_fds(link.sock.as_fd(), &mut buf) {
            Ok(r) => r,
            Err(_) => break,
        };
        if n == 0 {
            break;
        }
        let Ok(msg) = serde_json::from_slice::<SupervisorMsg>(&buf[..n]) else {
            continue;
        };
        match msg {
            SupervisorMsg::ShellReady => {
                if let (Some(fd), Ok(mut shells)) = (fds.into_iter().next(), link.shells.lock()) {
                    shells.push_back(fd);
                }
                continue;
            }
            SupervisorMsg::ShellFailed => {
                // Let the spawner build a replacement.
                if let Ok(bytes) = serde_json::to_vec(&proto::NodeMsg::ShellTaken) {
                    let _ = ipc::send_with_fds(link.sock.as_fd(), &bytes, &[]);
                }
                continue;
            }
            _ => {}
        }
        let req = match &msg {
            SupervisorMsg::Launched { req, .. } | SupervisorMsg::Failed { req, .. } => *req,
            _ => continue,
        };
        let tx = link.pending.lock().ok().and_then(|mut p| p.remove(&req));
        if let Some(tx) = tx {
            let _ = tx.try_send((msg, fds));
        }
    }
    // Spawner gone: fail every waiter.
    if let Ok(mut p) = link.pending.lock() {
        p.clear();
    }
}

/// One live container sandbox. Owned by exactly one caller at a time.
#[derive(Debug)]
pub struct Sandbox {
    id: String,
    spec: SandboxSpec,
    state: State,
    agent: AgentConn,
    /// The supervisor's control socket (containers only).
    control: Option<OwnedFd>,
    /// The supervisor (containers) or the QEMU process (VMs).
    sup: PidFd,
    init_pid: i32,
    /// What a VM sandbox is restored from (VM substrates only).
    vm: Option<vmsub::VmBinding>,
    run_dir: PathBuf,
    oom_kills: u64,
    uses: u32,
    busy: Duration,
    acquired_at: Option<Instant>,
}

impl Sandbox {
    /// The sandbox id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The current state.
    pub fn state(&self) -> State {
        self.state
    }

    /// The spec it was created from.
    pub fn spec(&self) -> &SandboxSpec {
        &self.spec
    }

    /// Host pid of the supervisor.
    pub fn supervisor_pid(&self) -> i32 {
        self.sup.pid()
    }

    /// Host pid of the sandbox init (the agent).
    pub fn init_pid(&self) -> i32 {
        self.init_pid
    }

    /// Marks the sandbox acquired (pool → user).
    pub fn mark_acquired(&mut self) -> Result<(), RuntimeError> {
        self.state = self.state.transition(State::Running)?;
        self.uses += 1;
        self.acquired_at = Some(Instant::now());
        Ok(())
    }

    /// Whether the reuse limits say this sandbox must be recycled instead of reset.
    pub fn needs_recycle(&self) -> bool {
        let current = self.acquired_at.map_or(Duration::ZERO, |t| t.elapsed());
        self.uses >= self.spec.max_uses
            || (self.busy + current).as_millis() as u64 >= self.spec.max_busy_ms
    }

    /// Whether the sandbox is whole: its supervisor lives and has not reported the end of the
    /// sandbox init on the control socket (nothing else arrives there unasked). Does not talk
    /// to the agent.
    pub fn is_alive(&self) -> bool {
        self.death().is_none()
    }

    /// Why the sandbox is not whole any more ([`Sandbox::is_alive`]), if it is not.
    pub fn death(&self) -> Option<String> {
        if self.vm.is_some() {
            return (!self.sup.is_alive()).then(|| "its QEMU process exited".into());
        }
        if !self.sup.is_alive() {
            return Some("its supervisor exited".into());
        }
        let control = self.control.as_ref()?;
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

    /// Liveness check of the agent.
    pub fn ping(&mut self) -> Result<(), RuntimeError> {
        let id = self.id.clone();
        self.agent
            .ping()
            .map_err(|source| RuntimeError::Agent { id, source })
    }

    /// Direct access to the agent connection (files, sessions, background processes).
    pub fn agent(&mut self) -> &mut AgentConn {
        &mut self.agent
    }

    fn control_call(&mut self, msg: &ControlMsg, timeout: Duration) -> Result<Reply, RuntimeError> {
        let sup_err = |message: String| RuntimeError::Supervisor {
            id: self.id.clone(),
            message,
        };
        let bytes = serde_json::to_vec(msg).map_err(|e| sup_err(e.to_string()))?;
        let control = self
            .control
            .as_ref()
            .ok_or_else(|| sup_err("no supervisor (a VM sandbox)".into()))?;
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

    /// Kills every process in the sandbox and starts a fresh init on a fresh writable layer;
    /// returns when the new agent answered a ping.
    pub fn reset(&mut self) -> Result<(), RuntimeError> {
        self.state = self.state.transition(State::Resetting)?;
        if let Some(t) = self.acquired_at.take() {
            self.busy += t.elapsed();
        }
        let result = if self.vm.is_some() {
            self.reset_vm()
        } else {
            self.reset_inner()
        };
        self.state = match result {
            Ok(()) => self.state.transition(State::Ready)?,
            Err(_) => self.state.transition(State::Failed)?,
        };
        result
    }

    fn reset_inner(&mut self) -> Result<(), RuntimeError> {
        let id = self.id.clone();
        let agent_err = |source| RuntimeError::Agent {
            id: id.clone(),
            source,
        };
        let (reply, mut fds) = self.control_call(&ControlMsg::Reset, Duration::from_secs(30))?;
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

    /// Destroys the sandbox: kills every process, removes its cgroup, mounts (they live only in
    /// its own mount namespace) and runtime directory.
    pub fn destroy(mut self, rt: &ContainerRuntime) -> Result<(), RuntimeError> {
        self.state = self.state.transition(State::Stopping)?;
        if self.vm.is_some() {
            return self.destroy_vm(rt);
        }
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

impl ContainerRuntime {
    /// Removes the cgroup and runtime directory of a sandbox whose supervisor is gone.
    /// Removes the cgroup and runtime directory of a sandbox whose supervisor is gone; returns
    /// whether nothing is left.
    pub fn cleanup_leftovers(&self, id: &str, run_dir: &Path) -> bool {
        if let Some(cg) = self.cgroups.open(id) {
            let _ = cg.kill_all();
            let _ = cg.remove();
        }
        let _ = std::fs::remove_dir_all(run_dir);
        self.cgroups.open(id).is_none() && !run_dir.exists()
    }

    fn new_req(&self) -> u64 {
        self.next_req.fetch_add(1, Ordering::Relaxed)
    }
}
