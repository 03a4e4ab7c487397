//! What the engine's integration tests share: a volume on a cache device over a datastore in
//! memory, and a destager driven by hand.

#![allow(dead_code)] // each test file uses part of it

use std::sync::Arc;

use cachelog::device::CacheDevice;
use cluster::{Policy, Tuning};
use datastore::device::MemDevice;
use datastore::{Extent, Gate};
use engine::cache::{CacheHost, VolCache};
use engine::replica::{BoxFuture, PeerReport, ReplicaWrite, Replicator};
use engine::Volume;
use uuid::Uuid;

pub const SEG: u64 = 64 << 10;
pub const VOL: u64 = 1 << 20;
pub const BLOCK: usize = 4096;

/// Opens (or recovers) the cache on `cache` and volume `id` on `store` with `policy`, and
/// ends recovery.
pub fn open(
    cache: Arc<dyn CacheDevice>,
    store: &Arc<MemDevice>,
    id: Uuid,
    policy: Policy,
) -> (Arc<CacheHost>, Volume) {
    let host = CacheHost::open(cache, SEG).unwrap();
    let extent = Extent::new(store.clone(), 0, VOL, Arc::new(Gate::new(4)));
    let vol = Volume::open(
        id,
        "t".into(),
        policy,
        Tuning::default(),
        extent,
        Some(host.clone()),
    )
    .unwrap();
    host.finish_recovery(&[id]).unwrap();
    (host, vol)
}

/// Runs destager turns until `c` is clean; panics if it never gets there.
pub async fn destage_all(host: &CacheHost, c: &VolCache) {
    for turn in 0..1000 {
        if c.clean() {
            return;
        }
        host.destage_turn(turn).await;
        tokio::task::yield_now().await;
    }
    assert!(c.clean(), "the destager made no progress");
}

/// Peers that take everything (what they hold does not matter to these tests, only that the
/// volume has peers).
pub struct Yes;

impl Replicator for Yes {
    fn write(&self, _w: ReplicaWrite) -> BoxFuture<Result<(), String>> {
        Box::pin(async { Ok(()) })
    }
    fn flush(&self) -> BoxFuture<Result<(), String>> {
        Box::pin(async { Ok(()) })
    }
    fn checkpoint(&self, _gen: u64, _ser: u64) {}
    fn exclude_failed(&self) -> BoxFuture<Result<(), String>> {
        Box::pin(async { Ok(()) })
    }
    fn hand_off(&self) -> BoxFuture<Result<(), String>> {
        Box::pin(async { Ok(()) })
    }
    fn healthy(&self) -> bool {
        true
    }
    fn report(&self) -> Vec<PeerReport> {
        Vec::new()
    }
}

/// Leaves `log` no room, even for volume `id`'s metadata: another owner's data up to the
/// metadata reserve, then `id`'s current segment with header-only records of a generation no
/// recovery takes, then the reserve with the other owner's metadata. Every record stays
/// pinned (in `pins`), so nothing is freed until the test unpins them.
pub fn fill_log(log: &cachelog::Log, id: Uuid, pins: &mut Vec<cachelog::Loc>) {
    use cachelog::format::Kind;
    use cachelog::{Entry, LogError};
    let other = Uuid::new_v4();
    let entry = |kind, volume, len| Entry {
        kind,
        volume,
        ser: 1,
        gen: 0,
        offset: 0,
        len,
        arg: 0,
    };
    let data = vec![0u8; 4096];
    for (e, payload) in [
        (entry(Kind::Data, other, 4096), &data[..]),
        (entry(Kind::Zero, id, 4096), &[][..]),
        (entry(Kind::Checkpoint, other, 0), &[][..]),
    ] {
        loop {
            match log.append(&e, payload) {
                Ok((loc, _)) => pins.push(loc),
                Err(LogError::NoSpace) => break,
                Err(err) => panic!("filling the log: {err}"),
            }
        }
    }
}
