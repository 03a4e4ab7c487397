//! Destage windows at their limits: a held window larger than the destager's byte cap, a
//! replay's pieces (cut between two, each going out behind the last), many batch windows each read ahead while
//! the one before is written, and a window with a corrupt record. At every checkpoint the datastore must equal the volume as of that checkpoint
//! (DESIGN §2), and a window that cannot be read must leave the datastore untouched.

use std::sync::Arc;

use bytes::Bytes;
use cachelog::device::SimDevice;
use cachelog::CacheDevice;
use cluster::{Policy, Tuning};
use datastore::device::{Device, MemDevice};
use datastore::{Extent, Gate};
use engine::cache::CacheHost;
use engine::Volume;
use uuid::Uuid;

/// The engine's default segment: records of at most 252 KiB, so a 768 KiB write has four parts
/// of 192 KiB.
const SEG: u64 = 1 << 20;

struct Rig {
    cache: Arc<SimDevice>,
    store: Arc<MemDevice>,
    host: Arc<CacheHost>,
    vol: Volume,
    /// Every write issued, in ser order (sers count from 1): offset and data.
    writes: Vec<(u64, Vec<u8>)>,
}

impl Rig {
    fn open(cache_bytes: u64, vol_bytes: u64, depth: u32, hold_s: f64) -> Rig {
        let cache = Arc::new(SimDevice::new(cache_bytes));
        let store = Arc::new(MemDevice::new(vol_bytes));
        Rig::start(cache, store, Uuid::new_v4(), depth, hold_s, Vec::new())
    }

    /// A host on `cache` with volume `id` on `store`, held for `hold_s`, recovered.
    fn start(
        cache: Arc<SimDevice>,
        store: Arc<MemDevice>,
        id: Uuid,
        depth: u32,
        hold_s: f64,
        writes: Vec<(u64, Vec<u8>)>,
    ) -> Rig {
        let host = CacheHost::open(cache.clone(), SEG).expect("open cache");
        let size = store.image().len() as u64;
        let extent = Extent::new(store.clone(), 0, size, Arc::new(Gate::new(depth)));
        let vol = Volume::open(
            id,
            "w".into(),
            Policy::Wb,
            Tuning {
                hold_s: Some(hold_s),
                ..Tuning::default()
            },
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
            writes,
        }
    }

    /// The host stops without destaging (a crash after a flush) and starts again on the same
    /// cache device, the volume held for `hold_s`: it replays what the log holds.
    fn restart(self, hold_s: f64) -> Rig {
        let Rig {
            cache,
            store,
            vol,
            writes,
            ..
        } = self;
        let id = vol.id();
        drop(vol);
        Rig::start(cache, store, id, 4, hold_s, writes)
    }

    async fn write(&mut self, offset: u64, data: Vec<u8>) {
        self.vol
            .write(offset, Bytes::from(data.clone()), false)
            .await
            .expect("write");
        self.writes.push((offset, data));
    }

    /// The volume after its first `k` writes.
    fn image(&self, k: usize) -> Vec<u8> {
        let mut img = vec![0u8; self.store.image().len()];
        for (off, data) in &self.writes[..k] {
            img[*off as usize..*off as usize + data.len()].copy_from_slice(data);
        }
        img
    }

    fn checkpoint(&self) -> u64 {
        self.vol.cache().expect("cached").checkpoint()
    }

    /// Destager turns until the volume is clean, checking the datastore at every checkpoint;
    /// returns how many windows it took.
    async fn destage_checking(&self) -> usize {
        let c = self.vol.cache().expect("cached");
        let mut windows = 0;
        for turn in 0..10_000 {
            if c.clean() {
                return windows;
            }
            let before = self.checkpoint();
            let progressed = self.host.destage_turn(turn).await;
            let cp = self.checkpoint();
            // (A replay's last turn ends it, with the checkpoint where it is.)
            if cp != before {
                windows += 1;
                assert!(
                    progressed && cp > before,
                    "a window moved the checkpoint back"
                );
                assert!(
                    self.store.image() == self.image(cp as usize),
                    "the datastore differs from the volume as of checkpoint {cp}"
                );
            }
        }
        panic!("the destager made no progress");
    }

    /// Asserts that no write lands on the datastore for 300 ms after `what` returned; the
    /// datastore's image as `what` left it.
    async fn nothing_lands_after(&self, what: &str) -> Vec<u8> {
        let then = self.store.image();
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        assert!(
            self.store.image() == then,
            "a write landed after {what} returned"
        );
        then
    }

    /// [`Rig::destage_checking`] while the volume drains. The hold time has not passed, so
    /// nothing is due until then; a drain (a policy change's, a replay's) makes the held
    /// window ready at once.
    async fn drain_checking(&self) -> usize {
        let c = self.vol.cache().expect("cached");
        let drain = tokio::spawn(async move {
            c.drain(0, std::time::Duration::MAX, std::time::Duration::MAX)
                .await
        });
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        let windows = self.destage_checking().await;
        drain.await.unwrap().expect("drain");
        windows
    }
}

/// Bytes that differ by write and by position, so a piece put in the wrong place shows.
fn pattern(i: usize, len: u64) -> Vec<u8> {
    (0..len)
        .map(|j| (i as u64 * 31 + j / 512) as u8 | 1)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_window_over_the_byte_cap_goes_out_in_whole_writes() {
    // 220 writes of 768 KiB (four records each), 640 KiB apart: each overwrites the first
    // 128 KiB of the last record of the one before, so pieces are whole and partial records.
    // 165 MiB in all, over the 128 MiB a window carries, and 128 MiB is no whole number of
    // writes: the cap falls inside a write.
    // Sent as concurrent writes (a LUN), then in batches (a file): 128 MiB is many batches.
    let (n, len, stride) = (220usize, 768u64 << 10, 640u64 << 10);
    for batches in [false, true] {
        let mut r = Rig::open((256 << 20) + 64 * SEG, stride * n as u64 + len, 4, 3600.0);
        r.store.prefer_batches(batches);
        for i in 0..n {
            r.write(i as u64 * stride, pattern(i, len)).await;
        }
        r.vol.flush().await.expect("flush");
        let windows = r.drain_checking().await;
        assert!(windows >= 2, "165 MiB took {windows} window(s)");
        assert_eq!(r.checkpoint(), n as u64);
        assert!(
            r.store.image() == r.image(n),
            "the datastore holds every write (batches: {batches})"
        );
    }
}

/// The writes of [`replaying_rig`]: 768 KiB each, 640 KiB apart (60 MiB in all).
const REPLAY_WRITES: usize = 80;
const REPLAY_LEN: u64 = 768 << 10;

/// A rig whose volume took [`REPLAY_WRITES`] writes with destaging held, flushed, and
/// restarted: its replay is about to begin.
async fn replaying_rig() -> Rig {
    let (n, len, stride) = (REPLAY_WRITES, REPLAY_LEN, 640u64 << 10);
    let mut r = Rig::open((256 << 20) + 64 * SEG, stride * n as u64 + len, 4, 3600.0);
    for i in 0..n {
        r.write(i as u64 * stride, pattern(i, len)).await;
    }
    r.vol.flush().await.expect("flush");
    r.restart(3600.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_goes_out_in_pieces_with_one_checkpoint_at_the_end() {
    // 80 writes of 768 KiB, 640 KiB apart (60 MiB), replayed after a restart: one window
    // reaching every recovered write, in pieces of 16 MiB (each ending at a whole write);
    // the checkpoint moves only when the last is on the datastore (a replay cut between
    // pieces starts again from where it started), and only that one is flushed, before it.
    let (n, len) = (REPLAY_WRITES, REPLAY_LEN);
    let r = replaying_rig().await;
    let c = r.vol.cache().expect("cached");
    let mut pieces = Vec::new();
    let flushes = r.store.flushes();
    for turn in 0..10_000 {
        if c.clean() {
            break;
        }
        let before = r.store.image();
        let progressed = r.host.destage_turn(turn).await;
        // A piece's writes may outlast its turn (the next piece's go out behind them).
        r.host.destage_settled().await;
        let now = r.store.image();
        let cp = r.checkpoint();
        if now != before {
            assert!(
                progressed,
                "a turn that wrote the datastore said it made no progress"
            );
            // Pieces go in order, each coalesced on its own: a piece's end leaves the datastore
            // the volume as of some write.
            let k = (1..=n)
                .find(|&k| now == r.image(k))
                .expect("a piece left the datastore no prefix of the writes");
            pieces.push(k as u64);
            // What `vesta volume show` says of the replay meanwhile.
            let rep = c.report();
            if rep.replaying && cp == 0 {
                assert_eq!((rep.replay_sent, rep.replay_end), (k as u64, n as u64));
            }
        }
        // (The turn after the last piece ends the replay, with the checkpoint where it is.)
        assert!(
            cp == 0 || cp == n as u64,
            "checkpoint {cp} recorded between the pieces of a replay"
        );
        let flushed = r.store.flushes() - flushes;
        assert_eq!(
            flushed,
            u64::from(cp == n as u64),
            "{flushed} datastore flush(es) with the checkpoint at {cp}"
        );
    }
    // Each piece ends at a whole write within its cap, or at the first one past it: 16 MiB
    // is 21⅓ writes of its bytes.
    let mib = |w: u64| w as f64 * len as f64 / (1 << 20) as f64;
    assert_eq!(pieces.len(), 4, "pieces ended at {pieces:?}");
    let mut start = 0;
    for &end in &pieces {
        assert!(
            mib(end - start) > 16.0 - 0.75 || end == n as u64,
            "a short piece in {pieces:?}"
        );
        assert!(mib(end - start) < 16.0 + 0.75, "a long piece in {pieces:?}");
        start = end;
    }
    assert_eq!(*pieces.last().unwrap(), n as u64);
    assert_eq!(r.checkpoint(), n as u64);
    assert!(
        r.store.image() == r.image(n),
        "the datastore holds every write"
    );
}

/// [`replaying_rig`] with the replay's first piece sent, its writes slow (200 ms each), so
/// that its turn ended with its last writes in flight (for about 150 ms more). Returns the
/// rig, the next turn and the writes the piece took.
async fn rig_with_a_piece_in_flight() -> (Rig, usize, usize) {
    piece_in_flight(false).await
}

/// [`rig_with_a_piece_in_flight`] with the piece's writes still in flight held there (the
/// datastore stopped answering) until the test calls `hold_writes_after(None)`.
async fn rig_with_a_piece_held() -> (Rig, usize, usize) {
    piece_in_flight(true).await
}

async fn piece_in_flight(hold: bool) -> (Rig, usize, usize) {
    let r = replaying_rig().await;
    let c = r.vol.cache().expect("cached");
    r.store
        .set_write_delay(Some(std::time::Duration::from_millis(200)));
    let mut turn = 0;
    while c.report().replay_sent == 0 {
        assert!(turn < 10_000, "no piece went out");
        r.host.destage_turn(turn).await;
        turn += 1;
    }
    if hold {
        // Those still in their delay stay in flight when it ends.
        r.store.hold_writes_after(Some(0));
    }
    // The delay counts for a write once it reaches the device: the ones just sent get there.
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    r.store.set_write_delay(None);
    let first = c.report().replay_sent as usize;
    assert!(
        first < REPLAY_WRITES,
        "the first piece was the whole replay"
    );
    assert!(
        r.store.image() != r.image(first),
        "the first piece's writes were all in when its turn ended"
    );
    (r, turn, first)
}

/// The replay above, its first piece's writes slow (200 ms each): the piece's turn ends with
/// its last writes in flight, and the next piece's writes go out behind them, except the
/// one that overlaps the last of them (consecutive writes share 128 KiB), which waits: sent
/// at once, it would land first and the older data over it. The datastore ends holding
/// every write, the newest version of each block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_piece_goes_out_behind_the_last_but_never_under_an_overlapping_write() {
    let n = REPLAY_WRITES;
    let (r, _, _) = rig_with_a_piece_in_flight().await;
    r.destage_checking().await;
    assert_eq!(r.checkpoint(), n as u64);
    assert!(
        r.store.image() == r.image(n),
        "an older write landed over a newer one"
    );
}

/// The piece that reaches the reach waits for every write still in flight, its own and the
/// pieces' before it, before the datastore flush its checkpoint follows: with every write slow
/// (50 ms), the datastore holds the whole volume when the flush comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_flushes_only_once_every_write_is_in() {
    let n = REPLAY_WRITES;
    let r = replaying_rig().await;
    r.store
        .set_write_delay(Some(std::time::Duration::from_millis(50)));
    let at_flush = Arc::new(std::sync::Mutex::new(None));
    {
        let (store, at_flush) = (r.store.clone(), at_flush.clone());
        r.store
            .after_next_flush(move || *at_flush.lock().unwrap() = Some(store.image()));
    }
    r.destage_checking().await;
    let image = at_flush.lock().unwrap().take().expect("no datastore flush");
    assert!(
        image == r.image(n),
        "the datastore was flushed with writes still in flight"
    );
}

/// Stopping the destager (a delete, a hand-off) waits for the writes a replay's piece left in
/// flight: none may land after it returns. And one of them that failed starts the replay
/// over once the destager goes on: the datastore may lack it, and nothing was flushed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_the_destager_waits_for_a_pieces_writes_and_hears_of_their_errors() {
    for fail in [false, true] {
        let n = REPLAY_WRITES;
        let (r, mut turn, first) = rig_with_a_piece_in_flight().await;
        let c = r.vol.cache().expect("cached");
        // The writes in flight fail once their delay is over.
        r.store.fail_writes(fail);
        c.stop_destaging().await;
        r.nothing_lands_after(&format!("stop_destaging (fail: {fail})"))
            .await;
        if !fail {
            assert!(
                r.store.image() == r.image(first),
                "the first piece is not in"
            );
        }
        r.store.fail_writes(false);
        c.resume_destaging();
        while !c.clean() {
            assert!(turn < 10_000, "the replay made no progress (fail: {fail})");
            r.host.destage_turn(turn).await;
            turn += 1;
            if fail {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
        }
        assert_eq!(r.checkpoint(), n as u64);
        assert!(
            r.store.image() == r.image(n),
            "the replay recorded its checkpoint over a failed write (fail: {fail})"
        );
    }
}

/// Waits (up to 10 s) until `f` holds.
async fn until(what: &str, f: impl Fn() -> bool) {
    for _ in 0..10_000 {
        if f() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    panic!("waited 10 s for {what}");
}

/// The destager itself stopping (the daemon shutting down, a volume handed off) returns only
/// once no write of its windows is in flight, those a replay's piece left behind included:
/// its caller may give up the volume's lock next. The piece's writes are held in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_destager_returns_only_once_its_pieces_writes_are_in() {
    use std::time::Duration;
    let n = REPLAY_WRITES;
    let (r, _, first) = rig_with_a_piece_held().await;
    // Stopped from the start: it runs one turn (the next piece goes out), then stops.
    let destager = tokio::spawn(r.host.clone().run_destager(|| true));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !destager.is_finished(),
        "the destager returned with a piece's writes in flight"
    );
    // The next piece's writes slow (200 ms): they too must be in before it returns.
    r.store.set_write_delay(Some(Duration::from_millis(200)));
    r.store.hold_writes_after(None);
    destager.await.unwrap();
    let stopped = r.nothing_lands_after("the destager").await;
    assert!(
        stopped != r.image(first),
        "the destager's last turn sent no piece"
    );
    r.store.set_write_delay(None);
    r.destage_checking().await;
    assert!(r.store.image() == r.image(n), "the replay lost a write");
}

/// A delete or relocation gives up stopping the destager after a limit, rather than wait for
/// ever on a datastore that stopped answering: whether a window holds the destager or a piece
/// left its writes in flight, `stop_destaging_within` says false in about its limit; once
/// the writes are in, it says true and nothing lands after. Nothing is lost either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_the_destager_gives_up_after_its_limit_and_loses_nothing() {
    use std::time::{Duration, Instant};
    let n = REPLAY_WRITES;
    // A window writing, its writes held.
    let r = replaying_rig().await;
    let c = r.vol.cache().expect("cached");
    r.store.hold_writes_after(Some(0));
    let turn = {
        let host = r.host.clone();
        tokio::spawn(async move { host.destage_turn(0).await })
    };
    until("a write of the window held", || r.store.writes_held() > 0).await;
    let t0 = Instant::now();
    assert!(
        !c.stop_destaging_within(Duration::from_millis(50)).await,
        "the destager stopped while its window was writing"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "it waited past its limit"
    );
    r.store.hold_writes_after(None);
    turn.await.unwrap();
    c.resume_destaging();
    r.destage_checking().await;
    assert!(r.store.image() == r.image(n), "the replay lost a write");
    // A piece's writes left in flight, held.
    let (r, _, _) = rig_with_a_piece_held().await;
    let c = r.vol.cache().expect("cached");
    assert!(
        !c.stop_destaging_within(Duration::from_millis(10)).await,
        "the destager stopped with a piece's writes in flight"
    );
    r.store.hold_writes_after(None);
    assert!(c.stop_destaging_within(Duration::from_secs(5)).await);
    r.nothing_lands_after("stop_destaging_within").await;
    c.resume_destaging();
    r.destage_checking().await;
    assert!(r.store.image() == r.image(n), "the replay lost a write");
}

/// Detaching a volume (it is deleted) with a replay's piece still writing its datastore
/// waits for those writes, so none lands in storage the delete frees next; the records stay
/// for the next start, since the volume is dirty. The piece's writes are held in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn detaching_waits_for_the_writes_a_replays_piece_left_in_flight() {
    let (r, _, first) = rig_with_a_piece_held().await;
    let c = r.vol.cache().expect("cached");
    assert!(!c.clean());
    let detach = {
        let (host, c) = (r.host.clone(), c.clone());
        tokio::spawn(async move { host.detach(&c).await })
    };
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(
        !detach.is_finished(),
        "detach returned with the piece's writes in flight"
    );
    r.store.hold_writes_after(None);
    detach.await.unwrap().expect("detach");
    let detached = r.nothing_lands_after("detach").await;
    assert!(detached == r.image(first), "the piece's writes are not in");
}

/// A write a piece left in flight fails (the datastore lost it): the next piece hears of it
/// (it waits for the write it overlaps) and the replay starts over, instead of going on from
/// the pieces sent and recording its checkpoint over a datastore without that write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_write_a_piece_left_in_flight_starts_the_replay_over() {
    let n = REPLAY_WRITES;
    let (r, mut turn, _) = rig_with_a_piece_in_flight().await;
    let c = r.vol.cache().expect("cached");
    r.store.fail_writes(true);
    tokio::time::sleep(std::time::Duration::from_millis(400)).await;
    r.store.fail_writes(false);
    while !c.clean() {
        assert!(turn < 10_000, "the replay made no progress");
        r.host.destage_turn(turn).await;
        turn += 1;
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert_eq!(r.checkpoint(), n as u64);
    assert!(
        r.store.image() == r.image(n),
        "the replay recorded its checkpoint over a failed write"
    );
}

/// The replay above, cut by a crash once two of its pieces are on the datastore: the one
/// after it starts again from the checkpoint the first one never moved, and reaches every
/// write before it records one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_cut_between_its_pieces_is_sent_again_whole() {
    let (n, len) = (REPLAY_WRITES, REPLAY_LEN);
    let r = replaying_rig().await;
    let mut pieces = 0;
    for turn in 0..10_000 {
        if pieces == 2 {
            break;
        }
        let before = r.store.image();
        r.host.destage_turn(turn).await;
        r.host.destage_settled().await;
        if r.store.image() != before {
            pieces += 1;
        }
    }
    assert_eq!(pieces, 2);
    assert_eq!(
        r.checkpoint(),
        0,
        "a checkpoint between the pieces of a replay"
    );
    // The first write's blocks wiped on the datastore: only a replay sent again from its
    // start puts them back (one resumed after the pieces sent would not).
    r.store
        .write_at(0, Bytes::from(vec![0u8; len as usize]), false)
        .await
        .expect("wipe");
    let r = r.restart(3600.0);
    assert_eq!(r.checkpoint(), 0);
    let c = r.vol.cache().expect("cached");
    for turn in 0..10_000 {
        if c.clean() {
            break;
        }
        r.host.destage_turn(turn).await;
        let cp = r.checkpoint();
        assert!(
            cp == 0 || cp == n as u64,
            "checkpoint {cp} recorded between the pieces of a replay"
        );
    }
    assert!(c.clean(), "the replay made no progress");
    assert_eq!(r.checkpoint(), n as u64);
    assert!(
        r.store.image() == r.image(n),
        "the datastore holds every write"
    );
}

/// The replay above, its first two pieces written (not flushed), then the datastore loses
/// them (an NBD server that restarted; here the first write's blocks) and fails the third
/// piece. The retry must send the pieces before it again: resumed after them, it would flush
/// and record a checkpoint over a datastore missing writes it had lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_datastore_error_during_a_replay_sends_its_unflushed_pieces_again() {
    let (n, len) = (REPLAY_WRITES, REPLAY_LEN);
    let r = replaying_rig().await;
    let c = r.vol.cache().expect("cached");
    let mut pieces = 0;
    for turn in 0..10_000 {
        if pieces == 2 {
            break;
        }
        let before = r.store.image();
        r.host.destage_turn(turn).await;
        r.host.destage_settled().await;
        if r.store.image() != before {
            pieces += 1;
        }
    }
    assert_eq!(pieces, 2);
    r.store
        .write_at(0, Bytes::from(vec![0u8; len as usize]), false)
        .await
        .expect("lose");
    r.store.fail_writes(true);
    r.host.destage_turn(0).await;
    assert!(c.report().destage_error.is_some(), "the third piece failed");
    r.store.fail_writes(false);
    for turn in 0..400 {
        if c.clean() {
            break;
        }
        r.host.destage_turn(turn).await;
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(c.clean(), "the replay did not finish after the error");
    assert_eq!(r.checkpoint(), n as u64);
    assert!(
        r.store.image() == r.image(n),
        "checkpoint {n} recorded over a datastore missing writes it had lost"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_windows_read_ahead_and_stay_prefixes() {
    // A queue depth of 2 makes each batch window 8 IOs: 300 writes need dozens of windows,
    // each read while the one before it is written. Writes overlap now and then, which
    // closes batch windows early.
    // Sent as concurrent writes (a LUN), then in batches (a file).
    for batches in [false, true] {
        let mut r = Rig::open((64 << 20) + 64 * SEG, 8 << 20, 2, 0.0);
        r.store.prefer_batches(batches);
        let c = r.vol.cache().expect("cached");
        c.stop_destaging().await; // nothing runs until the writes are all staged
        for i in 0..300usize {
            let off = ((i * 7919) % 2000) as u64 * 4096;
            let len = 4096 * (1 + (i % 5) as u64);
            r.write(off, pattern(i, len)).await;
        }
        c.resume_destaging();
        let windows = r.destage_checking().await;
        assert!(windows >= 10, "300 writes took only {windows} window(s)");
        assert!(
            r.store.image() == r.image(r.writes.len()),
            "batches: {batches}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_with_a_corrupt_record_leaves_the_datastore_at_its_checkpoint() {
    let mut r = Rig::open((64 << 20) + 64 * SEG, 4 << 20, 4, 3600.0);
    let c = r.vol.cache().expect("cached");
    for i in 0..20usize {
        r.write(i as u64 * 65536, pattern(i, 65536)).await;
    }
    r.drain_checking().await;
    assert_eq!(r.checkpoint(), 20);
    // Twenty more, one of them with a mark to find its record by; then that record rots.
    for i in 20..40usize {
        let mut data = pattern(i, 65536);
        if i == 30 {
            data[..16].copy_from_slice(b"corrupt-me-here!");
        }
        r.write(i as u64 * 65536, data).await;
    }
    r.vol.flush().await.expect("flush");
    let mut dev = vec![0u8; r.cache.size() as usize];
    r.cache.read_at(0, &mut dev).unwrap();
    let at = dev
        .windows(16)
        .position(|w| w == b"corrupt-me-here!")
        .expect("the marked record is in the log") as u64;
    r.cache.corrupt(at + 1000);
    let before = r.store.image();
    let drain = {
        let c = c.clone();
        tokio::spawn(async move {
            c.drain(0, std::time::Duration::MAX, std::time::Duration::MAX)
                .await
        })
    };
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    assert!(
        !r.host.destage_turn(0).await,
        "the window cannot be destaged"
    );
    drain.abort();
    assert_eq!(r.checkpoint(), 20);
    assert!(
        r.store.image() == before,
        "no part of the unreadable window reached the datastore"
    );
    let degraded = c.report().degraded.expect("the volume is degraded");
    assert!(degraded.contains("cannot be read"), "{degraded}");
}

/// The first dirty write after the checkpoint rots while the host is down, and the volume
/// opens only after recovery has finished (its datastore was not reachable at start): nothing
/// of it is served, and the volume is still reported degraded, not silently clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_opened_after_recovery_still_reports_its_rotten_first_record() {
    let mut r = Rig::open((64 << 20) + 64 * SEG, 4 << 20, 4, 3600.0);
    let id = r.vol.id();
    for i in 0..3usize {
        let mut data = pattern(i, 65536);
        if i == 0 {
            data[..16].copy_from_slice(b"corrupt-me-here!");
        }
        r.write(i as u64 * 65536, data).await;
    }
    r.vol.flush().await.expect("flush");
    let mut dev = vec![0u8; r.cache.size() as usize];
    r.cache.read_at(0, &mut dev).unwrap();
    let at = dev
        .windows(16)
        .position(|w| w == b"corrupt-me-here!")
        .expect("the marked record is in the log") as u64;
    let Rig {
        cache, store, vol, ..
    } = r;
    drop(vol);
    cache.power_loss(|_, _| cachelog::device::Fate::Kept);
    cache.corrupt(at + 1000);
    let host = CacheHost::open(cache.clone(), SEG).expect("reopen cache");
    // Recovery ends with the volume known but not open yet.
    host.finish_recovery(&[id]).expect("finish recovery");
    let extent = Extent::new(store.clone(), 0, 4 << 20, Arc::new(Gate::new(4)));
    let vol = Volume::open(
        id,
        "w".into(),
        Policy::Wb,
        Tuning::default(),
        extent,
        Some(host.clone()),
    )
    .expect("open volume");
    let degraded = vol
        .cache()
        .expect("cached")
        .report()
        .degraded
        .expect("the volume is degraded");
    assert!(degraded.contains("damaged"), "{degraded}");
    let read = vol.read(0, 3 * 65536).await.expect("read");
    assert!(
        read.iter().all(|b| *b == 0),
        "nothing after the rotten record is served"
    );
}
