//! The code runner (`/v1/run`, `/run_code`) against a real `dsec server`: verdicts, isolation
//! between consecutive calls, compile errors, typed errors for bad requests, and the path key
//! and anonymous tenant of SandboxFusion clients.
//!
//! Needs root (namespaces, cgroups, mounts); CI runs as root.

use std::path::PathBuf;
use std::process::Child;
use std::time::Duration;

use serde_json::{json, Value};

mod common;

struct Daemon {
    child: Child,
    url: String,
    key: String,
    base: PathBuf,
    agent: ureq::Agent,
}

impl Daemon {
    fn start(tag: &str, args: &[&str]) -> Self {
        let (data, run) = common::dirs("dsr", tag);
        let mut all = vec!["--pool-max", "0"];
        all.extend_from_slice(args);
        let common::Started { child, url, key } = common::start_server(&data, &run, &[], &all);
        Self {
            child,
            url,
            key,
            base: data.parent().expect("base dir").to_owned(),
            agent: ureq::Agent::config_builder()
                .http_status_as_error(false)
                .timeout_global(Some(Duration::from_secs(120)))
                .build()
                .into(),
        }
    }

    fn post(&self, path: &str, key: Option<&str>, body: &Value) -> (u16, Value) {
        let send = || {
            let mut b = self.agent.post(format!("{}{path}", self.url));
            if let Some(k) = key {
                b = b.header("X-API-Key", k);
            }
            b.send(body.to_string())
        };
        let mut r = match send() {
            Ok(r) => r,
            // A pooled keep-alive connection the server closed after its last answer (it
            // may after answering without reading a body, e.g. a 401): once more, on a new one.
            Err(ureq::Error::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                send().expect("http")
            }
            Err(e) => panic!("http: {e:?}"),
        };
        let status = r.status().as_u16();
        let v = serde_json::from_slice(&r.body_mut().read_to_vec().unwrap_or_default())
            .unwrap_or(Value::Null);
        (status, v)
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

impl Drop for Daemon {
    fn drop(&mut self) {
        // The runner's sandboxes outlive the daemon like any other: the admin destroys them.
        std::thread::sleep(Duration::from_millis(300));
        let url = format!("{}/v1/sandboxes?tenant=tn-run&limit=1000", self.url);
        let listed: Value = self
            .agent
            .get(&url)
            .header("X-API-Key", &self.key)
            .call()
            .ok()
            .and_then(|mut r| serde_json::from_slice(&r.body_mut().read_to_vec().ok()?).ok())
            .unwrap_or(Value::Null);
        for sb in listed["items"].as_array().into_iter().flatten() {
            if let Some(id) = sb["id"].as_str() {
                let _ = self
                    .agent
                    .delete(format!("{}/v1/sandboxes/{id}", self.url))
                    .header("X-API-Key", &self.key)
                    .call();
            }
        }
        if let Some(pid) = rustix::process::Pid::from_raw(self.child.id() as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.base);
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
    // A call that kills the driver (the session process) answers `agent_unavailable`.
    let key = d.key.clone();
    let (s, v) = d.post(
        "/v1/run",
        Some(&key),
        &json!({"code": "import os, signal\nz = os.getppid()\nst = open('/proc/%d/stat' % z).read()\nos.kill(int(st.rsplit(')', 1)[1].split()[1]), signal.SIGKILL)", "language": "python"}),
    );
    assert_eq!(
        (s, v["code"].as_str()),
        (502, Some("agent_unavailable")),
        "{v}"
    );
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
        (
            json!({"code": "1", "language": "python", "run_timeout": -1}),
            "invalid_request",
            400,
        ),
    ] {
        let (s, v) = d.post("/v1/run", Some(&key), &body);
        assert_eq!((s, v["code"].as_str()), (status, Some(code)), "{v}");
    }
    let (s, v) = d.post("/v1/run", None, &json!({"code": "1", "language": "python"}));
    assert_eq!((s, v["code"].as_str()), (401, Some("unauthorized")), "{v}");
    let mut r = d
        .agent
        .get(format!("{}/v1/languages", d.url))
        .header("X-API-Key", &key)
        .call()
        .expect("http");
    let langs: Value = serde_json::from_slice(&r.body_mut().read_to_vec().unwrap_or_default())
        .unwrap_or(Value::Null);
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
    assert_eq!(
        (s, v["status"].as_str()),
        (400, Some("SandboxError")),
        "{v}"
    );
    // The anonymous tenant reaches the runner only.
    let mut r = d
        .agent
        .get(format!("{}/v1/sandboxes", d.url))
        .call()
        .expect("http");
    assert_eq!(r.status().as_u16(), 401);
    let _ = r.body_mut().read_to_vec();
}

/// The R-xx abuse cases through SandboxFusion's `/run_code`: each is contained in its call
/// (a verdict, not a crash), and the next call still answers correctly.
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
    let cases = [
        // R-01 fork bomb: pids limit, ends by its deadline.
        ("R-01", "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass", 2.0),
        // R-02 double-fork escapee that would outlive the call.
        ("R-02", "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(1000)\n    os._exit(0)\nprint('parent done')", 2.0),
        // R-03 memory bomb.
        ("R-03", "a = []\nwhile True: a.append(bytearray(1 << 20))", 5.0),
        // R-04 disk fill of the writable layer.
        ("R-04", "f = open('/tmp/fill', 'wb')\nwhile True: f.write(b'x' * (1 << 20))", 5.0),
        // R-06 sleep forever / spin.
        ("R-06", "import time\ntime.sleep(1000)", 1.0),
        // R-08 output flood without newlines, invalid UTF-8.
        ("R-08", "import sys\nwhile True: sys.stdout.buffer.write(b'\\xff' * 65536)", 5.0),
        // R-09 zombie leak.
        ("R-09", "import os\nfor _ in range(50):\n    if os.fork() == 0: os._exit(0)\nprint('ok')", 2.0),
    ];
    for (id, code, timeout) in cases {
        let (s, v) = run_code(code, timeout);
        assert_eq!(s, 200, "{id}: {v}");
        assert!(
            matches!(v["status"].as_str(), Some("Success" | "Failed")),
            "{id}: a verdict, not a sandbox error: {v}"
        );
        // The next call is clean and correct: no process, file or output of the abuser left.
        let (s, next) = run_code(
            &format!("{LIVE_PROCESSES}print(len(procs) <= 4, os.path.exists('/tmp/fill'))"),
            5.0,
        );
        assert_eq!(s, 200, "{id}: {next}");
        assert_eq!(
            next["status"], "Success",
            "{id}: the node still runs code: {next}"
        );
        assert_eq!(
            next["run_result"]["stdout"], "True False\n",
            "{id}: nothing survived: {next}"
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
        let (s, v) = d.post(
            "/v1/run",
            Some(&key),
            &json!({"code": "print(1)", "language": "python"}),
        );
        assert_eq!(
            (s, v["code"].as_str()),
            (429, Some("quota_exceeded")),
            "{v}"
        );
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
