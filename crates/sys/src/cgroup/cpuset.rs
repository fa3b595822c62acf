//! A node's CPU partition on the cgroup v1 `cpuset` hierarchy: two cpusets, *quiet* (the node
//! and everything it starts) and *batch* (sandboxes that never sleep), whose CPUs the node
//! sets.
//!
//! Under `<root>/<base>/`: `n<pid>` (quiet) and `n<pid>b` (batch), `<pid>` the node's. A node
//! that exits dissolves them (their tasks go back to `<root>/<base>`); one that died leaves
//! them, and the next node to start [sweeps](CpuPartition::sweep) them, adopting their tasks.
//!
//! v1 only: on cgroup v2 the `cpuset` controller lives in the one hierarchy, per sandbox, and
//! the node does not partition (the batch class's `cpu.idle` still applies).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use super::group::{read_file, write_file};
use super::manager::read_mountinfo;
use super::CgroupError;

/// A node's two cpusets (see the module docs).
#[derive(Debug)]
pub struct CpuPartition {
    parent: PathBuf,
    quiet: PathBuf,
    batch: PathBuf,
    cpus: Vec<u32>,
}

impl CpuPartition {
    /// The mount point of the v1 `cpuset` hierarchy, if the host has one.
    pub fn v1_root() -> Option<PathBuf> {
        read_mountinfo()
            .ok()?
            .into_iter()
            .find(|m| m.fs_type == "cgroup" && m.has_super_option("cpuset"))
            .map(|m| m.mount_point)
    }

    /// Creates the cpusets of the node with process id `pid` under `<root>/<base>`, both over
    /// every CPU the parent has, and moves the process `pid` (all its threads) into the quiet
    /// one, where the processes it starts from now on inherit it.
    pub fn create(root: &Path, base: &str, pid: i32) -> Result<Self, CgroupError> {
        let parent = root.join(base);
        make_cpuset(root, &parent)?;
        let cpus = parse_cpu_list(read_file(&parent.join("cpuset.effective_cpus"))?.trim())
            .filter(|c| !c.is_empty())
            .ok_or_else(|| CgroupError::Parse {
                file: parent.join("cpuset.effective_cpus"),
                what: "a CPU list",
            })?;
        let p = Self {
            quiet: parent.join(format!("n{pid}")),
            batch: parent.join(format!("n{pid}b")),
            parent,
            cpus,
        };
        // Another node's sweep may remove an empty cpuset between its making and the move.
        let mut tries = 0;
        loop {
            make_cpuset(&p.parent, &p.quiet)?;
            make_cpuset(&p.parent, &p.batch)?;
            match write_file(&p.quiet.join("cgroup.procs"), &pid.to_string()) {
                Err(_) if tries < 3 => tries += 1,
                r => return r.map(|()| p),
            }
        }
    }

    /// The CPUs the node may use (its parent cpuset's), in order.
    pub fn cpus(&self) -> &[u32] {
        &self.cpus
    }

    /// Gives the quiet cpuset `quiet` and the batch one `batch` (neither empty; they may
    /// overlap).
    pub fn set(&self, quiet: &[u32], batch: &[u32]) -> Result<(), CgroupError> {
        write_file(&self.quiet.join("cpuset.cpus"), &format_cpu_list(quiet))?;
        write_file(&self.batch.join("cpuset.cpus"), &format_cpu_list(batch))
    }

    /// Moves thread `tid` to the batch cpuset (`true`) or back to the quiet one. A thread that
    /// is gone is not an error.
    pub fn place(&self, tid: i32, batch: bool) -> Result<(), CgroupError> {
        let to = if batch { &self.batch } else { &self.quiet };
        match write_file(&to.join("tasks"), &tid.to_string()) {
            Err(CgroupError::Write { source, .. })
                if source.raw_os_error() == Some(libc::ESRCH) =>
            {
                Ok(())
            }
            r => r,
        }
    }

    /// Removes the cpusets of nodes that are gone (`n<pid>` whose process is not in it):
    /// their tasks (sandboxes that outlived their node) move to `into`'s quiet cpuset.
    pub fn sweep(&self) {
        let Ok(entries) = fs::read_dir(&self.parent) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(pid) = name
                .strip_prefix('n')
                .map(|r| r.strip_suffix('b').unwrap_or(r))
                .and_then(|r| r.parse::<i32>().ok())
            else {
                continue;
            };
            let dir = e.path();
            if dir == self.quiet || dir == self.batch || owner_lives(&self.parent, pid) {
                continue;
            }
            empty_into(&dir, &self.quiet);
            if fs::remove_dir(&dir).is_err() {
                remove_later(&[&dir]);
            }
        }
    }
}

/// Dropping ends the partition: every task in either cpuset goes back to the parent (the node
/// itself too) and both are removed.
impl Drop for CpuPartition {
    fn drop(&mut self) {
        // A thread the node starts meanwhile, or a process still on its way out, keeps a
        // cpuset busy for a moment: a few rounds.
        for _ in 0..10 {
            for dir in [&self.batch, &self.quiet] {
                empty_into(dir, &self.parent);
                let _ = fs::remove_dir(dir);
            }
            if !self.batch.exists() && !self.quiet.exists() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        // Still busy (a process on its way out): removed once it empties.
        remove_later(&[&self.batch, &self.quiet]);
    }
}

/// Removes the cpusets `dirs` that still exist once they empty (a process on its way out keeps
/// one busy for a moment), from a detached helper that tries for up to 10 s; a node that starts
/// later sweeps what is left even so.
fn remove_later(dirs: &[&Path]) {
    let left: Vec<&Path> = dirs.iter().copied().filter(|d| d.exists()).collect();
    if left.is_empty() {
        return;
    }
    let script = "for i in $(seq 100); do rmdir \"$@\" 2>/dev/null; ok=1; \
                  for d in \"$@\"; do [ -d \"$d\" ] && ok=0; done; [ $ok = 1 ] && exit 0; \
                  sleep 0.1; done";
    let spawned = std::process::Command::new("/bin/sh")
        .arg("-c")
        .arg(script)
        .arg("dsec-cpuset-rmdir")
        .args(left)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn();
    // Reaped when it ends, while the node runs on (a sweep at start).
    if let Ok(mut child) = spawned {
        std::thread::spawn(move || {
            let _ = child.wait();
        });
    }
}

/// Whether node `pid` still runs in its quiet cpuset (a recycled pid runs elsewhere).
fn owner_lives(parent: &Path, pid: i32) -> bool {
    let Ok(procs) = fs::read_to_string(parent.join(format!("n{pid}")).join("cgroup.procs")) else {
        return false;
    };
    procs.lines().any(|l| l.trim() == pid.to_string())
}

/// Moves every task of cpuset `from` to cpuset `to`, a few rounds in case some fork meanwhile.
fn empty_into(from: &Path, to: &Path) {
    for _ in 0..5 {
        let Ok(tasks) = fs::read_to_string(from.join("tasks")) else {
            return;
        };
        if tasks.trim().is_empty() {
            return;
        }
        for t in tasks.lines() {
            let _ = write_file(&to.join("tasks"), t.trim());
        }
    }
}

/// Creates cpuset `dir` under `parent` (unless it exists) with the parent's CPUs and memory
/// nodes: a v1 cpuset starts with neither, and takes no task until it has both.
fn make_cpuset(parent: &Path, dir: &Path) -> Result<(), CgroupError> {
    match fs::create_dir(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(source) => {
            return Err(CgroupError::Create {
                path: dir.to_owned(),
                source,
            })
        }
    }
    for f in ["cpuset.cpus", "cpuset.mems"] {
        if read_file(&dir.join(f))?.trim().is_empty() {
            let v = read_file(&parent.join(f))?;
            write_file(&dir.join(f), v.trim())?;
        }
    }
    Ok(())
}

/// Parses a kernel CPU list (`0-3,6,8-9`); `None` when malformed.
pub fn parse_cpu_list(text: &str) -> Option<Vec<u32>> {
    let mut out = Vec::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (a.parse::<u32>().ok()?, b.parse::<u32>().ok()?);
                if b < a || b - a > 65_536 {
                    return None;
                }
                out.extend(a..=b);
            }
            None => out.push(part.parse().ok()?),
        }
    }
    Some(out)
}

/// Formats CPUs as a kernel CPU list (`0-3,6`).
pub fn format_cpu_list(cpus: &[u32]) -> String {
    let mut v = cpus.to_vec();
    v.sort_unstable();
    v.dedup();
    let mut parts = Vec::new();
    let mut i = 0;
    while i < v.len() {
        let mut j = i;
        while j + 1 < v.len() && v[j + 1] == v[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            v[i].to_string()
        } else {
            format!("{}-{}", v[i], v[j])
        });
        i = j + 1;
    }
    parts.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_and_format() {
        assert_eq!(parse_cpu_list("0-3,6,8-9"), Some(vec![0, 1, 2, 3, 6, 8, 9]));
        assert_eq!(parse_cpu_list("1"), Some(vec![1]));
        assert_eq!(parse_cpu_list(""), Some(vec![]));
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list("a"), None);
        assert_eq!(parse_cpu_list("0-4294967295"), None);
        assert_eq!(format_cpu_list(&[0, 1, 2, 3, 6, 8, 9]), "0-3,6,8-9");
        assert_eq!(format_cpu_list(&[5, 1]), "1,5");
        assert_eq!(format_cpu_list(&[]), "");
    }
}
