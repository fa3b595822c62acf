//! Sandboxes: create (one and batch), get, list, delete, lease, reset; the sandbox view.

use super::*;
use crate::capacity::NodeCapacity;
use dsec_api::body::{BatchCreate, BatchDelete, LeaseBody};
use dsec_api::sandbox::{CreateSpec, SandboxView};

/// The public view of a sandbox record.
pub fn view(r: &SandboxRecord) -> SandboxView {
    SandboxView {
        id: r.id.clone(),
        tenant: r.tenant.clone(),
        template: r.spec.template.clone(),
        substrate: r.spec.substrate,
        state: r.state,
        labels: r.labels.clone(),
        limits: Limits::clone(&r.spec.limits),
        writable_root: r.spec.writable_root,
        userns: r.spec.userns,
        env_keys: r.env.keys().cloned().collect(),
        created_at: rfc3339(r.created_at_ms),
        acquired_at: r.acquired_at_ms.map(rfc3339),
        expires_at: r.expires_at_ms.map(rfc3339),
        lease_expires_at: r.lease_expires_at_ms.map(rfc3339),
        version: r.version,
        pooled: r.pooled,
        error: r.error.clone(),
        phase: r.phase.clone(),
        fetched: r.fetched.clone(),
        snapshot: r.spec.snapshot.clone(),
        supervisor_pid: None,
        init_pid: None,
        network: r.network.enabled().then(|| r.network.clone()),
        network_address: r.net_addr,
    }
}

pub use crate::clock::rfc3339;

/// The create a spec asks for by `tenant`, its limits admitted by this node (the one place they
/// are checked).
pub(super) fn create_request(
    b: CreateSpec,
    tenant: &Tenant,
    capacity: &NodeCapacity,
) -> ApiResult<CreateRequest> {
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
    // Limits out of range or beyond this machine are refused before anything is recorded.
    let limits = capacity
        .admit(limits)
        .map_err(|e| ApiError::invalid(e.to_string()))?;
    if b.userns.is_some() && substrate.is_vm() {
        return Err(ApiError::invalid(
            "userns applies to the container substrate (a VM guest has its own kernel)",
        ));
    }
    // Without a user namespace the sandbox's root is host root (every capability dropped): an
    // operator's choice, not a tenant's.
    if b.userns == Some(false) && !tenant.admin {
        return Err(ApiError::new(
            ErrorCode::Forbidden,
            "\"userns\": false (the sandbox's root is host root) is for the admin tenant only",
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
    if let Some(s) = &b.snapshot {
        if !crate::snapshot::valid_id(s) {
            return Err(ApiError::new(
                ErrorCode::SnapshotNotFound,
                format!("no snapshot {}", s.chars().take(80).collect::<String>()),
            ));
        }
        if b.template.is_some() || substrate.is_vm() {
            return Err(ApiError::invalid(
                "a create from a snapshot takes the snapshot's template and substrate",
            ));
        }
    }
    let network = crate::lifecycle::network::admit_network(tenant, b.network.unwrap_or_default())?;
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
        userns: b.userns.unwrap_or(!substrate.is_vm()),
        snapshot: b.snapshot,
        layers: Vec::new(),
        network,
    })
}

pub(super) async fn create_sandbox(
    Caller(app, t): Caller,
    idem: Option<Extension<IdemKey>>,
    body: Bytes,
) -> ApiResult<Response> {
    let mut req = create_request(json_body(&body)?, &t, app.node.rt.capacity())?;
    req.idem = idem.map(|Extension(IdemKey(k))| k);
    let rec = app.node.create(&t, req).await?;
    app.node.failpoint("create:before_answer");
    tracing::info!(sandbox = %rec.id, tenant = %t.id, "sandbox created");
    Ok((StatusCode::CREATED, Json(view(&rec))).into_response())
}

#[derive(Deserialize)]
pub(super) struct GetQuery {
    wait: Option<String>,
    timeout: Option<String>,
    after_version: Option<u64>,
}

/// A duration parameter: `30s`, `500ms`, `2m`, or bare milliseconds.
pub(super) fn parse_duration(s: &str) -> ApiResult<Duration> {
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

pub(super) fn parse_state(s: &str) -> ApiResult<State> {
    serde_json::from_value(Value::String(s.to_owned())).map_err(|_| {
        ApiError::invalid(format!(
            "unknown state {:?}",
            s.chars().take(32).collect::<String>()
        ))
    })
}

pub(super) async fn get_sandbox(
    Caller(app, t): Caller,
    Path(id): Path<String>,
    Query(q): Query<GetQuery>,
) -> ApiResult<Json<SandboxView>> {
    let Some(e) = app.node.entry(&id) else {
        // Destroyed sandboxes stay readable for a while.
        return match app.node.store.sandbox(&id)? {
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
                v.supervisor_pid = Some(sup);
                v.init_pid = Some(init);
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

pub(super) async fn list_sandboxes(
    Caller(app, t): Caller,
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
        let page = app.node.store.tenant_sandboxes(&owner, &cursor, 500)?;
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

pub(super) async fn delete_sandbox(
    Caller(app, t): Caller,
    Path(id): Path<String>,
) -> ApiResult<Json<SandboxView>> {
    let e = app.node.owned_or_admin(&t, &id)?;
    let rec = app.node.destroy(&e).await?;
    tracing::info!(
        sandbox = %rec.id,
        tenant = %rec.tenant.as_deref().unwrap_or("-"),
        "sandbox destroyed",
    );
    Ok(Json(view(&rec)))
}

pub(super) async fn batch_create(
    Caller(app, t): Caller,
    idem: Option<Extension<IdemKey>>,
    JsonBody(b): JsonBody<BatchCreate>,
) -> ApiResult<Json<Value>> {
    let idem = idem.map(|Extension(IdemKey(k))| k);
    if !(1..=1000).contains(&b.count) {
        return Err(ApiError::invalid("count must be in 1..=1000"));
    }
    let spec: CreateSpec = match b.spec {
        Some(v) => {
            serde_json::from_value(v).map_err(|e| ApiError::invalid(format!("spec: {e}")))?
        }
        None => CreateSpec::default(),
    };
    let req = create_request(spec, &t, app.node.rt.capacity())?;
    let tasks = (0..b.count).map(|i| {
        let (app, t, mut req) = (app.clone(), t.clone(), req.clone());
        // Each item has its own key, so that a retried batch finds what it already made.
        req.idem = idem.as_ref().map(|k| format!("{k}#{i}"));
        async move {
            match app.node.create(&t, req).await {
                Ok(rec) => json!({"ok": true, "sandbox": view(&rec)}),
                Err(e) => json!({"ok": false, "error": ApiError::from(e).problem()}),
            }
        }
    });
    batch(tasks).await
}

/// Runs one task per item at once and answers `{"items": [...]}` in the items' order.
async fn batch<F>(tasks: impl IntoIterator<Item = F>) -> ApiResult<Json<Value>>
where
    F: std::future::Future<Output = Value> + Send + 'static,
{
    let mut set = tokio::task::JoinSet::new();
    for (i, task) in tasks.into_iter().enumerate() {
        set.spawn(async move { (i, task.await) });
    }
    let mut out = Vec::new();
    while let Some(r) = set.join_next().await {
        out.push(r.map_err(|e| ApiError::internal(e.to_string()))?);
    }
    out.sort_by_key(|(i, _)| *i);
    Ok(Json(
        json!({"items": out.into_iter().map(|(_, v)| v).collect::<Vec<_>>()}),
    ))
}

pub(super) async fn batch_delete(
    Caller(app, t): Caller,
    JsonBody(b): JsonBody<BatchDelete>,
) -> ApiResult<Json<Value>> {
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
                .node
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
    let tasks = ids.into_iter().map(|id| {
        let (app, t) = (app.clone(), t.clone());
        async move {
            let r = match app.node.owned(&t, &id) {
                Ok(e) => app.node.destroy(&e).await.map(|_| ()),
                Err(e) => Err(e),
            };
            match r {
                Ok(()) => json!({"id": id, "ok": true}),
                Err(e) => json!({"id": id, "ok": false, "error": ApiError::from(e).problem()}),
            }
        }
    });
    batch(tasks).await
}

pub(super) async fn lease(
    Caller(app, t): Caller,
    Path(id): Path<String>,
    JsonBody(b): JsonBody<LeaseBody>,
) -> ApiResult<Json<SandboxView>> {
    if b.lease_ms
        .is_some_and(|v| v == 0 || v > 30 * 24 * 3600 * 1000)
    {
        return Err(ApiError::invalid("lease_ms must be in 1..=30 days"));
    }
    let e = app.node.owned(&t, &id)?;
    Ok(Json(view(&app.node.heartbeat(&e, b.lease_ms)?)))
}

pub(super) async fn reset(
    Caller(app, t): Caller,
    Path(id): Path<String>,
) -> ApiResult<Json<SandboxView>> {
    let e = app.node.owned(&t, &id)?;
    Ok(Json(view(&app.node.reset(&e).await?)))
}

/// `PUT /v1/sandboxes/{id}/network` `{"egress": …}`: the policy of a running sandbox.
pub(super) async fn set_network(
    Caller(app, t): Caller,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<Json<SandboxView>> {
    let e = app.node.owned(&t, &id)?;
    let net: dsec_api::network::NetworkSpec = json_body(&body)?;
    Ok(Json(view(&app.node.set_network(&e, &t, net).await?)))
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
