//! The daemon's state: datastores and volumes in service, and every operation the admin API
//! offers on them. Records live in the coordinator; this keeps the open objects.
//!
//! Admin operations that change records are serialized by one async lock, so two concurrent
//! requests can never both create the same name or delete a volume while it is being created.
//! The IO path never takes that lock: connections look volumes up in a read-locked map.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tracing::{debug, info, warn};
use uuid::Uuid;

use cluster::{Coordinator, HostRecord, Policy, Vault, VolumeRecord};
use datastore::{Datastore, DatastoreSpec, Kind, OpenMode};
use engine::cache::{CacheHost, CacheReport};
use engine::Volume;
use nbd::StopHandle;
use vesta_api as api;

use crate::config::Config;
use crate::stats::Sampler;

/// What went wrong with an admin request, by the HTTP status it maps to.
#[derive(Debug)]
pub enum OpError {
    BadRequest(String),
    NotFound(String),
    Conflict(String),
    Unavailable(String),
    Internal(String),
}

impl std::fmt::Display for OpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OpError::BadRequest(m)
            | OpError::NotFound(m)
            | OpError::Conflict(m)
            | OpError::Unavailable(m)
            | OpError::Internal(m) => f.write_str(m),
        }
    }
}

impl From<datastore::Error> for OpError {
    fn from(e: datastore::Error) -> OpError {
        use datastore::Error as E;
        match e {
            E::Invalid(m) | E::Foreign(m) => OpError::BadRequest(m),
            E::Exists(m) => OpError::Conflict(m),
            E::NotFound(m) => OpError::NotFound(m),
            e @ E::NoSpace { .. } => OpError::Conflict(e.to_string()),
            e @ E::Io { .. } => OpError::Unavailable(e.to_string()),
        }
    }
}

impl From<cluster::Error> for OpError {
    fn from(e: cluster::Error) -> OpError {
        match e {
            cluster::Error::Exists(m) => OpError::Conflict(m),
            cluster::Error::NotFound(m) => OpError::NotFound(m),
            cluster::Error::Locked(m) | cluster::Error::NotHeld(m) => OpError::Conflict(m),
            e @ cluster::Error::Unavailable(_) => OpError::Unavailable(e.to_string()),
            other => OpError::Internal(other.to_string()),
        }
    }
}

pub type OpResult<T> = Result<T, OpError>;

/// An open datastore, or why it could not be opened.
type Opened = Result<Arc<dyn Datastore>, String>;

/// A datastore in service, or why it is not.
struct DsEntry {
    spec: DatastoreSpec,
    store: Opened,
}

/// A volume in service.
pub struct VolumeEntry {
    pub record: VolumeRecord,
    /// The open volume, or why it could not be opened.
    pub volume: Result<Arc<Volume>, String>,
    attached: AtomicU32,
    /// Fired when the volume is deleted with force: its connections end.
    pub stop: StopHandle,
    /// The policy asked for; the volume's own is the one in effect (a `wbp` volume runs in
    /// `wt` while it has no peers).
    wanted: Mutex<Policy>,
    /// Whether [`Daemon::retry_unavailable`] may open it again: only if it could not be
    /// opened. A placeholder for a volume still open in this process (a relocation copying
    /// it, a delete waiting for its IO) must never get a second `Volume`.
    retry: bool,
    /// Set on the placeholder of a relocation whose record switch went unconfirmed: what
    /// settles it ([`Daemon::settle_relocation`]).
    unconfirmed: Option<Unconfirmed>,
    /// A placeholder standing in for the volume while an operation holds it open (a
    /// relocation): it keeps the vault lock the volume was opened under.
    stands_in: bool,
    /// A relocation's bytes copied so far, shown with its status.
    copied: Option<Arc<std::sync::atomic::AtomicU64>>,
}

/// A relocation whose record update failed and whose record could not be read back: the
/// record names the source or the copy, and which is known only once the coordinator answers.
/// Until then the volume serves from neither.
struct Unconfirmed {
    /// The volume as opened from the source: revoked, its destaging stopped, nothing dirty.
    volume: Arc<Volume>,
    /// The entry it was served under before the relocation.
    before: Arc<VolumeEntry>,
    /// The record naming the copy.
    rec: VolumeRecord,
    /// The copy, written whole and flushed.
    copy: datastore::Extent,
    /// The record was found naming neither datastore (said once).
    odd_record: std::sync::atomic::AtomicBool,
}

impl VolumeEntry {
    fn new(record: VolumeRecord, volume: Result<Arc<Volume>, String>) -> VolumeEntry {
        VolumeEntry {
            wanted: Mutex::new(record.policy),
            record,
            volume,
            attached: AtomicU32::new(0),
            stop: StopHandle::new(),
            retry: true,
            unconfirmed: None,
            stands_in: false,
            copied: None,
        }
    }

    /// Shown, and refused, as `why` while an operation holds the volume's `Volume` elsewhere.
    fn placeholder(record: VolumeRecord, why: String) -> VolumeEntry {
        VolumeEntry {
            stands_in: true,
            ..VolumeEntry::not_retried(record, why)
        }
    }

    /// Listed as `why`, not open, and not opened again by the retry of unopened volumes.
    fn not_retried(record: VolumeRecord, why: String) -> VolumeEntry {
        VolumeEntry {
            retry: false,
            ..VolumeEntry::new(record, Err(why))
        }
    }

    /// Whether this entry is what this host serves the volume under, with its vault lock: the
    /// volume is open, or still open in this process under an operation (a placeholder
    /// standing in for it).
    /// Whoever gave the lock up for an entry that is not open (its peers replay first, a
    /// delete failed) owes it back until the coordinator takes it. (A handed-off volume is
    /// open but has given its lock up too: [`Daemon::serves_with_lock`].)
    fn keeps_vault_lock(&self) -> bool {
        self.volume.is_ok() || self.stands_in
    }

    pub fn wanted(&self) -> Policy {
        *self.wanted.lock().expect("lock")
    }

    /// The record as it stands now: the policy asked for and the tuning in effect, which
    /// change at run time (`record` keeps the ones the volume was opened with). What a
    /// placeholder, a reinstated entry or a new record must start from.
    pub fn current_record(&self) -> VolumeRecord {
        let mut r = self.record.clone();
        r.policy = self.wanted();
        if let Ok(v) = &self.volume {
            r.tuning = v.tuning();
        }
        r
    }

    /// The policy in effect: the open volume's, which changes at run time (`record` keeps
    /// the one the volume was opened with).
    pub fn policy(&self) -> Policy {
        match &self.volume {
            Ok(v) => v.policy(),
            Err(_) => self.record.policy,
        }
    }

    pub fn connections(&self) -> u32 {
        self.attached.load(Ordering::SeqCst)
    }
}

/// A connection's hold on a volume; dropping it detaches.
pub struct Attachment {
    pub entry: Arc<VolumeEntry>,
    pub volume: Arc<Volume>,
}

impl Drop for Attachment {
    fn drop(&mut self) {
        self.entry.attached.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Where clients reach the NBD server, known once the listeners are bound.
#[derive(Debug, Clone, Default)]
pub struct NbdAddrs {
    pub unix: Option<PathBuf>,
    pub tcp: Option<std::net::SocketAddr>,
}

pub struct Daemon {
    pub config: Config,
    /// The pod's id ([`Coordinator::pod_id`]): LUNs formatted here carry it, and a LUN
    /// carrying another is refused.
    pod: Uuid,
    pub coord: Arc<dyn Coordinator>,
    /// The host's cache device, if one is configured.
    pub cache: Option<Arc<CacheHost>>,
    datastores: RwLock<BTreeMap<String, DsEntry>>,
    volumes: RwLock<BTreeMap<String, Arc<VolumeEntry>>>,
    admin: tokio::sync::Mutex<()>,
    pub nbd: OnceLock<NbdAddrs>,
    pub api_addr: OnceLock<std::net::SocketAddr>,
    pub sampler: Mutex<Sampler>,
    /// Volumes with a policy change or a relocation under way: one at a time per volume, so
    /// neither acts on a volume object or record the other has replaced.
    /// (It maps the volume to the operation, `relocation` or `policy change`.)
    busy: Mutex<HashMap<String, &'static str>>,
    /// Set when vestad starts to stop ([`Daemon::stop_volumes`]): a relocation's copy ends.
    stopping: std::sync::atomic::AtomicBool,
    /// `wbp`: this host's peer listener, failed peers, replays under way.
    pub peers: crate::peers::PeerState,
}

/// A claim on a volume for one long operation; released when dropped.
pub(crate) struct Busy<'a> {
    set: &'a Mutex<HashMap<String, &'static str>>,
    name: String,
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.set.lock().expect("lock").remove(&self.name);
    }
}

/// How long the planner does not move a volume back to the datastore it was relocated off
/// (no ping-pong; BASIL §5): a day of workload, long enough for the move's effect to show in
/// the models.
pub const RECENT_MOVE_S: u64 = 24 * 3600;
/// What an offline relocation copies per IO.
const RELOCATE_CHUNK: u64 = 1 << 20;
/// Chunks an offline relocation keeps in flight: enough to keep a LUN's queue busy, few
/// enough (8 MiB) to leave it to the other volumes.
const RELOCATE_IN_FLIGHT: usize = 8;

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// How long a delete waits for the volume's in-flight datastore IO to finish.
const FORCE_DETACH_WAIT: Duration = Duration::from_secs(30);
/// How long a delete waits for another change of its volume to finish before it is refused.
const CLAIM_WAIT: Duration = Duration::from_secs(5);
/// How long a delete waits for connections whose clients have hung up to end before it
/// refuses one still attached (`delete_volume`).
const DETACH_GRACE: Duration = Duration::from_secs(2);
/// How long a delete waits for the reopen of a volume that could not open: as long as that
/// can take (an NBD server that accepts but does not answer: 40 s to connect and negotiate,
/// then 60 s for a request), since deleting such a volume is the way out of it.
const REOPEN_WAIT: Duration = Duration::from_secs(110);
/// How long a datastore add waits for an existing `dir` datastore to answer whether it is
/// the same directory.
const SAME_DIR_WAIT: Duration = Duration::from_secs(2);
/// Longest a datastore may take to list its volumes when a start or a delete looks for copies
/// that interrupted relocations left there.
const LEFTOVER_LIST_WAIT: Duration = Duration::from_secs(10);

/// Stops the destager and revokes the volume before its storage is freed or copied: true
/// once neither the destager nor a client has a datastore IO in flight, false if some are
/// still in flight after [`FORCE_DETACH_WAIT`] in all (a datastore that stopped answering).
/// Then the destager stays stopped and the volume may be revoked: the caller undoes both
/// (`unrevoke`, which also resumes the destager if asked).
async fn quiesce_for_storage(volume: &Volume) -> bool {
    let deadline = std::time::Instant::now() + FORCE_DETACH_WAIT;
    volume.stop_destaging_within(FORCE_DETACH_WAIT).await
        && volume
            .revoke(deadline.saturating_duration_since(std::time::Instant::now()))
            .await
}

impl Daemon {
    /// Opens every datastore and volume the coordinator records, adding configured datastores
    /// that are new. Failures of single datastores or volumes are reported, not fatal: the
    /// rest keep serving.
    pub async fn start(
        config: Config,
        coord: Arc<dyn Coordinator>,
        cache: Option<Arc<CacheHost>>,
    ) -> anyhow::Result<Daemon> {
        let pod = match coord.stored_pod_id().await? {
            Some(p) => p,
            None => {
                // None stored: a new pod, or one whose id was lost while its datastores were
                // kept (an etcd restored from an older backup). Its LUNs' labels still carry
                // it, and a new one would shut this pod out of every one of them.
                let recorded = coord.state().await?.datastores;
                let found = match pod_of_luns(&recorded).await {
                    Ok(found) => found,
                    // Another host of a pod starting at the same time may have stored one
                    // meanwhile (and recorded a LUN this host cannot read yet).
                    Err(e) => match coord.stored_pod_id().await? {
                        Some(p) => Some(p),
                        None => return Err(e),
                    },
                };
                if let Some(p) = found {
                    info!("pod id {p}: none was stored; taken from the labels of the pod's LUNs");
                }
                coord.pod_id(found.unwrap_or_else(Uuid::new_v4)).await?
            }
        };
        let d = Daemon {
            pod,
            sampler: Mutex::new(Sampler::new(config.stats.history, config.stats.interval_s)),
            busy: Mutex::new(HashMap::new()),
            stopping: std::sync::atomic::AtomicBool::new(false),
            config,
            coord,
            cache,
            datastores: RwLock::new(BTreeMap::new()),
            volumes: RwLock::new(BTreeMap::new()),
            admin: tokio::sync::Mutex::new(()),
            nbd: OnceLock::new(),
            api_addr: OnceLock::new(),
            peers: Default::default(),
        };
        let state = d.coord.state().await?;
        for dc in &d.config.datastores {
            let spec = d.config.datastore_spec(dc)?;
            match state.datastores.iter().find(|s| s.name == spec.name) {
                Some(rec) if !same_location(rec, &spec) => anyhow::bail!(
                    "datastore {:?}: the config says {} {} but it was added as {} {}; put the \
                     config back, or give the new location another datastore name",
                    spec.name,
                    spec.kind_name(),
                    spec.location(),
                    rec.kind_name(),
                    rec.location()
                ),
                Some(rec) => {
                    // Class, queue depth and O_DIRECT follow the config.
                    let mut rec = rec.clone();
                    if rec.class != spec.class
                        || rec.queue_depth != spec.queue_depth
                        || rec.direct != spec.direct
                    {
                        rec.class = spec.class;
                        rec.queue_depth = spec.queue_depth;
                        rec.direct = spec.direct;
                        d.coord.update_datastore(rec).await?;
                    }
                }
                None => {
                    // Hosts of a cluster sharing one config start together: the first adds
                    // (and formats) the datastore, the others find it added.
                    let lock = d.coord.lock_datastore(&spec.name).await?;
                    let mode = OpenMode::Add {
                        force: dc.force,
                        take_over: dc.take_over,
                    };
                    let added = d.add_configured(&spec, mode).await;
                    if let Err(e) = d.coord.unlock_datastore(lock).await {
                        warn!("datastore {:?}: release metadata lock: {e}", spec.name);
                    }
                    added?;
                }
            }
        }
        let state = d.coord.state().await?;
        for spec in state.datastores {
            let store = match datastore::open_in_pod(&spec, OpenMode::Reopen, Some(d.pod)).await {
                Ok(s) => {
                    d.arm(&s);
                    d.warn_if_cached_by_host(&spec);
                    Ok(s)
                }
                Err(e) => {
                    warn!("datastore {:?} is unavailable: {e}", spec.name);
                    Err(e.to_string())
                }
            };
            d.datastores
                .write()
                .expect("lock")
                .insert(spec.name.clone(), DsEntry { spec, store });
        }
        let me = d.coord.host().to_owned();
        for rec in state.volumes {
            // Another host's volumes are its to serve; `vesta volume list` still shows them.
            if !rec.owned_by(&me) {
                continue;
            }
            let volume = d.open_volume(&rec).await;
            if let Err(e) = &volume {
                warn!("volume {:?} cannot serve IO: {e}", rec.name);
            }
            d.volumes
                .write()
                .expect("lock")
                .insert(rec.name.clone(), Arc::new(VolumeEntry::new(rec, volume)));
        }
        let stores: Vec<Arc<dyn Datastore>> = d
            .datastores
            .read()
            .expect("lock")
            .values()
            .filter_map(|e| e.store.as_ref().ok().cloned())
            .collect();
        // First what relocations cut short left behind: otherwise, once its volume is
        // deleted, such a copy would be imported below as a volume of its own.
        for s in &stores {
            d.free_leftover_copies(s).await;
        }
        // A crash between a create's storage and its record leaves storage no record knows
        // (a LUN table entry, a tagged image), holding the name and the space. It is imported
        // as when its datastore is added again: listed, and deletable. A create under way on
        // another host holds the datastore's lock over both steps, as the import does.
        for s in &stores {
            d.import_recorded_volumes(s, true).await;
        }
        Ok(d)
    }

    /// Undoes a create that failed after its record was made: nothing may stay behind. The
    /// record goes first, then the storage. If the record may still be there, the storage is
    /// kept and the volume listed here, not open ([`Daemon::keep_for_delete`]).
    async fn undo_recorded_create(
        &self,
        rec: &VolumeRecord,
        store: &Arc<dyn Datastore>,
        why: String,
    ) {
        // Both steps under the datastore's lock: an import between them would take the
        // storage for a create cut short and record it again.
        let undone = self.ds_locked(&rec.datastore, async {
            if let Err(e) = self.coord.delete_volume(&rec.name, rec.id).await {
                // The answer may be what was lost: look.
                let gone = match self.coord.state().await {
                    Ok(s) => !s.volumes.iter().any(|r| r.id == rec.id),
                    Err(_) => false,
                };
                if !gone {
                    return Err(OpError::Unavailable(format!(
                        "its record could not be removed ({e})"
                    )));
                }
            }
            if let Err(e) = store.delete_volume(&rec.spec()).await {
                warn!("rollback of volume {:?} failed: {e}", rec.name);
            }
            Ok(())
        });
        if let Err(e) = undone.await {
            warn!(
                "volume {:?}: its create failed ({why}) and was not undone: {e}",
                rec.name
            );
            self.keep_for_delete(rec, &why);
        }
    }

    /// Whether datastores `a` and `b` are provably different storage, so that freeing a copy
    /// of a volume on one cannot touch the other's. One directory may be configured under two
    /// names (renamed in the config, listed twice, a symlink), and a LUN with no id known
    /// cannot be told apart: then it is not proven, and nothing is freed.
    async fn distinct(a: &DatastoreSpec, b: &DatastoreSpec) -> bool {
        match (&a.kind, &b.kind) {
            (Kind::Dir { path: pa }, Kind::Dir { path: pb }) => {
                // Device and inode are not enough: one export mounted twice has two device
                // numbers. Each directory's identity file is one file however it is reached.
                let (pa, pb) = (pa.clone(), pb.clone());
                let ids = datastore::device::on_pool(move || {
                    use std::os::unix::fs::MetadataExt;
                    let (x, y) = (std::fs::metadata(&pa)?, std::fs::metadata(&pb)?);
                    if (x.dev(), x.ino()) == (y.dev(), y.ino()) {
                        return Ok(None);
                    }
                    let (x, y) = (
                        datastore::dir::identity(&pa)?,
                        datastore::dir::identity(&pb)?,
                    );
                    Ok(Some((x, y)))
                });
                matches!(
                    tokio::time::timeout(SAME_DIR_WAIT, ids).await,
                    Ok(Ok(Some((x, y)))) if x != y
                )
            }
            (
                Kind::Lun {
                    lun_id: Some(x), ..
                },
                Kind::Lun {
                    lun_id: Some(y), ..
                },
            ) => x != y,
            (Kind::Lun { .. }, Kind::Lun { .. }) => false,
            // A directory and a LUN.
            _ => true,
        }
    }

    fn datastore_spec(&self, name: &str) -> Option<DatastoreSpec> {
        self.datastores
            .read()
            .expect("lock")
            .get(name)
            .map(|e| e.spec.clone())
    }

    /// The datastores other than `except` that are open, with their specs.
    fn open_stores_but(&self, except: &str) -> Vec<(DatastoreSpec, Arc<dyn Datastore>)> {
        self.datastores
            .read()
            .expect("lock")
            .iter()
            .filter(|(n, _)| n.as_str() != except)
            .filter_map(|(_, e)| Some((e.spec.clone(), e.store.as_ref().ok()?.clone())))
            .collect()
    }

    /// The volumes `store` records, or None if it does not answer within
    /// [`LEFTOVER_LIST_WAIT`] (a hung NFS mount must not hold up a delete or a start).
    async fn listed(store: &Arc<dyn Datastore>) -> Option<Vec<datastore::VolumeSpec>> {
        match tokio::time::timeout(LEFTOVER_LIST_WAIT, store.recorded_volumes()).await {
            Ok(Ok(found)) => Some(found),
            Ok(Err(e)) => {
                warn!("datastore {:?}: list its volumes: {e}", store.spec().name);
                None
            }
            Err(_) => {
                warn!(
                    "datastore {:?}: listing its volumes took over {LEFTOVER_LIST_WAIT:?}; \
                     passed over",
                    store.spec().name
                );
                None
            }
        }
    }

    /// Lists `rec`, whose create failed midway and whose record may be there, as a volume that
    /// is not open and is not retried, so that `vesta volume delete` removes its record and
    /// storage. Otherwise a record would name this host and no entry here would answer for
    /// it: a delete would send the operator to this very host, and a create say it exists.
    fn keep_for_delete(&self, rec: &VolumeRecord, why: &str) {
        warn!(
            "volume {:?}: listed, not open, its storage kept: `vesta volume delete {}` removes \
             it",
            rec.name, rec.name
        );
        let entry =
            VolumeEntry::not_retried(rec.clone(), format!("its create failed ({why}); delete it"));
        self.volumes
            .write()
            .expect("lock")
            .insert(rec.name.clone(), Arc::new(entry));
    }

    /// Frees the copies of volume `rec`, being deleted, on datastores other than its own:
    /// what relocations cut short left behind (see [`Daemon::relocate`]). Every copy with its
    /// id is the deleted volume's (a `dir` removes only a file tagged with it, a LUN goes by
    /// id), whatever name its datastore goes by.
    async fn free_copies_elsewhere(&self, rec: &VolumeRecord) {
        for (spec, store) in self.open_stores_but(&rec.datastore) {
            let here = spec.name.clone();
            let Some(found) = Self::listed(&store).await else {
                continue;
            };
            let copies: Vec<_> = found.into_iter().filter(|v| v.id == rec.id).collect();
            for v in &copies {
                let freed = self.ds_locked(&here, async { Ok(store.delete_volume(v).await?) });
                match freed.await {
                    Ok(()) => info!(
                        "volume {:?}: freed the copy an interrupted relocation left on \
                         datastore {here:?}",
                        rec.name
                    ),
                    Err(e) => warn!(
                        "volume {:?}: the copy an interrupted relocation left on datastore \
                         {here:?} could not be freed: {e}",
                        rec.name
                    ),
                }
            }
        }
    }

    /// Frees, at start-up, the copies that relocations of this host's volumes left on
    /// `store` when a crash cut them short: a copy of a volume whose record names another
    /// datastore is either a copy not finished (the record never switched to it) or the
    /// source the switch left behind (the volume lives where the record says). Nothing of
    /// this host's is relocating yet; another host's volumes are its own to look after. A
    /// copy is freed only while the volume is open here from its own datastore, and that
    /// datastore is provably not this one under another name ([`Daemon::distinct`]);
    /// otherwise it may be the only copy anyone can read, or the volume's own.
    async fn free_leftover_copies(&self, store: &Arc<dyn Datastore>) {
        let Some(found) = Self::listed(store).await else {
            return;
        };
        if found.is_empty() {
            return;
        }
        let Ok(recorded) = self.coord.state().await.map(|s| s.volumes) else {
            return;
        };
        let spec = store.spec().clone();
        let here = spec.name.clone();
        let mine = |r: &VolumeRecord| {
            self.coord.kind() == "local" || r.owner.as_deref() == Some(self.coord.host())
        };
        for v in &found {
            let Some(r) = recorded.iter().find(|r| r.id == v.id) else {
                continue;
            };
            if r.datastore == here || !mine(r) {
                continue;
            }
            let serving = self
                .entry(&r.name)
                .is_ok_and(|e| e.volume.is_ok() && e.record.id == r.id);
            let Some(own) = self.datastore_spec(&r.datastore) else {
                continue;
            };
            if !serving || !Self::distinct(&own, &spec).await {
                warn!(
                    "datastore {here:?} holds a copy of volume {:?}, which lives on {:?}; kept, \
                     since {}",
                    r.name,
                    r.datastore,
                    if serving {
                        "the two datastores may be one storage under two names"
                    } else {
                        "the volume is not open from its own datastore"
                    }
                );
                continue;
            }
            let freed = self.ds_locked(&here, async { Ok(store.delete_volume(v).await?) });
            match freed.await {
                Ok(()) => warn!(
                    "datastore {here:?} held a copy of volume {:?} ({}) left by a relocation \
                     that a crash cut short; the volume lives on {:?}: freed the copy",
                    r.name,
                    api::format_size(v.size),
                    r.datastore
                ),
                Err(e) => warn!(
                    "datastore {here:?} holds a copy of volume {:?} left by a relocation that \
                     a crash cut short (the volume lives on {:?}); it could not be freed: {e}",
                    r.name, r.datastore
                ),
            }
        }
    }

    /// Adds a datastore from the config unless another host added it meanwhile (then its
    /// location must match).
    async fn add_configured(&self, spec: &DatastoreSpec, mode: OpenMode) -> anyhow::Result<()> {
        let state = self.coord.state().await?;
        if let Some(rec) = state.datastores.iter().find(|s| s.name == spec.name) {
            if !same_location(rec, spec) {
                anyhow::bail!(
                    "datastore {:?}: the config says {} {} but another host added it as {} {}",
                    spec.name,
                    spec.kind_name(),
                    spec.location(),
                    rec.kind_name(),
                    rec.location()
                );
            }
            return Ok(());
        }
        if let Kind::Dir { path } = &spec.kind {
            std::fs::create_dir_all(path).map_err(|e| {
                anyhow::anyhow!("create datastore directory {}: {e}", path.display())
            })?;
        }
        let store = datastore::open_in_pod(spec, mode, Some(self.pod))
            .await
            .map_err(|e| anyhow::anyhow!("add configured datastore: {e}"))?;
        // One LUN under two names would mean two locks on one volume table (as
        // `add_datastore` refuses): the label it carries names it.
        if let Kind::Lun {
            lun_id: Some(id), ..
        } = &store.spec().kind
        {
            let other = state
                .datastores
                .iter()
                .find(|s| matches!(&s.kind, Kind::Lun { lun_id: Some(o), .. } if o == id));
            if let Some(other) = other {
                anyhow::bail!(
                    "datastore {:?}: {} is the LUN of datastore {:?} already (its label says \
                     so); one LUN cannot be two datastores. Remove one of them from the config",
                    spec.name,
                    spec.location(),
                    other.name
                );
            }
        }
        self.coord.add_datastore(store.spec().clone()).await?;
        info!(
            "added configured datastore {:?} ({} {})",
            spec.name,
            spec.kind_name(),
            spec.location()
        );
        Ok(())
    }

    /// Readies a datastore this host opened for its volumes' IO: behind the host's fence,
    /// with the configured wait for a datastore that cannot be reached.
    fn arm(&self, store: &Arc<dyn Datastore>) {
        store.set_fence(self.coord.fence());
        store
            .gate()
            .set_unreachable_wait(self.config.unreachable_wait());
    }

    pub(crate) fn store_pub(&self, name: &str) -> OpResult<Arc<dyn Datastore>> {
        self.store(name)
    }

    fn store(&self, name: &str) -> OpResult<Arc<dyn Datastore>> {
        let ds = self.datastores.read().expect("lock");
        match ds.get(name) {
            Some(DsEntry { store: Ok(s), .. }) => Ok(s.clone()),
            Some(DsEntry { store: Err(e), .. }) => Err(OpError::Unavailable(format!(
                "datastore {name:?} is unavailable: {e}"
            ))),
            None => Err(OpError::NotFound(format!(
                "no datastore named {name:?}; known datastores: {}",
                known(ds.keys())
            ))),
        }
    }

    /// Opens a volume this host owns: takes its vault lock first (only the holder writes its
    /// datastore), then records the vault.
    async fn open_volume(&self, rec: &VolumeRecord) -> Result<Arc<Volume>, String> {
        crate::peers::take_vault_lock(self, rec.id)
            .await
            .map_err(|e| format!("not served by this host: {e}"))?;
        let store = self.store(&rec.datastore).map_err(|e| e.to_string())?;
        let extent = store
            .open_volume(&rec.spec())
            .await
            .map_err(|e| e.to_string())?;
        // Without the vault this host cannot tell whether its own dirty data is still the
        // newest: better not to open than to replay over a peer's replay.
        let vault = self
            .coord
            .vault(rec.id)
            .await
            .map_err(|e| format!("read vault record: {e}"))?;
        let named_peers = vault.as_ref().is_some_and(|v| !v.peers.is_empty());
        let vault_before = vault.clone();
        if let Some(v) = vault.as_ref() {
            // Hand it to its peers, as an owner whose cache device failed does; it serves here
            // again once one of them has replayed.
            if let Some(why) = self.peers_replay_first(v) {
                if !v.handoff {
                    let h = Vault {
                        handoff: true,
                        ..v.clone()
                    };
                    self.coord
                        .put_vault(&h)
                        .await
                        .map_err(|e| format!("hand the volume to its peers: {e}"))?;
                    warn!(
                        "volume {:?}: {why}; handing it to its peer(s) {:?}, which hold its \
                         latest writes, to replay first",
                        rec.name, v.peers,
                    );
                }
                crate::peers::give_lock_back(self, rec.id, &rec.name).await;
                return Err(format!(
                    "waiting for its peer(s) {:?} to replay it ({why}); it serves here again \
                     once they have. If none can, `vesta volume accept-loss {}` gives up what \
                     they held",
                    v.peers, rec.name
                ));
            }
        }
        if let (Some(cache), Some(vault)) = (&self.cache, vault) {
            // The vault is of a newer generation than this host's own dirty data: another
            // host replayed the volume since (online replay by a peer, for a dead owner or
            // for this host's failed cache device, after which this host served it
            // uncached and recorded a newer generation itself). The datastore is newer than
            // that dirty data now, and replaying it would put old data over new. Nothing
            // else moves the vault past dirty data: a replay continues its own generation,
            // and every switch to a new one drains the volume before it is recorded.
            if let Some(g) = cache.recovered_gen(rec.id) {
                if vault.gen > g {
                    let n = cache.discard_recovered(rec.id);
                    warn!(
                        "volume {:?}: replayed elsewhere since (vault generation {} > {g} \
                         here, last by host {:?}); dropping the {n} write(s) this host's cache \
                         log still held for it",
                        rec.name,
                        vault.gen,
                        vault.previous_owner.as_deref().unwrap_or(&vault.owner)
                    );
                }
            }
            cache.raise_gen(rec.id, vault.gen);
        }
        let v = Volume::open(
            rec.id,
            rec.name.clone(),
            rec.policy,
            rec.tuning,
            extent,
            self.cache.clone(),
        )
        .map(Arc::new)
        .map_err(|e| e.to_string())?;
        if rec.policy == Policy::Uncached && v.policy() != Policy::Uncached {
            // It replays its dirty data first (in wb, then wt: engine::Volume::open). It stays
            // in wt, which is safe, until its policy is set again.
            warn!(
                "volume {:?}: policy uncached, but the cache log held its dirty data; it goes \
                 on in wt after the replay until its policy is set again",
                rec.name
            );
        }
        if let (Some(c), Some(vault)) = (v.cache(), vault_before) {
            // Restarted after a crash with dirty data its peers hold too (the vault names
            // them for the generation it replays): they stay named until the replay ends, so
            // that they keep their replicas and replay the rest if this host's cache device
            // fails meanwhile (`peers::flash_failed`). Its writes then wait for the vault
            // record of the generation after the replay, without them
            // (`peers::release_held_writes`): one of them replaying their old replicas over
            // what the volume wrote since would undo those writes.
            let replaying = c.report().replaying;
            if replaying
                && !vault.peers.is_empty()
                && vault.gen == c.gen()
                && vault.owner == self.coord.host()
            {
                c.set_replay_backed();
                v.hold_writes();
                info!(
                    "volume {:?}: its peer(s) {:?} hold what it replays; they stay in its \
                     vault until the replay ends",
                    rec.name, vault.peers
                );
            }
        }
        self.record_vault_or_hold(rec, &v, named_peers).await;
        Ok(v)
    }

    /// Why this host must leave volume `v.volume` to the peers its vault names, to replay
    /// first; `None` if it may serve it.
    ///
    /// - The vault names peers of a generation this host's log never reached (a new cache
    ///   device, a host that died before its log had the switch): the volume's newest writes
    ///   may be only in their replicas. Serving it would record a new generation and make
    ///   them drop those.
    /// - It names another host as the writer of this host's own generation: a peer began an
    ///   online replay and did not finish it (it died, or its cache device failed). That
    ///   replay started from the newest checkpoint its peers knew, which may be older than
    ///   this host's own, and rewrote blocks from there: the datastore may hold older data
    ///   than this host's checkpoint says, and only the peers' replicas reach back far enough
    ///   to put the newest back.
    pub(crate) fn peers_replay_first(&self, v: &Vault) -> Option<String> {
        if v.peers.is_empty() {
            return None;
        }
        if v.owner != self.coord.host() {
            return Some(format!(
                "host {:?} began replaying it and did not finish",
                v.owner
            ));
        }
        let logged = self.cache.as_ref().and_then(|c| c.logged_gen(v.volume));
        logged.is_none_or(|g| g < v.gen).then(|| {
            format!(
                "this host's cache log holds nothing of its generation {} (a new cache \
                 device?)",
                v.gen
            )
        })
    }

    /// Writes the volume's vault record as this host, its owner, sees it now. A failure is
    /// logged: the record bounds a contender's replay, the cache log stays the truth.
    async fn record_vault(&self, rec: &VolumeRecord, v: &Volume) {
        if let Err(e) = self.try_record_vault(rec, v).await {
            warn!("volume {:?}: {e}", rec.name);
        }
    }

    /// Records the vault of a volume this host has just opened, before any client reaches
    /// it. If that fails while the vault names peers (`named_peers`), their replicas are of
    /// an older generation, and if this host died again one of them would replay them over
    /// whatever the volume wrote meanwhile: so its writes are held (reads go on) until the
    /// vault is recorded, which [`crate::peers`] retries every second.
    async fn record_vault_or_hold(&self, rec: &VolumeRecord, v: &Volume, named_peers: bool) {
        let Err(e) = self.try_record_vault(rec, v).await else {
            return;
        };
        if named_peers {
            v.hold_writes();
            warn!(
                "volume {:?}: {e}; its vault still names peers of an older generation, so its \
                 writes wait until the vault is recorded (retried every second)",
                rec.name
            );
        } else {
            warn!("volume {:?}: {e}", rec.name);
        }
    }

    /// [`Daemon::record_vault`], saying whether it worked.
    pub async fn try_record_vault(&self, rec: &VolumeRecord, v: &Volume) -> Result<(), String> {
        if v.cache().is_some_and(|c| c.has_peers()) {
            return Ok(()); // in wbp its peer set keeps the vault (crate::peers)
        }
        let w = crate::peers::vault_writer(self, rec.id).await?;
        let report = v.cache_report();
        let backed = v.cache().is_some_and(|c| c.replay_backed());
        let me = self.coord.host().to_owned();
        w.replace_with(|cur| {
            let gen = report.as_ref().map_or(0, |r| r.gen);
            // An offline replay its peers back keeps them named (see `open_volume`).
            let peers = if backed && cur.gen == gen && cur.owner == me {
                cur.peers.clone()
            } else {
                Vec::new()
            };
            Vault {
                volume: rec.id,
                policy: v.policy(),
                checkpoint: report.as_ref().map_or(0, |r| r.checkpoint),
                gen,
                owner: me,
                peers,
                previous_owner: None,
                handoff: false,
            }
        })
        .await
        .map_err(|e| format!("write vault record: {e}"))
    }

    /// Runs `f` holding the cluster-wide lock on a datastore's metadata (a `lun`'s volume
    /// table is shared by every host that uses it).
    async fn ds_locked<T>(
        &self,
        ds: &str,
        f: impl std::future::Future<Output = OpResult<T>>,
    ) -> OpResult<T> {
        // The lock is bound to the lease the request went out under. A grant that comes back
        // after that lease was lost (and the host registered again, reopening its fence) is
        // no lock at all: another host may hold it. A grant under the new lease is. The
        // datastore checks the fence from the grant on; this covers the wait before it.
        let lock = self.coord.lock_datastore(ds).await?;
        if !lock.held_under(&self.coord.fence()) {
            if let Err(e) = self.coord.unlock_datastore(lock).await {
                warn!("datastore {ds:?}: release metadata lock: {e}");
            }
            return Err(OpError::Unavailable(format!(
                "this host's lease was lost while it waited for datastore {ds:?}'s metadata \
                 lock; nothing changed, try again"
            )));
        }
        let r = f.await;
        if let Err(e) = self.coord.unlock_datastore(lock).await {
            warn!("datastore {ds:?}: release metadata lock: {e}");
        }
        r
    }

    /// Frees volume `v`'s storage on datastore `ds`, under the datastore's lock.
    async fn free_storage(&self, ds: &str, v: &datastore::VolumeSpec) -> OpResult<()> {
        let store = self.store(ds)?;
        self.ds_locked(ds, async { Ok(store.delete_volume(v).await?) })
            .await
    }

    /// The entry of a volume this host serves, or an error that says which host serves it.
    pub async fn local_entry(&self, name: &str) -> OpResult<Arc<VolumeEntry>> {
        match self.entry(name) {
            Ok(e) => Ok(e),
            Err(OpError::NotFound(m)) => match self.foreign(name).await {
                Some(info) => Err(OpError::Conflict(format!(
                    "volume {name:?} is served by host {}; run the command against that host{}",
                    info.owner.as_deref().unwrap_or("?"),
                    info.owner_api
                        .as_deref()
                        .map(|a| format!(" (VESTA_API={a})"))
                        .unwrap_or_default()
                ))),
                None => Err(OpError::NotFound(m)),
            },
            Err(e) => Err(e),
        }
    }

    /// A volume recorded in the cluster that another host serves.
    pub async fn foreign(&self, name: &str) -> Option<api::VolumeInfo> {
        self.foreign_volumes()
            .await
            .into_iter()
            .find(|v| v.name == name)
    }

    /// Volumes recorded in the cluster that this host does not serve, as far as it can tell
    /// (empty with the `local` coordinator, or when the coordinator cannot be reached).
    pub async fn foreign_volumes(&self) -> Vec<api::VolumeInfo> {
        if self.coord.kind() == "local" {
            return Vec::new();
        }
        let Ok(state) = self.coord.state().await else {
            return Vec::new();
        };
        let hosts = self.coord.hosts().await.unwrap_or_default();
        let mine = self.volumes.read().expect("lock").clone();
        state
            .volumes
            .into_iter()
            .filter(|r| mine.get(&r.name).is_none_or(|e| e.record.id != r.id))
            .map(|r| {
                let owner = r.owner.clone();
                let host = hosts
                    .iter()
                    .find(|h| Some(&h.record.name) == owner.as_ref());
                let status = match (&owner, host) {
                    (Some(o), Some(h)) if h.alive => format!("served by host {o}"),
                    (Some(o), _) => format!("host {o} is down"),
                    (None, _) => "not served: no owner".into(),
                };
                api::VolumeInfo {
                    name: r.name.clone(),
                    id: r.id.to_string(),
                    size: r.size,
                    datastore: r.datastore.clone(),
                    policy: r.policy.to_string(),
                    policy_asked: None,
                    status,
                    connections: 0,
                    created_unix: r.created_unix,
                    urls: host
                        .and_then(|h| h.record.nbd.clone())
                        .map(|a| vec![tcp_url(&a, &r.name)])
                        .unwrap_or_default(),
                    tuning: api::TuningInfo {
                        hold_s: r.tuning.hold_s,
                        max_dirty_age_s: r.tuning.max_dirty_age_s,
                        rpo_s: r.tuning.rpo_s,
                    },
                    cache: None,
                    placement: None,
                    owner,
                    owner_api: host.and_then(|h| h.record.api.clone()),
                }
            })
            .collect()
    }

    /// Every host of the cluster, with the number of volumes each owns.
    pub async fn host_infos(&self) -> OpResult<Vec<api::HostInfo>> {
        let hosts = self.coord.hosts().await?;
        let state = self.coord.state().await?;
        let me = self.coord.host().to_owned();
        Ok(hosts
            .into_iter()
            .map(|h| {
                let r = h.record;
                let volumes = state
                    .volumes
                    .iter()
                    .filter(|v| match &v.owner {
                        Some(o) => *o == r.name,
                        None => r.name == me,
                    })
                    .count();
                // This host's own use as it is now, not as last published.
                let (cache_bytes, cache_used_bytes) = if r.name == me {
                    self.cache_use()
                } else {
                    (r.cache_bytes, r.cache_used_bytes)
                };
                api::HostInfo {
                    name: r.name,
                    fault_domain: r.fault_domain,
                    alive: h.alive,
                    api: r.api,
                    nbd: r.nbd,
                    peer: r.peer,
                    cache_bytes,
                    cache_used_bytes,
                    started_unix: r.started_unix,
                    volumes,
                }
            })
            .collect())
    }

    /// The cache device's size and the bytes of it in use; zeroes without one.
    fn cache_use(&self) -> (u64, u64) {
        match &self.cache {
            Some(c) => {
                let sb = c.log().superblock();
                let used = sb.segment_count - c.log().free_segments() as u64;
                (sb.segment_count * sb.segment_size, used * sb.segment_size)
            }
            None => (0, 0),
        }
    }

    /// Publishes this host's addresses and cache use to the coordinator.
    pub async fn publish_host(&self) {
        let st = self.status();
        let (cache_bytes, cache_used_bytes) = self.cache_use();
        let h = HostRecord {
            name: self.coord.host().to_owned(),
            fault_domain: self.config.cluster.fault_domain.clone(),
            api: (!st.api.is_empty()).then(|| format!("http://{}", st.api)),
            nbd: st.nbd_tcp,
            peer: self.peers.addr.get().cloned(),
            cache_bytes,
            cache_used_bytes,
            started_unix: 0,
        };
        if let Err(e) = self.coord.publish_host(h).await {
            warn!("publish host record: {e}");
        }
    }

    /// Ids of every volume the coordinator records (for the cache's start-up recovery).
    pub fn volume_ids(&self) -> Vec<Uuid> {
        self.entries().iter().map(|e| e.record.id).collect()
    }

    pub fn entry(&self, name: &str) -> OpResult<Arc<VolumeEntry>> {
        let v = self.volumes.read().expect("lock");
        v.get(name).cloned().ok_or_else(|| {
            OpError::NotFound(format!(
                "no volume named {name:?}; known volumes: {}",
                known(v.keys())
            ))
        })
    }

    pub fn entries(&self) -> Vec<Arc<VolumeEntry>> {
        self.volumes
            .read()
            .expect("lock")
            .values()
            .cloned()
            .collect()
    }

    pub fn datastore_names(&self) -> Vec<String> {
        self.datastores
            .read()
            .expect("lock")
            .keys()
            .cloned()
            .collect()
    }

    pub fn datastore_gates(&self) -> Vec<(String, Arc<datastore::Gate>)> {
        self.datastores
            .read()
            .expect("lock")
            .iter()
            .filter_map(|(n, e)| e.store.as_ref().ok().map(|s| (n.clone(), s.gate().clone())))
            .collect()
    }

    /// Attaches a connection to a volume (for NBD_OPT_GO). Counting happens under the map's
    /// read lock, and deletion checks the count under its write lock, so a volume can never be
    /// deleted between being looked up and being attached.
    pub fn attach(&self, name: &str) -> Result<Attachment, String> {
        let v = self.volumes.read().expect("lock");
        let (entry, volume) = Self::servable_in(&v, name)?;
        // Counted under the read lock: a delete takes the write lock to look for clients.
        entry.attached.fetch_add(1, Ordering::SeqCst);
        Ok(Attachment { entry, volume })
    }

    /// The volume an NBD client naming `name` would attach to, if it can serve IO; else a
    /// message for the client.
    pub fn servable(&self, name: &str) -> Result<(Arc<VolumeEntry>, Arc<Volume>), String> {
        Self::servable_in(&self.volumes.read().expect("lock"), name)
    }

    fn servable_in(
        volumes: &BTreeMap<String, Arc<VolumeEntry>>,
        name: &str,
    ) -> Result<(Arc<VolumeEntry>, Arc<Volume>), String> {
        let Some(entry) = volumes.get(name) else {
            const SHOWN: usize = 8;
            let hint = match volumes.len() {
                0 => "; this host serves no volumes".to_owned(),
                n => format!(
                    "; volumes here: {}{}",
                    known(volumes.keys().take(SHOWN)),
                    if n > SHOWN { ", …" } else { "" }
                ),
            };
            return Err(if name.is_empty() {
                // What `nbd://HOST:PORT` with no path asks for (the "default export").
                format!("no export name given: name the volume, as in nbd://HOST:PORT/NAME{hint}")
            } else {
                format!("no volume named {name:?}{hint}")
            });
        };
        let volume = entry
            .volume
            .as_ref()
            .map_err(|e| format!("volume {name:?} cannot serve IO: {e}"))?
            .clone();
        Ok((entry.clone(), volume))
    }

    /// The NBD URIs of volume `name` on this host, percent-encoded (a data directory whose
    /// path holds a space or `&` still gives a URI QEMU and libnbd take).
    pub fn urls(&self, name: &str) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(a) = self.nbd.get() {
            if let Some(p) = &a.unix {
                out.push(nbd_url(nbd::uri::Address::Unix(p.clone()), name));
            }
            if let Some(t) = &a.tcp {
                out.push(tcp_url(t, name));
            }
        }
        out
    }

    pub fn volume_info(&self, e: &VolumeEntry) -> api::VolumeInfo {
        // Policy and tuning change at run time: the open volume has the ones in effect.
        let (policy, tuning, cache) = match &e.volume {
            Ok(v) => (v.policy(), v.tuning(), v.cache_report()),
            Err(_) => (e.record.policy, e.record.tuning, None),
        };
        api::VolumeInfo {
            name: e.record.name.clone(),
            id: e.record.id.to_string(),
            size: e.record.size,
            datastore: e.record.datastore.clone(),
            policy: policy.to_string(),
            policy_asked: Some(e.wanted())
                .filter(|w| *w != policy)
                .map(|w| w.to_string()),
            tuning: api::TuningInfo {
                hold_s: tuning.hold_s,
                max_dirty_age_s: tuning.max_dirty_age_s,
                rpo_s: tuning.rpo_s,
            },
            cache: cache.map(cache_info),
            status: match &e.volume {
                Ok(v) if v.shut_out_reason().is_some() => format!(
                    "every IO fails: {}",
                    v.shut_out_reason().unwrap_or_default()
                ),
                Ok(v) if v.stalled() => {
                    if v.cache().is_some_and(|c| c.has_peers()) {
                        let mut s = "IO stalled: the cache device failed, and the volume's \
                                     peers replay what it held; it then serves uncached"
                            .to_string();
                        if let Some(a) = self.peers.handoff_answers(&e.record.name) {
                            s += &format!(" (peers asked: {a})");
                        }
                        if self.peers.handed_off(&e.record.name) {
                            s += &format!(
                                "; if none can, `vesta volume accept-loss {}` gives up what it \
                                 held",
                                e.record.name
                            );
                        }
                        s
                    } else {
                        "writes stalled: the cache device failed with nothing dirty; the \
                         volume goes on uncached within a second"
                            .into()
                    }
                }
                Ok(v) => match v.loss() {
                    Ok(l) if l.dirty_bytes > 0 => format!(
                        "data lost: the cache device failed holding {} of dirty data, which \
                         writes and reads of it fail on; `vesta volume accept-loss {}` gives \
                         it up and serves what the datastore holds",
                        api::format_size(l.dirty_bytes),
                        e.record.name
                    ),
                    _ => "ok".into(),
                },
                Err(m) => match &e.copied {
                    Some(c) => {
                        let copied = c.load(Ordering::Relaxed).min(e.record.size);
                        format!(
                            "{m} ({} of {} copied, {:.0} %)",
                            api::format_size(copied),
                            api::format_size(e.record.size),
                            100.0 * copied as f64 / e.record.size.max(1) as f64
                        )
                    }
                    None => m.clone(),
                },
            },
            connections: e.connections(),
            created_unix: e.record.created_unix,
            urls: self.urls(&e.record.name),
            placement: None,
            owner: Some(self.coord.host().to_owned()),
            owner_api: None,
        }
    }

    pub async fn datastore_infos(&self) -> Vec<api::DatastoreInfo> {
        let list: Vec<(DatastoreSpec, Opened)> = self
            .datastores
            .read()
            .expect("lock")
            .values()
            .map(|e| (e.spec.clone(), e.store.clone()))
            .collect();
        let mut counts = {
            let v = self.volumes.read().expect("lock");
            let mut m: BTreeMap<String, usize> = BTreeMap::new();
            for e in v.values() {
                *m.entry(e.record.datastore.clone()).or_default() += 1;
            }
            m
        };
        // In a cluster, the other hosts' volumes live on the same datastores.
        for v in self.foreign_volumes().await {
            *counts.entry(v.datastore).or_default() += 1;
        }
        let mut out = Vec::with_capacity(list.len());
        for (spec, store) in list {
            let (status, cap) = match &store {
                Ok(s) => match s.capacity().await {
                    Ok(c) => ("ok".to_owned(), Some(c)),
                    Err(e) => (e.to_string(), None),
                },
                Err(e) => (e.clone(), None),
            };
            out.push(datastore_info(
                store.as_ref().map(|s| s.spec()).unwrap_or(&spec),
                status,
                cap,
                counts.get(&spec.name).copied().unwrap_or(0),
            ));
        }
        out
    }

    pub async fn add_datastore(&self, req: api::AddDatastore) -> OpResult<api::DatastoreInfo> {
        let _admin = self.admin.lock().await;
        datastore::check_name("datastore", &req.name)?;
        if self
            .datastores
            .read()
            .expect("lock")
            .contains_key(&req.name)
        {
            return Err(OpError::Conflict(format!(
                "a datastore named {:?} already exists; choose another name",
                req.name
            )));
        }
        let kind = match (req.dir, req.lun) {
            (Some(dir), None) => {
                let p = PathBuf::from(&dir);
                let path = if p.is_absolute() {
                    p
                } else {
                    return Err(OpError::BadRequest(format!(
                        "--dir {dir:?} must be an absolute path (vestad may run in another \
                         directory than the CLI), e.g. --dir /srv/vesta/{}",
                        req.name
                    )));
                };
                Kind::Dir { path }
            }
            (None, Some(target)) => Kind::Lun {
                target,
                lun_id: None,
            },
            _ => {
                return Err(OpError::BadRequest(
                    "give exactly one of --dir PATH or --lun PATH_OR_NBD_URI".into(),
                ))
            }
        };
        let class = match req.class.as_deref() {
            Some(c) => c.parse().map_err(OpError::BadRequest)?,
            None => datastore::Class::default(),
        };
        let queue_depth = req.queue_depth.unwrap_or(datastore::QUEUE_DEPTH_DEFAULT);
        datastore::check_direct(&kind, req.direct).map_err(OpError::BadRequest)?;
        let spec = DatastoreSpec {
            name: req.name.clone(),
            kind,
            class,
            queue_depth,
            direct: req.direct,
        };
        let take_over = match req.take_over.as_deref().map(str::parse::<Uuid>) {
            None => None,
            Some(Ok(p)) => Some(p),
            Some(Err(_)) => {
                return Err(OpError::BadRequest(format!(
                    "--take-over {:?} is not a pod id; give the id the refusal names",
                    req.take_over.unwrap_or_default()
                )))
            }
        };
        let mode = OpenMode::Add {
            force: req.force,
            take_over,
        };
        // Under the datastore's metadata lock, as a configured one is added: two hosts that
        // add one blank LUN at once would each format it, and the second label would shut
        // the first host's record out. The second now finds the first's label (and record).
        let (store, spec) = self
            .ds_locked(&req.name, async {
                let store = datastore::open_in_pod(&spec, mode, Some(self.pod)).await?;
                self.arm(&store);
                self.warn_if_cached_by_host(&spec);
                let spec = store.spec().clone();
                // A LUN must not be added twice under two names.
                if let Kind::Lun {
                    lun_id: Some(id), ..
                } = &spec.kind
                {
                    let same = |s: &DatastoreSpec| {
                        matches!(&s.kind, Kind::Lun { lun_id: Some(o), .. } if o == id)
                    };
                    let here = {
                        let ds = self.datastores.read().expect("lock");
                        ds.values()
                            .find(|e| same(&e.spec))
                            .map(|e| e.spec.name.clone())
                    };
                    // Also under a name another host of the cluster added, which this host may not
                    // know yet or could not open: two names would mean two locks on one table.
                    let recorded = match here {
                        Some(n) => Some(n),
                        None => self
                            .coord
                            .state()
                            .await?
                            .datastores
                            .into_iter()
                            .find(same)
                            .map(|s| s.name),
                    };
                    if let Some(other) = recorded {
                        return Err(OpError::Conflict(format!(
                            "that LUN is already datastore {other:?}"
                        )));
                    }
                }
                if let Kind::Dir { path } = &spec.kind {
                    if let Some(other) = self.dir_datastore_at(path).await {
                        return Err(OpError::Conflict(format!(
                            "directory {} is already datastore {other:?}",
                            path.display()
                        )));
                    }
                }
                self.coord.add_datastore(spec.clone()).await?;
                Ok((store, spec))
            })
            .await?;
        info!(
            "added datastore {:?} ({} {}, class {}, queue depth {})",
            spec.name,
            spec.kind_name(),
            spec.location(),
            spec.class,
            spec.queue_depth
        );
        self.datastores.write().expect("lock").insert(
            spec.name.clone(),
            DsEntry {
                spec: spec.clone(),
                store: Ok(store.clone()),
            },
        );
        self.import_recorded_volumes(&store, false).await;
        let cap = store.capacity().await.ok();
        let n = self
            .volumes
            .read()
            .expect("lock")
            .values()
            .filter(|e| e.record.datastore == spec.name)
            .count();
        Ok(datastore_info(&spec, "ok".into(), cap, n))
    }

    /// The available `dir` datastore whose directory is `path`, under any name. A directory
    /// that does not answer within [`SAME_DIR_WAIT`] (a hung NFS mount) is passed over, with
    /// a warning, so the admin lock this runs under is not held up by it.
    async fn dir_datastore_at(&self, path: &Path) -> Option<String> {
        let dirs: Vec<(String, PathBuf)> = self
            .datastores
            .read()
            .expect("lock")
            .values()
            .filter(|e| e.store.is_ok())
            .filter_map(|e| match &e.spec.kind {
                Kind::Dir { path } => Some((e.spec.name.clone(), path.clone())),
                Kind::Lun { .. } => None,
            })
            .collect();
        for (name, p) in dirs {
            match tokio::time::timeout(SAME_DIR_WAIT, datastore::dir::same_dir(&p, path)).await {
                Ok(true) => return Some(name),
                Ok(false) => {}
                Err(_) => warn!(
                    "datastore {name:?}: {} did not answer within {SAME_DIR_WAIT:?}; not checked \
                     for being the same directory as {}",
                    p.display(),
                    path.display()
                ),
            }
        }
        None
    }

    /// A re-added datastore brings its volumes back: each volume in a LUN's table, or image
    /// file of a `dir` tagged with its volume's id, that the coordinator does not know is
    /// recorded again (policy `uncached`), unless its name is taken, and served here. At
    /// start-up the same finds what a create cut short by a crash left.
    ///
    /// Under the datastore's lock, under which creates make their storage and their record
    /// and undone creates remove both: storage no record knows is then never a create under
    /// way on another host, whose volume this would take.
    async fn import_recorded_volumes(&self, store: &Arc<dyn Datastore>, at_start: bool) {
        let ds = store.spec().name.clone();
        let recorded = self
            .ds_locked(&ds, async { Ok(self.record_unknown_volumes(store).await) })
            .await;
        let recs = match recorded {
            Ok(r) => r,
            Err(e) => {
                warn!("datastore {ds:?}: cannot look for volumes no record knows: {e}");
                return;
            }
        };
        for rec in recs {
            let volume = self.open_volume(&rec).await;
            if at_start {
                warn!(
                    "datastore {:?} holds volume {:?} ({}) that had no record (a create cut \
                     short by a crash); imported as an uncached volume: delete it if it is \
                     not wanted",
                    rec.datastore,
                    rec.name,
                    api::format_size(rec.size)
                );
            } else {
                info!(
                    "imported volume {:?} ({}) from datastore {:?}",
                    rec.name,
                    api::format_size(rec.size),
                    rec.datastore
                );
            }
            self.volumes
                .write()
                .expect("lock")
                .insert(rec.name.clone(), Arc::new(VolumeEntry::new(rec, volume)));
        }
    }

    /// Records the volumes on `store` that no record knows ([`Daemon::import_recorded_volumes`],
    /// which holds the datastore's lock), and returns their new records.
    async fn record_unknown_volumes(&self, store: &Arc<dyn Datastore>) -> Vec<VolumeRecord> {
        let mut made = Vec::new();
        // Bounded: the datastore's lock is held, and every host's changes to it wait.
        let Some(found) = Self::listed(store).await else {
            return made;
        };
        let ds = &store.spec().name;
        // Other hosts' volumes on a shared LUN are theirs, not lost ones to import.
        let recorded = match self.coord.state().await {
            Ok(s) => s.volumes,
            Err(e) => {
                warn!("datastore {ds:?}: volumes no record knows are left for now: {e}");
                return made;
            }
        };
        // Read after the records: a delete removes a record and leaves its id here in one
        // change, so an id is in one list or the other.
        let deleted = match self.coord.deleted_volumes().await {
            Ok(d) => d,
            Err(e) => {
                warn!("datastore {ds:?}: volumes no record knows are left for now: {e}");
                return made;
            }
        };
        let deleted: std::collections::HashSet<Uuid> = deleted.into_iter().collect();
        let (gone, found): (Vec<_>, Vec<_>) = found
            .into_iter()
            .partition(|v| deleted.contains(&v.id) && !recorded.iter().any(|r| r.id == v.id));
        for v in &gone {
            // A deleted volume's: its delete could not reach this datastore, or a copy a
            // relocation left here was out of its reach. The delete ends here.
            match store.delete_volume(v).await {
                Ok(()) => info!(
                    "datastore {ds:?}: freed the storage of deleted volume {:?} ({}) that its \
                     delete left behind",
                    v.name, v.id
                ),
                Err(e) => warn!(
                    "datastore {ds:?}: the storage of deleted volume {:?} ({}) could not be \
                     freed: {e}",
                    v.name, v.id
                ),
            }
        }
        for v in &found {
            let alike: Vec<&str> = found
                .iter()
                .filter(|w| w.id == v.id)
                .map(|w| w.name.as_str())
                .collect();
            if alike.len() > 1 && alike[0] == v.name {
                warn!(
                    "datastore {:?} holds volume {} under several names ({}): a copy kept \
                     with its attributes; none is imported until only one is left",
                    store.spec().name,
                    v.id,
                    alike.join(", ")
                );
            }
        }
        for v in found
            .iter()
            .filter(|v| found.iter().filter(|w| w.id == v.id).count() == 1)
        {
            let (id_known, name_taken) = (
                recorded.iter().any(|r| r.id == v.id),
                recorded.iter().any(|r| r.name == v.name),
            );
            if id_known {
                continue;
            }
            if name_taken {
                warn!(
                    "datastore {:?} holds volume {:?} ({}) but that name is taken; its extent \
                     is kept untouched",
                    store.spec().name,
                    v.name,
                    v.id
                );
                continue;
            }
            let rec = VolumeRecord {
                id: v.id,
                name: v.name.clone(),
                size: v.size,
                datastore: store.spec().name.clone(),
                policy: Policy::Uncached,
                created_unix: now_unix(),
                tuning: Default::default(),
                owner: self.owner_for_new(),
                moved: None,
            };
            if let Err(e) = self.coord.create_volume(rec.clone()).await {
                warn!("could not import volume {:?}: {e}", v.name);
                continue;
            }
            made.push(rec);
        }
        made
    }

    pub async fn create_volume(&self, req: api::CreateVolume) -> OpResult<api::VolumeInfo> {
        let _admin = self.admin.lock().await;
        datastore::check_name("volume", &req.name)?;
        if self.volumes.read().expect("lock").contains_key(&req.name)
            || self.foreign(&req.name).await.is_some()
        {
            return Err(OpError::Conflict(format!(
                "a volume named {:?} already exists; choose another name or delete it first",
                req.name
            )));
        }
        if req.size == 0 || !req.size.is_multiple_of(engine::SECTOR) {
            return Err(OpError::BadRequest(format!(
                "volume size {} is not a positive multiple of 512 bytes, e.g. 10G",
                req.size
            )));
        }
        let policy: Policy = match req.policy.as_deref() {
            Some(p) => p.parse().map_err(OpError::BadRequest)?,
            None => Policy::default(),
        };
        let tuning = tuning_from(
            cluster::Tuning::default(),
            req.hold_s,
            req.max_dirty_age_s,
            req.rpo_s,
        )?;
        self.check_cache_for(policy)?;
        if matches!(policy, Policy::Wbp { .. }) && self.coord.kind() == "local" {
            return Err(OpError::BadRequest(format!(
                "policy {policy} needs peer hosts: configure a cluster ([cluster] etcd) with \
                 enough other hosts"
            )));
        }
        let mut placement = None;
        let ds_name = match req.datastore {
            Some(d) => d,
            None => {
                let names = self.datastore_names();
                match names.as_slice() {
                    [only] => only.clone(),
                    [] => {
                        return Err(OpError::BadRequest(
                            "there are no datastores; add one with `vesta datastore add`".into(),
                        ))
                    }
                    // Several: initial placement (BASIL §5) by the balancing models.
                    _ => {
                        let p = crate::balancing::place(self, &req.name, req.size).await?;
                        info!("placing volume {:?}: {}", req.name, p.reason);
                        let name = p.datastore.clone();
                        placement = Some(p);
                        name
                    }
                }
            }
        };
        let store = self.store(&ds_name)?;
        let rec = VolumeRecord {
            id: Uuid::new_v4(),
            name: req.name.clone(),
            size: req.size,
            datastore: ds_name.clone(),
            policy,
            created_unix: now_unix(),
            tuning,
            owner: self.owner_for_new(),
            moved: None,
        };
        // The storage and its record are made under the datastore's lock, as are imports
        // ([`Daemon::import_recorded_volumes`]): an import, which takes storage no record
        // knows for a create cut short, never finds a create between its two steps.
        let extent = self
            .ds_locked(&ds_name, async {
                let extent = store.create_volume(&rec.spec()).await?;
                let Err(e) = self.coord.create_volume(rec.clone()).await else {
                    return Ok(extent);
                };
                // The coordinator may have made the record and lost only its answer: look.
                let found = self
                    .coord
                    .state()
                    .await
                    .map(|s| s.volumes.into_iter().find(|r| r.id == rec.id));
                match found {
                    Ok(Some(r)) if same_create(&r, &rec) => {
                        warn!(
                            "volume {:?}: recording it answered an error ({e}), but the record \
                             is there; going on",
                            rec.name
                        );
                        Ok(extent)
                    }
                    Ok(Some(r)) => {
                        // Another host took the storage for a create cut short and recorded it
                        // as its own: this host's lease (and with it the datastore's lock)
                        // lapsed between the two steps. It is that host's volume now; nothing
                        // of it may be undone here.
                        Err(OpError::Conflict(format!(
                            "volume {:?}: while this host stalled between making its storage \
                             and recording it, host {} recorded that storage as its own ({e}); \
                             it serves the volume now",
                            rec.name,
                            r.owner.as_deref().unwrap_or("?")
                        )))
                    }
                    Ok(None) => {
                        // Roll back so the datastore holds nothing the coordinator does not
                        // know.
                        if let Err(e2) = store.delete_volume(&rec.spec()).await {
                            warn!("rollback of volume {:?} failed: {e2}", rec.name);
                        }
                        Err(e.into())
                    }
                    Err(e2) => {
                        // Freeing the storage could leave a record without it; keeping it can
                        // at worst leave storage without a record (imported at the next
                        // start).
                        let why = format!(
                            "recording it failed ({e}), and whether the record was made cannot \
                             be read ({e2})"
                        );
                        self.keep_for_delete(&rec, &why);
                        Err(OpError::Unavailable(format!(
                            "volume {:?}: {why}; its storage on {ds_name:?} is kept and the \
                             volume listed: delete it, then create it again",
                            rec.name
                        )))
                    }
                }
            })
            .await?;
        if let Err(e) = crate::peers::take_vault_lock(self, rec.id).await {
            self.undo_recorded_create(&rec, &store, e.to_string()).await;
            return Err(e.into());
        }
        let volume = match Volume::open(
            rec.id,
            rec.name.clone(),
            policy,
            tuning,
            extent,
            self.cache.clone(),
        ) {
            Ok(v) => Arc::new(v),
            Err(e) => {
                let why = format!("cannot open the new volume: {e}");
                self.undo_recorded_create(&rec, &store, why.clone()).await;
                return Err(OpError::Unavailable(why));
            }
        };
        self.record_vault(&rec, &volume).await;
        let entry = Arc::new(VolumeEntry::new(rec.clone(), Ok(volume.clone())));
        self.volumes
            .write()
            .expect("lock")
            .insert(rec.name.clone(), entry.clone());
        if let Policy::Wbp { .. } = policy {
            // Until it has peers it runs in wt; the peer round keeps trying.
            if let Err(e) = crate::peers::establish(self, &rec.name, &volume, policy).await {
                warn!("volume {:?}: in wt for now: {e}", rec.name);
            }
        }
        info!(
            "created volume {:?} ({}) on datastore {:?}, policy {}",
            rec.name,
            api::format_size(rec.size),
            ds_name,
            policy
        );
        let mut info = self.volume_info(&entry);
        info.placement = placement;
        Ok(info)
    }

    /// The owner recorded for a volume created here: this host in a cluster, nobody (= the
    /// one host) with the `local` coordinator, whose state file stays as it was.
    fn owner_for_new(&self) -> Option<String> {
        (self.coord.kind() != "local").then(|| self.coord.host().to_owned())
    }

    /// Claims `name` for a long operation (`what`: `relocation` or `policy change`), or says
    /// which one is already under way.
    /// A claim on a volume if nothing else holds one.
    pub(crate) fn try_claim(&self, name: &str, what: &'static str) -> Option<Busy<'_>> {
        self.claim(name, what).ok()
    }

    /// [`Daemon::try_claim`] for a task that chose the volume from an earlier look at the
    /// entries: the claim only if `e` is still the volume's entry (not deleted, relocated
    /// or reopened since), so nothing acts on a volume that is gone.
    pub(crate) fn claim_entry(&self, e: &Arc<VolumeEntry>, what: &'static str) -> Option<Busy<'_>> {
        let busy = self.try_claim(&e.record.name, what)?;
        let current = self
            .volumes
            .read()
            .expect("lock")
            .get(&e.record.name)
            .is_some_and(|now| Arc::ptr_eq(now, e));
        current.then_some(busy)
    }

    fn claim(&self, name: &str, what: &'static str) -> OpResult<Busy<'_>> {
        let mut set = self.busy.lock().expect("lock");
        if let Some(other) = set.get(name) {
            return Err(OpError::Conflict(format!(
                "volume {name:?} has a {other} under way; retry the {what} when it completes"
            )));
        }
        set.insert(name.to_owned(), what);
        Ok(Busy {
            set: &self.busy,
            name: name.to_owned(),
        })
    }

    /// [`Daemon::claim`], waiting for a claim of the background rounds to go: up to `wait`
    /// (usually short), or [`REOPEN_WAIT`] for the reopen of a volume that could not open;
    /// an operator's relocation or policy change refuses at once. Operators' changes all
    /// claim this way: a round that holds the volume for a moment (a `wbp` volume without
    /// peers tries a peer change every second) must not turn their command into a conflict.
    async fn claim_within(
        &self,
        name: &str,
        what: &'static str,
        wait: Duration,
    ) -> OpResult<Busy<'_>> {
        let start = std::time::Instant::now();
        loop {
            let r = self.claim(name, what);
            if r.is_ok() {
                return r;
            }
            let limit = match self.busy.lock().expect("lock").get(name).copied() {
                None => continue, // given up just now
                Some("relocation" | "policy change") => Duration::ZERO,
                Some("reopen") => REOPEN_WAIT,
                Some(_) => wait,
            };
            if start.elapsed() >= limit {
                return r;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Relocations of the last [`RECENT_MOVE_S`], this host's and (in a cluster) every
    /// other's, for the planner's ping-pong rule: the volume records keep them, so a restart
    /// or a move carried out on another host counts too.
    pub async fn recent_moves(&self) -> Vec<balance::RecentMove> {
        let records: Vec<VolumeRecord> = match self.coord.state().await {
            Ok(s) => s.volumes,
            Err(e) => {
                warn!("volume records: {e}; only this host's moves count as recent");
                self.entries().iter().map(|e| e.current_record()).collect()
            }
        };
        recent_moves_at(&records, now_unix())
    }

    /// Copies a detached volume to another datastore (`vesta volume relocate --offline`).
    ///
    /// The volume must have no clients and no dirty data. It stops serving (new connections
    /// are refused with "not found" meanwhile), its bytes are copied and flushed, then the
    /// record is switched and the old storage freed. A crash before the switch leaves the
    /// volume where it was, and an orphan copy on the target; after it, the volume is on the
    /// target, and its old storage may be left behind. The next start frees either
    /// ([`Daemon::free_leftover_copies`]), as does a relocation to the target. Data is never in
    /// only one half-written place.
    pub async fn relocate(&self, name: &str, req: api::Relocate) -> OpResult<api::VolumeInfo> {
        if !req.offline {
            return Err(OpError::BadRequest(
                "live relocation is not available yet; detach the volume's clients and pass --offline"
                    .into(),
            ));
        }
        let _busy = self.claim_within(name, "relocation", CLAIM_WAIT).await?;
        // Held while the volume is taken out of service and the copy created, and again for
        // the switch; not during the copy, which may take hours. The claim keeps other
        // operations on this volume out meanwhile (a delete is refused).
        let admin = self.admin.lock().await;
        let entry = self.local_entry(name).await?;
        let from = entry.record.datastore.clone();
        let to = req.datastore.clone();
        if from == to {
            return Err(OpError::BadRequest(format!(
                "volume {name:?} is already on datastore {to:?}"
            )));
        }
        let volume = entry
            .volume
            .as_ref()
            .map_err(|e| OpError::Unavailable(format!("volume {name:?} is not open: {e}")))?
            .clone();
        let src_store = self.store(&from)?;
        let dst_store = self.store(&to)?;
        // Two names for one directory: the copy's stale-copy check would take the volume's
        // own image for a leftover and remove it, and the switch would free the copy as the
        // source. So two directories must be told apart, by inode and by identity file
        // (one export mounted twice has two device numbers).
        if let (Kind::Dir { path: b }, Kind::Dir { .. }) =
            (&dst_store.spec().kind, &src_store.spec().kind)
        {
            if !Self::distinct(src_store.spec(), dst_store.spec()).await {
                return Err(OpError::BadRequest(format!(
                    "datastores {from:?} and {to:?} are one directory ({}), or their identity \
                     files ({}) cannot be read to tell them apart: nothing to move",
                    b.display(),
                    datastore::dir::IDENTITY_FILE
                )));
            }
        }
        let n = entry.connections();
        if n > 0 {
            return Err(OpError::Conflict(format!(
                "volume {name:?} has {n} client connection(s); an offline relocation needs them detached first"
            )));
        }
        if let Some(c) = volume.cache_report() {
            if c.dirty_bytes > 0 || c.replaying {
                return Err(OpError::Conflict(format!(
                    "volume {name:?} has {} of dirty data not yet on datastore {from:?}; switch it to wt first (`vesta volume policy {name} wt` drains it), then relocate",
                    api::format_size(c.dirty_bytes)
                )));
            }
        }
        let progress = Arc::new(std::sync::atomic::AtomicU64::new(0));
        {
            let mut v = self.volumes.write().expect("lock");
            if v.get(name).is_some_and(|e| e.connections() > 0) {
                return Err(OpError::Conflict(format!(
                    "volume {name:?} was attached meanwhile; retry"
                )));
            }
            // Until the copy is done the volume is shown, and refused, as relocating, with
            // how far the copy is.
            v.insert(
                name.to_owned(),
                Arc::new(VolumeEntry {
                    copied: Some(progress.clone()),
                    ..VolumeEntry::placeholder(
                        entry.current_record(),
                        format!(
                            "relocating to datastore {to:?}; it serves again when the copy is \
                             done"
                        ),
                    )
                }),
            );
        }
        // A relocation that fails leaves the destager as it found it, as a delete does.
        let destaging = !volume.destaging_stopped();
        let restore = |why: String| {
            volume.unrevoke(destaging);
            self.reinstate(&entry, Ok(volume.clone()));
            why
        };
        if !quiesce_for_storage(&volume).await {
            return Err(OpError::Unavailable(restore(format!(
                "volume {name:?} still has IO in flight after {FORCE_DETACH_WAIT:?}; retry"
            ))));
        }
        // Dirty data cannot have appeared (no clients), but check under the revoke.
        if volume.cache_report().is_some_and(|c| c.dirty_bytes > 0) {
            return Err(OpError::Conflict(restore(format!(
                "volume {name:?} has dirty data; switch it to wt first, then relocate"
            ))));
        }
        // The record gets the policy asked for, not the one in effect: a volume that runs
        // uncached because its cache device failed, or in wt while it lacks peers, must come
        // back in its own policy at the next start, as it would without the relocation.
        let mut rec = entry.current_record();
        rec.datastore = to.clone();
        rec.moved = Some(cluster::Moved {
            from: from.clone(),
            unix: now_unix(),
        });
        // The extent the volume has been writing (not the table read again, which a source
        // failing its reads would not give).
        let src = volume.extent().clone();
        // A copy of this volume already on the target is what an interrupted relocation left
        // (the record names the source, so nothing uses it): remove it, or the create fails.
        if let Ok(there) = dst_store.recorded_volumes().await {
            if there.iter().any(|s| s.id == rec.id) {
                warn!(
                    "volume {name:?}: datastore {to:?} holds a stale copy from an interrupted \
                     relocation; removing it"
                );
                if let Err(e) = self.free_storage(&to, &rec.spec()).await {
                    return Err(OpError::Unavailable(restore(format!(
                        "cannot remove the stale copy of {name:?} on {to:?}: {e}"
                    ))));
                }
            }
        }
        let created = self.ds_locked(&to, async {
            Ok(dst_store.create_volume(&rec.spec()).await?)
        });
        let dst = match created.await {
            Ok(x) => x,
            Err(e) => {
                let why = restore(format!("cannot create the copy on {to:?}: {e}"));
                return Err(match e {
                    OpError::Conflict(_) => OpError::Conflict(why),
                    OpError::BadRequest(_) => OpError::BadRequest(why),
                    _ => OpError::Unavailable(why),
                });
            }
        };
        info!(
            "relocating volume {name:?} ({}) from {from:?} to {to:?}",
            api::format_size(rec.size)
        );
        let started = std::time::Instant::now();
        drop(admin);
        let copied = copy_extent(&src, &dst, &self.stopping, &progress).await;
        let _admin = self.admin.lock().await;
        let copy_spec = rec.spec();
        let drop_copy = || self.free_storage(&to, &copy_spec);
        if let Err(e) = copied {
            if let Err(e2) = drop_copy().await {
                warn!("volume {name:?}: the partial copy on {to:?} could not be removed: {e2}");
            }
            return Err(OpError::Unavailable(restore(format!(
                "copying volume {name:?} to {to:?} failed: {e}; it stays on {from:?}"
            ))));
        }
        if let Err(e) = self.coord.update_volume(rec.clone()).await {
            // The change may have been made with only its answer lost: look before undoing
            // it, or the record could name a copy that was just deleted.
            let recorded = self.coord.state().await.map(|s| {
                s.volumes
                    .into_iter()
                    .find(|r| r.id == rec.id)
                    .map(|r| r.datastore)
            });
            match recorded {
                Ok(Some(ds)) if ds == to => warn!(
                    "volume {name:?}: recording the new datastore answered {e}, but the record \
                     names {to:?}: the relocation goes on"
                ),
                Ok(_) => {
                    if let Err(e2) = drop_copy().await {
                        warn!("volume {name:?}: the copy on {to:?} could not be removed: {e2}");
                    }
                    return Err(OpError::Internal(restore(format!(
                        "cannot record the new datastore: {e}; the volume stays on {from:?}"
                    ))));
                }
                Err(e2) => {
                    // Which copy the record names is unknown: both are kept, and the volume
                    // serves neither until the record can be read; the retry of unavailable
                    // volumes then settles it ([`Daemon::settle_relocation`]), as does a
                    // restart.
                    let why = format!(
                        "relocation to {to:?} not confirmed: recording it answered {e}, and the \
                         record cannot be read ({e2}); both copies are kept. Once the \
                         coordinator answers, the volume serves again from the datastore its \
                         record names (vestad checks every few seconds)"
                    );
                    let placeholder = VolumeEntry {
                        unconfirmed: Some(Unconfirmed {
                            volume: volume.clone(),
                            before: entry.clone(),
                            rec: rec.clone(),
                            copy: dst,
                            odd_record: Default::default(),
                        }),
                        ..VolumeEntry::placeholder(entry.current_record(), why.clone())
                    };
                    self.volumes
                        .write()
                        .expect("lock")
                        .insert(name.to_owned(), Arc::new(placeholder));
                    return Err(OpError::Unavailable(why));
                }
            }
        }
        let new_entry = self.switch_to_copy(&entry, &volume, &rec, dst).await;
        info!(
            "relocated volume {name:?} from {from:?} to {to:?} in {:.1} s",
            started.elapsed().as_secs_f64()
        );
        Ok(self.volume_info(&new_entry))
    }

    /// The last step of a relocation whose record names the copy: serves the volume from
    /// `copy` under `rec`, and frees the storage it had before (`before`'s datastore).
    /// `volume`, opened from there, is revoked and clean; its cache data (clean) goes with
    /// it, and the reopened volume starts cold, in a new generation.
    async fn switch_to_copy(
        &self,
        before: &VolumeEntry,
        volume: &Arc<Volume>,
        rec: &VolumeRecord,
        copy: datastore::Extent,
    ) -> Arc<VolumeEntry> {
        let name = &rec.name;
        let (from, to) = (&before.record.datastore, &rec.datastore);
        volume.detach_cache().await;
        let reopened = Volume::open(
            rec.id,
            rec.name.clone(),
            volume.policy(),
            volume.tuning(),
            copy,
            self.cache.clone(),
        )
        .map(Arc::new)
        .map_err(|e| format!("cannot open the relocated volume: {e}"));
        match &reopened {
            Err(m) => warn!("volume {name:?}: {m}"),
            Ok(r) => {
                // The reopened volume starts a new generation, which the vault gets before
                // any client reaches it; held writes (the vault could not be recorded since
                // a switch) stay held until it is.
                let named_peers = volume.writes_held()
                    || self
                        .coord
                        .vault(rec.id)
                        .await
                        .map_or(true, |v| v.is_some_and(|v| !v.peers.is_empty()));
                self.record_vault_or_hold(rec, r, named_peers).await;
            }
        }
        let new_entry = Arc::new(VolumeEntry::new(rec.clone(), reopened));
        self.volumes
            .write()
            .expect("lock")
            .insert(rec.name.clone(), new_entry.clone());
        if let Err(e) = self.free_storage(from, &before.record.spec()).await {
            warn!(
                "volume {name:?} now lives on {to:?}, but its old storage on {from:?} could not \
                 be freed: {e}; the next start of vestad, or the volume's delete, frees it"
            );
        }
        new_entry
    }

    /// Settles a relocation whose record switch went unconfirmed (entry `e`, a placeholder),
    /// once the record can be read: the volume serves again from the datastore the record
    /// names, and the other copy is freed. False while the record still cannot be read. The
    /// caller holds the volume's claim.
    async fn settle_relocation(&self, e: &VolumeEntry) -> bool {
        let Some(u) = &e.unconfirmed else {
            return true;
        };
        let name = &u.rec.name;
        let (from, to) = (&u.before.record.datastore, &u.rec.datastore);
        // Read before the admin lock is taken: a coordinator that does not answer must not
        // hold up every other admin operation. Only this host changes the record of a volume
        // it serves, so it does not change between the read and the switch.
        let recorded = match self.coord.state().await {
            Ok(s) => s.volumes.into_iter().find(|r| r.id == u.rec.id),
            Err(err) => {
                debug!("volume {name:?}: the relocation stays unconfirmed: {err}");
                return false;
            }
        };
        let _admin = self.admin.lock().await;
        match recorded.map(|r| r.datastore) {
            Some(ds) if ds == *to => {
                info!("volume {name:?}: its record names {to:?}: the relocation is done");
                self.switch_to_copy(&u.before, &u.volume, &u.rec, u.copy.clone())
                    .await;
            }
            Some(ds) if ds == *from => {
                info!(
                    "volume {name:?}: its record names {from:?}: the relocation did not happen; \
                     the volume serves from there again and its copy on {to:?} is freed"
                );
                if let Err(e) = self.free_storage(to, &u.rec.spec()).await {
                    warn!(
                        "volume {name:?}: the copy on {to:?} could not be freed: {e}; the next \
                         start of vestad, or the volume's delete, frees it"
                    );
                }
                u.volume.unrevoke(true);
                self.reinstate(&u.before, Ok(u.volume.clone()));
            }
            // Once, not at every retry.
            other if !u.odd_record.swap(true, Ordering::Relaxed) => {
                warn!(
                    "volume {name:?}: its relocation from {from:?} to {to:?} is unconfirmed, and \
                     its record names {}: it stays out of service; restart vestad to serve what \
                     the record names",
                    other.map_or("no datastore (there is no record)".to_owned(), |d| format!(
                        "{d:?}"
                    ))
                );
                return false;
            }
            _ => return false,
        }
        true
    }

    /// Deletes a volume: refused while connections are attached unless `force`, which cuts
    /// them off. The volume is revoked and its in-flight datastore IO drained before its
    /// storage is freed, so no late write can land in a volume created there afterwards.
    pub async fn delete_volume(&self, name: &str, force: bool) -> OpResult<api::VolumeInfo> {
        // One change per volume at a time: a policy change, relocation or peer change still
        // running would write the volume (a drain, a copy) or its vault record after the
        // delete. Taken before the admin lock, as they take it.
        let _busy = self.claim_within(name, "delete", CLAIM_WAIT).await?;
        if !force {
            // A client that has just hung up (qemu-io sends its disconnect and exits) stays
            // attached until its connection's thread has answered what it had in flight and
            // ended: a delete right after it waits for that rather than refuse. Before the
            // admin lock, which nothing else should wait for on this.
            let entry = self.local_entry(name).await?;
            let until = tokio::time::Instant::now() + DETACH_GRACE;
            while entry.connections() > 0 && tokio::time::Instant::now() < until {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        let _admin = self.admin.lock().await;
        let entry = self.local_entry(name).await?;
        if entry.unconfirmed.is_some() {
            // Which copy is the volume's is not known yet: settled first, it is deleted as
            // any other volume (and it needs the coordinator the settling waits for).
            return Err(OpError::Unavailable(format!(
                "volume {name:?}: {}; retry the delete then",
                entry.volume.as_ref().err().map_or("", |w| w.as_str())
            )));
        }
        let n = entry.connections();
        if n > 0 && !force {
            return Err(OpError::Conflict(format!(
                "volume {name:?} has {n} client connection(s) attached; disconnect them first, \
                 or pass --force to cut them off and delete it"
            )));
        }
        let ds = &entry.record.datastore;
        let store = match self.store(ds) {
            Ok(s) => Some(s),
            Err(OpError::Unavailable(why)) if !force => {
                return Err(OpError::Unavailable(format!(
                    "{why}; the volume's storage cannot be deleted now. Retry when the \
                     datastore is back, or pass --force to forget the volume and leave its \
                     storage on the datastore"
                )))
            }
            Err(OpError::Unavailable(_)) => None,
            Err(e) => return Err(e),
        };
        // Another host holding the vault lock is replaying the volume into its storage (its
        // owner handed it off, or died): freeing the storage under it would let those writes
        // land in whatever volume gets the space next. Taken after the checks that need
        // nothing of it; a volume not served here (not open, or handed to its peers) gives it
        // back if the delete fails after all.
        match crate::peers::take_vault_lock(self, entry.record.id).await {
            Ok(()) => {}
            Err(cluster::Error::Locked(who)) => {
                return Err(OpError::Conflict(format!(
                    "volume {name:?} cannot be deleted while another host replays it ({who}); \
                     retry once its replay is done"
                )))
            }
            Err(e) => {
                // The coordinator may have granted it all the same.
                self.unlock_if_not_served(&entry).await;
                return Err(OpError::Unavailable(format!("take the vault lock: {e}")));
            }
        }
        let attached = {
            let mut v = self.volumes.write().expect("lock");
            let attached = v.get(name).is_some_and(|e| e.connections() > 0) && !force;
            if !attached {
                v.remove(name); // no new connection can attach from here on
            }
            attached
        };
        if attached {
            self.unlock_if_not_served(&entry).await;
            return Err(OpError::Conflict(format!(
                "volume {name:?} was attached meanwhile; retry, or pass --force"
            )));
        }
        let info = self.volume_info(&entry);
        entry.stop.stop();
        // A delete that fails leaves the destager as it found it: one stopped before (a
        // volume handed off to its peers) stays stopped.
        let destaging = entry.volume.as_ref().is_ok_and(|v| !v.destaging_stopped());
        if let Ok(volume) = &entry.volume {
            // Clients' IO and the destager's both must be over before the storage goes.
            if !quiesce_for_storage(volume).await {
                // Nothing is deleted: the volume goes back into service as it was (its dirty
                // data still goes to the datastore), so a retried delete stops and revokes
                // this same volume again rather than free storage it still writes.
                volume.unrevoke(destaging);
                self.reinstate(&entry, Ok(volume.clone()));
                self.unlock_if_not_served(&entry).await;
                return Err(OpError::Unavailable(format!(
                    "volume {name:?} still has IO in flight to datastore {ds:?} after \
                     {FORCE_DETACH_WAIT:?}; its storage was kept. Retry the delete"
                )));
            }
        }
        // Storage first, record second: a crash in between leaves a record whose storage is
        // gone (reported, and deletable), never storage nobody knows about.
        match &store {
            Some(store) => {
                let gone = self.ds_locked(ds, async {
                    Ok(store.delete_volume(&entry.record.spec()).await?)
                });
                if let Err(e) = gone.await {
                    // Nothing was deleted: serve the same volume again (its cache included).
                    if let Ok(v) = &entry.volume {
                        v.unrevoke(destaging);
                    }
                    self.reinstate(&entry, entry.volume.clone());
                    self.unlock_if_not_served(&entry).await;
                    return Err(e);
                }
            }
            None => warn!(
                "volume {name:?}: datastore {ds:?} is unavailable; forgetting the volume and \
                 leaving its storage there (--force)"
            ),
        }
        // Copies that relocations cut short left elsewhere go too, while the record still
        // names the volume: without it, a later start would take such a copy for a create
        // cut short and import it under this name.
        self.free_copies_elsewhere(&entry.record).await;
        // Only now, with the storage gone, may what the cache holds for it go too.
        if let Ok(v) = &entry.volume {
            v.detach_cache().await;
        } else if let Some(c) = &self.cache {
            // Never opened: what recovery kept of it (dirty data it could not replay).
            if let Err(e) = c.drop_recovered(entry.record.id).await {
                warn!("volume {name:?}: release its records in the cache log: {e}");
            }
        }
        let removed = match self.coord.delete_volume(name, entry.record.id).await {
            // Gone already: a create undone in part, or a delete whose answer was lost. The
            // removal took the vault lock with it only if it was the one that happened.
            Err(cluster::Error::NotFound(_)) => {
                crate::peers::give_lock_back(self, entry.record.id, name).await;
                Ok(())
            }
            r => r,
        };
        if let Err(e) = removed {
            // The storage is gone and the record is not: listed again, not open (as a start
            // finds such a record after a crash here), so the delete can be run again rather
            // than the name be unknown here and taken for another host's volume elsewhere.
            // The vault lock stays taken here: no peer is let to try replaying a volume whose
            // storage is gone (a retried delete that fails before its record may give it back).
            let why = format!("its storage was deleted, but its record was not ({e})");
            self.reinstate(&entry, Err(why));
            return Err(OpError::Unavailable(format!(
                "volume {name:?}: its storage is deleted, but removing its record failed: \
                 {e}; run the delete again"
            )));
        }
        crate::peers::forget_vault_writer(self, entry.record.id).await;
        // A hand-off it was in is over; a new volume of the same name starts with none.
        self.peers.end_handoff(name);
        self.sampler.lock().expect("lock").forget_volume(name);
        info!("deleted volume {name:?}");
        Ok(info)
    }

    fn check_cache_for(&self, policy: Policy) -> OpResult<()> {
        if policy.cached() && self.cache.is_none() {
            return Err(OpError::BadRequest(format!(
                "policy {policy} needs a cache device, and this host has none: set [cache] path \
                 in the vestad config"
            )));
        }
        Ok(())
    }

    /// Changes a volume's policy and/or tuning. Leaving `wb` drains dirty data first, which
    /// can take as long as the datastore needs to take it; IO goes on meanwhile.
    pub async fn set_policy(&self, name: &str, req: api::SetPolicy) -> OpResult<api::VolumeInfo> {
        let _busy = self.claim_within(name, "policy change", CLAIM_WAIT).await?;
        let entry = self.local_entry(name).await?;
        let volume = entry
            .volume
            .as_ref()
            .map_err(|e| OpError::Unavailable(format!("volume {name:?} is not open: {e}")))?
            .clone();
        let policy: Policy = req.policy.parse().map_err(OpError::BadRequest)?;
        self.check_cache_for(policy)?;
        let old_tuning = volume.tuning();
        let tuning = tuning_from(old_tuning, req.hold_s, req.max_dirty_age_s, req.rpo_s)?;
        if matches!(policy, Policy::Wbp { .. }) && self.coord.kind() == "local" {
            return Err(OpError::BadRequest(format!(
                "policy {policy} needs peer hosts: configure a cluster ([cluster] etcd) with \
                 enough other hosts"
            )));
        }
        volume.set_tuning(tuning);
        let switched = if let Policy::Wbp { .. } = policy {
            crate::peers::establish(self, name, &volume, policy)
                .await
                .map_err(|e| OpError::Unavailable(format!("volume {name:?}: {e}")))
        } else {
            // Leaving wbp (or any switch): the vault says so before the volume switches.
            match crate::peers::switch_hook(self, volume.id(), policy).await {
                Ok(hook) => volume
                    .set_policy_with(policy, None, Some(hook))
                    .await
                    .map_err(|e| {
                        let peers = volume.cache().is_some_and(|c| c.has_peers());
                        let hint = match volume.loss() {
                            Ok(l) if l.dirty_bytes > 0 => format!(
                                "; {}`vesta volume accept-loss {name}` gives it up",
                                if peers {
                                    "if no peer can replay it, "
                                } else {
                                    ""
                                }
                            ),
                            _ => String::new(),
                        };
                        OpError::Unavailable(format!("volume {name:?}: {e}{hint}"))
                    }),
                Err(e) => Err(OpError::Unavailable(e)),
            }
        };
        if let Err(e) = switched {
            // The record keeps the old tuning, and so does the volume.
            volume.set_tuning(old_tuning);
            return Err(e);
        }
        *entry.wanted.lock().expect("lock") = policy;
        // The record follows the volume only once the change is complete: a crash before that
        // leaves the old policy recorded, and the cache log's own policy record decides.
        let _admin = self.admin.lock().await;
        let mut rec = entry.current_record();
        rec.policy = policy;
        rec.tuning = tuning;
        if let Err(e) = self.coord.update_volume(rec.clone()).await {
            // The change is made; only its record may not be. The same command again is a
            // switch to the policy in effect, and records it.
            return Err(OpError::Unavailable(format!(
                "volume {name:?} now runs {policy}, but recording that failed: {e}; run the \
                 same command again to record it (until then a restart may go back to the \
                 policy recorded before)"
            )));
        }
        self.record_vault(&rec, &volume).await;
        Ok(self.volume_info(&entry))
    }

    /// Gives back the vault lock a failed delete took for a volume this host does not serve
    /// (not open, or handed to its peers, which may need the lock to replay); one it serves
    /// keeps it, as its owner.
    async fn unlock_if_not_served(&self, entry: &VolumeEntry) {
        if !self.serves_with_lock(entry) {
            crate::peers::give_lock_back(self, entry.record.id, &entry.record.name).await;
        }
    }

    /// Whether this host serves `entry`'s volume under its vault lock: open (or held open by
    /// an operation), and not handed off to its peers, for which it gave the lock up.
    pub(crate) fn serves_with_lock(&self, entry: &VolumeEntry) -> bool {
        entry.keeps_vault_lock() && !self.peers.handed_off(&entry.record.name)
    }

    /// In a cluster, says that a datastore reached by path is not safe to share between
    /// hosts: each host reads and writes it through its own page cache, which another host's
    /// writes (a peer's replay, a relocation) do not update, and which can write this host's
    /// data back after its lease lapsed. Shared storage goes behind an NBD server.
    fn warn_if_cached_by_host(&self, spec: &DatastoreSpec) {
        let by_path = match &spec.kind {
            Kind::Dir { .. } => true,
            Kind::Lun { target, .. } => !target.contains("://"),
        };
        if by_path && !spec.direct && self.coord.kind() != "local" {
            warn!(
                "datastore {:?} ({} {}) is reached by path: do not share it with other hosts \
                 of the cluster (NFS, a SAN disk). Each host caches it in its own page cache, \
                 so one host may read stale data after another wrote (a peer's replay) and \
                 write old data back after its lease lapsed. Add shared storage with --direct \
                 (config: direct = true), which bypasses the page cache, or serve it with an \
                 NBD server (nbdkit, qemu-nbd) and add it as --lun nbd://…",
                spec.name,
                spec.kind_name(),
                spec.location()
            );
        }
    }

    /// Puts a volume whose deletion failed back into service, as a fresh entry (its old stop
    /// signal has fired).
    fn reinstate(&self, old: &VolumeEntry, volume: Result<Arc<Volume>, String>) {
        // An entry the retry of volumes that could not open leaves alone stays so (a create
        // undone in part must not open by itself).
        let entry = VolumeEntry {
            retry: old.retry,
            ..VolumeEntry::new(old.current_record(), volume)
        };
        self.volumes
            .write()
            .expect("lock")
            .insert(old.record.name.clone(), Arc::new(entry));
    }

    /// Tries again to open datastores that were unavailable, and the volumes on them. Volumes
    /// that failed to open had no connections (they cannot be attached), so their entries are
    /// simply replaced.
    pub async fn retry_unavailable(&self) {
        let mut down: Vec<DatastoreSpec> = self
            .datastores
            .read()
            .expect("lock")
            .values()
            .filter(|e| e.store.is_err())
            .map(|e| e.spec.clone())
            .collect();
        let were_down = down.len();
        // Datastores another host of the cluster added since.
        if self.coord.kind() != "local" {
            if let Ok(state) = self.coord.state().await {
                let known = self.datastore_names();
                down.extend(
                    state
                        .datastores
                        .into_iter()
                        .filter(|s| !known.contains(&s.name)),
                );
            }
        }
        let mut back = Vec::new();
        for (i, spec) in down.into_iter().enumerate() {
            let Ok(store) = datastore::open_in_pod(&spec, OpenMode::Reopen, Some(self.pod)).await
            else {
                continue;
            };
            self.arm(&store);
            info!("datastore {:?} is available", spec.name);
            self.datastores.write().expect("lock").insert(
                spec.name.clone(),
                DsEntry {
                    spec: spec.clone(),
                    store: Ok(store.clone()),
                },
            );
            // One learned from another host was imported by that host when it added it.
            if i < were_down {
                back.push(store);
            }
        }
        let broken: Vec<Arc<VolumeEntry>> = self
            .entries()
            .into_iter()
            .filter(|e| e.volume.is_err() && e.retry)
            .collect();
        for e in broken {
            let rec = &e.record;
            // Still down: nothing to try (and no reason to hold up admin operations).
            if self.store(&rec.datastore).is_err() {
                continue;
            }
            // The volume's claim, not the admin lock: a delete must not free the storage
            // while this opens the volume and starts its replay (it waits for the claim), but
            // an open that takes long (a slow NBD server: up to 40 s) must not hold up every
            // other admin operation. A create cannot take the name: the entry holds it. The
            // claim is had only while `e` is still the volume's entry (not deleted since).
            let Some(_busy) = self.claim_entry(&e, "reopen") else {
                continue;
            };
            let _ = self.reopen(&e).await;
        }
        // What the start would have found on a datastore that is back (storage deletes left
        // behind while it was away, creates cut short): after its volumes serve again, as the
        // import may wait for the datastore's lock.
        for store in back {
            self.import_recorded_volumes(&store, true).await;
        }
        let unconfirmed: Vec<Arc<VolumeEntry>> = self
            .entries()
            .into_iter()
            .filter(|e| e.unconfirmed.is_some())
            .collect();
        for e in unconfirmed {
            let Some(_busy) = self.claim_entry(&e, "relocation") else {
                continue;
            };
            self.settle_relocation(&e).await;
        }
    }

    /// Opens again the volume of entry `e`, which could not be opened, and serves it. The
    /// caller holds the volume's claim, under which nothing else replaces the entry.
    pub(crate) async fn reopen(&self, e: &VolumeEntry) -> Result<(), String> {
        let rec = &e.record;
        let volume = self.open_volume(rec).await?;
        info!("volume {:?} can serve IO again", rec.name);
        self.volumes.write().expect("lock").insert(
            rec.name.clone(),
            Arc::new(VolumeEntry::new(rec.clone(), Ok(volume))),
        );
        Ok(())
    }

    /// Accepts the loss of what this host's failed cache device held of a volume, which no
    /// peer can replay, or with `dry_run` says what it would be ([`crate::loss`]).
    pub async fn accept_loss(&self, name: &str, dry_run: bool) -> OpResult<api::LossReport> {
        let _busy = self
            .claim_within(name, "loss acceptance", CLAIM_WAIT)
            .await?;
        let entry = self.local_entry(name).await?;
        if entry.unconfirmed.is_some() {
            // Its `Volume` is held for the settling: a reopen here would make a second one.
            return Err(OpError::Unavailable(format!(
                "volume {name:?}: {}; retry once it is settled",
                entry.volume.as_ref().err().map_or("", |w| w.as_str())
            )));
        }
        crate::loss::accept(self, &entry, dry_run).await
    }

    /// vestad is stopping: IO of every volume stalled for a hand-off to peers, which nothing
    /// will reroute now, ends with ESHUTDOWN ([`engine::Volume::stop`]), and a relocation
    /// under way ends its copy, as a crash would (its copy is removed, the volume stays).
    pub fn stop_volumes(&self) {
        self.stopping
            .store(true, std::sync::atomic::Ordering::SeqCst);
        for e in self.entries() {
            if let Ok(v) = &e.volume {
                v.stop();
            }
        }
    }

    /// Flushes every volume: called at shutdown after connections drained.
    pub async fn flush_all(&self) {
        for e in self.entries() {
            if let Ok(v) = &e.volume {
                if let Err(err) = v.flush().await {
                    warn!(
                        "volume {:?}: flush at shutdown failed: {err}",
                        e.record.name
                    );
                }
            }
        }
    }

    /// vestad is stopping: no datastore write is issued from here on (the host's fence is
    /// revoked), and this waits until `deadline` for the writes already issued to be answered.
    /// True if none is still in service then, and none went unanswered (its connection lost
    /// or timed out) in the last half lease TTL, the time the fence gives a write sent before
    /// it closed to land. Only then may the coordinator let another incarnation of this host
    /// adopt its vault locks at once ([`Coordinator::shutdown`]): a SAN finishes a write it
    /// has taken even after its client is gone, and such a write landing after the next
    /// incarnation's replay would put old data over newer.
    pub async fn stop_datastore_writes(&self, deadline: std::time::Instant) -> bool {
        let late = Duration::from_secs(self.config.cluster.lease_ttl_s) / 2;
        self.coord.fence().revoke();
        let mut quiet = true;
        for (_, g) in self.datastore_gates() {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            quiet &= g.idle_within(left, late).await;
        }
        quiet
    }

    /// Waits until every datastore write of this host that went unanswered can have landed
    /// ([`datastore::Gate::late_writes_pending`]), at most [`datastore::LATE_WRITE_GRACE`]:
    /// before a vault lock goes to another host, whose writes of the volume (a peer's replay
    /// of the newest versions) such a write must not land over. This host's own later writes
    /// wait at the gate.
    pub async fn late_writes_landed(&self) {
        let wait = self
            .datastore_gates()
            .iter()
            .filter_map(|(_, g)| g.late_writes_pending())
            .max();
        if let Some(wait) = wait {
            info!(
                "a datastore write went unanswered lately; waiting {wait:?} for it to land \
                 before another host may write the volume"
            );
            tokio::time::sleep(wait).await;
        }
    }

    pub fn status(&self) -> api::Status {
        let nbd = self.nbd.get().cloned().unwrap_or_default();
        api::Status {
            version: env!("CARGO_PKG_VERSION").into(),
            data_dir: self.config.data_dir.display().to_string(),
            coordinator: self.coord.kind().into(),
            pod: self.pod.to_string(),
            host: self.coord.host().into(),
            fault_domain: self.config.cluster.fault_domain.clone(),
            nbd_unix: nbd.unix.map(|p| p.display().to_string()),
            nbd_tcp: nbd.tcp.map(|a| a.to_string()),
            api: self
                .api_addr
                .get()
                .map(|a| a.to_string())
                .unwrap_or_default(),
            volumes: self.volumes.read().expect("lock").len(),
            datastores: self.datastores.read().expect("lock").len(),
        }
    }
}

/// Merges tuning changes, checking each value.
fn tuning_from(
    mut t: cluster::Tuning,
    hold_s: Option<f64>,
    max_dirty_age_s: Option<f64>,
    rpo_s: Option<f64>,
) -> OpResult<cluster::Tuning> {
    let check = |what: &str, v: Option<f64>, max: f64| match v {
        Some(x) if !(0.0..=max).contains(&x) || x.is_nan() => Err(OpError::BadRequest(format!(
            "{what} {x} is out of range: use 0 to {max} seconds"
        ))),
        _ => Ok(v),
    };
    if let Some(h) = check("--hold", hold_s, 3600.0)? {
        t.hold_s = Some(h);
    }
    if let Some(a) = check("--max-dirty-age", max_dirty_age_s, 86400.0)? {
        t.max_dirty_age_s = Some(a);
    }
    if let Some(r) = check("--rpo", rpo_s, 86400.0)? {
        t.rpo_s = Some(r).filter(|r| *r > 0.0);
    }
    Ok(t)
}

fn cache_info(r: CacheReport) -> api::CacheInfo {
    api::CacheInfo {
        mode: r.mode,
        gen: r.gen,
        dirty_bytes: r.dirty_bytes,
        dirty_writes: r.dirty_writes,
        share_bytes: r.share_bytes,
        used_bytes: r.used_bytes,
        checkpoint: r.checkpoint,
        last_ser: r.last_ser,
        read_hit_ratio: r.read_hit_ratio,
        destaged_bytes: r.destaged_bytes,
        destaged_writes: r.destaged_writes,
        destage_bytes_per_s: r.destage_bytes_per_s,
        datastore_write_latency_us: r.datastore_write_latency_us,
        flow_control: r.flow_control,
        flow_pressure: r.flow_pressure,
        throttled_writes: r.throttled_writes,
        throttle_delay_us_total: r.throttle_delay_us_total,
        stalls: r.stalls,
        throttled_past_bound: r.throttled_past_bound,
        longest_write_us: r.longest_write_us,
        evicted_segments: r.evicted_segments,
        space_waits: r.space_waits,
        replaying: r.replaying,
        replay_sent: r.replay_sent,
        replay_end: r.replay_end,
        degraded: r.degraded,
        destage_error: r.destage_error,
        peers: r
            .peers
            .into_iter()
            .map(|p| api::PeerInfo {
                lag_writes: r.last_ser.saturating_sub(p.acked_ser),
                host: p.host,
                acked_ser: p.acked_ser,
                error: p.error,
            })
            .collect(),
    }
}

fn same_location(a: &DatastoreSpec, b: &DatastoreSpec) -> bool {
    match (&a.kind, &b.kind) {
        (Kind::Dir { path: x }, Kind::Dir { path: y }) => {
            x == y
                || match (std::fs::canonicalize(x), std::fs::canonicalize(y)) {
                    (Ok(x), Ok(y)) => x == y,
                    _ => false,
                }
        }
        (Kind::Lun { target: x, .. }, Kind::Lun { target: y, .. }) => x == y,
        _ => false,
    }
}

/// The pod the labels of the recorded LUN datastores name, for a pod with no id stored:
/// `None` (make a new one) when none is recorded or none names a pod. An error when they are
/// recorded but none can be read within a few seconds, or they name different pods: a guess
/// would either shut the pod out of its LUNs or take another pod's.
async fn pod_of_luns(recorded: &[DatastoreSpec]) -> anyhow::Result<Option<Uuid>> {
    let luns: Vec<DatastoreSpec> = recorded
        .iter()
        .filter(|s| matches!(s.kind, Kind::Lun { .. }))
        .cloned()
        .collect();
    if luns.is_empty() {
        return Ok(None);
    }
    let reads: Vec<_> = luns
        .iter()
        .map(|spec| {
            let spec = spec.clone();
            tokio::spawn(async move {
                let read = datastore::lun::label_pod(&spec);
                tokio::time::timeout(Duration::from_secs(5), read)
                    .await
                    .ok()
                    .flatten()
            })
        })
        .collect();
    let mut named = BTreeMap::new();
    let mut answered = 0;
    for (spec, r) in luns.iter().zip(reads) {
        if let Ok(Some(pod)) = r.await {
            answered += 1;
            if let Some(p) = pod {
                named
                    .entry(p)
                    .or_insert_with(Vec::new)
                    .push(spec.name.clone());
            }
        }
    }
    match named.len() {
        // Every LUN answered and none names a pod (all formatted before pod ids): a new id.
        0 if answered == luns.len() => Ok(None),
        // One that did not answer may name the pod: a new id would shut the pod out of it.
        0 => anyhow::bail!(
            "this pod has no id stored (an etcd restored from an older backup, a state file \
             rewritten by an older vestad?), and of its LUN datastores ({}) {} could not be read \
             to find it. Start again once they are reachable, or put the pod's id back (etcd \
             key <prefix>/pod-id, or \"pod\" in state.json; `vesta status` on another host of \
             the pod shows it)",
            luns.iter()
                .map(|s| s.name.as_str())
                .collect::<Vec<_>>()
                .join(", "),
            luns.len() - answered
        ),
        1 => Ok(named.into_keys().next()),
        _ => anyhow::bail!(
            "this pod has no id stored, and its LUN datastores name different pods: {}. Put \
             the pod's id back (etcd key <prefix>/pod-id, or \"pod\" in state.json)",
            named
                .iter()
                .map(|(p, ds)| format!("{p} ({})", ds.join(", ")))
                .collect::<Vec<_>>()
                .join("; ")
        ),
    }
}

/// Whether record `r` is the one create `rec` made (not one another host made for the same
/// storage, found without a record, as an import does).
fn same_create(r: &VolumeRecord, rec: &VolumeRecord) -> bool {
    r.id == rec.id && r.owner == rec.owner && r.created_unix == rec.created_unix
}

fn known<'a>(names: impl Iterator<Item = &'a String>) -> String {
    let v: Vec<&str> = names.map(|s| s.as_str()).collect();
    if v.is_empty() {
        "(none)".into()
    } else {
        v.join(", ")
    }
}

fn datastore_info(
    spec: &DatastoreSpec,
    status: String,
    cap: Option<datastore::Capacity>,
    volumes: usize,
) -> api::DatastoreInfo {
    api::DatastoreInfo {
        name: spec.name.clone(),
        kind: spec.kind_name().into(),
        location: spec.location(),
        class: spec.class.to_string(),
        queue_depth: spec.queue_depth,
        status,
        total_bytes: cap.map(|c| c.total_bytes),
        free_bytes: cap.map(|c| c.free_bytes),
        unwritten_bytes: cap.map(|c| c.unwritten_bytes),
        volumes,
        lun_id: match &spec.kind {
            Kind::Lun { lun_id, .. } => lun_id.map(|u| u.to_string()),
            Kind::Dir { .. } => None,
        },
        direct: spec.direct,
    }
}

/// The moves among `records` made within [`RECENT_MOVE_S`] before `now` (Unix seconds).
fn recent_moves_at(records: &[VolumeRecord], now: u64) -> Vec<balance::RecentMove> {
    records
        .iter()
        .filter_map(|r| {
            let m = r.moved.as_ref()?;
            (now.saturating_sub(m.unix) < RECENT_MOVE_S).then(|| balance::RecentMove {
                workload: r.name.clone(),
                from: m.from.clone(),
            })
        })
        .collect()
}

/// Copies every byte of `src` to `dst` (same size), [`RELOCATE_IN_FLIGHT`] chunks at a time,
/// then flushes `dst`. Chunks that read as zeroes are skipped: a new volume reads as zeroes
/// on every kind (a `dir` file is created new and sparse, a `lun` extent is zeroed by
/// `create_volume`), and the target stays sparse. Stops early, with an error, once `stop` is
/// set (vestad stopping must not wait for a copy of hours).
async fn copy_extent(
    src: &datastore::Extent,
    dst: &datastore::Extent,
    stop: &std::sync::atomic::AtomicBool,
    copied: &std::sync::atomic::AtomicU64,
) -> std::io::Result<()> {
    async fn chunk(
        src: datastore::Extent,
        dst: datastore::Extent,
        off: u64,
        len: u64,
    ) -> std::io::Result<u64> {
        let data = src.read(off, len as usize).await?;
        if !data.iter().all(|b| *b == 0) {
            dst.write(off, data, false).await?;
        }
        Ok(len)
    }
    let size = src.size();
    let mut next = 0;
    let mut told = std::time::Instant::now();
    let mut running = tokio::task::JoinSet::new();
    let mut failed = None;
    loop {
        if failed.is_none() && next < size && stop.load(std::sync::atomic::Ordering::SeqCst) {
            failed = Some(std::io::Error::other(
                "vestad is stopping; run the relocation again after it starts",
            ));
        }
        while failed.is_none() && next < size && running.len() < RELOCATE_IN_FLIGHT {
            let len = RELOCATE_CHUNK.min(size - next);
            running.spawn(chunk(src.clone(), dst.clone(), next, len));
            next += len;
        }
        let Some(r) = running.join_next().await else {
            break;
        };
        // After an error the chunks in flight still finish (none is abandoned mid-write: the
        // copy is deleted next, and no late write may land in what replaces it).
        match r.map_err(std::io::Error::other).and_then(|r| r) {
            Ok(len) => copied.fetch_add(len, Ordering::Relaxed),
            Err(e) => {
                failed.get_or_insert(e);
                continue;
            }
        };
        if told.elapsed() >= std::time::Duration::from_secs(5) {
            let copied = copied.load(Ordering::Relaxed);
            info!(
                "relocation: {} of {} copied ({:.0} %)",
                api::format_size(copied),
                api::format_size(size),
                100.0 * copied as f64 / size as f64
            );
            told = std::time::Instant::now();
        }
    }
    match failed {
        Some(e) => Err(e),
        None => dst.flush().await,
    }
}

#[cfg(test)]
mod tests;

/// The NBD URI of export `name` at `address`, percent-encoded.
fn nbd_url(address: nbd::uri::Address, name: &str) -> String {
    nbd::uri::NbdUri {
        address,
        export: name.to_owned(),
    }
    .to_string()
}

/// The NBD URI of export `name` on a host's NBD listener `addr` (`HOST:PORT`).
fn tcp_url(addr: &impl std::fmt::Display, name: &str) -> String {
    match nbd::uri::NbdUri::parse(&format!("nbd://{addr}/")) {
        Ok(u) => nbd_url(u.address, name),
        Err(_) => format!("nbd://{addr}/{name}"),
    }
}
