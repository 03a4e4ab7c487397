//! An append whose thread dies in it (a panic in the cache device's write) must not leave a
//! hole that later writes complete above: recovery stops at the first missing `ser`, so they
//! would be lost. The log fails as for a device error, and later writes are refused.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use cachelog::device::{CacheDevice, SimDevice};
use cluster::Policy;
use datastore::device::MemDevice;
use uuid::Uuid;

mod common;
use common::{BLOCK, SEG, VOL};

/// A simulated device whose next write panics once armed.
struct Panicky {
    inner: SimDevice,
    armed: AtomicBool,
}

impl CacheDevice for Panicky {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn describe(&self) -> String {
        "panicky device".into()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.inner.read_at(offset, buf)
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        if self.armed.swap(false, Ordering::SeqCst) {
            panic!("test: the device write panics");
        }
        self.inner.write_at(offset, data)
    }
    fn sync(&self) -> io::Result<()> {
        self.inner.sync()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_an_append_fails_the_log_so_no_later_write_completes_above_it() {
    let dev = Arc::new(Panicky {
        inner: SimDevice::new((1 << 20) + 16 * SEG),
        armed: AtomicBool::new(false),
    });
    let store = Arc::new(MemDevice::new(VOL));
    let (_host, vol) = common::open(dev.clone(), &store, Uuid::new_v4(), Policy::Wb);
    vol.write(0, Bytes::from(vec![1; BLOCK]), false)
        .await
        .unwrap();

    dev.armed.store(true, Ordering::SeqCst);
    assert!(
        vol.write(BLOCK as u64, Bytes::from(vec![2; BLOCK]), false)
            .await
            .is_err(),
        "the write whose append panicked failed"
    );
    assert!(
        vol.write(2 * BLOCK as u64, Bytes::from(vec![3; BLOCK]), false)
            .await
            .is_err(),
        "a later write completed above the hole"
    );
}
