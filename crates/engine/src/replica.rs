//! What the IO path needs from `wbp` peers (DESIGN §3–§4), as a trait: the engine knows no
//! network. The daemon implements it over the `peer` crate's links and the coordinator.

use std::future::Future;
use std::pin::Pin;

use bytes::Bytes;

pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// One write as sent to the peers.
#[derive(Debug, Clone)]
pub struct ReplicaWrite {
    pub gen: u64,
    pub ser: u64,
    pub offset: u64,
    pub len: u64,
    /// `None` for WRITE_ZEROES and TRIM.
    pub data: Option<Bytes>,
    /// A zeroing the datastore must keep allocated (WRITE_ZEROES with NO_HOLE).
    pub alloc: bool,
}

/// One peer as `vesta volume show` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerReport {
    pub host: String,
    /// The highest `ser` the peer has acknowledged.
    pub acked_ser: u64,
    /// Why the link failed, if it did.
    pub error: Option<String>,
}

/// A volume's peers in `wbp`.
///
/// The contract the engine relies on: a write whose [`Replicator::write`] succeeded is in
/// every peer's cache log; a [`Replicator::flush`] that succeeded made durable on every peer
/// every write whose [`Replicator::write`] had succeeded before the flush was called (not
/// writes still in flight: a peer syncs a FLUSH as soon as it reads it). Once a write or flush failed, the engine completes nothing more
/// until [`Replicator::exclude_failed`] has succeeded, i.e. until the peers that failed can
/// no longer replay the volume: otherwise a peer holding an older prefix could replay it
/// over newer data.
pub trait Replicator: Send + Sync + 'static {
    fn write(&self, w: ReplicaWrite) -> BoxFuture<Result<(), String>>;
    fn flush(&self) -> BoxFuture<Result<(), String>>;
    /// The datastore holds every write up to `ser`: peers may drop their copies.
    fn checkpoint(&self, gen: u64, ser: u64);
    /// Takes the failed peers out of the volume's vault record (see the trait doc).
    fn exclude_failed(&self) -> BoxFuture<Result<(), String>>;
    /// Marks the vault for a peer to replay the volume (the owner's cache device failed);
    /// the caller then gives the vault lock up.
    fn hand_off(&self) -> BoxFuture<Result<(), String>>;
    /// Whether every peer is still taking writes.
    fn healthy(&self) -> bool;
    /// Called about once a second while the volume replicates: checks that peers whose
    /// links have been idle a while still answer, so that [`Replicator::healthy`] turns
    /// false for a peer gone silent without waiting for the next write. Default: nothing.
    fn keep_alive(&self) {}
    fn report(&self) -> Vec<PeerReport>;
}
