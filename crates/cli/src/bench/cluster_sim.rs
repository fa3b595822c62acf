//! `dsec bench cluster`'s placement figures: one gateway over 200 simulated nodes
//! (`dsec cluster simulate`) in an etcd of their own.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use dsec_cluster::model::NodeReport;
use dsec_cluster::place::{self, Ask};
use dsec_testkit as testkit;
use serde_json::{json, Value};
use testkit::cluster::{self, wait, Proc};

/// Simulated nodes.
const NODES: usize = 200;
/// Clients creating at once.
const CLIENTS: usize = 16;
/// How long the clients create.
const CREATING: Duration = Duration::from_secs(5);

/// etcd's count of writes (puts, transactions, deletes) so far.
fn etcd_writes(etcd: &str) -> anyhow::Result<f64> {
    let h = testkit::Http::new(etcd, None, Some(Duration::from_secs(5)));
    let r = h.send("GET", "/metrics", None, &[])?;
    let text = String::from_utf8_lossy(&r.body);
    let mut sum = 0.0;
    for line in text.lines() {
        for name in [
            "etcd_mvcc_put_total ",
            "etcd_mvcc_txn_total ",
            "etcd_mvcc_delete_total ",
        ] {
            if let Some(v) = line.strip_prefix(name) {
                sum += v.trim().parse::<f64>().unwrap_or(0.0);
            }
        }
    }
    Ok(sum)
}

/// A process's resident memory, bytes.
fn rss(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// The placement figures.
pub fn placement(base: &Path) -> anyhow::Result<Value> {
    let dir = base.join("sim");
    std::fs::create_dir_all(&dir)?;
    let (_etcd, etcd) = cluster::etcd(&dir);
    let mut child = Command::new(std::env::current_exe()?)
        .args([
            "cluster",
            "simulate",
            "--etcd",
            &etcd,
            "--nodes",
            &NODES.to_string(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .context("dsec cluster simulate")?;
    let out = child.stdout.take().context("stdout")?;
    let sim = Proc(child);
    testkit::address_line(out, "dsec cluster simulate listening on ")
        .context("the simulated nodes")?;
    let (gw_proc, gw, _) = cluster::gateway(std::env::current_exe()?, &etcd, None);
    anyhow::ensure!(
        wait(Duration::from_secs(20), || gw
            .req("GET", "/v1/cluster", None)
            .1["nodes"]
            .as_array()
            .map_or(0, Vec::len)
            == NODES),
        "the gateway did not see the {NODES} simulated nodes"
    );
    // The background: the nodes' reports, over the same time as the creates.
    let w0 = etcd_writes(&etcd)?;
    std::thread::sleep(CREATING);
    let background = etcd_writes(&etcd)? - w0;

    // One create per call, from many clients at once.
    let placed = AtomicU64::new(0);
    let failed = AtomicU64::new(0);
    let w0 = etcd_writes(&etcd)?;
    let t = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..CLIENTS {
            s.spawn(|| {
                while t.elapsed() < CREATING {
                    match gw.req("POST", "/v1/sandboxes", Some(&json!({}))) {
                        (201, _) => placed.fetch_add(1, Ordering::Relaxed),
                        _ => failed.fetch_add(1, Ordering::Relaxed),
                    };
                }
            });
        }
    });
    let single_wall = t.elapsed();
    let single_writes = etcd_writes(&etcd)? - w0;
    let single = placed.load(Ordering::Relaxed);

    // Batches of 1,000.
    let rounds = 20u64;
    let w0 = etcd_writes(&etcd)?;
    let t = Instant::now();
    let mut batched = 0u64;
    for _ in 0..rounds {
        let (s, v) = gw.req(
            "POST",
            "/v1/sandboxes/batch",
            Some(&json!({"count": 1000, "spec": {}})),
        );
        anyhow::ensure!(s == 200, "batch: {s} {v}");
        batched += v["items"]
            .as_array()
            .map_or(0, |a| a.iter().filter(|i| i["ok"] == true).count()) as u64;
    }
    let batch_wall = t.elapsed();
    let batch_writes = etcd_writes(&etcd)? - w0;
    let gateway_rss = rss(gw_proc.0.id());
    let per = |writes: f64, wall: Duration, n: u64| {
        let bg = background * wall.as_secs_f64() / CREATING.as_secs_f64();
        ((writes - bg).max(0.0) / n.max(1) as f64 * 1000.0).round() / 1000.0
    };
    let keys = dsec_cluster::etcd::Etcd::new(&etcd)
        .prefix(dsec_cluster::model::ROOT)
        .map(|(k, _)| k.len())
        .unwrap_or(0);
    drop(sim);
    Ok(json!({
        "simulated_nodes": NODES,
        "one_at_a_time": {"clients": CLIENTS, "placed": single, "failed": failed.load(Ordering::Relaxed),
            "decisions_per_s": (single as f64 / single_wall.as_secs_f64()).round(),
            "etcd_writes_per_placement": per(single_writes, single_wall, single)},
        "batches_of_1000": {"placed": batched,
            "decisions_per_s": (batched as f64 / batch_wall.as_secs_f64()).round(),
            "etcd_writes_per_placement": per(batch_writes, batch_wall, batched)},
        "etcd_background_writes_per_s": (background / CREATING.as_secs_f64()).round(),
        "etcd_keys": keys,
        "gateway_rss_bytes": gateway_rss,
        "in_process": in_process(),
    }))
}

/// The same decisions in process, over 200 reports: the gateway's scoring alone.
fn in_process() -> Value {
    let nodes: Vec<NodeReport> = (0..NODES as u16)
        .map(|i| NodeReport {
            name: format!("sim-{i:04}"),
            number: i + 1,
            max_sandboxes: 500,
            sandboxes: u64::from(i) % 50,
            memory_bytes: 256 << 30,
            templates: if i % 4 == 0 {
                vec!["py".into()]
            } else {
                vec![]
            },
            pools: if i % 10 == 0 {
                BTreeMap::from([("py".to_string(), 2)])
            } else {
                BTreeMap::new()
            },
            ..Default::default()
        })
        .collect();
    let ask = Ask {
        template: "py",
        tenant: "tn-bench",
        memory: 512 << 20,
    };
    let n = 20_000;
    let t = Instant::now();
    let mut placed = 0usize;
    for _ in 0..n {
        placed += place::place(&nodes, &ask, 1).0.len();
    }
    let single = n as f64 / t.elapsed().as_secs_f64();
    let t = Instant::now();
    for _ in 0..20 {
        placed += place::place(&nodes, &ask, 1000).0.values().sum::<u64>() as usize;
    }
    let batched = 20_000.0 / t.elapsed().as_secs_f64();
    json!({"decisions_per_s_one_at_a_time": single.round(),
           "decisions_per_s_in_batches_of_1000": batched.round(), "placed": placed})
}
