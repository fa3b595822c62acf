//! The sandbox's seccomp policy and a classic-BPF generator for it (no libseccomp).
//!
//! The policy is one table ([`TABLE`]) of every x86_64 system call dsec knows by name, each with
//! a rule. The generated program:
//!
//! 1. kills the process unless `seccomp_data.arch` is `AUDIT_ARCH_X86_64` (this kills the i386
//!    ABI, `int 0x80`);
//! 2. kills the process if `nr >= 0x4000_0000` (the x32 ABI bit);
//! 3. binary-searches the syscall number over the table, compressed into ranges of equal rules,
//!    and returns the rule's action. Five rules inspect an argument: `clone` (killed when any
//!    `CLONE_NEW*` flag is set), `ioctl` (`TIOCSTI` and `TIOCLINUX` fail with `EPERM`),
//!    `personality` (only the query `0xffffffff` is allowed, anything else fails with `EPERM`),
//!    `socket`/`socketpair` (only the families of [`SOCKET_FAMILIES`] and `NETLINK_ROUTE`;
//!    anything else fails with `EAFNOSUPPORT`) and `mknod`/`mknodat` (a character or block
//!    device node fails with `EPERM`; FIFOs, sockets and regular files are made).
//!
//! Anything the table does not allow or kill fails with `ENOSYS`, so programs take their
//! fallback paths (glibc retries `clone3` as `clone`). The [`Filter`] is built before fork (it
//! allocates) and [`Filter::install`] runs allocation-free in the child right before exec.
//!
//! [`render_table`] prints the table as Markdown for the docs; `dsec-probe` checks it from
//! inside a sandbox (TESTING.md S-04/S-05).

use std::io;

/// What the policy does with a system call, ignoring argument filters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Action {
    /// The call runs.
    Allow,
    /// The call fails with this errno without running.
    Errno(u16),
    /// The whole process is killed with `SIGSYS`.
    Kill,
}

/// A table entry's rule; the argument-filtered ones are separate so the generator can emit their
/// argument checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rule {
    Plain(Action),
    /// `clone`: allowed unless a namespace flag is set in the low 32 bits of `flags`, then kill.
    Clone,
    /// `ioctl`: `TIOCSTI`/`TIOCLINUX` requests fail with `EPERM`; anything else is allowed.
    Ioctl,
    /// `personality`: only the query `0xffffffff` is allowed; any change fails with `EPERM`.
    Personality,
    /// `socket`, `socketpair`: only the families in [`SOCKET_FAMILIES`], and `AF_NETLINK` only
    /// for `NETLINK_ROUTE`; any other family fails with `EAFNOSUPPORT`.
    Socket,
    /// `mknod` (mode in argument 1), `mknodat` (argument 2): a mode whose file type
    /// (`mode & S_IFMT`) is `S_IFCHR` or `S_IFBLK` fails with `EPERM`; any other is allowed.
    Mknod {
        /// Index of the mode argument.
        mode_arg: u32,
    },
}

const A: Rule = Rule::Plain(Action::Allow);
const MKNOD: Rule = Rule::Mknod { mode_arg: 1 };
const MKNODAT: Rule = Rule::Mknod { mode_arg: 2 };
const K: Rule = Rule::Plain(Action::Kill);
const EPERM: Rule = Rule::Plain(Action::Errno(libc::EPERM as u16));
const NOSYS: Rule = Rule::Plain(Action::Errno(libc::ENOSYS as u16));

/// Errno returned for every system call the table does not name.
pub const DEFAULT_ERRNO: u16 = libc::ENOSYS as u16;

/// Every namespace-creating clone flag; `clone` with any of them kills the process.
pub const CLONE_NEW_MASK: u32 = (libc::CLONE_NEWNS
    | libc::CLONE_NEWUTS
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWUSER
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWNET
    | libc::CLONE_NEWCGROUP
    | libc::CLONE_NEWTIME) as u32;

/// The address families `socket` and `socketpair` may open (besides `AF_NETLINK` with
/// `NETLINK_ROUTE`): local sockets and IP. Every other family (`AF_VSOCK`, which on a node that is
/// itself a VM reaches the hypervisor's host, `AF_PACKET`, `AF_ALG`, `AF_KEY`, Bluetooth, …) fails
/// with `EAFNOSUPPORT`, as if the kernel had no such family.
pub const SOCKET_FAMILIES: [u32; 3] = [
    libc::AF_UNIX as u32,
    libc::AF_INET as u32,
    libc::AF_INET6 as u32,
];

/// The file-type bits of a mode, and the two types `mknod`/`mknodat` may not create.
const S_IFMT: u32 = libc::S_IFMT;
const S_IFCHR: u32 = libc::S_IFCHR;
const S_IFBLK: u32 = libc::S_IFBLK;

const AF_NETLINK: u32 = libc::AF_NETLINK as u32;
const NETLINK_ROUTE: u32 = libc::NETLINK_ROUTE as u32;
const EAFNOSUPPORT: u16 = libc::EAFNOSUPPORT as u16;

/// `personality(0xffffffff)`: the read-only query, the only allowed form.
pub const PERSONALITY_QUERY: u32 = 0xffff_ffff;

/// The x32 ABI marker bit in the syscall number.
pub const X32_SYSCALL_BIT: u32 = 0x4000_0000;

const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
const TIOCSTI: u32 = libc::TIOCSTI as u32;
const TIOCLINUX: u32 = 0x541c;

/// The policy: `(nr, name, rule)` sorted by `nr`. Unlisted numbers get `ENOSYS`.
#[rustfmt::skip]
const TABLE: &[(u32, &str, Rule)] = &[
    (0, "read", A), (1, "write", A), (2, "open", A), (3, "close", A), (4, "stat", A),
    (5, "fstat", A), (6, "lstat", A), (7, "poll", A), (8, "lseek", A), (9, "mmap", A),
    (10, "mprotect", A), (11, "munmap", A), (12, "brk", A), (13, "rt_sigaction", A),
    (14, "rt_sigprocmask", A), (15, "rt_sigreturn", A), (16, "ioctl", Rule::Ioctl),
    (17, "pread64", A), (18, "pwrite64", A), (19, "readv", A), (20, "writev", A),
    (21, "access", A), (22, "pipe", A), (23, "select", A), (24, "sched_yield", A),
    (25, "mremap", A), (26, "msync", A), (27, "mincore", A), (28, "madvise", A),
    (29, "shmget", A), (30, "shmat", A), (31, "shmctl", A), (32, "dup", A), (33, "dup2", A),
    (34, "pause", A), (35, "nanosleep", A), (36, "getitimer", A), (37, "alarm", A),
    (38, "setitimer", A), (39, "getpid", A), (40, "sendfile", A), (41, "socket", Rule::Socket),
    (42, "connect", A), (43, "accept", A), (44, "sendto", A), (45, "recvfrom", A),
    (46, "sendmsg", A), (47, "recvmsg", A), (48, "shutdown", A), (49, "bind", A),
    (50, "listen", A), (51, "getsockname", A), (52, "getpeername", A), (53, "socketpair", Rule::Socket),
    (54, "setsockopt", A), (55, "getsockopt", A), (56, "clone", Rule::Clone), (57, "fork", A),
    (58, "vfork", A), (59, "execve", A), (60, "exit", A), (61, "wait4", A), (62, "kill", A),
    (63, "uname", A), (64, "semget", A), (65, "semop", A), (66, "semctl", A), (67, "shmdt", A),
    (68, "msgget", A), (69, "msgsnd", A), (70, "msgrcv", A), (71, "msgctl", A),
    (72, "fcntl", A), (73, "flock", A), (74, "fsync", A), (75, "fdatasync", A),
    (76, "truncate", A), (77, "ftruncate", A), (78, "getdents", A), (79, "getcwd", A),
    (80, "chdir", A), (81, "fchdir", A), (82, "rename", A), (83, "mkdir", A), (84, "rmdir", A),
    (85, "creat", A), (86, "link", A), (87, "unlink", A), (88, "symlink", A),
    (89, "readlink", A), (90, "chmod", A), (91, "fchmod", A), (92, "chown", A),
    (93, "fchown", A), (94, "lchown", A), (95, "umask", A), (96, "gettimeofday", A),
    (97, "getrlimit", A), (98, "getrusage", A), (99, "sysinfo", A), (100, "times", A),
    (101, "ptrace", K), (102, "getuid", A), (103, "syslog", K), (104, "getgid", A),
    (105, "setuid", A), (106, "setgid", A), (107, "geteuid", A), (108, "getegid", A),
    (109, "setpgid", A), (110, "getppid", A), (111, "getpgrp", A), (112, "setsid", A),
    (113, "setreuid", A), (114, "setregid", A), (115, "getgroups", A), (116, "setgroups", A),
    (117, "setresuid", A), (118, "getresuid", A), (119, "setresgid", A), (120, "getresgid", A),
    (121, "getpgid", A), (122, "setfsuid", A), (123, "setfsgid", A), (124, "getsid", A),
    (125, "capget", A), (126, "capset", A), (127, "rt_sigpending", A),
    (128, "rt_sigtimedwait", A), (129, "rt_sigqueueinfo", A), (130, "rt_sigsuspend", A),
    (131, "sigaltstack", A), (132, "utime", A), (133, "mknod", MKNOD), (134, "uselib", K),
    (135, "personality", Rule::Personality), (136, "ustat", NOSYS), (137, "statfs", A),
    (138, "fstatfs", A), (139, "sysfs", NOSYS), (140, "getpriority", A),
    (141, "setpriority", A), (142, "sched_setparam", A), (143, "sched_getparam", A),
    (144, "sched_setscheduler", A), (145, "sched_getscheduler", A),
    (146, "sched_get_priority_max", A), (147, "sched_get_priority_min", A),
    (148, "sched_rr_get_interval", A), (149, "mlock", A), (150, "munlock", A),
    (151, "mlockall", A), (152, "munlockall", A), (153, "vhangup", K), (154, "modify_ldt", EPERM),
    (155, "pivot_root", K), (156, "_sysctl", K), (157, "prctl", A), (158, "arch_prctl", A),
    (159, "adjtimex", EPERM), (160, "setrlimit", A), (161, "chroot", EPERM), (162, "sync", A),
    (163, "acct", K), (164, "settimeofday", K), (165, "mount", K), (166, "umount2", K),
    (167, "swapon", K), (168, "swapoff", K), (169, "reboot", K), (170, "sethostname", EPERM),
    (171, "setdomainname", EPERM), (172, "iopl", K), (173, "ioperm", K),
    (174, "create_module", K), (175, "init_module", K), (176, "delete_module", K),
    (177, "get_kernel_syms", K), (178, "query_module", K), (179, "quotactl", K),
    (180, "nfsservctl", K), (181, "getpmsg", NOSYS), (182, "putpmsg", NOSYS),
    (183, "afs_syscall", NOSYS), (184, "tuxcall", NOSYS), (185, "security", NOSYS),
    (186, "gettid", A), (187, "readahead", A), (188, "setxattr", A), (189, "lsetxattr", A),
    (190, "fsetxattr", A), (191, "getxattr", A), (192, "lgetxattr", A), (193, "fgetxattr", A),
    (194, "listxattr", A), (195, "llistxattr", A), (196, "flistxattr", A),
    (197, "removexattr", A), (198, "lremovexattr", A), (199, "fremovexattr", A),
    (200, "tkill", A), (201, "time", A), (202, "futex", A), (203, "sched_setaffinity", A),
    (204, "sched_getaffinity", A), (205, "set_thread_area", NOSYS), (206, "io_setup", A),
    (207, "io_destroy", A), (208, "io_getevents", A), (209, "io_submit", A),
    (210, "io_cancel", A), (211, "get_thread_area", NOSYS), (212, "lookup_dcookie", K),
    (213, "epoll_create", A), (214, "epoll_ctl_old", NOSYS), (215, "epoll_wait_old", NOSYS),
    (216, "remap_file_pages", A), (217, "getdents64", A), (218, "set_tid_address", A),
    (219, "restart_syscall", A), (220, "semtimedop", A), (221, "fadvise64", A),
    (222, "timer_create", A), (223, "timer_settime", A), (224, "timer_gettime", A),
    (225, "timer_getoverrun", A), (226, "timer_delete", A), (227, "clock_settime", K),
    (228, "clock_gettime", A), (229, "clock_getres", A), (230, "clock_nanosleep", A),
    (231, "exit_group", A), (232, "epoll_wait", A), (233, "epoll_ctl", A), (234, "tgkill", A),
    (235, "utimes", A), (236, "vserver", NOSYS), (237, "mbind", A), (238, "set_mempolicy", A),
    (239, "get_mempolicy", A), (240, "mq_open", A), (241, "mq_unlink", A),
    (242, "mq_timedsend", A), (243, "mq_timedreceive", A), (244, "mq_notify", A),
    (245, "mq_getsetattr", A), (246, "kexec_load", K), (247, "waitid", A), (248, "add_key", K),
    (249, "request_key", K), (250, "keyctl", K), (251, "ioprio_set", A), (252, "ioprio_get", A),
    (253, "inotify_init", A), (254, "inotify_add_watch", A), (255, "inotify_rm_watch", A),
    (256, "migrate_pages", EPERM), (257, "openat", A), (258, "mkdirat", A), (259, "mknodat", MKNODAT),
    (260, "fchownat", A), (261, "futimesat", A), (262, "newfstatat", A), (263, "unlinkat", A),
    (264, "renameat", A), (265, "linkat", A), (266, "symlinkat", A), (267, "readlinkat", A),
    (268, "fchmodat", A), (269, "faccessat", A), (270, "pselect6", A), (271, "ppoll", A),
    (272, "unshare", K), (273, "set_robust_list", A), (274, "get_robust_list", A),
    (275, "splice", A), (276, "tee", A), (277, "sync_file_range", A), (278, "vmsplice", A),
    (279, "move_pages", EPERM), (280, "utimensat", A), (281, "epoll_pwait", A),
    (282, "signalfd", A), (283, "timerfd_create", A), (284, "eventfd", A), (285, "fallocate", A),
    (286, "timerfd_settime", A), (287, "timerfd_gettime", A), (288, "accept4", A),
    (289, "signalfd4", A), (290, "eventfd2", A), (291, "epoll_create1", A), (292, "dup3", A),
    (293, "pipe2", A), (294, "inotify_init1", A), (295, "preadv", A), (296, "pwritev", A),
    (297, "rt_tgsigqueueinfo", A), (298, "perf_event_open", K), (299, "recvmmsg", A),
    (300, "fanotify_init", EPERM), (301, "fanotify_mark", EPERM), (302, "prlimit64", A),
    (303, "name_to_handle_at", EPERM), (304, "open_by_handle_at", K),
    (305, "clock_adjtime", EPERM), (306, "syncfs", A), (307, "sendmmsg", A), (308, "setns", K),
    (309, "getcpu", A), (310, "process_vm_readv", K), (311, "process_vm_writev", K),
    (312, "kcmp", K), (313, "finit_module", K), (314, "sched_setattr", A),
    (315, "sched_getattr", A), (316, "renameat2", A), (317, "seccomp", A), (318, "getrandom", A),
    (319, "memfd_create", A), (320, "kexec_file_load", K), (321, "bpf", K), (322, "execveat", A),
    (323, "userfaultfd", K), (324, "membarrier", A), (325, "mlock2", A),
    (326, "copy_file_range", A), (327, "preadv2", A), (328, "pwritev2", A),
    (329, "pkey_mprotect", A), (330, "pkey_alloc", A), (331, "pkey_free", A), (332, "statx", A),
    (333, "io_pgetevents", A), (334, "rseq", A),
    // The kernel passes these through seccomp unfiltered (since 6.13/6.18); they act only when
    // called from a uprobe trampoline and otherwise raise SIGILL / fail with ENXIO.
    (335, "uretprobe", A), (336, "uprobe", A),
    (424, "pidfd_send_signal", A),
    // io_uring fails with ENOSYS rather than killing: libuv (node) probes io_uring_setup and
    // falls back to its thread pool on any error.
    (425, "io_uring_setup", NOSYS), (426, "io_uring_enter", NOSYS),
    (427, "io_uring_register", NOSYS), (428, "open_tree", K), (429, "move_mount", K),
    (430, "fsopen", K), (431, "fsconfig", K), (432, "fsmount", K), (433, "fspick", K),
    // clone3's flags live in memory BPF cannot read: ENOSYS makes glibc fall back to clone.
    (434, "pidfd_open", A), (435, "clone3", NOSYS), (436, "close_range", A), (437, "openat2", A),
    (438, "pidfd_getfd", K), (439, "faccessat2", A), (440, "process_madvise", EPERM),
    (441, "epoll_pwait2", A), (442, "mount_setattr", K), (443, "quotactl_fd", K),
    (444, "landlock_create_ruleset", A), (445, "landlock_add_rule", A),
    (446, "landlock_restrict_self", A), (447, "memfd_secret", NOSYS),
    (448, "process_mrelease", NOSYS), (449, "futex_waitv", A),
    (450, "set_mempolicy_home_node", A), (451, "cachestat", A), (452, "fchmodat2", A),
    (453, "map_shadow_stack", A), (454, "futex_wake", A), (455, "futex_wait", A),
    (456, "futex_requeue", A), (457, "statmount", NOSYS), (458, "listmount", NOSYS),
    (459, "lsm_get_self_attr", NOSYS), (460, "lsm_set_self_attr", NOSYS),
    (461, "lsm_list_modules", NOSYS), (462, "mseal", A), (463, "setxattrat", A),
    (464, "getxattrat", A), (465, "listxattrat", A), (466, "removexattrat", A),
    (467, "open_tree_attr", K), (468, "file_getattr", A), (469, "file_setattr", A),
];

fn lookup(nr: u32) -> Option<(&'static str, Rule)> {
    TABLE
        .binary_search_by_key(&nr, |e| e.0)
        .ok()
        .map(|i| (TABLE[i].1, TABLE[i].2))
}

/// The table's action for syscall `nr` (x86_64 numbering, without the x32 bit).
///
/// Argument-filtered calls report what a call with all-zero arguments gets: `clone`, `ioctl`
/// and `mknod`/`mknodat` (mode 0 is a regular file) are [`Action::Allow`], `personality` is
/// `Errno(EPERM)`, `socket`/`socketpair` `Errno(EAFNOSUPPORT)`. Numbers with the x32 bit set are
/// [`Action::Kill`]; numbers the table does not name are `Errno(ENOSYS)`.
pub fn policy_action(nr: u32) -> Action {
    if nr >= X32_SYSCALL_BIT {
        return Action::Kill;
    }
    match lookup(nr).map(|(_, r)| r) {
        Some(Rule::Plain(a)) => a,
        Some(Rule::Clone | Rule::Ioctl | Rule::Mknod { .. }) => Action::Allow,
        Some(Rule::Personality) => Action::Errno(libc::EPERM as u16),
        // Family 0 is `AF_UNSPEC`, not on the list.
        Some(Rule::Socket) => Action::Errno(EAFNOSUPPORT),
        None => Action::Errno(DEFAULT_ERRNO),
    }
}

/// True for the calls whose outcome depends on their arguments (`clone`, `ioctl`,
/// `personality`, `socket`, `socketpair`, `mknod`, `mknodat`); [`policy_action`] describes them
/// with all-zero arguments.
pub fn is_arg_filtered(nr: u32) -> bool {
    matches!(lookup(nr), Some((_, rule)) if !matches!(rule, Rule::Plain(_)))
}

/// The x86_64 name of syscall `nr`, if the table knows it.
pub fn syscall_name(nr: u32) -> Option<&'static str> {
    lookup(nr).map(|(n, _)| n)
}

/// The highest syscall number the table names.
pub fn max_known_nr() -> u32 {
    TABLE.last().map_or(0, |e| e.0)
}

fn errno_name(e: u16) -> String {
    match i32::from(e) {
        libc::EPERM => "EPERM".to_owned(),
        libc::ENOSYS => "ENOSYS".to_owned(),
        libc::EAFNOSUPPORT => "EAFNOSUPPORT".to_owned(),
        other => format!("errno {other}"),
    }
}

/// The policy as a Markdown table (`| nr | name | action |`), one row per named syscall.
pub fn render_table() -> String {
    let mut out = String::from("| nr | name | action |\n|---:|---|---|\n");
    for &(nr, name, rule) in TABLE {
        let action = match rule {
            Rule::Plain(Action::Allow) => "allow".to_owned(),
            Rule::Plain(Action::Kill) => "kill process (SIGSYS)".to_owned(),
            Rule::Plain(Action::Errno(e)) => errno_name(e),
            Rule::Clone => "allow; kill process if flags contain CLONE_NEW*".to_owned(),
            Rule::Ioctl => "allow; EPERM for TIOCSTI and TIOCLINUX".to_owned(),
            Rule::Personality => "allow the query 0xffffffff; EPERM otherwise".to_owned(),
            Rule::Socket => {
                "allow AF_UNIX, AF_INET, AF_INET6, AF_NETLINK with NETLINK_ROUTE; EAFNOSUPPORT otherwise"
                    .to_owned()
            }
            Rule::Mknod { .. } => "allow; EPERM for S_IFCHR and S_IFBLK modes".to_owned(),
        };
        out.push_str(&format!("| {nr} | {name} | {action} |\n"));
    }
    out.push_str(&format!(
        "| other | (unlisted x86_64 numbers) | {} |\n| any | i386 ABI, x32 ABI | kill process (SIGSYS) |\n",
        errno_name(DEFAULT_ERRNO)
    ));
    out
}

/// Errors of installing the filter.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    /// `prctl(PR_SET_NO_NEW_PRIVS, 1)` failed.
    #[error("set no_new_privs")]
    NoNewPrivs(#[source] io::Error),
    /// `seccomp(SECCOMP_SET_MODE_FILTER)` failed.
    #[error("install seccomp filter of {len} instructions")]
    Install {
        /// Program length.
        len: usize,
        /// Cause.
        #[source]
        source: io::Error,
    },
}

// Classic BPF opcodes (linux/filter.h, linux/bpf_common.h).
const BPF_LD_W_ABS: u16 = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16;
const BPF_JEQ_K: u16 = (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16;
const BPF_JGE_K: u16 = (libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K) as u16;
const BPF_JSET_K: u16 = (libc::BPF_JMP | libc::BPF_JSET | libc::BPF_K) as u16;
const BPF_RET_K: u16 = (libc::BPF_RET | libc::BPF_K) as u16;
const BPF_AND_K: u16 = (libc::BPF_ALU | libc::BPF_AND | libc::BPF_K) as u16;

// struct seccomp_data { int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6]; }
const OFF_NR: u32 = 0;
const OFF_ARCH: u32 = 4;
/// Offset of the low 32 bits of argument `i` (little endian).
const fn off_arg_lo(i: u32) -> u32 {
    16 + 8 * i
}

const RET_KILL: u32 = libc::SECCOMP_RET_KILL_PROCESS;
const RET_ALLOW: u32 = libc::SECCOMP_RET_ALLOW;
const fn ret_errno(e: u16) -> u32 {
    libc::SECCOMP_RET_ERRNO | e as u32
}
fn ret_of(a: Action) -> u32 {
    match a {
        Action::Allow => RET_ALLOW,
        Action::Errno(e) => ret_errno(e),
        Action::Kill => RET_KILL,
    }
}

/// Kernel limit on a classic BPF program's length.
const BPF_MAXINSNS: usize = 4096;

const fn stmt(code: u16, k: u32) -> libc::sock_filter {
    libc::sock_filter {
        code,
        jt: 0,
        jf: 0,
        k,
    }
}
const fn jump(code: u16, k: u32, jt: u8, jf: u8) -> libc::sock_filter {
    libc::sock_filter { code, jt, jf, k }
}

/// Code of one leaf of the search tree; it ends in `RET` on every path.
fn leaf(rule: Rule) -> Vec<libc::sock_filter> {
    match rule {
        Rule::Plain(a) => vec![stmt(BPF_RET_K, ret_of(a))],
        Rule::Clone => vec![
            stmt(BPF_LD_W_ABS, off_arg_lo(0)),
            jump(BPF_JSET_K, CLONE_NEW_MASK, 0, 1),
            stmt(BPF_RET_K, RET_KILL),
            stmt(BPF_RET_K, RET_ALLOW),
        ],
        Rule::Ioctl => vec![
            // The kernel truncates the request to `unsigned int`: compare the low 32 bits only.
            stmt(BPF_LD_W_ABS, off_arg_lo(1)),
            jump(BPF_JEQ_K, TIOCSTI, 2, 0),
            jump(BPF_JEQ_K, TIOCLINUX, 1, 0),
            stmt(BPF_RET_K, RET_ALLOW),
            stmt(BPF_RET_K, ret_errno(libc::EPERM as u16)),
        ],
        Rule::Personality => vec![
            stmt(BPF_LD_W_ABS, off_arg_lo(0)),
            jump(BPF_JEQ_K, PERSONALITY_QUERY, 0, 1),
            stmt(BPF_RET_K, RET_ALLOW),
            stmt(BPF_RET_K, ret_errno(libc::EPERM as u16)),
        ],
        // The kernel reads the family and the protocol as `int`: the low 32 bits.
        Rule::Socket => vec![
            stmt(BPF_LD_W_ABS, off_arg_lo(0)),
            jump(BPF_JEQ_K, SOCKET_FAMILIES[0], 4, 0),
            jump(BPF_JEQ_K, SOCKET_FAMILIES[1], 3, 0),
            jump(BPF_JEQ_K, SOCKET_FAMILIES[2], 2, 0),
            jump(BPF_JEQ_K, AF_NETLINK, 2, 0),
            stmt(BPF_RET_K, ret_errno(EAFNOSUPPORT)),
            stmt(BPF_RET_K, RET_ALLOW),
            stmt(BPF_LD_W_ABS, off_arg_lo(2)),
            jump(BPF_JEQ_K, NETLINK_ROUTE, 0, 1),
            stmt(BPF_RET_K, RET_ALLOW),
            stmt(BPF_RET_K, ret_errno(EAFNOSUPPORT)),
        ],
        // The kernel reads the mode as `umode_t`: the file type is in the low 16 bits.
        Rule::Mknod { mode_arg } => vec![
            stmt(BPF_LD_W_ABS, off_arg_lo(mode_arg)),
            stmt(BPF_AND_K, S_IFMT),
            jump(BPF_JEQ_K, S_IFCHR, 2, 0),
            jump(BPF_JEQ_K, S_IFBLK, 1, 0),
            stmt(BPF_RET_K, RET_ALLOW),
            stmt(BPF_RET_K, ret_errno(libc::EPERM as u16)),
        ],
    }
}

/// Binary search over `segs` (sorted range starts; the accumulator holds `nr`). Laid out in
/// pre-order: `JGE start(right)` falls through into the left half and jumps over it to the right.
fn tree(segs: &[(u32, Rule)]) -> Vec<libc::sock_filter> {
    if let [(_, rule)] = segs {
        return leaf(*rule);
    }
    let mid = segs.len() / 2;
    let left = tree(&segs[..mid]);
    let right = tree(&segs[mid..]);
    let skip = u8::try_from(left.len())
        .expect("invariant: the policy table is small enough for 8-bit BPF jump offsets");
    let mut out = Vec::with_capacity(1 + left.len() + right.len());
    out.push(jump(BPF_JGE_K, segs[mid].0, skip, 0));
    out.extend(left);
    out.extend(right);
    out
}

/// The table as ranges `(first nr, rule)` covering `0..X32_SYSCALL_BIT`; adjacent equal plain
/// rules are merged.
fn segments() -> Vec<(u32, Rule)> {
    let mut segs: Vec<(u32, Rule)> = Vec::new();
    let mut push = |start: u32, rule: Rule| match segs.last() {
        Some(&(_, last)) if last == rule && matches!(rule, Rule::Plain(_)) => {}
        _ => segs.push((start, rule)),
    };
    let mut next = 0u32;
    for &(nr, _, rule) in TABLE {
        if nr > next {
            push(next, NOSYS);
        }
        push(nr, rule);
        next = nr + 1;
    }
    push(next, NOSYS);
    segs
}

/// A compiled seccomp-BPF program implementing the policy.
#[derive(Debug, Clone)]
pub struct Filter(Vec<libc::sock_filter>);

impl Filter {
    /// Compiles the policy. Allocates: call it before fork/clone.
    pub fn build() -> Filter {
        let mut prog = vec![
            stmt(BPF_LD_W_ABS, OFF_ARCH),
            jump(BPF_JEQ_K, AUDIT_ARCH_X86_64, 1, 0),
            stmt(BPF_RET_K, RET_KILL),
            stmt(BPF_LD_W_ABS, OFF_NR),
            jump(BPF_JGE_K, X32_SYSCALL_BIT, 0, 1),
            stmt(BPF_RET_K, RET_KILL),
        ];
        prog.extend(tree(&segments()));
        assert!(
            prog.len() <= BPF_MAXINSNS,
            "invariant: the policy fits a BPF program"
        );
        Filter(prog)
    }

    /// Number of BPF instructions.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Always false: a built filter has instructions.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The instructions.
    pub fn instructions(&self) -> &[libc::sock_filter] {
        &self.0
    }

    /// Sets `no_new_privs` and installs the filter on the calling thread (flags 0: meant for a
    /// single-threaded child right before exec). Does not allocate and is async-signal-safe.
    pub fn install(&self) -> Result<(), SeccompError> {
        // SAFETY: PR_SET_NO_NEW_PRIVS takes integer arguments only and touches no memory.
        let rc = unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1 as libc::c_ulong, 0, 0, 0) };
        if rc != 0 {
            return Err(SeccompError::NoNewPrivs(io::Error::last_os_error()));
        }
        let prog = libc::sock_fprog {
            // `build` guarantees len <= BPF_MAXINSNS (4096), which fits u16.
            len: self.0.len() as u16,
            filter: self.0.as_ptr().cast_mut(),
        };
        // SAFETY: `prog` points at `self.0`, a live array of `prog.len` initialised sock_filter
        // entries that outlives the call; the kernel only reads (copies) it.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_seccomp,
                libc::SECCOMP_SET_MODE_FILTER,
                0 as libc::c_uint,
                &prog as *const libc::sock_fprog,
            )
        };
        if rc != 0 {
            return Err(SeccompError::Install {
                len: self.0.len(),
                source: io::Error::last_os_error(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A classic-BPF interpreter for the subset the generator emits.
    fn run(prog: &[libc::sock_filter], arch: u32, nr: u32, args: [u64; 6]) -> u32 {
        let mut data = [0u8; 64];
        data[0..4].copy_from_slice(&nr.to_le_bytes());
        data[4..8].copy_from_slice(&arch.to_le_bytes());
        for (i, a) in args.iter().enumerate() {
            data[16 + 8 * i..24 + 8 * i].copy_from_slice(&a.to_le_bytes());
        }
        let mut acc = 0u32;
        let mut pc = 0usize;
        loop {
            let ins = prog[pc];
            pc += 1;
            match ins.code {
                BPF_LD_W_ABS => {
                    let o = ins.k as usize;
                    acc = u32::from_le_bytes(data[o..o + 4].try_into().expect("4 bytes"));
                }
                BPF_RET_K => return ins.k,
                BPF_AND_K => acc &= ins.k,
                BPF_JEQ_K | BPF_JGE_K | BPF_JSET_K => {
                    let t = match ins.code {
                        BPF_JEQ_K => acc == ins.k,
                        BPF_JGE_K => acc >= ins.k,
                        _ => acc & ins.k != 0,
                    };
                    pc += usize::from(if t { ins.jt } else { ins.jf });
                }
                other => panic!("unexpected opcode {other:#x}"),
            }
        }
    }

    #[test]
    fn program_matches_table_for_every_number() {
        let f = Filter::build();
        assert!(f.len() < 600, "program is {} instructions", f.len());
        for nr in (0..=1024).chain([X32_SYSCALL_BIT - 1, u32::MAX >> 2]) {
            let got = run(f.instructions(), AUDIT_ARCH_X86_64, nr, [0; 6]);
            assert_eq!(
                got,
                ret_of(policy_action(nr)),
                "nr {nr} ({:?})",
                syscall_name(nr)
            );
        }
        for nr in [0, 39, 101, X32_SYSCALL_BIT | 39, u32::MAX] {
            let want = if nr >= X32_SYSCALL_BIT {
                RET_KILL
            } else {
                ret_of(policy_action(nr))
            };
            assert_eq!(run(f.instructions(), AUDIT_ARCH_X86_64, nr, [0; 6]), want);
            assert_eq!(
                run(f.instructions(), 0x4000_0003, nr, [0; 6]),
                RET_KILL,
                "i386"
            );
        }
    }

    #[test]
    fn argument_filters() {
        let f = Filter::build();
        let p = f.instructions();
        let x = AUDIT_ARCH_X86_64;
        let sigchld = libc::SIGCHLD as u64;
        let thread = (libc::CLONE_VM | libc::CLONE_THREAD | libc::CLONE_SIGHAND) as u64;
        assert_eq!(run(p, x, 56, [sigchld, 0, 0, 0, 0, 0]), RET_ALLOW);
        assert_eq!(run(p, x, 56, [thread, 0, 0, 0, 0, 0]), RET_ALLOW);
        for flag in [
            libc::CLONE_NEWNS,
            libc::CLONE_NEWUTS,
            libc::CLONE_NEWIPC,
            libc::CLONE_NEWUSER,
            libc::CLONE_NEWPID,
            libc::CLONE_NEWNET,
            libc::CLONE_NEWCGROUP,
            libc::CLONE_NEWTIME,
        ] {
            assert_eq!(
                run(p, x, 56, [sigchld | flag as u64, 0, 0, 0, 0, 0]),
                RET_KILL
            );
        }
        let eperm = ret_errno(libc::EPERM as u16);
        assert_eq!(run(p, x, 16, [0, u64::from(TIOCSTI), 0, 0, 0, 0]), eperm);
        assert_eq!(run(p, x, 16, [0, u64::from(TIOCLINUX), 0, 0, 0, 0]), eperm);
        // The kernel ignores the high half of the request; so does the filter.
        assert_eq!(
            run(p, x, 16, [0, (1 << 32) | u64::from(TIOCSTI), 0, 0, 0, 0]),
            eperm
        );
        assert_eq!(run(p, x, 16, [0, libc::TCGETS, 0, 0, 0, 0]), RET_ALLOW);
        assert_eq!(run(p, x, 135, [0xffff_ffff, 0, 0, 0, 0, 0]), RET_ALLOW);
        assert_eq!(run(p, x, 135, [8, 0, 0, 0, 0, 0]), eperm);
    }

    #[test]
    fn socket_families_are_a_closed_list() {
        let f = Filter::build();
        let p = f.instructions();
        let x = AUDIT_ARCH_X86_64;
        let refused = ret_errno(EAFNOSUPPORT);
        let stream = libc::SOCK_STREAM as u64 | libc::SOCK_CLOEXEC as u64;
        let (unix, inet, inet6) = (libc::AF_UNIX, libc::AF_INET, libc::AF_INET6);
        let netlink = libc::AF_NETLINK as u64;
        for nr in [41, 53] {
            for family in [unix, inet, inet6] {
                assert_eq!(
                    run(p, x, nr, [family as u64, stream, 0, 0, 0, 0]),
                    RET_ALLOW
                );
            }
            let route = [netlink, libc::SOCK_RAW as u64, 0, 0, 0, 0];
            assert_eq!(run(p, x, nr, route), RET_ALLOW);
            for protocol in [libc::NETLINK_AUDIT, libc::NETLINK_KOBJECT_UEVENT, 1 << 16] {
                let args = [netlink, libc::SOCK_RAW as u64, protocol as u64, 0, 0, 0];
                assert_eq!(run(p, x, nr, args), refused, "netlink protocol {protocol}");
            }
            for family in [
                libc::AF_UNSPEC,
                libc::AF_VSOCK,
                libc::AF_PACKET,
                libc::AF_ALG,
                libc::AF_KEY,
                libc::AF_BLUETOOTH,
                libc::AF_XDP,
                libc::AF_TIPC,
                libc::AF_RDS,
                libc::AF_CAN,
                46, // AF_MAX, no family yet
            ] {
                let args = [family as u64, stream, 0, 0, 0, 0];
                assert_eq!(run(p, x, nr, args), refused, "family {family}");
            }
            // The kernel reads the family as an int; a set high half changes nothing.
            let high = (1u64 << 32) | unix as u64;
            assert_eq!(run(p, x, nr, [high, stream, 0, 0, 0, 0]), RET_ALLOW);
            let high = (1u64 << 32) | libc::AF_VSOCK as u64;
            assert_eq!(run(p, x, nr, [high, stream, 0, 0, 0, 0]), refused);
        }
        assert!(is_arg_filtered(41) && is_arg_filtered(53));
        assert_eq!(policy_action(41), Action::Errno(EAFNOSUPPORT));
    }

    #[test]
    fn mknod_of_device_nodes_is_refused() {
        let f = Filter::build();
        let p = f.instructions();
        let x = AUDIT_ARCH_X86_64;
        let eperm = ret_errno(libc::EPERM as u16);
        let mem = libc::makedev(1, 1);
        // mknod(path, mode, dev), mknodat(dirfd, path, mode, dev).
        let mknod = |mode: u32| run(p, x, 133, [0, u64::from(mode), mem, 0, 0, 0]);
        let at = |mode: u32| {
            let dirfd = libc::AT_FDCWD as u64;
            run(p, x, 259, [dirfd, 0, u64::from(mode), mem, 0, 0])
        };
        for call in [&mknod as &dyn Fn(u32) -> u32, &at] {
            for kind in [libc::S_IFCHR, libc::S_IFBLK] {
                assert_eq!(call(kind | 0o666), eperm, "{kind:o}");
                // Whiteouts (0:0 character devices) too; bits above the 16-bit mode count not.
                assert_eq!(call(kind), eperm, "{kind:o}");
                assert_eq!(call((1 << 16) | kind | 0o600), eperm, "{kind:o}");
            }
            for kind in [libc::S_IFIFO, libc::S_IFSOCK, libc::S_IFREG, 0] {
                assert_eq!(call(kind | 0o644), RET_ALLOW, "{kind:o}");
            }
            // S_IFCHR | S_IFDIR is S_IFBLK; S_IFCHR | S_IFIFO is no device (the kernel: EINVAL).
            assert_eq!(call(libc::S_IFCHR | libc::S_IFDIR), eperm);
            assert_eq!(call(libc::S_IFCHR | libc::S_IFIFO), RET_ALLOW);
        }
        // The mode argument of the other call is not looked at.
        assert_eq!(
            run(p, x, 133, [0, 0, u64::from(libc::S_IFCHR), 0, 0, 0]),
            RET_ALLOW
        );
        assert_eq!(
            run(p, x, 259, [0, u64::from(libc::S_IFCHR), 0, 0, 0, 0]),
            RET_ALLOW
        );
        assert!(is_arg_filtered(133) && is_arg_filtered(259));
        assert_eq!(policy_action(133), Action::Allow);
        assert!(render_table()
            .contains("| 259 | mknodat | allow; EPERM for S_IFCHR and S_IFBLK modes |"));
    }

    #[test]
    fn table_is_sorted_and_covers_the_must_deny_list() {
        assert!(TABLE.windows(2).all(|w| w[0].0 < w[1].0));
        for name in [
            "ptrace",
            "process_vm_readv",
            "process_vm_writev",
            "kcmp",
            "pidfd_getfd",
            "mount",
            "umount2",
            "pivot_root",
            "move_mount",
            "open_tree",
            "fsopen",
            "fsconfig",
            "fsmount",
            "fspick",
            "mount_setattr",
            "unshare",
            "setns",
            "keyctl",
            "bpf",
            "userfaultfd",
            "perf_event_open",
            "kexec_load",
            "kexec_file_load",
            "init_module",
            "finit_module",
            "delete_module",
            "open_by_handle_at",
            "reboot",
            "settimeofday",
        ] {
            let (nr, _, _) = TABLE.iter().find(|e| e.1 == name).expect("listed");
            assert_eq!(policy_action(*nr), Action::Kill, "{name}");
        }
        for name in [
            "clone3",
            "io_uring_setup",
            "io_uring_enter",
            "io_uring_register",
        ] {
            let (nr, _, _) = TABLE.iter().find(|e| e.1 == name).expect("listed");
            assert_eq!(policy_action(*nr), Action::Errno(DEFAULT_ERRNO), "{name}");
        }
        assert_eq!(policy_action(135), Action::Errno(libc::EPERM as u16));
        assert_eq!(policy_action(400), Action::Errno(DEFAULT_ERRNO));
        assert!(render_table().contains("| 101 | ptrace | kill process (SIGSYS) |"));
    }
}
