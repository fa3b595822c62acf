//! Idle shells: supervisors the spawner forks ahead of demand, each with a sandbox init already
//! cloned onto a placeholder root, waiting for the one create it will serve.

use std::os::fd::{AsFd, OwnedFd};

use dsec_sys::cgroup::CgroupLimits;
use dsec_sys::ipc;
use dsec_sys::launch;

use crate::ctx::{send, SpawnerCtx};
use crate::init::{discard, id_map, lease_ids, placeholder_init, Prebuilt, WARM_PATHS};
use crate::proto::{LaunchFailure, SpawnRequest, SupervisorMsg, MAX_MSG};
use crate::supervise::supervise;

/// Leases a host id range, clones an idle shell's init into a fresh cgroup in a user namespace
/// mapped onto that range, onto its placeholder root, and builds the likely root ahead of time.
fn prebuild(
    ctx: &SpawnerCtx,
    stage: &str,
    rootfs: Option<&launch::RootfsSpec>,
) -> Result<Prebuilt, LaunchFailure> {
    let ids = lease_ids()?;
    let name = format!("shell-{}", std::process::id());
    let cgroup = ctx.sandbox_cgroup(&name, &CgroupLimits::default())?;
    let mut reset_state = launch::ResetState::default();
    let map = id_map(&ids);
    match placeholder_init(ctx, stage, Some(map), &cgroup, &mut reset_state) {
        Ok(init) => {
            let tree = rootfs
                .or(ctx.likely_rootfs.as_ref())
                .and_then(|r| launch::build_root_tree(r, &mut reset_state, WARM_PATHS).ok());
            Ok(Prebuilt {
                cgroup,
                init,
                reset_state,
                tree,
                ids: Some(ids),
            })
        }
        Err(e) => {
            let _ = cgroup.kill_all();
            let _ = cgroup.remove();
            Err(e)
        }
    }
}

/// An idle supervisor: pre-builds a shell, then waits for the one request it will serve, sent
/// by the node on `requests` together with the socket to answer on.
/// `preferred`: the root to pre-build instead of the likely one (a snapshot's, see
/// `NodeMsg::Prefer`).
pub(crate) fn idle_supervisor(
    ctx: &SpawnerCtx,
    requests: OwnedFd,
    node_end: OwnedFd,
    preferred: Option<&launch::RootfsSpec>,
) -> i32 {
    ipc::default_sigchld();
    ipc::set_process_name("dsec-shell");
    let _ = ipc::setsid();
    // Building a shell is background work: it must not take CPU from sandboxes that are being
    // created or used right now.
    let _ = ipc::set_idle_priority(0, true);
    let Some(stage) = ctx.stage.as_deref() else {
        return 1;
    };
    let pre = match prebuild(ctx, stage, preferred) {
        Ok(pre) => pre,
        Err(f) => {
            // Tell the node, so that the spawner builds a replacement; not at once: whatever
            // failed (a stage others cannot search, a host without idmapped mounts) is likely
            // to fail again, and a tight loop of rebuilds would take the node's CPU.
            eprintln!("dsec-shell: pre-building a shell: {f}");
            std::thread::sleep(SHELL_RETRY_DELAY);
            let _ = send(ctx.node.as_fd(), &SupervisorMsg::ShellFailed, &[]);
            return 1;
        }
    };
    // Ready: hand the node our request socket.
    let init_pid = pre.init.pidfd.pid();
    let ready = match preferred {
        Some(r) => SupervisorMsg::PreferredReady {
            lowerdirs: r.lowerdirs.clone(),
            writable_root: r.writable_root,
            init_pid,
        },
        None => SupervisorMsg::ShellReady { init_pid },
    };
    if send(ctx.node.as_fd(), &ready, &[node_end.as_fd()]).is_err() {
        return discard(pre);
    }
    drop(node_end);
    let got = match ipc::recv_msg(requests.as_fd(), MAX_MSG) {
        Ok((buf, mut fds)) if !buf.is_empty() => serde_json::from_slice::<SpawnRequest>(&buf)
            .ok()
            .zip(fds.pop()),
        _ => None,
    };
    drop(requests);
    match got {
        Some((req, reply)) => {
            ipc::set_process_name("dsec-sup");
            let _ = ipc::set_idle_priority(0, false);
            // Every thread of the agent.
            let init = pre.init.pidfd.pid();
            let tasks = std::fs::read_dir(format!("/proc/{init}/task"))
                .into_iter()
                .flatten();
            for tid in tasks
                .flatten()
                .filter_map(|t| t.file_name().to_str()?.parse::<i32>().ok())
            {
                let _ = ipc::set_idle_priority(tid, false);
            }
            supervise(ctx, req, Some(pre), reply.as_fd())
        }
        // The node went away (or sent garbage): nothing was handed to us.
        None => discard(pre),
    }
}

/// How long a shell whose build failed waits before asking for its replacement.
const SHELL_RETRY_DELAY: std::time::Duration = std::time::Duration::from_secs(2);
