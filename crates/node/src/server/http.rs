//! The HTTP API (`/v1`, see `docs/api.md`): routing, authentication, idempotency, handlers.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Path, Query, Request, State as AxState};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use base64::Engine as _;
use dsec_api::agent::{Event, Request as AgentReq, SessionKind};
use dsec_api::exec::{Command, ExecRequest, ExecResult, Stream};
use dsec_api::ErrorCode;
use serde::Deserialize;
use serde_json::{json, Value};
use sha2::{Digest as _, Sha256};

use crate::sandbox::{Limits, State, Substrate};

use super::app::{now_ms, App, CreateRequest, Entry, PoolSize};
use super::error::{ApiError, ApiResult, REQUEST_ID};
use super::store::{IdemOutcome, SandboxRecord, Tenant};
use super::{auth, log};

type AppState = Arc<App>;

/// Largest request body (file and tar uploads included).
const MAX_BODY: usize = 256 << 20;
/// Largest file read through the API.
const MAX_READ: u64 = 256 << 20;
/// Longest long-poll.
const MAX_WAIT_MS: u64 = 120_000;

/// The router of the whole API.
pub fn router(app: AppState) -> Router {
    let v1 = Router::new()
        .route("/v1/tenants", post(create_tenant).get(list_tenants))
        .route("/v1/tenant", get(own_tenant))
        .route("/v1/sandboxes", post(create_sandbox).get(list_sandboxes))
        .route("/v1/sandboxes/batch", post(batch_create))
        .route("/v1/sandboxes/batch-delete", post(batch_delete))
        .route(
            "/v1/sandboxes/{id}",
            get(get_sandbox).delete(delete_sandbox),
        )
        .route("/v1/sandboxes/{id}/lease", post(lease))
        .route("/v1/sandboxes/{id}/reset", post(reset))
        .route("/v1/sandboxes/{id}/exec", post(exec))
        .route("/v1/sandboxes/{id}/processes", post(spawn))
        .route("/v1/sandboxes/{id}/processes/{handle}", get(proc_status))
        .route(
            "/v1/sandboxes/{id}/processes/{handle}/stdin",
            post(proc_stdin),
        )
        .route(
            "/v1/sandboxes/{id}/processes/{handle}/signal",
            post(proc_signal),
        )
        .route(
            "/v1/sandboxes/{id}/processes/{handle}/wait",
            post(proc_wait),
        )
        .route("/v1/sandboxes/{id}/sessions", post(session_open))
        .route(
            "/v1/sandboxes/{id}/sessions/{session}/run",
            post(session_run),
        )
        .route(
            "/v1/sandboxes/{id}/sessions/{session}",
            axum::routing::delete(session_close),
        )
        .route(
            "/v1/sandboxes/{id}/files",
            get(file_read).put(file_write).delete(file_remove),
        )
        .route("/v1/sandboxes/{id}/files/list", get(file_list))
        .route("/v1/sandboxes/{id}/files/stat", get(file_stat))
        .route("/v1/sandboxes/{id}/files/mkdir", post(file_mkdir))
        .route("/v1/sandboxes/{id}/tar", get(tar_download).put(tar_upload))
        .route("/v1/templates", get(list_templates).post(import_template))
        .route(
            "/v1/templates/{name}",
            get(get_template).delete(delete_template),
        )
        .route("/v1/pools", get(list_pools))
        .route("/v1/pools/{template}", get(get_pool).put(set_pool))
        .route("/v1/events", get(events))
        .route("/v1/run", post(run_native))
        .route("/v1/run/batch", post(run_batch))
        .route("/v1/run:batch", post(run_batch))
        .route("/v1/languages", get(languages))
        .route("/run_code", post(run_code))
        .route("/v1/ping", get(ping))
        .route("/t/{key}/run_code", post(run_code))
        .route("/t/{key}/v1/ping", get(ping))
        .route("/t/{key}/v1/run", post(run_native))
        .route("/t/{key}/v1/run/batch", post(run_batch))
        .route("/t/{key}/v1/run:batch", post(run_batch))
        .route("/t/{key}/v1/languages", get(languages))
        .route("/v1/trajectories", get(list_trajectories))
        .route("/v1/trajectories/{tid}", get(get_trajectory))
        .route("/v1/trajectories/{tid}/records", get(trajectory_records))
        .route("/v1/trajectories/{tid}/stream", get(trajectory_stream))
        .route("/v1/trajectories/{tid}/annotations", post(annotate))
        .route("/v1/trajectories/{tid}/export", get(export_trajectory))
        .route("/v1/trajectories/{tid}/finish", post(finish_trajectory))
        .route("/v1/admin/compact", post(compact_log))
        .layer(middleware::from_fn_with_state(
            Arc::clone(&app),
            idempotency,
        ))
        .layer(middleware::from_fn_with_state(
            Arc::clone(&app),
            authenticate,
        ));
    Router::new()
        .merge(v1)
        .route("/livez", get(|| async { Json(json!({"live": true})) }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(super::metrics_text))
        .route(
            "/openapi.json",
            get(|| async { Json(super::openapi::document()) }),
        )
        .method_not_allowed_fallback(method_not_allowed)
        .fallback(|| async { ApiError::new(ErrorCode::NotFound, "no such endpoint") })
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .layer(middleware::from_fn_with_state(Arc::clone(&app), request_id))
        .with_state(app)
}

/// A known path asked with a method it does not take: a problem document (the router adds the
/// `Allow` header listing the methods it takes).
async fn method_not_allowed(method: Method, uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        ErrorCode::MethodNotAllowed,
        format!(
            "{method} is not allowed on {} (the Allow header lists what is)",
            uri.path().chars().take(200).collect::<String>()
        ),
    )
}

async fn request_id(AxState(app): AxState<AppState>, req: Request, next: Next) -> Response {
    let _in_flight = app.track();
    let id = req
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 64 && v.bytes().all(|b| b.is_ascii_graphic()))
        .map_or_else(auth::random_id, str::to_owned);
    let (method, mut path) = (req.method().clone(), req.uri().path().to_owned());
    // A key carried in the path is never logged.
    if let Some((_, tail)) = path.strip_prefix("/t/").and_then(|r| r.split_once('/')) {
        path = format!("/t/<key>/{tail}");
    }
    let mut resp = REQUEST_ID
        .scope(id.clone(), async move {
            let resp = next.run(req).await;
            if resp.status().is_server_error() {
                log::warn(
                    "request failed",
                    &[
                        ("method", method.as_str()),
                        ("path", &path),
                        ("status", resp.status().as_str()),
                    ],
                );
            }
            resp
        })
        .await;
    if let Ok(v) = HeaderValue::from_str(&id) {
        resp.headers_mut().insert("x-request-id", v);
    }
    resp
}

/// Paths of the code runner: the only ones a key in the path (`/t/<key>/…`) or the anonymous
/// tenant may reach.
fn is_run_path(path: &str) -> bool {
    matches!(
        path,
        "/run_code" | "/v1/ping" | "/v1/run" | "/v1/run/batch" | "/v1/run:batch" | "/v1/languages"
    )
}

async fn authenticate(AxState(app): AxState<AppState>, mut req: Request, next: Next) -> Response {
    // Clients that cannot send a header carry the key in the path: `/t/<key>/run_code`.
    let in_path = req
        .uri()
        .path()
        .strip_prefix("/t/")
        .and_then(|rest| rest.split_once('/'))
        .filter(|(_, tail)| is_run_path(&format!("/{tail}")))
        .map(|(key, _)| key.to_owned());
    let anonymous_ok = is_run_path(req.uri().path());
    let key = in_path.or_else(|| {
        req.headers()
            .get("x-api-key")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
            .or_else(|| {
                req.headers()
                    .get(header::AUTHORIZATION)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.strip_prefix("Bearer "))
                    .map(|v| v.trim().to_owned())
            })
    });
    let Some(key) = key else {
        if let Some(t) = app.runner.anonymous().filter(|_| anonymous_ok) {
            req.extensions_mut().insert(t.clone());
            return next.run(req).await;
        }
        return ApiError::new(
            ErrorCode::Unauthorized,
            "pass an API key as `Authorization: Bearer <key>` or `X-API-Key`",
        )
        .into_response();
    };
    match app.tenant_for_key(&auth::hash_key(&key)) {
        Ok(Some(t)) => {
            req.extensions_mut().insert(t);
            next.run(req).await
        }
        Ok(None) => ApiError::new(ErrorCode::Unauthorized, "unknown API key").into_response(),
        Err(e) => e.into_response(),
    }
}

/// The idempotency key of the request being served.
#[derive(Debug, Clone)]
pub struct IdemKey(pub String);

/// Per-(tenant, key) locks so that two identical requests in flight run once.
type IdemLocks = std::sync::Mutex<HashMap<(String, String), Arc<tokio::sync::Mutex<()>>>>;

fn idem_locks() -> &'static IdemLocks {
    static LOCKS: std::sync::OnceLock<IdemLocks> = std::sync::OnceLock::new();
    LOCKS.get_or_init(Default::default)
}

async fn idempotency(AxState(app): AxState<AppState>, req: Request, next: Next) -> Response {
    if req.method() == Method::GET {
        return next.run(req).await;
    }
    let Some(key) = req.headers().get("idempotency-key").cloned() else {
        return next.run(req).await;
    };
    let Some(key) = key
        .to_str()
        .ok()
        .filter(|k| !k.is_empty() && k.len() <= 128 && k.bytes().all(|b| b.is_ascii_graphic()))
        .map(str::to_owned)
    else {
        return ApiError::invalid("Idempotency-Key must be 1..=128 printable ASCII characters")
            .into_response();
    };
    let Some(tenant) = req.extensions().get::<Tenant>().cloned() else {
        return ApiError::internal("no tenant").into_response();
    };
    let (parts, body) = req.into_parts();
    let bytes = match axum::body::to_bytes(body, MAX_BODY).await {
        Ok(b) => b,
        Err(e) => return ApiError::new(ErrorCode::TooLarge, e.to_string()).into_response(),
    };
    let mut h = Sha256::new();
    h.update(parts.method.as_str());
    h.update(b" ");
    h.update(parts.uri.path_and_query().map_or("", |p| p.as_str()));
    h.update(b"\n");
    h.update(&bytes);
    let hash = hex::encode(h.finalize());
    let slot = (tenant.id.clone(), key.clone());
    let lock = Arc::clone(
        idem_locks()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(slot.clone())
            .or_default(),
    );
    let _held = lock.lock().await;
    let resp = async {
        match app.store.idempotent(&tenant.id, &key) {
            Ok(Some(out)) if out.request_hash == hash => {
                let mut resp = (
                    StatusCode::from_u16(out.status).unwrap_or(StatusCode::OK),
                    out.body,
                )
                    .into_response();
                if let Ok(v) = HeaderValue::from_str(&out.content_type) {
                    resp.headers_mut().insert(header::CONTENT_TYPE, v);
                }
                resp.headers_mut()
                    .insert("idempotent-replayed", HeaderValue::from_static("true"));
                return resp;
            }
            Ok(Some(_)) => {
                return ApiError::new(
                    ErrorCode::IdempotencyConflict,
                    "this Idempotency-Key was used with a different request",
                )
                .into_response()
            }
            Ok(None) => {}
            Err(e) => return ApiError::from(e).into_response(),
        }
        let mut req = Request::from_parts(parts, Body::from(bytes));
        req.extensions_mut().insert(IdemKey(key.clone()));
        let resp = next.run(req).await;
        let ct = resp
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        // Server-side failures are not outcomes: a retry should run again. Streams cannot be
        // replayed.
        if resp.status().is_server_error() || ct.starts_with("text/event-stream") {
            return resp;
        }
        let (rparts, rbody) = resp.into_parts();
        let Ok(rbytes) = axum::body::to_bytes(rbody, MAX_BODY).await else {
            return ApiError::internal("response too large to record").into_response();
        };
        let out = IdemOutcome {
            request_hash: hash,
            status: rparts.status.as_u16(),
            content_type: ct,
            body: rbytes.to_vec(),
        };
        if let Err(e) = app.store.put_idempotent(&tenant.id, &key, &out, now_ms()) {
            return ApiError::from(e).into_response();
        }
        Response::from_parts(rparts, Body::from(rbytes))
    }
    .await;
    drop(_held);
    let mut locks = idem_locks().lock().unwrap_or_else(|p| p.into_inner());
    if locks.get(&slot).is_some_and(|l| Arc::strong_count(l) == 2) {
        locks.remove(&slot);
    }
    resp
}

fn require_admin(t: &Tenant) -> ApiResult<()> {
    if t.admin {
        Ok(())
    } else {
        Err(ApiError::new(
            ErrorCode::Forbidden,
            "only the admin tenant may do this",
        ))
    }
}

fn json_body<T: for<'de> Deserialize<'de>>(bytes: &Bytes) -> ApiResult<T> {
    let src: &[u8] = if bytes.is_empty() { b"{}" } else { bytes };
    serde_json::from_slice(src).map_err(|e| ApiError::invalid(format!("bad JSON body: {e}")))
}

async fn readyz(AxState(app): AxState<AppState>) -> Response {
    let ready = app.ready.load(Ordering::Relaxed);
    let draining = app.draining.load(Ordering::Relaxed);
    let recovery = app
        .recovery
        .lock()
        .map(|r| serde_json::to_value(&*r).unwrap_or_default())
        .unwrap_or_default();
    let vms = app.rt.vms_started();
    let vm_info = json!({
        "started": vms.is_some(),
        "accel": vms.as_ref().map_or_else(|| crate::substrate::vm::detect_accel().name(), |v| v.accel().name()),
        "qemu": vms.as_ref().map(|v| v.qemu_version().to_owned()),
        "kernel": vms.as_ref().map(|v| v.kernel_version().to_owned()),
    });
    let body = json!({
        "ready": ready && !draining,
        "draining": draining,
        "substrates": {"container": true, "function": true, "microvm": true, "vm": true},
        "vm": vm_info,
        "idle_shells": app.rt.idle_shells(),
        "favordynmods": app.rt.favordynmods(),
        "recovery": recovery,
    });
    let status = if ready && !draining {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(body)).into_response()
}

// ---- tenants ----

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NewTenant {
    name: String,
    #[serde(default)]
    max_sandboxes: Option<u64>,
    #[serde(default)]
    max_memory_bytes: Option<u64>,
}

async fn create_tenant(
    AxState(app): AxState<AppState>,
    Extension(caller): Extension<Tenant>,
    body: Bytes,
) -> ApiResult<Response> {
    require_admin(&caller)?;
    let req: NewTenant = json_body(&body)?;
    if req.name.is_empty()
        || req.name.len() > 64
        || !req
            .name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(ApiError::invalid(
            "tenant names are 1..=64 of [A-Za-z0-9_-]",
        ));
    }
    if app.store.tenant_by_name(&req.name)?.is_some() {
        return Err(ApiError::new(
            ErrorCode::InvalidTransition,
            format!("tenant {} exists", req.name),
        ));
    }
    let (t, key) = auth::new_tenant(
        &app.store,
        &req.name,
        false,
        req.max_sandboxes,
        req.max_memory_bytes,
    )?;
    let mut v = serde_json::to_value(&t).unwrap_or_default();
    v["api_key"] = key.into();
    Ok((StatusCode::CREATED, Json(v)).into_response())
}

async fn list_tenants(
    AxState(app): AxState<AppState>,
    Extension(caller): Extension<Tenant>,
) -> ApiResult<Json<Value>> {
    require_admin(&caller)?;
    Ok(Json(json!({"items": app.store.tenants()?})))
}

async fn own_tenant(
    AxState(app): AxState<AppState>,
    Extension(caller): Extension<Tenant>,
) -> Json<Value> {
    let (n, mem) = app.usage(&caller.id);
    let mut v = serde_json::to_value(&caller).unwrap_or_default();
    v["usage"] = json!({"sandboxes": n, "memory_bytes": mem});
    Json(v)
}

// ---- sandboxes ----

/// The public view of a sandbox record.
pub fn view(r: &SandboxRecord) -> Value {
    json!({
        "id": r.id,
        "tenant": r.tenant,
        "template": r.spec.template,
        "substrate": r.substrate,
        "state": r.state,
        "labels": r.labels,
        "limits": r.spec.limits,
        "writable_root": r.spec.writable_root,
        "userns": r.spec.userns,
        "env_keys": r.env.keys().collect::<Vec<_>>(),
        "created_at": rfc3339(r.created_at_ms),
        "acquired_at": r.acquired_at_ms.map(rfc3339),
        "expires_at": r.expires_at_ms.map(rfc3339),
        "lease_expires_at": r.lease_expires_at_ms.map(rfc3339),
        "version": r.version,
        "pooled": r.pooled,
        "error": r.error,
        "phase": r.phase,
    })
}

/// RFC 3339 UTC time of `ms` since the epoch.
pub fn rfc3339(ms: u64) -> String {
    let secs = ms / 1000;
    let days = (secs / 86400) as i64;
    let rem = secs % 86400;
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms % 1000
    )
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct CreateBody {
    #[serde(default)]
    template: Option<String>,
    #[serde(default)]
    substrate: Option<String>,
    #[serde(default)]
    limits: Option<Value>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    #[serde(default)]
    secret_env: BTreeMap<String, String>,
    #[serde(default)]
    labels: BTreeMap<String, String>,
    #[serde(default)]
    ttl_ms: Option<u64>,
    #[serde(default)]
    lease_ms: Option<u64>,
    #[serde(default)]
    writable_root: bool,
    #[serde(default)]
    userns: bool,
}

fn create_request(b: CreateBody) -> ApiResult<CreateRequest> {
    let substrate = match b.substrate.as_deref() {
        None => Substrate::Container,
        Some("function") => {
            return Err(ApiError::invalid(
                "substrate \"function\" runs snippets through POST /v1/run, not sandboxes",
            ))
        }
        Some(s) => Substrate::parse(s).ok_or_else(|| {
            ApiError::invalid(format!(
                "unknown substrate {:?} (container, microvm, vm)",
                s.chars().take(32).collect::<String>()
            ))
        })?,
    };
    // Partial limits: missing fields take the defaults.
    let limits = match b.limits {
        None => Limits::default(),
        Some(Value::Object(given)) => {
            let mut base = serde_json::to_value(Limits::default())
                .map_err(|e| ApiError::internal(e.to_string()))?;
            for (k, v) in given {
                if base.get(&k).is_none() {
                    return Err(ApiError::invalid(format!("unknown limit {k:?}")));
                }
                base[&k] = v;
            }
            serde_json::from_value(base).map_err(|e| ApiError::invalid(format!("limits: {e}")))?
        }
        Some(_) => return Err(ApiError::invalid("limits must be an object")),
    };
    limits
        .validate()
        .map_err(|e| ApiError::invalid(e.to_string()))?;
    if b.userns && substrate.is_vm() {
        return Err(ApiError::invalid(
            "userns applies to the container substrate (a VM guest has its own kernel)",
        ));
    }
    let secret_env: Vec<String> = b.secret_env.keys().cloned().collect();
    let mut env = b.env;
    env.extend(b.secret_env);
    for (k, v) in &env {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(ApiError::invalid(format!("invalid env entry {k:?}")));
        }
    }
    if b.labels.len() > 64
        || b.labels
            .iter()
            .any(|(k, v)| k.is_empty() || k.len() > 63 || v.len() > 256 || k.contains('='))
    {
        return Err(ApiError::invalid(
            "labels: at most 64, keys 1..=63 bytes without '=', values ≤ 256 bytes",
        ));
    }
    for (name, v) in [("ttl_ms", b.ttl_ms), ("lease_ms", b.lease_ms)] {
        if v.is_some_and(|v| v == 0 || v > 30 * 24 * 3600 * 1000) {
            return Err(ApiError::invalid(format!("{name} must be in 1..=30 days")));
        }
    }
    let template = b.template.unwrap_or_else(|| "host".into());
    crate::template::validate_name(&template).map_err(|e| ApiError::invalid(e.to_string()))?;
    Ok(CreateRequest {
        template,
        substrate,
        limits,
        env,
        labels: b.labels,
        ttl_ms: b.ttl_ms,
        lease_ms: b.lease_ms,
        writable_root: b.writable_root,
        idem: None,
        secret_env,
        userns: b.userns,
    })
}

async fn create_sandbox(
    AxState(app): AxState<AppState>,
    Extension(t): Extension<Tenant>,
    idem: Option<Extension<IdemKey>>,
    body: Bytes,
) -> ApiResult<Response> {
    let mut req = create_request(json_body(&body)?)?;
    req.idem = idem.map(|Extension(IdemKey(k))| k);
    let rec = app.create(&t, req).await?;
    super::app::failpoint("create:before_answer");
    log::info(
        "sandbox created",
        &[("sandbox", &rec.id), ("tenant", &t.id)],
    );
    Ok((StatusCode::CREATED, Json(view(&rec))).into_response())
}

#[derive(Deserialize)]
struct GetQuery {
    wait: Option<String>,
    timeout: Option<String>,
    after_version: Option<u64>,
}

/// A duration parameter: `30s`, `500ms`, `2m`, or bare milliseconds.
fn parse_duration(s: &str) -> ApiResult<Duration> {
    let s = s.trim();
    let (num, unit) = s
        .find(|c: char| !c.is_ascii_digit())
        .map_or((s, ""), |i| s.split_at(i));
    let n: u64 = num.parse().map_err(|_| {
        ApiError::invalid(format!(
            "bad duration {:?}",
            s.chars().take(32).collect::<String>()
        ))
    })?;
    let ms = match unit {
        "" | "ms" => n,
        "s" => n.saturating_mul(1000),
        "m" => n.saturating_mul(60_000),
        _ => {
            return Err(ApiError::invalid(
                "durations are <n>ms, <n>s, <n>m or bare milliseconds",
            ))
        }
    };
    Ok(Duration::from_millis(ms))
}

fn parse_state(s: &str) -> ApiResult<State> {
    serde_json::from_value(Value::String(s.to_owned())).map_err(|_| {
        ApiError::invalid(format!(
            "unknown state {:?}",
            s.chars().take(32).collect::<String>()
        ))
    })
}

async fn get_sandbox(
    AxState(app): AxState<AppState>,
    Extension(t): Extension<Tenant>,
    Path(id): Path<String>,
    Query(q): Query<GetQuery>,
) -> ApiResult<Json<Value>> {
    let Some(e) = app.entry(&id) else {
        // Destroyed sandboxes stay readable for a while.
        return match app.store.sandbox(&id)? {
            Some(r) if r.tenant.as_deref() == Some(&t.id) => Ok(Json(view(&r))),
            _ => Err(ApiError::no_sandbox(&id)),
        };
    };
    if e.record().tenant.as_deref() != Some(&t.id) && !t.admin {
        return Err(ApiError::no_sandbox(&id));
    }
    let admin_view = |e: &Entry| {
        let mut v = view(&e.record());
        if t.admin {
            if let Some((sup, init)) = e.pids() {
                v["supervisor_pid"] = sup.into();
                v["init_pid"] = init.into();
            }
        }
        v
    };
    let want = q.wait.as_deref().map(parse_state).transpose()?;
    if want.is_some() || q.after_version.is_some() {
        let timeout = q
            .timeout
            .as_deref()
            .map(parse_duration)
            .transpose()?
            .unwrap_or(Duration::from_secs(30))
            .min(Duration::from_millis(MAX_WAIT_MS));
        let mut rx = e.subscribe();
        let done = |(s, v): (State, u64)| {
            want.is_some_and(|w| w == s)
                || q.after_version.is_some_and(|a| v > a)
                || matches!(s, State::Stopped | State::Failed)
        };
        let _ = tokio::time::timeout(timeout, async {
            loop {
                if done(*rx.borrow_and_update()) {
                    break;
                }
                if rx.changed().await.is_err() {
                    break;
                }
            }
        })
        .await;
    }
    Ok(Json(admin_view(&e)))
}

async fn list_sandboxes(
    AxState(app): AxState<AppState>,
    Extension(t): Extension<Tenant>,
    Query(q): Query<Vec<(String, String)>>,
) -> ApiResult<Json<Value>> {
    let mut state = None;
    let mut labels = BTreeMap::new();
    let mut limit = 100usize;
    let mut cursor = String::new();
    let mut owner = t.id.clone();
    for (k, v) in q {
        match k.as_str() {
            "tenant" => {
                require_admin(&t)?;
                owner = v;
            }
            "state" => state = Some(parse_state(&v)?),
            "label" => {
                let (lk, lv) = v
                    .split_once('=')
                    .ok_or_else(|| ApiError::invalid("label filters are k=v"))?;
                labels.insert(lk.to_owned(), lv.to_owned());
            }
            "limit" => {
                limit = v
                    .parse()
                    .ok()
                    .filter(|l| (1..=1000).contains(l))
                    .ok_or_else(|| ApiError::invalid("limit must be in 1..=1000"))?;
            }
            "cursor" => cursor = v,
            other => {
                return Err(ApiError::invalid(format!(
                    "unknown parameter {:?}",
                    other.chars().take(32).collect::<String>()
                )))
            }
        }
    }
    let mut items = Vec::new();
    let mut next = None;
    'scan: loop {
        let page = app.store.tenant_sandboxes(&owner, &cursor, 500)?;
        let exhausted = page.len() < 500;
        for r in page {
            cursor = r.id.clone();
            let state_ok = match state {
                Some(s) => r.state == s,
                None => r.state != State::Stopped,
            };
            if state_ok && labels.iter().all(|(k, v)| r.labels.get(k) == Some(v)) {
                items.push(view(&r));
                if items.len() == limit {
                    next = Some(cursor.clone());
                    break 'scan;
                }
            }
        }
        if exhausted {
            break;
        }
    }
    Ok(Json(json!({"items": items, "next_cursor": next})))
}

async fn delete_sandbox(
    AxState(app): AxState<AppState>,
    Extension(t): Extension<Tenant>,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    let e = app.owned_or_admin(&t, &id)?;
    let rec = app.destroy(&e).await?;
    log::info(
        "sandbox destroyed",
        &[
            ("sandbox", &rec.id),
            ("tenant", rec.tenant.as_deref().unwrap_or("-")),
        ],
    );
    Ok(Json(view(&rec)))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchCreate {
    count: usize,
    #[serde(default)]
    spec: Option<Value>,
}

async fn batch_create(
    AxState(app): AxState<AppState>,
    Extension(t): Extension<Tenant>,
    idem: Option<Extension<IdemKey>>,
    body: Bytes,
) -> ApiResult<Json<Value>> {
    let idem = idem.map(|Extension(IdemKey(k))| k);
    let b: BatchCreate = json_body(&body)?;
    if !(1..=1000).contains(&b.count) {
        return Err(ApiError::invalid("count must be in 1..=1000"));
    }
    let spec: CreateBody = match b.spec {
        Some(v) => {
            serde_json::from_value(v).map_err(|e| ApiError::invalid(format!("spec: {e}")))?
        }
        None => CreateBody::default(),
    };
    let req = create_request(spec)?;
    let mut set = tokio::task::JoinSet::new();
    for i in 0..b.count {
        let app = Arc::clone(&app);
        let t = t.clone();
        let mut req = req.clone();
        // Each item has its own key, so that a retried batch finds what it already made.
        req.idem = idem.as_ref().map(|k| format!("{k}#{i}"));
        set.spawn(async move { (i, app.create(&t, req).await) });
    }
    let mut out: Vec<(usize, Value)> = Vec::with_capacity(b.count);
    while let Some(r) = set.join_next().await {
        let (i, r) = r.map_err(|e| ApiError::internal(e.to_string()))?;
        out.push((
            i,
            match r {
                Ok(rec) => json!({"ok": true, "sandbox": view(&rec)}),
                Err(e) => json!({"ok": false, "error": e.problem()}),
            },
        ));
    }
    out.sort_by_key(|(i, _)| *i);
    Ok(Json(
        json!({"items": out.into_iter().map(|(_, v)| v).collect::<Vec<_>>()}),
    ))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchDelete {
    #[serde(default)]
    ids: Option<Vec<String>>,
    #[serde(default)]
    labels: Option<BTreeMap<String, String>>,
}

async fn batch_delete(
    AxState(app): AxState<AppState>,
    Extension(t): Extension<Tenant>,
    body: Bytes,
) -> ApiResult<Json<Value>> {
    let b: BatchDelete = json_body(&body)?;
    let ids: Vec<String> = match (b.ids, b.labels) {
        (Some(ids), None) => {
            if ids.len() > 10_000 {
                return Err(ApiError::invalid("at most 10000 ids"));
            }
            ids
        }
        (None, Some(sel)) => {
            if sel.is_empty() {
                return Err(ApiError::invalid(
                    "an empty label selector would match everything",
                ));
            }
            let mut ids: Vec<String> = app
                .entries()
                .into_iter()
                .map(|e| e.record())
                .filter(|r| {
                    r.tenant.as_deref() == Some(&t.id)
                        && sel.iter().all(|(k, v)| r.labels.get(k) == Some(v))
                })
                .map(|r| r.id)
                .collect();
            ids.sort();
            ids
        }
        _ => return Err(ApiError::invalid("pass exactly one of ids and labels")),
    };
    let mut set = tokio::task::JoinSet::new();
    for (i, id) in ids.into_iter().enumerate() {
        let app = Arc::clone(&app);
        let t = t.clone();
        set.spawn(async move {
            let r = match app.owned(&t, &id) {
                Ok(e) => app.destroy(&e).await.map(|_| ()),
                Err(e) => Err(e),
            };
            (i, id, r)
        });
    }
    let mut out = Vec::new();
    while let Some(r) = set.join_next().await {
        let (i, id, r) = r.map_err(|e| ApiError::internal(e.to_string()))?;
        out.push((
            i,
            match r {
                Ok(()) => json!({"id": id, "ok": true}),
                Err(e) => json!({"id": id, "ok": false, "error": e.problem()}),
            },
        ));
    }
    out.sort_by_key(|(i, _)| *i);
    Ok(Json(
        json!({"items": out.into_iter().map(|(_, v)| v).collect::<Vec<_>>()}),
    ))
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct LeaseBody {
    #[serde(default)]
    lease_ms: Option<u64>,
}

async fn lease(
    AxState(app): AxState<AppState>,
    Extension(t): Extension<Tenant>,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<Json<Value>> {
    let b: LeaseBody = json_body(&body)?;
    if b.lease_ms
        .is_some_and(|v| v == 0 || v > 30 * 24 * 3600 * 1000)
    {
        return Err(ApiError::invalid("lease_ms must be in 1..=30 days"));
    }
    let e = app.owned(&t, &id)?;
    Ok(Json(view(&app.heartbeat(&e, b.lease_ms)?)))
}

async fn reset(
    AxState(app): AxState<AppState>,
    Extension(t): Extension<Tenant>,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    let e = app.owned(&t, &id)?;
    Ok(Json(view(&app.reset(&e).await?)))
}

// ---- running things in a sandbox ----

/// Runs `f` on the sandbox's agent on the blocking pool, holding the sandbox exclusively.
async fn with_sandbox<T: Send + 'static>(
    app: &AppState,
    e: &Arc<Entry>,
    f: impl FnOnce(&crate::substrate::ContainerRuntime, &mut crate::substrate::Sandbox) -> ApiResult<T>
        + Send
        + 'static,
) -> ApiResult<T> {
    let mut guard = e.lock().await;
    if guard.is_none() || e.record().state != State::Running {
        return Err(ApiError::new(
            ErrorCode::InvalidTransition,
            format!("sandbox {} is {:?}", e.id, e.record().state),
        ));
    }
    let rt = Arc::clone(&app.rt);
    tokio::task::spawn_blocking(move || match guard.as_mut() {
        Some(sb) => f(&rt, sb),
        None => Err(ApiError::no_sandbox("")),
    })
    .await
    .map_err(|err| ApiError::internal(err.to_string()))?
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ExecBody {
    #[serde(default, alias = "trajectory_id")]
    trajectory: Option<String>,
    #[serde(default)]
    step: Option<u64>,
    #[serde(default)]
    argv: Option<Vec<String>>,
    #[serde(default)]
    shell: Option<String>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    #[serde(default)]
    cwd: Option<String>,
    #[serde(default)]
    timeout_ms: Option<u64>,
    #[serde(default)]
    cpu_limit_ms: Option<u64>,
    #[serde(default)]
    output_limit: Option<u64>,
    #[serde(default)]
    stdin: Option<String>,
    #[serde(default)]
    stdin_b64: Option<String>,
}

fn exec_request(
    b: ExecBody,
    base_env: &BTreeMap<String, String>,
) -> ApiResult<(ExecRequest, Vec<u8>)> {
    let command = match (b.argv, b.shell) {
        (Some(a), None) => Command::Argv(a),
        (None, Some(s)) => Command::Shell(s),
        _ => return Err(ApiError::invalid("pass exactly one of argv and shell")),
    };
    let stdin = match (b.stdin, b.stdin_b64) {
        (Some(s), None) => s.into_bytes(),
        (None, Some(s)) => base64::engine::general_purpose::STANDARD
            .decode(s)
            .map_err(|e| ApiError::invalid(format!("stdin_b64: {e}")))?,
        (None, None) => Vec::new(),
        _ => return Err(ApiError::invalid("pass at most one of stdin and stdin_b64")),
    };
    let mut env = base_env.clone();
    env.extend(b.env);
    let req = ExecRequest {
        command,
        env,
        cwd: b.cwd,
        timeout_ms: b.timeout_ms,
        cpu_limit_ms: b.cpu_limit_ms,
        output_limit: b.output_limit,
        stream: false,
    };
    req.validate().map_err(ApiError::invalid)?;
    Ok((req, stdin))
}

#[derive(Deserialize)]
struct ExecQuery {
    #[serde(default)]
    stream: bool,
}

async fn exec(
    AxState(app): AxState<AppState>,
    Extension(t): Extension<Tenant>,
    Path(id): Path<String>,
    Query(q): Query<ExecQuery>,
    body: Bytes,
) -> ApiResult<Response> {
    let e = app.owned(&t, &id)?;
    let mut b: ExecBody = json_body(&body)?;
    let (trajectory, step) = (b.trajectory.take(), b.step.take());
    let (mut req, stdin) = exec_request(b, &e.record().env)?;
    app.metrics.execs.inc();
    if let Some(trajectory) = trajectory {
        if q.stream {
            return Err(ApiError::invalid(
                "a streamed exec cannot be a trajectory step; drop ?stream=true",
            ));
        }
        let action = action_of(&body, &["trajectory", "step"])?;
        let app2 = Arc::clone(&app);
        let e2 = Arc::clone(&e);
        return logged_step(
            &app,
            &t,
            &e,
            &trajectory,
            step,
            "exec",
            action,
            move || async move {
                let t0 = std::time::Instant::now();
                let r = with_sandbox(&app2, &e2, move |rt, sb| {
                    sb.exec(rt, &req, &stdin, |_, _| {}).map_err(ApiError::from)
                })
                .await?;
                app2.metrics.exec.observe_duration(t0.elapsed());
                count_kills(&app2, &r);
                Ok(serde_json::to_value(r).unwrap_or_default())
            },
        )
        .await;
    }
    if !q.stream {
        let t0 = std::time::Instant::now();
        let r = with_sandbox(&app, &e, move |rt, sb| {
            sb.exec(rt, &req, &stdin, |_, _| {}).map_err(ApiError::from)
        })
        .await?;
        app.metrics.exec.observe_duration(t0.elapsed());
        count_kills(&app, &r);
        return Ok(Json(r).into_response());
    }
    req.stream = true;
    let (tx, rx) = tokio::sync::mpsc::channel::<SseEvent>(64);
    let app2 = Arc::clone(&app);
    tokio::spawn(async move {
        let out_tx = tx.clone();
        let r = with_sandbox(&app2, &e, move |rt, sb| {
            sb.exec(rt, &req, &stdin, |stream, bytes| {
                let name = match stream {
                    Stream::Stdout => "stdout",
                    Stream::Stderr => "stderr",
                };
                let data =
                    json!({"data_b64": base64::engine::general_purpose::STANDARD.encode(bytes)});
                // Bounded: a slow client slows the command's output, not the node's memory.
                let _ =
                    out_tx.blocking_send(SseEvent::default().event(name).data(data.to_string()));
            })
            .map_err(ApiError::from)
        })
        .await;
        let ev = match r {
            Ok(res) => {
                count_kills(&app2, &res);
                SseEvent::default()
                    .event("exit")
                    .data(serde_json::to_string(&res).unwrap_or_default())
            }
            Err(err) => SseEvent::default()
                .event("error")
                .data(serde_json::to_string(&err.problem()).unwrap_or_default()),
        };
        let _ = tx.send(ev).await;
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|ev| (Ok::<_, Infallible>(ev), rx))
    });
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response())
}

/// The client's request body without the trajectory fields (what a step's digest covers).
fn action_of(body: &Bytes, drop: &[&str]) -> ApiResult<Value> {
    let mut v: Value = serde_json::from_slice(if body.is_empty() { b"{}" } else { body })
        .map_err(|e| ApiError::invalid(format!("bad JSON body: {e}")))?;
    if let Some(o) = v.as_object_mut() {
        for k in drop {
            o.remove(*k);
        }
    }
    Ok(v)
}

/// Runs `run` as step `step` of `trajectory` (see `trajectory.rs`): replayed from the log when
/// it was recorded, refused when its outcome is unknown or the step does not continue the
/// trajectory, otherwise run with its intent and its answer made durable.
#[allow(clippy::too_many_arguments)]
async fn logged_step<F, Fut>(
    app: &AppState,
    t: &Tenant,
    e: &Entry,
    trajectory: &str,
    step: Option<u64>,
    op: &str,
    action: Value,
    run: F,
) -> ApiResult<Response>
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = ApiResult<Value>>,
{
    let rec = e.record();
    let secrets: Vec<String> = rec
        .secret_env
        .iter()
        .filter_map(|k| rec.env.get(k).cloned())
        .collect();
    let begun = app
        .trajectories
        .begin(t, trajectory, step, op, &e.id, &action, secrets)
        .await?;
    let (status, body, step, replayed) = match begun {
        super::trajectory::Begin::Replay { status, body, step } => (status, body, step, true),
        super::trajectory::Begin::Run(running) => {
            let step = running.step();
            let (status, body, summary) = match run().await {
                Ok(v) => {
                    let summary = json!({"status": v["status"], "exit_code": v["exit_code"], "wall_us": v["wall_us"]});
                    (200u16, serde_json::to_vec(&v).unwrap_or_default(), summary)
                }
                Err(err) => (
                    ApiError::status_of(err.code).as_u16(),
                    serde_json::to_vec(&err.problem()).unwrap_or_default(),
                    json!({"error": err.code}),
                ),
            };
            let body = app
                .trajectories
                .finish(running, status, &body, summary)
                .await?;
            (status, body, step, false)
        }
    };
    let mut resp = (StatusCode::from_u16(status).unwrap_or(StatusCode::OK), body).into_response();
    let ct = if status < 400 {
        "application/json"
    } else {
        "application/problem+json"
    };
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(ct));
    if let Ok(v) = HeaderValue::from_str(&step.to_string()) {
        resp.headers_mut().insert("dsec-step", v);
    }
    if replayed {
        resp.headers_mut()
            .insert("dsec-replayed", HeaderValue::from_static("true"));
    }
    Ok(resp)
}

/// Counts seccomp (SIGSYS) and OOM kills for `/metrics`.
fn count_kills(app: &App, r: &ExecResult) {
    if r.signal == Some(31) {
        app.metrics.seccomp_kills.inc();
    }
    if r.status == dsec_api::exec::ExecStatus::Oom {
        app.metrics.oom_kills.inc();
    }
}

fn agent_event(
    sb: &mut crate::substrate::Sandbox,
    req: &AgentReq,
    body: &[u8],
    timeout: Option<Duration>,
) -> ApiResult<Event> {
    Ok(sb.agent().call(req, body, timeout, |_, _| {})?.0)
}

async fn spawn(
    AxState(app): AxState<AppState>,
    Extension(t): Extension<Tenant>,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<Response> {
    let e = app.owned(&t, &id)?;
    let (req, stdin) = exec_request(json_body(&body)?, &e.record().env)?;
    let ev = with_sandbox(&app, &e, move |_, sb| {
        agent_event(sb, &AgentReq::Spawn(req), &stdin, None)
    })
    .await?;
    match ev {
        Event::Started { handle, pid } => Ok((
            StatusCode::CREATED,
            Json(json!({"handle": handle, "pid": pid})),
        )
            .into_response()),
        other => Err(ApiError::internal(format!("unexpected {other:?}"))),
    }
}

async fn proc_status(
    AxState(app): AxState<AppState>,
    Extension(t): Extension<Tenant>,
    Path((id, handle)): Path<(String, u64)>,
) -> ApiResult<Json<Value>> {
    let e = app.owned(&t, &id)?;
    let ev = with_sandbox(&app, &e, move |_, sb| {
        agent_event(sb, &AgentReq::ProcStatus { handle }, &[], None)
    })
    .await?;
    match ev {
        Event::ProcStatus { running, pid } => Ok(Json(json!({"running": running, "pid": pid}))),
        other => Err(ApiError::internal(format!("unexpected {other:?}"))),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StdinBody {
    #[serde(default)]
    data: Option<String>,
    #[serde(default)]
    data_b64: Option<String>,
    #[serde(default)]
    eof: bool,
}

async fn proc_stdin(
    AxState(app): AxState<AppState>,
    Extension(t): Extension<Tenant>,
    Path((id, handle)): Path<(String, u64)>,
    body: Bytes,
) -> ApiResult<StatusCode> {
    let b: StdinBody = json_body(&body)?;
    let data = match (b.data, b.data_b64) {
        (Some(s), None) => s.into_bytes(),
        (None, Some(s)) => base64::engine::general_purpose::STANDARD
            .decode(s)
            .map_err(|e| ApiError::invalid(format!("data_b64: {e}")))?,
        (None, None) => Vec::new(),
        _ => return Err(ApiError::invalid("pass at most one of data and data_b64")),
    };
    let req = AgentReq::ProcStdin { handle, eof: b.eof };
    agent_ok(&app, &t, &id, req, Bytes::from(data)).await
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SignalBody {
    signal: i32,
}

async fn proc_signal(
    AxState(app): AxState<AppState>,
    Extension(t): Extension<Tenant>,
    Path((id, handle)): Path<(String, u64)>,
    body: Bytes,
) -> ApiResult<StatusCode> {
    let b: SignalBody = json_body(&body)?;
    if !(1..=64).contains(&b.signal) {
        return Err(ApiError::invalid("signal must be in 1..=64"));
    }
    let req = AgentReq::ProcSignal {
        handle,
        signal: b.signal,
    };
    agent_ok(&app, &t, &id, req, Bytes::new()).await
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct WaitBody {
    #[serde(default)]
    timeout_ms: Option<u64>,
}

async fn proc_wait(
    AxState(app): AxState<AppState>,
    Extension(t): Extension<Tenant>,
    Path((id, handle)): Path<(String, u64)>,
    body: Bytes,
) -> ApiResult<Json<Value>> {
    let b: WaitBody = json_body(&body)?;
    let timeout_ms = b.timeout_ms.unwrap_or(30_000).min(MAX_WAIT_MS);
    let e = app.owned(&t, &id)?;
    let ev = with_sandbox(&app, &e, move |_, sb| {
        agent_event(
            sb,
            &AgentReq::ProcWait { handle, timeout_ms },
            &[],
            Some(Duration::from_millis(timeout_ms)),
        )
    })
    .await?;
    match ev {
        Event::ExecDone(r) => Ok(Json(serde_json::to_value(r).unwrap_or_default())),
        Event::ProcStatus { running, pid } => Ok(Json(json!({"running": running, "pid": pid}))),
        other => Err(ApiError::internal(format!("unexpected {other:?}"))),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SessionBody {
    kind: SessionKind,
    #[serde(default)]
    env: BTreeMap<String, String>,
    #[serde(default)]
    cwd: Option<String>,
}

async fn session_open(
    AxState(app): AxState<AppState>,
    Extension(t): Extension<Tenant>,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<Response> {
    let b: SessionBody = json_body(&body)?;
    let e = app.owned(&t, &id)?;
    let mut env = e.record().env;
    env.extend(b.env);
    let ev = with_sandbox(&app, &e, move |_, sb| {
        agent_event(
            sb,
            &AgentReq::SessionOpen {
                kind: b.kind,
                env,
                cwd: b.cwd,
            },
            &[],
            None,
        )
    })
    .await?;
    match ev {
        Event::SessionOpened { session } => {
            Ok((StatusCode::CREATED, Json(json!({"session": session}))).into_response())
        }
        other => Err(ApiError::internal(format!("unexpected {other:?}"))),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RunBody {
    #[serde(default, alias = "trajectory_id")]
    trajectory: Option<String>,
    #[serde(default)]
    step: Option<u64>,
    input: String,
    #[serde(default)]
    timeout_ms: Option<u64>,
}

async fn session_run(
    AxState(app): AxState<AppState>,
    Extension(t): Extension<Tenant>,
    Path((id, session)): Path<(String, u64)>,
    body: Bytes,
) -> ApiResult<Response> {
    let mut b: RunBody = json_body(&body)?;
    if b.timeout_ms
        .is_some_and(|t| t == 0 || t > dsec_api::exec::MAX_TIMEOUT_MS)
    {
        return Err(ApiError::invalid("timeout_ms out of range"));
    }
    let e = app.owned(&t, &id)?;
    let (trajectory, step) = (b.trajectory.take(), b.step.take());
    let app2 = Arc::clone(&app);
    let e2 = Arc::clone(&e);
    let run = move || async move {
        let ev = with_sandbox(&app2, &e2, move |_, sb| {
            agent_event(
                sb,
                &AgentReq::SessionRun {
                    session,
                    input: b.input,
                    timeout_ms: b.timeout_ms,
                },
                &[],
                b.timeout_ms.map(Duration::from_millis),
            )
        })
        .await?;
        match ev {
            Event::ExecDone(r) => Ok(serde_json::to_value(r).unwrap_or_default()),
            other => Err(ApiError::internal(format!("unexpected {other:?}"))),
        }
    };
    match trajectory {
        Some(trajectory) => {
            let mut action = action_of(&body, &["trajectory", "step"])?;
            action["session"] = session.into();
            logged_step(&app, &t, &e, &trajectory, step, "session_run", action, run).await
        }
        None => Ok(Json(run().await?).into_response()),
    }
}

async fn session_close(
    AxState(app): AxState<AppState>,
    Extension(t): Extension<Tenant>,
    Path((id, session)): Path<(String, u64)>,
) -> ApiResult<StatusCode> {
    agent_ok(
        &app,
        &t,
        &id,
        AgentReq::SessionClose { session },
        Bytes::new(),
    )
    .await
}

// ---- files ----

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileQuery {
    path: String,
    #[serde(default, alias = "trajectory_id")]
    trajectory: Option<String>,
    #[serde(default)]
    step: Option<u64>,
    #[serde(default)]
    max_bytes: Option<u64>,
    #[serde(default)]
    mode: Option<u32>,
    #[serde(default)]
    parents: bool,
    #[serde(default)]
    recursive: bool,
}

fn octet(bytes: Vec<u8>, ct: &'static str) -> Response {
    let mut r = (StatusCode::OK, bytes).into_response();
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(ct));
    r
}

/// Sends one request whose answer is `Ok` to the agent of the caller's sandbox `id`: 204.
async fn agent_ok(
    app: &AppState,
    t: &Tenant,
    id: &str,
    req: AgentReq,
    body: Bytes,
) -> ApiResult<StatusCode> {
    let e = app.owned(t, id)?;
    with_sandbox(app, &e, move |_, sb| {
        sb.agent().call_ok(&req, &body).map_err(ApiError::from)
    })
    .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Sends one request answered by data chunks (a file, a tar stream), at most `max` bytes.
async fn agent_data(
    app: &AppState,
    t: &Tenant,
    id: &str,
    req: AgentReq,
    max: u64,
    content_type: &'static str,
) -> ApiResult<Response> {
    let e = app.owned(t, id)?;
    let data = with_sandbox(app, &e, move |_, sb| {
        sb.agent()
            .call_data(&req, max as usize)
            .map_err(ApiError::from)
    })
    .await?;
    Ok(octet(data, content_type))
}

async fn file_read(
    AxState(app): AxState<AppState>,
    Extension(t): Extension<Tenant>,
    Path(id): Path<String>,
    Query(q): Query<FileQuery>,
) -> ApiResult<Response> {
    let max = q.max_bytes.unwrap_or(MAX_READ).min(MAX_READ);
    let req = AgentReq::FileRead {
        path: q.path,
        max_bytes: Some(max),
    };
    agent_data(&app, &t, &id, req, max, "application/octet-stream").await
}

async fn file_write(
    AxState(app): AxState<AppState>,
    Extension(t): Extension<Tenant>,
    Path(id): Path<String>,
    Query(q): Query<FileQuery>,
    body: Bytes,
) -> ApiResult<Response> {
    let e = app.owned(&t, &id)?;
    let trajectory = q.trajectory.clone();
    let step = q.step;
    let mut action = json!({
        "path": q.path,
        "mode": q.mode,
        "parents": q.parents,
        "content_sha256": hex::encode(Sha256::digest(&body)),
        "content_len": body.len(),
    });
    if body.len() <= 64 << 10 {
        action["content_b64"] = base64::engine::general_purpose::STANDARD
            .encode(&body)
            .into();
    }
    let app2 = Arc::clone(&app);
    let e2 = Arc::clone(&e);
    let run = move || async move {
        with_sandbox(&app2, &e2, move |_, sb| {
            sb.agent()
                .call_ok(
                    &AgentReq::FileWrite {
                        path: q.path,
                        mode: q.mode,
                        parents: q.parents,
                    },
                    &body,
                )
                .map_err(ApiError::from)
        })
        .await?;
        Ok(json!({"written": true}))
    };
    match trajectory {
        Some(trajectory) => {
            logged_step(&app, &t, &e, &trajectory, step, "file_write", action, run).await
        }
        None => {
            run().await?;
            Ok(StatusCode::NO_CONTENT.into_response())
        }
    }
}

async fn file_remove(
    AxState(app): AxState<AppState>,
    Extension(t): Extension<Tenant>,
    Path(id): Path<String>,
    Query(q): Query<FileQuery>,
) -> ApiResult<StatusCode> {
    let req = AgentReq::Remove {
        path: q.path,
        recursive: q.recursive,
    };
    agent_ok(&app, &t, &id, req, Bytes::new()).await
}

async fn file_list(
    AxState(app): AxState<AppState>,
    Extension(t): Extension<Tenant>,
    Path(id): Path<String>,
    Query(q): Query<FileQuery>,
) -> ApiResult<Json<Value>> {
    let e = app.owned(&t, &id)?;
    let ev = with_sandbox(&app, &e, move |_, sb| {
        agent_event(sb, &AgentReq::FileList { path: q.path }, &[], None)
    })
    .await?;
    match ev {
        Event::Listing { entries } => Ok(Json(json!({"entries": entries}))),
        other => Err(ApiError::internal(format!("unexpected {other:?}"))),
    }
}

async fn file_stat(
    AxState(app): AxState<AppState>,
    Extension(t): Extension<Tenant>,
    Path(id): Path<String>,
    Query(q): Query<FileQuery>,
) -> ApiResult<Json<Value>> {
    let e = app.owned(&t, &id)?;
    let ev = with_sandbox(&app, &e, move |_, sb| {
        agent_event(sb, &AgentReq::FileStat { path: q.path }, &[], None)
    })
    .await?;
    match ev {
        Event::Stat(s) => Ok(Json(serde_json::to_value(s).unwrap_or_default())),
        other => Err(ApiError::internal(format!("unexpected {other:?}"))),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MkdirBody {
    path: String,
    #[serde(default)]
    parents: bool,
    #[serde(default)]
    mode: Option<u32>,
}

async fn file_mkdir(
    AxState(app): AxState<AppState>,
    Extension(t): Extension<Tenant>,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<StatusCode> {
    let b: MkdirBody = json_body(&body)?;
    let req = AgentReq::Mkdir {
        path: b.path,
        parents: b.parents,
        mode: b.mode,
    };
    agent_ok(&app, &t, &id, req, Bytes::new()).await
}

async fn tar_upload(
    AxState(app): AxState<AppState>,
    Extension(t): Extension<Tenant>,
    Path(id): Path<String>,
    Query(q): Query<FileQuery>,
    body: Bytes,
) -> ApiResult<StatusCode> {
    agent_ok(&app, &t, &id, AgentReq::TarUpload { path: q.path }, body).await
}

async fn tar_download(
    AxState(app): AxState<AppState>,
    Extension(t): Extension<Tenant>,
    Path(id): Path<String>,
    Query(q): Query<FileQuery>,
) -> ApiResult<Response> {
    let max = q.max_bytes.unwrap_or(MAX_READ).min(MAX_READ);
    let req = AgentReq::TarDownload {
        path: q.path,
        max_bytes: Some(max),
    };
    agent_data(&app, &t, &id, req, max, "application/x-tar").await
}

// ---- templates and pools ----

async fn list_templates(AxState(app): AxState<AppState>) -> ApiResult<Json<Value>> {
    let rt = Arc::clone(&app.rt);
    let list = tokio::task::spawn_blocking(move || rt.templates().list())
        .await
        .map_err(|e| ApiError::internal(e.to_string()))??;
    Ok(Json(json!({"items": list})))
}

async fn get_template(
    AxState(app): AxState<AppState>,
    Path(name): Path<String>,
) -> ApiResult<Json<Value>> {
    let rt = Arc::clone(&app.rt);
    let t = tokio::task::spawn_blocking(move || rt.templates().get(&name))
        .await
        .map_err(|e| ApiError::internal(e.to_string()))??;
    Ok(Json(serde_json::to_value(t).unwrap_or_default()))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ImportQuery {
    name: String,
    #[serde(default)]
    format: Option<String>,
}

async fn import_template(
    AxState(app): AxState<AppState>,
    Extension(caller): Extension<Tenant>,
    Query(q): Query<ImportQuery>,
    body: Bytes,
) -> ApiResult<Response> {
    require_admin(&caller)?;
    let rt = Arc::clone(&app.rt);
    let limits = crate::template::ImportLimits::default();
    let t = tokio::task::spawn_blocking(move || {
        let mut reader = std::io::Cursor::new(body);
        match q.format.as_deref().unwrap_or("rootfs") {
            "rootfs" => rt
                .templates()
                .import_rootfs_tar(&q.name, reader, &limits)
                .map_err(ApiError::from),
            "oci" | "docker" => rt
                .templates()
                .import_oci(
                    &q.name,
                    crate::template::OciSource::Tar(&mut reader),
                    &limits,
                )
                .map_err(ApiError::from),
            _ => Err(ApiError::invalid("format must be rootfs, oci or docker")),
        }
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))??;
    forget_template(&app, &t.name);
    Ok((
        StatusCode::CREATED,
        Json(serde_json::to_value(t).unwrap_or_default()),
    )
        .into_response())
}

async fn delete_template(
    AxState(app): AxState<AppState>,
    Extension(caller): Extension<Tenant>,
    Path(name): Path<String>,
) -> ApiResult<StatusCode> {
    require_admin(&caller)?;
    let gone = name.clone();
    let owner = Arc::clone(&app);
    tokio::task::spawn_blocking(move || {
        let in_use = || owner.templates_in_use();
        owner.rt.templates().remove(&name, &in_use)
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))??;
    forget_template(&app, &gone);
    Ok(StatusCode::NO_CONTENT)
}

/// Drops what was derived from a template that was imported again or deleted: its probed
/// languages and its VM snapshots (the next VM create builds them from the new layers).
fn forget_template(app: &App, name: &str) {
    super::run::forget_languages(app, name);
    if let Some(vms) = app.rt.vms_started() {
        vms.forget_template(name);
    }
}

async fn list_pools(AxState(app): AxState<AppState>) -> Json<Value> {
    Json(json!({"items": app.pool_stats()}))
}

async fn get_pool(
    AxState(app): AxState<AppState>,
    Path(template): Path<String>,
) -> ApiResult<Json<Value>> {
    app.pool_stats()
        .into_iter()
        .find(|p| p["template"] == template.as_str())
        .map(Json)
        .ok_or_else(|| ApiError::new(ErrorCode::NotFound, format!("no pool for {template}")))
}

async fn set_pool(
    AxState(app): AxState<AppState>,
    Extension(caller): Extension<Tenant>,
    Path(template): Path<String>,
    body: Bytes,
) -> ApiResult<Json<Value>> {
    require_admin(&caller)?;
    let size: PoolSize = json_body(&body)?;
    if size.min > size.max || size.max > 10_000 {
        return Err(ApiError::invalid("need min ≤ max ≤ 10000"));
    }
    let (base, _) = super::app::parse_pool_name(&template)
        .ok_or_else(|| ApiError::invalid("a pool is named <template> or <template>@microvm|vm"))?;
    if base != "host" {
        let rt = Arc::clone(&app.rt);
        let name = base.to_owned();
        tokio::task::spawn_blocking(move || rt.templates().get(&name))
            .await
            .map_err(|e| ApiError::internal(e.to_string()))??;
    }
    app.set_pool(&template, size)?;
    get_pool(AxState(app), Path(template)).await
}

/// An SSE stream of the broadcast items `pick` selects (event name and data); a lagging
/// subscriber gets a `lagged` event with the number it missed. It ends when the node drains,
/// so that shutdown does not wait for it.
fn broadcast_sse<T: Clone + Send + 'static>(
    app: AppState,
    rx: tokio::sync::broadcast::Receiver<T>,
    pick: impl Fn(&T) -> Option<(&'static str, String)> + Send + 'static,
) -> impl futures_util::Stream<Item = Result<SseEvent, Infallible>> {
    futures_util::stream::unfold((rx, pick, app), |(mut rx, pick, app)| async move {
        loop {
            if app.draining.load(Ordering::Relaxed) {
                return None;
            }
            let Ok(next) = tokio::time::timeout(Duration::from_millis(200), rx.recv()).await else {
                continue;
            };
            let (event, data) = match next {
                Ok(item) => match pick(&item) {
                    Some(picked) => picked,
                    None => continue,
                },
                Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                    ("lagged", json!({"lagged": n}).to_string())
                }
                Err(_) => return None,
            };
            return Some((
                Ok(SseEvent::default().event(event).data(data)),
                (rx, pick, app),
            ));
        }
    })
}

async fn events(
    AxState(app): AxState<AppState>,
    Extension(t): Extension<Tenant>,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    let rx = app.events.subscribe();
    let stream = broadcast_sse(app, rx, move |ev: &super::app::LifecycleEvent| {
        (t.admin || ev.tenant.as_deref() == Some(&t.id))
            .then(|| ("lifecycle", serde_json::to_string(ev).unwrap_or_default()))
    });
    Sse::new(stream).keep_alive(KeepAlive::default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30s").ok(), Some(Duration::from_secs(30)));
        assert_eq!(parse_duration("250").ok(), Some(Duration::from_millis(250)));
        assert_eq!(
            parse_duration("250ms").ok(),
            Some(Duration::from_millis(250))
        );
        assert_eq!(parse_duration("2m").ok(), Some(Duration::from_secs(120)));
        assert!(parse_duration("2h").is_err());
        assert!(parse_duration("s").is_err());
        assert!(parse_duration("").is_err());
    }

    #[test]
    fn rfc3339_dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(951_782_400_123), "2000-02-29T00:00:00.123Z");
        assert_eq!(rfc3339(1_796_042_274_227), "2026-11-30T12:37:54.227Z");
    }
}

// ---- trajectories ----

async fn list_trajectories(
    AxState(app): AxState<AppState>,
    Extension(t): Extension<Tenant>,
) -> Json<Value> {
    Json(json!({"items": app.trajectories.list(&t)}))
}

async fn get_trajectory(
    AxState(app): AxState<AppState>,
    Extension(t): Extension<Tenant>,
    Path(tid): Path<String>,
) -> ApiResult<Json<Value>> {
    let app2 = Arc::clone(&app);
    let v = tokio::task::spawn_blocking(move || app2.trajectories.summary(&t, &tid))
        .await
        .map_err(|e| ApiError::internal(e.to_string()))??;
    Ok(Json(v))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RecordsQuery {
    #[serde(default)]
    from_step: Option<u64>,
    #[serde(default)]
    limit: Option<usize>,
}

async fn trajectory_records(
    AxState(app): AxState<AppState>,
    Extension(t): Extension<Tenant>,
    Path(tid): Path<String>,
    Query(q): Query<RecordsQuery>,
) -> ApiResult<Json<Value>> {
    let limit = q.limit.unwrap_or(100).clamp(1, 1000);
    let from = q.from_step.unwrap_or(0);
    let app2 = Arc::clone(&app);
    let items =
        tokio::task::spawn_blocking(move || app2.trajectories.records(&t, &tid, from, limit + 1))
            .await
            .map_err(|e| ApiError::internal(e.to_string()))??;
    // Records are grouped by step; a page ends on a step boundary when it can.
    let mut items = items;
    let next = if items.len() > limit {
        let next_step = items[limit]["step"].as_u64();
        items.truncate(limit);
        next_step
    } else {
        None
    };
    Ok(Json(json!({"items": items, "next_from_step": next})))
}

async fn trajectory_stream(
    AxState(app): AxState<AppState>,
    Extension(t): Extension<Tenant>,
    Path(tid): Path<String>,
) -> ApiResult<Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>>> {
    super::trajectory::check_id(&tid)?;
    let key = format!("{}/{}", t.id, tid);
    let rx = app.trajectories.log().subscribe();
    let stream = broadcast_sse(app, rx, move |e: &Arc<crate::trajlog::Entry>| {
        (e.trajectory == key).then(|| ("record", super::trajectory::entry_view(e).to_string()))
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AnnotationBody {
    #[serde(default)]
    step: Option<u64>,
    #[serde(default)]
    reward: Option<f64>,
    #[serde(default)]
    labels: Vec<String>,
    #[serde(default)]
    data: Option<Value>,
}

async fn annotate(
    AxState(app): AxState<AppState>,
    Extension(t): Extension<Tenant>,
    Path(tid): Path<String>,
    body: Bytes,
) -> ApiResult<Response> {
    let b: AnnotationBody = json_body(&body)?;
    if b.labels.len() > 64 || b.labels.iter().any(|l| l.is_empty() || l.len() > 128) {
        return Err(ApiError::invalid("at most 64 labels of 1..=128 bytes"));
    }
    if b.reward.is_some_and(|r| !r.is_finite()) {
        return Err(ApiError::invalid("reward must be a finite number"));
    }
    let data = json!({"reward": b.reward, "labels": b.labels, "data": b.data.unwrap_or(Value::Null), "at_ms": super::app::now_ms()});
    let lsn = app
        .trajectories
        .annotate(&t, &tid, b.step.unwrap_or(0), &data)
        .await?;
    Ok((StatusCode::CREATED, Json(json!({"lsn": lsn.0}))).into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ExportQuery {
    #[serde(default)]
    format: Option<String>,
    #[serde(default)]
    label: Option<String>,
    #[serde(default)]
    min_reward: Option<f64>,
}

async fn export_trajectory(
    AxState(app): AxState<AppState>,
    Extension(t): Extension<Tenant>,
    Path(tid): Path<String>,
    Query(q): Query<ExportQuery>,
) -> ApiResult<Response> {
    let app2 = Arc::clone(&app);
    let rows = tokio::task::spawn_blocking(move || app2.trajectories.export_rows(&t, &tid))
        .await
        .map_err(|e| ApiError::internal(e.to_string()))??;
    let rows: Vec<Value> = rows
        .into_iter()
        .filter(|r| {
            let notes: Vec<&Value> = r["annotations"]
                .as_array()
                .into_iter()
                .flatten()
                .chain(r["trajectory_annotations"].as_array().into_iter().flatten())
                .collect();
            let label_ok = q.label.as_ref().is_none_or(|l| {
                notes.iter().any(|n| {
                    n["labels"]
                        .as_array()
                        .is_some_and(|ls| ls.iter().any(|x| x == l.as_str()))
                })
            });
            let reward_ok = q.min_reward.is_none_or(|m| {
                notes
                    .iter()
                    .any(|n| n["reward"].as_f64().is_some_and(|r| r >= m))
            });
            label_ok && reward_ok
        })
        .collect();
    match q.format.as_deref().unwrap_or("jsonl") {
        "jsonl" => {
            let mut out = Vec::new();
            for r in &rows {
                out.extend_from_slice(r.to_string().as_bytes());
                out.push(b'\n');
            }
            let mut resp = (StatusCode::OK, out).into_response();
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/x-ndjson"),
            );
            Ok(resp)
        }
        "parquet" => {
            let rows: Vec<crate::trajlog::export::ExportRow> =
                rows.iter().map(export_row).collect();
            let bytes = tokio::task::spawn_blocking(move || {
                let mut out = Vec::new();
                crate::trajlog::export::to_parquet(&rows, &mut out).map(|()| out)
            })
            .await
            .map_err(|e| ApiError::internal(e.to_string()))?
            .map_err(|e| ApiError::internal(format!("parquet: {e}")))?;
            let mut resp = (StatusCode::OK, bytes).into_response();
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/vnd.apache.parquet"),
            );
            Ok(resp)
        }
        other => Err(ApiError::invalid(format!(
            "unknown export format {:?} (jsonl, parquet)",
            other.chars().take(16).collect::<String>()
        ))),
    }
}

/// One export row in the columns of the Parquet schema: the step's annotations decide the
/// reward (the last one given, the step's over the trajectory's) and the labels (all).
fn export_row(r: &Value) -> crate::trajlog::export::ExportRow {
    let notes: Vec<&Value> = r["trajectory_annotations"]
        .as_array()
        .into_iter()
        .flatten()
        .chain(r["annotations"].as_array().into_iter().flatten())
        .collect();
    let reward = notes
        .iter()
        .filter_map(|n| n["reward"].as_f64())
        .next_back();
    let mut labels: Vec<String> = notes
        .iter()
        .flat_map(|n| n["labels"].as_array().into_iter().flatten())
        .filter_map(|l| l.as_str().map(str::to_owned))
        .collect();
    labels.dedup();
    crate::trajlog::export::ExportRow {
        trajectory: r["trajectory"].as_str().unwrap_or_default().to_owned(),
        step: r["step"].as_u64().unwrap_or(0),
        action: r["action"].to_string(),
        observation: r["observation"].to_string(),
        exit_status: r["exit_status"].as_str().map(str::to_owned),
        exit_code: r["exit_code"].as_i64(),
        wall_us: r["wall_us"].as_i64(),
        started_at_ms: r["started_at_ms"].as_i64(),
        finished_at_ms: r["finished_at_ms"].as_i64(),
        reward,
        labels,
        annotations: json!({"step": r["annotations"], "trajectory": r["trajectory_annotations"]})
            .to_string(),
    }
}

/// Marks a trajectory finished: it will not be resumed, so its records may be compacted out
/// of the log (after `--compact-finished-after`; export it first).
async fn finish_trajectory(
    AxState(app): AxState<AppState>,
    Extension(t): Extension<Tenant>,
    Path(tid): Path<String>,
) -> ApiResult<Json<Value>> {
    let key = app.trajectories.existing_key(&t, &tid)?;
    app.store.finish_trajectory(&key, super::app::now_ms())?;
    Ok(Json(json!({"id": tid, "finished": true})))
}

/// Runs retention and compaction of finished trajectories now (admin).
async fn compact_log(
    AxState(app): AxState<AppState>,
    Extension(caller): Extension<Tenant>,
) -> ApiResult<Json<Value>> {
    require_admin(&caller)?;
    let app2 = Arc::clone(&app);
    let report = tokio::task::spawn_blocking(move || {
        app2.trajectories.enforce_retention();
        app2.compact_finished()
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))??;
    Ok(Json(report))
}

// ---- code runner (see `run/mod.rs`) ----

async fn run_native(
    AxState(app): AxState<AppState>,
    Extension(t): Extension<Tenant>,
    body: Bytes,
) -> ApiResult<Json<Value>> {
    Ok(Json(super::run::run(app, &t, &body).await?))
}

async fn run_batch(
    AxState(app): AxState<AppState>,
    Extension(t): Extension<Tenant>,
    body: Bytes,
) -> ApiResult<Json<Value>> {
    Ok(Json(super::run::run_batch(app, &t, &body).await?))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LanguagesQuery {
    #[serde(default)]
    template: Option<String>,
}

async fn languages(
    AxState(app): AxState<AppState>,
    Query(q): Query<LanguagesQuery>,
) -> ApiResult<Json<Value>> {
    Ok(Json(super::run::list_languages(app, q.template).await?))
}

async fn run_code(
    AxState(app): AxState<AppState>,
    Extension(t): Extension<Tenant>,
    body: Bytes,
) -> Response {
    let (status, v) = super::run::run_code(app, &t, &body).await;
    (
        StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        Json(v),
    )
        .into_response()
}

async fn ping() -> Json<Value> {
    Json(json!("pong"))
}
