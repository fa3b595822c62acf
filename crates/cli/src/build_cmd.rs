//! `dsec template build`: a template built from a Dockerfile subset on a running daemon.
//!
//! `FROM` names a template of the daemon (imported images included). Each `RUN`, `COPY`/`ADD`
//! and `WORKDIR` runs in one build sandbox and is committed as a layer: a snapshot, to which
//! the sandbox is then restored, so that the next step's snapshot holds that step's changes
//! only. The last snapshot is committed as the template (`POST /v1/templates`), with the
//! `ENV`, `WORKDIR` and `USER` the file set. A step whose cache key — the steps before it,
//! its instruction and the digests of the files it copies — has a snapshot on the daemon is
//! skipped. The cache is a file of this client (`~/.cache/dsec/build-cache.json`).

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};
use std::process::ExitCode;

use serde_json::{json, Value};
use sha2::{Digest as _, Sha256};

use crate::client::{seg, Body, Client, ClientError};

/// Arguments of `dsec template build`.
#[derive(Debug, clap::Args)]
pub struct BuildArgs {
    /// The Dockerfile (default: `<context>/Dockerfile`).
    #[arg(long, short = 'f')]
    pub file: Option<PathBuf>,
    /// Name of the template to make.
    #[arg(long, short = 't')]
    pub tag: String,
    /// `ARG` values (NAME=VALUE), repeatable.
    #[arg(long = "build-arg", value_parser = crate::sandbox_cmd::parse_label)]
    pub build_args: Vec<(String, String)>,
    /// Run every step, whatever the cache holds.
    #[arg(long)]
    pub no_cache: bool,
    /// The build context: where `COPY` and `ADD` read from.
    #[arg(default_value = ".")]
    pub context: PathBuf,
}

/// One instruction of a Dockerfile: its line, keyword and arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// The line it starts on (1-based).
    pub line: usize,
    /// The keyword, upper case.
    pub op: String,
    /// The rest of the instruction, continuation lines joined.
    pub args: String,
}

/// Splits a Dockerfile into instructions: comments and blank lines dropped, `\` continuations
/// joined; an unknown instruction is an error naming its line.
pub fn parse(text: &str) -> Result<Vec<Step>, String> {
    let mut steps = Vec::new();
    let mut pending: Option<(usize, String)> = None;
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if pending.is_none() && (line.is_empty() || line.starts_with('#')) {
            continue;
        }
        let (start, mut acc) = pending.take().unwrap_or((i + 1, String::new()));
        if let Some(cont) = line.strip_suffix('\\') {
            acc.push_str(cont);
            acc.push(' ');
            pending = Some((start, acc));
            continue;
        }
        acc.push_str(line);
        let (op, args) = acc.split_once(char::is_whitespace).unwrap_or((&acc, ""));
        let op = op.to_ascii_uppercase();
        const KNOWN: [&str; 9] = [
            "FROM", "RUN", "COPY", "ADD", "ENV", "WORKDIR", "USER", "ARG", "LABEL",
        ];
        if !KNOWN.contains(&op.as_str()) {
            return Err(format!(
                "Dockerfile:{start}: {op} is not supported (FROM, RUN, COPY, ADD, ENV, WORKDIR, \
                 USER, ARG, LABEL)"
            ));
        }
        steps.push(Step {
            line: start,
            op,
            args: args.trim().to_owned(),
        });
    }
    if let Some((start, _)) = pending {
        return Err(format!(
            "Dockerfile:{start}: a continuation runs past the end"
        ));
    }
    match steps.first() {
        Some(s) if s.op == "FROM" || s.op == "ARG" => Ok(steps),
        Some(s) => Err(format!(
            "Dockerfile:{}: the first instruction must be FROM",
            s.line
        )),
        None => Err("Dockerfile: no instructions".into()),
    }
}

/// `$NAME` and `${NAME}` replaced from `vars` (unknown names: empty).
pub fn expand(s: &str, vars: &BTreeMap<String, String>) -> String {
    let mut out = String::new();
    let mut it = s.chars().peekable();
    while let Some(c) = it.next() {
        if c != '$' {
            out.push(c);
            continue;
        }
        let braced = it.peek() == Some(&'{');
        if braced {
            it.next();
        }
        let mut name = String::new();
        while let Some(&n) = it.peek() {
            if n.is_ascii_alphanumeric() || n == '_' {
                name.push(n);
                it.next();
            } else {
                break;
            }
        }
        if braced && it.peek() == Some(&'}') {
            it.next();
        }
        if name.is_empty() {
            out.push('$');
        } else {
            out.push_str(vars.get(&name).map_or("", String::as_str));
        }
    }
    out
}

/// `k=v k2="v 2"` or `k v` (the old form) as pairs.
pub fn pairs(args: &str) -> Vec<(String, String)> {
    if !args
        .split_whitespace()
        .next()
        .is_some_and(|w| w.contains('='))
    {
        let (k, v) = args.split_once(char::is_whitespace).unwrap_or((args, ""));
        return vec![(k.to_owned(), v.trim().to_owned())];
    }
    let mut out = Vec::new();
    let mut rest = args.trim();
    while let Some((k, after)) = rest.split_once('=') {
        let (v, next) = match after.strip_prefix('"') {
            Some(q) => q.split_once('"').unwrap_or((q, "")),
            None => after.split_once(char::is_whitespace).unwrap_or((after, "")),
        };
        out.push((k.trim().to_owned(), v.to_owned()));
        rest = next.trim();
    }
    out
}

fn fail(what: String) -> ClientError {
    ClientError::Usage { what }
}

/// The build cache: step key → snapshot id.
struct Cache {
    path: Option<PathBuf>,
    map: BTreeMap<String, String>,
}

impl Cache {
    fn open() -> Self {
        let path = std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .map(|d| d.join("dsec").join("build-cache.json"));
        let map = path
            .as_ref()
            .and_then(|p| std::fs::read(p).ok())
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        Self { path, map }
    }

    fn save(&self) {
        if let Some(p) = &self.path {
            if let Some(d) = p.parent() {
                let _ = std::fs::create_dir_all(d);
            }
            let _ = std::fs::write(p, serde_json::to_vec(&self.map).unwrap_or_default());
        }
    }
}

/// What `COPY`/`ADD` copies: a tar of its sources as the destination lays them out, and the
/// directory it is unpacked in.
fn copy_tar(context: &Path, args: &str, workdir: &str) -> Result<(Vec<u8>, String), String> {
    let words: Vec<&str> = args
        .split_whitespace()
        .filter(|w| !w.starts_with("--"))
        .collect();
    let Some((dest, srcs)) = words.split_last().filter(|(_, s)| !s.is_empty()) else {
        return Err("COPY needs a source and a destination".into());
    };
    let dest = if dest.starts_with('/') {
        (*dest).to_owned()
    } else {
        format!("{}/{dest}", workdir.trim_end_matches('/'))
    };
    let into_dir = dest.ends_with('/') || srcs.len() > 1;
    let mut b = tar::Builder::new(Vec::new());
    b.follow_symlinks(false);
    let (dir, rename) = if into_dir {
        (dest.trim_end_matches('/').to_owned(), None)
    } else {
        let p = Path::new(&dest);
        let parent = p.parent().map_or("/".into(), |d| d.display().to_string());
        (
            parent,
            p.file_name().map(|n| n.to_string_lossy().into_owned()),
        )
    };
    for s in srcs {
        let rel = Path::new(s);
        if rel.is_absolute() || rel.components().any(|c| c == Component::ParentDir) {
            return Err(format!("{s}: COPY reads inside the build context only"));
        }
        let src = context.join(rel);
        let meta = std::fs::symlink_metadata(&src).map_err(|e| format!("{s}: {e}"))?;
        if meta.is_dir() {
            if rename.is_some() {
                b.append_dir_all(rename.as_deref().unwrap_or("."), &src)
            } else {
                b.append_dir_all(".", &src)
            }
        } else {
            let name = rename.clone().unwrap_or_else(|| {
                rel.file_name()
                    .map_or(s.to_string(), |n| n.to_string_lossy().into())
            });
            b.append_path_with_name(&src, name)
        }
        .map_err(|e| format!("{s}: {e}"))?;
    }
    let tar = b.into_inner().map_err(|e| e.to_string())?;
    Ok((tar, dir))
}

/// The build's state between steps.
struct Build<'a> {
    c: &'a Client,
    sandbox: String,
    env: BTreeMap<String, String>,
    workdir: String,
    user: Option<String>,
    vars: BTreeMap<String, String>,
    /// The cache key of the steps so far.
    chain: String,
    /// The last step's snapshot, and whether the sandbox stands on it yet.
    last: Option<String>,
    restored: bool,
}

impl Build<'_> {
    fn restore_if_needed(&mut self) -> Result<(), ClientError> {
        if let (Some(s), false) = (&self.last, self.restored) {
            let body = json!({ "snapshot": s });
            let _: Value = self.c.json(
                "POST",
                &format!("/v1/sandboxes/{}/restore", seg(&self.sandbox)),
                &[],
                Body::Json(&body),
            )?;
            self.restored = true;
        }
        Ok(())
    }

    /// Runs `shell` for `step` in `cwd` (the build's working directory when `None`).
    fn run(&mut self, step: &Step, shell: &str, cwd: Option<&str>) -> Result<(), ClientError> {
        let mut env = self.vars.clone();
        env.extend(self.env.clone());
        let body = json!({"shell": shell, "env": env, "cwd": cwd.unwrap_or(&self.workdir),
                          "timeout_ms": 3_600_000u64});
        let r: Value = self.c.json(
            "POST",
            &format!("/v1/sandboxes/{}/exec", seg(&self.sandbox)),
            &[],
            Body::Json(&body),
        )?;
        print!("{}", r["stdout"]["data"].as_str().unwrap_or(""));
        eprint!("{}", r["stderr"]["data"].as_str().unwrap_or(""));
        if r["exit_code"] != 0 {
            return Err(fail(format!(
                "Dockerfile:{}: {} {}: exit code {} ({})",
                step.line, step.op, step.args, r["exit_code"], r["status"]
            )));
        }
        Ok(())
    }

    /// Snapshots the sandbox after a step and stands it on the snapshot.
    fn commit(&mut self) -> Result<String, ClientError> {
        let v: Value = self.c.json(
            "POST",
            &format!("/v1/sandboxes/{}/snapshots", seg(&self.sandbox)),
            &[],
            Body::Json(&json!({"labels": {"dsec-build": "step"}})),
        )?;
        let id = v["id"].as_str().unwrap_or_default().to_owned();
        self.last = Some(id.clone());
        self.restored = false;
        self.restore_if_needed()?;
        Ok(id)
    }
}

fn snapshot_exists(c: &Client, id: &str) -> bool {
    c.json::<Value>(
        "GET",
        &format!("/v1/snapshots/{}", seg(id)),
        &[],
        Body::Empty,
    )
    .is_ok()
}

/// Runs `dsec template build`.
pub fn run(c: &Client, a: &BuildArgs) -> Result<ExitCode, ClientError> {
    let file = a
        .file
        .clone()
        .unwrap_or_else(|| a.context.join("Dockerfile"));
    let text = std::fs::read_to_string(&file).map_err(|e| ClientError::Local {
        what: format!("read {}", file.display()),
        source: e,
    })?;
    let steps = parse(&text).map_err(fail)?;
    let mut vars: BTreeMap<String, String> = BTreeMap::new();
    let given: BTreeMap<String, String> = a.build_args.iter().cloned().collect();
    // ARGs before FROM, then FROM.
    let from_at = steps
        .iter()
        .position(|s| s.op == "FROM")
        .ok_or_else(|| fail("Dockerfile: no FROM".into()))?;
    for s in &steps[..from_at] {
        declare_arg(&s.args, &given, &mut vars);
    }
    let from = expand(&steps[from_at].args, &vars);
    let from = from.split_whitespace().next().unwrap_or("host").to_owned();
    let base: Value = c.json(
        "GET",
        &format!("/v1/templates/{}", seg(&from)),
        &[],
        Body::Empty,
    )?;
    let mut env: BTreeMap<String, String> = base["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| Some((p[0].as_str()?.to_owned(), p[1].as_str()?.to_owned())))
        .collect();
    env.entry("PATH".into())
        .or_insert_with(|| "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into());
    let sb: Value = c.json(
        "POST",
        "/v1/sandboxes",
        &[],
        Body::Json(
            &json!({"template": from, "writable_root": true, "labels": {"dsec-build": a.tag}}),
        ),
    )?;
    let mut b = Build {
        c,
        sandbox: sb["id"].as_str().unwrap_or_default().to_owned(),
        env,
        workdir: base["workdir"].as_str().unwrap_or("/").to_owned(),
        user: base["user"].as_str().map(str::to_owned),
        vars,
        chain: hex::encode(Sha256::digest(
            format!("{}\ntemplate:{from}", c.url()).as_bytes(),
        )),
        last: None,
        restored: true,
    };
    let out = steps_after_from(&mut b, a, &steps[from_at + 1..], steps.len(), from_at);
    let _ = c.send(
        "DELETE",
        &format!("/v1/sandboxes/{}", seg(&b.sandbox)),
        &[],
        Body::Empty,
        &[],
    );
    out?;
    let snapshot = match &b.last {
        Some(s) => s.clone(),
        None => b.commit()?,
    };
    let body = json!({"name": a.tag, "snapshot": snapshot, "env": b.env, "workdir": b.workdir,
                      "user": b.user});
    let t: Value = c.json("POST", "/v1/templates", &[], Body::Json(&body))?;
    println!(
        "Successfully built template {} ({} layers)",
        a.tag,
        t["layers"].as_array().map_or(0, Vec::len)
    );
    Ok(ExitCode::SUCCESS)
}

fn declare_arg(args: &str, given: &BTreeMap<String, String>, vars: &mut BTreeMap<String, String>) {
    let (k, default) = args.split_once('=').unwrap_or((args, ""));
    let k = k.trim().to_owned();
    let v = given
        .get(&k)
        .cloned()
        .unwrap_or_else(|| default.trim_matches('"').to_owned());
    vars.insert(k, v);
}

fn steps_after_from(
    b: &mut Build<'_>,
    a: &BuildArgs,
    steps: &[Step],
    total: usize,
    from_at: usize,
) -> Result<(), ClientError> {
    let mut cache = Cache::open();
    let given: BTreeMap<String, String> = a.build_args.iter().cloned().collect();
    for (i, step) in steps.iter().enumerate() {
        let mut vars = b.vars.clone();
        vars.extend(b.env.clone());
        // A RUN's shell expands its variables (ARGs are in its environment); the others are
        // expanded here.
        let args = if step.op == "RUN" {
            step.args.clone()
        } else {
            expand(&step.args, &vars)
        };
        println!("Step {}/{total} : {} {}", from_at + i + 2, step.op, args);
        let mut key_src = format!(
            "{}\n{} {}\n{:?}\n{:?}\n{}",
            b.chain, step.op, args, b.env, b.vars, b.workdir
        );
        let copy = match step.op.as_str() {
            "COPY" | "ADD" => {
                let (tar, dir) = copy_tar(&a.context, &args, &b.workdir)
                    .map_err(|e| fail(format!("Dockerfile:{}: {} {e}", step.line, step.op)))?;
                key_src.push_str(&hex::encode(Sha256::digest(&tar)));
                Some((tar, dir))
            }
            _ => None,
        };
        b.chain = hex::encode(Sha256::digest(key_src.as_bytes()));
        if step.op == "WORKDIR" {
            b.workdir = if args.starts_with('/') {
                args.clone()
            } else {
                format!("{}/{args}", b.workdir.trim_end_matches('/'))
            };
        }
        match step.op.as_str() {
            "ENV" => b.env.extend(pairs(&args)),
            "ARG" => declare_arg(&args, &given, &mut b.vars),
            "USER" => b.user = Some(args.clone()),
            "LABEL" | "FROM" => {}
            _ => {
                let hit = cache.map.get(&b.chain).filter(|_| !a.no_cache).cloned();
                if let Some(s) = hit.filter(|s| snapshot_exists(b.c, s)) {
                    println!(" ---> Using cache {s}");
                    b.last = Some(s);
                    b.restored = false;
                    continue;
                }
                b.restore_if_needed()?;
                let t = std::time::Instant::now();
                match (step.op.as_str(), copy) {
                    ("WORKDIR", _) => {
                        let dir = b.workdir.clone();
                        b.run(step, &format!("mkdir -p '{dir}'"), Some("/"))?;
                    }
                    ("RUN", _) => b.run(step, &args, None)?,
                    (_, Some((tar, dir))) => {
                        b.run(step, &format!("mkdir -p '{dir}'"), Some("/"))?;
                        let path = format!("/v1/sandboxes/{}/tar", seg(&b.sandbox));
                        b.c.send(
                            "PUT",
                            &path,
                            &[("path", &dir)],
                            Body::Bytes(&tar, "application/x-tar"),
                            &[],
                        )?;
                    }
                    _ => {}
                }
                let s = b.commit()?;
                println!(" ---> {s} ({:.1} s)", t.elapsed().as_secs_f64());
                cache.map.insert(b.chain.clone(), s);
                cache.save();
            }
        }
    }
    b.restore_if_needed()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_continuations_comments_and_refuses_the_unknown() {
        let s = parse("# c\nFROM host\n\nRUN echo a \\\n  && echo b\nenv A=1 B=\"x y\"\n")
            .expect("parses");
        assert_eq!(s.len(), 3);
        assert_eq!((s[1].line, s[1].op.as_str()), (4, "RUN"));
        assert_eq!(s[1].args, "echo a  && echo b");
        assert_eq!(
            pairs(&s[2].args),
            [("A".into(), "1".into()), ("B".into(), "x y".into())]
        );
        let e = parse("FROM host\nHEALTHCHECK x\n").expect_err("refused");
        assert!(e.starts_with("Dockerfile:2: HEALTHCHECK"), "{e}");
        assert!(parse("RUN x\n").is_err());
    }

    #[test]
    fn expands_args() {
        let vars = BTreeMap::from([("V".to_owned(), "1.2".to_owned())]);
        assert_eq!(expand("a-$V-${V}-$NONE-$", &vars), "a-1.2-1.2--$");
        assert_eq!(pairs("PATH /usr/bin"), [("PATH".into(), "/usr/bin".into())]);
    }
}
