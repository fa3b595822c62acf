//! What a lifecycle operation fails with. The server maps it to wire codes in one place
//! (`server/error.rs`).

pub use dsec_api::error::chain;

use crate::agent_client::AgentError;
use crate::sandbox::InvalidTransition;
use crate::store::StoreError;
use crate::substrate::RuntimeError;

/// A failed lifecycle operation.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No such sandbox (or not the caller's).
    #[error("no sandbox {}", .0.chars().take(80).collect::<String>())]
    NotFound(String),
    /// No such snapshot (or not the caller's).
    #[error("no snapshot {}", .0.chars().take(80).collect::<String>())]
    SnapshotNotFound(String),
    /// The request is invalid (limits beyond the node, a bad pool name, no lease …).
    #[error("{0}")]
    Invalid(String),
    /// The sandbox is not in a state that allows the operation.
    #[error("{0}")]
    Transition(String),
    /// The node is shutting down.
    #[error("the node is shutting down")]
    Draining,
    /// A tenant quota would be exceeded.
    #[error("{0}")]
    Quota(String),
    /// The caller's tenant may not do this (a network policy beyond its egress ceiling).
    #[error("{0}")]
    Forbidden(String),
    /// The node holds its maximum of sandboxes.
    #[error("the node holds its maximum of {0} sandboxes")]
    Full(usize),
    /// Something the operation needs does not answer now (a cluster's etcd, every source of
    /// a template's layers); a retry may succeed.
    #[error("{0}")]
    Unavailable(String),
    /// The runtime failed (its own code says how).
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// The durable store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A template could not be used.
    #[error(transparent)]
    Template(#[from] crate::template::TemplateError),
    /// Anything else (a task that panicked, a closed channel).
    #[error("{0}")]
    Internal(String),
}

impl From<InvalidTransition> for Error {
    fn from(t: InvalidTransition) -> Self {
        Error::Transition(t.to_string())
    }
}

/// Result of a lifecycle operation.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// [`Error::Invalid`].
    pub fn invalid(detail: impl Into<String>) -> Self {
        Error::Invalid(detail.into())
    }

    /// [`Error::Internal`].
    pub fn internal(detail: impl Into<String>) -> Self {
        Error::Internal(detail.into())
    }
}

impl Error {
    /// The human-readable detail: the whole cause chain, or an agent's own message as it
    /// gave it.
    pub fn detail(&self) -> String {
        match self {
            Error::Runtime(RuntimeError::Agent {
                source: AgentError::Remote { message, .. },
                ..
            }) => message.clone(),
            Error::Runtime(e) => chain(e),
            Error::Template(e) => chain(e),
            other => other.to_string(),
        }
    }
}
