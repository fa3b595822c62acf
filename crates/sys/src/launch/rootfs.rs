//! The sandbox's root: its `/dev` without a filesystem of its own, `/proc` with masked and
//! read-only paths, scratch directories, the read-only root, then the pivot.

use std::ffi::CStr;

use super::prepare::Prepared;
use super::steps::{ck, mkdir, mkdir_parents, path_kind, pivot_onto, try_mount};
use super::StepError;

/// Builds the sandbox's `/dev` (but for devpts) without a filesystem of its own: the nodes,
/// links and mount points are created in `<stage>/dev`, a directory of the sandbox's tmpfs
/// (beside the overlay's upper and work directories, so not reachable through the overlay),
/// which is bound on `<root>/dev` and made read-only; `/dev/shm` is a bind of `<stage>/shm`,
/// another directory of that tmpfs. Each superblock costs every memory cgroup created later on
/// the host (see docs/SPECIFICATION.md), and these two used to be tmpfs mounts of their own.
/// `/dev/shm` thereby shares the disk quota, and a fresh tmpfs means a fresh `/dev/shm`.
pub(super) fn build_dev(p: &Prepared) -> Result<(), StepError> {
    let nul = c"";
    ck(mkdir(&p.dev_src, 0o755), "mkdir_dev_src")?;
    ck(
        // SAFETY: valid path; the umask may have cleared bits.
        unsafe { libc::chmod(p.dev_src.as_ptr(), 0o755) },
        "chmod_dev",
    )?;
    for n in &p.dev_nodes {
        if p.userns {
            // SAFETY: valid path; creating an empty regular file as a bind-mount target.
            let fd = unsafe {
                libc::open(
                    n.src.as_ptr(),
                    libc::O_CREAT | libc::O_CLOEXEC | libc::O_WRONLY,
                    0o666,
                )
            };
            ck(fd, "dev_file")?;
            // SAFETY: closing the fd we just opened.
            unsafe { libc::close(fd) };
        } else {
            let dev = libc::makedev(n.major, n.minor);
            ck(
                // SAFETY: valid path and a character device number.
                unsafe { libc::mknod(n.src.as_ptr(), libc::S_IFCHR | 0o666, dev) },
                "mknod",
            )?;
            // SAFETY: valid path; umask may have cleared bits.
            ck(unsafe { libc::chmod(n.src.as_ptr(), 0o666) }, "chmod_dev")?;
        }
    }
    for (link, target) in &p.dev_links {
        ck(
            // SAFETY: both are valid NUL-terminated strings.
            unsafe { libc::symlink(target.as_ptr(), link.as_ptr()) },
            "dev_link",
        )?;
    }
    for d in &p.dev_src_dirs {
        ck(mkdir(d, 0o755), "mkdir_dev_dir")?;
    }
    ck(mkdir(&p.shm_src, 0o1777), "mkdir_shm")?;
    ck(
        // SAFETY: valid path; the umask may have cleared bits.
        unsafe { libc::chmod(p.shm_src.as_ptr(), 0o1777) },
        "chmod_shm",
    )?;
    try_mount("dev_bind", &p.dev_src, &p.dev, None, libc::MS_BIND, None)?;
    if p.userns {
        for n in &p.dev_nodes {
            try_mount("dev_node_bind", &n.host, &n.dst, None, libc::MS_BIND, None)?;
            // The host's devtmpfs is not nosuid; this bind must be.
            try_mount(
                "dev_node_remount",
                nul,
                &n.dst,
                None,
                libc::MS_BIND | libc::MS_REMOUNT | libc::MS_NOSUID | libc::MS_NOEXEC,
                None,
            )?;
        }
    }
    // The bind keeps the tmpfs mount's nosuid and nodev.
    try_mount("shm_bind", &p.shm_src, &p.shm, None, libc::MS_BIND, None)?;
    // Read-only, and not nodev (the nodes must work; no process in the sandbox can create nodes,
    // it has no CAP_MKNOD, and nothing else of the tmpfs is reachable without nodev). Only
    // /dev/shm and /dev/pts take writes.
    try_mount(
        "dev_ro",
        nul,
        &p.dev,
        None,
        libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NOEXEC,
        None,
    )
}

/// Populates the new root (`/dev`, `/proc` with masks, scratch dirs, read-only root) and pivots
/// the caller's mount namespace onto it. `pivot_root` moves the root and cwd of every process of
/// the namespace that was at the old root, which is what makes an in-place reset possible.
pub(super) fn populate_and_pivot(p: &Prepared) -> Result<(), StepError> {
    let nul = c"";
    let nosuid_nodev = libc::MS_NOSUID | libc::MS_NODEV;
    ck(mkdir(&p.dev, 0o755), "mkdir_dev")?;
    build_dev(p)?;
    try_mount(
        "devpts",
        c"devpts",
        &p.pts,
        Some(c"devpts"),
        libc::MS_NOSUID | libc::MS_NOEXEC,
        Some(c"newinstance,ptmxmode=0666,mode=0620"),
    )?;
    // The queues of the sandbox's own IPC namespace (the mount takes the mounter's): code in
    // the sandbox can list and remove what it made, as the function substrate's driver does
    // between calls. Like /dev/pts it moves across in-place resets.
    try_mount(
        "mqueue",
        c"mqueue",
        &p.mqueue,
        Some(c"mqueue"),
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        None,
    )?;

    // /proc for the sandbox's pid namespace, with the OCI masked and read-only paths.
    ck(mkdir(&p.proc_, 0o555), "mkdir_proc")?;
    try_mount(
        "proc",
        c"proc",
        &p.proc_,
        Some(c"proc"),
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        None,
    )?;
    // Masks come from outside the sandbox's tmpfs: /proc moves across resets, and a bind
    // from the tmpfs would keep the first writable layer alive with it.
    let devnull = &p.dev_nodes[0].host;
    let ro = libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_NOEXEC;
    for m in &p.masked {
        match path_kind(m) {
            Some(libc::S_IFDIR) => match &p.empty_dir {
                Some(empty) => {
                    try_mount("mask_dir", empty, m, None, libc::MS_BIND, None)?;
                    try_mount("mask_dir_ro", nul, m, None, ro | nosuid_nodev, None)?;
                }
                None => try_mount(
                    "mask_dir",
                    c"tmpfs",
                    m,
                    Some(c"tmpfs"),
                    libc::MS_RDONLY | nosuid_nodev | libc::MS_NOEXEC,
                    Some(c"size=0,nr_inodes=1"),
                )?,
            },
            Some(_) => {
                try_mount("mask_file", devnull, m, None, libc::MS_BIND, None)?;
                // In a user namespace also nodev, as it always was there.
                let nodev = if p.userns { libc::MS_NODEV } else { 0 };
                try_mount(
                    "mask_remount",
                    nul,
                    m,
                    None,
                    ro | libc::MS_NOSUID | nodev,
                    None,
                )?;
            }
            None => {}
        }
    }
    for r in &p.readonly {
        if path_kind(r).is_some() {
            try_mount("ro_bind", r, r, None, libc::MS_BIND | libc::MS_REC, None)?;
            try_mount(
                "ro_remount",
                nul,
                r,
                None,
                libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | nosuid_nodev | libc::MS_NOEXEC,
                None,
            )?;
        }
    }

    if !p.writable_root {
        for s in &p.scratch {
            ck(mkdir_parents(s, 0o755), "mkdir_scratch")?;
            try_mount("scratch_bind", s, s, None, libc::MS_BIND, None)?;
            try_mount(
                "scratch_remount",
                nul,
                s,
                None,
                libc::MS_BIND | libc::MS_REMOUNT | nosuid_nodev,
                None,
            )?;
        }
        make_root_read_only(p)?;
    }

    pivot_onto(&p.root)
}

/// Mounts the stage: a tmpfs limited to the sandbox's disk quota (bytes and inodes).
pub(super) fn mount_stage_tmpfs(p: &Prepared) -> Result<(), StepError> {
    mount_nosuid_nodev("tmpfs", c"tmpfs", &p.stage, &p.tmpfs_opts)
}

/// Makes the overlay's upper, work and root directories on the stage tmpfs.
pub(super) fn make_stage_dirs(p: &Prepared) -> Result<(), StepError> {
    for d in [&p.upper, &p.work, &p.root] {
        ck(mkdir(d, 0o755), "mkdir_stage")?;
    }
    Ok(())
}

/// Mounts the overlay on the root directory: the template layers read-only, the upper layer on
/// the stage tmpfs.
pub(super) fn mount_overlay(p: &Prepared) -> Result<(), StepError> {
    mount_nosuid_nodev("overlay", c"overlay", &p.root, &p.overlay_opts)
}

/// Mounts a new filesystem of type `fstype`, nosuid and nodev, with the options `opts` on
/// `target`.
fn mount_nosuid_nodev(
    step: &'static str,
    fstype: &CStr,
    target: &CStr,
    opts: &CStr,
) -> Result<(), StepError> {
    let flags = libc::MS_NOSUID | libc::MS_NODEV;
    try_mount(step, fstype, target, Some(fstype), flags, Some(opts))
}

/// Remounts the root read-only (its scratch directories, bound on themselves, stay writable).
pub(super) fn make_root_read_only(p: &Prepared) -> Result<(), StepError> {
    try_mount(
        "ro_root",
        c"",
        &p.root,
        None,
        libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV,
        None,
    )
}
