//! Coordination (DESIGN §4): what the cluster agrees on about datastores and volumes, and the
//! [`Coordinator`] through which every change to it goes.
//!
//! - [`record`]: the records (datastores, volumes, policies).
//! - [`local`]: the single-host coordinator, the embedded default: a state file in the data
//!   directory, replaced atomically on every change. No external service.
//! - [`etcd`]: a cluster of hosts sharing one etcd (v3 API): host registration bound to a
//!   lease, per-volume vault locks bound to the holder's lease, vault records, and the
//!   self-fencing that stops a host's datastore writes before its lease can expire.

pub mod etcd;
pub mod local;
pub mod record;

use std::sync::Arc;

use async_trait::async_trait;
use uuid::Uuid;

pub use record::{
    HostRecord, HostStatus, Moved, PeerRule, Policy, State, Tuning, Vault, VolumeRecord,
};

use datastore::fence::Fence;
use datastore::DatastoreSpec;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Exists(String),
    #[error("{0}")]
    NotFound(String),
    #[error("coordinator state {path}: {msg}")]
    Corrupt { path: String, msg: String },
    /// The coordination service cannot be reached or refused the request.
    #[error("coordinator: {0}")]
    Unavailable(String),
    /// Another host holds the lock.
    #[error("{0}")]
    Locked(String),
    /// This host does not (or no longer) hold the lock the change needs.
    #[error("{0}")]
    NotHeld(String),
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
    /// Forgets volume `id`, named `name`, and its vault; fails with [`Error::NotFound`] if
    /// no volume by that name has that id (a name taken since by another volume is not its
    /// to delete), and with [`Error::Locked`] while another host holds its vault lock.
    async fn delete_volume(&self, name: &str, id: Uuid) -> Result<()>;
    /// Ids of deleted volumes: [`Coordinator::delete_volume`] keeps each, in the same change
    /// that removes the record. Storage with such an id found with no record (left by a
    /// delete that could not reach its datastore, or a relocation's copy out of reach) is the
    /// deleted volume's, to be freed, never taken for a create cut short and imported. An id
    /// is kept [`DELETED_KEEP`], then forgotten (storage a delete left on a datastore away
    /// longer than that is imported as a volume, listed and deletable, when it is back).
    async fn deleted_volumes(&self) -> Result<Vec<Uuid>>;

    /// This host's name.
    fn host(&self) -> &str;
    /// Publishes this host's record (addresses once bound, cache use).
    async fn publish_host(&self, h: HostRecord) -> Result<()>;
    /// Every host that ever registered, with its liveness.
    async fn hosts(&self) -> Result<Vec<HostStatus>>;
    /// The fence every datastore of this host writes through ([`Fence`]).
    fn fence(&self) -> Arc<Fence>;

    /// Takes the volume's vault lock for this host (a no-op if it holds it already); fails
    /// with [`Error::Locked`] naming the holder. Only the holder writes the volume's datastore.
    async fn lock_vault(&self, volume: Uuid) -> Result<()>;
    /// Gives the vault lock up (after the volume's dirty data is on its datastore, or when
    /// the volume is deleted).
    async fn unlock_vault(&self, volume: Uuid) -> Result<()>;
    /// The volume's vault record, if one was written.
    async fn vault(&self, volume: Uuid) -> Result<Option<Vault>>;
    /// Writes the vault record; fails with [`Error::NotHeld`] unless this host holds the
    /// volume's vault lock at this moment (the lock's revision fences a stale holder).
    async fn put_vault(&self, v: &Vault) -> Result<()>;

    /// Serializes changes to a datastore's own metadata (a `lun`'s volume table) across
    /// hosts. Held until the guard is passed to [`Coordinator::unlock_datastore`].
    async fn lock_datastore(&self, name: &str) -> Result<DatastoreLock>;
    async fn unlock_datastore(&self, lock: DatastoreLock) -> Result<()>;

    /// Publishes this host's balancing statistics of one kind (DESIGN §8), replacing its
    /// last document of that kind. The coordinator carries the document without reading it;
    /// it goes away with the host (its lease).
    async fn put_stats(&self, kind: StatsDoc, doc: Vec<u8>) -> Result<()>;
    /// Every live host's latest document of that kind, by host name.
    async fn stats(&self, kind: StatsDoc) -> Result<Vec<(String, Vec<u8>)>>;
    /// Takes, or keeps, the pod's one statistics aggregator role: true while this host has
    /// it. The role is bound to the host's lease, so another host takes it over when this
    /// one is gone.
    async fn stats_aggregator(&self) -> Result<bool>;
    /// Publishes the pod's combined statistics; fails with [`Error::NotHeld`] unless this
    /// host is the aggregator at this moment.
    async fn put_pod_stats(&self, doc: Vec<u8>) -> Result<()>;
    /// The pod's combined statistics, if an aggregator has published them.
    async fn pod_stats(&self) -> Result<Option<Vec<u8>>>;

    /// The pod's peer key, which hosts prove they know before they take each other's wbp
    /// writes (DESIGN §4). `fresh` (random bytes) becomes the key if the pod has none yet;
    /// every host then gets the first one stored.
    async fn peer_key(&self, fresh: [u8; 32]) -> Result<[u8; 32]>;

    /// The pod's id: one for all its hosts, another for every other pod (or single host).
    /// Each LUN the pod formats carries it in its label, so that a LUN another pod uses is
    /// never adopted silently: two pods would allocate from one volume table under two
    /// locks. `fresh` becomes the id if the pod has none yet; every host then gets the first
    /// one stored.
    async fn pod_id(&self, fresh: Uuid) -> Result<Uuid>;
    /// The pod id if one is stored, without making one.
    async fn stored_pod_id(&self) -> Result<Option<Uuid>>;

    /// Leaves the cluster at a clean stop. `quiet`: no datastore write of this host is still
    /// in service ([`Fence`] revoked, every one answered); then this host shows as down at
    /// once, and its next start adopts its vault locks without waiting. Otherwise its
    /// registration is left to lapse with its lease, as after a crash, so that nothing takes
    /// its locks before the lease could have expired (the fence's budget for a write already
    /// sent).
    async fn shutdown(&self, quiet: bool) {
        let _ = quiet;
    }
}

/// How long the id of a deleted volume is kept ([`Coordinator::deleted_volumes`]): long enough
/// for any datastore that was away at the delete to be back, short enough that a pod creating
/// and deleting volumes all day does not keep every id it ever used.
pub const DELETED_KEEP: std::time::Duration = std::time::Duration::from_secs(30 * 24 * 3600);

/// The kinds of statistics documents hosts publish ([`Coordinator::put_stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StatsDoc {
    /// The host's recent intervals of each datastore it uses, every interval.
    Devices,
    /// The workload models of the volumes the host serves, now and then.
    Volumes,
}

impl StatsDoc {
    /// Its name in keys.
    pub fn name(self) -> &'static str {
        match self {
            StatsDoc::Devices => "devices",
            StatsDoc::Volumes => "volumes",
        }
    }
}

/// A held datastore metadata lock ([`Coordinator::lock_datastore`]).
#[derive(Debug)]
pub struct DatastoreLock {
    pub name: String,
    /// The coordinator's handle on the lock (etcd's lock key); empty for `local`.
    pub key: Vec<u8>,
    /// How many times this host's fence had closed ([`Fence::closes`]) when the lease the lock
    /// was granted under became this host's. The lock is bound to that lease: once the fence
    /// has closed again the lease may be gone, and the lock with it, though a new lease
    /// reopens the fence.
    pub closes: u64,
}

impl DatastoreLock {
    /// Whether the lease the lock was granted under is still this host's, never lost: the
    /// lock can be used only while this holds (the datastore checks the fence from then on).
    pub fn held_under(&self, fence: &Fence) -> bool {
        fence.closes() == self.closes
    }
}

/// Seconds since the Unix epoch.
pub fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
