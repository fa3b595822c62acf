//! Warm pools: pre-created, agent-ready sandboxes of one spec waiting to be acquired.
//!
//! Acquire is the hot path (a pop under a short lock). Released sandboxes are reset (fresh
//! writable layer, fresh init) and returned to the pool, or destroyed and replaced when their
//! reuse limits are reached. `refill` brings the pool back to its target; callers run it off the
//! hot path (a background thread, or after a burst of acquires).

use std::collections::VecDeque;
use std::sync::Mutex;

use crate::sandbox::SandboxSpec;
use crate::substrate::{ContainerRuntime, RuntimeError, Sandbox};

/// Sizing of a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolConfig {
    /// Never shrink below this many ready sandboxes.
    pub min: usize,
    /// Never hold more than this many ready sandboxes.
    pub max: usize,
    /// Refill up to this many.
    pub target: usize,
    /// Refill when the ready count drops below this.
    pub low_watermark: usize,
}

impl PoolConfig {
    /// Checks `min <= low_watermark <= target <= max`.
    pub fn validate(&self) -> Result<(), String> {
        if self.min <= self.target && self.low_watermark <= self.target && self.target <= self.max {
            Ok(())
        } else {
            Err("pool sizes must satisfy min <= target, low_watermark <= target <= max".into())
        }
    }
}

/// Counters of a pool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PoolStats {
    /// Ready sandboxes now.
    pub ready: usize,
    /// Acquires served from the pool.
    pub hits: u64,
    /// Acquires that had to create on demand.
    pub misses: u64,
    /// Sandboxes destroyed because of their reuse limits.
    pub recycled: u64,
}

/// A warm pool for one sandbox spec.
#[derive(Debug)]
pub struct Pool {
    spec: SandboxSpec,
    cfg: PoolConfig,
    ready: Mutex<VecDeque<Sandbox>>,
    stats: Mutex<PoolStats>,
}

impl Pool {
    /// An empty pool.
    pub fn new(spec: SandboxSpec, cfg: PoolConfig) -> Result<Self, RuntimeError> {
        cfg.validate().map_err(RuntimeError::Invalid)?;
        Ok(Self {
            spec,
            cfg,
            ready: Mutex::new(VecDeque::new()),
            stats: Mutex::new(PoolStats::default()),
        })
    }

    /// The sizing.
    pub fn config(&self) -> PoolConfig {
        self.cfg
    }

    /// Counters.
    pub fn stats(&self) -> PoolStats {
        let mut s = self.stats.lock().map(|s| *s).unwrap_or_default();
        s.ready = self.len();
        s
    }

    /// Ready sandboxes now.
    pub fn len(&self) -> usize {
        self.ready.lock().map(|r| r.len()).unwrap_or(0)
    }

    /// Whether no sandbox is ready.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the pool is below its refill watermark.
    pub fn needs_refill(&self) -> bool {
        self.len() < self.cfg.low_watermark.max(self.cfg.min)
    }

    fn bump(&self, f: impl FnOnce(&mut PoolStats)) {
        if let Ok(mut s) = self.stats.lock() {
            f(&mut s);
        }
    }

    /// Takes a ready sandbox from the pool (marked acquired), if there is one.
    pub fn try_acquire(&self) -> Option<Sandbox> {
        let mut sb = self.ready.lock().ok()?.pop_front()?;
        match sb.mark_acquired() {
            Ok(()) => {
                self.bump(|s| s.hits += 1);
                Some(sb)
            }
            Err(_) => None,
        }
    }

    /// Takes a ready sandbox, or creates one on demand when the pool is empty. Returns whether
    /// it was a pool hit.
    pub fn acquire(&self, rt: &ContainerRuntime) -> Result<(Sandbox, bool), RuntimeError> {
        if let Some(sb) = self.try_acquire() {
            return Ok((sb, true));
        }
        self.bump(|s| s.misses += 1);
        let (mut sb, _) = rt.create(&self.spec)?;
        sb.mark_acquired()?;
        Ok((sb, false))
    }

    /// Returns a sandbox: reset and kept when there is room and its reuse limits allow, else
    /// destroyed.
    pub fn release(&self, rt: &ContainerRuntime, mut sb: Sandbox) -> Result<(), RuntimeError> {
        let full = self.len() >= self.cfg.max;
        if full || sb.needs_recycle() {
            if !full {
                self.bump(|s| s.recycled += 1);
            }
            return sb.destroy(rt);
        }
        match sb.reset() {
            Ok(()) => {
                if let Ok(mut r) = self.ready.lock() {
                    r.push_back(sb);
                }
                Ok(())
            }
            Err(e) => {
                let _ = sb.destroy(rt);
                Err(e)
            }
        }
    }

    /// Creates sandboxes until the pool holds its target; returns how many were created.
    pub fn refill(&self, rt: &ContainerRuntime) -> Result<usize, RuntimeError> {
        let mut created = 0;
        while self.len() < self.cfg.target {
            let (sb, _) = rt.create(&self.spec)?;
            match self.ready.lock() {
                Ok(mut r) => r.push_back(sb),
                Err(_) => return sb.destroy(rt).map(|()| created),
            }
            created += 1;
        }
        Ok(created)
    }

    /// Destroys every ready sandbox.
    pub fn drain(&self, rt: &ContainerRuntime) -> Result<(), RuntimeError> {
        let all: Vec<Sandbox> = match self.ready.lock() {
            Ok(mut r) => r.drain(..).collect(),
            Err(_) => Vec::new(),
        };
        let mut first_err = None;
        for sb in all {
            if let Err(e) = sb.destroy(rt) {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}
