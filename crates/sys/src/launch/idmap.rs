//! A sandbox's user namespace seen from its supervisor: the template's read-only layers are
//! mounted *idmapped* into it (`mount_setattr(MOUNT_ATTR_IDMAP)`), so that a file the template
//! stores as host uid 0 belongs to the sandbox's root, which is the first host id of the
//! sandbox's own range. The layers themselves are never changed or copied.

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use super::steps::ck;
use super::{IdMap, StepError};

/// The user namespace of a running sandbox init and the host ids of its root.
#[derive(Debug)]
pub struct SandboxUser {
    ns: OwnedFd,
    /// The namespace's inode: identifies it (a relaunch makes a new one).
    ino: u64,
    root_uid: u32,
    root_gid: u32,
}

impl SandboxUser {
    /// The user namespace of the process `pid` (the caller's child, so the pid cannot be
    /// reused while it is unreaped), mapped as `map`.
    pub fn of(pid: i32, map: &IdMap) -> io::Result<SandboxUser> {
        let ns = std::fs::File::open(format!("/proc/{pid}/ns/user"))?;
        let ino = std::os::unix::fs::MetadataExt::ino(&ns.metadata()?);
        Ok(SandboxUser {
            ns: OwnedFd::from(ns),
            ino,
            root_uid: map.host_uid,
            root_gid: map.host_gid,
        })
    }

    /// The namespace's inode number.
    pub(super) fn ino(&self) -> u64 {
        self.ino
    }

    /// Runs `f` with the caller's file-system ids set to the sandbox root's host ids, so that
    /// what it creates through an overlay belongs to the sandbox's root. (The file-system
    /// capabilities are off meanwhile: `f` must need none.)
    pub(super) fn as_root<T>(&self, f: impl FnOnce() -> T) -> T {
        // SAFETY: integer-argument syscalls on the calling (single) thread.
        unsafe {
            libc::setfsgid(self.root_gid);
            libc::setfsuid(self.root_uid);
        }
        let out = f();
        // SAFETY: as above; back to host root.
        unsafe {
            libc::setfsuid(0);
            libc::setfsgid(0);
        }
        out
    }

    /// Gives `path` to the sandbox's root.
    /// The host uid and gid of the namespace's root (its ids count up from there).
    pub fn root_ids(&self) -> (u32, u32) {
        (self.root_uid, self.root_gid)
    }

    pub(super) fn chown(&self, path: &CStr) -> Result<(), StepError> {
        // SAFETY: valid NUL-terminated path.
        ck(
            unsafe { libc::lchown(path.as_ptr(), self.root_uid, self.root_gid) },
            "chown_to_root",
        )
    }

    /// Mounts a read-only, idmapped clone of the mount at `src` (that mount only, no submounts)
    /// on the directory `dst`.
    pub(super) fn mount_idmapped(&self, src: &CStr, dst: &CStr) -> Result<(), StepError> {
        // SAFETY: valid path; OPEN_TREE_CLONE returns a detached copy owned by the new fd.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_open_tree,
                libc::AT_FDCWD,
                src.as_ptr(),
                (libc::OPEN_TREE_CLONE | libc::OPEN_TREE_CLOEXEC) as libc::c_uint,
            )
        } as libc::c_int;
        ck(fd, "open_tree_lower")?;
        // SAFETY: open_tree succeeded; the fd is fresh.
        let tree = unsafe { OwnedFd::from_raw_fd(fd) };
        let attr = MountAttr {
            attr_set: MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_IDMAP,
            attr_clr: 0,
            propagation: 0,
            userns_fd: self.ns.as_raw_fd() as u64,
        };
        // SAFETY: `tree` is a detached mount we own; `attr` is a valid struct of the size given.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_mount_setattr,
                tree.as_raw_fd(),
                c"".as_ptr(),
                libc::AT_EMPTY_PATH,
                &attr as *const MountAttr,
                std::mem::size_of::<MountAttr>(),
            )
        } as libc::c_int;
        ck(rc, "idmap_lower")?;
        ck(super::steps::mkdir(dst, 0o755), "mkdir_lower")?;
        // SAFETY: `tree` is a detached mount; the target path is valid.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_move_mount,
                tree.as_raw_fd(),
                c"".as_ptr(),
                libc::AT_FDCWD,
                dst.as_ptr(),
                libc::MOVE_MOUNT_F_EMPTY_PATH as libc::c_uint,
            )
        } as libc::c_int;
        ck(rc, "move_lower")
    }
}

/// `struct mount_attr` of `mount_setattr(2)`.
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

const MOUNT_ATTR_RDONLY: u64 = 0x1;
const MOUNT_ATTR_NOSUID: u64 = 0x2;
const MOUNT_ATTR_NODEV: u64 = 0x4;
const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;
