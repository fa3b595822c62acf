//! The run dirs (`/run/<prefix><pid>-…`) test processes leave behind: shared by `common` and
//! `tests/isolation.rs` (which includes this file with `#[path]`).

use std::fs;
use std::path::Path;

/// Removes the run dirs named `<prefix><pid>-…` of earlier test processes that are gone (their
/// mask tmpfs stays mounted when their runtime was never dropped).
pub fn sweep_stale_run_dirs(prefix: &str) {
    let Ok(entries) = fs::read_dir("/run") else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(prefix) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        unmount_and_remove(&e.path());
    }
}

/// Unmounts a run dir's mask tmpfs (lazily) and removes the dir.
pub fn unmount_and_remove(run_dir: &Path) {
    let mask = run_dir.join("mask");
    let _ = std::process::Command::new("umount")
        .arg("-l")
        .arg(&mask)
        .stderr(std::process::Stdio::null())
        .status();
    let _ = fs::remove_dir_all(run_dir);
}
