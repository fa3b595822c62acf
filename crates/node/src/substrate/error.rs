//! Errors of the substrates' runtime.

use std::io;
use std::path::PathBuf;

use dsec_api::ErrorCode;
use dsec_shim::proto::LaunchFailure;

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
    #[error("launch sandbox {id}: {failure}")]
    Launch {
        /// Sandbox id.
        id: String,
        /// The step that failed, with its OS error.
        failure: LaunchFailure,
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
            RuntimeError::Launch { failure, .. } => launch_code(failure),
            RuntimeError::Prepare { .. }
            | RuntimeError::MissingBinary { .. }
            | RuntimeError::Spawner(_)
            | RuntimeError::Cgroup(_)
            | RuntimeError::Capacity(_)
            | RuntimeError::Supervisor { .. } => ErrorCode::Internal,
        }
    }
}

/// OS errors that mean the host (or the sandbox's share of it) ran out of something: memory,
/// processes, disk, descriptors, buffers.
const EXHAUSTION_ERRNOS: [i32; 7] = [
    libc::EAGAIN,
    libc::ENOMEM,
    libc::ENOSPC,
    libc::EDQUOT,
    libc::EMFILE,
    libc::ENFILE,
    libc::ENOBUFS,
];

/// The code of a failed launch: `resource_exhausted` when its step failed for want of a
/// resource (a retry later, or smaller limits, may succeed), `internal` otherwise.
fn launch_code(failure: &LaunchFailure) -> ErrorCode {
    match failure.errno {
        Some(n) if EXHAUSTION_ERRNOS.contains(&n) => ErrorCode::ResourceExhausted,
        _ => ErrorCode::Internal,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsec_shim::proto::LaunchStep;

    fn launch(step: LaunchStep, errno: Option<i32>) -> RuntimeError {
        RuntimeError::Launch {
            id: "sb-0123456789abcdef".into(),
            failure: LaunchFailure {
                step,
                errno,
                message: "m".into(),
            },
        }
    }

    #[test]
    fn launch_failures_for_want_of_a_resource_are_resource_exhausted() {
        for errno in EXHAUSTION_ERRNOS {
            let e = launch(LaunchStep::Clone, Some(errno));
            assert_eq!(e.code(), ErrorCode::ResourceExhausted, "{errno}");
        }
        for (step, errno) in [
            (LaunchStep::CgroupCreate, Some(libc::ENOSPC)),
            (LaunchStep::Rootfs, Some(libc::ENOMEM)),
            (LaunchStep::Fork, Some(libc::EAGAIN)),
        ] {
            assert_eq!(launch(step, errno).code(), ErrorCode::ResourceExhausted);
        }
    }

    #[test]
    fn other_launch_failures_are_internal() {
        for (step, errno) in [
            (LaunchStep::Rootfs, Some(libc::EINVAL)),
            (LaunchStep::ExecAgent, Some(libc::ENOENT)),
            (LaunchStep::Privileges, Some(libc::EPERM)),
            (LaunchStep::Timeout, None),
            (LaunchStep::Reply, None),
            (LaunchStep::Configure, None),
        ] {
            assert_eq!(launch(step, errno).code(), ErrorCode::Internal, "{step:?}");
        }
    }

    #[test]
    fn a_launch_failure_names_its_step() {
        let e = launch(LaunchStep::CgroupLimits, Some(libc::EINVAL));
        let text = e.to_string();
        assert!(
            text.contains("writing the cgroup limits failed: m"),
            "{text}"
        );
        assert!(
            text.starts_with("launch sandbox sb-0123456789abcdef: "),
            "{text}"
        );
    }
}
