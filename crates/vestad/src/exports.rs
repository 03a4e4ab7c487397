//! Volumes as NBD exports: the glue between the `nbd` server and the `engine`.

use std::io;
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

/// Maps an engine error to the errno the client sees, logging it once here where it is handled.
fn to_cmd(name: &str, what: &str, e: engine::Error) -> CmdError {
    let errno = match &e {
        engine::Error::Invalid(_) => Errno::EINVAL,
        // ESHUTDOWN tells the client to disconnect.
        engine::Error::Revoked | engine::Error::Stopping => Errno::ESHUTDOWN,
        engine::Error::Cache(_) | engine::Error::NoRoom => Errno::EIO,
        engine::Error::Datastore(io) => errno_of(io),
    };
    warn!("volume {name:?}: {what} failed: {e}");
    CmdError::new(errno, e.to_string())
}

fn errno_of(e: &io::Error) -> Errno {
    match e.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) | Some(libc::EFBIG) => Errno::ENOSPC,
        Some(libc::EPERM) | Some(libc::EROFS) | Some(libc::EACCES) => Errno::EPERM,
        Some(libc::EINVAL) => Errno::EINVAL,
        Some(libc::ESHUTDOWN) => Errno::ESHUTDOWN,
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
