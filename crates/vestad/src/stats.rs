//! Statistics intervals: every `stats.interval_s` a sampler snapshots the counters of each
//! volume and datastore; the difference to the previous snapshot is the interval the admin
//! API reports (rates, latency percentiles, mean outstanding IOs).

use std::collections::HashMap;
use std::sync::Arc;

use datastore::stats::{Interval, Snapshot};
use vesta_api as api;

use crate::daemon::Daemon;

#[derive(Default)]
pub struct Sampler {
    prev: HashMap<(Which, String), Snapshot>,
    latest: HashMap<(Which, String), Interval>,
    pub interval_s: f64,
}

#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub enum Which {
    Volume,
    Datastore,
}

impl Sampler {
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
                latest.insert(key.clone(), i);
            }
            prev.insert(key, snap);
        }
        self.prev = prev;
        self.latest = latest;
        self.interval_s = longest;
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
