//! `dsec-probe seccomp-selftest CHECK [ARGS...]`: installs [`Filter::build`] on the probe itself,
//! then runs one check and prints `{"check", "ok", ...}`. Checks that the filter must kill end
//! the probe with SIGSYS before anything is printed; the caller observes the wait status.

use std::os::fd::AsFd;
use std::process::Command;

use dsec_sys::seccomp::{Filter, PERSONALITY_QUERY};
use serde_json::{json, Value};

use super::{calls, sys};

/// Names of the checks, for `--help`.
pub const CHECKS: &[&str] = &[
    "run -- PROGRAM [ARGS...]",
    "ptrace",
    "unshare",
    "clone-newnet",
    "clone-plain",
    "clone3",
    "unlisted NR",
    "int80",
    "x32",
    "tiocsti",
    "personality",
    "open-by-handle",
    "mknod DIR",
    "sweep",
    "must-deny",
];

fn errno_of(r: Result<i64, i32>) -> Value {
    match r {
        Ok(v) => json!({ "ret": v }),
        Err(e) => json!({ "errno": e }),
    }
}

/// `mknod` and `mknodat` of a character device (1:1), a block device (7:0), a whiteout (0:0)
/// and a FIFO in `dir`: `{"<call> <node>": "made" | {"errno": n}}`. Each node made is removed.
fn mknod_in(dir: &str) -> Value {
    let nodes = [
        ("char", libc::S_IFCHR | 0o600, sys::makedev(1, 1)),
        ("block", libc::S_IFBLK | 0o600, sys::makedev(7, 0)),
        ("whiteout", libc::S_IFCHR, 0),
        ("fifo", libc::S_IFIFO | 0o600, 0),
    ];
    let mut out = serde_json::Map::new();
    for (call, at) in [("mknod", false), ("mknodat", true)] {
        for (node, mode, dev) in nodes {
            let path = format!("{dir}/{call}-{node}");
            let v = match sys::mknod_call(at, &path, mode, dev) {
                Ok(()) => json!("made"),
                Err(e) => json!({ "errno": e }),
            };
            let _ = std::fs::remove_file(&path);
            out.insert(format!("{call} {node}"), v);
        }
    }
    Value::Object(out)
}

/// Runs `check` under the filter; returns the JSON to print, or an error message for bad usage.
pub fn run(check: &str, args: &[String]) -> Result<Value, String> {
    let filter = Filter::build();
    sys::disable_core_dumps();
    filter
        .install()
        .map_err(|e| format!("install seccomp filter: {e}"))?;
    let z = [0u64; 6];
    // SAFETY: (covers every `sc` call below) the arguments are zero, -1 or small integers, so no
    // call writes to memory of this process; the process exits after printing the result, and the
    // clone children (no CLONE_VM, null stack = copy-on-write) exit at once.
    let sc = |nr: i64, a: [u64; 6]| unsafe { sys::raw_syscall(nr, a) };
    let out = match check {
        "run" => {
            let argv: Vec<&String> = args.iter().skip_while(|a| *a == "--").collect();
            let (prog, rest) = argv.split_first().ok_or("run needs a program")?;
            match Command::new(prog).args(rest).status() {
                Ok(st) => {
                    use std::os::unix::process::ExitStatusExt;
                    json!({ "ok": st.success(), "code": st.code(), "signal": st.signal() })
                }
                Err(e) => json!({ "ok": false, "spawn_error": e.to_string() }),
            }
        }
        "ptrace" => errno_of(sc(libc::SYS_ptrace, z)),
        "unshare" => errno_of(sc(
            libc::SYS_unshare,
            [libc::CLONE_NEWUSER as u64, 0, 0, 0, 0, 0],
        )),
        "clone-newnet" | "clone-plain" => {
            let extra = if check == "clone-newnet" {
                libc::CLONE_NEWNET as u64
            } else {
                0
            };
            match sc(
                libc::SYS_clone,
                [extra | libc::SIGCHLD as u64, 0, 0, 0, 0, 0],
            ) {
                Ok(0) => sys::raw_exit(7),
                Ok(pid) => {
                    let mut status = 0;
                    // SAFETY: `pid` is the child just created; `status` is a valid int.
                    unsafe { libc::waitpid(pid as i32, &mut status, 0) };
                    json!({ "ok": libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 7 })
                }
                Err(e) => json!({ "ok": false, "errno": e }),
            }
        }
        "clone3" => errno_of(sc(libc::SYS_clone3, z)),
        "unlisted" => {
            let nr: i64 = args
                .first()
                .and_then(|a| a.parse().ok())
                .ok_or("unlisted needs a syscall number")?;
            errno_of(sc(nr, z))
        }
        "int80" => json!({ "ret": sys::int80_getpid() }),
        "x32" => errno_of(sc(i64::from(dsec_sys::seccomp::X32_SYSCALL_BIT | 39), z)),
        "tiocsti" => {
            let ptmx = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open("/dev/ptmx")
                .map_err(|e| format!("open /dev/ptmx: {e}"))?;
            let sti = sys::ioctl_with_byte(ptmx.as_fd(), libc::TIOCSTI, b'x');
            let linux = sys::ioctl_with_byte(ptmx.as_fd(), 0x541c, 0);
            let tcgets = {
                // SAFETY: termios is plain data written by the kernel.
                let mut t: libc::termios = unsafe { std::mem::zeroed() };
                // SAFETY: `t` is a valid termios for TCGETS to fill; `ptmx` is open.
                let rc = unsafe {
                    libc::ioctl(std::os::fd::AsRawFd::as_raw_fd(&ptmx), libc::TCGETS, &mut t)
                };
                if rc < 0 {
                    Err(sys::errno())
                } else {
                    Ok(rc)
                }
            };
            json!({
                "tiocsti": errno_of(sti.map(i64::from)),
                "tioclinux": errno_of(linux.map(i64::from)),
                "tcgets": errno_of(tcgets.map(i64::from)),
            })
        }
        "personality" => json!({
            "query": errno_of(sc(
                libc::SYS_personality,
                [u64::from(PERSONALITY_QUERY), 0, 0, 0, 0, 0],
            )),
            "set_linux32": errno_of(sc(libc::SYS_personality, [8, 0, 0, 0, 0, 0])),
        }),
        "open-by-handle" => errno_of(sc(libc::SYS_open_by_handle_at, [u64::MAX, 0, 0, 0, 0, 0])),
        "mknod" => mknod_in(args.first().ok_or("mknod needs a directory")?),
        "sweep" => serde_json::to_value(calls::sweep()).map_err(|e| e.to_string())?,
        "must-deny" => serde_json::to_value(calls::must_deny_check()).map_err(|e| e.to_string())?,
        other => return Err(format!("unknown selftest check {other:?}")),
    };
    Ok(json!({ "check": check, "filter_len": filter.len(), "result": out }))
}
