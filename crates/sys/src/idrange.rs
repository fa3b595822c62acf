//! Host-wide leases of user-namespace id ranges: one range of [`SPAN`] ids per sandbox with a user
//! namespace, so that no two live sandboxes share a host uid (a process that escapes its sandbox
//! is also a different unprivileged uid from its neighbours).
//!
//! A lease is a Unix socket bound to the abstract name `dsec/userns/<index>` in the host's
//! network namespace, held by the sandbox's supervisor for as long as it lives. The kernel
//! allows one socket per name and frees the name when the socket's last descriptor closes,
//! however its process ends: a crashed node or supervisor gives its ranges back with no record
//! and no file left behind, and every node of the host (each with its own run dir) draws from
//! the same names.

use std::io;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

/// First host id of range 0: above the ids of the host's users.
pub const BASE: u32 = 1 << 20;
/// Ids per range: uid and gid 0..65536 inside (65534, `nobody`, included).
pub const SPAN: u32 = 65_536;
/// Ranges there are: `BASE + SLOTS × SPAN` stays below 2^30, where QEMU's ids begin.
pub const SLOTS: u32 = 16_000;

/// One leased range; given back when dropped (or when its process dies).
#[derive(Debug)]
pub struct IdRangeLease {
    /// Holds the name; closing it releases the range.
    _name: UnixDatagram,
    index: u32,
}

fn name(index: u32) -> io::Result<SocketAddr> {
    SocketAddr::from_abstract_name(format!("dsec/userns/{index}"))
}

impl IdRangeLease {
    /// Leases a free range, trying the ranges from one picked by this process's pid, so that
    /// concurrent acquirers rarely try the same name.
    pub fn acquire() -> io::Result<Self> {
        let start = std::process::id() % SLOTS;
        for k in 0..SLOTS {
            if let Some(lease) = Self::try_index((start + k) % SLOTS)? {
                return Ok(lease);
            }
        }
        // EAGAIN: the node answers `resource_exhausted`.
        Err(io::Error::from_raw_os_error(libc::EAGAIN))
    }

    /// Leases range `index` if it is free.
    pub fn try_index(index: u32) -> io::Result<Option<Self>> {
        match UnixDatagram::bind_addr(&name(index)?) {
            Ok(sock) => Ok(Some(Self { _name: sock, index })),
            Err(e) if e.kind() == io::ErrorKind::AddrInUse => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Whether range `index` is leased (by anyone on the host).
    pub fn is_leased(index: u32) -> io::Result<bool> {
        Ok(Self::try_index(index)?.is_none())
    }

    /// The range's index.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// The first host id of the range (uid and gid alike).
    pub fn first_id(&self) -> u32 {
        BASE + self.index * SPAN
    }

    /// The index of the range that begins at host id `first`.
    pub fn index_of(first: u32) -> Option<u32> {
        let off = first.checked_sub(BASE)?;
        (off % SPAN == 0 && off / SPAN < SLOTS).then_some(off / SPAN)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_are_exclusive_and_given_back_on_drop() -> io::Result<()> {
        let a = IdRangeLease::acquire()?;
        let b = IdRangeLease::acquire()?;
        assert_ne!(a.index(), b.index());
        assert_eq!(IdRangeLease::index_of(a.first_id()), Some(a.index()));
        assert!(a.first_id() >= BASE && u64::from(a.first_id()) + u64::from(SPAN) <= 1 << 30);
        assert!(IdRangeLease::try_index(a.index())?.is_none());
        assert!(IdRangeLease::is_leased(a.index())?);
        let index = a.index();
        drop(a);
        assert!(!IdRangeLease::is_leased(index)?);
        assert!(IdRangeLease::is_leased(b.index())?);
        Ok(())
    }

    #[test]
    fn a_lease_ends_with_its_process() -> io::Result<()> {
        // Another process holds range `index` (as a supervisor would) and is killed: the range
        // is free again at once, with nothing to clean up.
        let index = IdRangeLease::acquire()?.index();
        let hold = format!(
            "import socket, sys, time\n\
             s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n\
             s.bind(b'\\0dsec/userns/{index}')\n\
             print('held', flush=True)\n\
             time.sleep(60)\n"
        );
        let mut child = std::process::Command::new("/usr/bin/python3")
            .args(["-c", &hold])
            .stdout(std::process::Stdio::piped())
            .spawn()?;
        let mut line = String::new();
        let out = child.stdout.take().expect("stdout");
        io::BufRead::read_line(&mut io::BufReader::new(out), &mut line)?;
        assert_eq!(line.trim(), "held");
        let held = IdRangeLease::is_leased(index)?;
        child.kill()?;
        child.wait()?;
        assert!(held, "a range held by another process is leased");
        assert!(!IdRangeLease::is_leased(index)?);
        Ok(())
    }

    #[test]
    fn index_of_rejects_ids_outside_the_ranges() {
        assert_eq!(IdRangeLease::index_of(BASE - 1), None);
        assert_eq!(IdRangeLease::index_of(BASE + 1), None);
        assert_eq!(IdRangeLease::index_of(BASE + SLOTS * SPAN), None);
        assert_eq!(IdRangeLease::index_of(BASE + 3 * SPAN), Some(3));
    }
}
