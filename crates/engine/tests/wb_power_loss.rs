//! Write-back against power loss, as a property (DESIGN §2): random overlapping writes, FUA,
//! FLUSH, destager steps and power losses that keep, tear or drop each unsynced cache write.
//!
//! After every recovery the volume must read as the result of applying a prefix of the writes
//! issued, in issue order, and that prefix must hold every write that was durable (completed
//! with FUA, or completed before a completed FLUSH). And whenever the destager has recorded a
//! checkpoint, the datastore image must equal the volume as of that checkpoint.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use proptest::prelude::*;
use uuid::Uuid;

use cachelog::device::{Fate, SimDevice};
use cluster::{Policy, Tuning};
use datastore::device::MemDevice;
use datastore::{Extent, Gate};
use engine::cache::CacheHost;
use engine::Volume;

const SECTORS: u64 = 64;
const VOL: u64 = SECTORS * 512;
const SEG: u64 = 64 << 10;

#[derive(Debug, Clone)]
enum Op {
    Write {
        sector: u64,
        sectors: u64,
        fua: bool,
    },
    Zero {
        sector: u64,
        sectors: u64,
    },
    Flush,
    Destage,
    /// wb → uncached → wb: the volume leaves the cache and comes back (a new generation).
    Cycle,
    /// wb → uncached, writes straight to the datastore, then (if `crash`) a power loss and a
    /// restart uncached, then back to wb. Nothing the volume wrote in the cache may come
    /// back over the newer writes.
    Uncached {
        writes: Vec<(u64, u64)>,
        crash: Option<Vec<u8>>,
    },
    /// Switches between FVP's batch windows and SLIM's held windows (which coalesce
    /// overlapping writes).
    Hold(bool),
    /// A destage window whose datastore writes and FLUSH completed, and then the power failed:
    /// before its checkpoint (the most dangerous moment for the datastore image).
    CrashInDestage {
        fates: Vec<u8>,
    },
    PowerLoss {
        fates: Vec<u8>,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..SECTORS, 1..9u64, prop::bool::weighted(0.2)).prop_map(|(s, n, fua)| Op::Write {
            sector: s,
            sectors: n.min(SECTORS - s),
            fua
        }),
        // Writes of two and three records (a record carries at most 12 KiB in 64 KiB
        // segments), whose records a power loss can keep, tear or lose one by one.
        2 => (0..16u64, 25..=48u64, prop::bool::weighted(0.2)).prop_map(|(s, n, fua)| Op::Write {
            sector: s,
            sectors: n,
            fua
        }),
        1 => (0..SECTORS, 1..5u64).prop_map(|(s, n)| Op::Zero { sector: s, sectors: n.min(SECTORS - s) }),
        1 => Just(Op::Flush),
        2 => Just(Op::Destage),
        1 => proptest::collection::vec(0u8..3, 8).prop_map(|fates| Op::PowerLoss { fates }),
        1 => Just(Op::Cycle),
        1 => (
            proptest::collection::vec((0..SECTORS, 1..9u64), 0..4),
            proptest::option::weighted(0.7, proptest::collection::vec(0u8..3, 8)),
        )
            .prop_map(|(w, crash)| Op::Uncached {
                writes: w.into_iter().map(|(s, n)| (s, n.min(SECTORS - s))).collect(),
                crash,
            }),
        1 => any::<bool>().prop_map(Op::Hold),
        1 => proptest::collection::vec(0u8..3, 8).prop_map(|fates| Op::CrashInDestage { fates }),
    ]
}

/// A write issued: its `ser`, offset and data.
type W = (u64, u64, Vec<u8>);

/// The volume image after applying `writes[..k]`.
fn image(writes: &[W], k: usize) -> Vec<u8> {
    let mut img = vec![0u8; VOL as usize];
    for (_, off, data) in &writes[..k] {
        img[*off as usize..*off as usize + data.len()].copy_from_slice(data);
    }
    img
}

/// How many of `writes` have `ser` ≤ `s` (they are in ser order).
fn upto(writes: &[W], s: u64) -> usize {
    writes.iter().take_while(|w| w.0 <= s).count()
}

struct Rig {
    cache: Arc<SimDevice>,
    store: Arc<MemDevice>,
    host: Arc<CacheHost>,
    vol: Volume,
    id: Uuid,
}

impl Rig {
    /// `depth`: the datastore's queue depth. A small one makes windows carry more IOs than
    /// can be in flight at once, so they go out in waves.
    fn open(cache: Arc<SimDevice>, store: Arc<MemDevice>, id: Uuid, depth: u32) -> Rig {
        Rig::open_with(cache, store, id, depth, Policy::Wb)
    }

    fn open_with(
        cache: Arc<SimDevice>,
        store: Arc<MemDevice>,
        id: Uuid,
        depth: u32,
        policy: Policy,
    ) -> Rig {
        let host = CacheHost::open(cache.clone(), SEG).expect("open cache");
        let extent = Extent::new(store.clone(), 0, VOL, Arc::new(Gate::new(depth)));
        let vol = Volume::open(
            id,
            "p".into(),
            policy,
            Tuning::default(),
            extent,
            Some(host.clone()),
        )
        .expect("open volume");
        host.finish_recovery(&[id]).expect("finish recovery");
        Rig {
            cache,
            store,
            host,
            vol,
            id,
        }
    }

    /// wb → uncached, with the destager driven while the change drains.
    ///
    /// The drive is stopped and awaited, not aborted: an abort takes effect only where the task
    /// next yields, and turns over in-memory devices need not yield, so an aborted drive could
    /// go on destaging this host's windows after a later simulated power loss, over the
    /// replay of the next host (a real power loss stops every thread at once).
    async fn leave_cache(&self) {
        let host = self.host.clone();
        let stop = Arc::new(AtomicBool::new(false));
        let drive = tokio::spawn({
            let stop = stop.clone();
            async move {
                let mut turn = 0;
                while !stop.load(Ordering::SeqCst) {
                    if !host.destage_turn(turn).await {
                        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                    }
                    turn += 1;
                }
            }
        });
        self.vol.set_policy(Policy::Uncached).await.unwrap();
        stop.store(true, Ordering::SeqCst);
        drive.await.expect("the drive ran its turns");
    }

    async fn destage_all(&self) {
        let c = self.vol.cache().expect("cached");
        for turn in 0..10_000 {
            if c.clean() {
                return;
            }
            self.host.destage_turn(turn).await;
        }
        panic!("the destager made no progress");
    }
}

/// Checkpoint c means the datastore holds exactly the writes with `ser` ≤ c.
fn check_checkpoint(r: &Rig, writes: &[W]) -> Result<(), TestCaseError> {
    let cp = r.vol.cache().expect("cached").checkpoint();
    let (got, want) = (r.store.image(), image(writes, upto(writes, cp)));
    let first = got.iter().zip(&want).position(|(a, b)| a != b);
    prop_assert!(
        first.is_none(),
        "datastore differs from the volume as of checkpoint {} from byte {:?} ({} there, {} \
         expected)",
        cp,
        first,
        first.map(|i| got[i]).unwrap_or(0),
        first.map(|i| want[i]).unwrap_or(0)
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn every_durable_write_survives_and_the_volume_is_a_prefix(
        ops in proptest::collection::vec(op(), 1..60),
        depth in prop::sample::select(vec![1u32, 2, 8]),
        batches in any::<bool>(),
    ) {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(async {
            let id = Uuid::new_v4();
            let cache = Arc::new(SimDevice::new((1 << 20) + 64 * SEG));
            let store = Arc::new(MemDevice::new(VOL));
            // Windows sent as concurrent writes (a LUN) or in batches (a file).
            store.prefer_batches(batches);
            let mut r = Rig::open(cache, store, id, depth);
            // Every write issued, in ser order; how many are durable; the next ser.
            let mut writes: Vec<W> = Vec::new();
            let mut durable = 0usize;
            let mut next = 1u64;
            for (i, op) in ops.iter().enumerate() {
                match op {
                    Op::Write { sector, sectors, fua } => {
                        let data = vec![(i % 250) as u8 + 1; (*sectors * 512) as usize];
                        r.vol.write(sector * 512, Bytes::from(data.clone()), *fua).await.unwrap();
                        writes.push((next, sector * 512, data));
                        next += 1;
                        if *fua {
                            durable = writes.len();
                        }
                    }
                    Op::Zero { sector, sectors } => {
                        r.vol.write_zeroes(sector * 512, sectors * 512, true, false).await.unwrap();
                        writes.push((next, sector * 512, vec![0u8; (*sectors * 512) as usize]));
                        next += 1;
                    }
                    Op::Flush => {
                        r.vol.flush().await.unwrap();
                        durable = writes.len();
                    }
                    Op::Destage => {
                        r.host.destage_turn(0).await;
                        check_checkpoint(&r, &writes)?;
                    }
                    Op::Hold(on) => {
                        // A hold of a nanosecond: windows are held (take everything staged)
                        // and always ready.
                        let hold_s = if *on { Some(1e-9) } else { Some(0.0) };
                        r.vol.set_tuning(Tuning { hold_s, ..Tuning::default() });
                    }
                    Op::Cycle => {
                        r.leave_cache().await;
                        prop_assert_eq!(r.store.image(), image(&writes, writes.len()), "leaving wb drained everything");
                        r.vol.set_policy(Policy::Wb).await.unwrap();
                        // Everything is on the datastore; the new generation numbers anew.
                        let img = image(&writes, writes.len());
                        writes = vec![(0, 0, img)];
                        durable = 1;
                        next = r.vol.cache().unwrap().checkpoint() + 1;
                    }
                    Op::Uncached { writes: uw, crash } => {
                        r.leave_cache().await;
                        let mut img = image(&writes, writes.len());
                        prop_assert_eq!(r.store.image(), img.clone(), "leaving wb drained everything");
                        for (j, (sector, sectors)) in uw.iter().enumerate() {
                            // Data no write before can have had (those use 1..=250).
                            let data = vec![251 + (j % 4) as u8; (*sectors * 512) as usize];
                            r.vol.write(sector * 512, Bytes::from(data.clone()), false).await.unwrap();
                            img[(sector * 512) as usize..][..data.len()].copy_from_slice(&data);
                        }
                        if let Some(fates) = crash {
                            let Rig { cache, store, id, .. } = r;
                            cache.power_loss(|j, n| match fates[j % fates.len()] {
                                0 => Fate::Lost,
                                1 => Fate::Kept,
                                _ => Fate::Torn(n / 2),
                            });
                            // The datastore (memory) keeps every completed write.
                            r = Rig::open_with(cache, store, id, depth, Policy::Uncached);
                            prop_assert!(r.vol.cache().is_none(), "an uncached volume replayed old writes from the cache log");
                        }
                        let got = r.vol.read(0, VOL as u32).await.unwrap().to_vec();
                        prop_assert!(got == img, "the volume lost writes made while uncached");
                        r.vol.set_policy(Policy::Wb).await.unwrap();
                        writes = vec![(0, 0, img)];
                        durable = 1;
                        next = r.vol.cache().unwrap().checkpoint() + 1;
                    }
                    Op::PowerLoss { fates } | Op::CrashInDestage { fates } => {
                        if matches!(op, Op::CrashInDestage { .. }) {
                            if r.vol.cache().unwrap().clean() {
                                continue; // nothing to destage: no window to crash in
                            }
                            // Power fails right after the window's datastore FLUSH; the cache
                            // device is dead from then on, so nothing more reaches it.
                            let (cache, fates) = (r.cache.clone(), fates.clone());
                            r.store.after_next_flush(move || {
                                cache.power_loss(|j, n| match fates[j % fates.len()] {
                                    0 => Fate::Lost,
                                    1 => Fate::Kept,
                                    _ => Fate::Torn(n / 2),
                                });
                                cache.fail();
                            });
                            r.host.destage_turn(0).await;
                        }
                        let Rig { cache, store, id, .. } = r;
                        // (After a crash in destage this only revives the dead device.)
                        cache.power_loss(|j, n| match fates[j % fates.len()] {
                            0 => Fate::Lost,
                            1 => Fate::Kept,
                            _ => Fate::Torn(n / 2),
                        });
                        r = Rig::open(cache, store, id, depth);
                        let (recovered, void) = r.vol.cache().unwrap().recovery_marks();
                        // The replay's every checkpoint is a prefix too, even where the crash
                        // cut a window midway that the replay composes otherwise (a held
                        // window out, replayed in batches). (Until the replay records one, the
                        // datastore may hold part of the window the crash cut.)
                        let mut turns = 0;
                        while !r.vol.cache().unwrap().clean() {
                            let before = r.vol.cache().unwrap().checkpoint();
                            r.host.destage_turn(0).await;
                            if r.vol.cache().unwrap().checkpoint() != before {
                                check_checkpoint(&r, &writes[..upto(&writes, recovered)])?;
                            }
                            turns += 1;
                            prop_assert!(turns < 10_000, "the replay made no progress");
                        }
                        // The log gave back a prefix (by ser) holding every durable write.
                        let k = upto(&writes, recovered);
                        prop_assert!(k >= durable, "durable write lost: {} of {} survived, {} were durable", k, writes.len(), durable);
                        let got = r.vol.read(0, VOL as u32).await.unwrap().to_vec();
                        prop_assert!(got == image(&writes, k), "the volume is not the prefix of {} writes", k);
                        prop_assert_eq!(r.store.image(), got, "after replay the datastore equals the volume");
                        prop_assert!(r.vol.cache().unwrap().checkpoint() >= void);
                        // The writes past the prefix never happened; new sers come after all seen.
                        writes.truncate(k);
                        durable = k;
                        next = void + 1;
                    }
                }
            }
            // Finally everything destages and the datastore equals the volume.
            r.destage_all().await;
            let got = r.vol.read(0, VOL as u32).await.unwrap().to_vec();
            prop_assert_eq!(&got, &image(&writes, writes.len()));
            prop_assert_eq!(r.store.image(), got);
            drop(r.host);
            Ok(())
        })?;
    }
}

/// A held window larger than a replay's first window (16 MiB) goes out whole and the power
/// fails before its checkpoint is durable. The replay, in batches with its byte cap, must still
/// reach the end of that window before it records a checkpoint: a shorter first window would
/// put the first write's block back under the last one's and record a checkpoint over a
/// datastore that also holds the writes after it (a state no prefix of the writes gives).
#[test]
fn a_replay_reaches_the_end_of_a_window_the_crash_cut_whatever_its_caps() {
    const MIB: u64 = 1 << 20;
    const VOL: u64 = 40 * MIB;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let id = Uuid::new_v4();
        let cache = Arc::new(SimDevice::new(96 * MIB));
        let store = Arc::new(MemDevice::new(VOL));
        let open = |cache: Arc<SimDevice>, tuning: Tuning| {
            let host = CacheHost::open(cache, MIB).expect("open cache");
            let extent = Extent::new(store.clone(), 0, VOL, Arc::new(Gate::new(8)));
            let vol = Volume::open(
                id,
                "big".into(),
                Policy::Wb,
                tuning,
                extent,
                Some(host.clone()),
            )
            .expect("open volume");
            host.finish_recovery(&[id]).expect("finish recovery");
            (host, vol)
        };
        // Windows held (a nanosecond: always ready), so one takes everything staged.
        let held = Tuning {
            hold_s: Some(1e-9),
            ..Tuning::default()
        };
        let (host, vol) = open(cache.clone(), held);
        // ser 1: a block at 0; sers 2..=33: 32 MiB elsewhere; ser 34: the block at 0 again.
        let mut want = vec![0u8; VOL as usize];
        let mut put = |off: u64, data: &[u8]| {
            want[off as usize..][..data.len()].copy_from_slice(data);
        };
        let mut writes: Vec<(u64, Vec<u8>)> = vec![(0, vec![1u8; 4096])];
        for i in 0..32u64 {
            writes.push(((i + 4) * MIB, vec![2 + i as u8; MIB as usize]));
        }
        writes.push((0, vec![99u8; 4096]));
        for (off, data) in &writes {
            vol.write(*off, Bytes::from(data.clone()), false)
                .await
                .unwrap();
            put(*off, data);
        }
        vol.flush().await.unwrap();
        // The whole window reaches the datastore, then the power fails before its checkpoint.
        let c = cache.clone();
        store.after_next_flush(move || {
            c.power_loss(|_, _| Fate::Lost);
            c.fail();
        });
        host.destage_turn(0).await;
        assert_eq!(store.image(), want, "the held window went out whole");
        drop(vol);
        drop(host);
        cache.power_loss(|_, _| Fate::Lost);

        // Restart with batch windows (the default hold).
        let (host, vol) = open(cache, Tuning::default());
        let c = vol.cache().expect("cached");
        assert_eq!(c.checkpoint(), 0, "the window's checkpoint was lost");
        let mut turns = 0;
        while !c.clean() {
            let before = c.checkpoint();
            host.destage_turn(0).await;
            let cp = c.checkpoint();
            if cp != before {
                let mut prefix = vec![0u8; VOL as usize];
                for (off, data) in &writes[..cp as usize] {
                    prefix[*off as usize..][..data.len()].copy_from_slice(data);
                }
                let img = store.image();
                let first = img.iter().zip(&prefix).position(|(a, b)| a != b);
                assert!(
                    first.is_none(),
                    "checkpoint {cp} recorded over a datastore that differs from the volume as \
                     of it from byte {first:?}"
                );
            }
            turns += 1;
            assert!(turns < 1000, "the replay made no progress");
        }
        assert_eq!(c.checkpoint(), writes.len() as u64);
        assert_eq!(store.image(), want);
    });
}
