//! The spawner: the privileged process that forks each sandbox's supervisor (and keeps idle
//! pre-built shells), and the thread that reads its answers.

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::process::Child;
use std::sync::{mpsc, Mutex};

use dsec_shim::proto::{self, SupervisorMsg, MAX_MSG};
use dsec_sys::ipc;

use crate::substrate::{RuntimeConfig, RuntimeError};

/// A supervisor's answer and the descriptors it passed.
pub(crate) type Reply = (SupervisorMsg, Vec<OwnedFd>);

/// What a pre-built shell's root was built for: its lower directories and whether it is
/// writable.
pub(crate) type RootKey = (Vec<String>, bool);

/// An idle pre-built shell: the socket its one request goes to, and its init's pid (host pid
/// namespace; 0 when the spawner did not say).
pub(crate) type IdleShell = (OwnedFd, i32);

/// The node's end of the spawner: its socket, the creates waiting for an answer, the idle shells.
pub(crate) struct SpawnerLink {
    /// The socket to the spawner.
    pub(crate) sock: OwnedFd,
    /// Creates waiting for their answer, by request number.
    pub(crate) pending: Mutex<HashMap<u64, mpsc::SyncSender<Reply>>>,
    /// Idle pre-built shells, handed over by the spawner: their request sockets and inits.
    pub(crate) shells: Mutex<VecDeque<IdleShell>>,
    /// Idle shells whose root was built for a preferred root: its lower directories.
    pub(crate) preferred: Mutex<VecDeque<(RootKey, IdleShell)>>,
    /// The lower directories of the root the spawner was last asked to prefer.
    pub(crate) hint: Mutex<Option<RootKey>>,
    /// The spawner process.
    pub(crate) child: Mutex<Child>,
    /// Set when the node stops the spawner itself (its end is then no news).
    pub(crate) stopping: std::sync::atomic::AtomicBool,
}

pub(crate) fn start_spawner(
    cfg: &RuntimeConfig,
    likely: &dsec_sys::launch::RootfsSpec,
    mask_src: &Path,
    mask_dst: &Path,
) -> Result<SpawnerLink, RuntimeError> {
    let (ours, theirs) = ipc::seqpacket_pair().map_err(RuntimeError::Spawner)?;
    let mut cmd = std::process::Command::new(&cfg.shim_bin);
    cmd.arg("spawner")
        .env_clear()
        .env("DSEC_AGENT_BIN", &cfg.agent_bin)
        .env("DSEC_STAGE_DIR", cfg.run_dir.join("stage"))
        .env("DSEC_MASK_SRC", mask_src)
        .env("DSEC_MASK_DST", mask_dst)
        .env(
            "DSEC_SHELL_ROOTFS",
            serde_json::to_string(likely).map_err(|e| RuntimeError::Invalid(e.to_string()))?,
        )
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("GLIBC_TUNABLES", SPAWNER_MALLOC_TUNABLES)
        .stdin(std::process::Stdio::null());
    if let Some(n) = std::env::var_os("DSEC_SPAWNER_SHELLS") {
        cmd.env("DSEC_SPAWNER_SHELLS", n);
    }
    dsec_sys::proc::pass_fd3(&mut cmd, theirs);
    let child = cmd.spawn().map_err(RuntimeError::Spawner)?;
    Ok(SpawnerLink {
        sock: ours,
        pending: Mutex::new(HashMap::new()),
        shells: Mutex::new(VecDeque::new()),
        preferred: Mutex::new(VecDeque::new()),
        hint: Mutex::new(None),
        child: Mutex::new(child),
        stopping: std::sync::atomic::AtomicBool::new(false),
    })
}

/// The spawner's (and so every supervisor's) malloc runs without glibc's per-thread cache. A
/// supervisor lives as long as its sandbox, forked from the spawner: each heap page it writes
/// after the fork becomes its own copy, and the cache kept freed chunks apart, scattered over
/// pages that `malloc_trim` could then not give back. Without it a supervisor holds 55 KiB of
/// private memory instead of 78 (`smaps`, 1,000 idle sandboxes); its allocations are few and
/// off every hot path. Sandboxed processes never see the variable (their environment is built
/// from scratch).
pub const SPAWNER_MALLOC_TUNABLES: &str = "glibc.malloc.tcache_count=0";

pub(crate) fn spawner_reader(link: &SpawnerLink) {
    let mut buf = vec![0u8; MAX_MSG];
    loop {
        let (n, fds) = match ipc::recv_with_fds(link.sock.as_fd(), &mut buf) {
            Ok(r) => r,
            Err(_) => break,
        };
        if n == 0 {
            break;
        }
        let Ok(msg) = serde_json::from_slice::<SupervisorMsg>(&buf[..n]) else {
            continue;
        };
        match msg {
            SupervisorMsg::ShellReady { init_pid } => {
                if let (Some(fd), Ok(mut shells)) = (fds.into_iter().next(), link.shells.lock()) {
                    shells.push_back((fd, init_pid));
                }
                continue;
            }
            SupervisorMsg::PreferredReady {
                lowerdirs,
                writable_root,
                init_pid,
            } => {
                if let (Some(fd), Ok(mut shells)) = (fds.into_iter().next(), link.preferred.lock())
                {
                    shells.push_back(((lowerdirs, writable_root), (fd, init_pid)));
                }
                continue;
            }
            SupervisorMsg::ShellFailed => {
                // Let the spawner build a replacement.
                if let Ok(bytes) = serde_json::to_vec(&proto::NodeMsg::ShellTaken) {
                    let _ = ipc::send_with_fds(link.sock.as_fd(), &bytes, &[]);
                }
                continue;
            }
            _ => {}
        }
        let req = match &msg {
            SupervisorMsg::Launched { req, .. } | SupervisorMsg::Failed { req, .. } => *req,
            _ => continue,
        };
        let tx = link.pending.lock().ok().and_then(|mut p| p.remove(&req));
        if let Some(tx) = tx {
            let _ = tx.try_send((msg, fds));
        }
    }
    // Spawner gone: fail every waiter.
    if !link.stopping.load(std::sync::atomic::Ordering::SeqCst) {
        let status = link.child.lock().ok().map(|mut c| c.try_wait());
        tracing::error!(status = ?status, "the spawner's socket closed: creates that need it fail");
    }
    if let Ok(mut p) = link.pending.lock() {
        p.clear();
    }
}
