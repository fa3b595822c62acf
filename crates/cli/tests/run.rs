//! The code runner (`/v1/run`, `/run_code`) against a real `dsec server`: verdicts, isolation
//! between consecutive calls, compile errors, typed errors for bad requests, and the path key
//! and anonymous tenant of SandboxFusion clients.
//!
//! Needs root (namespaces, cgroups, mounts); CI runs as root.

use std::time::Duration;

use dsec_testkit as testkit;
use serde_json::{json, Value};

testkit::daemon_type!(
    /// A daemon of these tests on its own state dirs (removed, with the runner's sandboxes,
    /// when it drops).
    struct Daemon
);

impl Daemon {
    fn start(tag: &str, args: &[&str]) -> Self {
        Self::start_in(tag, args, 0o755)
    }

    /// A daemon whose state dirs are under a directory of `mode`.
    fn start_in(tag: &str, args: &[&str], mode: u32) -> Self {
        use std::os::unix::fs::PermissionsExt as _;
        let (data, run) = testkit::dirs("dsr", tag);
        let base = data.parent().expect("base dir");
        std::fs::set_permissions(base, std::fs::Permissions::from_mode(mode)).expect("chmod");
        let d = testkit::Server::test(env!("CARGO_BIN_EXE_dsec"), &data, &run)
            .args(&["--pool-max", "0"])
            .args(args)
            .remove_on_drop(base)
            .start()
            .expect("start dsec server");
        Self(d)
    }

    fn post(&self, path: &str, key: Option<&str>, body: &Value) -> (u16, Value) {
        let http = self.http().with_key(key);
        match http.call("POST", path, Some(body)) {
            Ok(r) => r,
            // A pooled keep-alive connection the server closed after its last answer (it
            // may after answering without reading a body, e.g. a 401): once more, on a new one.
            Err(ureq::Error::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                http.call("POST", path, Some(body)).expect("http")
            }
            Err(e) => panic!("http: {e:?}"),
        }
    }

    /// POSTs `body` to `path` with `key`: the answer must be `status` with `field` = `want`.
    fn post_expect(&self, path: &str, key: &str, body: Value, want: (u16, &str, &str)) -> Value {
        let (status, field, value) = want;
        let (s, v) = self.post(path, Some(key), &body);
        assert_eq!((s, v[field].as_str()), (status, Some(value)), "{v}");
        v
    }

    /// A GET with the admin key: the answer's JSON.
    fn get(&self, path: &str) -> Value {
        self.http().call("GET", path, None).expect("http").1
    }

    fn run(&self, body: Value) -> Value {
        let (s, v) = self.post("/v1/run", Some(&self.key.clone()), &body);
        assert_eq!(s, 200, "run: {v}");
        v
    }

    fn py(&self, code: &str) -> Value {
        self.run(json!({"code": code, "language": "python"}))["run_result"].clone()
    }
}

/// Python that lists the live (not zombie) processes of the sandbox in `procs`.
const LIVE_PROCESSES: &str = "import os\ndef live(p):\n    try:\n        return open('/proc/%s/stat' % p).read().rsplit(')', 1)[1].split()[0] != 'Z'\n    except OSError:\n        return False\nprocs = [p for p in os.listdir('/proc') if p.isdigit() and live(p)]\n";

/// Python that prints how many System V segments, queues and semaphore sets and whether the
/// POSIX queue `/call` exist, then makes one of each.
const IPC_OBJECTS: &str = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.mq_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]\nn = lambda k: len(open('/proc/sysvipc/' + k).readlines()) - 1\nseen = [n('shm'), n('msg'), n('sem'), int(libc.mq_open(b'/call', os.O_RDWR, 0, None) >= 0)]\nassert libc.shmget(0, 4096, 0o1600) >= 0\nassert libc.msgget(0, 0o1600) >= 0\nassert libc.semget(0, 2, 0o1600) >= 0\nassert libc.mq_open(b'/call', os.O_CREAT | os.O_RDWR, 0o600, None) >= 0, ctypes.get_errno()\nprint(*seen)";

#[test]
fn python_verdicts_and_isolation() {
    let d = Daemon::start("verdicts", &[]);
    let r = d.py("print(1+1)");
    assert_eq!(r["status"], "Finished", "{r}");
    assert_eq!(r["stdout"], "2\n");
    assert_eq!(r["exit_code"], 0);

    let r = d.run(json!({"code": "while True: pass", "language": "python", "run_timeout": 1}));
    assert_eq!(r["run_result"]["status"], "TimeLimitExceeded", "{r}");
    assert_eq!(r["status"], "Failed");

    let r = d.run(
        json!({"code": "x = bytearray(1 << 30)", "language": "python", "memory_limit_MB": 256}),
    );
    assert_eq!(r["run_result"]["status"], "MemoryLimitExceeded", "{r}");

    let r = d.py("raise ValueError('boom')");
    assert_eq!(r["status"], "RuntimeError", "{r}");
    assert_eq!(r["exit_code"], 1);
    assert!(
        r["stderr"]
            .as_str()
            .unwrap_or("")
            .contains("ValueError: boom"),
        "{r}"
    );

    let r =
        d.run(json!({"code": "print('x' * 100000)", "language": "python", "output_limit": 1000}));
    assert_eq!(r["run_result"]["status"], "OutputLimitExceeded", "{r}");

    let r = d.run(json!({"code": "print(input()[::-1])", "language": "python", "stdin": "abc\n"}));
    assert_eq!(r["run_result"]["stdout"], "cba\n", "{r}");

    // Call 1 leaves a file, a background process and a global; call 2 sees none of them.
    let r = d.py(
        "import subprocess\nopen('/tmp/leak', 'w').write('x')\nsubprocess.Popen(['sleep', '300'], start_new_session=True)\nLEAK = 1",
    );
    assert_eq!(r["status"], "Finished", "{r}");
    let r = d.py(
        "import os\nprint(os.path.exists('/tmp/leak'), 'LEAK' in globals(), any(open(f'/proc/{p}/cmdline','rb').read().startswith(b'sleep') for p in os.listdir('/proc') if p.isdigit()))",
    );
    assert_eq!(r["stdout"], "False False False\n", "{r}");

    // Call 1 leaves System V objects and a POSIX queue in the sandbox's IPC namespace, which
    // calls share; the next call finds none. Each call first counts what it finds, then makes
    // its own: over more calls than there are zygote sandboxes, every sandbox is revisited.
    for i in 0..8 {
        let r = d.py(IPC_OBJECTS);
        assert_eq!(
            r["stdout"], "0 0 0 0\n",
            "call {i} found the IPC objects of a call before: {r}"
        );
    }

    // A call that forges its own "done" report early and keeps running ends there: the driver
    // kills the child whatever it reported, and the next call finds nothing of it.
    let t = std::time::Instant::now();
    let r = d.py(
        "import os, time\nfor fd in range(3, 64):\n    try:\n        if os.readlink('/proc/self/fd/%d' % fd).startswith('pipe:'):\n            os.write(fd, b'done 0 1 -\\n')\n    except OSError:\n        pass\ntime.sleep(30)\nopen('/tmp/late', 'w').write('x')",
    );
    assert!(t.elapsed() < Duration::from_secs(20), "{r}");
    assert_eq!(r["status"], "Finished", "{r}");
    // The next calls visit every zygote sandbox: in each, only the agent, the driver, the
    // zygote and the call itself are alive.
    for _ in 0..6 {
        let r = d.py(&format!("{LIVE_PROCESSES}print(len(procs))"));
        assert_eq!(r["stdout"], "4\n", "{r}");
    }

    // The zygote and the driver are not dumpable: a call cannot open their memory (a write
    // there would run in every later call).
    let r = d.py(
        "import os\nz = os.getppid()\ndriver = int(open('/proc/%d/stat' % z).read().rsplit(')', 1)[1].split()[1])\nfor p in (z, driver):\n    try:\n        open('/proc/%d/mem' % p, 'r+b')\n        print('open')\n    except PermissionError:\n        print('denied')",
    );
    assert_eq!(r["stdout"], "denied\ndenied\n", "{r}");

    // Files in and out.
    let r = d.run(json!({
        "code": "print(open('in/a.txt').read()); open('out.txt', 'w').write('done')",
        "language": "python",
        "files": {"in/a.txt": "aGVsbG8="},
        "fetch_files": ["out.txt"],
    }));
    assert_eq!(r["run_result"]["stdout"], "hello\n", "{r}");
    assert_eq!(r["files"]["out.txt"], "ZG9uZQ==", "{r}");

    // A call that kills its zygote (its parent) gets its own answer; the driver then has no
    // zygote to fork from, refuses its next call and is replaced, and the call goes elsewhere.
    let r = d.py("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('ran')");
    assert_eq!(r["stdout"], "ran\n", "{r}");
    for _ in 0..6 {
        let r = d.py("print('next')");
        assert_eq!(r["stdout"], "next\n", "{r}");
    }
    // A call that kills the driver (the session process) ended its own runtime: that is its
    // result (`RuntimeError`, killed by SIGKILL), not a node error a client would retry.
    let key = d.key.clone();
    let (s, v) = d.post(
        "/v1/run",
        Some(&key),
        &json!({"code": "import os, signal\nz = os.getppid()\nst = open('/proc/%d/stat' % z).read()\nos.kill(int(st.rsplit(')', 1)[1].split()[1]), signal.SIGKILL)", "language": "python"}),
    );
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["status"], "Failed", "{v}");
    assert_eq!(v["run_result"]["status"], "RuntimeError", "{v}");
    assert_eq!(v["run_result"]["exit_code"], -9, "{v}");
    let r = d.py("print('after')");
    assert_eq!(r["stdout"], "after\n", "{r}");
}

#[test]
fn compiled_languages_and_bad_requests() {
    let d = Daemon::start("compiled", &[]);
    let r = d.run(json!({"code": "#include <cstdio>\nint main(){std::printf(\"%d\\n\", 6*7);}", "language": "cpp"}));
    assert_eq!(r["compile_result"]["status"], "Finished", "{r}");
    assert_eq!(r["run_result"]["stdout"], "42\n", "{r}");
    let r = d.run(json!({"code": "int main(){ return undefined_x; }", "language": "c"}));
    assert_eq!(r["status"], "Failed", "{r}");
    assert_ne!(r["compile_result"]["exit_code"], 0, "{r}");
    assert!(r["run_result"].is_null(), "{r}");
    let r = d.run(json!({"code": "echo $((6*7)); cat", "language": "bash", "stdin": "in"}));
    assert_eq!(r["run_result"]["stdout"], "42\nin", "{r}");
    let r = d.run(json!({"code": "print(1+1)", "language": "python", "substrate": "container"}));
    assert_eq!(r["run_result"]["stdout"], "2\n", "{r}");
    assert_eq!(r["substrate"], "container");

    let key = d.key.clone();
    for (body, code, status) in [
        (
            json!({"code": "1", "language": "cobol"}),
            "invalid_request",
            400,
        ),
        (json!({"language": "python"}), "invalid_request", 400),
        (
            json!({"code": "1", "language": "python", "files": {"a": "!!"}}),
            "invalid_request",
            400,
        ),
        (
            json!({"code": "1", "language": "python", "files": {"../a": ""}}),
            "invalid_request",
            400,
        ),
        (
            json!({"code": "1", "language": "python", "files": {"big": "A".repeat(24 << 20)}}),
            "too_large",
            413,
        ),
        // The native API refuses a field it does not know.
        (
            json!({"code": "1", "language": "python", "task_id": "HumanEval/0"}),
            "invalid_request",
            400,
        ),
    ] {
        let (s, v) = d.post("/v1/run", Some(&key), &body);
        assert_eq!((s, v["code"].as_str()), (status, Some(code)), "{v}");
    }
    let (s, v) = d.post("/v1/run", None, &json!({"code": "1", "language": "python"}));
    assert_eq!((s, v["code"].as_str()), (401, Some("unauthorized")), "{v}");
    let langs = d
        .http()
        .with_key(Some(&key))
        .call("GET", "/v1/languages", None)
        .expect("http")
        .1;
    let names: Vec<&str> = langs["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|l| l["name"].as_str())
        .collect();
    assert!(
        names.contains(&"python") && names.contains(&"c") && names.contains(&"bash"),
        "{langs}"
    );
}

#[test]
fn sandbox_fusion_shape_path_key_and_anonymous() {
    let d = Daemon::start("fusion", &["--anonymous-run"]);
    let key = d.key.clone();
    let (s, v) = d.post(
        &format!("/t/{key}/run_code"),
        None,
        &json!({"code": "print(3)", "language": "python"}),
    );
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["status"], "Success", "{v}");
    assert_eq!(v["run_result"]["return_code"], 0);
    assert_eq!(v["run_result"]["stdout"], "3\n");
    let (s, v) = d.post(
        "/t/not-a-key/run_code",
        None,
        &json!({"code": "print(3)", "language": "python"}),
    );
    assert_eq!(s, 401, "{v}");
    let (s, v) = d.post(
        "/run_code",
        None,
        &json!({"code": "import sys; sys.exit(3)", "language": "python"}),
    );
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        (
            v["status"].as_str(),
            v["run_result"]["return_code"].as_i64()
        ),
        (Some("Failed"), Some(3)),
        "{v}"
    );
    let (s, v) = d.post(
        "/run_code",
        None,
        &json!({"code": "x = bytearray(1 << 30)", "language": "python", "memory_limit_MB": 128}),
    );
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["run_result"]["status"], "Finished", "{v}");
    assert_eq!(v["run_result"]["verdict"], "MemoryLimitExceeded", "{v}");
    let (s, v) = d.post(
        "/run_code",
        None,
        &json!({"code": "1", "language": "cobol"}),
    );
    assert_eq!(s, 422, "{v}");
    assert_eq!(v["detail"][0]["loc"], json!(["body", "language"]), "{v}");
    // The anonymous tenant reaches the runner only.
    let (s, _) = d
        .http()
        .with_key(None)
        .call("GET", "/v1/sandboxes", None)
        .expect("http");
    assert_eq!(s, 401);
}

/// What SandboxFusion's server does with what datasets and reward code send, `/run_code` does
/// too: unknown fields are ignored (the native API refuses them), any timeout is taken (above
/// the node's maximum clamped to it and said so in `clamped`, 0 or less a time-out at once),
/// input it would not validate is 422 with FastAPI's `detail`, and a language whose toolchain
/// the template lacks answers as a missing command does (127 in the phase that needs it).
#[test]
fn sandbox_fusion_requests_answer_as_its_server_does() {
    let d = Daemon::start("sfcompat", &[]);
    let key = d.key.clone();
    let sf = |body: Value| d.post("/run_code", Some(&key), &body);

    let row = json!({"code": "print(input())", "language": "python", "stdin": "hi",
        "task_id": "HumanEval/0", "test": "assert True", "entry_point": null});
    let (s, v) = sf(row.clone());
    assert_eq!((s, v["status"].as_str()), (200, Some("Success")), "{v}");
    assert_eq!(v["run_result"]["stdout"], "hi\n", "{v}");
    let (s, v) = d.post("/v1/run", Some(&key), &row);
    assert_eq!(
        (s, v["code"].as_str()),
        (400, Some("invalid_request")),
        "{v}"
    );
    assert!(
        v["detail"].as_str().is_some_and(|m| m.contains("task_id")),
        "{v}"
    );

    // Timeouts: large ones run (clamped), 0 times out at once, negative ones too.
    let (s, v) = sf(
        json!({"code": "print(1)", "language": "python", "run_timeout": 100000.0, "compile_timeout": 1e9}),
    );
    assert_eq!((s, v["status"].as_str()), (200, Some("Success")), "{v}");
    assert_eq!(
        v["clamped"],
        json!({"run_timeout": 300.0, "compile_timeout": 300.0}),
        "{v}"
    );
    let (s, v) = sf(json!({"code": "print(1)", "language": "python", "run_timeout": 0}));
    assert_eq!((s, v["status"].as_str()), (200, Some("Failed")), "{v}");
    assert_eq!(v["run_result"]["status"], "TimeLimitExceeded", "{v}");
    assert_eq!(v["clamped"], json!({}), "{v}");
    let (s, v) = sf(json!({"code": "int main(){}", "language": "cpp", "compile_timeout": 0}));
    assert_eq!((s, v["status"].as_str()), (200, Some("Failed")), "{v}");
    assert_eq!(v["compile_result"]["status"], "TimeLimitExceeded", "{v}");
    assert!(v["run_result"].is_null(), "{v}");
    let v = d.run(json!({"code": "print(1)", "language": "python", "run_timeout": -1}));
    assert_eq!(v["run_result"]["status"], "TimeLimitExceeded", "{v}");
    assert_eq!(v["clamped"], json!({"run_timeout": 0.0}), "{v}");

    // Input SandboxFusion's server would not validate: 422 and FastAPI's detail.
    for (body, kind, loc) in [
        (
            json!({"language": "python"}),
            "missing",
            json!(["body", "code"]),
        ),
        (
            json!({"code": "1", "language": "react"}),
            "literal_error",
            json!(["body", "language"]),
        ),
        (
            json!({"code": "1", "language": "python", "run_timeout": "soon"}),
            "float_parsing",
            json!(["body", "run_timeout"]),
        ),
        (
            json!({"code": "1", "language": "python", "files": {"../x": ""}}),
            "value_error",
            json!(["body", "files", "../x"]),
        ),
        (
            json!(["print(1)"]),
            "model_attributes_type",
            json!(["body"]),
        ),
    ] {
        let (s, v) = sf(body.clone());
        assert_eq!(s, 422, "{body}: {v}");
        assert_eq!(v["detail"][0]["type"], kind, "{body}: {v}");
        assert_eq!(v["detail"][0]["loc"], loc, "{body}: {v}");
    }
    let r = d
        .http()
        .with_key(Some(&key))
        .send("POST", "/run_code", Some(b"{\"code\": "), &[])
        .expect("http");
    assert_eq!(r.status, 422);
    let v = r.json();
    assert_eq!(v["detail"][0]["type"], "json_invalid", "{v}");

    // No lean in Debian: the host template has none.
    assert!(
        !std::path::Path::new("/usr/bin/lean").exists(),
        "this case needs a host without lean"
    );
    let (s, v) = sf(json!({"code": "theorem t : 1 = 1 := rfl", "language": "lean"}));
    assert_eq!((s, v["status"].as_str()), (200, Some("Failed")), "{v}");
    assert_eq!(v["run_result"]["return_code"], 127, "{v}");
    assert!(
        v["run_result"]["stderr"]
            .as_str()
            .is_some_and(|e| e.contains("lean: command not found")),
        "{v}"
    );
    let body = json!({"code": "1", "language": "lean"});
    d.post_expect("/v1/run", &key, body, (400, "code", "invalid_request"));
}

/// The R-xx abuse cases through SandboxFusion's `/run_code`: each is contained in its call
/// (the verdict its abuse earns, never a sandbox error), and the next call still answers
/// correctly with nothing of the abuser left. R-12 (the host kills the supervisors of the
/// zygotes) follows: calls then go to new zygotes, none fails.
#[test]
fn abuse_through_run_code_is_contained() {
    let d = Daemon::start("abuse", &[]);
    let key = d.key.clone();
    let run_code = |code: &str, timeout: f64| {
        d.post(
            "/run_code",
            Some(&key),
            &json!({"code": code, "language": "python", "run_timeout": timeout, "memory_limit_MB": 128}),
        )
    };
    // (case, code, run timeout, the verdicts it may earn, what its stdout starts with).
    let cases: [(&str, &str, f64, &[&str], &str); 22] = [
        // R-01 fork bomb: pids limit, ends by its deadline.
        ("R-01 fork", "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass", 2.0, &["TimeLimitExceeded"], ""),
        // R-01 thread bomb: each thread's stack counts against the call's memory.
        ("R-01 threads", "import threading, time\nwhile True: threading.Thread(target=time.sleep, args=(100,)).start()", 2.0, &["MemoryLimitExceeded", "RuntimeError"], ""),
        // R-02 double-fork escapee that would outlive the call.
        ("R-02", "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(1000)\n    os._exit(0)\nprint('parent done')", 2.0, &["Finished"], "parent done"),
        // R-03 memory bomb: malloc, tmpfs (/dev/shm), memfd.
        ("R-03 malloc", "a = []\nwhile True: a.append(bytearray(1 << 20))", 5.0, &["MemoryLimitExceeded"], ""),
        ("R-03 tmpfs", "f = open('/dev/shm/fill', 'wb', buffering=0)\nwhile True: f.write(b'x' * (1 << 20))", 5.0, &["RuntimeError"], ""),
        ("R-03 memfd", "import os\nfd = os.memfd_create('m')\nwhile True: os.write(fd, b'x' * (1 << 20))", 5.0, &["RuntimeError"], ""),
        // R-04 disk fill and inode exhaustion of the writable layer.
        ("R-04 fill", "f = open('/tmp/fill', 'wb')\nwhile True: f.write(b'x' * (1 << 20))", 5.0, &["RuntimeError"], ""),
        ("R-04 inodes", "i = 0\nwhile True:\n    open('/tmp/f%d' % i, 'w').close()\n    i += 1", 20.0, &["RuntimeError"], ""),
        // R-05 a file beyond RLIMIT_FSIZE (sparse: only the limit stops it).
        ("R-05", "f = open('/tmp/big', 'wb', buffering=0)\nf.seek(1 << 40)\nf.write(b'x')\nprint('wrote')", 2.0, &["RuntimeError"], ""),
        // R-06 CPU spin, sleep forever, a read of stdin that has nothing.
        ("R-06 spin", "while True: pass", 1.0, &["TimeLimitExceeded"], ""),
        ("R-06 sleep", "import time\ntime.sleep(1000)", 1.0, &["TimeLimitExceeded"], ""),
        ("R-06 stdin", "import sys\nprint(len(sys.stdin.read()))", 2.0, &["Finished"], "0"),
        // R-07 fd, IPC and timer exhaustion, a huge argv.
        ("R-07 fds", "import os\nfs = []\ntry:\n    while True: fs.append(os.open('/dev/null', os.O_RDONLY))\nexcept OSError as e: print('fds', e.errno)", 5.0, &["Finished"], "fds 24"),
        ("R-07 ipc", "import ctypes\nlibc = ctypes.CDLL(None)\nn = 0\nwhile libc.semget(0, 1, 0o1600) >= 0: n += 1\nprint('sets', n > 0)", 10.0, &["Finished"], "sets True"),
        ("R-07 timers", "import ctypes\nlibc = ctypes.CDLL(None)\nt = ctypes.create_string_buffer(8)\nn = 0\nwhile n < 200000 and libc.timer_create(1, None, t) == 0: n += 1\nprint('timers', n > 0)", 10.0, &["Finished", "MemoryLimitExceeded"], ""),
        ("R-07 argv", "import os\ntry:\n    os.execv('/bin/true', ['x'] + ['a' * 100000] * 1000)\nexcept OSError as e: print('argv', e.errno)", 2.0, &["Finished"], "argv 7"),
        // R-08 output flood without newlines, invalid UTF-8; a grandchild holding stdout.
        ("R-08 flood", "import sys\nwhile True: sys.stdout.buffer.write(b'\\xff' * 65536)", 5.0, &["OutputLimitExceeded"], ""),
        ("R-08 grandchild", "import os, sys, time\nprint('main done', flush=True)\nif os.fork() == 0:\n    while True:\n        sys.stdout.write('g')\n        sys.stdout.flush()\n        time.sleep(0.01)", 5.0, &["Finished"], "main done"),
        // R-09 zombie leak.
        ("R-09", "import os\nfor _ in range(50):\n    if os.fork() == 0: os._exit(0)\nprint('ok')", 2.0, &["Finished"], "ok"),
        // R-10 signal the agent (the sandbox's init: ignored), the zygote (the call's parent),
        // then every process the call can see: the last ends the call's own runtime, which
        // is the call's result, not a node error.
        ("R-10 agent", "import os, signal\nos.kill(1, signal.SIGKILL)\nprint('after')", 2.0, &["Finished"], "after"),
        ("R-10 zygote", "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('after')", 2.0, &["Finished"], "after"),
        ("R-10 all", "import os, signal\nfor p in os.listdir('/proc'):\n    if p.isdigit() and int(p) != os.getpid():\n        try: os.kill(int(p), signal.SIGKILL)\n        except OSError: pass\nprint('after')", 2.0, &["RuntimeError"], ""),
    ];
    for (id, code, timeout, verdicts, stdout) in cases {
        let t = std::time::Instant::now();
        let (s, v) = run_code(code, timeout);
        assert_eq!(s, 200, "{id}: {v}");
        assert!(
            matches!(v["status"].as_str(), Some("Success" | "Failed")),
            "{id}: a verdict, not a sandbox error: {v}"
        );
        let verdict = v["run_result"]["verdict"].as_str().unwrap_or_default();
        assert!(verdicts.contains(&verdict), "{id}: verdict {verdict}: {v}");
        let out = v["run_result"]["stdout"].as_str().unwrap_or_default();
        assert!(out.starts_with(stdout), "{id}: stdout {out:?}");
        // Every case ends by its own deadline (the grandchild's pipe holds nothing up).
        assert!(
            t.elapsed() < Duration::from_secs_f64(timeout + 10.0),
            "{id}: took {:?}",
            t.elapsed()
        );
        // The next call is clean and correct: no process, file or output of the abuser left.
        let (s, next) = run_code(
            &format!(
                "{LIVE_PROCESSES}print(len(procs) <= 4, sorted(set(os.listdir('/tmp')) & \
                 {{'fill', 'big', 'f0'}}), os.listdir('/dev/shm'))"
            ),
            5.0,
        );
        assert_eq!(s, 200, "{id}: {next}");
        assert_eq!(
            next["status"], "Success",
            "{id}: the node still runs code: {next}"
        );
        assert_eq!(
            next["run_result"]["stdout"], "True [] []\n",
            "{id}: nothing survived: {next}"
        );
    }
    // kill -9 of every zygote's supervisor, from the host. The sandboxes are gone with
    // them; the calls that meet a dead zygote go to another one or to a new one.
    let listed = d.get("/v1/sandboxes?tenant=tn-run");
    let sups: Vec<i32> = listed["items"]
        .as_array()
        .expect("the runner's sandboxes")
        .iter()
        .filter_map(|sb| {
            let id = sb["id"].as_str()?;
            d.get(&format!("/v1/sandboxes/{id}"))["supervisor_pid"]
                .as_i64()
                .map(|p| p as i32)
        })
        .collect();
    assert!(!sups.is_empty(), "zygotes to kill: {listed}");
    for pid in &sups {
        let pid = rustix::process::Pid::from_raw(*pid).expect("a pid");
        rustix::process::kill_process(pid, rustix::process::Signal::KILL).expect("kill -9");
    }
    for i in 0..8 {
        let (s, v) = run_code(&format!("print({i} * 2)"), 5.0);
        assert_eq!(s, 200, "R-12 call {i}: {v}");
        assert_eq!(
            v["run_result"]["stdout"],
            format!("{}\n", i * 2),
            "R-12 call {i}: {v}"
        );
    }
}

/// A tenant with a sandbox quota may have that many runs in flight; more answer
/// `quota_exceeded` until one ends.
#[test]
fn runs_in_flight_follow_the_tenant_quota() {
    let d = Daemon::start("quota", &[]);
    let admin = d.key.clone();
    let (s, t) = d.post(
        "/v1/tenants",
        Some(&admin),
        &json!({"name": "runner-a", "max_sandboxes": 1}),
    );
    assert_eq!(s, 201, "{t}");
    let key = t["api_key"].as_str().expect("key").to_owned();
    std::thread::scope(|sc| {
        let slow = sc.spawn(|| {
            d.post(
                "/v1/run",
                Some(&key),
                &json!({"code": "import time\ntime.sleep(1.5)\nprint('slept')", "language": "python"}),
            )
        });
        std::thread::sleep(Duration::from_millis(500));
        let print = json!({"code": "print(1)", "language": "python"});
        d.post_expect(
            "/v1/run",
            &key,
            print.clone(),
            (429, "code", "quota_exceeded"),
        );
        // SandboxFusion's route answers what the node cannot serve as `SandboxError`.
        let v = d.post_expect("/run_code", &key, print, (200, "status", "SandboxError"));
        assert_eq!(v["code"], "quota_exceeded", "{v}");
        let (s, v) = slow.join().expect("join");
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["run_result"]["stdout"], "slept\n");
    });
    let (s, v) = d.post(
        "/v1/run",
        Some(&key),
        &json!({"code": "print(1)", "language": "python"}),
    );
    assert_eq!(
        (s, v["run_result"]["stdout"].as_str()),
        (200, Some("1\n")),
        "{v}"
    );
}

/// The live sandboxes of the runner's tenant (with only Python calls on the function
/// substrate, its zygotes).
fn runner_sandboxes(d: &Daemon) -> Vec<Value> {
    let listed = d.get("/v1/sandboxes?tenant=tn-run&limit=1000");
    listed["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|s| s["state"].as_str() != Some("destroyed"))
        .cloned()
        .collect()
}

fn zygote_count(d: &Daemon) -> usize {
    runner_sandboxes(d).len()
}

/// The cgroup directories of the runner's sandboxes (one per hierarchy each).
fn runner_cgroup_dirs(d: &Daemon) -> Vec<Vec<std::path::PathBuf>> {
    let cgroups = dsec_sys::cgroup::CgroupManager::detect("dsec").expect("cgroups");
    runner_sandboxes(d)
        .iter()
        .filter_map(|s| cgroups.open(s["id"].as_str()?))
        .map(|cg| cg.dirs())
        .collect()
}

/// The CPU weight of each of the runner's sandboxes: `cpu.weight` (cgroup v2), or
/// `cpu.shares` (v1) told back as the weight it was set from.
fn zygote_cpu_weights(d: &Daemon) -> Vec<u64> {
    use dsec_sys::cgroup::weight_to_shares;
    let read = |dir: &std::path::Path, file: &str| -> Option<u64> {
        std::fs::read_to_string(dir.join(file))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    runner_cgroup_dirs(d)
        .iter()
        .filter_map(|dirs| {
            dirs.iter().find_map(|dir| {
                read(dir, "cpu.weight").or_else(|| {
                    read(dir, "cpu.shares").map(|s| {
                        // A cgroup in the batch class (`cpu.idle`) reads the idle weight, 3.
                        [1, 100]
                            .into_iter()
                            .find(|w| weight_to_shares(*w) == s || (*w == 1 && s == 3))
                            .unwrap_or(s)
                    })
                })
            })
        })
        .collect()
}

/// R-13 through the runner: calls that hold every warm zygote to their time limit do not
/// hold up a short call behind them (more zygotes start, up to `--run-zygotes-max`), they
/// run in the batch CPU class (`cpu.idle`, weight 1) until they end, and the extra zygotes go again once idle.
#[test]
fn long_calls_do_not_hold_up_short_ones() {
    let d = Daemon::start(
        "elastic",
        &[
            "--run-zygotes",
            "2",
            "--run-zygotes-max",
            "5",
            "--run-zygote-idle-secs",
            "2",
        ],
    );
    assert_eq!(d.py("print(1)")["stdout"], "1\n");
    let done = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|sc| {
        // Four spinners: twice the warm zygotes, each to its 6 s time limit.
        for i in 0..4 {
            let done = &done;
            let d = &d;
            sc.spawn(move || {
                let v = d.run(json!({"code": "while True: pass", "language": "python",
                    "run_timeout": 6}));
                assert_eq!(v["run_result"]["status"], "TimeLimitExceeded", "{v}");
                done.lock().expect("order").push(format!("spinner {i}"));
            });
        }
        std::thread::sleep(Duration::from_millis(1500));
        let v = d.py("print(1+1)");
        assert_eq!(v["stdout"], "2\n", "{v}");
        done.lock().expect("order").push("short".into());
        // Every zygote the burst made is within the bound.
        let n = zygote_count(&d);
        assert!((3..=5).contains(&n), "{n} zygotes");
        // The spinners' zygote sandboxes run at CPU weight 1 while their calls last.
        let weights = zygote_cpu_weights(&d);
        assert_eq!(
            weights.iter().filter(|w| **w == 1).count(),
            4,
            "{weights:?}"
        );
    });
    // Ended, they have their weight back: a zygote the governor moved to the batch class for
    // its spinning (not only held for its call) gets it after its calm ticks in a row, which
    // may end after the call's answer reached us.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let weights = loop {
        let w = zygote_cpu_weights(&d);
        if (!w.is_empty() && w.iter().all(|w| *w == 100)) || std::time::Instant::now() > deadline {
            break w;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        !weights.is_empty() && weights.iter().all(|w| *w == 100),
        "{weights:?}"
    );
    let order = done.into_inner().expect("order");
    assert_eq!(
        order.first().map(String::as_str),
        Some("short"),
        "{order:?}"
    );
    // Idle for their 2 s, the extra zygotes go; the warm two stay.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while zygote_count(&d) > 2 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(250));
    }
    assert_eq!(zygote_count(&d), 2);
    assert_eq!(d.py("print(3)")["stdout"], "3\n");
}

/// A call's processes and threads are bounded by the zygote sandbox's `pids.max`
/// (`--run-pids-max`), and first by `RLIMIT_NPROC` a few under it, which the user namespace
/// makes apply: a fork bomb stops there, is told `TimeLimitExceeded`, and the next call runs.
#[test]
fn a_call_forks_only_up_to_the_zygote_bound() {
    let d = Daemon::start("pids", &["--run-pids-max", "32"]);
    let v = d.run(json!({"language": "python", "run_timeout": 5, "code":
        "import os, time\nkids = []\nwhile True:\n    try:\n        pid = os.fork()\n    except OSError:\n        break\n    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n    kids.append(pid)\nprint(len(kids))"}));
    let forked: u64 = v["run_result"]["stdout"]
        .as_str()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or_else(|| panic!("a count: {v}"));
    // 28 (the rlimit) less the agent, the driver, the zygote and the call itself.
    assert!((16..28).contains(&forked), "{forked} children: {v}");
    let v = d.run(json!({"language": "python", "run_timeout": 1, "code":
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"}));
    assert_eq!(v["run_result"]["status"], "TimeLimitExceeded", "{v}");
    // In its user namespace the call's RLIMIT_NPROC refused every fork beyond the bound
    // before the kernel copied the address space: none reached the pids controller, not
    // even while the bomb was killed and reaped (an exiting task leaves the rlimit count
    // before its pids charge; the rlimit's headroom covers that window). Without the user
    // namespace, thousands do in a second.
    assert_eq!(pids_refused(&d), 0);
    let v = d.py("import resource\nprint(resource.getrlimit(resource.RLIMIT_NPROC), open('/proc/self/uid_map').read().split()[1] != '0')");
    assert_eq!(v["stdout"], "(28, 28) True\n", "{v}");
    assert_eq!(d.py("print(1+1)")["stdout"], "2\n");
}

/// Forks the pids controller refused in the runner's sandboxes.
fn pids_refused(d: &Daemon) -> u64 {
    let cgroups = dsec_sys::cgroup::CgroupManager::detect("dsec").expect("cgroups");
    runner_sandboxes(d)
        .iter()
        .filter_map(|s| cgroups.open(s["id"].as_str()?)?.pids_refused())
        .sum()
}

/// Zygote sandboxes run in a user namespace; where the unprivileged host uid cannot reach the
/// run dir (a 0700 parent), they are made without one and calls still run.
#[test]
fn zygotes_fall_back_without_a_user_namespace() {
    let uid_map = "print(open('/proc/self/uid_map').read().split()[1])";
    let d = Daemon::start("userns", &[]);
    // Root of a zygote is the first id of a host id range of its own.
    let first: u32 = d.py(uid_map)["stdout"]
        .as_str()
        .and_then(|s| s.trim().parse().ok())
        .expect("a host id");
    assert!(
        dsec_sys::idrange::IdRangeLease::index_of(first).is_some(),
        "{first}"
    );
    drop(d);
    let d = Daemon::start_in("nouserns", &[], 0o700);
    assert_eq!(d.py(uid_map)["stdout"], "0\n");
    assert_eq!(d.py("print(1+1)")["stdout"], "2\n");
}
