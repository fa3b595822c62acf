//! Running things in a sandbox: commands, background processes, sessions; the trajectory log of each step.

use super::*;
use dsec_api::body::{RunBody, SessionBody, SignalBody, StdinBody, WaitBody};
use dsec_api::exec::ExecBody;

/// Runs `f` on the sandbox's agent on the blocking pool, holding the sandbox exclusively.
pub(super) async fn with_sandbox<T: Send + 'static>(
    app: &AppState,
    e: &Arc<Entry>,
    f: impl FnOnce(&crate::substrate::Runtime, &mut crate::substrate::Sandbox) -> ApiResult<T>
        + Send
        + 'static,
) -> ApiResult<T> {
    let mut guard = e.lock().await;
    if guard.is_none() || e.record().state != State::Running {
        return Err(ApiError::new(
            ErrorCode::InvalidTransition,
            format!("sandbox {} is {:?}", e.id, e.record().state),
        ));
    }
    let rt = Arc::clone(&app.node.rt);
    tokio::task::spawn_blocking(move || match guard.as_mut() {
        Some(sb) => f(&rt, sb),
        None => Err(ApiError::no_sandbox("")),
    })
    .await
    .map_err(|err| ApiError::internal(err.to_string()))?
}

pub(super) fn exec_request(
    b: ExecBody,
    base_env: &BTreeMap<String, String>,
) -> ApiResult<(ExecRequest, Vec<u8>)> {
    let command = match (b.argv, b.shell) {
        (Some(a), None) => Command::Argv(a),
        (None, Some(s)) => Command::Shell(s),
        _ => return Err(ApiError::invalid("pass exactly one of argv and shell")),
    };
    let stdin = text_or_b64(b.stdin, b.stdin_b64, "stdin")?;
    let mut env = base_env.clone();
    env.extend(b.env);
    let req = ExecRequest {
        command,
        env,
        cwd: b.cwd,
        timeout_ms: b.timeout_ms,
        cpu_limit_ms: b.cpu_limit_ms,
        output_limit: b.output_limit,
        stream: false,
        user: b.user,
        tag: None,
        pty: None,
        stdin_closed: false,
    };
    req.validate().map_err(ApiError::invalid)?;
    Ok((req, stdin))
}

#[derive(Deserialize)]
pub(super) struct ExecQuery {
    #[serde(default)]
    stream: bool,
}

pub(super) async fn exec(
    Caller(app, t): Caller,
    Path(id): Path<String>,
    Query(q): Query<ExecQuery>,
    body: Bytes,
) -> ApiResult<Response> {
    let e = app.node.owned(&t, &id)?;
    let mut b: ExecBody = json_body(&body)?;
    let (trajectory, step) = (b.trajectory.take(), b.step.take());
    let (mut req, stdin) = exec_request(b, &e.record().env)?;
    app.node.metrics.execs.inc();
    if let Some(trajectory) = trajectory {
        if q.stream {
            return Err(ApiError::invalid(
                "a streamed exec cannot be a trajectory step; drop ?stream=true",
            ));
        }
        let action = action_of(&body, &["trajectory", "step"])?;
        let app2 = app.clone();
        let e2 = Arc::clone(&e);
        return logged_step(
            &app,
            &t,
            &e,
            &trajectory,
            step,
            "exec",
            action,
            move |_| async move {
                let r = exec_once(&app2, &e2, req, stdin).await?;
                Ok(serde_json::to_value(r).unwrap_or_default())
            },
        )
        .await;
    }
    if !q.stream {
        let r = exec_once(&app, &e, req, stdin).await?;
        return Ok(Json(r).into_response());
    }
    req.stream = true;
    let (tx, rx) = tokio::sync::mpsc::channel::<SseEvent>(64);
    let app2 = app.clone();
    tokio::spawn(async move {
        let out_tx = tx.clone();
        let r = with_sandbox(&app2, &e, move |rt, sb| {
            sb.exec(rt, &req, &stdin, |stream, bytes| {
                let name = match stream {
                    Stream::Stdout => "stdout",
                    Stream::Stderr => "stderr",
                };
                let data =
                    json!({"data_b64": base64::engine::general_purpose::STANDARD.encode(bytes)});
                // Bounded: a slow client slows the command's output, not the node's memory.
                let _ =
                    out_tx.blocking_send(SseEvent::default().event(name).data(data.to_string()));
            })
            .map_err(ApiError::from)
        })
        .await;
        let ev = match r {
            Ok(res) => {
                count_kills(&app2, &res);
                SseEvent::default()
                    .event("exit")
                    .data(serde_json::to_string(&res).unwrap_or_default())
            }
            Err(err) => SseEvent::default()
                .event("error")
                .data(serde_json::to_string(&err.problem()).unwrap_or_default()),
        };
        let _ = tx.send(ev).await;
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|ev| (Ok::<_, Infallible>(ev), rx))
    });
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response())
}

/// The client's request body without the trajectory fields (what a step's digest covers).
pub(super) fn action_of(body: &Bytes, drop: &[&str]) -> ApiResult<Value> {
    let mut v: Value = serde_json::from_slice(if body.is_empty() { b"{}" } else { body })
        .map_err(|e| ApiError::invalid(format!("bad JSON body: {e}")))?;
    if let Some(o) = v.as_object_mut() {
        for k in drop {
            o.remove(*k);
        }
    }
    Ok(v)
}

/// Runs `run` as step `step` of `trajectory` (see `trajectory.rs`): replayed from the log when
/// it was recorded, refused when its outcome is unknown or the step does not continue the
/// trajectory, otherwise run with its intent and its answer made durable.
#[allow(clippy::too_many_arguments)]
pub(super) async fn logged_step<F, Fut>(
    app: &AppState,
    t: &Tenant,
    e: &Entry,
    trajectory: &str,
    step: Option<u64>,
    op: &str,
    action: Value,
    run: F,
) -> ApiResult<Response>
where
    F: FnOnce(u64) -> Fut,
    Fut: std::future::Future<Output = ApiResult<Value>>,
{
    let rec = e.record();
    let secrets: Vec<String> = rec
        .secret_env
        .iter()
        .filter_map(|k| rec.env.get(k).cloned())
        .collect();
    let begun = app
        .trajectories
        .begin(t, trajectory, step, op, &e.id, &action, secrets)
        .await?;
    let (status, body, step, replayed) = match begun {
        crate::server::trajectory::Begin::Replay { status, body, step } => {
            (status, body, step, true)
        }
        crate::server::trajectory::Begin::Run(running) => {
            let step = running.step();
            // What the sandbox's network refused while the step ran is part of its
            // observation (logged, and replayed with it).
            let watch = (e.record().net_addr.is_some()).then(|| app.node.egress_watch(&e.id));
            let ran = run(step).await;
            let refused = watch.map(|w| w.take()).unwrap_or_default();
            let (status, body, summary) = match ran.map(|mut v| {
                if !refused.is_empty() {
                    v["egress_denied"] = json!(refused);
                }
                v
            }) {
                Ok(v) => {
                    let summary = json!({"status": v["status"], "exit_code": v["exit_code"], "wall_us": v["wall_us"]});
                    (200u16, serde_json::to_vec(&v).unwrap_or_default(), summary)
                }
                Err(err) => (
                    ApiError::status_of(err.code).as_u16(),
                    serde_json::to_vec(&err.problem()).unwrap_or_default(),
                    json!({"error": err.code}),
                ),
            };
            let body = app
                .trajectories
                .finish(running, status, &body, summary)
                .await?;
            (status, body, step, false)
        }
    };
    let mut resp = (StatusCode::from_u16(status).unwrap_or(StatusCode::OK), body).into_response();
    let ct = if status < 400 {
        "application/json"
    } else {
        "application/problem+json"
    };
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(ct));
    if let Ok(v) = HeaderValue::from_str(&step.to_string()) {
        resp.headers_mut().insert("dsec-step", v);
    }
    if replayed {
        resp.headers_mut()
            .insert("dsec-replayed", HeaderValue::from_static("true"));
    }
    Ok(resp)
}

/// Runs one command to its end, timed and counted for `/metrics`.
async fn exec_once(
    app: &AppState,
    e: &Arc<Entry>,
    req: ExecRequest,
    stdin: Vec<u8>,
) -> ApiResult<ExecResult> {
    let t0 = std::time::Instant::now();
    let rt = Arc::clone(&app.node.rt);
    let id = e.id.clone();
    let _watch = crate::stall::StallWatch::start(&e.id, move || {
        rt.cgroups()
            .open(&id)
            .and_then(|cg| cg.pids().ok())
            .unwrap_or_default()
    });
    let r = with_sandbox(app, e, move |rt, sb| {
        sb.exec(rt, &req, &stdin, |_, _| {}).map_err(ApiError::from)
    })
    .await?;
    app.node.metrics.exec.observe_duration(t0.elapsed());
    count_kills(app, &r);
    Ok(r)
}

/// Counts seccomp (SIGSYS) and OOM kills for `/metrics`.
pub(super) fn count_kills(app: &AppState, r: &ExecResult) {
    if r.signal == Some(31) {
        app.node.metrics.seccomp_kills.inc();
    }
    if r.status == dsec_api::exec::ExecStatus::Oom {
        app.node.metrics.oom_kills.inc();
    }
}

pub(super) fn agent_event(
    sb: &mut crate::substrate::Sandbox,
    req: &AgentReq,
    body: &[u8],
    timeout: Option<Duration>,
) -> ApiResult<Event> {
    Ok(sb.agent().call(req, body, timeout, |_, _| {})?.0)
}

pub(super) async fn spawn(
    Caller(app, t): Caller,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<Response> {
    let e = app.node.owned(&t, &id)?;
    let (req, stdin) = exec_request(json_body(&body)?, &e.record().env)?;
    let ev = with_sandbox(&app, &e, move |_, sb| {
        agent_event(sb, &AgentReq::Spawn(req), &stdin, None)
    })
    .await?;
    match ev {
        Event::Started { handle, pid } => Ok((
            StatusCode::CREATED,
            Json(json!({"handle": handle, "pid": pid})),
        )
            .into_response()),
        other => Err(ApiError::internal(format!("unexpected {other:?}"))),
    }
}

pub(super) async fn proc_status(
    Caller(app, t): Caller,
    Path((id, handle)): Path<(String, u64)>,
) -> ApiResult<Json<Value>> {
    match agent_answer(&app, &t, &id, AgentReq::ProcStatus { handle }).await? {
        Event::ProcStatus { running, pid } => Ok(Json(json!({"running": running, "pid": pid}))),
        other => Err(ApiError::internal(format!("unexpected {other:?}"))),
    }
}

pub(super) async fn proc_stdin(
    Caller(app, t): Caller,
    Path((id, handle)): Path<(String, u64)>,
    JsonBody(b): JsonBody<StdinBody>,
) -> ApiResult<StatusCode> {
    let data = text_or_b64(b.data, b.data_b64, "data")?;
    let req = AgentReq::ProcStdin { handle, eof: b.eof };
    agent_ok(&app, &t, &id, req, Bytes::from(data)).await
}

pub(super) async fn proc_signal(
    Caller(app, t): Caller,
    Path((id, handle)): Path<(String, u64)>,
    JsonBody(b): JsonBody<SignalBody>,
) -> ApiResult<StatusCode> {
    if !(1..=64).contains(&b.signal) {
        return Err(ApiError::invalid("signal must be in 1..=64"));
    }
    let req = AgentReq::ProcSignal {
        handle,
        signal: b.signal,
    };
    agent_ok(&app, &t, &id, req, Bytes::new()).await
}

pub(super) async fn proc_wait(
    Caller(app, t): Caller,
    Path((id, handle)): Path<(String, u64)>,
    JsonBody(b): JsonBody<WaitBody>,
) -> ApiResult<Json<Value>> {
    let timeout_ms = b.timeout_ms.unwrap_or(30_000).min(MAX_WAIT_MS);
    let e = app.node.owned(&t, &id)?;
    let ev = with_sandbox(&app, &e, move |_, sb| {
        agent_event(
            sb,
            &AgentReq::ProcWait { handle, timeout_ms },
            &[],
            Some(Duration::from_millis(timeout_ms)),
        )
    })
    .await?;
    match ev {
        Event::ExecDone(r) => Ok(Json(serde_json::to_value(r).unwrap_or_default())),
        Event::ProcStatus { running, pid } => Ok(Json(json!({"running": running, "pid": pid}))),
        other => Err(ApiError::internal(format!("unexpected {other:?}"))),
    }
}

/// `GET /v1/sandboxes/{id}/processes`: the background processes still running.
pub(super) async fn proc_list(
    Caller(app, t): Caller,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    match agent_answer(&app, &t, &id, AgentReq::ProcList).await? {
        Event::Procs { items } => Ok(Json(json!({ "items": items }))),
        other => Err(ApiError::internal(format!("unexpected {other:?}"))),
    }
}

/// How long a follower waits for its `Attached` before the request fails.
const ATTACH_WAIT: Duration = Duration::from_secs(30);

/// `GET /v1/sandboxes/{id}/processes/{handle}/output`: follows a background process from now
/// on as `text/event-stream` — `stdout`/`stderr` events (`{"data_b64"}`), then `exit` with
/// its result (or `error`). A client that goes away stops the following; the process goes on.
pub(super) async fn proc_output(
    Caller(app, t): Caller,
    Path((id, handle)): Path<(String, u64)>,
) -> ApiResult<Response> {
    let e = app.node.owned(&t, &id)?;
    let mut f = crate::lifecycle::follow(&e, AgentReq::ProcAttach { handle }, Vec::new()).await?;
    // A handle that does not exist is the request's error, not an event of a stream.
    match f.next(ATTACH_WAIT).await {
        Some(Ok((Event::Attached { .. }, _))) => {}
        Some(Ok((Event::Error { code, message }, _))) => return Err(ApiError::new(code, message)),
        Some(Ok((other, _))) => return Err(ApiError::internal(format!("unexpected {other:?}"))),
        Some(Err(err)) => return Err(err.into()),
        None => {
            f.detach().await;
            return Err(ApiError::new(
                ErrorCode::AgentUnavailable,
                format!("the agent did not attach to process {handle} within {ATTACH_WAIT:?}"),
            ));
        }
    }
    let (tx, rx) = tokio::sync::mpsc::channel::<SseEvent>(64);
    tokio::spawn(async move {
        loop {
            // Bounded: a slow client leaves the events with the follower, which is ended
            // once too much is waiting (the process goes on).
            let got = tokio::select! {
                got = f.next(Duration::from_secs(15)) => got,
                () = tx.closed() => break,
            };
            let (ev, last) = match got {
                None => continue,
                Some(Ok((Event::Output { stream }, body))) => {
                    let name = match stream {
                        Stream::Stdout => "stdout",
                        Stream::Stderr => "stderr",
                    };
                    let data =
                        json!({"data_b64": base64::engine::general_purpose::STANDARD.encode(body)});
                    (
                        SseEvent::default().event(name).data(data.to_string()),
                        false,
                    )
                }
                Some(Ok((Event::ExecDone(r), _))) => {
                    count_kills(&app, &r);
                    let data = serde_json::to_string(&r).unwrap_or_default();
                    (SseEvent::default().event("exit").data(data), true)
                }
                Some(Ok((Event::Detached, _))) => {
                    (SseEvent::default().event("detached").data("{}"), true)
                }
                Some(Ok((Event::Error { code, message }, _))) => {
                    let p = ApiError::new(code, message).problem();
                    let data = serde_json::to_string(&p).unwrap_or_default();
                    (SseEvent::default().event("error").data(data), true)
                }
                Some(Ok(_)) => continue,
                Some(Err(err)) => {
                    let data =
                        serde_json::to_string(&ApiError::from(err).problem()).unwrap_or_default();
                    (SseEvent::default().event("error").data(data), true)
                }
            };
            if tx.send(ev).await.is_err() || last {
                break;
            }
        }
        // Dropped here: a follow that did not end is detached in the background.
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|ev| (Ok::<_, Infallible>(ev), rx))
    });
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response())
}

pub(super) async fn session_open(
    Caller(app, t): Caller,
    Path(id): Path<String>,
    JsonBody(b): JsonBody<SessionBody>,
) -> ApiResult<Response> {
    let e = app.node.owned(&t, &id)?;
    let mut env = e.record().env;
    env.extend(b.env);
    let ev = with_sandbox(&app, &e, move |_, sb| {
        agent_event(
            sb,
            &AgentReq::SessionOpen {
                kind: b.kind,
                env,
                cwd: b.cwd,
            },
            &[],
            None,
        )
    })
    .await?;
    match ev {
        Event::SessionOpened { session } => {
            Ok((StatusCode::CREATED, Json(json!({"session": session}))).into_response())
        }
        other => Err(ApiError::internal(format!("unexpected {other:?}"))),
    }
}

pub(super) async fn session_run(
    Caller(app, t): Caller,
    Path((id, session)): Path<(String, u64)>,
    body: Bytes,
) -> ApiResult<Response> {
    let mut b: RunBody = json_body(&body)?;
    if b.timeout_ms
        .is_some_and(|t| t == 0 || t > dsec_api::exec::MAX_TIMEOUT_MS)
    {
        return Err(ApiError::invalid("timeout_ms out of range"));
    }
    let e = app.node.owned(&t, &id)?;
    let (trajectory, step) = (b.trajectory.take(), b.step.take());
    let app2 = app.clone();
    let e2 = Arc::clone(&e);
    let run = move |_| async move {
        let ev = with_sandbox(&app2, &e2, move |_, sb| {
            agent_event(
                sb,
                &AgentReq::SessionRun {
                    session,
                    input: b.input,
                    timeout_ms: b.timeout_ms,
                },
                &[],
                b.timeout_ms.map(Duration::from_millis),
            )
        })
        .await?;
        match ev {
            Event::ExecDone(r) => Ok(serde_json::to_value(r).unwrap_or_default()),
            other => Err(ApiError::internal(format!("unexpected {other:?}"))),
        }
    };
    match trajectory {
        Some(trajectory) => {
            let mut action = action_of(&body, &["trajectory", "step"])?;
            action["session"] = session.into();
            logged_step(&app, &t, &e, &trajectory, step, "session_run", action, run).await
        }
        None => Ok(Json(run(0).await?).into_response()),
    }
}

pub(super) async fn session_close(
    Caller(app, t): Caller,
    Path((id, session)): Path<(String, u64)>,
) -> ApiResult<StatusCode> {
    agent_ok(
        &app,
        &t,
        &id,
        AgentReq::SessionClose { session },
        Bytes::new(),
    )
    .await
}

/// Bytes given as text in the field `name` or as base64 in `{name}_b64` (at most one of them;
/// neither is no bytes).
fn text_or_b64(text: Option<String>, b64: Option<String>, name: &str) -> ApiResult<Vec<u8>> {
    match (text, b64) {
        (Some(s), None) => Ok(s.into_bytes()),
        (None, Some(s)) => base64::engine::general_purpose::STANDARD
            .decode(s)
            .map_err(|e| ApiError::invalid(format!("{name}_b64: {e}"))),
        (None, None) => Ok(Vec::new()),
        _ => Err(ApiError::invalid(format!(
            "pass at most one of {name} and {name}_b64"
        ))),
    }
}
