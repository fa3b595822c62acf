//! `dsec bench`: the benchmarks of record, each printing one JSON document. Every figure is a
//! distribution (count, p50, p90, p99, max in microseconds) and each bench measures its peer in
//! the same run so that ratios survive a noisy machine.

use std::path::Path;
use std::process::{Command, ExitCode};
use std::time::Instant;

use anyhow::Context;
use dsec_node::substrate::Runtime;
use serde::Serialize;

mod api;
mod chaos;
mod cluster;
mod cluster_sim;
mod container;
mod e2b;
mod log;
mod net;
mod run;
mod snapshot;
mod vm;

/// What `dsec bench` measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchKind {
    /// The container substrate, in process (latency, density, `bwrap`/`python3` peers).
    Container,
    /// The daemon over HTTP from a separate process (`GET /livez` as the peer).
    Api,
    /// The trajectory log's durable appends and replay, with SQLite as the peer.
    Log,
    /// The code runner: function vs container substrate vs `python3 -c`.
    Run,
    /// VM sandboxes: snapshot, restore, exec, memory per clone, density, plain-boot peer.
    Vm,
    /// A soak: a mixed workload while the daemon is killed (-9) and restarted, with
    /// supervisors and agents killed, the data dir filled once and the clock stepped once;
    /// the invariants checked after every restart. Exits non-zero when one broke.
    Chaos,
    /// The cluster: a real etcd, 4 nodes and a gateway: gateway vs direct, a batch of 1,000,
    /// placement decisions per second over 200 simulated nodes, node-loss detection.
    Cluster,
    /// Container snapshots (0 and 100 files, `cp -a` peer), fork 16, create from a snapshot
    /// vs cold, restore vs reset, a 100-deep chain.
    Snapshot,
    /// The official E2B Python SDK's create + `commands.run("true")` + kill loop against the
    /// node's E2B-compatible API, with the dsec Python SDK's same loop as the peer, interleaved.
    E2b,
    /// Network egress: create + exec + delete with egress on vs off, HTTP throughput and small
    /// requests through the enforcement path vs the host's direct path, DNS lookups through the
    /// node's DNS vs straight to the resolver, against a fake internet.
    Net,
}

/// Arguments of `dsec bench`.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// What to measure.
    pub what: BenchKind,
    /// Iterations per latency figure.
    #[arg(long, default_value_t = 200)]
    pub iterations: usize,
    /// Idle sandboxes to hold at once for the density figure (0 skips it).
    #[arg(long, default_value_t = 1000)]
    pub idle: usize,
    /// Pause before each measured cold create, so that background work of the previous one
    /// (shell refill, namespace teardown) does not count against it.
    #[arg(long, default_value_t = 20)]
    pub settle_ms: u64,
    /// Cycles (daemon kills and restarts) of `chaos`.
    #[arg(long, default_value_t = 100)]
    pub cycles: usize,
    /// Client threads of `chaos`.
    #[arg(long, default_value_t = 3)]
    pub threads: usize,
    /// Seed of `chaos`'s choices (default: from the time; the report names it).
    #[arg(long)]
    pub seed: Option<u64>,
    /// The Python of `e2b` (it must import `e2b` and `dsec`; default: the repository's
    /// `target/pyvenv/bin/python`).
    #[arg(long)]
    pub python: Option<std::path::PathBuf>,
    /// The substrate of `e2b`'s sandboxes.
    #[arg(long, default_value = "container", value_parser = ["container", "microvm"])]
    pub substrate: String,
    /// Write the JSON here as well as to stdout.
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
}

/// Adds what every bench report says about the machine and the build: kernel, CPUs, commit.
pub(crate) fn with_machine(mut doc: serde_json::Value) -> serde_json::Value {
    if let Some(o) = doc.as_object_mut() {
        o.insert(
            "kernel".into(),
            std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .unwrap_or_default()
                .trim()
                .into(),
        );
        o.insert(
            "cpus".into(),
            std::thread::available_parallelism()
                .map_or(0, |n| n.get())
                .into(),
        );
        o.insert(
            "commit".into(),
            Command::new("git")
                .args(["rev-parse", "--short", "HEAD"])
                .output()
                .ok()
                .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
                .into(),
        );
    }
    doc
}

/// Prints a bench report (with [`with_machine`]'s fields) and writes it to `--out`.
pub(crate) fn emit(args: &BenchArgs, doc: serde_json::Value) -> anyhow::Result<ExitCode> {
    let text = serde_json::to_string_pretty(&with_machine(doc))?;
    println!("{text}");
    if let Some(p) = &args.out {
        std::fs::write(p, &text).with_context(|| format!("write {}", p.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(Debug, Serialize)]
pub(crate) struct Dist {
    pub(crate) count: usize,
    pub(crate) p50_us: u64,
    pub(crate) p90_us: u64,
    pub(crate) p99_us: u64,
    pub(crate) max_us: u64,
}

pub(crate) fn dist(mut v: Vec<u64>) -> Dist {
    v.sort_unstable();
    let q = |p: f64| -> u64 {
        if v.is_empty() {
            return 0;
        }
        let i = ((v.len() as f64 - 1.0) * p).round() as usize;
        v[i.min(v.len() - 1)]
    };
    Dist {
        count: v.len(),
        p50_us: q(0.5),
        p90_us: q(0.9),
        p99_us: q(0.99),
        max_us: v.last().copied().unwrap_or(0),
    }
}

pub(crate) fn us(t: Instant) -> u64 {
    t.elapsed().as_micros() as u64
}

/// Runs the benchmark `args` names; `data_dir` is where `log` writes, `rt` the container
/// runtime of `container`.
pub fn run(
    args: &BenchArgs,
    data_dir: &Path,
    rt: impl FnOnce() -> anyhow::Result<Runtime>,
) -> anyhow::Result<ExitCode> {
    match args.what {
        BenchKind::Container => container::run(args, rt),
        BenchKind::Api => api::run(args),
        BenchKind::Log => log::run(args, data_dir),
        BenchKind::Run => run::run(args),
        BenchKind::Vm => vm::run(args),
        BenchKind::Chaos => chaos::run(args),
        BenchKind::Cluster => cluster::run(args),
        BenchKind::Snapshot => snapshot::run(args),
        BenchKind::E2b => e2b::run(args),
        BenchKind::Net => net::run(args),
    }
}
