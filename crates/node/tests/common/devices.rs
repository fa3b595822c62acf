//! S-13's helpers: the device list a sandbox's cgroup must hold, and a device node planted in a
//! running sandbox from the host.

use std::process::{Command, Output};

/// The device list every sandbox's cgroup holds: the nodes of its `/dev` (made inside the
/// cgroup, hence `m`), its devpts instance's `ptmx` and every pty.
pub const SANDBOX_DEVICE_LIST: [&str; 8] = [
    "c 1:3 rwm",
    "c 1:5 rwm",
    "c 1:7 rwm",
    "c 1:8 rwm",
    "c 1:9 rwm",
    "c 5:0 rwm",
    "c 5:2 rw",
    "c 136:* rw",
];

/// Where [`plant_device`] puts its node, inside the sandbox.
pub const PLANTED: &str = "/dev/mqueue/dsec-planted-tun";

/// Plants, from the host, a device node that no layer but the cgroup's device list keeps from
/// the sandbox: in the mount namespace of the sandbox's process `pid`, a tmpfs of the host's
/// (not `nodev`, and of the initial user namespace, so its nodes open in either mode) over
/// `/dev/mqueue`, holding [`PLANTED`], `/dev/net/tun` (10:200, harmless to open) with mode 0666.
/// The mount goes with the sandbox's mount namespace.
pub fn plant_device(pid: i32) -> Output {
    let script = format!(
        "mount -t tmpfs -o size=64k,mode=0755 dsec-plant /dev/mqueue && mknod -m 0666 {PLANTED} c 10 200"
    );
    Command::new("nsenter")
        .args(["-t", &pid.to_string(), "-m", "-p", "--", "/bin/sh", "-c"])
        .arg(script)
        .output()
        .expect("run nsenter (util-linux)")
}
