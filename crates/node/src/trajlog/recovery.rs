//! Recovery on open: scan the segments in lsn order, keep the longest valid prefix.
//!
//! A record is valid when its frame decodes (magic, length, CRC, fields) and its lsn is the one
//! after its predecessor's (the first segment's name gives the first lsn). A segment rewritten by
//! compaction starts with a header giving the lsn range `first..end` it covers: its lsns only
//! have to increase within that range (dropped records leave gaps), and the next segment must
//! start at `end`, so a missing segment, compacted or not, is still a gap. A damaged header is
//! corruption (`segment_header`). Temporary files of an unfinished compaction are deleted first.
//! The scan stops at the first invalid record. What happens then depends on where it is:
//!
//! - **Torn tail**: the bad bytes are in the last segment and no valid frame follows them. This is
//!   what a crash during a write leaves; the segment is truncated at the bad record and the
//!   report counts the bytes cut.
//! - **Corruption**: anything else — a bad record followed by a valid one, a bad record in a
//!   segment that is not the last, or a gap in the lsn sequence between segments. The records
//!   after it are not skipped over: the damaged segment and every later one are renamed to
//!   `<name>.corrupt-<unix nanos>` (kept for inspection, never read again), the damaged segment's
//!   valid prefix is copied into a fresh segment of the same name, and the report carries a
//!   [`Corruption`]. Nothing is deleted.
//!
//! Arbitrary bytes never panic the scan: every length is bounded before it is used.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use super::format::{self, FrameDefect, SegmentHeader, HEADER_LEN, MAGIC, SEGMENT_HEADER_LEN};
use super::index::{Index, Loc};
use super::storage::sync_dir;
use super::{LogError, Lsn};

/// What recovery found and did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Segments kept (after any quarantine).
    pub segments: usize,
    /// Valid records kept.
    pub records: u64,
    /// The lsn the next append gets.
    pub next_lsn: Lsn,
    /// Bytes cut from the tail of the last segment (a torn write).
    pub truncated_bytes: u64,
    /// A bad record that was not a torn tail. `Some` means records after it, if any, were not
    /// recovered: the operator must look at the quarantined files.
    pub corruption: Option<Corruption>,
    /// Files renamed aside, in lsn order.
    pub quarantined: Vec<PathBuf>,
    /// Bytes in the quarantined files beyond the kept prefix.
    pub quarantined_bytes: u64,
}

impl RecoveryReport {
    /// True when recovery found corruption that was not a torn tail.
    pub fn is_corrupt(&self) -> bool {
        self.corruption.is_some()
    }
}

/// Where the first bad record that is not a torn tail was found, and why it is bad.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Corruption {
    /// The segment (its original path).
    pub segment: PathBuf,
    /// Byte offset of the bad record in it.
    pub offset: u64,
    /// The lsn that was expected there.
    pub expected_lsn: Lsn,
    /// What is wrong: `short`, `magic`, `length`, `crc`, `fields`, `lsn_sequence`,
    /// `segment_gap` or `segment_header`.
    pub defect: &'static str,
}

/// One segment kept by recovery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentMeta {
    /// First lsn (the file's name).
    pub first: Lsn,
    /// Valid length in bytes.
    pub len: u64,
    /// Whether it starts with a compacted-segment header.
    pub compacted: bool,
}

/// The state recovery hands to the log.
#[derive(Debug)]
pub struct Recovered {
    /// Kept segments, in lsn order.
    pub segments: Vec<SegmentMeta>,
    /// The index of every kept record.
    pub index: Index,
    /// The report.
    pub report: RecoveryReport,
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> LogError + 'a {
    move |source| LogError::Io {
        op,
        path: path.to_owned(),
        source,
    }
}

/// Lists the segment files of `dir` in lsn order.
pub fn list_segments(dir: &Path) -> Result<Vec<(Lsn, PathBuf)>, LogError> {
    let mut segs = Vec::new();
    for entry in fs::read_dir(dir).map_err(io_err("read_dir", dir))? {
        let entry = entry.map_err(io_err("read_dir", dir))?;
        let name = entry.file_name();
        if let Some(first) = name.to_str().and_then(format::parse_segment_name) {
            segs.push((first, entry.path()));
        }
    }
    segs.sort();
    Ok(segs)
}

/// Whether a valid frame starts anywhere in `data` at or after `from`.
fn valid_frame_after(data: &[u8], from: usize) -> bool {
    let magic = MAGIC.to_le_bytes();
    let mut pos = from;
    while pos + HEADER_LEN <= data.len() {
        if data[pos..pos + 4] == magic && format::decode_frame(&data[pos..]).is_ok() {
            return true;
        }
        pos += 1;
    }
    false
}

/// Whether a record with `lsn` may follow in a segment whose next expected lsn is `next`.
fn in_sequence(lsn: Lsn, next: Lsn, header: Option<SegmentHeader>) -> bool {
    match header {
        None => lsn == next,
        Some(h) => lsn >= next && lsn < h.end,
    }
}

/// Deletes the temporary files of a compaction that did not finish (its segment is intact).
fn remove_compaction_leftovers(dir: &Path) -> Result<(), LogError> {
    let mut removed = false;
    for entry in fs::read_dir(dir).map_err(io_err("read_dir", dir))? {
        let entry = entry.map_err(io_err("read_dir", dir))?;
        let name = entry.file_name();
        if name
            .to_str()
            .is_some_and(|n| n.ends_with(".log.compacting"))
        {
            let path = entry.path();
            fs::remove_file(&path).map_err(io_err("remove_compaction_leftover", &path))?;
            removed = true;
        }
    }
    if removed {
        sync_dir(dir).map_err(io_err("sync_dir", dir))?;
    }
    Ok(())
}

/// Scans `dir` and repairs it as described in the module docs.
pub fn recover(dir: &Path) -> Result<Recovered, LogError> {
    remove_compaction_leftovers(dir)?;
    let segs = list_segments(dir)?;
    let mut index = Index::default();
    let mut kept = Vec::new();
    let mut report = RecoveryReport::default();
    let mut expected: Option<Lsn> = None;

    for (i, (first, path)) in segs.iter().enumerate() {
        let is_last = i + 1 == segs.len();
        if let Some(e) = expected {
            if *first != e {
                quarantine(dir, &segs[i..], None, &mut report)?;
                report.corruption = Some(Corruption {
                    segment: path.clone(),
                    offset: 0,
                    expected_lsn: e,
                    defect: "segment_gap",
                });
                break;
            }
        }
        let data = fs::read(path).map_err(io_err("read_segment", path))?;
        let header = match format::decode_segment_header(&data) {
            Ok(Some(h)) if h.first == *first => Some(h),
            Ok(None) => None,
            Ok(Some(_)) | Err(_) => {
                quarantine(dir, &segs[i..], None, &mut report)?;
                report.corruption = Some(Corruption {
                    segment: path.clone(),
                    offset: 0,
                    expected_lsn: *first,
                    defect: "segment_header",
                });
                break;
            }
        };
        // An original segment holds exactly `next, next + 1, …`; a compacted one increasing
        // lsns in `first..end` (the dropped ones are gaps), and the next segment starts at `end`.
        let mut next = *first;
        let mut off = if header.is_some() {
            SEGMENT_HEADER_LEN
        } else {
            0
        };
        let mut bad: Option<&'static str> = None;
        while off < data.len() {
            match format::decode_frame(&data[off..]) {
                Ok((body, n)) if in_sequence(body.lsn, next, header) => {
                    index.insert(
                        body.trajectory,
                        body.step,
                        body.kind,
                        body.lsn,
                        Loc {
                            segment: *first,
                            offset: off as u64,
                            len: n as u32,
                        },
                    );
                    report.records += 1;
                    off += n;
                    next = Lsn(body.lsn.0 + 1);
                }
                Ok(_) => {
                    bad = Some("lsn_sequence");
                    break;
                }
                Err(d) => {
                    bad = Some(FrameDefect::as_str(d));
                    break;
                }
            }
        }
        let compacted = header.is_some();
        if let Some(h) = header {
            next = h.end;
        }
        expected = Some(next);
        match bad {
            None => kept.push(SegmentMeta {
                first: *first,
                len: data.len() as u64,
                compacted,
            }),
            // A compacted segment is renamed into place whole, so it has no torn tail.
            Some(_) if is_last && !compacted && !valid_frame_after(&data, off + 1) => {
                let f = fs::OpenOptions::new()
                    .write(true)
                    .open(path)
                    .map_err(io_err("open_segment", path))?;
                f.set_len(off as u64)
                    .map_err(io_err("truncate_segment", path))?;
                f.sync_all().map_err(io_err("sync_segment", path))?;
                report.truncated_bytes = (data.len() - off) as u64;
                kept.push(SegmentMeta {
                    first: *first,
                    len: off as u64,
                    compacted,
                });
            }
            Some(defect) => {
                quarantine(dir, &segs[i..], Some(&data[..off]), &mut report)?;
                report.quarantined_bytes -= off as u64;
                if off > 0 {
                    kept.push(SegmentMeta {
                        first: *first,
                        len: off as u64,
                        compacted,
                    });
                }
                report.corruption = Some(Corruption {
                    segment: path.clone(),
                    offset: off as u64,
                    expected_lsn: next,
                    defect,
                });
                break;
            }
        }
    }
    report.segments = kept.len();
    report.next_lsn = expected.unwrap_or(Lsn(1));
    Ok(Recovered {
        segments: kept,
        index,
        report,
    })
}

/// Renames `segs` aside; if `prefix` is non-empty, writes it back under the first one's name.
fn quarantine(
    dir: &Path,
    segs: &[(Lsn, PathBuf)],
    prefix: Option<&[u8]>,
    report: &mut RecoveryReport,
) -> Result<(), LogError> {
    let stamp = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    for (_, path) in segs {
        let mut aside = path.clone().into_os_string();
        aside.push(format!(".corrupt-{stamp}"));
        let aside = PathBuf::from(aside);
        let len = fs::metadata(path)
            .map_err(io_err("stat_segment", path))?
            .len();
        fs::rename(path, &aside).map_err(io_err("quarantine_segment", path))?;
        report.quarantined.push(aside);
        report.quarantined_bytes += len;
    }
    if let (Some(prefix), Some((_, path))) = (prefix, segs.first()) {
        if !prefix.is_empty() {
            fs::write(path, prefix).map_err(io_err("rewrite_prefix", path))?;
            fs::File::open(path)
                .and_then(|f| f.sync_all())
                .map_err(io_err("sync_segment", path))?;
        }
    }
    sync_dir(dir).map_err(io_err("sync_dir", dir))
}
