//! Integration tests of warm pools over the real container runtime: refill, hits and misses,
//! release resets (fresh /tmp) and returns, reuse limits recycle, release into a full pool
//! destroys, drain destroys everything. Run as root, never skipped.
//!
//! Every test holds [`SERIAL`] and compares the [`LeakSnapshot`] taken at its start with the one
//! at its end. Pools are wrapped in [`PoolGuard`] (drained on drop) and acquired sandboxes in
//! [`Held`] (destroyed on drop), so a failed assertion leaves nothing behind.

mod common;

use std::collections::BTreeSet;
use std::ops::{Deref, DerefMut};
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use common::{fixture, rt, stdout, LeakSnapshot};
use dsec_api::exec::{ExecRequest, ExecResult, ExecStatus};
use dsec_api::ErrorCode;
use dsec_node::pool::{Pool, PoolConfig, PoolStats};
use dsec_node::sandbox::{SandboxSpec, State};
use dsec_node::substrate::{RuntimeError, Sandbox};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

const SETTLE: Duration = Duration::from_secs(10);

/// A pool that is drained when dropped.
struct PoolGuard(Pool);

impl Deref for PoolGuard {
    type Target = Pool;
    fn deref(&self) -> &Pool {
        &self.0
    }
}

impl Drop for PoolGuard {
    fn drop(&mut self) {
        if let Err(e) = self.0.drain(rt()) {
            if !std::thread::panicking() {
                eprintln!("drain in guard failed: {e:?}");
            }
        }
    }
}

fn pool(spec: SandboxSpec, cfg: PoolConfig) -> PoolGuard {
    PoolGuard(Pool::new(spec, cfg).expect("valid pool config"))
}

/// An acquired sandbox; destroyed when dropped unless handed back with [`Held::take`].
struct Held(Option<Sandbox>);

impl Held {
    fn take(mut self) -> Sandbox {
        self.0.take().expect("sandbox present")
    }

    fn sh(&mut self, script: &str) -> ExecResult {
        let mut req = ExecRequest::shell(script);
        req.timeout_ms = Some(10_000);
        let id = self.id().to_owned();
        self.exec(rt(), &req, b"", |_, _| {})
            .unwrap_or_else(|e| panic!("exec in {id}: {e:?}"))
    }
}

impl Deref for Held {
    type Target = Sandbox;
    fn deref(&self) -> &Sandbox {
        self.0.as_ref().expect("sandbox present")
    }
}

impl DerefMut for Held {
    fn deref_mut(&mut self) -> &mut Sandbox {
        self.0.as_mut().expect("sandbox present")
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(sb) = self.0.take() {
            let _ = sb.destroy(rt());
        }
    }
}

fn try_acquire(p: &Pool) -> Option<Held> {
    p.try_acquire().map(|sb| Held(Some(sb)))
}

fn acquire(p: &Pool) -> (Held, bool) {
    let (sb, hit) = p.acquire(rt()).expect("acquire");
    (Held(Some(sb)), hit)
}

fn release(p: &Pool, h: Held) {
    p.release(rt(), h.take()).expect("release");
}

fn sandbox_run_dir(id: &str) -> PathBuf {
    fixture().run_dir.join("sandboxes").join(id)
}

/// Whether nothing of sandbox `id` is left on the machine (cgroup and runtime dir).
fn is_gone(id: &str) -> bool {
    rt().cgroups().open(id).is_none() && !sandbox_run_dir(id).exists()
}

fn is_alive(id: &str) -> bool {
    rt().cgroups().open(id).is_some() && sandbox_run_dir(id).exists()
}

/// Checks that an acquired sandbox is `Running` and runs commands.
fn check_usable(h: &mut Held) {
    assert_eq!(h.state(), State::Running, "acquired sandbox {}", h.id());
    let r = h.sh("echo pooled-$((20 + 22))");
    assert_eq!(r.status, ExecStatus::Ok, "exec in {}: {r:?}", h.id());
    assert_eq!(stdout(&r), "pooled-42\n");
}

fn cfg(min: usize, low_watermark: usize, target: usize, max: usize) -> PoolConfig {
    PoolConfig {
        min,
        max,
        target,
        low_watermark,
    }
}

#[test]
fn pool_config_validate_rejects_inconsistent_sizes() {
    assert!(cfg(0, 0, 0, 0).validate().is_ok());
    assert!(cfg(1, 1, 2, 3).validate().is_ok());
    assert!(cfg(2, 2, 2, 2).validate().is_ok());
    assert!(cfg(3, 1, 2, 4).validate().is_err(), "min > target");
    assert!(
        cfg(0, 3, 2, 4).validate().is_err(),
        "low_watermark > target"
    );
    assert!(cfg(0, 1, 5, 4).validate().is_err(), "target > max");
    assert!(cfg(5, 5, 5, 4).validate().is_err(), "everything > max");
    let err = Pool::new(SandboxSpec::default(), cfg(3, 1, 2, 4)).expect_err("min > target");
    assert!(matches!(err, RuntimeError::Invalid(_)), "{err:?}");
    assert_eq!(err.code(), ErrorCode::InvalidRequest);
    let p = Pool::new(SandboxSpec::default(), cfg(1, 1, 2, 3)).expect("valid");
    assert_eq!(p.config(), cfg(1, 1, 2, 3));
    assert!(p.is_empty());
    assert!(p.needs_refill(), "an empty pool with min 1 needs a refill");
    assert_eq!(
        p.stats(),
        PoolStats::default(),
        "a new pool has no counters"
    );
}

#[test]
fn pool_refill_hit_miss_release_reset_full_and_drain() {
    let _serial = serial();
    let base = LeakSnapshot::take();
    let p = pool(SandboxSpec::default(), cfg(1, 1, 2, 3));

    // refill brings the pool to its target, and only to it.
    assert_eq!(p.refill(rt()).expect("refill"), 2);
    assert_eq!(p.len(), 2);
    assert_eq!(
        p.refill(rt()).expect("refill again"),
        0,
        "already at target"
    );
    let s = p.stats();
    assert_eq!((s.ready, s.hits, s.misses, s.recycled), (2, 0, 0, 0));
    assert!(!p.needs_refill());

    // Hits.
    let mut a = try_acquire(&p).expect("first hit");
    check_usable(&mut a);
    let mut b = try_acquire(&p).expect("second hit");
    check_usable(&mut b);
    assert_ne!(a.id(), b.id());
    assert!(p.is_empty());
    assert!(p.needs_refill());
    assert!(try_acquire(&p).is_none(), "nothing left to take");
    let s = p.stats();
    assert_eq!((s.ready, s.hits, s.misses), (0, 2, 0), "{s:?}");

    // A miss creates on demand.
    let (mut c, hit) = acquire(&p);
    assert!(!hit);
    check_usable(&mut c);
    let s = p.stats();
    assert_eq!((s.hits, s.misses), (2, 1), "{s:?}");

    // Release resets: what `a` wrote to /tmp is gone when it is acquired again.
    let r = a.sh("echo secret > /tmp/left-behind && cat /tmp/left-behind");
    assert_eq!(stdout(&r), "secret\n", "{r:?}");
    let a_id = a.id().to_owned();
    let b_id = b.id().to_owned();
    let c_id = c.id().to_owned();
    release(&p, a);
    assert_eq!(p.len(), 1);
    assert!(is_alive(&a_id), "a released sandbox is kept, not destroyed");
    let mut a = try_acquire(&p).expect("the released sandbox is ready again");
    assert_eq!(
        a.id(),
        a_id,
        "the pool hands back the sandbox that was released"
    );
    check_usable(&mut a);
    let r = a.sh("test -e /tmp/left-behind && echo present || echo absent");
    assert_eq!(stdout(&r), "absent\n", "reset must drop /tmp: {r:?}");
    assert_eq!(p.stats().hits, 3);

    // Release all three: the pool fills up to max.
    release(&p, a);
    release(&p, b);
    release(&p, c);
    assert_eq!(p.len(), 3);
    let ids: BTreeSet<String> = [a_id, b_id, c_id].into_iter().collect();

    // Releasing into a full pool destroys (it is not a recycle).
    let (mut extra, _) = rt().create(&SandboxSpec::default()).expect("create extra");
    extra.mark_acquired().expect("mark acquired");
    let extra_id = extra.id().to_owned();
    assert!(is_alive(&extra_id));
    p.release(rt(), extra).expect("release into a full pool");
    assert_eq!(p.len(), 3, "a full pool does not grow beyond max");
    assert!(is_gone(&extra_id), "released into a full pool: destroyed");
    assert_eq!(p.stats().recycled, 0);
    for id in &ids {
        assert!(is_alive(id), "{id} is still pooled");
    }

    // Drain destroys everything.
    p.drain(rt()).expect("drain");
    assert!(p.is_empty());
    assert_eq!(p.stats().ready, 0);
    for id in &ids {
        assert!(is_gone(id), "{id} survived the drain");
    }
    drop(p);
    LeakSnapshot::assert_back_to(&base, SETTLE);
}

#[test]
fn pool_max_uses_recycles_after_the_last_use() {
    let _serial = serial();
    let base = LeakSnapshot::take();
    let spec = SandboxSpec {
        max_uses: 2,
        ..SandboxSpec::default()
    };
    let p = pool(spec, cfg(0, 0, 1, 2));
    assert_eq!(p.refill(rt()).expect("refill"), 1);

    // First use: reset and returned.
    let mut h = try_acquire(&p).expect("hit");
    check_usable(&mut h);
    let id = h.id().to_owned();
    assert!(!h.needs_recycle(), "one use of two");
    release(&p, h);
    assert_eq!(p.len(), 1);
    assert_eq!(p.stats().recycled, 0);

    // Second (last) use: destroyed, not returned.
    let mut h = try_acquire(&p).expect("hit again");
    assert_eq!(h.id(), id);
    check_usable(&mut h);
    assert!(h.needs_recycle(), "two uses of two");
    release(&p, h);
    assert_eq!(p.len(), 0, "a used-up sandbox is not returned");
    let s = p.stats();
    assert_eq!((s.hits, s.misses, s.recycled), (2, 0, 1), "{s:?}");
    assert!(
        is_gone(&id),
        "recycled sandbox {id} left its cgroup or run dir"
    );

    // A refill replaces it with a new one.
    assert_eq!(p.refill(rt()).expect("refill"), 1);
    let mut h = try_acquire(&p).expect("hit after refill");
    assert_ne!(h.id(), id);
    check_usable(&mut h);
    release(&p, h);
    drop(p);
    LeakSnapshot::assert_back_to(&base, SETTLE);
}

/// `max_busy_ms` is a limit on cumulative *acquired* time: a sandbox that was held longer than
/// that on its very first use must be recycled when it is released, not reset and reused.
#[test]
fn pool_max_busy_ms_counts_the_current_use() {
    let _serial = serial();
    let base = LeakSnapshot::take();
    let spec = SandboxSpec {
        max_busy_ms: 100,
        ..SandboxSpec::default()
    };
    let p = pool(spec, cfg(0, 0, 1, 2));
    assert_eq!(p.refill(rt()).expect("refill"), 1);
    let mut h = try_acquire(&p).expect("hit");
    check_usable(&mut h);
    let id = h.id().to_owned();
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        h.needs_recycle(),
        "held for 300 ms with max_busy_ms = 100, but needs_recycle() is false"
    );
    release(&p, h);
    assert_eq!(p.len(), 0, "an over-busy sandbox must not be returned");
    assert_eq!(p.stats().recycled, 1);
    assert!(is_gone(&id));
    drop(p);
    LeakSnapshot::assert_back_to(&base, SETTLE);
}
