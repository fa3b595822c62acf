//! Trajectories: list, read, stream, annotate, export, finish, compact.

use super::*;
use dsec_api::body::AnnotationBody;

pub(super) async fn list_trajectories(Caller(app, t): Caller) -> Json<Value> {
    Json(json!({"items": app.trajectories.list(&t)}))
}

pub(super) async fn get_trajectory(
    Caller(app, t): Caller,
    Path(tid): Path<String>,
) -> ApiResult<Json<Value>> {
    let app2 = app.clone();
    let v = blocking(move || app2.trajectories.summary(&t, &tid)).await?;
    Ok(Json(v))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RecordsQuery {
    #[serde(default)]
    from_step: Option<u64>,
    #[serde(default)]
    limit: Option<usize>,
}

pub(super) async fn trajectory_records(
    Caller(app, t): Caller,
    Path(tid): Path<String>,
    Query(q): Query<RecordsQuery>,
) -> ApiResult<Json<Value>> {
    let limit = q.limit.unwrap_or(100).clamp(1, 1000);
    let from = q.from_step.unwrap_or(0);
    let app2 = app.clone();
    let items = blocking(move || app2.trajectories.records(&t, &tid, from, limit + 1)).await?;
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

pub(super) async fn trajectory_stream(
    Caller(app, t): Caller,
    Path(tid): Path<String>,
) -> ApiResult<Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>>> {
    crate::server::trajectory::check_id(&tid)?;
    let key = format!("{}/{}", t.id, tid);
    let rx = app.trajectories.log().subscribe();
    let stream = broadcast_sse(app, rx, move |e: &Arc<crate::trajlog::Entry>| {
        (e.trajectory == key).then(|| {
            (
                "record",
                crate::server::trajectory::entry_view(e).to_string(),
            )
        })
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()))
}

pub(super) async fn annotate(
    Caller(app, t): Caller,
    Path(tid): Path<String>,
    JsonBody(b): JsonBody<AnnotationBody>,
) -> ApiResult<Response> {
    if b.labels.len() > 64 || b.labels.iter().any(|l| l.is_empty() || l.len() > 128) {
        return Err(ApiError::invalid("at most 64 labels of 1..=128 bytes"));
    }
    if b.reward.is_some_and(|r| !r.is_finite()) {
        return Err(ApiError::invalid("reward must be a finite number"));
    }
    let data = json!({"reward": b.reward, "labels": b.labels, "data": b.data.unwrap_or(Value::Null), "at_ms": crate::clock::now_ms()});
    let lsn = app
        .trajectories
        .annotate(&t, &tid, b.step.unwrap_or(0), &data)
        .await?;
    Ok((StatusCode::CREATED, Json(json!({"lsn": lsn.0}))).into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ExportQuery {
    #[serde(default)]
    format: Option<String>,
    #[serde(default)]
    label: Option<String>,
    #[serde(default)]
    min_reward: Option<f64>,
}

pub(super) async fn export_trajectory(
    Caller(app, t): Caller,
    Path(tid): Path<String>,
    Query(q): Query<ExportQuery>,
) -> ApiResult<Response> {
    let app2 = app.clone();
    let rows = blocking(move || app2.trajectories.export_rows(&t, &tid)).await?;
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
pub(super) fn export_row(r: &Value) -> crate::trajlog::export::ExportRow {
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
pub(super) async fn finish_trajectory(
    Caller(app, t): Caller,
    Path(tid): Path<String>,
) -> ApiResult<Json<Value>> {
    let key = app.trajectories.existing_key(&t, &tid)?;
    app.node
        .store
        .finish_trajectory(&key, crate::clock::now_ms())?;
    Ok(Json(json!({"id": tid, "finished": true})))
}

/// Runs retention and compaction of finished trajectories now (admin).
pub(super) async fn compact_log(Caller(app, caller): Caller) -> ApiResult<Json<Value>> {
    require_admin(&caller)?;
    let report = blocking(move || app.maintain_log()).await?;
    Ok(Json(report))
}
