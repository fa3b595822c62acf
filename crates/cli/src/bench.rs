//! `dsec bench`: latency and density measurements, printed as JSON.
use std::process::ExitCode;

use dsec_node::container::ContainerRuntime;

/// Arguments of `dsec bench`.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// What to measure.
    pub what: String,
}

/// Runs a benchmark.
pub fn run(_args: &BenchArgs, _rt: impl FnOnce() -> anyhow::Result<ContainerRuntime>) -> anyhow::Result<ExitCode> {
    anyhow::bail!("not yet")
}
