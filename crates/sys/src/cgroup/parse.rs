//! Pure parsers for the kernel's cgroup interface files and `/proc/self/mountinfo`.
//!
//! Every function here takes the file's text and returns plain data, so they are unit-tested
//! against fixtures and never touch the file system.

use std::path::PathBuf;

/// One line of `/proc/<pid>/mountinfo` (see `proc_pid_mountinfo(5)`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountInfo {
    /// Path of the mounted directory inside its file system (field 4).
    pub root: String,
    /// Where it is mounted (field 5), with the kernel's octal escapes decoded.
    pub mount_point: PathBuf,
    /// Per-mount options such as `rw`, `nosuid`, `relatime` (field 6).
    pub mount_options: Vec<String>,
    /// File system type, e.g. `cgroup` or `cgroup2`.
    pub fs_type: String,
    /// Mount source.
    pub source: String,
    /// Per-superblock options; for cgroup v1 these name the bound controllers.
    pub super_options: Vec<String>,
}

impl MountInfo {
    /// Whether `opt` is one of the superblock options (e.g. a v1 controller or `favordynmods`).
    pub fn has_super_option(&self, opt: &str) -> bool {
        self.super_options.iter().any(|o| o == opt)
    }
}

/// Decodes the `\NNN` octal escapes the kernel uses for space, tab, newline and backslash.
fn unescape_octal(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 4 <= bytes.len() {
            let digits = &bytes[i + 1..i + 4];
            if digits.iter().all(|d| (b'0'..=b'7').contains(d)) {
                let value = digits
                    .iter()
                    .fold(0u32, |acc, d| acc * 8 + u32::from(d - b'0'));
                if let Ok(byte) = u8::try_from(value) {
                    out.push(byte);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn split_options(field: &str) -> Vec<String> {
    field
        .split(',')
        .filter(|o| !o.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Parses the text of `/proc/<pid>/mountinfo`. Malformed lines are skipped.
pub fn parse_mountinfo(text: &str) -> Vec<MountInfo> {
    text.lines().filter_map(parse_mountinfo_line).collect()
}

fn parse_mountinfo_line(line: &str) -> Option<MountInfo> {
    let mut fields = line.split(' ');
    let _mount_id = fields.next()?;
    let _parent_id = fields.next()?;
    let _dev = fields.next()?;
    let root = unescape_octal(fields.next()?);
    let mount_point = PathBuf::from(unescape_octal(fields.next()?));
    let mount_options = split_options(fields.next()?);
    // Zero or more optional fields, terminated by a single "-".
    loop {
        if fields.next()? == "-" {
            break;
        }
    }
    let fs_type = fields.next()?.to_owned();
    let source = unescape_octal(fields.next()?);
    let super_options = split_options(fields.next().unwrap_or(""));
    Some(MountInfo {
        root,
        mount_point,
        mount_options,
        fs_type,
        source,
        super_options,
    })
}

/// Looks up `key` in a flat-keyed file (`key value` per line, as in `cpu.stat`).
pub fn flat_keyed(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let mut parts = line.split_whitespace();
        if parts.next()? != key {
            return None;
        }
        parts.next()?.parse().ok()
    })
}

/// Parses a single-value file such as `memory.current` or `pids.current`. `max` is `None`.
pub fn parse_single_value(text: &str) -> Option<Option<u64>> {
    let value = text.trim();
    if value == "max" {
        return Some(None);
    }
    value.parse().ok().map(Some)
}

/// Counters from cgroup v2 `memory.events`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryEvents {
    /// Times usage went over `memory.high` and was throttled.
    pub high: u64,
    /// Times usage hit `memory.max`.
    pub max: u64,
    /// Times the cgroup hit its limit and reclaim failed.
    pub oom: u64,
    /// Processes killed by the OOM killer in this cgroup (and its descendants).
    pub oom_kill: u64,
}

/// Parses v2 `memory.events`. `None` when the `oom_kill` line (kernel >= 4.13) is missing.
pub fn parse_memory_events(text: &str) -> Option<MemoryEvents> {
    Some(MemoryEvents {
        high: flat_keyed(text, "high").unwrap_or(0),
        max: flat_keyed(text, "max").unwrap_or(0),
        oom: flat_keyed(text, "oom").unwrap_or(0),
        oom_kill: flat_keyed(text, "oom_kill")?,
    })
}

/// Contents of cgroup v1 `memory.oom_control`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OomControl {
    /// `true` when the OOM killer is disabled for this cgroup (tasks hang instead).
    pub oom_kill_disable: bool,
    /// `true` while the cgroup is under OOM.
    pub under_oom: bool,
    /// Processes killed by the OOM killer in this cgroup.
    pub oom_kill: u64,
}

/// Parses v1 `memory.oom_control`. `None` when the `oom_kill` line (kernel >= 4.13) is missing.
pub fn parse_oom_control(text: &str) -> Option<OomControl> {
    Some(OomControl {
        oom_kill_disable: flat_keyed(text, "oom_kill_disable").unwrap_or(0) != 0,
        under_oom: flat_keyed(text, "under_oom").unwrap_or(0) != 0,
        oom_kill: flat_keyed(text, "oom_kill")?,
    })
}

/// The fields of `cpu.stat` dsec uses. v1 `cpu.stat` has only the throttling counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CpuStat {
    /// Total CPU time in microseconds (v2 only).
    pub usage_usec: Option<u64>,
    /// Number of periods in which the cgroup was throttled by its `cpu.max` quota.
    pub nr_throttled: u64,
    /// Total throttled time in microseconds (v2 `throttled_usec`, v1 `throttled_time` / 1000).
    pub throttled_usec: u64,
}

/// Parses `cpu.stat` of either version.
pub fn parse_cpu_stat(text: &str) -> CpuStat {
    let throttled_usec = flat_keyed(text, "throttled_usec")
        .or_else(|| flat_keyed(text, "throttled_time").map(|ns| ns / 1000))
        .unwrap_or(0);
    CpuStat {
        usage_usec: flat_keyed(text, "usage_usec"),
        nr_throttled: flat_keyed(text, "nr_throttled").unwrap_or(0),
        throttled_usec,
    }
}

/// Parses `cgroup.procs`: one pid per line.
pub fn parse_procs(text: &str) -> Option<Vec<i32>> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| l.trim().parse().ok())
        .collect()
}

/// Parses a space-separated controller list (`cgroup.controllers`, `cgroup.subtree_control`).
/// A leading `+` (as written by hand into a fake `subtree_control`) is ignored.
pub fn parse_controllers(text: &str) -> Vec<String> {
    text.split_whitespace()
        .map(|c| c.trim_start_matches('+').to_owned())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO_V1: &str = "\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
90 22 0:50 / /run/dsec/cgroup\\040fdm rw,nosuid,nodev,noexec,relatime shared:7 master:3 - cgroup cgroup rw,name=dsec,favordynmods
";

    #[test]
    fn mountinfo_fields_and_optional_fields() {
        let mounts = parse_mountinfo(MOUNTINFO_V1);
        assert_eq!(mounts.len(), 9);
        let cpu = &mounts[2];
        assert_eq!(cpu.mount_point, PathBuf::from("/sys/fs/cgroup/cpu"));
        assert_eq!(cpu.fs_type, "cgroup");
        assert!(cpu.has_super_option("cpu"));
        assert!(!cpu.has_super_option("cpuacct"));
        let named = &mounts[8];
        assert_eq!(named.mount_point, PathBuf::from("/run/dsec/cgroup fdm"));
        assert_eq!(
            named.mount_options,
            ["rw", "nosuid", "nodev", "noexec", "relatime"]
        );
        assert!(named.has_super_option("favordynmods"));
        assert!(named.has_super_option("name=dsec"));
        assert_eq!(mounts[0].fs_type, "ext4");
    }

    #[test]
    fn mountinfo_skips_malformed_lines() {
        let text = "garbage\n1 2 3 / /x rw no-dash-here\n\n5 1 0:1 / /y rw - cgroup2 cgroup2 rw,nsdelegate\n";
        let mounts = parse_mountinfo(text);
        assert_eq!(mounts.len(), 1);
        assert_eq!(mounts[0].super_options, ["rw", "nsdelegate"]);
    }

    #[test]
    fn octal_unescape() {
        assert_eq!(unescape_octal("a\\040b\\011c\\134d"), "a b\tc\\d");
        assert_eq!(unescape_octal("trailing\\04"), "trailing\\04");
        assert_eq!(unescape_octal("\\999"), "\\999");
    }

    #[test]
    fn memory_events_v2() {
        let text = "low 0\nhigh 12\nmax 40\noom 3\noom_kill 2\noom_group_kill 0\n";
        assert_eq!(
            parse_memory_events(text),
            Some(MemoryEvents {
                high: 12,
                max: 40,
                oom: 3,
                oom_kill: 2
            })
        );
        assert_eq!(parse_memory_events("low 0\nhigh 0\nmax 0\noom 0\n"), None);
    }

    #[test]
    fn oom_control_v1() {
        let text = "oom_kill_disable 0\nunder_oom 1\noom_kill 7\n";
        assert_eq!(
            parse_oom_control(text),
            Some(OomControl {
                oom_kill_disable: false,
                under_oom: true,
                oom_kill: 7
            })
        );
        assert_eq!(parse_oom_control("oom_kill_disable 1\nunder_oom 0\n"), None);
    }

    #[test]
    fn cpu_stat_both_versions() {
        let v2 = "usage_usec 188279946\nuser_usec 163332654\nsystem_usec 24947292\nnice_usec 0\n\
                  nr_periods 10\nnr_throttled 4\nthrottled_usec 900\nnr_bursts 0\nburst_usec 0\n";
        assert_eq!(
            parse_cpu_stat(v2),
            CpuStat {
                usage_usec: Some(188_279_946),
                nr_throttled: 4,
                throttled_usec: 900
            }
        );
        let v1 = "nr_periods 0\nnr_throttled 2\nthrottled_time 5000\nnr_bursts 0\nburst_time 0\n";
        assert_eq!(
            parse_cpu_stat(v1),
            CpuStat {
                usage_usec: None,
                nr_throttled: 2,
                throttled_usec: 5
            }
        );
    }

    #[test]
    fn flat_keyed_exact_key_match() {
        // `oom` must not match the `oom_kill` line and vice versa.
        let text = "oom_kill 5\noom 9\n";
        assert_eq!(flat_keyed(text, "oom"), Some(9));
        assert_eq!(flat_keyed(text, "oom_kill"), Some(5));
        assert_eq!(flat_keyed("oom x\n", "oom"), None);
    }

    #[test]
    fn single_values_and_procs() {
        assert_eq!(parse_single_value("4096\n"), Some(Some(4096)));
        assert_eq!(parse_single_value("max\n"), Some(None));
        assert_eq!(parse_single_value("-1\n"), None);
        assert_eq!(parse_procs("1\n22\n333\n"), Some(vec![1, 22, 333]));
        assert_eq!(parse_procs(""), Some(vec![]));
        assert_eq!(parse_procs("1\nx\n"), None);
        assert_eq!(
            parse_controllers("cpu memory pids\n"),
            ["cpu", "memory", "pids"]
        );
        assert_eq!(parse_controllers("+cpu +pids"), ["cpu", "pids"]);
    }
}
