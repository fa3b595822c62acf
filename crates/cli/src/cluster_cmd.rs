//! `dsec gateway` and `dsec cluster …`: the cluster's endpoint and its operator commands
//! (docs/design.md, *Cluster*).

use std::io::Write as _;
use std::net::SocketAddr;
use std::process::ExitCode;

use anyhow::Context as _;
use dsec_cluster::etcd::Etcd;
use dsec_cluster::gateway::{self, GatewayConfig};
use dsec_cluster::model;

/// `dsec gateway`.
#[derive(Debug, clap::Args)]
pub struct GatewayArgs {
    /// etcd endpoints (comma-separated URLs).
    #[arg(long, env = "DSEC_ETCD")]
    etcd: String,
    /// Address to listen on (`127.0.0.1:0` picks a free port).
    #[arg(long, env = "DSEC_GATEWAY_LISTEN", default_value = "127.0.0.1:7800")]
    listen: SocketAddr,
    /// Worker threads (0: one per CPU). One thread saves a cross-thread wake-up per proxied
    /// call; more serve more calls at once. Gateways scale out by replicas either way.
    #[arg(long, env = "DSEC_GATEWAY_WORKERS", default_value_t = 0)]
    workers: usize,
}

/// `dsec cluster …`.
#[derive(Debug, clap::Subcommand)]
pub enum ClusterCmd {
    /// The nodes of the cluster: state, lease age, sandboxes, free capacity, templates held.
    Status {
        /// etcd endpoints (comma-separated URLs).
        #[arg(long, env = "DSEC_ETCD")]
        etcd: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Simulated nodes, for scale tests only: they register in etcd like nodes and take
    /// placements without starting sandboxes. Runs until killed.
    Simulate {
        /// etcd endpoints (comma-separated URLs).
        #[arg(long, env = "DSEC_ETCD")]
        etcd: String,
        /// How many nodes.
        #[arg(long, default_value_t = 200)]
        nodes: usize,
        /// Sandbox slots per node.
        #[arg(long, default_value_t = 500)]
        slots: u64,
        /// Where they listen (one listener for all).
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: std::net::SocketAddr,
    },
    /// Stop placing new sandboxes on a node (`--undo` places on it again).
    Drain {
        /// The node's name.
        node: String,
        /// etcd endpoints (comma-separated URLs).
        #[arg(long, env = "DSEC_ETCD")]
        etcd: String,
        /// Place on it again.
        #[arg(long)]
        undo: bool,
    },
}

/// Runs simulated nodes until killed.
fn simulate(cfg: dsec_cluster::sim::SimConfig) -> anyhow::Result<ExitCode> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("tokio runtime")?;
    let n = cfg.nodes;
    rt.block_on(dsec_cluster::sim::serve(cfg, |addr| {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(
            out,
            "dsec cluster simulate listening on http://{addr} ({n} nodes)"
        );
        let _ = out.flush();
    }))
    .context("dsec cluster simulate")?;
    Ok(ExitCode::SUCCESS)
}

/// Runs the gateway until killed.
pub fn gateway(args: &GatewayArgs) -> anyhow::Result<ExitCode> {
    let rt = match args.workers {
        1 => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build(),
        0 => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build(),
        n => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(n)
            .enable_all()
            .build(),
    }
    .context("tokio runtime")?;
    let cfg = GatewayConfig {
        etcd: args.etcd.clone(),
        listen: args.listen,
    };
    rt.block_on(gateway::serve(cfg, |addr| {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "dsec gateway listening on http://{addr}");
        let _ = out.flush();
    }))
    .context("dsec gateway")?;
    Ok(ExitCode::SUCCESS)
}

/// Runs a `dsec cluster` command.
pub fn run(cmd: &ClusterCmd) -> anyhow::Result<ExitCode> {
    match cmd {
        ClusterCmd::Status { etcd, json } => status(&Etcd::new(etcd), *json),
        ClusterCmd::Simulate {
            etcd,
            nodes,
            slots,
            listen,
        } => simulate(dsec_cluster::sim::SimConfig {
            etcd: etcd.clone(),
            nodes: *nodes,
            slots: *slots,
            listen: *listen,
        }),
        ClusterCmd::Drain { node, etcd, undo } => {
            let etcd = Etcd::new(etcd);
            if *undo {
                etcd.delete(&model::drain_key(node))?;
            } else {
                etcd.put(&model::drain_key(node), b"1", 0)?;
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn status(etcd: &Etcd, as_json: bool) -> anyhow::Result<ExitCode> {
    let (nodes, _) = etcd.prefix(&model::nodes_prefix())?;
    let (numbers, _) = etcd.prefix(&model::numbers_prefix())?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let live: Vec<model::NodeReport> = nodes
        .iter()
        .filter_map(|kv| serde_json::from_slice(&kv.value).ok())
        .collect();
    let mut rows: Vec<serde_json::Value> = live
        .iter()
        .map(|n| {
            serde_json::json!({
                "name": n.name, "state": if n.draining { "draining" } else { "ready" },
                "number": n.number, "url": n.url,
                "report_age_ms": now.saturating_sub(n.updated_ms),
                "sandboxes": n.sandboxes, "free_slots": n.free_slots(),
                "cpus": n.cpus, "cpu_used": n.cpu_used,
                "free_memory_bytes": n.free_memory(), "templates": n.templates,
                "draining": n.draining,
            })
        })
        .collect();
    for kv in &numbers {
        let name = String::from_utf8_lossy(&kv.value).into_owned();
        if !live.iter().any(|n| n.name == name) {
            rows.push(serde_json::json!({"name": name, "state": "lost",
                "number": kv.key.rsplit('/').next().and_then(|s| s.parse::<u16>().ok())}));
        }
    }
    let mut out = std::io::stdout().lock();
    if as_json {
        writeln!(out, "{}", serde_json::json!({ "nodes": rows }))?;
        return Ok(ExitCode::SUCCESS);
    }
    writeln!(
        out,
        "{:<16} {:<9} {:>6} {:>10} {:>9} {:>10} {:>12}  TEMPLATES",
        "NODE", "STATE", "NUMBER", "REPORT_AGE", "SANDBOXES", "FREE_SLOTS", "FREE_MEM_MIB"
    )?;
    for r in &rows {
        writeln!(
            out,
            "{:<16} {:<9} {:>6} {:>10} {:>9} {:>10} {:>12}  {}",
            r["name"].as_str().unwrap_or(""),
            r["state"].as_str().unwrap_or(""),
            r["number"],
            r["report_age_ms"]
                .as_u64()
                .map_or("-".into(), |a| format!("{a}ms")),
            r["sandboxes"]
                .as_u64()
                .map_or("-".into(), |v| v.to_string()),
            r["free_slots"]
                .as_u64()
                .map_or("-".into(), |v| v.to_string()),
            r["free_memory_bytes"]
                .as_u64()
                .map_or("-".into(), |v| (v >> 20).to_string()),
            r["templates"]
                .as_array()
                .map(|a| a
                    .iter()
                    .filter_map(|t| t.as_str())
                    .collect::<Vec<_>>()
                    .join(","))
                .unwrap_or_default(),
        )?;
    }
    Ok(ExitCode::SUCCESS)
}
