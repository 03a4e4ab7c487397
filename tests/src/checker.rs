//! A checker for crash tests: writers put versioned 4 KiB blocks on a volume and record, per
//! block, the last version whose write completed and the one in flight; after a crash, every
//! block must read as its completed version or its in-flight one (DESIGN §2).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use nbd::client::Client;
use nbd::uri::NbdUri;

/// A campaign's rounds (from the environment variable `rounds_var`, else `default`) and its
/// first seed (`VESTA_CRASH_SEED`, else the clock), printed with the campaign's `name` so a
/// failing campaign can be replayed.
pub fn campaign(name: &str, rounds_var: &str, default: u64) -> (u64, u64) {
    let rounds = std::env::var(rounds_var)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default);
    let seed = std::env::var("VESTA_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
    eprintln!("{name} campaign: {rounds} rounds, VESTA_CRASH_SEED={seed}");
    (rounds, seed)
}

pub const BLOCK: u64 = 4096;
pub const BLOCKS: u64 = 1024;
/// Writers; each owns the blocks ≡ its index mod WRITERS, so a block has at most one write in
/// flight and its versions are strictly ordered.
pub const WRITERS: u64 = 16;

/// What a block holds: its number and version, repeated.
pub fn content(block: u64, version: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(BLOCK as usize);
    while v.len() < BLOCK as usize {
        v.extend_from_slice(&block.to_le_bytes());
        v.extend_from_slice(&version.to_le_bytes());
    }
    v
}

pub fn version_of(block: u64, data: &[u8]) -> u64 {
    if data.iter().all(|b| *b == 0) {
        return 0;
    }
    let b = u64::from_le_bytes(data[0..8].try_into().unwrap());
    let v = u64::from_le_bytes(data[8..16].try_into().unwrap());
    assert_eq!(b, block, "block {block} holds another block's data");
    assert!(data == content(b, v), "block {block} is torn or corrupt");
    v
}

/// Per block: the last version known completed, the one in flight (if any), and the last
/// version known durable: written with FUA, or completed before a FLUSH that completed.
#[derive(Clone, Copy, Default, Debug)]
pub struct Known {
    pub completed: u64,
    pub in_flight: Option<u64>,
    pub durable: u64,
    /// The newest version ever written: a version a power cut took back is never written
    /// again, so no stale copy of it can pass for the new one.
    pub issued: u64,
}

pub struct Xorshift(pub u64);

impl Xorshift {
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Runs writers (and, if `flushing`, a task sending a FLUSH every 5–45 ms) until the connection
/// dies; the shared table says what happened. Returns how many of them stopped on an error
/// before `stop` was set (none, unless the daemon died or failed an IO).
pub async fn write_until_killed(
    uri: String,
    known: Arc<Mutex<Vec<Known>>>,
    seed: u64,
    stop: Arc<AtomicBool>,
    flushing: bool,
) -> u64 {
    let Ok(client) = Client::connect(&NbdUri::parse(&uri).unwrap(), 2).await else {
        return 1;
    };
    let client = Arc::new(client);
    let mut tasks = Vec::new();
    for w in 0..WRITERS {
        let (client, known, stop) = (client.clone(), known.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut rng = Xorshift(seed ^ (w + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
            while !stop.load(Ordering::SeqCst) {
                let block = (rng.next_u64() % (BLOCKS / WRITERS)) * WRITERS + w;
                let version = {
                    let mut k = known.lock().unwrap();
                    let kb = &mut k[block as usize];
                    let v = kb.completed.max(kb.issued) + 1;
                    kb.issued = v;
                    kb.in_flight = Some(v);
                    v
                };
                // With FLUSHes, FUA is rare: each FUA syncs every write before it, which would
                // hide a FLUSH that does not.
                let fua = rng
                    .next_u64()
                    .is_multiple_of(if flushing { 256 } else { 16 });
                let r = client
                    .write(block * BLOCK, Bytes::from(content(block, version)), fua)
                    .await;
                let mut k = known.lock().unwrap();
                if r.is_err() {
                    // The daemon is gone (or failed it); it may or may not have landed.
                    return !stop.load(Ordering::SeqCst);
                }
                let kb = &mut k[block as usize];
                kb.completed = version;
                kb.in_flight = None;
                if fua {
                    kb.durable = version;
                }
            }
            false
        }));
    }
    if flushing {
        // A FLUSH makes durable every write that completed before it was sent.
        let (client, known, stop) = (client.clone(), known.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut rng = Xorshift(seed.rotate_left(17) | 1);
            while !stop.load(Ordering::SeqCst) {
                tokio::time::sleep(std::time::Duration::from_millis(5 + rng.next_u64() % 40)).await;
                let before: Vec<u64> = known.lock().unwrap().iter().map(|k| k.completed).collect();
                if client.flush().await.is_err() {
                    return !stop.load(Ordering::SeqCst);
                }
                for (k, v) in known.lock().unwrap().iter_mut().zip(before) {
                    k.durable = k.durable.max(v);
                }
            }
            false
        }));
    }
    let mut failed = 0;
    for t in tasks {
        failed += u64::from(t.await.unwrap_or(true));
    }
    failed
}

/// Every block of `bytes` (a volume's contents from its first byte, as a client or the
/// datastore image holds them) is its last completed version or the one in flight (DESIGN
/// §2). Returns the sum of completed versions, so a round can tell its writers got through.
/// The known state stays as it is, in-flight versions included.
pub fn assert_holds_completed(
    bytes: &[u8],
    known: &Mutex<Vec<Known>>,
    round: u64,
    seed: u64,
) -> u64 {
    let k = known.lock().unwrap();
    let mut completed = 0;
    for blk in 0..BLOCKS {
        let at = (blk * BLOCK) as usize;
        let have = version_of(blk, &bytes[at..at + BLOCK as usize]);
        let kb = k[blk as usize];
        assert!(
            have == kb.completed || Some(have) == kb.in_flight,
            "round {round} (seed {seed}): block {blk} holds version {have}, but version {} had \
             completed (in flight: {:?})",
            kb.completed,
            kb.in_flight
        );
        completed += kb.completed;
    }
    completed
}

/// After a power cut: every block of `bytes` is a version that was written, no older than
/// its last durable one (DESIGN §2). Returns how many blocks lost completed versions that
/// were not durable, so a campaign can tell its cuts had something to lose.
pub fn assert_holds_durable(bytes: &[u8], known: &Mutex<Vec<Known>>, round: u64, seed: u64) -> u64 {
    let k = known.lock().unwrap();
    let mut rolled_back = 0;
    for blk in 0..BLOCKS {
        let at = (blk * BLOCK) as usize;
        let have = version_of(blk, &bytes[at..at + BLOCK as usize]);
        let kb = k[blk as usize];
        let newest = kb.in_flight.unwrap_or(kb.completed);
        assert!(
            have >= kb.durable && have <= newest,
            "round {round} (seed {seed}): block {blk} holds version {have}, but version {} was \
             durable (completed: {}, in flight: {:?})",
            kb.durable,
            kb.completed,
            kb.in_flight
        );
        rolled_back += u64::from(have < kb.completed);
    }
    rolled_back
}

/// [`assert_holds_completed`], then what `bytes` hold becomes the known state
/// ([`reset_to`]).
pub fn settle_to(bytes: &[u8], known: &Mutex<Vec<Known>>, round: u64, seed: u64) -> u64 {
    let completed = assert_holds_completed(bytes, known, round, seed);
    reset_to(bytes, known);
    completed
}

/// What `bytes` hold becomes the known state, completed and durable, with nothing in flight,
/// for the next round.
pub fn reset_to(bytes: &[u8], known: &Mutex<Vec<Known>>) {
    let mut k = known.lock().unwrap();
    for blk in 0..BLOCKS {
        let at = (blk * BLOCK) as usize;
        let have = version_of(blk, &bytes[at..at + BLOCK as usize]);
        let kb = &mut k[blk as usize];
        *kb = Known {
            completed: have,
            in_flight: None,
            durable: have,
            issued: kb.issued.max(have),
        };
    }
}

/// A campaign's checker: the runtime its writers run on and what they know of each block.
pub struct Checker {
    pub rt: tokio::runtime::Runtime,
    pub known: Arc<Mutex<Vec<Known>>>,
}

/// Writers started by [`Checker::write`], until [`Writers::stop`].
pub struct Writers<'a> {
    rt: &'a tokio::runtime::Runtime,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<u64>,
}

impl Writers<'_> {
    /// Stops the writers (if the daemon did not already) and waits for them. Returns how
    /// many had stopped on an error before.
    pub fn stop(self) -> u64 {
        self.stop.store(true, Ordering::SeqCst);
        self.rt.block_on(self.task).expect("the writers panicked")
    }
}

impl Default for Checker {
    fn default() -> Checker {
        Checker::new()
    }
}

impl Checker {
    pub fn new() -> Checker {
        Checker {
            rt: tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .expect("a runtime"),
            known: Arc::new(Mutex::new(vec![Known::default(); BLOCKS as usize])),
        }
    }

    /// Starts [`write_until_killed`] on the volume at `uri`.
    pub fn write(&self, uri: String, seed: u64) -> Writers<'_> {
        self.start(uri, seed, false)
    }

    /// [`Checker::write`] with a task that sends FLUSHes as it goes, so that some completed
    /// writes become durable and others not.
    pub fn write_flushing(&self, uri: String, seed: u64) -> Writers<'_> {
        self.start(uri, seed, true)
    }

    fn start(&self, uri: String, seed: u64, flushing: bool) -> Writers<'_> {
        let stop = Arc::new(AtomicBool::new(false));
        let task = self.rt.spawn(write_until_killed(
            uri,
            self.known.clone(),
            seed,
            stop.clone(),
            flushing,
        ));
        Writers {
            rt: &self.rt,
            stop,
            task,
        }
    }

    /// The sum of completed versions: it grows while the writers get writes through.
    pub fn completed(&self) -> u64 {
        self.known.lock().unwrap().iter().map(|k| k.completed).sum()
    }

    /// The checker's blocks of the volume at `uri`, read through NBD.
    pub fn read(&self, uri: &str) -> Vec<u8> {
        self.rt.block_on(async {
            let c = Client::connect(&NbdUri::parse(uri).unwrap(), 1)
                .await
                .expect("connect to the volume");
            c.read(0, (BLOCKS * BLOCK) as u32)
                .await
                .expect("read the volume")
                .to_vec()
        })
    }
}

/// What a [`PolicyChanger`] did by the time the daemon was killed.
#[derive(Debug, Clone, Copy)]
pub struct Changes {
    /// The policy of the last change that completed, if any did.
    pub done: Option<&'static str>,
    /// The change the kill cut short (its command failed): it may or may not be in effect.
    pub cut_short: Option<&'static str>,
    /// How many changes completed.
    pub completed: u64,
}

impl Changes {
    /// The policies the volume may have after the restart: that of the last completed change
    /// (`before` if none completed), or that of the change the kill cut short.
    pub fn possible<'a>(&self, before: &'a str) -> Vec<&'a str> {
        let mut p = vec![self.done.unwrap_or(before)];
        p.extend(self.cut_short);
        p
    }
}

/// A second client of a campaign: it changes a volume's policy at random (each change a
/// policy name and `vesta volume policy`'s extra arguments), one after another with up to
/// 150 ms between them, until the daemon is killed. Any change failing with the daemon up
/// fails the test.
pub struct PolicyChanger {
    killed: Arc<AtomicBool>,
    starts: std::sync::mpsc::Receiver<&'static str>,
    thread: std::thread::JoinHandle<Changes>,
}

impl PolicyChanger {
    pub fn start(
        api: &str,
        volume: &str,
        changes: &'static [(&'static str, &'static [&'static str])],
        seed: u64,
    ) -> PolicyChanger {
        let killed = Arc::new(AtomicBool::new(false));
        let (started, starts) = std::sync::mpsc::channel();
        let (api, volume, k) = (api.to_owned(), volume.to_owned(), killed.clone());
        let thread = std::thread::spawn(move || {
            let mut r = Xorshift(seed | 1);
            let mut did = Changes {
                done: None,
                cut_short: None,
                completed: 0,
            };
            loop {
                std::thread::sleep(std::time::Duration::from_millis(r.next_u64() % 150));
                let (policy, extra) = changes[(r.next_u64() % changes.len() as u64) as usize];
                if k.load(Ordering::SeqCst) {
                    return did;
                }
                let mut args = vec!["--api", &api, "volume", "policy", &volume, policy];
                args.extend_from_slice(extra);
                let _ = started.send(policy);
                let out = crate::run(std::process::Command::new(crate::bin("vesta")).args(&args));
                let up = !k.load(Ordering::SeqCst);
                if out.status.success() {
                    did.done = Some(policy);
                    did.completed += 1;
                } else {
                    assert!(
                        !up,
                        "(seed {seed}) `vesta {}` failed with the daemon up: {}",
                        args.join(" "),
                        String::from_utf8_lossy(&out.stderr)
                    );
                    did.cut_short = Some(policy);
                    return did;
                }
                if !up {
                    return did;
                }
            }
        });
        PolicyChanger {
            killed,
            starts,
            thread,
        }
    }

    /// Waits (up to `limit`) until a change to one of `policies` starts.
    pub fn wait_for_a_change_to(&self, policies: &[&str], limit: std::time::Duration) {
        let deadline = std::time::Instant::now() + limit;
        while let Ok(p) = self
            .starts
            .recv_timeout(deadline.saturating_duration_since(std::time::Instant::now()))
        {
            if policies.contains(&p) {
                return;
            }
        }
    }

    /// Says the daemon is about to be killed: from here a failed change is one the kill cut
    /// short, and no new change starts.
    pub fn killing(&self) {
        self.killed.store(true, Ordering::SeqCst);
    }

    /// Waits for the changer to end (after [`PolicyChanger::killing`] and the kill).
    pub fn join(self) -> Changes {
        self.thread.join().expect("the policy changer panicked")
    }
}
