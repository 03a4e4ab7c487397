//! Device model (BASIL §4): how much a datastore can take, from nothing but what every host
//! already measures.
//!
//! Arrays hide their spindle counts, RAID levels and disk types behind a LUN. What a host can
//! see is, per interval, the average number of IOs it had outstanding to the LUN and their
//! average latency. BASIL found latency close to linear in outstanding IOs, with a slope that
//! falls as the LUN gets more (or faster) spindles: 1.13 ms per OIO for seven FC disks against
//! 3.5 for seven SATA disks (§4, Figure 7). So the performance of a datastore is
//! `P = 1 / slope` of the least-squares line through its ⟨OIO, latency⟩ pairs.
//!
//! Those pairs must describe the device, not the workload mix of the moment (§4.1): a burst of
//! cached writes at high OIO, a sequential scan, or large IOs in quiet periods each bend the
//! line and can even make the slope negative. Hence the filters of [`is_usable`]: only reads
//! (outstanding reads and read latency), and only intervals whose average IO is at most
//! [`IO_SIZE_KIB_MAX`] and whose sequentiality is at most [`SEQUENTIAL_PCT_MAX`]. Hosts that
//! share a datastore are combined by [`aggregate`] before fitting: outstanding IOs add up,
//! latency is averaged weighted by IOPS (§6.1).
//!
//! A datastore without enough usable points, or whose line does not rise, has no model
//! (`None`). The planner then treats it as new: it receives at most one workload until the
//! statistics of that workload give it a model (§6.3).

use serde::{Deserialize, Serialize};

use crate::stats;

/// Intervals whose average IO is larger than this are ignored (BASIL §4.1: 32 KB).
pub const IO_SIZE_KIB_MAX: f64 = 32.0;
/// Intervals more sequential than this are ignored (BASIL §4.1: 90 %).
pub const SEQUENTIAL_PCT_MAX: f64 = 90.0;
/// Fewest usable intervals a model is fitted from. A line through a handful of intervals is
/// at the mercy of one burst; ten is the least that still lets a new datastore get a model
/// within one planning round of a few minutes of 10-second samples. The paper collects pairs
/// "over a period of days" for the decisions that matter.
pub const MIN_POINTS: usize = 10;

/// One interval of one datastore as seen by one host, or by all of them after [`aggregate`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DeviceSample {
    /// Average outstanding reads.
    pub read_oio: f64,
    /// Average read latency.
    pub read_latency_ms: f64,
    /// Reads per second.
    pub read_iops: f64,
    /// Average size of the interval's reads (the IOs the model uses), KiB.
    pub io_size_kib: f64,
    /// Share of the interval's reads that were sequential, 0–100.
    pub sequential_pct: f64,
}

/// Whether an interval may be used for the device model: it saw reads, its numbers are sane,
/// and it is not extreme in IO size or sequentiality (BASIL §4.1).
pub fn is_usable(s: &DeviceSample) -> bool {
    s.read_oio.is_finite()
        && s.read_oio > 0.0
        && s.read_latency_ms.is_finite()
        && s.read_latency_ms > 0.0
        && s.read_iops.is_finite()
        && s.read_iops > 0.0
        && s.io_size_kib.is_finite()
        && s.io_size_kib <= IO_SIZE_KIB_MAX
        && s.sequential_pct.is_finite()
        && s.sequential_pct <= SEQUENTIAL_PCT_MAX
}

/// One interval of a datastore from the samples of every host that uses it: outstanding
/// reads summed, read latency weighted by read IOPS, IO size and sequentiality weighted by
/// read IOPS too (the filters are about the reads the model uses). `None` if no host read.
pub fn aggregate(per_host: &[DeviceSample]) -> Option<DeviceSample> {
    let hosts: Vec<&DeviceSample> = per_host
        .iter()
        .filter(|s| {
            s.read_iops.is_finite()
                && s.read_iops > 0.0
                && s.read_oio.is_finite()
                && s.read_latency_ms.is_finite()
                && s.io_size_kib.is_finite()
                && s.sequential_pct.is_finite()
        })
        .collect();
    let iops: f64 = hosts.iter().map(|s| s.read_iops).sum();
    if hosts.is_empty() || iops <= 0.0 {
        return None;
    }
    let weighted =
        |f: fn(&DeviceSample) -> f64| hosts.iter().map(|s| f(s) * s.read_iops).sum::<f64>() / iops;
    Some(DeviceSample {
        read_oio: hosts.iter().map(|s| s.read_oio).sum(),
        read_latency_ms: weighted(|s| s.read_latency_ms),
        read_iops: iops,
        io_size_kib: weighted(|s| s.io_size_kib),
        sequential_pct: weighted(|s| s.sequential_pct),
    })
}

/// A datastore's performance model.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DeviceModel {
    /// Milliseconds of latency each further outstanding read adds.
    pub slope_ms_per_oio: f64,
    pub intercept_ms: f64,
    /// BASIL's `P = 1 / slope`: outstanding reads per millisecond of latency. Larger is faster.
    pub performance: f64,
    /// How much of the latency variance the line explains (0–1).
    pub r_squared: f64,
    /// Intervals the line was fitted through.
    pub points: usize,
}

/// The least-squares model through ⟨outstanding reads, read latency⟩ pairs the caller has
/// already filtered. `None` with fewer than [`MIN_POINTS`] finite pairs, no spread in OIO, or
/// a slope that is not positive (a line that does not rise says nothing about capacity).
pub fn fit(points: &[(f64, f64)]) -> Option<DeviceModel> {
    let finite = points
        .iter()
        .filter(|(x, y)| x.is_finite() && y.is_finite())
        .count();
    if finite < MIN_POINTS {
        return None;
    }
    let line = stats::fit_line(points)?;
    if !(line.slope.is_finite() && line.slope > 0.0) {
        return None;
    }
    Some(DeviceModel {
        slope_ms_per_oio: line.slope,
        intercept_ms: line.intercept,
        performance: 1.0 / line.slope,
        r_squared: line.r_squared,
        points: line.points,
    })
}

/// [`fit`] over the usable samples ([`is_usable`]).
pub fn model(samples: &[DeviceSample]) -> Option<DeviceModel> {
    let points: Vec<(f64, f64)> = samples
        .iter()
        .filter(|s| is_usable(s))
        .map(|s| (s.read_oio, s.read_latency_ms))
        .collect();
    fit(&points)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample(oio: f64, lat: f64) -> DeviceSample {
        DeviceSample {
            read_oio: oio,
            read_latency_ms: lat,
            read_iops: 1000.0 * oio / lat,
            io_size_kib: 8.0,
            sequential_pct: 10.0,
        }
    }

    #[test]
    fn performance_is_the_inverse_slope() {
        // Figure 7's FC LUN: 1.13 ms per OIO.
        let samples: Vec<DeviceSample> = (1..=20)
            .map(|i| sample(f64::from(i), 1.13 * f64::from(i) + 3.0))
            .collect();
        let m = model(&samples).unwrap();
        assert!((m.slope_ms_per_oio - 1.13).abs() < 1e-9);
        assert!((m.intercept_ms - 3.0).abs() < 1e-9);
        assert!((m.performance - 1.0 / 1.13).abs() < 1e-9);
        assert!((m.r_squared - 1.0).abs() < 1e-9);
        assert_eq!(m.points, 20);
    }

    #[test]
    fn extreme_intervals_are_filtered_out() {
        let good = sample(4.0, 10.0);
        assert!(is_usable(&good));
        assert!(is_usable(&DeviceSample {
            io_size_kib: 32.0,
            sequential_pct: 90.0,
            ..good
        }));
        assert!(!is_usable(&DeviceSample {
            io_size_kib: 64.0,
            ..good
        }));
        assert!(!is_usable(&DeviceSample {
            sequential_pct: 95.0,
            ..good
        }));
        assert!(!is_usable(&DeviceSample {
            read_iops: 0.0,
            ..good
        })); // writes only
        assert!(!is_usable(&DeviceSample {
            read_latency_ms: f64::NAN,
            ..good
        }));
    }

    #[test]
    fn filtered_intervals_do_not_bend_the_line() {
        // DVD Store (§4.1, Figure 8): at high OIO, large sequential bursts with low latency
        // would make the slope negative. Filtered, the slope of the random reads remains.
        let mut samples: Vec<DeviceSample> = (1..=12)
            .map(|i| sample(f64::from(i), 2.0 * f64::from(i) + 5.0))
            .collect();
        for i in 30..40 {
            samples.push(DeviceSample {
                io_size_kib: 256.0,
                sequential_pct: 99.0,
                ..sample(f64::from(i), 3.0)
            });
        }
        let unfiltered: Vec<(f64, f64)> = samples
            .iter()
            .map(|s| (s.read_oio, s.read_latency_ms))
            .collect();
        assert_eq!(fit(&unfiltered), None); // negative slope: no model
        let m = model(&samples).unwrap();
        assert!((m.slope_ms_per_oio - 2.0).abs() < 1e-9);
    }

    #[test]
    fn no_model_from_too_few_points_or_a_falling_line() {
        let few: Vec<DeviceSample> = (1..MIN_POINTS)
            .map(|i| sample(i as f64, i as f64 + 1.0))
            .collect();
        assert_eq!(model(&few), None);
        let falling: Vec<DeviceSample> = (1..=20)
            .map(|i| sample(f64::from(i), 50.0 - f64::from(i)))
            .collect();
        assert_eq!(model(&falling), None);
        let flat_oio: Vec<DeviceSample> = (1..=20).map(|i| sample(8.0, f64::from(i))).collect();
        assert_eq!(model(&flat_oio), None);
    }

    #[test]
    fn hosts_add_outstanding_ios_and_weight_latency_by_iops() {
        let a = DeviceSample {
            read_oio: 2.0,
            read_latency_ms: 10.0,
            read_iops: 100.0,
            io_size_kib: 4.0,
            sequential_pct: 0.0,
        };
        let b = DeviceSample {
            read_oio: 6.0,
            read_latency_ms: 20.0,
            read_iops: 300.0,
            io_size_kib: 8.0,
            sequential_pct: 40.0,
        };
        let idle = DeviceSample {
            read_oio: 0.0,
            read_latency_ms: 0.0,
            read_iops: 0.0,
            io_size_kib: 0.0,
            sequential_pct: 0.0,
        };
        let s = aggregate(&[a, b, idle]).unwrap();
        assert_eq!(s.read_oio, 8.0);
        assert_eq!(s.read_iops, 400.0);
        assert!((s.read_latency_ms - 17.5).abs() < 1e-12);
        assert!((s.io_size_kib - 7.0).abs() < 1e-12);
        assert!((s.sequential_pct - 30.0).abs() < 1e-12);
        assert_eq!(aggregate(&[idle]), None);
    }

    proptest! {
        /// A noisy linear device gives back a slope near its own, and never a model with a
        /// non-positive performance.
        #[test]
        fn noisy_lines_give_their_slope_back(
            slope in 0.2f64..5.0, intercept in 0.0f64..10.0, seed in any::<u64>(),
        ) {
            let mut rng = crate::rng::SplitMix64::new(seed);
            let pts: Vec<(f64, f64)> = (0..200)
                .map(|_| {
                    let x = 1.0 + 63.0 * rng.next_f64();
                    (x, (slope * x + intercept) * (1.0 + 0.05 * rng.normal()))
                })
                .collect();
            let m = fit(&pts).unwrap();
            prop_assert!(m.performance > 0.0);
            prop_assert!((m.slope_ms_per_oio - slope).abs() / slope < 0.1,
                "slope {} vs {}", m.slope_ms_per_oio, slope);
        }
    }
}
