//! The one `dsec server` fixture of the system tests and of the HTTP benches: short state dirs,
//! a daemon started on a free port with its URL and admin key, a small HTTP client of it, and
//! stopping it (kill -9, SIGTERM, or on drop after destroying what it left on the machine).
//!
//! The binary to start is passed in: tests pass `env!("CARGO_BIN_EXE_dsec")`, a bench its own
//! executable.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

pub mod cluster;
pub mod fakenet;
mod http;

pub use http::{Http, Reply};

/// A fresh pair of short state dirs, `/tmp/<prefix>-<tag>-<pid>/{d,r}` (unix socket paths are
/// length-limited).
pub fn dirs(prefix: &str, tag: &str) -> (PathBuf, PathBuf) {
    let base = PathBuf::from(format!("/tmp/{prefix}-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base).expect("create test dir");
    (base.join("d"), base.join("r"))
}

/// Removes `dir` unless something is mounted below it (then it says so and leaves it).
pub fn remove_unless_mounted(dir: &Path) {
    let prefix = format!("{}/", dir.display());
    let mounted = std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .any(|m| m.starts_with(&prefix));
    if mounted {
        eprintln!(
            "{}: left in place, something is mounted below",
            dir.display()
        );
        return;
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// Removes a test's state dirs when dropped, also after a failed assertion. Declare it before
/// the daemon that uses them, so that it is dropped after the daemon stopped. Nothing is
/// removed while something is mounted below the dir.
pub struct RemoveOnDrop(pub PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        remove_unless_mounted(&self.0);
    }
}

/// [`dirs`], removed again when the returned guard drops.
pub fn dirs_removed_on_drop(prefix: &str, tag: &str) -> (PathBuf, PathBuf, RemoveOnDrop) {
    let (data, run) = dirs(prefix, tag);
    let base = data
        .parent()
        .expect("invariant: dirs are below a base")
        .to_owned();
    (data, run, RemoveOnDrop(base))
}

/// A root filesystem tarball holding `/etc/motd` = `motd`, written under `base` as `<name>.tar`.
pub fn rootfs_tarball(base: &Path, name: &str, motd: &str) -> PathBuf {
    let src = base.join(format!("{name}-root"));
    std::fs::create_dir_all(src.join("etc")).expect("rootfs");
    std::fs::write(src.join("etc/motd"), motd).expect("motd");
    let tarball = base.join(format!("{name}.tar"));
    let st = Command::new("tar")
        .arg("-cf")
        .arg(&tarball)
        .arg("-C")
        .arg(&src)
        .arg(".")
        .status()
        .expect("tar");
    assert!(st.success());
    tarball
}

/// The sandboxes whose runtime dirs are on the machine under a node's run dir.
pub fn sandbox_run_dirs(run: &Path) -> BTreeSet<String> {
    entry_names(&run.join("sandboxes"))
}

/// The names of the entries of `dir` (none when it cannot be read).
pub fn entry_names(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.file_name().to_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// An API document's path template with its parameters filled in: a sandbox id that does not
/// exist, handle and session 1, the `host` template, tenant `t1`.
pub fn concrete_path(template: &str) -> String {
    template
        .replace("{id}", "sb-0000000000000000")
        .replace("{handle}", "1")
        .replace("{session}", "1")
        .replace("{name}", "host")
        .replace("{template}", "host")
        .replace("{tid}", "t1")
}

/// A TCP port on 127.0.0.1 that nothing listened on a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// Where the daemon's stderr (its log) goes.
enum Stderr {
    /// Nowhere.
    Null,
    /// Nowhere, or to this process's stderr when `DSEC_TEST_LOG` is set.
    TestLog,
    /// To this file.
    File(PathBuf),
}

/// How to start `EXE --data-dir DATA --run-dir RUN server --listen 127.0.0.1:0 ARGS...`.
pub struct Server {
    exe: PathBuf,
    data: PathBuf,
    run: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    stderr: Stderr,
    timeout: Duration,
    owned: Option<PathBuf>,
}

impl Server {
    /// The daemon of the binary `exe` on the state dirs `data` and `run`, its stderr discarded,
    /// its client's calls given up after 120 s.
    pub fn new(exe: impl AsRef<Path>, data: &Path, run: &Path) -> Self {
        Self {
            exe: exe.as_ref().to_owned(),
            data: data.to_owned(),
            run: run.to_owned(),
            args: Vec::new(),
            env: Vec::new(),
            stderr: Stderr::Null,
            timeout: Duration::from_secs(120),
            owned: None,
        }
    }

    /// [`Server::new`] as a system test starts it: two pre-built spawner shells, and its log
    /// on this process's stderr when `DSEC_TEST_LOG` is set.
    pub fn test(exe: impl AsRef<Path>, data: &Path, run: &Path) -> Self {
        let mut s = Self::new(exe, data, run).env("DSEC_SPAWNER_SHELLS", "2");
        s.stderr = Stderr::TestLog;
        s
    }

    /// More `dsec server` flags.
    pub fn args(mut self, args: &[&str]) -> Self {
        self.args.extend(args.iter().map(|a| (*a).to_owned()));
        self
    }

    /// An environment variable of the daemon.
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.to_owned(), value.to_owned()));
        self
    }

    /// Environment variables of the daemon.
    pub fn envs(self, env: &[(&str, &str)]) -> Self {
        env.iter().fold(self, |s, (k, v)| s.env(k, v))
    }

    /// Writes the daemon's stderr (its log) to `path`.
    pub fn log_to(mut self, path: &Path) -> Self {
        self.stderr = Stderr::File(path.to_owned());
        self
    }

    /// Every call of the daemon's [`Http`] client gives up after `timeout`.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Removes `base` (the state dirs' parent) once the daemon is dropped.
    pub fn remove_on_drop(mut self, base: &Path) -> Self {
        self.owned = Some(base.to_owned());
        self
    }

    /// Starts the daemon, waits for its address line and reads its admin key.
    pub fn start(self) -> std::io::Result<Daemon> {
        let mut cmd = Command::new(&self.exe);
        cmd.arg("--data-dir")
            .arg(&self.data)
            .arg("--run-dir")
            .arg(&self.run)
            .args(["server", "--listen", "127.0.0.1:0"])
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::piped())
            .stderr(match &self.stderr {
                Stderr::File(p) => Stdio::from(std::fs::File::create(p)?),
                Stderr::TestLog if std::env::var_os("DSEC_TEST_LOG").is_some() => Stdio::inherit(),
                Stderr::TestLog | Stderr::Null => Stdio::null(),
            });
        let mut child = cmd.spawn()?;
        let out = child.stdout.take().ok_or_else(|| other("no stdout"))?;
        let url = address_line(out, "dsec server listening on ");
        let Some(url) = url else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(other("the daemon did not print its address"));
        };
        let key = std::fs::read_to_string(self.data.join("admin.key"))?
            .trim()
            .to_owned();
        Ok(Daemon {
            http: Http::new(&url, Some(&key), Some(self.timeout)),
            child,
            url,
            key,
            data: self.data,
            run: self.run,
            owned: self.owned,
        })
    }
}

/// The rest of the first line of `out` (a child's stdout) that starts with `prefix`: the
/// address a `dsec server` or `dsec gateway` prints once it listens.
pub fn address_line(out: std::process::ChildStdout, prefix: &str) -> Option<String> {
    BufReader::new(out)
        .lines()
        .map_while(Result::ok)
        .find_map(|l| l.strip_prefix(prefix).map(str::to_owned))
}

fn other(what: &str) -> std::io::Error {
    std::io::Error::other(what.to_owned())
}

/// A started `dsec server`. Dropped while it still runs, it destroys the sandboxes it has
/// runtime dirs for (sandboxes outlive their daemon by design, so a failed test must not leave
/// them running), then stops it: SIGTERM, SIGKILL after 30 s.
pub struct Daemon {
    /// The `dsec server` process.
    pub child: Child,
    /// `http://127.0.0.1:<port>`.
    pub url: String,
    /// The admin API key.
    pub key: String,
    /// The data dir.
    pub data: PathBuf,
    /// The run dir.
    pub run: PathBuf,
    http: Http,
    owned: Option<PathBuf>,
}

impl Daemon {
    /// Its client, with the admin key.
    pub fn http(&self) -> &Http {
        &self.http
    }

    /// `METHOD PATH [BODY]` with the admin key: status and JSON answer (`Null` when it is not
    /// JSON); status 0 and `{"transport_error": ...}` when no answer came.
    pub fn req(&self, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
        self.http.req(method, path, body)
    }

    /// The daemon's process id.
    pub fn pid(&self) -> rustix::process::Pid {
        rustix::process::Pid::from_raw(self.child.id() as i32).expect("a child has a pid")
    }

    /// Whether the process has not exited.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Sends SIGTERM (the daemon drains and exits).
    pub fn sigterm(&self) {
        rustix::process::kill_process(self.pid(), rustix::process::Signal::TERM).expect("SIGTERM");
    }

    /// Kills the daemon with SIGKILL and reaps it.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits for the process to exit.
    pub fn wait(&mut self) -> ExitStatus {
        self.child.wait().expect("wait for dsec server")
    }

    /// SIGTERM, then asserts that it exits 0.
    pub fn stop(&mut self) {
        self.sigterm();
        let st = self.wait();
        assert!(st.success(), "exit after SIGTERM: {st:?}");
    }

    /// The sandboxes whose runtime dirs are under this daemon's run dir.
    pub fn run_dirs(&self) -> BTreeSet<String> {
        sandbox_run_dirs(&self.run)
    }

    /// Destroys, through the API, every sandbox with a runtime dir under this daemon's run dir
    /// (whatever its tenant).
    pub fn destroy_run_dirs(&self) {
        for id in self.run_dirs() {
            let _ = self.req("DELETE", &format!("/v1/sandboxes/{id}"), None);
        }
    }

    /// Removes the state dirs' parent (unless something is mounted below it).
    pub fn remove_dirs(&self) {
        if let Some(base) = self.data.parent() {
            remove_unless_mounted(base);
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if self.running() {
            // Let creates in flight land first, so that their sandboxes are destroyed too.
            std::thread::sleep(Duration::from_millis(300));
            self.destroy_run_dirs();
            if let Some(pid) = rustix::process::Pid::from_raw(self.child.id() as i32) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
            }
            let deadline = Instant::now() + Duration::from_secs(30);
            while self.running() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(base) = &self.owned {
            remove_unless_mounted(base);
        }
    }
}

/// Declares `struct NAME(dsec_testkit::Daemon)` that derefs, mutably too, to the fixture: a
/// test file's (or bench's) daemon, with that file's own helpers in an `impl NAME`.
///
/// ```ignore
/// dsec_testkit::daemon_type!(
///     /// A daemon of these tests.
///     struct Daemon
/// );
/// ```
#[macro_export]
macro_rules! daemon_type {
    ($(#[$meta:meta])* $vis:vis struct $name:ident) => {
        $(#[$meta])*
        $vis struct $name($crate::Daemon);

        impl ::std::ops::Deref for $name {
            type Target = $crate::Daemon;
            fn deref(&self) -> &$crate::Daemon {
                &self.0
            }
        }

        impl ::std::ops::DerefMut for $name {
            fn deref_mut(&mut self) -> &mut $crate::Daemon {
                &mut self.0
            }
        }
    };
}

/// `{"transport_error": what}`: the answer of a call that got none.
pub(crate) fn transport_error(e: &ureq::Error) -> Value {
    json!({"transport_error": e.to_string()})
}
