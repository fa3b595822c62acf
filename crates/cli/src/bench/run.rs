//! `dsec bench run`: the code runner measured through HTTP from a separate process.
//!
//! The bench starts `dsec server` as a child on fresh state dirs and runs `print(1+1)` three
//! ways in the same run: the function substrate (a fork of a warm zygote), the container
//! substrate (a fresh `/usr/bin/python3` in a pooled sandbox), and `python3 -c` on the host
//! (the peer: no sandbox, no HTTP). Each at concurrency 1, 16 and 64 with p50/p99 through
//! HTTP, the node's own time (`server_us`) and calls/s; the function substrate once more at
//! concurrency 1 with calls paced 5 ms apart, and paced beside 20 calls that spin or fork
//! to their time limit (R-13: short calls are not held up behind long ones); a trainer's load
//! shape (32 keep-alive clients calling SandboxFusion's `/run_code` for 10 s: is the tail
//! fair?); then a C++ compile-and-run.

use std::process::{Command, ExitCode};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::bail;
use serde_json::{json, Value};

use super::{dist, emit, us, BenchArgs};

#[derive(Clone)]
struct Client {
    agent: ureq::Agent,
    url: String,
    key: String,
}

impl Client {
    fn run(&self, body: &Value) -> anyhow::Result<Value> {
        self.post("/v1/run", body)
    }

    /// A call through SandboxFusion's `/run_code`, as its clients send it.
    fn run_code(&self, body: &Value) -> anyhow::Result<Value> {
        self.post("/run_code", body)
    }

    fn post(&self, path: &str, body: &Value) -> anyhow::Result<Value> {
        let mut r = self
            .agent
            .post(format!("{}{path}", self.url))
            .header("X-API-Key", &self.key)
            .send(body.to_string())?;
        let status = r.status().as_u16();
        let v: Value = serde_json::from_slice(&r.body_mut().read_to_vec()?)?;
        if status != 200 || v["status"] != "Success" {
            bail!("{path}: {status} {v}");
        }
        Ok(v)
    }

    /// The runner's live sandboxes (zygotes and pooled containers), with the admin key.
    fn sandboxes(&self) -> usize {
        self.agent
            .get(format!(
                "{}/v1/sandboxes?tenant=tn-run&limit=1000",
                self.url
            ))
            .header("X-API-Key", &self.key)
            .call()
            .ok()
            .and_then(|mut r| {
                serde_json::from_slice::<Value>(&r.body_mut().read_to_vec().ok()?).ok()
            })
            .and_then(|v| v["items"].as_array().map(Vec::len))
            .unwrap_or(0)
    }
}

/// How long each worker of [`load`] keeps calling.
#[derive(Clone, Copy)]
enum Until {
    /// This many calls each.
    Calls(usize),
    /// Until this much time has passed since the start.
    Elapsed(Duration),
}

/// `threads` workers each calling `call` back to back `until` the rule says stop: client
/// latency, node time, rate.
fn load(threads: usize, until: Until, call: &(dyn Fn() -> anyhow::Result<u64> + Sync)) -> Value {
    let errors = AtomicU64::new(0);
    let t0 = Instant::now();
    let more = |done: usize| match until {
        Until::Calls(n) => done < n,
        Until::Elapsed(d) => t0.elapsed() < d,
    };
    let results: Vec<(Vec<u64>, Vec<u64>)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|_| {
                let (errors, more) = (&errors, &more);
                s.spawn(move || {
                    let (mut lat, mut server) = (vec![], vec![]);
                    let mut done = 0;
                    while more(done) {
                        done += 1;
                        let t = Instant::now();
                        match call() {
                            Ok(server_us) => {
                                lat.push(us(t));
                                if server_us > 0 {
                                    server.push(server_us);
                                }
                            }
                            Err(_) => {
                                errors.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    (lat, server)
                })
            })
            .collect();
        hs.into_iter().filter_map(|h| h.join().ok()).collect()
    });
    let wall = t0.elapsed();
    let (mut lat, mut server) = (vec![], vec![]);
    for (a, b) in results {
        lat.extend(a);
        server.extend(b);
    }
    let n = lat.len();
    json!({
        "concurrency": threads,
        "latency": dist(lat),
        "server": if server.is_empty() { Value::Null } else { json!(dist(server)) },
        "calls_per_s": n as f64 / wall.as_secs_f64(),
        "errors": errors.load(Ordering::Relaxed),
    })
}

/// Abusive calls in flight at once beside the measured ones (R-13: 20 abusers at once).
const ABUSERS: usize = 20;

/// `n` calls of `call`, paced 20 ms apart, while `ABUSERS` workers run `abuse` (to its 2 s time
/// limit) over and over: their latency, node time and errors, and how many sandboxes the
/// runner held at the end.
fn beside(c: &Client, call: &Value, abuse: &str, n: usize) -> anyhow::Result<Value> {
    let stop = std::sync::atomic::AtomicBool::new(false);
    let abuse = json!({"code": abuse, "language": "python", "run_timeout": 2});
    let mut lat = vec![];
    let mut server = vec![];
    let mut errors = 0u64;
    let mut held = 0;
    std::thread::scope(|s| {
        for _ in 0..ABUSERS {
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    let _ = c.run(&abuse);
                }
            });
        }
        std::thread::sleep(Duration::from_millis(500));
        for _ in 0..n.max(20) {
            let t = Instant::now();
            match c.run(call) {
                Ok(v) => {
                    lat.push(us(t));
                    server.push(v["server_us"].as_u64().unwrap_or(0));
                }
                Err(_) => errors += 1,
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        held = c.sandboxes();
        stop.store(true, Ordering::Relaxed);
    });
    Ok(json!({
        "latency": dist(lat),
        "server": dist(server),
        "errors": errors,
        "runner_sandboxes": held,
    }))
}

/// Runs the runner benchmark.
pub fn run(args: &BenchArgs) -> anyhow::Result<ExitCode> {
    let d = super::api::start_daemon("run", &["--run-zygotes", "4"])?;
    let c = Client {
        agent: ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_idle_connections(256)
            .max_idle_connections_per_host(256)
            .timeout_global(Some(Duration::from_secs(120)))
            .build()
            .into(),
        url: d.url.clone(),
        key: d.key.clone(),
    };
    let n = args.iterations.max(20);
    let function = json!({"code": "print(1+1)", "language": "python"});
    let container = json!({"code": "print(1+1)", "language": "python", "substrate": "container"});
    // Warm-up: every zygote and a few container sandboxes exist before measuring.
    std::thread::scope(|s| {
        for _ in 0..8 {
            s.spawn(|| {
                for _ in 0..3 {
                    let _ = c.run(&function);
                    let _ = c.run(&container);
                }
            });
        }
    });
    let call_fn = || -> anyhow::Result<u64> {
        let v = c.run(&function)?;
        Ok(v["server_us"].as_u64().unwrap_or(0))
    };
    let call_ct = || -> anyhow::Result<u64> {
        let v = c.run(&container)?;
        Ok(v["server_us"].as_u64().unwrap_or(0))
    };
    let call_host = || -> anyhow::Result<u64> {
        let o = Command::new("/usr/bin/python3")
            .args(["-c", "print(1+1)"])
            .output()?;
        if o.stdout != b"2\n" {
            bail!("python3 -c: {o:?}");
        }
        Ok(0)
    };
    let mut out = serde_json::Map::new();
    for (name, call, scale) in [
        (
            "function",
            &call_fn as &(dyn Fn() -> anyhow::Result<u64> + Sync),
            1,
        ),
        ("container_fresh_interpreter", &call_ct, 4),
        ("host_python3_c", &call_host, 4),
    ] {
        let mut by = serde_json::Map::new();
        for conc in [1usize, 16, 64] {
            let per = (n / scale / conc).clamp(2, 1000);
            by.insert(conc.to_string(), load(conc, Until::Calls(per), call));
        }
        out.insert(name.into(), Value::Object(by));
    }
    // A trainer's load shape: 32 client threads with keep-alive calling SandboxFusion's
    // `/run_code` back to back for 10 s. A fair queue keeps the tail near the median.
    let fusion = json!({"code": "print(1+1)", "language": "python"});
    let call_fusion = || -> anyhow::Result<u64> { c.run_code(&fusion).map(|_| 0) };
    out.insert(
        "run_code_32_threads_10s".into(),
        load(32, Until::Elapsed(Duration::from_secs(10)), &call_fusion),
    );
    // Concurrency 1 back to back keeps both cores of a small machine busy (each call's fork,
    // exit and sweep run beside the next call): the same calls paced 5 ms apart give the
    // latency of a node with CPU to spare.
    let mut lat = vec![];
    let mut server = vec![];
    for _ in 0..n {
        let t = Instant::now();
        let server_us = call_fn()?;
        lat.push(us(t));
        server.push(server_us);
        std::thread::sleep(Duration::from_millis(5));
    }
    out.insert(
        "function_paced_5ms".into(),
        json!({"latency": dist(lat), "server": dist(server)}),
    );
    // the same paced calls while 20 calls (five times the warm zygotes) spin, or fork
    // without end, to their 2 s time limit over and over.
    for (name, abuse) in [
        ("function_beside_20_spinners", "while True: pass"),
        (
            "function_beside_20_fork_bombs",
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        ),
    ] {
        out.insert(name.into(), beside(&c, &function, abuse, n / 2)?);
    }
    let cpp = json!({"language": "cpp",
        "code": "#include <iostream>\nint main(){ long s = 0; for (int i = 0; i < 1000; i++) s += i; std::cout << s << std::endl; }"});
    let mut compile = vec![];
    let mut total = vec![];
    for _ in 0..5 {
        let t = Instant::now();
        let v = c.run(&cpp)?;
        total.push(us(t));
        compile.push(
            (v["compile_result"]["execution_time"]
                .as_f64()
                .unwrap_or(0.0)
                * 1e6) as u64,
        );
    }
    out.insert(
        "cpp_compile_and_run".into(),
        json!({"total": dist(total), "compile": dist(compile)}),
    );
    let out = Value::Object(out);
    // A figure of `out` at `path`, from µs to ms.
    let ms =
        |path: &[&str]| path.iter().fold(&out, |v, k| &v[*k]).as_u64().unwrap_or(0) as f64 / 1000.0;
    let summary = json!({
        "function_p50_ms_server": ms(&["function", "1", "server", "p50_us"]),
        "function_p50_ms_http": ms(&["function", "1", "latency", "p50_us"]),
        "function_paced_p50_ms_server": ms(&["function_paced_5ms", "server", "p50_us"]),
        "container_p50_ms_http": ms(&["container_fresh_interpreter", "1", "latency", "p50_us"]),
        "host_python3_c_p50_ms": ms(&["host_python3_c", "1", "latency", "p50_us"]),
        "speedup_vs_container_p50": ms(&["container_fresh_interpreter", "1", "latency", "p50_us"])
            / ms(&["function", "1", "latency", "p50_us"]).max(0.001),
        "function_calls_per_s_at_64": out["function"]["64"]["calls_per_s"],
        "function_errors_at_64": out["function"]["64"]["errors"],
        "run_code_32x10s_calls_per_s": out["run_code_32_threads_10s"]["calls_per_s"],
        "run_code_32x10s_p50_ms": ms(&["run_code_32_threads_10s", "latency", "p50_us"]),
        "run_code_32x10s_p99_ms": ms(&["run_code_32_threads_10s", "latency", "p99_us"]),
        "run_code_32x10s_p99_over_p50": ms(&["run_code_32_threads_10s", "latency", "p99_us"])
            / ms(&["run_code_32_threads_10s", "latency", "p50_us"]).max(0.001),
        "beside_20_spinners_p50_ms": ms(&["function_beside_20_spinners", "latency", "p50_us"]),
        "beside_20_spinners_p99_ms": ms(&["function_beside_20_spinners", "latency", "p99_us"]),
        "beside_20_fork_bombs_p50_ms": ms(&["function_beside_20_fork_bombs", "latency", "p50_us"]),
        "beside_20_fork_bombs_p99_ms": ms(&["function_beside_20_fork_bombs", "latency", "p99_us"]),
    });
    let doc = json!({
        "bench": "run",
        "iterations": n,
        "results": out,
        "summary": summary,
    });
    emit(args, doc)
}
