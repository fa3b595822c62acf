//! The `microvm` and `vm` substrates: each sandbox is a QEMU virtual machine whose PID 1 is the
//! same `dsec-agent` that runs in containers, reached over a virtio-serial port.
//!
//! Creation is a restore, not a boot. Per (template, machine, memory, vCPUs) the node boots one
//! VM to agent-ready with its RAM in a file (`share=on`), then saves the device state with
//! `x-ignore-shared` (the RAM file *is* the memory snapshot; the device state is ~70 KB). Every
//! sandbox is a new QEMU that maps that file privately (`share=off`: copy-on-write, so clones
//! share every page they have not written and nothing is copied per clone), loads the device
//! state and continues; the node then gives the guest its identity (`Identify`: hostname,
//! clock, entropy, disk quota) and its environment (`Configure`).
//!
//! Snapshots are cached on disk under the VM cache directory, keyed by everything that shapes
//! them (kernel, initramfs, root image, QEMU version, machine, memory, vCPUs), so a restarted
//! node reuses them. Reset = restore the snapshot again into a new QEMU.

pub mod cache;
pub mod fork;
pub mod image;
pub mod qemu;
pub mod rootfs;
pub mod sandbox;

use std::collections::HashMap;
use std::fs;
use std::os::fd::AsFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dsec_api::ErrorCode;
use dsec_sys::ipc::PidFd;
use serde_json::json;

use crate::agent_client::{AgentConn, AgentError};
use cache::{touch, GcPolicy, GcReport};
use image::{ImageError, Kernel};
use qemu::{Accel, Machine, Qmp, VmArgs, AGENT_SOCK, QMP_SOCK};
use rootfs::{RootSource, ROOT_FORMAT, ROOT_SUFFIX};

/// Name of the agent's virtio-serial port (the agent looks for it by name).
pub const PORT_NAME: &str = "dsec.agent";
/// Environment variable overriding the VM cache directory.
pub const CACHE_ENV: &str = "DSEC_VM_CACHE";
/// Default VM cache directory (kernel, initramfs, root images, snapshots). Shared by every node
/// process of the host: everything in it is content-keyed and built atomically.
pub const DEFAULT_CACHE: &str = "/var/cache/dsec/vm";
/// Environment variable choosing the accelerator: `kvm`, `tcg` or `auto` (default).
pub const ACCEL_ENV: &str = "DSEC_VM_ACCEL";
/// How long a template boot may take to reach agent-ready (TCG on a busy 2-core machine).
const BOOT_TIMEOUT: Duration = Duration::from_secs(180);
/// How long a restore may take.
const RESTORE_TIMEOUT: Duration = Duration::from_secs(30);
/// Version of the snapshot recipe; bump to invalidate cached snapshots (3: every VM has a NIC).
const SNAPSHOT_FORMAT: &str = "3";
/// How long an unused cache entry (snapshot, initramfs, root image) is kept by a running node.
pub const CACHE_MAX_IDLE: Duration = Duration::from_secs(24 * 3600);

/// A step of preparing VM sandboxes that can take long (once per host, template and shape).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Fetching and unpacking Debian's guest kernel (once per host and kernel version).
    Kernel,
    /// Building the initramfs (the agent and the kernel modules it loads).
    Initramfs,
    /// Building the template's read-only root image (once per content).
    RootImage,
    /// Booting the template to agent-ready and saving its snapshot.
    TemplateBoot,
}

impl Phase {
    /// Name in logs and reports.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Kernel => "kernel",
            Phase::Initramfs => "initramfs",
            Phase::RootImage => "root image",
            Phase::TemplateBoot => "template boot",
        }
    }
}

/// What a preparation reports as it goes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Event {
    /// A phase started.
    Start(Phase),
    /// Fraction (0.0–1.0) of a long phase done.
    Progress(Phase, f64),
    /// A phase ended after this long.
    Done(Phase, Duration),
}

/// Receives the [`Event`]s of a preparation.
pub type Observer<'a> = &'a (dyn Fn(Event) + Sync);

/// An observer that ignores everything.
pub fn unobserved(_: Event) {}

/// Runs `f` as phase `p`, telling `observe`.
fn phase<T>(observe: Observer<'_>, p: Phase, f: impl FnOnce() -> T) -> T {
    observe(Event::Start(p));
    let t0 = Instant::now();
    let out = f();
    observe(Event::Done(p, t0.elapsed()));
    out
}

/// Everything that can go wrong with a VM.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// Preparing the kernel, initramfs, root image or QEMU failed.
    #[error(transparent)]
    Image(#[from] ImageError),
    /// An I/O step failed.
    #[error("{what}: {source}")]
    Io {
        /// The step.
        what: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// QMP answered with an error or the VM misbehaved.
    #[error("qemu: {0}")]
    Qmp(String),
    /// The agent in the guest failed.
    #[error("guest agent: {0}")]
    Agent(#[from] AgentError),
    /// The request cannot be served by a VM substrate.
    #[error("{0}")]
    Invalid(String),
}

impl VmError {
    pub(crate) fn io(what: &'static str) -> impl FnOnce(std::io::Error) -> VmError {
        move |source| VmError::Io { what, source }
    }

    /// The API error code.
    pub fn code(&self) -> ErrorCode {
        match self {
            VmError::Invalid(_) => ErrorCode::InvalidRequest,
            VmError::Agent(e) => e.code(),
            _ => ErrorCode::Internal,
        }
    }
}

/// Which VM substrate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum VmKind {
    /// `microvm`: QEMU `-M microvm`, one vCPU by default, minimal devices.
    Microvm,
    /// `vm`: QEMU q35 with PCI/ACPI, two vCPUs by default.
    Vm,
}

impl VmKind {
    fn machine(self) -> Machine {
        match self {
            VmKind::Microvm => Machine::Microvm,
            VmKind::Vm => Machine::Q35,
        }
    }

    /// Substrate name.
    pub fn name(self) -> &'static str {
        match self {
            VmKind::Microvm => "microvm",
            VmKind::Vm => "vm",
        }
    }
}

/// What a snapshot is made for.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SnapshotKey {
    /// Substrate.
    pub kind: VmKind,
    /// Template name.
    pub template: String,
    /// Guest RAM in MiB.
    pub memory_mib: u64,
    /// vCPUs.
    pub vcpus: u32,
    /// Size of the writable layer's disk in MiB (the disk quota).
    pub disk_mib: u64,
    /// Inodes of the writable layer's filesystem.
    pub disk_inodes: u64,
}

/// A template's VM snapshot on disk.
#[derive(Debug)]
pub struct Snapshot {
    key: SnapshotKey,
    dir: PathBuf,
    root_image: PathBuf,
    initrd: PathBuf,
    cmdline: String,
    /// Milliseconds the boot to agent-ready took (0 when loaded from the cache).
    pub boot_ms: u64,
    /// Milliseconds saving the snapshot took (0 when loaded from the cache).
    pub save_ms: u64,
    /// The snapshot's state file, root image and initramfs, held open while the snapshot is
    /// loaded: an open file marks its cache entry in use ([`cache::open_entries`]).
    _held: Vec<fs::File>,
    /// A snapshot of a running guest (`fork.rs`): the template snapshot it stands on, whose
    /// RAM file its clones map (the guest's own pages come with its state stream).
    base: Option<Arc<Snapshot>>,
}

impl Snapshot {
    fn ram(&self) -> PathBuf {
        match &self.base {
            Some(b) => b.ram(),
            None => self.dir.join("ram"),
        }
    }

    fn state(&self) -> PathBuf {
        self.dir.join("state")
    }

    /// The writable layer's disk as the template boot left it (clones write to a private,
    /// already-unlinked copy-on-write overlay of it).
    fn upper(&self) -> PathBuf {
        if self.base.is_some() {
            self.dir.join(fork::UPPER)
        } else {
            self.dir.join("upper.img")
        }
    }

    /// What it was made for.
    pub fn key(&self) -> &SnapshotKey {
        &self.key
    }
}

/// Where a template's root filesystem comes from (resolved by the container runtime).
#[derive(Debug, Clone)]
pub enum TemplateRoot {
    /// The host template: `lowerdir=` value and a key naming the host's current state.
    Host {
        /// overlayfs `lowerdir=` (mask first, then `/`).
        lowerdir: String,
        /// Cache key parts.
        key: String,
    },
    /// Stored layer directories, lowest first, and their digests.
    Layers {
        /// Layer directories, lowest first.
        dirs: Vec<PathBuf>,
        /// Cache key parts (the layer digests).
        key: String,
    },
}

/// The VM side of the node: kernel, initramfs, snapshots, QEMU processes.
#[derive(Debug)]
pub struct VmRuntime {
    qemu: PathBuf,
    qemu_version: String,
    cache: PathBuf,
    run_base: PathBuf,
    accel: Accel,
    kernel: Kernel,
    agent: PathBuf,
    snapshots: Mutex<HashMap<SnapshotKey, Arc<Snapshot>>>,
    build: Mutex<()>,
    max_bytes: Option<u64>,
}

/// Detects the accelerator: `DSEC_VM_ACCEL` when set; otherwise KVM only when `/dev/kvm`
/// opens and the CPU advertises hardware virtualisation (a PVM-backed `/dev/kvm`, as on the
/// development machines, cannot boot an ordinary guest kernel), else TCG.
/// Detected once per process (`/readyz` asks on every probe).
pub fn detect_accel() -> Accel {
    static ACCEL: std::sync::OnceLock<Accel> = std::sync::OnceLock::new();
    *ACCEL.get_or_init(probe_accel)
}

fn probe_accel() -> Accel {
    match std::env::var(ACCEL_ENV).as_deref() {
        Ok("kvm") => return Accel::Kvm,
        Ok("tcg") => return Accel::Tcg,
        _ => {}
    }
    let kvm = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_ok();
    let hw = fs::read_to_string("/proc/cpuinfo")
        .map(|c| {
            c.lines()
                .filter(|l| l.starts_with("flags"))
                .any(|l| l.split_whitespace().any(|f| f == "vmx" || f == "svm"))
        })
        .unwrap_or(false);
    if kvm && hw {
        Accel::Kvm
    } else {
        Accel::Tcg
    }
}

/// Kernel parameters that skip TSC and delay-loop calibration (1 boot in 5–8 hangs in TSC
/// calibration under TCG without them). The guest TSC ticks at the host's rate under both TCG
/// and KVM.
fn tsc_params() -> String {
    let khz = fs::read_to_string("/proc/cpuinfo").ok().and_then(|c| {
        c.lines()
            .find(|l| l.starts_with("cpu MHz"))
            .and_then(|l| l.split(':').nth(1))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .map(|mhz| (mhz * 1000.0) as u64)
    });
    match khz {
        // lpj = loops per jiffy = tsc_khz * 1000 / HZ (Debian: HZ=250).
        Some(khz) if khz > 0 => format!("tsc_early_khz={khz} lpj={}", khz * 4),
        _ => String::new(),
    }
}

impl VmRuntime {
    /// Prepares QEMU and the guest kernel (from Debian's packages, cached in `cache`), and the
    /// run directory for QEMU processes. `agent` is the static `dsec-agent` binary; the cache
    /// is kept under `max_bytes` when given ([`VmRuntime::gc`]).
    pub fn start(
        cache: PathBuf,
        run_base: PathBuf,
        agent: PathBuf,
        max_bytes: Option<u64>,
        observe: Observer<'_>,
    ) -> Result<Self, VmError> {
        fs::create_dir_all(&cache).map_err(VmError::io("create the VM cache"))?;
        fs::create_dir_all(&run_base).map_err(VmError::io("create the VM run dir"))?;
        let qemu = image::ensure_qemu()?;
        let out = Command::new(&qemu)
            .arg("--version")
            .output()
            .map_err(VmError::io("qemu --version"))?;
        let qemu_version = String::from_utf8_lossy(&out.stdout)
            .lines()
            .next()
            .unwrap_or_default()
            .to_string();
        let kernel = if image::kernel_cached(&cache) {
            image::prepare_kernel(&cache)?
        } else {
            phase(observe, Phase::Kernel, || image::prepare_kernel(&cache))?
        };
        let rt = Self {
            qemu,
            qemu_version,
            cache,
            run_base,
            accel: detect_accel(),
            kernel,
            agent,
            snapshots: Mutex::new(HashMap::new()),
            build: Mutex::new(()),
            max_bytes,
        };
        // At start only when no other node is building (the idle rule is not urgent).
        if let Some(lock) = CacheLock::try_take(&rt.cache)? {
            rt.gc_locked(&lock, Some(CACHE_MAX_IDLE));
        }
        Ok(rt)
    }

    /// The VM cache directory.
    pub fn cache_dir(&self) -> &Path {
        &self.cache
    }

    /// Removes the cache entries no process uses that are older than `max_idle`, and the least
    /// recently used ones past the size bound (see [`cache`]); waits for a build in progress.
    pub fn gc(&self, max_idle: Option<Duration>) -> Result<GcReport, VmError> {
        let lock = CacheLock::take(&self.cache)?;
        Ok(self.gc_locked(&lock, max_idle))
    }

    fn gc_locked(&self, _lock: &CacheLock, max_idle: Option<Duration>) -> GcReport {
        gc_cache(&self.cache, max_idle, self.max_bytes)
    }

    /// The accelerator in use.
    pub fn accel(&self) -> Accel {
        self.accel
    }

    /// The QEMU version line.
    pub fn qemu_version(&self) -> &str {
        &self.qemu_version
    }

    /// The guest kernel release.
    pub fn kernel_version(&self) -> &str {
        &self.kernel.version
    }

    /// Forgets the snapshots of `template` held in memory (it was imported again or deleted);
    /// the on-disk cache is keyed by content and needs nothing.
    pub fn forget_template(&self, template: &str) {
        lock(&self.snapshots).retain(|k, _| k.template != template);
    }

    /// The run directory of VM `id`.
    pub fn run_dir(&self, id: &str) -> PathBuf {
        self.run_base.join(id)
    }

    fn initrd(&self, kind: VmKind, observe: Observer<'_>) -> Result<PathBuf, VmError> {
        let agent_digest = file_digest(&self.agent)?;
        let modules = match kind {
            VmKind::Microvm => image::MICROVM_MODULES,
            VmKind::Vm => image::VM_MODULES,
        };
        let key = image::image_key(&[
            "initrd",
            &agent_digest,
            &self.kernel.version,
            &modules.join(","),
        ]);
        let out = self.cache.join("initrd").join(format!("{key}.cpio"));
        if out.exists() {
            touch(&out);
            return Ok(out);
        }
        fs::create_dir_all(out.parent().unwrap_or(&self.cache))
            .map_err(VmError::io("create the initrd dir"))?;
        let _lock = CacheLock::take(&self.cache)?;
        if !out.exists() {
            phase(observe, Phase::Initramfs, || {
                image::build_initramfs(&self.agent, &self.kernel, modules, &out)
            })?;
        }
        Ok(out)
    }

    /// The root image of `root`: found through the pointer its source key left, else by the
    /// content digest of a scan of its merged view, else built (see [`rootfs`]).
    fn root_image(&self, root: &TemplateRoot, observe: Observer<'_>) -> Result<PathBuf, VmError> {
        let (source_key, source) = match root {
            TemplateRoot::Host { lowerdir, key } => (
                image::image_key(&["host", key, ROOT_FORMAT]),
                RootSource::Overlay {
                    lowerdir: lowerdir.clone(),
                },
            ),
            TemplateRoot::Layers { dirs, key } => (
                image::image_key(&["layers", key, ROOT_FORMAT]),
                RootSource::Layers(dirs),
            ),
        };
        let dir = self.cache.join("rootfs");
        let pointer = dir.join(cache::POINTERS).join(&source_key);
        let pointed = |dir: &Path| {
            let name = fs::read_to_string(&pointer).ok()?;
            let image = dir.join(name.trim());
            (!name.trim().is_empty() && image.is_file()).then_some(image)
        };
        if let Some(image) = pointed(&dir) {
            touch(&image);
            return Ok(image);
        }
        fs::create_dir_all(dir.join(cache::POINTERS))
            .map_err(VmError::io("create the root image dir"))?;
        // One build at a time per host: another node process may be building the same image.
        let lock = CacheLock::take(&self.cache)?;
        if let Some(image) = pointed(&dir) {
            touch(&image);
            return Ok(image);
        }
        let scan = rootfs::scan_root(&source)?;
        let name = format!("{}{ROOT_SUFFIX}", scan.digest());
        let out = dir.join(&name);
        if out.is_file() {
            touch(&out);
        } else {
            self.gc_locked(&lock, Some(CACHE_MAX_IDLE));
            phase(observe, Phase::RootImage, || {
                rootfs::build_root_image(scan, &out, &mut |f| {
                    observe(Event::Progress(Phase::RootImage, f));
                })
            })?;
        }
        let tmp = pointer.with_extension("tmp");
        fs::write(&tmp, &name)
            .and_then(|()| fs::rename(&tmp, &pointer))
            .map_err(VmError::io("record the root image"))?;
        Ok(out)
    }

    /// Whether this process has the snapshot for `key` loaded.
    pub fn is_loaded(&self, key: &SnapshotKey) -> bool {
        lock(&self.snapshots).contains_key(key)
    }

    /// The snapshot for `key` if this process has it loaded already (the hot path of every
    /// create: no file system walk).
    pub fn loaded(&self, key: &SnapshotKey) -> Option<Arc<Snapshot>> {
        let s = Arc::clone(lock(&self.snapshots).get(key)?);
        // In use: keep it (and what it needs) out of reach of the cache GC.
        for p in [&s.dir, &s.root_image, &s.initrd] {
            touch(p);
        }
        Some(s)
    }

    /// The snapshot for `key`, booting and saving it first if there is none yet (seconds under
    /// TCG; once per key and host).
    pub fn snapshot(
        &self,
        key: &SnapshotKey,
        root: &TemplateRoot,
        observe: Observer<'_>,
    ) -> Result<Arc<Snapshot>, VmError> {
        if let Some(s) = self.loaded(key) {
            return Ok(s);
        }
        let _building = lock(&self.build);
        if let Some(s) = lock(&self.snapshots).get(key) {
            return Ok(Arc::clone(s));
        }
        let initrd = self.initrd(key.kind, observe)?;
        let root_image = self.root_image(root, observe)?;
        let mut cmdline = format!("console=ttyS0 quiet panic=-1 dsec_vm=1 {}", tsc_params());
        if key.kind == VmKind::Microvm {
            cmdline.push_str(" pci=off");
        }
        // The guest's page cache in the snapshot holds blocks of this very image file: a
        // rebuilt image at the same path (deleted by a cache clean-up, then made again) must
        // not meet an old snapshot. Its inode and birth time name the file, not the path.
        let image_id = fs::metadata(&root_image)
            .map(|m| {
                use std::os::unix::fs::MetadataExt;
                let born = m
                    .created()
                    .ok()
                    .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                    .map_or(0, |d| d.as_nanos());
                format!("{}:{}:{born}", m.dev(), m.ino())
            })
            .map_err(VmError::io("stat the root image"))?;
        let digest = image::image_key(&[
            SNAPSHOT_FORMAT,
            &image_id,
            &self.qemu_version,
            self.accel.name(),
            self.accel.cpu(),
            &self.kernel.kernel.display().to_string(),
            &initrd.display().to_string(),
            &root_image.display().to_string(),
            key.kind.name(),
            &key.memory_mib.to_string(),
            &key.vcpus.to_string(),
            &key.disk_mib.to_string(),
            &key.disk_inodes.to_string(),
            &cmdline,
        ]);
        let dir = self.cache.join("snap").join(&digest);
        let mut snap = Snapshot {
            key: key.clone(),
            dir: dir.clone(),
            root_image,
            initrd,
            cmdline,
            boot_ms: 0,
            save_ms: 0,
            _held: Vec::new(),
            base: None,
        };
        if dir.join("complete").exists() {
            touch(&dir);
        } else {
            let _lock = CacheLock::take(&self.cache)?;
            if !dir.join("complete").exists() {
                phase(observe, Phase::TemplateBoot, || {
                    self.make_snapshot(&mut snap)
                })?;
            }
        }
        for p in [snap.state(), snap.root_image.clone(), snap.initrd.clone()] {
            snap._held
                .push(fs::File::open(&p).map_err(VmError::io("open a snapshot file"))?);
        }
        let snap = Arc::new(snap);
        lock(&self.snapshots).insert(key.clone(), Arc::clone(&snap));
        Ok(snap)
    }

    fn args(&self, snap: &Snapshot, run_dir: &Path, boot: bool) -> VmArgs {
        VmArgs {
            machine: snap.key.kind.machine(),
            accel: self.accel,
            memory_mib: snap.key.memory_mib,
            vcpus: snap.key.vcpus,
            kernel: self.kernel.kernel.clone(),
            initrd: snap.initrd.clone(),
            cmdline: snap.cmdline.clone(),
            root_image: snap.root_image.clone(),
            ram_file: snap.ram(),
            ram_shared: boot,
            ram_anonymous: snap.base.is_some(),
            upper: snap.upper(),
            upper_qcow2: snap.base.is_some(),
            run_dir: run_dir.to_path_buf(),
            console_log: boot.then(|| run_dir.join("console.log")),
            incoming: !boot,
            // Clones only: a template boot runs nothing but the agent, and handing its block
            // devices over at the end of the save reopens files by path (not in a chroot).
            jail: (!boot).then(|| run_dir.join("jail")),
        }
    }

    fn spawn(&self, args: &VmArgs, log: &Path) -> Result<PidFd, VmError> {
        if let Some(dir) = &args.jail {
            fs::create_dir_all(dir).map_err(VmError::io("create the QEMU jail"))?;
        }
        let log = fs::File::create(log).map_err(VmError::io("create the qemu log"))?;
        let err = log.try_clone().map_err(VmError::io("clone the qemu log"))?;
        // A clone's writable disk is QEMU's own temporary overlay (`snapshot=on`), created and
        // unlinked at start in TMPDIR: on disk, next to the cache, gone with the process.
        let tmp = self.cache.join("tmp");
        fs::create_dir_all(&tmp).map_err(VmError::io("create the overlay dir"))?;
        let child = qemu::jailed_command(&self.qemu, args)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .env_clear()
            .env("TMPDIR", &tmp)
            .process_group(0)
            .spawn()
            .map_err(VmError::io("start qemu"))?;
        let pid = child.id() as i32;
        // The child is killed and reaped through its pidfd ([`kill`]) by whoever destroys it;
        // std's handle is not needed (dropping it neither kills nor waits).
        drop(child);
        PidFd::open(pid).map_err(VmError::io("pidfd of qemu"))
    }

    /// Boots the template VM with its RAM written through to the snapshot's RAM file, waits for
    /// the agent's hello, and saves the device state.
    fn make_snapshot(&self, snap: &mut Snapshot) -> Result<(), VmError> {
        let tmp = snap.dir.with_extension("tmp");
        let _ = fs::remove_dir_all(&tmp);
        fs::create_dir_all(&tmp).map_err(VmError::io("create the snapshot dir"))?;
        let mut args = self.args(snap, &tmp, true);
        args.ram_file = tmp.join("ram");
        args.upper = tmp.join("upper.img");
        image::build_upper_image(&args.upper, snap.key.disk_mib << 20, snap.key.disk_inodes)?;
        let t0 = Instant::now();
        let qemu = self.spawn(&args, &tmp.join("qemu.log"))?;
        let result = (|| -> Result<(), VmError> {
            let deadline = t0 + BOOT_TIMEOUT;
            let mut qmp = Qmp::connect(&tmp.join(QMP_SOCK), deadline)?;
            let sock = qemu::connect_retry(&tmp.join(AGENT_SOCK), deadline)?;
            let mut agent = AgentConn::new(sock.into());
            // The hello is the boot's end: the agent serves requests from here on.
            agent.ping_within(BOOT_TIMEOUT.saturating_sub(t0.elapsed()))?;
            if !agent.greeted() {
                return Err(VmError::Qmp("the guest agent sent no hello".into()));
            }
            snap.boot_ms = t0.elapsed().as_millis() as u64;
            let t1 = Instant::now();
            qmp.execute("stop", serde_json::Value::Null)?;
            qmp.ignore_shared()?;
            let state = fs::File::create(tmp.join("state"))
                .map_err(VmError::io("create the snapshot state"))?;
            qmp.pass_fd("snap", state.as_fd())?;
            drop(state);
            qmp.execute("migrate", json!({ "uri": "fd:snap" }))?;
            qmp.wait_migration(Instant::now() + Duration::from_secs(60))?;
            snap.save_ms = t1.elapsed().as_millis() as u64;
            let _ = qmp.execute("quit", serde_json::Value::Null);
            drop(agent);
            Ok(())
        })();
        kill(&qemu);
        if let Err(e) = result {
            let log = fs::read_to_string(tmp.join("console.log")).unwrap_or_default();
            let qlog = fs::read_to_string(tmp.join("qemu.log")).unwrap_or_default();
            let _ = fs::remove_dir_all(&tmp);
            return Err(VmError::Qmp(format!(
                "template boot failed: {e}; qemu: {}; console: {}",
                tail(&qlog, 800),
                tail(&log, 1500)
            )));
        }
        for f in [AGENT_SOCK, QMP_SOCK] {
            let _ = fs::remove_file(tmp.join(f));
        }
        let deps = format!("{}\n{}\n", snap.initrd.display(), snap.root_image.display());
        fs::write(tmp.join(cache::DEPS_FILE), deps)
            .map_err(VmError::io("record the snapshot's images"))?;
        fs::write(tmp.join("complete"), format!("{}\n", snap.boot_ms))
            .map_err(VmError::io("mark the snapshot complete"))?;
        let _ = fs::remove_dir_all(&snap.dir);
        fs::rename(&tmp, &snap.dir).map_err(VmError::io("publish the snapshot"))?;
        Ok(())
    }

    /// Starts a VM for sandbox `id` from `snap`; returns it with a connected agent that has
    /// not been given its identity yet.
    pub fn restore(
        &self,
        id: &str,
        snap: &Arc<Snapshot>,
        attach: impl FnOnce(i32) -> Result<(), VmError>,
    ) -> Result<(PidFd, AgentConn), VmError> {
        let run_dir = self.run_dir(id);
        let _ = fs::remove_dir_all(&run_dir);
        fs::create_dir_all(&run_dir).map_err(VmError::io("create the VM run dir"))?;
        let deadline = Instant::now() + RESTORE_TIMEOUT;
        let args = self.args(snap, &run_dir, false);
        let qemu = self.spawn(&args, &run_dir.join("qemu.log"))?;
        fs::write(run_dir.join("qemu.pid"), qemu.pid().to_string())
            .map_err(VmError::io("record the qemu pid"))?;
        let restored = (|| -> Result<AgentConn, VmError> {
            attach(qemu.pid())?;
            let mut qmp = Qmp::connect(&run_dir.join(QMP_SOCK), deadline)?;
            // Connect the agent's port before the device state loads: the guest then finds the
            // host end connected, as it was when the snapshot was taken, and its agent goes on
            // reading where it stopped.
            let sock = qemu::connect_retry(&run_dir.join(AGENT_SOCK), deadline)?;
            qmp.ignore_shared()?;
            let state = fs::File::open(snap.state()).map_err(VmError::io("open the snapshot"))?;
            qmp.pass_fd("snap", state.as_fd())?;
            drop(state);
            qmp.execute("migrate-incoming", json!({ "uri": "fd:snap" }))?;
            qmp.wait_migration(deadline)?;
            qmp.execute("cont", serde_json::Value::Null)?;
            Ok(AgentConn::adopted(sock.into()))
        })();
        match restored {
            Ok(agent) => Ok((qemu, agent)),
            Err(e) => {
                let qlog = fs::read_to_string(run_dir.join("qemu.log")).unwrap_or_default();
                kill(&qemu);
                let _ = fs::remove_dir_all(&run_dir);
                Err(match e {
                    VmError::Qmp(m) => VmError::Qmp(format!("{m}; qemu: {}", tail(&qlog, 800))),
                    other => other,
                })
            }
        }
    }
}

/// Gives a restored guest its identity: hostname, the host's clock, 64 fresh random bytes for
/// its entropy pool, its disk quota.
pub fn identify(
    agent: &mut AgentConn,
    hostname: &str,
    spec: &crate::sandbox::SandboxSpec,
    scratch: &[&str],
) -> Result<(), VmError> {
    let mut seed = [0u8; 64];
    getrandom::fill(&mut seed).map_err(|e| VmError::Qmp(format!("getrandom: {e}")))?;
    let unix_ns = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    agent.call_ok(
        &dsec_api::agent::Request::Identify {
            hostname: hostname.chars().take(64).collect(),
            unix_ns,
            disk_bytes: spec.limits.disk_bytes,
            disk_inodes: spec.limits.disk_inodes,
            read_only_root: !spec.writable_root,
            scratch: scratch.iter().map(|s| (*s).to_owned()).collect(),
        },
        &seed,
    )?;
    Ok(())
}

/// Kills a QEMU process, waits for it and reaps it (a QEMU this process started is its child:
/// unreaped, it would stay a zombie until the node exits).
pub fn kill(qemu: &PidFd) {
    qemu.kill_and_reap(Duration::from_secs(5));
}

/// An exclusive `flock` on `<cache>/lock`, held while building shared cache entries.
struct CacheLock {
    _file: fs::File,
}

impl CacheLock {
    /// The lock if no one else holds it.
    fn try_take(cache: &Path) -> Result<Option<Self>, VmError> {
        let f = Self::open(cache)?;
        match rustix::fs::flock(&f, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => Ok(Some(Self { _file: f })),
            Err(rustix::io::Errno::WOULDBLOCK) => Ok(None),
            Err(e) => Err(VmError::io("lock the VM cache")(e.into())),
        }
    }

    fn open(cache: &Path) -> Result<fs::File, VmError> {
        fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(cache.join("lock"))
            .map_err(VmError::io("open the VM cache lock"))
    }

    fn take(cache: &Path) -> Result<Self, VmError> {
        let f = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(cache.join("lock"))
            .map_err(VmError::io("open the VM cache lock"))?;
        rustix::fs::flock(&f, rustix::fs::FlockOperation::LockExclusive)
            .map_err(|e| VmError::io("lock the VM cache")(e.into()))?;
        Ok(Self { _file: f })
    }
}

/// Garbage-collects the VM cache at `cache` ([`cache::gc`]) for entries unused for `max_idle`
/// and past `max_bytes`; the caller holds the cache lock.
fn gc_cache(cache: &Path, max_idle: Option<Duration>, max_bytes: Option<u64>) -> GcReport {
    let in_use = cache::open_entries(cache);
    cache::gc(
        cache,
        &GcPolicy {
            max_idle,
            max_bytes,
        },
        &in_use,
    )
}

/// `dsec vm gc`: removes every entry of the VM cache at `cache` that no process uses — or, given
/// `max_bytes`, only the least recently used of them until the cache fits — and entries of
/// earlier formats (waits for a build in progress).
pub fn gc_unused(cache: &Path, max_bytes: Option<u64>) -> Result<GcReport, VmError> {
    if !cache.is_dir() {
        return Ok(GcReport::default());
    }
    let _lock = CacheLock::take(cache)?;
    let max_idle = if max_bytes.is_some() {
        None
    } else {
        Some(Duration::ZERO)
    };
    Ok(gc_cache(cache, max_idle, max_bytes))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn tail(s: &str, n: usize) -> &str {
    let mut start = s.len().saturating_sub(n);
    while !s.is_char_boundary(start) {
        start += 1;
    }
    s[start..].trim()
}

fn file_digest(p: &Path) -> Result<String, VmError> {
    use sha2::{Digest, Sha256};
    let data = fs::read(p).map_err(VmError::io("read the agent binary"))?;
    Ok(hex::encode(Sha256::digest(&data)))
}

/// The path in the environment variable `var` that a hand-run (`#[ignore]`d) test of real
/// resources needs; the test fails without it rather than pass having done nothing.
#[cfg(test)]
pub(crate) fn dev_path(var: &str) -> std::path::PathBuf {
    let path = std::env::var_os(var).unwrap_or_else(|| panic!("set {var} to run this test"));
    std::path::PathBuf::from(path)
}
