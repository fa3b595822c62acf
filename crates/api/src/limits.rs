//! A sandbox's resource limits: part of the create spec, carried down to the supervisor that
//! writes them into the sandbox's cgroup and rlimits.

use serde::{Deserialize, Serialize};

/// Resource limits of one sandbox.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// CPU weight, 1..=10000 (100 = one default share). A weight, not a cap.
    pub cpu_weight: u64,
    /// Optional hard CPU cap in CPUs (quota/period), e.g. 1.5. Off by default: CFS quotas add
    /// tail latency to short commands.
    pub cpu_max: Option<f64>,
    /// Hard memory limit in bytes (OOM inside the sandbox beyond it). No swap.
    pub memory_max: u64,
    /// Soft memory limit in bytes (reclaim pressure beyond it).
    pub memory_high: Option<u64>,
    /// Most processes/threads.
    pub pids_max: u64,
    /// Writable layer size in bytes (the disk quota).
    pub disk_bytes: u64,
    /// Writable layer inode limit.
    pub disk_inodes: u64,
    /// Largest file a process may write (RLIMIT_FSIZE).
    pub file_size_max: u64,
    /// Most open files per process (RLIMIT_NOFILE).
    pub open_files_max: u64,
    /// Requested size of /dev/shm. /dev/shm is a directory of the writable layer's tmpfs, so it
    /// is bounded by `disk_bytes` (shared with the writable layer), not by this value.
    pub shm_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            cpu_weight: 100,
            cpu_max: None,
            memory_max: 512 << 20,
            memory_high: None,
            pids_max: 256,
            disk_bytes: 1 << 30,
            disk_inodes: 65536,
            file_size_max: 1 << 30,
            open_files_max: 1024,
            shm_bytes: 64 << 20,
        }
    }
}

/// How far `RLIMIT_NPROC` sits under `pids_max` in a sandbox with a user namespace. An exiting
/// task leaves the rlimit count before its pids charge (`release_task` drops the one, then the
/// other), so at equal limits a fork made while a fork bomb is being killed and reaped passes
/// the rlimit and is refused only by the pids controller, after its address space was copied.
/// A few tasks of headroom keep the rlimit the one that refuses.
pub const NPROC_HEADROOM: u64 = 4;

impl Limits {
    /// `RLIMIT_NPROC` of a sandbox with a user namespace: `pids_max` less
    /// [`NPROC_HEADROOM`]. The kernel checks it at fork before copying the address space (the
    /// pids controller after), but not for uid 0 of the initial user namespace, so it counts
    /// only where root inside is an unprivileged host uid; there it is per user namespace, so
    /// per sandbox.
    pub fn nproc(&self) -> u64 {
        self.pids_max.saturating_sub(NPROC_HEADROOM).max(1)
    }

    /// Checks the bounds that hold on every node, the kernel's ranges for the cgroup files
    /// included: limits that pass never fail later when the sandbox's cgroup is written.
    /// What one node has is checked by the node when it admits a sandbox.
    pub fn validate(&self) -> Result<(), LimitsError> {
        let range = |limit, rule| Err(LimitsError::OutOfRange { limit, rule });
        if !(1..=10000).contains(&self.cpu_weight) {
            return range("cpu_weight", "must be in 1..=10000");
        }
        if let Some(c) = self.cpu_max {
            if !(0.01..=1024.0).contains(&c) {
                return range("cpu_max", "must be between 0.01 and 1024 CPUs");
            }
        }
        if !(8 << 20..=MAX_BYTES).contains(&self.memory_max) {
            return range("memory_max", "must be in 8 MiB..=8 EiB");
        }
        if self.memory_high.is_some_and(|h| h > self.memory_max) {
            return range("memory_high", "must not exceed memory_max");
        }
        if self.memory_high == Some(0) {
            return range("memory_high", "must be at least 1 byte");
        }
        if !(8..=1 << 20).contains(&self.pids_max) {
            return range("pids_max", "must be in 8..=1048576");
        }
        if !(1 << 20..=MAX_BYTES).contains(&self.disk_bytes) {
            return range("disk_bytes", "must be in 1 MiB..=8 EiB");
        }
        if !(64..=u64::from(u32::MAX)).contains(&self.disk_inodes) {
            return range("disk_inodes", "must be in 64..=4294967295");
        }
        if !(16..=1 << 20).contains(&self.open_files_max) {
            return range("open_files_max", "must be in 16..=1048576");
        }
        if self.file_size_max == 0 {
            return range("file_size_max", "must be at least 1 byte");
        }
        if self.shm_bytes > MAX_BYTES {
            return range("shm_bytes", "must be at most 8 EiB");
        }
        // One rule set: whatever passes here is what the kernel's cgroup files accept (the
        // shim's `cgroup_limits` tests hold the two together at the edges of every range).
        Ok(())
    }
}

/// The largest byte count any limit takes: the kernel's memory and tmpfs sizes are signed
/// 64-bit (`i64::MAX`, 8 EiB).
pub const MAX_BYTES: u64 = i64::MAX as u64;

/// Limits a sandbox cannot have.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitsError {
    /// A limit outside the range dsec accepts on any node.
    #[error("{limit} {rule}")]
    OutOfRange {
        /// The limit's name in the API.
        limit: &'static str,
        /// The range it must be in.
        rule: &'static str,
    },
    /// A limit above what this node has.
    #[error("{limit} = {asked} is more than this node has: at most {max} ({basis})")]
    AboveNode {
        /// The limit's name in the API.
        limit: &'static str,
        /// The value asked for, as given (bytes also in binary units).
        asked: String,
        /// The node's maximum, in the same unit.
        max: String,
        /// Where the maximum comes from (`MemTotal`, online CPUs, …).
        basis: &'static str,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_limits_validate() {
        assert!(Limits::default().validate().is_ok());
        let l = Limits {
            pids_max: 1,
            ..Limits::default()
        };
        assert!(l.validate().is_err());
    }

    #[test]
    fn limits_the_cgroup_files_refuse_are_out_of_range() {
        let cases = [
            Limits {
                memory_max: u64::MAX,
                ..Limits::default()
            },
            Limits {
                memory_max: MAX_BYTES + 1,
                ..Limits::default()
            },
            Limits {
                memory_high: Some(0),
                ..Limits::default()
            },
            Limits {
                disk_bytes: u64::MAX,
                ..Limits::default()
            },
            Limits {
                cpu_max: Some(f64::NAN),
                ..Limits::default()
            },
        ];
        for l in cases {
            let e = l.validate().expect_err("out of range");
            assert!(matches!(e, LimitsError::OutOfRange { .. }), "{e}");
        }
    }

    #[test]
    fn nproc_keeps_headroom_under_pids_max() {
        let l = Limits {
            pids_max: 64,
            ..Limits::default()
        };
        assert_eq!(l.nproc(), 64 - NPROC_HEADROOM);
        let tiny = Limits {
            pids_max: 2,
            ..Limits::default()
        };
        assert_eq!(tiny.nproc(), 1);
    }
}
