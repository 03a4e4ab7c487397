//! The file under a [`FileDevice`](crate::device::FileDevice): read and written through the
//! page cache, or with `O_DIRECT`.
//!
//! Hosts that share a datastore by path (a SAN disk every host sees as a block device, a
//! directory on NFS) must not each keep a page cache of it: a host would read its own stale
//! copy of blocks another host wrote (a peer's replay, a take-over's new label), and the
//! kernel could write a host's buffered data back after its lease lapsed, past its fence.
//! With `O_DIRECT` (`direct = true` on the datastore) every read goes to the device and every
//! write has reached it when it returns.
//!
//! `O_DIRECT` wants offsets, lengths and buffers aligned to the device's logical block size.
//! Vesta's IO is 512-byte aligned (NBD's minimum block), so a file is opened direct only where
//! 512-byte IO works (not on a 4Kn disk), and every IO goes through a 4 KiB-aligned bounce
//! buffer of at most [`CHUNK`] bytes: one copy, which is what page-cache IO costs too.

use std::alloc::Layout;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::ptr::NonNull;

/// The alignment `O_DIRECT` IO must have here: offsets and lengths.
pub const DIRECT_ALIGN: u64 = 512;
/// Bounce buffers are aligned to this (the page: enough for any device).
const BUF_ALIGN: usize = 4096;
/// The most one bounce buffer holds; longer IO goes in pieces.
pub const CHUNK: usize = 1 << 20;

pub struct FileIo {
    file: File,
    direct: bool,
}

impl FileIo {
    /// Through the page cache.
    pub fn cached(file: File) -> FileIo {
        FileIo {
            file,
            direct: false,
        }
    }

    /// Opens `path` for reading and writing with `O_DIRECT`. Fails where the file system
    /// cannot (tmpfs before Linux 6.6), or where 512-byte IO is refused (a 4Kn disk).
    pub fn open_direct(path: &Path) -> io::Result<FileIo> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
            .map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!("{}: cannot open with O_DIRECT: {e}", path.display()),
                )
            })?;
        let io = FileIo { file, direct: true };
        let too_coarse = |align: String| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{}: O_DIRECT here needs IO aligned to {align} bytes (a 4Kn disk?); Vesta's \
                     IO is {DIRECT_ALIGN}-byte aligned",
                    path.display()
                ),
            )
        };
        match dio_offset_align(&io.file) {
            Some(0) => Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("{}: its file system does not do O_DIRECT", path.display()),
            )),
            Some(a) if u64::from(a) > DIRECT_ALIGN => Err(too_coarse(a.to_string())),
            Some(_) => Ok(io),
            None => {
                // Not told (an older kernel): one sector, not at offset 0, which a device
                // that wants larger blocks refuses. (A read of a hole or past the end may
                // pass unchecked: the best left to try.)
                let mut probe = Bounce::zeroed(DIRECT_ALIGN as usize);
                match io.file.read_at(probe.as_mut(), DIRECT_ALIGN) {
                    Ok(_) => Ok(io),
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                        Err(too_coarse(format!("more than {DIRECT_ALIGN}")))
                    }
                    Err(e) => Err(e),
                }
            }
        }
    }

    pub fn direct(&self) -> bool {
        self.direct
    }

    /// The file itself, for what is neither a read nor a write (`fdatasync`, `fallocate`).
    pub fn file(&self) -> &File {
        &self.file
    }

    pub fn sync_data(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    fn check_aligned(offset: u64, len: usize) -> io::Result<()> {
        if offset.is_multiple_of(DIRECT_ALIGN) && (len as u64).is_multiple_of(DIRECT_ALIGN) {
            return Ok(());
        }
        Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "O_DIRECT IO must be {DIRECT_ALIGN}-byte aligned: {len} bytes at offset {offset}"
            ),
        ))
    }

    pub fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        if !self.direct {
            return self.file.read_exact_at(buf, offset);
        }
        Self::check_aligned(offset, buf.len())?;
        let mut bounce = Bounce::zeroed(buf.len().clamp(1, CHUNK));
        for (i, piece) in buf.chunks_mut(CHUNK).enumerate() {
            let b = &mut bounce.as_mut()[..piece.len()];
            self.file.read_exact_at(b, offset + (i * CHUNK) as u64)?;
            piece.copy_from_slice(b);
        }
        Ok(())
    }

    pub fn write_all_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        if !self.direct {
            return self.file.write_all_at(data, offset);
        }
        Self::check_aligned(offset, data.len())?;
        let mut bounce = Bounce::zeroed(data.len().clamp(1, CHUNK));
        for (i, piece) in data.chunks(CHUNK).enumerate() {
            let b = &mut bounce.as_mut()[..piece.len()];
            b.copy_from_slice(piece);
            self.file.write_all_at(b, offset + (i * CHUNK) as u64)?;
        }
        Ok(())
    }
}

/// The alignment `O_DIRECT` needs of offsets and lengths in `file`, as `statx` reports it
/// (`STATX_DIOALIGN`, Linux 6.1 on; 0 where the file cannot do direct IO), or a block
/// device's logical block size; `None` where neither tells.
fn dio_offset_align(file: &File) -> Option<u32> {
    use std::os::unix::fs::FileTypeExt;
    use std::os::unix::io::AsRawFd;
    // SAFETY: statx is plain data; all zeroes is a valid value of it.
    let mut sx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: a valid fd, an empty C string with AT_EMPTY_PATH (the fd itself), and a
    // pointer to a statx this call may write.
    let r = unsafe {
        libc::statx(
            file.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            &mut sx,
        )
    };
    if r == 0 && sx.stx_mask & libc::STATX_DIOALIGN != 0 {
        return Some(sx.stx_dio_offset_align);
    }
    if file.metadata().ok()?.file_type().is_block_device() {
        let mut size: libc::c_int = 0;
        // SAFETY: BLKSSZGET writes one c_int through the pointer; the fd is valid.
        if unsafe { libc::ioctl(file.as_raw_fd(), libc::BLKSSZGET, &mut size) } == 0 {
            return u32::try_from(size).ok();
        }
    }
    None
}

/// A zeroed buffer aligned to [`BUF_ALIGN`], as `O_DIRECT` needs.
struct Bounce {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: Bounce owns its allocation alone, like a Vec<u8>.
unsafe impl Send for Bounce {}

impl Bounce {
    fn zeroed(len: usize) -> Bounce {
        let layout = Layout::from_size_align(len.max(1), BUF_ALIGN).expect("a valid layout");
        // SAFETY: the layout's size is not zero.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        Bounce { ptr, layout }
    }

    fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` points to `layout.size()` initialized (zeroed) bytes this Bounce owns,
        // borrowed mutably through `self` for the slice's life.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for Bounce {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this very layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// A new directory `vesta-TAG-…` on the disk the repository is on, for tests of what the
/// page cache holds or of `O_DIRECT` (tmpfs is the page cache itself); the test removes it.
#[cfg(test)]
pub(crate) fn on_disk(tag: &str) -> std::path::PathBuf {
    let d = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../target/test-tmp")
        .join(format!("vesta-{tag}-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::io::AsRawFd;

    /// Whether the page cache holds the 4 KiB of `f` at `offset` (4 KiB-aligned), asked with
    /// `mincore`, which reads nothing.
    fn in_page_cache(f: &File, offset: u64) -> bool {
        // SAFETY: a shared read-only mapping of one page of an open file, never dereferenced;
        // mincore writes one byte to `vec`; the mapping is removed before `f` closes.
        unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                offset as libc::off_t,
            );
            assert_ne!(p, libc::MAP_FAILED, "{}", io::Error::last_os_error());
            let mut vec = 0u8;
            let r = libc::mincore(p, 4096, &mut vec);
            libc::munmap(p, 4096);
            assert_eq!(r, 0, "{}", io::Error::last_os_error());
            vec & 1 == 1
        }
    }

    #[test]
    fn direct_io_reads_back_what_it_wrote_and_leaves_nothing_in_the_page_cache() {
        let d = on_disk("fileio");
        let path = d.join("f.raw");
        let f = File::create(&path).unwrap();
        f.set_len(4 << 20).unwrap();
        drop(f);
        let io = FileIo::open_direct(&path).unwrap();
        assert!(io.direct());
        // Where the kernel says what direct IO needs here (6.1 on): the repository's disk
        // takes 512-byte IO.
        if let Some(a) = dio_offset_align(io.file()) {
            assert!(a > 0 && u64::from(a) <= DIRECT_ALIGN, "{a}");
        }
        // Longer than a bounce buffer, sector-aligned but not page-aligned, odd lengths of
        // sectors.
        let data: Vec<u8> = (0..(CHUNK + 3 * 512) as u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
            .collect();
        for (at, len) in [
            (512u64, 512usize),
            (4096 + 1536, 2560),
            (1 << 20, data.len()),
        ] {
            io.write_all_at(&data[..len], at).unwrap();
            let mut back = vec![0u8; len];
            io.read_exact_at(&mut back, at).unwrap();
            assert!(back == data[..len], "{len} bytes at {at}");
        }
        // What a plain reader of the file sees: the writes reached it.
        let plain = File::open(&path).unwrap();
        let mut b = vec![0u8; 2560];
        plain.read_exact_at(&mut b, 4096 + 1536).unwrap();
        assert!(b == data[..2560]);
        assert!(
            in_page_cache(&plain, 4096),
            "the check sees a page a plain read brought in"
        );
        // The page cache holds none of what direct IO read or wrote (after the plain read's
        // pages are dropped again).
        // SAFETY: posix_fadvise takes a valid fd and scalars.
        assert_eq!(
            unsafe { libc::posix_fadvise(plain.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) },
            0
        );
        let mut back = vec![0u8; 4096];
        io.read_exact_at(&mut back, 1 << 20).unwrap();
        // Asked with `mincore`, which reads nothing: a `RWF_NOWAIT` read of a page that is
        // not there starts its readahead, which on a fast disk can finish before the kernel
        // looks again and answer the page after all.
        assert!(
            !in_page_cache(&plain, 1 << 20),
            "direct IO left the page it read in the page cache"
        );
        // Unaligned IO is refused, not done wrong.
        for (at, len) in [(100u64, 512usize), (512, 100)] {
            let e = io.write_all_at(&data[..len], at).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
            let e = io.read_exact_at(&mut vec![0; len], at).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        }
        std::fs::remove_dir_all(&d).unwrap();
    }
}
