//! Stable error codes. Every process boundary maps its errors to one of these in one function.

use serde::{Deserialize, Serialize};

/// A stable, machine-readable error code. Serialized in `snake_case`; never renamed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The request is malformed or violates a documented limit.
    InvalidRequest,
    /// A path does not exist.
    NotFound,
    /// A path exists but is not what the operation needs (e.g. a directory for a file read).
    WrongFileType,
    /// A path would resolve outside the sandbox root or through a forbidden link.
    PathEscape,
    /// The operation was refused by the kernel (EACCES/EPERM/EROFS).
    PermissionDenied,
    /// The sandbox's disk or inode quota is full.
    NoSpace,
    /// A background process or session handle is unknown.
    HandleNotFound,
    /// The command could not be started (binary missing, not executable...).
    SpawnFailed,
    /// A size limit of the protocol or of the request was exceeded.
    TooLarge,
    /// The protocol peer spoke a version this build does not understand.
    UnsupportedVersion,
    /// The sandbox does not exist.
    SandboxNotFound,
    /// The requested state change is not allowed from the current state.
    InvalidTransition,
    /// The template does not exist.
    TemplateNotFound,
    /// The template or its image is malformed or hostile.
    TemplateInvalid,
    /// A tenant quota would be exceeded.
    QuotaExceeded,
    /// The node is out of a resource (slots, memory, disk).
    ResourceExhausted,
    /// An exec exceeded its deadline.
    ExecTimeout,
    /// The sandbox's agent is gone or unresponsive.
    AgentUnavailable,
    /// An infrastructure bug or unexpected host failure.
    Internal,
    /// The request carries no valid API key.
    Unauthorized,
    /// The caller's tenant may not do this.
    Forbidden,
    /// An idempotency key was reused with a different request.
    IdempotencyConflict,
    /// The node is shutting down and takes no new work.
    Draining,
    /// A logged step has an intent but no result: it may or may not have run.
    UnknownOutcome,
    /// A step number does not continue its trajectory.
    TrajectoryDiverged,
    /// The trajectory does not exist.
    TrajectoryNotFound,
    /// The path exists but does not take this HTTP method (the `Allow` header lists those it
    /// takes).
    MethodNotAllowed,
    /// A store the call needs (a cluster's etcd, a template source) does not answer now.
    Unavailable,
    /// The sandbox's node was lost (its cluster lease expired): the sandbox is gone.
    NodeLost,
    /// The snapshot does not exist (or is not the caller's).
    SnapshotNotFound,
}

impl ErrorCode {
    /// The code as it appears on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InvalidRequest => "invalid_request",
            Self::NotFound => "not_found",
            Self::WrongFileType => "wrong_file_type",
            Self::PathEscape => "path_escape",
            Self::PermissionDenied => "permission_denied",
            Self::NoSpace => "no_space",
            Self::HandleNotFound => "handle_not_found",
            Self::SpawnFailed => "spawn_failed",
            Self::TooLarge => "too_large",
            Self::UnsupportedVersion => "unsupported_version",
            Self::SandboxNotFound => "sandbox_not_found",
            Self::InvalidTransition => "invalid_transition",
            Self::TemplateNotFound => "template_not_found",
            Self::TemplateInvalid => "template_invalid",
            Self::QuotaExceeded => "quota_exceeded",
            Self::ResourceExhausted => "resource_exhausted",
            Self::ExecTimeout => "exec_timeout",
            Self::AgentUnavailable => "agent_unavailable",
            Self::Internal => "internal",
            Self::Unauthorized => "unauthorized",
            Self::Forbidden => "forbidden",
            Self::IdempotencyConflict => "idempotency_conflict",
            Self::Draining => "draining",
            Self::UnknownOutcome => "unknown_outcome",
            Self::TrajectoryDiverged => "trajectory_diverged",
            Self::TrajectoryNotFound => "trajectory_not_found",
            Self::MethodNotAllowed => "method_not_allowed",
            Self::Unavailable => "unavailable",
            Self::NodeLost => "node_lost",
            Self::SnapshotNotFound => "snapshot_not_found",
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `e` and its chain of sources, joined with `": "`: the detail of an error in a message.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_names_match_as_str() {
        for code in [
            ErrorCode::InvalidRequest,
            ErrorCode::PathEscape,
            ErrorCode::SandboxNotFound,
            ErrorCode::Internal,
            ErrorCode::ResourceExhausted,
            ErrorCode::IdempotencyConflict,
            ErrorCode::Unauthorized,
            ErrorCode::MethodNotAllowed,
        ] {
            let json = serde_json::to_string(&code).expect("serialize");
            assert_eq!(json, format!("\"{}\"", code.as_str()));
        }
    }
}
