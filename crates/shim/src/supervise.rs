//! A supervisor's launch of its sandbox: the runtime directory, the cgroup, the init (cloned
//! fresh or a pre-built shell pivoted onto the sandbox's root), then the answer to the node.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::time::Instant;

use dsec_sys::cgroup::Cgroup;
use dsec_sys::idrange::IdRangeLease;
use dsec_sys::ipc;
use dsec_sys::launch;

use crate::agent::{configure_request, send_agent_request, CONFIGURE_ID};
use crate::ctx::{send, SpawnerCtx};
use crate::failure::cgroup_failure;
use crate::init::{
    cleanup, discard, fresh_init, id_map, lease_ids, pivot_onto_root, Init, Prebuilt,
};
use crate::limits::cgroup_limits;
use crate::proto::{LaunchConfig, LaunchFailure, LaunchStep, SpawnRequest, SupervisorMsg};
use crate::serve::{serve, Supervised};

/// Launches the sandbox `req` asks for (on the pre-built shell `pre` if there is one), answers
/// on `reply`, then serves the sandbox until it is destroyed. Returns the process exit code.
pub(crate) fn supervise(
    ctx: &SpawnerCtx,
    req: SpawnRequest,
    pre: Option<Prebuilt>,
    reply: BorrowedFd<'_>,
) -> i32 {
    ipc::default_sigchld();
    ipc::set_process_name("dsec-sup");
    let _ = ipc::setsid();
    let mut cfg = req.config;
    let fail = |failure: LaunchFailure| {
        let _ = send(
            reply,
            &SupervisorMsg::Failed {
                req: req.req,
                failure,
            },
            &[],
        );
        1
    };
    let run_dir = PathBuf::from(&cfg.run_dir);
    // A pre-built shell has a user namespace: it serves only a sandbox with one.
    let mut pre = match pre {
        Some(p) if !cfg.userns => {
            discard(p);
            None
        }
        p => p,
    };
    // Held while this supervisor lives: its relaunches (resets) keep the same ids.
    let held = pre.as_mut().and_then(|p| p.ids.take());
    let _ids = match lease_for(&mut cfg, held) {
        Ok(lease) => lease,
        Err(f) => return fail(f),
    };
    if let Err(f) = std::fs::create_dir_all(&run_dir) {
        return fail(LaunchFailure {
            message: format!("create {}: {f}", run_dir.display()),
            ..LaunchFailure::io(LaunchStep::RunDir, &f)
        });
    }
    let t0 = Instant::now();
    let mut got = match sandbox_cgroup(ctx, &cfg, pre) {
        Ok(g) => g,
        Err(f) => {
            let _ = std::fs::remove_dir_all(&run_dir);
            return fail(f);
        }
    };
    let cgroup_us = t0.elapsed().as_micros() as u64;
    let (init, old_placeholder) = match start_init(ctx, &cfg, &mut got) {
        Ok(i) => i,
        Err(f) => {
            cleanup(&got.cgroup, &run_dir);
            let _ = got.cgroup.remove();
            return fail(f);
        }
    };
    let listener = UnixListener::bind(run_dir.join("sup.sock")).ok();
    let control = match answer(&cfg, &init, reply, req.req, (t0, cgroup_us)) {
        Ok(c) => c,
        Err(f) => {
            let _ = init.pidfd.signal(9);
            cleanup(&got.cgroup, &run_dir);
            let _ = got.cgroup.remove();
            return f.map_or(1, fail);
        }
    };
    // The spawner socket is the node's; this process no longer needs it.
    // (It is closed when this process exits; supervisors never write to it again.)
    // A supervisor lives as long as its sandbox: give back what the launch allocated.
    ipc::trim_heap();
    let sandbox = Supervised {
        ctx,
        cfg,
        cgroup: got.cgroup,
        init,
        control: Some(control),
        listener,
        run_dir: &run_dir,
        reset_state: got.reset_state,
    };
    serve(sandbox, old_placeholder)
}

/// For a sandbox with a user namespace, the host id range it maps onto: `held` (a pre-built
/// shell's) or a new lease; written into `cfg` (see [`LaunchConfig::ids`]).
fn lease_for(
    cfg: &mut LaunchConfig,
    held: Option<IdRangeLease>,
) -> Result<Option<IdRangeLease>, LaunchFailure> {
    if !cfg.userns {
        return Ok(None);
    }
    let lease = match held {
        Some(l) => l,
        None => lease_ids()?,
    };
    let map = id_map(&lease);
    cfg.ids = Some((map.host_uid, map.host_gid, map.count));
    Ok(Some(lease))
}

/// The sandbox's cgroup, and the pre-built shell and its prepared reset state if there is one.
struct Acquired {
    cgroup: Cgroup,
    shell: Option<Init>,
    reset_state: launch::ResetState,
    tree: Option<launch::RootTree>,
}

/// Creates the sandbox's cgroup, or gives a pre-built shell's cgroup (made with the same device
/// list, [`SpawnerCtx::sandbox_cgroup`]) the sandbox's name and limits.
fn sandbox_cgroup(
    ctx: &SpawnerCtx,
    cfg: &LaunchConfig,
    pre: Option<Prebuilt>,
) -> Result<Acquired, LaunchFailure> {
    let Some(Prebuilt {
        cgroup,
        init,
        reset_state,
        tree,
        ids: _,
    }) = pre
    else {
        let cgroup = ctx.sandbox_cgroup(&cfg.id, &cgroup_limits(&cfg.limits))?;
        return Ok(Acquired {
            cgroup,
            shell: None,
            reset_state: launch::ResetState::default(),
            tree: None,
        });
    };
    let shell_cgroup = cgroup.name().to_owned();
    let renamed = ctx.cgroups.rename(cgroup, &cfg.id).and_then(|c| {
        c.set_limits(&cgroup_limits(&cfg.limits))?;
        Ok(c)
    });
    match renamed {
        Ok(cgroup) => Ok(Acquired {
            cgroup,
            shell: Some(init),
            reset_state,
            tree,
        }),
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
            Err(cgroup_failure(&e))
        }
    }
}

/// Starts the sandbox's init: pivots the pre-built shell onto the sandbox's root and gives it
/// its identity, or starts a fresh one. Returns it with the old placeholder root, if any.
fn start_init(
    ctx: &SpawnerCtx,
    cfg: &LaunchConfig,
    got: &mut Acquired,
) -> Result<(Init, Option<OwnedFd>), LaunchFailure> {
    let Some(init) = got.shell.take() else {
        return fresh_init(ctx, cfg, &got.cgroup, &mut got.reset_state);
    };
    let old = pivot_onto_root(ctx, cfg, &init, got.tree.take(), &mut got.reset_state)?;
    Ok((init, Some(old)))
}

/// Configures the agent and tells the node the sandbox is launched, handing it the agent socket
/// and a control socket (`t0`: when the launch began, `cgroup_us`: how long its cgroup took).
/// Returns the supervisor's end of the control socket; on failure, what to
/// tell the node (nothing when the answer itself could not be sent).
fn answer(
    cfg: &LaunchConfig,
    init: &Init,
    reply: BorrowedFd<'_>,
    req: u64,
    (t0, cgroup_us): (Instant, u64),
) -> Result<OwnedFd, Option<LaunchFailure>> {
    let (control_node, control) = ipc::seqpacket_pair().map_err(|e| {
        Some(LaunchFailure {
            message: format!("control socketpair: {e}"),
            ..LaunchFailure::io(LaunchStep::Sockets, &e)
        })
    })?;
    // Configure the agent ourselves, before answering: the node then only awaits the answer,
    // one process hop less than sending it after our reply.
    if !send_agent_request(&init.agent_host, CONFIGURE_ID, &configure_request(cfg)) {
        return Err(Some(LaunchFailure::new(
            LaunchStep::Configure,
            "could not configure the agent",
        )));
    }
    let launched = SupervisorMsg::Launched {
        req,
        sup_pid: std::process::id() as i32,
        init_pid: init.pidfd.pid(),
        phases_us: (
            cgroup_us,
            (t0.elapsed().as_micros() as u64).saturating_sub(cgroup_us),
        ),
        configure_id: CONFIGURE_ID,
    };
    send(
        reply,
        &launched,
        &[init.agent_host.as_fd(), control_node.as_fd()],
    )
    .map_err(|_| None)?;
    Ok(control)
}
