//! The bounded submission queue between appenders and the writer thread.
//!
//! Bounded by records and by bytes: an appender that finds it full waits (a condition variable
//! for [`append_blocking`](super::TrajLog::append_blocking), a [`Notify`] for the async
//! [`append`](super::TrajLog::append)), so memory held by queued records never exceeds the bound
//! (a single record larger than the byte bound is admitted only into an empty queue).

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

use tokio::sync::{oneshot, Notify};

use super::{LogError, Lsn, Record};

/// A record waiting to be written and the appender waiting for it.
pub struct Pending {
    /// The record.
    pub record: Record,
    /// Its encoded size.
    pub size: usize,
    /// Where the outcome goes.
    pub reply: oneshot::Sender<Result<Lsn, LogError>>,
}

/// The result of trying to enqueue.
pub enum Push {
    /// Queued.
    Done,
    /// The queue is full; the record is handed back.
    Full(Pending),
    /// The log is closed.
    Closed,
}

struct State {
    items: VecDeque<Pending>,
    bytes: usize,
    closed: bool,
    high_water: usize,
}

/// The queue.
pub struct Queue {
    state: Mutex<State>,
    not_empty: Condvar,
    not_full: Condvar,
    /// Woken (all waiters) whenever the writer takes records out.
    pub space: Notify,
    cap_records: usize,
    cap_bytes: usize,
}

/// A snapshot of the queue's occupancy.
#[derive(Debug, Clone, Copy)]
pub struct Occupancy {
    pub depth: usize,
    pub bytes: usize,
    pub high_water: usize,
}

impl Queue {
    pub fn new(cap_records: usize, cap_bytes: usize) -> Queue {
        Queue {
            state: Mutex::new(State {
                items: VecDeque::with_capacity(cap_records.min(4096)),
                bytes: 0,
                closed: false,
                high_water: 0,
            }),
            not_empty: Condvar::new(),
            not_full: Condvar::new(),
            space: Notify::new(),
            cap_records,
            cap_bytes,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The queue's invariants hold between statements, so a panic elsewhere cannot break them.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn admits(&self, s: &State, size: usize) -> bool {
        s.items.is_empty() || (s.items.len() < self.cap_records && s.bytes + size <= self.cap_bytes)
    }

    fn push_locked(&self, s: &mut State, p: Pending) {
        s.bytes += p.size;
        s.items.push_back(p);
        s.high_water = s.high_water.max(s.items.len());
        self.not_empty.notify_one();
    }

    /// Enqueues without waiting.
    pub fn try_push(&self, p: Pending) -> Push {
        let mut s = self.lock();
        if s.closed {
            return Push::Closed;
        }
        if !self.admits(&s, p.size) {
            return Push::Full(p);
        }
        self.push_locked(&mut s, p);
        Push::Done
    }

    /// Enqueues, waiting for room. Returns `false` if the log is closed.
    pub fn push_blocking(&self, p: Pending) -> bool {
        let mut s = self.lock();
        loop {
            if s.closed {
                return false;
            }
            if self.admits(&s, p.size) {
                self.push_locked(&mut s, p);
                return true;
            }
            s = self
                .not_full
                .wait(s)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Takes a batch: waits for at least one record, then takes records in order while the batch
    /// stays within `max_records` and `max_bytes` (the first record is always taken). Returns
    /// `None` once the queue is closed and empty.
    pub fn pop_batch(&self, max_records: usize, max_bytes: usize) -> Option<Vec<Pending>> {
        let mut s = self.lock();
        while s.items.is_empty() {
            if s.closed {
                return None;
            }
            s = self
                .not_empty
                .wait(s)
                .unwrap_or_else(PoisonError::into_inner);
        }
        let mut batch = Vec::new();
        let mut bytes = 0usize;
        while let Some(front) = s.items.front() {
            if !batch.is_empty() && (batch.len() >= max_records || bytes + front.size > max_bytes) {
                break;
            }
            let Some(p) = s.items.pop_front() else { break };
            bytes += p.size;
            batch.push(p);
        }
        s.bytes -= bytes;
        drop(s);
        self.not_full.notify_all();
        self.space.notify_waiters();
        Some(batch)
    }

    /// Refuses new records and wakes everyone; queued records are still handed to the writer.
    pub fn close(&self) {
        self.lock().closed = true;
        self.not_empty.notify_all();
        self.not_full.notify_all();
        self.space.notify_waiters();
    }

    /// Current occupancy.
    pub fn occupancy(&self) -> Occupancy {
        let s = self.lock();
        Occupancy {
            depth: s.items.len(),
            bytes: s.bytes,
            high_water: s.high_water,
        }
    }
}
