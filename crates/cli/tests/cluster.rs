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
    let (data, run) = (
        base.join(format!("{name}-d")),
        base.join(format!("{name}-r")),
    );
    testkit::Server::test(env!("CARGO_BIN_EXE_dsec"), &data, &run)
        .args(&["--etcd", etcd, "--node-name", name, "--pool-max", "0"])
        .start()
        .expect("start a node")
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
    let (s, v) = gw.req(
        "POST",
        &format!("/v1/sandboxes/{id}/sessions/{sid}/run"),
        Some(&json!({"input": "echo $((X+1))"})),
    );
    assert_eq!(
        (s, v["stdout"]["data"].as_str()),
        (200, Some("42\n")),
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
        let (s, r) = gw.req(
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            Some(&json!({"argv": ["hostname"]})),
        );
        assert_eq!(
            (s, r["stdout"]["data"].as_str()),
            (200, Some(&*format!("{id}\n"))),
            "{r}"
        );
    }
    let (s, v) = gw.req("GET", "/v1/sandboxes", None);
    assert_eq!(
        (s, v["items"].as_array().map_or(0, Vec::len)),
        (200, 6),
        "{v}"
    );
    families_pass_through(&gw, &spread[spread.keys().nth(1).expect("n2")][1]);
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

    // A drained node gets no new sandbox; undrained, it does again.
    let drain = |undo: bool| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_dsec"));
        c.args(["cluster", "drain", "n1", "--etcd", &etcd_url]);
        if undo {
            c.arg("--undo");
        }
        assert!(c.status().expect("dsec cluster drain").success());
    };
    drain(false);
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
