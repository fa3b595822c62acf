//! [`CgroupManager`]: dsec's base cgroup under every hierarchy, the sandboxes' cgroups below it,
//! and the `favordynmods` mount that makes attaching cheap.

use std::collections::BTreeSet;
use std::ffi::CString;
use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use super::group::{read_file, read_oom_kills, rmdir_all, write_file, Cgroup};
use super::{
    parse_controllers, parse_mountinfo, validate_name, CgroupError, CgroupLayout, CgroupLimits,
    CgroupVersion, MountInfo, V2_CONTROLLERS,
};

/// Where [`CgroupManager::favor_dynmods`] mounts its named v1 hierarchy.
pub const FAVORDYNMODS_DIR: &str = "/run/dsec/cgroup-favordynmods";

/// Name of the controller-less v1 hierarchy that carries the `favordynmods` flag.
const FAVORDYNMODS_NAME: &str = "dsec";

/// Creates, finds and lists dsec's cgroups under one base name.
#[derive(Debug)]
pub struct CgroupManager {
    layout: CgroupLayout,
    base: String,
    favordynmods_dir: PathBuf,
    /// Set once the base directories exist (and, on v2, delegate the controllers).
    base_ready: AtomicBool,
}

impl CgroupManager {
    /// Detects the host's layout from `/proc/self/mountinfo`.
    pub fn detect(base_name: &str) -> Result<Self, CgroupError> {
        let mounts = read_mountinfo()?;
        let layout = CgroupLayout::from_mounts(&mounts, |root| {
            fs::read_to_string(root.join("cgroup.controllers")).ok()
        })?;
        Self::with_layout(layout, base_name)
    }

    /// A manager over explicit mount points (tests use a fake root in a temporary directory).
    pub fn with_layout(layout: CgroupLayout, base_name: &str) -> Result<Self, CgroupError> {
        validate_name(base_name)?;
        Ok(Self {
            layout,
            base: base_name.to_owned(),
            favordynmods_dir: PathBuf::from(FAVORDYNMODS_DIR),
            base_ready: AtomicBool::new(false),
        })
    }

    /// Overrides where [`favor_dynmods`](Self::favor_dynmods) mounts on v1.
    pub fn with_favordynmods_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.favordynmods_dir = dir.into();
        self
    }

    /// The cgroup version in use.
    pub fn version(&self) -> CgroupVersion {
        self.layout.version()
    }

    /// The detected or given layout.
    pub fn layout(&self) -> &CgroupLayout {
        &self.layout
    }

    /// The base directory in every hierarchy, deduplicated.
    pub fn base_dirs(&self) -> Vec<PathBuf> {
        self.dirs_for(None).all()
    }

    fn dirs_for(&self, name: Option<&str>) -> CgroupLayout {
        let dir = |root: &Path| {
            let base = root.join(&self.base);
            match name {
                Some(n) => base.join(n),
                None => base,
            }
        };
        match &self.layout {
            CgroupLayout::V1 {
                cpu,
                cpuacct,
                memory,
                pids,
                devices,
            } => CgroupLayout::V1 {
                cpu: dir(cpu),
                cpuacct: cpuacct.as_deref().map(dir),
                memory: dir(memory),
                pids: dir(pids),
                devices: devices.as_deref().map(dir),
            },
            CgroupLayout::V2 { root } => CgroupLayout::V2 { root: dir(root) },
        }
    }

    /// Creates the base directories and, on v2, delegates the controllers to them.
    fn ensure_base(&self) -> Result<(), CgroupError> {
        if self.base_ready.load(Ordering::Acquire) {
            return Ok(());
        }
        for dir in self.base_dirs() {
            match fs::create_dir(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(source) => return Err(CgroupError::Create { path: dir, source }),
            }
        }
        if let CgroupLayout::V2 { root } = &self.layout {
            let available = parse_controllers(&read_file(&root.join("cgroup.controllers"))?);
            let wanted: Vec<&str> = V2_CONTROLLERS
                .into_iter()
                .filter(|c| available.iter().any(|a| a == c))
                .collect();
            enable_controllers(root, &wanted)?;
            enable_controllers(&root.join(&self.base), &wanted)?;
        }
        self.base_ready.store(true, Ordering::Release);
        Ok(())
    }

    /// Creates cgroup `name` with `limits`. Fails with [`CgroupError::Create`] (`AlreadyExists`)
    /// if it exists; on any failure the directories created so far are removed again.
    pub fn create(&self, name: &str, limits: &CgroupLimits) -> Result<Cgroup, CgroupError> {
        validate_name(name)?;
        limits.validate()?;
        self.ensure_base()?;
        let dirs = self.dirs_for(Some(name));
        let mut created = Vec::new();
        for dir in dirs.all() {
            if let Err(source) = fs::create_dir(&dir) {
                rmdir_all(&created);
                return Err(CgroupError::Create { path: dir, source });
            }
            created.push(dir);
        }
        let mut cgroup = Cgroup {
            name: name.to_owned(),
            dirs,
            swap: None,
        };
        match cgroup.set_limits(limits) {
            Ok(swap) => {
                cgroup.swap = Some(swap);
                Ok(cgroup)
            }
            Err(e) => {
                rmdir_all(&created);
                Err(e)
            }
        }
    }

    /// Opens an existing cgroup (recovery after a restart). `Some` if its directory exists in
    /// at least one hierarchy, so half-created cgroups can still be killed and removed.
    pub fn open(&self, name: &str) -> Option<Cgroup> {
        validate_name(name).ok()?;
        let dirs = self.dirs_for(Some(name));
        if !dirs.all().iter().any(|d| d.is_dir()) {
            return None;
        }
        Some(Cgroup {
            name: name.to_owned(),
            dirs,
            swap: None,
        })
    }

    /// CPU time used by every cgroup under the base together, in nanoseconds; `None` when it is
    /// not accounted or the base does not exist yet. One file read.
    pub fn base_cpu_usage_ns(&self) -> Option<u64> {
        Cgroup {
            name: String::new(),
            dirs: self.dirs_for(None),
            swap: None,
        }
        .cpu_usage_ns()
    }

    /// The number of OOM kills a cgroup has recorded: one read of one file (v1
    /// `memory.oom_control`, v2 `memory.events`), where [`Cgroup::stats`] reads five. Called
    /// after every command, so it neither checks the other hierarchies nor keeps a file open
    /// (an open seq_file holds a page of node memory per sandbox).
    pub fn oom_kills(&self, name: &str) -> Result<u64, CgroupError> {
        validate_name(name)?;
        read_oom_kills(&self.dirs_for(Some(name)))
    }

    /// Renames a cgroup (every hierarchy's directory), keeping its members and limits. Used to
    /// give a pre-created cgroup its sandbox's name.
    pub fn rename(&self, cgroup: Cgroup, new_name: &str) -> Result<Cgroup, CgroupError> {
        validate_name(new_name)?;
        let to = self.dirs_for(Some(new_name));
        for (from, to) in cgroup.dirs.all().iter().zip(to.all()) {
            std::fs::rename(from, &to).map_err(|source| CgroupError::Rename {
                path: from.clone(),
                source,
            })?;
        }
        Ok(Cgroup {
            name: new_name.to_owned(),
            dirs: to,
            swap: cgroup.swap,
        })
    }

    /// Names of all cgroups under the base, in any hierarchy, sorted (orphan sweeps, leak
    /// counting). Empty when the base does not exist yet.
    pub fn list(&self) -> Result<Vec<String>, CgroupError> {
        let mut names = BTreeSet::new();
        for base in self.base_dirs() {
            let entries = match fs::read_dir(&base) {
                Ok(entries) => entries,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(source) => return Err(CgroupError::Read { file: base, source }),
            };
            for entry in entries {
                let entry = entry.map_err(|source| CgroupError::Read {
                    file: base.clone(),
                    source,
                })?;
                let is_dir = entry.file_type().map(|t| t.is_dir()).unwrap_or(false);
                if let (true, Some(name)) = (is_dir, entry.file_name().to_str()) {
                    names.insert(name.to_owned());
                }
            }
        }
        Ok(names.into_iter().collect())
    }

    /// Makes cgroup attaches skip the RCU grace period of the global
    /// `cgroup_threadgroup_rwsem` by turning on the kernel's `favordynmods` mode.
    ///
    /// - v1: mounts a controller-less hierarchy `none,name=dsec,favordynmods` at
    ///   [`FAVORDYNMODS_DIR`] (or the directory given to
    ///   [`with_favordynmods_dir`](Self::with_favordynmods_dir)).
    /// - v2: remounts the unified root with its current options plus `favordynmods`.
    ///
    /// Returns `true` if this call turned the mode on, `false` if it was already on. On kernels
    /// with the per-threadgroup rwsem (6.18+) the switch is one-way until reboot: unmounting
    /// or remounting without the flag does not bring the global write lock back for
    /// `cgroup.procs` writes.
    pub fn favor_dynmods(&self) -> Result<bool, CgroupError> {
        let mounts = read_mountinfo()?;
        match &self.layout {
            CgroupLayout::V1 { .. } => {
                let dir = &self.favordynmods_dir;
                if is_favordynmods_mount(&mounts, dir, "cgroup") {
                    return Ok(false);
                }
                fs::create_dir_all(dir).map_err(|source| CgroupError::Create {
                    path: dir.clone(),
                    source,
                })?;
                let options = format!("none,name={FAVORDYNMODS_NAME},favordynmods");
                mount(
                    "cgroup",
                    dir,
                    "cgroup",
                    libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                    &options,
                )?;
                if !is_favordynmods_mount(&read_mountinfo()?, dir, "cgroup") {
                    return Err(CgroupError::FavorDynmodsIgnored { path: dir.clone() });
                }
                Ok(true)
            }
            CgroupLayout::V2 { root } => {
                if is_favordynmods_mount(&mounts, root, "cgroup2") {
                    return Ok(false);
                }
                let Some(current) = mounts
                    .iter()
                    .rev()
                    .find(|m| m.mount_point == *root && m.fs_type == "cgroup2")
                else {
                    return Err(CgroupError::Detect {
                        reason: format!("{} is not a cgroup2 mount point", root.display()),
                    });
                };
                let (flags, options) = remount_args(current, &["favordynmods"]);
                mount("cgroup2", root, "cgroup2", flags, &options)?;
                if !is_favordynmods_mount(&read_mountinfo()?, root, "cgroup2") {
                    return Err(CgroupError::FavorDynmodsIgnored { path: root.clone() });
                }
                Ok(true)
            }
        }
    }
}

/// Arguments to remount `current` in place with `extra` superblock options added: the
/// per-mount flags are carried over (`MS_REMOUNT` resets those not passed) and so are the
/// superblock options (cgroup2 reconfigure clears every flag not passed, e.g. `nsdelegate`).
pub fn remount_args(current: &MountInfo, extra: &[&str]) -> (libc::c_ulong, String) {
    let mut flags = libc::MS_REMOUNT;
    for opt in &current.mount_options {
        flags |= match opt.as_str() {
            "ro" => libc::MS_RDONLY,
            "nosuid" => libc::MS_NOSUID,
            "nodev" => libc::MS_NODEV,
            "noexec" => libc::MS_NOEXEC,
            "noatime" => libc::MS_NOATIME,
            "nodiratime" => libc::MS_NODIRATIME,
            "relatime" => libc::MS_RELATIME,
            "strictatime" => libc::MS_STRICTATIME,
            _ => 0,
        };
    }
    let mut options: Vec<&str> = current
        .super_options
        .iter()
        .map(String::as_str)
        .filter(|o| *o != "rw" && *o != "ro")
        .collect();
    for e in extra {
        if !options.contains(e) {
            options.push(e);
        }
    }
    (flags, options.join(","))
}

fn is_favordynmods_mount(mounts: &[MountInfo], dir: &Path, fs_type: &str) -> bool {
    // The last entry for a mount point is the one on top (visible).
    mounts
        .iter()
        .rev()
        .find(|m| m.mount_point == dir)
        .is_some_and(|m| m.fs_type == fs_type && m.has_super_option("favordynmods"))
}

pub(super) fn read_mountinfo() -> Result<Vec<MountInfo>, CgroupError> {
    let text = fs::read_to_string("/proc/self/mountinfo").map_err(CgroupError::Mountinfo)?;
    Ok(parse_mountinfo(&text))
}

fn mount(
    source: &str,
    target: &Path,
    fs_type: &'static str,
    flags: libc::c_ulong,
    options: &str,
) -> Result<(), CgroupError> {
    let err = |source| CgroupError::Mount {
        path: target.to_owned(),
        fs_type,
        options: options.to_owned(),
        source,
    };
    let to_c =
        |s: &[u8]| CString::new(s).map_err(|_| err(io::Error::from(io::ErrorKind::InvalidInput)));
    let c_source = to_c(source.as_bytes())?;
    let c_target = to_c(target.as_os_str().as_bytes())?;
    let c_fs = to_c(fs_type.as_bytes())?;
    let c_options = to_c(options.as_bytes())?;
    // SAFETY: all four pointers come from live `CString`s (NUL-terminated, outliving the call);
    // mount(2) only reads them, and `data` is a NUL-terminated option string as the cgroup file
    // systems expect.
    let ret = unsafe {
        libc::mount(
            c_source.as_ptr(),
            c_target.as_ptr(),
            c_fs.as_ptr(),
            flags,
            c_options.as_ptr().cast(),
        )
    };
    if ret != 0 {
        return Err(err(io::Error::last_os_error()));
    }
    Ok(())
}

/// Enables `wanted` controllers in `dir/cgroup.subtree_control` if any is missing.
fn enable_controllers(dir: &Path, wanted: &[&str]) -> Result<(), CgroupError> {
    if wanted.is_empty() {
        return Ok(());
    }
    let file = dir.join("cgroup.subtree_control");
    let enabled = parse_controllers(&read_file(&file)?);
    let missing: Vec<String> = wanted
        .iter()
        .filter(|c| !enabled.iter().any(|e| e == *c))
        .map(|c| format!("+{c}"))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    write_file(&file, &missing.join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remount_keeps_flags_and_options() {
        let m = &parse_mountinfo(
            "30 1 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot\n",
        )[0];
        let (flags, opts) = remount_args(m, &["favordynmods"]);
        assert_eq!(
            flags,
            libc::MS_REMOUNT
                | libc::MS_NOSUID
                | libc::MS_NODEV
                | libc::MS_NOEXEC
                | libc::MS_RELATIME
        );
        assert_eq!(opts, "nsdelegate,memory_recursiveprot,favordynmods");
        let (_, again) = remount_args(m, &["nsdelegate"]);
        assert_eq!(again, "nsdelegate,memory_recursiveprot");
    }
}
