//! Templates and the content-addressed layer store.
//!
//! A *layer* is an immutable, unpacked directory tree stored at
//! `<data_dir>/layers/<sha256-hex>/`, where the digest is the sha256 of the layer's
//! **uncompressed** tar stream (so it equals an OCI `diff_id` / `docker save` layer id). Layers
//! are used as overlayfs lowerdirs and are shared by every template that references them.
//!
//! A *template* is a named recipe persisted as `<data_dir>/templates/<name>.json`: an ordered
//! list of layers (bottom → top), environment, working directory and user. The built-in `host`
//! template is always present: the host's `/` read-only under a generated mask layer
//! ([`host_mask_layer`]) that hides secrets and per-host state.
//!
//! Every tar this module reads is hostile input; see [`unpack`] for the rules.
//!
//! Code map: `store.rs` ([`LayerStore`], [`TemplateStore`]), `unpack.rs` (tar unpacking),
//! `oci.rs` (OCI image layout and `docker save` parsing), `host.rs` (the host mask layer).

mod commit;
mod host;
mod oci;
mod store;
pub mod unpack;

use std::fmt;
use std::io;
use std::path::PathBuf;

use dsec_api::ErrorCode;
use serde::{Deserialize, Serialize};

pub use host::{
    host_mask_layer, shares_filesystem_with_root, stage_layer, HIDDEN_DIRS, HIDDEN_FILES,
    VISIBLE_TOP,
};
pub use oci::{detect_archive, detect_dir, ImageFormat, OciSource};
pub use store::{LayerStore, TemplateStore};
pub use unpack::unpack_layer;

/// Name of the built-in template that exposes the host root read-only.
pub const HOST_TEMPLATE: &str = "host";

/// Default `PATH` given to templates whose image does not set one.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Errors of the template and layer store.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// A template name does not match `[a-z0-9][a-z0-9._-]{0,62}`.
    #[error("invalid template name {name:?}: must match [a-z0-9][a-z0-9._-]{{0,62}}")]
    InvalidName {
        /// The rejected name.
        name: String,
    },
    /// No template with this name exists.
    #[error("template {name:?} not found")]
    NotFound {
        /// The requested name.
        name: String,
    },
    /// A template with this name already exists.
    #[error("template {name:?} already exists")]
    AlreadyExists {
        /// The conflicting name.
        name: String,
    },
    /// The template is built in (`host`) and cannot be replaced or deleted.
    #[error("template {name:?} is built in")]
    Builtin {
        /// The built-in name.
        name: String,
    },
    /// The template is used by a live sandbox.
    #[error("template {name:?} is in use")]
    InUse {
        /// The template name.
        name: String,
    },
    /// A tar entry was refused or could not be unpacked.
    #[error("unpack entry {entry:?}: {reason}")]
    Unpack {
        /// The entry's path as found in the archive (lossy UTF-8, truncated).
        entry: String,
        /// Why it was refused.
        reason: &'static str,
    },
    /// A tar entry's path or link target would resolve outside the layer root.
    #[error("unpack entry {entry:?}: path escapes the layer root")]
    PathEscape {
        /// The entry's path as found in the archive (lossy UTF-8, truncated).
        entry: String,
    },
    /// An import limit was exceeded; unpacking stopped at the limit.
    #[error("import limit exceeded: {what} (limit {limit})")]
    LimitExceeded {
        /// Which limit (`"total bytes"`, `"entries"`, `"file size"`, `"path length"`, `"layers"`).
        what: &'static str,
        /// The configured limit.
        limit: u64,
    },
    /// Content did not hash to the digest its descriptor promised.
    #[error("digest mismatch: expected {expected}, got {actual}")]
    DigestMismatch {
        /// The digest named by the manifest/config.
        expected: String,
        /// The digest of the bytes actually read.
        actual: String,
    },
    /// The image layout or manifest is malformed.
    #[error("invalid image: {reason}")]
    InvalidImage {
        /// What is wrong.
        reason: String,
    },
    /// The image uses a feature this build does not support (e.g. zstd layers).
    #[error("unsupported image: {reason}")]
    Unsupported {
        /// The unsupported feature.
        reason: String,
    },
    /// An image JSON document (manifest, index, config) failed to parse.
    #[error("parse image {what}")]
    ImageJson {
        /// Which document.
        what: String,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
    /// The archive stream itself is unreadable (truncated, bad checksum, bad gzip).
    #[error("read archive")]
    ReadArchive {
        /// The underlying read error.
        #[source]
        source: io::Error,
    },
    /// A stored template file is corrupt.
    #[error("parse stored template {path}")]
    Corrupt {
        /// The template file.
        path: PathBuf,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
    /// A filesystem operation of the store failed.
    #[error("{op} {path}")]
    Io {
        /// The operation (`"create dir"`, `"rename"` ...).
        op: &'static str,
        /// The path it was applied to.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

impl TemplateError {
    /// The stable API error code for this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            TemplateError::NotFound { .. } => ErrorCode::TemplateNotFound,
            TemplateError::InvalidName { .. }
            | TemplateError::AlreadyExists { .. }
            | TemplateError::Builtin { .. } => ErrorCode::InvalidRequest,
            TemplateError::InUse { .. } => ErrorCode::InvalidTransition,
            TemplateError::Unpack { .. }
            | TemplateError::PathEscape { .. }
            | TemplateError::DigestMismatch { .. }
            | TemplateError::InvalidImage { .. }
            | TemplateError::Unsupported { .. }
            | TemplateError::ImageJson { .. }
            | TemplateError::ReadArchive { .. } => ErrorCode::TemplateInvalid,
            TemplateError::LimitExceeded { .. } => ErrorCode::ResourceExhausted,
            TemplateError::Io { source, .. }
                if source.raw_os_error() == Some(libc::ENOSPC)
                    || source.raw_os_error() == Some(libc::EDQUOT) =>
            {
                ErrorCode::ResourceExhausted
            }
            TemplateError::Io { .. } | TemplateError::Corrupt { .. } => ErrorCode::Internal,
        }
    }

    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        TemplateError::Io {
            op,
            path: path.into(),
            source,
        }
    }
}

/// Limits enforced while importing an image, checked while streaming.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImportLimits {
    /// Total uncompressed tar bytes over all layers of one import.
    pub max_bytes: u64,
    /// Total tar entries over all layers of one import.
    pub max_entries: u64,
    /// Size of any single file.
    pub max_file_bytes: u64,
    /// Length in bytes of any entry path or link target.
    pub max_path_len: usize,
    /// Number of layers of one image.
    pub max_layers: usize,
}

impl Default for ImportLimits {
    fn default() -> Self {
        ImportLimits {
            max_bytes: 16 << 30,
            max_entries: 1_000_000,
            max_file_bytes: 8 << 30,
            max_path_len: 4096,
            max_layers: 128,
        }
    }
}

/// A sha256 digest (64 lowercase hex digits); serialized as `sha256:<hex>`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Digest(String);

impl Digest {
    /// Parses `sha256:<hex>` or a bare 64-digit lowercase hex string.
    pub fn parse(s: &str) -> Option<Digest> {
        let hex = s.strip_prefix("sha256:").unwrap_or(s);
        Digest::from_hex(hex)
    }

    /// Parses a bare 64-digit lowercase hex string.
    pub fn from_hex(hex: &str) -> Option<Digest> {
        let ok = hex.len() == 64 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        ok.then(|| Digest(hex.to_owned()))
    }

    /// The digest of a finished sha256 hasher.
    pub(crate) fn from_hasher(h: sha2::Sha256) -> Digest {
        use sha2::Digest as _;
        Digest(hex::encode(h.finalize()))
    }

    /// The 64 hex digits, without the `sha256:` prefix.
    pub fn hex(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", self.0)
    }
}

impl TryFrom<String> for Digest {
    type Error = String;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        Digest::parse(&s).ok_or_else(|| format!("invalid sha256 digest {s:?}"))
    }
}

impl From<Digest> for String {
    fn from(d: Digest) -> String {
        d.to_string()
    }
}

/// One layer of a template.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum LayerRef {
    /// A layer of the content-addressed store, `<data_dir>/layers/<hex>`.
    Stored {
        /// Digest of the layer's uncompressed tar stream.
        digest: Digest,
    },
    /// The host's root filesystem `/`, read-only.
    HostRoot,
    /// The generated host mask layer, `<data_dir>/host-mask/<id>` (see [`host_mask_layer`]).
    HostMask {
        /// Directory name of the mask layer (a hash of its contents).
        id: String,
    },
}

/// Where a template came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum TemplateSource {
    /// The built-in host template.
    Host,
    /// A root filesystem tarball (one layer).
    RootfsTar,
    /// An OCI image layout.
    Oci {
        /// Digest of the image manifest that was imported.
        manifest: Digest,
    },
    /// A `docker save` tarball.
    DockerSave,
    /// Committed from a snapshot (`dsec template build` commits its last step's).
    Snapshot {
        /// The snapshot's id.
        id: String,
    },
}

/// A named template: ordered layers plus process defaults.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Template {
    /// The template's name (validated by [`validate_name`]).
    pub name: String,
    /// Layers, bottom → top (see [`TemplateStore::lowerdirs`] for overlayfs order).
    pub layers: Vec<LayerRef>,
    /// Environment variables, in image order.
    pub env: Vec<(String, String)>,
    /// Absolute working directory for processes.
    pub workdir: String,
    /// The image's `User` (e.g. `"1000:1000"`, `"app"`), if it set one.
    #[serde(default)]
    pub user: Option<String>,
    /// Where the template came from.
    pub source: TemplateSource,
}

/// Checks a template name against `[a-z0-9][a-z0-9._-]{0,62}`.
pub fn validate_name(name: &str) -> Result<(), TemplateError> {
    let b = name.as_bytes();
    let ok = !b.is_empty()
        && b.len() <= 63
        && matches!(b[0], b'a'..=b'z' | b'0'..=b'9')
        && b[1..]
            .iter()
            .all(|c| matches!(c, b'a'..=b'z' | b'0'..=b'9' | b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(TemplateError::InvalidName {
            name: name.chars().take(100).collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        for good in ["a", "host", "py3.12-slim", "0_x", &"a".repeat(63)] {
            assert!(validate_name(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "A",
            "-a",
            ".a",
            "a/b",
            "a b",
            "..",
            &"a".repeat(64),
            "é",
        ] {
            assert!(validate_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn digest_roundtrip() {
        let hex = "ab".repeat(32);
        let d = Digest::from_hex(&hex).expect("valid");
        let json = serde_json::to_string(&d).expect("ser");
        assert_eq!(json, format!("\"sha256:{hex}\""));
        let back: Digest = serde_json::from_str(&json).expect("de");
        assert_eq!(back, d);
        assert!(Digest::parse("sha256:AB").is_none());
        assert!(Digest::parse(&"g".repeat(64)).is_none());
    }

    #[test]
    fn codes() {
        let e = TemplateError::NotFound { name: "x".into() };
        assert_eq!(e.code(), ErrorCode::TemplateNotFound);
        let e = TemplateError::LimitExceeded {
            what: "entries",
            limit: 1,
        };
        assert_eq!(e.code(), ErrorCode::ResourceExhausted);
        let e = TemplateError::PathEscape { entry: "x".into() };
        assert_eq!(e.code(), ErrorCode::TemplateInvalid);
        let e = TemplateError::io("x", "/", io::Error::from_raw_os_error(libc::ENOSPC));
        assert_eq!(e.code(), ErrorCode::ResourceExhausted);
    }
}
