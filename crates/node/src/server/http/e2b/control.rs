//! The control plane: create, connect, get, list, kill, timeout, pause (docs/e2b.md).

use super::*;
use dsec_api::sandbox::CreateSpec;

/// A create body (`NewSandbox` of SDK < 2.51, `NewSandboxV2` after); unknown fields are
/// ignored, as E2B adds them often.
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub(in crate::server::http) struct NewSandbox {
    #[serde(default, rename = "templateID")]
    template_id: Option<String>,
    /// Seconds; 300 when absent.
    #[serde(default)]
    timeout: Option<u64>,
    #[serde(default)]
    metadata: Option<BTreeMap<String, String>>,
    #[serde(default)]
    env_vars: Option<BTreeMap<String, String>>,
    /// E2B's default is `true` (the SDK always sends it).
    #[serde(default, rename = "allow_internet_access")]
    allow_internet_access: Option<bool>,
    #[serde(default)]
    network: Option<E2bNetwork>,
}

/// `network` of a create (SDK ≥ 2.3): destinations let out and kept in.
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub(in crate::server::http) struct E2bNetwork {
    #[serde(default)]
    allow_out: Vec<String>,
    #[serde(default)]
    deny_out: Vec<String>,
}

/// The dsec network policy an E2B create asks for: `network.allowOut` is an allow list
/// (`denyOut` less the catch-all `0.0.0.0/0`, which an allow list implies);
/// `allow_internet_access: false` is none; otherwise (E2B's default) the public internet,
/// where the tenant's ceiling allows it, else none.
fn e2b_network(
    t: &Tenant,
    internet: Option<bool>,
    net: Option<E2bNetwork>,
) -> ApiResult<Option<dsec_api::network::NetworkSpec>> {
    use dsec_api::network::{AllowList, Egress, NetworkSpec, Rule};
    let parse = |v: Vec<String>| -> ApiResult<Vec<Rule>> {
        v.iter()
            .filter(|r| r.as_str() != "0.0.0.0/0")
            .map(|r| Rule::parse(r).map_err(|e| ApiError::invalid(e.to_string())))
            .collect()
    };
    if let Some(n) = net.filter(|n| !n.allow_out.is_empty()) {
        let egress = Egress::Allow(AllowList {
            allow: parse(n.allow_out)?,
            deny: parse(n.deny_out)?,
            ..AllowList::default()
        });
        return Ok(Some(NetworkSpec { egress }));
    }
    let open = internet != Some(false) && Egress::All.within(&t.ceiling()).is_ok();
    Ok(open.then_some(NetworkSpec {
        egress: Egress::All,
    }))
}

#[derive(Deserialize, Default)]
pub(in crate::server::http) struct TimeoutBody {
    #[serde(default)]
    timeout: Option<u64>,
}

/// Templates every node answers for, made from the host's root: E2B's SDK defaults.
const BUILT_IN: [&str; 2] = ["base", "code-interpreter-v1"];
/// Default sandbox timeout, seconds.
const DEFAULT_TIMEOUT_S: u64 = 300;
/// Longest timeout, seconds (24 h, as E2B's largest plan).
const MAX_TIMEOUT_S: u64 = 24 * 3600;
/// The metadata key that picks a substrate (E2B has no such field).
const SUBSTRATE_KEY: &str = "dsec.substrate";

/// The dsec template an E2B template id names: the template of that name, else `host` for
/// the built-in names.
fn template_of(app: &AppState, name: &str) -> String {
    if BUILT_IN.contains(&name) && app.node.rt.templates().get(name).is_err() {
        "host".to_owned()
    } else {
        name.to_owned()
    }
}

/// The E2B view of a sandbox: `Sandbox` (create, connect) when `detail` is false, else
/// `SandboxDetail`/`ListedSandbox`.
fn e2b_view(app: &AppState, rec: &SandboxRecord, detail: bool) -> Value {
    let template = rec
        .labels
        .get(TEMPLATE_LABEL)
        .cloned()
        .unwrap_or_else(|| rec.spec.template.clone());
    let mut v = json!({
        "sandboxID": rec.id,
        "templateID": template,
        "alias": template,
        "clientID": "dsec",
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": access_token(app, &rec.id),
        "domain": Value::Null,
    });
    if detail {
        let l = &rec.spec.limits;
        let metadata: BTreeMap<&String, &String> = rec
            .labels
            .iter()
            .filter(|(k, _)| !k.starts_with(OWN_LABELS))
            .collect();
        let started = rec.acquired_at_ms.unwrap_or(rec.created_at_ms);
        let cpus = l
            .cpu_max
            .map_or_else(|| f64::from(app.node.rt.capacity().cpus), |c| c.ceil());
        v["startedAt"] = json!(crate::clock::rfc3339(started));
        v["endAt"] = json!(crate::clock::rfc3339(
            rec.expires_at_ms.unwrap_or(started + MAX_TIMEOUT_S * 1000)
        ));
        v["cpuCount"] = json!(cpus.max(1.0) as u64);
        v["memoryMB"] = json!(l.memory_max >> 20);
        v["diskSizeMB"] = json!(l.disk_bytes >> 20);
        v["metadata"] = json!(metadata);
        v["state"] = json!(if rec.labels.contains_key(PAUSED_LABEL) {
            "paused"
        } else {
            "running"
        });
    }
    v
}

fn timeout_ms(t: Option<u64>) -> ApiResult<u64> {
    let t = t.unwrap_or(DEFAULT_TIMEOUT_S);
    if t > MAX_TIMEOUT_S {
        return Err(ApiError::invalid(format!(
            "timeout must be at most {MAX_TIMEOUT_S} s"
        )));
    }
    Ok(t.max(1) * 1000)
}

/// `POST /sandboxes`, `POST /v2/sandboxes` → 201 `Sandbox`.
pub(in crate::server::http) async fn e2b_create(
    Caller(app, t): Caller,
    idem: Option<Extension<IdemKey>>,
    body: Bytes,
) -> ApiResult<Response> {
    let b: NewSandbox = if body.is_empty() {
        NewSandbox::default()
    } else {
        serde_json::from_slice(&body)
            .map_err(|e| ApiError::invalid(format!("bad JSON body: {e}")))?
    };
    let asked = b.template_id.unwrap_or_else(|| "base".to_owned());
    let mut labels = b.metadata.unwrap_or_default();
    let substrate = labels.remove(SUBSTRATE_KEY);
    if labels.keys().any(|k| k.starts_with(OWN_LABELS)) {
        return Err(ApiError::invalid(format!(
            "metadata keys starting with {OWN_LABELS:?} are reserved"
        )));
    }
    labels.insert(TEMPLATE_LABEL.to_owned(), asked.clone());
    let network = e2b_network(&t, b.allow_internet_access, b.network)?;
    let spec = CreateSpec {
        network,
        template: Some(template_of(&app, &asked)),
        substrate,
        env: b.env_vars.unwrap_or_default(),
        labels,
        ttl_ms: Some(timeout_ms(b.timeout)?),
        // An E2B sandbox is a machine of its own: its user installs and writes anywhere.
        writable_root: true,
        ..CreateSpec::default()
    };
    let mut req = create_request(spec, &t, app.node.rt.capacity())?;
    req.idem = idem.map(|Extension(IdemKey(k))| k);
    let rec = app.node.create(&t, req).await?;
    let e = app.node.owned(&t, &rec.id)?;
    // E2B's default user, with a home, in every sandbox (the template keeps its own if it
    // has one of that name).
    let users = AgentReq::EnsureUsers {
        users: vec![(DEFAULT_USER.to_owned(), DEFAULT_UID)],
    };
    if let Err(err) = with_sandbox(&app, &e, move |_, sb| agent_event(sb, &users, &[], None)).await
    {
        let _ = app.node.destroy(&e).await;
        return Err(err);
    }
    tracing::info!(sandbox = %rec.id, tenant = %t.id, "sandbox created (e2b)");
    Ok((StatusCode::CREATED, Json(e2b_view(&app, &rec, false))).into_response())
}

fn live(app: &AppState, t: &Tenant, id: &str) -> ApiResult<Arc<Entry>> {
    let e = app.node.owned(t, id)?;
    if matches!(
        e.record().state,
        State::Stopped | State::Stopping | State::Failed
    ) {
        return Err(ApiError::no_sandbox(id));
    }
    Ok(e)
}

/// `GET /sandboxes/{id}` → `SandboxDetail`.
pub(in crate::server::http) async fn e2b_get(
    Caller(app, t): Caller,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    let e = live(&app, &t, &id)?;
    Ok(Json(e2b_view(&app, &e.record(), true)))
}

/// `DELETE /sandboxes/{id}` → 204.
pub(in crate::server::http) async fn e2b_kill(
    Caller(app, t): Caller,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    let e = live(&app, &t, &id)?;
    app.node.destroy(&e).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /sandboxes/{id}/timeout {"timeout": s}` → 204: the sandbox is killed `s` seconds
/// from now.
pub(in crate::server::http) async fn e2b_timeout(
    Caller(app, t): Caller,
    Path(id): Path<String>,
    JsonBody(b): JsonBody<TimeoutBody>,
) -> ApiResult<StatusCode> {
    let e = live(&app, &t, &id)?;
    let ms = timeout_ms(b.timeout)?;
    app.node.update(&e, |r| {
        r.expires_at_ms = Some(now_ms() + ms);
        Ok(())
    })?;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /sandboxes/{id}/connect`, `POST /v2/sandboxes/{id}/connect`: 201 when it resumed a
/// paused sandbox, else 200; the timeout is extended, never shortened.
pub(in crate::server::http) async fn e2b_connect(
    Caller(app, t): Caller,
    Path(id): Path<String>,
    JsonBody(b): JsonBody<TimeoutBody>,
) -> ApiResult<Response> {
    let e = live(&app, &t, &id)?;
    let resumed = if e.record().labels.contains_key(PAUSED_LABEL) {
        with_sandbox(&app, &e, |rt, sb| Ok(sb.pause(rt, false)?)).await?;
        app.node.update(&e, |r| {
            r.labels.remove(PAUSED_LABEL);
            Ok(())
        })?;
        true
    } else {
        false
    };
    let ms = timeout_ms(b.timeout)?;
    let rec = app.node.update(&e, |r| {
        let want = now_ms() + ms;
        if r.expires_at_ms.is_some_and(|at| at < want) {
            r.expires_at_ms = Some(want);
        }
        Ok(())
    })?;
    let status = if resumed {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(e2b_view(&app, &rec, false))).into_response())
}

/// `POST /sandboxes/{id}/pause` → 204; 409 when already paused. Its processes stop where
/// they are (frozen; their memory and files kept) until a connect resumes it.
pub(in crate::server::http) async fn e2b_pause(
    Caller(app, t): Caller,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    let e = live(&app, &t, &id)?;
    if e.record().labels.contains_key(PAUSED_LABEL) {
        return Ok(e2b_error(
            StatusCode::CONFLICT,
            format!("sandbox {id} is already paused"),
        ));
    }
    with_sandbox(&app, &e, |rt, sb| Ok(sb.pause(rt, true)?)).await?;
    app.node.update(&e, |r| {
        r.labels.insert(PAUSED_LABEL.to_owned(), "true".to_owned());
        Ok(())
    })?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub(in crate::server::http) struct ListQuery {
    #[serde(default)]
    metadata: Option<String>,
    #[serde(default)]
    state: Option<String>,
    #[serde(default)]
    limit: Option<usize>,
    #[serde(default)]
    next_token: Option<String>,
}

/// `GET /v2/sandboxes`, `GET /sandboxes` → `[ListedSandbox]`, oldest first, the next page's
/// token in `X-Next-Token`. `metadata` is `k=v&k2=v2` (URL-encoded once more by the SDK).
pub(in crate::server::http) async fn e2b_list(
    Caller(app, t): Caller,
    Query(q): Query<ListQuery>,
) -> ApiResult<Response> {
    // `metadata` is itself a query string (`k=v&k2=v2`, encoded once more by the SDK): the
    // router's query parser decodes it as it decoded the request's.
    let want: Vec<(String, String)> = match q.metadata.as_deref().filter(|m| !m.is_empty()) {
        Some(m) => format!("/?{m}")
            .parse::<axum::http::Uri>()
            .ok()
            .and_then(|u| Query::<Vec<(String, String)>>::try_from_uri(&u).ok())
            .map(|Query(v)| v)
            .ok_or_else(|| ApiError::invalid("metadata must be k=v pairs joined by &"))?,
        None => Vec::new(),
    };
    let states: Vec<String> = q
        .state
        .as_deref()
        .map(|s| s.split(',').map(str::to_owned).collect())
        .unwrap_or_default();
    let mut items: Vec<SandboxRecord> = app
        .node
        .entries()
        .iter()
        .map(|e| e.record())
        .filter(|r| r.tenant.as_deref() == Some(t.id.as_str()))
        .filter(|r| matches!(r.state, State::Running | State::Ready | State::Resetting))
        .filter(|r| want.iter().all(|(k, v)| r.labels.get(k) == Some(v)))
        .filter(|r| {
            let st = if r.labels.contains_key(PAUSED_LABEL) {
                "paused"
            } else {
                "running"
            };
            states.is_empty() || states.iter().any(|s| s == st)
        })
        .collect();
    items.sort_by(|a, b| (a.created_at_ms, &a.id).cmp(&(b.created_at_ms, &b.id)));
    let skip: usize = q
        .next_token
        .as_deref()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    let limit = q.limit.unwrap_or(1000).clamp(1, 1000);
    let page: Vec<Value> = items
        .iter()
        .skip(skip)
        .take(limit)
        .map(|r| e2b_view(&app, r, true))
        .collect();
    let mut resp = Json(page).into_response();
    if skip + limit < items.len() {
        if let Ok(v) = HeaderValue::from_str(&(skip + limit).to_string()) {
            resp.headers_mut().insert("x-next-token", v);
        }
    }
    Ok(resp)
}
