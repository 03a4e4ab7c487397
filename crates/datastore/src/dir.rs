//! Kind `dir`: a directory (local disk or a shared filesystem such as NFS) in which each volume
//! is a sparse raw image file named `<volume>.raw`, readable by any tool. Each file is tagged
//! with its volume's id (extended attribute `user.vesta.volume`, where the file system has
//! them), so a copy left by an interrupted relocation, or a datastore added again, is known
//! by the volume it holds.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;

use crate::device::{blocking, FileDevice};
use crate::{
    io_err, Capacity, Datastore, DatastoreSpec, Error, Extent, Gate, Kind, OpenMode, Result,
    VolumeSpec,
};

pub struct DirDatastore {
    spec: DatastoreSpec,
    path: PathBuf,
    gate: Arc<Gate>,
    /// The host's fence, handed to each volume's file ([`Datastore::set_fence`]): a long
    /// zeroing there asks it again between pieces.
    fence: std::sync::OnceLock<Arc<crate::fence::Fence>>,
}

impl DirDatastore {
    pub async fn open(spec: DatastoreSpec, mode: OpenMode) -> Result<DirDatastore> {
        let Kind::Dir { path } = &spec.kind else {
            unreachable!(
                "DirDatastore::open called for a {} datastore",
                spec.kind_name()
            );
        };
        let path = path.clone();
        // Off the reactor: a hung NFS mount must not stall it.
        let (p, probe_too) = (path.clone(), matches!(mode, OpenMode::Add { .. }));
        let checked = blocking(move || {
            let md = std::fs::metadata(&p)?;
            if probe_too && md.is_dir() {
                // Prove we can create files there before anything is recorded.
                let probe = p.join(format!(".vesta-probe-{}", uuid::Uuid::new_v4()));
                std::fs::write(&probe, b"")
                    .and_then(|_| std::fs::remove_file(&probe))
                    .map_err(|e| {
                        std::io::Error::new(e.kind(), format!("cannot create files: {e}"))
                    })?;
            }
            Ok(md)
        })
        .await;
        let md = checked.map_err(|e| {
            Error::Invalid(format!(
                "datastore {:?}: directory {} is not usable ({e}); create it first (mkdir -p {})",
                spec.name,
                path.display(),
                path.display()
            ))
        })?;
        if !md.is_dir() {
            return Err(Error::Invalid(format!(
                "datastore {:?}: {} is not a directory",
                spec.name,
                path.display()
            )));
        }
        // Made now, so the directory can be recognized under another path or mount
        // ([`same_dir`]) by a datastore being added, which only reads it. A read-only
        // directory goes without; it then cannot be told apart that way.
        let p = path.clone();
        if let Err(e) = blocking(move || identity(&p)).await {
            tracing::warn!(
                "datastore {:?}: no identity file {} in {} ({e}); another name or mount of \
                 this directory will be recognized only if it has the same inode",
                spec.name,
                IDENTITY_FILE,
                path.display()
            );
        }
        Ok(DirDatastore {
            gate: Arc::new(Gate::new(spec.queue_depth)),
            spec,
            path,
            fence: std::sync::OnceLock::new(),
        })
    }

    /// A volume's extent over its file, fenced like the datastore.
    fn extent(&self, dev: FileDevice, size: u64) -> Extent {
        use crate::device::Device as _;
        if let Some(f) = self.fence.get() {
            dev.set_fence(f.clone());
        }
        Extent::new(Arc::new(dev), 0, size, self.gate.clone())
    }

    fn file_of(&self, v: &VolumeSpec) -> PathBuf {
        self.path.join(format!("{}.raw", v.name))
    }
}

/// The file in a `dir` datastore's directory that holds its identity ([`identity`]).
pub const IDENTITY_FILE: &str = ".vesta-datastore";

/// The identity of the `dir` datastore in directory `root`: the UUID in its
/// [`IDENTITY_FILE`], made (exclusively, so two hosts never make two) if there is none.
/// Two datastore names whose identities differ are two directories, however they are
/// mounted: the same export mounted twice (NFS with `nosharecache`, a FUSE and a kernel
/// client) gives two device numbers for one directory, but one identity file. An error
/// (a file being made by another host, not readable yet) means "not known".
pub fn identity(root: &Path) -> std::io::Result<uuid::Uuid> {
    use std::io::Write;
    let f = root.join(IDENTITY_FILE);
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&f)
    {
        Ok(mut file) => {
            file.write_all(format!("{}\n", uuid::Uuid::new_v4()).as_bytes())?;
            file.sync_all()?;
            std::fs::File::open(root)?.sync_all()?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let text = std::fs::read_to_string(&f)?;
    uuid::Uuid::parse_str(text.trim()).map_err(|e| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{}: {e}", f.display()),
        )
    })
}

/// Whether two paths name one directory (a second datastore name for it, through a symlink,
/// a bind mount, or one export mounted twice, would let one volume's image be taken for
/// another's copy): one device and inode, or one identity file ([`identity`]; read here,
/// never made). False where that cannot be told (an error).
pub async fn same_dir(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let (a, b) = (a.to_owned(), b.to_owned());
    blocking(move || {
        let (x, y) = (std::fs::metadata(&a)?, std::fs::metadata(&b)?);
        if (x.dev(), x.ino()) == (y.dev(), y.ino()) {
            return Ok(true);
        }
        let id = |root: &Path| std::fs::read_to_string(root.join(IDENTITY_FILE)).ok();
        Ok(matches!((id(&a), id(&b)), (Some(x), Some(y)) if x.trim() == y.trim()))
    })
    .await
    .unwrap_or(false)
}

/// The extended attribute that names the volume an image file was created for.
const TAG: &std::ffi::CStr = c"user.vesta.volume";

/// Tags a new image file with its volume's id. A file system without user extended
/// attributes (some NFS servers) gets no tag: the volume works the same, but a copy an
/// interrupted relocation left there is not recognized (the retry says so, and names it).
fn tag(file: &std::fs::File, id: uuid::Uuid) -> std::io::Result<()> {
    use std::os::unix::io::AsRawFd;
    let v = id.to_string();
    // SAFETY: the name is a valid C string and the value a live buffer of the length given.
    let r = unsafe {
        libc::fsetxattr(
            file.as_raw_fd(),
            TAG.as_ptr(),
            v.as_ptr().cast(),
            v.len(),
            0,
        )
    };
    if r != 0 {
        let e = std::io::Error::last_os_error();
        tracing::debug!("image file not tagged with volume {id}: {e}");
    }
    Ok(())
}

/// The volume an image file was created for, if it was tagged ([`tag`]).
fn tag_of(path: &Path) -> Option<uuid::Uuid> {
    let c = CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut buf = [0u8; 64];
    // SAFETY: both are valid C strings; the buffer is ours and its length is given.
    // Not through a symlink: a link to another volume's image does not name that volume.
    let n =
        unsafe { libc::lgetxattr(c.as_ptr(), TAG.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    let n = usize::try_from(n).ok()?;
    std::str::from_utf8(&buf[..n]).ok()?.parse().ok()
}

/// The file system's space, and what the volume images in `path` may still take of it.
fn capacity_of(path: &Path) -> std::io::Result<Capacity> {
    use std::os::unix::fs::MetadataExt;
    let mut cap = statvfs(path)?;
    // An entry that cannot be read (gone meanwhile, a stale NFS handle) is not counted: the
    // free space is still known, and placement should not lose the datastore over it.
    for e in std::fs::read_dir(path)?.flatten() {
        if !e.file_name().to_str().is_some_and(|n| n.ends_with(".raw")) {
            continue;
        }
        let Ok(m) = e.metadata() else { continue };
        if m.is_file() {
            cap.unwritten_bytes += m.len().saturating_sub(m.blocks() * 512);
        }
    }
    Ok(cap)
}

fn statvfs(path: &Path) -> std::io::Result<Capacity> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::other("path contains NUL"))?;
    // SAFETY: statvfs writes into the zeroed struct we own; `c` is a valid C string.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let total = s.f_blocks * s.f_frsize;
    let free = s.f_bavail * s.f_frsize;
    Ok(Capacity {
        total_bytes: total,
        free_bytes: free,
        // Files are sparse: a volume larger than the free space can be created, but only the
        // free space can ever be written.
        largest_free_bytes: free,
        unwritten_bytes: 0,
    })
}

#[async_trait]
impl Datastore for DirDatastore {
    fn spec(&self) -> &DatastoreSpec {
        &self.spec
    }

    fn gate(&self) -> &Arc<Gate> {
        &self.gate
    }

    fn set_fence(&self, fence: Arc<crate::fence::Fence>) {
        self.gate.set_fence(fence.clone());
        let _ = self.fence.set(fence);
    }

    async fn capacity(&self) -> Result<Capacity> {
        let p = self.path.clone();
        blocking(move || capacity_of(&p))
            .await
            .map_err(io_err(format!("space of {}", self.path.display())))
    }

    async fn create_volume(&self, v: &VolumeSpec) -> Result<Extent> {
        let file = self.file_of(v);
        let size = v.size;
        let too_large = || {
            Error::Invalid(format!(
                "a volume of {size} bytes is larger than the file system of datastore {:?} \
                 allows for one file ({}); choose a smaller size or a LUN datastore",
                self.spec.name,
                self.path.display()
            ))
        };
        if i64::try_from(size).is_err() {
            return Err(too_large());
        }
        let (f, id, direct) = (file.clone(), v.id, self.spec.direct);
        let dev = blocking(move || FileDevice::create_with(&f, size, direct, |file| tag(file, id)))
            .await
            .map_err(|e| {
                if e.kind() == std::io::ErrorKind::AlreadyExists {
                    Error::Exists(format!(
                        "{} already exists in datastore {:?} but is not a volume Vesta knows; \
                         move it away or choose another volume name",
                        file.display(),
                        self.spec.name
                    ))
                } else if e.kind() == std::io::ErrorKind::FileTooLarge {
                    too_large()
                } else {
                    Error::Io {
                        what: format!("create {}", file.display()),
                        source: e,
                    }
                }
            })?;
        Ok(self.extent(dev, size))
    }

    async fn open_volume(&self, v: &VolumeSpec) -> Result<Extent> {
        let file = self.file_of(v);
        let (f, direct) = (file.clone(), self.spec.direct);
        let dev = blocking(move || FileDevice::open_with(&f, direct))
            .await
            .map_err(|e| {
                if e.kind() == std::io::ErrorKind::NotFound {
                    Error::NotFound(format!(
                        "volume {:?}: its image {} is missing from datastore {:?}",
                        v.name,
                        file.display(),
                        self.spec.name
                    ))
                } else {
                    Error::Io {
                        what: format!("open {}", file.display()),
                        source: e,
                    }
                }
            })?;
        use crate::device::Device;
        if dev.size() < v.size {
            return Err(Error::Invalid(format!(
                "volume {:?}: image {} has {} bytes, fewer than the volume's {}",
                v.name,
                file.display(),
                dev.size(),
                v.size
            )));
        }
        Ok(self.extent(dev, v.size))
    }

    /// The image files tagged with the volume they were created for: what an interrupted
    /// relocation left is known by its volume's id and removed when the relocation is retried.
    async fn recorded_volumes(&self) -> Result<Vec<VolumeSpec>> {
        let dir = self.path.clone();
        blocking(move || {
            let mut found = Vec::new();
            for e in std::fs::read_dir(&dir)? {
                let e = e?;
                let path = e.path();
                let Some(name) = path
                    .file_name()
                    .and_then(|n| n.to_str())
                    .and_then(|n| n.strip_suffix(".raw"))
                else {
                    continue;
                };
                if crate::check_name("volume", name).is_err() {
                    continue;
                }
                let Some(id) = tag_of(&path) else { continue };
                found.push(VolumeSpec {
                    id,
                    name: name.to_owned(),
                    size: e.metadata()?.len(),
                });
            }
            Ok(found)
        })
        .await
        .map_err(io_err(format!("list {}", self.path.display())))
    }

    async fn delete_volume(&self, v: &VolumeSpec) -> Result<()> {
        let file = self.file_of(v);
        let (f, id) = (file.clone(), v.id);
        let removed = blocking(move || match tag_of(&f) {
            // Made for another volume: not this one's to remove (a second name for this
            // directory, or a file put in place by hand).
            Some(other) if other != id => Err(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                format!("it holds volume {other}, not {id}; left in place"),
            )),
            // The directory synced too: after a power cut the file must not come back
            // without the record its delete removes next.
            _ => std::fs::remove_file(&f).and_then(|_| match f.parent() {
                Some(dir) => std::fs::File::open(dir)?.sync_all(),
                None => Ok(()),
            }),
        });
        match removed.await {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::Io {
                what: format!("remove {}", file.display()),
                source: e,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A datastore on a new scratch directory, removed at the end.
    struct Scratch(PathBuf, DirDatastore);

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    async fn scratch(tag: &str) -> Scratch {
        let p = std::env::temp_dir().join(format!("vesta-dir-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        let spec = DatastoreSpec {
            name: "d".into(),
            kind: Kind::Dir { path: p.clone() },
            class: Default::default(),
            queue_depth: 4,
            direct: false,
        };
        let ds = DirDatastore::open(
            spec,
            OpenMode::Add {
                force: false,
                take_over: None,
            },
        )
        .await
        .unwrap();
        Scratch(p, ds)
    }

    /// A directory's identity is made once and read the same through any path to it (here
    /// a symlink); two directories have two; a damaged identity file is an error, not a new
    /// identity.
    #[tokio::test]
    async fn a_directory_has_one_identity_however_it_is_reached() {
        let (a, b) = (scratch("ida").await, scratch("idb").await);
        let first = identity(&a.0).unwrap();
        assert_eq!(identity(&a.0).unwrap(), first);
        let link = a.0.with_extension("link");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&a.0, &link).unwrap();
        assert_eq!(identity(&link).unwrap(), first);
        std::fs::remove_file(&link).unwrap();
        assert_ne!(identity(&b.0).unwrap(), first);
        std::fs::write(b.0.join(IDENTITY_FILE), "").unwrap();
        assert!(identity(&b.0).is_err());
    }

    fn spec(name: &str) -> VolumeSpec {
        VolumeSpec {
            id: uuid::Uuid::new_v4(),
            name: name.into(),
            size: 1 << 20,
        }
    }

    #[tokio::test]
    async fn image_files_name_their_volumes() {
        let s = scratch("tags").await;
        let v = spec("v");
        s.1.create_volume(&v).await.unwrap();
        std::fs::write(s.0.join("hand.raw"), b"not made by vesta").unwrap();
        std::fs::write(s.0.join("notes.txt"), b"").unwrap();
        std::os::unix::fs::symlink(s.0.join("v.raw"), s.0.join("link.raw")).unwrap();
        assert_eq!(s.1.recorded_volumes().await.unwrap(), vec![v]);
    }

    /// A delete removes only the image made for its volume: a file of that name tagged with
    /// another volume (the same directory under a second datastore name) stays.
    #[tokio::test]
    async fn a_delete_leaves_a_file_made_for_another_volume() {
        let s = scratch("delete").await;
        let v = spec("v");
        s.1.create_volume(&v).await.unwrap();
        let other = VolumeSpec {
            id: uuid::Uuid::new_v4(),
            ..v.clone()
        };
        let e = s.1.delete_volume(&other).await.unwrap_err();
        assert!(e.to_string().contains("left in place"), "{e}");
        assert!(s.0.join("v.raw").exists());
        s.1.delete_volume(&v).await.unwrap();
        assert!(!s.0.join("v.raw").exists());
        // An untagged file (made before tags, or on a file system without them) goes as before.
        std::fs::write(s.0.join("w.raw"), b"").unwrap();
        s.1.delete_volume(&spec("w")).await.unwrap();
        assert!(!s.0.join("w.raw").exists());
    }

    /// The space a sparse image may still take counts against the datastore's free space
    /// for placement: it shrinks as the volume is written, by what was written.
    #[tokio::test]
    async fn a_sparse_image_counts_what_it_may_still_take() {
        let s = scratch("sparse").await;
        let none = s.1.capacity().await.unwrap();
        assert_eq!(none.unwritten_bytes, 0);
        let v = VolumeSpec {
            size: 64 << 20,
            ..spec("v")
        };
        let e = s.1.create_volume(&v).await.unwrap();
        // Not a volume image: not counted.
        std::fs::write(s.0.join("notes.txt"), vec![1u8; 1 << 20]).unwrap();
        let before = s.1.capacity().await.unwrap().unwritten_bytes;
        assert!(before > (64 << 20) - (64 << 10), "{before}");
        assert!(before <= 64 << 20, "{before}");
        e.write(0, bytes::Bytes::from(vec![7u8; 8 << 20]), false)
            .await
            .unwrap();
        e.flush().await.unwrap();
        let after = s.1.capacity().await.unwrap().unwritten_bytes;
        let taken = before - after;
        assert!(
            (8 << 20..=9 << 20).contains(&taken),
            "{before} -> {after}: 8 MiB written took {taken}"
        );
    }

    #[tokio::test]
    async fn a_directory_is_known_under_another_path() {
        let s = scratch("alias").await;
        let link = s.0.with_extension("link");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&s.0, &link).unwrap();
        assert!(same_dir(&s.0, &link).await);
        assert!(!same_dir(&s.0, &std::env::temp_dir()).await);
        std::fs::remove_file(&link).unwrap();
    }

    /// One export mounted twice gives two device numbers for one directory; its identity
    /// file is still one file. (Here a second directory holding a copy of it stands in.)
    #[tokio::test]
    async fn a_directory_is_known_by_its_identity_under_another_mount() {
        let a = scratch("mount-a").await;
        let b = scratch("mount-b").await;
        identity(&a.0).unwrap();
        identity(&b.0).unwrap();
        assert!(
            !same_dir(&a.0, &b.0).await,
            "two directories, two identities"
        );
        std::fs::copy(a.0.join(IDENTITY_FILE), b.0.join(IDENTITY_FILE)).unwrap();
        assert!(
            same_dir(&a.0, &b.0).await,
            "one identity taken for two directories"
        );
    }

    /// Each volume's file gets the host's fence, opened or created, so a long zeroing done
    /// in pieces (a file system without `fallocate`, such as NFSv3) asks it between them:
    /// at the gate alone, a host whose lease lapsed mid-zeroing would go on writing zeroes
    /// while another host replays the volume.
    #[tokio::test]
    async fn each_volume_file_gets_the_hosts_fence() {
        let s = scratch("fence").await;
        s.1.set_fence(Arc::new(crate::fence::Fence::open()));
        let v = spec("v");
        let created = s.1.create_volume(&v).await.unwrap();
        assert!(created.dev.fenced(), "a created volume's file has no fence");
        let opened = s.1.open_volume(&v).await.unwrap();
        assert!(opened.dev.fenced(), "an opened volume's file has no fence");
    }
}
