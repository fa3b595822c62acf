//! The file operations of the writer and of compaction, behind a small trait so that tests can
//! inject failures (F-12: write errors, short writes, fsync errors, slow disks; failures between
//! compaction's write, rename and directory sync).
//!
//! Only the mutating operations of the writer and compaction go through [`Storage`]; recovery,
//! retention and reads use the file system directly, since a fault there is reported as an error
//! and never acknowledged.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::Path;
use std::time::SystemTime;

/// Creates and opens segment files for appending.
pub trait Storage: Send + Sync + 'static {
    /// Creates a new, empty segment file (it must not exist) and makes its directory entry
    /// durable.
    fn create(&self, path: &Path) -> io::Result<Box<dyn SegmentFile>>;
    /// Opens an existing segment for appending at its end.
    fn open_append(&self, path: &Path) -> io::Result<Box<dyn SegmentFile>>;

    /// Compaction: writes `data` to a new file (replacing a leftover of the same name), sets its
    /// modification time to `modified` and makes it durable (`fsync`).
    fn write_durable(&self, path: &Path, data: &[u8], modified: SystemTime) -> io::Result<()> {
        let mut file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)?;
        file.write_all(data)?;
        file.set_modified(modified)?;
        file.sync_all()
    }

    /// Compaction: atomically replaces `to` with `from` (`rename(2)`).
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::rename(from, to)
    }

    /// Makes the entries of a directory durable (after compaction's rename).
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        sync_dir(dir)
    }
}

/// An open segment, written only at its end.
pub trait SegmentFile: Send {
    /// Writes some prefix of `buf`, returning how many bytes were written (like `write(2)`).
    fn write(&mut self, buf: &[u8]) -> io::Result<usize>;
    /// Makes every written byte durable (`fdatasync(2)`).
    fn sync_data(&mut self) -> io::Result<()>;
}

/// The real file system.
#[derive(Debug, Default, Clone, Copy)]
pub struct FsStorage;

impl Storage for FsStorage {
    fn create(&self, path: &Path) -> io::Result<Box<dyn SegmentFile>> {
        let file = OpenOptions::new()
            .append(true)
            .create_new(true)
            .open(path)?;
        file.sync_all()?;
        if let Some(dir) = path.parent() {
            sync_dir(dir)?;
        }
        Ok(Box::new(FsSegment { file }))
    }

    fn open_append(&self, path: &Path) -> io::Result<Box<dyn SegmentFile>> {
        let file = OpenOptions::new().append(true).open(path)?;
        Ok(Box::new(FsSegment { file }))
    }
}

struct FsSegment {
    file: File,
}

impl SegmentFile for FsSegment {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.file.write(buf)
    }

    fn sync_data(&mut self) -> io::Result<()> {
        rustix::fs::fdatasync(&self.file).map_err(io::Error::from)
    }
}

/// Makes the entries of a directory durable.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}
