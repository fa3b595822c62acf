//! Descriptor passing, socket pairs, pidfds and small process-control calls used by the node, the
//! spawner and the per-sandbox supervisors.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

/// Most descriptors passed in one message.
pub const MAX_FDS: usize = 4;

fn cvt(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// A connected `SOCK_SEQPACKET` pair (message boundaries preserved), close-on-exec.
pub fn seqpacket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    socket_pair(libc::SOCK_SEQPACKET)
}

/// A connected `SOCK_STREAM` pair, close-on-exec.
pub fn stream_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    socket_pair(libc::SOCK_STREAM)
}

fn socket_pair(ty: libc::c_int) -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: `fds` is a valid two-int array for socketpair to fill.
    cvt(unsafe { libc::socketpair(libc::AF_UNIX, ty | libc::SOCK_CLOEXEC, 0, fds.as_mut_ptr()) })?;
    // SAFETY: socketpair succeeded; both fds are fresh and exclusively ours.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Sends one message with up to [`MAX_FDS`] descriptors attached (`SCM_RIGHTS`).
pub fn send_with_fds(sock: BorrowedFd<'_>, data: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    if fds.len() > MAX_FDS {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    let mut cmsg_buf = [0u64; 8];
    // SAFETY: msghdr is plain data; zeroed is a valid starting value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        let payload = std::mem::size_of_val(fds) as u32;
        // SAFETY: CMSG_SPACE is a pure computation.
        let space = unsafe { libc::CMSG_SPACE(payload) } as usize;
        msg.msg_control = cmsg_buf.as_mut_ptr().cast();
        msg.msg_controllen = space;
        // SAFETY: msg_control points at a buffer of at least `space` bytes (64 bytes ≥ the space
        // for 4 fds), so the first header and its data fit.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(payload) as usize;
            let dst = libc::CMSG_DATA(cmsg).cast::<RawFd>();
            for (i, fd) in fds.iter().enumerate() {
                std::ptr::write_unaligned(dst.add(i), fd.as_raw_fd());
            }
        }
    }
    loop {
        // SAFETY: msg references live buffers for the duration of the call.
        let rc = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if rc >= 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Receives one message into `buf`; returns its length (0 on end of stream) and any descriptors
/// attached (received close-on-exec).
pub fn recv_with_fds(sock: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut cmsg_buf = [0u64; 8];
    // SAFETY: msghdr is plain data; zeroed is a valid starting value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cmsg_buf.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&cmsg_buf);
    let n = loop {
        // SAFETY: msg references live buffers for the duration of the call.
        let rc = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if rc >= 0 {
            break rc as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    let mut fds = Vec::new();
    // SAFETY: walking the control messages the kernel wrote into cmsg_buf; each SCM_RIGHTS
    // payload holds `(len - CMSG_LEN(0)) / 4` valid, newly installed descriptors that we now own.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let count =
                    ((*cmsg).cmsg_len - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<RawFd>();
                let src = libc::CMSG_DATA(cmsg).cast::<RawFd>();
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(src.add(i))));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(io::Error::other("control message truncated"));
    }
    Ok((n, fds))
}

/// Receives one message of at most `max` bytes into a buffer of exactly its size (plus any
/// descriptors). The length is peeked first (`MSG_PEEK | MSG_TRUNC` returns a seqpacket or
/// datagram message's real length), so a long-lived process never keeps — or zeroes — a
/// `max`-sized buffer: thousands of idle supervisors each save that many dirty heap pages.
/// A message longer than `max` is consumed and answered with `InvalidData`. End of stream is
/// an empty message, as with [`recv_with_fds`].
pub fn recv_msg(sock: BorrowedFd<'_>, max: usize) -> io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    let len = loop {
        // SAFETY: a zero-length peek writes nothing; the kernel only reports the length.
        let rc = unsafe {
            libc::recv(
                sock.as_raw_fd(),
                std::ptr::null_mut(),
                0,
                libc::MSG_PEEK | libc::MSG_TRUNC,
            )
        };
        if rc >= 0 {
            break rc as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    let mut buf = vec![0u8; len.min(max)];
    let (n, fds) = recv_with_fds(sock, &mut buf)?;
    if len > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("message of {len} bytes exceeds {max}"),
        ));
    }
    buf.truncate(n);
    Ok((buf, fds))
}

/// The credentials of the process at the other end of a connected Unix socket, as the kernel
/// recorded them (`SO_PEERCRED`): for a stream accepted from a listener, the process that
/// connected; for a stream connected to a listener, the process that called `listen`. The pid is
/// as this process's pid namespace sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCred {
    /// Process id.
    pub pid: i32,
    /// Effective uid at connect (or listen) time.
    pub uid: u32,
    /// Effective gid at connect (or listen) time.
    pub gid: u32,
}

impl PeerCred {
    /// True when the peer is this process's own effective uid and sits in this process's pid
    /// namespace: the node, a supervisor or the spawner, not a sandboxed process (another pid
    /// namespace, and in the user-namespace mode another uid).
    pub fn is_host_peer(&self) -> bool {
        let pid_ns = |pid: &str| std::fs::metadata(format!("/proc/{pid}/ns/pid")).ok();
        let same_ns = match (pid_ns("self"), pid_ns(&self.pid.to_string())) {
            (Some(a), Some(b)) => {
                use std::os::unix::fs::MetadataExt;
                (a.dev(), a.ino()) == (b.dev(), b.ino())
            }
            _ => false,
        };
        // SAFETY: geteuid has no arguments and cannot fail.
        let euid = unsafe { libc::geteuid() };
        self.pid > 0 && self.uid == euid && same_ns
    }
}

/// The credentials of `sock`'s peer (`SO_PEERCRED`).
pub fn peer_cred(sock: BorrowedFd<'_>) -> io::Result<PeerCred> {
    let mut c = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `c` and `len` are valid for writes of the sizes passed; the fd is borrowed.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut c as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    cvt(rc)?;
    Ok(PeerCred {
        pid: c.pid,
        uid: c.uid,
        gid: c.gid,
    })
}

/// A process file descriptor: signals go to exactly the process it was opened for.
#[derive(Debug)]
pub struct PidFd {
    fd: OwnedFd,
    pid: i32,
}

impl PidFd {
    /// Opens a pidfd for `pid`.
    pub fn open(pid: i32) -> io::Result<Self> {
        // SAFETY: integer-argument syscall.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) } as libc::c_int;
        cvt(fd)?;
        // SAFETY: pidfd_open returned a fresh fd we exclusively own.
        Ok(Self {
            // SAFETY: pidfd_open returned a fresh fd we exclusively own.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            pid,
        })
    }

    /// The pid it refers to.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Sends `signal`; `Ok(false)` when the process has already exited.
    pub fn signal(&self, signal: i32) -> io::Result<bool> {
        // SAFETY: integer and null-pointer arguments; the fd is a valid pidfd.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.fd.as_raw_fd(),
                signal,
                std::ptr::null::<u8>(),
                0,
            )
        };
        if rc == 0 {
            return Ok(true);
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ESRCH) {
            Ok(false)
        } else {
            Err(e)
        }
    }

    /// Waits until the process exits (the pidfd becomes readable) or `timeout` passes; returns
    /// whether it exited.
    pub fn wait_exit(&self, timeout: Duration) -> io::Result<bool> {
        poll_readable(self.fd.as_fd_borrowed(), timeout)
    }

    /// Reaps the process if it is an exited child of the caller (`waitid(P_PIDFD, WNOHANG)`):
    /// a child that exits stays a zombie in the process table until its parent waits for it,
    /// and polling the pidfd does not wait. Returns whether a zombie was collected; a process
    /// that is not the caller's child (adopted after a restart) or still runs is left alone.
    pub fn reap(&self) -> io::Result<bool> {
        // SAFETY: zeroed siginfo is a valid out-buffer for waitid.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        loop {
            // SAFETY: valid pidfd and out-pointer.
            let rc = unsafe {
                libc::waitid(
                    libc::P_PIDFD,
                    self.fd.as_raw_fd() as libc::id_t,
                    &mut info,
                    libc::WEXITED | libc::WNOHANG,
                )
            };
            if rc == 0 {
                // SAFETY: waitid filled `info`; si_pid is 0 when nothing was collected.
                return Ok(unsafe { info.si_pid() } != 0);
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::ECHILD) => return Ok(false),
                _ => return Err(e),
            }
        }
    }

    /// Kills the process (`SIGKILL`), waits up to `timeout` for it to exit and reaps it when it
    /// is the caller's child; returns whether it exited.
    pub fn kill_and_reap(&self, timeout: Duration) -> bool {
        let _ = self.signal(libc::SIGKILL);
        let exited = self.wait_exit(timeout).unwrap_or(false);
        let _ = self.reap();
        exited
    }

    /// Whether the process is still alive.
    pub fn is_alive(&self) -> bool {
        matches!(
            poll_readable(self.fd.as_fd_borrowed(), Duration::ZERO),
            Ok(false)
        )
    }

    /// The raw descriptor, for polling.
    pub fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd_borrowed()
    }
}

trait AsFdBorrowed {
    fn as_fd_borrowed(&self) -> BorrowedFd<'_>;
}

impl AsFdBorrowed for OwnedFd {
    fn as_fd_borrowed(&self) -> BorrowedFd<'_> {
        std::os::fd::AsFd::as_fd(self)
    }
}

/// Polls one descriptor for readability (or hang-up) for at most `timeout`.
pub fn poll_readable(fd: BorrowedFd<'_>, timeout: Duration) -> io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = timeout.as_millis().min(i32::MAX as u128) as libc::c_int;
    loop {
        // SAFETY: one valid pollfd.
        let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
        if rc >= 0 {
            return Ok(rc > 0);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Polls several descriptors for readability; returns the indices that are ready.
pub fn poll_many(fds: &[BorrowedFd<'_>], timeout: Option<Duration>) -> io::Result<Vec<usize>> {
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|f| libc::pollfd {
            fd: f.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let ms = timeout.map_or(-1, |t| t.as_millis().min(i32::MAX as u128) as libc::c_int);
    loop {
        // SAFETY: `pfds` is a valid array of `len` pollfds.
        let rc = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, ms) };
        if rc >= 0 {
            return Ok(pfds
                .iter()
                .enumerate()
                .filter(|(_, p)| p.revents != 0)
                .map(|(i, _)| i)
                .collect());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Starts a new session (detaches from the caller's controlling terminal and process group).
pub fn setsid() -> io::Result<()> {
    // SAFETY: no arguments.
    cvt(unsafe { libc::setsid() }).map(|_| ())
}

/// Sets the calling thread's name (shown by `ps`), truncated to 15 bytes.
pub fn set_process_name(name: &str) {
    let mut buf = [0u8; 16];
    let n = name.len().min(15);
    buf[..n].copy_from_slice(&name.as_bytes()[..n]);
    // SAFETY: buf is a NUL-terminated 16-byte buffer.
    unsafe { libc::prctl(libc::PR_SET_NAME, buf.as_ptr()) };
}

/// Makes the calling process a child subreaper (orphans are re-parented to it).
pub fn set_child_subreaper() -> io::Result<()> {
    // SAFETY: integer arguments.
    cvt(unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1 as libc::c_ulong) }).map(|_| ())
}

/// Sets `SIGCHLD` to be ignored, so exited children are reaped automatically.
pub fn ignore_sigchld() {
    // SAFETY: installing SIG_IGN is async-signal-safe and has no handler code.
    unsafe { libc::signal(libc::SIGCHLD, libc::SIG_IGN) };
}

/// Restores the default `SIGCHLD` disposition.
pub fn default_sigchld() {
    // SAFETY: installing SIG_DFL has no handler code.
    unsafe { libc::signal(libc::SIGCHLD, libc::SIG_DFL) };
}

/// Reaps any exited child without blocking; returns `(pid, raw wait status)`.
pub fn try_reap() -> Option<(i32, i32)> {
    let mut status = 0;
    // SAFETY: valid out-pointer.
    let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
    (pid > 0).then_some((pid, status))
}

/// Blocks until `pid` (our child) exits; returns its raw wait status.
pub fn wait_pid(pid: i32) -> io::Result<i32> {
    let mut status = 0;
    loop {
        // SAFETY: valid out-pointer.
        let rc = unsafe { libc::waitpid(pid, &mut status, 0) };
        if rc >= 0 {
            return Ok(status);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit; returns the new soft limit.
pub fn raise_nofile_limit() -> u64 {
    // SAFETY: valid out-pointer, then a valid in-pointer.
    unsafe {
        let mut lim: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return 0;
        }
        lim.rlim_cur = lim.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        lim.rlim_cur
    }
}

/// Exits the process immediately without running destructors or atexit handlers (for forked
/// children that must not tear down their parent's state).
pub fn exit_now(code: i32) -> ! {
    // SAFETY: _exit never returns and touches no process state we rely on.
    unsafe { libc::_exit(code) }
}

/// A close-on-exec pipe: `(read end, write end)`.
pub fn pipe_cloexec() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: `fds` is a valid array of two ints for pipe2 to fill.
    cvt(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) })?;
    // SAFETY: pipe2 succeeded, so both fds are open and owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Switches `pid` (0 = the caller) between `SCHED_IDLE` (runs only when a CPU has nothing else
/// to do) and the normal `SCHED_OTHER` policy. Children inherit the policy.
pub fn set_idle_priority(pid: i32, idle: bool) -> io::Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    let policy = if idle {
        libc::SCHED_IDLE
    } else {
        libc::SCHED_OTHER
    };
    // SAFETY: `param` is a valid sched_param on the stack.
    cvt(unsafe { libc::sched_setscheduler(pid, policy, &param) }).map(|_| ())
}

/// Keeps the process's heap small: one malloc arena for all threads (each extra arena costs
/// resident pages in every one of thousands of idle agents).
pub fn single_malloc_arena() {
    // SAFETY: mallopt only changes allocator tuning; called before other threads allocate.
    unsafe { libc::mallopt(libc::M_ARENA_MAX, 1) };
}

/// Returns free heap memory to the kernel.
pub fn trim_heap() {
    // SAFETY: malloc_trim walks the allocator's own free lists; no pointers are passed.
    unsafe { libc::malloc_trim(0) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn recv_msg_sizes_its_buffer_to_the_message() {
        let (a, b) = seqpacket_pair().expect("pair");
        let (p, _q) = pipe_cloexec().expect("pipe");
        send_with_fds(a.as_fd(), b"hello", &[p.as_fd()]).expect("send");
        let (msg, fds) = recv_msg(b.as_fd(), 64).expect("recv");
        assert_eq!(msg, b"hello");
        assert_eq!(msg.capacity(), 5, "the buffer is the message's size");
        assert_eq!(fds.len(), 1, "descriptors come with the message");
        // Too long: consumed (the next message is intact) and refused.
        send_with_fds(a.as_fd(), &[7u8; 100], &[]).expect("send");
        send_with_fds(a.as_fd(), b"next", &[]).expect("send");
        let e = recv_msg(b.as_fd(), 64).expect_err("oversized");
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert_eq!(recv_msg(b.as_fd(), 64).expect("recv").0, b"next");
        // End of stream is an empty message.
        drop(a);
        assert!(recv_msg(b.as_fd(), 64).expect("eof").0.is_empty());
    }

    fn state_of(pid: i32) -> Option<char> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        stat.rsplit_once(") ")?.1.chars().next()
    }

    #[test]
    fn kill_and_reap_leaves_no_zombie() {
        let child = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .expect("spawn sleep");
        let pid = child.id() as i32;
        // Dropping std's handle neither kills nor waits: the pidfd is the only handle left.
        drop(child);
        let fd = PidFd::open(pid).expect("pidfd");
        assert!(!fd.reap().expect("reap a running child"), "it still runs");
        assert!(fd.kill_and_reap(Duration::from_secs(5)), "it exited");
        assert_eq!(
            state_of(pid),
            None,
            "pid {pid} is still in the process table"
        );
        // Once collected, nothing is left to reap.
        assert!(!fd.reap().expect("reap again"));
    }

    #[test]
    fn waiting_on_the_pidfd_alone_leaves_a_zombie() {
        let child = std::process::Command::new("true")
            .spawn()
            .expect("spawn true");
        let pid = child.id() as i32;
        drop(child);
        let fd = PidFd::open(pid).expect("pidfd");
        assert!(fd.wait_exit(Duration::from_secs(5)).expect("wait"));
        assert_eq!(state_of(pid), Some('Z'));
        assert!(fd.reap().expect("reap"), "the zombie is collected");
        assert_eq!(state_of(pid), None);
    }
}
