//! `dsec bench e2b`: the official E2B Python SDK against the node's E2B-compatible API, with
//! dsec's own Python SDK as the peer in the same run.
//!
//! One loop is what an E2B user writes: `Sandbox.create()`, `sbx.commands.run("true")`,
//! `sbx.kill()`. Its peer is the same loop in the dsec SDK: `Sandbox.create()`, `exec("true")`,
//! `destroy()`. A third loop does, through the dsec SDK, the work the E2B calls ask of the node
//! (a writable root; a path out to the internet, `egress: all`, as E2B's
//! `allow_internet_access` defaults to it and the admin key's ceiling allows it;
//! `/bin/bash -l -c true`, which is what `commands.run` spawns) without the E2B translation
//! (the default user made on create, the Connect stream of `Start`): E2B minus it is what the
//! translation costs, it minus dsec what E2B's semantics cost. The loops run
//! interleaved in one Python process (their order rotates every iteration, so drift is shared),
//! each phase timed; warm-up iterations are left out. The driver is embedded below, written to
//! a temporary file for the run and removed after it.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};

use anyhow::{bail, Context};
use serde_json::{json, Map, Value};

use super::api::start_daemon;
use super::{dist, emit, BenchArgs, Dist};

/// Iterations of each loop run first and left out of the figures.
const WARMUP: usize = 5;
/// The issue's targets: the E2B loop's p50 against the dsec loop's, and its own p50.
const TARGET_RATIO: f64 = 1.5;
const TARGET_E2B_LOOP_MS: f64 = 10.0;
/// The loops, as the driver names them.
const LOOPS: [&str; 3] = ["e2b", "dsec", "dsec_e2b_semantics"];
const PHASES: [&str; 4] = ["loop", "create", "run", "kill"];

/// The driver: reads its settings from argv[1] (JSON), prints one JSON line per iteration of
/// each loop, then a last line with the SDKs' versions.
const DRIVER: &str = r#"
import json, sys, time
from importlib.metadata import version

import dsec
import e2b

cfg = json.loads(sys.argv[1])
url, key, substrate = cfg["url"], cfg["key"], cfg["substrate"]
metadata = {"bench": "e2b"}
spec = {"labels": {"bench": "e2b"}}
if substrate != "container":
    metadata["dsec.substrate"] = substrate
    spec["substrate"] = substrate
client = dsec.Client(base_url=url, api_key=key)
now = time.perf_counter_ns


def e2b_loop():
    t0 = now()
    sbx = e2b.Sandbox.create(metadata=metadata, api_key=key, api_url=url)
    t1 = now()
    r = sbx.commands.run("true")
    t2 = now()
    sbx.kill()
    t3 = now()
    assert r.exit_code == 0, r
    return t0, t1, t2, t3


def dsec_loop():
    t0 = now()
    sb = dsec.Sandbox.create(client, **spec)
    t1 = now()
    r = sb.exec("true")
    t2 = now()
    sb.destroy()
    t3 = now()
    assert r.ok, r
    return t0, t1, t2, t3


def dsec_e2b_semantics_loop():
    t0 = now()
    sb = dsec.Sandbox.create(client, writable_root=True, network={"egress": "all"}, **spec)
    t1 = now()
    r = sb.exec(["/bin/bash", "-l", "-c", "true"])
    t2 = now()
    sb.destroy()
    t3 = now()
    assert r.ok, r
    return t0, t1, t2, t3


loops = [("e2b", e2b_loop), ("dsec", dsec_loop), ("dsec_e2b_semantics", dsec_e2b_semantics_loop)]
warmup, n = cfg["warmup"], cfg["iterations"]
for i in range(warmup + n):
    k = i % len(loops)
    for name, f in loops[k:] + loops[:k]:
        line = {"name": name, "warmup": i < warmup}
        try:
            t0, t1, t2, t3 = f()
            us = lambda a, b: (b - a) // 1000
            line.update(loop=us(t0, t3), create=us(t0, t1), run=us(t1, t2), kill=us(t2, t3))
        except Exception as e:
            line["error"] = repr(e)[:500]
        print(json.dumps(line), flush=True)
    if (i + 1) % 20 == 0:
        print(f"bench e2b: {i + 1} of {warmup + n}", file=sys.stderr, flush=True)
print(json.dumps({"done": True, "e2b": version("e2b"), "dsec": dsec.__version__}), flush=True)
"#;

/// The driver written to a file of its own for the run, removed when dropped.
struct Script(PathBuf);

impl Script {
    fn write() -> anyhow::Result<Self> {
        let p = std::env::temp_dir().join(format!("dsec-bench-e2b-{}.py", std::process::id()));
        std::fs::write(&p, DRIVER).with_context(|| format!("write {}", p.display()))?;
        Ok(Self(p))
    }
}

impl Drop for Script {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// `--python`, else `target/pyvenv/bin/python` of the repository this binary was built in (or
/// of the current directory).
fn python(args: &BenchArgs) -> PathBuf {
    if let Some(p) = &args.python {
        return p.clone();
    }
    let rel = Path::new("target/pyvenv/bin/python");
    let exe = std::env::current_exe().unwrap_or_default();
    exe.ancestors()
        .map(|d| d.join(rel))
        .find(|p| p.exists())
        .unwrap_or_else(|| rel.to_owned())
}

/// Fails with what to install unless `py` imports both SDKs.
fn check_python(py: &Path) -> anyhow::Result<()> {
    let out = Command::new(py)
        .args(["-c", "import e2b, dsec"])
        .output()
        .map_err(|e| anyhow::anyhow!("cannot run {}: {e}", py.display()));
    let why = match out {
        Ok(o) if o.status.success() => return Ok(()),
        Ok(o) => String::from_utf8_lossy(&o.stderr)
            .lines()
            .last()
            .unwrap_or_default()
            .to_owned(),
        Err(e) => e.to_string(),
    };
    bail!(
        "dsec bench e2b needs a Python with the `e2b` and `dsec` SDKs: {} cannot import them \
         ({why}). Install them with `scripts/test-python.sh --setup-only` (target/pyvenv with \
         e2b==2.63.0 and sdk/python), or `<venv>/bin/pip install e2b==2.63.0 ./sdk/python` and \
         pass `--python <venv>/bin/python`",
        py.display()
    )
}

/// The samples of one loop: per phase, and its failed iterations (the first one's error).
#[derive(Default)]
struct Samples {
    phases: [Vec<u64>; 4],
    errors: usize,
    first_error: Option<String>,
}

/// Reads the driver's lines into samples per loop; answers the SDK versions of its last line.
fn parse(stdout: &str) -> anyhow::Result<(Value, Vec<Samples>)> {
    let mut by_loop: Vec<Samples> = LOOPS.iter().map(|_| Samples::default()).collect();
    let mut versions = Value::Null;
    for line in stdout.lines().filter(|l| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line).with_context(|| format!("driver: {line}"))?;
        if v["done"] == true {
            versions = json!({"e2b": v["e2b"], "dsec": v["dsec"]});
            continue;
        }
        let name = v["name"].as_str().unwrap_or_default();
        let i = LOOPS
            .iter()
            .position(|l| *l == name)
            .with_context(|| format!("driver: no loop named in {line}"))?;
        let s = &mut by_loop[i];
        if let Some(e) = v["error"].as_str() {
            s.errors += 1;
            s.first_error.get_or_insert_with(|| e.to_owned());
        } else if v["warmup"] != true {
            for (k, phase) in PHASES.iter().enumerate() {
                s.phases[k].push(v[phase].as_u64().unwrap_or(0));
            }
        }
    }
    anyhow::ensure!(!versions.is_null(), "the driver stopped before its end");
    Ok((versions, by_loop))
}

fn ms(d: &Dist) -> f64 {
    d.p50_us as f64 / 1000.0
}

/// Runs the E2B SDK benchmark.
pub fn run(args: &BenchArgs) -> anyhow::Result<ExitCode> {
    let py = python(args);
    check_python(&py)?;
    let d = start_daemon("e2b", &[])?;
    let script = Script::write()?;
    let n = args.iterations.max(5);
    let cfg = json!({"url": d.url, "key": d.key, "substrate": args.substrate,
                     "iterations": n, "warmup": WARMUP});
    let out = Command::new(&py)
        .arg(&script.0)
        .arg(cfg.to_string())
        .env("E2B_API_URL", &d.url)
        .env("E2B_SANDBOX_URL", &d.url)
        .env("E2B_API_KEY", &d.key)
        .env_remove("E2B_DOMAIN")
        .env_remove("E2B_DEBUG")
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("run {}", py.display()))?;
    drop(script);
    if !out.status.success() {
        bail!("the Python driver failed ({})", out.status);
    }
    let (versions, samples) = parse(&String::from_utf8_lossy(&out.stdout))?;
    let mut results = Map::new();
    let mut p50 = Vec::new();
    for (name, s) in LOOPS.iter().zip(samples) {
        let mut m = Map::new();
        let mut dists = Vec::new();
        for (phase, v) in PHASES.iter().zip(s.phases) {
            let dd = dist(v);
            m.insert((*phase).into(), json!(&dd));
            dists.push(dd);
        }
        m.insert("errors".into(), json!(s.errors));
        m.insert("first_error".into(), json!(s.first_error));
        results.insert((*name).into(), Value::Object(m));
        p50.push(dists.iter().map(ms).collect::<Vec<f64>>());
    }
    drop(d);
    let ratio = |a: usize, b: usize, k: usize| p50[a][k] / p50[b][k].max(0.001);
    let mut ratios = Map::new();
    for (k, phase) in PHASES.iter().enumerate() {
        ratios.insert(format!("{phase}_e2b_over_dsec_p50"), json!(ratio(0, 1, k)));
        ratios.insert(
            format!("{phase}_e2b_over_dsec_e2b_semantics_p50"),
            json!(ratio(0, 2, k)),
        );
    }
    let summary = json!({
        "e2b_loop_p50_ms": p50[0][0],
        "dsec_loop_p50_ms": p50[1][0],
        "dsec_e2b_semantics_loop_p50_ms": p50[2][0],
        "ratio_e2b_over_dsec_p50": ratio(0, 1, 0),
        "phase_ratios": Value::Object(ratios),
        "target_ratio_max": TARGET_RATIO,
        "target_e2b_loop_p50_ms_max": TARGET_E2B_LOOP_MS,
        "ratio_met": ratio(0, 1, 0) <= TARGET_RATIO,
        "e2b_loop_p50_met": p50[0][0] <= TARGET_E2B_LOOP_MS,
    });
    let doc = json!({
        "bench": "e2b",
        "substrate": args.substrate,
        "iterations": n,
        "warmup": WARMUP,
        "sdks": versions,
        "results": Value::Object(results),
        "summary": summary,
    });
    emit(args, doc)
}
