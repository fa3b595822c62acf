//! Snapshots, forks, restores and the snapshot tree (`crate::snapshot` holds the layers).

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use serde_json::{json, Value};

use super::create::CreateRequest;
use super::{Entry, Error, Node, Result};
use crate::clock::now_ms;
use crate::sandbox::State;
use crate::snapshot::{copy::IdShift, SnapshotRecord, FLATTEN_DEPTH, MAX_DEPTH};
use crate::store::{SandboxRecord, Tenant};

/// A committed template's `env`, `workdir` and `user` (`None`: its base template's).
pub type TemplateDefaults = (
    Option<Vec<(String, String)>>,
    Option<String>,
    Option<String>,
);

/// Most sandboxes one fork makes.
pub const MAX_FORK: usize = 64;

/// What `GET /v1/snapshots` filters by.
#[derive(Debug, Default, Clone)]
pub struct SnapshotFilter {
    /// Taken of this sandbox.
    pub sandbox: Option<String>,
    /// In the tree under this snapshot (itself included).
    pub root: Option<String>,
    /// Carrying every one of these labels.
    pub labels: BTreeMap<String, String>,
}

/// The layer id of a layer directory (its last component).
fn layer_id(dir: &str) -> String {
    std::path::Path::new(dir)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

impl Node {
    /// Snapshot `id` of `tenant`.
    pub fn snapshot_of(&self, tenant: &Tenant, id: &str) -> Result<SnapshotRecord> {
        match self.store.snapshot(id)? {
            Some(s) if s.tenant == tenant.id => Ok(s),
            _ => Err(Error::SnapshotNotFound(id.to_owned())),
        }
    }

    /// Takes a snapshot of a running container sandbox: its writable layer copied into a new
    /// layer above the ones it runs on. The sandbox goes on as it was.
    pub async fn snapshot(
        self: &Arc<Self>,
        tenant: &Tenant,
        e: &Arc<Entry>,
        labels: BTreeMap<String, String>,
        trajectory: Option<(String, u64)>,
    ) -> Result<SnapshotRecord> {
        let rec = e.record();
        let is_vm = rec.spec.substrate.is_vm();
        let used = self.snapshot_bytes(&tenant.id)?;
        if let Some(max) = tenant.max_snapshot_bytes.filter(|m| used >= *m) {
            return Err(Error::Quota(format!(
                "tenant {} holds {used} bytes of snapshots (max_snapshot_bytes {max})",
                tenant.name
            )));
        }
        let _gc = self.snapshot_gc.read().await;
        let mut guard = e.lock().await;
        if !matches!(e.record().state, State::Running | State::Ready) {
            return Err(Error::Transition(format!(
                "cannot snapshot a {:?} sandbox",
                e.record().state
            )));
        }
        let Some(mut sb) = guard.take() else {
            return Err(Error::NotFound(e.id.clone()));
        };
        let node = Arc::clone(self);
        let t0 = std::time::Instant::now();
        let (sb, taken) = tokio::task::spawn_blocking(move || {
            let taken = if is_vm {
                node.snapshots
                    .save(|dest| sb.vm_save(dest).map_err(|e| super::error::chain(&e)))
                    .map_err(|err| Error::internal(format!("save the guest: {err}")))
            } else {
                sb.upper()
                    .map_err(Error::from)
                    .and_then(|(fd, (uid, gid))| {
                        use std::os::fd::AsFd as _;
                        node.snapshots
                            .take(fd.as_fd(), IdShift { uid, gid })
                            .map_err(|err| {
                                Error::internal(format!("copy the writable layer: {err}"))
                            })
                    })
            };
            (sb, taken)
        })
        .await
        .map_err(|err| Error::internal(err.to_string()))?;
        *guard = Some(sb);
        drop(guard);
        let (layer, copied) = taken?;
        self.metrics.snapshot.observe_duration(t0.elapsed());
        if let Some(max) = tenant
            .max_snapshot_bytes
            .filter(|m| used + copied.bytes > *m)
        {
            let _ = std::fs::remove_dir_all(self.snapshots.dir(&layer));
            return Err(Error::Quota(format!(
                "a snapshot of {} bytes would take tenant {} past max_snapshot_bytes {max}",
                copied.bytes, tenant.name
            )));
        }
        self.failpoint("snapshot:before_record");
        let mut layers = vec![layer.clone()];
        layers.extend(rec.spec.layers.iter().map(|d| layer_id(d)));
        // (A VM's layers are a chain of disk overlays, each over the one below: never merged.)
        if layers.len() > MAX_DEPTH && !is_vm {
            let (template, _) = self.rt.lowerdirs(&rec.spec.template)?;
            let (node, all) = (Arc::clone(self), layers.clone());
            let flat = tokio::task::spawn_blocking(move || node.snapshots.flatten(&all, &template))
                .await
                .map_err(|err| Error::internal(err.to_string()))?
                .map_err(|err| Error::internal(format!("flatten the layers: {err}")))?;
            layers = vec![flat];
        }
        let snap = SnapshotRecord {
            id: crate::snapshot::new_id(crate::member::number()),
            parent: rec.spec.snapshot.clone(),
            sandbox: rec.id.clone(),
            tenant: tenant.id.clone(),
            substrate: rec.spec.substrate,
            template: rec.spec.template.clone(),
            layer,
            layers,
            size_bytes: copied.bytes,
            created_at_ms: now_ms(),
            labels,
            trajectory,
            limits: is_vm.then(|| rec.spec.limits.clone()),
        };
        self.store.put_snapshot(&snap)?;
        if snap.layers.len() > FLATTEN_DEPTH && !is_vm {
            let (node, id) = (Arc::clone(self), snap.id.clone());
            tokio::spawn(async move { node.flatten(&id).await });
        }
        Ok(snap)
    }

    /// Merges snapshot `id`'s stack of layers into one, which it then stands on (the layers
    /// stay for the snapshots below it).
    async fn flatten(self: &Arc<Self>, id: &str) {
        let _gc = self.snapshot_gc.read().await;
        let Ok(Some(s)) = self.store.snapshot(id) else {
            return;
        };
        let Ok((template, _)) = self.rt.lowerdirs(&s.template) else {
            return;
        };
        let node = Arc::clone(self);
        let layers = s.layers.clone();
        let merged =
            tokio::task::spawn_blocking(move || node.snapshots.flatten(&layers, &template)).await;
        match merged {
            Ok(Ok(flat)) => {
                // Deleted meanwhile: the merged layer is garbage for the next collection.
                if let Ok(Some(mut s)) = self.store.snapshot(id) {
                    s.layers = vec![flat];
                    let _ = self.store.put_snapshot(&s);
                }
            }
            Ok(Err(err)) => tracing::warn!(snapshot = %id, error = %err, "flatten failed"),
            Err(err) => tracing::warn!(snapshot = %id, error = %err, "flatten failed"),
        }
    }

    /// Commits snapshot `id` as template `name`: the snapshot's template's layers with the
    /// snapshot's above them; `env`, `workdir`, `user` replace the base template's when given.
    pub async fn commit_snapshot(
        self: &Arc<Self>,
        tenant: &Tenant,
        name: &str,
        id: &str,
        (env, workdir, user): TemplateDefaults,
    ) -> Result<crate::template::Template> {
        let s = self.snapshot_of(tenant, id)?;
        let _gc = self.snapshot_gc.read().await;
        let (node, name) = (Arc::clone(self), name.to_owned());
        tokio::task::spawn_blocking(move || {
            let store = node.rt.templates();
            let base = if s.template == crate::template::HOST_TEMPLATE {
                store.host_template()
            } else {
                store.get(&s.template)?
            };
            // Bottom → top.
            let dirs: Vec<std::path::PathBuf> = s
                .layers
                .iter()
                .rev()
                .map(|l| node.snapshots.dir(l))
                .collect();
            let defaults = (
                env.unwrap_or_else(|| base.env.clone()),
                workdir.unwrap_or_else(|| base.workdir.clone()),
                user.or_else(|| base.user.clone()),
            );
            let source = crate::template::TemplateSource::Snapshot { id: s.id.clone() };
            Ok(store.commit(&name, &base, &dirs, defaults, source)?)
        })
        .await
        .map_err(|err| Error::internal(err.to_string()))?
    }

    /// Bytes of `tenant`'s snapshots.
    pub fn snapshot_bytes(&self, tenant: &str) -> Result<u64> {
        Ok(self
            .store
            .snapshots(Some(tenant))?
            .iter()
            .map(|s| s.size_bytes)
            .sum())
    }

    /// What a create from snapshot `id` stands on: `req` with its template, substrate and
    /// layers.
    pub(super) fn resolve_snapshot(&self, tenant: &Tenant, req: &mut CreateRequest) -> Result<()> {
        let Some(id) = req.snapshot.clone() else {
            // Layers come from a snapshot's record only, never with a request.
            req.layers.clear();
            return Ok(());
        };
        let s = self.snapshot_of(tenant, &id)?;
        if s.substrate.is_vm() {
            req.userns = false;
            if let Some(l) = &s.limits {
                req.limits = l.clone();
            }
        } else if !req.userns {
            return Err(Error::invalid(
                "a sandbox made from a snapshot has a user namespace (its layers store the \
                 sandbox's own ids)",
            ));
        }
        req.template = s.template;
        req.substrate = s.substrate;
        req.layers = self.snapshots.dirs(&s.layers);
        Ok(())
    }

    /// Snapshot + `count` creates from it, alike (limits, root, environment, network policy)
    /// to the sandbox.
    pub async fn fork(
        self: &Arc<Self>,
        tenant: &Tenant,
        e: &Arc<Entry>,
        count: usize,
        labels: BTreeMap<String, String>,
    ) -> Result<(SnapshotRecord, Vec<Result<SandboxRecord>>)> {
        if count == 0 || count > MAX_FORK {
            return Err(Error::invalid(format!("count must be 1..={MAX_FORK}")));
        }
        let snap = self.snapshot(tenant, e, labels.clone(), None).await?;
        let rec = e.record();
        let req = CreateRequest {
            template: rec.spec.template.clone(),
            substrate: rec.spec.substrate,
            limits: rec.spec.limits.clone(),
            env: rec.env.clone(),
            labels,
            writable_root: rec.spec.writable_root,
            userns: true,
            secret_env: rec.secret_env.clone(),
            snapshot: Some(snap.id.clone()),
            network: rec.network.clone(),
            ..CreateRequest::default()
        };
        let made =
            futures_util::future::join_all((0..count).map(|_| self.create(tenant, req.clone())))
                .await;
        Ok((snap, made))
    }

    /// Rolls a container back in place to snapshot `id`: every process killed, its files
    /// those of the snapshot; later resets come back to it.
    pub async fn restore(
        self: &Arc<Self>,
        tenant: &Tenant,
        e: &Arc<Entry>,
        id: &str,
    ) -> Result<SandboxRecord> {
        let s = self.snapshot_of(tenant, id)?;
        let spec = e.record().spec;
        let vm = spec.substrate.is_vm();
        if vm != s.substrate.is_vm()
            || (vm && (spec.substrate, &spec.template) != (s.substrate, &s.template))
        {
            return Err(Error::invalid(format!(
                "a {} sandbox of template {} is restored to snapshots of its own kind (this \
                 one: {} of {})",
                spec.substrate.name(),
                spec.template,
                s.substrate.name(),
                s.template
            )));
        }
        let layers = self.snapshots.dirs(&s.layers);
        let lowerdirs: Vec<String> = if vm {
            layers.clone()
        } else {
            let (template_dirs, _) = self.rt.lowerdirs(&s.template)?;
            layers.iter().cloned().chain(template_dirs).collect()
        };
        let id = s.id.clone();
        self.in_place(
            e,
            "restore",
            move |sb| sb.restore(lowerdirs),
            &self.metrics.restore,
            |r| {
                r.spec.snapshot = Some(id);
                r.spec.template = s.template;
                r.spec.layers = layers;
            },
        )
        .await
    }

    /// `tenant`'s snapshots that pass `f`, oldest first.
    pub fn snapshots_of(&self, tenant: &Tenant, f: &SnapshotFilter) -> Result<Vec<SnapshotRecord>> {
        let all = self.store.snapshots(Some(&tenant.id))?;
        let under = match &f.root {
            Some(root) => {
                self.snapshot_of(tenant, root)?;
                Some(subtree(&all, root))
            }
            None => None,
        };
        let mut out: Vec<SnapshotRecord> = all
            .into_iter()
            .filter(|s| f.sandbox.as_ref().is_none_or(|sb| *sb == s.sandbox))
            .filter(|s| under.as_ref().is_none_or(|u| u.contains(&s.id)))
            .filter(|s| f.labels.iter().all(|(k, v)| s.labels.get(k) == Some(v)))
            .collect();
        out.sort_by(|a, b| (a.created_at_ms, &a.id).cmp(&(b.created_at_ms, &b.id)));
        Ok(out)
    }

    /// The tree under snapshot `id`: its view with `children`, recursively.
    pub fn snapshot_tree(&self, tenant: &Tenant, id: &str) -> Result<Value> {
        self.snapshot_of(tenant, id)?;
        let all = self.store.snapshots(Some(&tenant.id))?;
        fn node(all: &[SnapshotRecord], s: &SnapshotRecord, depth: usize) -> Value {
            let mut v = s.view();
            let children: Vec<Value> = if depth > 10_000 {
                Vec::new()
            } else {
                all.iter()
                    .filter(|c| c.parent.as_deref() == Some(s.id.as_str()))
                    .map(|c| node(all, c, depth + 1))
                    .collect()
            };
            v["children"] = json!(children);
            v
        }
        let Some(root) = all.iter().find(|s| s.id == id) else {
            return Err(Error::SnapshotNotFound(id.to_owned()));
        };
        Ok(node(&all, root, 0))
    }

    /// Deletes snapshot `id` (with the tree under it when `recursive`): refused while
    /// snapshots stand on it or live sandboxes were made from it, unless `recursive` (those
    /// sandboxes keep its layers until they are gone). Answers the ids deleted.
    pub async fn delete_snapshot(
        &self,
        tenant: &Tenant,
        id: &str,
        recursive: bool,
    ) -> Result<Vec<String>> {
        self.snapshot_of(tenant, id)?;
        let all = self.store.snapshots(Some(&tenant.id))?;
        let tree = subtree(&all, id);
        let in_use: Vec<String> = self
            .entries()
            .iter()
            .map(|e| e.record())
            .filter(|r| r.state != State::Stopped)
            .filter(|r| r.spec.snapshot.as_ref().is_some_and(|s| tree.contains(s)))
            .map(|r| r.id)
            .collect();
        if !recursive && (tree.len() > 1 || !in_use.is_empty()) {
            return Err(Error::Transition(format!(
                "snapshot {id} has {} snapshots and {} live sandboxes on it \
                 (delete with ?recursive=true)",
                tree.len() - 1,
                in_use.len()
            )));
        }
        let ids: Vec<String> = tree.into_iter().collect();
        self.store.delete_snapshots(&ids)?;
        self.gc_snapshot_layers().await?;
        Ok(ids)
    }

    /// Removes every snapshot layer no snapshot and no live sandbox stands on: how many.
    pub async fn gc_snapshot_layers(&self) -> Result<usize> {
        let _gc = self.snapshot_gc.write().await;
        let mut keep: HashSet<String> = self
            .store
            .snapshots(None)?
            .into_iter()
            .flat_map(|s| s.layers.into_iter().chain([s.layer]))
            .collect();
        for e in self.entries() {
            keep.extend(e.record().spec.layers.iter().map(|d| layer_id(d)));
        }
        Ok(self.snapshots.gc(&keep))
    }
}

/// The ids of the tree under `id` in `all` (itself included).
fn subtree(all: &[SnapshotRecord], id: &str) -> HashSet<String> {
    let mut out: HashSet<String> = HashSet::from([id.to_owned()]);
    loop {
        let before = out.len();
        for s in all {
            if s.parent.as_ref().is_some_and(|p| out.contains(p)) {
                out.insert(s.id.clone());
            }
        }
        if out.len() == before {
            return out;
        }
    }
}
