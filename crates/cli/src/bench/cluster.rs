//! `dsec bench cluster`: the cluster layer measured with a real etcd, real nodes and a gateway,
//! each a process of its own on this machine.
//!
//! - `create_exec_delete`: create + exec `true` + delete through the gateway and, interleaved,
//!   directly to the node (the peer), the other nodes drained meanwhile so that both go to the
//!   same node: the gateway's overhead is the difference of the p50s;
//! - `batch_1000`: a batch create of 1,000 through the gateway over 4 nodes (pools off): wall
//!   time and spread; then the batch delete;
//! - `placement`: placement decisions per second at one gateway over 200 simulated nodes
//!   (`dsec cluster simulate`: registered in their own etcd like nodes, taking placements without
//!   sandboxes): creates from 16 clients at once, and batches of 1,000; etcd writes per
//!   placement (etcd's own counters, less the nodes' reports over the same time); the
//!   gateway's memory; the same decisions in process, for the gateway's share;
//! - `node_loss`: a node killed (`kill -9`) until the gateway answers its sandbox `lost`, over
//!   `--cycles` kills (default 10 here), restarting the node between kills.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use dsec_testkit as testkit;
use serde_json::{json, Value};
use testkit::cluster::{self, wait};

use super::{dist, emit, us, BenchArgs};

fn node(base: &Path, name: &str, etcd: &str) -> anyhow::Result<testkit::Daemon> {
    let (data, run) = (
        base.join(format!("{name}-d")),
        base.join(format!("{name}-r")),
    );
    testkit::Server::new(std::env::current_exe()?, &data, &run)
        .args(&["--etcd", etcd, "--node-name", name, "--pool-max", "0"])
        .start()
        .context("start a node")
}

fn nodes_live(gw: &testkit::Http) -> usize {
    gw.req("GET", "/v1/cluster", None).1["nodes"]
        .as_array()
        .map_or(0, Vec::len)
}

fn id_of(v: &Value) -> anyhow::Result<String> {
    Ok(v["id"].as_str().context("an id")?.to_owned())
}

/// The calls of a cycle, timed each.
const CALLS: [&str; 3] = ["create", "exec", "delete"];

/// One create + exec `true` + delete through `h`: the cycle's time, then each call's.
fn cycle(h: &testkit::Http) -> anyhow::Result<[u64; 4]> {
    let t = Instant::now();
    let (s, v) = h.req("POST", "/v1/sandboxes", Some(&json!({})));
    anyhow::ensure!(s == 201, "create: {s} {v}");
    let created = us(t);
    let id = id_of(&v)?;
    let (s, v) = h.req(
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(&json!({"argv": ["/bin/true"]})),
    );
    anyhow::ensure!(s == 200 && v["status"] == "ok", "exec: {s} {v}");
    let executed = us(t);
    let (s, v) = h.req("DELETE", &format!("/v1/sandboxes/{id}"), None);
    anyhow::ensure!(s == 204 || s == 200, "delete: {s} {v}");
    let all = us(t);
    Ok([all, created, executed - created, all - executed])
}

/// Gateway against direct, `n` cycles interleaved: the cycle's distributions and overhead,
/// and each call's p50s and overhead.
fn hop(gw: &testkit::Http, direct: &testkit::Http, n: usize) -> anyhow::Result<Value> {
    let (mut via, mut to_node) = (vec![Vec::new(); 4], vec![Vec::new(); 4]);
    for _ in 0..n {
        for (i, v) in cycle(gw)?.into_iter().enumerate() {
            via[i].push(v);
        }
        for (i, v) in cycle(direct)?.into_iter().enumerate() {
            to_node[i].push(v);
        }
    }
    let mut calls = serde_json::Map::new();
    for (k, name) in CALLS.iter().enumerate() {
        let (a, b) = (
            dist(std::mem::take(&mut via[k + 1])),
            dist(std::mem::take(&mut to_node[k + 1])),
        );
        calls.insert(
            (*name).into(),
            json!({"gateway_p50_us": a.p50_us, "direct_p50_us": b.p50_us,
                   "overhead_p50_ms": (a.p50_us as f64 - b.p50_us as f64) / 1000.0}),
        );
    }
    let (via, to_node) = (dist(via.swap_remove(0)), dist(to_node.swap_remove(0)));
    Ok(json!({"gateway": &via, "direct": &to_node,
              "overhead_p50_ms": (via.p50_us as f64 - to_node.p50_us as f64) / 1000.0,
              "ratio_p50": via.p50_us as f64 / to_node.p50_us.max(1) as f64,
              "calls": Value::Object(calls)}))
}

/// Runs the cluster benchmark.
pub fn run(args: &BenchArgs) -> anyhow::Result<ExitCode> {
    let base = PathBuf::from(format!("/tmp/dsec-bench-cluster-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base)?;
    let _cleanup = testkit::RemoveOnDrop(base.clone());
    let (_etcd, etcd) = cluster::etcd(&base);
    let mut nodes = Vec::new();
    for i in 1..=4 {
        nodes.push(node(&base, &format!("n{i}"), &etcd)?);
    }
    let key = nodes[0].key.clone();
    let (_gw, gw, _) = cluster::gateway(std::env::current_exe()?, &etcd, Some(&key));
    anyhow::ensure!(
        wait(Duration::from_secs(20), || nodes_live(&gw) == 4
            && nodes[3]
                .http()
                .with_key(Some(&key))
                .req("GET", "/v1/sandboxes", None)
                .0
                == 200),
        "the nodes did not register"
    );
    let mut out = serde_json::Map::new();

    // Gateway vs direct, interleaved, on the same node: n2–n4 are drained meanwhile, so the
    // gateway places on n1 too and the difference is the gateway's hop alone.
    let draining = |on: bool| -> anyhow::Result<()> {
        let e = dsec_cluster::etcd::Etcd::new(&etcd);
        for n in ["n2", "n3", "n4"] {
            let k = dsec_cluster::model::drain_key(n);
            if on {
                e.put(&k, b"1", 0)?;
            } else {
                e.delete(&k)?;
            }
        }
        let want = if on { 3 } else { 0 };
        anyhow::ensure!(
            wait(Duration::from_secs(10), || gw
                .req("GET", "/v1/cluster", None)
                .1["nodes"]
                .as_array()
                .map_or(0, |a| a
                    .iter()
                    .filter(|n| n["draining"] == true)
                    .count())
                == want),
            "the drains did not show"
        );
        Ok(())
    };
    draining(true)?;
    let direct = nodes[0].http().with_key(Some(&key));
    for _ in 0..5 {
        cycle(&gw)?;
        cycle(&direct)?;
    }
    let hop = hop(&gw, &direct, args.iterations)?;
    draining(false)?;
    out.insert("create_exec_delete".into(), hop);

    // A batch of 1,000 over 4 nodes.
    let t = Instant::now();
    let (s, v) = gw.req(
        "POST",
        "/v1/sandboxes/batch",
        Some(&json!({"count": 1000, "spec": {"labels": {"bench": "batch"}, "limits": {"memory_max": 16777216}}})),
    );
    let wall = t.elapsed();
    anyhow::ensure!(s == 200, "batch: {s}");
    let mut spread: BTreeMap<String, u64> = BTreeMap::new();
    let mut failed = 0;
    for i in v["items"].as_array().context("items")? {
        match i["sandbox"]["id"].as_str() {
            Some(id) => {
                let n = dsec_cluster::ids::node_number(id).unwrap_or(0);
                *spread.entry(format!("node{n}")).or_default() += 1;
            }
            None => failed += 1,
        }
    }
    let t = Instant::now();
    let (s, _) = gw.req(
        "POST",
        "/v1/sandboxes/batch-delete",
        Some(&json!({"labels": {"bench": "batch"}})),
    );
    anyhow::ensure!(s == 200, "batch delete: {s}");
    out.insert(
        "batch_1000".into(),
        json!({"create_wall_ms": wall.as_millis() as u64, "failed": failed, "spread": spread,
               "delete_wall_ms": t.elapsed().as_millis() as u64}),
    );

    out.insert("placement".into(), super::cluster_sim::placement(&base)?);

    // Node loss: n4 killed, until its sandbox answers `lost`; restarted between kills.
    let kills = if args.cycles == 100 { 10 } else { args.cycles };
    let mut detect = Vec::new();
    for _ in 0..kills {
        let (s, v) =
            nodes[3]
                .http()
                .with_key(Some(&key))
                .req("POST", "/v1/sandboxes", Some(&json!({})));
        anyhow::ensure!(s == 201, "create on n4: {s} {v}");
        let id = id_of(&v)?;
        nodes[3].kill9();
        let t = Instant::now();
        anyhow::ensure!(
            wait(Duration::from_secs(30), || gw
                .req("GET", &format!("/v1/sandboxes/{id}"), None)
                .1["state"]
                == "lost"),
            "n4 was not declared lost"
        );
        detect.push(us(t));
        let old = nodes.pop().context("n4")?;
        drop(old);
        nodes.push(node(&base, "n4", &etcd)?);
        anyhow::ensure!(
            wait(Duration::from_secs(20), || nodes_live(&gw) == 4),
            "n4 did not come back"
        );
    }
    out.insert("node_loss_detection".into(), json!(dist(detect)));
    let doc = json!({"bench": "cluster", "iterations": args.iterations, "nodes": 4,
                     "results": Value::Object(out)});
    drop(nodes);
    emit(args, doc)
}
