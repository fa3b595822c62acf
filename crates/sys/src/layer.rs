//! Overlayfs layer trees on disk: whiteouts, opaque directories, and copying a layer
//! ([`stage_layer`]) with both intact.
//!
//! A whiteout is a character device 0/0; an opaque directory carries `trusted.overlay.opaque=y`
//! (and `user.overlay.opaque=y`, which overlays mounted with `userxattr` inside a user namespace
//! read).

use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Name of the xattr overlayfs reads to mark a directory opaque.
pub const OPAQUE_XATTR: &str = "trusted.overlay.opaque";

/// The opaque marker read by overlays mounted with `userxattr` (inside a user namespace).
pub const USER_OPAQUE_XATTR: &str = "user.overlay.opaque";

/// A filesystem operation on a layer tree failed.
#[derive(Debug, thiserror::Error)]
#[error("{op} {}", path.display())]
pub struct LayerError {
    /// The operation (`"mknod whiteout"`, `"copy"` ...).
    pub op: &'static str,
    /// The path it was applied to.
    pub path: PathBuf,
    /// The OS error.
    #[source]
    pub source: io::Error,
}

fn err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> LayerError + 'a {
    move |source| LayerError {
        op,
        path: path.to_owned(),
        source,
    }
}

/// Creates an overlayfs whiteout (character device 0/0) at `path`.
pub fn make_whiteout(path: &Path) -> Result<(), LayerError> {
    use rustix::fs::{makedev, mknodat, FileType, Mode, CWD};
    mknodat(
        CWD,
        path,
        FileType::CharacterDevice,
        Mode::empty(),
        makedev(0, 0),
    )
    .map_err(|e| err("mknod whiteout", path)(e.into()))
}

/// Marks the directory at `path` opaque for overlayfs.
pub fn set_opaque(path: &Path) -> Result<(), LayerError> {
    for name in [OPAQUE_XATTR, USER_OPAQUE_XATTR] {
        rustix::fs::lsetxattr(path, name, b"y", rustix::fs::XattrFlags::empty())
            .map_err(|e| err("set opaque xattr", path)(e.into()))?;
    }
    Ok(())
}

/// Whether `meta` is an overlayfs whiteout (a character device 0/0).
pub fn is_whiteout(meta: &fs::Metadata) -> bool {
    meta.file_type().is_char_device() && meta.rdev() == 0
}

/// Whether the directory `path` is marked opaque for overlayfs.
pub fn is_opaque(path: &Path) -> bool {
    let mut value = [0u8; 8];
    matches!(rustix::fs::lgetxattr(path, OPAQUE_XATTR, &mut value[..]), Ok(1) if value[0] == b'y')
}

/// Copies a layer tree (directories with their mode, owner and opaque marker, regular files,
/// symlinks, whiteouts) to `dest`, which must not exist. Used to place the host mask on a
/// filesystem other than `/`'s. Other file types are refused.
pub fn stage_layer(src: &Path, dest: &Path) -> Result<(), LayerError> {
    let meta = fs::symlink_metadata(src).map_err(err("stat", src))?;
    let chown = rustix::process::geteuid().is_root();
    let ft = meta.file_type();
    if ft.is_dir() {
        fs::DirBuilder::new()
            .mode(0o700)
            .create(dest)
            .map_err(err("create dir", dest))?;
        let rd = fs::read_dir(src).map_err(err("read dir", src))?;
        for ent in rd {
            let ent = ent.map_err(err("read dir", src))?;
            stage_layer(&ent.path(), &dest.join(ent.file_name()))?;
        }
        let mut buf = [0u8; 8];
        if let Ok(n) = rustix::fs::lgetxattr(src, OPAQUE_XATTR, &mut buf[..]) {
            if buf[..n] == *b"y" {
                set_opaque(dest)?;
            }
        }
    } else if ft.is_symlink() {
        let target = fs::read_link(src).map_err(err("readlink", src))?;
        std::os::unix::fs::symlink(&target, dest).map_err(err("create symlink", dest))?;
    } else if ft.is_file() {
        fs::copy(src, dest).map_err(err("copy", dest))?;
    } else if is_whiteout(&meta) {
        make_whiteout(dest)?;
    } else {
        return Err(err("stage layer: unsupported file type", src)(
            io::ErrorKind::InvalidData.into(),
        ));
    }
    if chown {
        std::os::unix::fs::lchown(dest, Some(meta.uid()), Some(meta.gid()))
            .map_err(err("chown", dest))?;
    }
    if !ft.is_symlink() {
        fs::set_permissions(dest, fs::Permissions::from_mode(meta.mode() & 0o7777))
            .map_err(err("chmod", dest))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stage_layer_copies_files_links_and_modes() -> Result<(), Box<dyn std::error::Error>> {
        let src = tempfile::tempdir()?;
        let s = src.path();
        fs::create_dir_all(s.join("a/b"))?;
        fs::write(s.join("a/b/f"), b"data")?;
        fs::set_permissions(s.join("a/b/f"), fs::Permissions::from_mode(0o640))?;
        fs::set_permissions(s.join("a"), fs::Permissions::from_mode(0o1777))?;
        std::os::unix::fs::symlink("b/f", s.join("a/link"))?;
        let out = tempfile::tempdir()?;
        let d = out.path().join("copy");
        stage_layer(s, &d)?;
        assert_eq!(fs::read(d.join("a/b/f"))?, b"data");
        assert_eq!(fs::metadata(d.join("a/b/f"))?.mode() & 0o7777, 0o640);
        assert_eq!(fs::metadata(d.join("a"))?.mode() & 0o7777, 0o1777);
        assert_eq!(fs::read_link(d.join("a/link"))?, Path::new("b/f"));
        let again = stage_layer(s, &d).expect_err("dest exists");
        assert_eq!(again.op, "create dir");
        Ok(())
    }

    #[test]
    fn stage_layer_refuses_other_file_types() -> Result<(), Box<dyn std::error::Error>> {
        let src = tempfile::tempdir()?;
        let fifo = src.path().join("fifo");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )?;
        let out = tempfile::tempdir()?;
        let e = stage_layer(&fifo, &out.path().join("x")).expect_err("a fifo is refused");
        assert_eq!(e.source.kind(), io::ErrorKind::InvalidData);
        Ok(())
    }
}
