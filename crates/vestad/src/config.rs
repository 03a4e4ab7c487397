//! `vestad`'s configuration: a TOML file given with `--config`, or the embedded default.
//!
//! The embedded default needs no external service: data in `./vesta-data`, one `dir` datastore
//! named `default` under it, NBD on `<data_dir>/nbd.sock` and `127.0.0.1:10809`, the admin API
//! on `127.0.0.1:7370`. A file only has to name what differs. Relative paths inside the data
//! directory (the socket, `dir` datastores) are resolved against `data_dir`; `data_dir` itself
//! against the working directory. Unknown keys are errors, so a typo never silently does
//! nothing.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use serde::Deserialize;

use datastore::{Class, DatastoreSpec, Kind, QUEUE_DEPTH_DEFAULT};

pub const API_DEFAULT: &str = "127.0.0.1:7370";
pub const NBD_TCP_DEFAULT: &str = "127.0.0.1:10809";
pub const NBD_UNIX_DEFAULT: &str = "nbd.sock";
pub const DATA_DIR_DEFAULT: &str = "vesta-data";
/// One hour of 2-second intervals: enough spread in load for a device model, short enough
/// that a workload's model follows its changes within the hour.
pub const HISTORY_DEFAULT: usize = 1800;
/// A day of 2-second intervals: a volume's sample is 40 bytes, so about 1.7 MB per volume
/// and datastore at the limit.
pub const HISTORY_MAX: usize = 43_200;
/// An hour: a client's IO held longer than that is held for good, as far as its VM can tell.
pub const UNREACHABLE_WAIT_MAX_S: u64 = 3600;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub data_dir: PathBuf,
    /// How long a client's IO that must go to a datastore this host cannot reach (an NBD
    /// server restarting) waits for it before it fails; 0 fails it at once.
    pub unreachable_wait_s: u64,
    pub nbd: NbdConfig,
    pub api: ApiConfig,
    pub stats: StatsConfig,
    pub cache: CacheConfig,
    pub cluster: ClusterConfig,
    #[serde(rename = "datastore")]
    pub datastores: Vec<DatastoreConfig>,
}

/// The cluster this host belongs to (DESIGN §4). No `etcd` endpoints: the `local`
/// coordinator, one host with its state in the data directory.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterConfig {
    /// etcd endpoints, e.g. `["http://127.0.0.1:2379"]`; empty = single host.
    pub etcd: Vec<String>,
    /// This host's name in the cluster; empty = the machine's host name.
    pub host: String,
    /// The fault domain (e.g. a rack) peer rules choose by.
    pub fault_domain: String,
    /// Key prefix in etcd: one per pod.
    pub prefix: String,
    /// Seconds the host's lease lives without renewal (3–60). Datastore IO stops after
    /// half of it without a renewal.
    pub lease_ttl_s: u64,
    /// Where other hosts send this host their writes when it is a `wbp` peer (`ip:port`;
    /// port 0 picks a free one, published through the coordinator). Empty: with `etcd`, the
    /// admin API's address with a free port; without, no peer listener (one host has no
    /// peers).
    pub peer_listen: String,
    /// The address other hosts are told to reach the peer listener at, if not the one it is
    /// bound to (a NAT, a proxy); empty = the bound address.
    pub peer_advertise: String,
    /// Seconds a link to a `wbp` peer may stay idle before the owner checks that the peer
    /// still answers (1–3600): a peer gone silent is replaced within this plus the peer
    /// request timeout (10 s), even while the volume writes nothing.
    pub peer_keepalive_s: u64,
}

impl Default for ClusterConfig {
    fn default() -> ClusterConfig {
        ClusterConfig {
            etcd: Vec::new(),
            host: String::new(),
            fault_domain: "default".into(),
            prefix: "/vesta".into(),
            lease_ttl_s: LEASE_TTL_DEFAULT_S,
            peer_listen: String::new(),
            peer_advertise: String::new(),
            peer_keepalive_s: PEER_KEEPALIVE_DEFAULT_S,
        }
    }
}

/// Five seconds: one tiny request per idle link every five seconds, and a silent peer
/// replaced within about fifteen.
pub const PEER_KEEPALIVE_DEFAULT_S: u64 = 5;

/// Six seconds: datastore writes stop 3 s after the last renewal, which leaves a write issued
/// just before that 3 s to land before any contender may take a lock; a vestad killed without
/// warning keeps its volumes for at most this long.
pub const LEASE_TTL_DEFAULT_S: u64 = 6;

impl ClusterConfig {
    /// This host's name: the configured one, else the machine's.
    pub fn host_name(&self) -> String {
        if !self.host.is_empty() {
            return self.host.clone();
        }
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_owned())
            .ok()
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "localhost".into())
    }

    /// The peer listener's address, if this host takes peers' writes; `api_listen` is the
    /// admin API's address, whose IP the default shares.
    pub fn peer_addr(&self, api_listen: &str) -> Option<String> {
        if !self.peer_listen.is_empty() {
            return Some(self.peer_listen.clone());
        }
        if self.etcd.is_empty() {
            return None;
        }
        let ip = api_listen
            .parse::<std::net::SocketAddr>()
            .map(|a| a.ip().to_string())
            .unwrap_or_else(|_| "127.0.0.1".into());
        Some(format!("{ip}:0"))
    }

    fn validate(&self) -> anyhow::Result<()> {
        if !self.peer_listen.is_empty() && self.peer_listen.parse::<std::net::SocketAddr>().is_err()
        {
            bail!(
                "cluster.peer_listen = {:?} is not an ip:port address (e.g. \"10.0.0.5:7100\")",
                self.peer_listen
            );
        }
        if !self.peer_advertise.is_empty()
            && self.peer_advertise.parse::<std::net::SocketAddr>().is_err()
        {
            bail!(
                "cluster.peer_advertise = {:?} is not an ip:port address",
                self.peer_advertise
            );
        }
        if !(3..=60).contains(&self.lease_ttl_s) {
            bail!(
                "cluster.lease_ttl_s = {} is out of range: use 3 to 60 seconds",
                self.lease_ttl_s
            );
        }
        if !(1..=3600).contains(&self.peer_keepalive_s) {
            bail!(
                "cluster.peer_keepalive_s = {} is out of range: use 1 to 3600 seconds",
                self.peer_keepalive_s
            );
        }
        if !self.host.is_empty() {
            datastore::check_name("cluster.host", &self.host)?;
        }
        for e in &self.etcd {
            if !(e.starts_with("http://") || e.starts_with("https://")) {
                bail!("cluster.etcd: endpoint {e:?} must be a URL such as http://127.0.0.1:2379");
            }
        }
        if !self.prefix.starts_with('/') {
            bail!(
                "cluster.prefix = {:?} must start with / (e.g. \"/vesta\")",
                self.prefix
            );
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NbdConfig {
    /// Unix socket path, relative to `data_dir` unless absolute; empty disables it.
    pub unix: String,
    /// TCP listen address; empty disables it.
    pub tcp: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ApiConfig {
    pub listen: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StatsConfig {
    /// Length of a statistics interval in seconds (2–10).
    pub interval_s: f64,
    /// Intervals of history kept per volume and datastore for the balancing models.
    pub history: usize,
}

/// The host's cache device (DESIGN §1: the paper's flash).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CacheConfig {
    /// A file (created sparse) or block device, relative to `data_dir` unless absolute; empty
    /// disables caching (only `uncached` volumes then).
    pub path: String,
    /// Size of a cache file, e.g. "1G" (a block device is used whole).
    pub size: String,
    /// Segment size of a new cache log, e.g. "1M".
    pub segment_size: String,
}

impl Default for CacheConfig {
    fn default() -> CacheConfig {
        CacheConfig {
            path: "cache.img".into(),
            size: "1G".into(),
            segment_size: "1M".into(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatastoreConfig {
    pub name: String,
    /// `dir` or `lun`.
    pub kind: String,
    /// For `dir`: the directory (relative to `data_dir` unless absolute).
    pub path: Option<PathBuf>,
    /// For `lun`: a device or file path, or an NBD URI.
    pub target: Option<String>,
    pub class: Option<String>,
    pub queue_depth: Option<u32>,
    /// Format a `lun` even if it holds foreign data.
    #[serde(default)]
    pub force: bool,
    /// Take over a `lun` that pod (its id, as the refusal names it) formatted: that pod can
    /// no longer use it. Naming the pod keeps a config copied elsewhere from taking another.
    #[serde(default)]
    pub take_over: Option<uuid::Uuid>,
    /// Read and write it with `O_DIRECT`, past this host's page cache: for a datastore
    /// reached by path that several hosts share (a SAN disk, NFS).
    #[serde(default)]
    pub direct: bool,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            data_dir: PathBuf::from(DATA_DIR_DEFAULT),
            unreachable_wait_s: datastore::UNREACHABLE_WAIT_DEFAULT.as_secs(),
            nbd: NbdConfig::default(),
            api: ApiConfig::default(),
            stats: StatsConfig::default(),
            cache: CacheConfig::default(),
            cluster: ClusterConfig::default(),
            datastores: vec![DatastoreConfig {
                name: "default".into(),
                kind: "dir".into(),
                path: Some(PathBuf::from("datastores/default")),
                target: None,
                class: None,
                queue_depth: None,
                force: false,
                take_over: None,
                direct: false,
            }],
        }
    }
}

impl Default for NbdConfig {
    fn default() -> NbdConfig {
        NbdConfig {
            unix: NBD_UNIX_DEFAULT.into(),
            tcp: NBD_TCP_DEFAULT.into(),
        }
    }
}

impl Default for ApiConfig {
    fn default() -> ApiConfig {
        ApiConfig {
            listen: API_DEFAULT.into(),
        }
    }
}

impl Default for StatsConfig {
    fn default() -> StatsConfig {
        StatsConfig {
            interval_s: 2.0,
            history: HISTORY_DEFAULT,
        }
    }
}

impl Config {
    pub fn load(path: &Path) -> anyhow::Result<Config> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("read config file {}", path.display()))?;
        Config::parse(&text).with_context(|| format!("config file {}", path.display()))
    }

    pub fn parse(text: &str) -> anyhow::Result<Config> {
        let c: Config = toml::from_str(text)?;
        c.validate()?;
        Ok(c)
    }

    /// The cache device path, size and segment size, if caching is enabled.
    pub fn cache_device(&self) -> anyhow::Result<Option<(PathBuf, u64, u64)>> {
        if self.cache.path.is_empty() {
            return Ok(None);
        }
        let size = vesta_api::parse_size(&self.cache.size)
            .map_err(|e| anyhow::anyhow!("cache.size: {e}"))?;
        let seg = vesta_api::parse_size(&self.cache.segment_size)
            .map_err(|e| anyhow::anyhow!("cache.segment_size: {e}"))?;
        if !(64 << 10..=64 << 20).contains(&seg) || seg % 4096 != 0 {
            bail!("cache.segment_size must be between 64K and 64M, a multiple of 4K (e.g. 1M)");
        }
        if size < (1 << 20) + 4 * seg {
            bail!(
                "cache.size {} is too small: it must hold 1 MiB of superblock and at least four \
                 segments, e.g. 1G",
                self.cache.size
            );
        }
        Ok(Some((
            self.in_data_dir(Path::new(&self.cache.path)),
            size,
            seg,
        )))
    }

    fn validate(&self) -> anyhow::Result<()> {
        self.cache_device()?;
        self.cluster.validate()?;
        if !(2.0..=10.0).contains(&self.stats.interval_s) {
            bail!(
                "stats.interval_s = {} is out of range: use 2 to 10 seconds",
                self.stats.interval_s
            );
        }
        if self.unreachable_wait_s > UNREACHABLE_WAIT_MAX_S {
            bail!(
                "unreachable_wait_s = {} is out of range: use 0 to {UNREACHABLE_WAIT_MAX_S} \
                 seconds",
                self.unreachable_wait_s
            );
        }
        if !(10..=HISTORY_MAX).contains(&self.stats.history) {
            bail!(
                "stats.history = {} is out of range: keep 10 to {HISTORY_MAX} intervals",
                self.stats.history
            );
        }
        let mut seen = std::collections::HashSet::new();
        for d in &self.datastores {
            if !seen.insert(&d.name) {
                bail!(
                    "datastore {:?} is defined twice; give each a unique name",
                    d.name
                );
            }
            self.datastore_spec(d)?;
        }
        Ok(())
    }

    /// [`Config::unreachable_wait_s`].
    pub fn unreachable_wait(&self) -> Duration {
        Duration::from_secs(self.unreachable_wait_s)
    }

    pub fn stats_interval(&self) -> Duration {
        Duration::from_secs_f64(self.stats.interval_s)
    }

    /// Resolves a path against the data directory.
    pub fn in_data_dir(&self, p: &Path) -> PathBuf {
        if p.is_absolute() {
            p.to_owned()
        } else {
            self.data_dir.join(p)
        }
    }

    pub fn nbd_unix_path(&self) -> Option<PathBuf> {
        (!self.nbd.unix.is_empty()).then(|| self.in_data_dir(Path::new(&self.nbd.unix)))
    }

    /// The spec a configured datastore stands for.
    pub fn datastore_spec(&self, d: &DatastoreConfig) -> anyhow::Result<DatastoreSpec> {
        datastore::check_name("datastore", &d.name)?;
        let kind = match (d.kind.as_str(), &d.path, &d.target) {
            ("dir", Some(p), None) => Kind::Dir {
                path: self.in_data_dir(p),
            },
            ("lun", None, Some(t)) => Kind::Lun {
                target: t.clone(),
                lun_id: None,
            },
            ("dir", _, _) => bail!(
                "datastore {:?}: kind \"dir\" takes `path = \"/some/dir\"` and no `target`",
                d.name
            ),
            ("lun", _, _) => bail!(
                "datastore {:?}: kind \"lun\" takes `target = \"/dev/sdX\"` or \
                 `target = \"nbd://host:port/export\"` and no `path`",
                d.name
            ),
            (other, _, _) => bail!(
                "datastore {:?}: unknown kind {other:?}; use \"dir\" or \"lun\"",
                d.name
            ),
        };
        let class = match &d.class {
            Some(c) => c
                .parse::<Class>()
                .map_err(|e| anyhow::anyhow!("datastore {:?}: {e}", d.name))?,
            None => Class::default(),
        };
        let queue_depth = d.queue_depth.unwrap_or(QUEUE_DEPTH_DEFAULT);
        if queue_depth == 0 {
            bail!("datastore {:?}: queue_depth must be at least 1", d.name);
        }
        datastore::check_direct(&kind, d.direct)
            .map_err(|e| anyhow::anyhow!("datastore {:?}: {e}", d.name))?;
        Ok(DatastoreSpec {
            name: d.name.clone(),
            kind,
            class,
            queue_depth,
            direct: d.direct,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_default_is_self_contained() {
        let c = Config::default();
        c.validate().unwrap();
        assert_eq!(
            c.nbd_unix_path(),
            Some(PathBuf::from("vesta-data/nbd.sock"))
        );
        let spec = c.datastore_spec(&c.datastores[0]).unwrap();
        assert_eq!(
            spec.kind,
            Kind::Dir {
                path: PathBuf::from("vesta-data/datastores/default")
            }
        );
    }

    #[test]
    fn a_file_names_only_what_differs() {
        let c = Config::parse(
            r#"
            data_dir = "/srv/vesta"
            [nbd]
            tcp = ""
            [[datastore]]
            name = "san"
            kind = "lun"
            target = "nbd://127.0.0.1:10810/lun0"
            class = "ssd"
            queue_depth = 16
            "#,
        )
        .unwrap();
        assert_eq!(c.api.listen, API_DEFAULT);
        assert_eq!(c.nbd.tcp, "");
        assert_eq!(
            c.nbd_unix_path(),
            Some(PathBuf::from("/srv/vesta/nbd.sock"))
        );
        assert_eq!(c.datastores.len(), 1);
        let s = c.datastore_spec(&c.datastores[0]).unwrap();
        assert_eq!(s.class, Class::Ssd);
        assert_eq!(s.queue_depth, 16);
    }

    #[test]
    fn mistakes_name_the_field() {
        let e = format!("{:#}", Config::parse("dat_dir = \"x\"").unwrap_err());
        assert!(e.contains("dat_dir"), "{e}");
        let e = format!(
            "{:#}",
            Config::parse("[[datastore]]\nname=\"a\"\nkind=\"dir\"\ntarget=\"x\"").unwrap_err()
        );
        assert!(e.contains("path"), "{e}");
        let e = format!(
            "{:#}",
            Config::parse("[[datastore]]\nname=\"a\"\nkind=\"nfs\"\npath=\"x\"").unwrap_err()
        );
        assert!(e.contains("unknown kind"), "{e}");
        let e = format!(
            "{:#}",
            Config::parse("[stats]\ninterval_s = 60").unwrap_err()
        );
        assert!(e.contains("interval_s"), "{e}");
        let e = format!("{:#}", Config::parse("[stats]\nhistory = 3").unwrap_err());
        assert!(e.contains("stats.history"), "{e}");
        let e = format!(
            "{:#}",
            Config::parse("unreachable_wait_s = 86400").unwrap_err()
        );
        assert!(
            e.contains("unreachable_wait_s") && e.contains("3600"),
            "{e}"
        );
        assert_eq!(
            Config::parse("").unwrap().unreachable_wait(),
            datastore::UNREACHABLE_WAIT_DEFAULT
        );
        assert_eq!(
            Config::parse("unreachable_wait_s = 0")
                .unwrap()
                .unreachable_wait(),
            Duration::ZERO
        );
        assert_eq!(Config::parse("").unwrap().stats.history, HISTORY_DEFAULT);
        let e = format!(
            "{:#}",
            Config::parse(
                "[[datastore]]\nname=\"a\"\nkind=\"dir\"\npath=\"x\"\n[[datastore]]\nname=\"a\"\nkind=\"dir\"\npath=\"y\""
            )
            .unwrap_err()
        );
        assert!(e.contains("twice"), "{e}");
        let e = format!(
            "{:#}",
            Config::parse("[cluster]\nlease_ttl_s = 1").unwrap_err()
        );
        assert!(e.contains("lease_ttl_s"), "{e}");
        let e = format!(
            "{:#}",
            Config::parse("[cluster]\npeer_keepalive_s = 0").unwrap_err()
        );
        assert!(e.contains("peer_keepalive_s"), "{e}");
        let e = format!(
            "{:#}",
            Config::parse("[cluster]\netcd = [\"127.0.0.1:2379\"]").unwrap_err()
        );
        assert!(e.contains("http://"), "{e}");
    }

    #[test]
    fn cluster_section_names_the_host() {
        let c = Config::parse(
            "[cluster]\netcd = [\"http://127.0.0.1:2379\"]\nhost = \"h1\"\nfault_domain = \"rack1\"",
        )
        .unwrap();
        assert_eq!(c.cluster.host_name(), "h1");
        assert_eq!(c.cluster.fault_domain, "rack1");
        assert_eq!(c.cluster.lease_ttl_s, LEASE_TTL_DEFAULT_S);
        assert_eq!(c.cluster.peer_keepalive_s, PEER_KEEPALIVE_DEFAULT_S);
        assert!(Config::default().cluster.etcd.is_empty());
        assert!(!Config::default().cluster.host_name().is_empty());
    }
}
