//! FUA on a zeroing or a trim reaches the datastore's stable media in the policies that
//! complete writes on the datastore (`uncached`, `wt`): the datastore has no FUA for them, so
//! the engine flushes it before the request completes.

use std::sync::Arc;

use cachelog::device::SimDevice;
use cluster::{Policy, Tuning};
use datastore::device::MemDevice;
use datastore::{Extent, Gate};
use engine::cache::CacheHost;
use engine::Volume;
use uuid::Uuid;

const SEG: u64 = 64 << 10;
const VOL: u64 = 1 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fua_zeroes_and_trims_flush_the_datastore_in_uncached_and_wt() {
    for policy in [Policy::Uncached, Policy::Wt] {
        let cache = Arc::new(SimDevice::new((1 << 20) + 16 * SEG));
        let store = Arc::new(MemDevice::new(VOL));
        let host = CacheHost::open(cache, SEG).unwrap();
        let id = Uuid::new_v4();
        let extent = Extent::new(store.clone(), 0, VOL, Arc::new(Gate::new(4)));
        let vol = Volume::open(
            id,
            "z".into(),
            policy,
            Tuning::default(),
            extent,
            Some(host.clone()),
        )
        .unwrap();
        host.finish_recovery(&[id]).unwrap();

        let before = store.flushes();
        vol.write_zeroes(0, 8192, true, true).await.unwrap();
        assert!(
            store.flushes() > before,
            "{policy}: a FUA zeroing completed without a datastore flush"
        );
        let before = store.flushes();
        vol.trim(8192, 8192, true).await.unwrap();
        assert!(
            store.flushes() > before,
            "{policy}: a FUA trim completed without a datastore flush"
        );
    }
}
