//! A cache record that cannot be read while a newer write replaces it: the read falls back to
//! the datastore for what the record still maps, and the newer write stays what the volume
//! reads.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use cachelog::device::SimDevice;
use cluster::Policy;
use datastore::device::MemDevice;
use uuid::Uuid;

mod common;
use common::{BLOCK, SEG, VOL};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_read_of_a_clean_record_keeps_the_newer_write_over_it() {
    let cache = Arc::new(SimDevice::new((1 << 20) + 16 * SEG));
    let store = Arc::new(MemDevice::new(VOL));
    let (host, vol) = common::open(cache.clone(), &store, Uuid::new_v4(), Policy::Wb);
    let vol = Arc::new(vol);

    // A, destaged: a clean record in the cache, and on the datastore.
    vol.write(0, Bytes::from(vec![0x11; BLOCK]), false)
        .await
        .unwrap();
    let c = vol.cache().unwrap();
    common::destage_all(&host, &c).await;
    assert_eq!(store.image()[..BLOCK], [0x11; BLOCK]);

    // The record's payload goes bad, and a reader stops at the device with it looked up.
    let at = cache.find(&[0x11; BLOCK]).expect("A's payload in the log");
    cache.corrupt(at);
    cache.pause_reads(true);
    let reader = {
        let v = vol.clone();
        tokio::spawn(async move { v.read(0, BLOCK as u32).await })
    };
    tokio::time::timeout(Duration::from_secs(10), async {
        while cache.reads_waiting() == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .expect("the reader reached the device");

    // B replaces A (dirty, in the cache only), then the reader finds A's record corrupt.
    vol.write(0, Bytes::from(vec![0x22; BLOCK]), false)
        .await
        .unwrap();
    cache.pause_reads(false);
    let first = reader
        .await
        .unwrap()
        .expect("the read falls back, it does not fail");
    assert!(
        first[..] == [0x11; BLOCK] || first[..] == [0x22; BLOCK],
        "the concurrent read returned neither A nor B"
    );

    // From now on the volume reads B, before and after it is destaged.
    let got = vol.read(0, BLOCK as u32).await.unwrap();
    assert!(
        got[..] == [0x22; BLOCK],
        "B was lost from the cache's index"
    );
    common::destage_all(&host, &c).await;
    assert_eq!(store.image()[..BLOCK], [0x22; BLOCK]);
    let got = vol.read(0, BLOCK as u32).await.unwrap();
    assert!(got[..] == [0x22; BLOCK], "a stale fill of A is served");
}
