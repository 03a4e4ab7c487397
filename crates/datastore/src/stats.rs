//! Per-IO statistics: counters, latency histograms and outstanding IOs, kept with atomics so
//! the IO path never takes a lock to account for itself.
//!
//! Readers take a [`Snapshot`]; the difference of two snapshots is the activity in between
//! (rates, percentiles, mean outstanding IOs). Mean outstanding IOs over an interval comes from
//! Little's law: the sum of all IO latencies in the interval divided by its length, which
//! needs no sampling.
//!
//! For balancing (BASIL, DESIGN §8) an IO's position is classified when it is issued: it is
//! *sequential* when it starts within [`SEQUENTIAL_WINDOW`] bytes of where the previous IO
//! ended, *random* otherwise (the seek-distance test). Reads keep their own busy time, so an
//! interval yields the datastore's mean outstanding reads and mean read latency as well.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// Buckets below this hold exact microsecond values.
const LINEAR: usize = 16;
/// Sub-buckets per power of two above [`LINEAR`]: 8 gives a relative error under 12.5 %.
const SUB_BITS: u32 = 3;
const SUB: usize = 1 << SUB_BITS;
/// Enough buckets for any u64 microsecond value.
pub const BUCKETS: usize = LINEAR + (64 - 4) * SUB;

/// Index of the bucket holding `v` (microseconds).
pub fn bucket_of(v: u64) -> usize {
    if v < LINEAR as u64 {
        return v as usize;
    }
    let e = 63 - v.leading_zeros(); // >= 4
    let m = ((v >> (e - SUB_BITS)) & (SUB as u64 - 1)) as usize;
    LINEAR + (e as usize - 4) * SUB + m
}

/// Smallest value that falls into bucket `i`.
pub fn bucket_low(i: usize) -> u64 {
    if i < LINEAR {
        return i as u64;
    }
    let e = ((i - LINEAR) / SUB) as u32 + 4;
    let m = ((i - LINEAR) % SUB) as u64;
    (1u64 << e) | (m << (e - SUB_BITS))
}

/// Largest value that falls into bucket `i`.
pub fn bucket_high(i: usize) -> u64 {
    if i + 1 >= BUCKETS {
        return u64::MAX;
    }
    bucket_low(i + 1) - 1
}

/// A lock-free latency histogram in microseconds.
pub struct Histogram {
    buckets: Box<[AtomicU64]>,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            buckets: (0..BUCKETS).map(|_| AtomicU64::new(0)).collect(),
        }
    }
}

impl Histogram {
    pub fn record(&self, us: u64) {
        self.buckets[bucket_of(us)].fetch_add(1, Relaxed);
    }

    pub fn snapshot(&self) -> HistSnapshot {
        HistSnapshot {
            counts: self.buckets.iter().map(|b| b.load(Relaxed)).collect(),
        }
    }
}

/// Bucket counts at one moment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HistSnapshot {
    pub counts: Vec<u64>,
}

impl Default for HistSnapshot {
    fn default() -> Self {
        HistSnapshot {
            counts: vec![0; BUCKETS],
        }
    }
}

impl HistSnapshot {
    pub fn total(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// The counts recorded after `earlier`.
    pub fn since(&self, earlier: &HistSnapshot) -> HistSnapshot {
        HistSnapshot {
            counts: self
                .counts
                .iter()
                .zip(&earlier.counts)
                .map(|(a, b)| a.saturating_sub(*b))
                .collect(),
        }
    }

    /// The value at quantile `q` (0..=1), reported as the upper bound of its bucket; `None`
    /// when empty.
    pub fn quantile(&self, q: f64) -> Option<u64> {
        let total = self.total();
        if total == 0 {
            return None;
        }
        let rank = ((q.clamp(0.0, 1.0) * total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                // The last bucket is unbounded; report its floor rather than u64::MAX.
                return Some(if i + 1 == BUCKETS {
                    bucket_low(i)
                } else {
                    bucket_high(i)
                });
            }
        }
        None
    }
}

/// Which operation an IO was, for accounting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
    Flush,
    Trim,
    WriteZeroes,
}

/// An IO that starts within this many bytes of the previous IO's end (either side) counts as
/// sequential. 64 KiB: readahead-sized gaps and reordering among a queue of sequential IOs
/// still count as a stream, a random 4 KiB IO on a multi-GiB disk almost never does.
pub const SEQUENTIAL_WINDOW: u64 = 64 << 10;

/// Counters and histograms for one volume or datastore.
#[derive(Default)]
pub struct IoStats {
    reads: AtomicU64,
    writes: AtomicU64,
    read_bytes: AtomicU64,
    write_bytes: AtomicU64,
    flushes: AtomicU64,
    trims: AtomicU64,
    zeroes: AtomicU64,
    errors: AtomicU64,
    outstanding: AtomicU64,
    busy_us: AtomicU64,
    read_busy_us: AtomicU64,
    /// Where the last located IO ended, plus one (0: none yet).
    last_end: AtomicU64,
    located: AtomicU64,
    random: AtomicU64,
    located_reads: AtomicU64,
    random_reads: AtomicU64,
    read_lat: Histogram,
    write_lat: Histogram,
}

/// An IO that has started; finish it with [`IoStats::finish`].
#[must_use]
pub struct Started(Instant);

impl IoStats {
    pub fn start(&self) -> Started {
        self.outstanding.fetch_add(1, Relaxed);
        Started(Instant::now())
    }

    /// Classifies a read or write at `offset` of `len` bytes as sequential or random against
    /// the IO located before it; call it as the IO is issued.
    pub fn locate(&self, op: Op, offset: u64, len: u64) {
        if !matches!(op, Op::Read | Op::Write) {
            return;
        }
        let prev = self
            .last_end
            .swap(offset.saturating_add(len).saturating_add(1), Relaxed);
        let random = prev == 0 || (prev - 1).abs_diff(offset) > SEQUENTIAL_WINDOW;
        self.located.fetch_add(1, Relaxed);
        if random {
            self.random.fetch_add(1, Relaxed);
        }
        if op == Op::Read {
            self.located_reads.fetch_add(1, Relaxed);
            if random {
                self.random_reads.fetch_add(1, Relaxed);
            }
        }
    }

    pub fn finish(&self, started: Started, op: Op, bytes: u64, ok: bool) {
        let us = started.0.elapsed().as_micros() as u64;
        self.outstanding.fetch_sub(1, Relaxed);
        self.busy_us.fetch_add(us, Relaxed);
        if !ok {
            self.errors.fetch_add(1, Relaxed);
            return;
        }
        match op {
            Op::Read => {
                self.reads.fetch_add(1, Relaxed);
                self.read_busy_us.fetch_add(us, Relaxed);
                self.read_bytes.fetch_add(bytes, Relaxed);
                self.read_lat.record(us);
            }
            Op::Write => {
                self.writes.fetch_add(1, Relaxed);
                self.write_bytes.fetch_add(bytes, Relaxed);
                self.write_lat.record(us);
            }
            Op::Flush => {
                self.flushes.fetch_add(1, Relaxed);
            }
            Op::Trim => {
                self.trims.fetch_add(1, Relaxed);
            }
            Op::WriteZeroes => {
                self.zeroes.fetch_add(1, Relaxed);
            }
        }
    }

    pub fn outstanding(&self) -> u64 {
        self.outstanding.load(Relaxed)
    }

    /// IOs other than reads that have finished, and IOs that failed: while it moves, the
    /// datastore answers the IO a destager sends it (reads alone may still be answered by a
    /// datastore whose writes hang).
    pub fn answered_writes(&self) -> u64 {
        [
            &self.writes,
            &self.flushes,
            &self.trims,
            &self.zeroes,
            &self.errors,
        ]
        .iter()
        .map(|c| c.load(Relaxed))
        .sum()
    }

    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            at: Instant::now(),
            reads: self.reads.load(Relaxed),
            writes: self.writes.load(Relaxed),
            read_bytes: self.read_bytes.load(Relaxed),
            write_bytes: self.write_bytes.load(Relaxed),
            flushes: self.flushes.load(Relaxed),
            trims: self.trims.load(Relaxed),
            zeroes: self.zeroes.load(Relaxed),
            errors: self.errors.load(Relaxed),
            outstanding: self.outstanding.load(Relaxed),
            busy_us: self.busy_us.load(Relaxed),
            read_busy_us: self.read_busy_us.load(Relaxed),
            located: self.located.load(Relaxed),
            random: self.random.load(Relaxed),
            located_reads: self.located_reads.load(Relaxed),
            random_reads: self.random_reads.load(Relaxed),
            read_lat: self.read_lat.snapshot(),
            write_lat: self.write_lat.snapshot(),
        }
    }
}

/// Counters at one moment.
#[derive(Clone, Debug)]
pub struct Snapshot {
    pub at: Instant,
    pub reads: u64,
    pub writes: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub flushes: u64,
    pub trims: u64,
    pub zeroes: u64,
    pub errors: u64,
    pub outstanding: u64,
    pub busy_us: u64,
    pub read_busy_us: u64,
    pub located: u64,
    pub random: u64,
    pub located_reads: u64,
    pub random_reads: u64,
    pub read_lat: HistSnapshot,
    pub write_lat: HistSnapshot,
}

/// Activity between two snapshots.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Interval {
    pub seconds: f64,
    pub read_iops: f64,
    pub write_iops: f64,
    pub read_bytes_per_s: f64,
    pub write_bytes_per_s: f64,
    pub read_latency_us_p50: Option<u64>,
    pub read_latency_us_p99: Option<u64>,
    pub write_latency_us_p50: Option<u64>,
    pub write_latency_us_p99: Option<u64>,
    /// Mean IOs in flight over the interval (Little's law).
    pub outstanding_mean: f64,
    /// IOs in flight at the end of the interval.
    pub outstanding_now: u64,
    pub errors: u64,
    /// Reads and writes that completed in the interval.
    pub ios: u64,
    /// Mean size of those reads and writes, bytes (0 when none).
    pub io_size_mean: f64,
    /// Reads among them, percent (0 when none).
    pub read_pct: f64,
    /// Located IOs that were random (seek-distance test), percent (0 when none).
    pub random_pct: f64,
    /// Mean reads in flight over the interval (Little's law).
    pub read_outstanding_mean: f64,
    /// Mean read latency, microseconds (`None` when no reads).
    pub read_latency_us_mean: Option<f64>,
    /// Mean read size, bytes (0 when no reads).
    pub read_size_mean: f64,
    /// Located reads that were sequential, percent (0 when none).
    pub read_sequential_pct: f64,
}

impl Snapshot {
    pub fn since(&self, earlier: &Snapshot) -> Interval {
        let d = self.at.saturating_duration_since(earlier.at);
        let s = d.as_secs_f64().max(1e-9);
        let rl = self.read_lat.since(&earlier.read_lat);
        let wl = self.write_lat.since(&earlier.write_lat);
        let reads = self.reads.saturating_sub(earlier.reads);
        let writes = self.writes.saturating_sub(earlier.writes);
        let read_bytes = self.read_bytes.saturating_sub(earlier.read_bytes);
        let write_bytes = self.write_bytes.saturating_sub(earlier.write_bytes);
        let read_busy = self.read_busy_us.saturating_sub(earlier.read_busy_us);
        let located = self.located.saturating_sub(earlier.located);
        let random = self.random.saturating_sub(earlier.random);
        let located_reads = self.located_reads.saturating_sub(earlier.located_reads);
        let random_reads = self.random_reads.saturating_sub(earlier.random_reads);
        // Counters are read one by one while IOs go on, so a part may run one ahead of its
        // whole; a share never exceeds 1.
        let share = |part: u64, whole: u64| {
            if whole == 0 {
                0.0
            } else {
                (part as f64 / whole as f64).min(1.0)
            }
        };
        let ratio = |part: u64, whole: u64| {
            if whole == 0 {
                0.0
            } else {
                part as f64 / whole as f64
            }
        };
        Interval {
            ios: reads + writes,
            io_size_mean: ratio(read_bytes + write_bytes, reads + writes),
            read_pct: 100.0 * share(reads, reads + writes),
            random_pct: 100.0 * share(random, located),
            read_outstanding_mean: read_busy as f64 / (d.as_micros().max(1) as f64),
            read_latency_us_mean: (reads > 0).then(|| read_busy as f64 / reads as f64),
            read_size_mean: ratio(read_bytes, reads),
            read_sequential_pct: 100.0
                * share(located_reads.saturating_sub(random_reads), located_reads),
            seconds: d.as_secs_f64(),
            read_iops: reads as f64 / s,
            write_iops: writes as f64 / s,
            read_bytes_per_s: read_bytes as f64 / s,
            write_bytes_per_s: write_bytes as f64 / s,
            read_latency_us_p50: rl.quantile(0.5),
            read_latency_us_p99: rl.quantile(0.99),
            write_latency_us_p50: wl.quantile(0.5),
            write_latency_us_p99: wl.quantile(0.99),
            outstanding_mean: self.busy_us.saturating_sub(earlier.busy_us) as f64
                / (d.as_micros().max(1) as f64),
            outstanding_now: self.outstanding,
            errors: self.errors.saturating_sub(earlier.errors),
        }
    }
}

/// How long a stats interval lasts by default.
pub const INTERVAL_DEFAULT: Duration = Duration::from_secs(2);

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn buckets_tile_the_value_range() {
        assert_eq!(bucket_of(0), 0);
        assert_eq!(bucket_of(15), 15);
        assert_eq!(bucket_of(16), 16);
        assert_eq!(bucket_of(u64::MAX), BUCKETS - 1);
        for i in 0..BUCKETS - 1 {
            assert_eq!(
                bucket_high(i) + 1,
                bucket_low(i + 1),
                "gap after bucket {i}"
            );
            assert_eq!(bucket_of(bucket_low(i)), i);
            assert_eq!(bucket_of(bucket_high(i)), i);
        }
    }

    proptest! {
        #[test]
        fn bucket_bounds_hold_value_within_an_eighth(v in any::<u64>()) {
            let i = bucket_of(v);
            prop_assert!(bucket_low(i) <= v && v <= bucket_high(i));
            if v >= 16 {
                let width = bucket_high(i) - bucket_low(i) + 1;
                prop_assert!(width <= v / 8 + 1);
            }
        }
    }

    #[test]
    fn quantiles_follow_the_recorded_distribution() {
        let h = Histogram::default();
        for v in 1..=1000u64 {
            h.record(v);
        }
        let s = h.snapshot();
        let p50 = s.quantile(0.5).unwrap();
        let p99 = s.quantile(0.99).unwrap();
        assert!((500..=570).contains(&p50), "p50 {p50}");
        assert!((990..=1130).contains(&p99), "p99 {p99}");
        assert_eq!(HistSnapshot::default().quantile(0.5), None);
    }

    #[test]
    fn interval_counts_only_what_happened_since() {
        let st = IoStats::default();
        let t = st.start();
        st.finish(t, Op::Write, 4096, true);
        let a = st.snapshot();
        for _ in 0..3 {
            let t = st.start();
            st.finish(t, Op::Read, 512, true);
        }
        let t = st.start();
        st.finish(t, Op::Read, 512, false);
        let held = st.start();
        let b = st.snapshot();
        let i = b.since(&a);
        assert_eq!(i.errors, 1);
        assert_eq!(i.outstanding_now, 1);
        assert_eq!(b.reads - a.reads, 3);
        assert_eq!(b.read_bytes - a.read_bytes, 1536);
        assert_eq!(b.writes - a.writes, 0);
        assert!(i.write_latency_us_p50.is_none());
        assert!(i.read_latency_us_p50.is_some());
        st.finish(held, Op::Flush, 0, true);
        assert_eq!(st.outstanding(), 0);
    }

    fn io(st: &IoStats, op: Op, offset: u64, len: u64) {
        st.locate(op, offset, len);
        let t = st.start();
        st.finish(t, op, len, true);
    }

    #[test]
    fn seek_distance_classifies_streams_and_jumps() {
        let st = IoStats::default();
        let a = st.snapshot();
        // The first IO has nothing to follow: random. Then a stream of 8 reads, a gap inside
        // the window (still sequential), a jump (random) and a backwards jump (random).
        io(&st, Op::Read, 0, 4096);
        for i in 1..8 {
            io(&st, Op::Read, i * 4096, 4096);
        }
        io(&st, Op::Write, 8 * 4096 + SEQUENTIAL_WINDOW, 8192);
        io(&st, Op::Write, 1 << 30, 4096);
        io(&st, Op::Read, 4096, 4096);
        // Flushes are not positioned and do not break a stream.
        st.locate(Op::Flush, 0, 0);
        io(&st, Op::Read, 8192, 4096);
        let i = st.snapshot().since(&a);
        assert_eq!(i.ios, 12);
        assert!((i.random_pct - 100.0 * 3.0 / 12.0).abs() < 1e-9, "{i:?}");
        assert!((i.read_pct - 100.0 * 10.0 / 12.0).abs() < 1e-9);
        assert!((i.read_sequential_pct - 100.0 * 8.0 / 10.0).abs() < 1e-9);
        assert!((i.io_size_mean - (10.0 * 4096.0 + 8192.0 + 4096.0) / 12.0).abs() < 1e-9);
        assert!((i.read_size_mean - 4096.0).abs() < 1e-9);
        assert!(i.read_latency_us_mean.is_some());
        let quiet = st.snapshot();
        let i = st.snapshot().since(&quiet);
        assert_eq!((i.ios, i.random_pct, i.read_pct), (0, 0.0, 0.0));
        assert_eq!(i.read_latency_us_mean, None);
    }

    #[test]
    fn read_outstanding_follows_littles_law() {
        // Two reads held for (nearly) the whole interval: close to two reads in flight, never
        // more. (The bounds hold however long the sleep overshoots.)
        let st = IoStats::default();
        let a = st.snapshot();
        let r1 = st.start();
        let r2 = st.start();
        std::thread::sleep(Duration::from_millis(50));
        st.finish(r1, Op::Read, 4096, true);
        st.finish(r2, Op::Read, 4096, true);
        let w = st.start();
        st.finish(w, Op::Write, 4096, true);
        let i = st.snapshot().since(&a);
        assert!(
            i.read_outstanding_mean > 1.0 && i.read_outstanding_mean <= 2.0,
            "{}",
            i.read_outstanding_mean
        );
        let mean = i.read_latency_us_mean.unwrap();
        assert!(mean >= 50_000.0, "{mean}");
    }
}
