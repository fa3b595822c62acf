//! Launching a container sandbox: `clone` into new namespaces, build the root filesystem inside
//! the child's own mount namespace, drop every privilege and `execveat` the agent.
//!
//! The caller (a per-sandbox supervisor) must be single-threaded: [`spawn_container`] and
//! [`fork_process`] check this and refuse otherwise, which is what makes them safe to call.
//! Because the parent is single-threaded, the child may allocate; it still prepares every path
//! before the clone so that the child does little more than system calls.
//!
//! Child sequence (each step reports `step:errno` on the error pipe and exits on failure):
//! wait for the supervisor's go byte (cgroup attached, id maps written) → cgroup namespace →
//! private mount tree → size/inode-limited tmpfs → overlay (template layers read-only, upper on the
//! tmpfs) → minimal `/dev` → fresh `/proc` with masked and read-only paths → writable scratch
//! directories, read-only root → `pivot_root` → hostname → `lo` up → rlimits → fds 3/4 only →
//! securebits, capability sets and bounding set cleared → `no_new_privs` + seccomp → `execveat`.

use std::ffi::{CStr, CString};
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use crate::seccomp::Filter;

mod ipc_ns;
mod tree;

pub use ipc_ns::IpcNamespace;
pub use tree::{
    build_root_tree, enter_private_mount_ns, enter_root_tree, reset_in_place, set_hostname_of,
    ResetState, RootTree,
};

/// Errors of the launch path (parent side; the child reports through the error pipe).
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// The calling process has more than one thread.
    #[error("launch requires a single-threaded process (found {threads} threads)")]
    NotSingleThreaded {
        /// Threads found.
        threads: usize,
    },
    /// A path or option contained a NUL byte.
    #[error("invalid launch argument {what}")]
    InvalidArgument {
        /// Which argument.
        what: &'static str,
    },
    /// `clone` failed.
    #[error("clone sandbox process")]
    Clone(#[source] io::Error),
    /// `fork` failed.
    #[error("fork supervisor process")]
    Fork(#[source] io::Error),
    /// Creating a pipe or socket failed.
    #[error("create {what}")]
    Create {
        /// What was being created.
        what: &'static str,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// Writing the user namespace id maps failed.
    #[error("write id maps of pid {pid}")]
    IdMap {
        /// Child pid.
        pid: i32,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// The child failed one of its setup steps.
    #[error("sandbox setup failed at {step} ({errno})")]
    ChildSetup {
        /// The step name.
        step: String,
        /// The OS error.
        errno: io::Error,
    },
}

/// Namespace and identity options of one sandbox.
#[derive(Debug, Clone)]
pub struct NamespaceSpec {
    /// Also create a user namespace mapping root inside to `host_uid`/`host_gid` (and a range of
    /// `count` ids above them).
    pub user: Option<IdMap>,
    /// Hostname inside the UTS namespace.
    pub hostname: String,
}

/// A user-namespace id mapping: ids `0..count` inside map to `host_id..host_id+count` outside.
#[derive(Debug, Clone, Copy)]
pub struct IdMap {
    /// First host uid.
    pub host_uid: u32,
    /// First host gid.
    pub host_gid: u32,
    /// Number of ids mapped.
    pub count: u32,
}

/// The root filesystem of one sandbox.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct RootfsSpec {
    /// Host directory on which the sandbox's private tmpfs is mounted (inside its own mount
    /// namespace only; every sandbox may use the same directory).
    pub stage: String,
    /// Overlay lower directories, topmost first.
    pub lowerdirs: Vec<String>,
    /// Size of the writable layer tmpfs in bytes (the disk quota).
    pub disk_bytes: u64,
    /// Inode limit of the writable layer tmpfs.
    pub disk_inodes: u64,
    /// Requested size of `/dev/shm` in bytes. `/dev/shm` is a directory of the writable layer's
    /// tmpfs (one superblock less per sandbox), so it shares the disk quota (`disk_bytes`) and
    /// is bounded by it rather than by this value.
    pub shm_bytes: u64,
    /// Keep the whole root writable (writes land in the private upper layer). When false the
    /// root is read-only and only `scratch` directories are writable.
    pub writable_root: bool,
    /// Writable directories (absolute paths inside the sandbox) when the root is read-only.
    pub scratch: Vec<String>,
    /// An empty directory on a tmpfs shared by the node's sandboxes (host path, visible before
    /// the pivot), bound read-only over the masked `/proc` directories. Without it each masked
    /// directory gets an empty tmpfs of its own: a superblock, and with it a memcg-aware
    /// shrinker, per directory and sandbox.
    #[serde(default)]
    pub empty_dir: Option<String>,
}

/// An rlimit to set in the child.
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct Rlimit {
    /// `libc::RLIMIT_*`.
    pub resource: u32,
    /// Soft and hard value.
    pub value: u64,
}

/// Everything the child needs, validated and converted before the clone.
pub struct ContainerSpec<'a> {
    /// Namespaces.
    pub ns: NamespaceSpec,
    /// Root filesystem.
    pub rootfs: RootfsSpec,
    /// Resource limits.
    pub rlimits: Vec<Rlimit>,
    /// The agent executable (a sealed memfd), exec'd with `execveat(AT_EMPTY_PATH)`.
    pub agent_exe: &'a OwnedFd,
    /// The agent's protocol socket, becomes fd 3 in the child.
    pub agent_sock: &'a OwnedFd,
    /// Agent argv.
    pub argv: Vec<String>,
    /// Agent environment (already allowlisted).
    pub env: Vec<(String, String)>,
    /// The seccomp filter, built before the clone.
    pub seccomp: &'a Filter,
}

/// A started sandbox init process, seen from the supervisor.
#[derive(Debug)]
pub struct Launched {
    /// Host pid of the sandbox's init (the agent).
    pub pid: i32,
}

/// Masked `/proc` entries (OCI defaults): files get the host's `/dev/null` bound over them,
/// directories an empty directory ([`RootfsSpec::empty_dir`]), both read-only.
pub const MASKED_PROC: &[&str] = &[
    "acpi",
    "asound",
    "kcore",
    "keys",
    "latency_stats",
    "timer_list",
    "timer_stats",
    "sched_debug",
    "scsi",
    "kallsyms",
    "sysrq-trigger",
];
/// Read-only `/proc` entries (OCI defaults).
pub const READONLY_PROC: &[&str] = &["bus", "fs", "irq", "sys"];

struct Prepared {
    stage: CString,
    tmpfs_opts: CString,
    upper: CString,
    work: CString,
    /// Where the overlay is mounted: the new root.
    root: CString,
    overlay_opts: CString,
    dev: CString,
    dev_src: CString,
    dev_src_dirs: [CString; 3],
    proc_: CString,
    masked: Vec<CString>,
    readonly: Vec<CString>,
    empty_dir: Option<CString>,
    dev_nodes: Vec<DevNode>,
    pts: CString,
    /// `<root>/dev/mqueue`: the sandbox's IPC namespace's POSIX message queues, as files.
    mqueue: CString,
    shm: CString,
    shm_src: CString,
    dev_links: Vec<(CString, CString)>,
    scratch: Vec<CString>,
    scratch_src: Vec<CString>,
    hostname: CString,
    _argv: Vec<CString>,
    _envp: Vec<CString>,
    argv_ptrs: Vec<*const libc::c_char>,
    envp_ptrs: Vec<*const libc::c_char>,
    userns: bool,
    writable_root: bool,
    placeholder: bool,
}

/// One device node of the sandbox's `/dev`.
struct DevNode {
    /// Where it is created: `<stage>/dev/<name>`, on the sandbox's tmpfs.
    src: CString,
    /// Where the sandbox sees it: `<root>/dev/<name>`.
    dst: CString,
    /// The host's node (`/dev/<name>`), bound over `dst` in a user namespace.
    host: CString,
    major: u32,
    minor: u32,
}

fn cstr(s: impl Into<Vec<u8>>, what: &'static str) -> Result<CString, LaunchError> {
    CString::new(s).map_err(|_| LaunchError::InvalidArgument { what })
}

fn prepare(spec: &ContainerSpec<'_>) -> Result<Prepared, LaunchError> {
    prepare_parts(
        &spec.rootfs,
        &spec.ns.hostname,
        &spec.argv,
        &spec.env,
        spec.ns.user.is_some(),
    )
}

fn prepare_parts(
    r: &RootfsSpec,
    hostname: &str,
    argv: &[String],
    env: &[(String, String)],
    userns: bool,
) -> Result<Prepared, LaunchError> {
    for l in &r.lowerdirs {
        if l.contains(':') || l.contains(',') {
            return Err(LaunchError::InvalidArgument { what: "lowerdir" });
        }
    }
    let stage = r.stage.trim_end_matches('/').to_string();
    let root = format!("{stage}/root");
    let dev = format!("{root}/dev");
    let dev_src = format!("{stage}/dev");
    let proc_ = format!("{root}/proc");
    let dev_nodes = [
        ("null", 1, 3),
        ("zero", 1, 5),
        ("full", 1, 7),
        ("random", 1, 8),
        ("urandom", 1, 9),
        ("tty", 5, 0),
    ]
    .iter()
    .map(|(n, ma, mi)| {
        Ok(DevNode {
            src: cstr(format!("{dev_src}/{n}"), "dev")?,
            dst: cstr(format!("{dev}/{n}"), "dev")?,
            host: cstr(format!("/dev/{n}"), "dev")?,
            major: *ma,
            minor: *mi,
        })
    })
    .collect::<Result<Vec<_>, LaunchError>>()?;
    let dev_links = [
        ("ptmx", "pts/ptmx"),
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ]
    .iter()
    .map(|(n, t)| Ok((cstr(format!("{dev_src}/{n}"), "dev")?, cstr(*t, "dev")?)))
    .collect::<Result<Vec<_>, LaunchError>>()?;
    let argv: Vec<CString> = argv
        .iter()
        .map(|a| cstr(a.as_str(), "argv"))
        .collect::<Result<_, _>>()?;
    let envp: Vec<CString> = env
        .iter()
        .map(|(k, v)| cstr(format!("{k}={v}"), "env"))
        .collect::<Result<_, _>>()?;
    let mut argv_ptrs: Vec<*const libc::c_char> = argv.iter().map(|c| c.as_ptr()).collect();
    argv_ptrs.push(std::ptr::null());
    let mut envp_ptrs: Vec<*const libc::c_char> = envp.iter().map(|c| c.as_ptr()).collect();
    envp_ptrs.push(std::ptr::null());
    let scratch = r
        .scratch
        .iter()
        .map(|s| {
            let rel = s.trim_start_matches('/');
            if rel.is_empty() || rel.split('/').any(|c| c == ".." || c == ".") {
                return Err(LaunchError::InvalidArgument { what: "scratch" });
            }
            cstr(format!("{root}/{rel}"), "scratch")
        })
        .collect::<Result<Vec<_>, _>>()?;
    let scratch_src = (0..scratch.len())
        .map(|i| cstr(format!("{stage}/scratch{i}"), "scratch"))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Prepared {
        scratch_src,
        tmpfs_opts: cstr(
            format!(
                "size={},nr_inodes={},mode=0755",
                r.disk_bytes.max(4096),
                r.disk_inodes.max(16)
            ),
            "tmpfs",
        )?,
        upper: cstr(format!("{stage}/upper"), "stage")?,
        work: cstr(format!("{stage}/work"), "stage")?,
        overlay_opts: cstr(
            format!(
                "lowerdir={},upperdir={stage}/upper,workdir={stage}/work{}",
                r.lowerdirs.join(":"),
                // Inside a user namespace overlayfs cannot use trusted.* xattrs.
                if userns { ",userxattr" } else { "" }
            ),
            "overlay",
        )?,
        root: cstr(root.as_str(), "stage")?,
        dev: cstr(dev.as_str(), "dev")?,
        dev_src_dirs: [
            cstr(format!("{dev_src}/pts"), "dev")?,
            cstr(format!("{dev_src}/shm"), "dev")?,
            cstr(format!("{dev_src}/mqueue"), "dev")?,
        ],
        dev_src: cstr(dev_src, "dev")?,
        empty_dir: r
            .empty_dir
            .as_deref()
            .map(|d| cstr(d, "empty_dir"))
            .transpose()?,
        masked: MASKED_PROC
            .iter()
            .map(|p| cstr(format!("{proc_}/{p}"), "proc"))
            .collect::<Result<_, _>>()?,
        readonly: READONLY_PROC
            .iter()
            .map(|p| cstr(format!("{proc_}/{p}"), "proc"))
            .collect::<Result<_, _>>()?,
        proc_: cstr(proc_, "proc")?,
        dev_nodes,
        pts: cstr(format!("{dev}/pts"), "dev")?,
        mqueue: cstr(format!("{dev}/mqueue"), "dev")?,
        shm: cstr(format!("{dev}/shm"), "dev")?,
        shm_src: cstr(format!("{stage}/shm"), "dev")?,
        dev_links,
        scratch,
        hostname: cstr(hostname, "hostname")?,
        stage: cstr(stage, "stage")?,
        _argv: argv,
        _envp: envp,
        argv_ptrs,
        envp_ptrs,
        userns,
        placeholder: r.lowerdirs.is_empty(),
        writable_root: r.writable_root,
    })
}

/// Number of threads of the calling process.
pub fn thread_count() -> usize {
    // A task directory's link count is 2 plus its threads: one `statx`, where listing the
    // directory takes an open, two reads and a close.
    use std::os::unix::fs::MetadataExt;
    match std::fs::metadata("/proc/self/task") {
        Ok(m) if m.nlink() >= 3 => (m.nlink() - 2) as usize,
        _ => std::fs::read_dir("/proc/self/task")
            .map(|d| d.count())
            .unwrap_or(usize::MAX),
    }
}

fn ensure_single_threaded() -> Result<(), LaunchError> {
    match thread_count() {
        1 => Ok(()),
        threads => Err(LaunchError::NotSingleThreaded { threads }),
    }
}

/// The result of [`fork_process`].
#[derive(Debug)]
pub enum Forked {
    /// In the parent, with the child's pid.
    Parent(i32),
    /// In the child.
    Child,
}

/// `fork()` for a single-threaded caller (checked). The child is an exact copy; because no other
/// thread existed, no lock can be held by a thread that vanished, so the child may run ordinary
/// code.
pub fn fork_process() -> Result<Forked, LaunchError> {
    ensure_single_threaded()?;
    // SAFETY: the process is single-threaded (checked above), so the child inherits no lock held
    // by another thread and may continue executing arbitrary Rust code.
    let pid = unsafe { libc::fork() };
    match pid {
        -1 => Err(LaunchError::Fork(io::Error::last_os_error())),
        0 => Ok(Forked::Child),
        pid => Ok(Forked::Parent(pid)),
    }
}

fn pipe_cloexec(what: &'static str) -> Result<(OwnedFd, OwnedFd), LaunchError> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: `fds` is a valid array of two ints for pipe2 to fill.
    let rc = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
    if rc != 0 {
        return Err(LaunchError::Create {
            what,
            source: io::Error::last_os_error(),
        });
    }
    // SAFETY: pipe2 succeeded, so both fds are open and owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// The parts of a launch that travel to the (already cloned) sandbox init as data.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct LaunchParams {
    /// Hostname inside the UTS namespace.
    pub hostname: String,
    /// Root filesystem.
    pub rootfs: RootfsSpec,
    /// Resource limits.
    pub rlimits: Vec<Rlimit>,
    /// Agent argv.
    pub argv: Vec<String>,
    /// Agent environment (already allowlisted).
    pub env: Vec<(String, String)>,
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

impl ContainerSpec<'_> {
    /// The data part of the spec.
    pub fn params(&self) -> LaunchParams {
        LaunchParams {
            hostname: self.ns.hostname.clone(),
            rootfs: self.rootfs.clone(),
            rlimits: self.rlimits.clone(),
            argv: self.argv.clone(),
            env: self.env.clone(),
        }
    }
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

/// Reports `step:errno` on the error pipe and exits. Never returns.
fn fail(err: &OwnedFd, step: &str) -> ! {
    let errno = io::Error::last_os_error().raw_os_error().unwrap_or(0);
    let msg = format!("{step}:{errno}");
    // SAFETY: writing a valid buffer to an fd we own, then exiting without running destructors
    // (the parent's state must not be torn down from the child).
    unsafe {
        libc::write(err.as_raw_fd(), msg.as_ptr().cast(), msg.len());
        libc::_exit(127);
    }
}

fn check(rc: libc::c_int, err: &OwnedFd, step: &str) {
    if rc < 0 {
        fail(err, step);
    }
}

fn mount(
    err: &OwnedFd,
    step: &'static str,
    src: &CStr,
    target: &CStr,
    fstype: Option<&CStr>,
    flags: libc::c_ulong,
    data: Option<&CStr>,
) {
    if let Err(e) = try_mount(step, src, target, fstype, flags, data) {
        fail_step(err, e);
    }
}

fn mkdir(path: &CStr, mode: libc::mode_t) -> libc::c_int {
    // SAFETY: valid NUL-terminated path.
    let rc = unsafe { libc::mkdir(path.as_ptr(), mode) };
    if rc < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::EEXIST) {
        0
    } else {
        rc
    }
}

/// `mkdir -p`: creates missing parents too (a template may lack `/var` for `/var/tmp`).
fn mkdir_parents(path: &CStr, mode: libc::mode_t) -> libc::c_int {
    if mkdir(path, mode) == 0 {
        return 0;
    }
    if io::Error::last_os_error().raw_os_error() != Some(libc::ENOENT) {
        return -1;
    }
    let bytes = path.to_bytes();
    let mut rc = 0;
    for (i, b) in bytes.iter().enumerate().skip(1) {
        if *b == b'/' {
            if let Ok(parent) = CString::new(&bytes[..i]) {
                rc = mkdir(&parent, mode);
            }
        }
    }
    if rc < 0 {
        return rc;
    }
    mkdir(path, mode)
}

/// Kind of an existing path, without following a final symlink.
fn path_kind(path: &CStr) -> Option<libc::mode_t> {
    // SAFETY: zeroed stat is a valid out-parameter; path is NUL-terminated.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let rc = unsafe { libc::lstat(path.as_ptr(), &mut st) };
    (rc == 0).then_some(st.st_mode & libc::S_IFMT)
}

const NONE: &CStr = c"none";

/// A failed setup step: its name and errno.
#[derive(Debug, Clone, Copy)]
pub struct StepError {
    step: &'static str,
    errno: i32,
}

impl StepError {
    fn last(step: &'static str) -> Self {
        Self {
            step,
            errno: io::Error::last_os_error().raw_os_error().unwrap_or(0),
        }
    }
}

impl From<StepError> for LaunchError {
    fn from(e: StepError) -> Self {
        LaunchError::ChildSetup {
            step: e.step.to_string(),
            errno: io::Error::from_raw_os_error(e.errno),
        }
    }
}

fn ck(rc: libc::c_int, step: &'static str) -> Result<(), StepError> {
    if rc < 0 {
        Err(StepError::last(step))
    } else {
        Ok(())
    }
}

fn try_mount(
    step: &'static str,
    src: &CStr,
    target: &CStr,
    fstype: Option<&CStr>,
    flags: libc::c_ulong,
    data: Option<&CStr>,
) -> Result<(), StepError> {
    // SAFETY: every pointer is a valid NUL-terminated string (or null where the kernel allows it).
    let rc = unsafe {
        libc::mount(
            src.as_ptr(),
            target.as_ptr(),
            fstype.map_or(std::ptr::null(), CStr::as_ptr),
            flags,
            data.map_or(std::ptr::null(), |d| d.as_ptr().cast()),
        )
    };
    ck(rc, step)
}

/// Builds the sandbox's `/dev` (but for devpts) without a filesystem of its own: the nodes,
/// links and mount points are created in `<stage>/dev`, a directory of the sandbox's tmpfs
/// (beside the overlay's upper and work directories, so not reachable through the overlay),
/// which is bound on `<root>/dev` and made read-only; `/dev/shm` is a bind of `<stage>/shm`,
/// another directory of that tmpfs. Each superblock costs every memory cgroup created later on
/// the host (see docs/SPECIFICATION.md), and these two used to be tmpfs mounts of their own.
/// `/dev/shm` thereby shares the disk quota, and a fresh tmpfs means a fresh `/dev/shm`.
fn build_dev(p: &Prepared) -> Result<(), StepError> {
    let nul = c"";
    ck(mkdir(&p.dev_src, 0o755), "mkdir_dev_src")?;
    ck(
        // SAFETY: valid path; the umask may have cleared bits.
        unsafe { libc::chmod(p.dev_src.as_ptr(), 0o755) },
        "chmod_dev",
    )?;
    for n in &p.dev_nodes {
        if p.userns {
            // SAFETY: valid path; creating an empty regular file as a bind-mount target.
            let fd = unsafe {
                libc::open(
                    n.src.as_ptr(),
                    libc::O_CREAT | libc::O_CLOEXEC | libc::O_WRONLY,
                    0o666,
                )
            };
            ck(fd, "dev_file")?;
            // SAFETY: closing the fd we just opened.
            unsafe { libc::close(fd) };
        } else {
            let dev = libc::makedev(n.major, n.minor);
            ck(
                // SAFETY: valid path and a character device number.
                unsafe { libc::mknod(n.src.as_ptr(), libc::S_IFCHR | 0o666, dev) },
                "mknod",
            )?;
            // SAFETY: valid path; umask may have cleared bits.
            ck(unsafe { libc::chmod(n.src.as_ptr(), 0o666) }, "chmod_dev")?;
        }
    }
    for (link, target) in &p.dev_links {
        ck(
            // SAFETY: both are valid NUL-terminated strings.
            unsafe { libc::symlink(target.as_ptr(), link.as_ptr()) },
            "dev_link",
        )?;
    }
    for d in &p.dev_src_dirs {
        ck(mkdir(d, 0o755), "mkdir_dev_dir")?;
    }
    ck(mkdir(&p.shm_src, 0o1777), "mkdir_shm")?;
    ck(
        // SAFETY: valid path; the umask may have cleared bits.
        unsafe { libc::chmod(p.shm_src.as_ptr(), 0o1777) },
        "chmod_shm",
    )?;
    try_mount("dev_bind", &p.dev_src, &p.dev, None, libc::MS_BIND, None)?;
    if p.userns {
        for n in &p.dev_nodes {
            try_mount("dev_node_bind", &n.host, &n.dst, None, libc::MS_BIND, None)?;
            // The host's devtmpfs is not nosuid; this bind must be.
            try_mount(
                "dev_node_remount",
                nul,
                &n.dst,
                None,
                libc::MS_BIND | libc::MS_REMOUNT | libc::MS_NOSUID | libc::MS_NOEXEC,
                None,
            )?;
        }
    }
    // The bind keeps the tmpfs mount's nosuid and nodev.
    try_mount("shm_bind", &p.shm_src, &p.shm, None, libc::MS_BIND, None)?;
    // Read-only, and not nodev (the nodes must work; no process in the sandbox can create nodes,
    // it has no CAP_MKNOD, and nothing else of the tmpfs is reachable without nodev). Only
    // /dev/shm and /dev/pts take writes.
    try_mount(
        "dev_ro",
        nul,
        &p.dev,
        None,
        libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NOEXEC,
        None,
    )
}

/// Populates the new root (`/dev`, `/proc` with masks, scratch dirs, read-only root) and pivots
/// the caller's mount namespace onto it. `pivot_root` moves the root and cwd of every process of
/// the namespace that was at the old root, which is what makes an in-place reset possible.
fn populate_and_pivot(p: &Prepared) -> Result<(), StepError> {
    let nul = c"";
    let nosuid_nodev = libc::MS_NOSUID | libc::MS_NODEV;
    ck(mkdir(&p.dev, 0o755), "mkdir_dev")?;
    build_dev(p)?;
    try_mount(
        "devpts",
        c"devpts",
        &p.pts,
        Some(c"devpts"),
        libc::MS_NOSUID | libc::MS_NOEXEC,
        Some(c"newinstance,ptmxmode=0666,mode=0620"),
    )?;
    // The queues of the sandbox's own IPC namespace (the mount takes the mounter's): code in
    // the sandbox can list and remove what it made, as the function substrate's driver does
    // between calls. Like /dev/pts it moves across in-place resets.
    try_mount(
        "mqueue",
        c"mqueue",
        &p.mqueue,
        Some(c"mqueue"),
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        None,
    )?;

    // /proc for the sandbox's pid namespace, with the OCI masked and read-only paths.
    ck(mkdir(&p.proc_, 0o555), "mkdir_proc")?;
    try_mount(
        "proc",
        c"proc",
        &p.proc_,
        Some(c"proc"),
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        None,
    )?;
    // Masks come from outside the sandbox's tmpfs: /proc moves across resets, and a bind
    // from the tmpfs would keep the first writable layer alive with it.
    let devnull = &p.dev_nodes[0].host;
    let ro = libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_NOEXEC;
    for m in &p.masked {
        match path_kind(m) {
            Some(libc::S_IFDIR) => match &p.empty_dir {
                Some(empty) => {
                    try_mount("mask_dir", empty, m, None, libc::MS_BIND, None)?;
                    try_mount("mask_dir_ro", nul, m, None, ro | nosuid_nodev, None)?;
                }
                None => try_mount(
                    "mask_dir",
                    c"tmpfs",
                    m,
                    Some(c"tmpfs"),
                    libc::MS_RDONLY | nosuid_nodev | libc::MS_NOEXEC,
                    Some(c"size=0,nr_inodes=1"),
                )?,
            },
            Some(_) => {
                try_mount("mask_file", devnull, m, None, libc::MS_BIND, None)?;
                // In a user namespace also nodev, as it always was there.
                let nodev = if p.userns { libc::MS_NODEV } else { 0 };
                try_mount(
                    "mask_remount",
                    nul,
                    m,
                    None,
                    ro | libc::MS_NOSUID | nodev,
                    None,
                )?;
            }
            None => {}
        }
    }
    for r in &p.readonly {
        if path_kind(r).is_some() {
            try_mount("ro_bind", r, r, None, libc::MS_BIND | libc::MS_REC, None)?;
            try_mount(
                "ro_remount",
                nul,
                r,
                None,
                libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | nosuid_nodev | libc::MS_NOEXEC,
                None,
            )?;
        }
    }

    if !p.writable_root {
        for (s, src) in p.scratch.iter().zip(&p.scratch_src) {
            if p.userns {
                // Inside a user namespace the template's directories belong to unmapped host
                // ids and cannot be written even through the overlay: each scratch directory is
                // a fresh directory of the sandbox's own tmpfs (same disk quota) bound on top.
                if path_kind(s).is_none() && mkdir(s, 0o755) < 0 {
                    continue;
                }
                ck(mkdir(src, 0o755), "mkdir_scratch_src")?;
                let sticky = s.to_bytes().ends_with(b"tmp");
                ck(
                    // SAFETY: valid path.
                    unsafe { libc::chmod(src.as_ptr(), if sticky { 0o1777 } else { 0o755 }) },
                    "chmod_scratch",
                )?;
                try_mount("scratch_bind", src, s, None, libc::MS_BIND, None)?;
                continue;
            }
            ck(mkdir_parents(s, 0o755), "mkdir_scratch")?;
            try_mount("scratch_bind", s, s, None, libc::MS_BIND, None)?;
            try_mount(
                "scratch_remount",
                nul,
                s,
                None,
                libc::MS_BIND | libc::MS_REMOUNT | nosuid_nodev,
                None,
            )?;
        }
        try_mount(
            "ro_root",
            nul,
            &p.root,
            None,
            libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | nosuid_nodev,
            None,
        )?;
    }

    pivot_onto(&p.root)
}

/// Makes `root` (a mount point) the root of the caller's mount namespace and of every process
/// whose root or cwd was the old root, then detaches the old root.
fn pivot_onto(root: &CStr) -> Result<(), StepError> {
    // pivot_root(".", ".") stacks the old root on top of the new one; detach it.
    // SAFETY: valid path.
    ck(unsafe { libc::chdir(root.as_ptr()) }, "chdir_root")?;
    ck(
        // SAFETY: valid NUL-terminated strings.
        unsafe { libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) as libc::c_int },
        "pivot_root",
    )?;
    ck(
        // SAFETY: valid path.
        unsafe { libc::umount2(c".".as_ptr(), libc::MNT_DETACH) },
        "umount_old_root",
    )?;
    // SAFETY: valid path.
    ck(unsafe { libc::chdir(c"/".as_ptr()) }, "chdir_new_root")?;
    Ok(())
}

fn fail_step(err: &OwnedFd, e: StepError) -> ! {
    let msg = format!("{}:{}", e.step, e.errno);
    // SAFETY: writing a valid buffer to an fd we own, then exiting without running destructors.
    unsafe {
        libc::write(err.as_raw_fd(), msg.as_ptr().cast(), msg.len());
        libc::_exit(127);
    }
}

fn child_main(p: &Prepared, spec: &ContainerSpec<'_>, sync: OwnedFd, err: OwnedFd) -> ! {
    if p.userns {
        // The id maps are written: become root of the new user namespace.
        // SAFETY: integer-argument syscalls.
        check(unsafe { libc::setresgid(0, 0, 0) }, &err, "setresgid");
        // SAFETY: as above.
        check(unsafe { libc::setresuid(0, 0, 0) }, &err, "setresuid");
        // Changing credentials clears the parent-death signal: arm it again, then make sure the
        // supervisor did not die in between (its end of the sync pipe would be closed).
        // SAFETY: prctl with integer arguments only.
        check(
            unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) },
            &err,
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
    drop(sync);
    // SAFETY: integer-argument syscall.
    check(
        unsafe { libc::unshare(libc::CLONE_NEWCGROUP) },
        &err,
        "cgroup_ns",
    );
    // A time namespace of its own (clone() cannot take CLONE_NEWTIME; the agent enters it at
    // exec, as a child would).
    // SAFETY: integer-argument syscall.
    check(
        unsafe { libc::unshare(libc::CLONE_NEWTIME) },
        &err,
        "time_ns",
    );
    mount(
        &err,
        "private",
        NONE,
        c"/",
        None,
        libc::MS_REC | libc::MS_PRIVATE,
        None,
    );
    let nosuid_nodev = libc::MS_NOSUID | libc::MS_NODEV;
    mount(
        &err,
        "tmpfs",
        c"tmpfs",
        &p.stage,
        Some(c"tmpfs"),
        nosuid_nodev,
        Some(&p.tmpfs_opts),
    );
    for d in [&p.upper, &p.work, &p.root] {
        check(mkdir(d, 0o755), &err, "mkdir_stage");
    }
    if p.placeholder {
        // No template yet (a pre-built shell): an empty root on the tmpfs, made a mount point
        // so that it can be pivoted to. The supervisor pivots the sandbox onto its template's
        // root when a request assigns it (see `reset_in_place`).
        mount(
            &err,
            "placeholder",
            &p.root,
            &p.root,
            None,
            libc::MS_BIND,
            None,
        );
    } else {
        mount(
            &err,
            "overlay",
            c"overlay",
            &p.root,
            Some(c"overlay"),
            nosuid_nodev,
            Some(&p.overlay_opts),
        );
    }

    // The agent's standard streams: the host's /dev/null, opened before the pivot. The
    // sandbox's own is a node of its tmpfs, which an agent holding it open for life would keep
    // alive after a reset or an activation had replaced that tmpfs.
    // SAFETY: valid path; the fd is ours and close-on-exec (the agent gets dup2'd copies).
    let opened =
        unsafe { libc::open(p.dev_nodes[0].host.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    check(opened, &err, "open_dev_null");
    // Above the descriptors the shuffle below writes (0 to 5).
    // SAFETY: fcntl and close on the fd just opened.
    let null = unsafe { libc::fcntl(opened, libc::F_DUPFD_CLOEXEC, 100) };
    check(null, &err, "dup_dev_null");
    // SAFETY: as above; `opened` is not used again.
    unsafe { libc::close(opened) };

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
    let err = unsafe { OwnedFd::from_raw_fd(5) };
    // Limits last among the fd work: a small RLIMIT_NOFILE must not break the shuffle above.
    for rl in &spec.rlimits {
        let lim = libc::rlimit {
            rlim_cur: rl.value,
            rlim_max: rl.value,
        };
        // SAFETY: valid rlimit struct.
        check(
            unsafe { libc::setrlimit(rl.resource as _, &lim) },
            &err,
            "setrlimit",
        );
    }

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

fn loopback_up(err: &OwnedFd) {
    // No allocation on this path (a raw OS error), so it is fine between clone and exec.
    if crate::guest::loopback_up().is_err() {
        fail(err, "lo_up");
    }
}

/// Clears every capability set of the calling process: locks securebits so that uid 0 gains
/// nothing on exec, empties the bounding and ambient sets, then zeroes effective, permitted and
/// inheritable sets.
fn drop_privileges(err: &OwnedFd) {
    let bits = libc::SECBIT_NOROOT
        | libc::SECBIT_NOROOT_LOCKED
        | libc::SECBIT_NO_SETUID_FIXUP
        | libc::SECBIT_NO_SETUID_FIXUP_LOCKED
        | libc::SECBIT_KEEP_CAPS_LOCKED
        | libc::SECBIT_NO_CAP_AMBIENT_RAISE
        | libc::SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED;
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
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let header = Header {
        version: 0x2008_0522,
        pid: 0,
    };
    let data = [
        Data {
            effective: 0,
            permitted: 0,
            inheritable: 0,
        },
        Data {
            effective: 0,
            permitted: 0,
            inheritable: 0,
        },
    ];
    // SAFETY: capset with a v3 header and two data structs, as the ABI requires.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &header, data.as_ptr()) as libc::c_int };
    check(rc, err, "capset");
}

/// Creates an executable memfd holding `bytes`, sealed against any modification, so that
/// `/proc/<pid>/exe` of a sandbox init can never be used to overwrite a host binary.
pub fn sealed_exe_memfd(name: &str, bytes: &[u8]) -> io::Result<OwnedFd> {
    let cname = CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: valid name; flags are constants.
    let fd =
        unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: memfd_create returned a fresh fd we exclusively own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut f = std::fs::File::from(fd);
    f.write_all(bytes)?;
    let fd = OwnedFd::from(f);
    let seals = libc::F_SEAL_SEAL | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE;
    // SAFETY: fcntl on an fd we own with integer arguments.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// Mounts a tmpfs (`nosuid,nodev,noexec`) on `target` in the caller's mount namespace.
pub fn mount_tmpfs(target: &std::path::Path, options: &str) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let t = CString::new(target.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let o = CString::new(options).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: valid NUL-terminated strings.
    let rc = unsafe {
        libc::mount(
            c"tmpfs".as_ptr(),
            t.as_ptr(),
            c"tmpfs".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            o.as_ptr().cast(),
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Moves the caller into a private mount namespace and binds the host root (without its
/// submounts) on `target`. A sandbox in a user namespace cannot use `/` itself as an overlay
/// layer (its submounts are locked there); this plain bind has no submounts, so it can.
pub fn private_root_bind(target: &std::path::Path) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let t = CString::new(target.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: integer-argument syscall; the caller is single-threaded or accepts that only the
    // calling thread moves.
    if unsafe { libc::unshare(libc::CLONE_NEWNS) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: valid NUL-terminated strings; null fstype/data are allowed for these flags.
    let rc = unsafe {
        libc::mount(
            NONE.as_ptr(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    let rc = unsafe {
        libc::mount(
            c"/".as_ptr(),
            t.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND,
            std::ptr::null(),
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
