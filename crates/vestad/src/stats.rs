//! Statistics intervals: every `stats.interval_s` a sampler snapshots the counters of each
//! volume and datastore; the difference to the previous snapshot is the interval the admin
//! API reports (rates, latency percentiles, mean outstanding IOs).
//!
//! The sampler also keeps a bounded history (`stats.history` intervals) for balancing
//! (DESIGN §8): per volume, each interval with IO as the workload model's characteristics
//! (mean outstanding IOs, IO size, read %, random % from seek distance) and its IOPS; per
//! datastore, each interval with reads as a ⟨outstanding reads, read latency⟩ sample with the
//! reads' size and sequentiality, which the device model filters. Volume histories follow the
//! volume's name, not its datastore: a workload's characteristics are its own.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use balance::{Characteristics, DeviceSample};
use datastore::stats::{Interval, Snapshot};
use vesta_api as api;

use crate::daemon::Daemon;

/// One interval of a volume, as the workload model sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct VolumeSample {
    pub chars: Characteristics,
    pub iops: f64,
}

pub struct Sampler {
    prev: HashMap<(Which, String), Snapshot>,
    latest: HashMap<(Which, String), Interval>,
    pub interval_s: f64,
    /// Intervals kept per volume and datastore.
    pub history: usize,
    volumes: HashMap<String, VecDeque<VolumeSample>>,
    datastores: HashMap<String, VecDeque<DeviceSample>>,
}

/// What a volume interval tells the workload model; `None` if the volume did no IO.
pub fn volume_sample(i: &Interval) -> Option<VolumeSample> {
    (i.ios > 0 && i.seconds > 0.0).then(|| VolumeSample {
        chars: Characteristics {
            oio: i.outstanding_mean,
            io_size_kib: i.io_size_mean / 1024.0,
            read_pct: i.read_pct,
            random_pct: i.random_pct,
        },
        iops: i.ios as f64 / i.seconds,
    })
}

/// What a datastore interval tells the device model; `None` if it served no reads.
pub fn device_sample(i: &Interval) -> Option<DeviceSample> {
    let latency_us = i.read_latency_us_mean?;
    (i.read_iops > 0.0).then(|| DeviceSample {
        read_oio: i.read_outstanding_mean,
        read_latency_ms: latency_us / 1000.0,
        read_iops: i.read_iops,
        io_size_kib: i.read_size_mean / 1024.0,
        sequential_pct: i.read_sequential_pct,
    })
}

fn push_bounded<T>(q: &mut VecDeque<T>, v: T, cap: usize) {
    while q.len() >= cap.max(1) {
        q.pop_front();
    }
    q.push_back(v);
}

#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub enum Which {
    Volume,
    Datastore,
}

impl Sampler {
    pub fn new(history: usize) -> Sampler {
        Sampler {
            prev: HashMap::new(),
            latest: HashMap::new(),
            interval_s: 0.0,
            history,
            volumes: HashMap::new(),
            datastores: HashMap::new(),
        }
    }

    /// Takes one sample of everything listed; forgets what is no longer listed.
    pub fn sample(&mut self, items: Vec<(Which, String, Snapshot)>) {
        let mut prev = HashMap::with_capacity(items.len());
        let mut latest = HashMap::with_capacity(items.len());
        let mut longest: f64 = 0.0;
        for (w, name, snap) in items {
            let key = (w, name);
            if let Some(p) = self.prev.get(&key) {
                let i = snap.since(p);
                longest = longest.max(i.seconds);
                self.remember(w, &key.1, &i);
                latest.insert(key.clone(), i);
            }
            prev.insert(key, snap);
        }
        // Histories outlive a volume's absence from the list (a relocation takes it out of
        // service for a while); they go when the volume is deleted ([`Sampler::forget_volume`]).
        self.prev = prev;
        self.latest = latest;
        self.interval_s = longest;
    }

    fn remember(&mut self, w: Which, name: &str, i: &Interval) {
        let cap = self.history;
        match w {
            Which::Volume => {
                if let Some(s) = volume_sample(i) {
                    let q = self.volumes.entry(name.to_owned()).or_default();
                    push_bounded(q, s, cap);
                }
            }
            Which::Datastore => {
                if let Some(s) = device_sample(i) {
                    let q = self.datastores.entry(name.to_owned()).or_default();
                    push_bounded(q, s, cap);
                }
            }
        }
    }

    /// Drops a deleted volume's history.
    pub fn forget_volume(&mut self, name: &str) {
        self.volumes.remove(name);
    }

    /// A volume's history, oldest first.
    pub fn volume_history(&self, name: &str) -> Vec<VolumeSample> {
        self.volumes
            .get(name)
            .map(|q| q.iter().copied().collect())
            .unwrap_or_default()
    }

    /// A datastore's history, oldest first.
    pub fn datastore_history(&self, name: &str) -> Vec<DeviceSample> {
        self.datastores
            .get(name)
            .map(|q| q.iter().copied().collect())
            .unwrap_or_default()
    }

    pub fn figures(&self, w: Which, name: &str, now: &Snapshot) -> api::IoFigures {
        let i = self
            .latest
            .get(&(w, name.to_owned()))
            .cloned()
            .unwrap_or_default();
        api::IoFigures {
            read_iops: i.read_iops,
            write_iops: i.write_iops,
            read_bytes_per_s: i.read_bytes_per_s,
            write_bytes_per_s: i.write_bytes_per_s,
            read_latency_us_p50: i.read_latency_us_p50,
            read_latency_us_p99: i.read_latency_us_p99,
            write_latency_us_p50: i.write_latency_us_p50,
            write_latency_us_p99: i.write_latency_us_p99,
            outstanding: now.outstanding,
            outstanding_mean: i.outstanding_mean,
            errors: i.errors,
            reads_total: now.reads,
            writes_total: now.writes,
            read_bytes_total: now.read_bytes,
            write_bytes_total: now.write_bytes,
            flushes_total: now.flushes,
        }
    }
}

fn snapshot_all(d: &Daemon) -> Vec<(Which, String, Snapshot)> {
    let mut items = Vec::new();
    for e in d.entries() {
        if let Ok(v) = &e.volume {
            items.push((Which::Volume, e.record.name.clone(), v.stats().snapshot()));
        }
    }
    for (name, gate) in d.datastore_gates() {
        items.push((Which::Datastore, name, gate.stats.snapshot()));
    }
    items
}

/// Runs the sampler until the daemon goes away.
pub async fn run(d: Arc<Daemon>, mut stop: nbd::Stop) {
    let every = d.config.stats_interval();
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait() => return,
        }
        let items = snapshot_all(&d);
        d.sampler.lock().expect("lock").sample(items);
    }
}

/// The report for `vesta stats`.
pub fn report(d: &Daemon, only: Option<&str>) -> api::StatsReport {
    let sampler = d.sampler.lock().expect("lock");
    let mut volumes = Vec::new();
    for e in d.entries() {
        if only.is_some_and(|n| n != e.record.name) {
            continue;
        }
        let Ok(v) = &e.volume else { continue };
        let now = v.stats().snapshot();
        volumes.push(api::VolumeStats {
            name: e.record.name.clone(),
            datastore: e.record.datastore.clone(),
            policy: e.record.policy.to_string(),
            io: sampler.figures(Which::Volume, &e.record.name, &now),
        });
    }
    let wanted_ds: Option<String> =
        only.and_then(|n| d.entry(n).ok().map(|e| e.record.datastore.clone()));
    let mut datastores = Vec::new();
    for (name, gate) in d.datastore_gates() {
        if wanted_ds.as_ref().is_some_and(|w| *w != name) {
            continue;
        }
        let now = gate.stats.snapshot();
        datastores.push(api::DatastoreStats {
            queue_depth: gate.queue_depth(),
            io: sampler.figures(Which::Datastore, &name, &now),
            name,
        });
    }
    api::StatsReport {
        interval_s: sampler.interval_s,
        volumes,
        datastores,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datastore::stats::{IoStats, Op};

    fn io(st: &IoStats, op: Op, offset: u64, len: u64) {
        st.locate(op, offset, len);
        let t = st.start();
        st.finish(t, op, len, true);
    }

    #[test]
    fn history_keeps_busy_intervals_only_and_is_bounded() {
        let vol = IoStats::default();
        let ds = IoStats::default();
        let mut s = Sampler::new(3);
        let tick = |s: &mut Sampler| {
            s.sample(vec![
                (Which::Volume, "v".into(), vol.snapshot()),
                (Which::Datastore, "d".into(), ds.snapshot()),
            ])
        };
        tick(&mut s); // the first snapshot only sets the baseline
        tick(&mut s); // idle: no sample
        assert!(s.volume_history("v").is_empty());
        assert!(s.datastore_history("d").is_empty());
        for round in 0..5u64 {
            // Three random 8 KiB reads and one write far away: 75 % reads, all random.
            for i in 0..3 {
                io(&vol, Op::Read, (round * 10 + i) << 30, 8192);
                io(&ds, Op::Read, (round * 10 + i) << 30, 8192);
            }
            io(&vol, Op::Write, 7 << 40, 8192);
            std::thread::sleep(std::time::Duration::from_millis(2));
            tick(&mut s);
        }
        let h = s.volume_history("v");
        assert_eq!(h.len(), 3, "bounded by the history length");
        for x in &h {
            assert_eq!(x.chars.io_size_kib, 8.0);
            assert_eq!(x.chars.read_pct, 75.0);
            assert_eq!(x.chars.random_pct, 100.0);
            assert!(x.iops > 0.0);
        }
        let d = s.datastore_history("d");
        assert_eq!(d.len(), 3);
        assert!(d
            .iter()
            .all(|x| x.io_size_kib == 8.0 && x.sequential_pct == 0.0));
        // A volume out of service for a while keeps its history; a deleted one loses it.
        s.sample(vec![]);
        assert_eq!(s.volume_history("v").len(), 3);
        s.forget_volume("v");
        assert!(s.volume_history("v").is_empty());
    }
}
