//! cgroup v1 and v2 management for sandboxes.
//!
//! A [`CgroupManager`] owns one base directory (e.g. `dsec`) under every hierarchy dsec uses and
//! creates one [`Cgroup`] per sandbox below it:
//!
//! - **v2** (production): one directory `<root>/<base>/<name>` in the unified hierarchy. The
//!   manager enables `cpu`, `memory` and `pids` in the `cgroup.subtree_control` of the root and of
//!   the base cgroup (only controllers the root offers).
//! - **v1**: one directory per hierarchy: `cpu`, `memory`, `pids`, plus `cpuacct` when it is
//!   mounted (co-mounted `cpu,cpuacct` counts once). A pid is attached by writing it into every
//!   hierarchy's `cgroup.procs` ([`Cgroup::procs_paths`]).
//!
//! Limits ([`CgroupLimits`]) use v2 semantics and are translated for v1 (`cpu.weight` →
//! `cpu.shares`, `memory.high` → `memory.soft_limit_in_bytes`, …). Swap is always capped at zero
//! when a memory limit is set: `memory.swap.max = 0` (v2) or `memory.memsw.limit_in_bytes =
//! memory.limit_in_bytes` (v1); a kernel without swap accounting is reported as
//! [`SwapLimit::NotAccounted`], not as an error.
//!
//! Attaching a pid to a cgroup write-locks the kernel's global `cgroup_threadgroup_rwsem`, which
//! costs an RCU grace period (≈10 ms) unless some hierarchy is mounted with `favordynmods`; see
//! [`CgroupManager::favor_dynmods`].
//!
//! All file IO is plain `std::fs`; the only `unsafe` is the pidfd and mount system calls.

mod parse;

pub use parse::{
    flat_keyed, parse_controllers, parse_cpu_stat, parse_memory_events, parse_mountinfo,
    parse_oom_control, parse_procs, parse_single_value, CpuStat, MemoryEvents, MountInfo,
    OomControl,
};

use std::collections::BTreeSet;
use std::ffi::CString;
use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

/// Where [`CgroupManager::favor_dynmods`] mounts its named v1 hierarchy.
pub const FAVORDYNMODS_DIR: &str = "/run/dsec/cgroup-favordynmods";

/// Name of the controller-less v1 hierarchy that carries the `favordynmods` flag.
const FAVORDYNMODS_NAME: &str = "dsec";

/// The v2 controllers dsec enables for its cgroups.
const V2_CONTROLLERS: [&str; 3] = ["cpu", "memory", "pids"];

/// How long [`Cgroup::remove`] retries `rmdir` on `EBUSY`.
const REMOVE_TIMEOUT: Duration = Duration::from_secs(2);

/// How long [`Cgroup::kill_all`] waits for the cgroup to become empty.
const KILL_TIMEOUT: Duration = Duration::from_secs(5);

/// Errors of cgroup operations. Each variant names the operation and the file or directory.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// `/proc/self/mountinfo` could not be read.
    #[error("reading /proc/self/mountinfo")]
    Mountinfo(#[source] io::Error),
    /// No usable cgroup layout was found.
    #[error("no usable cgroup hierarchy: {reason}")]
    Detect {
        /// What was missing.
        reason: String,
    },
    /// A cgroup or base name is not `[A-Za-z0-9._-]+` (or is `.`/`..`).
    #[error("invalid cgroup name {name:?}")]
    InvalidName {
        /// The rejected name.
        name: String,
    },
    /// A limit is outside the range the kernel accepts.
    #[error("invalid cgroup limit {what} = {value}")]
    InvalidLimit {
        /// Which limit.
        what: &'static str,
        /// The rejected value.
        value: u64,
    },
    /// Renaming a cgroup directory failed.
    #[error("renaming cgroup directory {}", path.display())]
    Rename {
        /// The directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// `mkdir` of a cgroup directory failed.
    #[error("creating cgroup directory {}", path.display())]
    Create {
        /// The directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// Writing a cgroup interface file failed.
    #[error("writing {value:?} to {}", file.display())]
    Write {
        /// The file.
        file: PathBuf,
        /// What was written.
        value: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// Writing a pid into `cgroup.procs` failed.
    #[error("attaching pid {pid} to {}", path.display())]
    Attach {
        /// The pid.
        pid: i32,
        /// The `cgroup.procs` file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// Reading a cgroup interface file failed.
    #[error("reading {}", file.display())]
    Read {
        /// The file.
        file: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// A cgroup interface file had unexpected content.
    #[error("parsing {}: {what}", file.display())]
    Parse {
        /// The file.
        file: PathBuf,
        /// What was expected.
        what: &'static str,
    },
    /// Sending `SIGKILL` to a member process failed.
    #[error("killing pid {pid} of {}", path.display())]
    Kill {
        /// The pid.
        pid: i32,
        /// The cgroup directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// Processes were still alive after [`Cgroup::kill_all`] gave up.
    #[error("{remaining} processes still in {} after {waited:?}", path.display())]
    KillTimeout {
        /// The cgroup directory.
        path: PathBuf,
        /// How many pids were left.
        remaining: usize,
        /// How long kill_all tried.
        waited: Duration,
    },
    /// `rmdir` of a cgroup directory failed.
    #[error("removing cgroup directory {}", path.display())]
    Remove {
        /// The directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// Mounting (or remounting) a cgroup file system failed.
    #[error("mounting {fs_type} at {} with {options:?}", path.display())]
    Mount {
        /// The mount point.
        path: PathBuf,
        /// `cgroup` or `cgroup2`.
        fs_type: &'static str,
        /// The file-system options passed.
        options: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The mount succeeded but the kernel did not apply `favordynmods` (e.g. a `name=dsec`
    /// hierarchy already existed without it).
    #[error("favordynmods not in effect on {} after mounting", path.display())]
    FavorDynmodsIgnored {
        /// The mount point.
        path: PathBuf,
    },
}

/// cgroup API version of a layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupVersion {
    /// Legacy: one hierarchy per controller (or group of controllers).
    V1,
    /// Unified hierarchy.
    V2,
}

/// Mount points of the hierarchies a [`CgroupManager`] uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CgroupLayout {
    /// cgroup v1: one mount point per controller. Paths may coincide (`cpu,cpuacct`).
    V1 {
        /// Hierarchy with the `cpu` controller.
        cpu: PathBuf,
        /// Hierarchy with the `cpuacct` controller, if mounted.
        cpuacct: Option<PathBuf>,
        /// Hierarchy with the `memory` controller.
        memory: PathBuf,
        /// Hierarchy with the `pids` controller.
        pids: PathBuf,
    },
    /// cgroup v2: the unified mount point.
    V2 {
        /// Mount point, normally `/sys/fs/cgroup`.
        root: PathBuf,
    },
}

impl CgroupLayout {
    /// The version of this layout.
    pub fn version(&self) -> CgroupVersion {
        match self {
            CgroupLayout::V1 { .. } => CgroupVersion::V1,
            CgroupLayout::V2 { .. } => CgroupVersion::V2,
        }
    }

    /// Picks the layout from parsed mountinfo. `v2_controllers` returns the text of
    /// `cgroup.controllers` under a cgroup2 mount point (`None` if unreadable).
    ///
    /// v2 wins when a cgroup2 mount (preferring `/sys/fs/cgroup`) offers `cpu`, `memory` and
    /// `pids`; otherwise v1 needs the `cpu`, `memory` and `pids` hierarchies (`cpuacct` optional).
    pub fn from_mounts(
        mounts: &[MountInfo],
        v2_controllers: impl Fn(&Path) -> Option<String>,
    ) -> Result<Self, CgroupError> {
        let mut v2: Vec<&MountInfo> = mounts.iter().filter(|m| m.fs_type == "cgroup2").collect();
        v2.sort_by_key(|m| m.mount_point != Path::new("/sys/fs/cgroup"));
        for mount in v2 {
            let Some(text) = v2_controllers(&mount.mount_point) else {
                continue;
            };
            let available = parse_controllers(&text);
            if V2_CONTROLLERS
                .iter()
                .all(|c| available.iter().any(|a| a == c))
            {
                return Ok(CgroupLayout::V2 {
                    root: mount.mount_point.clone(),
                });
            }
        }
        let v1 = |controller: &str| {
            mounts
                .iter()
                .find(|m| m.fs_type == "cgroup" && m.has_super_option(controller))
                .map(|m| m.mount_point.clone())
        };
        match (v1("cpu"), v1("memory"), v1("pids")) {
            (Some(cpu), Some(memory), Some(pids)) => Ok(CgroupLayout::V1 {
                cpu,
                cpuacct: v1("cpuacct"),
                memory,
                pids,
            }),
            (cpu, memory, pids) => {
                let missing: Vec<&str> = [("cpu", cpu), ("memory", memory), ("pids", pids)]
                    .into_iter()
                    .filter(|(_, path)| path.is_none())
                    .map(|(name, _)| name)
                    .collect();
                Err(CgroupError::Detect {
                    reason: format!(
                        "no cgroup2 mount offers cpu, memory and pids; missing v1 hierarchies: {}",
                        missing.join(", ")
                    ),
                })
            }
        }
    }
}

/// Resource limits of one cgroup, in cgroup v2 terms. `None` leaves the kernel's value alone
/// (unlimited / default for a fresh cgroup).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CgroupLimits {
    /// `cpu.weight`, 1..=10000 (default 100). v1: `cpu.shares = weight * 1024 / 100`.
    pub cpu_weight: Option<u64>,
    /// Hard CPU cap `(quota_us, period_us)`: `cpu.max` (v2) or `cpu.cfs_quota_us` +
    /// `cpu.cfs_period_us` (v1). Quota >= 1000, period 1000..=1_000_000.
    pub cpu_max: Option<(u64, u64)>,
    /// `memory.high` in bytes (v1: `memory.soft_limit_in_bytes`).
    pub memory_high: Option<u64>,
    /// `memory.max` in bytes (v1: `memory.limit_in_bytes`); swap is capped at zero with it.
    pub memory_max: Option<u64>,
    /// `pids.max`.
    pub pids_max: Option<u64>,
}

impl CgroupLimits {
    /// Checks the ranges the kernel accepts, so a bad request fails before any write.
    pub fn validate(&self) -> Result<(), CgroupError> {
        let invalid = |what, value| Err(CgroupError::InvalidLimit { what, value });
        if let Some(w) = self.cpu_weight {
            if !(1..=10_000).contains(&w) {
                return invalid("cpu_weight", w);
            }
        }
        if let Some((quota, period)) = self.cpu_max {
            if quota < 1000 {
                return invalid("cpu_max.quota_us", quota);
            }
            if !(1000..=1_000_000).contains(&period) {
                return invalid("cpu_max.period_us", period);
            }
        }
        if let Some(p) = self.pids_max {
            if p == 0 || p > i32::MAX as u64 {
                return invalid("pids_max", p);
            }
        }
        for (what, value) in [
            ("memory_high", self.memory_high),
            ("memory_max", self.memory_max),
        ] {
            if let Some(v) = value {
                if v == 0 || v > i64::MAX as u64 {
                    return invalid(what, v);
                }
            }
        }
        Ok(())
    }
}

/// v1 `cpu.shares` for a v2 `cpu.weight` (default 100 ↔ 1024; kernel minimum 2).
pub fn weight_to_shares(weight: u64) -> u64 {
    (weight * 1024 / 100).max(2)
}

/// What happened to swap when limits were applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SwapLimit {
    /// Swap is capped at zero (`memory.swap.max = 0` / `memsw = limit`).
    Disabled,
    /// The kernel has no swap accounting (the swap file does not exist); swap is not capped by
    /// the cgroup. Harmless on hosts without swap.
    NotAccounted,
    /// No memory limit was requested, so swap was left alone.
    Untouched,
}

/// Resource usage of one cgroup.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CgroupStats {
    /// Current memory usage in bytes (`memory.current` / `memory.usage_in_bytes`).
    pub memory_current: u64,
    /// Peak memory usage in bytes (`memory.peak`, kernel >= 5.19 / `memory.max_usage_in_bytes`).
    pub memory_peak: Option<u64>,
    /// OOM kills in this cgroup (`memory.events` / `memory.oom_control`).
    pub oom_kills: u64,
    /// CPU time in nanoseconds (v2 `cpu.stat` `usage_usec`; v1 `cpuacct.usage`, `None` when
    /// cpuacct is not mounted).
    pub cpu_usage_ns: Option<u64>,
    /// Current number of tasks (`pids.current`).
    pub pids_current: u64,
}

/// Checks a cgroup or base name: `[A-Za-z0-9._-]+`, not `.` or `..`.
pub fn validate_name(name: &str) -> Result<(), CgroupError> {
    let ok = !name.is_empty()
        && name != "."
        && name != ".."
        && name.len() <= 255
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(CgroupError::InvalidName {
            name: name.to_owned(),
        })
    }
}

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
            } => CgroupLayout::V1 {
                cpu: dir(cpu),
                cpuacct: cpuacct.as_deref().map(dir),
                memory: dir(memory),
                pids: dir(pids),
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

fn read_mountinfo() -> Result<Vec<MountInfo>, CgroupError> {
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

/// A cgroup's own directories have the shape of the layout: one per hierarchy.
impl CgroupLayout {
    /// Every distinct directory (co-mounted hierarchies share one).
    fn all(&self) -> Vec<PathBuf> {
        match self {
            CgroupLayout::V1 {
                cpu,
                cpuacct,
                memory,
                pids,
            } => {
                let mut out: Vec<PathBuf> = Vec::with_capacity(4);
                for dir in [Some(memory), Some(pids), Some(cpu), cpuacct.as_ref()]
                    .into_iter()
                    .flatten()
                {
                    if !out.contains(dir) {
                        out.push(dir.clone());
                    }
                }
                out
            }
            CgroupLayout::V2 { root: dir } => vec![dir.clone()],
        }
    }

    /// The directory whose `cgroup.procs` is authoritative for membership.
    fn primary(&self) -> &Path {
        match self {
            CgroupLayout::V1 { pids, .. } => pids,
            CgroupLayout::V2 { root: dir } => dir,
        }
    }
}

/// One sandbox's cgroup. Dropping it leaves the kernel objects in place; call
/// [`remove`](Self::remove).
#[derive(Debug)]
pub struct Cgroup {
    name: String,
    /// The cgroup's directory in each hierarchy.
    dirs: CgroupLayout,
    swap: Option<SwapLimit>,
}

impl Cgroup {
    /// The cgroup's name (its directory name under the base).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The cgroup version.
    pub fn version(&self) -> CgroupVersion {
        self.dirs.version()
    }

    /// Every directory of this cgroup (one per distinct hierarchy).
    pub fn dirs(&self) -> Vec<PathBuf> {
        self.dirs.all()
    }

    /// How swap was handled by [`CgroupManager::create`]; `None` for [`CgroupManager::open`]ed
    /// cgroups.
    pub fn swap_limit(&self) -> Option<SwapLimit> {
        self.swap
    }

    /// Every `cgroup.procs` file a pid must be written into (v1: one per hierarchy). A spawner
    /// that attaches the child itself (e.g. `echo $$ > …` before exec) uses these.
    pub fn procs_paths(&self) -> Vec<PathBuf> {
        self.dirs
            .all()
            .into_iter()
            .map(|d| d.join("cgroup.procs"))
            .collect()
    }

    /// Moves process `pid` (all its threads) into this cgroup.
    pub fn attach(&self, pid: i32) -> Result<(), CgroupError> {
        let value = pid.to_string();
        for path in self.procs_paths() {
            write_raw(&path, &value).map_err(|source| CgroupError::Attach { pid, path, source })?;
        }
        Ok(())
    }

    /// Applies `limits`; fields that are `None` are left unchanged. Returns how swap was
    /// handled.
    pub fn set_limits(&self, limits: &CgroupLimits) -> Result<SwapLimit, CgroupError> {
        limits.validate()?;
        match &self.dirs {
            CgroupLayout::V1 {
                cpu, memory, pids, ..
            } => set_limits_v1(cpu, memory, pids, limits),
            CgroupLayout::V2 { root: dir } => set_limits_v2(dir, limits),
        }
    }

    /// Pids of the processes in this cgroup (v1: read from the `pids` hierarchy).
    pub fn pids(&self) -> Result<Vec<i32>, CgroupError> {
        read_procs(&self.dirs.primary().join("cgroup.procs"))
    }

    /// Whether no process is in the cgroup, in any hierarchy.
    pub fn is_empty(&self) -> Result<bool, CgroupError> {
        Ok(self.member_pids()?.is_empty())
    }

    /// How long ago the youngest of the cgroup's existing directories was made (by its
    /// modification time, which cgroupfs sets when the directory is made; `None` when none
    /// exists or a time is unreadable or in the future). Sweeps of cgroups left behind use it
    /// to leave alone one that is being set up.
    pub fn age(&self) -> Option<Duration> {
        let mut youngest: Option<Duration> = None;
        for dir in self.dirs.all() {
            let modified = match fs::metadata(&dir) {
                Ok(m) => m.modified().ok()?,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(_) => return None,
            };
            let age = modified.elapsed().ok()?;
            youngest = Some(youngest.map_or(age, |y| y.min(age)));
        }
        youngest
    }

    /// Kills every process in the cgroup and waits (bounded) until it is empty.
    ///
    /// v2 writes `cgroup.kill`, which also catches processes forked concurrently. v1 (and v2
    /// kernels before 5.14) loops: read `cgroup.procs` of every hierarchy, pin each pid with a
    /// pidfd, re-read to confirm the pinned process is still a member, then
    /// `pidfd_send_signal(SIGKILL)` — so a pid recycled by an unrelated process is never
    /// signalled. Directories that no longer exist are skipped.
    pub fn kill_all(&self) -> Result<(), CgroupError> {
        let started = Instant::now();
        if let CgroupLayout::V2 { root: dir } = &self.dirs {
            let kill_file = dir.join("cgroup.kill");
            match write_raw(&kill_file, "1") {
                Ok(()) => return self.wait_empty(started),
                Err(e) if e.kind() == io::ErrorKind::NotFound && !dir.exists() => {
                    return Ok(());
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {} // kernel < 5.14: loop
                Err(source) => {
                    return Err(CgroupError::Write {
                        file: kill_file,
                        value: "1".into(),
                        source,
                    });
                }
            }
        }
        let mut backoff = Duration::from_micros(200);
        loop {
            let members = self.member_pids()?;
            if members.is_empty() {
                return Ok(());
            }
            if started.elapsed() > KILL_TIMEOUT {
                return Err(self.kill_timeout(members.len(), started));
            }
            let pinned: Vec<(i32, OwnedFd)> = members
                .iter()
                .filter_map(|&pid| pidfd_open(pid).ok().map(|fd| (pid, fd)))
                .collect();
            let still = self.member_pids()?;
            for (pid, fd) in &pinned {
                if !still.contains(pid) {
                    continue;
                }
                match pidfd_send_sigkill(fd.as_fd()) {
                    Ok(()) => {}
                    Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
                    Err(source) => {
                        return Err(CgroupError::Kill {
                            pid: *pid,
                            path: self.dirs.primary().to_owned(),
                            source,
                        });
                    }
                }
            }
            thread::sleep(backoff);
            backoff = (backoff * 2).min(Duration::from_millis(20));
        }
    }

    fn kill_timeout(&self, remaining: usize, started: Instant) -> CgroupError {
        CgroupError::KillTimeout {
            path: self.dirs.primary().to_owned(),
            remaining,
            waited: started.elapsed(),
        }
    }

    /// Union of `cgroup.procs` over every existing hierarchy directory.
    fn member_pids(&self) -> Result<BTreeSet<i32>, CgroupError> {
        let mut all = BTreeSet::new();
        for dir in self.dirs.all() {
            match read_procs(&dir.join("cgroup.procs")) {
                Ok(pids) => all.extend(pids),
                Err(CgroupError::Read { source, .. })
                    if source.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        Ok(all)
    }

    fn wait_empty(&self, started: Instant) -> Result<(), CgroupError> {
        let mut backoff = Duration::from_micros(100);
        loop {
            let members = self.member_pids()?;
            if members.is_empty() {
                return Ok(());
            }
            if started.elapsed() > KILL_TIMEOUT {
                return Err(self.kill_timeout(members.len(), started));
            }
            thread::sleep(backoff);
            backoff = (backoff * 2).min(Duration::from_millis(20));
        }
    }

    /// Reads usage counters.
    pub fn stats(&self) -> Result<CgroupStats, CgroupError> {
        match &self.dirs {
            CgroupLayout::V1 {
                cpuacct,
                memory,
                pids,
                ..
            } => {
                let oom_kills = read_oom_kills(&self.dirs)?;
                let cpu_usage_ns = match cpuacct {
                    Some(dir) => Some(read_u64(&dir.join("cpuacct.usage"))?),
                    None => None,
                };
                Ok(CgroupStats {
                    memory_current: read_u64(&memory.join("memory.usage_in_bytes"))?,
                    memory_peak: Some(read_u64(&memory.join("memory.max_usage_in_bytes"))?),
                    oom_kills,
                    cpu_usage_ns,
                    pids_current: read_u64(&pids.join("pids.current"))?,
                })
            }
            CgroupLayout::V2 { root: dir } => {
                let oom_kills = read_oom_kills(&self.dirs)?;
                let memory_peak = match read_u64(&dir.join("memory.peak")) {
                    Ok(v) => Some(v),
                    Err(CgroupError::Read { source, .. })
                        if source.kind() == io::ErrorKind::NotFound =>
                    {
                        None
                    }
                    Err(e) => return Err(e),
                };
                let cpu = parse_cpu_stat(&read_file(&dir.join("cpu.stat"))?);
                Ok(CgroupStats {
                    memory_current: read_u64(&dir.join("memory.current"))?,
                    memory_peak,
                    oom_kills,
                    cpu_usage_ns: cpu.usage_usec.map(|us| us.saturating_mul(1000)),
                    pids_current: read_u64(&dir.join("pids.current"))?,
                })
            }
        }
    }

    /// Forks the pids controller refused here (`max` of `pids.events`, v1 and v2): each had
    /// already copied its address space. `None` when the file cannot be read.
    pub fn pids_refused(&self) -> Option<u64> {
        self.dirs().iter().find_map(|dir| {
            let ev = std::fs::read_to_string(dir.join("pids.events")).ok()?;
            ev.lines()
                .find_map(|l| l.strip_prefix("max ")?.trim().parse().ok())
        })
    }

    /// Resets the peak-memory counter before reusing the cgroup. v1 writes
    /// `memory.max_usage_in_bytes`; v2 has no global reset (`memory.peak` resets only per open
    /// file), so this is a no-op there.
    pub fn reset_peak(&self) -> Result<(), CgroupError> {
        match &self.dirs {
            CgroupLayout::V1 { memory, .. } => {
                write_file(&memory.join("memory.max_usage_in_bytes"), "0")
            }
            CgroupLayout::V2 { .. } => Ok(()),
        }
    }

    /// Removes the cgroup's directories. Retries `EBUSY` briefly while the kernel finishes
    /// tearing down exiting tasks; directories already gone are fine. The cgroup must be empty
    /// (see [`kill_all`](Self::kill_all)).
    pub fn remove(self) -> Result<(), CgroupError> {
        for dir in self.dirs.all() {
            rmdir_retry(&dir)?;
        }
        Ok(())
    }
}

fn set_limits_v1(
    cpu: &Path,
    memory: &Path,
    pids: &Path,
    limits: &CgroupLimits,
) -> Result<SwapLimit, CgroupError> {
    if let Some(weight) = limits.cpu_weight {
        write_file(
            &cpu.join("cpu.shares"),
            &weight_to_shares(weight).to_string(),
        )?;
    }
    if let Some((quota, period)) = limits.cpu_max {
        write_file(&cpu.join("cpu.cfs_period_us"), &period.to_string())?;
        write_file(&cpu.join("cpu.cfs_quota_us"), &quota.to_string())?;
    }
    if let Some(high) = limits.memory_high {
        write_file(
            &memory.join("memory.soft_limit_in_bytes"),
            &high.to_string(),
        )?;
    }
    let mut swap = SwapLimit::Untouched;
    if let Some(max) = limits.memory_max {
        let value = max.to_string();
        let limit = memory.join("memory.limit_in_bytes");
        let memsw = memory.join("memory.memsw.limit_in_bytes");
        match write_raw(&limit, &value) {
            Ok(()) => {}
            // memory.limit_in_bytes may not exceed memsw: raising an existing limit needs memsw
            // lifted first.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) && memsw.exists() => {
                write_file(&memsw, "-1")?;
                write_file(&limit, &value)?;
            }
            Err(source) => {
                return Err(CgroupError::Write {
                    file: limit,
                    value,
                    source,
                });
            }
        }
        swap = write_optional(&memsw, &value)?;
    }
    if let Some(max) = limits.pids_max {
        write_file(&pids.join("pids.max"), &max.to_string())?;
    }
    Ok(swap)
}

fn set_limits_v2(dir: &Path, limits: &CgroupLimits) -> Result<SwapLimit, CgroupError> {
    if let Some(weight) = limits.cpu_weight {
        write_file(&dir.join("cpu.weight"), &weight.to_string())?;
    }
    if let Some((quota, period)) = limits.cpu_max {
        write_file(&dir.join("cpu.max"), &format!("{quota} {period}"))?;
    }
    if let Some(high) = limits.memory_high {
        write_file(&dir.join("memory.high"), &high.to_string())?;
    }
    if let Some(max) = limits.memory_max {
        write_file(&dir.join("memory.max"), &max.to_string())?;
    }
    let swap = if limits.memory_max.is_some() || limits.memory_high.is_some() {
        write_optional(&dir.join("memory.swap.max"), "0")?
    } else {
        SwapLimit::Untouched
    };
    if let Some(max) = limits.pids_max {
        write_file(&dir.join("pids.max"), &max.to_string())?;
    }
    Ok(swap)
}

/// Writes a swap-limit file that exists only with swap accounting.
fn write_optional(file: &Path, value: &str) -> Result<SwapLimit, CgroupError> {
    match write_raw(file, value) {
        Ok(()) => Ok(SwapLimit::Disabled),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(SwapLimit::NotAccounted),
        Err(source) => Err(CgroupError::Write {
            file: file.to_owned(),
            value: value.to_owned(),
            source,
        }),
    }
}

/// Writes `value` to an existing interface file in a single `write(2)`, without `O_CREAT`
/// (cgroupfs rejects creation, and a missing file must surface as `NotFound`).
fn write_raw(file: &Path, value: &str) -> io::Result<()> {
    let mut f = OpenOptions::new().write(true).open(file)?;
    f.write_all(value.as_bytes())
}

fn write_file(file: &Path, value: &str) -> Result<(), CgroupError> {
    write_raw(file, value).map_err(|source| CgroupError::Write {
        file: file.to_owned(),
        value: value.to_owned(),
        source,
    })
}

fn read_file(file: &Path) -> Result<String, CgroupError> {
    fs::read_to_string(file).map_err(|source| CgroupError::Read {
        file: file.to_owned(),
        source,
    })
}

/// The OOM-kill counter of the cgroup at `dirs`: v1 `memory.oom_control`, v2 `memory.events`.
fn read_oom_kills(dirs: &CgroupLayout) -> Result<u64, CgroupError> {
    let (file, kills) = match dirs {
        CgroupLayout::V1 { memory, .. } => {
            let file = memory.join("memory.oom_control");
            let kills = parse_oom_control(&read_file(&file)?).map(|o| o.oom_kill);
            (file, kills)
        }
        CgroupLayout::V2 { root } => {
            let file = root.join("memory.events");
            let kills = parse_memory_events(&read_file(&file)?).map(|e| e.oom_kill);
            (file, kills)
        }
    };
    kills.ok_or(CgroupError::Parse {
        file,
        what: "an oom_kill line",
    })
}

fn read_u64(file: &Path) -> Result<u64, CgroupError> {
    match parse_single_value(&read_file(file)?) {
        Some(Some(v)) => Ok(v),
        _ => Err(CgroupError::Parse {
            file: file.to_owned(),
            what: "an unsigned integer",
        }),
    }
}

fn read_procs(file: &Path) -> Result<Vec<i32>, CgroupError> {
    parse_procs(&read_file(file)?).ok_or_else(|| CgroupError::Parse {
        file: file.to_owned(),
        what: "one pid per line",
    })
}

fn rmdir_retry(dir: &Path) -> Result<(), CgroupError> {
    let started = Instant::now();
    let mut backoff = Duration::from_micros(200);
    loop {
        match fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e)
                if e.raw_os_error() == Some(libc::EBUSY) && started.elapsed() < REMOVE_TIMEOUT =>
            {
                thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_millis(20));
            }
            Err(source) => {
                return Err(CgroupError::Remove {
                    path: dir.to_owned(),
                    source,
                })
            }
        }
    }
}

/// Best-effort rollback of a half-created cgroup.
fn rmdir_all(dirs: &[PathBuf]) {
    for dir in dirs {
        let _ = rmdir_retry(dir);
    }
}

/// `pidfd_open(2)`: pins process `pid` so a later signal cannot hit a recycled pid.
fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and a flags word by value and touches no user memory.
    let ret = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = i32::try_from(ret).map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
    // SAFETY: the kernel just returned `fd` as a new descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `pidfd_send_signal(2)` with `SIGKILL`.
fn pidfd_send_sigkill(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: `fd` is a live pidfd borrowed for the call; a null `siginfo` is allowed (the
    // kernel fills in SI_USER) and flags are 0.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            fd.as_raw_fd(),
            libc::SIGKILL,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mounts(text: &str) -> Vec<MountInfo> {
        parse_mountinfo(text)
    }

    #[test]
    fn layout_prefers_v2_with_controllers() {
        let text = "\
30 1 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot
";
        let layout = CgroupLayout::from_mounts(&mounts(text), |_| {
            Some("cpuset cpu io memory hugetlb pids rdma misc\n".into())
        });
        assert_eq!(
            layout.ok(),
            Some(CgroupLayout::V2 {
                root: "/sys/fs/cgroup".into()
            })
        );
    }

    #[test]
    fn layout_falls_back_to_v1_when_v2_is_empty() {
        let text = "\
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";
        let layout = CgroupLayout::from_mounts(&mounts(text), |_| Some("hugetlb\n".into()));
        let cpu = PathBuf::from("/sys/fs/cgroup/cpu,cpuacct");
        assert_eq!(
            layout.ok(),
            Some(CgroupLayout::V1 {
                cpu: cpu.clone(),
                cpuacct: Some(cpu),
                memory: "/sys/fs/cgroup/memory".into(),
                pids: "/sys/fs/cgroup/pids".into(),
            })
        );
    }

    #[test]
    fn layout_reports_missing_v1_controllers() {
        let text = "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n";
        match CgroupLayout::from_mounts(&mounts(text), |_| None) {
            Err(CgroupError::Detect { reason }) => {
                assert!(
                    reason.ends_with("missing v1 hierarchies: cpu, pids"),
                    "{reason}"
                );
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn co_mounted_hierarchies_are_deduplicated() {
        let cpu = PathBuf::from("/c/cpu,cpuacct/dsec/x");
        let dirs = CgroupLayout::V1 {
            cpu: cpu.clone(),
            cpuacct: Some(cpu.clone()),
            memory: "/c/memory/dsec/x".into(),
            pids: "/c/pids/dsec/x".into(),
        };
        assert_eq!(dirs.all().len(), 3);
        assert!(dirs.all().contains(&cpu));
    }

    #[test]
    fn names_are_validated() {
        for bad in ["", ".", "..", "../x", "a/b", "a b", "x\0", "é"] {
            assert!(validate_name(bad).is_err(), "{bad:?} accepted");
        }
        for good in ["a", "sbx-1.2_3", "...", "A9"] {
            assert!(validate_name(good).is_ok(), "{good:?} rejected");
        }
    }

    #[test]
    fn limits_are_validated() {
        let ok = CgroupLimits {
            cpu_weight: Some(10_000),
            cpu_max: Some((50_000, 100_000)),
            memory_high: Some(1 << 30),
            memory_max: Some(2 << 30),
            pids_max: Some(64),
        };
        assert!(ok.validate().is_ok());
        for bad in [
            CgroupLimits {
                cpu_weight: Some(0),
                ..ok
            },
            CgroupLimits {
                cpu_weight: Some(10_001),
                ..ok
            },
            CgroupLimits {
                cpu_max: Some((999, 100_000)),
                ..ok
            },
            CgroupLimits {
                cpu_max: Some((50_000, 2_000_000)),
                ..ok
            },
            CgroupLimits {
                pids_max: Some(0),
                ..ok
            },
            CgroupLimits {
                memory_max: Some(u64::MAX),
                ..ok
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn weight_maps_to_shares() {
        assert_eq!(weight_to_shares(100), 1024);
        assert_eq!(weight_to_shares(1), 10);
        assert_eq!(weight_to_shares(10_000), 102_400);
    }

    #[test]
    fn remount_keeps_flags_and_options() {
        let m = &mounts(
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
