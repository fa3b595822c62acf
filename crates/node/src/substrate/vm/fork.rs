//! Snapshots of running VM sandboxes, and sandboxes restored from them.
//!
//! A running guest is saved like a template's snapshot, except for its memory: it is stopped,
//! its whole state — RAM included, for a clone's RAM is a private mapping of its template's
//! file, not a shared one `x-ignore-shared` could skip — goes to a migration stream
//! (`state`), and the copy-on-write overlay QEMU keeps for its writable disk (created in the
//! cache's `tmp/` and unlinked, reached through `/proc/<qemu>/fd`) is copied to `upper.qcow2`
//! while the migration has the disks flushed and inactive; then it goes on (`cont`). A sandbox
//! made from such a snapshot loads the stream into anonymous RAM (the stream has every page
//! the guest used, so a mapping of the template's file would be copied page by page for
//! nothing), with the copied overlay as its disk's base: its processes, their memory and its
//! files are the guest's at the snapshot.

use std::fs;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::qemu::{Qmp, QMP_SOCK};
use super::{Snapshot, VmError, VmRuntime};

/// The copied disk overlay in a running guest's snapshot.
pub const UPPER: &str = "upper.qcow2";

/// How long saving a running guest may take.
const SAVE_TIMEOUT: Duration = Duration::from_secs(120);

impl Snapshot {
    /// The snapshot of a running guest saved in `dir` by [`VmRuntime::save_running`], over
    /// `base` (the template snapshot the guest was restored from, or another such).
    pub fn derived(base: &Arc<Snapshot>, dir: PathBuf) -> Result<Snapshot, VmError> {
        let template = match &base.base {
            Some(t) => Arc::clone(t),
            None => Arc::clone(base),
        };
        let mut s = Snapshot {
            key: base.key.clone(),
            dir,
            root_image: base.root_image.clone(),
            initrd: base.initrd.clone(),
            cmdline: base.cmdline.clone(),
            boot_ms: 0,
            save_ms: 0,
            _held: Vec::new(),
            base: Some(template),
        };
        for p in [s.state(), s.upper()] {
            s._held
                .push(fs::File::open(&p).map_err(VmError::io("open a VM snapshot"))?);
        }
        Ok(s)
    }
}

/// The writable disk's overlay QEMU `pid` made in `tmp` and unlinked.
fn overlay_of(pid: i32, tmp: &Path) -> Result<PathBuf, VmError> {
    let fds = PathBuf::from(format!("/proc/{pid}/fd"));
    let prefix = tmp.display().to_string();
    for e in fs::read_dir(&fds).map_err(VmError::io("list QEMU's descriptors"))? {
        let Ok(e) = e else { continue };
        let Ok(target) = fs::read_link(e.path()) else {
            continue;
        };
        let t = target.display().to_string();
        if t.starts_with(&prefix) && t.ends_with(" (deleted)") {
            return Ok(e.path());
        }
    }
    Err(VmError::Qmp(
        "the writable disk's overlay is not open in QEMU".into(),
    ))
}

impl VmRuntime {
    /// Saves the running guest of sandbox `id` (QEMU `pid`) into `dest` (its state stream and
    /// disk overlay) and lets it go on: the bytes written.
    pub fn save_running(&self, id: &str, pid: i32, dest: &Path) -> Result<u64, VmError> {
        let deadline = Instant::now() + SAVE_TIMEOUT;
        let mut qmp = Qmp::connect(&self.run_dir(id).join(QMP_SOCK), deadline)?;
        qmp.execute("stop", Value::Null)?;
        let saved = (|| -> Result<u64, VmError> {
            // As every clone loads its stream: on (a clone's RAM is private, so it is saved
            // all the same).
            qmp.ignore_shared()?;
            // The default bandwidth (128 MiB/s) would make a 100 MiB guest take a second.
            qmp.execute(
                "migrate-set-parameters",
                json!({ "max-bandwidth": 1u64 << 40 }),
            )?;
            let state_path = dest.join("state");
            let state =
                fs::File::create(&state_path).map_err(VmError::io("create the VM state file"))?;
            qmp.pass_fd("save", state.as_fd())?;
            drop(state);
            qmp.execute("migrate", json!({ "uri": "fd:save" }))?;
            qmp.wait_migration(deadline)?;
            // The migration flushed the disks and let go of them: the overlay is whole.
            let overlay = overlay_of(pid, &self.cache.join("tmp"))?;
            let disk = fs::copy(&overlay, dest.join(UPPER))
                .map_err(VmError::io("copy the disk overlay"))?;
            let state = fs::metadata(&state_path)
                .map_err(VmError::io("stat the VM state"))?
                .len();
            Ok(state + disk)
        })();
        // Whatever happened, the guest goes on.
        let resumed = qmp.execute("cont", Value::Null);
        let bytes = saved?;
        resumed?;
        Ok(bytes)
    }
}
