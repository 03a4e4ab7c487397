//! FVP §7.1, flash failure in `wbp`: the owner's cache device fails, its peers replay what
//! it held, and the owner goes on uncached. Meanwhile the volume's IO stalls, as FVP stalls
//! the VM, instead of failing: a VM must not see an error for a failure that loses nothing.
//! The same holds for a `wb` volume whose every write was destaged: it stalls until it goes
//! on uncached. These tests play the daemon's part (the peer's replay onto the datastore,
//! then `abandon_cache`, or `stop_stalling`) by hand.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use cachelog::device::{CacheDevice, SimDevice};
use cluster::Policy;
use datastore::device::{Device, MemDevice};
use engine::cache::CacheHost;
use engine::{Error, Volume};
use uuid::Uuid;

mod common;
use common::{Yes, BLOCK, SEG, VOL};

const WBP: Policy = Policy::Wbp {
    peers: 1,
    rule: cluster::PeerRule::Any,
};

/// A `wbp` volume (its peers take everything) holding block 0 = 0x41, dirty, and a cache
/// device that fails every IO from now on.
async fn failed_under_wbp() -> (Arc<SimDevice>, Arc<MemDevice>, Arc<Volume>) {
    let cache = Arc::new(SimDevice::new((1 << 20) + 16 * SEG));
    let store = Arc::new(MemDevice::new(VOL));
    let (_host, vol) = common::open(cache.clone(), &store, Uuid::new_v4(), Policy::Wb);
    let vol = Arc::new(vol);
    vol.set_policy_with(WBP, Some(Arc::new(Yes)), None)
        .await
        .unwrap();
    vol.write(0, Bytes::from(vec![0x41; BLOCK]), false)
        .await
        .unwrap();
    assert!(
        store.image()[..BLOCK].iter().all(|b| *b == 0),
        "not destaged"
    );
    cache.fail();
    (cache, store, vol)
}

type Task<T> = tokio::task::JoinHandle<engine::Result<T>>;

/// A write, a read of the dirty block and a flush, each on its own task.
fn io(vol: &Arc<Volume>) -> (Task<()>, Task<Bytes>, Task<()>) {
    let v = vol.clone();
    let write = tokio::spawn(async move {
        v.write(BLOCK as u64, Bytes::from(vec![0x42; BLOCK]), true)
            .await
    });
    let v = vol.clone();
    let read = tokio::spawn(async move { v.read(0, BLOCK as u32).await });
    let v = vol.clone();
    let flush = tokio::spawn(async move { v.flush().await });
    (write, read, flush)
}

async fn within<T>(t: tokio::task::JoinHandle<T>, what: &str) -> T {
    tokio::time::timeout(Duration::from_secs(5), t)
        .await
        .unwrap_or_else(|_| panic!("{what} still stalled"))
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn io_stalls_while_peers_replay_and_goes_on_uncached_after() {
    let (_cache, store, vol) = failed_under_wbp().await;
    let (write, read, flush) = io(&vol);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(vol.stalled(), "the volume does not say it stalls");
    assert!(
        !write.is_finished(),
        "a write ended while its peers replayed"
    );
    assert!(
        !read.is_finished(),
        "a read of dirty data ended while its peers replayed"
    );
    assert!(
        !flush.is_finished(),
        "a flush ended while its peers replayed"
    );
    // Reads of clean data stall too: the replay can take the datastore back a version.
    let clean = {
        let v = vol.clone();
        tokio::spawn(async move { v.read(8 * BLOCK as u64, 512).await })
    };
    // A policy change is refused at once, and the stalled IO does not hold it up.
    let e = tokio::time::timeout(Duration::from_secs(5), vol.set_policy(Policy::Wt))
        .await
        .expect("a policy change hung on the stalled IO")
        .unwrap_err();
    assert!(e.to_string().contains("peers replay"), "{e}");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !clean.is_finished(),
        "a read ended while its peers replayed"
    );

    // The peer replays block 0, then the owner gives the cache up.
    store
        .write_at(0, Bytes::from(vec![0x41; BLOCK]), false)
        .await
        .unwrap();
    vol.abandon_cache().await;
    assert_eq!(vol.policy(), Policy::Uncached);
    assert!(!vol.stalled(), "the volume still says it stalls");
    within(write, "the write").await.unwrap();
    let got = within(read, "the read").await.unwrap();
    assert!(
        got[..] == [0x41; BLOCK],
        "the read saw other data than the replay"
    );
    within(flush, "the flush").await.unwrap();
    let clean = within(clean, "the clean read").await.unwrap();
    assert!(clean.iter().all(|b| *b == 0));
    assert!(store.image()[BLOCK..2 * BLOCK] == [0x42; BLOCK]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_peer_to_replay_the_volume_goes_on_as_in_wb() {
    let (_cache, store, vol) = failed_under_wbp().await;
    let (write, read, flush) = io(&vol);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!write.is_finished());
    // Issued once the failure is known (the write above found it).
    let clean = {
        let v = vol.clone();
        tokio::spawn(async move { v.read(8 * BLOCK as u64, 512).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!clean.is_finished());
    assert!(vol.stalled());
    vol.stop_stalling("no peer is left to replay from".into());
    assert!(!vol.stalled(), "the volume still says it stalls");
    // As in wb: what needed the failed device fails (the dirty block is lost with it), and
    // clean data reads from the datastore.
    within(write, "the write").await.unwrap_err();
    within(read, "the read of dirty data").await.unwrap_err();
    within(flush, "the flush").await.unwrap_err();
    assert!(within(clean, "the clean read")
        .await
        .unwrap()
        .iter()
        .all(|b| *b == 0));
    // Later IO does not stall either, and nothing reached the datastore.
    let e = tokio::time::timeout(
        Duration::from_secs(5),
        vol.write(0, Bytes::from(vec![1; BLOCK]), false),
    )
    .await
    .expect("a write stalled after the hand-off was given up")
    .unwrap_err();
    assert!(matches!(e, Error::Cache(_)), "{e}");
    tokio::time::timeout(Duration::from_secs(5), vol.read(16 * BLOCK as u64, 512))
        .await
        .expect("a clean read stalled after the hand-off was given up")
        .unwrap();
    assert!(store.image().iter().all(|b| *b == 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_change_wakes_stalled_io() {
    // Every route change wakes IO stalled on the old route (a policy change whose pause
    // the device failed in detaches the cache the same way): it goes on by the new route.
    let (_cache, store, vol) = failed_under_wbp().await;
    let (write, _read, _flush) = io(&vol);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!write.is_finished());
    vol.detach_cache().await;
    within(write, "the write").await.unwrap();
    assert!(store.image()[BLOCK..2 * BLOCK] == [0x42; BLOCK]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_ends_the_stall() {
    let (_cache, _store, vol) = failed_under_wbp().await;
    let (write, _read, _flush) = io(&vol);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!write.is_finished());
    // The revoke wakes the stalled IO, which ends at once.
    assert!(
        vol.revoke(Duration::from_millis(50)).await,
        "stalled IO kept the volume from draining"
    );
    assert!(matches!(
        within(write, "the write").await,
        Err(Error::Revoked)
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_ends_the_stall() {
    let (_cache, store, vol) = failed_under_wbp().await;
    let (write, _read, _flush) = io(&vol);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!write.is_finished());
    vol.stop();
    assert!(matches!(
        within(write, "the write").await,
        Err(Error::Stopping)
    ));
    // IO that would stall ends at once too, and nothing reached the datastore.
    let e = tokio::time::timeout(Duration::from_secs(5), vol.flush())
        .await
        .expect("a flush stalled after the stop")
        .unwrap_err();
    assert!(matches!(e, Error::Stopping), "{e}");
    assert!(store.image().iter().all(|b| *b == 0));
}

/// A `wb` volume on `cache` holding block 0 = 0x41, with that write destaged (`destaged`) or
/// not, and the destager's host.
async fn wb_volume(
    cache: Arc<dyn CacheDevice>,
    destaged: bool,
) -> (Arc<MemDevice>, Arc<Volume>, Arc<CacheHost>) {
    let store = Arc::new(MemDevice::new(VOL));
    let (host, vol) = common::open(cache, &store, Uuid::new_v4(), Policy::Wb);
    let vol = Arc::new(vol);
    vol.write(0, Bytes::from(vec![0x41; BLOCK]), false)
        .await
        .unwrap();
    if destaged {
        common::destage_all(&host, &vol.cache().unwrap()).await;
        assert!(store.image()[..BLOCK] == [0x41; BLOCK]);
    }
    (store, vol, host)
}

/// A switch hook that records that it ran, and with what generation.
fn recording_hook(ran: &Arc<std::sync::Mutex<Option<(u64, u64)>>>) -> engine::SwitchHook {
    let ran = ran.clone();
    Box::new(move |gen, checkpoint| {
        *ran.lock().unwrap() = Some((gen, checkpoint));
        Box::pin(async { Ok(()) })
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wb_volume_with_nothing_dirty_stalls_its_writes_and_goes_on_uncached() {
    let cache = Arc::new(SimDevice::new((1 << 20) + 16 * SEG));
    let (store, vol, _host) = wb_volume(cache.clone(), true).await;
    let gen = vol.cache().unwrap().gen();
    cache.fail();
    let (write, read, flush) = io(&vol);
    // Reads go on: the datastore holds everything.
    let got = within(read, "the read").await.unwrap();
    assert!(got[..] == [0x41; BLOCK], "the read saw other data");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(vol.stalled(), "the volume does not say it stalls");
    assert!(
        !write.is_finished(),
        "a write ended before the volume went uncached"
    );
    assert!(
        !flush.is_finished(),
        "a flush ended before the volume went uncached"
    );
    // The daemon's part: a new generation recorded, then on uncached.
    let ran = Arc::new(std::sync::Mutex::new(None));
    assert!(vol
        .go_uncached_with_nothing_lost(recording_hook(&ran))
        .await
        .unwrap());
    assert_eq!(
        ran.lock().unwrap().map(|r| r.0),
        Some(gen + 1),
        "the hook did not get the next generation"
    );
    assert!(!vol.stalled());
    assert_eq!(vol.policy(), Policy::Uncached);
    within(write, "the write").await.unwrap();
    within(flush, "the flush").await.unwrap();
    assert!(store.image()[BLOCK..2 * BLOCK] == [0x42; BLOCK]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wb_volume_with_dirty_data_does_not_stall_and_reports_the_loss() {
    let cache = Arc::new(SimDevice::new((1 << 20) + 16 * SEG));
    let (store, vol, _host) = wb_volume(cache.clone(), false).await;
    cache.fail();
    assert!(!vol.stalled(), "a volume that lost dirty data stalls");
    let e = tokio::time::timeout(
        Duration::from_secs(5),
        vol.write(BLOCK as u64, Bytes::from(vec![0x42; BLOCK]), false),
    )
    .await
    .expect("a write stalled")
    .unwrap_err();
    assert!(matches!(e, Error::Cache(_)), "{e}");
    let e = tokio::time::timeout(Duration::from_secs(5), vol.read(0, BLOCK as u32))
        .await
        .expect("a read of the lost block stalled")
        .unwrap_err();
    assert!(matches!(e, Error::Cache(_)), "{e}");
    let ran = Arc::new(std::sync::Mutex::new(None));
    assert!(!vol
        .go_uncached_with_nothing_lost(recording_hook(&ran))
        .await
        .unwrap());
    assert!(ran.lock().unwrap().is_none());
    assert!(store.image().iter().all(|b| *b == 0));
}

/// A simulated device whose write of a record holding 0x77 bytes is done, and then held
/// until released: an append that passed the log's failed check before the device failed,
/// and completes after.
struct Held {
    inner: Arc<SimDevice>,
    release: std::sync::Mutex<Option<std::sync::mpsc::Receiver<()>>>,
    holding: std::sync::atomic::AtomicBool,
}

impl CacheDevice for Held {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn describe(&self) -> String {
        "held device".into()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        self.inner.read_at(offset, buf)
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.inner.write_at(offset, data)?;
        if data.windows(256).any(|w| w.iter().all(|b| *b == 0x77)) {
            let rx = self.release.lock().unwrap().take();
            if let Some(rx) = rx {
                self.holding
                    .store(true, std::sync::atomic::Ordering::SeqCst);
                let _ = rx.recv();
            }
        }
        Ok(())
    }
    fn sync(&self) -> std::io::Result<()> {
        self.inner.sync()
    }
}

type Late = (std::sync::mpsc::Sender<()>, Arc<Volume>, Task<()>, Task<()>);

/// A clean `wb` volume whose device failed while a write's append was under way (held in
/// the device until the sender is used): that late write, and a write stalled since.
async fn a_write_held_across_the_failure() -> Late {
    let sim = Arc::new(SimDevice::new((1 << 20) + 16 * SEG));
    let (tx, rx) = std::sync::mpsc::channel();
    let dev = Arc::new(Held {
        inner: sim.clone(),
        release: std::sync::Mutex::new(Some(rx)),
        holding: std::sync::atomic::AtomicBool::new(false),
    });
    let (_store, vol, _host) = wb_volume(dev.clone(), true).await;
    let v = vol.clone();
    let late = tokio::spawn(async move {
        v.write(2 * BLOCK as u64, Bytes::from(vec![0x77; 512]), false)
            .await
    });
    while !dev.holding.load(std::sync::atomic::Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    sim.fail();
    let (write, _, _) = io(&vol);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(vol.stalled(), "the volume does not stall");
    (tx, vol, late, write)
}

/// A write whose append was under way as the device failed, and that lands in the cache
/// after: the volume holds dirty data the datastore lacks, so it must not go on uncached
/// (that write would be lost without a word), and the writes stalled meanwhile stop waiting,
/// whether the daemon tries to send the volume on uncached (`go`) or not. The late write
/// itself fails: in `wb` without peers it is nowhere a restart or a destage could take it
/// from.
async fn a_late_write(go: bool) {
    let (tx, vol, late, write) = a_write_held_across_the_failure().await;
    let ran = Arc::new(std::sync::Mutex::new(None));
    let going = go.then(|| {
        let (v, hook) = (vol.clone(), recording_hook(&ran));
        tokio::spawn(async move { v.go_uncached_with_nothing_lost(hook).await })
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    tx.send(()).unwrap();
    within(late, "the late write").await.unwrap_err();
    if let Some(going) = going {
        assert!(
            !within(going, "going uncached").await.unwrap(),
            "went uncached over a write only the failed cache holds"
        );
    }
    assert!(ran.lock().unwrap().is_none(), "the hook ran");
    assert!(!vol.stalled());
    // The stalled write stops waiting, and fails: the volume lost data.
    within(write, "the stalled write").await.unwrap_err();
}

/// An IO in flight that does not end keeps the volume paused for a moment only: the try
/// fails and changes nothing, reads go on, and a later try sees what that IO did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_try_to_go_uncached_does_not_wait_for_io_that_does_not_end() {
    let (tx, vol, late, write) = a_write_held_across_the_failure().await;
    let ran = Arc::new(std::sync::Mutex::new(None));
    let e = tokio::time::timeout(
        Duration::from_secs(5),
        vol.go_uncached_with_nothing_lost(recording_hook(&ran)),
    )
    .await
    .expect("the try waited for the held write")
    .unwrap_err();
    assert!(e.to_string().contains("did not end"), "{e}");
    assert!(ran.lock().unwrap().is_none(), "the hook ran");
    let got = tokio::time::timeout(Duration::from_secs(5), vol.read(0, BLOCK as u32))
        .await
        .expect("a read waited after the try")
        .unwrap();
    assert!(got[..] == [0x41; BLOCK]);
    tx.send(()).unwrap();
    within(late, "the late write").await.unwrap_err();
    assert!(!vol
        .go_uncached_with_nothing_lost(recording_hook(&ran))
        .await
        .unwrap());
    within(write, "the stalled write").await.unwrap_err();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_that_completes_in_the_failing_cache_keeps_the_volume_from_going_uncached() {
    a_late_write(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_that_completes_in_the_failing_cache_ends_the_stall() {
    a_late_write(false).await;
}

/// Fails the device, and has the log notice at once (the daemon probes it every second).
fn fail(cache: &SimDevice, host: &CacheHost) {
    cache.fail();
    assert!(host.log().probe().is_err());
}

/// A hook that fails, as a vault write does when the coordinator is down.
fn failing_hook() -> engine::SwitchHook {
    Box::new(|_, _| Box::pin(async { Err("the coordinator is down".to_string()) }))
}

/// The operator accepts the loss of a `wb` volume's dirty data after its cache device failed
/// (`vesta volume accept-loss`): the hook gets the next generation, the volume goes on
/// uncached, reads show what the datastore holds (the destaged block, and the older data
/// under the lost one), and writes go to the datastore. Before that, nothing changes while
/// the device works, and a failed hook changes nothing either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wb_volume_whose_loss_is_accepted_goes_on_uncached_from_the_datastore() {
    let cache = Arc::new(SimDevice::new((1 << 20) + 16 * SEG));
    let (store, vol, host) = wb_volume(cache.clone(), true).await;
    vol.write(0, Bytes::from(vec![0x51; BLOCK]), false)
        .await
        .unwrap();
    vol.write(2 * BLOCK as u64, Bytes::from(vec![0x52; BLOCK]), false)
        .await
        .unwrap();
    let c = vol.cache().unwrap();
    let (gen, checkpoint) = (c.gen(), c.checkpoint());

    // The device works: there is no loss to accept.
    let ran = Arc::new(std::sync::Mutex::new(None));
    let e = vol.accept_loss(recording_hook(&ran)).await.unwrap_err();
    assert!(e.to_string().contains("cache device works"), "{e}");
    assert!(vol.loss().is_err());
    assert!(ran.lock().unwrap().is_none(), "the hook ran");
    assert_eq!(vol.policy(), Policy::Wb);

    fail(&cache, &host);
    let lost = vol.loss().unwrap();
    assert_eq!((lost.dirty_bytes, lost.dirty_writes), (2 * BLOCK as u64, 2));
    assert_eq!(lost.checkpoint, checkpoint);

    // A hook that fails changes nothing: the volume still fails its writes in the cache.
    let e = vol.accept_loss(failing_hook()).await.unwrap_err();
    assert!(e.to_string().contains("record the loss"), "{e}");
    assert_eq!(vol.policy(), Policy::Wb);
    assert!(vol
        .write(4 * BLOCK as u64, Bytes::from(vec![0x53; BLOCK]), false)
        .await
        .is_err());

    let dropped = vol.accept_loss(recording_hook(&ran)).await.unwrap();
    assert_eq!(dropped, lost);
    assert_eq!(
        *ran.lock().unwrap(),
        Some((gen + 1, checkpoint)),
        "the hook did not get the next generation and the checkpoint"
    );
    assert_eq!(vol.policy(), Policy::Uncached);
    assert!(vol.cache().is_none());
    assert!(vol.loss().is_err(), "a loss to accept twice");
    // What the datastore holds: the destaged block, and zeroes under the lost ones.
    let got = vol.read(0, 3 * BLOCK as u32).await.unwrap();
    assert!(got[..BLOCK] == [0x41; BLOCK], "the destaged block");
    assert!(got[BLOCK..].iter().all(|b| *b == 0), "lost blocks");
    vol.write(2 * BLOCK as u64, Bytes::from(vec![0x54; BLOCK]), true)
        .await
        .unwrap();
    vol.flush().await.unwrap();
    assert!(store.image()[2 * BLOCK..3 * BLOCK] == [0x54; BLOCK]);
    // The cache no longer knows the volume: its destager sends nothing more.
    assert!(!host.destage_turn(0).await);
    assert!(store.image()[..BLOCK] == [0x41; BLOCK]);
}

/// A `wbp` volume whose hand-off no peer can finish: the operator accepts the loss, and the
/// IO stalled meanwhile goes on uncached instead of failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_accepted_loss_ends_a_stalled_hand_off() {
    let (_cache, store, vol) = failed_under_wbp().await;
    let (write, read, flush) = io(&vol);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!write.is_finished() && !read.is_finished() && !flush.is_finished());
    let ran = Arc::new(std::sync::Mutex::new(None));
    let dropped = tokio::time::timeout(
        Duration::from_secs(5),
        vol.accept_loss(recording_hook(&ran)),
    )
    .await
    .expect("accepting the loss waited for the stalled IO")
    .unwrap();
    assert_eq!(dropped.dirty_writes, 1);
    assert!(ran.lock().unwrap().is_some());
    within(write, "the write").await.unwrap();
    let got = within(read, "the read").await.unwrap();
    assert!(
        got.iter().all(|b| *b == 0),
        "the lost block reads as the datastore has it"
    );
    within(flush, "the flush").await.unwrap();
    assert!(store.image()[BLOCK..2 * BLOCK] == [0x42; BLOCK]);
    assert!(store.image()[..BLOCK].iter().all(|b| *b == 0));
}

/// A window the destager was writing when the device failed must not land on the datastore
/// after a write the volume makes uncached once the loss is accepted: that would take the
/// block back to older data with no error anywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_accepted_loss_waits_for_the_window_in_flight() {
    let cache = Arc::new(SimDevice::new((1 << 20) + 16 * SEG));
    let (store, vol, host) = wb_volume(cache.clone(), false).await;
    store.set_write_delay(Some(Duration::from_millis(800)));
    let destaging = {
        let host = host.clone();
        tokio::spawn(async move { host.destage_turn(0).await })
    };
    // The window's write of block 0 (0x41) is on its way to the datastore.
    tokio::time::sleep(Duration::from_millis(200)).await;
    fail(&cache, &host);
    let ran = Arc::new(std::sync::Mutex::new(None));
    vol.accept_loss(recording_hook(&ran)).await.unwrap();
    store.set_write_delay(None);
    vol.write(0, Bytes::from(vec![0x43; BLOCK]), true)
        .await
        .unwrap();
    within(destaging, "the destage turn").await;
    assert!(
        store.image()[..BLOCK] == [0x43; BLOCK],
        "the destager's older write landed over the uncached one"
    );
}

/// The same with the datastore not answering the window's writes at all: accepting the loss
/// fails after its wait (10 s) and changes nothing, instead of holding the operator's command
/// for ever; once the datastore answers, it goes through, and the window's older write does
/// not land over the uncached one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_accepted_loss_gives_up_on_a_window_the_datastore_holds() {
    let cache = Arc::new(SimDevice::new((1 << 20) + 16 * SEG));
    let (store, vol, host) = wb_volume(cache.clone(), false).await;
    store.hold_writes_after(Some(0));
    let destaging = {
        let host = host.clone();
        tokio::spawn(async move { host.destage_turn(0).await })
    };
    for _ in 0..10_000 {
        if store.writes_held() > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(
        store.writes_held() > 0,
        "the window's write never reached the datastore"
    );
    fail(&cache, &host);
    let ran = Arc::new(std::sync::Mutex::new(None));
    let t0 = std::time::Instant::now();
    let e = tokio::time::timeout(
        Duration::from_secs(30),
        vol.accept_loss(recording_hook(&ran)),
    )
    .await
    .expect("accepting the loss waited for the datastore past its limit")
    .unwrap_err();
    assert!(e.to_string().contains("did not end within"), "{e}");
    assert!(t0.elapsed() >= Duration::from_secs(9), "it gave up early");
    assert!(ran.lock().unwrap().is_none(), "the hook ran");
    assert!(vol.loss().is_ok(), "the loss is no longer there to accept");
    assert_eq!(vol.policy(), Policy::Wb);
    store.hold_writes_after(None);
    vol.accept_loss(recording_hook(&ran)).await.unwrap();
    vol.write(0, Bytes::from(vec![0x43; BLOCK]), true)
        .await
        .unwrap();
    within(destaging, "the destage turn").await;
    assert!(
        store.image()[..BLOCK] == [0x43; BLOCK],
        "the destager's older write landed over the uncached one"
    );
}

/// Peers that fail every write and flush, and cannot be taken out of the vault (the
/// coordinator is down, or the daemon no longer writes the vault: it handed the volume off).
struct Unexcludable;

impl engine::replica::Replicator for Unexcludable {
    fn write(
        &self,
        _w: engine::replica::ReplicaWrite,
    ) -> engine::replica::BoxFuture<Result<(), String>> {
        Box::pin(async { Err("link to peer b broken".to_string()) })
    }
    fn flush(&self) -> engine::replica::BoxFuture<Result<(), String>> {
        Box::pin(async { Err("link to peer b broken".to_string()) })
    }
    fn checkpoint(&self, _gen: u64, _ser: u64) {}
    fn exclude_failed(&self) -> engine::replica::BoxFuture<Result<(), String>> {
        Box::pin(async { Err("the vault cannot be written".to_string()) })
    }
    fn hand_off(&self) -> engine::replica::BoxFuture<Result<(), String>> {
        Box::pin(async { Ok(()) })
    }
    fn healthy(&self) -> bool {
        false
    }
    fn report(&self) -> Vec<engine::replica::PeerReport> {
        Vec::new()
    }
}

/// A write whose peer failed waits until that peer is out of the vault. If the cache device
/// fails meanwhile, that wait must end: the write never completed, and it goes on as IO on a
/// failed device does (it stalls outside the volume for the hand-off). Waiting inside, it
/// would hold the volume's IO slot forever, and neither a pause (accept-loss) nor a revoke
/// (delete) could ever quiesce the volume.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_waiting_to_exclude_a_peer_ends_when_the_cache_device_fails() {
    let cache = Arc::new(SimDevice::new((1 << 20) + 16 * SEG));
    let store = Arc::new(MemDevice::new(VOL));
    let (host, vol) = common::open(cache.clone(), &store, Uuid::new_v4(), Policy::Wb);
    let vol = Arc::new(vol);
    vol.set_policy_with(WBP, Some(Arc::new(Unexcludable)), None)
        .await
        .unwrap();
    let v = vol.clone();
    let write =
        tokio::spawn(async move { v.write(0, Bytes::from(vec![0x61; BLOCK]), false).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !write.is_finished(),
        "the write completed with its peer not excluded"
    );
    fail(&cache, &host);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert!(
        vol.revoke(Duration::from_secs(2)).await,
        "the write waiting to exclude its peer kept the volume from draining"
    );
    assert!(matches!(
        within(write, "the write").await,
        Err(Error::Revoked)
    ));
    assert!(store.image().iter().all(|b| *b == 0));
}

/// A delete that fails undoes its revoke, and the destager goes on only if it ran before:
/// a volume handed off to its peers (its destager stopped, a peer's replay maybe writing
/// the datastore) must not start destaging again because a delete of it failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undone_revoke_leaves_a_stopped_destager_stopped() {
    let cache = Arc::new(SimDevice::new((1 << 20) + 16 * SEG));
    let store = Arc::new(MemDevice::new(VOL));
    let (host, vol) = common::open(cache, &store, Uuid::new_v4(), Policy::Wb);
    vol.write(0, Bytes::from(vec![0x5a; BLOCK]), false)
        .await
        .unwrap();
    let c = vol.cache().expect("cached");
    vol.stop_destaging().await;
    assert!(vol.revoke(Duration::from_secs(1)).await);
    vol.unrevoke(false);
    assert!(vol.destaging_stopped());
    for turn in 0..20 {
        host.destage_turn(turn).await;
    }
    assert!(
        store.image()[..BLOCK].iter().all(|b| *b == 0),
        "a stopped destager wrote the datastore after an undone revoke"
    );
    // One that ran before goes on.
    assert!(vol.revoke(Duration::from_secs(1)).await);
    vol.unrevoke(true);
    assert!(!vol.destaging_stopped());
    common::destage_all(&host, &c).await;
    assert!(store.image()[..BLOCK] == [0x5a; BLOCK]);
}
