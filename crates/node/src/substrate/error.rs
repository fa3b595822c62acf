//! Errors of the substrates' runtime.

use std::io;
use std::path::PathBuf;

use dsec_api::ErrorCode;

use crate::agent_client::AgentError;
use crate::sandbox::InvalidTransition;

/// Errors of the container runtime.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// A runtime file or directory could not be prepared.
    #[error("prepare {path}")]
    Prepare {
        /// The path.
        path: PathBuf,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// A required binary is missing.
    #[error("cannot find {name} (looked in {looked})")]
    MissingBinary {
        /// Binary name.
        name: &'static str,
        /// Where.
        looked: String,
    },
    /// The spawner process could not be started or died.
    #[error("spawner unavailable")]
    Spawner(#[source] io::Error),
    /// cgroups could not be used.
    #[error("cgroups")]
    Cgroup(#[source] dsec_sys::cgroup::CgroupError),
    /// What the node has could not be read.
    #[error("node capacity")]
    Capacity(#[source] crate::capacity::CapacityError),
    /// Templates could not be used.
    #[error("template")]
    Template(#[source] crate::template::TemplateError),
    /// The request is invalid.
    #[error("invalid request: {0}")]
    Invalid(String),
    /// Launching the sandbox failed.
    #[error("launch sandbox {id}: {message}")]
    Launch {
        /// Sandbox id.
        id: String,
        /// What failed.
        message: String,
    },
    /// The supervisor of a sandbox is gone or misbehaved.
    #[error("supervisor of sandbox {id}: {message}")]
    Supervisor {
        /// Sandbox id.
        id: String,
        /// What happened.
        message: String,
    },
    /// The agent failed.
    #[error("agent of sandbox {id}")]
    Agent {
        /// Sandbox id.
        id: String,
        /// Cause.
        #[source]
        source: AgentError,
    },
    /// A lifecycle rule was violated.
    #[error(transparent)]
    Transition(#[from] InvalidTransition),
    /// A VM substrate failed.
    #[error("vm sandbox {id}: {source}")]
    Vm {
        /// Sandbox id.
        id: String,
        /// Cause.
        #[source]
        source: crate::substrate::vm::VmError,
    },
}

impl RuntimeError {
    /// The stable code of this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            RuntimeError::Invalid(_) => ErrorCode::InvalidRequest,
            RuntimeError::Template(e) => e.code(),
            RuntimeError::Agent { source, .. } => source.code(),
            RuntimeError::Transition(_) => ErrorCode::InvalidTransition,
            RuntimeError::Vm { source, .. } => source.code(),
            RuntimeError::Launch { .. } => ErrorCode::ResourceExhausted,
            RuntimeError::Prepare { .. }
            | RuntimeError::MissingBinary { .. }
            | RuntimeError::Spawner(_)
            | RuntimeError::Cgroup(_)
            | RuntimeError::Capacity(_)
            | RuntimeError::Supervisor { .. } => ErrorCode::Internal,
        }
    }
}
