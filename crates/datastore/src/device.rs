//! Byte-addressed storage targets: a file or block device, or an NBD export.
//!
//! [`Device`] is the seam where tests put a failing target and where every datastore kind gets
//! its bytes.
//!
//! # Where blocking file IO runs
//!
//! File IO blocks, and must never run on a reactor thread: a `pwrite` that stalls in page-cache
//! writeback would stall every task that thread serves. But handing each IO to a pool thread
//! and waking the reactor afterwards costs two thread hops, which more than doubles the
//! latency of a 4 KiB write (measured in `docs/BENCHMARKS.md`). So threads that exist to block —
//! the NBD server's per-connection threads — mark themselves with [`may_block_here`], and
//! [`blocking`] runs IO inline on such a thread and on the blocking pool everywhere else.
//!
//! Only plain reads and writes take that inline path, and a read only as far as the page
//! cache holds it ([`read_cached`]) while other requests of the connection are in flight or
//! queued: one that must wait for the disk then goes to the pool, so random reads of data not
//! in memory run in parallel, as the client sent them, instead of one at a time on the
//! connection thread. A request alone on its connection (QD1) waits for the disk inline: a
//! trip to the pool and back would only add to its latency. Operations that can take long — `fdatasync` (FLUSH,
//! FUA), zeroing, trimming — always go to the pool via [`on_pool`], so they never hold up the
//! requests queued behind them on a connection.

pub use cachelog::device::read_cached;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::fileio::FileIo;

use async_trait::async_trait;
use bytes::Bytes;

use crate::fence::Fence;
use nbd::client::{Client, ClientError};
use nbd::uri::NbdUri;

#[async_trait]
pub trait Device: Send + Sync + 'static {
    /// Usable bytes.
    fn size(&self) -> u64;
    /// Where the bytes are, for messages.
    fn describe(&self) -> String;
    async fn read_at(&self, offset: u64, len: usize) -> io::Result<Bytes>;
    async fn write_at(&self, offset: u64, data: Bytes, fua: bool) -> io::Result<()>;
    /// Makes every write the device answered durable. Writes it lost before (see
    /// [`Device::losses`]) are not reported here: each user of the device decides whether
    /// a loss concerns it ([`Extent::flush`](crate::Extent::flush), [`flush_since`]).
    async fn flush(&self) -> io::Result<()>;
    /// How many times written data the device answered for may have been lost so far (a
    /// connection to an NBD datastore that died, or whose FLUSH failed, with acknowledged,
    /// unflushed writes; a file's failed `fsync`, which the kernel reports once); it only
    /// grows, and is counted before any later [`Device::flush`] answers. Devices that never
    /// lose answered writes say 0.
    fn losses(&self) -> u64 {
        0
    }
    /// The host's fence, for a device whose writes can wait or run long after the gate let
    /// them in (a reconnect, a long zeroing done in pieces): it asks again before each piece.
    fn set_fence(&self, fence: Arc<Fence>) {
        let _ = fence;
    }
    /// Whether [`Device::set_fence`] gave this device a fence (for tests of the wiring).
    #[cfg(test)]
    fn fenced(&self) -> bool {
        false
    }
    /// A hint that the range is unused; it may read back as anything afterwards.
    async fn trim(&self, offset: u64, len: u64) -> io::Result<()>;
    /// The range reads back as zeroes afterwards; `may_trim` lets the device deallocate it.
    async fn write_zeroes(&self, offset: u64, len: u64, may_trim: bool) -> io::Result<()>;

    /// True if this device's writes are blocking calls that end in the page cache (buffered
    /// file IO): made one after another on one thread they cost less than made many at once,
    /// which costs a thread hop each and contends on the file's lock. The destager then
    /// sends a window's writes in batches ([`Device::write_batch`]).
    fn prefers_batches(&self) -> bool {
        false
    }

    /// Makes each write of `writes` in turn, stopping at the first that fails, and before
    /// any write once `fence` (the host's lease) stops allowing writes. Default: one
    /// [`Device::write_at`] or [`Device::write_zeroes`] after another.
    async fn write_batch(
        &self,
        writes: Vec<BatchWrite>,
        fence: Option<Arc<Fence>>,
    ) -> io::Result<()> {
        for w in writes {
            check_fence(&fence)?;
            match w.data {
                Some(d) => self.write_at(w.offset, d, false).await?,
                None => self.write_zeroes(w.offset, w.len, w.may_trim).await?,
            }
        }
        Ok(())
    }
}

fn check_fence(fence: &Option<Arc<Fence>>) -> io::Result<()> {
    match fence {
        Some(f) if !f.allows_writes() => Err(io::Error::other(crate::fence::FENCED)),
        _ => Ok(()),
    }
}

/// One write of a [`Device::write_batch`]: `len` bytes at `offset`, of `data`, or zeroes
/// (`None`), which may deallocate if `may_trim`.
#[derive(Clone, Debug)]
pub struct BatchWrite {
    pub offset: u64,
    pub len: u64,
    pub data: Option<Bytes>,
    pub may_trim: bool,
}

/// What blocking IO the current thread may run inline ([`may_block_here`]).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Inline {
    /// None: a reactor thread, or any other.
    No,
    /// Reads only as far as the page cache holds them, and plain writes.
    Cached,
    /// Any plain read or write, a read that waits for the disk too.
    Any,
}

thread_local! {
    static MAY_BLOCK: std::cell::Cell<Inline> = const { std::cell::Cell::new(Inline::No) };
}

#[cfg(test)]
thread_local! {
    /// Reads this thread made inline that could wait for the disk (tests tell by it where a
    /// read ran, whatever the timing).
    static INLINE_WAITS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Runs `f` with the current thread marked as one where blocking IO may run inline: plain
/// writes, and reads as far as the page cache holds them or, if `alone` (nothing else waits
/// for this thread: no other request of its connection is in flight or queued), reads that
/// wait for the disk too. Only threads that are not reactor threads may use this.
pub fn may_block_here<R>(alone: bool, f: impl FnOnce() -> R) -> R {
    struct Reset(Inline);
    impl Drop for Reset {
        fn drop(&mut self) {
            MAY_BLOCK.with(|m| m.set(self.0));
        }
    }
    let now = if alone { Inline::Any } else { Inline::Cached };
    let _reset = Reset(MAY_BLOCK.with(|m| m.replace(now)));
    f()
}

/// Runs slow blocking IO on the blocking pool, wherever it is called from.
pub async fn on_pool<T, F>(f: F) -> io::Result<T>
where
    F: FnOnce() -> io::Result<T> + Send + 'static,
    T: Send + 'static,
{
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r,
        Err(e) => Err(io::Error::other(format!("blocking IO task failed: {e}"))),
    }
}

/// What the current thread may run inline ([`may_block_here`]).
fn inline_here() -> Inline {
    MAY_BLOCK.with(|m| m.get())
}

/// Runs blocking IO: inline on a thread marked with [`may_block_here`], else on the blocking
/// pool.
pub async fn blocking<T, F>(f: F) -> io::Result<T>
where
    F: FnOnce() -> io::Result<T> + Send + 'static,
    T: Send + 'static,
{
    if inline_here() != Inline::No {
        return f();
    }
    on_pool(f).await
}

/// Runs a read that may wait for the disk: inline on a thread that may wait
/// ([`may_block_here`] with `alone`); on one that may only read what memory holds, inline if
/// `cached`, which must not wait, finds all of it there (`None` where it would have to wait)
/// and on the blocking pool if not; on the pool everywhere else.
pub async fn blocking_read<T, F>(
    cached: impl FnOnce() -> Option<io::Result<T>>,
    f: F,
) -> io::Result<T>
where
    F: FnOnce() -> io::Result<T> + Send + 'static,
    T: Send + 'static,
{
    match inline_here() {
        Inline::Any => f(),
        Inline::Cached => match cached() {
            Some(r) => r,
            None => on_pool(f).await,
        },
        Inline::No => on_pool(f).await,
    }
}

/// A regular file or a block device, through the page cache or with `O_DIRECT`
/// ([`crate::fileio`]).
pub struct FileDevice {
    file: Arc<FileIo>,
    size: u64,
    path: PathBuf,
    regular: bool,
    /// The host's fence, asked between the pieces of a long zeroing ([`Device::set_fence`]).
    fence: std::sync::OnceLock<Arc<Fence>>,
    /// Set once [`read_cached`] turned out unsupported here: reads then run inline whole, as
    /// they did before it.
    no_cached_reads: std::sync::atomic::AtomicBool,
    /// Flushes that failed ([`Device::losses`]): the kernel reports a write-back error to one
    /// `fsync` of the file only, and every user of the device must hear of it.
    failed_flushes: std::sync::atomic::AtomicU64,
    /// Tests: every `fsync` fails with EIO while set (a write-back error no file here can
    /// be made to have).
    #[cfg(test)]
    fail_syncs: Arc<std::sync::atomic::AtomicBool>,
}

impl FileDevice {
    /// What syncs the file's data (`fdatasync`), for a blocking thread.
    fn sync_fn(&self) -> impl FnOnce(&FileIo) -> io::Result<()> + Send + 'static {
        #[cfg(test)]
        let fail = self.fail_syncs.clone();
        move |f: &FileIo| {
            #[cfg(test)]
            if fail.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(io::Error::from_raw_os_error(libc::EIO));
            }
            f.sync_data()
        }
    }

    /// Counts a flush that failed (see [`Device::losses`] for this device), before its
    /// caller hears of it.
    fn flushed(&self, r: io::Result<()>) -> io::Result<()> {
        if r.is_err() {
            self.failed_flushes
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        r
    }

    /// Opens an existing file or block device for reading and writing, through the page
    /// cache.
    pub fn open(path: &Path) -> io::Result<FileDevice> {
        FileDevice::open_with(path, false)
    }

    /// Opens an existing file or block device for reading and writing, with `O_DIRECT` if
    /// `direct` (failing where that cannot be had: [`FileIo::open_direct`]).
    pub fn open_with(path: &Path, direct: bool) -> io::Result<FileDevice> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let md = file.metadata()?;
        let regular = md.file_type().is_file();
        let size = if regular {
            md.len()
        } else if md.file_type().is_block_device() {
            use std::io::Seek;
            let mut f = &file;
            f.seek(io::SeekFrom::End(0))?
        } else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{} is neither a regular file nor a block device",
                    path.display()
                ),
            ));
        };
        let file = if direct {
            FileIo::open_direct(path)?
        } else {
            FileIo::cached(file)
        };
        Ok(FileDevice {
            file: Arc::new(file),
            size,
            path: path.to_owned(),
            fence: std::sync::OnceLock::new(),
            no_cached_reads: Default::default(),
            #[cfg(test)]
            fail_syncs: Default::default(),
            failed_flushes: Default::default(),
            regular,
        })
    }

    /// Creates a new sparse file of `size` bytes; fails if the path exists, and leaves nothing
    /// behind if it fails after creating the file.
    pub fn create(path: &Path, size: u64) -> io::Result<FileDevice> {
        FileDevice::create_with(path, size, false, |_| Ok(()))
    }

    /// [`FileDevice::create`], running `prepare` on the new, empty file first (before it is
    /// sized and synced, so what it sets is durable with the file), and then using it with
    /// `O_DIRECT` if `direct`.
    pub fn create_with(
        path: &Path,
        size: u64,
        direct: bool,
        prepare: impl FnOnce(&File) -> io::Result<()>,
    ) -> io::Result<FileDevice> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)?;
        let sized = prepare(&file)
            .and_then(|_| file.set_len(size))
            .and_then(|_| file.sync_all())
            .and_then(|_| match path.parent() {
                Some(dir) => File::open(dir)?.sync_all(),
                None => Ok(()),
            });
        let file = sized.and_then(|()| match direct {
            true => FileIo::open_direct(path),
            false => Ok(FileIo::cached(file)),
        });
        let file = match file {
            Ok(f) => f,
            Err(e) => {
                let _ = std::fs::remove_file(path);
                return Err(e);
            }
        };
        Ok(FileDevice {
            file: Arc::new(file),
            size,
            path: path.to_owned(),
            fence: std::sync::OnceLock::new(),
            no_cached_reads: Default::default(),
            #[cfg(test)]
            fail_syncs: Default::default(),
            failed_flushes: Default::default(),
            regular: true,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

fn fallocate(file: &File, mode: libc::c_int, offset: u64, len: u64) -> io::Result<()> {
    // SAFETY: fallocate only reads its scalar arguments; the fd is valid for the File's life.
    let r = unsafe {
        libc::fallocate(
            file.as_raw_fd(),
            mode,
            offset as libc::off_t,
            len as libc::off_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn write_zero_bytes(
    file: &FileIo,
    offset: u64,
    len: u64,
    fence: &Option<Arc<Fence>>,
) -> io::Result<()> {
    const CHUNK: u64 = 1 << 20;
    let zeroes = vec![0u8; CHUNK.min(len) as usize];
    let mut done = 0;
    while done < len {
        // A zeroing of gigabytes takes seconds: it stops where the lease lapses.
        check_fence(fence)?;
        let n = (len - done).min(CHUNK) as usize;
        file.write_all_at(&zeroes[..n], offset + done)?;
        done += n as u64;
    }
    Ok(())
}

fn unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS)
    )
}

#[async_trait]
impl Device for FileDevice {
    fn size(&self) -> u64 {
        self.size
    }

    fn describe(&self) -> String {
        self.path.display().to_string()
    }

    async fn read_at(&self, offset: u64, len: usize) -> io::Result<Bytes> {
        use std::sync::atomic::Ordering::Relaxed;
        let f = self.file.clone();
        let mut buf = vec![0u8; len];
        let mut got = 0;
        let inline = inline_here();
        if self.file.direct() && inline != Inline::Any {
            // Nothing is in memory: to the pool, unless alone on a connection thread.
            return on_pool(move || {
                f.read_exact_at(&mut buf, offset)?;
                Ok(Bytes::from(buf))
            })
            .await;
        }
        if inline != Inline::No {
            if inline == Inline::Any || self.no_cached_reads.load(Relaxed) {
                #[cfg(test)]
                INLINE_WAITS.with(|n| n.set(n.get() + 1));
                f.read_exact_at(&mut buf, offset)?;
                return Ok(Bytes::from(buf));
            }
            match read_cached(f.file(), &mut buf, offset) {
                Ok(n) if n == len => return Ok(Bytes::from(buf)),
                Ok(n) => got = n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == io::ErrorKind::Unsupported => {
                    self.no_cached_reads.store(true, Relaxed);
                }
                Err(e) => return Err(e),
            }
        }
        // The rest waits for the disk: on the pool, so the requests behind this one on its
        // connection go on meanwhile.
        on_pool(move || {
            f.read_exact_at(&mut buf[got..], offset + got as u64)?;
            Ok(Bytes::from(buf))
        })
        .await
    }

    async fn write_at(&self, offset: u64, data: Bytes, fua: bool) -> io::Result<()> {
        let f = self.file.clone();
        if fua {
            // Its sync is a flush like any other: a failure is a loss every user of the device
            // hears of ([`FileDevice::flushed`]). Uncounted, a FUA write of one volume could
            // take the kernel's one report of another volume's lost write-back, and that
            // volume's next FLUSH would answer OK.
            let sync = self.sync_fn();
            let synced = on_pool(move || {
                f.write_all_at(&data, offset)?;
                Ok(sync(&f))
            })
            .await?;
            return self.flushed(synced);
        }
        if f.direct() && inline_here() != Inline::Any {
            // A direct write waits for the device, as a read of the disk does.
            return on_pool(move || f.write_all_at(&data, offset)).await;
        }
        blocking(move || f.write_all_at(&data, offset)).await
    }

    async fn flush(&self) -> io::Result<()> {
        let f = self.file.clone();
        let sync = self.sync_fn();
        let r = on_pool(move || sync(&f)).await;
        self.flushed(r)
    }

    /// A failed `fsync` may mean written pages were lost (a write-back error), and Linux
    /// tells only the first `fsync` after it, which may be another volume's on the same LUN:
    /// counted as a loss, so every user whose writes it may have taken hears of it at its
    /// next flush ([`crate::Extent::flush`]), and a destager sends its window again.
    fn losses(&self) -> u64 {
        self.failed_flushes
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    async fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        if !self.regular {
            return Ok(()); // a hint; block devices keep their data
        }
        let f = self.file.clone();
        on_pool(move || {
            match fallocate(
                f.file(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                offset,
                len,
            ) {
                Err(e) if unsupported(&e) => Ok(()),
                r => r,
            }
        })
        .await
    }

    async fn write_zeroes(&self, offset: u64, len: u64, may_trim: bool) -> io::Result<()> {
        let f = self.file.clone();
        let regular = self.regular;
        let fence = self.fence.get().cloned();
        on_pool(move || zero_range(&f, regular, offset, len, may_trim, &fence)).await
    }

    fn prefers_batches(&self) -> bool {
        // Writes that end in the page cache; a direct write waits for the device, and many
        // at once are what it wants.
        !self.file.direct()
    }

    fn set_fence(&self, fence: Arc<Fence>) {
        let _ = self.fence.set(fence);
    }

    #[cfg(test)]
    fn fenced(&self) -> bool {
        self.fence.get().is_some()
    }

    async fn write_batch(
        &self,
        writes: Vec<BatchWrite>,
        fence: Option<Arc<Fence>>,
    ) -> io::Result<()> {
        let f = self.file.clone();
        let regular = self.regular;
        blocking(move || {
            for w in writes {
                check_fence(&fence)?;
                match &w.data {
                    Some(d) => f.write_all_at(d, w.offset)?,
                    None => zero_range(&f, regular, w.offset, w.len, w.may_trim, &fence)?,
                }
            }
            Ok(())
        })
        .await
    }
}

/// Zeroes a range of a file or block device: deallocated (`may_trim`) or zeroed in place by
/// `fallocate` where the file system can, written out otherwise.
fn zero_range(
    f: &FileIo,
    regular: bool,
    offset: u64,
    len: u64,
    may_trim: bool,
    fence: &Option<Arc<Fence>>,
) -> io::Result<()> {
    if regular {
        let mode = if may_trim {
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
        } else {
            libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE
        };
        match fallocate(f.file(), mode, offset, len) {
            Ok(()) => return Ok(()),
            Err(e) if unsupported(&e) => {}
            Err(e) => return Err(e),
        }
    }
    write_zero_bytes(f, offset, len, fence)
}

/// An export on an NBD server, reached through a pipelined connection pool.
pub struct NbdDevice {
    client: Client,
}

/// Connections per NBD datastore when the server allows several (`NBD_FLAG_CAN_MULTI_CONN`).
/// Two already use both cores of a small host; more only add context switches.
pub const NBD_POOL_DEFAULT: usize = 2;

impl NbdDevice {
    pub async fn connect(uri: &NbdUri, pool: usize) -> io::Result<NbdDevice> {
        let client = Client::connect(uri, pool).await.map_err(to_io)?;
        let e = client.export();
        if e.read_only() {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("NBD export {uri} is read-only; Vesta needs a writable export"),
            ));
        }
        if e.block_min > nbd::proto::BLOCK_SIZE_MIN {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "NBD export {uri} needs {}-byte aligned IO; Vesta issues 512-byte aligned IO \
                     (serve it with a minimum block size of 512 or less)",
                    e.block_min
                ),
            ));
        }
        Ok(NbdDevice { client })
    }

    pub fn client(&self) -> &Client {
        &self.client
    }
}

/// Flushes `dev` for a user whose writes since the device's loss count was `before` must
/// all be durable: EIO if a loss was counted since (it may have taken one of them).
pub async fn flush_since(dev: &dyn Device, before: u64) -> io::Result<()> {
    dev.flush().await?;
    if dev.losses() != before {
        return Err(io::Error::from_raw_os_error(libc::EIO));
    }
    Ok(())
}

/// Maps NBD client errors to `io::Error`, keeping the server's errno where there is one.
pub fn to_io(e: ClientError) -> io::Error {
    match e {
        ClientError::Server(errno) => {
            let raw = match errno {
                nbd::Errno::ENOSPC => libc::ENOSPC,
                nbd::Errno::EPERM => libc::EPERM,
                nbd::Errno::EINVAL => libc::EINVAL,
                nbd::Errno::ENOMEM => libc::ENOMEM,
                nbd::Errno::EOVERFLOW => libc::EOVERFLOW,
                nbd::Errno::ESHUTDOWN => libc::ESHUTDOWN,
                _ => libc::EIO,
            };
            io::Error::from_raw_os_error(raw)
        }
        // Nothing was sent: not a request the server may still carry out, whatever the
        // socket's error was ([`crate::unanswered`]).
        ClientError::Connect { uri, source } => io::Error::new(
            io::ErrorKind::NotConnected,
            format!("cannot reach NBD server {uri}: {source}"),
        ),
        // No answer: the request may still be carried out by a server that goes on running
        // it after the connection is gone ([`crate::unanswered`]).
        ClientError::Disconnected(why) => io::Error::new(io::ErrorKind::ConnectionAborted, why),
        // The connection was gone before the request went out: nothing was sent.
        e @ ClientError::NotSent(_) => io::Error::new(io::ErrorKind::NotConnected, e.to_string()),
        other => io::Error::other(other.to_string()),
    }
}

/// Splits a 64-bit length into NBD-sized (u32) pieces, each a multiple of 512 bytes.
fn pieces(offset: u64, len: u64) -> impl Iterator<Item = (u64, u32)> {
    const MAX: u64 = (u32::MAX as u64) & !511;
    let mut done = 0u64;
    std::iter::from_fn(move || {
        if done >= len {
            return None;
        }
        let n = (len - done).min(MAX);
        let r = (offset + done, n as u32);
        done += n;
        Some(r)
    })
}

#[async_trait]
impl Device for NbdDevice {
    fn size(&self) -> u64 {
        self.client.export().size
    }

    fn describe(&self) -> String {
        self.client.uri().to_string()
    }

    async fn read_at(&self, offset: u64, len: usize) -> io::Result<Bytes> {
        let len = u32::try_from(len).map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("a read of {len} bytes is more than one NBD request can carry"),
            )
        })?;
        self.client.read(offset, len).await.map_err(to_io)
    }

    async fn write_at(&self, offset: u64, data: Bytes, fua: bool) -> io::Result<()> {
        self.client.write(offset, data, fua).await.map_err(to_io)
    }

    async fn flush(&self) -> io::Result<()> {
        self.client.flush_acked().await.map_err(to_io)
    }

    fn losses(&self) -> u64 {
        self.client.losses()
    }

    fn set_fence(&self, fence: Arc<Fence>) {
        self.client.set_write_guard(Arc::new(move || {
            (!fence.allows_writes()).then(|| crate::fence::FENCED.to_owned())
        }));
    }

    async fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        for (o, n) in pieces(offset, len) {
            self.client.trim(o, n).await.map_err(to_io)?;
        }
        Ok(())
    }

    async fn write_zeroes(&self, offset: u64, len: u64, may_trim: bool) -> io::Result<()> {
        for (o, n) in pieces(offset, len) {
            self.client
                .write_zeroes(o, n, may_trim)
                .await
                .map_err(to_io)?;
        }
        Ok(())
    }
}

/// A datastore device in memory, for tests of what sits above datastores (the engine's
/// destager, recovery): it records every write and flush so a test can check the datastore
/// image at any point, and can be made to fail writes.
pub struct MemDevice {
    data: Arc<std::sync::Mutex<Vec<u8>>>,
    fail_writes: std::sync::atomic::AtomicBool,
    flushes: std::sync::atomic::AtomicU64,
    delay: std::sync::Mutex<Option<std::time::Duration>>,
    /// Run once, right after the next successful flush (a test's crash point).
    flush_hook: FlushHook,
    /// Whether it asks for batches ([`Device::prefers_batches`]), as a file does.
    batches: std::sync::atomic::AtomicBool,
    /// Every zeroing made: (offset, len, may_trim).
    zeroings: std::sync::Mutex<Vec<(u64, u64, bool)>>,
    /// How many more writes may pass before the rest are held in flight ([`MemDevice::hold_writes_after`]);
    /// `None`: none is held.
    hold: tokio::sync::watch::Sender<Option<u64>>,
    /// Writes held now.
    held: std::sync::atomic::AtomicU64,
    /// How many more writes lose their answer ([`MemDevice::lose_answers`]), and how long
    /// after it each lands.
    lose: std::sync::Mutex<(u64, std::time::Duration)>,
    /// Writes that lost their answer and have landed since.
    landed_late: Arc<std::sync::atomic::AtomicU64>,
}

type FlushHook = std::sync::Mutex<Option<Box<dyn FnOnce() + Send>>>;

impl MemDevice {
    pub fn new(size: u64) -> MemDevice {
        MemDevice {
            data: Arc::new(std::sync::Mutex::new(vec![0; size as usize])),
            fail_writes: std::sync::atomic::AtomicBool::new(false),
            flushes: std::sync::atomic::AtomicU64::new(0),
            delay: std::sync::Mutex::new(None),
            flush_hook: std::sync::Mutex::new(None),
            batches: std::sync::atomic::AtomicBool::new(false),
            zeroings: std::sync::Mutex::new(Vec::new()),
            hold: tokio::sync::watch::Sender::new(None),
            held: std::sync::atomic::AtomicU64::new(0),
            lose: std::sync::Mutex::new((0, std::time::Duration::ZERO)),
            landed_late: Arc::default(),
        }
    }

    /// The next `n` writes go unanswered: each fails at once as if its connection was lost
    /// with it in flight ([`crate::unanswered`]), and lands `after` later all the same, as an
    /// NBD server that goes on running a request after its client is gone.
    pub fn lose_answers(&self, n: u64, after: std::time::Duration) {
        *self.lose.lock().unwrap_or_else(|e| e.into_inner()) = (n, after);
    }

    /// How many writes that went unanswered ([`MemDevice::lose_answers`]) have landed.
    pub fn landed_late(&self) -> u64 {
        self.landed_late.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Lets the next `n` writes through and holds every one after them in flight (after its
    /// delay, if any) until called with `None`, which releases them all: a datastore that
    /// stops answering, for as long as a test needs.
    pub fn hold_writes_after(&self, n: Option<u64>) {
        self.hold.send_replace(n);
    }

    /// How many writes are held in flight now ([`MemDevice::hold_writes_after`]).
    pub fn writes_held(&self) -> u64 {
        self.held.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Every zeroing made so far, in order: (offset, len, whether it could deallocate).
    pub fn zeroings(&self) -> Vec<(u64, u64, bool)> {
        self.zeroings
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Makes it ask for its writes in batches, as a file does, so tests cover that path too.
    pub fn prefer_batches(&self, yes: bool) {
        self.batches.store(yes, std::sync::atomic::Ordering::SeqCst);
    }

    /// Runs `f` once, right after the next successful flush: where a test cuts the power in
    /// the middle of a destage window.
    pub fn after_next_flush(&self, f: impl FnOnce() + Send + 'static) {
        *self.flush_hook.lock().unwrap_or_else(|e| e.into_inner()) = Some(Box::new(f));
    }

    /// A copy of the whole image.
    pub fn image(&self) -> Vec<u8> {
        self.data.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Makes writes (and flushes) fail with EIO until called with false.
    pub fn fail_writes(&self, fail: bool) {
        self.fail_writes
            .store(fail, std::sync::atomic::Ordering::SeqCst);
    }

    /// Delays every write by `d`, like a slow SAN.
    pub fn set_write_delay(&self, d: Option<std::time::Duration>) {
        *self.delay.lock().unwrap_or_else(|e| e.into_inner()) = d;
    }

    pub fn flushes(&self) -> u64 {
        self.flushes.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn failing(&self) -> io::Result<()> {
        if self.fail_writes.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        Ok(())
    }
}

#[async_trait]
impl Device for MemDevice {
    fn size(&self) -> u64 {
        self.data.lock().unwrap_or_else(|e| e.into_inner()).len() as u64
    }

    fn describe(&self) -> String {
        "memory".into()
    }

    async fn read_at(&self, offset: u64, len: usize) -> io::Result<Bytes> {
        let d = self.data.lock().unwrap_or_else(|e| e.into_inner());
        Ok(Bytes::copy_from_slice(
            &d[offset as usize..offset as usize + len],
        ))
    }

    async fn write_at(&self, offset: u64, data: Bytes, _fua: bool) -> io::Result<()> {
        let delay = *self.delay.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(d) = delay {
            tokio::time::sleep(d).await;
        }
        let mut passes = true;
        self.hold.send_if_modified(|h| match h {
            Some(0) => {
                passes = false;
                false
            }
            Some(k) => {
                *k -= 1;
                true
            }
            None => false,
        });
        if !passes {
            use std::sync::atomic::Ordering::SeqCst;
            let mut released = self.hold.subscribe();
            self.held.fetch_add(1, SeqCst);
            let _ = released.wait_for(|h| h.is_none()).await;
            self.held.fetch_sub(1, SeqCst);
        }
        self.failing()?;
        let late = {
            let mut lose = self.lose.lock().unwrap_or_else(|e| e.into_inner());
            (lose.0 > 0).then(|| {
                lose.0 -= 1;
                lose.1
            })
        };
        if let Some(after) = late {
            let (image, landed) = (self.data.clone(), self.landed_late.clone());
            std::thread::spawn(move || {
                std::thread::sleep(after);
                let mut d = image.lock().unwrap_or_else(|e| e.into_inner());
                d[offset as usize..offset as usize + data.len()].copy_from_slice(&data);
                landed.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            });
            return Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "connection lost with the write in flight (a test)",
            ));
        }
        let mut d = self.data.lock().unwrap_or_else(|e| e.into_inner());
        d[offset as usize..offset as usize + data.len()].copy_from_slice(&data);
        Ok(())
    }

    async fn flush(&self) -> io::Result<()> {
        self.failing()?;
        self.flushes
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let hook = self
            .flush_hook
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(f) = hook {
            f();
        }
        Ok(())
    }

    async fn trim(&self, _offset: u64, _len: u64) -> io::Result<()> {
        Ok(())
    }

    async fn write_zeroes(&self, offset: u64, len: u64, may_trim: bool) -> io::Result<()> {
        self.failing()?;
        let mut d = self.data.lock().unwrap_or_else(|e| e.into_inner());
        d[offset as usize..(offset + len) as usize].fill(0);
        self.zeroings
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((offset, len, may_trim));
        Ok(())
    }

    fn prefers_batches(&self) -> bool {
        self.batches.load(std::sync::atomic::Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only a request that went out and got no answer may still be carried out by the
    /// server: one never sent (no connection to send it on) is not.
    #[test]
    fn only_requests_sent_and_not_answered_count_as_unanswered() {
        let unanswered = |e: ClientError| crate::unanswered(&to_io(e));
        assert!(unanswered(ClientError::Disconnected(
            "no reply to WRITE within 60s".into()
        )));
        assert!(!unanswered(ClientError::NotSent(
            "connection failed".into()
        )));
        for kind in [io::ErrorKind::TimedOut, io::ErrorKind::ConnectionReset] {
            assert!(!unanswered(ClientError::Connect {
                uri: "nbd://127.0.0.1:1/x".into(),
                source: kind.into(),
            }));
        }
        assert!(!unanswered(ClientError::Server(nbd::Errno::EIO)));
        assert!(!unanswered(ClientError::Held("fenced".into())));
    }

    /// A datastore is unreachable when nothing could be sent, when its server says it is
    /// shutting down, or when a request went unanswered; never when it refused the request
    /// (an IO error, a full LUN) or the host's fence held it back.
    #[test]
    fn only_transport_failures_and_a_shutting_down_server_count_as_unreachable() {
        let unreachable = |e: ClientError| crate::unreachable(&to_io(e));
        assert!(unreachable(ClientError::Connect {
            uri: "nbd://127.0.0.1:1/x".into(),
            source: io::ErrorKind::ConnectionRefused.into(),
        }));
        assert!(unreachable(ClientError::NotSent(
            "connection failed".into()
        )));
        assert!(unreachable(ClientError::Disconnected("reset".into())));
        assert!(unreachable(ClientError::Server(nbd::Errno::ESHUTDOWN)));
        for errno in [nbd::Errno::EIO, nbd::Errno::ENOSPC, nbd::Errno::EPERM] {
            assert!(!unreachable(ClientError::Server(errno)));
        }
        assert!(!unreachable(ClientError::Held("fenced".into())));
        assert!(!unreachable(ClientError::Refused {
            uri: "nbd://127.0.0.1:1/x".into(),
            msg: "no such export".into(),
        }));
    }

    #[test]
    fn pieces_cover_the_range_in_aligned_u32_chunks() {
        let len = 10u64 << 30;
        let v: Vec<_> = pieces(4096, len).collect();
        assert_eq!(v.iter().map(|p| u64::from(p.1)).sum::<u64>(), len);
        let mut at = 4096;
        for (o, n) in &v {
            assert_eq!(*o, at);
            assert_eq!(n % 512, 0);
            at += u64::from(*n);
        }
        assert_eq!(pieces(0, 0).count(), 0);
    }

    /// A 1 MiB file device in a new directory (to remove), and two extents that halve it, as
    /// two volumes of one LUN.
    fn two_extents_on_one_file() -> (PathBuf, Arc<FileDevice>, crate::Extent, crate::Extent) {
        let dir = std::env::temp_dir().join(format!("vesta-dev-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let d = Arc::new(FileDevice::create(&dir.join("lun.raw"), 1 << 20).unwrap());
        let gate = || Arc::new(crate::Gate::new(4));
        let a = crate::Extent::new(d.clone(), 0, 1 << 19, gate());
        let b = crate::Extent::new(d.clone(), 1 << 19, 1 << 19, gate());
        (dir, d, a, b)
    }

    /// A write-back error is reported to one `fsync` only; the file device counts the failed
    /// flush as a loss, so a volume whose flush did not see it (another on the same LUN) is
    /// told at its next flush. (A real write-back error needs a failing disk; the failed
    /// flush is given to the device's own accounting here.)
    #[tokio::test]
    async fn a_failed_flush_of_a_file_is_a_loss_every_extent_hears_of() {
        let (dir, d, a, b) = two_extents_on_one_file();
        a.write(0, Bytes::from(vec![1u8; 4096]), false)
            .await
            .unwrap();
        b.write(0, Bytes::from(vec![2u8; 4096]), false)
            .await
            .unwrap();
        assert_eq!(d.losses(), 0);
        // a's flush is the one the kernel told.
        let told = d.flushed(Err(io::Error::from_raw_os_error(libc::EIO)));
        assert!(told.is_err());
        assert_eq!(d.losses(), 1);
        let e = b.flush().await.expect_err("b's writes may be lost too");
        assert_eq!(e.raw_os_error(), Some(libc::EIO));
        // Told once; a write after the loss flushes as usual.
        b.write(4096, Bytes::from(vec![3u8; 4096]), false)
            .await
            .unwrap();
        b.flush().await.expect("nothing lost since");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The sync of a FUA write is a flush like any other: when it fails, every extent of the
    /// device hears of the loss at its next flush, as after a failed FLUSH (it went
    /// uncounted before, and the other extent's flush answered OK after the kernel had told
    /// the FUA write of its lost write-back).
    #[tokio::test]
    async fn a_fua_write_whose_sync_fails_is_a_loss_every_extent_hears_of() {
        let (dir, d, a, b) = two_extents_on_one_file();
        b.write(0, Bytes::from(vec![2u8; 4096]), false)
            .await
            .unwrap();
        d.fail_syncs
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let e = a
            .write(0, Bytes::from(vec![1u8; 4096]), true)
            .await
            .expect_err("its sync failed");
        assert_eq!(e.raw_os_error(), Some(libc::EIO));
        d.fail_syncs
            .store(false, std::sync::atomic::Ordering::SeqCst);
        assert_eq!(d.losses(), 1);
        let e = b.flush().await.expect_err("b's writes may be lost too");
        assert_eq!(e.raw_os_error(), Some(libc::EIO));
        b.flush().await.expect("told once");
        // A FUA write whose sync works is no loss.
        a.write(4096, Bytes::from(vec![3u8; 4096]), true)
            .await
            .unwrap();
        assert_eq!(d.losses(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn file_device_round_trips_and_zeroes() {
        let dir = std::env::temp_dir().join(format!("vesta-dev-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f.raw");
        let d = FileDevice::create(&path, 1 << 20).unwrap();
        assert!(
            FileDevice::create(&path, 1 << 20).is_err(),
            "create must not clobber"
        );
        d.write_at(4096, Bytes::from(vec![7u8; 8192]), true)
            .await
            .unwrap();
        assert_eq!(&d.read_at(4096, 8192).await.unwrap()[..], &[7u8; 8192][..]);
        d.write_zeroes(4096, 4096, true).await.unwrap();
        d.write_zeroes(8192, 512, false).await.unwrap();
        let r = d.read_at(4096, 8192).await.unwrap();
        assert!(r[..4096 + 512].iter().all(|b| *b == 0));
        assert!(r[4096 + 512..].iter().all(|b| *b == 7));
        d.flush().await.unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// On a connection thread with other requests in flight a read runs inline only as far
    /// as the page cache holds it: a read that must wait for the disk goes to the pool, so it
    /// does not hold up the requests behind it. Alone on its connection, it waits inline.
    /// Its data is whole either way.
    #[tokio::test]
    async fn a_read_waits_for_the_disk_on_the_pool_not_on_the_connection_thread() {
        let dir = crate::fileio::on_disk("dev");
        let path = dir.join("f.raw");
        let d = FileDevice::create(&path, 1 << 20).unwrap();
        let data: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8).collect();
        d.write_at(0, Bytes::from(data.clone()), true)
            .await
            .unwrap();
        // Out of the page cache (the pages are clean: the write was synced).
        let f = File::open(&path).unwrap();
        for advice in [libc::POSIX_FADV_RANDOM, libc::POSIX_FADV_DONTNEED] {
            // SAFETY: posix_fadvise takes a valid fd and scalars.
            assert_eq!(
                unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, advice) },
                0
            );
        }
        let mut buf = vec![0u8; 4096];
        let cold = read_cached(&f, &mut buf, 0).unwrap_err();
        assert_eq!(cold.kind(), io::ErrorKind::WouldBlock, "{cold}");

        let poll = |alone: bool, offset: u64, len: usize| {
            let mut read = d.read_at(offset, len);
            let first = may_block_here(alone, || {
                read.as_mut()
                    .poll(&mut std::task::Context::from_waker(std::task::Waker::noop()))
            });
            (first, read)
        };
        let poll_once = |offset: u64, len: usize| poll(false, offset, len);
        // A read's outcome, from its first poll or after: a pool thread may finish it before
        // the first poll returns.
        let finish = |(first, rest): (std::task::Poll<io::Result<Bytes>>, _)| async move {
            match first {
                std::task::Poll::Ready(r) => r,
                std::task::Poll::Pending => rest.await,
            }
        };
        let at = 512 << 10;
        let waits = || INLINE_WAITS.with(|n| n.get());
        let before = waits();
        let read = poll_once(at, 4096);
        assert_eq!(
            waits(),
            before,
            "a read from the disk ran inline on the connection thread"
        );
        let want = &data[at as usize..at as usize + 4096];
        assert_eq!(finish(read).await.unwrap()[..], want[..]);
        // Now in the page cache: inline, answered in the first poll.
        match poll_once(at, 4096).0 {
            std::task::Poll::Ready(r) => assert_eq!(r.unwrap()[..], want[..]),
            std::task::Poll::Pending => panic!("a read the page cache holds left the thread"),
        }
        assert_eq!(read_cached(&f, &mut buf, at).unwrap(), 4096);
        // What the page cache holds of a range inline, the rest from the disk: whole.
        let whole = poll_once(at, 256 << 10);
        assert_eq!(
            finish(whole).await.unwrap()[..],
            data[at as usize..(at + (256 << 10)) as usize]
        );
        // Alone, a read from the disk is answered inline, in its first poll.
        // SAFETY: as above.
        assert_eq!(
            unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) },
            0
        );
        assert_eq!(
            read_cached(&f, &mut buf, at).unwrap_err().kind(),
            io::ErrorKind::WouldBlock
        );
        match poll(true, at, 4096).0 {
            std::task::Poll::Ready(r) => assert_eq!(r.unwrap()[..], want[..]),
            std::task::Poll::Pending => panic!("a read alone on its connection left the thread"),
        }
        assert_eq!(waits(), before + 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn a_file_batch_makes_every_write_and_zeroing_in_turn() {
        let dir = std::env::temp_dir().join(format!("vesta-dev-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let d = FileDevice::create(&dir.join("f.raw"), 1 << 20).unwrap();
        assert!(d.prefers_batches());
        d.write_at(0, Bytes::from(vec![1u8; 1 << 20]), false)
            .await
            .unwrap();
        let w = |offset: u64, len: u64, byte: Option<u8>| BatchWrite {
            offset,
            len,
            data: byte.map(|b| Bytes::from(vec![b; len as usize])),
            may_trim: true,
        };
        d.write_batch(
            vec![
                w(8192, 4096, Some(2)),
                w(0, 4096, Some(3)),
                w(65536, 65536, None),
                w(4096, 512, Some(4)),
            ],
            None,
        )
        .await
        .unwrap();
        let r = d.read_at(0, 1 << 20).await.unwrap();
        let mut want = vec![1u8; 1 << 20];
        want[8192..12288].fill(2);
        want[..4096].fill(3);
        want[65536..131072].fill(0);
        want[4096..4608].fill(4);
        assert!(r[..] == want[..]);
        // A write past the end fails the batch, after the writes before it were made.
        let e = d
            .write_batch(
                vec![w(0, 4096, Some(5)), w(u64::MAX - 8192, 4096, Some(6))],
                None,
            )
            .await;
        assert!(e.is_err());
        assert!(d.read_at(0, 4096).await.unwrap().iter().all(|b| *b == 5));
        // A closed fence stops the batch before its first write.
        let fence = Arc::new(Fence::closed());
        let e = d.write_batch(vec![w(0, 4096, Some(6))], Some(fence)).await;
        assert!(e.unwrap_err().to_string().contains("fenced"));
        assert!(d.read_at(0, 4096).await.unwrap().iter().all(|b| *b == 5));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
