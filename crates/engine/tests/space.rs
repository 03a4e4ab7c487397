//! A cache too small for the load never hangs: with one volume's clean data filling the log
//! and another writing small blocks faster than a slow datastore takes them, every write still
//! completes (throttled, stalled, evicting), and the datastore ends equal to the volume.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use cachelog::device::SimDevice;
use cluster::{Policy, Tuning};
use datastore::device::MemDevice;
use datastore::{Extent, Gate};
use engine::cache::CacheHost;
use engine::Volume;
use uuid::Uuid;

const SEG: u64 = 64 << 10;
const VOL: u64 = 4 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_cache_throttles_and_evicts_but_never_hangs() {
    // Twelve segments in all: a handful per volume.
    let cache = Arc::new(SimDevice::new((1 << 20) + 12 * SEG));
    let host = CacheHost::open(cache, SEG).unwrap();
    let open = |store: &Arc<MemDevice>, name: &str| {
        let extent = Extent::new(store.clone(), 0, VOL, Arc::new(Gate::new(4)));
        Arc::new(
            Volume::open(
                Uuid::new_v4(),
                name.into(),
                Policy::Wb,
                Tuning::default(),
                extent,
                Some(host.clone()),
            )
            .unwrap(),
        )
    };
    let store_a = Arc::new(MemDevice::new(VOL));
    let store_b = Arc::new(MemDevice::new(VOL));
    store_b.set_write_delay(Some(Duration::from_millis(1)));
    let a = open(&store_a, "a");
    host.finish_recovery(&[]).unwrap();
    let destager = {
        let h = host.clone();
        tokio::spawn(async move { h.run_destager(|| false).await })
    };
    // a fills the cache with read-cache data (fills of everything it reads).
    for off in (0..VOL).step_by(64 << 10) {
        a.read(off, 64 << 10).await.unwrap();
    }
    let b = open(&store_b, "b");
    // b writes 512-byte blocks from 8 writers: each costs the log twice its size.
    let mut tasks = Vec::new();
    for w in 0..8u64 {
        let b = b.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..300u64 {
                let block = (i * 8 + w) % (VOL / 512);
                let data = Bytes::from(vec![(w + 1) as u8; 512]);
                b.write(block * 512, data, i % 50 == 0).await.unwrap();
            }
        }));
    }
    let all = async {
        for t in tasks {
            t.await.unwrap();
        }
    };
    tokio::time::timeout(Duration::from_secs(120), all)
        .await
        .expect("writes hung on a full cache");
    // Everything reaches the datastore, which then equals what b reads.
    let c = b.cache().unwrap();
    tokio::time::timeout(Duration::from_secs(120), async {
        while !c.clean() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the destager never caught up");
    let got = b.read(0, VOL as u32).await.unwrap();
    assert!(
        got[..] == store_b.image()[..],
        "the datastore differs from the volume"
    );
    assert!(c.report().degraded.is_none(), "{:?}", c.report().degraded);
    destager.abort();
}
