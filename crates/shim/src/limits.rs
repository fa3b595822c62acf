//! A sandbox's [`Limits`] as cgroup limits.

use dsec_api::limits::Limits;
use dsec_sys::cgroup::CgroupLimits;

/// The cgroup limits `limits` set (the hard CPU cap as quota over a 100 ms period).
pub fn cgroup_limits(limits: &Limits) -> CgroupLimits {
    CgroupLimits {
        cpu_weight: Some(limits.cpu_weight),
        cpu_max: limits
            .cpu_max
            .map(|c| ((c * 100_000.0).round() as u64, 100_000)),
        memory_high: limits.memory_high,
        memory_max: Some(limits.memory_max),
        pids_max: Some(limits.pids_max),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsec_api::limits::MAX_BYTES;

    /// Limits that pass [`Limits::validate`] are limits the kernel's cgroup files accept, at the
    /// edges of every range.
    #[test]
    fn valid_limits_are_valid_cgroup_limits() {
        let top = Limits {
            memory_max: MAX_BYTES,
            memory_high: Some(MAX_BYTES),
            cpu_max: Some(1024.0),
            cpu_weight: 10000,
            pids_max: 1 << 20,
            ..Limits::default()
        };
        let bottom = Limits {
            cpu_max: Some(0.01),
            cpu_weight: 1,
            memory_max: 8 << 20,
            memory_high: Some(1),
            pids_max: 8,
            ..Limits::default()
        };
        for l in [top, bottom, Limits::default()] {
            assert_eq!(l.validate(), Ok(()), "{l:?}");
            assert!(cgroup_limits(&l).validate().is_ok(), "{l:?}");
        }
    }

    #[test]
    fn the_cpu_cap_is_a_quota_over_100ms() {
        let l = Limits {
            cpu_max: Some(1.5),
            ..Limits::default()
        };
        let c = cgroup_limits(&l);
        assert_eq!(c.cpu_max, Some((150_000, 100_000)));
        assert_eq!(c.memory_max, Some(l.memory_max));
        assert_eq!(c.pids_max, Some(l.pids_max));
        assert_eq!(c.cpu_weight, Some(100));
        assert_eq!(cgroup_limits(&Limits::default()).cpu_max, None);
    }
}
