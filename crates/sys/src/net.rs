//! Sockets: a TCP connection made inside a sandbox's own network namespace (to a server the
//! sandbox runs on its loopback) and used from the host's side afterwards — a socket stays in
//! the namespace it was made in; sockets bound to an address no interface has yet.

use std::fs::File;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

/// Runs `f` on the calling thread inside the network namespace of process `pid`, then puts the
/// thread back in its own (a thread of its own per call cost ~0.15 ms). Sockets `f` makes stay
/// in that namespace whichever thread uses them. The thread goes back however `f` ends, panics
/// included; one that cannot go back aborts the process, which would otherwise make its later
/// sockets in a sandbox's namespace.
pub fn in_netns<T>(pid: i32, f: impl FnOnce() -> io::Result<T>) -> io::Result<T> {
    struct Back(File);
    impl Drop for Back {
        fn drop(&mut self) {
            // SAFETY: setns on a namespace descriptor we own; this thread only.
            if unsafe { libc::setns(self.0.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                std::process::abort();
            }
        }
    }
    let path = format!("/proc/{pid}/ns/net");
    let ns = File::open(&path).map_err(|e| io::Error::new(e.kind(), format!("{path}: {e}")))?;
    let home = File::open("/proc/thread-self/ns/net")?;
    // SAFETY: setns on a namespace descriptor we own; it changes this thread only, which
    // `Back` returns to its own namespace when it drops.
    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(e.kind(), format!("setns {path}: {e}")));
    }
    let _back = Back(home);
    f()
}

/// Connects to `127.0.0.1:port` in the network namespace of process `pid` (a sandbox's init),
/// within `timeout` ([`in_netns`]).
pub fn connect_in_netns(pid: i32, port: u16, timeout: Duration) -> io::Result<TcpStream> {
    in_netns(pid, || {
        TcpStream::connect_timeout(&SocketAddr::from((Ipv4Addr::LOCALHOST, port)), timeout)
    })
}

/// A socket of `kind` (`SOCK_DGRAM`, `SOCK_STREAM`) bound to `addr` with `IP_FREEBIND`: the
/// address need not be on an interface yet (the node's DNS listens on its sandboxes' gateway
/// address, which lives on their veths).
fn bind_freebind(addr: SocketAddr, kind: libc::c_int) -> io::Result<OwnedFd> {
    let SocketAddr::V4(v4) = addr else {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "IPv4 only"));
    };
    // SAFETY: socket() with constant arguments; the result is checked before it is owned.
    let fd = unsafe {
        libc::socket(
            libc::AF_INET,
            kind | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let one: libc::c_int = 1;
    for opt in [
        (libc::SOL_IP, libc::IP_FREEBIND),
        (libc::SOL_SOCKET, libc::SO_REUSEADDR),
    ] {
        // SAFETY: setsockopt reads an int of the size given.
        let rc = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                opt.0,
                opt.1,
                (&one as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: v4.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*v4.ip()).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: bind reads a sockaddr_in of the size given.
    let rc = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&sin as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// A non-blocking UDP socket bound to `addr` with `IP_FREEBIND`.
pub fn bind_freebind_udp(addr: SocketAddr) -> io::Result<UdpSocket> {
    Ok(UdpSocket::from(bind_freebind(addr, libc::SOCK_DGRAM)?))
}

/// A non-blocking TCP listener on `addr` with `IP_FREEBIND`.
pub fn bind_freebind_tcp(addr: SocketAddr) -> io::Result<TcpListener> {
    let fd = bind_freebind(addr, libc::SOCK_STREAM)?;
    // SAFETY: listen on a bound socket we own.
    if unsafe { libc::listen(fd.as_raw_fd(), 128) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(TcpListener::from(fd))
}

/// The destination a connection was addressed to before the kernel redirected it to us
/// (`SO_ORIGINAL_DST` of an accepted socket; the node's in-band egress check).
pub fn original_dst(sock: &impl AsRawFd) -> io::Result<std::net::SocketAddrV4> {
    // SAFETY: an all-zero sockaddr_in is a valid value of the type.
    let mut sin: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `sin`, which has that size.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_IP,
            libc::SO_ORIGINAL_DST,
            (&mut sin as *mut libc::sockaddr_in).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(std::net::SocketAddrV4::new(
        Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)),
        u16::from_be(sin.sin_port),
    ))
}

/// Makes the tap device `name` (`IFF_TAP | IFF_NO_PI`, no virtio header: the frames a VM's
/// NIC sends, as they are) and answers its file descriptor. The device is not persistent: it
/// goes when the last descriptor (the VM's QEMU holds one) is closed.
pub fn open_tap(name: &str) -> io::Result<OwnedFd> {
    const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
    if name.is_empty() || name.len() > 15 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("bad interface name {name:?}"),
        ));
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")?;
    // struct ifreq: the name (16 bytes), then the flags (a short) in the union.
    let mut ifr = [0u8; 40];
    ifr[..name.len()].copy_from_slice(name.as_bytes());
    let flags = (libc::IFF_TAP | libc::IFF_NO_PI) as u16;
    ifr[16..18].copy_from_slice(&flags.to_ne_bytes());
    // SAFETY: TUNSETIFF reads (and writes back) a struct ifreq, which `ifr` is large enough for.
    if unsafe { libc::ioctl(file.as_raw_fd(), TUNSETIFF, ifr.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(OwnedFd::from(file))
}

/// The host's IPv4 addresses, loopback excepted (`getifaddrs`): where a server listening on
/// `0.0.0.0` is reached.
pub fn host_ipv4s() -> io::Result<Vec<Ipv4Addr>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list we free below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let mut out = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs made, freed only after the loop.
        let ifa = unsafe { &*cur };
        if ifa.ifa_addr.is_null() {
            cur = ifa.ifa_next;
            continue;
        }
        // SAFETY: a non-null `ifa_addr` points at a sockaddr whose family says its type.
        let family = unsafe { (*ifa.ifa_addr).sa_family };
        if i32::from(family) == libc::AF_INET {
            // SAFETY: an AF_INET address is a sockaddr_in.
            let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
            let a = Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
            if !a.is_loopback() && !out.contains(&a) {
                out.push(a);
            }
        }
        cur = ifa.ifa_next;
    }
    // SAFETY: the list getifaddrs made, freed once.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connects_in_its_own_namespace() {
        // The caller's own namespace: a listener here is reached.
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = l.local_addr().expect("addr").port();
        let s = connect_in_netns(std::process::id() as i32, port, Duration::from_secs(2));
        assert!(s.is_ok(), "{s:?}");
        assert!(connect_in_netns(i32::MAX, port, Duration::from_secs(1)).is_err());
    }

    #[test]
    fn the_thread_comes_back_from_another_namespace_however_f_ends() {
        let here = || std::fs::read_link("/proc/thread-self/ns/net").expect("netns");
        let before = here();
        // A child in a network namespace of its own.
        let mut child = std::process::Command::new("unshare")
            .args(["--net", "sleep", "30"])
            .spawn()
            .expect("unshare");
        let pid = child.id() as i32;
        // (Until `unshare` has made its namespace, the child is still in ours.)
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while std::fs::read_link(format!("/proc/{pid}/ns/net")).ok() == Some(before.clone())
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(10));
        }
        let inside = in_netns(pid, || {
            std::fs::read_link("/proc/thread-self/ns/net").map_err(io::Error::other)
        })
        .expect("in its namespace");
        assert_ne!(inside, before, "f ran in the child's namespace");
        assert_eq!(here(), before, "back after f returned");
        let r = std::panic::catch_unwind(|| in_netns(pid, || -> io::Result<()> { panic!("f") }));
        assert!(r.is_err());
        assert_eq!(here(), before, "back after f panicked");
        assert!(in_netns(pid, || Err::<(), _>(io::Error::other("no"))).is_err());
        assert_eq!(here(), before, "back after f failed");
        let _ = child.kill();
        let _ = child.wait();
    }

    #[test]
    fn binds_an_address_no_interface_has_yet() {
        let a = SocketAddr::from((Ipv4Addr::new(10, 254, 254, 1), 0));
        let u = bind_freebind_udp(a).expect("udp");
        assert_eq!(u.local_addr().expect("addr").ip(), a.ip());
        let t = bind_freebind_tcp(a).expect("tcp");
        assert_eq!(t.local_addr().expect("addr").ip(), a.ip());
        assert!(bind_freebind_udp("[::1]:0".parse().expect("v6")).is_err());
    }
}
