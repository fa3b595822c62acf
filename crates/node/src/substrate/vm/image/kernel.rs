//! The guest kernel: Debian's cloud kernel, downloaded (or given as a `.deb`), unpacked into the
//! cache once, its `bzImage` decompressed to the ELF `vmlinux` QEMU boots through PVH.

use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::{Deserialize, Serialize};

use super::decode::extract_vmlinux;
use super::modules::{ensure_modules_dep, MODULES_DEP};
use super::tools::{apt_download, deb_field, is_package_name, run};
use super::{io_err, write_file, ImageError};

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
