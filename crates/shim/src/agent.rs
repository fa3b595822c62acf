//! Requests the supervisor itself sends the agent (its `Configure`, `ReopenRoot` at a reset).

use std::os::fd::OwnedFd;

use dsec_api::agent::Request;

use crate::proto::LaunchConfig;

/// The `Configure` an agent gets from its supervisor: its sandbox's environment and the limits
/// applied to each command.
pub(crate) fn configure_request(cfg: &LaunchConfig) -> Request {
    Request::Configure {
        env: cfg.env.clone(),
        nofile: Some(cfg.limits.open_files_max),
        fsize: Some(cfg.limits.file_size_max),
        nproc: cfg.ids.map(|_| cfg.limits.nproc()),
        workdir: cfg.workdir.clone(),
        user: cfg.user.clone(),
    }
}

/// Request id of the `Configure` the supervisor sends at launch; resets use ids above it.
pub(crate) const CONFIGURE_ID: u64 = 1 << 62;

/// Sends the agent a request on the shared agent socket (only while the node is waiting on us,
/// so that frames never interleave); false if it could not.
pub(crate) fn send_agent_request(agent: &OwnedFd, id: u64, req: &Request) -> bool {
    use std::io::Write as _;
    let Ok(frame) = dsec_api::frame::encode_request(id, req, &[]) else {
        return false;
    };
    let Ok(dup) = agent.try_clone() else {
        return false;
    };
    std::os::unix::net::UnixStream::from(dup)
        .write_all(&frame)
        .is_ok()
}
