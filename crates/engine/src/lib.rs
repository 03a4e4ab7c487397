//! The per-volume IO path (DESIGN §3).
//!
//! Every IO of a volume, from every NBD connection, goes through one [`Volume`], which routes it
//! by policy: `uncached` straight to the volume's datastore extent; `wt` and `wb` through the
//! host's cache ([`cache`]). Because all connections share the one object, a FLUSH on any
//! connection covers writes completed on every connection, which is what lets the server
//! advertise `NBD_FLAG_CAN_MULTI_CONN`.
//!
//! Policy changes ([`Volume::set_policy`]) drain dirty data under flow control while IO goes on,
//! then pause new IO for the brief moment it takes to destage the last writes and switch.
//!
//! - [`window`] and [`flow`]: the destager's window selection and flow-control math (pure).
//! - [`cache`]: the cache host, the destager, the `wt`/`wb`/`wbp` paths, and the copies a
//!   host keeps of other hosts' writes as their peer.
//! - [`replica`]: what the `wbp` path needs from peers (implemented by the daemon).

pub mod cache;
pub mod flow;
pub mod replica;
pub mod window;

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::Notify;
use tracing::{info, warn};
use uuid::Uuid;

use cache::{CacheHost, CacheReport, Mode, VolCache, VolOpts};
use cluster::{Policy, Tuning};
use datastore::stats::{IoStats, Op};
use datastore::Extent;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The datastore failed the IO; the errno (if any) is kept for the client.
    #[error("datastore IO failed: {0}")]
    Datastore(#[source] io::Error),
    /// The caller broke the volume's contract (a range outside it, a misaligned IO).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The volume is being deleted: it takes no more IO.
    #[error("volume is being deleted")]
    Revoked,
    /// vestad is stopping, and IO stalled for a hand-off to peers will not be rerouted.
    #[error("vestad is stopping")]
    Stopping,
    /// The cache could not do what was asked (a failed cache device, lost dirty data).
    #[error("cache: {0}")]
    Cache(String),
    /// No room in the cache for clean data right now (it is then not cached).
    #[error("no room in the cache")]
    NoRoom,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Every offset and length is a multiple of this.
pub const SECTOR: u64 = 512;

/// Where a volume's IO goes.
#[derive(Clone)]
enum Route {
    Uncached,
    Cached(Arc<VolCache>),
}

pub struct Volume {
    id: Uuid,
    name: String,
    size: u64,
    policy: Mutex<Policy>,
    route: RwLock<Route>,
    host: Option<Arc<CacheHost>>,
    tuning: Mutex<Tuning>,
    store: Extent,
    stats: IoStats,
    /// Set once, by [`Volume::revoke`]; no IO starts afterwards.
    revoked: AtomicBool,
    /// Set while a policy change needs the volume quiet; IO waits at the door.
    paused: AtomicBool,
    /// Set after a policy change whose switch hook failed: writes wait at the door (reads go
    /// on) until the owner has recorded the volume's new generation ([`Volume::release_writes`]).
    writes_held: AtomicBool,
    /// The newest generation a switch hook was given: the vault may name it, whether the
    /// hook said so or not. Held writes go on only while the cache writes in a generation at
    /// least this new ([`Volume::release_writes`]).
    hooked_gen: AtomicU64,
    /// Woken by a resume and by a release.
    resumed: Notify,
    /// IOs between [`Volume::enter`] and their end.
    in_flight: AtomicU64,
    drained: Notify,
    /// One policy change at a time.
    transition: tokio::sync::Mutex<()>,
    /// Woken when the route changes, when a hand-off to peers is given up, and by a revoke
    /// or a stop: IO stalled by a failed cache device waits on it ([`Volume::measured`]).
    rerouted: Notify,
    /// Set when the host's cache device failed and no peer can replay what it held: IO that
    /// would stall for the hand-off goes on as in `wb` instead.
    handoff_lost: Mutex<Option<String>>,
    /// Set when vestad stops: IO that would stall for a hand-off ends with
    /// [`Error::Stopping`] instead.
    stopping: AtomicBool,
    /// Client IOs waiting for the datastore to be reachable again ([`Unreachable`]).
    unreachable_ios: AtomicU64,
}

/// One IO inside the volume; dropping it lets a revocation or pause know when the last is done.
struct InFlight<'a>(&'a Volume);

/// A client's IO that found its datastore unreachable ([`datastore::unreachable`]: an NBD
/// server restarting, a path failing over), whether it went there directly (`uncached`) or
/// through the cache (a `wt` write, a read miss, a FLUSH), and waits for
/// it to come back ([`Volume::measured`]), as DESIGN §4 stalls a volume whose datastore failed
/// instead of failing its IO. Tried again after a pause that doubles from
/// [`UNREACHABLE_RETRY_FIRST`] to [`UNREACHABLE_RETRY_MAX`], outside the volume (a pause, a
/// revocation or a policy change goes ahead meanwhile), until the datastore's
/// [`Gate::unreachable_wait`](datastore::Gate::unreachable_wait) has passed since the IO
/// first failed; then it fails with the datastore's error. Sending the same IO again loses
/// and reorders nothing: it never completed, so no client IO was ordered after it, and a
/// write that went unanswered goes out again only after its gate's
/// [`LATE_WRITE_GRACE`](datastore::LATE_WRITE_GRACE). A FLUSH sent again still reports
/// writes a restarted server lost ([`datastore::Extent::flush`]).
struct Unreachable<'a> {
    volume: &'a Volume,
    deadline: tokio::time::Instant,
    pause: Duration,
    /// Whether the IO went on: the datastore answered it.
    answered: bool,
}

const UNREACHABLE_RETRY_FIRST: Duration = Duration::from_millis(50);
const UNREACHABLE_RETRY_MAX: Duration = Duration::from_secs(1);

impl<'a> Unreachable<'a> {
    fn new(volume: &'a Volume, e: &io::Error) -> Unreachable<'a> {
        let wait = volume.store.gate().unreachable_wait();
        // With no wait the IO fails at once, and its failure is logged as any other.
        if volume.unreachable_ios.fetch_add(1, Ordering::SeqCst) == 0 && !wait.is_zero() {
            warn!(
                "volume {:?}: its datastore is unreachable ({e}); its IO waits up to {} s for \
                 it to come back",
                volume.name,
                wait.as_secs_f64()
            );
        }
        Unreachable {
            volume,
            deadline: tokio::time::Instant::now() + wait,
            pause: UNREACHABLE_RETRY_FIRST,
            answered: false,
        }
    }

    /// Waits before the IO is tried again, unless its time is up (`e`, the datastore's
    /// error, is the IO's), vestad stops, or the volume is revoked (the next
    /// [`Volume::enter`] says so).
    async fn pause(&mut self, e: io::Error) -> Result<()> {
        let v = self.volume;
        let rerouted = v.rerouted.notified();
        tokio::pin!(rerouted);
        rerouted.as_mut().enable();
        if v.stopping.load(Ordering::SeqCst) {
            return Err(Error::Stopping);
        }
        let now = tokio::time::Instant::now();
        if now >= self.deadline {
            return Err(Error::Datastore(e));
        }
        let until = (now + self.pause).min(self.deadline);
        self.pause = (self.pause * 2).min(UNREACHABLE_RETRY_MAX);
        tokio::select! {
            _ = tokio::time::sleep_until(until) => {}
            _ = rerouted => {}
        }
        if v.stopping.load(Ordering::SeqCst) {
            return Err(Error::Stopping);
        }
        Ok(())
    }
}

impl Drop for Unreachable<'_> {
    fn drop(&mut self) {
        let v = self.volume;
        if v.unreachable_ios.fetch_sub(1, Ordering::SeqCst) == 1 && self.answered {
            info!("volume {:?}: its datastore answers again", v.name);
        }
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if self.0.in_flight.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.drained.notify_waiters();
        }
    }
}

/// What [`Volume::accept_loss`] gives up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dropped {
    /// Dirty data only the failed cache device (or peers that cannot replay it) held.
    pub dirty_bytes: u64,
    pub dirty_writes: u64,
    /// Every write up to this `ser` is on the datastore.
    pub checkpoint: u64,
}

/// How long a policy change waits for IO in flight before it pauses the volume, new IO
/// waiting meanwhile (in-flight IO normally ends within milliseconds: a datastore IO, an
/// append, a flow-control delay of at most four datastore latencies).
const PAUSE_WAIT: Duration = Duration::from_secs(if cfg!(test) { 1 } else { 5 });

/// How long [`Volume::go_uncached_with_nothing_lost`] waits for IO in flight (a datastore
/// read, an append into a dying device) with the volume paused.
const REROUTE_PAUSE: Duration = Duration::from_secs(1);

/// How long [`Volume::accept_loss`] waits for the destager's datastore writes in flight.
const ACCEPT_LOSS_DESTAGER_WAIT: Duration = Duration::from_secs(10);

/// Whether an IO `op` on `c` waits to be rerouted once the host's cache device has failed
/// (see [`Volume::stalls`]): any IO of a volume with peers (or in an offline replay the
/// vault's peers back, `VolCache::replay_backed`), or anything but a read of a `wb`
/// volume with every write destaged (a read then comes from the datastore, which holds
/// everything).
fn waits_for_reroute(c: &VolCache, op: Op) -> bool {
    c.cache_failed()
        && (c.has_peers()
            || c.replay_backed()
            || (op != Op::Read && c.mode() == Mode::Wb && c.clean()))
}

fn mode_of(p: Policy) -> Option<Mode> {
    match p {
        Policy::Uncached => None,
        Policy::Wt => Some(Mode::Wt),
        Policy::Wb | Policy::Wbp { .. } => Some(Mode::Wb),
    }
}

/// Runs inside a policy change, after the volume is drained and paused and before it
/// switches: given the generation and checkpoint the switch starts, it records them (the
/// daemon writes the vault and opens the new peers). If it fails, nothing changes.
pub type SwitchHook = Box<dyn FnOnce(u64, u64) -> replica::BoxFuture<Result<(), String>> + Send>;

impl Volume {
    /// Opens a volume with `policy`. A cached policy needs the host's cache; so does a volume
    /// the cache log still holds dirty data for, whatever its policy (it is replayed first).
    pub fn open(
        id: Uuid,
        name: String,
        policy: Policy,
        tuning: Tuning,
        store: Extent,
        host: Option<Arc<CacheHost>>,
    ) -> Result<Volume> {
        let dirty_in_log = host.as_ref().is_some_and(|h| {
            h.recovered_volumes()
                .iter()
                .any(|(v, _, n)| *v == id && *n > 0)
        });
        let mut effective = policy;
        if let Policy::Wbp { .. } = policy {
            // Peers come later (the daemon picks them and calls set_policy_with); until then
            // writes go through to the datastore (DESIGN §4: a restarted owner finds wt).
            effective = Policy::Wt;
        }
        // Only wb replays (the policy recorded may lag a change that was interrupted). A
        // volume that is not wb replays in wb and leaves it for wt as the replay ends, before
        // it takes a write; an uncached one is then detached by its owner (wt writes are on
        // the datastore, so that is safe whenever it happens).
        let replay_in_wb = dirty_in_log && effective != Policy::Wb;
        if replay_in_wb {
            info!(
                "volume {name:?}: the cache log holds dirty data for it; replaying it in wb, \
                 then going on in wt (its policy is {policy})"
            );
        }
        let route = match (mode_of(effective), replay_in_wb) {
            (None, false) => Route::Uncached,
            (mode, _) => {
                let h = host.as_ref().ok_or_else(|| {
                    Error::Cache(format!(
                        "policy {policy} needs a cache device, and this host has none configured"
                    ))
                })?;
                let mode = if replay_in_wb {
                    Mode::Wb
                } else {
                    mode.unwrap_or(Mode::Wt)
                };
                let c = h.attach(
                    id,
                    &name,
                    store.clone(),
                    mode,
                    VolOpts::from_tuning(&tuning),
                )?;
                if replay_in_wb {
                    match c.after_replay(Mode::Wt) {
                        Ok(()) => effective = Policy::Wt,
                        // The cache device failed: wb takes no writes on a failed log.
                        Err(e) => {
                            warn!("volume {name:?}: stays in wb after its replay: {e}");
                            effective = Policy::Wb;
                        }
                    }
                }
                Route::Cached(c)
            }
        };
        Ok(Volume {
            id,
            name,
            size: store.size(),
            policy: Mutex::new(effective),
            route: RwLock::new(route),
            host,
            tuning: Mutex::new(tuning),
            store,
            stats: IoStats::default(),
            revoked: AtomicBool::new(false),
            paused: AtomicBool::new(false),
            writes_held: AtomicBool::new(false),
            hooked_gen: AtomicU64::new(0),
            resumed: Notify::new(),
            in_flight: AtomicU64::new(0),
            drained: Notify::new(),
            transition: tokio::sync::Mutex::new(()),
            rerouted: Notify::new(),
            handoff_lost: Mutex::new(None),
            stopping: AtomicBool::new(false),
            unreachable_ios: AtomicU64::new(0),
        })
    }

    /// An uncached volume (no cache host).
    pub fn new(id: Uuid, name: String, policy: Policy, store: Extent) -> Volume {
        Volume::open(id, name, policy, Tuning::default(), store, None)
            .expect("an uncached volume needs no cache")
    }

    pub fn id(&self) -> Uuid {
        self.id
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn policy(&self) -> Policy {
        *self.policy.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn tuning(&self) -> Tuning {
        *self.tuning.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// IO as the volume's clients see it, end to end.
    pub fn stats(&self) -> &IoStats {
        &self.stats
    }

    fn route(&self) -> Route {
        self.route.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The volume's cache, if it is cached.
    pub fn cache(&self) -> Option<Arc<VolCache>> {
        match self.route() {
            Route::Cached(c) => Some(c),
            Route::Uncached => None,
        }
    }

    /// The cache's view of the volume, if it is cached.
    pub fn cache_report(&self) -> Option<CacheReport> {
        match self.route() {
            Route::Cached(c) => Some(c.report()),
            Route::Uncached => None,
        }
    }

    /// Admits one IO, unless the volume is revoked; waits while it is paused. The count goes
    /// up before the flags are read and [`Volume::revoke`]/[`Volume::pause`] set their flag
    /// before reading the count (all sequentially consistent), so an IO either sees the flag or
    /// is waited for.
    async fn enter(&self, op: Op) -> Result<InFlight<'_>> {
        let writes = matches!(op, Op::Write | Op::WriteZeroes | Op::Trim);
        loop {
            let resumed = self.resumed.notified();
            tokio::pin!(resumed);
            resumed.as_mut().enable();
            self.in_flight.fetch_add(1, Ordering::SeqCst);
            let guard = InFlight(self);
            if self.revoked.load(Ordering::SeqCst) {
                return Err(Error::Revoked);
            }
            let held = writes && self.writes_held.load(Ordering::SeqCst);
            if !self.paused.load(Ordering::SeqCst) && !held {
                return Ok(guard);
            }
            drop(guard);
            resumed.await;
        }
    }

    /// Whether writes wait for the owner to record the volume's generation (see
    /// [`Volume::set_policy_with`]).
    pub fn writes_held(&self) -> bool {
        self.writes_held.load(Ordering::SeqCst)
    }

    /// Where the volume's bytes are on its datastore.
    pub fn extent(&self) -> &Extent {
        &self.store
    }

    /// Holds writes (reads go on) until [`Volume::release_writes`]: its owner could not
    /// record the volume as it is now, and the vault may still name peers of an older
    /// generation, whose replicas a replay would put over what the volume writes meanwhile.
    pub fn hold_writes(&self) {
        if !self.writes_held.swap(true, Ordering::SeqCst) {
            info!(
                "volume {:?}: writes held until its vault is recorded",
                self.name
            );
        }
    }

    /// Lets held writes go on: the owner has recorded the volume as it is now. Refused (false)
    /// while the cache writes in an older generation than a switch hook recorded: a restart
    /// that found the vault newer would drop those writes, and the peers it names lack them
    /// ([`Volume::catch_up_gen`] moves the cache on).
    pub fn release_writes(&self) -> bool {
        if let Some(behind) = self.gen_behind() {
            warn!("volume {:?}: writes stay held: {behind}", self.name);
            return false;
        }
        if self.writes_held.swap(false, Ordering::SeqCst) {
            info!("volume {:?}: writes go on", self.name);
        }
        self.resumed.notify_waiters();
        true
    }

    /// Why the cache writes in an older generation than the vault may name, if it does.
    fn gen_behind(&self) -> Option<String> {
        let Route::Cached(c) = self.route() else {
            return None; // uncached: every write is on the datastore
        };
        let (gen, hooked) = (c.gen(), self.hooked_gen.load(Ordering::SeqCst));
        (gen < hooked).then(|| {
            format!(
                "the cache writes in generation {gen}, the vault may name {hooked} (a switch \
                 was recorded that the cache log could not take)"
            )
        })
    }

    /// After a switch whose hook recorded a new generation and whose cache log then took
    /// neither it nor the fall-back to `wt` (a log with no room even for metadata), the cache
    /// still writes in the old generation, and the writes are held. This tries the fall-back
    /// again (IO paused a moment), so that the owner can record the vault from what the
    /// volume runs in and let them go. Nothing to do for a cache in step with the vault.
    pub async fn catch_up_gen(&self) -> Result<()> {
        let _one = self.transition.lock().await;
        if self.gen_behind().is_none() {
            return Ok(());
        }
        let Route::Cached(c) = self.route() else {
            return Ok(());
        };
        // Drained before the switch that failed, and no write went in since: held.
        let switched = self
            .paused_for(|| {
                if !c.clean() {
                    return Err(Error::Cache(
                        "the volume has dirty data; it stays as it is".into(),
                    ));
                }
                c.switch_mode(Mode::Wt, None)
            })
            .await;
        switched??;
        *self.policy.lock().unwrap_or_else(|e| e.into_inner()) = Policy::Wt;
        info!(
            "volume {:?}: in wt at generation {}, as its vault records",
            self.name,
            c.gen()
        );
        Ok(())
    }

    /// Waits up to `limit` for the IOs in the volume to finish. True if none is left.
    async fn quiesce(&self, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let drained = self.drained.notified();
            tokio::pin!(drained);
            drained.as_mut().enable();
            if self.in_flight.load(Ordering::SeqCst) == 0 {
                return true;
            }
            if tokio::time::timeout_at(deadline, drained).await.is_err() {
                return self.in_flight.load(Ordering::SeqCst) == 0;
            }
        }
    }

    /// Stops the volume taking IO, and waits up to `limit` for the IOs already issued to its
    /// datastore to finish. Only when this returns true may the volume's storage be freed: an
    /// IO still in flight could otherwise land in whatever is allocated there next.
    pub async fn revoke(&self, limit: Duration) -> bool {
        self.revoked.store(true, Ordering::SeqCst);
        self.resumed.notify_waiters();
        self.rerouted.notify_waiters();
        self.quiesce(limit).await
    }

    /// Undoes a [`Volume::revoke`] whose purpose (a delete, a relocation) failed: the volume
    /// serves again, and its destager goes on if `destage` (not if it was stopped before the
    /// delete: a volume handed off to its peers, whose replay may now write the datastore).
    pub fn unrevoke(&self, destage: bool) {
        self.revoked.store(false, Ordering::SeqCst);
        if destage {
            self.resume_destaging();
        }
    }

    /// Whether the destager is stopped for this volume ([`Volume::stop_destaging`]); false
    /// for an uncached volume, which has none.
    pub fn destaging_stopped(&self) -> bool {
        match self.route() {
            Route::Cached(c) => c.destaging_stopped(),
            _ => false,
        }
    }

    /// Stops the destager writing the volume's datastore (a delete is about to free it, a
    /// relocation to copy it, a hand-off to let the peers replay it).
    pub async fn stop_destaging(&self) {
        if let Route::Cached(c) = self.route() {
            c.stop_destaging().await;
        }
    }

    /// [`Volume::stop_destaging`], waiting at most `limit` for the destager's datastore writes
    /// in flight: false if some are still in flight then (the destager stays stopped; resume
    /// it or try again). True at once for an uncached volume.
    pub async fn stop_destaging_within(&self, limit: Duration) -> bool {
        match self.route() {
            Route::Cached(c) => c.stop_destaging_within(limit).await,
            _ => true,
        }
    }

    /// Lets the destager go on (a delete or a relocation did not happen).
    pub fn resume_destaging(&self) {
        if let Route::Cached(c) = self.route() {
            c.resume_destaging();
        }
    }

    /// Detaches the volume from the cache for good (it is being deleted): dirty data that was
    /// not destaged is dropped with it. A failure of the cache device is logged: the volume
    /// is detached all the same, and a failed log is not scanned for it again.
    pub async fn detach_cache(&self) {
        if let (Route::Cached(c), Some(h)) = (self.route(), &self.host) {
            if let Err(e) = h.detach(&c).await {
                warn!("volume {:?}: leaving the cache: {e}", self.name);
            }
        }
        self.set_route(Route::Uncached);
    }

    /// Gives the cache up without draining it, after the host's cache device failed and
    /// the datastore holds everything the volume wrote (a `wbp` peer replayed what the
    /// cache held, or it held nothing dirty): the volume goes on uncached.
    pub async fn abandon_cache(&self) {
        self.detach_cache().await;
        *self.policy.lock().unwrap_or_else(|e| e.into_inner()) = Policy::Uncached;
        // A later cache (its policy set again) stalls afresh if its device fails.
        *self.handoff_lost.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// Sends a `wb` volume (with or without peers) on uncached after the host's cache device
    /// failed with nothing dirty ([`Volume::stalled`]), losing nothing. IO pauses first (for
    /// at most [`REROUTE_PAUSE`]), so that no write is left between its append and its
    /// staging: one that completed in the cache as it failed makes the volume dirty, and then
    /// nothing changes and this returns false (in `wb` its IO goes on, the loss reported;
    /// with peers it stalls on, for a hand-off).
    /// Otherwise IO resumes (writes stall outside the cache from here: nothing can make the
    /// volume dirty again), `hook` runs with the generation after the cache's and its
    /// checkpoint (the daemon records the vault there, so that a restart on the device drops
    /// what its log still holds of the volume), and the volume goes on uncached: true. If IO
    /// in flight does not end in time or `hook` fails, nothing changes (its writes stall on)
    /// and this fails.
    pub async fn go_uncached_with_nothing_lost(&self, hook: SwitchHook) -> Result<bool> {
        let _one = self.transition.lock().await;
        let Route::Cached(c) = self.route() else {
            return Ok(false);
        };
        if !self.stalls(&c, Op::Write) {
            return Ok(false);
        }
        let clean = self.paused_for(|| c.clean()).await?;
        if !clean {
            // Stalled IO looks again: no longer stalling.
            self.rerouted.notify_waiters();
            return Ok(false);
        }
        hook(c.gen() + 1, c.checkpoint())
            .await
            .map_err(Error::Cache)?;
        // Reads through the cache (from the datastore) end before it goes.
        self.paused_for(|| ()).await?;
        if let Some(h) = &self.host {
            if let Err(e) = h.detach(&c).await {
                warn!("volume {:?}: leaving the cache: {e}", self.name);
            }
        }
        self.set_route(Route::Uncached);
        *self.policy.lock().unwrap_or_else(|e| e.into_inner()) = Policy::Uncached;
        *self.handoff_lost.lock().unwrap_or_else(|e| e.into_inner()) = None;
        Ok(true)
    }

    /// Runs `f` with the volume paused and no IO in it, if IO in flight ends within
    /// [`REROUTE_PAUSE`]; IO resumes when `f` returns, or at once if it did not end in time.
    /// `f` must not wait: IO waits meanwhile.
    async fn paused_for<T>(&self, f: impl FnOnce() -> T) -> Result<T> {
        self.paused.store(true, Ordering::SeqCst);
        let r = if self.quiesce(REROUTE_PAUSE).await {
            Ok(f())
        } else {
            Err(Error::Cache(format!(
                "IO in flight did not end within {REROUTE_PAUSE:?}; trying again later"
            )))
        };
        self.resume();
        r
    }

    /// From now on IO that would stall for a hand-off to peers ([`Volume::measured`]) goes
    /// on as in `wb` instead (reads of clean data from the datastore, the rest failing), and
    /// so does IO stalled now: the host's cache device failed and no peer can replay what it
    /// held (the volume reports the loss). `why` is logged.
    pub fn stop_stalling(&self, why: String) {
        let mut lost = self.handoff_lost.lock().unwrap_or_else(|e| e.into_inner());
        if lost.is_none()
            && self
                .cache()
                .is_some_and(|c| waits_for_reroute(&c, Op::Write))
        {
            warn!(
                "volume {:?}: IO no longer waits to be rerouted: {why}",
                self.name
            );
        }
        *lost = Some(why);
        drop(lost);
        self.rerouted.notify_waiters();
    }

    /// What the volume would give up if its loss were accepted now ([`Volume::accept_loss`]):
    /// an error unless the host's cache device failed under it.
    pub fn loss(&self) -> Result<Dropped> {
        let Route::Cached(c) = self.route() else {
            return Err(Error::Cache(
                "the volume is not cached: nothing of it is lost".into(),
            ));
        };
        if !c.cache_failed() {
            return Err(Error::Cache(
                "this host's cache device works: nothing of the volume is lost".into(),
            ));
        }
        let r = c.report();
        Ok(Dropped {
            dirty_bytes: r.dirty_bytes,
            dirty_writes: r.dirty_writes,
            checkpoint: c.checkpoint(),
        })
    }

    /// The operator accepts that what the host's failed cache device held of the volume is
    /// lost: the writes above the checkpoint that only it (or peers that cannot replay them)
    /// had. The volume goes on uncached, its content from here on what the datastore holds
    /// (every write up to the checkpoint, maybe some of the window the destager was writing
    /// when the device failed), and its IO stops failing or stalling.
    ///
    /// IO pauses first (for at most [`REROUTE_PAUSE`]), so that no write is left between
    /// its append and its answer; then `hook` runs with the generation after the cache's
    /// and its checkpoint, while IO waits: the daemon records the vault there, with no
    /// peers, so that neither a restart on the device (if it works again) nor a former peer
    /// puts what it still holds of the volume over what the volume writes uncached. Only
    /// then does the route change. If IO in flight does not end in time, or `hook` fails,
    /// nothing changes and this fails.
    pub async fn accept_loss(&self, hook: SwitchHook) -> Result<Dropped> {
        let _one = self.transition.lock().await;
        let dropped = self.loss()?;
        let Route::Cached(c) = self.route() else {
            unreachable!("loss() answers only for a cached volume");
        };
        // A window the destager is writing ends first: none of it may land on the datastore
        // after a write the volume does uncached. A datastore that does not answer its writes
        // fails this (the operator retries) rather than hold the command for ever.
        let was_stopped = c.destaging_stopped();
        if !c.stop_destaging_within(ACCEPT_LOSS_DESTAGER_WAIT).await {
            if !was_stopped {
                c.resume_destaging();
            }
            return Err(Error::Cache(format!(
                "the destager's writes to the datastore did not end within \
                 {ACCEPT_LOSS_DESTAGER_WAIT:?} (is the datastore answering?); nothing changed, \
                 retry"
            )));
        }
        self.paused.store(true, Ordering::SeqCst);
        let r = async {
            if !self.quiesce(REROUTE_PAUSE).await {
                return Err(Error::Cache(format!(
                    "IO in flight did not end within {REROUTE_PAUSE:?}; nothing changed, retry"
                )));
            }
            // Counted again with IO quiet: a write may have completed in the cache as it
            // failed.
            let dropped = self.loss().unwrap_or(dropped);
            hook(c.gen() + 1, c.checkpoint())
                .await
                .map_err(|e| Error::Cache(format!("record the loss: {e}")))?;
            self.set_route(Route::Uncached);
            *self.policy.lock().unwrap_or_else(|e| e.into_inner()) = Policy::Uncached;
            *self.handoff_lost.lock().unwrap_or_else(|e| e.into_inner()) = None;
            Ok(dropped)
        }
        .await;
        self.resume();
        let dropped = match r {
            Ok(d) => d,
            Err(e) => {
                if !was_stopped {
                    c.resume_destaging();
                }
                return Err(e);
            }
        };
        if let Some(h) = &self.host {
            if let Err(e) = h.detach(&c).await {
                warn!("volume {:?}: leaving the cache: {e}", self.name);
            }
        }
        warn!(
            "volume {:?}: loss accepted: {} dirty byte(s) in {} write(s) dropped; serving it \
             uncached from what the datastore holds (every write up to {} at least)",
            self.name, dropped.dirty_bytes, dropped.dirty_writes, dropped.checkpoint
        );
        Ok(dropped)
    }

    /// vestad is stopping, and nothing will reroute the volume: IO stalled for a hand-off to
    /// peers, and IO that would stall, ends with [`Error::Stopping`] (ESHUTDOWN to an NBD
    /// client: a planned stop, not a loss).
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        self.rerouted.notify_waiters();
    }

    /// Whether the volume's writes stall now, waiting to be rerouted after the host's cache
    /// device failed ([`Volume::measured`]).
    pub fn stalled(&self) -> bool {
        matches!(&self.route(), Route::Cached(c) if self.stalls(c, Op::Write))
    }

    /// Whether IO on `c` stalls: the host's cache device failed, and the volume waits to go
    /// on uncached ([`Volume::abandon_cache`]) with nothing lost, unless that was given up
    /// ([`Volume::stop_stalling`]; its IO then goes on as in `wb`: clean reads from the
    /// datastore, the rest failing). Either the volume has peers, which replay what it held
    /// first (FVP §7.1), or it is in `wb` with every write destaged, so the datastore holds
    /// everything already. (A `wt` volume goes on uncached by itself; a `wb` one with dirty
    /// data lost it, and says so.)
    fn stalls(&self, c: &VolCache, op: Op) -> bool {
        waits_for_reroute(c, op)
            && self
                .handoff_lost
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_none()
    }

    /// Points the volume's IO at `route`, waking IO stalled on the route before.
    fn set_route(&self, route: Route) {
        *self.route.write().unwrap_or_else(|e| e.into_inner()) = route;
        self.rerouted.notify_waiters();
    }

    /// Waits, outside the volume (a stalled IO must not keep a pause or a delete waiting),
    /// until the volume no longer goes through `c` or the hand-off is given up
    /// ([`Volume::stop_stalling`]); either way the IO is then done again by the route. Fails
    /// if the volume is deleted or vestad stops ([`Volume::stop`]).
    async fn await_reroute(&self, c: &Arc<VolCache>, op: Op) -> Result<()> {
        loop {
            let rerouted = self.rerouted.notified();
            tokio::pin!(rerouted);
            rerouted.as_mut().enable();
            if self.revoked.load(Ordering::SeqCst) {
                return Err(Error::Revoked);
            }
            if self.stopping.load(Ordering::SeqCst) {
                return Err(Error::Stopping);
            }
            match self.route() {
                Route::Cached(now) if Arc::ptr_eq(&now, c) && self.stalls(c, op) => {}
                _ => return Ok(()),
            }
            // Woken by a reroute; the stall's condition is looked at again now and then too
            // (a write that completed in the cache as it failed makes the volume dirty).
            let _ = tokio::time::timeout(Duration::from_millis(100), rerouted).await;
        }
    }

    /// Pauses the volume once the IO in it has ended. IO that does not end within
    /// [`PAUSE_WAIT`] (a datastore that answers nothing, a write waiting for its peers) fails
    /// the pause, and IO goes on: the caller has changed nothing yet.
    async fn pause(&self) -> Result<()> {
        self.paused.store(true, Ordering::SeqCst);
        if self.quiesce(PAUSE_WAIT).await {
            return Ok(());
        }
        self.resume();
        Err(Error::Cache(format!(
            "IO in flight did not end within {PAUSE_WAIT:?} (the datastore or the peers may \
             not be answering); nothing changed"
        )))
    }

    fn resume(&self) {
        self.paused.store(false, Ordering::SeqCst);
        self.resumed.notify_waiters();
    }

    /// Changes the policy at run time (DESIGN §3, Transitions). Leaving `wb` drains dirty data
    /// under flow control while IO goes on, then pauses IO only to destage the last writes.
    pub async fn set_policy(&self, new: Policy) -> Result<()> {
        if let Policy::Wbp { .. } = new {
            return Err(Error::Cache(format!(
                "policy {new} needs peers: the daemon sets it with set_policy_with"
            )));
        }
        self.set_policy_with(new, None, None).await
    }

    /// Changes the policy, entering `wbp` with `peers` (required for `wbp`, ignored
    /// otherwise), with `hook` run between drain and switch ([`SwitchHook`]). Entering
    /// `wbp` again with new peers (after a peer failed) is a change too.
    pub async fn set_policy_with(
        &self,
        new: Policy,
        peers: Option<Arc<dyn replica::Replicator>>,
        hook: Option<SwitchHook>,
    ) -> Result<()> {
        let _one = self.transition.lock().await;
        let old = self.policy();
        let renew = matches!(new, Policy::Wbp { .. });
        if old == new && !renew {
            return Ok(());
        }
        if renew && peers.is_none() {
            return Err(Error::Cache(format!("policy {new} needs peers")));
        }
        let host = self
            .host
            .clone()
            .ok_or_else(|| Error::Cache("this host has no cache device configured".into()))?;
        let route = self.route();
        if let Route::Cached(c) = &route {
            if self.stalls(c, Op::Write) {
                return Err(Error::Cache(
                    "the cache device failed; the volume goes on uncached once the datastore \
                     holds everything (its peers replay what the cache held)"
                        .into(),
                ));
            }
        }
        // Dirty data drains while IO goes on, down to what one window carries; then IO pauses
        // for the rest (DESIGN §3, Transitions). A datastore that takes no writes ends the
        // change, with nothing changed: soon while IO is paused, reads included.
        if let Route::Cached(c) = &route {
            if !c.clean() {
                c.drain(c.queue_depth(), Duration::from_secs(10), cache::HUNG_AFTER)
                    .await?;
            }
        }
        self.pause().await?;
        let r = async {
            if let Route::Cached(c) = &route {
                if !c.clean() {
                    // IO waits meanwhile: a datastore that answers nothing for as long as
                    // one that fails ends the change.
                    let limit = Duration::from_secs(2);
                    c.drain(0, limit, limit).await?;
                }
            }
            // Entering wb: writes completed before now may sit in the datastore's volatile
            // cache, and a wb FLUSH only syncs the cache log. Flush the datastore first so a
            // later FLUSH covers them too.
            if mode_of(new) == Some(Mode::Wb) {
                self.store
                    .flush_internal()
                    .await
                    .map_err(Error::Datastore)?;
            }
            let route = match (&route, mode_of(new)) {
                (Route::Uncached, Some(_)) => {
                    // Attached in wt first; the switch below starts the generation the hook
                    // records.
                    let c = host.attach(
                        self.id,
                        &self.name,
                        self.store.clone(),
                        Mode::Wt,
                        VolOpts::from_tuning(&self.tuning()),
                    )?;
                    self.set_route(Route::Cached(c.clone()));
                    *self.policy.lock().unwrap_or_else(|e| e.into_inner()) = Policy::Wt;
                    Route::Cached(c)
                }
                _ => route.clone(),
            };
            let recorded = matches!((&route, &hook), (Route::Cached(_), Some(_)));
            if let (Route::Cached(c), Some(h)) = (&route, hook) {
                let (gen, checkpoint) = c.switch_marks();
                // Only peers the vault names can replay: without any, nothing to hold for.
                let had_peers = c.has_peers();
                self.hooked_gen.fetch_max(gen, Ordering::SeqCst);
                if let Err(e) = h(gen, checkpoint).await {
                    // The hook may have recorded the new generation before it failed (a
                    // vault write whose answer was lost), or not: then the vault may still
                    // name peers of the old generation, whose replicas a replay would put
                    // over anything written since. So the volume goes to wt (no write
                    // completes in this cache alone) and holds its writes until its owner
                    // has recorded the new generation (`release_writes`); reads go on.
                    if had_peers {
                        // Before anything that can fail: no write may pass unheld.
                        self.writes_held.store(true, Ordering::SeqCst);
                    }
                    if let Err(e) = c.switch_mode(Mode::Wt, None) {
                        // Still in the old generation, which the vault may no longer name:
                        // held with or without peers (a restart would drop what it wrote),
                        // until `catch_up_gen` moves the cache on.
                        self.writes_held.store(true, Ordering::SeqCst);
                        return Err(e);
                    }
                    *self.policy.lock().unwrap_or_else(|e| e.into_inner()) = Policy::Wt;
                    if !had_peers {
                        return Err(Error::Cache(format!("{e}; the volume is in wt meanwhile")));
                    }
                    return Err(Error::Cache(format!(
                        "{e}; the volume is in wt, its writes held until its vault is recorded"
                    )));
                }
            }
            match (&route, mode_of(new)) {
                (Route::Cached(c), Some(mode)) => {
                    if let Err(e) = c.switch_mode(mode, peers) {
                        if !recorded {
                            return Err(e);
                        }
                        // The hook recorded the new generation (and the peers it names), but
                        // the cache still writes in the old one: writes completed now could
                        // be dropped by a restart that finds the vault newer, or be missing
                        // from those peers. As for a failed hook: held until the owner
                        // records the vault again from what the volume runs in, in wt.
                        self.writes_held.store(true, Ordering::SeqCst);
                        c.switch_mode(Mode::Wt, None)?;
                        *self.policy.lock().unwrap_or_else(|e| e.into_inner()) = Policy::Wt;
                        return Err(Error::Cache(format!(
                            "{e}; the volume is in wt, its writes held until its vault is \
                             recorded"
                        )));
                    }
                }
                (Route::Cached(c), None) => {
                    let r = host.detach(c).await;
                    self.set_route(Route::Uncached);
                    if let Err(e) = r {
                        // Uncached all the same: everything it wrote is on the datastore.
                        *self.policy.lock().unwrap_or_else(|e| e.into_inner()) = Policy::Uncached;
                        return Err(e);
                    }
                }
                (Route::Uncached, _) => {}
            }
            if recorded {
                // Recorded, and the cache writes in it: whatever an earlier failure held may go.
                self.release_writes();
            }
            Ok(())
        }
        .await;
        self.resume();
        r?;
        *self.policy.lock().unwrap_or_else(|e| e.into_inner()) = new;
        info!("volume {:?}: policy {old} -> {new}", self.name);
        Ok(())
    }

    /// Changes write-back tuning at run time.
    pub fn set_tuning(&self, t: Tuning) {
        *self.tuning.lock().unwrap_or_else(|e| e.into_inner()) = t;
        if let Route::Cached(c) = self.route() {
            c.set_opts(VolOpts::from_tuning(&t));
        }
    }

    /// The IO contract, checked again here although the NBD layer already did: the engine
    /// never trusts its callers with a write outside the volume.
    fn check(&self, offset: u64, len: u64) -> Result<()> {
        let in_range = offset.checked_add(len).is_some_and(|end| end <= self.size);
        if !in_range || !offset.is_multiple_of(SECTOR) || !len.is_multiple_of(SECTOR) {
            return Err(Error::Invalid(format!(
                "volume {:?}: range {offset}+{len} is misaligned or outside {} bytes",
                self.name, self.size
            )));
        }
        Ok(())
    }

    /// Runs one IO by the volume's route, `cached` on its cache or `direct` on the
    /// datastore, inside the volume (admitted by [`Volume::enter`]) and counted in its stats.
    ///
    /// When the host's cache device has failed under a volume with peers, the IO stalls
    /// instead of failing, as FVP §7.1 stalls the VM: the peers replay what the device held,
    /// the owner gives the cache up ([`Volume::abandon_cache`]), and the IO is done again by
    /// the new route. Nothing is lost or reordered by that: no IO on a failed device
    /// completes, so an IO that stalled never completed, and whatever overlaps it was issued
    /// while it was outstanding. Reads of clean data stall too: while a peer replays from
    /// the vault's checkpoint, the datastore can hold older versions than it did. A `wb`
    /// volume with nothing dirty stalls the same way until it goes on uncached
    /// ([`Volume::go_uncached_with_nothing_lost`]), all but its reads: the datastore holds
    /// everything already.
    ///
    /// Once the datastore is no longer this pod's ([`datastore::Gate::shut_out`]) every IO
    /// fails, a cached one too: a write the cache took would never reach the datastore, and
    /// a read from the cache could be older than what the pod that took the datastore over
    /// has written since.
    async fn measured<T, C, D>(
        &self,
        op: Op,
        bytes: u64,
        cached: impl Fn(Arc<VolCache>) -> C,
        direct: impl Fn() -> D,
    ) -> Result<T>
    where
        C: std::future::Future<Output = Result<T>>,
        D: std::future::Future<Output = io::Result<T>>,
    {
        let mut started = None;
        let mut unreachable = None;
        let r = loop {
            let inside = match self.enter(op).await {
                Ok(g) => g,
                Err(e) => break Err(e),
            };
            // Asked once inside: an IO may have waited there (a pause) while it was shut.
            if let Some(why) = self.shut_out_reason() {
                break Err(Error::Datastore(io::Error::other(why.to_owned())));
            }
            started.get_or_insert_with(|| self.stats.start());
            let (r, cache) = match self.route() {
                Route::Uncached => (direct().await.map_err(Error::Datastore), None),
                Route::Cached(c) if self.stalls(&c, op) => {
                    (Err(Error::Cache("the cache device failed".into())), Some(c))
                }
                Route::Cached(c) => (cached(c.clone()).await, Some(c)),
            };
            match r {
                Err(_) if cache.as_ref().is_some_and(|c| self.stalls(c, op)) => {
                    drop(inside);
                    let c = cache.expect("cached");
                    if let Err(e) = self.await_reroute(&c, op).await {
                        break Err(e);
                    }
                }
                // Uncached IO, or through the cache a `wt` write, a read miss, a FLUSH the
                // datastore owes: the cache kept nothing of an IO whose datastore part failed
                // (a `wt` write's range is dropped from the index), so it is done again whole.
                Err(Error::Datastore(e)) if datastore::unreachable(&e) => {
                    drop(inside);
                    let waiting = unreachable.get_or_insert_with(|| Unreachable::new(self, &e));
                    if let Err(e) = waiting.pause(e).await {
                        break Err(e);
                    }
                }
                r => break r,
            }
        };
        if let Some(u) = &mut unreachable {
            u.answered = r.is_ok();
        }
        if let Some(t) = started {
            self.stats.finish(t, op, bytes, r.is_ok());
        }
        r
    }

    /// Why the volume's datastore is no longer this pod's, once it is not
    /// ([`datastore::Gate::shut_out`]): every IO of the volume fails from then on.
    pub fn shut_out_reason(&self) -> Option<&str> {
        self.store.gate().shut_out_reason()
    }

    pub async fn read(&self, offset: u64, len: u32) -> Result<Bytes> {
        self.check(offset, u64::from(len))?;
        self.stats.locate(Op::Read, offset, u64::from(len));
        self.measured(
            Op::Read,
            u64::from(len),
            |c| async move { c.read(offset, len).await },
            || self.store.read(offset, len as usize),
        )
        .await
    }

    /// Writes `data` at `offset`. Not cancel-safe in a cached policy: see
    /// [`VolCache::write`].
    pub async fn write(&self, offset: u64, data: Bytes, fua: bool) -> Result<()> {
        let n = data.len() as u64;
        self.check(offset, n)?;
        self.stats.locate(Op::Write, offset, n);
        let data = &data;
        self.measured(
            Op::Write,
            n,
            |c| async move { c.write(offset, data.clone(), fua).await },
            || self.store.write(offset, data.clone(), fua),
        )
        .await
    }

    /// Makes every completed write durable on stable media.
    pub async fn flush(&self) -> Result<()> {
        self.measured(
            Op::Flush,
            0,
            |c| async move { c.flush().await },
            || self.store.flush(),
        )
        .await
    }

    pub async fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.check(offset, len)?;
        self.measured(
            Op::Trim,
            0,
            // Trimmed data may read back as anything; zeroes are the safe anything.
            |c| async move { c.write_zeroes(offset, len, false, fua).await },
            || async move {
                self.store.trim(offset, len).await?;
                if fua {
                    self.store.flush().await?;
                }
                Ok(())
            },
        )
        .await
    }

    pub async fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        may_trim: bool,
        fua: bool,
    ) -> Result<()> {
        self.check(offset, len)?;
        self.measured(
            Op::WriteZeroes,
            0,
            |c| async move { c.write_zeroes(offset, len, !may_trim, fua).await },
            || async move {
                self.store.write_zeroes(offset, len, may_trim).await?;
                if fua {
                    self.store.flush().await?;
                }
                Ok(())
            },
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    use async_trait::async_trait;
    use datastore::device::Device;
    use datastore::Gate;

    /// A device whose writes wait until the test lets them go.
    struct Held {
        release: Arc<Notify>,
        writes: AtomicU64,
    }

    #[async_trait]
    impl Device for Held {
        fn size(&self) -> u64 {
            1 << 20
        }
        fn describe(&self) -> String {
            "held".into()
        }
        async fn read_at(&self, _: u64, len: usize) -> io::Result<Bytes> {
            Ok(Bytes::from(vec![0; len]))
        }
        async fn write_at(&self, _: u64, _: Bytes, _: bool) -> io::Result<()> {
            self.release.notified().await;
            self.writes.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
        async fn flush(&self) -> io::Result<()> {
            Ok(())
        }
        async fn trim(&self, _: u64, _: u64) -> io::Result<()> {
            Ok(())
        }
        async fn write_zeroes(&self, _: u64, _: u64, _: bool) -> io::Result<()> {
            Ok(())
        }
    }

    /// A datastore device whose writes wait until released (a hung datastore).
    fn held() -> Arc<Held> {
        Arc::new(Held {
            release: Arc::new(Notify::new()),
            writes: AtomicU64::new(0),
        })
    }

    /// A datastore device that cannot be reached for its first `down` IOs (each fails with
    /// `error`), then answers from memory.
    struct Flaky {
        mem: datastore::device::MemDevice,
        down: AtomicU64,
        error: fn() -> io::Error,
        tries: AtomicU64,
    }

    impl Flaky {
        fn new(down: u64, error: fn() -> io::Error) -> Arc<Flaky> {
            Arc::new(Flaky {
                mem: datastore::device::MemDevice::new(1 << 20),
                down: AtomicU64::new(down),
                error,
                tries: AtomicU64::new(0),
            })
        }

        fn answer(&self) -> io::Result<()> {
            self.tries.fetch_add(1, Ordering::SeqCst);
            let down = self
                .down
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
            match down {
                Ok(_) => Err((self.error)()),
                Err(_) => Ok(()),
            }
        }
    }

    #[async_trait]
    impl Device for Flaky {
        fn size(&self) -> u64 {
            self.mem.size()
        }
        fn describe(&self) -> String {
            "flaky".into()
        }
        async fn read_at(&self, offset: u64, len: usize) -> io::Result<Bytes> {
            self.answer()?;
            self.mem.read_at(offset, len).await
        }
        async fn write_at(&self, offset: u64, data: Bytes, fua: bool) -> io::Result<()> {
            self.answer()?;
            self.mem.write_at(offset, data, fua).await
        }
        async fn flush(&self) -> io::Result<()> {
            self.answer()?;
            self.mem.flush().await
        }
        async fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
            self.answer()?;
            self.mem.trim(offset, len).await
        }
        async fn write_zeroes(&self, offset: u64, len: u64, may_trim: bool) -> io::Result<()> {
            self.answer()?;
            self.mem.write_zeroes(offset, len, may_trim).await
        }
    }

    fn not_connected() -> io::Error {
        io::Error::new(io::ErrorKind::NotConnected, "cannot reach NBD server")
    }

    fn shutting_down() -> io::Error {
        io::Error::from_raw_os_error(libc::ESHUTDOWN)
    }

    fn eio() -> io::Error {
        io::Error::from_raw_os_error(libc::EIO)
    }

    /// An uncached volume on `dev`, whose IO waits up to `wait` for it to be reachable.
    fn uncached_on(dev: Arc<dyn Device>, wait: Duration) -> Arc<Volume> {
        let gate = Arc::new(Gate::new(4));
        gate.set_unreachable_wait(wait);
        let extent = Extent::new(dev, 0, 1 << 20, gate);
        Arc::new(Volume::new(
            Uuid::nil(),
            "v".into(),
            Policy::Uncached,
            extent,
        ))
    }

    /// DESIGN §4: a volume whose datastore fails stalls; it does not fail its IO. A client's
    /// write, FLUSH and read on a datastore that cannot be reached for a while are sent again
    /// until it answers, and the write lands.
    #[tokio::test(start_paused = true)]
    async fn uncached_io_waits_for_an_unreachable_datastore_and_goes_on_when_it_answers() {
        for error in [not_connected as fn() -> io::Error, shutting_down] {
            let dev = Flaky::new(3, error);
            let v = uncached_on(dev.clone(), Duration::from_secs(30));
            v.write(4096, Bytes::from(vec![7; 4096]), false)
                .await
                .unwrap();
            assert_eq!(
                dev.tries.load(Ordering::SeqCst),
                4,
                "three failures, one answer"
            );
            dev.down.store(2, Ordering::SeqCst);
            v.flush().await.unwrap();
            dev.down.store(2, Ordering::SeqCst);
            assert_eq!(&v.read(4096, 4096).await.unwrap()[..], &[7; 4096][..]);
            assert_eq!(dev.tries.load(Ordering::SeqCst), 10);
            assert_eq!(v.unreachable_ios.load(Ordering::SeqCst), 0);
        }
    }

    /// The same through the cache: a `wt` write and a read miss wait for an unreachable
    /// datastore and go on when it answers; the write is on the datastore and reads back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_wt_write_and_a_read_miss_wait_for_an_unreachable_datastore() {
        let host = sim_host();
        let dev = Flaky::new(0, not_connected);
        dev.mem
            .write_at(65536, Bytes::from(vec![5; 4096]), false)
            .await
            .unwrap();
        let gate = Arc::new(Gate::new(4));
        gate.set_unreachable_wait(Duration::from_secs(30));
        let v = volume_in(
            &host,
            Extent::new(dev.clone(), 0, 1 << 20, gate),
            Policy::Wt,
        );
        host.finish_recovery(&[v.id()]).unwrap();
        dev.down.store(3, Ordering::SeqCst);
        v.write(0, Bytes::from(vec![7; 4096]), false).await.unwrap();
        assert_eq!(
            dev.tries.load(Ordering::SeqCst),
            4,
            "three failures, one answer"
        );
        assert_eq!(&dev.mem.read_at(0, 4096).await.unwrap()[..], &[7; 4096][..]);
        dev.down.store(2, Ordering::SeqCst);
        assert_eq!(&v.read(65536, 4096).await.unwrap()[..], &[5; 4096][..]);
        assert_eq!(dev.tries.load(Ordering::SeqCst), 7);
        assert_eq!(&v.read(0, 4096).await.unwrap()[..], &[7; 4096][..]);
        assert_eq!(v.unreachable_ios.load(Ordering::SeqCst), 0);
    }

    /// An IO still unanswered when the wait is over fails with the datastore's error; with
    /// no wait it fails at the first. An error that says the datastore refused the IO (EIO)
    /// fails it at once: sending it again would not change the answer.
    #[tokio::test(start_paused = true)]
    async fn uncached_io_fails_when_the_wait_is_over_or_the_datastore_refused_it() {
        let dev = Flaky::new(u64::MAX, not_connected);
        let v = uncached_on(dev.clone(), Duration::from_secs(10));
        let t = tokio::time::Instant::now();
        let e = v
            .write(0, Bytes::from(vec![1; 512]), false)
            .await
            .unwrap_err();
        assert!(matches!(&e, Error::Datastore(e) if e.kind() == io::ErrorKind::NotConnected));
        assert!(t.elapsed() >= Duration::from_secs(10), "{:?}", t.elapsed());
        let tries = dev.tries.load(Ordering::SeqCst);
        assert!((10..=20).contains(&tries), "sent {tries} times in 10 s");
        assert_eq!(v.unreachable_ios.load(Ordering::SeqCst), 0);

        let dev = Flaky::new(u64::MAX, not_connected);
        let v = uncached_on(dev.clone(), Duration::ZERO);
        v.read(0, 512).await.unwrap_err();
        assert_eq!(dev.tries.load(Ordering::SeqCst), 1);

        let dev = Flaky::new(1, eio);
        let v = uncached_on(dev.clone(), Duration::from_secs(10));
        let e = v
            .write(0, Bytes::from(vec![1; 512]), false)
            .await
            .unwrap_err();
        assert!(matches!(&e, Error::Datastore(e) if e.raw_os_error() == Some(libc::EIO)));
        assert_eq!(dev.tries.load(Ordering::SeqCst), 1);
    }

    /// An IO waiting for its datastore is outside the volume: a revocation (a delete) does
    /// not wait for it, and the IO ends with the revocation instead of being sent again;
    /// a stop of vestad ends it too.
    #[tokio::test(start_paused = true)]
    async fn a_revoke_or_a_stop_ends_an_io_waiting_for_its_datastore() {
        for stop in [false, true] {
            let dev = Flaky::new(u64::MAX, not_connected);
            let v = uncached_on(dev.clone(), Duration::from_secs(100));
            let w = {
                let v = v.clone();
                tokio::spawn(async move { v.write(0, Bytes::from(vec![1; 512]), false).await })
            };
            while dev.tries.load(Ordering::SeqCst) < 2 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let t = tokio::time::Instant::now();
            if stop {
                v.stop();
            } else {
                assert!(
                    v.revoke(Duration::from_millis(1)).await,
                    "the waiting IO is outside"
                );
            }
            let r = w.await.unwrap();
            assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
            if stop {
                assert!(matches!(r, Err(Error::Stopping)), "{r:?}");
            } else {
                assert!(matches!(r, Err(Error::Revoked)), "{r:?}");
            }
        }
    }

    /// A cache host on a simulated device of 32 segments.
    fn sim_host() -> Arc<CacheHost> {
        const SEG: u64 = 64 << 10;
        let cache = Arc::new(cachelog::device::SimDevice::new((1 << 20) + 32 * SEG));
        CacheHost::open(cache, SEG).unwrap()
    }

    /// A 1 MiB volume in `policy` on `dev` (a datastore of queue depth 4), cached by `host`.
    fn volume_on(host: &Arc<CacheHost>, dev: Arc<dyn Device>, policy: Policy) -> Volume {
        let extent = Extent::new(dev, 0, 1 << 20, Arc::new(Gate::new(4)));
        volume_in(host, extent, policy)
    }

    /// A new volume on `extent`, cached by `host`.
    fn volume_in(host: &Arc<CacheHost>, extent: Extent, policy: Policy) -> Volume {
        let (id, tuning) = (Uuid::new_v4(), Tuning::default());
        Volume::open(id, "v".into(), policy, tuning, extent, Some(host.clone())).unwrap()
    }

    #[tokio::test]
    async fn revoke_waits_for_in_flight_io_and_refuses_new_io() {
        let dev = Arc::new(Held {
            release: Arc::new(Notify::new()),
            writes: AtomicU64::new(0),
        });
        let extent = Extent::new(dev.clone(), 0, 1 << 20, Arc::new(Gate::new(4)));
        let v = Arc::new(Volume::new(
            Uuid::nil(),
            "v".into(),
            Policy::Uncached,
            extent,
        ));
        let w = {
            let v = v.clone();
            tokio::spawn(async move { v.write(0, Bytes::from(vec![1; 512]), false).await })
        };
        while v.in_flight.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        // The write is held at the device: a revocation must not report the volume drained.
        assert!(!v.revoke(Duration::from_millis(50)).await);
        assert!(matches!(v.read(0, 512).await, Err(Error::Revoked)));
        dev.release.notify_waiters();
        assert!(v.revoke(Duration::from_secs(5)).await);
        w.await.unwrap().unwrap();
        assert_eq!(dev.writes.load(Ordering::SeqCst), 1);
        assert!(matches!(
            v.write(0, Bytes::from(vec![1; 512]), false).await,
            Err(Error::Revoked)
        ));
        assert_eq!(dev.writes.load(Ordering::SeqCst), 1);
    }

    /// A datastore that hangs (its writes never answer: an NFS hard mount, an NBD server gone
    /// silent) holds up the destaging of its own volumes only; a volume on another datastore
    /// is destaged meanwhile. With one destager going from volume to volume it waited behind
    /// the hung window for good, and its dirty data filled its share.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_hung_datastore_holds_up_only_its_own_volumes_destaging() {
        let host = sim_host();
        let hung = held();
        let fine = Arc::new(datastore::device::MemDevice::new(1 << 20));
        let a = volume_on(&host, hung.clone(), Policy::Wb);
        let b = volume_on(&host, fine.clone(), Policy::Wb);
        host.finish_recovery(&[a.id(), b.id()]).unwrap();
        let destager = tokio::spawn(host.clone().run_destager(|| false));
        a.write(0, Bytes::from(vec![1; 4096]), false).await.unwrap();
        // a's window goes out first and hangs at its datastore.
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!a.cache().unwrap().clean());
        b.write(0, Bytes::from(vec![2; 4096]), false).await.unwrap();
        assert!(
            b.cache().unwrap().wait_clean(Duration::from_secs(10)).await,
            "b was not destaged while a's datastore hung"
        );
        assert_eq!(fine.image()[..4096], [2; 4096]);
        hung.release.notify_waiters();
        assert!(a.cache().unwrap().wait_clean(Duration::from_secs(10)).await);
        destager.abort();
    }

    /// While a window of a datastore is in flight, the destager looks at that datastore's
    /// volumes again when the window ends, so their writes meanwhile leave it be instead of
    /// waking it once each for nothing (in a QD32 run that cost a context switch per write and
    /// a quarter of the IOPS); and once the window ends, those writes are destaged.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn writes_behind_a_window_in_flight_leave_the_destager_be() {
        let host = sim_host();
        let hung = held();
        let gate = Arc::new(Gate::new(4));
        let on = |start: u64| {
            let extent = Extent::new(hung.clone(), start, 1 << 19, gate.clone());
            volume_in(&host, extent, Policy::Wb)
        };
        let (a, b) = (on(0), on(1 << 19));
        host.finish_recovery(&[a.id(), b.id()]).unwrap();
        let destager = tokio::spawn(host.clone().run_destager(|| false));
        a.write(0, Bytes::from(vec![1; 4096]), false).await.unwrap();
        // a's window goes out and hangs at the datastore.
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!a.cache().unwrap().clean());
        let (before, started) = (host.destager_passes(), std::time::Instant::now());
        for i in 1..=100u64 {
            let at = (i % 16) * 4096;
            a.write(at, Bytes::from(vec![i as u8; 4096]), false)
                .await
                .unwrap();
            b.write(at, Bytes::from(vec![i as u8; 4096]), false)
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        // A pass per idle interval is all there may be (the loop takes longer than its
        // 100 ms on a loaded machine: the bound grows with it, and stays far under one pass
        // per write unless the 200 writes took seconds).
        let passes = host.destager_passes() - before;
        let idle = (started.elapsed().as_millis() / cache::DESTAGER_IDLE.as_millis()) as u64;
        assert!(
            passes <= idle + 10,
            "the destager looked {passes} times for 200 writes in {idle} idle intervals"
        );
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let clean = || a.cache().unwrap().clean() && b.cache().unwrap().clean();
        while !clean() && std::time::Instant::now() < deadline {
            hung.release.notify_waiters();
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(clean(), "writes behind the window were left dirty");
        destager.abort();
    }

    /// A policy change over a datastore that answers nothing ends, with nothing changed and
    /// nothing lost, instead of holding the change, and the volume's IO while it is paused
    /// for the last of the drain, for as long as the datastore hangs: after 2 s in the
    /// paused step, after [`cache::HUNG_AFTER`] in the drain before it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_change_over_a_hung_datastore_gives_up_with_nothing_changed() {
        let host = sim_host();
        let hung = held();
        let v = volume_on(&host, hung.clone(), Policy::Wb);
        host.finish_recovery(&[v.id()]).unwrap();
        let destager = tokio::spawn(host.clone().run_destager(|| false));
        let c = v.cache().unwrap();
        let change = |wait: Duration| {
            let v = &v;
            async move {
                let started = std::time::Instant::now();
                let e = v.set_policy(Policy::Wt).await.unwrap_err();
                assert!(e.to_string().contains("answered none of its"), "{e}");
                let took = started.elapsed();
                assert!(took >= wait && took < wait * 3, "{took:?}");
                assert_eq!(v.policy(), Policy::Wb);
                // IO goes on.
                let read = tokio::time::timeout(Duration::from_secs(5), v.read(0, 4096));
                assert_eq!(read.await.unwrap().unwrap(), vec![1; 4096]);
            }
        };
        // One dirty write, fewer than a queue depth: the paused step.
        v.write(0, Bytes::from(vec![1; 4096]), false).await.unwrap();
        change(Duration::from_secs(2)).await;
        // More than a queue depth: the drain before it.
        for i in 1..8u64 {
            let w = Bytes::from(vec![1; 4096]);
            v.write(i * 65536, w, false).await.unwrap();
        }
        change(cache::HUNG_AFTER).await;
        assert!(!c.clean(), "the dirty writes are kept");
        // The datastore answers again (each window's writes as they come).
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !c.clean() && std::time::Instant::now() < deadline {
            hung.release.notify_waiters();
            c.wait_clean(Duration::from_millis(20)).await;
        }
        assert!(c.clean());
        assert_eq!(hung.writes.load(Ordering::SeqCst), 8);
        destager.abort();
    }

    /// A drain held up by anything but the datastore (here a stopped destager; in life a
    /// write waiting for its peers, or another volume's window waiting on its cache sync)
    /// sends it nothing, and is not taken for a hung datastore.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_drain_that_sends_the_datastore_nothing_does_not_call_it_hung() {
        let host = sim_host();
        let dev = Arc::new(datastore::device::MemDevice::new(1 << 20));
        let v = volume_on(&host, dev, Policy::Wb);
        host.finish_recovery(&[v.id()]).unwrap();
        let destager = tokio::spawn(host.clone().run_destager(|| false));
        let c = v.cache().unwrap();
        c.stop_destaging().await;
        v.write(0, Bytes::from(vec![1; 4096]), false).await.unwrap();
        let short = Duration::from_millis(100);
        let r = tokio::time::timeout(short * 10, c.drain(0, short, short)).await;
        assert!(r.is_err(), "the drain gave up: {r:?}");
        c.resume_destaging();
        c.drain(0, short * 50, short * 50).await.unwrap();
        destager.abort();
    }

    /// A change waits a bounded time for IO in flight before it pauses the volume: a write
    /// the datastore never answers fails it (nothing changed), and IO goes on.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_change_does_not_wait_for_ever_for_io_in_flight() {
        let host = sim_host();
        let hung = held();
        let v = Arc::new(volume_on(&host, hung.clone(), Policy::Uncached));
        let w = {
            let v = v.clone();
            tokio::spawn(async move { v.write(0, Bytes::from(vec![1; 4096]), false).await })
        };
        while v.in_flight.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        let e = v.set_policy(Policy::Wt).await.unwrap_err();
        assert!(e.to_string().contains("did not end within"), "{e}");
        assert_eq!(v.policy(), Policy::Uncached);
        let read = tokio::time::timeout(Duration::from_secs(5), v.read(0, 4096));
        read.await.expect("IO goes on").unwrap();
        hung.release.notify_waiters();
        w.await.unwrap().unwrap();
    }
}
