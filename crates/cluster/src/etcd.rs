//! The `etcd` coordinator: several hosts sharing one etcd cluster (v3 API).
//!
//! Keys, under a prefix (`/vesta` by default; one prefix per pod):
//!
//! | key | value | lease |
//! |---|---|---|
//! | `{p}/datastores/{name}` | `DatastoreSpec` (JSON) | none |
//! | `{p}/volumes/{name}` | `VolumeRecord` (JSON) | none |
//! | `{p}/members/{host}` | `HostRecord`: every host that ever registered | none |
//! | `{p}/hosts/{host}` | `HostRecord`: present while the host is alive | the host's |
//! | `{p}/vault-locks/{volume id}` | the holder's host name | the holder's |
//! | `{p}/vaults/{volume id}` | `Vault` (JSON) | none |
//! | `{p}/deleted/{volume id}` | when the volume was deleted (Unix seconds): its storage, if found with no record, is freed, not imported; forgotten after `DELETED_KEEP` | none |
//! | `{p}/ds-locks/{datastore}` | etcd's lock service, for metadata changes | the locker's |
//! | `{p}/stats/devices/{host}`, `{p}/stats/volumes/{host}` | the host's balancing statistics (opaque) | the host's |
//! | `{p}/stats/aggregator` | the name of the host that combines them | the aggregator's |
//! | `{p}/stats/pod` | the combined statistics (opaque) | the aggregator's |
//! | `{p}/peer-key` | 32 random bytes hosts prove they know before taking each other's `wbp` writes | none |
//! | `{p}/pod-id` | the pod's UUID (text), which the labels of its LUNs carry | none |
//!
//! **Statistics** (DESIGN §8, §11): every host puts its own documents; one host at a time,
//! the aggregator, reads them all and puts the pod's, which every host reads. So each host
//! reads one document per round, not one per host: the traffic grows with hosts, not with
//! their square.
//!
//! **One lease per host** (DESIGN §11): the host key and every vault lock the host holds are
//! bound to it, so renewals grow with hosts, not volumes, and a dead host's locks all go free
//! together when its lease expires.
//!
//! **Self-fencing.** Each renewal is timed from when it was sent; after a successful one, the
//! host's [`Fence`] allows datastore writes until `sent + ttl / 2`. The lease cannot expire
//! before `sent + ttl`, so a host that stops hearing from etcd stops writing datastores at
//! least `ttl / 2` before any contender could take one of its locks. That half is the budget
//! for a write issued just before the deadline to reach the datastore.
//!
//! **A lost lease** (etcd said the lease is gone, e.g. after a long partition): the fence
//! closes, the host registers again with a new lease and re-takes its vault locks. If another
//! host took one meanwhile, this host's view of that volume is stale: the fence stays closed
//! (no datastore writes from this host at all) and the log says to restart vestad, which
//! then serves only what it can lock. Refusing all writes is blunt, and it is never wrong.
//! Until a lock is confirmed taken back, this host does not write that volume's vault: a
//! lock taken back for a volume another host took over meanwhile is given up again, and a
//! vault write landing in between would have replaced that host's record with this one's
//! stale copy.
//!
//! **Restart of the same host.** A lock whose value is this host's name but whose lease is
//! not this incarnation's belongs to an earlier incarnation of this host. Registration
//! succeeded, so no other live process holds the name (the host key shares that earlier
//! lease): the earlier one is dead, and its locks are adopted.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, LockOptions, PutOptions,
    Txn, TxnOp, TxnOpResponse, WatchOptions,
};
use tracing::{error, info, warn};
use uuid::Uuid;

use datastore::fence::Fence;
use datastore::DatastoreSpec;

use crate::record::{HostRecord, HostStatus, State, Vault, VolumeRecord};
use crate::{Coordinator, DatastoreLock, Error, Result, StatsDoc};

/// How to reach etcd and who this host is.
#[derive(Debug, Clone)]
pub struct EtcdConfig {
    pub endpoints: Vec<String>,
    /// Key prefix, e.g. `/vesta`.
    pub prefix: String,
    pub host: HostRecord,
    /// The host lease's time to live. etcd refuses less than about 3 s (its minimum TTL).
    pub lease_ttl: Duration,
}

/// Whether a request ended because it ran out of time (see [`REQUEST_TIMEOUT`]).
fn timed_out(st: &tonic::Status) -> bool {
    matches!(
        st.code(),
        tonic::Code::DeadlineExceeded | tonic::Code::Cancelled
    )
}

/// How long a datastore metadata lock is waited for before the operation fails.
const DATASTORE_LOCK_WAIT: Duration = Duration::from_secs(30);
/// Any one etcd request; a lock wait is made of several.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

pub struct EtcdCoordinator {
    client: Client,
    prefix: String,
    name: String,
    endpoints: String,
    ttl: Duration,
    session: Arc<Session>,
}

/// What the renewal task and the coordinator share.
struct Session {
    lease: AtomicI64,
    /// The lease and how many times the fence had closed when it was granted, set together
    /// ([`DatastoreLock::closes`]).
    epoch: Mutex<(i64, u64)>,
    host: Mutex<HostRecord>,
    /// Volumes whose vault lock this host holds, each with its lock key's create revision:
    /// one per hold, so that a vault write sent in one hold never lands in a later one under
    /// the same lease ([`Coordinator::put_vault`]).
    held: Mutex<BTreeMap<Uuid, i64>>,
    /// Re-registrations begun ([`reregister`]), counted under `held`'s lock as each copies
    /// `held`: a lock taken under a lease that one of them replaced is not held (see
    /// [`Coordinator::lock_vault`]).
    reregistrations: AtomicU64,
    /// Volumes whose vault lock is being taken back after a lost lease ([`reregister`]):
    /// until that is decided (see [`retake_lock`]) their vault is not written and their lock
    /// is not taken by anything else of this host. Filled before the new lease is published,
    /// so a call that reads the new lease sees it.
    retaking: Mutex<BTreeSet<Uuid>>,
    fence: Arc<Fence>,
    /// Set by [`Coordinator::shutdown`]: the renewal task stops.
    stopping: AtomicBool,
    /// Places where a test holds the re-registration ([`pause`]).
    #[cfg(test)]
    pauses: Mutex<std::collections::HashMap<&'static str, Arc<tests::Pause>>>,
    /// A test's etcd error for the lock the re-registration takes back after this many
    /// more (`u64::MAX`: none).
    #[cfg(test)]
    fail_retake: AtomicU64,
    /// How often `connect` tried to register.
    #[cfg(test)]
    tries: AtomicU64,
}

impl EtcdCoordinator {
    /// Connects, registers this host with a new lease and starts renewing it. If the host
    /// name is still registered by an earlier incarnation (killed, its lease not yet
    /// expired), waits up to one lease TTL for that registration to lapse.
    pub async fn connect(cfg: EtcdConfig) -> Result<EtcdCoordinator> {
        let endpoints = cfg.endpoints.join(",");
        let opts = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(3))
            .with_timeout(REQUEST_TIMEOUT);
        let client = Client::connect(&cfg.endpoints, Some(opts))
            .await
            .map_err(|e| {
                Error::Unavailable(format!(
                    "cannot reach etcd at {endpoints}: {e}; start etcd or fix [cluster] etcd in \
                     the config"
                ))
            })?;
        let c = EtcdCoordinator {
            client,
            prefix: cfg.prefix.trim_end_matches('/').to_string(),
            name: cfg.host.name.clone(),
            endpoints,
            ttl: cfg.lease_ttl,
            session: Arc::new(Session {
                lease: AtomicI64::new(0),
                epoch: Mutex::new((0, 0)),
                host: Mutex::new(cfg.host),
                held: Mutex::new(BTreeMap::new()),
                reregistrations: AtomicU64::new(0),
                retaking: Mutex::new(BTreeSet::new()),
                fence: Arc::new(Fence::closed()),
                stopping: AtomicBool::new(false),
                #[cfg(test)]
                pauses: Mutex::default(),
                #[cfg(test)]
                fail_retake: AtomicU64::new(u64::MAX),
                #[cfg(test)]
                tries: AtomicU64::new(0),
            }),
        };
        let give_up = Instant::now() + c.ttl + Duration::from_secs(1);
        let mut said = false;
        loop {
            #[cfg(test)]
            c.session.tries.fetch_add(1, Ordering::Relaxed);
            match c.register().await {
                Ok(()) => break,
                Err(Error::Locked(_)) if Instant::now() < give_up => {
                    if !said {
                        info!(
                            "host name {:?} is still registered (an earlier run that did not \
                             stop cleanly?); waiting up to {:?} for that registration to lapse",
                            c.name, c.ttl
                        );
                        said = true;
                    }
                    // Not a moment longer: until it registers again, its peers count it
                    // dead and may replay volumes it would have replayed itself, from its
                    // own cache. A watch sees the key go the moment etcd expires its lease,
                    // with no writes to etcd meanwhile (a poll registering every 50 ms made
                    // three a try).
                    c.wait_deleted(&c.key("hosts", &c.name), give_up).await?;
                }
                Err(e) => return Err(e),
            }
        }
        info!(
            "registered host {:?} with etcd at {} (lease ttl {:?})",
            c.name, c.endpoints, c.ttl
        );
        tokio::spawn(renew(
            c.client.clone(),
            Arc::downgrade(&c.session),
            c.prefix.clone(),
            c.ttl,
        ));
        Ok(c)
    }

    /// Returns once `key` is gone (deleted, as when the lease it is bound to expires), or
    /// after at most a second, or at `until`: the caller tries again in any case, so a
    /// watch that missed an event costs a second, not the wait.
    async fn wait_deleted(&self, key: &str, until: Instant) -> Result<()> {
        let mut kv = self.client.kv_client();
        let r = kv.get(key, None).await.map_err(|e| self.unavailable(e))?;
        if r.kvs().is_empty() {
            return Ok(());
        }
        // From the revision after the one read: a delete between the read and the watch's
        // start is still seen.
        let from = r.header().map_or(0, |h| h.revision()) + 1;
        let mut watch = self.client.watch_client();
        let deleted = async {
            let mut events = watch
                .watch(key, Some(WatchOptions::new().with_start_revision(from)))
                .await?;
            while let Some(m) = events.message().await? {
                if m.events()
                    .iter()
                    .any(|e| e.event_type() == EventType::Delete)
                {
                    return Ok(true);
                }
                if m.canceled() {
                    break;
                }
            }
            Ok::<bool, etcd_client::Error>(false)
        };
        let until = until.min(Instant::now() + Duration::from_secs(1));
        match tokio::time::timeout_at(until.into(), deleted).await {
            Ok(Ok(true)) | Err(_) => {}
            // Polled then, as before there was a watch, so a watch that keeps ending does
            // not make the caller spin: the try that follows says whether etcd itself is
            // unreachable.
            Ok(Ok(false)) => tokio::time::sleep(Duration::from_millis(50)).await,
            Ok(Err(e)) => {
                warn!("watching etcd key {key}: {e}; polling instead");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        Ok(())
    }

    /// Stores `value` at `key` unless something is stored there already, and returns what is
    /// stored there now (the pod's peer key and id). Not bound to a lease: such a key outlives
    /// every host. Whoever asks first stores theirs; one transaction, so everyone gets back
    /// the same.
    async fn put_if_absent(&self, key: &str, value: Vec<u8>) -> Result<Vec<u8>> {
        let txn = Txn::new()
            .when([Compare::create_revision(key, CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key, value.clone(), None)])
            .or_else([TxnOp::get(key, None)]);
        let mut kv = self.client.kv_client();
        let r = kv.txn(txn).await.map_err(|e| self.unavailable(e))?;
        if r.succeeded() {
            return Ok(value);
        }
        Ok(first_get(&r.op_responses())
            .map(|kv| kv.value().to_vec())
            .unwrap_or_default())
    }

    fn key(&self, kind: &str, name: &str) -> String {
        format!("{}/{kind}/{name}", self.prefix)
    }

    fn unavailable(&self, e: etcd_client::Error) -> Error {
        Error::Unavailable(format!("etcd at {}: {e}", self.endpoints))
    }

    fn lease(&self) -> i64 {
        self.session.lease.load(Ordering::Acquire)
    }

    /// The lease, for a change to `volume`'s vault or lock; refused while the re-registration
    /// takes its lock back ([`Session::retaking`]). The lease is read first: the volumes are
    /// marked before a new lease is published, so a change under the new one sees the mark.
    fn lease_unless_retaking(&self, volume: Uuid) -> Result<i64> {
        let lease = self.lease();
        if self
            .session
            .retaking
            .lock()
            .expect("lock")
            .contains(&volume)
        {
            return Err(Error::Unavailable(format!(
                "host {:?} is taking the vault lock of volume {volume} back after its etcd \
                 lease lapsed",
                self.name
            )));
        }
        Ok(lease)
    }

    /// The transaction that writes `v` if this host holds its lock under `lease` in the hold
    /// whose key was created at revision `created`. The fence: etcd applies the write only
    /// while the lock is bound to this incarnation's lease, and only in the same hold, so a
    /// write applied late (after its request timed out here) cannot land in a later hold
    /// under the same lease and cover what another host wrote in between.
    fn vault_put(&self, v: &Vault, lease: i64, created: i64) -> Txn {
        let id = v.volume.to_string();
        let lock = self.key("vault-locks", &id);
        Txn::new()
            .when([
                Compare::lease(lock.clone(), CompareOp::Equal, lease),
                Compare::create_revision(lock, CompareOp::Equal, created),
            ])
            .and_then([TxnOp::put(self.key("vaults", &id), json(v), None)])
    }

    /// Grants a lease, creates the host key under it and opens the fence.
    async fn register(&self) -> Result<()> {
        let sent = register(&self.client, &self.session, &self.prefix, self.ttl)
            .await
            .map_err(|e| match e {
                Reg::Etcd(e) => self.unavailable(e),
                Reg::Taken(msg) => Error::Locked(msg),
            })?;
        self.session.fence.extend_to(sent + self.ttl / 2);
        Ok(())
    }

    /// Stops renewing and, if `quiet` (no datastore write of this host is still in service),
    /// removes the host key, so `vesta host list` shows the host as down at once. Vault
    /// locks are left to expire with the lease (or to be adopted by the next incarnation of
    /// this host): a volume may still hold dirty data in this host's cache, and no other host
    /// may write its datastore before that data is replayed. Not quiet, the host key stays
    /// until the lease lapses: the next incarnation registers, and adopts the locks, only
    /// after it could have expired, as after a crash, and no sooner than a write sent under
    /// it may still land.
    async fn leave(&self, quiet: bool) {
        self.session.stopping.store(true, Ordering::Release);
        if !quiet {
            warn!(
                "datastore writes of host {:?} still in service at the stop: its etcd lease \
                 is left to lapse ({:?}), and its next start waits for that",
                self.name, self.ttl
            );
            return;
        }
        let key = self.key("hosts", &self.name);
        let mut kv = self.client.kv_client();
        if let Err(e) = kv.delete(key, None).await {
            warn!("deregister host {:?}: {e}", self.name);
        }
    }

    /// Runs a transaction; whether its comparisons held.
    async fn txn_held(&self, txn: Txn) -> Result<bool> {
        let mut kv = self.client.kv_client();
        Ok(kv
            .txn(txn)
            .await
            .map_err(|e| self.unavailable(e))?
            .succeeded())
    }

    async fn get_json<T: serde::de::DeserializeOwned>(&self, key: String) -> Result<Option<T>> {
        let mut kv = self.client.kv_client();
        let r = kv
            .get(key.clone(), None)
            .await
            .map_err(|e| self.unavailable(e))?;
        match r.kvs().first() {
            None => Ok(None),
            Some(x) => serde_json::from_slice(x.value())
                .map(Some)
                .map_err(|e| corrupt(&key, e)),
        }
    }
}

fn corrupt(key: &str, e: serde_json::Error) -> Error {
    Error::Corrupt {
        path: format!("etcd key {key}"),
        msg: e.to_string(),
    }
}

fn json<T: serde::Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).expect("records serialize")
}

enum Reg {
    Etcd(etcd_client::Error),
    Taken(String),
}

impl From<etcd_client::Error> for Reg {
    fn from(e: etcd_client::Error) -> Reg {
        Reg::Etcd(e)
    }
}

/// Grants a lease and creates the host key under it. Returns when the grant was sent: the
/// caller opens the fence from there, once it knows it may write (after its locks are back).
async fn register(
    client: &Client,
    s: &Session,
    prefix: &str,
    ttl: Duration,
) -> std::result::Result<Instant, Reg> {
    let mut lease = client.lease_client();
    let sent = Instant::now();
    let granted = lease.grant(ttl.as_secs() as i64, None).await?;
    let id = granted.id();
    let host = {
        let mut h = s.host.lock().expect("lock");
        h.started_unix = crate::now_unix();
        h.clone()
    };
    let key = format!("{prefix}/hosts/{}", host.name);
    let member = format!("{prefix}/members/{}", host.name);
    let txn = Txn::new()
        .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
        .and_then([
            TxnOp::put(
                key.clone(),
                json(&host),
                Some(PutOptions::new().with_lease(id)),
            ),
            TxnOp::put(member, json(&host), None),
        ])
        .or_else([TxnOp::get(key, None)]);
    let mut kv = client.kv_client();
    let r = kv.txn(txn).await?;
    if !r.succeeded() {
        let _ = lease.revoke(id).await;
        let other = first_get(&r.op_responses())
            .and_then(|kv| serde_json::from_slice::<HostRecord>(kv.value()).ok());
        let api = other
            .and_then(|o| o.api)
            .unwrap_or_else(|| "unknown".into());
        return Err(Reg::Taken(format!(
            "host name {:?} is registered by another running vestad (admin API {api}); give \
             this one another [cluster] host name, or stop the other",
            host.name
        )));
    }
    // Each lease its own epoch. The fence is closed here (not yet opened, or closed when
    // the lease before was lost), so one more close changes only the count: without it a
    // registration that replaced one whose re-taking failed (`reregister`) would share its
    // epoch, and a datastore lock granted under that abandoned lease would count as held.
    s.fence.close();
    *s.epoch.lock().expect("lock") = (id, s.fence.closes());
    s.lease.store(id, Ordering::Release);
    Ok(sent)
}

fn first_get(rs: &[TxnOpResponse]) -> Option<etcd_client::KeyValue> {
    rs.iter().find_map(|r| match r {
        TxnOpResponse::Get(g) => g.kvs().first().cloned(),
        _ => None,
    })
}

/// Takes (or adopts from an earlier incarnation of this host) one vault lock; its key's
/// create revision.
async fn take_lock(
    client: &Client,
    prefix: &str,
    name: &str,
    lease: i64,
    volume: Uuid,
) -> std::result::Result<i64, Reg> {
    let key = format!("{prefix}/vault-locks/{volume}");
    take_key(client, key, name, lease).await?.map_err(|holder| {
        Reg::Taken(format!(
            "volume {volume}'s vault lock is held by host {holder:?}"
        ))
    })
}

/// Takes `key`, bound to `lease` with this host's `name` as its value, or adopts it from an
/// earlier incarnation of this host (same name, another lease): the key's create revision,
/// which names this hold of it (an adoption goes on with the earlier incarnation's). The
/// holder's name if another host holds it.
async fn take_key(
    client: &Client,
    key: String,
    name: &str,
    lease: i64,
) -> std::result::Result<std::result::Result<i64, String>, etcd_client::Error> {
    let mut kv = client.kv_client();
    loop {
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                key.clone(),
                name,
                Some(PutOptions::new().with_lease(lease)),
            )])
            .or_else([TxnOp::get(key.clone(), None)]);
        let r = kv.txn(txn).await?;
        if r.succeeded() {
            // Created by this transaction: at its revision.
            let created = r.header().map(|h| h.revision()).unwrap_or_default();
            return Ok(Ok(created));
        }
        let Some(cur) = first_get(&r.op_responses()) else {
            continue; // released between the compare and the get: try again
        };
        let holder = String::from_utf8_lossy(cur.value()).into_owned();
        if holder != name {
            return Ok(Err(holder));
        }
        if cur.lease() == lease {
            return Ok(Ok(cur.create_revision()));
        }
        // An earlier incarnation of this host: adopt, unless it changed meanwhile.
        let txn = Txn::new()
            .when([Compare::mod_revision(
                key.clone(),
                CompareOp::Equal,
                cur.mod_revision(),
            )])
            .and_then([TxnOp::put(
                key.clone(),
                name,
                Some(PutOptions::new().with_lease(lease)),
            )]);
        if kv.txn(txn).await?.succeeded() {
            return Ok(Ok(cur.create_revision()));
        }
    }
}

/// Renews the lease until the coordinator is dropped or shut down; see the module docs.
async fn renew(client: Client, session: std::sync::Weak<Session>, prefix: String, ttl: Duration) {
    // Several renewals per half-TTL: one lost answer does not close the fence.
    let every = ttl / 6;
    let mut lease_client = client.lease_client();
    'stream: loop {
        let Some(s) = session.upgrade() else { return };
        if s.stopping.load(Ordering::Acquire) {
            return;
        }
        let id = s.lease.load(Ordering::Acquire);
        // Opening the stream is a renewal too: etcd answers its first request before the
        // stream is handed over.
        let sent = Instant::now();
        let (mut keeper, mut stream) =
            match tokio::time::timeout(2 * every, lease_client.keep_alive(id)).await {
                Ok(Ok(x)) => x,
                Ok(Err(e)) if e.to_string().contains("lease not found") => {
                    lease_lost(&s);
                    reregister(&client, &s, &prefix, ttl).await;
                    continue;
                }
                Ok(Err(e)) => {
                    warn!("etcd lease renewal: {e}");
                    drop(s);
                    tokio::time::sleep(every).await;
                    continue;
                }
                Err(_) => continue, // no answer in time: a new stream, at once
            };
        s.fence.extend_to(sent + ttl / 2);
        drop(s);
        loop {
            tokio::time::sleep(every).await;
            let Some(s) = session.upgrade() else { return };
            if s.stopping.load(Ordering::Acquire) {
                return;
            }
            let sent = Instant::now();
            if let Err(e) = keeper.keep_alive().await {
                warn!("etcd lease renewal: {e}");
                continue 'stream;
            }
            match tokio::time::timeout(every, stream.message()).await {
                Ok(Ok(Some(r))) if r.ttl() > 0 => s.fence.extend_to(sent + ttl / 2),
                Ok(Ok(Some(_))) => {
                    lease_lost(&s);
                    reregister(&client, &s, &prefix, ttl).await;
                    continue 'stream;
                }
                Ok(Ok(None)) | Ok(Err(_)) => continue 'stream,
                // No answer in time. Answers carry nothing that ties them to a request, so
                // a late one read in a later round would extend the fence from that round's
                // send time, later than its own; a few late answers then keep the fence
                // open past the lease. A new stream leaves them unread.
                Err(_) => continue 'stream,
            }
        }
    }
}

/// The lease is gone: datastore writes stop at once.
fn lease_lost(s: &Session) {
    s.fence.close();
    error!(
        "etcd lease of host {:?} expired: datastore writes stop until it registers again",
        s.host.lock().expect("lock").name
    );
}

/// The owner a volume's vault names, if it has one.
async fn vault_owner(
    kv: &mut etcd_client::KvClient,
    prefix: &str,
    volume: Uuid,
) -> std::result::Result<Option<String>, etcd_client::Error> {
    let r = kv.get(format!("{prefix}/vaults/{volume}"), None).await?;
    Ok(r.kvs()
        .first()
        .and_then(|x| serde_json::from_slice::<Vault>(x.value()).ok())
        .map(|v| v.owner))
}

/// Re-takes a vault lock after a lost lease, unless another host took the volume over
/// meanwhile (a peer's online replay takes the lock, names itself the vault's owner, and
/// gives the lock back when done): then this host's copy is stale. The vault is read before
/// the lock is taken, and again after: a take-over in between gives the lock back too. This
/// host writes none of the volume's vault until then ([`Session::retaking`]): a write landing
/// between the take and the second read would have covered the other host's record.
///
/// A volume whose lock was given back meanwhile ([`Coordinator::unlock_vault`] while the lease
/// was gone, when there was no lock to delete) is not kept: its lock goes again.
async fn retake_lock(
    client: &Client,
    s: &Session,
    prefix: &str,
    name: &str,
    lease: i64,
    volume: Uuid,
) -> std::result::Result<(), Reg> {
    let mut kv = client.kv_client();
    let owner = vault_owner(&mut kv, prefix, volume).await?;
    if let Some(o) = owner.filter(|o| o != name) {
        return Err(Reg::Taken(format!(
            "volume {volume}: host {o:?} took it over while this host's lease was gone"
        )));
    }
    pause(s, "before take").await;
    let created = take_lock(client, prefix, name, lease, volume).await?;
    pause(s, "after take").await;
    // Another host that took it over in between names itself the owner.
    let now = vault_owner(&mut kv, prefix, volume).await?;
    if let Some(o) = now.filter(|o| o != name) {
        give_back(&mut kv, prefix, lease, volume).await?;
        return Err(Reg::Taken(format!(
            "volume {volume}: host {o:?} took it over while this host took its lock back"
        )));
    }
    // Given back meanwhile: `unlock_vault` forgets the volume before it deletes the lock, so
    // either it deleted the lock taken here or this sees it forgotten. Kept, it is a new
    // hold: the lock went with the lease before.
    let kept = match s.held.lock().expect("lock").get_mut(&volume) {
        Some(hold) => {
            *hold = created;
            true
        }
        None => false,
    };
    if !kept {
        give_back(&mut kv, prefix, lease, volume).await?;
    }
    Ok(())
}

/// Deletes `volume`'s vault lock if `lease` holds it.
async fn give_back(
    kv: &mut etcd_client::KvClient,
    prefix: &str,
    lease: i64,
    volume: Uuid,
) -> std::result::Result<(), etcd_client::Error> {
    let lock = format!("{prefix}/vault-locks/{volume}");
    let txn = Txn::new()
        .when([Compare::lease(lock.clone(), CompareOp::Equal, lease)])
        .and_then([TxnOp::delete(lock, None)]);
    kv.txn(txn).await.map(|_| ())
}

/// Holds the re-registration at `stage` while a test asks it to; nothing outside tests.
#[cfg(not(test))]
async fn pause(_s: &Session, _stage: &'static str) {}

#[cfg(test)]
async fn pause(s: &Session, stage: &'static str) {
    let p = s.pauses.lock().expect("lock").get(stage).cloned();
    if let Some(p) = p {
        p.hold().await;
    }
}

/// Renews `lease` every sixth of `ttl` until dropped, and raises `renewed` to the send time
/// of each renewal etcd answered. Opens no fence: [`reregister`] does, once its locks are back.
async fn keep_lease(
    client: &Client,
    lease: i64,
    ttl: Duration,
    renewed: &Mutex<Instant>,
) -> std::convert::Infallible {
    let every = ttl / 6;
    let mut leases = client.lease_client();
    loop {
        tokio::time::sleep(every).await;
        let sent = Instant::now();
        // Opening a keep-alive stream is one renewal: etcd answers it before the stream is
        // handed over, and an answer means the lease lives.
        match tokio::time::timeout(every, leases.keep_alive(lease)).await {
            Ok(Ok(_)) => {
                let mut r = renewed.lock().expect("lock");
                *r = (*r).max(sent);
            }
            Ok(Err(e)) => {
                warn!("etcd: renew the new lease while its vault locks are taken back: {e}")
            }
            Err(_) => {}
        }
    }
}

/// After a lost lease: registers again and re-takes every vault lock this host held. The fence
/// opens only if all of them came back.
async fn reregister(client: &Client, s: &Session, prefix: &str, ttl: Duration) {
    // An etcd error while re-taking the locks starts over with a new registration.
    let registered = 'again: loop {
        // Before a new lease can be read: every vault write under it waits for its lock.
        let held: BTreeSet<Uuid> = {
            let held = s.held.lock().expect("lock");
            s.reregistrations.fetch_add(1, Ordering::AcqRel);
            held.keys().copied().collect()
        };
        *s.retaking.lock().expect("lock") = held;
        let sent = loop {
            if s.stopping.load(Ordering::Acquire) {
                return;
            }
            match register(client, s, prefix, ttl).await {
                Ok(sent) => break sent,
                Err(Reg::Etcd(e)) => warn!("etcd: register again: {e}"),
                Err(Reg::Taken(m)) => warn!("etcd: register again: {m}"),
            }
            tokio::time::sleep(ttl / 6).await;
        };
        let name = s.host.lock().expect("lock").name.clone();
        let lease = s.lease.load(Ordering::Acquire);
        let held: Vec<Uuid> = s.retaking.lock().expect("lock").iter().copied().collect();
        let retakes = async {
            let mut lost = Vec::new();
            for v in held {
                // Counted down to the retake that fails, which disarms it.
                #[cfg(test)]
                if s.fail_retake
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                        (n != u64::MAX).then(|| n.checked_sub(1).unwrap_or(u64::MAX))
                    })
                    == Ok(0)
                {
                    return Err((v, etcd_client::Error::Internal("injected by a test".into())));
                }
                match retake_lock(client, s, prefix, &name, lease, v).await {
                    // Confirmed, or not this host's (then a vault write finds no lock).
                    Ok(()) => {
                        s.retaking.lock().expect("lock").remove(&v);
                    }
                    Err(Reg::Taken(m)) => {
                        error!("{m}");
                        s.retaking.lock().expect("lock").remove(&v);
                        lost.push(v);
                    }
                    Err(Reg::Etcd(e)) => return Err((v, e)),
                }
            }
            Ok(lost)
        };
        // Nothing else renews the new lease while its locks are taken back, a few round
        // trips per volume: renewed here meanwhile, so that many volumes cannot outlast it.
        let renewed = Mutex::new(sent);
        let outcome = tokio::select! {
            r = retakes => r,
            never = keep_lease(client, lease, ttl, &renewed) => match never {},
        };
        match outcome {
            Ok(lost) => break (*renewed.lock().expect("lock"), name, lost),
            Err((v, e)) => {
                warn!("re-take vault lock of {v}: {e}; registering again");
                // Every lock taken back under this lease goes with it: until the next round
                // takes them back, their vaults wait as all the others do (a vault write
                // answered NotHeld would make a replay give its volume up).
                let all: BTreeSet<Uuid> = s.held.lock().expect("lock").keys().copied().collect();
                *s.retaking.lock().expect("lock") = all;
                // The host key is bound to this lease: left to expire, it would refuse the
                // next registration the host's own name until then.
                if let Err(e) = client.lease_client().revoke(lease).await {
                    warn!("etcd: revoke the lease given up: {e}");
                }
                pause(s, "registering again").await;
                tokio::time::sleep(ttl / 6).await;
                continue 'again;
            }
        }
    };
    let (renewed, name, lost) = registered;
    if lost.is_empty() {
        // From the last renewal's send, not from now: the lease's clock ran from then.
        s.fence.extend_to(renewed + ttl / 2);
        info!("host {name:?} registered again; datastore writes resume");
    } else {
        // For good: the renewals of the new lease must not open it again.
        s.fence.revoke();
        error!(
            "host {name:?} lost the vault locks of {} volume(s) while its lease was gone; \
             datastore writes stay stopped on this host: restart vestad",
            lost.len()
        );
    }
}

#[async_trait]
impl Coordinator for EtcdCoordinator {
    fn kind(&self) -> &'static str {
        "etcd"
    }

    async fn state(&self) -> Result<State> {
        let ds = self.key("datastores", "");
        let vs = self.key("volumes", "");
        let txn = Txn::new().and_then([
            TxnOp::get(ds.clone(), Some(GetOptions::new().with_prefix())),
            TxnOp::get(vs.clone(), Some(GetOptions::new().with_prefix())),
        ]);
        let mut kv = self.client.kv_client();
        let r = kv.txn(txn).await.map_err(|e| self.unavailable(e))?;
        let mut state = State::default();
        let rs = r.op_responses();
        for (i, resp) in rs.iter().enumerate() {
            let TxnOpResponse::Get(g) = resp else {
                continue;
            };
            for x in g.kvs() {
                let key = String::from_utf8_lossy(x.key()).into_owned();
                if i == 0 {
                    state
                        .datastores
                        .push(serde_json::from_slice(x.value()).map_err(|e| corrupt(&key, e))?);
                } else {
                    state
                        .volumes
                        .push(serde_json::from_slice(x.value()).map_err(|e| corrupt(&key, e))?);
                }
            }
        }
        Ok(state)
    }

    async fn add_datastore(&self, d: DatastoreSpec) -> Result<()> {
        let key = self.key("datastores", &d.name);
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key, json(&d), None)]);
        if self.txn_held(txn).await? {
            Ok(())
        } else {
            Err(Error::Exists(format!(
                "a datastore named {:?} already exists",
                d.name
            )))
        }
    }

    async fn update_datastore(&self, d: DatastoreSpec) -> Result<()> {
        let key = self.key("datastores", &d.name);
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Greater, 0)])
            .and_then([TxnOp::put(key, json(&d), None)]);
        if self.txn_held(txn).await? {
            Ok(())
        } else {
            Err(Error::NotFound(format!("no datastore named {:?}", d.name)))
        }
    }

    async fn create_volume(&self, v: VolumeRecord) -> Result<()> {
        let key = self.key("volumes", &v.name);
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key, json(&v), None)]);
        if self.txn_held(txn).await? {
            Ok(())
        } else {
            Err(Error::Exists(format!(
                "a volume named {:?} already exists",
                v.name
            )))
        }
    }

    async fn update_volume(&self, v: VolumeRecord) -> Result<()> {
        let key = self.key("volumes", &v.name);
        // Same name *and* same id: a volume deleted and re-created by another host under the
        // same name is a different volume.
        let cur: Option<VolumeRecord> = self.get_json(key.clone()).await?;
        let Some(cur) = cur.filter(|c| c.id == v.id) else {
            return Err(Error::NotFound(format!(
                "no volume {:?} ({})",
                v.name, v.id
            )));
        };
        let txn = Txn::new()
            .when([Compare::value(key.clone(), CompareOp::Equal, json(&cur))])
            .and_then([TxnOp::put(key, json(&v), None)]);
        if self.txn_held(txn).await? {
            Ok(())
        } else {
            Err(Error::Unavailable(format!(
                "volume {:?} was changed by another host at the same time; try again",
                v.name
            )))
        }
    }

    async fn delete_volume(&self, name: &str, id: Uuid) -> Result<()> {
        let key = self.key("volumes", name);
        let cur: Option<VolumeRecord> = self.get_json(key.clone()).await?;
        // The transaction below compares the whole record: it is this one's, or nothing.
        let Some(cur) = cur.filter(|c| c.id == id) else {
            return Err(Error::NotFound(format!("no volume {id} named {name:?}")));
        };
        let id = cur.id.to_string();
        // The vault lock goes with the record only if it is this host's, or nobody's: another
        // host holding it replays the volume, and its lock is not this host's to delete.
        let lock = self.key("vault-locks", &id);
        let mut kv = self.client.kv_client();
        let held = kv
            .get(lock.clone(), None)
            .await
            .map_err(|e| self.unavailable(e))?;
        let lock_rev = match held.kvs().first() {
            Some(l) if l.lease() != self.lease() => {
                return Err(Error::Locked(format!(
                    "volume {name:?}'s vault lock is held by host {:?}",
                    String::from_utf8_lossy(l.value())
                )))
            }
            Some(l) => l.mod_revision(),
            None => 0,
        };
        let txn = Txn::new()
            .when([
                Compare::value(key.clone(), CompareOp::Equal, json(&cur)),
                Compare::mod_revision(lock.clone(), CompareOp::Equal, lock_rev),
            ])
            .and_then([
                TxnOp::delete(key, None),
                TxnOp::delete(self.key("vaults", &id), None),
                TxnOp::delete(lock, None),
                TxnOp::put(
                    self.key("deleted", &id),
                    crate::now_unix().to_string(),
                    None,
                ),
            ]);
        if self.txn_held(txn).await? {
            self.session.held.lock().expect("lock").remove(&cur.id);
            Ok(())
        } else {
            Err(Error::Unavailable(format!(
                "volume {name:?} was changed by another host at the same time; try again"
            )))
        }
    }

    async fn deleted_volumes(&self) -> Result<Vec<Uuid>> {
        let prefix = self.key("deleted", "");
        let mut kv = self.client.kv_client();
        let r = kv
            .get(prefix.clone(), Some(GetOptions::new().with_prefix()))
            .await
            .map_err(|e| self.unavailable(e))?;
        let now = crate::now_unix();
        let mut kept = Vec::new();
        for x in r.kvs() {
            let key = String::from_utf8_lossy(x.key()).into_owned();
            let Some(id) = key.strip_prefix(&prefix).and_then(|s| s.parse().ok()) else {
                continue;
            };
            let unix: u64 = String::from_utf8_lossy(x.value())
                .trim()
                .parse()
                .unwrap_or(now);
            if unix + crate::DELETED_KEEP.as_secs() > now {
                kept.push(id);
            } else {
                // Only the key as read: a volume imported since and deleted again has a new
                // one.
                let txn = Txn::new()
                    .when([Compare::mod_revision(
                        key.clone(),
                        CompareOp::Equal,
                        x.mod_revision(),
                    )])
                    .and_then([TxnOp::delete(key.clone(), None)]);
                match kv.txn(txn).await {
                    Ok(r) if r.succeeded() => {}
                    // Put again since it was read: a new delete of it, kept.
                    Ok(_) => kept.push(id),
                    // Forgotten at the next read instead.
                    Err(e) => warn!("etcd: forget the deleted volume {id}: {e}"),
                }
            }
        }
        Ok(kept)
    }

    fn host(&self) -> &str {
        &self.name
    }

    async fn publish_host(&self, mut h: HostRecord) -> Result<()> {
        h.name = self.name.clone();
        h.started_unix = self.session.host.lock().expect("lock").started_unix;
        *self.session.host.lock().expect("lock") = h.clone();
        let txn = Txn::new().and_then([
            TxnOp::put(
                self.key("hosts", &self.name),
                json(&h),
                Some(PutOptions::new().with_lease(self.lease())),
            ),
            TxnOp::put(self.key("members", &self.name), json(&h), None),
        ]);
        let mut kv = self.client.kv_client();
        kv.txn(txn).await.map_err(|e| self.unavailable(e))?;
        Ok(())
    }

    async fn hosts(&self) -> Result<Vec<HostStatus>> {
        let txn = Txn::new().and_then([
            TxnOp::get(
                self.key("members", ""),
                Some(GetOptions::new().with_prefix()),
            ),
            TxnOp::get(self.key("hosts", ""), Some(GetOptions::new().with_prefix())),
        ]);
        let mut kv = self.client.kv_client();
        let r = kv.txn(txn).await.map_err(|e| self.unavailable(e))?;
        let rs = r.op_responses();
        let mut hosts: BTreeMap<String, HostStatus> = BTreeMap::new();
        for (i, resp) in rs.iter().enumerate() {
            let TxnOpResponse::Get(g) = resp else {
                continue;
            };
            for x in g.kvs() {
                let key = String::from_utf8_lossy(x.key()).into_owned();
                let record: HostRecord =
                    serde_json::from_slice(x.value()).map_err(|e| corrupt(&key, e))?;
                // The live key, read second, carries the newest record.
                hosts.insert(
                    record.name.clone(),
                    HostStatus {
                        record,
                        alive: i == 1,
                    },
                );
            }
        }
        Ok(hosts.into_values().collect())
    }

    fn fence(&self) -> Arc<Fence> {
        self.session.fence.clone()
    }

    async fn lock_vault(&self, volume: Uuid) -> Result<()> {
        // One being re-taken is decided by the re-registration (which may give its lock up
        // again), not here.
        let reregistrations = self.session.reregistrations.load(Ordering::Acquire);
        let lease = self.lease_unless_retaking(volume)?;
        let created = take_lock(&self.client, &self.prefix, &self.name, lease, volume)
            .await
            .map_err(|e| match e {
                Reg::Etcd(e) => self.unavailable(e),
                Reg::Taken(m) => Error::Locked(m),
            })?;
        pause(&self.session, "vault lock taken").await;
        {
            // A re-registration that copied `held` since the lease was read does not take
            // this lock back; the lease it was taken under may be gone, and the lock with it
            // (a lock this host counted as held, with its fence open again, that another host
            // could take). Counted under this lock, so either this sees the count move or
            // the re-registration's copy has the volume.
            let mut held = self.session.held.lock().expect("lock");
            if self.session.reregistrations.load(Ordering::Acquire) == reregistrations {
                held.insert(volume, created);
                return Ok(());
            }
        }
        // Given back if it is still there under that lease (it was read after the count).
        let _ = give_back(&mut self.client.kv_client(), &self.prefix, lease, volume).await;
        Err(Error::Unavailable(format!(
            "host {:?} lost its etcd lease while it took the vault lock of volume {volume}; \
             it is registered again, and the lock can be taken again",
            self.name
        )))
    }

    async fn unlock_vault(&self, volume: Uuid) -> Result<()> {
        // Forgotten first: a re-registration that takes the lock back after this reads the
        // lease gives it up again (see `retake_lock`); one that took it before, took it under
        // the lease read here.
        self.session.held.lock().expect("lock").remove(&volume);
        let key = self.key("vault-locks", &volume.to_string());
        let txn = Txn::new()
            .when([Compare::lease(key.clone(), CompareOp::Equal, self.lease())])
            .and_then([TxnOp::delete(key, None)]);
        let mut kv = self.client.kv_client();
        kv.txn(txn).await.map_err(|e| self.unavailable(e))?;
        Ok(())
    }

    async fn vault(&self, volume: Uuid) -> Result<Option<Vault>> {
        self.get_json(self.key("vaults", &volume.to_string())).await
    }

    async fn put_vault(&self, v: &Vault) -> Result<()> {
        let lease = self.lease_unless_retaking(v.volume)?;
        let hold = self
            .session
            .held
            .lock()
            .expect("lock")
            .get(&v.volume)
            .copied();
        let held = match hold {
            Some(created) => self.txn_held(self.vault_put(v, lease, created)).await?,
            None => false,
        };
        if held {
            Ok(())
        } else {
            Err(Error::NotHeld(format!(
                "host {:?} does not hold the vault lock of volume {}",
                self.name, v.volume
            )))
        }
    }

    async fn lock_datastore(&self, name: &str) -> Result<DatastoreLock> {
        let mut locks = self.client.lock_client();
        let key = self.key("ds-locks", name);
        let give_up = Instant::now() + DATASTORE_LOCK_WAIT;
        loop {
            // The lease and its epoch, read together: a grant is bound to exactly this lease.
            let (lease, closes) = *self.session.epoch.lock().expect("lock");
            let opts = LockOptions::new().with_lease(lease);
            match locks.lock(key.clone(), Some(opts)).await {
                Ok(r) => {
                    return Ok(DatastoreLock {
                        name: name.into(),
                        key: r.key().to_vec(),
                        closes,
                    })
                }
                // Each attempt ends at the request timeout; etcd drops an abandoned waiter. The
                // client's own timeout answers `Cancelled`, the server's deadline
                // `DeadlineExceeded`, whichever comes first. A lock granted just as the
                // attempt timed out is under this host's lease and key: the next attempt
                // finds it held by this very lease and returns at once.
                Err(etcd_client::Error::GRpcStatus(st))
                    if timed_out(&st) && Instant::now() < give_up => {}
                Err(etcd_client::Error::GRpcStatus(st)) if timed_out(&st) => {
                    return Err(Error::Locked(format!(
                        "datastore {name:?}'s metadata is locked by another host for more \
                         than {DATASTORE_LOCK_WAIT:?}; try again"
                    )))
                }
                Err(e) => return Err(self.unavailable(e)),
            }
        }
    }

    async fn unlock_datastore(&self, lock: DatastoreLock) -> Result<()> {
        let mut locks = self.client.lock_client();
        locks
            .unlock(lock.key)
            .await
            .map_err(|e| self.unavailable(e))?;
        Ok(())
    }

    async fn put_stats(&self, kind: StatsDoc, doc: Vec<u8>) -> Result<()> {
        let key = format!("{}/stats/{}/{}", self.prefix, kind.name(), self.name);
        let mut kv = self.client.kv_client();
        kv.put(key, doc, Some(PutOptions::new().with_lease(self.lease())))
            .await
            .map_err(|e| self.unavailable(e))?;
        Ok(())
    }

    async fn stats(&self, kind: StatsDoc) -> Result<Vec<(String, Vec<u8>)>> {
        let prefix = format!("{}/stats/{}/", self.prefix, kind.name());
        let mut kv = self.client.kv_client();
        let r = kv
            .get(prefix.clone(), Some(GetOptions::new().with_prefix()))
            .await
            .map_err(|e| self.unavailable(e))?;
        Ok(r.kvs()
            .iter()
            .map(|x| {
                let key = String::from_utf8_lossy(x.key());
                let host = key.strip_prefix(&prefix).unwrap_or(&key).to_string();
                (host, x.value().to_vec())
            })
            .collect())
    }

    async fn stats_aggregator(&self) -> Result<bool> {
        let key = self.key("stats", "aggregator");
        take_key(&self.client, key, &self.name, self.lease())
            .await
            .map(|taken| taken.is_ok())
            .map_err(|e| self.unavailable(e))
    }

    async fn put_pod_stats(&self, doc: Vec<u8>) -> Result<()> {
        let lease = self.lease();
        let txn = Txn::new()
            .when([Compare::lease(
                self.key("stats", "aggregator"),
                CompareOp::Equal,
                lease,
            )])
            .and_then([TxnOp::put(
                self.key("stats", "pod"),
                doc,
                Some(PutOptions::new().with_lease(lease)),
            )]);
        if self.txn_held(txn).await? {
            Ok(())
        } else {
            Err(Error::NotHeld(format!(
                "host {:?} is not the statistics aggregator",
                self.name
            )))
        }
    }

    async fn pod_stats(&self) -> Result<Option<Vec<u8>>> {
        let mut kv = self.client.kv_client();
        let r = kv
            .get(self.key("stats", "pod"), None)
            .await
            .map_err(|e| self.unavailable(e))?;
        Ok(r.kvs().first().map(|x| x.value().to_vec()))
    }

    async fn peer_key(&self, fresh: [u8; 32]) -> Result<[u8; 32]> {
        let key = format!("{}/peer-key", self.prefix);
        let stored = self.put_if_absent(&key, fresh.to_vec()).await?;
        stored.as_slice().try_into().map_err(|_| Error::Corrupt {
            path: format!("etcd key {key}"),
            msg: format!(
                "{} bytes, not a 32-byte peer key; stop every host of the pod, delete the key \
                 and start them again",
                stored.len()
            ),
        })
    }

    async fn stored_pod_id(&self) -> Result<Option<Uuid>> {
        let key = format!("{}/pod-id", self.prefix);
        let mut kv = self.client.kv_client();
        let r = kv
            .get(key.clone(), None)
            .await
            .map_err(|e| self.unavailable(e))?;
        let Some(x) = r.kvs().first() else {
            return Ok(None);
        };
        let stored = String::from_utf8_lossy(x.value()).into_owned();
        stored.trim().parse().map(Some).map_err(|_| Error::Corrupt {
            path: format!("etcd key {key}"),
            msg: format!("{stored:?} is not a UUID; put back the pod's id"),
        })
    }

    async fn pod_id(&self, fresh: Uuid) -> Result<Uuid> {
        let key = format!("{}/pod-id", self.prefix);
        let stored = self
            .put_if_absent(&key, fresh.to_string().into_bytes())
            .await?;
        let stored = String::from_utf8_lossy(&stored).into_owned();
        stored.trim().parse().map_err(|_| Error::Corrupt {
            path: format!("etcd key {key}"),
            msg: format!("{stored:?} is not a UUID; put back the pod's id"),
        })
    }

    async fn shutdown(&self, quiet: bool) {
        self.leave(quiet).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Policy;
    use tokio::sync::Notify;
    use vesta_tests::Etcd;

    /// A place where the re-registration waits until the test lets it go.
    #[derive(Default)]
    pub(super) struct Pause {
        reached: Notify,
        go: Notify,
    }

    impl Pause {
        pub(super) async fn hold(&self) {
            self.reached.notify_one();
            self.go.notified().await;
        }
        async fn reached(&self) {
            tokio::time::timeout(Duration::from_secs(20), self.reached.notified())
                .await
                .expect("the re-registration never got there");
        }
        fn go(&self) {
            self.go.notify_one();
        }
    }

    /// Holds `c`'s next re-registration at `stage`.
    fn hold_at(c: &EtcdCoordinator, stage: &'static str) -> Arc<Pause> {
        let p = Arc::new(Pause::default());
        c.session.pauses.lock().unwrap().insert(stage, p.clone());
        p
    }

    async fn connect(etcd: &Etcd, name: &str) -> EtcdCoordinator {
        EtcdCoordinator::connect(EtcdConfig {
            endpoints: vec![etcd.endpoint.clone()],
            prefix: "/vesta".into(),
            host: HostRecord {
                name: name.into(),
                fault_domain: "rack1".into(),
                ..Default::default()
            },
            lease_ttl: Duration::from_secs(3),
        })
        .await
        .unwrap()
    }

    fn vault(volume: Uuid, owner: &str, gen: u64) -> Vault {
        Vault {
            volume,
            policy: Policy::Wb,
            checkpoint: 0,
            gen,
            owner: owner.into(),
            peers: Vec::new(),
            previous_owner: None,
            handoff: false,
        }
    }

    /// Ends `c`'s lease as etcd does when it expires: its renewals then find it gone.
    async fn lose_lease(c: &EtcdCoordinator) {
        c.client.lease_client().revoke(c.lease()).await.unwrap();
    }

    async fn wait_until(what: &str, f: impl Fn() -> bool) {
        for _ in 0..200 {
            if f() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("{what} within 20 s");
    }

    /// Host a's lease lapsed. Another host took its volume over and gave the lock back while
    /// a's re-registration took the lock back and before it read the vault again. A vault
    /// write of a's in that moment would have replaced the other host's record with a's
    /// stale copy; the second read would then have found a named and a kept the volume.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_vault_is_not_written_while_its_lock_is_taken_back() {
        let etcd = Etcd::start();
        let a = connect(&etcd, "a").await;
        let v = Uuid::new_v4();
        a.lock_vault(v).await.unwrap();
        a.put_vault(&vault(v, "a", 1)).await.unwrap();
        let after_take = hold_at(&a, "after take");
        lose_lease(&a).await;
        after_take.reached().await;
        // The take-over's record, as b left it.
        let key = a.key("vaults", &v.to_string());
        let b_took_it = vault(v, "b", 2);
        let mut kv = a.client.kv_client();
        kv.put(key.clone(), json(&b_took_it), None).await.unwrap();
        match a.put_vault(&vault(v, "a", 1)).await {
            Err(Error::Unavailable(m)) => assert!(m.contains("taking the vault lock"), "{m}"),
            other => panic!("a vault write while the lock is taken back: {other:?}"),
        }
        // Nor can anything else of a's take (adopt) the lock meanwhile: the re-registration
        // may give it up next, under it.
        match a.lock_vault(v).await {
            Err(Error::Unavailable(m)) => assert!(m.contains("taking the vault lock"), "{m}"),
            other => panic!("a vault lock taken while it is taken back: {other:?}"),
        }
        after_take.go();
        let fence = a.fence();
        wait_until("a gives the volume up", || fence.is_revoked()).await;
        assert_eq!(a.vault(v).await.unwrap(), Some(b_took_it));
        let lock = a.key("vault-locks", &v.to_string());
        assert!(kv.get(lock, None).await.unwrap().kvs().is_empty());
    }

    /// Host a takes a vault lock, and its lease is lost before the take's answer counts: the
    /// re-registration runs meanwhile, registers a new lease and takes back the locks it
    /// knew of, which did not include this one (the lock went with the old lease). The take
    /// must fail; before, it returned OK and a counted as held a lock that no longer existed,
    /// with its fence open, so another host could take the volume while a served it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_vault_lock_taken_as_the_lease_is_lost_is_not_counted_held() {
        let etcd = Etcd::start();
        let a = Arc::new(connect(&etcd, "a").await);
        let v = Uuid::new_v4();
        let first = a.lease();
        let taken = hold_at(&a, "vault lock taken");
        let take = tokio::spawn({
            let a = a.clone();
            async move { a.lock_vault(v).await }
        });
        taken.reached().await;
        lose_lease(&a).await;
        let fence = a.fence();
        wait_until("a registers again", || {
            a.lease() != first && fence.allows_writes()
        })
        .await;
        taken.go();
        match take.await.unwrap() {
            Err(Error::Unavailable(m)) => assert!(m.contains("lost its etcd lease"), "{m}"),
            other => panic!("a lock taken under a lost lease counted as held: {other:?}"),
        }
        assert!(!a.session.held.lock().unwrap().contains_key(&v));
        // The lock went with the old lease; taken again, it is held under the new one.
        let lock = a.key("vault-locks", &v.to_string());
        let mut kv = a.client.kv_client();
        assert!(kv.get(lock.clone(), None).await.unwrap().kvs().is_empty());
        a.session.pauses.lock().unwrap().remove("vault lock taken");
        a.lock_vault(v).await.unwrap();
        let got = kv.get(lock, None).await.unwrap();
        assert_eq!(got.kvs()[0].lease(), a.lease());
    }

    /// A volume record is deleted only by its id (a name another volume took since, a record
    /// removed and its name created again elsewhere, is not the old volume's to delete), and
    /// its delete leaves the id among the deleted.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_volume_record_is_deleted_only_by_its_id() {
        let etcd = Etcd::start();
        let a = connect(&etcd, "a").await;
        let rec = |id| VolumeRecord {
            id,
            name: "v".into(),
            size: 1 << 20,
            datastore: "san".into(),
            policy: Policy::Uncached,
            created_unix: 1,
            tuning: Default::default(),
            owner: Some("a".into()),
            moved: None,
        };
        let (old, new) = (Uuid::new_v4(), Uuid::new_v4());
        a.create_volume(rec(new)).await.unwrap();
        assert!(matches!(
            a.delete_volume("v", old).await,
            Err(Error::NotFound(_))
        ));
        assert_eq!(a.state().await.unwrap().volumes.len(), 1);
        assert!(a.deleted_volumes().await.unwrap().is_empty());
        // Not while another host holds its vault lock (it replays the volume).
        let b = connect(&etcd, "b").await;
        b.lock_vault(new).await.unwrap();
        match a.delete_volume("v", new).await {
            Err(Error::Locked(m)) => assert!(m.contains("\"b\""), "{m}"),
            other => panic!("a volume deleted with another host's vault lock: {other:?}"),
        }
        assert_eq!(a.state().await.unwrap().volumes.len(), 1);
        let lock = format!("/vesta/vault-locks/{new}");
        assert!(!etcd.keys(&lock).is_empty(), "b's vault lock was deleted");
        b.unlock_vault(new).await.unwrap();
        // With its own lock, the lock goes with the record.
        a.lock_vault(new).await.unwrap();
        a.delete_volume("v", new).await.unwrap();
        assert!(a.state().await.unwrap().volumes.is_empty());
        assert!(etcd.keys(&lock).is_empty());
        // The delete leaves the id, for storage it left behind to be freed, not imported.
        assert_eq!(b.deleted_volumes().await.unwrap(), vec![new]);
        // An id deleted longer ago than it is kept is forgotten, and its key removed.
        let key = format!("/vesta/deleted/{new}");
        let mut kv = b.client.kv_client();
        kv.put(key.clone(), "1", None).await.unwrap();
        assert!(b.deleted_volumes().await.unwrap().is_empty());
        assert!(kv.get(key, None).await.unwrap().kvs().is_empty());
    }

    /// A vault write of a's first hold of a lock that etcd applies only after a gave the lock
    /// up, b took the volume and wrote its vault, and a took the lock again under the same
    /// lease, must not land: it would cover b's record with a's older one. Before, the write
    /// compared only the lock's lease, which the second hold has too.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_vault_write_of_an_earlier_hold_never_lands_in_a_later_one() {
        let etcd = Etcd::start();
        let (a, b) = (connect(&etcd, "a").await, connect(&etcd, "b").await);
        let v = Uuid::new_v4();
        a.lock_vault(v).await.unwrap();
        let first = a.session.held.lock().unwrap()[&v];
        a.put_vault(&vault(v, "a", 1)).await.unwrap();
        // What a sends next, as etcd would apply it late.
        let late = a.vault_put(&vault(v, "a", 1), a.lease(), first);
        a.unlock_vault(v).await.unwrap();
        b.lock_vault(v).await.unwrap();
        b.put_vault(&vault(v, "b", 2)).await.unwrap();
        b.unlock_vault(v).await.unwrap();
        a.lock_vault(v).await.unwrap();
        assert_ne!(a.session.held.lock().unwrap()[&v], first, "one hold, twice");
        let applied = a.client.kv_client().txn(late).await.unwrap();
        assert!(
            !applied.succeeded(),
            "the first hold's write landed in the second"
        );
        assert_eq!(a.vault(v).await.unwrap(), Some(vault(v, "b", 2)));
        // The second hold writes as it should.
        a.put_vault(&vault(v, "a", 3)).await.unwrap();
        assert_eq!(a.vault(v).await.unwrap(), Some(vault(v, "a", 3)));
        // And a host holding none writes none.
        match b.put_vault(&vault(v, "b", 4)).await {
            Err(Error::NotHeld(_)) => {}
            other => panic!("a vault written without its lock: {other:?}"),
        }
    }

    /// Taking the locks back after a lost lease can take longer than the new lease's TTL (a
    /// few round trips per volume, fifty volumes a host). The new lease must live through it:
    /// before, nothing renewed it meanwhile, so it expired with the locks just taken under it,
    /// and the host went round again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_new_lease_lives_while_its_locks_are_taken_back() {
        let etcd = Etcd::start();
        let a = connect(&etcd, "a").await;
        let v = Uuid::new_v4();
        a.lock_vault(v).await.unwrap();
        let after_take = hold_at(&a, "after take");
        lose_lease(&a).await;
        after_take.reached().await;
        let new = a.lease();
        // Twice the TTL, as a retake of many volumes would take.
        tokio::time::sleep(Duration::from_secs(6)).await;
        a.session.pauses.lock().unwrap().remove("after take");
        after_take.go();
        let fence = a.fence();
        wait_until("a registers again", || fence.allows_writes()).await;
        assert_eq!(
            a.lease(),
            new,
            "the lease expired while the locks were taken back"
        );
        let lock = a.key("vault-locks", &v.to_string());
        let got = a.client.kv_client().get(lock, None).await.unwrap();
        assert_eq!(got.kvs()[0].lease(), new);
    }

    /// An etcd error while taking the locks back starts the registration over. The lease it
    /// gives up is revoked first: its host key would otherwise refuse the host's own name
    /// until the lease expired, keeping datastore writes stopped that much longer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_retake_revokes_its_lease_before_it_registers_again() {
        let etcd = Etcd::start();
        let a = connect(&etcd, "a").await;
        let (first, v) = {
            let (x, y) = (Uuid::new_v4(), Uuid::new_v4());
            (x.min(y), x.max(y)) // taken back in this order
        };
        a.lock_vault(first).await.unwrap();
        a.lock_vault(v).await.unwrap();
        let again = hold_at(&a, "registering again");
        // The first lock comes back, the second fails.
        a.session.fail_retake.store(1, Ordering::Release);
        lose_lease(&a).await;
        again.reached().await;
        // The lock taken back went with the lease given up: its vault waits for the next
        // round, as while any lock is taken back, rather than answer that it is not held.
        match a.put_vault(&vault(first, "a", 1)).await {
            Err(Error::Unavailable(m)) => assert!(m.contains("taking the vault lock"), "{m}"),
            other => panic!("a vault write between two rounds of taking locks back: {other:?}"),
        }
        let given_up = a.lease();
        let ttl = a
            .client
            .lease_client()
            .time_to_live(given_up, None)
            .await
            .unwrap();
        assert!(
            ttl.ttl() < 0,
            "the lease given up still lives ({} s)",
            ttl.ttl()
        );
        assert!(!etcd
            .keys("/vesta/hosts/")
            .contains(&"/vesta/hosts/a".to_string()));
        again.go();
        let fence = a.fence();
        wait_until("a registers again", || {
            a.lease() != given_up && fence.allows_writes()
        })
        .await;
        for v in [first, v] {
            let lock = a.key("vault-locks", &v.to_string());
            let got = a.client.kv_client().get(lock, None).await.unwrap();
            assert_eq!(got.kvs()[0].lease(), a.lease());
        }
        a.put_vault(&vault(first, "a", 1)).await.unwrap();
    }

    /// A stop with every datastore write answered deregisters at once, so the next start
    /// adopts the locks without waiting; one with a write still in service leaves its host key
    /// to lapse with the lease, and the next start waits for that, as after a crash.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stop_with_writes_in_service_leaves_its_registration_to_lapse() {
        let etcd = Etcd::start();
        let key = "/vesta/hosts/a".to_string();
        let a = connect(&etcd, "a").await;
        a.shutdown(true).await;
        assert!(!etcd.keys("/vesta/hosts/").contains(&key));
        let started = Instant::now();
        let a = connect(&etcd, "a").await;
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "a quiet stop made the next start wait"
        );
        let v = Uuid::new_v4();
        a.lock_vault(v).await.unwrap();
        a.shutdown(false).await;
        assert!(
            etcd.keys("/vesta/hosts/").contains(&key),
            "deregistered with a write in service"
        );
        let b = connect(&etcd, "b").await;
        match b.lock_vault(v).await {
            Err(Error::Locked(m)) => assert!(m.contains("\"a\""), "{m}"),
            other => panic!("the lock of a host stopped with a write in service: {other:?}"),
        }
        let started = Instant::now();
        let a = connect(&etcd, "a").await;
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_secs(1),
            "the next start did not wait for the lease to lapse"
        );
        // It waited on a watch, trying again once the key was gone (or once a second), not
        // polling: a try every 50 ms made about 60 over this wait.
        let tries = a.session.tries.load(Ordering::Relaxed);
        assert!(
            tries <= 3 + waited.as_secs(),
            "{tries} tries to register in {waited:?}"
        );
    }

    /// Every host of a pod gets the pod id the first one stored.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_hosts_of_a_pod_share_one_pod_id() {
        let etcd = Etcd::start();
        let (a, b) = (connect(&etcd, "a").await, connect(&etcd, "b").await);
        let first = a.pod_id(Uuid::new_v4()).await.unwrap();
        assert_eq!(b.pod_id(Uuid::new_v4()).await.unwrap(), first);
        assert_eq!(a.pod_id(Uuid::new_v4()).await.unwrap(), first);
    }

    /// A datastore lock is bound to the lease it was granted under: one granted before the
    /// lease was lost is no longer held once it is, even after the host registered again;
    /// one granted under the new lease is.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_datastore_lock_is_held_only_under_the_lease_it_was_granted_under() {
        let etcd = Etcd::start();
        let a = connect(&etcd, "a").await;
        let fence = a.fence();
        let old = a.lock_datastore("san").await.unwrap();
        assert!(old.held_under(&fence));
        lose_lease(&a).await;
        wait_until("a notices the lost lease", || !old.held_under(&fence)).await;
        wait_until("a registers again", || fence.allows_writes()).await;
        assert!(
            !old.held_under(&fence),
            "a lock of the lost lease counts as held"
        );
        // The old lock went with its lease: the new one is granted at once.
        let new = tokio::time::timeout(Duration::from_secs(10), a.lock_datastore("san"))
            .await
            .expect("the lock of the lost lease is still taken")
            .unwrap();
        assert!(
            new.held_under(&fence),
            "a lock granted under the new lease does not count as held"
        );
        a.unlock_datastore(new).await.unwrap();
    }

    /// A volume let go while the lease was gone (its lock went with the lease, so there was
    /// nothing to delete) is not taken back by the re-registration: another host can lock
    /// it, and a's datastore writes resume.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lock_given_back_while_the_lease_was_gone_stays_free() {
        let etcd = Etcd::start();
        let a = connect(&etcd, "a").await;
        let b = connect(&etcd, "b").await;
        let v = Uuid::new_v4();
        a.lock_vault(v).await.unwrap();
        let before_take = hold_at(&a, "before take");
        lose_lease(&a).await;
        before_take.reached().await;
        a.unlock_vault(v).await.unwrap();
        before_take.go();
        let fence = a.fence();
        wait_until("a registers again", || fence.allows_writes()).await;
        b.lock_vault(v)
            .await
            .expect("the lock a let go stayed with a");
    }
}
