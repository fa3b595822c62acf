//! The in-memory index: for each trajectory, its records ordered by `(step, lsn)` with where each
//! one lives on disk, and its counters. Built by recovery and extended by the writer after each
//! durable batch; payloads stay on disk.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::{Lsn, RecordKind, TrajectorySummary};

/// Where a record's frame is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Loc {
    /// The segment, named by its first lsn.
    pub segment: Lsn,
    /// Byte offset of the frame in the segment.
    pub offset: u64,
    /// Frame length.
    pub len: u32,
}

/// One indexed record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    /// Record kind.
    pub kind: RecordKind,
    /// Where it is.
    pub loc: Loc,
}

#[derive(Debug, Default)]
struct Traj {
    /// Keyed by `(step, lsn)`: a step's records in append order.
    records: BTreeMap<(u64, u64), Slot>,
    intents: u64,
    results: u64,
    annotations: u64,
    first_lsn: u64,
    last_lsn: u64,
    last_step: u64,
}

impl Traj {
    fn count(&mut self, kind: RecordKind, up: bool) {
        let c = match kind {
            RecordKind::Intent => &mut self.intents,
            RecordKind::Result => &mut self.results,
            RecordKind::Annotation => &mut self.annotations,
        };
        if up {
            *c += 1;
        } else {
            *c -= 1;
        }
    }

    fn recompute_bounds(&mut self) {
        self.first_lsn = self.records.keys().map(|k| k.1).min().unwrap_or(0);
        self.last_lsn = self.records.keys().map(|k| k.1).max().unwrap_or(0);
        self.last_step = self.records.keys().map(|k| k.0).max().unwrap_or(0);
    }
}

/// A step's first intent and first result, if any.
pub type StepSlots = (Option<(Lsn, Slot)>, Option<(Lsn, Slot)>);

/// The index of every live record.
#[derive(Debug, Default)]
pub struct Index {
    trajs: HashMap<String, Traj>,
    /// Which trajectories have records in each segment, so retention touches only those.
    by_segment: BTreeMap<u64, BTreeSet<String>>,
    records: u64,
}

impl Index {
    /// Adds a record. Records arrive in lsn order.
    pub fn insert(&mut self, trajectory: &str, step: u64, kind: RecordKind, lsn: Lsn, loc: Loc) {
        let t = match self.trajs.get_mut(trajectory) {
            Some(t) => t,
            None => self.trajs.entry(trajectory.to_owned()).or_insert(Traj {
                first_lsn: lsn.0,
                ..Traj::default()
            }),
        };
        t.records.insert((step, lsn.0), Slot { kind, loc });
        t.count(kind, true);
        t.last_lsn = lsn.0;
        t.last_step = t.last_step.max(step);
        let segs = self.by_segment.entry(loc.segment.0).or_default();
        if !segs.contains(trajectory) {
            segs.insert(trajectory.to_owned());
        }
        self.records += 1;
    }

    /// Forgets every record stored in `segment`.
    pub fn remove_segment(&mut self, segment: Lsn) {
        self.compact_segment(segment, &HashMap::new());
    }

    /// The trajectories with records in `segment`.
    pub fn segment_trajectories(&self, segment: Lsn) -> Vec<String> {
        self.by_segment
            .get(&segment.0)
            .map(|names| names.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// After `segment` was rewritten: its records whose lsn is in `kept` move to the offset
    /// given there, the others are forgotten. Returns how many were forgotten.
    pub fn compact_segment(&mut self, segment: Lsn, kept: &HashMap<u64, u64>) -> u64 {
        let Some(names) = self.by_segment.remove(&segment.0) else {
            return 0;
        };
        let mut dropped = 0;
        let mut still = BTreeSet::new();
        for name in names {
            let Some(t) = self.trajs.get_mut(&name) else {
                continue;
            };
            let here: Vec<(u64, u64)> = t
                .records
                .iter()
                .filter(|(_, s)| s.loc.segment == segment)
                .map(|(k, _)| *k)
                .collect();
            let mut removed = false;
            for k in &here {
                match kept.get(&k.1) {
                    Some(&offset) => {
                        if let Some(slot) = t.records.get_mut(k) {
                            slot.loc.offset = offset;
                        }
                        still.insert(name.clone());
                    }
                    None => {
                        if let Some(slot) = t.records.remove(k) {
                            t.count(slot.kind, false);
                            self.records -= 1;
                            dropped += 1;
                            removed = true;
                        }
                    }
                }
            }
            if t.records.is_empty() {
                self.trajs.remove(&name);
            } else if removed {
                t.recompute_bounds();
            }
        }
        if !still.is_empty() {
            self.by_segment.insert(segment.0, still);
        }
        dropped
    }

    /// Records of `trajectory` with `step >= from_step`, in `(step, lsn)` order, at most `limit`.
    pub fn range(&self, trajectory: &str, from_step: u64, limit: usize) -> Vec<(u64, Lsn, Slot)> {
        let Some(t) = self.trajs.get(trajectory) else {
            return Vec::new();
        };
        t.records
            .range((from_step, 0)..)
            .take(limit)
            .map(|(&(step, lsn), &slot)| (step, Lsn(lsn), slot))
            .collect()
    }

    /// The first intent and the first result recorded for `(trajectory, step)`, or `None` if the
    /// step has no record at all (annotations count as records).
    pub fn step(&self, trajectory: &str, step: u64) -> Option<StepSlots> {
        let t = self.trajs.get(trajectory)?;
        let mut any = false;
        let mut intent = None;
        let mut result = None;
        for (&(_, lsn), &slot) in t.records.range((step, 0)..=(step, u64::MAX)) {
            any = true;
            match slot.kind {
                RecordKind::Intent => {
                    intent.get_or_insert((Lsn(lsn), slot));
                }
                RecordKind::Result => {
                    result.get_or_insert((Lsn(lsn), slot));
                }
                RecordKind::Annotation => {}
            }
        }
        any.then_some((intent, result))
    }

    /// A summary of one trajectory.
    pub fn summary(&self, trajectory: &str) -> Option<TrajectorySummary> {
        self.trajs.get(trajectory).map(|t| summarize(trajectory, t))
    }

    /// Summaries of every trajectory, sorted by id.
    pub fn summaries(&self) -> Vec<TrajectorySummary> {
        let mut v: Vec<_> = self.trajs.iter().map(|(id, t)| summarize(id, t)).collect();
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v
    }

    /// Number of indexed records.
    pub fn records(&self) -> u64 {
        self.records
    }
}

fn summarize(id: &str, t: &Traj) -> TrajectorySummary {
    TrajectorySummary {
        id: id.to_owned(),
        intents: t.intents,
        results: t.results,
        annotations: t.annotations,
        first_lsn: Lsn(t.first_lsn),
        last_lsn: Lsn(t.last_lsn),
        last_step: t.last_step,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loc(segment: u64, offset: u64) -> Loc {
        Loc {
            segment: Lsn(segment),
            offset,
            len: 10,
        }
    }

    #[test]
    fn ordered_by_step_then_lsn_and_counted() {
        let mut ix = Index::default();
        ix.insert("a", 2, RecordKind::Intent, Lsn(1), loc(1, 0));
        ix.insert("a", 1, RecordKind::Annotation, Lsn(2), loc(1, 10));
        ix.insert("a", 2, RecordKind::Result, Lsn(3), loc(1, 20));
        ix.insert("b", 0, RecordKind::Intent, Lsn(4), loc(4, 0));
        let r = ix.range("a", 0, 10);
        let keys: Vec<_> = r.iter().map(|(s, l, _)| (*s, l.0)).collect();
        assert_eq!(keys, vec![(1, 2), (2, 1), (2, 3)]);
        let s = ix.summary("a").expect("a");
        assert_eq!((s.intents, s.results, s.annotations), (1, 1, 1));
        assert_eq!((s.first_lsn, s.last_lsn, s.last_step), (Lsn(1), Lsn(3), 2));
        let (i, res) = ix.step("a", 2).expect("step 2");
        assert_eq!(i.map(|x| x.0), Some(Lsn(1)));
        assert_eq!(res.map(|x| x.0), Some(Lsn(3)));
        assert!(ix.step("a", 9).is_none());
        ix.remove_segment(Lsn(1));
        assert!(ix.summary("a").is_none());
        assert_eq!(ix.records(), 1);
        assert_eq!(ix.summaries().len(), 1);
    }
}
