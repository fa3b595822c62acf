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
use std::time::Duration;

use dsec_sys::cgroup::{Cgroup, CgroupLimits, CgroupManager};
use dsec_sys::ipc::{self, PidFd};
use dsec_sys::launch::{self, ContainerSpec, Forked, IdMap, NamespaceSpec, Rlimit, RootfsSpec};
use dsec_sys::seccomp::Filter;

use super::proto::{ControlMsg, LaunchConfig, SpawnRequest, SupervisorMsg, MAX_MSG};

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
}

fn run_spawner() -> io::Result<()> {
    ipc::set_process_name("dsec-spawner");
    // The spawner exits when the node's socket closes (the node exited or died); supervisors,
    // its children, outlive it. (No parent-death signal: it would be tied to the node *thread*
    // that started the spawner, not to the node process.) As a subreaper that ignores SIGCHLD it
    // also reaps sandbox inits orphaned by a killed supervisor.
    ipc::set_child_subreaper()?;
    let node = dsec_sys::proc::take_inherited_fd(3).map_err(io::Error::other)?;
    let agent_path = std::env::var_os("DSEC_AGENT_BIN")
        .map(PathBuf::from)
        .ok_or_else(|| io::Error::other("DSEC_AGENT_BIN is not set"))?;
    let bytes = std::fs::read(&agent_path)?;
    let agent_exe = launch::sealed_exe_memfd("dsec-agent", &bytes)?;
    let cgroups = CgroupManager::detect(CGROUP_BASE).map_err(io::Error::other)?;
    let ctx = SpawnerCtx {
        node,
        agent_exe,
        seccomp: Filter::build(),
        cgroups,
    };
    // Exited supervisors are reaped by the kernel.
    ipc::ignore_sigchld();
    let mut buf = vec![0u8; MAX_MSG];
    loop {
        let (n, _fds) = ipc::recv_with_fds(ctx.node.as_fd(), &mut buf)?;
        if n == 0 {
            return Ok(()); // node went away
        }
        let req: SpawnRequest = match serde_json::from_slice(&buf[..n]) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("dsec-shim spawner: malformed request: {e}");
                continue;
            }
        };
        match launch::fork_process() {
            Ok(Forked::Child) => {
                let code = supervise(&ctx, req);
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

fn send(sock: BorrowedFd<'_>, msg: &SupervisorMsg, fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    let bytes = serde_json::to_vec(msg).map_err(io::Error::other)?;
    ipc::send_with_fds(sock, &bytes, fds)
}

/// One running sandbox init, seen from its supervisor.
struct Init {
    pidfd: PidFd,
    agent_host: OwnedFd,
}

fn cgroup_limits(cfg: &LaunchConfig) -> CgroupLimits {
    let l = &cfg.limits;
    CgroupLimits {
        cpu_weight: Some(l.cpu_weight),
        cpu_max: l.cpu_max.map(|c| ((c * 100_000.0) as u64, 100_000)),
        memory_high: l.memory_high,
        memory_max: Some(l.memory_max),
        pids_max: Some(l.pids_max),
    }
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
            Rlimit {
                resource: libc_rlimit::NOFILE,
                value: l.open_files_max,
            },
        ],
        agent_exe: &ctx.agent_exe,
        agent_sock,
        argv: vec!["dsec-agent".into()],
        env: cfg.env.clone(),
        seccomp: &ctx.seccomp,
    }
}

fn launch_init(ctx: &SpawnerCtx, cfg: &LaunchConfig, cgroup: &Cgroup) -> Result<Init, String> {
    let (agent_host, agent_child) = ipc::stream_pair().map_err(|e| format!("socketpair: {e}"))?;
    let spec = container_spec(ctx, cfg, &agent_child);
    let launched =
        launch::spawn_container(&spec, |pid| cgroup.attach(pid).map_err(io::Error::other))
            .map_err(|e| error_chain(&e))?;
    drop(agent_child);
    let pidfd = PidFd::open(launched.pid).map_err(|e| format!("pidfd_open: {e}"))?;
    Ok(Init { pidfd, agent_host })
}

mod libc_rlimit {
    pub const CORE: u32 = 4;
    pub const FSIZE: u32 = 1;
    pub const NOFILE: u32 = 7;
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

fn supervise(ctx: &SpawnerCtx, req: SpawnRequest) -> i32 {
    ipc::default_sigchld();
    ipc::set_process_name("dsec-sup");
    let _ = ipc::setsid();
    let mut cfg = req.config;
    let fail = |message: String| {
        let _ = send(
            ctx.node.as_fd(),
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
    let cgroup = match ctx.cgroups.create(&cfg.id, &cgroup_limits(&cfg)) {
        Ok(c) => c,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&run_dir);
            return fail(error_chain(&e));
        }
    };
    let cgroup_us = t0.elapsed().as_micros() as u64;
    let mut init = match launch_init(ctx, &cfg, &cgroup) {
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
    let launched = SupervisorMsg::Launched {
        req: req.req,
        sup_pid: std::process::id() as i32,
        init_pid: init.pidfd.pid(),
        phases_us: (
            cgroup_us,
            (t0.elapsed().as_micros() as u64).saturating_sub(cgroup_us),
        ),
    };
    if send(
        ctx.node.as_fd(),
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
    serve(
        ctx,
        &cfg,
        cgroup,
        &mut init,
        Some(control),
        listener,
        &run_dir,
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
) -> i32 {
    let mut dying: Vec<PidFd> = Vec::new();
    let mut reset_state = launch::ResetState::default();
    let mut buf = vec![0u8; MAX_MSG];
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
        let wait = if dying.is_empty() {
            None
        } else {
            Some(Duration::from_millis(50))
        };
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
                    let n = match ipc::recv_with_fds(c.as_fd(), &mut buf) {
                        Ok((n, _)) => n,
                        Err(_) => 0,
                    };
                    if n == 0 {
                        // Node closed the control socket (restart or crash): keep the sandbox,
                        // wait for a reconnect on sup.sock.
                        control = None;
                        break;
                    }
                    match serde_json::from_slice::<ControlMsg>(&buf[..n]) {
                        // In place only when the agent really left nothing else running
                        // (a compromised agent could lie about KillAll).
                        Ok(ControlMsg::Reset)
                            if cfg.userns.is_none()
                                && cgroup
                                    .pids()
                                    .is_ok_and(|p| p.iter().all(|&x| x == init.pidfd.pid())) =>
                        {
                            // In place: the node has killed every process but the agent.
                            let spec = container_spec(ctx, cfg, &init.agent_host);
                            match launch::reset_in_place(&spec, init.pidfd.pid(), &mut reset_state)
                            {
                                Ok(old_root) => {
                                    let msg = SupervisorMsg::ResetDone {
                                        init_pid: init.pidfd.pid(),
                                    };
                                    let _ = send(c.as_fd(), &msg, &[]);
                                    // Freeing the old writable layer happens here, after the
                                    // answer, off the caller's path.
                                    drop(old_root);
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
                                    let msg = SupervisorMsg::ResetDone {
                                        init_pid: init.pidfd.pid(),
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

fn wait_for_destroy(control: Option<OwnedFd>, cgroup: Cgroup, run_dir: &Path) -> i32 {
    if let Some(c) = &control {
        let mut buf = vec![0u8; MAX_MSG];
        // Bounded: the node destroys promptly; if it does not, clean up anyway.
        if let Ok(true) = ipc::poll_readable(c.as_fd(), Duration::from_secs(30)) {
            let _ = ipc::recv_with_fds(c.as_fd(), &mut buf);
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
