//! `dsec server`: the node daemon.
//!
//! With no flags it is a complete single-node system: SQLite state in the data dir, the `host`
//! template, the HTTP API on `127.0.0.1:7700`. Sandboxes live in their own supervisors, so they
//! survive the daemon: on start it reconnects to every sandbox its store knows ([`Node::recover`])
//! and destroys what it cannot adopt or does not know. SIGTERM/SIGINT drain: new work is
//! refused with `draining` (503, `Retry-After`), requests in flight finish within a deadline,
//! and the process exits 0 with every sandbox still running for the next start (or, with
//! `shutdown_sandboxes`, after destroying them all).

mod auth;
pub mod error;
mod http;
mod keyed;
pub mod openapi;
pub mod run;
mod state;
pub mod trajectory;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State as AxState;
use std::future::IntoFuture as _;

use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};

use crate::store;
use crate::substrate::{Runtime, RuntimeConfig};
use dsec_sys::cgroup::CgroupStats;

pub use crate::lifecycle::{Node, PoolSize};

/// Settings of the daemon.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Runtime settings (data dir, run dir, binaries).
    pub runtime: RuntimeConfig,
    /// Where to listen.
    pub listen: SocketAddr,
    /// How long in-flight requests get after SIGTERM.
    pub drain_timeout: Duration,
    /// Warm pool of the `host` template (`None`: no pool until one is set through the API).
    pub host_pool: Option<PoolSize>,
    /// Most sandboxes the node holds at once (pools included); creates beyond answer
    /// `resource_exhausted`.
    pub max_sandboxes: usize,
    /// Patterns masked in the trajectory log (on top of secret env values).
    pub redact_patterns: Vec<String>,
    /// Trajectory log retention: whole segments older than this, or beyond this many bytes,
    /// are deleted (never the active one).
    pub log_retention: (Option<Duration>, Option<u64>),
    /// Finished trajectories are compacted out of the log this long after they finished.
    pub compact_finished_after: Duration,
    /// Size at which the trajectory log starts a new segment (default 64 MiB).
    pub log_segment_bytes: Option<u64>,
    /// The code runner (`/v1/run`, `/run_code`).
    pub run: run::RunConfig,
    /// On SIGTERM/SIGINT, after the drain, destroy every sandbox of the node (every tenant's,
    /// the pools', the runner's) instead of leaving them running for the next start to adopt.
    pub shutdown_sandboxes: bool,
    /// Bound on the VM cache's size on disk (least recently used unused entries go first).
    pub vm_cache_max_bytes: Option<u64>,
    /// The cluster this node joins (`None`: a node on its own, the embedded default).
    pub cluster: Option<crate::member::ClusterConfig>,
    /// How sandboxes' network egress is set up.
    pub egress: crate::egress::EgressConfig,
}

/// A failure to start or run the daemon.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The runtime could not start.
    #[error("runtime: {0}")]
    Runtime(#[from] crate::substrate::RuntimeError),
    /// The store could not be opened.
    #[error(transparent)]
    Store(#[from] store::StoreError),
    /// Something else.
    #[error("{0}")]
    Other(String),
}

/// Logs a VM preparation step (a create that must fetch the kernel, build images or boot a
/// template says so: the first VM create of a host takes a minute or more).
fn log_vm_preparation(template: &str, e: crate::substrate::vm::Event) {
    match e {
        crate::substrate::vm::Event::Start(p) => {
            tracing::info!(template = %template, phase = %p.name(), "vm: preparing")
        }
        crate::substrate::vm::Event::Done(p, took) => {
            tracing::info!(
                template = %template,
                phase = %p.name(),
                took_ms = %took.as_millis(),
                "vm: prepared",
            )
        }
        crate::substrate::vm::Event::Progress(..) => {}
    }
}

/// Runs the daemon until SIGTERM/SIGINT; `on_ready` receives the bound address (and the
/// admin key on the first start of a data dir) once the API answers.
pub fn run(
    cfg: ServerConfig,
    on_ready: impl FnOnce(SocketAddr, Option<String>) + Send + 'static,
) -> Result<(), ServerError> {
    crate::log::init();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(1024)
        .enable_all()
        .thread_name("dsec-server")
        .build()
        .map_err(|e| ServerError::Other(format!("tokio: {e}")))?;
    rt.block_on(serve(cfg, on_ready))
}

async fn serve(
    cfg: ServerConfig,
    on_ready: impl FnOnce(SocketAddr, Option<String>) + Send + 'static,
) -> Result<(), ServerError> {
    std::fs::create_dir_all(&cfg.runtime.data_dir)
        .map_err(|e| ServerError::Other(format!("data dir: {e}")))?;
    let store = store::Store::open(&cfg.runtime.data_dir.join("state.db"))?;
    let admin_key = bootstrap_admin(&store, &cfg.runtime.data_dir)?;
    // Before the runtime starts its spawner: every process the node starts inherits the
    // partition's quiet cpuset.
    let partition = crate::lifecycle::cpu_share::start_partition();
    let runtime_cfg = cfg.runtime.clone();
    let runtime = tokio::task::spawn_blocking(move || Runtime::start(runtime_cfg))
        .await
        .map_err(|e| ServerError::Other(e.to_string()))??;
    runtime.set_vm_settings(crate::substrate::VmSettings {
        cache_max_bytes: cfg.vm_cache_max_bytes,
        observer: Some(std::sync::Arc::new(log_vm_preparation)),
    });
    let trajectories = open_trajectories(&cfg).await?;
    if cfg.run.anonymous && !cfg.listen.ip().is_loopback() {
        return Err(ServerError::Other(format!(
            "--anonymous-run is allowed only on a loopback listener, not {}",
            cfg.listen
        )));
    }
    let run_tenant = internal_tenant(&store, "run", None)?;
    let anonymous = if cfg.run.anonymous {
        Some(internal_tenant(&store, "anonymous", Some(16))?)
    } else {
        None
    };
    let app = Node::new(Arc::new(runtime), store, cfg.max_sandboxes);
    if let Some(p) = partition {
        app.cpu_shares.set_partition(p);
    }
    let _ = app.egress_config.set(cfg.egress.clone());
    let member = join(&cfg, &app).await?;
    let state = state::AppState {
        node: Arc::clone(&app),
        runner: Arc::new(run::Runner::new(
            Arc::clone(&app),
            cfg.run.clone(),
            run_tenant,
            anonymous,
        )),
        trajectories: Arc::new(trajectories),
        compact_after: cfg.compact_finished_after,
        idem: Arc::default(),
        member: member.clone(),
    };
    configure_pools(&cfg, &app)?;
    let report = app.recover().await;
    app.kick_pools();
    tracing::info!(
        adopted = %report.adopted.len(),
        reaped = %report.reaped.len(),
        orphans = %report.orphans.len(),
        orphan_cgroups = %report.orphan_cgroups.len(),
        took_ms = %report.took_ms,
        "recovered",
    );
    tokio::spawn(run::start(
        Arc::clone(&state.runner),
        crate::clock::now_ms(),
    ));
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .map_err(|e| ServerError::Other(format!("listen on {}: {e}", cfg.listen)))?;
    let addr = listener
        .local_addr()
        .map_err(|e| ServerError::Other(e.to_string()))?;
    let periodic = spawn_periodic(&state);
    let membership = member.map(|m| {
        m.listening_on(addr);
        tokio::spawn(m.run(Arc::clone(&app)))
    });
    let drain = cfg.drain_timeout;
    // On SIGTERM: refuse new work (`draining`) while still answering, let the requests in
    // flight finish (bounded by the drain deadline), then stop accepting and close.
    let signalled = on_signal();
    let shutdown = {
        let app = Arc::clone(&app);
        async move {
            signalled.await;
            app.draining.store(true, Ordering::Relaxed);
            tracing::info!(in_flight = %app.in_flight(), "draining");
            let deadline = tokio::time::Instant::now() + drain;
            while app.in_flight() > 0 && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    on_ready(addr, admin_key);
    tracing::info!(addr = %addr, "listening");
    // A streamed answer (an exec's events, the E2B API's Connect streams) goes out as small
    // writes: without TCP_NODELAY the second waits for the client's delayed ACK (40 ms).
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let server = axum::serve(listener, http::router(state.clone()))
        .with_graceful_shutdown(shutdown)
        .into_future();
    let watchdog = {
        let app = Arc::clone(&app);
        async move {
            while !app.draining.load(Ordering::Relaxed) {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            // Open connections (event streams, idle keep-alives) get the deadline, then go.
            tokio::time::sleep(drain + Duration::from_secs(1)).await;
        }
    };
    let result = tokio::select! {
        r = server => r.map_err(|e| ServerError::Other(format!("serve: {e}"))),
        () = watchdog => {
            tracing::warn!("drain deadline passed; closing open connections");
            Ok(())
        }
    };
    for task in periodic.into_iter().chain(membership) {
        task.abort();
    }
    run::stop(&state.runner).await;
    if cfg.shutdown_sandboxes {
        app.destroy_all(Duration::from_secs(60)).await;
    }
    // Sandboxes that live on keep their paths out enforced by the kernel meanwhile.
    app.egress_idle_teardown();
    app.cpu_shares.dissolve_partition();
    result?;
    tracing::info!("stopped");
    Ok(())
}

/// Pools first (recovery hands their adopted sandboxes back), from the store; the host pool
/// from the flags unless it was configured through the API before.
fn configure_pools(cfg: &ServerConfig, app: &Arc<Node>) -> Result<(), ServerError> {
    let stored = app.store.pools()?;
    for (template, min, max) in &stored {
        app.configure_pool(
            template,
            PoolSize {
                min: *min,
                max: *max,
            },
        )
        .map_err(|e| ServerError::Other(format!("pool {template}: {e}")))?;
    }
    if let Some(size) = cfg
        .host_pool
        .filter(|_| !stored.iter().any(|(t, ..)| t == "host"))
    {
        app.configure_pool("host", size)
            .map_err(|e| ServerError::Other(format!("host pool: {e}")))?;
    }
    Ok(())
}

/// Opens the trajectory log (recovering it); a corrupt log is served from its valid prefix.
/// In a cluster: joins it (the node's number is claimed before any sandbox id is made), keeps
/// every new layer's blob from now on (to serve the nodes that fetch it) and fetches the
/// templates the node does not hold through the member.
async fn join(
    cfg: &ServerConfig,
    app: &Arc<Node>,
) -> Result<Option<Arc<crate::member::Member>>, ServerError> {
    let Some(c) = cfg.cluster.clone() else {
        return Ok(None);
    };
    let m = tokio::task::spawn_blocking(move || crate::member::Member::join(c))
        .await
        .map_err(|e| ServerError::Other(e.to_string()))?
        .map_err(|e| ServerError::Other(format!("join the cluster: {e}")))?;
    app.rt
        .templates()
        .layers()
        .keep_blobs()
        .map_err(|e| ServerError::Other(format!("the layer store: {e}")))?;
    let m = Arc::new(m);
    let _ = app
        .fetcher
        .set(Arc::clone(&m) as Arc<dyn crate::lifecycle::TemplateFetcher>);
    let _ = app
        .quota
        .set(Arc::clone(&m) as Arc<dyn crate::lifecycle::ClusterQuota>);
    Ok(Some(m))
}

async fn open_trajectories(cfg: &ServerConfig) -> Result<trajectory::Trajectories, ServerError> {
    let traj_dir = cfg.runtime.data_dir.join("trajectories");
    let patterns = cfg.redact_patterns.clone();
    let retention = cfg.log_retention;
    let segment_bytes = cfg.log_segment_bytes;
    let trajectories = tokio::task::spawn_blocking(move || {
        trajectory::Trajectories::open(traj_dir, &patterns, retention, segment_bytes)
    })
    .await
    .map_err(|e| ServerError::Other(e.to_string()))?
    .map_err(ServerError::Other)?;
    if trajectories.recovery.is_corrupt() {
        tracing::warn!(
            report = %format!("{:?}", trajectories.recovery),
            "trajectory log: corruption found; serving its valid prefix (damaged segments kept as *.corrupt-*)",
        );
    }
    Ok(trajectories)
}

/// Registers for SIGTERM and SIGINT now (before the daemon says it is ready, so that a signal
/// right after that is never the default action), and returns the wait for either.
fn on_signal() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{signal, SignalKind};
    let signals = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    );
    async move {
        let (Ok(mut term), Ok(mut int)) = signals else {
            std::future::pending::<()>().await;
            return;
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    }
}

/// A tenant the node itself uses (the runner's sandboxes, the anonymous runner): made on the
/// first start, never given an API key.
fn internal_tenant(
    store: &store::Store,
    name: &str,
    max_sandboxes: Option<u64>,
) -> Result<store::Tenant, ServerError> {
    if let Some(t) = store.tenant_by_name(name)? {
        return Ok(t);
    }
    let t = store::Tenant {
        id: format!("tn-{name}"),
        name: name.to_owned(),
        admin: false,
        max_sandboxes,
        max_memory_bytes: None,
        max_snapshot_bytes: None,
        created_at_ms: crate::clock::now_ms(),
        egress_ceiling: None,
    };
    store.insert_tenant(&t)?;
    Ok(t)
}

/// Creates the `admin` tenant on the first start and writes its key to
/// `<data_dir>/admin.key` (0600); returns the key when it was just made.
fn bootstrap_admin(
    store: &store::Store,
    data_dir: &std::path::Path,
) -> Result<Option<String>, ServerError> {
    if store.tenant_by_name("admin")?.is_some() {
        return Ok(None);
    }
    let (_, key) = auth::new_tenant(store, "admin", true, None, None, None, None)
        .map_err(|e| ServerError::Other(e.to_string()))?;
    let path: PathBuf = data_dir.join("admin.key");
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&path)
        .map_err(|e| ServerError::Other(format!("{}: {e}", path.display())))?;
    writeln!(f, "{key}").map_err(|e| ServerError::Other(format!("{}: {e}", path.display())))?;
    Ok(Some(key))
}

/// `/metrics`: Prometheus text exposition: the registry's counters and histograms, then
/// gauges read now (sandboxes by state, pools, per-sandbox CPU and memory from the cgroups).
async fn metrics_text(AxState(state): AxState<state::AppState>) -> Response {
    let app = &state.node;
    use std::fmt::Write as _;
    let mut out = app.metrics.registry.render();
    let mut by_state = std::collections::BTreeMap::new();
    let entries = app.entries();
    for e in &entries {
        let state = serde_json::to_value(e.record().state).unwrap_or_default();
        *by_state
            .entry(state.as_str().unwrap_or("unknown").to_owned())
            .or_insert(0u64) += 1;
    }
    let _ = writeln!(
        out,
        "# HELP dsec_sandboxes Sandboxes by state\n# TYPE dsec_sandboxes gauge"
    );
    for (s, n) in by_state {
        let _ = writeln!(out, "dsec_sandboxes{{state=\"{s}\"}} {n}");
    }
    let pools = app.pool_stats();
    for (name, field, help) in [
        ("dsec_pool_ready", "ready", "Ready pooled sandboxes"),
        ("dsec_pool_target", "target", "Pool target size"),
        ("dsec_pool_hit_rate", "hit_rate", "Pool hit rate"),
    ] {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        for p in &pools {
            let t = p["template"].as_str().unwrap_or("");
            let _ = writeln!(out, "{name}{{template=\"{t}\"}} {}", p[field]);
        }
    }
    let _ = writeln!(
        out,
        "# HELP dsec_idle_shells Pre-built shells\n# TYPE dsec_idle_shells gauge\ndsec_idle_shells {}",
        app.rt.idle_shells()
    );
    let _ = writeln!(
        out,
        "# HELP dsec_http_requests_in_flight Requests being served\n# TYPE dsec_http_requests_in_flight gauge\ndsec_http_requests_in_flight {}",
        app.in_flight()
    );
    let accel = app.rt.vms_started().map(|v| v.accel().name());
    let _ = writeln!(
        out,
        "# HELP dsec_vm_accel The VM substrates' accelerator (1 = in use; absent until first use)\n# TYPE dsec_vm_accel gauge"
    );
    if let Some(a) = accel {
        let _ = writeln!(out, "dsec_vm_accel{{accel=\"{a}\"}} 1");
    }
    // Per-sandbox resource use, read from the cgroups off the async threads.
    let rt = Arc::clone(&app.rt);
    let ids: Vec<String> = entries.iter().map(|e| e.id.clone()).collect();
    let per = tokio::task::spawn_blocking(move || {
        ids.into_iter()
            .filter_map(|id| {
                let st = rt.cgroups().open(&id)?.stats().ok()?;
                Some((id, st))
            })
            .collect::<Vec<_>>()
    })
    .await
    .unwrap_or_default();
    /// A per-sandbox series: name, type, help, its value in a sandbox's cgroup figures.
    type Family = (
        &'static str,
        &'static str,
        &'static str,
        fn(&CgroupStats) -> Option<f64>,
    );
    let families: [Family; 3] = [
        (
            "dsec_sandbox_memory_bytes",
            "gauge",
            "Memory charged to a sandbox",
            |st| Some(st.memory_current as f64),
        ),
        (
            "dsec_sandbox_cpu_seconds_total",
            "counter",
            "CPU time of a sandbox",
            |st| st.cpu_usage_ns.map(|ns| ns as f64 / 1e9),
        ),
        (
            "dsec_sandbox_oom_kills_total",
            "counter",
            "OOM kills inside a sandbox",
            |st| Some(st.oom_kills as f64),
        ),
    ];
    for (name, kind, help, value) in families {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (id, st) in &per {
            if let Some(v) = value(st) {
                let _ = writeln!(out, "{name}{{sandbox=\"{id}\"}} {v}");
            }
        }
    }
    if let Some(eg) = app.egress_if_started() {
        if let Ok(text) = tokio::task::spawn_blocking(move || eg.metrics_text()).await {
            out.push_str(&text);
        }
    }
    let mut resp = out.into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4"),
    );
    resp
}

/// The node's periodic tasks: the sweep (every second; the trajectory log's retention and
/// compaction every minute) and the CPU-share governor (`lifecycle::cpu_share`, every tick).
fn spawn_periodic(state: &state::AppState) -> [tokio::task::JoinHandle<()>; 2] {
    let sweeper = {
        let state = state.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            for n in 1u64.. {
                tick.tick().await;
                state.node.sweep().await;
                // Every minute: the trajectory log's retention and compaction.
                if n.is_multiple_of(60) {
                    let s = state.clone();
                    let _ = tokio::task::spawn_blocking(move || s.maintain_log()).await;
                }
            }
        })
    };
    let cpu_governor = {
        let node = Arc::clone(&state.node);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(crate::lifecycle::cpu_share::TICK);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            // `DSEC_CPU_SHARES=off`: every sandbox keeps its own weight (benchmark peers).
            if std::env::var("DSEC_CPU_SHARES").is_ok_and(|v| v == "off") {
                return;
            }
            loop {
                tick.tick().await;
                let n = Arc::clone(&node);
                let _ = tokio::task::spawn_blocking(move || n.cpu_shares.tick(&n)).await;
            }
        })
    };
    [sweeper, cpu_governor]
}
