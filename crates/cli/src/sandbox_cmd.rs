//! `dsec sandbox …`: sandboxes on a running `dsec server`, driven over its HTTP API.

use std::io::{IsTerminal, Read};
use std::path::PathBuf;
use std::process::ExitCode;

use base64::Engine;
use clap::{Args, Subcommand};
use dsec_api::agent::{FileKind, FileStat};
use dsec_api::exec::{ExecResult, ExecStatus};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::client::{self, seg, Body, Client, ClientError, SseReader};
use crate::output::{self, age, print_json, print_table, text, write_out};
use crate::units;

/// Sandbox commands.
#[derive(Debug, Subcommand)]
pub enum SandboxCmd {
    /// Create sandboxes and print their ids, one per line.
    Create(CreateArgs),
    /// List sandboxes (every state but `stopped` unless --state is given).
    List(ListArgs),
    /// Show one sandbox.
    Get {
        /// Sandbox id.
        id: String,
        /// Print the sandbox as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Run a command in a sandbox, print its output and exit with its exit code.
    Exec(ExecArgs),
    /// Read, write, list and remove files of a sandbox; upload and download directories as tar.
    Files {
        /// Sandbox id.
        id: String,
        #[command(subcommand)]
        command: FilesCmd,
    },
    /// Destroy sandboxes: by id, by label, or every sandbox of your tenant (--all).
    #[command(visible_alias = "rm")]
    Kill(KillArgs),
    /// Reset a sandbox: kill every process and give it a fresh writable layer.
    Reset {
        /// Sandbox id.
        id: String,
        /// Print the sandbox as JSON.
        #[arg(long)]
        json: bool,
    },
}

/// Arguments of `dsec sandbox create`.
#[derive(Debug, Args)]
pub struct CreateArgs {
    /// Template to create the sandbox from (the daemon's default: `host`).
    #[arg(long)]
    template: Option<String>,
    /// Substrate: container (default), microvm or vm.
    #[arg(long)]
    substrate: Option<String>,
    /// Memory limit (bytes, or 256M, 1G).
    #[arg(long, value_parser = units::parse_bytes)]
    memory: Option<u64>,
    /// CPU cap in CPUs (e.g. 0.5, 2); also sets the CPU weight.
    #[arg(long)]
    cpus: Option<f64>,
    /// Most processes.
    #[arg(long)]
    pids: Option<u64>,
    /// Writable-layer size, the disk quota (bytes, or 512M, 1G); also the largest file.
    #[arg(long, value_parser = units::parse_bytes)]
    disk: Option<u64>,
    /// Environment variable of every command in the sandbox (KEY=VALUE), repeatable.
    #[arg(long = "env", short = 'e', value_parser = units::parse_env)]
    env: Vec<(String, String)>,
    /// Label (k=v), repeatable.
    #[arg(long = "label", short = 'l', value_parser = parse_label)]
    labels: Vec<(String, String)>,
    /// Make it from this snapshot (`sn-…`: its template, substrate and files).
    #[arg(long, conflicts_with_all = ["template", "substrate"])]
    snapshot: Option<String>,
    /// Destroy the sandbox after this long (seconds, or 10m, 2h).
    #[arg(long, value_parser = units::parse_duration_ms)]
    ttl: Option<u64>,
    /// Make the whole root writable (writes land in the private layer).
    #[arg(long)]
    writable_root: bool,
    /// The user namespace (on by default): root inside is an unprivileged host id range of the
    /// sandbox's own, and RLIMIT_NPROC refuses forks beyond pids_max less 4 before they are
    /// copied. `--userns false` runs the sandbox's root as host root with every capability
    /// dropped (admin tenant only).
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    userns: Option<bool>,
    /// How many sandboxes to create (more than one uses the batch endpoint).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000))]
    count: u32,
    /// Idempotency key: a retry with the same key returns what the first attempt made.
    #[arg(long)]
    idempotency_key: Option<String>,
    /// Print the sandbox (or, with --count, the batch items) as JSON.
    #[arg(long)]
    json: bool,
}

/// Arguments of `dsec sandbox list`.
#[derive(Debug, Args)]
pub struct ListArgs {
    /// Only sandboxes in this state (creating, ready, running, resetting, stopping, stopped,
    /// failed).
    #[arg(long)]
    state: Option<String>,
    /// Only sandboxes with this label (k=v), repeatable.
    #[arg(long = "label", short = 'l', value_parser = parse_label)]
    labels: Vec<(String, String)>,
    /// Print the items as a JSON array.
    #[arg(long)]
    json: bool,
}

/// Arguments of `dsec sandbox exec`.
#[derive(Debug, Args)]
pub struct ExecArgs {
    /// Sandbox id.
    id: String,
    /// Wall-clock timeout (seconds, or 500ms, 2m); the daemon's default without it.
    #[arg(long, value_parser = units::parse_duration_ms)]
    timeout: Option<u64>,
    /// Working directory inside the sandbox.
    #[arg(long)]
    cwd: Option<String>,
    /// Environment variable for the command (KEY=VALUE), repeatable.
    #[arg(long = "env", short = 'e', value_parser = units::parse_env)]
    env: Vec<(String, String)>,
    /// Print output as it arrives (server-sent events) instead of when the command ends.
    #[arg(long, conflicts_with = "json")]
    stream: bool,
    /// Run this script with `/bin/sh -c` instead of an argv.
    #[arg(long, conflicts_with = "command")]
    shell: Option<String>,
    /// Feed this file to the command's stdin (`-` for dsec's own stdin).
    #[arg(long, value_name = "FILE|-")]
    stdin: Option<PathBuf>,
    /// Print the full exec result as JSON instead of the command's output.
    #[arg(long)]
    json: bool,
    /// Log the command as a step of this trajectory (replayed from the log when it was
    /// already recorded; see `dsec trajectory`).
    #[arg(long, conflicts_with = "stream")]
    trajectory: Option<String>,
    /// The step number within the trajectory (default: the next one).
    #[arg(long, requires = "trajectory")]
    step: Option<u64>,
    /// The command and its arguments (after `--`).
    #[arg(last = true, required_unless_present = "shell")]
    command: Vec<String>,
}

/// File commands.
#[derive(Debug, Subcommand)]
pub enum FilesCmd {
    /// Write a file's bytes to stdout.
    Read {
        /// Path inside the sandbox.
        path: String,
    },
    /// Write a file from a local file or stdin.
    Write {
        /// Path inside the sandbox.
        path: String,
        /// Local file to send (`-`: stdin).
        #[arg(long, value_name = "FILE|-", default_value = "-")]
        from: PathBuf,
        /// Permission bits in octal (e.g. 755).
        #[arg(long, value_parser = parse_mode)]
        mode: Option<u32>,
        /// Create missing parent directories.
        #[arg(long, short = 'p')]
        parents: bool,
    },
    /// List a directory.
    Ls {
        /// Directory inside the sandbox.
        path: String,
        /// Print the entries as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Remove a file or (with -r) a directory tree.
    Rm {
        /// Path inside the sandbox.
        path: String,
        /// Remove directories and their contents.
        #[arg(long, short = 'r')]
        recursive: bool,
    },
    /// Create a directory.
    Mkdir {
        /// Path inside the sandbox.
        path: String,
        /// Create missing parents.
        #[arg(long, short = 'p')]
        parents: bool,
    },
    /// Unpack a local tar archive into a directory of the sandbox.
    Upload {
        /// Directory inside the sandbox.
        dir: String,
        /// The tar archive (`-`: stdin).
        #[arg(long, value_name = "FILE|-")]
        tar: PathBuf,
    },
    /// Write a directory of the sandbox as a tar archive to a file (-o) or to stdout when it is
    /// not a terminal.
    Download {
        /// Directory inside the sandbox.
        dir: String,
        /// Write the tar archive to this file instead of stdout.
        #[arg(long, short = 'o', value_name = "FILE")]
        output: Option<PathBuf>,
    },
}

/// Arguments of `dsec sandbox kill` (`rm`).
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("which").required(true).args(["ids", "labels", "all"])))]
pub struct KillArgs {
    /// Sandbox ids.
    ids: Vec<String>,
    /// Destroy every sandbox with this label (k=v), repeatable; all must match.
    #[arg(long = "label", short = 'l', value_parser = parse_label, conflicts_with = "ids")]
    labels: Vec<(String, String)>,
    /// Destroy every sandbox of your key's tenant (`dsec server --shutdown-sandboxes` stops
    /// every sandbox of the node when the daemon stops).
    #[arg(long, conflicts_with_all = ["ids", "labels"])]
    all: bool,
}

/// Parses a `k=v` label.
pub fn parse_label(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(format!("invalid label {s:?} (expected k=v)")),
    }
}

/// Parses octal permission bits.
fn parse_mode(s: &str) -> Result<u32, String> {
    u32::from_str_radix(s.trim_start_matches("0o"), 8)
        .ok()
        .filter(|m| *m <= 0o7777)
        .ok_or_else(|| format!("invalid mode {s:?} (octal, e.g. 644)"))
}

/// Runs one sandbox command.
pub fn run(c: &Client, cmd: &SandboxCmd) -> Result<ExitCode, ClientError> {
    match cmd {
        SandboxCmd::Create(a) => create(c, a),
        SandboxCmd::List(a) => list(c, a),
        SandboxCmd::Get { id, json } => {
            let v: Value = c.json("GET", &sb_path(id, ""), &[], Body::Empty)?;
            show(&v, *json)
        }
        SandboxCmd::Exec(a) => exec(c, a),
        SandboxCmd::Files { id, command } => files(c, id, command),
        SandboxCmd::Kill(a) => kill(c, a),
        SandboxCmd::Reset { id, json } => {
            let v: Value = c.json("POST", &sb_path(id, "/reset"), &[], Body::Empty)?;
            show(&v, *json)
        }
    }
}

fn sb_path(id: &str, rest: &str) -> String {
    format!("/v1/sandboxes/{}{rest}", seg(id))
}

fn str_of<'a>(v: &'a Value, k: &str) -> &'a str {
    v[k].as_str().unwrap_or("-")
}

fn create(c: &Client, a: &CreateArgs) -> Result<ExitCode, ClientError> {
    let mut limits = Map::new();
    if let Some(m) = a.memory {
        limits.insert("memory_max".into(), m.into());
    }
    if let Some(cpus) = a.cpus {
        limits.insert("cpu_max".into(), cpus.into());
        let weight = ((cpus * 100.0) as u64).clamp(1, 10000);
        limits.insert("cpu_weight".into(), weight.into());
    }
    if let Some(p) = a.pids {
        limits.insert("pids_max".into(), p.into());
    }
    if let Some(d) = a.disk {
        limits.insert("disk_bytes".into(), d.into());
        limits.insert("file_size_max".into(), d.into());
    }
    let mut spec = Map::new();
    if let Some(t) = &a.template {
        spec.insert("template".into(), t.clone().into());
    }
    if let Some(s) = &a.substrate {
        spec.insert("substrate".into(), s.clone().into());
    }
    if !limits.is_empty() {
        spec.insert("limits".into(), limits.into());
    }
    if !a.env.is_empty() {
        spec.insert("env".into(), pairs(&a.env));
    }
    if !a.labels.is_empty() {
        spec.insert("labels".into(), pairs(&a.labels));
    }
    if let Some(ttl) = a.ttl {
        spec.insert("ttl_ms".into(), ttl.into());
    }
    if let Some(s) = &a.snapshot {
        spec.insert("snapshot".into(), s.clone().into());
    }
    if a.writable_root {
        spec.insert("writable_root".into(), true.into());
    }
    if let Some(userns) = a.userns {
        spec.insert("userns".into(), userns.into());
    }
    let headers: Vec<(&str, &str)> = a
        .idempotency_key
        .as_deref()
        .map(|k| ("idempotency-key", k))
        .into_iter()
        .collect();
    if a.count == 1 {
        let sb: Value = c.json_with(
            "POST",
            "/v1/sandboxes",
            &[],
            Body::Json(&Value::Object(spec)),
            &headers,
        )?;
        if a.json {
            print_json(&sb)?;
        } else {
            write_out(format!("{}\n", str_of(&sb, "id")).as_bytes(), false)?;
        }
        return Ok(ExitCode::SUCCESS);
    }
    let body = json!({"count": a.count, "spec": spec});
    let v: Value = c.json_with(
        "POST",
        "/v1/sandboxes/batch",
        &[],
        Body::Json(&body),
        &headers,
    )?;
    let items = v["items"].as_array().cloned().unwrap_or_default();
    if a.json {
        print_json(&Value::Array(items.clone()))?;
    }
    let mut first_failure = None;
    for (i, it) in items.iter().enumerate() {
        if it["ok"] == true {
            if !a.json {
                write_out(
                    format!("{}\n", str_of(&it["sandbox"], "id")).as_bytes(),
                    false,
                )?;
            }
        } else {
            let e = item_error(&it["error"]);
            client::report(&e, &format!("sandbox {} of {}: ", i + 1, a.count));
            first_failure.get_or_insert(e.exit_code());
        }
    }
    Ok(first_failure.map_or(ExitCode::SUCCESS, ExitCode::from))
}

fn pairs(kv: &[(String, String)]) -> Value {
    Value::Object(
        kv.iter()
            .map(|(k, v)| (k.clone(), Value::String(v.clone())))
            .collect(),
    )
}

/// The error of one item of a batch answer.
fn item_error(p: &Value) -> ClientError {
    ClientError::Api {
        status: p["status"].as_u64().unwrap_or(0) as u16,
        code: crate::client::Code::parse(p["code"].as_str().unwrap_or("internal")),
        detail: p["detail"].as_str().unwrap_or_default().to_owned(),
        request_id: p["request_id"].as_str().unwrap_or("-").to_owned(),
    }
}

#[derive(Deserialize)]
struct Page {
    items: Vec<Value>,
    next_cursor: Option<String>,
}

/// Every sandbox the key's tenant has in `state` (every state but `stopped` when `None`) with
/// all of `labels`, through every page.
fn list_all(
    c: &Client,
    state: Option<&str>,
    labels: &[(String, String)],
) -> Result<Vec<Value>, ClientError> {
    let labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let mut items = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut q: Vec<(&str, &str)> = vec![("limit", "1000")];
        if let Some(s) = state {
            q.push(("state", s));
        }
        for l in &labels {
            q.push(("label", l));
        }
        if let Some(cur) = &cursor {
            q.push(("cursor", cur));
        }
        let page: Page = c.json("GET", "/v1/sandboxes", &q, Body::Empty)?;
        items.extend(page.items);
        match page.next_cursor {
            Some(next) if Some(&next) != cursor.as_ref() => cursor = Some(next),
            _ => break,
        }
    }
    Ok(items)
}

fn list(c: &Client, a: &ListArgs) -> Result<ExitCode, ClientError> {
    let items = list_all(c, a.state.as_deref(), &a.labels)?;
    if a.json {
        print_json(&Value::Array(items))?;
        return Ok(ExitCode::SUCCESS);
    }
    let rows: Vec<Vec<String>> = items
        .iter()
        .map(|s| {
            vec![
                str_of(s, "id").to_owned(),
                str_of(s, "state").to_owned(),
                str_of(s, "template").to_owned(),
                str_of(s, "substrate").to_owned(),
                // Since the tenant got it: a pooled sandbox was built before.
                age(s["acquired_at"]
                    .as_str()
                    .unwrap_or_else(|| str_of(s, "created_at"))),
                match &s["labels"] {
                    Value::Object(m) if m.is_empty() => "-".to_owned(),
                    l => text(l),
                },
            ]
        })
        .collect();
    print_table(
        &["ID", "STATE", "TEMPLATE", "SUBSTRATE", "AGE", "LABELS"],
        &rows,
    )?;
    Ok(ExitCode::SUCCESS)
}

/// Prints a sandbox as JSON or as `key: value` lines.
fn show(v: &Value, json: bool) -> Result<ExitCode, ClientError> {
    if json {
        print_json(v)?;
        return Ok(ExitCode::SUCCESS);
    }
    let mut out = String::new();
    let order = [
        "id",
        "state",
        "template",
        "substrate",
        "tenant",
        "labels",
        "created_at",
        "acquired_at",
        "expires_at",
        "lease_expires_at",
        "env_keys",
        "writable_root",
        "userns",
        "pooled",
        "version",
        "error",
    ];
    let Value::Object(m) = v else {
        return Err(ClientError::Unexpected {
            method: "GET".into(),
            path: "/v1/sandboxes".into(),
            status: 200,
            what: "a sandbox is not an object".into(),
        });
    };
    let mut lines: Vec<(String, String)> = Vec::new();
    for k in order {
        if let Some(x) = m.get(k) {
            lines.push((k.to_owned(), text(x)));
            if k == "acquired_at" && !x.is_null() {
                lines.push(("age".into(), age(&text(x))));
            }
        }
    }
    if let Some(Value::Object(l)) = m.get("limits") {
        for (k, x) in l {
            let shown = match (k.as_str(), x.as_u64()) {
                (
                    "memory_max" | "memory_high" | "disk_bytes" | "file_size_max" | "shm_bytes",
                    Some(n),
                ) => output::size(n),
                _ => text(x),
            };
            lines.push((format!("limits.{k}"), shown));
        }
    }
    for (k, x) in m {
        if !order.contains(&k.as_str()) && k != "limits" {
            lines.push((k.clone(), text(x)));
        }
    }
    let width = lines.iter().map(|(k, _)| k.len() + 1).max().unwrap_or(0);
    for (k, v) in lines {
        let v = if v.is_empty() { "-".to_owned() } else { v };
        out.push_str(&format!("{:<width$} {v}\n", format!("{k}:")));
    }
    write_out(out.as_bytes(), false)?;
    Ok(ExitCode::SUCCESS)
}

fn read_local(path: &PathBuf) -> Result<Vec<u8>, ClientError> {
    let mut buf = Vec::new();
    let r = if path.as_os_str() == "-" {
        std::io::stdin().lock().read_to_end(&mut buf)
    } else {
        std::fs::File::open(path).and_then(|mut f| f.read_to_end(&mut buf))
    };
    r.map_err(|source| ClientError::Local {
        what: format!("read {}", path.display()),
        source,
    })?;
    Ok(buf)
}

fn exec(c: &Client, a: &ExecArgs) -> Result<ExitCode, ClientError> {
    let mut body = Map::new();
    match &a.shell {
        Some(s) => body.insert("shell".into(), s.clone().into()),
        None => body.insert("argv".into(), json!(a.command)),
    };
    if !a.env.is_empty() {
        body.insert("env".into(), pairs(&a.env));
    }
    if let Some(d) = &a.cwd {
        body.insert("cwd".into(), d.clone().into());
    }
    if let Some(t) = a.timeout {
        body.insert("timeout_ms".into(), t.into());
    }
    if let Some(t) = &a.trajectory {
        body.insert("trajectory".into(), t.clone().into());
    }
    if let Some(s) = a.step {
        body.insert("step".into(), s.into());
    }
    if let Some(p) = &a.stdin {
        let data = read_local(p)?;
        body.insert(
            "stdin_b64".into(),
            base64::engine::general_purpose::STANDARD
                .encode(data)
                .into(),
        );
    }
    let body = Value::Object(body);
    let path = sb_path(&a.id, "/exec");
    let result: ExecResult = if a.stream {
        exec_stream(c, &path, &body)?
    } else {
        let v: Value = c.json("POST", &path, &[], Body::Json(&body))?;
        if a.json {
            print_json(&v)?;
        }
        let r: ExecResult = serde_json::from_value(v).map_err(|e| ClientError::Unexpected {
            method: "POST".into(),
            path: path.clone(),
            status: 200,
            what: format!("not an exec result: {e}"),
        })?;
        if !a.json {
            write_out(&r.stdout.data, false)?;
            write_out(&r.stderr.data, true)?;
            for (name, cap) in [("stdout", &r.stdout), ("stderr", &r.stderr)] {
                if cap.truncated {
                    eprintln!(
                        "dsec: {name} was truncated: the command wrote {} bytes, {} kept (head \
                         and tail)",
                        cap.total,
                        cap.data.len()
                    );
                }
            }
        }
        r
    };
    Ok(ExitCode::from(exit_of(&result, a.timeout)))
}

/// The exit code of an exec, as `dsec run` maps it; says why on stderr when dsec stopped it.
fn exit_of(r: &ExecResult, timeout_ms: Option<u64>) -> u8 {
    let code = match r.status {
        ExecStatus::Ok => 0,
        ExecStatus::NonzeroExit => r.exit_code.unwrap_or(1),
        ExecStatus::Timeout => {
            match timeout_ms {
                Some(t) => eprintln!("dsec: command timed out after {t} ms"),
                None => eprintln!("dsec: command timed out"),
            }
            124
        }
        ExecStatus::Oom => {
            eprintln!("dsec: command was killed: out of memory");
            137
        }
        ExecStatus::OutputLimit => {
            eprintln!("dsec: command was killed: output limit exceeded");
            125
        }
        ExecStatus::Killed => 128 + r.signal.unwrap_or(9),
    };
    code.clamp(0, 255) as u8
}

#[derive(Deserialize)]
struct Chunk {
    data_b64: String,
}

fn exec_stream(c: &Client, path: &str, body: &Value) -> Result<ExecResult, ClientError> {
    let resp = c.send(
        "POST",
        path,
        &[("stream", "true")],
        Body::Json(body),
        &[("accept", "text/event-stream")],
    )?;
    let unexpected = |what: String| ClientError::Unexpected {
        method: "POST".into(),
        path: path.to_owned(),
        status: 200,
        what,
    };
    let mut events = SseReader::new(resp.into_body().into_reader());
    loop {
        let ev = events
            .next_event()
            .map_err(|e| c.transport("POST", path, ureq::Error::Io(e)))?
            .ok_or_else(|| unexpected("the stream ended before the exit event".into()))?;
        match ev.event.as_str() {
            "stdout" | "stderr" => {
                let chunk: Chunk = serde_json::from_str(&ev.data)
                    .map_err(|e| unexpected(format!("bad {} event: {e}", ev.event)))?;
                let bytes = base64::engine::general_purpose::STANDARD
                    .decode(chunk.data_b64)
                    .map_err(|e| unexpected(format!("bad {} event: {e}", ev.event)))?;
                write_out(&bytes, ev.event == "stderr")?;
            }
            "exit" => {
                return serde_json::from_str(&ev.data)
                    .map_err(|e| unexpected(format!("bad exit event: {e}")));
            }
            "error" => {
                let p: Value = serde_json::from_str(&ev.data)
                    .map_err(|e| unexpected(format!("bad error event: {e}")))?;
                return Err(item_error(&p));
            }
            _ => {}
        }
    }
}

fn files(c: &Client, id: &str, cmd: &FilesCmd) -> Result<ExitCode, ClientError> {
    let files = sb_path(id, "/files");
    match cmd {
        FilesCmd::Read { path } => {
            let resp = c.send("GET", &files, &[("path", path)], Body::Empty, &[])?;
            copy_to(c, &files, resp, &mut std::io::stdout().lock(), None)?;
        }
        FilesCmd::Write {
            path,
            from,
            mode,
            parents,
        } => {
            let data = read_local(from)?;
            let mode = mode.map(|m| m.to_string());
            let mut q = vec![("path", path.as_str())];
            if let Some(m) = &mode {
                q.push(("mode", m));
            }
            if *parents {
                q.push(("parents", "true"));
            }
            c.send(
                "PUT",
                &files,
                &q,
                Body::Bytes(&data, "application/octet-stream"),
                &[],
            )?;
        }
        FilesCmd::Ls { path, json } => {
            let v: Value = c.json(
                "GET",
                &format!("{files}/list"),
                &[("path", path)],
                Body::Empty,
            )?;
            if *json {
                print_json(&v["entries"])?;
            } else {
                let entries: Vec<FileStat> =
                    serde_json::from_value(v["entries"].clone()).map_err(|e| {
                        ClientError::Unexpected {
                            method: "GET".into(),
                            path: format!("{files}/list"),
                            status: 200,
                            what: format!("not a listing: {e}"),
                        }
                    })?;
                let rows: Vec<Vec<String>> = entries
                    .iter()
                    .map(|e| {
                        let kind = match e.kind {
                            FileKind::File => "file",
                            FileKind::Dir => "dir",
                            FileKind::Symlink => "symlink",
                            FileKind::Other => "other",
                        };
                        let name = match &e.link_target {
                            Some(t) => format!("{} -> {t}", e.name),
                            None => e.name.clone(),
                        };
                        vec![
                            kind.to_owned(),
                            format!("{:04o}", e.mode & 0o7777),
                            e.size.to_string(),
                            name,
                        ]
                    })
                    .collect();
                print_table(&["KIND", "MODE", "SIZE", "NAME"], &rows)?;
            }
        }
        FilesCmd::Rm { path, recursive } => {
            let r = if *recursive { "true" } else { "false" };
            c.send(
                "DELETE",
                &files,
                &[("path", path), ("recursive", r)],
                Body::Empty,
                &[],
            )?;
        }
        FilesCmd::Mkdir { path, parents } => {
            let body = json!({"path": path, "parents": parents});
            c.send(
                "POST",
                &format!("{files}/mkdir"),
                &[],
                Body::Json(&body),
                &[],
            )?;
        }
        FilesCmd::Upload { dir, tar } => {
            let data = read_local(tar)?;
            c.send(
                "PUT",
                &sb_path(id, "/tar"),
                &[("path", dir)],
                Body::Bytes(&data, "application/x-tar"),
                &[],
            )?;
        }
        FilesCmd::Download { dir, output } => {
            if output.is_none() && std::io::stdout().is_terminal() {
                return Err(ClientError::Usage {
                    what: "refusing to write a tar archive to a terminal: write it to a file \
                           with `-o FILE`, or redirect stdout (`> dir.tar`, `| tar -x`)"
                        .into(),
                });
            }
            let tar = sb_path(id, "/tar");
            let resp = c.send("GET", &tar, &[("path", dir)], Body::Empty, &[])?;
            // The file is made only once the daemon answered with the archive.
            let mut sink: Box<dyn std::io::Write> =
                match output {
                    Some(file) => Box::new(std::fs::File::create(file).map_err(|source| {
                        ClientError::Local {
                            what: format!("create {}", file.display()),
                            source,
                        }
                    })?),
                    None => Box::new(std::io::stdout().lock()),
                };
            copy_to(c, &tar, resp, &mut sink, output.as_deref())?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Copies an answer's body to `out` (a file named `file`, or stdout when `None`).
fn copy_to(
    c: &Client,
    path: &str,
    resp: ureq::http::Response<ureq::Body>,
    out: &mut dyn std::io::Write,
    file: Option<&std::path::Path>,
) -> Result<(), ClientError> {
    let local = |source| ClientError::Local {
        what: match file {
            Some(f) => format!("write {}", f.display()),
            None => "write to stdout".into(),
        },
        source,
    };
    let mut reader = resp.into_body().into_reader();
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = reader
            .read(&mut buf)
            .map_err(|e| c.transport("GET", path, ureq::Error::Io(e)))?;
        if n == 0 {
            return out.flush().map_err(local);
        }
        out.write_all(&buf[..n]).map_err(local)?;
    }
}

fn kill(c: &Client, a: &KillArgs) -> Result<ExitCode, ClientError> {
    let mut first_failure = None;
    if a.all {
        let ids: Vec<Value> = list_all(c, None, &[])?
            .iter()
            .map(|s| s["id"].clone())
            .collect();
        // The batch endpoint takes at most 10000 ids.
        for chunk in ids.chunks(1000) {
            batch_delete(c, &json!({ "ids": chunk }), &mut first_failure)?;
        }
    } else if !a.labels.is_empty() {
        let body = json!({"labels": pairs(&a.labels)});
        batch_delete(c, &body, &mut first_failure)?;
    } else {
        for id in &a.ids {
            match c.json::<Value>("DELETE", &sb_path(id, ""), &[], Body::Empty) {
                Ok(_) => write_out(format!("{id}\n").as_bytes(), false)?,
                Err(e @ (ClientError::Unreachable { .. } | ClientError::Transport { .. })) => {
                    return Err(e)
                }
                Err(e) => {
                    client::report(&e, &format!("{id}: "));
                    first_failure.get_or_insert(e.exit_code());
                }
            }
        }
    }
    Ok(first_failure.map_or(ExitCode::SUCCESS, ExitCode::from))
}

/// One `batch-delete` call: prints the ids destroyed, reports the others and keeps the exit
/// code of the first failure.
fn batch_delete(
    c: &Client,
    body: &Value,
    first_failure: &mut Option<u8>,
) -> Result<(), ClientError> {
    let v: Value = c.json("POST", "/v1/sandboxes/batch-delete", &[], Body::Json(body))?;
    for it in v["items"].as_array().into_iter().flatten() {
        let id = str_of(it, "id");
        if it["ok"] == true {
            write_out(format!("{id}\n").as_bytes(), false)?;
        } else {
            let e = item_error(&it["error"]);
            client::report(&e, &format!("{id}: "));
            first_failure.get_or_insert(e.exit_code());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_and_modes() {
        assert_eq!(parse_label("a=b=c"), Ok(("a".into(), "b=c".into())));
        assert!(parse_label("=x").is_err());
        assert_eq!(parse_mode("755"), Ok(0o755));
        assert_eq!(parse_mode("0o644"), Ok(0o644));
        assert!(parse_mode("9").is_err());
    }
}
