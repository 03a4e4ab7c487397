//! The admin API contract between `vestad` and the `vesta` CLI (and any script): JSON bodies
//! under `/v1`. Both sides build from these types, so they cannot drift apart.
//!
//! | method | path | body | answer |
//! |---|---|---|---|
//! | GET | /v1/status | | [`Status`] |
//! | GET | /v1/datastores | | `[DatastoreInfo]` |
//! | POST | /v1/datastores | [`AddDatastore`] | [`DatastoreInfo`] |
//! | GET | /v1/volumes | | `[VolumeInfo]` |
//! | POST | /v1/volumes | [`CreateVolume`] | [`VolumeInfo`] |
//! | GET | /v1/volumes/{name} | | [`VolumeInfo`] |
//! | DELETE | /v1/volumes/{name}?force=true | | [`VolumeInfo`] of what was deleted |
//! | POST | /v1/volumes/{name}/policy | [`SetPolicy`] | [`VolumeInfo`] |
//! | GET | /v1/stats?volume=NAME | | [`StatsReport`] |
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
    pub volumes: usize,
    pub lun_id: Option<String>,
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
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VolumeInfo {
    pub name: String,
    pub id: String,
    pub size: u64,
    pub datastore: String,
    pub policy: String,
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
    pub destage_bytes_per_s: f64,
    pub datastore_write_latency_us: Option<u64>,
    /// `off`, `throttling` or `stalled`.
    pub flow_control: String,
    pub flow_pressure: f64,
    pub throttled_writes: u64,
    pub throttle_delay_us_total: u64,
    pub stalls: u64,
    pub replaying: bool,
    pub degraded: Option<String>,
    pub destage_error: Option<String>,
}

/// Change a volume's policy and/or write-back tuning.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SetPolicy {
    pub policy: String,
    pub hold_s: Option<f64>,
    pub max_dirty_age_s: Option<f64>,
    pub rpo_s: Option<f64>,
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
