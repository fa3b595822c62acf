//! The read-only root image of a VM template: its merged filesystem (the template's layers, or
//! the host's `/` under the host mask) as a compressed squashfs image that guests mount
//! read-only under an overlay of their own (the writable layer is each VM's own disk).
//!
//! The image is named by what it holds, not by where it came from: [`scan_root`] walks the
//! merged view as overlayfs shows it and digests every entry's metadata (path, type, mode,
//! owner, size, modification time), so every node of a host — whatever its data dir, hence its host
//! mask — finds the one image of the same content. A scan of the host's `/` takes seconds;
//! callers remember which cheap source key led to which content ([`super::cache`]).
//!
//! squashfs rather than ext4: the image holds only the compressed data (zstd), no free space
//! and no inode tables sized ahead; `mksquashfs` compresses on every core. (EROFS, the other
//! candidate, compresses with LZ4 only and on one core in Debian 12's `erofs-utils` 1.5: on
//! this kind of host its image of the host's `/usr` is larger and takes twice as long to
//! build — docs/SPECIFICATION.md has the figures.)

use std::collections::{BTreeMap, HashSet};
use std::ffi::OsString;
use std::fs;
use std::io::{self, BufRead, BufReader};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use sha2::{Digest as _, Sha256};

use super::image::{io_err, parent_dir, ImageError};
use crate::template::unpack::{is_opaque, is_whiteout};

/// The filesystem a root image is built from.
#[derive(Debug, Clone)]
pub enum RootSource<'a> {
    /// Template layer directories, lowest first, with overlayfs semantics: whiteouts
    /// (character devices 0/0) hide lower entries, `trusted.overlay.opaque=y` directories
    /// hide lower contents.
    Layers(&'a [PathBuf]),
    /// A ready overlayfs `lowerdir=` option value, topmost layer first, e.g. `<mask>:/` for
    /// the host template.
    Overlay {
        /// The `lowerdir=` value (`:`-separated absolute paths, no escapes).
        lowerdir: String,
    },
}

/// Version of the image recipe (format, compressor, digest): part of every image's name.
pub const ROOT_FORMAT: &str = "squashfs-zstd-1";
/// File name suffix of root images.
pub const ROOT_SUFFIX: &str = ".sqfs";
/// Page size, for the staging tmpfs estimate.
const PAGE: u64 = 4096;
/// Prefix of overlayfs's private xattrs, which never belong in an image.
const OVERLAY_XATTR_PREFIX: &[u8] = b"trusted.overlay.";
/// The squashfs tool and its Debian package (installed when missing).
pub const MKSQUASHFS: &str = "mksquashfs";
const SQUASHFS_PACKAGE: &str = "squashfs-tools";

/// A merged view, walked: what an image of it needs and what names its content.
pub struct RootScan {
    lowers: Vec<Lower>,
    fixup: BTreeMap<PathBuf, PathBuf>,
    digest: String,
    /// Entries in the merged view.
    pub entries: u64,
    /// Bytes of regular file data in the merged view (each hard-linked file once).
    pub bytes: u64,
}

impl RootScan {
    /// The content digest (hex sha256 of the recipe and every entry's metadata).
    pub fn digest(&self) -> &str {
        &self.digest
    }
}

/// Walks the merged view of `src` (see [`MergeScan`]).
pub fn scan_root(src: &RootSource<'_>) -> Result<RootScan, ImageError> {
    let lowers = match src {
        RootSource::Layers(layers) => layers
            .iter()
            .rev()
            .map(|path| Lower::new(path))
            .collect::<Result<Vec<_>, _>>()?,
        RootSource::Overlay { lowerdir } => lowerdir
            .split(':')
            .map(|path| Lower::new(Path::new(path)))
            .collect::<Result<Vec<_>, _>>()?,
    };
    if lowers.is_empty() {
        return Err(ImageError::InvalidSource {
            path: PathBuf::new(),
            reason: "no layers".into(),
        });
    }
    let scan = MergeScan::run(&lowers)?;
    let (fixup, entries, bytes) = (scan.fixup, scan.entries, scan.bytes);
    let mut hash = scan.hash;
    hash.update(ROOT_FORMAT.as_bytes());
    Ok(RootScan {
        digest: hex::encode(hash.finalize()),
        lowers,
        fixup,
        entries,
        bytes,
    })
}

/// Builds the squashfs image of a scanned merged view at `out`; `progress` is told the
/// fraction of the source read so far (0.0–1.0) about once a second.
///
/// The merged view is mounted read-only with overlayfs in a private mount namespace
/// (`unshare --mount`: every mount disappears with the process, even on a crash) and packed
/// by `mksquashfs` (zstd, on every core, xattrs kept). overlayfs does the merging, so
/// whiteouts and opaque directories behave exactly as in a container, and its private xattrs
/// are not shown. Three overlayfs quirks are handled before mounting:
///
/// - a lone lower layer cannot be mounted without an upper one: an empty directory is
///   added at the bottom;
/// - lower layers nested in one another on one filesystem are refused (`ELOOP`): the
///   nested ones (e.g. the host mask, above `/`) are copied into a tmpfs first;
/// - a directory present in only one layer is listed straight from it, so its whiteouts
///   (meaningless there, but they occur) show as entries that cannot be `lstat`ed: such
///   directories get a copy (attributes only) in an extra top layer, which makes overlayfs
///   merge and filter them.
///
/// The image is built next to `out` and renamed; `out` must not be visible in the source (for
/// the host's `/`, build it in a directory the mask hides). The image is mode 0600 (the host
/// template's holds host files). Needs root.
pub fn build_root_image(
    scan: RootScan,
    out: &Path,
    progress: &mut dyn FnMut(f64),
) -> Result<(), ImageError> {
    let mksquashfs = super::image::ensure_tool(MKSQUASHFS, SQUASHFS_PACKAGE)?;
    let RootScan {
        mut lowers,
        fixup,
        bytes,
        ..
    } = scan;
    let parent = parent_dir(out);
    let work = tempfile::Builder::new()
        .prefix(".dsec-root-")
        .tempdir_in(parent)
        .map_err(|e| io_err("create temp dir in", parent, e))?;
    let work_path = canonical(work.path())?;
    if !fixup.is_empty() {
        let layer = work_path.join("fixup");
        build_fixup_layer(&layer, &fixup)?;
        lowers.insert(0, Lower::new(&layer)?);
    }
    let image = tempfile::Builder::new()
        .prefix(".dsec-root-")
        .suffix(".img.tmp")
        .tempfile_in(parent)
        .map_err(|e| io_err("create temp file in", parent, e))?;
    let image_path = canonical(image.path())?;
    let plan = BuildPlan {
        mksquashfs,
        lowers: &lowers,
        mnt: work_path.join("mnt"),
        image: image_path,
        guards: vec![work_path.clone()],
    };
    fs::create_dir(&plan.mnt).map_err(|e| io_err("create dir", &plan.mnt, e))?;
    let script = plan.script()?;
    run_watched(
        Command::new("unshare")
            .args(["--mount", "--propagation", "private", "--", "sh", "-c"])
            .arg(&script),
        &format!(
            "unshare --mount -- sh -c <mount overlay, mksquashfs> (for {})",
            out.display()
        ),
        bytes,
        progress,
    )?;
    let file = image.as_file();
    file.set_permissions(fs::Permissions::from_mode(0o600))
        .map_err(|e| io_err("chmod", image.path(), e))?;
    file.sync_all()
        .map_err(|e| io_err("sync", image.path(), e))?;
    image
        .persist(out)
        .map_err(|e| io_err("rename into place", out, e.error))?;
    Ok(())
}

/// Runs `cmd` to its end (its output captured, the tail of stderr kept for the error) and
/// reports, about once a second, how much of `total` bytes its process tree has read.
fn run_watched(
    cmd: &mut Command,
    described: &str,
    total: u64,
    progress: &mut dyn FnMut(f64),
) -> Result<(), ImageError> {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| ImageError::Spawn {
            command: described.to_owned(),
            source,
        })?;
    let pid = child.id();
    let stderr = child.stderr.take();
    let reader = std::thread::spawn(move || {
        let mut lines = Vec::new();
        if let Some(s) = stderr {
            for line in BufReader::new(s).lines().map_while(Result::ok) {
                lines.push(line);
                if lines.len() > 40 {
                    lines.remove(0);
                }
            }
        }
        lines.join("\n")
    });
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) => {}
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(io_err("wait for", Path::new(described), e));
            }
        }
        if total > 0 {
            progress((tree_read_bytes(pid) as f64 / total as f64).min(0.99));
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    let stderr = reader.join().unwrap_or_default();
    if !status.success() {
        return Err(ImageError::Command {
            command: described.to_owned(),
            status: status.to_string(),
            stderr,
        });
    }
    progress(1.0);
    Ok(())
}

/// Bytes read (`rchar`) by process `pid` and its descendants.
fn tree_read_bytes(pid: u32) -> u64 {
    let mut total = 0;
    let mut todo = vec![pid.to_string()];
    while let Some(p) = todo.pop() {
        let io = fs::read_to_string(format!("/proc/{p}/io")).unwrap_or_default();
        total += io
            .lines()
            .find_map(|l| l.strip_prefix("rchar: "))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0);
        for task in fs::read_dir(format!("/proc/{p}/task"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let children = fs::read_to_string(task.path().join("children")).unwrap_or_default();
            todo.extend(children.split_whitespace().map(str::to_owned));
        }
    }
    total
}

/// One lower layer of a merged view.
struct Lower {
    /// Canonical path.
    path: PathBuf,
    /// Device of `path`.
    dev: u64,
}

impl Lower {
    fn new(path: &Path) -> Result<Self, ImageError> {
        let invalid = |reason: &str| ImageError::InvalidSource {
            path: path.to_path_buf(),
            reason: reason.into(),
        };
        if !path.is_absolute() {
            return Err(invalid("not an absolute path"));
        }
        let canonical = canonical(path)?;
        let meta = fs::metadata(&canonical).map_err(|e| io_err("stat", &canonical, e))?;
        if !meta.is_dir() {
            return Err(invalid("not a directory"));
        }
        check_option_path(&canonical)?;
        Ok(Self {
            path: canonical,
            dev: meta.dev(),
        })
    }

    /// Whether the directory `path` (with metadata `meta`) in this layer belongs to the
    /// layer's own filesystem and mount: overlayfs does not cross mount points inside a
    /// layer (it shows the directory underneath), bind mounts of the same filesystem
    /// included.
    fn same_mount(&self, path: &Path, meta: &fs::Metadata) -> bool {
        use rustix::fs::{AtFlags, StatxAttributes, StatxFlags};
        if meta.dev() != self.dev {
            return false;
        }
        // Without statx (Linux < 4.11) or STATX_ATTR_MOUNT_ROOT (< 5.8) only `st_dev` tells.
        match rustix::fs::statx(
            rustix::fs::CWD,
            path,
            AtFlags::SYMLINK_NOFOLLOW,
            StatxFlags::BASIC_STATS,
        ) {
            Ok(stx) => {
                !(stx
                    .stx_attributes_mask
                    .contains(StatxAttributes::MOUNT_ROOT)
                    && stx.stx_attributes.contains(StatxAttributes::MOUNT_ROOT))
            }
            Err(_) => true,
        }
    }
}

/// `fs::canonicalize` with a typed error.
fn canonical(path: &Path) -> Result<PathBuf, ImageError> {
    fs::canonicalize(path).map_err(|e| io_err("resolve", path, e))
}

/// Fails unless `path` can appear in a mount option and a shell script unescaped.
fn check_option_path(path: &Path) -> Result<&str, ImageError> {
    let text = path.to_str().filter(|t| {
        !t.chars()
            .any(|c| matches!(c, ':' | ',' | '\\') || c.is_control())
    });
    text.ok_or_else(|| ImageError::InvalidSource {
        path: path.to_path_buf(),
        reason: "paths in an overlayfs lowerdir must be UTF-8 without ':', ',', '\\' or \
                 control characters"
            .into(),
    })
}

/// Space used by a filesystem tree in pages (the staging tmpfs's estimate).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Usage {
    bytes: u64,
    inodes: u64,
}

/// A walk of the merged view of lower layers (topmost first), simulating overlayfs lookup,
/// to name its content and find what the build must fix up.
///
/// Each directory of each layer is listed once and its entries `lstat`ed once. Whiteouts
/// and opaque directories hide what is below them, and directories that are mount points
/// inside a layer are not entered (overlayfs shows the directory underneath, usually
/// empty), so whatever a layer holds but the merged view does not show (the host's `/work`
/// under the host mask, `/proc`…) is not counted. A live filesystem (the host's `/`) may
/// change during the walk: entries that disappear are skipped.
///
/// The digest covers, in path order, each entry's relative path and type, mode and owner,
/// and for everything but directories its size, modification time and device number: a file
/// written, replaced, re-owned or re-moded changes it, wherever the tree lies (unpacked
/// template layers keep their archive's times, so one template imported by two nodes has one
/// image). A directory's times are left out — they are where the host mask differs from node
/// to node (its directories are made when the node starts) — and so are change times (a
/// capability set with `setcap` alone keeps the old image until the cache is cleared).
struct MergeScan<'a> {
    lowers: &'a [Lower],
    /// Digest of the merged view so far.
    hash: Sha256,
    /// Entries seen.
    entries: u64,
    /// Regular file bytes (each hard-linked file once).
    bytes: u64,
    /// (device, inode) of hard-linked files already counted.
    seen: HashSet<(u64, u64)>,
    /// Directories (relative paths, `""` for the root) to recreate in the fix-up layer,
    /// with the directory whose attributes they must copy (the topmost one, which overlayfs
    /// shows).
    fixup: BTreeMap<PathBuf, PathBuf>,
}

/// An entry of a merged directory in one layer: the layer's index and the entry's metadata.
type Found = (usize, fs::Metadata);

impl<'a> MergeScan<'a> {
    fn run(lowers: &'a [Lower]) -> Result<Self, ImageError> {
        let mut scan = Self {
            lowers,
            hash: Sha256::new(),
            entries: 0,
            bytes: 0,
            seen: HashSet::new(),
            fixup: BTreeMap::new(),
        };
        let all: Vec<usize> = (0..lowers.len()).collect();
        let mut ancestors = Vec::new();
        scan.dir(Path::new(""), &all, &mut ancestors)?;
        Ok(scan)
    }

    /// Scans the merged directory `rel`, made of the directories `rel` in the layers
    /// `layers` (topmost first). `ancestors` are the merged directories above it, with the
    /// directory overlayfs takes their attributes from.
    fn dir(
        &mut self,
        rel: &Path,
        layers: &[usize],
        ancestors: &mut Vec<(PathBuf, PathBuf)>,
    ) -> Result<(), ImageError> {
        let lowers = self.lowers;
        let Some(top) = layers.first().and_then(|&i| lowers.get(i)) else {
            return Ok(());
        };
        let top_dir = top.path.join(rel);
        let Some(meta) = unless_gone(fs::symlink_metadata(&top_dir), "stat", &top_dir)? else {
            return Ok(());
        };
        self.count(rel, 'd', &meta);
        ancestors.push((rel.to_path_buf(), top_dir));
        // Name → its entries in the layers that have it, topmost first.
        let mut names = BTreeMap::<OsString, Vec<Found>>::new();
        let mut whiteouts = false;
        for &i in layers {
            let Some(lower) = lowers.get(i) else {
                continue;
            };
            let dir = lower.path.join(rel);
            let Some(entries) = unless_gone(fs::read_dir(&dir), "read dir", &dir)? else {
                continue;
            };
            for entry in entries {
                let entry = entry.map_err(|e| io_err("read dir", &dir, e))?;
                let Some(meta) = unless_gone(entry.metadata(), "stat", &entry.path())? else {
                    continue;
                };
                whiteouts |= is_whiteout(&meta);
                names.entry(entry.file_name()).or_default().push((i, meta));
            }
        }
        if layers.len() == 1 && whiteouts {
            // Listed straight from its only layer: the whiteouts would show.
            for (dir, source) in ancestors.iter() {
                self.fixup.insert(dir.clone(), source.clone());
            }
        }
        for (name, found) in &names {
            self.entry(&rel.join(name), found, ancestors)?;
        }
        ancestors.pop();
        Ok(())
    }

    /// Resolves `rel` from its entries `found` in the layers of its parent (topmost first)
    /// as overlayfs does: the topmost entry wins; directories merge down to an opaque one, a
    /// whiteout or a non-directory.
    fn entry(
        &mut self,
        rel: &Path,
        found: &[Found],
        ancestors: &mut Vec<(PathBuf, PathBuf)>,
    ) -> Result<(), ImageError> {
        let lowers = self.lowers;
        let mut dirs = Vec::new();
        // A mount point seen in a layer: overlayfs shows the directory underneath.
        let mut mount_point = false;
        for (n, (i, meta)) in found.iter().enumerate() {
            let Some(lower) = lowers.get(*i) else {
                continue;
            };
            if is_whiteout(meta) {
                break;
            }
            let path = lower.path.join(rel);
            if meta.is_dir() {
                if !lower.same_mount(&path, meta) {
                    mount_point = true;
                    continue;
                }
                dirs.push(*i);
                // An opaque directory matters only with layers below it.
                if n + 1 < found.len() && is_opaque(&path) {
                    break;
                }
                continue;
            }
            if dirs.is_empty() && !mount_point {
                self.count(rel, 'f', meta);
            }
            break;
        }
        if !dirs.is_empty() {
            self.dir(rel, &dirs, ancestors)?;
        } else if mount_point {
            // An empty directory in the image; whatever is mounted there does not count.
            self.hash.update(b"m\0");
            self.hash.update(rel.as_os_str().as_encoded_bytes());
            self.hash.update(b"\0");
            self.entries += 1;
        }
        Ok(())
    }

    /// Adds the entry `rel` (`'d'` a merged directory, `'f'` anything else) to the digest.
    fn count(&mut self, rel: &Path, kind: char, meta: &fs::Metadata) {
        self.entries += 1;
        let head = format!("{kind} {:o} {} {}", meta.mode(), meta.uid(), meta.gid());
        let tail = if kind == 'd' {
            String::new()
        } else {
            if meta.is_file() && (meta.nlink() == 1 || self.seen.insert((meta.dev(), meta.ino()))) {
                self.bytes += meta.len();
            }
            format!(
                " {} {}.{} {}",
                meta.len(),
                meta.mtime(),
                meta.mtime_nsec(),
                meta.rdev()
            )
        };
        self.hash.update(rel.as_os_str().as_encoded_bytes());
        self.hash.update(b"\0");
        self.hash.update(head.as_bytes());
        self.hash.update(tail.as_bytes());
        self.hash.update(b"\n");
    }
}

/// Creates the fix-up layer at `root`: the directories `dirs` (relative path → directory to
/// copy mode, owner, times and xattrs from), nothing else. Not opaque, it changes no
/// contents; it only makes overlayfs merge (and filter) those directories.
/// `r`, or `None` when the file is gone (never there, or removed while the layers are read).
fn unless_gone<T>(
    r: io::Result<T>,
    op: &'static str,
    path: &Path,
) -> Result<Option<T>, ImageError> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_err(op, path, e)),
    }
}

fn build_fixup_layer(root: &Path, dirs: &BTreeMap<PathBuf, PathBuf>) -> Result<(), ImageError> {
    // Sorted, so parents come first; times are set last, deepest first, because creating
    // an entry changes its parent's mtime.
    for rel in dirs.keys() {
        let path = root.join(rel);
        fs::create_dir_all(&path).map_err(|e| io_err("create dir", &path, e))?;
    }
    for (rel, source) in dirs.iter().rev() {
        copy_dir_attributes(source, &root.join(rel))?;
    }
    Ok(())
}

/// Copies mode, owner, xattrs (but overlayfs's own) and times of directory `src` to `dst`.
fn copy_dir_attributes(src: &Path, dst: &Path) -> Result<(), ImageError> {
    let meta = fs::symlink_metadata(src).map_err(|e| io_err("stat", src, e))?;
    std::os::unix::fs::lchown(dst, Some(meta.uid()), Some(meta.gid()))
        .map_err(|e| io_err("chown", dst, e))?;
    fs::set_permissions(dst, fs::Permissions::from_mode(meta.mode() & 0o7777))
        .map_err(|e| io_err("chmod", dst, e))?;
    for name in xattr_names(src)? {
        if name.starts_with(OVERLAY_XATTR_PREFIX) {
            continue;
        }
        let name = String::from_utf8_lossy(&name).into_owned();
        let mut value = vec![0u8; 64 * 1024];
        let len = rustix::fs::lgetxattr(src, name.as_str(), &mut value[..])
            .map_err(|e| io_err("get xattr", src, e.into()))?;
        value.truncate(len);
        rustix::fs::lsetxattr(dst, name.as_str(), &value, rustix::fs::XattrFlags::empty())
            .map_err(|e| io_err("set xattr", dst, e.into()))?;
    }
    let times = rustix::fs::Timestamps {
        last_access: rustix::fs::Timespec {
            tv_sec: meta.atime(),
            tv_nsec: meta.atime_nsec(),
        },
        last_modification: rustix::fs::Timespec {
            tv_sec: meta.mtime(),
            tv_nsec: meta.mtime_nsec(),
        },
    };
    rustix::fs::utimensat(
        rustix::fs::CWD,
        dst,
        &times,
        rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
    )
    .map_err(|e| io_err("set times", dst, e.into()))
}

/// The names of the xattrs of `path` (not following symlinks).
fn xattr_names(path: &Path) -> Result<Vec<Vec<u8>>, ImageError> {
    let mut buf = vec![0u8; 64 * 1024];
    let len = match rustix::fs::llistxattr(path, &mut buf[..]) {
        Ok(len) => len,
        Err(rustix::io::Errno::NOTSUP) => 0,
        Err(e) => return Err(io_err("list xattrs", path, e.into())),
    };
    Ok(buf
        .get(..len)
        .unwrap_or_default()
        .split(|&b| b == 0)
        .filter(|n| !n.is_empty())
        .map(<[u8]>::to_vec)
        .collect())
}

/// What the build script run in the private mount namespace does.
struct BuildPlan<'a> {
    /// The `mksquashfs` binary.
    mksquashfs: PathBuf,
    /// The lower layers, topmost first.
    lowers: &'a [Lower],
    /// Where the tmpfs holding the merged mount point and staged layers is mounted.
    mnt: PathBuf,
    /// The image file to fill.
    image: PathBuf,
    /// Paths that must not be visible in the merged view (the work directory, next to the
    /// image): if they are, the image would contain itself.
    guards: Vec<PathBuf>,
}

impl BuildPlan<'_> {
    /// The shell script: mount a tmpfs at `mnt`, copy the nested layers into it, mount the
    /// merged view, check the guards, run mksquashfs.
    fn script(&self) -> Result<String, ImageError> {
        let mnt = check_option_path(&self.mnt)?;
        let image = self
            .image
            .to_str()
            .ok_or_else(|| ImageError::InvalidSource {
                path: self.image.clone(),
                reason: "not UTF-8".into(),
            })?;
        let merged = format!("{mnt}/merged");
        let mut script = String::from("set -eu\n");
        let mut lowerdir = Vec::new();
        let mut stage = Vec::new();
        let mut stage_bytes = 0;
        for (i, lower) in self.lowers.iter().enumerate() {
            let nested = self.lowers.iter().enumerate().any(|(j, other)| {
                j != i && other.dev == lower.dev && lower.path.starts_with(&other.path)
            });
            if nested {
                let copy = format!("{mnt}/stage/{i}");
                stage_bytes += tree_usage(&lower.path)?.bytes;
                stage.push(format!(
                    "cp -a {} {}\n",
                    sh_quote(check_option_path(&lower.path)?),
                    sh_quote(&copy)
                ));
                lowerdir.push(copy);
            } else {
                lowerdir.push(check_option_path(&lower.path)?.to_string());
            }
        }
        if lowerdir.len() == 1 {
            // overlayfs needs two lower layers when there is no upper one.
            lowerdir.push(format!("{mnt}/empty"));
        }
        let tmpfs_kib = (stage_bytes + (16 << 20)) / 1024;
        script.push_str(&format!(
            "mount -t tmpfs -o size={tmpfs_kib}k,mode=0700 dsec-root {}\n",
            sh_quote(mnt)
        ));
        script.push_str(&format!(
            "mkdir {} {} {}\n",
            sh_quote(&merged),
            sh_quote(&format!("{mnt}/empty")),
            sh_quote(&format!("{mnt}/stage"))
        ));
        script.extend(stage);
        script.push_str(&format!(
            "mount -t overlay overlay -o {} {}\n",
            sh_quote(&format!("ro,lowerdir={}", lowerdir.join(":"))),
            sh_quote(&merged)
        ));
        for guard in &self.guards {
            for lower in self.lowers {
                if let Ok(rel) = guard.strip_prefix(&lower.path) {
                    let seen = format!("{merged}/{}", rel.to_string_lossy());
                    script.push_str(&format!(
                        "if [ -e {q} ] || [ -L {q} ]; then echo {msg} >&2; exit 3; fi\n",
                        q = sh_quote(&seen),
                        msg = sh_quote(&format!(
                            "{} is visible in the image source (the image would contain \
                             itself): build it in a directory the source hides",
                            guard.display()
                        )),
                    ));
                }
            }
        }
        // zstd level 1: on this kind of host within 5% of level 3's size, half its time.
        script.push_str(&format!(
            "{} {} {} -noappend -quiet -no-progress -xattrs -no-exports \
             -comp zstd -Xcompression-level 1\n",
            sh_quote(check_option_path(&self.mksquashfs)?),
            sh_quote(&merged),
            sh_quote(image),
        ));
        Ok(script)
    }
}

/// `s` quoted for the shell.
fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The usage of the tree at `path` (one filesystem, each hard-linked file once), in tmpfs
/// pages.
fn tree_usage(path: &Path) -> Result<Usage, ImageError> {
    fn walk(
        path: &Path,
        dev: u64,
        usage: &mut Usage,
        seen: &mut HashSet<(u64, u64)>,
    ) -> Result<(), ImageError> {
        let meta = fs::symlink_metadata(path).map_err(|e| io_err("stat", path, e))?;
        if meta.dev() != dev
            || (meta.nlink() > 1 && !meta.is_dir() && !seen.insert((dev, meta.ino())))
        {
            return Ok(());
        }
        usage.inodes += 1;
        usage.bytes += meta.len().div_ceil(PAGE).max(1) * PAGE;
        if meta.is_dir() {
            for entry in fs::read_dir(path).map_err(|e| io_err("read dir", path, e))? {
                let entry = entry.map_err(|e| io_err("read dir", path, e))?;
                walk(&entry.path(), dev, usage, seen)?;
            }
        }
        Ok(())
    }
    let dev = fs::symlink_metadata(path)
        .map_err(|e| io_err("stat", path, e))?
        .dev();
    let mut usage = Usage::default();
    walk(path, dev, &mut usage, &mut HashSet::new())?;
    Ok(usage)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn option_paths_are_checked() {
        assert!(check_option_path(Path::new("/a/b c")).is_ok());
        for bad in ["/a:b", "/a,b", "/a\\b", "/a\nb"] {
            assert!(check_option_path(Path::new(bad)).is_err(), "{bad}");
        }
        assert_eq!(sh_quote("it's"), r"'it'\''s'");
    }

    fn whiteout(path: &Path) -> anyhow::Result<()> {
        rustix::fs::mknodat(
            rustix::fs::CWD,
            path,
            rustix::fs::FileType::CharacterDevice,
            rustix::fs::Mode::from_raw_mode(0),
            0,
        )?;
        Ok(())
    }

    fn opaque(path: &Path) -> anyhow::Result<()> {
        rustix::fs::lsetxattr(
            path,
            dsec_sys::layer::OPAQUE_XATTR,
            b"y",
            rustix::fs::XattrFlags::empty(),
        )?;
        Ok(())
    }

    fn digest(layers: &[PathBuf]) -> anyhow::Result<(String, u64, u64)> {
        let s = scan_root(&RootSource::Layers(layers))?;
        Ok((s.digest().to_owned(), s.entries, s.bytes))
    }

    /// The digest names the merged view's content: a directory's own times (where host masks
    /// of different nodes differ) and what a layer hides do not count; a changed file does.
    #[test]
    fn merged_view_digest_follows_content_not_location() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let base = dir.path().join("base");
        let (top_a, top_b) = (dir.path().join("top-a"), dir.path().join("top-b"));
        for d in ["etc", "usr/lib", "var"] {
            fs::create_dir_all(base.join(d))?;
        }
        fs::write(base.join("etc/passwd"), "root:x:0:0\n")?;
        fs::hard_link(base.join("etc/passwd"), base.join("usr/passwd"))?;
        fs::write(base.join("usr/lib/big"), vec![7u8; 8 << 10])?;
        fs::write(base.join("var/log"), "hidden")?;
        // Two masks of the same content made at different times.
        for top in [&top_a, &top_b] {
            fs::create_dir_all(top.join("etc"))?;
            whiteout(&top.join("var"))?;
            std::thread::sleep(Duration::from_millis(20));
        }
        let a = digest(&[base.clone(), top_a.clone()])?;
        let b = digest(&[base.clone(), top_b.clone()])?;
        assert_eq!(a, b, "same content, other mask directories");
        // dirs /, etc, usr, usr/lib + passwd, usr/passwd, big; var is hidden.
        assert_eq!(a.1, 7, "{a:?}");
        assert_eq!(a.2, 11 + (8 << 10), "a hard-linked file counts once: {a:?}");
        // What the mask hides does not count.
        fs::write(base.join("var/log"), "changed but hidden")?;
        assert_eq!(digest(&[base.clone(), top_a.clone()])?, a);
        // A changed file does.
        fs::write(base.join("usr/lib/big"), vec![8u8; 8 << 10])?;
        let changed = digest(&[base.clone(), top_a.clone()])?;
        assert_ne!(changed.0, a.0, "rewritten in place, same size");
        fs::set_permissions(base.join("etc/passwd"), fs::Permissions::from_mode(0o600))?;
        assert_ne!(digest(&[base.clone(), top_a.clone()])?.0, changed.0);
        if rustix::process::geteuid().is_root() {
            // An opaque directory hides what is below it.
            fs::write(base.join("etc/shadow"), "x")?;
            let before = digest(&[base.clone(), top_a.clone()])?;
            opaque(&top_a.join("etc"))?;
            let hidden = digest(&[base.clone(), top_a.clone()])?;
            assert_ne!(hidden.0, before.0);
            assert_eq!(
                hidden.1,
                before.1 - 2,
                "etc/passwd and etc/shadow are hidden"
            );
        }
        Ok(())
    }

    // -- Root images: these need root, unshare, mount and squashfs-tools. --

    /// The root-image tests need root and these tools (the test command installs them); a
    /// machine without them fails the tests instead of skipping them.
    fn require_image_tools() {
        assert!(
            rustix::process::geteuid().is_root(),
            "the root-image tests need root"
        );
        for tool in ["unshare", MKSQUASHFS, "unsquashfs", "mount"] {
            let found = ["/usr/bin", "/usr/sbin", "/bin", "/sbin"]
                .iter()
                .any(|d| Path::new(d).join(tool).exists());
            assert!(
                found,
                "the root-image tests need {tool} (scripts/test.sh installs it)"
            );
        }
    }

    /// Every entry of a squashfs image (`unsquashfs -lln`): path (`""` for the root) →
    /// (permissions as `ls` shows them, `uid/gid`, size).
    fn image_tree(image: &Path) -> anyhow::Result<BTreeMap<String, (String, String, u64)>> {
        let out = Command::new("unsquashfs")
            .args(["-lln", "-d", ""])
            .arg(image)
            .output()?;
        anyhow::ensure!(out.status.success(), "unsquashfs: {out:?}");
        let mut entries = BTreeMap::new();
        for line in String::from_utf8(out.stdout)?.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() < 5 {
                continue;
            }
            let path = fields.get(5).map_or("", |p| *p).to_owned();
            entries.insert(
                path,
                (
                    fields[0].to_owned(),
                    fields[1].to_owned(),
                    fields[2].parse().unwrap_or(0),
                ),
            );
        }
        Ok(entries)
    }

    fn children(tree: &BTreeMap<String, (String, String, u64)>, dir: &str) -> Vec<String> {
        tree.keys()
            .filter_map(|p| p.strip_prefix(&format!("{dir}/")))
            .filter(|rest| !rest.contains('/'))
            .map(str::to_owned)
            .collect()
    }

    fn build(layers: &[PathBuf], out: &Path) -> Result<(), ImageError> {
        let scan = scan_root(&RootSource::Layers(layers))?;
        build_root_image(scan, out, &mut |_| {})
    }

    #[test]
    fn root_image_from_layers() -> anyhow::Result<()> {
        require_image_tools();
        let dir = tempfile::tempdir()?;
        let base = dir.path().join("base");
        let top = dir.path().join("top");
        for d in ["etc", "opaque", "usr/lib"] {
            fs::create_dir_all(base.join(d))?;
        }
        fs::write(base.join("etc/passwd"), "root:x:0:0\n")?;
        fs::write(base.join("etc/gone"), "deleted above")?;
        fs::write(base.join("opaque/hidden"), "hidden by an opaque dir")?;
        fs::write(base.join("usr/lib/big"), vec![7u8; 100_000])?;
        fs::hard_link(base.join("usr/lib/big"), base.join("usr/lib/big-link"))?;
        std::os::unix::fs::symlink("../etc/passwd", base.join("usr/passwd-link"))?;
        whiteout(&base.join("meaningless"))?; // in the lowest layer: hidden all the same
        for d in ["etc", "opaque", "newdir/sub"] {
            fs::create_dir_all(top.join(d))?;
        }
        whiteout(&top.join("etc/gone"))?;
        fs::write(top.join("etc/hostname"), "sandbox\n")?;
        opaque(&top.join("opaque"))?;
        fs::write(top.join("opaque/visible"), "only this")?;
        // A directory only in this layer with a (meaningless) whiteout: overlayfs would list it.
        whiteout(&top.join("newdir/sub/phantom"))?;
        fs::write(top.join("newdir/sub/real"), "real")?;
        fs::set_permissions(top.join("newdir"), fs::Permissions::from_mode(0o750))?;
        std::os::unix::fs::lchown(top.join("newdir"), Some(1234), Some(5678))?;

        let out_dir = dir.path().join("images");
        fs::create_dir(&out_dir)?;
        let out = out_dir.join("root.img");
        let mut seen = Vec::new();
        let scan = scan_root(&RootSource::Layers(&[base.clone(), top.clone()]))?;
        build_root_image(scan, &out, &mut |f| seen.push(f))?;
        assert_eq!(seen.last(), Some(&1.0), "progress ends at 1: {seen:?}");

        assert_eq!(
            fs::read_dir(&out_dir)?.count(),
            1,
            "no temporary files left"
        );
        let meta = fs::metadata(&out)?;
        assert_eq!(meta.mode() & 0o777, 0o600);
        assert!(meta.len() < 64 << 10, "compressed: {} bytes", meta.len());

        let tree = image_tree(&out)?;
        assert_eq!(
            children(&tree, ""),
            ["etc", "newdir", "opaque", "usr"],
            "{tree:#?}"
        );
        assert_eq!(children(&tree, "/etc"), ["hostname", "passwd"]);
        assert_eq!(children(&tree, "/opaque"), ["visible"]);
        assert_eq!(children(&tree, "/newdir/sub"), ["real"]);
        assert_eq!(tree["/newdir"].0, "drwxr-x---");
        assert_eq!(tree["/newdir"].1, "1234/5678");
        assert_eq!(tree["/usr/lib/big"].2, 100_000);
        assert!(tree["/usr/passwd-link"].0.starts_with('l'));
        // No overlayfs xattr leaked.
        let x = dir.path().join("x");
        let st = Command::new("unsquashfs")
            .arg("-q")
            .arg("-d")
            .arg(&x)
            .arg(&out)
            .arg("/opaque")
            .output()?;
        assert!(st.status.success(), "{st:?}");
        let names = xattr_names(&x.join("opaque"))?;
        assert!(
            !names.iter().any(|n| n.starts_with(OVERLAY_XATTR_PREFIX)),
            "{names:?}"
        );
        Ok(())
    }

    #[test]
    fn root_image_from_one_layer_and_nested_lowerdir() -> anyhow::Result<()> {
        require_image_tools();
        let dir = tempfile::tempdir()?;
        let layer = dir.path().join("layer");
        fs::create_dir_all(layer.join("bin"))?;
        fs::write(layer.join("bin/sh"), "#!")?;
        whiteout(&layer.join("bin/stale"))?;
        let out_dir = dir.path().join("images");
        fs::create_dir(&out_dir)?;

        let single = out_dir.join("single.img");
        build(std::slice::from_ref(&layer), &single)?;
        let tree = image_tree(&single)?;
        assert_eq!(children(&tree, ""), ["bin"]);
        assert_eq!(children(&tree, "/bin"), ["sh"]);

        // A mask layer inside the layer below it (like the host mask inside `/`): overlayfs
        // refuses that (ELOOP), so the mask is staged on a tmpfs.
        let mask = layer.join("mask");
        fs::create_dir_all(mask.join("bin"))?;
        whiteout(&mask.join("bin/sh"))?;
        whiteout(&mask.join("mask"))?;
        let lowerdir = format!("{}:{}", mask.display(), layer.display());
        let nested = out_dir.join("nested.img");
        let scan = scan_root(&RootSource::Overlay { lowerdir })?;
        build_root_image(scan, &nested, &mut |_| {})?;
        let tree = image_tree(&nested)?;
        assert_eq!(children(&tree, ""), ["bin"]);
        assert!(children(&tree, "/bin").is_empty());

        // An image whose temporary files would be visible in its own source is refused.
        let inside = layer.join("inside.img");
        let err = build(std::slice::from_ref(&layer), &inside);
        assert!(
            matches!(&err, Err(ImageError::Command { stderr, .. }) if stderr.contains("visible")),
            "{err:?}"
        );
        assert!(!inside.exists());
        assert_eq!(
            fs::read_dir(&layer)?.count(),
            2,
            "temporary files are removed"
        );

        let err = scan_root(&RootSource::Overlay {
            lowerdir: "relative".into(),
        });
        assert!(
            matches!(err, Err(ImageError::InvalidSource { .. })),
            "{:?}",
            err.map(|s| s.digest)
        );
        Ok(())
    }

    /// Builds the host template's root image (`<mask>:/`) at `$DSEC_DEV_HOST_IMAGE`, whose
    /// directory must be hidden by the mask (e.g. under `/var/cache`), and prints its size
    /// and the time the scan and the build took: `DSEC_DEV_HOST_IMAGE=/var/cache/dsec-dev/
    /// host-root.sqfs cargo test -p dsec-node --lib vm::rootfs -- --ignored --nocapture`.
    #[test]
    #[ignore = "builds an image of the host's /; set DSEC_DEV_HOST_IMAGE"]
    fn real_host_root_image() -> anyhow::Result<()> {
        let out = crate::substrate::vm::dev_path("DSEC_DEV_HOST_IMAGE");
        let data_dir = parent_dir(&out).join("host-data");
        fs::create_dir_all(&data_dir)?;
        let mask = crate::template::host_mask_layer(&data_dir, &[])?;
        let start = std::time::Instant::now();
        let lowerdir = format!("{}:/", mask.display());
        let scan = scan_root(&RootSource::Overlay { lowerdir })?;
        eprintln!(
            "merged view: {} entries, {} file bytes, digest {}, scanned in {:?}",
            scan.entries,
            scan.bytes,
            scan.digest(),
            start.elapsed()
        );
        let start = std::time::Instant::now();
        build_root_image(scan, &out, &mut |_| {})?;
        let meta = fs::metadata(&out)?;
        eprintln!(
            "{}: {} bytes in {:?}",
            out.display(),
            meta.len(),
            start.elapsed()
        );
        let tree = image_tree(&out)?;
        assert!(!tree.contains_key("/etc/shadow"));
        assert!(tree.contains_key("/etc/passwd"));
        assert!(children(&tree, "/root").is_empty());
        assert!(children(&tree, "/var/cache").is_empty());
        assert_eq!(tree["/tmp"].0, "drwxrwxrwt");
        Ok(())
    }
}
