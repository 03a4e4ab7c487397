//! Volumes as NBD exports: the glue between the `nbd` server and the `engine`.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use tracing::warn;

use nbd::server::{CmdError, CmdResult, Export, ExportInfo, ExportSet};
use nbd::{Errno, Stop};

use crate::daemon::{Attachment, Daemon, VolumeEntry};
use engine::Volume;

pub struct Exports(pub Arc<Daemon>);

fn export_info(entry: &VolumeEntry, volume: &Volume) -> ExportInfo {
    ExportInfo {
        size: volume.size(),
        read_only: false,
        // All connections to a volume share one engine::Volume (see the engine's module doc).
        can_multi_conn: true,
        description: format!(
            "Vesta volume on datastore {}, policy {}",
            entry.record.datastore,
            entry.policy()
        ),
    }
}

impl ExportSet for Exports {
    type Export = Attachment;

    fn list(&self) -> Vec<(String, String)> {
        self.0
            .entries()
            .into_iter()
            .filter(|e| e.volume.is_ok())
            .map(|e| (e.record.name.clone(), String::new()))
            .collect()
    }

    fn info(&self, name: &str) -> Result<ExportInfo, String> {
        // The answer GO would give, without attaching: a delete or relocation running at that
        // moment must not find a client attached.
        let (entry, volume) = self.0.servable(name)?;
        Ok(export_info(&entry, &volume))
    }

    fn open(&self, name: &str) -> Result<(ExportInfo, Attachment), String> {
        let a = self.0.attach(name)?;
        Ok((export_info(&a.entry, &a.volume), a))
    }

    fn on_connection_thread<R>(&self, alone: bool, f: impl FnOnce() -> R) -> R {
        // Connection threads exist to block: file IO runs inline there (datastore::device).
        datastore::device::may_block_here(alone, f)
    }
}

/// Failed IOs logged per second, over every volume; the rest are counted, and the count is
/// logged with the next one logged. A guest retrying against a failed or shut-out datastore
/// fails thousands of IOs a second, which would drown everything else in the log.
const FAILURES_LOGGED_PER_S: u64 = 10;

/// Decides which failed IOs are logged ([`FAILURES_LOGGED_PER_S`]). Pure bookkeeping over the
/// second it is told, so tests need no clock.
#[derive(Default)]
struct FailureLog {
    /// The second the counts are for.
    second: AtomicU64,
    /// Failures logged in it.
    logged: AtomicU64,
    /// Failures not logged since the last one that was.
    quiet: AtomicU64,
}

impl FailureLog {
    /// Whether a failure in second `now` is logged; if so, with how many went unlogged before
    /// it. Races between threads may log a few more or fewer; none is lost from the count
    /// except those racing a change of second.
    fn admit(&self, now: u64) -> Option<u64> {
        if self.second.swap(now, Ordering::AcqRel) != now {
            self.logged.store(0, Ordering::Release);
        }
        if self.logged.fetch_add(1, Ordering::AcqRel) < FAILURES_LOGGED_PER_S {
            Some(self.quiet.swap(0, Ordering::AcqRel))
        } else {
            self.quiet.fetch_add(1, Ordering::AcqRel);
            None
        }
    }
}

static FAILURES: FailureLog = FailureLog {
    second: AtomicU64::new(0),
    logged: AtomicU64::new(0),
    quiet: AtomicU64::new(0),
};

/// Maps an engine error to the errno the client sees, logging it here where it is handled
/// (at most [`FAILURES_LOGGED_PER_S`] a second).
fn to_cmd(name: &str, what: &str, e: engine::Error) -> CmdError {
    let errno = match &e {
        engine::Error::Invalid(_) => Errno::EINVAL,
        // ESHUTDOWN tells the client to disconnect.
        engine::Error::Revoked | engine::Error::Stopping => Errno::ESHUTDOWN,
        engine::Error::Cache(_) | engine::Error::NoRoom => Errno::EIO,
        engine::Error::Datastore(io) => errno_of(io),
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    match FAILURES.admit(now) {
        Some(0) => warn!("volume {name:?}: {what} failed: {e}"),
        Some(quiet) => {
            warn!("volume {name:?}: {what} failed: {e} ({quiet} more failed IOs were not logged)")
        }
        None => {}
    }
    CmdError::new(errno, e.to_string())
}

fn errno_of(e: &io::Error) -> Errno {
    match e.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) | Some(libc::EFBIG) => Errno::ENOSPC,
        Some(libc::EPERM) | Some(libc::EROFS) | Some(libc::EACCES) => Errno::EPERM,
        Some(libc::EINVAL) => Errno::EINVAL,
        // Not ESHUTDOWN, which an NBD datastore answers while *it* shuts down: passed on, it
        // would tell the VM's client that this server is going away and to disconnect.
        _ => Errno::EIO,
    }
}

impl Export for Attachment {
    async fn read(&self, offset: u64, len: u32) -> CmdResult<Bytes> {
        self.volume
            .read(offset, len)
            .await
            .map_err(|e| to_cmd(self.volume.name(), "READ", e))
    }

    async fn write(&self, offset: u64, data: Bytes, fua: bool) -> CmdResult<()> {
        self.volume
            .write(offset, data, fua)
            .await
            .map_err(|e| to_cmd(self.volume.name(), "WRITE", e))
    }

    async fn flush(&self) -> CmdResult<()> {
        self.volume
            .flush()
            .await
            .map_err(|e| to_cmd(self.volume.name(), "FLUSH", e))
    }

    async fn trim(&self, offset: u64, len: u32, fua: bool) -> CmdResult<()> {
        self.volume
            .trim(offset, u64::from(len), fua)
            .await
            .map_err(|e| to_cmd(self.volume.name(), "TRIM", e))
    }

    async fn write_zeroes(
        &self,
        offset: u64,
        len: u32,
        may_trim: bool,
        fua: bool,
    ) -> CmdResult<()> {
        self.volume
            .write_zeroes(offset, u64::from(len), may_trim, fua)
            .await
            .map_err(|e| to_cmd(self.volume.name(), "WRITE_ZEROES", e))
    }

    fn stop_signal(&self) -> Stop {
        self.entry.stop.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_ios_are_logged_ten_a_second_and_the_rest_counted() {
        let log = FailureLog::default();
        let logged: Vec<Option<u64>> = (0..25).map(|_| log.admit(100)).collect();
        assert_eq!(logged[..10], [Some(0); 10]);
        assert!(logged[10..].iter().all(Option::is_none));
        // The next second logs again, first saying how many went unlogged.
        assert_eq!(log.admit(101), Some(15));
        assert_eq!(log.admit(101), Some(0));
        for _ in 0..8 {
            log.admit(101);
        }
        assert_eq!(log.admit(101), None);
        assert_eq!(log.admit(105), Some(1));
    }

    /// Only vestad's own stop answers a client ESHUTDOWN; a datastore shutting down is an
    /// IO error of this server's.
    #[test]
    fn a_datastore_shutting_down_is_an_io_error_to_the_client() {
        let e = |errno| engine::Error::Datastore(io::Error::from_raw_os_error(errno));
        assert_eq!(to_cmd("v", "WRITE", e(libc::ESHUTDOWN)).errno, Errno::EIO);
        assert_eq!(to_cmd("v", "WRITE", e(libc::ENOSPC)).errno, Errno::ENOSPC);
        assert_eq!(
            to_cmd("v", "WRITE", engine::Error::Stopping).errno,
            Errno::ESHUTDOWN
        );
    }
}
