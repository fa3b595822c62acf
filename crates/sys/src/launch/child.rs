//! The sandbox init between clone and exec: namespaces, the stage tmpfs and overlay, the root, the
//! descriptors, limits, privileges and seccomp, then `execveat` of the agent. Every failure is
//! reported as `step:errno` on the error pipe and ends the child.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use super::prepare::Prepared;
use super::rootfs::{make_stage_dirs, mount_overlay, mount_stage_tmpfs, populate_and_pivot};
use super::steps::{make_mounts_private, try_mount};
use super::{ContainerSpec, StepError};

/// Reports `step:errno` (the last OS error) on the error pipe and exits. Never returns.
pub(super) fn fail(err: &OwnedFd, step: &'static str) -> ! {
    fail_step(err, StepError::last(step))
}

pub(super) fn check(rc: libc::c_int, err: &OwnedFd, step: &'static str) {
    if rc < 0 {
        fail(err, step);
    }
}

/// Reports a failed step as `step:errno` on the error pipe and exits. Never returns.
fn fail_step(err: &OwnedFd, e: StepError) -> ! {
    let msg = format!("{}:{}", e.step, e.errno);
    // SAFETY: writing a valid buffer to an fd we own, then exiting without running destructors
    // (the parent's state must not be torn down from the child).
    unsafe {
        libc::write(err.as_raw_fd(), msg.as_ptr().cast(), msg.len());
        libc::_exit(127);
    }
}

pub(super) fn child_main(p: &Prepared, spec: &ContainerSpec<'_>, sync: OwnedFd, err: OwnedFd) -> ! {
    if p.userns {
        become_namespace_root(&sync, &err);
    }
    drop(sync);
    unshare_cgroup_and_time(&err);
    if let Err(e) = mount_stage(p) {
        fail_step(&err, e);
    }
    let null = open_host_null(p, &err);

    if let Err(e) = populate_and_pivot(p) {
        fail_step(&err, e);
    }

    // SAFETY: valid buffer and length.
    check(
        unsafe { libc::sethostname(p.hostname.as_ptr(), p.hostname.as_bytes().len()) },
        &err,
        "sethostname",
    );
    loopback_up(&err);

    let err = install_descriptors(spec, null, err);
    // Limits last among the fd work: a small RLIMIT_NOFILE must not break the shuffle above.
    set_rlimits(spec, &err);

    drop_privileges(&err);
    if let Err(e) = spec.seccomp.install() {
        let _ = e;
        fail(&err, "seccomp");
    }
    // SAFETY: fd 4 is the agent executable; argv/envp are NULL-terminated arrays of valid
    // C strings that outlive the call.
    unsafe {
        libc::syscall(
            libc::SYS_execveat,
            4,
            c"".as_ptr(),
            p.argv_ptrs.as_ptr(),
            p.envp_ptrs.as_ptr(),
            libc::AT_EMPTY_PATH,
        );
    }
    fail(&err, "execveat")
}

/// In a user namespace: the id maps are written, so the init becomes its root.
fn become_namespace_root(sync: &OwnedFd, err: &OwnedFd) {
    // The id maps are written: become root of the new user namespace.
    // SAFETY: integer-argument syscalls.
    check(unsafe { libc::setresgid(0, 0, 0) }, err, "setresgid");
    // SAFETY: as above.
    check(unsafe { libc::setresuid(0, 0, 0) }, err, "setresuid");
    // Changing credentials clears the parent-death signal: arm it again, then make sure the
    // supervisor did not die in between (its end of the sync pipe would be closed).
    // SAFETY: prctl with integer arguments only.
    check(
        unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) },
        err,
        "pdeathsig",
    );
    let mut pfd = libc::pollfd {
        fd: sync.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, no wait.
    let rc = unsafe { libc::poll(&mut pfd, 1, 0) };
    if rc != 0 {
        // SAFETY: exiting the child without running the parent's destructors.
        unsafe { libc::_exit(126) };
    }
}

/// A cgroup namespace and a time namespace of the init's own.
fn unshare_cgroup_and_time(err: &OwnedFd) {
    // SAFETY: integer-argument syscall.
    check(
        unsafe { libc::unshare(libc::CLONE_NEWCGROUP) },
        err,
        "cgroup_ns",
    );
    // A time namespace of its own (clone() cannot take CLONE_NEWTIME; the agent enters it at
    // exec, as a child would).
    // SAFETY: integer-argument syscall.
    check(
        unsafe { libc::unshare(libc::CLONE_NEWTIME) },
        err,
        "time_ns",
    );
}

/// Mounts the stage tmpfs and, on its root directory, the overlay (or a placeholder root).
fn mount_stage(p: &Prepared) -> Result<(), StepError> {
    make_mounts_private()?;
    mount_stage_tmpfs(p)?;
    make_stage_dirs(p)?;
    if p.placeholder {
        // No template yet (a pre-built shell): an empty root on the tmpfs, made a mount point
        // so that it can be pivoted to. The supervisor pivots the sandbox onto its template's
        // root when a request assigns it (see `reset_in_place`).
        try_mount("placeholder", &p.root, &p.root, None, libc::MS_BIND, None)
    } else {
        mount_overlay(p)
    }
}

/// Opens the host's `/dev/null` for the agent's standard streams; returns its descriptor.
fn open_host_null(p: &Prepared, err: &OwnedFd) -> libc::c_int {
    // The agent's standard streams: the host's /dev/null, opened before the pivot. The
    // sandbox's own is a node of its tmpfs, which an agent holding it open for life would keep
    // alive after a reset or an activation had replaced that tmpfs.
    // SAFETY: valid path; the fd is ours and close-on-exec (the agent gets dup2'd copies).
    let opened =
        unsafe { libc::open(p.dev_nodes[0].host.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    check(opened, err, "open_dev_null");
    // Above the descriptors the shuffle below writes (0 to 5).
    // SAFETY: fcntl and close on the fd just opened.
    let null = unsafe { libc::fcntl(opened, libc::F_DUPFD_CLOEXEC, 100) };
    check(null, err, "dup_dev_null");
    // SAFETY: as above; `opened` is not used again.
    unsafe { libc::close(opened) };
    null
}

/// Moves the agent socket to fd 3, the agent executable to 4 and the error pipe to 5, points
/// the standard streams at `null` and closes everything else; returns the error pipe.
fn install_descriptors(spec: &ContainerSpec<'_>, null: libc::c_int, err: OwnedFd) -> OwnedFd {
    // Descriptors: 3 = agent socket, 4 = agent executable (close-on-exec), error pipe kept
    // close-on-exec above them; everything else is closed.
    let agent_sock = spec.agent_sock.as_raw_fd();
    let agent_exe = spec.agent_exe.as_raw_fd();
    // SAFETY: dup/dup3/close_range on fds we own; sources are first moved above the targets so
    // that no target clobbers a source.
    unsafe {
        let s = libc::fcntl(agent_sock, libc::F_DUPFD_CLOEXEC, 100);
        let e = libc::fcntl(agent_exe, libc::F_DUPFD_CLOEXEC, 100);
        let r = libc::fcntl(err.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 100);
        if s < 0 || e < 0 || r < 0 {
            fail(&err, "dup_high");
        }
        // Standard streams: never the supervisor's (they lead to the node's terminal or logs).
        for fd in 0..3 {
            if libc::dup2(null, fd) < 0 {
                fail(&err, "stdio");
            }
        }
        if libc::dup3(s, 3, 0) < 0
            || libc::dup3(e, 4, libc::O_CLOEXEC) < 0
            || libc::dup3(r, 5, libc::O_CLOEXEC) < 0
        {
            fail(&err, "dup_low");
        }
        if libc::close_range(6, u32::MAX, 0) < 0 {
            fail(&err, "close_range");
        }
    }
    // From here the error pipe is fd 5. The old descriptor number was closed or reused above, so
    // its owner must never run its destructor.
    std::mem::forget(err);
    // SAFETY: fd 5 is the error pipe just installed by dup3 and nothing else owns it.
    unsafe { OwnedFd::from_raw_fd(5) }
}

/// The sandbox's resource limits.
fn set_rlimits(spec: &ContainerSpec<'_>, err: &OwnedFd) {
    for rl in &spec.rlimits {
        let lim = libc::rlimit {
            rlim_cur: rl.value,
            rlim_max: rl.value,
        };
        // SAFETY: valid rlimit struct.
        check(
            unsafe { libc::setrlimit(rl.resource as _, &lim) },
            err,
            "setrlimit",
        );
    }
}

fn loopback_up(err: &OwnedFd) {
    // No allocation on this path (a raw OS error), so it is fine between clone and exec.
    if crate::guest::loopback_up().is_err() {
        fail(err, "lo_up");
    }
}

/// The capabilities the agent keeps (inside the sandbox's user namespace, when it has one): to
/// start a command as another user of the sandbox (`CAP_SETUID`, `CAP_SETGID`; also its own
/// file-system ids, for file requests made as that user), to give a user it makes a home of
/// its own (`CAP_CHOWN`) and to signal that user's processes (`CAP_KILL`: a timeout, a kill
/// request, a reset). The agent clears every set in each command it starts (see
/// `ChildSetup::drop_caps`), so no command holds them.
pub const AGENT_CAPS: u64 =
    (1 << CAP_SETUID) | (1 << CAP_SETGID) | (1 << CAP_CHOWN) | (1 << CAP_KILL);
const CAP_CHOWN: u32 = 0;
const CAP_KILL: u32 = 5;
const CAP_SETGID: u32 = 6;
const CAP_SETUID: u32 = 7;

fn capset(err: &OwnedFd, step: &'static str, effective: u64, permitted: u64, inheritable: u64) {
    let header = crate::proc::CapHeader::V3;
    let half = |m: u64, hi: bool| if hi { (m >> 32) as u32 } else { m as u32 };
    let data = [false, true].map(|hi| crate::proc::CapData {
        effective: half(effective, hi),
        permitted: half(permitted, hi),
        inheritable: half(inheritable, hi),
    });
    // SAFETY: capset with a v3 header and two data structs, as the ABI requires.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &header, data.as_ptr()) as libc::c_int };
    check(rc, err, step);
}

/// Drops every capability but [`AGENT_CAPS`]: locks securebits so that uid 0 gains nothing on
/// exec (and changing uid keeps nothing by itself), empties the bounding set, and leaves the
/// kept ones in the ambient set — the only way they survive the agent's exec under
/// `SECBIT_NOROOT` — then locks the ambient set against raising any other.
fn drop_privileges(err: &OwnedFd) {
    let Ok((effective, permitted)) = crate::proc::own_caps() else {
        fail(err, "capget");
    };
    if permitted & AGENT_CAPS != AGENT_CAPS {
        fail(err, "the launch lacks a capability the agent keeps");
    }
    // While every capability is still held: the kept ones become inheritable, which the
    // ambient set requires.
    capset(err, "capset", effective, permitted, AGENT_CAPS);
    let bits = libc::SECBIT_NOROOT
        | libc::SECBIT_NOROOT_LOCKED
        | libc::SECBIT_NO_SETUID_FIXUP
        | libc::SECBIT_NO_SETUID_FIXUP_LOCKED
        | libc::SECBIT_KEEP_CAPS_LOCKED;
    // SAFETY: prctl with integer arguments only.
    unsafe {
        check(
            libc::prctl(libc::PR_SET_SECUREBITS, bits as libc::c_ulong),
            err,
            "securebits",
        );
        check(
            libc::prctl(
                libc::PR_CAP_AMBIENT,
                libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
                0,
                0,
                0,
            ),
            err,
            "ambient",
        );
        for cap in 0..64u32 {
            if AGENT_CAPS & (1 << cap) != 0 {
                check(
                    libc::prctl(
                        libc::PR_CAP_AMBIENT,
                        libc::PR_CAP_AMBIENT_RAISE as libc::c_ulong,
                        cap as libc::c_ulong,
                        0,
                        0,
                    ),
                    err,
                    "ambient raise",
                );
            }
        }
        check(
            libc::prctl(
                libc::PR_SET_SECUREBITS,
                (bits
                    | libc::SECBIT_NO_CAP_AMBIENT_RAISE
                    | libc::SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED) as libc::c_ulong,
            ),
            err,
            "securebits",
        );
        let mut cap = 0;
        loop {
            if libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong) < 0 {
                if io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL) {
                    break;
                }
                fail(err, "capbset");
            }
            cap += 1;
        }
    }
    capset(err, "capset", AGENT_CAPS, AGENT_CAPS, AGENT_CAPS);
}
