//! The daemon against a coordinator that fails exactly where a test says: vault writes,
//! which a real etcd fails only with timing no test can arrange (it answers the lock and the
//! read just before).

use std::sync::atomic::AtomicBool;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use cluster::local::LocalCoordinator;
use cluster::{DatastoreLock, HostStatus, State, StatsDoc};
use datastore::fence::Fence;

use super::*;

/// The `local` coordinator, whose vault writes fail while `fail_vault` is set, and whose
/// vault locks another host holds while `locked_by` names one.
struct FailingVault {
    inner: LocalCoordinator,
    fail_vault: AtomicBool,
    locked_by: std::sync::Mutex<Option<String>>,
    /// Volume record updates are made, but answered with an error (a lost answer).
    lose_update_answers: AtomicBool,
    /// Volume records are created, but answered with an error (a lost answer).
    lose_create_answers: AtomicBool,
    /// Volume record deletes fail.
    fail_deletes: AtomicBool,
    /// Volume record updates fail (nothing is written).
    fail_updates: AtomicBool,
    /// Vault unlocks fail; those that went through are listed in `unlocked`.
    fail_unlocks: AtomicBool,
    /// Vault lock takes are granted, but answered with an error (a lost answer).
    lose_lock_answers: AtomicBool,
    unlocked: std::sync::Mutex<Vec<Uuid>>,
    /// Unlocks asked for so far; each then waits for this gate (a test holds it to keep one
    /// in flight).
    unlock_calls: std::sync::atomic::AtomicU64,
    unlock_gate: tokio::sync::Mutex<()>,
    /// The lease is lost, and the host registered again, while a datastore lock is waited
    /// for (the grant, under the old lease, comes back after both).
    lease_lost_in_lock_wait: AtomicBool,
    /// The lease is lost, and the host registered again, before a datastore lock is asked
    /// for (the grant is under the new lease).
    lease_renewed_before_lock: AtomicBool,
    /// Vault reads fail; `vault_reads` counts those asked for, failed ones included.
    fail_vault_reads: AtomicBool,
    vault_reads: std::sync::atomic::AtomicU64,
    /// Reads of the cluster state (the volume records) fail.
    fail_state_reads: AtomicBool,
    /// A volume record being created is made by host "b" first (an import of the storage
    /// while this host's lease lapsed), so this host's create finds it exists.
    creates_taken_by_b: AtomicBool,
}

#[async_trait]
impl Coordinator for FailingVault {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    async fn state(&self) -> cluster::Result<State> {
        if self.fail_state_reads.load(Ordering::SeqCst) {
            return Err(cluster::Error::Unavailable(
                "etcd: no answer (injected)".into(),
            ));
        }
        self.inner.state().await
    }
    async fn add_datastore(&self, d: DatastoreSpec) -> cluster::Result<()> {
        self.inner.add_datastore(d).await
    }
    async fn update_datastore(&self, d: DatastoreSpec) -> cluster::Result<()> {
        self.inner.update_datastore(d).await
    }
    async fn create_volume(&self, v: VolumeRecord) -> cluster::Result<()> {
        if self.creates_taken_by_b.load(Ordering::SeqCst) {
            let theirs = VolumeRecord {
                owner: Some("b".into()),
                created_unix: v.created_unix + 10,
                policy: Policy::Uncached,
                ..v
            };
            self.inner.create_volume(theirs).await?;
            return Err(cluster::Error::Exists(
                "a volume by that name exists".into(),
            ));
        }
        self.inner.create_volume(v).await?;
        if self.lose_create_answers.load(Ordering::SeqCst) {
            return Err(cluster::Error::Unavailable(
                "etcd: the answer was lost (injected)".into(),
            ));
        }
        Ok(())
    }
    async fn update_volume(&self, v: VolumeRecord) -> cluster::Result<()> {
        if self.fail_updates.load(Ordering::SeqCst) {
            return Err(cluster::Error::Unavailable("record updates fail".into()));
        }
        self.inner.update_volume(v).await?;
        if self.lose_update_answers.load(Ordering::SeqCst) {
            return Err(cluster::Error::Unavailable(
                "etcd: the answer was lost (injected)".into(),
            ));
        }
        Ok(())
    }
    async fn delete_volume(&self, name: &str, id: Uuid) -> cluster::Result<()> {
        if self.fail_deletes.load(Ordering::SeqCst) {
            return Err(cluster::Error::Unavailable("record deletes fail".into()));
        }
        self.inner.delete_volume(name, id).await
    }
    async fn deleted_volumes(&self) -> cluster::Result<Vec<Uuid>> {
        self.inner.deleted_volumes().await
    }
    async fn pod_id(&self, fresh: Uuid) -> cluster::Result<Uuid> {
        self.inner.pod_id(fresh).await
    }
    async fn stored_pod_id(&self) -> cluster::Result<Option<Uuid>> {
        self.inner.stored_pod_id().await
    }
    fn host(&self) -> &str {
        self.inner.host()
    }
    async fn publish_host(&self, h: HostRecord) -> cluster::Result<()> {
        self.inner.publish_host(h).await
    }
    async fn hosts(&self) -> cluster::Result<Vec<HostStatus>> {
        self.inner.hosts().await
    }
    fn fence(&self) -> Arc<Fence> {
        self.inner.fence()
    }
    async fn lock_vault(&self, volume: Uuid) -> cluster::Result<()> {
        if let Some(h) = self.locked_by.lock().unwrap().clone() {
            return Err(cluster::Error::Locked(format!(
                "volume {volume}'s vault lock is held by host {h:?}"
            )));
        }
        self.inner.lock_vault(volume).await?;
        if self.lose_lock_answers.load(Ordering::SeqCst) {
            return Err(cluster::Error::Unavailable(
                "etcd: the answer was lost (injected)".into(),
            ));
        }
        Ok(())
    }
    async fn unlock_vault(&self, volume: Uuid) -> cluster::Result<()> {
        self.unlock_calls.fetch_add(1, Ordering::SeqCst);
        let _gate = self.unlock_gate.lock().await;
        if self.fail_unlocks.load(Ordering::SeqCst) {
            return Err(cluster::Error::Unavailable(
                "etcd: no answer (injected)".into(),
            ));
        }
        self.inner.unlock_vault(volume).await?;
        self.unlocked.lock().unwrap().push(volume);
        Ok(())
    }
    async fn vault(&self, volume: Uuid) -> cluster::Result<Option<Vault>> {
        self.vault_reads.fetch_add(1, Ordering::SeqCst);
        if self.fail_vault_reads.load(Ordering::SeqCst) {
            return Err(cluster::Error::Unavailable(
                "etcd: no answer (injected)".into(),
            ));
        }
        self.inner.vault(volume).await
    }
    async fn put_vault(&self, v: &Vault) -> cluster::Result<()> {
        if self.fail_vault.load(Ordering::SeqCst) {
            return Err(cluster::Error::Unavailable(
                "etcd: no answer (injected)".into(),
            ));
        }
        self.inner.put_vault(v).await
    }
    async fn lock_datastore(&self, name: &str) -> cluster::Result<DatastoreLock> {
        let lose_lease = || {
            let f = self.inner.fence();
            f.close();
            f.extend_to(std::time::Instant::now() + Duration::from_secs(3600));
        };
        if self.lease_renewed_before_lock.load(Ordering::SeqCst) {
            lose_lease();
        }
        let lock = self.inner.lock_datastore(name).await?;
        if self.lease_lost_in_lock_wait.load(Ordering::SeqCst) {
            lose_lease();
        }
        Ok(lock)
    }
    async fn unlock_datastore(&self, lock: DatastoreLock) -> cluster::Result<()> {
        self.inner.unlock_datastore(lock).await
    }
    async fn put_stats(&self, kind: StatsDoc, doc: Vec<u8>) -> cluster::Result<()> {
        self.inner.put_stats(kind, doc).await
    }
    async fn stats(&self, kind: StatsDoc) -> cluster::Result<Vec<(String, Vec<u8>)>> {
        self.inner.stats(kind).await
    }
    async fn stats_aggregator(&self) -> cluster::Result<bool> {
        self.inner.stats_aggregator().await
    }
    async fn put_pod_stats(&self, doc: Vec<u8>) -> cluster::Result<()> {
        self.inner.put_pod_stats(doc).await
    }
    async fn pod_stats(&self) -> cluster::Result<Option<Vec<u8>>> {
        self.inner.pod_stats().await
    }
    async fn peer_key(&self, fresh: [u8; 32]) -> cluster::Result<[u8; 32]> {
        self.inner.peer_key(fresh).await
    }
}

/// A data directory of its own, removed at the end.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        // Unique even for two tests of one tag in one second (two used "alias", and shared
        // a directory when they ran side by side).
        let p = std::env::temp_dir().join(format!(
            "vestad-{tag}-{}-{}",
            std::process::id(),
            Uuid::new_v4()
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn config(dir: &TempDir) -> Config {
    Config::parse(&format!(
        "data_dir = \"{0}\"\n[[datastore]]\nname = \"default\"\nkind = \"dir\"\n\
         path = \"{0}/ds\"\n[[datastore]]\nname = \"other\"\nkind = \"dir\"\n\
         path = \"{0}/ds2\"\n",
        dir.0.display()
    ))
    .unwrap()
}

fn coordinator(dir: &TempDir) -> Arc<FailingVault> {
    Arc::new(FailingVault {
        inner: LocalCoordinator::open(&dir.0).unwrap(),
        fail_vault: AtomicBool::new(false),
        locked_by: Default::default(),
        lose_update_answers: AtomicBool::new(false),
        lose_create_answers: AtomicBool::new(false),
        fail_deletes: AtomicBool::new(false),
        fail_updates: AtomicBool::new(false),
        fail_unlocks: AtomicBool::new(false),
        lose_lock_answers: AtomicBool::new(false),
        unlocked: Default::default(),
        unlock_calls: Default::default(),
        unlock_gate: Default::default(),
        lease_lost_in_lock_wait: AtomicBool::new(false),
        lease_renewed_before_lock: AtomicBool::new(false),
        fail_vault_reads: AtomicBool::new(false),
        vault_reads: Default::default(),
        fail_state_reads: AtomicBool::new(false),
        creates_taken_by_b: AtomicBool::new(false),
    })
}

/// A daemon on `dir`, its cache log in `dir/cache.img` (opened afresh, as at a restart).
async fn start(dir: &TempDir, coord: &Arc<FailingVault>) -> Arc<Daemon> {
    Arc::new(try_start(dir, coord).await.unwrap())
}

/// [`start`], and how it went.
async fn try_start(dir: &TempDir, coord: &Arc<FailingVault>) -> anyhow::Result<Daemon> {
    let dev = cachelog::FileCache::open(&dir.0.join("cache.img"), 32 << 20).unwrap();
    let cache = CacheHost::open(Arc::new(dev), engine::cache::SEGMENT_DEFAULT).unwrap();
    let coord: Arc<dyn Coordinator> = coord.clone();
    Daemon::start(config(dir), coord, Some(cache)).await
}

/// Creates the 1 MiB volume `v` on datastore `default` in `policy`.
async fn create_v(d: &Daemon, policy: &str) {
    try_create_v(d, policy).await.unwrap();
}

/// [`create_v`], and how it went.
async fn try_create_v(d: &Daemon, policy: &str) -> OpResult<api::VolumeInfo> {
    d.create_volume(api::CreateVolume {
        name: "v".into(),
        size: 1 << 20,
        datastore: Some("default".into()),
        policy: Some(policy.into()),
        hold_s: None,
        max_dirty_age_s: None,
        rpo_s: None,
    })
    .await
}

/// What `vesta datastore add NAME --dir DIR` or `--lun LUN` asks for.
fn add_request(name: &str, dir: Option<&Path>, lun: Option<&Path>) -> api::AddDatastore {
    api::AddDatastore {
        name: name.into(),
        dir: dir.map(|p| p.display().to_string()),
        lun: lun.map(|p| p.display().to_string()),
        class: None,
        queue_depth: None,
        force: false,
        take_over: None,
        direct: false,
    }
}

/// A new, blank 64 MiB file `NAME.img` in `dir`, to serve as a LUN.
fn lun_file(dir: &TempDir, name: &str) -> PathBuf {
    let img = dir.0.join(format!("{name}.img"));
    std::fs::File::create(&img)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    img
}

/// LUN `img`, formatted for pod `pod` (by another host) and recorded as datastore `name`.
async fn record_lun(coord: &FailingVault, name: &str, img: &Path, pod: Option<Uuid>) {
    let spec = DatastoreSpec {
        name: name.into(),
        kind: Kind::Lun {
            target: img.display().to_string(),
            lun_id: None,
        },
        class: Default::default(),
        queue_depth: 4,
        direct: false,
    };
    let add = OpenMode::Add {
        force: false,
        take_over: None,
    };
    let store = datastore::open_in_pod(&spec, add, pod).await.unwrap();
    coord
        .inner
        .add_datastore(store.spec().clone())
        .await
        .unwrap();
}

/// Removes the pod id from the state file of the daemon on `dir` (stopped), as an older build
/// rewriting it would.
fn forget_pod_id(dir: &TempDir) {
    let state = dir.0.join("state.json");
    let mut j: serde_json::Value = serde_json::from_slice(&std::fs::read(&state).unwrap()).unwrap();
    assert!(j.as_object_mut().unwrap().remove("pod").is_some());
    std::fs::write(&state, serde_json::to_vec(&j).unwrap()).unwrap();
}

/// Creates volume `v` in `wt` and stops the daemon; returns its id and the generation its
/// cache log recorded.
async fn create_and_stop(dir: &TempDir, coord: &Arc<FailingVault>) -> (Uuid, u64) {
    let d = start(dir, coord).await;
    create_v(&d, "wt").await;
    let v = volume(&d, "v");
    assert!(writes(&v, Duration::from_secs(5)).await);
    d.flush_all().await;
    let id = d.entry("v").unwrap().record.id;
    let gen = v.cache_report().unwrap().gen;
    (id, gen)
}

/// A daemon on a new scratch directory, started again after [`create_and_stop`] made its
/// volume `v`: the scratch directory, the coordinator and the daemon.
async fn restarted_with_v(tag: &str) -> (TempDir, Arc<FailingVault>, Arc<Daemon>) {
    let dir = TempDir::new(tag);
    let coord = coordinator(&dir);
    create_and_stop(&dir, &coord).await;
    let d = start(&dir, &coord).await;
    (dir, coord, d)
}

/// Relocates volume `v` to datastore `other`, offline.
async fn relocate_to_other(d: &Daemon) {
    try_relocate_to_other(d).await.unwrap();
}

/// Relocates volume `v` to datastore `other`, offline, and says how it went.
async fn try_relocate_to_other(d: &Daemon) -> OpResult<api::VolumeInfo> {
    d.relocate(
        "v",
        api::Relocate {
            datastore: "other".into(),
            offline: true,
        },
    )
    .await
}

/// What a `wbp` owner that died leaves in the vault: peer b listed at generation `gen`.
fn old_vault(id: Uuid, gen: u64) -> Vault {
    Vault {
        volume: id,
        policy: Policy::Wt,
        checkpoint: 0,
        gen,
        owner: "local".into(),
        peers: vec!["b".into()],
        previous_owner: None,
        handoff: false,
    }
}

fn volume(d: &Daemon, name: &str) -> Arc<Volume> {
    d.entry(name).unwrap().volume.clone().unwrap()
}

/// Whether a 4 KiB write to `v` completes within `wait`.
async fn writes(v: &Volume, wait: Duration) -> bool {
    let w = v.write(0, Bytes::from(vec![9u8; 4096]), false);
    matches!(tokio::time::timeout(wait, w).await, Ok(Ok(())))
}

/// A host that opens a volume whose vault still names peers (it ran `wbp` before it died,
/// and no peer replayed) must record the vault before it takes writes: if it wrote first and
/// died again, a peer would replay its old replicas over those writes. When the record fails
/// the writes wait, reads go on, and they go once the vault is recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_whose_vault_names_old_peers_takes_no_write_before_the_vault_is_recorded() {
    let dir = TempDir::new("held");
    let coord = coordinator(&dir);
    let (id, gen) = create_and_stop(&dir, &coord).await;
    coord.put_vault(&old_vault(id, gen)).await.unwrap();

    coord.fail_vault.store(true, Ordering::SeqCst);
    let d = start(&dir, &coord).await;
    let v = volume(&d, "v");
    assert!(v.writes_held(), "the vault could not be recorded");
    assert!(
        !writes(&v, Duration::from_millis(300)).await,
        "a write completed while the vault still names peer b"
    );
    tokio::time::timeout(Duration::from_secs(5), v.read(0, 4096))
        .await
        .expect("reads go on")
        .unwrap();
    assert_eq!(coord.vault(id).await.unwrap().unwrap().peers, vec!["b"]);

    // The round that retries it: still failing, still held.
    crate::peers::release_held_writes(&d).await;
    assert!(v.writes_held());
    coord.fail_vault.store(false, Ordering::SeqCst);
    crate::peers::release_held_writes(&d).await;
    assert!(!v.writes_held());
    assert!(coord.vault(id).await.unwrap().unwrap().peers.is_empty());
    assert!(
        writes(&v, Duration::from_secs(5)).await,
        "writes go once recorded"
    );
}

/// Without peers in the vault a failed record only costs a log line: writes go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_whose_vault_names_no_peers_takes_writes_even_if_the_record_fails() {
    let dir = TempDir::new("unheld");
    let coord = coordinator(&dir);
    create_and_stop(&dir, &coord).await;
    coord.fail_vault.store(true, Ordering::SeqCst);
    let d = start(&dir, &coord).await;
    let v = volume(&d, "v");
    assert!(!v.writes_held());
    assert!(writes(&v, Duration::from_secs(5)).await);
}

/// Held writes survive a relocation: the reopened volume is another object, which must not
/// start unheld while the vault still names old peers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relocation_keeps_writes_held_until_the_vault_is_recorded() {
    let dir = TempDir::new("relocate");
    let coord = coordinator(&dir);
    let (id, gen) = create_and_stop(&dir, &coord).await;
    coord.put_vault(&old_vault(id, gen)).await.unwrap();
    coord.fail_vault.store(true, Ordering::SeqCst);
    let d = start(&dir, &coord).await;
    assert!(volume(&d, "v").writes_held());
    relocate_to_other(&d).await;
    let v = volume(&d, "v");
    assert_eq!(d.entry("v").unwrap().record.datastore, "other");
    assert!(
        v.writes_held(),
        "the relocated volume must keep its writes held"
    );
    assert!(!writes(&v, Duration::from_millis(300)).await);
    coord.fail_vault.store(false, Ordering::SeqCst);
    crate::peers::release_held_writes(&d).await;
    assert!(coord.vault(id).await.unwrap().unwrap().peers.is_empty());
    assert!(writes(&v, Duration::from_secs(5)).await);
}

/// A vault naming peers of a generation this host's cache log never reached (the host came
/// back on a new cache device): the volume's newest writes may be only in those peers'
/// replicas, so the host does not serve it (which would record a new generation and make the
/// peers drop them) but marks it for hand-off and gives the lock up; it serves once a peer
/// has replayed and recorded a vault without peers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_whose_log_lacks_the_vaults_generation_hands_the_volume_to_its_peers() {
    let dir = TempDir::new("handoff");
    let coord = coordinator(&dir);
    let (id, gen) = create_and_stop(&dir, &coord).await;
    coord.put_vault(&old_vault(id, gen + 1)).await.unwrap();
    let d = start(&dir, &coord).await;
    let Err(e) = d.entry("v").unwrap().volume.clone() else {
        panic!("the volume must not serve here yet");
    };
    assert!(e.contains("waiting for its peer(s)"), "{e}");
    let vault = coord.vault(id).await.unwrap().unwrap();
    assert!(vault.handoff && vault.peers == vec!["b"], "{vault:?}");
    drop(d);
    // A peer replayed: the vault says wt, a newer generation, no peers.
    coord
        .put_vault(&Vault {
            policy: Policy::Wt,
            gen: gen + 2,
            owner: "b".into(),
            peers: Vec::new(),
            handoff: false,
            ..vault
        })
        .await
        .unwrap();
    let d = start(&dir, &coord).await;
    let v = volume(&d, "v");
    assert!(writes(&v, Duration::from_secs(5)).await);
    assert!(v.cache_report().unwrap().gen > gen + 2);
}

/// A vault that names another host as the writer of this host's own generation: a peer began
/// an online replay of it and did not finish. That replay may have set blocks back to older
/// data than this host's checkpoint says the datastore holds, and only the peers can put the
/// newest back: the host must not serve (nor replay from its own checkpoint) but hand the
/// volume to them, even with no dirty data of its own. Once a replay finished, it serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_whose_peer_began_a_replay_and_did_not_finish_hands_the_volume_on() {
    let dir = TempDir::new("unfinished");
    let coord = coordinator(&dir);
    let (id, gen) = create_and_stop(&dir, &coord).await;
    let began = Vault {
        owner: "b".into(),
        previous_owner: Some("local".into()),
        peers: vec!["b".into(), "c".into()],
        ..old_vault(id, gen)
    };
    coord.put_vault(&began).await.unwrap();
    let d = start(&dir, &coord).await;
    let Err(e) = d.entry("v").unwrap().volume.clone() else {
        panic!("the volume must not serve here while b's replay is unfinished");
    };
    assert!(e.contains("began replaying it and did not finish"), "{e}");
    let vault = coord.vault(id).await.unwrap().unwrap();
    assert_eq!(
        vault,
        Vault {
            handoff: true,
            ..began.clone()
        }
    );
    // If no peer can finish it, the operator can give up what they hold.
    let report = crate::loss::accept(&d, &d.entry("v").unwrap(), true)
        .await
        .expect("accept-loss offered");
    assert_eq!(report.peers, vec!["b", "c"]);
    drop(d);
    // c finished it: wt, a newer generation, no peers.
    coord
        .put_vault(&Vault {
            policy: Policy::Wt,
            gen: gen + 1,
            owner: "c".into(),
            peers: Vec::new(),
            handoff: false,
            ..vault
        })
        .await
        .unwrap();
    let d = start(&dir, &coord).await;
    assert!(writes(&volume(&d, "v"), Duration::from_secs(5)).await);
}

/// The hand-off above must not fire for a volume whose log entry was used up: here its
/// datastore was down at start (the open failed, and recovery ended without it), and it
/// opens when the datastore is back. The log still knows its generation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_opened_late_is_not_handed_off_for_want_of_its_log_entry() {
    let dir = TempDir::new("late");
    let coord = coordinator(&dir);
    let (id, gen) = create_and_stop(&dir, &coord).await;
    coord.put_vault(&old_vault(id, gen)).await.unwrap();
    // The datastore is away at start.
    let ds = dir.0.join("ds");
    let away = dir.0.join("ds.away");
    std::fs::rename(&ds, &away).unwrap();
    let d = start(&dir, &coord).await;
    assert!(d.entry("v").unwrap().volume.is_err());
    d.cache
        .as_ref()
        .unwrap()
        .finish_recovery(&d.volume_ids())
        .unwrap();
    std::fs::rename(&away, &ds).unwrap();
    d.retry_unavailable().await;
    let v = volume(&d, "v");
    assert!(writes(&v, Duration::from_secs(5)).await);
    let vault = coord.vault(id).await.unwrap().unwrap();
    assert!(!vault.handoff && vault.peers.is_empty(), "{vault:?}");
}

/// The every-3-s retry of volumes that could not open leaves placeholders alone: a volume
/// being relocated (or with a delete pending) is still open in this process, and a second
/// `Volume` of it would take writes the operation then loses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_retry_of_unopened_volumes_leaves_placeholders_alone() {
    let (dir, coord, d) = restarted_with_v("placeholder").await;
    let rec = d.entry("v").unwrap().record.clone();
    let _open = volume(&d, "v");
    d.volumes.write().unwrap().insert(
        "v".into(),
        Arc::new(VolumeEntry::placeholder(rec.clone(), "relocating".into())),
    );
    d.retry_unavailable().await;
    let Err(why) = d.entry("v").unwrap().volume.clone() else {
        panic!("a placeholder was replaced by a second open of the volume");
    };
    assert_eq!(why, "relocating");
    // A volume that could not open is tried again.
    drop(_open);
    d.volumes.write().unwrap().remove("v");
    let d = start(&dir, &coord).await;
    d.volumes.write().unwrap().insert(
        "v".into(),
        Arc::new(VolumeEntry::new(rec, Err("datastore was down".into()))),
    );
    // Not under the admin lock (an admin operation running meanwhile), which an open that
    // takes long would hold up: under the volume's claim, which a delete waits for.
    let admin = d.admin.lock().await;
    tokio::time::timeout(Duration::from_secs(10), d.retry_unavailable())
        .await
        .expect("the retry waited for the admin lock");
    drop(admin);
    assert!(d.entry("v").unwrap().volume.is_ok());
    // A claim held elsewhere: the retry leaves the volume for the next round.
    let rec = d.entry("v").unwrap().record.clone();
    d.volumes.write().unwrap().remove("v");
    let d = start(&dir, &coord).await;
    d.volumes.write().unwrap().insert(
        "v".into(),
        Arc::new(VolumeEntry::new(rec, Err("datastore was down".into()))),
    );
    let busy = d.try_claim("v", "delete").unwrap();
    d.retry_unavailable().await;
    assert!(
        d.entry("v").unwrap().volume.is_err(),
        "opened under a delete"
    );
    drop(busy);
    d.retry_unavailable().await;
    assert!(d.entry("v").unwrap().volume.is_ok());
}

/// A delete must not free a volume's storage while another host holds its vault lock: that
/// host is replaying the volume into it (a hand-off, or its owner died), and its writes would
/// land in whatever volume gets the space next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_waits_for_another_hosts_replay_of_the_volume() {
    let (dir, coord, d) = restarted_with_v("delete").await;
    let file = dir.0.join("ds");
    let files = || std::fs::read_dir(&file).unwrap().count();
    let before = files();
    *coord.locked_by.lock().unwrap() = Some("b".into());
    let e = d.delete_volume("v", true).await.unwrap_err();
    assert!(e.to_string().contains("another host replays it"), "{e}");
    assert!(d.entry("v").is_ok(), "the volume is still known");
    assert_eq!(files(), before, "its storage is kept");
    *coord.locked_by.lock().unwrap() = None;
    d.delete_volume("v", true).await.unwrap();
    assert!(files() < before, "deleted once the lock is free");
}

/// A relocation whose record update was made but answered with an error: the record names
/// the new datastore, so the copy there must be kept and the volume served from it (before,
/// the copy was deleted and the volume served from the old place, against its record).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relocation_whose_recording_lost_its_answer_keeps_the_recorded_copy() {
    let (dir, coord, d) = restarted_with_v("lostanswer").await;
    let v = volume(&d, "v");
    v.write(8192, Bytes::from(vec![4u8; 4096]), true)
        .await
        .unwrap();
    coord.lose_update_answers.store(true, Ordering::SeqCst);
    relocate_to_other(&d).await;
    coord.lose_update_answers.store(false, Ordering::SeqCst);
    assert_eq!(d.entry("v").unwrap().record.datastore, "other");
    drop(v);
    drop(d);
    // What a restart serves: the datastore the record names, with the data.
    let d = start(&dir, &coord).await;
    let v = volume(&d, "v");
    assert_eq!(d.entry("v").unwrap().record.datastore, "other");
    let got = v.read(8192, 4096).await.unwrap();
    assert!(got.iter().all(|b| *b == 4), "the relocated data");
}

/// Relocates `v` while record updates fail as `lose_answer` says (made and answered with an
/// error, or not made) and the record cannot be read back: the relocation is unconfirmed, the
/// volume serves from neither copy, and a delete is refused. Then the coordinator answers
/// again. Returns the daemon and the scratch directory.
async fn unconfirmed_relocation(tag: &str, lose_answer: bool) -> (TempDir, Arc<Daemon>) {
    let (dir, coord, d) = restarted_with_v(tag).await;
    let v = volume(&d, "v");
    v.write(8192, Bytes::from(vec![4u8; 4096]), true)
        .await
        .unwrap();
    drop(v);
    let failing = if lose_answer {
        &coord.lose_update_answers
    } else {
        &coord.fail_updates
    };
    failing.store(true, Ordering::SeqCst);
    coord.fail_state_reads.store(true, Ordering::SeqCst);
    let e = try_relocate_to_other(&d).await.unwrap_err();
    assert!(e.to_string().contains("not confirmed"), "{e}");
    failing.store(false, Ordering::SeqCst);
    assert!(d.entry("v").unwrap().volume.is_err(), "serves unconfirmed");
    assert!(dir.0.join("ds/v.raw").exists() && dir.0.join("ds2/v.raw").exists());
    let e = d.delete_volume("v", true).await.unwrap_err();
    assert!(e.to_string().contains("not confirmed"), "{e}");
    // The retry of unavailable volumes leaves it while the record cannot be read...
    d.retry_unavailable().await;
    assert!(d.entry("v").unwrap().volume.is_err());
    assert!(dir.0.join("ds/v.raw").exists() && dir.0.join("ds2/v.raw").exists());
    // ...and settles it once it can.
    coord.fail_state_reads.store(false, Ordering::SeqCst);
    d.retry_unavailable().await;
    (dir, d)
}

/// A relocation whose record switch was made but could not be confirmed serves from the copy
/// as soon as the record can be read, and frees the source. Before, the volume stayed out of
/// service until vestad restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unconfirmed_relocation_that_was_recorded_serves_from_the_copy_once_confirmed() {
    let (dir, d) = unconfirmed_relocation("unconfirmed-made", true).await;
    let e = d.entry("v").unwrap();
    assert_eq!(e.record.datastore, "other");
    let v = volume(&d, "v");
    let got = v.read(8192, 4096).await.unwrap();
    assert!(got.iter().all(|b| *b == 4), "the relocated data");
    assert!(writes(&v, Duration::from_secs(5)).await, "takes writes");
    assert!(!dir.0.join("ds/v.raw").exists(), "the source was not freed");
    assert!(dir.0.join("ds2/v.raw").exists());
}

/// A relocation whose record switch did not happen, and could not be confirmed, serves from
/// the source again as soon as the record can be read, and frees the copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unconfirmed_relocation_that_was_not_recorded_serves_from_the_source_again() {
    let (dir, d) = unconfirmed_relocation("unconfirmed-not", false).await;
    let e = d.entry("v").unwrap();
    assert_eq!(e.record.datastore, "default");
    let v = volume(&d, "v");
    let got = v.read(8192, 4096).await.unwrap();
    assert!(got.iter().all(|b| *b == 4), "the volume's data");
    assert!(writes(&v, Duration::from_secs(5)).await, "takes writes");
    assert!(dir.0.join("ds/v.raw").exists());
    assert!(!dir.0.join("ds2/v.raw").exists(), "the copy was not freed");
    drop(v);
    // Settled for good: a delete now goes through.
    d.delete_volume("v", false).await.unwrap();
    assert!(!dir.0.join("ds/v.raw").exists());
}

/// A delete waits for another change of the volume and is refused if it goes on: a policy
/// change still draining, or a peer change, would write the volume's storage or its vault
/// record after the delete freed them. A short claim (the once-a-second round's) is waited
/// out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_is_refused_while_another_change_of_the_volume_runs() {
    let (dir, _coord, d) = restarted_with_v("deleteclaim").await;
    let file = dir.0.join("ds");
    let files = || std::fs::read_dir(&file).unwrap().count();
    let before = files();
    {
        let _busy = d.try_claim("v", "policy change").unwrap();
        let e = d.delete_volume("v", true).await.unwrap_err();
        assert!(e.to_string().contains("policy change under way"), "{e}");
        assert!(d.entry("v").is_ok(), "the volume is still known");
        assert_eq!(files(), before, "its storage is kept");
        assert!(
            d.try_claim("v", "vault record").is_none(),
            "the refused delete left the other change's claim alone"
        );
    }
    // A claim given up within the wait: the delete goes ahead.
    let busy = d.try_claim("v", "vault record").unwrap();
    let d2 = d.clone();
    let deleting = tokio::spawn(async move { d2.delete_volume("v", true).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!deleting.is_finished(), "the delete waits for the claim");
    drop(busy);
    deleting.await.unwrap().unwrap();
    assert!(files() < before, "deleted");
    assert!(
        d.try_claim("v", "policy change").is_some(),
        "the delete gave its own claim back"
    );
}

/// A delete whose last step, removing the record, fails has freed the storage already: the
/// volume stays listed (not open) and a second delete finishes. Before, the name was gone
/// from this host while its record stayed, so a retry answered "no volume named" and only
/// a restart brought it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_whose_record_removal_fails_can_be_run_again() {
    let (dir, coord, d) = restarted_with_v("deleterecord").await;
    let file = dir.0.join("ds");
    let files = || std::fs::read_dir(&file).unwrap().count();
    let before = files();
    coord.fail_deletes.store(true, Ordering::SeqCst);
    let e = d.delete_volume("v", false).await.unwrap_err();
    assert!(e.to_string().contains("run the delete again"), "{e}");
    assert!(files() < before, "the storage was deleted");
    let listed = d.entry("v").expect("the volume is still listed");
    assert!(listed.volume.is_err(), "and not open");
    coord.fail_deletes.store(false, Ordering::SeqCst);
    d.delete_volume("v", false)
        .await
        .expect("the second delete failed");
    assert!(d.entry("v").is_err(), "deleted");
    assert!(coord.inner.state().await.unwrap().volumes.is_empty());
}

/// A policy change whose record update fails has still switched the volume: the error says
/// so, and the same command again records it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_change_whose_record_fails_says_it_took_effect_and_a_rerun_records_it() {
    let (_dir, coord, d) = restarted_with_v("policyrecord").await;
    let to_uncached = || api::SetPolicy {
        policy: "uncached".into(),
        ..Default::default()
    };
    let recorded = || async {
        let state = coord.inner.state().await.unwrap();
        state.volumes.iter().find(|v| v.name == "v").unwrap().policy
    };
    coord.fail_updates.store(true, Ordering::SeqCst);
    let e = d.set_policy("v", to_uncached()).await.unwrap_err();
    assert!(
        e.to_string().contains("now runs uncached")
            && e.to_string().contains("run the same command again"),
        "{e}"
    );
    assert_eq!(
        recorded().await,
        Policy::Wt,
        "the record still has the old policy"
    );
    coord.fail_updates.store(false, Ordering::SeqCst);
    let v = d.set_policy("v", to_uncached()).await.unwrap();
    assert_eq!(v.policy, "uncached");
    assert_eq!(recorded().await, Policy::Uncached);
}

/// Storage a create made before a crash kept it from recording the volume is found at the
/// next start and imported, so its name and space are not lost for good: the volume is
/// listed, reads as zeroes and can be deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storage_a_crashed_create_left_is_imported_at_the_next_start() {
    let dir = TempDir::new("orphan");
    let coord = coordinator(&dir);
    create_and_stop(&dir, &coord).await;
    {
        let d = start(&dir, &coord).await;
        // The create's first step alone: the storage, then the crash.
        let store = d.store("default").unwrap();
        let spec = datastore::VolumeSpec {
            id: Uuid::new_v4(),
            name: "cut".into(),
            size: 1 << 20,
        };
        store.create_volume(&spec).await.unwrap();
        assert!(d.entry("cut").is_err());
    }
    let d = start(&dir, &coord).await;
    let e = d.entry("cut").expect("the storage was not imported");
    let v = e.volume.as_ref().expect("the imported volume is not open");
    assert_eq!(v.read(0, 4096).await.unwrap(), vec![0u8; 4096]);
    assert!(
        d.entry("v").is_ok(),
        "the recorded volume is served as before"
    );
    d.delete_volume("cut", false).await.unwrap();
    assert!(d.entry("cut").is_err());
}

/// A replay of a dead owner's volume that stopped here is handed on to the other peers by
/// marking the vault. When that write fails (the coordinator did not answer), it is tried
/// again every round, under the vault lock, until it lands. Before, it was tried once, and
/// the vault went on naming this live host as the writer: no other peer would ever continue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_replay_that_could_not_be_handed_on_is_handed_on_later() {
    let (_dir, coord, d) = restarted_with_v("passon").await;
    let mut rec = d.entry("v").unwrap().record.clone();
    rec.id = Uuid::new_v4();
    rec.name = "x".into();
    let me = d.coord.host().to_owned();
    // What a replay leaves in the vault once it has named this host the writer.
    coord.lock_vault(rec.id).await.unwrap();
    coord
        .put_vault(&Vault {
            owner: me.clone(),
            previous_owner: Some("b".into()),
            ..old_vault(rec.id, 3)
        })
        .await
        .unwrap();
    let handoff = || async { coord.vault(rec.id).await.unwrap().unwrap().handoff };
    let unlocks = || {
        coord
            .unlocked
            .lock()
            .unwrap()
            .iter()
            .filter(|v| **v == rec.id)
            .count()
    };
    coord.fail_vault.store(true, Ordering::SeqCst);
    crate::peers::pass_on(&d, &rec).await;
    crate::peers::give_lock_back(&d, rec.id, &rec.name).await;
    assert!(!handoff().await);
    assert_eq!(unlocks(), 1);
    // A round while it still fails: the lock taken and given back, nothing marked.
    crate::peers::retry_owed_passes(&d).await;
    assert!(!handoff().await);
    assert_eq!(unlocks(), 2);
    // Another host holds the lock for a while: the round leaves it alone.
    *coord.locked_by.lock().unwrap() = Some("c".into());
    coord.fail_vault.store(false, Ordering::SeqCst);
    crate::peers::retry_owed_passes(&d).await;
    assert!(!handoff().await, "marked without the vault lock");
    // It answers again.
    *coord.locked_by.lock().unwrap() = None;
    crate::peers::retry_owed_passes(&d).await;
    assert!(
        !handoff().await,
        "another host took the volume on: nothing is owed"
    );
    assert_eq!(unlocks(), 2);
    // Owed again; then this host tries the replay again (here it ends at once: it holds no
    // replicas). The hand-on is that try's to make if it stops: a later round marks nothing
    // (it would mark the vault of a replay that finished).
    coord.fail_vault.store(true, Ordering::SeqCst);
    coord.lock_vault(rec.id).await.unwrap();
    crate::peers::pass_on(&d, &rec).await;
    crate::peers::give_lock_back(&d, rec.id, &rec.name).await;
    coord.fail_vault.store(false, Ordering::SeqCst);
    crate::peers::replay_for_dead_owner(&d, &rec).await.unwrap();
    assert_eq!(unlocks(), 4);
    crate::peers::retry_owed_passes(&d).await;
    assert!(
        !handoff().await,
        "a round marked the vault after another try"
    );
    assert_eq!(unlocks(), 4);
    // Owed again, and the coordinator answers: handed on, the lock given back.
    coord.fail_vault.store(true, Ordering::SeqCst);
    coord.lock_vault(rec.id).await.unwrap();
    crate::peers::pass_on(&d, &rec).await;
    crate::peers::give_lock_back(&d, rec.id, &rec.name).await;
    coord.fail_vault.store(false, Ordering::SeqCst);
    crate::peers::retry_owed_passes(&d).await;
    let v = coord.vault(rec.id).await.unwrap().unwrap();
    assert!(v.handoff, "the stopped replay was never handed on");
    assert_eq!(v.owner, me);
    assert_eq!(unlocks(), 6, "the vault lock was not given back");
    // Nothing more owed.
    crate::peers::retry_owed_passes(&d).await;
    assert_eq!(unlocks(), 6);
}

/// A host whose datastore writes stopped for good (it lost vault locks while its lease was
/// gone) does not take a dead owner's vault lock to replay: it would hold it for as long as
/// it runs, every write refused, and keep every other host from replaying.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_host_does_not_start_a_replay() {
    let (_dir, coord, d) = restarted_with_v("revoked").await;
    let rec = d.entry("v").unwrap().record.clone();
    coord.fence().revoke();
    let e = crate::peers::replay_for_dead_owner(&d, &rec)
        .await
        .unwrap_err();
    assert!(e.contains("restart vestad"), "{e}");
}

/// A relocation whose copy is under way when vestad starts to stop ends its copy, as a crash
/// would: the volume stays where it was, and no copy is left on the target. Before, the
/// stop waited for the whole copy, however long (hours, for a large volume).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_ends_a_relocations_copy() {
    let (_dir, _coord, d) = restarted_with_v("relocstop").await;
    d.stop_volumes();
    let e = try_relocate_to_other(&d).await.unwrap_err();
    assert!(e.to_string().contains("vestad is stopping"), "{e}");
    assert_eq!(d.entry("v").unwrap().record.datastore, "default");
    let other = d.store("other").unwrap();
    assert!(
        other.recorded_volumes().await.unwrap().is_empty(),
        "the partial copy was left on the target"
    );
}

/// A LUN another host of the cluster added under one name (recorded, not yet known to this
/// host) is refused under a second: two names would be two locks on one volume table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lun_another_host_added_is_refused_under_a_second_name() {
    let dir = TempDir::new("lunname");
    let coord = coordinator(&dir);
    let d = start(&dir, &coord).await;
    let img = lun_file(&dir, "lun");
    // The other host formats and records it as "san".
    record_lun(&coord, "san", &img, None).await;
    let e = d
        .add_datastore(add_request("san2", None, Some(&img)))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("already datastore \"san\""), "{e}");
}

/// A pod whose stored id was lost while its datastores were kept (a state file rewritten by
/// an older build, an etcd restored from a backup older than pod ids) takes its id back from
/// its LUNs' labels. A new id would have shut it out of every LUN it formatted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_that_lost_its_id_finds_it_on_its_luns() {
    let dir = TempDir::new("pod-lost");
    let coord = coordinator(&dir);
    let d = start(&dir, &coord).await;
    let img = lun_file(&dir, "lun");
    d.add_datastore(add_request("san", None, Some(&img)))
        .await
        .unwrap();
    let pod = d.status().pod;
    drop(d);
    drop(coord);
    forget_pod_id(&dir);
    let coord = coordinator(&dir);
    let d = start(&dir, &coord).await;
    assert_eq!(d.status().pod, pod);
    assert!(d.store("san").is_ok(), "the pod's own LUN does not open");
}

/// A pod with no id stored guesses none from its LUNs when they cannot be read, or name
/// different pods: its start fails and says why. A new id would shut it out of its LUNs; one
/// taken from a LUN another pod took over would give it that pod's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_that_lost_its_id_does_not_guess_it() {
    let dir = TempDir::new("pod-guess");
    let coord = coordinator(&dir);
    let d = start(&dir, &coord).await;
    let (one, two) = (lun_file(&dir, "one"), lun_file(&dir, "two"));
    d.add_datastore(add_request("one", None, Some(&one)))
        .await
        .unwrap();
    drop(d);
    // "two" recorded too, formatted by another pod.
    record_lun(&coord, "two", &two, Some(Uuid::new_v4())).await;
    drop(coord);
    forget_pod_id(&dir);
    let e = try_start(&dir, &coordinator(&dir))
        .await
        .err()
        .expect("started")
        .to_string();
    assert!(e.contains("name different pods"), "{e}");
    // Neither can be read: no guess either.
    let away = |p: &Path| std::fs::rename(p, p.with_extension("away")).unwrap();
    away(&one);
    away(&two);
    let e = try_start(&dir, &coordinator(&dir))
        .await
        .err()
        .expect("started")
        .to_string();
    assert!(e.contains("could not be read"), "{e}");
}

/// A policy change and a relocation wait out a background round's claim of their volume
/// (a `wbp` volume without peers tries a peer change every second) instead of failing as a
/// conflict; another operator's change still refuses them at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_change_and_a_relocation_wait_out_a_rounds_claim() {
    let (_dir, _coord, d) = restarted_with_v("policyclaim").await;
    let to_uncached = || api::SetPolicy {
        policy: "uncached".into(),
        ..Default::default()
    };
    {
        let _busy = d.try_claim("v", "relocation").unwrap();
        let e = d.set_policy("v", to_uncached()).await.unwrap_err();
        assert!(e.to_string().contains("relocation under way"), "{e}");
    }
    let busy = d.try_claim("v", "peer change").unwrap();
    let d2 = d.clone();
    let changing = tokio::spawn(async move { d2.set_policy("v", to_uncached()).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !changing.is_finished(),
        "the policy change waits for the claim"
    );
    drop(busy);
    let v = changing.await.unwrap().expect("the policy change failed");
    assert_eq!(v.policy, "uncached");

    let busy = d.try_claim("v", "vault record").unwrap();
    let d2 = d.clone();
    let moving = tokio::spawn(async move { relocate_to_other(&d2).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!moving.is_finished(), "the relocation waits for the claim");
    drop(busy);
    moving.await.unwrap();
}

/// The reopen of a volume that could not open can take as long as a slow NBD server makes
/// it; a delete (the way out of such a volume) waits for it beyond the short wait it gives
/// the other background claims, rather than fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_waits_out_a_slow_reopen() {
    let (_dir, _coord, d) = restarted_with_v("deletereopen").await;
    let busy = d.try_claim("v", "reopen").unwrap();
    let d2 = d.clone();
    let deleting = tokio::spawn(async move { d2.delete_volume("v", true).await });
    tokio::time::sleep(CLAIM_WAIT + Duration::from_millis(500)).await;
    assert!(!deleting.is_finished(), "the delete gave up on the reopen");
    drop(busy);
    deleting.await.unwrap().unwrap();
    assert!(d.entry("v").is_err());
}

/// A relocation to a `dir` datastore cut short leaves its copy there, tagged with the
/// volume's id: the retry knows it for what it is, removes it and completes (before, it
/// failed with "already exists" until the operator removed the file). A file of that name
/// not made for this volume is left alone and named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relocation_retried_after_a_crash_replaces_its_own_stale_copy_on_a_dir() {
    let (dir, _coord, d) = restarted_with_v("stalecopy").await;
    let v = volume(&d, "v");
    v.write(8192, Bytes::from(vec![6u8; 4096]), true)
        .await
        .unwrap();
    let spec = d.entry("v").unwrap().record.spec();
    let stale = dir.0.join("ds2").join("v.raw");

    // Someone else's file of that name: refused, and kept.
    std::fs::write(&stale, b"not a volume").unwrap();
    let e = try_relocate_to_other(&d).await.unwrap_err();
    assert!(e.to_string().contains("already exists"), "{e}");
    assert_eq!(std::fs::read(&stale).unwrap(), b"not a volume");
    std::fs::remove_file(&stale).unwrap();

    // What a crash in the middle of the copy leaves: the volume's own copy, half written.
    let copy = d
        .store("other")
        .unwrap()
        .create_volume(&spec)
        .await
        .unwrap();
    copy.write(8192, Bytes::from(vec![1u8; 4096]), true)
        .await
        .unwrap();
    drop(copy);
    relocate_to_other(&d).await;
    assert_eq!(d.entry("v").unwrap().record.datastore, "other");
    let got = volume(&d, "v").read(8192, 4096).await.unwrap();
    assert!(
        got.iter().all(|b| *b == 6),
        "the volume's data, not the stale copy's"
    );
}

/// A `dir` datastore added to a host that does not know its volumes (its state was lost)
/// brings them back, as a LUN does: its image files name their volumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dir_datastore_added_again_brings_its_volumes_back() {
    let dir = TempDir::new("dirimport");
    let coord = coordinator(&dir);
    let (id, _) = create_and_stop(&dir, &coord).await;
    {
        let d = start(&dir, &coord).await;
        volume(&d, "v")
            .write(4096, Bytes::from(vec![3u8; 4096]), true)
            .await
            .unwrap();
    }
    let fresh = TempDir::new("dirimport-host");
    let coord = coordinator(&fresh);
    let d = start(&fresh, &coord).await;
    assert!(d.entry("v").is_err(), "a new host knows no volume yet");
    d.add_datastore(add_request("old", Some(&dir.0.join("ds")), None))
        .await
        .unwrap();
    let e = d.entry("v").unwrap();
    assert_eq!((e.record.id, e.record.datastore.as_str()), (id, "old"));
    let got = volume(&d, "v").read(4096, 4096).await.unwrap();
    assert!(got.iter().all(|b| *b == 3));

    // A copy kept with its attributes is tagged alike: which file is the volume is unknown,
    // so neither becomes one (before, both did, two records with one id).
    let ds = dir.0.join("ds");
    let copied = std::process::Command::new("cp")
        .arg("--preserve=xattr")
        .arg(ds.join("v.raw"))
        .arg(ds.join("v-copy.raw"))
        .status()
        .unwrap();
    assert!(copied.success());
    let other = TempDir::new("dirimport-third");
    let coord = coordinator(&other);
    let d = start(&other, &coord).await;
    d.add_datastore(add_request("old", Some(&ds), None))
        .await
        .unwrap();
    assert!(d.entry("v").is_err() && d.entry("v-copy").is_err());
}

/// One directory under two datastore names is refused when added, and a relocation between
/// two such names (configured by hand) is refused: its stale-copy check would take the
/// volume's own image for a copy left behind and remove it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_directory_is_never_two_datastores() {
    let (dir, coord, d) = restarted_with_v("alias").await;
    let link = dir.0.join("ds-link");
    std::os::unix::fs::symlink(dir.0.join("ds"), &link).unwrap();
    let e = d
        .add_datastore(add_request("alias", Some(&link), None))
        .await
        .unwrap_err();
    assert!(
        e.to_string().contains("already datastore \"default\""),
        "{e}"
    );

    // The same, configured: "other" is made a second name of "default"'s directory.
    drop(d);
    std::fs::remove_dir_all(dir.0.join("ds2")).unwrap();
    std::os::unix::fs::symlink(dir.0.join("ds"), dir.0.join("ds2")).unwrap();
    let d = start(&dir, &coord).await;
    volume(&d, "v")
        .write(0, Bytes::from(vec![5u8; 4096]), true)
        .await
        .unwrap();
    let e = try_relocate_to_other(&d).await.unwrap_err();
    assert!(e.to_string().contains("are one directory"), "{e}");
    let got = volume(&d, "v").read(0, 4096).await.unwrap();
    assert!(got.iter().all(|b| *b == 5), "the volume is untouched");

    // One export mounted twice: two device numbers, one identity file. A directory holding
    // a copy of "default"'s identity file stands in for the second mount, here as a
    // configured datastore and as one being added.
    drop(d);
    std::fs::remove_file(dir.0.join("ds2")).unwrap();
    std::fs::create_dir(dir.0.join("ds2")).unwrap();
    let id = datastore::dir::IDENTITY_FILE;
    datastore::dir::identity(&dir.0.join("ds")).unwrap();
    std::fs::copy(dir.0.join("ds").join(id), dir.0.join("ds2").join(id)).unwrap();
    let mount = dir.0.join("ds-mount");
    std::fs::create_dir(&mount).unwrap();
    std::fs::copy(dir.0.join("ds").join(id), mount.join(id)).unwrap();
    let d = start(&dir, &coord).await;
    let e = try_relocate_to_other(&d).await.unwrap_err();
    assert!(e.to_string().contains("are one directory"), "{e}");
    let got = volume(&d, "v").read(0, 4096).await.unwrap();
    assert!(got.iter().all(|b| *b == 5), "the volume is untouched");
    let e = d
        .add_datastore(add_request("mount", Some(&mount), None))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("already datastore"), "{e}");
}

/// A `wb` volume whose cache device fails with every write destaged: its writes wait (reads
/// go on) while the round cannot record the new generation that lets it go on uncached; once
/// it can, the volume serves uncached, nothing lost, and the vault has a generation above
/// the cache's. If it never can, the writes stop waiting after `UNCACHED_TRIES` rounds and
/// fail, as with dirty data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_wb_volume_goes_on_uncached_once_the_round_records_its_generation() {
    for recorded in [true, false] {
        let dir = TempDir::new("clean-wb");
        let coord = coordinator(&dir);
        let file = cachelog::FileCache::open(&dir.0.join("cache.img"), 32 << 20).unwrap();
        let dev = Arc::new(cachelog::Faulty::new(file));
        let cache = CacheHost::open(dev.clone(), engine::cache::SEGMENT_DEFAULT).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        tokio::spawn(
            cache
                .clone()
                .run_destager(move || stopped.load(Ordering::SeqCst)),
        );
        let c: Arc<dyn Coordinator> = coord.clone();
        let d = Arc::new(Daemon::start(config(&dir), c, Some(cache)).await.unwrap());
        create_v(&d, "wb").await;
        let v = volume(&d, "v");
        assert!(writes(&v, Duration::from_secs(5)).await);
        let gen = v.cache().unwrap().gen();
        assert!(v.cache().unwrap().wait_clean(Duration::from_secs(10)).await);
        dev.fail();
        coord.fail_vault.store(true, Ordering::SeqCst);
        let waiting = {
            let v = v.clone();
            tokio::spawn(async move { v.write(8192, Bytes::from(vec![7u8; 4096]), false).await })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!waiting.is_finished(), "a write did not wait");
        assert!(v.stalled(), "the volume does not say its writes wait");
        let got = tokio::time::timeout(Duration::from_secs(5), v.read(0, 4096))
            .await
            .expect("a read waited")
            .unwrap();
        assert!(got.iter().all(|b| *b == 9));
        let id = v.id();
        crate::peers::uncached_with_nothing_lost(&d, "v", &v).await;
        assert!(
            v.stalled(),
            "the volume moved on without its generation recorded"
        );
        if recorded {
            coord.fail_vault.store(false, Ordering::SeqCst);
            crate::peers::uncached_with_nothing_lost(&d, "v", &v).await;
            assert_eq!(v.policy(), Policy::Uncached);
            // The waiting write goes on, uncached.
            tokio::time::timeout(Duration::from_secs(5), waiting)
                .await
                .expect("the write still waits")
                .unwrap()
                .unwrap();
            assert!(writes(&v, Duration::from_secs(5)).await);
            let vault = coord.vault(id).await.unwrap().unwrap();
            assert!(vault.gen > gen, "vault generation {} <= {gen}", vault.gen);
            assert_eq!(vault.policy, Policy::Uncached);
        } else {
            for _ in 1..crate::peers::UNCACHED_TRIES {
                crate::peers::uncached_with_nothing_lost(&d, "v", &v).await;
            }
            assert!(!v.stalled());
            let r = tokio::time::timeout(Duration::from_secs(5), waiting)
                .await
                .expect("the write still waits")
                .unwrap();
            assert!(r.is_err(), "a write completed in a failed cache");
            let w = v.write(0, Bytes::from(vec![9u8; 4096]), false);
            let r = tokio::time::timeout(Duration::from_secs(5), w)
                .await
                .expect("a write still waits");
            assert!(r.is_err(), "a write completed in a failed cache");
        }
        stop.store(true, Ordering::SeqCst);
    }
}

/// A vault lock taken to replay another host's volume that cannot be given back when the
/// replay ends would stay with this host's lease for as long as it runs, keeping every other
/// host from the volume: it is retried every round until it goes, and dropped (not given
/// back) once this host holds the lock for a reason of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replays_lock_that_could_not_be_given_back_is_retried() {
    let (_dir, coord, d) = restarted_with_v("owed").await;
    let other = other_hosts(&d, "other-hosts");
    coord.lock_vault(other.id).await.unwrap();
    coord.fail_unlocks.store(true, Ordering::SeqCst);
    crate::peers::give_lock_back(&d, other.id, &other.name).await;
    crate::peers::retry_owed_unlocks(&d).await;
    assert!(coord.unlocked.lock().unwrap().is_empty());
    coord.fail_unlocks.store(false, Ordering::SeqCst);
    crate::peers::retry_owed_unlocks(&d).await;
    assert_eq!(*coord.unlocked.lock().unwrap(), vec![other.id]);
    crate::peers::retry_owed_unlocks(&d).await;
    assert_eq!(coord.unlocked.lock().unwrap().len(), 1, "given back once");

    // One this host serves (it took the lock again meanwhile) is not given back.
    let own = d.entry("v").unwrap().record.clone();
    coord.fail_unlocks.store(true, Ordering::SeqCst);
    crate::peers::give_lock_back(&d, own.id, &own.name).await;
    coord.fail_unlocks.store(false, Ordering::SeqCst);
    crate::peers::retry_owed_unlocks(&d).await;
    crate::peers::retry_owed_unlocks(&d).await;
    assert_eq!(coord.unlocked.lock().unwrap().len(), 1);
}

/// A vault lock goes to another host only once every datastore write of this host that went
/// unanswered (its connection lost with it in flight) can have landed: the next holder's
/// writes of the volume must not be undone by it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vault_lock_goes_back_only_once_an_unanswered_write_can_have_landed() {
    let (_dir, coord, d) = restarted_with_v("late-write").await;
    let other = other_hosts(&d, "other-hosts");
    coord.lock_vault(other.id).await.unwrap();
    let (_, gate) = d.datastore_gates().pop().expect("a datastore");
    let lost = gate
        .run(datastore::stats::Op::Write, 4096, async {
            Err::<(), _>(std::io::Error::from(std::io::ErrorKind::ConnectionAborted))
        })
        .await;
    assert!(lost.is_err());
    let lost_at = std::time::Instant::now();
    crate::peers::give_lock_back(&d, other.id, &other.name).await;
    assert_eq!(unlocks_of(&coord, other.id), 1);
    assert!(
        lost_at.elapsed() >= datastore::LATE_WRITE_GRACE - Duration::from_millis(10),
        "the lock went back {:?} after the write went unanswered",
        lost_at.elapsed()
    );
    // With nothing unanswered lately, at once.
    coord.lock_vault(other.id).await.unwrap();
    let at = std::time::Instant::now();
    crate::peers::give_lock_back(&d, other.id, &other.name).await;
    assert_eq!(unlocks_of(&coord, other.id), 2);
    assert!(at.elapsed() < Duration::from_secs(1));
}

/// The record of another host's volume `name` (a new id), for a replay of it here.
fn other_hosts(d: &Daemon, name: &str) -> VolumeRecord {
    VolumeRecord {
        id: Uuid::new_v4(),
        name: name.into(),
        ..d.entry("v").unwrap().record.clone()
    }
}

/// Makes the unlock of `rec`'s vault lock owed: the give-back at the end of a replay fails.
async fn owe_unlock(coord: &FailingVault, d: &Daemon, rec: &VolumeRecord) {
    coord.fail_unlocks.store(true, Ordering::SeqCst);
    crate::peers::give_lock_back(d, rec.id, &rec.name).await;
    coord.fail_unlocks.store(false, Ordering::SeqCst);
}

/// A retry of the owed unlocks, held inside its first unlock until the guard is dropped.
async fn retry_in_flight<'a>(
    coord: &'a FailingVault,
    d: &Arc<Daemon>,
) -> (tokio::sync::MutexGuard<'a, ()>, tokio::task::JoinHandle<()>) {
    let held = coord.unlock_gate.lock().await;
    let before = coord.unlock_calls.load(Ordering::SeqCst);
    let retry = {
        let d = d.clone();
        tokio::spawn(async move { crate::peers::retry_owed_unlocks(&d).await })
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while coord.unlock_calls.load(Ordering::SeqCst) == before {
        assert!(
            std::time::Instant::now() < deadline,
            "the retry never unlocks"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    (held, retry)
}

/// A replay that begins while an unlock of its volume owed from an earlier replay is being
/// retried must wait for that retry: the retry looked before the replay began (no replay
/// ran), and would otherwise delete the lock the replay takes meanwhile (this host's lease,
/// so the replay adopts the owed lock), leaving another host free to write the datastore
/// beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_that_begins_while_its_owed_unlock_is_retried_keeps_its_lock() {
    let (_dir, coord, d) = restarted_with_v("owed-race").await;
    let other = other_hosts(&d, "other-hosts");
    coord.lock_vault(other.id).await.unwrap();
    owe_unlock(&coord, &d, &other).await;
    let (held, retry) = retry_in_flight(&coord, &d).await;
    // The retry's unlock is in flight; a replay of the volume begins.
    let claim = {
        let d = d.clone();
        tokio::spawn(async move { crate::peers::claim_replay(&d, other.id).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !claim.is_finished(),
        "a replay began while an unlock that looked before it was in flight"
    );
    drop(held);
    retry.await.unwrap();
    assert!(claim.await.unwrap(), "the replay is the only one");
    assert_eq!(*coord.unlocked.lock().unwrap(), vec![other.id]);
    crate::peers::replay_ended(&d, other.id);

    // Owed again, and a replay begins that ends before it takes the lock (its host's writes
    // were revoked, the coordinator did not answer): the unlock stays owed, untouched while
    // the replay runs, and is given back after it.
    owe_unlock(&coord, &d, &other).await;
    assert!(crate::peers::claim_replay(&d, other.id).await);
    crate::peers::retry_owed_unlocks(&d).await;
    assert_eq!(
        coord.unlocked.lock().unwrap().len(),
        1,
        "a replay's lock given back while it runs"
    );
    crate::peers::replay_ended(&d, other.id);
    crate::peers::retry_owed_unlocks(&d).await;
    assert_eq!(
        *coord.unlocked.lock().unwrap(),
        vec![other.id, other.id],
        "the owed unlock was forgotten"
    );
}

/// The same for a lock this host takes for a reason of its own (to serve, delete or recover
/// the volume): a retry of an owed unlock that looked before (the volume not served here yet)
/// must not delete it. The lock is then no longer owed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vault_lock_taken_while_its_owed_unlock_is_retried_is_kept() {
    let (_dir, coord, d) = restarted_with_v("owed-take").await;
    let other = other_hosts(&d, "replayed-here-once");
    let id = other.id;
    coord.lock_vault(id).await.unwrap();
    owe_unlock(&coord, &d, &other).await;
    let (held, retry) = retry_in_flight(&coord, &d).await;
    let take = {
        let d = d.clone();
        tokio::spawn(async move { crate::peers::take_vault_lock(&d, id).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !take.is_finished(),
        "the lock was taken while an unlock that looked before was in flight"
    );
    drop(held);
    retry.await.unwrap();
    take.await.unwrap().unwrap();
    assert_eq!(*coord.unlocked.lock().unwrap(), vec![id]);
    // Held for this host's own reason now: no retry gives it back.
    owe_unlock(&coord, &d, &other).await;
    crate::peers::take_vault_lock(&d, id).await.unwrap();
    crate::peers::retry_owed_unlocks(&d).await;
    assert_eq!(coord.unlocked.lock().unwrap().len(), 1, "owed no more");
}

/// How many times volume `id`'s vault lock went back to the coordinator.
fn unlocks_of(coord: &FailingVault, id: Uuid) -> usize {
    coord
        .unlocked
        .lock()
        .unwrap()
        .iter()
        .filter(|x| **x == id)
        .count()
}

/// A volume whose peers must replay it before it serves here gives its vault lock back when
/// it cannot open (no peer could replay while this host holds it). One the coordinator did
/// not take back is owed and retried, although the volume is listed here (not open), and so
/// is one a failed `accept-loss` took for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_waiting_for_its_peers_gives_its_lock_back_though_the_first_try_fails() {
    let dir = TempDir::new("owed-open");
    let coord = coordinator(&dir);
    let (id, gen) = create_and_stop(&dir, &coord).await;
    coord.put_vault(&old_vault(id, gen + 1)).await.unwrap();
    coord.fail_unlocks.store(true, Ordering::SeqCst);
    let d = start(&dir, &coord).await;
    let Err(e) = d.entry("v").unwrap().volume.clone() else {
        panic!("the volume must not serve here yet");
    };
    assert!(e.contains("waiting for its peer(s)"), "{e}");
    assert_eq!(unlocks_of(&coord, id), 0);
    coord.fail_unlocks.store(false, Ordering::SeqCst);
    crate::peers::retry_owed_unlocks(&d).await;
    assert_eq!(
        unlocks_of(&coord, id),
        1,
        "the open's unlock was not retried"
    );
    crate::peers::retry_owed_unlocks(&d).await;
    assert_eq!(unlocks_of(&coord, id), 1, "given back once");

    // accept-loss takes the lock, and its vault record fails: the lock goes back, or is owed.
    coord.fail_vault.store(true, Ordering::SeqCst);
    coord.fail_unlocks.store(true, Ordering::SeqCst);
    let e = crate::loss::accept(&d, &d.entry("v").unwrap(), false)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("nothing changed"), "{e}");
    coord.fail_vault.store(false, Ordering::SeqCst);
    coord.fail_unlocks.store(false, Ordering::SeqCst);
    crate::peers::retry_owed_unlocks(&d).await;
    assert_eq!(
        unlocks_of(&coord, id),
        2,
        "the failed accept-loss's unlock was not retried"
    );
}

/// A delete that finds the volume's record gone already (a create undone in part, a delete
/// whose answer was lost) gives back the vault lock it took: the record's removal that took
/// the lock with it was not this one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_that_finds_the_record_gone_gives_its_lock_back() {
    let (_dir, coord, d) = restarted_with_v("delete-gone").await;
    let id = d.entry("v").unwrap().record.id;
    coord.inner.delete_volume("v", id).await.unwrap();
    d.delete_volume("v", false).await.unwrap();
    assert_eq!(unlocks_of(&coord, id), 1);
}

/// A volume this host does not serve gives back the lock a failed delete took, and an unlock
/// owed for it is retried until it goes: one handed off to its peers (open here, but its
/// lock given up for them to replay), and one listed after its create failed (no volume
/// open behind it). One this host serves keeps its lock. A delete ends a hand-off: a new
/// volume of the same name does not inherit it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_given_up_for_a_volume_not_served_here_is_owed_until_it_goes() {
    let (_dir, coord, d) = restarted_with_v("owed-served").await;
    let entry = d.entry("v").unwrap();
    let id = entry.record.id;
    coord.fail_unlocks.store(true, Ordering::SeqCst);
    d.unlock_if_not_served(&entry).await;
    assert_eq!(
        coord.unlock_calls.load(Ordering::SeqCst),
        0,
        "a volume served here gave its lock up"
    );
    d.peers.mark_handed_off("v");
    d.unlock_if_not_served(&entry).await;
    coord.fail_unlocks.store(false, Ordering::SeqCst);
    crate::peers::retry_owed_unlocks(&d).await;
    assert_eq!(
        unlocks_of(&coord, id),
        1,
        "a handed-off volume kept its lock"
    );
    d.delete_volume("v", false).await.unwrap();
    assert!(
        !d.peers.handed_off("v"),
        "the deleted volume's hand-off goes on"
    );

    // A create that failed midway, listed for its delete.
    let dir = TempDir::new("owed-create");
    let coord = coordinator(&dir);
    let d = start(&dir, &coord).await;
    *coord.locked_by.lock().unwrap() = Some("b".into());
    coord.fail_deletes.store(true, Ordering::SeqCst);
    try_create_v(&d, "wt").await.unwrap_err();
    *coord.locked_by.lock().unwrap() = None;
    let entry = d.entry("v").unwrap();
    assert!(entry.volume.is_err());
    coord.fail_unlocks.store(true, Ordering::SeqCst);
    d.unlock_if_not_served(&entry).await;
    coord.fail_unlocks.store(false, Ordering::SeqCst);
    crate::peers::retry_owed_unlocks(&d).await;
    assert_eq!(
        unlocks_of(&coord, entry.record.id),
        1,
        "a failed create's entry counted as holding its lock"
    );
}

/// A delete whose storage cannot be freed puts the volume back as it was, destager included:
/// running if it ran, stopped if it was stopped (a volume handed off to its peers, whose
/// replay may be writing the datastore).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_delete_leaves_the_destager_as_it_found_it() {
    let (dir, _coord, d) = restarted_with_v("delete-destager").await;
    // The image made undeletable: a directory where the file was (the volume keeps its
    // descriptor of the file).
    let img = dir.0.join("ds/v.raw");
    std::fs::rename(&img, dir.0.join("ds/v.raw.kept")).unwrap();
    std::fs::create_dir(&img).unwrap();
    assert!(!volume(&d, "v").destaging_stopped());
    d.delete_volume("v", false).await.unwrap_err();
    assert!(
        !volume(&d, "v").destaging_stopped(),
        "a failed delete left the destager stopped"
    );
    volume(&d, "v").stop_destaging().await;
    d.peers.mark_handed_off("v");
    d.delete_volume("v", false).await.unwrap_err();
    assert!(
        volume(&d, "v").destaging_stopped(),
        "a failed delete restarted a handed-off volume's destager"
    );
}

/// A lock take whose answer was lost may have been granted: a delete of a volume this host
/// does not serve gives it back, as does a replay for a dead owner; a delete of one it
/// serves keeps it (the volume holds it already).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_take_that_answered_an_error_is_given_back_unless_served() {
    let (_dir, coord, d) = restarted_with_v("lost-take").await;
    let entry = d.entry("v").unwrap();
    let id = entry.record.id;
    coord.lose_lock_answers.store(true, Ordering::SeqCst);
    let e = d.delete_volume("v", false).await.unwrap_err();
    assert!(e.to_string().contains("take the vault lock"), "{e}");
    assert_eq!(
        unlocks_of(&coord, id),
        0,
        "a served volume gave its lock up"
    );
    d.peers.mark_handed_off("v");
    d.delete_volume("v", false).await.unwrap_err();
    assert_eq!(
        unlocks_of(&coord, id),
        1,
        "a handed-off volume kept a lock a failed take may have granted"
    );
    // A replay for a dead owner whose take answered an error.
    let other = other_hosts(&d, "other-hosts");
    assert!(crate::peers::claim_replay(&d, other.id).await);
    crate::peers::replay_for_dead_owner(&d, &other)
        .await
        .unwrap_err();
    crate::peers::replay_ended(&d, other.id);
    assert_eq!(unlocks_of(&coord, other.id), 1, "the replay kept the lock");
    // A surrogate replay (from a dead host's cache file) whose take answered an error.
    let lost = other_hosts(&d, "surrogate-hosts");
    let file = CacheHost::open(
        Arc::new(cachelog::device::SimDevice::new(16 << 20)),
        engine::cache::SEGMENT_DEFAULT,
    )
    .unwrap();
    let e = crate::peers::surrogate_one(&d, &file, &lost, 1, false)
        .await
        .unwrap_err();
    assert!(e.contains("lost"), "{e}");
    assert_eq!(
        unlocks_of(&coord, lost.id),
        1,
        "the surrogate replay kept the lock"
    );
}

/// With the coordinator not answering, a round of retries tries one owed unlock, not each
/// in turn: every try holds the gate that locks taken for replays, creates and deletes wait
/// behind, for as long as the coordinator takes to fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owed_unlocks_stop_at_the_first_failure_of_a_round() {
    let (_dir, coord, d) = restarted_with_v("owed-down").await;
    let others: Vec<VolumeRecord> = (0..3)
        .map(|i| other_hosts(&d, &format!("other-{i}")))
        .collect();
    for o in &others {
        owe_unlock(&coord, &d, o).await;
    }
    coord.fail_unlocks.store(true, Ordering::SeqCst);
    let before = coord.unlock_calls.load(Ordering::SeqCst);
    crate::peers::retry_owed_unlocks(&d).await;
    assert_eq!(coord.unlock_calls.load(Ordering::SeqCst) - before, 1);
    coord.fail_unlocks.store(false, Ordering::SeqCst);
    crate::peers::retry_owed_unlocks(&d).await;
    for o in &others {
        assert_eq!(unlocks_of(&coord, o.id), 1, "{} not given back", o.name);
    }
}

/// A `dir` datastore's free space is not free for placement where sparse images already in
/// it, or in another datastore's directory on the same file system, may take it as they are
/// written: here an image no volume of the pod owns (another tool's, another pod's), which
/// the pod's own sizes do not cover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn space_sparse_images_may_still_take_is_not_free_for_placement() {
    async fn used_gib(d: &Daemon, ds: &str) -> f64 {
        let inputs = crate::balancing::inputs(d).await;
        let p = inputs.pod.datastores.iter().find(|x| x.id == ds).unwrap();
        p.used_gib
    }
    let dir = TempDir::new("sparse");
    let coord = coordinator(&dir);
    let d = start(&dir, &coord).await;
    let before = used_gib(&d, "default").await;
    let f = std::fs::File::create(dir.0.join("ds/other-tool.raw")).unwrap();
    f.set_len(16 << 30).unwrap();
    let after = used_gib(&d, "default").await;
    assert!(
        after - before > 15.0,
        "used {before:.2} GiB, then {after:.2} GiB with a 16 GiB sparse image"
    );
    // The other datastore is another directory on the same file system: the image may take
    // its free space too.
    assert!(used_gib(&d, "other").await > before + 15.0);
}

/// The planner's no-ping-pong rule outlives the host that moved the volume: the move is in
/// the volume's record, which every host reads, and it counts for a day.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relocation_counts_as_recent_after_a_restart_and_for_a_day() {
    let (dir, coord, d) = restarted_with_v("recent").await;
    assert!(d.recent_moves().await.is_empty());
    relocate_to_other(&d).await;
    drop(d);
    let d = start(&dir, &coord).await;
    let recent = d.recent_moves().await;
    assert_eq!(
        recent,
        vec![balance::RecentMove {
            workload: "v".into(),
            from: "default".into()
        }]
    );
    let rec = d.entry("v").unwrap().record.clone();
    let at = rec.moved.as_ref().unwrap().unix;
    assert_eq!(
        recent_moves_at(std::slice::from_ref(&rec), at + RECENT_MOVE_S - 1),
        recent
    );
    assert!(recent_moves_at(&[rec], at + RECENT_MOVE_S).is_empty());
}

/// A LUN named twice in the config (two paths to one device, as multipath gives) is not
/// added under the second name: two names would mean two locks on one volume table, and two
/// hosts creating volumes at once under each could give them one extent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_lun_is_never_two_configured_datastores() {
    let dir = TempDir::new("lun-alias");
    let img = dir.0.join("lun.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    let link = dir.0.join("lun-by-path.img");
    std::os::unix::fs::symlink(&img, &link).unwrap();
    let conf = |luns: &[(&str, &PathBuf)]| {
        let mut text = format!("data_dir = \"{}\"\n", dir.0.display());
        for (name, target) in luns {
            text += &format!(
                "[[datastore]]\nname = \"{name}\"\nkind = \"lun\"\ntarget = \"{}\"\nforce = true\n",
                target.display()
            );
        }
        Config::parse(&text).unwrap()
    };
    let coord = coordinator(&dir);
    let c: Arc<dyn Coordinator> = coord.clone();
    let d = Daemon::start(conf(&[("san", &img)]), c.clone(), None)
        .await
        .unwrap();
    drop(d);
    let e = Daemon::start(conf(&[("san", &img), ("san2", &link)]), c, None)
        .await
        .err()
        .expect("the second name was added");
    assert!(
        e.to_string().contains("is the LUN of datastore \"san\""),
        "{e}"
    );
    let names: Vec<String> = coord
        .state()
        .await
        .unwrap()
        .datastores
        .into_iter()
        .map(|s| s.name)
        .collect();
    assert_eq!(names, vec!["san".to_string()]);
}

/// A datastore's metadata lock granted after the lease it was asked under was lost (the host
/// registered again meanwhile, so its fence is open) is no lock: another host may hold it.
/// Nothing is created under it. A lock asked for under the new lease is used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_datastore_lock_granted_across_a_lost_lease_is_not_used() {
    let dir = TempDir::new("lock-lease");
    let coord = coordinator(&dir);
    let d = start(&dir, &coord).await;
    coord.lease_lost_in_lock_wait.store(true, Ordering::SeqCst);
    let create = || try_create_v(&d, "uncached");
    let e = create().await.unwrap_err();
    assert!(e.to_string().contains("lease was lost"), "{e}");
    assert!(d.entry("v").is_err());
    assert!(
        !dir.0.join("ds/v.raw").exists(),
        "the volume's storage was made"
    );
    coord.lease_lost_in_lock_wait.store(false, Ordering::SeqCst);
    coord
        .lease_renewed_before_lock
        .store(true, Ordering::SeqCst);
    create()
        .await
        .expect("a lock granted under the lease the host holds now was refused");
    assert!(dir.0.join("ds/v.raw").exists());
}

/// Peers that have all failed, as a `wbp` volume's peers are once their links broke.
struct BrokenPeers;

impl engine::replica::Replicator for BrokenPeers {
    fn write(
        &self,
        _: engine::replica::ReplicaWrite,
    ) -> engine::replica::BoxFuture<Result<(), String>> {
        Box::pin(async { Err("link broken".into()) })
    }
    fn flush(&self) -> engine::replica::BoxFuture<Result<(), String>> {
        Box::pin(async { Err("link broken".into()) })
    }
    fn checkpoint(&self, _: u64, _: u64) {}
    fn exclude_failed(&self) -> engine::replica::BoxFuture<Result<(), String>> {
        Box::pin(async { Err("the vault cannot be written".into()) })
    }
    fn hand_off(&self) -> engine::replica::BoxFuture<Result<(), String>> {
        Box::pin(async { Err("the vault cannot be written".into()) })
    }
    fn healthy(&self) -> bool {
        false
    }
    fn report(&self) -> Vec<engine::replica::PeerReport> {
        Vec::new()
    }
}

/// A `wbp` volume whose peers failed, with none to replace them, falls back to `wt`. Each
/// try drains it and pauses its IO, so one that failed is not tried again every round, but
/// after a wait; and once the cause is gone, a try after that wait succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_fall_back_from_broken_peers_waits_before_it_is_tried_again() {
    let dir = TempDir::new("fallback-retry");
    let coord = coordinator(&dir);
    let d = start(&dir, &coord).await;
    create_v(&d, "wb").await;
    let v = volume(&d, "v");
    let wbp = Policy::Wbp {
        peers: 1,
        rule: cluster::PeerRule::Any,
    };
    v.set_policy_with(wbp, Some(Arc::new(BrokenPeers)), None)
        .await
        .unwrap();
    *d.entry("v").unwrap().wanted.lock().unwrap() = wbp;
    let round = || async {
        for t in crate::peers::keep_replicated(&d) {
            t.await.unwrap();
        }
    };

    // The fall-back fails: its vault record cannot be read.
    crate::peers::forget_vault_writer(&d, v.id()).await;
    coord.fail_vault_reads.store(true, Ordering::SeqCst);
    round().await;
    let tried = coord.vault_reads.load(Ordering::SeqCst);
    assert!(tried > 0, "the round did not try to fall back to wt");
    assert_eq!(v.policy(), wbp, "fell back without its vault");
    assert!(v.cache().unwrap().has_peers());
    // The next rounds, a second later and at once: nothing tried, though the vault can be
    // read again.
    coord.fail_vault_reads.store(false, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(1)).await;
    round().await;
    round().await;
    assert_eq!(
        coord.vault_reads.load(Ordering::SeqCst),
        tried,
        "a failed fall-back was tried again at once"
    );
    assert_eq!(v.policy(), wbp);
    // After the wait it is tried, and goes through.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    round().await;
    assert_eq!(v.policy(), Policy::Wt, "not tried again after the wait");
    assert!(!v.cache().unwrap().has_peers());
    let vault = coord.vault(v.id()).await.unwrap().unwrap();
    assert_eq!(vault.policy, Policy::Wt);
    assert!(vault.peers.is_empty());
}

/// A copy that a relocation cut short by a crash left on another datastore (one the record
/// never switched to) is freed at the next start, and the volume goes on serving from where
/// its record says. A copy left while the daemon runs goes with the volume's delete: no later
/// start imports it as a volume of its own, a deleted volume coming back with old data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_left_by_interrupted_relocations_are_freed_and_never_come_back() {
    let dir = TempDir::new("leftover");
    let coord = coordinator(&dir);
    let d = start(&dir, &coord).await;
    create_v(&d, "wt").await;
    let v = volume(&d, "v");
    assert!(writes(&v, Duration::from_secs(5)).await);
    d.flush_all().await;
    let rec = d.entry("v").unwrap().record.clone();
    let copy = dir.0.join("ds2/v.raw");
    let leave_copy = |d: &Daemon| {
        let other = d.store("other").unwrap();
        let spec = rec.spec();
        async move { other.create_volume(&spec).await.unwrap() }
    };
    leave_copy(&d).await;
    assert!(copy.exists());
    drop(v);
    drop(d);

    // While the volume cannot open from its own datastore, the copy may be the only one
    // anyone can read: it is kept.
    let (own, away) = (dir.0.join("ds/v.raw"), dir.0.join("v.raw.away"));
    std::fs::rename(&own, &away).unwrap();
    let d = start(&dir, &coord).await;
    assert!(d.entry("v").unwrap().volume.is_err());
    assert!(
        copy.exists(),
        "a copy was freed while the volume could not open"
    );
    drop(d);
    std::fs::rename(&away, &own).unwrap();

    let d = start(&dir, &coord).await;
    assert!(
        !copy.exists(),
        "the copy a relocation left survived a start"
    );
    let v = volume(&d, "v");
    let got = v.read(0, 4096).await.unwrap();
    assert!(got.iter().all(|b| *b == 9), "the volume lost its data");
    drop(v);

    leave_copy(&d).await;
    d.delete_volume("v", false).await.unwrap();
    assert!(!copy.exists(), "the delete left the copy");
    drop(d);
    let d = start(&dir, &coord).await;
    assert!(d.entry("v").is_err(), "a deleted volume came back");
}

/// A volume deleted with `--force` while its datastore was unavailable leaves its storage
/// there. When the datastore is back (found by the retry of what was unavailable, or at a
/// start), that storage is freed: the delete ends, and the deleted volume does not come back
/// as a create cut short (before, the next start imported it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_deleted_while_its_datastore_was_down_is_freed_when_it_is_back() {
    let dir = TempDir::new("deleted-away");
    let coord = coordinator(&dir);
    create_and_stop(&dir, &coord).await;
    let (ds, away) = (dir.0.join("ds"), dir.0.join("ds.away"));
    std::fs::rename(&ds, &away).unwrap();
    let d = start(&dir, &coord).await;
    assert!(
        d.entry("v").unwrap().volume.is_err(),
        "opened without its datastore"
    );
    d.delete_volume("v", true).await.unwrap();
    std::fs::rename(&away, &ds).unwrap();
    assert!(ds.join("v.raw").exists());
    // The datastore is back: the retry of what was unavailable frees it, no restart needed.
    d.retry_unavailable().await;
    assert!(d.entry("v").is_err(), "the deleted volume came back");
    assert!(!ds.join("v.raw").exists(), "its storage was not freed");
    drop(d);
    let d = start(&dir, &coord).await;
    assert!(
        d.entry("v").is_err(),
        "the deleted volume came back at a restart"
    );
    // A volume created again under the name is a new one.
    create_v(&d, "wt").await;
    assert!(writes(&volume(&d, "v"), Duration::from_secs(5)).await);
}

/// A create whose record another host made first, for the storage this one had just made (it
/// imported it as a create cut short while this host's lease had lapsed), leaves that host's
/// record and storage alone. Before, the read-back went by id alone, took the record for its
/// own, and could then remove it and free the storage under the other host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_whose_storage_another_host_recorded_leaves_it_to_that_host() {
    let dir = TempDir::new("create-taken");
    let coord = coordinator(&dir);
    let d = start(&dir, &coord).await;
    coord.creates_taken_by_b.store(true, Ordering::SeqCst);
    let e = try_create_v(&d, "wt").await.unwrap_err();
    assert!(
        e.to_string().contains("host b recorded that storage"),
        "{e}"
    );
    assert!(d.entry("v").is_err(), "served here");
    assert!(dir.0.join("ds/v.raw").exists(), "b's storage was freed");
    let recs = coord.state().await.unwrap().volumes;
    assert!(
        recs.iter()
            .any(|r| r.name == "v" && r.owner.as_deref() == Some("b")),
        "b's record was removed: {recs:?}"
    );
}

/// A create whose record was made but whose answer was lost goes on: the volume serves, and
/// its storage is not freed under the record that names it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_whose_recording_lost_its_answer_goes_on() {
    let dir = TempDir::new("create-lost");
    let coord = coordinator(&dir);
    let d = start(&dir, &coord).await;
    coord.lose_create_answers.store(true, Ordering::SeqCst);
    create_v(&d, "wt").await;
    coord.lose_create_answers.store(false, Ordering::SeqCst);
    assert!(dir.0.join("ds/v.raw").exists(), "the storage was freed");
    assert!(writes(&volume(&d, "v"), Duration::from_secs(5)).await);
    let recorded = coord.state().await.unwrap().volumes;
    assert!(recorded.iter().any(|r| r.name == "v"));
}

/// A create that fails after its record was made, and whose record then cannot be removed,
/// keeps its storage and lists the volume here, so that a delete on this host removes both.
/// Before, the storage was freed and nothing here answered for the record: a delete said
/// "served by host local; run the command against that host", and a create "already exists".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_undone_only_in_part_can_be_deleted() {
    let dir = TempDir::new("create-undo");
    let coord = coordinator(&dir);
    let d = start(&dir, &coord).await;
    *coord.locked_by.lock().unwrap() = Some("b".into());
    coord.fail_deletes.store(true, Ordering::SeqCst);
    let e = try_create_v(&d, "wt").await.unwrap_err();
    assert!(e.to_string().contains("held by host"), "{e}");
    *coord.locked_by.lock().unwrap() = None;
    coord.fail_deletes.store(false, Ordering::SeqCst);
    assert!(
        dir.0.join("ds/v.raw").exists(),
        "storage freed under a record"
    );
    // A create that returned an error does not become a volume in service by itself.
    tokio::time::timeout(Duration::from_secs(10), d.retry_unavailable())
        .await
        .unwrap();
    assert!(
        d.entry("v").unwrap().volume.is_err(),
        "the retry of unopened volumes opened a create that failed"
    );
    d.delete_volume("v", false)
        .await
        .expect("the half-undone create cannot be deleted");
    assert!(!dir.0.join("ds/v.raw").exists());
    assert!(coord.state().await.unwrap().volumes.is_empty());
    create_v(&d, "wt").await;
}

/// One directory configured under two datastore names (renamed in the config, or listed
/// twice): each volume's image is listed by both, and the start-up sweep for copies left by
/// relocations must not take the volume's own image, seen under the other name, for one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directory_under_two_datastore_names_keeps_its_images() {
    let dir = TempDir::new("alias");
    let coord = coordinator(&dir);
    let conf = || {
        Config::parse(&format!(
            "data_dir = \"{0}\"\n[[datastore]]\nname = \"default\"\nkind = \"dir\"\n\
             path = \"{0}/ds\"\n[[datastore]]\nname = \"alias\"\nkind = \"dir\"\n\
             path = \"{0}/ds\"\n",
            dir.0.display()
        ))
        .unwrap()
    };
    let open = || async {
        let dev = cachelog::FileCache::open(&dir.0.join("cache.img"), 32 << 20).unwrap();
        let cache = CacheHost::open(Arc::new(dev), engine::cache::SEGMENT_DEFAULT).unwrap();
        let c: Arc<dyn Coordinator> = coord.clone();
        Arc::new(Daemon::start(conf(), c, Some(cache)).await.unwrap())
    };
    let d = open().await;
    create_v(&d, "wt").await;
    assert!(writes(&volume(&d, "v"), Duration::from_secs(5)).await);
    d.flush_all().await;
    drop(d);
    let d = open().await;
    assert!(
        dir.0.join("ds/v.raw").exists(),
        "the volume's own image was freed as a leftover copy"
    );
    let got = volume(&d, "v").read(0, 4096).await.unwrap();
    assert!(got.iter().all(|b| *b == 9));
}

/// A new directory on the disk the repository is on, for tests of what the page cache holds
/// (tmpfs keeps every page in memory); the test removes it.
fn on_disk(tag: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../target/test-tmp")
        .join(format!("vestad-{tag}-{}", Uuid::new_v4()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Whether the page cache holds the 4 KiB of `file` at `offset` (4 KiB-aligned), asked with
/// `mincore`, which reads nothing. (A `RWF_NOWAIT` read, as this asked before, starts a
/// readahead of the range when the page is not there, and on a loaded machine could find that
/// readahead done and answer yes.)
fn in_page_cache(file: &Path, offset: u64) -> bool {
    use std::os::fd::AsRawFd as _;
    let f = std::fs::File::open(file).unwrap();
    // SAFETY: a shared read-only mapping of one page of an open file, never dereferenced;
    // mincore writes one byte to `vec`; the mapping is removed before `f` closes.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            offset as libc::off_t,
        );
        assert_ne!(p, libc::MAP_FAILED, "{}", std::io::Error::last_os_error());
        let mut vec = 0u8;
        let r = libc::mincore(p, 4096, &mut vec);
        libc::munmap(p, 4096);
        assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
        vec & 1 == 1
    }
}

/// `vesta datastore add --direct`: the datastore is read and written with `O_DIRECT`, so this
/// host keeps no copy of it in its page cache that another host's writes would leave stale
/// (and that could be written back past the fence), also once the daemon restarts; an NBD
/// datastore, which every host reaches through one server, refuses it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_datastore_added_direct_keeps_none_of_it_in_the_page_cache() {
    let dir = TempDir::new("direct");
    let shared = on_disk("direct");
    let coord = coordinator(&dir);
    let data = Bytes::from((0..8192u32).map(|i| (i % 241) as u8).collect::<Vec<_>>());
    for round in 0..2 {
        let d = start(&dir, &coord).await;
        if round == 0 {
            let nbd = api::AddDatastore {
                direct: true,
                ..add_request("nbd", None, None)
            };
            let nbd = api::AddDatastore {
                lun: Some("nbd://127.0.0.1:1/x".into()),
                ..nbd
            };
            let e = d.add_datastore(nbd).await.unwrap_err();
            assert!(matches!(e, OpError::BadRequest(_)), "{e}");
            assert!(e.to_string().contains("NBD"), "{e}");
            let info = d
                .add_datastore(api::AddDatastore {
                    direct: true,
                    ..add_request("shared", Some(&shared), None)
                })
                .await
                .unwrap();
            assert!(info.direct);
            d.create_volume(api::CreateVolume {
                name: "v".into(),
                size: 1 << 20,
                datastore: Some("shared".into()),
                policy: Some("uncached".into()),
                hold_s: None,
                max_dirty_age_s: None,
                rpo_s: None,
            })
            .await
            .unwrap();
        }
        let info = d.datastore_infos().await;
        let info = info.iter().find(|i| i.name == "shared").unwrap();
        assert!(info.direct, "round {round}: {info:?}");
        // A buffered write would leave its pages in the page cache; these leave none.
        let at = 65536 * (round + 1);
        let v = volume(&d, "v");
        v.write(at, data.clone(), false).await.unwrap();
        assert_eq!(v.read(at, 8192).await.unwrap(), data);
        let image = shared.join("v.raw");
        assert!(
            !in_page_cache(&image, at),
            "round {round}: the write is in the page cache"
        );
        // What the next host reads from the file itself.
        let mut back = vec![0u8; 8192];
        std::os::unix::fs::FileExt::read_exact_at(
            &std::fs::File::open(&image).unwrap(),
            &mut back,
            at,
        )
        .unwrap();
        assert_eq!(back, data);
        drop(v);
        d.flush_all().await;
    }
    std::fs::remove_dir_all(&shared).unwrap();
}

/// `direct = true` in the config of a datastore added before without it takes effect at the
/// next start, as its class and queue depth do: before, the stored spec won and the
/// datastore went on through the page cache, the config saying otherwise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configured_datastore_follows_the_configs_direct() {
    let dir = TempDir::new("direct-config");
    let shared = on_disk("direct-config");
    let coord = coordinator(&dir);
    let image = shared.join("v.raw");
    for direct in [false, true] {
        let config = Config::parse(&format!(
            "data_dir = \"{}\"\n[[datastore]]\nname = \"default\"\nkind = \"dir\"\n\
             path = \"{}\"\ndirect = {direct}\n",
            dir.0.display(),
            shared.display()
        ))
        .unwrap();
        let dev = cachelog::FileCache::open(&dir.0.join("cache.img"), 32 << 20).unwrap();
        let cache = CacheHost::open(Arc::new(dev), engine::cache::SEGMENT_DEFAULT).unwrap();
        let c: Arc<dyn Coordinator> = coord.clone();
        let d = Daemon::start(config, c, Some(cache)).await.unwrap();
        if !direct {
            create_v(&d, "uncached").await;
        }
        let info = d.datastore_infos().await;
        assert_eq!(info[0].direct, direct);
        let at = if direct { 65536 } else { 0 };
        volume(&d, "v")
            .write(at, Bytes::from(vec![7u8; 4096]), false)
            .await
            .unwrap();
        assert_eq!(in_page_cache(&image, at), !direct, "direct = {direct}");
        d.flush_all().await;
    }
    std::fs::remove_dir_all(&shared).unwrap();
}
