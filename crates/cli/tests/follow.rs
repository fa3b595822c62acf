//! Following a background process over HTTP (`GET …/processes/{handle}/output`): its output
//! streams while other requests on the same sandbox are answered. Needs root (a container
//! sandbox), like the other tests of a real daemon.

use std::io::{BufRead, BufReader};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use dsec_testkit as testkit;
use serde_json::{json, Value};

/// The events of an event stream at `path`, as `(event, data)`, sent to the returned channel.
fn follow(http: &testkit::Http, path: String) -> mpsc::Receiver<(String, Value)> {
    let http = http.clone();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let Ok(mut r) = http.get_streaming(&path) else {
            return;
        };
        let mut event = String::new();
        for line in BufReader::new(r.body_mut().as_reader()).lines() {
            let Ok(line) = line else { return };
            if let Some(e) = line.strip_prefix("event:") {
                event = e.trim().to_owned();
            } else if let Some(d) = line.strip_prefix("data:") {
                let data = serde_json::from_str(d.trim()).unwrap_or(Value::Null);
                if tx.send((std::mem::take(&mut event), data)).is_err() {
                    return;
                }
            }
        }
    });
    rx
}

fn decoded(data: &Value) -> String {
    use base64::Engine as _;
    let b64 = data["data_b64"].as_str().unwrap_or_default();
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .unwrap_or_default();
    String::from_utf8_lossy(&bytes).into_owned()
}

#[test]
fn a_followed_process_streams_while_other_requests_go_on() {
    let (data, run, _remove) = testkit::dirs_removed_on_drop("dfw", "follow");
    let d = testkit::Server::test(env!("CARGO_BIN_EXE_dsec"), &data, &run)
        .args(&["--pool-max", "0"])
        .start()
        .expect("start dsec server");
    let (s, v) = d.req("POST", "/v1/sandboxes", Some(&json!({})));
    assert_eq!(s, 201, "create: {v}");
    let id = v["id"].as_str().expect("id").to_owned();
    let (s, v) = d.req(
        "POST",
        &format!("/v1/sandboxes/{id}/processes"),
        Some(&json!({"shell": "sleep 0.5; echo a; sleep 1.5; echo b"})),
    );
    assert_eq!(s, 201, "spawn: {v}");
    let handle = v["handle"].as_u64().expect("handle");
    let events = follow(
        d.http(),
        format!("/v1/sandboxes/{id}/processes/{handle}/output"),
    );
    let (ev, data) = events
        .recv_timeout(Duration::from_secs(10))
        .expect("first output");
    assert_eq!((ev.as_str(), decoded(&data).as_str()), ("stdout", "a\n"));
    // While it is followed (and runs on), the sandbox answers other requests at once.
    let t = Instant::now();
    let (s, v) = d.req("GET", &format!("/v1/sandboxes/{id}/processes"), None);
    assert_eq!(s, 200, "{v}");
    let items = v["items"].as_array().expect("items");
    assert_eq!(items.len(), 1, "{v}");
    assert_eq!(items[0]["handle"].as_u64(), Some(handle));
    let r = d
        .http()
        .send(
            "GET",
            &format!("/v1/sandboxes/{id}/files?path=/etc/passwd"),
            None,
            &[],
        )
        .expect("file read");
    assert_eq!(r.status, 200);
    assert!(String::from_utf8_lossy(&r.body).contains("root:"));
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "requests waited for the follower: {:?}",
        t.elapsed()
    );
    let (ev, data) = events
        .recv_timeout(Duration::from_secs(10))
        .expect("second output");
    assert_eq!((ev.as_str(), decoded(&data).as_str()), ("stdout", "b\n"));
    let (ev, result) = events.recv_timeout(Duration::from_secs(10)).expect("exit");
    assert_eq!(ev, "exit", "{result}");
    assert_eq!(result["exit_code"], 0, "{result}");
    assert_eq!(result["stdout"]["data"], "a\nb\n", "{result}");
    // Delivered to the follower: the process is listed no more, its handle is forgotten.
    let (s, v) = d.req("GET", &format!("/v1/sandboxes/{id}/processes"), None);
    assert_eq!(
        (s, v["items"].as_array().map(Vec::len)),
        (200, Some(0)),
        "{v}"
    );
    let r = d
        .http()
        .send(
            "GET",
            &format!("/v1/sandboxes/{id}/processes/{handle}/output"),
            None,
            &[],
        )
        .expect("output of a forgotten handle");
    assert_eq!(
        (r.status, r.json()["code"].as_str()),
        (404, Some("handle_not_found"))
    );
    let (s, _) = d.req("DELETE", &format!("/v1/sandboxes/{id}"), None);
    assert!(s < 300, "{s}");
}
