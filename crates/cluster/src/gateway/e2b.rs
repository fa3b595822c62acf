//! The E2B-compatible API through the gateway (docs/e2b.md, *Through a gateway*). Nodes serve
//! it themselves; the gateway only finds the node:
//!
//! | call | where it goes |
//! |---|---|
//! | `POST /sandboxes`, `POST /v2/sandboxes` | placed like `POST /v1/sandboxes` (placement, quota, idempotency), the body unchanged |
//! | `GET /sandboxes`, `GET /v2/sandboxes` | every live node (every page), merged oldest first by `startedAt`; `limit` and `nextToken` (`X-Next-Token`) applied here |
//! | `/sandboxes/{id}…`, `/v2/sandboxes/{id}…` | the node whose number `id` carries; `404` when that node is unknown or lost |
//! | sandbox traffic (`E2b-Sandbox-Id`, else the id in `X-Access-Token`, else `Host: <port>-<id>.<domain>`) | that node, as it came (method, path, query, headers, bodies streamed both ways); `502 "The sandbox <id> was not found"` when it is unknown or lost |
//!
//! The gateway's own errors on these paths are E2B's `{"code": <status>, "message"}`.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use super::{forward, node_of, App, MAX_JSON};
use crate::place::Ask;

/// Largest page of a list (as a node).
const MAX_LIMIT: usize = 1000;
/// Most pages read from one node for one list.
const MAX_PAGES: usize = 100;

/// Whether `path` is one of the control plane's.
pub(super) fn is_control_path(path: &str) -> bool {
    path == "/sandboxes"
        || path.starts_with("/sandboxes/")
        || path == "/v2/sandboxes"
        || path.starts_with("/v2/sandboxes/")
}

/// The ask of an E2B create body (`templateID`, `base` when absent; no memory field: the
/// node's default, as `/v1` assumes it).
pub(super) fn ask_of<'a>(spec: &'a Value, tenant: &'a str) -> Ask<'a> {
    Ask {
        template: spec["templateID"].as_str().unwrap_or("base"),
        tenant,
        memory: 512 << 20,
    }
}

/// An E2B error answer: `{"code": <status>, "message"}`.
/// An E2B error answer: `{"code": <status>, "message"}` (the node's E2B API answers the same).
pub fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (
        status,
        axum::Json(json!({"code": status.as_u16(), "message": message.into()})),
    )
        .into_response()
}

/// The answer for a sandbox no live node holds (the SDK reads "was not found" on a 502 as "not
/// running").
fn not_running(id: &str) -> Response {
    error(
        StatusCode::BAD_GATEWAY,
        format!("The sandbox {id} was not found"),
    )
}

/// Outermost layer: the control plane and sandbox traffic go to their nodes; everything else
/// to the gateway's routes untouched.
pub(super) async fn dispatch(State(gw): State<App>, req: Request, next: Next) -> Response {
    if is_control_path(req.uri().path()) {
        return e2b_shape(control(gw, req).await).await;
    }
    match target(req.headers()) {
        Some(Some(id)) => traffic(gw, &id, req).await,
        Some(None) => error(StatusCode::UNAUTHORIZED, "invalid access token"),
        None => next.run(req).await,
    }
}

/// The sandbox a request of sandbox traffic names: `E2b-Sandbox-Id`, else the id in
/// `X-Access-Token` (`<id>.<mac>`), else `Host: <port>-<id>.<domain>`. `None`: not sandbox
/// traffic; `Some(None)`: a token that names no sandbox.
fn target(headers: &HeaderMap) -> Option<Option<String>> {
    let get = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    if let Some(id) = get("e2b-sandbox-id") {
        return Some(Some(id.trim().to_owned()));
    }
    if let Some(token) = get("x-access-token") {
        return Some(
            token
                .split_once('.')
                .map(|(id, _)| id.to_owned())
                .filter(|id| !id.is_empty()),
        );
    }
    let first = get(header::HOST.as_str())?.split('.').next()?;
    let (port, id) = first.split_once('-')?;
    (port.parse::<u16>().is_ok() && id.starts_with("sb-")).then(|| Some(id.to_owned()))
}

/// Sandbox traffic for `id`: to its node as it came, `Host` included (it may name the port).
async fn traffic(gw: App, id: &str, req: Request) -> Response {
    let node = match node_of(&gw, id) {
        Some((_, Some(node))) => node,
        Some((_, None)) => {
            gw.lost_calls
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return not_running(id);
        }
        None => return not_running(id),
    };
    let (mut parts, body) = req.into_parts();
    let pq = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let Ok(uri) = format!("{}{pq}", node.url.trim_end_matches('/')).parse::<Uri>() else {
        return error(StatusCode::BAD_GATEWAY, "the node's URL is not valid");
    };
    parts.uri = uri;
    gw.proxied
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    match gw.client.request(Request::from_parts(parts, body)).await {
        Ok(r) => r.map(Body::new),
        Err(e) => error(
            StatusCode::BAD_GATEWAY,
            format!(
                "The sandbox {id} was not found: its node {} does not answer ({e})",
                node.name
            ),
        ),
    }
}

/// The control plane: creates placed, lists merged, calls by id to the sandbox's node.
async fn control(gw: App, req: Request) -> Response {
    let path = req.uri().path().trim_end_matches('/').to_owned();
    let list_path = path == "/sandboxes" || path == "/v2/sandboxes";
    match (req.method().clone(), list_path) {
        (Method::POST, true) => super::create(gw, req).await,
        (Method::GET, true) => list(gw, req).await,
        (_, true) => error(StatusCode::METHOD_NOT_ALLOWED, "GET or POST"),
        (_, false) => by_id(gw, req).await,
    }
}

/// `/sandboxes/{id}…`, `/v2/sandboxes/{id}…`: to the node `id` names.
async fn by_id(gw: App, req: Request) -> Response {
    let path = req.uri().path().to_owned();
    let rest = path.strip_prefix("/v2").unwrap_or(&path);
    let id = rest.split('/').nth(2).unwrap_or("").to_owned();
    let Some((name, node)) = node_of(&gw, &id) else {
        return error(StatusCode::NOT_FOUND, format!("no sandbox {id}"));
    };
    let Some(node) = node else {
        gw.lost_calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        return error(
            StatusCode::NOT_FOUND,
            format!("no sandbox {id}: it was on node {name}, which was lost (its lease expired)"),
        );
    };
    let delete =
        req.method() == Method::DELETE && rest.trim_end_matches('/').matches('/').count() == 2;
    let r = forward(&gw, &node, req).await;
    if delete && r.status().is_success() {
        gw.placed_recently.forget_one(&node.name);
    }
    r
}

/// `GET /sandboxes`, `GET /v2/sandboxes`: every page of every live node, merged oldest first
/// (`startedAt`, then `sandboxID`), then paged here: `nextToken` is the offset of the page.
async fn list(gw: App, req: Request) -> Response {
    let (parts, _) = req.into_parts();
    let mut kept = Vec::new();
    let (mut limit, mut skip) = (MAX_LIMIT, 0usize);
    for pair in parts.uri.query().unwrap_or("").split('&') {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "" => {}
            "limit" => match v.parse::<usize>() {
                Ok(n) => limit = n.clamp(1, MAX_LIMIT),
                Err(_) => return error(StatusCode::BAD_REQUEST, "limit must be a number"),
            },
            "nextToken" => skip = v.parse().unwrap_or(0),
            _ => kept.push(pair),
        }
    }
    let base = format!("{}?{}", parts.uri.path(), kept.join("&"));
    let calls = super::nodes(&gw).into_iter().map(|n| {
        let (gw, headers, base) = (gw.clone(), parts.headers.clone(), base.clone());
        async move { all_pages(&gw, &n, &base, &headers).await }
    });
    let mut items = Vec::new();
    for r in futures_util::future::join_all(calls).await {
        match r {
            Ok(page) => items.extend(page),
            Err(resp) => return resp,
        }
    }
    let key = |v: &Value| {
        (
            v["startedAt"].as_str().unwrap_or("").to_owned(),
            v["sandboxID"].as_str().unwrap_or("").to_owned(),
        )
    };
    items.sort_by_cached_key(key);
    let total = items.len();
    let page: Vec<Value> = items.into_iter().skip(skip).take(limit).collect();
    let mut resp = axum::Json(page).into_response();
    if skip.saturating_add(limit) < total {
        if let Ok(v) = HeaderValue::from_str(&(skip + limit).to_string()) {
            resp.headers_mut().insert("x-next-token", v);
        }
    }
    resp
}

/// Every page of `node`'s list at `base` (a path and query without `limit` or `nextToken`);
/// its answer as it came when it fails.
async fn all_pages(
    gw: &App,
    node: &crate::model::NodeReport,
    base: &str,
    headers: &HeaderMap,
) -> Result<Vec<Value>, Response> {
    let mut out = Vec::new();
    let mut token: Option<String> = None;
    for _ in 0..MAX_PAGES {
        let sep = if base.ends_with('?') { "" } else { "&" };
        let mut pq = format!("{base}{sep}limit={MAX_LIMIT}");
        if let Some(t) = &token {
            pq.push_str(&format!("&nextToken={t}"));
        }
        let mut req = Request::builder().method(Method::GET).uri(&pq);
        for (k, v) in headers {
            if k != header::HOST && k != header::CONTENT_LENGTH {
                req = req.header(k, v);
            }
        }
        let Ok(req) = req.body(Body::empty()) else {
            return Err(error(StatusCode::BAD_REQUEST, "bad list request"));
        };
        let r = forward(gw, node, req).await;
        if !r.status().is_success() {
            return Err(r);
        }
        token = r
            .headers()
            .get("x-next-token")
            .and_then(|v| v.to_str().ok())
            .filter(|t| !t.is_empty())
            .map(str::to_owned);
        let bytes = axum::body::to_bytes(r.into_body(), MAX_JSON)
            .await
            .unwrap_or_default();
        match serde_json::from_slice::<Vec<Value>>(&bytes) {
            Ok(page) => out.extend(page),
            Err(e) => {
                return Err(error(
                    StatusCode::BAD_GATEWAY,
                    format!("node {}: the list is not a JSON array: {e}", node.name),
                ))
            }
        }
        if token.is_none() {
            break;
        }
    }
    Ok(out)
}

/// Rewrites a problem document (`/v1`'s error shape, the gateway's or a node's own) into E2B's
/// `{"code", "message"}`, `Retry-After` kept; any other answer passes untouched.
pub async fn e2b_shape(resp: Response) -> Response {
    let is_problem = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/problem+json"));
    if !is_problem {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let bytes = axum::body::to_bytes(body, 1 << 20)
        .await
        .unwrap_or_default();
    let v: Value = serde_json::from_slice(&bytes).unwrap_or_default();
    let message = v
        .get("detail")
        .or_else(|| v.get("title"))
        .and_then(Value::as_str)
        .unwrap_or("error")
        .to_owned();
    let mut out = error(parts.status, message);
    if let Some(ra) = parts.headers.get(header::RETRY_AFTER) {
        out.headers_mut().insert(header::RETRY_AFTER, ra.clone());
    }
    out
}
