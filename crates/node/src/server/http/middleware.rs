//! Request ids, authentication and idempotency: the middleware every request passes.

use super::*;
use tracing::Instrument as _;

/// Request bodies up to this size are read in full before the handler runs.
pub(super) const SMALL_BODY: u64 = 64 << 10;

/// Reads a small request body (a `Content-Length` of at most [`SMALL_BODY`]) before the
/// handler runs, so that a handler that does not look at its body (`finish`, `compact`, a
/// `DELETE` with `{}`) leaves the connection reusable. Otherwise the server closes the
/// connection when it answers before the body's bytes have arrived, and a client that put the
/// connection back in its pool meanwhile sees its next request fail ("peer disconnected").
/// Larger and chunked bodies (uploads) stream to their handler as before.
pub(super) async fn read_small_body(req: Request, next: Next) -> Response {
    let len = req
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let Some(len @ 1..=SMALL_BODY) = len else {
        return next.run(req).await;
    };
    let (parts, body) = req.into_parts();
    match axum::body::to_bytes(body, len as usize).await {
        Ok(bytes) => {
            next.run(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
        Err(e) => ApiError::new(
            ErrorCode::InvalidRequest,
            format!("the request body could not be read: {e}"),
        )
        .into_response(),
    }
}

pub(super) async fn request_id(
    AxState(app): AxState<AppState>,
    req: Request,
    next: Next,
) -> Response {
    let _in_flight = app.node.track();
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
    let span = tracing::info_span!("request", request_id = %id);
    let mut resp = REQUEST_ID
        .scope(id.clone(), async move {
            let resp = next.run(req).await;
            if resp.status().is_server_error() {
                tracing::warn!(
                    method = %method,
                    path = %path,
                    status = %resp.status().as_str(),
                    "request failed",
                );
            }
            resp
        })
        .instrument(span)
        .await;
    if let Ok(v) = HeaderValue::from_str(&id) {
        resp.headers_mut().insert("x-request-id", v);
    }
    resp
}

/// Paths of the code runner: the only ones a key in the path (`/t/<key>/…`) or the anonymous
/// tenant may reach.
pub(super) fn is_run_path(path: &str) -> bool {
    matches!(
        path,
        "/run_code" | "/v1/ping" | "/v1/run" | "/v1/run/batch" | "/v1/run:batch" | "/v1/languages"
    )
}

pub(super) async fn authenticate(
    AxState(app): AxState<AppState>,
    mut req: Request,
    next: Next,
) -> Response {
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
    match app.node.tenant_for_key(&auth::hash_key(&key)) {
        Ok(Some(t)) => {
            req.extensions_mut().insert(t);
            next.run(req).await
        }
        Ok(None) => ApiError::new(ErrorCode::Unauthorized, "unknown API key").into_response(),
        Err(e) => ApiError::from(e).into_response(),
    }
}

/// The idempotency key of the request being served.
#[derive(Debug, Clone)]
pub struct IdemKey(pub String);

pub(super) async fn idempotency(
    AxState(app): AxState<AppState>,
    req: Request,
    next: Next,
) -> Response {
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
    let lock = crate::server::keyed::keyed(&app.idem, slot.clone());
    let _held = lock.lock().await;
    let resp = async {
        match app.node.store.idempotent(&tenant.id, &key) {
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
        if let Err(e) = app
            .node
            .store
            .put_idempotent(&tenant.id, &key, &out, now_ms())
        {
            return ApiError::from(e).into_response();
        }
        Response::from_parts(rparts, Body::from(rbytes))
    }
    .await;
    drop(_held);
    let mut locks = app.idem.lock().unwrap_or_else(|p| p.into_inner());
    if locks.get(&slot).is_some_and(|l| Arc::strong_count(l) == 2) {
        locks.remove(&slot);
    }
    resp
}
