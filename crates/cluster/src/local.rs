//! The `local` coordinator: one host, no service. State lives in `state.json` in the data
//! directory and every change replaces the file atomically (write a temporary file, fsync it,
//! rename it over the old one, fsync the directory), so a crash at any instant leaves either
//! the old state or the new one, never a mixture.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use std::sync::Arc;

use async_trait::async_trait;
use tokio::sync::Mutex;
use uuid::Uuid;

use datastore::fence::Fence;
use datastore::DatastoreSpec;

use crate::record::{HostRecord, HostStatus, State, Vault, VolumeRecord};
use crate::{Coordinator, DatastoreLock, Error, Result, StatsDoc};

const FILE: &str = "state.json";
/// Version of the state file layout; bumped on incompatible changes.
const VERSION: u32 = 1;

#[derive(Clone, Default, serde::Serialize, serde::Deserialize)]
struct OnDisk {
    version: u32,
    #[serde(flatten)]
    state: State,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    vaults: Vec<Vault>,
    /// [`Coordinator::deleted_volumes`], with when each was deleted.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    deleted: Vec<Deleted>,
    /// This host's pod id ([`Coordinator::pod_id`]), made the first time it is asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pod: Option<Uuid>,
}

#[derive(Clone, serde::Serialize, serde::Deserialize)]
struct Deleted {
    id: Uuid,
    unix: u64,
}

pub struct LocalCoordinator {
    path: PathBuf,
    state: Mutex<OnDisk>,
    name: String,
    host: std::sync::Mutex<HostRecord>,
    /// Never closes: with no lease there is nothing to lose, and the data directory's lock
    /// already keeps a second daemon away.
    fence: Arc<Fence>,
    /// Statistics documents live as long as the process, like a lease-bound key.
    stats: std::sync::Mutex<std::collections::HashMap<StatsDoc, Vec<u8>>>,
    pod_stats: std::sync::Mutex<Option<Vec<u8>>>,
    /// A single host has no peers; the key only has to stay the same while it runs.
    peer_key: std::sync::OnceLock<[u8; 32]>,
}

impl LocalCoordinator {
    /// Loads `state.json` from `dir`, or starts empty if there is none. `host` names this
    /// host in status output.
    pub fn open_as(dir: &Path, host: HostRecord) -> Result<LocalCoordinator> {
        let mut c = LocalCoordinator::open(dir)?;
        c.name = host.name.clone();
        c.host = std::sync::Mutex::new(host);
        Ok(c)
    }

    /// [`LocalCoordinator::open_as`] a host named `local`.
    pub fn open(dir: &Path) -> Result<LocalCoordinator> {
        let path = dir.join(FILE);
        let state = match fs::read(&path) {
            Ok(b) => {
                let d: OnDisk = serde_json::from_slice(&b).map_err(|e| Error::Corrupt {
                    path: path.display().to_string(),
                    msg: format!("{e}; restore it from a backup or move it away to start empty"),
                })?;
                if d.version != VERSION {
                    return Err(Error::Corrupt {
                        path: path.display().to_string(),
                        msg: format!(
                            "version {} is not supported (this build reads {VERSION})",
                            d.version
                        ),
                    });
                }
                d
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => OnDisk {
                version: VERSION,
                ..OnDisk::default()
            },
            Err(e) => {
                return Err(Error::Io {
                    what: format!("read {}", path.display()),
                    source: e,
                })
            }
        };
        Ok(LocalCoordinator {
            path,
            state: Mutex::new(state),
            name: "local".into(),
            host: std::sync::Mutex::new(HostRecord {
                name: "local".into(),
                fault_domain: "local".into(),
                ..HostRecord::default()
            }),
            fence: Arc::new(Fence::open()),
            stats: Default::default(),
            pod_stats: Default::default(),
            peer_key: Default::default(),
        })
    }

    /// Applies `change` to a copy of the state, persists the copy, then makes it current.
    async fn change(&self, change: impl FnOnce(&mut State) -> Result<()>) -> Result<()> {
        self.change_all(|d| change(&mut d.state)).await
    }

    async fn change_all(&self, change: impl FnOnce(&mut OnDisk) -> Result<()>) -> Result<()> {
        let mut cur = self.state.lock().await;
        let mut next = cur.clone();
        change(&mut next)?;
        let path = self.path.clone();
        let bytes = serde_json::to_vec_pretty(&next).expect("state serializes");
        tokio::task::spawn_blocking(move || replace_atomically(&path, &bytes))
            .await
            .map_err(|e| Error::Io {
                what: "persist state".into(),
                source: std::io::Error::other(e.to_string()),
            })?
            .map_err(|e| Error::Io {
                what: format!("write {}", self.path.display()),
                source: e,
            })?;
        *cur = next;
        Ok(())
    }
}

/// Replaces the file at `path` with `bytes` so that a crash leaves the old or the new
/// contents, never a mix: write a sibling temporary file, sync it, rename it over, sync the
/// directory.
pub fn replace_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("json.tmp");
    {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
    }
    fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent() {
        File::open(dir)?.sync_all()?;
    }
    Ok(())
}

#[async_trait]
impl Coordinator for LocalCoordinator {
    fn kind(&self) -> &'static str {
        "local"
    }

    async fn state(&self) -> Result<State> {
        Ok(self.state.lock().await.state.clone())
    }

    async fn add_datastore(&self, d: DatastoreSpec) -> Result<()> {
        self.change(|s| {
            if s.datastores.iter().any(|x| x.name == d.name) {
                return Err(Error::Exists(format!(
                    "a datastore named {:?} already exists",
                    d.name
                )));
            }
            s.datastores.push(d);
            Ok(())
        })
        .await
    }

    async fn update_datastore(&self, d: DatastoreSpec) -> Result<()> {
        self.change(|s| {
            let x = s
                .datastores
                .iter_mut()
                .find(|x| x.name == d.name)
                .ok_or_else(|| Error::NotFound(format!("no datastore named {:?}", d.name)))?;
            *x = d;
            Ok(())
        })
        .await
    }

    async fn create_volume(&self, v: VolumeRecord) -> Result<()> {
        self.change(|s| {
            if s.volumes.iter().any(|x| x.name == v.name || x.id == v.id) {
                return Err(Error::Exists(format!(
                    "a volume named {:?} already exists",
                    v.name
                )));
            }
            s.volumes.push(v);
            Ok(())
        })
        .await
    }

    async fn update_volume(&self, v: VolumeRecord) -> Result<()> {
        self.change(|s| {
            let x = s
                .volumes
                .iter_mut()
                .find(|x| x.id == v.id)
                .ok_or_else(|| Error::NotFound(format!("no volume {:?} ({})", v.name, v.id)))?;
            *x = v;
            Ok(())
        })
        .await
    }

    async fn delete_volume(&self, name: &str, id: Uuid) -> Result<()> {
        self.change_all(|d| {
            if !d.state.volumes.iter().any(|x| x.name == name && x.id == id) {
                return Err(Error::NotFound(format!("no volume {id} named {name:?}")));
            }
            d.state.volumes.retain(|x| x.id != id);
            d.vaults.retain(|x| x.volume != id);
            let now = crate::now_unix();
            d.deleted
                .retain(|x| x.unix + crate::DELETED_KEEP.as_secs() > now);
            d.deleted.push(Deleted { id, unix: now });
            Ok(())
        })
        .await
    }

    async fn deleted_volumes(&self) -> Result<Vec<Uuid>> {
        let now = crate::now_unix();
        Ok(self
            .state
            .lock()
            .await
            .deleted
            .iter()
            .filter(|x| x.unix + crate::DELETED_KEEP.as_secs() > now)
            .map(|x| x.id)
            .collect())
    }

    fn host(&self) -> &str {
        &self.name
    }

    async fn publish_host(&self, mut h: HostRecord) -> Result<()> {
        h.name = self.name.clone();
        *self.host.lock().expect("lock") = h;
        Ok(())
    }

    async fn hosts(&self) -> Result<Vec<HostStatus>> {
        Ok(vec![HostStatus {
            record: self.host.lock().expect("lock").clone(),
            alive: true,
        }])
    }

    fn fence(&self) -> Arc<Fence> {
        self.fence.clone()
    }

    async fn lock_vault(&self, _volume: Uuid) -> Result<()> {
        Ok(())
    }

    async fn unlock_vault(&self, _volume: Uuid) -> Result<()> {
        Ok(())
    }

    async fn vault(&self, volume: Uuid) -> Result<Option<Vault>> {
        let d = self.state.lock().await;
        Ok(d.vaults.iter().find(|v| v.volume == volume).cloned())
    }

    async fn put_vault(&self, v: &Vault) -> Result<()> {
        self.change_all(|d| {
            d.vaults.retain(|x| x.volume != v.volume);
            d.vaults.push(v.clone());
            Ok(())
        })
        .await
    }

    async fn lock_datastore(&self, name: &str) -> Result<DatastoreLock> {
        // One host: the daemon's admin lock already serializes metadata changes.
        Ok(DatastoreLock {
            name: name.into(),
            key: Vec::new(),
            closes: self.fence().closes(),
        })
    }

    async fn unlock_datastore(&self, _lock: DatastoreLock) -> Result<()> {
        Ok(())
    }

    async fn put_stats(&self, kind: StatsDoc, doc: Vec<u8>) -> Result<()> {
        self.stats.lock().expect("lock").insert(kind, doc);
        Ok(())
    }

    async fn stats(&self, kind: StatsDoc) -> Result<Vec<(String, Vec<u8>)>> {
        Ok(self
            .stats
            .lock()
            .expect("lock")
            .get(&kind)
            .map(|d| vec![(self.name.clone(), d.clone())])
            .unwrap_or_default())
    }

    async fn stats_aggregator(&self) -> Result<bool> {
        Ok(true) // the only host
    }

    async fn put_pod_stats(&self, doc: Vec<u8>) -> Result<()> {
        *self.pod_stats.lock().expect("lock") = Some(doc);
        Ok(())
    }

    async fn pod_stats(&self) -> Result<Option<Vec<u8>>> {
        Ok(self.pod_stats.lock().expect("lock").clone())
    }

    async fn peer_key(&self, fresh: [u8; 32]) -> Result<[u8; 32]> {
        Ok(*self.peer_key.get_or_init(|| fresh))
    }

    async fn stored_pod_id(&self) -> Result<Option<Uuid>> {
        Ok(self.state.lock().await.pod)
    }

    async fn pod_id(&self, fresh: Uuid) -> Result<Uuid> {
        if let Some(id) = self.state.lock().await.pod {
            return Ok(id);
        }
        self.change_all(|d| {
            d.pod.get_or_insert(fresh);
            Ok(())
        })
        .await?;
        Ok(self.state.lock().await.pod.unwrap_or(fresh))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Policy;
    use datastore::{Class, Kind};

    /// The pod id is made once and kept in the state file: a restart is the same pod, and
    /// the LUNs it formatted still open.
    #[tokio::test]
    async fn the_pod_id_survives_a_restart() {
        let dir = tmpdir();
        let c = LocalCoordinator::open(&dir).unwrap();
        let first = c.pod_id(Uuid::new_v4()).await.unwrap();
        assert_eq!(c.pod_id(Uuid::new_v4()).await.unwrap(), first);
        drop(c);
        let c = LocalCoordinator::open(&dir).unwrap();
        assert_eq!(c.pod_id(Uuid::new_v4()).await.unwrap(), first);
        let _ = fs::remove_dir_all(&dir);
    }

    /// A delete leaves the volume's id, kept [`crate::DELETED_KEEP`] and across restarts, then
    /// forgotten.
    #[tokio::test]
    async fn a_deleted_volumes_id_is_kept_for_a_while() {
        let dir = tmpdir();
        let c = LocalCoordinator::open(&dir).unwrap();
        let (a, b) = (vol("a"), vol("b"));
        for v in [&a, &b] {
            c.create_volume(v.clone()).await.unwrap();
        }
        c.delete_volume("a", a.id).await.unwrap();
        drop(c);
        let c = LocalCoordinator::open(&dir).unwrap();
        assert_eq!(c.deleted_volumes().await.unwrap(), vec![a.id]);
        // Deleted longer ago than it is kept: forgotten, and dropped at the next delete.
        c.state.lock().await.deleted[0].unix = 1;
        assert!(c.deleted_volumes().await.unwrap().is_empty());
        c.delete_volume("b", b.id).await.unwrap();
        let kept: Vec<Uuid> = c.state.lock().await.deleted.iter().map(|x| x.id).collect();
        assert_eq!(kept, vec![b.id]);
        let _ = fs::remove_dir_all(&dir);
    }

    fn tmpdir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("vesta-local-{}", uuid::Uuid::new_v4()));
        fs::create_dir_all(&d).unwrap();
        d
    }

    fn vol(name: &str) -> VolumeRecord {
        VolumeRecord {
            id: uuid::Uuid::new_v4(),
            name: name.into(),
            size: 1 << 30,
            datastore: "default".into(),
            policy: Policy::Uncached,
            created_unix: 1,
            tuning: Default::default(),
            owner: None,
            moved: None,
        }
    }

    #[tokio::test]
    async fn state_survives_reopen_and_rejects_duplicates() {
        let dir = tmpdir();
        let c = LocalCoordinator::open(&dir).unwrap();
        c.add_datastore(DatastoreSpec {
            name: "default".into(),
            kind: Kind::Dir { path: dir.clone() },
            class: Class::Hdd,
            queue_depth: 8,
            direct: false,
        })
        .await
        .unwrap();
        c.create_volume(vol("a")).await.unwrap();
        assert!(matches!(
            c.create_volume(vol("a")).await,
            Err(Error::Exists(_))
        ));
        c.create_volume(vol("b")).await.unwrap();
        let (a, b) = {
            let s = c.state().await.unwrap();
            let id = |n: &str| s.volumes.iter().find(|v| v.name == n).unwrap().id;
            (id("a"), id("b"))
        };
        // Another volume's id: not this name's volume.
        assert!(matches!(
            c.delete_volume("a", b).await,
            Err(Error::NotFound(_))
        ));
        c.delete_volume("a", a).await.unwrap();
        assert!(matches!(
            c.delete_volume("a", a).await,
            Err(Error::NotFound(_))
        ));
        let before = c.state().await.unwrap();
        drop(c);
        let c = LocalCoordinator::open(&dir).unwrap();
        let after = c.state().await.unwrap();
        assert_eq!(before, after);
        assert_eq!(after.volumes.len(), 1);
        assert_eq!(after.volumes[0].name, "b");
        assert!(!dir.join("state.json.tmp").exists());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn a_failed_change_leaves_state_untouched() {
        let dir = tmpdir();
        let c = LocalCoordinator::open(&dir).unwrap();
        c.create_volume(vol("a")).await.unwrap();
        let before = c.state().await.unwrap();
        assert!(c.create_volume(vol("a")).await.is_err());
        assert_eq!(c.state().await.unwrap(), before);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_corrupt_state_file_is_reported_not_replaced() {
        let dir = tmpdir();
        fs::write(dir.join("state.json"), b"{ not json").unwrap();
        let e = LocalCoordinator::open(&dir).err().expect("must fail");
        assert!(e.to_string().contains("state.json"), "{e}");
        assert_eq!(fs::read(dir.join("state.json")).unwrap(), b"{ not json");
        fs::remove_dir_all(&dir).unwrap();
    }
}
