//! The HTTP API (`/v1`, see `docs/api.md`): the router over one [`AppState`], and thin handlers
//! split by what they serve. Business logic lives in [`crate::lifecycle`], the runner and the
//! trajectory log; handlers parse, call and answer.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Path, Query, Request, State as AxState};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::{self as axum_mw, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Extension, Json, Router};
use base64::Engine as _;
use dsec_api::agent::{Event, Request as AgentReq};
use dsec_api::exec::{Command, ExecRequest, ExecResult, Stream};
use dsec_api::ErrorCode;
use serde::Deserialize;
use serde_json::{json, Value};
use sha2::{Digest as _, Sha256};

use crate::sandbox::{Limits, State, Substrate};

use super::auth;
use super::error::{ApiError, ApiResult};
use super::state::AppState;
use crate::clock::now_ms;
use crate::lifecycle::{CreateRequest, Entry, PoolSize};
use crate::log::REQUEST_ID;
use crate::store::{IdemOutcome, SandboxRecord, Tenant};

mod e2b;
mod exec;
mod files;
mod middleware;
mod run;
mod sandboxes;
mod snapshots;
mod templates;
mod tenants;
mod trajectories;

use e2b::*;
use exec::*;
use files::*;
use middleware::*;
use run::*;
use sandboxes::*;
use snapshots::*;
use templates::*;
use tenants::*;
use trajectories::*;

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
        .route("/v1/sandboxes/{id}/network", put(set_network))
        .route("/v1/sandboxes/{id}/snapshots", post(take_snapshot))
        .route("/v1/sandboxes/{id}/fork", post(fork))
        .route("/v1/sandboxes/{id}/restore", post(restore))
        .route("/v1/snapshots", get(list_snapshots))
        .route(
            "/v1/snapshots/{id}",
            get(get_snapshot).delete(delete_snapshot),
        )
        .route("/v1/snapshots/{id}/tree", get(snapshot_tree))
        .route("/v1/sandboxes/{id}/exec", post(exec))
        .route("/v1/sandboxes/{id}/processes", post(spawn))
        .route("/v1/sandboxes/{id}/processes/{handle}", get(proc_status))
        .route("/v1/sandboxes/{id}/processes", get(proc_list))
        .route(
            "/v1/sandboxes/{id}/processes/{handle}/output",
            get(proc_output),
        )
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
        // The E2B control plane (docs/e2b.md).
        .route("/sandboxes", post(e2b_create).get(e2b_list))
        .route("/v2/sandboxes", post(e2b_create).get(e2b_list))
        .route("/sandboxes/{id}", get(e2b_get).delete(e2b_kill))
        .route("/sandboxes/{id}/timeout", post(e2b_timeout))
        .route("/sandboxes/{id}/connect", post(e2b_connect))
        .route("/v2/sandboxes/{id}/connect", post(e2b_connect))
        .route("/sandboxes/{id}/resume", post(e2b_connect))
        .route("/sandboxes/{id}/pause", post(e2b_pause))
        .layer(axum_mw::from_fn_with_state(app.clone(), idempotency))
        .layer(axum_mw::from_fn_with_state(app.clone(), authenticate));
    Router::new()
        .merge(v1)
        .route("/livez", get(|| async { Json(json!({"live": true})) }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(super::metrics_text))
        // Authenticated by the cluster secret, not an API key.
        .route("/v1/cluster/layers/{digest}", get(cluster_layer))
        .route(
            "/openapi.json",
            get(|| async { Json(super::openapi::document()) }),
        )
        .method_not_allowed_fallback(method_not_allowed)
        .fallback(|| async { ApiError::new(ErrorCode::NotFound, "no such endpoint") })
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .layer(axum_mw::from_fn_with_state(
            app.clone(),
            e2b::sandbox_traffic,
        ))
        .layer(axum_mw::from_fn(read_small_body))
        .layer(axum_mw::from_fn_with_state(app.clone(), request_id))
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

/// Who is asking: the state every handler needs and the tenant the request authenticated as
/// (the authentication middleware put it there).
struct Caller(AppState, Tenant);

impl axum::extract::FromRequestParts<AppState> for Caller {
    type Rejection = Response;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &AppState,
    ) -> Result<Self, Response> {
        let tenant = parts.extensions.get::<Tenant>().cloned().ok_or_else(|| {
            ApiError::new(ErrorCode::Unauthorized, "no authenticated tenant").into_response()
        })?;
        Ok(Caller(state.clone(), tenant))
    }
}

/// Runs blocking work (disk, SQLite, the trajectory log) off the async workers.
async fn blocking<T, E>(f: impl FnOnce() -> Result<T, E> + Send + 'static) -> ApiResult<T>
where
    T: Send + 'static,
    E: Send + 'static,
    ApiError: From<E>,
{
    let r = tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?;
    r.map_err(ApiError::from)
}

/// A JSON request body, parsed as [`json_body`] does. A body the transport refuses (too large)
/// keeps axum's answer.
struct JsonBody<T>(T);

impl<T, S> axum::extract::FromRequest<S> for JsonBody<T>
where
    T: for<'de> Deserialize<'de>,
    S: Send + Sync,
{
    type Rejection = Response;

    async fn from_request(req: Request, state: &S) -> Result<Self, Response> {
        let bytes = Bytes::from_request(req, state)
            .await
            .map_err(IntoResponse::into_response)?;
        json_body(&bytes)
            .map(JsonBody)
            .map_err(IntoResponse::into_response)
    }
}

fn json_body<T: for<'de> Deserialize<'de>>(bytes: &Bytes) -> ApiResult<T> {
    let src: &[u8] = if bytes.is_empty() { b"{}" } else { bytes };
    serde_json::from_slice(src).map_err(|e| ApiError::invalid(format!("bad JSON body: {e}")))
}

async fn readyz(AxState(app): AxState<AppState>) -> Response {
    // A trajectory log that failed to write (a full disk) takes no step until the node restarts:
    // the node is then not ready, and says why.
    let log_failed = app.trajectories.log().stats().poisoned;
    let ready = app.node.ready.load(Ordering::Relaxed) && log_failed.is_none();
    let draining = app.node.draining.load(Ordering::Relaxed);
    let recovery = app
        .node
        .recovery
        .lock()
        .map(|r| serde_json::to_value(&*r).unwrap_or_default())
        .unwrap_or_default();
    let vms = app.node.rt.vms_started();
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
        "idle_shells": app.node.rt.idle_shells(),
        "favordynmods": app.node.rt.favordynmods(),
        "recovery": recovery,
        "trajectory_log_failed": log_failed,
    });
    let status = if ready && !draining {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(body)).into_response()
}
