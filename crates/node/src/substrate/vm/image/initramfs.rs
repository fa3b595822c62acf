//! The guest initramfs: an uncompressed newc cpio archive with the agent as `/init` and the
//! kernel modules it loads.

use std::fs;
use std::io::{self, BufWriter, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use super::kernel::Kernel;
use super::modules::ModuleIndex;
use super::{io_err, parent_dir, ImageError};

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

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, HashSet};
    use std::process::Command;

    use super::super::modules::tests::fake_kernel;
    use super::super::modules::{module_name, MICROVM_MODULES};
    use super::super::tools::{find_executable, run};
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
                "virtio-rng.ko",
                "failover.ko",
                "net_failover.ko",
                "virtio_net.ko"
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

        let err = build_initramfs(&agent, &kernel, &["e1000"], &out);
        assert!(matches!(err, Err(ImageError::ModuleNotFound(_))), "{err:?}");
        Ok(())
    }
}
