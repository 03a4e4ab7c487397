//! Flow control's pressure counts what the destager must move: a large TRIM, which reaches
//! the datastore as one request, does not push it up the way as many bytes of data would.

use std::sync::Arc;

use bytes::Bytes;
use cachelog::device::SimDevice;
use cluster::{Policy, Tuning};
use datastore::device::MemDevice;
use datastore::{Extent, Gate};
use engine::cache::CacheHost;
use engine::Volume;
use uuid::Uuid;

const SEG: u64 = 64 << 10;
const VOL: u64 = 64 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_trim_does_not_count_as_dirty_data_for_flow_control() {
    // A 4 MiB log: dirty data starts to count as pressure 1 at about 2 MiB.
    let cache = Arc::new(SimDevice::new((1 << 20) + 64 * SEG));
    let host = CacheHost::open(cache, SEG).unwrap();
    let store = Arc::new(MemDevice::new(VOL));
    let extent = Extent::new(store, 0, VOL, Arc::new(Gate::new(4)));
    let id = Uuid::new_v4();
    let vol = Volume::open(
        id,
        "t".into(),
        Policy::Wb,
        Tuning::default(),
        extent,
        Some(host.clone()),
    )
    .unwrap();
    host.finish_recovery(&[id]).unwrap();
    let c = vol.cache().unwrap();

    // The destager does not run: everything stays dirty.
    vol.trim(0, VOL, false).await.unwrap();
    let r = c.report();
    assert_eq!(r.dirty_bytes, VOL, "the trim is not dirty");
    assert!(
        r.flow_pressure < 0.1,
        "a 64 MiB trim put the pressure at {}",
        r.flow_pressure
    );

    // Data still counts: 1 MiB of 4 KiB writes is about half the trigger.
    for i in 0..256u64 {
        vol.write(i * 4096, Bytes::from(vec![7u8; 4096]), false)
            .await
            .unwrap();
    }
    let r = c.report();
    assert_eq!(r.dirty_bytes, VOL + (1 << 20));
    assert!(
        (0.3..0.9).contains(&r.flow_pressure),
        "1 MiB of dirty data in a 4 MiB log gives pressure {}",
        r.flow_pressure
    );
}
