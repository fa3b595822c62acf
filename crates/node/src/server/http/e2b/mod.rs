//! The E2B-compatible API (docs/e2b.md): the official `e2b` and `e2b-code-interpreter` SDKs
//! work against a node unchanged, switched by `E2B_API_URL`, `E2B_SANDBOX_URL` and
//! `E2B_API_KEY`.
//!
//! Two parts share the node's listener. The control plane (`/sandboxes…`, `/v2/sandboxes…`)
//! authenticates by API key like `/v1` and answers errors as `{"code": <status>, "message"}`.
//! Sandbox traffic — what the SDK sends to the sandbox's own API ("envd", port 49983) and to
//! its code interpreter (port 49999) — carries the sandbox in headers instead
//! (`E2b-Sandbox-Id`, `E2b-Sandbox-Port`, or only the sandbox's access token) and is
//! dispatched by [`sandbox_traffic`] before any `/v1` route. Both translate onto the node's
//! own lifecycle and agent requests; nothing here runs a process or touches a file itself.

use super::*;

mod connect;
mod control;
mod envd;
mod interp;
mod multipart;
mod port;

pub(super) use control::*;

/// The envd version reported: the SDK gates features by it (docs/e2b.md lists what each
/// gate needs); everything up to it is served.
pub(super) const ENVD_VERSION: &str = "0.5.7";
/// The sandbox API's port in the SDK's `E2b-Sandbox-Port`.
const ENVD_PORT: u16 = 49983;
/// The code interpreter's port.
const INTERP_PORT: u16 = 49999;
/// The user of sandbox requests that name none (E2B's default).
pub(super) const DEFAULT_USER: &str = "user";
/// Its uid (made in every sandbox created through this API).
pub(super) const DEFAULT_UID: u32 = 1000;
/// Label holding the template name the sandbox was asked with.
const TEMPLATE_LABEL: &str = "e2b.template";
/// Label marking a paused sandbox.
const PAUSED_LABEL: &str = "e2b.paused";
/// Prefix of the labels this API keeps for itself (left out of `metadata`).
const OWN_LABELS: &str = "e2b.";

/// Whether `path` is one of the control plane's.
pub(super) fn is_control_path(path: &str) -> bool {
    path == "/sandboxes"
        || path.starts_with("/sandboxes/")
        || path == "/v2/sandboxes"
        || path.starts_with("/v2/sandboxes/")
}

/// The access token of sandbox `id`: its id and a MAC of it under the node's secret, so a
/// token names its sandbox (the SDK of 2.7–2.25 sends nothing else after a reconnect, and a
/// gateway routes it without a lookup) and only the node can make one.
pub(super) fn access_token(app: &AppState, id: &str) -> String {
    let mut h = Sha256::new();
    h.update(secret(app));
    h.update(b"e2b-access-token\0");
    h.update(id.as_bytes());
    format!("{id}.{}", &hex::encode(h.finalize())[..32])
}

/// The node's secret for access tokens: 32 random bytes in `<data_dir>/e2b.secret` (0600),
/// made on first use, so tokens outlive a restart.
fn secret(app: &AppState) -> &'static [u8; 32] {
    static SECRET: std::sync::OnceLock<[u8; 32]> = std::sync::OnceLock::new();
    SECRET.get_or_init(|| {
        let path = app.node.rt.config().data_dir.join("e2b.secret");
        if let Ok(b) = std::fs::read(&path) {
            if let Ok(k) = <[u8; 32]>::try_from(b.as_slice()) {
                return k;
            }
        }
        let mut k = [0u8; 32];
        getrandom::fill(&mut k).expect("the kernel's random source");
        use std::io::Write as _;
        use std::os::unix::fs::OpenOptionsExt as _;
        let tmp = path.with_extension("tmp");
        let written = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .and_then(|mut f| f.write_all(&k).and_then(|()| f.sync_all()))
            .and_then(|()| std::fs::rename(&tmp, &path));
        if let Err(e) = written {
            tracing::warn!(error = %e, "e2b.secret not saved: access tokens change at restart");
        }
        k
    })
}

/// The sandbox a token names, if the token is the node's.
fn token_sandbox(app: &AppState, token: &str) -> Option<String> {
    let (id, _) = token.split_once('.')?;
    let expected = access_token(app, id);
    // Constant-time comparison of equal-length strings.
    let same = expected.len() == token.len()
        && expected
            .bytes()
            .zip(token.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0;
    same.then(|| id.to_owned())
}

/// An E2B error answer: `{"code": <status>, "message"}`.
pub(super) fn e2b_error(status: StatusCode, message: impl Into<String>) -> Response {
    dsec_cluster::gateway::e2b::error(status, message)
}

/// The answer for a sandbox that is gone (the SDK reads "was not found" on a 502 as "not
/// running").
fn not_running(id: &str) -> Response {
    e2b_error(
        StatusCode::BAD_GATEWAY,
        format!("The sandbox {id} was not found"),
    )
}

/// The sandbox a request of sandbox traffic is for, as the handlers get it.
#[derive(Clone)]
pub(super) struct Target {
    pub(super) app: AppState,
    pub(super) entry: Arc<Entry>,
    /// The user the request runs as (`Authorization: Basic base64("<user>:")`, else
    /// [`DEFAULT_USER`]).
    pub(super) user: String,
}

impl Target {
    pub(super) fn id(&self) -> &str {
        &self.entry.id
    }
}

/// `<port>-<id>.<domain>` in `Host`, for deployments with wildcard DNS.
fn host_target(headers: &axum::http::HeaderMap) -> Option<(u16, String)> {
    let host = headers.get(header::HOST)?.to_str().ok()?;
    let first = host.split('.').next()?;
    let (port, id) = first.split_once('-')?;
    let port = port.parse().ok()?;
    crate::substrate::valid_id(id).then(|| (port, id.to_owned()))
}

fn header_str<'a>(headers: &'a axum::http::HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// The user named by `Authorization: Basic base64("<user>:")`.
fn basic_user(headers: &axum::http::HeaderMap) -> Option<String> {
    let v = header_str(headers, "authorization")?.strip_prefix("Basic ")?;
    let raw = base64::engine::general_purpose::STANDARD
        .decode(v.trim())
        .ok()?;
    let s = String::from_utf8(raw).ok()?;
    let user = s.split(':').next()?.to_owned();
    (!user.is_empty()).then_some(user)
}

/// Outermost middleware: dispatches sandbox traffic (by `E2b-Sandbox-Id`, `Host`, or the
/// access token) to the sandbox API or the code interpreter, and gives the control plane's
/// errors E2B's shape. Everything else goes on to the `/v1` router untouched.
pub(super) async fn sandbox_traffic(
    AxState(app): AxState<AppState>,
    req: Request,
    next: Next,
) -> Response {
    let path = req.uri().path().to_owned();
    if is_control_path(&path) {
        return dsec_cluster::gateway::e2b::e2b_shape(next.run(req).await).await;
    }
    let headers = req.headers();
    let by_header = header_str(headers, "e2b-sandbox-id").map(str::to_owned);
    let token = header_str(headers, "x-access-token").map(str::to_owned);
    let by_host = host_target(headers);
    if by_header.is_none() && token.is_none() && by_host.is_none() {
        return next.run(req).await;
    }
    let port = header_str(headers, "e2b-sandbox-port")
        .and_then(|p| p.trim().parse::<u16>().ok())
        .or(by_host.as_ref().map(|(p, _)| *p))
        .unwrap_or(ENVD_PORT);
    let id = match by_header
        .or(by_host.map(|(_, id)| id))
        .or_else(|| token.as_deref().and_then(|t| token_sandbox(&app, t)))
    {
        Some(id) => id,
        None => return e2b_error(StatusCode::UNAUTHORIZED, "invalid access token"),
    };
    // The code interpreter's context calls carry no token (the SDK sends it on /execute
    // only); everything else must.
    let tokenless_ok = port == INTERP_PORT && path.starts_with("/contexts");
    match token.as_deref() {
        Some(t) if token_sandbox(&app, t).as_deref() == Some(id.as_str()) => {}
        None if tokenless_ok => {}
        _ => {
            return e2b_error(
                StatusCode::UNAUTHORIZED,
                "missing or wrong X-Access-Token for this sandbox",
            )
        }
    }
    let Some(entry) = app.node.entry(&id) else {
        return not_running(&id);
    };
    let rec = entry.record();
    if rec.state != State::Running || rec.labels.contains_key(PAUSED_LABEL) {
        return not_running(&id);
    }
    let user = basic_user(req.headers()).unwrap_or_else(|| DEFAULT_USER.to_owned());
    let target = Target { app, entry, user };
    match port {
        ENVD_PORT => envd::serve(target, req).await,
        INTERP_PORT => interp::serve(target, req).await,
        _ => port::serve(target, port, req).await,
    }
}
