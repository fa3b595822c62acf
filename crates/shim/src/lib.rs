//! `dsec-shim`: the spawner and the per-sandbox supervisors of the container substrate, and the
//! protocol the node speaks with them ([`proto`]). It needs no more than `std`, `dsec-sys` and
//! `dsec-api`: every sandbox's supervisor is a fork of the spawner, so the smaller this process,
//! the cheaper each one.
//!
//! The node starts one spawner (`dsec-shim spawner`, a fresh single-threaded process) and talks
//! to it over a `SOCK_SEQPACKET` socket on fd 3. For each [`proto::SpawnRequest`] the spawner
//! `fork`s a supervisor, which:
//! 1. detaches (`setsid`) so it outlives the node and the spawner,
//! 2. creates the sandbox cgroup and clones the sandbox init into new namespaces
//!    ([`dsec_sys::launch::spawn_container`]), which execs `dsec-agent` from a sealed memfd,
//! 3. answers the node with the agent socket and its own control socket, and listens on
//!    `<run_dir>/sup.sock` so that a restarted node can reconnect,
//! 4. serves `Reset`/`Destroy` on the control socket and watches the init with a pidfd.
//!
//! The sandbox init has `PR_SET_PDEATHSIG = SIGKILL` tied to its supervisor: killing a
//! supervisor kills the whole sandbox (its pid namespace dies with its init).
#![forbid(unsafe_code)]

pub mod limits;
pub mod proto;

mod agent;
mod ctx;
mod failure;
mod init;
mod serve;
mod shell;
mod spawner;
mod supervise;

/// Name of the cgroup base directory under each hierarchy.
pub const CGROUP_BASE: &str = "dsec";

/// Entry point of `dsec-shim`. Returns the process exit code.
pub fn main(args: &[String]) -> i32 {
    match args.get(1).map(String::as_str) {
        Some("spawner") => match spawner::run_spawner() {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("dsec-shim spawner: {e}");
                1
            }
        },
        _ => {
            eprintln!(
                "usage: dsec-shim spawner   (started by the dsec node, fd 3 = control socket)"
            );
            2
        }
    }
}
