//! A pipelined NBD client with a small pool of connections.
//!
//! Each connection has one writer task (requests are queued to it over a channel, so a caller
//! that gives up never leaves half a request on the wire) and one reader task that matches
//! simple replies to waiting callers by cookie. Many requests are in flight on each connection.
//!
//! The pool uses several connections only when the server advertises `NBD_FLAG_CAN_MULTI_CONN`:
//! without it, a FLUSH on one connection need not cover writes completed on another, so a
//! single connection is the only correct choice. A connection that fails is reconnected lazily
//! by the next request; requests that were in flight on it fail with an error (never a guess).
//!
//! A server that stops answering is treated like one that closed: a request with no reply
//! within [`REQUEST_TIMEOUT`] fails its connection and everything in flight on it.
//!
//! Durability across reconnects: a write acknowledged without FUA sits in the server's cache
//! until a FLUSH, and a FLUSH on a new connection does not cover writes acknowledged on one
//! that died. So when a connection dies holding such writes, the next [`Client::flush`] fails
//! with EIO (as `fsync` reports lost writeback), instead of claiming they are durable.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex as StdMutex};

use bytes::{BufMut, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::{TcpStream, UnixStream};
use tokio::sync::{mpsc, oneshot, Mutex};
use tokio::task::AbortHandle;

/// A request with no reply after this long fails its connection.
pub const REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);
/// Connecting (TCP or unix) must succeed within this long.
pub const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

use crate::proto::{self, Errno, InfoRequest, Request};
use crate::uri::{Address, NbdUri};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot reach NBD server {uri}: {source}")]
    Connect { uri: String, source: io::Error },
    #[error("NBD server {uri} refused export: {msg}")]
    Refused { uri: String, msg: String },
    #[error("NBD protocol error with {uri}: {msg}")]
    Protocol { uri: String, msg: String },
    #[error("NBD server answered {0}")]
    Server(Errno),
    /// The connection ended, or gave up waiting, with the request sent: the server may still
    /// carry it out.
    #[error("NBD connection lost: {0}")]
    Disconnected(String),
    /// The connection was gone before the request went out: nothing was sent.
    #[error("NBD connection lost: {0}")]
    NotSent(String),
    /// The write guard ([`Client::set_write_guard`]) refused the request; it was not sent.
    #[error("{0}")]
    Held(String),
}

/// Says, right before a write, trim or zeroing is sent, whether it may go: `None` if so,
/// else why not.
pub type WriteGuard = Arc<dyn Fn() -> Option<String> + Send + Sync>;

/// What the server told us about the export.
#[derive(Debug, Clone, Copy)]
pub struct RemoteExport {
    pub size: u64,
    pub flags: u16,
    pub block_min: u32,
    pub block_max: u32,
}

impl RemoteExport {
    pub fn can_multi_conn(&self) -> bool {
        self.flags & proto::FLAG_CAN_MULTI_CONN != 0
    }
    pub fn read_only(&self) -> bool {
        self.flags & proto::FLAG_READ_ONLY != 0
    }
}

pub struct Client {
    uri: NbdUri,
    export: RemoteExport,
    conns: Vec<Mutex<Option<Arc<Live>>>>,
    next: AtomicUsize,
    dur: Arc<Durability>,
    /// The losses [`Client::flush`] has reported.
    seen: AtomicU64,
    write_guard: std::sync::OnceLock<WriteGuard>,
}

/// Which acknowledged writes may still be lost. Writes are numbered as they are acknowledged;
/// each connection knows the newest it acknowledged and the newest a FLUSH on it covered.
#[derive(Default)]
struct Durability {
    write_seq: AtomicU64,
    /// How many times a connection died, or a sync on it failed, holding acknowledged,
    /// unflushed writes. Each user of the client (every volume on a LUN shares it) must
    /// learn of each loss that may have taken one of its writes, not just the first to flush.
    losses: AtomicU64,
}

struct Pending {
    read_len: u32,
    /// A write, zeroing or trim without FUA: numbered when its answer arrives, as one a
    /// FLUSH must cover.
    numbered: bool,
    /// For a FLUSH: the newest write number acknowledged when it was sent, which its
    /// answer covers on this connection.
    covers: u64,
    /// A FLUSH, or a write with FUA: the server syncs for it, and a sync that fails may
    /// have lost writes it acknowledged before ([`Live::sync_failed`]).
    syncs: bool,
    /// For a sync: the connection's failed syncs when it was sent ([`Live::sync_fails`]).
    fails_before: u64,
    tx: oneshot::Sender<Result<Bytes, ClientError>>,
}

struct Outgoing {
    header: [u8; proto::REQUEST_LEN],
    payload: Option<Bytes>,
}

/// One live connection.
struct Live {
    tx: mpsc::UnboundedSender<Outgoing>,
    pending: StdMutex<HashMap<u64, Pending>>,
    dead: AtomicBool,
    next_cookie: AtomicU64,
    tasks: StdMutex<Vec<AbortHandle>>,
    dur: Arc<Durability>,
    /// Number of the newest write acknowledged on this connection without FUA.
    max_acked: AtomicU64,
    /// Number of the newest write a FLUSH answered on this connection covered. Only a FLUSH
    /// on the connection itself counts: another connection of the pool may reach a server
    /// that restarted (its cache gone) while this one has not noticed yet.
    flushed: AtomicU64,
    /// Syncs on this connection that failed so far ([`Live::sync_failed`]).
    sync_fails: AtomicU64,
    /// Syncs answered OK while other syncs sent before the answer were still in flight:
    /// held until those answer ([`Live::sync_ok`]).
    held: StdMutex<Vec<Held>>,
}

/// A sync answered OK, waiting for the syncs that may have run beside it on the server.
struct Held {
    cookie: u64,
    waits: Vec<u64>,
    /// One of them failed: the OK may hide a write-back error that one took.
    failed: bool,
    covers: u64,
    tx: oneshot::Sender<Result<Bytes, ClientError>>,
}

/// Errors a server answers for a request it refused without running it: no sync ran.
fn refusal(errno: Errno) -> bool {
    matches!(
        errno,
        Errno::EINVAL | Errno::EPERM | Errno::EOVERFLOW | Errno::ENOTSUP | Errno::ESHUTDOWN
    )
}

impl Live {
    /// Counts a loss if a write acknowledged here (up to number `acked`) is not covered by
    /// a FLUSH on this connection.
    fn note_loss(&self, acked: u64) {
        if acked > self.flushed.load(Ordering::SeqCst) {
            self.dur.losses.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// A sync (a FLUSH, or a write with FUA) answered with an error, `cookie` its request.
    ///
    /// Unless the server refused it, its write-back error may have taken any write sent on
    /// the connection before the error was answered, and a server backed by a file
    /// (nbdkit's `file`, one descriptor per connection) reports such an error to one `fsync`
    /// of it only: a later FLUSH answers OK, and so may one that ran beside it. So it counts
    /// as a loss, as a connection that died does (every user with writes sent before it
    /// hears of it at its next flush; whether a FLUSH on the connection covered them does not
    /// matter, since another sync may have taken the error meant for it), and the syncs that
    /// answered OK while it was in flight are answered EIO ([`Live::sync_ok`]). Counted
    /// before the answer goes out.
    fn sync_failed(&self, cookie: u64, errno: Errno) {
        let ran = !refusal(errno);
        if ran {
            self.sync_fails.fetch_add(1, Ordering::SeqCst);
            self.dur.losses.fetch_add(1, Ordering::SeqCst);
        }
        self.sync_answered(cookie, ran);
    }

    /// A sync answered OK. Its OK holds only if no sync that may have run beside it on the
    /// server failed: one that failed while it was in flight makes it EIO at once; one still
    /// in flight when it answered (sent before the answer, so maybe run beside it) holds it
    /// until that one answers. A sync sent after the answer ran after it.
    fn sync_ok(&self, cookie: u64, p: Pending) {
        self.sync_answered(cookie, false);
        if self.sync_fails.load(Ordering::SeqCst) != p.fails_before {
            let _ = p.tx.send(Err(ClientError::Server(Errno::EIO)));
            return;
        }
        let waits: Vec<u64> = {
            let pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            // `fail` marks the connection dead, under this lock, before it empties `pending`:
            // what is left there then says nothing of what was in flight.
            if self.dead.load(Ordering::SeqCst) {
                drop(pending);
                let _ =
                    p.tx.send(Err(ClientError::Disconnected("connection failed".into())));
                return;
            }
            pending
                .iter()
                .filter(|(_, q)| q.syncs)
                .map(|(c, _)| *c)
                .collect()
        };
        if waits.is_empty() {
            self.flushed.fetch_max(p.covers, Ordering::SeqCst);
            let _ = p.tx.send(Ok(Bytes::new()));
            return;
        }
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        // `fail` marks the connection dead before it empties `held`: one that has not yet
        // will find this entry.
        if self.dead.load(Ordering::SeqCst) {
            let _ =
                p.tx.send(Err(ClientError::Disconnected("connection failed".into())));
            return;
        }
        held.push(Held {
            cookie,
            waits,
            failed: false,
            covers: p.covers,
            tx: p.tx,
        });
    }

    /// The sync `cookie` answered (`failed`: it ran and failed): held OKs that waited for it
    /// go out once nothing else holds them, EIO if one they waited for failed.
    fn sync_answered(&self, cookie: u64, failed: bool) {
        let ready: Vec<Held> = {
            let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
            for h in held.iter_mut() {
                if let Some(i) = h.waits.iter().position(|c| *c == cookie) {
                    h.waits.swap_remove(i);
                    h.failed |= failed;
                }
            }
            let (ready, waiting) = std::mem::take(&mut *held)
                .into_iter()
                .partition(|h| h.waits.is_empty());
            *held = waiting;
            ready
        };
        for h in ready {
            if h.failed {
                let _ = h.tx.send(Err(ClientError::Server(Errno::EIO)));
            } else {
                self.flushed.fetch_max(h.covers, Ordering::SeqCst);
                let _ = h.tx.send(Ok(Bytes::new()));
            }
        }
    }

    /// Whether request `cookie` was answered OK and is held ([`Live::sync_ok`]).
    fn is_held(&self, cookie: u64) -> bool {
        self.held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|h| h.cookie == cookie)
    }

    /// Waits until a `fail` that marked the connection dead has counted its losses.
    fn counted(&self) {
        drop(self.pending.lock().unwrap_or_else(|e| e.into_inner()));
    }

    /// Marks the connection dead and fails everything in flight on it.
    fn fail(&self, why: &str) {
        let drained: Vec<Pending> = {
            let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            self.dead.store(true, Ordering::SeqCst);
            // Counted under the lock: whoever replaces this connection takes the lock first
            // ([`Client::live`]), so no FLUSH on its successor can answer before the loss is
            // counted.
            self.note_loss(self.max_acked.load(Ordering::SeqCst));
            p.drain().map(|(_, v)| v).collect()
        };
        for p in drained {
            let _ = p.tx.send(Err(ClientError::Disconnected(why.to_owned())));
        }
        let held = std::mem::take(&mut *self.held.lock().unwrap_or_else(|e| e.into_inner()));
        for h in held {
            let _ = h.tx.send(Err(ClientError::Disconnected(why.to_owned())));
        }
        for t in self
            .tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            t.abort();
        }
    }
}

trait Duplex: AsyncRead + AsyncWrite + Unpin + Send + 'static {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> Duplex for T {}

impl Client {
    /// Connects and negotiates the first connection; the rest of the pool connects on demand.
    pub async fn connect(uri: &NbdUri, pool: usize) -> Result<Client, ClientError> {
        let dur = Arc::new(Durability::default());
        let (export, live) = open_live(uri, &dur).await?;
        let pool = if export.can_multi_conn() {
            pool.max(1)
        } else {
            1
        };
        let mut conns = Vec::with_capacity(pool);
        conns.push(Mutex::new(Some(live)));
        for _ in 1..pool {
            conns.push(Mutex::new(None));
        }
        Ok(Client {
            uri: uri.clone(),
            export,
            conns,
            next: AtomicUsize::new(0),
            dur,
            seen: AtomicU64::new(0),
            write_guard: std::sync::OnceLock::new(),
        })
    }

    pub fn export(&self) -> RemoteExport {
        self.export
    }

    pub fn uri(&self) -> &NbdUri {
        &self.uri
    }

    /// Asks `guard` before every write, trim and zeroing is sent (the datastore layer's
    /// fence: a host whose lease lapsed while a write waited here must not send it). Set
    /// once; a second call keeps the first.
    pub fn set_write_guard(&self, guard: WriteGuard) {
        let _ = self.write_guard.set(guard);
    }

    pub fn pool_size(&self) -> usize {
        self.conns.len()
    }

    /// Requests awaiting their answer and sync answers held ([`Live::sync_ok`]), over the
    /// live connections: what a test waits for before it pauses the clock.
    #[cfg(test)]
    pub(crate) async fn waiting(&self) -> (usize, usize) {
        let (mut pending, mut held) = (0, 0);
        for slot in &self.conns {
            if let Some(l) = slot.lock().await.as_ref() {
                pending += l.pending.lock().unwrap_or_else(|e| e.into_inner()).len();
                held += l.held.lock().unwrap_or_else(|e| e.into_inner()).len();
            }
        }
        (pending, held)
    }

    async fn live(&self) -> Result<Arc<Live>, ClientError> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.conns.len();
        let mut slot = self.conns[i].lock().await;
        if let Some(l) = slot.as_ref() {
            if !l.dead.load(Ordering::SeqCst) {
                return Ok(l.clone());
            }
            l.counted();
        }
        let (export, live) = open_live(&self.uri, &self.dur).await?;
        if export.size != self.export.size {
            live.fail("export changed size");
            return Err(ClientError::Protocol {
                uri: self.uri.to_string(),
                msg: format!(
                    "export size changed from {} to {} across a reconnect",
                    self.export.size, export.size
                ),
            });
        }
        *slot = Some(live.clone());
        Ok(live)
    }

    async fn call(
        &self,
        kind: u16,
        flags: u16,
        offset: u64,
        len: u32,
        payload: Option<Bytes>,
    ) -> Result<Bytes, ClientError> {
        let live = self.live().await?;
        let modifies = matches!(
            kind,
            proto::CMD_WRITE | proto::CMD_TRIM | proto::CMD_WRITE_ZEROES
        );
        // Asked here, after any wait for a connection and right before the request goes to
        // the socket: a write that waited out a reconnect must not go once it may not.
        if modifies {
            if let Some(why) = self.write_guard.get().and_then(|g| g()) {
                return Err(ClientError::Held(why));
            }
        }
        self.call_on(&live, kind, flags, offset, len, payload).await
    }

    async fn call_on(
        &self,
        live: &Arc<Live>,
        kind: u16,
        flags: u16,
        offset: u64,
        len: u32,
        payload: Option<Bytes>,
    ) -> Result<Bytes, ClientError> {
        let rx = send_on(live, kind, flags, offset, len, payload)?;
        reply_of(live, kind, rx).await
    }

    fn max_chunk(&self) -> u32 {
        self.export
            .block_max
            .clamp(proto::BLOCK_SIZE_MIN, proto::BLOCK_SIZE_MAX)
    }

    pub async fn read(&self, offset: u64, len: u32) -> Result<Bytes, ClientError> {
        let max = self.max_chunk();
        if len <= max {
            return self.call(proto::CMD_READ, 0, offset, len, None).await;
        }
        let mut out = BytesMut::with_capacity(len as usize);
        let mut done = 0u32;
        while done < len {
            let n = (len - done).min(max);
            let d = self
                .call(proto::CMD_READ, 0, offset + u64::from(done), n, None)
                .await?;
            out.extend_from_slice(&d);
            done += n;
        }
        Ok(out.freeze())
    }

    pub async fn write(&self, offset: u64, data: Bytes, fua: bool) -> Result<(), ClientError> {
        let send_fua = self.export.flags & proto::FLAG_SEND_FUA != 0;
        let flags = if fua && send_fua {
            proto::CMD_FLAG_FUA
        } else {
            0
        };
        let max = self.max_chunk() as usize;
        // With FUA emulated by a FLUSH, a loss counted from here on may have taken the write.
        let before = self.losses();
        let mut done = 0usize;
        while done < data.len() {
            let n = (data.len() - done).min(max);
            let chunk = data.slice(done..done + n);
            self.call(
                proto::CMD_WRITE,
                flags,
                offset + done as u64,
                n as u32,
                Some(chunk),
            )
            .await?;
            done += n;
        }
        if fua && !send_fua {
            self.flush_acked().await?;
            if self.losses() != before {
                return Err(ClientError::Server(Errno::EIO));
            }
        }
        Ok(())
    }

    /// Makes every acknowledged write durable, or fails with EIO if some acknowledged write
    /// may have been lost (with a connection, or in a sync that failed) since the last flush
    /// that said so (each loss is reported once, like a failed `fsync`, to whichever flush
    /// ends first). For a
    /// client shared by several users, or flushes that run at once, use
    /// [`Client::flush_acked`] and [`Client::losses`], and decide per user.
    pub async fn flush(&self) -> Result<(), ClientError> {
        self.flush_acked().await?;
        let losses = self.losses();
        if self.seen.swap(losses, Ordering::SeqCst) != losses {
            return Err(ClientError::Server(Errno::EIO));
        }
        Ok(())
    }

    /// FLUSH: makes every write acknowledged so far durable. It says nothing of writes
    /// lost before it ran: a connection that died with acknowledged, unflushed writes is
    /// counted in [`Client::losses`] before this returns.
    ///
    /// Each connection holding acknowledged writes no FLUSH covered gets a FLUSH of its own
    /// (at once, so usually one): one FLUSH covers a multi-conn server's every connection,
    /// but after a reconnect the pool may span a restarted server and the one before it.
    pub async fn flush_acked(&self) -> Result<(), ClientError> {
        let mut lives = Vec::with_capacity(self.conns.len());
        for slot in &self.conns {
            if let Some(l) = slot.lock().await.clone() {
                if l.dead.load(Ordering::SeqCst) {
                    l.counted();
                } else {
                    lives.push(l);
                }
            }
        }
        if self.export.flags & proto::FLAG_SEND_FLUSH == 0 {
            // The server has no write cache to lose.
            let covered = self.dur.write_seq.load(Ordering::SeqCst);
            for l in &lives {
                l.flushed.fetch_max(covered, Ordering::SeqCst);
            }
            return Ok(());
        }
        let unflushed: Vec<&Arc<Live>> = lives
            .iter()
            .filter(|l| l.max_acked.load(Ordering::SeqCst) > l.flushed.load(Ordering::SeqCst))
            .collect();
        if unflushed.is_empty() {
            self.call(proto::CMD_FLUSH, 0, 0, 0, None).await?;
            return Ok(());
        }
        // All sent before any answer is awaited; the reader records what each covers.
        let deadline = tokio::time::Instant::now() + REQUEST_TIMEOUT;
        let sent: Vec<_> = unflushed
            .iter()
            .map(|l| send_on(l, proto::CMD_FLUSH, 0, 0, 0, None))
            .collect();
        let mut first_err = None;
        for (l, rx) in unflushed.iter().zip(sent) {
            let answer = match rx {
                Ok(rx) => reply_by(l, proto::CMD_FLUSH, rx, deadline).await,
                Err(e) => Err(e),
            };
            if let Err(e) = answer {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// How many times acknowledged, unflushed writes may have been lost so far: with a
    /// connection that died, or in a sync that failed on one.
    pub fn losses(&self) -> u64 {
        self.dur.losses.load(Ordering::SeqCst)
    }

    pub async fn trim(&self, offset: u64, len: u32) -> Result<(), ClientError> {
        if self.export.flags & proto::FLAG_SEND_TRIM == 0 {
            return Ok(()); // trim is a hint
        }
        self.call(proto::CMD_TRIM, 0, offset, len, None)
            .await
            .map(|_| ())
    }

    pub async fn write_zeroes(
        &self,
        offset: u64,
        len: u32,
        may_trim: bool,
    ) -> Result<(), ClientError> {
        if self.export.flags & proto::FLAG_SEND_WRITE_ZEROES != 0 {
            let flags = if may_trim { 0 } else { proto::CMD_FLAG_NO_HOLE };
            return self
                .call(proto::CMD_WRITE_ZEROES, flags, offset, len, None)
                .await
                .map(|_| ());
        }
        let chunk = (1u32 << 20).min(len);
        let zeroes = Bytes::from(vec![0u8; chunk as usize]);
        let mut done = 0u32;
        while done < len {
            let n = (len - done).min(chunk);
            self.write(offset + u64::from(done), zeroes.slice(..n as usize), false)
                .await?;
            done += n;
        }
        Ok(())
    }

    /// Sends NBD_CMD_DISC on every open connection.
    pub async fn disconnect(&self) {
        for c in &self.conns {
            if let Some(l) = c.lock().await.take() {
                let mut b = BytesMut::new();
                Request {
                    flags: 0,
                    kind: proto::CMD_DISC,
                    cookie: 0,
                    offset: 0,
                    len: 0,
                }
                .encode(&mut b);
                let mut header = [0u8; proto::REQUEST_LEN];
                header.copy_from_slice(&b);
                let _ = l.tx.send(Outgoing {
                    header,
                    payload: None,
                });
            }
        }
    }
}

async fn dial(uri: &NbdUri) -> io::Result<Box<dyn Duplex>> {
    tokio::time::timeout(CONNECT_TIMEOUT, dial_now(uri))
        .await
        .unwrap_or_else(|_| {
            Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("connect timed out after {}s", CONNECT_TIMEOUT.as_secs()),
            ))
        })
}

async fn dial_now(uri: &NbdUri) -> io::Result<Box<dyn Duplex>> {
    Ok(match &uri.address {
        Address::Tcp { host, port } => {
            let s = TcpStream::connect((host.as_str(), *port)).await?;
            s.set_nodelay(true)?;
            Box::new(s)
        }
        Address::Unix(p) => Box::new(UnixStream::connect(p).await?),
    })
}

/// The way to a request's answer.
struct Reply {
    cookie: u64,
    rx: oneshot::Receiver<Result<Bytes, ClientError>>,
}

/// Puts a request on `live`'s way out; [`reply_of`] waits for its answer.
fn send_on(
    live: &Arc<Live>,
    kind: u16,
    flags: u16,
    offset: u64,
    len: u32,
    payload: Option<Bytes>,
) -> Result<Reply, ClientError> {
    let cookie = live.next_cookie.fetch_add(1, Ordering::Relaxed);
    let (tx, rx) = oneshot::channel();
    {
        let mut p = live.pending.lock().unwrap_or_else(|e| e.into_inner());
        if live.dead.load(Ordering::SeqCst) {
            return Err(ClientError::NotSent("connection failed".into()));
        }
        let read_len = if kind == proto::CMD_READ { len } else { 0 };
        // Writes are numbered once answered, so every write numbered now was answered
        // before this FLUSH goes out.
        let covers = if kind == proto::CMD_FLUSH {
            live.dur.write_seq.load(Ordering::SeqCst)
        } else {
            0
        };
        let numbered = matches!(
            kind,
            proto::CMD_WRITE | proto::CMD_TRIM | proto::CMD_WRITE_ZEROES
        ) && flags & proto::CMD_FLAG_FUA == 0;
        let syncs = kind == proto::CMD_FLUSH || flags & proto::CMD_FLAG_FUA != 0;
        let fails_before = live.sync_fails.load(Ordering::SeqCst);
        p.insert(
            cookie,
            Pending {
                read_len,
                numbered,
                covers,
                syncs,
                fails_before,
                tx,
            },
        );
    }
    let mut b = BytesMut::with_capacity(proto::REQUEST_LEN);
    Request {
        flags,
        kind,
        cookie,
        offset,
        len,
    }
    .encode(&mut b);
    let mut header = [0u8; proto::REQUEST_LEN];
    header.copy_from_slice(&b);
    if live.tx.send(Outgoing { header, payload }).is_err() {
        live.fail("writer stopped");
    }
    Ok(Reply { cookie, rx })
}

/// The answer to a request [`send_on`] sent on `live`; the connection fails if it takes
/// longer than [`REQUEST_TIMEOUT`].
async fn reply_of(live: &Live, kind: u16, rx: Reply) -> Result<Bytes, ClientError> {
    reply_by(
        live,
        kind,
        rx,
        tokio::time::Instant::now() + REQUEST_TIMEOUT,
    )
    .await
}

/// [`reply_of`] for a request sent earlier, at the same time as others: each gets
/// [`REQUEST_TIMEOUT`] from when they were all sent, not from when its answer is awaited, so
/// requests awaited one after another on silent connections fail together.
async fn reply_by(
    live: &Live,
    kind: u16,
    mut reply: Reply,
    mut deadline: tokio::time::Instant,
) -> Result<Bytes, ClientError> {
    let lost = |_| Err(ClientError::Disconnected("reply lost".into()));
    let mut late = false;
    let why = loop {
        match tokio::time::timeout_at(deadline, &mut reply.rx).await {
            Ok(r) => return r.unwrap_or_else(lost),
            // Answered OK in time, and held for syncs that may have run beside it
            // ([`Live::sync_ok`]), which answer within their own deadlines or fail the
            // connection, releasing it: one more timeout's grace, and no more (one whose
            // waiter went away has nobody to time it out).
            Err(_) if !late && live.is_held(reply.cookie) => {
                late = true;
                deadline = tokio::time::Instant::now() + REQUEST_TIMEOUT;
            }
            Err(_) => {
                // Answered just as the deadline passed.
                if let Ok(r) = reply.rx.try_recv() {
                    return r;
                }
                break format!(
                    "no reply to {} within {}s",
                    proto::command_name(kind),
                    REQUEST_TIMEOUT.as_secs()
                );
            }
        }
    };
    live.fail(&why);
    Err(ClientError::Disconnected(why))
}

async fn open_live(
    uri: &NbdUri,
    dur: &Arc<Durability>,
) -> Result<(RemoteExport, Arc<Live>), ClientError> {
    let s = dial(uri).await.map_err(|source| ClientError::Connect {
        uri: uri.to_string(),
        source,
    })?;
    let (rd, wr) = tokio::io::split(s);
    let mut rd = BufReader::with_capacity(128 * 1024, rd);
    let mut wr = BufWriter::with_capacity(128 * 1024, wr);
    let export = tokio::time::timeout(
        std::time::Duration::from_secs(30),
        handshake(&mut rd, &mut wr, uri),
    )
    .await
    .map_err(|_| ClientError::Protocol {
        uri: uri.to_string(),
        msg: "negotiation timed out".into(),
    })??;

    let (tx, rx) = mpsc::unbounded_channel();
    let live = Arc::new(Live {
        tx,
        pending: StdMutex::new(HashMap::new()),
        dead: AtomicBool::new(false),
        next_cookie: AtomicU64::new(1),
        tasks: StdMutex::new(Vec::new()),
        dur: dur.clone(),
        max_acked: AtomicU64::new(0),
        flushed: AtomicU64::new(0),
        sync_fails: AtomicU64::new(0),
        held: StdMutex::new(Vec::new()),
    });
    {
        // Registered before either task can call `fail`, which takes this lock to abort them.
        let mut tasks = live.tasks.lock().unwrap_or_else(|e| e.into_inner());
        let w = tokio::spawn(writer(wr, rx, live.clone()));
        let r = tokio::spawn(reader(rd, live.clone()));
        tasks.extend([w.abort_handle(), r.abort_handle()]);
    }
    Ok((export, live))
}

async fn writer<W: AsyncWrite + Unpin>(
    mut wr: BufWriter<W>,
    mut rx: mpsc::UnboundedReceiver<Outgoing>,
    live: Arc<Live>,
) {
    while let Some(first) = rx.recv().await {
        let mut next = Some(first);
        let res: io::Result<()> = async {
            while let Some(o) = next {
                wr.write_all(&o.header).await?;
                if let Some(p) = &o.payload {
                    wr.write_all(p).await?;
                }
                next = rx.try_recv().ok();
            }
            wr.flush().await
        }
        .await;
        if let Err(e) = res {
            live.fail(&format!("write failed: {e}"));
            return;
        }
    }
}

async fn reader<R: AsyncRead + Unpin>(mut rd: BufReader<R>, live: Arc<Live>) {
    let why = loop {
        let mut h = [0u8; proto::SIMPLE_REPLY_LEN];
        if let Err(e) = rd.read_exact(&mut h).await {
            break format!("read failed: {e}");
        }
        let Some((errno, cookie)) = proto::decode_simple_reply(&h) else {
            break "bad reply magic (structured replies were not negotiated)".to_owned();
        };
        let pending = live
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&cookie);
        let Some(p) = pending else {
            break format!("reply for unknown cookie {cookie:#x}");
        };
        if errno.0 != 0 {
            // Counted before the answer goes out, so the failed flusher's caller and every
            // later flush see it.
            if p.syncs {
                live.sync_failed(cookie, errno);
            }
            let _ = p.tx.send(Err(ClientError::Server(errno)));
            continue;
        }
        if p.read_len == 0 {
            // Both counted here, before this task can read the connection's end (which it
            // hands to `fail`): a write answered just before the end is known to be unflushed,
            // and a server that answers a FLUSH and then closes (a graceful restart) lost
            // nothing it covered.
            if p.numbered {
                let n = live.dur.write_seq.fetch_add(1, Ordering::SeqCst) + 1;
                live.max_acked.fetch_max(n, Ordering::SeqCst);
                // Another task (the writer's, a timeout) may have failed the connection since
                // this answer was taken from `pending`, and looked at `max_acked` before it
                // held this write: then it is counted here (`fail` marks the connection dead
                // before it reads, this reads after counting).
                if live.dead.load(Ordering::SeqCst) {
                    live.note_loss(n);
                }
            }
            if p.syncs {
                live.sync_ok(cookie, p);
            } else {
                let _ = p.tx.send(Ok(Bytes::new()));
            }
            continue;
        }
        let mut buf = BytesMut::with_capacity(p.read_len as usize);
        let mut failed = None;
        while buf.len() < p.read_len as usize {
            let want = p.read_len as usize - buf.len();
            match (&mut rd).take(want as u64).read_buf(&mut buf).await {
                Ok(0) => {
                    failed = Some("server closed mid-reply".to_owned());
                    break;
                }
                Ok(_) => {}
                Err(e) => {
                    failed = Some(format!("read failed: {e}"));
                    break;
                }
            }
        }
        if let Some(why) = failed {
            let _ = p.tx.send(Err(ClientError::Disconnected(why.clone())));
            break why;
        }
        let _ = p.tx.send(Ok(buf.freeze()));
    };
    live.fail(&why);
}

pub(crate) async fn handshake<R, W>(
    rd: &mut R,
    wr: &mut W,
    uri: &NbdUri,
) -> Result<RemoteExport, ClientError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let proto_err = |msg: String| ClientError::Protocol {
        uri: uri.to_string(),
        msg,
    };
    let io_err = |e: io::Error| ClientError::Protocol {
        uri: uri.to_string(),
        msg: format!("during negotiation: {e}"),
    };
    let magic = rd.read_u64().await.map_err(io_err)?;
    let opt = rd.read_u64().await.map_err(io_err)?;
    if magic != proto::NBDMAGIC || opt != proto::IHAVEOPT {
        return Err(proto_err(
            "not a newstyle NBD server (bad greeting magic)".into(),
        ));
    }
    let hflags = rd.read_u16().await.map_err(io_err)?;
    if hflags & proto::FLAG_FIXED_NEWSTYLE == 0 {
        return Err(proto_err("server does not speak fixed newstyle".into()));
    }
    let no_zeroes = hflags & proto::FLAG_NO_ZEROES != 0;
    let mut cflags = proto::FLAG_C_FIXED_NEWSTYLE;
    if no_zeroes {
        cflags |= proto::FLAG_C_NO_ZEROES;
    }
    let mut out = BytesMut::new();
    out.put_u32(cflags);
    let mut data = BytesMut::new();
    InfoRequest {
        name: uri.export.clone(),
        requests: vec![proto::INFO_BLOCK_SIZE],
    }
    .encode(&mut data);
    out.put_u64(proto::IHAVEOPT);
    out.put_u32(proto::OPT_GO);
    out.put_u32(data.len() as u32);
    out.put_slice(&data);
    wr.write_all(&out).await.map_err(io_err)?;
    wr.flush().await.map_err(io_err)?;

    let mut size = None;
    let mut flags = 0u16;
    let (mut block_min, mut block_max) = (1u32, proto::BLOCK_SIZE_MAX);
    loop {
        let magic = rd.read_u64().await.map_err(io_err)?;
        if magic != proto::OPT_REPLY_MAGIC {
            return Err(proto_err(format!("bad option reply magic {magic:#x}")));
        }
        let _opt = rd.read_u32().await.map_err(io_err)?;
        let kind = rd.read_u32().await.map_err(io_err)?;
        let len = rd.read_u32().await.map_err(io_err)?;
        if len > 64 * 1024 {
            return Err(proto_err(format!("option reply of {len} bytes")));
        }
        let mut d = vec![0u8; len as usize];
        rd.read_exact(&mut d).await.map_err(io_err)?;
        match kind {
            proto::REP_ACK => break,
            proto::REP_INFO if d.len() >= 2 => match proto::be16(&d) {
                proto::INFO_EXPORT if d.len() >= 12 => {
                    size = Some(proto::be64(&d[2..10]));
                    flags = proto::be16(&d[10..12]);
                }
                proto::INFO_BLOCK_SIZE if d.len() >= 14 => {
                    block_min = proto::be32(&d[2..6]);
                    block_max = proto::be32(&d[10..14]);
                }
                _ => {}
            },
            proto::REP_ERR_UNSUP => {
                // An old server without NBD_OPT_GO: fall back to NBD_OPT_EXPORT_NAME.
                let mut out = BytesMut::new();
                out.put_u64(proto::IHAVEOPT);
                out.put_u32(proto::OPT_EXPORT_NAME);
                out.put_u32(uri.export.len() as u32);
                out.put_slice(uri.export.as_bytes());
                wr.write_all(&out).await.map_err(io_err)?;
                wr.flush().await.map_err(io_err)?;
                let s = rd.read_u64().await.map_err(io_err)?;
                flags = rd.read_u16().await.map_err(io_err)?;
                if !no_zeroes {
                    let mut z = [0u8; 124];
                    rd.read_exact(&mut z).await.map_err(io_err)?;
                }
                size = Some(s);
                break;
            }
            k if k & (1 << 31) != 0 => {
                return Err(ClientError::Refused {
                    uri: uri.to_string(),
                    msg: format!("error {:#x}: {}", k, String::from_utf8_lossy(&d).trim_end()),
                })
            }
            _ => {}
        }
    }
    let size = size.ok_or_else(|| proto_err("server sent no NBD_INFO_EXPORT".into()))?;
    Ok(RemoteExport {
        size,
        flags,
        block_min: block_min.max(1),
        block_max: block_max.max(block_min.max(1)),
    })
}

impl Drop for Client {
    fn drop(&mut self) {
        // The connection tasks hold the connection alive; end them explicitly.
        for c in &mut self.conns {
            if let Some(l) = c.get_mut().take() {
                l.fail("client closed");
            }
        }
    }
}
