//! The Connect protocol as the E2B SDK speaks it, JSON codec only: unary calls (a JSON body
//! in, `application/json` out) and server streams (one enveloped message in; envelopes of
//! `flags(1) | length(4, big-endian) | JSON` out, always ended by an end-of-stream envelope,
//! flag `0x02`, carrying `{}` or `{"error": {"code", "message"}}`).

use super::*;

/// Largest request message accepted (an enveloped stream request or a unary body).
pub(super) const MAX_MESSAGE: usize = 8 << 20;
/// Envelope flag of the end-of-stream message.
const END_STREAM: u8 = 0x02;

/// A Connect error code (the protocol's names) with its message.
#[derive(Debug, Clone)]
pub(super) struct ConnectError {
    pub(super) code: &'static str,
    pub(super) message: String,
}

impl ConnectError {
    pub(super) fn new(code: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    pub(super) fn invalid(message: impl Into<String>) -> Self {
        Self::new("invalid_argument", message)
    }

    pub(super) fn not_found(message: impl Into<String>) -> Self {
        Self::new("not_found", message)
    }

    fn status(&self) -> StatusCode {
        match self.code {
            "invalid_argument" | "failed_precondition" | "out_of_range" => StatusCode::BAD_REQUEST,
            "unauthenticated" => StatusCode::UNAUTHORIZED,
            "permission_denied" => StatusCode::FORBIDDEN,
            "not_found" => StatusCode::NOT_FOUND,
            "already_exists" | "aborted" => StatusCode::CONFLICT,
            "resource_exhausted" => StatusCode::TOO_MANY_REQUESTS,
            "unimplemented" => StatusCode::NOT_IMPLEMENTED,
            "unavailable" => StatusCode::SERVICE_UNAVAILABLE,
            "deadline_exceeded" => StatusCode::GATEWAY_TIMEOUT,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn json(&self) -> Value {
        json!({"code": self.code, "message": self.message})
    }
}

impl From<ApiError> for ConnectError {
    fn from(e: ApiError) -> Self {
        use ErrorCode as C;
        let code = match e.code {
            C::InvalidRequest | C::PathEscape | C::WrongFileType | C::SpawnFailed => {
                "invalid_argument"
            }
            C::Unauthorized => "unauthenticated",
            C::Forbidden | C::PermissionDenied => "permission_denied",
            C::NotFound | C::HandleNotFound | C::SandboxNotFound => "not_found",
            C::TooLarge | C::NoSpace | C::QuotaExceeded | C::ResourceExhausted => {
                "resource_exhausted"
            }
            C::ExecTimeout => "deadline_exceeded",
            C::AgentUnavailable | C::Draining | C::Unavailable => "unavailable",
            C::InvalidTransition => "failed_precondition",
            _ => "internal",
        };
        Self::new(code, e.detail)
    }
}

/// A unary answer: 200 `application/json`, or the error with its status.
pub(super) fn unary(r: Result<Value, ConnectError>) -> Response {
    match r {
        Ok(v) => Json(v).into_response(),
        Err(e) => (e.status(), Json(e.json())).into_response(),
    }
}

/// Parses a unary request body.
pub(super) fn unary_request<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, ConnectError> {
    let src: &[u8] = if body.is_empty() { b"{}" } else { body };
    serde_json::from_slice(src).map_err(|e| ConnectError::invalid(format!("bad message: {e}")))
}

/// Parses the one enveloped message of a server-stream request.
pub(super) fn stream_request<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, ConnectError> {
    if body.len() < 5 {
        return Err(ConnectError::invalid("the request has no envelope"));
    }
    if body[0] & 0x01 != 0 {
        return Err(ConnectError::new(
            "unimplemented",
            "compressed messages are not supported",
        ));
    }
    let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
    let msg = body
        .get(5..5 + len)
        .ok_or_else(|| ConnectError::invalid("the envelope is longer than the body"))?;
    unary_request(msg)
}

/// One envelope.
pub(super) fn envelope(flags: u8, msg: &Value) -> Bytes {
    let json = serde_json::to_vec(msg).unwrap_or_else(|_| b"{}".to_vec());
    let mut out = Vec::with_capacity(json.len() + 5);
    out.push(flags);
    out.extend_from_slice(&(json.len() as u32).to_be_bytes());
    out.extend_from_slice(&json);
    Bytes::from(out)
}

/// The end-of-stream envelope.
pub(super) fn end_stream(err: Option<&ConnectError>) -> Bytes {
    match err {
        None => envelope(END_STREAM, &json!({})),
        Some(e) => envelope(END_STREAM, &json!({"error": e.json()})),
    }
}

/// A server-stream answer whose envelopes come from `rx` (the producer ends them with
/// [`end_stream`]).
pub(super) fn stream_response(rx: tokio::sync::mpsc::Receiver<Bytes>) -> Response {
    let body = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx))
    });
    let mut resp = Response::new(Body::from_stream(body));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/connect+json"),
    );
    resp
}

/// A stream that failed before its first message: the error in its end-of-stream envelope
/// (the canonical Connect form, which both SDK generations accept).
pub(super) fn stream_error(e: ConnectError) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    let _ = tx.try_send(end_stream(Some(&e)));
    stream_response(rx)
}

/// The stream's deadline from `Connect-Timeout-Ms`, if any.
pub(super) fn deadline(headers: &axum::http::HeaderMap) -> Option<tokio::time::Instant> {
    let ms: u64 = headers
        .get("connect-timeout-ms")?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Some(tokio::time::Instant::now() + Duration::from_millis(ms.min(MAX_WAIT_MS * 1000)))
}

/// The keepalive interval from `Keepalive-Ping-Interval` (seconds), 50 s by default.
pub(super) fn keepalive(headers: &axum::http::HeaderMap) -> Duration {
    let s: u64 = headers
        .get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(50);
    Duration::from_secs(s.clamp(1, 3600))
}

/// Standard base64 (the proto3 JSON form of `bytes`).
pub(super) fn b64(data: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(data)
}

/// Decodes proto3 JSON `bytes` (standard or URL-safe base64, padded or not).
pub(super) fn unb64(s: &str) -> Result<Vec<u8>, ConnectError> {
    use base64::engine::general_purpose::{STANDARD, URL_SAFE};
    STANDARD
        .decode(s)
        .or_else(|_| URL_SAFE.decode(s))
        .or_else(|_| {
            base64::engine::general_purpose::STANDARD_NO_PAD.decode(s.trim_end_matches('='))
        })
        .or_else(|_| {
            base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(s.trim_end_matches('='))
        })
        .map_err(|_| ConnectError::invalid("bad base64"))
}
