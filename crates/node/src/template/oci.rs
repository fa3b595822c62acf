//! Parsing OCI image layouts and `docker save` tarballs into an ordered list of layer blobs
//! plus the image config (env, workdir, user).
//!
//! The image is read from a directory: either the caller's directory or a staging copy of a
//! tar stream unpacked by the store (with the same hostile-input rules as layers). Every path
//! named by the image is resolved *beneath* that directory: symlinks inside it (newer
//! `docker save` writes `<id>/layer.tar -> ../blobs/sha256/..`) are followed as if the
//! directory were `/`, so nothing outside it is ever opened.
//!
//! - **OCI layout** (`oci-layout` present): `index.json` → manifest (nested indexes are
//!   followed; among several, the one for `linux/<host arch>` wins, else the first without a
//!   platform, else the first) → config + layers. Every blob is verified against its
//!   descriptor's digest (and size); layers also against the config's `rootfs.diff_ids`.
//! - **docker save** (`manifest.json`): the first image's `Config` and `Layers`; layers are
//!   verified against `rootfs.diff_ids`, and files named `<hex>.json` / `blobs/sha256/<hex>`
//!   against their name.

use std::fs::{self, File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Component, Path, PathBuf};

use serde::Deserialize;
use sha2::{Digest as _, Sha256};

use super::{Digest, ImportLimits, TemplateError, TemplateSource};

/// Largest JSON document (index, manifest, config) read from an image.
const MAX_JSON_BYTES: u64 = 4 << 20;
/// Symlinks followed while resolving one path inside an image directory.
const MAX_SYMLINKS: usize = 40;
/// Nesting of image indexes followed.
const MAX_INDEX_DEPTH: usize = 3;

/// Where an image to import comes from.
pub enum OciSource<'a> {
    /// An unpacked OCI image layout or `docker save` directory.
    Dir(&'a Path),
    /// A tar stream (plain or gzip'd) of an OCI image layout or a `docker save` tarball. It is
    /// unpacked into a staging directory under the data dir first (its size counted against
    /// the same [`ImportLimits`], separately from the layers).
    Tar(&'a mut dyn Read),
}

/// One layer of a parsed image.
#[derive(Debug)]
pub(crate) struct LayerBlob {
    /// The blob file, resolved beneath the image directory.
    pub(crate) path: PathBuf,
    /// Digest of the blob as stored (compressed), when the image names it.
    pub(crate) blob_digest: Option<Digest>,
    /// Digest of the uncompressed tar stream, when the config lists it.
    pub(crate) diff_id: Option<Digest>,
}

/// What the store needs from an image.
#[derive(Debug)]
pub(crate) struct ParsedImage {
    pub(crate) layers: Vec<LayerBlob>,
    pub(crate) env: Vec<(String, String)>,
    pub(crate) workdir: String,
    pub(crate) user: Option<String>,
    pub(crate) source: TemplateSource,
}

#[derive(Deserialize)]
struct Descriptor {
    #[serde(rename = "mediaType", default)]
    media_type: String,
    digest: String,
    #[serde(default)]
    size: Option<u64>,
    #[serde(default)]
    platform: Option<Platform>,
}

#[derive(Deserialize)]
struct Platform {
    #[serde(default)]
    architecture: String,
    #[serde(default)]
    os: String,
}

/// An image index or an image manifest (told apart by which fields are present).
#[derive(Deserialize)]
struct AnyManifest {
    #[serde(default)]
    manifests: Option<Vec<Descriptor>>,
    #[serde(default)]
    config: Option<Descriptor>,
    #[serde(default)]
    layers: Option<Vec<Descriptor>>,
}

#[derive(Deserialize, Default)]
struct ImageConfig {
    #[serde(default)]
    config: Option<ProcessConfig>,
    #[serde(default)]
    rootfs: Option<RootFs>,
}

#[derive(Deserialize, Default)]
struct ProcessConfig {
    #[serde(rename = "Env", default)]
    env: Option<Vec<String>>,
    #[serde(rename = "WorkingDir", default)]
    working_dir: Option<String>,
    #[serde(rename = "User", default)]
    user: Option<String>,
}

#[derive(Deserialize)]
struct RootFs {
    #[serde(default)]
    diff_ids: Vec<String>,
}

#[derive(Deserialize)]
struct DockerManifestEntry {
    #[serde(rename = "Config")]
    config: String,
    #[serde(rename = "Layers")]
    layers: Vec<String>,
}

/// Fails with [`TemplateError::DigestMismatch`] when `expected` is given and is not `actual`.
pub(crate) fn check_digest(
    expected: Option<&Digest>,
    actual: &Digest,
) -> Result<(), TemplateError> {
    match expected {
        Some(e) if e != actual => Err(TemplateError::DigestMismatch {
            expected: e.to_string(),
            actual: actual.to_string(),
        }),
        _ => Ok(()),
    }
}

fn invalid(reason: impl Into<String>) -> TemplateError {
    TemplateError::InvalidImage {
        reason: reason.into(),
    }
}

/// Resolves `rel` beneath `root`, following symlinks as if `root` were `/`. The result has no
/// symlink in any component (the last one may be missing).
pub(crate) fn resolve_beneath(root: &Path, rel: &str) -> Result<PathBuf, TemplateError> {
    let mut pending: Vec<std::ffi::OsString> = Path::new(rel)
        .components()
        .rev()
        .filter_map(|c| match c {
            Component::Normal(s) => Some(s.to_owned()),
            Component::ParentDir => Some("..".into()),
            _ => None,
        })
        .collect();
    let mut stack: Vec<std::ffi::OsString> = Vec::new();
    let mut links = 0;
    while let Some(c) = pending.pop() {
        if c == ".." {
            stack.pop();
            continue;
        }
        let mut p = root.to_path_buf();
        p.extend(&stack);
        p.push(&c);
        match fs::symlink_metadata(&p) {
            Ok(m) if m.file_type().is_symlink() => {
                links += 1;
                if links > MAX_SYMLINKS {
                    return Err(invalid(format!("too many symlinks resolving {rel:?}")));
                }
                let target = fs::read_link(&p).map_err(|e| TemplateError::io("readlink", &p, e))?;
                if target.is_absolute() {
                    stack.clear();
                }
                for tc in target.components().rev() {
                    match tc {
                        Component::Normal(s) => pending.push(s.to_owned()),
                        Component::ParentDir => pending.push("..".into()),
                        _ => {}
                    }
                }
            }
            _ => stack.push(c),
        }
    }
    let mut p = root.to_path_buf();
    p.extend(&stack);
    Ok(p)
}

/// Opens a regular file without following a final symlink.
pub(crate) fn open_file(path: &Path) -> Result<File, TemplateError> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => invalid(format!("missing file {}", path.display())),
            _ => TemplateError::io("open", path, e),
        })?;
    let meta = file
        .metadata()
        .map_err(|e| TemplateError::io("stat", path, e))?;
    if !meta.is_file() {
        return Err(invalid(format!("{} is not a regular file", path.display())));
    }
    Ok(file)
}

/// Reads a small file (at most [`MAX_JSON_BYTES`]) and returns its bytes and sha256.
fn read_small(path: &Path) -> Result<(Vec<u8>, Digest), TemplateError> {
    let file = open_file(path)?;
    let mut buf = Vec::new();
    file.take(MAX_JSON_BYTES + 1)
        .read_to_end(&mut buf)
        .map_err(|e| TemplateError::io("read", path, e))?;
    if buf.len() as u64 > MAX_JSON_BYTES {
        return Err(TemplateError::LimitExceeded {
            what: "image metadata size",
            limit: MAX_JSON_BYTES,
        });
    }
    let digest = Digest::from_hasher(Sha256::new_with_prefix(&buf));
    Ok((buf, digest))
}

fn parse_json<T: for<'de> Deserialize<'de>>(bytes: &[u8], what: &str) -> Result<T, TemplateError> {
    serde_json::from_slice(bytes).map_err(|source| TemplateError::ImageJson {
        what: what.to_owned(),
        source,
    })
}

fn parse_digest(s: &str) -> Result<Digest, TemplateError> {
    if let Some((alg, _)) = s.split_once(':') {
        if alg != "sha256" {
            return Err(TemplateError::Unsupported {
                reason: format!("digest algorithm {alg:?}"),
            });
        }
    }
    Digest::parse(s).ok_or_else(|| invalid(format!("malformed digest {s:?}")))
}

fn blob_path(root: &Path, digest: &Digest) -> Result<PathBuf, TemplateError> {
    resolve_beneath(root, &format!("blobs/sha256/{}", digest.hex()))
}

/// Reads and verifies a small blob named by a descriptor.
fn read_blob(root: &Path, desc: &Descriptor) -> Result<(Vec<u8>, Digest), TemplateError> {
    let digest = parse_digest(&desc.digest)?;
    let (bytes, actual) = read_small(&blob_path(root, &digest)?)?;
    check_digest(Some(&digest), &actual)?;
    if let Some(size) = desc.size {
        if size != bytes.len() as u64 {
            return Err(invalid(format!("blob {digest} has the wrong size")));
        }
    }
    Ok((bytes, digest))
}

fn host_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        other => other,
    }
}

/// Picks the descriptor for this host among an index's manifests.
fn pick(manifests: &[Descriptor]) -> Option<&Descriptor> {
    manifests
        .iter()
        .find(|d| {
            d.platform
                .as_ref()
                .is_some_and(|p| p.os == "linux" && p.architecture == host_arch())
        })
        .or_else(|| manifests.iter().find(|d| d.platform.is_none()))
        .or_else(|| manifests.first())
}

/// What an archive or directory to import holds, told by its top-level names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageFormat {
    /// An OCI image layout (`oci-layout`, `index.json`).
    OciLayout,
    /// A `docker save` archive (`manifest.json`).
    DockerSave,
    /// Neither: a root filesystem.
    Rootfs,
}

impl ImageFormat {
    fn of_top_level(name: &str) -> Option<Self> {
        match name {
            "oci-layout" | "index.json" => Some(Self::OciLayout),
            "manifest.json" => Some(Self::DockerSave),
            _ => None,
        }
    }
}

/// Tells the format of a (plain or gzip'd) tar stream from its entry names, reading headers
/// only as far as needed: an image at its first `oci-layout`, `index.json` or `manifest.json`
/// at the top level, a root filesystem at the end (at most `limits.max_entries` entries and
/// `limits.max_bytes` uncompressed bytes are read).
pub fn detect_archive(
    mut raw: impl Read,
    limits: &ImportLimits,
) -> Result<ImageFormat, TemplateError> {
    let read_err = |source| TemplateError::ReadArchive { source };
    let mut head = [0u8; 4];
    let mut n = 0;
    while n < head.len() {
        match raw.read(&mut head[n..]).map_err(read_err)? {
            0 => break,
            k => n += k,
        }
    }
    let chained = std::io::Cursor::new(head[..n].to_vec()).chain(raw);
    let decoded: Box<dyn Read + '_> = if head[..n].starts_with(&[0x1f, 0x8b]) {
        Box::new(flate2::read::MultiGzDecoder::new(chained))
    } else if head[..n].starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        return Err(TemplateError::Unsupported {
            reason: "zstd-compressed archive".into(),
        });
    } else {
        Box::new(chained)
    };
    let mut archive = tar::Archive::new(decoded.take(limits.max_bytes));
    for (i, entry) in archive.entries().map_err(read_err)?.enumerate() {
        if i as u64 >= limits.max_entries {
            return Err(TemplateError::LimitExceeded {
                what: "entries",
                limit: limits.max_entries,
            });
        }
        let entry = entry.map_err(read_err)?;
        let raw_path = entry.path_bytes();
        let name = String::from_utf8_lossy(&raw_path);
        let name = name.trim_start_matches("./").trim_start_matches('/');
        if let Some(f) = ImageFormat::of_top_level(name) {
            return Ok(f);
        }
    }
    Ok(ImageFormat::Rootfs)
}

/// Tells the format of an unpacked image directory (a root filesystem when it holds none of
/// `oci-layout`, `index.json`, `manifest.json`).
pub fn detect_dir(dir: &Path) -> ImageFormat {
    ["oci-layout", "index.json", "manifest.json"]
        .into_iter()
        .filter(|n| dir.join(n).exists())
        .find_map(ImageFormat::of_top_level)
        .unwrap_or(ImageFormat::Rootfs)
}

/// Parses the image under `root` (OCI layout if `oci-layout` exists, else `docker save`).
pub(crate) fn parse_image(
    root: &Path,
    limits: &ImportLimits,
) -> Result<ParsedImage, TemplateError> {
    if resolve_beneath(root, "oci-layout")?.exists() {
        parse_oci(root, limits)
    } else if resolve_beneath(root, "manifest.json")?.exists() {
        parse_docker(root, limits)
    } else {
        Err(invalid(
            "neither an OCI layout (oci-layout) nor a docker save (manifest.json)",
        ))
    }
}

fn parse_oci(root: &Path, limits: &ImportLimits) -> Result<ParsedImage, TemplateError> {
    let (bytes, _) = read_small(&resolve_beneath(root, "index.json")?)?;
    let mut doc: AnyManifest = parse_json(&bytes, "index.json")?;
    let mut manifest_digest = None;
    for _ in 0..=MAX_INDEX_DEPTH {
        let Some(manifests) = &doc.manifests else {
            break;
        };
        let desc = pick(manifests).ok_or_else(|| invalid("image index lists no manifests"))?;
        if desc.media_type.contains("layer") {
            return Err(invalid("index entry is not a manifest"));
        }
        let (bytes, digest) = read_blob(root, desc)?;
        doc = parse_json(&bytes, &format!("manifest {digest}"))?;
        manifest_digest = Some(digest);
    }
    let (Some(manifest), None) = (manifest_digest, &doc.manifests) else {
        return Err(invalid(
            "no image manifest found (indexes nested too deep?)",
        ));
    };
    let config_desc = doc
        .config
        .as_ref()
        .ok_or_else(|| invalid("manifest has no config"))?;
    let layer_descs = doc.layers.as_deref().unwrap_or_default();
    if layer_descs.len() > limits.max_layers {
        return Err(TemplateError::LimitExceeded {
            what: "layers",
            limit: limits.max_layers as u64,
        });
    }
    let (bytes, _) = read_blob(root, config_desc)?;
    let config: ImageConfig = parse_json(&bytes, "image config")?;
    let diff_ids = diff_ids(&config, layer_descs.len())?;
    let mut layers = Vec::with_capacity(layer_descs.len());
    for (i, desc) in layer_descs.iter().enumerate() {
        if desc.media_type.contains("zstd") {
            return Err(TemplateError::Unsupported {
                reason: format!("layer media type {:?}", desc.media_type),
            });
        }
        let digest = parse_digest(&desc.digest)?;
        let path = blob_path(root, &digest)?;
        if let Some(size) = desc.size {
            let len = fs::symlink_metadata(&path)
                .map_err(|_| invalid(format!("missing layer blob {digest}")))?
                .len();
            if len != size {
                return Err(invalid(format!("layer blob {digest} has the wrong size")));
            }
        }
        layers.push(LayerBlob {
            path,
            blob_digest: Some(digest),
            diff_id: diff_ids.get(i).cloned(),
        });
    }
    Ok(parsed_image(
        layers,
        config,
        TemplateSource::Oci { manifest },
    ))
}

fn parse_docker(root: &Path, limits: &ImportLimits) -> Result<ParsedImage, TemplateError> {
    let (bytes, _) = read_small(&resolve_beneath(root, "manifest.json")?)?;
    let entries: Vec<DockerManifestEntry> = parse_json(&bytes, "manifest.json")?;
    let entry = entries
        .first()
        .ok_or_else(|| invalid("manifest.json lists no images"))?;
    if entry.layers.len() > limits.max_layers {
        return Err(TemplateError::LimitExceeded {
            what: "layers",
            limit: limits.max_layers as u64,
        });
    }
    let (bytes, actual) = read_small(&resolve_beneath(root, &entry.config)?)?;
    check_digest(digest_from_name(&entry.config).as_ref(), &actual)?;
    let config: ImageConfig = parse_json(&bytes, "image config")?;
    let diff_ids = diff_ids(&config, entry.layers.len())?;
    let mut layers = Vec::with_capacity(entry.layers.len());
    for (i, name) in entry.layers.iter().enumerate() {
        layers.push(LayerBlob {
            path: resolve_beneath(root, name)?,
            blob_digest: digest_from_name(name).filter(|_| name.starts_with("blobs/")),
            diff_id: diff_ids.get(i).cloned(),
        });
    }
    Ok(parsed_image(layers, config, TemplateSource::DockerSave))
}

/// The digest a `docker save` file name promises: `<hex>.json` or `blobs/sha256/<hex>`.
fn digest_from_name(name: &str) -> Option<Digest> {
    let file = name.rsplit('/').next()?;
    if let Some(hex) = file.strip_suffix(".json") {
        return Digest::from_hex(hex);
    }
    name.strip_prefix("blobs/sha256/")
        .and_then(Digest::from_hex)
}

fn diff_ids(config: &ImageConfig, n_layers: usize) -> Result<Vec<Digest>, TemplateError> {
    let Some(rootfs) = &config.rootfs else {
        return Ok(Vec::new());
    };
    if rootfs.diff_ids.len() != n_layers {
        return Err(invalid(format!(
            "config lists {} diff_ids for {n_layers} layers",
            rootfs.diff_ids.len()
        )));
    }
    rootfs.diff_ids.iter().map(|d| parse_digest(d)).collect()
}

/// The parsed image: `layers`, `source` and the process settings of `config` (environment,
/// working directory made absolute, `/` by default; user, if not empty).
fn parsed_image(
    layers: Vec<LayerBlob>,
    config: ImageConfig,
    source: TemplateSource,
) -> ParsedImage {
    let pc = config.config.unwrap_or_default();
    let env: Vec<(String, String)> = pc
        .env
        .unwrap_or_default()
        .into_iter()
        .filter_map(|kv| {
            kv.split_once('=')
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
        })
        .collect();
    let workdir = match pc.working_dir.as_deref() {
        None | Some("") => "/".to_owned(),
        Some(w) if w.starts_with('/') => w.to_owned(),
        Some(w) => format!("/{w}"),
    };
    let user = pc.user.filter(|u| !u.is_empty());
    ParsedImage {
        layers,
        env,
        workdir,
        user,
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolve_stays_beneath() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let root = dir.path();
        fs::create_dir_all(root.join("blobs/sha256"))?;
        fs::write(root.join("blobs/sha256/x"), b"x")?;
        std::os::unix::fs::symlink("../blobs/sha256/x", root.join("rel"))?;
        std::os::unix::fs::symlink("/blobs/sha256/x", root.join("abs"))?;
        std::os::unix::fs::symlink("../../../../etc/passwd", root.join("esc"))?;
        std::os::unix::fs::symlink("loop", root.join("loop"))?;
        assert_eq!(resolve_beneath(root, "rel")?, root.join("blobs/sha256/x"));
        assert_eq!(resolve_beneath(root, "abs")?, root.join("blobs/sha256/x"));
        assert_eq!(resolve_beneath(root, "esc")?, root.join("etc/passwd"));
        assert_eq!(resolve_beneath(root, "../../x")?, root.join("x"));
        assert!(resolve_beneath(root, "loop").is_err());
        Ok(())
    }

    #[test]
    fn names_promise_digests() {
        let hex = "ab".repeat(32);
        assert!(digest_from_name(&format!("{hex}.json")).is_some());
        assert!(digest_from_name(&format!("blobs/sha256/{hex}")).is_some());
        assert!(digest_from_name("abc/layer.tar").is_none());
    }
}
