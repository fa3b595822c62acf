//! File operations confined to the sandbox root.
//!
//! Every path is first cleaned lexically (`.` dropped, `..` popped; climbing above the root is a
//! [`FileError::Escape`]) and then resolved by the kernel with `openat2(RESOLVE_IN_ROOT |
//! RESOLVE_NO_MAGICLINKS)` relative to an fd of the root, so symlinks inside the sandbox can
//! never lead outside it. Mutations work on a parent directory fd plus one final name with the
//! `*at` calls, never following a final symlink.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use dsec_api::agent::{FileKind, FileStat};
use dsec_api::ErrorCode;
use dsec_sys::fs::{self as sfs, Confine, FileInfo, FsError, Kind};

/// Longest path accepted.
const MAX_PATH: usize = 4096;
/// Most entries a listing returns.
pub const MAX_LIST: usize = 10_000;
/// Deepest directory tree `Remove`/`TarDownload` walk.
pub const MAX_DEPTH: usize = 256;
/// Default bound of a file read.
pub const DEFAULT_READ_MAX: u64 = 64 << 20;
/// Most bytes of the sandbox's `/etc/passwd` or `/etc/group` read for owner names.
const MAX_NAME_DB: u64 = 1 << 20;

/// Errors of file operations.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// The path is malformed.
    #[error("invalid path {path:?}: {reason}")]
    BadPath {
        /// The path.
        path: String,
        /// Why.
        reason: &'static str,
    },
    /// The path climbs above the root.
    #[error("path {path:?} escapes the sandbox root")]
    Escape {
        /// The path.
        path: String,
    },
    /// A confined system call failed.
    #[error("{op} {path:?}")]
    Sys {
        /// The operation.
        op: &'static str,
        /// The path.
        path: String,
        /// Cause.
        #[source]
        source: FsError,
    },
    /// Reading or writing file content failed.
    #[error("{op} {path:?}")]
    Io {
        /// The operation.
        op: &'static str,
        /// The path.
        path: String,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// The object is not of the kind the operation needs.
    #[error("{path:?} is not {expected}")]
    WrongType {
        /// The path.
        path: String,
        /// What was needed.
        expected: &'static str,
    },
    /// A bound was exceeded.
    #[error("{what} exceeds the limit of {limit}")]
    TooLarge {
        /// What.
        what: &'static str,
        /// The bound.
        limit: u64,
    },
    /// Renaming failed.
    #[error("rename {from:?} to {to:?}")]
    Rename {
        /// The path moved.
        from: String,
        /// Where to.
        to: String,
        /// Cause.
        #[source]
        source: FsError,
    },
}

/// Maps an errno to a wire code (one place for the whole agent).
pub fn errno_code(errno: Option<i32>) -> ErrorCode {
    match errno {
        Some(libc::ENOENT) => ErrorCode::NotFound,
        Some(libc::EACCES | libc::EPERM | libc::EROFS) => ErrorCode::PermissionDenied,
        Some(libc::ENOSPC | libc::EDQUOT) => ErrorCode::NoSpace,
        Some(libc::EXDEV | libc::ELOOP) => ErrorCode::PathEscape,
        Some(libc::ENOTDIR | libc::EISDIR | libc::ENOTEMPTY) => ErrorCode::WrongFileType,
        Some(libc::EFBIG) => ErrorCode::TooLarge,
        Some(libc::EEXIST | libc::ENAMETOOLONG | libc::EINVAL) => ErrorCode::InvalidRequest,
        _ => ErrorCode::Internal,
    }
}

impl FileError {
    /// The wire code.
    pub fn code(&self) -> ErrorCode {
        match self {
            FileError::BadPath { .. } => ErrorCode::InvalidRequest,
            FileError::Escape { .. } => ErrorCode::PathEscape,
            FileError::Sys { source, .. } => errno_code(source.raw_os_error()),
            FileError::Io { source, .. } => errno_code(source.raw_os_error()),
            FileError::WrongType { .. } => ErrorCode::WrongFileType,
            FileError::TooLarge { .. } => ErrorCode::TooLarge,
            // EXDEV from renameat itself is a move across file systems, not an escape (the
            // parents were resolved already).
            FileError::Rename { source, .. } if source.raw_os_error() == Some(libc::EXDEV) => {
                ErrorCode::InvalidRequest
            }
            FileError::Rename { source, .. } => errno_code(source.raw_os_error()),
        }
    }
}

/// Lexically cleans `path` into components below the root.
pub fn clean(path: &str) -> Result<Vec<&str>, FileError> {
    if path.len() > MAX_PATH {
        return Err(FileError::BadPath {
            path: path.chars().take(64).collect(),
            reason: "too long",
        });
    }
    if path.contains('\0') {
        return Err(FileError::BadPath {
            path: path.replace('\0', "\\0"),
            reason: "contains NUL",
        });
    }
    let mut out = Vec::new();
    for c in path.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                if out.pop().is_none() {
                    return Err(FileError::Escape {
                        path: path.to_owned(),
                    });
                }
            }
            c => out.push(c),
        }
    }
    Ok(out)
}

fn join(comps: &[&str]) -> OsString {
    if comps.is_empty() {
        OsString::from(".")
    } else {
        OsString::from(comps.join("/"))
    }
}

/// A directory that paths are resolved in.
#[derive(Debug)]
pub struct Root {
    fd: OwnedFd,
    confine: Confine,
    /// Owner names from the sandbox's user databases (dropped with the root on a reset).
    names: Mutex<NameCache>,
}

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

impl Root {
    /// The sandbox root at `path` (`/` in production), with `RESOLVE_IN_ROOT`.
    pub fn open(path: &std::path::Path) -> Result<Root, FileError> {
        let fd = sfs::open_root(path).map_err(|source| FileError::Sys {
            op: "open root",
            path: path.display().to_string(),
            source,
        })?;
        Ok(Root {
            fd,
            confine: Confine::InRoot,
            names: Mutex::default(),
        })
    }

    /// A root at an already-open directory, with `RESOLVE_BENEATH` (tar unpacking).
    pub fn beneath(fd: OwnedFd) -> Root {
        Root {
            fd,
            confine: Confine::Beneath,
            names: Mutex::default(),
        }
    }

    fn sys<'a>(op: &'static str, path: &'a str) -> impl FnOnce(FsError) -> FileError + 'a {
        move |source| FileError::Sys {
            op,
            path: path.to_owned(),
            source,
        }
    }

    /// Opens the cleaned `path` with `flags`.
    pub fn open_at(&self, path: &str, flags: i32, mode: u32) -> Result<OwnedFd, FileError> {
        let comps = clean(path)?;
        sfs::openat2(self.fd.as_fd(), &join(&comps), flags, mode, self.confine)
            .map_err(Self::sys("open", path))
    }

    /// Opens a directory (`libc::O_PATH`), e.g. for a cwd.
    pub fn open_dir(&self, path: &str) -> Result<OwnedFd, FileError> {
        let fd = self.open_at(path, libc::O_PATH | libc::O_DIRECTORY, 0)?;
        Ok(fd)
    }

    /// The parent directory fd and final name of `path` (which must not be the root).
    pub fn parent(&self, path: &str) -> Result<(OwnedFd, OsString), FileError> {
        let comps = clean(path)?;
        let Some((name, dir)) = comps.split_last() else {
            return Err(FileError::BadPath {
                path: path.to_owned(),
                reason: "is the root",
            });
        };
        let fd = sfs::openat2(
            self.fd.as_fd(),
            &join(dir),
            libc::O_PATH | libc::O_DIRECTORY,
            0,
            self.confine,
        )
        .map_err(Self::sys("open parent of", path))?;
        Ok((fd, OsString::from(*name)))
    }

    /// Creates `path` and its missing parents (succeeds when it already is a directory).
    pub fn mkdir_p(&self, path: &str, mode: u32) -> Result<OwnedFd, FileError> {
        let comps = clean(path)?;
        for i in 1..=comps.len() {
            let prefix = join(&comps[..i]);
            match sfs::openat2(
                self.fd.as_fd(),
                &prefix,
                libc::O_PATH | libc::O_DIRECTORY,
                0,
                self.confine,
            ) {
                Ok(_) => continue,
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                    let parent = sfs::openat2(
                        self.fd.as_fd(),
                        &join(&comps[..i - 1]),
                        libc::O_PATH | libc::O_DIRECTORY,
                        0,
                        self.confine,
                    )
                    .map_err(Self::sys("mkdir", path))?;
                    match sfs::mkdirat(parent.as_fd(), OsStr::new(comps[i - 1]), mode) {
                        Ok(()) => {}
                        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
                        Err(e) => return Err(Self::sys("mkdir", path)(e)),
                    }
                }
                Err(e) => return Err(Self::sys("mkdir", path)(e)),
            }
        }
        self.open_dir(path)
    }

    /// Stat without following a final symlink.
    pub fn stat(&self, path: &str) -> Result<FileStat, FileError> {
        let fd = self.open_at(path, libc::O_PATH | libc::O_NOFOLLOW, 0)?;
        let info =
            sfs::fstatat_nofollow(fd.as_fd(), OsStr::new("")).map_err(Self::sys("stat", path))?;
        let link_target = if info.kind == Kind::Symlink {
            let t =
                sfs::readlinkat(fd.as_fd(), OsStr::new("")).map_err(Self::sys("readlink", path))?;
            Some(t.to_string_lossy().into_owned())
        } else {
            None
        };
        Ok(wire_stat(
            path.to_owned(),
            &info,
            link_target,
            &self.owner_names(),
        ))
    }

    /// Lists a directory, sorted by name.
    pub fn list(&self, path: &str) -> Result<Vec<FileStat>, FileError> {
        let dir = self.open_at(path, libc::O_PATH | libc::O_DIRECTORY, 0)?;
        let (entries, truncated) =
            sfs::read_dir(dir.as_fd(), MAX_LIST).map_err(Self::sys("list", path))?;
        if truncated {
            return Err(FileError::TooLarge {
                what: "directory listing",
                limit: MAX_LIST as u64,
            });
        }
        let names = self.owner_names();
        let mut out = Vec::with_capacity(entries.len());
        for e in entries {
            let Ok(info) = sfs::fstatat_nofollow(dir.as_fd(), &e.name) else {
                continue; // raced with a removal
            };
            let link_target = if info.kind == Kind::Symlink {
                sfs::readlinkat(dir.as_fd(), &e.name)
                    .ok()
                    .map(|t| t.to_string_lossy().into_owned())
            } else {
                None
            };
            out.push(wire_stat(
                e.name.to_string_lossy().into_owned(),
                &info,
                link_target,
                &names,
            ));
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Opens a regular file for reading.
    pub fn open_read(&self, path: &str) -> Result<(File, u64), FileError> {
        let fd = self.open_at(path, libc::O_RDONLY | libc::O_NONBLOCK, 0)?;
        let info =
            sfs::fstatat_nofollow(fd.as_fd(), OsStr::new("")).map_err(Self::sys("stat", path))?;
        if info.kind != Kind::File {
            return Err(FileError::WrongType {
                path: path.to_owned(),
                expected: "a regular file",
            });
        }
        Ok((File::from(fd), info.size))
    }

    /// Atomically writes `data` to `path` (temp file in the same directory + rename).
    pub fn write_atomic(
        &self,
        path: &str,
        data: &[u8],
        mode: u32,
        parents: bool,
    ) -> Result<(), FileError> {
        if parents {
            let comps = clean(path)?;
            if comps.len() > 1 {
                self.mkdir_p(&comps[..comps.len() - 1].join("/"), 0o755)?;
            }
        }
        let (dir, name) = self.parent(path)?;
        write_in(dir.as_fd(), &name, data, mode).map_err(|e| match e {
            WriteErr::Sys(source) => FileError::Sys {
                op: "write",
                path: path.to_owned(),
                source,
            },
            WriteErr::Io(source) => FileError::Io {
                op: "write",
                path: path.to_owned(),
                source,
            },
        })
    }

    /// Creates one directory (or the whole chain with `parents`).
    pub fn mkdir(&self, path: &str, parents: bool, mode: u32) -> Result<(), FileError> {
        if parents {
            return self.mkdir_p(path, mode).map(drop);
        }
        let (dir, name) = self.parent(path)?;
        sfs::mkdirat(dir.as_fd(), &name, mode).map_err(Self::sys("mkdir", path))
    }

    /// Moves `from` to `to` (replacing an existing file there); both parents are resolved
    /// inside the root, neither final name is followed.
    pub fn rename(&self, from: &str, to: &str) -> Result<(), FileError> {
        let (from_dir, from_name) = self.parent(from)?;
        let (to_dir, to_name) = self.parent(to)?;
        sfs::renameat_between(from_dir.as_fd(), &from_name, to_dir.as_fd(), &to_name).map_err(
            |source| FileError::Rename {
                from: from.to_owned(),
                to: to.to_owned(),
                source,
            },
        )
    }

    /// The sandbox's user and group names: its `/etc/passwd` and `/etc/group`, read through
    /// this root (never the host's) and parsed again only when one of them changed (inode,
    /// size or mtime), so a listing costs two opens and two stats, not a read per entry.
    pub fn owner_names(&self) -> OwnerNames {
        let mut cache = match self.names.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        let users = self.name_table("/etc/passwd", 7, &mut cache.passwd);
        let groups = self.name_table("/etc/group", 4, &mut cache.group);
        OwnerNames { users, groups }
    }

    /// The id → name table of the database at `path` (lines of at least `fields` fields:
    /// `name:x:id:…`), from `slot` while the file is unchanged; empty when it is missing or not
    /// a regular file.
    fn name_table(
        &self,
        path: &str,
        fields: usize,
        slot: &mut Option<NameTable>,
    ) -> Arc<HashMap<u32, String>> {
        let opened = self.open_at(path, libc::O_RDONLY | libc::O_NONBLOCK | libc::O_NOCTTY, 0);
        let Ok(fd) = opened else {
            *slot = None;
            return Arc::default();
        };
        let info = match sfs::fstatat_nofollow(fd.as_fd(), OsStr::new("")) {
            Ok(i) if i.kind == Kind::File => i,
            _ => {
                *slot = None;
                return Arc::default();
            }
        };
        let key = (info.dev, info.ino, info.size, info.mtime);
        if let Some(t) = slot.as_ref().filter(|t| t.key == key) {
            return Arc::clone(&t.names);
        }
        let mut data = Vec::new();
        if File::from(fd)
            .take(MAX_NAME_DB)
            .read_to_end(&mut data)
            .is_err()
        {
            *slot = None;
            return Arc::default();
        }
        if data.len() as u64 >= MAX_NAME_DB {
            // Cut at the bound: the last line may be partial.
            let end = data.iter().rposition(|&b| b == b'\n').unwrap_or(0);
            data.truncate(end);
        }
        let names = Arc::new(parse_names(&data, fields));
        *slot = Some(NameTable {
            key,
            names: Arc::clone(&names),
        });
        names
    }

    /// Removes a file, symlink or (with `recursive`) a directory tree. Never follows symlinks.
    pub fn remove(&self, path: &str, recursive: bool) -> Result<(), FileError> {
        let (dir, name) = self.parent(path)?;
        let info = sfs::fstatat_nofollow(dir.as_fd(), &name).map_err(Self::sys("remove", path))?;
        if info.kind == Kind::Dir {
            if recursive {
                let sub = sfs::openat2(
                    dir.as_fd(),
                    &name,
                    libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW,
                    0,
                    Confine::BeneathNoSymlinks,
                )
                .map_err(Self::sys("remove", path))?;
                remove_tree(sub.as_fd(), 0).map_err(Self::sys("remove", path))?;
            }
            sfs::unlinkat(dir.as_fd(), &name, true).map_err(Self::sys("remove", path))
        } else {
            sfs::unlinkat(dir.as_fd(), &name, false).map_err(Self::sys("remove", path))
        }
    }
}

/// Cached id → name table of one user database.
#[derive(Debug)]
struct NameTable {
    /// Device, inode, size and mtime of the file it was parsed from.
    key: (u64, u64, u64, i64),
    names: Arc<HashMap<u32, String>>,
}

/// The cached tables of `/etc/passwd` and `/etc/group`.
#[derive(Debug, Default)]
struct NameCache {
    passwd: Option<NameTable>,
    group: Option<NameTable>,
}

/// The sandbox's user and group names by id (a snapshot of [`Root::owner_names`]).
#[derive(Debug, Clone, Default)]
pub struct OwnerNames {
    users: Arc<HashMap<u32, String>>,
    groups: Arc<HashMap<u32, String>>,
}

impl OwnerNames {
    /// Name of `uid`, when the sandbox has one.
    pub fn user(&self, uid: u32) -> Option<String> {
        self.users.get(&uid).cloned()
    }

    /// Name of `gid`, when the sandbox has one.
    pub fn group(&self, gid: u32) -> Option<String> {
        self.groups.get(&gid).cloned()
    }
}

/// Longest user or group name taken from a database.
const MAX_NAME: usize = 256;

/// The well-formed lines of a user database (`/etc/passwd`: 7 fields, `/etc/group`: 4), as
/// fields: comments and NIS lines (`#`, `+`, `-`), short lines, empty, long or control-laden
/// names and non-numeric ids (the third field) are skipped.
pub(crate) fn db_lines(db: &str, fields: usize) -> impl Iterator<Item = Vec<&str>> {
    db.lines().filter_map(move |l| {
        let l = l.strip_suffix('\r').unwrap_or(l);
        if l.starts_with(['#', '+', '-']) {
            return None;
        }
        let f: Vec<&str> = l.splitn(fields, ':').collect();
        let name = *f.first()?;
        let ok = f.len() == fields
            && !name.is_empty()
            && name.len() <= MAX_NAME
            && !name.chars().any(char::is_control)
            && f[2].parse::<u32>().is_ok();
        ok.then_some(f)
    })
}

/// Parses `name:x:id:…` lines (at least `fields` fields) of a user or group database into
/// id → name, skipping whatever is malformed: non-UTF-8, comments, NIS `+`/`-` entries, empty or
/// overlong names, ids that are not numbers. The first entry of an id wins (as `getpwuid`).
fn parse_names(data: &[u8], fields: usize) -> HashMap<u32, String> {
    // Lines that are not UTF-8 are skipped whole.
    let text: String = data
        .split(|&b| b == b'\n')
        .filter_map(|l| std::str::from_utf8(l).ok())
        .flat_map(|l| [l, "\n"])
        .collect();
    let mut out = HashMap::new();
    for f in db_lines(&text, fields) {
        if let Ok(id) = f[2].parse::<u32>() {
            out.entry(id).or_insert_with(|| f[0].to_owned());
        }
    }
    out
}

/// Failure of [`write_in`].
pub enum WriteErr {
    /// A confined call failed.
    Sys(FsError),
    /// Writing content failed.
    Io(io::Error),
}

/// Writes `data` to `name` in `dir` via a temp file + rename; `mode` bypasses the umask.
pub fn write_in(dir: BorrowedFd<'_>, name: &OsStr, data: &[u8], mode: u32) -> Result<(), WriteErr> {
    let n = TMP_COUNTER.fetch_add(1, Ordering::Relaxed);
    let short: String = name.to_string_lossy().chars().take(100).collect();
    let tmp = OsString::from(format!(".{short}.dsec-tmp-{}-{n}", std::process::id()));
    let fd = sfs::openat2(
        dir,
        &tmp,
        libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW,
        0o600,
        Confine::BeneathNoSymlinks,
    )
    .map_err(WriteErr::Sys)?;
    let mut f = File::from(fd);
    let res = f
        .write_all(data)
        .and_then(|()| f.set_permissions(std::fs::Permissions::from_mode(mode & 0o7777)))
        .map_err(WriteErr::Io)
        .and_then(|()| sfs::renameat(dir, &tmp, name).map_err(WriteErr::Sys));
    if res.is_err() {
        let _ = sfs::unlinkat(dir, &tmp, false);
    }
    res
}

fn remove_tree(dir: BorrowedFd<'_>, depth: usize) -> Result<(), FsError> {
    if depth > MAX_DEPTH {
        return Err(FsError::ReadDir(io::Error::from_raw_os_error(libc::ELOOP)));
    }
    loop {
        let (entries, _) = sfs::read_dir(dir, MAX_LIST)?;
        if entries.is_empty() {
            return Ok(());
        }
        for e in entries {
            let info = match sfs::fstatat_nofollow(dir, &e.name) {
                Ok(i) => i,
                Err(err) if err.raw_os_error() == Some(libc::ENOENT) => continue,
                Err(err) => return Err(err),
            };
            if info.kind == Kind::Dir {
                let sub = sfs::openat2(
                    dir,
                    &e.name,
                    libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW,
                    0,
                    Confine::BeneathNoSymlinks,
                )?;
                remove_tree(sub.as_fd(), depth + 1)?;
                sfs::unlinkat(dir, &e.name, true)?;
            } else {
                sfs::unlinkat(dir, &e.name, false)?;
            }
        }
    }
}

/// Wire form of a stat, with the owner's names from `names`.
pub fn wire_stat(
    name: String,
    info: &FileInfo,
    link_target: Option<String>,
    names: &OwnerNames,
) -> FileStat {
    FileStat {
        name,
        kind: match info.kind {
            Kind::File => FileKind::File,
            Kind::Dir => FileKind::Dir,
            Kind::Symlink => FileKind::Symlink,
            Kind::Device | Kind::Other => FileKind::Other,
        },
        size: info.size,
        mode: info.mode,
        mtime: info.mtime,
        link_target,
        uid: info.uid,
        gid: info.gid,
        owner: names.user(info.uid),
        group: names.group(info.gid),
    }
}

/// Reads up to `max` bytes of `path`, calling `chunk(bytes, eof)` per piece of at most
/// `chunk_size` bytes; the last call has `eof = true`.
pub fn read_chunks(
    root: &Root,
    path: &str,
    max: Option<u64>,
    chunk_size: usize,
    chunk: &mut dyn FnMut(&[u8], bool),
) -> Result<(), FileError> {
    let (file, size) = root.open_read(path)?;
    let bound = match max {
        Some(m) => m,
        None if size > DEFAULT_READ_MAX => {
            return Err(FileError::TooLarge {
                what: "file size",
                limit: DEFAULT_READ_MAX,
            });
        }
        None => DEFAULT_READ_MAX,
    };
    let mut reader = file.take(bound);
    let mut buf = Vec::with_capacity(chunk_size);
    let mut pending: Option<Vec<u8>> = None;
    loop {
        buf.clear();
        (&mut reader)
            .take(chunk_size as u64)
            .read_to_end(&mut buf)
            .map_err(|source| FileError::Io {
                op: "read",
                path: path.to_owned(),
                source,
            })?;
        let filled = buf.len();
        if let Some(p) = pending.take() {
            if filled == 0 {
                chunk(&p, true);
                return Ok(());
            }
            chunk(&p, false);
        }
        if filled < chunk_size {
            chunk(&buf, true);
            return Ok(());
        }
        pending = Some(buf.clone());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clean_rejects_escapes() {
        assert!(matches!(clean("/../etc"), Err(FileError::Escape { .. })));
        assert!(matches!(clean("a/../../b"), Err(FileError::Escape { .. })));
        assert_eq!(clean("/a/./b/../c").expect("ok"), vec!["a", "c"]);
        assert!(clean("/").expect("ok").is_empty());
        assert!(clean("a\0b").is_err());
    }

    #[test]
    fn user_databases_parse_defensively() {
        let db = b"root:x:0:0:root:/root:/bin/bash\nbad\n#c:x:5:5::/:/bin/sh\n+nis:x:6:6::/:/x\n\
            user:x:1000:1000::/home/user:/bin/sh\r\n:x:7:7::/:/bin/sh\nn:x:NaN:1::/:/bin/sh\n\
            dup:x:1000:1000::/:/bin/sh\n\xff:x:8:8::/:/bin/sh\nshort:x:9:9";
        let m = parse_names(db, 7);
        let mut v: Vec<_> = m.iter().map(|(k, v)| (*k, v.as_str())).collect();
        v.sort();
        assert_eq!(v, vec![(0, "root"), (1000, "user")]);
        let g = parse_names(b"sudo:x:27:user,other\nbroken\nusers:x:100:\n", 4);
        assert_eq!(g.get(&27).map(String::as_str), Some("sudo"));
        assert_eq!(g.get(&100).map(String::as_str), Some("users"));
        assert_eq!(g.len(), 2);
    }

    #[test]
    fn owner_names_are_cached_until_the_database_changes() {
        let tmp = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir(tmp.path().join("etc")).expect("mkdir");
        let passwd = tmp.path().join("etc/passwd");
        std::fs::write(&passwd, "user:x:1000:1000::/home/user:/bin/sh\n").expect("write");
        let root = Root::open(tmp.path()).expect("root");
        let a = root.owner_names();
        let b = root.owner_names();
        assert!(Arc::ptr_eq(&a.users, &b.users), "parsed once");
        assert_eq!(a.user(1000).as_deref(), Some("user"));
        assert_eq!(a.group(1000), None);
        // A new file (new inode) is parsed again.
        let next = tmp.path().join("etc/passwd.new");
        std::fs::write(&next, "other:x:1000:1000::/:/bin/sh\n").expect("write");
        std::fs::rename(&next, &passwd).expect("rename");
        let c = root.owner_names();
        assert_eq!(c.user(1000).as_deref(), Some("other"));
        // A database past the bound is read up to it, its cut line dropped.
        let mut big = "x".repeat(MAX_NAME_DB as usize - 10);
        big.push_str("\nlast:x:1:1::/:/bin/sh\n");
        std::fs::write(tmp.path().join("etc/group"), big).expect("write");
        assert_eq!(root.owner_names().group(1), None);
        std::fs::remove_file(&passwd).expect("rm");
        assert_eq!(root.owner_names().user(1000), None);
    }

    #[test]
    fn read_chunks_marks_the_last_piece() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let root = Root::open(tmp.path()).expect("root");
        for (len, want) in [
            (0, vec![(0, true)]),
            (3, vec![(3, true)]),
            (8, vec![(4, false), (4, true)]),
            (9, vec![(4, false), (4, false), (1, true)]),
        ] {
            std::fs::write(tmp.path().join("f"), vec![7u8; len]).expect("write");
            let mut got = Vec::new();
            read_chunks(&root, "/f", None, 4, &mut |b, eof| got.push((b.len(), eof)))
                .expect("read");
            assert_eq!(got, want, "{len} bytes");
        }
    }
}
