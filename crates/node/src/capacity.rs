//! What this node has: the upper bounds of any sandbox's limits.
//!
//! A limit above the machine is no limit at all (a `memory.max` of 10¹⁸ bytes never triggers),
//! so a create that asks for more than the node has is refused as invalid, naming the limit,
//! the value asked and the node's maximum. The bounds:
//!
//! | limit | at most | read from |
//! |---|---|---|
//! | `memory_max` (and so `memory_high`) | the node's memory | `MemTotal` in `/proc/meminfo` |
//! | `disk_bytes` | the node's memory: the writable layer is a tmpfs, held in memory | `MemTotal` |
//! | `cpu_max` | the online CPUs | `/sys/devices/system/cpu/online` |
//! | `pids_max` | the kernel's task limit | the lower of `/proc/sys/kernel/pid_max` and `threads-max` |

use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use dsec_api::limits::{Limits, LimitsError};

/// Limits a node admitted ([`NodeCapacity::admit`]): in every range, and within what the node
/// has. A sandbox's spec carries them, so nothing below the edge that admitted them checks them
/// again. (The defaults count as admitted; so do a persisted record's, admitted when it was
/// made.)
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Admitted(Limits);

impl std::ops::Deref for Admitted {
    type Target = Limits;

    fn deref(&self) -> &Limits {
        &self.0
    }
}

const MEMINFO: &str = "/proc/meminfo";
const CPU_ONLINE: &str = "/sys/devices/system/cpu/online";
const PID_MAX: &str = "/proc/sys/kernel/pid_max";
const THREADS_MAX: &str = "/proc/sys/kernel/threads-max";

/// Reading what the node has failed.
#[derive(Debug, thiserror::Error)]
pub enum CapacityError {
    /// A kernel file could not be read.
    #[error("reading {}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// A kernel file had unexpected content.
    #[error("parsing {}: expected {what}", path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// What was expected.
        what: &'static str,
    },
}

/// The node's resources that bound a sandbox's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeCapacity {
    /// Memory, bytes (`MemTotal`).
    pub memory_bytes: u64,
    /// Online CPUs.
    pub cpus: u32,
    /// The kernel's pid limit (`kernel.pid_max`).
    pub pid_max: u64,
    /// The kernel's task limit (`kernel.threads-max`).
    pub threads_max: u64,
}

fn read(path: &str) -> Result<String, CapacityError> {
    std::fs::read_to_string(path).map_err(|source| CapacityError::Read {
        path: PathBuf::from(path),
        source,
    })
}

fn parse_err(path: &str, what: &'static str) -> CapacityError {
    CapacityError::Parse {
        path: Path::new(path).to_owned(),
        what,
    }
}

/// `MemTotal` of `/proc/meminfo`, in bytes.
pub fn parse_mem_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let mut words = line["MemTotal:".len()..].split_whitespace();
    let n: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") => n.checked_mul(1024),
        None => Some(n),
        Some(_) => None,
    }
}

/// The number of CPUs in a kernel CPU list (`0-3,8,10-11`).
pub fn parse_cpu_list(list: &str) -> Option<u32> {
    let mut n = 0u32;
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (a.parse::<u32>().ok()?, b.parse::<u32>().ok()?),
            None => {
                let c = part.parse::<u32>().ok()?;
                (c, c)
            }
        };
        n = n.checked_add(hi.checked_sub(lo)?.checked_add(1)?)?;
    }
    (n > 0).then_some(n)
}

/// Bytes as `<n> bytes (<binary units>)`, e.g. `1073741824 bytes (1 GiB)`.
pub fn show_bytes(v: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut unit = "";
    let mut scaled = v as f64;
    for u in UNITS {
        if scaled < 1024.0 {
            break;
        }
        scaled /= 1024.0;
        unit = u;
    }
    if unit.is_empty() {
        return format!("{v} bytes");
    }
    let num = format!("{scaled:.1}");
    let num = num.strip_suffix(".0").unwrap_or(&num);
    format!("{v} bytes ({num} {unit})")
}

impl NodeCapacity {
    /// Reads this machine's capacity from `/proc` and `/sys`.
    pub fn detect() -> Result<Self, CapacityError> {
        let memory_bytes = parse_mem_total(&read(MEMINFO)?)
            .ok_or_else(|| parse_err(MEMINFO, "a MemTotal line"))?;
        let cpus = match read(CPU_ONLINE) {
            Ok(list) => parse_cpu_list(&list).ok_or_else(|| parse_err(CPU_ONLINE, "a CPU list"))?,
            // No sysfs (a restricted container): what the scheduler lets this process use.
            Err(_) => std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
        };
        let number = |path: &'static str| -> Result<u64, CapacityError> {
            read(path)?
                .trim()
                .parse()
                .map_err(|_| parse_err(path, "a number"))
        };
        Ok(Self {
            memory_bytes,
            cpus,
            pid_max: number(PID_MAX)?,
            threads_max: number(THREADS_MAX)?,
        })
    }

    /// Checks `limits` on any node ([`Limits::validate`]), then against what this node has
    /// (the table in this module's documentation). The error names the first limit refused.
    pub fn admit(&self, limits: Limits) -> Result<Admitted, LimitsError> {
        limits.validate()?;
        let above_bytes = |limit, asked: u64, basis| {
            (asked > self.memory_bytes).then(|| LimitsError::AboveNode {
                limit,
                asked: show_bytes(asked),
                max: show_bytes(self.memory_bytes),
                basis,
            })
        };
        if let Some(e) = above_bytes("memory_max", limits.memory_max, "MemTotal") {
            return Err(e);
        }
        if let Some(e) = above_bytes(
            "disk_bytes",
            limits.disk_bytes,
            "MemTotal: the writable layer is a tmpfs, held in memory",
        ) {
            return Err(e);
        }
        if let Some(c) = limits.cpu_max {
            if c > f64::from(self.cpus) {
                return Err(LimitsError::AboveNode {
                    limit: "cpu_max",
                    asked: format!("{c} CPUs"),
                    max: format!("{} CPUs", self.cpus),
                    basis: "online CPUs",
                });
            }
        }
        let (tasks, basis) = if self.threads_max < self.pid_max {
            (self.threads_max, "kernel.threads-max")
        } else {
            (self.pid_max, "kernel.pid_max")
        };
        if limits.pids_max > tasks {
            return Err(LimitsError::AboveNode {
                limit: "pids_max",
                asked: format!("{} tasks", limits.pids_max),
                max: format!("{tasks} tasks"),
                basis,
            });
        }
        Ok(Admitted(limits))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NODE: NodeCapacity = NodeCapacity {
        memory_bytes: 4 << 30,
        cpus: 2,
        pid_max: 32768,
        threads_max: 15000,
    };

    #[test]
    fn parses_kernel_files() {
        let meminfo = "MemTotal:       24683792 kB\nMemFree:         1000 kB\n";
        assert_eq!(parse_mem_total(meminfo), Some(24_683_792 * 1024));
        assert_eq!(parse_mem_total("MemFree: 1 kB\n"), None);
        assert_eq!(parse_cpu_list("0-1\n"), Some(2));
        assert_eq!(parse_cpu_list("0-3,8,10-11"), Some(7));
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list(""), None);
    }

    #[test]
    fn shows_bytes_in_binary_units() {
        assert_eq!(show_bytes(512), "512 bytes");
        assert_eq!(show_bytes(1 << 30), "1073741824 bytes (1 GiB)");
        assert_eq!(show_bytes(3 << 29), "1610612736 bytes (1.5 GiB)");
    }

    #[test]
    fn limits_within_the_node_are_admitted() {
        assert!(NODE.admit(Limits::default().clone()).is_ok());
        let top = Limits {
            memory_max: 4 << 30,
            disk_bytes: 4 << 30,
            cpu_max: Some(2.0),
            pids_max: 15000,
            ..Limits::default()
        };
        assert!(NODE.admit(top.clone()).is_ok());
    }

    #[test]
    fn each_limit_above_the_node_is_named_with_both_values() {
        let cases = [
            (
                Limits {
                    memory_max: 999_999 << 40,
                    ..Limits::default()
                },
                "memory_max = 1099510528264372224 bytes (976.6 PiB) is more than this node \
                 has: at most 4294967296 bytes (4 GiB) (MemTotal)",
            ),
            (
                Limits {
                    disk_bytes: (4 << 30) + 1,
                    ..Limits::default()
                },
                "disk_bytes = 4294967297 bytes (4 GiB) is more than this node has: at most \
                 4294967296 bytes (4 GiB) (MemTotal: the writable layer is a tmpfs, held in \
                 memory)",
            ),
            (
                Limits {
                    cpu_max: Some(2.5),
                    ..Limits::default()
                },
                "cpu_max = 2.5 CPUs is more than this node has: at most 2 CPUs (online CPUs)",
            ),
            (
                Limits {
                    pids_max: 15001,
                    ..Limits::default()
                },
                "pids_max = 15001 tasks is more than this node has: at most 15000 tasks \
                 (kernel.threads-max)",
            ),
        ];
        for (limits, want) in cases {
            let e = NODE.admit(limits.clone()).expect_err("above the node");
            assert!(matches!(e, LimitsError::AboveNode { .. }), "{e:?}");
            assert_eq!(e.to_string(), want);
        }
    }

    #[test]
    fn out_of_range_comes_before_the_node() {
        let e = NODE
            .admit(Limits {
                memory_max: u64::MAX,
                ..Limits::default()
            })
            .expect_err("out of range");
        assert!(
            matches!(
                e,
                LimitsError::OutOfRange {
                    limit: "memory_max",
                    ..
                }
            ),
            "{e:?}"
        );
    }

    #[test]
    fn this_machine_is_read() {
        let cap = NodeCapacity::detect().expect("capacity of this machine");
        assert!(cap.memory_bytes > 64 << 20 && cap.cpus >= 1 && cap.pid_max >= 301);
        assert!(cap.admit(Limits::default().clone()).is_ok());
    }
}
