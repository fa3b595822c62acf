//! OCI image layouts for the template tests (`tests/template.rs`, `tests/template_e2e.rs`),
//! which include this file with `#[path]`.

use std::fs;
use std::path::Path;

use serde_json::{json, Value};
use sha2::{Digest as _, Sha256};

/// The sha256 of `data`, in hex.
pub fn sha_hex(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

/// An image config for the uncompressed `layers` (bottom first) with the runtime `config`.
pub fn config_json<'a>(layers: impl IntoIterator<Item = &'a Vec<u8>>, config: Value) -> Vec<u8> {
    let diff_ids: Vec<String> = layers
        .into_iter()
        .map(|l| format!("sha256:{}", sha_hex(l)))
        .collect();
    serde_json::to_vec(&json!({
        "architecture": "amd64",
        "os": "linux",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }))
    .expect("config json")
}

/// Writes an OCI image layout into `dir`: the `config` blob, each of `layers` as (blob, media
/// type), their manifest, and an index naming it (with an amd64/linux platform when
/// `platform`); returns the manifest's sha256 in hex.
pub fn write_layout(
    dir: &Path,
    config: &[u8],
    layers: &[(Vec<u8>, &str)],
    platform: bool,
) -> String {
    let blobs = dir.join("blobs/sha256");
    fs::create_dir_all(&blobs).expect("create blobs dir");
    let put = |data: &[u8]| -> (String, usize) {
        let h = sha_hex(data);
        fs::write(blobs.join(&h), data).expect("write blob");
        (h, data.len())
    };
    let (ch, cs) = put(config);
    let descs: Vec<Value> = layers
        .iter()
        .map(|(data, media_type)| {
            let (h, s) = put(data);
            json!({"mediaType": media_type, "digest": format!("sha256:{h}"), "size": s})
        })
        .collect();
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": format!("sha256:{ch}"), "size": cs},
        "layers": descs,
    }))
    .expect("manifest json");
    let (mh, ms) = put(&manifest);
    fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).expect("oci-layout");
    let mut desc = json!({"mediaType": "application/vnd.oci.image.manifest.v1+json",
                          "digest": format!("sha256:{mh}"), "size": ms});
    if platform {
        desc["platform"] = json!({"architecture": "amd64", "os": "linux"});
    }
    let index = json!({"schemaVersion": 2, "manifests": [desc]});
    fs::write(
        dir.join("index.json"),
        serde_json::to_vec(&index).expect("index json"),
    )
    .expect("index.json");
    mh
}
