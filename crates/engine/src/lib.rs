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
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::Notify;
use uuid::Uuid;

pub mod flow;
pub mod window;

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
    /// The volume is being deleted: it takes no more IO.
    #[error("volume is being deleted")]
    Revoked,
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
    /// Set once, by [`Volume::revoke`]; no IO starts afterwards.
    revoked: AtomicBool,
    /// IOs between [`Volume::enter`] and the end of their datastore IO.
    in_flight: AtomicU64,
    drained: Notify,
}

/// One IO inside the volume; dropping it lets a revocation know when the last one is done.
struct InFlight<'a>(&'a Volume);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if self.0.in_flight.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.drained.notify_waiters();
        }
    }
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
            revoked: AtomicBool::new(false),
            in_flight: AtomicU64::new(0),
            drained: Notify::new(),
        }
    }

    /// Admits one IO, unless the volume is revoked. The count goes up before the flag is read
    /// and [`Volume::revoke`] sets the flag before it reads the count (both sequentially
    /// consistent), so an IO either sees the revocation or is waited for by it.
    fn enter(&self) -> Result<InFlight<'_>> {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        let guard = InFlight(self);
        if self.revoked.load(Ordering::SeqCst) {
            return Err(Error::Revoked);
        }
        Ok(guard)
    }

    /// Stops the volume taking IO, and waits up to `limit` for the IOs already issued to its
    /// datastore to finish. Only when this returns true may the volume's storage be freed: an
    /// IO still in flight could otherwise land in whatever is allocated there next.
    pub async fn revoke(&self, limit: Duration) -> bool {
        self.revoked.store(true, Ordering::SeqCst);
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let drained = self.drained.notified();
            tokio::pin!(drained);
            drained.as_mut().enable();
            if self.in_flight.load(Ordering::SeqCst) == 0 {
                return true;
            }
            if tokio::time::timeout_at(deadline, drained).await.is_err() {
                return self.in_flight.load(Ordering::SeqCst) == 0;
            }
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
        let _in = self.enter()?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    use async_trait::async_trait;
    use datastore::device::Device;
    use datastore::Gate;

    /// A device whose writes wait until the test lets them go.
    struct Held {
        release: Arc<Notify>,
        writes: AtomicU64,
    }

    #[async_trait]
    impl Device for Held {
        fn size(&self) -> u64 {
            1 << 20
        }
        fn describe(&self) -> String {
            "held".into()
        }
        async fn read_at(&self, _: u64, len: usize) -> io::Result<Bytes> {
            Ok(Bytes::from(vec![0; len]))
        }
        async fn write_at(&self, _: u64, _: Bytes, _: bool) -> io::Result<()> {
            self.release.notified().await;
            self.writes.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
        async fn flush(&self) -> io::Result<()> {
            Ok(())
        }
        async fn trim(&self, _: u64, _: u64) -> io::Result<()> {
            Ok(())
        }
        async fn write_zeroes(&self, _: u64, _: u64, _: bool) -> io::Result<()> {
            Ok(())
        }
    }

    #[tokio::test]
    async fn revoke_waits_for_in_flight_io_and_refuses_new_io() {
        let dev = Arc::new(Held {
            release: Arc::new(Notify::new()),
            writes: AtomicU64::new(0),
        });
        let extent = Extent::new(dev.clone(), 0, 1 << 20, Arc::new(Gate::new(4)));
        let v = Arc::new(Volume::new(
            Uuid::nil(),
            "v".into(),
            Policy::Uncached,
            extent,
        ));
        let w = {
            let v = v.clone();
            tokio::spawn(async move { v.write(0, Bytes::from(vec![1; 512]), false).await })
        };
        while v.in_flight.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        // The write is held at the device: a revocation must not report the volume drained.
        assert!(!v.revoke(Duration::from_millis(50)).await);
        assert!(matches!(v.read(0, 512).await, Err(Error::Revoked)));
        dev.release.notify_waiters();
        assert!(v.revoke(Duration::from_secs(5)).await);
        w.await.unwrap().unwrap();
        assert_eq!(dev.writes.load(Ordering::SeqCst), 1);
        assert!(matches!(
            v.write(0, Bytes::from(vec![1; 512]), false).await,
            Err(Error::Revoked)
        ));
        assert_eq!(dev.writes.load(Ordering::SeqCst), 1);
    }
}
