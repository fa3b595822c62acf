//! System-call observations: the S-04 sweep over every syscall number and ABI, the S-05 list of
//! calls that must be denied, C-06, and the argument rules of S-11 and S-12. Every call runs in a forked child so a seccomp kill only
//! ends the child.

use std::time::Duration;

use dsec_sys::seccomp::{self, Action};
use serde_json::{json, Value};

use super::sys::{self, Outcome};
use super::Check;

/// Highest syscall number the sweep tries.
pub const SWEEP_MAX_NR: u32 = 470;

/// Numbers that are not x86_64 system calls at all.
const UNKNOWN_NRS: [u32; 3] = [1000, 4095, seccomp::X32_SYSCALL_BIT - 1];

/// Syscalls the sweep skips: with all-zero arguments they would fork a copy of the probe that
/// keeps running (`clone`, `fork`, `vfork`) or crash for reasons unrelated to the policy
/// (`rt_sigreturn`). `clone` is covered by S-05 with real flags.
const SWEEP_SKIP: [u32; 4] = [15, 56, 57, 58];

/// Argument sets for one sweep call: all zero, except that System V IPC calls get id -1 so that
/// no IPC object (id 0 may exist) is touched, even where the call is allowed.
fn sweep_args(nr: u32) -> [u64; 6] {
    const IPC_BY_ID: [u32; 8] = [30, 31, 65, 66, 67, 69, 70, 71];
    let mut a = [0u64; 6];
    if IPC_BY_ID.contains(&nr) || nr == 220 {
        a[0] = u64::MAX;
    }
    a
}

/// Runs syscall `nr` with `args` in a child with no open fds and a 300 ms alarm (for the calls
/// that block with zero arguments: pause, select, ppoll, pselect6).
pub fn observe(nr: u64, args: [u64; 6]) -> Outcome {
    sys::in_child(Duration::from_secs(3), move || {
        sys::close_all_fds();
        sys::arm_alarm_ms(300);
        // SAFETY: this forked child owns no fds any more and exits right after the call; the
        // argument sets are zero / -1 (see `sweep_args` and `must_deny`).
        match unsafe { sys::raw_syscall(nr as i64, args) } {
            Ok(_) => 0,
            Err(e) => e,
        }
    })
}

/// True when `outcome` is what `action` predicts.
pub fn matches(action: Action, outcome: Outcome) -> bool {
    match action {
        Action::Kill => outcome.killed_by_seccomp(),
        Action::Errno(e) => outcome == Outcome::Exited(i32::from(e)),
        // An allowed call runs: it may succeed, fail with any errno, block until the alarm, or end
        // the child itself (exit, strict seccomp mode). ENOSYS is ambiguous (the kernel may lack
        // the call, e.g. map_shadow_stack without shadow-stack support); `sweep` lists those.
        Action::Allow => {
            !outcome.killed_by_seccomp()
                && !matches!(outcome, Outcome::TimedOut | Outcome::ForkFailed(_))
        }
    }
}

fn action_str(a: Action) -> String {
    match a {
        Action::Allow => "allow".to_owned(),
        Action::Errno(e) => format!("errno {e}"),
        Action::Kill => "sigsys".to_owned(),
    }
}

fn foreign_abis() -> Vec<(String, Outcome)> {
    let int80 = sys::in_child(Duration::from_secs(3), || {
        // Survived: the i386 getpid ran. Report it as a distinctive exit code.
        let _ = sys::int80_getpid();
        200
    });
    let x32 = observe(u64::from(seccomp::X32_SYSCALL_BIT | 39), [0; 6]);
    vec![
        ("i386 int 0x80 getpid".to_owned(), int80),
        ("x32 getpid".to_owned(), x32),
    ]
}

/// S-04: every syscall number 0..=470 compared with [`seccomp::policy_action`], the i386 and x32
/// ABIs (must be killed; a kernel without IA32 emulation turns `int 0x80` into SIGSEGV, which is
/// accepted) and numbers beyond the table (ENOSYS).
pub fn sweep() -> Check {
    let mut mismatches = Vec::new();
    let mut counts = [0u32; 3];
    let mut tried = 0u32;
    let mut allowed_enosys = Vec::new();
    for nr in (0..=SWEEP_MAX_NR).chain(UNKNOWN_NRS) {
        if SWEEP_SKIP.contains(&nr) {
            continue;
        }
        tried += 1;
        let want = seccomp::policy_action(nr);
        let got = observe(u64::from(nr), sweep_args(nr));
        counts[match want {
            Action::Allow => 0,
            Action::Errno(_) => 1,
            Action::Kill => 2,
        }] += 1;
        if want == Action::Allow && got == Outcome::Exited(i32::from(seccomp::DEFAULT_ERRNO)) {
            allowed_enosys.push(json!({ "nr": nr, "name": seccomp::syscall_name(nr) }));
        }
        if !matches(want, got) {
            mismatches.push(json!({
                "nr": nr,
                "name": seccomp::syscall_name(nr),
                "policy": action_str(want),
                "observed": got.describe(),
            }));
        }
    }
    let mut abis = Vec::new();
    for (name, got) in foreign_abis() {
        let ok = got.killed_by_seccomp() || got == Outcome::Signaled(libc::SIGSEGV);
        if !ok {
            mismatches.push(json!({ "abi": name, "policy": "sigsys", "observed": got.describe() }));
        }
        abis.push(json!({ "abi": name, "observed": got.describe() }));
    }
    Check {
        id: "S-04",
        pass: mismatches.is_empty(),
        detail: json!({
            "tried": tried,
            "skipped": SWEEP_SKIP,
            "policy_allow": counts[0],
            "policy_errno": counts[1],
            "policy_kill": counts[2],
            "foreign_abis": abis,
            "allowed_but_kernel_enosys": allowed_enosys,
            "mismatches": mismatches,
        }),
    }
}

/// One S-05 probe: a name, the syscall and arguments that are harmless even where allowed.
struct Denied {
    name: &'static str,
    nr: i64,
    args: [u64; 6],
    /// What the policy says for these arguments.
    want: Action,
}

fn must_deny() -> Vec<Denied> {
    let m1 = u64::MAX; // -1: an invalid fd / pid / id
    let kill = Action::Kill;
    let d = |name, nr: i64, args, want| Denied {
        name,
        nr,
        args,
        want,
    };
    vec![
        d("ptrace(PTRACE_TRACEME)", libc::SYS_ptrace, [0; 6], kill),
        d(
            "process_vm_readv",
            libc::SYS_process_vm_readv,
            [1, 0, 0, 0, 0, 0],
            kill,
        ),
        d(
            "process_vm_writev",
            libc::SYS_process_vm_writev,
            [1, 0, 0, 0, 0, 0],
            kill,
        ),
        d("kcmp", libc::SYS_kcmp, [1, 1, 0, 0, 0, 0], kill),
        d(
            "pidfd_getfd",
            libc::SYS_pidfd_getfd,
            [m1, 0, 0, 0, 0, 0],
            kill,
        ),
        d("mount(NULL...)", libc::SYS_mount, [0; 6], kill),
        d("umount2(NULL)", libc::SYS_umount2, [0; 6], kill),
        d("pivot_root(NULL)", libc::SYS_pivot_root, [0; 6], kill),
        d("open_tree", libc::SYS_open_tree, [m1, 0, 0, 0, 0, 0], kill),
        d(
            "move_mount",
            libc::SYS_move_mount,
            [m1, 0, m1, 0, 0, 0],
            kill,
        ),
        d("fsopen(NULL)", libc::SYS_fsopen, [0; 6], kill),
        d("fsconfig", libc::SYS_fsconfig, [m1, 0, 0, 0, 0, 0], kill),
        d("fsmount", libc::SYS_fsmount, [m1, 0, 0, 0, 0, 0], kill),
        d("fspick", libc::SYS_fspick, [m1, 0, 0, 0, 0, 0], kill),
        d(
            "mount_setattr",
            libc::SYS_mount_setattr,
            [m1, 0, 0, 0, 0, 0],
            kill,
        ),
        d(
            "unshare(CLONE_NEWUSER)",
            libc::SYS_unshare,
            [libc::CLONE_NEWUSER as u64, 0, 0, 0, 0, 0],
            kill,
        ),
        d("setns(-1)", libc::SYS_setns, [m1, 0, 0, 0, 0, 0], kill),
        d(
            "keyctl(GET_KEYRING_ID)",
            libc::SYS_keyctl,
            [0, (-1i64) as u64, 0, 0, 0, 0],
            kill,
        ),
        d("add_key(NULL)", libc::SYS_add_key, [0; 6], kill),
        d("request_key(NULL)", libc::SYS_request_key, [0; 6], kill),
        d("bpf(-1)", libc::SYS_bpf, [m1, 0, 0, 0, 0, 0], kill),
        d("userfaultfd", libc::SYS_userfaultfd, [0; 6], kill),
        d(
            "perf_event_open(NULL)",
            libc::SYS_perf_event_open,
            [0; 6],
            kill,
        ),
        d(
            "kexec_load(bad flags)",
            libc::SYS_kexec_load,
            [0, 0, 0, 0xdead_0000, 0, 0],
            kill,
        ),
        d(
            "kexec_file_load(bad flags)",
            libc::SYS_kexec_file_load,
            [m1, m1, 0, 0, 0xdead_0000, 0],
            kill,
        ),
        d("init_module(NULL)", libc::SYS_init_module, [0; 6], kill),
        d(
            "finit_module(-1)",
            libc::SYS_finit_module,
            [m1, 0, 0, 0, 0, 0],
            kill,
        ),
        d("delete_module(NULL)", libc::SYS_delete_module, [0; 6], kill),
        d(
            "open_by_handle_at(-1)",
            libc::SYS_open_by_handle_at,
            [m1, 0, 0, 0, 0, 0],
            kill,
        ),
        d("reboot(bad magic)", libc::SYS_reboot, [0; 6], kill),
        d(
            "settimeofday(NULL, NULL)",
            libc::SYS_settimeofday,
            [0; 6],
            kill,
        ),
        d(
            "clock_settime(bad clock)",
            libc::SYS_clock_settime,
            [m1, 0, 0, 0, 0, 0],
            kill,
        ),
        d(
            "personality(PER_LINUX32)",
            libc::SYS_personality,
            [8, 0, 0, 0, 0, 0],
            Action::Errno(libc::EPERM as u16),
        ),
        d(
            "clone3(NULL)",
            libc::SYS_clone3,
            [0; 6],
            Action::Errno(libc::ENOSYS as u16),
        ),
        d(
            "io_uring_setup(NULL)",
            libc::SYS_io_uring_setup,
            [0; 6],
            Action::Errno(libc::ENOSYS as u16),
        ),
        d(
            "io_uring_enter(-1)",
            libc::SYS_io_uring_enter,
            [m1, 0, 0, 0, 0, 0],
            Action::Errno(libc::ENOSYS as u16),
        ),
        d(
            "io_uring_register(-1)",
            libc::SYS_io_uring_register,
            [m1, 0, 0, 0, 0, 0],
            Action::Errno(libc::ENOSYS as u16),
        ),
    ]
}

fn clone_with_flags(flags: u64) -> Outcome {
    sys::in_child(Duration::from_secs(3), move || {
        // SAFETY: clone without CLONE_VM and a null stack forks a copy that leaves at once
        // through raw_exit; this child exits right after.
        let r = unsafe {
            sys::raw_syscall(
                libc::SYS_clone,
                [flags | libc::SIGCHLD as u64, 0, 0, 0, 0, 0],
            )
        };
        match r {
            // The grandchild: the flag was allowed. Leave at once.
            Ok(0) => sys::raw_exit(0),
            Ok(_) => 0,
            Err(e) => e,
        }
    })
}

/// S-05: each call of the must-deny list is denied the way the policy says, including `clone`
/// with every `CLONE_NEW*` flag.
pub fn must_deny_check() -> Check {
    let mut results = Vec::new();
    let mut pass = true;
    for c in must_deny() {
        let got = observe(c.nr as u64, c.args);
        let ok = matches(c.want, got);
        pass &= ok;
        results.push(json!({ "call": c.name, "policy": action_str(c.want), "observed": got.describe(), "pass": ok }));
    }
    for (name, flag) in [
        ("CLONE_NEWNS", libc::CLONE_NEWNS),
        ("CLONE_NEWUTS", libc::CLONE_NEWUTS),
        ("CLONE_NEWIPC", libc::CLONE_NEWIPC),
        ("CLONE_NEWUSER", libc::CLONE_NEWUSER),
        ("CLONE_NEWPID", libc::CLONE_NEWPID),
        ("CLONE_NEWNET", libc::CLONE_NEWNET),
        ("CLONE_NEWCGROUP", libc::CLONE_NEWCGROUP),
        ("CLONE_NEWTIME", libc::CLONE_NEWTIME),
    ] {
        let got = clone_with_flags(flag as u64);
        let ok = got.killed_by_seccomp();
        pass &= ok;
        results.push(json!({ "call": format!("clone({name})"), "policy": "sigsys", "observed": got.describe(), "pass": ok }));
    }
    Check {
        id: "S-05",
        pass,
        detail: Value::Array(results),
    }
}

/// C-06: `open_by_handle_at` is denied (killed, or EPERM).
pub fn open_by_handle_check() -> Check {
    let got = observe(
        libc::SYS_open_by_handle_at as u64,
        [u64::MAX, 0, 0, 0, 0, 0],
    );
    let pass = got.killed_by_seccomp() || got == Outcome::Exited(libc::EPERM);
    Check {
        id: "C-06",
        pass,
        detail: json!({ "observed": got.describe() }),
    }
}

/// S-11: `socket` and `socketpair` open only the families a sandbox needs (`AF_UNIX`, `AF_INET`,
/// `AF_INET6`, and `AF_NETLINK` for `NETLINK_ROUTE`); every other family and netlink protocol
/// fails with `EAFNOSUPPORT`, as if the kernel had none.
pub fn socket_families_check() -> Check {
    use libc::{SOCK_DGRAM as DGRAM, SOCK_RAW as RAW, SOCK_SEQPACKET, SOCK_STREAM as STREAM};
    const NETLINK: i32 = libc::AF_NETLINK;
    // (family, domain, type, protocol, whether the policy opens it)
    let cases = [
        ("AF_UNIX", libc::AF_UNIX, STREAM, 0, true),
        ("AF_INET", libc::AF_INET, STREAM, 0, true),
        ("AF_INET6", libc::AF_INET6, DGRAM, 0, true),
        ("AF_NETLINK/ROUTE", NETLINK, RAW, libc::NETLINK_ROUTE, true),
        ("AF_VSOCK", libc::AF_VSOCK, STREAM, 0, false),
        ("AF_PACKET", libc::AF_PACKET, DGRAM, 0, false),
        ("AF_ALG", libc::AF_ALG, SOCK_SEQPACKET, 0, false),
        ("AF_KEY", libc::AF_KEY, RAW, 2, false),
        ("AF_NETLINK/AUDIT", NETLINK, RAW, libc::NETLINK_AUDIT, false),
        (
            "AF_NETLINK/UEVENT",
            NETLINK,
            RAW,
            libc::NETLINK_KOBJECT_UEVENT,
            false,
        ),
        (
            "AF_NETLINK/DIAG",
            NETLINK,
            RAW,
            libc::NETLINK_SOCK_DIAG,
            false,
        ),
        ("AF_XDP", libc::AF_XDP, RAW, 0, false),
        ("AF_TIPC", libc::AF_TIPC, RAW, 0, false),
        ("AF_BLUETOOTH", libc::AF_BLUETOOTH, RAW, 0, false),
    ];
    let eafnosupport = Outcome::Exited(libc::EAFNOSUPPORT);
    let mut results = Vec::new();
    let mut pass = true;
    for (name, family, ty, protocol, open) in cases {
        let args = [family as u64, ty as u64, protocol as u64, 0, 0, 0];
        let socket = observe(libc::SYS_socket as u64, args);
        // socketpair with a NULL vector: EFAULT where the family passes the filter.
        let pair = observe(libc::SYS_socketpair as u64, args);
        let ok = if open {
            socket == Outcome::Exited(0) && pair != eafnosupport
        } else {
            socket == eafnosupport && pair == eafnosupport
        };
        pass &= ok;
        results.push(json!({
            "family": name,
            "policy": if open { "allow" } else { "EAFNOSUPPORT" },
            "socket": socket.describe(),
            "socketpair": pair.describe(),
            "pass": ok,
        }));
    }
    Check {
        id: "S-11",
        pass,
        detail: Value::Array(results),
    }
}

/// One `mknod`/`mknodat` of S-12: the call, what it makes and where, the verdict it must get.
struct NodeCase {
    at: bool,
    node: &'static str,
    mode: u32,
    dev: u64,
    /// Where: `/tmp`, `/dev/shm`, or a directory that does not exist.
    dir: &'static str,
    refused: bool,
}

/// S-12: `mknod` and `mknodat` make no character or block device: both fail with `EPERM` from the
/// seccomp filter, also where the kernel alone would answer otherwise — under a directory that
/// does not exist (the kernel: `ENOENT`) and for a whiteout, the 0:0 character device that needs
/// no capability (the kernel makes it on `/dev/shm`). FIFOs, sockets and regular files are made.
pub fn mknod_check() -> Check {
    let (chr, blk) = (libc::S_IFCHR | 0o666, libc::S_IFBLK | 0o666);
    let (mem, loop0) = (sys::makedev(1, 1), sys::makedev(7, 0));
    let missing = "/tmp/.dsec-probe-missing";
    let mut cases = Vec::new();
    for at in [false, true] {
        let c = |node, mode, dev, dir, refused| NodeCase {
            at,
            node,
            mode,
            dev,
            dir,
            refused,
        };
        cases.extend([
            c("char 1:1", chr, mem, "/tmp", true),
            c("block 7:0", blk, loop0, "/tmp", true),
            c("char 1:1", chr, mem, missing, true),
            c("block 7:0", blk, loop0, missing, true),
            c("whiteout 0:0", libc::S_IFCHR, 0, "/dev/shm", true),
            c("fifo", libc::S_IFIFO | 0o600, 0, "/tmp", false),
            c("socket", libc::S_IFSOCK | 0o600, 0, "/tmp", false),
            c("regular file", libc::S_IFREG | 0o600, 0, "/tmp", false),
        ]);
    }
    let mut pass = true;
    let results: Vec<Value> = cases
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let path = format!("{}/.dsec-probe-node-{}-{i}", c.dir, sys::getpid());
            let r = sys::mknod_call(c.at, &path, c.mode, c.dev);
            let made = std::fs::symlink_metadata(&path).is_ok();
            let _ = std::fs::remove_file(&path);
            let ok = if c.refused {
                r == Err(libc::EPERM) && !made
            } else {
                r.is_ok() && made
            };
            pass &= ok;
            json!({
                "call": if c.at { "mknodat" } else { "mknod" },
                "node": c.node,
                "dir": c.dir,
                "policy": if c.refused { "EPERM" } else { "allow" },
                "observed": r.map_or_else(|e| format!("errno {e}"), |()| "made".to_owned()),
                "pass": ok,
            })
        })
        .collect();
    Check {
        id: "S-12",
        pass,
        detail: Value::Array(results),
    }
}
