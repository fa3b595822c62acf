//! L-02 (torn tails and bit flips never panic recovery nor yield a corrupt record) and recovery
//! unit tests over hand-written segment files.

use super::*;
use proptest::prelude::*;

#[path = "../../tests/common/trajlog.rs"]
mod shared;
use shared::{open_configured, read_all};

/// Writes `records` (lsn 1..) as segments starting at the given record indexes; returns the
/// concatenated bytes and each segment's (path, start offset in the concatenation).
fn write_log(dir: &Path, records: &[Record], splits: &[usize]) -> (Vec<u8>, Vec<(PathBuf, usize)>) {
    let mut starts: Vec<usize> = splits
        .iter()
        .copied()
        .filter(|&s| s > 0 && s < records.len())
        .collect();
    starts.insert(0, 0);
    starts.sort_unstable();
    starts.dedup();
    let mut all = Vec::new();
    let mut segs = Vec::new();
    for (k, &start) in starts.iter().enumerate() {
        let end = starts.get(k + 1).copied().unwrap_or(records.len());
        let mut buf = Vec::new();
        for (i, r) in records.iter().enumerate().take(end).skip(start) {
            format::encode(
                &mut buf,
                Lsn(i as u64 + 1),
                &r.trajectory,
                r.step,
                r.kind,
                &r.payload,
            );
        }
        let path = dir.join(format::segment_name(Lsn(start as u64 + 1)));
        std::fs::write(&path, &buf).expect("write segment");
        segs.push((path, all.len()));
        all.extend_from_slice(&buf);
    }
    (all, segs)
}

fn records_strategy() -> impl Strategy<Value = Vec<Record>> {
    proptest::collection::vec(
        (
            0u8..3,
            0u64..5,
            0u8..3,
            proptest::collection::vec(any::<u8>(), 0..40),
        )
            .prop_map(|(t, step, k, payload)| {
                let kind = [
                    RecordKind::Intent,
                    RecordKind::Result,
                    RecordKind::Annotation,
                ][k as usize];
                Record::new(format!("traj-{t}"), step, kind, payload)
            }),
        1..12,
    )
}

/// How many records lie entirely before byte `pos` of the concatenation.
fn whole_before(records: &[Record], pos: usize) -> usize {
    let mut end = 0;
    for (i, r) in records.iter().enumerate() {
        end += format::frame_len(r.trajectory.len(), r.payload.len());
        if end > pos {
            return i;
        }
    }
    records.len()
}

fn check_prefix(log: &TrajLog, records: &[Record], expected: usize) {
    let got = read_all(log);
    assert_eq!(got.len(), expected, "recovered record count");
    for (i, e) in got.iter().enumerate() {
        let r = &records[i];
        assert_eq!(e.lsn, Lsn(i as u64 + 1));
        assert_eq!(
            (&e.trajectory, e.step, e.kind, &e.payload),
            (&r.trajectory, r.step, r.kind, &r.payload)
        );
    }
    assert_eq!(log.stats().next_lsn, Lsn(expected as u64 + 1));
}

fn sample_records(n: usize) -> Vec<Record> {
    (0..n)
        .map(|i| {
            Record::new(
                format!("t{}", i % 3),
                i as u64,
                RecordKind::Result,
                vec![i as u8; i % 7],
            )
        })
        .collect()
}

#[test]
fn l02_torn_tail_at_every_offset_keeps_the_records_before_it() {
    let records = sample_records(6);
    let tmp = tempfile::tempdir().expect("tempdir");
    let (all, _) = write_log(tmp.path(), &records, &[]);
    for cut in 0..=all.len() {
        let dir = tmp.path().join(format!("cut-{cut}"));
        std::fs::create_dir(&dir).expect("mkdir");
        std::fs::write(dir.join(format::segment_name(Lsn(1))), &all[..cut]).expect("write");
        let (log, report) = TrajLog::open(Config::new(&dir)).expect("open");
        let expected = whole_before(&records, cut);
        assert!(!report.is_corrupt(), "cut {cut}: {report:?}");
        let kept: usize = records[..expected]
            .iter()
            .map(|r| format::frame_len(r.trajectory.len(), r.payload.len()))
            .sum();
        assert_eq!(report.truncated_bytes as usize, cut - kept, "cut {cut}");
        check_prefix(&log, &records, expected);
        // The log continues after the repaired tail.
        let lsn = log
            .append_blocking(Record::new("after", 0, RecordKind::Intent, b"x".to_vec()))
            .expect("append after recovery");
        assert_eq!(lsn, Lsn(expected as u64 + 1));
    }
}

#[test]
fn l02_garbage_directory_contents_never_panic() {
    let tmp = tempfile::tempdir().expect("tempdir");
    std::fs::write(tmp.path().join(format::segment_name(Lsn(1))), [0u8; 100]).expect("write");
    std::fs::write(tmp.path().join("unrelated.txt"), b"hello").expect("write");
    let (log, report) = TrajLog::open(Config::new(tmp.path())).expect("open");
    assert_eq!(report.records, 0);
    assert_eq!(report.truncated_bytes, 100);
    assert_eq!(log.stats().next_lsn, Lsn(1));
}

#[derive(Debug, Clone)]
enum Damage {
    Truncate(usize),
    Flip(usize, u8),
    TruncateAndFlip(usize, usize, u8),
    /// Up to three flips anywhere (CRC-32 detects any three-bit error in a frame).
    Flips(Vec<(usize, u8)>),
}

fn damage_strategy() -> impl Strategy<Value = Damage> {
    prop_oneof![
        any::<usize>().prop_map(Damage::Truncate),
        (any::<usize>(), 0u8..8).prop_map(|(p, b)| Damage::Flip(p, b)),
        (any::<usize>(), any::<usize>(), 0u8..8)
            .prop_map(|(c, p, b)| Damage::TruncateAndFlip(c, p, b)),
        proptest::collection::vec((any::<usize>(), 0u8..8), 1..=3).prop_map(Damage::Flips),
    ]
}

/// Applies `op` at byte `pos` of the concatenated log to the segment holding it.
fn at_global(segs: &[(PathBuf, usize)], total: usize, pos: usize, op: impl FnOnce(&Path, usize)) {
    for (k, (path, start)) in segs.iter().enumerate() {
        let end = segs.get(k + 1).map_or(total, |s| s.1);
        if pos >= *start && pos < end {
            op(path, pos - start);
            return;
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// L-02: whatever single truncation and/or bit flip hits the log (in any segment), recovery
    /// does not panic, and what it yields is exactly the records before the first damaged one —
    /// byte-for-byte, each one passing its CRC.
    #[test]
    fn l02_torn_tails_and_bit_flips_yield_exactly_the_undamaged_prefix(
        records in records_strategy(),
        splits in proptest::collection::vec(0usize..12, 0..3),
        damage in damage_strategy(),
    ) {
        let tmp = tempfile::tempdir().expect("tempdir");
        let (all, segs) = write_log(tmp.path(), &records, &splits);
        let total = all.len();
        let mut first_bad = total;
        let flip = |pos: usize, bit: u8| {
            at_global(&segs, total, pos, |path, off| {
                let mut b = std::fs::read(path).expect("read");
                b[off] ^= 1 << bit;
                std::fs::write(path, b).expect("write");
            });
        };
        let cut_at = |cut: usize| {
            at_global(&segs, total, cut, |path, off| {
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(path)
                    .and_then(|f| f.set_len(off as u64))
                    .expect("truncate");
            });
        };
        match damage {
            Damage::Truncate(c) => {
                let c = c % (total + 1);
                cut_at(c);
                first_bad = c;
            }
            Damage::Flip(p, b) => {
                let p = p % total;
                flip(p, b);
                first_bad = p;
            }
            Damage::TruncateAndFlip(c, p, b) => {
                let c = c % (total + 1);
                let p = p % total;
                if p < c {
                    flip(p, b);
                }
                cut_at(c);
                first_bad = first_bad.min(c).min(if p < c { p } else { total });
            }
            Damage::Flips(flips) => {
                let mut seen = std::collections::BTreeMap::new();
                for (p, b) in flips {
                    *seen.entry(p % total).or_insert(0u8) ^= 1 << b;
                }
                for (&p, &mask) in &seen {
                    for b in (0..8).filter(|b| mask & (1 << b) != 0) {
                        flip(p, b);
                    }
                }
                // Flips that cancel out leave the byte intact.
                first_bad = seen
                    .iter()
                    .find(|(_, &m)| m != 0)
                    .map_or(total, |(&p, _)| p);
            }
        }
        let (log, report) = TrajLog::open(Config::new(tmp.path())).expect("open");
        let expected = whole_before(&records, first_bad);
        check_prefix(&log, &records, expected);
        prop_assert_eq!(report.records as usize, expected);
    }
}

#[test]
fn corruption_in_a_middle_segment_quarantines_the_rest_and_keeps_the_prefix() {
    let records = sample_records(9);
    let tmp = tempfile::tempdir().expect("tempdir");
    let (_, segs) = write_log(tmp.path(), &records, &[3, 6]);
    // Damage the first record's payload byte of the second segment... its second record.
    let second = &segs[1].0;
    let mut b = std::fs::read(second).expect("read");
    let first_len = format::frame_len(2, records[3].payload.len());
    let at = first_len + 20;
    b[at] ^= 0x40;
    std::fs::write(second, b).expect("write");
    let (log, report) = TrajLog::open(Config::new(tmp.path())).expect("open");
    let c = report.corruption.clone().expect("corruption reported");
    assert_eq!(c.segment, *second);
    assert_eq!(c.offset as usize, first_len);
    assert_eq!(c.expected_lsn, Lsn(5));
    assert_eq!(c.defect, "crc");
    assert_eq!(report.quarantined.len(), 2);
    check_prefix(&log, &records, 4);
    // The quarantined files are kept, the prefix of the damaged segment is rewritten in place.
    for q in &report.quarantined {
        assert!(q.exists(), "{q:?}");
    }
    assert_eq!(
        std::fs::metadata(second).expect("stat").len() as usize,
        first_len
    );
    let lsn = log
        .append_blocking(Record::new("x", 1, RecordKind::Intent, vec![]))
        .expect("append");
    assert_eq!(lsn, Lsn(5));
    drop(log);
    let (log, report) = TrajLog::open(Config::new(tmp.path())).expect("reopen");
    assert!(!report.is_corrupt(), "{report:?}");
    assert_eq!(read_all(&log).len(), 5);
}

#[test]
fn a_missing_middle_segment_is_a_reported_gap() {
    let records = sample_records(9);
    let tmp = tempfile::tempdir().expect("tempdir");
    let (_, segs) = write_log(tmp.path(), &records, &[3, 6]);
    std::fs::remove_file(&segs[1].0).expect("rm");
    let (log, report) = TrajLog::open(Config::new(tmp.path())).expect("open");
    let c = report.corruption.expect("gap reported");
    assert_eq!(c.defect, "segment_gap");
    assert_eq!(c.expected_lsn, Lsn(4));
    check_prefix(&log, &records, 3);
}

#[test]
fn invalid_records_are_refused_before_queueing() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let log = open_configured(tmp.path(), |cfg| cfg.max_payload = 10);
    let bad =
        |t: &str, n: usize| log.append_blocking(Record::new(t, 0, RecordKind::Intent, vec![0; n]));
    assert!(matches!(
        bad("", 0),
        Err(LogError::Invalid { what: "trajectory" })
    ));
    assert!(matches!(bad("has space", 0), Err(LogError::Invalid { .. })));
    assert!(matches!(
        bad(&"a".repeat(129), 0),
        Err(LogError::Invalid { .. })
    ));
    assert!(matches!(
        bad("ok", 11),
        Err(LogError::TooLarge { size: 11, max: 10 })
    ));
    assert_eq!(bad(&"a".repeat(128), 10).expect("valid"), Lsn(1));
    log.close();
    assert!(matches!(bad("ok", 0), Err(LogError::Closed)));
    let mut cfg = Config::new(tmp.path());
    cfg.queue_records = 0;
    assert!(matches!(
        TrajLog::open(cfg),
        Err(LogError::Invalid {
            what: "config.queue_records"
        })
    ));
}

// ---------------------------------------------------------------------------------------------
// recovery of compacted segments

/// Writes a compacted segment `first..end` holding `lsns` (each a record of trajectory `c`).
fn write_compacted(dir: &Path, first: u64, end: u64, lsns: &[u64]) -> PathBuf {
    let mut buf = Vec::new();
    format::encode_segment_header(
        &mut buf,
        format::SegmentHeader {
            first: Lsn(first),
            end: Lsn(end),
        },
    );
    for &l in lsns {
        format::encode(&mut buf, Lsn(l), "c", l, RecordKind::Result, b"p");
    }
    let path = dir.join(format::segment_name(Lsn(first)));
    std::fs::write(&path, &buf).expect("write segment");
    path
}

/// Writes an original segment holding `first..end`.
fn write_original(dir: &Path, first: u64, end: u64) -> PathBuf {
    let mut buf = Vec::new();
    for l in first..end {
        format::encode(&mut buf, Lsn(l), "o", l, RecordKind::Intent, b"q");
    }
    let path = dir.join(format::segment_name(Lsn(first)));
    std::fs::write(&path, &buf).expect("write segment");
    path
}

#[test]
fn recovery_accepts_gaps_inside_compacted_segments() {
    let tmp = tempfile::tempdir().expect("tempdir");
    write_compacted(tmp.path(), 1, 10, &[2, 5, 9]);
    write_compacted(tmp.path(), 10, 20, &[]);
    write_original(tmp.path(), 20, 23);
    let (log, report) = TrajLog::open(Config::new(tmp.path())).expect("open");
    assert!(!report.is_corrupt(), "{report:?}");
    let lsns: Vec<u64> = read_all(&log).iter().map(|e| e.lsn.0).collect();
    assert_eq!(lsns, vec![2, 5, 9, 20, 21, 22]);
    assert_eq!(report.next_lsn, Lsn(23));
}

#[test]
fn a_compacted_last_segment_is_not_appended_to_and_bounds_next_lsn() {
    let tmp = tempfile::tempdir().expect("tempdir");
    write_compacted(tmp.path(), 1, 50, &[3, 4]);
    let (log, report) = TrajLog::open(Config::new(tmp.path())).expect("open");
    assert!(!report.is_corrupt(), "{report:?}");
    let lsn = log
        .append_blocking(Record::new("n", 0, RecordKind::Intent, b"x".to_vec()))
        .expect("append");
    assert_eq!(lsn, Lsn(50), "never below the compacted segment's end");
    drop(log);
    assert!(tmp.path().join(format::segment_name(Lsn(50))).exists());
    let (log, report) = TrajLog::open(Config::new(tmp.path())).expect("reopen");
    assert!(!report.is_corrupt(), "{report:?}");
    assert_eq!(read_all(&log).len(), 3);
}

#[test]
fn compacted_segments_still_detect_corruption() {
    // (case, expected defect, expected kept records)
    let cases: [(&str, &str, u64); 5] = [
        ("backwards", "lsn_sequence", 1),
        ("beyond_end", "lsn_sequence", 1),
        ("missing_compacted", "segment_gap", 1),
        ("missing_original", "segment_gap", 3),
        ("bad_header", "segment_header", 0),
    ];
    for (case, defect, kept) in cases {
        let tmp = tempfile::tempdir().expect("tempdir");
        let d = tmp.path();
        match case {
            "backwards" => {
                write_compacted(d, 1, 10, &[5, 3]);
                write_original(d, 10, 12);
            }
            "beyond_end" => {
                write_compacted(d, 1, 10, &[5, 10]);
                write_original(d, 10, 12);
            }
            "missing_compacted" => {
                write_compacted(d, 1, 10, &[5]);
                // 10..20 missing
                write_original(d, 20, 22);
            }
            "missing_original" => {
                write_compacted(d, 1, 10, &[5]);
                write_original(d, 10, 12);
                // 12..20 missing
                write_compacted(d, 20, 30, &[25]);
                write_original(d, 30, 31);
            }
            _ => {
                let p = write_compacted(d, 1, 10, &[5]);
                let mut b = std::fs::read(&p).expect("read");
                b[17] ^= 4;
                std::fs::write(&p, b).expect("write");
                write_original(d, 10, 12);
            }
        }
        let (log, report) = TrajLog::open(Config::new(d)).expect("open");
        let c = report
            .corruption
            .clone()
            .unwrap_or_else(|| panic!("{case}: corruption not reported"));
        assert_eq!(c.defect, defect, "{case}");
        assert_eq!(read_all(&log).len() as u64, kept, "{case}");
    }
}

#[test]
fn leftover_compaction_files_are_removed() {
    let tmp = tempfile::tempdir().expect("tempdir");
    write_original(tmp.path(), 1, 5);
    let tmpfile = tmp.path().join(format::compacting_name(Lsn(1)));
    std::fs::write(&tmpfile, b"half a compaction").expect("write");
    let (log, report) = TrajLog::open(Config::new(tmp.path())).expect("open");
    assert!(!report.is_corrupt(), "{report:?}");
    assert!(!tmpfile.exists());
    assert_eq!(read_all(&log).len(), 4);
}
