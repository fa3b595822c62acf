//! Copying an overlayfs layer onto another: a sandbox's upper layer into a snapshot layer, and
//! a chain of snapshot layers into one (flattening).
//!
//! The source may be a tree the sandbox controls and is changing while it is read, so it is
//! walked by descriptors only: every entry is opened relative to its directory's descriptor
//! with `O_NOFOLLOW`, checked again after the open, and a symbolic link is only ever read,
//! never followed. No path of the source is resolved by name from the node's root, so a link
//! or a rename inside the sandbox cannot point the copy at a host file. The destination is
//! the node's own directory and is written by path.
//!
//! [`apply`] puts the source on top of what the destination holds, with overlay semantics: a
//! whiteout removes the entry below it (and stays, to hide the template's); an opaque
//! directory replaces the directory below it; any other directory merges. Onto an empty
//! destination that is a plain copy.

use std::collections::HashMap;
use std::ffi::CStr;
use std::fs;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Mode, OFlags, Timestamps};

/// How deep a layer's directories may nest.
pub const MAX_DEPTH: usize = 256;

/// Ids the source's files carry, mapped to the ids a layer stores: the sandbox's view, so
/// that any sandbox can mount the layer idmapped into its own namespace.
#[derive(Debug, Clone, Copy, Default)]
pub struct IdShift {
    /// Host uid of the source's root (0: no shift).
    pub uid: u32,
    /// Host gid of the source's root.
    pub gid: u32,
}

/// The ids a namespace maps (`dsec_sys::idrange`: 65,536 from its root's).
const MAPPED: u32 = 65_536;
/// What an id outside the mapped range becomes.
const OVERFLOW: u32 = 65_534;

impl IdShift {
    fn uid(&self, host: u32) -> u32 {
        shift(host, self.uid)
    }

    fn gid(&self, host: u32) -> u32 {
        shift(host, self.gid)
    }
}

fn shift(host: u32, base: u32) -> u32 {
    match host.checked_sub(base) {
        Some(id) if id < MAPPED => id,
        _ => OVERFLOW,
    }
}

/// What a copy wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Copied {
    /// Bytes of regular files.
    pub bytes: u64,
    /// Entries (files, directories, links, whiteouts).
    pub entries: u64,
}

/// A copy failed.
#[derive(Debug, thiserror::Error)]
#[error("{op} {}: {source}", path.display())]
pub struct CopyError {
    /// What was done.
    pub op: &'static str,
    /// The destination path it was done for.
    pub path: PathBuf,
    /// Why it failed.
    #[source]
    pub source: io::Error,
}

fn err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> CopyError + 'a {
    move |source| CopyError {
        op,
        path: path.to_owned(),
        source,
    }
}

fn rerr<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(rustix::io::Errno) -> CopyError + 'a {
    move |e| CopyError {
        op,
        path: path.to_owned(),
        source: e.into(),
    }
}

/// Puts the layer under the directory `src` on top of the directory `dest` (which exists),
/// with overlay semantics (see the module), its ids shifted by `ids`; setuid and setgid bits
/// are dropped, as an import drops them. The root directory's owner and mode go to `dest`.
pub fn apply(src: BorrowedFd<'_>, dest: &Path, ids: IdShift) -> Result<Copied, CopyError> {
    apply_over(src, dest, ids, None)
}

/// [`apply`], keeping a whiteout only where `below` (given the path inside the layer) says
/// the layers under the result hold something to hide. A flattened layer sits right above its
/// template: a whiteout of what only the merged layers held would show as an entry of its
/// directory wherever the template has no such directory (overlayfs filters whiteouts out of
/// merged directories only).
pub fn apply_over(
    src: BorrowedFd<'_>,
    dest: &Path,
    ids: IdShift,
    below: Option<&dyn Fn(&Path) -> bool>,
) -> Result<Copied, CopyError> {
    let root = open_dir(src, c".").map_err(rerr("open", dest))?;
    let mut c = Copier {
        ids,
        links: HashMap::new(),
        done: Copied::default(),
        root: dest.to_owned(),
        below,
    };
    let fresh = fs::read_dir(dest)
        .map_err(err("read", dest))?
        .next()
        .is_none();
    c.dir(root.as_fd(), dest, 0, fresh)?;
    let st = rustix::fs::fstat(&root).map_err(rerr("stat", dest))?;
    c.meta(dest, &st, false)?;
    Ok(c.done)
}

struct Copier<'a> {
    ids: IdShift,
    /// The destination's root.
    root: PathBuf,
    /// Whether the layers below hold a path (see [`apply_over`]).
    below: Option<&'a dyn Fn(&Path) -> bool>,
    /// Hard links already copied: (device, inode) → the first copy.
    links: HashMap<(u64, u64), PathBuf>,
    done: Copied,
}

fn open_dir(dir: BorrowedFd<'_>, name: &CStr) -> rustix::io::Result<OwnedFd> {
    rustix::fs::openat(
        dir,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
}

fn is_opaque(dir: BorrowedFd<'_>) -> bool {
    let mut buf = [0u8; 8];
    matches!(
        rustix::fs::fgetxattr(dir, dsec_sys::layer::OPAQUE_XATTR, &mut buf),
        Ok(1) if buf[0] == b'y'
    )
}

/// Removes whatever `path` is (a directory with all it holds); nothing there is fine.
fn remove(path: &Path) -> Result<(), CopyError> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => fs::remove_dir_all(path).map_err(err("remove", path)),
        Ok(_) => fs::remove_file(path).map_err(err("remove", path)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(err("stat", path)(e)),
    }
}

fn mtime(st: &rustix::fs::Stat) -> Timestamps {
    let t = rustix::fs::Timespec {
        tv_sec: st.st_mtime as _,
        tv_nsec: st.st_mtime_nsec as _,
    };
    Timestamps {
        last_access: t,
        last_modification: t,
    }
}

impl Copier<'_> {
    /// Copies the entries of `src` into `dest`; `fresh`: `dest` was empty (made by this copy),
    /// so nothing there needs looking at or removing.
    fn dir(
        &mut self,
        src: BorrowedFd<'_>,
        dest: &Path,
        depth: usize,
        fresh: bool,
    ) -> Result<(), CopyError> {
        if depth > MAX_DEPTH {
            return Err(err("copy", dest)(io::Error::other(format!(
                "directories nest deeper than {MAX_DEPTH}"
            ))));
        }
        let mut entries = rustix::fs::Dir::read_from(src).map_err(rerr("read", dest))?;
        while let Some(entry) = entries.read() {
            let entry = entry.map_err(rerr("read", dest))?;
            let name = entry.file_name();
            if name == c"." || name == c".." {
                continue;
            }
            let to = dest.join(std::ffi::OsStr::from_bytes(name.to_bytes()));
            let Ok(st) = rustix::fs::statat(src, name, AtFlags::SYMLINK_NOFOLLOW) else {
                continue; // gone meanwhile
            };
            self.entry(src, name, &st, &to, depth, fresh)?;
        }
        Ok(())
    }

    fn entry(
        &mut self,
        src: BorrowedFd<'_>,
        name: &CStr,
        st: &rustix::fs::Stat,
        to: &Path,
        depth: usize,
        fresh: bool,
    ) -> Result<(), CopyError> {
        self.done.entries += 1;
        let remove = |to: &Path| if fresh { Ok(()) } else { remove(to) };
        match FileType::from_raw_mode(st.st_mode) {
            FileType::Directory => {
                let Ok(fd) = open_dir(src, name) else {
                    return Ok(()); // replaced meanwhile
                };
                let opaque = is_opaque(fd.as_fd());
                let below = if fresh {
                    None
                } else {
                    fs::symlink_metadata(to).ok()
                };
                let merge = !opaque && below.as_ref().is_some_and(fs::Metadata::is_dir);
                if !merge {
                    remove(to)?;
                    fs::create_dir(to).map_err(err("mkdir", to))?;
                    // Over something that was not a directory, nothing below may show.
                    if opaque || below.is_some() {
                        dsec_sys::layer::set_opaque(to)
                            .map_err(|e| err("opaque", to)(io::Error::other(e)))?;
                    }
                }
                self.dir(fd.as_fd(), to, depth + 1, fresh || !merge)?;
                let st = rustix::fs::fstat(&fd).map_err(rerr("stat", to))?;
                self.meta(to, &st, false)
            }
            FileType::RegularFile => {
                remove(to)?;
                self.file(src, name, st, to)
            }
            FileType::Symlink => {
                let Ok(target) = rustix::fs::readlinkat(src, name, Vec::new()) else {
                    return Ok(());
                };
                remove(to)?;
                std::os::unix::fs::symlink(std::ffi::OsStr::from_bytes(target.to_bytes()), to)
                    .map_err(err("symlink", to))?;
                self.meta(to, st, true)
            }
            FileType::CharacterDevice if st.st_rdev == 0 => {
                remove(to)?;
                let rel = to.strip_prefix(&self.root).unwrap_or(to);
                if self.below.is_some_and(|below| !below(rel)) {
                    return Ok(());
                }
                dsec_sys::layer::make_whiteout(to)
                    .map_err(|e| err("whiteout", to)(io::Error::other(e)))
            }
            FileType::Fifo => {
                remove(to)?;
                rustix::fs::mknodat(
                    rustix::fs::CWD,
                    to,
                    FileType::Fifo,
                    Mode::from_raw_mode(st.st_mode & 0o777),
                    0,
                )
                .map_err(rerr("mkfifo", to))?;
                self.meta(to, st, false)
            }
            // Sockets and device nodes are not part of a layer.
            _ => Ok(()),
        }
    }

    fn file(
        &mut self,
        src: BorrowedFd<'_>,
        name: &CStr,
        st: &rustix::fs::Stat,
        to: &Path,
    ) -> Result<(), CopyError> {
        let Ok(fd) = rustix::fs::openat(
            src,
            name,
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
            Mode::empty(),
        ) else {
            return Ok(());
        };
        // What was opened is what is copied: checked again on the descriptor.
        let st_now = rustix::fs::fstat(&fd).map_err(rerr("stat", to))?;
        if FileType::from_raw_mode(st_now.st_mode) != FileType::RegularFile {
            return Ok(());
        }
        let key = (st_now.st_dev, st_now.st_ino);
        if st.st_nlink > 1 {
            if let Some(first) = self.links.get(&key) {
                return fs::hard_link(first, to).map_err(err("link", to));
            }
            self.links.insert(key, to.to_owned());
        }
        let mut out = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(to)
            .map_err(err("create", to))?;
        // Small files are most of a layer: read and write, without the probing of
        // `io::copy` (whose `copy_file_range` fails across file systems, tmpfs → disk).
        let mut input = fs::File::from(fd);
        let mut buf = vec![0u8; (st_now.st_size.clamp(0, 128 << 10) as usize).max(1)];
        loop {
            use std::io::{Read, Write};
            let n = input.read(&mut buf).map_err(err("copy", to))?;
            if n == 0 {
                break;
            }
            out.write_all(&buf[..n]).map_err(err("copy", to))?;
            self.done.bytes += n as u64;
        }
        self.meta_fd(out.as_fd(), to, &st_now)
    }

    /// Owner (shifted), mode (without setuid/setgid) and modification time of `to`, by path.
    fn meta(&self, to: &Path, st: &rustix::fs::Stat, link: bool) -> Result<(), CopyError> {
        let (uid, gid) = (self.ids.uid(st.st_uid), self.ids.gid(st.st_gid));
        rustix::fs::chownat(
            rustix::fs::CWD,
            to,
            Some(rustix::fs::Uid::from_raw(uid)),
            Some(rustix::fs::Gid::from_raw(gid)),
            AtFlags::SYMLINK_NOFOLLOW,
        )
        .map_err(rerr("chown", to))?;
        if !link {
            rustix::fs::chmodat(
                rustix::fs::CWD,
                to,
                Mode::from_raw_mode(st.st_mode & 0o1777),
                AtFlags::empty(),
            )
            .map_err(rerr("chmod", to))?;
        }
        rustix::fs::utimensat(rustix::fs::CWD, to, &mtime(st), AtFlags::SYMLINK_NOFOLLOW)
            .map_err(rerr("utimes", to))
    }

    fn meta_fd(
        &self,
        fd: BorrowedFd<'_>,
        to: &Path,
        st: &rustix::fs::Stat,
    ) -> Result<(), CopyError> {
        let (uid, gid) = (self.ids.uid(st.st_uid), self.ids.gid(st.st_gid));
        // The node runs as root: a file it made is root's already.
        if (uid, gid) != (0, 0) {
            rustix::fs::fchown(
                fd,
                Some(rustix::fs::Uid::from_raw(uid)),
                Some(rustix::fs::Gid::from_raw(gid)),
            )
            .map_err(rerr("chown", to))?;
        }
        rustix::fs::fchmod(fd, Mode::from_raw_mode(st.st_mode & 0o1777))
            .map_err(rerr("chmod", to))?;
        rustix::fs::futimens(fd, &mtime(st)).map_err(rerr("utimes", to))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    fn open(p: &Path) -> OwnedFd {
        fs::File::open(p)
            .map(OwnedFd::from)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn copies_files_links_whiteouts_and_shifts_ids() -> Result<(), Box<dyn std::error::Error>> {
        let t = tempfile::tempdir()?;
        let (src, dest) = (t.path().join("src"), t.path().join("dest"));
        fs::create_dir_all(src.join("d/e"))?;
        fs::write(src.join("d/e/f"), b"hello")?;
        fs::set_permissions(src.join("d/e/f"), fs::Permissions::from_mode(0o4755))?;
        fs::hard_link(src.join("d/e/f"), src.join("g"))?;
        std::os::unix::fs::symlink("/etc/shadow", src.join("l"))?;
        dsec_sys::layer::make_whiteout(&src.join("gone"))?;
        fs::create_dir(src.join("o"))?;
        dsec_sys::layer::set_opaque(&src.join("o"))?;
        std::os::unix::fs::lchown(src.join("d/e/f"), Some(100_007), Some(100_009))?;
        fs::create_dir(&dest)?;
        let ids = IdShift {
            uid: 100_000,
            gid: 100_000,
        };
        let done = apply(open(&src).as_fd(), &dest, ids)?;
        assert_eq!(done.bytes, 5, "a hard link is stored and counted once");
        let f = fs::metadata(dest.join("d/e/f"))?;
        assert_eq!((f.uid(), f.gid()), (7, 9));
        assert_eq!(f.mode() & 0o7777, 0o755, "setuid dropped");
        assert_eq!(fs::read(dest.join("g"))?, b"hello");
        assert_eq!(fs::metadata(dest.join("g"))?.ino(), f.ino());
        assert_eq!(fs::read_link(dest.join("l"))?, Path::new("/etc/shadow"));
        assert!(dsec_sys::layer::is_whiteout(&fs::symlink_metadata(
            dest.join("gone")
        )?));
        assert!(dsec_sys::layer::is_opaque(&dest.join("o")));
        // Root ids outside the range become the overflow id.
        assert_eq!(fs::metadata(&dest)?.uid(), OVERFLOW);
        Ok(())
    }

    #[test]
    fn applies_on_top_with_overlay_semantics() -> Result<(), Box<dyn std::error::Error>> {
        let t = tempfile::tempdir()?;
        let (below, above, dest) = (
            t.path().join("below"),
            t.path().join("above"),
            t.path().join("dest"),
        );
        fs::create_dir_all(below.join("keep"))?;
        fs::write(below.join("keep/a"), b"a")?;
        fs::create_dir_all(below.join("opq"))?;
        fs::write(below.join("opq/old"), b"old")?;
        fs::write(below.join("deleted"), b"x")?;
        fs::create_dir_all(above.join("keep"))?;
        fs::write(above.join("keep/b"), b"b")?;
        fs::create_dir_all(above.join("opq"))?;
        fs::write(above.join("opq/new"), b"new")?;
        dsec_sys::layer::set_opaque(&above.join("opq"))?;
        dsec_sys::layer::make_whiteout(&above.join("deleted"))?;
        fs::create_dir(&dest)?;
        apply(open(&below).as_fd(), &dest, IdShift::default())?;
        apply(open(&above).as_fd(), &dest, IdShift::default())?;
        assert_eq!(fs::read(dest.join("keep/a"))?, b"a");
        assert_eq!(fs::read(dest.join("keep/b"))?, b"b");
        assert!(!dest.join("opq/old").exists());
        assert_eq!(fs::read(dest.join("opq/new"))?, b"new");
        assert!(dsec_sys::layer::is_whiteout(&fs::symlink_metadata(
            dest.join("deleted")
        )?));
        Ok(())
    }
}
