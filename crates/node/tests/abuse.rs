//! Resource-abuse tests of the container substrate (TESTING.md, R-01 … R-12). Each runs hostile
//! code in a real sandbox, as root, and asserts the outcome: the limit held, the result says
//! why, the host and the neighbours did not notice. Never skipped.

mod common;

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{
    cgroup_u64, cmdline, create, create_spec, live_procs_in_pid_ns, ns_inode, procs_in_pid_ns, rt,
    small_limits, small_spec, stderr, stdout, wait_until, SbGuard,
};
use dsec_api::exec::{ExecRequest, ExecStatus, MAX_ARGS, MAX_COMMAND_BYTES};
use dsec_api::ErrorCode;
use dsec_node::agent_client::AgentError;
use dsec_node::sandbox::{Limits, SandboxSpec};
use dsec_node::substrate::RuntimeError;

/// Runs `true` in `sb` and returns how long it took (asserting it worked).
fn time_true(sb: &mut SbGuard) -> Duration {
    let t = Instant::now();
    let r = sb.sh("true", 10_000);
    assert_eq!(r.status, ExecStatus::Ok, "neighbour `true`: {r:?}");
    t.elapsed()
}

/// Resident set size of this (host-side) process in KiB.
fn our_rss_kb() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next().and_then(|n| n.parse().ok()))
        .unwrap_or(0)
}

// ---------------------------------------------------------------------------------------------
//

/// Without the user namespace (the admin's opt-out) a fork bomb is stopped by `pids.max`.
#[test]
fn r01_fork_bomb_hits_pids_limit() {
    fork_bomb_is_contained(false);
}

/// In the default user namespace `RLIMIT_NPROC` stops it first, before any fork is copied.
#[test]
fn r01b_fork_bomb_is_refused_by_rlimit_nproc_in_the_default_namespace() {
    fork_bomb_is_contained(true);
}

fn fork_bomb_is_contained(userns: bool) {
    let limits = small_limits();
    let pids_max = limits.pids_max;
    let mut neighbour = create(limits.clone());
    let mut sb = create_spec(&small_spec(userns));
    let id = sb.id().to_owned();
    let events_before = cgroup_pids_events_max(&id);

    let peak = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    let (bomb, neighbour_latency) = std::thread::scope(|s| {
        // Sample pids.current while the bomb runs.
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                if let Some(n) = cgroup_u64(&id, "pids.current") {
                    peak.fetch_max(n, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        let bomb = s.spawn(|| {
            let t = Instant::now();
            // The bomb runs in the background of the same group; the main process becomes
            // `sleep` without forking again (a shell that needs a fork under the bomb gives up
            // early), so the command ends by its deadline, which kills the whole group.
            let r = sb.sh("(f() { f | f & }; f) & exec sleep 60", 3000);
            (r, t.elapsed())
        });
        std::thread::sleep(Duration::from_millis(1000));
        let lat = time_true(&mut neighbour);
        let bomb = bomb.join();
        // Stop the sampler before reporting a panicked bomb thread (the scope would otherwise
        // wait for the sampler forever).
        stop.store(true, Ordering::Relaxed);
        (bomb.expect("bomb thread"), lat)
    });
    let (r, elapsed) = bomb;
    // Contained either way: the deadline kills the tree, or the bomb's shells exhaust the
    // sandbox's memory first and the OOM killer (inside the sandbox only) ends the command.
    assert!(
        matches!(r.status, ExecStatus::Timeout | ExecStatus::Oom),
        "fork bomb must end by its timeout or inside its memory limit: {:?} exit {:?}",
        r.status,
        r.exit_code
    );
    assert!(
        elapsed < Duration::from_secs(8),
        "fork bomb exec took {elapsed:?}"
    );
    let peak = peak.load(Ordering::Relaxed);
    assert!(
        peak <= pids_max,
        "pids.current reached {peak} > pids_max {pids_max}"
    );
    if let Some(kernel_peak) = cgroup_u64(&id, "pids.peak") {
        assert!(
            kernel_peak <= pids_max,
            "pids.peak {kernel_peak} > {pids_max}"
        );
    }
    let events_after = cgroup_pids_events_max(&id);
    if userns {
        // RLIMIT_NPROC (pids_max less 4) refused every fork beyond it: none reached pids.max.
        // (That the limit is there and refuses is `server.rs::userns_sandboxes_refuse_forks_
        // before_the_copy`.)
        assert_eq!(
            events_after, events_before,
            "forks reached pids.max in a sandbox with a user namespace"
        );
    } else {
        // The limit was actually hit (fork failures counted by the kernel).
        assert!(
            events_after > events_before,
            "pids.events max did not increase ({events_before} -> {events_after}): the bomb never hit the limit?"
        );
    }
    assert!(
        neighbour_latency < Duration::from_secs(2),
        "neighbour `true` took {neighbour_latency:?} during the bomb"
    );

    // The bombed sandbox recovers: the bomb is gone, exec works.
    assert!(
        wait_until(Duration::from_secs(5), || cgroup_u64(&id, "pids.current")
            .is_some_and(|n| n <= 2)),
        "bomb processes survive the timeout kill: pids.current = {:?}",
        cgroup_u64(&id, "pids.current")
    );
    let r = sb.sh("echo alive", 5000);
    common::assert_ok_stdout(&r, "alive\n");

    // Thread bomb: threads count against pids.max too.
    let r = sb.sh(
        "python3 -c '\nimport threading, time\nn = 0\ntry:\n    while True:\n        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n        n += 1\nexcept RuntimeError:\n    print(n)\n'",
        20_000,
    );
    assert_eq!(
        r.status,
        ExecStatus::Ok,
        "thread bomb: {r:?} {}",
        stderr(&r)
    );
    let threads: u64 = stdout(&r).trim().parse().expect("thread count");
    assert!(
        threads < pids_max,
        "{threads} threads started with pids_max {pids_max}"
    );
    assert!(
        threads >= pids_max / 2,
        "only {threads} threads started: limit not the cause?"
    );

    sb.destroy().expect("destroy bombed sandbox");
    neighbour.destroy().expect("destroy neighbour");
}

/// The `max` counter of the sandbox's `pids.events` (fork attempts refused by pids.max).
fn cgroup_pids_events_max(id: &str) -> u64 {
    let dir = common::cgroup_dir_with(id, "pids.events").expect("pids cgroup dir");
    std::fs::read_to_string(dir.join("pids.events"))
        .expect("read pids.events")
        .lines()
        .find_map(|l| l.strip_prefix("max "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

// ---------------------------------------------------------------------------------------------
//

#[test]
fn r02_setsid_escapee_dies_with_sandbox() {
    let mut sb = create(small_limits());
    let ns = ns_inode(sb.init_pid(), "pid").expect("sandbox pid ns");
    let ours = ns_inode(std::process::id() as i32, "pid").expect("our pid ns");
    assert_ne!(ns, ours);
    let t = Instant::now();
    let r = sb.sh(
        "setsid sh -c 'sleep 7301' </dev/null >/dev/null 2>&1 &\n\
         (sh -c 'sleep 7302' </dev/null >/dev/null 2>&1 &) &\n\
         nohup sleep 7303 </dev/null >/dev/null 2>&1 &\n\
         echo started",
        5000,
    );
    common::assert_ok_stdout(&r, "started\n");
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "exec with detached children took {:?}",
        t.elapsed()
    );
    let marked = |pid: &i32| {
        let c = cmdline(*pid);
        ["sleep 7301", "sleep 7302", "sleep 7303"]
            .iter()
            .any(|m| c.contains(m))
    };
    // The escapees really escaped the exec and are alive inside the sandbox.
    assert!(
        wait_until(Duration::from_secs(3), || procs_in_pid_ns(ns)
            .iter()
            .filter(|p| marked(p))
            .count()
            >= 3),
        "escapees not found in the sandbox: {:?}",
        procs_in_pid_ns(ns)
            .iter()
            .map(|p| cmdline(*p))
            .collect::<Vec<_>>()
    );
    // Everything that lived in the sandbox's pid namespace, by pid. (Namespace inode numbers are
    // reused once a namespace is gone — by the next pre-built shell, say — so "nothing left in
    // that namespace" is checked for these processes, not for whatever gets the number next.)
    let members = live_procs_in_pid_ns(ns);
    assert!(members.len() >= 4, "{members:?}");
    sb.destroy().expect("destroy");
    let survivors = || {
        common::all_procs()
            .into_iter()
            .map(|p| p.pid)
            .filter(|p| marked(p) && ns_inode(*p, "pid") != Some(ours))
            .collect::<Vec<_>>()
    };
    let members_alive = || {
        let now = live_procs_in_pid_ns(ns);
        members
            .iter()
            .copied()
            .filter(|p| now.contains(p))
            .collect::<Vec<_>>()
    };
    assert!(
        wait_until(Duration::from_secs(1), || survivors().is_empty()
            && members_alive().is_empty()),
        "processes of the destroyed sandbox survive: {:?} {:?}",
        survivors(),
        members_alive()
    );
}

// ---------------------------------------------------------------------------------------------
//

#[test]
fn r03_memory_bomb_is_oom_inside_only() {
    let mut neighbour = create(small_limits());
    let mut sb = create(small_limits());
    let id = sb.id().to_owned();

    // malloc bomb: 1 GiB touched, run directly (python is the main process).
    let r = sb.argv(
        &["python3", "-c", "s = b'x' * (1 << 30); print(len(s))"],
        30_000,
    );
    assert_eq!(
        r.status,
        ExecStatus::Oom,
        "python 1 GiB in 64 MiB: {r:?} {}",
        stderr(&r)
    );
    let stats = rt().cgroups().open(&id).and_then(|c| c.stats().ok());
    assert!(stats.is_some_and(|s| s.oom_kills >= 1), "{stats:?}");
    assert!(time_true(&mut neighbour) < Duration::from_secs(2));
    let r = sb.sh("echo after-malloc", 5000);
    assert_eq!(
        stdout(&r),
        "after-malloc\n",
        "sandbox unusable after an OOM: {r:?}"
    );

    // memfd bomb: 200 MiB written into an anonymous file.
    let memfd = "import os\nfd = os.memfd_create('bomb')\nchunk = b'm' * (1 << 20)\n\
                 for _ in range(200):\n    os.write(fd, chunk)\nprint('wrote')\n";
    let r = sb.argv(&["python3", "-c", memfd], 30_000);
    assert!(
        r.status == ExecStatus::Oom
            || (r.status == ExecStatus::NonzeroExit && stderr(&r).contains("No space left")),
        "memfd bomb must be stopped by the memory limit: {r:?} {}",
        stderr(&r)
    );
    assert!(!stdout(&r).contains("wrote"));
    assert!(time_true(&mut neighbour) < Duration::from_secs(2));

    // tmpfs bomb: /dev/shm filled beyond the memory limit. The file outlives the writer, so the
    // writer's death does not give the memory back; the sandbox must stay manageable.
    let r = sb.argv(
        &[
            "dd",
            "if=/dev/zero",
            "of=/dev/shm/bomb",
            "bs=1M",
            "count=200",
        ],
        30_000,
    );
    assert!(
        r.status == ExecStatus::Oom
            || (r.status == ExecStatus::NonzeroExit
                && stderr(&r).contains("No space left on device")),
        "tmpfs bomb must end by OOM or ENOSPC: {r:?} {}",
        stderr(&r)
    );
    let used =
        cgroup_u64(&id, "memory.usage_in_bytes").or_else(|| cgroup_u64(&id, "memory.current"));
    assert!(
        used.is_some_and(|u| u <= 64 << 20),
        "memory usage above the limit: {used:?}"
    );
    assert!(time_true(&mut neighbour) < Duration::from_secs(2));
    // Freeing the shm file gives the sandbox back.
    sb.sh_prints("rm -f /dev/shm/bomb; echo freed", 10_000, "freed\n");

    sb.destroy().expect("destroy");
    neighbour.destroy().expect("destroy neighbour");
}

/// An OOM kill of a child of the main process (the common `sh -c 'python3 big.py'`) must be
/// reported as `oom`, and must not be attributed to a later, unrelated SIGKILL.
#[test]
fn r03_oom_of_a_shell_child_is_reported_as_oom() {
    let mut sb = create(small_limits());
    let r1 = sb.sh("python3 -c 's = b\"x\" * (1 << 30)'", 30_000);
    let kills = rt()
        .cgroups()
        .open(sb.id())
        .and_then(|c| c.stats().ok())
        .map(|s| s.oom_kills);
    // An unrelated SIGKILL of the main process afterwards.
    let r2 = sb.sh("kill -9 $$", 5000);
    assert_eq!(
        kills,
        Some(1),
        "the bomb did not cause exactly one OOM kill"
    );
    assert_eq!(
        (r1.status, r2.status),
        (ExecStatus::Oom, ExecStatus::Killed),
        "shell-wrapped OOM: {r1:?}\nlater `kill -9 $$`: {r2:?}"
    );
    sb.destroy().expect("destroy");
}

// ---------------------------------------------------------------------------------------------
//

#[test]
fn r04_disk_fill_and_inode_exhaustion_enospc_inside_only() {
    let mut sb = create(small_limits());
    let r = sb.sh("dd if=/dev/zero of=/tmp/fill bs=1M count=100", 30_000);
    assert_eq!(r.status, ExecStatus::NonzeroExit, "{r:?}");
    assert!(
        stderr(&r).contains("No space left on device"),
        "dd stderr: {}",
        stderr(&r)
    );
    let r = sb.sh("stat -c %s /tmp/fill", 5000);
    let size: u64 = stdout(&r).trim().parse().expect("size");
    assert!(
        size <= 16 << 20,
        "wrote {size} bytes with disk_bytes 16 MiB"
    );
    // The quota is shared by every scratch dir (one writable layer).
    let r = sb.sh("echo x > /var/tmp/more", 5000);
    assert_eq!(
        r.status,
        ExecStatus::NonzeroExit,
        "a second scratch dir escapes the quota: {r:?}"
    );
    sb.sh_prints(
        "rm /tmp/fill && dd if=/dev/zero of=/tmp/ok bs=1M count=4 2>/dev/null && echo ok",
        10_000,
        "ok\n",
    );
    sb.destroy().expect("destroy");

    let mut sb = create(Limits {
        disk_inodes: 512,
        ..small_limits()
    });
    let r = sb.sh(
        "i=0; while true > /tmp/f$i; do i=$((i+1)); done; echo $i",
        30_000,
    );
    assert_eq!(r.status, ExecStatus::Ok, "{r:?}");
    let files: u64 = stdout(&r).trim().parse().expect("file count");
    assert!(
        (64..=512).contains(&files),
        "created {files} files with disk_inodes 512"
    );
    assert!(
        stderr(&r).contains("No space left on device"),
        "inode exhaustion stderr: {}",
        stderr(&r)
    );
    sb.destroy().expect("destroy");

    // A fresh sandbox is unaffected.
    let mut fresh = create(small_limits());
    let r = fresh.sh(
        "dd if=/dev/zero of=/tmp/x bs=1M count=8 2>/dev/null && i=0; while [ $i -lt 100 ]; do true > /tmp/g$i || exit 1; i=$((i+1)); done; echo fine",
        10_000,
    );
    common::assert_ok_stdout(&r, "fine\n");
    fresh.destroy().expect("destroy fresh");
}

// ---------------------------------------------------------------------------------------------
//

#[test]
fn r05_file_beyond_rlimit_fsize() {
    let mut sb = create(Limits {
        file_size_max: 1 << 20,
        ..small_limits()
    });
    // Default disposition: SIGXFSZ kills the writer.
    let r = sb.sh("exec dd if=/dev/zero of=/tmp/big bs=1M count=2", 10_000);
    assert!(
        r.signal == Some(25) || stderr(&r).contains("File too large"),
        "dd past RLIMIT_FSIZE: {r:?} {}",
        stderr(&r)
    );
    assert_ne!(r.status, ExecStatus::Ok);
    let r = sb.sh("stat -c %s /tmp/big", 5000);
    assert_eq!(stdout(&r).trim(), "1048576", "file grew past RLIMIT_FSIZE");
    // SIGXFSZ ignored: the write fails with EFBIG.
    let r = sb.sh(
        "python3 -c '\nimport signal\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\nopen(\"/tmp/b\", \"wb\").write(b\"x\" * (2 << 20))\n'",
        20_000,
    );
    assert_eq!(r.status, ExecStatus::NonzeroExit, "{r:?}");
    assert!(
        stderr(&r).contains("File too large"),
        "python stderr: {}",
        stderr(&r)
    );
    sb.destroy().expect("destroy");
}

// ---------------------------------------------------------------------------------------------
//

#[test]
fn r06_cpu_spin_sleep_and_stdin_end_by_timeout() {
    let mut sb = create(small_limits());
    for script in ["while :; do :; done", "sleep 1000"] {
        let t = Instant::now();
        let r = sb.sh(script, 500);
        let took = t.elapsed();
        assert_eq!(r.status, ExecStatus::Timeout, "{script}: {r:?}");
        assert!(
            took < Duration::from_millis(1500),
            "{script}: timeout 500 ms took {took:?}"
        );
        assert!(
            r.wall_us >= 450_000,
            "{script}: killed before its timeout ({} us)",
            r.wall_us
        );
    }
    // stdin is closed after the (empty) body: `cat` returns at once.
    let t = Instant::now();
    let r = sb.sh("cat", 5000);
    assert_eq!(
        (r.status, r.stdout.data.len()),
        (ExecStatus::Ok, 0),
        "{r:?}"
    );
    assert!(t.elapsed() < Duration::from_secs(2));
    // With a body, cat echoes it and returns.
    let req = ExecRequest {
        timeout_ms: Some(5000),
        ..ExecRequest::shell("cat")
    };
    let r = sb
        .exec(rt(), &req, b"hello stdin", |_, _| {})
        .expect("exec cat");
    assert_eq!(stdout(&r), "hello stdin");
    // A reader of a pipe that never gets EOF (its own writer keeps it open) ends by timeout.
    let r = sb.sh("sleep 1000 | cat", 500);
    assert_eq!(r.status, ExecStatus::Timeout, "{r:?}");
    // CPU-time limit.
    let req = ExecRequest {
        timeout_ms: Some(10_000),
        cpu_limit_ms: Some(1000),
        ..ExecRequest::shell("while :; do :; done")
    };
    let r = sb.run(&req);
    assert_eq!(r.status, ExecStatus::Timeout, "cpu_limit_ms: {r:?}");
    assert!(
        r.wall_us < 5_000_000,
        "cpu limit took {} us of wall time",
        r.wall_us
    );
    sb.destroy().expect("destroy");
}

// ---------------------------------------------------------------------------------------------
//

/// Opens files in python until it fails; returns (count, errno name).
fn open_until_failure(sb: &mut SbGuard) -> (u64, String) {
    let code =
        "import errno\nfs = []\ntry:\n    while True:\n        fs.append(open('/dev/null'))\n\
                except OSError as e:\n    print(len(fs), errno.errorcode[e.errno])\n";
    let r = sb.argv(&["python3", "-c", code], 20_000);
    assert_eq!(r.status, ExecStatus::Ok, "{r:?} {}", stderr(&r));
    let out = stdout(&r);
    let mut it = out.split_whitespace();
    let n = it.next().and_then(|n| n.parse().ok()).expect("count");
    (n, it.next().unwrap_or_default().to_owned())
}

#[test]
fn r07_fd_exhaustion_open_files_max_honoured() {
    let mut sb = create(Limits {
        open_files_max: 200,
        ..small_limits()
    });
    let r = sb.sh("ulimit -n", 5000);
    assert_eq!(stdout(&r).trim(), "200");
    let (n, errno) = open_until_failure(&mut sb);
    assert_eq!(errno, "EMFILE");
    assert!(
        (150..200).contains(&n),
        "opened {n} files with open_files_max 200"
    );
    // The sandbox is fine afterwards.
    assert_eq!(stdout(&sb.sh("echo ok", 5000)), "ok\n");
    sb.destroy().expect("destroy");
}

/// Every `open_files_max` accepted by `Limits::validate` (16 and up) must give a working sandbox.
#[test]
fn r07_fd_exhaustion_small_open_files_max() {
    for max in [64u64, 16] {
        let limits = Limits {
            open_files_max: max,
            ..small_limits()
        };
        assert!(limits.validate().is_ok());
        let spec = SandboxSpec {
            limits: common::admitted(limits),
            ..Default::default()
        };
        let sb = match rt().create(&spec) {
            Ok((sb, _)) => sb,
            Err(e) => panic!("create with open_files_max {max} (valid per Limits::validate): {e}"),
        };
        let mut sb = common::adopt(sb);
        let r = sb.sh("ulimit -n", 5000);
        assert_eq!(stdout(&r).trim(), max.to_string());
        let (n, errno) = open_until_failure(&mut sb);
        assert_eq!(errno, "EMFILE");
        assert!(n < max, "opened {n} files with open_files_max {max}");
        sb.destroy().expect("destroy");
    }
}

#[test]
fn r07_huge_argv_rejected_with_typed_error() {
    let mut sb = create(small_limits());
    // Huge argv: rejected by validation with a typed error, on the node …
    let huge = "a".repeat(MAX_COMMAND_BYTES + 1);
    let req = ExecRequest::argv(["echo".to_owned(), huge.clone()]);
    let err = sb
        .exec(rt(), &req, b"", |_, _| {})
        .expect_err("argv > MAX_COMMAND_BYTES accepted");
    assert!(matches!(err, RuntimeError::Invalid(_)), "{err:?}");
    assert_eq!(err.code(), ErrorCode::InvalidRequest);
    let many = ExecRequest::argv(std::iter::repeat_n("x".to_owned(), MAX_ARGS + 1));
    let err = sb
        .exec(rt(), &many, b"", |_, _| {})
        .expect_err("argv > MAX_ARGS accepted");
    assert_eq!(err.code(), ErrorCode::InvalidRequest);
    let shell = ExecRequest::shell(format!("echo {huge}"));
    assert_eq!(
        sb.exec(rt(), &shell, b"", |_, _| {})
            .expect_err("huge shell")
            .code(),
        ErrorCode::InvalidRequest
    );
    // … and by the agent itself when the node's check is bypassed.
    match sb.agent().exec(&req, b"", |_, _| {}) {
        Err(AgentError::Remote { code, .. }) => assert_eq!(code, ErrorCode::InvalidRequest),
        other => panic!("agent accepted a huge argv: {other:?}"),
    }
    // The connection is still usable.
    sb.ping().expect("ping after rejected request");

    // 100 KiB argv works.
    let big = "b".repeat(100 << 10);
    let req = ExecRequest {
        timeout_ms: Some(10_000),
        ..ExecRequest::argv([
            "sh".to_owned(),
            "-c".into(),
            "printf %s \"${#1}\"".into(),
            "sh".into(),
            big,
        ])
    };
    let r = sb.run(&req);
    common::assert_ok_stdout(&r, "102400");
    sb.destroy().expect("destroy");
}

// ---------------------------------------------------------------------------------------------
//

#[test]
fn r08_output_flood_is_capped() {
    let mut sb = create(small_limits());
    let rss_before = our_rss_kb();
    let cap = 65536u64;
    let kill_after = cap * dsec_api::exec::OUTPUT_KILL_FACTOR;

    let flood = |sb: &mut SbGuard, script: &str| {
        let req = ExecRequest {
            timeout_ms: Some(60_000),
            output_limit: Some(cap),
            ..ExecRequest::shell(script)
        };
        let t = Instant::now();
        let r = sb.run(&req);
        (r, t.elapsed())
    };
    let (r, took) = flood(&mut sb, "yes | head -c 200000000");
    assert_eq!(
        r.status,
        ExecStatus::OutputLimit,
        "{:?}",
        (r.status, r.stdout.total, r.stdout.truncated)
    );
    assert!(r.stdout.truncated);
    assert_eq!(r.stdout.data.len() as u64, cap, "kept bytes");
    assert!(
        r.stdout.total > kill_after && r.stdout.total < 200_000_000,
        "total {}",
        r.stdout.total
    );
    assert!(r.stdout.data.starts_with(b"y\ny\n"));
    assert!(took < Duration::from_secs(20), "flood took {took:?}");

    // No newline, invalid UTF-8.
    let (r, took) = flood(&mut sb, "head -c 50000000 /dev/urandom");
    assert_eq!(
        r.status,
        ExecStatus::OutputLimit,
        "{:?}",
        (r.status, r.stdout.total)
    );
    assert!(r.stdout.truncated && r.stdout.data.len() as u64 == cap);
    assert!(took < Duration::from_secs(20), "binary flood took {took:?}");

    // Flood on stderr.
    let (r, _) = flood(&mut sb, "yes >&2");
    assert_eq!(r.status, ExecStatus::OutputLimit);
    assert!(r.stderr.truncated && r.stderr.data.len() as u64 == cap);

    // Below the kill bound: truncated, not killed.
    let (r, _) = flood(&mut sb, "head -c 1000000 /dev/zero");
    assert_eq!(r.status, ExecStatus::Ok);
    assert_eq!(
        (
            r.stdout.total,
            r.stdout.truncated,
            r.stdout.data.len() as u64
        ),
        (1_000_000, true, cap)
    );

    let grown = our_rss_kb().saturating_sub(rss_before);
    assert!(
        grown < 64 << 10,
        "node RSS grew by {grown} KiB during the floods"
    );

    // A grandchild holding the pipe does not hold the exec.
    let t = Instant::now();
    let r = sb.sh("sh -c 'sleep 100 & echo hi'", 30_000);
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "exec held by a grandchild for {:?}",
        t.elapsed()
    );
    common::assert_ok_stdout(&r, "hi\n");
    sb.destroy().expect("destroy");
}

// ---------------------------------------------------------------------------------------------
//

#[test]
fn r09_orphaned_zombies_are_reaped() {
    let mut sb = create(small_limits());
    let ns = ns_inode(sb.init_pid(), "pid").expect("pid ns");
    let r = sb.sh(
        "for i in $(seq 200); do (sleep 0 &) ; done; echo spawned",
        60_000,
    );
    common::assert_ok_stdout(&r, "spawned\n");
    let zombies_host = || {
        common::all_procs()
            .into_iter()
            .filter(|p| p.state == 'Z' && ns_inode(p.pid, "pid") == Some(ns))
            .count()
    };
    assert!(
        wait_until(Duration::from_secs(3), || zombies_host() == 0),
        "{} zombies in the sandbox",
        zombies_host()
    );
    // The check's own pipeline can show a just-exited member as a zombie for an instant before
    // its shell reaps it: look a few times.
    let zombie_check = "cat /proc/[0-9]*/stat 2>/dev/null | awk '$3==\"Z\"' | wc -l";
    let mut r = sb.sh(zombie_check, 10_000);
    for _ in 0..5 {
        if stdout(&r).trim() == "0" {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
        r = sb.sh(zombie_check, 10_000);
    }
    assert_eq!(stdout(&r).trim(), "0", "zombies seen inside: {r:?}");
    // Orphans that are still running when the exec ends are reaped once they exit.
    sb.sh_prints(
        "for i in $(seq 20); do (sleep 0.3 &) ; done; echo ok",
        10_000,
        "ok\n",
    );
    std::thread::sleep(Duration::from_millis(400));
    assert!(
        wait_until(Duration::from_secs(3), || zombies_host() == 0),
        "{} zombies in the sandbox",
        zombies_host()
    );
    assert!(
        wait_until(Duration::from_secs(3), || cgroup_u64(
            sb.id(),
            "pids.current"
        )
        .is_some_and(|n| n <= 2)),
        "orphans not reaped: pids.current = {:?}",
        cgroup_u64(sb.id(), "pids.current")
    );
    sb.destroy().expect("destroy");
}

// ---------------------------------------------------------------------------------------------
//

#[test]
fn r10_signals_to_the_agent_from_inside_are_survived() {
    let mut sb = create(small_limits());
    let init = sb.init_pid();
    sb.sh_prints(
        "for s in KILL TERM STOP INT HUP QUIT USR1 USR2 SEGV PIPE ALRM; do kill -s $s 1; done; echo sent",
        5000,
        "sent\n",
    );
    sb.ping().expect("agent answers ping after signals");
    let r = sb.sh("echo still-here", 5000);
    common::assert_ok_stdout(&r, "still-here\n");
    assert_eq!(sb.init_pid(), init);
    let state =
        std::fs::read_to_string(format!("/proc/{init}/stat")).expect("agent alive on the host");
    let after = &state[state.rfind(')').expect("stat") + 2..];
    assert!(!after.starts_with('T'), "agent stopped: {state}");
    // kill -9 -1 kills every process the caller may signal except itself and init.
    let r = sb.sh("sleep 30 & kill -9 -1; echo rc=$?", 5000);
    common::assert_ok_stdout(&r, "rc=0\n");
    sb.ping().expect("agent answers ping after kill -9 -1");
    assert_eq!(stdout(&sb.sh("echo ok", 5000)), "ok\n");
    // Also from a background process (`sleep`, not `wait`: see
    // `exec_children_start_with_an_empty_signal_mask` in lifecycle.rs).
    sb.sh_prints(
        "(sleep 0.2; kill -STOP 1; kill -KILL 1) & sleep 1; echo done",
        5000,
        "done\n",
    );
    sb.ping().expect("ping after background signals");
    sb.destroy().expect("destroy");
}

// ---------------------------------------------------------------------------------------------
//

#[test]
fn r12_kill_supervisor_kills_the_whole_tree() {
    let mut sb = create(small_limits());
    let id = sb.id().to_owned();
    let sup = sb.supervisor_pid();
    let init = sb.init_pid();
    let ns = ns_inode(init, "pid").expect("pid ns");
    sb.sh_prints(
        "setsid sleep 7312 </dev/null >/dev/null 2>&1 & echo bg",
        5000,
        "bg\n",
    );
    assert!(wait_until(Duration::from_secs(2), || procs_in_pid_ns(ns)
        .len()
        >= 2));
    assert!(rt().cgroups().open(&id).is_some());

    let members = live_procs_in_pid_ns(ns);
    let sup_pid = rustix::process::Pid::from_raw(sup).expect("supervisor pid");
    rustix::process::kill_process(sup_pid, rustix::process::Signal::KILL)
        .expect("kill the supervisor");
    let gone = |pid: i32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| s[s.rfind(')').map_or(0, |i| i + 2)..].starts_with('Z'))
            .unwrap_or(true)
    };
    let t = Instant::now();
    assert!(
        wait_until(Duration::from_secs(1), || gone(init)
            && common::members_alive(ns, &members).is_empty()),
        "sandbox tree alive {:?} after kill -9 of its supervisor: {:?}",
        t.elapsed(),
        common::members_alive(ns, &members)
            .iter()
            .map(|p| common::describe(*p))
            .collect::<Vec<_>>()
    );
    assert!(
        wait_until(Duration::from_secs(1), || gone(sup)),
        "supervisor still there"
    );

    // destroy still removes every trace (its verdict may report the dead supervisor).
    let run_dir = common::fixture().run_dir.join("sandboxes").join(&id);
    let verdict = sb.destroy();
    eprintln!("destroy after supervisor kill: {verdict:?}");
    assert!(
        rt().cgroups().open(&id).is_none(),
        "cgroup of {id} left behind"
    );
    assert!(!rt().cgroups().list().expect("list cgroups").contains(&id));
    assert!(
        !Path::new(&run_dir).exists(),
        "run dir {} left behind",
        run_dir.display()
    );
}
