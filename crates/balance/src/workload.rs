//! Workload model (BASIL §3): how much load a workload puts on whichever datastore it runs on.
//!
//! BASIL observed that a workload's average IO latency is close to linear in each of four
//! characteristics that belong to the workload rather than to the device — outstanding IOs,
//! IO size, read ratio and randomness — and modeled it as a product (its Equation 1):
//!
//! ```text
//! latency = (K1 + OIO)(K2 + size_kib)(K3 + read%/100)(K4 + random%/100) / K5
//! ```
//!
//! K5 belongs to the device (the paper doubled it when it doubled the spindles), so the
//! numerator alone is the workload's *load* `L`, comparable across datastores. Each
//! characteristic is taken at its 90th percentile over the sampling intervals, not at its
//! mean: storage workloads are bursty, averages are low and jumpy, and a migration takes hours,
//! so a decision should hold for the busy periods rather than the average one (§6.1).
//!
//! # Calibration
//!
//! [`calibrate`] follows §3 to the letter. From controlled experiments (the paper ran the
//! cross product OIO {4, 8, 16, 32, 64} × size {8, 16, 32, 128, 256, 512} KiB × read % and
//! random % {0, 25, 50, 75, 100}: 750 of them), K1 comes from every pair of experiments that
//! differ in OIO only: dividing their two Equations 1 cancels everything else,
//! `L1/L2 = (K1 + OIO1)/(K1 + OIO2)`, so `K1 = (OIO1 − OIO2·L1/L2)/(L1/L2 − 1)` (Equation 3).
//! K1 is the median over all such pairs, because pairs whose latencies are nearly equal divide
//! by almost zero and throw wild values. K2, K3 and K4 the same way, varying one parameter
//! each. K5 is then the least-squares fit of measured latency against the numerator
//! (`latency ≈ numerator / K5`, a line through the origin).
//!
//! A device may not respond to a parameter at all (an SSD to randomness, an emulated LUN
//! with a fixed per-IO delay to read share): every pair's latency ratio is then 1 plus noise,
//! Equation 3 divides noise by noise, and the median K can come out negative, which would make
//! loads negative. The paper is silent on this. Such a parameter is marked *insensitive*
//! (median latency change across its pairs under [`SENSITIVITY_MIN`], or a median K that is
//! not positive) and gets `K = `[`K_INSENSITIVE`]` × its range`: its factor is then constant
//! to within 0.1 %, which is what "latency does not depend on it" means in Equation 1.
//!
//! # Defaults
//!
//! The paper publishes no values for K1–K4; it only says they "lie in a narrow range even
//! when measured across devices", so a fixed set may be used, or a per-device calibration run
//! when a datastore is provisioned. [`Constants::DEFAULT`] is what the paper's own procedure
//! gives on the paper's own calibration setup — the 750 experiments on a 4-spindle LUN — run
//! on the simulated spindles of [`crate::sim`] ([`crate::sim::Physics::PAPER_LINEAR`], whose
//! parameters come from the paper's measurements and textbook 2010 FC disks; the linear
//! queueing because §3's LUN was a striped RAID-0 and the paper found K1 positive). A test
//! keeps the two in step. Operators of other hardware (SSDs above all, where randomness matters little
//! and size a lot) should calibrate.

use serde::{Deserialize, Serialize};

use crate::stats;

/// The percentile at which workload characteristics are taken (BASIL §6.1).
pub const CHARACTERIZATION_PERCENTILE: f64 = 90.0;

/// The four characteristics of a workload that BASIL treats as its own, independent of the
/// device: one sampling interval's averages, or a workload's summary over many.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Characteristics {
    /// Average outstanding IOs.
    pub oio: f64,
    /// Average IO size in KiB.
    pub io_size_kib: f64,
    /// Share of reads, 0–100.
    pub read_pct: f64,
    /// Share of random IOs (from seek distance), 0–100.
    pub random_pct: f64,
}

impl Characteristics {
    /// Finite, non-negative, and percentages within 0–100.
    pub fn is_valid(&self) -> bool {
        let pct = 0.0..=100.0;
        self.oio.is_finite()
            && self.oio >= 0.0
            && self.io_size_kib.is_finite()
            && self.io_size_kib >= 0.0
            && pct.contains(&self.read_pct)
            && pct.contains(&self.random_pct)
    }
}

/// A workload's summary: each characteristic at its [`CHARACTERIZATION_PERCENTILE`] over the
/// valid samples, independently (the paper builds one distribution per parameter). `None`
/// without a valid sample.
pub fn characterize(samples: &[Characteristics]) -> Option<Characteristics> {
    let valid: Vec<&Characteristics> = samples.iter().filter(|s| s.is_valid()).collect();
    let at = |f: fn(&Characteristics) -> f64| {
        let v: Vec<f64> = valid.iter().map(|s| f(s)).collect();
        stats::percentile(&v, CHARACTERIZATION_PERCENTILE)
    };
    Some(Characteristics {
        oio: at(|s| s.oio)?,
        io_size_kib: at(|s| s.io_size_kib)?,
        read_pct: at(|s| s.read_pct)?,
        random_pct: at(|s| s.random_pct)?,
    })
}

/// K1–K4 of Equation 1: the offsets that make latency linear in each characteristic.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Constants {
    /// Outstanding IOs.
    pub k1: f64,
    /// KiB.
    pub k2: f64,
    /// Read fraction (0–1).
    pub k3: f64,
    /// Random fraction (0–1).
    pub k4: f64,
}

impl Constants {
    /// The paper's calibration on a simulated 4-spindle LUN (see the module doc):
    /// - K1 = 4: alone on k spindles a workload sees one service time plus its own queue,
    ///   `s·(1 + OIO/k)`, so latency is proportional to `k + OIO`;
    /// - K2 = 248 KiB: positioning time over transfer time per KiB, at the median randomness;
    /// - K3 = 0.111: the array's cache makes a write cost a tenth of a read ("read latencies
    ///   ... almost an order of magnitude higher", §3), and `r + 0.1(1 − r) ∝ r + 1/9`;
    /// - K4 = 0.207: sequential positioning plus transfer over the cost of randomness, at the
    ///   median IO size.
    pub const DEFAULT: Constants = Constants {
        k1: 4.0,
        k2: 248.0,
        k3: 0.111,
        k4: 0.207,
    };

    /// The workload's load `L`, the numerator of Equation 1.
    pub fn load(&self, c: &Characteristics) -> f64 {
        (self.k1 + c.oio)
            * (self.k2 + c.io_size_kib)
            * (self.k3 + c.read_pct / 100.0)
            * (self.k4 + c.random_pct / 100.0)
    }
}

impl Default for Constants {
    fn default() -> Constants {
        Constants::DEFAULT
    }
}

/// One controlled experiment: a workload run alone with fixed characteristics, and the
/// average latency it saw.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Experiment {
    pub characteristics: Characteristics,
    pub latency_ms: f64,
}

/// The result of [`calibrate`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    pub constants: Constants,
    /// Device constant: `latency_ms = load / k5`.
    pub k5: f64,
    /// How many experiment pairs each of K1–K4 is the median of.
    pub pairs: [usize; 4],
    /// Median of |predicted − measured| / measured over the experiments.
    pub median_relative_error: f64,
    /// Parameters (OIO, size, read, random) the device did not respond to; their K is set so
    /// their factor is constant.
    pub insensitive: [bool; 4],
}

/// A parameter whose pairs change latency by less than this (median of |L1/L2 − 1|) is one
/// the device does not respond to.
pub const SENSITIVITY_MIN: f64 = 0.03;

/// An insensitive parameter's K, in multiples of the parameter's range in the experiments (or
/// of 1 if they did not vary it): its factor `(K + x)` then varies by at most 0.1 %.
pub const K_INSENSITIVE: f64 = 1000.0;

impl Calibration {
    /// Predicted latency of a workload with these characteristics on the calibrated device.
    pub fn latency_ms(&self, c: &Characteristics) -> f64 {
        self.constants.load(c) / self.k5
    }
}

/// Why a calibration failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CalibrationError {
    #[error(
        "no pair of experiments differs only in {parameter}: vary one parameter at a time \
         while holding the other three fixed"
    )]
    NoPairs { parameter: &'static str },
    #[error("the fitted constants give a non-positive load for some experiment: the model does not fit this device")]
    NonPositiveLoad,
    #[error("latency does not grow with the fitted load (K5 fit {k5}): the model does not fit this device")]
    BadFit { k5: f64 },
}

/// The parameters of Equation 1 in the units it uses (read and random as fractions).
fn params(c: &Characteristics) -> [f64; 4] {
    [
        c.oio,
        c.io_size_kib,
        c.read_pct / 100.0,
        c.random_pct / 100.0,
    ]
}

const PARAMETER_NAMES: [&str; 4] = ["OIO", "IO size", "read %", "random %"];

/// K1–K4 by medians of pairwise ratios and K5 by least squares (BASIL §3; see the module
/// doc). Experiments with invalid characteristics or a non-positive latency are ignored.
/// Pairs are experiments whose other three parameters are *exactly* equal: controlled
/// experiments set them exactly, and approximate matching would let a second parameter's
/// effect leak into the ratio.
pub fn calibrate(experiments: &[Experiment]) -> Result<Calibration, CalibrationError> {
    let good: Vec<&Experiment> = experiments
        .iter()
        .filter(|e| e.characteristics.is_valid() && e.latency_ms.is_finite() && e.latency_ms > 0.0)
        .collect();
    let points: Vec<([f64; 4], f64)> = good
        .iter()
        .map(|e| (params(&e.characteristics), e.latency_ms))
        .collect();

    let mut ks = [0.0; 4];
    let mut pairs = [0usize; 4];
    let mut insensitive = [false; 4];
    for p in 0..4 {
        let (estimates, changes) = pairwise_estimates(&points, p);
        pairs[p] = estimates.len();
        let k = stats::median(&estimates).ok_or(CalibrationError::NoPairs {
            parameter: PARAMETER_NAMES[p],
        })?;
        let change = stats::median(&changes).unwrap_or(0.0);
        if change < SENSITIVITY_MIN || !(k.is_finite() && k > 0.0) {
            insensitive[p] = true;
            let (lo, hi) = points
                .iter()
                .fold((f64::MAX, f64::MIN), |(lo, hi), (x, _)| {
                    (lo.min(x[p]), hi.max(x[p]))
                });
            let range = if hi > lo { hi - lo } else { 1.0 };
            ks[p] = K_INSENSITIVE * range;
        } else {
            ks[p] = k;
        }
    }
    let constants = Constants {
        k1: ks[0],
        k2: ks[1],
        k3: ks[2],
        k4: ks[3],
    };

    // K5: least squares of latency = numerator · a through the origin, a = 1/K5.
    let mut sxy = 0.0;
    let mut sxx = 0.0;
    for e in &good {
        let x = constants.load(&e.characteristics);
        if !(x.is_finite() && x > 0.0) {
            return Err(CalibrationError::NonPositiveLoad);
        }
        sxy += x * e.latency_ms;
        sxx += x * x;
    }
    let a = sxy / sxx;
    if !(a.is_finite() && a > 0.0) {
        return Err(CalibrationError::BadFit { k5: 1.0 / a });
    }
    let k5 = 1.0 / a;
    let errors: Vec<f64> = good
        .iter()
        .map(|e| (constants.load(&e.characteristics) / k5 - e.latency_ms).abs() / e.latency_ms)
        .collect();
    Ok(Calibration {
        constants,
        k5,
        pairs,
        median_relative_error: stats::median(&errors).unwrap_or(f64::NAN),
        insensitive,
    })
}

/// Equation 3 for parameter `p` over every pair of experiments that differ in `p` only, and
/// each pair's relative latency change |L1/L2 − 1|.
fn pairwise_estimates(good: &[([f64; 4], f64)], p: usize) -> (Vec<f64>, Vec<f64>) {
    // Group by the exact bits of the other three parameters.
    let key = |x: &[f64; 4]| -> [u64; 3] {
        let mut k = [0u64; 3];
        let mut j = 0;
        for (i, v) in x.iter().enumerate() {
            if i != p {
                k[j] = v.to_bits();
                j += 1;
            }
        }
        k
    };
    let mut groups: std::collections::BTreeMap<[u64; 3], Vec<(f64, f64)>> =
        std::collections::BTreeMap::new();
    for (x, lat) in good {
        groups.entry(key(x)).or_default().push((x[p], *lat));
    }
    let mut out = Vec::new();
    let mut changes = Vec::new();
    for members in groups.values() {
        for (i, &(x1, l1)) in members.iter().enumerate() {
            for &(x2, l2) in &members[i + 1..] {
                if x1 == x2 {
                    continue; // a repeat of the same experiment says nothing about K
                }
                let r = l1 / l2;
                changes.push((r - 1.0).abs());
                let k = (x1 - x2 * r) / (r - 1.0);
                if k.is_finite() {
                    out.push(k);
                }
            }
        }
    }
    (out, changes)
}

/// The cross product of the paper's 750 calibration experiments (§3), without latencies.
pub fn paper_experiment_grid() -> Vec<Characteristics> {
    const OIO: [f64; 5] = [4.0, 8.0, 16.0, 32.0, 64.0];
    const SIZE_KIB: [f64; 6] = [8.0, 16.0, 32.0, 128.0, 256.0, 512.0];
    const PCT: [f64; 5] = [0.0, 25.0, 50.0, 75.0, 100.0];
    let mut out = Vec::with_capacity(750);
    for oio in OIO {
        for io_size_kib in SIZE_KIB {
            for read_pct in PCT {
                for random_pct in PCT {
                    out.push(Characteristics {
                        oio,
                        io_size_kib,
                        read_pct,
                        random_pct,
                    });
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;
    use proptest::prelude::*;

    fn ch(oio: f64, size: f64, read: f64, random: f64) -> Characteristics {
        Characteristics {
            oio,
            io_size_kib: size,
            read_pct: read,
            random_pct: random,
        }
    }

    /// Latencies from Equation 1 with known constants and multiplicative Gaussian noise.
    fn synthetic(k: Constants, k5: f64, noise: f64, seed: u64) -> Vec<Experiment> {
        let mut rng = SplitMix64::new(seed);
        paper_experiment_grid()
            .into_iter()
            .map(|c| Experiment {
                characteristics: c,
                latency_ms: k.load(&c) / k5 * (1.0 + noise * rng.normal()).max(0.05),
            })
            .collect()
    }

    #[test]
    fn load_is_the_numerator_of_equation_1() {
        let k = Constants {
            k1: 1.0,
            k2: 2.0,
            k3: 0.5,
            k4: 0.25,
        };
        // (1+3)(2+8)(0.5+0.5)(0.25+0.75) = 40
        assert!((k.load(&ch(3.0, 8.0, 50.0, 75.0)) - 40.0).abs() < 1e-12);
    }

    #[test]
    fn characterization_takes_each_parameter_at_its_90th_percentile() {
        let samples: Vec<Characteristics> = (0..=10)
            .map(|i| {
                let i = f64::from(i);
                ch(i, 100.0 - i, 10.0 * i, 50.0)
            })
            .collect();
        let c = characterize(&samples).unwrap();
        assert!((c.oio - 9.0).abs() < 1e-9);
        assert!((c.io_size_kib - 99.0).abs() < 1e-9); // each parameter on its own
        assert!((c.read_pct - 90.0).abs() < 1e-9);
        assert_eq!(c.random_pct, 50.0);
    }

    #[test]
    fn characterization_skips_invalid_samples_and_needs_one_valid() {
        assert_eq!(characterize(&[]), None);
        assert_eq!(characterize(&[ch(f64::NAN, 8.0, 50.0, 50.0)]), None);
        let c = characterize(&[ch(4.0, 8.0, 50.0, 50.0), ch(400.0, 8.0, 150.0, 50.0)]).unwrap();
        assert_eq!(c.oio, 4.0);
    }

    #[test]
    fn calibration_recovers_exact_constants_without_noise() {
        let k = Constants {
            k1: 3.0,
            k2: 40.0,
            k3: 0.3,
            k4: 1.5,
        };
        let cal = calibrate(&synthetic(k, 500.0, 0.0, 1)).unwrap();
        for (got, want) in [
            (cal.constants.k1, k.k1),
            (cal.constants.k2, k.k2),
            (cal.constants.k3, k.k3),
            (cal.constants.k4, k.k4),
            (cal.k5, 500.0),
        ] {
            assert!((got - want).abs() < 1e-6 * want, "{got} vs {want}");
        }
        // OIO pairs: 150 groups × C(5,2); size: 125 × C(6,2); read and random: 150 × C(5,2).
        assert_eq!(cal.pairs, [1500, 1875, 1500, 1500]);
        assert!(cal.median_relative_error < 1e-9);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        /// With 5 % latency noise the medians of pairwise estimates still land near the truth.
        #[test]
        fn calibration_recovers_known_constants_from_noisy_data(
            k1 in 1.0f64..10.0, k2 in 10.0f64..300.0, k3 in 0.05f64..1.0, k4 in 0.1f64..3.0,
            k5 in 10.0f64..1000.0, seed in any::<u64>(),
        ) {
            let k = Constants { k1, k2, k3, k4 };
            let cal = calibrate(&synthetic(k, k5, 0.05, seed)).unwrap();
            let rel = |got: f64, want: f64| (got - want).abs() / want;
            prop_assert!(rel(cal.constants.k1, k1) < 0.15, "K1 {} vs {}", cal.constants.k1, k1);
            prop_assert!(rel(cal.constants.k2, k2) < 0.15, "K2 {} vs {}", cal.constants.k2, k2);
            prop_assert!(rel(cal.constants.k3, k3) < 0.15, "K3 {} vs {}", cal.constants.k3, k3);
            prop_assert!(rel(cal.constants.k4, k4) < 0.15, "K4 {} vs {}", cal.constants.k4, k4);
            prop_assert!(rel(cal.k5, k5) < 0.15, "K5 {} vs {}", cal.k5, k5);
            prop_assert!(cal.median_relative_error < 0.06);
        }
    }

    #[test]
    fn calibration_marks_parameters_the_device_ignores() {
        // A device whose latency depends on OIO and size only (an emulated LUN with a fixed
        // delay per IO): read share and randomness change nothing but the noise.
        let mut rng = SplitMix64::new(7);
        let exps: Vec<Experiment> = paper_experiment_grid()
            .into_iter()
            .map(|c| Experiment {
                characteristics: c,
                latency_ms: (4.0 + c.oio) * (60.0 + c.io_size_kib) / 900.0
                    * (1.0 + 0.01 * (rng.next_f64() - 0.5)),
            })
            .collect();
        let cal = calibrate(&exps).unwrap();
        assert_eq!(cal.insensitive, [false, false, true, true]);
        let k = cal.constants;
        assert!(
            (k.k1 - 4.0).abs() < 0.2 && (k.k2 - 60.0).abs() < 3.0,
            "{k:?}"
        );
        assert_eq!((k.k3, k.k4), (K_INSENSITIVE, K_INSENSITIVE)); // ranges of 1
                                                                  // Loads stay positive, and the model predicts the device.
        assert!(exps.iter().all(|e| k.load(&e.characteristics) > 0.0));
        assert!(
            cal.median_relative_error < 0.01,
            "{}",
            cal.median_relative_error
        );
        // Read share and randomness no longer move a workload's load.
        let a = k.load(&ch(8.0, 8.0, 0.0, 0.0));
        let b = k.load(&ch(8.0, 8.0, 100.0, 100.0));
        assert!((b / a - 1.0).abs() < 0.003, "{a} vs {b}");
    }

    #[test]
    fn calibration_without_controlled_pairs_says_what_is_missing() {
        // Every experiment differs in OIO *and* size: no pair isolates either.
        let exps: Vec<Experiment> = (1..6)
            .map(|i| Experiment {
                characteristics: ch(f64::from(i), f64::from(i) * 8.0, 50.0, 50.0),
                latency_ms: f64::from(i),
            })
            .collect();
        assert_eq!(
            calibrate(&exps),
            Err(CalibrationError::NoPairs { parameter: "OIO" })
        );
    }

    #[test]
    fn the_defaults_rank_heavier_workloads_higher() {
        let k = Constants::DEFAULT;
        let base = ch(8.0, 8.0, 70.0, 100.0);
        for heavier in [
            ch(16.0, 8.0, 70.0, 100.0),
            ch(8.0, 64.0, 70.0, 100.0),
            ch(8.0, 8.0, 100.0, 100.0),
        ] {
            assert!(k.load(&heavier) > k.load(&base));
        }
        assert!(k.load(&ch(8.0, 8.0, 70.0, 50.0)) < k.load(&base));
    }
}
