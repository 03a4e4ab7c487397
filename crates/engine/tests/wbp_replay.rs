//! `wbp` against the death of the owner, as a property (DESIGN §2, §4): an owner replicates
//! random overlapping writes, zeroes, FUA writes and FLUSHes to a peer (in process: the
//! peer's replica store is called directly, which is what the daemon's peer service does),
//! destages some of them, and dies. Sometimes the peer loses power too (its unsynced cache
//! writes are kept, torn or dropped). The peer then replays online from a checkpoint no newer
//! than the owner's, onto the same datastore.
//!
//! Afterwards the datastore must equal the volume as of a prefix of the writes in issue order,
//! and that prefix must hold every completed write (every durable one if the peer lost power).

use std::sync::Arc;

use bytes::Bytes;
use proptest::prelude::*;
use uuid::Uuid;

use cachelog::device::{Fate, SimDevice};
use cluster::{PeerRule, Policy, Tuning};
use datastore::device::MemDevice;
use datastore::{Extent, Gate};
use engine::cache::{CacheHost, ReplicaInfo, ReplicaRefusal};
use engine::replica::{BoxFuture, PeerReport, ReplicaWrite, Replicator};
use engine::Volume;

mod common;

const SECTORS: u64 = 64;
const VOL: u64 = SECTORS * 512;
const SEG: u64 = 64 << 10;

/// The peer, called in process.
struct Direct {
    peer: Arc<CacheHost>,
    volume: Uuid,
}

impl Replicator for Direct {
    fn write(&self, w: ReplicaWrite) -> BoxFuture<Result<(), String>> {
        let r = self
            .peer
            .replica_write(
                self.volume,
                w.gen,
                w.ser,
                w.offset,
                w.len,
                w.data.as_deref(),
                w.alloc,
            )
            .map_err(|e| format!("{e:?}"));
        Box::pin(async move { r })
    }
    fn flush(&self) -> BoxFuture<Result<(), String>> {
        let r = self.peer.replica_sync().map_err(|e| format!("{e:?}"));
        Box::pin(async move { r })
    }
    fn checkpoint(&self, gen: u64, ser: u64) {
        self.peer
            .replica_checkpoint(self.volume, gen, ser)
            .expect("checkpoint");
    }
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

#[derive(Debug, Clone)]
enum Op {
    Write {
        sector: u64,
        sectors: u64,
        fua: bool,
    },
    Zero {
        sector: u64,
        sectors: u64,
    },
    Flush,
    Destage,
}

/// What `host` holds of `volume`'s replicas; panics if it holds none.
fn replica_set(host: &CacheHost, volume: Uuid) -> ReplicaInfo {
    host.replica_sets()
        .into_iter()
        .find(|s| s.volume == volume)
        .unwrap_or_else(|| panic!("no replicas of volume {volume}"))
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..SECTORS, 1..9u64, prop::bool::weighted(0.2)).prop_map(|(s, n, fua)| Op::Write {
            sector: s,
            sectors: n.min(SECTORS - s),
            fua
        }),
        1 => (0..SECTORS, 1..9u64).prop_map(|(s, n)| Op::Zero { sector: s, sectors: n.min(SECTORS - s) }),
        1 => Just(Op::Flush),
        2 => Just(Op::Destage),
    ]
}

type W = (u64, Vec<u8>);

fn image(writes: &[W], k: usize) -> Vec<u8> {
    let mut img = vec![0u8; VOL as usize];
    for (off, d) in &writes[..k] {
        img[*off as usize..*off as usize + d.len()].copy_from_slice(d);
    }
    img
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn a_peer_replays_every_completed_write_in_order(
        ops in proptest::collection::vec(op(), 1..50),
        peer_power_loss in prop::option::weighted(0.4, proptest::collection::vec(0u8..3, 1..8)),
        vault_lags in any::<bool>(),
        depth in prop::sample::select(vec![1u32, 8]),
    ) {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(async {
            let id = Uuid::new_v4();
            let store = Arc::new(MemDevice::new(VOL));
            let extent = || Extent::new(store.clone(), 0, VOL, Arc::new(Gate::new(depth)));
            let owner_host = CacheHost::open(Arc::new(SimDevice::new((1 << 20) + 64 * SEG)), SEG).unwrap();
            let peer_dev = Arc::new(SimDevice::new((1 << 20) + 64 * SEG));
            let peer = CacheHost::open(peer_dev.clone(), SEG).unwrap();
            let vol = Volume::open(id, "v".into(), Policy::Wt, Tuning::default(), extent(), Some(owner_host.clone())).unwrap();
            let p2 = peer.clone();
            let hook: engine::SwitchHook = Box::new(move |gen, ckpt| {
                let r = p2.replica_open("owner", id, gen, ckpt).map_err(|e| format!("{e:?}"));
                Box::pin(async move { r })
            });
            vol.set_policy_with(
                Policy::Wbp { peers: 1, rule: PeerRule::Any },
                Some(Arc::new(Direct { peer: peer.clone(), volume: id })),
                Some(hook),
            ).await.unwrap();
            let mut writes: Vec<W> = Vec::new();
            let mut durable = 0usize;
            for (i, op) in ops.iter().enumerate() {
                match op {
                    Op::Write { sector, sectors, fua } => {
                        let data = vec![(i % 250) as u8 + 1; (*sectors * 512) as usize];
                        vol.write(sector * 512, Bytes::from(data.clone()), *fua).await.unwrap();
                        writes.push((sector * 512, data));
                        if *fua {
                            durable = writes.len();
                        }
                    }
                    Op::Zero { sector, sectors } => {
                        vol.write_zeroes(sector * 512, sectors * 512, true, false).await.unwrap();
                        writes.push((sector * 512, vec![0u8; (*sectors * 512) as usize]));
                    }
                    Op::Flush => {
                        vol.flush().await.unwrap();
                        durable = writes.len();
                    }
                    Op::Destage => {
                        owner_host.destage_turn(0).await;
                    }
                }
            }
            // The vault's checkpoint is a recent one, maybe behind the owner's.
            let owner_ckpt = vol.cache().unwrap().checkpoint();
            let vault_ckpt = if vault_lags { owner_ckpt / 2 } else { owner_ckpt };
            // The owner dies: nothing of it is used again.
            drop(vol);
            drop(owner_host);
            let (peer, must_have) = match &peer_power_loss {
                None => (peer, writes.len()),
                Some(fates) => {
                    drop(peer);
                    peer_dev.power_loss(|j, n| match fates[j % fates.len()] {
                        0 => Fate::Lost,
                        1 => Fate::Kept,
                        _ => Fate::Torn(n / 2),
                    });
                    (CacheHost::open(peer_dev.clone(), SEG).unwrap(), durable)
                }
            };
            // Online replay on the peer.
            let held = peer.replica_sets().into_iter().any(|s| s.volume == id);
            if held {
                peer.promote_replicas(id, vault_ckpt, u64::MAX).unwrap();
            }
            let v2 = Volume::open(id, "v".into(), Policy::Wb, Tuning::default(), extent(), Some(peer.clone())).unwrap();
            let c = v2.cache().unwrap();
            for turn in 0..10_000 {
                if c.clean() {
                    break;
                }
                peer.destage_turn(turn).await;
            }
            prop_assert!(c.clean(), "the replay made no progress");
            let img = store.image();
            let k = (0..=writes.len()).rev().find(|k| image(&writes, *k) == img);
            prop_assert!(k.is_some(), "the datastore is not the volume as of any prefix of the writes");
            let k = k.unwrap();
            // Another prefix may read the same (later writes rewrote the same bytes); the
            // longest one is what counts.
            prop_assert!(k >= must_have, "only {} of {} writes are on the datastore; {} had to be", k, writes.len(), must_have);
            Ok(())
        })?;
    }
}

/// A switch whose hook fails (the vault write may or may not have landed) leaves the volume
/// in wt: from then on a completed write is on the datastore, so no vault record can make it
/// look stale.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_switch_hook_leaves_the_volume_in_wt() {
    let id = Uuid::new_v4();
    let store = Arc::new(MemDevice::new(VOL));
    let host = CacheHost::open(Arc::new(SimDevice::new((1 << 20) + 64 * SEG)), SEG).unwrap();
    let peer = CacheHost::open(Arc::new(SimDevice::new((1 << 20) + 64 * SEG)), SEG).unwrap();
    let extent = Extent::new(store.clone(), 0, VOL, Arc::new(Gate::new(8)));
    let vol = Volume::open(
        id,
        "v".into(),
        Policy::Wb,
        Tuning::default(),
        extent,
        Some(host.clone()),
    )
    .unwrap();
    vol.write(0, Bytes::from(vec![1u8; 4096]), false)
        .await
        .unwrap();
    let drive = {
        let h = host.clone();
        tokio::spawn(async move {
            for turn in 0.. {
                if !h.destage_turn(turn).await {
                    tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                }
            }
        })
    };
    let hook: engine::SwitchHook =
        Box::new(|_, _| Box::pin(async { Err("vault write: no answer".to_string()) }));
    let e = to_wbp_1(&vol, peer, id, hook).await.unwrap_err();
    assert!(e.to_string().contains("in wt meanwhile"), "{e}");
    assert_eq!(vol.policy(), Policy::Wt);
    drive.abort();
    // Written through: on the datastore as soon as it completes.
    vol.write(8192, Bytes::from(vec![2u8; 4096]), false)
        .await
        .unwrap();
    let img = store.image();
    assert!(
        img[..4096].iter().all(|b| *b == 1),
        "drained before the switch"
    );
    assert!(
        img[8192..12288].iter().all(|b| *b == 2),
        "wt writes reach the datastore"
    );
}

/// Switches `vol` (volume `id`) to `wbp:1` with `peer` as its peer, running `hook` as the
/// daemon's vault record would run.
async fn to_wbp_1(
    vol: &Volume,
    peer: Arc<CacheHost>,
    id: Uuid,
    hook: engine::SwitchHook,
) -> Result<(), engine::Error> {
    vol.set_policy_with(
        Policy::Wbp {
            peers: 1,
            rule: PeerRule::Any,
        },
        Some(Arc::new(Direct { peer, volume: id })),
        Some(hook),
    )
    .await
}

/// Volume `id` on `store` owned by a host on its own cache device, recovered, in `wbp:1` with
/// the peer called in process (its hook opens the replica set on it): the cache device, the
/// owner, the peer and the volume.
async fn owner_in_wbp_1(
    id: Uuid,
    store: &Arc<MemDevice>,
) -> (Arc<SimDevice>, Arc<CacheHost>, Arc<CacheHost>, Volume) {
    let dev = Arc::new(SimDevice::new((1 << 20) + 64 * SEG));
    let owner = CacheHost::open(dev.clone(), SEG).unwrap();
    let peer = CacheHost::open(Arc::new(SimDevice::new((1 << 20) + 64 * SEG)), SEG).unwrap();
    let extent = Extent::new(store.clone(), 0, VOL, Arc::new(Gate::new(8)));
    let vol = Volume::open(
        id,
        "v".into(),
        Policy::Wt,
        Tuning::default(),
        extent,
        Some(owner.clone()),
    )
    .unwrap();
    owner.finish_recovery(&[id]).unwrap();
    let p2 = peer.clone();
    let hook: engine::SwitchHook = Box::new(move |gen, ckpt| {
        let r = p2
            .replica_open("owner", id, gen, ckpt)
            .map_err(|e| format!("{e:?}"));
        Box::pin(async move { r })
    });
    to_wbp_1(&vol, peer.clone(), id, hook).await.unwrap();
    (dev, owner, peer, vol)
}

/// The hook records the new generation, and then the cache cannot switch to it (here its
/// device fails as the hook runs): the vault names a generation the volume does not write
/// in, so its writes are held, as after a failed hook, until the owner records the vault
/// again. Before, they went on in the old generation, which a restart that finds the vault
/// newer drops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_switch_that_fails_after_its_hook_recorded_it_holds_the_writes() {
    let id = Uuid::new_v4();
    let store = Arc::new(MemDevice::new(VOL));
    let dev = Arc::new(SimDevice::new((1 << 20) + 64 * SEG));
    let host = CacheHost::open(dev.clone(), SEG).unwrap();
    let peer = CacheHost::open(Arc::new(SimDevice::new((1 << 20) + 64 * SEG)), SEG).unwrap();
    let extent = Extent::new(store.clone(), 0, VOL, Arc::new(Gate::new(8)));
    let vol = Volume::open(
        id,
        "v".into(),
        Policy::Wt,
        Tuning::default(),
        extent,
        Some(host.clone()),
    )
    .unwrap();
    host.finish_recovery(&[id]).unwrap();
    vol.write(0, Bytes::from(vec![1u8; 4096]), false)
        .await
        .unwrap();
    let failing = dev.clone();
    let hook: engine::SwitchHook = Box::new(move |_, _| {
        Box::pin(async move {
            failing.fail();
            Ok(())
        })
    });
    to_wbp_1(&vol, peer, id, hook).await.unwrap_err();
    assert!(
        vol.writes_held(),
        "writes go on in a generation the vault does not name"
    );
    let w = vol.write(8192, Bytes::from(vec![2u8; 4096]), false);
    assert!(
        tokio::time::timeout(std::time::Duration::from_millis(300), w)
            .await
            .is_err(),
        "a write completed while the vault names another generation"
    );
}

/// The hook records the new generation, and then the cache log has no room for the switch,
/// nor for the fall-back to wt: the cache still writes in the old generation, which the vault
/// no longer names (a restart that found the vault newer would drop those writes, and its new
/// peers lack them). The writes stay held, and cannot be let go until `catch_up_gen`, once
/// there is room, has moved the cache on to the recorded generation. Before, the daemon let
/// them go as soon as its own record of the vault went through, which for a volume with peers
/// was at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_held_after_a_switch_the_log_had_no_room_for_go_on_only_in_its_generation() {
    let id = Uuid::new_v4();
    let store = Arc::new(MemDevice::new(VOL));
    let host = CacheHost::open(Arc::new(SimDevice::new((1 << 20) + 16 * SEG)), SEG).unwrap();
    let peer = CacheHost::open(Arc::new(SimDevice::new((1 << 20) + 64 * SEG)), SEG).unwrap();
    let extent = Extent::new(store.clone(), 0, VOL, Arc::new(Gate::new(8)));
    let vol = Arc::new(
        Volume::open(
            id,
            "v".into(),
            Policy::Wt,
            Tuning::default(),
            extent,
            Some(host.clone()),
        )
        .unwrap(),
    );
    host.finish_recovery(&[id]).unwrap();
    vol.write(0, Bytes::from(vec![1u8; 4096]), false)
        .await
        .unwrap();
    let c = vol.cache().unwrap();
    let before = c.gen();
    let pins = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (log, filled) = (host.log().clone(), pins.clone());
    let recorded = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let r = recorded.clone();
    let hook: engine::SwitchHook = Box::new(move |gen, _| {
        Box::pin(async move {
            r.store(gen, std::sync::atomic::Ordering::SeqCst);
            common::fill_log(&log, id, &mut filled.lock().unwrap());
            Ok(())
        })
    });
    let e = to_wbp_1(&vol, peer, id, hook).await.unwrap_err();
    let recorded = recorded.load(std::sync::atomic::Ordering::SeqCst);
    assert!(recorded > before, "the hook recorded a newer generation");
    assert_eq!(c.gen(), before, "the log took no switch: {e}");
    assert!(vol.writes_held());
    assert!(
        !vol.release_writes(),
        "writes let go in generation {before} while the vault names {recorded}"
    );
    let write = {
        let v = vol.clone();
        tokio::spawn(async move { v.write(8192, Bytes::from(vec![2u8; 4096]), false).await })
    };
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(
        !write.is_finished(),
        "a write completed in the old generation"
    );
    assert!(vol.catch_up_gen().await.is_err(), "no room yet");

    // Room again: the cache moves on, in wt, and then the writes may go.
    for loc in pins.lock().unwrap().drain(..) {
        host.log().unpin(&loc);
    }
    host.log().sync_freed().unwrap();
    vol.catch_up_gen().await.unwrap();
    assert!(c.gen() >= recorded);
    assert_eq!(vol.policy(), Policy::Wt);
    assert!(vol.release_writes());
    tokio::time::timeout(std::time::Duration::from_secs(5), write)
        .await
        .expect("the write went on once released")
        .unwrap()
        .unwrap();
    assert!(store.image()[8192..12288].iter().all(|b| *b == 2));
}

/// A peer takes only whole sectors, and only for a generation it was opened for.
#[test]
fn a_peer_refuses_malformed_and_stale_writes() {
    let peer = CacheHost::open(Arc::new(SimDevice::new((1 << 20) + 16 * SEG)), SEG).unwrap();
    let id = Uuid::new_v4();
    let data = vec![7u8; 4096];
    assert!(
        matches!(
            peer.replica_write(id, 1, 1, 0, 4096, Some(&data), false),
            Err(ReplicaRefusal::Failed(_))
        ),
        "not opened"
    );
    peer.replica_open("a", id, 3, 0).unwrap();
    for (off, len) in [(100, 4096), (0, 100), (0, 0)] {
        let d = vec![1u8; len as usize];
        assert!(matches!(
            peer.replica_write(id, 3, 1, off, len, Some(&d), false),
            Err(ReplicaRefusal::Failed(m)) if m.contains("sectors")
        ));
    }
    assert!(matches!(
        peer.replica_write(id, 2, 1, 0, 4096, Some(&data), false),
        Err(ReplicaRefusal::Stale(_))
    ));
    assert!(matches!(
        peer.replica_open("a", id, 2, 0),
        Err(ReplicaRefusal::Stale(_))
    ));
    peer.replica_write(id, 3, 1, 0, 4096, Some(&data), false)
        .unwrap();
    let sets = peer.replica_sets();
    assert_eq!((sets[0].gen, sets[0].last_ser, sets[0].bytes), (3, 1, 4096));
    // A newer generation drops the older copies, those above its checkpoint too: a write its
    // owner sent here that never completed (the peer that replayed lacked it), whose `ser`
    // the new generation may give another write.
    peer.replica_write(id, 3, 2, 8192, 4096, Some(&data), false)
        .unwrap();
    peer.replica_open("a", id, 4, 1).unwrap();
    let sets = peer.replica_sets();
    assert_eq!(
        (sets[0].gen, sets[0].writes, sets[0].bytes, sets[0].last_ser),
        (4, 0, 0, 0)
    );
}

/// A peer says it holds a window's end only if its set records it: not for a generation it
/// does not hold, nor past what a set held for a replay knows (before, both answered OK
/// without recording anything, and the owner would have sent a window no replay here
/// reaches). An end it recorded is still held when asked again.
#[test]
fn a_peer_says_it_holds_a_window_end_only_when_it_recorded_it() {
    let peer = CacheHost::open(Arc::new(SimDevice::new((1 << 20) + 16 * SEG)), SEG).unwrap();
    let id = Uuid::new_v4();
    let gen = 3;
    peer.replica_open("a", id, gen, 0).unwrap();
    for ser in 1..=4u64 {
        let data = vec![ser as u8; 4096];
        peer.replica_write(id, gen, ser, ser * 4096, 4096, Some(&data), false)
            .unwrap();
    }
    peer.replica_window(id, gen, 0, 3).unwrap();
    // Another generation's window: older (its sender is stale) or newer (never opened here).
    assert!(matches!(
        peer.replica_window(id, gen - 1, 0, 4),
        Err(ReplicaRefusal::Stale(_))
    ));
    assert!(matches!(
        peer.replica_window(id, gen + 1, 0, 4),
        Err(ReplicaRefusal::Failed(_))
    ));
    // A checkpoint alone (no window end) is no promise, and is answered as before.
    peer.replica_window(id, gen + 1, 2, 0).unwrap();
    // Held for a replay: what it recorded stands; nothing past it is promised.
    peer.replica_hold(id, gen);
    peer.replica_window(id, gen, 0, 3).unwrap();
    peer.replica_window(id, gen, 1, 2).unwrap();
    assert!(matches!(
        peer.replica_window(id, gen, 0, 4),
        Err(ReplicaRefusal::Failed(m)) if m.contains("held")
    ));
}

/// [`replay_all`] in batch windows (the default hold), checking at every checkpoint it records
/// that the datastore is the volume as of it: `done` are the writes in `ser` order, all of
/// which the replay must put on the datastore.
async fn replay_checking(host: &Arc<CacheHost>, id: Uuid, store: &Arc<MemDevice>, done: &[W]) {
    let extent = Extent::new(store.clone(), 0, VOL, Arc::new(Gate::new(8)));
    let v = Volume::open(
        id,
        "v".into(),
        Policy::Wb,
        Tuning::default(),
        extent,
        Some(host.clone()),
    )
    .unwrap();
    let c = v.cache().unwrap();
    for turn in 0..1000 {
        if c.clean() {
            break;
        }
        let before = c.checkpoint();
        host.destage_turn(turn).await;
        let cp = c.checkpoint();
        if cp != before {
            assert!(
                store.image() == image(done, cp as usize),
                "checkpoint {cp} recorded over a datastore that is not the volume as of it"
            );
        }
    }
    assert!(c.clean(), "the replay made no progress");
    assert_eq!(store.image(), image(done, done.len()));
}

/// Replays what `host` promoted for `id` onto `store` to the end, as the daemon's online
/// replay does, then lets the volume go (the replaying host may die any time after).
async fn replay_all(host: &Arc<CacheHost>, id: Uuid, store: &Arc<MemDevice>) {
    let extent = Extent::new(store.clone(), 0, VOL, Arc::new(Gate::new(8)));
    let v = Volume::open(
        id,
        "v".into(),
        Policy::Wb,
        Tuning::default(),
        extent,
        Some(host.clone()),
    )
    .unwrap();
    let c = v.cache().unwrap();
    // While it replays here, this host holds the volume, though no longer as replicas.
    assert!(
        c.clean() || !matches!(host.replica_held(id, 0, 0), Err(ReplicaRefusal::Absent(_))),
        "a host replaying a volume said it holds nothing of it"
    );
    for turn in 0..10_000 {
        if c.clean() {
            break;
        }
        host.destage_turn(turn).await;
    }
    assert!(c.clean(), "the replay made no progress");
}

/// A zeroing with NO_HOLE must stay allocated on the datastore: the flag goes to the peer
/// with the write, and the peer's replay for a dead owner zeroes the range in place, where a
/// zeroing without it may deallocate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peers_replay_keeps_a_no_hole_zeroing_allocated() {
    let id = Uuid::new_v4();
    let store = Arc::new(MemDevice::new(VOL));
    let (_dev, owner, peer, vol) = owner_in_wbp_1(id, &store).await;
    vol.write(0, Bytes::from(vec![7u8; 16384]), false)
        .await
        .unwrap();
    // With FUA: on the peer's stable media before they complete.
    vol.write_zeroes(0, 4096, false, true).await.unwrap();
    vol.write_zeroes(4096, 4096, true, true).await.unwrap();
    // The owner dies before destaging any of it.
    drop(vol);
    drop(owner);
    let (_, upto) = peer.replica_seal(id, 0).unwrap().expect("replicas");
    assert_eq!(upto, 3);
    assert_eq!(peer.promote_replicas(id, 0, upto).unwrap(), 3);
    assert!(
        store.zeroings().is_empty(),
        "destaged before the owner died"
    );
    replay_all(&peer, id, &store).await;
    let z = store.zeroings();
    assert!(
        z.contains(&(0, 4096, false)),
        "the NO_HOLE zeroing may deallocate after the peer's replay: {z:?}"
    );
    assert!(z.contains(&(4096, 4096, true)), "{z:?}");
    let img = store.image();
    assert!(img[..8192].iter().all(|b| *b == 0));
    assert!(img[8192..16384].iter().all(|b| *b == 7));
}

/// FVP Table 1's cascade: the peer replaying for a dead owner dies, and another peer
/// continues from the vault's checkpoint, which lags (it is written at most once a second).
/// The owner died with writes 3 and 4 sent to peer P but not yet to peer Q (so neither had
/// completed). P goes no further than Q holds: had it replayed 3 and 4, Q, replaying 1 and 2
/// after it, would leave block 16 of write 4 beside block 0 of write 1, a state no prefix of
/// the writes produces.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_goes_no_further_than_the_peer_that_would_continue_it() {
    let id = Uuid::new_v4();
    let gen = 5;
    let store = Arc::new(MemDevice::new(VOL));
    let p = CacheHost::open(Arc::new(SimDevice::new((1 << 20) + 64 * SEG)), SEG).unwrap();
    let q = CacheHost::open(Arc::new(SimDevice::new((1 << 20) + 64 * SEG)), SEG).unwrap();
    p.replica_open("owner", id, gen, 0).unwrap();
    q.replica_open("owner", id, gen, 0).unwrap();
    // (ser, sector, byte): write 3 rewrites write 1's block.
    let writes = [(1u64, 0u64, 1u8), (2, 8, 2), (3, 0, 3), (4, 16, 4)];
    for (ser, sector, b) in writes {
        let data = vec![b; 4096];
        p.replica_write(id, gen, ser, sector * 512, 4096, Some(&data), false)
            .unwrap();
        if ser <= 2 {
            q.replica_write(id, gen, ser, sector * 512, 4096, Some(&data), false)
                .unwrap();
        }
    }
    // What the daemon asks before P replays: how far each holds above the vault's checkpoint.
    assert_eq!(p.replica_seal(id, 0).unwrap(), Some((gen, 4)));
    // Sealed: P takes no more of the owner's writes (so none can complete), nor a new
    // generation from it.
    {
        let data = vec![5u8; 4096];
        assert!(matches!(
            p.replica_write(id, gen, 5, 0, 4096, Some(&data), false),
            Err(ReplicaRefusal::Stale(_))
        ));
        assert!(matches!(
            p.replica_open("owner", id, gen + 1, 4),
            Err(ReplicaRefusal::Stale(_))
        ));
        assert_eq!(
            p.replica_seal(id, 0).unwrap(),
            Some((gen, 4)),
            "nothing was taken"
        );
    }
    // As the peer service answers a replaying host's `held`: held first, then measured.
    q.replica_hold(id, gen);
    let q_held = q.replica_held(id, gen, 0).unwrap();
    assert_eq!(q_held, 2);
    // The owner's checkpoint of writes 1 and 2, still on its way to Q when it answered,
    // arrives now: had Q taken it, it would continue P's replay from 2 and skip write 1,
    // which P's replay may have set back over newer data by then.
    q.replica_checkpoint(id, gen, 2).unwrap();
    assert_eq!(
        q.replica_sets()[0].checkpoint,
        0,
        "a checkpoint after Q said how far it holds moved it on"
    );
    // So does the same generation opened again with it (an owner that reconnects): a held set
    // takes nothing from an open either.
    q.replica_open("owner", id, gen, 2).unwrap();
    assert_eq!(
        q.replica_sets()[0].checkpoint,
        0,
        "an open after Q said how far it holds moved it on"
    );
    // A new generation opened on Q is not held: its checkpoints release its writes.
    let other = Uuid::new_v4();
    q.replica_open("owner", other, 1, 0).unwrap();
    q.replica_hold(other, 1);
    q.replica_open("owner", other, 2, 0).unwrap();
    q.replica_write(other, 2, 1, 0, 4096, Some(&[9u8; 4096]), false)
        .unwrap();
    q.replica_checkpoint(other, 2, 1).unwrap();
    let set = replica_set(&q, other);
    assert_eq!((set.checkpoint, set.writes), (1, 0), "{set:?}");
    assert!(
        matches!(
            q.replica_held(id, gen + 1, 0),
            Err(ReplicaRefusal::Failed(_))
        ),
        "another generation: Q holds none of it, but holds the volume"
    );
    assert_eq!(p.promote_replicas(id, 0, 4.min(q_held)).unwrap(), 2);
    // Promoted, P holds no replicas, but it holds the volume's data: asked, it must not say
    // it holds nothing (an owner would conclude that nobody can replay).
    assert!(
        matches!(p.replica_held(id, gen, 0), Err(ReplicaRefusal::Failed(_))),
        "a host that promoted its replicas still holds the volume"
    );
    let fresh = CacheHost::open(Arc::new(SimDevice::new((1 << 20) + 16 * SEG)), SEG).unwrap();
    assert!(
        matches!(
            fresh.replica_held(id, gen, 0),
            Err(ReplicaRefusal::Absent(_))
        ),
        "a host on an empty cache device holds nothing of the volume"
    );
    replay_all(&p, id, &store).await;
    // P dies; Q continues from the vault's checkpoint (still 0).
    drop(p);
    assert_eq!(q.promote_replicas(id, 0, u64::MAX).unwrap(), 2);
    replay_all(&q, id, &store).await;
    let img = store.image();
    let mut want = vec![0u8; VOL as usize];
    want[..4096].fill(1);
    want[8 * 512..8 * 512 + 4096].fill(2);
    assert!(
        img == want,
        "the datastore must be the volume as of writes 1 and 2"
    );
}

/// An owner whose lease lapsed may still reach its peers and its clients. P (wbp:2 with Q)
/// seals the volume's replicas to replay them, holding writes 1 to 3; Q has taken 1 and 2,
/// and write 3 is still on its way to it. P asks Q how far it holds: 2, so P replays up to 2.
/// Write 3 then reaches Q. Had Q taken it, the owner would have both acknowledgements and
/// complete write 3 (and a FLUSH after it), which no replay puts on the datastore: P stops at
/// 2, and Q, continuing after P, would stop where it answered too. Q refuses it, which breaks
/// the owner's link to it: the write does not complete. Other volumes, and a later
/// generation of this one, are not held.
#[test]
fn a_peer_takes_no_write_of_a_generation_once_it_said_how_far_it_holds_it() {
    let id = Uuid::new_v4();
    let gen = 2;
    let p = CacheHost::open(Arc::new(SimDevice::new((1 << 20) + 16 * SEG)), SEG).unwrap();
    let q = CacheHost::open(Arc::new(SimDevice::new((1 << 20) + 16 * SEG)), SEG).unwrap();
    let other = Uuid::new_v4();
    for host in [&p, &q] {
        host.replica_open("owner", id, gen, 0).unwrap();
        host.replica_open("owner", other, gen, 0).unwrap();
    }
    let data = |ser: u64| vec![ser as u8; 4096];
    for ser in 1..=3u64 {
        p.replica_write(id, gen, ser, ser * 4096, 4096, Some(&data(ser)), false)
            .unwrap();
        if ser <= 2 {
            q.replica_write(id, gen, ser, ser * 4096, 4096, Some(&data(ser)), false)
                .unwrap();
        }
    }
    assert_eq!(p.replica_seal(id, 0).unwrap(), Some((gen, 3)));
    // As the peer service answers `held`.
    q.replica_hold(id, gen);
    let q_held = q.replica_held(id, gen, 0).unwrap();
    assert_eq!(q_held, 2);
    for write in [
        q.replica_write(id, gen, 3, 3 * 4096, 4096, Some(&data(3)), false),
        q.replica_write_at_once(id, gen, 3, 3 * 4096, 4096, Some(&data(3)), false)
            .map(|_| ()),
        q.replica_write(id, gen, 3, 3 * 4096, 4096, None, true),
    ] {
        assert!(
            matches!(&write, Err(ReplicaRefusal::Failed(m)) if m.contains("how far it holds")),
            "Q took write 3 after it said it holds up to {q_held}: {write:?}"
        );
    }
    assert_eq!(q.replica_held(id, gen, 0).unwrap(), 2, "nothing was taken");
    let set = replica_set(&q, id);
    assert_eq!((set.writes, set.last_ser), (2, 2), "{set:?}");
    // Another volume's writes go on.
    q.replica_write(other, gen, 1, 0, 4096, Some(&data(1)), false)
        .unwrap();
    // The owner, its lease back, goes on with other peers in a new generation; opened on Q,
    // that generation takes writes again.
    q.replica_open("owner", id, gen + 1, 2).unwrap();
    q.replica_write(id, gen + 1, 3, 3 * 4096, 4096, Some(&data(3)), false)
        .unwrap();
}

/// FVP Table 1's cascade, the replaying peer's part: P replays all four writes (its windows
/// in batches would be writes 1–2, then 3–4: write 3 rewrites write 1's block) and dies
/// before the vault's checkpoint (written at most once a second) moves. Q continues from the
/// vault's checkpoint and does not know how far P went: its replay must reach everything it
/// holds before it records a checkpoint. Before, Q's first batch window put write 1 back
/// over write 3 and recorded checkpoint 2 beside write 4's block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_continues_a_dead_peers_replay_reaches_all_it_holds_before_a_checkpoint() {
    let id = Uuid::new_v4();
    let gen = 5;
    let store = Arc::new(MemDevice::new(VOL));
    let p = CacheHost::open(Arc::new(SimDevice::new((1 << 20) + 64 * SEG)), SEG).unwrap();
    let q = CacheHost::open(Arc::new(SimDevice::new((1 << 20) + 64 * SEG)), SEG).unwrap();
    let writes = [(1u64, 0u64, 1u8), (2, 8, 2), (3, 0, 3), (4, 16, 4)];
    let mut done: Vec<W> = Vec::new();
    for host in [&p, &q] {
        host.replica_open("owner", id, gen, 0).unwrap();
    }
    for (ser, sector, b) in writes {
        let data = vec![b; 4096];
        for host in [&p, &q] {
            host.replica_write(id, gen, ser, sector * 512, 4096, Some(&data), false)
                .unwrap();
        }
        done.push((sector * 512, data));
    }
    assert_eq!(p.replica_seal(id, 0).unwrap(), Some((gen, 4)));
    q.replica_hold(id, gen);
    assert_eq!(q.replica_held(id, gen, 0).unwrap(), 4);
    assert_eq!(p.promote_replicas(id, 0, 4).unwrap(), 4);
    replay_all(&p, id, &store).await;
    assert_eq!(store.image(), image(&done, 4));
    // P dies; the vault still says 0.
    drop(p);
    assert_eq!(q.replica_seal(id, 0).unwrap(), Some((gen, 4)));
    assert_eq!(q.promote_replicas(id, 0, 4).unwrap(), 4);
    replay_checking(&q, id, &store, &done).await;
}

/// The owner's checkpoint is being appended on a peer (its device write under way) when a
/// replaying host has the peer hold the set. The hold waits for it: once held, the log takes
/// no checkpoint the set does not know, so the peer restarted says the same checkpoint as it
/// did before. Before, the append went on after the hold and landed in the log only, and a
/// restart took the set's checkpoint from there, past where the peer had said it would
/// continue from.
#[test]
fn a_checkpoint_under_way_when_a_set_is_held_is_in_the_set_and_the_log_or_in_neither() {
    let id = Uuid::new_v4();
    let gen = 3;
    let dev = Arc::new(SimDevice::new((1 << 20) + 64 * SEG));
    let peer = CacheHost::open(dev.clone(), SEG).unwrap();
    peer.replica_open("owner", id, gen, 0).unwrap();
    for ser in 1..=4u64 {
        let data = vec![ser as u8; 4096];
        peer.replica_write(id, gen, ser, ser * 4096, 4096, Some(&data), false)
            .unwrap();
    }
    peer.replica_sync().unwrap();
    dev.pause_writes(true);
    let checkpoint = {
        let p = peer.clone();
        std::thread::spawn(move || p.replica_checkpoint(id, gen, 3))
    };
    while dev.writes_waiting() == 0 {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let hold = {
        let p = peer.clone();
        std::thread::spawn(move || p.replica_hold(id, gen))
    };
    std::thread::sleep(std::time::Duration::from_millis(100));
    dev.pause_writes(false);
    checkpoint.join().unwrap().unwrap();
    hold.join().unwrap();
    let said = peer.replica_sets()[0].checkpoint;
    // Held: later checkpoints change nothing.
    peer.replica_checkpoint(id, gen, 4).unwrap();
    assert_eq!(peer.replica_sets()[0].checkpoint, said);
    peer.replica_sync().unwrap();
    drop(peer);
    let back = CacheHost::open(dev, SEG).unwrap();
    assert_eq!(
        back.replica_sets()[0].checkpoint,
        said,
        "the log holds a checkpoint the held set did not know"
    );
}

/// The owner sends a held window (writes 1 to 4, write 3 over write 1's block) whole to the
/// datastore and dies before its checkpoint. Its peer replays in batches, whose first window
/// would close before write 3 (the overlap): it must reach the end of the owner's window
/// first, which the owner sent it (durably) before the window went. Checkpoint 2 over a
/// datastore holding write 4 is a state no prefix gives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peers_replay_reaches_the_end_of_the_window_its_owner_died_in() {
    let id = Uuid::new_v4();
    let store = Arc::new(MemDevice::new(VOL));
    let (dev, owner, peer, vol) = owner_in_wbp_1(id, &store).await;
    vol.set_tuning(Tuning {
        hold_s: Some(1e-9),
        ..Tuning::default()
    });
    let gen = vol.cache().unwrap().gen();
    let writes = [(0u64, 1u8), (8, 2), (0, 3), (16, 4)];
    let mut done: Vec<W> = Vec::new();
    for (sector, b) in writes {
        let data = vec![b; 4096];
        vol.write(sector * 512, Bytes::from(data.clone()), false)
            .await
            .unwrap();
        done.push((sector * 512, data));
    }
    // The owner dies once its window is on the datastore, before its checkpoint.
    let d = dev.clone();
    store.after_next_flush(move || d.fail());
    owner.destage_turn(0).await;
    assert_eq!(
        store.image(),
        image(&done, 4),
        "the held window went out whole"
    );
    assert_eq!(vol.cache().unwrap().checkpoint(), 0);
    drop(vol);

    let (g, upto) = peer.replica_seal(id, 0).unwrap().expect("replicas");
    assert_eq!((g, upto), (gen, 4));
    assert_eq!(peer.promote_replicas(id, 0, upto).unwrap(), 4);
    replay_checking(&peer, id, &store, &done).await;
}

/// A `wbp` owner's checkpoint reaches its peer only once the owner's log holds it durably.
/// Before, it was forwarded as soon as it was appended: an owner back from a power cut then
/// found an older checkpoint than its peer held, replayed from it (setting blocks back), and
/// had it died midway, the peer, continuing from its newer checkpoint without the writes
/// below it, would never have put those blocks forward again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wbp_owner_tells_its_peers_only_a_checkpoint_its_log_holds_durably() {
    let id = Uuid::new_v4();
    let store = Arc::new(MemDevice::new(VOL));
    let (dev, owner, peer, vol) = owner_in_wbp_1(id, &store).await;
    for (sector, b) in [(0u64, 1u8), (8, 2), (16, 3)] {
        vol.write(sector * 512, Bytes::from(vec![b; 4096]), false)
            .await
            .unwrap();
    }
    for turn in 0..100 {
        if vol.cache().unwrap().clean() {
            break;
        }
        owner.destage_turn(turn).await;
    }
    let told = replica_set(&peer, id).checkpoint;
    assert_eq!(told, 3, "the peer was told the window's checkpoint");
    // The owner's power fails now: what its log holds durably.
    let back = CacheHost::open(Arc::new(dev.crash_copy()), SEG).unwrap();
    let v = Volume::open(
        id,
        "v".into(),
        Policy::Wb,
        Tuning::default(),
        Extent::new(store.clone(), 0, VOL, Arc::new(Gate::new(8))),
        Some(back.clone()),
    )
    .unwrap();
    let own = v.cache().unwrap().checkpoint();
    assert!(
        own >= told,
        "the owner's log holds checkpoint {own}, older than the {told} its peer was told"
    );
}

/// A peer replaying for a dead owner sends a held window (writes 1 to 4, write 3 over write
/// 1's block) whole to the datastore, and loses power before its checkpoint. Back, it resumes
/// the replay in batches, whose first window would close before write 3 (the overlap). It
/// must reach the end of the window it had recorded first: checkpoint 2 over a datastore
/// holding write 4 is a state no prefix gives. Before, the recovered replicas dropped that
/// end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peers_resumed_replay_reaches_the_end_of_the_window_it_had_sent() {
    let id = Uuid::new_v4();
    let gen = 2;
    let store = Arc::new(MemDevice::new(VOL));
    let dev = Arc::new(SimDevice::new((1 << 20) + 64 * SEG));
    let p = CacheHost::open(dev.clone(), SEG).unwrap();
    p.replica_open("owner", id, gen, 0).unwrap();
    let writes = [(1u64, 0u64, 1u8), (2, 8, 2), (3, 0, 3), (4, 16, 4)];
    let mut done: Vec<W> = Vec::new();
    for (ser, sector, b) in writes {
        let data = vec![b; 4096];
        p.replica_write(id, gen, ser, sector * 512, 4096, Some(&data), false)
            .unwrap();
        done.push((sector * 512, data));
    }
    assert_eq!(p.replica_seal(id, 0).unwrap(), Some((gen, 4)));
    assert_eq!(p.promote_replicas(id, 0, 4).unwrap(), 4);
    let open = |host: &Arc<CacheHost>, hold_s| {
        let extent = Extent::new(store.clone(), 0, VOL, Arc::new(Gate::new(8)));
        let tuning = Tuning {
            hold_s,
            ..Tuning::default()
        };
        Volume::open(
            id,
            "v".into(),
            Policy::Wb,
            tuning,
            extent,
            Some(host.clone()),
        )
        .unwrap()
    };
    {
        let v = open(&p, Some(1e-9));
        let d = dev.clone();
        store.after_next_flush(move || {
            d.power_loss(|_, _| Fate::Lost);
            d.fail();
        });
        p.destage_turn(0).await;
        assert_eq!(
            store.image(),
            image(&done, 4),
            "the held window went out whole"
        );
        drop(v);
    }
    drop(p);
    dev.power_loss(|_, _| Fate::Lost);
    let back = CacheHost::open(dev.clone(), SEG).unwrap();
    let (_, upto) = back
        .replica_seal(id, 0)
        .unwrap()
        .expect("replicas found again");
    assert_eq!(back.promote_replicas(id, 0, upto).unwrap(), 4);
    replay_checking(&back, id, &store, &done).await;
}

/// A peer replaying for a dead owner loses power after its replay put the owner's writes on
/// the datastore, before anything of that replay was synced, and replays again from the
/// same checkpoint (the vault's) once back. Its second replay may only put back what its
/// first one did: had the writes counted at the seal not been durable, it would replay the
/// part a FLUSH had synced (writes 1 and 2) over the datastore the first one left, and
/// block 0 would go back to write 1 beside write 4's block 16.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_loses_power_after_its_replay_replays_again_to_a_prefix() {
    let id = Uuid::new_v4();
    let gen = 5;
    let store = Arc::new(MemDevice::new(VOL));
    let dev = Arc::new(SimDevice::new((1 << 20) + 64 * SEG));
    let p = CacheHost::open(dev.clone(), SEG).unwrap();
    p.replica_open("owner", id, gen, 0).unwrap();
    // (ser, sector, byte): write 3 rewrites write 1's block; a FLUSH after write 2.
    let writes = [(1u64, 0u64, 1u8), (2, 8, 2), (3, 0, 3), (4, 16, 4)];
    let mut done: Vec<W> = Vec::new();
    for (ser, sector, b) in writes {
        let data = vec![b; 4096];
        p.replica_write(id, gen, ser, sector * 512, 4096, Some(&data), false)
            .unwrap();
        done.push((sector * 512, data));
        if ser == 2 {
            p.replica_sync().unwrap();
        }
    }
    assert_eq!(p.replica_seal(id, 0).unwrap(), Some((gen, 4)));
    assert_eq!(p.promote_replicas(id, 0, 4).unwrap(), 4);
    // The power cut comes once the replay's first window is on the datastore, before the
    // replay syncs anything more of its own: the log keeps what was durable here.
    let cut = dev.crash_copy();
    replay_all(&p, id, &store).await;
    assert_eq!(store.image(), image(&done, 4));
    // Back, it finds its replicas again; the vault's checkpoint is still 0, and the replay
    // starts over from there, as the daemon's does.
    let back = Arc::new(CacheHost::open(Arc::new(cut), SEG).unwrap());
    if let Some((_, upto)) = back.replica_seal(id, 0).unwrap() {
        back.promote_replicas(id, 0, upto).unwrap();
        replay_all(&back, id, &store).await;
    }
    let now = store.image();
    assert!(
        (0..=done.len()).any(|k| now == image(&done, k)),
        "the datastore is no prefix of the writes after the second replay"
    );
    assert_eq!(now, image(&done, 4), "a completed write was lost");
}

/// What a peer says it holds (`replica_held`, asked by a host about to replay) is durable
/// when it says it: the owner's writes keep arriving while the peer is asked, and a power
/// cut right after each answer keeps at least as much. Synced before it counted, the peer
/// could count a write appended in between, which a power cut then took: a replay that went
/// that far could not be continued from this peer.
#[test]
fn what_a_peer_says_it_holds_survives_a_power_cut_right_after() {
    // The window is a few instructions wide: many short rounds find it.
    for _ in 0..20 {
        asked_while_writes_arrive();
    }
}

/// One round: a writer sends writes for as long as the peer is being asked (8 times), each
/// answer checked against a power cut right after it.
fn asked_while_writes_arrive() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let dev = Arc::new(SimDevice::new((1 << 20) + 512 * SEG));
    let peer = Arc::new(CacheHost::open(dev.clone(), SEG).unwrap());
    let id = Uuid::new_v4();
    peer.replica_open("a", id, 1, 0).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (peer, stop) = (peer.clone(), stop.clone());
        std::thread::spawn(move || {
            // At most what the log holds without waiting for room (1 KiB a write).
            for ser in 1..=20_000u64 {
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                let data = [ser as u8; 512];
                let at = (ser % SECTORS) * 512;
                peer.replica_write(id, 1, ser, at, 512, Some(&data), false)
                    .unwrap();
            }
        })
    };
    for _ in 0..8 {
        let said = peer.replica_held(id, 1, 0).unwrap();
        let after = CacheHost::open(Arc::new(dev.crash_copy()), SEG).unwrap();
        let kept = after.replica_held(id, 1, 0).unwrap_or(0);
        assert!(
            kept >= said,
            "the peer said it held up to write {said}; after a power cut it held {kept}"
        );
    }
    stop.store(true, Ordering::SeqCst);
    writer.join().unwrap();
}

/// A peer promotes a dead owner's replicas for its replay from the vault's checkpoint (8),
/// ahead of the last checkpoint its log records (0): the replicas up to 8 are released, and
/// their segments may be reused after the next sync. The power fails before the replay's
/// volume records anything. The log must still say where the kept replicas start: before,
/// nothing recorded checkpoint 8 before the release, another owner's replicas reused the
/// freed segments, and the scan found checkpoint 0 with the writes above it gone, so it kept
/// none of the durable writes 9 to 12, which only this peer held.
#[test]
fn a_promotion_records_its_checkpoint_before_it_frees_the_replicas_below_it() {
    let id = Uuid::new_v4();
    let gen = 3;
    let dev = Arc::new(SimDevice::new((1 << 20) + 64 * SEG));
    let peer = CacheHost::open(dev.clone(), SEG).unwrap();
    peer.replica_open("owner", id, gen, 0).unwrap();
    // 16 KiB each: three or four to a 64 KiB segment, so writes 1 to 8 fill two segments.
    for ser in 1..=12u64 {
        let data = vec![ser as u8; 16384];
        peer.replica_write(id, gen, ser, ser * 16384, 16384, Some(&data), false)
            .unwrap();
    }
    peer.replica_sync().unwrap(); // the owner's FLUSH: every write durable on the peer
    assert_eq!(peer.promote_replicas(id, 8, u64::MAX).unwrap(), 4);
    // Another owner's replicas fill the current segment and go on into the freed ones (the
    // newest first), once a sync made them reusable. Their writes reach the device; then the
    // power fails.
    let other = Uuid::new_v4();
    peer.replica_open("owner", other, 1, 0).unwrap();
    for ser in 1..=10u64 {
        let data = vec![0xee; 16384];
        peer.replica_write(other, 1, ser, ser * 16384, 16384, Some(&data), false)
            .unwrap();
        if ser == 1 {
            // That owner's FLUSH: the sync that makes the freed segments reusable.
            peer.replica_sync().unwrap();
        }
    }
    drop(peer);
    dev.power_loss(|_, _| Fate::Kept);
    let back = CacheHost::open(dev.clone(), SEG).unwrap();
    let set = replica_set(&back, id);
    assert_eq!(
        (set.checkpoint, set.last_ser, set.writes),
        (8, 12, 4),
        "durable replicas above the promotion's checkpoint were lost: {set:?}"
    );
    assert_eq!(back.promote_replicas(id, 8, u64::MAX).unwrap(), 4);
}
