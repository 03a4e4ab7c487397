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

/// The host's destager, running until the test aborts it.
fn destager(host: &Arc<CacheHost>) -> tokio::task::JoinHandle<()> {
    let h = host.clone();
    tokio::spawn(async move { h.run_destager(|| false).await })
}

/// Waits for `tasks`, failing with `what` if they take longer than `secs`.
async fn join_within(tasks: Vec<tokio::task::JoinHandle<()>>, secs: u64, what: &str) {
    tokio::time::timeout(Duration::from_secs(secs), async {
        for t in tasks {
            t.await.unwrap();
        }
    })
    .await
    .expect(what);
}

/// Waits until the volume has nothing dirty, at most `secs`.
async fn wait_clean(c: &engine::cache::VolCache, secs: u64) {
    tokio::time::timeout(Duration::from_secs(secs), async {
        while !c.clean() {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await
    .expect("the destager never caught up");
}

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
    let destager = destager(&host);
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
    wait_clean(&c, 120).await;
    let got = b.read(0, VOL as u32).await.unwrap();
    assert!(
        got[..] == store_b.image()[..],
        "the datastore differs from the volume"
    );
    assert!(c.report().degraded.is_none(), "{:?}", c.report().degraded);
    destager.abort();
}

/// A log full of clean data makes room for a write at once: the segments it evicts are
/// reusable after one sync, which the write does itself rather than wait for the destager's.
/// (It waited for a timeout per segment before: `wb` took 1 MiB sequential writes at 68 MiB/s
/// on the default 1 GiB cache, against 400 MiB/s after.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_full_of_clean_data_takes_writes_without_waiting() {
    let cache = Arc::new(SimDevice::new((1 << 20) + 12 * SEG));
    let host = CacheHost::open(cache, SEG).unwrap();
    let store = Arc::new(MemDevice::new(VOL));
    let extent = Extent::new(store.clone(), 0, VOL, Arc::new(Gate::new(4)));
    let v = Volume::open(
        Uuid::new_v4(),
        "v".into(),
        Policy::Wb,
        Tuning::default(),
        extent,
        Some(host.clone()),
    )
    .unwrap();
    host.finish_recovery(&[]).unwrap();
    let destager = destager(&host);
    let c = v.cache().unwrap();
    // Each write takes five segments (four segments' worth of data, and headers), so it
    // needs more than the log has free: from the second round of the log on, most segments it
    // gets are ones it evicted itself.
    const W: u64 = 4 * SEG;
    const N: u64 = VOL / W * 3;
    for i in 0..N {
        let data = Bytes::from(vec![i as u8 + 1; W as usize]);
        v.write(i * W % VOL, data, false).await.unwrap();
        wait_clean(&c, 30).await;
    }
    let r = c.report();
    assert_eq!(
        r.space_waits, 0,
        "writes waited for space in a log holding nothing dirty"
    );
    assert!(r.used_bytes > 0);
    // The last round is what the volume and the datastore hold.
    let last = |at: u64| (N - VOL / W + at / W) as u8 + 1;
    let got = v.read(0, VOL as u32).await.unwrap();
    let image = store.image();
    for at in (0..VOL).step_by(W as usize) {
        let r = at as usize..(at + W) as usize;
        assert!(
            got[r.clone()].iter().all(|b| *b == last(at)),
            "{at} reads back wrong"
        );
        assert!(
            image[r].iter().all(|b| *b == last(at)),
            "{at} is wrong on the datastore"
        );
    }
    destager.abort();
}

/// Concurrent writes that each need several segments (together about half the log), on a
/// log full of clean data, all complete and read back. When every writer waits for space, no
/// append is left to trigger the sync that makes freed segments reusable; the writers make
/// it themselves. (`bench/seqwrite.sh` hung once that way before they did; this test
/// has not reproduced that hang, the destager's syncs got there first, but keeps the case.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_large_writes_on_a_full_log_never_wait_on_each_other() {
    let cache = Arc::new(SimDevice::new((1 << 20) + 24 * SEG));
    let host = CacheHost::open(cache, SEG).unwrap();
    let store = Arc::new(MemDevice::new(VOL));
    let extent = Extent::new(store.clone(), 0, VOL, Arc::new(Gate::new(4)));
    let v = Arc::new(
        Volume::open(
            Uuid::new_v4(),
            "v".into(),
            Policy::Wb,
            Tuning::default(),
            extent,
            Some(host.clone()),
        )
        .unwrap(),
    );
    host.finish_recovery(&[]).unwrap();
    let destager = destager(&host);
    let c = v.cache().unwrap();
    const W: u64 = 2 * SEG;
    for round in 0..8u64 {
        let writes: Vec<_> = (0..4u64)
            .map(|w| {
                let v = v.clone();
                tokio::spawn(async move {
                    let data = Bytes::from(vec![(round * 4 + w + 1) as u8; W as usize]);
                    v.write(w * W, data, false).await.unwrap();
                })
            })
            .collect();
        tokio::time::timeout(Duration::from_secs(30), async {
            for t in writes {
                t.await.unwrap();
            }
        })
        .await
        .unwrap_or_else(|_| panic!("round {round}: writes hung on a log full of clean data"));
        wait_clean(&c, 30).await;
    }
    let got = v.read(0, (4 * W) as u32).await.unwrap();
    for w in 0..4u64 {
        let r = (w * W) as usize..((w + 1) * W) as usize;
        assert!(got[r.clone()].iter().all(|b| *b == (7 * 4 + w + 1) as u8));
        assert!(store.image()[r].iter().all(|b| *b == (7 * 4 + w + 1) as u8));
    }
    destager.abort();
}

/// More multi-part writes in flight than the log has room for wait at admission instead
/// of each appending some parts and waiting, with them pinned, for space only the others'
/// completion could free (they waited for each other forever before: 64 writes of 1 MiB on a
/// 64 MiB cache did, and so did this test).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_large_writes_in_flight_than_the_log_holds_never_deadlock() {
    // Twelve segments of 64 KiB; each write takes eight 16 KiB parts over three segments.
    let cache = Arc::new(SimDevice::new((1 << 20) + 12 * SEG));
    let host = CacheHost::open(cache, SEG).unwrap();
    let store = Arc::new(MemDevice::new(VOL));
    let extent = Extent::new(store.clone(), 0, VOL, Arc::new(Gate::new(4)));
    let v = Arc::new(
        Volume::open(
            Uuid::new_v4(),
            "v".into(),
            Policy::Wb,
            Tuning::default(),
            extent,
            Some(host.clone()),
        )
        .unwrap(),
    );
    host.finish_recovery(&[]).unwrap();
    let destager = destager(&host);
    const W: u64 = 2 * SEG;
    const WRITERS: u64 = 8;
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let v = v.clone();
            tokio::spawn(async move {
                for round in 0..16u64 {
                    let data = Bytes::from(vec![(round * WRITERS + w + 1) as u8; W as usize]);
                    v.write(w * W, data, false).await.unwrap();
                }
            })
        })
        .collect();
    join_within(writers, 60, "large writes deadlocked on a small log").await;
    let c = v.cache().unwrap();
    wait_clean(&c, 30).await;
    let got = v.read(0, (WRITERS * W) as u32).await.unwrap();
    let image = store.image();
    for w in 0..WRITERS {
        let want = (15 * WRITERS + w + 1) as u8;
        let r = (w * W) as usize..((w + 1) * W) as usize;
        assert!(
            got[r.clone()].iter().all(|b| *b == want),
            "writer {w} reads back wrong"
        );
        assert!(
            image[r].iter().all(|b| *b == want),
            "writer {w} is wrong on the datastore"
        );
    }
    assert!(c.report().degraded.is_none());
    destager.abort();
}

/// A peer's replicas of another host's volume take a share of its log like one of its own
/// volumes, and no more: an owner that does not checkpoint (a long hold, a stuck datastore)
/// gets its replica writes refused (and drops this peer) instead of filling the log under
/// this host's own volumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peers_replicas_keep_to_their_share_and_its_own_volume_keeps_writing() {
    // Sixteen segments: a share of eight for the host's volume and eight for the replicas.
    let cache = Arc::new(SimDevice::new((1 << 20) + 16 * SEG));
    let host = CacheHost::open(cache, SEG).unwrap();
    let store = Arc::new(MemDevice::new(VOL));
    let extent = Extent::new(store.clone(), 0, VOL, Arc::new(Gate::new(4)));
    let own = Volume::open(
        Uuid::new_v4(),
        "own".into(),
        Policy::Wb,
        Tuning::default(),
        extent,
        Some(host.clone()),
    )
    .unwrap();
    host.finish_recovery(&[]).unwrap();
    let destager = destager(&host);
    let other = Uuid::new_v4();
    host.replica_open("owner", other, 1, 0).unwrap();
    // The owner never checkpoints: its writes come until this host refuses one.
    const W: u64 = 16 << 10;
    let h = host.clone();
    let (taken, refusal) = tokio::task::spawn_blocking(move || {
        let data = vec![0x5a; W as usize];
        for ser in 1..=256u64 {
            if let Err(e) =
                h.replica_write(other, 1, ser, (ser - 1) * W % VOL, W, Some(&data), false)
            {
                return (ser - 1, format!("{e:?}"));
            }
        }
        (256, String::new())
    })
    .await
    .unwrap();
    assert!(
        refusal.contains("share of this host's cache"),
        "{taken} replica writes taken, then: {refusal:?}"
    );
    // Eight segments' worth at most (their headers take some of it), and one write over.
    assert!(
        taken * W <= 8 * SEG + W,
        "the replicas took {taken} writes of {W} bytes, over their share of 8 segments"
    );
    // Asked not to wait, the next write says at once that it would have to, and takes
    // nothing (the peer's reading thread asks so, and queues the write if it must wait).
    // (One record: a write of several is never taken at once, see below.)
    let again = vec![2u8; 4096];
    assert_eq!(
        host.replica_write_at_once(other, 1, taken + 1, 0, 4096, Some(&again), false),
        Ok(false)
    );
    assert_eq!(host.replica_held(other, 1, 0), Ok(taken));
    // The host's own volume still has its share.
    let mut expect = vec![0u8; VOL as usize];
    let writes = async {
        for i in 0..16u64 {
            let data = vec![i as u8 + 1; W as usize];
            own.write(i * W, Bytes::from(data.clone()), i % 4 == 3)
                .await
                .unwrap();
            expect[(i * W) as usize..((i + 1) * W) as usize].copy_from_slice(&data);
        }
    };
    tokio::time::timeout(Duration::from_secs(60), writes)
        .await
        .expect("the host's own volume could not write beside the replicas");
    assert!(own.read(0, VOL as u32).await.unwrap()[..] == expect[..]);
    // A checkpoint frees the replicas' space: writes are taken again.
    host.replica_checkpoint(other, 1, taken).unwrap();
    assert_eq!(
        host.replica_write_at_once(other, 1, taken + 1, 0, 4096, Some(&again), false),
        Ok(true)
    );
    assert_eq!(host.replica_held(other, 1, 0), Ok(taken + 1));
    // A write of several records is never taken at once: once its first record is in, the
    // rest could wait for space only a checkpoint frees.
    let big = vec![3u8; 4 * SEG as usize];
    assert_eq!(
        host.replica_write_at_once(other, 1, taken + 2, 0, big.len() as u64, Some(&big), false),
        Ok(false)
    );
    assert_eq!(host.replica_held(other, 1, 0), Ok(taken + 1));
    let h = host.clone();
    tokio::task::spawn_blocking(move || {
        h.replica_write(
            other,
            1,
            taken + 2,
            0,
            W,
            Some(&vec![1u8; W as usize]),
            false,
        )
    })
    .await
    .unwrap()
    .expect("a replica write after the checkpoint");
    destager.abort();
}

/// A generation's replicas that are dropped as stale (the owner moved on, or another host
/// replayed them) give their share of the cache back: the next generation's writes are taken
/// as after a checkpoint. Each generation here writes half the replicas' share of eight
/// segments and more than a third of it (with their headers).
#[test]
fn a_dropped_generations_replicas_give_their_share_back() {
    let cache = Arc::new(SimDevice::new((1 << 20) + 16 * SEG));
    let host = CacheHost::open(cache, SEG).unwrap();
    host.finish_recovery(&[]).unwrap();
    let other = Uuid::new_v4();
    const W: u64 = 16 << 10;
    const N: u64 = 4 * SEG / W;
    let data = vec![0x5a; W as usize];
    let fill = |gen: u64, first: u64| {
        for ser in first..first + N {
            host.replica_write(other, gen, ser, (ser % N) * W, W, Some(&data), false)
                .unwrap_or_else(|e| {
                    panic!(
                        "write {} of generation {gen} refused: {e:?}",
                        ser - first + 1
                    )
                });
        }
    };
    host.replica_open("owner", other, 1, 0).unwrap();
    fill(1, 1);
    assert_eq!(host.replica_sets()[0].writes, N);
    host.replica_drop(other, 1).unwrap();
    assert!(host.replica_sets().is_empty());
    host.replica_open("owner", other, 2, N).unwrap();
    fill(2, N + 1);
    fill(2, 2 * N + 1);
}

/// A `wb` volume of [`VOL`] bytes on `store` (queue depth 4), cached on `host`.
fn wb_volume(host: &Arc<CacheHost>, store: &Arc<MemDevice>, tuning: Tuning) -> Arc<Volume> {
    let extent = Extent::new(store.clone(), 0, VOL, Arc::new(Gate::new(4)));
    Arc::new(
        Volume::open(
            Uuid::new_v4(),
            "v".into(),
            Policy::Wb,
            tuning,
            extent,
            Some(host.clone()),
        )
        .unwrap(),
    )
}

/// A held volume whose writers stall for room sends its held window at once. A write large
/// against the volume's share stalls while the dirty data alone is still under the
/// flow-control trigger that releases a held window (admission counts the log space the
/// write itself will take, and a segment more for its parts): such writes waited out the
/// whole hold time (here 600 s) before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_writers_release_a_held_window() {
    // 64 segments: a 4 MiB share, stalling at about 2.8 MiB of dirty and reserved log, and
    // a held window due by pressure at 2 MiB of dirty data. A 1.5 MiB write reserves about
    // 1.6 MiB, so the second one stalls with 1.5 MiB dirty.
    let cache = Arc::new(SimDevice::new((1 << 20) + 64 * SEG));
    let host = CacheHost::open(cache, SEG).unwrap();
    let store = Arc::new(MemDevice::new(VOL));
    let held = Tuning {
        hold_s: Some(600.0),
        max_dirty_age_s: Some(600.0),
        rpo_s: None,
    };
    let v = wb_volume(&host, &store, held);
    host.finish_recovery(&[]).unwrap();
    let destager = destager(&host);
    const W: u64 = 1536 << 10;
    const WRITERS: u64 = 2;
    const ROUNDS: u64 = 3;
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let v = v.clone();
            tokio::spawn(async move {
                for round in 0..ROUNDS {
                    let data = Bytes::from(vec![(round * WRITERS + w + 1) as u8; W as usize]);
                    v.write(w * W, data, false).await.unwrap();
                }
            })
        })
        .collect();
    join_within(writers, 30, "stalled writers waited for the hold time").await;
    let c = v.cache().unwrap();
    assert!(c.report().stalls > 0, "the writes never stalled: no test");
    let got = v.read(0, (WRITERS * W) as u32).await.unwrap();
    for w in 0..WRITERS {
        let r = (w * W) as usize..((w + 1) * W) as usize;
        let last = ((ROUNDS - 1) * WRITERS + w + 1) as u8;
        assert!(
            got[r].iter().all(|b| *b == last),
            "writer {w} reads back wrong"
        );
    }
    destager.abort();
}

/// A TRIM of the whole volume, far more than the volume's share of the log, is admitted
/// while small writes keep coming: it takes one record, and is admitted as one. (It was
/// counted as its length in data and waited until nothing at all was dirty or in flight.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_trim_is_admitted_among_steady_writes() {
    let cache = Arc::new(SimDevice::new((1 << 20) + 12 * SEG));
    let host = CacheHost::open(cache, SEG).unwrap();
    let store = Arc::new(MemDevice::new(VOL));
    store.set_write_delay(Some(Duration::from_millis(1)));
    let v = wb_volume(&host, &store, Tuning::default());
    host.finish_recovery(&[]).unwrap();
    let destager = destager(&host);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writers: Vec<_> = (0..4u64)
        .map(|w| {
            let (v, stop) = (v.clone(), stop.clone());
            tokio::spawn(async move {
                let mut i = 0u64;
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    let block = (i * 4 + w) % (VOL / 4096);
                    v.write(block * 4096, Bytes::from(vec![w as u8 + 1; 4096]), false)
                        .await
                        .unwrap();
                    i += 1;
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let trimmed =
        tokio::time::timeout(Duration::from_secs(20), v.write_zeroes(0, VOL, true, false)).await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    for t in writers {
        t.await.unwrap();
    }
    trimmed
        .expect("the TRIM was never admitted while writes went on")
        .unwrap();
    // Whatever the order, the datastore ends equal to the volume.
    let c = v.cache().unwrap();
    wait_clean(&c, 60).await;
    let got = v.read(0, VOL as u32).await.unwrap();
    assert!(
        got[..] == store.image()[..],
        "the datastore differs from the volume"
    );
    destager.abort();
}

/// Recovery frees everything of a volume deleted while its records were in the log: the
/// segment the log opened at recovery to carry its checkpoint and policy was kept forever
/// before, one more for every deleted volume.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovery_frees_the_segments_of_a_deleted_volume() {
    let cache = Arc::new(SimDevice::new((1 << 20) + 12 * SEG));
    let (id, free_before) = {
        let host = CacheHost::open(cache.clone(), SEG).unwrap();
        let free = host.log().free_segments();
        let store = Arc::new(MemDevice::new(VOL));
        let v = wb_volume(&host, &store, Tuning::default());
        host.finish_recovery(&[]).unwrap();
        for i in 0..8u64 {
            v.write(i * 4096, Bytes::from(vec![9u8; 4096]), true)
                .await
                .unwrap();
        }
        (v.id(), free)
        // The host stops here without detaching the volume (a crash); the volume is then
        // deleted while the host is down.
    };
    for restart in 0..2 {
        let host = CacheHost::open(cache.clone(), SEG).unwrap();
        host.finish_recovery(&[]).unwrap();
        assert_eq!(
            host.log().segments_of(id),
            0,
            "restart {restart}: the deleted volume still holds segments"
        );
        assert_eq!(host.log().free_segments(), free_before, "restart {restart}");
    }
}

/// Many volumes, each writing writes of several segments at once: every volume's share is
/// floored at two segments, and a write larger than its volume's stall limit is admitted
/// alone on its volume, so together the writes in flight need more of the log than it has.
/// They take turns for it instead of each appending some parts and waiting, with them
/// pinned, for space only the others could free (six volumes' writes of about seven
/// segments each, on a log of 24, hung every writer before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_volumes_writing_large_writes_on_a_small_log_never_deadlock() {
    let cache = Arc::new(SimDevice::new((1 << 20) + 24 * SEG));
    let host = CacheHost::open(cache, SEG).unwrap();
    const VOLS: usize = 6;
    const W: u64 = 6 * SEG;
    let stores: Vec<Arc<MemDevice>> = (0..VOLS).map(|_| Arc::new(MemDevice::new(VOL))).collect();
    let vols: Vec<Arc<Volume>> = stores
        .iter()
        .map(|s| wb_volume(&host, s, Tuning::default()))
        .collect();
    host.finish_recovery(&[]).unwrap();
    let destager = destager(&host);
    let writers: Vec<_> = vols
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let v = v.clone();
            tokio::spawn(async move {
                for round in 0..6u64 {
                    let data = Bytes::from(vec![(round * 16 + i as u64 + 1) as u8; W as usize]);
                    v.write((round % 2) * W, data, false).await.unwrap();
                }
            })
        })
        .collect();
    join_within(
        writers,
        60,
        "writes of many volumes deadlocked on a small log",
    )
    .await;
    for (i, (v, store)) in vols.iter().zip(&stores).enumerate() {
        let got = v.read(0, (2 * W) as u32).await.unwrap();
        assert!(got[..W as usize]
            .iter()
            .all(|b| *b == (4 * 16 + i + 1) as u8));
        assert!(got[W as usize..]
            .iter()
            .all(|b| *b == (5 * 16 + i + 1) as u8));
        let c = v.cache().unwrap();
        wait_clean(&c, 30).await;
        assert!(
            store.image()[..(2 * W) as usize] == got[..],
            "volume {i}'s datastore"
        );
    }
    destager.abort();
}

/// A write that the log could not hold even alone (more volumes than it has room for, each
/// keeping a segment) fails at once with an error that says so, and small writes go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_larger_than_the_log_can_give_fails_clearly_and_small_ones_go_on() {
    let cache = Arc::new(SimDevice::new((1 << 20) + 12 * SEG));
    let host = CacheHost::open(cache, SEG).unwrap();
    let stores: Vec<Arc<MemDevice>> = (0..10).map(|_| Arc::new(MemDevice::new(VOL))).collect();
    let vols: Vec<Arc<Volume>> = stores
        .iter()
        .map(|s| wb_volume(&host, s, Tuning::default()))
        .collect();
    host.finish_recovery(&[]).unwrap();
    let destager = destager(&host);
    // Each volume writes once, and keeps the segment it wrote to as its current one.
    for (i, v) in vols.iter().enumerate() {
        v.write(8192, Bytes::from(vec![i as u8 + 1; 4096]), true)
            .await
            .unwrap();
    }
    let big = tokio::time::timeout(
        Duration::from_secs(10),
        vols[0].write(0, Bytes::from(vec![1u8; (2 * SEG) as usize]), false),
    )
    .await
    .expect("a write too large for the log hung");
    let e = big.expect_err("ten volumes on twelve segments cannot take a 128 KiB write");
    assert!(e.to_string().contains("make the cache larger"), "{e}");
    // In wt the same write goes to the datastore, its cache copy given up for want of room:
    // write-through never fails on the cache's account.
    let store = Arc::new(MemDevice::new(VOL));
    let wt = Volume::open(
        Uuid::new_v4(),
        "wt".into(),
        Policy::Wt,
        Tuning::default(),
        Extent::new(store.clone(), 0, VOL, Arc::new(Gate::new(4))),
        Some(host.clone()),
    )
    .unwrap();
    tokio::time::timeout(
        Duration::from_secs(10),
        wt.write(0, Bytes::from(vec![7u8; (2 * SEG) as usize]), false),
    )
    .await
    .expect("a wt write hung")
    .expect("a wt write failed for want of cache room");
    assert!(store.image()[..(2 * SEG) as usize].iter().all(|b| *b == 7));
    for (i, v) in vols.iter().enumerate() {
        tokio::time::timeout(
            Duration::from_secs(10),
            v.write(4096, Bytes::from(vec![i as u8 + 1; 4096]), true),
        )
        .await
        .expect("a small write hung")
        .unwrap();
        let got = v.read(0, 8192).await.unwrap();
        assert!(
            got[..4096].iter().all(|b| *b == 0),
            "the failed write left data"
        );
        assert!(got[4096..].iter().all(|b| *b == i as u8 + 1));
    }
    destager.abort();
}

/// Two volumes each writing writes of more than half the log: each write alone fits, both at
/// once do not, and their parts must not wait for each other's space forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_volumes_writing_more_than_half_the_log_at_once_never_deadlock() {
    let cache = Arc::new(SimDevice::new((1 << 20) + 24 * SEG));
    let host = CacheHost::open(cache, SEG).unwrap();
    const W: u64 = 13 * SEG;
    let stores: Vec<Arc<MemDevice>> = (0..2).map(|_| Arc::new(MemDevice::new(VOL))).collect();
    let vols: Vec<Arc<Volume>> = stores
        .iter()
        .map(|s| wb_volume(&host, s, Tuning::default()))
        .collect();
    host.finish_recovery(&[]).unwrap();
    let destager = destager(&host);
    let writers: Vec<_> = vols
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let v = v.clone();
            tokio::spawn(async move {
                for round in 0..4u64 {
                    let data = Bytes::from(vec![(round * 16 + i as u64 + 1) as u8; W as usize]);
                    v.write(0, data, false).await.unwrap();
                }
            })
        })
        .collect();
    join_within(writers, 60, "two volumes' large writes deadlocked").await;
    for (i, v) in vols.iter().enumerate() {
        let got = v.read(0, W as u32).await.unwrap();
        assert!(got.iter().all(|b| *b == (3 * 16 + i + 1) as u8));
    }
    destager.abort();
}

/// A large write in flight on one volume, small writes of the same volume completing their
/// appends behind it (staged above its `ser`, so not destageable until it completes), and
/// another volume's large write, on a log a third volume's slow dirty data fills first: all
/// complete. The staged small writes keep their host budget until the large write before
/// them completes; released at staging, the budget could admit the other volume's write into
/// room they still hold, and both large writes would wait for room forever. (That
/// interleaving was found by reading the code; this test has not produced it either way.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_writes_and_small_ones_staged_behind_them_all_complete_on_a_full_log() {
    for round in 0..10u64 {
        let cache = Arc::new(SimDevice::new((1 << 20) + 24 * SEG));
        let host = CacheHost::open(cache, SEG).unwrap();
        let stores: Vec<Arc<MemDevice>> = (0..3).map(|_| Arc::new(MemDevice::new(VOL))).collect();
        stores[2].set_write_delay(Some(Duration::from_millis(20)));
        let (a, b, c) = (
            wb_volume(&host, &stores[0], Tuning::default()),
            wb_volume(&host, &stores[1], Tuning::default()),
            wb_volume(&host, &stores[2], Tuning::default()),
        );
        host.finish_recovery(&[]).unwrap();
        let destager = destager(&host);
        // c: as much dirty data as its share takes, slow to leave.
        for i in 0..12u64 {
            c.write(i * 32768, Bytes::from(vec![9u8; 32768]), false)
                .await
                .unwrap();
        }
        let mut tasks = Vec::new();
        {
            let b = b.clone();
            tasks.push(tokio::spawn(async move {
                b.write(0, Bytes::from(vec![1u8; (4 * SEG) as usize]), false)
                    .await
                    .unwrap();
            }));
        }
        // The small writes get their sers after the large one's.
        tokio::time::sleep(Duration::from_millis(2)).await;
        for i in 0..40u64 {
            let b = b.clone();
            tasks.push(tokio::spawn(async move {
                let at = (1 << 20) + i * 4096;
                b.write(at, Bytes::from(vec![2u8; 4096]), false)
                    .await
                    .unwrap();
            }));
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
        {
            let a = a.clone();
            tasks.push(tokio::spawn(async move {
                a.write(0, Bytes::from(vec![3u8; (10 * SEG) as usize]), false)
                    .await
                    .unwrap();
            }));
        }
        tokio::time::timeout(Duration::from_secs(30), async {
            for t in tasks {
                t.await.unwrap();
            }
        })
        .await
        .unwrap_or_else(|_| panic!("round {round}: the writes waited for room forever"));
        let got = a.read(0, (10 * SEG) as u32).await.unwrap();
        assert!(got.iter().all(|x| *x == 3));
        let got = b.read(0, (4 * SEG) as u32).await.unwrap();
        assert!(got.iter().all(|x| *x == 1));
        destager.abort();
    }
}

/// Eviction finds a segment's extents through the segment's own list of records, not by
/// searching the whole index. Random writes of every size and alignment (so records overlap,
/// and later writes cut earlier extents into pieces) and reads (whose fills are records too),
/// on `wt` and `wb` volumes sharing a log far smaller than they are: segments are evicted all
/// along, no eviction ever has to fall back to a search of the index, and every read returns
/// the volume's contents.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_finds_every_extent_through_the_segments_records() {
    let cache = Arc::new(SimDevice::new((1 << 20) + 16 * SEG));
    let host = CacheHost::open(cache, SEG).unwrap();
    let open = |policy: Policy, name: &str| {
        let store = Arc::new(MemDevice::new(VOL));
        let extent = Extent::new(store, 0, VOL, Arc::new(Gate::new(4)));
        Volume::open(
            Uuid::new_v4(),
            name.into(),
            policy,
            Tuning::default(),
            extent,
            Some(host.clone()),
        )
        .unwrap()
    };
    let vols = [open(Policy::Wt, "wt"), open(Policy::Wb, "wb")];
    host.finish_recovery(&[]).unwrap();
    let destager = destager(&host);
    let mut models = [vec![0u8; VOL as usize], vec![0u8; VOL as usize]];
    // splitmix64: a fixed sequence, so a failure repeats.
    let mut state = 0x5eed_u64;
    let mut next = move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    for i in 0..3000u64 {
        let which = (next() % 2) as usize;
        let (v, model) = (&vols[which], &mut models[which]);
        let sectors = 1 + next() % 64;
        let len = sectors * 512;
        let offset = next() % (VOL / 512 - sectors + 1) * 512;
        let r = offset as usize..(offset + len) as usize;
        if next() % 3 == 0 {
            let got = v.read(offset, len as u32).await.unwrap();
            assert!(
                got[..] == model[r],
                "op {i}: {len} bytes at {offset} read back wrong"
            );
        } else {
            let data: Vec<u8> = (0..len).map(|b| (i as u8) ^ (b as u8)).collect();
            model[r].copy_from_slice(&data);
            v.write(offset, Bytes::from(data), false).await.unwrap();
        }
    }
    for (v, model) in vols.iter().zip(&models) {
        let got = v.read(0, VOL as u32).await.unwrap();
        assert!(got[..] == model[..], "the volume reads back wrong");
        let r = v.cache().unwrap().report();
        assert!(r.evicted_segments > 0, "nothing was evicted: {r:?}");
        assert_eq!(
            r.eviction_scans, 0,
            "an eviction searched the whole index: {r:?}"
        );
    }
    destager.abort();
}
