//! Setup steps as plain system calls returning a [`StepError`] (the step's name and errno):
//! directories, mounts and the pivot, shared by the sandbox init and the root trees.

use std::ffi::{CStr, CString};
use std::io;

use super::StepError;

pub(super) fn mkdir(path: &CStr, mode: libc::mode_t) -> libc::c_int {
    // SAFETY: valid NUL-terminated path.
    let rc = unsafe { libc::mkdir(path.as_ptr(), mode) };
    if rc < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::EEXIST) {
        0
    } else {
        rc
    }
}

/// `mkdir -p`: creates missing parents too (a template may lack `/var` for `/var/tmp`).
pub(super) fn mkdir_parents(path: &CStr, mode: libc::mode_t) -> libc::c_int {
    if mkdir(path, mode) == 0 {
        return 0;
    }
    if io::Error::last_os_error().raw_os_error() != Some(libc::ENOENT) {
        return -1;
    }
    let bytes = path.to_bytes();
    let mut rc = 0;
    for (i, b) in bytes.iter().enumerate().skip(1) {
        if *b == b'/' {
            if let Ok(parent) = CString::new(&bytes[..i]) {
                rc = mkdir(&parent, mode);
            }
        }
    }
    if rc < 0 {
        return rc;
    }
    mkdir(path, mode)
}

/// Kind of an existing path, without following a final symlink.
pub(super) fn path_kind(path: &CStr) -> Option<libc::mode_t> {
    // SAFETY: zeroed stat is a valid out-parameter; path is NUL-terminated.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let rc = unsafe { libc::lstat(path.as_ptr(), &mut st) };
    (rc == 0).then_some(st.st_mode & libc::S_IFMT)
}

pub(super) const NONE: &CStr = c"none";

pub(super) fn ck(rc: libc::c_int, step: &'static str) -> Result<(), StepError> {
    if rc < 0 {
        Err(StepError::last(step))
    } else {
        Ok(())
    }
}

pub(super) fn try_mount(
    step: &'static str,
    src: &CStr,
    target: &CStr,
    fstype: Option<&CStr>,
    flags: libc::c_ulong,
    data: Option<&CStr>,
) -> Result<(), StepError> {
    // SAFETY: every pointer is a valid NUL-terminated string (or null where the kernel allows it).
    let rc = unsafe {
        libc::mount(
            src.as_ptr(),
            target.as_ptr(),
            fstype.map_or(std::ptr::null(), CStr::as_ptr),
            flags,
            data.map_or(std::ptr::null(), |d| d.as_ptr().cast()),
        )
    };
    ck(rc, step)
}

/// Makes every mount of the caller's mount namespace private: nothing mounted in it propagates
/// to another namespace, nor the other way.
pub(super) fn make_mounts_private() -> Result<(), StepError> {
    try_mount(
        "private",
        NONE,
        c"/",
        None,
        libc::MS_REC | libc::MS_PRIVATE,
        None,
    )
}

/// Makes `root` (a mount point) the root of the caller's mount namespace and of every process
/// whose root or cwd was the old root, then detaches the old root.
pub(super) fn pivot_onto(root: &CStr) -> Result<(), StepError> {
    // pivot_root(".", ".") stacks the old root on top of the new one; detach it.
    // SAFETY: valid path.
    ck(unsafe { libc::chdir(root.as_ptr()) }, "chdir_root")?;
    ck(
        // SAFETY: valid NUL-terminated strings.
        unsafe { libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) as libc::c_int },
        "pivot_root",
    )?;
    ck(
        // SAFETY: valid path.
        unsafe { libc::umount2(c".".as_ptr(), libc::MNT_DETACH) },
        "umount_old_root",
    )?;
    // SAFETY: valid path.
    ck(unsafe { libc::chdir(c"/".as_ptr()) }, "chdir_new_root")?;
    Ok(())
}
