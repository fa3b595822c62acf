//! SandboxFusion's `POST /run_code`, answered as its server answers: every field of its
//! response models, its status codes (422 with FastAPI's `{"detail": [...]}` for a request it
//! would not validate, 200 with `SandboxError` for a failure of the node), unknown request
//! fields ignored, and a language whose toolchain the template lacks answered as a shell
//! answers a missing command (return code 127).

use std::sync::Arc;

use dsec_api::ErrorCode;
use serde_json::{json, Value};

use super::request::{self, BadRun, Fields, RunSpec};
use super::Runner;
use super::{anonymous_slot, available, execute, PhaseResult, RunOutcome, Verdict};
use crate::server::error::ApiError;
use crate::store::Tenant;

/// SandboxFusion's `CommandRunResult` of a phase: its statuses are `Finished`, `Error` and
/// `TimeLimitExceeded`; the finer verdict (with `MemoryLimitExceeded`) travels in the extra
/// field `verdict`, which its pydantic models ignore.
fn phase(p: &PhaseResult) -> Value {
    // A non-zero exit is `Finished` with its return code there too.
    let status = match p.status {
        Verdict::TimeLimitExceeded => "TimeLimitExceeded",
        Verdict::Finished
        | Verdict::RuntimeError
        | Verdict::MemoryLimitExceeded
        | Verdict::OutputLimitExceeded => "Finished",
    };
    json!({
        "status": status,
        "execution_time": p.execution_time,
        "return_code": p.exit_code,
        "stdout": p.stdout,
        "stderr": p.stderr,
        "verdict": p.status,
        "memory_kb": p.memory_kb,
    })
}

/// The answer to a run: `Success` when the run phase finished with code 0. `clamped` (an
/// extra field, ignored by its models) names the fields whose value the node clamped.
fn answer(o: &RunOutcome) -> Value {
    let ok = o
        .run_result
        .as_ref()
        .is_some_and(|r| r.status == Verdict::Finished && r.exit_code == Some(0));
    json!({
        "status": if ok { "Success" } else { "Failed" },
        "message": "",
        "compile_result": o.compile_result.as_ref().map(phase),
        "run_result": o.run_result.as_ref().map(phase),
        "executor_pod_name": null,
        "files": o.files,
        "clamped": o.clamped,
    })
}

/// A template without the language's toolchain: SandboxFusion runs the command all the same
/// and the shell answers 127 in the phase that needed it (compile for compiled languages).
fn missing_toolchain(spec: &RunSpec) -> Value {
    let lang = spec.lang;
    let p = json!({
        "status": "Finished",
        "execution_time": 0.0,
        "return_code": 127,
        "stdout": "",
        "stderr": format!(
            "sh: 1: {}: command not found (template {} has no {} toolchain)\n",
            lang.tool, spec.template, lang.name
        ),
        "verdict": Verdict::RuntimeError,
        "memory_kb": 0,
    });
    let (compile, run) = match spec.program.compile {
        Some(_) => (p, Value::Null),
        None => (Value::Null, p),
    };
    json!({
        "status": "Failed",
        "message": "",
        "compile_result": compile,
        "run_result": run,
        "executor_pod_name": null,
        "files": {},
        "clamped": spec.clamped,
    })
}

/// A request FastAPI would refuse: 422 with its `detail`.
fn unprocessable(e: &BadRun) -> (u16, Value) {
    (422, json!({"detail": e.fastapi_detail()}))
}

/// An error of the node while serving a valid request: 422 when it is the request's (a
/// template that does not exist is a bad `template` field), else 200 with `SandboxError`, the
/// reason in `message` and the native error code in `code` (SandboxFusion's client raises on
/// either and retries).
fn failed(e: ApiError) -> (u16, Value) {
    match e.code {
        ErrorCode::InvalidRequest | ErrorCode::TooLarge | ErrorCode::TemplateNotFound => {
            let loc = match e.code {
                ErrorCode::TemplateNotFound => vec!["template".into()],
                _ => Vec::new(),
            };
            let bad = BadRun::Field {
                loc,
                kind: "value_error",
                msg: e.detail,
                input: Value::Null,
            };
            unprocessable(&bad)
        }
        code => (
            200,
            json!({
                "status": "SandboxError",
                "message": e.detail,
                "code": code,
                "compile_result": null,
                "run_result": null,
                "executor_pod_name": null,
                "files": {},
            }),
        ),
    }
}

/// `POST /run_code` (SandboxFusion): the HTTP status and the answer.
pub async fn run_code(app: Arc<Runner>, t: &Tenant, body: &[u8]) -> (u16, Value) {
    let spec = match request::parse_object(body)
        .and_then(|m| request::validate(&m, Fields::Lenient, &app.cfg.template))
    {
        Ok(spec) => spec,
        Err(e) => return unprocessable(&e),
    };
    let r = async {
        let _slot = anonymous_slot(&app, t)?;
        if !available(&app, &spec).await? {
            return Ok(missing_toolchain(&spec));
        }
        Ok::<_, ApiError>(answer(&execute(&app, &spec).await?))
    }
    .await;
    match r {
        Ok(v) => (200, v),
        Err(e) => failed(e),
    }
}
