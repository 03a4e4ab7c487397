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
//!
//! **Several hosts share a datastore** (BASIL §6.1: the device model is fitted to what all
//! of them see together). Intervals are numbered by the wall clock (`floor(unix seconds /
//! interval)`, the sampler ticks on those boundaries), so interval `t` is the same seconds
//! on every host. After each interval, [`exchange`] runs a round through the coordinator:
//!
//! 1. the host publishes its last [`PUBLISH_WINDOW`] intervals of every datastore it has
//!    ([`DevicesDoc`]), and now and then its volumes' workload models ([`VolumesDoc`]);
//! 2. the pod's one aggregator (a role bound to its lease) reads every host's document and
//!    combines them interval by interval (`balance::device::combine`: outstanding IOs
//!    summed, latency weighted by IOPS, an interval taken once every live host has
//!    published it) into the pod's document ([`PodDoc`]);
//! 3. the host reads the pod's document and appends the intervals it has not seen to each
//!    datastore's history, which is what the device models are fitted to.
//!
//! With the `local` coordinator the host is the whole pod and its own aggregator: the round
//! gives back its own intervals at once.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use balance::device::{HostSeries, PodSeries};
use balance::{Characteristics, DeviceSample};
use cluster::StatsDoc;
use datastore::stats::{Interval, Snapshot};
use serde::{Deserialize, Serialize};
use vesta_api as api;

use crate::daemon::Daemon;

/// Intervals of each datastore a host publishes every round. The pod's document carries the
/// same span, so a host whose rounds fail for a while (up to about this many intervals)
/// still finds every interval it has not merged yet.
pub const PUBLISH_WINDOW: u64 = 16;
/// A host this many intervals behind the newest is taken as stopped by the aggregator: it
/// no longer holds the other hosts' intervals back.
const MAX_LAG: u64 = 4;
/// Volume models are published every this many rounds: they are 90th percentiles over the
/// whole history and change slowly, and each is a few hundred bytes per volume.
const VOLUMES_EVERY: u64 = 5;
/// Layout of the documents below; a document of another version is skipped.
const DOC_VERSION: u32 = 1;

/// What a host publishes of its datastores every round.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DevicesDoc {
    pub version: u32,
    pub interval_s: f64,
    /// The last interval sampled.
    pub through: u64,
    /// Every datastore the host has, with its intervals with reads in the window (none
    /// is a host that uses the datastore and read nothing: the aggregator waits for it all
    /// the same).
    pub datastores: BTreeMap<String, Vec<(u64, DeviceSample)>>,
}

/// The pod's combined intervals, one series per datastore, written by the aggregator.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PodDoc {
    pub version: u32,
    pub interval_s: f64,
    pub aggregator: String,
    pub datastores: BTreeMap<String, PodSeries>,
}

/// A volume's workload model as its host publishes it for the others' planners.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PublishedVolume {
    pub name: String,
    pub datastore: String,
    pub size: u64,
    /// Intervals with IO in the history.
    pub samples: usize,
    pub p90: Option<Characteristics>,
    pub iops: f64,
}

/// What a host publishes of the volumes it serves.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VolumesDoc {
    pub version: u32,
    pub volumes: Vec<PublishedVolume>,
}

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
    /// `stats.interval_s`: the length every host of the pod must use.
    configured_interval_s: f64,
    /// Intervals kept per volume and datastore.
    pub history: usize,
    volumes: HashMap<String, VecDeque<VolumeSample>>,
    /// The last interval sampled (wall-clock numbered).
    through: u64,
    /// The datastores this host has, as of the last sample.
    known: BTreeSet<String>,
    /// This host's own intervals of each datastore, the last [`PUBLISH_WINDOW`] of them:
    /// what it publishes.
    own: HashMap<String, VecDeque<(u64, DeviceSample)>>,
    /// Each datastore's history as the whole pod saw it: what the device models use.
    datastores: HashMap<String, VecDeque<(u64, DeviceSample)>>,
    /// The hosts whose IO each datastore's latest combined intervals hold.
    datastore_hosts: HashMap<String, Vec<String>>,
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
    pub fn new(history: usize, interval_s: f64) -> Sampler {
        Sampler {
            prev: HashMap::new(),
            latest: HashMap::new(),
            interval_s: 0.0,
            configured_interval_s: interval_s,
            history,
            volumes: HashMap::new(),
            through: 0,
            known: BTreeSet::new(),
            own: HashMap::new(),
            datastores: HashMap::new(),
            datastore_hosts: HashMap::new(),
        }
    }

    /// Takes one sample of everything listed, as interval `t`; forgets what is no longer
    /// listed.
    pub fn sample(&mut self, t: u64, items: Vec<(Which, String, Snapshot)>) {
        let mut prev = HashMap::with_capacity(items.len());
        let mut latest = HashMap::with_capacity(items.len());
        let mut longest: f64 = 0.0;
        self.through = t;
        self.known.clear();
        for (w, name, snap) in items {
            let key = (w, name);
            if w == Which::Datastore {
                self.known.insert(key.1.clone());
            }
            if let Some(p) = self.prev.get(&key) {
                let i = snap.since(p);
                longest = longest.max(i.seconds);
                self.remember(w, t, &key.1, &i);
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

    fn remember(&mut self, w: Which, t: u64, name: &str, i: &Interval) {
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
                    let q = self.own.entry(name.to_owned()).or_default();
                    push_bounded(q, (t, s), PUBLISH_WINDOW as usize);
                }
            }
        }
    }

    /// This host's document for the others: its window of every datastore it has.
    pub fn devices_doc(&self) -> DevicesDoc {
        let from = self.through.saturating_sub(PUBLISH_WINDOW - 1);
        DevicesDoc {
            version: DOC_VERSION,
            interval_s: self.configured_interval_s,
            through: self.through,
            datastores: self
                .known
                .iter()
                .map(|ds| {
                    let samples = self
                        .own
                        .get(ds)
                        .map(|q| q.iter().filter(|(t, _)| *t >= from).copied().collect())
                        .unwrap_or_default();
                    (ds.clone(), samples)
                })
                .collect(),
        }
    }

    /// Appends the pod's intervals not seen yet to each datastore's history. Intervals
    /// ahead of this host's clock by more than a few are left out: one host whose clock
    /// jumped ahead must not make every later real interval look old.
    pub fn merge_pod(&mut self, pod: &PodDoc) {
        let cap = self.history;
        let horizon = self.through + MAX_LAG;
        for (ds, series) in &pod.datastores {
            let q = self.datastores.entry(ds.clone()).or_default();
            let last = q.back().map(|(t, _)| *t);
            for (t, s) in &series.samples {
                if last.is_none_or(|l| *t > l) && *t <= horizon {
                    push_bounded(q, (*t, *s), cap);
                }
            }
            if !series.hosts.is_empty() {
                self.datastore_hosts
                    .insert(ds.clone(), series.hosts.clone());
            }
        }
    }

    /// The hosts whose IO a datastore's history holds (its latest combined intervals).
    pub fn datastore_hosts(&self, name: &str) -> Vec<String> {
        self.datastore_hosts.get(name).cloned().unwrap_or_default()
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

    /// A datastore's history as the pod saw it, oldest first.
    pub fn datastore_history(&self, name: &str) -> Vec<DeviceSample> {
        self.datastores
            .get(name)
            .map(|q| q.iter().map(|(_, s)| *s).collect())
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

/// The next interval boundary on the wall clock: how long until it, and its number.
fn next_boundary(every: Duration) -> (Duration, u64) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let every_ms = every.as_millis().max(1);
    let t = now.as_millis() / every_ms + 1;
    let at = Duration::from_millis((t * every_ms) as u64);
    (at.saturating_sub(now), t as u64)
}

/// Runs the sampler until the daemon goes away: a sample on every interval boundary, then a
/// round of [`exchange`] (on its own task; a round still running makes the next one wait for
/// the interval after, so a slow coordinator never delays a sample).
pub async fn run(d: Arc<Daemon>, mut stop: nbd::Stop) {
    let every = d.config.stats_interval();
    let busy = Arc::new(AtomicBool::new(false));
    let mut round = 0u64;
    loop {
        let (wait, t) = next_boundary(every);
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stop.wait() => return,
        }
        let items = snapshot_all(&d);
        d.sampler.lock().expect("lock").sample(t, items);
        if !busy.swap(true, Ordering::AcqRel) {
            /// Frees the next round however this one ends.
            struct Done(Arc<AtomicBool>);
            impl Drop for Done {
                fn drop(&mut self) {
                    self.0.store(false, Ordering::Release);
                }
            }
            let (d, done) = (d.clone(), Done(busy.clone()));
            let volumes = round.is_multiple_of(VOLUMES_EVERY);
            tokio::spawn(async move {
                let _done = done;
                exchange(&d, volumes).await;
            });
        }
        round += 1;
    }
}

/// One round of statistics through the coordinator (the module docs): publish this host's
/// intervals (and its volumes' models if `volumes`), combine everyone's if this host is the
/// aggregator, and merge the pod's combined intervals. A failure is logged when it starts
/// and when it ends, not every round.
pub async fn exchange(d: &Daemon, volumes: bool) {
    static FAILING: AtomicBool = AtomicBool::new(false);
    match exchange_round(d, volumes).await {
        Ok(()) => {
            if FAILING.swap(false, Ordering::Relaxed) {
                tracing::info!("statistics exchange through the coordinator works again");
            }
        }
        Err(e) => {
            if !FAILING.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    "statistics exchange through the coordinator failed: {e}; the device \
                     models take no new intervals until it works again (up to {PUBLISH_WINDOW} \
                     missed ones are caught up then)"
                );
            }
        }
    }
}

async fn exchange_round(d: &Daemon, volumes: bool) -> anyhow::Result<()> {
    let coord = &d.coord;
    let doc = d.sampler.lock().expect("lock").devices_doc();
    let interval_s = doc.interval_s;
    coord
        .put_stats(StatsDoc::Devices, serde_json::to_vec(&doc)?)
        .await?;
    if volumes {
        let doc = VolumesDoc {
            version: DOC_VERSION,
            volumes: crate::balancing::own_volumes(d),
        };
        coord
            .put_stats(StatsDoc::Volumes, serde_json::to_vec(&doc)?)
            .await?;
    }
    if coord.stats_aggregator().await? {
        let docs = coord.stats(StatsDoc::Devices).await?;
        let pod = combine(coord.host(), interval_s, doc.through, &docs);
        match coord.put_pod_stats(serde_json::to_vec(&pod)?).await {
            Ok(()) | Err(cluster::Error::NotHeld(_)) => {} // lost the role meanwhile
            Err(e) => return Err(e.into()),
        }
    }
    if let Some(raw) = coord.pod_stats().await? {
        let pod = serde_json::from_slice::<PodDoc>(&raw);
        if !matches!(&pod, Ok(p) if p.version == DOC_VERSION && p.interval_s == interval_s) {
            // This host's own intervals at least, as if it were alone.
            let own = combine(
                coord.host(),
                interval_s,
                doc.through,
                &[(coord.host().to_string(), serde_json::to_vec(&doc)?)],
            );
            d.sampler.lock().expect("lock").merge_pod(&own);
        }
        match pod {
            Ok(pod) if pod.version == DOC_VERSION && pod.interval_s == interval_s => {
                d.sampler.lock().expect("lock").merge_pod(&pod)
            }
            Ok(pod) => anyhow::bail!(
                "the pod's statistics (from host {}) are of version {} with {} s intervals; \
                 this host reads version {DOC_VERSION} with {interval_s} s: give every host \
                 the same [stats] interval_s",
                pod.aggregator,
                pod.version,
                pod.interval_s
            ),
            Err(e) => anyhow::bail!("the pod's statistics do not parse: {e}"),
        }
    }
    Ok(())
}

/// The pod's document from every host's: each datastore's series combined. Documents of
/// another version or interval length, or ahead of the aggregator's clock (`now`, its last
/// interval) by more than a few intervals, are left out (and said once).
fn combine(aggregator: &str, interval_s: f64, now: u64, docs: &[(String, Vec<u8>)]) -> PodDoc {
    static SAID: AtomicBool = AtomicBool::new(false);
    let mut per_ds: BTreeMap<String, Vec<HostSeries>> = BTreeMap::new();
    for (host, raw) in docs {
        let doc = match serde_json::from_slice::<DevicesDoc>(raw) {
            Ok(doc)
                if doc.version == DOC_VERSION
                    && doc.interval_s == interval_s
                    && doc.through <= now + MAX_LAG =>
            {
                doc
            }
            other => {
                if !SAID.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        "statistics of host {host} left out of the pod's: {}",
                        match other {
                            Ok(doc) if doc.through > now + MAX_LAG => format!(
                                "its clock is ahead of this host's by {} intervals",
                                doc.through - now
                            ),
                            Ok(doc) => format!(
                                "version {} with {} s intervals, this host uses version \
                                 {DOC_VERSION} with {interval_s} s",
                                doc.version, doc.interval_s
                            ),
                            Err(e) => format!("they do not parse ({e})"),
                        }
                    );
                }
                continue;
            }
        };
        for (ds, samples) in doc.datastores {
            per_ds.entry(ds).or_default().push(HostSeries {
                host: host.clone(),
                through: doc.through,
                samples,
            });
        }
    }
    PodDoc {
        version: DOC_VERSION,
        interval_s,
        aggregator: aggregator.to_string(),
        datastores: per_ds
            .into_iter()
            .map(|(ds, series)| (ds, balance::device::combine(&series, MAX_LAG)))
            .collect(),
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
            policy: e.policy().to_string(),
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

    /// One host's round of the exchange, as with the `local` coordinator.
    fn alone(s: &mut Sampler) {
        let doc = serde_json::to_vec(&s.devices_doc()).unwrap();
        let now = s.through;
        s.merge_pod(&combine("h", 2.0, now, &[("h".into(), doc)]));
    }

    /// A datastore sample with `oio` outstanding reads.
    fn busy(oio: f64) -> DeviceSample {
        DeviceSample {
            read_oio: oio,
            read_latency_ms: 1.0 + oio,
            read_iops: 100.0,
            io_size_kib: 8.0,
            sequential_pct: 0.0,
        }
    }

    /// A host that has sampled `through`, with datastore `d`'s reads in the intervals
    /// `reads` (its document as it would publish it).
    fn doc(through: u64, reads: &[(u64, f64)]) -> Vec<u8> {
        serde_json::to_vec(&DevicesDoc {
            version: DOC_VERSION,
            interval_s: 2.0,
            through,
            datastores: [(
                "d".to_string(),
                reads.iter().map(|(t, oio)| (*t, busy(*oio))).collect(),
            )]
            .into(),
        })
        .unwrap()
    }

    #[test]
    fn a_datastore_history_sums_every_hosts_outstanding_reads() {
        let mut s = Sampler::new(100, 2.0);
        // Round 1: b has not published interval 11 yet.
        let docs = vec![
            ("a".to_string(), doc(11, &[(10, 1.0), (11, 1.0)])),
            ("b".to_string(), doc(10, &[(10, 3.0)])),
        ];
        s.through = 11;
        let pod = combine("a", 2.0, 11, &docs);
        s.merge_pod(&pod);
        assert_eq!(
            s.datastore_history("d")
                .iter()
                .map(|x| x.read_oio)
                .collect::<Vec<_>>(),
            [4.0]
        );
        assert_eq!(s.datastore_hosts("d"), ["a", "b"]);
        // Round 2: both have 11 and 12; interval 10 comes again in the windows and is not
        // taken twice.
        let docs = vec![
            ("a".to_string(), doc(12, &[(10, 1.0), (11, 1.0), (12, 2.0)])),
            ("b".to_string(), doc(12, &[(10, 3.0), (11, 5.0), (12, 2.0)])),
        ];
        s.through = 12;
        s.merge_pod(&combine("a", 2.0, 12, &docs));
        assert_eq!(
            s.datastore_history("d")
                .iter()
                .map(|x| x.read_oio)
                .collect::<Vec<_>>(),
            [4.0, 6.0, 4.0]
        );
        // A host on other intervals is left out, not mixed in.
        let mut odd: DevicesDoc = serde_json::from_slice(&doc(13, &[(13, 50.0)])).unwrap();
        odd.interval_s = 5.0;
        let docs = vec![
            ("a".to_string(), doc(13, &[(13, 1.0)])),
            ("c".to_string(), serde_json::to_vec(&odd).unwrap()),
        ];
        let pod = combine("a", 2.0, 13, &docs);
        assert_eq!(pod.datastores["d"].hosts, ["a"]);
        assert_eq!(pod.datastores["d"].samples[0].1.read_oio, 1.0);
        // A host whose clock ran a day ahead is left out by the aggregator, and a pod
        // document carrying such an interval does not make later real ones look old.
        let docs = vec![
            ("a".to_string(), doc(14, &[(14, 1.0)])),
            ("z".to_string(), doc(14 + 43_200, &[(14 + 43_200, 7.0)])),
        ];
        let pod = combine("a", 2.0, 14, &docs);
        assert_eq!(pod.datastores["d"].hosts, ["a"]);
        let mut ahead = pod.clone();
        ahead
            .datastores
            .get_mut("d")
            .unwrap()
            .samples
            .push((14 + 43_200, busy(7.0)));
        s.through = 14;
        s.merge_pod(&ahead);
        s.through = 15;
        s.merge_pod(&combine(
            "a",
            2.0,
            15,
            &[("a".to_string(), doc(15, &[(15, 2.0)]))],
        ));
        assert_eq!(
            s.datastore_history("d")
                .iter()
                .map(|x| x.read_oio)
                .collect::<Vec<_>>(),
            [4.0, 6.0, 4.0, 1.0, 2.0]
        );
    }

    #[test]
    fn history_keeps_busy_intervals_only_and_is_bounded() {
        let vol = IoStats::default();
        let ds = IoStats::default();
        let mut s = Sampler::new(3, 2.0);
        let mut t = 100;
        let mut tick = |s: &mut Sampler| {
            t += 1;
            s.sample(
                t,
                vec![
                    (Which::Volume, "v".into(), vol.snapshot()),
                    (Which::Datastore, "d".into(), ds.snapshot()),
                ],
            );
            alone(s);
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
        s.sample(200, vec![]);
        assert_eq!(s.volume_history("v").len(), 3);
        s.forget_volume("v");
        assert!(s.volume_history("v").is_empty());
    }
}
