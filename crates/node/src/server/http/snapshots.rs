//! Snapshots: take, fork, restore, list, tree, delete (`crate::lifecycle::snapshot` does the
//! work).

use super::*;
use crate::lifecycle::snapshot::SnapshotFilter;

/// `POST /v1/sandboxes/{id}/snapshots`, `…/fork`, `…/restore` bodies.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct SnapshotBody {
    #[serde(default)]
    labels: BTreeMap<String, String>,
    #[serde(default)]
    count: Option<usize>,
    #[serde(default)]
    snapshot: Option<String>,
    #[serde(default)]
    trajectory: Option<String>,
    #[serde(default)]
    step: Option<u64>,
}

fn check_labels(labels: &BTreeMap<String, String>) -> ApiResult<()> {
    if labels.len() > 64
        || labels
            .iter()
            .any(|(k, v)| k.is_empty() || k.len() > 63 || v.len() > 256 || k.contains('='))
    {
        return Err(ApiError::invalid(
            "labels: at most 64, keys 1..=63 bytes without '=', values ≤ 256 bytes",
        ));
    }
    Ok(())
}

/// Runs `run` as a logged step when the body names a trajectory, else as it is.
async fn maybe_logged<F, Fut>(
    app: &AppState,
    t: &Tenant,
    e: &Arc<Entry>,
    body: &Bytes,
    b: &SnapshotBody,
    op: &str,
    run: F,
) -> ApiResult<Response>
where
    F: FnOnce(Option<(String, u64)>) -> Fut,
    Fut: std::future::Future<Output = ApiResult<Value>>,
{
    match &b.trajectory {
        Some(traj) => {
            let action = action_of(body, &["trajectory", "step"])?;
            let traj2 = traj.clone();
            let r = logged_step(app, t, e, traj, b.step, op, action, move |step| {
                run(Some((traj2, step)))
            })
            .await?;
            // A step that made something answers as its call does: 201 (replayed too).
            let (mut parts, body) = r.into_parts();
            if parts.status == StatusCode::OK {
                parts.status = StatusCode::CREATED;
            }
            Ok(Response::from_parts(parts, body))
        }
        None => Ok((StatusCode::CREATED, Json(run(None).await?)).into_response()),
    }
}

pub(super) async fn take_snapshot(
    Caller(app, t): Caller,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<Response> {
    let e = app.node.owned(&t, &id)?;
    let b: SnapshotBody = json_body(&body)?;
    if b.count.is_some() || b.snapshot.is_some() {
        return Err(ApiError::invalid(
            "a snapshot takes labels, trajectory and step",
        ));
    }
    check_labels(&b.labels)?;
    let (node, t2, e2, labels) = (
        Arc::clone(&app.node),
        t.clone(),
        Arc::clone(&e),
        b.labels.clone(),
    );
    maybe_logged(
        &app,
        &t,
        &e,
        &body,
        &b,
        "snapshot",
        move |traj| async move { Ok(node.snapshot(&t2, &e2, labels, traj).await?.view()) },
    )
    .await
}

pub(super) async fn fork(
    Caller(app, t): Caller,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<Response> {
    let e = app.node.owned(&t, &id)?;
    let b: SnapshotBody = json_body(&body)?;
    if b.snapshot.is_some() {
        return Err(ApiError::invalid(
            "a fork takes count, labels, trajectory and step",
        ));
    }
    check_labels(&b.labels)?;
    let count = b.count.unwrap_or(1);
    let (node, t2, e2, labels) = (
        Arc::clone(&app.node),
        t.clone(),
        Arc::clone(&e),
        b.labels.clone(),
    );
    maybe_logged(&app, &t, &e, &body, &b, "fork", move |traj| async move {
        let (snap, made) = node.fork(&t2, &e2, count, labels).await?;
        let snap = match traj {
            Some(traj) => {
                let mut s = snap;
                s.trajectory = Some(traj);
                node.store.put_snapshot(&s)?;
                s
            }
            None => snap,
        };
        let mut sandboxes = Vec::new();
        let mut errors = Vec::new();
        for m in made {
            match m {
                Ok(r) => sandboxes.push(serde_json::to_value(view(&r)).unwrap_or_default()),
                Err(err) => errors.push(ApiError::from(err).problem()),
            }
        }
        Ok(json!({"snapshot": snap.view(), "sandboxes": sandboxes, "errors": errors}))
    })
    .await
}

pub(super) async fn restore(
    Caller(app, t): Caller,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<Response> {
    let e = app.node.owned(&t, &id)?;
    let b: SnapshotBody = json_body(&body)?;
    let Some(snapshot) = b.snapshot.clone() else {
        return Err(ApiError::invalid("a restore names its snapshot"));
    };
    let (node, t2, e2) = (Arc::clone(&app.node), t.clone(), Arc::clone(&e));
    let r = maybe_logged(&app, &t, &e, &body, &b, "restore", move |_| async move {
        let rec = node.restore(&t2, &e2, &snapshot).await?;
        Ok(serde_json::to_value(view(&rec)).unwrap_or_default())
    })
    .await?;
    // A restore answers 200, not 201: nothing is made.
    let (mut parts, body) = r.into_parts();
    if parts.status == StatusCode::CREATED {
        parts.status = StatusCode::OK;
    }
    Ok(Response::from_parts(parts, body))
}

#[derive(Debug, Deserialize)]
pub(super) struct SnapshotQuery {
    sandbox: Option<String>,
    root: Option<String>,
    /// `key=value`, several joined by commas.
    label: Option<String>,
    #[serde(default)]
    recursive: bool,
}

pub(super) async fn list_snapshots(
    Caller(app, t): Caller,
    Query(q): Query<SnapshotQuery>,
) -> ApiResult<Json<Value>> {
    let mut f = SnapshotFilter {
        sandbox: q.sandbox,
        root: q.root,
        ..SnapshotFilter::default()
    };
    for kv in q.label.iter().flat_map(|l| l.split(',')) {
        let Some((k, v)) = kv.split_once('=') else {
            return Err(ApiError::invalid("label filters are key=value"));
        };
        f.labels.insert(k.to_owned(), v.to_owned());
    }
    let items: Vec<Value> = app
        .node
        .snapshots_of(&t, &f)?
        .iter()
        .map(crate::snapshot::SnapshotRecord::view)
        .collect();
    Ok(Json(json!({ "items": items })))
}

pub(super) async fn get_snapshot(
    Caller(app, t): Caller,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    Ok(Json(app.node.snapshot_of(&t, &id)?.view()))
}

pub(super) async fn snapshot_tree(
    Caller(app, t): Caller,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    Ok(Json(app.node.snapshot_tree(&t, &id)?))
}

pub(super) async fn delete_snapshot(
    Caller(app, t): Caller,
    Path(id): Path<String>,
    Query(q): Query<SnapshotQuery>,
) -> ApiResult<Json<Value>> {
    let deleted = app.node.delete_snapshot(&t, &id, q.recursive).await?;
    Ok(Json(json!({ "deleted": deleted })))
}
