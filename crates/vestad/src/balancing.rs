//! Balancing in the daemon (BASIL, DESIGN §8): the sampler's history made into the pure
//! `balance` crate's models, the pod they describe, migration plans, initial placement, and
//! the workload-model constants `vesta calibrate` stores.
//!
//! - A volume's load `L` comes from the 90th percentiles of its intervals with IO; a volume
//!   that has done no IO in the history has `L = 0`.
//! - A datastore's `P` comes from its ⟨outstanding reads, read latency⟩ intervals that pass
//!   the paper's filters, as every host that uses it saw them together (summed through the
//!   coordinator: `crate::stats`).
//! - In a cluster the pod holds every host's volumes: this host's with their models from its
//!   own history, the others' with the models their hosts publish (`stats::VolumesDoc`). A
//!   plan may move any of them; a move is carried out on the host that serves the volume.
//! - The pod holds the datastores that are `ok`; no plan is made while one is not (nothing
//!   moves while a datastore is degraded).

use std::path::PathBuf;

use balance::{workload, Constants, Pod, RecentMove};
use vesta_api as api;

use std::sync::Arc;

use crate::daemon::{Daemon, OpError, OpResult, VolumeEntry};
use crate::stats::{PublishedVolume, VolumesDoc};
use cluster::StatsDoc;

const GIB: f64 = (1u64 << 30) as f64;

/// Where the calibrated constants are kept, inside the data directory.
pub const CALIBRATION_FILE: &str = "calibration.json";

/// Everything the planner and placement need, and the report `vesta stats --models` prints.
pub struct Inputs {
    pub pod: Pod,
    pub report: api::ModelsReport,
    pub notes: Vec<String>,
    /// Datastores left out of the pod, with why.
    pub unavailable: Vec<(String, String)>,
    /// Volumes whose host is down, with that host: their load is not known.
    pub hosts_down: Vec<(String, String)>,
    /// Why the host list could not be read, if it could not: then nobody knows which hosts
    /// are down.
    pub unknown_hosts: Option<String>,
}

fn calibration_path(d: &Daemon) -> PathBuf {
    d.config.data_dir.join(CALIBRATION_FILE)
}

/// The stored calibration, if any. A file that does not parse is reported and ignored.
pub fn calibration(d: &Daemon) -> Option<api::Calibration> {
    let path = calibration_path(d);
    let text = std::fs::read_to_string(&path).ok()?;
    match serde_json::from_str(&text) {
        Ok(c) => Some(c),
        Err(e) => {
            tracing::warn!(
                "{} does not parse ({e}); using the default workload constants",
                path.display()
            );
            None
        }
    }
}

/// Stores constants from a calibration, replacing the file atomically.
pub fn store_calibration(d: &Daemon, c: &api::Calibration) -> OpResult<()> {
    let k = &c.constants;
    let sane = [k.k1, k.k2, k.k3, k.k4]
        .iter()
        .all(|v| v.is_finite() && *v >= 0.0);
    if !sane {
        return Err(OpError::BadRequest(format!(
            "constants {k:?} are not finite non-negative numbers; nothing was stored"
        )));
    }
    let path = calibration_path(d);
    let body = serde_json::to_vec_pretty(c).map_err(|e| OpError::Internal(e.to_string()))?;
    // Two stores at once would share the temporary file.
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    cluster::local::replace_atomically(&path, &body)
        .map_err(|e| OpError::Internal(format!("cannot write {}: {e}", path.display())))
}

/// The constants in use and where they come from.
pub fn constants(d: &Daemon) -> (Constants, String) {
    match calibration(d) {
        Some(c) => (
            c.constants,
            format!(
                "calibrated on datastore {} ({} experiments, median error {:.0} %)",
                c.datastore,
                c.experiments,
                100.0 * c.median_relative_error
            ),
        ),
        None => (Constants::DEFAULT, "defaults".to_string()),
    }
}

fn median(v: Vec<f64>) -> f64 {
    balance::stats::median(&v).unwrap_or(0.0)
}

/// The workload models of the volumes this host serves, from its own history.
pub fn own_volumes(d: &Daemon) -> Vec<PublishedVolume> {
    volume_models(d, &d.entries())
}

/// The workload models of `entries`, in their order.
fn volume_models(d: &Daemon, entries: &[Arc<VolumeEntry>]) -> Vec<PublishedVolume> {
    let sampler = d.sampler.lock().expect("lock");
    entries
        .iter()
        .map(|e| {
            let hist = sampler.volume_history(&e.record.name);
            let chars: Vec<_> = hist.iter().map(|s| s.chars).collect();
            PublishedVolume {
                name: e.record.name.clone(),
                datastore: e.record.datastore.clone(),
                size: e.record.size,
                samples: hist.len(),
                p90: workload::characterize(&chars),
                iops: median(hist.iter().map(|s| s.iops).collect()),
            }
        })
        .collect()
}

/// A volume another host serves, as the pod knows it.
struct Foreign {
    model: PublishedVolume,
    /// The host that serves it, if any.
    host: Option<String>,
    /// Why it may not move (its host is down, or has published no model of it yet).
    stuck: Option<String>,
    /// Its host is down: its load is not known (its published model went with the host).
    host_down: bool,
}

/// The volumes other hosts serve: their records from the coordinator, their models from
/// what their hosts published. Empty with the `local` coordinator.
/// `unknown_hosts` gets why the host list could not be read, if it could not.
async fn foreign_volumes(
    d: &Daemon,
    notes: &mut Vec<String>,
    unknown_hosts: &mut Option<String>,
) -> Vec<Foreign> {
    if d.coord.kind() == "local" {
        return Vec::new();
    }
    let mine: std::collections::HashSet<uuid::Uuid> =
        d.entries().iter().map(|e| e.record.id).collect();
    let records = match d.coord.state().await {
        Ok(s) => s.volumes,
        Err(e) => {
            notes.push(format!(
                "the other hosts' volumes are left out: the coordinator cannot list them ({e})"
            ));
            return Vec::new();
        }
    };
    let hosts = d.coord.hosts().await;
    if let Err(e) = &hosts {
        *unknown_hosts = Some(e.to_string());
    }
    let listed = hosts.is_ok();
    let alive: std::collections::HashSet<String> = hosts
        .unwrap_or_default()
        .into_iter()
        .filter(|h| h.alive)
        .map(|h| h.record.name)
        .collect();
    let mut published: std::collections::HashMap<String, PublishedVolume> = Default::default();
    match d.coord.stats(StatsDoc::Volumes).await {
        Ok(docs) => {
            for (host, raw) in docs {
                if host == d.coord.host() {
                    continue;
                }
                match serde_json::from_slice::<VolumesDoc>(&raw) {
                    Ok(doc) => {
                        for v in doc.volumes {
                            published.insert(format!("{host}/{}", v.name), v);
                        }
                    }
                    Err(e) => notes.push(format!(
                        "host {host}'s volume models do not parse ({e}); its volumes count \
                         as idle"
                    )),
                }
            }
        }
        Err(e) => notes.push(format!(
            "the other hosts' volume models cannot be read ({e}); their volumes count as idle"
        )),
    }
    records
        .into_iter()
        .filter(|r| !mine.contains(&r.id))
        .map(|r| {
            let host = r.owner.clone();
            let model = host
                .as_ref()
                .and_then(|h| published.remove(&format!("{h}/{}", r.name)))
                .filter(|m| m.datastore == r.datastore);
            let stuck = match (&host, &model) {
                (Some(h), _) if !listed => Some(format!("whether its host {h} is up is not known")),
                (Some(h), _) if !alive.contains(h) => Some(format!("its host {h} is down")),
                (None, _) => Some("no host serves it".to_string()),
                (Some(h), None) => Some(format!("host {h} has not published its model yet")),
                _ => None,
            };
            let host_down = listed && host.as_ref().is_some_and(|h| !alive.contains(h));
            Foreign {
                host_down,
                model: model.unwrap_or(PublishedVolume {
                    name: r.name.clone(),
                    datastore: r.datastore.clone(),
                    size: r.size,
                    samples: 0,
                    p90: None,
                    iops: 0.0,
                }),
                host,
                stuck,
            }
        })
        .collect()
}

/// Builds the models and the pod from the statistics: this host's history, the pod's
/// combined datastore intervals and the other hosts' published volume models.
pub async fn inputs(d: &Daemon) -> Inputs {
    let infos = d.datastore_infos().await;
    let (k, constants_from) = constants(d);
    let entries = d.entries();
    let mut notes = Vec::new();
    // The same entries throughout: `volumes` and `open` below are zipped by position.
    let own = volume_models(d, &entries);
    let mut unknown_hosts = None;
    let foreign = foreign_volumes(d, &mut notes, &mut unknown_hosts).await;
    if let Some(e) = &unknown_hosts {
        notes.push(format!(
            "the host list cannot be read ({e}): which hosts are down is not known"
        ));
    }
    let model = |v: &PublishedVolume, host: Option<String>| api::VolumeModel {
        name: v.name.clone(),
        datastore: v.datastore.clone(),
        host,
        samples: v.samples,
        p90: v.p90,
        load: v.p90.map(|c| k.load(&c)).unwrap_or(0.0),
        iops: v.iops,
    };
    let volumes: Vec<api::VolumeModel> = own
        .iter()
        .map(|v| model(v, None))
        .chain(foreign.iter().map(|f| model(&f.model, f.host.clone())))
        .collect();
    let sampler = d.sampler.lock().expect("lock");

    // `dir` datastores on one file system share its free space, which the sparse images of
    // each of them may take as they are written.
    let file_system = |info: &api::DatastoreInfo| {
        use std::os::unix::fs::MetadataExt;
        (info.kind == "dir")
            .then(|| std::fs::metadata(&info.location).ok().map(|m| m.dev()))
            .flatten()
    };
    let mut unwritten_on: std::collections::HashMap<u64, u64> = Default::default();
    for info in &infos {
        if let (Some(fs), Some(u)) = (file_system(info), info.unwritten_bytes) {
            *unwritten_on.entry(fs).or_default() += u;
        }
    }
    let mut datastores = Vec::with_capacity(infos.len());
    let mut pod = Pod::default();
    let mut unavailable = Vec::new();
    for info in &infos {
        let hist = sampler.datastore_history(&info.name);
        let model = balance::device::model(&hist);
        let load: f64 = volumes
            .iter()
            .filter(|v| v.datastore == info.name)
            .map(|v| v.load)
            .sum();
        datastores.push(api::DatastoreModel {
            name: info.name.clone(),
            hosts: sampler.datastore_hosts(&info.name),
            samples: hist.len(),
            usable: hist
                .iter()
                .filter(|s| balance::device::is_usable(s))
                .count(),
            read_oio_median: balance::stats::median(
                &hist
                    .iter()
                    .filter(|s| balance::device::is_usable(s))
                    .map(|s| s.read_oio)
                    .collect::<Vec<_>>(),
            ),
            model,
            load,
            normalized_load: model.map(|m| balance::normalized_load(load, m.performance)),
        });
        match (info.status.as_str(), info.total_bytes, info.free_bytes) {
            ("ok", Some(total), Some(free)) => {
                // Sparse images take their unwritten part as they are written: it is not
                // free for another volume.
                let unwritten = match file_system(info) {
                    Some(fs) => unwritten_on.get(&fs).copied().unwrap_or(0),
                    None => info.unwritten_bytes.unwrap_or(0),
                };
                let taken = total.saturating_sub(free).saturating_add(unwritten);
                let sized: u64 = own
                    .iter()
                    .chain(foreign.iter().map(|f| &f.model))
                    .filter(|v| v.datastore == info.name)
                    .map(|v| v.size)
                    .sum();
                // The pod's volumes count whole (what a move copies), even one whose image
                // is elsewhere on a shared file system.
                let used = taken.max(sized);
                pod.datastores.push(balance::Datastore {
                    id: info.name.clone(),
                    capacity_gib: total as f64 / GIB,
                    used_gib: used as f64 / GIB,
                    reliability: None,
                    performance: model.map(|m| m.performance),
                });
                if model.is_none() {
                    notes.push(format!(
                        "datastore {} has no device model yet ({} usable intervals of reads); \
                         it is given the median performance of the others and takes at most \
                         one new volume until it has one",
                        info.name,
                        hist.iter()
                            .filter(|s| balance::device::is_usable(s))
                            .count()
                    ));
                }
            }
            (status, _, _) => unavailable.push((info.name.clone(), status.to_string())),
        }
    }
    // Own volumes first (as `volumes` lists them), then the other hosts'.
    let open: Vec<Option<String>> = entries
        .iter()
        .map(|e| e.volume.is_err().then(|| "it is not open".to_string()))
        .chain(foreign.iter().map(|f| f.stuck.clone()))
        .collect();
    for (v, stuck) in volumes.iter().zip(&open) {
        if !pod.datastores.iter().any(|ds| ds.id == v.datastore) {
            continue;
        }
        if let Some(why) = stuck {
            notes.push(format!("volume {} stays where it is: {why}", v.name));
        }
        if v.samples == 0 {
            notes.push(format!(
                "volume {} has done no IO in the history; its load counts as 0",
                v.name
            ));
        }
        let size = own
            .iter()
            .chain(foreign.iter().map(|f| &f.model))
            .find(|p| p.name == v.name)
            .map(|p| p.size)
            .unwrap_or(0);
        pod.workloads.push(balance::Workload {
            id: v.name.clone(),
            datastore: v.datastore.clone(),
            load: v.load,
            size_gib: size as f64 / GIB,
            iops: v.iops,
            reliability: None,
            // A volume nobody can copy now (not open, its host down) may only stay.
            affinity: if stuck.is_some() {
                vec![v.datastore.clone()]
            } else {
                Vec::new()
            },
            anti_affinity: Vec::new(),
        });
    }
    let history = sampler.history;
    let interval_s = d.config.stats.interval_s;
    drop(sampler);
    let hosts_down = foreign
        .iter()
        .filter(|f| f.host_down)
        .filter_map(|f| Some((f.model.name.clone(), f.host.clone()?)))
        .collect();
    Inputs {
        hosts_down,
        unknown_hosts,
        pod,
        report: api::ModelsReport {
            interval_s,
            history,
            constants: k,
            constants_from,
            volumes,
            datastores,
        },
        notes,
        unavailable,
    }
}

/// A migration plan from the current models.
pub async fn plan(d: &Daemon, policy: &balance::Policy) -> OpResult<api::BalancePlan> {
    let inputs = inputs(d).await;
    if let Some((name, why)) = inputs.unavailable.first() {
        return Err(OpError::Conflict(format!(
            "datastore {name} is not available ({why}); nothing is planned while a datastore \
             is degraded"
        )));
    }
    // DESIGN §8: nothing moves while a host is degraded. Its volumes' published models went
    // with its lease, so their load would count as 0, and their datastore would look cooler
    // than it is: a plan would send load there.
    if let Some(e) = &inputs.unknown_hosts {
        return Err(OpError::Unavailable(format!(
            "the host list cannot be read ({e}), so which hosts are down is not known; \
             nothing is planned without it"
        )));
    }
    if let Some((volume, host)) = inputs.hosts_down.first() {
        return Err(OpError::Conflict(format!(
            "host {host} is down (it serves volume {volume}), so its volumes' load is not \
             known; nothing is planned while a host is down"
        )));
    }
    let recent: Vec<RecentMove> = d.recent_moves().await;
    let plan = balance::plan(&inputs.pod, &recent, policy)
        .map_err(|e| OpError::Internal(format!("the planner rejected the pod: {e}")))?;
    let mut notes = inputs.notes;
    for m in &plan.moves {
        let host = inputs
            .report
            .volumes
            .iter()
            .find(|v| v.name == m.workload)
            .and_then(|v| v.host.as_ref());
        if let Some(h) = host {
            notes.push(format!(
                "volume {} is served by host {h}: carry its move out there",
                m.workload
            ));
        }
    }
    Ok(api::BalancePlan {
        plan,
        constants_from: inputs.report.constants_from,
        notes,
    })
}

/// Initial placement of a new volume of `size` bytes: the eligible datastore with the lowest
/// normalized load once it is added. Its expected load is the median of the loaded volumes'
/// (nothing is known about a new disk), or 0 when no volume has a load yet.
pub async fn place(d: &Daemon, name: &str, size: u64) -> OpResult<balance::Placement> {
    let inputs = inputs(d).await;
    let loads: Vec<f64> = inputs
        .pod
        .workloads
        .iter()
        .map(|w| w.load)
        .filter(|l| *l > 0.0)
        .collect();
    let new = balance::NewWorkload {
        id: name.to_string(),
        load: median(loads),
        size_gib: size as f64 / GIB,
        reliability: None,
        affinity: Vec::new(),
        anti_affinity: Vec::new(),
    };
    match balance::place(&inputs.pod, &new) {
        Err(balance::plan::PlacementError::NoEligibleDatastore { .. })
            if inputs
                .pod
                .datastores
                .iter()
                .all(|ds| ds.performance.is_none()) =>
        {
            // A pod with no device model at all (a new cluster, or one without reads yet):
            // BASIL's one-workload-per-unmodeled-datastore rule would refuse every volume after
            // the first few. Place by free space instead, and say so.
            return by_free_space(&inputs.pod, &new);
        }
        r => r,
    }
    .map_err(|e| match e {
        balance::plan::PlacementError::NoEligibleDatastore { .. } => OpError::Conflict(format!(
            "{e}. Name a datastore with --datastore{}",
            if inputs
                .pod
                .datastores
                .iter()
                .all(|ds| ds.performance.is_none())
            {
                "; datastores get device models from a few minutes of reads (or from \
                 `vesta calibrate`), after which placement can stack volumes"
            } else {
                ""
            }
        )),
        other => OpError::Internal(format!("placement failed: {other}")),
    })
}

/// Placement when no datastore has a model: the one with the most free space that fits.
fn by_free_space(pod: &Pod, new: &balance::NewWorkload) -> OpResult<balance::Placement> {
    let free = |ds: &balance::Datastore| ds.capacity_gib - ds.used_gib;
    let best = pod
        .datastores
        .iter()
        .filter(|ds| free(ds) >= new.size_gib)
        .max_by(|a, b| free(a).total_cmp(&free(b)))
        .ok_or_else(|| {
            OpError::Conflict(format!(
                "no datastore has {:.1} GiB free for {}",
                new.size_gib, new.id
            ))
        })?;
    Ok(balance::Placement {
        datastore: best.id.clone(),
        normalized_load_before: 0.0,
        normalized_load_after: 0.0,
        reason: format!(
            "no datastore has a device model yet, so loads cannot be compared; {} has the \
             most free space ({:.1} GiB)",
            best.id,
            free(best)
        ),
        candidates: pod
            .datastores
            .iter()
            .map(|ds| balance::plan::Candidate {
                datastore: ds.id.clone(),
                normalized_load_after: None,
                excluded: (free(ds) < new.size_gib).then(|| {
                    format!(
                        "{:.1} GiB free, the workload needs {:.1}",
                        free(ds),
                        new.size_gib
                    )
                }),
            })
            .collect(),
    })
}
