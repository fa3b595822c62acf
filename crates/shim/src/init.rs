//! One sandbox init as its supervisor sees it: launching it (directly, or on a placeholder root
//! in a user namespace on a leased id range), its container spec, and what a
//! supervisor does to it from outside (clearing its IPC namespace, killing everything else).

use std::io;
use std::os::fd::OwnedFd;
use std::path::Path;
use std::time::Duration;

use dsec_sys::cgroup::Cgroup;
use dsec_sys::idrange::{self, IdRangeLease};
use dsec_sys::ipc::{self, PidFd};
use dsec_sys::launch::{self, ContainerSpec, IdMap, NamespaceSpec, Rlimit, RootfsSpec};

use crate::ctx::SpawnerCtx;
use crate::failure::{cgroup_failure, launch_failure};
use crate::proto::{LaunchConfig, LaunchFailure, LaunchStep};

/// One running sandbox init, seen from its supervisor.
pub(crate) struct Init {
    pub(crate) pidfd: PidFd,
    pub(crate) agent_host: OwnedFd,
    /// The init's IPC namespace, opened at its first in-place reset.
    pub(crate) ipc: Option<launch::IpcNamespace>,
}

/// Empties the IPC namespace of `init` (System V objects, POSIX message queues) for an
/// in-place reset: they outlive the processes that made them. False when that failed: the
/// caller then relaunches the init in fresh namespaces instead.
pub(crate) fn clear_ipc(init: &mut Init, state: &mut launch::ResetState) -> bool {
    let ns = match &mut init.ipc {
        Some(ns) => ns,
        None => match launch::IpcNamespace::open(&init.pidfd, state) {
            Ok(ns) => init.ipc.insert(ns),
            Err(_) => return false,
        },
    };
    ns.clear(&init.pidfd, state).is_ok()
}

/// The container spec of `cfg`'s sandbox, its agent talking on `agent_sock`.
pub(crate) fn container_spec<'a>(
    ctx: &'a SpawnerCtx,
    cfg: &LaunchConfig,
    agent_sock: &'a OwnedFd,
) -> ContainerSpec<'a> {
    let l = &cfg.limits;
    ContainerSpec {
        ns: NamespaceSpec {
            user: cfg.ids.map(|(uid, gid, count)| IdMap {
                host_uid: uid,
                host_gid: gid,
                count,
            }),
            hostname: cfg.id.chars().take(63).collect(),
        },
        rootfs: RootfsSpec {
            stage: cfg.stage.clone(),
            lowerdirs: cfg.lowerdirs.clone(),
            disk_bytes: l.disk_bytes,
            disk_inodes: l.disk_inodes,
            shm_bytes: l.shm_bytes,
            writable_root: cfg.writable_root,
            scratch: cfg.scratch.clone(),
            empty_dir: ctx.empty_dir.clone(),
        },
        rlimits: vec![
            Rlimit {
                resource: libc_rlimit::CORE,
                value: 0,
            },
            Rlimit {
                resource: libc_rlimit::FSIZE,
                value: l.file_size_max,
            },
            // The agent needs descriptors for every command's pipes; commands get the sandbox's
            // own limits from the agent (`Configure`).
            Rlimit {
                resource: libc_rlimit::NOFILE,
                value: l.open_files_max.max(AGENT_NOFILE),
            },
        ],
        agent_exe: &ctx.agent_exe,
        agent_sock,
        argv: vec!["dsec-agent".into()],
        env: cfg.env.clone(),
        seccomp: &ctx.seccomp,
    }
}

/// A memory bomb inside the sandbox must kill the bomb, never the agent: the agent's commands
/// raise their own OOM score to the maximum (see the agent's exec set-up), and where this process
/// holds CAP_SYS_RESOURCE the agent is exempted outright (best effort: some hosts withhold it).
fn protect_from_oom(pid: i32) {
    let _ = std::fs::write(format!("/proc/{pid}/oom_score_adj"), "-1000");
}

/// The socket pair between the supervisor (first) and the agent (second).
pub(crate) fn agent_socket() -> Result<(OwnedFd, OwnedFd), LaunchFailure> {
    ipc::stream_pair().map_err(|e| LaunchFailure {
        message: format!("socketpair: {e}"),
        ..LaunchFailure::io(LaunchStep::Sockets, &e)
    })
}

/// A pidfd on the sandbox init `pid`.
fn open_pidfd(pid: i32) -> Result<PidFd, LaunchFailure> {
    PidFd::open(pid).map_err(|e| LaunchFailure {
        message: format!("pidfd_open: {e}"),
        ..LaunchFailure::io(LaunchStep::Pidfd, &e)
    })
}

/// Starts a fresh sandbox init for `cfg` in `cgroup`: cloned directly onto its root or, with a
/// user namespace, onto a placeholder root and then pivoted onto its root, built with the
/// template's layers idmapped into the namespace (which only a process outside it can do).
/// Returns the init and, in the second case, the placeholder root to release.
pub(crate) fn fresh_init(
    ctx: &SpawnerCtx,
    cfg: &LaunchConfig,
    cgroup: &Cgroup,
    state: &mut launch::ResetState,
) -> Result<(Init, Option<OwnedFd>), LaunchFailure> {
    let Some((uid, gid, count)) = cfg.ids else {
        return launch_init(ctx, cfg, cgroup).map(|i| (i, None));
    };
    let map = IdMap {
        host_uid: uid,
        host_gid: gid,
        count,
    };
    let init = placeholder_init(ctx, &cfg.stage, Some(map), cgroup, state)?;
    match pivot_onto_root(ctx, cfg, &init, None, state) {
        Ok(old) => Ok((init, Some(old))),
        Err(f) => {
            let _ = init.pidfd.signal(9);
            let _ = ipc::wait_pid(init.pidfd.pid());
            Err(f)
        }
    }
}

/// Pivots `init`, running on a placeholder or an old root, onto `cfg`'s root (`tree` if it was
/// built for it, else one built now) and gives it the sandbox's hostname. Returns the old root.
pub(crate) fn pivot_onto_root(
    ctx: &SpawnerCtx,
    cfg: &LaunchConfig,
    init: &Init,
    tree: Option<launch::RootTree>,
    state: &mut launch::ResetState,
) -> Result<OwnedFd, LaunchFailure> {
    let spec = container_spec(ctx, cfg, &init.agent_host);
    let pivoted = match tree.filter(|t| t.matches(&spec.rootfs, state)) {
        Some(tree) => launch::enter_root_tree(tree, &init.pidfd, state),
        None => launch::reset_in_place(&spec, &init.pidfd, state),
    };
    let old = pivoted.map_err(|e| pivot_failure(&e))?;
    launch::set_hostname_of(init.pidfd.pid(), &spec.ns.hostname).map_err(|e| launch_failure(&e))?;
    Ok(old)
}

/// A failed pivot of an init: at the step it names, or the pivot itself.
fn pivot_failure(e: &launch::LaunchError) -> LaunchFailure {
    let f = launch_failure(e);
    match e {
        launch::LaunchError::ChildSetup { .. } | launch::LaunchError::Create { .. } => f,
        _ => LaunchFailure {
            step: LaunchStep::Pivot,
            ..f
        },
    }
}

/// Clones a sandbox init for `cfg` into `cgroup`, running the agent.
fn launch_init(
    ctx: &SpawnerCtx,
    cfg: &LaunchConfig,
    cgroup: &Cgroup,
) -> Result<Init, LaunchFailure> {
    let (agent_host, agent_child) = agent_socket()?;
    let spec = container_spec(ctx, cfg, &agent_child);
    let launched =
        launch::spawn_container(&spec, |pid| cgroup.attach(pid).map_err(io::Error::other))
            .map_err(|e| launch_failure(&e))?;
    drop(agent_child);
    Init::started(launched.pid, agent_host)
}

impl Init {
    /// The init `pid` has exec'd the agent, which talks on `agent_host`: shield the agent from
    /// the OOM killer and hold the init by a pidfd.
    pub(crate) fn started(pid: i32, agent_host: OwnedFd) -> Result<Init, LaunchFailure> {
        protect_from_oom(pid);
        Ok(Init {
            pidfd: open_pidfd(pid)?,
            agent_host,
            ipc: None,
        })
    }
}

/// Open-files limit of the agent itself.
pub(crate) const AGENT_NOFILE: u64 = 4096;

pub(crate) mod libc_rlimit {
    pub const CORE: u32 = 4;
    pub const FSIZE: u32 = 1;
    pub const NOFILE: u32 = 7;
}

/// A sandbox init already cloned into its namespaces, attached to a cgroup and running the agent
/// on an empty placeholder root, waiting in an idle supervisor for a request. Assigning it a
/// template is an in-place reset onto that template's root.
pub(crate) struct Prebuilt {
    pub(crate) cgroup: Cgroup,
    pub(crate) init: Init,
    pub(crate) reset_state: launch::ResetState,
    /// The likely root, already built.
    pub(crate) tree: Option<launch::RootTree>,
    /// The host id range its user namespace maps onto, held for the sandbox's life.
    pub(crate) ids: Option<dsec_sys::idrange::IdRangeLease>,
}

/// Paths looked up once in a pre-built root, so that a sandbox's first commands find them cached
/// (the interpreter, the shell, the dynamic loader and libc of common images).
pub(crate) const WARM_PATHS: &[&str] = &[
    "/bin/sh",
    "/bin/true",
    "/usr/bin/env",
    "/usr/bin/python3",
    "/lib64/ld-linux-x86-64.so.2",
    "/etc/ld.so.cache",
    "/lib/x86_64-linux-gnu/libc.so.6",
    "/usr/lib/x86_64-linux-gnu/libc.so.6",
];

/// Kills every process of the sandbox's cgroup except its init, through pidfds (no pid reuse
/// race), until the cgroup lists only the init; false when that does not happen in time (a
/// fork bomb outrunning the kills is bounded by pids.max, so this converges).
pub(crate) fn kill_all_but_init(cgroup: &Cgroup, init: i32) -> bool {
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    loop {
        let Ok(pids) = cgroup.pids() else {
            return false;
        };
        let others: Vec<i32> = pids.into_iter().filter(|&p| p != init).collect();
        if others.is_empty() {
            return true;
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        for pid in others {
            if let Ok(fd) = PidFd::open(pid) {
                let _ = fd.signal(9);
            }
        }
        std::thread::sleep(Duration::from_micros(100));
    }
}

/// Kills what is left in `cgroup` and removes the sandbox's runtime directory.
pub(crate) fn cleanup(cgroup: &Cgroup, run_dir: &Path) {
    let _ = cgroup.kill_all();
    let _ = std::fs::remove_dir_all(run_dir);
}

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

/// Kills a pre-built shell nobody took and removes its cgroup.
pub(crate) fn discard(pre: Prebuilt) -> i32 {
    let _ = pre.init.pidfd.signal(9);
    let _ = ipc::wait_pid(pre.init.pidfd.pid());
    let _ = pre.cgroup.kill_all();
    let _ = pre.cgroup.remove();
    0
}
