//! An append whose thread dies in it (a panic in the cache device's write) must not leave a
//! hole that later writes complete above: recovery stops at the first missing `ser`, so they
//! would be lost. The log fails as for a device error, and later writes are refused.

use std::future::Future;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Waker};

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

/// The same, with the write polled as the NBD server polls a request first: inline on a
/// connection thread that may block (`may_block_here`), under `catch_unwind`, the future
/// dropped if it panics. The append then runs on that thread, not on the pool, and the panic
/// unwinds through the write itself. Before the write's completion failed the log when it was
/// dropped unstaged, the log stayed good, a later FUA write completed, and after a power cut
/// recovery stopped at the hole and dropped that FUA write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_an_append_polled_inline_fails_the_log_too() {
    let dev = Arc::new(Panicky {
        inner: SimDevice::new((1 << 20) + 16 * SEG),
        armed: AtomicBool::new(false),
    });
    let store = Arc::new(MemDevice::new(VOL));
    let (host, vol) = common::open(dev.clone(), &store, Uuid::new_v4(), Policy::Wb);
    vol.write(0, Bytes::from(vec![1; BLOCK]), true)
        .await
        .unwrap();

    dev.armed.store(true, Ordering::SeqCst);
    let rt = tokio::runtime::Handle::current();
    let polled = std::thread::scope(|s| {
        s.spawn(|| {
            let _rt = rt.enter();
            datastore::device::may_block_here(true, || {
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let mut write =
                        Box::pin(vol.write(BLOCK as u64, Bytes::from(vec![2; BLOCK]), false));
                    let mut cx = Context::from_waker(Waker::noop());
                    write.as_mut().poll(&mut cx).is_ready()
                }))
            })
        })
        .join()
        .unwrap()
    });
    assert!(
        polled.is_err(),
        "the append did not panic on the polling thread"
    );
    assert!(
        host.log().is_failed(),
        "a write dropped unstaged left the log good"
    );
    assert!(
        vol.write(2 * BLOCK as u64, Bytes::from(vec![3; BLOCK]), true)
            .await
            .is_err(),
        "a later FUA write completed above the hole"
    );
}

/// A simulated device that holds the write of a record holding 0x55 bytes until told, then
/// fails it, as a dying device fails a write it took long over.
struct FailsLate {
    inner: SimDevice,
    release: std::sync::Mutex<Option<std::sync::mpsc::Receiver<()>>>,
    holding: AtomicBool,
}

impl CacheDevice for FailsLate {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn describe(&self) -> String {
        "device that fails late".into()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.inner.read_at(offset, buf)
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        if data.windows(256).any(|w| w.iter().all(|b| *b == 0x55)) {
            let rx = self.release.lock().unwrap().take();
            if let Some(rx) = rx {
                self.holding.store(true, Ordering::SeqCst);
                let _ = rx.recv();
                return Err(io::Error::other("test: the held write fails"));
            }
        }
        self.inner.write_at(offset, data)
    }
    fn sync(&self) -> io::Result<()> {
        self.inner.sync()
    }
}

/// Write 5 appends slowly and fails; write 6, appended meanwhile and waiting for 5 to
/// complete in order, must fail too: recovery stops at the first missing `ser`, and nothing
/// destages from a failed log, so 6 would never be anywhere but this dead device.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_waiting_for_one_whose_append_fails_does_not_complete() {
    let (tx, rx) = std::sync::mpsc::channel();
    let dev = Arc::new(FailsLate {
        inner: SimDevice::new((1 << 20) + 16 * SEG),
        release: std::sync::Mutex::new(Some(rx)),
        holding: AtomicBool::new(false),
    });
    let store = Arc::new(MemDevice::new(VOL));
    let (_host, vol) = common::open(dev.clone(), &store, Uuid::new_v4(), Policy::Wb);
    let vol = Arc::new(vol);
    let slow = {
        let v = vol.clone();
        tokio::spawn(async move { v.write(0, Bytes::from(vec![0x55; BLOCK]), false).await })
    };
    while !dev.holding.load(Ordering::SeqCst) {
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    let after = {
        let v = vol.clone();
        tokio::spawn(async move {
            v.write(8 * BLOCK as u64, Bytes::from(vec![0x66; BLOCK]), false)
                .await
        })
    };
    // Write 6 appended (its payload is on the device), and waits for 5.
    while dev.inner.find(&[0x66; BLOCK]).is_none() {
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    assert!(!after.is_finished(), "write 6 completed before write 5");
    tx.send(()).unwrap();
    assert!(
        slow.await.unwrap().is_err(),
        "the failed append's write failed"
    );
    assert!(
        after.await.unwrap().is_err(),
        "a write completed after the cache device failed under the one before it"
    );
}
