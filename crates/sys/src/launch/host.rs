//! Launch helpers that act on the caller itself: the sealed agent executable, a tmpfs mount and a
//! private bind of the host root.

use std::ffi::CString;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// Creates an executable memfd holding `bytes`, sealed against any modification, so that
/// `/proc/<pid>/exe` of a sandbox init can never be used to overwrite a host binary.
pub fn sealed_exe_memfd(name: &str, bytes: &[u8]) -> io::Result<OwnedFd> {
    let cname = CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: valid name; flags are constants.
    let fd =
        unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: memfd_create returned a fresh fd we exclusively own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut f = std::fs::File::from(fd);
    f.write_all(bytes)?;
    let fd = OwnedFd::from(f);
    let seals = libc::F_SEAL_SEAL | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE;
    // SAFETY: fcntl on an fd we own with integer arguments.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// Mounts a tmpfs (`nosuid,nodev,noexec`) on `target` in the caller's mount namespace.
pub fn mount_tmpfs(target: &std::path::Path, options: &str) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let t = CString::new(target.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let o = CString::new(options).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: valid NUL-terminated strings.
    let rc = unsafe {
        libc::mount(
            c"tmpfs".as_ptr(),
            t.as_ptr(),
            c"tmpfs".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            o.as_ptr().cast(),
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
