//! Kind `lun`: one whole device — a block device, a file, or an NBD export served by nbdkit or
//! qemu-nbd — formatted with a small label and a volume table ([`crate::label`]). Each volume is
//! one contiguous extent, so its bytes stay plain raw data any tool can read at the recorded
//! offset.
//!
//! Table changes are serialized by a lock here; across hosts they are serialized through the
//! coordinator, which is the only one who asks a LUN to create or delete volumes.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::Mutex;
use tracing::{info, warn};
use uuid::Uuid;

use crate::device::{Device, FileDevice, NbdDevice, NBD_POOL_DEFAULT};
use crate::fence::Fence;
use crate::label::{self, Entry, Label, LabelError, Table};
use crate::{
    io_err, Capacity, Datastore, DatastoreSpec, Error, Extent, Gate, Kind, OpenMode, Result,
    VolumeSpec,
};

/// How often a host confirms that each LUN it uses is still its pod's, by its label
/// ([`watch_owner`]).
pub const OWNER_CHECK_EVERY: Duration = Duration::from_millis(if cfg!(test) { 300 } else { 2000 });
/// How long writes to a LUN go on after a check that confirmed it (from when the check was
/// sent). Long: a LUN whose reads are slow (seconds, on a struggling SAN) must not have its
/// writes stopped by that alone; only a label that cannot be read for this long stops them.
pub const OWNER_VALID: Duration = Duration::from_millis(if cfg!(test) { 900 } else { 20_000 });
/// How long a take-over waits after relabelling a LUN before its pod uses it: longer than
/// [`OWNER_VALID`], so no host of the pod it was taken from still writes it by then (its last
/// confirmation was sent before the new label landed), with 5 s for a write issued just
/// before that to land. The caller holds the datastore's lock meanwhile, which the other
/// hosts of its pod wait up to 30 s for (a start with `take_over` configured on every host).
pub const TAKE_OVER_WAIT: Duration = Duration::from_millis(if cfg!(test) { 1500 } else { 25_000 });

pub struct LunDatastore {
    spec: DatastoreSpec,
    dev: Arc<dyn Device>,
    label: Label,
    /// The pod this host is in, if the caller named one: table changes are refused once the
    /// label names another (a take-over while this host had the LUN open).
    pod: Option<Uuid>,
    /// Closed unless a recent check of the label found it this pod's ([`OWNER_VALID`]),
    /// revoked once it names another ([`shut_out`]); under the host's fence. The gate and the
    /// device ask it before each write.
    owner: Arc<Fence>,
    table: Mutex<Table>,
    gate: Arc<Gate>,
}

/// Whether a target string names an NBD export rather than a path.
pub fn is_nbd_uri(target: &str) -> bool {
    target.starts_with("nbd://") || target.starts_with("nbd+unix://")
}

async fn open_device(name: &str, target: &str, direct: bool) -> Result<Arc<dyn Device>> {
    if is_nbd_uri(target) {
        let uri = nbd::uri::NbdUri::parse(target).map_err(|e| Error::Invalid(e.to_string()))?;
        let d = NbdDevice::connect(&uri, NBD_POOL_DEFAULT)
            .await
            .map_err(|e| Error::Invalid(format!("datastore {name:?}: {e}")))?;
        Ok(Arc::new(d))
    } else {
        let p = Path::new(target).to_owned();
        let d = crate::device::blocking(move || FileDevice::open_with(&p, direct))
            .await
            .map_err(|e| {
                Error::Invalid(format!(
                    "datastore {name:?}: cannot open {target} ({e}); give an existing block \
                     device, a file, or an NBD URI such as nbd://127.0.0.1:10810/lun0"
                ))
            })?;
        Ok(Arc::new(d))
    }
}

/// The pod named in the label of the LUN `spec` names (its backup label if need be): how a
/// pod whose stored id was lost (an etcd restored from a backup older than pod ids, a state
/// file rewritten by an older build) finds its id again instead of making a new one, under
/// which none of its LUNs would open. `None` if the LUN cannot be read or is not the one
/// `spec` recorded; `Some(None)` for a label from before pod ids.
pub async fn label_pod(spec: &DatastoreSpec) -> Option<Option<Uuid>> {
    let Kind::Lun { target, lun_id } = &spec.kind else {
        return None;
    };
    let dev = open_device(&spec.name, target, spec.direct).await.ok()?;
    let head = dev.read_at(0, label::DATA_START as usize).await.ok()?;
    let (l, _) = decode_label(&head, &spec.name, target).ok()?;
    if lun_id.is_some_and(|id| id != l.lun_id) {
        return None;
    }
    Some(l.pod)
}

impl LunDatastore {
    /// Opens the LUN `spec` names for pod `pod` (none: any pod), formatting it if it is blank
    /// and being added. A LUN whose label names another pod is refused: two pods would
    /// allocate from one volume table under two locks. Added with `take_over` naming that
    /// pod, this pod takes it over (its label then names this pod, and the other pod can no
    /// longer change or open it).
    pub async fn open(
        spec: DatastoreSpec,
        mode: OpenMode,
        pod: Option<Uuid>,
    ) -> Result<LunDatastore> {
        let Kind::Lun { target, .. } = &spec.kind else {
            unreachable!(
                "LunDatastore::open called for a {} datastore",
                spec.kind_name()
            );
        };
        let dev = open_device(&spec.name, target, spec.direct).await?;
        Self::open_on(dev, spec, mode, pod).await
    }

    /// [`LunDatastore::open`] on a device already open (tests wrap one to watch its IO).
    async fn open_on(
        dev: Arc<dyn Device>,
        mut spec: DatastoreSpec,
        mode: OpenMode,
        pod: Option<Uuid>,
    ) -> Result<LunDatastore> {
        let Kind::Lun { target, lun_id } = &spec.kind else {
            unreachable!("LunDatastore::open_on for a {} datastore", spec.kind_name());
        };
        let (target, recorded_id) = (target.clone(), *lun_id);
        let name = spec.name.clone();
        if dev.size() < label::DATA_START + label::EXTENT_ALIGN {
            return Err(Error::Invalid(format!(
                "datastore {name:?}: {target} has {} bytes; a LUN needs at least {} bytes",
                dev.size(),
                label::DATA_START + label::EXTENT_ALIGN
            )));
        }
        // When the label this open goes by was asked for (see `owner` below).
        let mut sent = std::time::Instant::now();
        let head = dev
            .read_at(0, label::DATA_START as usize)
            .await
            .map_err(io_err(format!("read label of {target}")))?;
        let decoded = decode_label(&head, &name, &target);
        // A label read from its backup (the label write was torn) is written whole again.
        let mut repair = matches!(decoded, Ok((_, true)));
        // The pod this open takes the LUN over from.
        let mut taken_from = None;
        let decoded = decoded.map(|(l, _)| l);
        let slot = |i: usize| {
            let o = label::TABLE_SLOT_OFFSETS[i] as usize;
            Table::decode(&head[o..o + label::TABLE_SLOT_LEN])
        };
        let (label, table) = match (decoded, mode) {
            (Ok(l), _) if recorded_id.is_some_and(|id| id != l.lun_id) => {
                return Err(Error::Invalid(format!(
                    "datastore {name:?}: {target} holds Vesta LUN {} but {} was added under \
                     this name; the device behind the target has changed",
                    l.lun_id,
                    recorded_id.unwrap_or_default()
                )))
            }
            (Ok(mut l), _) => {
                let t = Table::newest([slot(0), slot(1)]).ok_or_else(|| {
                    Error::Invalid(format!(
                        "datastore {name:?}: {target} has a Vesta label but neither volume \
                         table copy is valid"
                    ))
                })?;
                t.check(l.device_size).map_err(|why| {
                    Error::Invalid(format!(
                        "datastore {name:?}: the volume table on {target} is inconsistent \
                         ({why}); refusing to use it"
                    ))
                })?;
                if dev.size() < l.device_size {
                    return Err(Error::Invalid(format!(
                        "datastore {name:?}: {target} shrank from {} to {} bytes since it was \
                         formatted; volumes past the end would be lost",
                        l.device_size,
                        dev.size()
                    )));
                }
                match (pod, l.pod) {
                    (Some(ours), None) => {
                        // Formatted before labels named pods: this pod's from now on.
                        l.pod = Some(ours);
                        repair = true;
                    }
                    (Some(ours), Some(theirs)) if ours != theirs => match mode {
                        OpenMode::Reopen => {
                            return Err(Error::Invalid(format!(
                                "datastore {name:?}: {target} now belongs to another Vesta pod \
                                 ({theirs}; this pod is {ours}), which took it over: this pod \
                                 must not use it any more"
                            )))
                        }
                        OpenMode::Add { take_over, .. } if take_over != Some(theirs) => {
                            return Err(Error::Foreign(format!(
                                "datastore {name:?}: {target} is a Vesta LUN of another pod \
                                 ({theirs}; this pod is {ours}) with {} volume(s): two pods \
                                 allocating from one volume table overwrite each other's \
                                 volumes. Remove it from that pod first; pass --take-over \
                                 {theirs} only if that pod is gone for good (as is a single \
                                 host whose data directory was lost): this pod then takes the \
                                 LUN over, with its volumes, and the other can no longer change \
                                 it",
                                t.entries.len()
                            )))
                        }
                        OpenMode::Add { .. } => {
                            warn!(
                                "datastore {name:?}: taking Vesta LUN {} on {target} over from \
                                 pod {theirs} (--take-over)",
                                l.lun_id
                            );
                            l.pod = Some(ours);
                            repair = true;
                            taken_from = Some(theirs);
                        }
                    },
                    _ => {}
                }
                if repair {
                    // Only over the label this open read: another pod may have taken the LUN
                    // over since, and its label must not be written back.
                    let now = dev
                        .read_at(0, label::LABEL_LEN)
                        .await
                        .map_err(io_err(format!("read label of {target}")))?;
                    let ours = l.encode();
                    if now[..] == ours[..] {
                        // Another host of this pod wrote the same label meanwhile.
                    } else if now[..] != head[..label::LABEL_LEN] {
                        return Err(Error::Invalid(format!(
                            "datastore {name:?}: the label of {target} changed while it was \
                             opened (another host wrote it); try again"
                        )));
                    } else {
                        write_label(&*dev, &l)
                            .await
                            .map_err(io_err(format!("write the label of {target}")))?;
                    }
                }
                if let Some(theirs) = taken_from {
                    // Hosts of that pod still running stop their writes to the LUN once no
                    // check confirms it theirs (`watch_owner`): not before then may this pod
                    // hand out its space or serve its volumes.
                    info!(
                        "datastore {name:?}: took Vesta LUN {} over; waiting {TAKE_OVER_WAIT:?} \
                         for any host of pod {theirs} still running to stop its IO to it",
                        l.lun_id
                    );
                    tokio::time::sleep(TAKE_OVER_WAIT).await;
                    sent = std::time::Instant::now();
                    // A host of that pod that read the label before this open wrote it may
                    // have written it back since (a repair of its own): then both pods think
                    // the LUN theirs, and this one must not use it.
                    let now = dev
                        .read_at(0, label::LABEL_LEN)
                        .await
                        .map_err(io_err(format!("read label of {target}")))?;
                    if now[..] != l.encode()[..] {
                        return Err(Error::Invalid(format!(
                            "datastore {name:?}: the label of {target} changed while it was \
                             taken over (a host of pod {theirs} wrote it); nothing was taken \
                             over. Stop that pod's hosts and try again"
                        )));
                    }
                }
                if mode != OpenMode::Reopen {
                    info!(
                        "datastore {name:?}: adopting existing Vesta LUN {} on {target} with {} \
                         volume(s)",
                        l.lun_id,
                        t.entries.len()
                    );
                }
                (l, t)
            }
            (Err(e), OpenMode::Reopen) => {
                return Err(Error::Invalid(format!(
                    "datastore {name:?}: {target} no longer carries its Vesta label ({e}); was \
                     the device wiped or replaced?"
                )))
            }
            (Err(e), OpenMode::Add { force, .. }) => {
                // What --force must not format: a label from a newer build, or a Vesta label
                // (or its backup) that does not decode while a volume table is whole.
                if let LabelError::Version(v) = e {
                    return Err(Error::Foreign(format!(
                        "datastore {name:?}: {target} carries a Vesta label of version {v}, \
                         written by a newer Vesta than this one ({}); use that version",
                        label::VERSION
                    )));
                }
                let o = label::LABEL_BACKUP_OFFSET as usize;
                let magic = |at: usize| &head[at..at + 8] == label::LABEL_MAGIC;
                let table = Table::newest([slot(0), slot(1)]).filter(|t| !t.entries.is_empty());
                if let (true, Some(t)) = (magic(0) || magic(o), table) {
                    let backup = match Label::decode(&head[o..o + label::LABEL_LEN]) {
                        Ok(b) => format!("its backup at 3 MiB names Vesta LUN {}", b.lun_id),
                        Err(b) => format!("its backup at 3 MiB does not decode either ({b})"),
                    };
                    return Err(Error::Foreign(format!(
                        "datastore {name:?}: the Vesta label of {target} does not decode \
                         ({e}), and {backup}, while its volume table holds {} volume(s): \
                         formatting would destroy them, so --force does not. To keep them, \
                         restore the label (the 4 KiB at offset 3 MiB, if whole, copied to \
                         offset 0); to format anyway, zero the first 4 MiB and add it with --force",
                        t.entries.len()
                    )));
                }
                let first = match head.iter().position(|b| *b != 0) {
                    Some(at) => Some(at as u64),
                    None => first_data_past_head(&dev)
                        .await
                        .map_err(io_err(format!("read {target}")))?,
                };
                let blank = first.is_none();
                if let (Some(first), false) = (first, force) {
                    let what = match e {
                        LabelError::NoMagic => "data that is not a Vesta label".to_owned(),
                        other => format!("a damaged Vesta label ({other})"),
                    };
                    return Err(Error::Foreign(format!(
                        "datastore {name:?}: {target} holds {what} (first non-zero byte at \
                         offset {first}); formatting it would destroy that data. Pass --force \
                         to format it anyway"
                    )));
                }
                if !blank {
                    warn!("datastore {name:?}: formatting {target} over existing data (--force)");
                }
                let l = Label {
                    lun_id: Uuid::new_v4(),
                    device_size: dev.size(),
                    pod,
                };
                let t = Table {
                    generation: 1,
                    entries: Vec::new(),
                };
                format(&*dev, &l, &t)
                    .await
                    .map_err(io_err(format!("format {target}")))?;
                info!(
                    "datastore {name:?}: formatted {target} as Vesta LUN {} ({} bytes)",
                    l.lun_id,
                    dev.size()
                );
                (l, t)
            }
        };
        spec.kind = Kind::Lun {
            target,
            lun_id: Some(label.lun_id),
        };
        let gate = Arc::new(Gate::new(spec.queue_depth));
        let owner = Arc::new(match pod {
            // The label this open read (or wrote) names this pod.
            Some(_) => {
                let f = Fence::closed();
                f.extend_to(sent + OWNER_VALID);
                f
            }
            None => Fence::open(),
        });
        gate.set_fence(owner.clone());
        dev.set_fence(owner.clone());
        if let Some(pod) = pod {
            tokio::spawn(watch_owner(
                Arc::downgrade(&dev),
                Arc::downgrade(&gate),
                Arc::downgrade(&owner),
                pod,
                label.lun_id,
                spec.name.clone(),
            ));
        }
        Ok(LunDatastore {
            gate,
            spec,
            dev,
            label,
            pod,
            owner,
            table: Mutex::new(table),
        })
    }

    pub fn lun_id(&self) -> Uuid {
        self.label.lun_id
    }

    /// Fails if this host's fence is closed, or was closed at any time since `since` (its
    /// [`Gate::fence_closes`] when the table change began). The table, and the space it hands
    /// out, are shared by every host of the LUN, and changes to them are serialized by a lock
    /// bound to this host's lease: past the fence another host may hold that lock, and may
    /// have given the space this host is about to zero, trim or record to a volume of its
    /// own. A fence reopened under a new lease allows writes again, but the lock taken under
    /// the old one is gone: a change begun before must not go on.
    fn unfenced(&self, since: u64, what: &str) -> Result<()> {
        if self.gate.fenced(crate::Op::Write) || self.gate.fence_closes() != since {
            return Err(Error::Io {
                what: format!("{what} on datastore {:?}", self.spec.name),
                source: std::io::Error::other(crate::fence::FENCED),
            });
        }
        Ok(())
    }

    /// Writes `t` to its slot and makes it durable, unless fenced since `since`
    /// ([`LunDatastore::unfenced`]). The other slot keeps the previous table, so a crash in
    /// the middle leaves one valid copy.
    async fn commit(&self, t: &Table, since: u64) -> Result<()> {
        self.unfenced(since, "write the volume table")?;
        let slot = Table::slot_of(t.generation);
        self.dev
            .write_at(label::TABLE_SLOT_OFFSETS[slot], table_bytes(t), true)
            .await
            .map_err(io_err(format!(
                "write volume table of datastore {:?}",
                self.spec.name
            )))
    }

    /// Writes `next`, the table after `t`, and makes it `t` once it is on the device. A write
    /// that answered an error may still have landed (a sync that failed after the write, an
    /// NBD reply lost with its connection), so the device is read again to tell: taking a
    /// landed change for a failed one would, after a delete, serve a volume whose extent the
    /// table has already given back for the next create to take. A write that went
    /// unanswered ([`crate::unanswered`]) is given [`crate::LATE_WRITE_GRACE`] to land first, and
    /// may land even after that: its outcome is then unknown whatever the read finds.
    async fn commit_or_read_back(&self, t: &mut Table, next: &Table, since: u64) -> Commit {
        let Err(e) = self.commit(next, since).await else {
            *t = next.clone();
            return Commit::Landed;
        };
        let unanswered = matches!(&e, Error::Io { source, .. } if crate::unanswered(source));
        if unanswered {
            warn!(
                "datastore {:?}: writing volume table {} went unanswered ({e}); waiting {:?} \
                 for it to land before reading the table back",
                self.spec.name,
                next.generation,
                crate::LATE_WRITE_GRACE
            );
            tokio::time::sleep(crate::LATE_WRITE_GRACE).await;
        }
        match self.refresh(t).await {
            Ok(()) if t == next => {
                // Found, but maybe only in a cache: a sync that failed after the write left
                // it in the host's page cache (which Linux then counts clean, never to write
                // it back) and the device with the table before. Written again, and synced,
                // it is on the device; the same bytes, so a late landing of the first write
                // changes nothing.
                match self.commit(next, since).await {
                    Ok(()) => {
                        warn!(
                            "datastore {:?}: writing volume table {} answered an error ({e}); \
                             reading it back found it, and writing it again made it durable",
                            self.spec.name, next.generation
                        );
                        Commit::Landed
                    }
                    Err(again) => {
                        warn!(
                            "datastore {:?}: writing volume table {} answered an error ({e}); \
                             reading it back found it, but writing it again failed too \
                             ({again}): whether the device holds it is unknown",
                            self.spec.name, next.generation
                        );
                        Commit::Unknown(e)
                    }
                }
            }
            Ok(()) if unanswered => {
                warn!(
                    "datastore {:?}: writing volume table {} went unanswered ({e}); it may \
                     still land, though the device holds the table before it now",
                    self.spec.name, next.generation
                );
                Commit::Unknown(e)
            }
            Ok(()) => Commit::NotLanded(e),
            Err(read) => {
                warn!(
                    "datastore {:?}: writing volume table {} answered an error ({e}), and \
                     reading it back failed too ({read})",
                    self.spec.name, next.generation
                );
                Commit::Unknown(e)
            }
        }
    }

    /// Reads the table back from the device and takes it if it is newer than `t`: another
    /// host may have changed it. Callers on several hosts serialize table changes through the
    /// coordinator's datastore lock, so after this `t` is the newest table and the next
    /// commit goes to the other slot.
    async fn refresh(&self, t: &mut Table) -> Result<()> {
        self.check_pod().await?;
        let start = label::TABLE_SLOT_OFFSETS[0];
        let len = (label::TABLE_SLOT_OFFSETS[1] - start) as usize + label::TABLE_SLOT_LEN;
        let b = self.dev.read_at(start, len).await.map_err(io_err(format!(
            "read volume table of datastore {:?}",
            self.spec.name
        )))?;
        let slot = |i: usize| {
            let o = (label::TABLE_SLOT_OFFSETS[i] - start) as usize;
            Table::decode(&b[o..o + label::TABLE_SLOT_LEN])
        };
        let Some(newest) = Table::newest([slot(0), slot(1)]) else {
            return Err(Error::Invalid(format!(
                "datastore {:?}: neither volume table copy is valid any more",
                self.spec.name
            )));
        };
        if newest.generation > t.generation {
            newest.check(self.label.device_size).map_err(|why| {
                Error::Invalid(format!(
                    "datastore {:?}: the volume table is inconsistent ({why}); refusing to use it",
                    self.spec.name
                ))
            })?;
            *t = newest;
        }
        Ok(())
    }

    /// Fails if the label now names a pod other than this host's: another pod took the LUN
    /// over (`take_over`) while it was open here, and this pod must not change its table,
    /// open its volumes, or do any IO to it any more ([`shut_out`], at the first sight and for
    /// good). A label that names this pod confirms it ([`OWNER_VALID`]).
    async fn check_pod(&self) -> Result<()> {
        if let Some(why) = self.gate.shut_out_reason() {
            return Err(Error::Invalid(why.to_owned()));
        }
        let Some(pod) = self.pod else {
            return Ok(());
        };
        let sent = std::time::Instant::now();
        match owner_of(&*self.dev, pod, self.label.lun_id, &self.spec.name).await? {
            Owner::Ours => {
                self.owner.extend_to(sent + OWNER_VALID);
                Ok(())
            }
            Owner::Other(why) => {
                shut_out(&self.gate, &self.owner, why.clone());
                Err(Error::Invalid(why))
            }
        }
    }

    fn extent(&self, e: &Entry, size: u64) -> Extent {
        Extent::new(self.dev.clone(), e.offset, size, self.gate.clone())
    }
}

/// Whose a LUN is now ([`owner_of`]).
enum Owner {
    Ours,
    /// No longer this pod's: why.
    Other(String),
}

/// Whose LUN `lun_id` (datastore `name`) on `dev` is now, for a host of pod `ours`, by its
/// label (its backup if a take-over tore it). An error if that cannot be told: the label
/// cannot be read or does not decode.
async fn owner_of(dev: &dyn Device, ours: Uuid, lun_id: Uuid, name: &str) -> Result<Owner> {
    let read = |at: u64| async move {
        dev.read_at(at, label::LABEL_LEN)
            .await
            .map_err(io_err(format!("read the label of datastore {name:?}")))
    };
    let mut l = Label::decode(&read(0).await?);
    if l == Err(LabelError::BadChecksum) {
        // A take-over torn in the label: its backup, written first, names the new pod.
        l = Label::decode(&read(label::LABEL_BACKUP_OFFSET).await?).and_then(|b| {
            if b.lun_id == lun_id {
                Ok(b)
            } else {
                Err(LabelError::BadChecksum)
            }
        });
    }
    match l {
        Ok(Label {
            pod: Some(theirs), ..
        }) if theirs != ours => Ok(Owner::Other(format!(
            "datastore {name:?} now belongs to another Vesta pod ({theirs}; this pod is \
             {ours}), which took it over: this pod must not use it any more"
        ))),
        Ok(l) if l.lun_id != lun_id => Ok(Owner::Other(format!(
            "datastore {name:?} now carries Vesta LUN {} instead of {lun_id}: the device was \
             replaced or formatted again",
            l.lun_id
        ))),
        Ok(_) => Ok(Owner::Ours),
        // Whose it is cannot be told: no change until it can (a reopen refuses it too).
        Err(e) => Err(Error::Invalid(format!(
            "datastore {name:?}: its Vesta label can no longer be read ({e}); its volume table \
             is left alone until it is restored"
        ))),
    }
}

/// Shuts a LUN that is no longer this pod's, for good: every IO through its gate fails, and
/// its own fence, which the device asks too (batches, long zeroings, writes waiting for a
/// reconnect), is revoked.
fn shut_out(gate: &Gate, owner: &Fence, why: String) {
    if gate.shut_out_reason().is_none() {
        warn!("{why}; every IO to it fails from now on");
    }
    gate.shut_out(why);
    owner.revoke();
}

/// Confirms, every [`OWNER_CHECK_EVERY`] for as long as anything uses the LUN (its gate is
/// alive), that its label still names pod `pod`: each confirmation lets its writes go on for
/// [`OWNER_VALID`] from when the check was sent. A label naming another pod shuts the LUN out
/// ([`shut_out`]); one that cannot be read only lets the fence lapse until a later check
/// confirms it again.
async fn watch_owner(
    dev: std::sync::Weak<dyn Device>,
    gate: std::sync::Weak<Gate>,
    owner: std::sync::Weak<Fence>,
    pod: Uuid,
    lun_id: Uuid,
    name: String,
) {
    let mut every = tokio::time::interval(OWNER_CHECK_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut lapsed = false;
    loop {
        every.tick().await;
        let (Some(dev), Some(gate), Some(owner)) = (dev.upgrade(), gate.upgrade(), owner.upgrade())
        else {
            return;
        };
        if gate.shut_out_reason().is_some() {
            return;
        }
        let sent = std::time::Instant::now();
        let checked = tokio::time::timeout(OWNER_VALID, owner_of(&*dev, pod, lun_id, &name)).await;
        match checked {
            Ok(Ok(Owner::Ours)) => {
                owner.extend_to(sent + OWNER_VALID);
                if std::mem::take(&mut lapsed) {
                    info!("datastore {name:?}: its label names this pod again; writes go on");
                }
            }
            Ok(Ok(Owner::Other(why))) => {
                shut_out(&gate, &owner, why);
                return;
            }
            Ok(Err(e)) if !owner.allows_writes() && !lapsed => {
                lapsed = true;
                warn!(
                    "datastore {name:?}: no write goes to it until its label can be read again \
                     to confirm this pod still owns it ({e})"
                );
            }
            Err(_) if !owner.allows_writes() && !lapsed => {
                lapsed = true;
                warn!(
                    "datastore {name:?}: no write goes to it until its label can be read again \
                     to confirm this pod still owns it (no answer within {OWNER_VALID:?})"
                );
            }
            _ => {}
        }
    }
}

/// Table `t` as written to its slot: padded with zeroes to whole 4 KiB blocks, which every
/// device takes (`O_DIRECT` wants whole sectors); [`Table::decode`] reads only the table.
fn table_bytes(t: &Table) -> bytes::Bytes {
    let mut b = t.encode();
    b.resize(b.len().next_multiple_of(label::LABEL_LEN), 0);
    bytes::Bytes::from(b)
}

/// Where a blank check reads past the first [`label::DATA_START`] bytes (which it reads
/// whole): the last 4 MiB, where other formats keep their second copies (a GPT's backup
/// header, an md 1.0 superblock, ZFS's last two labels), and [`BLANK_SAMPLES`] pieces of
/// 64 KiB evenly spread over the rest. Reading a whole LUN to add it would take hours; this
/// takes about 8 MiB. Pure: (offset, length) pairs within `size`, in order, not overlapping,
/// every offset a multiple of 4 KiB (a LUN opened with `O_DIRECT` takes no other), every
/// length too but the last one's, which ends the device.
fn blank_probes(size: u64) -> Vec<(u64, usize)> {
    const TAIL: u64 = 4 << 20;
    const PIECE: u64 = 64 << 10;
    const ALIGN: u64 = 4096;
    let start = label::DATA_START;
    if size <= start {
        return Vec::new();
    }
    let tail = (size.saturating_sub(TAIL) / ALIGN * ALIGN).max(start);
    let between = tail - start;
    let mut probes = Vec::new();
    if between <= BLANK_SAMPLES * (PIECE + ALIGN) {
        // Small enough to read whole.
        if between > 0 {
            probes.push((start, between as usize));
        }
    } else {
        // Pieces further apart than they are long, even each rounded down to its alignment:
        // none overlaps the next or the tail.
        for i in 0..BLANK_SAMPLES {
            let at = (start + between * i / BLANK_SAMPLES) / ALIGN * ALIGN;
            probes.push((at, PIECE as usize));
        }
    }
    probes.push((tail, (size - tail) as usize));
    probes
}

/// How many pieces a blank check reads between the head and the tail ([`blank_probes`]).
const BLANK_SAMPLES: u64 = 64;

/// How many of a blank check's reads are in flight at once. One at a time, a LUN behind a
/// slow path took 66 round trips to add (2 minutes at 2 s a read).
const BLANK_READS_IN_FLIGHT: usize = 16;

/// The first non-zero byte a blank check finds past the head ([`blank_probes`]), if any:
/// the lowest such offset whichever read answers first.
async fn first_data_past_head(dev: &Arc<dyn Device>) -> std::io::Result<Option<u64>> {
    let mut probes = blank_probes(dev.size()).into_iter();
    let mut reads = tokio::task::JoinSet::new();
    let mut first: Option<u64> = None;
    loop {
        while reads.len() < BLANK_READS_IN_FLIGHT {
            let Some((at, len)) = probes.next() else {
                break;
            };
            let dev = dev.clone();
            reads.spawn(async move {
                let got = dev.read_at(at, len).await?;
                std::io::Result::Ok(got.iter().position(|b| *b != 0).map(|i| at + i as u64))
            });
        }
        let Some(done) = reads.join_next().await else {
            return Ok(first);
        };
        if let Some(at) = done.map_err(std::io::Error::other)?? {
            first = Some(first.map_or(at, |f| f.min(at)));
        }
    }
}

async fn format(dev: &dyn Device, l: &Label, t: &Table) -> std::io::Result<()> {
    let before = dev.losses();
    // Clear both table slots first so a stale table from an earlier life is never read back.
    for off in label::TABLE_SLOT_OFFSETS {
        dev.write_zeroes(off, label::TABLE_SLOT_LEN as u64, false)
            .await?;
    }
    let slot = Table::slot_of(t.generation);
    dev.write_at(label::TABLE_SLOT_OFFSETS[slot], table_bytes(t), false)
        .await?;
    crate::device::flush_since(dev, before).await?;
    // The label goes last: a device with a label always has a valid table.
    write_label(dev, l).await
}

/// Writes label `l`: its backup first, then the label itself, each flushed before the next
/// write. A write torn at any point leaves one of the two whole, and the other either whole
/// too or failing its checksum ([`decode_label`] then reads the backup).
async fn write_label(dev: &dyn Device, l: &Label) -> std::io::Result<()> {
    let before = dev.losses();
    let b = bytes::Bytes::from(l.encode());
    dev.write_at(label::LABEL_BACKUP_OFFSET, b.clone(), true)
        .await?;
    crate::device::flush_since(dev, before).await?;
    dev.write_at(0, b, true).await?;
    crate::device::flush_since(dev, before).await
}

/// The label at the start of `head` (the device's first [`label::DATA_START`] bytes), or its
/// backup when the label itself is a Vesta label whose checksum fails (a label write torn
/// between the two, [`write_label`]) and the backup is of the same LUN; with whether it was
/// the backup.
fn decode_label(
    head: &[u8],
    name: &str,
    target: &str,
) -> std::result::Result<(Label, bool), LabelError> {
    let primary = Label::decode(&head[..label::LABEL_LEN]);
    let Err(LabelError::BadChecksum) = primary else {
        return primary.map(|l| (l, false));
    };
    let o = label::LABEL_BACKUP_OFFSET as usize;
    match Label::decode(&head[o..o + label::LABEL_LEN]) {
        // A torn write keeps the first sector whole, and with it the LUN's id; a backup of
        // another id is left over from an earlier life of the device.
        Ok(backup) if backup.lun_id.as_bytes()[..] == head[16..32] => {
            warn!(
                "datastore {name:?}: the Vesta label on {target} fails its checksum (a write \
                 torn by a crash?); using its backup, and writing the label again"
            );
            Ok((backup, true))
        }
        _ => primary.map(|l| (l, false)),
    }
}

#[async_trait]
impl Datastore for LunDatastore {
    fn spec(&self) -> &DatastoreSpec {
        &self.spec
    }

    fn gate(&self) -> &Arc<Gate> {
        &self.gate
    }

    /// The gate and the device ask the LUN's own fence ([`LunDatastore::owner`]), which
    /// now waits on the host's too.
    fn set_fence(&self, fence: Arc<Fence>) {
        self.owner.set_parent(fence);
    }

    async fn capacity(&self) -> Result<Capacity> {
        if let Some(why) = self.gate.shut_out_reason() {
            return Err(Error::Invalid(why.to_owned()));
        }
        let t = self.table.lock().await;
        let size = self.label.device_size;
        let (free, largest) = t.free(size);
        Ok(Capacity {
            total_bytes: size.saturating_sub(label::DATA_START),
            free_bytes: free,
            largest_free_bytes: largest,
            unwritten_bytes: 0,
        })
    }

    async fn create_volume(&self, v: &VolumeSpec) -> Result<Extent> {
        // Noted before anything else: the caller holds the datastore's lock from before.
        let since = self.gate.fence_closes();
        let mut t = self.table.lock().await;
        self.refresh(&mut t).await?;
        if t.entries
            .iter()
            .any(|e| e.volume_id == v.id || e.name == v.name)
        {
            return Err(Error::Exists(format!(
                "datastore {:?} already holds a volume {:?}",
                self.spec.name, v.name
            )));
        }
        if t.entries.len() >= label::ENTRIES_MAX {
            return Err(Error::Invalid(format!(
                "datastore {:?} holds the most volumes one LUN can ({})",
                self.spec.name,
                label::ENTRIES_MAX
            )));
        }
        let Some(offset) = t.allocate(self.label.device_size, v.size) else {
            return Err(Error::NoSpace {
                datastore: self.spec.name.clone(),
                need: v.size,
                largest: t.free(self.label.device_size).1,
            });
        };
        let entry = Entry {
            volume_id: v.id,
            name: v.name.clone(),
            offset,
            len: v.size,
        };
        self.unfenced(since, &format!("zero new volume {:?}", v.name))?;
        // Losses before now took no write of this volume.
        let before = self.dev.losses();
        // A new volume reads as zeroes, not as whatever an earlier volume left there; and
        // durably so before the table names it (the table's FUA write covers only itself on
        // an NBD target, whose server may lose its cache).
        self.dev
            .write_zeroes(offset, v.size, true)
            .await
            .map_err(io_err(format!("zero new volume {:?}", v.name)))?;
        crate::device::flush_since(&*self.dev, before)
            .await
            .map_err(io_err(format!(
                "flush the zeroes of new volume {:?}",
                v.name
            )))?;
        let mut next = t.clone();
        next.generation += 1;
        next.entries.push(entry.clone());
        match self.commit_or_read_back(&mut t, &next, since).await {
            Commit::Landed => Ok(self.extent(&entry, v.size)),
            // If an unknown write did land, its entry blocks the name and holds the space
            // until the volume is created again under another name; it names no live data.
            Commit::NotLanded(e) | Commit::Unknown(e) => Err(e),
        }
    }

    async fn open_volume(&self, v: &VolumeSpec) -> Result<Extent> {
        let mut t = self.table.lock().await;
        // Always read again: another host may have created the volume since this one read
        // the table, or moved it (a relocation keeps its id) to another extent, where this
        // host's copy would send its writes into whatever volume took the old one.
        self.refresh(&mut t).await?;
        let e = t
            .entries
            .iter()
            .find(|e| e.volume_id == v.id)
            .ok_or_else(|| {
                Error::NotFound(format!(
                    "volume {:?} ({}) is not in the volume table of datastore {:?}",
                    v.name, v.id, self.spec.name
                ))
            })?;
        if e.len < v.size {
            return Err(Error::Invalid(format!(
                "volume {:?}: its extent on {:?} has {} bytes, fewer than the volume's {}",
                v.name, self.spec.name, e.len, v.size
            )));
        }
        Ok(self.extent(e, v.size))
    }

    async fn delete_volume(&self, v: &VolumeSpec) -> Result<()> {
        let since = self.gate.fence_closes();
        let mut t = self.table.lock().await;
        self.refresh(&mut t).await?;
        let Some(i) = t.entries.iter().position(|e| e.volume_id == v.id) else {
            return Ok(());
        };
        let mut next = t.clone();
        next.generation += 1;
        let gone = next.entries.remove(i);
        match self.commit_or_read_back(&mut t, &next, since).await {
            Commit::Landed => {}
            Commit::NotLanded(e) => return Err(e),
            Commit::Unknown(e) => {
                // Deleted as far as the caller knows: a volume served again could be writing
                // an extent the next create takes. At worst its entry stays in the table,
                // holding the space.
                warn!(
                    "datastore {:?}: volume {:?} counts as deleted, though the outcome of the \
                     table write that deletes it is unknown ({e}); if it did not land, the \
                     volume's extent stays allocated under its name",
                    self.spec.name, gone.name
                );
                return Ok(());
            }
        }
        // Give the space back to a thin backend; a hint, so failure only costs space.
        let trimmed = match self.unfenced(since, "trim a deleted volume") {
            Ok(()) => self.dev.trim(gone.offset, gone.len).await,
            Err(e) => Err(std::io::Error::other(e.to_string())),
        };
        if let Err(e) = trimmed {
            warn!(
                "datastore {:?}: trim of deleted volume {:?} failed: {e}",
                self.spec.name, gone.name
            );
        }
        Ok(())
    }

    async fn recorded_volumes(&self) -> Result<Vec<VolumeSpec>> {
        let mut t = self.table.lock().await;
        self.refresh(&mut t).await?;
        Ok(t.entries
            .iter()
            .map(|e| VolumeSpec {
                id: e.volume_id,
                name: e.name.clone(),
                size: e.len,
            })
            .collect())
    }
}

/// What became of a table write ([`LunDatastore::commit_or_read_back`]).
enum Commit {
    Landed,
    /// It answered this error and the device still holds the table before it.
    NotLanded(Error),
    /// It answered this error and the device could not be read to tell, or it went
    /// unanswered and may still land ([`crate::unanswered`]).
    Unknown(Error),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Class;

    fn spec(target: &std::path::Path) -> DatastoreSpec {
        DatastoreSpec {
            name: "san".into(),
            kind: Kind::Lun {
                target: target.display().to_string(),
                lun_id: None,
            },
            class: Class::Hdd,
            queue_depth: 4,
            direct: false,
        }
    }

    /// A device that records the order of its writes, zeroings and flushes, and on demand
    /// answers an error for a write it did ([`Watched::landed_but_failed`]: a sync that
    /// failed after the write, a reply lost with its connection) or fails reads.
    struct Watched {
        inner: crate::device::MemDevice,
        ops: std::sync::Mutex<Vec<String>>,
        /// The next write lands, then answers an error.
        landed_but_failed: std::sync::atomic::AtomicBool,
        lost: std::sync::atomic::AtomicBool,
        /// Set by a write that landed but failed while `then_unreadable` is.
        reads_fail: std::sync::atomic::AtomicBool,
        then_unreadable: std::sync::atomic::AtomicBool,
        /// Run during each zeroing (a request stalled while the world moves on).
        during_zeroing: std::sync::Mutex<Option<Box<dyn Fn() + Send>>>,
        /// The next write goes unanswered (the connection lost with it in flight) and is
        /// kept in `late`, to land when the test says (a server that went on running it).
        unanswered: std::sync::atomic::AtomicBool,
        /// Unanswered writes land by themselves this long after they were sent, before the
        /// next read that comes later (None: only when the test says).
        land_after: std::sync::Mutex<Option<std::time::Duration>>,
        late: std::sync::Mutex<Vec<(Option<std::time::Instant>, u64, bytes::Bytes)>>,
        /// The next write's sync fails after the write reached only the host's page cache
        /// (`cached`): reads see it, the device does not hold it, and nothing writes it back.
        sync_fails: std::sync::atomic::AtomicBool,
        cached: std::sync::Mutex<Vec<(u64, bytes::Bytes)>>,
    }

    impl Watched {
        /// The host loses power: what only its page cache held is gone.
        fn power_cut(&self) {
            self.cached.lock().unwrap().clear();
        }

        /// The writes that went unanswered land now.
        async fn land_late(&self) {
            let late = std::mem::take(&mut *self.late.lock().unwrap());
            for (_, offset, data) in late {
                self.inner.write_at(offset, data, true).await.unwrap();
            }
        }

        /// The unanswered writes whose time has come land now.
        async fn land_due(&self) {
            let now = std::time::Instant::now();
            let due: Vec<_> = {
                let mut late = self.late.lock().unwrap();
                let (due, wait) = std::mem::take(&mut *late)
                    .into_iter()
                    .partition(|(at, _, _)| at.is_some_and(|at| at <= now));
                *late = wait;
                due
            };
            for (_, offset, data) in due {
                self.inner.write_at(offset, data, true).await.unwrap();
            }
        }
    }

    fn io_error() -> std::io::Error {
        std::io::Error::from_raw_os_error(libc::EIO)
    }

    #[async_trait]
    impl Device for Watched {
        fn size(&self) -> u64 {
            self.inner.size()
        }
        fn describe(&self) -> String {
            "watched".into()
        }
        async fn read_at(&self, offset: u64, len: usize) -> std::io::Result<bytes::Bytes> {
            if self.reads_fail.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(io_error());
            }
            self.land_due().await;
            let got = self.inner.read_at(offset, len).await?;
            let mut got = bytes::BytesMut::from(&got[..]);
            for (at, data) in self.cached.lock().unwrap().iter() {
                let (from, to) = (
                    (*at).max(offset),
                    (at + data.len() as u64).min(offset + len as u64),
                );
                if from < to {
                    got[(from - offset) as usize..(to - offset) as usize]
                        .copy_from_slice(&data[(from - at) as usize..(to - at) as usize]);
                }
            }
            Ok(got.freeze())
        }
        async fn write_at(
            &self,
            offset: u64,
            data: bytes::Bytes,
            fua: bool,
        ) -> std::io::Result<()> {
            self.ops
                .lock()
                .unwrap()
                .push(format!("write {offset} fua={fua}"));
            use std::sync::atomic::Ordering::SeqCst;
            if self.lost.load(SeqCst) {
                return Err(io_error());
            }
            if self.unanswered.swap(false, SeqCst) {
                let at = self
                    .land_after
                    .lock()
                    .unwrap()
                    .map(|d| std::time::Instant::now() + d);
                self.late.lock().unwrap().push((at, offset, data));
                return Err(std::io::Error::new(
                    std::io::ErrorKind::ConnectionAborted,
                    "no reply to WRITE within 60s",
                ));
            }
            if self.sync_fails.swap(false, SeqCst) {
                self.cached.lock().unwrap().push((offset, data));
                return Err(io_error());
            }
            self.cached.lock().unwrap().retain(|(at, d)| {
                offset + data.len() as u64 <= *at || at + d.len() as u64 <= offset
            });
            self.inner.write_at(offset, data, fua).await?;
            if self.landed_but_failed.swap(false, SeqCst) {
                if self.then_unreadable.load(SeqCst) {
                    self.reads_fail.store(true, SeqCst);
                }
                return Err(io_error());
            }
            Ok(())
        }
        async fn flush(&self) -> std::io::Result<()> {
            self.ops.lock().unwrap().push("flush".into());
            self.inner.flush().await
        }
        async fn trim(&self, offset: u64, len: u64) -> std::io::Result<()> {
            self.inner.trim(offset, len).await
        }
        async fn write_zeroes(&self, offset: u64, len: u64, may_trim: bool) -> std::io::Result<()> {
            self.ops.lock().unwrap().push(format!("zero {offset}"));
            if let Some(f) = self.during_zeroing.lock().unwrap().as_ref() {
                f();
            }
            self.inner.write_zeroes(offset, len, may_trim).await
        }
    }

    /// A LUN formatted on a [`Watched`] memory device.
    async fn watched_lun() -> (Arc<Watched>, LunDatastore) {
        let dev = Arc::new(Watched {
            inner: crate::device::MemDevice::new(64 << 20),
            ops: Default::default(),
            landed_but_failed: Default::default(),
            lost: Default::default(),
            reads_fail: Default::default(),
            then_unreadable: Default::default(),
            during_zeroing: Default::default(),
            unanswered: Default::default(),
            land_after: Default::default(),
            late: Default::default(),
            sync_fails: Default::default(),
            cached: Default::default(),
        });
        let lun = LunDatastore::open_on(
            dev.clone(),
            spec(std::path::Path::new("watched")),
            OpenMode::Add {
                force: false,
                take_over: None,
            },
            None,
        )
        .await
        .unwrap();
        (dev, lun)
    }

    /// A host still running in the pod a LUN was taken from does no IO to it, reads
    /// included, by the time the take-over returns, though it goes on holding the LUN open
    /// with a volume on it: it checks the label on its own. A label it only cannot read
    /// stops its writes for as long (nothing confirms the LUN its pod's) and shuts nothing.
    #[tokio::test]
    async fn a_pod_whose_lun_was_taken_over_does_no_more_io_to_it() {
        let (dev, _) = watched_lun().await;
        let (ours, theirs) = (Uuid::new_v4(), Uuid::new_v4());
        let open = |mode, pod| {
            let dev: Arc<dyn Device> = dev.clone();
            LunDatastore::open_on(dev, spec(Path::new("watched")), mode, Some(pod))
        };
        let a = open(OpenMode::Reopen, ours).await.unwrap();
        let v = volume("v");
        let e = a.create_volume(&v).await.unwrap();
        let data = |b: u8| bytes::Bytes::from(vec![b; 4096]);
        e.write(0, data(0x17), false).await.unwrap();

        use std::sync::atomic::Ordering::SeqCst;
        dev.reads_fail.store(true, SeqCst);
        tokio::time::sleep(OWNER_VALID + OWNER_CHECK_EVERY).await;
        let fenced = e.write(4096, data(0x18), false).await.unwrap_err();
        assert!(fenced.to_string().contains("label"), "{fenced}");
        dev.reads_fail.store(false, SeqCst);
        tokio::time::sleep(2 * OWNER_CHECK_EVERY).await;
        assert!(a.gate.shut_out_reason().is_none());
        e.write(4096, data(0x18), false).await.unwrap();
        e.flush().await.unwrap();

        let started = std::time::Instant::now();
        let take_over = OpenMode::Add {
            force: false,
            take_over: Some(ours),
        };
        let b = open(take_over, theirs).await.unwrap();
        assert!(started.elapsed() >= TAKE_OVER_WAIT);
        let refused = [
            e.write(0, data(0x99), false).await,
            e.write_zeroes(0, 4096, false).await,
            e.trim(0, 4096).await,
            e.read(0, 4096).await.map(drop),
            e.flush().await,
        ];
        for r in refused {
            let r = r.expect_err("an IO went to a LUN taken over").to_string();
            assert!(r.contains("now belongs to another Vesta pod"), "{r}");
        }
        let why = a
            .capacity()
            .await
            .map(drop)
            .expect_err("capacity")
            .to_string();
        assert!(why.contains("now belongs to another Vesta pod"), "{why}");
        // Nothing of it landed, and the pod that took the LUN over writes it at once.
        let mut want = vec![0x17; 4096];
        want.extend_from_slice(&[0x18; 4096]);
        let eb = b.open_volume(&v).await.unwrap();
        assert_eq!(eb.read(0, 8192).await.unwrap()[..], want[..]);
        eb.write(8192, data(0x19), false).await.unwrap();
        // For good: the label naming this pod again (taken back) opens nothing until a
        // new open reads it.
        let back = OpenMode::Add {
            force: false,
            take_over: Some(theirs),
        };
        open(back, ours).await.unwrap();
        assert!(e.read(0, 4096).await.is_err());
    }

    fn volume(name: &str) -> VolumeSpec {
        VolumeSpec {
            id: Uuid::new_v4(),
            name: name.into(),
            size: 4 << 20,
        }
    }

    /// A new volume's zeroes are flushed before the table that names it is written: over
    /// NBD, the table's FUA covers only the table, and a server that loses its cache would
    /// leave the new volume reading an old one's data.
    #[tokio::test]
    async fn a_new_volumes_zeroes_are_durable_before_the_table_names_it() {
        let (dev, lun) = watched_lun().await;
        dev.ops.lock().unwrap().clear();
        let v = volume("v");
        lun.create_volume(&v).await.unwrap();
        let ops = dev.ops.lock().unwrap().clone();
        let zero = ops
            .iter()
            .position(|o| o.starts_with("zero"))
            .expect("zeroed");
        let table = ops
            .iter()
            .rposition(|o| o.starts_with("write"))
            .expect("the table written");
        assert!(
            ops[zero..table].iter().any(|o| o == "flush"),
            "no flush between the zeroing and the table write: {ops:?}"
        );
    }

    /// Past the host's fence the volume table is not written: another host may hold the
    /// datastore's lock by then.
    #[tokio::test]
    async fn a_fenced_host_does_not_write_the_volume_table() {
        let (dev, lun) = watched_lun().await;
        lun.set_fence(Arc::new(crate::fence::Fence::closed()));
        dev.ops.lock().unwrap().clear();
        let v = volume("v");
        let Err(e) = lun.create_volume(&v).await else {
            panic!("a fenced host created a volume");
        };
        assert!(format!("{e:?}").contains("fenced"), "{e:?}");
        let ops = dev.ops.lock().unwrap().clone();
        assert!(ops.is_empty(), "a fenced host wrote the LUN: {ops:?}");
        assert!(lun.recorded_volumes().await.unwrap().is_empty());
    }

    /// A table change begun under one lease does not finish under the next: the host's lease
    /// is lost and it registers again (a new lease opens the fence again) while the new
    /// volume's zeroing is stalled. The metadata lock the change held was bound to the old
    /// lease, so another host may have changed the table meanwhile; the change must fail,
    /// not write its table over the other host's.
    #[tokio::test]
    async fn a_table_change_does_not_outlive_the_lease_it_began_under() {
        use std::time::{Duration, Instant};
        let (dev, lun) = watched_lun().await;
        let fence = Arc::new(crate::fence::Fence::closed());
        fence.extend_to(Instant::now() + Duration::from_secs(60));
        lun.set_fence(fence.clone());
        let f = fence.clone();
        *dev.during_zeroing.lock().unwrap() = Some(Box::new(move || {
            f.close();
            f.extend_to(Instant::now() + Duration::from_secs(60));
        }));
        let Err(e) = lun.create_volume(&volume("v")).await else {
            panic!("a table change went on under a new lease");
        };
        assert!(format!("{e:?}").contains("fenced"), "{e:?}");
        *dev.during_zeroing.lock().unwrap() = None;
        assert!(lun.recorded_volumes().await.unwrap().is_empty());
        // Begun under the new lease, it goes through.
        lun.create_volume(&volume("w")).await.unwrap();
    }

    /// The places a blank check reads lie within the device, in order and apart, always
    /// include its last 4 MiB (or all of it past the head), and are few.
    #[test]
    fn a_blank_check_reads_the_tail_and_a_sample_of_the_rest() {
        let mb = 1u64 << 20;
        for size in (0..64).map(|i| i * mb / 2).chain([
            4 * mb + 512,
            12 * mb - 512,
            1 << 30,
            (1 << 40) + 4096,
            // Sizes whose sixty-fourths are not sector multiples: 100 GB and 1 TB (decimal).
            100_000_000_000,
            1_000_000_000_000,
            100_000_000_512,
        ]) {
            let probes = blank_probes(size);
            if size <= label::DATA_START {
                assert!(probes.is_empty(), "{size}");
                continue;
            }
            let mut end = label::DATA_START;
            for (i, &(at, len)) in probes.iter().enumerate() {
                assert!(at >= end && len > 0, "{size}: {probes:?}");
                assert_eq!(at % 4096, 0, "{size}: {probes:?}");
                if i + 1 < probes.len() {
                    assert_eq!(len % 4096, 0, "{size}: {probes:?}");
                }
                end = at + len as u64;
            }
            assert_eq!(end, size, "{size}: the tail is not read");
            let (last, len) = *probes.last().unwrap();
            assert!(
                len as u64 >= (4 * mb).min(size - label::DATA_START) && last + len as u64 == size,
                "{size}: {probes:?}"
            );
            let read: u64 = probes.iter().map(|&(_, l)| l as u64).sum();
            assert!(read <= 8 * mb + (1 << 20), "{size}: reads {read} bytes");
            assert!(probes.len() as u64 <= BLANK_SAMPLES + 1);
        }
    }

    /// The blank check's reads run side by side; the refusal still names the lowest offset
    /// holding data, whichever read answered first.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_blank_check_names_the_lowest_offset_holding_data() {
        let dir = std::env::temp_dir().join(format!("vesta-lun-lowest-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let img = dir.join("lun.img");
        let size = 256u64 << 20;
        let f = std::fs::File::create(&img).unwrap();
        f.set_len(size).unwrap();
        let probes = blank_probes(size);
        let low = probes[3].0 + 7;
        for at in [size - 512, probes[40].0, probes[20].0 + 9, low] {
            std::os::unix::fs::FileExt::write_all_at(&f, b"x", at).unwrap();
        }
        let dev: Arc<dyn Device> = Arc::new(FileDevice::open(&img).unwrap());
        for _ in 0..20 {
            assert_eq!(first_data_past_head(&dev).await.unwrap(), Some(low));
        }
        std::fs::File::create(&img).unwrap().set_len(size).unwrap();
        assert_eq!(first_data_past_head(&dev).await.unwrap(), None);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A LUN whose first 4 MiB are zeroes but which holds data further on (a GPT's backup
    /// header in its last sector, data in the middle) is not taken for blank: formatting it
    /// would destroy that data. Before, only the first 4 MiB were read.
    #[tokio::test]
    async fn data_past_the_head_of_a_lun_is_not_formatted_without_force() {
        let dir = std::env::temp_dir().join(format!("vesta-lun-blank-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let img = dir.join("lun.img");
        let size = 256u64 << 20;
        let add = |force| OpenMode::Add {
            force,
            take_over: None,
        };
        let middle = blank_probes(size)[BLANK_SAMPLES as usize / 2].0 + 100;
        for (at, what) in [(size - 512, &b"EFI PART"[..]), (middle, &b"data"[..])] {
            let _ = std::fs::remove_file(&img);
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&img)
                .unwrap();
            f.set_len(size).unwrap();
            std::os::unix::fs::FileExt::write_all_at(&f, what, at).unwrap();
            let e = LunDatastore::open(spec(&img), add(false), None)
                .await
                .err()
                .expect("a LUN with data on it was formatted")
                .to_string();
            assert!(
                e.contains(&format!("offset {at}")) && e.contains("--force"),
                "{e}"
            );
            let mut kept = vec![0; what.len()];
            std::os::unix::fs::FileExt::read_exact_at(&f, &mut kept, at).unwrap();
            assert_eq!(kept, what, "the refused add wrote over the data");
            LunDatastore::open(spec(&img), add(true), None)
                .await
                .expect("--force formats it");
        }
        // A blank one is formatted without --force.
        let _ = std::fs::remove_file(&img);
        std::fs::File::create(&img).unwrap().set_len(size).unwrap();
        LunDatastore::open(spec(&img), add(false), None)
            .await
            .unwrap();
        // So is a blank 100 GB (decimal) one opened with O_DIRECT, which takes only aligned
        // reads: its sample pieces are spread over a length whose sixty-fourths are not
        // sector multiples.
        let _ = std::fs::remove_file(&img);
        std::fs::File::create(&img)
            .unwrap()
            .set_len(100_000_000_000)
            .unwrap();
        let direct = DatastoreSpec {
            direct: true,
            ..spec(&img)
        };
        LunDatastore::open(direct, add(false), None)
            .await
            .expect("a blank LUN opened with O_DIRECT");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A LUN carries the pod that formatted it: another pod is refused when it adds it, and
    /// takes it over only with `take_over` naming the first pod (not `force`), after which
    /// the first pod can neither change its table, though it has it open, nor open it again,
    /// even when the take-over's label write was torn. A LUN formatted before labels named
    /// pods becomes the first pod's that opens it.
    #[tokio::test]
    async fn a_lun_of_another_pod_is_refused_unless_taken_over() {
        let dir = std::env::temp_dir().join(format!("vesta-lun-pod-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let img = dir.join("lun.img");
        std::fs::File::create(&img)
            .unwrap()
            .set_len(64 << 20)
            .unwrap();
        let (ours, theirs) = (Some(Uuid::new_v4()), Some(Uuid::new_v4()));
        let add = |force, take_over| OpenMode::Add { force, take_over };
        let write_at = |at: u64, b: &[u8]| {
            use std::io::{Seek, SeekFrom, Write};
            let mut f = std::fs::OpenOptions::new().write(true).open(&img).unwrap();
            f.seek(SeekFrom::Start(at)).unwrap();
            f.write_all(b).unwrap();
        };
        let a = LunDatastore::open(spec(&img), add(false, None), ours)
            .await
            .unwrap();
        a.create_volume(&volume("v")).await.unwrap();
        LunDatastore::open(spec(&img), OpenMode::Reopen, ours)
            .await
            .unwrap();
        for force in [false, true] {
            let refused = LunDatastore::open(spec(&img), add(force, None), theirs).await;
            let e = refused
                .err()
                .expect("another pod's LUN was adopted")
                .to_string();
            assert!(
                e.contains("another pod") && e.contains("1 volume(s)"),
                "{e}"
            );
        }
        assert!(LunDatastore::open(spec(&img), OpenMode::Reopen, theirs)
            .await
            .is_err());
        // Taking over from a pod the label does not name is refused.
        assert!(
            LunDatastore::open(spec(&img), add(false, Some(Uuid::new_v4())), theirs)
                .await
                .is_err()
        );
        // Taken over: the volumes come along, and the first pod is shut out, though `a`
        // still has the LUN open.
        let b = LunDatastore::open(spec(&img), add(false, ours), theirs)
            .await
            .unwrap();
        assert_eq!(b.recorded_volumes().await.unwrap().len(), 1);
        let e = a
            .create_volume(&volume("w"))
            .await
            .err()
            .expect("the pod it was taken from changed the table")
            .to_string();
        assert!(e.contains("now belongs to another Vesta pod"), "{e}");
        let e = LunDatastore::open(spec(&img), OpenMode::Reopen, ours)
            .await
            .err()
            .expect("the pod it was taken from still opens it")
            .to_string();
        assert!(e.contains("now belongs to another Vesta pod"), "{e}");
        // A take-over torn in the label: its backup, written first, is read instead, by the
        // pod shut out as by the one that took over, whose next open writes the label again.
        write_at(100, &[0xee; 16]);
        let dev = FileDevice::open(&img).unwrap();
        let seen = owner_of(&dev, ours.unwrap(), a.lun_id(), "san").await;
        assert!(
            matches!(&seen, Ok(Owner::Other(why)) if why.contains("another Vesta pod")),
            "a host of the pod it was taken from took the torn label for its own"
        );
        let again = LunDatastore::open(spec(&img), OpenMode::Reopen, theirs)
            .await
            .unwrap();
        assert_eq!(again.recorded_volumes().await.unwrap().len(), 1);
        let head = std::fs::read(&img).unwrap();
        let l = Label::decode(&head[..label::LABEL_LEN]).expect("the label was not repaired");
        assert_eq!(l.pod, theirs);
        // A label overwritten at the start (not torn: no magic left) whose backup and table
        // survive is not formatted, --force or not.
        write_at(0, &[0u8; label::LABEL_LEN]);
        // Whose it is cannot be told now: the pod that has it open changes nothing.
        let e = again
            .create_volume(&volume("z"))
            .await
            .err()
            .expect("changed")
            .to_string();
        assert!(e.contains("can no longer be read"), "{e}");
        let e = LunDatastore::open(spec(&img), add(true, None), theirs)
            .await
            .err()
            .expect("formatted over a backup label and its volumes")
            .to_string();
        assert!(e.contains("1 volume(s)") && e.contains("3 MiB"), "{e}");
        assert_eq!(
            std::fs::read(&img).unwrap()[label::DATA_START as usize..],
            head[label::DATA_START as usize..]
        );
        // A label without a pod (an older format) becomes the first opener's.
        std::fs::File::create(&img)
            .unwrap()
            .set_len(64 << 20)
            .unwrap();
        LunDatastore::open(spec(&img), add(false, None), None)
            .await
            .unwrap();
        LunDatastore::open(spec(&img), OpenMode::Reopen, ours)
            .await
            .unwrap();
        assert!(LunDatastore::open(spec(&img), add(false, None), theirs)
            .await
            .is_err());
        // With no volume in its table, a LUN whose label was overwritten is formatted with
        // --force: there is nothing to lose.
        write_at(0, &[0u8; label::LABEL_LEN]);
        assert!(LunDatastore::open(spec(&img), add(false, None), ours)
            .await
            .is_err());
        LunDatastore::open(spec(&img), add(true, None), ours)
            .await
            .unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Two hosts on one LUN: host B opened volume V once. Host A then moves V away, gives
    /// its extent to W, and moves V back elsewhere (a relocation keeps the id). B, opening V
    /// again (a peer replaying it), must get V's new extent, not write into W.
    #[tokio::test]
    async fn a_volume_moved_by_another_host_opens_at_its_new_extent() {
        // Through the page cache and with O_DIRECT (label, tables, zeroing and volume IO
        // all aligned as it needs), on the disk the repository is on (tmpfs is memory).
        for direct in [false, true] {
            a_volume_moved_by_another_host_opens_at_its_new_extent_with(direct).await;
        }
    }

    async fn a_volume_moved_by_another_host_opens_at_its_new_extent_with(direct: bool) {
        let dir = crate::fileio::on_disk("lun");
        let img = dir.join("lun.img");
        let f = std::fs::File::create(&img).unwrap();
        f.set_len(64 << 20).unwrap();
        let add = OpenMode::Add {
            force: false,
            take_over: None,
        };
        let spec = |img: &Path| DatastoreSpec {
            direct,
            ..spec(img)
        };
        let a = LunDatastore::open(spec(&img), add, None).await.unwrap();
        let mut recorded = spec(&img);
        recorded.kind = Kind::Lun {
            target: img.display().to_string(),
            lun_id: Some(a.lun_id()),
        };
        let b = LunDatastore::open(recorded, OpenMode::Reopen, None)
            .await
            .unwrap();
        let v = volume("v");
        let w = volume("w");
        a.create_volume(&v).await.unwrap();
        b.open_volume(&v).await.unwrap();
        a.delete_volume(&v).await.unwrap();
        let on_w = a.create_volume(&w).await.unwrap();
        a.create_volume(&v).await.unwrap();
        let on_v = b.open_volume(&v).await.unwrap();
        on_v.write(0, bytes::Bytes::from(vec![7u8; 4096]), true)
            .await
            .unwrap();
        let w_reads = on_w.read(0, 4096).await.unwrap();
        assert_eq!(on_v.read(0, 4096).await.unwrap()[..], [7u8; 4096]);
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            w_reads.iter().all(|b| *b == 0),
            "host B wrote V's data into W, which took V's old extent"
        );
    }

    fn names(t: &[VolumeSpec]) -> Vec<String> {
        let mut n: Vec<String> = t.iter().map(|v| v.name.clone()).collect();
        n.sort();
        n
    }

    /// A delete whose table write answered an error after landing is done: the table no
    /// longer names the volume, so the caller must not serve it again (the next create
    /// takes its extent). One whose write did not land failed, and the volume is still
    /// there; one whose outcome cannot be read back counts as done (at worst a leak).
    #[tokio::test]
    async fn a_delete_counts_as_done_exactly_when_its_table_write_landed() {
        use std::sync::atomic::Ordering::SeqCst;
        let (dev, lun) = watched_lun().await;
        let (v, w, x) = (volume("v"), volume("w"), volume("x"));
        for vol in [&v, &w, &x] {
            lun.create_volume(vol).await.unwrap();
        }
        dev.lost.store(true, SeqCst);
        assert!(
            lun.delete_volume(&v).await.is_err(),
            "a lost table write deleted v"
        );
        dev.lost.store(false, SeqCst);
        assert_eq!(
            names(&lun.recorded_volumes().await.unwrap()),
            ["v", "w", "x"]
        );

        dev.landed_but_failed.store(true, SeqCst);
        lun.delete_volume(&v)
            .await
            .expect("a delete whose table write landed reported a failure");
        dev.landed_but_failed.store(false, SeqCst);
        assert_eq!(names(&lun.recorded_volumes().await.unwrap()), ["w", "x"]);

        dev.landed_but_failed.store(true, SeqCst);
        dev.then_unreadable.store(true, SeqCst);
        lun.delete_volume(&w)
            .await
            .expect("a delete whose outcome is unknown reported a failure");
        assert!(dev.reads_fail.load(SeqCst), "the table was never read back");
        dev.landed_but_failed.store(false, SeqCst);
        dev.then_unreadable.store(false, SeqCst);
        dev.reads_fail.store(false, SeqCst);
        assert_eq!(names(&lun.recorded_volumes().await.unwrap()), ["x"]);
    }

    /// A delete whose table write went unanswered counts as done even though the device
    /// still holds the old table when read back: the write may land later (an NBD server
    /// that went on running it after the connection was given up), and a volume served
    /// again would then be writing an extent the table had given back.
    #[tokio::test]
    async fn a_delete_whose_table_write_went_unanswered_counts_as_done() {
        use std::sync::atomic::Ordering::SeqCst;
        let (dev, lun) = watched_lun().await;
        let (v, w) = (volume("v"), volume("w"));
        for vol in [&v, &w] {
            lun.create_volume(vol).await.unwrap();
        }
        dev.unanswered.store(true, SeqCst);
        lun.delete_volume(&v)
            .await
            .expect("a delete whose table write may still land reported a failure");
        dev.unanswered.store(false, SeqCst);
        // Read back now, the table still names v; once the write lands it does not.
        assert_eq!(names(&lun.recorded_volumes().await.unwrap()), ["v", "w"]);
        dev.land_late().await;
        assert_eq!(names(&lun.recorded_volumes().await.unwrap()), ["w"]);
    }

    /// A table write that goes unanswered and lands soon after (the server ran it after the
    /// connection was given up) is found landed: the create succeeds, and the next change
    /// goes to the other slot, where the late write cannot undo it.
    #[tokio::test]
    async fn a_table_write_that_lands_soon_after_going_unanswered_counts_as_landed() {
        use std::sync::atomic::Ordering::SeqCst;
        let (dev, lun) = watched_lun().await;
        *dev.land_after.lock().unwrap() = Some(std::time::Duration::from_millis(50));
        dev.unanswered.store(true, SeqCst);
        let v = lun.create_volume(&volume("v")).await;
        dev.unanswered.store(false, SeqCst);
        v.expect("a create whose table write landed late failed");
        lun.create_volume(&volume("w")).await.unwrap();
        dev.land_late().await;
        assert_eq!(names(&lun.recorded_volumes().await.unwrap()), ["v", "w"]);
    }

    /// A table write whose sync failed may be only in the host's page cache: reading it
    /// back finds it, but the device holds the table before. Counted as landed on that read
    /// alone, a create returned an extent the table on the device did not name, and a
    /// delete trimmed a volume the device's table still listed; after a power cut the
    /// created volume was gone. It is written again, and durable, before it counts.
    #[tokio::test]
    async fn a_table_write_found_only_in_the_page_cache_is_made_durable_before_it_counts() {
        use std::sync::atomic::Ordering::SeqCst;
        let (dev, lun) = watched_lun().await;
        let (v, w) = (volume("v"), volume("w"));
        lun.create_volume(&v).await.unwrap();
        dev.sync_fails.store(true, SeqCst);
        lun.create_volume(&w)
            .await
            .expect("a create whose table write could be made durable failed");
        dev.sync_fails.store(true, SeqCst);
        lun.delete_volume(&v).await.unwrap();
        dev.power_cut();
        let reopened = LunDatastore::open_on(
            dev.clone(),
            spec(std::path::Path::new("watched")),
            OpenMode::Reopen,
            None,
        )
        .await
        .unwrap();
        assert_eq!(
            names(&reopened.recorded_volumes().await.unwrap()),
            ["w"],
            "the table on the device after a power cut"
        );
    }

    /// A create whose table write answered an error after landing returns the volume's
    /// extent, which the table now names; one whose write did not land fails and leaves
    /// nothing.
    #[tokio::test]
    async fn a_create_succeeds_exactly_when_its_table_write_landed() {
        use std::sync::atomic::Ordering::SeqCst;
        let (dev, lun) = watched_lun().await;
        dev.lost.store(true, SeqCst);
        assert!(lun.create_volume(&volume("v")).await.is_err());
        dev.lost.store(false, SeqCst);
        assert!(lun.recorded_volumes().await.unwrap().is_empty());

        dev.landed_but_failed.store(true, SeqCst);
        let w = volume("w");
        let extent = lun.create_volume(&w).await;
        dev.landed_but_failed.store(false, SeqCst);
        let extent = extent.expect("a create whose table write landed failed");
        assert_eq!(names(&lun.recorded_volumes().await.unwrap()), ["w"]);
        assert_eq!(extent.size(), w.size);
    }
}
