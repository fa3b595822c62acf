//! Launching a container sandbox: `clone` into new namespaces, build the root filesystem inside
//! the child's own mount namespace, drop every privilege and `execveat` the agent.
//!
//! The caller (a per-sandbox supervisor) must be single-threaded: [`spawn_container`] and
//! [`fork_process`] check this and refuse otherwise, which is what makes them safe to call.
//! Because the parent is single-threaded, the child may allocate; it still prepares every path
//! before the clone so that the child does little more than system calls.
//!
//! Child sequence (each step reports `step:errno` on the error pipe and exits on failure):
//! wait for the supervisor's go byte (cgroup attached, id maps written) → cgroup namespace →
//! private mount tree → size/inode-limited tmpfs → overlay (template layers read-only, upper on the
//! tmpfs) → minimal `/dev` → fresh `/proc` with masked and read-only paths → writable scratch
//! directories, read-only root → `pivot_root` → hostname → `lo` up → rlimits → fds 3/4 only →
//! securebits, capability sets and bounding set cleared → `no_new_privs` + seccomp → `execveat`.

use std::io;
use std::os::fd::OwnedFd;

use crate::cgroup::devices::{ACCESS_MKNOD, ACCESS_READ, ACCESS_WRITE};
use crate::cgroup::DeviceRule;
use crate::seccomp::Filter;

mod child;
mod host;
mod idmap;
mod ipc_ns;
mod prepare;
mod rootfs;
mod shell;
mod steps;
mod tree;

pub use host::{mount_tmpfs, sealed_exe_memfd};
pub use idmap::SandboxUser;
pub use ipc_ns::IpcNamespace;
pub use shell::{clone_shell, spawn_container, Shell, ShellResources};
pub use tree::{
    build_root_tree, enter_private_mount_ns, enter_root_tree, reset_in_place, set_hostname_of,
    ResetState, RootTree,
};

/// Errors of the launch path (parent side; the child reports through the error pipe).
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// The calling process has more than one thread.
    #[error("launch requires a single-threaded process (found {threads} threads)")]
    NotSingleThreaded {
        /// Threads found.
        threads: usize,
    },
    /// A path or option contained a NUL byte.
    #[error("invalid launch argument {what}")]
    InvalidArgument {
        /// Which argument.
        what: &'static str,
    },
    /// `clone` failed.
    #[error("clone sandbox process")]
    Clone(#[source] io::Error),
    /// `fork` failed.
    #[error("fork supervisor process")]
    Fork(#[source] io::Error),
    /// Creating a pipe or socket failed.
    #[error("create {what}")]
    Create {
        /// What was being created.
        what: &'static str,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// Writing the user namespace id maps failed.
    #[error("write id maps of pid {pid}")]
    IdMap {
        /// Child pid.
        pid: i32,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// The child failed one of its setup steps.
    #[error("sandbox setup failed at {step} ({errno})")]
    ChildSetup {
        /// The step name.
        step: String,
        /// The OS error.
        errno: io::Error,
    },
}

/// Namespace and identity options of one sandbox.
#[derive(Debug, Clone)]
pub struct NamespaceSpec {
    /// Also create a user namespace mapping root inside to `host_uid`/`host_gid` (and a range of
    /// `count` ids above them).
    pub user: Option<IdMap>,
    /// Hostname inside the UTS namespace.
    pub hostname: String,
}

/// A user-namespace id mapping: ids `0..count` inside map to `host_id..host_id+count` outside.
#[derive(Debug, Clone, Copy)]
pub struct IdMap {
    /// First host uid.
    pub host_uid: u32,
    /// First host gid.
    pub host_gid: u32,
    /// Number of ids mapped.
    pub count: u32,
}

/// The root filesystem of one sandbox.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct RootfsSpec {
    /// Host directory on which the sandbox's private tmpfs is mounted (inside its own mount
    /// namespace only; every sandbox may use the same directory).
    pub stage: String,
    /// Overlay lower directories, topmost first.
    pub lowerdirs: Vec<String>,
    /// Size of the writable layer tmpfs in bytes (the disk quota).
    pub disk_bytes: u64,
    /// Inode limit of the writable layer tmpfs.
    pub disk_inodes: u64,
    /// Requested size of `/dev/shm` in bytes. `/dev/shm` is a directory of the writable layer's
    /// tmpfs (one superblock less per sandbox), so it shares the disk quota (`disk_bytes`) and
    /// is bounded by it rather than by this value.
    pub shm_bytes: u64,
    /// Keep the whole root writable (writes land in the private upper layer). When false the
    /// root is read-only and only `scratch` directories are writable.
    pub writable_root: bool,
    /// Writable directories (absolute paths inside the sandbox) when the root is read-only.
    pub scratch: Vec<String>,
    /// An empty directory on a tmpfs shared by the node's sandboxes (host path, visible before
    /// the pivot), bound read-only over the masked `/proc` directories. Without it each masked
    /// directory gets an empty tmpfs of its own: a superblock, and with it a memcg-aware
    /// shrinker, per directory and sandbox.
    #[serde(default)]
    pub empty_dir: Option<String>,
}

/// An rlimit to set in the child.
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct Rlimit {
    /// `libc::RLIMIT_*`.
    pub resource: u32,
    /// Soft and hard value.
    pub value: u64,
}

/// Everything the child needs, validated and converted before the clone.
pub struct ContainerSpec<'a> {
    /// Namespaces.
    pub ns: NamespaceSpec,
    /// Root filesystem.
    pub rootfs: RootfsSpec,
    /// Resource limits.
    pub rlimits: Vec<Rlimit>,
    /// The agent executable (a sealed memfd), exec'd with `execveat(AT_EMPTY_PATH)`.
    pub agent_exe: &'a OwnedFd,
    /// The agent's protocol socket, becomes fd 3 in the child.
    pub agent_sock: &'a OwnedFd,
    /// Agent argv.
    pub argv: Vec<String>,
    /// Agent environment (already allowlisted).
    pub env: Vec<(String, String)>,
    /// The seccomp filter, built before the clone.
    pub seccomp: &'a Filter,
}

/// A started sandbox init process, seen from the supervisor.
#[derive(Debug)]
pub struct Launched {
    /// Host pid of the sandbox's init (the agent).
    pub pid: i32,
}

/// The device nodes of the sandbox's `/dev`: name, major, minor (`build_dev` makes them).
const DEV_NODES: [(&str, u32, u32); 6] = [
    ("null", 1, 3),
    ("zero", 1, 5),
    ("full", 1, 7),
    ("random", 1, 8),
    ("urandom", 1, 9),
    ("tty", 5, 0),
];

const RW: u8 = ACCESS_READ | ACCESS_WRITE;

/// The devices a sandbox's cgroup allows ([`Cgroup::limit_devices`]), and nothing else: the
/// nodes of its `/dev` ([`DEV_NODES`], made by `mknod` inside the cgroup in the default mode,
/// hence `m`), its devpts instance's `ptmx` (5:2) and every pty (136:*). Any other device fails
/// with `EPERM` on `open` and `mknod`, even where a node exists on a mount without `nodev`.
///
/// [`Cgroup::limit_devices`]: crate::cgroup::Cgroup::limit_devices
pub const SANDBOX_DEVICES: [DeviceRule; 8] = [
    DeviceRule::char(1, Some(3), RW | ACCESS_MKNOD),
    DeviceRule::char(1, Some(5), RW | ACCESS_MKNOD),
    DeviceRule::char(1, Some(7), RW | ACCESS_MKNOD),
    DeviceRule::char(1, Some(8), RW | ACCESS_MKNOD),
    DeviceRule::char(1, Some(9), RW | ACCESS_MKNOD),
    DeviceRule::char(5, Some(0), RW | ACCESS_MKNOD),
    DeviceRule::char(5, Some(2), RW),
    DeviceRule::char(136, None, RW),
];

/// Masked `/proc` entries (OCI defaults): files get the host's `/dev/null` bound over them,
/// directories an empty directory ([`RootfsSpec::empty_dir`]), both read-only.
pub const MASKED_PROC: &[&str] = &[
    "acpi",
    "asound",
    "kcore",
    "keys",
    "latency_stats",
    "timer_list",
    "timer_stats",
    "sched_debug",
    "scsi",
    "kallsyms",
    "sysrq-trigger",
];

/// Read-only `/proc` entries (OCI defaults).
pub const READONLY_PROC: &[&str] = &["bus", "fs", "irq", "sys"];

/// Number of threads of the calling process.
pub fn thread_count() -> usize {
    // A task directory's link count is 2 plus its threads: one `statx`, where listing the
    // directory takes an open, two reads and a close.
    use std::os::unix::fs::MetadataExt;
    match std::fs::metadata("/proc/self/task") {
        Ok(m) if m.nlink() >= 3 => (m.nlink() - 2) as usize,
        _ => std::fs::read_dir("/proc/self/task")
            .map(|d| d.count())
            .unwrap_or(usize::MAX),
    }
}

fn ensure_single_threaded() -> Result<(), LaunchError> {
    match thread_count() {
        1 => Ok(()),
        threads => Err(LaunchError::NotSingleThreaded { threads }),
    }
}

/// The result of [`fork_process`].
#[derive(Debug)]
pub enum Forked {
    /// In the parent, with the child's pid.
    Parent(i32),
    /// In the child.
    Child,
}

/// `fork()` for a single-threaded caller (checked). The child is an exact copy; because no other
/// thread existed, no lock can be held by a thread that vanished, so the child may run ordinary
/// code.
pub fn fork_process() -> Result<Forked, LaunchError> {
    ensure_single_threaded()?;
    // SAFETY: the process is single-threaded (checked above), so the child inherits no lock held
    // by another thread and may continue executing arbitrary Rust code.
    let pid = unsafe { libc::fork() };
    match pid {
        -1 => Err(LaunchError::Fork(io::Error::last_os_error())),
        0 => Ok(Forked::Child),
        pid => Ok(Forked::Parent(pid)),
    }
}

/// The parts of a launch that travel to the (already cloned) sandbox init as data.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct LaunchParams {
    /// Hostname inside the UTS namespace.
    pub hostname: String,
    /// Root filesystem.
    pub rootfs: RootfsSpec,
    /// Resource limits.
    pub rlimits: Vec<Rlimit>,
    /// Agent argv.
    pub argv: Vec<String>,
    /// Agent environment (already allowlisted).
    pub env: Vec<(String, String)>,
}

impl ContainerSpec<'_> {
    /// The data part of the spec.
    pub fn params(&self) -> LaunchParams {
        LaunchParams {
            hostname: self.ns.hostname.clone(),
            rootfs: self.rootfs.clone(),
            rlimits: self.rlimits.clone(),
            argv: self.argv.clone(),
            env: self.env.clone(),
        }
    }
}

/// A failed setup step: its name and errno.
#[derive(Debug, Clone, Copy)]
pub struct StepError {
    step: &'static str,
    errno: i32,
}

impl StepError {
    fn last(step: &'static str) -> Self {
        Self {
            step,
            errno: io::Error::last_os_error().raw_os_error().unwrap_or(0),
        }
    }
}

impl From<StepError> for LaunchError {
    fn from(e: StepError) -> Self {
        LaunchError::ChildSetup {
            step: e.step.to_string(),
            errno: io::Error::from_raw_os_error(e.errno),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every node `build_dev` makes is on the cgroup's list, `mknod` included; so are the
    /// devpts instance's `ptmx` and its ptys.
    #[test]
    fn sandbox_devices_cover_the_sandbox_dev() {
        let allows = |major: u32, minor: u32, access: u8| {
            SANDBOX_DEVICES.iter().any(|r| {
                r.major == Some(major)
                    && r.minor.is_none_or(|m| m == minor)
                    && r.access & access == access
            })
        };
        for (name, major, minor) in DEV_NODES {
            assert!(allows(major, minor, RW | ACCESS_MKNOD), "{name}");
        }
        assert!(allows(5, 2, RW) && allows(136, 0, RW) && allows(136, 4095, RW));
        assert!(!allows(5, 2, ACCESS_MKNOD) && !allows(1, 1, ACCESS_READ));
        assert!(!allows(10, 200, ACCESS_READ) && !allows(5, 1, ACCESS_READ));
    }
}
