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

pub mod decode;
pub mod disk;
pub mod initramfs;
pub mod kernel;
pub mod modules;
pub mod tools;

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use sha2::{Digest as _, Sha256};

pub use disk::build_upper_image;
pub use initramfs::build_initramfs;
pub use kernel::{kernel_cached, prepare_kernel, Kernel, KERNEL_DEB_ENV, KERNEL_META_PACKAGE};
pub use modules::{MICROVM_MODULES, VM_MODULES};
pub use tools::{ensure_qemu, ensure_tool};

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

/// Writes `data` to `path` (a new file).
fn write_file(path: &Path, data: &[u8]) -> Result<(), ImageError> {
    fs::write(path, data).map_err(|e| io_err("write", path, e))
}

/// The directory containing `path` (`.` for a bare file name).
pub(super) fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    }
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

#[cfg(test)]
mod tests {
    use super::modules::ModuleIndex;
    use super::*;

    #[test]
    fn image_key_joins_with_nul() {
        assert_eq!(image_key(&["a", "b"]), hex::encode(Sha256::digest(b"a\0b")));
        assert_ne!(image_key(&["ab"]), image_key(&["a", "b"]));
        assert_eq!(image_key(&[]), hex::encode(Sha256::digest(b"")));
    }

    /// Prepares the real kernel and initramfs into `$DSEC_DEV_VM_CACHE` (downloads from the
    /// Debian mirror): `DSEC_DEV_VM_CACHE=/var/cache/dsec-dev/vm cargo test -p dsec-node --lib
    /// vm::image -- --ignored --nocapture`.
    #[test]
    #[ignore = "downloads Debian's kernel; set DSEC_DEV_VM_CACHE"]
    fn real_kernel_and_initramfs() -> anyhow::Result<()> {
        let cache = crate::substrate::vm::dev_path("DSEC_DEV_VM_CACHE");
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
