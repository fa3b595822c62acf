//! Filesystem access confined to a directory: `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)`
//! (or `RESOLVE_BENEATH`) and the `*at` calls the agent needs on a parent directory fd plus one
//! final name (`mkdirat`, `unlinkat`, `renameat`, `linkat`, `symlinkat`, `readlinkat`, `fstatat`
//! without following links), and directory listing by fd.
//!
//! No function here follows a path string from the process's own root or cwd.

use std::ffi::{CStr, CString, OsStr, OsString};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::Path;

/// Errors of the confined filesystem wrappers. Each carries the OS error as its source; use
/// [`FsError::raw_os_error`] to map it to a protocol error code.
#[derive(Debug, thiserror::Error)]
pub enum FsError {
    /// A path contained a NUL byte.
    #[error("path {path:?} contains NUL")]
    Nul {
        /// The offending path.
        path: OsString,
    },
    /// Opening the root directory failed.
    #[error("open root {path:?}")]
    OpenRoot {
        /// Root path.
        path: OsString,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `openat2` failed.
    #[error("open {path:?}")]
    Open {
        /// Path relative to the directory fd.
        path: OsString,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `mkdirat` failed.
    #[error("mkdir {name:?}")]
    Mkdir {
        /// Name in the parent.
        name: OsString,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `unlinkat` failed.
    #[error("unlink {name:?}")]
    Unlink {
        /// Name in the parent.
        name: OsString,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `renameat` failed.
    #[error("rename {from:?} to {to:?}")]
    Rename {
        /// Old name.
        from: OsString,
        /// New name.
        to: OsString,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `linkat` failed.
    #[error("link {from:?} to {to:?}")]
    Link {
        /// Existing name.
        from: OsString,
        /// New name.
        to: OsString,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `symlinkat` failed.
    #[error("symlink {name:?}")]
    Symlink {
        /// New link name.
        name: OsString,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `readlinkat` failed.
    #[error("readlink {name:?}")]
    Readlink {
        /// Link name ("" for the fd itself).
        name: OsString,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// `fstatat`/`fstat` failed.
    #[error("stat {name:?}")]
    Stat {
        /// Name ("" for the fd itself).
        name: OsString,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// Reading a directory failed.
    #[error("read directory")]
    ReadDir(#[source] io::Error),
    /// An inotify call (`inotify_init1`, `inotify_add_watch`, `inotify_rm_watch`) failed.
    #[error("inotify {op}")]
    Inotify {
        /// The call.
        op: &'static str,
        /// Cause.
        #[source]
        source: io::Error,
    },
}

impl FsError {
    /// The errno behind this error, if any.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            FsError::Nul { .. } => None,
            FsError::OpenRoot { source, .. }
            | FsError::Open { source, .. }
            | FsError::Mkdir { source, .. }
            | FsError::Unlink { source, .. }
            | FsError::Rename { source, .. }
            | FsError::Link { source, .. }
            | FsError::Symlink { source, .. }
            | FsError::Readlink { source, .. }
            | FsError::Stat { source, .. }
            | FsError::ReadDir(source)
            | FsError::Inotify { source, .. } => source.raw_os_error(),
        }
    }
}

fn cstr(p: &OsStr) -> Result<CString, FsError> {
    CString::new(p.as_bytes()).map_err(|_| FsError::Nul { path: p.to_owned() })
}

/// How `openat2` confines path resolution.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Confine {
    /// `RESOLVE_IN_ROOT`: the dir fd acts as `/` (absolute symlinks and `..` stay inside).
    InRoot,
    /// `RESOLVE_BENEATH`: anything leaving the dir fd fails with `EXDEV`.
    Beneath,
    /// `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`: no symlink at all may be traversed (`ELOOP`).
    BeneathNoSymlinks,
}

#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

/// Opens the directory at `path` (of the caller's filesystem view) as an `O_PATH` fd, to serve
/// as the root for [`openat2`].
pub fn open_root(path: &Path) -> Result<OwnedFd, FsError> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(path)
        .map(OwnedFd::from)
        .map_err(|source| FsError::OpenRoot {
            path: path.as_os_str().to_owned(),
            source,
        })
}

/// `openat2(dir, path, flags | O_CLOEXEC, mode)` with `RESOLVE_NO_MAGICLINKS` plus `confine`.
/// `flags` are `O_*` flags (e.g. `O_RDONLY | O_NOFOLLOW`, `O_PATH`, `O_DIRECTORY`).
pub fn openat2(
    dir: BorrowedFd<'_>,
    path: &OsStr,
    flags: i32,
    mode: u32,
    confine: Confine,
) -> Result<OwnedFd, FsError> {
    let c = cstr(path)?;
    let resolve = libc::RESOLVE_NO_MAGICLINKS
        | match confine {
            Confine::InRoot => libc::RESOLVE_IN_ROOT,
            Confine::Beneath => libc::RESOLVE_BENEATH,
            Confine::BeneathNoSymlinks => libc::RESOLVE_BENEATH | libc::RESOLVE_NO_SYMLINKS,
        };
    let creating = flags & (libc::O_CREAT | libc::O_TMPFILE) != 0;
    let how = OpenHow {
        flags: (flags | libc::O_CLOEXEC) as u32 as u64,
        mode: if creating {
            u64::from(mode & 0o7777)
        } else {
            0
        },
        resolve,
    };
    loop {
        // SAFETY: `c` is a NUL-terminated string and `how` a properly laid out open_how struct
        // (size passed explicitly), both valid for the call; `dir` is an open fd.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_openat2,
                dir.as_raw_fd(),
                c.as_ptr(),
                &how as *const OpenHow,
                std::mem::size_of::<OpenHow>(),
            )
        };
        if rc >= 0 {
            // SAFETY: openat2 returned a new fd that nothing else owns.
            return Ok(unsafe { OwnedFd::from_raw_fd(rc as i32) });
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EAGAIN) || err.raw_os_error() == Some(libc::EINTR) {
            continue;
        }
        return Err(FsError::Open {
            path: path.to_owned(),
            source: err,
        });
    }
}

fn check(rc: libc::c_int) -> io::Result<()> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// `mkdirat(dir, name, mode)`.
pub fn mkdirat(dir: BorrowedFd<'_>, name: &OsStr, mode: u32) -> Result<(), FsError> {
    let c = cstr(name)?;
    // SAFETY: `c` is NUL-terminated and `dir` is open for the call.
    check(unsafe { libc::mkdirat(dir.as_raw_fd(), c.as_ptr(), mode as libc::mode_t) }).map_err(
        |source| FsError::Mkdir {
            name: name.to_owned(),
            source,
        },
    )
}

/// `unlinkat(dir, name, AT_REMOVEDIR if remove_dir)`. Never follows a symlink.
pub fn unlinkat(dir: BorrowedFd<'_>, name: &OsStr, remove_dir: bool) -> Result<(), FsError> {
    let c = cstr(name)?;
    let flags = if remove_dir { libc::AT_REMOVEDIR } else { 0 };
    // SAFETY: `c` is NUL-terminated and `dir` is open for the call.
    check(unsafe { libc::unlinkat(dir.as_raw_fd(), c.as_ptr(), flags) }).map_err(|source| {
        FsError::Unlink {
            name: name.to_owned(),
            source,
        }
    })
}

/// `renameat(dir, from, dir, to)` within one directory.
pub fn renameat(dir: BorrowedFd<'_>, from: &OsStr, to: &OsStr) -> Result<(), FsError> {
    let a = cstr(from)?;
    let b = cstr(to)?;
    // SAFETY: both strings are NUL-terminated and `dir` is open for the call.
    check(unsafe { libc::renameat(dir.as_raw_fd(), a.as_ptr(), dir.as_raw_fd(), b.as_ptr()) })
        .map_err(|source| FsError::Rename {
            from: from.to_owned(),
            to: to.to_owned(),
            source,
        })
}

/// `renameat(from_dir, from, to_dir, to)` between two directories; replaces an existing `to`
/// (a file by a file, an empty directory by a directory) and never follows a final symlink.
pub fn renameat_between(
    from_dir: BorrowedFd<'_>,
    from: &OsStr,
    to_dir: BorrowedFd<'_>,
    to: &OsStr,
) -> Result<(), FsError> {
    let a = cstr(from)?;
    let b = cstr(to)?;
    // SAFETY: both strings are NUL-terminated and both fds are open for the call.
    check(unsafe {
        libc::renameat(
            from_dir.as_raw_fd(),
            a.as_ptr(),
            to_dir.as_raw_fd(),
            b.as_ptr(),
        )
    })
    .map_err(|source| FsError::Rename {
        from: from.to_owned(),
        to: to.to_owned(),
        source,
    })
}

/// `linkat(old_dir, old, new_dir, new, 0)`: a hard link; a final symlink is not followed.
pub fn linkat(
    old_dir: BorrowedFd<'_>,
    old: &OsStr,
    new_dir: BorrowedFd<'_>,
    new: &OsStr,
) -> Result<(), FsError> {
    let a = cstr(old)?;
    let b = cstr(new)?;
    // SAFETY: both strings are NUL-terminated and both fds are open for the call.
    check(unsafe {
        libc::linkat(
            old_dir.as_raw_fd(),
            a.as_ptr(),
            new_dir.as_raw_fd(),
            b.as_ptr(),
            0,
        )
    })
    .map_err(|source| FsError::Link {
        from: old.to_owned(),
        to: new.to_owned(),
        source,
    })
}

/// `symlinkat(target, dir, name)`.
pub fn symlinkat(target: &OsStr, dir: BorrowedFd<'_>, name: &OsStr) -> Result<(), FsError> {
    let t = cstr(target)?;
    let c = cstr(name)?;
    // SAFETY: both strings are NUL-terminated and `dir` is open for the call.
    check(unsafe { libc::symlinkat(t.as_ptr(), dir.as_raw_fd(), c.as_ptr()) }).map_err(|source| {
        FsError::Symlink {
            name: name.to_owned(),
            source,
        }
    })
}

/// `readlinkat(dir, name)`; with an empty `name`, `dir` must be an `O_PATH|O_NOFOLLOW` fd of the
/// link itself.
pub fn readlinkat(dir: BorrowedFd<'_>, name: &OsStr) -> Result<OsString, FsError> {
    let c = cstr(name)?;
    let mut buf = vec![0u8; libc::PATH_MAX as usize + 1];
    // SAFETY: `buf` is writable for `buf.len()` bytes, `c` is NUL-terminated, `dir` is open.
    let n = unsafe {
        libc::readlinkat(
            dir.as_raw_fd(),
            c.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    if n < 0 {
        return Err(FsError::Readlink {
            name: name.to_owned(),
            source: io::Error::last_os_error(),
        });
    }
    buf.truncate(n as usize);
    Ok(OsString::from_vec(buf))
}

/// Kind of a filesystem object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Regular file.
    File,
    /// Directory.
    Dir,
    /// Symbolic link.
    Symlink,
    /// Character or block device.
    Device,
    /// FIFO or socket.
    Other,
}

/// The parts of `struct stat` the agent uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileInfo {
    /// Object kind.
    pub kind: Kind,
    /// Permission bits (`st_mode & 0o7777`).
    pub mode: u32,
    /// Size in bytes.
    pub size: u64,
    /// Modification time, seconds since the epoch.
    pub mtime: i64,
    /// Device number.
    pub dev: u64,
    /// Inode number.
    pub ino: u64,
    /// Owner uid (as the caller's user namespace sees it).
    pub uid: u32,
    /// Owner gid (as the caller's user namespace sees it).
    pub gid: u32,
}

fn info(st: &libc::stat) -> FileInfo {
    let kind = match st.st_mode & libc::S_IFMT {
        libc::S_IFREG => Kind::File,
        libc::S_IFDIR => Kind::Dir,
        libc::S_IFLNK => Kind::Symlink,
        libc::S_IFCHR | libc::S_IFBLK => Kind::Device,
        _ => Kind::Other,
    };
    FileInfo {
        kind,
        mode: st.st_mode & 0o7777,
        size: st.st_size.max(0) as u64,
        mtime: st.st_mtime,
        dev: st.st_dev,
        ino: st.st_ino,
        uid: st.st_uid,
        gid: st.st_gid,
    }
}

/// `fstatat(dir, name, AT_SYMLINK_NOFOLLOW)`; with an empty `name`, stats `dir` itself
/// (`AT_EMPTY_PATH`, works on `O_PATH` fds).
pub fn fstatat_nofollow(dir: BorrowedFd<'_>, name: &OsStr) -> Result<FileInfo, FsError> {
    let c = cstr(name)?;
    let mut flags = libc::AT_SYMLINK_NOFOLLOW;
    if name.is_empty() {
        flags |= libc::AT_EMPTY_PATH;
    }
    // SAFETY: stat is plain data written by the kernel on success.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is NUL-terminated, `st` is writable and `dir` is open for the call.
    check(unsafe { libc::fstatat(dir.as_raw_fd(), c.as_ptr(), &mut st, flags) }).map_err(
        |source| FsError::Stat {
            name: name.to_owned(),
            source,
        },
    )?;
    Ok(info(&st))
}

/// One directory entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntry {
    /// Name (never `.` or `..`).
    pub name: OsString,
}

/// Lists the directory open at `dir` (any fd of a directory, including `O_PATH`), skipping `.`
/// and `..`. Stops with `truncated = true` after `limit` entries.
pub fn read_dir(dir: BorrowedFd<'_>, limit: usize) -> Result<(Vec<DirEntry>, bool), FsError> {
    // Re-open "." for reading: fdopendir needs a readable fd and takes ownership of it.
    let fd = openat2(
        dir,
        OsStr::new("."),
        libc::O_RDONLY | libc::O_DIRECTORY,
        0,
        Confine::Beneath,
    )
    .map_err(|e| match e {
        FsError::Open { source, .. } => FsError::ReadDir(source),
        other => other,
    })?;
    let raw = std::os::fd::IntoRawFd::into_raw_fd(fd);
    // SAFETY: `raw` is an open directory fd we own; on success fdopendir takes ownership.
    let dirp = unsafe { libc::fdopendir(raw) };
    if dirp.is_null() {
        let err = io::Error::last_os_error();
        // SAFETY: fdopendir failed, so we still own `raw` and close it exactly once.
        drop(unsafe { OwnedFd::from_raw_fd(raw) });
        return Err(FsError::ReadDir(err));
    }
    let mut out = Vec::new();
    let mut truncated = false;
    let result = loop {
        // SAFETY: errno is thread-local; resetting it distinguishes end-of-directory from error.
        unsafe { *libc::__errno_location() = 0 };
        // SAFETY: `dirp` is a valid DIR* until closedir below, used by this thread only.
        let ent = unsafe { libc::readdir64(dirp) };
        if ent.is_null() {
            let err = io::Error::last_os_error();
            break if err.raw_os_error().unwrap_or(0) == 0 {
                Ok(())
            } else {
                Err(err)
            };
        }
        // SAFETY: a non-null dirent64 from readdir64 is valid until the next readdir call on
        // `dirp`, and d_name is NUL-terminated; the name is copied out immediately.
        let name = unsafe { CStr::from_ptr((*ent).d_name.as_ptr()) }.to_bytes();
        if name == b"." || name == b".." {
            continue;
        }
        if out.len() >= limit {
            truncated = true;
            break Ok(());
        }
        out.push(DirEntry {
            name: OsString::from_vec(name.to_vec()),
        });
    };
    // SAFETY: `dirp` came from fdopendir and is closed exactly once (closing `raw` with it).
    unsafe { libc::closedir(dirp) };
    result.map_err(FsError::ReadDir)?;
    Ok((out, truncated))
}

/// An inotify instance (non-blocking, close-on-exec). Directories are watched by descriptor
/// (see [`Inotify::add_watch`]), so no path string is ever resolved for a watch.
#[derive(Debug)]
pub struct Inotify {
    fd: std::fs::File,
}

/// One inotify event (`struct inotify_event`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InotifyEvent {
    /// Watch descriptor (-1 with `IN_Q_OVERFLOW`).
    pub wd: i32,
    /// `IN_*` bits.
    pub mask: u32,
    /// Pairs an `IN_MOVED_FROM` with its `IN_MOVED_TO`.
    pub cookie: u32,
    /// Name of the entry inside the watched directory (empty for events on the directory itself).
    pub name: OsString,
}

/// Size of `struct inotify_event` without its name.
const INOTIFY_HEADER: usize = 16;

impl Inotify {
    /// `inotify_init1(IN_NONBLOCK | IN_CLOEXEC)`.
    pub fn new() -> Result<Inotify, FsError> {
        // SAFETY: plain system call without pointers.
        let rc = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        if rc < 0 {
            return Err(FsError::Inotify {
                op: "init",
                source: io::Error::last_os_error(),
            });
        }
        // SAFETY: inotify_init1 returned a new fd that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(rc) };
        Ok(Inotify {
            fd: std::fs::File::from(fd),
        })
    }

    /// Watches the directory open at `dir` (any fd of it, `O_PATH` too) with `mask` (`IN_*`
    /// event bits; `IN_ONLYDIR` is added). The kernel resolves `/proc/self/fd/<dir>` to the
    /// object the descriptor holds, so whatever happened to the path since it was opened, the
    /// watch lands on that directory. (`IN_DONT_FOLLOW` must not be passed: it would stop at the
    /// magic link itself.) Returns the watch descriptor, the same one for a directory that is
    /// watched already.
    pub fn add_watch(&self, dir: BorrowedFd<'_>, mask: u32) -> Result<i32, FsError> {
        let path = CString::new(format!("/proc/self/fd/{}", dir.as_raw_fd()))
            .expect("invariant: a formatted number has no NUL");
        // SAFETY: `path` is NUL-terminated, `self.fd` is an inotify fd we own and `dir` stays
        // open for the call.
        let rc = unsafe {
            libc::inotify_add_watch(
                self.fd.as_raw_fd(),
                path.as_ptr(),
                (mask | libc::IN_ONLYDIR) & !libc::IN_DONT_FOLLOW,
            )
        };
        if rc < 0 {
            return Err(FsError::Inotify {
                op: "add watch",
                source: io::Error::last_os_error(),
            });
        }
        Ok(rc)
    }

    /// `inotify_rm_watch`. The kernel queues an `IN_IGNORED` event for `wd`.
    pub fn rm_watch(&self, wd: i32) -> Result<(), FsError> {
        // SAFETY: plain system call on an inotify fd we own.
        check(unsafe { libc::inotify_rm_watch(self.fd.as_raw_fd(), wd) }).map_err(|source| {
            FsError::Inotify {
                op: "remove watch",
                source,
            }
        })
    }

    /// Reads the queued events (none when nothing is queued: the fd is non-blocking); `buf`
    /// bounds one read (at least 4 KiB, so that any one event fits).
    pub fn read(&self, buf: &mut [u8]) -> io::Result<Vec<InotifyEvent>> {
        use std::io::Read;
        match (&self.fd).read(buf) {
            Ok(n) => Ok(parse_inotify(&buf[..n])),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(Vec::new()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(Vec::new()),
            Err(e) => Err(e),
        }
    }

    /// The instance's fd, for polling.
    pub fn as_fd(&self) -> BorrowedFd<'_> {
        std::os::fd::AsFd::as_fd(&self.fd)
    }
}

/// Splits what one `read` of an inotify fd returned into events (a truncated tail is dropped).
pub fn parse_inotify(mut buf: &[u8]) -> Vec<InotifyEvent> {
    let mut out = Vec::new();
    let word = |b: &[u8], at: usize| -> [u8; 4] {
        let mut w = [0u8; 4];
        w.copy_from_slice(&b[at..at + 4]);
        w
    };
    while buf.len() >= INOTIFY_HEADER {
        let len = u32::from_ne_bytes(word(buf, 12)) as usize;
        let Some(name) = buf.get(INOTIFY_HEADER..INOTIFY_HEADER + len) else {
            break;
        };
        // The name is NUL-padded to an alignment boundary.
        let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
        out.push(InotifyEvent {
            wd: i32::from_ne_bytes(word(buf, 0)),
            mask: u32::from_ne_bytes(word(buf, 4)),
            cookie: u32::from_ne_bytes(word(buf, 8)),
            name: OsString::from_vec(name[..end].to_vec()),
        });
        buf = &buf[INOTIFY_HEADER + len..];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn inotify_watches_by_descriptor() {
        let tmp = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir(tmp.path().join("d")).expect("mkdir");
        let root = open_root(tmp.path()).expect("root");
        let d = openat2(
            root.as_fd(),
            OsStr::new("d"),
            libc::O_PATH | libc::O_DIRECTORY,
            0,
            Confine::Beneath,
        )
        .expect("open d");
        let ino = Inotify::new().expect("inotify");
        let wd = ino
            .add_watch(d.as_fd(), libc::IN_CREATE | libc::IN_DONT_FOLLOW)
            .expect("watch");
        // The path now names something else: the watch stays on the directory.
        std::fs::rename(tmp.path().join("d"), tmp.path().join("e")).expect("rename");
        std::fs::write(tmp.path().join("e/f"), b"x").expect("write");
        let mut buf = vec![0u8; 4096];
        let evs = ino.read(&mut buf).expect("read");
        assert_eq!(evs.len(), 1, "{evs:?}");
        assert_eq!(evs[0].wd, wd);
        assert_eq!(evs[0].name, OsString::from("f"));
        assert_ne!(evs[0].mask & libc::IN_CREATE, 0);
        assert!(ino.read(&mut buf).expect("read").is_empty());
        ino.rm_watch(wd).expect("rm");
        // A file is refused (IN_ONLYDIR).
        let f = openat2(
            root.as_fd(),
            OsStr::new("e/f"),
            libc::O_PATH,
            0,
            Confine::Beneath,
        )
        .expect("open f");
        let e = ino.add_watch(f.as_fd(), libc::IN_CREATE).expect_err("file");
        assert_eq!(e.raw_os_error(), Some(libc::ENOTDIR));
        // A truncated record is dropped, not misread.
        assert!(parse_inotify(&[0u8; 15]).is_empty());
        let mut rec = vec![0u8; 16];
        rec[12] = 8;
        assert!(parse_inotify(&rec).is_empty());
    }

    #[test]
    fn in_root_confines_symlinks_and_dotdot() {
        let tmp = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir(tmp.path().join("d")).expect("mkdir");
        std::os::unix::fs::symlink("../../../../..", tmp.path().join("d/up")).expect("symlink");
        std::fs::write(tmp.path().join("f"), b"x").expect("write");
        let root = open_root(tmp.path()).expect("root");
        let open = |path: &str, confine| {
            openat2(root.as_fd(), OsStr::new(path), libc::O_RDONLY, 0, confine)
        };
        // "d/up/f" climbs to the root of the tmp dir, not the host root.
        let fd = open("d/up/f", Confine::InRoot).expect("resolves inside root");
        assert_eq!(
            fstatat_nofollow(fd.as_fd(), OsStr::new(""))
                .expect("stat")
                .size,
            1
        );
        let e = open("../etc/passwd", Confine::Beneath).expect_err("beneath refuses ..");
        assert_eq!(e.raw_os_error(), Some(libc::EXDEV));
        let (entries, truncated) = read_dir(root.as_fd(), 10).expect("read_dir");
        assert!(!truncated);
        let mut names: Vec<_> = entries.into_iter().map(|e| e.name).collect();
        names.sort();
        assert_eq!(names, vec![OsString::from("d"), OsString::from("f")]);
    }
}
