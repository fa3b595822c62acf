//! The agent as PID 1 of a VM guest (`microvm` and `vm` substrates).
//!
//! The kernel starts `/init` (this binary) from the initramfs dsec generates. Boot:
//! 1. mount `/dev`, `/proc`, `/sys`; load the virtio modules listed in `/modules/order`
//!    (Debian's kernels build virtio as modules);
//! 2. mount the template's root image (squashfs, read-only) under a writable overlay whose
//!    upper layer is the VM's own disk (ext4, labelled `dsec-upper`; a tmpfs sized by the disk
//!    quota without one); switch root onto it;
//! 3. open the virtio-serial port named [`PORT_NAME`] and serve the same framed protocol as in
//!    a container, one host connection at a time.
//!
//! A sandbox is created by restoring a snapshot taken while this agent waited for requests, so
//! the first request after a restore is `Identify`: the guest takes its own hostname, the
//! host's clock, fresh entropy and its disk quota.
//!
//! When the host end of the port goes away (the node restarted) the agent keeps everything it
//! started and waits for the next connection, which it greets with `Hello`.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read};
use std::os::fd::AsFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use dsec_sys::guest::{self, MS_NODEV, MS_NOEXEC, MS_NOSUID, MS_RDONLY};

use crate::conn::{Agent, Reader};
use crate::files::Root;
use crate::guest::{memory_guard, Guest};
use crate::reaper::Reaper;

/// Name of the virtio-serial port the host talks to the agent on.
pub const PORT_NAME: &str = "dsec.agent";
/// Environment variable (from the kernel command line `dsec_vm=1`) that selects guest mode.
pub const VM_ENV: &str = "dsec_vm";
/// Label of the writable layer's disk.
const UPPER_LABEL: &str = "dsec-upper";
/// Environment variable with the initial writable-layer size in bytes (tmpfs fallback).
const DISK_ENV: &str = "dsec_disk";
/// How long boot waits for a device to appear.
const DEVICE_WAIT: Duration = Duration::from_secs(20);

/// Whether this process is PID 1 of a dsec VM guest.
pub fn is_guest() -> bool {
    dsec_sys::proc::getpid() == 1 && std::env::var_os(VM_ENV).is_some()
}

/// The volume label of the ext4 filesystem on `dev` (`s_volume_name`, 16 bytes at offset 120
/// of the superblock at 1024), if it has one.
fn ext4_label(dev: &Path) -> Option<String> {
    use std::os::unix::fs::FileExt;
    let f = File::open(dev).ok()?;
    let mut sb = [0u8; 256];
    f.read_exact_at(&mut sb, 1024).ok()?;
    // s_magic at offset 56
    if u16::from_le_bytes([sb[56], sb[57]]) != 0xEF53 {
        return None;
    }
    let name = &sb[120..136];
    let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    Some(String::from_utf8_lossy(&name[..end]).into_owned())
}

/// The filesystem type of the root image on `dev`: squashfs (magic `hsqs` at offset 0).
fn root_fs_type(dev: &Path) -> Option<&'static str> {
    use std::os::unix::fs::FileExt;
    let f = File::open(dev).ok()?;
    let mut magic = [0u8; 4];
    f.read_exact_at(&mut magic, 0).ok()?;
    (&magic == b"hsqs").then_some("squashfs")
}

/// Boots the guest and serves host connections forever.
pub fn run() -> anyhow::Result<()> {
    let guest = Arc::new(boot().context("guest boot")?);
    std::thread::Builder::new()
        .name("memory-guard".into())
        .spawn(memory_guard)
        .context("start the memory guard")?;
    let reaper = Reaper::new();
    let port = open_port().context("open the agent port")?;
    let writer = port.try_clone().context("clone port")?;
    let root = Root::open(Path::new("/")).context("open root")?;
    let agent = Arc::new(Agent::new(
        Box::new(writer),
        root,
        PathBuf::from("/"),
        reaper,
        Some(Guest {
            upper: guest.upper.try_clone().context("clone upper fd")?,
            upper_disk: guest.upper_disk,
        }),
    ));
    // One agent for the guest's life: when the host end goes away (the node restarted) the
    // guest's processes, sessions and handles stay, and the next connection is greeted with a
    // new `Hello` that the node resynchronises on (frames cut by the disconnect are lost).
    wait_for_host(&port);
    let reader = port.try_clone().context("clone port")?;
    agent.serve(
        Box::new(PortReader(reader)),
        Box::new(move || {
            wait_for_host(&port);
            let reader = port.try_clone().ok()?;
            Some(Box::new(PortReader(reader)) as Reader)
        }),
    );
    anyhow::bail!("the agent port could not be reopened")
}

/// Reads the port; a read error (the host went away mid-read) ends the connection like EOF.
struct PortReader(File);

impl std::os::fd::AsFd for PortReader {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.0.as_fd()
    }
}

impl Read for PortReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self.0.read(buf) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(0),
            r => r,
        }
    }
}

fn mkdirs(p: &str) -> anyhow::Result<()> {
    fs::create_dir_all(p).with_context(|| format!("mkdir {p}"))
}

fn mount(src: &str, target: &str, fstype: &str, flags: u64, data: &str) -> anyhow::Result<()> {
    mkdirs(target)?;
    guest::mount(src, Path::new(target), fstype, flags, data)
        .with_context(|| format!("mount {fstype} on {target}"))
}

fn boot() -> anyhow::Result<Guest> {
    if let Err(e) = mount("devtmpfs", "/dev", "devtmpfs", MS_NOSUID, "mode=0755") {
        // CONFIG_DEVTMPFS_MOUNT may have mounted it already.
        if !Path::new("/dev/null").exists() {
            return Err(e);
        }
    }
    mount(
        "proc",
        "/proc",
        "proc",
        MS_NOSUID | MS_NODEV | MS_NOEXEC,
        "",
    )?;
    mount(
        "sysfs",
        "/sys",
        "sysfs",
        MS_NOSUID | MS_NODEV | MS_NOEXEC,
        "",
    )?;
    load_modules(Path::new("/modules"))?;
    // Two disks: the template's root image and the writable layer's. Which one the kernel
    // named vda depends on probe order: the writable layer's is the ext4 labelled dsec-upper.
    wait_for(Path::new("/dev/vda"))?;
    let second = Path::new("/dev/vdb");
    let t0 = Instant::now();
    while !second.exists() && t0.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(1));
    }
    let (root, upper_dev) = if ext4_label(Path::new("/dev/vda")).as_deref() == Some(UPPER_LABEL) {
        ("/dev/vdb", Some("/dev/vda"))
    } else if second.exists() {
        ("/dev/vda", Some("/dev/vdb"))
    } else {
        ("/dev/vda", None)
    };
    let fstype = root_fs_type(Path::new(root))
        .with_context(|| format!("{root} holds no squashfs root image"))?;
    mount(root, "/lower", fstype, MS_RDONLY, "")?;
    let upper_disk = match upper_dev {
        Some(dev) if ext4_label(Path::new(dev)).as_deref() == Some(UPPER_LABEL) => {
            mount(dev, "/upper", "ext4", MS_NOSUID | MS_NODEV, "")?;
            true
        }
        _ => {
            // No disk for the writable layer: a tmpfs in guest RAM.
            let disk = std::env::var(DISK_ENV)
                .ok()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(1 << 30);
            mount(
                "tmpfs",
                "/upper",
                "tmpfs",
                MS_NOSUID | MS_NODEV,
                &format!("size={disk},mode=0755"),
            )?;
            false
        }
    };
    mkdirs("/upper/data")?;
    mkdirs("/upper/work")?;
    let upper = File::open("/upper").context("open /upper")?;
    mount(
        "overlay",
        "/newroot",
        "overlay",
        0,
        "lowerdir=/lower,upperdir=/upper/data,workdir=/upper/work",
    )?;
    for d in ["dev", "proc", "sys"] {
        let to = format!("/newroot/{d}");
        mkdirs(&to)?;
        guest::move_mount(Path::new(&format!("/{d}")), Path::new(&to))
            .with_context(|| format!("move /{d}"))?;
    }
    guest::switch_root(Path::new("/newroot")).context("switch root")?;
    mount(
        "devpts",
        "/dev/pts",
        "devpts",
        MS_NOSUID | MS_NOEXEC,
        "newinstance,ptmxmode=0666,mode=0620",
    )?;
    mount(
        "tmpfs",
        "/dev/shm",
        "tmpfs",
        MS_NOSUID | MS_NODEV,
        "mode=1777,size=64m",
    )?;
    for d in ["/tmp", "/run"] {
        mkdirs(d)?;
    }
    let _ = fs::set_permissions("/tmp", std::os::unix::fs::PermissionsExt::from_mode(0o1777));
    guest::set_hostname("sandbox").context("hostname")?;
    guest::loopback_up().context("lo up")?;
    Ok(Guest { upper, upper_disk })
}

fn load_modules(dir: &Path) -> anyhow::Result<()> {
    let order = match fs::read_to_string(dir.join("order")) {
        Ok(s) => s,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).context("read /modules/order"),
    };
    for name in order.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if name.contains('/') {
            bail!("bad module name {name:?}");
        }
        let f = File::open(dir.join(name)).with_context(|| format!("open module {name}"))?;
        guest::load_module(f.as_fd()).with_context(|| format!("load module {name}"))?;
    }
    Ok(())
}

fn wait_for(p: &Path) -> anyhow::Result<()> {
    let t0 = Instant::now();
    while !p.exists() {
        if t0.elapsed() > DEVICE_WAIT {
            bail!("{} did not appear", p.display());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

fn open_port() -> anyhow::Result<File> {
    let t0 = Instant::now();
    loop {
        if let Ok(entries) = fs::read_dir("/sys/class/virtio-ports") {
            for e in entries.flatten() {
                let name = fs::read_to_string(e.path().join("name")).unwrap_or_default();
                if name.trim() == PORT_NAME {
                    let dev = Path::new("/dev").join(e.file_name());
                    wait_for(&dev)?;
                    return OpenOptions::new()
                        .read(true)
                        .write(true)
                        .custom_flags(libc::O_CLOEXEC)
                        .open(&dev)
                        .with_context(|| format!("open {}", dev.display()));
                }
            }
        }
        if t0.elapsed() > DEVICE_WAIT {
            bail!("no virtio port named {PORT_NAME}");
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Waits until the host end of the port is connected: 1 ms polls at first (a restored clone is
/// connected within milliseconds), backing off to 50 ms so an unconnected guest stays idle.
fn wait_for_host(port: &File) {
    let mut pause = Duration::from_millis(1);
    loop {
        match guest::port_host_connected(port.as_fd(), 0) {
            Ok(true) => return,
            Ok(false) => {}
            Err(e) => eprintln!("dsec-agent: poll port: {e}"),
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(50));
    }
}
