//! Emptying a sandbox's IPC namespace between episodes.
//!
//! An in-place reset keeps the sandbox's namespaces, and System V shared memory segments,
//! message queues and semaphore sets, like POSIX message queues, live in the IPC namespace, not
//! in a process: without this they would carry one episode's data into the next.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use std::ffi::OsStr;

use crate::fs::{self, FsError};
use crate::ipc::PidFd;

use super::steps::ck;
use super::{ensure_single_threaded, LaunchError, ResetState, StepError};

// <linux/ipc.h>, <linux/shm.h>, <linux/msg.h>, <linux/sem.h>.
const IPC_RMID: libc::c_int = 0;
const MSG_STAT: libc::c_int = 11;
const MSG_INFO: libc::c_int = 12;
const SHM_STAT: libc::c_int = 13;
const SHM_INFO: libc::c_int = 14;
const SEM_STAT: libc::c_int = 18;
const SEM_INFO: libc::c_int = 19;

/// Room for any of `shmid64_ds`, `msqid64_ds`, `semid64_ds`, `shm_info`, `msginfo`, `seminfo`
/// (all at most 120 bytes on x86_64).
type IpcBuf = [u64; 32];

/// The IPC namespace of one sandbox init, as its supervisor holds it.
#[derive(Debug)]
pub struct IpcNamespace {
    /// A detached mount of the namespace's `mqueue` filesystem (its queues are its files), so
    /// that a reset finds them with one `fstat` and no mount in any tree.
    mqueue: OwnedFd,
}

impl IpcNamespace {
    /// Opens the IPC namespace of `init` (entered for the call; the caller must be
    /// single-threaded).
    pub fn open(init: &PidFd, state: &mut ResetState) -> Result<Self, LaunchError> {
        let mqueue = in_ipc_ns(init, state, detached_mqueue)?;
        Ok(Self { mqueue })
    }

    /// Removes every System V object and POSIX message queue of the namespace. Call it once
    /// every process of the sandbox but its init is gone (nothing can then create new ones: the
    /// init creates none). Checking an empty namespace costs three `*ctl` calls and one `fstat`.
    pub fn clear(&self, init: &PidFd, state: &mut ResetState) -> Result<(), LaunchError> {
        in_ipc_ns(init, state, || {
            remove_all(libc::SYS_shmctl, SHM_INFO, SHM_STAT, |b| info_int(b, 0))?;
            remove_all(libc::SYS_msgctl, MSG_INFO, MSG_STAT, |b| info_int(b, 0))?;
            // `seminfo.semusz`, the eighth int, holds the number of sets for SEM_INFO.
            remove_all(libc::SYS_semctl, SEM_INFO, SEM_STAT, |b| info_int(b, 7))
        })?;
        Ok(clear_mqueues(self.mqueue.as_fd())?)
    }
}

/// A detached mount (attached to no tree) of the caller's IPC namespace's `mqueue` filesystem.
fn detached_mqueue() -> Result<OwnedFd, StepError> {
    // SAFETY: valid NUL-terminated name; the fd returned is fresh and owned by us.
    let fc = unsafe {
        libc::syscall(
            libc::SYS_fsopen,
            c"mqueue".as_ptr(),
            libc::FSOPEN_CLOEXEC as libc::c_uint,
        )
    } as libc::c_int;
    ck(fc, "fsopen_mqueue")?;
    // SAFETY: fsopen succeeded; the fd is fresh.
    let fc = unsafe { OwnedFd::from_raw_fd(fc) };
    // SAFETY: a filesystem context fd; no key, value or aux.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_fsconfig,
            fc.as_raw_fd(),
            libc::FSCONFIG_CMD_CREATE as libc::c_uint,
            std::ptr::null::<libc::c_char>(),
            std::ptr::null::<libc::c_void>(),
            0 as libc::c_int,
        )
    } as libc::c_int;
    ck(rc, "fsconfig_mqueue")?;
    // SAFETY: a created filesystem context; the mount fd returned is fresh.
    let mnt = unsafe {
        libc::syscall(
            libc::SYS_fsmount,
            fc.as_raw_fd(),
            libc::FSMOUNT_CLOEXEC as libc::c_uint,
            (libc::MOUNT_ATTR_NOSUID | libc::MOUNT_ATTR_NODEV | libc::MOUNT_ATTR_NOEXEC)
                as libc::c_uint,
        )
    } as libc::c_int;
    ck(mnt, "fsmount_mqueue")?;
    // SAFETY: fsmount succeeded; the fd is fresh.
    Ok(unsafe { OwnedFd::from_raw_fd(mnt) })
}

/// Runs `f` inside the IPC namespace of `init`, then returns to the caller's own.
fn in_ipc_ns<T>(
    init: &PidFd,
    state: &mut ResetState,
    f: impl FnOnce() -> Result<T, StepError>,
) -> Result<T, LaunchError> {
    ensure_single_threaded()?;
    let own = state.own_ipc_ns()?;
    // SAFETY: a pidfd, whose IPC namespace is entered; the caller is single-threaded (checked).
    let rc = unsafe { libc::setns(init.as_fd().as_raw_fd(), libc::CLONE_NEWIPC) };
    ck(rc, "setns_ipc")?;
    let out = f();
    // SAFETY: our own IPC namespace fd.
    let rc = unsafe { libc::setns(own.as_raw_fd(), libc::CLONE_NEWIPC) };
    ck(rc, "setns_ipc_back")?;
    Ok(out?)
}

fn info_int(buf: &IpcBuf, index: usize) -> i64 {
    // The info structures begin with C ints, two to a u64 (little endian).
    let word = buf[index / 2];
    let half = if index.is_multiple_of(2) {
        word
    } else {
        word >> 32
    };
    i64::from(half as u32 as i32)
}

/// Removes every object of one System V kind: the `*_INFO` call gives the highest index in use
/// and the count, `*_STAT` turns each index into an id, `IPC_RMID` removes it (a shared memory
/// segment still attached by a dying process goes when it detaches).
fn remove_all(
    sys: libc::c_long,
    info_cmd: libc::c_int,
    stat_cmd: libc::c_int,
    in_use: impl Fn(&IpcBuf) -> i64,
) -> Result<(), StepError> {
    let call = |id: libc::c_int, cmd: libc::c_int, buf: *mut IpcBuf| -> libc::c_long {
        // SAFETY: shmctl(id, cmd, buf) / msgctl(id, cmd, buf) / semctl(id, 0, cmd, buf): `buf`
        // is null (IPC_RMID) or points to a zeroed buffer larger than any structure the kernel
        // writes for these commands.
        unsafe {
            if sys == libc::SYS_semctl {
                libc::syscall(sys, id, 0 as libc::c_int, cmd, buf)
            } else {
                libc::syscall(sys, id, cmd, buf)
            }
        }
    };
    let mut buf: IpcBuf = [0; 32];
    let max_index = call(0, info_cmd, &mut buf);
    ck(max_index as libc::c_int, "ipc_info")?;
    if in_use(&buf) <= 0 {
        return Ok(());
    }
    for index in 0..=max_index as libc::c_int {
        let mut stat: IpcBuf = [0; 32];
        let id = call(index, stat_cmd, &mut stat);
        if id < 0 {
            continue; // a free slot
        }
        // Fails only for an object already gone.
        call(id as libc::c_int, IPC_RMID, std::ptr::null_mut());
    }
    Ok(())
}

/// The size `ipc/mqueue.c` gives an empty queue directory (`2 * DIRENT_SIZE`, for `.` and
/// `..`); each queue adds `DIRENT_SIZE` (20) and its unlink takes it back.
const EMPTY_MQUEUE_DIR_SIZE: u64 = 40;

/// Whether an `mqueue` mount holds any queue, told by one `fstat` of its root.
fn holds_queues(mnt: BorrowedFd<'_>) -> Result<bool, FsError> {
    Ok(fs::fstatat_nofollow(mnt, OsStr::new(""))?.size > EMPTY_MQUEUE_DIR_SIZE)
}

/// Unlinks every queue of an `mqueue` mount (its queues are its files).
fn clear_mqueues(mnt: BorrowedFd<'_>) -> Result<(), StepError> {
    let failed = |step| {
        move |e: FsError| StepError {
            step,
            errno: e.raw_os_error().unwrap_or(libc::EIO),
        }
    };
    if !holds_queues(mnt).map_err(failed("stat_mqueue"))? {
        return Ok(());
    }
    loop {
        let (queues, more) = fs::read_dir(mnt, 1024).map_err(failed("list_mqueue"))?;
        for q in &queues {
            fs::unlinkat(mnt, &q.name, false).map_err(failed("unlink_mqueue"))?;
        }
        if !more {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// In a thread of its own IPC namespace (needs root; the namespace dies with the thread):
    /// an empty `mqueue` is told empty by its size, a queue is seen, and the clean-up removes it.
    #[test]
    fn an_empty_mqueue_is_told_by_its_size_and_a_queue_is_removed() {
        std::thread::spawn(|| {
            // SAFETY: unshare of this thread's IPC namespace only.
            let rc = unsafe { libc::unshare(libc::CLONE_NEWIPC) };
            assert_eq!(rc, 0, "unshare(CLONE_NEWIPC): {}", io_err());
            let mnt = detached_mqueue().expect("detached mqueue");
            assert!(!holds_queues(mnt.as_fd()).expect("stat"), "a new namespace");
            // SAFETY: a NUL-terminated name; default attributes.
            let q = unsafe {
                libc::mq_open(
                    c"/dsec-test".as_ptr(),
                    libc::O_CREAT | libc::O_RDWR | libc::O_CLOEXEC,
                    0o600 as libc::mode_t,
                    std::ptr::null_mut::<libc::mq_attr>(),
                )
            };
            assert!(q >= 0, "mq_open: {}", io_err());
            assert!(holds_queues(mnt.as_fd()).expect("stat"), "one queue");
            clear_mqueues(mnt.as_fd()).expect("clear");
            assert!(
                !holds_queues(mnt.as_fd()).expect("stat"),
                "after the clean-up"
            );
            let (left, _) = fs::read_dir(mnt.as_fd(), 16).expect("list");
            assert!(left.is_empty(), "left: {:?}", left.len());
            // SAFETY: the descriptor mq_open returned.
            unsafe { libc::mq_close(q) };
        })
        .join()
        .expect("the test thread");
    }

    fn io_err() -> std::io::Error {
        std::io::Error::last_os_error()
    }
}
