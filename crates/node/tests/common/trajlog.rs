//! Helpers shared by the trajectory log's unit tests (`src/trajlog/tests.rs`) and its
//! integration tests (`tests/trajlog.rs`), which include this file with `#[path]`; the includer
//! brings `Config`, `Entry` and `TrajLog` into scope.

use std::path::Path;

use super::{Config, Entry, TrajLog};

/// Every record of the log, by lsn.
pub fn read_all(log: &TrajLog) -> Vec<Entry> {
    let mut out = Vec::new();
    for t in log.trajectories() {
        out.extend(log.read(&t.id, 0, usize::MAX).expect("read"));
    }
    out.sort_by_key(|e| e.lsn);
    out
}

/// Opens a log in `dir` with the default config as changed by `set`.
pub fn open_configured(dir: &Path, set: impl FnOnce(&mut Config)) -> TrajLog {
    let mut cfg = Config::new(dir);
    set(&mut cfg);
    let (log, _) = TrajLog::open(cfg).expect("open");
    log
}
