//! Balancing (BASIL, FAST'10; DESIGN §8), pure: models of workloads and datastores built from
//! statistics every host already has, the normalized load they give each datastore, a planner
//! that proposes migrations to even it out, initial placement, and a simulator that reproduces
//! the paper's evaluation.
//!
//! BASIL's insight is to split "how loaded is this datastore" into two models that can be
//! learned online and separately, because IO latency is close to linear in each of their
//! inputs:
//!
//! - a **workload** puts load `L = (K1+OIO)(K2+size)(K3+read)(K4+random)` on any datastore,
//!   from its outstanding IOs, IO size, read and random shares at their 90th percentile
//!   ([`workload`]);
//! - a **datastore** can take load in proportion to `P = 1/slope` of its read latency against
//!   outstanding reads ([`device`]);
//! - a datastore's **normalized load** is `N = ΣL / P`, and the pod's **imbalance** is
//!   `f = σ(N) / mean(N)` ([`plan`]).
//!
//! The planner ([`plan::plan`]) moves sets of workloads from the most to the least loaded
//! datastore while that lowers `f`, within hard constraints (capacity, affinity,
//! anti-affinity, reliability class) and soft ones (no ping-pong, a cap on moves).
//! Initial placement ([`plan::place`]) picks the eligible datastore with the lowest `N`.
//! The simulator ([`sim`]) runs the paper's §6.4 and §6.5 experiments on modeled spindles.
//!
//! # For the daemon and the CLI
//!
//! Per interval and volume, collect a [`workload::Characteristics`]; per interval and
//! datastore, one [`device::DeviceSample`] per host, combined by [`device::aggregate`]. Then:
//! [`workload::characterize`] and [`workload::Constants::load`] give each volume's `L`,
//! [`device::model`] each datastore's `P` (or none yet); fill a [`plan::Pod`] and call
//! [`plan::plan`] or [`plan::place`]. Everything is `serde`-serializable for `--json`.
//!
//! Nothing here does IO, reads a clock or keeps global state: the same input gives the same
//! output, which is what lets the planner be property-tested and the paper's 500
//! configurations run in a second or two. (The `basil-sim` binary writes its CSV files; the
//! library does not.)

pub mod device;
pub mod plan;
pub mod rng;
pub mod sim;
pub mod stats;
pub mod workload;

pub use device::{DeviceModel, DeviceSample};
pub use plan::{
    imbalance, normalized_load, place, plan, Datastore, Move, NewWorkload, Placement, Plan, Pod,
    Policy, RecentMove, Workload,
};
pub use workload::{Characteristics, Constants};
