//! Coordination (DESIGN §4): what the cluster agrees on about datastores and volumes, and the
//! [`Coordinator`] through which every change to it goes.
//!
//! - [`record`]: the records (datastores, volumes, policies).
//! - [`local`]: the single-host coordinator, the embedded default: a state file in the data
//!   directory, replaced atomically on every change. No external service.
//!
//! The `etcd` coordinator (host leases, vault locks and records) plugs in behind the same trait.

pub mod local;
pub mod record;

use async_trait::async_trait;

pub use record::{Policy, State, Tuning, VolumeRecord};

use datastore::DatastoreSpec;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Exists(String),
    #[error("{0}")]
    NotFound(String),
    #[error("coordinator state {path}: {msg}")]
    Corrupt { path: String, msg: String },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Every change to shared records goes through here; callers hold no copy they mutate.
#[async_trait]
pub trait Coordinator: Send + Sync + 'static {
    /// Which implementation, for status output.
    fn kind(&self) -> &'static str;
    /// The current records.
    async fn state(&self) -> Result<State>;
    /// Records a new datastore; fails with [`Error::Exists`] if the name is taken.
    async fn add_datastore(&self, d: DatastoreSpec) -> Result<()>;
    /// Replaces a datastore's record (same name).
    async fn update_datastore(&self, d: DatastoreSpec) -> Result<()>;
    /// Records a new volume; fails with [`Error::Exists`] if the name or id is taken.
    async fn create_volume(&self, v: VolumeRecord) -> Result<()>;
    /// Replaces a volume's record (same id).
    async fn update_volume(&self, v: VolumeRecord) -> Result<()>;
    /// Forgets a volume; fails with [`Error::NotFound`] if there is none by that name.
    async fn delete_volume(&self, name: &str) -> Result<()>;
}
