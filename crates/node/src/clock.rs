//! The wall clock the node records times with.
//!
//! `DSEC_CLOCK_OFFSET_MS` (read once, at the first reading; negative moves it back) shifts this
//! clock, and only this process's: the chaos soak (`dsec bench chaos`) steps a restarted node's
//! clock with it instead of stepping the shared host's. Deadlines the node keeps while it runs
//! are on the monotonic clock (F-09); the wall clock is what it records and compares across a
//! restart (expiry times, idempotency ages, trajectory times).

use std::sync::OnceLock;

/// The offset `DSEC_CLOCK_OFFSET_MS` names, 0 without it.
fn offset_ms() -> i64 {
    static OFFSET: OnceLock<i64> = OnceLock::new();
    *OFFSET.get_or_init(|| {
        std::env::var("DSEC_CLOCK_OFFSET_MS")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    })
}

/// `real` milliseconds shifted by `offset` (saturating at 0 and at the end of time).
fn shifted(real: u64, offset: i64) -> u64 {
    real.saturating_add_signed(offset)
}

/// Milliseconds since the epoch.
pub fn now_ms() -> u64 {
    let real = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    shifted(real, offset_ms())
}

/// The UTC calendar date and time of `secs` since the epoch: (year, month, day, hour, minute,
/// second) (H. Hinnant's civil-from-days algorithm).
pub fn civil(secs: u64) -> (i64, i64, i64, u64, u64, u64) {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d, rem / 3600, rem % 3600 / 60, rem % 60)
}

/// RFC 3339 UTC time of `ms` since the epoch.
pub fn rfc3339(ms: u64) -> String {
    let (y, m, d, hh, mm, ss) = civil(ms / 1000);
    format!(
        "{y:04}-{m:02}-{d:02}T{hh:02}:{mm:02}:{ss:02}.{:03}Z",
        ms % 1000
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_offset_steps_the_clock_both_ways_and_saturates() {
        assert_eq!(shifted(10_000, 600_000), 610_000);
        assert_eq!(shifted(610_000, -600_000), 10_000);
        assert_eq!(shifted(5, -10), 0);
        assert_eq!(shifted(u64::MAX - 1, 10), u64::MAX);
    }
}
