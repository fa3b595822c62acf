//! `dsec-agent`: PID 1 inside every dsec sandbox.
//!
//! The protocol socket is fd 3. Start-up: block SIGCHLD (before any thread exists, so every
//! thread inherits the mask), become a child subreaper, send `Hello`, then serve requests until
//! end of stream, kill everything started, exit 0.
//!
//! Threads: the main thread reads frames; each request runs on its own worker thread (bounded);
//! the reaper thread (started by the first spawn) reaps every child; each background process
//! and session has a pump thread.
//! See `conn.rs` for dispatch, `exec.rs` for running commands, `files.rs`/`tar.rs` for confined
//! file access and `session.rs` for persistent shells.
#![forbid(unsafe_code)]

mod conn;
mod exec;
mod files;
mod guest;
mod out;
mod procs;
mod reaper;
mod session;
mod tar;
mod users;
mod vm;
mod watch;

use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use dsec_sys::proc;

/// The fd the host passes the protocol socket on.
const PROTOCOL_FD: i32 = 3;

fn main() {
    if let Err(e) = run() {
        eprintln!("dsec-agent: {e:#}");
        std::process::exit(1);
    }
    std::process::exit(0);
}

fn run() -> anyhow::Result<()> {
    dsec_sys::ipc::single_malloc_arena();
    // Sandboxed code runs as the same uid: without this it could rewrite PID 1 through
    // /proc/1/mem.
    proc::set_not_dumpable().context("mark the agent not dumpable")?;
    proc::block_sigchld().context("block SIGCHLD")?;
    proc::set_child_subreaper().context("become child subreaper")?;
    if vm::is_guest() {
        return vm::run();
    }
    let sock = proc::take_inherited_fd(PROTOCOL_FD).context("protocol socket on fd 3")?;
    let sock = UnixStream::from(sock);
    let root = std::env::var_os(exec::ROOT_ENV).map_or_else(|| PathBuf::from("/"), PathBuf::from);
    let root_path = root;
    let root = files::Root::open(&root_path).context("open sandbox root")?;
    let reaper = reaper::Reaper::new();
    let reader = sock.try_clone().context("clone protocol socket")?;
    let agent = Arc::new(conn::Agent::new(
        Box::new(sock),
        root,
        root_path,
        reaper,
        None,
    ));
    agent.serve(Box::new(reader), Box::new(|| None));
    Ok(())
}
