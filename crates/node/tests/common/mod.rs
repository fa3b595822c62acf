//! Shared fixture of the root-level container integration tests (`abuse.rs`, `lifecycle.rs`).
//!
//! - [`fixture`] starts ONE [`Runtime`] per test binary, with its own run dir under
//!   `/run/dsec-test-<pid>-<nanos>` (data dir inside it). The fixture lives in a `static`, which
//!   is never dropped, so a small cleaner process removes the run dir once the test process has
//!   exited. Stale run dirs of earlier test processes (whose pid is gone, e.g. killed before
//!   their cleaner ran) are swept at start: their mask tmpfs is unmounted and the tree removed.
//! - [`SbGuard`] owns one sandbox and destroys it when dropped, even when the test panics.
//! - [`LeakSnapshot`] counts what a sandbox could leave behind; every counter is scoped to this
//!   test process (its run dir, its own process tree, the sandbox ids it created), so other dsec
//!   users on the machine do not disturb it.
#![allow(dead_code)] // each test binary uses a different subset

mod run_dirs;

use std::collections::{BTreeSet, HashMap};
use std::fs;
use std::ops::{Deref, DerefMut};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use dsec_api::exec::{ExecRequest, ExecResult, ExecStatus};
use dsec_node::sandbox::{Limits, SandboxSpec};
use dsec_node::substrate::{Runtime, RuntimeConfig, RuntimeError, Sandbox};

/// The runtime shared by every test of one test binary.
pub struct Fixture {
    /// The runtime.
    pub rt: Runtime,
    /// Its run dir (unique to this process).
    pub run_dir: PathBuf,
    /// Its data dir (inside the run dir).
    pub data_dir: PathBuf,
    /// Ids of every sandbox created through [`create`] (for scoped leak counting).
    created: Mutex<Vec<String>>,
    /// The write end of the cleaner's stdin: closed by the kernel when this process exits,
    /// which tells the cleaner to remove the run dir.
    _cleaner: Option<std::process::ChildStdin>,
}

/// Starts a process that waits for this one to exit (its stdin reaches end of file when the
/// kernel closes our end), then removes `run_dir` without crossing into other file systems.
fn remove_at_exit(run_dir: &Path) -> Option<std::process::ChildStdin> {
    let mut child = std::process::Command::new("/bin/sh")
        .arg("-c")
        .arg("read _ || true; umount -l \"$1/mask\" 2>/dev/null; rm -rf --one-file-system \"$1\"")
        .arg("dsec-test-cleaner")
        .arg(run_dir)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .ok()?;
    child.stdin.take()
}

static FIXTURE: OnceLock<Fixture> = OnceLock::new();

fn agent_and_shim() -> (PathBuf, PathBuf) {
    // The workspace's binaries sit beside `deps/`, the directory of this test executable.
    let shim = std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.join("dsec-shim")))
        .expect("the test executable's directory");
    let agent = shim.with_file_name("dsec-agent");
    for b in [&agent, &shim] {
        assert!(
            b.is_file(),
            "{} is missing: build the whole workspace first (`cargo build --workspace`), \
             then run `cargo test --workspace` with the same CARGO_TARGET_DIR",
            b.display()
        );
    }
    (agent, shim)
}

/// The shared runtime, started on first use.
pub fn fixture() -> &'static Fixture {
    FIXTURE.get_or_init(|| {
        run_dirs::sweep_stale_run_dirs("dsec-test-");
        let (agent_bin, shim_bin) = agent_and_shim();
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let run_dir = PathBuf::from(format!("/run/dsec-test-{}-{nanos:08x}", std::process::id()));
        let data_dir = run_dir.join("data");
        let cleaner = remove_at_exit(&run_dir);
        let cfg = RuntimeConfig {
            data_dir: data_dir.clone(),
            run_dir: run_dir.clone(),
            agent_bin,
            shim_bin,
        };
        // Started on a thread that never exits: the spawner's PR_SET_PDEATHSIG fires when the
        // *thread* that forked it exits, and cargo runs each test on its own short-lived thread
        // (see `lifecycle_runtime_outlives_the_thread_that_started_it`).
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("dsec-test-runtime-owner".into())
            .spawn(move || {
                let _ = tx.send(Runtime::start(cfg));
                loop {
                    std::thread::park();
                }
            })
            .expect("spawn the runtime owner thread");
        let rt = rx
            .recv()
            .expect("runtime owner thread")
            .expect("start the container runtime");
        Fixture {
            rt,
            run_dir,
            data_dir,
            created: Mutex::new(Vec::new()),
            _cleaner: cleaner,
        }
    })
}

/// The runtime.
pub fn rt() -> &'static Runtime {
    &fixture().rt
}

/// Small limits used by most tests.
pub fn small_limits() -> Limits {
    Limits {
        memory_max: 64 << 20,
        pids_max: 64,
        disk_bytes: 16 << 20,
        ..Default::default()
    }
}

/// Owns a sandbox; destroys it on drop (also while unwinding from a failed assertion).
pub struct SbGuard {
    sb: Option<Sandbox>,
}

impl SbGuard {
    /// Destroys the sandbox now and returns the runtime's verdict.
    pub fn destroy(mut self) -> Result<(), RuntimeError> {
        let sb = self.sb.take().expect("sandbox present");
        sb.destroy(rt())
    }

    /// Runs a shell command with a timeout; panics on a transport/validation error.
    /// Runs `script` (see [`SbGuard::sh`]) and asserts it printed exactly `want`.
    pub fn sh_prints(&mut self, script: &str, timeout_ms: u64, want: &str) {
        let r = self.sh(script, timeout_ms);
        assert_eq!(stdout(&r), want, "{script}: {r:?}");
    }

    pub fn sh(&mut self, script: &str, timeout_ms: u64) -> ExecResult {
        let mut req = ExecRequest::shell(script);
        req.timeout_ms = Some(timeout_ms);
        self.run(&req)
    }

    /// Runs an argv command with a timeout; panics on a transport/validation error.
    pub fn argv(&mut self, argv: &[&str], timeout_ms: u64) -> ExecResult {
        let mut req = ExecRequest::argv(argv.iter().copied());
        req.timeout_ms = Some(timeout_ms);
        self.run(&req)
    }

    /// Runs a request; panics on a transport/validation error.
    pub fn run(&mut self, req: &ExecRequest) -> ExecResult {
        let id = self.id().to_owned();
        self.exec(rt(), req, b"", |_, _| {})
            .unwrap_or_else(|e| panic!("exec in {id}: {e:?}"))
    }
}

impl Deref for SbGuard {
    type Target = Sandbox;
    fn deref(&self) -> &Sandbox {
        self.sb.as_ref().expect("sandbox present")
    }
}

impl DerefMut for SbGuard {
    fn deref_mut(&mut self) -> &mut Sandbox {
        self.sb.as_mut().expect("sandbox present")
    }
}

impl Drop for SbGuard {
    fn drop(&mut self) {
        if let Some(sb) = self.sb.take() {
            let id = sb.id().to_owned();
            if let Err(e) = sb.destroy(rt()) {
                if !std::thread::panicking() {
                    eprintln!("destroy of {id} in guard failed: {e:?}");
                }
            }
        }
    }
}

/// `limits` as this node admits them (the tests ask for limits within range).
pub fn admitted(limits: Limits) -> dsec_node::capacity::Admitted {
    fixture()
        .rt
        .capacity()
        .admit(limits)
        .expect("limits this node admits")
}

/// Creates a sandbox with `limits` (host template) and guards it.
pub fn create(limits: Limits) -> SbGuard {
    create_spec(&SandboxSpec {
        limits: admitted(limits),
        ..Default::default()
    })
}

/// Creates a sandbox from `spec` and guards it.
pub fn create_spec(spec: &SandboxSpec) -> SbGuard {
    let fx = fixture();
    let (sb, _phases) = fx.rt.create(spec).expect("create sandbox");
    fx.created
        .lock()
        .expect("registry")
        .push(sb.id().to_owned());
    SbGuard { sb: Some(sb) }
}

/// Guards a sandbox created directly with `rt().create` (registers it for leak counting).
pub fn adopt(sb: Sandbox) -> SbGuard {
    fixture()
        .created
        .lock()
        .expect("registry")
        .push(sb.id().to_owned());
    SbGuard { sb: Some(sb) }
}

/// Stdout of a result as text.
pub fn stdout(r: &ExecResult) -> String {
    String::from_utf8_lossy(&r.stdout.data).into_owned()
}

/// Stderr of a result as text.
pub fn stderr(r: &ExecResult) -> String {
    String::from_utf8_lossy(&r.stderr.data).into_owned()
}

/// Asserts `r` finished with [`ExecStatus::Ok`] and printed exactly `want` on stdout.
pub fn assert_ok_stdout(r: &ExecResult, want: &str) {
    assert_eq!(
        (r.status, stdout(r).as_str()),
        (ExecStatus::Ok, want),
        "{r:?} {}",
        stderr(r)
    );
}

/// A spec of [`small_limits`] (admitted), in a user namespace when `userns`.
pub fn small_spec(userns: bool) -> SandboxSpec {
    SandboxSpec {
        limits: admitted(small_limits()),
        userns,
        ..Default::default()
    }
}

// ---------------------------------------------------------------------------------------------
// processes

/// One process seen in /proc.
#[derive(Debug, Clone)]
pub struct Proc {
    /// Host pid.
    pub pid: i32,
    /// Parent pid.
    pub ppid: i32,
    /// `comm`.
    pub comm: String,
    /// State letter.
    pub state: char,
}

/// Every process on the host (those that vanish while scanning are skipped).
pub fn all_procs() -> Vec<Proc> {
    let mut out = Vec::new();
    let Ok(entries) = fs::read_dir("/proc") else {
        return out;
    };
    for e in entries.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // pid (comm) S ppid ...: comm may contain spaces and parentheses.
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let comm = stat[open + 1..close].to_owned();
        let mut rest = stat[close + 1..].split_whitespace();
        let state = rest.next().and_then(|s| s.chars().next()).unwrap_or('?');
        let ppid = rest.next().and_then(|s| s.parse().ok()).unwrap_or(0);
        out.push(Proc {
            pid,
            ppid,
            comm,
            state,
        });
    }
    out
}

/// This process and every descendant of it.
pub fn our_tree() -> Vec<Proc> {
    let procs = all_procs();
    let mut children: HashMap<i32, Vec<usize>> = HashMap::new();
    for (i, p) in procs.iter().enumerate() {
        children.entry(p.ppid).or_default().push(i);
    }
    let me = std::process::id() as i32;
    let mut out = Vec::new();
    let mut stack = vec![me];
    let mut seen = BTreeSet::new();
    while let Some(pid) = stack.pop() {
        if !seen.insert(pid) {
            continue;
        }
        if let Some(p) = procs.iter().find(|p| p.pid == pid) {
            out.push(p.clone());
        }
        for &c in children.get(&pid).map(Vec::as_slice).unwrap_or(&[]) {
            stack.push(procs[c].pid);
        }
    }
    out
}

/// The namespace inode of `kind` (`pid`, `net`, ...) of a process.
pub fn ns_inode(pid: i32, kind: &str) -> Option<u64> {
    fs::metadata(format!("/proc/{pid}/ns/{kind}"))
        .ok()
        .map(|m| m.ino())
}

/// Host pids of every process in the pid namespace with inode `ns`.
pub fn procs_in_pid_ns(ns: u64) -> Vec<i32> {
    all_procs()
        .into_iter()
        .filter(|p| ns_inode(p.pid, "pid") == Some(ns))
        .map(|p| p.pid)
        .collect()
}

/// Host pids of the live (not zombie) processes in the pid namespace with inode `ns`.
pub fn live_procs_in_pid_ns(ns: u64) -> Vec<i32> {
    all_procs()
        .into_iter()
        .filter(|p| p.state != 'Z' && p.state != 'X' && ns_inode(p.pid, "pid") == Some(ns))
        .map(|p| p.pid)
        .collect()
}

/// Which of `members` (processes seen in pid namespace `ns` earlier) are still alive in it.
/// Checking named processes, not "anything in that namespace", matters because namespace inode
/// numbers are reused as soon as a namespace is gone (e.g. by the next pre-built shell).
pub fn members_alive(ns: u64, members: &[i32]) -> Vec<i32> {
    let now = live_procs_in_pid_ns(ns);
    members
        .iter()
        .copied()
        .filter(|p| now.contains(p))
        .collect()
}

/// The NUL-separated strings of `/proc/<pid>/<file>` (`cmdline`, `environ`), empty ones left
/// out.
pub fn proc_strings(pid: i32, file: &str) -> std::io::Result<Vec<String>> {
    Ok(fs::read(format!("/proc/{pid}/{file}"))?
        .split(|&b| b == 0)
        .filter(|v| !v.is_empty())
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .collect())
}

/// The command line of a process, its arguments joined by spaces (empty when it is gone).
pub fn cmdline(pid: i32) -> String {
    proc_strings(pid, "cmdline").unwrap_or_default().join(" ")
}

/// `pid comm state cmdline`, for failure messages.
pub fn describe(pid: i32) -> String {
    let p = all_procs().into_iter().find(|p| p.pid == pid);
    match p {
        Some(p) => format!(
            "{} ({}) {} ppid={} [{}]",
            p.pid,
            p.comm,
            p.state,
            p.ppid,
            cmdline(pid)
        ),
        None => format!("{pid} (gone)"),
    }
}

/// Waits until `cond` holds or `limit` passes; returns whether it held.
pub fn wait_until(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The directory of a sandbox's cgroup in the hierarchy that has `file` (e.g. `pids.max`).
pub fn cgroup_dir_with(id: &str, file: &str) -> Option<PathBuf> {
    rt().cgroups()
        .open(id)?
        .dirs()
        .into_iter()
        .find(|d| d.join(file).exists())
}

/// Reads a cgroup counter file of a sandbox as a number.
pub fn cgroup_u64(id: &str, file: &str) -> Option<u64> {
    let dir = cgroup_dir_with(id, file)?;
    fs::read_to_string(dir.join(file)).ok()?.trim().parse().ok()
}

// ---------------------------------------------------------------------------------------------
// leak counters

/// What a sandbox could leave behind, counted for this test process only.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeakSnapshot {
    /// Overlay mounts in our mount namespace that use our run or data dir.
    pub overlay_mounts: usize,
    /// Directories of our sandboxes under each dsec cgroup base (all hierarchies).
    pub cgroup_dirs: usize,
    /// Every directory under the dsec cgroup bases whose name is one of our sandbox ids, by name
    /// (for the failure message).
    pub cgroup_names: Vec<String>,
    /// `dsec-sup` processes in our process tree.
    pub supervisors: usize,
    /// `dsec-agent` processes (comm `memfd:dsec-agen`) in our process tree.
    pub agents: usize,
    /// All processes in our tree except this one and the spawner.
    pub tree_procs: usize,
    /// Open descriptors of this process.
    pub fds: usize,
    /// Distinct network namespaces in our process tree.
    pub net_namespaces: usize,
    /// Entries in `<run_dir>/sandboxes`.
    pub run_entries: usize,
}

/// Runs `body` holding `serial` (a test binary's lock for the tests that must run alone) and
/// asserts that within `settle` afterwards it left nothing behind (see [`LeakSnapshot`]).
pub fn leak_checked(serial: &Mutex<()>, settle: Duration, body: impl FnOnce()) {
    let _serial = serial.lock().unwrap_or_else(|p| p.into_inner());
    let base = LeakSnapshot::take();
    body();
    LeakSnapshot::assert_back_to(&base, settle);
}

impl LeakSnapshot {
    /// Counts now.
    pub fn take() -> Self {
        let fx = fixture();
        let run = fx.run_dir.display().to_string();
        let overlay_mounts = fs::read_to_string("/proc/self/mountinfo")
            .unwrap_or_default()
            .lines()
            .filter(|l| {
                l.split(" - ")
                    .nth(1)
                    .is_some_and(|t| t.starts_with("overlay "))
                    && l.contains(&run)
            })
            .count();
        let ids: BTreeSet<String> = fx
            .created
            .lock()
            .expect("registry")
            .iter()
            .cloned()
            .collect();
        let mut cgroup_dirs = 0;
        let mut names = BTreeSet::new();
        for base in fx.rt.cgroups().base_dirs() {
            for e in fs::read_dir(&base).into_iter().flatten().flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if e.path().is_dir() && ids.contains(&name) {
                    cgroup_dirs += 1;
                    names.insert(name);
                }
            }
        }
        // Idle pre-built shells (`dsec-shell` and the agent waiting under it, kept by the spawner
        // for fast creates) are part of the runtime, not of any sandbox; their number
        // fluctuates while they are replaced.
        let all = our_tree();
        let shells: BTreeSet<i32> = all
            .iter()
            .filter(|p| p.comm == "dsec-shell")
            .map(|p| p.pid)
            .collect();
        let tree: Vec<_> = all
            .into_iter()
            .filter(|p| !shells.contains(&p.pid) && !shells.contains(&p.ppid))
            .collect();
        let me = std::process::id() as i32;
        let supervisors = tree.iter().filter(|p| p.comm == "dsec-sup").count();
        let agents = tree.iter().filter(|p| p.comm.contains("dsec-agen")).count();
        let tree_procs = tree
            .iter()
            .filter(|p| p.pid != me && p.comm != "dsec-spawner")
            .count();
        // Minus the request sockets of idle pre-built shells, which belong to the runtime.
        let fds = fs::read_dir("/proc/self/fd")
            .map(|d| d.count())
            .unwrap_or(0)
            .saturating_sub(fx.rt.idle_shells());
        let net_namespaces = tree
            .iter()
            .filter_map(|p| ns_inode(p.pid, "net"))
            .collect::<BTreeSet<_>>()
            .len();
        let run_entries = fs::read_dir(fx.run_dir.join("sandboxes"))
            .map(|d| d.count())
            .unwrap_or(0);
        Self {
            overlay_mounts,
            cgroup_dirs,
            cgroup_names: names.into_iter().collect(),
            supervisors,
            agents,
            tree_procs,
            fds,
            net_namespaces,
            run_entries,
        }
    }

    /// True when nothing grew compared to `baseline` (a count going down is not a leak: the
    /// baseline may include a process that finished meanwhile).
    fn within(&self, baseline: &LeakSnapshot) -> bool {
        self.overlay_mounts <= baseline.overlay_mounts
            && self.cgroup_dirs <= baseline.cgroup_dirs
            && self
                .cgroup_names
                .iter()
                .all(|n| baseline.cgroup_names.contains(n))
            && self.supervisors <= baseline.supervisors
            && self.agents <= baseline.agents
            && self.tree_procs <= baseline.tree_procs
            && self.fds <= baseline.fds
            && self.net_namespaces <= baseline.net_namespaces
            && self.run_entries <= baseline.run_entries
    }

    /// Waits (bounded) until no counter is above `baseline`; panics with both when one is.
    pub fn assert_back_to(baseline: &LeakSnapshot, within: Duration) {
        let mut now = LeakSnapshot::take();
        let ok = wait_until(within, || {
            now = LeakSnapshot::take();
            now.within(baseline)
        });
        assert!(ok, "leak counters did not return to baseline within {within:?}:\n before: {baseline:?}\n after:  {now:?}");
    }
}
