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
    /// Write-back with peers: writes complete when the local cache device and `peers` peer
    /// hosts chosen by `rule` have them (`wbp:P` or `wbp:P:rule`).
    Wbp { peers: u8, rule: PeerRule },
}

/// Which hosts may be a `wbp` volume's peers, by fault domain (DESIGN §3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PeerRule {
    /// Hosts in the owner's fault domain.
    Local,
    /// Hosts in other fault domains.
    Remote,
    /// Any other host.
    #[default]
    Any,
}

impl PeerRule {
    /// Whether a host in `domain` may be a peer of an owner in `owner_domain`.
    pub fn allows(self, owner_domain: &str, domain: &str) -> bool {
        match self {
            PeerRule::Local => owner_domain == domain,
            PeerRule::Remote => owner_domain != domain,
            PeerRule::Any => true,
        }
    }

    fn code(self) -> u64 {
        match self {
            PeerRule::Local => 0,
            PeerRule::Remote => 1,
            PeerRule::Any => 2,
        }
    }

    fn from_code(c: u64) -> Option<PeerRule> {
        Some(match c {
            0 => PeerRule::Local,
            1 => PeerRule::Remote,
            2 => PeerRule::Any,
            _ => return None,
        })
    }
}

impl fmt::Display for PeerRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PeerRule::Local => "local",
            PeerRule::Remote => "remote",
            PeerRule::Any => "any",
        })
    }
}

impl Policy {
    /// Every policy form, for error messages.
    pub const ALL: &'static [&'static str] = &["uncached", "wt", "wb", "wbp:P[:local|remote|any]"];
    /// Most peers a `wbp` volume may have.
    pub const PEERS_MAX: u8 = 4;

    /// Whether the volume uses the host's cache device.
    pub fn cached(self) -> bool {
        !matches!(self, Policy::Uncached)
    }

    /// How many peers the policy asks for (0 unless `wbp`).
    pub fn peers(self) -> usize {
        match self {
            Policy::Wbp { peers, .. } => peers as usize,
            _ => 0,
        }
    }

    /// The code stored in a cache log policy record.
    pub fn code(self) -> u64 {
        match self {
            Policy::Uncached => 0,
            Policy::Wt => 1,
            Policy::Wb => 2,
            Policy::Wbp { peers, rule } => 3 | (u64::from(peers) << 8) | (rule.code() << 16),
        }
    }

    pub fn from_code(c: u64) -> Option<Policy> {
        Some(match c & 0xff {
            0 => Policy::Uncached,
            1 => Policy::Wt,
            2 => Policy::Wb,
            3 => Policy::Wbp {
                peers: ((c >> 8) & 0xff) as u8,
                rule: PeerRule::from_code((c >> 16) & 0xff)?,
            },
            _ => return None,
        })
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Policy::Uncached => f.write_str("uncached"),
            Policy::Wt => f.write_str("wt"),
            Policy::Wb => f.write_str("wb"),
            Policy::Wbp { peers, rule } if *rule == PeerRule::default() => {
                write!(f, "wbp:{peers}")
            }
            Policy::Wbp { peers, rule } => write!(f, "wbp:{peers}:{rule}"),
        }
    }
}

impl FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Policy, String> {
        match s {
            "uncached" => return Ok(Policy::Uncached),
            "wt" => return Ok(Policy::Wt),
            "wb" => return Ok(Policy::Wb),
            _ => {}
        }
        let mut parts = s.split(':');
        if parts.next() != Some("wbp") {
            return Err(format!(
                "unknown policy {s:?}; available: {}",
                Policy::ALL.join(", ")
            ));
        }
        let peers = parts
            .next()
            .and_then(|p| p.parse::<u8>().ok())
            .filter(|p| (1..=Policy::PEERS_MAX).contains(p))
            .ok_or_else(|| {
                format!(
                    "policy {s:?}: wbp needs a peer count from 1 to {}, e.g. wbp:1 or wbp:2:remote",
                    Policy::PEERS_MAX
                )
            })?;
        let rule = match parts.next() {
            None | Some("any") => PeerRule::Any,
            Some("local") => PeerRule::Local,
            Some("remote") => PeerRule::Remote,
            Some(other) => {
                return Err(format!(
                    "policy {s:?}: unknown peer rule {other:?}; use local (same fault domain), \
                     remote (other fault domains) or any"
                ))
            }
        };
        if parts.next().is_some() {
            return Err(format!("policy {s:?}: expected wbp:P or wbp:P:rule"));
        }
        Ok(Policy::Wbp { peers, rule })
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
    /// Its last relocation, which the planner does not undo for a while (no ping-pong).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moved: Option<Moved>,
}

/// A volume's relocation off datastore `from`, at `unix` (seconds since the Unix epoch).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Moved {
    pub from: String,
    pub unix: u64,
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
    /// The owner cannot destage the volume itself (its cache device failed) and has given up
    /// the vault lock for a peer to replay from its replicas (FVP Table 1, flash failure).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub handoff: bool,
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
        for (text, peers, rule) in [
            ("wbp:1", 1, PeerRule::Any),
            ("wbp:2:remote", 2, PeerRule::Remote),
            ("wbp:4:local", 4, PeerRule::Local),
        ] {
            let p: Policy = text.parse().unwrap();
            assert_eq!(p, Policy::Wbp { peers, rule });
            assert_eq!(Policy::from_code(p.code()), Some(p));
            assert_eq!(p.to_string().parse::<Policy>(), Ok(p));
            assert_eq!(p.peers(), peers as usize);
        }
        assert_eq!("wbp:2:any".parse::<Policy>().unwrap().to_string(), "wbp:2");
        for bad in [
            "wbp",
            "wbp:0",
            "wbp:5",
            "wbp:x",
            "wbp:1:rack",
            "wbp:1:any:x",
        ] {
            let e = bad.parse::<Policy>().unwrap_err();
            assert!(e.contains(bad), "{e}");
        }
        assert!(PeerRule::Local.allows("r1", "r1") && !PeerRule::Local.allows("r1", "r2"));
        assert!(PeerRule::Remote.allows("r1", "r2") && !PeerRule::Remote.allows("r1", "r1"));
        assert!(PeerRule::Any.allows("r1", "r1") && PeerRule::Any.allows("r1", "r2"));
        let e = "fast".parse::<Policy>().unwrap_err();
        assert!(
            e.contains("unknown policy") && e.contains("uncached"),
            "{e}"
        );
    }
}
