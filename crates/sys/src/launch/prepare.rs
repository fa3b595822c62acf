//! Everything a sandbox init needs, converted to C strings and pointer arrays before the clone so
//! that the child does little more than system calls.

use std::ffi::CString;

use super::{ContainerSpec, LaunchError, RootfsSpec, DEV_NODES, MASKED_PROC, READONLY_PROC};

pub(super) struct Prepared {
    pub(super) stage: CString,
    pub(super) tmpfs_opts: CString,
    pub(super) upper: CString,
    pub(super) work: CString,
    /// Where the overlay is mounted: the new root.
    pub(super) root: CString,
    pub(super) overlay_opts: CString,
    pub(super) dev: CString,
    pub(super) dev_src: CString,
    pub(super) dev_src_dirs: [CString; 3],
    pub(super) proc_: CString,
    pub(super) masked: Vec<CString>,
    pub(super) readonly: Vec<CString>,
    pub(super) empty_dir: Option<CString>,
    pub(super) dev_nodes: Vec<DevNode>,
    pub(super) pts: CString,
    /// `<root>/dev/mqueue`: the sandbox's IPC namespace's POSIX message queues, as files.
    pub(super) mqueue: CString,
    pub(super) shm: CString,
    pub(super) shm_src: CString,
    pub(super) dev_links: Vec<(CString, CString)>,
    pub(super) scratch: Vec<CString>,
    pub(super) hostname: CString,
    pub(super) _argv: Vec<CString>,
    pub(super) _envp: Vec<CString>,
    pub(super) argv_ptrs: Vec<*const libc::c_char>,
    pub(super) envp_ptrs: Vec<*const libc::c_char>,
    pub(super) userns: bool,
    pub(super) writable_root: bool,
    pub(super) placeholder: bool,
}

/// One device node of the sandbox's `/dev`.
pub(super) struct DevNode {
    /// Where it is created: `<stage>/dev/<name>`, on the sandbox's tmpfs.
    pub(super) src: CString,
    /// Where the sandbox sees it: `<root>/dev/<name>`.
    pub(super) dst: CString,
    /// The host's node (`/dev/<name>`), bound over `dst` in a user namespace.
    pub(super) host: CString,
    pub(super) major: u32,
    pub(super) minor: u32,
}

pub(super) fn cstr(s: impl Into<Vec<u8>>, what: &'static str) -> Result<CString, LaunchError> {
    CString::new(s).map_err(|_| LaunchError::InvalidArgument { what })
}

pub(super) fn prepare(spec: &ContainerSpec<'_>) -> Result<Prepared, LaunchError> {
    prepare_parts(
        &spec.rootfs,
        &spec.ns.hostname,
        &spec.argv,
        &spec.env,
        spec.ns.user.is_some(),
    )
}

pub(super) fn prepare_parts(
    r: &RootfsSpec,
    hostname: &str,
    argv: &[String],
    env: &[(String, String)],
    userns: bool,
) -> Result<Prepared, LaunchError> {
    // In a user namespace the init starts on a placeholder root: only its supervisor, outside
    // the namespace, can mount the template's layers for it (idmapped, see `build_root_tree`).
    if userns && !r.lowerdirs.is_empty() {
        return Err(LaunchError::InvalidArgument {
            what: "lowerdirs in a user namespace",
        });
    }
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
    let dev_nodes = DEV_NODES
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
    Ok(Prepared {
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
                "lowerdir={},upperdir={stage}/upper,workdir={stage}/work",
                r.lowerdirs.join(":"),
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
