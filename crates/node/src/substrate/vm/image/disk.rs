//! The writable layer's disk: an empty ext4 filesystem per snapshot.

use std::path::Path;
use std::process::Command;

use super::tools::run;
use super::{io_err, ImageError};

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
