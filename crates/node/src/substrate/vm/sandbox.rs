//! VM sandboxes (`microvm`, `vm`) behind the same [`Sandbox`] type as containers: the node's
//! lifecycle, pools, API and trajectory log do not know which substrate they hold.
//!
//! A VM sandbox has no supervisor: its QEMU process plays that role (`Sandbox::sup` is QEMU's
//! pidfd) and sits in the sandbox's cgroup (memory = guest RAM + QEMU's own overhead, CPU
//! weight and optional cap, pids). Its run directory is `<run_dir>/sandboxes/<id>` like a
//! container's, so a node that restarts finds it there and re-attaches ([`adopt_vm`]): QEMU
//! listens for the agent connection again, the guest's agent keeps its processes and greets
//! the new connection, and the node skips whatever a cut frame left in the stream.
//!
//! [`adopt_vm`]: Runtime::adopt_vm

use std::sync::Arc;
use std::time::{Duration, Instant};

use dsec_sys::cgroup::{Cgroup, CgroupLimits};
use dsec_sys::ipc::PidFd;

use super::{self as vm, Snapshot, SnapshotKey, TemplateRoot, VmError, VmKind, VmRuntime};
use crate::agent_client::AgentConn;
use crate::egress::VmPath;
use crate::sandbox::{SandboxSpec, State, Substrate};
use crate::substrate::container::create::SCRATCH_DIRS;
use crate::substrate::{Backend, Phases, Runtime, RuntimeError, Sandbox};
use crate::template::unpack::{is_opaque, is_whiteout};

/// Memory the QEMU process may use beyond guest RAM (its heap, the TCG translation cache).
const QEMU_OVERHEAD: u64 = 256 << 20;
/// Threads a QEMU process may have (vCPUs, I/O, RCU, migration).
const QEMU_PIDS: u64 = 256;

/// Paths whose modification times name the host template's VM root image: package installs
/// and removals touch them. Changes deeper down (a file edited in place) keep the old image
/// until the VM cache is cleared.
/// (`/etc` itself is left out: its modification time moves whenever any tool replaces a file
/// there by rename.)
const HOST_FINGERPRINT: &[&str] = &["/var/lib/dpkg/status", "/opt"];

/// Directories named by what they hold instead ([`listing_fingerprint`]): tools rewrite their
/// files there by rename with the same content (a session's helper scripts, `ln -sf` of the
/// same link), which moves the directory's modification time and, named by it, made a new
/// multi-GB image each time.
const HOST_LISTED: &[&str] = &["/usr/local/bin", "/usr/local/lib"];

/// Names what `dir` holds: each entry's name, kind, size (a regular file) or target (a link),
/// sorted; not modification times.
fn listing_fingerprint(dir: &std::path::Path) -> String {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return String::new();
    };
    let mut lines: Vec<String> = rd
        .flatten()
        .filter_map(|e| {
            let m = std::fs::symlink_metadata(e.path()).ok()?;
            let what = if m.file_type().is_symlink() {
                format!("l {}", std::fs::read_link(e.path()).ok()?.display())
            } else if m.is_dir() {
                "d".to_owned()
            } else {
                format!("f {}", m.len())
            };
            Some(format!("{} {what}", e.file_name().to_string_lossy()))
        })
        .collect();
    lines.sort();
    crate::substrate::vm::image::image_key(&lines.iter().map(String::as_str).collect::<Vec<_>>())
}

/// Told of every VM preparation step with the template it is for.
pub type VmObserver = Arc<dyn Fn(&str, vm::Event) + Send + Sync>;

/// How the VM substrates of a node are run: the cache's size bound and who hears about
/// preparations (the server logs them).
#[derive(Default, Clone)]
pub struct VmSettings {
    /// Bound on the VM cache's size on disk (least recently used entries go first).
    pub cache_max_bytes: Option<u64>,
    /// Told of every preparation step (kernel, initramfs, root image, template boot) with the
    /// template it is for.
    pub observer: Option<VmObserver>,
}

impl std::fmt::Debug for VmSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmSettings")
            .field("cache_max_bytes", &self.cache_max_bytes)
            .field("observer", &self.observer.is_some())
            .finish()
    }
}

/// What a VM sandbox needs to be restored again (reset).
#[derive(Debug)]
pub(crate) struct VmBinding {
    rt: Arc<VmRuntime>,
    snap: Arc<Snapshot>,
    cgroup: Cgroup,
    env: Vec<(String, String)>,
    /// The template's user and working directory: the defaults of the guest's commands.
    defaults: GuestDefaults,
    /// Its path out (network egress), plugged into every QEMU of it.
    net: Option<VmPath>,
}

/// A template's user and working directory, as a guest's `Configure` carries them.
#[derive(Debug, Clone, Default)]
pub(crate) struct GuestDefaults {
    user: Option<String>,
    workdir: Option<String>,
}

fn vm_err(id: &str) -> impl FnOnce(VmError) -> RuntimeError + '_ {
    move |source| RuntimeError::Vm {
        id: id.to_owned(),
        source,
    }
}

/// Names the content of a host mask layer as the VM image sees it: every entry below the top
/// level (opaque directories, whiteouts) and the top-level directories, but not the top-level
/// whiteouts — those hide host directories the image never contains anyway, and they come and
/// go with unrelated directories at the host's `/` (a CI checkout), which must not force a
/// rebuild of a multi-GB image.
fn mask_fingerprint(mask: &std::path::Path) -> String {
    use std::os::unix::fs::MetadataExt;
    fn walk(dir: &std::path::Path, rel: &str, depth: usize, out: &mut Vec<String>) {
        let Ok(rd) = std::fs::read_dir(dir) else {
            return;
        };
        let mut entries: Vec<_> = rd.flatten().collect();
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let Ok(m) = e.metadata() else { continue };
            let name = format!("{rel}/{}", e.file_name().to_string_lossy());
            if depth == 0 && is_whiteout(&m) {
                continue;
            }
            let opaque = m.is_dir() && is_opaque(&e.path());
            out.push(format!("{name} {:o} {}", m.mode(), u8::from(opaque)));
            if m.is_dir() {
                walk(&e.path(), &name, depth + 1, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(mask, "", 0, &mut out);
    crate::substrate::vm::image::image_key(&out.iter().map(String::as_str).collect::<Vec<_>>())
}

impl Runtime {
    /// Sets how the VM substrates are run; takes effect when they start (first use).
    pub fn set_vm_settings(&self, settings: VmSettings) {
        *self.vm_settings.lock().unwrap_or_else(|p| p.into_inner()) = settings;
    }

    fn vm_settings(&self) -> VmSettings {
        self.vm_settings
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The VM cache directory (`DSEC_VM_CACHE`, or the default).
    pub fn vm_cache_dir() -> std::path::PathBuf {
        std::env::var_os(vm::CACHE_ENV)
            .map_or_else(|| vm::DEFAULT_CACHE.into(), std::path::PathBuf::from)
    }

    /// The VM substrates, started (QEMU installed, guest kernel prepared — from Debian's
    /// packages, cached) on first use.
    pub fn vms(&self) -> Result<Arc<VmRuntime>, RuntimeError> {
        let settings = self.vm_settings();
        let observe = |e: vm::Event| {
            if let Some(o) = &settings.observer {
                o("-", e);
            }
        };
        self.vms_observed(&observe)
    }

    fn vms_observed(&self, observe: vm::Observer<'_>) -> Result<Arc<VmRuntime>, RuntimeError> {
        let mut g = self.vms.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(v) = g.as_ref() {
            return Ok(Arc::clone(v));
        }
        let rt = VmRuntime::start(
            Self::vm_cache_dir(),
            self.cfg.run_dir.join("sandboxes"),
            self.cfg.agent_bin.clone(),
            self.vm_settings().cache_max_bytes,
            observe,
        )
        .map_err(vm_err("-"))?;
        let rt = Arc::new(rt);
        *g = Some(Arc::clone(&rt));
        Ok(rt)
    }

    /// Whether the VM substrates were started in this process.
    pub fn vms_started(&self) -> Option<Arc<VmRuntime>> {
        self.vms
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(Arc::clone)
    }

    /// Where a template's root filesystem comes from, for its VM root image (walks the host
    /// mask: called only when no snapshot of the template is loaded yet).
    fn template_root(&self, template: &str) -> Result<TemplateRoot, RuntimeError> {
        if template == "host" {
            // The image must follow the host: name it by the mask (what is hidden: its id is
            // the digest of its description, the same for every node whose own directories are
            // already hidden) and by when the installed software last changed.
            let mtime = |p: &str| {
                std::fs::metadata(p)
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                    .map_or(0, |d| d.as_secs())
            };
            let changed: Vec<String> = HOST_FINGERPRINT
                .iter()
                .map(|p| format!("{p}={}", mtime(p)))
                .chain(
                    HOST_LISTED
                        .iter()
                        .map(|p| format!("{p}#{}", listing_fingerprint(std::path::Path::new(p)))),
                )
                .collect();
            let mask_id = mask_fingerprint(&self.host_mask_src);
            let mask = self.host_mask_src.display().to_string();
            return Ok(TemplateRoot::Host {
                lowerdir: format!("{mask}:/"),
                key: format!("{mask_id}\0{}", changed.join("\0")),
            });
        }
        let t = self
            .templates
            .get(template)
            .map_err(RuntimeError::Template)?;
        let mut dirs = self.templates.lowerdirs(&t);
        dirs.reverse();
        let key = dirs
            .iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join("\0");
        Ok(TemplateRoot::Layers { dirs, key })
    }

    /// The base environment of VM sandbox `id` (defaults, the template's, the request's) and
    /// the template's user.
    #[allow(clippy::type_complexity)]
    fn vm_env(
        &self,
        id: &str,
        spec: &SandboxSpec,
    ) -> Result<(Vec<(String, String)>, GuestDefaults), RuntimeError> {
        let (template_env, defaults) = if spec.template == "host" {
            (Vec::new(), GuestDefaults::default())
        } else {
            let t = self
                .templates
                .get(&spec.template)
                .map_err(RuntimeError::Template)?;
            let workdir = (t.workdir != "/" && !t.workdir.is_empty()).then_some(t.workdir);
            (
                t.env,
                GuestDefaults {
                    user: t.user,
                    workdir,
                },
            )
        };
        Ok((self.sandbox_env(id, template_env, spec), defaults))
    }

    /// The snapshot VM sandboxes of `spec` are restored from (made first if needed: a boot of
    /// a few seconds under TCG, once per template, substrate, memory size and vCPU count).
    pub fn vm_snapshot(
        &self,
        spec: &SandboxSpec,
    ) -> Result<(Arc<VmRuntime>, Arc<Snapshot>), RuntimeError> {
        let settings = self.vm_settings();
        let observe = |e: vm::Event| {
            if let Some(o) = &settings.observer {
                o(&spec.template, e);
            }
        };
        self.vm_snapshot_observed(spec, &observe)
    }

    /// Whether a VM sandbox of `spec` is a restore of a snapshot this node has loaded (no
    /// preparation: kernel, images and template boot are done).
    pub fn vm_snapshot_loaded(&self, spec: &SandboxSpec) -> bool {
        let Some(rt) = self.vms_started() else {
            return false;
        };
        self.snapshot_key(spec).is_ok_and(|key| rt.is_loaded(&key))
    }

    /// [`Self::vm_snapshot`], telling `observe` of each preparation step as it happens.
    pub fn vm_snapshot_observed(
        &self,
        spec: &SandboxSpec,
        observe: vm::Observer<'_>,
    ) -> Result<(Arc<VmRuntime>, Arc<Snapshot>), RuntimeError> {
        let rt = self.vms_observed(observe)?;
        let key = self.snapshot_key(spec)?;
        let snap = match rt.loaded(&key) {
            Some(snap) => snap,
            None => {
                let root = self.template_root(&spec.template)?;
                rt.snapshot(&key, &root, observe).map_err(vm_err("-"))?
            }
        };
        Ok((rt, snap))
    }

    fn snapshot_key(&self, spec: &SandboxSpec) -> Result<SnapshotKey, RuntimeError> {
        let kind = match spec.substrate {
            Substrate::Microvm => VmKind::Microvm,
            Substrate::Vm => VmKind::Vm,
            Substrate::Container | Substrate::Function => {
                return Err(RuntimeError::Invalid("not a VM substrate".into()));
            }
        };
        let host_cpus = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
        let default_cpus = if kind == VmKind::Vm { 2 } else { 1 };
        let vcpus = spec
            .limits
            .cpu_max
            .map_or(default_cpus, |c| c.ceil() as u32)
            .clamp(1, host_cpus.max(1));
        Ok(SnapshotKey {
            kind,
            template: spec.template.clone(),
            memory_mib: (spec.limits.memory_max >> 20).clamp(128, 64 << 10),
            vcpus,
            disk_mib: spec.limits.disk_bytes.div_ceil(1 << 20).clamp(16, 1 << 20),
            disk_inodes: spec.limits.disk_inodes.clamp(1024, 1 << 26),
        })
    }

    /// Creates a VM sandbox by restoring its template's snapshot.
    pub(crate) fn create_vm(
        &self,
        id: &str,
        spec: &SandboxSpec,
    ) -> Result<(Sandbox, Phases), RuntimeError> {
        let t0 = Instant::now();
        let (rt, snap) = self.vm_snapshot(spec)?;
        // Made from a running guest's snapshot: its top layer holds the guest.
        let snap = match spec.layers.first() {
            Some(dir) => Arc::new(
                Snapshot::derived(&snap, std::path::PathBuf::from(dir)).map_err(vm_err(id))?,
            ),
            None => snap,
        };
        let (env, defaults) = self.vm_env(id, spec)?;
        let limits = CgroupLimits {
            cpu_weight: Some(spec.limits.cpu_weight),
            cpu_max: spec
                .limits
                .cpu_max
                .map(|c| ((c * 100_000.0) as u64, 100_000)),
            memory_high: None,
            memory_max: Some((snap.key().memory_mib << 20) + QEMU_OVERHEAD),
            pids_max: Some(QEMU_PIDS),
        };
        if let Some(old) = self.cgroups.open(id) {
            let _ = old.kill_all();
            let _ = old.remove();
        }
        let cgroup = self
            .cgroups
            .create(id, &limits)
            .map_err(RuntimeError::Cgroup)?;
        let t_cg = t0.elapsed().as_micros() as u64;
        let started = start_vm(&rt, id, &snap, &cgroup, spec, (&env, &defaults), None);
        let (sup, agent) = match started {
            Ok(v) => v,
            Err(e) => {
                let _ = cgroup.kill_all();
                let _ = cgroup.remove();
                let _ = std::fs::remove_dir_all(rt.run_dir(id));
                return Err(e);
            }
        };
        let launch_us = t0.elapsed().as_micros() as u64;
        let binding = VmBinding {
            rt,
            snap,
            cgroup,
            env,
            defaults,
            net: None,
        };
        let sandbox = binding.sandbox(id, spec.clone(), State::Ready, sup, agent);
        Ok((
            sandbox,
            Phases {
                launch_us,
                hello_us: t0.elapsed().as_micros() as u64,
                cgroup_us: t_cg,
                clone_exec_us: launch_us - t_cg,
            },
        ))
    }
}

impl Runtime {
    /// Re-attaches to a VM sandbox an earlier node process created: its QEMU (found by the pid
    /// recorded in the run directory, checked against its command line) listens for the agent
    /// connection again, and the guest's agent greets the new connection; its processes,
    /// sessions and files are as they were.
    pub(crate) fn adopt_vm(
        &self,
        id: &str,
        spec: SandboxSpec,
        state: State,
    ) -> Result<Sandbox, RuntimeError> {
        let (rt, snap) = self.vm_snapshot(&spec)?;
        let run_dir = rt.run_dir(id);
        let err = |m: String| RuntimeError::Supervisor {
            id: id.to_owned(),
            message: m,
        };
        let pid = std::fs::read_to_string(run_dir.join("qemu.pid"))
            .ok()
            .and_then(|s| s.trim().parse::<i32>().ok())
            .ok_or_else(|| err("no QEMU pid recorded".into()))?;
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if !String::from_utf8_lossy(&cmdline).contains(&*run_dir.to_string_lossy()) {
            return Err(err(format!("process {pid} is not this sandbox's QEMU")));
        }
        let sup = PidFd::open(pid).map_err(|e| err(format!("pidfd of QEMU: {e}")))?;
        let cgroup = self
            .cgroups
            .open(id)
            .ok_or_else(|| err("the sandbox's cgroup is gone".into()))?;
        let sock = std::os::unix::net::UnixStream::connect(run_dir.join(vm::qemu::AGENT_SOCK))
            .map_err(|e| err(format!("connect to the agent port: {e}")))?;
        let agent =
            AgentConn::reattach(sock.into(), Duration::from_secs(10)).map_err(|source| {
                RuntimeError::Agent {
                    id: id.to_owned(),
                    source,
                }
            })?;
        let (env, defaults) = self.vm_env(id, &spec)?;
        let binding = VmBinding {
            rt,
            snap,
            cgroup,
            env,
            defaults,
            net: None,
        };
        Ok(binding.sandbox(id, spec, state, sup, agent))
    }
}

impl VmBinding {
    /// The [`Sandbox`] of VM `id`, in `state` (`Running` counts as acquired now).
    fn sandbox(
        self,
        id: &str,
        spec: SandboxSpec,
        state: State,
        sup: PidFd,
        agent: AgentConn,
    ) -> Sandbox {
        Sandbox {
            id: id.to_owned(),
            spec,
            state,
            agent,
            init_pid: sup.pid(),
            sup,
            run_dir: self.rt.run_dir(id),
            backend: Backend::Vm(Box::new(self)),
            oom_kills: 0,
        }
    }
}

/// Plugs a fresh tap of `net` into the running QEMU of VM `id` and has the guest configure its
/// side (left unconfigured when the policy lets nothing out).
fn plug_net(rt: &VmRuntime, id: &str, agent: &mut AgentConn, net: &VmPath) -> Result<(), VmError> {
    let tap = crate::egress::open_tap(net).map_err(VmError::io("make the tap"))?;
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut qmp = vm::qemu::Qmp::connect(&rt.run_dir(id).join(vm::qemu::QMP_SOCK), deadline)?;
    qmp.plug_tap(std::os::fd::AsFd::as_fd(&tap))?;
    drop(qmp);
    if net.open {
        guest_net(agent, net)?;
    }
    Ok(())
}

/// Has the guest bring `eth0` up on `net` (open) or take it down.
fn guest_net(agent: &mut AgentConn, net: &VmPath) -> Result<(), VmError> {
    let req = if net.open {
        dsec_api::agent::Request::GuestNet {
            addr: net.addr,
            gateway: net.gateway,
        }
    } else {
        dsec_api::agent::Request::GuestNetOff
    };
    agent.call_ok(&req, &[])?;
    Ok(())
}

/// Restores the snapshot into a new QEMU in `cgroup`, then identifies and configures the guest
/// (and plugs its path out in, if it has one).
fn start_vm(
    rt: &VmRuntime,
    id: &str,
    snap: &Arc<Snapshot>,
    cgroup: &Cgroup,
    spec: &SandboxSpec,
    (env, defaults): (&[(String, String)], &GuestDefaults),
    net: Option<&VmPath>,
) -> Result<(PidFd, AgentConn), RuntimeError> {
    let (qemu, mut agent) = rt
        .restore(id, snap, |pid| {
            cgroup
                .attach(pid)
                .map_err(|e| VmError::Qmp(format!("attach QEMU to its cgroup: {e}")))
        })
        .map_err(vm_err(id))?;
    let ready = (|| -> Result<(), VmError> {
        // A running guest's snapshot already made its root read-only in its memory.
        let fresh;
        let spec_now = if snap.base.is_some() {
            fresh = SandboxSpec {
                writable_root: true,
                ..spec.clone()
            };
            &fresh
        } else {
            spec
        };
        vm::identify(&mut agent, id, spec_now, SCRATCH_DIRS)?;
        agent.call_ok(
            &dsec_api::agent::Request::Configure {
                workdir: defaults.workdir.clone(),
                env: env.to_vec(),
                nofile: Some(spec.limits.open_files_max),
                fsize: Some(spec.limits.file_size_max),
                nproc: None,
                user: defaults.user.clone(),
            },
            &[],
        )?;
        if let Some(net) = net {
            plug_net(rt, id, &mut agent, net)?;
        }
        Ok(())
    })();
    if let Err(e) = ready {
        vm::kill(&qemu);
        return Err(vm_err(id)(e));
    }
    Ok((qemu, agent))
}

impl Sandbox {
    /// A restored QEMU starts with an empty translation cache (TCG): its first command costs
    /// ~100 ms more than the next, so a pooled VM runs `/bin/true` once, off the acquire path
    /// (it leaves nothing behind).
    pub(crate) fn warm_up_vm(&mut self, rt: &Runtime) {
        let _ = self.exec(
            rt,
            &dsec_api::exec::ExecRequest::argv(["/bin/true"]),
            &[],
            |_, _| {},
        );
    }

    /// Reset of a VM: a fresh QEMU restored from the snapshot again replaces the old one (in
    /// the same cgroup); nothing of the old guest survives.
    /// Saves the running guest into `dest` (a snapshot layer's directory): the bytes written.
    pub(crate) fn vm_save(&self, dest: &std::path::Path) -> Result<u64, RuntimeError> {
        let Backend::Vm(b) = &self.backend else {
            return Err(RuntimeError::Invalid("not a VM sandbox".into()));
        };
        b.rt.save_running(&self.id, self.sup.pid(), dest)
            .map_err(vm_err(&self.id))
    }

    /// Stops (QMP `stop`) or continues (`cont`) the whole guest: its vCPUs halt where they
    /// are, its memory and disk kept by QEMU (a pause).
    pub(crate) fn pause_vm(&self, paused: bool) -> Result<(), RuntimeError> {
        let Backend::Vm(b) = &self.backend else {
            return Err(RuntimeError::Invalid("not a VM sandbox".into()));
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut qmp =
            vm::qemu::Qmp::connect(&b.rt.run_dir(&self.id).join(vm::qemu::QMP_SOCK), deadline)
                .map_err(vm_err(&self.id))?;
        qmp.execute(
            if paused { "stop" } else { "cont" },
            serde_json::Value::Null,
        )
        .map_err(vm_err(&self.id))?;
        Ok(())
    }

    /// Replaces the guest with one restored from the running guest's snapshot in `dir` (a
    /// rollback); later resets come back to it.
    pub(crate) fn restore_vm(&mut self, dir: &str) -> Result<(), RuntimeError> {
        let Backend::Vm(b) = &mut self.backend else {
            return Err(RuntimeError::Invalid("not a VM sandbox".into()));
        };
        let snap = Arc::new(
            Snapshot::derived(&b.snap, std::path::PathBuf::from(dir)).map_err(vm_err(&self.id))?,
        );
        vm::kill(&self.sup);
        let (sup, agent) = start_vm(
            &b.rt,
            &self.id,
            &snap,
            &b.cgroup,
            &self.spec,
            (&b.env, &b.defaults),
            b.net.as_ref(),
        )?;
        b.snap = snap;
        self.init_pid = sup.pid();
        self.sup = sup;
        self.agent = agent;
        Ok(())
    }

    pub(crate) fn reset_vm(&mut self) -> Result<(), RuntimeError> {
        let Backend::Vm(b) = &self.backend else {
            return Err(RuntimeError::Invalid("not a VM sandbox".into()));
        };
        vm::kill(&self.sup);
        let (sup, agent) = start_vm(
            &b.rt,
            &self.id,
            &b.snap,
            &b.cgroup,
            &self.spec,
            (&b.env, &b.defaults),
            b.net.as_ref(),
        )?;
        self.init_pid = sup.pid();
        self.sup = sup;
        self.agent = agent;
        Ok(())
    }

    /// Gives a running VM its path out: a tap plugged into its QEMU, the guest's side
    /// configured; every later QEMU of it (reset, restore) gets it too.
    pub(crate) fn attach_vm_net(&mut self, net: VmPath) -> Result<(), RuntimeError> {
        let Backend::Vm(b) = &mut self.backend else {
            return Err(RuntimeError::Invalid("not a VM sandbox".into()));
        };
        plug_net(&b.rt, &self.id, &mut self.agent, &net).map_err(vm_err(&self.id))?;
        b.net = Some(net);
        Ok(())
    }

    /// Records a VM's path out without plugging anything in (an adopted VM's QEMU has its tap
    /// already; a changed bandwidth cap): later QEMUs of it get this one.
    pub(crate) fn set_vm_net(&mut self, net: Option<VmPath>) {
        if let Backend::Vm(b) = &mut self.backend {
            b.net = net;
        }
    }

    /// A VM whose tap stays plugged in and whose policy changed: records `net` for later QEMUs
    /// and has the guest bring `eth0` up on it, or take it down when it lets nothing out.
    pub(crate) fn reopen_vm_net(&mut self, net: VmPath) -> Result<(), RuntimeError> {
        let Backend::Vm(b) = &mut self.backend else {
            return Err(RuntimeError::Invalid("not a VM sandbox".into()));
        };
        guest_net(&mut self.agent, &net).map_err(vm_err(&self.id))?;
        b.net = Some(net);
        Ok(())
    }

    /// Destroys a VM sandbox: QEMU, cgroup, run directory.
    pub(crate) fn destroy_vm(mut self, rt: &Runtime) -> Result<(), RuntimeError> {
        vm::kill(&self.sup);
        if let Backend::Vm(b) = &self.backend {
            let _ = b.cgroup.kill_all();
        }
        // The VM's cgroup is named after the sandbox: removed with the run directory.
        let clean = rt.cleanup_leftovers(&self.id, &self.run_dir) && !self.sup.is_alive();
        self.state = self.state.transition(State::Stopped)?;
        if clean {
            Ok(())
        } else {
            Err(RuntimeError::Supervisor {
                id: self.id.clone(),
                message: "the VM left processes or files behind".into(),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{listing_fingerprint, mask_fingerprint};

    #[test]
    fn a_listing_is_named_by_its_entries_not_their_times() -> anyhow::Result<()> {
        let d = tempfile::tempdir()?;
        std::fs::write(d.path().join("tool"), "#!/bin/sh\n")?;
        std::os::unix::fs::symlink("/elsewhere/dsec", d.path().join("dsec"))?;
        let before = listing_fingerprint(d.path());
        // Rewritten by rename with the same content, the link made again: the same name.
        std::fs::write(d.path().join("tool.new"), "#!/bin/sh\n")?;
        std::fs::rename(d.path().join("tool.new"), d.path().join("tool"))?;
        std::fs::remove_file(d.path().join("dsec"))?;
        std::os::unix::fs::symlink("/elsewhere/dsec", d.path().join("dsec"))?;
        assert_eq!(listing_fingerprint(d.path()), before);
        // A new file, a changed size, a link elsewhere: another.
        std::fs::write(d.path().join("tool"), "#!/bin/sh\nexit 0\n")?;
        assert_ne!(listing_fingerprint(d.path()), before);
        Ok(())
    }
    use crate::template::unpack::{make_whiteout, set_opaque};

    #[test]
    fn mask_key_ignores_top_level_whiteouts_only() -> anyhow::Result<()> {
        let a = tempfile::tempdir()?;
        let b = tempfile::tempdir()?;
        for m in [a.path(), b.path()] {
            std::fs::create_dir_all(m.join("etc/ssh"))?;
            make_whiteout(&m.join("etc/shadow"))?;
            std::fs::create_dir(m.join("root"))?;
            set_opaque(&m.join("root"))?;
        }
        // A CI checkout appearing at the host's `/` adds a top-level whiteout.
        make_whiteout(&b.path().join("check"))?;
        assert_eq!(mask_fingerprint(a.path()), mask_fingerprint(b.path()));
        // What the image does contain changes the key.
        make_whiteout(&b.path().join("etc/ssh/ssh_host_key"))?;
        assert_ne!(mask_fingerprint(a.path()), mask_fingerprint(b.path()));
        Ok(())
    }
}
