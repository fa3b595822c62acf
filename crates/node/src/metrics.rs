//! A small Prometheus registry: counters, gauges and latency histograms with labels, rendered in
//! the text exposition format 0.0.4 for `/metrics`.
//!
//! Registering a metric (one name, help text, type and label names per family; one child per set
//! of label values) takes the registry lock and returns a handle. Handles are cheap clones of an
//! `Arc` over atomics: the hot path keeps the handle and never touches the registry again.
//! [`Histogram::observe`] is a binary search over [`LATENCY_BUCKETS`], one `fetch_add` and one
//! compare-and-swap on the sum.
//!
//! Rendering takes the registry lock and reads each atomic once (relaxed). Concurrent updates
//! during a render may be split across it, as with every Prometheus client; a histogram's `_count`
//! is always the sum of its buckets, so a scrape is never internally inconsistent on that point.
//!
//! Families render sorted by name and children by label values, so the output is deterministic.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// Upper bounds (`le`, in seconds) of every histogram's buckets: 50 µs doubling up to 52.4 s,
/// then 60 s, then the implicit `+Inf`. The doubling is exact in binary floating point, so the
/// bounds print as short decimals.
pub const LATENCY_BUCKETS: [f64; 22] = [
    0.00005, 0.0001, 0.0002, 0.0004, 0.0008, 0.0016, 0.0032, 0.0064, 0.0128, 0.0256, 0.0512,
    0.1024, 0.2048, 0.4096, 0.8192, 1.6384, 3.2768, 6.5536, 13.1072, 26.2144, 52.4288, 60.0,
];

/// Slots of a histogram: one per finite bucket plus `+Inf`.
const SLOTS: usize = LATENCY_BUCKETS.len() + 1;

/// Why a metric could not be registered. All of these are bugs in the caller's names.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MetricsError {
    /// The metric name is not `[a-zA-Z_:][a-zA-Z0-9_:]*`.
    #[error("invalid metric name {name:?}")]
    InvalidName {
        /// The metric name.
        name: String,
    },
    /// A label name is not `[a-zA-Z_][a-zA-Z0-9_]*`, starts with `__`, repeats, or is `le` on a
    /// histogram.
    #[error("invalid label name {label:?} on metric {name}")]
    InvalidLabel {
        /// The metric name.
        name: String,
        /// The label name.
        label: String,
    },
    /// The name is already registered with another type.
    #[error("metric {name} is a {existing}, not a {requested}")]
    TypeConflict {
        /// The metric name.
        name: String,
        /// Its registered type.
        existing: &'static str,
        /// The type asked for.
        requested: &'static str,
    },
    /// The name is already registered with other label names.
    #[error("metric {name} has labels {existing:?}, not {requested:?}")]
    LabelConflict {
        /// The metric name.
        name: String,
        /// Its registered label names.
        existing: Vec<String>,
        /// The label names asked for.
        requested: Vec<String>,
    },
}

/// A monotonically increasing count.
#[derive(Debug, Clone, Default)]
pub struct Counter(Arc<AtomicU64>);

impl Counter {
    /// Adds one.
    pub fn inc(&self) {
        self.inc_by(1);
    }

    /// Adds `n`.
    pub fn inc_by(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    /// The current count.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A value that goes up and down.
#[derive(Debug, Clone)]
pub struct Gauge(Arc<AtomicU64>);

impl Default for Gauge {
    fn default() -> Self {
        Self(Arc::new(AtomicU64::new(0.0f64.to_bits())))
    }
}

impl Gauge {
    /// Sets the value.
    pub fn set(&self, v: f64) {
        self.0.store(v.to_bits(), Ordering::Relaxed);
    }

    /// Adds `v` (which may be negative).
    pub fn add(&self, v: f64) {
        add_f64(&self.0, v);
    }

    /// Adds one.
    pub fn inc(&self) {
        self.add(1.0);
    }

    /// Subtracts one.
    pub fn dec(&self) {
        self.add(-1.0);
    }

    /// The current value.
    pub fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }
}

fn add_f64(cell: &AtomicU64, v: f64) {
    // The closure never declines, so this cannot fail.
    let _ = cell.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
        Some((f64::from_bits(bits) + v).to_bits())
    });
}

#[derive(Debug)]
struct HistogramCore {
    /// Non-cumulative counts per slot; the last slot is `+Inf`.
    slots: [AtomicU64; SLOTS],
    /// The sum of observations, as `f64` bits.
    sum: AtomicU64,
}

/// A distribution of durations in seconds over [`LATENCY_BUCKETS`].
#[derive(Debug, Clone)]
pub struct Histogram(Arc<HistogramCore>);

impl Default for Histogram {
    fn default() -> Self {
        Self(Arc::new(HistogramCore {
            slots: std::array::from_fn(|_| AtomicU64::new(0)),
            sum: AtomicU64::new(0.0f64.to_bits()),
        }))
    }
}

/// A point-in-time copy of a histogram.
#[derive(Debug, Clone, PartialEq)]
pub struct HistogramSnapshot {
    /// Cumulative counts: `cumulative[i]` observations were `<= LATENCY_BUCKETS[i]`; the last
    /// entry is the `+Inf` bucket and equals `count`.
    pub cumulative: [u64; SLOTS],
    /// The sum of observations, in seconds.
    pub sum: f64,
    /// The number of observations.
    pub count: u64,
}

impl Histogram {
    /// An unregistered histogram (for benches and tests).
    pub fn new() -> Self {
        Self::default()
    }

    /// Records one observation in seconds. NaN is ignored.
    pub fn observe(&self, secs: f64) {
        if secs.is_nan() {
            return;
        }
        let slot = LATENCY_BUCKETS.partition_point(|&le| le < secs);
        self.0.slots[slot].fetch_add(1, Ordering::Relaxed);
        add_f64(&self.0.sum, secs);
    }

    /// Records one duration.
    pub fn observe_duration(&self, d: Duration) {
        self.observe(d.as_secs_f64());
    }

    /// The current counts and sum.
    pub fn snapshot(&self) -> HistogramSnapshot {
        let mut cumulative = [0u64; SLOTS];
        let mut count = 0u64;
        for (c, slot) in cumulative.iter_mut().zip(&self.0.slots) {
            count += slot.load(Ordering::Relaxed);
            *c = count;
        }
        HistogramSnapshot {
            cumulative,
            sum: f64::from_bits(self.0.sum.load(Ordering::Relaxed)),
            count,
        }
    }

    /// The number of observations.
    pub fn count(&self) -> u64 {
        self.snapshot().count
    }

    /// The sum of observations, in seconds.
    pub fn sum(&self) -> f64 {
        f64::from_bits(self.0.sum.load(Ordering::Relaxed))
    }

    /// Estimates the `q`-quantile (`0 <= q <= 1`) in seconds, as Prometheus's
    /// `histogram_quantile` does: linear interpolation inside the bucket holding the rank, the
    /// first bucket starting at 0, and the `+Inf` bucket answering with the largest finite bound.
    /// `None` when there are no observations or `q` is out of range.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        self.snapshot().quantile(q)
    }
}

impl HistogramSnapshot {
    /// See [`Histogram::quantile`].
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if !(0.0..=1.0).contains(&q) || self.count == 0 {
            return None;
        }
        let rank = q * self.count as f64;
        let mut below = 0u64;
        for (i, &cum) in self.cumulative.iter().enumerate() {
            let here = cum - below;
            if here > 0 && cum as f64 >= rank {
                let Some(&upper) = LATENCY_BUCKETS.get(i) else {
                    return LATENCY_BUCKETS.last().copied();
                };
                let lower = if i == 0 { 0.0 } else { LATENCY_BUCKETS[i - 1] };
                let frac = ((rank - below as f64) / here as f64).clamp(0.0, 1.0);
                return Some(lower + (upper - lower) * frac);
            }
            below = cum;
        }
        None
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

#[derive(Debug, Clone)]
enum Metric {
    Counter(Counter),
    Gauge(Gauge),
    Histogram(Histogram),
}

impl Metric {
    fn new(kind: Kind) -> Self {
        match kind {
            Kind::Counter => Metric::Counter(Counter::default()),
            Kind::Gauge => Metric::Gauge(Gauge::default()),
            Kind::Histogram => Metric::Histogram(Histogram::default()),
        }
    }
}

#[derive(Debug)]
struct Family {
    help: String,
    kind: Kind,
    label_names: Vec<String>,
    /// Children by label values, in `label_names` order.
    children: BTreeMap<Vec<String>, Metric>,
}

/// The metrics of one process. Cheap to share behind an `Arc`.
#[derive(Debug, Default)]
pub struct Registry {
    families: Mutex<BTreeMap<String, Family>>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// The counter `name` with these labels, registered on first use. The help text of the first
    /// registration wins.
    pub fn counter(
        &self,
        name: &str,
        help: &str,
        labels: &[(&str, &str)],
    ) -> Result<Counter, MetricsError> {
        match self.child(name, help, Kind::Counter, labels)? {
            Metric::Counter(c) => Ok(c),
            other => Err(conflict(name, &other, Kind::Counter)),
        }
    }

    /// The gauge `name` with these labels, registered on first use.
    pub fn gauge(
        &self,
        name: &str,
        help: &str,
        labels: &[(&str, &str)],
    ) -> Result<Gauge, MetricsError> {
        match self.child(name, help, Kind::Gauge, labels)? {
            Metric::Gauge(g) => Ok(g),
            other => Err(conflict(name, &other, Kind::Gauge)),
        }
    }

    /// The histogram `name` (seconds, over [`LATENCY_BUCKETS`]) with these labels, registered on
    /// first use.
    pub fn histogram(
        &self,
        name: &str,
        help: &str,
        labels: &[(&str, &str)],
    ) -> Result<Histogram, MetricsError> {
        match self.child(name, help, Kind::Histogram, labels)? {
            Metric::Histogram(h) => Ok(h),
            other => Err(conflict(name, &other, Kind::Histogram)),
        }
    }

    /// Stops exporting the child of `name` with these label values (e.g. a destroyed sandbox's
    /// gauges); the family goes when its last child does. Handles still held keep working but
    /// are no longer rendered. Returns whether there was such a child.
    pub fn remove(&self, name: &str, labels: &[(&str, &str)]) -> bool {
        let mut families = self.lock();
        let Some(family) = families.get_mut(name) else {
            return false;
        };
        if !labels
            .iter()
            .map(|(k, _)| *k)
            .eq(family.label_names.iter().map(String::as_str))
        {
            return false;
        }
        let values: Vec<String> = labels.iter().map(|(_, v)| (*v).to_owned()).collect();
        let removed = family.children.remove(&values).is_some();
        if family.children.is_empty() {
            families.remove(name);
        }
        removed
    }

    /// Every metric in the text exposition format 0.0.4
    /// (`Content-Type: text/plain; version=0.0.4`).
    pub fn render(&self) -> String {
        let families = self.lock();
        let mut out = String::new();
        for (name, family) in families.iter() {
            let _ = writeln!(out, "# HELP {name} {}", escape_help(&family.help));
            let _ = writeln!(out, "# TYPE {name} {}", family.kind.as_str());
            for (values, metric) in &family.children {
                let labels = render_labels(&family.label_names, values);
                match metric {
                    Metric::Counter(c) => {
                        let _ = writeln!(out, "{name}{} {}", braced(&labels), c.get());
                    }
                    Metric::Gauge(g) => {
                        let _ = writeln!(out, "{name}{} {}", braced(&labels), fmt_f64(g.get()));
                    }
                    Metric::Histogram(h) => render_histogram(&mut out, name, &labels, h),
                }
            }
        }
        out
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Family>> {
        // The map is only ever changed by single inserts and removes, so a panic elsewhere while
        // it was held cannot have left it half-updated.
        self.families.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn child(
        &self,
        name: &str,
        help: &str,
        kind: Kind,
        labels: &[(&str, &str)],
    ) -> Result<Metric, MetricsError> {
        check_name(name)?;
        for (i, (label, _)) in labels.iter().enumerate() {
            let repeated = labels[..i].iter().any(|(l, _)| l == label);
            if !valid_label_name(label) || repeated || (kind == Kind::Histogram && *label == "le") {
                return Err(MetricsError::InvalidLabel {
                    name: name.to_owned(),
                    label: (*label).to_owned(),
                });
            }
        }
        let label_names: Vec<String> = labels.iter().map(|(k, _)| (*k).to_owned()).collect();
        let values: Vec<String> = labels.iter().map(|(_, v)| (*v).to_owned()).collect();

        let mut families = self.lock();
        let family = families.entry(name.to_owned()).or_insert_with(|| Family {
            help: help.to_owned(),
            kind,
            label_names: label_names.clone(),
            children: BTreeMap::new(),
        });
        if family.kind != kind {
            return Err(MetricsError::TypeConflict {
                name: name.to_owned(),
                existing: family.kind.as_str(),
                requested: kind.as_str(),
            });
        }
        if family.label_names != label_names {
            return Err(MetricsError::LabelConflict {
                name: name.to_owned(),
                existing: family.label_names.clone(),
                requested: label_names,
            });
        }
        Ok(family
            .children
            .entry(values)
            .or_insert_with(|| Metric::new(kind))
            .clone())
    }
}

fn conflict(name: &str, existing: &Metric, requested: Kind) -> MetricsError {
    let existing = match existing {
        Metric::Counter(_) => Kind::Counter,
        Metric::Gauge(_) => Kind::Gauge,
        Metric::Histogram(_) => Kind::Histogram,
    };
    MetricsError::TypeConflict {
        name: name.to_owned(),
        existing: existing.as_str(),
        requested: requested.as_str(),
    }
}

fn render_histogram(out: &mut String, name: &str, labels: &str, h: &Histogram) {
    let snap = h.snapshot();
    let sep = if labels.is_empty() { "" } else { "," };
    for (le, cum) in LATENCY_BUCKETS.iter().zip(&snap.cumulative) {
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{le}\"}} {cum}");
    }
    let _ = writeln!(
        out,
        "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {}",
        snap.count
    );
    let _ = writeln!(out, "{name}_sum{} {}", braced(labels), fmt_f64(snap.sum));
    let _ = writeln!(out, "{name}_count{} {}", braced(labels), snap.count);
}

/// `a="x",b="y"` (no braces).
fn render_labels(names: &[String], values: &[String]) -> String {
    let mut s = String::new();
    for (i, (k, v)) in names.iter().zip(values).enumerate() {
        if i > 0 {
            s.push(',');
        }
        let _ = write!(s, "{k}=\"{}\"", escape_label_value(v));
    }
    s
}

fn braced(labels: &str) -> String {
    if labels.is_empty() {
        String::new()
    } else {
        format!("{{{labels}}}")
    }
}

/// A sample value as Prometheus parses it (`+Inf`, `-Inf`, `NaN`, else a decimal).
fn fmt_f64(v: f64) -> String {
    if v.is_nan() {
        "NaN".to_owned()
    } else if v == f64::INFINITY {
        "+Inf".to_owned()
    } else if v == f64::NEG_INFINITY {
        "-Inf".to_owned()
    } else {
        v.to_string()
    }
}

fn escape_label_value(v: &str) -> String {
    let mut s = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '"' => s.push_str("\\\""),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    s
}

fn escape_help(v: &str) -> String {
    let mut s = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    s
}

fn check_name(name: &str) -> Result<(), MetricsError> {
    let mut chars = name.chars();
    let ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':');
    if ok {
        Ok(())
    } else {
        Err(MetricsError::InvalidName {
            name: name.to_owned(),
        })
    }
}

fn valid_label_name(label: &str) -> bool {
    let mut chars = label.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !label.starts_with("__")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_double_from_50us_and_end_at_60s() {
        assert_eq!(LATENCY_BUCKETS[0], 50e-6);
        for w in LATENCY_BUCKETS[..LATENCY_BUCKETS.len() - 1].windows(2) {
            assert_eq!(w[1], w[0] * 2.0);
        }
        assert_eq!(LATENCY_BUCKETS.last(), Some(&60.0));
        assert!(LATENCY_BUCKETS.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn renders_golden_text() {
        let r = Registry::new();
        let created = r
            .counter(
                "dsec_sandboxes_created_total",
                "Sandboxes created.",
                &[("substrate", "container")],
            )
            .expect("counter");
        created.inc_by(3);
        created.inc();
        r.gauge(
            "dsec_pool_ready",
            "Ready pooled sandboxes.",
            &[("template", "python")],
        )
        .expect("gauge")
        .set(4.0);
        r.gauge(
            "dsec_pool_ready",
            "Ready pooled sandboxes.",
            &[("template", "base")],
        )
        .expect("gauge")
        .set(0.5);
        let acquire = r
            .histogram("dsec_acquire_seconds", "Acquire latency.", &[])
            .expect("histogram");
        for v in [0.0, 0.25, 0.5, 100.0] {
            acquire.observe(v);
        }
        let want = "\
# HELP dsec_acquire_seconds Acquire latency.
# TYPE dsec_acquire_seconds histogram
dsec_acquire_seconds_bucket{le=\"0.00005\"} 1
dsec_acquire_seconds_bucket{le=\"0.0001\"} 1
dsec_acquire_seconds_bucket{le=\"0.0002\"} 1
dsec_acquire_seconds_bucket{le=\"0.0004\"} 1
dsec_acquire_seconds_bucket{le=\"0.0008\"} 1
dsec_acquire_seconds_bucket{le=\"0.0016\"} 1
dsec_acquire_seconds_bucket{le=\"0.0032\"} 1
dsec_acquire_seconds_bucket{le=\"0.0064\"} 1
dsec_acquire_seconds_bucket{le=\"0.0128\"} 1
dsec_acquire_seconds_bucket{le=\"0.0256\"} 1
dsec_acquire_seconds_bucket{le=\"0.0512\"} 1
dsec_acquire_seconds_bucket{le=\"0.1024\"} 1
dsec_acquire_seconds_bucket{le=\"0.2048\"} 1
dsec_acquire_seconds_bucket{le=\"0.4096\"} 2
dsec_acquire_seconds_bucket{le=\"0.8192\"} 3
dsec_acquire_seconds_bucket{le=\"1.6384\"} 3
dsec_acquire_seconds_bucket{le=\"3.2768\"} 3
dsec_acquire_seconds_bucket{le=\"6.5536\"} 3
dsec_acquire_seconds_bucket{le=\"13.1072\"} 3
dsec_acquire_seconds_bucket{le=\"26.2144\"} 3
dsec_acquire_seconds_bucket{le=\"52.4288\"} 3
dsec_acquire_seconds_bucket{le=\"60\"} 3
dsec_acquire_seconds_bucket{le=\"+Inf\"} 4
dsec_acquire_seconds_sum 100.75
dsec_acquire_seconds_count 4
# HELP dsec_pool_ready Ready pooled sandboxes.
# TYPE dsec_pool_ready gauge
dsec_pool_ready{template=\"base\"} 0.5
dsec_pool_ready{template=\"python\"} 4
# HELP dsec_sandboxes_created_total Sandboxes created.
# TYPE dsec_sandboxes_created_total counter
dsec_sandboxes_created_total{substrate=\"container\"} 4
";
        assert_eq!(r.render(), want);
    }

    #[test]
    fn histogram_labels_come_before_le() {
        let r = Registry::new();
        let h = r
            .histogram(
                "dsec_create_seconds",
                "Create latency by phase.",
                &[("substrate", "container"), ("phase", "clone")],
            )
            .expect("histogram");
        h.observe(0.001);
        let text = r.render();
        assert!(text.contains(
            "dsec_create_seconds_bucket{substrate=\"container\",phase=\"clone\",le=\"0.0016\"} 1\n"
        ));
        assert!(text.contains(
            "dsec_create_seconds_bucket{substrate=\"container\",phase=\"clone\",le=\"0.0008\"} 0\n"
        ));
        assert!(text
            .contains("dsec_create_seconds_sum{substrate=\"container\",phase=\"clone\"} 0.001\n"));
        assert!(
            text.contains("dsec_create_seconds_count{substrate=\"container\",phase=\"clone\"} 1\n")
        );
    }

    #[test]
    fn escapes_label_values_and_help() {
        let r = Registry::new();
        r.counter(
            "odd_total",
            "A \\ backslash\nand a \"quote\".",
            &[("path", "C:\\tmp\\\"x\"\nnext")],
        )
        .expect("counter")
        .inc();
        assert_eq!(
            r.render(),
            "# HELP odd_total A \\\\ backslash\\nand a \"quote\".\n\
             # TYPE odd_total counter\n\
             odd_total{path=\"C:\\\\tmp\\\\\\\"x\\\"\\nnext\"} 1\n"
        );
        // And every line parses back to the original values.
        let samples = parse(&r.render());
        assert_eq!(
            samples,
            vec![(
                "odd_total".to_owned(),
                vec![("path".to_owned(), "C:\\tmp\\\"x\"\nnext".to_owned())],
                "1".to_owned()
            )]
        );
    }

    #[test]
    fn buckets_are_cumulative_and_le_is_inclusive() {
        let h = Histogram::new();
        for &le in &LATENCY_BUCKETS {
            h.observe(le);
        }
        h.observe(61.0);
        h.observe(f64::INFINITY);
        h.observe(f64::NAN);
        h.observe(-1.0);
        let s = h.snapshot();
        // -1 and 50 µs in the first bucket, then one more per bound.
        for (i, &c) in s.cumulative[..LATENCY_BUCKETS.len()].iter().enumerate() {
            assert_eq!(c, i as u64 + 2, "bucket {i}");
        }
        assert_eq!(s.cumulative[LATENCY_BUCKETS.len()], 25);
        assert_eq!(s.count, 25);
        assert!(s.cumulative.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(s.sum, f64::INFINITY);
        let r = Registry::new();
        let h = r.histogram("h_seconds", "h", &[]).expect("histogram");
        h.observe(f64::INFINITY);
        assert!(r.render().contains("h_seconds_sum +Inf\n"));
    }

    #[test]
    fn quantile_interpolates_like_prometheus() {
        let h = Histogram::new();
        assert_eq!(h.quantile(0.5), None);
        for _ in 0..100 {
            h.observe_duration(Duration::from_millis(1));
        }
        // All in (0.0008, 0.0016]: the median is the middle of that bucket.
        let median = h.quantile(0.5).expect("observations");
        assert!((median - 0.0012).abs() < 1e-12, "{median}");
        assert_eq!(h.quantile(0.0), Some(0.0008));
        assert_eq!(h.quantile(1.0), Some(0.0016));
        assert_eq!(h.quantile(1.5), None);
        assert_eq!(h.quantile(f64::NAN), None);
        for _ in 0..100 {
            h.observe(1000.0);
        }
        assert_eq!(h.quantile(0.99), Some(60.0));
        let p25 = h.quantile(0.25).expect("observations");
        assert!(0.0008 < p25 && p25 <= 0.0016, "{p25}");
    }

    #[test]
    fn same_name_and_labels_share_one_child() {
        let r = Registry::new();
        let a = r.counter("c_total", "c", &[("k", "v")]).expect("counter");
        let b = r
            .counter("c_total", "other help", &[("k", "v")])
            .expect("counter");
        a.inc();
        b.inc();
        assert_eq!(a.get(), 2);
        let other = r.counter("c_total", "c", &[("k", "w")]).expect("counter");
        assert_eq!(other.get(), 0);
        assert!(r.render().starts_with("# HELP c_total c\n"));
    }

    #[test]
    fn remove_drops_a_child_and_then_its_family() {
        let r = Registry::new();
        let g = r.gauge("g", "g", &[("sandbox", "a")]).expect("gauge");
        r.gauge("g", "g", &[("sandbox", "b")]).expect("gauge");
        assert!(r.remove("g", &[("sandbox", "a")]));
        assert!(!r.remove("g", &[("sandbox", "a")]));
        assert!(!r.remove("g", &[("other", "b")]));
        g.set(1.0);
        assert!(!r.render().contains("sandbox=\"a\""));
        assert!(r.remove("g", &[("sandbox", "b")]));
        assert_eq!(r.render(), "");
    }

    #[test]
    fn rejects_bad_names_and_conflicts() {
        let r = Registry::new();
        assert!(matches!(
            r.counter("1bad", "", &[]),
            Err(MetricsError::InvalidName { .. })
        ));
        assert!(matches!(
            r.counter("", "", &[]),
            Err(MetricsError::InvalidName { .. })
        ));
        assert!(matches!(
            r.counter("has-dash", "", &[]),
            Err(MetricsError::InvalidName { .. })
        ));
        assert!(r.counter("ns:sub_total", "", &[]).is_ok());
        for label in ["", "9x", "a:b", "__reserved", "é"] {
            assert!(
                matches!(
                    r.counter("x_total", "", &[(label, "v")]),
                    Err(MetricsError::InvalidLabel { .. })
                ),
                "{label:?}"
            );
        }
        assert!(matches!(
            r.counter("x_total", "", &[("a", "1"), ("a", "2")]),
            Err(MetricsError::InvalidLabel { .. })
        ));
        assert!(matches!(
            r.histogram("h_seconds", "", &[("le", "1")]),
            Err(MetricsError::InvalidLabel { .. })
        ));
        assert!(r.gauge("le_gauge", "", &[("le", "1")]).is_ok());

        r.counter("y_total", "", &[("a", "1")]).expect("counter");
        assert_eq!(
            r.gauge("y_total", "", &[("a", "1")]).err(),
            Some(MetricsError::TypeConflict {
                name: "y_total".into(),
                existing: "counter",
                requested: "gauge",
            })
        );
        assert_eq!(
            r.counter("y_total", "", &[("b", "1")]).err(),
            Some(MetricsError::LabelConflict {
                name: "y_total".into(),
                existing: vec!["a".into()],
                requested: vec!["b".into()],
            })
        );
    }

    #[test]
    fn gauge_goes_up_and_down() {
        let g = Gauge::default();
        g.inc();
        g.inc();
        g.dec();
        g.add(0.5);
        assert_eq!(g.get(), 1.5);
        g.set(f64::NEG_INFINITY);
        assert_eq!(fmt_f64(g.get()), "-Inf");
        assert_eq!(fmt_f64(f64::NAN), "NaN");
    }

    #[test]
    fn concurrent_updates_sum_correctly() {
        const THREADS: usize = 8;
        const EACH: usize = 10_000;
        let r = Arc::new(Registry::new());
        std::thread::scope(|s| {
            for t in 0..THREADS {
                let r = Arc::clone(&r);
                s.spawn(move || {
                    // Half the threads resolve handles once, half resolve them on every update.
                    let h = r.histogram("lat_seconds", "l", &[]).expect("histogram");
                    let c = r.counter("ops_total", "o", &[]).expect("counter");
                    let g = r.gauge("level", "l", &[]).expect("gauge");
                    for i in 0..EACH {
                        let v = if i % 2 == 0 { 0.25 } else { 2.0 };
                        if t % 2 == 0 {
                            h.observe(v);
                            c.inc();
                            g.add(1.0);
                        } else {
                            r.histogram("lat_seconds", "l", &[]).expect("h").observe(v);
                            r.counter("ops_total", "o", &[]).expect("c").inc();
                            r.gauge("level", "l", &[]).expect("g").add(1.0);
                        }
                    }
                    // Renders concurrent with updates must not block forever or panic.
                    let _ = r.render();
                });
            }
        });
        let n = (THREADS * EACH) as u64;
        let h = r.histogram("lat_seconds", "l", &[]).expect("histogram");
        let s = h.snapshot();
        assert_eq!(s.count, n);
        assert_eq!(s.sum, (n / 2) as f64 * 0.25 + (n / 2) as f64 * 2.0);
        assert_eq!(s.cumulative[13], n / 2); // le 0.4096
        assert_eq!(s.cumulative[15], n / 2); // le 1.6384
        assert_eq!(s.cumulative[16], n); // le 3.2768
        assert_eq!(r.counter("ops_total", "o", &[]).expect("c").get(), n);
        assert_eq!(r.gauge("level", "l", &[]).expect("g").get(), n as f64);
        let text = r.render();
        assert!(text.contains(&format!("lat_seconds_count {n}\n")));
        assert!(text.contains(&format!("ops_total {n}\n")));
    }

    #[test]
    fn rendered_text_parses() {
        let r = Registry::new();
        r.counter("a_total", "a", &[("x", "1"), ("y", "q\"\\\n")])
            .expect("counter")
            .inc();
        r.histogram("b_seconds", "b", &[("x", "}{,=")])
            .expect("histogram")
            .observe(0.01);
        r.gauge("c", "c", &[]).expect("gauge").set(-2.5);
        let samples = parse(&r.render());
        assert_eq!(samples.len(), 1 + (LATENCY_BUCKETS.len() + 3) + 1);
        let bucket = samples
            .iter()
            .find(|(n, l, _)| {
                n == "b_seconds_bucket" && l.last().is_some_and(|(_, v)| v == "0.0128")
            })
            .expect("bucket");
        assert_eq!(bucket.1[0], ("x".to_owned(), "}{,=".to_owned()));
        assert_eq!(bucket.2, "1");
    }

    type Sample = (String, Vec<(String, String)>, String);

    /// A strict parser of the sample lines of the text format; checks the comment lines' shape.
    fn parse(text: &str) -> Vec<Sample> {
        assert!(text.is_empty() || text.ends_with('\n'));
        let mut out = Vec::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# ") {
                assert!(
                    rest.starts_with("HELP ") || rest.starts_with("TYPE "),
                    "{line}"
                );
                continue;
            }
            let name_end = line.find(['{', ' ']).expect("name then labels or value");
            let name = &line[..name_end];
            check_name(name).expect("valid name");
            let mut rest = &line[name_end..];
            let mut labels = Vec::new();
            if let Some(r) = rest.strip_prefix('{') {
                rest = r;
                loop {
                    if let Some(r) = rest.strip_prefix('}') {
                        rest = r;
                        break;
                    }
                    let eq = rest.find('=').expect("label =");
                    let key = &rest[..eq];
                    assert!(valid_label_name(key) || key == "le", "{key}");
                    rest = rest[eq..].strip_prefix("=\"").expect("opening quote");
                    let mut value = String::new();
                    let mut chars = rest.char_indices();
                    let end = loop {
                        match chars.next().expect("closing quote") {
                            (i, '"') => break i,
                            (_, '\\') => match chars.next().expect("escape").1 {
                                'n' => value.push('\n'),
                                '\\' => value.push('\\'),
                                '"' => value.push('"'),
                                c => panic!("bad escape \\{c}"),
                            },
                            (_, '\n') => panic!("raw newline"),
                            (_, c) => value.push(c),
                        }
                    };
                    labels.push((key.to_owned(), value));
                    rest = &rest[end + 1..];
                    rest = rest.strip_prefix(',').unwrap_or(rest);
                }
            }
            let value = rest.strip_prefix(' ').expect("space before value");
            assert!(
                value.parse::<f64>().is_ok() || ["+Inf", "-Inf", "NaN"].contains(&value),
                "{value}"
            );
            out.push((name.to_owned(), labels, value.to_owned()));
        }
        out
    }
}
