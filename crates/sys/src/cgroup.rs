//! cgroup v1 and v2 management for sandboxes.
//!
//! A [`CgroupManager`] owns one base directory (e.g. `dsec`) under every hierarchy dsec uses and
//! creates one [`Cgroup`] per sandbox below it:
//!
//! - **v2** (production): one directory `<root>/<base>/<name>` in the unified hierarchy. The
//!   manager enables `cpu`, `memory` and `pids` in the `cgroup.subtree_control` of the root and of
//!   the base cgroup (only controllers the root offers).
//! - **v1**: one directory per hierarchy: `cpu`, `memory`, `pids`, plus `cpuacct` and `devices`
//!   when they are mounted (co-mounted `cpu,cpuacct` counts once). A pid is attached by writing
//!   it into every hierarchy's `cgroup.procs` ([`Cgroup::procs_paths`]).
//!
//! Limits ([`CgroupLimits`]) use v2 semantics and are translated for v1 (`cpu.weight` →
//! `cpu.shares`, `memory.high` → `memory.soft_limit_in_bytes`, …). Swap is always capped at zero
//! when a memory limit is set: `memory.swap.max = 0` (v2) or `memory.memsw.limit_in_bytes =
//! memory.limit_in_bytes` (v1); a kernel without swap accounting is reported as
//! [`SwapLimit::NotAccounted`], not as an error.
//!
//! Device access is limited separately, by [`Cgroup::limit_devices`] with a list of
//! [`DeviceRule`]s: `devices.deny`/`devices.allow` (v1) or a `BPF_CGROUP_DEVICE` program (v2,
//! [`devices`]).
//!
//! Attaching a pid to a cgroup write-locks the kernel's global `cgroup_threadgroup_rwsem`, which
//! costs an RCU grace period (≈10 ms) unless some hierarchy is mounted with `favordynmods`; see
//! [`CgroupManager::favor_dynmods`].
//!
//! All file IO is plain `std::fs`; the only `unsafe` is the pidfd and mount system calls.

pub mod cpuset;
pub mod devices;
mod group;
mod manager;
mod parse;

pub use cpuset::CpuPartition;
pub use devices::{DeviceKind, DeviceRule};
pub use group::Cgroup;
pub use manager::{remount_args, CgroupManager, FAVORDYNMODS_DIR};
pub use parse::{
    flat_keyed, parse_controllers, parse_cpu_stat, parse_memory_events, parse_mountinfo,
    parse_oom_control, parse_procs, parse_single_value, CpuStat, MemoryEvents, MountInfo,
    OomControl,
};

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The v2 controllers dsec enables for its cgroups.
const V2_CONTROLLERS: [&str; 3] = ["cpu", "memory", "pids"];

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
    /// Loading or attaching a v2 device program failed.
    #[error("{step} of the device program of {}", path.display())]
    DeviceProgram {
        /// The cgroup directory.
        path: PathBuf,
        /// `load`, `open` (the directory) or `attach`.
        step: &'static str,
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
        /// Hierarchy with the `devices` controller, if mounted.
        devices: Option<PathBuf>,
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
                devices: v1("devices"),
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
                devices,
            } => {
                let mut out: Vec<PathBuf> = Vec::with_capacity(5);
                let dirs = [
                    Some(memory),
                    Some(pids),
                    Some(cpu),
                    cpuacct.as_ref(),
                    devices.as_ref(),
                ];
                for dir in dirs.into_iter().flatten() {
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
37 31 0:34 / /sys/fs/cgroup/devices rw,relatime - cgroup cgroup rw,devices
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
                devices: Some("/sys/fs/cgroup/devices".into()),
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
            devices: Some("/c/devices/dsec/x".into()),
        };
        assert_eq!(dirs.all().len(), 4);
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
}
