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
}

impl Policy {
    /// Every policy name, for error messages.
    pub const ALL: &'static [&'static str] = &["uncached"];
    /// Policies the design names that this build does not serve yet.
    const LATER: &'static [&'static str] = &["wt", "wb", "wbp"];
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Policy::Uncached => f.write_str("uncached"),
        }
    }
}

impl FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Policy, String> {
        match s {
            "uncached" => Ok(Policy::Uncached),
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
}

impl VolumeRecord {
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
        let e = "wb".parse::<Policy>().unwrap_err();
        assert!(e.contains("not available"), "{e}");
        let e = "wbp:2".parse::<Policy>().unwrap_err();
        assert!(e.contains("not available"), "{e}");
        let e = "fast".parse::<Policy>().unwrap_err();
        assert!(
            e.contains("unknown policy") && e.contains("uncached"),
            "{e}"
        );
    }
}
