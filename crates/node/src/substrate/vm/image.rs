//! Guest artifacts for the QEMU microVM substrate, built from Debian packages only.
//!
//! Besides QEMU itself ([`ensure_qemu`]), a guest needs:
//!
//! - a **kernel** ([`prepare_kernel`]): Debian's cloud kernel (`linux-image-cloud-amd64`, the
//!   smallest kernel Debian ships, with virtio and PVH support), unpacked from its `.deb` with
//!   `dpkg-deb` into a cache directory. The LZ4-compressed `bzImage` is decompressed once into
//!   the ELF `vmlinux` it wraps, which QEMU boots directly through the PVH entry point: no
//!   in-guest decompression, a faster boot. Debian's `.deb` has no `modules.dep` (the
//!   package's postinst runs `depmod`), so it is generated here from the modules' `.modinfo`
//!   sections, without needing kmod on the host.
//! - an **initramfs** ([`build_initramfs`]): an uncompressed newc cpio archive with the dsec
//!   agent as `/init` and the few kernel modules it loads (virtio transports, block, console,
//!   rng, overlayfs) plus their dependencies, in load order.
//! - a **root image** ([`super::rootfs`]): a template's merged filesystem (its layers, or
//!   the host's `/` under the host mask) as a compressed squashfs image that guests use
//!   read-only, under an overlay of their own;
//! - the **writable layer's disk** ([`build_upper_image`]): an empty ext4 filesystem per
//!   snapshot, each VM's private copy-on-write overlay of it.
//!
//! Everything is written atomically (a temporary file or directory next to the target, then
//! a rename), so a crash never leaves a half-built artifact under its final name.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::io::{self, BufWriter, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

/// Errors of guest image preparation.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// A filesystem operation failed.
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file or directory concerned.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// An external command could not be started.
    #[error("cannot run `{command}`: {source}")]
    Spawn {
        /// The command line.
        command: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// An external command exited unsuccessfully.
    #[error("`{command}` failed ({status}): {stderr}")]
    Command {
        /// The command line.
        command: String,
        /// How it exited.
        status: String,
        /// The end of its standard error.
        stderr: String,
    },
    /// A Debian package does not have the expected contents.
    #[error("package {}: {reason}", path.display())]
    Package {
        /// The `.deb` (or the directory it was downloaded to).
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A kernel module requested for the initramfs is neither a module nor built in.
    #[error("kernel module not found: {0}")]
    ModuleNotFound(String),
    /// The kernel's module index (`modules.dep`) or a module file is unusable.
    #[error("kernel modules {}: {reason}", path.display())]
    ModuleIndex {
        /// The index or module file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A file does not fit the newc cpio format (at most 4 GiB - 1 per file).
    #[error("{}: {size} bytes is too large for a cpio archive", path.display())]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size.
        size: u64,
    },
    /// A root image source or destination is unusable.
    #[error("root image {}: {reason}", path.display())]
    InvalidSource {
        /// The layer, lowerdir entry or output concerned.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A tool (QEMU, mksquashfs) is still missing after installing its package.
    #[error("{binary} not found after installing {package}")]
    ToolMissing {
        /// The binary looked for.
        binary: &'static str,
        /// The Debian package installed.
        package: &'static str,
    },
}

pub(super) fn io_err(op: &'static str, path: &Path, source: io::Error) -> ImageError {
    ImageError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

// ---------------------------------------------------------------------------------------------
// External commands
// ---------------------------------------------------------------------------------------------

/// How much of a failed command's standard error is kept in [`ImageError::Command`].
const STDERR_TAIL: usize = 2000;

/// The command line of `cmd`, for error messages.
fn describe(cmd: &Command) -> String {
    let mut line = cmd.get_program().to_string_lossy().into_owned();
    for arg in cmd.get_args() {
        line.push(' ');
        line.push_str(&arg.to_string_lossy());
    }
    line
}

/// The last [`STDERR_TAIL`] bytes of `bytes` (cut at a character boundary), trimmed.
fn tail(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let text = text.trim();
    let mut start = text.len().saturating_sub(STDERR_TAIL);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    if start == 0 {
        text.to_string()
    } else {
        format!("…{}", &text[start..])
    }
}

/// Runs `cmd` (stdin from /dev/null, output captured) and fails unless it exits with 0.
fn run(cmd: &mut Command) -> Result<Output, ImageError> {
    let command = describe(cmd);
    run_described(cmd, command)
}

/// [`run`] with an explicit description (for commands whose arguments are too long to quote).
fn run_described(cmd: &mut Command, command: String) -> Result<Output, ImageError> {
    let out = match cmd.stdin(Stdio::null()).output() {
        Ok(out) => out,
        Err(source) => return Err(ImageError::Spawn { command, source }),
    };
    if out.status.success() {
        Ok(out)
    } else {
        Err(ImageError::Command {
            command,
            status: out.status.to_string(),
            stderr: tail(&out.stderr),
        })
    }
}

/// Runs `apt-get <args>` (in `dir`, if given). On a fresh machine apt's package lists are
/// missing, and on an old one they are stale (the versions they name are gone from the
/// mirror), so a failure is retried once after `apt-get update`.
fn apt_get(args: &[&str], dir: Option<&Path>) -> Result<Output, ImageError> {
    let attempt = || {
        let mut cmd = Command::new("apt-get");
        cmd.arg("-q")
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive");
        if let Some(dir) = dir {
            cmd.current_dir(dir);
        }
        run(&mut cmd)
    };
    match attempt() {
        Err(ImageError::Command { .. }) => {
            run(Command::new("apt-get")
                .args(["-q", "update"])
                .env("DEBIAN_FRONTEND", "noninteractive"))?;
            attempt()
        }
        other => other,
    }
}

/// Whether `name` is a valid Debian package name (and so safe to pass to apt-get).
fn is_package_name(name: &str) -> bool {
    name.len() >= 2
        && name.starts_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "+-.".contains(c))
}

/// Downloads `package`'s `.deb` into `dir` and returns its path.
fn apt_download(package: &str, dir: &Path) -> Result<PathBuf, ImageError> {
    // apt-get warns that the download is unsandboxed (`_apt` cannot write to `dir`): harmless.
    apt_get(&["download", package], Some(dir))?;
    find_deb(dir, package)
}

/// The `.deb` of `package` in `dir` (apt names it `<package>_<version>_<arch>.deb`).
fn find_deb(dir: &Path, package: &str) -> Result<PathBuf, ImageError> {
    let prefix = format!("{package}_");
    let mut found = Vec::new();
    for entry in fs::read_dir(dir).map_err(|e| io_err("read dir", dir, e))? {
        let entry = entry.map_err(|e| io_err("read dir", dir, e))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(&prefix) && name.ends_with(".deb") {
            found.push(entry.path());
        }
    }
    found.sort();
    found.pop().ok_or_else(|| ImageError::Package {
        path: dir.to_path_buf(),
        reason: format!("apt-get download {package} left no {prefix}*.deb"),
    })
}

/// A control field of a `.deb` (`dpkg-deb -f`).
fn deb_field(deb: &Path, field: &str) -> Result<String, ImageError> {
    let out = run(Command::new("dpkg-deb").arg("-f").arg(deb).arg(field))?;
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The versioned kernel package a `linux-image-*` meta package depends on, from its
/// `Depends` field (`linux-image-6.1.0-57-cloud-amd64 (= 6.1.192-3)`).
fn kernel_dependency(depends: &str) -> Option<String> {
    depends
        .split(',')
        .flat_map(|alternatives| alternatives.split('|'))
        .filter_map(|dep| dep.split_whitespace().next())
        .find(|name| name.starts_with("linux-image-") && is_package_name(name))
        .map(str::to_string)
}

// ---------------------------------------------------------------------------------------------
// Kernel
// ---------------------------------------------------------------------------------------------

/// Debian's meta package depending on the current cloud kernel.
pub const KERNEL_META_PACKAGE: &str = "linux-image-cloud-amd64";

/// Environment variable naming an already-downloaded `linux-image-<version>` `.deb` to use
/// instead of downloading one (for machines without network access to a Debian mirror).
pub const KERNEL_DEB_ENV: &str = "DSEC_VM_KERNEL_DEB";

/// The record written last into a prepared kernel directory: its presence means "complete".
const KERNEL_RECORD: &str = "kernel.json";

/// A guest kernel ready to boot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kernel {
    /// The kernel release (`6.1.0-57-cloud-amd64`), as `uname -r` reports in the guest.
    pub version: String,
    /// The file to pass to `qemu -kernel`: the uncompressed ELF `vmlinux` when it could be
    /// extracted (PVH boot), the `bzImage` otherwise.
    pub kernel: PathBuf,
    /// The kernel's module directory (`.../lib/modules/<version>`), with a `modules.dep`.
    pub modules_dir: PathBuf,
}

/// What is stored in [`KERNEL_RECORD`]; paths are relative to the kernel directory so that
/// the cache can be moved.
#[derive(Debug, Serialize, Deserialize)]
struct KernelRecord {
    version: String,
    kernel: PathBuf,
    modules_dir: PathBuf,
    /// Where the kernel came from ([`KernelSource::describe`]).
    source: String,
}

impl KernelRecord {
    fn resolve(&self, dir: &Path) -> Kernel {
        Kernel {
            version: self.version.clone(),
            kernel: dir.join(&self.kernel),
            modules_dir: dir.join(&self.modules_dir),
        }
    }
}

/// Where the kernel package comes from.
enum KernelSource {
    /// The current cloud kernel, downloaded with apt.
    Apt,
    /// A `.deb` named by [`KERNEL_DEB_ENV`].
    Deb(PathBuf),
}

impl KernelSource {
    fn from_env() -> Self {
        match std::env::var_os(KERNEL_DEB_ENV) {
            Some(path) if !path.is_empty() => Self::Deb(PathBuf::from(path)),
            _ => Self::Apt,
        }
    }

    fn describe(&self) -> String {
        match self {
            Self::Apt => format!("apt:{KERNEL_META_PACKAGE}"),
            Self::Deb(path) => format!("deb:{}", path.display()),
        }
    }
}

/// Whether [`prepare_kernel`] finds the kernel in `cache` (nothing to fetch).
pub fn kernel_cached(cache: &Path) -> bool {
    matches!(
        cached_kernel(&cache.join("kernel"), &KernelSource::from_env()),
        Ok(Some(_))
    )
}

/// Prepares (once) the guest kernel under `cache/kernel/` and returns it.
///
/// The kernel comes from Debian's `linux-image-cloud-amd64` (or the `.deb` named by
/// [`KERNEL_DEB_ENV`]). A prepared kernel is reused as is — this is called on daemon start
/// and costs two `stat`s then; delete `cache/kernel` to pick up a newer Debian kernel. When
/// [`KERNEL_DEB_ENV`] names another `.deb` than the cached kernel came from, the kernel is
/// prepared again and swapped in atomically.
pub fn prepare_kernel(cache: &Path) -> Result<Kernel, ImageError> {
    let source = KernelSource::from_env();
    let dir = cache.join("kernel");
    if let Some(kernel) = cached_kernel(&dir, &source)? {
        return Ok(kernel);
    }
    fs::create_dir_all(cache).map_err(|e| io_err("create dir", cache, e))?;
    let tmp = tempfile::Builder::new()
        .prefix(".kernel-")
        .tempdir_in(cache)
        .map_err(|e| io_err("create temp dir in", cache, e))?;
    let record = unpack_kernel(tmp.path(), &source)?;
    let json = serde_json::to_vec_pretty(&record).map_err(|e| {
        io_err(
            "serialize",
            &tmp.path().join(KERNEL_RECORD),
            io::Error::other(e),
        )
    })?;
    write_file(&tmp.path().join(KERNEL_RECORD), &json)?;
    fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o755))
        .map_err(|e| io_err("chmod", tmp.path(), e))?;
    install_dir(tmp, &dir)?;
    Ok(record.resolve(&dir))
}

/// The kernel prepared in `dir`, if it is complete and fits `source`.
fn cached_kernel(dir: &Path, source: &KernelSource) -> Result<Option<Kernel>, ImageError> {
    let path = dir.join(KERNEL_RECORD);
    let json = match fs::read(&path) {
        Ok(json) => json,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err("read", &path, e)),
    };
    // A corrupt record is rebuilt rather than reported: it is our own cache.
    let Ok(record) = serde_json::from_slice::<KernelRecord>(&json) else {
        return Ok(None);
    };
    if matches!(source, KernelSource::Deb(_)) && record.source != source.describe() {
        return Ok(None);
    }
    let kernel = record.resolve(dir);
    let complete = kernel.kernel.is_file() && kernel.modules_dir.join(MODULES_DEP).is_file();
    Ok(complete.then_some(kernel))
}

/// Moves the finished directory `tmp` to `dir`: a rename, or an atomic exchange with an
/// existing `dir` (whose old contents are then removed with `tmp`).
fn install_dir(tmp: tempfile::TempDir, dir: &Path) -> Result<(), ImageError> {
    match fs::rename(tmp.path(), dir) {
        Ok(()) => {
            // The directory is now at `dir`: nothing is left for the guard to remove.
            let _moved = tmp.keep();
            Ok(())
        }
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::ENOTEMPTY) | Some(libc::EEXIST) | Some(libc::EISDIR)
            ) =>
        {
            rustix::fs::renameat_with(
                rustix::fs::CWD,
                tmp.path(),
                rustix::fs::CWD,
                dir,
                rustix::fs::RenameFlags::EXCHANGE,
            )
            .map_err(|e| io_err("exchange", dir, e.into()))?;
            // `tmp` now holds the previous kernel; dropping it removes it.
            Ok(())
        }
        Err(e) => Err(io_err("rename into place", dir, e)),
    }
}

/// Writes `data` to `path` (a new file).
fn write_file(path: &Path, data: &[u8]) -> Result<(), ImageError> {
    fs::write(path, data).map_err(|e| io_err("write", path, e))
}

/// Downloads (unless given) and unpacks the kernel package into `root`; returns the record
/// describing it (paths relative to `root`).
fn unpack_kernel(root: &Path, source: &KernelSource) -> Result<KernelRecord, ImageError> {
    let downloads = root.join(".download");
    fs::create_dir(&downloads).map_err(|e| io_err("create dir", &downloads, e))?;
    let deb = match source {
        KernelSource::Deb(path) => path.clone(),
        KernelSource::Apt => download_kernel_deb(&downloads)?,
    };
    run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(root))?;
    fs::remove_dir_all(&downloads).map_err(|e| io_err("remove", &downloads, e))?;

    let (version, vmlinuz) = find_vmlinuz(root, &deb)?;
    let modules_dir = ["lib/modules", "usr/lib/modules"]
        .iter()
        .map(|base| Path::new(base).join(&version))
        .find(|dir| root.join(dir).join("kernel").is_dir())
        .ok_or_else(|| ImageError::Package {
            path: deb.clone(),
            reason: format!("no lib/modules/{version}/kernel directory"),
        })?;
    ensure_modules_dep(&root.join(&modules_dir))?;
    let kernel = match write_vmlinux(root, &vmlinuz, &version)? {
        Some(vmlinux) => vmlinux,
        None => vmlinuz,
    };
    Ok(KernelRecord {
        version,
        kernel,
        modules_dir,
        source: source.describe(),
    })
}

/// Downloads the current cloud kernel's versioned package (through its meta package).
fn download_kernel_deb(dir: &Path) -> Result<PathBuf, ImageError> {
    let meta = apt_download(KERNEL_META_PACKAGE, dir)?;
    let depends = deb_field(&meta, "Depends")?;
    let Some(package) = kernel_dependency(&depends) else {
        return Err(ImageError::Package {
            path: meta,
            reason: format!("no linux-image-* package in Depends: {depends}"),
        });
    };
    apt_download(&package, dir)
}

/// The kernel version and the relative path of its `bzImage` (`boot/vmlinuz-<version>`) in
/// the unpacked package at `root`.
fn find_vmlinuz(root: &Path, deb: &Path) -> Result<(String, PathBuf), ImageError> {
    let boot = root.join("boot");
    let mut found = Vec::new();
    if let Ok(entries) = fs::read_dir(&boot) {
        for entry in entries {
            let entry = entry.map_err(|e| io_err("read dir", &boot, e))?;
            if let Some(version) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.strip_prefix("vmlinuz-"))
            {
                found.push(version.to_string());
            }
        }
    }
    found.sort();
    match found.pop() {
        Some(version) => {
            let path = Path::new("boot").join(format!("vmlinuz-{version}"));
            Ok((version, path))
        }
        None => Err(ImageError::Package {
            path: deb.to_path_buf(),
            reason: "no boot/vmlinuz-<version> (is it a linux-image-<version> package, not a \
                     meta package?)"
                .into(),
        }),
    }
}

/// Extracts the ELF `vmlinux` from the `bzImage` at `root/vmlinuz` into
/// `boot/vmlinux-<version>` and returns that relative path, or `None` when the `bzImage`
/// holds no bootable LZ4-compressed ELF (the caller then boots the `bzImage`).
fn write_vmlinux(
    root: &Path,
    vmlinuz: &Path,
    version: &str,
) -> Result<Option<PathBuf>, ImageError> {
    let path = root.join(vmlinuz);
    let bzimage = fs::read(&path).map_err(|e| io_err("read", &path, e))?;
    let Some(elf) = extract_vmlinux(&bzimage) else {
        return Ok(None);
    };
    let rel = vmlinuz.with_file_name(format!("vmlinux-{version}"));
    write_file(&root.join(&rel), &elf)?;
    Ok(Some(rel))
}

/// Magic of an LZ4 "legacy frame", the format of the kernel's LZ4-compressed payload.
const LZ4_LEGACY_MAGIC: [u8; 4] = [0x02, 0x21, 0x4c, 0x18];
/// Uncompressed size of every block of a legacy frame but the last.
const LZ4_LEGACY_BLOCK: usize = 8 << 20;
/// Upper bound on the compressed size of a legacy block (`LZ4_compressBound`).
const LZ4_LEGACY_BOUND: usize = LZ4_LEGACY_BLOCK + LZ4_LEGACY_BLOCK / 255 + 16;
/// Decompression stops beyond this (a kernel is far smaller), bounding garbage input.
const MAX_VMLINUX: usize = 1 << 30;

/// The bootable ELF `vmlinux` inside a `bzImage` with an LZ4-compressed payload.
///
/// The payload's offset is not recorded anywhere simple, so every occurrence of the legacy
/// frame magic is tried until one decompresses to a bootable ELF. The frame's length is not
/// known either: decompression stops at the first block that cannot be one (the kernel's
/// build appends the uncompressed size after the frame), and [`is_bootable_vmlinux`] judges
/// the result.
fn extract_vmlinux(bzimage: &[u8]) -> Option<Vec<u8>> {
    let mut from = 0;
    while let Some(found) = find_bytes(bzimage.get(from..)?, &LZ4_LEGACY_MAGIC) {
        let start = from + found + LZ4_LEGACY_MAGIC.len();
        let data = lz4_legacy_decode(bzimage.get(start..)?);
        if is_bootable_vmlinux(&data) {
            return Some(data);
        }
        from = start;
    }
    None
}

/// The offset of the first occurrence of `needle` in `hay`.
fn find_bytes(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Decodes the blocks of an LZ4 legacy frame (`input` starts right after the magic) until
/// the input ends, a block is invalid, or a short (hence last) block was decoded. Returns
/// what was decoded; callers validate it.
fn lz4_legacy_decode(input: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut pos = 0usize;
    while let Some(size) = le_u32(input, pos) {
        let size = size as usize;
        if size == 0 || size > LZ4_LEGACY_BOUND {
            break;
        }
        let Some(block) = pos
            .checked_add(4)
            .and_then(|start| input.get(start..start.checked_add(size)?))
        else {
            break;
        };
        let before = out.len();
        if lz4_block_decode(block, &mut out, LZ4_LEGACY_BLOCK).is_none() {
            out.truncate(before);
            break;
        }
        if out.len() - before < LZ4_LEGACY_BLOCK || out.len() > MAX_VMLINUX {
            break;
        }
        pos += 4 + size;
    }
    out
}

/// Decodes one LZ4 block, appending at most `max` bytes to `out`; `None` if it is invalid.
/// Matches may only refer to this block's output (legacy-frame blocks are independent).
fn lz4_block_decode(src: &[u8], out: &mut Vec<u8>, max: usize) -> Option<()> {
    let start = out.len();
    let mut i = 0usize;
    loop {
        let token = *src.get(i)?;
        i += 1;
        let literals = lz4_length(src, &mut i, usize::from(token >> 4))?;
        let end = i.checked_add(literals)?;
        if out.len() - start + literals > max {
            return None;
        }
        out.extend_from_slice(src.get(i..end)?);
        i = end;
        if i == src.len() {
            // The last sequence has literals only.
            return Some(());
        }
        let offset = usize::from(le_u16(src, i)?);
        i += 2;
        let length = lz4_length(src, &mut i, usize::from(token & 0x0f))?.checked_add(4)?;
        let produced = out.len() - start;
        if offset == 0 || offset > produced || produced + length > max {
            return None;
        }
        let from = out.len() - offset;
        if offset >= length {
            out.extend_from_within(from..from + length);
        } else {
            // Overlapping copy: a repeated pattern.
            for k in 0..length {
                let byte = *out.get(from + k)?;
                out.push(byte);
            }
        }
    }
}

/// An LZ4 length: the 4-bit `base` from the token, extended by bytes while they are 255.
fn lz4_length(src: &[u8], i: &mut usize, base: usize) -> Option<usize> {
    let mut length = base;
    if base == 0x0f {
        loop {
            let byte = *src.get(*i)?;
            *i += 1;
            length = length.checked_add(usize::from(byte))?;
            if byte != 0xff {
                break;
            }
        }
    }
    Some(length)
}

fn le_u16(b: &[u8], off: usize) -> Option<u16> {
    Some(u16::from_le_bytes(
        b.get(off..off.checked_add(2)?)?.try_into().ok()?,
    ))
}

fn le_u32(b: &[u8], off: usize) -> Option<u32> {
    Some(u32::from_le_bytes(
        b.get(off..off.checked_add(4)?)?.try_into().ok()?,
    ))
}

fn le_u64(b: &[u8], off: usize) -> Option<u64> {
    Some(u64::from_le_bytes(
        b.get(off..off.checked_add(8)?)?.try_into().ok()?,
    ))
}

/// `b[off..off + len]` with 64-bit ELF offsets, `None` when out of bounds.
fn slice_at(b: &[u8], off: u64, len: u64) -> Option<&[u8]> {
    let off = usize::try_from(off).ok()?;
    let len = usize::try_from(len).ok()?;
    b.get(off..off.checked_add(len)?)
}

/// Whether `elf` starts like a little-endian ELF64 file.
fn is_elf64_le(elf: &[u8]) -> bool {
    elf.get(..6) == Some(&[0x7f, b'E', b'L', b'F', 2, 1][..])
}

const PT_LOAD: u32 = 1;
const PT_NOTE: u32 = 4;
/// `XEN_ELFNOTE_PHYS32_ENTRY`: the PVH entry point QEMU needs to boot an ELF kernel.
const XEN_ELFNOTE_PHYS32_ENTRY: u32 = 18;

/// Whether `elf` is an x86-64 ELF executable whose segments are all present (not truncated)
/// and which has a PVH entry note — what `qemu -kernel` needs to boot an uncompressed kernel.
fn is_bootable_vmlinux(elf: &[u8]) -> bool {
    const ET_EXEC: u16 = 2;
    const EM_X86_64: u16 = 62;
    if !is_elf64_le(elf)
        || le_u16(elf, 0x10) != Some(ET_EXEC)
        || le_u16(elf, 0x12) != Some(EM_X86_64)
    {
        return false;
    }
    let (Some(phoff), Some(phentsize), Some(phnum)) =
        (le_u64(elf, 0x20), le_u16(elf, 0x36), le_u16(elf, 0x38))
    else {
        return false;
    };
    let (Ok(phoff), phentsize) = (usize::try_from(phoff), usize::from(phentsize)) else {
        return false;
    };
    if phentsize < 56 {
        return false;
    }
    let mut loads = 0;
    let mut pvh = false;
    for n in 0..usize::from(phnum) {
        let Some(ph) = n
            .checked_mul(phentsize)
            .and_then(|o| o.checked_add(phoff))
            .and_then(|o| elf.get(o..o.checked_add(56)?))
        else {
            return false;
        };
        let (Some(kind), Some(offset), Some(size)) = (le_u32(ph, 0), le_u64(ph, 8), le_u64(ph, 32))
        else {
            return false;
        };
        let Some(segment) = slice_at(elf, offset, size) else {
            return false;
        };
        match kind {
            PT_LOAD => loads += 1,
            PT_NOTE => pvh |= has_xen_note(segment, XEN_ELFNOTE_PHYS32_ENTRY),
            _ => {}
        }
    }
    loads > 0 && pvh
}

/// Whether the ELF note segment `notes` has a `Xen` note of type `kind`.
fn has_xen_note(notes: &[u8], kind: u32) -> bool {
    let align4 = |n: usize| n.checked_add(3).map(|n| n & !3);
    let mut pos = 0usize;
    while let (Some(namesz), Some(descsz), Some(note_type)) = (
        le_u32(notes, pos),
        le_u32(notes, pos.saturating_add(4)),
        le_u32(notes, pos.saturating_add(8)),
    ) {
        let name_start = pos.saturating_add(12);
        let (Some(name_len), Some(desc_len)) = (align4(namesz as usize), align4(descsz as usize))
        else {
            return false;
        };
        let name = notes.get(name_start..name_start.saturating_add(namesz as usize));
        if note_type == kind && name == Some(&b"Xen\0"[..]) {
            return true;
        }
        let Some(next) = name_start
            .checked_add(name_len)
            .and_then(|p| p.checked_add(desc_len))
        else {
            return false;
        };
        pos = next;
    }
    false
}

// ---------------------------------------------------------------------------------------------
// Kernel modules
// ---------------------------------------------------------------------------------------------

/// Modules the microVM guest (`qemu -M microvm`, virtio-mmio devices) loads from the
/// initramfs. On Debian's cloud kernel none of them is built in; `virtio_rng` is the module
/// in `drivers/char/hw_random/virtio-rng.ko`.
pub const MICROVM_MODULES: &[&str] = &[
    "virtio",
    "virtio_ring",
    "virtio_mmio",
    "virtio_blk",
    "virtio_console",
    "overlay",
    "squashfs",
    "virtio_rng",
];

/// [`MICROVM_MODULES`] plus the virtio PCI transport, for full VMs (`qemu -M q35`); its
/// dependencies (`virtio_pci_modern_dev`, `virtio_pci_legacy_dev`) are resolved automatically.
pub const VM_MODULES: &[&str] = &[
    "virtio",
    "virtio_ring",
    "virtio_mmio",
    "virtio_blk",
    "virtio_console",
    "overlay",
    "squashfs",
    "virtio_rng",
    "virtio_pci",
];

/// The module dependency index, in depmod's format.
const MODULES_DEP: &str = "modules.dep";
/// The list of modules built into the kernel.
const MODULES_BUILTIN: &str = "modules.builtin";

/// File name suffixes of kernel modules (uncompressed and compressed).
const MODULE_SUFFIXES: &[&str] = &[".ko", ".ko.xz", ".ko.zst", ".ko.gz"];

/// The kernel's name for a module file or name: the file name without its module suffix,
/// `-` replaced by `_` (`drivers/char/hw_random/virtio-rng.ko` → `virtio_rng`).
fn module_name(path_or_name: &str) -> String {
    let base = path_or_name.rsplit('/').next().unwrap_or(path_or_name);
    let stem = MODULE_SUFFIXES
        .iter()
        .find_map(|suffix| base.strip_suffix(suffix))
        .unwrap_or(base);
    stem.replace('-', "_")
}

/// Whether `name` is a kernel module file name.
fn is_module_file(name: &str) -> bool {
    MODULE_SUFFIXES.iter().any(|suffix| name.ends_with(suffix))
}

/// Writes `modules_dir/modules.dep` unless present (Debian's packages do not ship it: their
/// postinst runs depmod), generated from the modules' `.modinfo` sections.
fn ensure_modules_dep(modules_dir: &Path) -> Result<(), ImageError> {
    let path = modules_dir.join(MODULES_DEP);
    if path.exists() {
        return Ok(());
    }
    let text = generate_modules_dep(modules_dir)?;
    let tmp = modules_dir.join(".modules.dep.tmp");
    write_file(&tmp, text.as_bytes())?;
    fs::rename(&tmp, &path).map_err(|e| io_err("rename into place", &path, e))
}

/// What a module's `.modinfo` says about it.
struct ModInfo {
    /// `name=`: the module's name (absent in old kernels: then the file name is used).
    name: Option<String>,
    /// `depends=`: the names of the modules it needs.
    depends: Vec<String>,
}

/// A `modules.dep` for the modules under `modules_dir`, like `depmod` writes it: one line
/// per module, `<path>: <dependency paths>`, with all transitive dependencies, the ones that
/// depend on others first (modprobe loads them from last to first).
///
/// Dependencies come from `depends=` in each module's `.modinfo` section, which the kernel
/// build (modpost) fills from the symbols the module uses — the same information depmod
/// derives, read without kmod.
fn generate_modules_dep(modules_dir: &Path) -> Result<String, ImageError> {
    let mut files = Vec::new();
    collect_module_files(modules_dir, Path::new(""), &mut files)?;
    files.sort();

    let mut modules: Vec<(String, Vec<String>)> = Vec::with_capacity(files.len());
    let mut by_name: HashMap<String, usize> = HashMap::new();
    for rel in &files {
        let path = modules_dir.join(rel);
        let data = read_module(&path)?;
        let info = modinfo(&data).ok_or_else(|| ImageError::ModuleIndex {
            path: path.clone(),
            reason: "no .modinfo section".into(),
        })?;
        let rel = rel.to_string_lossy().into_owned();
        let name = info
            .name
            .unwrap_or_else(|| module_name(&rel))
            .replace('-', "_");
        by_name.entry(name).or_insert(modules.len());
        modules.push((rel, info.depends));
    }

    let mut text = String::new();
    for (index, (rel, _)) in modules.iter().enumerate() {
        let mut order = Vec::new();
        let mut visiting = HashSet::new();
        dep_closure(
            index,
            &modules,
            &by_name,
            &mut order,
            &mut visiting,
            modules_dir,
        )?;
        text.push_str(rel);
        text.push(':');
        // `order` is the load order, the module itself last; depmod lists the reverse.
        for &dep in order.iter().rev().skip(1) {
            if let Some((dep_rel, _)) = modules.get(dep) {
                text.push(' ');
                text.push_str(dep_rel);
            }
        }
        text.push('\n');
    }
    Ok(text)
}

/// Appends module `index` and its transitive dependencies to `order` in load order
/// (dependencies first), each once.
fn dep_closure(
    index: usize,
    modules: &[(String, Vec<String>)],
    by_name: &HashMap<String, usize>,
    order: &mut Vec<usize>,
    visiting: &mut HashSet<usize>,
    modules_dir: &Path,
) -> Result<(), ImageError> {
    if order.contains(&index) {
        return Ok(());
    }
    let Some((rel, depends)) = modules.get(index) else {
        return Ok(());
    };
    if !visiting.insert(index) {
        return Err(ImageError::ModuleIndex {
            path: modules_dir.join(rel),
            reason: "dependency cycle".into(),
        });
    }
    for dep in depends {
        let Some(&dep_index) = by_name.get(&dep.replace('-', "_")) else {
            return Err(ImageError::ModuleIndex {
                path: modules_dir.join(rel),
                reason: format!("depends on {dep}, which is not among the modules"),
            });
        };
        dep_closure(dep_index, modules, by_name, order, visiting, modules_dir)?;
    }
    visiting.remove(&index);
    order.push(index);
    Ok(())
}

/// Appends the paths (relative to `base`) of the module files under `base/rel`.
fn collect_module_files(base: &Path, rel: &Path, out: &mut Vec<PathBuf>) -> Result<(), ImageError> {
    let dir = base.join(rel);
    for entry in fs::read_dir(&dir).map_err(|e| io_err("read dir", &dir, e))? {
        let entry = entry.map_err(|e| io_err("read dir", &dir, e))?;
        let file_type = entry
            .file_type()
            .map_err(|e| io_err("stat", &entry.path(), e))?;
        let child = rel.join(entry.file_name());
        if file_type.is_dir() {
            collect_module_files(base, &child, out)?;
        } else if file_type.is_file() && is_module_file(&entry.file_name().to_string_lossy()) {
            out.push(child);
        }
    }
    Ok(())
}

/// The uncompressed contents of a module file.
fn read_module(path: &Path) -> Result<Vec<u8>, ImageError> {
    let name = path.to_string_lossy();
    if name.ends_with(".ko.gz") {
        let file = fs::File::open(path).map_err(|e| io_err("open", path, e))?;
        let mut data = Vec::new();
        flate2::read::GzDecoder::new(file)
            .read_to_end(&mut data)
            .map_err(|e| io_err("decompress", path, e))?;
        Ok(data)
    } else if name.ends_with(".ko.xz") {
        Ok(run(Command::new("xz").arg("-dc").arg(path))?.stdout)
    } else if name.ends_with(".ko.zst") {
        Ok(run(Command::new("zstd").arg("-dcq").arg(path))?.stdout)
    } else {
        fs::read(path).map_err(|e| io_err("read", path, e))
    }
}

/// The `name=` and `depends=` entries of the `.modinfo` section of the ELF module `elf`
/// (NUL-separated `key=value` strings); `None` if it is not an ELF64 file with one.
fn modinfo(elf: &[u8]) -> Option<ModInfo> {
    let section = elf_section(elf, b".modinfo")?;
    let mut info = ModInfo {
        name: None,
        depends: Vec::new(),
    };
    for entry in section.split(|&b| b == 0) {
        let entry = String::from_utf8_lossy(entry);
        if let Some(name) = entry.strip_prefix("name=") {
            info.name = Some(name.to_string());
        } else if let Some(depends) = entry.strip_prefix("depends=") {
            info.depends.extend(
                depends
                    .split(',')
                    .filter(|d| !d.is_empty())
                    .map(str::to_string),
            );
        }
    }
    Some(info)
}

/// The contents of the section named `wanted` of the ELF64 little-endian file `elf`.
fn elf_section<'a>(elf: &'a [u8], wanted: &[u8]) -> Option<&'a [u8]> {
    if !is_elf64_le(elf) {
        return None;
    }
    let shoff = usize::try_from(le_u64(elf, 0x28)?).ok()?;
    let shentsize = usize::from(le_u16(elf, 0x3a)?);
    let shnum = usize::from(le_u16(elf, 0x3c)?);
    let shstrndx = usize::from(le_u16(elf, 0x3e)?);
    if shentsize < 64 {
        return None;
    }
    // (name offset, file offset, size) of section `n`.
    let header = |n: usize| -> Option<(usize, u64, u64)> {
        let base = shoff.checked_add(n.checked_mul(shentsize)?)?;
        let sh = elf.get(base..base.checked_add(64)?)?;
        Some((le_u32(sh, 0)? as usize, le_u64(sh, 24)?, le_u64(sh, 32)?))
    };
    let (_, names_off, names_size) = header(shstrndx)?;
    let names = slice_at(elf, names_off, names_size)?;
    (0..shnum).find_map(|n| {
        let (name, offset, size) = header(n)?;
        let name = names.get(name..)?;
        let name = name.get(..name.iter().position(|&b| b == 0)?)?;
        if name == wanted {
            slice_at(elf, offset, size)
        } else {
            None
        }
    })
}

/// A kernel's module index: `modules.dep` and `modules.builtin`.
struct ModuleIndex {
    /// `modules.dep`, for error messages.
    source: PathBuf,
    /// Module path (relative to the modules directory) → its dependency paths.
    deps: HashMap<PathBuf, Vec<PathBuf>>,
    /// Module name → its path (the first one listed, as modprobe does).
    by_name: HashMap<String, PathBuf>,
    /// Names of modules built into the kernel.
    builtin: HashSet<String>,
}

impl ModuleIndex {
    /// Reads the index of `modules_dir` (generating `modules.dep` in memory when absent).
    fn load(modules_dir: &Path) -> Result<Self, ImageError> {
        let source = modules_dir.join(MODULES_DEP);
        let deps = match fs::read_to_string(&source) {
            Ok(text) => text,
            Err(e) if e.kind() == io::ErrorKind::NotFound => generate_modules_dep(modules_dir)?,
            Err(e) => return Err(io_err("read", &source, e)),
        };
        let builtin_path = modules_dir.join(MODULES_BUILTIN);
        let builtin = match fs::read_to_string(&builtin_path) {
            Ok(text) => text,
            Err(e) if e.kind() == io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(io_err("read", &builtin_path, e)),
        };
        Self::parse(source, &deps, &builtin)
    }

    /// Parses `modules.dep` (`kernel/drivers/block/virtio_blk.ko: kernel/drivers/virtio/virtio.ko
    /// ...`) and `modules.builtin` (one module path per line).
    fn parse(source: PathBuf, deps_text: &str, builtin_text: &str) -> Result<Self, ImageError> {
        let mut deps = HashMap::new();
        let mut by_name = HashMap::new();
        for (number, line) in deps_text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let Some((module, list)) = line.split_once(':') else {
                return Err(ImageError::ModuleIndex {
                    path: source,
                    reason: format!("line {}: no ':' in {line:?}", number + 1),
                });
            };
            let module = module.trim();
            by_name
                .entry(module_name(module))
                .or_insert_with(|| PathBuf::from(module));
            deps.entry(PathBuf::from(module))
                .or_insert_with(|| list.split_whitespace().map(PathBuf::from).collect());
        }
        let builtin = builtin_text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(module_name)
            .collect();
        Ok(Self {
            source,
            deps,
            by_name,
            builtin,
        })
    }

    /// The module files needed to load `wanted` (names, `-`/`_` equivalent), dependencies
    /// first, each once. Built-in modules are skipped.
    fn resolve(&self, wanted: &[&str]) -> Result<Vec<PathBuf>, ImageError> {
        let mut order = Vec::new();
        let mut visiting = HashSet::new();
        for name in wanted {
            let key = module_name(name);
            if let Some(path) = self.by_name.get(&key) {
                self.visit(path, &mut order, &mut visiting)?;
            } else if !self.builtin.contains(&key) {
                return Err(ImageError::ModuleNotFound((*name).to_string()));
            }
        }
        Ok(order)
    }

    /// Appends `path`'s dependencies, then `path`, to `order` (unless already there).
    fn visit(
        &self,
        path: &Path,
        order: &mut Vec<PathBuf>,
        visiting: &mut HashSet<PathBuf>,
    ) -> Result<(), ImageError> {
        if order.iter().any(|p| p == path) {
            return Ok(());
        }
        if !visiting.insert(path.to_path_buf()) {
            return Err(ImageError::ModuleIndex {
                path: self.source.clone(),
                reason: format!("dependency cycle through {}", path.display()),
            });
        }
        // depmod lists the base modules last: visit them first for a natural order. Each
        // dependency's own dependencies are visited too, so direct-only lists work as well.
        for dep in self.deps.get(path).into_iter().flatten().rev() {
            self.visit(dep, order, visiting)?;
        }
        visiting.remove(path);
        order.push(path.to_path_buf());
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Initramfs
// ---------------------------------------------------------------------------------------------

/// Directories of the initramfs: mount points for the agent's early boot (`/newroot` is the
/// guest's root overlay, over the read-only root image at `/lower` and a writable `/upper`).
const INITRAMFS_DIRS: &[&str] = &["dev", "proc", "sys", "modules", "newroot", "lower", "upper"];

/// Builds the guest initramfs at `out`: an uncompressed newc cpio archive (the kernel
/// unpacks it fastest, and it is small) holding
///
/// - the directories `/dev /proc /sys /modules /newroot /lower /upper`;
/// - `/dev/console` (5,1), which the kernel opens for `/init` before anything is mounted;
/// - `/init`: the `agent` binary;
/// - `/modules/<file>.ko`: the `modules` (kernel names; `-` and `_` are equivalent) not
///   built into `kernel`, plus their dependencies, and `/modules/order`: their file names in
///   load order, one per line.
///
/// The archive is deterministic (fixed inode numbers, owners and times) and written to a
/// temporary file next to `out`, then renamed. An unknown module is
/// [`ImageError::ModuleNotFound`].
pub fn build_initramfs(
    agent: &Path,
    kernel: &Kernel,
    modules: &[&str],
    out: &Path,
) -> Result<(), ImageError> {
    let index = ModuleIndex::load(&kernel.modules_dir)?;
    let files = index.resolve(modules)?;
    let agent_data = read_for_cpio(agent)?;

    let parent = parent_dir(out);
    let mut tmp = tempfile::Builder::new()
        .prefix(".initramfs-")
        .tempfile_in(parent)
        .map_err(|e| io_err("create temp file in", parent, e))?;
    let tmp_path = tmp.path().to_path_buf();
    let write_err = |e| io_err("write", &tmp_path, e);

    let mut cpio = CpioWriter::new(BufWriter::new(tmp.as_file_mut()));
    for dir in INITRAMFS_DIRS {
        cpio.directory(dir, 0o755).map_err(write_err)?;
    }
    cpio.char_device("dev/console", 0o600, (5, 1))
        .map_err(write_err)?;
    cpio.file("init", 0o755, &agent_data).map_err(write_err)?;
    let mut order = String::new();
    for rel in &files {
        let path = kernel.modules_dir.join(rel);
        let Some(name) = rel.file_name().and_then(|n| n.to_str()) else {
            return Err(ImageError::ModuleIndex {
                path: index.source.clone(),
                reason: format!("bad module path {}", rel.display()),
            });
        };
        let data = read_for_cpio(&path)?;
        cpio.file(&format!("modules/{name}"), 0o644, &data)
            .map_err(write_err)?;
        order.push_str(name);
        order.push('\n');
    }
    cpio.file("modules/order", 0o644, order.as_bytes())
        .map_err(write_err)?;
    cpio.finish()
        .and_then(|mut w| w.flush())
        .map_err(write_err)?;

    let file = tmp.as_file();
    file.sync_all().map_err(write_err)?;
    file.set_permissions(fs::Permissions::from_mode(0o644))
        .map_err(|e| io_err("chmod", &tmp_path, e))?;
    tmp.persist(out)
        .map_err(|e| io_err("rename into place", out, e.error))?;
    Ok(())
}

/// The directory containing `path` (`.` for a bare file name).
pub(super) fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    }
}

/// The contents of `path`, which must fit a cpio entry.
fn read_for_cpio(path: &Path) -> Result<Vec<u8>, ImageError> {
    let data = fs::read(path).map_err(|e| io_err("read", path, e))?;
    if u32::try_from(data.len()).is_err() {
        return Err(ImageError::TooLarge {
            path: path.to_path_buf(),
            size: data.len() as u64,
        });
    }
    Ok(data)
}

/// A writer of newc ("070701") cpio archives, the format the kernel unpacks an initramfs
/// from: per entry a 110-byte ASCII header (magic and 13 fields of 8 hex digits), the name
/// with a NUL padded to 4 bytes, then the data padded to 4 bytes; a `TRAILER!!!` entry ends
/// the archive. Owners are root, times 0, so the output depends on the contents only.
struct CpioWriter<W: Write> {
    out: W,
    /// Bytes written so far (for padding).
    written: u64,
    /// The last inode number used.
    ino: u32,
}

/// File type bits of cpio modes.
const S_IFDIR: u32 = 0o040_000;
const S_IFREG: u32 = 0o100_000;
const S_IFCHR: u32 = 0o020_000;

impl<W: Write> CpioWriter<W> {
    fn new(out: W) -> Self {
        Self {
            out,
            written: 0,
            ino: 0,
        }
    }

    fn directory(&mut self, name: &str, perm: u32) -> io::Result<()> {
        self.entry(name, S_IFDIR | perm, 2, &[], (0, 0))
    }

    fn char_device(&mut self, name: &str, perm: u32, rdev: (u32, u32)) -> io::Result<()> {
        self.entry(name, S_IFCHR | perm, 1, &[], rdev)
    }

    fn file(&mut self, name: &str, perm: u32, data: &[u8]) -> io::Result<()> {
        self.entry(name, S_IFREG | perm, 1, data, (0, 0))
    }

    /// Writes the trailer and returns the underlying writer.
    fn finish(mut self) -> io::Result<W> {
        self.ino = u32::MAX; // the trailer gets inode 0
        self.entry("TRAILER!!!", 0, 1, &[], (0, 0))?;
        Ok(self.out)
    }

    fn entry(
        &mut self,
        name: &str,
        mode: u32,
        nlink: u32,
        data: &[u8],
        (rdev_major, rdev_minor): (u32, u32),
    ) -> io::Result<()> {
        let size = u32::try_from(data.len())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "cpio entry too large"))?;
        let namesize = u32::try_from(name.len() + 1)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "cpio name too long"))?;
        self.ino = self.ino.wrapping_add(1);
        let (uid, gid, mtime, dev_major, dev_minor, check) = (0, 0, 0, 0, 0, 0);
        let fields = [
            self.ino, mode, uid, gid, nlink, mtime, size, dev_major, dev_minor, rdev_major,
            rdev_minor, namesize, check,
        ];
        let mut header = String::with_capacity(110);
        header.push_str("070701");
        for field in fields {
            header.push_str(&format!("{field:08x}"));
        }
        self.put(header.as_bytes())?;
        self.put(name.as_bytes())?;
        self.put(&[0])?;
        self.pad()?;
        self.put(data)?;
        self.pad()
    }

    fn put(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.out.write_all(bytes)?;
        self.written += bytes.len() as u64;
        Ok(())
    }

    /// Pads the output to a multiple of 4 bytes.
    fn pad(&mut self) -> io::Result<()> {
        let padding = (4 - (self.written % 4) as usize) % 4;
        self.put(&[0; 3][..padding])
    }
}

// ---------------------------------------------------------------------------------------------
// Writable layer
// ---------------------------------------------------------------------------------------------

/// Makes the empty ext4 filesystem of a VM's writable layer at `out`: `bytes` large (sparse)
/// with `inodes` inodes — the disk quota. Labelled `dsec-upper` (the guest tells its disks
/// apart by label), no journal (the layer never outlives its VM), no reserved blocks.
pub fn build_upper_image(out: &Path, bytes: u64, inodes: u64) -> Result<(), ImageError> {
    let f = std::fs::File::create(out).map_err(|e| io_err("create", out, e))?;
    f.set_len(bytes).map_err(|e| io_err("size", out, e))?;
    drop(f);
    run(Command::new("mke2fs")
        .args([
            "-q",
            "-F",
            "-t",
            "ext4",
            "-O",
            "^has_journal",
            "-L",
            "dsec-upper",
            "-m",
            "0",
        ])
        .args(["-E", "root_owner=0:0,lazy_itable_init=1,nodiscard"])
        .arg("-N")
        .arg(inodes.to_string())
        .arg(out))?;
    Ok(())
}

/// A name for a cached image built from `parts` (template id, kernel version, format
/// version…): the sha256 hex of the parts joined with NUL bytes.
pub fn image_key(parts: &[&str]) -> String {
    let mut hash = Sha256::new();
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            hash.update([0u8]);
        }
        hash.update(part.as_bytes());
    }
    hex::encode(hash.finalize())
}

// ---------------------------------------------------------------------------------------------
// QEMU
// ---------------------------------------------------------------------------------------------

/// The QEMU binary for x86-64 guests.
const QEMU_BINARY: &str = "qemu-system-x86_64";
/// The Debian package providing it.
const QEMU_PACKAGE: &str = "qemu-system-x86";

/// The path of `qemu-system-x86_64`, installing Debian's `qemu-system-x86` (without
/// recommends: no GUI stack) when it is missing.
pub fn ensure_qemu() -> Result<PathBuf, ImageError> {
    ensure_tool(QEMU_BINARY, QEMU_PACKAGE)
}

/// The path of the executable `binary`, installing the Debian package `package` (without
/// recommends) when it is missing.
pub fn ensure_tool(binary: &'static str, package: &'static str) -> Result<PathBuf, ImageError> {
    if let Some(path) = find_executable(binary) {
        return Ok(path);
    }
    apt_get(&["install", "-y", "--no-install-recommends", package], None)?;
    find_executable(binary).ok_or(ImageError::ToolMissing { binary, package })
}

/// The first executable file `name` in `$PATH` or the standard binary directories (a
/// daemon's `PATH` may be minimal).
fn find_executable(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/local/bin", "/usr/bin", "/bin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|candidate| {
            fs::metadata(candidate)
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An entry parsed back from a newc archive.
    #[derive(Debug, Clone, PartialEq, Eq)]
    struct Entry {
        name: String,
        ino: u32,
        mode: u32,
        nlink: u32,
        rdev: (u32, u32),
        data: Vec<u8>,
    }

    /// Parses a newc archive, checking the format strictly (magic, alignment, trailer).
    fn parse_cpio(archive: &[u8]) -> anyhow::Result<Vec<Entry>> {
        let mut entries = Vec::new();
        let mut pos = 0;
        loop {
            anyhow::ensure!(pos % 4 == 0, "entry at unaligned offset {pos}");
            let header = archive
                .get(pos..pos + 110)
                .ok_or_else(|| anyhow::anyhow!("truncated header at {pos}"))?;
            anyhow::ensure!(&header[..6] == b"070701", "bad magic at {pos}");
            let field = |n: usize| -> anyhow::Result<u32> {
                let text = std::str::from_utf8(&header[6 + 8 * n..14 + 8 * n])?;
                Ok(u32::from_str_radix(text, 16)?)
            };
            let (ino, mode, uid, gid, nlink, mtime, size) = (
                field(0)?,
                field(1)?,
                field(2)?,
                field(3)?,
                field(4)?,
                field(5)?,
                field(6)?,
            );
            anyhow::ensure!((uid, gid, mtime, field(12)?) == (0, 0, 0, 0));
            let rdev = (field(9)?, field(10)?);
            let namesize = field(11)? as usize;
            let name_start = pos + 110;
            let name = archive
                .get(name_start..name_start + namesize)
                .ok_or_else(|| anyhow::anyhow!("truncated name"))?;
            anyhow::ensure!(name.last() == Some(&0), "name not NUL-terminated");
            let name = std::str::from_utf8(&name[..namesize - 1])?.to_string();
            let data_start = (name_start + namesize).div_ceil(4) * 4;
            anyhow::ensure!(
                archive[name_start + namesize..data_start]
                    .iter()
                    .all(|&b| b == 0),
                "non-zero name padding"
            );
            let data = archive
                .get(data_start..data_start + size as usize)
                .ok_or_else(|| anyhow::anyhow!("truncated data of {name}"))?
                .to_vec();
            pos = (data_start + size as usize).div_ceil(4) * 4;
            if name == "TRAILER!!!" {
                anyhow::ensure!(pos == archive.len(), "data after the trailer");
                return Ok(entries);
            }
            entries.push(Entry {
                name,
                ino,
                mode,
                nlink,
                rdev,
                data,
            });
        }
    }

    #[test]
    fn cpio_round_trip() -> anyhow::Result<()> {
        let mut cpio = CpioWriter::new(Vec::new());
        cpio.directory("dev", 0o755)?;
        cpio.char_device("dev/console", 0o600, (5, 1))?;
        // Sizes 0..=5 exercise every padding length of names and data.
        let files: Vec<(String, Vec<u8>)> = (0..6)
            .map(|n| (format!("f{}", "x".repeat(n)), vec![b'a' + n as u8; n]))
            .collect();
        for (name, data) in &files {
            cpio.file(name, 0o644, data)?;
        }
        cpio.file("init", 0o755, b"\x7fELF binary")?;
        let archive = cpio.finish()?;
        let entries = parse_cpio(&archive)?;

        assert_eq!(entries.len(), 9);
        assert_eq!(entries[0].name, "dev");
        assert_eq!(entries[0].mode, 0o040_755);
        assert_eq!(entries[0].nlink, 2);
        assert_eq!(entries[1].name, "dev/console");
        assert_eq!(entries[1].mode, 0o020_600);
        assert_eq!(entries[1].rdev, (5, 1));
        for (entry, (name, data)) in entries[2..8].iter().zip(&files) {
            assert_eq!(&entry.name, name);
            assert_eq!(entry.mode, 0o100_644);
            assert_eq!(&entry.data, data);
        }
        assert_eq!(entries[8].name, "init");
        assert_eq!(entries[8].mode, 0o100_755);
        assert_eq!(entries[8].data, b"\x7fELF binary");
        let inos: HashSet<u32> = entries.iter().map(|e| e.ino).collect();
        assert_eq!(inos.len(), entries.len(), "inode numbers are unique");
        Ok(())
    }

    #[test]
    fn cpio_is_accepted_by_gnu_cpio() -> anyhow::Result<()> {
        assert!(
            find_executable("cpio").is_some(),
            "GNU cpio is missing (scripts/test.sh installs it)"
        );
        let mut cpio = CpioWriter::new(Vec::new());
        cpio.directory("d", 0o755)?;
        cpio.file("d/f", 0o644, b"hello")?;
        let archive = cpio.finish()?;
        let dir = tempfile::tempdir()?;
        let file = dir.path().join("a.cpio");
        fs::write(&file, &archive)?;
        let out = run(Command::new("sh")
            .arg("-c")
            .arg("cpio -it --quiet < \"$1\"")
            .arg("sh")
            .arg(&file))?;
        assert_eq!(String::from_utf8(out.stdout)?, "d\nd/f\n");
        Ok(())
    }

    const FAKE_DEP: &str = "\
kernel/drivers/virtio/virtio.ko:
kernel/drivers/virtio/virtio_ring.ko: kernel/drivers/virtio/virtio.ko
kernel/drivers/virtio/virtio_mmio.ko: kernel/drivers/virtio/virtio_ring.ko kernel/drivers/virtio/virtio.ko
kernel/drivers/block/virtio_blk.ko: kernel/drivers/virtio/virtio_ring.ko kernel/drivers/virtio/virtio.ko
kernel/drivers/char/hw_random/virtio-rng.ko: kernel/drivers/char/hw_random/rng-core.ko kernel/drivers/virtio/virtio_ring.ko kernel/drivers/virtio/virtio.ko
kernel/drivers/char/hw_random/rng-core.ko:
kernel/fs/overlayfs/overlay.ko:
kernel/fs/squashfs/squashfs.ko:
";

    /// A fake kernel: modules directory with [`FAKE_DEP`], module files, `modules.builtin`.
    fn fake_kernel(dir: &Path, builtin: &str) -> anyhow::Result<Kernel> {
        let modules_dir = dir.join("lib/modules/9.9.9-test");
        fs::create_dir_all(&modules_dir)?;
        fs::write(modules_dir.join(MODULES_DEP), FAKE_DEP)?;
        fs::write(modules_dir.join(MODULES_BUILTIN), builtin)?;
        for line in FAKE_DEP.lines() {
            let Some((module, _)) = line.split_once(':') else {
                continue;
            };
            let path = modules_dir.join(module);
            fs::create_dir_all(parent_dir(&path))?;
            fs::write(&path, format!("module {}", module_name(module)))?;
        }
        Ok(Kernel {
            version: "9.9.9-test".into(),
            kernel: dir.join("vmlinux"),
            modules_dir,
        })
    }

    fn index(builtin: &str) -> anyhow::Result<ModuleIndex> {
        Ok(ModuleIndex::parse(
            PathBuf::from("modules.dep"),
            FAKE_DEP,
            builtin,
        )?)
    }

    fn names(paths: &[PathBuf]) -> Vec<String> {
        paths
            .iter()
            .filter_map(|p| p.file_name())
            .map(|n| n.to_string_lossy().into_owned())
            .collect()
    }

    #[test]
    fn dependencies_first_without_duplicates() -> anyhow::Result<()> {
        let index = index("")?;
        let order = index.resolve(&["virtio_blk", "virtio-mmio", "virtio_rng", "overlay"])?;
        assert_eq!(
            names(&order),
            [
                "virtio.ko",
                "virtio_ring.ko",
                "virtio_blk.ko",
                "virtio_mmio.ko",
                "rng-core.ko",
                "virtio-rng.ko",
                "overlay.ko"
            ]
        );
        // Direct-only dependency lists resolve the same (dependencies of dependencies).
        let direct = ModuleIndex::parse(
            PathBuf::from("modules.dep"),
            "a.ko: b.ko\nb.ko: c.ko\nc.ko:\n",
            "",
        )?;
        assert_eq!(names(&direct.resolve(&["a"])?), ["c.ko", "b.ko", "a.ko"]);
        Ok(())
    }

    #[test]
    fn unknown_module_is_reported() -> anyhow::Result<()> {
        let err = index("")?.resolve(&["virtio_blk", "no_such_module"]);
        assert!(
            matches!(&err, Err(ImageError::ModuleNotFound(name)) if name == "no_such_module"),
            "{err:?}"
        );
        Ok(())
    }

    #[test]
    fn builtin_modules_are_skipped() -> anyhow::Result<()> {
        let index = index("kernel/drivers/virtio/virtio_console.ko\nkernel/fs/ext4/ext4.ko\n")?;
        let order = index.resolve(&["virtio-console", "ext4", "overlay"])?;
        assert_eq!(names(&order), ["overlay.ko"]);
        Ok(())
    }

    #[test]
    fn dependency_cycles_and_malformed_lines_are_errors() -> anyhow::Result<()> {
        let cyclic = ModuleIndex::parse(PathBuf::from("m"), "a.ko: b.ko\nb.ko: a.ko\n", "")?;
        assert!(matches!(
            cyclic.resolve(&["a"]),
            Err(ImageError::ModuleIndex { .. })
        ));
        assert!(matches!(
            ModuleIndex::parse(PathBuf::from("m"), "a.ko b.ko\n", ""),
            Err(ImageError::ModuleIndex { .. })
        ));
        Ok(())
    }

    #[test]
    fn initramfs_contents() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let kernel = fake_kernel(dir.path(), "kernel/drivers/char/virtio_console.ko\n")?;
        let agent = dir.path().join("agent");
        fs::write(&agent, b"\x7fELF agent")?;
        let out = dir.path().join("out/initramfs.cpio");
        fs::create_dir(dir.path().join("out"))?;
        build_initramfs(&agent, &kernel, MICROVM_MODULES, &out)?;

        let entries = parse_cpio(&fs::read(&out)?)?;
        let by_name: HashMap<&str, &Entry> = entries.iter().map(|e| (e.name.as_str(), e)).collect();
        for dir in INITRAMFS_DIRS {
            assert_eq!(by_name[dir].mode, 0o040_755, "{dir}");
        }
        assert_eq!(by_name["dev/console"].mode, 0o020_600);
        assert_eq!(by_name["dev/console"].rdev, (5, 1));
        assert_eq!(by_name["init"].mode, 0o100_755);
        assert_eq!(by_name["init"].data, b"\x7fELF agent");
        let order = String::from_utf8(by_name["modules/order"].data.clone())?;
        let order: Vec<&str> = order.lines().collect();
        assert_eq!(
            order,
            [
                "virtio.ko",
                "virtio_ring.ko",
                "virtio_mmio.ko",
                "virtio_blk.ko",
                "overlay.ko",
                "squashfs.ko",
                "rng-core.ko",
                "virtio-rng.ko"
            ]
        );
        for name in &order {
            let entry = by_name[format!("modules/{name}").as_str()];
            assert_eq!(entry.mode, 0o100_644);
            assert_eq!(
                entry.data,
                format!("module {}", module_name(name)).as_bytes()
            );
        }
        assert_eq!(entries.len(), INITRAMFS_DIRS.len() + 3 + order.len());
        assert_eq!(fs::metadata(&out)?.permissions().mode() & 0o777, 0o644);
        // No temporary file is left behind, and a rebuild is byte-identical.
        assert_eq!(fs::read_dir(dir.path().join("out"))?.count(), 1);
        let first = fs::read(&out)?;
        build_initramfs(&agent, &kernel, MICROVM_MODULES, &out)?;
        assert_eq!(fs::read(&out)?, first);

        let err = build_initramfs(&agent, &kernel, &["virtio_net"], &out);
        assert!(matches!(err, Err(ImageError::ModuleNotFound(_))), "{err:?}");
        Ok(())
    }

    /// A minimal ELF64 relocatable file with a `.modinfo` section holding `modinfo`.
    fn fake_ko(modinfo: &[u8]) -> Vec<u8> {
        let shstrtab = b"\0.shstrtab\0.modinfo\0";
        let mut elf = vec![0u8; 64];
        elf[..6].copy_from_slice(&[0x7f, b'E', b'L', b'F', 2, 1]);
        let strtab_off = elf.len();
        elf.extend_from_slice(shstrtab);
        let modinfo_off = elf.len();
        elf.extend_from_slice(modinfo);
        while !elf.len().is_multiple_of(8) {
            elf.push(0);
        }
        let shoff = elf.len();
        let section = |name: u32, off: usize, size: usize| {
            let mut sh = vec![0u8; 64];
            sh[..4].copy_from_slice(&name.to_le_bytes());
            sh[24..32].copy_from_slice(&(off as u64).to_le_bytes());
            sh[32..40].copy_from_slice(&(size as u64).to_le_bytes());
            sh
        };
        elf.extend(section(0, 0, 0));
        elf.extend(section(1, strtab_off, shstrtab.len()));
        elf.extend(section(11, modinfo_off, modinfo.len()));
        elf[0x28..0x30].copy_from_slice(&(shoff as u64).to_le_bytes());
        elf[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        elf[0x3c..0x3e].copy_from_slice(&3u16.to_le_bytes());
        elf[0x3e..0x40].copy_from_slice(&1u16.to_le_bytes());
        elf
    }

    #[test]
    fn modules_dep_from_modinfo() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let modules = [
            ("kernel/virtio/virtio.ko", "name=virtio\0depends=\0"),
            (
                "kernel/virtio/virtio_ring.ko",
                "depends=virtio\0name=virtio_ring\0",
            ),
            (
                "kernel/block/virtio_blk.ko",
                "license=GPL\0depends=virtio_ring,virtio\0name=virtio_blk\0",
            ),
            (
                "kernel/hw/virtio-rng.ko",
                "depends=virtio,virtio_ring,rng-core\0",
            ),
            ("kernel/hw/rng-core.ko", "name=rng_core\0depends=\0"),
        ];
        for (path, info) in modules {
            let path = dir.path().join(path);
            fs::create_dir_all(parent_dir(&path))?;
            fs::write(&path, fake_ko(info.as_bytes()))?;
        }
        ensure_modules_dep(dir.path())?;
        let text = fs::read_to_string(dir.path().join(MODULES_DEP))?;
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines,
            [
                "kernel/block/virtio_blk.ko: kernel/virtio/virtio_ring.ko kernel/virtio/virtio.ko",
                "kernel/hw/rng-core.ko:",
                "kernel/hw/virtio-rng.ko: kernel/hw/rng-core.ko kernel/virtio/virtio_ring.ko \
                 kernel/virtio/virtio.ko",
                "kernel/virtio/virtio.ko:",
                "kernel/virtio/virtio_ring.ko: kernel/virtio/virtio.ko",
            ]
        );
        let index = ModuleIndex::load(dir.path())?;
        assert_eq!(
            names(&index.resolve(&["virtio_rng"])?),
            [
                "virtio.ko",
                "virtio_ring.ko",
                "rng-core.ko",
                "virtio-rng.ko"
            ]
        );
        // A module whose dependency is missing makes the index unusable.
        fs::write(dir.path().join("kernel/x.ko"), fake_ko(b"depends=nope\0"))?;
        assert!(matches!(
            generate_modules_dep(dir.path()),
            Err(ImageError::ModuleIndex { .. })
        ));
        assert!(modinfo(b"not an elf").is_none());
        assert!(modinfo(&fake_ko(b"")[..100]).is_none());
        Ok(())
    }

    /// An x86-64 ELF executable with one PT_LOAD and, if `pvh`, a Xen PVH entry note.
    fn fake_vmlinux(pvh: bool) -> Vec<u8> {
        let mut elf = vec![0u8; 64 + 2 * 56];
        elf[..6].copy_from_slice(&[0x7f, b'E', b'L', b'F', 2, 1]);
        elf[0x10..0x12].copy_from_slice(&2u16.to_le_bytes());
        elf[0x12..0x14].copy_from_slice(&62u16.to_le_bytes());
        elf[0x20..0x28].copy_from_slice(&64u64.to_le_bytes());
        elf[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
        elf[0x38..0x3a].copy_from_slice(&2u16.to_le_bytes());
        let note_off = elf.len();
        let note_type: u32 = if pvh { XEN_ELFNOTE_PHYS32_ENTRY } else { 17 };
        for word in [4u32, 4, note_type] {
            elf.extend_from_slice(&word.to_le_bytes());
        }
        elf.extend_from_slice(b"Xen\0\x00\x10\x00\x01");
        let note_len = elf.len() - note_off;
        elf.extend((0..5000u32).map(|n| (n % 251) as u8));
        let total = elf.len();
        let mut ph = |n: usize, kind: u32, off: usize, size: usize| {
            let base = 64 + n * 56;
            elf[base..base + 4].copy_from_slice(&kind.to_le_bytes());
            elf[base + 8..base + 16].copy_from_slice(&(off as u64).to_le_bytes());
            elf[base + 32..base + 40].copy_from_slice(&(size as u64).to_le_bytes());
        };
        ph(0, PT_LOAD, 0, total);
        ph(1, PT_NOTE, note_off, note_len);
        elf
    }

    /// An LZ4 block of literals only (valid, if not compressed).
    fn lz4_literal_block(data: &[u8]) -> Vec<u8> {
        let mut block = Vec::new();
        if data.len() < 15 {
            block.push((data.len() as u8) << 4);
        } else {
            block.push(0xf0);
            let mut rest = data.len() - 15;
            while rest >= 255 {
                block.push(255);
                rest -= 255;
            }
            block.push(rest as u8);
        }
        block.extend_from_slice(data);
        block
    }

    #[test]
    fn lz4_block_with_overlapping_match() {
        // "abc", then a match at offset 3 of length 9, then the literals "xyz".
        let block = [0x35, b'a', b'b', b'c', 3, 0, 0x30, b'x', b'y', b'z'];
        let mut out = Vec::new();
        assert!(lz4_block_decode(&block, &mut out, 1 << 20).is_some());
        assert_eq!(out, b"abcabcabcabcxyz");
        // Offsets before the block's start, and output beyond the limit, are invalid.
        let mut out = b"prefix".to_vec();
        assert!(lz4_block_decode(&[0x10, b'a', 5, 0, 0x00], &mut out, 1 << 20).is_none());
        assert!(lz4_block_decode(&block, &mut Vec::new(), 10).is_none());
        assert!(lz4_block_decode(&[0xf0], &mut Vec::new(), 10).is_none());
    }

    #[test]
    fn vmlinux_from_fake_bzimage() -> anyhow::Result<()> {
        let vmlinux = fake_vmlinux(true);
        assert!(is_bootable_vmlinux(&vmlinux));
        assert!(!is_bootable_vmlinux(&fake_vmlinux(false)));
        assert!(!is_bootable_vmlinux(&vmlinux[..vmlinux.len() - 1]));
        assert!(!is_bootable_vmlinux(b"\x7fELF"));

        let block = lz4_literal_block(&vmlinux);
        let mut bzimage = b"setup code".to_vec();
        // A stray magic followed by garbage, then the real payload and the size trailer.
        bzimage.extend_from_slice(&LZ4_LEGACY_MAGIC);
        bzimage.extend_from_slice(b"\x05\x00\x00\x00\xffjunk");
        bzimage.extend_from_slice(&LZ4_LEGACY_MAGIC);
        bzimage.extend_from_slice(&(block.len() as u32).to_le_bytes());
        bzimage.extend_from_slice(&block);
        bzimage.extend_from_slice(&(vmlinux.len() as u32).to_le_bytes());
        bzimage.extend_from_slice(&[0u8; 100]);
        assert_eq!(extract_vmlinux(&bzimage), Some(vmlinux));
        assert_eq!(extract_vmlinux(b"no payload here"), None);

        // The lz4 tool's legacy format (-l) decodes identically (scripts/test.sh installs lz4).
        assert!(
            find_executable("lz4").is_some(),
            "this test needs the lz4 tool"
        );
        {
            let dir = tempfile::tempdir()?;
            let data: Vec<u8> = (0..(LZ4_LEGACY_BLOCK + 300_000))
                .map(|n| ((n / 7) % 13) as u8 ^ (n % 3) as u8)
                .collect();
            fs::write(dir.path().join("data"), &data)?;
            let out = run(Command::new("lz4")
                .args(["-l", "-c", "-9"])
                .arg(dir.path().join("data")))?;
            let compressed = out
                .stdout
                .strip_prefix(&LZ4_LEGACY_MAGIC[..])
                .ok_or_else(|| anyhow::anyhow!("no legacy magic"))?;
            assert!(compressed.len() < data.len() / 4);
            assert!(lz4_legacy_decode(compressed) == data);
        }
        Ok(())
    }

    #[test]
    fn kernel_dependency_from_depends() {
        assert_eq!(
            kernel_dependency("linux-image-6.1.0-57-cloud-amd64 (= 6.1.192-3)").as_deref(),
            Some("linux-image-6.1.0-57-cloud-amd64")
        );
        assert_eq!(
            kernel_dependency(
                "initramfs-tools | linux-initramfs-tool, linux-image-6.12.9-cloud-amd64"
            )
            .as_deref(),
            Some("linux-image-6.12.9-cloud-amd64")
        );
        assert_eq!(kernel_dependency("linux-image-$(rm -rf /)"), None);
        assert_eq!(kernel_dependency(""), None);
    }

    #[test]
    fn cached_kernel_is_reused() -> anyhow::Result<()> {
        let cache = tempfile::tempdir()?;
        let dir = cache.path().join("kernel");
        assert_eq!(cached_kernel(&dir, &KernelSource::Apt)?, None);
        let record = KernelRecord {
            version: "9.9.9".into(),
            kernel: PathBuf::from("boot/vmlinux-9.9.9"),
            modules_dir: PathBuf::from("lib/modules/9.9.9"),
            source: KernelSource::Apt.describe(),
        };
        fs::create_dir_all(dir.join("boot"))?;
        fs::create_dir_all(dir.join("lib/modules/9.9.9"))?;
        fs::write(dir.join("boot/vmlinux-9.9.9"), b"elf")?;
        fs::write(dir.join(KERNEL_RECORD), serde_json::to_vec(&record)?)?;
        // Incomplete without modules.dep.
        assert_eq!(cached_kernel(&dir, &KernelSource::Apt)?, None);
        fs::write(dir.join("lib/modules/9.9.9/modules.dep"), b"")?;
        let kernel = cached_kernel(&dir, &KernelSource::Apt)?;
        assert_eq!(
            kernel,
            Some(Kernel {
                version: "9.9.9".into(),
                kernel: dir.join("boot/vmlinux-9.9.9"),
                modules_dir: dir.join("lib/modules/9.9.9"),
            })
        );
        // Another .deb than the cached kernel came from is prepared anew.
        let other = KernelSource::Deb(PathBuf::from("/tmp/other.deb"));
        assert_eq!(cached_kernel(&dir, &other)?, None);

        // install_dir swaps a new kernel directory in over an existing one.
        let new = tempfile::Builder::new().tempdir_in(cache.path())?;
        fs::write(new.path().join("marker"), b"new")?;
        install_dir(new, &dir)?;
        assert_eq!(fs::read(dir.join("marker"))?, b"new");
        assert_eq!(
            fs::read_dir(cache.path())?.count(),
            1,
            "the old one is removed"
        );
        Ok(())
    }

    #[test]
    fn image_key_joins_with_nul() {
        assert_eq!(image_key(&["a", "b"]), hex::encode(Sha256::digest(b"a\0b")));
        assert_ne!(image_key(&["ab"]), image_key(&["a", "b"]));
        assert_eq!(image_key(&[]), hex::encode(Sha256::digest(b"")));
    }

    #[test]
    fn stderr_tail_is_bounded() {
        let long = "é".repeat(STDERR_TAIL);
        let end = tail(long.as_bytes());
        assert!(end.starts_with('…'));
        assert!(end.len() <= STDERR_TAIL + 4);
        assert_eq!(tail(b"  short\n"), "short");
    }

    /// Prepares the real kernel and initramfs into `$DSEC_DEV_VM_CACHE` (downloads from the
    /// Debian mirror): `DSEC_DEV_VM_CACHE=/var/cache/dsec-dev/vm cargo test -p dsec-node --lib
    /// vm::image -- --ignored --nocapture`.
    #[test]
    #[ignore = "downloads Debian's kernel; set DSEC_DEV_VM_CACHE"]
    fn real_kernel_and_initramfs() -> anyhow::Result<()> {
        let Some(cache) = std::env::var_os("DSEC_DEV_VM_CACHE") else {
            eprintln!("skipped: DSEC_DEV_VM_CACHE is not set");
            return Ok(());
        };
        let cache = PathBuf::from(cache);
        let start = std::time::Instant::now();
        let kernel = prepare_kernel(&cache)?;
        eprintln!("prepared {kernel:#?} in {:?}", start.elapsed());
        let start = std::time::Instant::now();
        assert_eq!(prepare_kernel(&cache)?, kernel);
        eprintln!("cached in {:?}", start.elapsed());
        let index = ModuleIndex::load(&kernel.modules_dir)?;
        for (label, modules) in [("MICROVM", MICROVM_MODULES), ("VM", VM_MODULES)] {
            let order: Vec<String> = index
                .resolve(modules)?
                .iter()
                .map(|p| p.display().to_string())
                .collect();
            eprintln!("{label}_MODULES load order:\n  {}", order.join("\n  "));
        }
        let agent = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../target/x86_64-unknown-linux-gnu/debug/dsec-agent");
        if agent.exists() {
            for (name, modules) in [
                ("initramfs-microvm.cpio", MICROVM_MODULES),
                ("initramfs-vm.cpio", VM_MODULES),
            ] {
                let out = cache.join(name);
                build_initramfs(&agent, &kernel, modules, &out)?;
                eprintln!("{}: {} bytes", out.display(), fs::metadata(&out)?.len());
            }
        }
        Ok(())
    }
}
