//! The receiving side: a peer takes other hosts' writes into its cache log.
//!
//! A connection is taken only from a host that proves it knows the pod's peer key
//! ([`crate::auth`]); until then its frames must be the handshake's and small, and a host that
//! has not finished it within [`HANDSHAKE_TIMEOUT`] is dropped, as is any connection beyond
//! [`HANDSHAKES_MAX`] handshakes at once.
//!
//! Each connection gets a thread that reads frames and one that hands them to the [`Sink`] in
//! order and writes the replies; replies are flushed to the socket whenever no further
//! request is queued, so a pipelined sender gets them in batches. Requests of one connection
//! are applied in the order they were sent, which is the order of their acknowledgements,
//! except checkpoints: the reading thread applies them at once, since a write waiting for
//! room may be waiting for one (every write a checkpoint covers was applied already).
//! While nothing is queued, the reading thread also applies a write that has room and a
//! FLUSH itself, saving a thread hand-off on every write of a lightly loaded link; a write
//! that would wait for room is queued, so the reading thread never waits for a checkpoint.

use std::collections::HashMap;
use std::io::{BufReader, BufWriter, Read, Write};
use std::net::IpAddr;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tracing::{info, warn};
use uuid::Uuid;

use crate::auth::{self, Exchange, Key, Role};
use crate::wire::{self, Msg, Status, WriteMsg, HANDSHAKE_BODY_MAX, HEADER_LEN};

/// Longest a connecting host may take over the whole handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Most connections in their handshake at once; more are closed as they come.
pub const HANDSHAKES_MAX: usize = 64;
/// Most connections from one address in their handshake at once, so that one stranger cannot
/// take every place (a host of the pod needs one, for a few milliseconds).
pub const HANDSHAKES_PER_SOURCE: usize = 4;
/// Connections closed for want of a place are logged at most this often.
const BUSY_LOG_EVERY: Duration = Duration::from_secs(10);

/// Why a peer did not take a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// It could not (cache device failed, out of space…).
    Failed(String),
    /// It knows a newer generation of the volume: the sender is no longer its owner.
    Stale(String),
    /// It holds nothing of the volume (an answer to `held`): no replicas, and nothing it
    /// could replay from.
    Absent(String),
}

/// What a peer does with what it receives (the daemon puts it in the host's cache log).
/// Calls may block (they append to and sync the log).
pub trait Sink: Send + Sync + 'static {
    /// This host's name, sent back in answer to a `Hello`.
    fn host(&self) -> String;
    fn open(&self, from: &str, volume: Uuid, gen: u64, checkpoint: u64) -> Result<(), Refusal>;
    fn write(&self, from: &str, w: WriteMsg) -> Result<(), Refusal>;
    /// As [`Sink::write`], but only if it can be done without waiting for room, which only
    /// a checkpoint frees: `None` if it would have to wait, and nothing was done. Must not
    /// block on anything a later frame of the connection brings.
    fn write_at_once(&self, from: &str, w: &WriteMsg) -> Option<Result<(), Refusal>>;
    /// Makes every write taken so far durable.
    fn flush(&self) -> Result<(), Refusal>;
    /// The owner's checkpoint `ser`, with the end of the window it is about to send if
    /// `window_end` is nonzero (then answered once durable).
    fn checkpoint(&self, volume: Uuid, gen: u64, ser: u64, window_end: u64) -> Result<(), Refusal>;
    fn drop_replicas(&self, volume: Uuid, gen: u64) -> Result<(), Refusal>;
    /// For a host about to replay `volume`: makes this host's replicas durable and says up to
    /// which `ser` it holds generation `gen` without a gap above `from` (`from` if it holds
    /// none above it), and the newest checkpoint the owner sent it. [`Refusal::Absent`] only
    /// if it holds nothing of the volume at all: an owner that hears it from every peer
    /// concludes that nobody can replay the volume.
    fn held(&self, volume: Uuid, gen: u64, from: u64) -> Result<Holding, Refusal>;
}

/// A peer's answer to `held` ([`Sink::held`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Holding {
    /// It holds every write above the checkpoint up to this one.
    pub upto: u64,
    /// The newest checkpoint the owner sent it: every write up to it was on the datastore.
    pub checkpoint: u64,
}

impl Holding {
    /// As sent in a reply: `upto checkpoint`.
    pub fn encode(&self) -> String {
        format!("{} {}", self.upto, self.checkpoint)
    }

    /// From a reply. `upto` alone (0 for the checkpoint) is also taken, as a version-2 peer
    /// sent it, though the handshake keeps hosts of different versions apart.
    pub fn decode(s: &str) -> Option<Holding> {
        let mut it = s.split(' ');
        let upto = it.next()?.parse().ok()?;
        let checkpoint = match it.next() {
            Some(c) => c.parse().ok()?,
            None => 0,
        };
        it.next().is_none().then_some(Holding { upto, checkpoint })
    }
}

/// Accepts peer connections on `listener` until the process ends, from hosts that know `key`.
pub fn serve(listener: TcpListener, sink: Arc<dyn Sink>, key: Key) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("peer-accept".into())
        .spawn(move || {
            let handshaking = Arc::new(Mutex::new(Handshaking::default()));
            let mut busy = Busy::default();
            for conn in listener.incoming() {
                match conn {
                    Ok(s) => {
                        let slot = s
                            .peer_addr()
                            .map_err(|e| e.to_string())
                            .and_then(|a| Slot::take(&handshaking, a.ip()));
                        let slot = match slot {
                            Ok(slot) => slot,
                            Err(why) => {
                                busy.refused(&why);
                                // Say why, if the socket takes it at once, and close.
                                let reply = Msg::Reply {
                                    status: Status::Failed,
                                    msg: format!("peer busy: {why}"),
                                };
                                let _ = s.set_nonblocking(true);
                                let _ = (&s).write_all(&wire::encode(0, &reply));
                                continue;
                            }
                        };
                        let (sink, key) = (sink.clone(), key.clone());
                        let _ =
                            std::thread::Builder::new()
                                .name("peer-conn".into())
                                .spawn(move || {
                                    let who = s
                                        .peer_addr()
                                        .map(|a| a.to_string())
                                        .unwrap_or_else(|_| "?".into());
                                    if let Err(e) = connection(s, sink, &key, slot) {
                                        warn!("peer connection from {who} closed: {e}");
                                    }
                                });
                    }
                    Err(e) => {
                        warn!("peer listener: accept failed: {e}");
                        std::thread::sleep(std::time::Duration::from_millis(100));
                    }
                }
            }
        })?;
    Ok(())
}

/// Connections in their handshake, in all and by source address.
#[derive(Default)]
struct Handshaking {
    total: usize,
    by_source: HashMap<IpAddr, usize>,
}

/// A place among the connections in their handshake ([`HANDSHAKES_MAX`],
/// [`HANDSHAKES_PER_SOURCE`]), given back on drop.
struct Slot {
    shared: Arc<Mutex<Handshaking>>,
    source: IpAddr,
}

impl Slot {
    fn take(shared: &Arc<Mutex<Handshaking>>, source: IpAddr) -> Result<Slot, String> {
        let mut h = shared.lock().unwrap_or_else(|e| e.into_inner());
        if h.total >= HANDSHAKES_MAX {
            return Err(format!(
                "{HANDSHAKES_MAX} connections are in their handshake"
            ));
        }
        let n = h.by_source.entry(source).or_default();
        if *n >= HANDSHAKES_PER_SOURCE {
            return Err(format!(
                "{HANDSHAKES_PER_SOURCE} connections from {source} are in their handshake"
            ));
        }
        *n += 1;
        h.total += 1;
        Ok(Slot {
            shared: shared.clone(),
            source,
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut h = self.shared.lock().unwrap_or_else(|e| e.into_inner());
        h.total -= 1;
        if let Some(n) = h.by_source.get_mut(&self.source) {
            *n -= 1;
            if *n == 0 {
                h.by_source.remove(&self.source);
            }
        }
    }
}

/// Logs connections closed for want of a place, at most once per [`BUSY_LOG_EVERY`]: a
/// stranger must not be able to flood the log.
#[derive(Default)]
struct Busy {
    last: Option<Instant>,
    since: u64,
}

impl Busy {
    fn refused(&mut self, why: &str) {
        self.since += 1;
        if self.last.is_none_or(|t| t.elapsed() >= BUSY_LOG_EVERY) {
            warn!(
                "peer listener: closed {} connection(s) at once, the latest because {why}",
                self.since
            );
            self.last = Some(Instant::now());
            self.since = 0;
        }
    }
}

/// Reads from a socket until a deadline: each read waits at most for what is left, so a
/// host that trickles bytes cannot stretch a handshake past it.
struct Until<'a> {
    s: &'a TcpStream,
    deadline: Instant,
}

impl Read for Until<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let late = || {
            std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no handshake within {HANDSHAKE_TIMEOUT:?}"),
            )
        };
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(late());
        }
        self.s.set_read_timeout(Some(left))?;
        match (&mut &*self.s).read(buf) {
            // What a read timeout looks like on Linux.
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Err(late()),
            r => r,
        }
    }
}

/// Reads one frame whose body may be at most `max` bytes; `None` at a clean end.
fn read_frame(r: &mut impl Read, max: u32) -> std::io::Result<Option<(wire::Head, Bytes)>> {
    let mut head = [0u8; HEADER_LEN];
    match r.read_exact(&mut head) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let h = wire::decode_head(&head).map_err(std::io::Error::other)?;
    if h.body_len > max {
        return Err(std::io::Error::other(wire::WireError::TooLong(h.body_len)));
    }
    // Not zeroed first: the read fills it.
    let len = h.body_len as usize;
    let mut body = Vec::with_capacity(len);
    r.take(len as u64).read_to_end(&mut body)?;
    if body.len() < len {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    Ok(Some((h, Bytes::from(body))))
}

fn reply_of(result: Result<String, Refusal>) -> Msg {
    match result {
        Ok(msg) => Msg::Reply {
            status: Status::Ok,
            msg,
        },
        Err(Refusal::Failed(msg)) => Msg::Reply {
            status: Status::Failed,
            msg,
        },
        Err(Refusal::Stale(msg)) => Msg::Reply {
            status: Status::Stale,
            msg,
        },
        Err(Refusal::Absent(msg)) => Msg::Reply {
            status: Status::Absent,
            msg,
        },
    }
}

type Writer = Arc<std::sync::Mutex<BufWriter<TcpStream>>>;

/// FLUSHes are synced on their own thread, so the writes behind one keep going into the log
/// while the device syncs; flushes waiting together share one sync. A flush's reply may
/// overtake the replies of writes sent after it (replies are matched by request number).
fn syncer(sink: Arc<dyn Sink>, w: Writer) -> std::sync::mpsc::Sender<u64> {
    let (tx, rx) = std::sync::mpsc::channel::<u64>();
    let _ = std::thread::Builder::new()
        .name("peer-sync".into())
        .spawn(move || {
            while let Ok(first) = rx.recv() {
                let mut seqs = vec![first];
                seqs.extend(rx.try_iter());
                // Everything the connection applied before queueing these is in the log.
                let reply = reply_of(sink.flush().map(|_| String::new()));
                let mut w = w.lock().unwrap_or_else(|e| e.into_inner());
                let sent = seqs
                    .iter()
                    .try_for_each(|seq| w.write_all(&wire::encode(*seq, &reply)))
                    .and_then(|_| w.flush());
                if sent.is_err() {
                    return; // the connection is gone; its thread notices too
                }
            }
        });
    tx
}

/// Sends one frame and flushes it.
fn send(w: &Writer, seq: u64, msg: &Msg) -> std::io::Result<()> {
    let mut w = w.lock().unwrap_or_else(|e| e.into_inner());
    w.write_all(&wire::encode(seq, msg))?;
    w.flush()
}

/// The peer's side of the handshake ([`crate::auth`]): the connecting host's name once it
/// has proved it knows `key`; `None` if it left first.
fn handshake(
    r: &mut impl Read,
    w: &Writer,
    me: &str,
    key: &Key,
) -> std::io::Result<Option<String>> {
    let other = |m: String| std::io::Error::other(m);
    let Some((h, body)) = read_frame(r, HANDSHAKE_BODY_MAX)? else {
        return Ok(None);
    };
    let (owner, owner_nonce) = match wire::decode_body(&h, body).map_err(other_err)? {
        Msg::Hello { host, nonce, .. } => (host, nonce),
        m => {
            return Err(other(format!(
                "expected Hello first, got {:?}",
                kind_of(&m)
            )))
        }
    };
    let peer_nonce = auth::nonce()?;
    let x = Exchange {
        owner: &owner,
        owner_nonce: &owner_nonce,
        peer: me,
        peer_nonce: &peer_nonce,
    };
    let hello = Msg::Hello {
        host: me.to_owned(),
        nonce: peer_nonce,
        proof: key.prove(Role::Peer, &x),
    };
    send(w, h.seq, &hello)?;
    let Some((h, body)) = read_frame(r, HANDSHAKE_BODY_MAX)? else {
        return Ok(None);
    };
    let proof = match wire::decode_body(&h, body).map_err(other_err)? {
        Msg::Proof(p) => p,
        m => return Err(other(format!("expected Proof, got {:?}", kind_of(&m)))),
    };
    if !key.verify(Role::Owner, &x, &proof) {
        let why = format!("host {owner:?} did not prove it knows this pod's peer key");
        let reply = Msg::Reply {
            status: Status::Failed,
            msg: format!("{me} refused the connection: {why} (is it in another pod?)"),
        };
        send(w, h.seq, &reply)?;
        return Err(other(why));
    }
    let ok = Msg::Reply {
        status: Status::Ok,
        msg: String::new(),
    };
    send(w, h.seq, &ok)?;
    Ok(Some(owner))
}

fn other_err(e: wire::WireError) -> std::io::Error {
    std::io::Error::other(e)
}

/// A frame's kind, for an error that must not print a stranger's bytes.
fn kind_of(m: &Msg) -> &'static str {
    match m {
        Msg::Hello { .. } => "Hello",
        Msg::Proof(_) => "Proof",
        Msg::Open { .. } => "Open",
        Msg::Write(_) => "Write",
        Msg::Flush => "Flush",
        Msg::Checkpoint { .. } => "Checkpoint",
        Msg::Drop { .. } => "Drop",
        Msg::Held { .. } => "Held",
        Msg::Reply { .. } => "Reply",
    }
}

fn connection(s: TcpStream, sink: Arc<dyn Sink>, key: &Key, slot: Slot) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    let rd = s.try_clone()?;
    let w: Writer = Arc::new(std::sync::Mutex::new(BufWriter::with_capacity(64 << 10, s)));
    // Unbuffered: the owner sends nothing past its proof until it is answered.
    let mut until = Until {
        s: &rd,
        deadline: Instant::now() + HANDSHAKE_TIMEOUT,
    };
    let Some(from) = handshake(&mut until, &w, &sink.host(), key)? else {
        return Ok(());
    };
    drop(slot);
    rd.set_read_timeout(None)?;
    keep_alive(&rd)?;
    info!("peer {from} connected");
    // Small: headers and small bodies are buffered, a write's data is read straight into
    // its own buffer.
    let mut r = BufReader::with_capacity(16 << 10, rd.try_clone()?);
    let flushes = syncer(sink.clone(), w.clone());
    // Frames are applied in order by a thread of their own, all but checkpoints, which this
    // thread applies as it reads them: a write waiting for room in its volume's share waits
    // for exactly such a checkpoint, which would otherwise sit behind it on this connection
    // until the wait gave up. While that thread has nothing to do, this one applies what
    // needs no wait ([`read_frames`]).
    let pending = Arc::new(AtomicUsize::new(0));
    let (tx, rx) = std::sync::mpsc::channel::<(u64, Msg)>();
    let applier = {
        let (sink, w, from, pending) = (sink.clone(), w.clone(), from.clone(), pending.clone());
        std::thread::Builder::new()
            .name("peer-apply".into())
            .spawn(move || {
                let r = apply(rx, &*sink, &w, &from, &pending);
                // Ends the connection (a refused write, a lost socket): the reading thread
                // stops at its next read.
                let _ = rd.shutdown(std::net::Shutdown::Both);
                r
            })?
    };
    let read = read_frames(&mut r, &*sink, &w, &from, &tx, &flushes, &pending);
    drop(tx);
    let applied = applier
        .join()
        .unwrap_or_else(|_| Err(std::io::Error::other("the applying thread panicked")));
    read.and(applied)
}

/// An idle connection is probed after this long without traffic ([`keep_alive`])...
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(60);
/// ...then every this long, and ends after [`KEEPALIVE_PROBES`] go unanswered.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
pub const KEEPALIVE_PROBES: u32 = 6;

/// TCP keepalive for an owner's connection: one whose host lost power or dropped off the
/// network while the link was idle ends within about two minutes, instead of holding its
/// threads and buffers here for as long as this host runs (nothing is read from it with a
/// timeout once the handshake is done).
fn keep_alive(s: &TcpStream) -> std::io::Result<()> {
    let probes = socket2::TcpKeepalive::new()
        .with_time(KEEPALIVE_IDLE)
        .with_interval(KEEPALIVE_INTERVAL)
        .with_retries(KEEPALIVE_PROBES);
    socket2::SockRef::from(s).set_tcp_keepalive(&probes)
}

/// Reads `from`'s frames: checkpoints are applied here at once, and FLUSHes go to the
/// syncing thread at once; everything else is queued for [`apply`] in order, except that
/// while nothing is queued, a write with room ([`Sink::write_at_once`]) is applied here too:
/// nothing sent before it is still to be applied. Ends at the end of the stream, a damaged
/// or unexpected frame, a write refused here, or once [`apply`] has ended the connection.
fn read_frames(
    r: &mut BufReader<impl Read>,
    sink: &dyn Sink,
    w: &Writer,
    from: &str,
    tx: &std::sync::mpsc::Sender<(u64, Msg)>,
    flushes: &std::sync::mpsc::Sender<u64>,
    pending: &AtomicUsize,
) -> std::io::Result<()> {
    // Replies this thread wrote to the buffer and has not sent yet.
    let mut unsent = false;
    loop {
        if unsent && !frame_buffered(r) {
            // The next read may wait for the owner, which may be waiting for these.
            lock_writer(w).flush()?;
            unsent = false;
        }
        let Some((h, body)) = read_frame(r, wire::BODY_MAX)? else {
            info!("peer {from} disconnected");
            return Ok(());
        };
        let msg = match wire::decode_body(&h, body) {
            Ok(m) => m,
            Err(e) => {
                // The frame is damaged: answer it if possible and close, since nothing after
                // it can be trusted.
                let reply = Msg::Reply {
                    status: Status::Failed,
                    msg: format!("damaged frame: {e}"),
                };
                send(w, h.seq, &reply)?;
                return Err(std::io::Error::other(e));
            }
        };
        // Nothing queued nor being applied: a frame applied here keeps its place in the order.
        let idle = pending.load(Ordering::Acquire) == 0;
        let msg = match msg {
            // Ahead of the frames queued before it. Every write it covers completed, and a
            // write completes only once every peer acknowledged it, which this one does only
            // after applying it: the writes still queued are all above it.
            Msg::Checkpoint {
                volume,
                gen,
                ser,
                window_end,
            } => {
                let reply = reply_of(sink.checkpoint(volume, gen, ser, window_end).map(|_| {
                    if window_end != 0 {
                        wire::WINDOW_END_HELD.to_owned()
                    } else {
                        String::new()
                    }
                }));
                send(w, h.seq, &reply)?;
                unsent = false;
                continue;
            }
            Msg::Write(m) if idle => match sink.write_at_once(from, &m) {
                Some(Ok(())) => {
                    let ok = reply_of(Ok(String::new()));
                    lock_writer(w).write_all(&wire::encode(h.seq, &ok))?;
                    unsent = true;
                    continue;
                }
                Some(Err(e)) => {
                    refused(m.volume, from, &e);
                    send(w, h.seq, &reply_of(Err(e)))?;
                    return Ok(());
                }
                // It would wait for room: the applying thread waits instead.
                None => Msg::Write(m),
            },
            // Ahead of the frames queued before it too. The owner sends a FLUSH only for
            // writes this peer answered (a write completes only once every peer did; the
            // destager's FLUSH covers completed writes), so applied ones: a write still
            // queued is not the FLUSH's to wait for. Queued behind a write waiting for room,
            // it waited for the checkpoint that the owner's destager would send only once
            // this FLUSH was answered.
            Msg::Flush => {
                flushes
                    .send(h.seq)
                    .map_err(|_| std::io::Error::other("flush thread gone"))?;
                continue;
            }
            m => m,
        };
        match msg {
            Msg::Open { .. } | Msg::Write(_) | Msg::Drop { .. } | Msg::Held { .. } => {
                pending.fetch_add(1, Ordering::AcqRel);
                if tx.send((h.seq, msg)).is_err() {
                    return Ok(()); // the applying thread ended the connection
                }
            }
            other => {
                return Err(std::io::Error::other(format!(
                    "unexpected {} frame",
                    kind_of(&other)
                )))
            }
        }
    }
}

/// Whether `r` holds a whole frame already, so reading it will not wait for the socket.
fn frame_buffered<R>(r: &BufReader<R>) -> bool {
    let b = r.buffer();
    let Some(head) = b.first_chunk::<HEADER_LEN>() else {
        return false;
    };
    wire::decode_head(head).is_ok_and(|h| HEADER_LEN + h.body_len as usize <= b.len())
}

fn lock_writer(w: &Writer) -> std::sync::MutexGuard<'_, BufWriter<TcpStream>> {
    w.lock().unwrap_or_else(|e| e.into_inner())
}

/// Logs a write the sink refused.
fn refused(volume: uuid::Uuid, from: &str, e: &Refusal) {
    let (Refusal::Failed(why) | Refusal::Stale(why) | Refusal::Absent(why)) = e;
    warn!("refused a write of volume {volume} from peer {from}: {why}");
}

/// Applies `from`'s queued frames in the order they came and writes the replies, flushed
/// whenever nothing else is queued. Ends when the reading side is done and the queue is
/// empty, or at a refused write (the owner counts nothing after it and breaks the link).
/// `pending` counts the frames queued and not yet applied, the one being applied included.
fn apply(
    rx: std::sync::mpsc::Receiver<(u64, Msg)>,
    sink: &dyn Sink,
    w: &Writer,
    from: &str,
    pending: &AtomicUsize,
) -> std::io::Result<()> {
    let f = from;
    for (seq, msg) in rx {
        let result = match msg {
            Msg::Open {
                volume,
                gen,
                checkpoint,
            } => sink.open(f, volume, gen, checkpoint).map(|_| String::new()),
            Msg::Write(m) => {
                let volume = m.volume;
                // One that will wait for room must not hold back the answers buffered ahead
                // of it: the owner's destager may need them to send the checkpoint that
                // frees that room.
                let done = match sink.write_at_once(f, &m) {
                    Some(r) => r,
                    None => {
                        lock_writer(w).flush()?;
                        sink.write(f, m)
                    }
                };
                match done {
                    Ok(()) => Ok(String::new()),
                    Err(e) => {
                        // The owner counts nothing after a refused write and breaks the link:
                        // the writes queued behind this one are not applied (each could wait
                        // for room again), the connection ends here.
                        refused(volume, f, &e);
                        send(w, seq, &reply_of(Err(e)))?;
                        return Ok(());
                    }
                }
            }
            Msg::Drop { volume, gen } => sink.drop_replicas(volume, gen).map(|_| String::new()),
            Msg::Held { volume, gen, from } => sink.held(volume, gen, from).map(|h| h.encode()),
            other => {
                return Err(std::io::Error::other(format!(
                    "unexpected {} frame",
                    kind_of(&other)
                )))
            }
        };
        let reply = reply_of(result);
        let mut w = lock_writer(w);
        w.write_all(&wire::encode(seq, &reply))?;
        // Applied and answered (under the writer's lock, so that a reply the reading thread
        // writes once it sees nothing pending comes after this one).
        if pending.fetch_sub(1, Ordering::AcqRel) == 1 {
            w.flush()?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An owner's connection is probed when idle, with the idle time, interval and probe
    /// count the constants say (off unless asked for; the kernel's defaults take hours).
    #[test]
    fn an_owners_connection_is_probed_when_idle() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let _c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        let sock = socket2::SockRef::from(&s);
        assert!(!sock.keepalive().unwrap());
        keep_alive(&s).unwrap();
        assert!(sock.keepalive().unwrap());
        assert_eq!(sock.tcp_keepalive_time().unwrap(), KEEPALIVE_IDLE);
        assert_eq!(sock.tcp_keepalive_interval().unwrap(), KEEPALIVE_INTERVAL);
        assert_eq!(sock.tcp_keepalive_retries().unwrap(), KEEPALIVE_PROBES);
    }
}
