//! Tenants and their API keys.

use super::*;
use dsec_api::body::NewTenant;

pub(super) async fn create_tenant(
    Caller(app, caller): Caller,
    JsonBody(req): JsonBody<NewTenant>,
) -> ApiResult<Response> {
    require_admin(&caller)?;
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
    if app.node.store.tenant_by_name(&req.name)?.is_some() {
        return Err(ApiError::new(
            ErrorCode::InvalidTransition,
            format!("tenant {} exists", req.name),
        ));
    }
    let (t, key) = auth::new_tenant(
        &app.node.store,
        &req.name,
        false,
        req.max_sandboxes,
        req.max_memory_bytes,
        req.max_snapshot_bytes,
        req.egress_ceiling,
    )?;
    let mut v = serde_json::to_value(&t).unwrap_or_default();
    v["api_key"] = key.into();
    Ok((StatusCode::CREATED, Json(v)).into_response())
}

pub(super) async fn list_tenants(Caller(app, caller): Caller) -> ApiResult<Json<Value>> {
    require_admin(&caller)?;
    Ok(Json(json!({"items": app.node.store.tenants()?})))
}

pub(super) async fn own_tenant(Caller(app, caller): Caller) -> Json<Value> {
    let (n, mem) = app.node.usage(&caller.id);
    let mut v = serde_json::to_value(&caller).unwrap_or_default();
    v["usage"] = json!({"sandboxes": n, "memory_bytes": mem});
    Json(v)
}
