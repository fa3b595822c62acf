//! Snapshots of container sandboxes: their records and the layers they are made of.
//!
//! A snapshot of a container is its writable layer copied into an immutable layer
//! (`<data_dir>/snapshots/layers/<sl-…>/`, [`copy::apply`]) stacked on the layers the sandbox
//! ran on: its template's and, for a sandbox made from (or restored to) a snapshot, that
//! snapshot's. The sandbox goes on with its own writable layer, whose content the new layer
//! now also holds. A snapshot's `layers` name its stack above the template, topmost first; a
//! layer is shared by every snapshot above it and stored once.
//!
//! Layers are written under `tmp/` and renamed into place before their record is stored, so
//! a crash leaves a complete layer or none; a layer no record (and no live sandbox) names is
//! garbage, collected after every delete and when the node starts ([`LayerStore::gc`]).
//! Chains deeper than [`FLATTEN_DEPTH`] are flattened in the background: their layers are
//! merged into one, which the snapshot then stands on.

pub mod copy;

use std::collections::{BTreeMap, HashSet};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::sandbox::Substrate;

/// How deep a snapshot's stack of layers may grow before it is flattened in the background.
/// Each layer is idmapped and stacked when a sandbox is made from it, so a deep stack slows
/// every create from it (see docs/perf-notes.md, *Snapshots*).
pub const FLATTEN_DEPTH: usize = 16;

/// The deepest stack a snapshot is recorded with: a deeper one (snapshots taken faster than
/// the background flattening keeps up) is flattened before the snapshot is answered. The
/// overlay's options (every layer's path) must fit in one page.
pub const MAX_DEPTH: usize = 2 * FLATTEN_DEPTH;

/// A snapshot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotRecord {
    /// `sn-` and 16 hex digits (the first four the node's number in a cluster).
    pub id: String,
    /// The snapshot the sandbox stood on when this one was taken.
    pub parent: Option<String>,
    /// The sandbox it was taken of.
    pub sandbox: String,
    /// Owner (tenant id).
    pub tenant: String,
    /// The sandbox's substrate.
    pub substrate: Substrate,
    /// The sandbox's template.
    pub template: String,
    /// Its own layer (what changed since its parent, or since the template).
    pub layer: String,
    /// The layers a sandbox made from it stands on, above the template, topmost first.
    pub layers: Vec<String>,
    /// Bytes of its own layer's files: what it adds to its tenant's `max_snapshot_bytes`.
    pub size_bytes: u64,
    /// Taken at, ms since the epoch.
    pub created_at_ms: u64,
    /// Labels.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// The trajectory and step it was logged as, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trajectory: Option<(String, u64)>,
    /// A VM's limits (its guest's memory, vCPUs and disk): a sandbox made from its snapshot
    /// has the same.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<crate::capacity::Admitted>,
}

impl SnapshotRecord {
    /// Its API form.
    pub fn view(&self) -> serde_json::Value {
        let mut v = serde_json::json!({
            "id": self.id,
            "parent": self.parent,
            "sandbox": self.sandbox,
            "substrate": self.substrate,
            "template": self.template,
            "size_bytes": self.size_bytes,
            "created_at": crate::clock::rfc3339(self.created_at_ms),
            "labels": self.labels,
            "depth": self.layers.len(),
            // A container's snapshot holds its files, not its processes' memory; a VM's holds
            // the whole guest.
            "memory": self.substrate.is_vm(),
        });
        if let Some((t, step)) = &self.trajectory {
            v["trajectory"] = serde_json::json!(t);
            v["step"] = serde_json::json!(step);
        }
        v
    }
}

/// A new snapshot id (`sn-` + 16 hex digits, the first four the node's `number`).
pub fn new_id(number: u16) -> String {
    let mut b = [0u8; 8];
    let _ = getrandom::fill(&mut b);
    format!(
        "sn-{:016x}",
        dsec_cluster::ids::with_number(number, u64::from_le_bytes(b))
    )
}

/// Whether `id` has the form [`new_id`] makes.
pub fn valid_id(id: &str) -> bool {
    id.len() == 19
        && id.starts_with("sn-")
        && id[3..]
            .bytes()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// The snapshot layers on disk.
#[derive(Debug)]
pub struct LayerStore {
    layers: PathBuf,
    tmp: PathBuf,
}

impl LayerStore {
    /// Opens the store under `data_dir`, dropping what a crash left half-written (its
    /// directories are made when a layer is first written).
    pub fn open(data_dir: &Path) -> Self {
        let root = data_dir.join("snapshots");
        let (layers, tmp) = (root.join("layers"), root.join("tmp"));
        let _ = std::fs::remove_dir_all(&tmp);
        Self { layers, tmp }
    }

    /// Where layer `id` lives.
    pub fn dir(&self, id: &str) -> PathBuf {
        self.layers.join(id)
    }

    /// The directories of `layers`, in the same order.
    pub fn dirs(&self, layers: &[String]) -> Vec<String> {
        layers
            .iter()
            .map(|l| self.dir(l).display().to_string())
            .collect()
    }

    /// Copies the upper layer `upper` (ids shifted by `ids`) into a new layer: its id and
    /// what was copied.
    pub fn take(
        &self,
        upper: BorrowedFd<'_>,
        ids: copy::IdShift,
    ) -> Result<(String, copy::Copied), copy::CopyError> {
        self.write(|dest| copy::apply(upper, dest, ids))
    }

    /// A new layer `fill` writes (a VM's saved state and disk): its id and the bytes written.
    pub fn save(
        &self,
        fill: impl FnOnce(&Path) -> Result<u64, String>,
    ) -> Result<(String, copy::Copied), copy::CopyError> {
        self.write(|dest| {
            fill(dest)
                .map(|bytes| copy::Copied { bytes, entries: 0 })
                .map_err(|e| copy::CopyError {
                    op: "save",
                    path: dest.to_owned(),
                    source: std::io::Error::other(e),
                })
        })
    }

    /// Merges `layers` (topmost first) into a new layer that sits right above `template` (its
    /// lower directories): its id.
    pub fn flatten(
        &self,
        layers: &[String],
        template: &[String],
    ) -> Result<String, copy::CopyError> {
        // Whether the template holds `rel` in any of its layers (hidden there or not).
        let below = |rel: &Path| {
            template
                .iter()
                .any(|l| Path::new(l).join(rel).symlink_metadata().is_ok())
        };
        self.write(|dest| {
            let mut total = copy::Copied::default();
            for l in layers.iter().rev() {
                let dir = self.dir(l);
                let fd: OwnedFd = std::fs::File::open(&dir)
                    .map_err(|e| copy::CopyError {
                        op: "open",
                        path: dir.clone(),
                        source: e,
                    })?
                    .into();
                let c = copy::apply_over(fd.as_fd(), dest, copy::IdShift::default(), Some(&below))?;
                total.bytes += c.bytes;
                total.entries += c.entries;
            }
            Ok(total)
        })
        .map(|(id, _)| id)
    }

    /// Writes a new layer with `fill` under `tmp/` and renames it into place.
    fn write(
        &self,
        fill: impl FnOnce(&Path) -> Result<copy::Copied, copy::CopyError>,
    ) -> Result<(String, copy::Copied), copy::CopyError> {
        let mut b = [0u8; 8];
        let _ = getrandom::fill(&mut b);
        let id = format!("sl-{}", hex::encode(b));
        let tmp = self.tmp.join(&id);
        let fail = |op, source| copy::CopyError {
            op,
            path: tmp.clone(),
            source,
        };
        for d in [&self.layers, &self.tmp] {
            std::fs::create_dir_all(d).map_err(|e| fail("mkdir", e))?;
        }
        std::fs::create_dir(&tmp).map_err(|e| fail("mkdir", e))?;
        let done = fill(&tmp).and_then(|c| {
            std::fs::rename(&tmp, self.dir(&id)).map_err(|e| fail("rename", e))?;
            Ok(c)
        });
        if done.is_err() {
            let _ = std::fs::remove_dir_all(&tmp);
        }
        done.map(|c| (id, c))
    }

    /// Every layer on disk.
    pub fn all(&self) -> Vec<String> {
        let Ok(rd) = std::fs::read_dir(&self.layers) else {
            return Vec::new();
        };
        rd.filter_map(|e| e.ok()?.file_name().into_string().ok())
            .collect()
    }

    /// Removes every layer not in `keep`: how many went.
    pub fn gc(&self, keep: &HashSet<String>) -> usize {
        let mut n = 0;
        for l in self.all() {
            if !keep.contains(&l) && std::fs::remove_dir_all(self.dir(&l)).is_ok() {
                n += 1;
            }
        }
        n
    }
}
