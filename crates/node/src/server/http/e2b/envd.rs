//! The sandbox API ("envd", port 49983): the `process.Process` and `filesystem.Filesystem`
//! Connect services, `GET`/`POST /files` and `GET /health`, each mapped onto agent requests
//! run as the request's user.

use std::collections::HashMap;
use std::sync::Mutex;

use dsec_api::agent::{FileKind, FileStat, FsOp, ProcInfo};
use dsec_api::exec::{Command as ExecCommand, ExecStatus, PtySize, MAX_OUTPUT_LIMIT};

use super::connect::*;
use super::*;
use crate::lifecycle::Follow;

/// Dispatches one request of sandbox traffic to the sandbox API.
pub(super) async fn serve(t: Target, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let path = parts.uri.path().to_owned();
    let limit = if path == "/files" {
        MAX_BODY
    } else {
        MAX_MESSAGE
    };
    let body = match axum::body::to_bytes(body, limit).await {
        Ok(b) => b,
        Err(e) => return e2b_error(StatusCode::PAYLOAD_TOO_LARGE, e.to_string()),
    };
    let q: FilesQuery = Query::try_from_uri(&parts.uri)
        .map(|Query(q)| q)
        .unwrap_or_default();
    let h = &parts.headers;
    match (parts.method.as_str(), path.as_str()) {
        ("GET", "/health") => StatusCode::NO_CONTENT.into_response(),
        ("GET", "/files") => files_read(t, &q).await,
        ("POST", "/files") => files_write(t, &q, h, body).await,
        ("POST", p) if p.starts_with("/process.Process/") => {
            process(t, &p["/process.Process/".len()..], h, body).await
        }
        ("POST", p) if p.starts_with("/filesystem.Filesystem/") => {
            filesystem(t, &p["/filesystem.Filesystem/".len()..], h, body).await
        }
        _ => e2b_error(StatusCode::NOT_FOUND, format!("no such endpoint {path}")),
    }
}

/// Follows `req` (a streaming spawn, an attach, a watch) on the target's sandbox.
async fn follow_start(t: &Target, req: AgentReq, body: Vec<u8>) -> Result<Follow, ApiError> {
    crate::lifecycle::follow(&t.entry, req, body)
        .await
        .map_err(ApiError::from)
}

/// The next event of a follower (`None`: none within `wait`); the agent's error answer as
/// `Err`.
async fn next_event(f: &mut Follow, wait: Duration) -> Option<Result<(Event, Vec<u8>), ApiError>> {
    match f.next(wait).await? {
        Ok((Event::Error { code, message }, _)) => Some(Err(ApiError::new(code, message))),
        Ok(ev) => Some(Ok(ev)),
        Err(e) => Some(Err(ApiError::from(e))),
    }
}

/// Runs one agent request on the sandbox.
async fn call(t: &Target, req: AgentReq, body: Vec<u8>) -> Result<Event, ApiError> {
    with_sandbox(&t.app, &t.entry, move |_, sb| {
        agent_event(sb, &req, &body, None)
    })
    .await
}

/// Runs one file request as the target's user.
async fn call_as(t: &Target, req: AgentReq, body: Vec<u8>) -> Result<Event, ApiError> {
    let req = AgentReq::AsUser {
        user: t.user.clone(),
        req: Box::new(req),
    };
    call(t, req, body).await
}

/// The home of `user` as E2B has it (relative paths and a command's default cwd).
fn home_of(user: &str) -> String {
    match user {
        "root" => "/root".to_owned(),
        u => format!("/home/{u}"),
    }
}

/// A path of a request: relative ones are under the user's home.
fn full_path(t: &Target, p: &str) -> String {
    if p.starts_with('/') {
        p.to_owned()
    } else if p.is_empty() {
        home_of(&t.user)
    } else {
        format!("{}/{p}", home_of(&t.user))
    }
}

// ---------------------------------------------------------------------------------------------
// process.Process

#[derive(Deserialize, Default)]
struct ProcessConfig {
    #[serde(default)]
    cmd: String,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    envs: BTreeMap<String, String>,
    #[serde(default)]
    cwd: Option<String>,
}

#[derive(Deserialize, Default)]
struct PtyMsg {
    #[serde(default)]
    size: Option<PtySizeMsg>,
}

#[derive(Deserialize, Default, Clone, Copy)]
struct PtySizeMsg {
    #[serde(default)]
    cols: u32,
    #[serde(default)]
    rows: u32,
}

impl PtySizeMsg {
    fn size(self) -> PtySize {
        PtySize {
            rows: self.rows.clamp(1, 4096) as u16,
            cols: self.cols.clamp(1, 4096) as u16,
        }
    }
}

#[derive(Deserialize, Default)]
struct StartRequest {
    #[serde(default)]
    process: ProcessConfig,
    #[serde(default)]
    pty: Option<PtyMsg>,
    #[serde(default)]
    tag: Option<String>,
    #[serde(default)]
    stdin: Option<bool>,
}

#[derive(Deserialize, Default)]
struct Selector {
    #[serde(default)]
    pid: Option<u32>,
    #[serde(default)]
    tag: Option<String>,
}

#[derive(Deserialize, Default)]
struct SelectorRequest {
    #[serde(default)]
    process: Selector,
    #[serde(default)]
    input: Option<InputMsg>,
    #[serde(default)]
    signal: Option<Value>,
    #[serde(default)]
    pty: Option<PtyMsg>,
}

#[derive(Deserialize, Default)]
struct InputMsg {
    #[serde(default)]
    stdin: Option<String>,
    #[serde(default)]
    pty: Option<String>,
}

async fn process(t: Target, method: &str, h: &axum::http::HeaderMap, body: Bytes) -> Response {
    match method {
        "Start" => match stream_request::<StartRequest>(&body) {
            Ok(r) => start(t, r, h).await,
            Err(e) => stream_error(e),
        },
        "Connect" => match stream_request::<SelectorRequest>(&body) {
            Ok(r) => match handle_of(&t, &r.process).await {
                Ok(handle) => {
                    follow_process(t, AgentReq::ProcAttach { handle }, Vec::new(), h).await
                }
                Err(e) => stream_error(e),
            },
            Err(e) => stream_error(e),
        },
        "StreamInput" => stream_input(t, &body).await,
        _ => unary(process_unary(&t, method, &body).await),
    }
}

async fn process_unary(t: &Target, method: &str, body: &[u8]) -> Result<Value, ConnectError> {
    match method {
        "List" => {
            let items = proc_list(t).await?;
            let processes: Vec<Value> = items.iter().map(process_info).collect();
            Ok(json!({"processes": processes}))
        }
        "SendInput" => {
            let r: SelectorRequest = unary_request(body)?;
            let handle = handle_of(t, &r.process).await?;
            let input = r.input.unwrap_or_default();
            let data = unb64(input.stdin.or(input.pty).as_deref().unwrap_or(""))?;
            call(t, AgentReq::ProcStdin { handle, eof: false }, data).await?;
            Ok(json!({}))
        }
        "CloseStdin" => {
            let r: SelectorRequest = unary_request(body)?;
            let handle = handle_of(t, &r.process).await?;
            call(t, AgentReq::ProcStdin { handle, eof: true }, Vec::new()).await?;
            Ok(json!({}))
        }
        "SendSignal" => {
            let r: SelectorRequest = unary_request(body)?;
            let handle = handle_of(t, &r.process).await?;
            let signal = match r.signal.as_ref() {
                Some(Value::String(s)) if s == "SIGNAL_SIGTERM" => libc::SIGTERM,
                Some(Value::Number(n)) if n.as_i64() == Some(15) => libc::SIGTERM,
                _ => libc::SIGKILL,
            };
            call(t, AgentReq::ProcSignal { handle, signal }, Vec::new()).await?;
            Ok(json!({}))
        }
        "Update" => {
            let r: SelectorRequest = unary_request(body)?;
            let handle = handle_of(t, &r.process).await?;
            if let Some(size) = r.pty.and_then(|p| p.size) {
                let size = size.size();
                call(t, AgentReq::ProcResize { handle, size }, Vec::new()).await?;
            }
            Ok(json!({}))
        }
        m => Err(ConnectError::new(
            "unimplemented",
            format!("process.Process/{m} is not served"),
        )),
    }
}

async fn proc_list(t: &Target) -> Result<Vec<ProcInfo>, ConnectError> {
    match call(t, AgentReq::ProcList, Vec::new()).await? {
        Event::Procs { items } => Ok(items),
        other => Err(ConnectError::new(
            "internal",
            format!("unexpected answer {other:?}"),
        )),
    }
}

fn process_info(p: &ProcInfo) -> Value {
    let (cmd, args) = match &p.command {
        ExecCommand::Argv(a) => (a[0].clone(), a[1..].to_vec()),
        ExecCommand::Shell(s) => ("/bin/sh".to_owned(), vec!["-c".to_owned(), s.clone()]),
    };
    let mut config = json!({"cmd": cmd, "args": args, "envs": p.env});
    if let Some(cwd) = &p.cwd {
        config["cwd"] = json!(cwd);
    }
    let mut v = json!({"pid": p.pid, "config": config});
    if let Some(tag) = &p.tag {
        v["tag"] = json!(tag);
    }
    v
}

/// The agent's handle of the process a selector names (by pid, or by tag).
async fn handle_of(t: &Target, sel: &Selector) -> Result<u64, ConnectError> {
    let items = proc_list(t).await?;
    items
        .iter()
        .find(|p| match (&sel.pid, &sel.tag) {
            (Some(pid), _) => i64::from(p.pid) == i64::from(*pid),
            (None, Some(tag)) => p.tag.as_deref() == Some(tag.as_str()),
            (None, None) => false,
        })
        .map(|p| p.handle)
        .ok_or_else(|| ConnectError::not_found("process not found"))
}

async fn start(t: Target, r: StartRequest, h: &axum::http::HeaderMap) -> Response {
    let c = r.process;
    if c.cmd.is_empty() {
        return stream_error(ConnectError::invalid("process.cmd is empty"));
    }
    let mut argv = vec![c.cmd];
    argv.extend(c.args);
    let mut env = t.entry.record().env.clone();
    env.extend(c.envs);
    let pty = r.pty.and_then(|p| p.size).map(PtySizeMsg::size);
    let mut req = dsec_api::exec::ExecRequest::argv(argv);
    req.env = env;
    req.cwd = Some(c.cwd.unwrap_or_else(|| home_of(&t.user)));
    req.user = Some(t.user.clone());
    req.tag = r.tag;
    req.stream = true;
    req.pty = pty;
    req.stdin_closed = pty.is_none() && !r.stdin.unwrap_or(false);
    // A long-lived process (a server the sandbox runs) keeps what it writes flowing; the
    // captures are only for the end event, which E2B does not read.
    req.output_limit = Some(MAX_OUTPUT_LIMIT);
    if let Err(e) = req.validate() {
        return stream_error(ConnectError::invalid(e));
    }
    follow_process(t, AgentReq::Spawn(req), Vec::new(), h).await
}

/// Streams a followed process (a streaming spawn, or an attach) as `start`, `data`…,
/// `end` events. The stream ending early (the client went, or its deadline passed) leaves
/// the process running.
async fn follow_process(
    t: Target,
    req: AgentReq,
    body: Vec<u8>,
    h: &axum::http::HeaderMap,
) -> Response {
    let pty = matches!(&req, AgentReq::Spawn(r) if r.pty.is_some());
    let mut f = match follow_start(&t, req, body).await {
        Ok(f) => f,
        Err(e) => return stream_error(e.into()),
    };
    let deadline = deadline(h);
    let every = keepalive(h);
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(16);
    tokio::spawn(async move {
        let mut pty = pty;
        let end = loop {
            let wait = match deadline {
                Some(d) => every.min(d.saturating_duration_since(tokio::time::Instant::now())),
                None => every,
            };
            let msg = match next_event(&mut f, wait).await {
                None if deadline.is_some_and(|d| tokio::time::Instant::now() >= d) => {
                    break Some(ConnectError::new(
                        "deadline_exceeded",
                        "the stream's deadline passed (the process goes on; connect to it again)",
                    ));
                }
                None => json!({"keepalive": {}}),
                Some(Err(e)) => break Some(e.into()),
                Some(Ok((Event::Attached { pid, .. }, _))) => json!({"start": {"pid": pid}}),
                Some(Ok((Event::Output { stream }, data))) => {
                    let key = match stream {
                        _ if pty => "pty",
                        dsec_api::exec::Stream::Stdout => "stdout",
                        dsec_api::exec::Stream::Stderr => "stderr",
                    };
                    json!({"data": {key: b64(&data)}})
                }
                Some(Ok((Event::ExecDone(r), _))) => {
                    let _ = tx
                        .send(envelope(0, &json!({"event": {"end": end_event(&r)}})))
                        .await;
                    pty = false;
                    break None;
                }
                Some(Ok((Event::Detached, _))) => break None,
                Some(Ok(_)) => continue,
            };
            if tx.send(envelope(0, &json!({"event": msg}))).await.is_err() {
                f.detach().await;
                return;
            }
        };
        let _ = pty;
        if end.is_some() {
            f.detach().await;
        }
        let _ = tx.send(end_stream(end.as_ref())).await;
    });
    stream_response(rx)
}

fn end_event(r: &dsec_api::exec::ExecResult) -> Value {
    match (r.exit_code, r.signal) {
        (Some(code), _) => {
            let mut v =
                json!({"exitCode": code, "exited": true, "status": format!("exit status {code}")});
            if r.status == ExecStatus::OutputLimit || r.status == ExecStatus::Oom {
                v["error"] = json!(format!("{:?}", r.status).to_lowercase());
            }
            v
        }
        (None, sig) => {
            let status = match sig {
                Some(9) | None => "signal: killed".to_owned(),
                Some(s) => format!("signal: {s}"),
            };
            json!({"exitCode": -1, "exited": false, "status": status, "error": status})
        }
    }
}

/// `StreamInput`: the request body is a sequence of envelopes (`start` naming the process,
/// then `data`), each written to the process's stdin as read.
async fn stream_input(t: Target, body: &[u8]) -> Response {
    let run = async {
        let mut handle = None;
        let mut rest = body;
        while rest.len() >= 5 {
            let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
            let msg = rest
                .get(5..5 + len)
                .ok_or_else(|| ConnectError::invalid("truncated envelope"))?;
            rest = &rest[5 + len..];
            let v: Value = unary_request(msg)?;
            if let Some(start) = v.get("start") {
                let sel: Selector =
                    serde_json::from_value(start.get("process").cloned().unwrap_or_default())
                        .map_err(|e| ConnectError::invalid(e.to_string()))?;
                handle = Some(handle_of(&t, &sel).await?);
            } else if let Some(data) = v.get("data") {
                let h = handle.ok_or_else(|| ConnectError::invalid("data before start"))?;
                let input: InputMsg =
                    serde_json::from_value(data.get("input").cloned().unwrap_or_default())
                        .map_err(|e| ConnectError::invalid(e.to_string()))?;
                let bytes = unb64(input.stdin.or(input.pty).as_deref().unwrap_or(""))?;
                call(
                    &t,
                    AgentReq::ProcStdin {
                        handle: h,
                        eof: false,
                    },
                    bytes,
                )
                .await?;
            }
        }
        Ok::<(), ConnectError>(())
    };
    let (tx, rx) = tokio::sync::mpsc::channel(2);
    match run.await {
        Ok(()) => {
            let _ = tx.try_send(envelope(0, &json!({})));
            let _ = tx.try_send(end_stream(None));
        }
        Err(e) => {
            let _ = tx.try_send(end_stream(Some(&e)));
        }
    }
    stream_response(rx)
}

// ---------------------------------------------------------------------------------------------
// filesystem.Filesystem

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct FsRequest {
    #[serde(default)]
    path: String,
    #[serde(default)]
    depth: Option<u32>,
    #[serde(default)]
    source: String,
    #[serde(default)]
    destination: String,
    #[serde(default)]
    recursive: bool,
    #[serde(default, alias = "watcher_id")]
    watcher_id: String,
}

/// `EntryInfo` of a stat at `path`.
fn entry_info(path: &str, st: &FileStat) -> Value {
    let (ty, ch) = match st.kind {
        FileKind::Dir => ("FILE_TYPE_DIRECTORY", 'd'),
        FileKind::Symlink => ("FILE_TYPE_FILE", 'l'),
        _ => ("FILE_TYPE_FILE", '-'),
    };
    let mut perms = String::with_capacity(10);
    perms.push(ch);
    for shift in [6, 3, 0] {
        let bits = (st.mode >> shift) & 7;
        perms.push(if bits & 4 != 0 { 'r' } else { '-' });
        perms.push(if bits & 2 != 0 { 'w' } else { '-' });
        perms.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    let name = path
        .rsplit('/')
        .next()
        .filter(|n| !n.is_empty())
        .unwrap_or("/");
    let mut v = json!({
        "name": name,
        "type": ty,
        "path": path,
        "size": st.size,
        "mode": st.mode,
        "permissions": perms,
        "owner": st.owner.clone().unwrap_or_else(|| st.uid.to_string()),
        "group": st.group.clone().unwrap_or_else(|| st.gid.to_string()),
        "modifiedTime": crate::clock::rfc3339(u64::try_from(st.mtime).unwrap_or(0) * 1000),
    });
    if let Some(target) = &st.link_target {
        v["symlinkTarget"] = json!(target);
        v["isSymlink"] = json!(true);
    }
    v
}

async fn stat(t: &Target, path: &str) -> Result<FileStat, ConnectError> {
    match call_as(
        t,
        AgentReq::FileStat {
            path: path.to_owned(),
        },
        Vec::new(),
    )
    .await?
    {
        Event::Stat(st) => Ok(st),
        other => Err(ConnectError::new(
            "internal",
            format!("unexpected {other:?}"),
        )),
    }
}

async fn filesystem(t: Target, method: &str, h: &axum::http::HeaderMap, body: Bytes) -> Response {
    if method == "WatchDir" {
        return match stream_request::<FsRequest>(&body) {
            Ok(r) => watch_dir(t, r, h).await,
            Err(e) => stream_error(e),
        };
    }
    unary(filesystem_unary(&t, method, &body).await)
}

async fn filesystem_unary(t: &Target, method: &str, body: &[u8]) -> Result<Value, ConnectError> {
    let r: FsRequest = unary_request(body)?;
    let path = full_path(t, &r.path);
    match method {
        "Stat" => Ok(json!({"entry": entry_info(&path, &stat(t, &path).await?)})),
        "ListDir" => {
            let depth = r.depth.unwrap_or(1).clamp(1, 64);
            let mut entries = Vec::new();
            list_into(t, &path, depth, &mut entries).await?;
            Ok(json!({"entries": entries}))
        }
        "MakeDir" => {
            if stat(t, &path).await.is_ok() {
                return Err(ConnectError::new(
                    "already_exists",
                    format!("{path} already exists"),
                ));
            }
            let req = AgentReq::Mkdir {
                path: path.clone(),
                parents: true,
                mode: None,
            };
            call_as(t, req, Vec::new()).await?;
            Ok(json!({"entry": entry_info(&path, &stat(t, &path).await?)}))
        }
        "Remove" => {
            let req = AgentReq::Remove {
                path,
                recursive: true,
            };
            call_as(t, req, Vec::new()).await?;
            Ok(json!({}))
        }
        "Move" => {
            let (from, to) = (full_path(t, &r.source), full_path(t, &r.destination));
            call_as(
                t,
                AgentReq::FileRename {
                    from,
                    to: to.clone(),
                },
                Vec::new(),
            )
            .await?;
            Ok(json!({"entry": entry_info(&to, &stat(t, &to).await?)}))
        }
        "CreateWatcher" => {
            let id = watchers::create(t, &path, r.recursive).await?;
            Ok(json!({"watcherId": id}))
        }
        "GetWatcherEvents" => Ok(json!({"events": watchers::drain(t, &r.watcher_id)?})),
        "RemoveWatcher" => {
            watchers::remove(t, &r.watcher_id).await?;
            Ok(json!({}))
        }
        m => Err(ConnectError::new(
            "unimplemented",
            format!("filesystem.Filesystem/{m} is not served"),
        )),
    }
}

/// Lists `dir` into `out`, descending `depth - 1` more levels (at most 10,000 entries).
async fn list_into(
    t: &Target,
    dir: &str,
    depth: u32,
    out: &mut Vec<Value>,
) -> Result<(), ConnectError> {
    let entries = match call_as(
        t,
        AgentReq::FileList {
            path: dir.to_owned(),
        },
        Vec::new(),
    )
    .await?
    {
        Event::Listing { entries } => entries,
        other => {
            return Err(ConnectError::new(
                "internal",
                format!("unexpected {other:?}"),
            ))
        }
    };
    for st in entries {
        if out.len() >= 10_000 {
            break;
        }
        let path = format!("{}/{}", dir.trim_end_matches('/'), st.name);
        out.push(entry_info(&path, &st));
        if depth > 1 && st.kind == FileKind::Dir {
            Box::pin(list_into(t, &path, depth - 1, out)).await?;
        }
    }
    Ok(())
}

fn event_type(op: FsOp) -> &'static str {
    match op {
        FsOp::Create => "EVENT_TYPE_CREATE",
        FsOp::Write => "EVENT_TYPE_WRITE",
        FsOp::Remove => "EVENT_TYPE_REMOVE",
        FsOp::Rename => "EVENT_TYPE_RENAME",
        FsOp::Chmod => "EVENT_TYPE_CHMOD",
    }
}

fn watch_request(t: &Target, path: &str, recursive: bool) -> AgentReq {
    AgentReq::AsUser {
        user: t.user.clone(),
        req: Box::new(AgentReq::Watch {
            path: path.to_owned(),
            recursive,
        }),
    }
}

/// `WatchDir` (the async SDK): `start`, then `filesystem` events as they come.
async fn watch_dir(t: Target, r: FsRequest, h: &axum::http::HeaderMap) -> Response {
    let path = full_path(&t, &r.path);
    let mut f = match follow_start(&t, watch_request(&t, &path, r.recursive), Vec::new()).await {
        Ok(f) => f,
        Err(e) => return stream_error(e.into()),
    };
    let every = keepalive(h);
    let deadline = deadline(h);
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(16);
    tokio::spawn(async move {
        let mut end = None;
        loop {
            let wait = match deadline {
                Some(d) => every.min(d.saturating_duration_since(tokio::time::Instant::now())),
                None => every,
            };
            let msgs: Vec<Value> = match next_event(&mut f, wait).await {
                None if deadline.is_some_and(|d| tokio::time::Instant::now() >= d) => break,
                None => vec![json!({"keepalive": {}})],
                Some(Ok((Event::Watching, _))) => vec![json!({"start": {}})],
                Some(Ok((Event::FsEvents { events }, _))) => events
                    .iter()
                    .map(|e| json!({"filesystem": {"name": e.name, "type": event_type(e.op)}}))
                    .collect(),
                Some(Ok((Event::Detached, _))) => break,
                Some(Ok(_)) => continue,
                Some(Err(e)) => {
                    end = Some(ConnectError::from(e));
                    break;
                }
            };
            for m in msgs {
                if tx.send(envelope(0, &m)).await.is_err() {
                    f.detach().await;
                    return;
                }
            }
        }
        f.detach().await;
        let _ = tx.send(end_stream(end.as_ref())).await;
    });
    stream_response(rx)
}

/// Polled watchers (`CreateWatcher`/`GetWatcherEvents`/`RemoveWatcher`, the sync SDK): a
/// follower task per watcher collects events until they are taken (at most 10,000 kept).
mod watchers {
    use super::*;

    struct Watcher {
        sandbox: String,
        events: Vec<Value>,
        stop: Option<tokio::sync::oneshot::Sender<()>>,
    }

    static WATCHERS: Mutex<Option<HashMap<String, Watcher>>> = Mutex::new(None);
    /// Most watchers per sandbox (its agent holds at most 64 watches anyway).
    const MAX_WATCHERS: usize = 64;
    const MAX_EVENTS: usize = 10_000;

    fn with<T>(f: impl FnOnce(&mut HashMap<String, Watcher>) -> T) -> T {
        let mut g = WATCHERS.lock().unwrap_or_else(|p| p.into_inner());
        f(g.get_or_insert_with(HashMap::new))
    }

    pub(super) async fn create(
        t: &Target,
        path: &str,
        recursive: bool,
    ) -> Result<String, ConnectError> {
        // Watchers of sandboxes that are gone go first.
        let node = Arc::clone(&t.app.node);
        let mine = with(|m| {
            m.retain(|_, w| node.entry(&w.sandbox).is_some());
            m.values().filter(|w| w.sandbox == t.id()).count()
        });
        if mine >= MAX_WATCHERS {
            return Err(ConnectError::new(
                "resource_exhausted",
                format!("a sandbox has at most {MAX_WATCHERS} watchers"),
            ));
        }
        let mut f = follow_start(t, watch_request(t, path, recursive), Vec::new())
            .await
            .map_err(ConnectError::from)?;
        // The watch is in place once the agent says so.
        match next_event(&mut f, Duration::from_secs(10)).await {
            Some(Ok((Event::Watching, _))) => {}
            Some(Err(e)) => return Err(e.into()),
            _ => {
                f.detach().await;
                return Err(ConnectError::new("internal", "the watch did not start"));
            }
        }
        let mut raw = [0u8; 12];
        getrandom::fill(&mut raw).map_err(|e| ConnectError::new("internal", e.to_string()))?;
        let id = hex::encode(raw);
        let (stop_tx, mut stop_rx) = tokio::sync::oneshot::channel();
        with(|m| {
            m.insert(
                id.clone(),
                Watcher {
                    sandbox: t.id().to_owned(),
                    events: Vec::new(),
                    stop: Some(stop_tx),
                },
            )
        });
        let key = id.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = &mut stop_rx => break,
                    ev = next_event(&mut f, Duration::from_secs(60)) => match ev {
                        None => continue,
                        Some(Ok((Event::FsEvents { events }, _))) => with(|m| {
                            if let Some(w) = m.get_mut(&key) {
                                for e in events {
                                    if w.events.len() < MAX_EVENTS {
                                        w.events.push(json!({"name": e.name, "type": event_type(e.op)}));
                                    }
                                }
                            }
                        }),
                        Some(Ok(_)) => continue,
                        Some(Err(_)) => break,
                    },
                }
            }
            f.detach().await;
        });
        Ok(id)
    }

    pub(super) fn drain(t: &Target, id: &str) -> Result<Vec<Value>, ConnectError> {
        with(|m| match m.get_mut(id) {
            Some(w) if w.sandbox == t.id() => Ok(std::mem::take(&mut w.events)),
            _ => Err(ConnectError::not_found(format!("no watcher {id}"))),
        })
    }

    pub(super) async fn remove(t: &Target, id: &str) -> Result<(), ConnectError> {
        let w = with(|m| match m.get(id) {
            Some(w) if w.sandbox == t.id() => m.remove(id),
            _ => None,
        });
        match w {
            Some(mut w) => {
                if let Some(s) = w.stop.take() {
                    let _ = s.send(());
                }
                Ok(())
            }
            None => Err(ConnectError::not_found(format!("no watcher {id}"))),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// /files

/// The query of `/files`, decoded by the router's query parser.
#[derive(Deserialize, Default)]
struct FilesQuery {
    #[serde(default)]
    path: Option<String>,
    #[serde(default)]
    username: Option<String>,
}

/// The E2B error answer of a failed file request.
fn files_error(e: ApiError) -> Response {
    let status = ApiError::status_of(e.code);
    e2b_error(status, e.detail)
}

fn user_for(t: &Target, q: &FilesQuery) -> Target {
    let mut t = t.clone();
    if let Some(u) = q.username.clone().filter(|u| !u.is_empty()) {
        t.user = u;
    }
    t
}

async fn files_read(t: Target, q: &FilesQuery) -> Response {
    let t = user_for(&t, q);
    let Some(path) = q.path.clone() else {
        return e2b_error(StatusCode::BAD_REQUEST, "path is required");
    };
    let path = full_path(&t, &path);
    let req = AgentReq::AsUser {
        user: t.user.clone(),
        req: Box::new(AgentReq::FileRead {
            path,
            max_bytes: Some(MAX_READ),
        }),
    };
    let r = with_sandbox(&t.app, &t.entry, move |_, sb| {
        sb.agent()
            .call_data(&req, MAX_READ as usize)
            .map_err(ApiError::from)
    })
    .await;
    match r {
        Ok(data) => octet(data, "application/octet-stream"),
        Err(e) => files_error(e),
    }
}

async fn files_write(
    t: Target,
    q: &FilesQuery,
    h: &axum::http::HeaderMap,
    body: Bytes,
) -> Response {
    let t = user_for(&t, q);
    let ctype = header_str(h, "content-type").unwrap_or("").to_owned();
    let files: Vec<(String, Bytes)> = if ctype.starts_with("multipart/form-data") {
        match super::multipart::parse(&ctype, &body) {
            Ok(parts) => parts
                .into_iter()
                .filter(|p| p.name == "file")
                .map(|p| {
                    (
                        p.filename.or_else(|| q.path.clone()).unwrap_or_default(),
                        p.data,
                    )
                })
                .collect(),
            Err(e) => return e2b_error(StatusCode::BAD_REQUEST, e),
        }
    } else {
        vec![(q.path.clone().unwrap_or_default(), body)]
    };
    if files.is_empty() || files.iter().any(|(p, _)| p.is_empty()) {
        return e2b_error(StatusCode::BAD_REQUEST, "every file needs a path");
    }
    let mut out = Vec::with_capacity(files.len());
    for (path, data) in files {
        let path = full_path(&t, &path);
        let req = AgentReq::FileWrite {
            path: path.clone(),
            mode: None,
            parents: true,
        };
        if let Err(e) = call_as(&t, req, data.to_vec()).await {
            return files_error(e);
        }
        let name = path.rsplit('/').next().unwrap_or("").to_owned();
        out.push(json!({"name": name, "type": "file", "path": path}));
    }
    Json(out).into_response()
}
