//! WRITE_ZEROES with NO_HOLE in a cached volume: the datastore must keep the range allocated,
//! so the flag travels with the write through the cache log (a flag of the zero record) to
//! the destager, live and after a power cut, where a zeroing without it (and a TRIM) may
//! deallocate. (The peer's side: `wbp_replay.rs`; real clients: `tests/tests/nbdsh.rs`.)

use std::sync::Arc;

use bytes::Bytes;
use cachelog::device::{Fate, SimDevice};
use cluster::Policy;
use datastore::device::MemDevice;
use uuid::Uuid;

mod common;
use common::{BLOCK, SEG, VOL};

/// Data over blocks 0–3, then a zeroing that may deallocate (block 0), a NO_HOLE one
/// (block 1, adjacent: two pieces of one window that must not merge) and a TRIM (block 3).
async fn zero_three_ways(vol: &engine::Volume, fua: bool) {
    vol.write(0, Bytes::from(vec![9u8; 4 * BLOCK]), false)
        .await
        .unwrap();
    let b = BLOCK as u64;
    vol.write_zeroes(0, b, true, fua).await.unwrap();
    vol.write_zeroes(b, b, false, fua).await.unwrap();
    vol.trim(3 * b, b, fua).await.unwrap();
}

fn assert_zeroed_as_asked(store: &MemDevice) {
    let b = BLOCK as u64;
    let z = store.zeroings();
    assert!(
        z.contains(&(b, b, false)),
        "the NO_HOLE zeroing went to the datastore as one that may deallocate: {z:?}"
    );
    assert!(z.contains(&(0, b, true)), "{z:?}");
    assert!(z.contains(&(3 * b, b, true)), "a TRIM deallocates: {z:?}");
    let img = store.image();
    assert!(img[..2 * BLOCK].iter().all(|x| *x == 0));
    assert!(img[2 * BLOCK..3 * BLOCK].iter().all(|x| *x == 9));
    assert!(img[3 * BLOCK..4 * BLOCK].iter().all(|x| *x == 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destaged_no_hole_zeroing_stays_allocated() {
    for batches in [false, true] {
        let cache = Arc::new(SimDevice::new((1 << 20) + 16 * SEG));
        let store = Arc::new(MemDevice::new(VOL));
        store.prefer_batches(batches);
        let id = Uuid::new_v4();
        let (host, vol) = common::open(cache, &store, id, Policy::Wb);
        zero_three_ways(&vol, false).await;
        common::destage_all(&host, &vol.cache().unwrap()).await;
        assert_zeroed_as_asked(&store);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_no_hole_zeroing_stays_allocated() {
    let cache = Arc::new(SimDevice::new((1 << 20) + 16 * SEG));
    let store = Arc::new(MemDevice::new(VOL));
    let id = Uuid::new_v4();
    {
        let (_host, vol) = common::open(cache.clone(), &store, id, Policy::Wb);
        // With FUA: durable in the log, never destaged.
        zero_three_ways(&vol, true).await;
    }
    cache.power_loss(|_, _| Fate::Kept);
    assert!(store.zeroings().is_empty(), "destaged before the power cut");
    let (host, vol) = common::open(cache, &store, id, Policy::Wb);
    common::destage_all(&host, &vol.cache().unwrap()).await;
    assert_zeroed_as_asked(&store);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wt_no_hole_zeroing_stays_allocated() {
    let cache = Arc::new(SimDevice::new((1 << 20) + 16 * SEG));
    let store = Arc::new(MemDevice::new(VOL));
    let (_host, vol) = common::open(cache, &store, Uuid::new_v4(), Policy::Wt);
    zero_three_ways(&vol, false).await;
    assert_zeroed_as_asked(&store);
}
