//! FUA on a zeroing or a trim reaches the datastore's stable media in the policies that
//! complete writes on the datastore (`uncached`, `wt`): the datastore has no FUA for them, so
//! the engine flushes it before the request completes.

use std::sync::Arc;

use cachelog::device::SimDevice;
use cluster::Policy;
use datastore::device::MemDevice;
use uuid::Uuid;

mod common;
use common::{SEG, VOL};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fua_zeroes_and_trims_flush_the_datastore_in_uncached_and_wt() {
    for policy in [Policy::Uncached, Policy::Wt] {
        let cache = Arc::new(SimDevice::new((1 << 20) + 16 * SEG));
        let store = Arc::new(MemDevice::new(VOL));
        let (_host, vol) = common::open(cache, &store, Uuid::new_v4(), policy);

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
