//! The substrates a sandbox runs on, behind one [`Sandbox`] type: `container` (namespaces +
//! cgroups + seccomp + overlayfs, one `dsec-agent` per sandbox as PID 1, supervised by its own
//! `dsec-shim`) and `microvm`/`vm` (QEMU restored from a template's snapshot, the same agent in
//! the guest).
//!
//! [`Runtime`] owns the spawner process and the VM runtime and hands out [`Sandbox`]es;
//! what differs per substrate lives in [`container`] and [`vm`], each with the same shape
//! (create, adopt after a node restart, reset, destroy).

pub mod container;
pub mod vm;

mod error;
mod exec;
mod runtime;

use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use dsec_sys::cgroup::CgroupManager;
use dsec_sys::ipc::PidFd;

use crate::agent_client::AgentConn;
use crate::capacity::NodeCapacity;
use crate::sandbox::{SandboxSpec, State, Substrate};
use crate::template::TemplateStore;

pub use container::spawner::SPAWNER_MALLOC_TUNABLES;
pub use container::{new_id, valid_id, Phases, ORPHAN_CGROUP_GRACE};
pub use error::RuntimeError;
pub use runtime::{find_binary, RuntimeConfig};
pub use vm::sandbox::VmSettings;

/// Called with a container's init pid once its launch request is in a pre-built shell's hands
/// (see [`Runtime::create_early`]).
pub type OnShell = Box<dyn FnOnce(i32) + Send>;

/// The runtime of one node's sandboxes: the container substrate's spawner, and the VM
/// substrates (started on first use).
/// The container substrate of one node.
pub struct Runtime {
    cfg: RuntimeConfig,
    templates: TemplateStore,
    cgroups: CgroupManager,
    capacity: NodeCapacity,
    spawner: Arc<container::spawner::SpawnerLink>,
    next_req: AtomicU64,
    stage: PathBuf,
    host_mask: PathBuf,
    /// The host mask layer where it is built (the VM substrates build root images from it).
    host_mask_src: PathBuf,
    /// The root idle shells pre-build (see `runtime.rs`).
    likely: dsec_sys::launch::RootfsSpec,
    favordynmods: bool,
    /// The VM substrates, started on first use.
    vms: Mutex<Option<Arc<vm::VmRuntime>>>,
    /// How the VM substrates are run (set before their first use).
    vm_settings: Mutex<VmSettings>,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

/// What runs a sandbox, per substrate.
#[derive(Debug)]
enum Backend {
    /// A container: its supervisor's control socket.
    Container {
        /// The control socket.
        control: OwnedFd,
    },
    /// A VM: what it is restored from.
    Vm(Box<vm::sandbox::VmBinding>),
}

/// One live sandbox, of any substrate. Owned by exactly one caller at a time.
#[derive(Debug)]
pub struct Sandbox {
    id: String,
    spec: SandboxSpec,
    state: State,
    agent: AgentConn,
    backend: Backend,
    /// The supervisor (containers) or the QEMU process (VMs).
    sup: PidFd,
    init_pid: i32,
    run_dir: PathBuf,
    oom_kills: u64,
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

    /// The substrate of this sandbox.
    pub fn substrate(&self) -> Substrate {
        self.spec.substrate
    }

    /// Host pid of the supervisor (containers) or of QEMU (VMs).
    pub fn supervisor_pid(&self) -> i32 {
        self.sup.pid()
    }

    /// Host pid of the sandbox init (the agent; QEMU for VMs).
    pub fn init_pid(&self) -> i32 {
        self.init_pid
    }

    /// Stops (`SIGSTOP`) or continues (`SIGCONT`) every process of a container sandbox but its
    /// agent and supervisor: they stay where they are, memory and files kept (a pause). Twice,
    /// so that a child forked while the first pass ran is caught by the second. A VM's whole
    /// guest stops instead.
    pub fn pause(&mut self, rt: &Runtime, paused: bool) -> Result<(), RuntimeError> {
        if self.spec.substrate.is_vm() {
            return self.pause_vm(paused);
        }
        let Some(cg) = rt.cgroups.open(&self.id) else {
            return Err(RuntimeError::Invalid(format!("no cgroup for {}", self.id)));
        };
        let keep = [self.init_pid, self.sup.pid()];
        let signal = if paused { libc::SIGSTOP } else { libc::SIGCONT };
        for _ in 0..2 {
            for pid in cg.pids().map_err(RuntimeError::Cgroup)? {
                if !keep.contains(&pid) {
                    let _ = dsec_sys::proc::kill(pid, signal);
                }
            }
        }
        Ok(())
    }

    /// Marks the sandbox acquired (pool → user).
    pub fn mark_acquired(&mut self) -> Result<(), RuntimeError> {
        self.state = self.state.transition(State::Running)?;
        Ok(())
    }

    /// Whether the sandbox is whole: its supervisor (or QEMU) lives and, for a container, has
    /// not reported the end of the sandbox init. Does not talk to the agent.
    pub fn is_alive(&self) -> bool {
        self.death().is_none()
    }

    /// Why the sandbox is not whole any more ([`Sandbox::is_alive`]), if it is not.
    pub fn death(&self) -> Option<String> {
        match &self.backend {
            Backend::Vm(_) => (!self.sup.is_alive()).then(|| "its QEMU process exited".into()),
            Backend::Container { control } => self.container_death(control),
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

    /// Kills every process in the sandbox and starts afresh (a container: a fresh init on a
    /// fresh writable layer; a VM: a fresh QEMU from the snapshot); returns when the new agent
    /// answered.
    pub fn reset(&mut self) -> Result<(), RuntimeError> {
        self.state = self.state.transition(State::Resetting)?;
        let result = match &self.backend {
            Backend::Vm(_) => self.reset_vm(),
            Backend::Container { .. } => self.reset_container(None),
        };
        self.state = match result {
            Ok(()) => self.state.transition(State::Ready)?,
            Err(_) => self.state.transition(State::Failed)?,
        };
        result
    }

    /// Rolls a container back in place onto `lowerdirs` (a snapshot's layers above its
    /// template's, topmost first) under a fresh writable layer: every process but the agent
    /// is killed, as by [`Sandbox::reset`], whose later calls come back to these layers.
    ///
    /// A VM is replaced by a guest restored from the running guest's snapshot in
    /// `lowerdirs[0]` (its processes and memory as they were).
    pub fn restore(&mut self, lowerdirs: Vec<String>) -> Result<(), RuntimeError> {
        self.state = self.state.transition(State::Resetting)?;
        let result = match &self.backend {
            Backend::Container { .. } => self.reset_container(Some(lowerdirs)),
            Backend::Vm(_) => match lowerdirs.first() {
                Some(dir) => self.restore_vm(dir),
                None => Err(RuntimeError::Invalid("no VM snapshot to restore".into())),
            },
        };
        self.state = match result {
            Ok(()) => self.state.transition(State::Ready)?,
            Err(_) => self.state.transition(State::Failed)?,
        };
        result
    }

    /// The upper (writable) layer of a container's root (`O_PATH`) and the host uid and gid
    /// of its root: what a snapshot copies.
    pub fn upper(&mut self) -> Result<(std::os::fd::OwnedFd, (u32, u32)), RuntimeError> {
        match &self.backend {
            Backend::Container { .. } => self.container_upper(),
            Backend::Vm(_) => Err(RuntimeError::Invalid(
                "a VM sandbox has no upper layer".into(),
            )),
        }
    }

    /// Destroys the sandbox: every process, its cgroup, mounts and runtime directory.
    pub fn destroy(mut self, rt: &Runtime) -> Result<(), RuntimeError> {
        self.state = self.state.transition(State::Stopping)?;
        match &self.backend {
            Backend::Vm(_) => self.destroy_vm(rt),
            Backend::Container { .. } => self.destroy_container(rt),
        }
    }

    /// Prepares a sandbox that waits in a pool for its first command (see
    /// [`vm::sandbox`]: a restored VM warms its translation cache). Containers need nothing.
    pub fn warm_up(&mut self, rt: &Runtime) {
        if matches!(self.backend, Backend::Vm(_)) {
            self.warm_up_vm(rt);
        }
    }
}
