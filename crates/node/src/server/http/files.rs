//! Files in a sandbox: read, write, list, stat, mkdir, remove, tar up and down.

use super::*;
use dsec_api::body::MkdirBody;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileQuery {
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

pub(super) fn octet(bytes: Vec<u8>, ct: &'static str) -> Response {
    let mut r = (StatusCode::OK, bytes).into_response();
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(ct));
    r
}

/// Sends one request whose answer is `Ok` to the agent of the caller's sandbox `id`: 204.
pub(super) async fn agent_ok(
    app: &AppState,
    t: &Tenant,
    id: &str,
    req: AgentReq,
    body: Bytes,
) -> ApiResult<StatusCode> {
    let e = app.node.owned(t, id)?;
    with_sandbox(app, &e, move |_, sb| {
        sb.agent().call_ok(&req, &body).map_err(ApiError::from)
    })
    .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Sends one request answered by a single event (a listing, a stat).
pub(super) async fn agent_answer(
    app: &AppState,
    t: &Tenant,
    id: &str,
    req: AgentReq,
) -> ApiResult<Event> {
    let e = app.node.owned(t, id)?;
    with_sandbox(app, &e, move |_, sb| agent_event(sb, &req, &[], None)).await
}

/// Sends one request answered by data chunks (a file, a tar stream), at most `max` bytes.
pub(super) async fn agent_data(
    app: &AppState,
    t: &Tenant,
    id: &str,
    req: AgentReq,
    max: u64,
    content_type: &'static str,
) -> ApiResult<Response> {
    let e = app.node.owned(t, id)?;
    let data = with_sandbox(app, &e, move |_, sb| {
        sb.agent()
            .call_data(&req, max as usize)
            .map_err(ApiError::from)
    })
    .await?;
    Ok(octet(data, content_type))
}

pub(super) async fn file_read(
    Caller(app, t): Caller,
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

pub(super) async fn file_write(
    Caller(app, t): Caller,
    Path(id): Path<String>,
    Query(q): Query<FileQuery>,
    body: Bytes,
) -> ApiResult<Response> {
    let e = app.node.owned(&t, &id)?;
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
    let app2 = app.clone();
    let e2 = Arc::clone(&e);
    let run = move |_| async move {
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
            run(0).await?;
            Ok(StatusCode::NO_CONTENT.into_response())
        }
    }
}

pub(super) async fn file_remove(
    Caller(app, t): Caller,
    Path(id): Path<String>,
    Query(q): Query<FileQuery>,
) -> ApiResult<StatusCode> {
    let req = AgentReq::Remove {
        path: q.path,
        recursive: q.recursive,
    };
    agent_ok(&app, &t, &id, req, Bytes::new()).await
}

pub(super) async fn file_list(
    Caller(app, t): Caller,
    Path(id): Path<String>,
    Query(q): Query<FileQuery>,
) -> ApiResult<Json<Value>> {
    match agent_answer(&app, &t, &id, AgentReq::FileList { path: q.path }).await? {
        Event::Listing { entries } => Ok(Json(json!({"entries": entries}))),
        other => Err(ApiError::internal(format!("unexpected {other:?}"))),
    }
}

pub(super) async fn file_stat(
    Caller(app, t): Caller,
    Path(id): Path<String>,
    Query(q): Query<FileQuery>,
) -> ApiResult<Json<Value>> {
    match agent_answer(&app, &t, &id, AgentReq::FileStat { path: q.path }).await? {
        Event::Stat(s) => Ok(Json(serde_json::to_value(s).unwrap_or_default())),
        other => Err(ApiError::internal(format!("unexpected {other:?}"))),
    }
}

pub(super) async fn file_mkdir(
    Caller(app, t): Caller,
    Path(id): Path<String>,
    JsonBody(b): JsonBody<MkdirBody>,
) -> ApiResult<StatusCode> {
    let req = AgentReq::Mkdir {
        path: b.path,
        parents: b.parents,
        mode: b.mode,
    };
    agent_ok(&app, &t, &id, req, Bytes::new()).await
}

pub(super) async fn tar_upload(
    Caller(app, t): Caller,
    Path(id): Path<String>,
    Query(q): Query<FileQuery>,
    body: Bytes,
) -> ApiResult<StatusCode> {
    agent_ok(&app, &t, &id, AgentReq::TarUpload { path: q.path }, body).await
}

pub(super) async fn tar_download(
    Caller(app, t): Caller,
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
