//! The write-back and write-through IO path (DESIGN §3, FVP §3–§6).
//!
//! [`CacheHost`] owns the host's cache log and the destager; each cached volume has a
//! [`VolCache`] with its index (which log record holds the newest data of each range), its
//! staging queue (dirty writes in `ser` order, metadata only), its gatekeeper, and its share
//! of the cache.
//!
//! # The write path in `wb`
//!
//! 1. *Admission*: if the volume's share would be full of dirty data, the write waits for the
//!    destager (a stall; flow control exists to make this rare).
//! 2. *Gatekeeper*: the write gets the next `ser`, and waits for every in-flight write with a
//!    lower `ser` that overlaps it.
//! 3. *Append*: a data record (split into parts if large, all with the same `ser`) goes to the
//!    log; index and staging queue are updated.
//! 4. *Completion order*: the write completes only after every lower `ser` has been appended.
//!    So whatever survives a crash, the log holds a prefix of the completed writes, and
//!    recovery (which takes records up to the first gap in `ser`) never drops a completed one.
//! 5. *FUA*: a group-commit sync of the log.
//! 6. *Flow control*: a delay of 0 to 4× the datastore write latency ([`crate::flow`]).
//!
//! # The destager
//!
//! One task per host visits cached volumes round robin, one window per turn: the window's
//! records are made durable in the log (a group-commit sync, usually already done), the window's
//! writes are coalesced ([`crate::window`]) and sent concurrently, the datastore is flushed,
//! a checkpoint record is appended, and the window's records are released (their segments are
//! reused only after a later sync, which makes the checkpoint durable first).
//! A datastore error leaves the window staged and retries with backoff; nothing is dropped.
//!
//! # Recovery
//!
//! At start-up the host scans the log. For each volume the records above its checkpoint, up to
//! the first gap in `ser` or damaged record, are its dirty data: they are indexed and staged
//! again, and the volume replays them (offline replay) before it takes writes; reads are
//! served meanwhile. Clean data is not kept across a crash.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use tokio::sync::Notify;
use tracing::{info, warn};
use uuid::Uuid;

use cachelog::format::Kind;
use cachelog::index::{ExtentMap, Piece as IndexPiece};
use cachelog::log::{Entry, Loc, Log, LogError, Scanned};
use cachelog::CacheDevice;
use cluster::Policy;
use datastore::device::{blocking, blocking_read, on_pool, BatchWrite};
use datastore::Extent;

use crate::flow::{self, Ewma, Signals, Triggers};
use crate::replica::{PeerReport, ReplicaWrite, Replicator};
use crate::window::{self, Closing, Piece, Source, Staged};
use crate::Error;

mod replicas;
pub use replicas::{ReplicaInfo, ReplicaRefusal};

/// Largest payload of one log record; larger writes are split into parts sharing one `ser`.
/// Small segments lower it further ([`Shared::record_max`]).
pub const RECORD_MAX: u64 = 256 << 10;

/// Splits a payload of `len` bytes into parts of at most `max` bytes (a multiple of the page):
/// as few parts as `max` allows, as equal as whole pages let them be, each but the last in
/// whole pages. Equal parts pack segments better than parts of `max` and a remainder. With
/// 1 MiB segments (four 252 KiB parts fit one), a stream of 1 MiB writes fills segments to
/// 80 % cut 4 × 208 + 192 KiB, against 75 % cut 4 × 256 KiB; 512 KiB writes 83 % against
/// 75 %, and writes of 4 KiB to 1 MiB mixed 89 % against 80 % (a model of the log's packing).
pub fn split(len: u64, max: u64) -> Vec<(u64, u64)> {
    let page = cachelog::format::PAGE;
    debug_assert!(max >= page && max.is_multiple_of(page));
    let n = len.div_ceil(max).max(1);
    let size = len.div_ceil(n).next_multiple_of(page).min(max);
    let mut out = Vec::with_capacity(n as usize);
    let mut at = 0;
    while at < len || out.is_empty() {
        let l = size.min(len - at);
        out.push((at, l));
        at += l;
    }
    out
}

/// Removals from a volume's index a read's fill is checked against ([`VolState::removed`]):
/// a few hundred reads can be in flight while that many removals happen, far more than a
/// read takes; one that began before the oldest kept is dropped.
const REMOVALS_KEPT: usize = 512;

/// Default segment size of a new cache log.
pub const SEGMENT_DEFAULT: u64 = 1 << 20;
/// A write stalls when its volume's dirty records would take more than this fraction of its
/// cache share (the rest is for segment headers, partly filled segments and clean data).
const STALL_FRACTION: f64 = 0.85;
/// Most writes one window carries. A held window takes everything staged up to this: one
/// enormous window would hold up every stalled writer until all of it were on the datastore.
const WINDOW_MAX: usize = 4096;
/// Most bytes one window carries. A window's records are all in memory while it is sent
/// (`send_window`), so this bounds the destager's memory whatever a held window would take.
const WINDOW_BYTES_MAX: u64 = 128 << 20;
/// A replay's window goes out in pieces of at most this much (past it to a whole write).
/// Every record of a piece is read before its first datastore write, and the next piece is
/// read while the one before is written; its writes go out behind that one's still in
/// flight ([`Trailing`]). Small pieces get the datastore busy after reading 16 MiB, and
/// keep the few buffers they need coming back to the pool warm: memory a process touches
/// for the first time costs 4–9 µs a page on a VM, which made 128 MiB pieces wait for their
/// reads (docs/BENCHMARKS.md, "Replays in 16 MiB pieces").
const REPLAY_PIECE_BYTES: u64 = 16 << 20;
/// Most writes, and bytes, in one batch to a device that takes batches
/// ([`datastore::device::Device::prefers_batches`]): a batch is one blocking call, checked
/// against the fence once, so it is kept short.
const BATCH_WRITES: usize = 256;
const BATCH_BYTES: u64 = 4 << 20;
/// A batch window carries up to this many queue-depths of datastore IOs, sent at most a queue
/// depth at a time: each window ends in a datastore FLUSH and a checkpoint, and a window of a
/// single queue depth spends as long on those as on its writes.
const WINDOW_WAVES: usize = 4;
/// Longest wait between destager visits when nothing wakes it.
pub(crate) const DESTAGER_IDLE: Duration = Duration::from_millis(50);
/// A drain with IO going on gives up after this long with no progress while the datastore
/// answers none of the IO it has been sent: it is hung, or slower than anything should wait
/// on. Shorter in this crate's tests, which wait it out.
pub const HUNG_AFTER: Duration = Duration::from_secs(if cfg!(test) { 3 } else { 30 });
/// Longest backoff between retries of a failing datastore. Short: writers stalled on a share
/// full of dirty data wait for the next retry after the datastore is back, and a retry costs
/// a failing datastore one window's IO (30 s kept them waiting up to that long).
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// Default maximum age of dirty data before it is destaged regardless of the hold time.
const MAX_DIRTY_AGE_DEFAULT: Duration = Duration::from_secs(30);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Client writes among staged records in `ser` order (a large write is staged as several
/// records, one per part, all with its `ser`).
fn writes_among(sers: impl Iterator<Item = u64>) -> u64 {
    let mut last = None;
    let mut n = 0;
    for s in sers {
        if last != Some(s) {
            n += 1;
            last = Some(s);
        }
    }
    n
}

fn log_err(e: LogError) -> Error {
    Error::Cache(e.to_string())
}

/// Where an indexed byte range's data is.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Ix {
    src: IxSrc,
    /// Byte offset into the record's payload.
    pos: u64,
    /// The write that put it there (0 for data read from the datastore).
    ser: u64,
    /// A `wb` write: dirty until a checkpoint reaches `ser`. `wt` writes and fills are clean.
    wb: bool,
}

impl Ix {
    fn dirty(&self, checkpoint: u64) -> bool {
        self.wb && self.ser > checkpoint
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum IxSrc {
    Rec(Loc),
    Zero,
}

impl IndexPiece for Ix {
    fn advance(&self, by: u64) -> Ix {
        Ix {
            pos: self.pos + by,
            ..*self
        }
    }
}

/// One record `append_write` appended: `len` bytes of the volume at `offset`.
#[derive(Debug, Clone, Copy)]
struct Part {
    loc: Loc,
    offset: u64,
    len: u64,
    ticket: u64,
}

/// A dirty write waiting for the destager, with the log record(s) it pins.
#[derive(Debug, Clone)]
struct StagedWrite {
    w: Staged<Loc>,
    rec: Loc,
    /// The append's completion ticket: the record is durable once the log has synced
    /// through it (`Log::sync_through`).
    ticket: u64,
    /// When it was staged (hold time and maximum dirty age count from here).
    at: Instant,
}

/// How a volume uses the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Wt,
    Wb,
}

/// What the destager is doing for a volume.
#[derive(Debug, Clone, Default)]
struct DestageState {
    /// The last datastore error, while retrying.
    error: Option<String>,
    retry_at: Option<Instant>,
    backoff: Duration,
}

struct VolState {
    mode: Mode,
    gen: u64,
    next_ser: u64,
    /// Every `ser` up to here has completed its append.
    done_ser: u64,
    /// Completed sers above `done_ser` (a gap below them is still in flight).
    done_above: std::collections::BTreeSet<u64>,
    /// The gatekeeper's view: writes between getting a `ser` and completing.
    in_flight: BTreeMap<u64, (u64, u64)>,
    checkpoint: u64,
    index: ExtentMap<Ix>,
    staged: VecDeque<StagedWrite>,
    dirty_bytes: u64,
    /// The part of `dirty_bytes` that zeroed (trimmed) ranges cover: each goes to the
    /// datastore as one request, whatever its length.
    dirty_zero_bytes: u64,
    /// What the dirty records occupy in the log, headers included: what admission counts,
    /// since small writes cost the log up to twice their size.
    dirty_log_bytes: u64,
    /// Log space that admitted writes not yet staged may take ([`Reservation`]).
    reserved_log_bytes: u64,
    /// Bumped whenever data leaves the index (eviction, a `wt` write invalidating a range, a
    /// clean record that failed to read), so a read that raced it does not put back data read
    /// from the datastore before the newer data got there.
    removals: u64,
    /// The ranges of the latest removals, oldest first (the last is removal `removals`), so
    /// a read's fill is dropped only when one overlaps it, not for every eviction in the
    /// volume meanwhile (its own append's among them). At most [`REMOVALS_KEPT`]: a fill
    /// that began before the oldest kept is dropped, whatever its range.
    removed: std::collections::VecDeque<(u64, u64)>,
    /// Offline replay in progress: writes wait.
    replaying: bool,
    /// The mode the volume switches to when its offline replay ends, before it takes a
    /// write ([`VolCache::after_replay`]).
    after_replay: Option<Mode>,
    /// When to try again the switch that ends a replay, after it failed.
    replay_end_retry: Option<Instant>,
    /// Above the checkpoint, the datastore may hold parts of the writes up to this `ser`: the
    /// end of the last window that went out (or began to). A window that starts at or below
    /// it reaches at least to it, whatever else would close it, so that its checkpoint is a
    /// prefix again: a shorter one would set some blocks back while blocks written after its
    /// end kept newer data. (A datastore error can cut a window midway; the window sent again
    /// may be composed differently, in batches after a held window, say.)
    ///
    /// After a crash, an offline or online replay reaches everything it recovered: its writes
    /// go out as one window, in pieces no larger than a window (`sent`), with one datastore
    /// flush and one checkpoint, at the end. Only durable records are destaged (in `wbp`,
    /// only writes every listed peer synced), so whatever replays holds every write of any
    /// window that went out; and a host that continues a replay after another died (a peer,
    /// or this host restarted) need not know how far that one went.
    reach: u64,
    /// The end of the pieces of a window forced to the reach that are written to the datastore
    /// (not flushed; no checkpoint yet: both come with the piece that reaches the reach): the
    /// next piece starts after it. Stale once the checkpoint is at or above it; cleared by a
    /// datastore error, after which the window starts over.
    sent: u64,
    /// See `Recovered::void_upto`: the checkpoint jumps here when replay ends.
    void_upto: u64,
    /// The last `ser` recovered from the log at start-up (the end of the replayed prefix).
    recovered_upto: u64,
    /// Set when data was lost or cannot be trusted (a damaged record, a failed cache device).
    degraded: Option<String>,
    destage: DestageState,
    /// A policy change is draining dirty data.
    draining: bool,
    /// The volume's peers while it is in `wbp`.
    replicator: Option<Arc<dyn Replicator>>,
    /// Writes waiting to be on the datastore (a peer failed them): windows are not held.
    urgent: usize,
    /// In `wbp`, every write up to here is durable on every peer (a forwarded FLUSH covered
    /// it). The destager sends nothing above it to the datastore (see `destage_window`).
    peer_synced: u64,
    /// Attached straight into `wb` (a volume opened, not switched): writes it completed on
    /// the datastore before (in `wt` or uncached, in an earlier life of the volume) may sit in
    /// the datastore's volatile cache, and a `wb` FLUSH only syncs the cache log. So the
    /// first FLUSH also flushes the datastore; this is cleared once one has. (The switch into
    /// `wb` at run time flushes the datastore before it.)
    store_flush_owed: bool,
    /// Peers named in the vault hold replicas of what this offline replay replays (an owner
    /// of a `wbp` volume restarted after a crash, and its vault still names them for the
    /// replay's generation): if the cache device fails before the replay ends, one of them
    /// replays the rest, and IO stalls for that hand-off meanwhile as it does with peers
    /// ([`VolCache::replay_backed`]).
    replay_backed: bool,
}

/// Whether a datastore IO of the run `run` (one zero piece, or data) may deallocate: a
/// zeroing not kept allocated.
fn may_trim(run: &[Piece<Loc>]) -> bool {
    matches!(
        run,
        [Piece {
            source: Source::Zero { alloc: false },
            ..
        }]
    )
}

/// Log bytes of one staged record (`cachelog::format::log_bytes`).
fn log_bytes(src: IxSrc, len: u64) -> u64 {
    cachelog::format::log_bytes(matches!(src, IxSrc::Rec(_)), len)
}

fn log_bytes_of(src: &Source<Loc>, len: u64) -> u64 {
    match src {
        Source::Data(l, _) => log_bytes(IxSrc::Rec(*l), len),
        Source::Zero { .. } => log_bytes(IxSrc::Zero, len),
    }
}

/// Log space a write holds from its admission until it is staged or fails
/// ([`VolCache::admit`]).
struct Reservation<'a> {
    v: &'a VolCache,
    bytes: u64,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        lock(&self.v.st).reserved_log_bytes -= self.bytes;
        self.v.changed.notify_waiters();
    }
}

/// Log space a `wb` write holds in the host-wide budget ([`HostAdmission`]) from its admission
/// until every lower `ser` of its volume has completed too. Staged is not enough: a staged
/// write above a `ser` still in flight cannot be destaged (nor its space freed) before that
/// one completes, so the budget keeps counting it until then.
struct HostCharge<'a> {
    shared: &'a Shared,
    bytes: u64,
}

impl Drop for HostCharge<'_> {
    fn drop(&mut self) {
        lock(&self.shared.admission).reserved -= self.bytes;
        self.shared.admitted.notify_waiters();
    }
}

/// A write's place in the host-wide admission queue while it waits; gives it up if the
/// write is dropped meanwhile.
struct Ticket<'a> {
    shared: &'a Shared,
    id: u64,
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        let mut a = lock(&self.shared.admission);
        a.waiting.retain(|t| *t != self.id);
        drop(a);
        self.shared.admitted.notify_waiters();
    }
}

/// Someone waits for the destager (a write for space, a FLUSH in `wbp` for its window): while
/// it lives, the volume's windows are due at once, whatever their hold time.
struct Urgent<'a>(&'a VolCache);

impl<'a> Urgent<'a> {
    fn new(v: &'a VolCache) -> Self {
        lock(&v.st).urgent += 1;
        Urgent(v)
    }
}

impl Drop for Urgent<'_> {
    fn drop(&mut self) {
        lock(&self.0.st).urgent -= 1;
    }
}

/// Counters for `vesta volume show`.
#[derive(Debug, Default)]
struct Counters {
    read_hit_bytes: AtomicU64,
    read_miss_bytes: AtomicU64,
    destaged_bytes: AtomicU64,
    destaged_writes: AtomicU64,
    throttled_writes: AtomicU64,
    throttle_us: AtomicU64,
    stalls: AtomicU64,
    throttled_past_bound: AtomicU64,
    longest_write_us: AtomicU64,
    evicted_segments: AtomicU64,
    eviction_scans: AtomicU64,
    space_waits: AtomicU64,
}

/// Per-volume tuning the engine reads.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VolOpts {
    pub hold: Duration,
    pub max_dirty_age: Duration,
    pub rpo_s: Option<f64>,
}

impl Default for VolOpts {
    fn default() -> VolOpts {
        VolOpts {
            hold: Duration::ZERO,
            max_dirty_age: MAX_DIRTY_AGE_DEFAULT,
            rpo_s: None,
        }
    }
}

impl VolOpts {
    pub fn from_tuning(t: &cluster::Tuning) -> VolOpts {
        let d = VolOpts::default();
        VolOpts {
            hold: t.hold_s.map(Duration::from_secs_f64).unwrap_or(d.hold),
            max_dirty_age: t
                .max_dirty_age_s
                .map(Duration::from_secs_f64)
                .unwrap_or(d.max_dirty_age),
            rpo_s: t.rpo_s,
        }
    }
}

/// What `vesta volume show` reports about a cached volume.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CacheReport {
    pub mode: String,
    pub gen: u64,
    pub dirty_bytes: u64,
    pub dirty_writes: u64,
    pub share_bytes: u64,
    pub used_bytes: u64,
    pub checkpoint: u64,
    pub last_ser: u64,
    pub read_hit_ratio: Option<f64>,
    pub destaged_bytes: u64,
    pub destaged_writes: u64,
    pub destage_bytes_per_s: f64,
    pub datastore_write_latency_us: Option<u64>,
    /// `off`, `throttling`, or `stalled`.
    pub flow_control: String,
    pub flow_pressure: f64,
    pub throttled_writes: u64,
    pub throttle_delay_us_total: u64,
    pub stalls: u64,
    /// `wb` writes that flow control held past [`flow::hold_bound`] (by the delay it asked
    /// for, not by how late the timer that released them fired): none, unless its math is
    /// wrong.
    pub throttled_past_bound: u64,
    /// The longest a `wb` write took from its arrival to its completion, timers included.
    pub longest_write_us: u64,
    /// Segments evicted so far, and how many of those evictions found extents outside the
    /// segment's record list and had to search the whole index (none, unless a bug).
    pub evicted_segments: u64,
    pub eviction_scans: u64,
    /// Appends that found the log out of free segments and had to wait for the destager or
    /// another volume to free some.
    pub space_waits: u64,
    pub replaying: bool,
    /// While replaying: the writes up to this `ser` are sent to the datastore (the pieces
    /// sent; the last piece's writes may still be in flight), of the ones up to `replay_end`;
    /// the checkpoint moves once, at the end.
    pub replay_sent: u64,
    pub replay_end: u64,
    pub degraded: Option<String>,
    pub destage_error: Option<String>,
    /// The volume's peers in `wbp`.
    pub peers: Vec<PeerReport>,
}

/// Dirty data recovered for one volume at start-up.
#[derive(Debug, Default)]
struct Recovered {
    checkpoint: u64,
    gen: u64,
    policy: Option<Policy>,
    /// Intact, complete, contiguous writes above the checkpoint, in ser order; each with its parts.
    writes: Vec<Vec<Scanned>>,
    /// The host pins these records itself while the volume has not attached yet (its datastore
    /// is down): attaching takes the pins over.
    pinned_by_host: bool,
    /// The highest `ser` of any write record found, recovered or not. Records above the
    /// recovered prefix are void (they never completed, or follow a gap); new writes are
    /// numbered above all of them, and once replay is done a checkpoint at this `ser` puts them
    /// below the checkpoint for good. Reusing their numbers would let a later scan mix a void
    /// record with a new write of the same `ser`.
    void_upto: u64,
    degraded: Option<String>,
    /// The writes are replicas: this host was the volume's peer, not its owner.
    replica: bool,
    /// Without replay, the volume starts at least this generation ([`CacheHost::raise_gen`]).
    min_gen: u64,
    /// The window end the newest checkpoint record carries, if above the checkpoint (written
    /// by the builds of 2026-11-27; a replay reaches every recovered write, at least as far:
    /// [`VolState::reach`]).
    window_end: u64,
}

impl Recovered {
    /// A copy to restore if an attach fails (a failed `VolCache::new` releases the staging
    /// pins it took, leaving the host's pins as they were).
    fn shallow_copy(&self) -> Recovered {
        Recovered {
            checkpoint: self.checkpoint,
            gen: self.gen,
            policy: self.policy,
            writes: self.writes.clone(),
            pinned_by_host: self.pinned_by_host,
            void_upto: self.void_upto,
            degraded: self.degraded.clone(),
            replica: self.replica,
            min_gen: self.min_gen,
            window_end: self.window_end,
        }
    }
}

/// Records pinned so that their segments stay while they are used, unpinned when dropped:
/// a read, an append or a write whose future is dropped midway (its task aborted) or that
/// panics gives them back. (An append's record is pinned by [`Log::append`] itself.)
struct Pins {
    log: Arc<Log>,
    locs: Vec<Loc>,
}

impl Pins {
    fn new(log: &Arc<Log>) -> Pins {
        Pins {
            log: log.clone(),
            locs: Vec::new(),
        }
    }

    fn pin(&mut self, loc: Loc) {
        self.log.pin(&loc);
        self.locs.push(loc);
    }

    /// One more pin of `loc`, already pinned here, in a guard of its own: for a blocking
    /// read of the record that may outlive this guard's future.
    fn again(&self, loc: Loc) -> Pins {
        let mut p = Pins::new(&self.log);
        p.pin(loc);
        p
    }

    /// Takes over the pins of `other`.
    fn absorb(&mut self, mut other: Pins) {
        self.locs.append(&mut other.locs);
    }
}

impl Drop for Pins {
    fn drop(&mut self) {
        for l in &self.locs {
            self.log.unpin(l);
        }
    }
}

/// State shared by the host and its volumes.
struct Shared {
    log: Arc<Log>,
    /// Every attached volume, for evictions that must look beyond the one asking.
    vols: Mutex<Vec<std::sync::Weak<VolCache>>>,
    /// Wakes the destager.
    wake: Notify,
    /// Signalled when the destager frees space or a write completes.
    space: Notify,
    cached_volumes: AtomicU64,
    /// Volumes this host holds replicas of as a peer: each takes a share of the log, like a
    /// cached volume, and no more ([`CacheHost::replica_write`]).
    replica_sets: AtomicU64,
    /// Buffers for the destager's datastore writes, used again and again.
    bufs: Arc<BufPool>,
    /// Log space of the writes in flight on all volumes ([`VolCache::admit`]).
    admission: Mutex<HostAdmission>,
    /// Signalled when writes in flight give log space back.
    admitted: Notify,
}

/// Host-wide admission of writes, in arrival order. Each volume keeps its own writes in
/// flight within its share; but shares are floored at two segments (so they can add up to
/// more than the log), and a write larger than its volume's stall limit is admitted alone
/// on its volume. Writes of several volumes at once could then together need more of the
/// log than it has, each append parts and wait, with them pinned, for space only the
/// others could free: forever. So every `wb` write also takes its log space from a host-wide
/// budget, first come first served, and keeps it until it can be destaged ([`HostCharge`]):
/// the writes that cannot be freed yet can always have their room at once.
#[derive(Default)]
struct HostAdmission {
    /// Log bytes the admitted writes may still take.
    reserved: u64,
    /// Tickets of the writes waiting, oldest first.
    waiting: VecDeque<u64>,
    next_ticket: u64,
}

impl Shared {
    /// The largest part a write is split into: [`RECORD_MAX`], or a quarter of a segment's
    /// data area (all but the page of headers) if that is smaller, so that four parts fill a
    /// segment and one always fits with its header and metadata copies.
    fn record_max(&self) -> u64 {
        // Whole pages, so that the parts of a page-aligned write are paged too.
        let page = cachelog::format::PAGE;
        let quarter = (self.log.superblock().segment_size - page) / 4 / page * page;
        RECORD_MAX.min(quarter).max(page)
    }

    /// The parts (offset in the write, length) a write of `len` bytes is appended as.
    fn parts(&self, has_payload: bool, len: u64) -> Vec<(u64, u64)> {
        if has_payload {
            split(len, self.record_max())
        } else {
            vec![(0, len)]
        }
    }

    /// Log bytes the writes in flight may take: every segment but the metadata reserve and
    /// `others` owners' current segments (never freed while their owner lasts). Writes
    /// admitted together count one per cached volume and replica set (any may have one by
    /// the time they append); a write alone counts the current segments other owners hold.
    fn log_budget(&self, others: u64) -> u64 {
        let sb = self.log.superblock();
        (sb.segment_count)
            .saturating_sub(self.log.meta_reserve() as u64)
            .saturating_sub(others)
            * sb.segment_size
    }

    fn owners(&self) -> u64 {
        self.cached_volumes.load(Ordering::SeqCst) + self.replica_sets.load(Ordering::SeqCst)
    }

    /// A fair share of the log: for each cached volume, and for each volume this host holds
    /// replicas of.
    fn share_segments(&self) -> u64 {
        let n = (self.cached_volumes.load(Ordering::SeqCst)
            + self.replica_sets.load(Ordering::SeqCst))
        .max(1);
        (self.log.superblock().segment_count / n).max(2)
    }

    fn share_bytes(&self) -> u64 {
        self.share_segments() * self.log.superblock().segment_size
    }

    /// Log bytes (as [`log_bytes`] counts them) a volume's dirty records and admitted writes
    /// may take before its writes stall: [`STALL_FRACTION`] of its share, less what packing
    /// can waste. A part that does not fit in what is left of a segment goes to the next one,
    /// so up to one part's worth ([`Shared::record_max`]) of every segment may stay empty.
    fn stall_limit(&self) -> u64 {
        let seg = self.log.superblock().segment_size;
        let packed = (seg - self.record_max()) as f64 / seg as f64;
        (self.share_bytes() as f64 * STALL_FRACTION * packed) as u64
    }

    /// Evicts one clean segment from the attached volume most over its share (the volume
    /// asking, `except`, last). True if something was evicted.
    fn evict_elsewhere(&self, except: Option<Uuid>) -> bool {
        let share = self.share_segments() as i64;
        let mut vols: Vec<Arc<VolCache>> = lock(&self.vols)
            .iter()
            .filter_map(|w| w.upgrade())
            .collect();
        vols.sort_by_key(|v| {
            let over = self.log.segments_of(v.id) as i64 - share;
            (Some(v.id) == except, std::cmp::Reverse(over))
        });
        vols.iter().any(|v| v.evict_one())
    }
}

/// The host's cache: the log on the cache device, the cached volumes, and the destager.
pub struct CacheHost {
    shared: Arc<Shared>,
    vols: Mutex<Vec<Arc<VolCache>>>,
    recovered: Mutex<HashMap<Uuid, Recovered>>,
    /// Other hosts' volumes this host is a peer of ([`replicas`]).
    replicas: Mutex<HashMap<Uuid, replicas::ReplicaSet>>,
    /// The lowest generation the next attach of a volume may start ([`CacheHost::raise_gen`]).
    gen_floor: Mutex<HashMap<Uuid, u64>>,
    /// How many times [`CacheHost::run_destager`] has looked at the volumes.
    destager_passes: AtomicU64,
}

impl CacheHost {
    /// Opens the cache log on `dev`, formatting it if it holds no log. Scans it and keeps what
    /// each volume needs for replay until the volume attaches.
    pub fn open(dev: Arc<dyn CacheDevice>, segment_size: u64) -> Result<Arc<CacheHost>, Error> {
        let (log, scanned) = match Log::open(dev.clone()) {
            Ok(x) => x,
            Err(LogError::Format { msg, .. }) => {
                // Only a device that never held a log is formatted. A damaged superblock, a
                // log of another version or a device that shrank may still hold dirty data:
                // formatting it would destroy that silently.
                let mut head = vec![0u8; cachelog::format::SUPER_LEN];
                dev.read_at(0, &mut head)
                    .map_err(|e| Error::Cache(format!("read {}: {e}", dev.describe())))?;
                if head.iter().any(|b| *b != 0) {
                    return Err(Error::Cache(format!(
                        "cache device {} holds data that is not a usable Vesta cache log ({msg}); \
                         refusing to format it, since it may hold writes not yet destaged. If \
                         its contents are no longer needed, delete the cache file (or zero the \
                         device's first 4 KiB) and start again",
                        dev.describe()
                    )));
                }
                info!(
                    "cache device {}: new; formatting it with {} KiB segments",
                    dev.describe(),
                    segment_size >> 10
                );
                (Log::format(dev, segment_size).map_err(log_err)?, Vec::new())
            }
            Err(e) => return Err(log_err(e)),
        };
        let log = Arc::new(log);
        let mut recovered = recover(&log, scanned);
        // Claim every recovered dirty record before anything is appended, so the log can free
        // all else; volumes take the claims over when they attach.
        for r in recovered.values_mut() {
            for s in r.writes.iter().flatten() {
                log.pin(&s.loc);
            }
            r.pinned_by_host = true;
        }
        log.finish_recovery().map_err(log_err)?;
        let mut sets = HashMap::new();
        for id in recovered
            .iter()
            .filter(|(_, r)| r.replica)
            .map(|(id, _)| *id)
            .collect::<Vec<_>>()
        {
            let r = recovered.remove(&id).expect("present");
            if !r.writes.is_empty() {
                info!(
                    "cache log holds {} replicated write(s) of volume {id} (generation {}) \
                     as a peer",
                    r.writes.len(),
                    r.gen
                );
                sets.insert(id, replicas::from_recovered(r));
            }
        }
        let replica_sets = AtomicU64::new(sets.len() as u64);
        Ok(Arc::new(CacheHost {
            replicas: Mutex::new(sets),
            gen_floor: Mutex::new(HashMap::new()),
            shared: Arc::new(Shared {
                log,
                vols: Mutex::new(Vec::new()),
                wake: Notify::new(),
                space: Notify::new(),
                cached_volumes: AtomicU64::new(0),
                replica_sets,
                bufs: Arc::new(BufPool::default()),
                admission: Mutex::new(HostAdmission::default()),
                admitted: Notify::new(),
            }),
            vols: Mutex::new(Vec::new()),
            recovered: Mutex::new(recovered),
            destager_passes: AtomicU64::new(0),
        }))
    }

    /// How many times the destager has looked at the volumes for a window to start: once
    /// per window that ends, per wake-up and per idle interval.
    pub fn destager_passes(&self) -> u64 {
        self.destager_passes.load(Ordering::Relaxed)
    }

    pub fn log(&self) -> &Arc<Log> {
        &self.shared.log
    }

    /// Volumes the log holds dirty data for, and the policy the log last recorded for each.
    pub fn recovered_volumes(&self) -> Vec<(Uuid, Option<Policy>, usize)> {
        lock(&self.recovered)
            .iter()
            .map(|(id, r)| (*id, r.policy, r.writes.len()))
            .collect()
    }

    /// Attaches a volume to the cache in `mode`, claiming any dirty data recovered for it.
    pub fn attach(
        &self,
        id: Uuid,
        name: &str,
        store: Extent,
        mode: Mode,
        opts: VolOpts,
    ) -> Result<Arc<VolCache>, Error> {
        if lock(&self.replicas).contains_key(&id) {
            return Err(Error::Cache(format!(
                "this host holds replicas of volume {id} as a peer; replay or drop them first"
            )));
        }
        let mut rec = lock(&self.recovered).remove(&id).unwrap_or_default();
        if let Some(why) = &rec.degraded {
            warn!("volume {name}: {why}");
        }
        rec.min_gen = lock(&self.gen_floor).get(&id).copied().unwrap_or(0);
        let held: Vec<Loc> = if rec.pinned_by_host {
            rec.writes.iter().flatten().map(|s| s.loc).collect()
        } else {
            Vec::new()
        };
        let backup = rec.shallow_copy();
        let v = match VolCache::new(
            id,
            name.to_owned(),
            store,
            mode,
            opts,
            self.shared.clone(),
            rec,
        ) {
            Ok(v) => Arc::new(v),
            Err(e) => {
                // Keep what was recovered for the next attempt; the host's pins still hold it.
                lock(&self.recovered).insert(id, backup);
                return Err(e);
            }
        };
        for l in held {
            self.shared.log.unpin(&l); // the volume's staging queue pins them now
        }
        self.shared.cached_volumes.fetch_add(1, Ordering::SeqCst);
        lock(&self.shared.vols).push(Arc::downgrade(&v));
        lock(&self.vols).push(v.clone());
        self.shared.wake.notify_one();
        Ok(v)
    }

    /// Detaches a volume whose dirty data has been destaged (or is being thrown away, for a
    /// deleted volume): its records are released. If it is clean they are also erased from
    /// the log for good ([`Log::erase`]), so that no restart can find them and replay them
    /// over what the volume writes to its datastore from now on. Dirty records stay on the
    /// device (only forgotten): a replay that gave up leaves them for the next start. An error
    /// means the cache device failed (the volume is detached all the same). Detaching a
    /// volume again does nothing.
    pub async fn detach(&self, v: &VolCache) -> Result<(), Error> {
        {
            // This very attachment: a volume reopened since (a relocation) has the same id.
            let mut vols = lock(&self.vols);
            if !vols.iter().any(|x| std::ptr::eq(&**x, v)) {
                return Ok(());
            }
            vols.retain(|x| !std::ptr::eq(&**x, v));
        }
        lock(&self.shared.vols).retain(|x| x.upgrade().is_some_and(|x| !std::ptr::eq(&*x, v)));
        self.shared.cached_volumes.fetch_sub(1, Ordering::SeqCst);
        // From here the volume's IO goes straight to the datastore: no write of its destager
        // may land after it (callers stop the destager first, so this rarely waits).
        {
            let mut d = v.destaging.lock().await;
            if let Some(e) = v.settle(&mut d.trailing).await {
                v.trailing_failed(e);
            }
        }
        let clean = v.clean();
        v.release_all();
        let (log, id) = (self.shared.log.clone(), v.id);
        if !clean {
            log.forget(id);
            return Ok(());
        }
        blocking(move || Ok(log.erase(id)))
            .await
            .map_err(|e| Error::Cache(format!("erase the volume's records: {e}")))?
            .map_err(log_err)
    }

    /// Drops what recovery kept of volume `id`, which never attached and is gone (deleted
    /// with its storage): its records are released and erased from the log, as
    /// [`CacheHost::detach`] does for an attached volume. Otherwise they stay pinned, their
    /// segments lost to every volume, until the next start. Replicas this host holds for
    /// another host's volume are not touched. An error means the cache device failed.
    pub async fn drop_recovered(&self, id: Uuid) -> Result<(), Error> {
        let r = {
            let mut rec = lock(&self.recovered);
            if rec.get(&id).is_none_or(|r| r.replica) {
                return Ok(());
            }
            rec.remove(&id).expect("present")
        };
        if !r.writes.is_empty() {
            warn!(
                "dropping {} dirty write(s) of deleted volume {id} from the cache log",
                r.writes.len()
            );
        }
        for s in r.writes.iter().flatten() {
            self.shared.log.unpin(&s.loc);
        }
        let log = self.shared.log.clone();
        blocking(move || Ok(log.erase(id)))
            .await
            .map_err(|e| Error::Cache(format!("erase the volume's records: {e}")))?
            .map_err(log_err)
    }

    /// Ends start-up recovery once the volumes the coordinator knows have opened. Dirty data
    /// of volumes in `keep` that have not attached yet (their datastore is down) stays claimed
    /// until they do; dirty data of volumes that no longer exist is reported and released.
    pub fn finish_recovery(&self, keep: &[Uuid]) -> Result<(), Error> {
        let mut rec = lock(&self.recovered);
        rec.retain(|id, r| {
            if keep.contains(id) && (!r.writes.is_empty() || r.degraded.is_some()) {
                warn!(
                    "volume {id} has {} dirty write(s) in the cache log but is not open yet; \
                     they are kept for when it opens{}",
                    r.writes.len(),
                    r.degraded
                        .as_deref()
                        .map(|d| format!(" ({d})"))
                        .unwrap_or_default()
                );
                return true;
            }
            if keep.contains(id) {
                return false; // clean: its segments are freed as its records are
            }
            if !r.writes.is_empty() {
                warn!(
                    "cache log holds {} dirty write(s) of volume {id}, which no longer exists; \
                     dropping them",
                    r.writes.len()
                );
            }
            for s in r.writes.iter().flatten() {
                self.shared.log.unpin(&s.loc);
            }
            // The log gave it a segment with copies of its checkpoint and policy at recovery;
            // nobody will ever release that one but this.
            self.shared.log.forget(*id);
            false
        });
        Ok(())
    }

    fn volumes(&self) -> Vec<Arc<VolCache>> {
        lock(&self.vols).clone()
    }

    /// One destager turn: one window from every volume that has one ready, starting the round
    /// robin at `turn`. True if any window was destaged.
    pub async fn destage_turn(&self, turn: usize) -> bool {
        let vols = self.volumes();
        let mut progressed = false;
        let n = vols.len();
        for i in 0..n {
            let v = &vols[(turn + i) % n];
            if v.window_ready(Instant::now()) {
                progressed |= v.destage_window().await;
            }
        }
        progressed
    }

    /// Waits until no datastore write of a replay's pieces is in flight for any volume (they
    /// may outlast their turn, [`Trailing`]); a failed one starts its replay over.
    pub async fn destage_settled(&self) {
        for v in self.volumes() {
            let mut d = v.destaging.lock().await;
            if let Some(e) = v.settle(&mut d.trailing).await {
                v.trailing_failed(e);
            }
        }
    }

    /// The destager: visits volumes round robin, one window per turn, until `stopped` says so;
    /// then returns once no window is in flight.
    ///
    /// The volumes of one datastore take turns, one window at a time, as [`Self::destage_turn`]
    /// does; those of different datastores are destaged at once. A datastore that hangs (an
    /// NFS hard mount, an NBD server gone silent with its connection up) then holds up its own
    /// volumes only, as one that fails does (DESIGN §4), instead of every volume of the host;
    /// and memory holds at most one window per datastore (and the buffers of a replay
    /// piece's writes still in flight, [`Trailing`]).
    pub async fn run_destager(self: Arc<Self>, stopped: impl Fn() -> bool) {
        let mut turn = 0usize;
        // The windows in flight, each on its own task (aborted if this future is dropped),
        // with the datastore (by its gate) and volume of each; volumes whose last window made
        // no progress rest until the given time (a retry at once could spin), without holding
        // up the other volumes of their datastore.
        type Busy = HashMap<tokio::task::Id, (usize, Uuid)>;
        let mut windows: tokio::task::JoinSet<bool> = tokio::task::JoinSet::new();
        let mut busy: Busy = HashMap::new();
        let mut resting: HashMap<Uuid, Instant> = HashMap::new();
        let ended =
            |busy: &mut Busy,
             resting: &mut HashMap<Uuid, Instant>,
             r: Result<(tokio::task::Id, bool), tokio::task::JoinError>| {
                let (id, progressed) = match r {
                    Ok((id, p)) => (id, p),
                    Err(e) => (e.id(), false), // it panicked: the log is failed (`Log::append`)
                };
                if let Some((_, volume)) = busy.remove(&id) {
                    if !progressed {
                        resting.insert(volume, Instant::now() + DESTAGER_IDLE);
                    }
                }
            };
        loop {
            self.destager_passes.fetch_add(1, Ordering::Relaxed);
            let now = Instant::now();
            resting.retain(|_, until| *until > now);
            let vols = self.volumes();
            let n = vols.len();
            let ds_of = |v: &VolCache| Arc::as_ptr(v.store.gate()) as usize;
            let waits = |busy: &Busy, resting: &HashMap<Uuid, Instant>, v: &VolCache| {
                busy.values().any(|(b, _)| *b == ds_of(v)) || resting.contains_key(&v.id)
            };
            for i in 0..n {
                let v = &vols[(turn + i) % n];
                let waiting = waits(&busy, &resting, v);
                if !waiting {
                    // Before its readiness is read: a write that saw the flag still set was
                    // staged before this clears it, so the read below sees it.
                    v.destager_will_look.store(false, Ordering::SeqCst);
                }
                // Readiness first: it also tells of a replay that is done, whose writes wait.
                if !v.window_ready(now) || waiting {
                    continue;
                }
                let (ds, volume) = (ds_of(v), v.id);
                let v = v.clone();
                let h = windows.spawn(async move { v.destage_window().await });
                busy.insert(h.id(), (ds, volume));
            }
            // Until a window ends (or the rest is over, at most DESTAGER_IDLE from now) the
            // volumes that wait need not wake the destager: it looks at them again then.
            for v in &vols {
                if waits(&busy, &resting, v) {
                    v.destager_will_look.store(true, Ordering::SeqCst);
                }
            }
            turn = turn.wrapping_add(1);
            tokio::select! {
                Some(r) = windows.join_next_with_id(), if !windows.is_empty() => {
                    ended(&mut busy, &mut resting, r)
                }
                _ = self.shared.wake.notified() => {}
                _ = tokio::time::sleep(DESTAGER_IDLE) => {}
            }
            while let Some(r) = windows.try_join_next_with_id() {
                ended(&mut busy, &mut resting, r);
            }
            if stopped() {
                // A caller that stops the destager may give up the volume's lock next: no
                // window may still be writing.
                while let Some(r) = windows.join_next_with_id().await {
                    ended(&mut busy, &mut resting, r);
                }
                // Nor any write a replay's piece left in flight.
                self.destage_settled().await;
                for v in self.volumes() {
                    v.destager_will_look.store(false, Ordering::SeqCst);
                }
                return;
            }
        }
    }
}

/// `f`'s output, unless `deadline` passes first.
async fn by<T>(
    deadline: Option<tokio::time::Instant>,
    f: impl std::future::Future<Output = T>,
) -> Option<T> {
    match deadline {
        None => Some(f.await),
        Some(at) => tokio::time::timeout_at(at, f).await.ok(),
    }
}

/// A destage window: the writes it carries (a prefix of the staging queue), the ser its
/// checkpoint moves to, the log ticket that makes its records durable, its datastore IOs
/// ([`window::coalesce`], [`window::runs`]) and the records they read (pinned until read).
struct Window {
    writes: Vec<Staged<Loc>>,
    last: u64,
    ticket: u64,
    pieces: Vec<window::Piece<Loc>>,
    runs: Vec<Range<usize>>,
    locs: Vec<Loc>,
    /// Whether later writes could not have joined it (see `compose`).
    closed: bool,
}

/// A window's bytes, read from the log and verified.
struct WindowData {
    /// Each run's bytes (`None` for zeroes).
    runs: Vec<Option<Bytes>>,
    /// The pool buffers small runs were packed into, each shared by its runs' bytes; back to
    /// the pool once the runs' writes are done and nothing else holds them.
    slabs: Vec<Bytes>,
}

type ReadTask = tokio::task::JoinHandle<std::io::Result<WindowData>>;

/// The next window, its records being read while the current window is written.
struct ReadAhead {
    window: Window,
    read: ReadTask,
}

/// A destage write's outcome and service time, with its buffer to use again and its offset.
type SentRun = ((std::io::Result<()>, Duration), Option<Bytes>, u64);

/// What the destager keeps of a volume between its turns.
#[derive(Default)]
struct Destaging {
    /// The next window, its records being read while the current one is written.
    ahead: Option<ReadAhead>,
    trailing: Trailing,
}

/// Datastore writes of a replay's pieces (or of any window forced to the reach after a
/// datastore error) still in flight. A piece short of the reach does not wait for its writes:
/// the next piece's go out behind them, at most the datastore's queue depth in all, and a write waits only for one in flight whose range it overlaps (a newer
/// version must not land under an older one). Nothing is flushed or checkpointed until the
/// piece that reaches the reach has waited for all of them. Each write's error counts: the
/// window starts over ([`VolState::sent`]).
#[derive(Default)]
struct Trailing {
    set: tokio::task::JoinSet<SentRun>,
    /// The range of each write in `set`, start → end; they never overlap.
    ranges: BTreeMap<u64, u64>,
    /// Slabs that writes in `set` may hold slices of: each back to the pool once none does.
    slabs: Vec<Bytes>,
}

impl Trailing {
    /// Whether a write in flight overlaps `start..end`. Their ranges are disjoint, so only
    /// the last one starting before `end` can.
    fn overlaps(&self, start: u64, end: u64) -> bool {
        self.ranges
            .range(..end)
            .next_back()
            .is_some_and(|(_, &e)| e > start)
    }
}

/// Buffers of [`window::RUN_BYTES_MAX`] for the destager's datastore writes. Each window
/// would otherwise allocate its bytes afresh, and memory that new costs a page fault and a
/// zeroed page per 4 KiB: more than reading the log and sending the bytes together.
#[derive(Default)]
struct BufPool {
    free: Mutex<Vec<BytesMut>>,
}

/// Buffers a pool keeps (1 MiB each): a window's worth.
const BUF_POOL_MAX: usize = (WINDOW_BYTES_MAX / window::RUN_BYTES_MAX) as usize;

impl BufPool {
    /// A buffer of `len` bytes, for the caller to overwrite whole; pooled when `len` is large
    /// enough to be worth it. A pooled buffer keeps the bytes of its last use: zeroing 1 MiB
    /// on every reuse cost more than a fifth of the destager's CPU (`perf`, wbp 64 KiB
    /// writes). Only bytes beyond its last length are zeroed. The pool serves every volume,
    /// so a caller must fill all `len` bytes before it sends any ([`read_runs`] checks).
    fn take(&self, len: usize) -> BytesMut {
        if !Self::pools(len) {
            return BytesMut::zeroed(len);
        }
        let size = window::RUN_BYTES_MAX as usize;
        let mut b = lock(&self.free)
            .pop()
            .unwrap_or_else(|| BytesMut::with_capacity(size));
        if b.len() >= len {
            b.truncate(len);
        } else {
            b.resize(len, 0);
        }
        b
    }

    /// Whether a buffer of `len` bytes comes from the pool.
    fn pools(len: usize) -> bool {
        let size = window::RUN_BYTES_MAX as usize;
        len > size / 4 && len <= size
    }

    /// Returns a buffer whose write is done, if nothing else holds it.
    fn put(&self, b: Bytes) {
        let _ = self.put_if_free(b);
    }

    /// Returns a buffer to the pool if nothing else holds it any more (a write's slice of a
    /// slab); else gives it back to the caller.
    fn put_if_free(&self, b: Bytes) -> Option<Bytes> {
        let size = window::RUN_BYTES_MAX as usize;
        match b.try_into_mut() {
            Ok(b) => {
                let mut free = lock(&self.free);
                if b.capacity() == size && free.len() < BUF_POOL_MAX {
                    free.push(b);
                }
                None
            }
            Err(b) => Some(b),
        }
    }
}

/// The data of each run (`None` for zeroes): each piece's bytes read from its record and
/// verified, straight into the run's buffer when the piece is a whole record. Runs too small
/// for a pool buffer of their own are packed into shared ones (slabs): a window of 4 KiB
/// writes would otherwise allocate thousands of small buffers, and the allocator gives their
/// memory back and faults it in again for every window.
fn read_runs(
    log: &Log,
    volume: Uuid,
    bufs: &BufPool,
    runs: &[Vec<window::Piece<Loc>>],
) -> std::io::Result<WindowData> {
    let io = |e: LogError| std::io::Error::other(e.to_string());
    let slab_size = window::RUN_BYTES_MAX as usize;
    // Records only part of which is in a piece, kept while the chunk may need them again,
    // with the volume offset their header gave.
    let mut partial: HashMap<Loc, (Vec<u8>, u64)> = HashMap::new();
    // What each piece's record must say: this volume's bytes for the piece's offset (a
    // piece does not know its write's `ser`). Wrapping: a position past the piece's offset
    // (a bug) expects an offset no record has, and the read fails as corrupt, not a panic.
    let want = |offset: u64, pos: u64| cachelog::Expect {
        volume,
        offset: offset.wrapping_sub(pos),
        ser: None,
    };
    // Where each run goes: its own buffer, or a range of a slab.
    enum Place {
        Zero,
        Own(BytesMut),
        Slab(usize, usize, usize),
    }
    let mut places = Vec::with_capacity(runs.len());
    let mut slabs: Vec<BytesMut> = Vec::new();
    let mut used = slab_size;
    for run in runs {
        if run.iter().all(|p| matches!(p.source, Source::Zero { .. })) {
            places.push(Place::Zero);
            continue;
        }
        let len = run.iter().map(|p| p.len).sum::<u64>() as usize;
        let mut place = if len > slab_size / 4 {
            Place::Own(bufs.take(len))
        } else {
            if used + len > slab_size {
                slabs.push(bufs.take(slab_size));
                used = 0;
            }
            used += len;
            Place::Slab(slabs.len() - 1, used - len, len)
        };
        let buf: &mut [u8] = match &mut place {
            Place::Own(b) => b,
            Place::Slab(k, at, len) => &mut slabs[*k][*at..*at + *len],
            Place::Zero => unreachable!("zero runs were taken above"),
        };
        let mut at = 0usize;
        for p in run {
            let dst = &mut buf[at..at + p.len as usize];
            match p.source {
                Source::Data(l, 0) if l.len == p.len => {
                    log.read_into(&l, &want(p.offset, 0), dst).map_err(io)?
                }
                Source::Data(l, pos) => {
                    let w = want(p.offset, pos);
                    let (rec, at) = match partial.entry(l) {
                        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                        std::collections::hash_map::Entry::Vacant(e) => {
                            e.insert((log.read(&l, &w).map_err(io)?, w.offset))
                        }
                    };
                    if *at != w.offset {
                        return Err(io(LogError::Corrupt {
                            offset: l.offset,
                            what: format!(
                                "record at volume offset {at} where {} was expected",
                                w.offset
                            ),
                        }));
                    }
                    dst.copy_from_slice(&rec[pos as usize..(pos + p.len) as usize]);
                }
                Source::Zero { .. } => unreachable!("runs of data hold no zero pieces"),
            }
            at += p.len as usize;
        }
        // Every byte of the run came from its records: a pooled buffer holds what its last
        // use left, maybe another volume's data, and none of that may reach this datastore.
        assert_eq!(at, len, "a run's pieces cover it exactly");
        places.push(place);
    }
    let slabs: Vec<Bytes> = slabs.into_iter().map(BytesMut::freeze).collect();
    let runs = places
        .into_iter()
        .map(|p| match p {
            Place::Zero => None,
            Place::Own(b) => Some(b.freeze()),
            Place::Slab(k, at, len) => Some(slabs[k].slice(at..at + len)),
        })
        .collect();
    Ok(WindowData { runs, slabs })
}

/// Groups the scan into each volume's recoverable dirty writes.
fn recover(log: &Log, scanned: Vec<Scanned>) -> HashMap<Uuid, Recovered> {
    let mut by_vol: HashMap<Uuid, BTreeMap<u64, Vec<Scanned>>> = HashMap::new();
    let mut owners: std::collections::HashSet<Uuid> = std::collections::HashSet::new();
    for s in scanned {
        owners.insert(s.header.volume);
        // Only the newest generation counts: older ones are earlier lives of the volume in
        // this cache, fully destaged or deliberately dropped, whose records may linger in
        // freed segments.
        let newest = log.meta(s.header.volume).max_gen;
        if s.header.kind.is_write() && s.header.gen == newest {
            by_vol
                .entry(s.header.volume)
                .or_default()
                .entry(s.header.ser)
                .or_default()
                .push(s);
        }
    }
    let mut out = HashMap::new();
    for id in owners {
        let meta = log.meta(id);
        let (checkpoint, window_end) = match meta.checkpoint {
            Some((ser, gen)) if gen == meta.max_gen => (ser, meta.window_end),
            _ => (0, 0),
        };
        let mut r = Recovered {
            checkpoint,
            window_end: if window_end > checkpoint {
                window_end
            } else {
                0
            },
            gen: meta.max_gen,
            policy: meta.policy.and_then(|(arg, _)| Policy::from_code(arg)),
            ..Recovered::default()
        };
        let groups = by_vol.remove(&id).unwrap_or_default();
        r.replica = groups
            .values()
            .next()
            .is_some_and(|p| p[0].header.kind.is_replica());
        r.void_upto = groups
            .keys()
            .next_back()
            .copied()
            .unwrap_or(0)
            .max(checkpoint);
        let mut stopped_at = None;
        for (expect, (ser, parts)) in (checkpoint + 1..).zip(groups.range(checkpoint + 1..)) {
            if *ser != expect {
                stopped_at = Some(expect);
                break;
            }
            let n = parts
                .first()
                .map(|p| (p.header.arg >> 32).max(1))
                .unwrap_or(1);
            let intact = parts.iter().all(|p| p.intact);
            let mut seen: Vec<u64> = parts.iter().map(|p| p.header.arg & 0xffff_ffff).collect();
            seen.sort_unstable();
            seen.dedup();
            if !intact || seen.len() as u64 != n {
                stopped_at = Some(*ser);
                break;
            }
            r.writes.push(parts.clone());
        }
        if let Some(at) = stopped_at {
            let later = groups.range(at + 1..).count();
            if later > 0 {
                let damaged = groups.get(&at).is_some_and(|p| p.iter().any(|x| !x.intact));
                r.degraded = Some(format!(
                    "cache log record for write {at} is {}; {later} later write(s) of the volume \
                     in the log were discarded to keep it a prefix",
                    if damaged { "damaged" } else { "missing" }
                ));
                // Said when the volume attaches: records of a deleted volume linger in freed
                // segments, with holes where segments were reused, and are no one's loss.
            }
        }
        out.insert(id, r);
    }
    out
}

/// One cached volume.
pub struct VolCache {
    id: Uuid,
    name: String,
    store: Extent,
    shared: Arc<Shared>,
    st: Mutex<VolState>,
    /// Signalled whenever a write completes, the checkpoint moves, or the mode changes.
    changed: Notify,
    ds_latency: Mutex<Ewma>,
    destage_bps: Mutex<Ewma>,
    opts: Mutex<VolOpts>,
    counters: Counters,
    /// Held for the whole of a destage window; a delete takes it to wait one out. It keeps
    /// the next window, read ahead while the current one is written.
    destaging: tokio::sync::Mutex<Destaging>,
    /// Set while the volume's storage is being deleted: no window starts.
    destage_stopped: std::sync::atomic::AtomicBool,
    /// Set by [`CacheHost::run_destager`] while it will look at this volume again without
    /// being woken: a window of its datastore is in flight (whose end makes it look at every
    /// volume) or the volume rests. Its writes then leave the destager be, instead of waking
    /// it once each for nothing (a wake-up per write cost a quarter of a QD32 run).
    destager_will_look: std::sync::atomic::AtomicBool,
}

/// Removes a write from the gatekeeper and marks its `ser` complete, however the write ends.
struct Completion<'a> {
    v: &'a VolCache,
    ser: u64,
    /// Set while the write's records may be in the log but are not yet staged. Dropped
    /// then (a panic on the thread that appends, which may be a connection's, or a future
    /// dropped midway), the write may leave a hole that recovery stops at: the log is
    /// failed, as for a device error, before its `ser` counts as done, so no later write
    /// completes above the hole.
    unstaged: bool,
}

impl Drop for Completion<'_> {
    fn drop(&mut self) {
        if self.unstaged {
            self.v.shared.log.fail();
        }
        let mut st = lock(&self.v.st);
        st.in_flight.remove(&self.ser);
        st.done_above.insert(self.ser);
        loop {
            let next = st.done_ser + 1;
            if !st.done_above.remove(&next) {
                break;
            }
            st.done_ser = next;
        }
        drop(st);
        self.v.changed.notify_waiters();
    }
}

impl VolCache {
    fn new(
        id: Uuid,
        name: String,
        store: Extent,
        mode: Mode,
        opts: VolOpts,
        shared: Arc<Shared>,
        rec: Recovered,
    ) -> Result<VolCache, Error> {
        let last = rec.checkpoint + rec.writes.len() as u64;
        let replaying = !rec.writes.is_empty();
        // With something to replay the volume continues its generation (the replay is in it);
        // otherwise it starts one newer than anything the device holds for it, so records of
        // its earlier lives can never be mistaken for its new ones.
        let gen = if replaying {
            rec.gen.max(1)
        } else {
            (shared.log.meta(id).max_gen + 1).max(rec.min_gen)
        };
        // Without replay the void range is checkpointed at once; with replay, when it ends.
        let checkpoint = if replaying {
            rec.checkpoint
        } else {
            rec.void_upto
        };
        let v = VolCache {
            id,
            name,
            store,
            st: Mutex::new(VolState {
                mode,
                gen,
                next_ser: last.max(rec.void_upto) + 1,
                done_ser: last.max(rec.void_upto),
                done_above: Default::default(),
                in_flight: BTreeMap::new(),
                checkpoint,
                index: ExtentMap::new(),
                staged: VecDeque::new(),
                dirty_bytes: 0,
                dirty_zero_bytes: 0,
                dirty_log_bytes: 0,
                reserved_log_bytes: 0,
                removals: 0,
                removed: std::collections::VecDeque::new(),
                replaying,
                after_replay: None,
                replay_end_retry: None,
                // Everything recovered ([`VolState::reach`]), and no further: past a damaged
                // record nothing is replayed, and new writes take sers above it.
                reach: if replaying { last } else { 0 },
                sent: 0,
                void_upto: rec.void_upto,
                recovered_upto: last,
                degraded: rec.degraded,
                destage: DestageState::default(),
                draining: false,
                replicator: None,
                urgent: 0,
                peer_synced: 0,
                store_flush_owed: mode == Mode::Wb,
                replay_backed: false,
            }),
            changed: Notify::new(),
            ds_latency: Mutex::new(Ewma::new(0.1)),
            destage_bps: Mutex::new(Ewma::new(0.2)),
            opts: Mutex::new(opts),
            counters: Counters::default(),
            destaging: tokio::sync::Mutex::new(Destaging::default()),
            destage_stopped: std::sync::atomic::AtomicBool::new(false),
            destager_will_look: std::sync::atomic::AtomicBool::new(false),
            shared,
        };
        {
            let mut st = lock(&v.st);
            for parts in rec.writes {
                for p in parts {
                    let h = p.header;
                    let src = if h.kind.is_zero() {
                        IxSrc::Zero
                    } else {
                        IxSrc::Rec(p.loc)
                    };
                    // Recovered records are durable (the device was synced before the scan).
                    let alloc = h.kind.allocates();
                    v.stage(&mut st, h.ser, h.offset, h.len, src, alloc, p.loc, 0);
                }
            }
            if st.replaying {
                info!(
                    "volume {:?}: replaying {} dirty write(s) ({} bytes) from the cache log \
                     before it takes writes",
                    v.name,
                    writes_among(st.staged.iter().map(|w| w.w.ser)),
                    st.dirty_bytes
                );
            }
        }
        // Record the policy in effect and where the sequence stands, so a later recovery
        // starts from here.
        let code = match mode {
            Mode::Wt => Policy::Wt.code(),
            Mode::Wb => Policy::Wb.code(),
        };
        let (gen, checkpoint, reach) = {
            let st = lock(&v.st);
            (st.gen, st.checkpoint, st.reach)
        };
        let recorded = v
            .append_meta(Kind::Policy, 0, gen, code)
            .and_then(|_| v.append_meta(Kind::Checkpoint, checkpoint, gen, reach))
            .and_then(|_| v.shared.log.sync())
            .map_err(log_err);
        if let Err(e) = recorded {
            v.release_all(); // the recovered writes stay claimed by the host
            return Err(e);
        }
        Ok(v)
    }

    fn append_meta(&self, kind: Kind, ser: u64, gen: u64, arg: u64) -> Result<(), LogError> {
        self.append_meta_ticket(kind, ser, gen, arg).map(|_| ())
    }

    /// [`VolCache::append_meta`], returning the append's ticket for [`Log::sync_through`].
    fn append_meta_ticket(
        &self,
        kind: Kind,
        ser: u64,
        gen: u64,
        arg: u64,
    ) -> Result<u64, LogError> {
        let e = Entry {
            kind,
            volume: self.id,
            ser,
            gen,
            offset: 0,
            len: 0,
            arg,
        };
        let (loc, ticket) = self.shared.log.append(&e, &[])?;
        // Metadata needs no reference: every new segment carries a copy.
        self.shared.log.unpin(&loc);
        Ok(ticket)
    }

    pub fn id(&self) -> Uuid {
        self.id
    }

    pub fn mode(&self) -> Mode {
        lock(&self.st).mode
    }

    pub fn gen(&self) -> u64 {
        lock(&self.st).gen
    }

    /// Whether the volume is in `wbp` with every peer taking writes.
    pub fn replicating(&self) -> bool {
        lock(&self.st)
            .replicator
            .as_ref()
            .is_some_and(|p| p.healthy())
    }

    /// Whether the volume is in `wbp` (healthy or not).
    pub fn has_peers(&self) -> bool {
        lock(&self.st).replicator.is_some()
    }

    /// Marks the offline replay under way as backed by the peers the vault names for its
    /// generation (see `VolState::replay_backed`). Nothing to mark without a replay.
    pub fn set_replay_backed(&self) {
        let mut st = lock(&self.st);
        st.replay_backed = st.replaying;
    }

    /// Whether the offline replay under way is backed by peers that can finish it if the
    /// cache device fails (false once the replay has ended).
    pub fn replay_backed(&self) -> bool {
        let st = lock(&self.st);
        st.replaying && st.replay_backed
    }

    /// The volume's peers, if it is in `wbp`.
    pub fn peers(&self) -> Option<Arc<dyn Replicator>> {
        lock(&self.st).replicator.clone()
    }

    /// Whether the host's cache device has failed (nothing on it can be read any more).
    pub fn cache_failed(&self) -> bool {
        self.shared.log.is_failed()
    }

    /// Indexes and stages one dirty record (caller holds the state lock).
    #[allow(clippy::too_many_arguments)]
    fn stage(
        &self,
        st: &mut VolState,
        ser: u64,
        offset: u64,
        len: u64,
        src: IxSrc,
        alloc: bool,
        rec: Loc,
        ticket: u64,
    ) {
        let ix = Ix {
            src,
            pos: 0,
            ser,
            wb: true,
        };
        self.index_insert(st, offset, len, ix);
        self.shared.log.pin(&rec);
        let w = StagedWrite {
            w: Staged {
                ser,
                offset,
                len,
                source: match src {
                    IxSrc::Rec(l) => Source::Data(l, 0),
                    IxSrc::Zero => Source::Zero { alloc },
                },
            },
            rec,
            ticket,
            at: Instant::now(),
        };
        // Concurrent writes finish their appends in any order; the queue stays in ser order
        // (parts of one write keep their order). Nearly always this is the back.
        let at = st
            .staged
            .iter()
            .rposition(|x| x.w.ser <= ser)
            .map_or(0, |i| i + 1);
        st.staged.insert(at, w);
        st.dirty_bytes += len;
        if src == IxSrc::Zero {
            st.dirty_zero_bytes += len;
        }
        st.dirty_log_bytes += log_bytes(src, len);
    }

    fn index_insert(&self, st: &mut VolState, offset: u64, len: u64, ix: Ix) {
        if let IxSrc::Rec(l) = ix.src {
            self.shared.log.hold(&l, len);
        }
        for (_, n, old) in st.index.insert(offset, len, ix) {
            if let IxSrc::Rec(l) = old.src {
                self.shared.log.release(&l, n);
            }
        }
    }

    fn index_remove(&self, st: &mut VolState, offset: u64, len: u64) {
        // A read that missed before this removal may hold older data than what is now on the
        // datastore (a wt write, an eviction): its fill must not go in.
        st.removals += 1;
        st.removed.push_back((offset, offset.saturating_add(len)));
        if st.removed.len() > REMOVALS_KEPT {
            st.removed.pop_front();
        }
        for (_, n, old) in st.index.remove(offset, len) {
            if let IxSrc::Rec(l) = old.src {
                self.shared.log.release(&l, n);
            }
        }
    }

    /// Releases everything the volume holds in the log (detach).
    fn release_all(&self) {
        let mut st = lock(&self.st);
        let all: Vec<(u64, u64)> = st.index.iter().map(|(s, l, _)| (s, l)).collect();
        for (s, l) in all {
            self.index_remove(&mut st, s, l);
        }
        for w in std::mem::take(&mut st.staged) {
            self.shared.log.unpin(&w.rec);
        }
        st.dirty_bytes = 0;
        st.dirty_zero_bytes = 0;
        st.dirty_log_bytes = 0;
    }

    /// Waits until `ready` holds for the state, re-checking whenever it changes.
    async fn wait_until(&self, mut ready: impl FnMut(&VolState) -> bool) {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if ready(&lock(&self.st)) {
                return;
            }
            changed.await;
        }
    }

    fn signals(&self, st: &VolState) -> Signals {
        let lat = lock(&self.ds_latency).get().unwrap_or(0.0);
        Signals {
            dirty_writes: st.staged.len() as u64,
            // The log space the stall limit counts ([`VolCache::admit`]): a zeroed range
            // takes one header, whatever its length.
            dirty_bytes: st.dirty_log_bytes + st.reserved_log_bytes,
            // What the destager must move: a zeroed range is one request (counted among
            // the writes), not its length. Otherwise a large TRIM (mkfs, fstrim) would put
            // the pressure at its maximum until it was destaged.
            destage_bytes: st.dirty_bytes - st.dirty_zero_bytes,
            write_latency: Duration::from_secs_f64(lat.max(0.0)),
            destage_bytes_per_s: lock(&self.destage_bps).get().unwrap_or(0.0),
            queue_depth: self.store.gate().queue_depth(),
        }
    }

    fn triggers(&self) -> Triggers {
        Triggers::for_stall_limit(self.shared.stall_limit(), lock(&self.opts).rpo_s)
    }

    /// Admission of a write of `len` bytes: waits out offline replay, and stalls while the
    /// volume's share would be full of dirty data and the log space that writes admitted
    /// before this one may still take.
    ///
    /// Counting writes in flight matters for writes of several parts: each part is appended
    /// on its own, and one that waits for space keeps its earlier parts pinned, while later
    /// writes cannot be destaged before it. Enough of them at once (64 writes of 1 MiB on a
    /// 64 MiB cache) would fill the log with pins and wait for each other forever. Such a
    /// write also counts a segment more, for the part of a segment its pins keep from eviction.
    ///
    /// A stalled write makes the volume's windows due at once ([`Urgent`]): with writes in
    /// flight counted, a held volume can stall before its dirty data alone is enough flow
    /// control pressure to send a held window, and would wait out the hold time.
    async fn admit(
        &self,
        kind: Kind,
        len: u64,
    ) -> Result<(Reservation<'_>, Option<HostCharge<'_>>), Error> {
        let limit = self.shared.stall_limit();
        let need = if kind.has_payload() {
            let parts = self.shared.parts(true, len).len() as u64;
            let mut need = len.next_multiple_of(512) + parts * cachelog::format::HEADER_LEN as u64;
            if parts > 1 {
                need += self.shared.log.superblock().segment_size;
            }
            need
        } else {
            // One header whatever the length: a large TRIM takes no more room than a small one.
            cachelog::format::log_bytes(false, len)
        };
        let mut stalled: Option<Urgent<'_>> = None;
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let admitted = {
                let mut st = lock(&self.st);
                if let Some(why) = &st.degraded {
                    if st.mode == Mode::Wb && self.shared.log.is_failed() {
                        return Err(Error::Cache(why.clone()));
                    }
                }
                let taken = st.dirty_log_bytes + st.reserved_log_bytes;
                let full = st.mode == Mode::Wb && taken > 0 && taken + need > limit;
                if !st.replaying && !full {
                    st.reserved_log_bytes += need;
                    Some(st.mode)
                } else {
                    if full && stalled.is_none() {
                        self.counters.stalls.fetch_add(1, Ordering::Relaxed);
                        drop(st);
                        stalled = Some(Urgent::new(self));
                    }
                    None
                }
            };
            if let Some(mode) = admitted {
                let r = Reservation {
                    v: self,
                    bytes: need,
                };
                // A `wt` write's cache copy gives up when there is no room, and holds nothing
                // while the datastore writes: it takes no host budget (nor fails for want of
                // it). A policy change to `wb` between here and the write's `ser` lets it
                // append uncharged: one write, once.
                let charge = match mode {
                    Mode::Wb => {
                        self.admit_host(len, need).await?;
                        Some(HostCharge {
                            shared: &self.shared,
                            bytes: need,
                        })
                    }
                    Mode::Wt => None,
                };
                return Ok((r, charge));
            }
            self.shared.wake.notify_one();
            tokio::select! {
                _ = changed => {}
                _ = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
        }
    }

    /// Host-wide admission of a write of `len` bytes that may take `need` bytes of the log
    /// ([`HostAdmission`]): in arrival order, once the writes in flight leave room for it,
    /// or at once when none is in flight. A write that would not fit even alone fails.
    async fn admit_host(&self, len: u64, need: u64) -> Result<(), Error> {
        let sh = &*self.shared;
        let mut ticket: Option<Ticket<'_>> = None;
        loop {
            let admitted = sh.admitted.notified();
            tokio::pin!(admitted);
            admitted.as_mut().enable();
            {
                let mut a = lock(&sh.admission);
                let owners = sh.owners();
                let first = match &ticket {
                    None => a.waiting.is_empty(),
                    Some(t) => a.waiting.front() == Some(&t.id),
                };
                if first && a.reserved == 0 {
                    // Alone, a write has every segment but the reserve and the other owners'
                    // current ones, its own current one included (only its unused bytes).
                    let (others, own) = sh.log.current_segments(self.id);
                    let alone =
                        sh.log_budget(others as u64 + u64::from(own.is_some())) + own.unwrap_or(0);
                    if need > alone {
                        let sb = sh.log.superblock();
                        return Err(Error::Cache(format!(
                            "a write of {len} bytes needs more of the cache log than it can \
                             give one write ({} of {} segments of {} bytes, the rest held by \
                             {owners} cached volumes); make the cache larger",
                            alone / sb.segment_size,
                            sb.segment_count,
                            sb.segment_size
                        )));
                    }
                }
                if first && (a.reserved == 0 || a.reserved + need <= sh.log_budget(owners)) {
                    a.reserved += need;
                    if ticket.is_some() {
                        a.waiting.pop_front();
                    }
                    drop(a);
                    drop(ticket); // wakes the next in line
                    return Ok(());
                }
                if ticket.is_none() {
                    let id = a.next_ticket;
                    a.next_ticket += 1;
                    a.waiting.push_back(id);
                    ticket = Some(Ticket { shared: sh, id });
                }
            }
            tokio::select! {
                _ = admitted => {}
                _ = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
        }
    }

    /// Gets a `ser` and waits for every earlier in-flight write that overlaps.
    async fn gatekeep(&self, offset: u64, len: u64) -> (u64, u64) {
        let (ser, gen) = {
            let mut st = lock(&self.st);
            let ser = st.next_ser;
            st.next_ser += 1;
            st.in_flight.insert(ser, (offset, offset + len));
            (ser, st.gen)
        };
        self.wait_until(|st| {
            !st.in_flight
                .range(..ser)
                .any(|(_, (s, e))| offset < *e && *s < offset + len)
        })
        .await;
        (ser, gen)
    }

    /// Appends the records of one write (parts as [`split`] cuts it), making room
    /// in the volume's share first. The records come back pinned (see `Log::append`), in
    /// the guard that comes with them: the caller drops it once it has referenced them
    /// (or, its future dropped, without).
    async fn append_write(
        &self,
        kind: Kind,
        ser: u64,
        gen: u64,
        offset: u64,
        len: u64,
        data: Option<&Bytes>,
    ) -> Result<(Vec<Part>, Pins), Error> {
        let split = self.shared.parts(kind.has_payload(), len);
        let parts = split.len() as u64;
        let mut out = Vec::with_capacity(split.len());
        // The parts' pins: a future dropped midway, or an error, releases them.
        let mut pins = Pins::new(&self.shared.log);
        for (i, (poff, plen)) in (0u64..).zip(split) {
            let e = Entry {
                kind,
                volume: self.id,
                ser,
                gen,
                offset: offset + poff,
                len: plen,
                arg: (parts << 32) | i,
            };
            let payload = data.map(|d| d.slice(poff as usize..(poff + plen) as usize));
            // A fill takes the segments evictions freed since the last sync at most once.
            let mut fill_synced = false;
            loop {
                self.make_room();
                let log = self.shared.log.clone();
                let p = payload.clone();
                let r = blocking(move || {
                    // Pinned from the moment it exists: if this future is dropped before the
                    // append returns, dropping its result unpins the record.
                    let r = log.append(&e, p.as_deref().unwrap_or(&[]));
                    Ok(r.map(|(loc, ticket)| {
                        let mut pin = Pins::new(&log);
                        pin.locs.push(loc);
                        (pin, ticket)
                    }))
                })
                .await
                .unwrap_or_else(|io| {
                    // The append's thread died in it (a panic): whether the record got
                    // out is unknown, and this write's `ser` completes anyway (as failed).
                    // Later writes must not complete above a possible hole, which
                    // recovery would stop at: the log is failed, as for a device error.
                    self.shared.log.fail();
                    Err(LogError::Io {
                        device: "cache".into(),
                        source: io,
                    })
                });
                match r {
                    Ok((pin, ticket)) => {
                        let loc = pin.locs[0];
                        pins.absorb(pin);
                        out.push(Part {
                            loc,
                            offset: e.offset,
                            len: plen,
                            ticket,
                        });
                        break;
                    }
                    Err(LogError::NoSpace) if kind == Kind::Fill => {
                        // Clean data (a read fill, the cache's copy of a wt write) is a bonus:
                        // with no room it is simply not cached. Waiting could wait forever on
                        // space this very write's pinned parts hold (released here). But the
                        // segments evicted since the last sync (`make_room` just now, most
                        // likely) are reusable after one, and a volume that only reads makes
                        // no syncs: without this one, once its share was full nothing it read
                        // was cached again.
                        if !fill_synced {
                            fill_synced = true;
                            let log = self.shared.log.clone();
                            if let Ok(Ok(true)) = on_pool(move || Ok(log.sync_freed())).await {
                                continue;
                            }
                        }
                        return Err(Error::NoRoom);
                    }
                    Err(LogError::NoSpace) => {
                        // Segments evicted or released since the last sync are reusable after
                        // one: take them at once rather than wait for someone else's sync. A
                        // sync, so on the pool, never on a connection's thread.
                        let log = self.shared.log.clone();
                        if let Ok(Ok(true)) = on_pool(move || Ok(log.sync_freed())).await {
                            continue;
                        }
                        // Wait for the destager (or another volume's eviction) to free space.
                        self.counters.space_waits.fetch_add(1, Ordering::Relaxed);
                        self.shared.wake.notify_one();
                        let space = self.shared.space.notified();
                        let _ = tokio::time::timeout(Duration::from_millis(50), space).await;
                        let log = self.shared.log.clone();
                        let _ = on_pool(move || {
                            log.sync().map_err(|e| std::io::Error::other(e.to_string()))
                        })
                        .await;
                    }
                    Err(err) => {
                        let why = format!("cache device failed: {err}");
                        lock(&self.st).degraded.get_or_insert(why.clone());
                        return Err(Error::Cache(why));
                    }
                }
            }
        }
        Ok((out, pins))
    }

    /// Evicts this volume's least recently used clean segment. True if one was evicted.
    fn evict_one(&self) -> bool {
        let log = &self.shared.log;
        let Some(seg) = log.eviction_candidate(self.id) else {
            return false;
        };
        // The index maps into the segment only where its records put data: look there, not
        // through the whole index (a cost per eviction that grew with the volume's size).
        let ranges = log.payload_ranges(seg);
        let mut st = lock(&self.st);
        // Clean extents only. The candidate holds nothing dirty, but until the lock above it
        // could have been evicted by another writer, freed, synced and taken again by an
        // append whose dirty extents must stay.
        let checkpoint = st.checkpoint;
        let in_seg =
            |ix: &Ix| matches!(ix.src, IxSrc::Rec(l) if l.segment == seg) && !ix.dirty(checkpoint);
        let mut found: Vec<(u64, u64)> = Vec::new();
        for (offset, len) in ranges {
            for sp in st.index.lookup(offset, len) {
                if sp.value.as_ref().is_some_and(in_seg) {
                    found.push((sp.start, sp.start + sp.len));
                }
            }
        }
        // A segment's records can overlap: merge what two lookups found.
        found.sort_unstable();
        let mut victims: Vec<(u64, u64)> = Vec::with_capacity(found.len());
        for (s, e) in found {
            match victims.last_mut() {
                Some(last) if s <= last.1 => last.1 = last.1.max(e),
                _ => victims.push((s, e)),
            }
        }
        for &(s, e) in &victims {
            self.index_remove(&mut st, s, e - s);
        }
        // Every record of the segment is listed, so nothing should be left; if something is,
        // the whole index is searched rather than leave the segment unfreeable.
        let mut evicted = !victims.is_empty();
        if log.held(seg) > 0 {
            let rest: Vec<(u64, u64)> = st
                .index
                .iter()
                .filter(|(_, _, ix)| in_seg(ix))
                .map(|(s, l, _)| (s, l))
                .collect();
            if !rest.is_empty() {
                self.counters.eviction_scans.fetch_add(1, Ordering::Relaxed);
                warn!(
                    "volume {:?}: cache segment {seg} had {} extent(s) outside its records; \
                     evicted them too",
                    self.name,
                    rest.len()
                );
                evicted = true;
            }
            for (s, l) in rest {
                self.index_remove(&mut st, s, l);
            }
        }
        if !evicted {
            return false;
        }
        self.counters
            .evicted_segments
            .fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Makes room before an append: evicts the volume's own least recently used clean
    /// segments while it is at its share, and other volumes' (most over their share first)
    /// while the log is nearly out of segments. Never waits.
    fn make_room(&self) {
        let share = self.shared.share_segments() as usize;
        let log = &self.shared.log;
        let low = log.meta_reserve() + 1;
        for _ in 0..64 {
            let progressed = if log.segments_of(self.id) >= share {
                self.evict_one() || self.shared.evict_elsewhere(Some(self.id))
            } else if log.free_segments() <= low {
                self.shared.evict_elsewhere(Some(self.id))
            } else {
                return;
            };
            if !progressed {
                return;
            }
        }
    }

    /// A volume write.
    ///
    /// # Cancel safety
    ///
    /// None: once polled, a write (this, [`VolCache::write_zeroes`]) must be polled to its
    /// end. Its `ser` is taken once it is admitted (dropped before, it leaves no trace).
    /// Dropped while it waits its turn, it never completes, and every later write waits for
    /// it forever (writes complete in `ser` order); dropped (or unwound by a panic) between
    /// its append and its staging, it fails the cache log, since later writes could otherwise
    /// complete above a gap that a recovery stops at. Callers run writes to completion (the
    /// NBD server spawns each request that does not finish at its first poll).
    pub async fn write(&self, offset: u64, data: Bytes, fua: bool) -> Result<(), Error> {
        self.write_kind(Kind::Data, offset, data.len() as u64, Some(data), fua)
            .await
    }

    /// WRITE_ZEROES or TRIM: the range reads as zeroes afterwards. With `alloc` (NO_HOLE)
    /// the datastore keeps it allocated; otherwise it may deallocate it.
    pub async fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        alloc: bool,
        fua: bool,
    ) -> Result<(), Error> {
        let kind = if alloc { Kind::ZeroAlloc } else { Kind::Zero };
        self.write_kind(kind, offset, len, None, fua).await
    }

    async fn write_kind(
        &self,
        kind: Kind,
        offset: u64,
        len: u64,
        data: Option<Bytes>,
        fua: bool,
    ) -> Result<(), Error> {
        let started = Instant::now();
        let (reservation, charge) = self.admit(kind, len).await?;
        let mut reservation = Some(reservation);
        let (ser, gen) = self.gatekeep(offset, len).await;
        let mut done = Completion {
            v: self,
            ser,
            unstaged: false,
        };
        let (mode, peers) = {
            let st = lock(&self.st);
            (st.mode, st.replicator.clone())
        };
        // In wbp, a write whose peers did not all take it completes only once it is on the
        // datastore, as in wt (DESIGN §4, network failure).
        let mut through = false;
        match mode {
            Mode::Wb => {
                done.unstaged = true;
                let local = self.append_write(kind, ser, gen, offset, len, data.as_ref());
                let remote = async {
                    match &peers {
                        Some(p) => {
                            p.write(ReplicaWrite {
                                gen,
                                ser,
                                offset,
                                len,
                                data: data.clone(),
                                alloc: kind.allocates(),
                            })
                            .await
                        }
                        None => Ok(()),
                    }
                };
                // The peers' send first: polled first, it is on its way (or on the socket)
                // before the local append, which may block this thread, runs. The two then
                // overlap instead of adding up.
                let (remote, recs) = tokio::join!(remote, local);
                let (recs, pins) = recs?;
                {
                    let mut st = lock(&self.st);
                    for p in &recs {
                        let src = if kind.is_zero() {
                            IxSrc::Zero
                        } else {
                            IxSrc::Rec(p.loc)
                        };
                        let alloc = kind.allocates();
                        self.stage(&mut st, ser, p.offset, p.len, src, alloc, p.loc, p.ticket);
                    }
                }
                done.unstaged = false;
                // Staged: its records count as dirty now.
                drop(reservation.take());
                drop(pins);
                if let (Err(e), Some(p)) = (remote, &peers) {
                    // The write is staged, but it must not complete (nor let a later write
                    // complete, nor be destaged) while a peer that lacks it could still
                    // replay the volume.
                    self.peer_failed(p, &e).await;
                    through = true;
                }
            }
            Mode::Wt => {
                self.write_through(kind, ser, gen, offset, len, data, fua)
                    .await?
            }
        }
        drop(reservation);
        drop(done);
        // Complete in ser order: see the module doc.
        self.wait_until(|st| st.done_ser >= ser).await;
        if mode == Mode::Wb && peers.is_none() && self.shared.log.is_failed() {
            // A lower write's append may have failed as the cache device died while this one
            // waited: recovery stops at the first missing ser, and nothing destages from a
            // failed log, so this write is nowhere it could be kept. (With peers it is on
            // theirs, and their replay finishes it.)
            return Err(Error::Cache(format!(
                "the cache device {} failed before this write could complete",
                self.shared.log.device().describe()
            )));
        }
        // Destageable now: the host budget may count it as freeable.
        drop(charge);
        if through {
            self.wait_destaged(ser).await?;
        }
        if mode == Mode::Wb {
            // Wake the destager only for a window it would take, and only if it would not
            // look anyway: a held volume's writes, or those of a volume whose datastore has a
            // window in flight, would otherwise wake it once each for nothing.
            if !self.destager_will_look.load(Ordering::SeqCst) && self.window_ready(Instant::now())
            {
                self.shared.wake.notify_one();
            }
            if fua {
                // Durable on stable media: the cache device's, and in wbp every peer's.
                if peers.is_some() {
                    self.flush().await?;
                } else {
                    self.sync().await?;
                }
            }
            self.throttle(started).await;
        }
        Ok(())
    }

    /// `wt`: the datastore and the cache get the write concurrently; it completes when both
    /// have it. If the cache fails, the volume keeps going uncached.
    #[allow(clippy::too_many_arguments)]
    async fn write_through(
        &self,
        kind: Kind,
        ser: u64,
        gen: u64,
        offset: u64,
        len: u64,
        data: Option<Bytes>,
        fua: bool,
    ) -> Result<(), Error> {
        let ds = async {
            let t = Instant::now();
            let r = match &data {
                Some(d) => self.store.write(offset, d.clone(), fua).await,
                // Zeroing has no FUA of its own: a flush makes it durable.
                None => match self
                    .store
                    .write_zeroes(offset, len, !kind.allocates())
                    .await
                {
                    Ok(()) if fua => self.store.flush().await,
                    r => r,
                },
            };
            self.note_latency(t.elapsed());
            r
        };
        let cache_ok = !self.shared.log.is_failed();
        let cache = async {
            if !cache_ok || kind.is_zero() {
                return Ok((Vec::new(), None));
            }
            self.append_write(Kind::Fill, ser, gen, offset, len, data.as_ref())
                .await
                .map(|(recs, pins)| (recs, Some(pins)))
        };
        let (ds, cache) = tokio::join!(ds, cache);
        let mut st = lock(&self.st);
        // No room is not a failure: the range just is not cached (invalidated below).
        let (cache, pins) = match cache {
            Err(Error::NoRoom) => (Ok(Vec::new()), None),
            Err(e) => (Err(e), None),
            Ok((recs, pins)) => (Ok(recs), pins),
        };
        match (&ds, &cache) {
            (Ok(()), Ok(recs)) if !recs.is_empty() => {
                for p in recs {
                    let ix = Ix {
                        src: IxSrc::Rec(p.loc),
                        pos: 0,
                        ser,
                        wb: false,
                    };
                    self.index_insert(&mut st, p.offset, p.len, ix);
                }
            }
            (_, cache) => {
                // The datastore is the truth; whatever the cache held for the range is stale.
                self.index_remove(&mut st, offset, len);
                if let Err(e) = cache {
                    st.degraded
                        .get_or_insert(format!("{e}; serving uncached (no data lost in wt)"));
                }
            }
        }
        drop(st);
        drop(pins);
        ds.map_err(Error::Datastore)
    }

    fn note_latency(&self, d: Duration) {
        lock(&self.ds_latency).add(d.as_secs_f64());
    }

    /// Flow control: holds a write's completion in proportion to the pressure. The delay is
    /// the time the write should take in all: what it already spent (appending, waiting its
    /// turn) counts, so a throttled write never waits more than the delay plus timer slack.
    /// Also keeps the counts of how long writes were held (`throttled_past_bound`,
    /// `longest_write_us`).
    async fn throttle(&self, started: Instant) {
        let (signals, draining) = {
            let st = lock(&self.st);
            (self.signals(&st), st.draining)
        };
        let mut d = flow::delay(&signals, &self.triggers());
        if draining {
            // A policy change is draining: hold writes as if under full pressure.
            d = d.max(signals.write_latency.mul_f64(flow::MAX_MULTIPLE));
        }
        // What the write spent already (admission, its turn, the append, its FUA sync) counts
        // toward the delay. The hold flow control asks for is checked against its bound, not
        // how late the timer fires.
        let spent = started.elapsed();
        let rest = d.saturating_sub(spent);
        if !rest.is_zero() && spent + rest > flow::hold_bound(signals.write_latency) {
            self.counters
                .throttled_past_bound
                .fetch_add(1, Ordering::Relaxed);
        }
        if !d.is_zero() {
            self.counters
                .throttled_writes
                .fetch_add(1, Ordering::Relaxed);
            self.counters
                .throttle_us
                .fetch_add(rest.as_micros() as u64, Ordering::Relaxed);
            if !rest.is_zero() {
                tokio::time::sleep(rest).await;
            }
        }
        self.counters
            .longest_write_us
            .fetch_max(started.elapsed().as_micros() as u64, Ordering::Relaxed);
    }

    /// Makes every completed write durable on the cache device (group commit).
    pub async fn sync(&self) -> Result<(), Error> {
        let log = self.shared.log.clone();
        on_pool(move || log.sync().map_err(|e| std::io::Error::other(e.to_string())))
            .await
            .map_err(|e| Error::Cache(e.to_string()))
    }

    /// Makes the first `ticket` completed appends durable (nothing to do if they are).
    async fn sync_through(&self, ticket: u64) -> Result<(), Error> {
        let log = self.shared.log.clone();
        on_pool(move || {
            log.sync_through(ticket)
                .map_err(|e| std::io::Error::other(e.to_string()))
        })
        .await
        .map_err(|e| Error::Cache(e.to_string()))
    }

    /// FLUSH: in `wb`, completed writes are on the cache device once it is synced; in
    /// `wbp`, on every peer's as well (the flush is forwarded); in `wt` they are on the
    /// datastore, which is flushed.
    pub async fn flush(&self) -> Result<(), Error> {
        let (mode, peers, done, owed) = {
            let st = lock(&self.st);
            (
                st.mode,
                st.replicator.clone(),
                st.done_ser,
                st.store_flush_owed,
            )
        };
        if owed && mode == Mode::Wb {
            // Internal: the losses a client is owed a report of (`Extent::flush`) are those of
            // writes it made through this volume's wb cache, which the destager answers for.
            self.store
                .flush_internal()
                .await
                .map_err(Error::Datastore)?;
            lock(&self.st).store_flush_owed = false;
        }
        match (mode, peers) {
            (Mode::Wb, None) => self.sync().await,
            (Mode::Wb, Some(p)) => {
                let (local, remote) = tokio::join!(self.sync(), p.flush());
                local?;
                if remote.is_ok() {
                    let mut st = lock(&self.st);
                    st.peer_synced = st.peer_synced.max(done);
                }
                if let Err(e) = remote {
                    // Durable only locally: the writes this flush covers count once they
                    // are on the datastore (a checkpoint follows a datastore flush).
                    self.peer_failed(&p, &e).await;
                    self.wait_destaged(done).await?;
                }
                Ok(())
            }
            (Mode::Wt, _) => self.store.flush().await.map_err(Error::Datastore),
        }
    }

    /// A peer failed a write or flush: waits until the failed peers are out of the vault
    /// (retrying; meanwhile nothing more of the volume completes). See [`Replicator`]. Gives
    /// up once the cache device has failed: the vault then goes to the hand-off (or the loss),
    /// and the caller's wait for the datastore fails the IO, which so never completes.
    async fn peer_failed(&self, p: &Arc<dyn Replicator>, e: &str) {
        let mut warned = false;
        loop {
            if self.shared.log.is_failed() {
                return;
            }
            match p.exclude_failed().await {
                Ok(()) => return,
                Err(why) => {
                    if !warned {
                        warn!(
                            "volume {:?}: a peer failed ({e}) and it cannot be excluded yet \
                             ({why}); writes wait",
                            self.name
                        );
                        warned = true;
                    }
                    lock(&self.st).degraded.get_or_insert(format!(
                        "a peer failed ({e}); waiting to exclude it: {why}"
                    ));
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
    }

    /// Waits until the datastore holds every write up to `ser` (a checkpoint at or above it).
    /// Held windows are not held meanwhile.
    async fn wait_destaged(&self, ser: u64) -> Result<(), Error> {
        let _urgent = Urgent::new(self);
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            {
                let st = lock(&self.st);
                if st.checkpoint >= ser {
                    return Ok(());
                }
                if self.shared.log.is_failed() {
                    return Err(Error::Cache(
                        "the cache device failed before the write reached the datastore".into(),
                    ));
                }
            }
            self.shared.wake.notify_one();
            tokio::select! {
                _ = changed => {}
                _ = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
        }
    }

    /// A volume read: cache hits from the log, misses from the datastore (then cached).
    ///
    /// # Cancel safety
    ///
    /// Dropped at any point, a read leaves nothing behind: the records it pinned, and the
    /// record its fill was appending, are unpinned ([`Pins`]).
    pub async fn read(&self, offset: u64, len: u32) -> Result<Bytes, Error> {
        let len64 = u64::from(len);
        if self.shared.log.is_failed() {
            // Nothing on the cache device can be read any more: clean data comes from the
            // datastore; dirty data is lost, and saying so is the only honest answer.
            let lost = {
                let st = lock(&self.st);
                st.index
                    .lookup(offset, len64)
                    .iter()
                    .any(|sp| sp.value.is_some_and(|ix| ix.dirty(st.checkpoint)))
            };
            if lost {
                return Err(Error::Cache(format!(
                    "bytes {offset}+{len} were dirty on the failed cache device"
                )));
            }
            return self
                .store
                .read(offset, len as usize)
                .await
                .map_err(Error::Datastore);
        }
        let (spans, removals, pins) = {
            let st = lock(&self.st);
            let spans = st.index.lookup(offset, len64);
            // Keep the segments while we read them.
            let mut pins = Pins::new(&self.shared.log);
            for sp in &spans {
                if let Some(Ix {
                    src: IxSrc::Rec(l), ..
                }) = sp.value
                {
                    pins.pin(l);
                }
            }
            (spans, st.removals, pins)
        };
        let mut out = BytesMut::zeroed(len as usize);
        let mut misses = Vec::new();
        let mut read_err = None;
        let mut hit = 0;
        for sp in &spans {
            let at = (sp.start - offset) as usize;
            match sp.value {
                None => misses.push((sp.start, sp.len)),
                Some(Ix {
                    src: IxSrc::Zero, ..
                }) => hit += sp.len,
                Some(
                    ix @ Ix {
                        src: IxSrc::Rec(l),
                        pos,
                        ..
                    },
                ) => {
                    let log = self.shared.log.clone();
                    // The device read goes on if this future is dropped: it keeps the
                    // segment until it ends.
                    let keep = pins.again(l);
                    // Wrapping, as in `read_runs`.
                    let want = cachelog::Expect {
                        volume: self.id,
                        offset: sp.start.wrapping_sub(pos),
                        ser: Some(ix.ser),
                    };
                    let io = |e: LogError| std::io::Error::other(e.to_string());
                    let n = sp.len;
                    // Only the pages the span lies in. Inline what memory holds; a read that
                    // waits for the cache device holds up the connection's other requests
                    // only if there are none.
                    let read = blocking_read(
                        || {
                            let r = self.shared.log.read_range_cached(&l, &want, pos, n);
                            r.map(|r| r.map_err(io))
                        },
                        move || {
                            let r = log.read_range(&l, &want, pos, n).map_err(io);
                            drop(keep);
                            r
                        },
                    );
                    match read.await {
                        Ok(d) => out[at..at + n as usize].copy_from_slice(&d),
                        Err(e) => {
                            read_err = Some((e, sp.start, sp.len, ix));
                            break;
                        }
                    }
                    hit += sp.len;
                }
            }
        }
        drop(pins);
        if let Some((e, start, n, ix)) = read_err {
            {
                let mut st = lock(&self.st);
                // Only what the failed record still maps: a write may have replaced some or
                // all of it while the lock was not held, and its entries must stay.
                let same = |v: &Ix| v.src == ix.src && v.ser == ix.ser;
                let stale: Vec<(u64, u64)> = st
                    .index
                    .lookup(start, n)
                    .into_iter()
                    .filter(|sp| sp.value.as_ref().is_some_and(same))
                    .map(|sp| (sp.start, sp.len))
                    .collect();
                let dirty = !stale.is_empty() && ix.dirty(st.checkpoint);
                let why = format!(
                    "cache record for bytes {start}+{n} cannot be read: {e}{}",
                    if dirty { " (dirty data lost)" } else { "" }
                );
                warn!("volume {:?}: {why}", self.name);
                if dirty {
                    st.degraded.get_or_insert(why.clone());
                    return Err(Error::Cache(why));
                }
                // Clean data: the datastore has it. Drop the entries and read from there.
                for (s, l) in stale {
                    self.index_remove(&mut st, s, l);
                }
            }
            return Box::pin(self.read(offset, len)).await;
        }
        self.counters
            .read_hit_bytes
            .fetch_add(hit, Ordering::Relaxed);
        for (start, n) in &misses {
            let d = self
                .store
                .read(*start, *n as usize)
                .await
                .map_err(Error::Datastore)?;
            let at = (start - offset) as usize;
            out[at..at + *n as usize].copy_from_slice(&d);
            self.counters
                .read_miss_bytes
                .fetch_add(*n, Ordering::Relaxed);
            self.fill(*start, d, removals).await;
        }
        Ok(out.freeze())
    }

    /// Caches data read from the datastore, only into ranges still unmapped, and only if
    /// nothing in its range left the index since the read began (module doc). Best effort:
    /// errors are ignored.
    async fn fill(&self, offset: u64, data: Bytes, removals_before: u64) {
        if self.shared.log.is_failed() {
            return;
        }
        let len = data.len() as u64;
        let Ok((recs, pins)) = self
            .append_write(Kind::Fill, 0, 0, offset, len, Some(&data))
            .await
        else {
            return;
        };
        let mut st = lock(&self.st);
        let end = offset + len;
        // The removals since the read began are the last `since` kept, if all are kept.
        let since = (st.removals - removals_before) as usize;
        let stale = since > st.removed.len()
            || st
                .removed
                .iter()
                .rev()
                .take(since)
                .any(|&(from, to)| from < end && offset < to);
        for p in &recs {
            if stale {
                break;
            }
            for sp in st.index.lookup(p.offset, p.len) {
                if sp.value.is_none() {
                    let ix = Ix {
                        src: IxSrc::Rec(p.loc),
                        pos: sp.start - p.offset,
                        ser: 0,
                        wb: false,
                    };
                    self.index_insert(&mut st, sp.start, sp.len, ix);
                }
            }
        }
        drop(st);
        drop(pins);
    }

    /// Stops destaging (no window starts; one in flight is waited out), so the volume's
    /// storage can be freed without a late datastore write landing in it.
    pub async fn stop_destaging(&self) {
        self.stop_destaging_by(None).await;
    }

    /// [`VolCache::stop_destaging`], waiting at most `limit` for the destager's datastore
    /// writes in flight (a datastore that stopped answering can hold them for ever). False if
    /// some are still in flight then: the destager stays stopped (the caller resumes it, or
    /// tries again), and the window they belong to goes on and ends as any other.
    pub async fn stop_destaging_within(&self, limit: Duration) -> bool {
        self.stop_destaging_by(Some(tokio::time::Instant::now() + limit))
            .await
    }

    async fn stop_destaging_by(&self, deadline: Option<tokio::time::Instant>) -> bool {
        self.destage_stopped.store(true, Ordering::SeqCst);
        let Some(mut d) = by(deadline, self.destaging.lock()).await else {
            return false; // a window is still writing
        };
        if let Some(a) = d.ahead.take() {
            // A read of the cache log, not of the datastore (it unpins its records itself).
            if by(deadline, a.read).await.is_none() {
                return false;
            }
        }
        // No write of this volume may be in flight once this returns true.
        let (done, err) = self.settle_by(&mut d.trailing, deadline).await;
        if let Some(e) = err {
            self.trailing_failed(e);
        }
        done
    }

    /// Waits for every write in flight of the pieces sent (`t`), and returns the first error.
    async fn settle(&self, t: &mut Trailing) -> Option<Error> {
        self.settle_by(t, None).await.1
    }

    /// [`VolCache::settle`] until `deadline` at most: whether every write is in, and the first
    /// error among those that ended (a write that ends after the deadline is heard of by the
    /// next settle, or by the next piece).
    async fn settle_by(
        &self,
        t: &mut Trailing,
        deadline: Option<tokio::time::Instant>,
    ) -> (bool, Option<Error>) {
        let mut first_err = None;
        loop {
            // (`join_next` is cancel safe: a write whose end the timeout cut stays in `t`.)
            let Some(r) = by(deadline, t.set.join_next()).await else {
                self.slabs_back(t);
                return (false, first_err);
            };
            let Some(r) = r else { break };
            self.note_write(Some(r), t, &mut first_err);
        }
        t.ranges.clear();
        self.slabs_back(t);
        (true, first_err)
    }

    /// Gives the pool back the slabs of `t` that no write in flight holds a slice of.
    fn slabs_back(&self, t: &mut Trailing) {
        let slabs = std::mem::take(&mut t.slabs);
        t.slabs = slabs
            .into_iter()
            .filter_map(|b| self.shared.bufs.put_if_free(b))
            .collect();
    }

    /// A write of a piece sent before failed: the datastore may lack it, and the pieces were
    /// not flushed, so the window starts over (as a datastore error during a piece does).
    fn trailing_failed(&self, e: Error) {
        let mut st = lock(&self.st);
        if st.sent > st.checkpoint {
            warn!(
                "volume {:?}: a datastore write of the replay failed ({e}); it starts over",
                self.name
            );
        }
        st.sent = 0;
    }

    /// Whether [`VolCache::stop_destaging`] stopped the destager for this volume.
    pub fn destaging_stopped(&self) -> bool {
        self.destage_stopped.load(Ordering::SeqCst)
    }

    pub fn resume_destaging(&self) {
        self.destage_stopped.store(false, Ordering::SeqCst);
        self.shared.wake.notify_one();
    }

    /// Where the next window starts: after the pieces sent of a window forced to the reach
    /// ([`VolState::sent`]), else at the head of the staging queue.
    fn piece_start(st: &VolState) -> u64 {
        if st.sent > st.checkpoint {
            st.sent
        } else {
            0
        }
    }

    /// The index of the first staged write after `ser` (the queue is in `ser` order; a
    /// binary search, since a replay's pieces leave everything before them staged).
    fn staged_after(st: &VolState, ser: u64) -> usize {
        st.staged.partition_point(|w| w.w.ser <= ser)
    }

    /// Whether an offline replay is done destaging and due to end ([`VolCache::finish_replay`]).
    fn replay_done(st: &VolState, now: Instant) -> bool {
        st.replaying && st.staged.is_empty() && st.replay_end_retry.is_none_or(|t| t <= now)
    }

    /// Ends an offline replay once nothing is staged (a destager visit, as a window is):
    /// switches to the mode the volume runs in after it, if it is not `wb` (`after_replay`),
    /// then lets writes in. Writes wait in `admit` until `replaying` clears, so none runs in
    /// the mode the replay needed: if the switch fails (a log with no room even for
    /// metadata), room is made as for a checkpoint, they wait on, and the destager tries again
    /// a second later. Only a failed cache device ends the replay without it: no write
    /// completes in that cache, and the volume reports it (a `wb` write fails on it). True if
    /// the replay ended.
    async fn finish_replay(&self) -> bool {
        let now = Instant::now();
        let mode = {
            let st = lock(&self.st);
            if !Self::replay_done(&st, now) {
                return false;
            }
            st.after_replay
        };
        if let Some(mode) = mode {
            if let Err(e) = self.switch_mode(mode, None) {
                if !self.shared.log.is_failed() {
                    let first = lock(&self.st).replay_end_retry.is_none();
                    if first {
                        warn!(
                            "volume {:?}: offline replay done, but the switch to {mode:?} it \
                             ends with failed ({e}); writes wait, retrying every second",
                            self.name
                        );
                    }
                    self.meta_found_no_space().await;
                    lock(&self.st).replay_end_retry = Some(now + Duration::from_secs(1));
                    return false;
                }
                warn!(
                    "volume {:?}: switch to {mode:?} after replay: {e}",
                    self.name
                );
                // The switch may stand in memory only: its checkpoint, and the replay's
                // last, never reached the device, which a later start may find readable with
                // the replayed records still above its checkpoint. Taken in `wt` straight to
                // the datastore, writes would then be undone by that second replay. So the
                // volume stays a clean `wb` one on a failed device: its writes stall until
                // the daemon records a newer generation in the vault (which discards those
                // records at that start) and serves it uncached.
                let mut st = lock(&self.st);
                st.mode = Mode::Wb;
                st.replicator = None;
            }
        }
        let mut st = lock(&self.st);
        if st.after_replay != mode {
            // `after_replay` asked for another mode meanwhile: the next visit switches to it.
            return false;
        }
        st.after_replay = None;
        st.replay_end_retry = None;
        st.replaying = false;
        info!(
            "volume {:?}: offline replay complete; taking writes in {}",
            self.name,
            if st.mode == Mode::Wt { "wt" } else { "wb" }
        );
        drop(st);
        self.changed.notify_waiters();
        true
    }

    /// Whether the destager should take a window from this volume now, or end its replay
    /// ([`VolCache::finish_replay`]).
    fn window_ready(&self, now: Instant) -> bool {
        if self.destage_stopped.load(Ordering::SeqCst) {
            return false;
        }
        let st = lock(&self.st);
        if Self::replay_done(&st, now) {
            return true;
        }
        if st.staged.is_empty() || st.destage.retry_at.is_some_and(|t| t > now) {
            return false;
        }
        if st.degraded.is_some() && self.shared.log.is_failed() {
            return false; // nothing to destage from
        }
        let opts = *lock(&self.opts);
        if opts.hold.is_zero() || st.replaying || st.draining || st.urgent > 0 {
            return true;
        }
        // The head of the queue is the oldest dirty write.
        let age = st.staged.front().map(|w| now - w.at).unwrap_or_default();
        age >= opts.hold
            || age >= opts.max_dirty_age
            || flow::pressure(&self.signals(&st), &self.triggers()) >= 1.0
    }

    /// Destages one window; true if it made progress.
    async fn destage_window(&self) -> bool {
        let mut guard = self.destaging.lock().await;
        let d = &mut *guard;
        if self.destage_stopped.load(Ordering::SeqCst) {
            return false;
        }
        if Self::replay_done(&lock(&self.st), Instant::now()) {
            // The piece that reached the reach waited for every write (`send_window`).
            debug_assert!(d.trailing.set.is_empty());
            return self.finish_replay().await;
        }
        // The window read ahead during the last turn, if it still starts the queue (the one
        // before it reached the datastore); else a window composed now.
        let (first, gen) = {
            let st = lock(&self.st);
            let start = Self::piece_start(&st);
            (
                st.staged
                    .get(Self::staged_after(&st, start))
                    .map(|w| w.w.ser),
                st.gen,
            )
        };
        let (win, read) = match d.ahead.take() {
            Some(a) if Some(a.window.writes[0].ser) == first => (a.window, a.read),
            stale => {
                if let Some(a) = stale {
                    let _ = a.read.await;
                }
                let Some(win) = self.compose(None) else {
                    return false;
                };
                let read = self.read_window(&win);
                (win, read)
            }
        };
        let last = win.last;
        // A datastore error can cut the window midway: whatever this volume sends next must
        // reach as far ([`VolState::reach`]).
        {
            let mut st = lock(&self.st);
            st.reach = st.reach.max(last);
        }
        // Only durable records are destaged. The datastore then never holds a write the log
        // could lose: a recovery finds every write of every window that went out, and its
        // replay reaches them all before it records a checkpoint (a crash may cut a window,
        // or leave several out above the checkpoint it finds). Free when a client FLUSH or FUA
        // already synced the records (group commit); one sync usually covers several windows.
        if let Err(e) = self.sync_through(win.ticket).await {
            lock(&self.st).degraded.get_or_insert(format!("{e}"));
            return false;
        }
        // The same for the peers in wbp: a peer that lost power could otherwise hold an older
        // run of the sequence than the datastore, and replaying it from a lagging vault
        // checkpoint would put old data back over newer (a state no prefix of the writes
        // gives). So a peer's replay too reaches every write of a window that went out. One
        // forwarded FLUSH usually covers several windows, as the local sync does.
        let (peers, synced, done) = {
            let st = lock(&self.st);
            (st.replicator.clone(), st.peer_synced, st.done_ser)
        };
        if let Some(p) = peers.filter(|_| last > synced) {
            match p.flush().await {
                Ok(()) => {
                    let mut st = lock(&self.st);
                    st.peer_synced = st.peer_synced.max(done);
                }
                // A peer out of the vault can never replay: the window may go.
                Err(_) if p.exclude_failed().await.is_ok() => {}
                Err(_) => return false,
            }
        }
        let started = Instant::now();
        let bytes: u64 = win.pieces.iter().map(|p| p.len).sum();
        let result = match read.await {
            Ok(Ok(datas)) => {
                // The next window's records are read while this one is written and flushed,
                // when the next window is due at once anyway.
                d.ahead = self.read_ahead(last);
                self.send_window(&win, datas, started, &mut d.trailing)
                    .await
            }
            Ok(Err(e)) => {
                // Never destage what cannot be verified.
                let why = format!("a dirty cache record cannot be read ({e}); destaging stopped");
                lock(&self.st).degraded.get_or_insert(why.clone());
                Err(Error::Cache(why))
            }
            Err(e) => Err(Error::Cache(format!("destage read failed: {e}"))),
        };
        if let Err(e) = result {
            // Writes of the pieces before may still be in flight (a record that could not be
            // read): none may be when the window goes again. Their errors change nothing: it
            // starts over anyway.
            let _ = self.settle(&mut d.trailing).await;
            let mut st = lock(&self.st);
            // The pieces sent before were not flushed: a datastore that lost them (an NBD
            // server restarted, a writeback error a failed flush reported once) must get them
            // again. The retry starts the window over.
            st.sent = 0;
            let backoff = if st.destage.backoff.is_zero() {
                Duration::from_millis(500)
            } else {
                (st.destage.backoff * 2).min(BACKOFF_MAX)
            };
            if st.destage.error.is_none() {
                warn!(
                    "volume {:?}: destaging to the datastore failed ({e}); retrying every \
                     {:?} up to {BACKOFF_MAX:?}, nothing is dropped",
                    self.name, backoff
                );
            }
            st.destage = DestageState {
                error: Some(e.to_string()),
                retry_at: Some(Instant::now() + backoff),
                backoff,
            };
            return false;
        }
        // A piece short of the reach: the datastore is no prefix yet, so no checkpoint, and
        // every record stays (a crash sends all the pieces again).
        {
            let mut st = lock(&self.st);
            if last < st.reach {
                st.sent = st.sent.max(last);
                // Counted, but no recovery yet: its writes may still fail.
                self.count_out(&win, bytes);
                return true;
            }
        }
        // The datastore now holds the window durably: record the checkpoint, then release the
        // window's records. The window that ends a replay also covers the void range above it
        // (`Recovered::void_upto`).
        let ends_replay = {
            let st = lock(&self.st);
            st.replaying && st.staged.back().is_some_and(|w| w.w.ser <= last)
        };
        let recorded = if ends_replay {
            last.max(lock(&self.st).void_upto)
        } else {
            last
        };
        let ticket = match self.append_meta_ticket(Kind::Checkpoint, recorded, gen, 0) {
            Ok(t) => t,
            Err(LogError::NoSpace) => {
                // Resending the window later is harmless: nothing is released until a
                // checkpoint lands.
                self.meta_found_no_space().await;
                return false;
            }
            Err(_) => {
                let mut st = lock(&self.st);
                st.degraded
                    .get_or_insert("cache device failed while recording a checkpoint".into());
                return false;
            }
        };
        // In wbp the peers (and through them the vault) learn the checkpoint only once this
        // log holds it durably: they drop their copies up to it, and a replay that started
        // lower here after a power cut (this host back with an older checkpoint) would set
        // blocks back that no peer could put forward again, should this host die midway.
        if lock(&self.st).replicator.is_some() {
            if let Err(e) = self.sync_through(ticket).await {
                lock(&self.st).degraded.get_or_insert(format!("{e}"));
                return false;
            }
        }
        // Otherwise no sync here: the window's records (durable, see above) may be released at
        // once, because a segment they free is reused only after a later sync, which makes
        // this checkpoint durable first (cachelog::log's rules). Until then a crash just
        // replays from the checkpoint before, reaching every write it recovers.
        let mut st = lock(&self.st);
        while st.staged.front().is_some_and(|w| w.w.ser <= last) {
            let w = st.staged.pop_front().expect("front exists");
            st.dirty_bytes -= w.w.len;
            if matches!(w.w.source, Source::Zero { .. }) {
                st.dirty_zero_bytes -= w.w.len;
            }
            st.dirty_log_bytes -= log_bytes_of(&w.w.source, w.w.len);
            self.shared.log.unpin(&w.rec);
        }
        st.checkpoint = recorded;
        if let Some(p) = &st.replicator {
            p.checkpoint(gen, recorded);
        }
        self.went_out(&mut st, &win, bytes, started);
        drop(st);
        // A replay that is done ends at the destager's next visit (`finish_replay`).
        self.changed.notify_waiters();
        self.shared.space.notify_waiters();
        true
    }

    /// Counts a window (or a piece of one) that is on the datastore, `bytes` of it since
    /// `started`, and clears a destage error.
    fn went_out(&self, st: &mut VolState, win: &Window, bytes: u64, started: Instant) {
        let secs = started.elapsed().as_secs_f64().max(1e-6);
        lock(&self.destage_bps).add(bytes as f64 / secs);
        self.count_out(win, bytes);
        if st.destage.error.is_some() {
            info!("volume {:?}: destaging recovered", self.name);
        }
        st.destage = DestageState::default();
    }

    /// Counts the writes and bytes of a window (or a piece of one) sent to the datastore.
    fn count_out(&self, win: &Window, bytes: u64) {
        self.counters
            .destaged_bytes
            .fetch_add(bytes, Ordering::Relaxed);
        self.counters.destaged_writes.fetch_add(
            writes_among(win.writes.iter().map(|w| w.ser)),
            Ordering::Relaxed,
        );
    }

    /// The log is full even for metadata: makes room, and has the destager try again later.
    /// What eviction frees is reusable after a sync, which no one else may be about to make
    /// (every writer waiting for space, or none writing).
    async fn meta_found_no_space(&self) {
        self.shared.evict_elsewhere(None);
        let log = self.shared.log.clone();
        let _ = on_pool(move || Ok(log.sync_freed())).await;
        lock(&self.st).destage.retry_at = Some(Instant::now() + Duration::from_millis(100));
    }

    /// The next window to destage: writes from the head of the staging queue (after `after`,
    /// the last ser of a window still being sent), none past the completion watermark (a lower
    /// ser still in flight is not staged yet, and a checkpoint past it would claim the
    /// datastore has it), closed as the volume's hold time says and at [`WINDOW_MAX`] writes
    /// or [`WINDOW_BYTES_MAX`] bytes, and always at a whole write. Its records are pinned
    /// until read (`read_window`).
    fn compose(&self, after: Option<u64>) -> Option<Window> {
        let st = lock(&self.st);
        let cap = if st.replaying {
            REPLAY_PIECE_BYTES
        } else {
            WINDOW_BYTES_MAX
        };
        let opts = *lock(&self.opts);
        let closing = if opts.hold.is_zero() {
            Closing::Batch {
                max_ios: self.store.gate().queue_depth() as usize * WINDOW_WAVES,
            }
        } else {
            Closing::Held
        };
        let after = after.unwrap_or(0).max(Self::piece_start(&st));
        let start = Self::staged_after(&st, after);
        // A window that starts at or below the reach takes everything up to it, coalesced
        // as a held window is, whatever else would close it; in pieces within the caps, with
        // one checkpoint at the end (`VolState::sent`).
        let reach = st.reach;
        let forced = st.staged.get(start).is_some_and(|w| w.w.ser <= reach);
        let upto = if forced { reach } else { u64::MAX };
        let mut bytes = 0u64;
        let head: Vec<Staged<Loc>> = st
            .staged
            .range(start..)
            .take_while(|w| w.w.ser <= st.done_ser && w.w.ser <= upto)
            .take(WINDOW_MAX)
            .take_while(|w| {
                bytes += w.w.len;
                bytes == w.w.len || bytes <= cap
            })
            .map(|w| w.w)
            .collect();
        let closing = if forced { Closing::Held } else { closing };
        let mut n = window::window_len(&head, closing);
        if n == 0 {
            return None;
        }
        // Closed: the window would be the same if composed later, because something other
        // than the end of the ready writes ended it (an overlap, a cap).
        let closed = n < head.len()
            || st
                .staged
                .get(start + head.len())
                .is_some_and(|w| w.w.ser <= st.done_ser);
        // A window ends at a whole write: all parts of its last ser, past the caps if need be
        // (a checkpoint at that ser releases every part of it).
        let tail = head[n - 1].ser;
        n += st
            .staged
            .range(start + n..)
            .take_while(|w| w.w.ser == tail)
            .count();
        let writes: Vec<Staged<Loc>> = st.staged.range(start..start + n).map(|w| w.w).collect();
        let ticket = st
            .staged
            .range(start..start + n)
            .map(|w| w.ticket)
            .max()
            .unwrap_or(0);
        let pieces = window::coalesce(&writes);
        let runs = window::runs(&pieces);
        let mut locs: Vec<Loc> = pieces
            .iter()
            .filter_map(|p| match p.source {
                Source::Data(l, _) => Some(l),
                Source::Zero { .. } => None,
            })
            .collect();
        locs.sort_by_key(|l| (l.segment, l.offset));
        locs.dedup();
        // Staged records are pinned already; these pins keep them while they are read even if
        // the volume's records are released meanwhile (a delete).
        for l in &locs {
            self.shared.log.pin(l);
        }
        Some(Window {
            last: tail,
            writes,
            ticket,
            pieces,
            runs,
            locs,
            closed,
        })
    }

    /// Reads and verifies every record of a window on the blocking pool, into reused buffers,
    /// each piece that is a whole record straight into its datastore IO; then unpins them.
    fn read_window(&self, w: &Window) -> ReadTask {
        let (log, bufs) = (self.shared.log.clone(), self.shared.bufs.clone());
        let jobs: Vec<Vec<window::Piece<Loc>>> = w
            .runs
            .iter()
            .map(|r| w.pieces[r.clone()].to_vec())
            .collect();
        let (locs, volume) = (w.locs.clone(), self.id);
        tokio::task::spawn_blocking(move || {
            let r = read_runs(&log, volume, &bufs, &jobs);
            for l in &locs {
                log.unpin(l);
            }
            r
        })
    }

    /// The window after the one ending at `last`, its records being read, if the volume
    /// would destage it at once (no hold time, or a replay, drain or urgent flush) and it is
    /// closed already: a window still open to later writes waits for them, or each window
    /// would carry only what completed while the one before was read, and pay a datastore
    /// FLUSH (in `wbp` a peer FLUSH too) for that little.
    fn read_ahead(&self, last: u64) -> Option<ReadAhead> {
        let due = {
            let st = lock(&self.st);
            lock(&self.opts).hold.is_zero() || st.replaying || st.draining || st.urgent > 0
        };
        if !due {
            return None;
        }
        let window = self.compose(Some(last))?;
        if !window.closed {
            self.unpin_window(&window);
            return None;
        }
        let read = self.read_window(&window);
        Some(ReadAhead { window, read })
    }

    /// Releases the pins `compose` took, for a window that will not be read.
    fn unpin_window(&self, w: &Window) {
        for l in &w.locs {
            self.shared.log.unpin(l);
        }
    }

    /// Writes a window (or a piece of one) to the datastore, then flushes it (a piece short of
    /// the reach is not flushed: see below). Its records were all read and verified before
    /// (`read_window`): if the cache device fails or a record is corrupt, the datastore stays
    /// at the last checkpoint, or in a replay at the end of the last piece written (the volume
    /// as of it, if the datastore was at the checkpoint when the replay began), never holding
    /// part of a window or piece. At most the datastore's queue depth of writes is in flight.
    async fn send_window(
        &self,
        win: &Window,
        data: WindowData,
        started: Instant,
        trailing: &mut Trailing,
    ) -> Result<(), Error> {
        let read = started.elapsed();
        let WindowData { runs, slabs } = data;
        let short = win.last < lock(&self.st).reach;
        trailing.slabs.extend(slabs);
        let sent = if self.store.prefers_batches() {
            // A file datastore's batches complete before the next goes: none trail, unless
            // the device changed its mind.
            match self.settle(trailing).await {
                Some(e) => Err(e),
                None => self.send_batches(win, runs).await,
            }
        } else {
            self.send_runs(win, runs, trailing, short).await
        };
        // The slabs no write still in flight holds a slice of go back to the pool: memory holds
        // one piece and the slabs of the writes in flight, however long the replay.
        self.slabs_back(trailing);
        sent?;
        // A piece short of the reach is not flushed: no checkpoint follows it, and its writes
        // may still be in flight; the next piece's overlap none of them ([`Trailing`]). The
        // piece that reaches the reach waits for them all and flushes them before the
        // checkpoint; a crash before it sends every piece again.
        if win.last < lock(&self.st).reach {
            tracing::debug!(
                "volume {:?}: piece of {} writes ({} IOs) waited {read:?} for its records, \
                 written in {:?}",
                self.name,
                win.writes.len(),
                win.runs.len(),
                started.elapsed() - read,
            );
            return Ok(());
        }
        self.flush_window(win, started, read).await
    }

    /// A window's writes, at most the datastore's queue depth in flight, counting those of
    /// the pieces before still in flight ([`Trailing`]). A piece short of the reach (`short`)
    /// leaves its own in flight; anything else waits for all of them.
    async fn send_runs(
        &self,
        win: &Window,
        datas: Vec<Option<Bytes>>,
        t: &mut Trailing,
        short: bool,
    ) -> Result<(), Error> {
        let limit = self.store.gate().queue_depth().max(1) as usize;
        let mut first_err = None;
        for (run, data) in win.runs.iter().zip(datas) {
            let run = &win.pieces[run.clone()];
            let (off, len) = (run[0].offset, run.iter().map(|p| p.len).sum::<u64>());
            while !t.set.is_empty() && (t.set.len() >= limit || t.overlaps(off, off + len)) {
                let r = t.set.join_next().await;
                self.note_write(r, t, &mut first_err);
            }
            if t.set.is_empty() {
                // (A task that panicked never said which range was its own.)
                t.ranges.clear();
            }
            if first_err.is_some() {
                break;
            }
            let may_trim = may_trim(run);
            let store = self.store.clone();
            t.ranges.insert(off, off + len);
            // Flow control wants the device's service time, not the wait for a slot. The
            // buffer comes back once the write is done with it.
            t.set.spawn(async move {
                // Only a buffer of its own can go back; a slab's slice never could alone.
                let keep = data.clone().filter(|b| BufPool::pools(b.len()));
                (store.write_timed(off, len, data, may_trim).await, keep, off)
            });
        }
        // Every write sent is waited for after a failure: none may still be in flight when
        // the window is sent again.
        if !short || first_err.is_some() {
            if let Some(e) = self.settle(t).await {
                first_err.get_or_insert(e);
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// A window's writes to a device that takes them in batches (a file: each write ends in
    /// the page cache, and a thread hop per write would cost more than the write), one batch
    /// after another, in the window's order.
    async fn send_batches(&self, win: &Window, datas: Vec<Option<Bytes>>) -> Result<(), Error> {
        let mut batch = Vec::new();
        let mut bufs = Vec::new();
        let mut bytes = 0;
        let mut runs = win.runs.iter().zip(datas).peekable();
        while let Some((run, data)) = runs.next() {
            let run = &win.pieces[run.clone()];
            let (offset, len) = (run[0].offset, run.iter().map(|p| p.len).sum::<u64>());
            bufs.extend(data.clone().filter(|b| BufPool::pools(b.len())));
            batch.push(BatchWrite {
                offset,
                len,
                data,
                may_trim: may_trim(run),
            });
            bytes += len;
            if batch.len() < BATCH_WRITES && bytes < BATCH_BYTES && runs.peek().is_some() {
                continue;
            }
            let n = batch.len() as u32;
            let (r, took) = self
                .store
                .write_batch_timed(std::mem::take(&mut batch))
                .await;
            // The device is done with the buffers either way.
            for b in bufs.drain(..) {
                self.shared.bufs.put(b);
            }
            r.map_err(Error::Datastore)?;
            // Flow control wants the device's time per write.
            self.note_latency(took / n);
            bytes = 0;
        }
        Ok(())
    }

    /// Ends a window whose writes are all done: a datastore FLUSH, so the checkpoint that
    /// follows covers only what is stable.
    async fn flush_window(
        &self,
        win: &Window,
        started: Instant,
        read: Duration,
    ) -> Result<(), Error> {
        let flushing = Instant::now();
        let r = self.store.flush_internal().await.map_err(Error::Datastore);
        tracing::debug!(
            "volume {:?}: window of {} writes ({} IOs) waited {read:?} for its records, \
             written in {:?}, flushed in {:?}",
            self.name,
            win.writes.len(),
            win.runs.len(),
            flushing - started - read,
            flushing.elapsed()
        );
        r
    }

    /// Takes in one finished destage write: its service time for flow control, its buffer
    /// back to the pool, its error if it failed and none came before.
    fn note_write(
        &self,
        r: Option<Result<SentRun, tokio::task::JoinError>>,
        t: &mut Trailing,
        first_err: &mut Option<Error>,
    ) {
        match r {
            Some(Ok((done, buf, off))) => {
                t.ranges.remove(&off);
                if let Some(b) = buf {
                    self.shared.bufs.put(b);
                }
                match done {
                    (Ok(()), t) => self.note_latency(t),
                    (Err(e), _) => {
                        first_err.get_or_insert(Error::Datastore(e));
                    }
                }
            }
            Some(Err(e)) => {
                first_err.get_or_insert(Error::Cache(format!("destage task failed: {e}")));
            }
            None => {}
        }
    }

    /// Waits until at most `left` dirty writes remain (a drain), with writes throttled at full
    /// pressure meanwhile. Fails if the cache device has failed (what it held cannot be
    /// destaged any more), or once the drain has made no progress for `stuck` while the
    /// datastore failed destage writes, or for `hung` while IO sent to it was outstanding and
    /// it answered none (a hung datastore shows no error). Nothing is lost: the data stays
    /// dirty, and the destager goes on retrying. A drain held up by anything else (peers,
    /// writes not complete yet) waits.
    pub async fn drain(&self, left: usize, stuck: Duration, hung: Duration) -> Result<(), Error> {
        {
            let mut st = lock(&self.st);
            st.draining = true;
            // A destager backing off from errors tries again now: the datastore may be back,
            // and the error must not end the drain unless it is still there.
            st.destage.retry_at = None;
        }
        self.shared.wake.notify_one();
        let log = self.shared.log.clone();
        let (mut fewest, mut progress) = (usize::MAX, Instant::now());
        // The datastore's IOs, every volume's: one still answering may be busy with another
        // volume's window, this volume's turn to come.
        let stats = &self.store.gate().stats;
        let mut answered = stats.answered_writes();
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            {
                let mut st = lock(&self.st);
                // An offline replay ends with a switch of its own (`after_replay`): a change
                // waits for it.
                if st.staged.len() <= left && !st.replaying {
                    st.draining = false;
                    return Ok(());
                }
                if log.is_failed() {
                    st.draining = false;
                    return Err(Error::Cache(format!(
                        "the cache device failed with {} dirty write(s) ({} bytes) not destaged",
                        writes_among(st.staged.iter().map(|w| w.w.ser)),
                        st.dirty_bytes
                    )));
                }
                let now = stats.answered_writes();
                let outstanding = stats.outstanding();
                let answers = now != answered && st.destage.error.is_none();
                answered = now;
                let on_datastore = st.destage.error.is_some() || outstanding > 0;
                if st.staged.len() < fewest || answers || !on_datastore {
                    (fewest, progress) = (st.staged.len(), Instant::now());
                }
                // A datastore that takes no writes, or answers nothing, would hold the caller
                // (and a paused volume's IO, reads too) for as long as it is down.
                let limit = match st.destage.error {
                    Some(_) => stuck,
                    None => hung,
                };
                if progress.elapsed() >= limit {
                    let how = match &st.destage.error {
                        Some(e) => format!("is not taking writes ({e})"),
                        None => format!(
                            "has answered none of its {outstanding} outstanding IO(s) for \
                             {limit:?}"
                        ),
                    };
                    let why = format!(
                        "the datastore {how}; {} dirty write(s) ({} bytes) wait for it",
                        st.staged.len(),
                        st.dirty_bytes
                    );
                    st.draining = false;
                    return Err(Error::Cache(why));
                }
            }
            tokio::select! {
                _ = changed => {}
                _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            }
        }
    }

    /// Whether every dirty write has been destaged (and an offline replay has ended).
    pub fn clean(&self) -> bool {
        let st = lock(&self.st);
        st.staged.is_empty() && !st.replaying
    }

    /// Waits until every dirty write has been destaged, or for `limit`; true if clean.
    pub async fn wait_clean(&self, limit: Duration) -> bool {
        tokio::time::timeout(
            limit,
            self.wait_until(|st| st.staged.is_empty() && !st.replaying),
        )
        .await
        .is_ok()
    }

    /// The datastore's queue depth: how many writes a drain leaves for the pause.
    pub fn queue_depth(&self) -> usize {
        self.store.gate().queue_depth() as usize
    }

    /// The `ser` the datastore is known to hold every write up to.
    pub fn checkpoint(&self) -> u64 {
        lock(&self.st).checkpoint
    }

    /// The dirty bytes and client writes staged above `ser`: what is not on the datastore
    /// when another host (a peer's replay) has destaged the volume up to `ser`.
    pub fn dirty_above(&self, ser: u64) -> (u64, u64) {
        let st = lock(&self.st);
        let above = || st.staged.iter().filter(|w| w.w.ser > ser);
        (
            above().map(|w| w.w.len).sum(),
            writes_among(above().map(|w| w.w.ser)),
        )
    }

    /// What start-up recovery found: the last `ser` of the replayed prefix, and the highest
    /// `ser` seen in the log (new writes are numbered above it).
    pub fn recovery_marks(&self) -> (u64, u64) {
        let st = lock(&self.st);
        (st.recovered_upto, st.void_upto)
    }

    /// The generation and checkpoint a switch ([`VolCache::switch_mode`]) would start: what
    /// the caller records in the vault before it switches.
    pub fn switch_marks(&self) -> (u64, u64) {
        let st = lock(&self.st);
        (st.gen + 1, st.next_ser - 1)
    }

    /// Switches between `wt`, `wb` and `wbp` (`wb` with `peers`) on a drained volume with no
    /// IO in flight (the caller paused it). Every switch starts a new generation, so that
    /// copies of the old one (a dropped peer's, an earlier life's) are never mistaken for the
    /// new; the sequence so far is checkpointed so recovery never looks below it.
    /// Makes the volume leave `wb` for `mode` when its offline replay ends, before it takes
    /// a write: a volume that is not `wb` replays in `wb` and must not stay there. If the
    /// replay has ended already (the destager may be quick), it switches now; so this must
    /// come before the volume's first write.
    pub fn after_replay(&self, mode: Mode) -> Result<(), Error> {
        {
            let mut st = lock(&self.st);
            if st.replaying {
                st.after_replay = Some(mode);
                return Ok(());
            }
        }
        self.switch_mode(mode, None)
    }

    ///
    /// The new generation's checkpoint goes into the log first. Until it is in, nothing has
    /// changed: a failed append leaves nothing behind, and the volume goes on as it was. Once
    /// it is in, the log knows the new generation as the volume's newest, and a recovery
    /// ignores records of older ones: the volume must go on in the new one whatever follows,
    /// or the writes it completed next would be dropped after a crash.
    pub fn switch_mode(&self, mode: Mode, peers: Option<Arc<dyn Replicator>>) -> Result<(), Error> {
        let (gen, next) = {
            let st = lock(&self.st);
            assert!(st.in_flight.is_empty(), "mode switch with writes in flight");
            assert!(st.staged.is_empty(), "mode switch before draining");
            (st.gen + 1, st.next_ser)
        };
        self.append_meta(Kind::Checkpoint, next - 1, gen, 0)
            .map_err(log_err)?;
        {
            let mut st = lock(&self.st);
            st.gen = gen;
            st.mode = mode;
            st.replicator = if mode == Mode::Wb { peers } else { None };
            st.checkpoint = next - 1;
            st.peer_synced = st.checkpoint;
        }
        self.changed.notify_waiters();
        let code = match mode {
            Mode::Wt => Policy::Wt.code(),
            Mode::Wb => Policy::Wb.code(),
        };
        // The policy record only tells a later scan what the volume ran in (nothing decides
        // by it): without it the switch stands.
        if let Err(e) = self.append_meta(Kind::Policy, 0, gen, code) {
            warn!(
                "volume {}: record its policy in the cache log: {e}",
                self.id
            );
        }
        self.shared.log.sync().map_err(log_err)
    }

    pub fn set_opts(&self, o: VolOpts) {
        *lock(&self.opts) = o;
        self.shared.wake.notify_one();
    }

    pub fn report(&self) -> CacheReport {
        let st = lock(&self.st);
        let sig = self.signals(&st);
        let p = flow::pressure(&sig, &self.triggers());
        let limit = self.shared.stall_limit();
        let hits = self.counters.read_hit_bytes.load(Ordering::Relaxed);
        let misses = self.counters.read_miss_bytes.load(Ordering::Relaxed);
        CacheReport {
            mode: match (st.mode, &st.replicator) {
                (Mode::Wt, _) => "wt".into(),
                (Mode::Wb, None) => "wb".into(),
                (Mode::Wb, Some(p)) => format!("wbp:{}", p.report().len()),
            },
            peers: st
                .replicator
                .as_ref()
                .map(|p| p.report())
                .unwrap_or_default(),
            gen: st.gen,
            dirty_bytes: st.dirty_bytes,
            dirty_writes: writes_among(st.staged.iter().map(|w| w.w.ser)),
            share_bytes: self.shared.share_bytes(),
            used_bytes: self.shared.log.segments_of(self.id) as u64
                * self.shared.log.superblock().segment_size,
            checkpoint: st.checkpoint,
            last_ser: st.next_ser - 1,
            read_hit_ratio: (hits + misses > 0).then(|| hits as f64 / (hits + misses) as f64),
            destaged_bytes: self.counters.destaged_bytes.load(Ordering::Relaxed),
            destaged_writes: self.counters.destaged_writes.load(Ordering::Relaxed),
            destage_bytes_per_s: sig.destage_bytes_per_s,
            datastore_write_latency_us: lock(&self.ds_latency).get().map(|s| (s * 1e6) as u64),
            flow_control: if st.mode == Mode::Wb && st.dirty_log_bytes >= limit {
                "stalled".into()
            } else if flow::multiple(p) > 0.0 {
                "throttling".into()
            } else {
                "off".into()
            },
            flow_pressure: p,
            throttled_writes: self.counters.throttled_writes.load(Ordering::Relaxed),
            throttle_delay_us_total: self.counters.throttle_us.load(Ordering::Relaxed),
            stalls: self.counters.stalls.load(Ordering::Relaxed),
            throttled_past_bound: self.counters.throttled_past_bound.load(Ordering::Relaxed),
            longest_write_us: self.counters.longest_write_us.load(Ordering::Relaxed),
            evicted_segments: self.counters.evicted_segments.load(Ordering::Relaxed),
            eviction_scans: self.counters.eviction_scans.load(Ordering::Relaxed),
            space_waits: self.counters.space_waits.load(Ordering::Relaxed),
            replaying: st.replaying,
            replay_sent: if st.replaying {
                Self::piece_start(&st).max(st.checkpoint)
            } else {
                0
            },
            replay_end: if st.replaying { st.reach } else { 0 },
            degraded: st.degraded.clone().or_else(|| {
                self.shared.log.is_failed().then(|| match st.mode {
                    Mode::Wt => {
                        "the cache device failed; serving uncached (no data lost in wt)".into()
                    }
                    Mode::Wb => format!(
                        "the cache device failed with {} dirty byte(s) not destaged",
                        st.dirty_bytes
                    ),
                })
            }),
            destage_error: st.destage.error.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_is_split_into_as_few_parts_as_equal_as_pages_allow() {
        let page = cachelog::format::PAGE;
        let sizes = (0..=40u64)
            .flat_map(|p| {
                [
                    p * page,
                    (p * page).saturating_sub(1),
                    p * page + 1,
                    p * page + 512,
                ]
            })
            .chain([1 << 20, 768 << 10, (1 << 20) + 4096, 4 << 20]);
        for max in [page, 3 * page, 63 * page, 64 * page] {
            for len in sizes.clone() {
                let parts = split(len, max);
                let why = format!("len {len}, max {max}: {parts:?}");
                assert_eq!(parts.len() as u64, len.div_ceil(max).max(1), "{why}");
                let mut at = 0;
                for (i, (off, l)) in parts.iter().copied().enumerate() {
                    assert_eq!(off, at, "contiguous from the start: {why}");
                    assert!(l <= max, "{why}");
                    assert!(l > 0 || len == 0, "no empty part: {why}");
                    if i + 1 < parts.len() {
                        assert!(l.is_multiple_of(page), "whole pages but the last: {why}");
                        assert_eq!(l, parts[0].1, "equal but the last: {why}");
                    }
                    at += l;
                }
                assert_eq!(at, len, "{why}");
                // Equal: the last part is at most a page per part shorter than the others.
                let last = parts.last().expect("a part").1;
                assert!(parts[0].1 - last < page * parts.len() as u64, "{why}");
            }
        }
    }

    #[test]
    fn large_writes_fill_four_fifths_of_the_log() {
        // Appends 1 MiB writes, cut as the write path cuts them, until the log is out of
        // segments. Cut into 256 KiB parts, three fit a 1 MiB segment and the fourth takes
        // a quarter of the next: only 75 % of the log would hold data.
        let seg = SEGMENT_DEFAULT;
        let dev = Arc::new(cachelog::SimDevice::new((1 << 20) + 64 * seg));
        let host = CacheHost::open(dev, seg).expect("open");
        let log = host.shared.log.clone();
        let usable = (log.free_segments() - log.meta_reserve()) as u64 * seg;
        let vol = Uuid::new_v4();
        let data = vec![7u8; 1 << 20];
        let mut held = 0u64;
        'fill: for ser in 1.. {
            let parts = host.shared.parts(true, data.len() as u64);
            for (i, (off, len)) in (0u64..).zip(parts.iter().copied()) {
                let e = Entry {
                    kind: Kind::Data,
                    volume: vol,
                    ser,
                    gen: 1,
                    offset: (ser - 1) * (1 << 20) + off,
                    len,
                    arg: ((parts.len() as u64) << 32) | i,
                };
                match log.append(&e, &data[off as usize..(off + len) as usize]) {
                    Ok(_) => held += len, // stays pinned: dirty data
                    Err(LogError::NoSpace) => break 'fill,
                    Err(e) => panic!("append: {e}"),
                }
            }
        }
        let fill = held as f64 / usable as f64;
        assert!(
            fill >= 0.79,
            "1 MiB writes filled {:.1} % of the log",
            fill * 100.0
        );
    }

    /// A slab a write in flight holds a slice of comes back to its holder; once no write
    /// holds one, it goes to the pool ([`VolCache::slabs_back`], called after each piece).
    #[test]
    fn a_slab_goes_back_to_the_pool_once_no_write_holds_a_slice() {
        let pool = BufPool::default();
        let size = window::RUN_BYTES_MAX as usize;
        let slab = pool.take(size).freeze();
        let ptr = slab.as_ptr();
        let write = slab.slice(4096..8192);
        let slab = pool
            .put_if_free(slab)
            .expect("a slab a write holds went to the pool");
        assert!(lock(&pool.free).is_empty());
        drop(write);
        assert!(pool.put_if_free(slab).is_none());
        assert_eq!(pool.take(size).as_ptr(), ptr);
    }

    /// `Trailing::overlaps` against every range over a few disjoint ones in flight.
    #[test]
    fn a_write_overlaps_exactly_the_writes_in_flight_it_shares_a_byte_with() {
        let mut t = Trailing::default();
        let flight = [(0u64, 4u64), (4, 6), (10, 12), (20, 30)];
        for (s, e) in flight {
            t.ranges.insert(s, e);
        }
        for start in 0..35u64 {
            for end in start + 1..36 {
                let want = flight.iter().any(|&(s, e)| start < e && s < end);
                assert_eq!(t.overlaps(start, end), want, "{start}..{end}");
            }
        }
        assert!(!Trailing::default().overlaps(0, u64::MAX));
    }

    #[test]
    fn the_buffer_pool_reuses_only_buffers_nothing_else_holds() {
        let pool = BufPool::default();
        let size = window::RUN_BYTES_MAX as usize;
        let mut b = pool.take(size / 2);
        assert_eq!(b.len(), size / 2);
        b.fill(0xa5);
        let ptr = b.as_ptr();
        pool.put(b.freeze());
        // Back at the length asked for, holding what it held (the caller overwrites it):
        // not zeroed again, except past its last length.
        let b = pool.take(size / 3);
        assert_eq!((b.as_ptr(), b.len()), (ptr, size / 3));
        assert!(b.iter().all(|&x| x == 0xa5));
        pool.put(b.freeze());
        let b = pool.take(size);
        assert_eq!((b.as_ptr(), b.len()), (ptr, size));
        assert!(b[..size / 3].iter().all(|&x| x == 0xa5));
        assert!(b[size / 3..].iter().all(|&x| x == 0));
        // A buffer still shared (a write holding a slice of it) never goes back.
        let shared = b.freeze();
        let held = shared.slice(0..10);
        pool.put(shared);
        assert_ne!(pool.take(size).as_ptr(), ptr);
        drop(held);
        // Small runs are not pooled.
        pool.put(pool.take(4096).freeze());
        assert!(lock(&pool.free).is_empty());
    }

    #[test]
    fn small_runs_share_pool_slabs_that_come_back_once_their_writes_are_done() {
        let dev = Arc::new(cachelog::SimDevice::new(256 << 20));
        let log = Log::format(dev, 4 << 20).expect("format");
        let vol = Uuid::new_v4();
        // Records of many sizes, each filled with its own byte.
        let lens = [
            4096u64,
            8192,
            4096,
            300 << 10,
            12288,
            1 << 20,
            4096,
            200 << 10,
        ];
        let mut runs = Vec::new();
        let mut offset = 0;
        for (i, len) in (0u64..).zip(lens.iter().copied().cycle().take(300)) {
            let e = Entry {
                kind: Kind::Data,
                volume: vol,
                ser: i + 1,
                gen: 1,
                offset,
                len,
                arg: 0,
            };
            let (loc, _) = log
                .append(&e, &vec![(i % 251) as u8; len as usize])
                .expect("append");
            runs.push(vec![window::Piece {
                offset,
                len,
                source: Source::Data(loc, 0),
            }]);
            offset += len;
            // A zero run now and then, and a run from two records.
            if i % 97 == 0 {
                runs.push(vec![window::Piece {
                    offset,
                    len: 4096,
                    source: Source::Zero { alloc: false },
                }]);
            }
        }
        let pool = BufPool::default();
        let data = read_runs(&log, vol, &pool, &runs).expect("read");
        assert_eq!(data.runs.len(), runs.len());
        let mut small = 0;
        let mut i = 0u64;
        for (run, got) in runs.iter().zip(&data.runs) {
            match run[0].source {
                Source::Zero { .. } => assert!(got.is_none()),
                Source::Data(..) => {
                    let got = got.as_ref().expect("data run");
                    assert_eq!(got.len() as u64, run[0].len);
                    assert!(got.iter().all(|&b| b == (i % 251) as u8), "run {i}");
                    small += got.len() * usize::from(run[0].len <= 256 << 10);
                    i += 1;
                }
            }
        }
        // The small runs fill their slabs: none more than they need.
        let slab = window::RUN_BYTES_MAX as usize;
        assert!(data.slabs.len() >= small.div_ceil(slab));
        assert!(data.slabs.len() <= small.div_ceil(slab) + small.div_ceil(slab) / 2 + 1);
        // A slab goes back to the pool only when none of its runs is still held.
        let WindowData { runs: got, slabs } = data;
        let held = got.iter().flatten().find(|b| b.len() == 4096).cloned();
        drop(got);
        let ptrs: Vec<*const u8> = slabs.iter().map(|b| b.as_ptr()).collect();
        for b in slabs {
            pool.put(b);
        }
        assert_eq!(lock(&pool.free).len(), ptrs.len() - 1);
        drop(held);
        let back: Vec<*const u8> = lock(&pool.free).iter().map(|b| b.as_ptr()).collect();
        assert!(back.iter().all(|p| ptrs.contains(p)));
    }
}
