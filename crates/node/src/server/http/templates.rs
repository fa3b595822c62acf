//! Templates, pools and the lifecycle event stream.

use super::*;

pub(super) async fn list_templates(AxState(app): AxState<AppState>) -> ApiResult<Json<Value>> {
    let (rt, member) = (Arc::clone(&app.node.rt), app.member.clone());
    let list = blocking(move || {
        let mut list = rt.templates().list()?;
        // In a cluster: every template of the cluster, held here or not.
        if let Some(m) = member {
            for t in m.cluster_templates().unwrap_or_default() {
                if !list.iter().any(|l| l.name == t.name) {
                    list.push(t);
                }
            }
        }
        Ok::<_, crate::template::TemplateError>(list)
    })
    .await?;
    Ok(Json(json!({"items": list})))
}

pub(super) async fn get_template(
    AxState(app): AxState<AppState>,
    Path(name): Path<String>,
) -> ApiResult<Json<Value>> {
    let (rt, member) = (Arc::clone(&app.node.rt), app.member.clone());
    let t = blocking(move || match (rt.templates().get(&name), member) {
        (Err(crate::template::TemplateError::NotFound { .. }), Some(m)) => m
            .cluster_template(&name)
            .ok()
            .flatten()
            .ok_or(crate::template::TemplateError::NotFound { name }),
        (r, _) => r,
    })
    .await?;
    Ok(Json(serde_json::to_value(t).unwrap_or_default()))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ImportQuery {
    #[serde(default)]
    name: String,
    #[serde(default)]
    format: Option<String>,
}

/// `POST /v1/templates` with a JSON body: a snapshot committed as a template.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct CommitBody {
    name: String,
    snapshot: String,
    #[serde(default)]
    env: Option<BTreeMap<String, String>>,
    #[serde(default)]
    workdir: Option<String>,
    #[serde(default)]
    user: Option<String>,
}

pub(super) async fn import_template(
    Caller(app, caller): Caller,
    Query(q): Query<ImportQuery>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> ApiResult<Response> {
    require_admin(&caller)?;
    let json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    let t = if json {
        let b: CommitBody = json_body(&body)?;
        let env = b.env.map(|e| e.into_iter().collect());
        app.node
            .commit_snapshot(&caller, &b.name, &b.snapshot, (env, b.workdir, b.user))
            .await?
    } else {
        if q.name.is_empty() {
            return Err(ApiError::invalid("an import names its template: ?name="));
        }
        import_body(&app, q, body).await?
    };
    if let Some(m) = app.member.clone() {
        // The cluster learns of it now (a failure here is retried with the next report).
        let (rt, t2) = (Arc::clone(&app.node.rt), t.clone());
        let published = tokio::task::spawn_blocking(move || m.publish(rt.templates(), &t2)).await;
        if let Ok(Err(e)) = published {
            tracing::warn!(template = %t.name, error = %e, "cluster: publishing a template failed");
        }
    }
    forget_template(&app, &t.name);
    Ok((
        StatusCode::CREATED,
        Json(serde_json::to_value(t).unwrap_or_default()),
    )
        .into_response())
}

/// A template imported from the request's body (a root filesystem tarball or an image).
async fn import_body(
    app: &AppState,
    q: ImportQuery,
    body: Bytes,
) -> ApiResult<crate::template::Template> {
    let rt = Arc::clone(&app.node.rt);
    let limits = crate::template::ImportLimits::default();
    blocking(move || {
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
        // Here, or (in a cluster) a template the node will fetch.
        let (node, name) = (Arc::clone(&app.node), base.to_owned());
        blocking(move || node.template_known(&name).map_err(ApiError::from)).await?;
    }
    app.node.set_pool(&template, size)?;
    if let Some(m) = app.member.clone() {
        // Every node of the cluster keeps it (within a report interval).
        let (t, (min, max)) = (template.clone(), (size.min, size.max));
        blocking(move || {
            m.publish_pool(&t, min, max).map_err(|e| {
                ApiError::new(ErrorCode::Unavailable, format!("the cluster's store: {e}"))
            })
        })
        .await?;
    }
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

/// `GET /v1/cluster/layers/{sha256}`: a layer's blob (the uncompressed tar its digest is of),
/// for another node of the cluster that fetches it; authenticated by the cluster secret, not
/// an API key. Streamed in 1 MiB chunks.
pub(super) async fn cluster_layer(
    AxState(app): AxState<AppState>,
    Path(digest): Path<String>,
    headers: axum::http::HeaderMap,
) -> ApiResult<Response> {
    let Some(member) = app.member.as_ref() else {
        return Err(ApiError::new(
            ErrorCode::NotFound,
            "this node is not in a cluster",
        ));
    };
    let given = headers
        .get(crate::member::layers::SECRET_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if !member.secret_matches(given) {
        return Err(ApiError::new(
            ErrorCode::Unauthorized,
            "a layer call needs the cluster secret",
        ));
    }
    let d = crate::template::Digest::from_hex(&digest)
        .ok_or_else(|| ApiError::invalid("a layer digest is 64 hex digits"))?;
    let Some(path) = app.node.rt.templates().layers().blob(&d) else {
        return Err(ApiError::new(
            ErrorCode::NotFound,
            format!("no blob of layer {digest} here"),
        ));
    };
    let file = std::fs::File::open(&path)
        .map_err(|e| ApiError::new(ErrorCode::NotFound, format!("layer {digest}: {e}")))?;
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(4);
    tokio::task::spawn_blocking(move || {
        use std::io::Read as _;
        let mut file = file;
        loop {
            let mut buf = vec![0u8; 1 << 20];
            match file.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    buf.truncate(n);
                    if tx.blocking_send(Ok(Bytes::from(buf))).is_err() {
                        break;
                    }
                }
                Err(e) => {
                    let _ = tx.blocking_send(Err(e));
                    break;
                }
            }
        }
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    let mut r = Body::from_stream(stream).into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/x-tar"),
    );
    if let Ok(v) = HeaderValue::from_str(&len.to_string()) {
        r.headers_mut().insert(header::CONTENT_LENGTH, v);
    }
    Ok(r)
}
