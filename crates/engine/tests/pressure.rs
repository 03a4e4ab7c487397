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

/// A `wb` volume of [`VOL`] bytes on a log of 64 segments of [`SEG`], its destager not
/// running: everything written stays dirty.
fn wb_volume() -> (Arc<CacheHost>, Volume) {
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
    (host, vol)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_trim_does_not_count_as_dirty_data_for_flow_control() {
    // A log of 64 segments of 64 KiB: dirty data reaches pressure 1 at about 1.4 MiB of
    // log space (half of the 85 % of the share, less packing, at which writes stall).
    let (_host, vol) = wb_volume();
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

/// The delay grows all the way to the stall: 4 KiB writes fill a volume's share with flow
/// control's pressure at 2 (a delay of 4× the datastore latency) just as they stall, not
/// before. Before, the bytes signal counted payload against half the share while the stall
/// counts log space (a header per record) against 85 % of it less packing: 4 KiB writes
/// stalled at pressure 1.13, a delay of 1.4×, a cliff from there to a stall.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_writes_reach_the_largest_delay_before_they_stall() {
    let (_host, vol) = wb_volume();
    let vol = Arc::new(vol);
    let c = vol.cache().unwrap();

    // The destager does not run: every write stays dirty until the share is full. No
    // datastore latency is measured yet, so flow control's delays are zero and only the
    // pressure shows where the writes are on the curve.
    let mut written = 0u64;
    let before_stall = loop {
        let (p, stalls) = (c.report().flow_pressure, c.report().stalls);
        let w = tokio::spawn({
            let vol = vol.clone();
            async move {
                vol.write(written * 4096, Bytes::from(vec![9u8; 4096]), false)
                    .await
            }
        });
        // Completed, or counted as stalled: nothing else can keep it waiting here.
        while !w.is_finished() && c.report().stalls == stalls {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        if c.report().stalls > stalls {
            break p;
        }
        w.await.unwrap().unwrap();
        written += 1;
        assert!(written < VOL / 4096, "the share never filled");
    };
    assert!(
        before_stall >= 1.95,
        "{written} writes of 4 KiB stalled at pressure {before_stall:.2}, before the largest \
         delay (pressure 2)"
    );
}
