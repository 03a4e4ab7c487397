//! The load-balance engine (BASIL §5): normalized load, imbalance, migration plans and initial
//! placement.
//!
//! BASIL wants each datastore's load in proportion to its performance, so it compares
//! datastores by their *normalized load* `N = ΣL / P` — the loads of the workloads on it
//! ([`crate::workload`]) over its performance ([`crate::device`]) — and measures how uneven a
//! pod is by the *imbalance fraction* `f = σ(N) / mean(N)`.
//!
//! # Planning
//!
//! [`plan`] repeats one step until `f` is under the threshold: take the datastore with the
//! highest `N` and the one with the lowest, and move the set of workloads from the first to the
//! second that balances the two best. Balancing a pair exactly is a subset-sum problem (the
//! load to move is `(S_x·P_y − S_y·P_x)/(P_x + P_y)`, which makes `N_x = N_y`); BASIL uses
//! Przydatek's fast approximation [16], and so do we ([`subsets_near`]: randomized greedy fills
//! each improved by exchanges, the best of a few seeded trials, plus the plain greedy fill in
//! preference order and the single workload nearest the target).
//!
//! Candidates are taken in the order §5 suggests: highest load per GiB first, so each GiB
//! copied buys the most balance; then lowest IOPS per load, so the workloads doing the least
//! right now bear the disruption. When two sets balance about equally (their `f` within
//! [`IMBALANCE_TIE`]), the one that copies fewer GiB wins: migrations take hours, and the paper
//! found the last bit of balance not worth the extra copying.
//!
//! Every move must pay: a step is taken only if `f` falls after *each* of its moves, in the
//! order they would be executed, and by at least `min_imbalance_gain` over the step. When the
//! extreme pair has no such step (say the coolest datastore lacks space or has the wrong
//! reliability class), the next pairs are tried, hottest sources and coolest destinations
//! first; when no pair has one, planning stops.
//!
//! # Constraints
//!
//! Hard, never violated (a proptest replays every plan against them): capacity, affinity
//! (the datastores a workload may live on), anti-affinity (workloads that must never share a
//! datastore), and reliability class (a workload that requires one only goes to datastores of
//! that class). Soft, by policy: no ping-pong (a workload recently moved off a datastore is not
//! moved back to it, and nothing moves twice in one plan), and at most `max_moves` moves per
//! plan, since each one is a live migration that costs IO for hours.
//!
//! # Datastores without a model
//!
//! A datastore with no device model yet (new, or idle) gets at most one workload until that
//! workload's statistics give it a model (§6.3). Meanwhile its performance is taken to be the
//! median of the modeled ones — a neutral guess that lets `N` and `f` be computed for every
//! datastore — and it is never the source of a move, since its true load is unknown. The paper
//! assigns such a device a slope of zero instead; that would make its `N` zero whatever it
//! holds, so moving a workload there could never lower `f`.
//!
//! Initial placement ([`place`]) puts a new workload on the eligible datastore with the lowest
//! `N` after adding it, and says why in words.

use std::collections::{HashMap, HashSet};

use serde::{Deserialize, Serialize};

use crate::rng::SplitMix64;
use crate::stats;

/// Default imbalance under which a pod counts as balanced. Device models are fitted from
/// noisy intervals (slopes within ±10–20 % are the norm) and the workload model's error is
/// larger still (§3), so chasing an `f` much below 0.1 would move disks on the strength of
/// model noise.
pub const IMBALANCE_THRESHOLD_DEFAULT: f64 = 0.1;
/// Default cap on moves per plan. Each is a live storage migration of a whole disk; BASIL's
/// own rounds recommended two or three (§6.2, §6.3), and the next round re-plans from fresh
/// statistics anyway.
pub const MAX_MOVES_DEFAULT: usize = 4;
/// Default least fall in `f` a step must bring: one point of imbalance. Below that the
/// predicted gain is inside the models' error, and the migration's cost is certain.
pub const MIN_IMBALANCE_GAIN_DEFAULT: f64 = 0.01;
/// Steps whose resulting imbalance differ by less than this balance "equally well"; the one
/// moving fewer GiB wins.
pub const IMBALANCE_TIE: f64 = 0.005;
/// Randomized subset-sum trials per pair of datastores. Przydatek's analysis needs only a
/// few; the candidate lists here are a handful of workloads long.
const SUBSET_TRIALS: usize = 8;
/// Seed of the planner's subset-sum trials: a plan is a pure function of its input.
const PLANNER_SEED: u64 = 0xBA51_1FA5_7000_0005;
/// Least fall in `f` that counts as lowering it, per move: far above floating-point noise in
/// `f`, far below any fall worth a migration.
const MOVE_EPSILON: f64 = 1e-9;

/// `N = ΣL / P`.
pub fn normalized_load(load: f64, performance: f64) -> f64 {
    load / performance
}

/// `f = σ(N) / mean(N)` (population standard deviation); 0 for an empty or idle pod.
pub fn imbalance(normalized: &[f64]) -> f64 {
    match (stats::mean(normalized), stats::std_dev(normalized)) {
        (Some(m), Some(s)) if m > 0.0 => s / m,
        _ => 0.0,
    }
}

/// A datastore of the pod, as the planner needs it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Datastore {
    pub id: String,
    pub capacity_gib: f64,
    /// Space in use now, including the pod's workloads that live here.
    pub used_gib: f64,
    /// Reliability class (RAID level, replication, backup policy…); `None` = unclassified.
    pub reliability: Option<String>,
    /// `P` from its device model; `None` if it has none yet.
    pub performance: Option<f64>,
}

/// A workload (virtual disk) of the pod.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Workload {
    pub id: String,
    /// The datastore it lives on.
    pub datastore: String,
    /// `L` from its workload model.
    pub load: f64,
    /// Space it occupies: what a move copies and what the destination must have free.
    pub size_gib: f64,
    /// Current IOPS (for the candidate order only).
    pub iops: f64,
    /// The reliability class it requires, if any.
    pub reliability: Option<String>,
    /// The datastores it may live on; empty = any.
    pub affinity: Vec<String>,
    /// Workloads it must never share a datastore with (either side may list the other).
    pub anti_affinity: Vec<String>,
}

/// A pod: the datastores placement and balancing choose among, and the workloads on them.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Pod {
    pub datastores: Vec<Datastore>,
    pub workloads: Vec<Workload>,
}

/// A move made in an earlier round: `workload` is not moved back to `from`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecentMove {
    pub workload: String,
    pub from: String,
}

/// How aggressive a plan may be.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Policy {
    /// Stop once `f` is at or below this.
    pub imbalance_threshold: f64,
    /// At most this many moves per plan.
    pub max_moves: usize,
    /// A step must lower `f` by at least this much.
    pub min_imbalance_gain: f64,
}

impl Default for Policy {
    fn default() -> Policy {
        Policy {
            imbalance_threshold: IMBALANCE_THRESHOLD_DEFAULT,
            max_moves: MAX_MOVES_DEFAULT,
            min_imbalance_gain: MIN_IMBALANCE_GAIN_DEFAULT,
        }
    }
}

/// A pod the planner cannot work with; nothing is planned.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PodError {
    #[error("datastore {0} is listed twice")]
    DuplicateDatastore(String),
    #[error("workload {0} is listed twice")]
    DuplicateWorkload(String),
    #[error("workload {workload} lives on datastore {datastore}, which is not in the pod")]
    UnknownDatastore { workload: String, datastore: String },
    #[error("{what} is {value}; it must be a finite number{rule}")]
    BadNumber {
        what: String,
        value: f64,
        rule: &'static str,
    },
}

/// Normalized load of one datastore.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DatastoreLoad {
    pub datastore: String,
    /// `ΣL` of its workloads.
    pub load: f64,
    /// `P` used: the device model's, or the provisional one if it has none.
    pub performance: f64,
    pub modeled: bool,
    /// `N = ΣL / P`.
    pub normalized_load: f64,
    pub workloads: usize,
    pub used_gib: f64,
}

/// One proposed migration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Move {
    pub workload: String,
    pub from: String,
    pub to: String,
    pub load: f64,
    pub size_gib: f64,
    /// `f` once this move (and the ones before it) are done. Strictly decreasing along a plan.
    pub imbalance_after: f64,
}

/// Why planning stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Stop {
    /// `f` is at or below the threshold.
    Balanced,
    /// The plan has `max_moves` moves.
    MoveCap,
    /// No allowed move lowers `f` enough.
    NoImprovingMove,
}

/// A migration plan: the moves, in execution order, and the loads they are predicted to give.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub moves: Vec<Move>,
    pub before: Vec<DatastoreLoad>,
    pub after: Vec<DatastoreLoad>,
    pub imbalance_before: f64,
    pub imbalance_after: f64,
    pub stop: Stop,
}

fn check(what: impl FnOnce() -> String, value: f64, positive: bool) -> Result<(), PodError> {
    let ok = value.is_finite() && if positive { value > 0.0 } else { value >= 0.0 };
    if ok {
        Ok(())
    } else {
        Err(PodError::BadNumber {
            what: what(),
            value,
            rule: if positive { " above 0" } else { " at least 0" },
        })
    }
}

/// The planner's working state: indices instead of names, and the running sums.
struct State<'a> {
    pod: &'a Pod,
    perf: Vec<f64>,
    modeled: Vec<bool>,
    load: Vec<f64>,
    used: Vec<f64>,
    count: Vec<usize>,
    at: Vec<usize>,
    moved: Vec<bool>,
    /// Symmetric anti-affinity, by workload index.
    anti: Vec<Vec<usize>>,
    /// (workload, datastore) pairs a move may not go to: ping-pong.
    banned: HashSet<(usize, usize)>,
}

impl<'a> State<'a> {
    fn new(pod: &'a Pod, recent: &[RecentMove]) -> Result<State<'a>, PodError> {
        let mut ds = HashMap::new();
        for (i, d) in pod.datastores.iter().enumerate() {
            if ds.insert(d.id.as_str(), i).is_some() {
                return Err(PodError::DuplicateDatastore(d.id.clone()));
            }
            check(|| format!("capacity of {}", d.id), d.capacity_gib, false)?;
            check(|| format!("used space of {}", d.id), d.used_gib, false)?;
            if let Some(p) = d.performance {
                check(|| format!("performance of {}", d.id), p, true)?;
            }
        }
        let mut wl = HashMap::new();
        let mut at = Vec::with_capacity(pod.workloads.len());
        for (i, w) in pod.workloads.iter().enumerate() {
            if wl.insert(w.id.as_str(), i).is_some() {
                return Err(PodError::DuplicateWorkload(w.id.clone()));
            }
            check(|| format!("load of {}", w.id), w.load, false)?;
            check(|| format!("size of {}", w.id), w.size_gib, false)?;
            check(|| format!("IOPS of {}", w.id), w.iops, false)?;
            let &j = ds
                .get(w.datastore.as_str())
                .ok_or_else(|| PodError::UnknownDatastore {
                    workload: w.id.clone(),
                    datastore: w.datastore.clone(),
                })?;
            at.push(j);
        }
        let mut anti = vec![Vec::new(); pod.workloads.len()];
        for (i, w) in pod.workloads.iter().enumerate() {
            for other in &w.anti_affinity {
                if let Some(&j) = wl.get(other.as_str()) {
                    if i != j {
                        anti[i].push(j);
                        anti[j].push(i);
                    }
                }
            }
        }
        let banned = recent
            .iter()
            .filter_map(|r| Some((*wl.get(r.workload.as_str())?, *ds.get(r.from.as_str())?)))
            .collect();

        let modeled: Vec<bool> = pod
            .datastores
            .iter()
            .map(|d| d.performance.is_some())
            .collect();
        let known: Vec<f64> = pod
            .datastores
            .iter()
            .filter_map(|d| d.performance)
            .collect();
        // With no model anywhere all datastores look alike; any common value does.
        let provisional = stats::median(&known).unwrap_or(1.0);
        let perf = pod
            .datastores
            .iter()
            .map(|d| d.performance.unwrap_or(provisional))
            .collect();
        let n = pod.datastores.len();
        let mut load = vec![0.0; n];
        let mut count = vec![0; n];
        for (w, &j) in pod.workloads.iter().zip(&at) {
            load[j] += w.load;
            count[j] += 1;
        }
        Ok(State {
            pod,
            perf,
            modeled,
            load,
            used: pod.datastores.iter().map(|d| d.used_gib).collect(),
            count,
            at,
            moved: vec![false; pod.workloads.len()],
            anti,
            banned,
        })
    }

    fn normalized(&self) -> Vec<f64> {
        self.load
            .iter()
            .zip(&self.perf)
            .map(|(l, p)| normalized_load(*l, *p))
            .collect()
    }

    /// `f` if `delta` of load went from `x` to `y`.
    fn imbalance_if(&self, x: usize, y: usize, delta: f64) -> f64 {
        let mut n = self.normalized();
        n[x] = normalized_load(self.load[x] - delta, self.perf[x]);
        n[y] = normalized_load(self.load[y] + delta, self.perf[y]);
        imbalance(&n)
    }

    fn loads(&self) -> Vec<DatastoreLoad> {
        self.pod
            .datastores
            .iter()
            .enumerate()
            .map(|(j, d)| DatastoreLoad {
                datastore: d.id.clone(),
                load: self.load[j],
                performance: self.perf[j],
                modeled: self.modeled[j],
                normalized_load: normalized_load(self.load[j], self.perf[j]),
                workloads: self.count[j],
                used_gib: self.used[j],
            })
            .collect()
    }

    /// Whether workload `w` could, by itself, move to datastore `y` now.
    fn may_move(&self, w: usize, y: usize) -> bool {
        let wl = &self.pod.workloads[w];
        let d = &self.pod.datastores[y];
        self.at[w] != y
            && !self.moved[w]
            && !self.banned.contains(&(w, y))
            && (self.modeled[y] || self.count[y] == 0)
            && self.used[y] + wl.size_gib <= d.capacity_gib
            && allowed_on(
                wl.reliability.as_deref(),
                &wl.affinity,
                d.reliability.as_deref(),
                &d.id,
            )
            && !self.anti[w].iter().any(|&o| self.at[o] == y && o != w)
    }

    /// The best step moving workloads from `x` to `y`, as workload indices in execution
    /// order, with the `f` after each move; `None` if no set lowers `f` after every move and
    /// by `min_gain` overall.
    fn best_step(
        &self,
        x: usize,
        y: usize,
        moves_left: usize,
        min_gain: f64,
        rng: &mut SplitMix64,
    ) -> Option<(Vec<usize>, Vec<f64>)> {
        let ws = &self.pod.workloads;
        let mut cands: Vec<usize> = (0..ws.len())
            .filter(|&w| self.at[w] == x && self.may_move(w, y))
            .collect();
        if cands.is_empty() || moves_left == 0 {
            return None;
        }
        cands.sort_by(|&a, &b| preference(&ws[a], &ws[b]));

        let sets: Vec<Vec<usize>> = if !self.modeled[y] {
            // At most one workload on a datastore without a model.
            (0..cands.len()).map(|i| vec![i]).collect()
        } else {
            let (px, py) = (self.perf[x], self.perf[y]);
            let target = (self.load[x] * py - self.load[y] * px) / (px + py);
            if target.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
                return None;
            }
            let loads: Vec<f64> = cands.iter().map(|&w| ws[w].load).collect();
            subsets_near(&loads, target, moves_left, rng)
        };

        let f0 = imbalance(&self.normalized());
        let free = self.pod.datastores[y].capacity_gib - self.used[y];
        let mut steps: Vec<(f64, f64, Vec<usize>, Vec<f64>)> = Vec::new();
        for set in sets {
            // Execution order: preference order (`cands` is sorted, `set` holds positions).
            let mut order: Vec<usize> = set.iter().map(|&i| cands[i]).collect();
            order.sort_by(|&a, &b| preference(&ws[a], &ws[b]));
            let gib: f64 = order.iter().map(|&w| ws[w].size_gib).sum();
            if gib > free || order.len() > moves_left {
                continue;
            }
            let mutual = order
                .iter()
                .any(|&a| order.iter().any(|&b| a != b && self.anti[a].contains(&b)));
            if mutual {
                continue;
            }
            let Some(trail) = self.trail(x, y, &order, f0) else {
                continue;
            };
            let f = *trail.last().unwrap_or(&f0);
            if f0 - f >= min_gain {
                steps.push((f, gib, order, trail));
            }
        }
        // The best balance, or one within IMBALANCE_TIE of it that copies fewer GiB.
        let f_best = steps.iter().map(|s| s.0).min_by(f64::total_cmp)?;
        steps
            .into_iter()
            .filter(|s| s.0 <= f_best + IMBALANCE_TIE)
            .min_by(|a, b| {
                a.1.total_cmp(&b.1)
                    .then(a.2.len().cmp(&b.2.len()))
                    .then(a.0.total_cmp(&b.0))
            })
            .map(|(_, _, set, trail)| (set, trail))
    }

    /// `f` after each move of `order` from `x` to `y`, or `None` if one of them does not lower
    /// it.
    fn trail(&self, x: usize, y: usize, order: &[usize], f0: f64) -> Option<Vec<f64>> {
        let mut delta = 0.0;
        let mut prev = f0;
        let mut out = Vec::with_capacity(order.len());
        for &w in order {
            delta += self.pod.workloads[w].load;
            let f = self.imbalance_if(x, y, delta);
            if f.partial_cmp(&(prev - MOVE_EPSILON)) != Some(std::cmp::Ordering::Less) {
                return None;
            }
            out.push(f);
            prev = f;
        }
        Some(out)
    }

    fn apply(&mut self, w: usize, y: usize) {
        let x = self.at[w];
        let wl = &self.pod.workloads[w];
        self.load[x] -= wl.load;
        self.load[y] += wl.load;
        self.used[x] -= wl.size_gib;
        self.used[y] += wl.size_gib;
        self.count[x] -= 1;
        self.count[y] += 1;
        self.at[w] = y;
        self.moved[w] = true;
    }
}

/// Reliability class and affinity: the static rules between a workload and a datastore.
fn allowed_on(
    required: Option<&str>,
    affinity: &[String],
    class: Option<&str>,
    datastore: &str,
) -> bool {
    required.is_none_or(|r| class == Some(r))
        && (affinity.is_empty() || affinity.iter().any(|a| a == datastore))
}

/// Candidate order (§5): load per GiB descending, then IOPS per load ascending, then id.
fn preference(a: &Workload, b: &Workload) -> std::cmp::Ordering {
    let per_gib = |w: &Workload| w.load / w.size_gib.max(f64::MIN_POSITIVE);
    let busy = |w: &Workload| {
        if w.load > 0.0 {
            w.iops / w.load
        } else {
            f64::INFINITY
        }
    };
    per_gib(b)
        .total_cmp(&per_gib(a))
        .then(busy(a).total_cmp(&busy(b)))
        .then(a.id.cmp(&b.id))
}

/// Candidate subsets (positions into `loads`, at most `max_len` each) whose sums come close
/// to `target`, after Przydatek's approximation: the greedy fill in the given order, several
/// randomized greedy fills each improved by exchanging a chosen item for a larger unchosen one
/// while the sum stays within the target, and the single item nearest the target (which may
/// overshoot it, and still balance better than anything below it). Items without load (idle
/// volumes) are never chosen: they always fit, so every fill would take them up to
/// `max_len`, and a set with a move that lowers nothing is thrown out whole.
fn subsets_near(
    loads: &[f64],
    target: f64,
    max_len: usize,
    rng: &mut SplitMix64,
) -> Vec<Vec<usize>> {
    let n = loads.len();
    let greedy = |order: &[usize]| {
        let mut set = Vec::new();
        let mut sum = 0.0;
        for &i in order {
            if set.len() == max_len {
                break;
            }
            if loads[i] > 0.0 && sum + loads[i] <= target {
                set.push(i);
                sum += loads[i];
            }
        }
        (set, sum)
    };
    let mut out: Vec<Vec<usize>> = Vec::new();
    let in_order: Vec<usize> = (0..n).collect();
    out.push(greedy(&in_order).0);
    for _ in 0..SUBSET_TRIALS {
        let mut order = in_order.clone();
        rng.shuffle(&mut order);
        let (mut set, mut sum) = greedy(&order);
        // Improvement: replace each chosen item by the largest unchosen one that still fits.
        for pos in 0..set.len() {
            let i = set[pos];
            let swap = (0..n)
                .filter(|j| !set.contains(j) && loads[*j] > loads[i])
                .filter(|&j| sum - loads[i] + loads[j] <= target)
                .max_by(|&a, &b| loads[a].total_cmp(&loads[b]));
            if let Some(j) = swap {
                sum += loads[j] - loads[i];
                set[pos] = j;
            }
        }
        out.push(set);
    }
    if let Some(i) = (0..n).filter(|&i| loads[i] > 0.0).min_by(|&a, &b| {
        (loads[a] - target)
            .abs()
            .total_cmp(&(loads[b] - target).abs())
    }) {
        out.push(vec![i]);
    }
    for set in &mut out {
        set.sort_unstable();
    }
    out.retain(|s| !s.is_empty());
    out.sort();
    out.dedup();
    out
}

/// A migration plan for the pod (see the module doc). `recent` lists moves of earlier rounds
/// that must not be undone. Deterministic: the same input gives the same plan.
pub fn plan(pod: &Pod, recent: &[RecentMove], policy: &Policy) -> Result<Plan, PodError> {
    let mut st = State::new(pod, recent)?;
    let before = st.loads();
    let imbalance_before = imbalance(&st.normalized());
    let mut rng = SplitMix64::new(PLANNER_SEED);
    let mut moves: Vec<Move> = Vec::new();
    let stop = loop {
        let n = st.normalized();
        if imbalance(&n) <= policy.imbalance_threshold {
            break Stop::Balanced;
        }
        if moves.len() >= policy.max_moves {
            break Stop::MoveCap;
        }
        let by_n = |a: &usize, b: &usize| n[*a].total_cmp(&n[*b]).then(a.cmp(b));
        let mut sources: Vec<usize> = (0..n.len())
            .filter(|&j| st.modeled[j] && st.count[j] > 0)
            .collect();
        sources.sort_by(|a, b| by_n(b, a));
        let mut dests: Vec<usize> = (0..n.len())
            .filter(|&j| st.modeled[j] || st.count[j] == 0)
            .collect();
        dests.sort_by(by_n);
        let step = sources.iter().find_map(|&x| {
            dests.iter().filter(|&&y| n[y] < n[x]).find_map(|&y| {
                st.best_step(
                    x,
                    y,
                    policy.max_moves - moves.len(),
                    policy.min_imbalance_gain,
                    &mut rng,
                )
                .map(|s| (x, y, s))
            })
        });
        let Some((x, y, (set, trail))) = step else {
            break Stop::NoImprovingMove;
        };
        for (&w, f) in set.iter().zip(trail) {
            st.apply(w, y);
            let wl = &pod.workloads[w];
            moves.push(Move {
                workload: wl.id.clone(),
                from: pod.datastores[x].id.clone(),
                to: pod.datastores[y].id.clone(),
                load: wl.load,
                size_gib: wl.size_gib,
                imbalance_after: f,
            });
        }
    };
    Ok(Plan {
        moves,
        before,
        after: st.loads(),
        imbalance_before,
        imbalance_after: imbalance(&st.normalized()),
        stop,
    })
}

/// A workload to be placed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NewWorkload {
    pub id: String,
    /// Its expected `L`: from a declared profile, or the pod's median load if nothing is known.
    pub load: f64,
    pub size_gib: f64,
    pub reliability: Option<String>,
    pub affinity: Vec<String>,
    pub anti_affinity: Vec<String>,
}

/// How one datastore fared in a placement decision.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    pub datastore: String,
    /// `N` with the new workload added, if the datastore is eligible.
    pub normalized_load_after: Option<f64>,
    /// Why it is not eligible.
    pub excluded: Option<String>,
}

/// An initial placement.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Placement {
    pub datastore: String,
    pub normalized_load_before: f64,
    pub normalized_load_after: f64,
    /// One or two sentences for the operator.
    pub reason: String,
    /// Every datastore, in pod order, with its `N` after placement or why it was excluded.
    pub candidates: Vec<Candidate>,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlacementError {
    #[error(transparent)]
    Pod(#[from] PodError),
    #[error("no datastore can take {workload}: {why}")]
    NoEligibleDatastore { workload: String, why: String },
}

/// Initial placement (BASIL §5): after the hard constraints, the datastore with the lowest
/// normalized load once the new workload is added. Ties go to the one with more free space.
pub fn place(pod: &Pod, new: &NewWorkload) -> Result<Placement, PlacementError> {
    let st = State::new(pod, &[])?;
    check(|| format!("load of {}", new.id), new.load, false)?;
    check(|| format!("size of {}", new.id), new.size_gib, false)?;
    if pod.workloads.iter().any(|w| w.id == new.id) {
        return Err(PodError::DuplicateWorkload(new.id.clone()).into());
    }
    let n = st.normalized();
    let mut candidates = Vec::with_capacity(pod.datastores.len());
    let mut best: Option<usize> = None;
    for (j, d) in pod.datastores.iter().enumerate() {
        let free = d.capacity_gib - st.used[j];
        let excluded = if let Some(r) = new
            .reliability
            .as_deref()
            .filter(|r| d.reliability.as_deref() != Some(*r))
        {
            Some(format!(
                "reliability class {}, the workload needs {r}",
                d.reliability.as_deref().unwrap_or("(none)")
            ))
        } else if !allowed_on(None, &new.affinity, None, &d.id) {
            Some("not among the workload's allowed datastores".to_string())
        } else if free < new.size_gib {
            Some(format!(
                "{free:.1} GiB free, the workload needs {:.1}",
                new.size_gib
            ))
        } else if let Some(w) = pod.workloads.iter().zip(&st.at).find_map(|(w, &at)| {
            (at == j && (new.anti_affinity.contains(&w.id) || w.anti_affinity.contains(&new.id)))
                .then_some(w)
        }) {
            Some(format!(
                "holds {}, which must not share a datastore with it",
                w.id
            ))
        } else if !st.modeled[j] && st.count[j] > 0 {
            Some("no device model yet, and it already holds a workload".to_string())
        } else {
            None
        };
        let after = normalized_load(st.load[j] + new.load, st.perf[j]);
        if excluded.is_none() {
            let better = match best {
                None => true,
                Some(b) => {
                    let nb = normalized_load(st.load[b] + new.load, st.perf[b]);
                    let free_b = pod.datastores[b].capacity_gib - st.used[b];
                    after < nb || (after == nb && free > free_b)
                }
            };
            if better {
                best = Some(j);
            }
        }
        candidates.push(Candidate {
            datastore: d.id.clone(),
            normalized_load_after: excluded.is_none().then_some(after),
            excluded,
        });
    }
    let Some(b) = best else {
        let why = candidates
            .iter()
            .map(|c| format!("{}: {}", c.datastore, c.excluded.as_deref().unwrap_or("")))
            .collect::<Vec<_>>()
            .join("; ");
        return Err(PlacementError::NoEligibleDatastore {
            workload: new.id.clone(),
            why: if why.is_empty() {
                "the pod has no datastores".to_string()
            } else {
                why
            },
        });
    };
    let after = normalized_load(st.load[b] + new.load, st.perf[b]);
    let eligible = candidates.iter().filter(|c| c.excluded.is_none()).count();
    let excluded = candidates.len() - eligible;
    let id = &pod.datastores[b].id;
    let mut reason = format!(
        "{id} has the lowest normalized load with {} added: N {:.3} -> {:.3}",
        new.id, n[b], after
    );
    let runner_up = candidates
        .iter()
        .filter(|c| &c.datastore != id)
        .filter_map(|c| Some((c.datastore.as_str(), c.normalized_load_after?)))
        .min_by(|a, b| a.1.total_cmp(&b.1));
    match runner_up {
        Some((d, nd)) => reason.push_str(&format!(
            " (next best {d} at {nd:.3}, of {eligible} eligible datastores"
        )),
        None => reason.push_str(" (the only eligible datastore"),
    }
    if excluded > 0 {
        reason.push_str(&format!("; {excluded} excluded by constraints"));
    }
    reason.push(')');
    if !st.modeled[b] {
        reason.push_str(&format!(
            ". {id} has no device model yet: its performance is assumed to be the pod's median \
             until this workload's statistics give it one, and it takes no other workload before then"
        ));
    }
    reason.push('.');
    Ok(Placement {
        datastore: id.clone(),
        normalized_load_before: n[b],
        normalized_load_after: after,
        reason,
        candidates,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ds(id: &str, p: Option<f64>) -> Datastore {
        Datastore {
            id: id.to_string(),
            capacity_gib: 1000.0,
            used_gib: 0.0,
            reliability: None,
            performance: p,
        }
    }

    fn wl(id: &str, on: &str, load: f64, size_gib: f64) -> Workload {
        Workload {
            id: id.to_string(),
            datastore: on.to_string(),
            load,
            size_gib,
            iops: 100.0,
            reliability: None,
            affinity: Vec::new(),
            anti_affinity: Vec::new(),
        }
    }

    /// A pod whose datastores' used space is the sum of their workloads.
    fn pod(datastores: Vec<Datastore>, workloads: Vec<Workload>) -> Pod {
        let mut p = Pod {
            datastores,
            workloads,
        };
        for d in &mut p.datastores {
            d.used_gib = p
                .workloads
                .iter()
                .filter(|w| w.datastore == d.id)
                .map(|w| w.size_gib)
                .sum();
        }
        p
    }

    fn new_wl(id: &str, load: f64) -> NewWorkload {
        NewWorkload {
            id: id.to_string(),
            load,
            size_gib: 10.0,
            reliability: None,
            affinity: Vec::new(),
            anti_affinity: Vec::new(),
        }
    }

    fn moved(p: &Plan) -> Vec<(&str, &str)> {
        p.moves
            .iter()
            .map(|m| (m.workload.as_str(), m.to.as_str()))
            .collect()
    }

    #[test]
    fn imbalance_is_the_coefficient_of_variation() {
        assert_eq!(imbalance(&[3.0, 3.0, 3.0]), 0.0);
        assert_eq!(imbalance(&[]), 0.0);
        assert_eq!(imbalance(&[0.0, 0.0]), 0.0);
        let f = imbalance(&[1.0, 2.0, 3.0]);
        assert!((f - (2.0f64 / 3.0).sqrt() / 2.0).abs() < 1e-12);
        assert_eq!(normalized_load(6.0, 2.0), 3.0);
    }

    #[test]
    fn a_balanced_pod_gets_no_moves() {
        let p = pod(
            vec![ds("a", Some(1.0)), ds("b", Some(2.0))],
            vec![wl("w1", "a", 10.0, 10.0), wl("w2", "b", 20.0, 10.0)],
        );
        let plan = plan(&p, &[], &Policy::default()).unwrap();
        assert!(plan.moves.is_empty());
        assert_eq!(plan.stop, Stop::Balanced);
        assert_eq!(plan.before, plan.after);
    }

    #[test]
    fn load_moves_to_the_coolest_datastore_and_copies_the_fewest_gib() {
        // Moving w5 (load 5) or {w3, w2} (5) both balance a and b exactly; w5 is 50 GiB,
        // the pair 20 GiB.
        let p = pod(
            vec![ds("a", Some(1.0)), ds("b", Some(1.0))],
            vec![
                wl("w5", "a", 5.0, 50.0),
                wl("w3", "a", 3.0, 10.0),
                wl("w2", "a", 2.0, 10.0),
            ],
        );
        let plan = plan(&p, &[], &Policy::default()).unwrap();
        assert_eq!(moved(&plan), [("w3", "b"), ("w2", "b")]);
        assert!(plan.imbalance_after < 1e-12);
        assert_eq!(plan.stop, Stop::Balanced);
        assert_eq!(plan.after[0].normalized_load, 5.0);
        assert_eq!(plan.after[1].normalized_load, 5.0);
        assert!(plan.moves[0].imbalance_after > plan.moves[1].imbalance_after);
    }

    /// Idle volumes (no load) beside the busy ones change nothing: they used to fill every
    /// multi-volume candidate set, each of which was then thrown out (moving an idle volume
    /// lowers nothing), leaving only single moves: here w5, 50 GiB, for {w3, w2}'s 20.
    #[test]
    fn idle_volumes_do_not_change_the_plan() {
        let busy = vec![
            wl("w5", "a", 5.0, 50.0),
            wl("w3", "a", 3.0, 10.0),
            wl("w2", "a", 2.0, 10.0),
        ];
        let alone = plan(
            &pod(vec![ds("a", Some(1.0)), ds("b", Some(1.0))], busy.clone()),
            &[],
            &Policy::default(),
        )
        .unwrap();
        for idle in 1..=4 {
            let mut all = busy.clone();
            all.extend((0..idle).map(|i| wl(&format!("idle{i}"), "a", 0.0, 1.0)));
            let p = pod(vec![ds("a", Some(1.0)), ds("b", Some(1.0))], all);
            let with = plan(&p, &[], &Policy::default()).unwrap();
            assert_eq!(moved(&with), moved(&alone), "{idle} idle volume(s)");
            assert_eq!(moved(&with), [("w3", "b"), ("w2", "b")]);
        }
    }

    #[test]
    fn load_is_shared_in_proportion_to_performance() {
        // b is three times as fast: it should end up with three quarters of the load.
        let p = pod(
            vec![ds("a", Some(1.0)), ds("b", Some(3.0))],
            (0..4)
                .map(|i| wl(&format!("w{i}"), "a", 3.0, 10.0))
                .collect(),
        );
        let plan = plan(&p, &[], &Policy::default()).unwrap();
        assert_eq!(plan.moves.len(), 3);
        assert_eq!(plan.after[0].load, 3.0);
        assert_eq!(plan.after[1].load, 9.0);
        assert!(plan.imbalance_after < 1e-12);
    }

    #[test]
    fn hard_constraints_keep_workloads_off_forbidden_datastores() {
        let mut gold = ds("gold", Some(1.0));
        gold.reliability = Some("raid6".into());
        let mut small = ds("small", Some(1.0));
        small.capacity_gib = 5.0;
        let mut plain = ds("plain", Some(1.0));
        plain.reliability = Some("raid0".into());
        let mut picky = wl("picky", "gold", 10.0, 10.0);
        picky.reliability = Some("raid6".into());
        let mut pinned = wl("pinned", "gold", 10.0, 10.0);
        pinned.affinity = vec!["gold".into(), "small".into()];
        let mut apart = wl("apart", "gold", 10.0, 10.0);
        apart.anti_affinity = vec!["other".into()];
        let p = pod(
            vec![gold, small, plain],
            vec![picky, pinned, apart, wl("other", "plain", 1.0, 1.0)],
        );
        let plan = plan(&p, &[], &Policy::default()).unwrap();
        // Only "other" may go anywhere, and it is already on the cool side: no move helps.
        assert!(plan.moves.is_empty(), "{:?}", plan.moves);
        assert_eq!(plan.stop, Stop::NoImprovingMove);
    }

    #[test]
    fn a_workload_is_not_moved_back_where_it_just_came_from() {
        let p = pod(
            vec![ds("a", Some(1.0)), ds("b", Some(1.0))],
            vec![wl("w1", "a", 5.0, 10.0), wl("w2", "a", 5.0, 10.0)],
        );
        let free = plan(&p, &[], &Policy::default()).unwrap();
        assert_eq!(free.moves.len(), 1);
        let recent = [
            RecentMove {
                workload: "w1".into(),
                from: "b".into(),
            },
            RecentMove {
                workload: "w2".into(),
                from: "b".into(),
            },
        ];
        let held = plan(&p, &recent, &Policy::default()).unwrap();
        assert!(held.moves.is_empty());
    }

    #[test]
    fn a_datastore_without_a_model_gets_one_workload() {
        // §6.3: all eight workloads on the 6-disk LUN, two new LUNs without models.
        let p = pod(
            vec![ds("6disk", Some(1.4)), ds("3disk", None), ds("9disk", None)],
            (0..8)
                .map(|i| wl(&format!("w{i}"), "6disk", 10.0 + f64::from(i), 10.0))
                .collect(),
        );
        let plan = plan(&p, &[], &Policy::default()).unwrap();
        let to: Vec<&str> = plan.moves.iter().map(|m| m.to.as_str()).collect();
        assert_eq!(to.len(), 2, "{:?}", plan.moves);
        assert!(to.contains(&"3disk") && to.contains(&"9disk"));
        assert_eq!(plan.stop, Stop::NoImprovingMove);
        // The provisional performance is the modeled median.
        assert_eq!(plan.after[1].performance, 1.4);
        assert!(!plan.after[1].modeled);
    }

    #[test]
    fn the_move_cap_holds() {
        let p = pod(
            vec![ds("a", Some(1.0)), ds("b", Some(1.0))],
            (0..10)
                .map(|i| wl(&format!("w{i}"), "a", 1.0, 1.0))
                .collect(),
        );
        let policy = Policy {
            max_moves: 2,
            ..Policy::default()
        };
        let plan = plan(&p, &[], &policy).unwrap();
        assert_eq!(plan.moves.len(), 2);
        assert_eq!(plan.stop, Stop::MoveCap);
    }

    #[test]
    fn bad_pods_are_refused() {
        let dup = pod(vec![ds("a", None), ds("a", None)], vec![]);
        assert_eq!(
            plan(&dup, &[], &Policy::default()),
            Err(PodError::DuplicateDatastore("a".into()))
        );
        let lost = pod(vec![ds("a", None)], vec![wl("w", "zz", 1.0, 1.0)]);
        assert!(matches!(
            plan(&lost, &[], &Policy::default()),
            Err(PodError::UnknownDatastore { .. })
        ));
        let nan = pod(vec![ds("a", None)], vec![wl("w", "a", f64::NAN, 1.0)]);
        assert!(matches!(
            plan(&nan, &[], &Policy::default()),
            Err(PodError::BadNumber { .. })
        ));
        let zero_p = pod(vec![ds("a", Some(0.0))], vec![]);
        assert!(matches!(
            place(&zero_p, &new_wl("n", 1.0)),
            Err(PlacementError::Pod(PodError::BadNumber { .. }))
        ));
    }

    #[test]
    fn placement_picks_the_lowest_load_after_adding_and_says_why() {
        // a: 10/1 = 10; b: 12/2 = 6; c: 3/0.5 = 6, but +4 weighs 8 on c against 2 on b.
        let p = pod(
            vec![ds("a", Some(1.0)), ds("b", Some(2.0)), ds("c", Some(0.5))],
            vec![
                wl("x", "a", 10.0, 10.0),
                wl("y", "b", 12.0, 10.0),
                wl("z", "c", 3.0, 10.0),
            ],
        );
        let pl = place(&p, &new_wl("n", 4.0)).unwrap();
        assert_eq!(pl.datastore, "b");
        assert_eq!(pl.normalized_load_before, 6.0);
        assert_eq!(pl.normalized_load_after, 8.0);
        assert!(
            pl.reason.starts_with("b has the lowest normalized load"),
            "{}",
            pl.reason
        );
        assert!(pl.reason.contains("next best a at 14.000"), "{}", pl.reason);
    }

    #[test]
    fn placement_explains_exclusions_and_fails_when_nothing_fits() {
        let mut full = ds("full", Some(1.0));
        full.capacity_gib = 5.0;
        let mut gold = ds("gold", Some(1.0));
        gold.reliability = Some("raid6".into());
        let p = pod(
            vec![full, gold, ds("new", None)],
            vec![wl("old", "new", 1.0, 1.0)],
        );
        let mut n = new_wl("n", 1.0);
        n.reliability = Some("raid10".into());
        let err = place(&p, &n).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("gold: reliability class raid6, the workload needs raid10"),
            "{text}"
        );
        n.reliability = None;
        let pl = place(&p, &n).unwrap();
        assert_eq!(pl.datastore, "gold");
        let why: Vec<Option<&str>> = pl
            .candidates
            .iter()
            .map(|c| c.excluded.as_deref())
            .collect();
        assert_eq!(why[0], Some("5.0 GiB free, the workload needs 10.0"));
        assert_eq!(why[1], None);
        assert_eq!(
            why[2],
            Some("no device model yet, and it already holds a workload")
        );
        assert!(
            pl.reason.contains("2 excluded by constraints"),
            "{}",
            pl.reason
        );
    }

    #[test]
    fn a_new_datastore_attracts_a_new_workload_and_says_it_has_no_model() {
        let p = pod(
            vec![ds("old", Some(1.0)), ds("new", None)],
            vec![wl("w", "old", 10.0, 10.0)],
        );
        let pl = place(&p, &new_wl("n", 4.0)).unwrap();
        assert_eq!(pl.datastore, "new");
        assert!(pl.reason.contains("no device model yet"), "{}", pl.reason);
    }

    #[test]
    fn plans_are_deterministic() {
        let p = pod(
            vec![ds("a", Some(1.0)), ds("b", Some(2.0)), ds("c", Some(0.7))],
            (0..12)
                .map(|i| wl(&format!("w{i}"), "a", 1.0 + f64::from(i % 5), 5.0))
                .collect(),
        );
        let one = plan(&p, &[], &Policy::default()).unwrap();
        let two = plan(&p, &[], &Policy::default()).unwrap();
        assert_eq!(one, two);
        assert!(!one.moves.is_empty());
    }

    // ---- Properties: replay every plan against an independent model of the rules. ----

    const CLASSES: [&str; 2] = ["gold", "silver"];

    fn arb_pod() -> impl Strategy<Value = (Pod, Vec<RecentMove>, Policy)> {
        let datastores = proptest::collection::vec(
            (
                prop_oneof![1 => Just(None), 4 => (0.2f64..5.0).prop_map(Some)],
                prop_oneof![2 => Just(None), 1 => (0usize..2).prop_map(Some)],
                0.0f64..60.0,
            ),
            2..6,
        );
        let workloads = proptest::collection::vec(
            (
                0usize..6,
                prop_oneof![1 => Just(0.0), 9 => 0.1f64..100.0],
                1.0f64..40.0,
                0.0f64..1000.0,
                prop_oneof![3 => Just(None), 1 => (0usize..2).prop_map(Some)],
                proptest::collection::vec(0usize..6, 0..3),
                proptest::collection::vec(0usize..14, 0..2),
                any::<bool>(),
            ),
            0..14,
        );
        let policy = (0.0f64..0.3, 1usize..8, 0.0f64..0.05).prop_map(|(t, m, g)| Policy {
            imbalance_threshold: t,
            max_moves: m,
            min_imbalance_gain: g,
        });
        (
            datastores,
            workloads,
            policy,
            proptest::collection::vec((0usize..14, 0usize..6), 0..4),
        )
            .prop_map(|(dss, wls, policy, recent)| {
                let nd = dss.len();
                let mut p = Pod::default();
                for (j, (perf, class, _)) in dss.iter().enumerate() {
                    p.datastores.push(Datastore {
                        id: format!("d{j}"),
                        capacity_gib: 0.0,
                        used_gib: 0.0,
                        reliability: class.map(|c| CLASSES[c].to_string()),
                        performance: *perf,
                    });
                }
                let nw = wls.len();
                for (i, (on, load, size, iops, class, aff, anti, use_aff)) in
                    wls.into_iter().enumerate()
                {
                    p.workloads.push(Workload {
                        id: format!("w{i}"),
                        datastore: format!("d{}", on % nd),
                        load,
                        size_gib: size,
                        iops,
                        reliability: class.map(|c| CLASSES[c].to_string()),
                        affinity: if use_aff {
                            aff.iter().map(|a| format!("d{}", a % nd)).collect()
                        } else {
                            Vec::new()
                        },
                        anti_affinity: anti
                            .iter()
                            .filter(|&&a| a < nw && a != i)
                            .map(|a| format!("w{a}"))
                            .collect(),
                    });
                }
                // Capacity: what is there now plus some headroom.
                for (j, (_, _, headroom)) in dss.iter().enumerate() {
                    let used: f64 = p
                        .workloads
                        .iter()
                        .filter(|w| w.datastore == format!("d{j}"))
                        .map(|w| w.size_gib)
                        .sum();
                    p.datastores[j].used_gib = used;
                    p.datastores[j].capacity_gib = used + headroom;
                }
                let recent = recent
                    .into_iter()
                    .filter(|(w, _)| *w < nw)
                    .map(|(w, d)| RecentMove {
                        workload: format!("w{w}"),
                        from: format!("d{}", d % nd),
                    })
                    .collect();
                (p, recent, policy)
            })
    }

    /// `f` of a pod with workloads at `at`, computed from scratch.
    fn f_of(p: &Pod, at: &[usize]) -> f64 {
        let known: Vec<f64> = p.datastores.iter().filter_map(|d| d.performance).collect();
        let prov = stats::median(&known).unwrap_or(1.0);
        let n: Vec<f64> = p
            .datastores
            .iter()
            .enumerate()
            .map(|(j, d)| {
                let l: f64 = p
                    .workloads
                    .iter()
                    .zip(at)
                    .filter(|(_, &a)| a == j)
                    .map(|(w, _)| w.load)
                    .sum();
                l / d.performance.unwrap_or(prov)
            })
            .collect();
        imbalance(&n)
    }

    fn idx(p: &Pod, id: &str) -> usize {
        p.datastores.iter().position(|d| d.id == id).unwrap()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]

        /// Every move lowers f, and no move breaks a hard rule or a soft one.
        #[test]
        fn every_move_lowers_imbalance_and_breaks_no_rule((p, recent, policy) in arb_pod()) {
            let plan = plan(&p, &recent, &policy).unwrap();
            let mut at: Vec<usize> = p.workloads.iter().map(|w| idx(&p, &w.datastore)).collect();
            let mut used: Vec<f64> = p.datastores.iter().map(|d| d.used_gib).collect();
            let mut f = f_of(&p, &at);
            prop_assert!((f - plan.imbalance_before).abs() < 1e-9);
            prop_assert!(plan.moves.len() <= policy.max_moves);
            let mut seen = std::collections::HashSet::new();
            let mut received_unmodeled = std::collections::HashSet::new();
            for m in &plan.moves {
                let w = p.workloads.iter().position(|x| x.id == m.workload).unwrap();
                let wl = &p.workloads[w];
                let (x, y) = (idx(&p, &m.from), idx(&p, &m.to));
                let d = &p.datastores[y];
                prop_assert_eq!(at[w], x, "moved from where it is not");
                prop_assert!(x != y);
                prop_assert!(seen.insert(w), "moved twice");
                prop_assert!(p.datastores[x].performance.is_some(), "moved off a datastore without a model");
                // Hard constraints.
                prop_assert!(used[y] + wl.size_gib <= d.capacity_gib + 1e-9, "over capacity");
                if let Some(r) = &wl.reliability {
                    prop_assert_eq!(d.reliability.as_ref(), Some(r), "wrong reliability class");
                }
                prop_assert!(wl.affinity.is_empty() || wl.affinity.contains(&d.id), "affinity");
                for (o, other) in p.workloads.iter().enumerate() {
                    if at[o] == y {
                        prop_assert!(!wl.anti_affinity.contains(&other.id)
                            && !other.anti_affinity.contains(&wl.id), "anti-affinity");
                    }
                }
                // Soft ones.
                prop_assert!(!recent.iter().any(|r| r.workload == wl.id && r.from == d.id), "ping-pong");
                if d.performance.is_none() {
                    prop_assert!(at.iter().all(|&a| a != y), "second workload on an unmodeled datastore");
                    prop_assert!(received_unmodeled.insert(y));
                }
                used[x] -= wl.size_gib;
                used[y] += wl.size_gib;
                at[w] = y;
                let f2 = f_of(&p, &at);
                prop_assert!(f2 < f, "move {:?} raised f from {} to {}", m, f, f2);
                prop_assert!((f2 - m.imbalance_after).abs() < 1e-9);
                f = f2;
            }
            prop_assert!((f - plan.imbalance_after).abs() < 1e-9);
            match plan.stop {
                Stop::Balanced => prop_assert!(f <= policy.imbalance_threshold),
                Stop::MoveCap => prop_assert_eq!(plan.moves.len(), policy.max_moves),
                Stop::NoImprovingMove => prop_assert!(f > policy.imbalance_threshold),
            }
            if plan.imbalance_before <= policy.imbalance_threshold {
                prop_assert!(plan.moves.is_empty());
            }
            for (a, d) in plan.after.iter().zip(&p.datastores) {
                let j = idx(&p, &d.id);
                prop_assert_eq!(a.workloads, at.iter().filter(|&&x| x == j).count());
            }
        }

        /// Placement picks an eligible datastore with the lowest N after adding, or none is
        /// eligible.
        #[test]
        fn placement_is_eligible_and_minimal(
            (p, _, _) in arb_pod(), load in 0.0f64..100.0, size in 1.0f64..40.0,
            class in prop_oneof![Just(None), (0usize..2).prop_map(Some)],
            anti in proptest::collection::vec(0usize..14, 0..3),
        ) {
            let new = NewWorkload {
                id: "new".into(),
                load,
                size_gib: size,
                reliability: class.map(|c| CLASSES[c].to_string()),
                affinity: Vec::new(),
                anti_affinity: anti.iter().map(|a| format!("w{a}")).collect(),
            };
            let known: Vec<f64> = p.datastores.iter().filter_map(|d| d.performance).collect();
            let prov = stats::median(&known).unwrap_or(1.0);
            let eligible: Vec<(usize, f64)> = p.datastores.iter().enumerate().filter(|(_, d)| {
                let here: Vec<&Workload> = p.workloads.iter().filter(|w| w.datastore == d.id).collect();
                new.reliability.as_ref().is_none_or(|r| d.reliability.as_ref() == Some(r))
                    && d.capacity_gib - d.used_gib >= size
                    && !here.iter().any(|w| new.anti_affinity.contains(&w.id))
                    && (d.performance.is_some() || here.is_empty())
            }).map(|(j, d)| {
                let l: f64 = p.workloads.iter().filter(|w| w.datastore == d.id).map(|w| w.load).sum();
                (j, (l + load) / d.performance.unwrap_or(prov))
            }).collect();
            match place(&p, &new) {
                Ok(pl) => {
                    let j = idx(&p, &pl.datastore);
                    let mine = eligible.iter().find(|e| e.0 == j);
                    prop_assert!(mine.is_some(), "chose an ineligible datastore");
                    let min = eligible.iter().map(|e| e.1).fold(f64::INFINITY, f64::min);
                    prop_assert!(mine.unwrap().1 <= min + 1e-12);
                    prop_assert!(pl.reason.contains(&pl.datastore));
                }
                Err(PlacementError::NoEligibleDatastore { .. }) => prop_assert!(eligible.is_empty()),
                Err(e) => prop_assert!(false, "unexpected error {}", e),
            }
        }
    }
}
