//! Kernel modules: the ones a guest loads, `modules.dep` generated from the modules' `.modinfo`
//! when a package does not ship it, and the index that orders a module list for loading.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::process::Command;

use super::decode::elf_section;
use super::tools::run;
use super::{io_err, write_file, ImageError};

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
    // The NIC of a sandbox's network egress (its dependencies `net_failover` and `failover`
    // resolved automatically).
    "virtio_net",
];

/// [`MICROVM_MODULES`] plus the virtio PCI transport, for full VMs (`qemu -M q35`); its
/// dependencies (`virtio_pci_modern_dev`, `virtio_pci_legacy_dev`) are resolved automatically.
pub const VM_MODULES: &[&str] = &{
    let mut all = [""; MICROVM_MODULES.len() + 1];
    let mut i = 0;
    while i < MICROVM_MODULES.len() {
        all[i] = MICROVM_MODULES[i];
        i += 1;
    }
    all[i] = "virtio_pci";
    all
};

/// The module dependency index, in depmod's format.
pub(super) const MODULES_DEP: &str = "modules.dep";
/// The list of modules built into the kernel.
pub(super) const MODULES_BUILTIN: &str = "modules.builtin";

/// File name suffixes of kernel modules (uncompressed and compressed).
const MODULE_SUFFIXES: &[&str] = &[".ko", ".ko.xz", ".ko.zst", ".ko.gz"];

/// The kernel's name for a module file or name: the file name without its module suffix,
/// `-` replaced by `_` (`drivers/char/hw_random/virtio-rng.ko` → `virtio_rng`).
pub(super) fn module_name(path_or_name: &str) -> String {
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
pub(super) fn ensure_modules_dep(modules_dir: &Path) -> Result<(), ImageError> {
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

/// A kernel's module index: `modules.dep` and `modules.builtin`.
pub(super) struct ModuleIndex {
    /// `modules.dep`, for error messages.
    pub(super) source: PathBuf,
    /// Module path (relative to the modules directory) → its dependency paths.
    deps: HashMap<PathBuf, Vec<PathBuf>>,
    /// Module name → its path (the first one listed, as modprobe does).
    by_name: HashMap<String, PathBuf>,
    /// Names of modules built into the kernel.
    builtin: HashSet<String>,
}

impl ModuleIndex {
    /// Reads the index of `modules_dir` (generating `modules.dep` in memory when absent).
    pub(super) fn load(modules_dir: &Path) -> Result<Self, ImageError> {
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
    pub(super) fn resolve(&self, wanted: &[&str]) -> Result<Vec<PathBuf>, ImageError> {
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

#[cfg(test)]
pub(super) mod tests {
    use super::super::{parent_dir, Kernel};
    use super::*;

    const FAKE_DEP: &str = "\
kernel/drivers/virtio/virtio.ko:
kernel/drivers/virtio/virtio_ring.ko: kernel/drivers/virtio/virtio.ko
kernel/drivers/virtio/virtio_mmio.ko: kernel/drivers/virtio/virtio_ring.ko kernel/drivers/virtio/virtio.ko
kernel/drivers/block/virtio_blk.ko: kernel/drivers/virtio/virtio_ring.ko kernel/drivers/virtio/virtio.ko
kernel/drivers/char/hw_random/virtio-rng.ko: kernel/drivers/char/hw_random/rng-core.ko kernel/drivers/virtio/virtio_ring.ko kernel/drivers/virtio/virtio.ko
kernel/drivers/char/hw_random/rng-core.ko:
kernel/fs/overlayfs/overlay.ko:
kernel/fs/squashfs/squashfs.ko:
kernel/drivers/net/virtio_net.ko: kernel/drivers/net/net_failover.ko kernel/net/core/failover.ko kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/net/net_failover.ko: kernel/net/core/failover.ko
kernel/net/core/failover.ko:
";

    /// A fake kernel: modules directory with [`FAKE_DEP`], module files, `modules.builtin`.
    pub(in super::super) fn fake_kernel(dir: &Path, builtin: &str) -> anyhow::Result<Kernel> {
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
    fn vm_modules_are_the_microvm_ones_and_virtio_pci() {
        assert_eq!(VM_MODULES, [MICROVM_MODULES, &["virtio_pci"]].concat());
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
}
