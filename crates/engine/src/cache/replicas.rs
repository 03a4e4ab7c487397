//! The copies this host keeps of other hosts' writes as their `wbp` peer (DESIGN §4).
//!
//! A peer appends each write it receives to its own cache log as a replica record, under the
//! volume's UUID and the owner's `gen` and `ser`, and keeps it (pinned) until the owner's
//! forwarded checkpoint covers it. A checkpoint is appended to the log before the records it
//! covers are released, and a released segment is reused only after a later sync, so after a
//! crash the scan finds every replica above the newest checkpoint it can find: a contiguous
//! run of the owner's sequence, never a gap under data it still holds.
//!
//! When the owner dies, the daemon promotes a volume's replicas ([`CacheHost::promote_replicas`]):
//! they become recovered dirty data, the volume attaches, and the ordinary replay destages
//! them in `ser` order (online replay).

use super::*;

/// Longest a replica append waits for log space, or for its volume's replicas to fit their
/// share again (the owner's checkpoints free both), before the write is refused and the owner
/// drops this peer.
const SPACE_WAIT: Duration = Duration::from_secs(5);

/// Why a replica request was not taken.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplicaRefusal {
    Failed(String),
    /// The request is for an older generation than this host holds: its sender is stale.
    Stale(String),
    /// This host holds nothing of the volume asked about: no replicas, no record in its log
    /// ([`CacheHost::replica_held`]).
    Absent(String),
}

/// One volume's replicas on this host.
#[derive(Debug, Default)]
pub(super) struct ReplicaSet {
    /// The owner that sent them ("" if they were found by the recovery scan).
    from: String,
    gen: u64,
    checkpoint: u64,
    /// The end of a window the owner sent, or this host's own replay of the volume recorded
    /// before it stopped (found by the recovery scan; see `OwnerMeta::window_end`), by the
    /// builds of 2026-11-27. A replay of the set reaches every write it holds, at least as far.
    window_end: u64,
    /// Writes above the checkpoint by `ser`, each with its records (parts), all pinned.
    writes: BTreeMap<u64, Vec<Scanned>>,
    bytes: u64,
    /// This host is replaying the volume ([`CacheHost::replica_seal`]): it takes no more of
    /// its writes, so no write of its owner can complete from then on.
    sealed: bool,
    /// This host told a replaying host how far it holds the set ([`CacheHost::replica_hold`]):
    /// the owner's checkpoints no longer release anything, and its writes of this generation
    /// are refused. A checkpoint still on its way from the owner could otherwise move this
    /// host past where that replay started; if the replay then stopped short of it, this host
    /// would continue from the later checkpoint and skip writes the replay had set back on the
    /// datastore. And a write taken after the answer would complete at an owner that every
    /// other peer had acknowledged it to (one whose lease lapsed still reaches them), while
    /// the replay, which goes no further than this host said, drops it.
    held: bool,
}

/// What `vesta host` and the daemon's replay watcher see of one volume's replicas.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaInfo {
    pub volume: Uuid,
    pub from: String,
    pub gen: u64,
    pub checkpoint: u64,
    /// The highest `ser` held (0 if none).
    pub last_ser: u64,
    pub writes: u64,
    pub bytes: u64,
}

/// The refusal of a write or an open of a volume this host is replaying.
fn sealed(volume: Uuid) -> ReplicaRefusal {
    ReplicaRefusal::Stale(format!(
        "this host is replaying volume {volume}: its owner no longer holds it"
    ))
}

/// The refusal of a write of a generation this host told a replaying host how far it holds.
fn held(volume: Uuid, gen: u64) -> ReplicaRefusal {
    ReplicaRefusal::Failed(format!(
        "this host told a host that replays volume {volume} how far it holds generation \
         {gen}: it takes no more of that generation's writes"
    ))
}

/// A replica record as the owner's own would read: what replay stages.
fn as_owned(mut s: Scanned) -> Scanned {
    s.header.kind = match s.header.kind {
        Kind::Replica => Kind::Data,
        Kind::ReplicaZero => Kind::Zero,
        Kind::ReplicaZeroAlloc => Kind::ZeroAlloc,
        k => k,
    };
    s
}

impl ReplicaSet {
    /// Frees every copy of a `ser` up to `upto` (all of them for `u64::MAX`).
    fn release(&mut self, log: &Log, upto: u64) {
        let keep = match upto.checked_add(1) {
            Some(above) => self.writes.split_off(&above),
            None => BTreeMap::new(),
        };
        for s in std::mem::replace(&mut self.writes, keep)
            .into_values()
            .flatten()
        {
            if s.header.kind == Kind::Replica {
                self.bytes -= s.header.len;
            }
            log.unpin(&s.loc);
        }
    }

    /// The highest `ser` held without a gap above `from` (or above the checkpoint, if it is
    /// higher: what lies below it is on the datastore); `from` or the checkpoint if none.
    fn contiguous_end(&self, from: u64) -> u64 {
        let mut end = from.max(self.checkpoint);
        while self.writes.contains_key(&(end + 1)) {
            end += 1;
        }
        end
    }

    fn info(&self, volume: Uuid) -> ReplicaInfo {
        ReplicaInfo {
            volume,
            from: self.from.clone(),
            gen: self.gen,
            checkpoint: self.checkpoint,
            last_ser: self.writes.keys().next_back().copied().unwrap_or(0),
            writes: self.writes.len() as u64,
            bytes: self.bytes,
        }
    }
}

/// Turns what the recovery scan found for a volume this host was a peer of back into a set.
pub(super) fn from_recovered(r: Recovered) -> ReplicaSet {
    let mut set = ReplicaSet {
        gen: r.gen,
        checkpoint: r.checkpoint,
        window_end: r.window_end,
        ..ReplicaSet::default()
    };
    for parts in r.writes {
        let ser = parts[0].header.ser;
        set.bytes += parts
            .iter()
            .filter(|p| p.header.kind == Kind::Replica)
            .map(|p| p.header.len)
            .sum::<u64>();
        set.writes.insert(ser, parts);
    }
    set
}

impl CacheHost {
    fn refuse_if_own(&self, volume: Uuid) -> Result<(), ReplicaRefusal> {
        if lock(&self.vols).iter().any(|v| v.id == volume) {
            return Err(ReplicaRefusal::Failed(format!(
                "volume {volume} is served by this host; it cannot be its own peer"
            )));
        }
        Ok(())
    }

    /// Notes how many volumes this host holds replicas of: each takes a share of the log.
    fn count_sets(&self, sets: &HashMap<Uuid, ReplicaSet>) {
        self.shared
            .replica_sets
            .store(sets.len() as u64, Ordering::SeqCst);
    }

    /// Waits, up to [`SPACE_WAIT`], until `volume`'s replicas take less than their share of
    /// the log: an owner must not crowd out this host's own volumes, nor the replicas of
    /// other owners. A write is let in while they are under the share, so they exceed it by
    /// at most one write.
    /// Without `wait`, says at once whether there is room: `Ok(false)` if the write would
    /// have to wait.
    fn replica_room(&self, volume: Uuid, wait: bool) -> Result<bool, ReplicaRefusal> {
        let log = &self.shared.log;
        let started = Instant::now();
        loop {
            let (used, share) = (log.segments_of(volume) as u64, self.shared.share_segments());
            if used < share {
                return Ok(true);
            }
            if !wait {
                return Ok(false);
            }
            if started.elapsed() >= SPACE_WAIT {
                return Err(ReplicaRefusal::Failed(format!(
                    "the replicas of volume {volume} fill their share of this host's cache \
                     ({used} of {share} segments) and no checkpoint freed any within \
                     {SPACE_WAIT:?}"
                )));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn append_meta_for(
        &self,
        volume: Uuid,
        ser: u64,
        gen: u64,
        window_end: u64,
    ) -> Result<(), ReplicaRefusal> {
        let e = Entry {
            kind: Kind::Checkpoint,
            volume,
            ser,
            gen,
            offset: 0,
            len: 0,
            arg: window_end,
        };
        let (loc, _) = self
            .shared
            .log
            .append(&e, &[])
            .map_err(|e| ReplicaRefusal::Failed(format!("cache log: {e}")))?;
        self.shared.log.unpin(&loc);
        Ok(())
    }

    /// The owner `from` starts replicating generation `gen` of `volume`, whose writes up to
    /// `checkpoint` are on the datastore. Copies of older generations are dropped; a request
    /// for an older generation than this host holds is refused as stale.
    pub fn replica_open(
        &self,
        from: &str,
        volume: Uuid,
        gen: u64,
        checkpoint: u64,
    ) -> Result<(), ReplicaRefusal> {
        self.refuse_if_own(volume)?;
        let log = &self.shared.log;
        let mut sets = lock(&self.replicas);
        let set = sets.entry(volume).or_default();
        if set.sealed {
            return Err(sealed(volume));
        }
        if set.gen > gen {
            return Err(ReplicaRefusal::Stale(format!(
                "this host holds generation {} of volume {volume}, newer than {gen}",
                set.gen
            )));
        }
        if set.gen < gen {
            set.release(log, u64::MAX);
            set.gen = gen;
            set.checkpoint = 0;
            set.window_end = 0;
            // What this host said it held was of the old generation.
            set.held = false;
        } else if set.held {
            // The same generation opened again (an owner that reconnects) after this host
            // said how far it holds for a replay: its checkpoint stays where this host said,
            // as for a checkpoint forwarded now ([`CacheHost::replica_window`]).
            return Ok(());
        }
        set.from = from.to_owned();
        // Recorded so a scan knows the generation and where its replicas start; under the
        // lock, so that no record lands in the log once a hold has come (a restart takes the
        // set's checkpoint from the log). Recorded before the replicas it covers go: freed
        // first, their segments could be reused before the record that makes them clean is
        // durable, and a power cut then would leave a hole above the last checkpoint the log
        // holds, which ends the replicas a recovery keeps, durable later ones included.
        let ckpt = set.checkpoint.max(checkpoint);
        let window_end = if set.window_end > ckpt {
            set.window_end
        } else {
            0
        };
        let recorded = self.append_meta_for(volume, ckpt, gen, window_end);
        if recorded.is_ok() {
            set.release(log, checkpoint);
            set.checkpoint = ckpt;
        }
        self.count_sets(&sets);
        recorded
    }

    /// Appends one replicated write (`data`; `None`, a zeroing, kept allocated on the
    /// datastore if `alloc`). Blocks while the log is full, up to [`SPACE_WAIT`].
    #[allow(clippy::too_many_arguments)]
    pub fn replica_write(
        &self,
        volume: Uuid,
        gen: u64,
        ser: u64,
        offset: u64,
        len: u64,
        data: Option<&[u8]>,
        alloc: bool,
    ) -> Result<(), ReplicaRefusal> {
        self.append_replica(volume, gen, ser, offset, len, data, alloc, true)
            .map(|_| ())
    }

    /// As [`CacheHost::replica_write`], but only if it need not wait for room (for the
    /// owner's next checkpoint): `Ok(false)` if it would have to, and nothing was done. A
    /// write of more than one record always says so.
    /// A peer's connection applies a write this way on the thread that reads its frames,
    /// which must never wait for a checkpoint: the checkpoint would be behind it.
    #[allow(clippy::too_many_arguments)]
    pub fn replica_write_at_once(
        &self,
        volume: Uuid,
        gen: u64,
        ser: u64,
        offset: u64,
        len: u64,
        data: Option<&[u8]>,
        alloc: bool,
    ) -> Result<bool, ReplicaRefusal> {
        self.append_replica(volume, gen, ser, offset, len, data, alloc, false)
    }

    /// Appends one replicated write, waiting for room if `wait`; `Ok(false)` if there was
    /// none and it did not wait.
    #[allow(clippy::too_many_arguments)]
    fn append_replica(
        &self,
        volume: Uuid,
        gen: u64,
        ser: u64,
        offset: u64,
        len: u64,
        data: Option<&[u8]>,
        alloc: bool,
        wait: bool,
    ) -> Result<bool, ReplicaRefusal> {
        let sector = crate::SECTOR;
        if len == 0
            || !offset.is_multiple_of(sector)
            || !len.is_multiple_of(sector)
            || offset.checked_add(len).is_none()
            || data.is_some_and(|d| d.len() as u64 != len)
        {
            return Err(ReplicaRefusal::Failed(format!(
                "write {ser} of volume {volume}: range {offset}+{len} is not a whole number of \
                 512-byte sectors"
            )));
        }
        {
            let sets = lock(&self.replicas);
            match sets.get(&volume) {
                None => {
                    return Err(ReplicaRefusal::Failed(format!(
                        "volume {volume} was not opened for replication here"
                    )))
                }
                Some(s) if s.sealed => return Err(sealed(volume)),
                Some(s) if s.held && s.gen == gen => return Err(held(volume, gen)),
                Some(s) if s.gen > gen => {
                    return Err(ReplicaRefusal::Stale(format!(
                        "this host holds generation {} of volume {volume}, newer than {gen}",
                        s.gen
                    )))
                }
                Some(s) if s.gen < gen || ser <= s.checkpoint => {
                    return Err(ReplicaRefusal::Failed(format!(
                        "write {ser} of generation {gen} does not follow generation {} \
                         checkpoint {} (open first)",
                        s.gen, s.checkpoint
                    )))
                }
                Some(_) => {}
            }
        }
        if !self.replica_room(volume, wait)? {
            return Ok(false);
        }
        let kind = match data {
            Some(_) => Kind::Replica,
            None if alloc => Kind::ReplicaZeroAlloc,
            None => Kind::ReplicaZero,
        };
        let split = self.shared.parts(data.is_some(), len);
        if !wait && split.len() > 1 {
            // Once its first part is in, the rest must follow, and could wait for log space
            // only a checkpoint frees: a write of several records is left to a caller that
            // may wait.
            return Ok(false);
        }
        let parts = split.len() as u64;
        let mut out: Vec<Scanned> = Vec::with_capacity(split.len());
        let log = &self.shared.log;
        let fail = |out: &[Scanned], why: String| {
            for s in out {
                log.unpin(&s.loc);
            }
            ReplicaRefusal::Failed(why)
        };
        for (i, (poff, plen)) in (0u64..).zip(split) {
            let e = Entry {
                kind,
                volume,
                ser,
                gen,
                offset: offset + poff,
                len: plen,
                arg: (parts << 32) | i,
            };
            let payload = data.map_or(&[][..], |d| &d[poff as usize..(poff + plen) as usize]);
            let started = Instant::now();
            let loc = loop {
                match log.append(&e, payload) {
                    Ok((loc, _)) => break loc,
                    Err(LogError::NoSpace) if started.elapsed() < SPACE_WAIT => {
                        // Freed segments become reusable after a sync; wait only when none
                        // were freed, and only if asked to (a write that need not wait is
                        // one record: nothing of it is in yet).
                        if !matches!(log.sync_freed(), Ok(true)) {
                            if !wait {
                                return Ok(false);
                            }
                            let _ = log.sync();
                            std::thread::sleep(Duration::from_millis(10));
                        }
                    }
                    Err(err) => return Err(fail(&out, format!("cache log: {err}"))),
                }
            };
            out.push(Scanned {
                header: cachelog::format::Header {
                    kind,
                    seg_seq: 0,
                    volume,
                    ser,
                    gen,
                    offset: e.offset,
                    len: plen,
                    arg: e.arg,
                    payload_crc: 0,
                    data_at: 0,
                    pages: 0,
                },
                loc,
                intact: true,
            });
        }
        let mut sets = lock(&self.replicas);
        match sets.get_mut(&volume) {
            // The set moved on meanwhile (a newer open, a drop, a replay): these are not
            // wanted, and must not be acknowledged.
            Some(s) if s.gen == gen && ser > s.checkpoint && !s.sealed && !s.held => {
                s.bytes += len * u64::from(data.is_some());
                if let Some(old) = s.writes.insert(ser, out) {
                    for r in old {
                        s.bytes -= r.header.len * u64::from(r.header.kind == Kind::Replica);
                        log.unpin(&r.loc);
                    }
                }
                Ok(true)
            }
            _ => Err(fail(
                &out,
                "replication of the volume ended meanwhile".into(),
            )),
        }
    }

    /// The owner's checkpoint: copies up to `ser` are no longer needed.
    pub fn replica_checkpoint(
        &self,
        volume: Uuid,
        gen: u64,
        ser: u64,
    ) -> Result<(), ReplicaRefusal> {
        self.replica_window(volume, gen, ser, 0)
    }

    /// The owner's checkpoint `ser` and, if nonzero, the end of the window it is about to
    /// send (`OwnerMeta::window_end`): a replay of these copies must reach that end before
    /// its first checkpoint. With an end, durable when this returns (the owner sends the
    /// window only then).
    pub fn replica_window(
        &self,
        volume: Uuid,
        gen: u64,
        ser: u64,
        window_end: u64,
    ) -> Result<(), ReplicaRefusal> {
        let mut sets = lock(&self.replicas);
        let Some(set) = sets.get_mut(&volume) else {
            if window_end > 0 {
                // Said held, it would let the owner send a window no replay here could
                // reach: this host holds nothing of the volume to replay.
                return Err(ReplicaRefusal::Failed(format!(
                    "this host holds no replicas of volume {volume}"
                )));
            }
            return Ok(());
        };
        let ser = ser.max(set.checkpoint);
        let news = ser > set.checkpoint || window_end > set.window_end.max(ser);
        if set.gen != gen || !news || set.held {
            // A window end is said held only if this set records it: not for another
            // generation's window, nor one past what a held set (which records nothing more)
            // knows. Said held, it would let the owner send a window no replay here reaches.
            let recorded = set.gen == gen && window_end <= set.window_end.max(set.checkpoint);
            if window_end > ser && !recorded {
                let (held, set_gen) = (set.held, set.gen);
                drop(sets);
                let why = format!(
                    "cannot hold window end {window_end} of volume {volume} generation {gen}: \
                     this host holds generation {set_gen}{}",
                    if held { ", held for a replay" } else { "" }
                );
                return Err(if set_gen > gen {
                    ReplicaRefusal::Stale(why)
                } else {
                    ReplicaRefusal::Failed(why)
                });
            }
            drop(sets);
            // Asked to hold an end already recorded (a retry after a failed sync, say): it
            // must be durable before the answer.
            if window_end > ser {
                self.replica_sync()?;
            }
            return Ok(());
        }
        // The checkpoint goes into the log before the records it covers are released, and
        // under the lock: a hold ([`CacheHost::replica_hold`]) that comes after the check
        // above waits for it, so no checkpoint record lands in the log once the set is held
        // (a restart would take the set's checkpoint from it, past what this host said it
        // would continue from). An append is a device write or two, never a sync.
        // A known end above the new checkpoint stays (the owner's windows reach it anyway).
        let window_end = window_end.max(set.window_end);
        let window_end = if window_end > ser { window_end } else { 0 };
        self.append_meta_for(volume, ser, gen, window_end)?;
        set.release(&self.shared.log, ser);
        set.checkpoint = ser;
        set.window_end = window_end;
        drop(sets);
        if window_end > 0 {
            self.replica_sync()?;
        }
        Ok(())
    }

    /// Drops every copy of `volume` of a generation up to `gen`: they are stale (the owner
    /// moved on, or another host replayed them).
    pub fn replica_drop(&self, volume: Uuid, gen: u64) -> Result<(), ReplicaRefusal> {
        let mut sets = lock(&self.replicas);
        let Some(set) = sets.get(&volume) else {
            return Ok(());
        };
        if set.gen > gen {
            return Ok(());
        }
        let mut set = sets.remove(&volume).expect("present");
        self.count_sets(&sets);
        drop(sets);
        let last = set.writes.keys().next_back().copied().unwrap_or(0);
        // A checkpoint above them all, so a scan does not bring them back.
        let recorded = self.append_meta_for(volume, last.max(set.checkpoint), set.gen, 0);
        set.release(&self.shared.log, u64::MAX);
        if !lock(&self.vols).iter().any(|v| v.id == volume) {
            // Under the lock, and only with no set again: the owner's open of the next
            // generation may have come meanwhile (on another connection), and its record
            // must keep the segments that hold it (`replica_open` appends under this lock).
            let sets = lock(&self.replicas);
            if !sets.contains_key(&volume) {
                self.shared.log.forget(volume);
            }
        }
        info!(
            "dropped the replicas of volume {volume} (generation {}, up to write {last})",
            set.gen
        );
        recorded
    }

    /// Makes every replica taken so far durable (a forwarded FLUSH).
    pub fn replica_sync(&self) -> Result<(), ReplicaRefusal> {
        self.shared
            .log
            .sync()
            .map_err(|e| ReplicaRefusal::Failed(format!("cache log: {e}")))
    }

    /// For a host about to replay `volume` (DESIGN §4): says up to which `ser` this host
    /// holds generation `gen` without a gap above `from`, once all of that is durable.
    /// The replaying host goes no further than every peer it keeps can go, so whichever of
    /// them takes over if it dies can finish every write it started.
    ///
    /// [`ReplicaRefusal::Absent`] only if this host holds nothing of the volume at all: no
    /// replicas, and no record of it in its log. Replicas promoted for a replay are no
    /// longer replicas but are still here (recovered, attached, or kept for the next start
    /// after a replay that stopped), and an owner told "absent" may conclude that nobody can
    /// replay what it held.
    pub fn replica_held(&self, volume: Uuid, gen: u64, from: u64) -> Result<u64, ReplicaRefusal> {
        {
            let sets = lock(&self.replicas);
            match sets.get(&volume) {
                Some(set) if set.gen == gen => {
                    // Measured first, synced after: a write is in the set only once its
                    // append is done, so the sync covers every write counted. Synced first,
                    // a write appended between the sync and the count would be counted
                    // without being durable, and a replay that trusted it could go further
                    // than this host could continue after a power cut.
                    let end = set.contiguous_end(from);
                    drop(sets);
                    self.replica_sync()?;
                    return Ok(end);
                }
                Some(set) if set.gen > gen => {
                    return Err(ReplicaRefusal::Stale(format!(
                        "this host holds generation {} of volume {volume}, newer than {gen}",
                        set.gen
                    )))
                }
                Some(set) => {
                    return Err(ReplicaRefusal::Failed(format!(
                        "this host holds generation {} of volume {volume}, not {gen}",
                        set.gen
                    )))
                }
                None => {}
            }
        }
        // Promotion takes the set away before the recovered data is in place; the records
        // stay in the log throughout, so the log is asked last.
        if lock(&self.recovered).contains_key(&volume) || self.shared.log.segments_of(volume) > 0 {
            return Err(ReplicaRefusal::Failed(format!(
                "this host holds records of volume {volume} that are no longer replicas (it \
                 replays them, or kept them from a replay that stopped)"
            )));
        }
        Err(ReplicaRefusal::Absent(format!(
            "this host holds nothing of volume {volume}"
        )))
    }

    /// Another host asks how far this one holds `volume`'s replicas of generation `gen`
    /// because it is about to replay them (or its owner's hand-off found no taker): from now
    /// on the owner's checkpoints of that generation release nothing here, and its writes of
    /// that generation are refused (see `ReplicaSet::held`), so no write of the owner can
    /// complete beyond what the answer says. Asked before [`CacheHost::replica_held`]
    /// measures, so no checkpoint or write lands between the answer and this. An owner that
    /// goes on (its lease came back) finds this peer failed and replaces it, in a new
    /// generation.
    pub fn replica_hold(&self, volume: Uuid, gen: u64) {
        if let Some(set) = lock(&self.replicas)
            .get_mut(&volume)
            .filter(|s| s.gen == gen)
        {
            set.held = true;
        }
    }

    /// Online replay, before anything else: this host takes no more of `volume`'s writes
    /// (nor a new generation of it), so no write of its owner can complete from here on (a
    /// write completes only once every listed peer has it). Returns the generation of the
    /// replicas and up to which `ser` this host holds them without a gap above `from` (see
    /// [`CacheHost::replica_held`]); `None` if it holds none.
    ///
    /// What it counts is durable when it returns: the replay destages these records as
    /// recovered ones, which it takes to be durable, and a replay that put writes on the
    /// datastore which a power cut then took from this log would, resumed after it, put
    /// older data back over some of them (a state no prefix of the writes gives).
    pub fn replica_seal(
        &self,
        volume: Uuid,
        from: u64,
    ) -> Result<Option<(u64, u64)>, ReplicaRefusal> {
        let sealed = {
            let mut sets = lock(&self.replicas);
            let Some(set) = sets.get_mut(&volume) else {
                return Ok(None);
            };
            set.sealed = true;
            (set.gen, set.contiguous_end(from))
        };
        // Counted first, synced after, as in `replica_held`.
        self.replica_sync()?;
        Ok(Some(sealed))
    }

    /// Every volume this host holds replicas of.
    pub fn replica_sets(&self) -> Vec<ReplicaInfo> {
        lock(&self.replicas)
            .iter()
            .map(|(id, s)| s.info(*id))
            .collect()
    }

    /// Online replay, first step: the volume's replicas above `checkpoint` (the vault's, if
    /// it is ahead of this host's) and up to `upto` become recovered dirty data, which the
    /// volume replays when it attaches here. Only the contiguous run above the checkpoint
    /// counts. Writes above `upto` are dropped: another peer that would take over lacks them,
    /// so none of them ever completed. Returns how many writes will be replayed.
    pub fn promote_replicas(
        &self,
        volume: Uuid,
        checkpoint: u64,
        upto: u64,
    ) -> Result<usize, Error> {
        let mut sets = lock(&self.replicas);
        let Some(set) = sets.get(&volume) else {
            return Err(Error::Cache(format!(
                "this host holds no replicas of volume {volume}"
            )));
        };
        let from = set.checkpoint.max(checkpoint);
        if from > set.checkpoint {
            // The replicas up to the vault's checkpoint go next: recorded first, as in
            // `replica_open`, or a power cut after their segments were reused would leave a
            // hole above this host's own checkpoint, and a recovery would keep none of the
            // replicas above it.
            let window_end = if set.window_end > from {
                set.window_end
            } else {
                0
            };
            self.append_meta_for(volume, from, set.gen, window_end)
                .map_err(|e| Error::Cache(format!("record the replay's checkpoint: {e:?}")))?;
        }
        let mut set = sets.remove(&volume).expect("looked up above");
        self.count_sets(&sets);
        drop(sets);
        let log = &self.shared.log;
        set.release(log, from);
        let mut r = Recovered {
            checkpoint: from,
            gen: set.gen,
            window_end: if set.window_end > from {
                set.window_end
            } else {
                0
            },
            pinned_by_host: true,
            void_upto: set
                .writes
                .keys()
                .next_back()
                .copied()
                .unwrap_or(from)
                .max(from),
            ..Recovered::default()
        };
        let mut expect = from + 1;
        let mut rest = std::mem::take(&mut set.writes);
        let beyond = match upto.max(from).checked_add(1) {
            Some(above) => rest.split_off(&above),
            None => BTreeMap::new(),
        };
        if !beyond.is_empty() {
            info!(
                "volume {volume}: {} write(s) above {upto} are not replayed: a peer that \
                 would take over the replay lacks them, so none of them completed",
                beyond.len()
            );
            for s in beyond.into_values().flatten() {
                log.unpin(&s.loc);
            }
        }
        while let Some(parts) = rest.remove(&expect) {
            r.writes.push(parts.into_iter().map(as_owned).collect());
            expect += 1;
        }
        if !rest.is_empty() {
            r.degraded = Some(format!(
                "replica of write {expect} is missing; {} later replica(s) were discarded to \
                 keep the volume a prefix",
                rest.len()
            ));
            warn!("volume {volume}: {}", r.degraded.as_deref().unwrap_or(""));
            for s in rest.into_values().flatten() {
                log.unpin(&s.loc);
            }
        }
        let n = r.writes.len();
        lock(&self.recovered).insert(volume, r);
        Ok(n)
    }

    /// Gives up the dirty data recovered for `volume` from this host's own log, because
    /// another host replayed the volume since (its vault generation is newer): replaying it
    /// would put old data over new. Returns how many writes were dropped.
    pub fn discard_recovered(&self, volume: Uuid) -> usize {
        let Some(r) = lock(&self.recovered).remove(&volume) else {
            return 0;
        };
        if r.pinned_by_host {
            for s in r.writes.iter().flatten() {
                self.shared.log.unpin(&s.loc);
            }
        }
        r.writes.len()
    }

    /// The newest generation of `volume` this host's log recorded (dirty data, or only its
    /// metadata); `None` if the log never held anything of it (a new cache device, say).
    pub fn logged_gen(&self, volume: Uuid) -> Option<u64> {
        // The log's own memory of the volume, which outlives its attach and the end of
        // recovery (unlike `recovered`).
        let gen = self.shared.log.meta(volume).max_gen;
        (gen > 0).then_some(gen)
    }

    /// The generation the log's own dirty data of `volume` is in, if it holds any.
    pub fn recovered_gen(&self, volume: Uuid) -> Option<u64> {
        lock(&self.recovered)
            .get(&volume)
            .filter(|r| !r.writes.is_empty())
            .map(|r| r.gen)
    }

    /// The checkpoint above which the log's own dirty data of `volume` lies, if it holds any.
    pub fn recovered_checkpoint(&self, volume: Uuid) -> Option<u64> {
        lock(&self.recovered)
            .get(&volume)
            .filter(|r| !r.writes.is_empty())
            .map(|r| r.checkpoint)
    }

    /// The next attach of `volume` starts a generation above `gen` (the vault's), whatever
    /// this host's log remembers.
    pub fn raise_gen(&self, volume: Uuid, gen: u64) {
        let mut f = lock(&self.gen_floor);
        let e = f.entry(volume).or_default();
        *e = (*e).max(gen + 1);
    }
}
