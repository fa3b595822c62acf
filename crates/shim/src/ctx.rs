//! What the spawner holds and every supervisor it forks inherits, and how they answer the node.

use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};

use dsec_sys::cgroup::{Cgroup, CgroupLimits, CgroupManager};
use dsec_sys::ipc;
use dsec_sys::launch::{RootfsSpec, SANDBOX_DEVICES};
use dsec_sys::seccomp::Filter;

use crate::failure::cgroup_failure;
use crate::proto::{LaunchFailure, SupervisorMsg};

/// State shared by the spawner and inherited by every supervisor it forks.
pub(crate) struct SpawnerCtx {
    pub(crate) node: OwnedFd,
    pub(crate) agent_exe: OwnedFd,
    pub(crate) seccomp: Filter,
    pub(crate) cgroups: CgroupManager,
    /// The node's stage directory (where every sandbox mounts its private tmpfs).
    pub(crate) stage: Option<String>,
    /// An empty directory on the spawner's mask tmpfs, bound read-only over masked `/proc`
    /// directories (see [`RootfsSpec::empty_dir`]).
    pub(crate) empty_dir: Option<String>,
    /// The root most creates ask for (the default template with default limits): idle shells
    /// build it ahead of time.
    pub(crate) likely_rootfs: Option<RootfsSpec>,
}

impl SpawnerCtx {
    /// Creates the cgroup `name` of a sandbox (or of an idle shell, which becomes one): `limits`,
    /// and the devices of [`SANDBOX_DEVICES`] only. Nothing is left behind on failure.
    pub(crate) fn sandbox_cgroup(
        &self,
        name: &str,
        limits: &CgroupLimits,
    ) -> Result<Cgroup, LaunchFailure> {
        let cgroup = self
            .cgroups
            .create(name, limits)
            .map_err(|e| cgroup_failure(&e))?;
        if let Err(e) = cgroup.limit_devices(&SANDBOX_DEVICES) {
            let _ = cgroup.remove();
            return Err(cgroup_failure(&e));
        }
        Ok(cgroup)
    }
}

/// Sends `msg` (and `fds`) as one message on `sock`.
pub(crate) fn send(
    sock: BorrowedFd<'_>,
    msg: &SupervisorMsg,
    fds: &[BorrowedFd<'_>],
) -> io::Result<()> {
    let bytes = serde_json::to_vec(msg).map_err(io::Error::other)?;
    ipc::send_with_fds(sock, &bytes, fds)
}
