//! [`Cgroup`]: one sandbox's cgroup — attach, limits (v2 semantics, translated for v1), stats,
//! kill and remove — and the file IO every cgroup operation goes through.

use std::collections::BTreeSet;
use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

use super::{
    parse_cpu_stat, parse_memory_events, parse_oom_control, parse_procs, parse_single_value,
    weight_to_shares, CgroupError, CgroupLayout, CgroupLimits, CgroupStats, CgroupVersion,
    DeviceRule, SwapLimit,
};

/// How long [`Cgroup::remove`] retries `rmdir` on `EBUSY`.
const REMOVE_TIMEOUT: Duration = Duration::from_secs(2);

/// How long [`Cgroup::kill_all`] waits for the cgroup to become empty.
const KILL_TIMEOUT: Duration = Duration::from_secs(5);
/// One sandbox's cgroup. Dropping it leaves the kernel objects in place; call
/// [`remove`](Self::remove).
#[derive(Debug)]
pub struct Cgroup {
    pub(super) name: String,
    /// The cgroup's directory in each hierarchy.
    pub(super) dirs: CgroupLayout,
    pub(super) swap: Option<SwapLimit>,
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
    ///
    /// [`CgroupManager::create`]: super::CgroupManager::create
    /// [`CgroupManager::open`]: super::CgroupManager::open
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

    /// Marks the cgroup's CPU scheduling entity idle (`cpu.idle`, Linux 5.15+, v1 and v2) or
    /// not: an idle group runs at the lowest weight and is preempted as soon as a task of a
    /// non-idle group wakes on its CPU. Its own `cpu.weight` comes back when it is not idle.
    pub fn set_cpu_idle(&self, idle: bool) -> Result<(), CgroupError> {
        let dir = match &self.dirs {
            CgroupLayout::V1 { cpu, .. } => cpu,
            CgroupLayout::V2 { root } => root,
        };
        write_file(&dir.join("cpu.idle"), if idle { "1" } else { "0" })
    }

    /// Whether the cgroup's CPU scheduling entity is idle (see
    /// [`set_cpu_idle`](Self::set_cpu_idle)); `None` when the kernel has no `cpu.idle`.
    pub fn cpu_idle(&self) -> Option<bool> {
        let dir = match &self.dirs {
            CgroupLayout::V1 { cpu, .. } => cpu,
            CgroupLayout::V2 { root } => root,
        };
        read_u64(&dir.join("cpu.idle")).ok().map(|v| v == 1)
    }

    /// Lets the cgroup's processes create (`mknod`) and open only the devices `allowed` names;
    /// any other device fails with `EPERM` (see [`devices`](super::devices)). v1 writes `a` into
    /// `devices.deny`, then one line per rule into `devices.allow`; v2 attaches a
    /// `BPF_CGROUP_DEVICE` program ([`devices::attach_program`](super::devices::attach_program);
    /// call it once per cgroup). Returns `false`, having done nothing, on a v1 host without the
    /// `devices` hierarchy. Meant for a fresh cgroup, before any process joins it (a process
    /// keeps the devices it already has open).
    pub fn limit_devices(&self, allowed: &[DeviceRule]) -> Result<bool, CgroupError> {
        match &self.dirs {
            CgroupLayout::V1 {
                devices: Some(dir), ..
            } => {
                write_file(&dir.join("devices.deny"), "a")?;
                let allow = dir.join("devices.allow");
                for rule in allowed {
                    write_file(&allow, &rule.v1_line())?;
                }
                Ok(true)
            }
            CgroupLayout::V1 { devices: None, .. } => Ok(false),
            CgroupLayout::V2 { root: dir } => {
                super::devices::attach_program(dir, allowed)?;
                Ok(true)
            }
        }
    }

    /// The cgroup's directory in the v1 `devices` hierarchy, if that is mounted (its
    /// `devices.list` shows what [`limit_devices`](Self::limit_devices) allowed).
    pub fn devices_dir(&self) -> Option<&Path> {
        match &self.dirs {
            CgroupLayout::V1 { devices, .. } => devices.as_deref(),
            CgroupLayout::V2 { .. } => None,
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
        self.until_empty(started, Duration::from_micros(200), |members| {
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
            Ok(())
        })
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
        self.until_empty(started, Duration::from_micros(100), |_| Ok(()))
    }

    /// Until the cgroup is empty (or [`KILL_TIMEOUT`] after `started`): calls `each` with the
    /// members found, then sleeps, `backoff` at first and twice as long each time (20 ms at most).
    fn until_empty(
        &self,
        started: Instant,
        mut backoff: Duration,
        mut each: impl FnMut(&BTreeSet<i32>) -> Result<(), CgroupError>,
    ) -> Result<(), CgroupError> {
        loop {
            let members = self.member_pids()?;
            if members.is_empty() {
                return Ok(());
            }
            if started.elapsed() > KILL_TIMEOUT {
                return Err(self.kill_timeout(members.len(), started));
            }
            each(&members)?;
            thread::sleep(backoff);
            backoff = (backoff * 2).min(Duration::from_millis(20));
        }
    }

    /// CPU time used by the cgroup's tasks, in nanoseconds (v1 `cpuacct.usage`, v2 `usage_usec`
    /// of `cpu.stat`); `None` when it is not accounted or cannot be read. One file read.
    pub fn cpu_usage_ns(&self) -> Option<u64> {
        match &self.dirs {
            CgroupLayout::V1 { cpuacct, .. } => {
                read_u64(&cpuacct.as_ref()?.join("cpuacct.usage")).ok()
            }
            CgroupLayout::V2 { root } => parse_cpu_stat(&read_file(&root.join("cpu.stat")).ok()?)
                .usage_usec
                .map(|us| us.saturating_mul(1000)),
        }
    }

    /// The ids of the threads in the cgroup's CPU hierarchy (v1 `tasks`, v2 `cgroup.threads`);
    /// `None` when it cannot be read. One file read.
    pub fn threads(&self) -> Option<Vec<i32>> {
        let file = match &self.dirs {
            CgroupLayout::V1 { cpu, .. } => cpu.join("tasks"),
            CgroupLayout::V2 { root } => root.join("cgroup.threads"),
        };
        read_procs(&file).ok()
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

pub(super) fn write_file(file: &Path, value: &str) -> Result<(), CgroupError> {
    write_raw(file, value).map_err(|source| CgroupError::Write {
        file: file.to_owned(),
        value: value.to_owned(),
        source,
    })
}

pub(super) fn read_file(file: &Path) -> Result<String, CgroupError> {
    fs::read_to_string(file).map_err(|source| CgroupError::Read {
        file: file.to_owned(),
        source,
    })
}

/// The OOM-kill counter of the cgroup at `dirs`: v1 `memory.oom_control`, v2 `memory.events`.
pub(super) fn read_oom_kills(dirs: &CgroupLayout) -> Result<u64, CgroupError> {
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
pub(super) fn rmdir_all(dirs: &[PathBuf]) {
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
