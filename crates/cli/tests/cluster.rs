//! The cluster, for real: an etcd member (the `etcd-server` package), two `dsec server` nodes
//! joined to it and a `dsec gateway`, as separate processes on this machine. Needs root (the
//! nodes make sandboxes) and `etcd` on the PATH; never skipped.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use dsec_testkit as testkit;
use serde_json::{json, Value};
use testkit::cluster::{self, etcd, etcd_cluster, wait, EtcdMember as Member, Proc};

fn node(base: &Path, name: &str, etcd: &str) -> testkit::Daemon {
    node_with(base, name, etcd, &[])
}

fn node_with(base: &Path, name: &str, etcd: &str, extra: &[&str]) -> testkit::Daemon {
    let (data, run) = (
        base.join(format!("{name}-d")),
        base.join(format!("{name}-r")),
    );
    let mut args = vec!["--etcd", etcd, "--node-name", name, "--pool-max", "0"];
    args.extend_from_slice(extra);
    testkit::Server::test(env!("CARGO_BIN_EXE_dsec"), &data, &run)
        .args(&args)
        .start()
        .expect("start a node")
}

/// A test's scratch dir, removed at the end.
fn scratch(tag: &str) -> (PathBuf, testkit::RemoveOnDrop) {
    let base = PathBuf::from(format!("/tmp/dsec-cluster-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base).expect("base dir");
    (base.clone(), testkit::RemoveOnDrop(base))
}

/// Waits until the gateway sees `n` nodes and `key` works on every node of `nodes`.
fn wait_registered(gw: &testkit::Http, nodes: &[&testkit::Daemon], key: &str) {
    assert!(
        wait(Duration::from_secs(20), || {
            let (_, v) = gw.req("GET", "/v1/cluster", None);
            v["nodes"].as_array().map_or(0, Vec::len) == nodes.len()
                && nodes.iter().all(|n| {
                    n.http()
                        .with_key(Some(key))
                        .req("GET", "/v1/sandboxes", None)
                        .0
                        == 200
                })
        }),
        "the nodes did not register: {}",
        gw.req("GET", "/v1/cluster", None).1
    );
}

fn gateway(etcd: &str) -> (Proc, testkit::Http, String) {
    cluster::gateway(env!("CARGO_BIN_EXE_dsec"), etcd, None)
}

/// The ids of a batch answer, by the node number they carry.
fn by_node(v: &Value) -> BTreeMap<u16, Vec<String>> {
    let mut out: BTreeMap<u16, Vec<String>> = BTreeMap::new();
    for i in v["items"].as_array().expect("items") {
        let id = i["sandbox"]["id"].as_str().expect("an id").to_owned();
        let n = dsec_cluster::ids::node_number(&id).expect("a node number");
        out.entry(n).or_default().push(id);
    }
    out
}

fn status(etcd: &str) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_dsec"))
        .args(["cluster", "status", "--json", "--etcd", etcd])
        .output()
        .expect("dsec cluster status");
    assert!(out.status.success(), "{out:?}");
    serde_json::from_slice(&out.stdout).expect("JSON")
}

/// POSTs `body` to sandbox `id`'s `call` (`exec`, `sessions/1/run`) and checks that it answers
/// 200 with `stdout`.
fn assert_stdout(h: &testkit::Http, id: &str, call: &str, body: Value, stdout: &str) {
    let (s, v) = h.req("POST", &format!("/v1/sandboxes/{id}/{call}"), Some(&body));
    assert_eq!(
        (s, v["stdout"]["data"].as_str()),
        (200, Some(stdout)),
        "{call}: {v}"
    );
}

/// Snapshots through the gateway: taken, listed, walked, forked, restored, made from and
/// deleted on sandbox `id`'s node; what this makes is gone after.
fn snapshots_pass_through(gw: &testkit::Http, id: &str) {
    let sh = |sb: &str, shell: &str| {
        let (s, v) = gw.req(
            "POST",
            &format!("/v1/sandboxes/{sb}/exec"),
            Some(&json!({"shell": shell})),
        );
        assert_eq!(s, 200, "{v}");
        v["stdout"]["data"].as_str().unwrap_or_default().to_owned()
    };
    sh(id, "echo snap > /workspace/s");
    let (s, snap) = gw.req(
        "POST",
        &format!("/v1/sandboxes/{id}/snapshots"),
        Some(&json!({})),
    );
    assert_eq!(s, 201, "{snap}");
    let sn = snap["id"].as_str().expect("id").to_owned();
    assert_eq!(
        dsec_cluster::ids::node_number(&sn),
        dsec_cluster::ids::node_number(id),
        "a snapshot's id names its node"
    );
    let (s, v) = gw.req("GET", &format!("/v1/snapshots?sandbox={id}"), None);
    assert_eq!(
        (s, v["items"][0]["id"].as_str()),
        (200, Some(sn.as_str())),
        "{v}"
    );
    let (s, v) = gw.req("GET", &format!("/v1/snapshots/{sn}/tree"), None);
    assert_eq!((s, v["id"].as_str()), (200, Some(sn.as_str())), "{v}");
    let (s, made) = gw.req("POST", "/v1/sandboxes", Some(&json!({"snapshot": sn})));
    assert_eq!(s, 201, "{made}");
    let made = made["id"].as_str().expect("id").to_owned();
    assert_eq!(sh(&made, "cat /workspace/s"), "snap\n");
    let (s, fork) = gw.req(
        "POST",
        &format!("/v1/sandboxes/{id}/fork"),
        Some(&json!({"count": 2})),
    );
    assert_eq!(s, 201, "{fork}");
    sh(id, "rm /workspace/s");
    let (s, v) = gw.req(
        "POST",
        &format!("/v1/sandboxes/{id}/restore"),
        Some(&json!({"snapshot": sn})),
    );
    assert_eq!(s, 200, "{v}");
    assert_eq!(sh(id, "cat /workspace/s"), "snap\n");
    let forks = fork["sandboxes"].as_array().expect("sandboxes");
    assert_eq!(forks.len(), 2, "{fork}");
    for f in forks
        .iter()
        .map(|f| f["id"].as_str().expect("id"))
        .chain([made.as_str()])
    {
        let (s, _) = gw.req("DELETE", &format!("/v1/sandboxes/{f}"), None);
        assert!(s == 200 || s == 204);
    }
    // A commit goes to the snapshot's node, whichever node a plain call would reach.
    let body = serde_json::to_vec(&json!({"name": "from-snap", "snapshot": sn})).expect("json");
    let r = gw
        .send(
            "POST",
            "/v1/templates",
            Some(&body),
            &[("content-type", "application/json")],
        )
        .expect("commit");
    assert_eq!(r.status, 201, "{}", r.json());
    let (s, v) = gw.req(
        "DELETE",
        &format!("/v1/snapshots/{sn}?recursive=true"),
        None,
    );
    assert_eq!(s, 200, "{v}");
    let (s, v) = gw.req("GET", &format!("/v1/snapshots/{sn}"), None);
    assert_eq!(
        (s, v["code"].as_str()),
        (404, Some("snapshot_not_found")),
        "{v}"
    );
}

/// Files, background processes with their wait, sessions and the code runner, through the
/// gateway to sandbox `id`'s node.
fn families_pass_through(gw: &testkit::Http, id: &str) {
    let put = gw
        .send(
            "PUT",
            &format!("/v1/sandboxes/{id}/files?path=/tmp/x&parents=true"),
            Some(b"hello"),
            &[],
        )
        .expect("put");
    assert_eq!(put.status, 204, "{}", String::from_utf8_lossy(&put.body));
    let get = gw
        .send(
            "GET",
            &format!("/v1/sandboxes/{id}/files?path=/tmp/x"),
            None,
            &[],
        )
        .expect("get");
    assert_eq!((get.status, get.body.as_slice()), (200, &b"hello"[..]));
    let (s, v) = gw.req(
        "POST",
        &format!("/v1/sandboxes/{id}/processes"),
        Some(&json!({"shell": "sleep 0.2; echo done"})),
    );
    assert_eq!(s, 201, "{v}");
    let h = v["handle"].as_u64().expect("handle");
    let (s, v) = gw.req(
        "POST",
        &format!("/v1/sandboxes/{id}/processes/{h}/wait"),
        Some(&json!({})),
    );
    assert_eq!(s, 200, "{v}");
    let (s, v) = gw.req(
        "POST",
        &format!("/v1/sandboxes/{id}/sessions"),
        Some(&json!({"kind": "shell"})),
    );
    assert_eq!(s, 201, "{v}");
    let sid = v["session"].as_u64().expect("session");
    gw.req(
        "POST",
        &format!("/v1/sandboxes/{id}/sessions/{sid}/run"),
        Some(&json!({"input": "X=41"})),
    );
    assert_stdout(
        gw,
        id,
        &format!("sessions/{sid}/run"),
        json!({"input": "echo $((X+1))"}),
        "42\n",
    );
    // An exec stream passes through as it comes.
    let streamed = gw
        .send(
            "POST",
            &format!("/v1/sandboxes/{id}/exec?stream=true"),
            Some(br#"{"shell": "echo one; echo two"}"#),
            &[("content-type", "application/json")],
        )
        .expect("stream");
    let text = String::from_utf8_lossy(&streamed.body);
    assert_eq!(streamed.status, 200, "{text}");
    assert!(
        text.contains("event: stdout") && text.contains("event: exit"),
        "{text}"
    );
    // A trajectory's steps run on the sandbox's node; the gateway finds it there.
    let tid = format!("tj-{id}");
    for step in 1..=2 {
        let (s, v) = gw.req(
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            Some(&json!({"shell": format!("echo step{step}"), "trajectory": tid, "step": step})),
        );
        assert_eq!(s, 200, "{v}");
    }
    let (s, v) = gw.req("GET", &format!("/v1/trajectories/{tid}"), None);
    assert_eq!(s, 200, "{v}");
    let (s, v) = gw.req("GET", &format!("/v1/trajectories/{tid}/records"), None);
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        v["items"].as_array().map(Vec::len),
        Some(4),
        "two intents and two results: {v}"
    );
    let (s, v) = gw.req("GET", "/v1/trajectories", None);
    assert_eq!(s, 200, "{v}");
    assert!(
        v["items"]
            .as_array()
            .expect("items")
            .iter()
            .any(|t| t.to_string().contains(&tid)),
        "{v}"
    );
    let (s, v) = gw.req("GET", "/v1/trajectories/no-such-one", None);
    assert_eq!(
        (s, v["code"].as_str()),
        (404, Some("trajectory_not_found")),
        "{v}"
    );
    let (s, v) = gw.req(
        "POST",
        "/run_code",
        Some(&json!({"code": "print(6*7)", "language": "python"})),
    );
    assert_eq!(
        (s, v["run_result"]["stdout"].as_str()),
        (200, Some("42\n")),
        "{v}"
    );
}

#[test]
fn a_gateway_places_routes_and_declares_a_killed_node_lost() {
    let base = PathBuf::from(format!("/tmp/dsec-cluster-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base).expect("base dir");
    let _cleanup = testkit::RemoveOnDrop(base.clone());
    let (_etcd, etcd_url) = etcd(&base);
    let n1 = node(&base, "n1", &etcd_url);
    let mut n2 = node(&base, "n2", &etcd_url);
    let (_gw, gw, _) = gateway(&etcd_url);
    let gw = gw.with_key(Some(&n1.key));
    // Both nodes registered, and n1's admin key reached n2 (keys are shared by tenant name).
    assert!(
        wait(Duration::from_secs(15), || {
            let (_, v) = gw.req("GET", "/v1/cluster", None);
            let (s, _) = n2
                .http()
                .with_key(Some(&n1.key))
                .req("GET", "/v1/sandboxes", None);
            v["nodes"].as_array().map_or(0, Vec::len) == 2 && s == 200
        }),
        "the nodes did not register"
    );

    // A batch is spread over the nodes; every sandbox answers through the gateway.
    let (s, v) = gw.req(
        "POST",
        "/v1/sandboxes/batch",
        Some(&json!({"count": 6, "spec": {"labels": {"t": "c"}}})),
    );
    assert_eq!(s, 200, "{v}");
    let spread = by_node(&v);
    assert_eq!(
        spread.values().map(Vec::len).collect::<Vec<_>>(),
        [3, 3],
        "{spread:?}"
    );
    for id in spread.values().flatten() {
        assert_stdout(
            &gw,
            id,
            "exec",
            json!({"argv": ["hostname"]}),
            &format!("{id}\n"),
        );
    }
    let (s, v) = gw.req("GET", "/v1/sandboxes", None);
    assert_eq!(
        (s, v["items"].as_array().map_or(0, Vec::len)),
        (200, 6),
        "{v}"
    );
    families_pass_through(&gw, &spread[spread.keys().nth(1).expect("n2")][1]);
    snapshots_pass_through(&gw, &spread[spread.keys().nth(1).expect("n2")][1]);
    let (s, one) = gw.req(
        "POST",
        "/v1/sandboxes",
        Some(&json!({"labels": {"t": "c"}})),
    );
    assert_eq!(s, 201, "{one}");
    let st = status(&etcd_url);
    assert_eq!(st["nodes"].as_array().map_or(0, Vec::len), 2, "{st}");

    // A tenant's max_sandboxes holds across the cluster, not per node.
    let (s, t) = gw.req(
        "POST",
        "/v1/tenants",
        Some(&json!({"name": "three", "max_sandboxes": 3})),
    );
    assert_eq!(s, 201, "{t}");
    let tkey = t["api_key"].as_str().expect("api_key").to_owned();
    let tgw = gw.with_key(Some(&tkey));
    assert!(
        wait(Duration::from_secs(15), || [&n1, &n2].iter().all(|n| n
            .http()
            .with_key(Some(&tkey))
            .req("GET", "/v1/tenant", None)
            .0
            == 200)),
        "the tenant's key did not reach both nodes"
    );
    // The gateway learns the quota from etcd within a refresh.
    assert!(
        wait(Duration::from_secs(10), || gw
            .req("GET", "/v1/cluster", None)
            .1["keys_with_quota"]
            == 1),
        "{}",
        gw.req("GET", "/v1/cluster", None).1
    );
    let (s, v) = tgw.req(
        "POST",
        "/v1/sandboxes/batch",
        Some(&json!({"count": 2, "spec": {"labels": {"t": "q"}}})),
    );
    assert_eq!(s, 200, "{v}");
    assert_eq!(by_node(&v).len(), 2, "spread over both nodes: {v}");
    let (s, v) = tgw.req(
        "POST",
        "/v1/sandboxes",
        Some(&json!({"labels": {"t": "q"}})),
    );
    assert_eq!(s, 201, "{v}");
    let (s, v) = tgw.req(
        "POST",
        "/v1/sandboxes",
        Some(&json!({"labels": {"t": "q"}})),
    );
    assert_eq!(
        (s, v["code"].as_str()),
        (429, Some("quota_exceeded")),
        "{v}"
    );
    let (s, v) = tgw.req(
        "POST",
        "/v1/sandboxes/batch-delete",
        Some(&json!({"labels": {"t": "q"}})),
    );
    assert_eq!(s, 200, "{v}");

    // An idempotent create retried on another gateway gets the same sandbox.
    let (_gw2, gw2, _) = gateway(&etcd_url);
    let gw2 = gw2.with_key(Some(&n1.key));
    let body = br#"{"labels": {"t": "c"}}"#;
    let idem = [
        ("Idempotency-Key", "cluster-retry-1"),
        ("content-type", "application/json"),
    ];
    let a = gw
        .send("POST", "/v1/sandboxes", Some(body), &idem)
        .expect("create");
    assert!(wait(Duration::from_secs(5), || gw2
        .req("GET", "/v1/cluster", None)
        .0
        == 200));
    let b = gw2
        .send("POST", "/v1/sandboxes", Some(body), &idem)
        .expect("retry");
    assert_eq!(a.status, 201, "{}", String::from_utf8_lossy(&a.body));
    assert_eq!(
        a.json()["id"],
        b.json()["id"],
        "{}",
        String::from_utf8_lossy(&b.body)
    );
    // A gateway killed while creates are in flight: each retried on another gateway with its
    // Idempotency-Key ends with exactly one sandbox, whenever the kill landed (before the
    // placement was pinned, before the node was asked, or after).
    let (mut g3p, g3, _) = gateway(&etcd_url);
    let g3 = g3.with_key(Some(&n1.key));
    assert!(wait(Duration::from_secs(5), || g3
        .req("GET", "/v1/cluster", None)
        .1["nodes"]
        .as_array()
        .is_some_and(|a| a.len() == 2)));
    let keys: Vec<String> = (0..6).map(|i| format!("cluster-kill-{i}")).collect();
    std::thread::scope(|s| {
        for (i, k) in keys.iter().enumerate() {
            let g3 = &g3;
            s.spawn(move || {
                std::thread::sleep(Duration::from_millis(2 * i as u64));
                let body = format!(r#"{{"labels": {{"t": "kill", "k": "{k}"}}}}"#);
                let _ = g3.send(
                    "POST",
                    "/v1/sandboxes",
                    Some(body.as_bytes()),
                    &[("Idempotency-Key", k), ("content-type", "application/json")],
                );
            });
        }
        std::thread::sleep(Duration::from_millis(6));
        let _ = g3p.0.kill();
    });
    for k in &keys {
        let body = format!(r#"{{"labels": {{"t": "kill", "k": "{k}"}}}}"#);
        let r = gw2
            .send(
                "POST",
                "/v1/sandboxes",
                Some(body.as_bytes()),
                &[("Idempotency-Key", k), ("content-type", "application/json")],
            )
            .expect("retry");
        assert!(
            r.status == 201 || r.status == 200,
            "{}",
            String::from_utf8_lossy(&r.body)
        );
        let (_, v) = gw2.req("GET", &format!("/v1/sandboxes?label=k={k}"), None);
        assert_eq!(
            v["items"].as_array().map(Vec::len),
            Some(1),
            "one sandbox for {k}: {v}"
        );
    }
    let (s, v) = gw.req(
        "POST",
        "/v1/sandboxes/batch-delete",
        Some(&json!({"labels": {"t": "kill"}})),
    );
    assert_eq!(s, 200, "{v}");

    // A drained node gets no new sandbox; undrained, it does again.
    let drain = |undo: bool| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_dsec"));
        c.args(["cluster", "drain", "n1", "--etcd", &etcd_url]);
        if undo {
            c.arg("--undo");
        }
        assert!(c.status().expect("dsec cluster drain").success());
    };
    // A pool set on one node is kept by every node (published in etcd). n1 keeps 2 ready;
    // drained, it empties; undrained, it refills.
    let n1h = n1.http().with_key(Some(&n1.key));
    let n2h = n2.http().with_key(Some(&n1.key));
    let (s, v) = n1h.req("PUT", "/v1/pools/host", Some(&json!({"min": 2, "max": 2})));
    assert_eq!(s, 200, "{v}");
    let ready = || n1h.req("GET", "/v1/pools/host", None).1["ready"].as_u64();
    let ready2 = || n2h.req("GET", "/v1/pools/host", None).1["ready"].as_u64();
    assert!(
        wait(Duration::from_secs(20), || ready() == Some(2)),
        "{:?}",
        ready()
    );
    assert!(
        wait(Duration::from_secs(20), || ready2() == Some(2)),
        "the pool did not reach n2: {:?}",
        ready2()
    );
    drain(false);
    assert!(
        wait(Duration::from_secs(10), || ready() == Some(0)),
        "{:?}",
        ready()
    );
    assert!(wait(Duration::from_secs(10), || gw
        .req("GET", "/v1/cluster", None)
        .1["nodes"]
        .as_array()
        .is_some_and(|a| a
            .iter()
            .any(|n| n["name"] == "n1" && n["draining"] == true))));
    let (s, v) = gw.req(
        "POST",
        "/v1/sandboxes/batch",
        Some(&json!({"count": 4, "spec": {"labels": {"t": "c"}}})),
    );
    assert_eq!(s, 200, "{v}");
    let n1_number = *spread.keys().next().expect("n1's number");
    assert!(
        !by_node(&v).contains_key(&n1_number),
        "placed on a draining node: {v}"
    );
    drain(true);
    assert!(wait(Duration::from_secs(10), || gw
        .req("GET", "/v1/cluster", None)
        .1["nodes"]
        .as_array()
        .is_some_and(|a| a.iter().all(|n| n["draining"] == false))));
    assert!(
        wait(Duration::from_secs(20), || ready() == Some(2)),
        "{:?}",
        ready()
    );
    // Set through the gateway, for the whole cluster.
    let (s, v) = gw.req("PUT", "/v1/pools/host", Some(&json!({"min": 0, "max": 0})));
    assert_eq!(s, 200, "{v}");
    assert!(
        wait(Duration::from_secs(20), || ready() == Some(0)
            && ready2() == Some(0)),
        "{:?} {:?}",
        ready(),
        ready2()
    );

    // n2 is killed: its sandboxes are `lost` within 10 s, calls to them `node_lost`.
    let n2_number = *spread.keys().nth(1).expect("n2's number");
    let victim = spread[&n2_number][0].clone();
    n2.kill9();
    let killed = Instant::now();
    assert!(
        wait(Duration::from_secs(10), || gw
            .req("GET", &format!("/v1/sandboxes/{victim}"), None)
            .1["state"]
            == "lost"),
        "not lost within 10 s"
    );
    eprintln!("node lost after {:?}", killed.elapsed());
    let (s, v) = gw.req(
        "POST",
        &format!("/v1/sandboxes/{victim}/exec"),
        Some(&json!({"argv": ["true"]})),
    );
    assert_eq!((s, v["code"].as_str()), (410, Some("node_lost")), "{v}");
    assert!(status(&etcd_url)["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .any(|n| n["state"] == "lost"));
    // New sandboxes go to the node that is left.
    let (s, v) = gw.req(
        "POST",
        "/v1/sandboxes/batch",
        Some(&json!({"count": 2, "spec": {"labels": {"t": "c"}}})),
    );
    assert_eq!(s, 200, "{v}");
    assert_eq!(by_node(&v).keys().count(), 1, "{v}");

    // n2 comes back after it was declared lost: what it held is destroyed, not resurrected.
    let n2 = node(&base, "n2", &etcd_url);
    assert!(
        wait(Duration::from_secs(15), || {
            let (s, v) = n2.req("GET", "/v1/sandboxes", None);
            s == 200 && v["items"].as_array().is_some_and(Vec::is_empty)
        }),
        "n2 kept the sandboxes the cluster declared lost"
    );
    assert!(wait(Duration::from_secs(10), || gw
        .req("GET", "/v1/cluster", None)
        .1["nodes"]
        .as_array()
        .map_or(0, Vec::len)
        == 2));
    let (s, v) = gw.req(
        "POST",
        "/v1/sandboxes/batch-delete",
        Some(&json!({"labels": {"t": "c"}})),
    );
    // n1's: three of the first batch, the single and the idempotent one when placed there, the two placed
    // after the loss.
    let items = v["items"].as_array().expect("items");
    assert!(s == 200 && (5..=7).contains(&items.len()), "{v}");
    assert!(items.iter().all(|i| i["ok"] == true), "{v}");
    drop(n2);
    drop(n1);
}

/// etcd loses its quorum: calls to existing sandboxes go on through the gateway, creates answer
/// `503 unavailable` with `Retry-After`; when the quorum is back, creates work again and
/// nothing was lost.
#[test]
fn etcd_quorum_loss_keeps_calls_and_holds_creates() {
    let base = PathBuf::from(format!("/tmp/dsec-cluster-quorum-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base).expect("base dir");
    let _cleanup = testkit::RemoveOnDrop(base.clone());
    let (members, mut procs, urls) = etcd_cluster(&base, 3);
    let n1 = node(&base, "n1", &urls);
    let (_gw, gw, _) = gateway(&urls);
    let gw = gw.with_key(Some(&n1.key));
    assert!(wait(Duration::from_secs(15), || gw
        .req("GET", "/v1/cluster", None)
        .1["nodes"]
        .as_array()
        .map_or(0, Vec::len)
        == 1));
    let (s, v) = gw.req(
        "POST",
        "/v1/sandboxes",
        Some(&json!({"labels": {"t": "q"}})),
    );
    assert_eq!(s, 201, "{v}");
    let id = v["id"].as_str().expect("id").to_owned();
    // Two of three members gone: no quorum.
    drop(procs.drain(1..).collect::<Vec<_>>());
    let create = |gw: &testkit::Http| {
        gw.send(
            "POST",
            "/v1/sandboxes",
            Some(br#"{"labels": {"t": "q"}}"#),
            &[("content-type", "application/json")],
        )
        .expect("create")
    };
    assert!(
        wait(Duration::from_secs(20), || {
            let r = create(&gw);
            r.status == 503
                && r.json()["code"] == "unavailable"
                && r.headers.contains_key("retry-after")
        }),
        "creates were not held"
    );
    for _ in 0..5 {
        let (s, v) = gw.req(
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            Some(&json!({"argv": ["true"]})),
        );
        assert_eq!((s, v["status"].as_str()), (200, Some("ok")), "{v}");
    }
    // Quorum back: creates again, and the first sandbox is still there.
    procs.extend(members[1..].iter().map(Member::start));
    assert!(
        wait(Duration::from_secs(30), || create(&gw).status == 201),
        "creates did not come back with the quorum"
    );
    let (s, v) = gw.req("GET", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!((s, v["state"].as_str()), (200, Some("running")), "{v}");
    let (s, v) = gw.req(
        "POST",
        "/v1/sandboxes/batch-delete",
        Some(&json!({"labels": {"t": "q"}})),
    );
    assert_eq!(s, 200, "{v}");
    drop(n1);
}

/// A template imported through a gateway is stored once (the origin store, a shared directory)
/// and its record reaches etcd; creates prefer the node that holds it; a node that does not hold
/// it fetches it — from a peer that does, else from the origin — verified, and says so in the
/// create's `fetched`.
#[test]
fn templates_are_stored_once_and_fetched_from_a_peer_or_the_origin() {
    let (base, _cleanup) = scratch("tpl");
    let origin = base.join("origin");
    let origin_arg = origin.to_str().expect("utf-8").to_owned();
    let (_etcd, etcd_url) = etcd(&base);
    let extra = ["--template-store", origin_arg.as_str()];
    let nodes: Vec<testkit::Daemon> = ["t1", "t2", "t3"]
        .iter()
        .map(|n| node_with(&base, n, &etcd_url, &extra))
        .collect();
    let (_gw, gw, _) = gateway(&etcd_url);
    let key = nodes[0].key.clone();
    let gw = gw.with_key(Some(&key));
    wait_registered(&gw, &nodes.iter().collect::<Vec<_>>(), &key);

    let tarball = testkit::rootfs_tarball(&base, "rootfs", "shared template\n");
    let body = std::fs::read(&tarball).expect("tarball");
    let r = gw
        .send("POST", "/v1/templates?name=tiny", Some(&body), &[])
        .expect("import");
    assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
    let digest = r.json()["layers"][0]["digest"]
        .as_str()
        .expect("a stored layer")
        .trim_start_matches("sha256:")
        .to_owned();
    // Stored once, in the origin, under its digest: the bytes hash to it.
    let blob = std::fs::read(origin.join("blobs").join(&digest)).expect("the origin's blob");
    assert_eq!(hex_sha256(&blob), digest);
    // Every node lists it; one node holds it.
    for n in &nodes {
        let (s, v) = n
            .http()
            .with_key(Some(&key))
            .req("GET", "/v1/templates/tiny", None);
        assert_eq!(s, 200, "{v}");
    }
    let holders = || -> Vec<String> {
        let (_, v) = gw.req("GET", "/v1/cluster", None);
        v["nodes"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|n| {
                n["templates"]
                    .as_array()
                    .is_some_and(|t| t.iter().any(|t| t == "tiny"))
            })
            .filter_map(|n| n["name"].as_str().map(str::to_owned))
            .collect()
    };
    assert!(
        wait(Duration::from_secs(10), || holders().len() == 1),
        "{:?}",
        holders()
    );
    let holder = holders()[0].clone();
    let number_of = |name: &str| -> u16 {
        let (_, v) = gw.req("GET", "/v1/cluster", None);
        v["nodes"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|n| n["name"] == name)
            .and_then(|n| n["number"].as_u64())
            .expect("a number") as u16
    };

    // Affinity: through the gateway, the create goes where the template is; nothing fetched.
    let (s, v) = gw.req("POST", "/v1/sandboxes", Some(&json!({"template": "tiny"})));
    assert_eq!(s, 201, "{v}");
    let id = v["id"].as_str().expect("id");
    assert_eq!(
        dsec_cluster::ids::node_number(id),
        Some(number_of(&holder)),
        "{v}"
    );
    assert!(v.get("fetched").is_none(), "{v}");

    // A node without it fetches it from the peer that holds it.
    let others: Vec<&testkit::Daemon> = ["t1", "t2", "t3"]
        .iter()
        .zip(&nodes)
        .filter(|(n, _)| **n != holder)
        .map(|(_, d)| d)
        .collect();
    let (s, v) = others[0].http().with_key(Some(&key)).req(
        "POST",
        "/v1/sandboxes",
        Some(&json!({"template": "tiny"})),
    );
    assert_eq!(s, 201, "{v}");
    assert_eq!(v["fetched"]["layers"], 1, "{v}");
    assert_eq!(
        v["fetched"]["from"],
        json!([format!("node:{holder}")]),
        "{v}"
    );
    assert_eq!(
        v["fetched"]["bytes"].as_u64(),
        Some(blob.len() as u64),
        "{v}"
    );
    let id = v["id"].as_str().expect("id").to_owned();
    let motd = gw
        .send(
            "GET",
            &format!("/v1/sandboxes/{id}/files?path=/etc/motd"),
            None,
            &[],
        )
        .expect("read");
    assert_eq!(motd.body, b"shared template\n");

    // With no peer able to serve it (their blobs gone), the origin does.
    for d in [&base.join(format!("{holder}-d")), &others[0].data] {
        let _ = std::fs::remove_file(d.join("blobs").join(&digest));
    }
    let (s, v) = others[1].http().with_key(Some(&key)).req(
        "POST",
        "/v1/sandboxes",
        Some(&json!({"template": "tiny"})),
    );
    assert_eq!(s, 201, "{v}");
    assert_eq!(v["fetched"]["from"], json!(["origin"]), "{v}");

    // A template the cluster does not know is not found anywhere.
    let (s, v) = gw.req("POST", "/v1/sandboxes", Some(&json!({"template": "nope"})));
    assert_eq!(
        (s, v["code"].as_str()),
        (404, Some("template_not_found")),
        "{v}"
    );
    // A layer call without the cluster secret is refused.
    let r = nodes[0]
        .http()
        .send("GET", &format!("/v1/cluster/layers/{digest}"), None, &[])
        .expect("layer call");
    assert_eq!(r.status, 401);
}

fn hex_sha256(b: &[u8]) -> String {
    use sha2::Digest as _;
    hex::encode(sha2::Sha256::digest(b))
}

/// Two gateways racing for a node's last slots never overcommit it: the node admits up to its
/// maximum, and a gateway whose create it refuses tries the next node or answers
/// `capacity_exhausted`.
#[test]
fn two_gateways_racing_for_the_last_slots_never_overcommit() {
    let (base, _cleanup) = scratch("race");
    let (_etcd, etcd_url) = etcd(&base);
    let n = node_with(&base, "r1", &etcd_url, &["--max-sandboxes", "4"]);
    let (_g1, g1, _) = gateway(&etcd_url);
    let (_g2, g2, _) = gateway(&etcd_url);
    let (g1, g2) = (g1.with_key(Some(&n.key)), g2.with_key(Some(&n.key)));
    wait_registered(&g1, &[&n], &n.key);
    wait_registered(&g2, &[&n], &n.key);
    let results: Vec<(u16, Value)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..10)
            .map(|i| {
                let g = if i % 2 == 0 { &g1 } else { &g2 };
                s.spawn(move || {
                    g.req(
                        "POST",
                        "/v1/sandboxes",
                        Some(&json!({"labels": {"t": "race"}})),
                    )
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("thread")).collect()
    });
    let made = results.iter().filter(|(s, _)| *s == 201).count();
    assert_eq!(made, 4, "{results:?}");
    for (s, v) in results.iter().filter(|(s, _)| *s != 201) {
        assert_eq!(*s, 503, "{v}");
        assert!(
            matches!(
                v["code"].as_str(),
                Some("resource_exhausted" | "capacity_exhausted")
            ),
            "{v}"
        );
    }
    let (_, v) = n.req("GET", "/v1/sandboxes", None);
    assert_eq!(v["items"].as_array().map(Vec::len), Some(4), "{v}");
    // The autoscaling signals: creates refused for capacity wait, the one node is full, so
    // the cluster wants more nodes, now.
    assert!(
        wait(Duration::from_secs(5), || {
            let (_, v) = g1.req("GET", "/v1/cluster", None);
            v["queue_depth"].as_u64() > Some(0) && v["desired_nodes"].as_u64() >= Some(2)
        }),
        "{}",
        g1.req("GET", "/v1/cluster", None).1
    );
    let m = g1.send("GET", "/metrics", None, &[]).expect("metrics");
    assert!(
        String::from_utf8_lossy(&m.body).contains("dsec_gateway_desired_nodes "),
        "{}",
        String::from_utf8_lossy(&m.body)
    );
    let (s, v) = g1.req(
        "POST",
        "/v1/sandboxes/batch-delete",
        Some(&json!({"labels": {"t": "race"}})),
    );
    assert_eq!(s, 200, "{v}");
    // Creates and deletes back to back, each sandbox promised a quarter of the node's memory:
    // the gateway's count of its own recent placements never makes the node look full.
    let quarter = g1.req("GET", "/v1/cluster", None).1["nodes"][0]["memory_bytes"]
        .as_u64()
        .expect("memory")
        / 4;
    for i in 0..12 {
        let (s, v) = g1.req(
            "POST",
            "/v1/sandboxes",
            Some(&json!({"limits": {"memory_max": quarter}})),
        );
        assert_eq!(s, 201, "cycle {i}: {v}");
        let id = v["id"].as_str().expect("id");
        let (s, v) = g1.req("DELETE", &format!("/v1/sandboxes/{id}"), None);
        assert!(s == 200 || s == 204, "{v}");
    }
}

/// The VM substrates through the gateway: a `microvm` sandbox is placed, its exec and files
/// routed, like a container's (slow under TCG the first time: the node builds its VM cache).
#[test]
fn a_microvm_sandbox_and_network_egress_work_through_the_gateway() {
    let (base, _cleanup) = scratch("vm");
    let (_etcd, etcd_url) = etcd(&base);
    let n = node(&base, "v1", &etcd_url);
    let (_gw, gw, _) = gateway(&etcd_url);
    let gw = gw.with_key(Some(&n.key));
    wait_registered(&gw, &[&n], &n.key);
    let (s, v) = gw.req(
        "POST",
        "/v1/sandboxes",
        Some(&json!({"substrate": "microvm"})),
    );
    assert_eq!(s, 201, "{v}");
    let id = v["id"].as_str().expect("id").to_owned();
    assert_eq!(v["substrate"], "microvm", "{v}");
    assert_stdout(
        &gw,
        &id,
        "exec",
        json!({"shell": "echo in-a-vm > /tmp/f; cat /tmp/f"}),
        "in-a-vm\n",
    );
    let f = gw
        .send(
            "GET",
            &format!("/v1/sandboxes/{id}/files?path=/tmp/f"),
            None,
            &[],
        )
        .expect("read");
    assert_eq!(f.body, b"in-a-vm\n");
    let (s, v) = gw.req("DELETE", &format!("/v1/sandboxes/{id}"), None);
    assert!(s == 200 || s == 204, "{v}");

    // Network egress through the gateway: a policy on create, changed on a running sandbox.
    let (s, v) = gw.req(
        "POST",
        "/v1/sandboxes",
        Some(&json!({"network": {"egress": {"allow": ["192.0.2.0/24:443"]}}})),
    );
    assert_eq!(s, 201, "{v}");
    let id = v["id"].as_str().expect("id").to_owned();
    assert!(v["network_address"].is_string(), "{v}");
    assert_stdout(
        &gw,
        &id,
        "exec",
        json!({"shell": "grep -c eth0 /proc/net/dev"}),
        "1\n",
    );
    let (s, v) = gw.req(
        "PUT",
        &format!("/v1/sandboxes/{id}/network"),
        Some(&json!({"egress": "none"})),
    );
    assert_eq!(s, 200, "{v}");
    assert!(v.get("network_address").is_none(), "{v}");
    assert_stdout(
        &gw,
        &id,
        "exec",
        json!({"shell": "grep -c eth0 /proc/net/dev || true"}),
        "0\n",
    );
    let (s, v) = gw.req("DELETE", &format!("/v1/sandboxes/{id}"), None);
    assert!(s == 200 || s == 204, "{v}");
}

/// Network egress never reaches the cluster's gateways: each gateway registers its addresses
/// under a lease of its own (`gateways/<id>`), and every node adds the registered addresses to
/// the networks no sandbox reaches, open connections included. Here a registration at the fake
/// internet's address (what a gateway on another host would write) cuts a sandbox's allowed
/// path to it.
#[test]
fn egress_never_reaches_the_clusters_gateways() {
    use base64::Engine as _;
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let net = testkit::fakenet::FakeNet::start().expect("fake internet");
    let (base, _cleanup) = scratch("gwnever");
    let (_etcd, etcd_url) = etcd(&base);
    let resolver = net.dns().to_string();
    let n = node_with(&base, "g1", &etcd_url, &["--egress-resolver", &resolver]);
    let (_gw, gw, _) = gateway(&etcd_url);
    let gw = gw.with_key(Some(&n.key));
    wait_registered(&gw, &[&n], &n.key);
    let etcd_http = testkit::Http::new(&etcd_url, None, Some(Duration::from_secs(5)));
    let registrations = || -> Vec<Value> {
        let range = json!({"key": b64("/dsec/gateways/"), "range_end": b64("/dsec/gateways0")});
        let (_, v) = etcd_http.req("POST", "/v3/kv/range", Some(&range));
        v["kvs"]
            .as_array()
            .map(|kvs| {
                kvs.iter()
                    .filter_map(|kv| {
                        let raw = base64::engine::general_purpose::STANDARD
                            .decode(kv["value"].as_str()?)
                            .ok()?;
                        serde_json::from_slice(&raw).ok()
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    assert!(
        wait(Duration::from_secs(10), || registrations()
            .iter()
            .any(|r| r["addrs"] == json!(["127.0.0.1"]))),
        "the gateway registers the address it listens on: {:?}",
        registrations()
    );

    let web = net.web();
    let (s, v) = gw.req(
        "POST",
        "/v1/sandboxes",
        Some(&json!({"network": {"egress": {"allow": [format!("{web}/32")]}}})),
    );
    assert_eq!(s, 201, "{v}");
    let id = v["id"].as_str().expect("id").to_owned();
    let reaches = || {
        let body = json!({"shell": format!("curl -sS --max-time 3 http://{web}/whoami")});
        let (s, v) = gw.req("POST", &format!("/v1/sandboxes/{id}/exec"), Some(&body));
        assert_eq!(s, 200, "{v}");
        v["exit_code"] == 0
    };
    assert!(reaches(), "allowed by its policy");
    let put = json!({
        "key": b64("/dsec/gateways/elsewhere"),
        "value": b64(&json!({"addrs": [web.to_string()]}).to_string()),
    });
    let (s, v) = etcd_http.req("POST", "/v3/kv/put", Some(&put));
    assert_eq!(s, 200, "{v}");
    assert!(
        wait(Duration::from_secs(10), || !reaches()),
        "a gateway's address is never reached, whatever the policy"
    );
    let k = std::fs::read_to_string(n.data.join("egress-index")).expect("egress index");
    let set = Command::new("nft")
        .args([
            "list",
            "set",
            "inet",
            &format!("dsec_{}", k.trim()),
            "never4",
        ])
        .output()
        .expect("nft");
    let set = String::from_utf8_lossy(&set.stdout);
    assert!(set.contains(&web.to_string()), "{set}");
    let (s, v) = gw.req("DELETE", &format!("/v1/sandboxes/{id}"), None);
    assert!(s == 200 || s == 204, "{v}");
}

/// The tests' Python (its venv has moto and boto3).
fn s3_python() -> String {
    std::env::var("DSEC_TEST_PYTHON").unwrap_or_else(|_| {
        format!(
            "{}/../../target/pyvenv/bin/python",
            env!("CARGO_MANIFEST_DIR")
        )
    })
}

/// An S3 server installed from PyPI (`moto[server]`, in the tests' venv): its process and URL.
fn s3_server(base: &Path) -> (Proc, String) {
    let python = s3_python();
    let moto = Path::new(&python).with_file_name("moto_server");
    assert!(
        moto.exists(),
        "{} is missing: run through scripts/test.sh (its venv has moto[server]), or set \
         DSEC_TEST_PYTHON to a venv's python with it",
        moto.display()
    );
    let port = testkit::free_port();
    let child = Command::new(&moto)
        .args(["-H", "127.0.0.1", "-p", &port.to_string()])
        .current_dir(base)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start moto_server");
    let url = format!("http://127.0.0.1:{port}");
    let h = testkit::Http::new(&url, None, Some(Duration::from_secs(5)));
    assert!(
        wait(Duration::from_secs(30), || h
            .send("GET", "/", None, &[])
            .is_ok()),
        "moto_server did not start"
    );
    (Proc(child), url)
}

/// The origin store as an S3 bucket (a real S3 server): an import's blob is uploaded there
/// (signed with AWS Signature Version 4), and a node no peer can serve fetches it from there.
#[test]
fn the_origin_store_can_be_an_s3_bucket() {
    let (base, _cleanup) = scratch("s3");
    let (_s3, s3_url) = s3_server(&base);
    let s3 = testkit::Http::new(&s3_url, None, Some(Duration::from_secs(5)));
    let made = s3
        .send("PUT", "/dsec-layers", None, &[])
        .expect("make the bucket");
    assert_eq!(made.status, 200, "{}", String::from_utf8_lossy(&made.body));
    let (_etcd, etcd_url) = etcd(&base);
    let start = |name: &str| {
        let (data, run) = (
            base.join(format!("{name}-d")),
            base.join(format!("{name}-r")),
        );
        testkit::Server::test(env!("CARGO_BIN_EXE_dsec"), &data, &run)
            .args(&["--etcd", &etcd_url, "--node-name", name, "--pool-max", "0"])
            .args(&["--template-store", "s3://dsec-layers/cluster-a"])
            .env("AWS_ENDPOINT_URL", &s3_url)
            .env("AWS_ACCESS_KEY_ID", "testing")
            .env("AWS_SECRET_ACCESS_KEY", "testing")
            .start()
            .expect("start a node")
    };
    let (a, b) = (start("s1"), start("s2"));
    let key = a.key.clone();
    let b_http = b.http().with_key(Some(&key));
    assert!(
        wait(Duration::from_secs(20), || b_http
            .req("GET", "/v1/sandboxes", None)
            .0
            == 200),
        "the admin key did not reach s2"
    );
    let tarball = testkit::rootfs_tarball(&base, "rootfs", "from the bucket\n");
    let body = std::fs::read(&tarball).expect("tarball");
    let r = a
        .http()
        .with_key(Some(&key))
        .send("POST", "/v1/templates?name=bucketed", Some(&body), &[])
        .expect("import");
    assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
    let digest = r.json()["layers"][0]["digest"]
        .as_str()
        .expect("a stored layer")
        .trim_start_matches("sha256:")
        .to_owned();
    // Another S3 client (boto3, which came with moto) finds the blob under its digest.
    let python = Path::new(&s3_python()).to_owned();
    let out = Command::new(&python)
        .args([
            "-c",
            "import boto3,hashlib,sys; c=boto3.client('s3',endpoint_url=sys.argv[1],region_name='us-east-1',aws_access_key_id='testing',aws_secret_access_key='testing'); print(hashlib.sha256(c.get_object(Bucket='dsec-layers',Key='cluster-a/blobs/'+sys.argv[2])['Body'].read()).hexdigest())",
            &s3_url,
            &digest,
        ])
        .output()
        .expect("boto3");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        digest,
        "the bucket holds the blob"
    );
    // s1 cannot serve it (its blob gone): s2 fetches it from the bucket.
    std::fs::remove_file(a.data.join("blobs").join(&digest)).expect("remove s1's blob");
    let (s, v) = b_http.req(
        "POST",
        "/v1/sandboxes",
        Some(&json!({"template": "bucketed"})),
    );
    assert_eq!(s, 201, "{v}");
    assert_eq!(v["fetched"]["from"], json!(["origin"]), "{v}");
    let id = v["id"].as_str().expect("id");
    let motd = b_http
        .send(
            "GET",
            &format!("/v1/sandboxes/{id}/files?path=/etc/motd"),
            None,
            &[],
        )
        .expect("read");
    assert_eq!(motd.body, b"from the bucket\n");
}

/// A tenant's `max_sandboxes` is exact across the cluster: creates racing through two gateways
/// onto two nodes get exactly the quota; a delete frees a slot for the next create.
#[test]
fn a_tenant_quota_holds_exactly_across_gateways_and_nodes() {
    let (base, _cleanup) = scratch("quota");
    let (_etcd, etcd_url) = etcd(&base);
    let (a, b) = (node(&base, "q1", &etcd_url), node(&base, "q2", &etcd_url));
    let (_g1, g1, _) = gateway(&etcd_url);
    let (_g2, g2, _) = gateway(&etcd_url);
    let admin = g1.with_key(Some(&a.key));
    wait_registered(&admin, &[&a, &b], &a.key);
    let (s, t) = admin.req(
        "POST",
        "/v1/tenants",
        Some(&json!({"name": "three-exact", "max_sandboxes": 3})),
    );
    assert_eq!(s, 201, "{t}");
    let key = t["api_key"].as_str().expect("api_key").to_owned();
    assert!(
        wait(Duration::from_secs(15), || [&a, &b].iter().all(|n| n
            .http()
            .with_key(Some(&key))
            .req("GET", "/v1/tenant", None)
            .0
            == 200)),
        "the tenant's key did not reach both nodes"
    );
    let (g1, g2) = (g1.with_key(Some(&key)), g2.with_key(Some(&key)));
    let results: Vec<(u16, Value)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..8)
            .map(|i| {
                let g = if i % 2 == 0 { &g1 } else { &g2 };
                s.spawn(move || g.req("POST", "/v1/sandboxes", Some(&json!({}))))
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("thread")).collect()
    });
    let made: Vec<&Value> = results
        .iter()
        .filter(|(s, _)| *s == 201)
        .map(|(_, v)| v)
        .collect();
    assert_eq!(made.len(), 3, "{results:?}");
    for (s, v) in results.iter().filter(|(s, _)| *s != 201) {
        assert_eq!(
            (*s, v["code"].as_str()),
            (429, Some("quota_exceeded")),
            "{v}"
        );
    }
    // Direct to a node, past the gateways: still refused.
    let (s, v) = b
        .http()
        .with_key(Some(&key))
        .req("POST", "/v1/sandboxes", Some(&json!({})));
    assert_eq!(
        (s, v["code"].as_str()),
        (429, Some("quota_exceeded")),
        "{v}"
    );
    // A delete frees one.
    let id = made[0]["id"].as_str().expect("id");
    let (s, v) = g2.req("DELETE", &format!("/v1/sandboxes/{id}"), None);
    assert!(s == 200 || s == 204, "{v}");
    let (s, v) = a
        .http()
        .with_key(Some(&key))
        .req("POST", "/v1/sandboxes", Some(&json!({})));
    assert_eq!(s, 201, "{v}");
}

/// One Connect envelope: `flags`, the JSON's length (u32, big-endian), the JSON.
fn envelope(flags: u8, v: &Value) -> Vec<u8> {
    let json = v.to_string().into_bytes();
    let mut out = vec![flags];
    out.extend_from_slice(&(json.len() as u32).to_be_bytes());
    out.extend_from_slice(&json);
    out
}

/// The envelopes of a Connect stream, as (flags, JSON).
fn envelopes(mut b: &[u8]) -> Vec<(u8, Value)> {
    let mut out = Vec::new();
    while b.len() >= 5 {
        let len = u32::from_be_bytes([b[1], b[2], b[3], b[4]]) as usize;
        let msg = &b[5..(5 + len).min(b.len())];
        out.push((b[0], serde_json::from_slice(msg).unwrap_or(Value::Null)));
        b = &b[(5 + len).min(b.len())..];
    }
    out
}

/// Checks that the answer of a `process.Process/Start` of `echo hi` is a Connect stream of a
/// start event, `hi\n` on stdout, an end event and the end of the stream.
fn assert_echo_hi(status: u16, ctype: Option<&str>, body: &[u8]) {
    let env = envelopes(body);
    assert_eq!(
        (status, ctype),
        (200, Some("application/connect+json")),
        "{env:?} {}",
        String::from_utf8_lossy(body)
    );
    let events: Vec<&Value> = env.iter().map(|(_, v)| &v["event"]).collect();
    assert!(events[0]["start"]["pid"].is_u64(), "{env:?}");
    assert!(
        events.iter().any(|e| e["data"]["stdout"] == "aGkK"),
        "{env:?}"
    );
    assert!(events.iter().any(|e| e["end"].is_object()), "{env:?}");
    assert_eq!(env.last().map(|(f, _)| *f), Some(0x02), "{env:?}");
}

/// The E2B API through a gateway: creates placed on the nodes, info, list merged and paged,
/// sandbox traffic (a Connect stream, files) routed by `E2b-Sandbox-Id` or by the access token
/// alone (a chunked request body), the gateway's own errors in E2B's shape, kill.
#[test]
fn the_e2b_api_works_through_the_gateway() {
    let (base, _cleanup) = scratch("e2b");
    let (_etcd, etcd_url) = etcd(&base);
    let (a, b) = (node(&base, "e1", &etcd_url), node(&base, "e2", &etcd_url));
    let (_gw, gw, url) = gateway(&etcd_url);
    let gw = gw.with_key(Some(&a.key));
    wait_registered(&gw, &[&a, &b], &a.key);

    // Two creates (both versions of the SDK), spread over the nodes.
    let mut made = Vec::new();
    for path in ["/v2/sandboxes", "/sandboxes"] {
        let (s, v) = gw.req(
            "POST",
            path,
            Some(&json!({"templateID": "base", "metadata": {"via": "gw"}, "envVars": {}})),
        );
        assert_eq!(s, 201, "{path}: {v}");
        let id = v["sandboxID"].as_str().expect("sandboxID").to_owned();
        let token = v["envdAccessToken"].as_str().expect("token").to_owned();
        made.push((id, token));
        std::thread::sleep(Duration::from_millis(5));
    }
    let numbers: std::collections::BTreeSet<u16> = made
        .iter()
        .map(|(id, _)| dsec_cluster::ids::node_number(id).expect("a node number"))
        .collect();
    assert_eq!(numbers.len(), 2, "{made:?}");
    let (id, token) = made[0].clone();

    let (s, v) = gw.req("GET", &format!("/sandboxes/{id}"), None);
    assert_eq!(
        (s, v["sandboxID"].as_str()),
        (200, Some(id.as_str())),
        "{v}"
    );
    assert_eq!(v["state"], "running", "{v}");

    // The list: both nodes, oldest first; paged at the gateway.
    let (s, v) = gw.req("GET", "/v2/sandboxes?metadata=via%3Dgw", None);
    let ids: Vec<&str> = v
        .as_array()
        .map(|a| a.iter().filter_map(|i| i["sandboxID"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(
        (s, ids),
        (200, vec![made[0].0.as_str(), made[1].0.as_str()])
    );
    let r = gw
        .send("GET", "/v2/sandboxes?limit=1", None, &[])
        .expect("list");
    let next = r.headers.get("x-next-token").and_then(|v| v.to_str().ok());
    assert_eq!((r.status, next), (200, Some("1")));
    assert_eq!(r.json()[0]["sandboxID"], made[0].0.as_str());
    let r = gw
        .send("GET", "/v2/sandboxes?limit=1&nextToken=1", None, &[])
        .expect("list");
    assert!(r.headers.get("x-next-token").is_none(), "{:?}", r.headers);
    assert_eq!(r.json()[0]["sandboxID"], made[1].0.as_str());

    // A Connect server stream, routed by E2b-Sandbox-Id.
    let start = envelope(
        0,
        &json!({"process": {"cmd": "/bin/sh", "args": ["-c", "echo hi"]}, "stdin": false}),
    );
    let traffic = gw.with_key(None);
    let headers = [
        ("E2b-Sandbox-Id", id.as_str()),
        ("E2b-Sandbox-Port", "49983"),
        ("X-Access-Token", token.as_str()),
        ("Content-Type", "application/connect+json"),
        ("Connect-Protocol-Version", "1"),
    ];
    let r = traffic
        .send("POST", "/process.Process/Start", Some(&start), &headers)
        .expect("start");
    let ctype = r.headers.get("content-type").and_then(|v| v.to_str().ok());
    assert_echo_hi(r.status, ctype, &r.body);

    // Files, both ways.
    let file_headers = [
        ("E2b-Sandbox-Id", id.as_str()),
        ("X-Access-Token", token.as_str()),
        ("Content-Type", "application/octet-stream"),
    ];
    let r = traffic
        .send(
            "POST",
            "/files?path=/tmp/x",
            Some(b"through the gateway"),
            &file_headers,
        )
        .expect("write");
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()[0]["path"], "/tmp/x", "{}", r.json());
    let r = traffic
        .send("GET", "/files?path=/tmp/x", None, &file_headers[..2])
        .expect("read");
    assert_eq!(
        (r.status, r.body.as_slice()),
        (200, &b"through the gateway"[..])
    );

    // The access token alone routes (SDK 2.20 after a connect); the body chunked; the answer
    // streams: `hi` comes through while the command still sleeps.
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into();
    let slow = envelope(
        0,
        &json!({"process": {"cmd": "/bin/sh", "args": ["-c", "echo hi; sleep 2"]}, "stdin": false}),
    );
    let mut reader = std::io::Cursor::new(slow);
    let t0 = Instant::now();
    let mut resp = agent
        .post(format!("{url}/process.Process/Start"))
        .header("X-Access-Token", token.as_str())
        .header("Content-Type", "application/connect+json")
        .send(ureq::SendBody::from_reader(&mut reader))
        .expect("start by token");
    let status = resp.status().as_u16();
    let ctype = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let mut stream = resp.body_mut().as_reader();
    let (mut body, mut hi_at) = (Vec::new(), None);
    loop {
        use std::io::Read as _;
        let mut head = [0u8; 5];
        if stream.read_exact(&mut head).is_err() {
            break;
        }
        let mut msg = vec![0u8; u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize];
        stream.read_exact(&mut msg).expect("an envelope's message");
        if String::from_utf8_lossy(&msg).contains("aGkK") {
            hi_at = Some(t0.elapsed());
        }
        body.extend_from_slice(&head);
        body.extend_from_slice(&msg);
    }
    let done = t0.elapsed();
    assert_echo_hi(status, ctype.as_deref(), &body);
    let hi_at = hi_at.expect("hi");
    assert!(
        done >= Duration::from_secs(2) && done - hi_at >= Duration::from_millis(1500),
        "hi at {hi_at:?}, the end at {done:?}: not streamed"
    );

    // Routed by `Host: <port>-<id>.<domain>` (with a token, by the token): each sandbox's own
    // node answers (401 without the token; another node would not know the sandbox: 502).
    for (sb, tok) in &made {
        let host = format!("49983-{sb}.sandboxes.test");
        let r = traffic
            .send("GET", "/health", None, &[("Host", host.as_str())])
            .expect("health by host");
        assert_eq!(r.status, 401, "{}", String::from_utf8_lossy(&r.body));
        let r = traffic
            .send(
                "GET",
                "/health",
                None,
                &[("Host", host.as_str()), ("X-Access-Token", tok.as_str())],
            )
            .expect("health by host");
        assert_eq!(r.status, 204, "{}", String::from_utf8_lossy(&r.body));
    }

    // What the gateway answers itself is E2B's shape: a sandbox no node holds.
    let ghost = "sb-00ff000000000001";
    let r = traffic
        .send("GET", "/health", None, &[("E2b-Sandbox-Id", ghost)])
        .expect("health");
    assert_eq!(
        (r.status, r.json()),
        (
            502,
            json!({"code": 502, "message": format!("The sandbox {ghost} was not found")})
        )
    );
    let (s, v) = gw.req("GET", &format!("/sandboxes/{ghost}"), None);
    assert_eq!((s, v["code"].as_u64()), (404, Some(404)), "{v}");
    let (s, v) = gw.req("PUT", "/v2/sandboxes", None);
    assert_eq!((s, v["code"].as_u64()), (405, Some(405)), "{v}");

    // Kill: gone for the control plane and for its traffic.
    for (id, _) in &made {
        let (s, v) = gw.req("DELETE", &format!("/sandboxes/{id}"), None);
        assert_eq!(s, 204, "{v}");
    }
    let (s, v) = gw.req("GET", &format!("/sandboxes/{id}"), None);
    assert_eq!((s, v["code"].as_u64()), (404, Some(404)), "{v}");
    let r = traffic
        .send("POST", "/process.Process/Start", Some(&start), &headers)
        .expect("start after kill");
    assert_eq!(r.status, 502, "{}", String::from_utf8_lossy(&r.body));
    let (s, v) = gw.req("GET", "/v2/sandboxes", None);
    assert_eq!((s, v), (200, json!([])));
}
