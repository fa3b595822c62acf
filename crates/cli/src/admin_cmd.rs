//! `dsec pool …` and `dsec tenant …`: warm pools and tenants of a running `dsec server`.

use std::process::ExitCode;

use clap::Subcommand;
use serde_json::{json, Map, Value};

use crate::client::{seg, Body, Client, ClientError};
use crate::output::{print_items, print_json, print_table, size, text, write_out};
use crate::units;

/// Pool commands.
#[derive(Debug, Subcommand)]
pub enum PoolCmd {
    /// List warm pools and their hit counters.
    List {
        /// Print the pools as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Size the warm pool of a template (admin key).
    Set {
        /// Template name.
        template: String,
        /// Ready sandboxes to keep at least.
        #[arg(long)]
        min: u64,
        /// Ready sandboxes to keep at most.
        #[arg(long)]
        max: u64,
        /// Print the pool as JSON.
        #[arg(long)]
        json: bool,
    },
}

/// Tenant commands (admin key).
#[derive(Debug, Subcommand)]
pub enum TenantCmd {
    /// Create a tenant and print its API key (shown only this once).
    Create {
        /// Tenant name ([A-Za-z0-9_-], at most 64).
        name: String,
        /// Most live sandboxes at once.
        #[arg(long)]
        max_sandboxes: Option<u64>,
        /// Most memory over its live sandboxes (bytes, or 8G).
        #[arg(long, value_parser = units::parse_bytes)]
        max_memory: Option<u64>,
        /// Print the tenant (with its key) as JSON.
        #[arg(long)]
        json: bool,
    },
    /// List tenants (without keys).
    List {
        /// Print the tenants as JSON.
        #[arg(long)]
        json: bool,
    },
}

fn cell(v: &Value, k: &str) -> String {
    text(&v[k])
}

fn pool_rows(items: &[Value]) -> Vec<Vec<String>> {
    items
        .iter()
        .map(|p| {
            ["template", "min", "max", "ready", "hits", "misses"]
                .iter()
                .map(|k| cell(p, k))
                .collect()
        })
        .collect()
}

/// Runs one pool command.
pub fn pool(c: &Client, cmd: &PoolCmd) -> Result<ExitCode, ClientError> {
    let (items, json) = match cmd {
        PoolCmd::List { json } => {
            let v: Value = c.json("GET", "/v1/pools", &[], Body::Empty)?;
            (v["items"].as_array().cloned().unwrap_or_default(), *json)
        }
        PoolCmd::Set {
            template,
            min,
            max,
            json,
        } => {
            let body = json!({"min": min, "max": max});
            let path = format!("/v1/pools/{}", seg(template));
            let v: Value = c.json("PUT", &path, &[], Body::Json(&body))?;
            if *json {
                print_json(&v)?;
                return Ok(ExitCode::SUCCESS);
            }
            (vec![v], false)
        }
    };
    if json {
        print_json(&Value::Array(items))?;
    } else {
        print_table(
            &["TEMPLATE", "MIN", "MAX", "READY", "HITS", "MISSES"],
            &pool_rows(&items),
        )?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Runs one tenant command.
pub fn tenant(c: &Client, cmd: &TenantCmd) -> Result<ExitCode, ClientError> {
    match cmd {
        TenantCmd::Create {
            name,
            max_sandboxes,
            max_memory,
            json,
        } => {
            let mut body = Map::new();
            body.insert("name".into(), name.clone().into());
            if let Some(n) = max_sandboxes {
                body.insert("max_sandboxes".into(), (*n).into());
            }
            if let Some(m) = max_memory {
                body.insert("max_memory_bytes".into(), (*m).into());
            }
            let v: Value = c.json("POST", "/v1/tenants", &[], Body::Json(&Value::Object(body)))?;
            if *json {
                print_json(&v)?;
            } else {
                eprintln!(
                    "dsec: created tenant {} ({}); its API key follows and is not shown again",
                    cell(&v, "name"),
                    cell(&v, "id")
                );
                write_out(format!("{}\n", cell(&v, "api_key")).as_bytes(), false)?;
            }
        }
        TenantCmd::List { json } => {
            let v: Value = c.json("GET", "/v1/tenants", &[], Body::Empty)?;
            print_items(
                &v,
                *json,
                &["ID", "NAME", "ADMIN", "MAX_SANDBOXES", "MAX_MEMORY"],
                |t| {
                    vec![
                        cell(t, "id"),
                        cell(t, "name"),
                        cell(t, "admin"),
                        cell(t, "max_sandboxes"),
                        t["max_memory_bytes"].as_u64().map_or("-".into(), size),
                    ]
                },
            )?;
        }
    }
    Ok(ExitCode::SUCCESS)
}
