//! The code runner's endpoints (see `run/mod.rs`): native, batch, languages, SandboxFusion's `/run_code`.

use super::*;

pub(super) async fn run_native(Caller(app, t): Caller, body: Bytes) -> ApiResult<Json<Value>> {
    Ok(Json(crate::server::run::run(app.runner, &t, &body).await?))
}

pub(super) async fn run_batch(Caller(app, t): Caller, body: Bytes) -> ApiResult<Json<Value>> {
    Ok(Json(
        crate::server::run::run_batch(app.runner, &t, &body).await?,
    ))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct LanguagesQuery {
    #[serde(default)]
    template: Option<String>,
}

pub(super) async fn languages(
    AxState(app): AxState<AppState>,
    Query(q): Query<LanguagesQuery>,
) -> ApiResult<Json<Value>> {
    Ok(Json(
        crate::server::run::list_languages(app.runner, q.template).await?,
    ))
}

pub(super) async fn run_code(Caller(app, t): Caller, body: Bytes) -> Response {
    let (status, v) = crate::server::run::run_code(app.runner, &t, &body).await;
    (
        StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        Json(v),
    )
        .into_response()
}

pub(super) async fn ping() -> Json<Value> {
    Json(json!("pong"))
}
