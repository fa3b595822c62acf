//! `Watch`/`Unwatch`: changes under a directory of the sandbox (inotify), sent as batched
//! `FsEvents` until the watch ends.
//!
//! One inotify instance and one thread serve every watch of the agent; the thread starts with
//! the first watch and exits once none is left, so a watch holds no worker thread of the
//! connection. The directory is opened through the sandbox root and watched by descriptor
//! (`/proc/self/fd/<n>`, see [`Inotify::add_watch`]); subdirectories are opened beneath it with
//! no symlink followed on the way, so a path swapped for a symlink never moves a watch
//! elsewhere. No descriptor is held between events (one would keep a removed directory's inode
//! alive and delay the `IN_DELETE_SELF` that ends the watch): a directory made later is opened
//! beneath the watched one reopened through the root and checked to be the same inode.
//!
//! A directory moved within the tree keeps its watches under the new name (the kernel queues
//! `IN_MOVED_FROM` and `IN_MOVED_TO` next to each other); one moved out is no longer watched.
//!
//! The registry is one mutex, and every event of a watch (`Watching`, `FsEvents`, its end) is
//! sent while it is held, so nothing follows a watch's terminal event.
//!
//! Bounds: [`MAX_WATCHES`] watches per agent and [`MAX_DIRS`] watched directories per watch
//! (beyond either: `resource_exhausted`; a recursive watch whose tree grows past it ends with
//! that error). A watch sends at most one `FsEvents` per [`BATCH`], of at most [`MAX_BATCH`]
//! events; what does not fit, and what the kernel dropped on a queue overflow, is counted and
//! logged (rate-limited), not sent.

// Errors carry the path and cause; they are rare and built once.
#![allow(clippy::result_large_err)]

use std::collections::HashMap;
use std::ffi::OsStr;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use dsec_api::agent::{Event, FsEvent, FsOp};
use dsec_api::error::chain;
use dsec_api::ErrorCode;
use dsec_sys::fs::{self as sfs, Confine, FsError, Inotify, InotifyEvent};
use dsec_sys::proc::{self, Interest};

use crate::files::{errno_code, FileError, Root, MAX_DEPTH};
use crate::out::Out;

/// Most watches in place at once, per agent.
pub const MAX_WATCHES: usize = 64;
/// Most directories one (recursive) watch covers.
pub const MAX_DIRS: usize = 4096;
/// Most events in one `FsEvents`.
pub const MAX_BATCH: usize = 1000;
/// How long events are gathered before they are sent (and the least time between two
/// `FsEvents` of one watch).
pub const BATCH: Duration = Duration::from_millis(20);
/// Most entries of one directory a recursive watch looks through for subdirectories.
const MAX_ENTRIES: usize = 100_000;
/// How often the thread checks whether any watch is left while nothing happens.
const IDLE_POLL: Duration = Duration::from_secs(1);
/// Least time between two log lines about dropped events of one watch.
const DROP_LOG_EVERY: Duration = Duration::from_secs(10);
/// Bytes read from the inotify fd at once.
const READ_BUF: usize = 64 << 10;

/// The events a watch asks for. (`IN_ONLYDIR` is added by [`Inotify::add_watch`]; a final
/// symlink is never followed because the directory was opened by descriptor beforehand.)
const MASK: u32 = libc::IN_CREATE
    | libc::IN_MODIFY
    | libc::IN_CLOSE_WRITE
    | libc::IN_DELETE
    | libc::IN_MOVED_FROM
    | libc::IN_MOVED_TO
    | libc::IN_ATTRIB
    | libc::IN_DELETE_SELF
    | libc::IN_MOVE_SELF
    | libc::IN_ONLYDIR;

/// Errors of `Watch` and `Unwatch`.
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    /// Opening the directory failed.
    #[error("open {path:?} to watch")]
    Open {
        /// The path.
        path: String,
        /// Cause.
        #[source]
        source: FileError,
    },
    /// Adding an inotify watch failed.
    #[error("watch {path:?}")]
    AddWatch {
        /// The directory, relative to the watched one.
        path: String,
        /// Cause.
        #[source]
        source: FsError,
    },
    /// The agent has [`MAX_WATCHES`] watches already.
    #[error("more than {MAX_WATCHES} watches")]
    TooManyWatches,
    /// The tree has more than [`MAX_DIRS`] directories (or one with more than [`MAX_ENTRIES`]
    /// entries).
    #[error("{path:?} has more than {limit} {what} to watch")]
    TooLarge {
        /// The directory, relative to the watched one.
        path: String,
        /// What.
        what: &'static str,
        /// The bound.
        limit: usize,
    },
    /// A request id that is watching already.
    #[error("request {0} is watching already")]
    Duplicate(u64),
    /// No watch of that request id.
    #[error("no watch of request {0}")]
    Unknown(u64),
    /// The watched directory was removed or moved away.
    #[error("the watched directory {path:?} is gone")]
    Gone {
        /// The path.
        path: String,
    },
    /// No thread for the events.
    #[error("start the watch thread")]
    Thread(#[source] std::io::Error),
}

impl WatchError {
    /// The wire code.
    pub fn code(&self) -> ErrorCode {
        match self {
            WatchError::Open { source, .. } => source.code(),
            WatchError::AddWatch { source, .. } => match source.raw_os_error() {
                // The kernel's limits (max_user_watches, max_user_instances, memory).
                Some(libc::ENOSPC | libc::EMFILE | libc::ENFILE | libc::ENOMEM) => {
                    ErrorCode::ResourceExhausted
                }
                e => errno_code(e),
            },
            WatchError::TooManyWatches | WatchError::TooLarge { .. } | WatchError::Thread(_) => {
                ErrorCode::ResourceExhausted
            }
            WatchError::Duplicate(_) => ErrorCode::InvalidRequest,
            WatchError::Unknown(_) => ErrorCode::HandleNotFound,
            WatchError::Gone { .. } => ErrorCode::NotFound,
        }
    }
}

/// Events gathered for one `FsEvents`.
#[derive(Default)]
struct Batch {
    events: Vec<FsEvent>,
    /// The last op of each name in `events` (to drop repeated writes).
    last: HashMap<String, FsOp>,
    /// When the first of `events` came.
    since: Option<Instant>,
    /// Events dropped since the last log line.
    dropped: u64,
    /// When dropped events were last logged.
    logged: Option<Instant>,
}

/// One `Watch` in place.
struct Watch {
    out: Arc<Out>,
    /// The path requested.
    path: String,
    /// The root it was resolved in.
    root: Arc<Root>,
    /// Device and inode of the watched directory.
    inode: (u64, u64),
    recursive: bool,
    /// Cookie of a directory move within the tree whose `IN_MOVED_TO` is next.
    moved: Option<u32>,
    /// Watch descriptor → directory relative to the watched one ("" for itself).
    dirs: HashMap<i32, PathBuf>,
    batch: Batch,
}

/// Every watch of the agent.
#[derive(Default)]
struct Registry {
    /// Created with the first watch; kept for the agent's life.
    inotify: Option<Arc<Inotify>>,
    /// The event thread runs.
    thread: bool,
    /// By the id of the `Watch` request.
    watches: HashMap<u64, Watch>,
    /// Watch descriptor → the watches that cover its directory (one inotify watch per
    /// directory, whoever asked for it).
    wds: HashMap<i32, Vec<u64>>,
}

fn registry() -> MutexGuard<'static, Registry> {
    static REGISTRY: OnceLock<Mutex<Registry>> = OnceLock::new();
    match REGISTRY.get_or_init(Mutex::default).lock() {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    }
}

/// `Watch`: answers `Watching` once the directory (and with `recursive` every subdirectory)
/// is watched, then `FsEvents` from the event thread; or an error.
pub fn watch(out: &Arc<Out>, root: Arc<Root>, id: u64, path: &str, recursive: bool) {
    if let Err(e) = start(out, root, id, path, recursive) {
        send_error(out, id, &e);
    }
}

/// `Unwatch`: the watch of request `watch` ends with `Detached` (after the events gathered so
/// far); the `Unwatch` itself gets `Ok`.
pub fn unwatch(out: &Out, id: u64, watch: u64) {
    let mut reg = registry();
    match take(&mut reg, watch) {
        Some(mut w) => {
            flush(watch, &mut w);
            w.out.send(watch, &Event::Detached, &[]);
            out.send(id, &Event::Ok, &[]);
        }
        None => send_error(out, id, &WatchError::Unknown(watch)),
    }
}

/// A reset: every watch ends with `Detached`.
pub fn end_all() {
    let mut reg = registry();
    let ids: Vec<u64> = reg.watches.keys().copied().collect();
    for id in ids {
        if let Some(mut w) = take(&mut reg, id) {
            flush(id, &mut w);
            w.out.send(id, &Event::Detached, &[]);
        }
    }
}

fn send_error(out: &Out, id: u64, e: &WatchError) {
    let ev = Event::Error {
        code: e.code(),
        message: chain(e),
    };
    out.send(id, &ev, &[]);
}

fn start(
    out: &Arc<Out>,
    root: Arc<Root>,
    id: u64,
    path: &str,
    recursive: bool,
) -> Result<(), WatchError> {
    let open_err = |source| WatchError::Open {
        path: path.to_owned(),
        source,
    };
    let base = root.open_dir(path).map_err(open_err)?;
    let info = sfs::fstatat_nofollow(base.as_fd(), OsStr::new("")).map_err(|source| {
        open_err(FileError::Sys {
            op: "stat",
            path: path.to_owned(),
            source,
        })
    })?;
    let mut reg = registry();
    if reg.watches.contains_key(&id) {
        return Err(WatchError::Duplicate(id));
    }
    if reg.watches.len() >= MAX_WATCHES {
        return Err(WatchError::TooManyWatches);
    }
    let inotify = match &reg.inotify {
        Some(i) => Arc::clone(i),
        None => {
            let i = Arc::new(Inotify::new().map_err(|source| WatchError::AddWatch {
                path: path.to_owned(),
                source,
            })?);
            reg.inotify = Some(Arc::clone(&i));
            i
        }
    };
    reg.watches.insert(
        id,
        Watch {
            out: Arc::clone(out),
            path: path.to_owned(),
            root,
            inode: (info.dev, info.ino),
            recursive,
            moved: None,
            dirs: HashMap::new(),
            batch: Batch::default(),
        },
    );
    let added = add_tree(&mut reg, &inotify, id, base.as_fd(), Path::new(""), None);
    drop(base);
    if let Err(e) = added {
        take(&mut reg, id);
        return Err(e);
    }
    if !reg.thread {
        let i = Arc::clone(&inotify);
        let spawned = std::thread::Builder::new()
            .name("watch".into())
            .spawn(move || run(&i));
        if let Err(e) = spawned {
            take(&mut reg, id);
            return Err(WatchError::Thread(e));
        }
        reg.thread = true;
    }
    out.send(id, &Event::Watching, &[]);
    Ok(())
}

/// Unregisters watch `id` (its inotify watches go unless another watch shares them).
fn take(reg: &mut Registry, id: u64) -> Option<Watch> {
    let w = reg.watches.remove(&id)?;
    for wd in w.dirs.keys() {
        drop_owner(reg, *wd, id);
    }
    Some(w)
}

/// Removes `id` from the owners of `wd`; the inotify watch goes with its last owner.
fn drop_owner(reg: &mut Registry, wd: i32, id: u64) {
    let Some(owners) = reg.wds.get_mut(&wd) else {
        return;
    };
    owners.retain(|o| *o != id);
    if owners.is_empty() {
        reg.wds.remove(&wd);
        if let Some(i) = &reg.inotify {
            // Fails when the kernel removed it already (the directory went).
            let _ = i.rm_watch(wd);
        }
    }
}

/// Watches the directory `dir` (at `rel` below watch `id`'s directory) and, for a recursive
/// watch, every directory below it. With `found`, the entries met on the way are reported as
/// created (a directory made after the watch began may have been filled before its own watch
/// was in place).
fn add_tree(
    reg: &mut Registry,
    inotify: &Inotify,
    id: u64,
    dir: BorrowedFd<'_>,
    rel: &Path,
    found: Option<Instant>,
) -> Result<(), WatchError> {
    let Some(w) = reg.watches.get_mut(&id) else {
        return Ok(());
    };
    if w.dirs.len() >= MAX_DIRS {
        return Err(WatchError::TooLarge {
            path: rel.to_string_lossy().into_owned(),
            what: "directories",
            limit: MAX_DIRS,
        });
    }
    let wd = inotify
        .add_watch(dir, MASK)
        .map_err(|source| WatchError::AddWatch {
            path: rel.to_string_lossy().into_owned(),
            source,
        })?;
    if w.dirs.contains_key(&wd) {
        return Ok(()); // the same directory again (a bind mount inside the tree)
    }
    w.dirs.insert(wd, rel.to_owned());
    let recursive = w.recursive;
    reg.wds.entry(wd).or_default().push(id);
    if !recursive || rel.components().count() >= MAX_DEPTH {
        return Ok(());
    }
    let (entries, truncated) = match sfs::read_dir(dir, MAX_ENTRIES) {
        Ok(r) => r,
        Err(_) => return Ok(()), // went, or unreadable: nothing below to watch
    };
    if truncated {
        return Err(WatchError::TooLarge {
            path: rel.to_string_lossy().into_owned(),
            what: "entries",
            limit: MAX_ENTRIES,
        });
    }
    for e in entries {
        let sub_rel = rel.join(&e.name);
        if let (Some(now), Some(w)) = (found, reg.watches.get_mut(&id)) {
            push(
                &mut w.batch,
                sub_rel.to_string_lossy().into_owned(),
                FsOp::Create,
                now,
            );
        }
        let sub = sfs::openat2(
            dir,
            &e.name,
            libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW,
            0,
            Confine::BeneathNoSymlinks,
        );
        // Not a directory, a symlink, gone or unreadable: nothing to watch.
        if let Ok(sub) = sub {
            add_tree(reg, inotify, id, sub.as_fd(), &sub_rel, found)?;
        }
    }
    Ok(())
}

/// Adds one event to a batch: a write (or create) repeating the last op of its name is
/// dropped, one past [`MAX_BATCH`] is counted.
fn push(batch: &mut Batch, name: String, op: FsOp, now: Instant) {
    if matches!(op, FsOp::Write | FsOp::Create) && batch.last.get(&name) == Some(&op) {
        return;
    }
    if batch.events.len() >= MAX_BATCH {
        batch.dropped += 1;
        return;
    }
    batch.since.get_or_insert(now);
    batch.last.insert(name.clone(), op);
    batch.events.push(FsEvent { name, op });
}

/// Sends the events gathered for watch `id`, and logs what was dropped (rate-limited).
fn flush(id: u64, w: &mut Watch) {
    let b = &mut w.batch;
    if !b.events.is_empty() {
        let events = std::mem::take(&mut b.events);
        w.out.send(id, &Event::FsEvents { events }, &[]);
    }
    b.last.clear();
    b.since = None;
    if b.dropped > 0 && b.logged.is_none_or(|t| t.elapsed() >= DROP_LOG_EVERY) {
        eprintln!(
            "dsec-agent: watch {id} of {:?}: {} events dropped (more than {MAX_BATCH} per \
             {BATCH:?}, or the kernel's queue overflowed)",
            w.path, b.dropped
        );
        b.dropped = 0;
        b.logged = Some(Instant::now());
    }
}

/// The event thread: reads, sorts events into batches, sends batches that are due. Exits when
/// no watch is left.
fn run(inotify: &Inotify) {
    let mut buf = vec![0u8; READ_BUF];
    loop {
        let timeout = {
            let mut reg = registry();
            if reg.watches.is_empty() {
                reg.thread = false;
                return;
            }
            let now = Instant::now();
            reg.watches
                .values()
                .filter_map(|w| w.batch.since)
                .min()
                .map_or(IDLE_POLL, |s| (s + BATCH).saturating_duration_since(now))
        };
        if let Err(e) = proc::poll(&[(inotify.as_fd(), Interest::Read)], Some(timeout)) {
            eprintln!("dsec-agent: poll the watch queue: {e}");
            std::thread::sleep(BATCH);
        }
        let events = match inotify.read(&mut buf) {
            Ok(evs) => evs,
            Err(e) => {
                eprintln!("dsec-agent: read the watch queue: {e}");
                std::thread::sleep(BATCH);
                Vec::new()
            }
        };
        let now = Instant::now();
        let mut reg = registry();
        for (i, ev) in events.iter().enumerate() {
            dispatch(&mut reg, inotify, ev, events.get(i + 1), now);
        }
        let due: Vec<u64> = reg
            .watches
            .iter()
            .filter(|(_, w)| w.batch.since.is_some_and(|s| now >= s + BATCH))
            .map(|(id, _)| *id)
            .collect();
        for id in due {
            if let Some(w) = reg.watches.get_mut(&id) {
                flush(id, w);
            }
        }
    }
}

/// Ends watch `id` with `err` (after the events gathered so far).
fn fail(reg: &mut Registry, id: u64, err: &WatchError) {
    if let Some(mut w) = take(reg, id) {
        flush(id, &mut w);
        send_error(&w.out, id, err);
    }
}

/// What one inotify event (followed by `next`) means to each watch that covers its directory.
fn dispatch(
    reg: &mut Registry,
    inotify: &Inotify,
    ev: &InotifyEvent,
    next: Option<&InotifyEvent>,
    now: Instant,
) {
    if ev.mask & libc::IN_Q_OVERFLOW != 0 {
        for w in reg.watches.values_mut() {
            w.batch.dropped += 1;
            w.batch.since.get_or_insert(now); // logged with the next batch
        }
        return;
    }
    let Some(owners) = reg.wds.get(&ev.wd).cloned() else {
        return; // a watch removed since
    };
    if ev.mask & libc::IN_IGNORED != 0 {
        // The kernel dropped the watch: its directory went (or its file system).
        reg.wds.remove(&ev.wd);
        for id in owners {
            let Some(w) = reg.watches.get_mut(&id) else {
                continue;
            };
            if w.dirs
                .remove(&ev.wd)
                .is_some_and(|rel| rel.as_os_str().is_empty())
            {
                let path = w.path.clone();
                fail(reg, id, &WatchError::Gone { path });
            }
        }
        return;
    }
    for id in owners {
        let Some(w) = reg.watches.get_mut(&id) else {
            continue;
        };
        let Some(rel) = w.dirs.get(&ev.wd).cloned() else {
            continue;
        };
        if ev.name.is_empty() {
            // About the directory itself: its parent's watch reports it by name, except for
            // the watched directory, whose going ends the watch.
            if ev.mask & (libc::IN_DELETE_SELF | libc::IN_MOVE_SELF) != 0
                && rel.as_os_str().is_empty()
            {
                let path = w.path.clone();
                fail(reg, id, &WatchError::Gone { path });
            }
            continue;
        }
        let path = rel.join(&ev.name);
        let name = path.to_string_lossy().into_owned();
        let is_dir = ev.mask & libc::IN_ISDIR != 0;
        let op = if ev.mask & (libc::IN_CREATE | libc::IN_MOVED_TO) != 0 {
            FsOp::Create
        } else if ev.mask & (libc::IN_MODIFY | libc::IN_CLOSE_WRITE) != 0 {
            FsOp::Write
        } else if ev.mask & libc::IN_DELETE != 0 {
            FsOp::Remove
        } else if ev.mask & libc::IN_MOVED_FROM != 0 {
            FsOp::Rename
        } else if ev.mask & libc::IN_ATTRIB != 0 {
            FsOp::Chmod
        } else {
            continue;
        };
        push(&mut w.batch, name, op, now);
        if !(w.recursive && is_dir) {
            continue;
        }
        match op {
            FsOp::Create if ev.mask & libc::IN_MOVED_TO != 0 && w.moved == Some(ev.cookie) => {
                w.moved = None; // its watches were renamed with its `IN_MOVED_FROM`
            }
            FsOp::Create => watch_new_dir(reg, inotify, id, &path, now),
            FsOp::Rename => {
                // Moved within the tree (its `IN_MOVED_TO` comes next, in a directory of this
                // watch): the same watches, a new name. Moved away: no longer watched.
                let to = next
                    .filter(|n| n.mask & libc::IN_MOVED_TO != 0 && n.cookie == ev.cookie)
                    .and_then(|n| Some(w.dirs.get(&n.wd)?.join(&n.name)));
                match to {
                    Some(to) => {
                        for rel in w.dirs.values_mut() {
                            if let Ok(rest) = rel.strip_prefix(&path) {
                                *rel = to.join(rest);
                            }
                        }
                        w.moved = Some(ev.cookie);
                    }
                    None => forget_subtree(reg, id, &path),
                }
            }
            FsOp::Write | FsOp::Remove | FsOp::Chmod => {}
        }
    }
}

/// A recursive watch met a new directory at `rel`: watch it and everything below it.
fn watch_new_dir(reg: &mut Registry, inotify: &Inotify, id: u64, rel: &Path, now: Instant) {
    let Some(w) = reg.watches.get(&id) else {
        return;
    };
    // The watched directory again, through the root: it must be the same one (else it moved
    // away, and its `IN_MOVE_SELF` ends the watch).
    let Ok(base) = w.root.open_dir(&w.path) else {
        return;
    };
    match sfs::fstatat_nofollow(base.as_fd(), OsStr::new("")) {
        Ok(i) if (i.dev, i.ino) == w.inode => {}
        _ => return,
    }
    let opened = sfs::openat2(
        base.as_fd(),
        OsStr::new(rel.as_os_str()),
        libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW,
        0,
        Confine::BeneathNoSymlinks,
    );
    // Gone again, or not a plain directory below the watched one: nothing to watch.
    let Ok(dir) = opened else {
        return;
    };
    match add_tree(reg, inotify, id, dir.as_fd(), rel, Some(now)) {
        Ok(()) => {}
        Err(e @ WatchError::TooLarge { .. }) => fail(reg, id, &e),
        Err(e) if e.code() == ErrorCode::ResourceExhausted => fail(reg, id, &e),
        Err(_) => {} // raced with its removal
    }
}

/// Stops watching `rel` and every directory below it for watch `id`.
fn forget_subtree(reg: &mut Registry, id: u64, rel: &Path) {
    let Some(w) = reg.watches.get_mut(&id) else {
        return;
    };
    let gone: Vec<i32> = w
        .dirs
        .iter()
        .filter(|(_, r)| r.starts_with(rel))
        .map(|(wd, _)| *wd)
        .collect();
    for wd in &gone {
        w.dirs.remove(wd);
    }
    for wd in gone {
        drop_owner(reg, wd, id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_drop_repeated_writes_and_count_overflow() {
        let mut b = Batch::default();
        let now = Instant::now();
        push(&mut b, "a".into(), FsOp::Create, now);
        push(&mut b, "a".into(), FsOp::Write, now);
        push(&mut b, "a".into(), FsOp::Write, now);
        push(&mut b, "b".into(), FsOp::Write, now);
        push(&mut b, "a".into(), FsOp::Chmod, now);
        push(&mut b, "a".into(), FsOp::Write, now);
        let ops: Vec<_> = b.events.iter().map(|e| (e.name.as_str(), e.op)).collect();
        assert_eq!(
            ops,
            vec![
                ("a", FsOp::Create),
                ("a", FsOp::Write),
                ("b", FsOp::Write),
                ("a", FsOp::Chmod),
                ("a", FsOp::Write),
            ]
        );
        for i in 0..MAX_BATCH {
            push(&mut b, format!("f{i}"), FsOp::Remove, now);
        }
        assert_eq!(b.events.len(), MAX_BATCH);
        assert_eq!(b.dropped, 5);
        assert_eq!(b.since, Some(now));
    }
}
