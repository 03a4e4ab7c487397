//! The few statistics the models need: percentiles (BASIL characterizes workloads at their
//! 90th percentile and takes medians of pairwise constants), a least-squares line (the device
//! model), and the population mean and standard deviation (the imbalance fraction).
//!
//! Every function ignores non-finite inputs rather than letting one NaN from a bad sample
//! poison a model, and answers `None` when there is nothing left to compute from.

/// The `pct`-th percentile (0–100) of the finite values, interpolating linearly between the
/// two closest ranks (Hyndman and Fan's type 7, what NumPy and spreadsheets use), so the 50th
/// percentile of an even-sized set is the mean of its two middle values.
pub fn percentile(values: &[f64], pct: f64) -> Option<f64> {
    if !(0.0..=100.0).contains(&pct) {
        return None;
    }
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let rank = pct / 100.0 * (v.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    Some(v[lo] + (v[hi] - v[lo]) * (rank - lo as f64))
}

/// The median of the finite values.
pub fn median(values: &[f64]) -> Option<f64> {
    percentile(values, 50.0)
}

/// Mean of the finite values.
pub fn mean(values: &[f64]) -> Option<f64> {
    let (sum, n) = values
        .iter()
        .filter(|x| x.is_finite())
        .fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    (n > 0).then(|| sum / n as f64)
}

/// Population standard deviation of the finite values.
pub fn std_dev(values: &[f64]) -> Option<f64> {
    let m = mean(values)?;
    let (ss, n) = values
        .iter()
        .filter(|x| x.is_finite())
        .fold((0.0, 0usize), |(s, n), x| (s + (x - m).powi(2), n + 1));
    Some((ss / n as f64).sqrt())
}

/// An ordinary least-squares line `y = slope·x + intercept`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LineFit {
    pub slope: f64,
    pub intercept: f64,
    /// Coefficient of determination: the share of the variance of `y` the line explains.
    pub r_squared: f64,
    /// Points the fit used (finite ones).
    pub points: usize,
}

/// The least-squares line through the finite points; `None` with fewer than two of them or
/// when every `x` is the same (no slope can be told from such data).
pub fn fit_line(points: &[(f64, f64)]) -> Option<LineFit> {
    let pts: Vec<(f64, f64)> = points
        .iter()
        .copied()
        .filter(|(x, y)| x.is_finite() && y.is_finite())
        .collect();
    if pts.len() < 2 {
        return None;
    }
    let n = pts.len() as f64;
    let mx = pts.iter().map(|p| p.0).sum::<f64>() / n;
    let my = pts.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = pts.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let syy: f64 = pts.iter().map(|p| (p.1 - my).powi(2)).sum();
    // Relative to the spread of the x values themselves: all-equal x means no slope.
    if sxx
        <= f64::EPSILON
            * pts
                .iter()
                .map(|p| p.0 * p.0)
                .sum::<f64>()
                .max(f64::MIN_POSITIVE)
    {
        return None;
    }
    let slope = sxy / sxx;
    let intercept = my - slope * mx;
    let ss_res: f64 = pts
        .iter()
        .map(|p| (p.1 - (slope * p.0 + intercept)).powi(2))
        .sum();
    let r_squared = if syy > 0.0 {
        (1.0 - ss_res / syy).clamp(0.0, 1.0)
    } else {
        1.0 // every y equal and the flat line hits them all
    };
    Some(LineFit {
        slope,
        intercept,
        r_squared,
        points: pts.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn percentiles_interpolate_between_ranks() {
        let v = [5.0, 1.0, 4.0, 2.0, 3.0];
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        assert_eq!(percentile(&v, 100.0), Some(5.0));
        assert_eq!(percentile(&v, 50.0), Some(3.0));
        assert!((percentile(&v, 90.0).unwrap() - 4.6).abs() < 1e-12);
        assert_eq!(median(&[1.0, 2.0, 3.0, 10.0]), Some(2.5));
        assert_eq!(percentile(&[7.0], 90.0), Some(7.0));
    }

    #[test]
    fn percentiles_of_nothing_or_out_of_range_are_none() {
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(percentile(&[f64::NAN, f64::INFINITY], 50.0), None);
        assert_eq!(percentile(&[1.0], 101.0), None);
        assert_eq!(percentile(&[1.0], -1.0), None);
        // A NaN among good values is ignored, not sorted into the middle.
        assert_eq!(median(&[1.0, f64::NAN, 3.0]), Some(2.0));
    }

    #[test]
    fn a_line_through_exact_points_is_recovered() {
        let pts: Vec<(f64, f64)> = (0..10).map(|i| (i as f64, 2.5 * i as f64 + 1.0)).collect();
        let f = fit_line(&pts).unwrap();
        assert!((f.slope - 2.5).abs() < 1e-12);
        assert!((f.intercept - 1.0).abs() < 1e-12);
        assert!((f.r_squared - 1.0).abs() < 1e-12);
        assert_eq!(f.points, 10);
    }

    #[test]
    fn no_line_without_spread_in_x() {
        assert_eq!(fit_line(&[(3.0, 1.0), (3.0, 2.0), (3.0, 5.0)]), None);
        assert_eq!(fit_line(&[(3.0, 1.0)]), None);
    }

    #[test]
    fn mean_and_population_std_dev() {
        assert_eq!(mean(&[2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]), Some(5.0));
        assert_eq!(
            std_dev(&[2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]),
            Some(2.0)
        );
        assert_eq!(mean(&[]), None);
    }

    proptest! {
        #[test]
        fn percentiles_are_monotone_and_within_the_data(
            v in proptest::collection::vec(-1e6f64..1e6, 1..50), p in 0.0f64..100.0, dp in 0.0f64..10.0,
        ) {
            let a = percentile(&v, p).unwrap();
            let b = percentile(&v, (p + dp).min(100.0)).unwrap();
            let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            prop_assert!(a <= b);
            prop_assert!(lo <= a && b <= hi);
        }

        #[test]
        fn the_fitted_line_has_the_least_squared_error(
            pts in proptest::collection::vec((0.0f64..100.0, 0.0f64..100.0), 3..30),
            ds in -1.0f64..1.0, di in -1.0f64..1.0,
        ) {
            if let Some(f) = fit_line(&pts) {
                let sse = |s: f64, i: f64| pts.iter().map(|p| (p.1 - s * p.0 - i).powi(2)).sum::<f64>();
                let best = sse(f.slope, f.intercept);
                prop_assert!(best <= sse(f.slope + ds * 0.01, f.intercept + di * 0.01) + 1e-6);
                prop_assert!((0.0..=1.0).contains(&f.r_squared));
            }
        }
    }
}
