//! Starting the runtime: its directories, cgroups, templates and spawner, and cleaning up what
//! a sandbox leaves behind.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use dsec_sys::cgroup::CgroupManager;
use dsec_sys::ipc;

use super::container::{create, shim, spawner};
use super::vm::sandbox::VmSettings;
use super::{Runtime, RuntimeError};
use crate::capacity::NodeCapacity;
use crate::template::TemplateStore;

/// Where the runtime keeps its state and finds its binaries.
#[derive(Debug, Clone)]
pub struct RuntimeConfig {
    /// Persistent data (layers, templates).
    pub data_dir: PathBuf,
    /// Volatile runtime state (stage dir, supervisor sockets).
    pub run_dir: PathBuf,
    /// The `dsec-agent` binary.
    pub agent_bin: PathBuf,
    /// The `dsec-shim` binary.
    pub shim_bin: PathBuf,
}

impl RuntimeConfig {
    /// Defaults: `/var/lib/dsec`, `/run/dsec`, binaries next to the current executable (or in
    /// `DSEC_AGENT_BIN` / `DSEC_SHIM_BIN`).
    pub fn from_env() -> Result<Self, RuntimeError> {
        let data_dir = std::env::var_os("DSEC_DATA_DIR")
            .map_or_else(|| PathBuf::from("/var/lib/dsec"), PathBuf::from);
        let run_dir = std::env::var_os("DSEC_RUN_DIR")
            .map_or_else(|| PathBuf::from("/run/dsec"), PathBuf::from);
        Ok(Self {
            data_dir,
            run_dir,
            agent_bin: find_binary("dsec-agent", "DSEC_AGENT_BIN")?,
            shim_bin: find_binary("dsec-shim", "DSEC_SHIM_BIN")?,
        })
    }
}

/// Finds a companion binary: `$ENV`, then next to the current executable, then its parent
/// directory (cargo puts test binaries in `deps/`).
pub fn find_binary(name: &'static str, env: &str) -> Result<PathBuf, RuntimeError> {
    if let Some(p) = std::env::var_os(env) {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe().map_err(|e| RuntimeError::Prepare {
        path: "/proc/self/exe".into(),
        source: e,
    })?;
    let mut looked = Vec::new();
    let mut dir = exe.parent().map(Path::to_path_buf);
    for _ in 0..2 {
        let Some(d) = dir else { break };
        let cand = d.join(name);
        if cand.is_file() {
            return Ok(cand);
        }
        looked.push(d.display().to_string());
        dir = d.parent().map(Path::to_path_buf);
    }
    Err(RuntimeError::MissingBinary {
        name,
        looked: looked.join(", "),
    })
}

/// The first directory of `path` (or `path` itself) that others may not search, if any.
fn unsearchable_ancestor(path: &Path) -> Option<std::path::PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    path.ancestors()
        .filter(|a| !a.as_os_str().is_empty())
        .find(|a| std::fs::metadata(a).is_ok_and(|m| m.permissions().mode() & 0o001 == 0))
        .map(Path::to_path_buf)
}

fn prep_dir(path: &Path) -> Result<(), RuntimeError> {
    std::fs::create_dir_all(path).map_err(|source| RuntimeError::Prepare {
        path: path.to_path_buf(),
        source,
    })
}

impl Runtime {
    /// Prepares directories, cgroups and the host template, and starts the spawner.
    pub fn start(cfg: RuntimeConfig) -> Result<Self, RuntimeError> {
        ipc::raise_nofile_limit();
        prep_dir(&cfg.data_dir)?;
        prep_dir(&cfg.run_dir)?;
        let stage = cfg.run_dir.join("stage");
        prep_dir(&stage)?;
        prep_dir(&cfg.run_dir.join("sandboxes"))?;
        if let Some(dir) = unsearchable_ancestor(&stage) {
            // A sandbox's init, in its user namespace, mounts its placeholder root on the stage
            // as an unprivileged host id: every directory on the way must let others search it.
            tracing::warn!(
                dir = %dir.display(),
                "sandboxes with a user namespace (the default) cannot be made: this directory \
                 above the run dir's stage is not searchable by others (chmod o+x it)"
            );
        }
        let cgroups = CgroupManager::detect(shim::CGROUP_BASE).map_err(RuntimeError::Cgroup)?;
        let favordynmods = cgroups.favor_dynmods().unwrap_or(false);
        let capacity = NodeCapacity::detect().map_err(RuntimeError::Capacity)?;
        let templates =
            TemplateStore::open_with_hidden(&cfg.data_dir, std::slice::from_ref(&cfg.run_dir))
                .map_err(RuntimeError::Template)?;
        // The host template's mask layer cannot be used where it is built (under the data dir on
        // the host root filesystem): overlayfs refuses a lower layer nested inside another lower
        // layer (`/`) of the same filesystem. The spawner copies it onto a small tmpfs mounted in
        // its own private mount namespace, which every supervisor and sandbox inherits: no
        // mount in the host namespace, and it disappears with the last of them.
        let mask_src = templates
            .lowerdirs(&templates.host_template())
            .into_iter()
            .next()
            .ok_or_else(|| RuntimeError::Invalid("host template without a mask layer".into()))?;
        let mask_fs = cfg.run_dir.join("mask");
        prep_dir(&mask_fs)?;
        let host_mask = mask_fs.join(mask_src.file_name().unwrap_or_default());
        // The root most creates ask for: the default template with default limits. Idle shells
        // build it ahead of time; a create with anything else builds its own.
        let defaults = crate::sandbox::Limits::default();
        let likely = dsec_sys::launch::RootfsSpec {
            stage: stage.display().to_string(),
            lowerdirs: vec![host_mask.display().to_string(), "/".into()],
            disk_bytes: defaults.disk_bytes,
            disk_inodes: defaults.disk_inodes,
            shm_bytes: defaults.shm_bytes,
            writable_root: false,
            scratch: create::SCRATCH_DIRS
                .iter()
                .map(|s| (*s).to_string())
                .collect(),
            // Only the spawner knows it; not needed to build a root.
            empty_dir: None,
        };
        let spawner = Arc::new(spawner::start_spawner(
            &cfg, &likely, &mask_src, &host_mask,
        )?);
        let likely_root = likely.clone();
        let reader = Arc::clone(&spawner);
        std::thread::Builder::new()
            .name("dsec-spawner-rx".into())
            .spawn(move || spawner::spawner_reader(&reader))
            .map_err(RuntimeError::Spawner)?;
        Ok(Self {
            cfg,
            templates,
            cgroups,
            capacity,
            spawner,
            next_req: AtomicU64::new(1),
            stage,
            host_mask,
            host_mask_src: mask_src,
            likely: likely_root,
            favordynmods,
            vms: Mutex::new(None),
            vm_settings: Mutex::new(VmSettings::default()),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &RuntimeConfig {
        &self.cfg
    }

    /// The template store.
    pub fn templates(&self) -> &TemplateStore {
        &self.templates
    }

    /// The cgroup manager.
    pub fn cgroups(&self) -> &CgroupManager {
        &self.cgroups
    }

    /// What this node has: the bounds of a sandbox's limits.
    pub fn capacity(&self) -> &NodeCapacity {
        &self.capacity
    }

    /// Idle pre-built shells, for the likely root and for a preferred one, the node holds a
    /// request socket of (one descriptor each).
    pub fn idle_shells(&self) -> usize {
        let plain = self.spawner.shells.lock().map(|s| s.len()).unwrap_or(0);
        let preferred = self.spawner.preferred.lock().map(|s| s.len()).unwrap_or(0);
        plain + preferred
    }

    /// Whether cgroup attaches avoid the RCU grace period (`favordynmods`).
    pub fn favordynmods(&self) -> bool {
        self.favordynmods
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        // The spawner goes; running sandboxes (their supervisors) are unaffected, and idle
        // shells clean up when the node's ends of their request sockets close.
        self.spawner
            .stopping
            .store(true, std::sync::atomic::Ordering::SeqCst);
        if let Ok(mut c) = self.spawner.child.lock() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Runtime {
    /// Removes the cgroup and runtime directory of a sandbox whose supervisor is gone.
    /// Removes the cgroup and runtime directory of a sandbox whose supervisor is gone; returns
    /// whether nothing is left.
    pub fn cleanup_leftovers(&self, id: &str, run_dir: &Path) -> bool {
        if let Some(cg) = self.cgroups.open(id) {
            let _ = cg.kill_all();
            let _ = cg.remove();
        }
        let _ = std::fs::remove_dir_all(run_dir);
        self.cgroups.open(id).is_none() && !run_dir.exists()
    }

    /// A fresh request number for the spawner.
    pub(crate) fn new_req(&self) -> u64 {
        self.next_req.fetch_add(1, Ordering::Relaxed)
    }
}
