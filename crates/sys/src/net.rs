//! Reaching a sandbox's own network namespace from the host: a TCP connection made inside it
//! (to a server the sandbox runs on its loopback), used from the host's side afterwards — a
//! socket stays in the namespace it was made in.

use std::fs::File;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::time::Duration;

/// Connects to `127.0.0.1:port` in the network namespace of process `pid` (a sandbox's init),
/// within `timeout`. The namespace is entered by a thread of its own, which ends right after,
/// so no thread of the caller ever runs in it.
pub fn connect_in_netns(pid: i32, port: u16, timeout: Duration) -> io::Result<TcpStream> {
    let ns = File::open(format!("/proc/{pid}/ns/net"))?;
    std::thread::Builder::new()
        .name("netns-connect".into())
        .spawn(move || {
            // SAFETY: setns on a namespace descriptor we own; it changes this thread only.
            if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(io::Error::last_os_error());
            }
            let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
            TcpStream::connect_timeout(&addr, timeout)
        })?
        .join()
        .map_err(|_| io::Error::other("the connecting thread panicked"))?
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
}
