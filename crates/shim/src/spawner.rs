//! The spawner: the process the node starts once, which forks a supervisor for every create
//! and keeps idle shells ready.

use std::io;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use dsec_sys::cgroup::CgroupManager;
use dsec_sys::ipc;
use dsec_sys::launch::{self, Forked, RootfsSpec};
use dsec_sys::seccomp::Filter;

use crate::ctx::{send, SpawnerCtx};
use crate::failure::launch_failure;
use crate::proto::{NodeMsg, SupervisorMsg, MAX_MSG, PREFERRED_SHELLS};
use crate::shell::idle_supervisor;
use crate::supervise::supervise;
use crate::CGROUP_BASE;

/// The spawner: serves the node's socket on fd 3 until it closes.
pub(crate) fn run_spawner() -> io::Result<()> {
    ipc::set_process_name("dsec-spawner");
    // Supervisors are forks of this process and live as long as their sandboxes.
    ipc::single_malloc_arena();
    // The spawner exits when the node's socket closes (the node exited or died); supervisors,
    // its children, outlive it. (No parent-death signal: it would be tied to the node *thread*
    // that started the spawner, not to the node process.) As a subreaper that ignores SIGCHLD it
    // also reaps sandbox inits orphaned by a killed supervisor.
    ipc::set_child_subreaper()?;
    let node = dsec_sys::proc::take_inherited_fd(3).map_err(io::Error::other)?;
    let empty_dir = mount_host_mask()?;
    let agent_path = std::env::var_os("DSEC_AGENT_BIN")
        .map(PathBuf::from)
        .ok_or_else(|| io::Error::other("DSEC_AGENT_BIN is not set"))?;
    let bytes = std::fs::read(&agent_path)?;
    let agent_exe = launch::sealed_exe_memfd("dsec-agent", &bytes)?;
    // Every supervisor and sandbox init is forked from this process: keep its memory small so
    // that forks copy (and execs tear down) as few page tables as possible.
    drop(bytes);
    let cgroups = CgroupManager::detect(CGROUP_BASE).map_err(io::Error::other)?;
    let stage = std::env::var("DSEC_STAGE_DIR").ok();
    let likely_rootfs = std::env::var("DSEC_SHELL_ROOTFS")
        .ok()
        .and_then(|j| serde_json::from_str::<RootfsSpec>(&j).ok());
    let ctx = SpawnerCtx {
        node,
        agent_exe,
        seccomp: Filter::build(),
        cgroups,
        stage,
        empty_dir,
        likely_rootfs,
    };
    // Exited supervisors are reaped by the kernel.
    ipc::ignore_sigchld();
    let target: usize = std::env::var("DSEC_SPAWNER_SHELLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_SHELLS)
        .min(64)
        * usize::from(ctx.stage.is_some());
    // Idle shells handed to the node and not yet used. The node talks to a shell directly (one
    // process hop less on the create path) and tells us when it took one.
    let mut idle = 0usize;
    // When the next refill is due. A shell is replaced only a little after it was taken: building
    // one (a network namespace, mounts, an exec) right away would compete for the CPU with the
    // sandbox that was just created and its first commands, which measured as the largest cost
    // of a create + first exec on a 2-CPU node.
    let mut refill_at: Option<Instant> = None;
    // The root the node prefers some shells to have (a snapshot's creates come from), and how
    // many idle shells were built for one.
    let mut preferred: Option<RootfsSpec> = None;
    let mut preferred_idle = 0usize;
    let mut buf = vec![0u8; MAX_MSG];
    loop {
        if refill_at.is_none_or(|t| Instant::now() >= t) {
            refill_at = None;
            while idle < target {
                let (node_end, shell_end) = ipc::seqpacket_pair()?;
                let prefer = preferred
                    .as_ref()
                    .filter(|_| preferred_idle < PREFERRED_SHELLS.min(target / 2));
                match launch::fork_process() {
                    Ok(Forked::Child) => {
                        ipc::exit_now(idle_supervisor(&ctx, shell_end, node_end, prefer));
                    }
                    Ok(Forked::Parent(_)) => {
                        // The shell announces itself to the node once it is built (see
                        // `idle_supervisor`), so that no request waits for a build in progress.
                        drop(shell_end);
                        drop(node_end);
                        idle += 1;
                        preferred_idle += usize::from(prefer.is_some());
                    }
                    Err(e) => {
                        eprintln!("dsec-shim spawner: pre-building a shell: {e}");
                        break;
                    }
                }
            }
        }
        let wait = refill_at.map(|t| t.saturating_duration_since(Instant::now()));
        if !ipc::poll_readable(ctx.node.as_fd(), wait.unwrap_or(Duration::MAX))? {
            continue; // the refill is due
        }
        let (n, _fds) = ipc::recv_with_fds(ctx.node.as_fd(), &mut buf)?;
        if n == 0 {
            return Ok(()); // node went away; idle shells see EOF on their sockets and clean up
        }
        let req = match serde_json::from_slice::<NodeMsg>(&buf[..n]) {
            Ok(NodeMsg::Spawn(r)) => {
                // A create found no idle shell: demand is outrunning the shells, so waiting
                // for a quiet moment would only send more creates down the slow path.
                if idle < target && r.config.userns {
                    refill_at = Some(Instant::now());
                }
                *r
            }
            Ok(NodeMsg::ShellTaken) => {
                idle = idle.saturating_sub(1);
                refill_at.get_or_insert(Instant::now() + REFILL_DELAY);
                continue;
            }
            Ok(NodeMsg::PreferredTaken) => {
                idle = idle.saturating_sub(1);
                preferred_idle = preferred_idle.saturating_sub(1);
                refill_at.get_or_insert(Instant::now() + REFILL_DELAY);
                continue;
            }
            Ok(NodeMsg::Prefer { rootfs }) => {
                preferred = rootfs;
                continue;
            }
            Err(e) => {
                eprintln!("dsec-shim spawner: malformed request: {e}");
                continue;
            }
        };
        match launch::fork_process() {
            Ok(Forked::Child) => {
                let code = supervise(&ctx, req, None, ctx.node.as_fd());
                ipc::exit_now(code);
            }
            Ok(Forked::Parent(_)) => {}
            Err(e) => {
                let msg = SupervisorMsg::Failed {
                    req: req.req,
                    failure: launch_failure(&e),
                };
                send(ctx.node.as_fd(), &msg, &[])?;
            }
        }
    }
}

/// How long after a shell was taken its replacement is built.
const REFILL_DELAY: Duration = Duration::from_millis(15);

/// Idle shells the spawner keeps ready by default.
const DEFAULT_SHELLS: usize = 4;

/// Copies the host template's mask layer onto a tmpfs mounted in a private mount namespace of
/// the spawner (inherited by every supervisor and sandbox; nothing is mounted in the node's
/// namespace). See `Runtime::start`. Returns the empty directory made beside it on the
/// same tmpfs, which sandboxes bind read-only over their masked `/proc` directories.
fn mount_host_mask() -> io::Result<Option<String>> {
    // Always private: supervisors also stage reset roots in this namespace.
    launch::enter_private_mount_ns().map_err(io::Error::other)?;
    let (Some(src), Some(dst)) = (
        std::env::var_os("DSEC_MASK_SRC"),
        std::env::var_os("DSEC_MASK_DST"),
    ) else {
        return Ok(None);
    };
    let dst = PathBuf::from(dst);
    let fs = dst
        .parent()
        .ok_or_else(|| io::Error::other("mask destination has no parent"))?;
    launch::mount_tmpfs(fs, "size=1m,nr_inodes=4096,mode=0755")?;
    dsec_sys::layer::stage_layer(Path::new(&src), &dst).map_err(io::Error::other)?;
    let empty = fs.join(".empty");
    std::fs::create_dir(&empty)?;
    std::fs::set_permissions(&empty, std::os::unix::fs::PermissionsExt::from_mode(0o555))?;
    Ok(empty.to_str().map(str::to_owned))
}
