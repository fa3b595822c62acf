//! Templates committed from snapshot layers: each layer directory is written out as an OCI
//! layer tar (whiteouts as `.wh.<name>`, opaque directories as `.wh..wh..opq`) and imported
//! through the store's own unpacker, so a committed layer is content-addressed, verified and
//! distributed like any imported one.

use std::fs;
use std::io::{self, Seek, Write};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

use super::store::TemplateStore;
use super::{ImportLimits, LayerRef, Template, TemplateError, TemplateSource};

/// Writes the layer directory `dir` as a tar stream to `out`.
pub fn layer_tar(dir: &Path, out: impl Write) -> io::Result<()> {
    let mut b = tar::Builder::new(out);
    b.follow_symlinks(false);
    add_dir(&mut b, dir, Path::new(""))?;
    b.into_inner()?.flush()
}

fn header(meta: &fs::Metadata, kind: tar::EntryType, size: u64) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_mode(meta.mode() & 0o7777);
    h.set_uid(u64::from(meta.uid()));
    h.set_gid(u64::from(meta.gid()));
    h.set_mtime(meta.mtime().max(0) as u64);
    h.set_size(size);
    h
}

/// The header of an empty whiteout or opaque marker.
fn marker() -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Regular);
    h.set_mode(0o644);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(0);
    h.set_size(0);
    h
}

fn add_dir<W: Write>(b: &mut tar::Builder<W>, root: &Path, rel: &Path) -> io::Result<()> {
    let dir = root.join(rel);
    if !rel.as_os_str().is_empty() && dsec_sys::layer::is_opaque(&dir) {
        b.append_data(&mut marker(), rel.join(".wh..wh..opq"), io::empty())?;
    }
    let mut names: Vec<_> = fs::read_dir(&dir)?
        .filter_map(|e| e.ok().map(|e| e.file_name()))
        .collect();
    names.sort();
    for name in names {
        let path = dir.join(&name);
        let r = rel.join(&name);
        let meta = fs::symlink_metadata(&path)?;
        let ft = meta.file_type();
        if ft.is_dir() {
            let mut h = header(&meta, tar::EntryType::Directory, 0);
            b.append_data(&mut h, &r, io::empty())?;
            add_dir(b, root, &r)?;
        } else if ft.is_file() {
            let mut h = header(&meta, tar::EntryType::Regular, meta.len());
            b.append_data(&mut h, &r, fs::File::open(&path)?)?;
        } else if ft.is_symlink() {
            let mut h = header(&meta, tar::EntryType::Symlink, 0);
            b.append_link(&mut h, &r, fs::read_link(&path)?)?;
        } else if ft.is_char_device() && meta.rdev() == 0 {
            let wh = format!(".wh.{}", name.to_string_lossy());
            b.append_data(&mut marker(), rel.join(wh), io::empty())?;
        }
        // FIFOs and sockets are not part of an image layer.
    }
    Ok(())
}

impl TemplateStore {
    /// Commits template `name`: `base`'s layers with `dirs` (snapshot layer directories,
    /// bottom → top) above them, each imported as a layer of the store; `env`, `workdir` and
    /// `user` as given.
    pub fn commit(
        &self,
        name: &str,
        base: &Template,
        dirs: &[std::path::PathBuf],
        defaults: (Vec<(String, String)>, String, Option<String>),
        source: TemplateSource,
    ) -> Result<Template, TemplateError> {
        // Layer collection waits until the record names the new layers.
        self.importing(|| {
            super::validate_name(name)?;
            let limits = ImportLimits::default();
            let mut layers = base.layers.clone();
            for dir in dirs {
                let mut tmp = tempfile::tempfile()
                    .map_err(|e| TemplateError::io("create temp file", dir, e))?;
                layer_tar(dir, &mut tmp)
                    .map_err(|e| TemplateError::io("write layer tar", dir, e))?;
                tmp.rewind()
                    .map_err(|e| TemplateError::io("rewind layer tar", dir, e))?;
                let (digest, _) = self.layers().import(tmp, None, &limits)?;
                layers.push(LayerRef::Stored { digest });
            }
            let (env, workdir, user) = defaults;
            let t = Template {
                name: name.to_owned(),
                layers,
                env,
                workdir,
                user,
                source,
            };
            self.put_new(&t)?;
            Ok(t)
        })
    }
}
