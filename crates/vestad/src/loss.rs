//! Accepting a loss (`vesta volume accept-loss`).
//!
//! When this host's cache device fails holding dirty data that no peer can replay, the
//! volume waits for an operator: a `wb` volume fails its writes and its reads of what was
//! lost, and a `wbp` hand-off whose peers cannot replay (they died too, their devices
//! failed, they cannot reach the datastore) stalls its IO. Waiting is the right default: a
//! peer may come back, and a restart may find the device readable again. Accepting the loss
//! is the other decision, and only an operator can take it: the writes that only the failed
//! cache (and those peers) held are given up, and the volume goes on uncached from what its
//! datastore holds, every write up to the vault's checkpoint and maybe part of the window
//! the destager was writing.
//!
//! What keeps that safe is the vault. Before the volume serves a single IO from the
//! datastore, its vault is recorded, under the vault lock, with a new generation and no
//! peers (`engine::Volume::accept_loss` runs the hook while IO waits). From then on a former
//! peer's replicas are stale (it drops them, and cannot replay them: a replay needs the lock
//! and the vault's generation), and so is whatever this host's log still holds of the
//! volume if the device works again at the next start (`Daemon::open_volume` drops it). A
//! peer that holds the vault lock is replaying: nothing is lost if it finishes, so the
//! operator is told to wait for it.
//!
//! A volume that could not open because its peers are to replay it first (it came back on a
//! new cache device while they were to replay it, or one of them began a replay and did not
//! finish it: `Daemon::peers_replay_first`) has its vault recorded the same way, and is then
//! opened again.

use std::sync::Arc;
use std::time::Duration;

use cluster::{Policy, Vault};
use engine::Volume;
use tracing::warn;
use vesta_api as api;

use crate::daemon::{Daemon, OpError, OpResult, VolumeEntry};
use crate::peers;

/// How long a vault lock held by another host is waited for: a peer that cannot reach the
/// datastore takes it every second to try again, for as long as its attempt to open the
/// datastore takes.
const LOCK_WAIT: Duration = Duration::from_secs(30);

/// Accepts the loss of entry `e`'s volume (or, with `dry_run`, says what it would be). The
/// caller holds the volume's claim.
pub async fn accept(d: &Daemon, e: &Arc<VolumeEntry>, dry_run: bool) -> OpResult<api::LossReport> {
    match &e.volume {
        Ok(v) => accept_open(d, e, v, dry_run).await,
        Err(why) => accept_not_open(d, e, why, dry_run).await,
    }
}

async fn accept_open(
    d: &Daemon,
    e: &Arc<VolumeEntry>,
    v: &Arc<Volume>,
    dry_run: bool,
) -> OpResult<api::LossReport> {
    let (name, id) = (&e.record.name, e.record.id);
    let lost = v.loss().map_err(|err| {
        OpError::Conflict(format!(
            "volume {name:?}: {}; there is no loss to accept",
            msg(err)
        ))
    })?;
    let c = v.cache().ok_or_else(|| {
        OpError::Conflict(format!(
            "volume {name:?} is not cached; there is no loss to accept"
        ))
    })?;
    let handed = d.peers.handed_off(name);
    if !handed && v.stalled() && c.has_peers() {
        return Err(OpError::Conflict(format!(
            "volume {name:?}: its peers hold what the failed cache device held, and it is \
             being handed to them to replay (see `vesta volume show`); nothing is lost yet"
        )));
    }
    let mut report = api::LossReport {
        name: name.clone(),
        datastore: e.record.datastore.clone(),
        accepted: false,
        dirty_bytes: Some(lost.dirty_bytes),
        dirty_writes: Some(lost.dirty_writes),
        checkpoint: lost.checkpoint,
        peers: Vec::new(),
        peers_said: d.peers.handoff_answers(name),
    };
    if handed {
        if let Ok(Some(vault)) = d.coord.vault(id).await {
            report.peers = vault.peers;
        }
    }
    if dry_run {
        return Ok(report);
    }
    let me = d.coord.host().to_owned();
    // This command's own record, from an earlier try whose vault write landed although it
    // answered an error (the volume did not switch then).
    let ours = |v: &Vault| v.gen > c.gen() && v.owner == me && v.peers.is_empty() && !v.handoff;
    let mut floor = 0;
    if handed {
        // The hand-off gave the lock up for a peer to replay; it comes back here first. With
        // the lock held no peer replays, and one whose replay ended moved the vault to a new
        // generation; a replay that stopped midway (its device failed, it lost the lock)
        // left the generation as it was, and nothing will finish it.
        take_lock(d, name, id).await?;
        let checked = async {
            let vault = peers::read_vault(d, id)
                .await
                .map_err(OpError::Unavailable)?;
            if vault.gen > c.gen() && !ours(&vault) {
                return Err(OpError::Conflict(format!(
                    "volume {name:?}: host {:?} replayed it meanwhile (vault generation {}); \
                     nothing is lost, and it goes on uncached within seconds",
                    vault.owner, vault.gen
                )));
            }
            Ok(vault)
        }
        .await;
        match checked {
            Ok(vault) => {
                // A replay that stopped midway started from the newest checkpoint any peer
                // knew, maybe past this cache's: the datastore holds that much.
                floor = vault.checkpoint;
                if !ours(&vault) {
                    report.peers = vault.peers;
                }
            }
            Err(err) => {
                give_lock_back(d, name, id).await;
                return Err(err);
            }
        }
        // The writer this host had before the hand-off is stale: read the vault afresh.
        peers::forget_vault_writer(d, id).await;
    }
    let hook = match peers::switch_hook(d, id, Policy::Uncached).await {
        Ok(h) => h,
        Err(err) => {
            if handed {
                give_lock_back(d, name, id).await;
            }
            return Err(OpError::Unavailable(format!("volume {name:?}: {err}")));
        }
    };
    let hook: engine::SwitchHook =
        Box::new(move |gen, checkpoint| hook(gen, checkpoint.max(floor)));
    // What a peer's replay had destaged before it stopped is not lost.
    let replayed = (floor > lost.checkpoint).then(|| c.dirty_above(floor));
    match v.accept_loss(hook).await {
        Ok(dropped) => {
            if handed {
                d.peers.end_handoff(name);
            }
            let (bytes, writes) = replayed.unwrap_or((dropped.dirty_bytes, dropped.dirty_writes));
            report.accepted = true;
            report.dirty_bytes = Some(bytes);
            report.dirty_writes = Some(writes);
            report.checkpoint = dropped.checkpoint.max(floor);
            Ok(report)
        }
        Err(err) => {
            // A vault write may have landed although it answered an error: then the loss is
            // recorded, and this host keeps the lock (no peer may replay now). In a hand-off
            // the round then finishes the switch; otherwise running the command again does.
            match d.coord.vault(id).await {
                Ok(Some(vault)) if ours(&vault) => Err(OpError::Unavailable(format!(
                    "volume {name:?}: the vault records the loss, but the volume has not \
                         switched yet ({}); {}",
                    msg(err),
                    if handed {
                        "it switches within seconds"
                    } else {
                        "run the command again to finish"
                    }
                ))),
                Ok(_) => {
                    if handed {
                        give_lock_back(d, name, id).await;
                    }
                    Err(OpError::Unavailable(format!(
                        "volume {name:?}: {}; nothing changed",
                        msg(err)
                    )))
                }
                Err(e2) => Err(OpError::Unavailable(format!(
                    "volume {name:?}: {}; the vault cannot be read back ({e2}), so the loss \
                     may or may not be recorded: run the command again",
                    msg(err)
                ))),
            }
        }
    }
}

/// Whether `vault` hands the volume to its peers to replay first
/// ([`Daemon::peers_replay_first`]): the volume cannot open here until one of them has.
fn waits_for_peers(d: &Daemon, vault: &Vault) -> bool {
    vault.handoff && d.peers_replay_first(vault).is_some()
}

async fn accept_not_open(
    d: &Daemon,
    e: &Arc<VolumeEntry>,
    why: &str,
    dry_run: bool,
) -> OpResult<api::LossReport> {
    let (name, id) = (&e.record.name, e.record.id);
    let vault = d
        .coord
        .vault(id)
        .await
        .map_err(|err| OpError::Unavailable(format!("read the vault record: {err}")))?
        .filter(|v| waits_for_peers(d, v))
        .ok_or_else(|| {
            OpError::Conflict(format!(
                "volume {name:?} is not open ({why}), but its peers are not holding anything \
                 this host lost; there is no loss to accept"
            ))
        })?;
    let mut report = api::LossReport {
        name: name.clone(),
        datastore: e.record.datastore.clone(),
        accepted: false,
        dirty_bytes: None,
        dirty_writes: None,
        checkpoint: vault.checkpoint,
        peers: vault.peers.clone(),
        peers_said: None,
    };
    if dry_run {
        return Ok(report);
    }
    take_lock(d, name, id).await?;
    let me = d.coord.host().to_owned();
    let recorded = async {
        let vault = peers::read_vault(d, id)
            .await
            .map_err(OpError::Unavailable)?;
        if !waits_for_peers(d, &vault) {
            return Err(OpError::Conflict(format!(
                "volume {name:?}: host {:?} replayed it meanwhile (vault generation {}); \
                 nothing is lost, and it opens here within seconds",
                vault.owner, vault.gen
            )));
        }
        let left = Vault {
            policy: Policy::Wt,
            gen: vault.gen + 1,
            owner: me.clone(),
            peers: Vec::new(),
            previous_owner: Some(vault.owner.clone()).filter(|o| *o != me),
            handoff: false,
            ..vault.clone()
        };
        if let Err(err) = d.coord.put_vault(&left).await {
            // It may have landed all the same.
            match d.coord.vault(id).await {
                Ok(now) if now.as_ref() == Some(&left) => {}
                Ok(_) => {
                    return Err(OpError::Unavailable(format!(
                        "record the vault: {err}; nothing changed"
                    )))
                }
                Err(e2) => {
                    return Err(OpError::Unavailable(format!(
                        "record the vault: {err}; it cannot be read back ({e2}), so the loss \
                         may or may not be recorded: run the command again"
                    )))
                }
            }
        }
        Ok(vault)
    }
    .await;
    let vault = match recorded {
        Ok(v) => v,
        Err(err) => {
            give_lock_back(d, name, id).await;
            return Err(err);
        }
    };
    peers::forget_vault_writer(d, id).await;
    warn!(
        "volume {name:?}: loss accepted: what its peer(s) {:?} held of generation {} is \
         given up; it serves what datastore {:?} holds (every write up to {})",
        vault.peers, vault.gen, e.record.datastore, vault.checkpoint
    );
    report.accepted = true;
    if let Err(err) = d.reopen(e).await {
        // Accepted all the same: the volume opens once what stops it now is gone.
        warn!("volume {name:?}: open it again: {err}; retrying");
    }
    Ok(report)
}

/// Takes the volume's vault lock, waiting [`LOCK_WAIT`] for a peer that holds it for a
/// moment; one that keeps it is replaying.
async fn take_lock(d: &Daemon, name: &str, id: uuid::Uuid) -> OpResult<()> {
    let start = std::time::Instant::now();
    loop {
        match crate::peers::take_vault_lock(d, id).await {
            Ok(()) => return Ok(()),
            Err(cluster::Error::Locked(who)) if start.elapsed() >= LOCK_WAIT => {
                return Err(OpError::Conflict(format!(
                    "volume {name:?}: another host holds its vault lock ({who}): it is \
                     replaying the volume, or trying to reach the datastore to; nothing is \
                     lost if it finishes. Retry later, or stop that host first"
                )))
            }
            Err(cluster::Error::Locked(_)) => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(err) => {
                // The coordinator may have granted it all the same.
                give_lock_back(d, name, id).await;
                return Err(OpError::Unavailable(format!("take the vault lock: {err}")));
            }
        }
    }
}

/// Gives back a vault lock taken to accept a loss that did not happen, so a peer can replay.
async fn give_lock_back(d: &Daemon, name: &str, id: uuid::Uuid) {
    peers::forget_vault_writer(d, id).await;
    peers::give_lock_back(d, id, name).await;
}

/// An engine error for people: a cache error's own words.
fn msg(e: engine::Error) -> String {
    match e {
        engine::Error::Cache(m) => m,
        other => other.to_string(),
    }
}
