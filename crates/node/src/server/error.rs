//! API errors: every failure leaves the node as `application/problem+json` with a stable code.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use dsec_api::ErrorCode;

use crate::agent_client::AgentError;
use crate::substrate::RuntimeError;

use crate::lifecycle;
use crate::log::request_id;
use crate::store::StoreError;

/// A failed API call.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// Stable code.
    pub code: ErrorCode,
    /// Human-readable detail.
    pub detail: String,
    /// Seconds after which a retry may succeed (`Retry-After`).
    pub retry_after: Option<u64>,
}

pub use dsec_api::problem::Problem;

impl ApiError {
    /// An error with a code and a detail.
    pub fn new(code: ErrorCode, detail: impl Into<String>) -> Self {
        Self {
            code,
            detail: detail.into(),
            retry_after: None,
        }
    }

    /// `invalid_request`.
    pub fn invalid(detail: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidRequest, detail)
    }

    /// `sandbox_not_found`.
    pub fn no_sandbox(id: &str) -> Self {
        Self::new(
            ErrorCode::SandboxNotFound,
            format!("no sandbox {}", id.chars().take(80).collect::<String>()),
        )
    }

    /// `internal`.
    pub fn internal(detail: impl Into<String>) -> Self {
        Self::new(ErrorCode::Internal, detail)
    }

    /// The HTTP status of a code.
    pub fn status_of(code: ErrorCode) -> StatusCode {
        use ErrorCode::*;
        match code {
            InvalidRequest | PathEscape | WrongFileType | SpawnFailed | TemplateInvalid
            | UnsupportedVersion => StatusCode::BAD_REQUEST,
            Unauthorized => StatusCode::UNAUTHORIZED,
            Forbidden | PermissionDenied => StatusCode::FORBIDDEN,
            NotFound | SandboxNotFound | TemplateNotFound | HandleNotFound | TrajectoryNotFound
            | SnapshotNotFound => StatusCode::NOT_FOUND,
            InvalidTransition | IdempotencyConflict | UnknownOutcome | TrajectoryDiverged => {
                StatusCode::CONFLICT
            }
            MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            QuotaExceeded => StatusCode::TOO_MANY_REQUESTS,
            ResourceExhausted | Draining | Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            NodeLost => StatusCode::GONE,
            ExecTimeout => StatusCode::GATEWAY_TIMEOUT,
            AgentUnavailable => StatusCode::BAD_GATEWAY,
            NoSpace => StatusCode::INSUFFICIENT_STORAGE,
            Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The problem document of this error.
    pub fn problem(&self) -> Problem {
        let status = Self::status_of(self.code);
        Problem {
            kind: format!("https://dsec.dev/errors/{}", self.code.as_str()),
            title: self.code.as_str().replace('_', " "),
            status: status.as_u16(),
            code: self.code,
            detail: self.detail.clone(),
            request_id: request_id(),
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code, self.detail)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let p = self.problem();
        let body = serde_json::to_vec(&p).unwrap_or_default();
        let mut resp = (Self::status_of(self.code), body).into_response();
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(s) = self.retry_after {
            if let Ok(v) = HeaderValue::from_str(&s.to_string()) {
                resp.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        resp
    }
}

impl From<lifecycle::Error> for ApiError {
    fn from(e: lifecycle::Error) -> Self {
        use lifecycle::Error as E;
        let detail = e.detail();
        let code = match e {
            E::Store(s) => return Self::from(s),
            E::Draining => {
                return Self {
                    retry_after: Some(5),
                    ..Self::new(ErrorCode::Draining, detail)
                };
            }
            E::Unavailable(_) => {
                return Self {
                    retry_after: Some(1),
                    ..Self::new(ErrorCode::Unavailable, detail)
                };
            }
            E::Full(_) => {
                return Self {
                    retry_after: Some(1),
                    ..Self::new(ErrorCode::ResourceExhausted, detail)
                };
            }
            E::NotFound(_) => ErrorCode::SandboxNotFound,
            E::SnapshotNotFound(_) => ErrorCode::SnapshotNotFound,
            E::Invalid(_) => ErrorCode::InvalidRequest,
            E::Transition(_) => ErrorCode::InvalidTransition,
            E::Quota(_) => ErrorCode::QuotaExceeded,
            E::Forbidden(_) => ErrorCode::Forbidden,
            E::Runtime(r) => r.code(),
            E::Template(t) => t.code(),
            E::Internal(_) => ErrorCode::Internal,
        };
        Self::new(code, detail)
    }
}

impl From<RuntimeError> for ApiError {
    fn from(e: RuntimeError) -> Self {
        Self::from(lifecycle::Error::Runtime(e))
    }
}

impl From<AgentError> for ApiError {
    fn from(e: AgentError) -> Self {
        let detail = match &e {
            AgentError::Remote { message, .. } => message.clone(),
            other => lifecycle::chain(other),
        };
        Self::new(e.code(), detail)
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        // A full disk is the machine's condition, not a bug: say so, and that a retry can work.
        if let StoreError::Sql(rusqlite::Error::SqliteFailure(f, _)) = &e {
            if f.code == rusqlite::ErrorCode::DiskFull {
                return Self {
                    retry_after: Some(5),
                    ..Self::new(
                        ErrorCode::ResourceExhausted,
                        "the node's state disk is full",
                    )
                };
            }
        }
        Self::internal(e.to_string())
    }
}

impl From<crate::template::TemplateError> for ApiError {
    fn from(e: crate::template::TemplateError) -> Self {
        Self::new(e.code(), lifecycle::chain(&e))
    }
}

/// Result of a handler.
pub type ApiResult<T> = Result<T, ApiError>;
