//! External commands: running them with their errors described, apt, and finding (or
//! installing) the tools the images and the VMs need.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use super::{io_err, ImageError};

/// How much of a failed command's standard error is kept in [`ImageError::Command`].
const STDERR_TAIL: usize = 2000;

/// The command line of `cmd`, for error messages.
fn describe(cmd: &Command) -> String {
    let mut line = cmd.get_program().to_string_lossy().into_owned();
    for arg in cmd.get_args() {
        line.push(' ');
        line.push_str(&arg.to_string_lossy());
    }
    line
}

/// The last [`STDERR_TAIL`] bytes of `bytes` (cut at a character boundary), trimmed.
fn tail(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let text = text.trim();
    let mut start = text.len().saturating_sub(STDERR_TAIL);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    if start == 0 {
        text.to_string()
    } else {
        format!("…{}", &text[start..])
    }
}

/// Runs `cmd` (stdin from /dev/null, output captured) and fails unless it exits with 0.
pub(super) fn run(cmd: &mut Command) -> Result<Output, ImageError> {
    let command = describe(cmd);
    run_described(cmd, command)
}

/// [`run`] with an explicit description (for commands whose arguments are too long to quote).
fn run_described(cmd: &mut Command, command: String) -> Result<Output, ImageError> {
    let out = match cmd.stdin(Stdio::null()).output() {
        Ok(out) => out,
        Err(source) => return Err(ImageError::Spawn { command, source }),
    };
    if out.status.success() {
        Ok(out)
    } else {
        Err(ImageError::Command {
            command,
            status: out.status.to_string(),
            stderr: tail(&out.stderr),
        })
    }
}

/// Runs `apt-get <args>` (in `dir`, if given). On a fresh machine apt's package lists are
/// missing, and on an old one they are stale (the versions they name are gone from the
/// mirror), so a failure is retried once after `apt-get update`.
fn apt_get(args: &[&str], dir: Option<&Path>) -> Result<Output, ImageError> {
    let attempt = || {
        let mut cmd = Command::new("apt-get");
        cmd.arg("-q")
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive");
        if let Some(dir) = dir {
            cmd.current_dir(dir);
        }
        run(&mut cmd)
    };
    match attempt() {
        Err(ImageError::Command { .. }) => {
            run(Command::new("apt-get")
                .args(["-q", "update"])
                .env("DEBIAN_FRONTEND", "noninteractive"))?;
            attempt()
        }
        other => other,
    }
}

/// Whether `name` is a valid Debian package name (and so safe to pass to apt-get).
pub(super) fn is_package_name(name: &str) -> bool {
    name.len() >= 2
        && name.starts_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "+-.".contains(c))
}

/// Downloads `package`'s `.deb` into `dir` and returns its path.
pub(super) fn apt_download(package: &str, dir: &Path) -> Result<PathBuf, ImageError> {
    // apt-get warns that the download is unsandboxed (`_apt` cannot write to `dir`): harmless.
    apt_get(&["download", package], Some(dir))?;
    find_deb(dir, package)
}

/// The `.deb` of `package` in `dir` (apt names it `<package>_<version>_<arch>.deb`).
fn find_deb(dir: &Path, package: &str) -> Result<PathBuf, ImageError> {
    let prefix = format!("{package}_");
    let mut found = Vec::new();
    for entry in fs::read_dir(dir).map_err(|e| io_err("read dir", dir, e))? {
        let entry = entry.map_err(|e| io_err("read dir", dir, e))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(&prefix) && name.ends_with(".deb") {
            found.push(entry.path());
        }
    }
    found.sort();
    found.pop().ok_or_else(|| ImageError::Package {
        path: dir.to_path_buf(),
        reason: format!("apt-get download {package} left no {prefix}*.deb"),
    })
}

/// A control field of a `.deb` (`dpkg-deb -f`).
pub(super) fn deb_field(deb: &Path, field: &str) -> Result<String, ImageError> {
    let out = run(Command::new("dpkg-deb").arg("-f").arg(deb).arg(field))?;
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The QEMU binary for x86-64 guests.
const QEMU_BINARY: &str = "qemu-system-x86_64";
/// The Debian package providing it.
const QEMU_PACKAGE: &str = "qemu-system-x86";

/// The path of `qemu-system-x86_64`, installing Debian's `qemu-system-x86` (without
/// recommends: no GUI stack) when it is missing.
pub fn ensure_qemu() -> Result<PathBuf, ImageError> {
    ensure_tool(QEMU_BINARY, QEMU_PACKAGE)
}

/// The path of the executable `binary`, installing the Debian package `package` (without
/// recommends) when it is missing.
pub fn ensure_tool(binary: &'static str, package: &'static str) -> Result<PathBuf, ImageError> {
    if let Some(path) = find_executable(binary) {
        return Ok(path);
    }
    apt_get(&["install", "-y", "--no-install-recommends", package], None)?;
    find_executable(binary).ok_or(ImageError::ToolMissing { binary, package })
}

/// The first executable file `name` in `$PATH` or the standard binary directories (a
/// daemon's `PATH` may be minimal).
pub(super) fn find_executable(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/local/bin", "/usr/bin", "/bin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|candidate| {
            fs::metadata(candidate)
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stderr_tail_is_bounded() {
        let long = "é".repeat(STDERR_TAIL);
        let end = tail(long.as_bytes());
        assert!(end.starts_with('…'));
        assert!(end.len() <= STDERR_TAIL + 4);
        assert_eq!(tail(b"  short\n"), "short");
    }
}
