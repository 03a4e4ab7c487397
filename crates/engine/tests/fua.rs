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

/// A volume that opens straight into `wb` (its record says so) may have completed writes on
/// the datastore in an earlier life (in `wt` or uncached) that still sit in the datastore's
/// volatile cache. A `wb` FLUSH only syncs the cache log, so the first one after the open
/// must flush the datastore as well, or those writes never become durable by it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_wb_flush_after_an_open_flushes_the_datastore() {
    for earlier in [Policy::Uncached, Policy::Wt] {
        let cache = Arc::new(SimDevice::new((1 << 20) + 16 * SEG));
        let store = Arc::new(MemDevice::new(VOL));
        let id = Uuid::new_v4();
        {
            let (_host, vol) = common::open(cache.clone(), &store, id, earlier);
            vol.write(0, bytes::Bytes::from(vec![7u8; 4096]), false)
                .await
                .unwrap();
        }
        let (_host, vol) = common::open(cache, &store, id, Policy::Wb);
        let before = store.flushes();
        vol.flush().await.unwrap();
        assert!(
            store.flushes() > before,
            "after {earlier}: the first wb FLUSH left the datastore unflushed, so a write it \
             completed before the reopen is still not durable"
        );
        let before = store.flushes();
        vol.write(4096, bytes::Bytes::from(vec![8u8; 4096]), false)
            .await
            .unwrap();
        vol.flush().await.unwrap();
        assert_eq!(
            store.flushes(),
            before,
            "after {earlier}: a later wb FLUSH flushed the datastore, though it owed nothing"
        );
    }
}
