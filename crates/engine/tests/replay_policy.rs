//! A volume that is not `wb` but finds dirty data of its own in the cache log at start-up (a
//! `wbp` owner back from a crash before a peer replayed it, a change away from `wb` that a
//! crash interrupted) replays in `wb`, and then takes its writes in `wt`, never in `wb`: a
//! write completed in `wb` would sit only on this host's flash, which `wt` and `wbp` promise
//! it never does.

use std::sync::Arc;

use bytes::Bytes;
use cachelog::device::{CacheDevice, Fate, SimDevice};
use cluster::{PeerRule, Policy, Tuning};
use datastore::device::MemDevice;
use datastore::{Extent, Gate};
use engine::cache::CacheHost;
use engine::Volume;
use uuid::Uuid;

mod common;
use common::{BLOCK, SEG, VOL};

/// Volume `id` in `wb` writes block 0 (0x11, FUA: synced, never destaged); then the host
/// loses power.
async fn dirty_then_crash(cache: &Arc<SimDevice>, store: &Arc<MemDevice>, id: Uuid) {
    {
        let (_host, vol) = common::open(cache.clone(), store, id, Policy::Wb);
        vol.write(0, Bytes::from(vec![0x11; BLOCK]), true)
            .await
            .unwrap();
    }
    cache.power_loss(|_, _| Fate::Kept);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_ends_in_wt_for_a_volume_that_is_not_wb() {
    let wbp = Policy::Wbp {
        peers: 1,
        rule: PeerRule::default(),
    };
    for policy in [Policy::Wt, wbp, Policy::Uncached] {
        let cache = Arc::new(SimDevice::new((1 << 20) + 16 * SEG));
        let store = Arc::new(MemDevice::new(VOL));
        let id = Uuid::new_v4();
        dirty_then_crash(&cache, &store, id).await;

        let (host, vol) = common::open(cache.clone(), &store, id, policy);
        let c = vol.cache().expect("cached while it replays");
        assert_eq!(c.report().mode, "wb", "{policy}: replays in wb");
        assert_eq!(vol.policy(), Policy::Wt, "{policy}: goes on in wt");
        // A write waits for the replay, which the destager finishes.
        let write = {
            let v = Arc::new(vol);
            let w = v.clone();
            (
                v,
                tokio::spawn(async move {
                    w.write(BLOCK as u64, Bytes::from(vec![0x22; BLOCK]), false)
                        .await
                }),
            )
        };
        let (vol, w) = write;
        for turn in 0..1000 {
            if w.is_finished() {
                break;
            }
            host.destage_turn(turn).await;
            tokio::task::yield_now().await;
        }
        w.await.unwrap().unwrap();
        assert_eq!(c.report().mode, "wt", "{policy}: in wt after the replay");
        // Written through: on the datastore as it completed, with the replayed write.
        let img = store.image();
        assert_eq!(img[..BLOCK], [0x11; BLOCK], "{policy}: the replay");
        assert_eq!(
            img[BLOCK..2 * BLOCK],
            [0x22; BLOCK],
            "{policy}: a write after the replay completed in wb"
        );
        // Its owner then changes the policy as usual: an uncached volume leaves the cache.
        if policy == Policy::Uncached {
            vol.set_policy(Policy::Uncached).await.unwrap();
            assert!(vol.cache().is_none());
        }
    }
}

/// The switch to `wt` that ends a `wt` volume's replay finds the log with no room (filled
/// once the replay's write was on the datastore): writes wait on, the volume stays in the
/// replay, and the destager tries again until the switch goes in. Before, the replay ended
/// all the same and the volume took writes in `wb`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_whose_closing_switch_finds_no_room_keeps_writes_waiting_until_it_goes_in() {
    let cache = Arc::new(SimDevice::new((1 << 20) + 16 * SEG));
    let store = Arc::new(MemDevice::new(VOL));
    let id = Uuid::new_v4();
    dirty_then_crash(&cache, &store, id).await;
    let (host, vol) = common::open(cache.clone(), &store, id, Policy::Wt);
    let vol = Arc::new(vol);
    let c = vol.cache().expect("cached while it replays");
    for turn in 0..100 {
        if store.image()[..BLOCK] == [0x11; BLOCK] {
            break;
        }
        host.destage_turn(turn).await;
    }
    assert_eq!(store.image()[..BLOCK], [0x11; BLOCK], "the replay's write");
    let mut pins = Vec::new();
    common::fill_log(host.log(), id, &mut pins);
    let w = {
        let v = vol.clone();
        tokio::spawn(async move {
            v.write(BLOCK as u64, Bytes::from(vec![0x22; BLOCK]), false)
                .await
        })
    };
    for turn in 0..20 {
        host.destage_turn(turn).await;
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert!(
        !w.is_finished(),
        "a write completed before the switch to wt"
    );
    assert!(c.report().replaying);
    assert_eq!(c.report().mode, "wb");
    // Room again once the segments are unpinned; the destager makes them reusable itself
    // (they wait for a sync, which no one else makes here), and the switch goes in at the
    // next try, a second on; then the write.
    for loc in pins.drain(..) {
        host.log().unpin(&loc);
    }
    for turn in 0..400 {
        if w.is_finished() {
            break;
        }
        host.destage_turn(turn).await;
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    tokio::time::timeout(std::time::Duration::from_secs(5), w)
        .await
        .expect("the replay never ended: the switch found no room again and again")
        .unwrap()
        .unwrap();
    assert_eq!(c.report().mode, "wt");
    assert_eq!(
        store.image()[BLOCK..2 * BLOCK],
        [0x22; BLOCK],
        "written through, in wt"
    );
}

/// A volume detached with dirty data (an online replay that gave up, a forced delete) leaves
/// its records on the device: they are only forgotten, never erased, so the next start
/// replays them. A clean volume's are erased.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn detaching_keeps_dirty_records_for_the_next_start_and_erases_clean_ones() {
    for dirty in [true, false] {
        let cache = Arc::new(SimDevice::new((1 << 20) + 16 * SEG));
        let store = Arc::new(MemDevice::new(VOL));
        let id = Uuid::new_v4();
        {
            let (host, vol) = common::open(cache.clone(), &store, id, Policy::Wb);
            vol.write(0, Bytes::from(vec![0x33; BLOCK]), true)
                .await
                .unwrap();
            if !dirty {
                common::destage_all(&host, &vol.cache().unwrap()).await;
            }
            vol.detach_cache().await;
        }
        cache.power_loss(|_, _| Fate::Kept);
        // What the scan found of it: nothing at all once erased.
        let found = CacheHost::open(cache.clone(), SEG)
            .unwrap()
            .recovered_volumes()
            .iter()
            .any(|(v, _, _)| *v == id);
        assert_eq!(
            found, dirty,
            "dirty {dirty}: records of the volume in the log"
        );
        let (_host, vol) = common::open(cache.clone(), &store, id, Policy::Wb);
        let replays = vol.cache().unwrap().report().replaying;
        assert_eq!(replays, dirty, "dirty {dirty}: replay at the next start");
    }
}

/// Detaching twice (a delete racing a policy change) leaves the host's count of cached
/// volumes right, so the fair shares of the others stay fair.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn detaching_twice_leaves_the_other_volumes_shares_alone() {
    let cache = Arc::new(SimDevice::new((1 << 20) + 16 * SEG));
    let host = CacheHost::open(cache.clone(), SEG).unwrap();
    let vol = |name: &str| {
        let store = Arc::new(MemDevice::new(VOL));
        let extent = Extent::new(store, 0, VOL, Arc::new(Gate::new(4)));
        Volume::open(
            Uuid::new_v4(),
            name.into(),
            Policy::Wb,
            Tuning::default(),
            extent,
            Some(host.clone()),
        )
        .unwrap()
    };
    let (a, b) = (vol("a"), vol("b"));
    host.finish_recovery(&[]).unwrap();
    let shared = b.cache().unwrap().report().share_bytes;
    let c = a.cache().unwrap();
    host.detach(&c).await.unwrap();
    host.detach(&c).await.unwrap();
    // Two volumes again: the same shares as before.
    let _c = vol("c");
    let now = b.cache().unwrap().report().share_bytes;
    assert_eq!(
        now, shared,
        "with b and c cached, b's share must be what it was with a and b"
    );
}

/// A switch whose first record cannot go into the log changes nothing: the volume goes on
/// in its old mode and generation. It used to take the new ones first and keep them when the
/// log refused the records, so a `wt` volume went on in `wb` with no record of the new
/// generation: after a crash, a recovery would not have found the writes it completed since.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_switch_the_log_refuses_changes_nothing() {
    let cache = Arc::new(SimDevice::new((1 << 20) + 16 * SEG));
    let store = Arc::new(MemDevice::new(VOL));
    let (_host, vol) = common::open(cache.clone(), &store, Uuid::new_v4(), Policy::Wt);
    vol.write(0, Bytes::from(vec![0x41; BLOCK]), false)
        .await
        .unwrap();
    let before = vol.cache_report().unwrap();
    cache.fail();
    vol.set_policy(Policy::Wb).await.unwrap_err();
    let after = vol.cache_report().unwrap();
    assert_eq!((after.mode.as_str(), after.gen), ("wt", before.gen));
    assert_ne!(vol.policy(), Policy::Wb);
}

/// Dirty data of a volume that never opened (its datastore down) is kept for it; once the
/// volume is deleted, dropping it releases its segments at once and erases its records, so
/// that no later start finds them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_volume_that_never_opened_leaves_nothing_in_the_log() {
    let cache = Arc::new(SimDevice::new((1 << 20) + 16 * SEG));
    let store = Arc::new(MemDevice::new(VOL));
    let id = Uuid::new_v4();
    dirty_then_crash(&cache, &store, id).await;

    let host = CacheHost::open(cache.clone(), SEG).unwrap();
    host.finish_recovery(&[id]).unwrap();
    assert!(
        host.log().segments_of(id) > 0,
        "the dirty data was not kept"
    );
    host.drop_recovered(id).await.unwrap();
    assert_eq!(
        host.log().segments_of(id),
        0,
        "the deleted volume's segments are still held"
    );
    drop(host);
    let host = CacheHost::open(cache.clone(), SEG).unwrap();
    assert!(
        host.recovered_volumes().iter().all(|(v, _, _)| *v != id),
        "a later start found the deleted volume's records"
    );
}

/// Forwards to a simulated device; its syncs fail while `fail_syncs` is set.
struct SyncsFail {
    sim: Arc<SimDevice>,
    fail_syncs: std::sync::atomic::AtomicBool,
}

impl CacheDevice for SyncsFail {
    fn size(&self) -> u64 {
        self.sim.size()
    }
    fn describe(&self) -> String {
        "device whose syncs fail".into()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        self.sim.read_at(offset, buf)
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.sim.write_at(offset, data)
    }
    fn sync(&self) -> std::io::Result<()> {
        if self.fail_syncs.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(std::io::Error::other("test: the sync fails"));
        }
        self.sim.sync()
    }
}

/// A `wt` volume replays its dirty `wb` records at start-up, then switches to `wt`; that
/// switch's sync fails. Its checkpoint (and the replay's last) never reached the device, so a
/// later start that finds the device readable again replays the same records. Writes taken
/// in `wt` meanwhile went straight to the datastore and would be undone: they must stall
/// (as a clean `wb` volume's on a failed device do, until the daemon records a newer
/// generation and serves the volume uncached). Found by review: before, the write completed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_whose_closing_sync_fails_takes_no_write_in_wt() {
    use std::sync::atomic::Ordering::SeqCst;
    let sim = Arc::new(SimDevice::new((1 << 20) + 16 * SEG));
    let store = Arc::new(MemDevice::new(VOL));
    let id = Uuid::new_v4();
    {
        let (_host, vol) = common::open(sim.clone(), &store, id, Policy::Wb);
        vol.write(0, Bytes::from(vec![0x11; BLOCK]), true)
            .await
            .unwrap();
    }
    sim.power_loss(|_, _| Fate::Kept);

    let dev = Arc::new(SyncsFail {
        sim: sim.clone(),
        fail_syncs: Default::default(),
    });
    let (host, vol) = common::open(dev.clone(), &store, id, Policy::Wt);
    let c = vol.cache().unwrap();
    assert!(c.report().replaying);
    for turn in 0..100 {
        if c.report().dirty_bytes == 0 {
            break;
        }
        host.destage_turn(turn).await;
    }
    assert!(c.report().replaying && c.report().dirty_bytes == 0);
    dev.fail_syncs.store(true, SeqCst);
    host.destage_turn(0).await;
    assert!(
        c.cache_failed(),
        "the closing switch's sync did not fail the log"
    );
    assert!(
        vol.stalled(),
        "writes after the failed closing switch do not stall"
    );
    let write = vol.write(0, Bytes::from(vec![0x22; BLOCK]), true);
    assert!(
        tokio::time::timeout(std::time::Duration::from_millis(500), write)
            .await
            .is_err(),
        "a write completed in wt over records a later start would replay"
    );
    assert_eq!(&store.image()[..BLOCK], &[0x11; BLOCK][..]);
}
