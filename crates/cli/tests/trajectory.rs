//! Trajectories through `dsec server` (TESTING.md L-03, L-04): steps survive kill -9 of the
//! daemon, replays execute nothing, and every command's side effect happens once or is
//! reported as `unknown_outcome`. Needs root; CI runs as root.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use dsec_testkit as testkit;
use serde_json::{json, Value};

testkit::daemon_type!(
    /// A daemon of these tests.
    struct Daemon
);

impl Daemon {
    fn start(data: &Path, run: &Path) -> Self {
        Self::start_with(data, run, &[])
    }

    fn start_with(data: &Path, run: &Path, args: &[&str]) -> Self {
        let d = testkit::Server::test(env!("CARGO_BIN_EXE_dsec"), data, run)
            .args(&["--pool-max", "0"])
            .args(args)
            .timeout(Duration::from_secs(60))
            .start()
            .expect("start dsec server");
        Self(d)
    }

    /// (status, whether it is a replay, body bytes); status 0 on a transport error.
    fn post(&self, path: &str, body: &Value) -> (u16, bool, Vec<u8>) {
        let body = body.to_string();
        match self.http().send("POST", path, Some(body.as_bytes()), &[]) {
            Ok(r) => (r.status, r.headers.get("dsec-replayed").is_some(), r.body),
            // No answer: status 0, and what went wrong as the body.
            Err(e) => (0, false, format!("{e:#}").into_bytes()),
        }
    }

    fn get(&self, path: &str) -> Value {
        self.http().call("GET", path, None).expect("get").1
    }

    fn finish(mut self, ids: &[String]) {
        for id in ids {
            let _ = self.req("DELETE", &format!("/v1/sandboxes/{id}"), None);
        }
        let left = self.run_dirs();
        assert!(left.is_empty(), "left on the machine: {left:?}");
        self.stop();
    }
}

fn create(d: &Daemon) -> String {
    let (_, v) = d
        .http()
        .call("POST", "/v1/sandboxes", Some(&json!({})))
        .expect("create");
    v["id"].as_str().expect("id").to_owned()
}

/// Lines of /tmp/counter in the sandbox, read without a trajectory.
fn counter(d: &Daemon, id: &str) -> BTreeMap<String, usize> {
    let (s, _, body) = d.post(
        &format!("/v1/sandboxes/{id}/exec"),
        &json!({"shell": "cat /tmp/counter 2>/dev/null; true"}),
    );
    assert_eq!(s, 200);
    let v: Value = serde_json::from_slice(&body).expect("json");
    let mut out = BTreeMap::new();
    for line in v["stdout"]["data"].as_str().unwrap_or_default().lines() {
        *out.entry(line.to_owned()).or_insert(0) += 1;
    }
    out
}

fn step_body(step: u64, marker: &str) -> Value {
    json!({
        "trajectory": "episode-1",
        "step": step,
        "shell": format!("echo {marker} >> /tmp/counter; head -c 12 /dev/urandom | od -An -tx1"),
    })
}

/// Runs step `step` of the trajectory in sandbox `id` as a new action (marked `marker`).
fn exec_step(d: &Daemon, id: &str, step: u64, marker: &str) {
    let (s, _, _) = d.post(
        &format!("/v1/sandboxes/{id}/exec"),
        &step_body(step, marker),
    );
    assert_eq!(s, 200, "step {step}");
}

#[test]
fn l04_replay_after_a_crash_executes_nothing_and_is_byte_identical() {
    let (data, run, _dirs) = testkit::dirs_removed_on_drop("dtr", "l04");
    let mut d = Daemon::start(&data, &run);
    let id = create(&d);
    let mut first = Vec::new();
    for step in 1..=5 {
        let (s, replayed, body) = d.post(
            &format!("/v1/sandboxes/{id}/exec"),
            &step_body(step, &format!("s{step}")),
        );
        assert_eq!(
            (s, replayed),
            (200, false),
            "{}",
            String::from_utf8_lossy(&body)
        );
        first.push(body);
    }
    d.kill9();
    let d = Daemon::start(&data, &run);
    for step in 1..=5u64 {
        let (s, replayed, body) = d.post(
            &format!("/v1/sandboxes/{id}/exec"),
            &step_body(step, &format!("s{step}")),
        );
        assert_eq!((s, replayed), (200, true), "step {step} is fast-forwarded");
        assert_eq!(body, first[step as usize - 1], "step {step} byte-identical");
    }
    let c = counter(&d, &id);
    assert_eq!(c.len(), 5, "{c:?}");
    assert!(c.values().all(|n| *n == 1), "nothing ran twice: {c:?}");
    // The step after the log runs live; a gap is refused.
    let (s, replayed, _) = d.post(&format!("/v1/sandboxes/{id}/exec"), &step_body(6, "s6"));
    assert_eq!((s, replayed), (200, false));
    let (s, _, body) = d.post(&format!("/v1/sandboxes/{id}/exec"), &step_body(9, "s9"));
    let v: Value = serde_json::from_slice(&body).expect("json");
    assert_eq!((s, v["code"].as_str()), (409, Some("trajectory_diverged")));
    let t = d.get("/v1/trajectories/episode-1");
    assert_eq!(
        (t["intents"].as_u64(), t["results"].as_u64()),
        (Some(6), Some(6)),
        "{t}"
    );
    // Training export: JSONL rows and a Parquet file of the same steps.
    for (format, magic) in [("jsonl", &b"{"[..]), ("parquet", &b"PAR1"[..])] {
        let r = d
            .http()
            .send(
                "GET",
                &format!("/v1/trajectories/episode-1/export?format={format}"),
                None,
                &[],
            )
            .expect("export");
        assert_eq!(r.status, 200);
        let bytes = r.body;
        assert!(bytes.starts_with(magic), "{format}");
        if format == "jsonl" {
            let rows: Vec<Value> = bytes
                .split(|b| *b == b'\n')
                .filter(|l| !l.is_empty())
                .map(|l| serde_json::from_slice(l).expect("row"))
                .collect();
            assert_eq!(rows.len(), 6);
            assert_eq!(rows[0]["op"], "exec");
            assert_eq!(rows[0]["exit_status"], "ok");
        } else {
            assert!(bytes.ends_with(b"PAR1"));
        }
    }
    d.finish(&[id]);
}

#[test]
fn l03_kill9_at_random_moments_each_side_effect_once_or_unknown() {
    let (data, run, _dirs) = testkit::dirs_removed_on_drop("dtr", "l03");
    let mut d = Daemon::start(&data, &run);
    let id = create(&d);
    let total: u64 = 40;
    let mut acked: Vec<u64> = Vec::new();
    let mut unknown: Vec<u64> = Vec::new();
    // The client's own history: the action it settled on for each step (a step it re-ran as
    // a new action after `unknown_outcome` is re-sent as that action when it resumes).
    let marker = |step: u64, unknown: &[u64]| {
        if unknown.contains(&step) {
            format!("s{step}-retry")
        } else {
            format!("s{step}")
        }
    };
    let mut next: u64 = 1;
    let mut seed: u64 = 0x9E37_79B9_7F4A_7C15 ^ u64::from(std::process::id());
    let mut rounds = 0;
    while next <= total {
        // A client thread sends steps until the daemon dies; the main thread kills it at a
        // pseudo-random moment.
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let kill_after = Duration::from_millis(20 + seed % 150);
        let (http, sid) = (d.http().clone(), id.clone());
        let start = next;
        let client = std::thread::spawn(move || {
            let mut got = Vec::new();
            for step in start..=total {
                let body = step_body(step, &format!("s{step}")).to_string();
                let path = format!("/v1/sandboxes/{sid}/exec");
                match http.send("POST", &path, Some(body.as_bytes()), &[]) {
                    Ok(r) if r.status == 200 => got.push(step),
                    _ => break,
                }
            }
            got
        });
        std::thread::sleep(kill_after);
        if rounds < 4 {
            d.kill9();
        }
        let got = client.join().expect("client");
        acked.extend(&got);
        rounds += 1;
        if rounds <= 4 {
            d = Daemon::start(&data, &run);
        }
        // Resume: re-send every step from 1 (fast-forward) until the log ends.
        next = 1;
        loop {
            if next > total {
                break;
            }
            let (s, replayed, body) = d.post(
                &format!("/v1/sandboxes/{id}/exec"),
                &step_body(next, &marker(next, &unknown)),
            );
            let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            match (s, v["code"].as_str()) {
                (200, _) if replayed => next += 1,
                (200, _) => {
                    // Ran live: this step was beyond the log.
                    acked.push(next);
                    next += 1;
                    break;
                }
                (409, Some("unknown_outcome")) => {
                    // The client decides: here it re-runs the step as a new action.
                    unknown.push(next);
                    exec_step(&d, &id, next, &format!("s{next}-retry"));
                    acked.push(next);
                    next += 1;
                    break;
                }
                other => panic!("step {next}: {other:?} {v}"),
            }
        }
        if next > total {
            break;
        }
    }
    // Finish the trajectory without kills.
    while next <= total {
        exec_step(&d, &id, next, &format!("s{next}"));
        acked.push(next);
        next += 1;
    }
    let c = counter(&d, &id);
    for step in 1..=total {
        let plain = c.get(&format!("s{step}")).copied().unwrap_or(0);
        let retry = c.get(&format!("s{step}-retry")).copied().unwrap_or(0);
        if unknown.contains(&step) {
            assert!(
                plain <= 1 && retry == 1,
                "step {step}: {plain} + {retry} retry"
            );
        } else {
            assert_eq!(
                (plain, retry),
                (1, 0),
                "step {step} ran exactly once: {c:?}"
            );
        }
    }
    // Every acknowledged step has its result in the log.
    let t = d.get("/v1/trajectories/episode-1");
    assert_eq!(t["last_step"].as_u64(), Some(total), "{t}");
    let mut results = std::collections::BTreeSet::new();
    let mut from = 0;
    loop {
        let page = d.get(&format!(
            "/v1/trajectories/episode-1/records?from_step={from}&limit=1000"
        ));
        for r in page["items"].as_array().expect("items") {
            if r["kind"] == "result" {
                results.insert(r["step"].as_u64().unwrap_or(0));
            }
        }
        match page["next_from_step"].as_u64() {
            Some(n) => from = n,
            None => break,
        }
    }
    for a in &acked {
        assert!(results.contains(a), "acked step {a} has a logged result");
    }
    assert!(rounds >= 1);
    d.finish(&[id]);
}

/// A finished trajectory is compacted out of the log; the others stay, and replay still works.
#[test]
fn finished_trajectories_are_compacted_and_the_rest_replays() {
    let (data, run, _dirs) = testkit::dirs_removed_on_drop("dtr", "cmp");
    let args = [
        "--log-segment-bytes",
        "4096",
        "--compact-finished-after",
        "0",
    ];
    let mut d = Daemon::start_with(&data, &run, &args);
    let id = create(&d);
    let step = |traj: &str, n: u64| json!({"trajectory": traj, "step": n, "shell": format!("echo {traj}-{n}")});
    let mut kept = Vec::new();
    for n in 1..=30u64 {
        for traj in ["done", "live"] {
            let (s, _, body) = d.post(&format!("/v1/sandboxes/{id}/exec"), &step(traj, n));
            assert_eq!(s, 200, "{}", String::from_utf8_lossy(&body));
            if traj == "live" {
                kept.push(body);
            }
        }
    }
    let (s, _, _) = d.post("/v1/trajectories/done/finish", &json!({}));
    assert_eq!(s, 200);
    let (s, _, body) = d.post("/v1/admin/compact", &json!({}));
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&body));
    let report: Value = serde_json::from_slice(&body).expect("report");
    assert!(report["records_dropped"].as_u64() > Some(0), "{report}");
    d.kill9();
    let d = Daemon::start_with(&data, &run, &args);
    let live = d.get("/v1/trajectories/live");
    assert_eq!(live["results"].as_u64(), Some(30), "{live}");
    let done = d.get("/v1/trajectories/done");
    assert!(
        done["code"] == "trajectory_not_found" || done["results"].as_u64() < Some(30),
        "the finished one was compacted: {done}"
    );
    for n in 1..=30u64 {
        let (s, replayed, body) = d.post(&format!("/v1/sandboxes/{id}/exec"), &step("live", n));
        assert_eq!((s, replayed), (200, true), "step {n}");
        assert_eq!(body, kept[n as usize - 1], "step {n} byte-identical");
    }
    d.finish(&[id]);
}

/// A handler that does not read its body (`finish`, `compact`) answers only once the body has
/// arrived, and the connection stays open for the next request. Before, an answer sent ahead
/// of the body's bytes closed the connection, and a client that had put it back in its pool
/// saw its next call fail ("peer disconnected"): the flake this test's neighbour showed.
#[test]
fn a_body_the_handler_ignores_keeps_the_connection() {
    use std::io::{Read as _, Write as _};
    let (data, run, _dirs) = testkit::dirs_removed_on_drop("dtr", "ignored-body");
    let d = Daemon::start(&data, &run);
    let addr = d.url.trim_start_matches("http://").to_owned();
    let mut s = std::net::TcpStream::connect(&addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let head = |path: &str| {
        format!(
            "POST {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {}\r\n\
             Content-Type: application/json\r\nContent-Length: 2\r\n\r\n",
            d.key
        )
    };
    for round in 0..2 {
        // The head, then the body a moment later: as a client under load sends them.
        s.write_all(head("/v1/admin/compact").as_bytes())
            .expect("head");
        std::thread::sleep(Duration::from_millis(200));
        s.write_all(b"{}").expect("body");
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        // One whole answer: the head, then as many bytes as its Content-Length says.
        let answer = loop {
            let n = s.read(&mut buf).unwrap_or(0);
            assert!(
                n > 0,
                "round {round}: the connection closed: {:?}",
                String::from_utf8_lossy(&got)
            );
            got.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&got).into_owned();
            let Some((h, b)) = text.split_once("\r\n\r\n") else {
                continue;
            };
            let len: usize = h
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().parse().expect("a length"))
                })
                .expect("content-length");
            if b.len() >= len {
                break text;
            }
        };
        assert!(
            answer.starts_with("HTTP/1.1 200"),
            "round {round}: {answer}"
        );
        assert!(
            !answer.to_ascii_lowercase().contains("connection: close"),
            "{answer}"
        );
    }
    d.finish(&[]);
}
