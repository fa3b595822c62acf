//! Compaction: dropping the records of finished trajectories from sealed segments.
//!
//! For each sealed segment (every segment but the active one, oldest first) that holds a record
//! of a finished trajectory, the surviving frames are copied byte for byte, in order, behind a
//! segment header (`format::SegmentHeader`: the lsn range `first..end` the segment covers) into
//! `seg-<first>.log.compacting`; that file is fsync'ed, renamed over the segment and the
//! directory fsync'ed. A crash before the rename leaves the original segment and a temporary
//! file that recovery deletes; after it, the compacted segment. Either is a valid log: recovery
//! accepts lsn gaps inside a compacted segment's range and still requires the next segment to
//! start at its `end`, so a missing segment is still detected.
//!
//! A segment left without records is deleted when it is the oldest segment (a prefix, as with
//! retention, so recovery sees no gap); one in the middle is kept as a bare 24-byte header, and
//! deleted by a later compaction or by retention once everything before it is gone.
//!
//! Concurrency. Sealed segments are never written by the writer, so compaction reads and writes
//! them without holding any lock the writer needs. The swap — rename, dropping the cached read
//! handle, moving the segment's records in the index to their new offsets and forgetting the
//! dropped ones — happens under the index write lock. Readers take their slots and the read
//! handles of those slots' segments under one index read lock (`Shared::files_for`), so they read
//! either the old file at the old offsets (the renamed-over inode stays readable through an open
//! handle) or the new file at the new ones. The writer waits for that lock only for the rename.
//! Compaction and retention exclude each other (`Shared::maintenance`).

use std::collections::HashMap;
use std::fs;
use std::path::Path;
use std::sync::atomic::Ordering;

use super::format::{self, SegmentHeader, SEGMENT_HEADER_LEN};
use super::{unpoison, LogError, Lsn, Shared};

/// What [`TrajLog::compact`](super::TrajLog::compact) did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CompactionReport {
    /// Segments rewritten without the dropped records.
    pub segments_rewritten: usize,
    /// Segments deleted because no record was left in them.
    pub segments_deleted: usize,
    /// Records dropped.
    pub records_dropped: u64,
    /// Bytes of segment files freed.
    pub bytes_reclaimed: u64,
}

/// The caller's `finished` predicate, asked once per trajectory so one compaction is consistent.
struct Verdicts<'a> {
    finished: &'a dyn Fn(&str) -> bool,
    cache: HashMap<String, bool>,
}

impl Verdicts<'_> {
    fn finished(&mut self, trajectory: &str) -> bool {
        if let Some(&v) = self.cache.get(trajectory) {
            return v;
        }
        let v = (self.finished)(trajectory);
        self.cache.insert(trajectory.to_owned(), v);
        v
    }
}

/// A sealed segment as compaction sees it.
#[derive(Debug, Clone, Copy)]
struct Sealed {
    first: Lsn,
    len: u64,
    /// The next segment's first lsn.
    end: Lsn,
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> LogError + 'a {
    move |source| LogError::Io {
        op,
        path: path.to_owned(),
        source,
    }
}

pub(super) fn compact(
    shared: &Shared,
    finished: &dyn Fn(&str) -> bool,
) -> Result<CompactionReport, LogError> {
    let _maintenance = unpoison(shared.maintenance.lock());
    let sealed: Vec<Sealed> = {
        let segs = shared.lock_segments();
        let active = shared.active_segment.load(Ordering::Acquire);
        let all: Vec<(u64, u64)> = segs.iter().map(|(&f, &l)| (f, l)).collect();
        all.windows(2)
            .filter(|w| w[0].0 < active)
            .map(|w| Sealed {
                first: Lsn(w[0].0),
                len: w[0].1,
                end: Lsn(w[1].0),
            })
            .collect()
    };
    let mut verdicts = Verdicts {
        finished,
        cache: HashMap::new(),
    };
    let mut report = CompactionReport::default();
    // Whether every segment before this one has been deleted (so deleting it leaves no gap).
    let mut head = true;
    for seg in sealed {
        let names = shared.read_index().segment_trajectories(seg.first);
        let mut drop_any = false;
        let mut keep_any = false;
        for n in &names {
            if verdicts.finished(n) {
                drop_any = true;
            } else {
                keep_any = true;
            }
        }
        if !keep_any && head {
            delete(shared, seg, &mut report)?;
            continue;
        }
        head = false;
        if drop_any {
            rewrite(shared, seg, &mut verdicts, &mut report)?;
        }
    }
    if report.segments_deleted > 0 {
        let dir = &shared.config.dir;
        shared
            .storage
            .sync_dir(dir)
            .map_err(io_err("sync_dir", dir))?;
    }
    Ok(report)
}

/// Deletes the oldest segment, whose records are all dropped.
fn delete(shared: &Shared, seg: Sealed, report: &mut CompactionReport) -> Result<(), LogError> {
    let path = shared.segment_path(seg.first);
    {
        let mut index = shared.write_index();
        report.records_dropped += index.compact_segment(seg.first, &HashMap::new());
        unpoison(shared.readers.lock()).remove(&seg.first.0);
    }
    fs::remove_file(&path).map_err(io_err("delete_segment", &path))?;
    shared.lock_segments().remove(&seg.first.0);
    report.segments_deleted += 1;
    report.bytes_reclaimed += seg.len;
    Ok(())
}

/// Rewrites a segment without the records of finished trajectories.
fn rewrite(
    shared: &Shared,
    seg: Sealed,
    verdicts: &mut Verdicts<'_>,
    report: &mut CompactionReport,
) -> Result<(), LogError> {
    let dir = &shared.config.dir;
    let path = shared.segment_path(seg.first);
    let data = fs::read(&path).map_err(io_err("read_segment", &path))?;
    let modified = fs::metadata(&path)
        .and_then(|m| m.modified())
        .map_err(io_err("stat_segment", &path))?;
    let corrupt = |offset: usize| LogError::Corrupt {
        path: path.clone(),
        offset: offset as u64,
    };
    let (end, mut off) = match format::decode_segment_header(&data) {
        Ok(Some(h)) if h.first == seg.first && h.end == seg.end => (h.end, SEGMENT_HEADER_LEN),
        Ok(None) => (seg.end, 0),
        Ok(Some(_)) | Err(_) => return Err(corrupt(0)),
    };
    let mut out = Vec::with_capacity(data.len());
    format::encode_segment_header(
        &mut out,
        SegmentHeader {
            first: seg.first,
            end,
        },
    );
    // lsn → new offset of every surviving record.
    let mut kept = HashMap::new();
    while off < data.len() {
        let (body, n) = format::decode_frame(&data[off..]).map_err(|_| corrupt(off))?;
        if body.lsn < seg.first || body.lsn >= end {
            return Err(corrupt(off));
        }
        if !verdicts.finished(body.trajectory) {
            kept.insert(body.lsn.0, out.len() as u64);
            out.extend_from_slice(&data[off..off + n]);
        }
        off += n;
    }

    let tmp = dir.join(format::compacting_name(seg.first));
    if let Err(source) = shared.storage.write_durable(&tmp, &out, modified) {
        let _ = fs::remove_file(&tmp);
        return Err(LogError::Io {
            op: "write_compacted_segment",
            path: tmp,
            source,
        });
    }
    {
        let mut index = shared.write_index();
        if let Err(source) = shared.storage.rename(&tmp, &path) {
            drop(index);
            let _ = fs::remove_file(&tmp);
            return Err(LogError::Io {
                op: "rename_compacted_segment",
                path,
                source,
            });
        }
        unpoison(shared.readers.lock()).remove(&seg.first.0);
        report.records_dropped += index.compact_segment(seg.first, &kept);
    }
    shared.lock_segments().insert(seg.first.0, out.len() as u64);
    report.segments_rewritten += 1;
    report.bytes_reclaimed += (data.len() as u64).saturating_sub(out.len() as u64);
    shared
        .storage
        .sync_dir(dir)
        .map_err(io_err("sync_dir", dir))
}
