//! Templates across a cluster: imported once, fetched by the nodes that need them.
//!
//! A template imported on a node (through a gateway, on any node) is *published*: the
//! uncompressed tar of each of its layers (kept since the node joined, see
//! [`crate::template::LayerStore::keep_blobs`]) is copied to the cluster's origin store
//! (`--template-store`: a shared directory, or an S3-compatible bucket), under `blobs/<sha256>`, and the template's record goes to etcd
//! (`templates/<name>`). From then on every node knows the template.
//!
//! A node asked to create a sandbox of a template it does not hold *fetches* it first, each
//! missing layer from, in turn:
//!
//! 1. a peer: a live node whose report lists the template, over its
//!    `GET /v1/cluster/layers/{sha256}` (authenticated by the cluster secret in etcd);
//! 2. the origin store.
//!
//! Every layer is verified: it is unpacked through the same checks as an import and must hash to
//! its digest, or the next source is tried. The sandbox shows the `fetching` phase meanwhile, and
//! its view's `fetched` says how many layers and bytes came from where, and how long it took.
//! Concurrent creates of one template fetch it once.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use dsec_api::sandbox::Fetched;
use dsec_cluster::etcd::EtcdError;
use dsec_cluster::model::{self, NodeReport};

use super::Member;
use crate::template::{Digest, ImportLimits, LayerRef, Template, TemplateStore};

/// The header a node's layer call carries the cluster secret in.
pub const SECRET_HEADER: &str = "x-dsec-cluster-secret";

/// How long a peer may take to start answering a layer call.
const PEER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The cluster's origin store of layer blobs: a directory every node mounts, or an
/// S3-compatible bucket ([`super::s3`]).
#[derive(Debug, Clone)]
pub enum Origin {
    /// `<dir>/blobs/<sha256>`.
    Dir(PathBuf),
    /// `s3://bucket/prefix`: `<prefix>/blobs/<sha256>`.
    S3(super::s3::S3),
}

impl Origin {
    /// The store `spec` names: `s3://bucket[/prefix]`, or a directory (created if needed).
    pub fn open(spec: &str) -> Result<Self, String> {
        if spec.starts_with("s3://") {
            return super::s3::S3::from_url(spec).map(Origin::S3);
        }
        let root = PathBuf::from(spec);
        std::fs::create_dir_all(root.join("blobs")).map_err(|e| format!("{spec}: {e}"))?;
        Ok(Origin::Dir(root))
    }

    /// Copies a blob in: written aside and renamed in a directory (readers see it whole or
    /// not at all); uploaded to a bucket unless there already.
    fn put(&self, agent: &ureq::Agent, d: &Digest, src: &Path) -> Result<(), String> {
        match self {
            Origin::S3(s3) => s3.put(agent, d.hex(), src),
            Origin::Dir(root) => {
                let dst = root.join("blobs").join(d.hex());
                if dst.exists() {
                    return Ok(());
                }
                let tmp = tempfile::Builder::new()
                    .prefix(".tmp-")
                    .tempfile_in(root.join("blobs"))
                    .map_err(|e| e.to_string())?;
                std::fs::copy(src, tmp.path()).map_err(|e| e.to_string())?;
                tmp.persist(&dst).map_err(|e| e.error.to_string())?;
                Ok(())
            }
        }
    }

    /// Reads a blob.
    fn read(&self, agent: &ureq::Agent, d: &Digest) -> Result<Box<dyn Read + Send>, String> {
        match self {
            Origin::S3(s3) => s3.open(agent, d.hex()),
            Origin::Dir(root) => std::fs::File::open(root.join("blobs").join(d.hex()))
                .map(|f| Box::new(f) as Box<dyn Read + Send>)
                .map_err(|e| e.to_string()),
        }
    }
}

/// Why a template could not be fetched.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// etcd did not answer.
    #[error(transparent)]
    Etcd(#[from] EtcdError),
    /// No source had a layer that verified.
    #[error("layer {digest} of template {template}: no source has it ({tried})")]
    NoSource {
        /// The template.
        template: String,
        /// The layer.
        digest: String,
        /// What each source answered.
        tried: String,
    },
    /// The local store refused the template.
    #[error("template {0}")]
    Store(#[from] crate::template::TemplateError),
}

/// What a node keeps of the cluster's templates.
#[derive(Debug, Default)]
pub(super) struct Layers {
    /// One lock per template being fetched.
    fetching: Mutex<HashMap<String, Arc<Mutex<()>>>>,
}

fn stored(t: &Template) -> impl Iterator<Item = &Digest> {
    t.layers.iter().filter_map(|l| match l {
        LayerRef::Stored { digest } => Some(digest),
        _ => None,
    })
}

impl Member {
    /// Publishes a template imported here: its blobs to the origin store, its record to etcd.
    pub fn publish(&self, store: &TemplateStore, t: &Template) -> Result<(), String> {
        if let Some(origin) = &self.origin {
            for d in stored(t) {
                if let Some(blob) = store.layers().blob(d) {
                    origin
                        .put(&self.http, d, &blob)
                        .map_err(|e| format!("copy layer {d} to the origin store: {e}"))?;
                }
            }
        }
        let body = serde_json::to_vec(t).map_err(|e| e.to_string())?;
        self.etcd
            .create(&model::template_key(&t.name), &body, 0)
            .map_err(|e| e.to_string())?;
        Ok(())
    }

    /// The cluster's record of template `name`, if it has one.
    pub fn cluster_template(&self, name: &str) -> Result<Option<Template>, EtcdError> {
        Ok(self
            .etcd
            .get(&model::template_key(name))?
            .and_then(|kv| serde_json::from_slice(&kv.value).ok()))
    }

    /// Every template the cluster has a record of.
    pub fn cluster_templates(&self) -> Result<Vec<Template>, EtcdError> {
        let (kvs, _) = self.etcd.prefix(&model::templates_prefix())?;
        Ok(kvs
            .iter()
            .filter_map(|kv| serde_json::from_slice(&kv.value).ok())
            .collect())
    }

    /// Makes template `name` local: `None` when it was already, else what was fetched.
    pub fn fetch_template(
        &self,
        store: &TemplateStore,
        name: &str,
    ) -> Result<Option<Fetched>, FetchError> {
        let lock = {
            let mut m = self
                .layers
                .fetching
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            Arc::clone(m.entry(name.to_owned()).or_default())
        };
        let _one = lock.lock().unwrap_or_else(|p| p.into_inner());
        if store.get(name).is_ok() {
            return Ok(None);
        }
        let Some(t) = self.cluster_template(name)? else {
            return Err(FetchError::Store(
                crate::template::TemplateError::NotFound {
                    name: name.to_owned(),
                },
            ));
        };
        let t0 = Instant::now();
        let peers = self.peers_holding(name)?;
        let mut got = Fetched::default();
        for d in stored(&t) {
            if store.layers().contains(d) {
                continue;
            }
            let (from, bytes) = self.fetch_layer(store, &t.name, d, &peers)?;
            got.layers += 1;
            got.bytes += bytes;
            if !got.from.contains(&from) {
                got.from.push(from);
            }
        }
        store.adopt(&t)?;
        got.ms = t0.elapsed().as_millis() as u64;
        tracing::info!(template = %name, layers = %got.layers, bytes = %got.bytes, from = ?got.from, ms = %got.ms, "cluster: fetched a template");
        Ok(Some(got))
    }

    /// Live nodes other than this one whose report lists template `name`.
    fn peers_holding(&self, name: &str) -> Result<Vec<NodeReport>, EtcdError> {
        let (kvs, _) = self.etcd.prefix(&model::nodes_prefix())?;
        Ok(kvs
            .iter()
            .filter_map(|kv| serde_json::from_slice::<NodeReport>(&kv.value).ok())
            .filter(|r| r.name != self.cfg.name && r.templates.iter().any(|t| t == name))
            .collect())
    }

    /// One layer, from the first source that has it and whose copy verifies: (source, bytes).
    fn fetch_layer(
        &self,
        store: &TemplateStore,
        template: &str,
        d: &Digest,
        peers: &[NodeReport],
    ) -> Result<(String, u64), FetchError> {
        let limits = ImportLimits::default();
        let mut tried = Vec::new();
        for p in peers {
            let url = format!(
                "{}/v1/cluster/layers/{}",
                p.url.trim_end_matches('/'),
                d.hex()
            );
            let answer = self
                .http
                .get(&url)
                .header(SECRET_HEADER, &self.secret)
                .call();
            match answer {
                Ok(r) => match store.fetch_layer(r.into_body().into_reader(), d, &limits) {
                    Ok(bytes) => return Ok((format!("node:{}", p.name), bytes)),
                    Err(e) => tried.push(format!("node {}: {e}", p.name)),
                },
                Err(e) => tried.push(format!("node {}: {e}", p.name)),
            }
        }
        if let Some(origin) = &self.origin {
            match origin.read(&self.http, d) {
                Ok(r) => match store.fetch_layer(r, d, &limits) {
                    Ok(bytes) => return Ok(("origin".into(), bytes)),
                    Err(e) => tried.push(format!("origin: {e}")),
                },
                Err(e) => tried.push(format!("origin: {e}")),
            }
        } else {
            tried.push("no origin store (--template-store)".into());
        }
        Err(FetchError::NoSource {
            template: template.to_owned(),
            digest: d.to_string(),
            tried: tried.join("; "),
        })
    }

    /// Whether `given` is the cluster secret (compared in constant time).
    pub fn secret_matches(&self, given: &str) -> bool {
        let (a, b) = (self.secret.as_bytes(), given.as_bytes());
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    }
}

impl crate::lifecycle::TemplateFetcher for Member {
    fn knows(&self, name: &str) -> Result<bool, String> {
        self.cluster_template(name)
            .map(|t| t.is_some())
            .map_err(|e| e.to_string())
    }

    fn fetch(&self, store: &TemplateStore, name: &str) -> Result<Option<Fetched>, String> {
        self.fetch_template(store, name).map_err(|e| e.to_string())
    }
}

/// The agent layer calls go through.
pub(super) fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .timeout_connect(Some(PEER_TIMEOUT))
        .timeout_recv_response(Some(PEER_TIMEOUT))
        .http_status_as_error(true)
        .build()
        .new_agent()
}
