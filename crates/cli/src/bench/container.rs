//! `dsec bench container`: latency and density of the container substrate, printed as JSON.
//!
//! Every figure is a distribution (count, p50, p90, p99, max in microseconds) and the peer
//! (`bwrap`, a host `python3`) is measured in the same run so ratios survive a noisy machine.

use std::collections::BTreeMap;
use std::process::{Command, ExitCode, Stdio};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{dist, emit, us, BenchArgs, Dist};
use dsec_api::exec::{ExecRequest, ExecStatus};
use dsec_node::lifecycle::{CreateRequest, Node, PoolSize};
use dsec_node::sandbox::SandboxSpec;
use dsec_node::store::{Store, Tenant};
use dsec_node::substrate::{Runtime, Sandbox};

fn exec_ok(sb: &mut Sandbox, rt: &Runtime, argv: &[&str]) -> anyhow::Result<u64> {
    let r = sb.exec(rt, &ExecRequest::argv(argv.iter().copied()), &[], |_, _| {})?;
    anyhow::ensure!(r.status == ExecStatus::Ok, "{argv:?} failed: {r:?}");
    Ok(r.wall_us)
}

fn meminfo() -> BTreeMap<String, u64> {
    let Ok(m) = std::fs::read_to_string("/proc/meminfo") else {
        return BTreeMap::new();
    };
    m.lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            let k = it.next()?.trim_end_matches(':').to_string();
            let v = it.next()?.parse::<u64>().ok()? * 1024;
            Some((k, v))
        })
        .collect()
}

/// Bytes held by each slab cache (`/proc/slabinfo`: active objects × object size).
fn slabinfo() -> BTreeMap<String, u64> {
    let Ok(s) = std::fs::read_to_string("/proc/slabinfo") else {
        return BTreeMap::new();
    };
    s.lines()
        .skip(2)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let active: u64 = f.get(1)?.parse().ok()?;
            let size: u64 = f.get(3)?.parse().ok()?;
            Some((f.first()?.to_string(), active * size))
        })
        .collect()
}

/// The `n` slab caches that grew most between two [`slabinfo`] reads, per `count` objects.
fn slab_growth(
    before: &BTreeMap<String, u64>,
    after: &BTreeMap<String, u64>,
    count: usize,
    n: usize,
) -> BTreeMap<String, i64> {
    let mut d: Vec<(String, i64)> = after
        .iter()
        .map(|(k, &a)| {
            let b = before.get(k).copied().unwrap_or(0);
            (k.clone(), (a as i64 - b as i64) / count.max(1) as i64)
        })
        .collect();
    d.sort_by_key(|(_, v)| std::cmp::Reverse(*v));
    d.into_iter().take(n).collect()
}

fn host_used_bytes() -> u64 {
    let Ok(m) = std::fs::read_to_string("/proc/meminfo") else {
        return 0;
    };
    let get = |k: &str| -> u64 {
        m.lines()
            .find(|l| l.starts_with(k))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
            * 1024
    };
    get("MemTotal:").saturating_sub(get("MemAvailable:"))
}

/// The least pause before a spaced reset: the supervisor builds the spare root 30 ms after a
/// reset.
const SPARE_SETTLE_MS: u64 = 50;

/// Runs `argv` `n` times, each after `settle` of quiet (zero: back to back).
fn run_peer(argv: &[&str], n: usize, settle: Duration) -> Option<Dist> {
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        std::thread::sleep(settle);
        let t = Instant::now();
        let ok = Command::new(argv[0])
            .args(&argv[1..])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .ok()?
            .success();
        if !ok {
            return None;
        }
        v.push(us(t));
    }
    Some(dist(v))
}

/// What a run measured: distributions by name.
type Results = BTreeMap<&'static str, Dist>;
/// What a run noted besides distributions.
type Notes = BTreeMap<&'static str, serde_json::Value>;

/// What every measurement of a run works with.
struct Run<'a> {
    rt: &'a Runtime,
    spec: &'a SandboxSpec,
    /// Iterations per figure.
    n: usize,
    /// Pause before a settled measurement.
    settle_ms: u64,
}

/// Cold creates + exec from a settled node (with their phases), back to back, and with a user
/// namespace.
fn cold_creates(r: &Run<'_>, res: &mut Results) -> anyhow::Result<()> {
    let (rt, spec, n, settle_ms) = (r.rt, r.spec, r.n, r.settle_ms);
    let (mut create, mut launch, mut create_exec, mut destroy) = (vec![], vec![], vec![], vec![]);
    let (mut cg, mut clone_exec) = (vec![], vec![]);
    let (mut first_exec, mut second_exec) = (vec![], vec![]);
    let (mut first_wall, mut second_wall) = (vec![], vec![]);
    for _ in 0..n {
        // Measure each create from a quiet node: the spawner refills its pre-built shells and
        // the kernel tears the previous sandbox's namespaces down in the background; the
        // back-to-back figure below includes that work.
        std::thread::sleep(Duration::from_millis(settle_ms));
        let t = Instant::now();
        let (mut sb, phases) = rt.create(spec)?;
        create.push(us(t));
        let t_exec = Instant::now();
        first_wall.push(exec_ok(&mut sb, rt, &["/bin/true"])?);
        first_exec.push(us(t_exec));
        create_exec.push(us(t));
        let t_exec = Instant::now();
        second_wall.push(exec_ok(&mut sb, rt, &["/bin/true"])?);
        second_exec.push(us(t_exec));
        launch.push(phases.launch_us);
        cg.push(phases.cgroup_us);
        clone_exec.push(phases.clone_exec_us);
        let t = Instant::now();
        sb.destroy(rt)?;
        destroy.push(us(t));
    }
    res.insert("cold_create_to_agent_ready", dist(create));
    res.insert("cold_create_phase_launch", dist(launch));
    res.insert("cold_create_phase_cgroup", dist(cg));
    res.insert("cold_create_phase_clone_to_exec", dist(clone_exec));
    res.insert("cold_create_exec_true", dist(create_exec));
    res.insert("destroy", dist(destroy));
    res.insert("first_exec_true_after_create", dist(first_exec));
    res.insert("second_exec_true_after_create", dist(second_exec));
    res.insert("first_exec_true_process_wall", dist(first_wall));
    res.insert("second_exec_true_process_wall", dist(second_wall));
    let mut b2b = vec![];
    for _ in 0..n {
        let t = Instant::now();
        let (mut sb, _) = rt.create(spec)?;
        exec_ok(&mut sb, rt, &["/bin/true"])?;
        b2b.push(us(t));
        sb.destroy(rt)?;
    }
    res.insert("cold_create_exec_true_back_to_back", dist(b2b));

    // The same from a settled node without a user namespace (`"userns": false`, the admin
    // tenant's opt-out): pre-built shells have one, so such a sandbox is made by the spawner.
    let host_root = SandboxSpec {
        userns: false,
        ..SandboxSpec::default()
    };
    let mut cold_host_root = vec![];
    for _ in 0..n.min(100) {
        std::thread::sleep(Duration::from_millis(settle_ms));
        let t = Instant::now();
        let (mut sb, _) = rt.create(&host_root)?;
        exec_ok(&mut sb, rt, &["/bin/true"])?;
        cold_host_root.push(us(t));
        sb.destroy(rt)?;
    }
    res.insert("cold_create_exec_true_no_userns", dist(cold_host_root));

    Ok(())
}

/// Peer: bubblewrap with every namespace, in the same run, under both conditions: back to
/// back, and from a node as settled as the cold creates (a process started on a quiet node
/// pays for waking idle CPUs, whoever starts it).
fn bwrap_peer(n: usize, settle_ms: u64, res: &mut Results, notes: &mut Notes) {
    let bwrap_argv = [
        "bwrap",
        "--unshare-all",
        "--ro-bind",
        "/",
        "/",
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        "/bin/true",
    ];
    let settle = Duration::from_millis(settle_ms);
    for (key, pause) in [
        ("peer_bwrap_true", Duration::ZERO),
        ("peer_bwrap_true_settled", settle),
    ] {
        match run_peer(&bwrap_argv, n, pause) {
            Some(d) => {
                res.insert(key, d);
            }
            None => {
                notes.insert(key, "bwrap not installed or failed".into());
            }
        }
    }
}

/// Exec in a running sandbox (`true`, python inside vs outside), then its resets.
fn execs_and_resets(r: &Run<'_>, res: &mut Results) -> anyhow::Result<()> {
    let (rt, spec, n, settle_ms) = (r.rt, r.spec, r.n, r.settle_ms);
    // Exec in a running sandbox, python inside vs outside.
    let (mut sb, _) = rt.create(spec)?;
    let mut v = vec![];
    for _ in 0..n {
        let t = Instant::now();
        exec_ok(&mut sb, rt, &["/bin/true"])?;
        v.push(us(t));
    }
    res.insert("exec_true_running", dist(v));
    let py_n = (n / 4).max(10);
    let mut v = vec![];
    for _ in 0..py_n {
        let t = Instant::now();
        exec_ok(&mut sb, rt, &["/usr/bin/python3", "-c", "pass"])?;
        v.push(us(t));
    }
    res.insert("python3_pass_inside", dist(v));
    if let Some(d) = run_peer(&["/usr/bin/python3", "-c", "pass"], py_n, Duration::ZERO) {
        res.insert("python3_pass_outside", d);
    }

    // Reset: clean (back to back, then spaced like a reuse loop, where an episode runs between
    // two resets: the supervisor has built the next root by then, its spare, see
    // docs/design.md, so the reset only pivots), and after writing 100 files.
    sb.mark_acquired()?;
    let mut clean_resets = |pause: Duration| -> anyhow::Result<Vec<u64>> {
        let mut v = vec![];
        for i in 0..n / 2 {
            if !pause.is_zero() {
                std::thread::sleep(pause);
            }
            let t = Instant::now();
            sb.reset()?;
            v.push(us(t));
            sb.mark_acquired()?;
            if i % 10 == 0 {
                exec_ok(&mut sb, rt, &["/bin/true"])?;
            }
        }
        Ok(v)
    };
    let clean = clean_resets(Duration::ZERO)?;
    let spaced = clean_resets(Duration::from_millis(settle_ms.max(SPARE_SETTLE_MS)))?;
    let mut dirty = vec![];
    for _ in 0..(n / 4).max(10) {
        exec_ok(
            &mut sb,
            rt,
            &[
                "/bin/sh",
                "-c",
                "for i in $(seq 100); do echo $i > /tmp/f$i; done",
            ],
        )?;
        let t = Instant::now();
        sb.reset()?;
        dirty.push(us(t));
        sb.mark_acquired()?;
    }
    res.insert("reset_clean", dist(spaced));
    res.insert("reset_clean_back_to_back", dist(clean));
    res.insert("reset_100_files", dist(dirty));
    sb.destroy(rt)?;

    Ok(())
}

/// Warm acquire from the daemon's pool: a create that the node's lifecycle serves from its
/// warm pool of the `host` template (the quota check, the handover recorded in the store, the
/// refill kicked off), as `POST /v1/sandboxes` does less its HTTP.
fn warm_acquire(rt: &Arc<Runtime>, n: usize, res: &mut Results) -> anyhow::Result<()> {
    let pool_size = 50.min(n);
    let state = tempfile::tempdir()?;
    let store = Store::open(&state.path().join("state.db"))?;
    let tenant = Tenant {
        id: "tn-bench".into(),
        name: "bench".into(),
        admin: false,
        max_sandboxes: None,
        max_memory_bytes: None,
        max_snapshot_bytes: None,
        created_at_ms: dsec_node::clock::now_ms(),
        egress_ceiling: None,
    };
    store.insert_tenant(&tenant)?;
    let tokio = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let node = Node::new(Arc::clone(rt), store, usize::MAX);
    let size = PoolSize {
        min: pool_size,
        max: pool_size,
    };
    let measured = tokio.block_on(async {
        node.configure_pool("host", size)?;
        node.ready.store(true, Ordering::Relaxed);
        node.kick_pools();
        let filled = Instant::now();
        while node.pool_stats().first().and_then(|p| p["ready"].as_u64()) < Some(pool_size as u64) {
            anyhow::ensure!(
                filled.elapsed() < Duration::from_secs(300),
                "the pool did not fill"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut v = vec![];
        for _ in 0..pool_size {
            let t = Instant::now();
            let rec = node.create(&tenant, CreateRequest::host()).await?;
            v.push(us(t));
            anyhow::ensure!(rec.pooled, "a create missed the full pool");
        }
        Ok(v)
    });
    // No refill beyond this point, and nothing of the node's left behind.
    node.draining.store(true, Ordering::Relaxed);
    tokio.block_on(node.destroy_all(Duration::from_secs(120)));
    res.insert("warm_acquire_from_pool", dist(measured?));
    Ok(())
}

/// Density: `idle` idle sandboxes held at once, host memory per sandbox.
fn density(rt: &Runtime, spec: &SandboxSpec, idle: usize, notes: &mut Notes) -> anyhow::Result<()> {
    let before = host_used_bytes();
    let mi_before = meminfo();
    let slab_before = slabinfo();
    let mut held = Vec::with_capacity(idle);
    let t = Instant::now();
    for _ in 0..idle {
        match rt.create(spec) {
            Ok((sb, _)) => held.push(sb),
            Err(e) => {
                notes.insert("idle_stopped_by", format!("{e:#}").into());
                break;
            }
        }
    }
    let create_all_ms = t.elapsed().as_millis() as u64;
    std::thread::sleep(Duration::from_millis(500));
    let after = host_used_bytes();
    let mi_after = meminfo();
    let count = held.len();
    let slab_top = slab_growth(&slab_before, &slabinfo(), count, 16);
    // Where the memory went, per sandbox (kernel slabs, page tables, stacks, tmpfs, user).
    let breakdown: BTreeMap<&str, i64> = [
        "AnonPages",
        "Shmem",
        "Slab",
        "SUnreclaim",
        "PageTables",
        "KernelStack",
        "Percpu",
    ]
    .into_iter()
    .map(|k| {
        let d = mi_after.get(k).copied().unwrap_or(0) as i64
            - mi_before.get(k).copied().unwrap_or(0) as i64;
        (k, if count > 0 { d / count as i64 } else { 0 })
    })
    .collect();
    let per = if count > 0 {
        after.saturating_sub(before) / count as u64
    } else {
        0
    };
    // Everything still answers.
    let mut alive = 0;
    for sb in held.iter_mut() {
        if sb.ping().is_ok() {
            alive += 1;
        }
    }
    let t = Instant::now();
    for sb in held {
        sb.destroy(rt)?;
    }
    notes.insert(
        "idle",
        serde_json::json!({
            "held": count,
            "answering_ping": alive,
            "host_memory_per_sandbox_bytes": per,
            "per_sandbox_breakdown_bytes": breakdown,
            "per_sandbox_slab_top_bytes": slab_top,
            "create_all_ms": create_all_ms,
            "destroy_all_ms": t.elapsed().as_millis() as u64,
        }),
    );
    Ok(())
}

/// The ratios of like against like.
fn ratios(res: &Results) -> serde_json::Value {
    let ratio = |a: &str, b: &str| -> Option<f64> {
        let (a, b) = (res.get(a)?, res.get(b)?);
        (b.p50_us > 0).then(|| a.p50_us as f64 / b.p50_us as f64)
    };
    serde_json::json!({
        // Like against like: settled against settled, back to back against back to back.
        "cold_create_exec_true_vs_bwrap_p50":
            ratio("cold_create_exec_true", "peer_bwrap_true_settled"),
        "back_to_back_vs_bwrap_p50": ratio("cold_create_exec_true_back_to_back", "peer_bwrap_true"),
        // The stricter mix reported before: a settled create against bwrap back to back.
        "cold_create_exec_true_vs_bwrap_back_to_back_p50":
            ratio("cold_create_exec_true", "peer_bwrap_true"),
        "python_inside_vs_outside_p50": ratio("python3_pass_inside", "python3_pass_outside"),
        // The default has a user namespace; the opt-out is made without a pre-built shell.
        "userns_vs_no_userns_p50":
            ratio("cold_create_exec_true", "cold_create_exec_true_no_userns"),
    })
}

/// Runs the container benchmark.
pub fn run(
    args: &BenchArgs,
    rt: impl FnOnce() -> anyhow::Result<Runtime>,
) -> anyhow::Result<ExitCode> {
    let rt = Arc::new(rt()?);
    let n = args.iterations.max(10);
    let spec = SandboxSpec::default();
    let mut res = Results::new();
    let mut notes = Notes::new();

    // Warm-up: page cache, spawner, cgroup base dirs.
    for _ in 0..5 {
        let (mut sb, _) = rt.create(&spec)?;
        exec_ok(&mut sb, &rt, &["/bin/true"])?;
        sb.destroy(&rt)?;
    }
    let r = Run {
        rt: &rt,
        spec: &spec,
        n,
        settle_ms: args.settle_ms,
    };
    cold_creates(&r, &mut res)?;
    bwrap_peer(n, args.settle_ms, &mut res, &mut notes);
    execs_and_resets(&r, &mut res)?;
    warm_acquire(&rt, n, &mut res)?;
    if args.idle > 0 {
        density(&rt, &spec, args.idle, &mut notes)?;
    }
    let ratios = ratios(&res);
    let out = serde_json::json!({
        "benchmark": "container",

        "cgroup_favordynmods": rt.favordynmods(),
        "results": res,
        "ratios": ratios,
        "notes": notes,
    });
    emit(args, out)
}
