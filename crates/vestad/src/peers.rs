//! `wbp` in the daemon (DESIGN §4, FVP §7): this host as a peer of others (the [`PeerService`]
//! behind the peer listener), as the owner of `wbp` volumes (a [`PeerSet`] per volume, and
//! [`establish`] to pick peers and enter `wbp`), and the once-a-second round ([`run`]) that
//! keeps `wbp` volumes replicated and replays the volumes of owners that died.
//!
//! Who may replay what is decided by the vault record alone: a peer replays a volume only
//! while holding its vault lock, only if the vault lists it as a peer of the generation its
//! replicas are of, and only after the vault's holder is gone. An owner that loses a peer
//! takes it out of the vault before anything the peer lacks can complete or reach the
//! datastore ([`engine::replica::Replicator`]); every switch of the volume starts a new
//! generation and writes it to the vault first. So a peer never replays an old prefix over
//! newer data.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::{Duration, Instant};

use tracing::{info, warn};
use uuid::Uuid;

use cluster::{Coordinator, Policy, Vault, VolumeRecord};
use engine::cache::{CacheHost, ReplicaRefusal};
use engine::replica::{BoxFuture, PeerReport, ReplicaWrite, Replicator};
use engine::Volume;
use peer::{Link, PeerError, Refusal, WriteMsg};

use crate::daemon::Daemon;

/// How often `wbp` volumes are checked and replicas looked after.
const ROUND: Duration = Duration::from_secs(1);
/// A peer that failed is not chosen again for this long.
const FAILED_PEER_REST: Duration = Duration::from_secs(30);
/// The vault's checkpoint is rewritten at most this often per volume (DESIGN §11).
const VAULT_CHECKPOINT_EVERY: Duration = Duration::from_secs(1);
/// How long after handing a volume off, and then between tries, its owner asks the peers
/// the vault names whether any of them still holds the volume ([`handed_to_nobody`]).
const HANDOFF_ASK_EVERY: Duration = Duration::from_secs(5);
/// The first wait after a peer change that failed to take a volume out of its failed peers
/// ([`keep_replicated`]); it doubles with each failure up to [`CHANGE_RETRY_MAX`].
const CHANGE_RETRY_FIRST: Duration = Duration::from_secs(2);
const CHANGE_RETRY_MAX: Duration = Duration::from_secs(60);

/// When a volume's next peer change may run, after changes that failed. Pure: the caller
/// says what time it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Backoff {
    next: Instant,
    wait: Duration,
}

impl Backoff {
    /// The wait after one more failure at `now`, following `prev` (None: the first). A
    /// failure long after the last one was due starts again from the first wait.
    fn after_failure(prev: Option<Backoff>, now: Instant) -> Backoff {
        let prev = prev.filter(|b| now < b.next + CHANGE_RETRY_MAX);
        let wait = prev.map_or(CHANGE_RETRY_FIRST, |b| (b.wait * 2).min(CHANGE_RETRY_MAX));
        Backoff {
            next: now + wait,
            wait,
        }
    }

    fn due(&self, now: Instant) -> bool {
        now >= self.next
    }
}

/// This host as a peer: what other hosts send goes into the cache log.
pub struct PeerService {
    pub host: String,
    pub cache: Arc<CacheHost>,
}

fn refusal(r: ReplicaRefusal) -> Refusal {
    match r {
        ReplicaRefusal::Failed(m) => Refusal::Failed(m),
        ReplicaRefusal::Stale(m) => Refusal::Stale(m),
        ReplicaRefusal::Absent(m) => Refusal::Absent(m),
    }
}

impl peer::Sink for PeerService {
    fn host(&self) -> String {
        self.host.clone()
    }
    fn open(&self, from: &str, volume: Uuid, gen: u64, checkpoint: u64) -> Result<(), Refusal> {
        info!("replicating volume {volume} for host {from} (generation {gen}, from write {checkpoint})");
        self.cache
            .replica_open(from, volume, gen, checkpoint)
            .map_err(refusal)
    }
    fn write(&self, _from: &str, w: WriteMsg) -> Result<(), Refusal> {
        self.cache
            .replica_write(
                w.volume,
                w.gen,
                w.ser,
                w.offset,
                w.len,
                w.data.as_deref(),
                w.alloc,
            )
            .map_err(refusal)
    }
    fn write_at_once(&self, _from: &str, w: &WriteMsg) -> Option<Result<(), Refusal>> {
        match self.cache.replica_write_at_once(
            w.volume,
            w.gen,
            w.ser,
            w.offset,
            w.len,
            w.data.as_deref(),
            w.alloc,
        ) {
            Ok(true) => Some(Ok(())),
            Ok(false) => None,
            Err(e) => Some(Err(refusal(e))),
        }
    }
    fn flush(&self) -> Result<(), Refusal> {
        self.cache.replica_sync().map_err(refusal)
    }
    fn checkpoint(&self, volume: Uuid, gen: u64, ser: u64, window_end: u64) -> Result<(), Refusal> {
        self.cache
            .replica_window(volume, gen, ser, window_end)
            .map_err(refusal)
    }
    fn drop_replicas(&self, volume: Uuid, gen: u64) -> Result<(), Refusal> {
        self.cache.replica_drop(volume, gen).map_err(refusal)
    }
    fn held(&self, volume: Uuid, gen: u64, from: u64) -> Result<peer::Holding, Refusal> {
        // The asker replays from what this answers: no later checkpoint may move this host
        // past it, and no later write of the generation may be taken (and so complete).
        self.cache.replica_hold(volume, gen);
        let upto = self
            .cache
            .replica_held(volume, gen, from)
            .map_err(refusal)?;
        let checkpoint = self
            .cache
            .replica_sets()
            .into_iter()
            .find(|s| s.volume == volume && s.gen == gen)
            .map_or(0, |s| s.checkpoint);
        Ok(peer::Holding { upto, checkpoint })
    }
}

/// Polls every future to its end, concurrently (a volume has a handful of peers).
async fn join_all<T>(mut futs: Vec<BoxFuture<T>>) -> Vec<T> {
    let mut out: Vec<Option<T>> = futs.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, o) in futs.iter_mut().zip(out.iter_mut()) {
            if o.is_none() {
                match f.as_mut().poll(cx) {
                    Poll::Ready(v) => *o = Some(v),
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await;
    out.into_iter()
        .map(|o| o.expect("polled to the end"))
        .collect()
}

/// The one writer of a volume's vault on this host (its owner): every change (a switch, a
/// peer taken out, a checkpoint) goes through its lock and applies to the newest record, so
/// a late update from an earlier peer set can neither put back an excluded peer nor an old
/// generation.
pub struct VaultWriter {
    coord: Arc<dyn Coordinator>,
    vault: tokio::sync::Mutex<(Vault, Instant)>,
    /// Set when the writer is forgotten ([`forget_vault_writer`]): its copy of the record
    /// may be stale, so whoever still has it (a peer set's checkpoint task) writes nothing
    /// more. Read under the lock.
    retired: std::sync::atomic::AtomicBool,
}

impl VaultWriter {
    /// The lock on the record, if the writer may still write.
    async fn lock(&self) -> Result<tokio::sync::MutexGuard<'_, (Vault, Instant)>, String> {
        let g = self.vault.lock().await;
        if self.retired.load(Ordering::SeqCst) {
            return Err("this host's copy of the vault record is stale".into());
        }
        Ok(g)
    }

    async fn update(&self, f: impl FnOnce(&mut Vault)) -> Result<(), String> {
        let mut g = self.lock().await?;
        let mut v = g.0.clone();
        f(&mut v);
        if v == g.0 {
            return Ok(());
        }
        self.coord.put_vault(&v).await.map_err(|e| e.to_string())?;
        *g = (v, Instant::now());
        Ok(())
    }

    /// Writes `v` whole, carrying `previous_owner` over and never lowering the generation.
    pub async fn replace(&self, v: Vault) -> Result<(), String> {
        self.replace_with(|_| v).await
    }

    /// [`VaultWriter::replace`] with the record `f` makes of the current one.
    pub async fn replace_with(&self, f: impl FnOnce(&Vault) -> Vault) -> Result<(), String> {
        let mut g = self.lock().await?;
        let cur = &g.0;
        let mut v = f(cur);
        v.gen = v.gen.max(cur.gen);
        if cur.owner != v.owner && !cur.owner.is_empty() {
            v.previous_owner = Some(cur.owner.clone());
        } else if v.previous_owner.is_none() {
            v.previous_owner = cur.previous_owner.clone();
        }
        if v == g.0 {
            return Ok(());
        }
        self.coord.put_vault(&v).await.map_err(|e| e.to_string())?;
        *g = (v, Instant::now());
        Ok(())
    }
}

/// This host's vault writer for `volume`, created from the record in the coordinator.
pub async fn vault_writer(d: &Daemon, volume: Uuid) -> Result<Arc<VaultWriter>, String> {
    if let Some(w) = d.peers.writers.lock().expect("lock").get(&volume) {
        return Ok(w.clone());
    }
    let cur = d
        .coord
        .vault(volume)
        .await
        .map_err(|e| format!("read vault record: {e}"))?
        .unwrap_or(Vault {
            volume,
            policy: Policy::Uncached,
            checkpoint: 0,
            gen: 0,
            owner: String::new(),
            peers: Vec::new(),
            previous_owner: None,
            handoff: false,
        });
    let w = Arc::new(VaultWriter {
        coord: d.coord.clone(),
        vault: tokio::sync::Mutex::new((cur, Instant::now())),
        retired: Default::default(),
    });
    Ok(d.peers
        .writers
        .lock()
        .expect("lock")
        .entry(volume)
        .or_insert(w)
        .clone())
}

/// Forgets the vault writer of a volume this host no longer holds the lock of (or whose
/// record it must read afresh), and retires it: whoever still holds it writes nothing more,
/// and a write of it under way has ended when this returns. Otherwise a late checkpoint
/// update of an old peer set, landing once this host holds the lock again, could put an old
/// generation and its peers back over a newer record.
pub async fn forget_vault_writer(d: &Daemon, volume: Uuid) {
    let w = d.peers.writers.lock().expect("lock").remove(&volume);
    if let Some(w) = w {
        w.retired.store(true, Ordering::SeqCst);
        drop(w.vault.lock().await);
    }
}

/// A `wbp` volume's peers, from its owner's side. Cheap to clone.
#[derive(Clone)]
pub struct PeerSet(Arc<PeerSetInner>);

struct PeerSetInner {
    volume: Uuid,
    links: Vec<Link>,
    acked: Vec<AtomicU64>,
    vault: Arc<VaultWriter>,
    /// Peers that failed, remembered by the daemon so they are not picked again at once.
    failed: Arc<Mutex<HashMap<String, Instant>>>,
    /// The newest checkpoint to forward, and whether a forwarding task runs: one task at a
    /// time, sending the newest each time, however many windows end meanwhile.
    forward: Mutex<(u64, bool)>,
    /// At most one vault checkpoint update under way.
    vault_busy: std::sync::atomic::AtomicBool,
    /// How long a link stays idle before its peer is pinged ([`PeerSet::keep_alive`]).
    keepalive: Duration,
}

impl PeerSetInner {
    fn note_failures(&self) {
        let mut f = self.failed.lock().expect("lock");
        for l in &self.links {
            if l.broken().is_some() {
                f.insert(l.peer().to_owned(), Instant::now());
            }
        }
    }
}

impl PeerSet {
    /// Moves the vault's checkpoint to `ser` if the last update is a second old (DESIGN §11).
    fn vault_checkpoint(&self, gen: u64, ser: u64) {
        if self.0.vault_busy.swap(true, Ordering::SeqCst) {
            return;
        }
        let set = self.0.clone();
        tokio::spawn(async move {
            let due = set.vault.vault.lock().await.1.elapsed() >= VAULT_CHECKPOINT_EVERY;
            if due {
                let _ = set
                    .vault
                    .update(|v| {
                        if v.gen == gen {
                            v.checkpoint = v.checkpoint.max(ser);
                        }
                    })
                    .await;
            }
            set.vault_busy.store(false, Ordering::SeqCst);
        });
    }
}

impl Replicator for PeerSet {
    fn write(&self, w: ReplicaWrite) -> BoxFuture<Result<(), String>> {
        let set = self.0.clone();
        // Encoded (and checksummed) once for every peer.
        let body = peer::Body::new(&peer::wire::Msg::Write(WriteMsg {
            volume: set.volume,
            gen: w.gen,
            ser: w.ser,
            offset: w.offset,
            len: w.len,
            data: w.data.clone(),
            alloc: w.alloc,
        }));
        let futs: Vec<BoxFuture<Result<(), PeerError>>> = set
            .links
            .iter()
            .map(|l| {
                let (l, b) = (l.clone(), body.clone());
                Box::pin(async move { l.write_encoded(b).await }) as BoxFuture<_>
            })
            .collect();
        let ser = w.ser;
        Box::pin(async move {
            let mut err = None;
            for (i, r) in join_all(futs).await.into_iter().enumerate() {
                match r {
                    Ok(()) => {
                        set.acked[i].fetch_max(ser, Ordering::Relaxed);
                    }
                    Err(e) => {
                        err.get_or_insert(e.to_string());
                    }
                }
            }
            match err {
                None => Ok(()),
                Some(e) => {
                    set.note_failures();
                    Err(e)
                }
            }
        })
    }

    fn flush(&self) -> BoxFuture<Result<(), String>> {
        let set = self.0.clone();
        let futs: Vec<BoxFuture<Result<(), PeerError>>> = set
            .links
            .iter()
            .map(|l| {
                let l = l.clone();
                Box::pin(async move { l.flush().await }) as BoxFuture<_>
            })
            .collect();
        Box::pin(async move {
            let r: Result<(), String> = join_all(futs)
                .await
                .into_iter()
                .collect::<Result<(), PeerError>>()
                .map_err(|e| e.to_string());
            if r.is_err() {
                set.note_failures();
            }
            r
        })
    }

    fn checkpoint(&self, gen: u64, ser: u64) {
        {
            let mut f = self.0.forward.lock().expect("lock");
            f.0 = f.0.max(ser);
            if f.1 {
                return self.vault_checkpoint(gen, ser); // the running task sends the newest
            }
            f.1 = true;
        }
        let set = self.0.clone();
        tokio::spawn(async move {
            let mut sent = 0;
            loop {
                let next = {
                    let mut f = set.forward.lock().expect("lock");
                    if f.0 <= sent {
                        f.1 = false;
                        return;
                    }
                    f.0
                };
                let sends: Vec<BoxFuture<Result<(), PeerError>>> = set
                    .links
                    .iter()
                    .filter(|l| l.broken().is_none())
                    .map(|l| {
                        let (l, v) = (l.clone(), set.volume);
                        Box::pin(async move { l.checkpoint(v, gen, next).await }) as BoxFuture<_>
                    })
                    .collect();
                join_all(sends).await;
                sent = next;
            }
        });
        self.vault_checkpoint(gen, ser);
    }

    fn exclude_failed(&self) -> BoxFuture<Result<(), String>> {
        let failed: Vec<String> = self
            .0
            .links
            .iter()
            .filter(|l| l.broken().is_some())
            .map(|l| l.peer().to_owned())
            .collect();
        let vault = self.0.vault.clone();
        let volume = self.0.volume;
        Box::pin(async move {
            if failed.is_empty() {
                // A write failed but no link says so: nothing can be excluded, so nothing
                // may complete (the caller retries).
                return Err("a peer failed a write but no link to a peer is broken".into());
            }
            vault
                .update(|v| v.peers.retain(|p| !failed.contains(p)))
                .await?;
            warn!(
                "volume {volume}: peer(s) {} failed and are out of its vault; writes complete \
                 on the datastore until new peers are in place",
                failed.join(", ")
            );
            Ok(())
        })
    }

    fn hand_off(&self) -> BoxFuture<Result<(), String>> {
        let vault = self.0.vault.clone();
        Box::pin(async move { vault.update(|v| v.handoff = true).await })
    }

    fn healthy(&self) -> bool {
        self.0.links.iter().all(|l| l.broken().is_none())
    }

    /// Pings each peer whose link has been idle `[cluster] peer_keepalive_s`. A ping not answered
    /// within the request timeout breaks the link (a refusal breaks it here), and the round
    /// then replaces the peer (`keep_replicated`): the owner falls back to `wt`, which
    /// destages what only it and that peer held, until new peers are in place. Without it an
    /// idle owner would go on counting on a peer that died without a word, and hold its dirty
    /// data alone for as long as it wrote nothing.
    fn keep_alive(&self) {
        for l in &self.0.links {
            if l.broken().is_some() || l.idle_for().is_none_or(|t| t < self.0.keepalive) {
                continue;
            }
            let (l, set) = (l.clone(), self.0.clone());
            tokio::spawn(async move {
                if let Err(e) = l.ping(set.volume).await {
                    l.close(&format!("no answer to a keep-alive: {e}"));
                    set.note_failures();
                }
            });
        }
    }

    fn report(&self) -> Vec<PeerReport> {
        self.0
            .links
            .iter()
            .zip(&self.0.acked)
            .map(|(l, a)| PeerReport {
                host: l.peer().to_owned(),
                acked_ser: a.load(Ordering::Relaxed),
                error: l.broken(),
            })
            .collect()
    }
}

/// What the daemon keeps for `wbp`.
#[derive(Default)]
pub struct PeerState {
    /// This host's peer listener (`ip:port`), once bound.
    pub addr: std::sync::OnceLock<String>,
    /// The pod's peer key (from the coordinator), which links prove they know.
    pub key: std::sync::OnceLock<peer::auth::Key>,
    /// Peers that failed recently, and when.
    failed: Arc<Mutex<HashMap<String, Instant>>>,
    /// The last problem reported per volume, so a round repeats no warning.
    last_problem: Mutex<HashMap<String, String>>,
    /// Volumes being replayed here for a dead owner.
    replaying: Mutex<std::collections::HashSet<Uuid>>,
    /// This host's volumes handed off to their peers (its cache device failed), by name.
    handed_off: Mutex<HashMap<String, Handoff>>,
    /// The vault writer of each volume this host owns ([`vault_writer`]).
    writers: Mutex<HashMap<Uuid, Arc<VaultWriter>>>,
    /// Volumes whose last peer change could not take them out of their failed peers, and
    /// when to try again ([`keep_replicated`]).
    change_retry: Mutex<HashMap<Uuid, Backoff>>,
    /// Failed rounds of [`go_on_uncached_with_nothing_lost`], per volume.
    uncached_tries: Mutex<HashMap<Uuid, u32>>,
    /// Vault locks this host took (to replay another host's volume, to open, delete or
    /// recover one) and could not give back ([`give_lock_back`]): retried every round.
    unlock_owed: Mutex<std::collections::HashSet<Uuid>>,
    /// Held while an owed unlock or hand-on is retried, by a replay while it claims its volume
    /// ([`claim_replay`]), and by every lock taken for a reason of this host's own
    /// ([`take_vault_lock`]): a lock so taken (adopting an owed one, same lease) must not be
    /// deleted, or its volume handed on, by a retry that looked before.
    owed_gate: tokio::sync::Mutex<()>,
    /// Replays that stopped here and could not be handed on ([`pass_on`]), by volume, with
    /// its name: retried every round ([`retry_owed_passes`]).
    pass_on_owed: Mutex<HashMap<Uuid, String>>,
}

/// A hand-off this host waits on ([`flash_failed`], [`handed_to_nobody`]).
struct Handoff {
    /// When to ask next whether any peer still holds the volume.
    next_ask: Instant,
    /// What the peers answered when last asked, for `vesta volume show`.
    answers: Option<String>,
}

/// Tries (a round apart, each as long as the coordinator takes to fail) a `wb` volume whose
/// cache device failed with nothing dirty keeps its writes waiting for its new generation to
/// be recorded.
pub(crate) const UNCACHED_TRIES: u32 = 10;

impl PeerState {
    /// Whether a peer change for `volume` may run now ([`keep_replicated`]).
    fn change_due(&self, volume: Uuid) -> bool {
        let m = self.change_retry.lock().expect("lock");
        m.get(&volume).is_none_or(|b| b.due(Instant::now()))
    }

    /// A peer change for `volume` failed and left it with its failed peers: returns when
    /// the next may run.
    fn change_failed(&self, volume: Uuid) -> Backoff {
        let mut m = self.change_retry.lock().expect("lock");
        let b = Backoff::after_failure(m.get(&volume).copied(), Instant::now());
        m.insert(volume, b);
        b
    }

    /// A peer change for `volume` left it without failed peers: the next runs when needed.
    fn change_settled(&self, volume: Uuid) {
        self.change_retry.lock().expect("lock").remove(&volume);
    }

    /// Logs `problem` for `volume` unless it was the last one logged; `None` clears it.
    fn note(&self, volume: &str, problem: Option<String>) {
        let mut m = self.last_problem.lock().expect("lock");
        match problem {
            Some(p) => {
                if m.get(volume) != Some(&p) {
                    warn!("volume {volume:?}: {p}");
                    m.insert(volume.to_owned(), p);
                }
            }
            None => {
                m.remove(volume);
            }
        }
    }
}

/// Picks peers for `volume` by its policy's rule and enters `wbp` with them: the volume
/// drains, the new peers open the new generation, the vault names them, and writes go to
/// them from then on. If the switch fails after the volume drained, it is left in `wt`.
pub async fn establish(
    d: &Daemon,
    name: &str,
    volume: &Arc<Volume>,
    policy: Policy,
) -> Result<(), String> {
    let Policy::Wbp { peers: n, rule } = policy else {
        return Err(format!("{policy} is not a wbp policy"));
    };
    if d.coord.kind() == "local" {
        return Err(format!(
            "policy {policy} needs peer hosts: configure a cluster ([cluster] etcd) with at \
             least {n} other host(s)"
        ));
    }
    let Some(key) = d.peers.key.get() else {
        return Err("this host has not loaded the pod's peer key yet".into());
    };
    let me = d.coord.host().to_owned();
    let my_domain = d.config.cluster.fault_domain.clone();
    let hosts = d.coord.hosts().await.map_err(|e| e.to_string())?;
    let resting: Vec<String> = {
        let mut f = d.peers.failed.lock().expect("lock");
        f.retain(|_, t| t.elapsed() < FAILED_PEER_REST);
        f.keys().cloned().collect()
    };
    let mut cands: Vec<_> = hosts
        .into_iter()
        .filter(|h| {
            h.alive
                && h.record.name != me
                && h.record.peer.is_some()
                && rule.allows(&my_domain, &h.record.fault_domain)
                && !resting.contains(&h.record.name)
        })
        .collect();
    // The least used caches first.
    cands.sort_by(|a, b| {
        let f = |h: &cluster::HostStatus| {
            h.record.cache_used_bytes as f64 / h.record.cache_bytes.max(1) as f64
        };
        f(a).total_cmp(&f(b))
            .then(a.record.name.cmp(&b.record.name))
    });
    let mut links = Vec::new();
    for h in &cands {
        if links.len() == n as usize {
            break;
        }
        let addr = h.record.peer.clone().unwrap_or_default();
        match Link::connect(&h.record.name, &addr, &me, key).await {
            Ok(l) => links.push(l),
            Err(e) => {
                warn!(
                    "volume {name:?}: cannot use {} as a peer: {e}",
                    h.record.name
                );
                d.peers
                    .failed
                    .lock()
                    .expect("lock")
                    .insert(h.record.name.clone(), Instant::now());
            }
        }
    }
    if links.len() < n as usize {
        return Err(format!(
            "policy {policy} needs {n} peer host(s) ({rule} to fault domain {my_domain:?}) with \
             a peer listener; {} live candidate(s) found, {} reachable",
            cands.len(),
            links.len()
        ));
    }
    let id = volume.id();
    let names: Vec<String> = links.iter().map(|l| l.peer().to_owned()).collect();
    let writer = vault_writer(d, id).await?;
    let set = PeerSet(Arc::new(PeerSetInner {
        volume: id,
        links: links.clone(),
        acked: links.iter().map(|_| AtomicU64::new(0)).collect(),
        forward: Mutex::new((0, false)),
        vault_busy: Default::default(),
        vault: writer.clone(),
        failed: d.peers.failed.clone(),
        keepalive: Duration::from_secs(d.config.cluster.peer_keepalive_s),
    }));
    let hook_writer = writer.clone();
    let joined = names.join(", ");
    let me = me.clone();
    let hook: engine::SwitchHook = Box::new(move |gen, checkpoint| {
        Box::pin(async move {
            // The peers first, then the vault: once the vault names them, they may replay.
            for l in &links {
                l.open(id, gen, checkpoint)
                    .await
                    .map_err(|e| e.to_string())?;
            }
            hook_writer
                .replace(Vault {
                    volume: id,
                    policy,
                    checkpoint,
                    gen,
                    owner: me,
                    peers: names,
                    previous_owner: None,
                    handoff: false,
                })
                .await
        })
    });
    volume
        .set_policy_with(policy, Some(Arc::new(set)), Some(hook))
        .await
        .map_err(|e| e.to_string())?;
    info!(
        "volume {name:?}: {policy} with peer(s) {joined} (generation {})",
        volume.cache_report().map_or(0, |r| r.gen)
    );
    Ok(())
}

/// Takes a `wbp` volume whose peers failed (and cannot be replaced now) to `wt`, recording
/// it in the vault; it goes back to `wbp` once peers are available ([`run`]).
async fn fall_back_to_wt(d: &Daemon, volume: &Arc<Volume>) -> Result<(), String> {
    let hook = switch_hook(d, volume.id(), Policy::Wt).await?;
    volume
        .set_policy_with(Policy::Wt, None, Some(hook))
        .await
        .map_err(|e| e.to_string())
}

/// The hook of a switch to a policy without peers: the vault gets the new generation, the
/// policy and no peers before the volume switches (so no former peer can replay over what
/// the volume writes afterwards).
pub async fn switch_hook(
    d: &Daemon,
    id: Uuid,
    policy: Policy,
) -> Result<engine::SwitchHook, String> {
    let w = vault_writer(d, id).await?;
    let me = d.coord.host().to_owned();
    Ok(Box::new(move |gen, checkpoint| {
        Box::pin(async move {
            w.replace(Vault {
                volume: id,
                policy,
                checkpoint,
                gen,
                owner: me,
                peers: Vec::new(),
                previous_owner: None,
                handoff: false,
            })
            .await
        })
    }))
}

/// Once a second: keeps this host's `wbp` volumes replicated, and looks after the replicas
/// it holds for others (drops stale ones, replays those of dead owners).
pub async fn run(d: Arc<Daemon>, mut stop: nbd::Stop) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(ROUND) => {}
            _ = stop.wait() => return,
        }
        if let Some(c) = d.cache.clone() {
            // A cache device that died while idle is noticed here, not at the next write.
            let log = c.log().clone();
            let _ = datastore::device::on_pool(move || {
                log.probe()
                    .map_err(|e| std::io::Error::other(e.to_string()))
            })
            .await;
        }
        release_held_writes(&d).await;
        retry_owed_passes(&d).await;
        retry_owed_unlocks(&d).await;
        go_on_uncached_with_nothing_lost(&d).await;
        keep_replicated(&d);
        if d.cache.is_some() && d.coord.kind() != "local" {
            look_after_replicas(&d).await;
        }
    }
}

/// A volume whose policy switch could not record its new generation holds its writes
/// (`engine::Volume::set_policy_with`): records it now, and lets them go once that worked.
pub(crate) async fn release_held_writes(d: &Arc<Daemon>) {
    for e in d.entries() {
        let Ok(v) = &e.volume else { continue };
        if !v.writes_held() {
            continue;
        }
        // An offline replay backed by the vault's peers keeps them named until it ends
        // (`Daemon::try_record_vault`); its writes wait for the record after it.
        if v.cache_report().is_some_and(|r| r.replaying) {
            continue;
        }
        // One change per volume at a time: an `establish` running now records the vault
        // itself (with its new peers, which this record would drop).
        let Some(_busy) = d.claim_entry(&e, "vault record") else {
            continue;
        };
        if !v.writes_held() {
            continue;
        }
        // A switch the cache log could not take leaves it in an older generation than the
        // vault may name: it moves on first, so that the record below is of what it runs in.
        if let Err(why) = v.catch_up_gen().await {
            d.peers.note(
                &e.record.name,
                Some(format!(
                    "writes held: the cache cannot take the generation its vault names: {why}"
                )),
            );
            continue;
        }
        match d.try_record_vault(&e.record, v).await {
            Ok(()) => {
                v.release_writes();
            }
            Err(why) => d.peers.note(
                &e.record.name,
                Some(format!("writes held until the vault is recorded: {why}")),
            ),
        }
    }
}

/// Starts a peer change for each `wbp` volume that needs one; returns their tasks.
pub(crate) fn keep_replicated(d: &Arc<Daemon>) -> Vec<tokio::task::JoinHandle<()>> {
    let mut changes = Vec::new();
    for e in d.entries() {
        let Ok(v) = &e.volume else { continue };
        let want = e.wanted();
        // An offline replay its vault's peers back hands off to them whatever the policy
        // wanted now (one set since the restart, or a record that lagged a switch to wbp).
        let backed_failure = v
            .cache()
            .is_some_and(|c| c.cache_failed() && c.replay_backed());
        if !matches!(want, Policy::Wbp { .. }) && !backed_failure {
            d.peers.change_settled(e.record.id);
            continue;
        }
        let Some(c) = v.cache() else { continue };
        if c.replicating() && v.policy() == want && !c.cache_failed() {
            d.peers.change_settled(e.record.id);
            d.peers.note(&e.record.name, None);
            if let Some(p) = c.peers() {
                p.keep_alive();
            }
            continue;
        }
        if c.report().replaying && !c.cache_failed() {
            continue; // offline replay first
        }
        // A failed cache device goes to its hand-off at once, whatever failed before.
        if !c.cache_failed() && !d.peers.change_due(e.record.id) {
            continue;
        }
        // Each volume on its own task: a drain that takes long (a slow or failed datastore)
        // must not hold up the others, nor this host's replays for dead owners. The claim
        // keeps one change per volume at a time.
        let (d, e, v) = (d.clone(), e.clone(), v.clone());
        changes.push(tokio::spawn(async move {
            let Some(_busy) = d.claim_entry(&e, "peer change") else {
                return;
            };
            // A change that held the claim meanwhile (the volume went uncached) is done.
            if !v.cache().is_some_and(|now| Arc::ptr_eq(&now, &c)) {
                return;
            }
            let name = &e.record.name;
            if c.cache_failed() {
                if let Err(why) = flash_failed(&d, &e.record, &v, &c).await {
                    d.peers
                        .note(name, Some(format!("hand-off to peers: {why}")));
                }
                return;
            }
            let why = match establish(&d, name, &v, want).await {
                Ok(()) => {
                    d.peers.change_settled(e.record.id);
                    d.peers.note(name, None);
                    return;
                }
                Err(why) => why,
            };
            if !c.has_peers() {
                // In wt already: trying again next round costs the volume nothing.
                d.peers.change_settled(e.record.id);
                d.peers
                    .note(name, Some(format!("stays in wt for now: {why}")));
                return;
            }
            // Its peers failed and none can replace them: wt until some can.
            match fall_back_to_wt(&d, &v).await {
                Ok(()) => {
                    d.peers.change_settled(e.record.id);
                    info!("volume {name:?}: lost its peers; in wt until new peers are available");
                    d.peers
                        .note(name, Some(format!("stays in wt for now: {why}")));
                }
                Err(e2) => {
                    // Each try drains under flow control, then pauses IO (a failing
                    // datastore makes both last): not every round.
                    let b = d.peers.change_failed(e.record.id);
                    warn!(
                        "volume {name:?}: its peers failed and it cannot leave them: no new \
                         peers ({why}), and the fall-back to wt failed ({e2}); trying again in \
                         {} s",
                        b.wait.as_secs()
                    );
                }
            }
        }));
    }
    changes
}

/// How long a hand-off waits at a time for the destager's datastore writes in service.
const HANDOFF_DESTAGE_WAIT: Duration = Duration::from_secs(10);

/// FVP Table 1, flash failure in `wbp`: the owner's cache device failed, so what only it and
/// its peers held can be destaged only by a peer. The owner stops its destager, marks the
/// vault for hand-off and gives the lock up; a peer replays (as for a dead owner) and leaves
/// the vault in `wt` with a new generation; the owner then takes the lock back and serves the
/// volume uncached, with the datastore current. The volume's IO stalls meanwhile, as FVP
/// stalls the VM, and is then done on the datastore; reads stall too, since a peer's replay
/// from the vault's checkpoint can take a block back to an older version for a moment. If
/// the vault names no peer to replay, the volume reports the loss and its IO goes on as in
/// `wb` (clean reads from the datastore, the rest failing); so it does when every peer the
/// vault names answers that it holds nothing of the volume ([`handed_to_nobody`]). A
/// hand-off whose peers never replay because they died too and do not return stalls until
/// the volume is deleted. A volume
/// with nothing dirty needs no replay: it goes on uncached at once
/// (`engine::Volume::go_uncached_with_nothing_lost`, as for `wb`). An owner restarted after a
/// crash whose offline replay its vault's peers back (`VolCache::replay_backed`) hands off
/// the same way, its peer set being the vault's.
async fn flash_failed(
    d: &Arc<Daemon>,
    rec: &VolumeRecord,
    v: &Arc<Volume>,
    c: &Arc<engine::cache::VolCache>,
) -> Result<(), String> {
    let name = &rec.name;
    let handed = d.peers.handed_off.lock().expect("lock").contains_key(name);
    let peers = c.peers();
    // An owner restarted after a crash, replaying offline what its peers hold too: they
    // replay the rest, as for an owner in wbp.
    let replay_backed = peers.is_none() && c.replay_backed();
    if !handed && peers.is_none() && !replay_backed {
        return Ok(()); // not wbp: wt goes on uncached, wb reports its loss (engine)
    }
    let mut vault = read_vault(d, rec.id).await?;
    if replay_backed && (vault.gen != c.gen() || vault.owner != d.coord.host()) {
        // Not the vault the replay was backed by (this host writes it; nothing should have
        // moved it): its peers cannot be trusted to hold this generation.
        vault.peers.clear();
    }
    if !handed && (peers.is_some() || replay_backed) {
        // With nothing dirty the datastore holds every completed write: no peer needs to
        // replay, and the volume goes on uncached at once (its new generation makes the
        // peers drop their replicas).
        if c.clean() {
            let hook = switch_hook(d, rec.id, Policy::Uncached).await?;
            if v.go_uncached_with_nothing_lost(hook)
                .await
                .map_err(|e| e.to_string())?
            {
                warn!(
                    "volume {name:?}: the cache device failed with nothing dirty (every write \
                     was on the datastore); serving it uncached, nothing lost, without a \
                     replay by its peers"
                );
                return Ok(());
            }
        }
        // The peers the vault names hold every completed write (a write completes only once
        // they all have it, or once a peer that failed it is out of the vault), whatever the
        // state of this host's links to them: a link broken while idle says nothing of the
        // peer. With none named, nobody can replay.
        if vault.peers.is_empty() {
            // The volume reports the loss, and its IO goes on as in wb.
            let why = "the cache device failed and no peer is left to replay from";
            v.stop_stalling(why.into());
            return Err(why.into());
        }
        // Not while a write of the destager's is still in service at the datastore: the
        // peer's replay would race it. Waited for a while at a time, so that a datastore that
        // stopped answering shows in the volume's status and the volume's claim is let go
        // between tries (each round tries again).
        if !c.stop_destaging_within(HANDOFF_DESTAGE_WAIT).await {
            return Err(format!(
                "waiting for the destager's writes to the datastore to be answered (still in \
                 service after {HANDOFF_DESTAGE_WAIT:?}); the peers replay once they are"
            ));
        }
        match &peers {
            Some(p) => p.hand_off().await?,
            None => {
                vault_writer(d, rec.id)
                    .await?
                    .update(|v| v.handoff = true)
                    .await?
            }
        }
        // Marked handed off before the lock goes back: the volume is no longer served with
        // its lock, so an unlock owed here stays owed (a retry that still saw the volume
        // served would drop it). And marked whether or not the unlock went through: with the
        // vault marked and the lock gone (an unlock that landed but whose answer was lost), a
        // next try of all this would find nothing held and report a loss that did not happen.
        d.peers.handed_off.lock().expect("lock").insert(
            name.clone(),
            Handoff {
                next_ask: Instant::now() + HANDOFF_ASK_EVERY,
                answers: None,
            },
        );
        give_lock_back(d, rec.id, name).await;
        // Another host writes the vault next: this host's copy is stale from here.
        forget_vault_writer(d, rec.id).await;
        warn!(
            "volume {name:?}: the cache device failed; its peers replay what it held (vault \
             lock given up, or retried until it is)"
        );
        return Ok(());
    }
    // Waiting for a peer to finish.
    if vault.handoff || vault.gen <= c.gen() {
        let due = {
            let mut h = d.peers.handed_off.lock().expect("lock");
            match h.get_mut(name) {
                Some(w) => {
                    let due = w.next_ask <= Instant::now();
                    if due {
                        w.next_ask = Instant::now() + HANDOFF_ASK_EVERY;
                    }
                    due
                }
                None => false,
            }
        };
        if due && nobody_replays(d, &vault, c) {
            handed_to_nobody(d, rec, v, c).await?;
        }
        return Ok(());
    }
    take_vault_lock(d, rec.id)
        .await
        .map_err(|e| e.to_string())?;
    v.abandon_cache().await;
    // Served uncached from here, under this host's lock: the hand-off is over whether or not
    // the vault below is recorded (no later round would find a cache to end it with).
    d.peers.handed_off.lock().expect("lock").remove(name);
    let me = d.coord.host().to_owned();
    let back = Vault {
        volume: rec.id,
        policy: Policy::Uncached,
        checkpoint: vault.checkpoint,
        gen: vault.gen + 1,
        owner: me,
        peers: Vec::new(),
        previous_owner: Some(vault.owner.clone()),
        handoff: false,
    };
    vault_writer(d, rec.id).await?.replace(back).await?;
    if vault.owner == d.coord.host() {
        // An accept-loss whose vault write landed although it answered an error.
        info!(
            "volume {name:?}: the vault records its loss as accepted; serving it uncached (the \
             cache device failed)"
        );
    } else {
        info!(
            "volume {name:?}: host {:?} replayed it; serving it uncached (the cache device \
             failed)",
            vault.owner
        );
    }
    Ok(())
}

/// The vault record of `volume`; an error if it cannot be read or there is none.
pub(crate) async fn read_vault(d: &Daemon, volume: Uuid) -> Result<Vault, String> {
    d.coord
        .vault(volume)
        .await
        .map_err(|e| e.to_string())?
        .ok_or_else(|| "no vault record".into())
}

/// A hand-off no peer can take: every peer the vault names is up and answers that it holds
/// nothing of the volume ([`Held::Nothing`]). That takes a second failure: each of them came
/// back on an empty cache device while the owner's links to them were idle, and the owner's
/// device failed before its keep-alive found those links dead ([`PeerSet::keep_alive`],
/// seconds), or while it could not replace them. What only the owner's
/// cache held is lost, so the volume reports the loss and its IO goes on as in `wb`, as when
/// the vault names no peer. A peer that is down or cannot answer may come back with its
/// replicas: the hand-off goes on waiting for it.
///
/// A peer that promoted its replicas for a replay holds them no longer as such, but still
/// answers that it holds the volume (`CacheHost::replica_held`), also after a replay that
/// stopped. And the owner decides only with the vault lock taken back: no peer replays while
/// it holds it, and a replay that ended has moved the vault to a new generation. Returns an
/// error (to log) once the loss is reported.
async fn handed_to_nobody(
    d: &Arc<Daemon>,
    rec: &VolumeRecord,
    v: &Arc<Volume>,
    c: &Arc<engine::cache::VolCache>,
) -> Result<(), String> {
    let name = &rec.name;
    let vault = read_vault(d, rec.id).await?;
    let answers = ask_held(d, rec, &vault, &vault.peers).await?;
    if let Some(w) = d.peers.handed_off.lock().expect("lock").get_mut(name) {
        w.answers = Some(said(&answers));
    }
    if !hold_nothing(&answers) {
        return Ok(());
    }
    match take_vault_lock(d, rec.id).await {
        Ok(()) => {}
        Err(cluster::Error::Locked(_)) => return Ok(()), // a peer replays
        Err(e) => {
            // The coordinator may have taken it all the same: given back to be sure.
            give_lock_back(d, rec.id, name).await;
            return Err(e.to_string());
        }
    }
    let decided = async {
        let vault = read_vault(d, rec.id).await?;
        if !nobody_replays(d, &vault, c) {
            return Ok(None);
        }
        let answers = ask_held(d, rec, &vault, &vault.peers).await?;
        if !hold_nothing(&answers) {
            return Ok(None);
        }
        let left = Vault {
            peers: Vec::new(),
            handoff: false,
            ..vault.clone()
        };
        vault_writer(d, rec.id).await?.replace(left).await?;
        Ok::<_, String>(Some(answers))
    }
    .await;
    let answers = match decided {
        Ok(Some(a)) => a,
        other => {
            // Not decided: the lock goes back to whichever peer can replay.
            forget_vault_writer(d, rec.id).await;
            give_lock_back(d, rec.id, name).await;
            return other.map(drop);
        }
    };
    d.peers.handed_off.lock().expect("lock").remove(name);
    let why = "the cache device failed and no peer is left to replay from";
    v.stop_stalling(format!(
        "{why}: every peer the vault named holds nothing of the volume ({})",
        said(&answers)
    ));
    Err(why.into())
}

/// The peers' answers, for people: `b: holds its replicas (to write 42); c: not alive`.
fn said(answers: &[(String, Held)]) -> String {
    let each: Vec<String> = answers
        .iter()
        .map(|(peer, a)| match a {
            Held::Upto(h) => format!("{peer}: holds its replicas (to write {})", h.upto),
            Held::Nothing(why) | Held::Unknown(why) => format!("{peer}: {why}"),
        })
        .collect();
    each.join("; ")
}

impl PeerState {
    /// Whether this host handed `volume` off to its peers and waits for one to replay it.
    pub fn handed_off(&self, volume: &str) -> bool {
        self.handed_off.lock().expect("lock").contains_key(volume)
    }

    /// Marks `volume` handed off, as [`flash_failed`] does.
    #[cfg(test)]
    pub(crate) fn mark_handed_off(&self, volume: &str) {
        self.handed_off.lock().expect("lock").insert(
            volume.to_owned(),
            Handoff {
                next_ask: Instant::now() + HANDOFF_ASK_EVERY,
                answers: None,
            },
        );
    }

    /// The hand-off of `volume` is over without a replay (its loss was accepted, or the
    /// volume deleted).
    pub fn end_handoff(&self, volume: &str) {
        self.handed_off.lock().expect("lock").remove(volume);
        self.note(volume, None);
    }

    /// For a volume handed off to its peers: what they answered when last asked whether they
    /// hold it (asked 5 s after the hand-off, and every 5 s after).
    pub fn handoff_answers(&self, volume: &str) -> Option<String> {
        self.handed_off
            .lock()
            .expect("lock")
            .get(volume)
            .and_then(|w| w.answers.clone())
    }
}

/// Whether `vault` is still this host's hand-off of the generation its cache failed in, as
/// far as the vault says: a replaying peer names itself owner before it writes anything (and
/// keeps the generation until it is done); before that, only its lock, and its answer that
/// it holds the volume, say it replays. With no peers named and no hand-off flag, it is a
/// loss this host recorded before (that write may have landed though it answered an error).
fn nobody_replays(d: &Daemon, vault: &Vault, c: &engine::cache::VolCache) -> bool {
    vault.gen == c.gen()
        && vault.owner == d.coord.host()
        && (vault.handoff || vault.peers.is_empty())
}

/// What a peer answered when asked how far it holds a volume ([`ask_held`]).
#[derive(Debug)]
enum Held {
    /// Up to this `ser`, without a gap above the vault's checkpoint (and the newest
    /// checkpoint the owner sent it).
    Upto(peer::Holding),
    /// Nothing of the volume at all: no replicas, no record in its log.
    Nothing(String),
    /// No answer (down, unreachable, or another refusal).
    Unknown(String),
}

/// Whether every answer says "holds nothing" (true for no answers: no peer is named).
fn hold_nothing(answers: &[(String, Held)]) -> bool {
    answers.iter().all(|(_, a)| matches!(a, Held::Nothing(_)))
}

/// Asks each of `peers` how far it holds `rec`'s replicas of the vault's generation (durably)
/// above the vault's checkpoint. If the host list cannot be read, nothing is asked (an error:
/// without it every peer would look dead).
async fn ask_held(
    d: &Daemon,
    rec: &VolumeRecord,
    vault: &Vault,
    peers: &[String],
) -> Result<Vec<(String, Held)>, String> {
    if peers.is_empty() {
        return Ok(Vec::new());
    }
    let me = d.coord.host().to_owned();
    let hosts = d
        .coord
        .hosts()
        .await
        .map_err(|e| format!("list the hosts: {e}; retrying"))?;
    let key = d.peers.key.get();
    let asks: Vec<BoxFuture<(String, Held)>> = peers
        .iter()
        .map(|name| {
            let addr = hosts
                .iter()
                .find(|h| h.alive && h.record.name == *name)
                .and_then(|h| h.record.peer.clone());
            let (name, me, key) = (name.clone(), me.clone(), key.cloned());
            let (id, gen, from) = (rec.id, vault.gen, vault.checkpoint);
            Box::pin(async move {
                let answer = async {
                    let addr = addr.ok_or("not alive")?;
                    let key = key.ok_or("this host has not loaded the pod's peer key")?;
                    let link = Link::connect(&name, &addr, &me, &key)
                        .await
                        .map_err(|e| e.to_string())?;
                    let held = link.held(id, gen, from).await;
                    link.close("asked what it holds");
                    Ok::<_, String>(match held {
                        Ok(h) => Held::Upto(h),
                        Err(PeerError::Absent { msg, .. }) => Held::Nothing(msg),
                        Err(e) => Held::Unknown(e.to_string()),
                    })
                }
                .await;
                (name, answer.unwrap_or_else(Held::Unknown))
            }) as BoxFuture<_>
        })
        .collect();
    Ok(join_all(asks).await)
}

/// FVP Table 1, flash failure in `wb` with every write destaged: nothing is lost, so the
/// volume goes on uncached, as `wt` does, instead of failing its writes. Its writes stall
/// until then (`engine::Volume::stalled`). The vault first gets a new generation, so that if
/// the device is readable again at the next start, whatever the log still holds of the
/// volume (records above a checkpoint the failure kept from the log) is dropped, not replayed
/// over what the volume writes uncached meanwhile. If that cannot be recorded in
/// [`UNCACHED_TRIES`] tries, the writes stop waiting and fail, as with dirty data. The
/// volume record keeps its policy: at the next start the volume is cached again.
async fn go_on_uncached_with_nothing_lost(d: &Arc<Daemon>) {
    for e in d.entries() {
        let Ok(v) = &e.volume else { continue };
        if !v.stalled() || v.cache().is_none_or(|c| c.has_peers() || c.replay_backed()) {
            continue; // a hand-off to peers is flash_failed's
        }
        // On a task of its own: the switch pauses the volume, which waits for its IO in
        // flight, and a slow datastore must not hold up the round. The claim keeps one at a
        // time.
        let (d, e, v) = (d.clone(), e.clone(), v.clone());
        tokio::spawn(async move {
            let Some(_busy) = d.claim_entry(&e, "cache device failure") else {
                return;
            };
            uncached_with_nothing_lost(&d, &e.record.name, &v).await;
        });
    }
}

/// One try of [`go_on_uncached_with_nothing_lost`] for volume `v` (claimed by the caller).
pub(crate) async fn uncached_with_nothing_lost(d: &Daemon, name: &str, v: &Arc<Volume>) {
    let done = match switch_hook(d, v.id(), Policy::Uncached).await {
        Ok(hook) => v
            .go_uncached_with_nothing_lost(hook)
            .await
            .map_err(|e| e.to_string()),
        Err(why) => Err(why),
    };
    let tries = {
        let mut t = d.peers.uncached_tries.lock().expect("lock");
        if done.is_err() {
            let n = t.entry(v.id()).or_insert(0);
            *n += 1;
            *n
        } else {
            t.remove(&v.id());
            0
        }
    };
    match done {
        Ok(true) => {
            d.peers.note(name, None);
            warn!(
                "volume {name:?}: the cache device failed with nothing dirty (every write was \
                 on the datastore); serving it uncached, nothing lost. It is cached again when \
                 vestad next starts with a working cache device"
            );
        }
        // A write completed in the cache as it failed: the volume reports that loss.
        Ok(false) => {}
        Err(why) if tries >= UNCACHED_TRIES => {
            d.peers.uncached_tries.lock().expect("lock").remove(&v.id());
            v.stop_stalling(format!(
                "the cache device failed, and the new generation that would let the volume go \
                 on uncached cannot be recorded: {why}"
            ));
        }
        Err(why) => d
            .peers
            .note(name, Some(format!("go on uncached: {why}; retrying"))),
    }
}

async fn look_after_replicas(d: &Arc<Daemon>) {
    let Some(cache) = d.cache.clone() else { return };
    let me = d.coord.host().to_owned();
    let sets = cache.replica_sets();
    if sets.is_empty() {
        return;
    }
    let (Ok(hosts), Ok(state)) = (d.coord.hosts().await, d.coord.state().await) else {
        return;
    };
    let alive = |h: &str| hosts.iter().any(|x| x.alive && x.record.name == h);
    for set in sets {
        if d.peers
            .replaying
            .lock()
            .expect("lock")
            .contains(&set.volume)
        {
            continue;
        }
        let Some(rec) = state.volumes.iter().find(|v| v.id == set.volume).cloned() else {
            info!(
                "volume {} no longer exists; dropping its replicas",
                set.volume
            );
            let _ = cache.replica_drop(set.volume, set.gen);
            continue;
        };
        let vault = match d.coord.vault(set.volume).await {
            Ok(Some(v)) => v,
            _ => continue,
        };
        let listed = vault.gen == set.gen && vault.peers.contains(&me);
        if !listed {
            // Another generation, or this host was taken out: these copies are stale
            // unless the owner is still setting them up (a vault names peers after they
            // open, so a newer set may wait for its vault while the owner lives).
            if vault.gen > set.gen || !alive(&vault.owner) || vault.gen == set.gen {
                info!(
                    "volume {:?}: dropping stale replicas (generation {}, vault generation {}, \
                     peers {:?})",
                    rec.name, set.gen, vault.gen, vault.peers
                );
                let _ = cache.replica_drop(set.volume, set.gen);
            }
            continue;
        }
        // A vault that names this host was a replay of this host's that stopped (it is not
        // replaying now, see above): its restart, or an error, cut it short. It goes on.
        if vault.owner != me && alive(&vault.owner) && !vault.handoff {
            continue;
        }
        // The vault's holder is gone (or handed the volume off): replay, if this host gets
        // the lock first.
        if !claim_replay(d, set.volume).await {
            continue;
        }
        let d2 = d.clone();
        tokio::spawn(async move {
            match replay_for_dead_owner(&d2, &rec).await {
                // Repeats (a datastore that stays down) are logged once.
                Err(e) => d2
                    .peers
                    .note(&rec.name, Some(format!("online replay: {e}"))),
                Ok(()) => d2.peers.note(&rec.name, None),
            }
            replay_ended(&d2, rec.id);
        });
    }
}

/// Online replay (DESIGN §4): this host holds replicas of `rec`, whose vault holder died.
/// With the vault lock, the replicas above the vault's checkpoint are destaged in `ser`
/// order, the vault's checkpoint following as they go; at the end the vault says `wt` with
/// a new generation (so every other copy is stale) and the lock is given back for the owner.
pub(crate) async fn replay_for_dead_owner(
    d: &Arc<Daemon>,
    rec: &VolumeRecord,
) -> Result<(), String> {
    let cache = d.cache.clone().ok_or("no cache device")?;
    // A host whose writes stopped for good would take the lock and then hold it for as long
    // as it runs, its replay refused at every write, keeping every other host from replaying.
    revoked_hosts_do_not_replay(d)?;
    match d.coord.lock_vault(rec.id).await {
        Ok(()) => {}
        Err(cluster::Error::Locked(_)) => return Ok(()), // another host got there first
        Err(e) => {
            // The coordinator may have granted it all the same.
            give_lock_back(d, rec.id, &rec.name).await;
            return Err(e.to_string());
        }
    }
    holds_lock(d, rec.id);
    // A hand-on still owed from an earlier try is this try's to make now, if it stops too:
    // retried after a replay that finished, it would mark the finished one's vault.
    d.peers.pass_on_owed.lock().expect("lock").remove(&rec.id);
    let result = replay_locked(d, &cache, rec).await;
    if result.is_err() {
        pass_on(d, rec).await;
    }
    give_lock_back(d, rec.id, &rec.name).await;
    result
}

/// A replay of this host's that stopped on a host that goes on running (its cache device
/// failed, its datastore writes stopped for good, its replicas could not be taken up) leaves
/// the vault naming this host as the volume's writer, and every other peer waits for a live
/// writer to finish: none would, ever. So the volume is marked handed off, as an owner whose
/// cache device failed marks it, and another listed peer continues from the vault's
/// checkpoint. (A replay that stops because this host restarts is resumed by it.) Called with
/// the vault lock held. A hand-on that fails (the coordinator did not answer) is tried again
/// every round until it lands ([`retry_owed_passes`]): until then no peer would continue.
pub(crate) async fn pass_on(d: &Daemon, rec: &VolumeRecord) {
    if let Err(e) = try_pass_on(d, rec.id, &rec.name).await {
        warn!(
            "volume {:?}: its replay stopped here, and handing it on failed: {e}; retried \
             every {ROUND:?}",
            rec.name
        );
        d.peers
            .pass_on_owed
            .lock()
            .expect("lock")
            .insert(rec.id, rec.name.clone());
    }
}

/// [`pass_on`], once, with the vault lock held.
async fn try_pass_on(d: &Daemon, id: Uuid, name: &str) -> Result<(), String> {
    let me = d.coord.host();
    let v = d
        .coord
        .vault(id)
        .await
        .map_err(|e| format!("read the vault: {e}"))?;
    // Not named yet, or not any more; or a replay finished (its vault names no peers, and
    // there is nobody to hand on to).
    let Some(v) = v.filter(|v| v.owner == me && !v.handoff && !v.peers.is_empty()) else {
        return Ok(());
    };
    let peers = v.peers.clone();
    d.coord
        .put_vault(&Vault { handoff: true, ..v })
        .await
        .map_err(|e| format!("mark the vault handed off: {e}"))?;
    warn!("volume {name:?}: its replay stopped here; handed on to its other peer(s) in {peers:?}");
    Ok(())
}

/// Hands on the replays [`pass_on`] could not, each under the vault lock: the one this host
/// still owes back ([`give_lock_back`]) or taken again. A lock another host holds means another
/// host acts on the volume now (a peer replays, or its owner came back and finds the vault
/// naming this host): nothing is owed any more. A volume replayed here again meanwhile is
/// left to that replay.
pub(crate) async fn retry_owed_passes(d: &Daemon) {
    let owed: Vec<(Uuid, String)> = d
        .peers
        .pass_on_owed
        .lock()
        .expect("lock")
        .iter()
        .map(|(id, name)| (*id, name.clone()))
        .collect();
    for (id, name) in owed {
        let _gate = d.peers.owed_gate.lock().await;
        if d.peers.replaying.lock().expect("lock").contains(&id) {
            continue;
        }
        if d.entries().iter().any(|e| e.record.id == id) {
            // Served here now: this host is its owner, nothing to hand on.
            d.peers.pass_on_owed.lock().expect("lock").remove(&id);
            continue;
        }
        let held = d.peers.unlock_owed.lock().expect("lock").contains(&id);
        if !held {
            match d.coord.lock_vault(id).await {
                Ok(()) => {}
                Err(cluster::Error::Locked(_)) => {
                    d.peers.pass_on_owed.lock().expect("lock").remove(&id);
                    continue;
                }
                Err(e) => {
                    d.peers
                        .note(&name, Some(format!("hand the stopped replay on: {e}")));
                    continue;
                }
            }
        }
        let r = try_pass_on(d, id, &name).await;
        if !held {
            give_lock_back(d, id, &name).await;
        }
        match r {
            Ok(()) => {
                d.peers.pass_on_owed.lock().expect("lock").remove(&id);
            }
            Err(e) => d
                .peers
                .note(&name, Some(format!("hand the stopped replay on: {e}"))),
        }
    }
}

/// Gives back volume `id`'s vault lock (named `name` in the log), which this host holds, or
/// may hold (a take that answered an error), and is done with: a replay or a hand-on ended,
/// the volume waits for its peers to replay it, its owner hands it off or took it back to
/// decide a hand-off, a delete or a loss it was taken for did not happen. One the
/// coordinator did not take back stays bound to this host's lease for as long as it runs,
/// and no other host could replay or serve the volume: it is owed, and retried from the
/// next round on ([`retry_owed_unlocks`]). A write of this host's that went unanswered is
/// given its time to land first ([`Daemon::late_writes_landed`]).
pub(crate) async fn give_lock_back(d: &Daemon, id: Uuid, name: &str) {
    d.late_writes_landed().await;
    if let Err(e) = d.coord.unlock_vault(id).await {
        warn!("volume {name:?}: give the vault lock back: {e}; retrying");
        d.peers.unlock_owed.lock().expect("lock").insert(id);
    }
}

/// Marks a replay of volume `id` as running here (false if one runs already). Under the
/// gate an owed unlock or hand-on is retried under: the lock this replay takes (this host's
/// lease, so it adopts one still owed) is its own, and a retry that looked before the replay
/// began (and saw none) must not give it back or hand the volume on meanwhile. Retries
/// leave a replaying volume alone; an unlock still owed from an earlier replay becomes the
/// new one's to give back once it holds the lock ([`holds_lock`]), and stays owed if it
/// never gets there.
pub(crate) async fn claim_replay(d: &Daemon, id: Uuid) -> bool {
    let _gate = d.peers.owed_gate.lock().await;
    d.peers.replaying.lock().expect("lock").insert(id)
}

/// A replay [`claim_replay`] marked took its volume's vault lock: it gives it back when it
/// ends ([`give_lock_back`]), an unlock owed from an earlier replay included.
fn holds_lock(d: &Daemon, id: Uuid) {
    d.peers.unlock_owed.lock().expect("lock").remove(&id);
}

/// Takes volume `id`'s vault lock for a reason of this host's own (to serve, delete or
/// recover the volume), under the gate owed unlocks are retried under: a retry that looked
/// before (the volume neither served nor replayed here) must not give back the lock taken
/// meanwhile (this host's lease, so it adopts one still owed). Once it is held, an unlock
/// still owed is not: whatever took the lock gives it back when it is done.
pub(crate) async fn take_vault_lock(d: &Daemon, id: Uuid) -> cluster::Result<()> {
    let _gate = d.peers.owed_gate.lock().await;
    d.coord.lock_vault(id).await?;
    d.peers.unlock_owed.lock().expect("lock").remove(&id);
    Ok(())
}

/// A replay [`claim_replay`] marked ended.
pub(crate) fn replay_ended(d: &Daemon, id: Uuid) {
    d.peers.replaying.lock().expect("lock").remove(&id);
}

/// Gives back the vault locks [`give_lock_back`] could not, unless this host took the
/// volume's lock again since for a reason of its own (another replay of it, or it serves
/// it). One failure ends the round's tries: the coordinator does not answer, and each try
/// would hold the gate (and every lock taken behind it) for as long again.
pub(crate) async fn retry_owed_unlocks(d: &Daemon) {
    let _gate = d.peers.owed_gate.lock().await;
    let owed: Vec<Uuid> = d
        .peers
        .unlock_owed
        .lock()
        .expect("lock")
        .iter()
        .copied()
        .collect();
    for id in owed {
        if d.peers.replaying.lock().expect("lock").contains(&id) {
            // Its replay gives it back, or leaves it owed if it never took it.
            continue;
        }
        // A lock owed for a volume this host serves again (open, and not handed off) is that
        // volume's now; one that could not open, or was handed off, gave it up.
        let again = d
            .entries()
            .iter()
            .any(|e| e.record.id == id && d.serves_with_lock(e));
        if again {
            d.peers.unlock_owed.lock().expect("lock").remove(&id);
            continue;
        }
        match d.coord.unlock_vault(id).await {
            Ok(()) => {
                d.peers.unlock_owed.lock().expect("lock").remove(&id);
                info!("volume {id}: gave its vault lock back");
            }
            Err(e) => {
                warn!("volume {id}: give the vault lock back: {e}; retried in {ROUND:?}");
                break;
            }
        }
    }
}

async fn replay_locked(
    d: &Arc<Daemon>,
    cache: &Arc<CacheHost>,
    rec: &VolumeRecord,
) -> Result<(), String> {
    let me = d.coord.host().to_owned();
    // Read again under the lock: the vault may have moved on meanwhile.
    let vault = read_vault(d, rec.id).await?;
    let Some(set) = cache
        .replica_sets()
        .into_iter()
        .find(|s| s.volume == rec.id)
    else {
        return Ok(());
    };
    if vault.gen != set.gen || !vault.peers.contains(&me) {
        let _ = cache.replica_drop(rec.id, set.gen);
        return Ok(());
    }
    // A replay of this host's that stopped (a restart) names this host already: the owner
    // it replays for is the one named before it.
    let dead = match vault.previous_owner.clone() {
        Some(before) if vault.owner == me => before,
        _ => vault.owner.clone(),
    };
    let started = Instant::now();
    // The datastore first: if it cannot be reached, the replicas stay as they are for the
    // next attempt.
    let store = d.store_pub(&rec.datastore).map_err(|e| e.to_string())?;
    let extent = store
        .open_volume(&rec.spec())
        .await
        .map_err(|e| format!("datastore {:?}: {e}; retrying", rec.datastore))?;
    // How far to go: no further than every other peer that could take over holds, so that
    // whichever of them continues if this host dies midway can rewrite every block this
    // host wrote (DESIGN §2: replay always completes the window in flight). Every completed
    // write is on every listed peer, so only writes that never completed stay behind. A
    // peer that cannot say is taken out of the vault first: it will not continue.
    // Sealed first: from here no write of the owner completes (this host no longer takes
    // them), so every completed write is at most what each listed peer holds now.
    let (gen, own) = cache
        .replica_seal(rec.id, vault.checkpoint)
        .map_err(|e| format!("seal this host's replicas: {e:?}"))?
        .ok_or("this host's replicas went away")?;
    if gen != vault.gen {
        return Err(format!(
            "this host's replicas are of generation {gen}, the vault's {}",
            vault.gen
        ));
    }
    let others = ask_other_peers(d, rec, &vault, own).await?;
    let from = others.start(vault.checkpoint, set.checkpoint);
    let Others { upto, kept, .. } = others;
    let mut vault = vault;
    if kept.len() + 1 < vault.peers.len() {
        let left: Vec<String> = vault
            .peers
            .iter()
            .filter(|p| **p != me && !kept.contains(*p))
            .cloned()
            .collect();
        vault.peers.retain(|p| *p == me || kept.contains(p));
        d.coord.put_vault(&vault).await.map_err(|e| {
            format!("take unreachable peer(s) {left:?} out of the vault: {e}; retrying")
        })?;
        warn!(
            "volume {:?}: peer(s) {left:?} could not say what they hold; taken out of the \
             vault before the replay, they will not continue it",
            rec.name
        );
    }
    // The vault names this host as the volume's writer before anything is written: an
    // owner that comes back (cut off from etcd, its lease lapsed while it lived) must find
    // that another host wrote its datastore, even if this replay stops before its first
    // checkpoint update. Otherwise it would take the lock back as its own and destage on
    // from its own checkpoint, over blocks this replay had set back to older versions.
    let replaying = Vault {
        owner: me.clone(),
        previous_owner: Some(dead.clone()),
        handoff: false,
        checkpoint: from,
        ..vault.clone()
    };
    d.coord
        .put_vault(&replaying)
        .await
        .map_err(|e| format!("name this host as the replaying one in the vault: {e}; retrying"))?;
    let n = cache
        .promote_replicas(rec.id, from, upto)
        .map_err(|e| e.to_string())?;
    warn!(
        "volume {:?}: its owner {dead:?} is gone; replaying {n} write(s) from this host's \
         replicas (generation {}, from checkpoint {from}, up to write {upto}, which peer(s) \
         {kept:?} hold too)",
        rec.name, vault.gen,
    );
    let done = replay_to_datastore(d, cache, rec, extent, replaying).await?;
    info!(
        "volume {:?}: online replay done in {:.1} s; its datastore is current (vault: wt, \
         generation {}); the owner takes it back when it returns",
        rec.name,
        started.elapsed().as_secs_f64(),
        done.gen
    );
    Ok(())
}

/// Refuses to start a replay on a host whose datastore writes stopped for good (it lost vault
/// locks while its lease was gone; [`datastore::fence::Fence::revoke`]).
fn revoked_hosts_do_not_replay(d: &Daemon) -> Result<(), String> {
    if d.coord.fence().is_revoked() {
        return Err(
            "this host's datastore writes stopped for good (it lost vault locks while \
                    its lease was gone): restart vestad; not replaying"
                .into(),
        );
    }
    Ok(())
}

/// What the other peers of a volume hold, for a host about to replay it ([`ask_other_peers`]).
struct Others {
    /// How far all of them and this host hold its replicas without a gap.
    upto: u64,
    /// The peers that answered.
    kept: Vec<String>,
    /// The newest checkpoint any of them was sent: every write up to it is on the datastore.
    checkpoint: u64,
}

/// Asks every other peer the vault names how far it holds `rec`'s replicas (durably) above
/// the vault's checkpoint, and the newest checkpoint it was sent. A peer that is down,
/// unreachable or holds no replicas of the vault's generation is left out; if the host list
/// cannot be read, nothing is decided (an error). `own`: how far this host holds them.
async fn ask_other_peers(
    d: &Daemon,
    rec: &VolumeRecord,
    vault: &Vault,
    own: u64,
) -> Result<Others, String> {
    let me = d.coord.host();
    let others: Vec<String> = vault.peers.iter().filter(|p| *p != me).cloned().collect();
    let answers = ask_held(d, rec, vault, &others).await?;
    for (name, answer) in &answers {
        if let Held::Nothing(e) | Held::Unknown(e) = answer {
            warn!("volume {:?}: before replaying: {name}: {e}", rec.name)
        }
    }
    Ok(Others::tally(own, answers))
}

impl Others {
    /// From the other peers' answers; `own`: how far this host holds.
    fn tally(own: u64, answers: Vec<(String, Held)>) -> Others {
        let mut o = Others {
            upto: own,
            kept: Vec::new(),
            checkpoint: 0,
        };
        for (name, answer) in answers {
            if let Held::Upto(held) = answer {
                o.upto = o.upto.min(held.upto);
                o.checkpoint = o.checkpoint.max(held.checkpoint);
                o.kept.push(name);
            }
        }
        o
    }

    /// Where a replay starts: after the newest checkpoint any of them knows, the vault's
    /// (`vault`) and this host's own (`own`); everything up to it is on the datastore.
    /// Started lower, the replay would rewrite older versions of blocks the datastore holds
    /// newer ones of, and if it stopped midway, a peer that continues from its own, newer
    /// checkpoint would not put those back: it dropped the writes below it.
    fn start(&self, vault: u64, own: u64) -> u64 {
        vault.max(own).max(self.checkpoint)
    }
}

/// Replays what `cache` recovered (or promoted) for `rec` onto its datastore, under the vault
/// lock this host holds: the volume attaches in wb, its destager replays in `ser` order (one
/// window in pieces, its checkpoint moved once at the end: `engine::cache`'s `VolState::reach`;
/// a host that continues after this one died starts again from the vault's checkpoint), and at
/// the end the
/// vault says `wt` with a new generation, so every other copy is stale. Returns that record.
///
/// It runs to its end: giving the lock up with the volume still destaging here would let
/// another host write the datastore at the same time. Vault errors are retried; only a lost
/// lock (another host has it: this host's fence is closed and stays closed) or a dead cache
/// device ends it early. Either way the destager stops before this returns.
async fn replay_to_datastore(
    d: &Arc<Daemon>,
    cache: &Arc<CacheHost>,
    rec: &VolumeRecord,
    extent: datastore::Extent,
    mut replaying: Vault,
) -> Result<Vault, String> {
    let volume = Volume::open(
        rec.id,
        rec.name.clone(),
        Policy::Wb,
        rec.tuning,
        extent,
        Some(cache.clone()),
    )
    .map_err(|e| e.to_string())?;
    let c = volume.cache().ok_or("volume did not attach to the cache")?;
    let mut last_put = Instant::now();
    let mut fail = None;
    while !c.clean() {
        c.wait_clean(Duration::from_millis(250)).await;
        if last_put.elapsed() >= VAULT_CHECKPOINT_EVERY && c.checkpoint() > replaying.checkpoint {
            replaying.checkpoint = c.checkpoint();
            // A host that continues after this one dies starts from here.
            match d.coord.put_vault(&replaying).await {
                Ok(()) => {}
                Err(cluster::Error::NotHeld(e)) => {
                    fail = Some(format!("lost the vault lock: {e}"));
                    break;
                }
                Err(e) => warn!("volume {:?}: vault checkpoint: {e}; retrying", rec.name),
            }
            last_put = Instant::now();
        }
        if let Some(r) = c.report().degraded.filter(|_| cache.log().is_failed()) {
            fail = Some(format!("replay stopped: {r}"));
            break;
        }
        if d.coord.fence().is_revoked() {
            // Its writes are refused from now on; the lock goes back for another host.
            fail = Some("replay stopped: this host's datastore writes stopped for good".into());
            break;
        }
    }
    let done = Vault {
        policy: Policy::Wt,
        gen: c.gen() + 1,
        checkpoint: c.checkpoint(),
        peers: Vec::new(),
        ..replaying
    };
    while fail.is_none() {
        match d.coord.put_vault(&done).await {
            Ok(()) => break,
            Err(cluster::Error::NotHeld(e)) => fail = Some(format!("lost the vault lock: {e}")),
            Err(e) => {
                warn!(
                    "volume {:?}: record the replay in the vault: {e}; retrying",
                    rec.name
                );
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
    volume.stop_destaging().await;
    volume.detach_cache().await;
    match fail {
        Some(e) => Err(e),
        None => Ok(done),
    }
}

/// Surrogate replay (DESIGN §4, FVP Table 1's last cascade): the owner and every peer of some
/// volumes are gone, but the owner's cache device survives and is reachable from this host
/// (moved, or on shared storage). Its log is scanned here, and each volume with dirty data in
/// it is replayed to its datastore under its vault lock, as a peer would from replicas. A
/// volume whose vault is of a newer generation than the log's copy was replayed already and is
/// skipped; one a peer began to replay from below the file's checkpoint is left alone unless
/// `force` ([`surrogate_verdict`]). Returns a line per volume found, and how many of them
/// were to be replayed and were not.
pub async fn surrogate_replay(
    d: &Arc<Daemon>,
    path: &std::path::Path,
    force: bool,
) -> Result<(Vec<String>, usize), String> {
    if d.coord.kind() == "local" {
        return Err(
            "surrogate replay needs a cluster (etcd): with one host, restart its vestad \
                    on the cache device instead"
                .into(),
        );
    }
    revoked_hosts_do_not_replay(d)?;
    let own = d.config.cache_device().ok().flatten().map(|(p, _, _)| p);
    if own.as_deref().and_then(|p| std::fs::canonicalize(p).ok())
        == std::fs::canonicalize(path).ok()
    {
        return Err(format!(
            "{} is this host's own cache device",
            path.display()
        ));
    }
    let size = std::fs::metadata(path)
        .map_err(|e| format!("cache file {}: {e}", path.display()))?
        .len();
    let dev = Arc::new(
        cachelog::FileCache::open(path, size)
            .map_err(|e| format!("open {}: {e}", path.display()))?,
    );
    let host = CacheHost::open(dev, engine::cache::SEGMENT_DEFAULT).map_err(|e| e.to_string())?;
    let state = d.coord.state().await.map_err(|e| e.to_string())?;
    let found = host.recovered_volumes();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let destager = {
        let (h, s) = (host.clone(), stop.clone());
        tokio::spawn(h.run_destager(move || s.load(Ordering::SeqCst)))
    };
    let mut out = Vec::new();
    let mut not_replayed = 0;
    for (id, _, n) in found {
        if n == 0 {
            continue;
        }
        let Some(rec) = state.volumes.iter().find(|v| v.id == id).cloned() else {
            out.push(format!(
                "volume {id}: no longer exists; its {n} dirty write(s) are left"
            ));
            continue;
        };
        match surrogate_one(d, &host, &rec, n, force).await {
            Ok(line) => out.push(line),
            Err(e) => {
                out.push(format!("volume {:?}: not replayed: {e}", rec.name));
                not_replayed += 1;
            }
        }
    }
    stop.store(true, Ordering::SeqCst);
    let _ = destager.await;
    Ok((out, not_replayed))
}

pub(crate) async fn surrogate_one(
    d: &Arc<Daemon>,
    host: &Arc<CacheHost>,
    rec: &VolumeRecord,
    n: usize,
    force: bool,
) -> Result<String, String> {
    if !claim_replay(d, rec.id).await {
        return Err("a replay of it runs on this host already".into());
    }
    let r = surrogate_locked(d, host, rec, n, force).await;
    replay_ended(d, rec.id);
    r
}

async fn surrogate_locked(
    d: &Arc<Daemon>,
    host: &Arc<CacheHost>,
    rec: &VolumeRecord,
    n: usize,
    force: bool,
) -> Result<String, String> {
    match d.coord.lock_vault(rec.id).await {
        Ok(()) => {}
        Err(e @ cluster::Error::Locked(_)) => return Err(e.to_string()),
        Err(e) => {
            // The coordinator may have granted it all the same.
            give_lock_back(d, rec.id, &rec.name).await;
            return Err(e.to_string());
        }
    }
    holds_lock(d, rec.id);
    let r = async {
        let vault = d.coord.vault(rec.id).await.map_err(|e| e.to_string())?;
        let gen = host.recovered_gen(rec.id).unwrap_or(0);
        let checkpoint = host.recovered_checkpoint(rec.id).unwrap_or(0);
        let mut forced = None;
        match surrogate_verdict(vault.as_ref(), gen, checkpoint) {
            Verdict::Replay => {}
            Verdict::Skip(why) => return Ok(format!("volume {:?}: skipped, {why}", rec.name)),
            Verdict::Unsafe(why) if force => {
                warn!(
                    "volume {:?}: replayed with --force although {why}",
                    rec.name
                );
                forced = Some(why);
            }
            Verdict::Unsafe(why) => {
                return Err(format!(
                    "{why}. Start one of those peers again to finish that replay; if none can \
                     come back, `--force` replays this file anyway: it loses nothing if that \
                     replay got past write {checkpoint} (a replay records its progress in the \
                     vault only when it is done), and otherwise gives up what it set back below \
                     that"
                ))
            }
        }
        let store = d.store_pub(&rec.datastore).map_err(|e| e.to_string())?;
        let extent = store
            .open_volume(&rec.spec())
            .await
            .map_err(|e| e.to_string())?;
        let started = Instant::now();
        let me = d.coord.host().to_owned();
        let replaying = Vault {
            volume: rec.id,
            policy: Policy::Wb,
            checkpoint: 0,
            gen,
            owner: me,
            peers: Vec::new(),
            previous_owner: vault.map(|v| v.owner),
            handoff: false,
        };
        // Named before anything is written, as in an online replay.
        d.coord
            .put_vault(&replaying)
            .await
            .map_err(|e| format!("name this host as the replaying one in the vault: {e}"))?;
        replay_to_datastore(d, host, rec, extent, replaying).await?;
        let line = format!(
            "volume {:?}: replayed {n} write(s) in {:.1} s",
            rec.name,
            started.elapsed().as_secs_f64()
        );
        Ok(match forced {
            None => format!("{line}; its datastore is current"),
            Some(why) => format!(
                "{line} (forced: {why}; blocks that replay set back and this file no longer \
                 holds may have older data)"
            ),
        })
    }
    .await;
    give_lock_back(d, rec.id, &rec.name).await;
    if let Ok(line) = &r {
        info!("surrogate replay: {line}");
    }
    r
}

/// What a surrogate replay does with a volume whose dirty data in the cache file is of
/// generation `gen`, above checkpoint `checkpoint`.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    Replay,
    /// Replayed already: the datastore is newer than the file.
    Skip(String),
    /// A peer began an online replay of this generation and did not finish it (the vault
    /// names a listed peer as the writer). That replay started from the newest checkpoint the
    /// peers knew, which may be older than the owner's own, and each window it wrote set its
    /// blocks to their newest version within it: blocks it set back from `vault.checkpoint`
    /// on, with no write above the file's checkpoint, stay old if this file is replayed (it
    /// holds nothing below its checkpoint). Only the peers' replicas reach back that far.
    Unsafe(String),
}

fn surrogate_verdict(vault: Option<&Vault>, gen: u64, checkpoint: u64) -> Verdict {
    let Some(v) = vault else {
        return Verdict::Replay;
    };
    if v.gen > gen {
        return Verdict::Skip(format!(
            "already replayed (vault generation {} > {gen} in the cache file)",
            v.gen
        ));
    }
    if v.gen == gen && v.peers.contains(&v.owner) && v.checkpoint < checkpoint {
        return Verdict::Unsafe(format!(
            "its peer {:?} began replaying it and did not finish, and the vault has that replay \
             no further than write {}, below this file's checkpoint {checkpoint} (its peers: \
             {:?})",
            v.owner, v.checkpoint, v.peers
        ));
    }
    Verdict::Replay
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The wait starts at CHANGE_RETRY_FIRST, doubles with each failure, stops growing at
    /// CHANGE_RETRY_MAX, counts from the failure it follows, and starts over after a while
    /// without failures.
    #[test]
    fn a_peer_change_waits_longer_after_each_failure_up_to_a_limit() {
        let t0 = Instant::now();
        let first = Backoff::after_failure(None, t0);
        assert_eq!(first.wait, CHANGE_RETRY_FIRST);
        assert!(!first.due(t0));
        assert!(!first.due(t0 + CHANGE_RETRY_FIRST - Duration::from_millis(1)));
        assert!(first.due(t0 + CHANGE_RETRY_FIRST));
        let mut b = first;
        let mut waits = vec![b.wait];
        for _ in 1..12u32 {
            // Failing again as soon as it is due.
            let now = b.next;
            b = Backoff::after_failure(Some(b), now);
            assert_eq!(b.next, now + b.wait);
            waits.push(b.wait);
        }
        assert!(waits
            .windows(2)
            .all(|w| w[1] == (w[0] * 2).min(CHANGE_RETRY_MAX)));
        assert_eq!(*waits.last().unwrap(), CHANGE_RETRY_MAX);
        assert!(waits.iter().all(|w| *w <= CHANGE_RETRY_MAX));
        // Long after the last was due, a failure starts over.
        let later = b.next + CHANGE_RETRY_MAX;
        assert_eq!(
            Backoff::after_failure(Some(b), later).wait,
            CHANGE_RETRY_FIRST
        );
        let soon = b.next + CHANGE_RETRY_MAX - Duration::from_millis(1);
        assert_eq!(Backoff::after_failure(Some(b), soon).wait, CHANGE_RETRY_MAX);
    }

    /// A surrogate replay goes on over a vault its owner or an earlier surrogate replay
    /// wrote, and over a peer's unfinished replay that got as far as the file's checkpoint;
    /// not over one that stopped below it.
    #[test]
    fn a_surrogate_replay_goes_on_only_above_what_a_peers_unfinished_replay_covered() {
        let v = |owner: &str, peers: &[&str], gen, checkpoint| Vault {
            volume: Uuid::nil(),
            policy: Policy::Wb,
            checkpoint,
            gen,
            owner: owner.into(),
            peers: peers.iter().map(|p| p.to_string()).collect(),
            previous_owner: None,
            handoff: false,
        };
        let verdict = |v: &Vault| surrogate_verdict(Some(v), 3, 10);
        assert_eq!(surrogate_verdict(None, 3, 10), Verdict::Replay);
        assert_eq!(
            verdict(&v("a", &["b"], 3, 2)),
            Verdict::Replay,
            "the owner's"
        );
        assert_eq!(
            verdict(&v("d", &[], 3, 2)),
            Verdict::Replay,
            "a surrogate's"
        );
        assert!(matches!(verdict(&v("b", &["b"], 4, 2)), Verdict::Skip(_)));
        assert_eq!(verdict(&v("b", &["b", "c"], 3, 10)), Verdict::Replay);
        assert_eq!(verdict(&v("b", &["b", "c"], 3, 12)), Verdict::Replay);
        match verdict(&v("b", &["c", "b"], 3, 9)) {
            Verdict::Unsafe(why) => assert!(why.contains("no further than write 9"), "{why}"),
            other => panic!("{other:?}"),
        }
    }

    /// A replay goes as far as every peer that could continue it holds, and starts after the
    /// newest checkpoint any of them, the vault or this host knows.
    #[test]
    fn a_replay_starts_after_the_newest_checkpoint_any_peer_knows() {
        let held = |upto, checkpoint| Held::Upto(peer::Holding { upto, checkpoint });
        let o = Others::tally(
            50,
            vec![
                ("b".into(), held(40, 30)),
                ("c".into(), held(60, 35)),
                ("d".into(), Held::Unknown("down".into())),
                ("e".into(), Held::Nothing("nothing".into())),
            ],
        );
        assert_eq!((o.upto, o.kept.clone()), (40, vec!["b".into(), "c".into()]));
        assert_eq!(o.start(10, 20), 35, "c's checkpoint");
        assert_eq!(o.start(36, 20), 36, "the vault's");
        assert_eq!(o.start(10, 37), 37, "this host's own");
        let alone = Others::tally(50, Vec::new());
        assert_eq!((alone.upto, alone.start(10, 20)), (50, 20));
    }
}
