//! `dsec gateway`: the cluster's one endpoint. Stateless: it reads the node table from etcd
//! (every [`REFRESH`]; the last table it read keeps serving while etcd has no quorum), places
//! creates ([`crate::place`]) and proxies every other call to the sandbox's node, found by the
//! node number the sandbox id carries ([`crate::ids`]). Request and answer bodies stream both
//! ways, so exec streams, file transfers and waits pass through unchanged.
//!
//! | call | where it goes |
//! |---|---|
//! | `POST /v1/sandboxes` | the best-scored node; the next one if that node refuses for capacity |
//! | `POST /v1/sandboxes/batch` | placed in one pass, one sub-batch per node, sent at once, answers merged |
//! | `GET /v1/sandboxes` | every live node, lists merged |
//! | `POST /v1/sandboxes/batch-delete` | every live node |
//! | `/v1/sandboxes/{id}/…`, `GET/DELETE /v1/sandboxes/{id}` | the node whose number `id` carries; `lost` (410, `node_lost`) when that node's lease expired |
//! | `GET /v1/trajectories` | every live node, lists merged |
//! | `/v1/trajectories/{id}/…` | the node that holds it, found by asking them all once (`gateway/trajectories.rs`) |
//! | `GET /v1/cluster` | the gateway itself: the node table and the autoscaling signals |
//! | `/livez`, `/readyz`, `/metrics` | the gateway itself |
//! | E2B's API: `/sandboxes…`, `/v2/sandboxes…`, sandbox traffic | as `/v1` (`gateway/e2b.rs`) |
//! | anything else (`/run_code`, `/v1/run`, tenants, templates, pools) | the best-scored node |

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
use axum::Router;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use serde_json::{json, Value};

use crate::etcd::Etcd;
use crate::model::{self, now_ms, NodeReport};
use crate::place::{self, Ask};

pub mod e2b;
mod placed;
mod register;
mod trajectories;

/// How often the gateway rereads the node table.
pub const REFRESH: Duration = Duration::from_millis(500);

/// A node table older than this (etcd has not answered since) places nothing: creates answer
/// `503 unavailable` with `Retry-After` until etcd answers again.
pub const STALE: Duration = Duration::from_secs(3);

/// Largest JSON body the gateway reads itself (creates, batches, lists).
const MAX_JSON: usize = 16 << 20;

/// How the gateway runs.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// etcd endpoints, comma-separated.
    pub etcd: String,
    /// Where to listen.
    pub listen: SocketAddr,
}

/// What the gateway knows of the cluster.
#[derive(Debug, Default)]
struct Table {
    /// Live nodes (their lease holds), by name.
    nodes: BTreeMap<String, NodeReport>,
    /// Node number → name, for every number ever claimed.
    numbers: BTreeMap<u16, String>,
    /// When etcd last answered.
    read_at: Option<Instant>,
    /// API key hash → (tenant id, its `max_sandboxes`), from `keys/` and `tenants/`.
    /// (Shared with the next table while `tenants/` and `keys/` do not move.)
    quotas: Arc<BTreeMap<String, (String, Option<u64>)>>,
}

struct Gw {
    etcd: Etcd,
    table: RwLock<Table>,
    client: Client<HttpConnector, Body>,
    placed: AtomicU64,
    lost_calls: AtomicU64,
    proxied: AtomicU64,
    /// The lease idempotent placements go under, and when it was granted.
    idem_lease: std::sync::Mutex<Option<(i64, Instant)>>,
    /// The versions of `tenants/` and `keys/` the quota table was read at.
    quotas_at: std::sync::Mutex<Option<[(i64, i64); 2]>>,
    /// This gateway's placements the node reports do not count yet.
    placed_recently: placed::Placed,
    /// When this gateway last refused creates for capacity (bounded: the last
    /// [`MAX_REFUSALS`]), the waiting part of the queue depth.
    refused: std::sync::Mutex<std::collections::VecDeque<(Instant, u64)>>,
    /// The desired node count, updated at every refresh.
    desired: std::sync::Mutex<crate::autoscale::Desired>,
    desired_nodes: AtomicU64,
    /// Which node holds a trajectory, by (caller's key hash, trajectory id).
    trajectories: std::sync::Mutex<std::collections::HashMap<String, String>>,
    /// Its addresses, registered for the nodes to keep sandboxes from.
    registration: register::Registration,
}

/// How long one lease takes idempotent placements before the next is granted.
const IDEM_LEASE_REUSE: Duration = Duration::from_secs(60);

impl Gw {
    /// The lease for an idempotent placement made now (granted once a minute).
    fn idem_lease(&self) -> Result<i64, crate::etcd::EtcdError> {
        let mut l = self.idem_lease.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((id, at)) = *l {
            if at.elapsed() < IDEM_LEASE_REUSE {
                return Ok(id);
            }
        }
        let id = self
            .etcd
            .grant(model::IDEM_TTL + IDEM_LEASE_REUSE.as_secs() as i64)?;
        *l = Some((id, Instant::now()));
        Ok(id)
    }
}

type App = Arc<Gw>;

/// Serves the gateway until the process ends; calls `on_ready` with the bound address.
pub async fn serve(
    cfg: GatewayConfig,
    on_ready: impl FnOnce(SocketAddr),
) -> Result<(), std::io::Error> {
    let gw = Arc::new(Gw {
        etcd: Etcd::new(&cfg.etcd),
        table: RwLock::default(),
        client: {
            // Headers and body go out as two writes: without TCP_NODELAY the body waits for
            // the node's delayed ACK of the headers (~2 ms per call here).
            let mut conn = HttpConnector::new();
            conn.set_nodelay(true);
            Client::builder(hyper_util::rt::TokioExecutor::new())
                .pool_max_idle_per_host(256)
                .build(conn)
        },
        placed: AtomicU64::new(0),
        lost_calls: AtomicU64::new(0),
        proxied: AtomicU64::new(0),
        idem_lease: std::sync::Mutex::new(None),
        trajectories: std::sync::Mutex::default(),
        refused: std::sync::Mutex::default(),
        placed_recently: placed::Placed::default(),
        quotas_at: std::sync::Mutex::default(),
        desired: std::sync::Mutex::default(),
        desired_nodes: AtomicU64::new(1),
        registration: register::Registration::new(cfg.listen),
    });
    refresh(&gw).await;
    let g = Arc::clone(&gw);
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(REFRESH).await;
            refresh(&g).await;
        }
    });
    // The registration on a loop of its own: renewing it never holds the table's refresh up.
    let g = Arc::clone(&gw);
    tokio::spawn(async move {
        loop {
            let r = Arc::clone(&g);
            let renewed = tokio::task::spawn_blocking(move || r.registration.renew(&r.etcd)).await;
            if let Ok(Err(e)) = renewed {
                tracing::debug!(error = %e, "gateway: registration not renewed");
            }
            tokio::time::sleep(register::RENEW_EVERY).await;
        }
    });
    let app = Router::new()
        .route("/livez", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/v1/cluster", get(cluster))
        .route("/v1/sandboxes", any(sandboxes))
        .route("/v1/sandboxes/batch", any(batch))
        .route("/v1/sandboxes/batch-delete", any(batch_delete))
        .route("/v1/sandboxes/{id}", any(by_id))
        .route("/v1/sandboxes/{id}/{*rest}", any(by_id))
        .route(
            "/v1/snapshots",
            get(|State(gw): State<App>, req: Request| list(gw, req)),
        )
        .route("/v1/templates", any(templates))
        .route("/v1/snapshots/{id}", any(by_id))
        .route("/v1/snapshots/{id}/{*rest}", any(by_id))
        .route(
            "/v1/trajectories",
            get(|State(gw): State<App>, req: Request| list(gw, req)),
        )
        .route("/v1/trajectories/{id}", any(trajectories::by_id))
        .route("/v1/trajectories/{id}/{*rest}", any(trajectories::by_id))
        .fallback(anywhere)
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&gw),
            e2b::dispatch,
        ))
        .with_state(gw);
    let listener = tokio::net::TcpListener::bind(cfg.listen).await?;
    on_ready(listener.local_addr()?);
    use axum::serve::ListenerExt as _;
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, app).await
}

/// Rereads the node table; keeps the last one when etcd does not answer.
async fn refresh(gw: &App) {
    let g = Arc::clone(gw);
    let read = tokio::task::spawn_blocking(move || {
        let (nodes, _) = g.etcd.prefix(&model::nodes_prefix())?;
        let (numbers, _) = g.etcd.prefix(&model::numbers_prefix())?;
        // Tenants and keys change rarely: reread only when either prefix moved.
        let version = [
            g.etcd.prefix_version(&model::tenants_prefix())?,
            g.etcd.prefix_version(&model::api_keys_prefix())?,
        ];
        let same = *g.quotas_at.lock().unwrap_or_else(|p| p.into_inner()) == Some(version);
        let quotas = if same {
            None
        } else {
            let (tenants, _) = g.etcd.prefix(&model::tenants_prefix())?;
            let (keys, _) = g.etcd.prefix(&model::api_keys_prefix())?;
            Some((quotas_of(&tenants, keys), version))
        };
        Ok::<_, crate::etcd::EtcdError>((nodes, numbers, quotas))
    })
    .await;
    let Ok(Ok((nodes, numbers, quotas))) = read else {
        return;
    };
    let mut t = Table {
        read_at: Some(Instant::now()),
        ..Default::default()
    };
    for kv in nodes {
        if let Ok(r) = serde_json::from_slice::<NodeReport>(&kv.value) {
            t.nodes.insert(r.name.clone(), r);
        }
    }
    for kv in numbers {
        if let Some(n) = kv.key.rsplit('/').next().and_then(|s| s.parse().ok()) {
            t.numbers
                .insert(n, String::from_utf8_lossy(&kv.value).into_owned());
        }
    }
    match quotas {
        Some((q, version)) => {
            t.quotas = Arc::new(q);
            *gw.quotas_at.lock().unwrap_or_else(|p| p.into_inner()) = Some(version);
        }
        None => {
            t.quotas = Arc::clone(&gw.table.read().unwrap_or_else(|p| p.into_inner()).quotas);
        }
    }
    *gw.table.write().unwrap_or_else(|p| p.into_inner()) = t;
    let load = load(gw, refused_recently(gw));
    let n = gw
        .desired
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .update(load, Instant::now());
    gw.desired_nodes.store(n, Ordering::Relaxed);
}

/// API key hash → (tenant id, its `max_sandboxes`), from the `tenants/` and `keys/` records.
fn quotas_of(
    tenants: &[crate::etcd::Kv],
    keys: Vec<crate::etcd::Kv>,
) -> BTreeMap<String, (String, Option<u64>)> {
    let records: BTreeMap<String, Value> = tenants
        .iter()
        .filter_map(|kv| {
            let name = kv.key.rsplit('/').next()?.to_owned();
            Some((name, serde_json::from_slice(&kv.value).ok()?))
        })
        .collect();
    let mut out = BTreeMap::new();
    for kv in keys {
        let (Some(hash), Ok(name)) = (kv.key.rsplit('/').next(), String::from_utf8(kv.value))
        else {
            continue;
        };
        if let Some(r) = records.get(&name) {
            let id = r["id"].as_str().unwrap_or_default().to_owned();
            out.insert(hash.to_owned(), (id, r["max_sandboxes"].as_u64()));
        }
    }
    out
}

/// Most capacity refusals a gateway remembers (the oldest go first).
const MAX_REFUSALS: usize = 10_000;

/// Counts `n` creates refused for capacity now.
fn refuse(gw: &App, n: usize) {
    if n == 0 {
        return;
    }
    let mut r = gw.refused.lock().unwrap_or_else(|p| p.into_inner());
    if r.len() == MAX_REFUSALS {
        r.pop_front();
    }
    r.push_back((Instant::now(), n as u64));
}

/// Creates refused for capacity within the autoscaler's window.
fn refused_recently(gw: &App) -> u64 {
    let mut r = gw.refused.lock().unwrap_or_else(|p| p.into_inner());
    while r
        .front()
        .is_some_and(|(t, _)| t.elapsed() > crate::autoscale::REFUSED_WINDOW)
    {
        r.pop_front();
    }
    r.iter().map(|(_, n)| n).sum()
}

/// The cluster's load as the autoscaler reads it, with `refused` creates waiting besides the
/// nodes' queues.
fn load(gw: &App, refused: u64) -> crate::autoscale::Load {
    let t = gw.table.read().unwrap_or_else(|p| p.into_inner());
    let live: Vec<&NodeReport> = t.nodes.values().filter(|n| !n.draining).collect();
    let sum = |f: &dyn Fn(&NodeReport) -> f64| live.iter().map(|n| f(n)).sum::<f64>();
    let frac = |used: f64, all: f64| if all > 0.0 { used / all } else { 0.0 };
    let slots = sum(&|n| n.max_sandboxes as f64);
    let used = frac(sum(&|n| n.cpu_used), sum(&|n| n.cpus))
        .max(frac(
            sum(&|n| n.memory_allocated_bytes as f64),
            sum(&|n| n.memory_bytes as f64),
        ))
        .max(frac(sum(&|n| n.sandboxes as f64), slots));
    crate::autoscale::Load {
        nodes: live.len() as u64,
        queue: live.iter().map(|n| n.creates_waiting).sum::<u64>() + refused,
        used,
        slots_per_node: frac(slots, live.len() as f64),
    }
}

/// Who is calling: its tenant id and `max_sandboxes` from the key table (a key the table does
/// not know yet: its hash, no quota). The key itself is never kept.
fn tenant_of(gw: &App, headers: &axum::http::HeaderMap) -> (String, Option<u64>) {
    use sha2::Digest as _;
    let hash = hex::encode(sha2::Sha256::digest(caller(headers).as_bytes()));
    let t = gw.table.read().unwrap_or_else(|p| p.into_inner());
    t.quotas.get(&hash).cloned().unwrap_or((hash, None))
}

/// How many of `want` sandboxes `tenant` (quota `max`) may still have, cluster-wide, as far as
/// this gateway sees: the node reports plus its own placements they do not count yet. An early
/// answer only: the nodes' reservations in etcd are exact (`member/quota.rs`).
fn quota_room(gw: &App, tenant: &str, max: Option<u64>, want: u64) -> u64 {
    let Some(max) = max else {
        return want;
    };
    let live: u64 = adjusted(gw, &nodes(gw))
        .iter()
        .map(|n| n.tenants.get(tenant).copied().unwrap_or(0))
        .sum();
    max.saturating_sub(live).min(want)
}

fn quota_exceeded() -> Response {
    problem(
        StatusCode::TOO_MANY_REQUESTS,
        "quota_exceeded",
        "the tenant's max_sandboxes is reached across the cluster",
    )
}

fn problem(status: StatusCode, code: &str, detail: &str) -> Response {
    let body = json!({"type": format!("https://dsec.dev/errors/{code}"), "title": code.replace('_', " "),
                      "status": status.as_u16(), "code": code, "detail": detail});
    let mut r = (status, axum::Json(body)).into_response();
    r.headers_mut().insert(
        "content-type",
        HeaderValue::from_static("application/problem+json"),
    );
    r
}

/// `Some(503)` when the node table is too old to place on.
fn stale(gw: &App) -> Option<Response> {
    let t = gw.table.read().unwrap_or_else(|p| p.into_inner());
    match t.read_at {
        Some(at) if at.elapsed() < STALE => None,
        _ => Some(unavailable("no answer from etcd")),
    }
}

/// The live nodes, as they last reported.
fn nodes(gw: &App) -> Vec<NodeReport> {
    gw.table
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .nodes
        .values()
        .cloned()
        .collect()
}

/// The live nodes, with this gateway's placements their reports do not count yet: what
/// placement orders by. A node that only looks full this way is still tried (last): its
/// report is the truth, and the node's own admission refuses when it really is full.
fn adjusted(gw: &App, all: &[NodeReport]) -> Vec<NodeReport> {
    let mut all = all.to_vec();
    gw.placed_recently.adjust(&mut all, now_ms());
    all
}

/// The caller's API key, as a node reads it (`X-API-Key`, or `Authorization: Bearer`); empty
/// without one. Never stored: it finds the caller's tenant ([`tenant_of`]) and keys idempotency.
fn caller(headers: &axum::http::HeaderMap) -> String {
    headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .or_else(|| {
            headers
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
        })
        .unwrap_or("")
        .to_owned()
}

/// Forwards `req` to `node` (path and query kept, body streamed) and streams the answer back.
async fn forward(gw: &App, node: &NodeReport, req: Request) -> Response {
    let (mut parts, body) = req.into_parts();
    let pq = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    let Ok(uri) = format!("{}{pq}", node.url.trim_end_matches('/')).parse::<Uri>() else {
        return problem(
            StatusCode::BAD_GATEWAY,
            "bad_gateway",
            "the node's URL is not valid",
        );
    };
    parts.uri = uri;
    parts.headers.remove("host");
    gw.proxied.fetch_add(1, Ordering::Relaxed);
    match gw.client.request(Request::from_parts(parts, body)).await {
        Ok(r) => r.map(Body::new),
        Err(e) => problem(
            StatusCode::BAD_GATEWAY,
            "node_unreachable",
            &format!("node {}: {e}", node.name),
        ),
    }
}

/// Sends a JSON body to `node` and reads the JSON answer.
async fn call_json(
    gw: &App,
    node: &NodeReport,
    method: Method,
    path: &str,
    headers: &axum::http::HeaderMap,
    body: Vec<u8>,
) -> (StatusCode, Value) {
    let mut req = Request::builder().method(method).uri(path);
    for (k, v) in headers {
        if k != "host" && k != "content-length" {
            req = req.header(k, v);
        }
    }
    let Ok(req) = req.body(Body::from(body)) else {
        return (StatusCode::BAD_REQUEST, Value::Null);
    };
    let r = forward(gw, node, req).await;
    let status = r.status();
    let bytes = axum::body::to_bytes(r.into_body(), MAX_JSON)
        .await
        .unwrap_or_default();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

async fn readyz(State(gw): State<App>) -> Response {
    let t = gw.table.read().unwrap_or_else(|p| p.into_inner());
    if t.nodes.is_empty() {
        return problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            "no live node",
        );
    }
    "ok".into_response()
}

/// The autoscaling signals and the node table.
fn cluster_view(gw: &App) -> Value {
    let refused = refused_recently(gw);
    let load = load(gw, refused);
    let t = gw.table.read().unwrap_or_else(|p| p.into_inner());
    let live: Vec<&NodeReport> = t.nodes.values().collect();
    let cpus: f64 = live.iter().map(|n| n.cpus).sum();
    let used: f64 = live.iter().map(|n| n.cpu_used).sum();
    let mem: u64 = live.iter().map(|n| n.memory_bytes).sum();
    let mem_used: u64 = live.iter().map(|n| n.memory_allocated_bytes).sum();
    let cpu_frac = if cpus > 0.0 { used / cpus } else { 0.0 };
    let mem_frac = if mem > 0 {
        mem_used as f64 / mem as f64
    } else {
        0.0
    };
    let lost: Vec<&String> = t
        .numbers
        .values()
        .filter(|n| !t.nodes.contains_key(*n))
        .collect();
    json!({
        "nodes": live.iter().map(|n| json!({
            "name": n.name, "url": n.url, "number": n.number, "state": if n.draining {"draining"} else {"ready"},
            "report_age_ms": now_ms().saturating_sub(n.updated_ms),
            "sandboxes": n.sandboxes, "free_slots": n.free_slots(), "cpus": n.cpus, "cpu_used": n.cpu_used,
            "memory_bytes": n.memory_bytes, "free_memory_bytes": n.free_memory(),
            "templates": n.templates, "pools": n.pools, "draining": n.draining,
        })).collect::<Vec<_>>(),
        "lost": lost,
        "queue_depth": load.queue,
        "refused_for_capacity": refused,
        "used_fraction": load.used,
        "desired_nodes": gw.desired_nodes.load(Ordering::Relaxed),
        "cpu_used_fraction": cpu_frac,
        "memory_used_fraction": mem_frac,
        "etcd_read_age_ms": t.read_at.map(|r| r.elapsed().as_millis() as u64),
        "keys_with_quota": t.quotas.values().filter(|(_, m)| m.is_some()).count(),
    })
}

async fn cluster(State(gw): State<App>) -> Response {
    axum::Json(cluster_view(&gw)).into_response()
}

async fn metrics(State(gw): State<App>) -> Response {
    let v = cluster_view(&gw);
    let n = v["nodes"].as_array().map_or(0, Vec::len);
    let lost = v["lost"].as_array().map_or(0, Vec::len);
    let text = format!(
        "# TYPE dsec_gateway_nodes gauge\ndsec_gateway_nodes {n}\n\
         # TYPE dsec_gateway_nodes_lost gauge\ndsec_gateway_nodes_lost {lost}\n\
         # TYPE dsec_gateway_queue_depth gauge\ndsec_gateway_queue_depth {}\n\
         # TYPE dsec_gateway_cpu_used_fraction gauge\ndsec_gateway_cpu_used_fraction {}\n\
         # TYPE dsec_gateway_memory_used_fraction gauge\ndsec_gateway_memory_used_fraction {}\n\
         # TYPE dsec_gateway_desired_nodes gauge\ndsec_gateway_desired_nodes {}\n\
         # TYPE dsec_gateway_placements_total counter\ndsec_gateway_placements_total {}\n\
         # TYPE dsec_gateway_lost_calls_total counter\ndsec_gateway_lost_calls_total {}\n\
         # TYPE dsec_gateway_proxied_total counter\ndsec_gateway_proxied_total {}\n",
        v["queue_depth"],
        v["cpu_used_fraction"],
        v["memory_used_fraction"],
        v["desired_nodes"],
        gw.placed.load(Ordering::Relaxed),
        gw.lost_calls.load(Ordering::Relaxed),
        gw.proxied.load(Ordering::Relaxed),
    );
    ([("content-type", "text/plain; version=0.0.4")], text).into_response()
}

/// The ask of a create body.
fn ask_of<'a>(spec: &'a Value, tenant: &'a str) -> Ask<'a> {
    Ask {
        template: spec["template"].as_str().unwrap_or("host"),
        tenant,
        memory: spec["limits"]["memory_max"].as_u64().unwrap_or(512 << 20),
    }
}

/// Nodes in placement order for one sandbox of `ask`.
fn ranked(gw: &App, ask: &Ask<'_>) -> Vec<NodeReport> {
    let all = nodes(gw);
    let with_mine = adjusted(gw, &all);
    let mut scored: Vec<(f64, NodeReport)> = all
        .into_iter()
        .zip(with_mine)
        .filter_map(|(n, mine)| {
            let raw = place::score(&n, ask, 1)?;
            Some((place::score(&mine, ask, 1).unwrap_or(raw - 10_000.0), n))
        })
        .collect();
    scored.sort_by(|a, b| b.0.total_cmp(&a.0));
    scored.into_iter().map(|(_, n)| n).collect()
}

async fn sandboxes(State(gw): State<App>, req: Request) -> Response {
    match *req.method() {
        Method::POST => create(gw, req).await,
        Method::GET => list(gw, req).await,
        _ => problem(
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            "GET or POST",
        ),
    }
}

/// Reads a JSON body the gateway needs itself: `413 too_large` past [`MAX_JSON`], `400
/// invalid_request` when it is not JSON (an empty body is `{}`).
async fn read_json(
    req: Request,
) -> Result<(axum::http::request::Parts, axum::body::Bytes, Value), Response> {
    let (parts, body) = req.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, MAX_JSON).await else {
        return Err(problem(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too_large",
            "the request body is too large",
        ));
    };
    let v = if bytes.iter().all(u8::is_ascii_whitespace) {
        json!({})
    } else {
        serde_json::from_slice(&bytes).map_err(|e| {
            problem(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                &format!("the body is not JSON: {e}"),
            )
        })?
    };
    Ok((parts, bytes, v))
}

async fn create(gw: App, req: Request) -> Response {
    if let Some(r) = stale(&gw) {
        return r;
    }
    let (parts, bytes, spec) = match read_json(req).await {
        Ok(r) => r,
        Err(r) => return r,
    };
    let (tenant, max) = tenant_of(&gw, &parts.headers);
    let idempotent = parts.headers.contains_key("idempotency-key");
    // (A retry of an idempotent create is answered by its node, which counts it once.)
    if !idempotent && quota_room(&gw, &tenant, max, 1) == 0 {
        return quota_exceeded();
    }
    let ask = if e2b::is_control_path(parts.uri.path()) {
        e2b::ask_of(&spec, &tenant)
    } else {
        ask_of(&spec, &tenant)
    };
    let mut order = match spec["snapshot"].as_str() {
        // A snapshot's layers are on its node: the sandbox is made there.
        Some(s) => match node_of(&gw, s).and_then(|(_, node)| node) {
            Some(n) => vec![n],
            None => {
                return problem(
                    StatusCode::NOT_FOUND,
                    "snapshot_not_found",
                    &format!("no snapshot {s} on a live node"),
                )
            }
        },
        None => ranked(&gw, &ask),
    };
    if order.is_empty() {
        refuse(&gw, 1);
        return no_capacity();
    }
    if let Some(idem) = parts
        .headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
    {
        // A retry, through this gateway or another, goes to the node the first try went to,
        // whose own idempotency store answers it.
        match pin_idempotent(&gw, &caller(&parts.headers), idem, &order[0].name).await {
            Ok(name) => {
                let t = gw.table.read().unwrap_or_else(|p| p.into_inner());
                match t.nodes.get(&name) {
                    Some(n) => order = vec![n.clone()],
                    None => {
                        return problem(
                            StatusCode::GONE,
                            "node_lost",
                            &format!(
                                "this Idempotency-Key's create went to node {name}, which was lost"
                            ),
                        )
                    }
                }
            }
            Err(resp) => return resp,
        }
    }
    let pq = parts
        .uri
        .path_and_query()
        .map_or("/v1/sandboxes", |p| p.as_str())
        .to_owned();
    let mut last = no_capacity();
    for node in order.iter().take(3) {
        let mut req = Request::builder().method(Method::POST).uri(&pq);
        for (k, v) in &parts.headers {
            req = req.header(k, v);
        }
        let Ok(req) = req.body(Body::from(bytes.clone())) else {
            break;
        };
        let r = forward(&gw, node, req).await;
        // A node that is full or draining now: the next one.
        if matches!(r.status().as_u16(), 502 | 503 | 507) {
            last = r;
            continue;
        }
        if r.status().is_success() {
            gw.placed.fetch_add(1, Ordering::Relaxed);
            gw.placed_recently
                .record(&node.name, &tenant, 1, ask.memory, now_ms());
        }
        return r;
    }
    refuse(&gw, 1);
    last
}

/// The node an idempotent create goes to: the one recorded for (`who`, `idem`), or `first`,
/// recorded now. etcd unavailable: 503, so the client retries rather than risk two creates.
async fn pin_idempotent(gw: &App, who: &str, idem: &str, first: &str) -> Result<String, Response> {
    use sha2::Digest as _;
    let digest = hex::encode(sha2::Sha256::digest(format!("{who}\n{idem}").as_bytes()));
    let (g, first) = (Arc::clone(gw), first.to_owned());
    let r = tokio::task::spawn_blocking(move || {
        let key = model::idem_key(&digest);
        if let Some(kv) = g.etcd.get(&key)? {
            return Ok(String::from_utf8_lossy(&kv.value).into_owned());
        }
        match g.etcd.create(&key, first.as_bytes(), g.idem_lease()?) {
            Ok(true) => return Ok(first),
            Ok(false) => {}
            Err(e) => {
                // The lease may be gone (revoked, or etcd restored): the retry takes a new one.
                *g.idem_lease.lock().unwrap_or_else(|p| p.into_inner()) = None;
                return Err(e);
            }
        }
        Ok::<_, crate::etcd::EtcdError>(
            g.etcd
                .get(&key)?
                .map(|kv| String::from_utf8_lossy(&kv.value).into_owned())
                .unwrap_or(first),
        )
    })
    .await;
    match r {
        Ok(Ok(name)) => Ok(name),
        Ok(Err(e)) => Err(unavailable(&e.to_string())),
        Err(e) => Err(unavailable(&e.to_string())),
    }
}

/// etcd has no quorum (or does not answer): creates wait, calls to existing sandboxes go on.
fn unavailable(detail: &str) -> Response {
    let mut r = problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "unavailable",
        &format!("the cluster's store does not answer; retry: {detail}"),
    );
    r.headers_mut()
        .insert("retry-after", HeaderValue::from_static("1"));
    r
}

fn no_capacity() -> Response {
    let mut r = problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "capacity_exhausted",
        "no node of the cluster can take the sandbox now",
    );
    r.headers_mut()
        .insert("retry-after", HeaderValue::from_static("1"));
    r
}

async fn list(gw: App, req: Request) -> Response {
    let (parts, _) = req.into_parts();
    let pq = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    fan_out(&gw, Method::GET, &pq, &parts.headers, Vec::new()).await
}

/// Sends the same call to every live node at once and merges their `items` (the first node
/// that fails answers for all).
async fn fan_out(
    gw: &App,
    method: Method,
    path: &str,
    headers: &axum::http::HeaderMap,
    body: Vec<u8>,
) -> Response {
    let calls = nodes(gw).into_iter().map(|n| {
        let (gw, m, h, b) = (
            Arc::clone(gw),
            method.clone(),
            headers.clone(),
            body.clone(),
        );
        async move { call_json(&gw, &n, m, path, &h, b).await }
    });
    let mut items = Vec::new();
    for (status, v) in futures_util::future::join_all(calls).await {
        if !status.is_success() {
            return (status, axum::Json(v)).into_response();
        }
        if let Some(a) = v["items"].as_array() {
            items.extend(a.iter().cloned());
        }
    }
    axum::Json(json!({"items": items})).into_response()
}

async fn batch(State(gw): State<App>, req: Request) -> Response {
    if let Some(r) = stale(&gw) {
        return r;
    }
    let (parts, _, v) = match read_json(req).await {
        Ok(r) => r,
        Err(r) => return r,
    };
    let (tenant, max) = tenant_of(&gw, &parts.headers);
    let asked = v["count"].as_u64().unwrap_or(0);
    let count = quota_room(&gw, &tenant, max, asked);
    if count == 0 && asked > 0 {
        return quota_exceeded();
    }
    let over_quota = asked - count;
    let count = count as usize;
    let spec = v.get("spec").cloned().unwrap_or_else(|| json!({}));
    let ask = ask_of(&spec, &tenant);
    let all = nodes(&gw);
    let (mut plan, mut unplaced) = place::place(&adjusted(&gw, &all), &ask, count);
    if unplaced > 0 {
        // What only looks full with this gateway's recent placements is tried too.
        let mut raw = all;
        for n in raw.iter_mut() {
            let placed = plan.get(&n.name).copied().unwrap_or(0);
            n.sandboxes += placed;
            n.memory_allocated_bytes += placed * ask.memory;
        }
        let (more, left) = place::place(&raw, &ask, unplaced);
        for (name, n) in more {
            *plan.entry(name).or_default() += n;
        }
        unplaced = left;
    }
    for (name, n) in &plan {
        gw.placed_recently
            .record(name, &tenant, *n, ask.memory, now_ms());
    }
    let table = gw
        .table
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .nodes
        .clone();
    let calls = plan.into_iter().filter_map(|(name, n)| {
        let node = table.get(&name)?.clone();
        let mut sub = v.clone();
        sub["count"] = n.into();
        let (gw, h) = (Arc::clone(&gw), parts.headers.clone());
        Some(async move {
            let body = serde_json::to_vec(&sub).unwrap_or_default();
            call_json(&gw, &node, Method::POST, "/v1/sandboxes/batch", &h, body).await
        })
    });
    let mut items = Vec::new();
    let mut first_error = None;
    for (status, ans) in futures_util::future::join_all(calls).await {
        match ans["items"].as_array() {
            Some(a) => items.extend(a.iter().cloned()),
            None => first_error = first_error.or(Some((status, ans))),
        }
    }
    if items.is_empty() {
        if let Some((status, ans)) = first_error {
            return (status, axum::Json(ans)).into_response();
        }
    }
    let made = items.iter().filter(|i| i["ok"] == true).count();
    gw.placed.fetch_add(made as u64, Ordering::Relaxed);
    refuse(&gw, unplaced);
    for _ in 0..unplaced {
        items.push(json!({"ok": false, "error": {"code": "capacity_exhausted",
            "detail": "no node of the cluster can take the sandbox now"}}));
    }
    for _ in 0..over_quota {
        items.push(json!({"ok": false, "error": {"code": "quota_exceeded",
            "detail": "the tenant's max_sandboxes is reached across the cluster"}}));
    }
    (StatusCode::OK, axum::Json(json!({"items": items}))).into_response()
}

async fn batch_delete(State(gw): State<App>, req: Request) -> Response {
    let (parts, bytes, _) = match read_json(req).await {
        Ok(r) => r,
        Err(r) => return r,
    };
    fan_out(
        &gw,
        Method::POST,
        "/v1/sandboxes/batch-delete",
        &parts.headers,
        bytes.to_vec(),
    )
    .await
}

/// The node a sandbox or snapshot id names: its name, and its report while it is live. `None`
/// for an id that names no node this gateway knows.
fn node_of(gw: &App, id: &str) -> Option<(String, Option<NodeReport>)> {
    let number = crate::ids::node_number(id)?;
    let t = gw.table.read().unwrap_or_else(|p| p.into_inner());
    let name = t.numbers.get(&number)?.clone();
    let node = t.nodes.get(&name).cloned();
    Some((name, node))
}

/// A call to one sandbox (`/v1/sandboxes/{id}…`) or snapshot (`/v1/snapshots/{id}…`): to the
/// node its id names.
async fn by_id(State(gw): State<App>, req: Request) -> Response {
    // "", "v1", "sandboxes" | "snapshots", id, …
    let id = req.uri().path().split('/').nth(3).unwrap_or("").to_owned();
    let missing = if id.starts_with("sn-") {
        "snapshot_not_found"
    } else {
        "sandbox_not_found"
    };
    let Some((name, node)) = node_of(&gw, &id) else {
        return problem(StatusCode::NOT_FOUND, missing, &format!("no {id}"));
    };
    match node {
        Some(node) => {
            let delete = req.method() == Method::DELETE
                && req.uri().path().trim_end_matches('/') == format!("/v1/sandboxes/{id}");
            let r = forward(&gw, &node, req).await;
            if delete && r.status().is_success() {
                gw.placed_recently.forget_one(&node.name);
            }
            r
        }
        None => {
            gw.lost_calls.fetch_add(1, Ordering::Relaxed);
            if req.method() == Method::GET && req.uri().path() == format!("/v1/sandboxes/{id}") {
                return axum::Json(json!({"id": id, "state": "lost", "node": name,
                    "error": format!("node {name} was lost: its lease expired")}))
                .into_response();
            }
            problem(
                StatusCode::GONE,
                "node_lost",
                &format!("sandbox {id} was on node {name}, which was lost (its lease expired)"),
            )
        }
    }
}

/// `/v1/templates`: a commit of a snapshot (a JSON body naming one) goes to the snapshot's
/// node; an import or a listing to any node (the cluster's templates are in etcd).
async fn templates(State(gw): State<App>, req: Request) -> Response {
    let json = req
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if req.method() != Method::POST || !json {
        return anywhere(State(gw), req).await;
    }
    let (parts, bytes, v) = match read_json(req).await {
        Ok(r) => r,
        Err(r) => return r,
    };
    let node = v["snapshot"]
        .as_str()
        .and_then(|s| node_of(&gw, s))
        .and_then(|(_, node)| node);
    let req = Request::from_parts(parts, Body::from(bytes));
    match node {
        Some(n) => forward(&gw, &n, req).await,
        None => anywhere(State(gw), req).await,
    }
}

async fn anywhere(State(gw): State<App>, req: Request) -> Response {
    let (tenant, _) = tenant_of(&gw, req.headers());
    let ask = Ask {
        template: "host",
        tenant: &tenant,
        memory: 0,
    };
    match ranked(&gw, &ask).first() {
        Some(node) => forward(&gw, node, req).await,
        None => no_capacity(),
    }
}
