//! A datastore write whose answer was lost (its NBD connection died with it in flight) may
//! still be carried out by the server, late: the destager must not send a newer version of
//! the block before the old one can have landed, or the old one lands over it after the
//! checkpoint that released the newer one from the cache.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use cachelog::device::SimDevice;
use cluster::Policy;
use common::{BLOCK, SEG, VOL};
use datastore::device::MemDevice;
use uuid::Uuid;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_whose_answer_was_lost_never_lands_over_a_newer_version() {
    let store = Arc::new(MemDevice::new(VOL));
    let cache = Arc::new(SimDevice::new((1 << 20) + 32 * SEG));
    let (host, vol) = common::open(cache, &store, Uuid::new_v4(), Policy::Wb);
    let c = vol.cache().expect("a cached volume");
    vol.write(0, Bytes::from(vec![1; BLOCK]), false)
        .await
        .unwrap();
    // Version 1 goes out, its answer is lost, and the server writes it a second later.
    store.lose_answers(1, Duration::from_secs(1));
    host.destage_turn(0).await;
    assert!(
        !c.clean(),
        "a window whose write went unanswered counted as destaged"
    );
    assert_eq!(store.landed_late(), 0);
    vol.write(0, Bytes::from(vec![2; BLOCK]), false)
        .await
        .unwrap();
    let start = Instant::now();
    let mut turn = 1;
    while !c.clean() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the destager never retried"
        );
        host.destage_turn(turn).await;
        turn += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The volume is clean: its cache holds version 2 no more. Once the late write is in, the
    // datastore must still hold version 2.
    while store.landed_late() == 0 {
        assert!(start.elapsed() < Duration::from_secs(30), "never landed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        store.image()[..BLOCK].iter().all(|&b| b == 2),
        "the late write of version 1 landed over version 2 (destaged after {:?})",
        start.elapsed()
    );
    assert_eq!(vol.read(0, BLOCK as u32).await.unwrap()[..], [2; BLOCK][..]);
}
