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

/// Waits until `done` holds, checking every millisecond; fails with `what` after 10 s.
async fn until(what: &str, done: impl Fn() -> bool) {
    tokio::time::timeout(Duration::from_secs(10), async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .expect(what);
}
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
    until("the reader reached the device", || {
        cache.reads_waiting() > 0
    })
    .await;

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

/// A read stopped midway (its task aborted while it reads the cache device) gives back the
/// segments it pinned to read from, once the device read it started has ended: a volume that
/// leaves the cache meanwhile keeps the segment being read until then, and none after, so
/// the cache's space is not lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_dropped_midway_leaves_no_segment_pinned() {
    let cache = Arc::new(SimDevice::new((1 << 20) + 16 * SEG));
    let store = Arc::new(MemDevice::new(VOL));
    let id = Uuid::new_v4();
    let (host, vol) = common::open(cache.clone(), &store, id, Policy::Wb);
    let vol = Arc::new(vol);
    vol.write(0, Bytes::from(vec![0x11; BLOCK]), false)
        .await
        .unwrap();
    let c = vol.cache().unwrap();
    common::destage_all(&host, &c).await;
    drop(c);

    cache.pause_reads(true);
    let reader = {
        let v = vol.clone();
        tokio::spawn(async move { v.read(0, BLOCK as u32).await })
    };
    until("the reader reached the device", || {
        cache.reads_waiting() > 0
    })
    .await;
    reader.abort();
    assert!(reader.await.unwrap_err().is_cancelled());
    // Reads go on again even if an assertion below fails (a paused read would hold the
    // runtime's shutdown, and the test, for ever).
    struct Resume(Arc<SimDevice>);
    impl Drop for Resume {
        fn drop(&mut self) {
            self.0.pause_reads(false);
        }
    }
    let _resume = Resume(cache.clone());

    // The volume leaves the cache while the device read goes on: the segment it reads stays
    // until that read ends, then goes too.
    assert!(host.log().segments_of(id) > 0);
    vol.set_policy(Policy::Uncached).await.unwrap();
    assert_eq!(
        host.log().segments_of(id),
        1,
        "the segment a device read is still reading was let go"
    );
    cache.pause_reads(false);
    until(
        "a segment of the volume stays pinned after it left the cache",
        || host.log().segments_of(id) == 0,
    )
    .await;
    let got = vol.read(0, BLOCK as u32).await.unwrap();
    assert!(got[..] == [0x11; BLOCK]);
}

/// A read whose fill is stopped midway (its task aborted while the fill's record is being
/// appended) leaves nothing pinned either: the record, once appended, is unpinned though no
/// one takes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_dropped_in_its_fill_leaves_no_segment_pinned() {
    let cache = Arc::new(SimDevice::new((1 << 20) + 16 * SEG));
    let store = Arc::new(MemDevice::new(VOL));
    datastore::device::Device::write_at(&*store, 0, Bytes::from(vec![0x33; BLOCK]), false)
        .await
        .unwrap();
    let id = Uuid::new_v4();
    let (host, vol) = common::open(cache.clone(), &store, id, Policy::Wt);
    let vol = Arc::new(vol);
    // A miss: the read goes to the datastore, then appends what it read to the cache.
    cache.pause_writes(true);
    let reader = {
        let v = vol.clone();
        tokio::spawn(async move { v.read(0, BLOCK as u32).await })
    };
    until("the fill reached the device", || cache.writes_waiting() > 0).await;
    reader.abort();
    assert!(reader.await.unwrap_err().is_cancelled());
    cache.pause_writes(false);
    // The append ends on its own thread, its result dropped.
    vol.set_policy(Policy::Uncached).await.unwrap();
    until(
        "a segment of the volume stays pinned after it left the cache",
        || host.log().segments_of(id) == 0,
    )
    .await;
    let got = vol.read(0, BLOCK as u32).await.unwrap();
    assert!(got[..] == [0x33; BLOCK]);
}
