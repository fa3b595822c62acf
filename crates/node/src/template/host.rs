//! The host mask layer of the built-in `host` template.
//!
//! The `host` template is the host's `/` read-only with a generated layer on top
//! (`lowerdir=<mask>:/`) that hides secrets and per-host state:
//!
//! - **opaque empty directories** (`trusted.overlay.opaque=y`) over [`HIDDEN_DIRS`] and the
//!   caller's extra paths (the data dir, the runtime dir), keeping the host directory's mode
//!   and owner — except `/tmp`, which is always present, empty and `1777 root:root`;
//! - **whiteouts** (character devices 0/0) over [`HIDDEN_FILES`] and `/etc/ssh/ssh_host_*`;
//! - **whiteouts over every other top-level entry**: only [`VISIBLE_TOP`] and the top-level
//!   [`HIDDEN_DIRS`] exist in the sandbox's `/`. A host's own top-level directories (a CI
//!   checkout under `/check`, `/data`, `/nix`, a container's `/old_root`…) are unknown to us
//!   and may hold anything, so they are default-deny, not default-allow.
//!
//! Only paths that exist on the host are masked: an opaque dir where the host has a
//! directory, a whiteout where it has anything else. A hidden path that is a symlink is left
//! alone when it points into another hidden directory (`/var/run -> /run`), and covered by an
//! empty opaque directory otherwise. Paths below a hidden directory, or below a host symlink,
//! are skipped. Parent directories in the mask copy the host's mode and owner, because
//! overlayfs shows the topmost layer's directory attributes.
//!
//! The mask is named by the sha256 of its description and built atomically under
//! `<data_dir>/host-mask/<id>/`, so rebuilding it is idempotent and a changed host yields a
//! new directory (old ones are left for running sandboxes).
//!
//! overlayfs refuses lower layers nested inside one another on one filesystem (`ELOOP`), and
//! every path is inside `/`. When the data dir is on the root filesystem
//! ([`shares_filesystem_with_root`]), the runtime copies the mask with [`stage_layer`] onto
//! the sandbox's tmpfs (where upper and work dirs live anyway) and uses that copy.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use serde::Serialize;
use sha2::{Digest as _, Sha256};

use super::unpack::{make_whiteout, set_opaque};
use super::TemplateError;

/// Host directories the `host` template shows as empty.
pub const HIDDEN_DIRS: &[&str] = &[
    "/root",
    "/home",
    "/tmp",
    "/var/tmp",
    "/run",
    "/var/run",
    "/mnt",
    "/media",
    "/srv",
    "/work",
    "/boot",
    "/lost+found",
    "/var/log",
    "/var/mail",
    "/var/spool",
    "/var/cache",
    "/var/lib/dsec",
];

/// Top-level host entries the `host` template shows (when they exist). Every other top-level
/// entry except the top-level [`HIDDEN_DIRS`] is whited out.
pub const VISIBLE_TOP: &[&str] = &[
    "bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc", "opt", "var", "dev", "proc",
    "sys",
];

/// Host files the `host` template hides (plus `/etc/ssh/ssh_host_*`).
pub const HIDDEN_FILES: &[&str] = &[
    "/etc/shadow",
    "/etc/gshadow",
    "/etc/shadow-",
    "/etc/gshadow-",
];

/// Bumped when the mask format changes, so old masks are not reused.
const MASK_FORMAT: u32 = 2;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
enum Kind {
    /// A plain directory mirroring the host's (a parent of something masked).
    Dir,
    /// An opaque, empty directory.
    Opaque,
    /// A whiteout.
    Whiteout,
}

#[derive(Debug, Clone, Serialize)]
struct MaskEntry {
    kind: Kind,
    mode: u32,
    uid: u32,
    gid: u32,
}

/// Builds (or reuses) the mask layer for the host root `/` under `data_dir` and returns its
/// directory. `extra_hidden` paths are canonicalized and hidden as opaque directories (or
/// whiteouts, if they are files); missing ones are ignored.
pub fn host_mask_layer(
    data_dir: &Path,
    extra_hidden: &[PathBuf],
) -> Result<PathBuf, TemplateError> {
    build_host_mask(Path::new("/"), data_dir, extra_hidden)
}

/// Whether `path` is on the same filesystem as `/` (then it cannot be a lowerdir next to `/`
/// and must be copied with [`stage_layer`]).
pub fn shares_filesystem_with_root(path: &Path) -> Result<bool, TemplateError> {
    let a = fs::metadata(path).map_err(|e| TemplateError::io("stat", path, e))?;
    let b = fs::metadata("/").map_err(|e| TemplateError::io("stat", "/", e))?;
    Ok(a.dev() == b.dev())
}

/// Relative form of an absolute host path (`/var/log` → `var/log`), lexically normalized.
fn rel(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::Normal(s) => out.push(s),
            Component::ParentDir => {
                out.pop();
            }
            _ => {}
        }
    }
    out
}

fn describe(host_root: &Path, extra_hidden: &[PathBuf]) -> BTreeMap<PathBuf, MaskEntry> {
    let stat = |r: &Path| fs::symlink_metadata(host_root.join(r)).ok();
    let mut hidden: Vec<PathBuf> = HIDDEN_DIRS.iter().map(|p| rel(Path::new(p))).collect();
    for p in extra_hidden {
        // The real location is what must be hidden; aliases resolve to it.
        if let Ok(c) = p.canonicalize() {
            if let Ok(r) = c.strip_prefix(host_root) {
                hidden.push(rel(r));
            }
        }
    }
    hidden.retain(|p| !p.as_os_str().is_empty());
    hidden.sort();
    hidden.dedup();

    // Default-deny at the top level: anything not known to be a system directory goes.
    let mut entries: BTreeMap<PathBuf, MaskEntry> = BTreeMap::new();
    let mut gone: Vec<PathBuf> = Vec::new();
    if let Ok(rd) = fs::read_dir(host_root) {
        for ent in rd.flatten() {
            let name = PathBuf::from(ent.file_name());
            let known = VISIBLE_TOP.iter().any(|v| name == Path::new(v))
                || HIDDEN_DIRS.iter().any(|h| rel(Path::new(h)) == name);
            if !known {
                entries.insert(
                    name.clone(),
                    MaskEntry {
                        kind: Kind::Whiteout,
                        mode: 0,
                        uid: 0,
                        gid: 0,
                    },
                );
                gone.push(name);
            }
        }
    }
    hidden.retain(|p| !gone.iter().any(|g| p.starts_with(g)));

    let mut opaque: Vec<PathBuf> = Vec::new();
    let covered = |opaque: &[PathBuf], p: &Path| opaque.iter().any(|o| p.starts_with(o));
    for r in &hidden {
        if covered(&opaque, r) {
            continue;
        }
        let entry = match stat(r) {
            _ if r == Path::new("tmp") => MaskEntry {
                kind: Kind::Opaque,
                mode: 0o1777,
                uid: 0,
                gid: 0,
            },
            Some(m) if m.file_type().is_symlink() => {
                let target = fs::read_link(host_root.join(r)).unwrap_or_default();
                let abs = if target.is_absolute() {
                    rel(&target)
                } else {
                    rel(&r.parent().unwrap_or(Path::new("")).join(&target))
                };
                if hidden.iter().any(|h| h != r && abs.starts_with(h)) {
                    continue;
                }
                MaskEntry {
                    kind: Kind::Opaque,
                    mode: 0o755,
                    uid: 0,
                    gid: 0,
                }
            }
            // Readable and searchable by everyone (it is empty): an overlay mounted inside a
            // user namespace reads its opaque marker with the mounter's unprivileged credentials.
            Some(m) if m.is_dir() => MaskEntry {
                kind: Kind::Opaque,
                mode: (m.mode() & 0o7777) | 0o555,
                uid: m.uid(),
                gid: m.gid(),
            },
            Some(_) => MaskEntry {
                kind: Kind::Whiteout,
                mode: 0,
                uid: 0,
                gid: 0,
            },
            None => continue,
        };
        if entry.kind == Kind::Opaque {
            opaque.push(r.clone());
        }
        entries.insert(r.clone(), entry);
    }

    let mut files: Vec<PathBuf> = HIDDEN_FILES.iter().map(|p| rel(Path::new(p))).collect();
    if let Ok(rd) = fs::read_dir(host_root.join("etc/ssh")) {
        for ent in rd.flatten() {
            if ent.file_name().to_string_lossy().starts_with("ssh_host_") {
                files.push(Path::new("etc/ssh").join(ent.file_name()));
            }
        }
    }
    for r in files {
        if covered(&opaque, &r) {
            continue;
        }
        if let Some(m) = stat(&r) {
            if !m.is_dir() {
                entries.insert(
                    r,
                    MaskEntry {
                        kind: Kind::Whiteout,
                        mode: 0,
                        uid: 0,
                        gid: 0,
                    },
                );
            }
        }
    }

    // Parents mirror the host; an entry whose parent is not a real host directory is dropped
    // (a mask directory would replace the host's symlink).
    let mut parents: BTreeMap<PathBuf, MaskEntry> = BTreeMap::new();
    entries.retain(|r, _| {
        let mut ok = true;
        for anc in r.ancestors().skip(1) {
            if anc.as_os_str().is_empty() || parents.contains_key(anc) {
                continue;
            }
            match stat(anc) {
                Some(m) if m.is_dir() && !m.file_type().is_symlink() => {
                    parents.insert(
                        anc.to_path_buf(),
                        MaskEntry {
                            kind: Kind::Dir,
                            mode: m.mode() & 0o7777,
                            uid: m.uid(),
                            gid: m.gid(),
                        },
                    );
                }
                _ => ok = false,
            }
        }
        ok
    });
    entries.extend(parents);
    entries
}

/// Builds the mask of `host_root` (`/` except in tests) under `data_dir/host-mask/`.
pub(crate) fn build_host_mask(
    host_root: &Path,
    data_dir: &Path,
    extra_hidden: &[PathBuf],
) -> Result<PathBuf, TemplateError> {
    let entries = describe(host_root, extra_hidden);
    let root_meta = fs::metadata(host_root).map_err(|e| TemplateError::io("stat", host_root, e))?;
    let root_entry = MaskEntry {
        kind: Kind::Dir,
        mode: root_meta.mode() & 0o7777,
        uid: root_meta.uid(),
        gid: root_meta.gid(),
    };
    let spec = serde_json::to_vec(&(MASK_FORMAT, &root_entry, &entries))
        .map_err(|e| TemplateError::io("describe host mask", data_dir, io::Error::other(e)))?;
    let id = hex::encode(Sha256::digest(&spec));
    let masks = data_dir.join("host-mask");
    let final_dir = masks.join(&id);
    if final_dir.is_dir() {
        return Ok(final_dir);
    }
    fs::create_dir_all(&masks).map_err(|e| TemplateError::io("create dir", &masks, e))?;
    let tmp = tempfile::Builder::new()
        .prefix(".tmp-")
        .tempdir_in(&masks)
        .map_err(|e| TemplateError::io("create temp dir", &masks, e))?;
    let root = tmp.path().join("m");
    let chown = rustix::process::geteuid().is_root();
    make_dir(&root, &root_entry, chown)?;
    for (r, e) in &entries {
        let p = root.join(r);
        match e.kind {
            Kind::Dir | Kind::Opaque => make_dir(&p, e, chown)?,
            Kind::Whiteout => make_whiteout(&p)?,
        }
    }
    match fs::rename(&root, &final_dir) {
        Ok(()) => Ok(final_dir),
        Err(_) if final_dir.is_dir() => Ok(final_dir),
        Err(e) => Err(TemplateError::io("rename host mask", &final_dir, e)),
    }
}

fn make_dir(p: &Path, e: &MaskEntry, chown: bool) -> Result<(), TemplateError> {
    fs::DirBuilder::new()
        .mode(0o700)
        .create(p)
        .map_err(|err| TemplateError::io("create dir", p, err))?;
    if chown {
        std::os::unix::fs::lchown(p, Some(e.uid), Some(e.gid))
            .map_err(|err| TemplateError::io("chown", p, err))?;
    }
    fs::set_permissions(p, fs::Permissions::from_mode(e.mode))
        .map_err(|err| TemplateError::io("chmod", p, err))?;
    if e.kind == Kind::Opaque {
        set_opaque(p)?;
    }
    Ok(())
}

/// Copies a layer tree with its whiteouts and opaque markers (see [`dsec_sys::layer`]).
pub use dsec_sys::layer::stage_layer;

#[cfg(test)]
mod tests {
    use super::*;
    use dsec_sys::layer::OPAQUE_XATTR;
    use std::os::unix::fs::FileTypeExt;

    #[test]
    fn mask_of_fake_root() -> anyhow::Result<()> {
        let host = tempfile::tempdir()?;
        let h = host.path();
        for d in [
            "root/.ssh",
            "home/u",
            "var/log",
            "etc/ssh",
            "usr/bin",
            "data/dsec",
            "check/work/main",
            "opt/dsec-data/x",
        ] {
            fs::create_dir_all(h.join(d))?;
        }
        fs::set_permissions(h.join("root"), fs::Permissions::from_mode(0o700))?;
        std::os::unix::fs::symlink("/run", h.join("var/run"))?;
        std::os::unix::fs::symlink("/elsewhere", h.join("media"))?;
        fs::write(h.join("etc/shadow"), b"x")?;
        fs::write(h.join("container_info.json"), b"{}")?;
        std::os::unix::fs::symlink("usr/bin", h.join("bin"))?;
        std::os::unix::fs::symlink("check/work", h.join("w"))?;
        fs::write(h.join("etc/ssh/ssh_host_ed25519_key"), b"x")?;
        fs::write(h.join("etc/ssh/sshd_config"), b"x")?;
        let data = tempfile::tempdir()?;
        let extra = vec![h.join("data/dsec"), h.join("opt/./dsec-data")];
        let m = build_host_mask(h, data.path(), &extra)?;
        assert_eq!(build_host_mask(h, data.path(), &extra)?, m, "idempotent");

        let meta = |p: &str| fs::symlink_metadata(m.join(p));
        assert_eq!(meta("root")?.mode() & 0o7777, 0o755);
        assert_eq!(fs::read_dir(m.join("root"))?.count(), 0);
        assert_eq!(meta("tmp")?.mode() & 0o7777, 0o1777);
        assert!(meta("home")?.is_dir());
        assert!(meta("var/log")?.is_dir());
        assert!(
            meta("var/run").is_err(),
            "symlink into a hidden dir is left alone"
        );
        assert!(meta("media")?.is_dir(), "symlink elsewhere is covered");
        assert!(meta("etc/shadow")?.file_type().is_char_device());
        assert!(meta("etc/ssh/ssh_host_ed25519_key")?
            .file_type()
            .is_char_device());
        assert!(meta("etc/ssh/sshd_config").is_err());
        assert!(
            meta("etc/gshadow").is_err(),
            "only existing files are masked"
        );
        assert!(meta("usr").is_err());
        assert!(meta("srv").is_err(), "only existing dirs are masked");
        // Unknown top-level entries are whited out whole, with nothing below them (the extra
        // path `data/dsec` lies inside one).
        for gone in ["data", "check", "container_info.json", "w"] {
            assert!(
                meta(gone)?.file_type().is_char_device(),
                "{gone} is whited out"
            );
        }
        assert!(meta("bin").is_err(), "a known top-level symlink stays");
        // An extra path is canonicalized, i.e. relative to the real `/`.
        assert!(meta("opt/dsec-data")?.is_dir());
        assert_eq!(fs::read_dir(m.join("opt/dsec-data"))?.count(), 0);

        let staged = tempfile::tempdir()?;
        let copy = staged.path().join("mask");
        stage_layer(&m, &copy)?;
        assert!(fs::symlink_metadata(copy.join("etc/shadow"))?
            .file_type()
            .is_char_device());
        assert_eq!(
            fs::symlink_metadata(copy.join("tmp"))?.mode() & 0o7777,
            0o1777
        );
        let mut buf = [0u8; 4];
        let n = rustix::fs::lgetxattr(copy.join("root"), OPAQUE_XATTR, &mut buf[..])?;
        assert_eq!(&buf[..n], b"y");
        Ok(())
    }
}
