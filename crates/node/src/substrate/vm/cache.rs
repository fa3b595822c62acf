//! Housekeeping of the VM cache: which entries are in use, which go.
//!
//! The cache (`/var/cache/dsec/vm` by default, shared by every node of the host) holds the
//! guest kernel (`kernel/`), initramfs images (`initrd/`), template root images (`rootfs/`,
//! with `rootfs/src/`: which source key led to which image) and snapshots (`snap/`, each
//! naming the initramfs and root image it was made from in its `deps` file). Every entry's
//! modification time is its last use ([`touch`]).
//!
//! [`gc`] removes, of the entries no process has open (a running QEMU holds its snapshot's
//! files, its root image and initramfs; a node holds those of every snapshot it has loaded):
//!
//! - entries of earlier formats (`root/`: the ext4 root images of earlier versions), and
//!   snapshots whose initramfs or root image is gone: nothing reads them any more;
//! - entries unused for longer than the policy's idle time (24 h for a running node);
//! - past the policy's size bound, the least recently used entries until the cache fits;
//!   removing an initramfs or root image removes the snapshots made from it;
//! - leftovers of interrupted builds (the caller holds the cache lock, so none is under way).
//!
//! The kernel is not an entry: it is small and every VM needs it.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use serde::Serialize;

/// Sub-directories holding cache entries.
pub const ENTRY_DIRS: &[&str] = &["snap", "initrd", "rootfs"];
/// Sub-directories of earlier cache formats: never read, removed when unused.
pub const LEGACY_DIRS: &[&str] = &["root"];
/// The file in a snapshot directory naming its initramfs and root image (one path a line).
pub const DEPS_FILE: &str = "deps";
/// Where root image pointers live (`rootfs/src/<source key>` holds an image's file name).
pub const POINTERS: &str = "src";

/// What [`gc`] may remove.
#[derive(Debug, Clone, Copy, Default)]
pub struct GcPolicy {
    /// Remove entries unused for longer than this.
    pub max_idle: Option<Duration>,
    /// Keep the cache at most this large (bytes on disk), least recently used entries first.
    pub max_bytes: Option<u64>,
}

/// One removed entry.
#[derive(Debug, Clone, Serialize)]
pub struct Removed {
    /// Its path.
    pub path: PathBuf,
    /// Bytes it held on disk.
    pub bytes: u64,
    /// Why: `legacy`, `orphan`, `idle`, `size`, `partial`.
    pub reason: &'static str,
}

/// What [`gc`] did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct GcReport {
    /// Removed entries.
    pub removed: Vec<Removed>,
    /// Bytes freed on disk.
    pub bytes_freed: u64,
    /// Entries kept.
    pub kept: usize,
    /// Bytes the kept entries hold.
    pub kept_bytes: u64,
    /// Kept entries some process has open.
    pub in_use: usize,
}

/// One cache entry (a file or a snapshot directory).
#[derive(Debug, Clone)]
struct Entry {
    path: PathBuf,
    bytes: u64,
    used: SystemTime,
    partial: bool,
    legacy: bool,
    /// For a snapshot: the initramfs and root image it needs.
    deps: Vec<PathBuf>,
}

/// Marks a cache entry used now.
pub fn touch(p: &Path) {
    if let Ok(f) = fs::File::open(p) {
        let _ = f.set_modified(SystemTime::now());
    }
}

/// Bytes `path` holds on disk (allocated blocks; a directory with everything in it).
pub fn disk_bytes(path: &Path) -> u64 {
    let Ok(meta) = fs::symlink_metadata(path) else {
        return 0;
    };
    let mut n = meta.blocks() * 512;
    if meta.is_dir() {
        for e in fs::read_dir(path).into_iter().flatten().flatten() {
            n += disk_bytes(&e.path());
        }
    }
    n
}

fn entries(cache: &Path) -> Vec<Entry> {
    let mut out = Vec::new();
    let dirs = ENTRY_DIRS
        .iter()
        .map(|d| (d, false))
        .chain(LEGACY_DIRS.iter().map(|d| (d, true)));
    for (sub, legacy) in dirs {
        for e in fs::read_dir(cache.join(sub))
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = e.file_name().to_string_lossy().into_owned();
            if *sub == "rootfs" && name == POINTERS {
                continue;
            }
            let Ok(meta) = e.metadata() else { continue };
            let path = e.path();
            let deps = if *sub == "snap" {
                fs::read_to_string(path.join(DEPS_FILE))
                    .unwrap_or_default()
                    .lines()
                    .map(PathBuf::from)
                    .collect()
            } else {
                Vec::new()
            };
            out.push(Entry {
                bytes: disk_bytes(&path),
                used: meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                partial: name.ends_with(".tmp") || name.starts_with('.'),
                // A snapshot of an earlier format names no dependencies.
                legacy: legacy || (*sub == "snap" && !path.join(DEPS_FILE).exists()),
                deps,
                path,
            });
        }
    }
    out
}

/// The entries some process has open or mapped: their paths under `cache`, cut to
/// `<sub>/<name>`.
pub fn open_entries(cache: &Path) -> BTreeSet<PathBuf> {
    let cache = fs::canonicalize(cache).unwrap_or_else(|_| cache.to_path_buf());
    let mut out = BTreeSet::new();
    let mut note = |p: &Path| {
        if let Ok(rel) = p.strip_prefix(&cache) {
            let top: PathBuf = rel.components().take(2).collect();
            if top.components().count() == 2 {
                out.insert(cache.join(top));
            }
        }
    };
    for proc_entry in fs::read_dir("/proc").into_iter().flatten().flatten() {
        let pid = proc_entry.path();
        if !proc_entry
            .file_name()
            .to_string_lossy()
            .bytes()
            .all(|b| b.is_ascii_digit())
        {
            continue;
        }
        for fd in fs::read_dir(pid.join("fd")).into_iter().flatten().flatten() {
            if let Ok(target) = fs::read_link(fd.path()) {
                note(&target);
            }
        }
        let maps = fs::read_to_string(pid.join("maps")).unwrap_or_default();
        for line in maps.lines() {
            if let Some(i) = line.find(" /") {
                note(Path::new(line[i + 1..].trim_end_matches(" (deleted)")));
            }
        }
    }
    out
}

/// Removes what `policy` lets go (see the module documentation); `in_use` are the entries
/// some process has open ([`open_entries`]). The caller holds the cache lock.
pub fn gc(cache: &Path, policy: &GcPolicy, in_use: &BTreeSet<PathBuf>) -> GcReport {
    let cache_c = fs::canonicalize(cache).unwrap_or_else(|_| cache.to_path_buf());
    let rel = |p: &Path| -> PathBuf {
        p.strip_prefix(cache)
            .or_else(|_| p.strip_prefix(&cache_c))
            .map_or_else(|_| p.to_path_buf(), Path::to_path_buf)
    };
    let all = entries(cache);
    let by_rel: BTreeMap<PathBuf, Entry> = all.into_iter().map(|e| (rel(&e.path), e)).collect();
    // In use: open by a process, or needed by a snapshot that is.
    let mut busy: BTreeSet<PathBuf> = in_use.iter().map(|p| rel(p)).collect();
    for (r, e) in &by_rel {
        if busy.contains(r) {
            busy.extend(e.deps.iter().map(|d| rel(d)));
        }
    }
    let now = SystemTime::now();
    let mut report = GcReport::default();
    let mut gone: BTreeSet<PathBuf> = BTreeSet::new();
    let mut remove =
        |r: &PathBuf, e: &Entry, reason: &'static str, gone: &mut BTreeSet<PathBuf>| {
            let ok = if e.path.is_dir() {
                fs::remove_dir_all(&e.path)
            } else {
                fs::remove_file(&e.path)
            };
            if ok.is_ok() {
                gone.insert(r.clone());
                report.bytes_freed += e.bytes;
                report.removed.push(Removed {
                    path: e.path.clone(),
                    bytes: e.bytes,
                    reason,
                });
            }
        };
    let orphan = |e: &Entry, gone: &BTreeSet<PathBuf>| {
        e.deps
            .iter()
            .any(|d| gone.contains(&rel(d)) || !by_rel.contains_key(&rel(d)))
    };
    // Format, leftovers, orphans, idle time; snapshots first, so that each says why it went
    // (rather than `orphan` after its images).
    let mut order: Vec<(&PathBuf, &Entry)> = by_rel.iter().collect();
    order.sort_by_key(|(r, _)| !r.starts_with("snap"));
    for (r, e) in order {
        if busy.contains(r) {
            continue;
        }
        let idle = now.duration_since(e.used).unwrap_or_default();
        let reason = if e.legacy {
            Some("legacy")
        } else if e.partial {
            Some("partial")
        } else if orphan(e, &gone) {
            Some("orphan")
        } else if policy.max_idle.is_some_and(|m| idle >= m) {
            Some("idle")
        } else {
            None
        };
        if let Some(reason) = reason {
            remove(r, e, reason, &mut gone);
        }
    }
    // Size bound: least recently used first; a removed image takes its snapshots along.
    if let Some(max) = policy.max_bytes {
        let mut left: Vec<(&PathBuf, &Entry)> =
            by_rel.iter().filter(|(r, _)| !gone.contains(*r)).collect();
        left.sort_by_key(|(_, e)| e.used);
        let mut total: u64 = left.iter().map(|(_, e)| e.bytes).sum();
        for (r, e) in &left {
            if total <= max {
                break;
            }
            if busy.contains(*r) || gone.contains(*r) {
                continue;
            }
            remove(r, e, "size", &mut gone);
            total = total.saturating_sub(e.bytes);
            for (sr, se) in &by_rel {
                if !gone.contains(sr) && !busy.contains(sr) && orphan(se, &gone) {
                    remove(sr, se, "orphan", &mut gone);
                    total = total.saturating_sub(se.bytes);
                }
            }
        }
    }
    // Pointers to images that are gone.
    let pointers = cache.join("rootfs").join(POINTERS);
    for p in fs::read_dir(&pointers).into_iter().flatten().flatten() {
        let target = fs::read_to_string(p.path()).unwrap_or_default();
        let target = cache.join("rootfs").join(target.trim());
        if target.as_os_str().is_empty() || !target.is_file() {
            let _ = fs::remove_file(p.path());
        }
    }
    for (r, e) in &by_rel {
        if !gone.contains(r) {
            report.kept += 1;
            report.kept_bytes += e.bytes;
            report.in_use += usize::from(busy.contains(r));
        }
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(cache: &Path, rel: &str, bytes: usize, age_s: u64) -> PathBuf {
        let p = cache.join(rel);
        fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        fs::write(&p, vec![1u8; bytes]).expect("write");
        set_age(&p, age_s);
        p
    }

    fn set_age(p: &Path, age_s: u64) {
        let f = fs::File::open(p).expect("open");
        f.set_modified(SystemTime::now() - Duration::from_secs(age_s))
            .expect("mtime");
    }

    fn snapshot(cache: &Path, name: &str, deps: &[&Path], age_s: u64) -> PathBuf {
        let dir = cache.join("snap").join(name);
        fs::create_dir_all(&dir).expect("mkdir");
        fs::write(dir.join("ram"), vec![2u8; 64 << 10]).expect("ram");
        let deps: Vec<String> = deps.iter().map(|d| d.display().to_string()).collect();
        fs::write(dir.join(DEPS_FILE), deps.join("\n")).expect("deps");
        set_age(&dir, age_s);
        dir
    }

    fn names(r: &GcReport) -> Vec<(String, &'static str)> {
        let mut v: Vec<_> = r
            .removed
            .iter()
            .map(|x| {
                let n = x.path.file_name().map(|n| n.to_string_lossy().into_owned());
                (n.unwrap_or_default(), x.reason)
            })
            .collect();
        v.sort();
        v
    }

    #[test]
    fn old_formats_orphans_and_leftovers_go_first() {
        let dir = tempfile::tempdir().expect("tmp");
        let c = dir.path();
        let legacy = entry(c, "root/host-abc.ext4", 4096, 0);
        let initrd = entry(c, "initrd/i.cpio", 4096, 0);
        let image = entry(c, "rootfs/r.sqfs", 8192, 0);
        fs::create_dir_all(c.join("rootfs/src")).expect("mkdir");
        fs::write(c.join("rootfs/src/k1"), "r.sqfs").expect("ptr");
        fs::write(c.join("rootfs/src/k2"), "gone.sqfs").expect("ptr");
        snapshot(c, "ok", &[&initrd, &image], 0);
        snapshot(c, "orphan", &[&initrd, &c.join("rootfs/gone.sqfs")], 0);
        // A snapshot of the earlier format (no deps file).
        fs::create_dir_all(c.join("snap/old")).expect("mkdir");
        entry(c, "rootfs/.dsec-root-x.img.tmp", 100, 0);
        let r = gc(c, &GcPolicy::default(), &BTreeSet::new());
        assert_eq!(
            names(&r),
            [
                (".dsec-root-x.img.tmp".into(), "partial"),
                ("host-abc.ext4".into(), "legacy"),
                ("old".into(), "legacy"),
                ("orphan".into(), "orphan"),
            ]
        );
        assert!(!legacy.exists() && image.exists() && initrd.exists());
        assert!(c.join("rootfs/src/k1").exists(), "a live pointer stays");
        assert!(!c.join("rootfs/src/k2").exists(), "a dangling pointer goes");
        assert_eq!(r.kept, 3);
        assert!(r.bytes_freed >= 4096, "{r:?}");
    }

    #[test]
    fn idle_entries_go_unless_in_use() {
        let dir = tempfile::tempdir().expect("tmp");
        let c = dir.path();
        let day = 24 * 3600;
        let initrd = entry(c, "initrd/i.cpio", 4096, 2 * day);
        let image = entry(c, "rootfs/r.sqfs", 4096, 2 * day);
        let fresh = entry(c, "rootfs/fresh.sqfs", 4096, 10);
        let snap = snapshot(c, "s", &[&initrd, &image], 2 * day);
        let policy = GcPolicy {
            max_idle: Some(Duration::from_secs(day)),
            max_bytes: None,
        };
        // The snapshot is open (a QEMU runs from it): it and what it needs stay.
        let r = gc(c, &policy, &BTreeSet::from([snap.clone()]));
        assert!(r.removed.is_empty(), "{r:?}");
        assert_eq!(r.in_use, 3);
        let r = gc(c, &policy, &BTreeSet::new());
        assert_eq!(
            names(&r),
            [
                ("i.cpio".into(), "idle"),
                ("r.sqfs".into(), "idle"),
                ("s".into(), "idle")
            ]
        );
        assert!(fresh.exists());
        // `dsec vm gc`: everything unused.
        let all = GcPolicy {
            max_idle: Some(Duration::ZERO),
            max_bytes: None,
        };
        assert_eq!(
            names(&gc(c, &all, &BTreeSet::new())),
            [("fresh.sqfs".into(), "idle")]
        );
    }

    #[test]
    fn size_bound_evicts_least_recently_used_first_never_in_use() {
        let dir = tempfile::tempdir().expect("tmp");
        let c = dir.path();
        let kib = 1024;
        let oldest = entry(c, "rootfs/oldest.sqfs", 64 * kib, 500);
        let in_use = entry(c, "rootfs/in-use.sqfs", 64 * kib, 400);
        let older = entry(c, "rootfs/older.sqfs", 64 * kib, 300);
        let initrd = entry(c, "initrd/i.cpio", 4 * kib, 10);
        // Removing `older` takes the snapshot made from it along, however recent.
        snapshot(c, "of-older", &[&initrd, &older], 5);
        let newest = entry(c, "rootfs/newest.sqfs", 64 * kib, 1);
        let total: u64 = gc(c, &GcPolicy::default(), &BTreeSet::new()).kept_bytes;
        let policy = GcPolicy {
            max_idle: None,
            // Room for two images and the initramfs.
            max_bytes: Some(total - 64 * kib as u64 * 2 - 64 * kib as u64),
        };
        let r = gc(c, &policy, &BTreeSet::from([in_use.clone()]));
        assert_eq!(
            names(&r),
            [
                ("of-older".into(), "orphan"),
                ("older.sqfs".into(), "size"),
                ("oldest.sqfs".into(), "size"),
            ]
        );
        assert!(in_use.exists() && newest.exists() && initrd.exists());
        assert!(!oldest.exists());
        assert!(r.kept_bytes <= policy.max_bytes.unwrap_or(0), "{r:?}");
    }

    #[test]
    fn open_files_are_found() {
        let dir = tempfile::tempdir().expect("tmp");
        let c = dir.path();
        let image = entry(c, "rootfs/r.sqfs", 10, 0);
        let snap = snapshot(c, "s", &[], 0);
        let _held = fs::File::open(&image).expect("open");
        let _ram = fs::File::open(snap.join("ram")).expect("open");
        let open = open_entries(c);
        let c = fs::canonicalize(c).expect("canonical");
        assert!(open.contains(&c.join("rootfs/r.sqfs")), "{open:?}");
        assert!(open.contains(&c.join("snap/s")), "{open:?}");
    }
}
