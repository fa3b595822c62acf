//! The container substrate of the code runner: a run's files written into a pooled container
//! sandbox, its compile and run phases as shell commands there, the sandbox reset in the
//! background before it is reused.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use dsec_api::agent::{Event, Request as AgentReq};
use dsec_api::exec::{Command, ExecRequest, ExecResult, ExecStatus};

use super::request::RunSpec;
use super::Runner;
use super::{
    agent_call, runner_sandbox, sandbox_exec, PhaseResult, RunOutcome, Substrate, Verdict, B64,
    MAX_FILES_BYTES, WORKDIR,
};
use crate::lifecycle::Entry;
use crate::server::error::{ApiError, ApiResult};

fn phase_of(r: &ExecResult, memory: Option<u64>) -> PhaseResult {
    let over_memory = memory.is_some_and(|m| r.peak_rss_kb * 1024 >= m / 100 * 95);
    let status = match r.status {
        ExecStatus::Ok => Verdict::Finished,
        ExecStatus::Timeout => Verdict::TimeLimitExceeded,
        ExecStatus::Oom => Verdict::MemoryLimitExceeded,
        ExecStatus::OutputLimit => Verdict::OutputLimitExceeded,
        _ if over_memory => Verdict::MemoryLimitExceeded,
        ExecStatus::NonzeroExit | ExecStatus::Killed => Verdict::RuntimeError,
    };
    let status = if status == Verdict::Finished && (r.stdout.truncated || r.stderr.truncated) {
        Verdict::OutputLimitExceeded
    } else {
        status
    };
    PhaseResult {
        status,
        exit_code: r.exit_code.or(r.signal.map(|s| -s)),
        stdout: String::from_utf8_lossy(&r.stdout.data).into_owned(),
        stderr: String::from_utf8_lossy(&r.stderr.data).into_owned(),
        execution_time: r.wall_us as f64 / 1e6,
        memory_kb: r.peak_rss_kb,
    }
}

pub(super) fn shell_exec(cmd: String, timeout: Duration, output_limit: u64) -> ExecRequest {
    ExecRequest {
        command: Command::Shell(cmd),
        env: BTreeMap::new(),
        cwd: Some(WORKDIR.into()),
        timeout_ms: Some(timeout.as_millis().max(1) as u64),
        cpu_limit_ms: Some(timeout.as_millis().max(1) as u64),
        output_limit: Some(output_limit),
        ..ExecRequest::shell(String::new())
    }
}

async fn write_file(
    app: &Arc<Runner>,
    e: &Arc<Entry>,
    path: String,
    data: Vec<u8>,
) -> ApiResult<()> {
    let ev = agent_call(
        app,
        e,
        AgentReq::FileWrite {
            path,
            mode: Some(0o755),
            parents: true,
        },
        data,
        Some(Duration::from_secs(30)),
    )
    .await?;
    match ev {
        Event::Ok => Ok(()),
        other => Err(ApiError::internal(format!("unexpected {other:?}"))),
    }
}

async fn read_file(e: &Arc<Entry>, path: String, max: u64) -> Option<Vec<u8>> {
    let mut guard = e.lock().await;
    tokio::task::spawn_blocking(move || {
        let sb = guard.as_mut()?;
        let req = AgentReq::FileRead {
            path,
            max_bytes: Some(max),
        };
        let mut data = Vec::new();
        let r = sb
            .agent()
            .call(&req, &[], Some(Duration::from_secs(30)), |ev, b| {
                if matches!(ev, Event::Data { .. }) {
                    data.extend_from_slice(b);
                }
            });
        match r {
            Ok((ev, last)) => {
                if matches!(ev, Event::Data { .. }) {
                    data.extend_from_slice(&last);
                }
                Some(data)
            }
            Err(_) => None,
        }
    })
    .await
    .ok()
    .flatten()
}

async fn run_container_in(
    app: &Arc<Runner>,
    e: &Arc<Entry>,
    spec: &RunSpec,
) -> ApiResult<RunOutcome> {
    let prog = &spec.program;
    write_file(
        app,
        e,
        format!("{WORKDIR}/{}", prog.source),
        prog.code.clone().into_bytes(),
    )
    .await?;
    for (p, d) in &spec.files {
        write_file(app, e, format!("{WORKDIR}/{p}"), d.clone()).await?;
    }
    let mut compile_result = None;
    if let Some(cc) = &prog.compile {
        let r = sandbox_exec(
            app,
            e,
            shell_exec(cc.clone(), spec.compile_timeout, spec.output_limit),
            Vec::new(),
        )
        .await?;
        let phase = phase_of(&r, None);
        let ok = phase.status == Verdict::Finished;
        compile_result = Some(phase);
        if !ok {
            return Ok(RunOutcome {
                status: "Failed",
                compile_result,
                run_result: None,
                files: BTreeMap::new(),
                substrate: Substrate::Container,
                server_us: 0,
                clamped: BTreeMap::new(),
            });
        }
    }
    let cmd = match spec.memory_bytes {
        Some(m) => format!("ulimit -v {} 2>/dev/null; {}", m / 1024, prog.run),
        None => prog.run.clone(),
    };
    let r = sandbox_exec(
        app,
        e,
        shell_exec(cmd, spec.run_timeout, spec.output_limit),
        spec.stdin.clone(),
    )
    .await?;
    let run = phase_of(&r, spec.memory_bytes);
    let mut files = BTreeMap::new();
    for p in &spec.fetch {
        if let Some(d) = read_file(e, format!("{WORKDIR}/{p}"), MAX_FILES_BYTES as u64).await {
            files.insert(p.clone(), B64.encode(d));
        }
    }
    Ok(RunOutcome {
        status: if run.status == Verdict::Finished {
            "Success"
        } else {
            "Failed"
        },
        compile_result,
        run_result: Some(run),
        files,
        substrate: Substrate::Container,
        server_us: 0,
        clamped: BTreeMap::new(),
    })
}

pub(super) async fn run_container(app: &Arc<Runner>, spec: &RunSpec) -> ApiResult<RunOutcome> {
    let idle = app
        .containers
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get_mut(&spec.template)
        .and_then(Vec::pop);
    let e = match idle {
        Some(e) => e,
        None => runner_sandbox(app, &spec.template).await?,
    };
    let out = run_container_in(app, &e, spec).await;
    // Reset for the next run in the background; a sandbox that cannot be reset goes.
    let app2 = Arc::clone(app);
    let template = spec.template.clone();
    tokio::spawn(async move {
        if app2.node.reset(&e).await.is_ok() {
            let mut m = app2.containers.lock().unwrap_or_else(|p| p.into_inner());
            let idle = m.entry(template).or_default();
            if idle.len() < app2.cfg.zygotes.max(1) * 4 {
                idle.push(e);
                return;
            }
        }
        let _ = app2.node.destroy(&e).await;
    });
    out
}
