//! The content-addressed layer store and the named template store.
//!
//! On-disk layout under the data dir:
//!
//! ```text
//! layers/<sha256-hex>/      immutable unpacked layer trees (overlayfs lowerdirs)
//! blobs/<sha256-hex>        in a cluster: the uncompressed tar each layer was unpacked from
//!                           (its digest is the layer's), served to the nodes that fetch it
//! host-mask/<id>/           generated host mask layers (see host.rs)
//! templates/<name>.json     template records, written atomically
//! tmp/                      in-progress imports; emptied by TemplateStore::open
//! ```
//!
//! Writers unpack into `tmp/` and `rename(2)` into place, so a layer directory is either
//! complete or absent. Concurrency: imports hold a shared lock and `gc_layers` / `remove` an
//! exclusive one, so garbage collection never removes a layer an import is about to reference;
//! `remove` also keeps every layer of the templates live sandboxes use (their lowerdirs). One
//! `TemplateStore` per data dir (a second instance's `open` would clear the first's `tmp/`).

use std::collections::BTreeSet;
use std::fs;
use std::io::{self, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::RwLock;

use tempfile::TempDir;

use super::host::host_mask_layer;
use super::oci::{self, check_digest, OciSource, ParsedImage};
use super::unpack::{self, Budget, MeteredReader, UnpackMode};
use super::{
    validate_name, Digest, ImportLimits, LayerRef, Template, TemplateError, TemplateSource,
    DEFAULT_PATH, HOST_TEMPLATE,
};

/// The content-addressed store of unpacked layers at `<data_dir>/layers/`.
#[derive(Debug)]
pub struct LayerStore {
    root: PathBuf,
    tmp: PathBuf,
    blobs: PathBuf,
    /// Keep each new layer's blob (see [`LayerStore::keep_blobs`]).
    keep_blobs: std::sync::atomic::AtomicBool,
}

/// A layer unpacked into a temporary directory, not yet committed to the store.
/// Dropping it removes the temporary directory.
pub(crate) struct StagedLayer<'a> {
    store: &'a LayerStore,
    tmp: TempDir,
    digest: Digest,
    blob: Option<tempfile::NamedTempFile>,
}

impl StagedLayer<'_> {
    /// The digest of the uncompressed tar stream that was unpacked.
    pub(crate) fn digest(&self) -> &Digest {
        &self.digest
    }

    /// Moves the layer into the store; a no-op (the copy is discarded) if it is already there.
    pub(crate) fn commit(self) -> Result<Digest, TemplateError> {
        if let Some(blob) = self.blob {
            let path = self.store.blobs.join(self.digest.hex());
            match blob.persist_noclobber(&path) {
                Ok(_) => {}
                Err(e) if e.error.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(TemplateError::io("keep layer blob", &path, e.error)),
            }
        }
        let src = self.tmp.path().join("l");
        let dst = self.store.path(&self.digest);
        if !dst.exists() {
            match fs::rename(&src, &dst) {
                Ok(()) => {}
                // Lost a race with an identical import: dedup.
                Err(_) if dst.is_dir() => {}
                Err(e) => return Err(TemplateError::io("rename layer", &dst, e)),
            }
        }
        Ok(self.digest)
    }
}

fn create_dir_all(path: &Path) -> Result<(), TemplateError> {
    fs::create_dir_all(path).map_err(|e| TemplateError::io("create dir", path, e))
}

impl LayerStore {
    /// Opens (creating if needed) the layer store of `data_dir`.
    pub fn open(data_dir: &Path) -> Result<Self, TemplateError> {
        let store = LayerStore {
            root: data_dir.join("layers"),
            tmp: data_dir.join("tmp"),
            blobs: data_dir.join("blobs"),
            keep_blobs: std::sync::atomic::AtomicBool::new(false),
        };
        create_dir_all(&store.root)?;
        create_dir_all(&store.tmp)?;
        Ok(store)
    }

    /// From now on, keep the uncompressed tar of every layer added (a node of a cluster serves
    /// them to the nodes that fetch its templates).
    pub fn keep_blobs(&self) -> Result<(), TemplateError> {
        create_dir_all(&self.blobs)?;
        self.keep_blobs
            .store(true, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// The kept blob of a layer, if there is one.
    pub fn blob(&self, digest: &Digest) -> Option<PathBuf> {
        let p = self.blobs.join(digest.hex());
        p.is_file().then_some(p)
    }

    /// The directory of a layer (whether or not it is present).
    pub fn path(&self, digest: &Digest) -> PathBuf {
        self.root.join(digest.hex())
    }

    /// Whether the layer is present.
    pub fn contains(&self, digest: &Digest) -> bool {
        self.path(digest).is_dir()
    }

    /// All layers present in the store, sorted.
    pub fn list(&self) -> Result<Vec<Digest>, TemplateError> {
        let rd = fs::read_dir(&self.root).map_err(|e| TemplateError::io("list", &self.root, e))?;
        let mut out = Vec::new();
        for ent in rd {
            let ent = ent.map_err(|e| TemplateError::io("list", &self.root, e))?;
            if let Some(d) = ent.file_name().to_str().and_then(Digest::from_hex) {
                out.push(d);
            }
        }
        out.sort();
        Ok(out)
    }

    /// Unpacks a (plain or gzip'd) layer tar and adds it to the store, returning its digest and
    /// the bytes of its uncompressed stream. Importing a layer that is already present leaves
    /// the store unchanged. If `expected` is given, the uncompressed stream must hash to it.
    pub fn import(
        &self,
        reader: impl Read,
        expected: Option<&Digest>,
        limits: &ImportLimits,
    ) -> Result<(Digest, u64), TemplateError> {
        let mut budget = Budget::new(limits);
        let staged = self.stage(reader, &mut budget)?;
        check_digest(expected, staged.digest())?;
        Ok((staged.commit()?, budget.bytes_used()))
    }

    /// Unpacks a layer into a temporary directory of the store.
    pub(crate) fn stage(
        &self,
        reader: impl Read,
        budget: &mut Budget,
    ) -> Result<StagedLayer<'_>, TemplateError> {
        let tmp = tempfile::Builder::new()
            .prefix("layer-")
            .tempdir_in(&self.tmp)
            .map_err(|e| TemplateError::io("create temp dir", &self.tmp, e))?;
        let dest = tmp.path().join("l");
        fs::create_dir(&dest).map_err(|e| TemplateError::io("create dir", &dest, e))?;
        fs::set_permissions(&dest, fs::Permissions::from_mode(0o755))
            .map_err(|e| TemplateError::io("chmod", &dest, e))?;
        let blob = if self.keep_blobs.load(std::sync::atomic::Ordering::Relaxed) {
            Some(
                tempfile::Builder::new()
                    .prefix("blob-")
                    .tempfile_in(&self.tmp)
                    .map_err(|e| TemplateError::io("create temp file", &self.tmp, e))?,
            )
        } else {
            None
        };
        let tee = match &blob {
            Some(b) => Some(
                b.reopen()
                    .map_err(|e| TemplateError::io("open temp file", b.path(), e))?,
            ),
            None => None,
        };
        let digest = unpack::unpack_stream_tee(reader, &dest, budget, UnpackMode::Layer, tee)?;
        Ok(StagedLayer {
            store: self,
            tmp,
            digest,
            blob,
        })
    }

    /// Removes a layer. The caller guarantees no template references it.
    pub fn remove(&self, digest: &Digest) -> Result<(), TemplateError> {
        if let Some(blob) = self.blob(digest) {
            let _ = fs::remove_file(blob);
        }
        let path = self.path(digest);
        // Rename first so a half-removed layer is never visible under its digest.
        let doomed = self.tmp.join(format!("rm-{}", digest.hex()));
        match fs::rename(&path, &doomed) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(TemplateError::io("rename layer", &path, e)),
        }
        fs::remove_dir_all(&doomed).map_err(|e| TemplateError::io("remove layer", &doomed, e))
    }
}

/// The stored layers of a template.
fn stored_layers(t: &Template) -> impl Iterator<Item = Digest> + '_ {
    t.layers.iter().filter_map(|l| match l {
        LayerRef::Stored { digest } => Some(digest.clone()),
        LayerRef::HostRoot | LayerRef::HostMask { .. } => None,
    })
}

/// Named templates over a [`LayerStore`], persisted under `<data_dir>/templates/`.
#[derive(Debug)]
pub struct TemplateStore {
    data_dir: PathBuf,
    layers: LayerStore,
    templates: PathBuf,
    host_mask_id: String,
    /// Imports hold it shared, `gc_layers` exclusive.
    gc_lock: RwLock<()>,
}

impl TemplateStore {
    /// Opens (creating if needed) the store in `data_dir`, clears leftovers of interrupted
    /// imports and builds the host mask layer hiding the data dir itself.
    pub fn open(data_dir: &Path) -> Result<Self, TemplateError> {
        Self::open_with_hidden(data_dir, &[])
    }

    /// Like [`TemplateStore::open`], also hiding `extra_hidden` host paths (e.g. the node's
    /// runtime dir) from the `host` template. `data_dir` is always hidden.
    pub fn open_with_hidden(
        data_dir: &Path,
        extra_hidden: &[PathBuf],
    ) -> Result<Self, TemplateError> {
        create_dir_all(data_dir)?;
        let data_dir = data_dir
            .canonicalize()
            .map_err(|e| TemplateError::io("resolve data dir", data_dir, e))?;
        let tmp = data_dir.join("tmp");
        if tmp.exists() {
            fs::remove_dir_all(&tmp).map_err(|e| TemplateError::io("clear tmp", &tmp, e))?;
        }
        let layers = LayerStore::open(&data_dir)?;
        let templates = data_dir.join("templates");
        create_dir_all(&templates)?;
        let mut hidden = vec![data_dir.clone()];
        hidden.extend_from_slice(extra_hidden);
        let mask = host_mask_layer(&data_dir, &hidden)?;
        let host_mask_id = mask
            .file_name()
            .and_then(|n| n.to_str())
            .map(str::to_owned)
            .ok_or_else(|| {
                TemplateError::io("host mask", &mask, io::ErrorKind::InvalidData.into())
            })?;
        Ok(TemplateStore {
            data_dir,
            layers,
            templates,
            host_mask_id,
            gc_lock: RwLock::new(()),
        })
    }

    /// The (canonical) data dir.
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// The underlying layer store.
    pub fn layers(&self) -> &LayerStore {
        &self.layers
    }

    /// The built-in `host` template.
    pub fn host_template(&self) -> Template {
        Template {
            name: HOST_TEMPLATE.to_owned(),
            layers: vec![
                LayerRef::HostRoot,
                LayerRef::HostMask {
                    id: self.host_mask_id.clone(),
                },
            ],
            env: vec![("PATH".to_owned(), DEFAULT_PATH.to_owned())],
            workdir: "/".to_owned(),
            user: None,
            source: TemplateSource::Host,
        }
    }

    fn record_path(&self, name: &str) -> PathBuf {
        self.templates.join(format!("{name}.json"))
    }

    /// All templates, `host` first, then by name.
    pub fn list(&self) -> Result<Vec<Template>, TemplateError> {
        let rd = fs::read_dir(&self.templates)
            .map_err(|e| TemplateError::io("list", &self.templates, e))?;
        let mut names = Vec::new();
        for ent in rd {
            let ent = ent.map_err(|e| TemplateError::io("list", &self.templates, e))?;
            let file = ent.file_name();
            let Some(name) = file.to_str().and_then(|f| f.strip_suffix(".json")) else {
                continue;
            };
            if validate_name(name).is_ok() && name != HOST_TEMPLATE {
                names.push(name.to_owned());
            }
        }
        names.sort();
        let mut out = vec![self.host_template()];
        for name in names {
            match self.get(&name) {
                Ok(t) => out.push(t),
                // Deleted concurrently.
                Err(TemplateError::NotFound { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

    /// The template called `name`.
    pub fn get(&self, name: &str) -> Result<Template, TemplateError> {
        validate_name(name)?;
        if name == HOST_TEMPLATE {
            return Ok(self.host_template());
        }
        let path = self.record_path(name);
        let bytes = match fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(TemplateError::NotFound {
                    name: name.to_owned(),
                })
            }
            Err(e) => return Err(TemplateError::io("read template", &path, e)),
        };
        serde_json::from_slice(&bytes).map_err(|source| TemplateError::Corrupt { path, source })
    }

    /// Deletes a template record (its layers stay until [`TemplateStore::gc_layers`]). The
    /// caller checks that no sandbox or pool uses it. `host` cannot be deleted.
    pub fn delete(&self, name: &str) -> Result<(), TemplateError> {
        validate_name(name)?;
        if name == HOST_TEMPLATE {
            return Err(TemplateError::Builtin {
                name: name.to_owned(),
            });
        }
        let path = self.record_path(name);
        fs::remove_file(&path).map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => TemplateError::NotFound {
                name: name.to_owned(),
            },
            _ => TemplateError::io("remove template", &path, e),
        })
    }

    /// Deletes the template `name`, then every stored layer no template references any more
    /// (layers shared with another template stay); returns the removed layers.
    ///
    /// `in_use` names the templates that live sandboxes were made from; their layers are their
    /// overlayfs lowerdirs and are never removed. It is asked before the delete (a template in
    /// use is refused with [`TemplateError::InUse`]) and again after it, so that a sandbox whose
    /// create read the template just before the delete keeps its layers; when a sandbox uses a
    /// template that no longer exists at all, its layers are unknown and no layer is removed.
    pub fn remove(
        &self,
        name: &str,
        in_use: &dyn Fn() -> BTreeSet<String>,
    ) -> Result<Vec<Digest>, TemplateError> {
        validate_name(name)?;
        if name == HOST_TEMPLATE {
            return Err(TemplateError::Builtin {
                name: name.to_owned(),
            });
        }
        let _guard = self.gc_lock.write().unwrap_or_else(|p| p.into_inner());
        let template = self.get(name)?;
        if in_use().contains(name) {
            return Err(TemplateError::InUse {
                name: name.to_owned(),
            });
        }
        self.delete(name)?;
        let used = in_use();
        let remaining = self.list()?;
        if used
            .iter()
            .any(|u| u != name && !remaining.iter().any(|t| &t.name == u))
        {
            return Ok(Vec::new());
        }
        let mut keep = BTreeSet::new();
        if used.contains(name) {
            keep.extend(stored_layers(&template));
        }
        self.gc_except(
            remaining
                .iter()
                .flat_map(stored_layers)
                .chain(keep)
                .collect(),
        )
    }

    /// Removes every stored layer no template references; returns the removed digests.
    pub fn gc_layers(&self) -> Result<Vec<Digest>, TemplateError> {
        let _guard = self.gc_lock.write().unwrap_or_else(|p| p.into_inner());
        let used = self.list()?.iter().flat_map(stored_layers).collect();
        self.gc_except(used)
    }

    /// Removes every stored layer not in `used` (the caller holds `gc_lock` for writing).
    fn gc_except(&self, used: BTreeSet<Digest>) -> Result<Vec<Digest>, TemplateError> {
        let mut removed = Vec::new();
        for d in self.layers.list()? {
            if !used.contains(&d) {
                self.layers.remove(&d)?;
                removed.push(d);
            }
        }
        Ok(removed)
    }

    /// Overlayfs lowerdirs of a template, **topmost first** (ready for `lowerdir=a:b:c`).
    ///
    /// For `host` this is `[<mask>, /]`. overlayfs refuses lower layers nested in one another
    /// on the same filesystem, so when [`super::shares_filesystem_with_root`] is true for the
    /// mask, the runtime copies it onto its sandbox tmpfs with [`super::stage_layer`] first.
    pub fn lowerdirs(&self, template: &Template) -> Vec<PathBuf> {
        template
            .layers
            .iter()
            .rev()
            .map(|l| match l {
                LayerRef::Stored { digest } => self.layers.path(digest),
                LayerRef::HostRoot => PathBuf::from("/"),
                // This node's mask, whichever node recorded the template (ids differ with
                // the hidden paths, the data dir among them).
                LayerRef::HostMask { .. } => {
                    self.data_dir.join("host-mask").join(&self.host_mask_id)
                }
            })
            .collect()
    }

    /// Imports a root filesystem tarball (plain or gzip'd) as a one-layer template.
    pub fn import_rootfs_tar(
        &self,
        name: &str,
        reader: impl Read,
        limits: &ImportLimits,
    ) -> Result<Template, TemplateError> {
        self.check_new_name(name)?;
        let _guard = self.gc_lock.read().unwrap_or_else(|p| p.into_inner());
        let mut budget = Budget::new(limits);
        let digest = self.layers.stage(reader, &mut budget)?.commit()?;
        let template = Template {
            name: name.to_owned(),
            layers: vec![LayerRef::Stored { digest }],
            env: vec![("PATH".to_owned(), DEFAULT_PATH.to_owned())],
            workdir: "/".to_owned(),
            user: None,
            source: TemplateSource::RootfsTar,
        };
        self.write_record(&template)?;
        Ok(template)
    }

    /// Imports an OCI image layout or a `docker save` tarball (directory or tar stream) as a
    /// template: layers in manifest order, env/workdir/user from the image config. Blob digests
    /// and `diff_id`s are verified.
    pub fn import_oci(
        &self,
        name: &str,
        source: OciSource<'_>,
        limits: &ImportLimits,
    ) -> Result<Template, TemplateError> {
        self.check_new_name(name)?;
        let _guard = self.gc_lock.read().unwrap_or_else(|p| p.into_inner());
        let staging;
        let root: &Path = match source {
            OciSource::Dir(dir) => dir,
            OciSource::Tar(reader) => {
                staging = tempfile::Builder::new()
                    .prefix("image-")
                    .tempdir_in(&self.layers.tmp)
                    .map_err(|e| TemplateError::io("create temp dir", &self.layers.tmp, e))?;
                let mut budget = Budget::new(limits);
                unpack::unpack_stream(reader, staging.path(), &mut budget, UnpackMode::Staging)?;
                staging.path()
            }
        };
        let image: ParsedImage = oci::parse_image(root, limits)?;
        let mut budget = Budget::new(limits);
        let mut layers = Vec::with_capacity(image.layers.len());
        for blob in &image.layers {
            let digest = self.import_blob(blob, &mut budget)?;
            layers.push(LayerRef::Stored { digest });
        }
        let template = Template {
            name: name.to_owned(),
            layers,
            env: image.env,
            workdir: image.workdir,
            user: image.user,
            source: image.source,
        };
        self.write_record(&template)?;
        Ok(template)
    }

    fn import_blob(
        &self,
        blob: &oci::LayerBlob,
        budget: &mut Budget,
    ) -> Result<Digest, TemplateError> {
        if let Some(diff_id) = &blob.diff_id {
            if self.layers.contains(diff_id) {
                return Ok(diff_id.clone());
            }
        }
        let file = oci::open_file(&blob.path)?;
        let mut raw = MeteredReader::new(file, u64::MAX);
        let staged = self.layers.stage(&mut raw, budget)?;
        raw.drain()
            .map_err(|source| TemplateError::ReadArchive { source })?;
        check_digest(blob.blob_digest.as_ref(), &raw.digest())?;
        check_digest(blob.diff_id.as_ref(), staged.digest())?;
        staged.commit()
    }

    /// Adds a layer fetched from elsewhere (another node, the cluster's origin store): it must
    /// hash to `digest`. Answers the bytes read (0 when the layer was here already).
    pub fn fetch_layer(
        &self,
        reader: impl Read,
        digest: &Digest,
        limits: &ImportLimits,
    ) -> Result<u64, TemplateError> {
        let _guard = self.gc_lock.read().unwrap_or_else(|p| p.into_inner());
        if self.layers.contains(digest) {
            return Ok(0);
        }
        self.layers
            .import(reader, Some(digest), limits)
            .map(|(_, bytes)| bytes)
    }

    /// Records a template imported elsewhere whose layers are all here now (fetched with
    /// [`TemplateStore::fetch_layer`]). A record of the same name already here is kept.
    pub fn adopt(&self, template: &Template) -> Result<(), TemplateError> {
        validate_name(&template.name)?;
        if template.name == HOST_TEMPLATE || self.record_path(&template.name).exists() {
            return Ok(());
        }
        if let Some(missing) = stored_layers(template).find(|d| !self.layers.contains(d)) {
            return Err(TemplateError::InvalidImage {
                reason: format!("layer {missing} of template {} is missing", template.name),
            });
        }
        match self.write_record(template) {
            Err(TemplateError::AlreadyExists { .. }) => Ok(()),
            r => r,
        }
    }

    /// Records the new template `t` (its name must be free).
    pub(super) fn put_new(&self, t: &Template) -> Result<(), TemplateError> {
        self.check_new_name(&t.name)?;
        self.write_record(t)
    }

    /// Runs `f` (which imports layers and records a template naming them) while layer
    /// collection waits.
    pub(super) fn importing<T>(&self, f: impl FnOnce() -> T) -> T {
        let _guard = self.gc_lock.read().unwrap_or_else(|p| p.into_inner());
        f()
    }

    fn check_new_name(&self, name: &str) -> Result<(), TemplateError> {
        validate_name(name)?;
        if name == HOST_TEMPLATE {
            return Err(TemplateError::Builtin {
                name: name.to_owned(),
            });
        }
        if self.record_path(name).exists() {
            return Err(TemplateError::AlreadyExists {
                name: name.to_owned(),
            });
        }
        Ok(())
    }

    /// Writes a template record atomically, refusing to replace an existing one.
    fn write_record(&self, template: &Template) -> Result<(), TemplateError> {
        let path = self.record_path(&template.name);
        let json = serde_json::to_vec_pretty(template)
            .map_err(|e| TemplateError::io("serialize template", &path, io::Error::other(e)))?;
        let mut tmp = tempfile::Builder::new()
            .prefix(".tmp-")
            .tempfile_in(&self.templates)
            .map_err(|e| TemplateError::io("create temp file", &self.templates, e))?;
        tmp.write_all(&json)
            .and_then(|()| tmp.as_file().sync_all())
            .map_err(|e| TemplateError::io("write template", tmp.path(), e))?;
        tmp.persist_noclobber(&path).map_err(|e| {
            if e.error.kind() == io::ErrorKind::AlreadyExists {
                TemplateError::AlreadyExists {
                    name: template.name.clone(),
                }
            } else {
                TemplateError::io("persist template", &path, e.error)
            }
        })?;
        Ok(())
    }
}
