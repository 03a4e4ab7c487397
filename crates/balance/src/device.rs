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
//! latency is averaged weighted by IOPS (§6.1). [`combine`] does it for series of intervals
//! that hosts publish at their own pace, taking each interval once all of them have it.
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

/// One host's recent intervals of one datastore, as it publishes them for the others.
/// Intervals are numbered by wall-clock time (`floor(unix seconds / interval)`), so every
/// host's interval `t` covers the same seconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HostSeries {
    pub host: String,
    /// The last interval the host has sampled: it read nothing in the intervals up to here
    /// for which it has no sample.
    pub through: u64,
    /// `(interval, sample)` for the intervals in which it read, oldest first.
    pub samples: Vec<(u64, DeviceSample)>,
}

/// A datastore's intervals as all the hosts that use it saw them together ([`combine`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct PodSeries {
    /// Every interval up to here is complete: each host counted has published past it.
    pub through: u64,
    /// `(interval, aggregated sample)` for the complete intervals with reads, oldest first.
    pub samples: Vec<(u64, DeviceSample)>,
    /// The hosts whose samples are in it.
    pub hosts: Vec<String>,
}

/// Combines hosts' series of one datastore interval by interval ([`aggregate`]).
///
/// An interval is complete once every host counted has published through it: taking it
/// before a host has reported would understate the outstanding IOs, and an interval is
/// taken once only. A host more than `max_lag` intervals behind the newest is not counted:
/// it has stopped (its published series goes when its lease expires), and must not hold
/// the others back. Its samples still count where they exist.
pub fn combine(series: &[HostSeries], max_lag: u64) -> PodSeries {
    let Some(newest) = series.iter().map(|s| s.through).max() else {
        return PodSeries::default();
    };
    let through = series
        .iter()
        .map(|s| s.through)
        .filter(|t| *t + max_lag >= newest)
        .min()
        .unwrap_or(newest);
    let mut by_t: std::collections::BTreeMap<u64, Vec<DeviceSample>> = Default::default();
    let mut hosts = Vec::new();
    for s in series {
        let mut any = false;
        for (t, x) in &s.samples {
            if *t <= through && *t <= s.through {
                by_t.entry(*t).or_default().push(*x);
                any = true;
            }
        }
        if any {
            hosts.push(s.host.clone());
        }
    }
    hosts.sort();
    PodSeries {
        through,
        samples: by_t
            .into_iter()
            .filter_map(|(t, xs)| aggregate(&xs).map(|a| (t, a)))
            .collect(),
        hosts,
    }
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

    fn series(host: &str, through: u64, samples: &[(u64, f64)]) -> HostSeries {
        HostSeries {
            host: host.into(),
            through,
            samples: samples
                .iter()
                .map(|(t, oio)| (*t, sample(*oio, 2.0 * oio + 1.0)))
                .collect(),
        }
    }

    #[test]
    fn one_host_is_its_own_pod() {
        let a = series("a", 9, &[(5, 1.0), (7, 3.0), (9, 2.0)]);
        let p = combine(std::slice::from_ref(&a), 4);
        assert_eq!(p.through, 9);
        assert_eq!(p.samples, a.samples);
        assert_eq!(p.hosts, vec!["a".to_string()]);
        assert_eq!(combine(&[], 4), PodSeries::default());
    }

    #[test]
    fn intervals_wait_for_every_live_host_and_not_for_a_stopped_one() {
        let a = series("a", 10, &[(8, 1.0), (9, 1.0), (10, 1.0)]);
        let b = series("b", 9, &[(8, 2.0), (9, 2.0)]);
        // b has not published interval 10 yet: it is not taken with a's alone.
        let p = combine(&[a.clone(), b.clone()], 4);
        assert_eq!(p.through, 9);
        let oio: Vec<(u64, f64)> = p.samples.iter().map(|(t, s)| (*t, s.read_oio)).collect();
        assert_eq!(oio, vec![(8, 3.0), (9, 3.0)]);
        assert_eq!(p.hosts, vec!["a".to_string(), "b".to_string()]);
        // b stopped at 9 long ago: a's intervals go on without it, b's samples still count.
        let a = series("a", 20, &[(9, 1.0), (15, 1.0), (20, 1.0)]);
        let p = combine(&[a, b], 4);
        assert_eq!(p.through, 20);
        let oio: Vec<(u64, f64)> = p.samples.iter().map(|(t, s)| (*t, s.read_oio)).collect();
        assert_eq!(oio, vec![(8, 2.0), (9, 3.0), (15, 1.0), (20, 1.0)]);
    }

    proptest! {
        /// However the hosts' series fall, every interval combined is complete for every
        /// live host, holds exactly the sum of the outstanding reads reported for it, and
        /// nothing past `through` is taken.
        #[test]
        fn combined_intervals_are_complete_sums(
            hosts in proptest::collection::vec(
                (0u64..40, proptest::collection::btree_map(0u64..40, 1u32..50, 0..20)),
                1..5,
            ),
            max_lag in 0u64..10,
        ) {
            let series: Vec<HostSeries> = hosts
                .iter()
                .enumerate()
                .map(|(i, (through, m))| HostSeries {
                    host: format!("h{i}"),
                    through: *through,
                    samples: m
                        .iter()
                        .filter(|(t, _)| **t <= *through)
                        .map(|(t, oio)| (*t, sample(f64::from(*oio), 1.0)))
                        .collect(),
                })
                .collect();
            let p = combine(&series, max_lag);
            let newest = series.iter().map(|s| s.through).max().unwrap();
            for s in &series {
                if s.through + max_lag >= newest {
                    prop_assert!(p.through <= s.through, "interval {} taken before {} had it", p.through, s.host);
                }
            }
            prop_assert!(p.through + max_lag >= newest);
            let mut last = None;
            for (t, x) in &p.samples {
                prop_assert!(*t <= p.through);
                prop_assert!(last.is_none_or(|l| l < *t), "intervals in order, once each");
                last = Some(*t);
                let want: f64 = series
                    .iter()
                    .flat_map(|s| s.samples.iter())
                    .filter(|(u, _)| u == t)
                    .map(|(_, s)| s.read_oio)
                    .sum();
                prop_assert!((x.read_oio - want).abs() < 1e-9);
            }
            // Every reported interval up to `through` is there.
            for s in &series {
                for (t, _) in &s.samples {
                    if *t <= p.through {
                        prop_assert!(p.samples.iter().any(|(u, _)| u == t));
                    }
                }
            }
        }
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
