//! The code interpreter (port 49999) of `e2b-code-interpreter`, served from the sandbox's
//! persistent Python (or shell) sessions instead of a Jupyter server: `POST /execute` runs a
//! cell in a context and answers NDJSON (`stdout`, `stderr`, `result` — the value of the
//! cell's last expression, as a notebook shows it —, `error`, `number_of_executions`,
//! `end_of_execution`); `/contexts` makes, lists, restarts and removes contexts.

// Handlers' helpers answer an E2B error response as their error: built once, returned up.
#![allow(clippy::result_large_err)]

use std::collections::HashMap;
use std::sync::Mutex;

use dsec_api::agent::SessionKind;

use super::*;

/// A context: a session of the sandbox's agent.
#[derive(Clone)]
struct Context {
    id: String,
    language: String,
    cwd: String,
    session: u64,
    executions: u64,
}

/// Contexts per sandbox (the default one under the id `default`).
static CONTEXTS: Mutex<Option<HashMap<String, Vec<Context>>>> = Mutex::new(None);
/// Most contexts per sandbox.
const MAX_CONTEXTS: usize = 32;
/// Default cell timeout (the SDK's).
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
const RESULT_MARK: &str = "\u{1e}dsec-result ";
const ERROR_MARK: &str = "\u{1e}dsec-error ";

/// Runs a cell: the last expression's value and any exception come back as marked lines.
const CELL_DRIVER: &str = r#"
def _dsec_cell(src, env):
    import ast, json, os, sys, traceback
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        tree = ast.parse(src, "<cell>", "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, "<cell>", "exec"), globals())
        if last is not None:
            v = eval(compile(last, "<cell>", "eval"), globals())
            if v is not None:
                sys.stdout.flush()
                sys.stdout.write("\n\x1edsec-result " + json.dumps(repr(v)) + "\n")
    except BaseException as e:
        sys.stdout.flush()
        tb = traceback.format_exc()
        sys.stdout.write("\n\x1edsec-error " + json.dumps({"name": type(e).__name__, "value": str(e), "traceback": tb}) + "\n")
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
"#;

fn with<T>(f: impl FnOnce(&mut HashMap<String, Vec<Context>>) -> T) -> T {
    let mut g = CONTEXTS.lock().unwrap_or_else(|p| p.into_inner());
    f(g.get_or_insert_with(HashMap::new))
}

/// Dispatches one request to the code interpreter.
pub(super) async fn serve(t: Target, req: Request) -> Response {
    // Contexts of sandboxes that are gone go first.
    let node = Arc::clone(&t.app.node);
    with(|m| m.retain(|id, _| node.entry(id).is_some()));
    let (parts, body) = req.into_parts();
    let path = parts.uri.path().to_owned();
    let body = match axum::body::to_bytes(body, 16 << 20).await {
        Ok(b) => b,
        Err(e) => return e2b_error(StatusCode::PAYLOAD_TOO_LARGE, e.to_string()),
    };
    let r = match (parts.method.as_str(), path.as_str()) {
        ("GET", "/health") => return StatusCode::NO_CONTENT.into_response(),
        ("POST", "/execute") => return execute(t, &body).await,
        ("POST", "/contexts") => create(&t, &body)
            .await
            .map(|c| Json(view(&c)).into_response()),
        ("GET", "/contexts") => Ok(Json(
            with(|m| m.get(t.id()).cloned().unwrap_or_default())
                .iter()
                .filter(|c| c.id != "default")
                .map(view)
                .collect::<Vec<_>>(),
        )
        .into_response()),
        ("DELETE", p) if p.starts_with("/contexts/") => remove(&t, &p["/contexts/".len()..])
            .await
            .map(|()| StatusCode::NO_CONTENT.into_response()),
        ("POST", p) if p.starts_with("/contexts/") && p.ends_with("/restart") => {
            let id = &p["/contexts/".len()..p.len() - "/restart".len()];
            restart(&t, id)
                .await
                .map(|()| StatusCode::NO_CONTENT.into_response())
        }
        _ => Err(e2b_error(
            StatusCode::NOT_FOUND,
            format!("no such endpoint {path}"),
        )),
    };
    r.unwrap_or_else(|e| e)
}

fn view(c: &Context) -> Value {
    json!({"id": c.id, "language": c.language, "cwd": c.cwd})
}

fn kind_of(language: &str) -> Result<SessionKind, Response> {
    match language {
        "python" | "" => Ok(SessionKind::Python),
        "bash" | "sh" | "shell" => Ok(SessionKind::Shell),
        other => Err(e2b_error(
            StatusCode::BAD_REQUEST,
            format!("language {other:?} is not served (python, bash)"),
        )),
    }
}

async fn open(t: &Target, language: &str, cwd: &str) -> Result<u64, Response> {
    let kind = kind_of(language)?;
    let req = AgentReq::SessionOpen {
        kind,
        env: t.entry.record().env.clone(),
        cwd: Some(cwd.to_owned()),
    };
    match with_sandbox(&t.app, &t.entry, move |_, sb| {
        agent_event(sb, &req, &[], None)
    })
    .await
    {
        Ok(Event::SessionOpened { session }) => Ok(session),
        Ok(other) => Err(e2b_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("unexpected {other:?}"),
        )),
        Err(e) => Err(e2b_error(ApiError::status_of(e.code), e.detail)),
    }
}

#[derive(Deserialize, Default)]
struct NewContext {
    #[serde(default)]
    language: Option<String>,
    #[serde(default)]
    cwd: Option<String>,
}

async fn create(t: &Target, body: &[u8]) -> Result<Context, Response> {
    let b: NewContext = serde_json::from_slice(if body.is_empty() { b"{}" } else { body })
        .map_err(|e| e2b_error(StatusCode::BAD_REQUEST, e.to_string()))?;
    if with(|m| m.get(t.id()).map_or(0, Vec::len)) >= MAX_CONTEXTS {
        return Err(e2b_error(
            StatusCode::TOO_MANY_REQUESTS,
            "too many contexts",
        ));
    }
    let language = b.language.unwrap_or_else(|| "python".to_owned());
    let cwd = b.cwd.unwrap_or_else(|| "/home/user".to_owned());
    let session = open(t, &language, &cwd).await?;
    let mut raw = [0u8; 8];
    let _ = getrandom::fill(&mut raw);
    let c = Context {
        id: hex::encode(raw),
        language,
        cwd,
        session,
        executions: 0,
    };
    with(|m| m.entry(t.id().to_owned()).or_default().push(c.clone()));
    Ok(c)
}

async fn close(t: &Target, session: u64) {
    let req = AgentReq::SessionClose { session };
    let _ = with_sandbox(&t.app, &t.entry, move |_, sb| {
        agent_event(sb, &req, &[], None)
    })
    .await;
}

async fn remove(t: &Target, id: &str) -> Result<(), Response> {
    let c = with(|m| {
        let v = m.get_mut(t.id())?;
        let i = v.iter().position(|c| c.id == id)?;
        Some(v.remove(i))
    })
    .ok_or_else(|| e2b_error(StatusCode::NOT_FOUND, format!("no context {id}")))?;
    close(t, c.session).await;
    Ok(())
}

async fn restart(t: &Target, id: &str) -> Result<(), Response> {
    let c = with(|m| m.get(t.id())?.iter().find(|c| c.id == id).cloned())
        .ok_or_else(|| e2b_error(StatusCode::NOT_FOUND, format!("no context {id}")))?;
    close(t, c.session).await;
    let session = open(t, &c.language, &c.cwd).await?;
    with(|m| {
        if let Some(x) = m
            .get_mut(t.id())
            .and_then(|v| v.iter_mut().find(|x| x.id == id))
        {
            x.session = session;
            x.executions = 0;
        }
    });
    Ok(())
}

#[derive(Deserialize, Default)]
struct ExecuteBody {
    code: String,
    #[serde(default)]
    context_id: Option<String>,
    #[serde(default)]
    language: Option<String>,
    #[serde(default)]
    env_vars: Option<BTreeMap<String, String>>,
}

/// The context a cell runs in: the one named, else the sandbox's default for the language.
async fn context_for(t: &Target, b: &ExecuteBody) -> Result<Context, Response> {
    if let Some(id) = &b.context_id {
        return with(|m| m.get(t.id())?.iter().find(|c| &c.id == id).cloned())
            .ok_or_else(|| e2b_error(StatusCode::NOT_FOUND, format!("no context {id}")));
    }
    let language = b.language.clone().unwrap_or_else(|| "python".to_owned());
    let default_id = format!("default-{language}");
    if let Some(c) = with(|m| m.get(t.id())?.iter().find(|c| c.id == default_id).cloned()) {
        return Ok(c);
    }
    let session = open(t, &language, "/home/user").await?;
    let c = Context {
        id: default_id,
        language,
        cwd: "/home/user".to_owned(),
        session,
        executions: 0,
    };
    with(|m| m.entry(t.id().to_owned()).or_default().push(c.clone()));
    Ok(c)
}

fn ndjson(lines: &[Value]) -> Response {
    let mut out = String::new();
    for l in lines {
        out.push_str(&l.to_string());
        out.push('\n');
    }
    let mut resp = Response::new(Body::from(out));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/x-ndjson"),
    );
    resp
}

fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

async fn execute(t: Target, body: &[u8]) -> Response {
    let b: ExecuteBody = match serde_json::from_slice(body) {
        Ok(b) => b,
        Err(e) => return e2b_error(StatusCode::BAD_REQUEST, format!("bad body: {e}")),
    };
    let c = match context_for(&t, &b).await {
        Ok(c) => c,
        Err(r) => return r,
    };
    let python = c.language == "python";
    let input = if python {
        let code = serde_json::to_string(&b.code).unwrap_or_default();
        let env =
            serde_json::to_string(&b.env_vars.clone().unwrap_or_default()).unwrap_or_default();
        format!("{CELL_DRIVER}\n_dsec_cell({code}, {env})\n")
    } else {
        b.code.clone()
    };
    let req = AgentReq::SessionRun {
        session: c.session,
        input,
        timeout_ms: Some(DEFAULT_TIMEOUT.as_millis() as u64),
    };
    let done = with_sandbox(&t.app, &t.entry, move |_, sb| {
        agent_event(sb, &req, &[], Some(DEFAULT_TIMEOUT))
    })
    .await;
    let r = match done {
        Ok(Event::ExecDone(r)) => r,
        Ok(other) => {
            return e2b_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("unexpected {other:?}"),
            )
        }
        Err(e) => return e2b_error(ApiError::status_of(e.code), e.detail),
    };
    let count = with(|m| {
        let x = m.get_mut(t.id())?.iter_mut().find(|x| x.id == c.id)?;
        x.executions += 1;
        Some(x.executions)
    })
    .unwrap_or(1);
    let ts = now_ns();
    let mut lines = Vec::new();
    let stdout = String::from_utf8_lossy(&r.stdout.data).into_owned();
    let mut text = String::new();
    let mut results = Vec::new();
    for line in stdout.split_inclusive('\n') {
        if let Some(v) = line.strip_prefix(RESULT_MARK) {
            let repr: String = serde_json::from_str(v.trim_end()).unwrap_or_default();
            results.push(json!({"type": "result", "text": repr, "is_main_result": true}));
        } else if let Some(v) = line.strip_prefix(ERROR_MARK) {
            let mut e: Value = serde_json::from_str(v.trim_end()).unwrap_or_default();
            e["type"] = json!("error");
            results.push(e);
        } else {
            text.push_str(line);
        }
    }
    // The driver starts its marked lines on a line of their own.
    if python && (text.ends_with('\n') && !results.is_empty()) {
        text.pop();
    }
    if !text.is_empty() {
        lines.push(json!({"type": "stdout", "text": text, "timestamp": ts}));
    }
    let stderr = String::from_utf8_lossy(&r.stderr.data).into_owned();
    if !stderr.is_empty() {
        lines.push(json!({"type": "stderr", "text": stderr, "timestamp": ts}));
    }
    lines.extend(results);
    if !python && r.exit_code != Some(0) {
        lines.push(json!({"type": "error", "name": "ExitError", "value": format!("exit status {:?}", r.exit_code), "traceback": ""}));
    }
    lines.push(json!({"type": "number_of_executions", "execution_count": count}));
    lines.push(json!({"type": "end_of_execution"}));
    ndjson(&lines)
}
