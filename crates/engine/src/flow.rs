//! Flow control (FVP §6; pure): how long to hold a write's completion so the destager can keep
//! up, from three signals per volume — dirty writes, dirty bytes, and the expected time to
//! destage them.
//!
//! Each signal divided by its trigger is a *pressure*; the largest one counts. Below
//! [`ONSET`] nothing is delayed. From there the delay grows continuously: to 1× the moving
//! average datastore write latency at pressure 1 (the trigger), and on to 4× at pressure 2,
//! where it stays. There is no cliff anywhere: a small change in pressure is a small change in
//! delay. When the destager catches up, pressure falls and the delay with it.
//!
//! Stalling — refusing to complete a write at all — is not decided here: it happens only when
//! a volume's cache share is full of dirty data (see `cache`).

use std::time::Duration;

/// Pressure below which writes are not delayed.
pub const ONSET: f64 = 0.75;
/// The largest delay, in multiples of the datastore write latency (FVP: 4×).
pub const MAX_MULTIPLE: f64 = 4.0;
/// Seconds of destage backlog at which flow control starts when a volume has no RPO.
pub const DESTAGE_SECONDS_DEFAULT: f64 = 30.0;

/// When each signal starts to count as pressure 1.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Triggers {
    pub dirty_writes: u64,
    /// Log bytes ([`Signals::dirty_bytes`]).
    pub dirty_bytes: u64,
    /// Expected seconds to destage what is dirty.
    pub destage_seconds: f64,
}

impl Triggers {
    /// Triggers for a volume whose writes stall once its dirty data takes `stall_bytes` of
    /// the cache log, with an optional recovery point objective: dirty data may take half
    /// that, and should take no longer to destage than the RPO. Without one,
    /// [`DESTAGE_SECONDS_DEFAULT`]: long enough that a burst of a few tens of seconds is
    /// absorbed at cache speed (FVP §8.1), short enough that a sustained one is slowed long
    /// before the share fills (§8.2). The bytes pressure is 2, and the delay at its largest,
    /// just as the share is full: the delay grows all the way to the stall, with no cliff
    /// before it.
    pub fn for_stall_limit(stall_bytes: u64, rpo_seconds: Option<f64>) -> Triggers {
        Triggers {
            dirty_writes: (stall_bytes / 2 / 4096).max(64),
            dirty_bytes: (stall_bytes / 2).max(1),
            destage_seconds: rpo_seconds.unwrap_or(DESTAGE_SECONDS_DEFAULT).max(0.1),
        }
    }
}

/// What the volume's dirty data and its datastore look like now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Signals {
    pub dirty_writes: u64,
    /// Cache log bytes the dirty data and the writes admitted take (headers included): the
    /// space whose limit stalls writes. Before 2026-12-01 this was the payload, which takes
    /// less: 4 KiB writes stalled at pressure 1.13, a delay of 1.4× the datastore latency.
    pub dirty_bytes: u64,
    /// Payload bytes the destager must move (a zeroed range is one request, not its length).
    pub destage_bytes: u64,
    /// Moving average latency of one datastore write.
    pub write_latency: Duration,
    /// Moving average destage throughput in bytes per second (0 if not yet measured).
    pub destage_bytes_per_s: f64,
    /// Writes the destager has in flight per datastore round trip (the datastore's queue
    /// depth; a window carries a few such waves).
    pub queue_depth: u32,
}

/// Expected seconds to destage everything dirty: the larger of the byte-bound and the
/// round-trip-bound estimates (small writes are limited by windows, large ones by bandwidth).
pub fn expected_destage_seconds(s: &Signals) -> f64 {
    let windows = s.dirty_writes as f64 / f64::from(s.queue_depth.max(1));
    let by_windows = windows * s.write_latency.as_secs_f64();
    let by_bytes = if s.destage_bytes_per_s > 0.0 {
        s.destage_bytes as f64 / s.destage_bytes_per_s
    } else {
        0.0
    };
    by_windows.max(by_bytes)
}

/// The largest of the three pressures.
pub fn pressure(s: &Signals, t: &Triggers) -> f64 {
    let w = s.dirty_writes as f64 / t.dirty_writes.max(1) as f64;
    let b = s.dirty_bytes as f64 / t.dirty_bytes.max(1) as f64;
    let d = expected_destage_seconds(s) / t.destage_seconds;
    w.max(b).max(d)
}

/// Delay in multiples of the datastore write latency, for a pressure.
pub fn multiple(p: f64) -> f64 {
    if p.is_nan() || p <= ONSET {
        0.0
    } else if p < 1.0 {
        (p - ONSET) / (1.0 - ONSET)
    } else {
        (1.0 + (MAX_MULTIPLE - 1.0) * (p - 1.0)).min(MAX_MULTIPLE)
    }
}

/// How long to hold a write's completion.
pub fn delay(s: &Signals, t: &Triggers) -> Duration {
    s.write_latency.mul_f64(multiple(pressure(s, t)))
}

/// What a write may take besides flow control's delay: its own trip through the cache.
pub const HOLD_SLACK: Duration = Duration::from_millis(1);

/// The longest flow control may hold a write, from its arrival to its completion, at a
/// datastore write latency: the largest delay plus [`HOLD_SLACK`]. The delay counts the time a
/// write has spent already, so a throttled write is held longer only by the timer that
/// releases it firing late. (A stall, the volume's share full of dirty data, is not a delay
/// and may hold a write longer.)
pub fn hold_bound(write_latency: Duration) -> Duration {
    write_latency.mul_f64(MAX_MULTIPLE) + HOLD_SLACK
}

/// An exponentially weighted moving average.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ewma {
    value: Option<f64>,
    alpha: f64,
}

impl Ewma {
    /// `alpha` is the weight of each new sample (0..=1).
    pub fn new(alpha: f64) -> Ewma {
        Ewma {
            value: None,
            alpha: alpha.clamp(0.0, 1.0),
        }
    }

    pub fn add(&mut self, x: f64) {
        self.value = Some(match self.value {
            None => x,
            Some(v) => v + self.alpha * (x - v),
        });
    }

    pub fn get(&self) -> Option<f64> {
        self.value
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn signals(writes: u64, bytes: u64, lat_ms: u64) -> Signals {
        Signals {
            dirty_writes: writes,
            dirty_bytes: bytes,
            destage_bytes: bytes,
            write_latency: Duration::from_millis(lat_ms),
            destage_bytes_per_s: 0.0,
            queue_depth: 16,
        }
    }

    #[test]
    fn the_curve_has_its_landmarks() {
        assert_eq!(multiple(0.0), 0.0);
        assert_eq!(multiple(ONSET), 0.0);
        assert_eq!(multiple(1.0), 1.0);
        assert_eq!(multiple(2.0), MAX_MULTIPLE);
        assert_eq!(multiple(100.0), MAX_MULTIPLE);
        assert_eq!(multiple(f64::NAN), 0.0);
    }

    #[test]
    fn delay_is_measured_in_datastore_latency() {
        let t = Triggers {
            dirty_writes: 1000,
            dirty_bytes: 1 << 40,
            destage_seconds: 1000.0,
        };
        assert_eq!(delay(&signals(100, 0, 2), &t), Duration::ZERO);
        assert_eq!(delay(&signals(1000, 0, 2), &t), Duration::from_millis(2));
        assert_eq!(delay(&signals(5000, 0, 2), &t), Duration::from_millis(8));
    }

    #[test]
    fn the_expected_destage_time_counts_windows_and_bytes() {
        let mut s = signals(160, 160 * 4096, 2);
        assert!((expected_destage_seconds(&s) - 0.020).abs() < 1e-9); // 10 windows of 2 ms
        s.destage_bytes_per_s = 4096.0 * 100.0;
        assert!((expected_destage_seconds(&s) - 1.6).abs() < 1e-9); // bandwidth-bound
    }

    proptest! {
        #[test]
        fn the_multiple_is_continuous_monotone_and_bounded(p in 0.0f64..3.0, dp in 0.0f64..0.001) {
            let (a, b) = (multiple(p), multiple(p + dp));
            prop_assert!(a >= 0.0 && b <= MAX_MULTIPLE);
            prop_assert!(b >= a, "not monotone at {}", p);
            // Lipschitz: slope at most 4 (the 0.75..1 ramp) — no jumps.
            prop_assert!(b - a <= 4.0 * dp + 1e-12, "jump at {}", p);
        }

        #[test]
        fn delay_never_exceeds_four_times_the_latency(
            w in 0u64..1_000_000, b in 0u64..(1 << 34), lat in 0u64..100, bps in 0.0f64..1e9,
        ) {
            let mut s = signals(w, b, lat);
            s.destage_bytes_per_s = bps;
            let t = Triggers::for_stall_limit(64 << 20, Some(1.0));
            prop_assert!(delay(&s, &t) <= s.write_latency.mul_f64(MAX_MULTIPLE));
            prop_assert!(delay(&s, &t) + HOLD_SLACK <= hold_bound(s.write_latency));
        }
    }

    proptest! {
        /// Whatever the writes' size, the delay reaches its largest as their records fill the
        /// space at which writes stall, and grows with the space on the way there: no stall
        /// comes while the delay is still short of 4×. (Before, the bytes signal counted
        /// payload against half the share: 4 KiB writes stalled at a delay of 1.4×.)
        #[test]
        fn the_delay_is_at_its_largest_when_the_share_is_full(
            size in 1u64..=512, limit_mib in 1u64..4096, rpo in prop::option::of(0.1f64..3600.0),
        ) {
            let size = size * 512;
            let limit = limit_mib << 20;
            let per = cachelog::format::log_bytes(true, size);
            let t = Triggers::for_stall_limit(limit, rpo);
            let at = |n: u64| Signals {
                dirty_writes: n,
                dirty_bytes: n * per,
                destage_bytes: n * size,
                write_latency: Duration::from_millis(2),
                destage_bytes_per_s: 0.0,
                queue_depth: 16,
            };
            // The last write admitted before the stall: the next one would pass the limit.
            let full = limit / per;
            prop_assume!(full >= 2);
            let last = multiple(pressure(&at(full), &t));
            let next_to_last = multiple(pressure(&at(full - 1), &t));
            let one_short = 2.0 * (1.0 - 2.0 * per as f64 / limit as f64);
            prop_assert!(
                last >= multiple(one_short) - 1e-9,
                "{} writes of {} bytes fill {} bytes at a multiple of {}", full, size, limit, last
            );
            prop_assert!(multiple(pressure(&at(full / 2), &t)) <= next_to_last);
            prop_assert!(next_to_last <= last);
        }
    }

    #[test]
    fn the_hold_bound_is_four_latencies_and_a_millisecond() {
        assert_eq!(hold_bound(Duration::ZERO), Duration::from_millis(1));
        assert_eq!(
            hold_bound(Duration::from_micros(2500)),
            Duration::from_millis(11)
        );
    }

    #[test]
    fn ewma_follows_its_samples() {
        let mut e = Ewma::new(0.5);
        assert_eq!(e.get(), None);
        e.add(10.0);
        assert_eq!(e.get(), Some(10.0));
        e.add(20.0);
        assert_eq!(e.get(), Some(15.0));
    }
}
