//! The cache log (DESIGN §3): the host's cache device as an append-only log of records.
//!
//! - [`format`]: superblock, segment and record headers (pure codec).
//! - [`device`]: the [`device::CacheDevice`] trait, the file implementation, and a simulated
//!   device that fails, tears writes and loses power, for tests.
//! - [`index`]: the extent map behind the in-memory index (pure).

pub mod device;
pub mod format;
pub mod index;
