//! `dsec trajectory …`: the trajectory log of a running `dsec server`.

use std::process::ExitCode;

use clap::Subcommand;
use serde_json::Value;

use crate::client::{seg, Body, Client, ClientError};
use crate::output::{print_items, print_json, text, write_out};

/// Trajectory commands.
#[derive(Debug, Subcommand)]
pub enum TrajectoryCmd {
    /// List the trajectories with their counters (intents, results, unknown outcomes).
    List {
        /// Print them as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show a trajectory's counters and its records (action, then observation, per step).
    Show {
        /// Trajectory id.
        id: String,
        /// First step to show.
        #[arg(long, default_value_t = 0)]
        from_step: u64,
        /// Most records to show.
        #[arg(long, default_value_t = 100)]
        limit: usize,
        /// Print the records as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Export training rows (JSONL) to stdout.
    Export {
        /// Trajectory id.
        id: String,
        /// Only steps carrying this annotation label (on the step or the trajectory).
        #[arg(long)]
        label: Option<String>,
        /// Only steps with an annotated reward at least this.
        #[arg(long)]
        min_reward: Option<f64>,
    },
    /// Annotate a trajectory (or one step of it) with a reward, labels and data.
    Annotate {
        /// Trajectory id.
        id: String,
        /// The step (omit for the whole trajectory).
        #[arg(long)]
        step: Option<u64>,
        /// Reward.
        #[arg(long)]
        reward: Option<f64>,
        /// Labels (repeatable).
        #[arg(long = "label")]
        labels: Vec<String>,
    },
}

/// `trajectory ID: 1 step, 2 intents, 2 results, 0 unknown, 1 annotation` (a count the daemon
/// did not send shows as `-`).
fn summary_line(id: &str, summary: &Value) -> String {
    let count = |key: &str, one: &str, many: &str| match summary[key].as_u64() {
        Some(1) => format!("1 {one}"),
        Some(n) => format!("{n} {many}"),
        None => format!("{} {many}", text(&summary[key])),
    };
    format!(
        "trajectory {id}: {}, {}, {}, {}, {}\n",
        count("last_step", "step", "steps"),
        count("intents", "intent", "intents"),
        count("results", "result", "results"),
        count("unknown", "unknown", "unknown"),
        count("annotations", "annotation", "annotations"),
    )
}

/// Runs one trajectory command.
pub fn run(c: &Client, cmd: &TrajectoryCmd) -> Result<ExitCode, ClientError> {
    match cmd {
        TrajectoryCmd::List { json } => {
            let v: Value = c.json("GET", "/v1/trajectories", &[], Body::Empty)?;
            let keys = [
                "id",
                "last_step",
                "intents",
                "results",
                "unknown",
                "annotations",
            ];
            print_items(
                &v,
                *json,
                &[
                    "ID",
                    "STEPS",
                    "INTENTS",
                    "RESULTS",
                    "UNKNOWN",
                    "ANNOTATIONS",
                ],
                |t| keys.iter().map(|k| text(&t[*k])).collect(),
            )?;
        }
        TrajectoryCmd::Show {
            id,
            from_step,
            limit,
            json,
        } => {
            let path = format!("/v1/trajectories/{}", seg(id));
            let summary: Value = c.json("GET", &path, &[], Body::Empty)?;
            let from = from_step.to_string();
            let lim = limit.to_string();
            let recs: Value = c.json(
                "GET",
                &format!("{path}/records"),
                &[("from_step", &from), ("limit", &lim)],
                Body::Empty,
            )?;
            if *json {
                print_json(&serde_json::json!({"summary": summary, "records": recs["items"]}))?;
            } else {
                let mut out = summary_line(id, &summary);
                for r in recs["items"].as_array().into_iter().flatten() {
                    let rec = &r["record"];
                    let what = match r["kind"].as_str() {
                        Some("intent") => format!("{} {}", text(&rec["op"]), rec["action"]),
                        Some("result") => {
                            format!("http {} {}", text(&rec["http_status"]), rec["summary"])
                        }
                        _ => rec.to_string(),
                    };
                    out.push_str(&format!(
                        "{:>6} step {:>4} {:<10} {}\n",
                        text(&r["lsn"]),
                        text(&r["step"]),
                        text(&r["kind"]),
                        what
                    ));
                }
                write_out(out.as_bytes(), false)?;
            }
        }
        TrajectoryCmd::Export {
            id,
            label,
            min_reward,
        } => {
            let reward = min_reward.map(|r| r.to_string());
            let mut q: Vec<(&str, &str)> = vec![("format", "jsonl")];
            if let Some(l) = label {
                q.push(("label", l));
            }
            if let Some(r) = &reward {
                q.push(("min_reward", r));
            }
            let path = format!("/v1/trajectories/{}/export", seg(id));
            let mut resp = c.send("GET", &path, &q, Body::Empty, &[])?;
            let bytes = resp
                .body_mut()
                .with_config()
                .limit(1 << 30)
                .read_to_vec()
                .map_err(|e| c.transport("GET", &path, e))?;
            write_out(&bytes, false)?;
        }
        TrajectoryCmd::Annotate {
            id,
            step,
            reward,
            labels,
        } => {
            let body = serde_json::json!({"step": step, "reward": reward, "labels": labels});
            let path = format!("/v1/trajectories/{}/annotations", seg(id));
            let v: Value = c.json("POST", &path, &[], Body::Json(&body))?;
            write_out(
                format!("annotated (lsn {})\n", text(&v["lsn"])).as_bytes(),
                false,
            )?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_counts_are_singular_for_one() {
        let one = serde_json::json!({"last_step": 1, "intents": 1, "results": 1, "unknown": 1,
            "annotations": 1});
        assert_eq!(
            summary_line("t", &one),
            "trajectory t: 1 step, 1 intent, 1 result, 1 unknown, 1 annotation\n"
        );
        let more = serde_json::json!({"last_step": 2, "intents": 0, "results": 3, "unknown": 0});
        assert_eq!(
            summary_line("t", &more),
            "trajectory t: 2 steps, 0 intents, 3 results, 0 unknown, - annotations\n"
        );
    }
}
