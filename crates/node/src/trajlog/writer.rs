//! The writer thread: group commit.
//!
//! Loop: take whatever is queued (up to the batch bounds), assign consecutive lsns, encode the
//! batch into one buffer, rotate the segment first if the active one is full, write the buffer
//! (one `write(2)` unless the kernel writes less), `fdatasync` once, then index the records,
//! publish them to subscribers and answer every appender of the batch.
//!
//! Any failed write, rotation or `fdatasync` poisons the log: the batch's appenders and every
//! later one get [`LogError::Poisoned`], and nothing is retried. After a failed `fdatasync` the
//! kernel may have dropped the dirty pages and marked them clean, so a retry that succeeds proves
//! nothing; only a restart with recovery from what is really on disk is sound.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::format;
use super::index::Loc;
use super::queue::Pending;
use super::storage::{SegmentFile, Storage};
use super::{Entry, LogError, Lsn, Shared};

pub struct Writer {
    pub shared: Arc<Shared>,
    pub storage: Arc<dyn Storage>,
    pub active: Box<dyn SegmentFile>,
    pub active_first: Lsn,
    pub active_len: u64,
    pub next_lsn: Lsn,
    pub buf: Vec<u8>,
}

impl Writer {
    pub fn run(mut self) {
        let cfg = &self.shared.config;
        let (max_records, max_bytes) = (cfg.max_batch_records, cfg.max_batch_bytes);
        while let Some(batch) = self.shared.queue.pop_batch(max_records, max_bytes) {
            if let Some(op) = self.shared.poisoned() {
                fail(batch, op);
                continue;
            }
            match self.commit(&batch) {
                Ok(first) => self.complete(batch, first),
                Err(op) => {
                    self.shared.poison(op);
                    fail(batch, op);
                }
            }
            if self.buf.capacity() > 2 * max_bytes.max(1 << 20) {
                self.buf = Vec::with_capacity(max_bytes.min(1 << 24));
            }
        }
    }

    /// Writes and syncs a batch; returns its first lsn, or the operation that failed.
    fn commit(&mut self, batch: &[Pending]) -> Result<Lsn, &'static str> {
        if self.active_len >= self.shared.config.segment_bytes {
            self.rotate()?;
        }
        let first = self.next_lsn;
        self.buf.clear();
        for (i, p) in batch.iter().enumerate() {
            let r = &p.record;
            format::encode(
                &mut self.buf,
                Lsn(first.0 + i as u64),
                &r.trajectory,
                r.step,
                r.kind,
                &r.payload,
            );
        }
        let mut written = 0;
        while written < self.buf.len() {
            match self.active.write(&self.buf[written..]) {
                Ok(0) => return Err("write"),
                Ok(n) => written += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return Err("write"),
            }
        }
        let stats = &self.shared.stats;
        stats.bytes.fetch_add(written as u64, Ordering::Relaxed);
        if self.active.sync_data().is_err() {
            return Err("fdatasync");
        }
        stats.fsyncs.fetch_add(1, Ordering::Relaxed);
        Ok(first)
    }

    fn rotate(&mut self) -> Result<(), &'static str> {
        let path = self.shared.segment_path(self.next_lsn);
        let file = self.storage.create(&path).map_err(|_| "create_segment")?;
        self.active = file;
        self.active_first = self.next_lsn;
        self.active_len = 0;
        let mut segs = self.shared.lock_segments();
        segs.insert(self.next_lsn.0, 0);
        self.shared
            .active_segment
            .store(self.next_lsn.0, Ordering::Release);
        Ok(())
    }

    /// Indexes a durable batch, publishes it and answers its appenders.
    fn complete(&mut self, batch: Vec<Pending>, first: Lsn) {
        let n = batch.len() as u64;
        let publish = self.shared.events.receiver_count() > 0;
        let mut offset = self.active_len;
        {
            let mut index = self.shared.write_index();
            for (i, p) in batch.iter().enumerate() {
                let r = &p.record;
                let len = format::frame_len(r.trajectory.len(), r.payload.len());
                index.insert(
                    &r.trajectory,
                    r.step,
                    r.kind,
                    Lsn(first.0 + i as u64),
                    Loc {
                        segment: self.active_first,
                        offset,
                        len: len as u32,
                    },
                );
                offset += len as u64;
            }
        }
        self.active_len = offset;
        self.next_lsn = Lsn(first.0 + n);
        self.shared
            .next_lsn
            .store(self.next_lsn.0, Ordering::Release);
        self.shared
            .lock_segments()
            .insert(self.active_first.0, self.active_len);
        let stats = &self.shared.stats;
        stats.appends.fetch_add(n, Ordering::Relaxed);
        stats.batches.fetch_add(1, Ordering::Relaxed);
        for (i, p) in batch.into_iter().enumerate() {
            let lsn = Lsn(first.0 + i as u64);
            if publish {
                let Pending { record, reply, .. } = p;
                let _ = reply.send(Ok(lsn));
                let _ = self.shared.events.send(Arc::new(Entry {
                    lsn,
                    trajectory: record.trajectory,
                    step: record.step,
                    kind: record.kind,
                    payload: record.payload,
                }));
            } else {
                let _ = p.reply.send(Ok(lsn));
            }
        }
    }
}

fn fail(batch: Vec<Pending>, op: &'static str) {
    for p in batch {
        let _ = p.reply.send(Err(LogError::Poisoned { op }));
    }
}
