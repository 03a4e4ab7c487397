//! The test rig: real processes on one machine (DESIGN §10).
//!
//! - [`Vestad`]: a daemon on a fresh data directory with OS-chosen ports, driven through the
//!   real `vesta` CLI.
//! - [`Nbdkit`]: an emulated SAN LUN (`nbdkit file` with filters such as `delay` or `error`).
//! - [`run`]/[`sh`]: real clients (`qemu-io`, `qemu-img`, `nbdsh`, `nbdinfo`, `fio`).
//! - [`raw`]: a hand-driven NBD connection for protocol negatives no real client would send.
//! - [`Etcd`]: a one-member etcd for the cluster tests; [`VestadOpts::ip`] puts each host's
//!   daemon on its own loopback address.
//!
//! Binaries come from `VESTA_BIN_DIR` (set by `make test`), else from the workspace's target
//! directory of the profile the tests are built with. `cargo test -p vesta-tests` alone does
//! not rebuild them: use `make test`, or `cargo test --workspace`.

pub mod checker;
pub mod proxy;
pub mod raw;
pub mod writers;

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;

/// Directory holding the project's binaries.
pub fn bin_dir() -> PathBuf {
    if let Ok(d) = std::env::var("VESTA_BIN_DIR") {
        // A relative path means one from the workspace root, where `make` and cargo are run
        // (tests run in their package's directory, daemons in scratch directories).
        return Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(d);
    }
    let profile = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("target")
        .join(profile);
    assert!(
        dir.join("vestad").exists(),
        "no vestad in {}: run `make test`, or `cargo test --workspace`",
        dir.display()
    );
    dir
}

pub fn bin(name: &str) -> PathBuf {
    bin_dir().join(name)
}

/// A scratch directory removed when dropped, unless the test is panicking (kept for a post
/// mortem, and its path printed).
pub struct Scratch(pub PathBuf);

static SEQ: AtomicU32 = AtomicU32::new(0);

impl Scratch {
    pub fn new(tag: &str) -> Scratch {
        let p = std::env::temp_dir().join(format!(
            "vt-{tag}-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&p);
        fs::create_dir_all(&p).expect("create scratch dir");
        Scratch(p)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    pub fn join(&self, p: &str) -> PathBuf {
        self.0.join(p)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("kept scratch dir for inspection: {}", self.0.display());
        } else {
            let _ = fs::remove_dir_all(&self.0);
        }
    }
}

/// Waits until `f` returns Some, or panics after `limit` with `what`.
pub fn wait_for<T>(limit: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        if start.elapsed() > limit {
            panic!("timed out after {limit:?} waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs a command to completion, capturing output.
pub fn run(cmd: &mut Command) -> Output {
    cmd.stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
}

/// Runs a command and panics with its output unless it succeeds; returns stdout.
pub fn run_ok(cmd: &mut Command) -> String {
    let out = run(cmd);
    if !out.status.success() {
        panic!(
            "{cmd:?} failed with {}\nstdout:\n{}\nstderr:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs a shell snippet.
pub fn sh(script: &str) -> Output {
    run(Command::new("bash").arg("-c").arg(script))
}

/// A running `vestad` on its own data directory.
pub struct Vestad {
    child: Option<Child>,
    pub scratch: Scratch,
    pub data_dir: PathBuf,
    pub api: String,
    pub nbd_unix: PathBuf,
    pub nbd_tcp: String,
    extra_args: Vec<String>,
}

/// How a test wants its daemon.
#[derive(Default, Clone)]
pub struct VestadOpts {
    /// TOML written to `vestad.toml` and passed with `--config` (data_dir is set by the rig).
    pub config: Option<String>,
    /// Loopback address for the API and NBD TCP listeners (a host of its own, e.g.
    /// `127.0.0.2`); `127.0.0.1` if unset.
    pub ip: Option<String>,
    /// Symbolic links (name, target) made in the daemon's working directory, its scratch
    /// directory, before it starts: a config naming `socket=lun.sock` then reaches a socket
    /// of this host's own while every host's config says the same (see [`Nbdkit::door`]).
    pub links: Vec<(String, PathBuf)>,
}

impl Vestad {
    pub fn start() -> Vestad {
        Vestad::start_with(VestadOpts::default())
    }

    pub fn start_with(opts: VestadOpts) -> Vestad {
        let scratch = Scratch::new("vestad");
        let data_dir = scratch.join("data");
        let ip = opts.ip.as_deref().unwrap_or("127.0.0.1");
        let mut extra = vec![
            "--test-faults".to_owned(),
            "--data-dir".to_owned(),
            data_dir.display().to_string(),
            "--api".to_owned(),
            format!("{ip}:0"),
            "--nbd-tcp".to_owned(),
            format!("{ip}:0"),
        ];
        for (name, target) in &opts.links {
            std::os::unix::fs::symlink(target, scratch.join(name)).expect("link");
        }
        if let Some(c) = &opts.config {
            let p = scratch.join("vestad.toml");
            fs::write(&p, c).expect("write config");
            extra.push("--config".into());
            extra.push(p.display().to_string());
        }
        let mut v = Vestad {
            child: None,
            scratch,
            data_dir,
            api: String::new(),
            nbd_unix: PathBuf::new(),
            nbd_tcp: String::new(),
            extra_args: extra,
        };
        v.launch();
        v
    }

    fn log_path(&self) -> PathBuf {
        self.scratch.join("vestad.log")
    }

    /// Starts (or restarts) the daemon on the same data directory and waits until ready.
    pub fn launch(&mut self) {
        assert!(self.child.is_none(), "vestad already running");
        let ready = self.data_dir.join("vestad.json");
        let _ = fs::remove_file(&ready);
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("open log");
        let child = Command::new(bin("vestad"))
            .args(&self.extra_args)
            .env("VESTA_LOG", "info")
            .current_dir(self.scratch.path())
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("dup log"))
            .stderr(log)
            .spawn()
            .expect("spawn vestad");
        self.child = Some(child);
        let info: Value = wait_for(Duration::from_secs(30), "vestad to become ready", || {
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(st)) = c.try_wait() {
                    panic!("vestad exited with {st} during start-up:\n{}", self.log());
                }
            }
            let s = fs::read_to_string(&ready).ok()?;
            serde_json::from_str(&s).ok()
        });
        self.api = format!("http://{}", info["api"].as_str().expect("api address"));
        self.nbd_unix = PathBuf::from(info["nbd_unix"].as_str().expect("nbd unix socket"));
        self.nbd_tcp = info["nbd_tcp"].as_str().unwrap_or_default().to_owned();
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    pub fn log(&self) -> String {
        fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// Runs `vesta` against this daemon.
    pub fn vesta(&self, args: &[&str]) -> Output {
        run(Command::new(bin("vesta"))
            .arg("--api")
            .arg(&self.api)
            .args(args))
    }

    /// Runs `vesta`, panicking on failure; returns stdout.
    pub fn vesta_ok(&self, args: &[&str]) -> String {
        let out = self.vesta(args);
        if !out.status.success() {
            panic!(
                "vesta {args:?} failed: {}\n--- vestad log ---\n{}",
                String::from_utf8_lossy(&out.stderr),
                self.log()
            );
        }
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Runs `vesta` expecting failure; returns stderr.
    pub fn vesta_err(&self, args: &[&str]) -> String {
        let out = self.vesta(args);
        assert!(
            !out.status.success(),
            "vesta {args:?} should have failed but printed {}",
            String::from_utf8_lossy(&out.stdout)
        );
        String::from_utf8_lossy(&out.stderr).into_owned()
    }

    pub fn vesta_json(&self, args: &[&str]) -> Value {
        let mut a = vec!["--json"];
        a.extend_from_slice(args);
        let s = self.vesta_ok(&a);
        serde_json::from_str(&s).unwrap_or_else(|e| panic!("vesta {args:?}: bad JSON {e}: {s}"))
    }

    /// A raw HTTP POST to the admin API (for the test-only fault API, which the CLI does not
    /// expose). Returns the status code and body.
    pub fn post(&self, path: &str, body: &str) -> (u16, String) {
        let resp = self.request(path, body).expect("admin API request");
        let status = resp
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let body = resp.split("\r\n\r\n").nth(1).unwrap_or("").to_owned();
        (status, body)
    }

    /// Sends one POST to the admin API and reads the raw response until the connection ends.
    fn request(&self, path: &str, body: &str) -> std::io::Result<String> {
        use std::io::Write;
        let addr = self.api.trim_start_matches("http://");
        let mut s = std::net::TcpStream::connect(addr)?;
        write!(
            s,
            "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )?;
        let mut resp = String::new();
        s.read_to_string(&mut resp)?;
        Ok(resp)
    }

    /// Waits until the volume has no dirty data left in the cache (60 s).
    pub fn wait_clean(&self, name: &str) {
        wait_for(Duration::from_secs(60), "the volume to be clean", || {
            let j = self.vesta_json(&["volume", "show", name]);
            (j["cache"]["dirty_bytes"] == 0).then_some(())
        });
    }

    /// Makes the cache device fail every IO from now on.
    pub fn fail_cache_device(&self) {
        let (status, body) = self.post("/v1/debug/faults", r#"{"cache_device":"fail"}"#);
        assert_eq!(status, 200, "fault injection failed: {body}");
    }

    /// From now on the cache device keeps what each write replaces until a sync covers it, so
    /// that [`Vestad::power_cut`] can undo it.
    pub fn record_power_cut(&self) {
        let (status, body) = self.post("/v1/debug/faults", r#"{"cache_device":"record"}"#);
        assert_eq!(status, 200, "fault injection failed: {body}");
    }

    /// A power cut of this host: the cache device loses every write no sync covered (since
    /// [`Vestad::record_power_cut`]) and the daemon stops at once, without replying. Returns
    /// how many writes were lost, from its log.
    pub fn power_cut(&mut self) -> u64 {
        // The daemon ends without answering; a reply means the cut failed.
        let resp = self
            .request("/v1/debug/faults", r#"{"cache_device":"power_cut"}"#)
            .unwrap_or_default();
        let mut c = self.child.take().expect("running");
        let start = Instant::now();
        while c.try_wait().expect("wait").is_none() {
            if start.elapsed() > Duration::from_secs(10) {
                let _ = c.kill();
                let _ = c.wait();
                panic!(
                    "vestad did not stop at the power cut: {resp}\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let log = self.log();
        let line = log
            .lines()
            .rfind(|l| l.contains("test fault: power cut;"))
            .unwrap_or_else(|| panic!("no power cut in the log: {resp}\n{log}"));
        let after = line.split("power cut; ").nth(1).unwrap_or("");
        after
            .split_whitespace()
            .next()
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("unreadable power cut line: {line}"))
    }

    /// Creates a volume and returns its unix-socket URI.
    pub fn create_volume(&self, name: &str, size: &str) -> String {
        self.vesta_ok(&["volume", "create", name, "--size", size]);
        self.url(name)
    }

    /// Adds the nbdkit LUN as datastore `name` with the given queue depth.
    pub fn add_lun(&self, name: &str, lun: &Nbdkit, queue_depth: u32) {
        self.vesta_ok(&[
            "datastore",
            "add",
            name,
            "--lun",
            &lun.uri(),
            "--queue-depth",
            &queue_depth.to_string(),
        ]);
    }

    pub fn url(&self, name: &str) -> String {
        format!("nbd+unix:///{name}?socket={}", self.nbd_unix.display())
    }

    pub fn tcp_url(&self, name: &str) -> String {
        format!("nbd://{}/{name}", self.nbd_tcp)
    }

    /// SIGKILL, the crash of a host's daemon.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM and wait for exit; returns the exit status.
    pub fn terminate(&mut self) -> ExitStatus {
        signal(self.pid(), libc::SIGTERM);
        self.terminate_wait()
    }

    /// Waits for a daemon that was already signalled to exit; returns the exit status.
    pub fn terminate_wait(&mut self) -> ExitStatus {
        let mut c = self.child.take().expect("running");
        let start = Instant::now();
        loop {
            if let Some(st) = c.try_wait().expect("wait") {
                return st;
            }
            if start.elapsed() > Duration::from_secs(60) {
                let _ = c.kill();
                panic!("vestad did not exit within 60s of SIGTERM:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Sends a signal to a process.
pub fn signal(pid: u32, sig: i32) {
    // SAFETY: kill(2) with a pid and a signal number.
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

impl Drop for Vestad {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- vestad log ---\n{}", self.log());
        }
        self.kill9();
    }
}

/// A one-member etcd on loopback, with its data in a scratch directory.
pub struct Etcd {
    child: Option<Child>,
    pub scratch: Scratch,
    pub endpoint: String,
}

/// A TCP port free at the moment of asking.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind an ephemeral port")
        .port()
}

impl Etcd {
    /// Starts etcd on two ports free a moment before. Another test may take a port in that
    /// moment; etcd then exits with "address already in use" and is started again on others.
    pub fn start() -> Etcd {
        for _ in 0..5 {
            match Etcd::try_start() {
                Ok(e) => return e,
                Err(log) if log.contains("address already in use") => continue,
                Err(log) => panic!("etcd exited: {log}"),
            }
        }
        panic!("etcd found no free ports in 5 tries");
    }

    /// etcd serving, or its log if it exited first.
    fn try_start() -> Result<Etcd, String> {
        let scratch = Scratch::new("etcd");
        let (client, peer) = (free_port(), free_port());
        let endpoint = format!("http://127.0.0.1:{client}");
        let log = fs::File::create(scratch.join("etcd.log")).expect("log");
        let child = Command::new("etcd")
            .arg("--data-dir")
            .arg(scratch.join("data"))
            .arg("--listen-client-urls")
            .arg(&endpoint)
            .arg("--advertise-client-urls")
            .arg(&endpoint)
            .arg("--listen-peer-urls")
            .arg(format!("http://127.0.0.1:{peer}"))
            .arg("--initial-advertise-peer-urls")
            .arg(format!("http://127.0.0.1:{peer}"))
            .arg("--initial-cluster")
            .arg(format!("default=http://127.0.0.1:{peer}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("dup"))
            .stderr(log)
            .spawn()
            .expect("spawn etcd (is it installed? run `make deps`)");
        let mut e = Etcd {
            child: Some(child),
            scratch,
            endpoint,
        };
        let exited = wait_for(Duration::from_secs(20), "etcd to serve", || {
            if let Some(Ok(Some(st))) = e.child.as_mut().map(|c| c.try_wait()) {
                let log = fs::read_to_string(e.scratch.join("etcd.log")).unwrap_or_default();
                return Some(Some(format!("{st}: {log}")));
            }
            let out = e.etcdctl(&["endpoint", "health"]);
            out.status.success().then_some(None)
        });
        match exited {
            Some(log) => {
                // Already exited: nothing for Drop to stop.
                e.child = None;
                Err(log)
            }
            None => Ok(e),
        }
    }

    pub fn etcdctl(&self, args: &[&str]) -> Output {
        run(Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .arg("--endpoints")
            .arg(&self.endpoint)
            .arg("--dial-timeout=1s")
            .arg("--command-timeout=2s")
            .args(args))
    }

    /// [`Etcd::etcdctl`] of a command that may be repeated (a read, a put), tried again
    /// while it fails: on a loaded machine etcd may take longer than the command timeout to
    /// answer, which says nothing about what a test checks.
    pub fn etcdctl_retrying(&self, args: &[&str]) -> Output {
        let mut out = self.etcdctl(args);
        for _ in 0..5 {
            if out.status.success() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(500));
            out = self.etcdctl(args);
        }
        out
    }

    /// Keys under `prefix`.
    pub fn keys(&self, prefix: &str) -> Vec<String> {
        let out = self.etcdctl_retrying(&["get", "--prefix", "--keys-only", prefix]);
        assert!(out.status.success(), "etcdctl get: {out:?}");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect()
    }

    /// SIGSTOP: etcd stops answering, as in a partition between the hosts and it.
    pub fn pause(&self) {
        signal(self.child.as_ref().expect("running").id(), libc::SIGSTOP);
    }

    pub fn resume(&self) {
        signal(self.child.as_ref().expect("running").id(), libc::SIGCONT);
    }

    /// The `[cluster]` section naming this etcd.
    pub fn cluster_config(&self, host: &str, fault_domain: &str, lease_ttl_s: u64) -> String {
        format!(
            "[cluster]\netcd = [\"{}\"]\nhost = \"{host}\"\nfault_domain = \"{fault_domain}\"\n\
             lease_ttl_s = {lease_ttl_s}\n",
            self.endpoint
        )
    }

    /// Starts a host of this etcd's cluster on its own loopback address, with `lun` as its
    /// datastore `san` (queue depth 8), reached through the host's own door
    /// ([`Nbdkit::door`]) so the LUN's log can tell the hosts' writes apart.
    pub fn host(&self, lun: &Nbdkit, spec: Host) -> Vestad {
        Vestad::start_with(VestadOpts {
            config: Some(format!(
                "{}{}\n[cache]\nsize = \"{}\"\n\n[[datastore]]\nname = \"san\"\nkind = \"lun\"\n\
                 target = \"nbd+unix:///?socket=lun.sock\"\nqueue_depth = 8\n",
                self.cluster_config(spec.name, spec.fault_domain, CLUSTER_TTL_S),
                spec.cluster,
                spec.cache,
            )),
            ip: Some(spec.ip.into()),
            // Every host names the same target; each reaches the LUN through its own door.
            links: vec![("lun.sock".into(), lun.door(spec.name))],
        })
    }
}

/// The lease of every host [`Etcd::host`] starts: short leases keep the tests quick, and 3 s
/// is etcd's minimum.
pub const CLUSTER_TTL_S: u64 = 3;

/// A host for [`Etcd::host`].
#[derive(Clone, Copy)]
pub struct Host<'a> {
    pub name: &'a str,
    pub fault_domain: &'a str,
    /// Its loopback address, e.g. `127.0.0.2`.
    pub ip: &'a str,
    /// The cache size, e.g. `128M`.
    pub cache: &'a str,
    /// More lines for the `[cluster]` section (empty for none).
    pub cluster: &'a str,
}

impl<'a> Host<'a> {
    /// A host with a 128 MiB cache and nothing more in its `[cluster]` section.
    pub fn new(name: &'a str, fault_domain: &'a str, ip: &'a str) -> Host<'a> {
        Host {
            name,
            fault_domain,
            ip,
            cache: "128M",
            cluster: "",
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            signal(c.id(), libc::SIGCONT);
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Where the first volume's bytes start on a fresh LUN, after its label and volume table
/// (docs/FORMAT.md).
pub const LUN_EXTENT: usize = 4 << 20;

/// An `nbdkit` serving a file as an emulated SAN LUN on a unix socket.
pub struct Nbdkit {
    child: Option<Child>,
    pub scratch: Scratch,
    pub image: PathBuf,
    pub socket: PathBuf,
    args: Vec<String>,
    doors: std::sync::Mutex<Vec<Door>>,
}

/// A behaviour of an nbdkit LUN switched by a file: on while the file exists.
pub struct FileSwitch {
    _dir: Scratch,
    file: PathBuf,
}

impl FileSwitch {
    pub fn on(&self) {
        fs::write(&self.file, b"").expect("switch on");
    }

    pub fn off(&self) {
        fs::remove_file(&self.file).expect("switch off");
    }

    pub fn is_on(&self) -> bool {
        self.file.exists()
    }
}

/// nbdkit's error filter, switched by a file: while on, every IO of the chosen kind fails
/// with EIO (a datastore that fails, then heals). See [`Nbdkit::start_failing`].
pub type ErrorSwitch = FileSwitch;

/// While on, the writes of [`Nbdkit::start_slow_writes`] are held before they are written;
/// writes taken while off are written at once (those held stay held).
pub type SlowWrites = FileSwitch;

/// When the FLUSHes of [`Nbdkit::start_failing_flushes`] fail.
pub struct FlushErrors {
    _dir: Scratch,
    on: PathBuf,
    once: PathBuf,
}

impl FlushErrors {
    /// Every FLUSH fails from now on, at once. Once off, a FLUSH answers OK again, as the
    /// next `fsync` of a file does: Linux reports a write-back error once.
    pub fn on(&self) {
        fs::write(&self.on, b"").expect("switch the flush errors on");
    }

    pub fn off(&self) {
        fs::remove_file(&self.on).expect("switch the flush errors off");
    }

    /// The next FLUSH to run takes one error, and answers it half a second later; FLUSHes
    /// that run beside it or after it answer OK (one `fsync` of a file hears of a write-back
    /// error, whichever runs first).
    pub fn once(&self) {
        fs::write(&self.once, b"").expect("arm the flush error");
    }
}

/// A host's own way onto the LUN: another nbdkit on the same image with the same filters,
/// and nbdkit's log filter outermost, so its log says what that host wrote and when
/// ([`writers`]).
struct Door {
    host: String,
    socket: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

impl Nbdkit {
    /// [`Nbdkit::start`] with the error filter first: while the switch is on, every IO of
    /// kind `op` ("pread", "pwrite", …; "" for every kind) fails with EIO.
    pub fn start_failing(
        size: u64,
        op: &str,
        filter_args: &[&str],
        plugin_params: &[&str],
    ) -> (Nbdkit, ErrorSwitch) {
        let dir = Scratch::new("errfile");
        let file = dir.join("on");
        let op = if op.is_empty() {
            String::new()
        } else {
            format!("-{op}")
        };
        let filters: Vec<&str> = std::iter::once("--filter=error")
            .chain(filter_args.iter().copied())
            .collect();
        let errors = [
            format!("error{op}=EIO"),
            format!("error{op}-rate=100%"),
            format!("error{op}-file={}", file.display()),
        ];
        let params: Vec<&str> = errors
            .iter()
            .map(String::as_str)
            .chain(plugin_params.iter().copied())
            .collect();
        let k = Nbdkit::start(size, &filters, &params);
        (k, ErrorSwitch { _dir: dir, file })
    }

    /// A server whose FLUSH fails with EIO as a file's `fsync` does after a write-back error
    /// (nbdkit's error filter cannot fail a flush): nbdkit's `eval` plugin over an image of
    /// `size` bytes, its reads and writes done by `dd`, requests run in parallel. See
    /// [`FlushErrors`] for when a FLUSH fails.
    pub fn start_failing_flushes(size: u64) -> (Nbdkit, FlushErrors) {
        let dir = Scratch::new("flusherr");
        let errors = FlushErrors {
            on: dir.join("on"),
            once: dir.join("once"),
            _dir: dir,
        };
        let (on, once) = (errors.on.display(), errors.once.display());
        let k = Nbdkit::serve(size, |image| {
            let img = image.display();
            vec![
                "eval".into(),
                "thread_model=echo parallel".into(),
                format!("get_size=echo {size}"),
                "can_write=exit 0".into(),
                "can_flush=exit 0".into(),
                format!(
                    "pread=dd if='{img}' skip=$4 count=$3 iflag=skip_bytes,count_bytes status=none"
                ),
                format!("pwrite=dd of='{img}' seek=$4 oflag=seek_bytes conv=notrunc status=none"),
                format!(
                    "flush=if rm '{once}' 2>/dev/null; then sleep 0.5; \
                     echo 'EIO write-back error' >&2; exit 1; fi; \
                     if [ -e '{on}' ]; then echo 'EIO write-back error' >&2; exit 1; fi"
                ),
            ]
        });
        (k, errors)
    }

    /// A server that, while [`SlowWrites`] is on, holds each write it takes for `hold` before
    /// it writes the image, and then writes it even if its client has gone meanwhile, as a
    /// SAN does with a write it has accepted (nbdkit's delay filter drops a delayed request
    /// whose client is gone). nbdkit's `eval` plugin over an image of `size` bytes, its
    /// reads and writes done by `dd`, requests run in parallel.
    pub fn start_slow_writes(size: u64, hold: Duration) -> (Nbdkit, SlowWrites) {
        let dir = Scratch::new("slowwrites");
        let slow = SlowWrites {
            file: dir.join("on"),
            _dir: dir,
        };
        let on = slow.file.display();
        let hold = hold.as_secs_f64();
        let k = Nbdkit::serve(size, |image| {
            let img = image.display();
            vec![
                "eval".into(),
                "thread_model=echo parallel".into(),
                format!("get_size=echo {size}"),
                "can_write=exit 0".into(),
                "can_flush=exit 0".into(),
                format!(
                    "pread=dd if='{img}' skip=$4 count=$3 iflag=skip_bytes,count_bytes status=none"
                ),
                format!(
                    "pwrite=if [ -e '{on}' ]; then sleep {hold}; fi; \
                     dd of='{img}' seek=$4 oflag=seek_bytes conv=notrunc status=none"
                ),
                "flush=exit 0".into(),
            ]
        });
        (k, slow)
    }

    /// Serves a new sparse image of `size` bytes. `filter_args` go before the plugin (e.g.
    /// `["--filter=delay"]`), `plugin_params` after the image (e.g. `["delay-write=2ms"]`).
    pub fn start(size: u64, filter_args: &[&str], plugin_params: &[&str]) -> Nbdkit {
        Nbdkit::serve(size, |image| {
            let mut args: Vec<String> = filter_args.iter().map(|s| s.to_string()).collect();
            args.push("file".into());
            args.push(image.display().to_string());
            args.extend(plugin_params.iter().map(|s| s.to_string()));
            args
        })
    }

    /// Serves a new sparse image of `size` bytes with the arguments `args` gives for it
    /// (filters, plugin, parameters).
    fn serve(size: u64, args: impl FnOnce(&Path) -> Vec<String>) -> Nbdkit {
        let scratch = Scratch::new("nbdkit");
        let image = scratch.join("lun.img");
        let f = fs::File::create(&image).expect("create image");
        f.set_len(size).expect("size image");
        let args = args(&image);
        let mut k = Nbdkit {
            child: None,
            socket: scratch.join("nbdkit.sock"),
            scratch,
            image,
            args,
            doors: std::sync::Mutex::new(Vec::new()),
        };
        k.restart();
        k
    }

    /// (Re)starts serving the same image on the same socket (and every door on its own).
    pub fn restart(&mut self) {
        self.stop();
        let socket = self.socket.clone();
        self.child = Some(self.spawn(&socket, &[]));
        for d in self
            .doors
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .iter_mut()
        {
            let extra = door_args(&d.log);
            d.child = Some(spawn_nbdkit(&self.scratch, &self.args, &d.socket, &extra));
        }
    }

    fn spawn(&self, socket: &Path, extra: &[String]) -> Child {
        spawn_nbdkit(&self.scratch, &self.args, socket, extra)
    }

    /// The socket of `host`'s own door onto this LUN (started on first use): the same image
    /// and filters, with every request logged for [`Nbdkit::assert_one_writer_at_a_time`].
    /// Every host must name the datastore's target alike, so a host reaches its door through
    /// a link of the same name in its working directory ([`VestadOpts::links`]).
    pub fn door(&self, host: &str) -> PathBuf {
        let mut doors = self.doors.lock().unwrap_or_else(|e| e.into_inner());
        if !doors.iter().any(|d| d.host == host) {
            let socket = self.scratch.join(&format!("door-{host}.sock"));
            let log = self.scratch.join(&format!("door-{host}.log"));
            let child = self.spawn(&socket, &door_args(&log));
            doors.push(Door {
                host: host.to_owned(),
                socket,
                log,
                child: Some(child),
            });
        }
        let d = doors.iter().find(|d| d.host == host).expect("door exists");
        d.socket.clone()
    }

    /// What `host`'s door has logged so far.
    fn door_log(&self, host: &str) -> String {
        let doors = self.doors.lock().unwrap_or_else(|e| e.into_inner());
        let d = doors
            .iter()
            .find(|d| d.host == host)
            .expect("the host has a door");
        read_string(&d.log)
    }

    /// The requests that changed data through `host`'s door so far, by its log
    /// ([`writers::parse`]).
    pub fn door_writes(&self, host: &str) -> Vec<writers::Request> {
        writers::parse(host, &self.door_log(host))
    }

    /// How many writes `host`'s door has taken and not answered yet, by its log (nbdkit logs
    /// a request's return before its connection's end, even when the client has gone).
    pub fn writes_in_service(&self, host: &str) -> usize {
        let log = self.door_log(host);
        let taken = log.lines().filter(|l| l.contains(" Write id=")).count();
        let answered = log.lines().filter(|l| l.contains(" ...Write id=")).count();
        taken - answered
    }

    /// Closes `host`'s door (SIGKILL): that host alone loses its path to the LUN, and it
    /// stays lost ([`Nbdkit::keep_running`] leaves it closed) until [`Nbdkit::restart`].
    pub fn close_door(&self, host: &str) {
        let mut doors = self.doors.lock().unwrap_or_else(|e| e.into_inner());
        let d = doors
            .iter_mut()
            .find(|d| d.host == host)
            .expect("the host has a door");
        if let Some(mut c) = d.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Checks, from the doors' logs, that no two hosts had writes to `range` in service at
    /// the same time (and that some host wrote there, so the check says something).
    pub fn assert_one_writer_at_a_time(&self, range: std::ops::Range<u64>) {
        let doors = self.doors.lock().unwrap_or_else(|e| e.into_inner());
        assert!(doors.len() >= 2, "the check needs a door per host");
        let mut all = Vec::new();
        for d in doors.iter() {
            all.extend(writers::parse(&d.host, &read_string(&d.log)));
        }
        let inside: Vec<&writers::Request> = all
            .iter()
            .filter(|r| r.offset < range.end && r.offset + r.count > range.start)
            .collect();
        let hosts: std::collections::BTreeSet<&str> =
            inside.iter().map(|r| r.host.as_str()).collect();
        assert!(
            !hosts.is_empty(),
            "no host wrote {range:?}: nothing to check"
        );
        let found = writers::overlaps(&all, range.clone());
        assert!(
            found.is_empty(),
            "two hosts wrote {range:?} at the same time ({} time(s)); first: {}",
            found.len(),
            found[0]
        );
        eprintln!(
            "one writer at a time on {range:?}: {} data requests from {hosts:?}, none overlapping",
            inside.len()
        );
    }

    pub fn uri(&self) -> String {
        format!("nbd+unix:///?socket={}", self.socket.display())
    }

    /// Starts nbdkit again if it exited. nbdkit 1.32 can abort (`raw_send_socket: Assertion
    /// sock >= 0 failed`) when a client is killed with requests in its delay filter; a real
    /// SAN does not go away with a client, so tests that kill clients mid-IO keep it up.
    pub fn keep_running(&mut self) {
        if let Some(Ok(Some(st))) = self.child.as_mut().map(|c| c.try_wait()) {
            eprintln!("nbdkit exited ({st}) after a client was killed; starting it again");
            self.child = None;
            let socket = self.socket.clone();
            self.child = Some(self.spawn(&socket, &[]));
        }
        for d in self
            .doors
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .iter_mut()
        {
            if let Some(Ok(Some(st))) = d.child.as_mut().map(|c| c.try_wait()) {
                eprintln!(
                    "door of {} exited ({st}) after a client was killed; starting it again",
                    d.host
                );
                let extra = door_args(&d.log);
                d.child = Some(spawn_nbdkit(&self.scratch, &self.args, &d.socket, &extra));
            }
        }
    }

    /// After a client was killed with requests in flight: gives them time to leave the
    /// filters (100 ms; they take a few ms here), then [`Nbdkit::keep_running`].
    pub fn outlive_killed_client(&mut self) {
        std::thread::sleep(Duration::from_millis(100));
        self.keep_running();
    }

    /// SIGKILL: the LUN disappears, doors too (their socket files stay, refusing
    /// connections).
    pub fn stop(&mut self) {
        let doors = self.doors.get_mut().unwrap_or_else(|e| e.into_inner());
        for c in std::iter::once(&mut self.child).chain(doors.iter_mut().map(|d| &mut d.child)) {
            if let Some(mut c) = c.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

impl Drop for Nbdkit {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A door's log filter, outermost: it sees a request arrive before any other filter (a
/// delay, an error) and return after all of them.
fn door_args(log: &Path) -> Vec<String> {
    vec![
        format!("logfile={}", log.display()),
        "logappend=true".into(),
    ]
}

/// Starts `nbdkit` with `args` (filters, plugin, image, parameters) on `socket`; `extra`
/// non-empty means a door: the log filter first, `extra` (its parameters) last.
fn spawn_nbdkit(scratch: &Scratch, args: &[String], socket: &Path, extra: &[String]) -> Child {
    let _ = fs::remove_file(socket);
    let log = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(scratch.join("nbdkit.log"))
        .expect("log");
    let mut cmd = Command::new("nbdkit");
    cmd.arg("-f").arg("--unix").arg(socket);
    if !extra.is_empty() {
        cmd.arg("--filter=log");
    }
    let mut child = cmd
        .args(args)
        .args(extra)
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("dup"))
        .stderr(log)
        .spawn()
        .expect("spawn nbdkit (is it installed? run `make deps`)");
    wait_for(Duration::from_secs(10), "nbdkit socket", || {
        if let Ok(Some(st)) = child.try_wait() {
            panic!(
                "nbdkit exited with {st}: {}",
                read_string(&scratch.join("nbdkit.log"))
            );
        }
        // Bound is not yet listening: a connect between the two is refused.
        std::os::unix::net::UnixStream::connect(socket)
            .is_ok()
            .then_some(())
    });
    child
}

fn read_string(p: &Path) -> String {
    let mut s = String::new();
    let _ = fs::File::open(p).and_then(|mut f| f.read_to_string(&mut s));
    s
}

/// Runs `qemu-io` commands against a URI; returns the output, panicking on failure or on any
/// "Pattern verification failed" line.
pub fn qemu_io(url: &str, cmds: &[&str]) -> String {
    let mut c = Command::new("qemu-io");
    c.arg("-f").arg("raw");
    for cmd in cmds {
        c.arg("-c").arg(cmd);
    }
    c.arg(url);
    let out = run_ok(&mut c);
    assert!(
        !out.contains("Pattern verification failed") && !out.contains("failed:"),
        "qemu-io reported a failure:\n{out}"
    );
    out
}

/// One 4 KiB write of `byte` at `offset` with qemu-io; whether it succeeded (a fenced or
/// failing datastore makes it fail).
pub fn try_write(url: &str, byte: u8, offset: u64) -> bool {
    let out = run(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        &format!("write -P {byte} {offset} 4k"),
        url,
    ]));
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    out.status.success() && !text.contains("failed")
}

/// Whether a 4 KiB read at `offset` of the NBD export at `url` succeeds.
pub fn try_read(url: &str, offset: u64) -> bool {
    let out =
        run(Command::new("qemu-io").args(["-f", "raw", "-c", &format!("read {offset} 4k"), url]));
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    out.status.success() && !text.contains("failed")
}

/// `nbdsh` as a command: Debian's python3-libnbd installs the `nbd` module for the system
/// Python only, so the system Python goes first on PATH whatever else (pyenv) is installed.
pub fn nbdsh_cmd() -> Command {
    let mut c = Command::new("nbdsh");
    let path = std::env::var("PATH").unwrap_or_default();
    c.env("PATH", format!("/usr/bin:{path}"));
    c
}

/// Runs an `nbdsh` Python snippet with `h` connected to `url`; panics on failure.
pub fn nbdsh(url: &str, script: &str) -> String {
    run_ok(nbdsh_cmd().arg("-u").arg(url).arg("-c").arg(script))
}

/// Reads a file fully.
pub fn read_file(p: &Path) -> Vec<u8> {
    fs::read(p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()))
}

/// Deterministic pseudo-random bytes (xorshift), so tests need no RNG crate.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut v = Vec::with_capacity(len);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    v
}
