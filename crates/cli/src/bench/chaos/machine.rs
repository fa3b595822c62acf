//! What one daemon of the soak has on the machine, found through its own state dirs (never by
//! a process name host-wide: other daemons may run beside it): its processes (the spawner,
//! supervisors and pre-built shells carry `DSEC_STAGE_DIR=<run dir>/stage` in their
//! environment; QEMUs name the run dir on their command line), the sandbox cgroups of its ids,
//! the mounts below its state dirs, and its runtime dirs; and the faults done to them: SIGKILL
//! to a supervisor or an agent, a data dir filled to `ENOSPC`.

use std::collections::BTreeSet;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Context;

/// A process of the daemon (or below it).
#[derive(Debug, Clone)]
pub(super) struct Proc {
    pub(super) pid: i32,
    pub(super) ppid: i32,
    pub(super) comm: String,
}

/// The daemon's state dirs, and how to recognise what is its.
pub(super) struct Machine {
    pub(super) data: PathBuf,
    pub(super) run: PathBuf,
    /// `DSEC_STAGE_DIR=<run>/stage`, NUL-terminated as it is in `/proc/<pid>/environ`.
    stage_env: Vec<u8>,
}

/// `pid`'s parent and name from `/proc/<pid>/stat` (whose name may hold spaces and brackets).
fn stat(pid: i32) -> Option<(i32, String)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (open, close) = (s.find('(')?, s.rfind(')')?);
    let comm = s[open + 1..close].to_owned();
    let ppid = s[close + 2..].split(' ').nth(1)?.parse().ok()?;
    Some((ppid, comm))
}

fn all_pids() -> Vec<i32> {
    std::fs::read_dir("/proc")
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Whether `needle` occurs in `hay`.
fn contains(hay: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && hay.windows(needle.len()).any(|w| w == needle)
}

impl Machine {
    pub(super) fn new(data: &Path, run: &Path) -> Self {
        let mut stage_env = format!("DSEC_STAGE_DIR={}", run.join("stage").display()).into_bytes();
        stage_env.push(0);
        Self {
            data: data.to_owned(),
            run: run.to_owned(),
            stage_env,
        }
    }

    /// The daemon's spawner, supervisors and pre-built shells (by their environment), and its
    /// QEMUs (by their command line).
    pub(super) fn procs(&self) -> Vec<Proc> {
        let run = self.run.display().to_string().into_bytes();
        all_pids()
            .into_iter()
            .filter(|pid| {
                let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
                contains(&env, &self.stage_env) || {
                    let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                    contains(&cmd, b"qemu-system") && contains(&cmd, &run)
                }
            })
            .filter_map(|pid| {
                let (ppid, comm) = stat(pid)?;
                Some(Proc { pid, ppid, comm })
            })
            .collect()
    }

    /// Whether `pid` is a supervisor of this daemon.
    pub(super) fn is_our_supervisor(&self, pid: i32) -> bool {
        let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        contains(&env, &self.stage_env) && stat(pid).is_some_and(|(_, c)| c == "dsec-sup")
    }

    /// The sandboxes with a runtime dir under the run dir.
    pub(super) fn run_dirs(&self) -> BTreeSet<String> {
        dsec_testkit::sandbox_run_dirs(&self.run)
    }

    /// The sandbox cgroups (any hierarchy) named by one of `ids`.
    pub(super) fn cgroups(&self, ids: &BTreeSet<String>) -> BTreeSet<String> {
        dsec_sys::cgroup::CgroupManager::detect("dsec")
            .and_then(|m| m.list())
            .map(|l| l.into_iter().filter(|n| ids.contains(n)).collect())
            .unwrap_or_default()
    }

    /// The processes in sandbox `id`'s cgroup.
    pub(super) fn cgroup_pids(&self, id: &str) -> Vec<i32> {
        dsec_sys::cgroup::CgroupManager::detect("dsec")
            .ok()
            .and_then(|m| m.open(id))
            .and_then(|g| g.pids().ok())
            .unwrap_or_default()
    }

    /// Mount points below the state dirs (in this mount namespace), the data dir's own tmpfs
    /// left out.
    pub(super) fn mounts(&self) -> Vec<String> {
        let (data, run) = (
            self.data.display().to_string(),
            self.run.display().to_string(),
        );
        std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .filter(|m| *m != data && (m.starts_with(&data) || m.starts_with(&run)))
            .map(str::to_owned)
            .collect()
    }

    /// A `dsec-agent` process in sandbox `id`, if one is there.
    pub(super) fn agent_of(&self, id: &str) -> Option<i32> {
        self.cgroup_pids(id).into_iter().find(|pid| {
            stat(*pid).is_some_and(|(_, c)| c.contains("dsec-agen"))
                || std::fs::read_link(format!("/proc/{pid}/exe"))
                    .is_ok_and(|p| p.to_string_lossy().contains("dsec-agent"))
        })
    }
}

/// SIGKILL to `pid`.
pub(super) fn kill9(pid: i32) -> bool {
    rustix::process::Pid::from_raw(pid)
        .is_some_and(|p| rustix::process::kill_process(p, rustix::process::Signal::KILL).is_ok())
}

/// A tmpfs of `size_mb` mounted on `dir` (the soak's data dir, so that it can be filled to
/// `ENOSPC` without touching the host's disks); unmounted when dropped.
pub(super) struct Tmpfs(PathBuf);

impl Tmpfs {
    pub(super) fn mount(dir: &Path, size_mb: u64) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let st = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o"])
            .arg(format!("size={size_mb}m,mode=0755"))
            .arg("tmpfs")
            .arg(dir)
            .status()
            .context("mount")?;
        anyhow::ensure!(st.success(), "mount a tmpfs on {}: {st}", dir.display());
        Ok(Self(dir.to_owned()))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

/// Writes `path` until its filesystem is full; answers the bytes written.
pub(super) fn fill(path: &Path) -> anyhow::Result<u64> {
    let mut f = std::fs::File::create(path)?;
    let chunk = vec![0xa5u8; 1 << 20];
    let mut written = 0u64;
    loop {
        match f.write(&chunk) {
            Ok(0) => break,
            Ok(n) => written += n as u64,
            Err(e) if e.raw_os_error() == Some(28) => break,
            Err(e) => return Err(e).context("fill the data dir"),
        }
    }
    // The last partial page or block too.
    for n in [4096usize, 512, 1] {
        while f.write(&chunk[..n]).map(|w| w > 0).unwrap_or(false) {
            written += n as u64;
        }
    }
    Ok(written)
}
