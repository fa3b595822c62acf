//! Roots built in the supervisor and moved into a running sandbox: how an activation gives a
//! pre-built shell its template's root and how an in-place reset swaps the writable layer
//! underneath a running agent.

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use crate::ipc::PidFd;

use super::idmap::SandboxUser;
use super::prepare::{cstr, prepare_parts};
use super::rootfs::{
    build_dev, make_root_read_only, make_stage_dirs, mount_overlay, mount_stage_tmpfs,
};
use super::steps::{
    ck, make_mounts_private, mkdir, mkdir_parents, path_kind, pivot_onto, try_mount,
};
use super::{ensure_single_threaded, ContainerSpec, LaunchError, RootfsSpec, StepError};

/// State a supervisor keeps for in-place resets.
///
/// Roots are staged in the caller's mount namespace, which must already be private to dsec (the
/// spawner's, inherited by every supervisor: see `enter_private_mount_ns`), under a directory of
/// the stage unique to the caller, and detached again before they are moved into a sandbox.
/// (A private namespace per supervisor would cost a copy of the whole mount table per sandbox.)
#[derive(Debug, Default)]
pub struct ResetState {
    prepared: bool,
    /// The caller's own mount namespace, to return to after entering a sandbox's.
    own_ns: Option<OwnedFd>,
    /// The caller's own IPC namespace, likewise.
    own_ipc: Option<OwnedFd>,
    /// The sandbox's user namespace, if it has one: roots are built for it.
    user: Option<SandboxUser>,
    /// The writable (upper) layer of the root the sandbox runs on now, once a root built
    /// here was entered: what a snapshot copies.
    upper: Option<OwnedFd>,
}

impl ResetState {
    /// Checks that the caller may stage roots (single-threaded); idempotent.
    pub fn prepare(&mut self) -> Result<(), LaunchError> {
        if !self.prepared {
            ensure_single_threaded()?;
            self.prepared = true;
        }
        Ok(())
    }

    /// Builds the roots of a sandbox with a user namespace from now on (its template's layers
    /// idmapped into `user`); set again when a relaunch makes a new namespace.
    pub fn set_user(&mut self, user: SandboxUser) {
        self.user = Some(user);
    }

    /// An `O_PATH` descriptor of the upper layer of the sandbox's current root (`None` before
    /// a root built by [`build_root_tree`] was entered: a sandbox without a user namespace
    /// that was never reset). The sandbox's processes may change it while it is read.
    pub fn upper(&self) -> Option<BorrowedFd<'_>> {
        self.upper.as_ref().map(AsFd::as_fd)
    }

    /// The host ids the sandbox's root maps to (uid, gid; `(0, 0)` without a user namespace).
    pub fn root_ids(&self) -> (u32, u32) {
        self.user.as_ref().map_or((0, 0), SandboxUser::root_ids)
    }

    /// The inode of the user namespace roots are built for.
    fn user_ino(&self) -> Option<u64> {
        self.user.as_ref().map(SandboxUser::ino)
    }

    /// The caller's mount namespace, opened once.
    fn own_ns(&mut self) -> Result<BorrowedFd<'_>, StepError> {
        opened_once(&mut self.own_ns, c"/proc/self/ns/mnt")
    }

    /// The caller's IPC namespace, opened once.
    pub(super) fn own_ipc_ns(&mut self) -> Result<BorrowedFd<'_>, StepError> {
        opened_once(&mut self.own_ipc, c"/proc/self/ns/ipc")
    }
}

/// The fd in `slot`, opening `path` read-only into it the first time.
fn opened_once<'a>(
    slot: &'a mut Option<OwnedFd>,
    path: &CStr,
) -> Result<BorrowedFd<'a>, StepError> {
    let fd = match slot.take() {
        Some(fd) => fd,
        None => open_path(path, libc::O_RDONLY)?,
    };
    let fd: &'a OwnedFd = slot.insert(fd);
    Ok(fd.as_fd())
}

fn open_path(path: &CStr, flags: libc::c_int) -> Result<OwnedFd, StepError> {
    // SAFETY: valid NUL-terminated path; the returned fd is fresh and owned by us.
    let fd = unsafe { libc::open(path.as_ptr(), flags | libc::O_CLOEXEC) };
    ck(fd, "open")?;
    // SAFETY: open succeeded.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `s` as a C string, its failure a step error.
fn cstr_step(s: &str) -> Result<CString, StepError> {
    CString::new(s).map_err(|_| StepError {
        step: "path",
        errno: libc::EINVAL,
    })
}

fn setns_mnt(fd: BorrowedFd<'_>, step: &'static str) -> Result<(), StepError> {
    // SAFETY: fd is a mount namespace fd or a pidfd (whose mount namespace is entered); the
    // caller is single-threaded (checked by the caller).
    ck(
        unsafe { libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNS) },
        step,
    )
}

/// A sandbox root (overlay with its `/dev`, `/dev/shm` and scratch mounts, read-only when asked)
/// assembled in the supervisor's private mount namespace and detached, ready to be moved into a
/// sandbox.
#[derive(Debug)]
pub struct RootTree {
    fd: OwnedFd,
    /// Its upper layer (`O_PATH`).
    upper: OwnedFd,
    rootfs: RootfsSpec,
    /// The user namespace it was built for (see [`ResetState::set_user`]).
    user_ino: Option<u64>,
}

impl RootTree {
    /// Whether this tree was built for `rootfs` (same layers, quota, layout) and for the user
    /// namespace `state` builds for now.
    pub fn matches(&self, rootfs: &RootfsSpec, state: &ResetState) -> bool {
        let a = &self.rootfs;
        self.user_ino == state.user_ino()
            && a.stage == rootfs.stage
            && a.lowerdirs == rootfs.lowerdirs
            && a.disk_bytes == rootfs.disk_bytes
            && a.disk_inodes == rootfs.disk_inodes
            && a.writable_root == rootfs.writable_root
            && a.scratch == rootfs.scratch
    }
}

/// Builds a [`RootTree`] for `rootfs`: a fresh size-limited tmpfs, the overlay, `/dev` and
/// `/dev/shm` (directories of that tmpfs, see `build_dev`), scratch binds and the read-only
/// root, cloned as a detached tree; the staging mounts are then dropped from
/// the caller's namespace. `warm` paths (absolute, inside the root) are looked up once so that
/// the first command of the sandbox finds their dentries cached.
pub fn build_root_tree(
    rootfs: &RootfsSpec,
    state: &mut ResetState,
    warm: &[&str],
) -> Result<RootTree, LaunchError> {
    if rootfs.lowerdirs.is_empty() {
        return Err(LaunchError::InvalidArgument { what: "lowerdirs" });
    }
    state.prepare()?;
    // A staging directory of our own (other supervisors stage in the same namespace).
    let own_stage = format!(
        "{}/b{}",
        rootfs.stage.trim_end_matches('/'),
        std::process::id()
    );
    if let Err(e) = std::fs::create_dir(&own_stage) {
        if e.kind() != io::ErrorKind::AlreadyExists {
            return Err(LaunchError::Create {
                what: "staging directory",
                source: e,
            });
        }
    }
    let user = state.user.as_ref();
    // With a user namespace the overlay's lower layers are idmapped clones of the template's,
    // mounted on directories of the stage tmpfs (beside the upper layer, not reachable through
    // the overlay).
    let lowerdirs: Vec<String> = match user {
        Some(_) => (0..rootfs.lowerdirs.len())
            .map(|i| format!("{own_stage}/l{i}"))
            .collect(),
        None => rootfs.lowerdirs.clone(),
    };
    // Layers above the host's root (a snapshot's, kept under the data dir) may sit on the
    // root's own file system, and overlayfs refuses a layer inside another (ELOOP). The host
    // template (its mask and `/`) then becomes one read-only overlay of its own, a layer of a
    // different file system under the others.
    let host = (lowerdirs.len() > 2 && rootfs.lowerdirs.last().is_some_and(|l| l == "/"))
        .then(|| format!("{own_stage}/h"));
    let outer = match &host {
        Some(h) => {
            let mut v = lowerdirs[..lowerdirs.len() - 2].to_vec();
            v.push(h.clone());
            v
        }
        None => lowerdirs.clone(),
    };
    let staged = RootfsSpec {
        stage: own_stage,
        lowerdirs: outer,
        ..rootfs.clone()
    };
    let p = prepare_parts(&staged, "", &[], &[], false)?;
    mount_stage_tmpfs(&p)?;
    let built = (|| -> Result<(OwnedFd, OwnedFd), StepError> {
        make_stage_dirs(&p)?;
        let upper = open_path(&p.upper, libc::O_PATH | libc::O_DIRECTORY)?;
        if let Some(user) = user {
            for (src, dst) in rootfs.lowerdirs.iter().zip(&lowerdirs) {
                user.mount_idmapped(&cstr_step(src)?, &cstr_step(dst)?)?;
            }
            // The root directory of the merged tree is the upper layer's.
            user.chown(&p.upper)?;
        }
        if let Some(h) = &host {
            mount_host_layer(h, &lowerdirs[lowerdirs.len() - 2..])?;
        }
        mount_overlay(&p)?;
        // The sandbox's /dev but for its devpts instance, and the mount point for its /proc;
        // both move in later. Made by (and so owned by) the sandbox's root.
        let in_root = || -> Result<(), StepError> {
            ck(mkdir(&p.dev, 0o755), "mkdir_dev")?;
            ck(mkdir(&p.proc_, 0o555), "mkdir_proc")?;
            if !p.writable_root {
                for s in &p.scratch {
                    ck(mkdir_parents(s, 0o755), "mkdir_scratch")?;
                }
            }
            Ok(())
        };
        match user {
            Some(user) => user.as_root(in_root)?,
            None => in_root()?,
        }
        build_dev(&p)?;
        if let Some(user) = user {
            // The sandbox's /dev, like its root, belongs to its root.
            let nodes = p.dev_nodes.iter().map(|n| &n.src);
            let links = p.dev_links.iter().map(|(l, _)| l);
            for path in [&p.dev_src, &p.shm_src]
                .into_iter()
                .chain(&p.dev_src_dirs)
                .chain(nodes)
                .chain(links)
            {
                user.chown(path)?;
            }
        }
        if !p.writable_root {
            for s in &p.scratch {
                // A bind mount inherits nosuid/nodev from the overlay mount.
                try_mount("scratch_bind", s, s, None, libc::MS_BIND, None)?;
            }
            make_root_read_only(&p)?;
        }
        for w in warm {
            if let Ok(c) = CString::new(format!("{}{w}", p.root.to_string_lossy())) {
                let _ = path_kind(&c);
            }
        }
        // SAFETY: valid path; OPEN_TREE_CLONE returns a detached copy (with its submounts, by
        // AT_RECURSIVE) owned by the new fd.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_open_tree,
                libc::AT_FDCWD,
                p.root.as_ptr(),
                (libc::OPEN_TREE_CLONE | libc::OPEN_TREE_CLOEXEC | libc::AT_RECURSIVE as u32)
                    as libc::c_uint,
            )
        } as libc::c_int;
        ck(fd, "open_tree")?;
        // SAFETY: open_tree succeeded; the fd is fresh.
        Ok((unsafe { OwnedFd::from_raw_fd(fd) }, upper))
    })();
    // The staging mounts are not needed in our namespace any more; the detached clone keeps the
    // overlay (and through it the tmpfs upper) alive.
    // SAFETY: valid paths.
    unsafe {
        libc::umount2(p.root.as_ptr(), libc::MNT_DETACH);
        libc::umount2(p.stage.as_ptr(), libc::MNT_DETACH);
    }
    let _ = std::fs::remove_dir(&staged.stage);
    let (fd, upper) = built?;
    Ok(RootTree {
        fd,
        upper,
        rootfs: rootfs.clone(),
        user_ino: state.user_ino(),
    })
}

/// Mounts the host template's two layers (`[mask, /]`, staged) as one read-only overlay on
/// `at`, a directory it makes.
fn mount_host_layer(at: &str, host: &[String]) -> Result<(), StepError> {
    let at = cstr_step(at)?;
    ck(mkdir(&at, 0o755), "mkdir_host_layer")?;
    let opts = cstr_step(&format!("lowerdir={}", host.join(":")))?;
    try_mount(
        "host_layer",
        c"overlay",
        &at,
        Some(c"overlay"),
        libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV,
        Some(&opts),
    )
}

/// Where [`enter_root_tree`] mounts the new root inside the old one.
const NEW_ROOT: &CStr = c"/tmp";

/// Moves `tree` into the mount namespace of the process `init` and pivots every process of that
/// namespace onto it (`pivot_root` moves the root and working directory of each process that was
/// at the old root, so a running agent keeps running, now on the new root). `/proc`,
/// `/dev/pts` and `/dev/mqueue` are moved from the old root; the rest of `/dev`, with an empty
/// `/dev/shm`, comes with the tree. Returns an `O_PATH` descriptor of the old root: dropping it frees
/// the old writable layer, so the caller can do that after answering. The caller must be
/// single-threaded.
pub fn enter_root_tree(
    tree: RootTree,
    init: &PidFd,
    state: &mut ResetState,
) -> Result<OwnedFd, LaunchError> {
    ensure_single_threaded()?;
    state.own_ns()?;
    let (Some(own_ns), user) = (state.own_ns.as_ref(), state.user.as_ref()) else {
        return Err(StepError::last("own_ns").into());
    };
    let mountpoint = || ck(mkdir(NEW_ROOT, 0o700), "mkdir_mountpoint");
    // Made by the sandbox's root where it has a user namespace (a file system mounted in the
    // namespace, as a placeholder root is, takes only ids mapped in it).
    let mountpoint = || match user {
        Some(u) => u.as_root(mountpoint),
        None => mountpoint(),
    };
    // A pidfd names the init itself: no /proc path to open, no pid to be reused.
    setns_mnt(init.as_fd(), "setns_sandbox")?;
    let RootTree {
        fd: tree_fd, upper, ..
    } = tree;
    let inside = (|| -> Result<OwnedFd, StepError> {
        // The new root is mounted inside the old one, on /tmp (a writable scratch directory of
        // a read-only root, or creatable in a writable one); not beneath /dev/pts, which moves
        // into it. The tree has its /proc and /dev/pts directories (`build_root_tree`).
        mountpoint()?;
        // SAFETY: `tree_fd` is a detached mount; the target path is valid.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_move_mount,
                tree_fd.as_raw_fd(),
                c"".as_ptr(),
                libc::AT_FDCWD,
                NEW_ROOT.as_ptr(),
                libc::MOVE_MOUNT_F_EMPTY_PATH as libc::c_uint,
            )
        } as libc::c_int;
        ck(rc, "move_mount")?;
        let old_root = open_path(c"/", libc::O_PATH | libc::O_DIRECTORY)?;
        // The devpts instance has nothing open: every process but the agent is gone. /proc
        // already carries its masks: the whole subtree moves.
        for (step, from, to) in [
            ("move_pts", c"/dev/pts", c"/tmp/dev/pts"),
            ("move_mqueue", c"/dev/mqueue", c"/tmp/dev/mqueue"),
            ("move_proc", c"/proc", c"/tmp/proc"),
        ] {
            try_mount(step, from, to, None, libc::MS_MOVE, None)?;
        }
        pivot_onto(NEW_ROOT)?;
        Ok(old_root)
    })();
    // Back to our own namespace whatever happened.
    let back = setns_mnt(own_ns.as_fd(), "setns_back");
    // SAFETY: valid path.
    unsafe { libc::chdir(c"/".as_ptr()) };
    back?;
    let old = inside?;
    state.upper = Some(upper);
    Ok(old)
}

/// Resets a running sandbox in place: builds a fresh root for its template
/// ([`build_root_tree`]) and pivots the sandbox onto it ([`enter_root_tree`]); its namespaces,
/// cgroup, agent and connection are unchanged. The caller must have killed every other process
/// of the sandbox first.
pub fn reset_in_place(
    spec: &ContainerSpec<'_>,
    init: &PidFd,
    state: &mut ResetState,
) -> Result<OwnedFd, LaunchError> {
    if spec.ns.user.is_some() != state.user.is_some() {
        return Err(LaunchError::InvalidArgument {
            what: "in-place reset without the sandbox's user namespace",
        });
    }
    let tree = build_root_tree(&spec.rootfs, state, &[])?;
    enter_root_tree(tree, init, state)
}

/// Sets the hostname of the UTS namespace of `pid` (the supervisor enters it for the call).
pub fn set_hostname_of(pid: i32, hostname: &str) -> Result<(), LaunchError> {
    ensure_single_threaded()?;
    let name = cstr(hostname, "hostname")?;
    let own = open_path(c"/proc/self/ns/uts", libc::O_RDONLY)?;
    let theirs = open_path(&cstr(format!("/proc/{pid}/ns/uts"), "pid")?, libc::O_RDONLY)?;
    ck(
        // SAFETY: setns on namespace fds we own; the caller is single-threaded (checked).
        unsafe { libc::setns(theirs.as_raw_fd(), libc::CLONE_NEWUTS) },
        "setns_uts",
    )?;
    // SAFETY: valid buffer and length.
    let set = ck(
        unsafe { libc::sethostname(name.as_ptr(), name.as_bytes().len()) },
        "sethostname",
    );
    // SAFETY: as above, back to our own namespace.
    let back = ck(
        unsafe { libc::setns(own.as_raw_fd(), libc::CLONE_NEWUTS) },
        "setns_uts_back",
    );
    set?;
    back?;
    Ok(())
}

/// Moves the (single-threaded) caller into a new mount namespace whose mounts are all private,
/// so that what it mounts is seen by it and its descendants only, and disappears with them.
pub fn enter_private_mount_ns() -> Result<(), LaunchError> {
    ensure_single_threaded()?;
    // SAFETY: integer-argument syscall in a single-threaded process.
    ck(unsafe { libc::unshare(libc::CLONE_NEWNS) }, "unshare_mnt")?;
    make_mounts_private()?;
    Ok(())
}
