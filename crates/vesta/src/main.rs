//! `vesta`: the command line for operators and scripts. Every command talks to `vestad`'s
//! admin API; `--json` prints the API's answer as is, otherwise a table for people.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use clap::{Parser, Subcommand};
use serde::de::DeserializeOwned;
use serde::Serialize;

use vesta_api::{self as api, format_size, parse_size};

mod balancing;

#[derive(Parser)]
#[command(name = "vesta", version, about = "Control a Vesta daemon (vestad)")]
struct Cli {
    /// Admin API of the vestad to talk to.
    #[arg(
        long,
        env = "VESTA_API",
        default_value = "http://127.0.0.1:7370",
        global = true
    )]
    api: String,
    /// Print machine-readable JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Datastores: where volumes' bytes live.
    #[command(subcommand)]
    Datastore(DatastoreCmd),
    /// Volumes: the virtual disks served over NBD.
    #[command(subcommand)]
    Volume(VolumeCmd),
    /// IO rates, latency percentiles and outstanding IOs per volume and datastore.
    Stats {
        /// Only this volume (and its datastore).
        volume: Option<String>,
        /// The balancing models instead: each volume's characteristics at p90 and load L,
        /// each datastore's performance P and fit.
        #[arg(long, conflicts_with = "volume")]
        models: bool,
    },
    /// Balance volumes across datastores (BASIL).
    #[command(subcommand)]
    Balance(BalanceCmd),
    /// Fit the workload model's constants with a fio sweep against a scratch volume on
    /// DATASTORE, and store them. Needs fio on this host.
    Calibrate {
        datastore: String,
        /// The paper's full 750-experiment sweep instead of the short 16-experiment one.
        #[arg(long)]
        full: bool,
        /// Seconds each experiment runs (after 1 s of ramp).
        #[arg(long, default_value_t = 3)]
        runtime: u32,
        /// Size of the scratch volume.
        #[arg(long, default_value = "1G")]
        size: String,
    },
    /// Hosts of the cluster: fault domain, liveness, cache use.
    #[command(subcommand)]
    Host(HostCmd),
    /// Daemon status: version, addresses, counts.
    Status,
}

#[derive(Subcommand)]
enum HostCmd {
    /// Every host that registered: alive or down, fault domain, addresses, cache use and
    /// how many volumes it owns.
    List,
    /// Surrogate replay: destage what a dead host's cache device holds (its file, moved or
    /// reachable here) to the datastores, for volumes whose owner and peers are all gone.
    ReplayCache {
        /// The cache file or device as this host sees it.
        path: String,
        /// Replay a volume even though a peer began replaying it from below the file's
        /// checkpoint and did not finish: blocks that replay set back stay old. Only when
        /// none of its peers can come back to finish it.
        #[arg(long)]
        force: bool,
    },
}

#[derive(Subcommand)]
enum BalanceCmd {
    /// Propose moves that even out the datastores' normalized load, with the predicted load
    /// per datastore before and after. Nothing is moved.
    Plan {
        /// At most this many moves.
        #[arg(long)]
        max_moves: Option<usize>,
        /// Stop once the imbalance f (σ/mean of normalized load) is at or under this.
        #[arg(long)]
        threshold: Option<f64>,
    },
}

#[derive(Subcommand)]
enum DatastoreCmd {
    /// Add a datastore: a directory of image files, or a whole device / NBD export.
    Add {
        name: String,
        /// A directory; each volume becomes NAME.raw in it.
        #[arg(long, conflicts_with = "lun", required_unless_present = "lun")]
        dir: Option<PathBuf>,
        /// A block device, a file, or an NBD URI (nbd://HOST:PORT/EXPORT,
        /// nbd+unix:///EXPORT?socket=PATH); Vesta formats it with a label.
        #[arg(long)]
        lun: Option<String>,
        /// Device class, used by migration cost and SSD wear accounting.
        #[arg(long, value_parser = ["ssd", "hdd"])]
        class: Option<String>,
        /// Most IOs Vesta keeps in flight to this datastore.
        #[arg(long)]
        queue_depth: Option<u32>,
        /// Format a LUN even if it holds data that is not Vesta's (destroys that data).
        #[arg(long)]
        force: bool,
        /// Take over a LUN that pod (another cluster, or a single host whose data directory
        /// was lost; the refusal names its id) formatted: its volumes come along, and that
        /// pod can no longer use it. Only once that pod is gone for good.
        #[arg(long, value_name = "POD")]
        take_over: Option<String>,
        /// Read and write it with O_DIRECT, past this host's page cache: for a directory or
        /// device that several hosts share (NFS, a SAN disk). Not for NBD URIs.
        #[arg(long)]
        direct: bool,
    },
    /// List datastores with capacity and status.
    List,
}

#[derive(Subcommand)]
enum VolumeCmd {
    /// Create a volume.
    Create {
        name: String,
        /// Size, e.g. 10G, 512M (binary units).
        #[arg(long)]
        size: String,
        /// Datastore to create it on (default: the only one; with several, the one the
        /// balancing models place it on, with the reason printed).
        #[arg(long)]
        datastore: Option<String>,
        /// Cache policy: uncached, wt (write-through), wb (write-back), or wbp:P[:rule]
        /// (write-back with P peer hosts; rule local, remote or any fault domain).
        #[arg(long)]
        policy: Option<String>,
        #[command(flatten)]
        tuning: TuningArgs,
    },
    /// Change a volume's cache policy (and write-back tuning) while it serves IO. Leaving wb
    /// first destages all dirty data.
    Policy {
        name: String,
        /// uncached, wt, wb, or wbp:P[:local|remote|any].
        policy: String,
        #[command(flatten)]
        tuning: TuningArgs,
    },
    /// List volumes.
    List,
    /// Show one volume.
    Show { name: String },
    /// Delete a volume and its data.
    Delete {
        name: String,
        /// Delete even while clients are attached (they are disconnected).
        #[arg(long)]
        force: bool,
    },
    /// Move a volume to another datastore. Only --offline exists so far: the volume must
    /// have no clients and no dirty data; it is copied, then serves from the new place.
    Relocate {
        name: String,
        #[arg(long)]
        datastore: String,
        /// Copy while detached (required until live migration exists).
        #[arg(long)]
        offline: bool,
    },
    /// Give up what this host's failed cache device held of a volume, when no peer can
    /// replay it: the volume goes on uncached from what its datastore holds. Without --yes,
    /// only says what would be lost.
    AcceptLoss {
        name: String,
        /// Accept the loss (dirty data that only the failed cache held is dropped).
        #[arg(long)]
        yes: bool,
    },
    /// Print the NBD URI a client uses to reach the volume.
    Url {
        name: String,
        /// The TCP URI instead of the unix socket one.
        #[arg(long)]
        tcp: bool,
    },
}

/// Write-back tuning (DESIGN §3).
#[derive(clap::Args, Debug, Default)]
struct TuningArgs {
    /// Seconds a destage window is held open to absorb overwrites (0: destage at once).
    #[arg(long)]
    hold: Option<f64>,
    /// Seconds after which dirty data is destaged even while a window is held.
    #[arg(long)]
    max_dirty_age: Option<f64>,
    /// Recovery point objective in seconds: flow control keeps dirty data destageable in it.
    #[arg(long)]
    rpo: Option<f64>,
}

struct Client {
    base: String,
    agent: ureq::Agent,
}

impl Client {
    fn new(base: &str) -> Client {
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(600)))
            .build()
            .into();
        Client {
            base: base.trim_end_matches('/').to_owned(),
            agent,
        }
    }

    fn unreachable(&self, e: ureq::Error) -> anyhow::Error {
        if let ureq::Error::Timeout(t) = e {
            return anyhow!(
                "vestad at {} did not answer in time ({t}); what was asked may still be \
                 under way there: see `vesta volume show` or its log",
                self.base
            );
        }
        anyhow!(
            "cannot reach vestad at {}: {e}. Is it running? Start it with `make run` or \
             `vestad`, or point --api / VESTA_API at it",
            self.base
        )
    }

    fn answer<T: DeserializeOwned>(
        &self,
        r: Result<ureq::http::Response<ureq::Body>, ureq::Error>,
    ) -> anyhow::Result<T> {
        let mut r = r.map_err(|e| self.unreachable(e))?;
        let status = r.status();
        let text = r
            .body_mut()
            .read_to_string()
            .context("read vestad's answer")?;
        if !status.is_success() {
            let msg = serde_json::from_str::<api::ApiError>(&text)
                .map(|e| e.error)
                .unwrap_or(text);
            bail!("{msg}");
        }
        serde_json::from_str(&text)
            .with_context(|| format!("vestad answered {status} with unexpected JSON"))
    }

    fn get<T: DeserializeOwned>(&self, path: &str) -> anyhow::Result<T> {
        self.answer(self.agent.get(format!("{}{path}", self.base)).call())
    }

    fn post<B: Serialize, T: DeserializeOwned>(&self, path: &str, body: &B) -> anyhow::Result<T> {
        self.answer(
            self.agent
                .post(format!("{}{path}", self.base))
                .send_json(body),
        )
    }

    /// [`Client::post`] for operations that take as long as they take (copying a volume,
    /// draining a volume's dirty data before a policy change): no overall timeout.
    fn post_long<B: Serialize, T: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
    ) -> anyhow::Result<T> {
        self.answer(
            self.agent
                .post(format!("{}{path}", self.base))
                .config()
                .timeout_global(None)
                .build()
                .send_json(body),
        )
    }

    fn put<B: Serialize, T: DeserializeOwned>(&self, path: &str, body: &B) -> anyhow::Result<T> {
        self.answer(
            self.agent
                .put(format!("{}{path}", self.base))
                .send_json(body),
        )
    }

    fn delete<T: DeserializeOwned>(&self, path: &str) -> anyhow::Result<T> {
        self.answer(self.agent.delete(format!("{}{path}", self.base)).call())
    }
}

/// `s` as one segment of a URL path or a query value: every byte but the unreserved ones
/// percent-encoded, so a name holding `?`, `/` or `#` reaches the daemon as itself (and is
/// refused there as a name) instead of changing the request.
fn seg(s: &str) -> String {
    if s == "." || s == ".." {
        // Dot segments a client library may resolve away.
        return s.replace('.', "%2E");
    }
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// `vesta volume accept-loss`, for people.
fn print_loss(r: &api::LossReport) {
    let what = match (r.dirty_bytes, r.dirty_writes) {
        (Some(b), Some(w)) => format!("{} of dirty data ({w} write(s))", format_size(b)),
        _ => "the writes its peers held (this host's cache device was replaced, so it \
              cannot say how many)"
            .into(),
    };
    let peers = if r.peers.is_empty() {
        String::new()
    } else {
        format!(
            "; peers {}{}",
            r.peers.join(", "),
            r.peers_said
                .as_deref()
                .map(|s| format!(" ({s})"))
                .unwrap_or_default()
        )
    };
    // `checkpoint` numbers the volume's writes in the cache, in the order they were made.
    let kept = if r.checkpoint == 0 {
        format!(
            "what datastore {} holds (none of the writes made through the cache had reached it)",
            r.datastore
        )
    } else {
        format!(
            "what datastore {} holds (every write made through the cache up to #{}, the last \
             destaged)",
            r.datastore, r.checkpoint
        )
    };
    if r.accepted {
        println!(
            "volume {}: loss accepted; {what} dropped{peers}. It serves {kept}, uncached. \
             Check the guest's file system.",
            r.name
        );
    } else {
        let lost = match (r.dirty_bytes.is_some(), r.peers.is_empty()) {
            (true, true) => format!("this host's cache device failed holding {what}"),
            (true, false) => format!(
                "this host's cache device failed holding {what}, which no peer has replayed"
            ),
            (false, _) => format!("no peer has replayed {what}"),
        };
        println!(
            "volume {}: {lost}{peers}. Accepting the loss drops it: the volume then serves \
             {kept}, and the guest's file system should be checked.",
            r.name
        );
    }
}

fn print_json<T: Serialize>(v: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

/// Prints rows as left-aligned columns.
fn table(header: &[&str], rows: Vec<Vec<String>>) {
    let mut w: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let s: Vec<String> = cells
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{c:<width$}", width = w[i]))
            .collect();
        println!("{}", s.join("  ").trim_end());
    };
    line(header.iter().map(|s| s.to_string()).collect());
    for r in rows {
        line(r);
    }
}

/// Free space, and how much of it sparse volume images may still take as they are written.
/// A datastore's kind, and `/direct` where it is read and written with `O_DIRECT`.
fn kind_shown(d: &api::DatastoreInfo) -> String {
    if d.direct {
        format!("{}/direct", d.kind)
    } else {
        d.kind.clone()
    }
}

fn free_shown(d: &api::DatastoreInfo) -> String {
    match d.unwritten_bytes.filter(|n| *n > 0) {
        Some(u) => format!("{} ({} unwritten)", opt_size(d.free_bytes), format_size(u)),
        None => opt_size(d.free_bytes),
    }
}

fn opt_size(n: Option<u64>) -> String {
    n.map(format_size).unwrap_or_else(|| "-".into())
}

/// The policy in effect, and the one asked for when they differ.
fn policy_shown(v: &api::VolumeInfo) -> String {
    match &v.policy_asked {
        Some(a) => format!("{} ({a} asked)", v.policy),
        None => v.policy.clone(),
    }
}

fn lat(us: Option<u64>) -> String {
    match us {
        None => "-".into(),
        Some(u) if u < 1000 => format!("{u}us"),
        Some(u) if u < 1_000_000 => format!("{:.1}ms", u as f64 / 1000.0),
        Some(u) => format!("{:.1}s", u as f64 / 1e6),
    }
}

fn rate(bytes_per_s: f64) -> String {
    format!("{:.1}", bytes_per_s / (1 << 20) as f64)
}

/// How often a long operation's progress is looked up.
const PROGRESS_EVERY: Duration = Duration::from_secs(1);
/// How often it is printed when stderr is not a terminal (a log, a script's capture).
const PROGRESS_LOGGED: Duration = Duration::from_secs(10);

/// Runs `op`, a long request about volume `name` (a drain, a copy), and meanwhile, if `show`,
/// reports on stderr how far it is: `line` of the volume as vestad shows it, looked up every
/// [`PROGRESS_EVERY`]. On a terminal one line is rewritten in place; elsewhere a line is
/// printed at most every [`PROGRESS_LOGGED`], and only when it says something new. A lookup
/// that fails is skipped: progress never fails the operation.
fn with_progress<T: Send>(
    c: &Client,
    name: &str,
    show: bool,
    line: impl Fn(&api::VolumeInfo) -> Option<String> + Sync,
    op: impl FnOnce() -> anyhow::Result<T> + Send,
) -> anyhow::Result<T> {
    use std::io::IsTerminal as _;
    if !show {
        return op();
    }
    let terminal = std::io::stderr().is_terminal();
    let (done, wait) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|scope| {
        let line = &line;
        let poller = scope.spawn(move || {
            let path = format!("/v1/volumes/{}", seg(name));
            let mut last = String::new();
            let mut printed: Option<std::time::Instant> = None;
            let mut rewritten = false;
            while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                wait.recv_timeout(PROGRESS_EVERY)
            {
                let Some(now) = c.get::<api::VolumeInfo>(&path).ok().and_then(|v| line(&v)) else {
                    continue;
                };
                if terminal {
                    eprint!("\r  {now}\x1b[K");
                    rewritten = true;
                } else if now != last && printed.is_none_or(|t| t.elapsed() >= PROGRESS_LOGGED) {
                    eprintln!("  {now}");
                    printed = Some(std::time::Instant::now());
                }
                last = now;
            }
            if rewritten {
                eprintln!();
            }
        });
        let r = op();
        drop(done);
        let _ = poller.join();
        r
    })
}

/// A draining policy change's progress: the dirty data left, and the destage rate once one
/// was measured.
fn drain_left(v: &api::VolumeInfo) -> Option<String> {
    let c = v.cache.as_ref()?;
    let left = format!("{} of dirty data left", format_size(c.dirty_bytes));
    Some(if c.destage_bytes_per_s > 0.0 {
        format!("{left}, destaging at {} MiB/s", rate(c.destage_bytes_per_s))
    } else {
        left
    })
}

/// A relocation's progress, from the volume's status ("… (48 MiB of 64 MiB copied, 75 %)").
fn copied_so_far(v: &api::VolumeInfo) -> Option<String> {
    let (_, rest) = v.status.rsplit_once('(')?;
    let inner = rest.strip_suffix(')')?;
    inner.contains("copied").then(|| inner.to_owned())
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let c = Client::new(&cli.api);
    match cli.cmd {
        Cmd::Status => {
            let s: api::Status = c.get("/v1/status")?;
            if cli.json {
                return print_json(&s);
            }
            println!("vestad {}", s.version);
            println!("data dir     {}", s.data_dir);
            println!("host         {} (fault domain {})", s.host, s.fault_domain);
            println!("coordinator  {} (pod {})", s.coordinator, s.pod);
            println!("api          http://{}", s.api);
            println!("nbd unix     {}", s.nbd_unix.as_deref().unwrap_or("-"));
            println!("nbd tcp      {}", s.nbd_tcp.as_deref().unwrap_or("-"));
            println!("volumes      {}", s.volumes);
            println!("datastores   {}", s.datastores);
        }
        Cmd::Datastore(DatastoreCmd::Add {
            name,
            dir,
            lun,
            class,
            queue_depth,
            force,
            take_over,
            direct,
        }) => {
            let dir = match dir {
                Some(d) => Some(
                    std::path::absolute(&d)
                        .with_context(|| format!("resolve {}", d.display()))?
                        .display()
                        .to_string(),
                ),
                None => None,
            };
            // A LUN given as a path, like --dir, is resolved here: vestad may run in another
            // directory, and resolved there it could name (and with --force format) another
            // file.
            let lun = match lun {
                Some(l) if !l.contains("://") => Some(
                    std::path::absolute(&l)
                        .with_context(|| format!("resolve {l}"))?
                        .display()
                        .to_string(),
                ),
                l => l,
            };
            let req = api::AddDatastore {
                name,
                dir,
                lun,
                class,
                queue_depth,
                force,
                take_over,
                direct,
            };
            let d: api::DatastoreInfo = c.post("/v1/datastores", &req)?;
            if cli.json {
                return print_json(&d);
            }
            println!(
                "added datastore {} ({} {}, class {}, queue depth {}, {} free)",
                d.name,
                kind_shown(&d),
                d.location,
                d.class,
                d.queue_depth,
                opt_size(d.free_bytes)
            );
            if d.volumes > 0 {
                println!("it holds {} volume(s); see `vesta volume list`", d.volumes);
            }
        }
        Cmd::Datastore(DatastoreCmd::List) => {
            let v: Vec<api::DatastoreInfo> = c.get("/v1/datastores")?;
            if cli.json {
                return print_json(&v);
            }
            table(
                &[
                    "NAME", "KIND", "CLASS", "QD", "SIZE", "FREE", "VOLUMES", "STATUS", "LOCATION",
                ],
                v.into_iter()
                    .map(|d| {
                        let free = free_shown(&d);
                        vec![
                            d.name.clone(),
                            kind_shown(&d),
                            d.class,
                            d.queue_depth.to_string(),
                            opt_size(d.total_bytes),
                            free,
                            d.volumes.to_string(),
                            d.status,
                            d.location,
                        ]
                    })
                    .collect(),
            );
        }
        Cmd::Volume(VolumeCmd::Create {
            name,
            size,
            datastore,
            policy,
            tuning,
        }) => {
            let size = parse_size(&size).map_err(|e| anyhow!("--size: {e}"))?;
            let req = api::CreateVolume {
                name,
                size,
                datastore,
                policy,
                hold_s: tuning.hold,
                max_dirty_age_s: tuning.max_dirty_age,
                rpo_s: tuning.rpo,
            };
            let v: api::VolumeInfo = c.post("/v1/volumes", &req)?;
            if cli.json {
                return print_json(&v);
            }
            println!(
                "created volume {} ({}) on datastore {}, policy {}",
                v.name,
                format_size(v.size),
                v.datastore,
                v.policy
            );
            if let Some(p) = &v.placement {
                println!("placed: {}", p.reason);
            }
            if let Some(u) = v.urls.first() {
                println!("connect: {u}");
            }
        }
        Cmd::Volume(VolumeCmd::Policy {
            name,
            policy,
            tuning,
        }) => {
            let req = api::SetPolicy {
                policy,
                hold_s: tuning.hold,
                max_dirty_age_s: tuning.max_dirty_age,
                rpo_s: tuning.rpo,
            };
            // Leaving write-back drains dirty data first, which can take a while: say so
            // (only for the policies that do; a misspelt one is refused at once).
            let drains = matches!(req.policy.as_str(), "uncached" | "wt");
            if !cli.json && drains {
                eprintln!("changing the policy of {name} (dirty data destages first)…");
            }
            let v: api::VolumeInfo =
                with_progress(&c, &name, !cli.json && drains, drain_left, || {
                    c.post_long(&format!("/v1/volumes/{}/policy", seg(&name)), &req)
                })?;
            if cli.json {
                return print_json(&v);
            }
            println!("volume {} now has policy {}", v.name, v.policy);
        }
        Cmd::Volume(VolumeCmd::List) => {
            let v: Vec<api::VolumeInfo> = c.get("/v1/volumes")?;
            if cli.json {
                return print_json(&v);
            }
            table(
                &[
                    "NAME",
                    "SIZE",
                    "DATASTORE",
                    "POLICY",
                    "OWNER",
                    "CONNS",
                    "STATUS",
                ],
                v.into_iter()
                    .map(|v| {
                        let policy = policy_shown(&v);
                        vec![
                            v.name,
                            format_size(v.size),
                            v.datastore,
                            policy,
                            v.owner.unwrap_or_else(|| "-".into()),
                            v.connections.to_string(),
                            v.status,
                        ]
                    })
                    .collect(),
            );
        }
        Cmd::Host(HostCmd::ReplayCache { path, force }) => {
            let path = std::fs::canonicalize(&path)
                .map(|p| p.display().to_string())
                .unwrap_or(path);
            let r: api::SurrogateReport = c.post_long(
                "/v1/hosts/replay-cache",
                &api::SurrogateReplay { path, force },
            )?;
            if cli.json {
                print_json(&r)?;
            } else {
                if r.volumes.is_empty() {
                    println!("no dirty data for any volume in that cache");
                }
                for l in &r.volumes {
                    println!("{l}");
                }
            }
            if r.not_replayed > 0 {
                bail!(
                    "{} volume(s) with dirty data in that cache were not replayed (see above)",
                    r.not_replayed
                );
            }
        }
        Cmd::Host(HostCmd::List) => {
            let hosts: Vec<api::HostInfo> = c.get("/v1/hosts")?;
            if cli.json {
                return print_json(&hosts);
            }
            table(
                &[
                    "NAME",
                    "FAULT DOMAIN",
                    "STATE",
                    "VOLUMES",
                    "CACHE USED",
                    "API",
                    "NBD",
                ],
                hosts
                    .into_iter()
                    .map(|h| {
                        vec![
                            h.name,
                            h.fault_domain,
                            if h.alive { "alive" } else { "down" }.into(),
                            h.volumes.to_string(),
                            if h.cache_bytes == 0 {
                                "-".into()
                            } else {
                                format!(
                                    "{} of {}",
                                    format_size(h.cache_used_bytes),
                                    format_size(h.cache_bytes)
                                )
                            },
                            h.api.unwrap_or_else(|| "-".into()),
                            h.nbd.unwrap_or_else(|| "-".into()),
                        ]
                    })
                    .collect(),
            );
        }
        Cmd::Volume(VolumeCmd::Show { name }) => {
            let v: api::VolumeInfo = c.get(&format!("/v1/volumes/{}", seg(&name)))?;
            if cli.json {
                return print_json(&v);
            }
            println!("name         {}", v.name);
            println!("id           {}", v.id);
            println!("size         {} ({} bytes)", format_size(v.size), v.size);
            println!("datastore    {}", v.datastore);
            println!("policy       {}", policy_shown(&v));
            if let Some(o) = &v.owner {
                println!("owner        {o}");
            }
            println!("status       {}", v.status);
            println!("connections  {}", v.connections);
            for u in &v.urls {
                println!("url          {u}");
            }
            let t = &v.tuning;
            if let Some(h) = t.hold_s {
                println!("hold         {h}s");
            }
            if let Some(a) = t.max_dirty_age_s {
                println!("max dirty    {a}s");
            }
            if let Some(r) = t.rpo_s {
                println!("rpo          {r}s");
            }
            if let Some(c) = &v.cache {
                println!("cache        {} (gen {})", c.mode, c.gen);
                println!(
                    "  share      {} used of {}; {} segment(s) evicted; {} write(s) waited for free space",
                    format_size(c.used_bytes),
                    format_size(c.share_bytes),
                    c.evicted_segments,
                    c.space_waits
                );
                println!(
                    "  dirty      {} in {} write(s); checkpoint {} of {}",
                    format_size(c.dirty_bytes),
                    c.dirty_writes,
                    c.checkpoint,
                    c.last_ser
                );
                println!(
                    "  hit ratio  {}",
                    c.read_hit_ratio
                        .map(|r| format!("{:.1}%", r * 100.0))
                        .unwrap_or_else(|| "-".into())
                );
                println!(
                    "  destage    {} in {} write(s), {}/s while destaging, datastore write latency {}",
                    format_size(c.destaged_bytes),
                    c.destaged_writes,
                    format_size(c.destage_bytes_per_s as u64),
                    lat(c.datastore_write_latency_us)
                );
                println!(
                    "  flow       {} (pressure {:.2}); {} write(s) throttled, {} of delay added in all, {} stall(s)",
                    c.flow_control,
                    c.flow_pressure,
                    c.throttled_writes,
                    lat(Some(c.throttle_delay_us_total)),
                    c.stalls
                );
                if c.longest_write_us > 0 {
                    println!(
                        "  holds      longest write {}; {} throttled past 4x the datastore latency + 1ms",
                        lat(Some(c.longest_write_us)),
                        c.throttled_past_bound
                    );
                }
                for p in &c.peers {
                    println!(
                        "  peer       {}: acknowledged write {}, {} behind{}",
                        p.host,
                        p.acked_ser,
                        p.lag_writes,
                        p.error
                            .as_ref()
                            .map(|e| format!("; FAILED: {e}"))
                            .unwrap_or_default()
                    );
                }
                if c.replaying {
                    println!(
                        "  replaying  dirty data from before a crash; writes wait; sent to the \
                         datastore up to write {} of {} (checkpoint at the end)",
                        c.replay_sent, c.replay_end
                    );
                }
                if let Some(d) = &c.degraded {
                    println!("  DEGRADED   {d}");
                }
                if let Some(e) = &c.destage_error {
                    println!("  destage    failing, retrying: {e}");
                }
            }
        }
        Cmd::Volume(VolumeCmd::Delete { name, force }) => {
            let v: api::VolumeInfo = c.delete(&format!(
                "/v1/volumes/{}{}",
                seg(&name),
                if force { "?force=true" } else { "" }
            ))?;
            if cli.json {
                return print_json(&v);
            }
            println!("deleted volume {} ({})", v.name, format_size(v.size));
        }
        Cmd::Volume(VolumeCmd::AcceptLoss { name, yes }) => {
            let r: api::LossReport = c.post_long(
                &format!("/v1/volumes/{}/accept-loss", seg(&name)),
                &api::AcceptLoss { dry_run: !yes },
            )?;
            if cli.json {
                print_json(&r)?;
            } else {
                print_loss(&r);
            }
            if !r.accepted {
                bail!("nothing was changed; run again with --yes to accept the loss");
            }
        }
        Cmd::Volume(VolumeCmd::Url { name, tcp }) => {
            let v: api::VolumeInfo = c.get(&format!("/v1/volumes/{}", seg(&name)))?;
            if cli.json {
                return print_json(&v.urls);
            }
            let pick = v.urls.iter().find(|u| {
                if tcp {
                    u.starts_with("nbd://")
                } else {
                    u.starts_with("nbd+unix://")
                }
            });
            match pick.or(v.urls.first()) {
                Some(u) => println!("{u}"),
                None => bail!("vestad has no NBD listener enabled; set [nbd] unix or tcp"),
            }
        }
        Cmd::Stats { models: true, .. } => {
            let r: api::ModelsReport = c.get("/v1/models")?;
            if cli.json {
                return print_json(&r);
            }
            balancing::print_models(&r);
        }
        Cmd::Balance(BalanceCmd::Plan {
            max_moves,
            threshold,
        }) => {
            let mut q = Vec::new();
            if let Some(m) = max_moves {
                q.push(format!("max_moves={m}"));
            }
            if let Some(t) = threshold {
                q.push(format!("threshold={t}"));
            }
            let path = if q.is_empty() {
                "/v1/balance/plan".to_string()
            } else {
                format!("/v1/balance/plan?{}", q.join("&"))
            };
            let p: api::BalancePlan = c.get(&path)?;
            if cli.json {
                return print_json(&p);
            }
            balancing::print_plan(&p);
        }
        Cmd::Calibrate {
            datastore,
            full,
            runtime,
            size,
        } => {
            let size = parse_size(&size).map_err(|e| anyhow!("--size: {e}"))?;
            if runtime == 0 {
                bail!("--runtime must be at least 1 second");
            }
            balancing::calibrate(
                &c,
                balancing::CalibrateArgs {
                    datastore,
                    full,
                    runtime_s: runtime,
                    size,
                    json: cli.json,
                },
            )?;
        }
        Cmd::Volume(VolumeCmd::Relocate {
            name,
            datastore,
            offline,
        }) => {
            if !offline {
                bail!(
                    "live relocation is not available yet; detach the volume's clients and \
                     pass --offline"
                );
            }
            if !cli.json {
                eprintln!(
                    "copying volume {name} to datastore {datastore}; `vesta volume show {name}` \
                     shows how far it is, and the volume serves again when this returns"
                );
            }
            let started = std::time::Instant::now();
            let v: api::VolumeInfo = with_progress(&c, &name, !cli.json, copied_so_far, || {
                c.post_long(
                    &format!("/v1/volumes/{}/relocate", seg(&name)),
                    &api::Relocate { datastore, offline },
                )
            })?;
            if cli.json {
                return print_json(&v);
            }
            println!(
                "relocated volume {} ({}) to datastore {} in {:.1} s",
                v.name,
                format_size(v.size),
                v.datastore,
                started.elapsed().as_secs_f64()
            );
        }
        Cmd::Stats { volume, .. } => {
            let path = match &volume {
                Some(v) => format!("/v1/stats?volume={}", seg(v)),
                None => "/v1/stats".into(),
            };
            let r: api::StatsReport = c.get(&path)?;
            if cli.json {
                return print_json(&r);
            }
            if r.interval_s > 0.0 {
                println!("rates and percentiles over the last {:.1}s", r.interval_s);
            } else {
                println!("the first statistics interval is not complete yet; rates show 0");
            }
            table(
                &[
                    "VOLUME",
                    "DATASTORE",
                    "POLICY",
                    "R-IOPS",
                    "W-IOPS",
                    "R-MiB/s",
                    "W-MiB/s",
                    "R-P50",
                    "R-P99",
                    "W-P50",
                    "W-P99",
                    "OIO",
                    "OIO-AVG",
                    "ERR",
                ],
                r.volumes
                    .into_iter()
                    .map(|v| {
                        vec![
                            v.name,
                            v.datastore,
                            v.policy,
                            format!("{:.0}", v.io.read_iops),
                            format!("{:.0}", v.io.write_iops),
                            rate(v.io.read_bytes_per_s),
                            rate(v.io.write_bytes_per_s),
                            lat(v.io.read_latency_us_p50),
                            lat(v.io.read_latency_us_p99),
                            lat(v.io.write_latency_us_p50),
                            lat(v.io.write_latency_us_p99),
                            v.io.outstanding.to_string(),
                            format!("{:.1}", v.io.outstanding_mean),
                            v.io.errors.to_string(),
                        ]
                    })
                    .collect(),
            );
            println!();
            table(
                &[
                    "DATASTORE",
                    "QD",
                    "R-IOPS",
                    "W-IOPS",
                    "R-MiB/s",
                    "W-MiB/s",
                    "R-P50",
                    "R-P99",
                    "W-P50",
                    "W-P99",
                    "OIO",
                    "OIO-AVG",
                    "ERR",
                ],
                r.datastores
                    .into_iter()
                    .map(|d| {
                        vec![
                            d.name,
                            d.queue_depth.to_string(),
                            format!("{:.0}", d.io.read_iops),
                            format!("{:.0}", d.io.write_iops),
                            rate(d.io.read_bytes_per_s),
                            rate(d.io.write_bytes_per_s),
                            lat(d.io.read_latency_us_p50),
                            lat(d.io.read_latency_us_p99),
                            lat(d.io.write_latency_us_p50),
                            lat(d.io.write_latency_us_p99),
                            d.io.outstanding.to_string(),
                            format!("{:.1}", d.io.outstanding_mean),
                            d.io.errors.to_string(),
                        ]
                    })
                    .collect(),
            );
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    // `vesta … | head` should end quietly when head does, as other command-line tools do,
    // not panic on the closed pipe.
    // SAFETY: called before any thread exists; SIG_DFL is a valid disposition.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vesta: {e:#}");
            ExitCode::FAILURE
        }
    }
}
