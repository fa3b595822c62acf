//! Unpacking untrusted tar streams into a layer directory.
//!
//! Every archive is hostile input. The rules, enforced entry by entry while streaming:
//!
//! - **Compression** is detected by magic: gzip is decompressed, zstd is refused
//!   ([`TemplateError::Unsupported`]), anything else is read as a plain tar.
//! - **Paths**: a leading `/` is stripped (an absolute entry means "relative to the layer root",
//!   as in Docker), empty and `.` components are dropped, any `..` component is a
//!   [`TemplateError::PathEscape`], a NUL byte is refused.
//! - **No symlink is ever followed**: every parent component is checked with `symlink_metadata`
//!   and created by us; a parent that is a symlink is a `PathEscape`. Files are created with
//!   `O_CREAT|O_EXCL|O_NOFOLLOW`; an existing entry at the destination is removed first (later
//!   entries win, as in tar). Directory modes are applied at the end after re-checking the path.
//! - **Hardlinks** must name a regular file already extracted in this layer, reached without
//!   symlinks; anything else is refused.
//! - **Device nodes, fifos and sparse/unknown entries are refused.** The only device this
//!   module creates is the overlayfs whiteout (character device 0/0), translated from OCI
//!   `.wh.<name>` entries; `.wh..wh..opq` sets `trusted.overlay.opaque=y` on its directory.
//!   Other `.wh..wh.*` (aufs metadata) entries are skipped.
//! - **Modes**: setuid/setgid bits are dropped everywhere, the sticky bit is kept on
//!   directories only. Owners are kept when running as root. Extended attributes in PAX
//!   headers are ignored.
//! - **Limits** ([`ImportLimits`]) are checked while streaming: the uncompressed byte counter
//!   sits between the decompressor and the tar parser, so a gzip bomb stops at `max_bytes`.
//!
//! On error the destination is left partially written; callers unpack into a temporary
//! directory and remove it (the layer store does).

use std::fs::{self, File, OpenOptions, Permissions};
use std::io::{self, Cursor, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use flate2::read::MultiGzDecoder;
use sha2::{Digest as _, Sha256};
use tar::{Archive, EntryType};

use super::{Digest, ImportLimits, TemplateError};

pub(crate) use dsec_sys::layer::{is_opaque, is_whiteout, make_whiteout, set_opaque};

/// What the unpacked tree is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum UnpackMode {
    /// An image layer: OCI whiteouts are translated, owners and modes kept.
    Layer,
    /// A staging copy of an image archive: no whiteout translation, owners ignored,
    /// files 0644 and directories 0755.
    Staging,
}

/// Running totals of one import, shared by all its layers.
#[derive(Debug)]
pub(crate) struct Budget {
    pub(crate) limits: ImportLimits,
    bytes_used: u64,
    entries_used: u64,
}

impl Budget {
    pub(crate) fn new(limits: &ImportLimits) -> Self {
        Budget {
            limits: *limits,
            bytes_used: 0,
            entries_used: 0,
        }
    }

    /// Uncompressed bytes read so far.
    pub(crate) fn bytes_used(&self) -> u64 {
        self.bytes_used
    }

    fn bytes_left(&self) -> u64 {
        self.limits.max_bytes.saturating_sub(self.bytes_used)
    }

    fn count_entry(&mut self) -> Result<(), TemplateError> {
        self.entries_used += 1;
        if self.entries_used > self.limits.max_entries {
            return Err(TemplateError::LimitExceeded {
                what: "entries",
                limit: self.limits.max_entries,
            });
        }
        Ok(())
    }
}

/// A reader that hashes and counts what passes through it and fails once more than `cap`
/// bytes are read.
pub(crate) struct MeteredReader<R> {
    inner: R,
    hasher: Sha256,
    read: u64,
    cap: u64,
    hit: bool,
    /// Where every byte read is copied as well (a layer's blob, kept to serve other nodes).
    tee: Option<std::fs::File>,
}

impl<R: Read> MeteredReader<R> {
    pub(crate) fn new(inner: R, cap: u64) -> Self {
        MeteredReader {
            inner,
            hasher: Sha256::new(),
            read: 0,
            cap,
            hit: false,
            tee: None,
        }
    }

    /// Reads the rest of the stream (still bounded by the cap).
    pub(crate) fn drain(&mut self) -> io::Result<()> {
        io::copy(self, &mut io::sink()).map(|_| ())
    }

    pub(crate) fn limit_hit(&self) -> bool {
        self.hit
    }

    pub(crate) fn bytes_read(&self) -> u64 {
        self.read
    }

    pub(crate) fn digest(&self) -> Digest {
        Digest::from_hasher(self.hasher.clone())
    }
}

impl<R: Read> Read for MeteredReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        if self.read >= self.cap {
            // Only fail if there really is more data.
            let mut one = [0u8; 1];
            if self.inner.read(&mut one)? == 0 {
                return Ok(0);
            }
            self.hit = true;
            return Err(io::Error::other("import byte limit exceeded"));
        }
        let max = usize::try_from(self.cap - self.read)
            .unwrap_or(usize::MAX)
            .min(buf.len());
        let n = self.inner.read(&mut buf[..max])?;
        if let Some(f) = &mut self.tee {
            f.write_all(&buf[..n])?;
        }
        self.hasher.update(&buf[..n]);
        self.read += n as u64;
        Ok(n)
    }
}

/// Unpacks one (plain or gzip'd) layer tar into the existing, empty directory `dest`,
/// translating OCI whiteouts, and returns the sha256 of the uncompressed tar stream.
///
/// This is the primitive under [`super::LayerStore`]; it applies all the rules of this module
/// with a fresh budget from `limits`. On error `dest` may hold partial content.
pub fn unpack_layer(
    reader: impl Read,
    dest: &Path,
    limits: &ImportLimits,
) -> Result<Digest, TemplateError> {
    let mut budget = Budget::new(limits);
    unpack_stream(reader, dest, &mut budget, UnpackMode::Layer)
}

/// Unpacks a possibly compressed tar stream into `dest`; returns the digest of the
/// uncompressed stream (including trailing padding).
pub(crate) fn unpack_stream(
    raw: impl Read,
    dest: &Path,
    budget: &mut Budget,
    mode: UnpackMode,
) -> Result<Digest, TemplateError> {
    unpack_stream_tee(raw, dest, budget, mode, None)
}

/// [`unpack_stream`], copying the uncompressed stream (the bytes the digest is of) to `tee`.
pub(crate) fn unpack_stream_tee(
    mut raw: impl Read,
    dest: &Path,
    budget: &mut Budget,
    mode: UnpackMode,
    tee: Option<std::fs::File>,
) -> Result<Digest, TemplateError> {
    // The first four bytes (fewer only at the end of the stream) tell the compression.
    let mut head = Vec::with_capacity(4);
    (&mut raw)
        .take(4)
        .read_to_end(&mut head)
        .map_err(|source| TemplateError::ReadArchive { source })?;
    let chained = Cursor::new(head.clone()).chain(raw);
    let decoded: Box<dyn Read + '_> = if head.starts_with(&[0x1f, 0x8b]) {
        Box::new(MultiGzDecoder::new(chained))
    } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        return Err(TemplateError::Unsupported {
            reason: "zstd-compressed layer".into(),
        });
    } else {
        Box::new(chained)
    };
    let mut metered = MeteredReader::new(decoded, budget.bytes_left());
    metered.tee = tee;
    let res = {
        let mut archive = Archive::new(&mut metered);
        unpack_entries(&mut archive, dest, budget, mode)
    };
    let res = res.and_then(|()| {
        metered
            .drain()
            .map_err(|source| TemplateError::ReadArchive { source })
    });
    budget.bytes_used += metered.bytes_read();
    match res {
        Err(_) if metered.limit_hit() => Err(TemplateError::LimitExceeded {
            what: "total bytes",
            limit: budget.limits.max_bytes,
        }),
        Err(e) => Err(e),
        Ok(()) => Ok(metered.digest()),
    }
}

/// The entry name for error messages: lossy UTF-8, at most 256 characters.
fn display(raw: &[u8]) -> String {
    String::from_utf8_lossy(raw).chars().take(256).collect()
}

/// Splits a raw tar path into safe components (see the module doc).
fn normalize(raw: &[u8], entry: &str) -> Result<Vec<PathBuf>, TemplateError> {
    if raw.contains(&0) {
        return Err(TemplateError::Unpack {
            entry: entry.to_owned(),
            reason: "NUL byte in path",
        });
    }
    let mut out = Vec::new();
    for comp in raw.split(|&b| b == b'/') {
        match comp {
            b"" | b"." => {}
            b".." => {
                return Err(TemplateError::PathEscape {
                    entry: entry.to_owned(),
                })
            }
            c => out.push(PathBuf::from(std::ffi::OsStr::from_bytes(c))),
        }
    }
    Ok(out)
}

/// Walks `comps` below `dest`, creating missing directories (0755) and refusing symlinks and
/// non-directories. Returns the full path.
fn ensure_dirs(dest: &Path, comps: &[PathBuf], entry: &str) -> Result<PathBuf, TemplateError> {
    let mut p = dest.to_path_buf();
    for c in comps {
        p.push(c);
        match fs::symlink_metadata(&p) {
            Ok(m) if m.file_type().is_symlink() => {
                return Err(TemplateError::PathEscape {
                    entry: entry.to_owned(),
                })
            }
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(TemplateError::Unpack {
                    entry: entry.to_owned(),
                    reason: "a parent path component is not a directory",
                })
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => fs::DirBuilder::new()
                .mode(0o755)
                .create(&p)
                .map_err(|e| TemplateError::io("create dir", &p, e))?,
            Err(e) => return Err(TemplateError::io("stat", &p, e)),
        }
    }
    Ok(p)
}

/// Checks that `comps` below `dest` exist as real directories except the last, which must
/// exist and not be a symlink. Returns its metadata.
fn lookup_nofollow(dest: &Path, comps: &[PathBuf]) -> Option<(PathBuf, fs::Metadata)> {
    let mut p = dest.to_path_buf();
    let (last, parents) = comps.split_last()?;
    for c in parents {
        p.push(c);
        let m = fs::symlink_metadata(&p).ok()?;
        if !m.is_dir() || m.file_type().is_symlink() {
            return None;
        }
    }
    p.push(last);
    let m = fs::symlink_metadata(&p).ok()?;
    if m.file_type().is_symlink() {
        return None;
    }
    Some((p, m))
}

/// Removes whatever is at `path` (never following a symlink).
fn remove_existing(path: &Path) -> Result<(), TemplateError> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => {
            fs::remove_dir_all(path).map_err(|e| TemplateError::io("remove dir", path, e))
        }
        Ok(_) => fs::remove_file(path).map_err(|e| TemplateError::io("remove", path, e)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(TemplateError::io("stat", path, e)),
    }
}

impl From<dsec_sys::layer::LayerError> for TemplateError {
    fn from(e: dsec_sys::layer::LayerError) -> Self {
        TemplateError::io(e.op, e.path, e.source)
    }
}

struct DirFixup {
    comps: Vec<PathBuf>,
    mode: u32,
    owner: Option<(u32, u32)>,
}

fn read_err(source: io::Error) -> TemplateError {
    TemplateError::ReadArchive { source }
}

fn unpack_entries<R: Read>(
    archive: &mut Archive<R>,
    dest: &Path,
    budget: &mut Budget,
    mode: UnpackMode,
) -> Result<(), TemplateError> {
    let chown = mode == UnpackMode::Layer && rustix::process::geteuid().is_root();
    let limits = budget.limits;
    let mut dirs: Vec<DirFixup> = Vec::new();
    for entry in archive.entries().map_err(read_err)? {
        let mut entry = entry.map_err(read_err)?;
        budget.count_entry()?;
        let raw = entry.path_bytes().into_owned();
        let name = display(&raw);
        check_path_len(raw.len(), &limits)?;
        let comps = normalize(&raw, &name)?;
        let header = entry.header();
        let etype = header.entry_type();
        let perm = header.mode().map_err(read_err)?;
        let owner = if chown {
            Some((
                u32::try_from(header.uid().map_err(read_err)?).unwrap_or(u32::MAX),
                u32::try_from(header.gid().map_err(read_err)?).unwrap_or(u32::MAX),
            ))
        } else {
            None
        };
        if etype == EntryType::XGlobalHeader {
            continue;
        }
        let Some((last, parents)) = comps.split_last() else {
            if etype == EntryType::Directory {
                continue; // the layer root itself ("./" or "/")
            }
            return Err(TemplateError::Unpack {
                entry: name,
                reason: "entry has an empty path",
            });
        };

        let last_bytes = last.as_os_str().as_bytes();
        if mode == UnpackMode::Layer && last_bytes.starts_with(b".wh.") {
            unpack_whiteout(dest, parents, last_bytes, &name)?;
            continue;
        }

        match etype {
            EntryType::Directory => {
                let path = ensure_dirs(dest, parents, &name)?.join(last);
                match fs::symlink_metadata(&path) {
                    Ok(m) if m.is_dir() => {}
                    _ => {
                        remove_existing(&path)?;
                        fs::DirBuilder::new()
                            .mode(0o700)
                            .create(&path)
                            .map_err(|e| TemplateError::io("create dir", &path, e))?;
                    }
                }
                let mode = match mode {
                    UnpackMode::Layer => perm & 0o1777,
                    UnpackMode::Staging => 0o755,
                };
                dirs.push(DirFixup {
                    comps: comps.clone(),
                    mode,
                    owner,
                });
            }
            EntryType::Regular | EntryType::Continuous => {
                let size = entry.size();
                if size > limits.max_file_bytes {
                    return Err(TemplateError::LimitExceeded {
                        what: "file size",
                        limit: limits.max_file_bytes,
                    });
                }
                let mtime = entry.header().mtime().ok();
                let path = ensure_dirs(dest, parents, &name)?.join(last);
                remove_existing(&path)?;
                let mut file = OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                    .open(&path)
                    .map_err(|e| TemplateError::io("create file", &path, e))?;
                let written = copy_entry(&mut entry, &mut file, &path)?;
                if written != size {
                    return Err(TemplateError::ReadArchive {
                        source: io::ErrorKind::UnexpectedEof.into(),
                    });
                }
                finish_file(&file, &path, mode, perm, owner, mtime)?;
            }
            EntryType::Symlink => {
                let target = symlink_target(&entry, &name, &limits)?;
                let path = ensure_dirs(dest, parents, &name)?.join(last);
                remove_existing(&path)?;
                std::os::unix::fs::symlink(std::ffi::OsStr::from_bytes(&target), &path)
                    .map_err(|e| TemplateError::io("create symlink", &path, e))?;
                if let Some((uid, gid)) = owner {
                    std::os::unix::fs::lchown(&path, Some(uid), Some(gid))
                        .map_err(|e| TemplateError::io("chown", &path, e))?;
                }
            }
            EntryType::Link => {
                let tpath = hardlink_source(&entry, dest, &comps, &name, &limits)?;
                let path = ensure_dirs(dest, parents, &name)?.join(last);
                remove_existing(&path)?;
                fs::hard_link(&tpath, &path)
                    .map_err(|e| TemplateError::io("create hardlink", &path, e))?;
            }
            EntryType::Char | EntryType::Block | EntryType::Fifo => {
                return Err(TemplateError::Unpack {
                    entry: name,
                    reason: "device nodes and fifos are not allowed",
                })
            }
            _ => {
                return Err(TemplateError::Unpack {
                    entry: name,
                    reason: "unsupported tar entry type",
                })
            }
        }
    }
    apply_dir_fixups(dest, &dirs)
}

/// Fails with [`TemplateError::LimitExceeded`] when a path (or link target) of `len` bytes is
/// longer than the limit.
fn check_path_len(len: usize, limits: &ImportLimits) -> Result<(), TemplateError> {
    if len > limits.max_path_len {
        return Err(TemplateError::LimitExceeded {
            what: "path length",
            limit: limits.max_path_len as u64,
        });
    }
    Ok(())
}

/// An OCI whiteout entry `<parents>/<last>` (`last` starts with `.wh.`): `.wh..wh..opq` makes
/// its directory opaque, other `.wh..wh.*` (aufs metadata) are skipped, `.wh.<name>` replaces
/// `<name>` with an overlayfs whiteout.
fn unpack_whiteout(
    dest: &Path,
    parents: &[PathBuf],
    last: &[u8],
    name: &str,
) -> Result<(), TemplateError> {
    let parent = ensure_dirs(dest, parents, name)?;
    if last == b".wh..wh..opq" {
        set_opaque(&parent)?;
    } else if last.starts_with(b".wh..wh.") {
        // aufs metadata (.wh..wh.plnk, .wh..wh.aufs): not meaningful for overlayfs.
    } else {
        let target = &last[4..];
        if matches!(target, b"" | b"." | b"..") {
            return Err(TemplateError::Unpack {
                entry: name.to_owned(),
                reason: "whiteout without a valid target name",
            });
        }
        let path = parent.join(std::ffi::OsStr::from_bytes(target));
        remove_existing(&path)?;
        make_whiteout(&path)?;
    }
    Ok(())
}

/// The target of a symlink entry: not empty, no NUL byte, within the path length limit.
fn symlink_target<R: Read>(
    entry: &tar::Entry<'_, R>,
    name: &str,
    limits: &ImportLimits,
) -> Result<Vec<u8>, TemplateError> {
    let target = entry
        .link_name_bytes()
        .map(|t| t.into_owned())
        .unwrap_or_default();
    if target.is_empty() || target.contains(&0) {
        return Err(TemplateError::Unpack {
            entry: name.to_owned(),
            reason: "symlink with an empty or invalid target",
        });
    }
    check_path_len(target.len(), limits)?;
    Ok(target)
}

/// The file a hardlink entry at `comps` links to: a regular file already extracted under
/// `dest`, reached without symlinks, other than the entry itself.
fn hardlink_source<R: Read>(
    entry: &tar::Entry<'_, R>,
    dest: &Path,
    comps: &[PathBuf],
    name: &str,
    limits: &ImportLimits,
) -> Result<PathBuf, TemplateError> {
    let target = entry
        .link_name_bytes()
        .map(|t| t.into_owned())
        .unwrap_or_default();
    check_path_len(target.len(), limits)?;
    let tcomps = normalize(&target, name)?;
    if tcomps == comps {
        return Err(TemplateError::Unpack {
            entry: name.to_owned(),
            reason: "hardlink to itself",
        });
    }
    let Some((tpath, tmeta)) = lookup_nofollow(dest, &tcomps) else {
        return Err(TemplateError::PathEscape {
            entry: name.to_owned(),
        });
    };
    if !tmeta.is_file() {
        return Err(TemplateError::Unpack {
            entry: name.to_owned(),
            reason: "hardlink target is not a regular file",
        });
    }
    Ok(tpath)
}

/// Directory modes last (so read-only directories can still be filled), deepest first,
/// re-checking that no later entry turned a parent into a symlink.
fn apply_dir_fixups(dest: &Path, dirs: &[DirFixup]) -> Result<(), TemplateError> {
    for fix in dirs.iter().rev() {
        let Some((path, meta)) = lookup_nofollow(dest, &fix.comps) else {
            continue;
        };
        if !meta.is_dir() {
            continue;
        }
        if let Some((uid, gid)) = fix.owner {
            std::os::unix::fs::lchown(&path, Some(uid), Some(gid))
                .map_err(|e| TemplateError::io("chown", &path, e))?;
        }
        fs::set_permissions(&path, Permissions::from_mode(fix.mode))
            .map_err(|e| TemplateError::io("chmod", &path, e))?;
    }
    Ok(())
}

fn copy_entry(src: &mut impl Read, file: &mut File, path: &Path) -> Result<u64, TemplateError> {
    let mut buf = vec![0u8; 64 * 1024];
    let mut total = 0u64;
    loop {
        let n = match src.read(&mut buf) {
            Ok(0) => return Ok(total),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(source) => return Err(TemplateError::ReadArchive { source }),
        };
        file.write_all(&buf[..n])
            .map_err(|e| TemplateError::io("write", path, e))?;
        total += n as u64;
    }
}

fn finish_file(
    file: &File,
    path: &Path,
    mode: UnpackMode,
    perm: u32,
    owner: Option<(u32, u32)>,
    mtime: Option<u64>,
) -> Result<(), TemplateError> {
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::fchown(file, Some(uid), Some(gid))
            .map_err(|e| TemplateError::io("chown", path, e))?;
    }
    let perm = match mode {
        UnpackMode::Layer => perm & 0o777,
        UnpackMode::Staging => 0o644,
    };
    file.set_permissions(Permissions::from_mode(perm))
        .map_err(|e| TemplateError::io("chmod", path, e))?;
    if let Some(secs) = mtime {
        if let Some(t) = SystemTime::UNIX_EPOCH.checked_add(Duration::from_secs(secs)) {
            // Best effort: mtimes matter for caches (.pyc), not for safety.
            let _ = file.set_modified(t);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalize_rules() {
        let n = |s: &str| normalize(s.as_bytes(), s);
        assert_eq!(
            n("/etc//passwd").expect("ok"),
            vec![PathBuf::from("etc"), PathBuf::from("passwd")]
        );
        assert_eq!(n("./a/./b/").expect("ok").len(), 2);
        assert!(n("./").expect("ok").is_empty());
        assert!(matches!(n("a/../b"), Err(TemplateError::PathEscape { .. })));
        assert!(matches!(n(".."), Err(TemplateError::PathEscape { .. })));
        assert!(matches!(
            normalize(b"a\0b", "x"),
            Err(TemplateError::Unpack { .. })
        ));
    }

    #[test]
    fn metered_reader_caps() {
        let data = [7u8; 100];
        let mut r = MeteredReader::new(&data[..], 100);
        assert!(r.drain().is_ok());
        assert_eq!(r.bytes_read(), 100);
        let mut r = MeteredReader::new(&data[..], 99);
        assert!(r.drain().is_err());
        assert!(r.limit_hit());
    }
}
