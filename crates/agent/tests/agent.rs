//! Integration tests: start the real `dsec-agent` binary as a normal child process with one end
//! of a socketpair as its fd 3 and drive it with a small synchronous client.

use std::collections::HashMap;
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use dsec_api::agent::{Event, FileKind, Request, SessionKind};
use dsec_api::exec::{Command as Cmd, ExecRequest, ExecResult, ExecStatus, Stream};
use dsec_api::frame;
use dsec_api::ErrorCode;

type Inbox = Arc<(Mutex<HashMap<u64, Vec<(Event, Vec<u8>)>>>, Condvar)>;

struct Agent {
    child: Child,
    w: Mutex<UnixStream>,
    inbox: Inbox,
    next: AtomicU64,
    hello_pid: i32,
    _root: Option<tempfile::TempDir>,
}

impl Agent {
    fn start() -> Agent {
        Self::start_with_root(None)
    }

    fn start_with_root(root: Option<tempfile::TempDir>) -> Agent {
        let (ours, theirs) = UnixStream::pair().expect("socketpair");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_dsec-agent"));
        cmd.stdin(Stdio::null());
        if let Some(r) = &root {
            cmd.env("DSEC_AGENT_ROOT", r.path());
        }
        dsec_sys::proc::pass_fd3(&mut cmd, theirs.into());
        let child = cmd.spawn().expect("spawn agent");
        drop(cmd); // closes our copy of the agent's end
        let inbox: Inbox = Arc::new((Mutex::new(HashMap::new()), Condvar::new()));
        let mut reader = ours.try_clone().expect("clone");
        let ib = Arc::clone(&inbox);
        std::thread::spawn(move || {
            while let Ok(Some(raw)) = frame::read_frame(&mut reader) {
                let (env, body) = raw.into_event().expect("event frame");
                let (m, cv) = &*ib;
                m.lock()
                    .expect("lock")
                    .entry(env.id)
                    .or_default()
                    .push((env.ev, body));
                cv.notify_all();
            }
        });
        let mut a = Agent {
            child,
            w: Mutex::new(ours),
            inbox,
            next: AtomicU64::new(1),
            hello_pid: 0,
            _root: root,
        };
        let hello = a.wait_terminal(0, Duration::from_secs(10));
        match &hello[0].0 {
            Event::Hello { version, pid } => {
                assert_eq!(*version, dsec_api::agent::PROTOCOL_VERSION);
                a.hello_pid = *pid;
            }
            other => panic!("expected hello, got {other:?}"),
        }
        a
    }

    fn send(&self, req: &Request, body: &[u8]) -> u64 {
        let id = self.next.fetch_add(1, Ordering::SeqCst);
        let bytes = frame::encode_request(id, req, body).expect("encode");
        self.w
            .lock()
            .expect("lock")
            .write_all(&bytes)
            .expect("write");
        id
    }

    fn wait_terminal(&self, id: u64, timeout: Duration) -> Vec<(Event, Vec<u8>)> {
        let deadline = Instant::now() + timeout;
        let (m, cv) = &*self.inbox;
        let mut g = m.lock().expect("lock");
        loop {
            if g.get(&id)
                .is_some_and(|v| v.last().is_some_and(|(e, _)| e.is_terminal()))
            {
                return g.remove(&id).expect("present");
            }
            let now = Instant::now();
            assert!(now < deadline, "timeout waiting for request {id}");
            g = cv.wait_timeout(g, deadline - now).expect("wait").0;
        }
    }

    fn call_body(&self, req: Request, body: &[u8]) -> Vec<(Event, Vec<u8>)> {
        let id = self.send(&req, body);
        self.wait_terminal(id, Duration::from_secs(60))
    }

    fn call(&self, req: Request) -> Event {
        self.call_body(req, b"").pop().expect("terminal").0
    }

    fn exec_req(&self, r: ExecRequest, stdin: &[u8]) -> ExecResult {
        match self
            .call_body(Request::Exec(r), stdin)
            .pop()
            .expect("terminal")
            .0
        {
            Event::ExecDone(r) => r,
            other => panic!("expected exec_done, got {other:?}"),
        }
    }

    fn sh(&self, script: &str) -> ExecResult {
        self.exec_req(ExecRequest::shell(script), b"")
    }

    fn read(&self, path: &str) -> Result<Vec<u8>, ErrorCode> {
        let evs = self.call_body(
            Request::FileRead {
                path: path.into(),
                max_bytes: None,
            },
            b"",
        );
        data_of(evs)
    }

    /// Opens a session of `kind` (default environment and directory); returns its id.
    fn open_session(&self, kind: SessionKind) -> u64 {
        let ev = self.call(Request::SessionOpen {
            kind,
            env: Default::default(),
            cwd: None,
        });
        let Event::SessionOpened { session } = ev else {
            panic!("expected session, got {ev:?}")
        };
        session
    }

    /// Runs `input` in `session`; returns its result.
    fn session_run(&self, session: u64, input: &str, timeout_ms: Option<u64>) -> ExecResult {
        done(self.call(Request::SessionRun {
            session,
            input: input.into(),
            timeout_ms,
        }))
    }

    /// Waits up to `timeout_ms` for the background process `handle`, which must finish.
    fn wait_done(&self, handle: u64, timeout_ms: u64) -> ExecResult {
        done(self.call(Request::ProcWait { handle, timeout_ms }))
    }
}

/// The result an `exec_done` event carries.
fn done(ev: Event) -> ExecResult {
    match ev {
        Event::ExecDone(r) => r,
        other => panic!("unexpected {other:?}"),
    }
}

/// The bytes of a stream of `data` events, or the code of the error that ended it.
fn data_of(evs: Vec<(Event, Vec<u8>)>) -> Result<Vec<u8>, ErrorCode> {
    let mut out = Vec::new();
    for (e, b) in evs {
        match e {
            Event::Data { .. } => out.extend(b),
            Event::Error { code, .. } => return Err(code),
            other => panic!("unexpected {other:?}"),
        }
    }
    Ok(out)
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Checks `done` every `every` until it holds; fails with `failure()` once `timeout` has passed.
fn poll(
    timeout: Duration,
    every: Duration,
    mut done: impl FnMut() -> bool,
    failure: impl Fn() -> String,
) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(Instant::now() < deadline, "{}", failure());
        std::thread::sleep(every);
    }
}

fn code_of(ev: Event) -> ErrorCode {
    match ev {
        Event::Error { code, .. } => code,
        other => panic!("expected error, got {other:?}"),
    }
}

fn text(c: &dsec_api::exec::Captured) -> String {
    String::from_utf8_lossy(&c.data).into_owned()
}

#[test]
fn hello_ping_and_clean_exit() {
    let mut a = Agent::start();
    assert_eq!(a.hello_pid, a.child.id() as i32);
    assert_eq!(a.call(Request::Ping), Event::Pong);
    // EOF on the socket: the agent exits 0.
    let w = a.w.lock().expect("lock").try_clone().expect("clone");
    w.shutdown(std::net::Shutdown::Both).expect("shutdown");
    let exited = || {
        let st = a.child.try_wait().expect("try_wait");
        if let Some(st) = st {
            assert!(st.success(), "{st:?}");
        }
        st.is_some()
    };
    poll(
        Duration::from_secs(10),
        Duration::from_millis(10),
        exited,
        || "agent did not exit on EOF".to_owned(),
    );
}

#[test]
fn malformed_header_gets_invalid_request() {
    let a = Agent::start();
    // A valid frame prefix with a header that is JSON but not a request.
    let header = br#"{"id":77,"req":{"op":"no_such_op"}}"#;
    let mut bytes = Vec::from(frame::MAGIC);
    bytes.extend_from_slice(&[dsec_api::agent::PROTOCOL_VERSION, 0]);
    bytes.extend_from_slice(&(header.len() as u32).to_le_bytes());
    bytes.extend_from_slice(&0u32.to_le_bytes());
    bytes.extend_from_slice(header);
    a.w.lock().expect("lock").write_all(&bytes).expect("write");
    let ev = a
        .wait_terminal(77, Duration::from_secs(10))
        .pop()
        .expect("ev")
        .0;
    assert_eq!(code_of(ev), ErrorCode::InvalidRequest);
    assert_eq!(a.call(Request::Ping), Event::Pong);
}

#[test]
fn exec_ok_nonzero_env_stdin() {
    let a = Agent::start();
    let r = a.exec_req(ExecRequest::argv(["echo", "hi"]), b"");
    assert_eq!(r.status, ExecStatus::Ok);
    assert_eq!(text(&r.stdout), "hi\n");
    let r = a.sh("echo err >&2; exit 3");
    assert_eq!(r.status, ExecStatus::NonzeroExit);
    assert_eq!(r.exit_code, Some(3));
    assert_eq!(text(&r.stderr), "err\n");
    let mut req = ExecRequest::shell("echo $FOO");
    req.env.insert("FOO".into(), "bar".into());
    assert_eq!(text(&a.exec_req(req, b"").stdout), "bar\n");
    let r = a.exec_req(ExecRequest::argv(["cat"]), b"from stdin");
    assert_eq!(text(&r.stdout), "from stdin");
}

#[test]
fn exec_spawn_failure_and_cwd() {
    let a = Agent::start();
    // Many concurrent failed execs: std's own waitpid on exec failure must not race the reaper.
    let ids: Vec<u64> = (0..40)
        .map(|_| {
            a.send(
                &Request::Exec(ExecRequest::argv(["/definitely/missing"])),
                b"",
            )
        })
        .collect();
    for id in ids {
        let ev = a
            .wait_terminal(id, Duration::from_secs(30))
            .pop()
            .expect("ev")
            .0;
        assert_eq!(code_of(ev), ErrorCode::SpawnFailed);
    }
    let mut req = ExecRequest::argv(["pwd"]);
    req.cwd = Some("/tmp".into());
    assert_eq!(text(&a.exec_req(req, b"").stdout), "/tmp\n");
    let mut req = ExecRequest::argv(["pwd"]);
    req.cwd = Some("/../etc".into());
    assert_eq!(code_of(a.call(Request::Exec(req))), ErrorCode::PathEscape);
    let mut req = ExecRequest::argv(["pwd"]);
    req.cwd = Some("/proc/self/cwd".into());
    assert_eq!(code_of(a.call(Request::Exec(req))), ErrorCode::PathEscape);
    let mut req = ExecRequest::argv(["pwd"]);
    req.cwd = Some("/etc/passwd".into());
    assert_eq!(
        code_of(a.call(Request::Exec(req))),
        ErrorCode::WrongFileType
    );
}

#[test]
fn exec_timeout_and_cpu_limit() {
    let a = Agent::start();
    let mut req = ExecRequest::argv(["sleep", "30"]);
    req.timeout_ms = Some(200);
    let t = Instant::now();
    let r = a.exec_req(req, b"");
    assert_eq!(r.status, ExecStatus::Timeout);
    assert!(t.elapsed() < Duration::from_secs(5));
    let mut req = ExecRequest::shell("while :; do :; done");
    req.cpu_limit_ms = Some(500);
    req.timeout_ms = Some(20_000);
    let r = a.exec_req(req, b"");
    assert_eq!(r.status, ExecStatus::Timeout, "{r:?}");
    // RLIMIT_CPU is whole seconds (500 ms rounds up to 1 s); the kernel checks it on ticks
    // and the reaped rusage can read a little under it, so assert only the asked-for 500 ms.
    assert!(r.cpu_us >= 500_000, "{r:?}");
}

#[test]
fn exec_output_cap_and_flood() {
    let a = Agent::start();
    let mut req = ExecRequest::shell("seq 1 100000");
    req.output_limit = Some(1000);
    let r = a.exec_req(req, b"");
    assert_eq!(r.status, ExecStatus::Ok);
    assert!(r.stdout.truncated);
    assert_eq!(r.stdout.data.len(), 1000);
    assert!(r.stdout.data.starts_with(b"1\n2\n3\n"));
    assert!(r.stdout.data.ends_with(b"99999\n100000\n"));
    let expected: u64 = (1..=100000u64)
        .map(|n| n.to_string().len() as u64 + 1)
        .sum();
    assert_eq!(r.stdout.total, expected);
    let mut req = ExecRequest::shell("cat /dev/zero");
    req.output_limit = Some(1000);
    let r = a.exec_req(req, b"");
    assert_eq!(r.status, ExecStatus::OutputLimit);
    assert_eq!(r.stdout.data.len(), 1000);
}

#[test]
fn exec_returns_when_grandchild_holds_pipe() {
    let a = Agent::start();
    let t = Instant::now();
    let r = a.sh("sleep 100 & echo hi");
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "took {:?}",
        t.elapsed()
    );
    assert_eq!(text(&r.stdout), "hi\n");
    assert_eq!(a.call(Request::KillAll), Event::Ok);
}

#[test]
fn exec_streaming() {
    let a = Agent::start();
    let mut req = ExecRequest::shell("echo one; sleep 0.1; echo two >&2; echo three");
    req.stream = true;
    let evs = a.call_body(Request::Exec(req), b"");
    let mut out = Vec::new();
    let mut err = Vec::new();
    for (e, b) in &evs[..evs.len() - 1] {
        assert!(b.len() <= 64 << 10);
        match e {
            Event::Output {
                stream: Stream::Stdout,
            } => out.extend_from_slice(b),
            Event::Output {
                stream: Stream::Stderr,
            } => err.extend_from_slice(b),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(out, b"one\nthree\n");
    assert_eq!(err, b"two\n");
    match &evs.last().expect("done").0 {
        Event::ExecDone(r) => assert_eq!(text(&r.stdout), "one\nthree\n"),
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn concurrent_requests_do_not_block() {
    let a = Agent::start();
    let slow = a.send(&Request::Exec(ExecRequest::argv(["sleep", "2"])), b"");
    let t = Instant::now();
    assert_eq!(a.call(Request::Ping), Event::Pong);
    assert!(a.read("/etc/hostname").is_ok() || a.read("/etc/passwd").is_ok());
    assert!(t.elapsed() < Duration::from_secs(1));
    let r = a.wait_terminal(slow, Duration::from_secs(10));
    assert!(matches!(r[0].0, Event::ExecDone(_)));
}

#[test]
fn background_spawn_stdin_wait_signal() {
    let a = Agent::start();
    let Event::Started { handle, pid } = a
        .call_body(Request::Spawn(ExecRequest::argv(["cat"])), b"first ")
        .pop()
        .expect("ev")
        .0
    else {
        panic!("expected started")
    };
    assert!(pid > 0);
    assert_eq!(
        a.call(Request::ProcStatus { handle }),
        Event::ProcStatus { running: true, pid }
    );
    assert_eq!(
        a.call_body(Request::ProcStdin { handle, eof: true }, b"second")
            .pop()
            .expect("ev")
            .0,
        Event::Ok
    );
    let r = a.wait_done(handle, 5000);
    assert_eq!(r.status, ExecStatus::Ok);
    assert_eq!(text(&r.stdout), "first second");
    // The handle is forgotten after ExecDone.
    assert_eq!(
        code_of(a.call(Request::ProcStatus { handle })),
        ErrorCode::HandleNotFound
    );

    let Event::Started { handle, pid } =
        a.call(Request::Spawn(ExecRequest::argv(["sleep", "100"])))
    else {
        panic!("expected started")
    };
    assert_eq!(
        a.call(Request::ProcWait {
            handle,
            timeout_ms: 50
        }),
        Event::ProcStatus { running: true, pid }
    );
    assert_eq!(
        a.call(Request::ProcSignal { handle, signal: 15 }),
        Event::Ok
    );
    let r = a.wait_done(handle, 5000);
    assert_eq!(r.status, ExecStatus::Killed);
    assert_eq!(r.signal, Some(15));
    assert_eq!(
        code_of(a.call(Request::ProcSignal {
            handle: 999,
            signal: 9
        })),
        ErrorCode::HandleNotFound
    );
}

#[test]
fn shell_session_keeps_state() {
    let a = Agent::start();
    let session = a.open_session(SessionKind::Shell);
    let run = |input: &str| a.session_run(session, input, Some(10_000));
    run("cd /tmp; export XYZ=42; f() { echo \"f:$1\"; }; shvar=7");
    let r = run("pwd; echo $XYZ; f hello; echo $shvar; echo oops >&2; false");
    assert_eq!(text(&r.stdout), "/tmp\n42\nf:hello\n7\n");
    assert_eq!(text(&r.stderr), "oops\n");
    assert_eq!(r.exit_code, Some(1));
    assert_eq!(r.status, ExecStatus::NonzeroExit);
    let r = run("echo -n no-newline");
    assert_eq!(text(&r.stdout), "no-newline");
    let r = run("if then fi");
    assert_ne!(r.exit_code, Some(0));
    assert_eq!(run("echo still alive").exit_code, Some(0));
    // Timeout kills the session.
    let r = a.session_run(session, "sleep 30", Some(200));
    assert_eq!(r.status, ExecStatus::Timeout);
    let ev = a.call(Request::SessionRun {
        session,
        input: "true".into(),
        timeout_ms: None,
    });
    assert_eq!(code_of(ev), ErrorCode::HandleNotFound);
}

#[test]
fn python_session_keeps_globals_and_reports_exceptions() {
    assert!(
        std::path::Path::new("/usr/bin/python3").exists(),
        "/usr/bin/python3 is missing (scripts/test.sh installs it)"
    );
    let a = Agent::start();
    let session = a.open_session(SessionKind::Python);
    let run = |input: &str| a.session_run(session, input, Some(20_000));
    let r = run("x = 40\ndef g(v):\n    return v + 2\nprint('set')");
    assert_eq!(text(&r.stdout), "set\n");
    assert_eq!(r.exit_code, Some(0));
    let r = run("g(x)");
    assert_eq!(text(&r.stdout), "42\n");
    let r = run("raise ValueError('boom')");
    assert_eq!(r.exit_code, Some(1));
    assert!(
        text(&r.stderr).contains("ValueError: boom"),
        "{}",
        text(&r.stderr)
    );
    assert_eq!(text(&run("print(x)").stdout), "40\n");
    assert_eq!(a.call(Request::SessionClose { session }), Event::Ok);
    assert_eq!(
        code_of(a.call(Request::SessionClose { session })),
        ErrorCode::HandleNotFound
    );
}

#[test]
fn file_operations() {
    let a = Agent::start();
    let dir = tempfile::tempdir().expect("tmp");
    let d = dir.path().to_str().expect("utf8").to_owned();
    let f = format!("{d}/sub/a.txt");
    let ev = a.call_body(
        Request::FileWrite {
            path: f.clone(),
            mode: Some(0o600),
            parents: true,
        },
        b"hello",
    );
    assert_eq!(ev.last().expect("ev").0, Event::Ok);
    assert_eq!(a.read(&f).expect("read"), b"hello");
    match a.call(Request::FileStat { path: f.clone() }) {
        Event::Stat(st) => {
            assert_eq!(st.kind, FileKind::File);
            assert_eq!(st.size, 5);
            assert_eq!(st.mode, 0o600);
        }
        other => panic!("unexpected {other:?}"),
    }
    // Large file: several Data chunks.
    let big: Vec<u8> = (0..700_000u32).map(|i| (i % 251) as u8).collect();
    let bigp = format!("{d}/big.bin");
    a.call_body(
        Request::FileWrite {
            path: bigp.clone(),
            mode: None,
            parents: false,
        },
        &big,
    );
    assert_eq!(a.read(&bigp).expect("read"), big);
    let evs = a.call_body(
        Request::FileRead {
            path: bigp.clone(),
            max_bytes: Some(10),
        },
        b"",
    );
    assert_eq!(evs.iter().map(|(_, b)| b.len()).sum::<usize>(), 10);
    assert_eq!(
        a.call(Request::Mkdir {
            path: format!("{d}/m/n"),
            parents: true,
            mode: None
        }),
        Event::Ok
    );
    let ev = a.call(Request::Mkdir {
        path: format!("{d}/x/y"),
        parents: false,
        mode: None,
    });
    assert_eq!(code_of(ev), ErrorCode::NotFound);
    std::os::unix::fs::symlink("sub/a.txt", dir.path().join("link")).expect("symlink");
    match a.call(Request::FileList { path: d.clone() }) {
        Event::Listing { entries } => {
            let names: Vec<_> = entries.iter().map(|e| e.name.as_str()).collect();
            assert_eq!(names, vec!["big.bin", "link", "m", "sub"]);
            assert_eq!(entries[1].kind, FileKind::Symlink);
            assert_eq!(entries[1].link_target.as_deref(), Some("sub/a.txt"));
        }
        other => panic!("unexpected {other:?}"),
    }
    match a.call(Request::FileStat {
        path: format!("{d}/link"),
    }) {
        Event::Stat(st) => assert_eq!(st.kind, FileKind::Symlink),
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(
        code_of(a.call(Request::FileStat {
            path: format!("{d}/nope")
        })),
        ErrorCode::NotFound
    );
    assert_eq!(a.read(&d).expect_err("dir"), ErrorCode::WrongFileType);
    assert_eq!(
        code_of(a.call(Request::Remove {
            path: format!("{d}/sub"),
            recursive: false
        })),
        ErrorCode::WrongFileType
    );
    // Recursive remove does not follow the symlink to sub/.
    std::os::unix::fs::symlink(dir.path().join("sub"), dir.path().join("m/escape"))
        .expect("symlink");
    assert_eq!(
        a.call(Request::Remove {
            path: format!("{d}/m"),
            recursive: true
        }),
        Event::Ok
    );
    assert!(dir.path().join("sub/a.txt").exists());
    assert!(!dir.path().join("m").exists());
    assert_eq!(
        a.call(Request::Remove {
            path: f.clone(),
            recursive: false
        }),
        Event::Ok
    );
    assert!(!dir.path().join("sub/a.txt").exists());
}

#[test]
fn paths_stay_inside_root() {
    let root = tempfile::tempdir().expect("tmp");
    std::fs::create_dir_all(root.path().join("a/b")).expect("mkdir");
    std::os::unix::fs::symlink("../../..", root.path().join("a/b/up")).expect("symlink");
    std::os::unix::fs::symlink("/", root.path().join("abs")).expect("symlink");
    std::fs::write(root.path().join("inside"), b"in").expect("write");
    let a = Agent::start_with_root(Some(root));
    // Symlinks resolve inside the root: the host's /etc/passwd is never reachable.
    for p in [
        "/a/b/up/etc/passwd",
        "/abs/etc/passwd",
        "a/b/up/up/etc/passwd",
    ] {
        let r = a.read(p);
        assert!(
            matches!(r, Err(ErrorCode::NotFound | ErrorCode::PathEscape)),
            "{p}: {r:?}"
        );
    }
    assert_eq!(a.read("/a/b/up/inside").expect("inside"), b"in");
    assert_eq!(a.read("/abs/inside").expect("inside"), b"in");
    assert_eq!(
        a.read("/../etc/passwd").expect_err("escape"),
        ErrorCode::PathEscape
    );
    // Writing through a symlink stays inside too.
    let ev = a.call_body(
        Request::FileWrite {
            path: "/abs/tmp-written".into(),
            mode: None,
            parents: false,
        },
        b"x",
    );
    assert_eq!(ev.last().expect("ev").0, Event::Ok);
    assert!(!std::path::Path::new("/tmp-written").exists());
    // cwd resolves inside the root as well.
    let mut req = ExecRequest::argv(["pwd"]);
    req.cwd = Some("/a/b/up/a".into());
    let r = a.exec_req(req, b"");
    assert!(text(&r.stdout).trim_end().ends_with("/a"), "{r:?}");
    assert!(text(&r.stdout).trim_end() != "/a");
}

fn tar_with(entries: &[(&str, tar::EntryType, &[u8], Option<&str>)]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (path, kind, data, link) in entries {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(*kind);
        h.set_mode(0o4755);
        h.set_size(data.len() as u64);
        // Bypass the builder's own path validation to craft hostile names.
        let name = h.as_old_mut().name.as_mut();
        name[..path.len()].copy_from_slice(path.as_bytes());
        if let Some(l) = link {
            h.set_link_name(l).expect("link");
        }
        h.set_cksum();
        b.append(&h, *data).expect("append");
    }
    b.into_inner().expect("finish")
}

#[test]
fn tar_upload_rejects_hostile_entries() {
    let a = Agent::start();
    let dir = tempfile::tempdir().expect("tmp");
    let d = dir.path().to_str().expect("utf8").to_owned();
    let up = |body: Vec<u8>| {
        a.call_body(Request::TarUpload { path: d.clone() }, &body)
            .pop()
            .expect("ev")
            .0
    };
    let escape = tar_with(&[("../evil", tar::EntryType::Regular, b"x", None)]);
    assert_eq!(code_of(up(escape)), ErrorCode::PathEscape);
    let abs = tar_with(&[("/tmp/evil", tar::EntryType::Regular, b"x", None)]);
    assert_eq!(code_of(up(abs)), ErrorCode::PathEscape);
    let link = tar_with(&[("l", tar::EntryType::Symlink, b"", Some("/etc"))]);
    assert_eq!(code_of(up(link)), ErrorCode::PathEscape);
    let hard = tar_with(&[("h", tar::EntryType::Link, b"", Some("../../etc/passwd"))]);
    assert_eq!(code_of(up(hard)), ErrorCode::PathEscape);
    let dev = tar_with(&[("null", tar::EntryType::Char, b"", None)]);
    assert_eq!(code_of(up(dev)), ErrorCode::InvalidRequest);
    let ok = tar_with(&[("ok/file", tar::EntryType::Regular, b"data", None)]);
    assert_eq!(up(ok), Event::Ok);
    let meta = std::fs::metadata(dir.path().join("ok/file")).expect("unpacked");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(meta.permissions().mode() & 0o7777, 0o755, "setuid dropped");
    assert_eq!(
        code_of(up(b"not a tar archive at all, definitely".repeat(20))),
        ErrorCode::InvalidRequest
    );
}

#[test]
fn tar_round_trip() {
    let a = Agent::start();
    let src = tempfile::tempdir().expect("tmp");
    std::fs::create_dir_all(src.path().join("d/e")).expect("mkdir");
    std::fs::write(src.path().join("d/e/f.txt"), b"deep").expect("write");
    std::fs::write(src.path().join("top"), vec![7u8; 300_000]).expect("write");
    std::os::unix::fs::symlink("d/e/f.txt", src.path().join("ln")).expect("symlink");
    std::os::unix::fs::symlink("/etc/passwd", src.path().join("abs-ln")).expect("symlink");
    let s = src.path().to_str().expect("utf8").to_owned();
    let evs = a.call_body(
        Request::TarDownload {
            path: s.clone(),
            max_bytes: None,
        },
        b"",
    );
    let tarball = data_of(evs).expect("tar data");
    // Too small a bound fails with too_large.
    let ev = a
        .call_body(
            Request::TarDownload {
                path: s.clone(),
                max_bytes: Some(1000),
            },
            b"",
        )
        .pop()
        .expect("ev")
        .0;
    assert_eq!(code_of(ev), ErrorCode::TooLarge);
    // The absolute symlink cannot be uploaded back; drop it from the source and retry.
    std::fs::remove_file(src.path().join("abs-ln")).expect("rm");
    let evs = a.call_body(
        Request::TarDownload {
            path: s.clone(),
            max_bytes: None,
        },
        b"",
    );
    let tarball2: Vec<u8> = evs.into_iter().flat_map(|(_, b)| b).collect();
    assert!(tarball2.len() < tarball.len());
    let dst = tempfile::tempdir().expect("tmp");
    let dpath = format!("{}/new", dst.path().to_str().expect("utf8"));
    let ev = a
        .call_body(
            Request::TarUpload {
                path: dpath.clone(),
            },
            &tarball2,
        )
        .pop()
        .expect("ev")
        .0;
    assert_eq!(ev, Event::Ok);
    assert_eq!(
        std::fs::read(format!("{dpath}/d/e/f.txt")).expect("read"),
        b"deep"
    );
    assert_eq!(
        std::fs::read(format!("{dpath}/top")).expect("read"),
        vec![7u8; 300_000]
    );
    assert_eq!(
        std::fs::read_link(format!("{dpath}/ln")).expect("link"),
        std::path::Path::new("d/e/f.txt")
    );
}

fn zombie_children(pid: u32) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").expect("proc").flatten() {
        let Ok(status) = std::fs::read_to_string(e.path().join("status")) else {
            continue;
        };
        let ppid = status
            .lines()
            .find_map(|l| l.strip_prefix("PPid:"))
            .map(|v| v.trim().to_owned());
        let state = status
            .lines()
            .find_map(|l| l.strip_prefix("State:"))
            .unwrap_or("")
            .trim()
            .to_owned();
        if ppid.as_deref() == Some(&pid.to_string()) && state.starts_with('Z') {
            out.push(format!("{:?} {state}", e.file_name()));
        }
    }
    out
}

#[test]
fn zombies_are_reaped() {
    let a = Agent::start();
    for _ in 0..30 {
        let r = a.sh("(sleep 0 &) ; exit 0");
        assert_eq!(r.status, ExecStatus::Ok);
    }
    let zombies = || zombie_children(a.child.id());
    poll(
        Duration::from_secs(5),
        Duration::from_millis(20),
        || zombies().is_empty(),
        || format!("zombies left: {:?}", zombies()),
    );
}

#[test]
fn kill_all_kills_only_our_processes() {
    let a = Agent::start();
    let Event::Started { handle, .. } = a.call(Request::Spawn(ExecRequest::shell(
        "sleep 100 & sleep 100; wait",
    ))) else {
        panic!("expected started")
    };
    a.sh("sleep 100 >/dev/null 2>&1 &");
    let session = a.open_session(SessionKind::Shell);
    // A process of the test itself (not started by the agent) must survive.
    let mut bystander = Command::new("sleep").arg("100").spawn().expect("spawn");
    let t = Instant::now();
    assert_eq!(a.call(Request::KillAll), Event::Ok);
    assert!(t.elapsed() < Duration::from_secs(5));
    assert!(
        bystander.try_wait().expect("try_wait").is_none(),
        "bystander killed"
    );
    let _ = bystander.kill();
    let _ = bystander.wait();
    let children = std::fs::read_to_string(format!(
        "/proc/{}/task/{}/children",
        a.child.id(),
        a.child.id()
    ))
    .unwrap_or_default();
    assert!(children.trim().is_empty(), "children left: {children}");
    assert_eq!(
        code_of(a.call(Request::ProcStatus { handle })),
        ErrorCode::HandleNotFound
    );
    let ev = a.call(Request::SessionRun {
        session,
        input: "true".into(),
        timeout_ms: None,
    });
    assert_eq!(code_of(ev), ErrorCode::HandleNotFound);
    assert_eq!(a.call(Request::Ping), Event::Pong);
}

#[test]
fn binary_is_static() {
    let bytes = std::fs::read(env!("CARGO_BIN_EXE_dsec-agent")).expect("read binary");
    assert_eq!(&bytes[..4], b"\x7fELF");
    assert_eq!(bytes[4], 2, "64-bit ELF");
    let u16_at = |o: usize| u16::from_le_bytes([bytes[o], bytes[o + 1]]) as usize;
    let u64_at =
        |o: usize| u64::from_le_bytes(bytes[o..o + 8].try_into().expect("8 bytes")) as usize;
    let phoff = u64_at(0x20);
    let phentsize = u16_at(0x36);
    let phnum = u16_at(0x38);
    for i in 0..phnum {
        let p_type = u32::from_le_bytes(
            bytes[phoff + i * phentsize..][..4]
                .try_into()
                .expect("4 bytes"),
        );
        assert_ne!(p_type, 3, "PT_INTERP present: binary is dynamically linked");
    }
    // Position-dependent (ET_EXEC), so that no start-up relocation writes a private copy of
    // its read-only data in each of thousands of agents (scripts/link-static.sh).
    assert_eq!(
        u16_at(0x10),
        2,
        "e_type: the agent must be ET_EXEC, not a PIE"
    );
}

#[test]
fn the_reaper_thread_starts_with_the_first_spawn() {
    let a = Agent::start();
    let threads = || {
        std::fs::read_dir(format!("/proc/{}/task", a.child.id()))
            .expect("task dir")
            .count()
    };
    assert_eq!(a.call(Request::Ping), Event::Pong);
    assert_eq!(
        threads(),
        1,
        "an agent that has spawned nothing runs one thread"
    );
    assert_eq!(a.sh("exit 0").status, ExecStatus::Ok);
    // The exec was reaped, so the reaper runs; and it keeps reaping later children.
    assert!(threads() >= 2, "no reaper thread after a spawn");
    assert_eq!(a.sh("exit 3").exit_code, Some(3));
}

#[test]
fn exec_argv_shell_variants() {
    let a = Agent::start();
    let r = a.exec_req(
        ExecRequest {
            command: Cmd::Shell("echo $0".into()),
            ..ExecRequest::shell("")
        },
        b"",
    );
    assert_eq!(text(&r.stdout), "/bin/sh\n");
    assert!(r.wall_us > 0);
}

// Background processes that are followed: streaming spawns, attach, detach, list, terminals.

impl Agent {
    /// The events of request `id` so far, once `cond` holds for them (they stay in the inbox).
    fn events_when(
        &self,
        id: u64,
        timeout: Duration,
        cond: impl Fn(&[(Event, Vec<u8>)]) -> bool,
    ) -> Vec<(Event, Vec<u8>)> {
        let deadline = Instant::now() + timeout;
        let (m, cv) = &*self.inbox;
        let mut g = m.lock().expect("lock");
        loop {
            let evs = g.get(&id).cloned().unwrap_or_default();
            if cond(&evs) {
                return evs;
            }
            let now = Instant::now();
            assert!(now < deadline, "timeout waiting for request {id}: {evs:?}");
            g = cv.wait_timeout(g, deadline - now).expect("wait").0;
        }
    }

    /// Sends a streaming `Spawn` of `req`; returns its request id, handle and pid.
    fn spawn_followed(&self, mut req: ExecRequest, stdin: &[u8]) -> (u64, u64, i32) {
        req.stream = true;
        let id = self.send(&Request::Spawn(req), stdin);
        let evs = self.events_when(id, Duration::from_secs(10), |e| !e.is_empty());
        match evs[0].0 {
            Event::Attached { handle, pid } => (id, handle, pid),
            ref other => panic!("expected attached, got {other:?}"),
        }
    }

    /// Sends a `ProcAttach`; returns its request id once `Attached` came.
    fn attach(&self, handle: u64) -> u64 {
        let id = self.send(&Request::ProcAttach { handle }, b"");
        let evs = self.events_when(id, Duration::from_secs(10), |e| !e.is_empty());
        assert!(
            matches!(evs[0].0, Event::Attached { handle: h, .. } if h == handle),
            "{evs:?}"
        );
        id
    }
}

/// The bytes of the `Output` events of `evs`, per stream.
fn outputs(evs: &[(Event, Vec<u8>)]) -> (String, String) {
    let (mut out, mut err) = (Vec::new(), Vec::new());
    for (e, b) in evs {
        match e {
            Event::Output {
                stream: Stream::Stdout,
            } => out.extend_from_slice(b),
            Event::Output {
                stream: Stream::Stderr,
            } => err.extend_from_slice(b),
            _ => {}
        }
    }
    (
        String::from_utf8_lossy(&out).into_owned(),
        String::from_utf8_lossy(&err).into_owned(),
    )
}

fn terminal_of(evs: &[(Event, Vec<u8>)]) -> &Event {
    &evs.last().expect("events").0
}

#[test]
fn follow_a_streaming_spawn_to_its_end() {
    let a = Agent::start();
    let (id, handle, pid) =
        a.spawn_followed(ExecRequest::shell("echo out; echo err >&2; exit 3"), b"");
    assert!(pid > 0);
    let evs = a.wait_terminal(id, Duration::from_secs(10));
    assert!(matches!(evs[0].0, Event::Attached { .. }), "{evs:?}");
    assert_eq!(outputs(&evs), ("out\n".into(), "err\n".into()));
    let Event::ExecDone(r) = terminal_of(&evs) else {
        panic!("{evs:?}")
    };
    assert_eq!((r.status, r.exit_code), (ExecStatus::NonzeroExit, Some(3)));
    assert_eq!(text(&r.stdout), "out\n");
    // The follower had the result: the handle is forgotten.
    poll(
        Duration::from_secs(5),
        Duration::from_millis(10),
        || {
            matches!(
                a.call(Request::ProcStatus { handle }),
                Event::Error {
                    code: ErrorCode::HandleNotFound,
                    ..
                }
            )
        },
        || "the handle of a followed process outlives its result".into(),
    );
    // stdin_closed: the body, then the end of input.
    let mut req = ExecRequest::argv(["cat"]);
    req.stdin_closed = true;
    let (id, _, _) = a.spawn_followed(req, b"fed");
    let evs = a.wait_terminal(id, Duration::from_secs(10));
    assert_eq!(outputs(&evs).0, "fed");
    assert!(matches!(terminal_of(&evs), Event::ExecDone(r) if r.status == ExecStatus::Ok));
}

#[test]
fn attach_mid_way_then_detach() {
    let a = Agent::start();
    let Event::Started { handle, .. } = a.call(Request::Spawn(ExecRequest::shell(
        "for i in 1 2 3; do echo $i; sleep 0.2; done",
    ))) else {
        panic!("expected started")
    };
    std::thread::sleep(Duration::from_millis(300));
    let f = a.attach(handle);
    let evs = a.wait_terminal(f, Duration::from_secs(10));
    let (out, _) = outputs(&evs);
    assert!(!out.contains('1') && out.contains('3'), "{out:?}");
    let Event::ExecDone(r) = terminal_of(&evs) else {
        panic!("{evs:?}")
    };
    assert_eq!(text(&r.stdout), "1\n2\n3\n");
    // Delivered to a follower: a later wait finds no handle.
    poll(
        Duration::from_secs(5),
        Duration::from_millis(10),
        || {
            matches!(
                a.call(Request::ProcStatus { handle }),
                Event::Error {
                    code: ErrorCode::HandleNotFound,
                    ..
                }
            )
        },
        || "the handle of a followed process outlives its result".into(),
    );

    // Attaching to a process that exited unfollowed: its result at once.
    let Event::Started { handle, .. } = a.call(Request::Spawn(ExecRequest::shell("echo gone")))
    else {
        panic!("expected started")
    };
    poll(
        Duration::from_secs(5),
        Duration::from_millis(10),
        || {
            matches!(
                a.call(Request::ProcStatus { handle }),
                Event::ProcStatus { running: false, .. }
            )
        },
        || "did not exit".into(),
    );
    let f = a.attach(handle);
    let evs = a.wait_terminal(f, Duration::from_secs(10));
    assert!(matches!(terminal_of(&evs), Event::ExecDone(r) if text(&r.stdout) == "gone\n"));

    // Detach: the follower ends with `Detached`, the process goes on.
    let Event::Started { handle, pid } = a.call(Request::Spawn(ExecRequest::shell(
        "while true; do echo x; sleep 0.05; done",
    ))) else {
        panic!("expected started")
    };
    let f = a.attach(handle);
    let g = a.attach(handle);
    a.events_when(f, Duration::from_secs(5), |e| e.len() >= 3);
    assert_eq!(a.call(Request::ProcDetach { handle, attach: f }), Event::Ok);
    let evs = a.wait_terminal(f, Duration::from_secs(5));
    assert_eq!(terminal_of(&evs), &Event::Detached);
    assert_eq!(
        a.call(Request::ProcStatus { handle }),
        Event::ProcStatus { running: true, pid }
    );
    // The other follower still gets output, and the end.
    let before = a
        .events_when(g, Duration::from_secs(5), |e| e.len() >= 2)
        .len();
    a.events_when(g, Duration::from_secs(5), |e| e.len() > before);
    assert_eq!(a.call(Request::ProcSignal { handle, signal: 9 }), Event::Ok);
    let evs = a.wait_terminal(g, Duration::from_secs(10));
    assert!(matches!(terminal_of(&evs), Event::ExecDone(r) if r.status == ExecStatus::Killed));
    // Detaching from an unknown handle.
    assert_eq!(
        code_of(a.call(Request::ProcDetach {
            handle: 9999,
            attach: 1
        })),
        ErrorCode::HandleNotFound
    );
}

#[test]
fn proc_list_shows_running_processes_with_their_request() {
    let a = Agent::start();
    let mut req = ExecRequest::argv(["sleep", "30"]);
    req.tag = Some("server".into());
    req.env.insert("K".into(), "v".into());
    req.cwd = Some("/tmp".into());
    let Event::Started { handle: h1, pid } = a.call(Request::Spawn(req.clone())) else {
        panic!("expected started")
    };
    let Event::Started { handle: h2, .. } = a.call(Request::Spawn(ExecRequest::argv(["true"])))
    else {
        panic!("expected started")
    };
    let mut pty = ExecRequest::argv(["sleep", "30"]);
    pty.pty = Some(dsec_api::exec::PtySize { rows: 5, cols: 10 });
    let Event::Started { handle: h3, .. } = a.call(Request::Spawn(pty)) else {
        panic!("expected started")
    };
    // `true` exits: listed no more (its handle stays, for ProcWait).
    let list = || match a.call(Request::ProcList) {
        Event::Procs { items } => items,
        other => panic!("expected procs, got {other:?}"),
    };
    poll(
        Duration::from_secs(5),
        Duration::from_millis(10),
        || list().len() == 2,
        || format!("{:?}", list()),
    );
    let items = list();
    assert_eq!(
        items.iter().map(|i| (i.handle, i.pty)).collect::<Vec<_>>(),
        [(h1, false), (h3, true)]
    );
    assert_eq!(items[0].pid, pid);
    assert_eq!(items[0].tag.as_deref(), Some("server"));
    assert_eq!(items[0].env.get("K").map(String::as_str), Some("v"));
    assert_eq!(items[0].cwd.as_deref(), Some("/tmp"));
    assert_eq!(items[0].command, req.command);
    assert!(matches!(a.wait_done(h2, 5000).status, ExecStatus::Ok));
    for h in [h1, h3] {
        assert_eq!(
            a.call(Request::ProcSignal {
                handle: h,
                signal: 9
            }),
            Event::Ok
        );
        a.wait_done(h, 5000);
    }
    assert_eq!(a.call(Request::ProcList), Event::Procs { items: vec![] });
}

#[test]
fn pty_size_resize_and_input() {
    let a = Agent::start();
    let mut req = ExecRequest::shell("test -t 0 && stty size; read x; stty size; echo bye >&2");
    req.pty = Some(dsec_api::exec::PtySize { rows: 24, cols: 80 });
    let (id, handle, _) = a.spawn_followed(req, b"");
    a.events_when(id, Duration::from_secs(10), |e| {
        outputs(e).0.contains("24 80")
    });
    assert_eq!(
        a.call(Request::ProcResize {
            handle,
            size: dsec_api::exec::PtySize {
                rows: 50,
                cols: 132
            }
        }),
        Event::Ok
    );
    assert_eq!(
        a.call_body(Request::ProcStdin { handle, eof: false }, b"go\n")
            .pop()
            .expect("ev")
            .0,
        Event::Ok
    );
    let evs = a.wait_terminal(id, Duration::from_secs(10));
    let (out, err) = outputs(&evs);
    // Everything the terminal shows comes as stdout: stderr too, and the echoed input.
    assert!(
        out.contains("50 132") && out.contains("go") && out.contains("bye"),
        "{out:?}"
    );
    assert_eq!(err, "");
    assert!(matches!(terminal_of(&evs), Event::ExecDone(r) if r.status == ExecStatus::Ok));
    // A process without a terminal cannot be resized; a size out of bounds is refused.
    let Event::Started { handle, .. } = a.call(Request::Spawn(ExecRequest::argv(["sleep", "5"])))
    else {
        panic!("expected started")
    };
    let resize = |rows| Request::ProcResize {
        handle,
        size: dsec_api::exec::PtySize { rows, cols: 10 },
    };
    assert_eq!(code_of(a.call(resize(10))), ErrorCode::InvalidRequest);
    assert_eq!(code_of(a.call(resize(0))), ErrorCode::InvalidRequest);
    assert_eq!(a.call(Request::ProcSignal { handle, signal: 9 }), Event::Ok);

    // `cat` on a terminal: input is echoed and copied; the end of input (after a line left
    // open) ends it.
    let mut req = ExecRequest::argv(["cat"]);
    req.pty = Some(dsec_api::exec::PtySize { rows: 24, cols: 80 });
    let (id, handle, _) = a.spawn_followed(req, b"hello\n");
    a.events_when(id, Duration::from_secs(10), |e| {
        outputs(e).0.matches("hello").count() >= 2
    });
    assert_eq!(
        a.call_body(Request::ProcStdin { handle, eof: true }, b"tail")
            .pop()
            .expect("ev")
            .0,
        Event::Ok
    );
    let evs = a.wait_terminal(id, Duration::from_secs(10));
    assert!(
        outputs(&evs).0.matches("tail").count() >= 2,
        "{:?}",
        outputs(&evs)
    );
    assert!(
        matches!(terminal_of(&evs), Event::ExecDone(r) if r.status == ExecStatus::Ok),
        "{evs:?}"
    );
}

#[test]
fn followed_processes_that_exit_leave_the_table() {
    let a = Agent::start();
    // More followed processes than the table holds, one after another.
    for i in 0..1100 {
        let (id, _, _) = a.spawn_followed(ExecRequest::argv(["true"]), b"");
        let evs = a.wait_terminal(id, Duration::from_secs(10));
        assert!(
            matches!(terminal_of(&evs), Event::ExecDone(r) if r.status == ExecStatus::Ok),
            "spawn {i}: {evs:?}"
        );
    }
    let Event::Started { handle, .. } = a.call(Request::Spawn(ExecRequest::argv(["true"]))) else {
        panic!("the table is full")
    };
    a.wait_done(handle, 5000);
}

// Renames, owners, watches.

/// A test root with `dirs` made.
fn root_with(dirs: &[&str]) -> tempfile::TempDir {
    let root = tempfile::tempdir().expect("tmp");
    for d in dirs {
        std::fs::create_dir_all(root.path().join(d)).expect("mkdir");
    }
    root
}

/// The changes the `FsEvents` of `evs` report, in order.
fn fs_events(evs: &[(Event, Vec<u8>)]) -> Vec<(String, dsec_api::agent::FsOp)> {
    evs.iter()
        .filter_map(|(e, _)| match e {
            Event::FsEvents { events } => Some(events.iter().map(|f| (f.name.clone(), f.op))),
            _ => None,
        })
        .flatten()
        .collect()
}

/// Whether `want` occurs in `got` in order (other changes may come between).
fn in_order(
    got: &[(String, dsec_api::agent::FsOp)],
    want: &[(&str, dsec_api::agent::FsOp)],
) -> bool {
    let mut it = got.iter();
    want.iter()
        .all(|(n, op)| it.any(|(gn, gop)| gn == n && gop == op))
}

impl Agent {
    /// Starts watching `path`; returns the request id once `Watching` came.
    fn watch(&self, path: &str, recursive: bool) -> u64 {
        let id = self.send(
            &Request::Watch {
                path: path.into(),
                recursive,
            },
            b"",
        );
        let evs = self.events_when(id, Duration::from_secs(10), |e| !e.is_empty());
        assert_eq!(evs[0].0, Event::Watching, "{evs:?}");
        id
    }

    /// The changes watch `id` reported so far, once `want` is among them in order.
    fn changes(
        &self,
        id: u64,
        want: &[(&str, dsec_api::agent::FsOp)],
    ) -> Vec<(String, dsec_api::agent::FsOp)> {
        let evs = self.events_when(id, Duration::from_secs(10), |e| {
            in_order(&fs_events(e), want)
        });
        fs_events(&evs)
    }

    /// Ends watch `id`: the `Unwatch` gets `Ok`, the watch `Detached`.
    fn unwatch(&self, id: u64) -> Vec<(Event, Vec<u8>)> {
        assert_eq!(self.call(Request::Unwatch { watch: id }), Event::Ok);
        let evs = self.wait_terminal(id, Duration::from_secs(10));
        assert_eq!(terminal_of(&evs), &Event::Detached, "{evs:?}");
        evs
    }

    fn rename(&self, from: &str, to: &str) -> Event {
        self.call(Request::FileRename {
            from: from.into(),
            to: to.into(),
        })
    }
}

#[test]
fn file_rename_within_and_across_directories() {
    let root = root_with(&["a", "b"]);
    let r = root.path().to_owned();
    std::fs::write(r.join("a/f"), b"one").expect("write");
    std::fs::write(r.join("b/h"), b"old").expect("write");
    std::os::unix::fs::symlink("/", r.join("abs")).expect("symlink");
    let a = Agent::start_with_root(Some(root));
    // Within a directory, then across, then over an existing file.
    assert_eq!(a.rename("/a/f", "/a/g"), Event::Ok);
    assert_eq!(a.rename("a/g", "/b/g"), Event::Ok);
    assert_eq!(a.rename("/b/g", "/b/h"), Event::Ok);
    assert_eq!(a.read("/b/h").expect("read"), b"one");
    assert!(!r.join("a/f").exists() && !r.join("b/g").exists());
    // A directory moves with what it holds.
    assert_eq!(a.rename("/b", "/a/b2"), Event::Ok);
    assert_eq!(a.read("/a/b2/h").expect("read"), b"one");
    // Missing source or destination parent.
    assert_eq!(code_of(a.rename("/a/nope", "/a/x")), ErrorCode::NotFound);
    assert_eq!(code_of(a.rename("/a/b2/h", "/none/x")), ErrorCode::NotFound);
    // Escapes are refused, either way round; the root itself does not move.
    assert_eq!(code_of(a.rename("/a/b2/h", "../x")), ErrorCode::PathEscape);
    assert_eq!(
        code_of(a.rename("/a/../../x", "/a/y")),
        ErrorCode::PathEscape
    );
    assert_eq!(code_of(a.rename("/", "/a/y")), ErrorCode::InvalidRequest);
    // A symlink on the way resolves inside the root.
    assert_eq!(a.rename("/a/b2/h", "/abs/moved"), Event::Ok);
    assert_eq!(std::fs::read(r.join("moved")).expect("inside"), b"one");
    assert!(!std::path::Path::new("/moved").exists());
    // A final symlink is moved, not followed.
    assert_eq!(a.rename("/abs", "/abs2"), Event::Ok);
    assert!(r
        .join("abs2")
        .symlink_metadata()
        .expect("link")
        .is_symlink());
}

#[test]
fn stat_and_list_name_the_owner_from_the_sandbox_databases() {
    let root = root_with(&["etc", "d"]);
    let r = root.path().to_owned();
    std::fs::write(
        r.join("etc/passwd"),
        "root:x:0:0:root:/root:/bin/sh\nbroken line\nuser:x:1000:1000::/home/user:/bin/sh\n",
    )
    .expect("passwd");
    std::fs::write(r.join("etc/group"), "root:x:0:\nstaff:x:1000:user\n").expect("group");
    std::fs::write(r.join("d/mine"), b"x").expect("write");
    std::fs::write(r.join("d/nobody"), b"x").expect("write");
    std::os::unix::fs::chown(r.join("d/mine"), Some(1000), Some(1000)).expect("chown");
    std::os::unix::fs::chown(r.join("d/nobody"), Some(4242), Some(4343)).expect("chown");
    let a = Agent::start_with_root(Some(root));
    let Event::Stat(st) = a.call(Request::FileStat {
        path: "/d/mine".into(),
    }) else {
        panic!("stat")
    };
    assert_eq!((st.uid, st.gid), (1000, 1000));
    assert_eq!(st.owner.as_deref(), Some("user"));
    assert_eq!(st.group.as_deref(), Some("staff"));
    let Event::Listing { entries } = a.call(Request::FileList { path: "/d".into() }) else {
        panic!("list")
    };
    let nobody = entries.iter().find(|e| e.name == "nobody").expect("nobody");
    assert_eq!((nobody.uid, nobody.gid), (4242, 4343));
    assert_eq!(
        (nobody.owner.as_deref(), nobody.group.as_deref()),
        (None, None)
    );
    let Event::Listing { entries } = a.call(Request::FileList { path: "/".into() }) else {
        panic!("list")
    };
    let etc = entries.iter().find(|e| e.name == "etc").expect("etc");
    assert_eq!(etc.owner.as_deref(), Some("root"));
    // A changed database is read again.
    std::fs::write(r.join("etc/passwd.new"), "renamed:x:1000:1000::/:/bin/sh\n").expect("w");
    std::fs::rename(r.join("etc/passwd.new"), r.join("etc/passwd")).expect("rename");
    let Event::Stat(st) = a.call(Request::FileStat {
        path: "/d/mine".into(),
    }) else {
        panic!("stat")
    };
    assert_eq!(st.owner.as_deref(), Some("renamed"));
}

#[test]
fn watch_reports_changes_in_one_directory() {
    use dsec_api::agent::FsOp::*;
    let root = root_with(&["w"]);
    let w = root.path().join("w");
    let a = Agent::start_with_root(Some(root));
    let id = a.watch("/w", false);
    std::fs::write(w.join("f"), b"x").expect("write");
    a.changes(id, &[("f", Create), ("f", Write)]);
    std::fs::set_permissions(
        w.join("f"),
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .expect("chmod");
    std::fs::rename(w.join("f"), w.join("g")).expect("rename");
    std::fs::remove_file(w.join("g")).expect("rm");
    std::fs::create_dir(w.join("sub")).expect("mkdir");
    std::fs::write(w.join("sub/inner"), b"x").expect("write");
    std::fs::write(w.join("end"), b"x").expect("write");
    let got = a.changes(
        id,
        &[
            ("f", Chmod),
            ("f", Rename),
            ("g", Create),
            ("g", Remove),
            ("sub", Create),
            ("end", Create),
        ],
    );
    // One write reported per batch, however many write calls and closes there were.
    assert_eq!(
        got.iter().filter(|e| *e == &("f".into(), Write)).count(),
        1,
        "{got:?}"
    );
    assert!(got.iter().all(|(n, _)| !n.starts_with("sub/")), "{got:?}");
    let evs = a.unwatch(id);
    assert_eq!(evs[0].0, Event::Watching);
    // Gone after Unwatch: no more events, and a second Unwatch does not know it.
    std::fs::write(w.join("later"), b"x").expect("write");
    assert_eq!(
        code_of(a.call(Request::Unwatch { watch: id })),
        ErrorCode::HandleNotFound
    );
    std::thread::sleep(Duration::from_millis(100));
    assert!(a.inbox.0.lock().expect("lock").get(&id).is_none());
}

#[test]
fn watch_recursive_follows_the_tree() {
    use dsec_api::agent::FsOp::*;
    let root = root_with(&["t/a/b"]);
    let t = root.path().join("t");
    let a = Agent::start_with_root(Some(root));
    let id = a.watch("/t", true);
    std::fs::write(t.join("a/b/f"), b"x").expect("write");
    a.changes(id, &[("a/b/f", Create), ("a/b/f", Write)]);
    // A new directory, written to at once: its file is reported (found when its watch was
    // put in place, or seen by it), and later writes to it too.
    std::fs::create_dir_all(t.join("n/m")).expect("mkdir");
    std::fs::write(t.join("n/m/f"), b"x").expect("write");
    a.changes(id, &[("n", Create), ("n/m/f", Create)]);
    std::thread::sleep(Duration::from_millis(50));
    std::fs::write(t.join("n/m/f"), b"y").expect("write");
    a.changes(id, &[("n/m/f", Create), ("n/m/f", Write)]);
    // A directory moved within the tree is reported under its new name.
    std::fs::rename(t.join("a"), t.join("c")).expect("rename");
    std::fs::write(t.join("c/b/g"), b"x").expect("write");
    std::fs::remove_file(t.join("c/b/g")).expect("rm");
    let got = a.changes(
        id,
        &[
            ("a", Rename),
            ("c", Create),
            ("c/b/g", Create),
            ("c/b/g", Remove),
        ],
    );
    assert!(!got.iter().any(|(n, _)| n == "a/b/g"), "{got:?}");
    // Moved out of the tree: no longer watched.
    std::fs::rename(t.join("c"), t.parent().expect("parent").join("out")).expect("rename");
    std::fs::write(t.parent().expect("parent").join("out/b/h"), b"x").expect("write");
    std::fs::write(t.join("end"), b"x").expect("write");
    let got = a.changes(id, &[("c", Rename), ("end", Create)]);
    assert!(!got.iter().any(|(n, _)| n.ends_with("b/h")), "{got:?}");
    a.unwatch(id);
}

#[test]
fn watch_of_a_missing_or_removed_directory() {
    let root = root_with(&["w"]);
    std::fs::write(root.path().join("file"), b"x").expect("write");
    let w = root.path().join("w");
    let a = Agent::start_with_root(Some(root));
    let watch = |path: &str| {
        a.call(Request::Watch {
            path: path.into(),
            recursive: true,
        })
    };
    assert_eq!(code_of(watch("/missing")), ErrorCode::NotFound);
    assert_eq!(code_of(watch("/file")), ErrorCode::WrongFileType);
    assert_eq!(code_of(watch("/../w")), ErrorCode::PathEscape);
    let id = a.watch("/w", false);
    std::fs::write(w.join("f"), b"x").expect("write");
    std::fs::remove_dir_all(&w).expect("rm");
    let evs = a.wait_terminal(id, Duration::from_secs(10));
    assert!(
        matches!(
            terminal_of(&evs),
            Event::Error {
                code: ErrorCode::NotFound,
                ..
            }
        ),
        "{evs:?}"
    );
}

#[test]
fn watches_are_bounded_and_end_with_a_reset() {
    use dsec_api::agent::FsOp::*;
    let root = root_with(&["w"]);
    let w = root.path().join("w");
    let a = Agent::start_with_root(Some(root));
    // Many watches of one directory share its inotify watch.
    let ids: Vec<u64> = (0..64).map(|_| a.watch("/w", false)).collect();
    let over = a.call(Request::Watch {
        path: "/w".into(),
        recursive: false,
    });
    assert_eq!(code_of(over), ErrorCode::ResourceExhausted);
    for id in &ids[1..] {
        a.unwatch(*id);
    }
    // The one left still sees changes after the others let go.
    std::fs::write(w.join("f"), b"x").expect("write");
    a.changes(ids[0], &[("f", Create)]);
    let again = a.watch("/w", true);
    // A reset ends every watch.
    assert_eq!(a.call(Request::KillAll), Event::Ok);
    for id in [ids[0], again] {
        let evs = a.wait_terminal(id, Duration::from_secs(10));
        assert_eq!(terminal_of(&evs), &Event::Detached, "{evs:?}");
    }
}

#[test]
fn watch_of_a_tree_past_the_directory_bound() {
    // 4,096 directories per watch: the watched one and 4,095 below it fit, one more does not.
    let root = root_with(&["big", "fits"]);
    for i in 0..4096 {
        std::fs::create_dir(root.path().join(format!("big/d{i}"))).expect("mkdir");
    }
    for i in 0..4095 {
        std::fs::create_dir(root.path().join(format!("fits/d{i}"))).expect("mkdir");
    }
    let fits = root.path().join("fits");
    let a = Agent::start_with_root(Some(root));
    let ev = a.call(Request::Watch {
        path: "/big".into(),
        recursive: true,
    });
    assert_eq!(code_of(ev), ErrorCode::ResourceExhausted);
    let flat = a.watch("/big", false);
    a.unwatch(flat);
    // A tree that grows past the bound ends its watch.
    let id = a.watch("/fits", true);
    std::fs::create_dir(fits.join("d0/one-more")).expect("mkdir");
    let evs = a.wait_terminal(id, Duration::from_secs(10));
    assert!(
        matches!(
            terminal_of(&evs),
            Event::Error {
                code: ErrorCode::ResourceExhausted,
                ..
            }
        ),
        "{evs:?}"
    );
}
