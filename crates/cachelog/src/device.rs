//! The host's cache device (the paper's "flash"): a file or block device, behind a trait so
//! tests can put a device there that fails, tears writes, or loses power.
//!
//! The API is synchronous: callers run it where blocking is allowed (a connection thread, or
//! tokio's blocking pool). `sync` is `fdatasync`: after it returns, every write that returned
//! before it began is on stable media.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, FileTypeExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

pub trait CacheDevice: Send + Sync + 'static {
    fn size(&self) -> u64;
    fn describe(&self) -> String;
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()>;
    /// Reads into `buf` from `offset` only as far as it can without waiting for the device
    /// (what the page cache holds): how many bytes, `Err` with `WouldBlock` if none, and
    /// `Unsupported` where the device cannot tell (the default), which [`read_at`] then
    /// serves. See [`read_cached`].
    ///
    /// [`read_at`]: CacheDevice::read_at
    fn read_cached(&self, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        let _ = (offset, buf);
        Err(io::ErrorKind::Unsupported.into())
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()>;
    /// Makes every write that completed before this call durable.
    fn sync(&self) -> io::Result<()>;
    /// Checks that the device still works, for an idle host to notice a dead device before
    /// the next write does. Nothing may rely on it for durability.
    fn probe(&self) -> io::Result<()> {
        self.sync()
    }
}

/// Reads into `buf` from `offset` what the page cache holds, without waiting for the disk
/// (`preadv2` with `RWF_NOWAIT`): how many bytes it read, which is less than `buf.len()` where
/// the data is not in memory (or the file ends). `Err` with `WouldBlock` if none of it is, and
/// `Unsupported` where the file system or kernel cannot tell (`EOPNOTSUPP`, `ENOSYS`); other
/// errors are the read's own.
pub fn read_cached(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    loop {
        // SAFETY: one iovec over `buf`, which is valid for writes of its length for the whole
        // call; the fd is valid for the File's life.
        let n = unsafe {
            libc::preadv2(
                file.as_raw_fd(),
                &iov,
                1,
                offset as libc::off_t,
                libc::RWF_NOWAIT,
            )
        };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EAGAIN) => Err(io::ErrorKind::WouldBlock.into()),
            Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) => Err(io::ErrorKind::Unsupported.into()),
            _ => Err(e),
        };
    }
}

/// A cache file (created sparse at the configured size) or a block device.
pub struct FileCache {
    file: File,
    size: u64,
    path: PathBuf,
    /// Set once [`read_cached`] turned out unsupported here, so it is not asked again.
    no_cached_reads: AtomicBool,
}

impl FileCache {
    /// Opens `path`, creating a sparse file of `size` bytes if it does not exist. An existing
    /// regular file smaller than `size` is grown; a block device is used at its own size.
    pub fn open(path: &Path, size: u64) -> io::Result<FileCache> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        let md = file.metadata()?;
        let size = if md.file_type().is_block_device() {
            use std::io::Seek;
            (&file).seek(io::SeekFrom::End(0))?
        } else {
            if md.len() < size {
                file.set_len(size)?;
                // A new or grown file: its size, and its name in the directory, are durable
                // before the log formats it and acknowledges writes synced into it. Syncing
                // the file alone does not make a new name durable: after a power cut the file
                // could be gone, and a new empty one formatted in its place.
                file.sync_all()?;
            }
            // Every time, not only when created here: a start killed between creating the
            // file and syncing its directory leaves a full-size file whose name is not yet
            // durable, which the next start formats.
            let dir = match path.parent() {
                Some(d) if !d.as_os_str().is_empty() => d,
                _ => Path::new("."),
            };
            File::open(dir)?.sync_all()?;
            md.len().max(size)
        };
        Ok(FileCache {
            file,
            size,
            path: path.to_owned(),
            no_cached_reads: AtomicBool::new(false),
        })
    }
}

impl CacheDevice for FileCache {
    fn size(&self) -> u64 {
        self.size
    }

    fn describe(&self) -> String {
        self.path.display().to_string()
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.file.read_exact_at(buf, offset)
    }

    fn read_cached(&self, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        if self.no_cached_reads.load(Ordering::Relaxed) {
            return Err(io::ErrorKind::Unsupported.into());
        }
        let r = read_cached(&self.file, buf, offset);
        if r.as_ref()
            .is_err_and(|e| e.kind() == io::ErrorKind::Unsupported)
        {
            self.no_cached_reads.store(true, Ordering::Relaxed);
        }
        r
    }

    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.file.write_all_at(data, offset)
    }

    fn sync(&self) -> io::Result<()> {
        self.file.sync_data()
    }
}

/// Wraps a device so that a test can make it fail every IO from some moment on, as a dying
/// flash device would, or lose power; used by `vestad --test-faults`.
///
/// A power cut of a real file needs to know what the file held before each write that no
/// sync has covered yet. From [`Faulty::record_power_cut`] on, every write first reads the
/// bytes it replaces and keeps them until a sync covers it; [`Faulty::power_cut`] writes
/// them back, newest first, so the device holds exactly what its syncs made durable, and
/// fails every IO from then on. Every unsynced write is lost whole: the torn writes and the
/// survivors out of order that [`SimDevice`] also models are left to its property tests.
/// While recording, [`CacheDevice::probe`] checks without syncing, so that only the syncs
/// the log asks for make writes durable. Recording must start on an idle device: a write
/// already in flight then is neither recorded nor synced. Until recording starts a write
/// costs one atomic load more.
pub struct Faulty<D> {
    inner: D,
    failed: AtomicBool,
    recording: AtomicBool,
    undo: Mutex<Undo>,
}

/// The unsynced writes of a recording [`Faulty`]: (sequence number, offset, old bytes).
#[derive(Default)]
struct Undo {
    next: u64,
    writes: Vec<(u64, u64, Vec<u8>)>,
}

impl<D: CacheDevice> Faulty<D> {
    pub fn new(inner: D) -> Faulty<D> {
        Faulty {
            inner,
            failed: AtomicBool::new(false),
            recording: AtomicBool::new(false),
            undo: Mutex::new(Undo::default()),
        }
    }

    pub fn fail(&self) {
        self.failed.store(true, Ordering::SeqCst);
    }

    /// Syncs the device, then keeps what each later write replaces until a sync covers it,
    /// for [`Faulty::power_cut`].
    pub fn record_power_cut(&self) -> io::Result<()> {
        let mut u = self.undo.lock().unwrap_or_else(|e| e.into_inner());
        self.check()?;
        self.inner.sync()?;
        u.writes.clear();
        self.recording.store(true, Ordering::SeqCst);
        Ok(())
    }

    /// Puts back what every write not covered by a sync replaced, syncs that, and fails every
    /// IO from then on. Returns how many writes it undid.
    pub fn power_cut(&self) -> io::Result<usize> {
        let mut u = self.undo.lock().unwrap_or_else(|e| e.into_inner());
        if !self.recording.load(Ordering::SeqCst) {
            return Err(io::Error::other("power_cut without record_power_cut first"));
        }
        self.fail();
        let writes = std::mem::take(&mut u.writes);
        for (_, offset, old) in writes.iter().rev() {
            self.inner.write_at(*offset, old)?;
        }
        self.inner.sync()?;
        Ok(writes.len())
    }

    fn check(&self) -> io::Result<()> {
        if self.failed.load(Ordering::SeqCst) {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        Ok(())
    }
}

impl<D: CacheDevice> CacheDevice for Faulty<D> {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.check()?;
        self.inner.read_at(offset, buf)
    }
    fn read_cached(&self, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        self.check()?;
        self.inner.read_cached(offset, buf)
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.check()?;
        if !self.recording.load(Ordering::SeqCst) {
            return self.inner.write_at(offset, data);
        }
        // The old bytes are read and the write made under one lock, so the undo entries of
        // overlapping writes are in the order the writes happened.
        let mut u = self.undo.lock().unwrap_or_else(|e| e.into_inner());
        self.check()?;
        let mut old = vec![0u8; data.len()];
        self.inner.read_at(offset, &mut old)?;
        // Kept before the write, so a write that fails partway is undone too.
        let seq = u.next;
        u.next += 1;
        u.writes.push((seq, offset, old));
        self.inner.write_at(offset, data)
    }
    fn sync(&self) -> io::Result<()> {
        self.check()?;
        if !self.recording.load(Ordering::SeqCst) {
            return self.inner.sync();
        }
        // Covers the writes that completed before it began: those numbered below `upto`.
        let upto = self.undo.lock().unwrap_or_else(|e| e.into_inner()).next;
        self.inner.sync()?;
        let mut u = self.undo.lock().unwrap_or_else(|e| e.into_inner());
        self.check()?;
        u.writes.retain(|(seq, _, _)| *seq >= upto);
        Ok(())
    }
    fn probe(&self) -> io::Result<()> {
        self.check()?;
        if self.recording.load(Ordering::SeqCst) {
            return Ok(());
        }
        self.inner.probe()
    }
}

/// A simulated device in memory that models a volatile write cache, for tests:
///
/// - writes land in a volatile layer; [`CacheDevice::sync`] makes them durable;
/// - [`SimDevice::power_loss`] throws away what was not synced, keeping, tearing or dropping
///   each unsynced write as a caller-supplied choice dictates (sector granularity);
/// - [`SimDevice::fail`] makes every later IO fail with EIO, as a dead flash device would.
pub struct SimDevice {
    size: u64,
    state: Mutex<SimState>,
    failed: AtomicBool,
    writes: AtomicU64,
    read_bytes: AtomicU64,
    /// Reads wait while this is true ([`SimDevice::pause_reads`]), counted in `waiting`.
    reads_paused: Mutex<bool>,
    /// Writes wait while this is true ([`SimDevice::pause_writes`]), counted in
    /// `writes_waiting`.
    writes_paused: Mutex<bool>,
    /// Signalled when either pause ends.
    resumed: std::sync::Condvar,
    waiting: AtomicU64,
    writes_waiting: AtomicU64,
}

struct SimState {
    durable: Vec<u8>,
    /// Writes since the last sync, oldest first.
    pending: Vec<(u64, Vec<u8>)>,
}

/// What a power loss does to one unsynced write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    Lost,
    Kept,
    /// Only the first n sectors reached the media.
    Torn(usize),
}

impl SimDevice {
    pub fn new(size: u64) -> SimDevice {
        SimDevice {
            size,
            state: Mutex::new(SimState {
                durable: vec![0; size as usize],
                pending: Vec::new(),
            }),
            failed: AtomicBool::new(false),
            writes: AtomicU64::new(0),
            read_bytes: AtomicU64::new(0),
            reads_paused: Mutex::new(false),
            writes_paused: Mutex::new(false),
            resumed: std::sync::Condvar::new(),
            waiting: AtomicU64::new(0),
            writes_waiting: AtomicU64::new(0),
        }
    }

    /// While `on`, every read waits (writes and syncs go on): a test can then act between a
    /// reader's lookup and its device read.
    pub fn pause_reads(&self, on: bool) {
        *self.reads_paused.lock().unwrap_or_else(|e| e.into_inner()) = on;
        self.resumed.notify_all();
    }

    /// Reads waiting in [`SimDevice::pause_reads`].
    pub fn reads_waiting(&self) -> u64 {
        self.waiting.load(Ordering::SeqCst)
    }

    /// While `on`, every write waits (reads and syncs go on): a test can then act while a
    /// writer is in the device.
    pub fn pause_writes(&self, on: bool) {
        *self.writes_paused.lock().unwrap_or_else(|e| e.into_inner()) = on;
        self.resumed.notify_all();
    }

    /// Writes waiting in [`SimDevice::pause_writes`].
    pub fn writes_waiting(&self) -> u64 {
        self.writes_waiting.load(Ordering::SeqCst)
    }

    /// Waits while `paused` is true, counted in `waiting`.
    fn wait_while(&self, paused: &Mutex<bool>, waiting: &AtomicU64) {
        let mut p = paused.lock().unwrap_or_else(|e| e.into_inner());
        if *p {
            waiting.fetch_add(1, Ordering::SeqCst);
            while *p {
                p = self.resumed.wait(p).unwrap_or_else(|e| e.into_inner());
            }
            waiting.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Where `pattern` first occurs in what reads would return.
    pub fn find(&self, pattern: &[u8]) -> Option<u64> {
        let mut img = vec![0u8; self.size as usize];
        self.read_now(0, &mut img);
        img.windows(pattern.len())
            .position(|w| w == pattern)
            .map(|p| p as u64)
    }

    fn read_now(&self, offset: u64, buf: &mut [u8]) {
        let st = self.state();
        let o = offset as usize;
        buf.copy_from_slice(&st.durable[o..o + buf.len()]);
        // Later writes shadow earlier ones.
        for (wo, d) in &st.pending {
            let (a, b) = (*wo, *wo + d.len() as u64);
            let (x, y) = (offset.max(a), (offset + buf.len() as u64).min(b));
            if x < y {
                buf[(x - offset) as usize..(y - offset) as usize]
                    .copy_from_slice(&d[(x - a) as usize..(y - a) as usize]);
            }
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, SimState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// From now on every IO fails with EIO.
    pub fn fail(&self) {
        self.failed.store(true, Ordering::SeqCst);
    }

    /// Unsynced writes since the last sync.
    pub fn unsynced(&self) -> usize {
        self.state().pending.len()
    }

    /// Writes ever issued.
    pub fn writes(&self) -> u64 {
        self.writes.load(Ordering::SeqCst)
    }

    /// Bytes ever read.
    pub fn read_bytes(&self) -> u64 {
        self.read_bytes.load(Ordering::SeqCst)
    }

    /// Power loss: each unsynced write, oldest first, meets the fate `choose` gives it (called
    /// with the write's index and its length in sectors). Afterwards the device holds only
    /// durable data and works again.
    pub fn power_loss(&self, mut choose: impl FnMut(usize, usize) -> Fate) {
        let mut st = self.state();
        let pending = std::mem::take(&mut st.pending);
        for (i, (off, data)) in pending.into_iter().enumerate() {
            let sectors = data.len().div_ceil(512);
            let keep = match choose(i, sectors) {
                Fate::Lost => 0,
                Fate::Kept => data.len(),
                Fate::Torn(n) => (n * 512).min(data.len()),
            };
            let o = off as usize;
            st.durable[o..o + keep].copy_from_slice(&data[..keep]);
        }
        self.failed.store(false, Ordering::SeqCst);
    }

    /// A second device holding what a power loss now that kept no unsynced write would leave,
    /// so a test can recover from it while this one stays in use.
    pub fn crash_copy(&self) -> SimDevice {
        let copy = SimDevice::new(self.size);
        copy.state().durable = self.state().durable.clone();
        copy
    }

    /// Flips one bit at `offset` in what reads return (and what a sync would persist), as
    /// media corruption would.
    pub fn corrupt(&self, offset: u64) {
        let mut st = self.state();
        let newest = st
            .pending
            .iter_mut()
            .rev()
            .find(|(o, d)| *o <= offset && offset < o + d.len() as u64);
        match newest {
            Some((o, d)) => d[(offset - *o) as usize] ^= 0x40,
            None => st.durable[offset as usize] ^= 0x40,
        }
    }

    fn check(&self, offset: u64, len: usize) -> io::Result<()> {
        if self.failed.load(Ordering::SeqCst) {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        if offset + len as u64 > self.size {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "IO past the end of the simulated device",
            ));
        }
        Ok(())
    }
}

impl CacheDevice for SimDevice {
    fn size(&self) -> u64 {
        self.size
    }

    fn describe(&self) -> String {
        "simulated device".into()
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.wait_while(&self.reads_paused, &self.waiting);
        self.check(offset, buf.len())?;
        self.read_bytes
            .fetch_add(buf.len() as u64, Ordering::SeqCst);
        self.read_now(offset, buf);
        Ok(())
    }

    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.wait_while(&self.writes_paused, &self.writes_waiting);
        self.check(offset, data.len())?;
        self.writes.fetch_add(1, Ordering::SeqCst);
        self.state().pending.push((offset, data.to_vec()));
        Ok(())
    }

    fn sync(&self) -> io::Result<()> {
        self.check(0, 0)?;
        let mut st = self.state();
        let pending = std::mem::take(&mut st.pending);
        for (off, d) in pending {
            let o = off as usize;
            st.durable[o..o + d.len()].copy_from_slice(&d);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file that holds, after `power_cut`, exactly what was synced: unsynced writes undone
    /// newest first (overlapping ones included), synced ones kept, and IO failing after.
    #[test]
    fn a_power_cut_leaves_a_file_with_what_its_syncs_made_durable() {
        let dir = std::env::temp_dir().join(format!("vesta-faulty-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("cache.img");
        let _ = std::fs::remove_file(&path);
        let d = Faulty::new(FileCache::open(&path, 16384).unwrap());
        d.write_at(0, &[1; 4096]).unwrap(); // before recording: durable once recording starts
        d.record_power_cut().unwrap();
        d.write_at(4096, &[2; 4096]).unwrap();
        d.sync().unwrap(); // covers the 2s
        d.write_at(0, &[3; 1024]).unwrap();
        d.write_at(512, &[4; 1024]).unwrap(); // overlaps the 3s
        d.write_at(8192, &[5; 512]).unwrap();
        d.probe().unwrap(); // checks, syncs nothing
        assert_eq!(d.power_cut().unwrap(), 3, "three writes were not synced");
        let mut b = [0u8; 4096];
        assert!(d.read_at(0, &mut b).is_err(), "IO fails after the cut");
        assert!(d.write_at(0, &[6; 512]).is_err(), "IO fails after the cut");
        let f = std::fs::read(&path).unwrap();
        assert_eq!(
            &f[..4096],
            &[1; 4096][..],
            "the unsynced overlapping writes are undone"
        );
        assert_eq!(&f[4096..8192], &[2; 4096][..], "the synced write stays");
        assert_eq!(
            &f[8192..8704],
            &[0; 512][..],
            "the unsynced write is undone"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn unsynced_writes_meet_their_fate_at_power_loss() {
        let d = SimDevice::new(8192);
        d.write_at(0, &[1; 1024]).unwrap();
        d.sync().unwrap();
        d.write_at(0, &[2; 1024]).unwrap(); // torn after one sector
        d.write_at(2048, &[3; 512]).unwrap(); // lost
        d.write_at(4096, &[4; 512]).unwrap(); // kept
        let mut b = [0u8; 1024];
        d.read_at(0, &mut b).unwrap();
        assert_eq!(
            b, [2; 1024],
            "reads see unsynced writes before the power loss"
        );
        let fates = [Fate::Torn(1), Fate::Lost, Fate::Kept];
        d.power_loss(|i, _| fates[i]);
        d.read_at(0, &mut b).unwrap();
        assert_eq!(&b[..512], &[2; 512]);
        assert_eq!(&b[512..], &[1; 512]);
        let mut s = [0u8; 512];
        d.read_at(2048, &mut s).unwrap();
        assert_eq!(s, [0; 512]);
        d.read_at(4096, &mut s).unwrap();
        assert_eq!(s, [4; 512]);
    }

    #[test]
    fn a_failed_device_fails_every_io() {
        let d = SimDevice::new(4096);
        d.fail();
        assert!(d.write_at(0, &[1; 512]).is_err());
        assert!(d.read_at(0, &mut [0; 512]).is_err());
        assert!(d.sync().is_err());
    }

    #[test]
    fn file_cache_is_created_sparse_and_round_trips() {
        let p = std::env::temp_dir().join(format!("vesta-cache-{}", uuid::Uuid::new_v4()));
        let c = FileCache::open(&p, 4 << 20).unwrap();
        assert_eq!(c.size(), 4 << 20);
        c.write_at(1 << 20, &[9; 4096]).unwrap();
        c.sync().unwrap();
        let mut b = [0u8; 4096];
        c.read_at(1 << 20, &mut b).unwrap();
        assert_eq!(b, [9; 4096]);
        drop(c);
        let c = FileCache::open(&p, 1 << 20).unwrap();
        assert_eq!(c.size(), 4 << 20, "an existing larger file keeps its size");
        std::fs::remove_file(&p).unwrap();
    }
}
