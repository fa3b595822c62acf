//! S-13: a walk of the whole file system (but `/proc` and `/sys`) for device nodes. Whatever a
//! node's mount, mode and place, a device outside the sandbox's list must not open.

use std::fs::{self, OpenOptions};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::{sys, Check};

/// Entries the walk looks at, at most (a bound on time; the count is reported).
const MAX_ENTRIES: usize = 2_000_000;

/// Device nodes listed in the detail, at most.
const MAX_LISTED: usize = 256;

/// The sandbox's devices (`dsec_sys::launch::SANDBOX_DEVICES`): `null zero full random urandom`,
/// `tty`, `ptmx` and every pty; all character devices.
pub fn on_the_list(block: bool, rdev: u64) -> bool {
    !block
        && matches!(
            sys::major_minor(rdev),
            (1, 3 | 5 | 7 | 8 | 9) | (5, 0 | 2) | (136, _)
        )
}

/// Opens `path` for reading and, where the file's mode refused that (`EACCES`), for writing;
/// non-blocking and without becoming a controlling terminal. Returns what each attempt gave
/// (`"opened"` or `{"errno": n}`) and whether one opened.
fn try_open(path: &Path) -> (Value, bool) {
    let mut opened = false;
    let mut tries = serde_json::Map::new();
    for (name, write) in [("read", false), ("write", true)] {
        if write && tries.get("read") != Some(&json!({ "errno": libc::EACCES })) {
            break;
        }
        let r = OpenOptions::new()
            .read(!write)
            .write(write)
            .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
            .open(path);
        let v = match r {
            Ok(_) => {
                opened = true;
                json!("opened")
            }
            Err(e) => json!({ "errno": e.raw_os_error().unwrap_or(0) }),
        };
        tries.insert(name.to_owned(), v);
    }
    (Value::Object(tries), opened)
}

/// Every device node under `/` (not following symbolic links, but into every mount; `/proc` and
/// `/sys` skipped): `(path, block, rdev)`. Also returns how many entries were looked at.
fn find_nodes() -> (Vec<(PathBuf, bool, u64)>, usize) {
    let mut nodes = Vec::new();
    let mut seen = 0usize;
    let mut stack = vec![PathBuf::from("/")];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            seen += 1;
            if seen > MAX_ENTRIES {
                return (nodes, seen);
            }
            let path = entry.path();
            let Ok(ft) = entry.file_type() else { continue };
            if ft.is_dir() {
                if path != Path::new("/proc") && path != Path::new("/sys") {
                    stack.push(path);
                }
                continue;
            }
            // The directory entry's type is that of the node underneath a mount: a device bound
            // over a file (the user-namespace mode's `/dev`) shows as a file. `lstat` sees the
            // mounted one.
            let Ok(m) = fs::symlink_metadata(&path) else {
                continue;
            };
            let ft = m.file_type();
            if ft.is_char_device() || ft.is_block_device() {
                nodes.push((path, ft.is_block_device(), m.rdev()));
            }
        }
    }
    (nodes, seen)
}

/// S-13: walks the file system and tries to open every character or block device outside the
/// sandbox's list ([`on_the_list`]); passes when none opened. Outside a sandbox (no seccomp
/// filter) it does nothing: opening the host's devices is not harmless (a watchdog, a tape).
pub fn walk_check() -> Check {
    if !sys::seccomp_active() {
        return Check {
            id: "S-13",
            pass: false,
            detail: json!({ "skipped": "no seccomp filter active; the walk only runs in a sandbox" }),
        };
    }
    let (nodes, seen) = find_nodes();
    let mut listed = serde_json::Map::new();
    let mut outside = Vec::new();
    let mut opened = Vec::new();
    for (path, block, rdev) in &nodes {
        let (major, minor) = sys::major_minor(*rdev);
        let node = format!("{} {major}:{minor}", if *block { "b" } else { "c" });
        let name = path.display().to_string();
        if listed.len() < MAX_LISTED {
            listed.insert(name.clone(), json!(node));
        }
        if on_the_list(*block, *rdev) {
            continue;
        }
        let (tries, did_open) = try_open(path);
        if did_open {
            opened.push(name.clone());
        }
        outside.push(json!({ "path": name, "node": node, "open": tries }));
    }
    Check {
        id: "S-13",
        pass: opened.is_empty() && seen <= MAX_ENTRIES,
        detail: json!({
            "entries": seen,
            "device_nodes": nodes.len(),
            "nodes": listed,
            "outside_the_list": outside,
            "opened": opened,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_list_is_the_sandbox_devices() {
        for (major, minor) in [(1, 3), (1, 9), (5, 0), (5, 2), (136, 0), (136, 70_000)] {
            assert!(on_the_list(false, sys::makedev(major, minor)));
            assert!(!on_the_list(true, sys::makedev(major, minor)));
        }
        for (major, minor) in [(1, 1), (1, 11), (5, 1), (10, 200), (137, 0), (0, 0)] {
            assert!(!on_the_list(false, sys::makedev(major, minor)));
        }
    }
}
