//! Shared backend storage (DESIGN §1): where volumes' bytes live when they leave the host.
//!
//! - [`Datastore`]: one datastore of some kind; creates, opens and deletes volume [`Extent`]s.
//! - [`dir`]: kind `dir`, a directory with one sparse raw image file per volume.
//! - [`lun`]: kind `lun`, one whole device (path or NBD export) with a label and a volume table;
//!   each volume a contiguous extent. The format is in [`label`] and `docs/FORMAT.md`.
//! - [`device`]: the byte-addressed targets underneath: files, block devices, NBD exports.
//! - [`Extent`]: a volume's bytes on a datastore; every IO through it passes the datastore's
//!   [`Gate`], which bounds IOs in flight to `queue_depth` and measures each one ([`stats`]),
//!   and refuses every IO but a FLUSH while the host's [`fence::Fence`] is closed, and every
//!   IO once the datastore is no longer this pod's ([`Gate::shut_out`]).

pub mod device;
pub mod dir;
pub mod fence;
pub mod fileio;
pub mod label;
mod losses;
pub mod lun;
pub mod stats;

use std::future::Future;
use std::io;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;
use uuid::Uuid;

use device::Device;
use fence::Fence;
use stats::{IoStats, Op};

/// Device class, used by migration cost and wear accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Class {
    Ssd,
    #[default]
    Hdd,
}

impl std::fmt::Display for Class {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Class::Ssd => "ssd",
            Class::Hdd => "hdd",
        })
    }
}

impl std::str::FromStr for Class {
    type Err = String;
    fn from_str(s: &str) -> Result<Class, String> {
        match s {
            "ssd" => Ok(Class::Ssd),
            "hdd" => Ok(Class::Hdd),
            _ => Err(format!("class must be ssd or hdd, not {s:?}")),
        }
    }
}

/// Where a datastore's bytes are.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Kind {
    Dir {
        path: PathBuf,
    },
    Lun {
        /// A device or file path, or an NBD URI (`nbd://…`, `nbd+unix://…`).
        target: String,
        /// The UUID in the LUN's label, recorded when it was added, so a different device
        /// showing up under the same path is never mistaken for it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        lun_id: Option<Uuid>,
    },
}

/// Default for `queue_depth`: deep enough for a SAN LUN, shallow enough not to flood one disk.
pub const QUEUE_DEPTH_DEFAULT: u32 = 64;

/// A datastore as configured and persisted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DatastoreSpec {
    pub name: String,
    #[serde(flatten)]
    pub kind: Kind,
    #[serde(default)]
    pub class: Class,
    #[serde(default = "default_queue_depth")]
    pub queue_depth: u32,
    /// Read and write a datastore reached by path with `O_DIRECT`, bypassing this host's page
    /// cache: for storage several hosts share (a SAN disk, NFS). See [`fileio`].
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub direct: bool,
}

/// Whether `direct` may be asked of a datastore of `kind`: only of one reached by path (an NBD
/// server's cache is the same for all its clients already).
pub fn check_direct(kind: &Kind, direct: bool) -> std::result::Result<(), String> {
    match kind {
        Kind::Lun { target, .. } if direct && lun::is_nbd_uri(target) => Err(format!(
            "direct applies to a datastore reached by path; {target} is an NBD export, which \
             every host reaches through the same server"
        )),
        _ => Ok(()),
    }
}

fn default_queue_depth() -> u32 {
    QUEUE_DEPTH_DEFAULT
}

impl DatastoreSpec {
    pub fn kind_name(&self) -> &'static str {
        match self.kind {
            Kind::Dir { .. } => "dir",
            Kind::Lun { .. } => "lun",
        }
    }

    pub fn location(&self) -> String {
        match &self.kind {
            Kind::Dir { path } => path.display().to_string(),
            Kind::Lun { target, .. } => target.clone(),
        }
    }
}

/// What a datastore needs to know about a volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeSpec {
    pub id: Uuid,
    pub name: String,
    pub size: u64,
}

/// Whether an IO error says the request went unanswered (a connection lost or timed out
/// with it in flight) rather than refused: an NBD server may still carry such a write out
/// afterwards, whatever a read says meanwhile.
pub fn unanswered(e: &io::Error) -> bool {
    use io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionAborted | ConnectionReset | BrokenPipe | TimedOut | UnexpectedEof
    )
}

/// Whether an IO error says this host cannot reach the datastore now, rather than that the
/// datastore refused the request: no connection (nothing was sent), a server that answered
/// it is shutting down (ESHUTDOWN: it did not carry the request out), or a connection lost
/// with the request in flight ([`unanswered`]). The same request may be sent again once the
/// datastore is back; a write that went unanswered is sent again only after
/// [`LATE_WRITE_GRACE`], as every write through its [`Gate`] is.
pub fn unreachable(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::NotConnected
        || e.raw_os_error() == Some(libc::ESHUTDOWN)
        || unanswered(e)
}

/// How long IO that finds its datastore unreachable ([`unreachable`]) waits for it to come
/// back by default before it fails to the client ([`Gate::unreachable_wait`]): a restart of
/// an NBD server, a path failing over. The same default as VMware's "all paths down"
/// timeout, after which ESXi fails such IO too.
pub const UNREACHABLE_WAIT_DEFAULT: Duration = Duration::from_secs(140);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Capacity {
    pub total_bytes: u64,
    pub free_bytes: u64,
    /// Largest volume that can still be created.
    pub largest_free_bytes: u64,
    /// What the volumes already here may still take of `free_bytes` as they are written:
    /// the unallocated part of sparse images (a `dir`); 0 where a volume's space is taken
    /// whole when it is created (a `lun`).
    pub unwritten_bytes: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error(
        "datastore {datastore:?} has no room for {need} bytes (largest free extent: {largest} \
         bytes); delete volumes there or choose another datastore"
    )]
    NoSpace {
        datastore: String,
        need: u64,
        largest: u64,
    },
    #[error("{0}")]
    Exists(String),
    #[error("{0}")]
    NotFound(String),
    /// The target holds data Vesta did not write; adding it would destroy that data.
    #[error("{0}")]
    Foreign(String),
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> Error {
    let what = what.into();
    move |source| Error::Io { what, source }
}

/// Whether a datastore is being added for the first time or reopened at start-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenMode {
    /// First time: a blank `lun` is formatted; foreign data is refused unless `force`, and a
    /// `lun` of another pod unless `take_over` names that pod.
    Add {
        force: bool,
        take_over: Option<Uuid>,
    },
    /// Start-up: the datastore must be exactly what was added before.
    Reopen,
}

#[async_trait]
pub trait Datastore: Send + Sync + 'static {
    /// The spec, including anything learnt when it was opened (a `lun`'s label UUID).
    fn spec(&self) -> &DatastoreSpec;
    fn gate(&self) -> &Arc<Gate>;
    /// Makes every later write to this datastore wait on the host's `fence`: at the gate,
    /// and in devices whose writes can wait or run long after it (see
    /// [`device::Device::set_fence`]).
    fn set_fence(&self, fence: Arc<Fence>) {
        self.gate().set_fence(fence);
    }
    async fn capacity(&self) -> Result<Capacity>;
    /// Creates a volume's storage; it reads as zeroes.
    async fn create_volume(&self, v: &VolumeSpec) -> Result<Extent>;
    async fn open_volume(&self, v: &VolumeSpec) -> Result<Extent>;
    async fn delete_volume(&self, v: &VolumeSpec) -> Result<()>;
    /// Volumes the datastore itself records (a `lun`'s table); empty for kinds that record
    /// nothing beyond the files themselves.
    async fn recorded_volumes(&self) -> Result<Vec<VolumeSpec>> {
        Ok(Vec::new())
    }
}

/// Opens (or, when adding, prepares) a datastore of any kind, for no pod in particular: a
/// `lun` of any pod is opened, and one formatted here carries none.
pub async fn open(spec: &DatastoreSpec, mode: OpenMode) -> Result<Arc<dyn Datastore>> {
    open_in_pod(spec, mode, None).await
}

/// [`open`] for pod `pod`: a `lun` formatted here carries it in its label, and one whose label
/// names another pod is refused (taken over when added with `take_over` naming it).
pub async fn open_in_pod(
    spec: &DatastoreSpec,
    mode: OpenMode,
    pod: Option<Uuid>,
) -> Result<Arc<dyn Datastore>> {
    if spec.queue_depth == 0 {
        return Err(Error::Invalid(format!(
            "datastore {:?}: queue_depth must be at least 1",
            spec.name
        )));
    }
    Ok(match &spec.kind {
        Kind::Dir { .. } => Arc::new(dir::DirDatastore::open(spec.clone(), mode).await?),
        Kind::Lun { .. } => Arc::new(lun::LunDatastore::open(spec.clone(), mode, pod).await?),
    })
}

/// How long a write that went unanswered ([`unanswered`]) is given to land. An NBD server
/// goes on running a request whose connection was lost, usually for moments; a SAN finishes
/// a command it has taken. Until then no later write through the same [`Gate`] goes out
/// ([`Gate::late_writes_pending`]): the destager's retry, or the next window, may carry a
/// newer version of the very block, and the old one landing after it would undo it once the
/// checkpoint has released the newer one from the cache. A write later than this still can.
#[cfg(not(test))]
pub const LATE_WRITE_GRACE: Duration = Duration::from_secs(5);
#[cfg(test)]
pub const LATE_WRITE_GRACE: Duration = Duration::from_millis(300);

/// Admission and accounting for every IO to one datastore: at most `queue_depth` IOs in
/// flight, each measured from issue to completion at the device.
pub struct Gate {
    slots: Semaphore,
    queue_depth: u32,
    pub stats: IoStats,
    /// The host's fence, once a coordinator with leases sets it; open until then.
    fence: std::sync::OnceLock<Arc<Fence>>,
    /// Why the datastore is no longer this pod's, once it is not ([`Gate::shut_out`]).
    shut_out: std::sync::OnceLock<String>,
    /// When a write through this gate last went unanswered ([`unanswered`]): its slot is
    /// free again, but the server may still carry it out ([`Gate::idle_within`]).
    unanswered_at: std::sync::Mutex<Option<Instant>>,
    /// [`Gate::unreachable_wait`], in milliseconds.
    unreachable_wait_ms: std::sync::atomic::AtomicU64,
}

impl Gate {
    pub fn new(queue_depth: u32) -> Gate {
        Gate {
            slots: Semaphore::new(queue_depth as usize),
            queue_depth,
            stats: IoStats::default(),
            fence: std::sync::OnceLock::new(),
            shut_out: std::sync::OnceLock::new(),
            unanswered_at: std::sync::Mutex::new(None),
            unreachable_wait_ms: std::sync::atomic::AtomicU64::new(
                UNREACHABLE_WAIT_DEFAULT.as_millis() as u64,
            ),
        }
    }

    /// How long a client's IO that finds this datastore unreachable ([`unreachable`]) waits
    /// for it to come back, trying again, before it fails ([`UNREACHABLE_WAIT_DEFAULT`]
    /// unless set). Zero: it fails at once.
    pub fn unreachable_wait(&self) -> Duration {
        Duration::from_millis(self.unreachable_wait_ms.load(Ordering::Relaxed))
    }

    /// Sets [`Gate::unreachable_wait`] (the host's config).
    pub fn set_unreachable_wait(&self, wait: Duration) {
        let ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
        self.unreachable_wait_ms.store(ms, Ordering::Relaxed);
    }

    /// Fails every later IO through this gate, reads and flushes included, with `why`: the
    /// datastore is no longer this pod's (another pod took a `lun` over, or its device now
    /// carries another LUN), and that pod may give this pod's extents to volumes of its own.
    /// For good: only a new open (a restart) can find it this pod's again. The first reason
    /// stays.
    pub fn shut_out(&self, why: String) {
        let _ = self.shut_out.set(why);
    }

    /// Why [`Gate::shut_out`] shut the gate, if it did.
    pub fn shut_out_reason(&self) -> Option<&str> {
        self.shut_out.get().map(String::as_str)
    }

    /// Makes every later write, trim and zeroing through this gate wait on `fence`. Set once;
    /// a second call keeps the first fence (one host has one lease).
    pub fn set_fence(&self, fence: Arc<Fence>) {
        let _ = self.fence.set(fence);
    }

    /// [`Fence::closes`] of the host's fence; 0 without one.
    pub(crate) fn fence_closes(&self) -> u64 {
        self.fence.get().map_or(0, |f| f.closes())
    }

    /// Whether the host's fence refuses `op` now. Writes, trims and zeroings: they could race
    /// a contender that took the volume after the lease lapsed. Reads too: they harm no
    /// contender, but their reader, since a peer's replay of the volume may be setting blocks
    /// back to older versions for a while (from the vault's checkpoint, up), and a read then
    /// would undo a write this host's client saw complete. A FLUSH changes nothing and passes.
    pub(crate) fn fenced(&self, op: Op) -> bool {
        op != Op::Flush && self.fence.get().is_some_and(|f| !f.allows_writes())
    }

    pub fn queue_depth(&self) -> u32 {
        self.queue_depth
    }

    /// Waits up to `limit` until no IO is in service through this gate; whether that
    /// happened, and no write went unanswered in the last `late` (one whose connection was
    /// lost or timed out with it in flight freed its slot, but its server may still carry it
    /// out). Every IO holds a slot from its fence check until it completes, so once all slots
    /// are free, every write that passed the check before the fence closed has been answered
    /// (vestad's clean stop, before it lets a restart adopt its locks). IOs that queued
    /// meanwhile go ahead afterwards, and a write among them meets the closed fence.
    pub async fn idle_within(&self, limit: Duration, late: Duration) -> bool {
        let idle =
            match tokio::time::timeout(limit, self.slots.acquire_many(self.queue_depth)).await {
                Ok(Ok(_all)) => true,
                // Closed: nothing is ever issued through it again.
                Ok(Err(_)) => true,
                Err(_) => false,
            };
        let at = *self.unanswered_at.lock().expect("lock");
        idle && at.is_none_or(|at| at.elapsed() >= late)
    }

    /// How long writes through this gate still wait for one that went unanswered to land:
    /// until [`LATE_WRITE_GRACE`] has passed since (then `None`). Reads and flushes do not wait.
    pub fn late_writes_pending(&self) -> Option<Duration> {
        let at = (*self.unanswered_at.lock().expect("lock"))?;
        LATE_WRITE_GRACE
            .checked_sub(at.elapsed())
            .filter(|d| !d.is_zero())
    }

    /// Notes a write that went unanswered ([`Gate::idle_within`]).
    fn note_unanswered<T>(&self, op: Op, r: &io::Result<T>) {
        if let Err(e) = r {
            if op != Op::Read && unanswered(e) {
                *self.unanswered_at.lock().expect("lock") = Some(Instant::now());
            }
        }
    }

    pub async fn run<T>(
        &self,
        op: Op,
        bytes: u64,
        io: impl Future<Output = io::Result<T>>,
    ) -> io::Result<T> {
        self.run_timed(op, bytes, io).await.0
    }

    /// A slot for an IO of kind `op`, unless the gate is closed or shut out, or the host's
    /// lease fences `op`. Both are checked after the wait for a slot, right before the IO is
    /// issued: a write that queued while the lease was still good must not go out after it
    /// lapsed. A write, zeroing or trim also waits, without a slot, until one that went
    /// unanswered can have landed ([`Gate::late_writes_pending`]).
    async fn slot(&self, op: Op) -> io::Result<tokio::sync::SemaphorePermit<'_>> {
        loop {
            let slot = self
                .slots
                .acquire()
                .await
                .map_err(|_| io::Error::other("datastore gate closed"))?;
            if let Some(why) = self.shut_out.get() {
                return Err(io::Error::other(why.clone()));
            }
            if self.fenced(op) {
                return Err(io::Error::other(if op == Op::Read {
                    fence::READS_FENCED
                } else {
                    fence::FENCED
                }));
            }
            match self.late_writes_pending() {
                Some(left) if !matches!(op, Op::Read | Op::Flush) => {
                    drop(slot);
                    tokio::time::sleep(left).await;
                }
                _ => return Ok(slot),
            }
        }
    }

    /// [`Gate::run`], also returning the IO's service time: from issue to completion at the
    /// device, without the wait for a slot. (A latency that counted the queue in front of the
    /// gate would grow with the number of IOs submitted at once, not with the device.)
    pub async fn run_timed<T>(
        &self,
        op: Op,
        bytes: u64,
        io: impl Future<Output = io::Result<T>>,
    ) -> (io::Result<T>, Duration) {
        let _slot = match self.slot(op).await {
            Ok(s) => s,
            Err(e) => return (Err(e), Duration::ZERO),
        };
        let t = self.stats.start();
        let started = Instant::now();
        let r = io.await;
        let took = started.elapsed();
        self.stats.finish(t, op, bytes, r.is_ok());
        self.note_unanswered(op, &r);
        (r, took)
    }

    /// [`Gate::run_timed`] for a batch of writes made by one IO call
    /// ([`Device::write_batch`](device::Device::write_batch)): one slot, each write counted
    /// in the statistics as an IO of its own.
    async fn run_batch_timed(
        &self,
        ios: &[(Op, u64)],
        io: impl Future<Output = io::Result<()>>,
    ) -> (io::Result<()>, Duration) {
        let _slot = match self.slot(Op::Write).await {
            Ok(s) => s,
            Err(e) => return (Err(e), Duration::ZERO),
        };
        let ts: Vec<_> = ios.iter().map(|_| self.stats.start()).collect();
        let started = Instant::now();
        let r = io.await;
        let took = started.elapsed();
        for (t, (op, n)) in ts.into_iter().zip(ios) {
            self.stats.finish(t, *op, *n, r.is_ok());
        }
        self.note_unanswered(Op::Write, &r);
        (r, took)
    }
}

/// A volume's bytes on a datastore: a window `[base, base + size)` of a device.
#[derive(Clone)]
pub struct Extent {
    pub(crate) dev: Arc<dyn Device>,
    base: u64,
    size: u64,
    gate: Arc<Gate>,
    /// Who flushes this extent ([`Extent::flush`], [`Extent::flush_internal`]), shared by
    /// its clones: each hears of every write the device lost that it covered ([`losses`]).
    flushers: Arc<[losses::Flusher; 2]>,
}

/// The volume's clients: FLUSH, and FUA on a zeroing or trim.
const CLIENTS: usize = 0;
/// Vesta's own flushes: the destager's, a switch into `wb`.
const INTERNAL: usize = 1;

impl Extent {
    pub fn new(dev: Arc<dyn Device>, base: u64, size: u64, gate: Arc<Gate>) -> Extent {
        Extent {
            flushers: Arc::new(Default::default()),
            dev,
            base,
            size,
            gate,
        }
    }

    /// What a write, zeroing or trim notes before it is sent: the device's loss count, so
    /// a loss counted later is known to maybe have taken it ([`losses`]).
    fn sending(&self) -> u64 {
        self.dev.losses()
    }

    /// Notes a write, zeroing or trim done (or tried) through this extent, sent at loss
    /// count `sent`: the next flush of each flusher covers it. Noted after the device
    /// answered, so a flush that began before (and may not cover it) does not take the note.
    fn wrote(&self, sent: u64) {
        for f in self.flushers.iter() {
            f.wrote(sent);
        }
    }

    async fn flush_as(&self, who: usize) -> io::Result<()> {
        let f = &self.flushers[who];
        let flush = f.begin();
        let r = self.gate.run(Op::Flush, 0, self.dev.flush()).await;
        // Read after the FLUSH answered: a connection that died before it did is counted.
        let lost = r.is_ok() && flush.may_have_lost(self.dev.losses());
        f.end(flush, r.is_ok());
        r?;
        if lost {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        Ok(())
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn gate(&self) -> &Arc<Gate> {
        &self.gate
    }

    fn check(&self, offset: u64, len: u64) -> io::Result<u64> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(self.base + offset),
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "range {offset}+{len} outside extent of {} bytes on {}",
                    self.size,
                    self.dev.describe()
                ),
            )),
        }
    }

    pub async fn read(&self, offset: u64, len: usize) -> io::Result<Bytes> {
        let at = self.check(offset, len as u64)?;
        self.gate.stats.locate(Op::Read, at, len as u64);
        self.gate
            .run(Op::Read, len as u64, self.dev.read_at(at, len))
            .await
    }

    pub async fn write(&self, offset: u64, data: Bytes, fua: bool) -> io::Result<()> {
        let at = self.check(offset, data.len() as u64)?;
        let n = data.len() as u64;
        self.gate.stats.locate(Op::Write, at, n);
        let sent = self.sending();
        let r = self
            .gate
            .run(Op::Write, n, self.dev.write_at(at, data, fua))
            .await;
        // A FUA write the device answered is durable: no loss can take it.
        if !(fua && r.is_ok()) {
            self.wrote(sent);
        }
        r
    }

    /// Makes every write through the extent durable, for the volume's clients. Fails with
    /// EIO if the device lost writes (a connection to an NBD datastore died with
    /// acknowledged, unflushed writes) that may include one this flush covers and no earlier
    /// flush reported: every flush running at the time reports it, even when another volume,
    /// or Vesta's own flushes ([`Extent::flush_internal`]), heard of it first ([`losses`]).
    pub async fn flush(&self) -> io::Result<()> {
        self.flush_as(CLIENTS).await
    }

    /// [`Extent::flush`] for Vesta's own needs (the destager, a policy switch), which learn
    /// of losses on their own account, so they never use up the report a client is owed.
    pub async fn flush_internal(&self) -> io::Result<()> {
        self.flush_as(INTERNAL).await
    }

    pub async fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        let at = self.check(offset, len)?;
        let sent = self.sending();
        let r = self.gate.run(Op::Trim, 0, self.dev.trim(at, len)).await;
        self.wrote(sent);
        r
    }

    pub async fn write_zeroes(&self, offset: u64, len: u64, may_trim: bool) -> io::Result<()> {
        let at = self.check(offset, len)?;
        let sent = self.sending();
        let r = self
            .gate
            .run(Op::WriteZeroes, 0, self.dev.write_zeroes(at, len, may_trim))
            .await;
        self.wrote(sent);
        r
    }

    /// A write (`Some(data)`) or zeroing of `len` bytes (deallocated if `may_trim`),
    /// returning its service time at the device ([`Gate::run_timed`]): what the destager
    /// feeds flow control.
    pub async fn write_timed(
        &self,
        offset: u64,
        len: u64,
        data: Option<Bytes>,
        may_trim: bool,
    ) -> (io::Result<()>, Duration) {
        let at = match self.check(offset, len) {
            Ok(at) => at,
            Err(e) => return (Err(e), Duration::ZERO),
        };
        let sent = self.sending();
        let r = match data {
            Some(d) => {
                self.gate.stats.locate(Op::Write, at, len);
                self.gate
                    .run_timed(Op::Write, len, self.dev.write_at(at, d, false))
                    .await
            }
            None => {
                self.gate
                    .run_timed(Op::WriteZeroes, 0, self.dev.write_zeroes(at, len, may_trim))
                    .await
            }
        };
        self.wrote(sent);
        r
    }
}

impl Extent {
    /// True if the device takes writes best in batches ([`Extent::write_batch_timed`]).
    pub fn prefers_batches(&self) -> bool {
        self.dev.prefers_batches()
    }

    /// Writes (`Some(data)`) and zeroings, each at an offset in the extent, made in turn by
    /// one device call; returns its service time at the device, as [`Extent::write_timed`].
    /// Stops at the first failure.
    pub async fn write_batch_timed(
        &self,
        writes: Vec<device::BatchWrite>,
    ) -> (io::Result<()>, Duration) {
        let mut ios = Vec::with_capacity(writes.len());
        let mut at = Vec::with_capacity(writes.len());
        for mut w in writes {
            match self.check(w.offset, w.len) {
                Ok(o) => w.offset = o,
                Err(e) => return (Err(e), Duration::ZERO),
            }
            // Counted as `write_timed` counts them: zeroings move no bytes.
            if w.data.is_some() {
                self.gate.stats.locate(Op::Write, w.offset, w.len);
                ios.push((Op::Write, w.len));
            } else {
                ios.push((Op::WriteZeroes, 0));
            }
            at.push(w);
        }
        let sent = self.sending();
        let r = self
            .gate
            .run_batch_timed(
                &ios,
                self.dev.write_batch(at, self.gate.fence.get().cloned()),
            )
            .await;
        self.wrote(sent);
        r
    }
}

/// Checks a volume or datastore name: what NBD URIs, file names and the LUN table all accept.
pub fn check_name(what: &str, name: &str) -> Result<()> {
    let ok_len = !name.is_empty() && name.len() <= label::NAME_MAX;
    let ok_chars = name
        .bytes()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'));
    let ok_start = name
        .bytes()
        .next()
        .is_some_and(|c| c.is_ascii_alphanumeric());
    if ok_len && ok_chars && ok_start {
        Ok(())
    } else {
        Err(Error::Invalid(format!(
            "{what} name {name:?} is not valid: use 1 to {} characters from A-Z a-z 0-9 . _ -, \
             starting with a letter or digit (e.g. web-01)",
            label::NAME_MAX
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A write that passed the fence before it closed is waited for; one after it is refused,
    /// and so is a read (a FLUSH goes through).
    #[tokio::test]
    async fn a_gate_is_idle_only_once_every_write_it_let_through_is_answered() {
        let gate = Arc::new(Gate::new(4));
        let fence = Arc::new(Fence::open());
        gate.set_fence(fence.clone());
        let (answer, answered) = tokio::sync::oneshot::channel::<()>();
        let (issued, is_issued) = tokio::sync::oneshot::channel::<()>();
        let write = tokio::spawn({
            let gate = gate.clone();
            async move {
                gate.run(Op::Write, 4096, async move {
                    let _ = issued.send(());
                    answered.await.map_err(io::Error::other)
                })
                .await
            }
        });
        is_issued.await.unwrap();
        fence.revoke();
        let late_for = Duration::from_secs(60);
        assert!(
            !gate.idle_within(Duration::from_millis(50), late_for).await,
            "a write in service counts as idle"
        );
        let late = gate.run(Op::Write, 4096, async { Ok(()) }).await;
        assert_eq!(late.unwrap_err().to_string(), fence::FENCED);
        let read = gate.run(Op::Read, 4096, async { Ok(()) }).await;
        assert_eq!(read.unwrap_err().to_string(), fence::READS_FENCED);
        gate.run(Op::Flush, 0, async { Ok(()) }).await.unwrap();
        let waited = tokio::spawn({
            let gate = gate.clone();
            async move { gate.idle_within(Duration::from_secs(10), late_for).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waited.is_finished(), "idle before the write was answered");
        answer.send(()).unwrap();
        write.await.unwrap().unwrap();
        assert!(waited.await.unwrap());
        // A write whose connection was lost with it in flight frees its slot, but its server
        // may still carry it out: not idle until `late` has passed since.
        let gate = Gate::new(4);
        let lost = gate
            .run(Op::Write, 4096, async {
                Err::<(), _>(io::Error::from(io::ErrorKind::ConnectionReset))
            })
            .await;
        assert!(lost.is_err());
        assert!(!gate.idle_within(Duration::from_secs(1), late_for).await);
        assert!(
            gate.idle_within(Duration::from_secs(1), Duration::ZERO)
                .await
        );
        // A refused one, or a read cut off, is over.
        let gate = Gate::new(4);
        let _ = gate
            .run(Op::Write, 4096, async {
                Err::<(), _>(io::Error::from_raw_os_error(libc::EIO))
            })
            .await;
        let _ = gate
            .run(Op::Read, 4096, async {
                Err::<(), _>(io::Error::from(io::ErrorKind::ConnectionReset))
            })
            .await;
        assert!(gate.idle_within(Duration::from_secs(1), late_for).await);
    }

    /// After a write whose answer was lost, the gate lets no write, zeroing or trim out until
    /// it can have landed; reads and flushes go on, and a closed fence still refuses at once.
    #[tokio::test]
    async fn writes_wait_for_one_that_went_unanswered_to_land() {
        let gate = Arc::new(Gate::new(4));
        let fence = Arc::new(Fence::open());
        gate.set_fence(fence.clone());
        assert_eq!(gate.late_writes_pending(), None);
        let lost = gate
            .run(Op::Write, 4096, async {
                Err::<(), _>(io::Error::from(io::ErrorKind::ConnectionAborted))
            })
            .await;
        let lost_at = Instant::now();
        assert!(lost.is_err());
        assert!(gate.late_writes_pending().is_some());
        let read_at = Instant::now();
        gate.run(Op::Read, 4096, async { Ok(()) }).await.unwrap();
        gate.run(Op::Flush, 0, async { Ok(()) }).await.unwrap();
        assert!(read_at.elapsed() < LATE_WRITE_GRACE / 2, "a read waited");
        for op in [Op::Write, Op::WriteZeroes, Op::Trim] {
            let issued_at = gate
                .run(op, 4096, async { Ok(Instant::now()) })
                .await
                .unwrap();
            assert!(
                issued_at.duration_since(lost_at) >= LATE_WRITE_GRACE,
                "{op:?} went out {:?} after the lost write",
                issued_at.duration_since(lost_at)
            );
        }
        assert_eq!(gate.late_writes_pending(), None);
        // A lost write, then a closed fence: the next write is refused at once.
        let _ = gate
            .run(Op::Write, 4096, async {
                Err::<(), _>(io::Error::from(io::ErrorKind::TimedOut))
            })
            .await;
        fence.revoke();
        let refused_at = Instant::now();
        let r = gate.run(Op::Write, 4096, async { Ok(()) }).await;
        assert_eq!(r.unwrap_err().to_string(), fence::FENCED);
        assert!(refused_at.elapsed() < LATE_WRITE_GRACE / 2);
        // A write refused with an answer (EIO) was not carried out: nothing to wait for.
        let gate = Gate::new(4);
        let _ = gate
            .run(Op::Write, 4096, async {
                Err::<(), _>(io::Error::from_raw_os_error(libc::EIO))
            })
            .await;
        assert_eq!(gate.late_writes_pending(), None);
    }

    #[test]
    fn names_are_checked() {
        for good in ["demo", "web-01", "a", "DB_2.disk"] {
            assert!(check_name("volume", good).is_ok(), "{good}");
        }
        for bad in ["", "-x", ".x", "a/b", "a b", "ü", &"x".repeat(65)] {
            assert!(check_name("volume", bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn spec_serializes_flat_with_kind_tag() {
        let s = DatastoreSpec {
            name: "san".into(),
            kind: Kind::Lun {
                target: "nbd://127.0.0.1:10810/x".into(),
                lun_id: None,
            },
            class: Class::Ssd,
            queue_depth: 16,
            direct: false,
        };
        let j = serde_json::to_value(&s).unwrap();
        assert!(
            j.get("direct").is_none(),
            "records stay as older builds wrote them"
        );
        let direct = DatastoreSpec {
            direct: true,
            ..s.clone()
        };
        let d = serde_json::to_value(&direct).unwrap();
        assert_eq!(d["direct"], true);
        assert_eq!(serde_json::from_value::<DatastoreSpec>(d).unwrap(), direct);
        assert_eq!(j["kind"], "lun");
        assert_eq!(j["target"], "nbd://127.0.0.1:10810/x");
        let back: DatastoreSpec = serde_json::from_value(j).unwrap();
        assert_eq!(back, s);
    }
}
