//! Idle shells: supervisors the spawner forks ahead of demand, each with a sandbox init already
//! cloned onto a placeholder root, waiting for the one create it will serve.

use std::os::fd::{AsFd, OwnedFd};

use dsec_sys::cgroup::{Cgroup, CgroupLimits};
use dsec_sys::idrange::{self, IdRangeLease};
use dsec_sys::ipc;
use dsec_sys::launch::{self, IdMap, Rlimit, RootfsSpec};

use crate::ctx::{send, SpawnerCtx};
use crate::failure::{cgroup_failure, launch_failure};
use crate::init::{agent_socket, libc_rlimit, Init, Prebuilt, AGENT_NOFILE, WARM_PATHS};
use crate::proto::{LaunchFailure, LaunchStep, SpawnRequest, SupervisorMsg, MAX_MSG};
use crate::supervise::supervise;

/// What an idle shell's init runs on: an empty writable root, the agent, a generic hostname.
fn placeholder_params(stage: &str, empty_dir: Option<String>) -> launch::LaunchParams {
    launch::LaunchParams {
        hostname: "dsec-shell".into(),
        rootfs: RootfsSpec {
            stage: stage.to_string(),
            lowerdirs: Vec::new(),
            disk_bytes: 1 << 20,
            disk_inodes: 1024,
            shm_bytes: 64 << 20,
            writable_root: true,
            scratch: Vec::new(),
            empty_dir,
        },
        rlimits: vec![
            Rlimit {
                resource: libc_rlimit::CORE,
                value: 0,
            },
            Rlimit {
                resource: libc_rlimit::NOFILE,
                value: AGENT_NOFILE,
            },
        ],
        argv: vec!["dsec-agent".into()],
        env: vec![(
            "PATH".into(),
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
        )],
    }
}

/// Clones a sandbox init into `cgroup` (in a user namespace mapped as `user`, if given) onto an
/// empty placeholder root, running the agent: an idle shell's, or the first step of a fresh
/// launch with a user namespace. `state` then builds roots for its namespace.
pub(crate) fn placeholder_init(
    ctx: &SpawnerCtx,
    stage: &str,
    user: Option<IdMap>,
    cgroup: &Cgroup,
    state: &mut launch::ResetState,
) -> Result<Init, LaunchFailure> {
    let (agent_host, agent_child) = agent_socket()?;
    let shell = launch::clone_shell(&launch::ShellResources {
        user,
        agent_exe: &ctx.agent_exe,
        agent_sock: &agent_child,
        seccomp: &ctx.seccomp,
    })
    .map_err(|e| launch_failure(&e))?;
    if let Err(e) = cgroup.attach(shell.pid()) {
        shell.discard();
        return Err(cgroup_failure(&e));
    }
    let launched = shell
        .launch(&placeholder_params(stage, ctx.empty_dir.clone()))
        .map_err(|e| launch_failure(&e))?;
    let init = Init::started(launched.pid, agent_host)?;
    // After the clone: the shell must not inherit what preparing does.
    let ready = state
        .prepare()
        .map_err(|e| launch_failure(&e))
        .and_then(|()| {
            let Some(map) = user else { return Ok(()) };
            let ns =
                launch::SandboxUser::of(init.pidfd.pid(), &map).map_err(|e| LaunchFailure {
                    message: format!("open the sandbox's user namespace: {e}"),
                    ..LaunchFailure::io(LaunchStep::IdMap, &e)
                })?;
            state.set_user(ns);
            Ok(())
        });
    match ready {
        Ok(()) => Ok(init),
        Err(e) => {
            let _ = init.pidfd.signal(9);
            let _ = ipc::wait_pid(init.pidfd.pid());
            Err(e)
        }
    }
}

/// Leases a host id range, clones an idle shell's init into a fresh cgroup in a user namespace
/// mapped onto that range, onto its placeholder root, and builds the likely root ahead of time.
fn prebuild(ctx: &SpawnerCtx, stage: &str) -> Result<Prebuilt, LaunchFailure> {
    let ids = lease_ids()?;
    let name = format!("shell-{}", std::process::id());
    let cgroup = ctx.sandbox_cgroup(&name, &CgroupLimits::default())?;
    let mut reset_state = launch::ResetState::default();
    let map = id_map(&ids);
    match placeholder_init(ctx, stage, Some(map), &cgroup, &mut reset_state) {
        Ok(init) => {
            let tree = ctx
                .likely_rootfs
                .as_ref()
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

/// Leases a host id range of this process's own (see [`IdRangeLease`]).
pub(crate) fn lease_ids() -> Result<IdRangeLease, LaunchFailure> {
    IdRangeLease::acquire().map_err(|e| LaunchFailure {
        message: format!("lease a user-namespace id range: {e}"),
        ..LaunchFailure::io(LaunchStep::IdMap, &e)
    })
}

/// The user-namespace mapping onto the range `ids`: ids 0.. inside are its ids.
pub(crate) fn id_map(ids: &IdRangeLease) -> IdMap {
    IdMap {
        host_uid: ids.first_id(),
        host_gid: ids.first_id(),
        count: idrange::SPAN,
    }
}

/// An idle supervisor: pre-builds a shell, then waits for the one request it will serve, sent
/// by the node on `requests` together with the socket to answer on.
pub(crate) fn idle_supervisor(ctx: &SpawnerCtx, requests: OwnedFd, node_end: OwnedFd) -> i32 {
    ipc::default_sigchld();
    ipc::set_process_name("dsec-shell");
    let _ = ipc::setsid();
    // Building a shell is background work: it must not take CPU from sandboxes that are being
    // created or used right now.
    let _ = ipc::set_idle_priority(0, true);
    let Some(stage) = ctx.stage.as_deref() else {
        return 1;
    };
    let pre = match prebuild(ctx, stage) {
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
    if send(
        ctx.node.as_fd(),
        &SupervisorMsg::ShellReady,
        &[node_end.as_fd()],
    )
    .is_err()
    {
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

/// Kills a pre-built shell nobody took and removes its cgroup.
pub(crate) fn discard(pre: Prebuilt) -> i32 {
    let _ = pre.init.pidfd.signal(9);
    let _ = ipc::wait_pid(pre.init.pidfd.pid());
    let _ = pre.cgroup.kill_all();
    let _ = pre.cgroup.remove();
    0
}
