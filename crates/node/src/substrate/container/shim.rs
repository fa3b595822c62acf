//! `dsec-shim`: the spawner and the per-sandbox supervisors.
//!
//! The node starts one spawner (`dsec-shim spawner`, a fresh single-threaded process) and talks
//! to it over a `SOCK_SEQPACKET` socket on fd 3. For each [`SpawnRequest`] the spawner `fork`s a
//! supervisor, which:
//! 1. detaches (`setsid`) so it outlives the node and the spawner,
//! 2. creates the sandbox cgroup and clones the sandbox init into new namespaces
//!    ([`dsec_sys::launch::spawn_container`]), which execs `dsec-agent` from a sealed memfd,
//! 3. answers the node with the agent socket and its own control socket, and listens on
//!    `<run_dir>/sup.sock` so that a restarted node can reconnect,
//! 4. serves `Reset`/`Destroy` on the control socket and watches the init with a pidfd.
//!
//! The sandbox init has `PR_SET_PDEATHSIG = SIGKILL` tied to its supervisor: killing a
//! supervisor kills the whole sandbox (its pid namespace dies with its init).

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use dsec_sys::cgroup::{Cgroup, CgroupLimits, CgroupManager};
use dsec_sys::ipc::{self, PidFd};
use dsec_sys::launch::{self, ContainerSpec, Forked, IdMap, NamespaceSpec, Rlimit, RootfsSpec};
use dsec_sys::seccomp::Filter;

use super::proto::{ControlMsg, LaunchConfig, NodeMsg, SpawnRequest, SupervisorMsg, MAX_MSG};

/// Name of the cgroup base directory under each hierarchy.
pub const CGROUP_BASE: &str = "dsec";

/// Entry point of `dsec-shim`. Returns the process exit code.
pub fn main(args: &[String]) -> i32 {
    match args.get(1).map(String::as_str) {
        Some("spawner") => match run_spawner() {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("dsec-shim spawner: {e}");
                1
            }
        },
        _ => {
            eprintln!(
                "usage: dsec-shim spawner   (started by the dsec node, fd 3 = control socket)"
            );
            2
        }
    }
}

/// State shared by the spawner and inherited by every supervisor it forks.
struct SpawnerCtx {
    node: OwnedFd,
    agent_exe: OwnedFd,
    seccomp: Filter,
    cgroups: CgroupManager,
    /// The node's stage directory (where every sandbox mounts its private tmpfs).
    stage: Option<String>,
    /// An empty directory on the spawner's mask tmpfs, bound read-only over masked `/proc`
    /// directories (see [`RootfsSpec::empty_dir`]).
    empty_dir: Option<String>,
    /// The root most creates ask for (the default template with default limits): idle shells
    /// build it ahead of time.
    likely_rootfs: Option<RootfsSpec>,
}

fn run_spawner() -> io::Result<()> {
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
    let mut buf = vec![0u8; MAX_MSG];
    loop {
        if refill_at.is_none_or(|t| Instant::now() >= t) {
            refill_at = None;
            while idle < target {
                let (node_end, shell_end) = ipc::seqpacket_pair()?;
                match launch::fork_process() {
                    Ok(Forked::Child) => {
                        ipc::exit_now(idle_supervisor(&ctx, shell_end, node_end));
                    }
                    Ok(Forked::Parent(_)) => {
                        // The shell announces itself to the node once it is built (see
                        // `idle_supervisor`), so that no request waits for a build in progress.
                        drop(shell_end);
                        drop(node_end);
                        idle += 1;
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
                if idle < target && r.config.userns.is_none() {
                    refill_at = Some(Instant::now());
                }
                *r
            }
            Ok(NodeMsg::ShellTaken) => {
                idle = idle.saturating_sub(1);
                refill_at.get_or_insert(Instant::now() + REFILL_DELAY);
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
                    message: format!("{e}"),
                };
                send(ctx.node.as_fd(), &msg, &[])?;
            }
        }
    }
}

/// How long after a reset or an activation the old root is released.
const RELEASE_DELAY: Duration = Duration::from_millis(20);

/// How long after an in-place reset the root of the next one is built: after the old root is
/// released, so that neither competes with the sandbox's first commands on its fresh root.
const SPARE_DELAY: Duration = Duration::from_millis(30);

/// How long after a shell was taken its replacement is built.
const REFILL_DELAY: Duration = Duration::from_millis(15);

/// Idle shells the spawner keeps ready by default.
const DEFAULT_SHELLS: usize = 4;

/// A sandbox init already cloned into its namespaces, attached to a cgroup and running the agent
/// on an empty placeholder root, waiting in an idle supervisor for a request. Assigning it a
/// template is an in-place reset onto that template's root.
struct Prebuilt {
    cgroup: Cgroup,
    init: Init,
    reset_state: launch::ResetState,
    /// The likely root, already built.
    tree: Option<launch::RootTree>,
}

/// Paths looked up once in a pre-built root, so that a sandbox's first commands find them cached
/// (the interpreter, the shell, the dynamic loader and libc of common images).
const WARM_PATHS: &[&str] = &[
    "/bin/sh",
    "/bin/true",
    "/usr/bin/env",
    "/usr/bin/python3",
    "/lib64/ld-linux-x86-64.so.2",
    "/etc/ld.so.cache",
    "/lib/x86_64-linux-gnu/libc.so.6",
    "/usr/lib/x86_64-linux-gnu/libc.so.6",
];

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

fn prebuild(ctx: &SpawnerCtx, stage: &str) -> Result<Prebuilt, String> {
    let name = format!("shell-{}", std::process::id());
    let cgroup = ctx
        .cgroups
        .create(&name, &CgroupLimits::default())
        .map_err(|e| error_chain(&e))?;
    let built = (|| {
        let (agent_host, agent_child) =
            ipc::stream_pair().map_err(|e| format!("socketpair: {e}"))?;
        let shell = launch::clone_shell(&launch::ShellResources {
            user: None,
            agent_exe: &ctx.agent_exe,
            agent_sock: &agent_child,
            seccomp: &ctx.seccomp,
        })
        .map_err(|e| error_chain(&e))?;
        if let Err(e) = cgroup.attach(shell.pid()) {
            shell.discard();
            return Err(error_chain(&e));
        }
        let launched = shell
            .launch(&placeholder_params(stage, ctx.empty_dir.clone()))
            .map_err(|e| error_chain(&e))?;
        protect_from_oom(launched.pid);
        let pidfd = PidFd::open(launched.pid).map_err(|e| format!("pidfd_open: {e}"))?;
        Ok(Init {
            pidfd,
            agent_host,
            ipc: None,
        })
    })();
    match built {
        Ok(init) => {
            // Enter the private mount namespace that resets stage their roots in now, off the
            // request path. (After the clone: the shell must not inherit it.)
            let mut reset_state = launch::ResetState::default();
            if let Err(e) = reset_state.prepare() {
                let _ = init.pidfd.signal(9);
                let _ = cgroup.kill_all();
                let _ = cgroup.remove();
                return Err(error_chain(&e));
            }
            let tree = ctx
                .likely_rootfs
                .as_ref()
                .and_then(|r| launch::build_root_tree(r, &mut reset_state, WARM_PATHS).ok());
            Ok(Prebuilt {
                cgroup,
                init,
                reset_state,
                tree,
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
fn idle_supervisor(ctx: &SpawnerCtx, requests: OwnedFd, node_end: OwnedFd) -> i32 {
    ipc::default_sigchld();
    ipc::set_process_name("dsec-shell");
    let _ = ipc::setsid();
    // Building a shell is background work: it must not take CPU from sandboxes that are being
    // created or used right now.
    let _ = ipc::set_idle_priority(0, true);
    let Some(stage) = ctx.stage.as_deref() else {
        return 1;
    };
    let Ok(pre) = prebuild(ctx, stage) else {
        // Tell the node, so that the spawner builds a replacement.
        let _ = send(ctx.node.as_fd(), &SupervisorMsg::ShellFailed, &[]);
        return 1;
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

fn discard(pre: Prebuilt) -> i32 {
    let _ = pre.init.pidfd.signal(9);
    let _ = ipc::wait_pid(pre.init.pidfd.pid());
    let _ = pre.cgroup.kill_all();
    let _ = pre.cgroup.remove();
    0
}

/// Copies the host template's mask layer onto a tmpfs mounted in a private mount namespace of
/// the spawner (inherited by every supervisor and sandbox; nothing is mounted in the node's
/// namespace). See `ContainerRuntime::start`. Returns the empty directory made beside it on the
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
    crate::template::stage_layer(Path::new(&src), &dst).map_err(io::Error::other)?;
    let empty = fs.join(".empty");
    std::fs::create_dir(&empty)?;
    std::fs::set_permissions(&empty, std::os::unix::fs::PermissionsExt::from_mode(0o555))?;
    Ok(empty.to_str().map(str::to_owned))
}

fn send(sock: BorrowedFd<'_>, msg: &SupervisorMsg, fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    let bytes = serde_json::to_vec(msg).map_err(io::Error::other)?;
    ipc::send_with_fds(sock, &bytes, fds)
}

/// One running sandbox init, seen from its supervisor.
struct Init {
    pidfd: PidFd,
    agent_host: OwnedFd,
    /// The init's IPC namespace, opened at its first in-place reset.
    ipc: Option<launch::IpcNamespace>,
}

/// Empties the IPC namespace of `init` (System V objects, POSIX message queues) for an
/// in-place reset: they outlive the processes that made them. False when that failed: the
/// caller then relaunches the init in fresh namespaces instead.
fn clear_ipc(init: &mut Init, state: &mut launch::ResetState) -> bool {
    let ns = match &mut init.ipc {
        Some(ns) => ns,
        None => match launch::IpcNamespace::open(&init.pidfd, state) {
            Ok(ns) => init.ipc.insert(ns),
            Err(_) => return false,
        },
    };
    ns.clear(&init.pidfd, state).is_ok()
}

fn container_spec<'a>(
    ctx: &'a SpawnerCtx,
    cfg: &LaunchConfig,
    agent_sock: &'a OwnedFd,
) -> ContainerSpec<'a> {
    let l = &cfg.limits;
    ContainerSpec {
        ns: NamespaceSpec {
            user: cfg.userns.map(|(uid, gid, count)| IdMap {
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
        ]
        .into_iter()
        // In a user namespace the kernel applies RLIMIT_NPROC, before a fork copies anything;
        // the agent and every command inherit it (uid 0 of the initial namespace is exempt).
        .chain(cfg.userns.map(|_| Rlimit {
            resource: libc_rlimit::NPROC,
            value: l.nproc(),
        }))
        .collect(),
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

fn launch_init(ctx: &SpawnerCtx, cfg: &LaunchConfig, cgroup: &Cgroup) -> Result<Init, String> {
    let (agent_host, agent_child) = ipc::stream_pair().map_err(|e| format!("socketpair: {e}"))?;
    let spec = container_spec(ctx, cfg, &agent_child);
    let launched =
        launch::spawn_container(&spec, |pid| cgroup.attach(pid).map_err(io::Error::other))
            .map_err(|e| error_chain(&e))?;
    drop(agent_child);
    protect_from_oom(launched.pid);
    let pidfd = PidFd::open(launched.pid).map_err(|e| format!("pidfd_open: {e}"))?;
    Ok(Init {
        pidfd,
        agent_host,
        ipc: None,
    })
}

/// Open-files limit of the agent itself.
const AGENT_NOFILE: u64 = 4096;

mod libc_rlimit {
    pub const CORE: u32 = 4;
    pub const FSIZE: u32 = 1;
    pub const NOFILE: u32 = 7;
    pub const NPROC: u32 = 6;
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

fn supervise(
    ctx: &SpawnerCtx,
    req: SpawnRequest,
    pre: Option<Prebuilt>,
    reply: BorrowedFd<'_>,
) -> i32 {
    ipc::default_sigchld();
    ipc::set_process_name("dsec-sup");
    let _ = ipc::setsid();
    let mut cfg = req.config;
    let fail = |message: String| {
        let _ = send(
            reply,
            &SupervisorMsg::Failed {
                req: req.req,
                message,
            },
            &[],
        );
        1
    };
    let run_dir = PathBuf::from(&cfg.run_dir);
    if let Err(e) = std::fs::create_dir_all(&run_dir) {
        return fail(format!("create {}: {e}", run_dir.display()));
    }
    if cfg.userns.is_some() && cfg.lowerdirs.iter().any(|l| l == "/") {
        let hostroot = Path::new(&cfg.stage).with_file_name("hostroot");
        if let Err(e) = launch::private_root_bind(&hostroot) {
            let _ = std::fs::remove_dir_all(&run_dir);
            return fail(format!("bind host root for a user namespace: {e}"));
        }
        let h = hostroot.display().to_string();
        for l in cfg.lowerdirs.iter_mut().filter(|l| *l == "/") {
            l.clone_from(&h);
        }
    }
    let t0 = std::time::Instant::now();
    let pre = pre.filter(|_| cfg.userns.is_none());
    let mut reset_state = launch::ResetState::default();
    let mut likely_tree = None;
    let (cgroup, pre) = match pre {
        // A pre-built shell: give its cgroup the sandbox's name and limits.
        Some(Prebuilt {
            cgroup,
            init,
            reset_state: prepared,
            tree,
        }) => {
            reset_state = prepared;
            likely_tree = tree;
            let shell_cgroup = cgroup.name().to_owned();
            let renamed = ctx.cgroups.rename(cgroup, &cfg.id).and_then(|c| {
                c.set_limits(&cfg.limits.cgroup_limits())?;
                Ok(c)
            });
            match renamed {
                Ok(c) => (c, Some(init)),
                Err(e) => {
                    let _ = init.pidfd.signal(9);
                    // The rename may have moved some hierarchies' directories and not others:
                    // remove the cgroup under both names, in every hierarchy.
                    for name in [shell_cgroup.as_str(), cfg.id.as_str()] {
                        if let Some(cg) = ctx.cgroups.open(name) {
                            let _ = cg.kill_all();
                            let _ = cg.remove();
                        }
                    }
                    let _ = std::fs::remove_dir_all(&run_dir);
                    return fail(error_chain(&e));
                }
            }
        }
        None => match ctx.cgroups.create(&cfg.id, &cfg.limits.cgroup_limits()) {
            Ok(c) => (c, None),
            Err(e) => {
                let _ = std::fs::remove_dir_all(&run_dir);
                return fail(error_chain(&e));
            }
        },
    };
    let cgroup_us = t0.elapsed().as_micros() as u64;
    let mut old_placeholder = None;
    let launched = match pre {
        Some(init) => {
            // Pivot the running shell onto the template's root and give it its identity.
            let spec = container_spec(ctx, &cfg, &init.agent_host);
            let pivoted = match likely_tree.take().filter(|t| t.matches(&spec.rootfs)) {
                Some(tree) => launch::enter_root_tree(tree, &init.pidfd, &mut reset_state),
                None => launch::reset_in_place(&spec, &init.pidfd, &mut reset_state),
            };
            pivoted
                .and_then(|old| {
                    old_placeholder = Some(old);
                    launch::set_hostname_of(init.pidfd.pid(), &spec.ns.hostname)
                })
                .map_err(|e| error_chain(&e))
                .map(|()| init)
        }
        None => launch_init(ctx, &cfg, &cgroup),
    };
    let mut init = match launched {
        Ok(i) => i,
        Err(e) => {
            cleanup(&cgroup, &run_dir);
            let _ = cgroup.remove();
            return fail(e);
        }
    };
    let listener = UnixListener::bind(run_dir.join("sup.sock")).ok();
    let (control_node, control) = match ipc::seqpacket_pair() {
        Ok(p) => p,
        Err(e) => {
            let _ = init.pidfd.signal(9);
            cleanup(&cgroup, &run_dir);
            let _ = cgroup.remove();
            return fail(format!("control socketpair: {e}"));
        }
    };
    // Configure the agent ourselves, before answering: the node then only awaits the answer,
    // one process hop less than sending it after our reply.
    if !send_agent_request(&init.agent_host, CONFIGURE_ID, &configure_request(&cfg)) {
        let _ = init.pidfd.signal(9);
        cleanup(&cgroup, &run_dir);
        let _ = cgroup.remove();
        return fail("could not configure the agent".into());
    }
    let launched = SupervisorMsg::Launched {
        req: req.req,
        sup_pid: std::process::id() as i32,
        init_pid: init.pidfd.pid(),
        phases_us: (
            cgroup_us,
            (t0.elapsed().as_micros() as u64).saturating_sub(cgroup_us),
        ),
        configure_id: CONFIGURE_ID,
    };
    if send(
        reply,
        &launched,
        &[init.agent_host.as_fd(), control_node.as_fd()],
    )
    .is_err()
    {
        let _ = init.pidfd.signal(9);
        cleanup(&cgroup, &run_dir);
        let _ = cgroup.remove();
        return 1;
    }
    drop(control_node);
    // The spawner socket is the node's; this process no longer needs it.
    // (It is closed when this process exits; supervisors never write to it again.)
    // A supervisor lives as long as its sandbox: give back what the launch allocated.
    ipc::trim_heap();
    serve(
        ctx,
        &cfg,
        cgroup,
        &mut init,
        Some(control),
        listener,
        &run_dir,
        reset_state,
        old_placeholder,
    )
}

fn cleanup(cgroup: &Cgroup, run_dir: &Path) {
    let _ = cgroup.kill_all();
    let _ = std::fs::remove_dir_all(run_dir);
}

#[allow(clippy::too_many_arguments)]
fn serve(
    ctx: &SpawnerCtx,
    cfg: &LaunchConfig,
    cgroup: Cgroup,
    init: &mut Init,
    mut control: Option<OwnedFd>,
    listener: Option<UnixListener>,
    run_dir: &Path,
    mut reset_state: launch::ResetState,
    old_placeholder: Option<OwnedFd>,
) -> i32 {
    let mut dying: Vec<PidFd> = Vec::new();
    // Request ids the supervisor uses on the agent socket: far from the node's own counter.
    let mut agent_req_id: u64 = CONFIGURE_ID;
    let mut old_roots: Vec<OwnedFd> = old_placeholder.into_iter().collect();
    let mut release_at = (!old_roots.is_empty()).then(|| Instant::now() + RELEASE_DELAY);
    // The root of the next in-place reset, built while the sandbox runs once it has been reset
    // (a sandbox that is reset once is in a reuse loop): the reset then only pivots.
    let mut spare: Option<launch::RootTree> = None;
    let mut spare_at: Option<Instant> = None;
    loop {
        // Reap inits killed by a reset.
        while ipc::try_reap().is_some() {}
        dying.retain(|p| p.is_alive());
        let mut fds: Vec<BorrowedFd<'_>> = vec![init.pidfd.as_fd()];
        if let Some(c) = &control {
            fds.push(c.as_fd());
        }
        if let Some(l) = &listener {
            fds.push(l.as_fd());
        }
        // Old roots are released a little after the answer: tearing a mount tree and its
        // tmpfs down right away competes for the CPU with the sandbox's next commands.
        if release_at.is_some_and(|t| Instant::now() >= t) {
            old_roots.clear();
            release_at = None;
        }
        if spare_at.is_some_and(|t| Instant::now() >= t) {
            spare_at = None;
            if spare.is_none() {
                let spec = container_spec(ctx, cfg, &init.agent_host);
                // A failure here only means the next reset builds its root itself.
                spare = launch::build_root_tree(&spec.rootfs, &mut reset_state, WARM_PATHS).ok();
            }
        }
        let mut wait = if dying.is_empty() {
            None
        } else {
            Some(Duration::from_millis(50))
        };
        for t in [release_at, spare_at].into_iter().flatten() {
            let left = t.saturating_duration_since(Instant::now());
            wait = Some(wait.map_or(left, |w| w.min(left)));
        }
        let ready = match ipc::poll_many(&fds, wait) {
            Ok(r) => r,
            Err(_) => continue,
        };
        for idx in ready {
            let which = if idx == 0 {
                Ready::Init
            } else if idx == 1 && control.is_some() {
                Ready::Control
            } else {
                Ready::Listener
            };
            match which {
                Ready::Init => {
                    let status = ipc::wait_pid(init.pidfd.pid()).unwrap_or(-1);
                    let _ = std::fs::write(run_dir.join("exit"), status.to_string());
                    if let Some(c) = &control {
                        let _ = send(c.as_fd(), &SupervisorMsg::Exited { status }, &[]);
                    }
                    // The sandbox is gone; wait for the node to destroy it (or for our socket to
                    // close) so that it can read the record. Clean what we own now.
                    let _ = cgroup.kill_all();
                    return wait_for_destroy(control, cgroup, run_dir);
                }
                Ready::Control => {
                    let Some(c) = &control else { continue };
                    let buf = match ipc::recv_msg(c.as_fd(), MAX_MSG) {
                        Ok((buf, _)) => buf,
                        Err(_) => Vec::new(),
                    };
                    if buf.is_empty() {
                        // Node closed the control socket (restart or crash): keep the sandbox,
                        // wait for a reconnect on sup.sock.
                        control = None;
                        break;
                    }
                    match serde_json::from_slice::<ControlMsg>(&buf) {
                        // In place only when the agent really left nothing else running
                        // (a compromised agent could lie about KillAll).
                        // In place: every process of the sandbox but the agent is killed here,
                        // from outside (the agent is not trusted to do it), then the root is
                        // swapped underneath the agent. A tree that will not die falls back to
                        // a relaunch.
                        Ok(ControlMsg::Reset)
                            if cfg.userns.is_none()
                                && kill_all_but_init(&cgroup, init.pidfd.pid())
                                && clear_ipc(init, &mut reset_state) =>
                        {
                            // The agent's `ReopenRoot` goes out before the pivot, so that
                            // its answer overlaps the pivot: it drops its handles and
                            // sessions (their processes are gone) and reopens the root at its
                            // next use, which comes after the node's answer, after the pivot.
                            // The node is waiting on us, so it writes nothing to the agent
                            // socket meanwhile. An agent that cannot be written to is broken:
                            // end it, so that the node's wait ends on its closed socket.
                            agent_req_id += 1;
                            if !send_agent_request(
                                &init.agent_host,
                                agent_req_id,
                                &dsec_api::agent::Request::ReopenRoot,
                            ) {
                                let _ = init.pidfd.signal(9);
                            }
                            let spec = container_spec(ctx, cfg, &init.agent_host);
                            let pivoted = match spare.take().filter(|t| t.matches(&spec.rootfs)) {
                                Some(tree) => {
                                    launch::enter_root_tree(tree, &init.pidfd, &mut reset_state)
                                }
                                None => {
                                    launch::reset_in_place(&spec, &init.pidfd, &mut reset_state)
                                }
                            };
                            match pivoted {
                                Ok(old_root) => {
                                    let done = SupervisorMsg::ResetDone {
                                        init_pid: init.pidfd.pid(),
                                        await_id: agent_req_id,
                                    };
                                    let _ = send(c.as_fd(), &done, &[]);
                                    // The old writable layer is freed later, off the path of
                                    // the answer and of the sandbox's next commands.
                                    old_roots.push(old_root);
                                    release_at.get_or_insert(Instant::now() + RELEASE_DELAY);
                                    spare_at.get_or_insert(Instant::now() + SPARE_DELAY);
                                }
                                Err(e) => {
                                    let message = error_chain(&e);
                                    let _ = send(c.as_fd(), &SupervisorMsg::Error { message }, &[]);
                                }
                            }
                        }
                        Ok(ControlMsg::Reset) => {
                            let _ = init.pidfd.signal(9);
                            match launch_init(ctx, cfg, &cgroup) {
                                Ok(new) => {
                                    let old = std::mem::replace(init, new);
                                    dying.push(old.pidfd);
                                    // A new agent: configure it like the first one.
                                    agent_req_id += 1;
                                    let msg = if send_agent_request(
                                        &init.agent_host,
                                        agent_req_id,
                                        &configure_request(cfg),
                                    ) {
                                        SupervisorMsg::ResetDone {
                                            init_pid: init.pidfd.pid(),
                                            await_id: agent_req_id,
                                        }
                                    } else {
                                        SupervisorMsg::Error {
                                            message: "could not configure the relaunched agent"
                                                .into(),
                                        }
                                    };
                                    let _ = send(c.as_fd(), &msg, &[init.agent_host.as_fd()]);
                                }
                                Err(message) => {
                                    let _ = send(c.as_fd(), &SupervisorMsg::Error { message }, &[]);
                                    let _ = ipc::wait_pid(init.pidfd.pid());
                                    return destroy(control, cgroup, run_dir);
                                }
                            }
                        }
                        Ok(ControlMsg::Destroy) => {
                            let _ = init.pidfd.signal(9);
                            let _ = ipc::wait_pid(init.pidfd.pid());
                            for d in dying.drain(..) {
                                let _ = ipc::wait_pid(d.pid());
                            }
                            return destroy(control, cgroup, run_dir);
                        }
                        Err(e) => {
                            let msg = SupervisorMsg::Error {
                                message: format!("bad control message: {e}"),
                            };
                            let _ = send(c.as_fd(), &msg, &[]);
                        }
                    }
                }
                Ready::Listener => {
                    let Some(l) = &listener else { continue };
                    if let Ok((stream, _)) = l.accept() {
                        // A reconnecting node: hand it the agent socket and a fresh control
                        // socket over the accepted stream.
                        if let Ok((node_end, ours)) = ipc::seqpacket_pair() {
                            let msg = SupervisorMsg::Launched {
                                req: 0,
                                sup_pid: std::process::id() as i32,
                                init_pid: init.pidfd.pid(),
                                phases_us: (0, 0),
                                configure_id: CONFIGURE_ID,
                            };
                            if send(
                                stream.as_fd(),
                                &msg,
                                &[init.agent_host.as_fd(), node_end.as_fd()],
                            )
                            .is_ok()
                            {
                                control = Some(ours);
                            }
                        }
                    }
                    break;
                }
            }
        }
    }
}

enum Ready {
    Init,
    Control,
    Listener,
}

/// Kills every process of the sandbox's cgroup except its init, through pidfds (no pid reuse
/// race), until the cgroup lists only the init; false when that does not happen in time (a
/// fork bomb outrunning the kills is bounded by pids.max, so this converges).
fn kill_all_but_init(cgroup: &Cgroup, init: i32) -> bool {
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

/// The `Configure` an agent gets from its supervisor: its sandbox's environment and the limits
/// applied to each command.
fn configure_request(cfg: &LaunchConfig) -> dsec_api::agent::Request {
    dsec_api::agent::Request::Configure {
        env: cfg.env.clone(),
        nofile: Some(cfg.limits.open_files_max),
        fsize: Some(cfg.limits.file_size_max),
    }
}

/// Request id of the `Configure` the supervisor sends at launch; resets use ids above it.
const CONFIGURE_ID: u64 = 1 << 62;

/// Sends the agent a request on the shared agent socket (only while the node is waiting on us,
/// so that frames never interleave); false if it could not.
fn send_agent_request(agent: &OwnedFd, id: u64, req: &dsec_api::agent::Request) -> bool {
    use std::io::Write as _;
    let Ok(frame) = dsec_api::frame::encode_request(id, req, &[]) else {
        return false;
    };
    let Ok(dup) = agent.try_clone() else {
        return false;
    };
    std::os::unix::net::UnixStream::from(dup)
        .write_all(&frame)
        .is_ok()
}

fn wait_for_destroy(control: Option<OwnedFd>, cgroup: Cgroup, run_dir: &Path) -> i32 {
    if let Some(c) = &control {
        // Bounded: the node destroys promptly; if it does not, clean up anyway.
        if let Ok(true) = ipc::poll_readable(c.as_fd(), Duration::from_secs(30)) {
            let _ = ipc::recv_msg(c.as_fd(), MAX_MSG);
        }
    }
    destroy(control, cgroup, run_dir)
}

fn destroy(control: Option<OwnedFd>, cgroup: Cgroup, run_dir: &Path) -> i32 {
    let _ = cgroup.kill_all();
    let _ = cgroup.remove();
    let _ = std::fs::remove_dir_all(run_dir);
    if let Some(c) = &control {
        let _ = send(c.as_fd(), &SupervisorMsg::Destroyed, &[]);
    }
    0
}
