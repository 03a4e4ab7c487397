//! Where a read served from the cache device waits for it. On a connection thread
//! (`may_block_here`), a record memory holds is read inline; one the device must be asked for
//! goes to the blocking pool while other requests share the thread, so they are not held up
//! behind it, and stays inline when the request is alone. Off such threads, always the pool.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;

use bytes::Bytes;
use cachelog::device::{CacheDevice, SimDevice};
use cluster::Policy;
use datastore::device::{may_block_here, MemDevice};
use uuid::Uuid;

mod common;
use common::{SEG, VOL};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Op {
    /// A read that waits for the device.
    Wait,
    /// A read of what memory holds, which never waits.
    Cached,
}

/// A simulated device that says whether its data is in memory (`cold`: none of it is), and
/// records on which thread each read ran: timing cannot tell where a read ran, this can.
struct Where {
    inner: SimDevice,
    cold: AtomicBool,
    reads: Mutex<Vec<(Op, ThreadId)>>,
}

impl Where {
    fn take(&self) -> Vec<(Op, ThreadId)> {
        std::mem::take(&mut *self.reads.lock().unwrap())
    }
}

impl CacheDevice for Where {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn describe(&self) -> String {
        "where device".into()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        let me = std::thread::current().id();
        self.reads.lock().unwrap().push((Op::Wait, me));
        self.inner.read_at(offset, buf)
    }
    fn read_cached(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<usize> {
        let me = std::thread::current().id();
        self.reads.lock().unwrap().push((Op::Cached, me));
        if self.cold.load(Ordering::SeqCst) {
            return Err(std::io::ErrorKind::WouldBlock.into());
        }
        self.inner.read_at(offset, buf)?;
        Ok(buf.len())
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.inner.write_at(offset, data)
    }
    fn sync(&self) -> std::io::Result<()> {
        self.inner.sync()
    }
}

/// Polls `read` on this thread, marked as a connection thread (`alone`: nothing else waits
/// for it) during each poll, as the NBD server polls a request's future.
async fn on_connection_thread<T>(alone: bool, read: impl Future<Output = T>) -> T {
    let mut read = std::pin::pin!(read);
    std::future::poll_fn(|cx| may_block_here(alone, || read.as_mut().poll(cx))).await
}

#[tokio::test(flavor = "current_thread")]
async fn a_cache_read_that_waits_for_the_device_leaves_a_busy_connection_thread() {
    let dev = Arc::new(Where {
        inner: SimDevice::new((1 << 20) + 16 * SEG),
        cold: AtomicBool::new(false),
        reads: Mutex::new(Vec::new()),
    });
    let store = Arc::new(MemDevice::new(VOL));
    let (_host, vol) = common::open(dev.clone(), &store, Uuid::new_v4(), Policy::Wb);
    // Dirty, so in the cache only: whatever the reads return came from the cache device. A
    // record of whole pages keeps its payload apart from its header; 512 bytes, inline.
    let paged = Bytes::from((0..8192u32).map(|i| (i % 253) as u8).collect::<Vec<_>>());
    let inline = Bytes::from(vec![0x5a; 512]);
    vol.write(0, paged.clone(), false).await.unwrap();
    vol.write(64 << 10, inline.clone(), false).await.unwrap();
    assert!(store.image().iter().all(|b| *b == 0));
    let me = std::thread::current().id();
    let ops = |reads: &[(Op, ThreadId)], op: Op, here: bool| {
        reads
            .iter()
            .filter(|(o, t)| *o == op && (*t == me) == here)
            .count()
    };

    for (what, at, want) in [("paged", 0u64, &paged), ("inline", 64 << 10, &inline)] {
        let len = want.len() as u32;
        dev.take();

        // In memory: read inline, without asking the device to wait.
        let got = on_connection_thread(false, vol.read(at, len))
            .await
            .unwrap();
        assert_eq!(got, *want, "{what}");
        let r = dev.take();
        assert!(ops(&r, Op::Cached, true) > 0, "{what}: {r:?}");
        assert_eq!(
            ops(&r, Op::Wait, true) + ops(&r, Op::Wait, false),
            0,
            "{what}: {r:?}"
        );

        // Not in memory, other requests on the thread: the device waited on another thread.
        dev.cold.store(true, Ordering::SeqCst);
        let got = on_connection_thread(false, vol.read(at, len))
            .await
            .unwrap();
        assert_eq!(got, *want, "{what}");
        let r = dev.take();
        assert_eq!(
            ops(&r, Op::Wait, true),
            0,
            "{what}: waited on the connection thread {r:?}"
        );
        assert!(ops(&r, Op::Wait, false) > 0, "{what}: {r:?}");

        // Not in memory, the request alone: inline, where a trip to the pool only adds latency.
        let got = on_connection_thread(true, vol.read(at, len)).await.unwrap();
        assert_eq!(got, *want, "{what}");
        let r = dev.take();
        assert!(ops(&r, Op::Wait, true) > 0, "{what}: {r:?}");
        assert_eq!(ops(&r, Op::Wait, false), 0, "{what}: {r:?}");

        // Not on a connection thread: never inline, in memory or not.
        dev.cold.store(false, Ordering::SeqCst);
        let got = vol.read(at, len).await.unwrap();
        assert_eq!(got, *want, "{what}");
        let r = dev.take();
        assert_eq!(
            ops(&r, Op::Wait, true) + ops(&r, Op::Cached, true),
            0,
            "{what}: {r:?}"
        );
    }
}

#[tokio::test(flavor = "current_thread")]
async fn a_small_read_of_a_large_write_reads_and_verifies_only_its_pages() {
    let sim = Arc::new(SimDevice::new((1 << 20) + 64 * SEG));
    let store = Arc::new(MemDevice::new(VOL));
    let (_host, vol) = common::open(sim.clone(), &store, Uuid::new_v4(), Policy::Wb);
    // One 64 KiB write, dirty, so in the cache only. Records in 64 KiB test segments hold at
    // most 12 KiB: it is cut into five parts of three pages and a last one of one page.
    // Bytes that repeat nowhere, so each page can be found in the log.
    let data = Bytes::from(
        (0..64u32 << 10)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
            .collect::<Vec<_>>(),
    );
    vol.write(0, data.clone(), false).await.unwrap();
    let c = vol.cache().unwrap();
    for at in [0u64, 4096, 36 << 10, 60 << 10] {
        let before = sim.read_bytes();
        let got = vol.read(at, 4096).await.unwrap();
        assert_eq!(got[..], data[at as usize..][..4096]);
        assert_eq!(
            sim.read_bytes() - before,
            512 + 4096,
            "a 4 KiB read at {at} read more than its record's header and page"
        );
    }
    // A damaged page: the reads that need it fail (the data is dirty: nowhere else), and the
    // volume says so; the other pages of its record are still served.
    let page = sim
        .find(&data[8192..12288])
        .expect("the third page in the log");
    sim.corrupt(page + 100);
    let e = vol.read(8192, 512).await.unwrap_err();
    assert!(e.to_string().contains("cannot be read"), "{e}");
    assert!(c.report().degraded.is_some());
    for at in [0u64, 4096, 12288] {
        let got = vol.read(at, 4096).await.unwrap();
        assert_eq!(got[..], data[at as usize..][..4096], "page at {at}");
    }
}

/// Once a volume's share is full of clean data, every read that misses still caches what it
/// read: its fill's own append evicts a segment of other data, which does not touch the
/// block just read. Before, any removal from the volume's index while a read was in flight
/// dropped its fill, its own eviction's included, so about one miss in sixteen here was never
/// cached. Each block is read, changed on the datastore behind the cache's back, and read
/// again: the second read must come from the cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_share_still_caches_what_a_read_misses() {
    use datastore::device::Device;
    let cache = Arc::new(SimDevice::new((1 << 20) + 16 * SEG));
    let store = Arc::new(MemDevice::new(VOL));
    let block = common::BLOCK as u64;
    for b in 0..VOL / block {
        store
            .write_at(
                b * block,
                Bytes::from(vec![(b % 250) as u8 + 1; 4096]),
                false,
            )
            .await
            .unwrap();
    }
    let id = Uuid::new_v4();
    let (_host, vol) = common::open(cache, &store, id, Policy::Wt);
    let mut uncached = Vec::new();
    for b in 0..VOL / block {
        let first = vol.read(b * block, 4096).await.unwrap();
        assert!(first.iter().all(|x| *x == (b % 250) as u8 + 1));
        store
            .write_at(b * block, Bytes::from(vec![0xff; 4096]), false)
            .await
            .unwrap();
        let again = vol.read(b * block, 4096).await.unwrap();
        if again[0] == 0xff {
            uncached.push(b);
        }
    }
    let c = vol.cache().unwrap();
    assert!(
        c.report().evicted_segments > 0,
        "the share never filled: nothing was evicted"
    );
    assert!(
        uncached.is_empty(),
        "{} of {} blocks read were not cached: {uncached:?}",
        uncached.len(),
        VOL / block
    );
}
