//! The cache log (DESIGN §3): the host's cache device as an append-only log of records.
//!
//! - [`format`]: superblock, segment and record headers (pure codec).
//! - [`device`]: the [`device::CacheDevice`] trait, the file implementation, and a simulated
//!   device that fails, tears writes and loses power, for tests.
//! - [`index`]: the extent map behind the in-memory index (pure).
//! - [`log`]: append, verified read, group commit, segment reclaim, recovery scan.

pub mod device;
pub mod format;
pub mod index;
pub mod log;

pub use device::{CacheDevice, Faulty, FileCache, SimDevice};
pub use log::{Entry, Expect, Loc, Log, LogError, OwnerMeta, Scanned};
