//! A volume that is not `wb` but finds dirty data of its own in the cache log at start-up (a
//! `wbp` owner back from a crash before a peer replayed it, a change away from `wb` that a
//! crash interrupted) replays in `wb`, and then takes its writes in `wt`, never in `wb`: a
//! write completed in `wb` would sit only on this host's flash, which `wt` and `wbp` promise
//! it never does.

use std::sync::Arc;

use bytes::Bytes;
use cachelog::device::{Fate, SimDevice};
use cluster::{PeerRule, Policy, Tuning};
use datastore::device::MemDevice;
use datastore::{Extent, Gate};
use engine::cache::CacheHost;
use engine::Volume;
use uuid::Uuid;

const SEG: u64 = 64 << 10;
const VOL: u64 = 1 << 20;
const BLOCK: usize = 4096;

fn open(
    cache: &Arc<SimDevice>,
    store: &Arc<MemDevice>,
    id: Uuid,
    policy: Policy,
) -> (Arc<CacheHost>, Volume) {
    let host = CacheHost::open(cache.clone(), SEG).unwrap();
    let extent = Extent::new(store.clone(), 0, VOL, Arc::new(Gate::new(4)));
    let vol = Volume::open(
        id,
        "r".into(),
        policy,
        Tuning::default(),
        extent,
        Some(host.clone()),
    )
    .unwrap();
    host.finish_recovery(&[id]).unwrap();
    (host, vol)
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
        // Dirty data in the log, synced, never destaged; then the daemon dies.
        {
            let (_host, vol) = open(&cache, &store, id, Policy::Wb);
            vol.write(0, Bytes::from(vec![0x11; BLOCK]), true)
                .await
                .unwrap();
        }
        cache.power_loss(|_, _| Fate::Kept);

        let (host, vol) = open(&cache, &store, id, policy);
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
