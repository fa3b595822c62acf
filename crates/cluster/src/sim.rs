//! Simulated nodes, for scale tests only (`dsec cluster simulate`): each registers in etcd as a
//! node does — its number claimed, its report rewritten every second under its own lease — and
//! accepts placements without starting sandboxes: a create answers a sandbox id that carries its
//! number and counts it, a delete uncounts it. All of them share one process and one listener
//! (a node's URL is `http://<addr>/sim/<n>`), so 200 of them cost a few MiB.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

use crate::etcd::{Etcd, EtcdError};
use crate::model::{self, now_ms, NodeReport};

/// How the simulated nodes look.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// etcd endpoints, comma-separated.
    pub etcd: String,
    /// How many nodes.
    pub nodes: usize,
    /// Sandbox slots per node.
    pub slots: u64,
    /// Where the one listener listens.
    pub listen: SocketAddr,
}

/// One simulated node.
#[derive(Debug)]
struct Sim {
    name: String,
    number: u16,
    sandboxes: AtomicU64,
    slots: u64,
    next: AtomicU64,
}

type Sims = Arc<Vec<Sim>>;

/// Registers the nodes and serves them until the process ends; calls `on_ready` with the
/// listener's address once every node is registered.
pub async fn serve(cfg: SimConfig, on_ready: impl FnOnce(SocketAddr)) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(cfg.listen).await?;
    let addr = listener.local_addr()?;
    let c = cfg.clone();
    let sims: Vec<Sim> = tokio::task::spawn_blocking(move || {
        let etcd = Etcd::new(&c.etcd);
        (0..c.nodes)
            .map(|i| {
                let name = format!("sim-{i:04}");
                let number = crate::ids::claim_number(&etcd, &name)?;
                Ok(Sim {
                    name,
                    number,
                    sandboxes: AtomicU64::new(0),
                    slots: c.slots,
                    next: AtomicU64::new(0),
                })
            })
            .collect::<Result<_, EtcdError>>()
    })
    .await
    .map_err(std::io::Error::other)?
    .map_err(std::io::Error::other)?;
    let sims: Sims = Arc::new(sims);
    // Reports: one thread per 50 nodes, each node under its own lease.
    let started = now_ms();
    for chunk in 0..sims.len().div_ceil(50) {
        let (sims, cfg) = (Arc::clone(&sims), cfg.clone());
        std::thread::spawn(move || {
            report_loop(
                &sims,
                chunk * 50..((chunk + 1) * 50).min(sims.len()),
                &cfg,
                addr,
                started,
            )
        });
    }
    let app = Router::new()
        .route("/sim/{n}/v1/sandboxes", post(create).get(list))
        .route("/sim/{n}/v1/sandboxes/batch", post(batch))
        .route("/sim/{n}/v1/sandboxes/batch-delete", post(batch_delete))
        .route("/sim/{n}/v1/sandboxes/{id}", delete(remove).get(one))
        .route("/sim/{n}/readyz", get(|| async { "ok" }))
        .with_state(Arc::clone(&sims));
    // Every node's first report is written before the caller is told.
    let etcd = Arc::new(Etcd::new(&cfg.etcd));
    loop {
        let e = Arc::clone(&etcd);
        let registered = tokio::task::spawn_blocking(move || e.prefix(&model::nodes_prefix()))
            .await
            .ok()
            .and_then(Result::ok)
            .map_or(0, |(kvs, _)| {
                kvs.iter().filter(|kv| kv.key.contains("/sim-")).count()
            });
        if registered >= sims.len() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    on_ready(addr);
    axum::serve(listener, app).await
}

/// Keeps the leases of nodes `range` alive and rewrites their reports, every second.
fn report_loop(
    sims: &[Sim],
    range: std::ops::Range<usize>,
    cfg: &SimConfig,
    addr: SocketAddr,
    started: u64,
) {
    let etcd = Etcd::new(&cfg.etcd);
    let mut leases = vec![0i64; range.len()];
    loop {
        let t = std::time::Instant::now();
        for (slot, i) in range.clone().enumerate() {
            let s = &sims[i];
            let lease = match leases[slot] {
                0 => etcd.grant(5),
                l => etcd
                    .keep_alive(l)
                    .and_then(|ttl| if ttl > 0 { Ok(l) } else { etcd.grant(5) }),
            };
            let Ok(lease) = lease else { continue };
            leases[slot] = lease;
            let r = NodeReport {
                name: s.name.clone(),
                url: format!("http://{addr}/sim/{}", s.number),
                number: s.number,
                started_ms: started,
                updated_ms: now_ms(),
                sandboxes: s.sandboxes.load(Ordering::Relaxed),
                max_sandboxes: cfg.slots,
                cpus: 64.0,
                memory_bytes: 256 << 30,
                memory_allocated_bytes: s.sandboxes.load(Ordering::Relaxed) * (512 << 20),
                templates: if s.number.is_multiple_of(4) {
                    vec!["py".into()]
                } else {
                    Vec::new()
                },
                ..Default::default()
            };
            let body = serde_json::to_vec(&r).unwrap_or_default();
            let _ = etcd.put(&model::node_key(&s.name), &body, lease);
        }
        std::thread::sleep(Duration::from_secs(1).saturating_sub(t.elapsed()));
    }
}

fn sim(sims: &Sims, n: u16) -> Option<&Sim> {
    sims.iter().find(|s| s.number == n)
}

/// A sandbox of node `s`, counted.
fn made(s: &Sim) -> Value {
    s.sandboxes.fetch_add(1, Ordering::Relaxed);
    let bits = s.next.fetch_add(1, Ordering::Relaxed);
    let id = format!("sb-{:016x}", crate::ids::with_number(s.number, bits));
    json!({"id": id, "state": "running", "template": "host", "substrate": "container"})
}

fn no_node() -> Response {
    (StatusCode::NOT_FOUND, Json(json!({"code": "not_found"}))).into_response()
}

async fn create(State(sims): State<Sims>, Path(n): Path<u16>) -> Response {
    match sim(&sims, n) {
        Some(s) if s.sandboxes.load(Ordering::Relaxed) < s.slots => {
            (StatusCode::CREATED, Json(made(s))).into_response()
        }
        Some(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"code": "resource_exhausted"})),
        )
            .into_response(),
        None => no_node(),
    }
}

async fn batch(State(sims): State<Sims>, Path(n): Path<u16>, body: axum::body::Bytes) -> Response {
    let Some(s) = sim(&sims, n) else {
        return no_node();
    };
    let v: Value = serde_json::from_slice(&body).unwrap_or_default();
    let count = v["count"].as_u64().unwrap_or(0).min(10_000);
    let items: Vec<Value> = (0..count)
        .map(|_| json!({"ok": true, "sandbox": made(s)}))
        .collect();
    Json(json!({"items": items})).into_response()
}

async fn remove(State(sims): State<Sims>, Path((n, _id)): Path<(u16, String)>) -> Response {
    match sim(&sims, n) {
        Some(s) => {
            let _ = s
                .sandboxes
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| c.checked_sub(1));
            StatusCode::NO_CONTENT.into_response()
        }
        None => no_node(),
    }
}

async fn one(Path((_n, id)): Path<(u16, String)>) -> Response {
    Json(json!({"id": id, "state": "running"})).into_response()
}

async fn list(Path(_n): Path<u16>) -> Response {
    Json(json!({"items": []})).into_response()
}

async fn batch_delete(State(sims): State<Sims>, Path(n): Path<u16>) -> Response {
    match sim(&sims, n) {
        Some(s) => {
            s.sandboxes.store(0, Ordering::Relaxed);
            Json(json!({"items": []})).into_response()
        }
        None => no_node(),
    }
}
