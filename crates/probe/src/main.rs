//! `dsec-probe`: a static binary that asserts isolation from inside a sandbox and prints JSON.
//!
//! - `dsec-probe report [OPTIONS]` runs TESTING.md's S-01..S-08, S-10..S-13, C-01, C-03..C-06
//!   observations and prints `{"checks":[{"id","pass","detail"}], "all_pass"}`. It does not
//!   install seccomp itself: the sandbox already did.
//! - `dsec-probe seccomp-selftest CHECK [ARGS]` installs dsec's filter on itself and runs one
//!   check (used by `crates/probe/tests/seccomp.rs`).
//! - `dsec-probe seccomp-table` prints the policy as Markdown.
//!
//! Exit status: 0 when the JSON was printed (whatever the checks found), 2 on bad usage.
#![allow(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

mod calls;
mod devices;
mod report;
mod selftest;
mod sys;

use std::io::Write;

use serde::Serialize;
use serde_json::Value;

/// One observation, named after its TESTING.md id.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// The TESTING.md id (`S-01`, `C-05`, ...).
    pub id: &'static str,
    /// Whether the observation matches what a sandbox must show.
    pub pass: bool,
    /// What was observed (check-specific).
    pub detail: Value,
}

fn usage() -> String {
    format!(
        "usage:\n  dsec-probe {}\n  dsec-probe seccomp-selftest CHECK, CHECK one of:\n    {}\n  dsec-probe seccomp-table\n",
        report::USAGE,
        selftest::CHECKS.join("\n    ")
    )
}

fn print_json(v: &Value) -> i32 {
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{v}").and_then(|()| out.flush()) {
        Ok(()) => 0,
        Err(_) => 1,
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let code = match args.split_first() {
        Some((cmd, rest)) if cmd == "report" => match report::Options::parse(rest) {
            Ok(o) => print_json(&report::run(&o)),
            Err(e) => {
                eprintln!("dsec-probe: {e}\n{}", usage());
                2
            }
        },
        Some((cmd, rest)) if cmd == "seccomp-selftest" => match rest.split_first() {
            Some((check, rest)) => match selftest::run(check, rest) {
                Ok(v) => print_json(&v),
                Err(e) => {
                    eprintln!("dsec-probe: {e}\n{}", usage());
                    2
                }
            },
            None => {
                eprintln!("{}", usage());
                2
            }
        },
        Some((cmd, _)) if cmd == "seccomp-table" => {
            print!("{}", dsec_sys::seccomp::render_table());
            0
        }
        _ => {
            eprintln!("{}", usage());
            2
        }
    };
    std::process::exit(code);
}
