//! Tar upload (defensive unpacking) and download (packing without following symlinks).
//!
//! Unpacking resolves every entry with `RESOLVE_BENEATH` relative to the destination directory:
//! no absolute paths, no `..`, no symlink whose target leaves the destination, no hard link to
//! outside, no device nodes or FIFOs, no setuid/setgid bits, bounded entry count and size.
//! Downloads contain the *contents* of the requested directory (paths relative to it), or the
//! single file under its base name.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;

use dsec_api::ErrorCode;
use dsec_sys::fs::{self as sfs, Confine, FsError, Kind};
use tar::{Archive, Builder, EntryType, Header};

use crate::files::{self, clean, FileError, Root, WriteErr, MAX_DEPTH};

/// Most entries accepted in an upload (and produced by a download).
pub const MAX_ENTRIES: usize = 100_000;
/// Most unpacked bytes accepted in an upload.
pub const MAX_UNPACKED: u64 = 1 << 30;
/// Default bound of a download.
pub const DEFAULT_DOWNLOAD_MAX: u64 = 256 << 20;

/// Errors of tar transfers.
#[derive(Debug, thiserror::Error)]
pub enum TarError {
    /// The stream is not a valid tar archive.
    #[error("read tar stream")]
    Read(#[source] io::Error),
    /// An entry path is absolute or contains `..`.
    #[error("tar entry {path:?} escapes the destination")]
    EntryEscape {
        /// Entry path.
        path: String,
    },
    /// A link entry points outside the destination.
    #[error("tar link {path:?} -> {target:?} escapes the destination")]
    LinkEscape {
        /// Entry path.
        path: String,
        /// Link target.
        target: String,
    },
    /// The entry type is not allowed (device, FIFO, sparse...).
    #[error("tar entry {path:?} has a forbidden type")]
    ForbiddenType {
        /// Entry path.
        path: String,
    },
    /// Entry count or size bound exceeded.
    #[error("tar {what} exceeds the limit of {limit}")]
    TooLarge {
        /// What.
        what: &'static str,
        /// The bound.
        limit: u64,
    },
    /// Creating something failed.
    #[error("unpack tar entry")]
    File(#[source] FileError),
    /// Packing failed.
    #[error("pack {path:?}")]
    Pack {
        /// Path being packed.
        path: String,
        /// Cause.
        #[source]
        source: io::Error,
    },
}

impl TarError {
    /// The wire code.
    pub fn code(&self) -> ErrorCode {
        match self {
            TarError::Read(_) | TarError::ForbiddenType { .. } => ErrorCode::InvalidRequest,
            TarError::EntryEscape { .. } | TarError::LinkEscape { .. } => ErrorCode::PathEscape,
            TarError::TooLarge { .. } => ErrorCode::TooLarge,
            TarError::File(e) => e.code(),
            TarError::Pack { source, .. } => match source
                .get_ref()
                .and_then(|e| e.downcast_ref::<DownloadTooLarge>())
            {
                Some(_) => ErrorCode::TooLarge,
                None => files::errno_code(source.raw_os_error()),
            },
        }
    }
}

fn fserr<'a>(op: &'static str, path: &'a str) -> impl FnOnce(FsError) -> TarError + 'a {
    move |source| {
        TarError::File(FileError::Sys {
            op,
            path: path.to_owned(),
            source,
        })
    }
}

/// Validates an entry path: relative, no `..`; returns the cleaned components.
fn entry_components(raw: &[u8]) -> Result<Vec<String>, TarError> {
    let path = String::from_utf8_lossy(raw).into_owned();
    if path.starts_with('/') || path.split('/').any(|c| c == "..") || path.contains('\0') {
        return Err(TarError::EntryEscape { path });
    }
    let comps = clean(&path).map_err(|_| TarError::EntryEscape { path: path.clone() })?;
    Ok(comps.into_iter().map(str::to_owned).collect())
}

/// Unpacks `body` under `dest` (created if missing).
pub fn upload(root: &Root, dest: &str, body: &[u8]) -> Result<(), TarError> {
    let dest_fd = root.mkdir_p(dest, 0o755).map_err(TarError::File)?;
    let dest_root = Root::beneath(dest_fd);
    let mut archive = Archive::new(body);
    let mut count = 0usize;
    let mut total = 0u64;
    for entry in archive.entries().map_err(TarError::Read)? {
        let mut entry = entry.map_err(TarError::Read)?;
        count += 1;
        if count > MAX_ENTRIES {
            return Err(TarError::TooLarge {
                what: "entry count",
                limit: MAX_ENTRIES as u64,
            });
        }
        let comps = entry_components(&entry.path_bytes())?;
        let path = comps.join("/");
        let kind = entry.header().entry_type();
        let mode = entry.header().mode().unwrap_or(0o644) & 0o777;
        match kind {
            EntryType::Directory => {
                if !comps.is_empty() {
                    dest_root
                        .mkdir_p(&path, mode | 0o700)
                        .map_err(TarError::File)?;
                }
            }
            EntryType::Regular | EntryType::Continuous => {
                total = total.saturating_add(entry.size());
                if total > MAX_UNPACKED {
                    return Err(TarError::TooLarge {
                        what: "unpacked size",
                        limit: MAX_UNPACKED,
                    });
                }
                let mut data = Vec::with_capacity(entry.size().min(body.len() as u64) as usize);
                entry.read_to_end(&mut data).map_err(TarError::Read)?;
                let (dir, name) = parent(&dest_root, &comps, &path)?;
                files::write_in(dir.as_fd(), &name, &data, mode).map_err(|e| match e {
                    WriteErr::Sys(source) => TarError::File(FileError::Sys {
                        op: "write",
                        path: path.clone(),
                        source,
                    }),
                    WriteErr::Io(source) => TarError::File(FileError::Io {
                        op: "write",
                        path: path.clone(),
                        source,
                    }),
                })?;
            }
            EntryType::Symlink => {
                let target = entry
                    .link_name_bytes()
                    .map(|t| String::from_utf8_lossy(&t).into_owned())
                    .unwrap_or_default();
                check_link_target(&comps, &target, &path)?;
                let (dir, name) = parent(&dest_root, &comps, &path)?;
                replace_non_dir(dir.as_fd(), &name, &path)?;
                sfs::symlinkat(OsStr::new(&target), dir.as_fd(), &name)
                    .map_err(fserr("symlink", &path))?;
            }
            EntryType::Link => {
                let target_raw = entry
                    .link_name_bytes()
                    .map(|t| t.into_owned())
                    .unwrap_or_default();
                let tcomps = entry_components(&target_raw).map_err(|_| TarError::LinkEscape {
                    path: path.clone(),
                    target: String::from_utf8_lossy(&target_raw).into_owned(),
                })?;
                let tpath = tcomps.join("/");
                let (odir, oname) = parent(&dest_root, &tcomps, &tpath)?;
                let info =
                    sfs::fstatat_nofollow(odir.as_fd(), &oname).map_err(fserr("link", &tpath))?;
                if info.kind != Kind::File {
                    return Err(TarError::ForbiddenType { path });
                }
                let (dir, name) = parent(&dest_root, &comps, &path)?;
                replace_non_dir(dir.as_fd(), &name, &path)?;
                sfs::linkat(odir.as_fd(), &oname, dir.as_fd(), &name)
                    .map_err(fserr("link", &path))?;
            }
            EntryType::XGlobalHeader
            | EntryType::XHeader
            | EntryType::GNULongName
            | EntryType::GNULongLink => {}
            _ => return Err(TarError::ForbiddenType { path }),
        }
    }
    Ok(())
}

fn parent(
    root: &Root,
    comps: &[String],
    path: &str,
) -> Result<(std::os::fd::OwnedFd, OsString), TarError> {
    if comps.is_empty() {
        return Err(TarError::EntryEscape {
            path: path.to_owned(),
        });
    }
    if comps.len() > 1 {
        root.mkdir_p(&comps[..comps.len() - 1].join("/"), 0o755)
            .map_err(TarError::File)?;
    }
    root.parent(path).map_err(TarError::File)
}

/// Removes an existing non-directory at `name` so a link can take its place.
fn replace_non_dir(dir: BorrowedFd<'_>, name: &OsStr, path: &str) -> Result<(), TarError> {
    match sfs::fstatat_nofollow(dir, name) {
        Ok(info) if info.kind == Kind::Dir => Err(TarError::ForbiddenType {
            path: path.to_owned(),
        }),
        Ok(_) => sfs::unlinkat(dir, name, false).map_err(fserr("replace", path)),
        Err(_) => Ok(()),
    }
}

/// A symlink target must be relative and stay inside the destination when resolved from the
/// link's directory.
fn check_link_target(comps: &[String], target: &str, path: &str) -> Result<(), TarError> {
    let escape = || TarError::LinkEscape {
        path: path.to_owned(),
        target: target.to_owned(),
    };
    if target.is_empty() || target.starts_with('/') || target.contains('\0') {
        return Err(escape());
    }
    let mut depth = comps.len().saturating_sub(1) as i64;
    for c in target.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                depth -= 1;
                if depth < 0 {
                    return Err(escape());
                }
            }
            _ => depth += 1,
        }
    }
    Ok(())
}

/// Marker error: the download passed its byte bound.
#[derive(Debug, thiserror::Error)]
#[error("tar stream exceeds max_bytes")]
pub struct DownloadTooLarge;

/// A writer that forwards full chunks to a callback and enforces a byte bound.
struct ChunkWriter<'a> {
    buf: Vec<u8>,
    chunk: usize,
    written: u64,
    max: u64,
    sink: &'a mut dyn FnMut(&[u8], bool),
}

impl Write for ChunkWriter<'_> {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if self.written + data.len() as u64 > self.max {
            return Err(io::Error::other(DownloadTooLarge));
        }
        self.written += data.len() as u64;
        self.buf.extend_from_slice(data);
        while self.buf.len() >= self.chunk {
            let rest = self.buf.split_off(self.chunk);
            (self.sink)(&self.buf, false);
            self.buf = rest;
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Packs `path` and passes the stream to `sink` in chunks; the last call has `eof = true`.
pub fn download(
    root: &Root,
    path: &str,
    max: Option<u64>,
    chunk: usize,
    sink: &mut dyn FnMut(&[u8], bool),
) -> Result<(), TarError> {
    let comps = clean(path).map_err(TarError::File)?;
    let top = root
        .open_at(path, libc::O_PATH | libc::O_NOFOLLOW, 0)
        .map_err(TarError::File)?;
    let info = sfs::fstatat_nofollow(top.as_fd(), OsStr::new("")).map_err(fserr("stat", path))?;
    let mut w = ChunkWriter {
        buf: Vec::new(),
        chunk,
        written: 0,
        max: max.unwrap_or(DEFAULT_DOWNLOAD_MAX),
        sink,
    };
    let pack = |source| TarError::Pack {
        path: path.to_owned(),
        source,
    };
    {
        let mut b = Builder::new(&mut w);
        b.follow_symlinks(false);
        let mut count = 0usize;
        if info.kind == Kind::Dir {
            let dir = root.open_dir(path).map_err(TarError::File)?;
            pack_dir(&mut b, dir.as_fd(), "", 0, &mut count).map_err(pack)?;
        } else {
            let name = comps.last().map_or(".", |s| s);
            let (dir, fname) = root.parent(path).map_err(TarError::File)?;
            pack_entry(&mut b, dir.as_fd(), &fname, name, 0, &mut count).map_err(pack)?;
        }
        b.finish().map_err(pack)?;
    }
    let rest = std::mem::take(&mut w.buf);
    (w.sink)(&rest, true);
    Ok(())
}

fn pack_dir<W: Write>(
    b: &mut Builder<W>,
    dir: BorrowedFd<'_>,
    prefix: &str,
    depth: usize,
    count: &mut usize,
) -> io::Result<()> {
    if depth > MAX_DEPTH {
        return Err(io::Error::other("directory tree too deep"));
    }
    let (mut entries, truncated) = sfs::read_dir(dir, MAX_ENTRIES).map_err(io::Error::other)?;
    if truncated {
        return Err(io::Error::other("directory too large"));
    }
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    for e in entries {
        let name = String::from_utf8_lossy(e.name.as_bytes()).into_owned();
        let archived = if prefix.is_empty() {
            name
        } else {
            format!("{prefix}/{name}")
        };
        pack_entry(b, dir, &e.name, &archived, depth, count)?;
    }
    Ok(())
}

/// Opens the entry `name` of `dir` with `flags`, neither following it nor any symlink on the way.
fn open_beneath(dir: BorrowedFd<'_>, name: &OsStr, flags: libc::c_int) -> io::Result<OwnedFd> {
    sfs::openat2(
        dir,
        name,
        flags | libc::O_NOFOLLOW,
        0,
        Confine::BeneathNoSymlinks,
    )
    .map_err(io::Error::other)
}

fn pack_entry<W: Write>(
    b: &mut Builder<W>,
    dir: BorrowedFd<'_>,
    name: &OsStr,
    archived: &str,
    depth: usize,
    count: &mut usize,
) -> io::Result<()> {
    *count += 1;
    if *count > MAX_ENTRIES {
        return Err(io::Error::other("too many entries"));
    }
    let info = match sfs::fstatat_nofollow(dir, name) {
        Ok(i) => i,
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(()),
        Err(e) => return Err(io::Error::other(e)),
    };
    let mut h = Header::new_gnu();
    h.set_mode(info.mode);
    h.set_mtime(info.mtime.max(0) as u64);
    h.set_uid(0);
    h.set_gid(0);
    match info.kind {
        Kind::Dir => {
            h.set_entry_type(EntryType::Directory);
            h.set_size(0);
            b.append_data(&mut h, format!("{archived}/"), io::empty())?;
            let sub = open_beneath(dir, name, libc::O_PATH | libc::O_DIRECTORY)?;
            pack_dir(b, sub.as_fd(), archived, depth + 1, count)
        }
        Kind::File => {
            let fd = open_beneath(dir, name, libc::O_RDONLY | libc::O_NONBLOCK)?;
            let size = info.size;
            h.set_entry_type(EntryType::Regular);
            h.set_size(size);
            // Exactly `size` bytes even if the file changes while we read it.
            let reader = File::from(fd).take(size).chain(io::repeat(0)).take(size);
            b.append_data(&mut h, archived, reader)
        }
        Kind::Symlink => {
            let target = sfs::readlinkat(dir, name).map_err(io::Error::other)?;
            h.set_entry_type(EntryType::Symlink);
            h.set_size(0);
            b.append_link(&mut h, archived, std::path::Path::new(&target))
        }
        Kind::Device | Kind::Other => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_paths_are_validated() {
        assert!(entry_components(b"../x").is_err());
        assert!(entry_components(b"/etc/passwd").is_err());
        assert!(entry_components(b"a/../../x").is_err());
        assert_eq!(entry_components(b"./a/b").expect("ok"), vec!["a", "b"]);
    }

    #[test]
    fn link_targets_must_stay_inside() {
        let c = vec!["a".to_owned(), "l".to_owned()];
        assert!(check_link_target(&c, "../x", "a/l").is_ok());
        assert!(check_link_target(&c, "../../x", "a/l").is_err());
        assert!(check_link_target(&c, "/etc", "a/l").is_err());
    }
}
