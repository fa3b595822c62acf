//! Templates, pools and the lifecycle event stream.

use super::*;

pub(super) async fn list_templates(AxState(app): AxState<AppState>) -> ApiResult<Json<Value>> {
    let rt = Arc::clone(&app.node.rt);
    let list = blocking(move || rt.templates().list()).await?;
    Ok(Json(json!({"items": list})))
}

pub(super) async fn get_template(
    AxState(app): AxState<AppState>,
    Path(name): Path<String>,
) -> ApiResult<Json<Value>> {
    let rt = Arc::clone(&app.node.rt);
    let t = blocking(move || rt.templates().get(&name)).await?;
    Ok(Json(serde_json::to_value(t).unwrap_or_default()))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ImportQuery {
    name: String,
    #[serde(default)]
    format: Option<String>,
}

pub(super) async fn import_template(
    Caller(app, caller): Caller,
    Query(q): Query<ImportQuery>,
    body: Bytes,
) -> ApiResult<Response> {
    require_admin(&caller)?;
    let rt = Arc::clone(&app.node.rt);
    let limits = crate::template::ImportLimits::default();
    let t = blocking(move || {
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
    .await?;
    forget_template(&app, &t.name);
    Ok((
        StatusCode::CREATED,
        Json(serde_json::to_value(t).unwrap_or_default()),
    )
        .into_response())
}

pub(super) async fn delete_template(
    Caller(app, caller): Caller,
    Path(name): Path<String>,
) -> ApiResult<StatusCode> {
    require_admin(&caller)?;
    let gone = name.clone();
    let owner = app.node.clone();
    blocking(move || {
        let in_use = || owner.templates_in_use();
        owner.rt.templates().remove(&name, &in_use)
    })
    .await?;
    forget_template(&app, &gone);
    Ok(StatusCode::NO_CONTENT)
}

/// Drops what was derived from a template that was imported again or deleted: its probed
/// languages and its VM snapshots (the next VM create builds them from the new layers).
pub(super) fn forget_template(app: &AppState, name: &str) {
    crate::server::run::forget_languages(&app.runner, name);
    if let Some(vms) = app.node.rt.vms_started() {
        vms.forget_template(name);
    }
}

pub(super) async fn list_pools(AxState(app): AxState<AppState>) -> Json<Value> {
    Json(json!({"items": app.node.pool_stats()}))
}

pub(super) async fn get_pool(
    AxState(app): AxState<AppState>,
    Path(template): Path<String>,
) -> ApiResult<Json<Value>> {
    app.node
        .pool_stats()
        .into_iter()
        .find(|p| p["template"] == template.as_str())
        .map(Json)
        .ok_or_else(|| ApiError::new(ErrorCode::NotFound, format!("no pool for {template}")))
}

pub(super) async fn set_pool(
    Caller(app, caller): Caller,
    Path(template): Path<String>,
    JsonBody(size): JsonBody<PoolSize>,
) -> ApiResult<Json<Value>> {
    require_admin(&caller)?;
    if size.min > size.max || size.max > 10_000 {
        return Err(ApiError::invalid("need min ≤ max ≤ 10000"));
    }
    let (base, _) = crate::lifecycle::parse_pool_name(&template)
        .ok_or_else(|| ApiError::invalid("a pool is named <template> or <template>@microvm|vm"))?;
    if base != "host" {
        let rt = Arc::clone(&app.node.rt);
        let name = base.to_owned();
        blocking(move || rt.templates().get(&name)).await?;
    }
    app.node.set_pool(&template, size)?;
    get_pool(AxState(app), Path(template)).await
}

/// An SSE stream of the broadcast items `pick` selects (event name and data); a lagging
/// subscriber gets a `lagged` event with the number it missed. It ends when the node drains,
/// so that shutdown does not wait for it.
pub(super) fn broadcast_sse<T: Clone + Send + 'static>(
    app: AppState,
    rx: tokio::sync::broadcast::Receiver<T>,
    pick: impl Fn(&T) -> Option<(&'static str, String)> + Send + 'static,
) -> impl futures_util::Stream<Item = Result<SseEvent, Infallible>> {
    futures_util::stream::unfold((rx, pick, app), |(mut rx, pick, app)| async move {
        loop {
            if app.node.draining.load(Ordering::Relaxed) {
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

pub(super) async fn events(
    Caller(app, t): Caller,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    let rx = app.node.events.subscribe();
    let stream = broadcast_sse(app, rx, move |ev: &crate::lifecycle::LifecycleEvent| {
        (t.admin || ev.tenant.as_deref() == Some(&t.id))
            .then(|| ("lifecycle", serde_json::to_string(ev).unwrap_or_default()))
    });
    Sse::new(stream).keep_alive(KeepAlive::default())
}
