//! Lifecycle tests of the container substrate: create/exec/destroy cycles leave nothing behind,
//! reset gives a fresh writable layer, destroy takes background work with it, `/proc/self/exe`
//! overwrites (C-02) cannot reach host binaries. Run as root, never skipped.
//!
//! Every test holds [`SERIAL`] and compares the [`LeakSnapshot`] taken at its start with the one
//! at its end, so the tests of this file never see each other's sandboxes.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use common::{create, create_spec, small_limits, stderr, stdout, LeakSnapshot};
use dsec_api::agent::{Event, Request, SessionKind};
use dsec_api::exec::{ExecRequest, ExecStatus};
use dsec_node::sandbox::{Limits, SandboxSpec};
use dsec_node::substrate::{Runtime, RuntimeConfig};
use dsec_sys::idrange::IdRangeLease;
use sha2::{Digest, Sha256};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs a test's `body` alone, checking it leaves nothing behind.
fn isolated(body: impl FnOnce()) {
    common::leak_checked(&SERIAL, SETTLE, body);
}

const SETTLE: Duration = Duration::from_secs(5);

fn sha256_file(path: &Path) -> String {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    hex::encode(Sha256::digest(&bytes))
}

#[test]
fn lifecycle_create_exec_destroy_20x_returns_to_baseline() {
    let _serial = serial();
    let base = LeakSnapshot::take();
    for i in 0..20 {
        let mut sb = create(small_limits());
        let r = sb.sh(&format!("echo round-{i}; echo data > /tmp/f"), 10_000);
        assert_eq!(
            (r.status, stdout(&r)),
            (ExecStatus::Ok, format!("round-{i}\n")),
            "{r:?}"
        );
        // While it runs, the counters do show it (the snapshot would notice a leak).
        if i == 0 {
            let during = LeakSnapshot::take();
            assert_eq!(during.supervisors, base.supervisors + 1, "{during:?}");
            assert_eq!(during.agents, base.agents + 1, "{during:?}");
            assert_eq!(during.run_entries, base.run_entries + 1, "{during:?}");
            assert!(during.cgroup_dirs > base.cgroup_dirs, "{during:?}");
            assert_eq!(during.net_namespaces, base.net_namespaces + 1, "{during:?}");
            assert!(during.fds > base.fds, "{during:?}");
        }
        sb.destroy()
            .unwrap_or_else(|e| panic!("destroy round {i}: {e:?}"));
    }
    LeakSnapshot::assert_back_to(&base, SETTLE);
}

/// Host pids of live processes whose command line contains `marker`.
fn live_with_cmdline(marker: &str) -> Vec<i32> {
    common::all_procs()
        .into_iter()
        .filter(|p| p.state != 'Z' && common::cmdline(p.pid).contains(marker))
        .map(|p| p.pid)
        .collect()
}

fn check_reset(spec: &SandboxSpec, marker: &str) {
    let mut sb = create_spec(spec);
    sb.mark_acquired().expect("acquire");
    let r = sb.sh(
        &format!(
            "echo before > /tmp/marker; echo x > /workspace/ws-marker; echo s > /dev/shm/shm-marker; \
             setsid {marker} </dev/null >/dev/null 2>&1 & echo ok"
        ),
        5000,
    );
    assert_eq!(stdout(&r), "ok\n", "{r:?}");
    sb.agent()
        .call_ok(
            &Request::FileWrite {
                path: "/workspace/w".into(),
                mode: None,
                parents: false,
            },
            b"agent-written",
        )
        .expect("file write");
    assert!(common::wait_until(
        Duration::from_secs(2),
        || live_with_cmdline(marker).len() == 1
    ));

    sb.reset().expect("reset");
    assert!(
        common::wait_until(SETTLE, || live_with_cmdline(marker).is_empty()),
        "a process started before the reset survives it: {:?}",
        live_with_cmdline(marker)
            .iter()
            .map(|p| common::describe(*p))
            .collect::<Vec<_>>()
    );
    sb.ping().expect("ping after reset");
    let r = sb.sh("ls -A /tmp /workspace /dev/shm", 5000);
    assert_eq!(
        stdout(&r),
        "/dev/shm:\n\n/tmp:\n\n/workspace:\n",
        "old writable layer or /dev/shm visible after reset ({spec:?}): {r:?}"
    );
    let r = sb.sh("echo after > /tmp/marker && cat /tmp/marker", 5000);
    common::assert_ok_stdout(&r, "after\n");
    // A second reset works too.
    sb.mark_acquired().expect("acquire again");
    sb.reset().expect("second reset");
    sb.sh_prints(
        "test -e /tmp/marker && echo present || echo absent",
        5000,
        "absent\n",
    );
    sb.destroy().expect("destroy");
}

#[test]
fn lifecycle_reset_gives_a_fresh_writable_layer() {
    isolated(|| {
        check_reset(&common::small_spec(false), "sleep 7401");
    });
}

#[test]
fn lifecycle_reset_gives_a_fresh_writable_layer_userns() {
    isolated(|| {
        let spec = common::small_spec(true);
        check_reset(&spec, "sleep 7404");
    });
}

/// Resets spaced like a reuse loop pivot onto the spare root the supervisor built meanwhile:
/// each one still starts from an empty writable layer (the spare is never visible to the
/// sandbox, and nothing of one episode reaches the spare of the next), the sandbox's mount table
/// stays the same size, and nothing is left after the destroy.
#[test]
fn lifecycle_spaced_resets_start_from_a_fresh_layer_each_time() {
    isolated(|| {
        let mut sb = create(small_limits());
        sb.mark_acquired().expect("acquire");
        let mounts = |sb: &mut common::SbGuard| {
            let r = sb.sh("wc -l < /proc/self/mountinfo", 5000);
            assert_eq!(r.status, ExecStatus::Ok, "{r:?}");
            stdout(&r).trim().parse::<u32>().expect("a count")
        };
        let first = mounts(&mut sb);
        for round in 0..4 {
            let r = sb.sh(
                &format!(
                    "ls -A /tmp /workspace /dev/shm; echo {round} > /tmp/m; echo {round} > /dev/shm/m; \
                     echo {round} > /workspace/m; setsid sleep 740{round} </dev/null >/dev/null 2>&1 &"
                ),
                5000,
            );
            assert_eq!(
                (r.status, stdout(&r).as_str()),
                (ExecStatus::Ok, "/dev/shm:\n\n/tmp:\n\n/workspace:\n"),
                "round {round}: state of an earlier episode is visible: {r:?}"
            );
            // Longer than the supervisor waits before it builds the spare.
            std::thread::sleep(Duration::from_millis(150));
            sb.reset()
                .unwrap_or_else(|e| panic!("reset {round}: {e:?}"));
            sb.mark_acquired().expect("acquire again");
            assert!(
                common::wait_until(SETTLE, || live_with_cmdline(&format!("sleep 740{round}"))
                    .is_empty()),
                "round {round}: a process survives the reset"
            );
            assert_eq!(
                mounts(&mut sb),
                first,
                "round {round}: the mount table grew"
            );
        }
        sb.sh_prints(
            "ls -A /tmp /workspace /dev/shm",
            5000,
            "/dev/shm:\n\n/tmp:\n\n/workspace:\n",
        );
        sb.destroy().expect("destroy");
    });
}

/// System V shared memory, message queues and semaphores, and POSIX message queues, live in
/// the sandbox's IPC namespace, which an in-place reset keeps: the reset removes them, so one
/// episode's IPC objects never reach the next (whether the reset builds its root on the request
/// path or pivots onto the spare).
#[test]
fn lifecycle_a_reset_removes_the_ipc_objects_of_the_episode_before() {
    isolated(|| {
        let mut sb = create(small_limits());
        sb.mark_acquired().expect("acquire");
        const MAKE: &str = "ipcmk -M 4096 >/dev/null && ipcmk -M 8192 >/dev/null && \
            ipcmk -Q >/dev/null && ipcmk -S 3 >/dev/null && python3 -c '
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.mq_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
assert libc.mq_open(b\"/episode\", os.O_CREAT | os.O_RDWR, 0o600, None) >= 0, ctypes.get_errno()
'";
        const COUNT: &str =
            "echo $(tail -n +2 /proc/sysvipc/shm | wc -l) $(tail -n +2 /proc/sysvipc/msg | wc -l) \
            $(tail -n +2 /proc/sysvipc/sem | wc -l) $(python3 -c '
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.mq_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
print(1 if libc.mq_open(b\"/episode\", os.O_RDWR, 0, None) >= 0 else 0)
')";
        for (round, pause) in [(0, 0), (1, 150), (2, 150)] {
            let r = sb.sh(MAKE, 10_000);
            assert_eq!(r.status, ExecStatus::Ok, "round {round}: {r:?}");
            sb.sh_prints(COUNT, 10_000, "2 1 1 1\n");
            // Longer than the supervisor waits before it builds the spare root, after the first.
            std::thread::sleep(Duration::from_millis(pause));
            sb.reset()
                .unwrap_or_else(|e| panic!("reset {round}: {e:?}"));
            sb.mark_acquired().expect("acquire again");
            let r = sb.sh(COUNT, 10_000);
            assert_eq!(
                stdout(&r),
                "0 0 0 0\n",
                "round {round}: IPC objects of the episode before are visible: {r:?}"
            );
        }
        sb.destroy().expect("destroy");
    });
}

/// A reset frees the old writable layer while the sandbox sits idle after it (nothing, the
/// agent included, keeps the old root alive until the next command).
#[test]
fn lifecycle_a_reset_frees_the_old_layer_before_the_next_command() {
    isolated(|| {
        let mut sb = create(Limits {
            memory_max: 256 << 20,
            disk_bytes: 128 << 20,
            ..small_limits()
        });
        sb.mark_acquired().expect("acquire");
        sb.sh_prints(
            "head -c 48000000 /dev/zero > /tmp/big && echo ok",
            20_000,
            "ok\n",
        );
        let rt = common::rt();
        let usage = |id: &str| {
            rt.cgroups()
                .open(id)
                .expect("cgroup")
                .stats()
                .expect("stats")
                .memory_current
        };
        let before = usage(sb.id());
        assert!(
            before > 40_000_000,
            "the file is charged to the sandbox: {before}"
        );
        sb.reset().expect("reset");
        let id = sb.id().to_owned();
        assert!(
            common::wait_until(Duration::from_secs(5), || usage(&id) < before - 30_000_000),
            "the old layer is still charged after the reset: {} of {before}",
            usage(&id)
        );
        sb.sh_prints(
            "test -e /tmp/big && echo present || echo absent",
            5000,
            "absent\n",
        );
        sb.destroy().expect("destroy");
    });
}

/// HOME (`/root`) is a scratch dir and must be usable in user-namespace mode too.
#[test]
fn lifecycle_userns_scratch_dirs_are_writable() {
    isolated(|| {
        let spec = common::small_spec(true);
        let mut sb = create_spec(&spec);
        let r = sb.sh("for d in /tmp /var/tmp /root /home /workspace; do echo x > $d/probe || echo \"FAIL $d\"; done; echo end", 5000);
        sb.destroy().expect("destroy");
        assert_eq!(
            stdout(&r),
            "end\n",
            "scratch dirs not writable in userns mode: {}",
            stderr(&r)
        );
    });
}

#[test]
fn lifecycle_destroy_takes_background_work_with_it() {
    isolated(|| {
        let mut sb = create(small_limits());
        let ns = common::ns_inode(sb.init_pid(), "pid").expect("pid ns");
        let (ev, _) = sb
            .agent()
            .call(
                &Request::Spawn(ExecRequest::shell("sleep 7402")),
                b"",
                None,
                |_, _| {},
            )
            .expect("spawn");
        assert!(matches!(ev, Event::Started { .. }), "{ev:?}");
        let (ev, _) = sb
            .agent()
            .call(
                &Request::SessionOpen {
                    kind: SessionKind::Shell,
                    env: BTreeMap::new(),
                    cwd: None,
                },
                b"",
                None,
                |_, _| {},
            )
            .expect("session open");
        let Event::SessionOpened { session } = ev else {
            panic!("{ev:?}")
        };
        let (ev, _) = sb
            .agent()
            .call(
                &Request::SessionRun {
                    session,
                    input: "sleep 7403 &".into(),
                    timeout_ms: Some(5000),
                },
                b"",
                Some(Duration::from_secs(5)),
                |_, _| {},
            )
            .expect("session run");
        assert!(matches!(ev, Event::ExecDone(_)), "{ev:?}");
        assert!(
            common::wait_until(Duration::from_secs(2), || common::live_procs_in_pid_ns(ns)
                .iter()
                .filter(|p| common::cmdline(**p).starts_with("sleep 740"))
                .count()
                == 2),
            "background processes not running"
        );
        let members = common::live_procs_in_pid_ns(ns);
        sb.destroy().expect("destroy with background work");
        assert!(
            common::wait_until(Duration::from_secs(1), || common::members_alive(
                ns, &members
            )
            .is_empty()),
            "survivors: {:?}",
            common::members_alive(ns, &members)
                .iter()
                .map(|p| common::describe(*p))
                .collect::<Vec<_>>()
        );
    });
}

#[test]
fn c02_proc_self_exe_overwrite_leaves_host_binaries_unchanged() {
    isolated(|| {
        let agent_bin = common::rt().config().agent_bin.clone();
        let sh = std::fs::canonicalize("/bin/sh").expect("resolve /bin/sh");
        let targets: Vec<PathBuf> = vec![agent_bin, sh, PathBuf::from("/bin/cp")];
        let before: Vec<String> = targets.iter().map(|p| sha256_file(p)).collect();

        let script = "echo pwned > /proc/self/exe; echo rc1=$?\n\
                      cp /bin/sh /proc/1/exe; echo rc2=$?\n\
                      echo pwned > /proc/1/exe; echo rc3=$?\n\
                      cat /proc/self/exe > /dev/null; echo rc4=$?\n\
                      exec 3</proc/self/exe; echo pwned > /proc/self/fd/3; echo rc5=$?\n";
        for writable_root in [false, true] {
            let mut sb = create_spec(&SandboxSpec {
                limits: common::admitted(small_limits()),
                writable_root,
                ..Default::default()
            });
            let r = sb.sh(script, 10_000);
            let out = stdout(&r);
            for (k, must_fail) in [
                ("rc1", true),
                ("rc2", true),
                ("rc3", true),
                ("rc4", false),
                ("rc5", true),
            ] {
                let line = out
                    .lines()
                    .find(|l| l.starts_with(k))
                    .unwrap_or_else(|| panic!("{k} missing: {out}"));
                assert_eq!(
                    line != format!("{k}=0"),
                    must_fail,
                    "writable_root={writable_root}: {line}\n{out}\n{}",
                    stderr(&r)
                );
            }
            // A second command still runs the real shell and agent.
            sb.sh_prints("echo still-sh", 5000, "still-sh\n");
            sb.destroy().expect("destroy");
        }
        let after: Vec<String> = targets.iter().map(|p| sha256_file(p)).collect();
        assert_eq!(before, after, "a host binary changed: {targets:?}");
    });
}

/// The agent blocks SIGCHLD in all its threads; the commands it starts must not inherit that
/// mask, or `cmd & wait` in dash (which sigsuspends with the inherited mask) never returns.
#[test]
fn exec_children_start_with_an_empty_signal_mask() {
    isolated(|| {
        let mut sb = create(small_limits());
        let r = sb.argv(&["grep", "SigBlk", "/proc/self/status"], 5000);
        let blocked = stdout(&r);
        let r = sb.sh("sleep 0.1 & wait $!; echo rc=$?", 3000);
        let wait_status = (r.status, stdout(&r));
        sb.destroy().expect("destroy");
        assert_eq!(
            blocked.trim(),
            "SigBlk:\t0000000000000000",
            "signal mask inherited by exec children"
        );
        assert_eq!(
            wait_status,
            (ExecStatus::Ok, "rc=0\n".to_owned()),
            "`sleep 0.1 & wait` in /bin/sh"
        );
    });
}

/// A node starts its runtime on whatever thread it likes (a worker, a `spawn_blocking` task);
/// the spawner must not die when that thread exits. (`PR_SET_PDEATHSIG` is tied to the thread
/// that forked the child, not to the process.)
#[test]
fn lifecycle_runtime_outlives_the_thread_that_started_it() {
    let _serial = serial();
    let fx = common::fixture();
    let run_dir = PathBuf::from(format!("{}-thread", fx.run_dir.display()));
    let cfg = RuntimeConfig {
        data_dir: run_dir.join("data"),
        run_dir: run_dir.clone(),
        agent_bin: fx.rt.config().agent_bin.clone(),
        shim_bin: fx.rt.config().shim_bin.clone(),
    };
    let rt: Runtime = std::thread::spawn(move || Runtime::start(cfg).expect("start runtime"))
        .join()
        .expect("starter thread");
    std::thread::sleep(Duration::from_millis(200));
    let created = rt.create(&common::small_spec(false));
    let verdict = match created {
        Ok((mut sb, _)) => {
            let r = sb.exec(&rt, &ExecRequest::shell("echo hi"), b"", |_, _| {});
            let ok = r.as_ref().is_ok_and(|r| r.status == ExecStatus::Ok);
            let destroyed = sb.destroy(&rt);
            Ok((ok, destroyed.is_ok()))
        }
        Err(e) => Err(format!("{e:?}")),
    };
    drop(rt);
    remove_runtime_dirs(&run_dir);
    assert_eq!(
        verdict,
        Ok((true, true)),
        "runtime started on a thread that has exited cannot create sandboxes"
    );
}

/// /dev takes no writes (only /dev/shm and /dev/pts do), so a reset can reuse it as it is.
#[test]
fn lifecycle_dev_is_read_only_but_shm_is_writable() {
    let _serial = serial();
    let mut sb = create_spec(&common::small_spec(false));
    let r = sb.sh(
        "touch /dev/planted 2>/dev/null && echo planted; echo s > /dev/shm/x && cat /dev/shm/x; \
         echo data > /dev/null && echo null-ok",
        5000,
    );
    sb.destroy().expect("destroy");
    assert_eq!(stdout(&r), "s\nnull-ok\n", "{r:?}");
}

/// Every superblock costs every memory cgroup created later on the host (SPECIFICATION.md), so a
/// sandbox makes four filesystems: its tmpfs (seen as `/dev` and `/dev/shm`, directories of it),
/// the overlay, devpts and procfs. `/dev/mqueue` mounts the one its IPC namespace has anyway
/// (the kernel makes it with the namespace), so it is not counted, only checked to be there.
/// The `/proc` masks are binds of node-wide files, not filesystems of their own. Also after a
/// reset, which brings a fresh tmpfs and overlay.
#[test]
fn lifecycle_four_filesystems_per_sandbox() {
    let _serial = serial();
    let mut sb = create_spec(&common::small_spec(false));
    let script =
        "grep -v ' - mqueue ' /proc/self/mountinfo | awk '$5 !~ /^\\/proc\\// {print $3}' \
                  | sort -u | wc -l; \
                  grep -q ' /dev/mqueue .* - mqueue ' /proc/self/mountinfo && echo mqueue; \
                  [ $(stat -c %d /dev) = $(stat -c %d /dev/shm) ] && echo shm-on-tmpfs; \
                  [ $(stat -c %d /dev) != $(stat -c %d /) ] && echo tmpfs-not-overlay";
    let first = sb.sh(script, 5000);
    sb.mark_acquired().expect("acquire");
    sb.reset().expect("reset");
    let after_reset = sb.sh(script, 5000);
    sb.destroy().expect("destroy");
    let want = "4\nmqueue\nshm-on-tmpfs\ntmpfs-not-overlay\n";
    assert_eq!(stdout(&first), want, "{first:?}");
    assert_eq!(stdout(&after_reset), want, "after a reset: {after_reset:?}");
}

/// The agent (PID 1) runs as the same uid as sandboxed code: its memory, environment and
/// descriptors must still be out of reach (it is not dumpable), or sandboxed code could rewrite
/// the agent through /proc/1/mem and survive resets inside it.
#[test]
fn c02b_agent_memory_and_fds_are_out_of_reach() {
    let _serial = serial();
    let mut sb = create_spec(&common::small_spec(false));
    let probe = "import os\n\
                 for path, mode in (('/proc/1/mem', 'r+b'), ('/proc/1/mem', 'rb'), ('/proc/1/environ', 'rb')):\n\
                 \x20   try:\n\
                 \x20       open(path, mode).close(); print('open', path, mode)\n\
                 \x20   except OSError as e:\n\
                 \x20       print('denied', path, mode, e.errno)\n\
                 try:\n\
                 \x20   print('link', os.readlink('/proc/1/fd/3'))\n\
                 except OSError as e:\n\
                 \x20   print('denied fd link', e.errno)\n";
    let r = sb.argv(&["/usr/bin/python3", "-c", probe], 10_000);
    sb.destroy().expect("destroy");
    let out = stdout(&r);
    assert!(
        !out.lines()
            .any(|l| l.starts_with("open ") || l.starts_with("link ")),
        "PID 1 reachable from inside: {out} {r:?}"
    );
    assert_eq!(out.matches("denied").count(), 4, "{out}");
}

fn environ(pid: i32) -> Vec<String> {
    common::proc_strings(pid, "environ").unwrap_or_else(|e| panic!("environ of {pid}: {e}"))
}

/// Supervisors run without glibc's per-thread malloc cache (each idle sandbox's supervisor then
/// keeps ~23 KiB less of private heap), and the setting stays outside the sandbox.
#[test]
fn lifecycle_supervisors_run_without_the_malloc_cache_and_sandboxes_do_not_inherit_it() {
    isolated(|| {
        let mut sb = create(small_limits());
        let tunable = format!(
            "GLIBC_TUNABLES={}",
            dsec_node::substrate::SPAWNER_MALLOC_TUNABLES
        );
        let sup = environ(sb.supervisor_pid());
        assert!(sup.contains(&tunable), "{sup:?}");
        let agent = environ(sb.init_pid());
        assert!(
            !agent.iter().any(|v| v.starts_with("GLIBC_TUNABLES")),
            "{agent:?}"
        );
        let r = sb.sh("env", 10_000);
        assert_eq!(r.status, ExecStatus::Ok, "{r:?}");
        assert!(!stdout(&r).contains("GLIBC_TUNABLES"), "{}", stdout(&r));
        sb.destroy().expect("destroy");
    });
}

/// A launch that fails comes back typed: the step that failed and its errno, which decide the
/// code (an agent that cannot be executed is no resource shortage: `internal`), and a message
/// that names the step.
#[test]
fn lifecycle_a_failed_launch_names_its_step() {
    use dsec_api::ErrorCode;
    use dsec_node::substrate::container::shim::proto::LaunchStep;
    use dsec_node::substrate::RuntimeError;

    let _serial = serial();
    let fx = common::fixture();
    let run_dir = PathBuf::from(format!("{}-noexec", fx.run_dir.display()));
    std::fs::create_dir_all(&run_dir).expect("run dir");
    // Not an executable format: the sandbox init's `execveat` fails with ENOEXEC.
    let agent_bin = run_dir.join("not-an-agent");
    std::fs::write(&agent_bin, b"plain text\n").expect("write fake agent");
    let cfg = RuntimeConfig {
        data_dir: run_dir.join("data"),
        run_dir: run_dir.clone(),
        agent_bin,
        shim_bin: fx.rt.config().shim_bin.clone(),
    };
    let rt = Runtime::start(cfg).expect("start runtime");
    let created = rt.create(&common::small_spec(false));
    drop(rt);
    remove_runtime_dirs(&run_dir);
    let Err(err) = created else {
        panic!("a create with no runnable agent succeeded");
    };
    let RuntimeError::Launch { failure, .. } = &err else {
        panic!("not a launch failure: {err:?}");
    };
    assert_eq!(failure.step, LaunchStep::ExecAgent, "{err}");
    assert_eq!(failure.errno, Some(libc::ENOEXEC), "{err}");
    assert_eq!(err.code(), ErrorCode::Internal, "{err}");
    assert!(
        err.to_string().contains("executing the agent failed"),
        "{err}"
    );
}

/// Removes the state of a runtime a test started on its own dirs (its mask tmpfs first).
fn remove_runtime_dirs(run_dir: &std::path::Path) {
    let _ = std::process::Command::new("umount")
        .arg("-l")
        .arg(run_dir.join("mask"))
        .status();
    let _ = std::fs::remove_dir_all(run_dir);
}

/// What a process reaching `sup.sock` gets, as `/usr/bin/python3` run by `cmd` (a prefix such as
/// `setpriv` or `unshare`) reports it: `connect <errno>`, `nothing` (hung up on) or
/// `got <bytes> <fds>`.
fn sup_sock_answer(cmd: &[&str], sock: &Path) -> String {
    const CLIENT: &str = r#"
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(5)
try:
    s.connect(sys.argv[1])
except OSError as e:
    print("connect", e.errno)
    sys.exit(0)
msg, anc, _, _ = s.recvmsg(65536, socket.CMSG_SPACE(64))
fds = sum(len(d) // 4 for (_, t, d) in anc if t == socket.SCM_RIGHTS)
print("nothing" if not msg else f"got {len(msg)} {fds}")
"#;
    let out = std::process::Command::new(cmd[0])
        .args(&cmd[1..])
        .args(["/usr/bin/python3", "-c", CLIENT])
        .arg(sock)
        .output()
        .expect("run the sup.sock client");
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// G-4: a supervisor's `sup.sock` hands the agent and control sockets only to the node: a
/// process of another uid, or host root in another pid namespace (as an escaped sandbox process
/// would be), is hung up on with nothing, even when the socket is reachable by mistake.
#[test]
fn g04_sup_sock_answers_only_the_node() {
    use std::os::unix::fs::PermissionsExt;
    isolated(|| {
        let mut sb = create(small_limits());
        let run_dir = &common::fixture().run_dir;
        let sock = run_dir.join("sandboxes").join(sb.id()).join("sup.sock");
        // A permission slip: every directory on the way and the socket open to everyone.
        let mut opened = Vec::new();
        for p in sock.ancestors().take_while(|p| p.starts_with(run_dir)) {
            let mode = std::fs::metadata(p).expect("stat").permissions().mode();
            opened.push((p.to_path_buf(), mode));
            let world = if p == sock { 0o777 } else { mode | 0o011 };
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(world)).expect("chmod");
        }
        let nobody = [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
        ];
        let other_pid_ns = ["unshare", "--pid", "--fork"];
        let answers = [
            sup_sock_answer(&nobody, &sock),
            sup_sock_answer(&other_pid_ns, &sock),
        ];
        for (p, mode) in opened {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).expect("chmod");
        }
        assert_eq!(answers, ["nothing", "nothing"]);
        // The supervisor still serves its sandbox.
        common::assert_ok_stdout(&sb.sh("echo alive", 5_000), "alive\n");
        sb.destroy().expect("destroy");
    });
}

/// Issue-20 item 1: every sandbox with a user namespace maps root to a host id range of its own,
/// leased while its supervisor lives and given back when it is destroyed; a reset keeps it.
#[test]
fn userns_sandboxes_get_host_id_ranges_of_their_own() {
    isolated(|| {
        let host_id = |sb: &mut common::SbGuard| -> u32 {
            let map = stdout(&sb.sh("cat /proc/self/uid_map", 5_000));
            let f: Vec<&str> = map.split_whitespace().collect();
            assert_eq!((f[0], f[2]), ("0", "65536"), "{map}");
            f[1].parse().expect("host id")
        };
        let spec = common::small_spec(true);
        let (mut a, mut b) = (create_spec(&spec), create_spec(&spec));
        let (ia, ib) = (host_id(&mut a), host_id(&mut b));
        assert_ne!(ia, ib, "two live sandboxes share host ids");
        let leased = |first: u32| {
            let index = IdRangeLease::index_of(first).expect("a leased range");
            IdRangeLease::is_leased(index).expect("lease check")
        };
        assert!(leased(ia) && leased(ib));
        a.mark_acquired().expect("acquired");
        a.reset().expect("reset");
        assert_eq!(host_id(&mut a), ia, "a reset keeps the range");
        a.destroy().expect("destroy");
        assert!(
            common::wait_until(Duration::from_secs(5), || !leased(ia)),
            "the range of a destroyed sandbox is given back"
        );
        assert!(leased(ib));
        b.destroy().expect("destroy");
    });
}

/// G-1: a sandbox made with the default spec runs in a user namespace, from a pre-built shell:
/// its processes are an unprivileged host uid, yet the template's files keep their owners inside
/// (its layers are mounted idmapped), so root inside owns `/etc` and a writable root takes
/// writes to it; an in-place reset keeps the namespace.
#[test]
fn g01_default_sandboxes_are_unprivileged_and_own_their_template() {
    isolated(|| {
        let mut sb = create_spec(&SandboxSpec::default());
        let init = sb.init_pid();
        let host_uid = std::fs::read_to_string(format!("/proc/{init}/status"))
            .expect("status")
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<u32>().ok())
            .expect("a Uid line");
        assert_ne!(host_uid, 0, "the default sandbox's init is host root");
        assert!(IdRangeLease::index_of(host_uid).is_some(), "{host_uid}");
        let out = stdout(&sb.sh("id -u; stat -c '%u %g' / /etc /etc/passwd /tmp", 5_000));
        assert_eq!(out, "0\n0 0\n0 0\n0 0\n0 0\n", "owners inside");
        sb.mark_acquired().expect("acquired");
        sb.reset().expect("reset");
        assert_eq!(sb.init_pid(), init, "the reset was in place");
        sb.destroy().expect("destroy");
        let mut w = create_spec(&SandboxSpec {
            writable_root: true,
            ..SandboxSpec::default()
        });
        common::assert_ok_stdout(
            &w.sh("echo x >> /etc/motd && stat -c '%u' /etc/motd", 5_000),
            "0\n",
        );
        w.destroy().expect("destroy");
    });
}
