//! `vestad`: the Vesta daemon. Wires config, coordinator, datastores and volumes, the NBD
//! listeners and the admin API together, and shuts them down in order on SIGTERM:
//! stop accepting, let every connection finish its in-flight requests, flush every volume,
//! exit 0.

mod api;
mod balancing;
mod config;
mod daemon;
mod exports;
mod loss;
mod peers;
mod stats;

/// Test-only fault injection (`--test-faults`).
pub mod faults {
    use std::sync::{Arc, OnceLock};

    use cachelog::{Faulty, FileCache};

    /// The cache device, when faults are enabled.
    pub static CACHE: OnceLock<Arc<Faulty<FileCache>>> = OnceLock::new();
}

use std::future::IntoFuture;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, Context};
use clap::Parser;
use tokio::net::TcpListener;
use tracing::{error, info, warn};

use cachelog::{Faulty, FileCache};
use cluster::etcd::{EtcdConfig, EtcdCoordinator};
use cluster::local::LocalCoordinator;
use cluster::{Coordinator, HostRecord};
use engine::cache::CacheHost;
use nbd::server::{self as nbd_server, ConnTracker};
use nbd::StopHandle;

use crate::config::Config;
use crate::daemon::{Daemon, NbdAddrs};
use crate::exports::Exports;

#[derive(Parser, Debug)]
#[command(
    name = "vestad",
    version,
    about = "Vesta daemon: serves virtual disks over NBD",
    long_about = "Vesta daemon: serves virtual disks over NBD.\n\nWithout --config it runs the \
                  embedded default: data in ./vesta-data, a `dir` datastore named `default`, \
                  NBD on ./vesta-data/nbd.sock and 127.0.0.1:10809, admin API on \
                  127.0.0.1:7370. Flags override the config file."
)]
struct Args {
    /// TOML configuration file.
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// Data directory (state, sockets, the default datastore).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Admin API listen address, e.g. 127.0.0.1:7370 (port 0 picks a free one).
    #[arg(long)]
    api: Option<String>,
    /// NBD TCP listen address; empty disables TCP.
    #[arg(long)]
    nbd_tcp: Option<String>,
    /// NBD unix socket path (relative to the data dir); empty disables it.
    #[arg(long)]
    nbd_unix: Option<String>,
    /// Enables POST /v1/debug/faults, through which tests make the cache device fail. Never
    /// for production.
    #[arg(long, hide = true)]
    test_faults: bool,
}

/// How long shutdown waits for connections to finish their in-flight requests.
const DRAIN_LIMIT: Duration = Duration::from_secs(60);
/// How long a stop waits for the destager's window and every datastore write in service to
/// end, all told. A write still in service then leaves the host's lease to lapse
/// ([`cluster::Coordinator::shutdown`]).
const STOP_WRITES_LIMIT: Duration = Duration::from_secs(30);
/// Written into the data directory once every listener is up; scripts and tests wait for it.
const READY_FILE: &str = "vestad.json";

fn main() -> ExitCode {
    let filter = tracing_subscriber::EnvFilter::try_from_env("VESTA_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .init();
    let args = Args::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("vestad")
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("vestad: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let r = rt.block_on(run(args));
    // Blocking IO stuck in the kernel (a hung NFS mount) must not keep the process alive.
    rt.shutdown_timeout(Duration::from_secs(5));
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error!("vestad: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Holds an exclusive lock on the data directory for the life of the process, so two daemons
/// never share one state file and one set of volumes.
fn lock_data_dir(dir: &Path) -> anyhow::Result<std::fs::File> {
    let path = dir.join("vestad.lock");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(&path)
        .with_context(|| format!("open {}", path.display()))?;
    // SAFETY: flock on a valid fd we own.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let holder = std::fs::read_to_string(&path).unwrap_or_default();
        return Err(anyhow!(
            "another vestad (pid {}) is using data directory {}; stop it or pass another \
             --data-dir",
            holder.trim(),
            dir.display()
        ));
    }
    f.set_len(0)?;
    std::io::Write::write_all(&mut &f, std::process::id().to_string().as_bytes())?;
    Ok(f)
}

async fn bind_tcp(addr: &str, what: &str, flag: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr).await.map_err(|e| {
        anyhow!("cannot listen for {what} on {addr}: {e}; is another vestad running? choose another address with {flag}")
    })
}

fn write_ready(dir: &Path, d: &Daemon) -> anyhow::Result<()> {
    let s = d.status();
    let body = serde_json::json!({
        "pid": std::process::id(),
        "api": s.api,
        "nbd_unix": s.nbd_unix,
        "nbd_tcp": s.nbd_tcp,
    });
    let tmp = dir.join(format!("{READY_FILE}.tmp"));
    std::fs::write(&tmp, serde_json::to_vec_pretty(&body)?)?;
    std::fs::rename(&tmp, dir.join(READY_FILE))?;
    Ok(())
}

/// How often datastores that are down are tried again.
const RETRY_EVERY: Duration = Duration::from_secs(3);

/// How often this host's record (cache use) is published: every fourth retry round.
const PUBLISH_EVERY_ROUNDS: u32 = 4;

async fn retry_unavailable(d: Arc<Daemon>, mut stop: nbd::Stop) {
    let mut round = 0u32;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(RETRY_EVERY) => d.retry_unavailable().await,
            _ = stop.wait() => return,
        }
        round += 1;
        if round.is_multiple_of(PUBLISH_EVERY_ROUNDS) {
            d.publish_host().await;
        }
    }
}

/// The `local` coordinator, or the `etcd` one when `[cluster] etcd` names endpoints.
async fn open_coordinator(config: &Config) -> anyhow::Result<Arc<dyn Coordinator>> {
    let c = &config.cluster;
    let host = HostRecord {
        name: c.host_name(),
        fault_domain: c.fault_domain.clone(),
        ..HostRecord::default()
    };
    if c.etcd.is_empty() {
        return Ok(Arc::new(LocalCoordinator::open_as(&config.data_dir, host)?));
    }
    let coord = EtcdCoordinator::connect(EtcdConfig {
        endpoints: c.etcd.clone(),
        prefix: c.prefix.clone(),
        host,
        lease_ttl: Duration::from_secs(c.lease_ttl_s),
    })
    .await?;
    Ok(Arc::new(coord))
}

async fn run(args: Args) -> anyhow::Result<()> {
    let mut config = match &args.config {
        Some(p) => Config::load(p)?,
        None => Config::default(),
    };
    if let Some(d) = args.data_dir {
        config.data_dir = d;
    }
    if let Some(a) = args.api {
        config.api.listen = a;
    }
    if let Some(t) = args.nbd_tcp {
        config.nbd.tcp = t;
    }
    if let Some(u) = args.nbd_unix {
        config.nbd.unix = u;
    }
    std::fs::create_dir_all(&config.data_dir)
        .with_context(|| format!("create data directory {}", config.data_dir.display()))?;
    // Absolute from here on, so URLs and recorded paths mean the same from any directory.
    config.data_dir = std::fs::canonicalize(&config.data_dir)?;
    let data_dir = config.data_dir.clone();
    let _lock = lock_data_dir(&data_dir)?;
    let _ = std::fs::remove_file(data_dir.join(READY_FILE));

    let coord = open_coordinator(&config).await?;
    // The cache log is scanned before any volume opens: volumes with dirty data replay it.
    let cache = match config.cache_device()? {
        Some((path, size, segment)) => {
            let dev = Arc::new(Faulty::new(
                FileCache::open(&path, size)
                    .with_context(|| format!("open cache device {}", path.display()))?,
            ));
            if args.test_faults {
                warn!("--test-faults: the debug fault API is enabled");
                let _ = faults::CACHE.set(dev.clone());
            }
            // A large, well-used log takes a while to scan (every record's crc is checked).
            info!(
                "cache device {}: scanning {} for recovery",
                path.display(),
                vesta_api::format_size(size)
            );
            let scan = std::time::Instant::now();
            let host = CacheHost::open(dev, segment)
                .map_err(|e| anyhow!("cache device {}: {e}", path.display()))?;
            info!(
                "cache device {} ({} segments of {}), scanned in {:.1?}",
                path.display(),
                host.log().superblock().segment_count,
                vesta_api::format_size(host.log().superblock().segment_size),
                scan.elapsed()
            );
            Some(host)
        }
        None => None,
    };
    let stop_destager = StopHandle::new();
    // Loaded before anything can pick peers or take a peer's connection.
    let peer_key = peer::auth::Key::from_bytes(
        coord
            .peer_key(peer::auth::Key::random_bytes().context("random peer key")?)
            .await
            .context("the pod's peer key")?,
    );
    let daemon = Arc::new(Daemon::start(config.clone(), coord, cache.clone()).await?);
    let mut destager = None;
    let _ = daemon.peers.key.set(peer_key.clone());
    if let Some(host) = &cache {
        host.finish_recovery(&daemon.volume_ids())
            .map_err(|e| anyhow!("cache recovery: {e}"))?;
        let stopped = stop_destager.subscribe();
        destager = Some(tokio::spawn(
            host.clone().run_destager(move || stopped.is_stopped()),
        ));
    }

    // This host as other hosts' wbp peer.
    if let (Some(addr), Some(host)) = (config.cluster.peer_addr(&config.api.listen), &cache) {
        let l = std::net::TcpListener::bind(&addr).map_err(|e| {
            anyhow!("cannot listen for peers on {addr}: {e}; choose another [cluster] peer_listen")
        })?;
        let bound = l.local_addr()?.to_string();
        peer::serve(
            l,
            Arc::new(peers::PeerService {
                host: daemon.coord.host().to_owned(),
                cache: host.clone(),
            }),
            peer_key,
        )?;
        info!("taking peers' writes on {bound}");
        let advertised = match config.cluster.peer_advertise.as_str() {
            "" => bound,
            a => {
                info!("peers are told to reach this host at {a}");
                a.to_owned()
            }
        };
        let _ = daemon.peers.addr.set(advertised);
    }

    let stop = StopHandle::new();
    let (tracker, waiter) = ConnTracker::new();
    let exports = Arc::new(Exports(daemon.clone()));
    let mut addrs = NbdAddrs::default();
    if let Some(path) = config.nbd_unix_path() {
        let l = nbd_server::bind_unix(&path)
            .with_context(|| format!("listen for NBD on unix socket {}", path.display()))?;
        tokio::spawn(nbd_server::serve_unix(
            l,
            exports.clone(),
            stop.subscribe(),
            tracker.clone(),
        ));
        addrs.unix = Some(path);
    }
    if !config.nbd.tcp.is_empty() {
        let l = bind_tcp(&config.nbd.tcp, "NBD", "[nbd] tcp or --nbd-tcp").await?;
        addrs.tcp = Some(l.local_addr()?);
        tokio::spawn(nbd_server::serve_tcp(
            l,
            exports.clone(),
            stop.subscribe(),
            tracker.clone(),
        ));
    }
    drop(tracker);
    let _ = daemon.nbd.set(addrs.clone());

    let api_listener =
        bind_tcp(&config.api.listen, "the admin API", "[api] listen or --api").await?;
    let _ = daemon.api_addr.set(api_listener.local_addr()?);
    let mut api_stop = stop.subscribe();
    let api = tokio::spawn(
        axum::serve(api_listener, api::router(daemon.clone()))
            .with_graceful_shutdown(async move { api_stop.wait().await })
            .into_future(),
    );
    tokio::spawn(stats::run(daemon.clone(), stop.subscribe()));
    tokio::spawn(retry_unavailable(daemon.clone(), stop.subscribe()));
    tokio::spawn(peers::run(daemon.clone(), stop.subscribe()));

    // Handlers go in before the ready file: a SIGTERM sent as soon as it appears must drain.
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    daemon.publish_host().await;
    write_ready(&data_dir, &daemon)?;
    let st = daemon.status();
    info!(
        "vestad ready: host {:?} ({} coordinator), data {}, API http://{}, NBD {}{}, {} \
         volume(s) on {} datastore(s)",
        st.host,
        st.coordinator,
        data_dir.display(),
        st.api,
        st.nbd_unix.as_deref().unwrap_or("-"),
        st.nbd_tcp.map(|t| format!(" and {t}")).unwrap_or_default(),
        st.volumes,
        st.datastores
    );

    let which = tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    };
    info!("{which}: shutting down; draining in-flight IO");
    stop.stop();
    // Nothing reroutes a volume from here (the peer round stops): IO stalled for a hand-off
    // to peers ends (ESHUTDOWN) instead of holding up the drain and the flushes.
    daemon.stop_volumes();
    if tokio::time::timeout(DRAIN_LIMIT, waiter.wait())
        .await
        .is_err()
    {
        warn!("connections still busy after {DRAIN_LIMIT:?}; flushing and exiting anyway");
    }
    daemon.flush_all().await;
    // Dirty data stays in the (synced) cache log and is replayed at the next start. The
    // window in flight ends first (its checkpoint saves the next start some replay), unless
    // its datastore does not answer.
    let writes_stop_by = std::time::Instant::now() + STOP_WRITES_LIMIT;
    stop_destager.stop();
    if let Some(d) = destager {
        if tokio::time::timeout(STOP_WRITES_LIMIT, d).await.is_err() {
            warn!(
                "the destager's window did not end within {STOP_WRITES_LIMIT:?}; stopping anyway"
            );
        }
    }
    let quiet = daemon.stop_datastore_writes(writes_stop_by).await;
    if !quiet && daemon.coord.kind() == "local" {
        warn!(
            "datastore writes still in service at the stop (a datastore that does not answer); \
             they may land after a restart that comes at once"
        );
    }
    let _ = api.await;
    if let Some(p) = &addrs.unix {
        let _ = std::fs::remove_file(p);
    }
    let _ = std::fs::remove_file(data_dir.join(READY_FILE));
    daemon.coord.shutdown(quiet).await;
    info!("vestad stopped cleanly");
    Ok(())
}
