//! The supervisor's side of a launch: clone a [`Shell`] into its namespaces, release it with its
//! [`LaunchParams`] and read back the step that failed, if any.

use std::io::{self, Read, Write};
use std::os::fd::OwnedFd;

use crate::seccomp::Filter;

use super::child::{check, child_main, fail};
use super::prepare::prepare;
use super::{
    ensure_single_threaded, ContainerSpec, IdMap, LaunchError, LaunchParams, Launched,
    NamespaceSpec,
};

/// [`crate::ipc::pipe_cloexec`], its failure a [`LaunchError::Create`] of `what`.
fn pipe_cloexec(what: &'static str) -> Result<(OwnedFd, OwnedFd), LaunchError> {
    crate::ipc::pipe_cloexec().map_err(|source| LaunchError::Create { what, source })
}

/// What a shell is cloned with: everything that does not depend on the request.
pub struct ShellResources<'a> {
    /// Optional user namespace mapping.
    pub user: Option<IdMap>,
    /// The agent executable (a sealed memfd).
    pub agent_exe: &'a OwnedFd,
    /// The agent's protocol socket (child end), becomes fd 3.
    pub agent_sock: &'a OwnedFd,
    /// The seccomp filter.
    pub seccomp: &'a Filter,
}

/// A sandbox init cloned into its namespaces (pid, mount, IPC, UTS, network, and user when
/// asked) and waiting for its [`LaunchParams`]. Creating namespaces is the most expensive part
/// of a launch; a supervisor can hold a shell ready before any request arrives.
#[derive(Debug)]
pub struct Shell {
    pid: i32,
    go: std::fs::File,
    err: std::fs::File,
}

/// Clones a [`Shell`]. The caller must be single-threaded (checked).
pub fn clone_shell(res: &ShellResources<'_>) -> Result<Shell, LaunchError> {
    ensure_single_threaded()?;
    let (sync_r, sync_w) = pipe_cloexec("sync pipe")?;
    let (err_r, err_w) = pipe_cloexec("error pipe")?;
    let mut flags = libc::CLONE_NEWPID
        | libc::CLONE_NEWNS
        | libc::CLONE_NEWIPC
        | libc::CLONE_NEWUTS
        | libc::CLONE_NEWNET;
    if res.user.is_some() {
        flags |= libc::CLONE_NEWUSER;
    }
    // SAFETY: raw clone without CLONE_VM behaves like fork: the child gets a copy of the address
    // space. The caller is single-threaded (checked above), so the child may run Rust code; it
    // never returns from `shell_main`.
    let pid = unsafe {
        libc::syscall(
            libc::SYS_clone,
            (flags | libc::SIGCHLD) as libc::c_ulong,
            0usize,
            0usize,
            0usize,
            0usize,
        )
    };
    if pid == -1 {
        return Err(LaunchError::Clone(io::Error::last_os_error()));
    }
    if pid == 0 {
        drop(sync_w);
        drop(err_r);
        shell_main(res, sync_r, err_w);
    }
    let pid = pid as i32;
    drop(sync_r);
    drop(err_w);
    let shell = Shell {
        pid,
        go: std::fs::File::from(sync_w),
        err: std::fs::File::from(err_r),
    };
    if let Some(map) = &res.user {
        if let Err(e) = write_id_maps(pid, map) {
            kill_and_reap(pid);
            return Err(e);
        }
    }
    Ok(shell)
}

impl Shell {
    /// Host pid of the waiting init.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Sends the parameters and waits until the init exec'd the agent (or reports the step
    /// that failed; the init is then killed and reaped).
    pub fn launch(mut self, params: &LaunchParams) -> Result<Launched, LaunchError> {
        let bytes = serde_json::to_vec(params)
            .map_err(|_| LaunchError::InvalidArgument { what: "params" })?;
        let mut msg = Vec::with_capacity(bytes.len() + 4);
        msg.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
        msg.extend_from_slice(&bytes);
        let sent = self
            .go
            .write_all(&msg)
            .map_err(|source| LaunchError::Create {
                what: "release",
                source,
            });
        let mut report = String::new();
        let _ = self.err.read_to_string(&mut report);
        // `self.go` stays open until the init exec'd: an init that re-arms its parent-death
        // signal (after changing uid) checks it to see whether we died in between.
        if let Err(e) = sent {
            kill_and_reap(self.pid);
            return Err(e);
        }
        if !report.is_empty() {
            kill_and_reap(self.pid);
            let (step, errno) = report.split_once(':').unwrap_or((report.as_str(), "0"));
            return Err(LaunchError::ChildSetup {
                step: step.to_string(),
                errno: io::Error::from_raw_os_error(errno.trim().parse().unwrap_or(0)),
            });
        }
        Ok(Launched { pid: self.pid })
    }

    /// Kills and reaps a shell that will not be used.
    pub fn discard(self) {
        kill_and_reap(self.pid);
    }
}

/// Clones the sandbox init into new namespaces and runs the setup sequence in it; returns once
/// the child has exec'd the agent (or reports the step that failed). `attach` is called with the
/// child's host pid before the child is released (put it into its cgroup there).
pub fn spawn_container(
    spec: &ContainerSpec<'_>,
    attach: impl FnOnce(i32) -> Result<(), io::Error>,
) -> Result<Launched, LaunchError> {
    let shell = clone_shell(&ShellResources {
        user: spec.ns.user,
        agent_exe: spec.agent_exe,
        agent_sock: spec.agent_sock,
        seccomp: spec.seccomp,
    })?;
    if let Err(source) = attach(shell.pid) {
        shell.discard();
        return Err(LaunchError::Create {
            what: "cgroup attach",
            source,
        });
    }
    shell.launch(&spec.params())
}

/// The shell side: waits for the parameters, then runs the setup sequence.
fn shell_main(res: &ShellResources<'_>, sync: OwnedFd, err: OwnedFd) -> ! {
    // SAFETY: prctl with integer arguments only.
    check(
        unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) },
        &err,
        "pdeathsig",
    );
    let mut f = std::fs::File::from(sync);
    let mut len = [0u8; 4];
    if f.read_exact(&mut len).is_err() {
        // The supervisor discarded us or died before releasing us.
        // SAFETY: exiting the child without running the parent's destructors.
        unsafe { libc::_exit(126) };
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > (1 << 20) {
        fail(&err, "params_size");
    }
    let mut buf = vec![0u8; len];
    if f.read_exact(&mut buf).is_err() {
        // SAFETY: exiting the child without running the parent's destructors.
        unsafe { libc::_exit(126) };
    }
    let sync = OwnedFd::from(f);
    let Ok(params) = serde_json::from_slice::<LaunchParams>(&buf) else {
        fail(&err, "params")
    };
    let spec = ContainerSpec {
        ns: NamespaceSpec {
            user: res.user,
            hostname: params.hostname,
        },
        rootfs: params.rootfs,
        rlimits: params.rlimits,
        agent_exe: res.agent_exe,
        agent_sock: res.agent_sock,
        argv: params.argv,
        env: params.env,
        seccomp: res.seccomp,
    };
    let Ok(prep) = prepare(&spec) else {
        fail(&err, "prepare")
    };
    child_main(&prep, &spec, sync, err)
}

fn kill_and_reap(pid: i32) {
    // SAFETY: plain syscalls on a pid that is our own unreaped child, so it cannot be recycled.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
        libc::waitpid(pid, std::ptr::null_mut(), 0);
    }
}

fn write_id_maps(pid: i32, map: &IdMap) -> Result<(), LaunchError> {
    let w = |file: &str, content: String| {
        std::fs::write(format!("/proc/{pid}/{file}"), content)
            .map_err(|source| LaunchError::IdMap { pid, source })
    };
    w("setgroups", "deny".into())?;
    w("uid_map", format!("0 {} {}\n", map.host_uid, map.count))?;
    w("gid_map", format!("0 {} {}\n", map.host_gid, map.count))
}
