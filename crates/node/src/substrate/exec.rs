//! Running commands in a container sandbox.

use dsec_api::exec::{ExecRequest, ExecResult, ExecStatus, Stream};

use super::{Runtime, RuntimeError, Sandbox};

impl Sandbox {
    /// Runs a command to completion. A command killed by SIGKILL while the sandbox's cgroup
    /// recorded a new OOM kill is reported as `oom`.
    pub fn exec(
        &mut self,
        rt: &Runtime,
        req: &ExecRequest,
        stdin: &[u8],
        on_output: impl FnMut(Stream, &[u8]),
    ) -> Result<ExecResult, RuntimeError> {
        req.validate().map_err(RuntimeError::Invalid)?;
        let id = self.id.clone();
        let mut result = self
            .agent
            .exec(req, stdin, on_output)
            .map_err(|source| RuntimeError::Agent { id, source })?;
        // The cgroup's OOM counter tells whether the kernel killed something for memory during
        // this command, whichever process of the tree it picked.
        if let Ok(kills) = rt.cgroups().oom_kills(&self.id) {
            if kills > self.oom_kills {
                self.oom_kills = kills;
                if result.status != ExecStatus::Ok {
                    result.status = ExecStatus::Oom;
                }
            }
        }
        Ok(result)
    }
}
