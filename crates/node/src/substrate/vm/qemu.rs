//! The QEMU process of one VM: its command line and its QMP control connection.
//!
//! Every QEMU is started with `-nodefaults -no-user-config`, one virtio NIC on a hub of its own
//! with nothing else on it (a sandbox with network egress gets a tap plugged into that hub over
//! QMP: [`Qmp::plug_tap`]; the NIC is the same either way, so every snapshot fits), the guest's
//! serial console on a null (clones) or size-bounded file (template boots) backend, QEMU's own
//! seccomp filter (`-sandbox on` denying spawn, privilege changes and resource control), and
//! only three channels to the host: the QMP socket, the agent's virtio-serial socket (both unix
//! sockets in the sandbox's run directory, which only root can reach), and file descriptors the
//! node passes over QMP (`getfd`) for snapshot streams.

use std::io::{self, BufRead, BufReader, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::VmError;

/// Machine type of a VM substrate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Machine {
    /// `-M microvm`: virtio-mmio devices, no PCI, no firmware.
    Microvm,
    /// `-M q35`: PCI and ACPI, a whole machine.
    Q35,
}

/// CPU accelerator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Accel {
    /// Hardware virtualisation.
    Kvm,
    /// Software emulation (QEMU's tiny code generator).
    Tcg,
}

impl Accel {
    /// The `-accel` argument.
    pub fn arg(self) -> &'static str {
        match self {
            // A bounded translation cache: the default (1 GiB, touched lazily) lets each
            // busy VM grow its private memory by hundreds of MiB.
            Accel::Tcg => "tcg,tb-size=64",
            Accel::Kvm => "kvm",
        }
    }

    /// The guest CPU model. Under TCG an x86-64-v2 CPU (SSE4.2, POPCNT: what common
    /// distributions' binaries may assume) rather than `max`: `max` also emulates features
    /// such as 5-level paging that make every guest page walk dearer — `/bin/true` forks and
    /// execs ~1.8 ms (11%) faster in the guest with this model.
    pub fn cpu(self) -> &'static str {
        match self {
            Accel::Kvm => "host",
            Accel::Tcg => "qemu64,+ssse3,+sse4.1,+sse4.2,+popcnt",
        }
    }

    /// Name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

/// Everything that shapes one QEMU command line.
#[derive(Debug, Clone)]
pub struct VmArgs {
    /// Machine type.
    pub machine: Machine,
    /// Accelerator.
    pub accel: Accel,
    /// Guest RAM in MiB.
    pub memory_mib: u64,
    /// vCPUs.
    pub vcpus: u32,
    /// Kernel image.
    pub kernel: PathBuf,
    /// Initramfs.
    pub initrd: PathBuf,
    /// Kernel command line.
    pub cmdline: String,
    /// Root filesystem image (attached read-only).
    pub root_image: PathBuf,
    /// File backing guest RAM.
    pub ram_file: PathBuf,
    /// The writable layer's disk: written through while booting a template, a private
    /// copy-on-write overlay (`snapshot=on`) for clones.
    pub upper: PathBuf,
    /// The writable disk is a qcow2 image (a running guest's snapshot: its overlay over the
    /// template's disk), not the raw ext4 image.
    pub upper_qcow2: bool,
    /// `true` while booting a template (guest RAM written through to `ram_file`); `false`
    /// for clones (a private copy-on-write mapping of it).
    pub ram_shared: bool,
    /// Guest RAM is anonymous memory, not `ram_file`: a running guest's snapshot loads every
    /// page the guest used from its stream, so a mapping of the template's file would only be
    /// copied on write page by page.
    pub ram_anonymous: bool,
    /// Directory for the QMP and agent sockets.
    pub run_dir: PathBuf,
    /// Serial console log (template boots) or none (clones).
    pub console_log: Option<PathBuf>,
    /// Wait for an incoming snapshot instead of booting.
    pub incoming: bool,
    /// Least privilege after start-up: the empty directory QEMU chroots into (`-chroot`) once
    /// every file and socket it needs is open, dropping to a uid of its own (`-runas`, added
    /// when it is started: see [`jailed_command`]).
    pub jail: Option<PathBuf>,
}

/// First uid (and gid) of the range QEMU processes of VM clones run as: a clone's QEMU drops to
/// `QEMU_UID_BASE + its pid`. A pid is unique among the host's live processes, so no two live
/// QEMUs share a uid (they cannot signal or ptrace each other), with no allocator to keep and
/// nothing to recover after a restart; no passwd entry is needed. The range, 2^30 up to 2^30 +
/// 2^22 (the kernel's largest pid), is far above the ids of users and of the sandboxes' user
/// namespaces.
pub const QEMU_UID_BASE: u32 = 1 << 30;

/// The command that starts `qemu` with `args`: when `args` has a jail, through `/bin/sh`, which
/// adds `-runas <uid>:<gid>` for the pid it then hands to QEMU with `exec`
/// ([`QEMU_UID_BASE`]).
pub fn jailed_command(qemu: &Path, args: &VmArgs) -> std::process::Command {
    let argv = args.to_args();
    if args.jail.is_none() {
        let mut c = std::process::Command::new(qemu);
        c.args(argv);
        return c;
    }
    let mut c = std::process::Command::new("/bin/sh");
    c.arg("-c")
        .arg(format!(
            "id=$(({QEMU_UID_BASE} + $$)); exec \"$0\" \"$@\" -runas \"$id:$id\""
        ))
        .arg(qemu)
        .args(argv);
    c
}

/// The hub port of the guest's NIC.
const NIC_PORT: &str = "nic0";
/// The tap's netdev and its hub port, when plugged.
const TAP: &str = "tap0";
const TAP_PORT: &str = "tap0port";

/// QMP socket name in the run directory.
pub const QMP_SOCK: &str = "qmp.sock";
/// Agent socket name in the run directory.
pub const AGENT_SOCK: &str = "agent.sock";

impl VmArgs {
    /// The argument vector (without the program).
    pub fn to_args(&self) -> Vec<String> {
        let mut a: Vec<String> = Vec::new();
        let mut push = |s: &[&str]| a.extend(s.iter().map(|s| (*s).to_string()));
        let machine = match self.machine {
            Machine::Microvm => {
                "microvm,x-option-roms=off,isa-serial=on,rtc=on,pit=off,pic=off,memory-backend=mem"
            }
            Machine::Q35 => "q35,memory-backend=mem,vmport=off,smbus=off,sata=off",
        };
        push(&["-M", machine, "-accel", self.accel.arg()]);
        push(&["-cpu", self.accel.cpu()]);
        let mem = format!("{}M", self.memory_mib);
        let smp = self.vcpus.to_string();
        push(&["-m", &mem, "-smp", &smp]);
        push(&[
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-no-reboot",
        ]);
        let kernel = self.kernel.display().to_string();
        let initrd = self.initrd.display().to_string();
        push(&[
            "-kernel",
            &kernel,
            "-initrd",
            &initrd,
            "-append",
            &self.cmdline,
        ]);
        let console = match &self.console_log {
            Some(p) => format!("file,id=con,path={}", p.display()),
            None => "null,id=con".to_string(),
        };
        push(&["-chardev", &console, "-serial", "chardev:con"]);
        let (blk, serial, rng) = match self.machine {
            Machine::Microvm => (
                "virtio-blk-device",
                "virtio-serial-device",
                "virtio-rng-device",
            ),
            Machine::Q35 => ("virtio-blk-pci", "virtio-serial-pci", "virtio-rng-pci"),
        };
        let drive = format!(
            "id=root,file={},format=raw,readonly=on,if=none,cache=unsafe",
            self.root_image.display()
        );
        push(&["-drive", &drive, "-device", &format!("{blk},drive=root")]);
        let upper = format!(
            "id=upper,file={},format={},if=none,cache=unsafe,discard=unmap{}",
            self.upper.display(),
            if self.upper_qcow2 { "qcow2" } else { "raw" },
            if self.ram_shared { "" } else { ",snapshot=on" }
        );
        push(&["-drive", &upper, "-device", &format!("{blk},drive=upper")]);
        let agent = format!(
            "socket,id=agent,path={},server=on,wait=off",
            self.run_dir.join(AGENT_SOCK).display()
        );
        push(&["-device", serial, "-chardev", &agent]);
        push(&[
            "-device",
            &format!("virtserialport,chardev=agent,name={}", super::PORT_NAME),
        ]);
        push(&["-device", rng]);
        // The NIC, always (a snapshot's devices must match the clone's): on hub 0 alone until a
        // tap is plugged in. One MAC for every guest: each is alone on its own link.
        let nic = match self.machine {
            Machine::Microvm => "virtio-net-device",
            Machine::Q35 => "virtio-net-pci",
        };
        push(&["-netdev", &format!("hubport,id={NIC_PORT},hubid=0")]);
        push(&[
            "-device",
            &format!("{nic},netdev={NIC_PORT},mac=52:54:00:d5:ec:01"),
        ]);
        let ram = if self.ram_anonymous {
            format!("memory-backend-ram,id=mem,size={mem}")
        } else {
            format!(
                "memory-backend-file,id=mem,size={mem},mem-path={},share={}",
                self.ram_file.display(),
                if self.ram_shared { "on" } else { "off" }
            )
        };
        push(&["-object", &ram]);
        let qmp = format!(
            "unix:{},server=on,wait=off",
            self.run_dir.join(QMP_SOCK).display()
        );
        push(&["-qmp", &qmp]);
        if self.incoming {
            push(&["-incoming", "defer"]);
        }
        // QEMU's own seccomp filter is installed before `-runas` switches users, so it must
        // allow the set*id calls when the process drops root; a QEMU that runs as `nobody`
        // in an empty chroot cannot elevate with them anyway.
        let elevate = match &self.jail {
            Some(dir) => {
                push(&["-chroot", &dir.display().to_string()]);
                "allow"
            }
            None => "deny",
        };
        let sandbox =
            format!("on,obsolete=deny,elevateprivileges={elevate},spawn=deny,resourcecontrol=deny");
        push(&["-sandbox", &sandbox]);
        a
    }
}

/// A QMP connection (one JSON object per line).
#[derive(Debug)]
pub struct Qmp {
    stream: UnixStream,
    reader: BufReader<UnixStream>,
}

impl Qmp {
    /// Connects to the QMP socket at `path`, retrying until `deadline` (QEMU creates it during
    /// start-up), and negotiates capabilities.
    pub fn connect(path: &Path, deadline: Instant) -> Result<Qmp, VmError> {
        let stream = connect_retry(path, deadline)?;
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .map_err(VmError::io("qmp timeout"))?;
        let reader = BufReader::new(stream.try_clone().map_err(VmError::io("qmp clone"))?);
        let mut q = Qmp { stream, reader };
        q.read_reply()?; // greeting
        q.execute("qmp_capabilities", Value::Null)?;
        Ok(q)
    }

    fn read_reply(&mut self) -> Result<Value, VmError> {
        loop {
            let mut line = String::new();
            let n = self
                .reader
                .read_line(&mut line)
                .map_err(VmError::io("qmp read"))?;
            if n == 0 {
                return Err(VmError::Qmp("QEMU closed its QMP socket".into()));
            }
            let v: Value = serde_json::from_str(&line)
                .map_err(|e| VmError::Qmp(format!("bad QMP message: {e}")))?;
            if v.get("event").is_some() {
                continue;
            }
            return Ok(v);
        }
    }

    fn send(
        &mut self,
        cmd: &str,
        args: Value,
        fd: Option<BorrowedFd<'_>>,
    ) -> Result<Value, VmError> {
        let msg = if args.is_null() {
            json!({ "execute": cmd })
        } else {
            json!({ "execute": cmd, "arguments": args })
        };
        let bytes = serde_json::to_vec(&msg).map_err(|e| VmError::Qmp(e.to_string()))?;
        match fd {
            Some(fd) => dsec_sys::ipc::send_with_fds(self.stream.as_fd(), &bytes, &[fd])
                .map_err(VmError::io("qmp send fd"))?,
            None => self
                .stream
                .write_all(&bytes)
                .map_err(VmError::io("qmp send"))?,
        }
        let reply = self.read_reply()?;
        if let Some(e) = reply.get("error") {
            return Err(VmError::Qmp(format!("{cmd}: {e}")));
        }
        Ok(reply.get("return").cloned().unwrap_or(Value::Null))
    }

    /// Runs a QMP command; returns its `return` value.
    pub fn execute(&mut self, cmd: &str, args: Value) -> Result<Value, VmError> {
        self.send(cmd, args, None)
    }

    /// Hands QEMU a file descriptor under `name` (`getfd`).
    pub fn pass_fd(&mut self, name: &str, fd: BorrowedFd<'_>) -> Result<(), VmError> {
        self.send("getfd", json!({ "fdname": name }), Some(fd))
            .map(|_| ())
    }

    /// Plugs the tap `fd` into the hub of the guest's NIC: what the guest sends goes out of it.
    pub fn plug_tap(&mut self, fd: BorrowedFd<'_>) -> Result<(), VmError> {
        self.pass_fd(TAP, fd)?;
        self.execute("netdev_add", json!({ "type": "tap", "id": TAP, "fd": TAP }))?;
        self.execute(
            "netdev_add",
            json!({ "type": "hubport", "id": TAP_PORT, "hubid": 0, "netdev": TAP }),
        )
        .map(|_| ())
    }

    /// Turns on the `x-ignore-shared` migration capability: guest RAM in a shared file is not
    /// copied into the snapshot stream (the file is the RAM snapshot).
    pub fn ignore_shared(&mut self) -> Result<(), VmError> {
        self.execute(
            "migrate-set-capabilities",
            json!({ "capabilities": [{ "capability": "x-ignore-shared", "state": true }] }),
        )
        .map(|_| ())
    }

    /// Polls `query-migrate` until it completes; fails on `failed`/`cancelled` or at `deadline`.
    pub fn wait_migration(&mut self, deadline: Instant) -> Result<(), VmError> {
        loop {
            let st = self.execute("query-migrate", Value::Null)?;
            match st.get("status").and_then(Value::as_str) {
                Some("completed") => return Ok(()),
                Some(s @ ("failed" | "cancelled")) => {
                    let why = st
                        .get("error-desc")
                        .and_then(Value::as_str)
                        .unwrap_or_default();
                    return Err(VmError::Qmp(format!("migration {s}: {why}")));
                }
                _ => {}
            }
            if Instant::now() >= deadline {
                return Err(VmError::Qmp("migration did not complete in time".into()));
            }
            std::thread::sleep(Duration::from_micros(500));
        }
    }
}

/// Connects to a unix socket QEMU creates, retrying until `deadline`.
pub fn connect_retry(path: &Path, deadline: Instant) -> Result<UnixStream, VmError> {
    loop {
        match UnixStream::connect(path) {
            Ok(s) => return Ok(s),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused
                ) =>
            {
                if Instant::now() >= deadline {
                    return Err(VmError::Io {
                        what: "connect to QEMU",
                        source: e,
                    });
                }
                std::thread::sleep(Duration::from_micros(500));
            }
            Err(e) => {
                return Err(VmError::Io {
                    what: "connect to QEMU",
                    source: e,
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(machine: Machine, incoming: bool) -> Vec<String> {
        VmArgs {
            machine,
            accel: Accel::Tcg,
            memory_mib: 256,
            vcpus: 1,
            kernel: "/k".into(),
            initrd: "/i".into(),
            cmdline: "quiet".into(),
            root_image: "/r.img".into(),
            ram_file: "/ram".into(),
            ram_shared: !incoming,
            ram_anonymous: false,
            upper: "/u.img".into(),
            upper_qcow2: false,
            run_dir: "/run/x".into(),
            console_log: None,
            incoming,
            jail: Some("/run/x/jail".into()),
        }
        .to_args()
    }

    #[test]
    fn clone_maps_ram_privately_and_denies_spawn() {
        let a = args(Machine::Microvm, true).join(" ");
        assert!(a.contains("mem-path=/ram,share=off"), "{a}");
        assert!(a.contains("-incoming defer"));
        assert!(a.contains("spawn=deny"));
        assert!(a.contains("-chroot /run/x/jail"));
        assert!(a.contains("readonly=on"));
        assert!(a.contains("-nodefaults"));
        // One NIC on a hub with nothing else: no way out until a tap is plugged in.
        assert!(a.contains("-netdev hubport,id=nic0,hubid=0"), "{a}");
        assert!(a.contains("virtio-net-device,netdev=nic0"), "{a}");
        assert_eq!(a.matches("-netdev").count(), 1);
        assert!(!a.contains("-nic") && !a.contains("user,") && !a.contains("tap"));
        assert!(a.contains("virtio-serial-device"));
        assert!(a.contains("file=/u.img,format=raw,if=none,cache=unsafe,discard=unmap,snapshot=on"));
    }

    #[test]
    fn template_boot_writes_ram_through_and_q35_uses_pci() {
        let a = args(Machine::Q35, false).join(" ");
        assert!(a.contains("share=on"));
        assert!(!a.contains("-incoming"));
        assert!(a.contains("virtio-blk-pci") && a.contains("q35"));
        assert!(a.contains("virtio-net-pci,netdev=nic0"), "{a}");
        assert!(a.contains("file=/u.img") && !a.contains("snapshot=on"));
    }
}
