//! Self-fencing (DESIGN §4): a host that cannot renew its lease stops writing datastores
//! before the lease can expire, so no contender that acquires a volume's vault lock after the
//! expiry ever races a late write from this host.
//!
//! A [`Fence`] holds a deadline. The coordinator moves it forward after every successful lease
//! renewal, to a point safely before the lease could expire (measured from when the renewal was
//! *sent*, so a slow answer never stretches it). Every mutating IO checks it at the [`crate::Gate`]
//! before it is issued; past the deadline it fails with [`FENCED`] and issues nothing. So does a
//! volume's read ([`READS_FENCED`]): it harms no contender, but a contender's replay may be
//! setting the volume's blocks back to older versions for a while, and the read would hand one
//! to a client that saw a newer write complete. (A LUN's label check reads the device itself.)

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// The error text of an IO refused by a closed fence; the destager treats it like any
/// datastore write error (retry with backoff, reported as stalled).
pub const FENCED: &str = "datastore writes are fenced: this host's cluster lease is not \
                           renewed, or (a LUN) no recent read of its label confirmed that this \
                           pod still owns it";

/// The error text of a volume read refused by a closed fence.
pub const READS_FENCED: &str = "datastore reads are fenced: this host's cluster lease is not \
                                renewed (another host may be replaying the volume), or (a LUN) \
                                no recent read of its label confirmed that this pod still owns it";

/// Deadline for datastore writes. Starts open without limit (a single host with no lease);
/// a coordinator with leases closes it and then keeps extending it.
pub struct Fence {
    /// Nanoseconds after [`epoch`] until which writes may be issued; `u64::MAX` = no limit.
    until_ns: AtomicU64,
    /// Closed for good ([`Fence::revoke`]).
    revoked: AtomicBool,
    /// How many times it was closed ([`Fence::closes`]).
    closes: AtomicU64,
    /// A fence this one also waits on ([`Fence::set_parent`]).
    parent: OnceLock<Arc<Fence>>,
}

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn nanos(at: Instant) -> u64 {
    at.saturating_duration_since(epoch()).as_nanos() as u64
}

impl Default for Fence {
    fn default() -> Fence {
        Fence::open()
    }
}

impl Fence {
    /// A fence that never closes.
    pub fn open() -> Fence {
        Fence {
            until_ns: AtomicU64::new(u64::MAX),
            revoked: AtomicBool::new(false),
            closes: AtomicU64::new(0),
            parent: OnceLock::new(),
        }
    }

    /// A fence closed until the first [`Fence::extend_to`].
    pub fn closed() -> Fence {
        Fence {
            until_ns: AtomicU64::new(0),
            revoked: AtomicBool::new(false),
            closes: AtomicU64::new(0),
            parent: OnceLock::new(),
        }
    }

    /// Makes this fence closed whenever `parent` is too: a datastore's own fence (its owner
    /// check, [`crate::lun`]) under the host's (its lease). Set once; a second call keeps the
    /// first parent.
    pub fn set_parent(&self, parent: Arc<Fence>) {
        let _ = self.parent.set(parent);
    }

    /// Allows writes until `at`. Never moves the deadline backwards: renewals answered out of
    /// order cannot shorten it, and only [`Fence::close`] revokes it.
    pub fn extend_to(&self, at: Instant) {
        if self.revoked.load(Ordering::Acquire) {
            return;
        }
        self.until_ns.fetch_max(nanos(at), Ordering::AcqRel);
        // A revoke that raced the extension wins.
        if self.revoked.load(Ordering::Acquire) {
            self.close();
        }
    }

    /// Stops writes now (the lease is known to be lost).
    pub fn close(&self) {
        self.closes.fetch_add(1, Ordering::AcqRel);
        self.until_ns.store(0, Ordering::Release);
    }

    /// How many times the fence was closed (the lease lost), its parent's closes included.
    /// What is bound to the lease (a datastore's metadata lock) is gone after a close, though
    /// the fence opens again once the host registers with a new lease: an operation that
    /// holds such a thing notes this first and writes only while it is unchanged.
    pub fn closes(&self) -> u64 {
        self.closes.load(Ordering::Acquire) + self.parent.get().map_or(0, |p| p.closes())
    }

    /// Stops writes for good: no later [`Fence::extend_to`] opens it again (the host lost a
    /// vault lock to another host and must not write until it restarts).
    pub fn revoke(&self) {
        self.revoked.store(true, Ordering::Release);
        self.close();
    }

    /// Whether [`Fence::revoke`] closed it (not its parent) for good.
    pub fn is_revoked(&self) -> bool {
        self.revoked.load(Ordering::Acquire)
    }

    /// Whether a write may be issued now: this fence and its parent both allow it.
    pub fn allows_writes(&self) -> bool {
        let until = self.until_ns.load(Ordering::Acquire);
        (until == u64::MAX || nanos(Instant::now()) < until)
            && self.parent.get().is_none_or(|p| p.allows_writes())
    }

    /// How long writes stay allowed from now, by this fence and its parent; `None` if both
    /// are open.
    pub fn remaining(&self) -> Option<Duration> {
        let own = match self.until_ns.load(Ordering::Acquire) {
            u64::MAX => None,
            until => Some(Duration::from_nanos(
                until.saturating_sub(nanos(Instant::now())),
            )),
        };
        match (own, self.parent.get().and_then(|p| p.remaining())) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_fence_always_allows() {
        let f = Fence::open();
        assert!(f.allows_writes());
        assert_eq!(f.remaining(), None);
    }

    #[test]
    fn closed_fence_opens_only_until_its_deadline() {
        let f = Fence::closed();
        assert!(!f.allows_writes());
        f.extend_to(Instant::now() + Duration::from_millis(50));
        assert!(f.allows_writes());
        // An older renewal answered late does not shorten the deadline.
        f.extend_to(Instant::now());
        assert!(f.allows_writes());
        std::thread::sleep(Duration::from_millis(60));
        assert!(!f.allows_writes());
        f.extend_to(Instant::now() + Duration::from_secs(10));
        assert!(f.allows_writes());
        f.close();
        assert!(!f.allows_writes());
        assert_eq!(f.remaining(), Some(Duration::ZERO));
    }

    #[test]
    fn each_close_is_counted_though_the_fence_opens_again() {
        let f = Fence::closed();
        let before = f.closes();
        f.extend_to(Instant::now() + Duration::from_secs(10));
        assert_eq!(f.closes(), before, "opening is not a close");
        f.close();
        f.extend_to(Instant::now() + Duration::from_secs(10));
        assert!(f.allows_writes());
        assert_eq!(f.closes(), before + 1);
    }

    #[test]
    fn a_fence_under_a_parent_allows_writes_only_when_both_do() {
        let host = Arc::new(Fence::closed());
        let own = Fence::closed();
        own.set_parent(host.clone());
        own.extend_to(Instant::now() + Duration::from_secs(10));
        assert!(!own.allows_writes(), "the parent is closed");
        host.extend_to(Instant::now() + Duration::from_secs(5));
        assert!(own.allows_writes());
        let left = own.remaining().unwrap();
        assert!(left <= Duration::from_secs(5) && left > Duration::from_secs(4));
        let before = own.closes();
        host.close();
        assert!(!own.allows_writes());
        assert_eq!(own.closes(), before + 1, "a parent's close is counted");
        host.extend_to(Instant::now() + Duration::from_secs(10));
        own.revoke();
        assert!(!own.allows_writes());
        assert!(
            host.allows_writes() && !host.is_revoked(),
            "a child's revoke stays its own"
        );
    }

    #[test]
    fn a_revoked_fence_stays_closed_whatever_renewals_say() {
        let f = Fence::closed();
        f.extend_to(Instant::now() + Duration::from_secs(10));
        assert!(!f.is_revoked());
        f.revoke();
        assert!(f.is_revoked());
        assert!(!f.allows_writes());
        f.extend_to(Instant::now() + Duration::from_secs(10));
        assert!(!f.allows_writes(), "a renewal opened a revoked fence");
    }
}
