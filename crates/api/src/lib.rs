//! The admin API contract between `vestad` and the `vesta` CLI (and any script): JSON bodies
//! under `/v1`. Both sides build from these types, so they cannot drift apart.
//!
//! | method | path | body | answer |
//! |---|---|---|---|
//! | GET | /v1/status | | [`Status`] |
//! | GET | /v1/hosts | | `[HostInfo]` |
//! | GET | /v1/datastores | | `[DatastoreInfo]` |
//! | POST | /v1/datastores | [`AddDatastore`] | [`DatastoreInfo`] |
//! | GET | /v1/volumes | | `[VolumeInfo]` |
//! | POST | /v1/volumes | [`CreateVolume`] | [`VolumeInfo`] |
//! | GET | /v1/volumes/{name} | | [`VolumeInfo`] |
//! | DELETE | /v1/volumes/{name}?force=true | | [`VolumeInfo`] of what was deleted |
//! | POST | /v1/volumes/{name}/policy | [`SetPolicy`] | [`VolumeInfo`] |
//! | POST | /v1/volumes/{name}/relocate | [`Relocate`] | [`VolumeInfo`] |
//! | POST | /v1/volumes/{name}/accept-loss | [`AcceptLoss`] | [`LossReport`] |
//! | GET | /v1/stats?volume=NAME | | [`StatsReport`] |
//! | GET | /v1/models | | [`ModelsReport`] |
//! | GET | /v1/balance/plan?max_moves=N&threshold=F | | [`BalancePlan`] |
//! | GET | /v1/calibration | | [`Calibration`] (404 if none) |
//! | PUT | /v1/calibration | [`Calibration`] | [`Calibration`] |
//!
//! Errors come back with a 4xx/5xx status and an [`ApiError`] body.

pub mod size;

use serde::{Deserialize, Serialize};

pub use size::{format_size, parse_size};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ApiError {
    /// What went wrong and how to fix it, in one sentence or two.
    pub error: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Status {
    pub version: String,
    pub data_dir: String,
    pub coordinator: String,
    /// The pod's id, which the labels of its LUNs carry.
    #[serde(default)]
    pub pod: String,
    /// This host's name and fault domain.
    #[serde(default)]
    pub host: String,
    #[serde(default)]
    pub fault_domain: String,
    pub nbd_unix: Option<String>,
    pub nbd_tcp: Option<String>,
    pub api: String,
    pub volumes: usize,
    pub datastores: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DatastoreInfo {
    pub name: String,
    pub kind: String,
    pub location: String,
    pub class: String,
    pub queue_depth: u32,
    /// `ok`, or what is wrong with it.
    pub status: String,
    pub total_bytes: Option<u64>,
    pub free_bytes: Option<u64>,
    /// What its volumes may still take of `free_bytes` as they are written (sparse images).
    #[serde(default)]
    pub unwritten_bytes: Option<u64>,
    pub volumes: usize,
    pub lun_id: Option<String>,
    /// Read and written with `O_DIRECT`, past this host's page cache.
    #[serde(default)]
    pub direct: bool,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct AddDatastore {
    pub name: String,
    pub dir: Option<String>,
    pub lun: Option<String>,
    pub class: Option<String>,
    pub queue_depth: Option<u32>,
    #[serde(default)]
    pub force: bool,
    /// Take over a LUN that pod (its id) formatted: that pod can no longer use it.
    #[serde(default)]
    pub take_over: Option<String>,
    /// Read and write it with `O_DIRECT` (a datastore reached by path that hosts share).
    #[serde(default)]
    pub direct: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VolumeInfo {
    pub name: String,
    pub id: String,
    pub size: u64,
    pub datastore: String,
    /// The policy in effect (for a volume another host serves, the one in its record).
    pub policy: String,
    /// The policy asked for, when it is not the one in effect: a `wbp` volume runs in `wt`
    /// while it lacks peers, a cached one uncached once its cache device failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_asked: Option<String>,
    /// `ok`, or why the volume cannot serve IO.
    pub status: String,
    /// NBD connections attached now.
    pub connections: u32,
    pub created_unix: u64,
    /// URIs clients connect to: the unix socket first, then TCP.
    pub urls: Vec<String>,
    /// Write-back tuning in effect.
    #[serde(default)]
    pub tuning: TuningInfo,
    /// The cache's view, for cached policies.
    #[serde(default)]
    pub cache: Option<CacheInfo>,
    /// Why `vesta volume create` chose this datastore, when it chose (no `--datastore`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<balance::Placement>,
    /// The host that serves the volume.
    #[serde(default)]
    pub owner: Option<String>,
    /// That host's admin API, when it is another host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner_api: Option<String>,
}

/// One host of the cluster (`GET /v1/hosts`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct HostInfo {
    pub name: String,
    pub fault_domain: String,
    /// Whether its lease is alive.
    pub alive: bool,
    pub api: Option<String>,
    pub nbd: Option<String>,
    /// Where it takes `wbp` peers' writes.
    #[serde(default)]
    pub peer: Option<String>,
    pub cache_bytes: u64,
    pub cache_used_bytes: u64,
    pub started_unix: u64,
    /// Volumes it owns.
    pub volumes: usize,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct TuningInfo {
    pub hold_s: Option<f64>,
    pub max_dirty_age_s: Option<f64>,
    pub rpo_s: Option<f64>,
}

/// A cached volume as the cache sees it.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct CacheInfo {
    pub mode: String,
    pub gen: u64,
    pub dirty_bytes: u64,
    pub dirty_writes: u64,
    pub share_bytes: u64,
    pub used_bytes: u64,
    /// The datastore holds every write up to this sequence number.
    pub checkpoint: u64,
    pub last_ser: u64,
    pub read_hit_ratio: Option<f64>,
    pub destaged_bytes: u64,
    pub destaged_writes: u64,
    /// Moving average of the destager's rate over the windows it wrote: what it can do, not
    /// what it does now (it keeps its value while there is nothing to destage).
    pub destage_bytes_per_s: f64,
    pub datastore_write_latency_us: Option<u64>,
    /// `off`, `throttling` or `stalled`.
    pub flow_control: String,
    pub flow_pressure: f64,
    pub throttled_writes: u64,
    pub throttle_delay_us_total: u64,
    pub stalls: u64,
    /// `wb` writes flow control held past its bound (4x the datastore write latency plus
    /// 1 ms): none, unless something is wrong.
    #[serde(default)]
    pub throttled_past_bound: u64,
    /// The longest a `wb` write took inside vestad, from its arrival to its completion.
    #[serde(default)]
    pub longest_write_us: u64,
    /// Segments of clean data evicted to make room (LRU).
    #[serde(default)]
    pub evicted_segments: u64,
    /// Writes that waited for the cache log to free a segment.
    #[serde(default)]
    pub space_waits: u64,
    pub replaying: bool,
    /// While replaying: the writes up to this sequence number are sent to the datastore (the
    /// last 16 MiB of them may still be in flight), of the ones up to `replay_end` (a replay
    /// records its checkpoint once, at its end).
    #[serde(default)]
    pub replay_sent: u64,
    #[serde(default)]
    pub replay_end: u64,
    pub degraded: Option<String>,
    pub destage_error: Option<String>,
    /// The volume's peers in `wbp`, with how far each lags the owner.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub peers: Vec<PeerInfo>,
}

/// Replay what another host's cache device holds (`vesta host replay-cache`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SurrogateReplay {
    /// The cache file or device, as this host sees it.
    pub path: String,
    /// Replay a volume even over a peer's unfinished replay that began below the file's
    /// checkpoint, giving up what that replay set back.
    #[serde(default)]
    pub force: bool,
}

/// What a surrogate replay did, one line per volume found with dirty data.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SurrogateReport {
    pub volumes: Vec<String>,
    /// Volumes with dirty data in the cache that were not replayed (each line says why).
    #[serde(default)]
    pub not_replayed: usize,
}

/// One `wbp` peer of a volume.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PeerInfo {
    pub host: String,
    /// The highest write sequence number the peer has acknowledged.
    pub acked_ser: u64,
    /// Writes issued to the volume that the peer has not acknowledged yet.
    pub lag_writes: u64,
    /// Why the link to the peer failed, if it did.
    pub error: Option<String>,
}

/// Change a volume's policy and/or write-back tuning.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SetPolicy {
    pub policy: String,
    pub hold_s: Option<f64>,
    pub max_dirty_age_s: Option<f64>,
    pub rpo_s: Option<f64>,
}

/// Accept the loss of what this host's failed cache device held of a volume, which no peer
/// can replay (`vesta volume accept-loss`): the volume goes on from what its datastore holds.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct AcceptLoss {
    /// Only say what would be lost; change nothing.
    #[serde(default)]
    pub dry_run: bool,
}

/// What accepting a loss gave up (or would, in a dry run).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct LossReport {
    pub name: String,
    pub datastore: String,
    /// False for a dry run.
    pub accepted: bool,
    /// The dirty data only the failed cache device (or peers that cannot replay it) held;
    /// `None` when this host cannot tell (its cache device was replaced: only the peers knew).
    pub dirty_bytes: Option<u64>,
    pub dirty_writes: Option<u64>,
    /// Every write up to this one (its `ser`) is on the datastore.
    pub checkpoint: u64,
    /// The peers the vault named, whose replicas of the volume become stale.
    pub peers: Vec<String>,
    /// What they answered when last asked whether they hold the volume.
    pub peers_said: Option<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct CreateVolume {
    pub name: String,
    pub size: u64,
    pub datastore: Option<String>,
    pub policy: Option<String>,
    #[serde(default)]
    pub hold_s: Option<f64>,
    #[serde(default)]
    pub max_dirty_age_s: Option<f64>,
    #[serde(default)]
    pub rpo_s: Option<f64>,
}

/// IO figures over the last stats interval, plus totals since start.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct IoFigures {
    pub read_iops: f64,
    pub write_iops: f64,
    pub read_bytes_per_s: f64,
    pub write_bytes_per_s: f64,
    pub read_latency_us_p50: Option<u64>,
    pub read_latency_us_p99: Option<u64>,
    pub write_latency_us_p50: Option<u64>,
    pub write_latency_us_p99: Option<u64>,
    /// IOs in flight now.
    pub outstanding: u64,
    /// Mean IOs in flight over the interval.
    pub outstanding_mean: f64,
    pub errors: u64,
    pub reads_total: u64,
    pub writes_total: u64,
    pub read_bytes_total: u64,
    pub write_bytes_total: u64,
    pub flushes_total: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VolumeStats {
    pub name: String,
    pub datastore: String,
    pub policy: String,
    pub io: IoFigures,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DatastoreStats {
    pub name: String,
    pub queue_depth: u32,
    pub io: IoFigures,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StatsReport {
    /// Length of the interval the rates and percentiles cover.
    pub interval_s: f64,
    pub volumes: Vec<VolumeStats>,
    pub datastores: Vec<DatastoreStats>,
}

/// Copy a volume to another datastore. Only `offline: true` exists so far: the volume must
/// have no clients and no dirty data, and it serves again once the copy is done.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Relocate {
    pub datastore: String,
    #[serde(default)]
    pub offline: bool,
}

/// The balancing models (BASIL, DESIGN §8) as the daemon sees them now.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ModelsReport {
    pub interval_s: f64,
    /// Intervals of history the models are built from, at most.
    pub history: usize,
    /// K1–K4 of the workload model in use.
    pub constants: balance::Constants,
    /// `defaults`, or which calibration they come from.
    pub constants_from: String,
    pub volumes: Vec<VolumeModel>,
    pub datastores: Vec<DatastoreModel>,
}

/// One volume's workload model.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VolumeModel {
    pub name: String,
    pub datastore: String,
    /// The host that serves it, when that is another host (its model is the one that host
    /// published).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// Intervals with IO in the history.
    pub samples: usize,
    /// OIO, IO size, read % and random % at their 90th percentiles; `None` before the
    /// first interval with IO.
    pub p90: Option<balance::Characteristics>,
    /// Its load `L`; 0 for a volume that has done no IO.
    pub load: f64,
    /// Median IOPS over the intervals with IO.
    pub iops: f64,
}

/// One datastore's device model.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DatastoreModel {
    pub name: String,
    /// The hosts whose IO its latest intervals hold (summed: BASIL's aggregation).
    #[serde(default)]
    pub hosts: Vec<String>,
    /// Intervals in the history in which it served reads.
    pub samples: usize,
    /// Those that pass the filters (reads ≤ 32 KiB, sequentiality ≤ 90 %).
    pub usable: usize,
    /// The median outstanding reads of those intervals: the load the model was fitted at.
    #[serde(default)]
    pub read_oio_median: Option<f64>,
    /// `P = 1/slope` of read latency against outstanding reads, with its fit; `None` until
    /// enough usable intervals with spread in load exist.
    pub model: Option<balance::DeviceModel>,
    /// `ΣL` of its volumes.
    pub load: f64,
    /// `N = ΣL / P`; `None` without a model.
    pub normalized_load: Option<f64>,
}

/// A migration plan with what it was made from.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BalancePlan {
    pub plan: balance::Plan,
    pub constants_from: String,
    /// What the operator should know about the inputs (volumes without statistics, datastores
    /// without a model).
    pub notes: Vec<String>,
}

/// Fitted workload-model constants, stored by `vesta calibrate`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Calibration {
    /// The datastore the sweep ran on.
    pub datastore: String,
    pub at_unix: u64,
    pub constants: balance::Constants,
    /// Experiments the fit used.
    pub experiments: usize,
    /// Median of |predicted − measured| / measured latency over them.
    pub median_relative_error: f64,
    /// Parameters the datastore's latency did not respond to (of `OIO`, `size`, `read`,
    /// `random`); their constants are set so they do not move a load.
    #[serde(default)]
    pub insensitive: Vec<String>,
}
