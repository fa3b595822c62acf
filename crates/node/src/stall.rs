//! A diagnostic hook for slow execs. With `DSEC_STALL_DUMP=<file>` in the node's environment,
//! an exec whose answer has not come after `DSEC_STALL_DUMP_MS` (default 1000) milliseconds
//! has the state of every task of its sandbox's cgroup and of the node's own threads appended
//! to `<file>`, again every such interval while it waits (at most five times): each task's
//! state, scheduling policy and nice value, its time on a CPU and waiting for one
//! (`schedstat`), its wait channel and its kernel stack. Off (no timer, no cost) without the
//! variable.

use std::fmt::Write as _;
use std::sync::OnceLock;
use std::time::Duration;

/// Where and after how long to dump, from the environment (read once).
fn config() -> Option<&'static (String, Duration)> {
    static CONFIG: OnceLock<Option<(String, Duration)>> = OnceLock::new();
    CONFIG
        .get_or_init(|| {
            let file = std::env::var("DSEC_STALL_DUMP").ok()?;
            let ms = std::env::var("DSEC_STALL_DUMP_MS")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(1000);
            Some((file, Duration::from_millis(ms)))
        })
        .as_ref()
}

/// A watch on one exec; dropping it ends the watch.
pub struct StallWatch(Option<tokio::task::JoinHandle<()>>);

impl StallWatch {
    /// Watches an exec in sandbox `what`; `pids` lists its cgroup's processes when called.
    pub fn start(what: &str, pids: impl Fn() -> Vec<i32> + Send + 'static) -> Self {
        let Some((file, after)) = config() else {
            return Self(None);
        };
        let what = what.to_owned();
        Self(Some(tokio::spawn(async move {
            let t0 = std::time::Instant::now();
            for _ in 0..5 {
                tokio::time::sleep(*after).await;
                let waited = t0.elapsed();
                let pids = pids();
                let dump = tokio::task::spawn_blocking(move || dump(&pids)).await;
                let mut text = format!(
                    "=== exec in {what} unanswered after {} ms (unix {:?})\n",
                    waited.as_millis(),
                    std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .unwrap_or_default()
                );
                text.push_str(&dump.unwrap_or_default());
                let _ = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(file)
                    .and_then(|mut f| std::io::Write::write_all(&mut f, text.as_bytes()));
            }
        })))
    }
}

impl Drop for StallWatch {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            h.abort();
        }
    }
}

/// The state of every task of `pids` and of this process.
fn dump(pids: &[i32]) -> String {
    let mut out = String::new();
    let me = std::process::id() as i32;
    for (label, pid) in pids.iter().map(|p| ("sandbox", *p)).chain([("node", me)]) {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        for t in tasks.flatten() {
            let dir = t.path();
            let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_default();
            let stat = read("stat");
            // After the command name in parentheses: state is field 3, nice 19, policy 41.
            let tail: Vec<&str> = stat
                .rsplit_once(") ")
                .map(|(_, t)| t.split(' ').collect())
                .unwrap_or_default();
            let field = |n: usize| tail.get(n - 3).copied().unwrap_or("?");
            let _ = writeln!(
                out,
                "{label} pid {pid} tid {} comm {} state {} nice {} policy {} cpu {} \
                 schedstat(run_ns wait_ns slices) {} wchan {}",
                t.file_name().to_string_lossy(),
                read("comm").trim(),
                field(3),
                field(19),
                field(41),
                field(39),
                read("schedstat").trim(),
                read("wchan").trim(),
            );
            for line in read("stack").lines() {
                let _ = writeln!(out, "    {line}");
            }
        }
    }
    blocked_elsewhere(&mut out);
    out
}

/// Every other task on the host in uninterruptible sleep, grouped by kernel stack (most
/// common first), and how many tasks are runnable: who holds or queues for a lock the stuck
/// exec waits for.
fn blocked_elsewhere(out: &mut String) {
    let mut stacks: std::collections::HashMap<String, (usize, String)> = Default::default();
    let mut runnable = 0usize;
    for p in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(tasks) = std::fs::read_dir(p.path().join("task")) else {
            continue;
        };
        for t in tasks.flatten() {
            let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
            let state = stat.rsplit_once(") ").map_or("?", |(_, t)| &t[..1]);
            if state == "R" {
                runnable += 1;
            }
            if state != "D" {
                continue;
            }
            let stack = std::fs::read_to_string(t.path().join("stack")).unwrap_or_default();
            let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
            let e = stacks.entry(stack).or_default();
            e.0 += 1;
            if e.1.len() < 200 {
                e.1.push_str(comm.trim());
                e.1.push(' ');
            }
        }
    }
    let mut v: Vec<_> = stacks.into_iter().collect();
    v.sort_by_key(|e| std::cmp::Reverse(e.1 .0));
    let _ = writeln!(out, "host: {runnable} runnable tasks; tasks in D by stack:");
    for (stack, (n, comms)) in v.into_iter().take(8) {
        let _ = writeln!(out, "  {n} tasks ({comms})");
        for line in stack.lines().take(12) {
            let _ = writeln!(out, "    {line}");
        }
    }
}
