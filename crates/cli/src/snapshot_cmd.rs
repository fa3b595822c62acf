//! `dsec snapshot`: snapshots, forks and restores of a running daemon's sandboxes.

use std::process::ExitCode;

use clap::Subcommand;
use serde_json::{json, Map, Value};

use crate::client::{seg, Body, Client, ClientError};
use crate::output::print_json;
use crate::sandbox_cmd::parse_label;

/// `dsec snapshot …`.
#[derive(Debug, Subcommand)]
pub enum SnapshotCmd {
    /// Snapshot a sandbox's files and print the snapshot's id.
    Create {
        /// Sandbox id.
        sandbox: String,
        /// Label (k=v), repeatable.
        #[arg(long = "label", short = 'l', value_parser = parse_label)]
        labels: Vec<(String, String)>,
        /// Print the snapshot as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Snapshot a sandbox and make sandboxes from it; print their ids, one per line.
    Fork {
        /// Sandbox id.
        sandbox: String,
        /// How many sandboxes (1–64).
        #[arg(long, short = 'n', default_value_t = 1)]
        count: usize,
        /// Label (k=v) of the snapshot and the sandboxes, repeatable.
        #[arg(long = "label", short = 'l', value_parser = parse_label)]
        labels: Vec<(String, String)>,
        /// Print the answer as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Roll a sandbox back to a snapshot (every process killed, its files the snapshot's).
    Restore {
        /// Sandbox id.
        sandbox: String,
        /// Snapshot id.
        snapshot: String,
    },
    /// List snapshots: of a sandbox, in the tree under a snapshot, by label.
    List {
        /// Taken of this sandbox.
        #[arg(long)]
        sandbox: Option<String>,
        /// In the tree under this snapshot.
        #[arg(long)]
        root: Option<String>,
        /// Label (k=v), repeatable: carrying every one.
        #[arg(long = "label", short = 'l', value_parser = parse_label)]
        labels: Vec<(String, String)>,
        /// Print the list as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Print the tree under a snapshot.
    Tree {
        /// Snapshot id.
        id: String,
        /// Print the tree as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Delete a snapshot (with the tree under it: --recursive).
    Rm {
        /// Snapshot id.
        id: String,
        /// Also the snapshots under it (sandboxes on them keep running).
        #[arg(long, short = 'r')]
        recursive: bool,
    },
}

fn labels(kv: &[(String, String)]) -> Value {
    Value::Object(
        kv.iter()
            .map(|(k, v)| (k.clone(), Value::String(v.clone())))
            .collect::<Map<_, _>>(),
    )
}

fn sb(id: &str, rest: &str) -> String {
    format!("/v1/sandboxes/{}{rest}", seg(id))
}

/// One line of a snapshot: id, parent, sandbox, size, depth, labels.
fn line(s: &Value) -> String {
    let text = |k: &str| s[k].as_str().unwrap_or("-").to_owned();
    format!(
        "{}\t{}\t{}\t{}\t{}\t{}",
        text("id"),
        text("parent"),
        text("sandbox"),
        s["size_bytes"].as_u64().unwrap_or(0),
        s["depth"].as_u64().unwrap_or(0),
        s["labels"]
    )
}

fn tree_lines(node: &Value, depth: usize, out: &mut String) {
    out.push_str(&format!(
        "{}{} ({} bytes, sandbox {})\n",
        "  ".repeat(depth),
        node["id"].as_str().unwrap_or("-"),
        node["size_bytes"].as_u64().unwrap_or(0),
        node["sandbox"].as_str().unwrap_or("-"),
    ));
    for c in node["children"].as_array().into_iter().flatten() {
        tree_lines(c, depth + 1, out);
    }
}

/// Runs a `dsec snapshot` command.
pub fn run(c: &Client, cmd: &SnapshotCmd) -> Result<ExitCode, ClientError> {
    match cmd {
        SnapshotCmd::Create {
            sandbox,
            labels: l,
            json,
        } => {
            let body = json!({ "labels": labels(l) });
            let v: Value = c.json("POST", &sb(sandbox, "/snapshots"), &[], Body::Json(&body))?;
            if *json {
                print_json(&v)?;
            } else {
                println!("{}", v["id"].as_str().unwrap_or("-"));
            }
        }
        SnapshotCmd::Fork {
            sandbox,
            count,
            labels: l,
            json,
        } => {
            let body = json!({ "count": count, "labels": labels(l) });
            let v: Value = c.json("POST", &sb(sandbox, "/fork"), &[], Body::Json(&body))?;
            if *json {
                print_json(&v)?;
            } else {
                for s in v["sandboxes"].as_array().into_iter().flatten() {
                    println!("{}", s["id"].as_str().unwrap_or("-"));
                }
                for e in v["errors"].as_array().into_iter().flatten() {
                    eprintln!(
                        "dsec: a fork failed: {}",
                        e["detail"].as_str().unwrap_or("-")
                    );
                }
            }
        }
        SnapshotCmd::Restore { sandbox, snapshot } => {
            let body = json!({ "snapshot": snapshot });
            let _: Value = c.json("POST", &sb(sandbox, "/restore"), &[], Body::Json(&body))?;
        }
        SnapshotCmd::List {
            sandbox,
            root,
            labels: l,
            json,
        } => {
            let label = l
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(",");
            let mut q: Vec<(&str, &str)> = Vec::new();
            if let Some(s) = sandbox {
                q.push(("sandbox", s));
            }
            if let Some(r) = root {
                q.push(("root", r));
            }
            if !label.is_empty() {
                q.push(("label", &label));
            }
            let v: Value = c.json("GET", "/v1/snapshots", &q, Body::Empty)?;
            if *json {
                print_json(&v)?;
            } else {
                println!("ID\tPARENT\tSANDBOX\tBYTES\tDEPTH\tLABELS");
                for s in v["items"].as_array().into_iter().flatten() {
                    println!("{}", line(s));
                }
            }
        }
        SnapshotCmd::Tree { id, json } => {
            let v: Value = c.json(
                "GET",
                &format!("/v1/snapshots/{}/tree", seg(id)),
                &[],
                Body::Empty,
            )?;
            if *json {
                print_json(&v)?;
            } else {
                let mut out = String::new();
                tree_lines(&v, 0, &mut out);
                print!("{out}");
            }
        }
        SnapshotCmd::Rm { id, recursive } => {
            let q: Vec<(&str, &str)> = if *recursive {
                vec![("recursive", "true")]
            } else {
                Vec::new()
            };
            let v: Value = c.json(
                "DELETE",
                &format!("/v1/snapshots/{}", seg(id)),
                &q,
                Body::Empty,
            )?;
            for d in v["deleted"].as_array().into_iter().flatten() {
                println!("{}", d.as_str().unwrap_or("-"));
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
