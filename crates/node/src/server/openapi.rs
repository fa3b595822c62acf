//! The OpenAPI 3.1 document served at `/openapi.json`, generated from [`ROUTES`]: the table
//! the router is checked against in tests (every listed operation is routed).

use serde_json::{json, Map, Value};

/// One operation: method, path, summary, request body kind, answer kind.
pub struct Route {
    /// HTTP method, lowercase.
    pub method: &'static str,
    /// Path with `{param}`s.
    pub path: &'static str,
    /// What it does.
    pub summary: &'static str,
    /// `json`, `bytes` or empty.
    pub body: &'static str,
    /// Schema name of the answer (`Sandbox`, `ExecResult`, …), `bytes`, `sse` or empty (204).
    pub answer: &'static str,
}

const fn r(
    method: &'static str,
    path: &'static str,
    summary: &'static str,
    body: &'static str,
    answer: &'static str,
) -> Route {
    Route {
        method,
        path,
        summary,
        body,
        answer,
    }
}

/// Every operation of the API.
pub const ROUTES: &[Route] = &[
    r(
        "post",
        "/v1/tenants",
        "Create a tenant (admin); answers its API key once",
        "json",
        "Tenant",
    ),
    r("get", "/v1/tenants", "List tenants (admin)", "", "List"),
    r(
        "get",
        "/v1/tenant",
        "The caller's tenant and usage",
        "",
        "Tenant",
    ),
    r(
        "post",
        "/v1/sandboxes",
        "Create a sandbox (from the warm pool when it has one)",
        "json",
        "Sandbox",
    ),
    r(
        "get",
        "/v1/sandboxes",
        "List sandboxes (state, label=k=v, limit, cursor)",
        "",
        "List",
    ),
    r(
        "post",
        "/v1/sandboxes/batch",
        "Create N sandboxes from one spec",
        "json",
        "BatchResult",
    ),
    r(
        "post",
        "/v1/sandboxes/batch-delete",
        "Destroy sandboxes by ids or labels",
        "json",
        "BatchResult",
    ),
    r(
        "get",
        "/v1/sandboxes/{id}",
        "Get a sandbox; ?wait=<state>&timeout=<ms> long-polls",
        "",
        "Sandbox",
    ),
    r(
        "delete",
        "/v1/sandboxes/{id}",
        "Destroy a sandbox",
        "",
        "Sandbox",
    ),
    r(
        "post",
        "/v1/sandboxes/{id}/lease",
        "Renew the owner lease",
        "json",
        "Sandbox",
    ),
    r(
        "post",
        "/v1/sandboxes/{id}/reset",
        "Kill every process, fresh writable layer",
        "",
        "Sandbox",
    ),
    r(
        "post",
        "/v1/sandboxes/{id}/exec",
        "Run a command; ?stream=true answers SSE",
        "json",
        "ExecResult",
    ),
    r(
        "post",
        "/v1/sandboxes/{id}/processes",
        "Start a background process",
        "json",
        "Process",
    ),
    r(
        "get",
        "/v1/sandboxes/{id}/processes",
        "The running background processes",
        "",
        "",
    ),
    r(
        "get",
        "/v1/sandboxes/{id}/processes/{handle}",
        "Background process status",
        "",
        "Process",
    ),
    r(
        "get",
        "/v1/sandboxes/{id}/processes/{handle}/output",
        "Follow its output (SSE) until it exits",
        "",
        "",
    ),
    r(
        "post",
        "/v1/sandboxes/{id}/processes/{handle}/stdin",
        "Write to its stdin",
        "json",
        "",
    ),
    r(
        "post",
        "/v1/sandboxes/{id}/processes/{handle}/signal",
        "Signal its process group",
        "json",
        "",
    ),
    r(
        "post",
        "/v1/sandboxes/{id}/processes/{handle}/wait",
        "Wait for it to exit",
        "json",
        "ExecResult",
    ),
    r(
        "post",
        "/v1/sandboxes/{id}/sessions",
        "Open a shell or Python session",
        "json",
        "Session",
    ),
    r(
        "post",
        "/v1/sandboxes/{id}/sessions/{session}/run",
        "Run one input in a session",
        "json",
        "ExecResult",
    ),
    r(
        "delete",
        "/v1/sandboxes/{id}/sessions/{session}",
        "Close a session",
        "",
        "",
    ),
    r(
        "get",
        "/v1/sandboxes/{id}/files",
        "Read a file (?path=)",
        "",
        "bytes",
    ),
    r(
        "put",
        "/v1/sandboxes/{id}/files",
        "Write a file atomically (?path=&mode=&parents=)",
        "bytes",
        "",
    ),
    r(
        "delete",
        "/v1/sandboxes/{id}/files",
        "Remove a path (?path=&recursive=)",
        "",
        "",
    ),
    r(
        "get",
        "/v1/sandboxes/{id}/files/list",
        "List a directory (?path=)",
        "",
        "Listing",
    ),
    r(
        "get",
        "/v1/sandboxes/{id}/files/stat",
        "Stat a path (?path=)",
        "",
        "FileStat",
    ),
    r(
        "post",
        "/v1/sandboxes/{id}/files/mkdir",
        "Create a directory",
        "json",
        "",
    ),
    r(
        "put",
        "/v1/sandboxes/{id}/tar",
        "Unpack a tar stream under ?path=",
        "bytes",
        "",
    ),
    r(
        "get",
        "/v1/sandboxes/{id}/tar",
        "Download ?path= as a tar stream",
        "",
        "bytes",
    ),
    r("get", "/v1/templates", "List templates", "", "List"),
    r(
        "post",
        "/v1/templates",
        "Import a template (admin; ?name=&format=rootfs|oci)",
        "bytes",
        "Template",
    ),
    r(
        "get",
        "/v1/templates/{name}",
        "Get a template",
        "",
        "Template",
    ),
    r(
        "delete",
        "/v1/templates/{name}",
        "Delete a template (admin; refused while in use)",
        "",
        "",
    ),
    r("get", "/v1/pools", "Pool statistics", "", "List"),
    r(
        "get",
        "/v1/pools/{template}",
        "One pool's statistics",
        "",
        "Pool",
    ),
    r(
        "put",
        "/v1/pools/{template}",
        "Size a pool (admin)",
        "json",
        "Pool",
    ),
    r("get", "/v1/events", "Lifecycle events (SSE)", "", "sse"),
    r(
        "get",
        "/v1/trajectories",
        "The tenant's trajectories with their counters",
        "",
        "List",
    ),
    r(
        "get",
        "/v1/trajectories/{tid}",
        "One trajectory's counters (intents, results, acknowledged, unknown)",
        "",
        "Trajectory",
    ),
    r(
        "get",
        "/v1/trajectories/{tid}/records",
        "Its records, paged by step (?from_step=&limit=)",
        "",
        "List",
    ),
    r(
        "get",
        "/v1/trajectories/{tid}/stream",
        "New records as they are logged (SSE)",
        "",
        "sse",
    ),
    r(
        "post",
        "/v1/trajectories/{tid}/annotations",
        "Annotate a step or the trajectory (reward, labels, data)",
        "json",
        "Annotation",
    ),
    r(
        "get",
        "/v1/trajectories/{tid}/export",
        "Training rows (?format=jsonl|parquet&label=&min_reward=)",
        "",
        "bytes",
    ),
    r(
        "post",
        "/v1/trajectories/{tid}/finish",
        "Mark finished: its records may be compacted out of the log",
        "",
        "Trajectory",
    ),
    r(
        "post",
        "/v1/admin/compact",
        "Run log retention and compaction of finished trajectories now (admin)",
        "",
        "Compaction",
    ),
    r(
        "post",
        "/v1/run",
        "Run a snippet (python on the function substrate; other languages compile and run in a container)",
        "json",
        "RunResult",
    ),
    r(
        "post",
        "/v1/run/batch",
        "Run many snippets ({\"requests\": [...], \"concurrency\"}; also /v1/run:batch)",
        "json",
        "BatchResult",
    ),
    r("get", "/v1/languages", "Languages the runner has toolchains for", "", "List"),
    r(
        "post",
        "/run_code",
        "SandboxFusion-compatible run (also /t/{key}/run_code)",
        "json",
        "RunCodeResponse",
    ),
    r("get", "/v1/ping", "SandboxFusion liveness: \"pong\"", "", "Pong"),
    r(
        "post",
        "/t/{key}/run_code",
        "SandboxFusion-compatible run, API key in the path",
        "json",
        "RunCodeResponse",
    ),
    r("get", "/t/{key}/v1/ping", "SandboxFusion liveness, API key in the path", "", "Pong"),
];

fn answer_schema(kind: &str) -> Value {
    match kind {
        "bytes" => {
            json!({"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}})
        }
        "sse" => json!({"content": {"text/event-stream": {"schema": {"type": "string"}}}}),
        name => {
            json!({"content": {"application/json": {"schema": {"$ref": format!("#/components/schemas/{name}")}}}})
        }
    }
}

/// The document.
pub fn document() -> Value {
    let mut paths = Map::new();
    for route in ROUTES {
        let mut op = Map::new();
        op.insert("summary".into(), route.summary.into());
        let params: Vec<Value> = route
            .path
            .split('/')
            .filter_map(|seg| seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')))
            .map(|p| json!({"name": p, "in": "path", "required": true, "schema": {"type": "string"}}))
            .collect();
        let mut params = params;
        if route.method != "get" {
            params.push(
                json!({"name": "Idempotency-Key", "in": "header", "required": false,
                "schema": {"type": "string", "maxLength": 128}}),
            );
        }
        op.insert("parameters".into(), Value::Array(params));
        match route.body {
            "json" => {
                op.insert(
                    "requestBody".into(),
                    json!({"content": {"application/json": {"schema": {"type": "object"}}}}),
                );
            }
            "bytes" => {
                op.insert("requestBody".into(), json!({"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}));
            }
            _ => {}
        }
        let ok = match (route.answer, route.method) {
            ("", _) => ("204", json!({"description": "done"})),
            (a, "post")
                if matches!(a, "Sandbox" | "Tenant" | "Process" | "Session" | "Template")
                    && !route.path.ends_with("/lease")
                    && !route.path.ends_with("/reset") =>
            {
                let mut v = answer_schema(a);
                v["description"] = "created".into();
                ("201", v)
            }
            (a, _) => {
                let mut v = answer_schema(a);
                v["description"] = "ok".into();
                ("200", v)
            }
        };
        let mut responses = Map::new();
        responses.insert(ok.0.into(), ok.1);
        responses.insert(
            "default".into(),
            json!({"description": "error", "content": {"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}}}),
        );
        op.insert("responses".into(), Value::Object(responses));
        op.insert("security".into(), json!([{"bearer": []}, {"apiKey": []}]));
        let item = paths
            .entry(route.path.to_owned())
            .or_insert_with(|| Value::Object(Map::new()));
        item[route.method] = Value::Object(op);
    }
    let obj = |props: &[&str]| {
        let mut m = Map::new();
        for p in props {
            m.insert((*p).to_owned(), json!({}));
        }
        json!({"type": "object", "properties": m})
    };
    json!({
        "openapi": "3.1.0",
        "info": {"title": "dsec node API", "version": env!("CARGO_PKG_VERSION"),
                 "description": "Sandboxes for agentic training. See docs/api.md."},
        "paths": paths,
        "components": {
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "X-API-Key"}
            },
            "schemas": {
                "Problem": {"type": "object", "required": ["type", "title", "status", "code", "detail"],
                    "properties": {"type": {"type": "string"}, "title": {"type": "string"},
                        "status": {"type": "integer"}, "code": {"type": "string"},
                        "detail": {"type": "string"}, "request_id": {"type": "string"}}},
                "Sandbox": obj(&["id", "tenant", "template", "substrate", "state", "labels", "limits",
                    "env_keys", "created_at", "acquired_at", "expires_at", "lease_expires_at", "version", "pooled"]),
                "ExecResult": obj(&["status", "exit_code", "signal", "wall_us", "cpu_us",
                    "peak_rss_kb", "stdout", "stderr"]),
                "Tenant": obj(&["id", "name", "admin", "max_sandboxes", "max_memory_bytes", "api_key"]),
                "List": obj(&["items", "next_cursor"]),
                "BatchResult": obj(&["items"]),
                "Process": obj(&["handle", "pid", "running"]),
                "Session": obj(&["session"]),
                "Listing": obj(&["entries"]),
                "FileStat": obj(&["name", "kind", "size", "mode", "mtime", "link_target"]),
                "Template": obj(&["name", "layers", "env", "workdir", "user", "source"]),
                "Trajectory": obj(&["id", "intents", "results", "annotations", "acknowledged", "unknown", "last_step", "first_lsn", "last_lsn"]),
                "Annotation": obj(&["lsn"]),
                "Compaction": obj(&["segments_rewritten", "segments_deleted", "records_dropped", "bytes_reclaimed"]),
                "RunResult": obj(&["status", "compile_result", "run_result", "files", "substrate", "server_us"]),
                "RunCodeResponse": obj(&["status", "message", "compile_result", "run_result", "executor_pod_name", "files"]),
                "Pong": {"type": "string"},
                "Pool": obj(&["template", "min", "max", "ready", "creating", "hits", "misses", "hit_rate"]),
            }
        }
    })
}
