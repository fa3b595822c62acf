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
//! - a **root image** ([`build_root_image`]): a template's merged filesystem (its layers, or
//!   the host's `/` under the host mask) as an ext4 image that guests use read-only, under an
//!   overlay of their own.
//!
//! Everything is written atomically (a temporary file or directory next to the target, then
//! a rename), so a crash never leaves a half-built artifact under its final name.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::OsString;
use std::fs;
use std::io::{self, BufWriter, Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use crate::template::unpack::{is_opaque, is_whiteout};

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
    /// QEMU is still missing after installing its package.
    #[error("{binary} not found after installing {package}")]
    QemuMissing {
        /// The binary looked for.
        binary: &'static str,
        /// The Debian package installed.
        package: &'static str,
    },
}

fn io_err(op: &'static str, path: &Path, source: io::Error) -> ImageError {
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
fn parent_dir(path: &Path) -> &Path {
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
// Root image
// ---------------------------------------------------------------------------------------------

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

/// Block size of root images.
const ROOT_BLOCK: u64 = 4096;
/// Inode size of root images (`mke2fs -I`).
const ROOT_INODE_SIZE: u64 = 256;
/// Free space added to the estimated size of a root image, besides 15%.
const ROOT_SLACK: u64 = 256 << 20;
/// Inodes added to the estimated count, besides 20%.
const ROOT_SLACK_INODES: u64 = 10_000;
/// Prefix of overlayfs's private xattrs, which never belong in an image.
const OVERLAY_XATTR_PREFIX: &[u8] = b"trusted.overlay.";

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

/// Builds a read-only-use ext4 image of `src` at `out`.
///
/// The merged view is mounted read-only with overlayfs in a private mount namespace
/// (`unshare --mount`: every mount disappears with the process, even on a crash) and copied
/// into a new filesystem by `mke2fs -d`. overlayfs does the merging, so whiteouts and opaque
/// directories behave exactly as in a container, and its private xattrs are not shown.
/// Three overlayfs quirks are handled before mounting:
///
/// - a lone lower layer cannot be mounted without an upper one: an empty directory is
///   added at the bottom;
/// - lower layers nested in one another on one filesystem are refused (`ELOOP`): the
///   nested ones (e.g. the host mask, above `/`) are copied into a tmpfs first;
/// - a directory present in only one layer is listed straight from it, so its whiteouts
///   (meaningless there, but they occur) show as entries that cannot be `lstat`ed and make
///   `mke2fs` fail: such directories get a copy (attributes only) in an extra top layer,
///   which makes overlayfs merge and filter them.
///
/// The size is estimated up front (mke2fs needs it) by walking the merged view as overlayfs
/// would show it (whiteouts, opaque directories, no crossing into other mounts: see
/// [`MergeScan`]), so hidden trees of a layer (the host's `/work`, caches…) do not count:
/// the bytes used by the merged view plus 15% and 256 MiB, its inodes plus 20% and 10000,
/// and the inode table; the file is sparse. The
/// image is built next to `out` and renamed; `out` must not be visible in the source (for
/// the host's `/`, build it in a directory the mask hides). The image is mode 0600 (the host
/// template's holds host files). Needs root.
pub fn build_root_image(src: RootSource<'_>, out: &Path) -> Result<(), ImageError> {
    let mut lowers = match src {
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
            path: out.to_path_buf(),
            reason: "no layers".into(),
        });
    }

    let MergeScan { usage, fixup, .. } = MergeScan::run(&lowers)?;
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

    let (bytes, inodes) = image_size(usage);

    let image = tempfile::Builder::new()
        .prefix(".dsec-root-")
        .suffix(".img.tmp")
        .tempfile_in(parent)
        .map_err(|e| io_err("create temp file in", parent, e))?;
    image
        .as_file()
        .set_len(bytes)
        .map_err(|e| io_err("truncate", image.path(), e))?;
    let image_path = canonical(image.path())?;

    let plan = BuildPlan {
        lowers: &lowers,
        mnt: work_path.join("mnt"),
        image: image_path,
        guards: vec![work_path.clone()],
        size_kib: bytes / 1024,
        inodes,
    };
    fs::create_dir(&plan.mnt).map_err(|e| io_err("create dir", &plan.mnt, e))?;
    let script = plan.script()?;
    run_described(
        Command::new("unshare")
            .args(["--mount", "--propagation", "private", "--", "sh", "-c"])
            .arg(&script),
        format!(
            "unshare --mount -- sh -c <mount overlay, mke2fs -d> (for {})",
            out.display()
        ),
    )?;

    image
        .as_file()
        .sync_all()
        .map_err(|e| io_err("sync", image.path(), e))?;
    image
        .persist(out)
        .map_err(|e| io_err("rename into place", out, e.error))?;
    Ok(())
}

/// The size (bytes, a multiple of the block size) and inode count of an image for contents
/// using `usage`: 15% and 256 MiB more space, 20% and 10000 more inodes, plus the inode table.
fn image_size(usage: Usage) -> (u64, u64) {
    let inodes = usage.inodes + usage.inodes / 5 + ROOT_SLACK_INODES;
    let bytes = usage.bytes + usage.bytes * 15 / 100 + ROOT_SLACK + inodes * ROOT_INODE_SIZE;
    (bytes.div_ceil(ROOT_BLOCK) * ROOT_BLOCK, inodes)
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

/// Space used by a filesystem tree, as far as an ext4 image of it is concerned.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Usage {
    bytes: u64,
    inodes: u64,
}

/// A walk of the merged view of lower layers (topmost first), simulating overlayfs lookup,
/// to size an image of it.
///
/// Each directory of each layer is listed once and its entries `lstat`ed once. Whiteouts
/// and opaque directories hide what is below them, and directories that are mount points
/// inside a layer are not entered (overlayfs shows the directory underneath, usually
/// empty), so whatever a layer holds but the merged view does not show (the host's `/work`
/// under the host mask, `/proc`…) is not counted. A live filesystem (the host's `/`) may
/// change during the walk: entries that disappear are skipped.
struct MergeScan<'a> {
    lowers: &'a [Lower],
    /// Estimated use of the merged view.
    usage: Usage,
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
            usage: Usage::default(),
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
        ancestors.push((rel.to_path_buf(), top.path.join(rel)));
        // Name → its entries in the layers that have it, topmost first.
        let mut names = BTreeMap::<OsString, Vec<Found>>::new();
        let mut whiteouts = false;
        for &i in layers {
            let Some(lower) = lowers.get(i) else {
                continue;
            };
            let dir = lower.path.join(rel);
            let entries = match fs::read_dir(&dir) {
                Ok(entries) => entries,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(io_err("read dir", &dir, e)),
            };
            for entry in entries {
                let entry = entry.map_err(|e| io_err("read dir", &dir, e))?;
                let meta = match entry.metadata() {
                    Ok(meta) => meta,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                    Err(e) => return Err(io_err("stat", &entry.path(), e)),
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
        self.count_dir();
        for (name, found) in &names {
            self.usage.bytes += (8 + name.len() as u64).div_ceil(4) * 4;
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
                self.count_file(&path, meta);
            }
            break;
        }
        if !dirs.is_empty() {
            self.dir(rel, &dirs, ancestors)?;
        } else if mount_point {
            self.count_dir();
        }
        Ok(())
    }

    /// Counts an (empty) directory; its entries are counted by [`Self::dir`].
    fn count_dir(&mut self) {
        self.usage.inodes += 1;
        self.usage.bytes += ROOT_BLOCK;
    }

    fn count_file(&mut self, path: &Path, meta: &fs::Metadata) {
        if meta.nlink() > 1 && !self.seen.insert((meta.dev(), meta.ino())) {
            return;
        }
        self.usage.inodes += 1;
        let file_type = meta.file_type();
        if file_type.is_file() {
            self.usage.bytes += file_data_bytes(path, meta);
        } else if file_type.is_symlink() && meta.len() >= 60 {
            // Shorter targets are stored in the inode.
            self.usage.bytes += ROOT_BLOCK;
        }
    }
}

/// The space the regular file `path` takes in an image: its size in whole blocks, or, if it
/// has holes, its data ranges in whole blocks (`mke2fs -d` keeps holes, so a sparse file of
/// terabytes like `/var/log/lastlog` needs no space).
fn file_data_bytes(path: &Path, meta: &fs::Metadata) -> u64 {
    let size = meta.len().div_ceil(ROOT_BLOCK) * ROOT_BLOCK;
    if meta.blocks() * 512 >= size {
        return size;
    }
    // Fewer blocks than its size: sparse, compressed or inline. Only holes are subtracted.
    data_ranges_bytes(path, meta.len()).map_or(size, |data| data.min(size))
}

/// The total size of the data ranges (`SEEK_DATA`/`SEEK_HOLE`) of the first `len` bytes of
/// the file `path`, each rounded out to whole blocks; `None` if they cannot be listed.
fn data_ranges_bytes(path: &Path, len: u64) -> Option<u64> {
    use rustix::fs::SeekFrom;
    let file = fs::File::open(path).ok()?;
    let mut total = 0;
    let mut pos = 0;
    while pos < len {
        let start = match rustix::fs::seek(&file, SeekFrom::Data(pos)) {
            Ok(start) => start,
            Err(rustix::io::Errno::NXIO) => break,
            Err(_) => return None,
        };
        let end = rustix::fs::seek(&file, SeekFrom::Hole(start))
            .ok()?
            .min(len);
        if end <= start {
            break;
        }
        total += end.div_ceil(ROOT_BLOCK) * ROOT_BLOCK - start / ROOT_BLOCK * ROOT_BLOCK;
        pos = end;
    }
    Some(total)
}

/// Creates the fix-up layer at `root`: the directories `dirs` (relative path → directory to
/// copy mode, owner, times and xattrs from), nothing else. Not opaque, it changes no
/// contents; it only makes overlayfs merge (and filter) those directories.
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
    /// The lower layers, topmost first.
    lowers: &'a [Lower],
    /// Where the tmpfs holding the merged mount point and staged layers is mounted.
    mnt: PathBuf,
    /// The image file to fill.
    image: PathBuf,
    /// Paths that must not be visible in the merged view (the work directory, next to the
    /// image): if they are, the image would contain itself.
    guards: Vec<PathBuf>,
    size_kib: u64,
    inodes: u64,
}

impl BuildPlan<'_> {
    /// The shell script: mount a tmpfs at `mnt`, copy the nested layers into it, mount the
    /// merged view, check the guards, run mke2fs.
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
        script.push_str(&format!(
            "mke2fs -q -F -t ext4 -b {ROOT_BLOCK} -I {ROOT_INODE_SIZE} -m 0 -O ^has_journal -L dsec-root \
             -N {} -E root_owner=0:0 -d {} {} {}k\n",
            self.inodes,
            sh_quote(&merged),
            sh_quote(image),
            self.size_kib
        ));
        Ok(script)
    }
}

/// `s` quoted for the shell.
fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The usage of the tree at `path` (one filesystem, each hard-linked file once), as tmpfs
/// or ext4 pages.
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
        usage.bytes += meta.len().div_ceil(ROOT_BLOCK).max(1) * ROOT_BLOCK;
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
    if let Some(path) = find_executable(QEMU_BINARY) {
        return Ok(path);
    }
    apt_get(
        &["install", "-y", "--no-install-recommends", QEMU_PACKAGE],
        None,
    )?;
    find_executable(QEMU_BINARY).ok_or(ImageError::QemuMissing {
        binary: QEMU_BINARY,
        package: QEMU_PACKAGE,
    })
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
        if find_executable("cpio").is_none() {
            eprintln!("skipped: no cpio");
            return Ok(());
        }
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

    #[test]
    fn option_paths_are_checked() {
        assert!(check_option_path(Path::new("/a/b c")).is_ok());
        for bad in ["/a:b", "/a,b", "/a\\b", "/a\nb"] {
            assert!(check_option_path(Path::new(bad)).is_err(), "{bad}");
        }
        assert_eq!(sh_quote("it's"), r"'it'\''s'");
    }

    #[test]
    fn merged_view_size_estimate() -> anyhow::Result<()> {
        const MIB: u64 = 1 << 20;
        let dir = tempfile::tempdir()?;
        let base = dir.path().join("base");
        let top = dir.path().join("top");
        for d in ["etc", "usr/lib", "var"] {
            fs::create_dir_all(base.join(d))?;
        }
        fs::write(base.join("etc/passwd"), "root:x:0:0\n")?;
        fs::hard_link(base.join("etc/passwd"), base.join("usr/passwd"))?;
        fs::write(base.join("usr/lib/big"), vec![7u8; 8 << 20])?;
        // 1 GiB apparent, one block of data.
        let sparse = fs::File::create(base.join("var/sparse"))?;
        sparse.set_len(1 << 30)?;
        std::os::unix::fs::FileExt::write_all_at(&sparse, b"data", 512 << 20)?;
        drop(sparse);
        std::os::unix::fs::symlink("x".repeat(100), base.join("var/long-link"))?;
        for d in ["etc", "usr/lib"] {
            fs::create_dir_all(top.join(d))?;
        }
        fs::write(top.join("etc/hostname"), "sandbox\n")?;
        whiteout(&top.join("usr/lib/big"))?;
        whiteout(&top.join("var"))?;

        let scan = |layers: &[&Path]| -> anyhow::Result<Usage> {
            let lowers = layers
                .iter()
                .map(|p| Lower::new(p))
                .collect::<Result<Vec<_>, _>>()?;
            Ok(MergeScan::run(&lowers)?.usage)
        };

        // Alone, the base counts its big file, the data of its sparse file, a hard-linked
        // file once: dirs /, etc, usr, usr/lib, var + passwd, big, sparse, long-link.
        let alone = scan(&[&base])?;
        assert_eq!(alone.inodes, 9, "{alone:?}");
        assert!(alone.bytes >= (8 << 20) + 2 * ROOT_BLOCK, "{alone:?}");
        assert!(
            alone.bytes < 9 * MIB,
            "the sparse file's holes count: {alone:?}"
        );

        // Under the top layer, the whiteouts hide the big file and all of var; the hidden
        // entries of the base do not count: dirs /, etc, usr, usr/lib + passwd, hostname.
        let merged = scan(&[&top, &base])?;
        assert_eq!(merged.inodes, 6, "{merged:?}");
        assert!(merged.bytes < MIB, "hidden files count: {merged:?}");
        assert_eq!(scan(&[&top])?.inodes, 5, "whiteouts are not counted");

        let (bytes, inodes) = image_size(merged);
        assert_eq!(bytes % ROOT_BLOCK, 0);
        assert!(bytes >= ROOT_SLACK + merged.bytes && bytes < ROOT_SLACK + 8 * MIB);
        assert_eq!(
            inodes,
            merged.inodes + merged.inodes / 5 + ROOT_SLACK_INODES
        );

        if !rustix::process::geteuid().is_root() {
            eprintln!("opaque directories skipped: needs root for trusted xattrs");
            return Ok(());
        }
        // An opaque directory hides what is below it.
        fs::create_dir_all(top.join("etc2"))?;
        fs::create_dir_all(base.join("etc2"))?;
        fs::write(base.join("etc2/big"), vec![1u8; 4 << 20])?;
        assert!(scan(&[&top, &base])?.bytes > 4 * MIB);
        opaque(&top.join("etc2"))?;
        let hidden = scan(&[&top, &base])?;
        assert_eq!(hidden.inodes, 7, "{hidden:?}");
        assert!(hidden.bytes < MIB, "{hidden:?}");
        Ok(())
    }

    // -- Root images: these need root, unshare, mke2fs and debugfs. --

    /// The root-image tests need root and these tools (the test command installs them); a
    /// machine without them fails the tests instead of skipping them.
    fn require_image_tools() {
        assert!(
            rustix::process::geteuid().is_root(),
            "the root-image tests need root"
        );
        for tool in ["unshare", "mke2fs", "debugfs", "mount"] {
            assert!(
                find_executable(tool).is_some()
                    || Path::new("/usr/sbin").join(tool).exists()
                    || Path::new("/sbin").join(tool).exists(),
                "the root-image tests need {tool} (scripts/test.sh installs it)"
            );
        }
    }

    /// `debugfs -R <request> <image>` output.
    fn debugfs(image: &Path, request: &str) -> anyhow::Result<String> {
        let out = run(Command::new("debugfs").arg("-R").arg(request).arg(image))?;
        Ok(String::from_utf8(out.stdout)?)
    }

    /// The entries of `dir` in `image`: name → (mode, size), without `.` and `..`.
    fn image_dir(image: &Path, dir: &str) -> anyhow::Result<BTreeMap<String, (u32, u64)>> {
        // `ls -p` lines: /inode/mode/uid/gid/name/size/
        let mut entries = BTreeMap::new();
        for line in debugfs(image, &format!("ls -p {dir}"))?.lines() {
            let fields: Vec<&str> = line.split('/').collect();
            if fields.len() < 7 || fields[5] == "." || fields[5] == ".." {
                continue;
            }
            let mode = u32::from_str_radix(fields[2], 8)?;
            let size = fields[6].parse().unwrap_or(0);
            entries.insert(fields[5].to_string(), (mode, size));
        }
        Ok(entries)
    }

    fn keys(map: &BTreeMap<String, (u32, u64)>) -> Vec<&str> {
        map.keys().map(String::as_str).collect()
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
            crate::template::unpack::OPAQUE_XATTR,
            b"y",
            rustix::fs::XattrFlags::empty(),
        )?;
        Ok(())
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
        build_root_image(RootSource::Layers(&[base.clone(), top.clone()]), &out)?;

        assert_eq!(
            fs::read_dir(&out_dir)?.count(),
            1,
            "no temporary files left"
        );
        let meta = fs::metadata(&out)?;
        assert!(meta.len() >= ROOT_SLACK);
        assert!(meta.blocks() * 512 < meta.len() / 4, "the image is sparse");

        let root = image_dir(&out, "/")?;
        assert_eq!(
            keys(&root),
            ["etc", "lost+found", "newdir", "opaque", "usr"]
        );
        assert_eq!(keys(&image_dir(&out, "/etc")?), ["hostname", "passwd"]);
        assert_eq!(keys(&image_dir(&out, "/opaque")?), ["visible"]);
        assert_eq!(keys(&image_dir(&out, "/newdir/sub")?), ["real"]);
        let newdir = debugfs(&out, "stat /newdir")?;
        assert!(newdir.contains("Mode:  0750"), "{newdir}");
        assert!(newdir.contains("User:  1234"), "{newdir}");
        assert!(newdir.contains("Group:  5678"), "{newdir}");
        let lib = image_dir(&out, "/usr/lib")?;
        assert_eq!(lib["big"].1, 100_000);
        let links = debugfs(&out, "stat /usr/lib/big")?;
        assert!(links.contains("Links: 2"), "hard links are kept: {links}");
        let link = image_dir(&out, "/usr")?;
        assert_eq!(link["passwd-link"].0 & 0o170_000, 0o120_000);
        // No overlayfs xattr leaked.
        let xattrs = debugfs(&out, "ea_list /opaque")?;
        assert!(!xattrs.contains("overlay"), "{xattrs}");
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
        build_root_image(RootSource::Layers(std::slice::from_ref(&layer)), &single)?;
        assert_eq!(keys(&image_dir(&single, "/")?), ["bin", "lost+found"]);
        assert_eq!(keys(&image_dir(&single, "/bin")?), ["sh"]);

        // A mask layer inside the layer below it (like the host mask inside `/`): overlayfs
        // refuses that (ELOOP), so the mask is staged on a tmpfs.
        let mask = layer.join("mask");
        fs::create_dir_all(mask.join("bin"))?;
        whiteout(&mask.join("bin/sh"))?;
        whiteout(&mask.join("mask"))?;
        let lowerdir = format!("{}:{}", mask.display(), layer.display());
        let nested = out_dir.join("nested.img");
        build_root_image(RootSource::Overlay { lowerdir }, &nested)?;
        assert_eq!(keys(&image_dir(&nested, "/")?), ["bin", "lost+found"]);
        assert!(image_dir(&nested, "/bin")?.is_empty());

        // An image whose temporary files would be visible in its own source is refused.
        let inside = layer.join("inside.img");
        let err = build_root_image(RootSource::Layers(std::slice::from_ref(&layer)), &inside);
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

        let err = build_root_image(
            RootSource::Overlay {
                lowerdir: "relative".into(),
            },
            &nested,
        );
        assert!(
            matches!(err, Err(ImageError::InvalidSource { .. })),
            "{err:?}"
        );
        Ok(())
    }

    /// Builds the host template's root image (`<mask>:/`, a few GB) at
    /// `$DSEC_DEV_HOST_IMAGE`, whose directory must be hidden by the mask (e.g. under
    /// `/var/cache`): `DSEC_DEV_HOST_IMAGE=/var/cache/dsec-dev/vm/host-root.img cargo test -p
    /// dsec-node --lib vm::image -- --ignored --nocapture`.
    #[test]
    #[ignore = "builds an image of the host's /; set DSEC_DEV_HOST_IMAGE"]
    fn real_host_root_image() -> anyhow::Result<()> {
        let Some(out) = std::env::var_os("DSEC_DEV_HOST_IMAGE") else {
            eprintln!("skipped: DSEC_DEV_HOST_IMAGE is not set");
            return Ok(());
        };
        let out = PathBuf::from(out);
        let data_dir = parent_dir(&out).join("host-data");
        fs::create_dir_all(&data_dir)?;
        let mask = crate::template::host_mask_layer(&data_dir, &[])?;
        let start = std::time::Instant::now();
        let lowers = [Lower::new(&mask)?, Lower::new(Path::new("/"))?];
        let usage = MergeScan::run(&lowers)?.usage;
        eprintln!(
            "merged view: {usage:?}, image {:?}, scanned in {:?}",
            image_size(usage),
            start.elapsed()
        );
        let start = std::time::Instant::now();
        let lowerdir = format!("{}:/", mask.display());
        build_root_image(RootSource::Overlay { lowerdir }, &out)?;
        let meta = fs::metadata(&out)?;
        eprintln!(
            "{}: {} bytes ({} allocated) in {:?}",
            out.display(),
            meta.len(),
            meta.blocks() * 512,
            start.elapsed()
        );
        assert!(!image_dir(&out, "/etc")?.contains_key("shadow"));
        assert!(image_dir(&out, "/etc")?.contains_key("passwd"));
        assert!(image_dir(&out, "/root")?.is_empty());
        assert!(image_dir(&out, "/var/cache")?.is_empty());
        let top = image_dir(&out, "/")?;
        eprintln!("/: {:?}", keys(&top));
        assert_eq!(top["tmp"].0, 0o041_777);
        Ok(())
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
