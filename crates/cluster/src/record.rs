//! The records the coordinator keeps.

use std::fmt;
use std::str::FromStr;

use datastore::DatastoreSpec;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// A volume's cache policy (DESIGN §3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Policy {
    /// Pass-through: every IO goes to the datastore.
    #[default]
    Uncached,
    /// Write-through: writes complete when both the cache and the datastore have them; reads
    /// are cached.
    Wt,
    /// Write-back: writes complete when the local cache device has them; the destager sends
    /// them to the datastore later.
    Wb,
}

impl Policy {
    /// Every policy name, for error messages.
    pub const ALL: &'static [&'static str] = &["uncached", "wt", "wb"];
    /// Policies the design names that this build does not serve yet.
    const LATER: &'static [&'static str] = &["wbp"];

    /// Whether the volume uses the host's cache device.
    pub fn cached(self) -> bool {
        !matches!(self, Policy::Uncached)
    }

    /// The code stored in a cache log policy record.
    pub fn code(self) -> u64 {
        match self {
            Policy::Uncached => 0,
            Policy::Wt => 1,
            Policy::Wb => 2,
        }
    }

    pub fn from_code(c: u64) -> Option<Policy> {
        Some(match c {
            0 => Policy::Uncached,
            1 => Policy::Wt,
            2 => Policy::Wb,
            _ => return None,
        })
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Policy::Uncached => "uncached",
            Policy::Wt => "wt",
            Policy::Wb => "wb",
        })
    }
}

impl FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Policy, String> {
        match s {
            "uncached" => Ok(Policy::Uncached),
            "wt" => Ok(Policy::Wt),
            "wb" => Ok(Policy::Wb),
            other if Policy::LATER.contains(&other.split(':').next().unwrap_or(other)) => {
                Err(format!(
                    "policy {other:?} is not available in this build yet; available: {}",
                    Policy::ALL.join(", ")
                ))
            }
            other => Err(format!(
                "unknown policy {other:?}; available: {}",
                Policy::ALL.join(", ")
            )),
        }
    }
}

impl Serialize for Policy {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Policy {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Policy, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// One volume as the cluster knows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeRecord {
    pub id: Uuid,
    pub name: String,
    pub size: u64,
    pub datastore: String,
    pub policy: Policy,
    /// Seconds since the Unix epoch.
    pub created_unix: u64,
    /// Write-back tuning; absent means the defaults.
    #[serde(default)]
    pub tuning: Tuning,
    /// The host that serves the volume (DESIGN §1). Absent in a single-host state: the one
    /// host owns everything.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
}

impl VolumeRecord {
    /// Whether `host` serves this volume.
    pub fn owned_by(&self, host: &str) -> bool {
        self.owner.as_deref().is_none_or(|o| o == host)
    }
}

/// One host as it registered with the coordinator.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct HostRecord {
    pub name: String,
    pub fault_domain: String,
    /// Admin API address (`http://ip:port`), once bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api: Option<String>,
    /// NBD TCP address (`ip:port`), once bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbd: Option<String>,
    /// Peer replication address (`ip:port`), once bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer: Option<String>,
    /// Cache device size and bytes in use, as last published.
    #[serde(default)]
    pub cache_bytes: u64,
    #[serde(default)]
    pub cache_used_bytes: u64,
    /// Seconds since the Unix epoch when this vestad registered.
    #[serde(default)]
    pub started_unix: u64,
}

/// A host with its liveness: a host is alive while its lease is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostStatus {
    #[serde(flatten)]
    pub record: HostRecord,
    pub alive: bool,
}

/// A volume's vault record (DESIGN §4): what a host needs to recover the volume without its
/// owner. Written only by the holder of the volume's vault lock.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Vault {
    pub volume: Uuid,
    /// The policy in effect (a transition to `wt` is complete once this says so).
    pub policy: Policy,
    /// A recent checkpoint: every write with `ser` ≤ this is on the datastore.
    pub checkpoint: u64,
    /// Incremented by every transition to `wt`; replicas of an older gen are stale.
    pub gen: u64,
    pub owner: String,
    #[serde(default)]
    pub peers: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_owner: Option<String>,
}

/// Per-volume write-back tuning (DESIGN §3).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
pub struct Tuning {
    /// Seconds a destage window is held open to absorb overwrites; 0 = FVP's batches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold_s: Option<f64>,
    /// Dirty data older than this is destaged even while a window is held.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_dirty_age_s: Option<f64>,
    /// Recovery point objective: seconds of dirty data that flow control aims to stay under.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rpo_s: Option<f64>,
}

impl Eq for Tuning {}

impl VolumeRecord {
    /// The volume as its datastore knows it.
    pub fn spec(&self) -> datastore::VolumeSpec {
        datastore::VolumeSpec {
            id: self.id,
            name: self.name.clone(),
            size: self.size,
        }
    }
}

/// Everything the coordinator holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct State {
    #[serde(default)]
    pub datastores: Vec<DatastoreSpec>,
    #[serde(default)]
    pub volumes: Vec<VolumeRecord>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_parses_and_explains_what_is_missing() {
        assert_eq!("uncached".parse::<Policy>(), Ok(Policy::Uncached));
        assert_eq!("wt".parse::<Policy>(), Ok(Policy::Wt));
        assert_eq!("wb".parse::<Policy>(), Ok(Policy::Wb));
        for p in [Policy::Uncached, Policy::Wt, Policy::Wb] {
            assert_eq!(Policy::from_code(p.code()), Some(p));
            assert_eq!(p.to_string().parse::<Policy>(), Ok(p));
        }
        let e = "wbp:2".parse::<Policy>().unwrap_err();
        assert!(e.contains("not available"), "{e}");
        let e = "fast".parse::<Policy>().unwrap_err();
        assert!(
            e.contains("unknown policy") && e.contains("uncached"),
            "{e}"
        );
    }
}
