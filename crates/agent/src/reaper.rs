//! The reaper: one thread, started by the first spawn, that reaps every child (`wait4(-1,
//! WNOHANG)` driven by SIGCHLD) and hands `(status, rusage)` to whoever registered that pid. Unregistered pids (orphaned
//! grandchildren re-parented to us) are just reaped.
//!
//! Spawning goes through [`Reaper::spawn`], which holds the read side of a gate across the
//! clone, exec and registration while the reaper holds the write side around `wait4`. So an
//! exit is never reaped before its pid is registered, and [`Spawn::spawn`]'s own `waitpid` on a
//! failed exec never races with the reaper.

use std::collections::{HashMap, HashSet};
use std::io::{PipeReader, PipeWriter, Write};
use std::os::fd::AsFd;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock, Weak};
use std::time::{Duration, Instant};

use dsec_sys::proc::{self, Rusage, WaitStatus};
use dsec_sys::spawn::{self, Spawn};

/// Most process groups remembered for `KillAll` before pruning dead ones.
const MAX_PGIDS: usize = 4096;

/// How a registered process ended.
#[derive(Debug, Clone, Copy)]
pub struct Exit {
    /// Exit code or signal.
    pub status: WaitStatus,
    /// Rusage of the process and its waited-for descendants.
    pub rusage: Rusage,
    /// When it was reaped.
    pub at: Instant,
}

/// Where the reaper delivers one pid's exit. Also a wake-up channel for the process's pump: the
/// reaper (and stdin writers) write a byte to `wake` so a `poll` on the read end returns.
#[derive(Debug)]
pub struct ExitSlot {
    exit: Mutex<Option<Exit>>,
    cv: Condvar,
    wake: Mutex<PipeWriter>,
}

impl ExitSlot {
    /// The exit, if the process was reaped.
    pub fn get(&self) -> Option<Exit> {
        *lock(&self.exit)
    }

    /// Waits up to `timeout` for the exit.
    pub fn wait(&self, timeout: Duration) -> Option<Exit> {
        let deadline = Instant::now() + timeout;
        let mut g = lock(&self.exit);
        loop {
            if let Some(e) = *g {
                return Some(e);
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            g = self
                .cv
                .wait_timeout(g, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Wakes whoever polls the read end of the wake pipe.
    pub fn wake(&self) {
        // A full pipe already guarantees a wake-up; errors are irrelevant.
        let _ = lock(&self.wake).write(&[1]);
    }

    fn set(&self, exit: Exit) {
        *lock(&self.exit) = Some(exit);
        self.cv.notify_all();
        self.wake();
    }
}

/// Locks a mutex, ignoring poisoning (state stays consistent: every critical section here is a
/// plain insert/remove).
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The registry shared by the reaper thread and spawners.
#[derive(Debug, Default)]
pub struct Reaper {
    gate: RwLock<()>,
    registry: Mutex<HashMap<i32, Arc<ExitSlot>>>,
    pgids: Mutex<HashSet<i32>>,
    /// Whether the reaper thread runs. It is started by the first spawn (and again by the next
    /// one if starting it failed): an agent that has never spawned has nothing to reap, and
    /// thousands of idle sandboxes each save a thread (kernel stack, task, stack pages).
    started: Mutex<bool>,
    me: Weak<Reaper>,
}

/// A spawned, registered child.
pub struct Spawned {
    /// Pid and pipes (never waited on here: the reaper owns reaping).
    pub child: spawn::Spawned,
    /// Exit delivery.
    pub slot: Arc<ExitSlot>,
    /// Read end of the wake pipe (non-blocking).
    pub wake: PipeReader,
    /// Taken just before `fork`.
    pub started: Instant,
}

impl Reaper {
    /// The registry; its thread starts with the first [`Reaper::spawn`]. SIGCHLD must already
    /// be blocked in every thread (a child that exits before the thread runs stays a zombie,
    /// its SIGCHLD pending, until the thread's first pass).
    pub fn new() -> Arc<Reaper> {
        Arc::new_cyclic(|me| Reaper {
            me: me.clone(),
            ..Reaper::default()
        })
    }

    /// Starts the reaper thread unless it runs.
    fn ensure_thread(&self) -> std::io::Result<()> {
        let mut started = lock(&self.started);
        if !*started {
            let r = self
                .me
                .upgrade()
                .ok_or_else(|| std::io::Error::other("reaper dropped"))?;
            std::thread::Builder::new()
                .name("reaper".into())
                .spawn(move || r.run())
                .map_err(|e| std::io::Error::other(format!("start reaper thread: {e}")))?;
            *started = true;
        }
        Ok(())
    }

    fn run(&self) {
        loop {
            // The timeout is a safety net against a lost wake-up; SIGCHLD normally drives this.
            if let Err(e) = proc::wait_sigchld(Duration::from_millis(500)) {
                eprintln!("dsec-agent: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
            self.reap_all();
        }
    }

    fn reap_all(&self) {
        let _gate = self.gate.write().unwrap_or_else(|p| p.into_inner());
        loop {
            match proc::reap_any() {
                Ok(Some((pid, status, rusage))) => {
                    let slot = lock(&self.registry).remove(&pid);
                    if let Some(slot) = slot {
                        slot.set(Exit {
                            status,
                            rusage,
                            at: Instant::now(),
                        });
                    }
                }
                Ok(None) => return,
                Err(e) => {
                    eprintln!("dsec-agent: {e}");
                    return;
                }
            }
        }
    }

    /// Spawns `cmd` (in a process group of its own) and registers its pid and process group.
    pub fn spawn(&self, cmd: &Spawn) -> std::io::Result<Spawned> {
        let (rd, wr) = std::io::pipe()?;
        proc::set_nonblocking(rd.as_fd()).map_err(std::io::Error::other)?;
        proc::set_nonblocking(wr.as_fd()).map_err(std::io::Error::other)?;
        let slot = Arc::new(ExitSlot {
            exit: Mutex::new(None),
            cv: Condvar::new(),
            wake: Mutex::new(wr),
        });
        // The first spawn starts the reaper thread before its child: started after it, the
        // thread could not be made once the child had filled the sandbox's `pids.max` (a fork
        // bomb as the first command), and that command would fail to spawn instead of ending
        // by its deadline.
        self.ensure_thread()?;
        let gate = self.gate.read().unwrap_or_else(|p| p.into_inner());
        let started = Instant::now();
        let child = cmd.spawn()?;
        let pid = child.pid;
        lock(&self.registry).insert(pid, Arc::clone(&slot));
        drop(gate);
        self.remember_pgid(pid);
        Ok(Spawned {
            child,
            slot,
            wake: rd,
            started,
        })
    }

    fn remember_pgid(&self, pgid: i32) {
        let mut pg = lock(&self.pgids);
        if pg.len() >= MAX_PGIDS {
            pg.retain(|&g| proc::killpg(g, 0).unwrap_or(false));
        }
        pg.insert(pgid);
    }

    /// Every process group this agent started that may still exist.
    pub fn pgids(&self) -> Vec<i32> {
        lock(&self.pgids).iter().copied().collect()
    }

    /// Forgets process groups that no longer exist.
    pub fn prune_pgids(&self) {
        lock(&self.pgids).retain(|&g| proc::killpg(g, 0).unwrap_or(false));
    }
}
