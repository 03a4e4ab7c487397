//! The per-volume IO path (DESIGN §3).
//!
//! Every IO of a volume, from every NBD connection, goes through one [`Volume`]. That single
//! object is the seam where policies plug in: today `uncached` passes IO straight to the
//! volume's datastore extent; the cache log, gatekeeper, destager and flow control will sit
//! here too, so the NBD server and the admin API never change when they arrive.
//!
//! Because all connections share the one object and the extent underneath has no per-connection
//! state, a FLUSH on any connection covers writes completed on every connection, which is what
//! lets the server advertise `NBD_FLAG_CAN_MULTI_CONN`.

use std::io;

use bytes::Bytes;
use uuid::Uuid;

use cluster::Policy;
use datastore::stats::{IoStats, Op};
use datastore::Extent;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The datastore failed the IO; the errno (if any) is kept for the client.
    #[error("datastore IO failed: {0}")]
    Datastore(#[source] io::Error),
    /// The caller broke the volume's contract (a range outside it, a misaligned IO).
    #[error("invalid request: {0}")]
    Invalid(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Every offset and length is a multiple of this.
pub const SECTOR: u64 = 512;

pub struct Volume {
    id: Uuid,
    name: String,
    size: u64,
    policy: Policy,
    store: Extent,
    stats: IoStats,
}

impl Volume {
    pub fn new(id: Uuid, name: String, policy: Policy, store: Extent) -> Volume {
        Volume {
            id,
            name,
            size: store.size(),
            policy,
            store,
            stats: IoStats::default(),
        }
    }

    pub fn id(&self) -> Uuid {
        self.id
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// IO as the volume's clients see it, end to end.
    pub fn stats(&self) -> &IoStats {
        &self.stats
    }

    /// The IO contract, checked again here although the NBD layer already did: the engine
    /// never trusts its callers with a write outside the volume.
    fn check(&self, offset: u64, len: u64) -> Result<()> {
        let in_range = offset.checked_add(len).is_some_and(|end| end <= self.size);
        if !in_range || !offset.is_multiple_of(SECTOR) || !len.is_multiple_of(SECTOR) {
            return Err(Error::Invalid(format!(
                "volume {:?}: range {offset}+{len} is misaligned or outside {} bytes",
                self.name, self.size
            )));
        }
        Ok(())
    }

    async fn measured<T>(
        &self,
        op: Op,
        bytes: u64,
        io: impl std::future::Future<Output = io::Result<T>>,
    ) -> Result<T> {
        let t = self.stats.start();
        let r = io.await;
        self.stats.finish(t, op, bytes, r.is_ok());
        r.map_err(Error::Datastore)
    }

    pub async fn read(&self, offset: u64, len: u32) -> Result<Bytes> {
        self.check(offset, u64::from(len))?;
        match self.policy {
            Policy::Uncached => {
                self.measured(
                    Op::Read,
                    u64::from(len),
                    self.store.read(offset, len as usize),
                )
                .await
            }
        }
    }

    pub async fn write(&self, offset: u64, data: Bytes, fua: bool) -> Result<()> {
        let n = data.len() as u64;
        self.check(offset, n)?;
        match self.policy {
            Policy::Uncached => {
                self.measured(Op::Write, n, self.store.write(offset, data, fua))
                    .await
            }
        }
    }

    /// Makes every completed write durable on stable media.
    pub async fn flush(&self) -> Result<()> {
        match self.policy {
            Policy::Uncached => self.measured(Op::Flush, 0, self.store.flush()).await,
        }
    }

    pub async fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.check(offset, len)?;
        match self.policy {
            Policy::Uncached => {
                self.measured(Op::Trim, 0, async {
                    self.store.trim(offset, len).await?;
                    if fua {
                        self.store.flush().await?;
                    }
                    Ok(())
                })
                .await
            }
        }
    }

    pub async fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        may_trim: bool,
        fua: bool,
    ) -> Result<()> {
        self.check(offset, len)?;
        match self.policy {
            Policy::Uncached => {
                self.measured(Op::WriteZeroes, 0, async {
                    self.store.write_zeroes(offset, len, may_trim).await?;
                    if fua {
                        self.store.flush().await?;
                    }
                    Ok(())
                })
                .await
            }
        }
    }
}
