//! Warm-pool sizing: how many ready sandboxes one template's pool should hold, and what to create
//! or destroy now to get there.
//!
//! The policy is pure and clock-free: every call takes the current [`Instant`] (or a measured
//! [`Duration`]), so it is tested with simulated time and owned by whichever task drives the pool.
//!
//! # The model
//!
//! * **Acquire rate** — an exponentially weighted moving average of acquires per second, with a
//!   configurable half-life ([`AutoscaleConfig::rate_halflife`]). It is a continuous-time
//!   estimator: each acquire adds `λ = ln 2 / half-life` and the value decays by `e^(-λ·Δt)`, so
//!   a steady rate of `r` acquires/s reads `r`, and an idle pool's rate decays smoothly to zero.
//! * **Refill time** — the time to create one pooled sandbox: an EWMA (weight
//!   [`REFILL_EWMA_WEIGHT`] per sample) of the durations passed to [`Autoscaler::record_refill`],
//!   starting at [`AutoscaleConfig::initial_refill`].
//! * **Burst** — the number of acquires within the last refill time (capped at `max`). This is
//!   the "concurrent demand" the pool has to absorb: acquires that arrive faster than a
//!   replacement can be created must all be served from sandboxes that are already ready. It
//!   reacts instantly, whereas the rate average lags a burst by design.
//! * **Peak** — the largest burst seen within the last [`AutoscaleConfig::shrink_after`].
//! * **Demand** at an instant —
//!   `max(rate × refill, peak_factor × burst)`, rounded up (fractions below
//!   [`DEMAND_ROUNDING_SLACK`] are dropped so a decayed rate does reach zero), clamped to
//!   `[min, max]`. Under steady load the burst equals `rate × refill`, so the target settles at
//!   `peak_factor × rate × refill`.
//! * **Target** — the running maximum of demand over the last `shrink_after` (demand is sampled
//!   on every call). It rises as soon as demand does (grow fast). It only falls once demand has
//!   stayed below it for a whole `shrink_after` window (5 minutes by default), and then by
//!   halving the excess over that window's maximum once per
//!   [`AutoscaleConfig::shrink_interval`] (shrink gradually). Because it never falls below the
//!   window's maximum demand, the target is always at least `peak_factor ×` the recent peak, and
//!   always within `[min, max]`.
//! * **Plan** — when fewer than `ceil(low_watermark × target)` sandboxes are ready, create enough
//!   to bring ready plus in-flight creations up to the target (never past it, so never past
//!   `max`); when more than the target are ready, destroy the excess (never below the target, so
//!   never below `min`). Creations in flight are not counted as excess: a destroy never races a
//!   create that may still fail.
//!
//! Time is taken to be monotonic: an `Instant` earlier than one already seen is treated as the
//! latest one seen.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Weight of each new refill measurement in the refill-time EWMA.
pub const REFILL_EWMA_WEIGHT: f64 = 0.2;

/// Demand is `ceil(x - DEMAND_ROUNDING_SLACK)`: a fraction of a sandbox below this is not worth
/// keeping warm (and `6.000000001` from float arithmetic means 6).
pub const DEMAND_ROUNDING_SLACK: f64 = 0.05;

/// Refill measurements shorter than this count as this long (the burst window is never empty).
pub const MIN_REFILL: Duration = Duration::from_millis(1);

/// The sizing policy of one template's pool.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AutoscaleConfig {
    /// Never plan fewer ready sandboxes than this.
    pub min: usize,
    /// Never plan more ready plus creating sandboxes than this.
    pub max: usize,
    /// How long demand must stay below the target before the target starts to fall; also the
    /// window of the recent peak. Default 5 minutes.
    pub shrink_after: Duration,
    /// Once shrinking, the target halves its excess over demand at most once per interval.
    /// Default 30 seconds.
    pub shrink_interval: Duration,
    /// The target is at least this times the recent peak burst. At least 1. Default 1.2.
    pub peak_factor: f64,
    /// Half-life of the acquire-rate average. Default 60 seconds.
    pub rate_halflife: Duration,
    /// Refill when fewer than `ceil(low_watermark × target)` sandboxes are ready; in (0, 1].
    /// 1 tops up after every acquire; lower values batch creations. Default 0.5.
    pub low_watermark: f64,
    /// The refill-time estimate before the first measurement. Default 1 second.
    pub initial_refill: Duration,
}

impl AutoscaleConfig {
    /// The given bounds with the default policy.
    pub fn new(min: usize, max: usize) -> Self {
        Self {
            min,
            max,
            shrink_after: Duration::from_secs(300),
            shrink_interval: Duration::from_secs(30),
            peak_factor: 1.2,
            rate_halflife: Duration::from_secs(60),
            low_watermark: 0.5,
            initial_refill: Duration::from_secs(1),
        }
    }

    /// Checks `min <= max`, `peak_factor >= 1`, `0 < low_watermark <= 1` and that every duration
    /// is positive.
    pub fn validate(&self) -> Result<(), AutoscaleConfigError> {
        if self.min > self.max {
            return Err(AutoscaleConfigError::Bounds {
                min: self.min,
                max: self.max,
            });
        }
        if !(self.peak_factor.is_finite() && self.peak_factor >= 1.0) {
            return Err(AutoscaleConfigError::PeakFactor(self.peak_factor));
        }
        if !(self.low_watermark > 0.0 && self.low_watermark <= 1.0) {
            return Err(AutoscaleConfigError::LowWatermark(self.low_watermark));
        }
        for (field, d) in [
            ("shrink_after", self.shrink_after),
            ("shrink_interval", self.shrink_interval),
            ("rate_halflife", self.rate_halflife),
            ("initial_refill", self.initial_refill),
        ] {
            if d.is_zero() {
                return Err(AutoscaleConfigError::ZeroDuration { field });
            }
        }
        Ok(())
    }
}

/// Why an [`AutoscaleConfig`] is invalid.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AutoscaleConfigError {
    /// `min > max`.
    #[error("pool bounds must satisfy min <= max (min {min}, max {max})")]
    Bounds {
        /// The configured minimum.
        min: usize,
        /// The configured maximum.
        max: usize,
    },
    /// `peak_factor` is not a finite number of at least 1.
    #[error("peak_factor must be a finite number of at least 1, got {0}")]
    PeakFactor(f64),
    /// `low_watermark` is not in (0, 1].
    #[error("low_watermark must be in (0, 1], got {0}")]
    LowWatermark(f64),
    /// A duration is zero.
    #[error("{field} must be longer than zero")]
    ZeroDuration {
        /// The config field.
        field: &'static str,
    },
}

/// What a pool should do now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Plan {
    /// Sandboxes to start creating.
    pub create: usize,
    /// Ready sandboxes to destroy.
    pub destroy: usize,
}

/// A snapshot of an [`Autoscaler`], for `/metrics` and the pool API.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct AutoscaleStats {
    /// The configured minimum.
    pub min: usize,
    /// The configured maximum.
    pub max: usize,
    /// The target as of the last [`Autoscaler::target`] or [`Autoscaler::plan`] call.
    pub target: usize,
    /// The acquire-rate average, per second.
    pub acquire_rate_per_s: f64,
    /// The refill-time average, in milliseconds.
    pub refill_ms: f64,
    /// The largest number of acquires within one refill time seen in the last `shrink_after`.
    pub peak: usize,
    /// Acquires served from the pool.
    pub hits: u64,
    /// Acquires that had to create on demand.
    pub misses: u64,
    /// `hits / (hits + misses)`, 0 before the first acquire.
    pub hit_rate: f64,
}

/// The running maximum of values sampled over a trailing time window.
///
/// A monotonic queue: samples are in time order with strictly decreasing values, so the front is
/// the maximum and the length is bounded by the number of distinct values (here `max + 1`).
#[derive(Debug)]
struct WindowMax {
    samples: VecDeque<(Instant, usize)>,
    window: Duration,
}

impl WindowMax {
    fn new(window: Duration) -> Self {
        Self {
            samples: VecDeque::new(),
            window,
        }
    }

    fn push(&mut self, now: Instant, value: usize) {
        while self
            .samples
            .front()
            .is_some_and(|&(t, _)| now.saturating_duration_since(t) >= self.window)
        {
            self.samples.pop_front();
        }
        while self.samples.back().is_some_and(|&(_, v)| v <= value) {
            self.samples.pop_back();
        }
        self.samples.push_back((now, value));
    }

    /// The maximum of the samples still inside the window at `now`, if any.
    fn max_at(&self, now: Instant) -> Option<usize> {
        self.samples
            .iter()
            .find(|&&(t, _)| now.saturating_duration_since(t) < self.window)
            .map(|&(_, v)| v)
    }
}

/// The sizing state of one template's pool. See the [module docs](self) for the model.
#[derive(Debug)]
pub struct Autoscaler {
    cfg: AutoscaleConfig,
    /// The latest instant seen; earlier ones are clamped to it.
    latest: Instant,
    /// `ln 2 / rate_halflife`, per second.
    lambda: f64,
    /// The acquire rate as of `rate_at`.
    rate: f64,
    rate_at: Instant,
    /// The refill-time average, in seconds (at least `MIN_REFILL`).
    refill_s: f64,
    /// Acquire instants within the last refill time, oldest first, at most `max` of them.
    burst: VecDeque<Instant>,
    /// Demand samples over the last `shrink_after`.
    demand: WindowMax,
    /// Burst samples over the last `shrink_after`.
    peak: WindowMax,
    target: usize,
    /// When the target last rose or stepped down.
    last_change: Instant,
    hits: u64,
    misses: u64,
}

impl Autoscaler {
    /// A pool policy starting at `min` with no demand seen. Fails when `cfg` is invalid.
    pub fn new(cfg: AutoscaleConfig, now: Instant) -> Result<Self, AutoscaleConfigError> {
        cfg.validate()?;
        Ok(Self {
            cfg,
            latest: now,
            lambda: std::f64::consts::LN_2 / cfg.rate_halflife.as_secs_f64(),
            rate: 0.0,
            rate_at: now,
            refill_s: cfg.initial_refill.max(MIN_REFILL).as_secs_f64(),
            burst: VecDeque::new(),
            demand: WindowMax::new(cfg.shrink_after),
            peak: WindowMax::new(cfg.shrink_after),
            target: cfg.min,
            last_change: now,
            hits: 0,
            misses: 0,
        })
    }

    /// The policy.
    pub fn config(&self) -> &AutoscaleConfig {
        &self.cfg
    }

    /// One acquire happened at `now`; `hit` when it was served from the pool.
    pub fn record_acquire(&mut self, now: Instant, hit: bool) {
        let now = self.clock(now);
        if hit {
            self.hits += 1;
        } else {
            self.misses += 1;
        }
        self.rate = self.rate_at(now) + self.lambda;
        self.rate_at = now;
        self.burst.push_back(now);
        if self.burst.len() > self.cfg.max {
            // Beyond `max` the count no longer changes the (clamped) demand.
            self.burst.pop_front();
        }
        self.sample(now);
    }

    /// One pooled create finished and took `took`.
    pub fn record_refill(&mut self, took: Duration) {
        let took = took.max(MIN_REFILL).as_secs_f64();
        self.refill_s += REFILL_EWMA_WEIGHT * (took - self.refill_s);
    }

    /// The number of ready sandboxes the pool should hold now.
    pub fn target(&mut self, now: Instant) -> usize {
        let now = self.clock(now);
        self.sample(now);
        let window_max = self.demand.max_at(now).unwrap_or(self.cfg.min);
        if window_max > self.target {
            self.target = window_max;
            self.last_change = now;
        } else if window_max < self.target
            && now.saturating_duration_since(self.last_change) >= self.cfg.shrink_interval
        {
            self.target = window_max + (self.target - window_max) / 2;
            self.last_change = now;
        }
        self.target
    }

    /// What to do now, given `ready` idle pooled sandboxes and `creating` pooled creations in
    /// flight. Never plans past `max` in total, never destroys below `min`, and never both
    /// creates and destroys.
    pub fn plan(&mut self, now: Instant, ready: usize, creating: usize) -> Plan {
        let target = self.target(now);
        let low = if target == 0 {
            0
        } else {
            // The slack keeps `0.7 × 10 = 7.000000000000001` at 7.
            round_up(self.cfg.low_watermark * target as f64 - 1e-9).clamp(1, target)
        };
        let create = if ready < low {
            target.saturating_sub(ready.saturating_add(creating))
        } else {
            0
        };
        Plan {
            create,
            destroy: ready.saturating_sub(target),
        }
    }

    /// A snapshot at `now` (the target is the one last computed; this does not advance it).
    pub fn stats(&self, now: Instant) -> AutoscaleStats {
        let now = now.max(self.latest);
        let burst = self.burst_at(now);
        let peak = self.peak.max_at(now).unwrap_or(0).max(burst);
        let acquires = self.hits + self.misses;
        AutoscaleStats {
            min: self.cfg.min,
            max: self.cfg.max,
            target: self.target,
            acquire_rate_per_s: self.rate_at(now),
            refill_ms: self.refill_s * 1000.0,
            peak,
            hits: self.hits,
            misses: self.misses,
            hit_rate: if acquires == 0 {
                0.0
            } else {
                self.hits as f64 / acquires as f64
            },
        }
    }

    fn clock(&mut self, now: Instant) -> Instant {
        self.latest = self.latest.max(now);
        self.latest
    }

    fn rate_at(&self, now: Instant) -> f64 {
        let dt = now.saturating_duration_since(self.rate_at).as_secs_f64();
        self.rate * (-self.lambda * dt).exp()
    }

    fn refill_window(&self) -> Duration {
        Duration::try_from_secs_f64(self.refill_s).unwrap_or(Duration::MAX)
    }

    fn burst_at(&self, now: Instant) -> usize {
        let window = self.refill_window();
        self.burst
            .iter()
            .rev()
            .take_while(|&&t| now.saturating_duration_since(t) < window)
            .count()
    }

    /// Drops expired acquires and records the burst and the demand at `now`.
    fn sample(&mut self, now: Instant) {
        let window = self.refill_window();
        while self
            .burst
            .front()
            .is_some_and(|&t| now.saturating_duration_since(t) >= window)
        {
            self.burst.pop_front();
        }
        let burst = self.burst.len();
        let need = (self.rate_at(now) * self.refill_s).max(self.cfg.peak_factor * burst as f64);
        let demand = round_up(need - DEMAND_ROUNDING_SLACK).clamp(self.cfg.min, self.cfg.max);
        self.peak.push(now, burst);
        self.demand.push(now, demand);
    }
}

/// `ceil(x)` as a count; negative and NaN give 0, huge values saturate.
fn round_up(x: f64) -> usize {
    // `as` from f64 saturates and maps NaN to 0, which is what a count wants.
    x.ceil() as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    fn want(create: usize, destroy: usize) -> Plan {
        Plan { create, destroy }
    }

    fn cfg(min: usize, max: usize) -> AutoscaleConfig {
        AutoscaleConfig {
            initial_refill: secs(2.0),
            ..AutoscaleConfig::new(min, max)
        }
    }

    fn scaler(cfg: AutoscaleConfig, t0: Instant) -> Autoscaler {
        Autoscaler::new(cfg, t0).expect("valid config")
    }

    /// `n` pool misses at `at`.
    fn burst(a: &mut Autoscaler, at: Instant, n: usize) {
        for _ in 0..n {
            a.record_acquire(at, false);
        }
    }

    /// A scaler started now, and the instant it started at.
    fn started(cfg: AutoscaleConfig) -> (Autoscaler, Instant) {
        let t0 = Instant::now();
        (scaler(cfg, t0), t0)
    }

    /// Acquires every `every` from `from` (inclusive) until `to` (exclusive), planning after each.
    fn steady(a: &mut Autoscaler, from: Instant, to: Instant, every: Duration) -> Instant {
        let mut t = from;
        while t < to {
            a.record_acquire(t, true);
            a.plan(t, 0, 0);
            t += every;
        }
        t
    }

    #[test]
    fn default_config_is_valid() {
        assert_eq!(AutoscaleConfig::new(0, 10).validate(), Ok(()));
        assert_eq!(AutoscaleConfig::new(0, 0).validate(), Ok(()));
    }

    #[test]
    fn validate_rejects_bad_configs() {
        let ok = AutoscaleConfig::new(2, 8);
        let bad = [
            (
                AutoscaleConfig { min: 9, ..ok },
                AutoscaleConfigError::Bounds { min: 9, max: 8 },
            ),
            (
                AutoscaleConfig {
                    peak_factor: 0.9,
                    ..ok
                },
                AutoscaleConfigError::PeakFactor(0.9),
            ),
            (
                AutoscaleConfig {
                    peak_factor: f64::INFINITY,
                    ..ok
                },
                AutoscaleConfigError::PeakFactor(f64::INFINITY),
            ),
            (
                AutoscaleConfig {
                    low_watermark: 0.0,
                    ..ok
                },
                AutoscaleConfigError::LowWatermark(0.0),
            ),
            (
                AutoscaleConfig {
                    low_watermark: 1.5,
                    ..ok
                },
                AutoscaleConfigError::LowWatermark(1.5),
            ),
            (
                AutoscaleConfig {
                    shrink_after: Duration::ZERO,
                    ..ok
                },
                AutoscaleConfigError::ZeroDuration {
                    field: "shrink_after",
                },
            ),
            (
                AutoscaleConfig {
                    rate_halflife: Duration::ZERO,
                    ..ok
                },
                AutoscaleConfigError::ZeroDuration {
                    field: "rate_halflife",
                },
            ),
        ];
        for (c, want) in bad {
            assert_eq!(c.validate(), Err(want.clone()), "{c:?}");
            assert_eq!(Autoscaler::new(c, Instant::now()).err(), Some(want));
        }
        let nan = AutoscaleConfig {
            low_watermark: f64::NAN,
            ..ok
        };
        assert!(matches!(
            nan.validate(),
            Err(AutoscaleConfigError::LowWatermark(_))
        ));
    }

    #[test]
    fn starts_at_min_and_fills_it() {
        let (mut a, t0) = started(cfg(3, 10));
        assert_eq!(a.target(t0), 3);
        assert_eq!(a.plan(t0, 0, 0), want(3, 0));
    }

    #[test]
    fn steady_demand_converges_to_peak_factor_times_rate_times_refill() {
        // 10 acquires/s, 2 s to create one: 20 acquires per refill time, 24 with the 1.2 floor.
        let (mut a, t0) = started(cfg(0, 100));
        let t = steady(&mut a, t0, t0 + secs(600.0), secs(0.1));
        assert_eq!(a.target(t), 24);
        let s = a.stats(t);
        assert!((s.acquire_rate_per_s - 10.0).abs() < 0.1, "{s:?}");
        assert_eq!(s.refill_ms, 2000.0);
        assert_eq!(s.peak, 20);
    }

    #[test]
    fn steady_demand_without_headroom_converges_to_rate_times_refill() {
        let (mut a, t0) = started(AutoscaleConfig {
            peak_factor: 1.0,
            ..cfg(0, 100)
        });
        let t = steady(&mut a, t0, t0 + secs(600.0), secs(0.1));
        assert_eq!(a.target(t), 20);
    }

    #[test]
    fn target_follows_measured_refill_time() {
        let (mut a, t0) = started(cfg(0, 100));
        let t = steady(&mut a, t0, t0 + secs(60.0), secs(0.1));
        assert_eq!(a.target(t), 24);
        // Creates get slower: 4 s each. The EWMA converges; the target grows at once.
        for _ in 0..100 {
            a.record_refill(secs(4.0));
        }
        assert!((a.stats(t).refill_ms - 4000.0).abs() < 0.01);
        let t = steady(&mut a, t, t + secs(600.0), secs(0.1));
        assert_eq!(a.target(t), 48);
    }

    #[test]
    fn refill_ewma_weights_new_samples() {
        let (mut a, t0) = started(cfg(0, 10));
        a.record_refill(secs(3.0));
        // 2 + 0.2 × (3 - 2)
        assert!((a.stats(t0).refill_ms - 2200.0).abs() < 1e-6);
        a.record_refill(Duration::ZERO);
        let floor = MIN_REFILL.as_secs_f64() * 1000.0;
        assert!((a.stats(t0).refill_ms - (2200.0 + 0.2 * (floor - 2200.0))).abs() < 1e-6);
    }

    #[test]
    fn burst_raises_target_at_once_then_holds_then_steps_down() {
        let (mut a, t0) = started(cfg(0, 100));
        let burst_at = t0 + secs(1.0);
        burst(&mut a, burst_at, 50);
        // Grow fast: 1.2 × 50 as soon as the burst is seen.
        assert_eq!(a.target(burst_at), 60);
        assert_eq!(a.plan(burst_at, 0, 0), want(60, 0));
        assert_eq!(a.stats(burst_at).peak, 50);

        // Hold for five minutes after the burst.
        for k in 1..30 {
            assert_eq!(a.target(burst_at + secs(10.0 * k as f64)), 60, "at {k}0 s");
        }
        assert_eq!(a.target(burst_at + secs(299.999)), 60);

        // Then step down: never up, halving at most once per shrink interval, down to min.
        let mut prev = 60;
        let mut last_drop: Option<Instant> = None;
        let mut first_drop = None;
        let mut t = burst_at + secs(300.0);
        while t < burst_at + secs(1800.0) {
            let now = a.target(t);
            assert!(now <= prev, "grew from {prev} to {now}");
            if now < prev {
                assert!(now >= prev / 2, "fell from {prev} to {now} in one step");
                if let Some(d) = last_drop {
                    assert!(t - d >= secs(30.0));
                }
                last_drop = Some(t);
                first_drop.get_or_insert((t - burst_at, now));
            }
            prev = now;
            t += secs(5.0);
        }
        assert_eq!(prev, 0);
        // The first step comes right at five minutes and halves the excess over the demand left.
        let (when, first) = first_drop.expect("the target fell");
        assert_eq!(when, secs(300.0));
        assert!((30..=31).contains(&first), "{first}");
        assert_eq!(a.stats(t).peak, 0);
    }

    #[test]
    fn demand_inside_the_window_delays_the_shrink() {
        let (mut a, t0) = started(cfg(0, 100));
        burst(&mut a, t0, 50);
        assert_eq!(a.target(t0), 60);
        // A smaller burst 4 minutes later: still below the target, but the next five minutes
        // must keep the target at least 1.2 × 30.
        let second = t0 + secs(240.0);
        burst(&mut a, second, 30);
        assert_eq!(a.target(second), 60);
        let mut t = second;
        while t < second + secs(299.0) {
            t += secs(1.0);
            assert!(a.target(t) >= 36, "at {:?}", t - second);
        }
        assert!(a.target(second + secs(900.0)) < 36);
    }

    #[test]
    fn renewed_demand_grows_at_once_while_shrinking() {
        let (mut a, t0) = started(cfg(0, 100));
        burst(&mut a, t0, 50);
        a.target(t0);
        let t = t0 + secs(400.0);
        assert!(a.target(t) < 60);
        burst(&mut a, t, 70);
        assert_eq!(a.target(t), 84);
    }

    #[test]
    fn target_stays_within_bounds() {
        let (mut a, t0) = started(cfg(3, 10));
        burst(&mut a, t0, 1000);
        assert_eq!(a.target(t0), 10);
        assert_eq!(a.plan(t0, 2, 3), want(5, 0));
        let mut t = t0;
        for _ in 0..720 {
            t += secs(5.0);
            let target = a.target(t);
            assert!((3..=10).contains(&target), "{target}");
        }
        assert_eq!(a.target(t), 3);
        assert_eq!(a.plan(t, 10, 0), want(0, 7));
    }

    #[test]
    fn plan_counts_creations_in_flight() {
        let (mut a, t0) = started(cfg(0, 100));
        burst(&mut a, t0, 20);
        assert_eq!(a.target(t0), 24);
        let plan = |a: &mut Autoscaler, ready, creating| a.plan(t0, ready, creating);
        assert_eq!(plan(&mut a, 0, 0).create, 24);
        assert_eq!(plan(&mut a, 0, 24).create, 0);
        assert_eq!(plan(&mut a, 0, 30).create, 0);
        assert_eq!(plan(&mut a, 5, 10).create, 9);
        assert_eq!(plan(&mut a, 11, 0).create, 13);
        // At or above the low watermark (12 of 24) nothing is created.
        assert_eq!(plan(&mut a, 12, 0), Plan::default());
        assert_eq!(plan(&mut a, 24, 0), Plan::default());
        // Excess ready sandboxes are destroyed; creations in flight are not counted as excess.
        assert_eq!(plan(&mut a, 30, 5), want(0, 6));
    }

    #[test]
    fn low_watermark_sets_the_top_up_point() {
        // (low watermark, pool min = max, ready, creating, creations planned). A mark of 1.0
        // tops up after every acquire; 0.7 × 10 is 7.000000000000001 in f64, and the mark is 7.
        let cases = [
            (1.0, 4, 3, 0, 1),
            (1.0, 4, 3, 1, 0),
            (1.0, 4, 4, 0, 0),
            (0.7, 10, 7, 0, 0),
            (0.7, 10, 6, 0, 4),
        ];
        for (mark, size, ready, creating, create) in cases {
            let (mut a, t0) = started(AutoscaleConfig {
                low_watermark: mark,
                ..cfg(size, size)
            });
            let case = format!("mark {mark}, size {size}, ready {ready}, creating {creating}");
            assert_eq!(a.plan(t0, ready, creating), want(create, 0), "{case}");
        }
    }

    #[test]
    fn zero_max_plans_nothing() {
        let (mut a, t0) = started(cfg(0, 0));
        burst(&mut a, t0, 10);
        assert_eq!(a.target(t0), 0);
        assert_eq!(a.plan(t0, 0, 0), Plan::default());
        assert_eq!(a.plan(t0, 2, 0), want(0, 2));
    }

    #[test]
    fn time_going_backwards_is_clamped() {
        let t0 = Instant::now();
        let mut a = scaler(cfg(0, 100), t0 + secs(10.0));
        a.record_acquire(t0 + secs(20.0), true);
        a.record_acquire(t0, true);
        assert_eq!(a.target(t0), 3);
        assert_eq!(a.stats(t0).peak, 2);
    }

    #[test]
    fn stats_count_hits_and_misses() {
        let (mut a, t0) = started(cfg(1, 9));
        assert_eq!(a.stats(t0).hit_rate, 0.0);
        a.record_acquire(t0, true);
        a.record_acquire(t0, true);
        a.record_acquire(t0, true);
        a.record_acquire(t0, false);
        a.target(t0);
        let s = a.stats(t0);
        assert_eq!((s.hits, s.misses, s.hit_rate), (3, 1, 0.75));
        assert_eq!((s.min, s.max, s.target, s.peak), (1, 9, 5, 4));
        let json = serde_json::to_value(s).expect("serialize");
        for key in [
            "min",
            "max",
            "target",
            "acquire_rate_per_s",
            "refill_ms",
            "peak",
            "hits",
            "misses",
            "hit_rate",
        ] {
            assert!(json.get(key).is_some(), "{key} in {json}");
        }
    }

    mod props {
        use super::*;
        use proptest::prelude::*;

        #[derive(Debug, Clone)]
        enum Op {
            Acquire {
                after_ms: u64,
                hit: bool,
            },
            Refill {
                took_ms: u64,
            },
            Plan {
                after_ms: u64,
                ready: usize,
                creating: usize,
            },
            Wait {
                after_ms: u64,
            },
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                4 => (0u64..3_000, any::<bool>()).prop_map(|(after_ms, hit)| Op::Acquire { after_ms, hit }),
                1 => (0u64..20_000).prop_map(|took_ms| Op::Refill { took_ms }),
                3 => (0u64..30_000, 0usize..60, 0usize..60)
                    .prop_map(|(after_ms, ready, creating)| Op::Plan { after_ms, ready, creating }),
                1 => (0u64..900_000).prop_map(|after_ms| Op::Wait { after_ms }),
            ]
        }

        fn config() -> impl Strategy<Value = AutoscaleConfig> {
            (
                0usize..10,
                0usize..40,
                1.0f64..3.0,
                0.01f64..=1.0,
                1u64..600,
                1u64..60,
                1u64..300,
                1u64..5_000,
            )
                .prop_map(
                    |(min, extra, peak_factor, low_watermark, after, interval, half, refill)| {
                        AutoscaleConfig {
                            min,
                            max: min + extra,
                            shrink_after: Duration::from_secs(after),
                            shrink_interval: Duration::from_secs(interval),
                            peak_factor,
                            rate_halflife: Duration::from_secs(half),
                            low_watermark,
                            initial_refill: Duration::from_millis(refill),
                        }
                    },
                )
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(512))]

            #[test]
            fn invariants_hold(cfg in config(), ops in proptest::collection::vec(op(), 1..200)) {
                let t0 = Instant::now();
                let mut a = Autoscaler::new(cfg, t0).expect("valid config");
                let mut now = t0;
                let mut acquires = 0u64;
                let mut prev_target = a.target(now);
                let mut last_rise = t0;
                let mut last_change = t0;
                for op in ops {
                    let (ready, creating) = match op {
                        Op::Acquire { after_ms, hit } => {
                            now += Duration::from_millis(after_ms);
                            a.record_acquire(now, hit);
                            acquires += 1;
                            (0, 0)
                        }
                        Op::Refill { took_ms } => {
                            a.record_refill(Duration::from_millis(took_ms));
                            (0, 0)
                        }
                        Op::Plan { after_ms, ready, creating } => {
                            now += Duration::from_millis(after_ms);
                            (ready, creating)
                        }
                        Op::Wait { after_ms } => {
                            now += Duration::from_millis(after_ms);
                            (0, 0)
                        }
                    };
                    let plan = a.plan(now, ready, creating);
                    let target = a.stats(now).target;
                    prop_assert!(cfg.min <= target && target <= cfg.max, "target {}", target);
                    prop_assert!(plan.create <= cfg.max.saturating_sub(ready + creating));
                    prop_assert!(plan.destroy <= ready.saturating_sub(cfg.min));
                    prop_assert!(plan.create == 0 || plan.destroy == 0);
                    if ready + creating == 0 && target > 0 {
                        prop_assert_eq!(plan.create, target);
                    }

                    // Grow fast: at least the peak factor times the recent peak.
                    let s = a.stats(now);
                    let floor = round_up(cfg.peak_factor * s.peak as f64 - DEMAND_ROUNDING_SLACK)
                        .clamp(cfg.min, cfg.max);
                    prop_assert!(target >= floor, "target {} below floor {} ({:?})", target, floor, s);

                    // Shrink slowly: not within shrink_after of a rise, at most once per
                    // interval, at most half at a time.
                    if target > prev_target {
                        last_rise = now;
                        last_change = now;
                    } else if target < prev_target {
                        prop_assert!(now - last_rise >= cfg.shrink_after);
                        prop_assert!(now - last_change >= cfg.shrink_interval || last_change == t0);
                        prop_assert!(target >= prev_target / 2);
                        last_change = now;
                    }
                    prev_target = target;
                    prop_assert_eq!(s.hits + s.misses, acquires);
                    prop_assert!(s.acquire_rate_per_s.is_finite() && s.acquire_rate_per_s >= 0.0);
                }
            }
        }
    }
}
