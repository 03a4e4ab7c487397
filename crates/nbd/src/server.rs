//! The server side: negotiation and a pipelined transmission phase.
//!
//! # Shape of a connection
//!
//! Negotiation is async, on the reactor. Once a client enters transmission, the connection
//! gets a thread of its own that reads requests with blocking reads, validates each against
//! the export, and polls it once inline (see [`ExportSet::on_connection_thread`]). What
//! completes in that poll — a page-cache read or write — is answered on the spot, so the common
//! 4 KiB IO costs no thread hop, as in nbdkit. What is still pending (network IO to a datastore,
//! a wait in the engine) moves to the runtime as a task, so a slow request never holds up
//! independent ones. When it completes, the task sends its reply itself if the socket takes it
//! at once without blocking (the common case); otherwise the reply goes through the
//! connection's reply thread, which may block on a client slow to read. Ordering between
//! overlapping requests is the export's business (the engine's gatekeeper), as the protocol
//! allows any completion order.
//!
//! Memory is bounded per connection: a request may not start (its payload is not even read)
//! until it holds a slot of [`IN_FLIGHT_REQUESTS_MAX`] and its share of
//! [`IN_FLIGHT_BYTES_MAX`]; both are released only after the reply is on the socket.
//!
//! # Ending a connection
//!
//! On `NBD_CMD_DISC`, end of stream or a protocol violation, the connection thread stops
//! taking requests; the reply thread keeps sending replies until every in-flight request has
//! finished, and then the socket closes. In-flight writes are thus always completed, never
//! abandoned.
//!
//! When the server stops (daemon shutdown), it does what the protocol asks of a server
//! shutting down: requests in flight are served and answered; requests that come after are
//! answered `ESHUTDOWN` and never run (the protocol asks a client that gets it to disconnect
//! softly, with `NBD_CMD_DISC`); once nothing is in flight and every reply is on the socket,
//! the server shuts its writing side, and the whole socket once the client has closed its own
//! (or after [`CLOSE_LINGER`]). The client can send until then: its reading side is never cut
//! under it (a client on a Unix socket whose reading side the server had shut would fail its
//! next send with `EPIPE`, and with it every request it had in flight). When an export is
//! removed (a volume deleted with `--force`), the socket is shut down both ways at once.
//!
//! # Bad input
//!
//! Nothing a client sends can panic the server. A request that can be answered gets an error
//! reply (`EINVAL`, `ENOSPC`, `EPERM`); one after which the stream cannot be trusted (bad magic,
//! a WRITE payload over the maximum) closes the connection. Either way one line is logged with
//! the peer and the reason, and other connections are unaffected.

use std::future::Future;
use std::io;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use std::io::{Read as _, Write as _};
use std::sync::{mpsc as std_mpsc, Mutex as StdMutex};

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tracing::{debug, info, warn};

use crate::proto::{self, Errno, InfoRequest, Request};
use crate::stop::Stop;

/// Requests one connection may have in flight. Deeper than any client queue we know of
/// (fio and libnbd default to at most 64; the Linux client to 128) so clients never wait on it.
pub const IN_FLIGHT_REQUESTS_MAX: usize = 256;
/// Payload bytes one connection may have in flight, in both directions together. Twice the
/// largest request, so one maximal request never blocks behind another.
pub const IN_FLIGHT_BYTES_MAX: usize = 2 * proto::BLOCK_SIZE_MAX as usize;
/// Payload bytes all connections together may have in flight beyond their reserves: without
/// it, a thousand connections each within their own budget could still hold tens of GiB.
pub const IN_FLIGHT_BYTES_TOTAL_MAX: usize = 512 << 20;
/// Payload bytes each connection may have in flight outside the shared budget
/// ([`IN_FLIGHT_BYTES_TOTAL_MAX`]): a connection takes from the shared budget only what its
/// reserve cannot hold. Requests stalled behind one failed datastore, however many, can use
/// up the shared budget but no other connection's reserve, so volumes elsewhere go on with
/// up to this much in flight each; a request larger than the reserve still needs the shared
/// budget. Memory bound: this times [`CONNECTIONS_MAX`] plus the total.
pub const IN_FLIGHT_BYTES_RESERVED: usize = 2 << 20;
/// A reply the client does not read within this long ends the connection, so a client that
/// stops reading cannot hold its budget (and a connection thread) forever.
pub const REPLY_WRITE_TIMEOUT: Duration = Duration::from_secs(60);
/// How often a stopping connection looks whether its requests in flight are done.
const DRAIN_POLL: Duration = Duration::from_millis(10);
/// How long a stopping connection, its replies all sent and its writing side shut, waits for
/// the client to close its side before the socket is shut both ways.
const CLOSE_LINGER: Duration = Duration::from_secs(1);
/// Rejected requests logged in full per connection; later ones are only counted.
const REJECTIONS_LOGGED: u64 = 8;
/// Unit in which the byte budget is counted (semaphore permits are `u32`).
const BUDGET_UNIT: usize = 4096;
/// An idle TCP client is probed after this long without traffic ([`keep_alive`])...
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(60);
/// ...then every this long...
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
/// ...and its connection ends after this many probes go unanswered.
pub const KEEPALIVE_PROBES: u32 = 6;
/// A client that has not finished negotiating by then is disconnected (slow-loris guard).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
/// Options one client may send before entering transmission, besides two per export (a
/// listing client asks `NBD_OPT_INFO` of each); beyond that it is looping.
const OPTIONS_MAX: usize = 256;
/// Option payloads larger than this are not read (the longest legal one is a 4 KiB name).
const OPTION_LEN_MAX: u32 = 64 * 1024;
/// Connections the server accepts at once; beyond that new ones are closed with a log line.
/// Each connection in transmission costs two OS threads (reader and replies).
pub const CONNECTIONS_MAX: usize = 1024;

/// An error a command completes with: the errno sent to the client and a message for the log.
#[derive(Debug, Clone)]
pub struct CmdError {
    pub errno: Errno,
    pub msg: String,
}

impl CmdError {
    pub fn new(errno: Errno, msg: impl Into<String>) -> CmdError {
        CmdError {
            errno,
            msg: msg.into(),
        }
    }
}

impl std::fmt::Display for CmdError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.errno, self.msg)
    }
}

pub type CmdResult<T> = Result<T, CmdError>;

/// What negotiation tells a client about an export.
#[derive(Debug, Clone)]
pub struct ExportInfo {
    pub size: u64,
    pub read_only: bool,
    /// True only if FLUSH and FUA on one connection make writes from every connection durable
    /// and reads on every connection see completed writes: the export's state is shared.
    pub can_multi_conn: bool,
    pub description: String,
}

impl ExportInfo {
    pub fn transmission_flags(&self) -> u16 {
        let mut f = proto::FLAG_HAS_FLAGS
            | proto::FLAG_SEND_FLUSH
            | proto::FLAG_SEND_FUA
            | proto::FLAG_SEND_TRIM
            | proto::FLAG_SEND_WRITE_ZEROES;
        if self.read_only {
            f |= proto::FLAG_READ_ONLY;
        }
        if self.can_multi_conn {
            f |= proto::FLAG_CAN_MULTI_CONN;
        }
        f
    }
}

/// One opened export, shared by all requests of a connection. Requests arrive validated:
/// aligned to [`proto::BLOCK_SIZE_MIN`], inside the export, READ/WRITE no longer than
/// [`proto::BLOCK_SIZE_MAX`], and no writes to a read-only export.
pub trait Export: Send + Sync + 'static {
    fn read(&self, offset: u64, len: u32) -> impl Future<Output = CmdResult<Bytes>> + Send;
    fn write(
        &self,
        offset: u64,
        data: Bytes,
        fua: bool,
    ) -> impl Future<Output = CmdResult<()>> + Send;
    fn flush(&self) -> impl Future<Output = CmdResult<()>> + Send;
    fn trim(&self, offset: u64, len: u32, fua: bool) -> impl Future<Output = CmdResult<()>> + Send;
    fn write_zeroes(
        &self,
        offset: u64,
        len: u32,
        may_trim: bool,
        fua: bool,
    ) -> impl Future<Output = CmdResult<()>> + Send;
    /// Fires when the export goes away (deleted with force): connections to it end.
    fn stop_signal(&self) -> Stop;
}

/// The set of exports a server offers, looked up by name during negotiation.
pub trait ExportSet: Send + Sync + 'static {
    /// What a connection holds while attached; dropping it detaches.
    type Export: Export;
    /// Names and descriptions for `NBD_OPT_LIST`.
    fn list(&self) -> Vec<(String, String)>;
    /// Information for `NBD_OPT_INFO`, without attaching. The error is a message for the
    /// client and the log, as [`ExportSet::open`]'s.
    fn info(&self, name: &str) -> Result<ExportInfo, String>;
    /// Attaches a connection for `NBD_OPT_GO` / `NBD_OPT_EXPORT_NAME`. The error is a message
    /// for the client and the log.
    fn open(&self, name: &str) -> Result<(ExportInfo, Self::Export), String>;
    /// Runs `f` — the first poll of a request — on a connection thread: a thread the server
    /// dedicates to one connection, never a reactor thread. Implementations may let their IO
    /// block inline there. `alone`: no other request of the connection is in flight or read
    /// ahead, so blocking holds up nothing else (a client at queue depth 1).
    fn on_connection_thread<R>(&self, alone: bool, f: impl FnOnce() -> R) -> R {
        let _ = alone;
        f()
    }
}

/// Who is on the other end, for log lines.
#[derive(Debug, Clone)]
pub struct Peer(pub String);

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A stream the server negotiates on asynchronously and then hands to a connection thread.
pub trait Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static {
    /// The same socket in blocking mode, off the reactor.
    fn into_blocking(self) -> io::Result<StdConn>;
}

impl Stream for TcpStream {
    fn into_blocking(self) -> io::Result<StdConn> {
        let s = self.into_std()?;
        s.set_nonblocking(false)?;
        Ok(StdConn::Tcp(s))
    }
}

impl Stream for UnixStream {
    fn into_blocking(self) -> io::Result<StdConn> {
        let s = self.into_std()?;
        s.set_nonblocking(false)?;
        Ok(StdConn::Unix(s))
    }
}

/// A connected socket in blocking mode, owned by a connection's threads.
pub enum StdConn {
    Tcp(std::net::TcpStream),
    Unix(std::os::unix::net::UnixStream),
}

impl std::os::fd::AsRawFd for StdConn {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        match self {
            StdConn::Tcp(s) => s.as_raw_fd(),
            StdConn::Unix(s) => s.as_raw_fd(),
        }
    }
}

impl StdConn {
    fn try_clone(&self) -> io::Result<StdConn> {
        Ok(match self {
            StdConn::Tcp(s) => StdConn::Tcp(s.try_clone()?),
            StdConn::Unix(s) => StdConn::Unix(s.try_clone()?),
        })
    }

    fn set_write_timeout(&self, t: Duration) -> io::Result<()> {
        match self {
            StdConn::Tcp(s) => s.set_write_timeout(Some(t)),
            StdConn::Unix(s) => s.set_write_timeout(Some(t)),
        }
    }

    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            StdConn::Tcp(s) => s.set_read_timeout(t),
            StdConn::Unix(s) => s.set_read_timeout(t),
        }
    }

    fn shutdown(&self, how: std::net::Shutdown) -> io::Result<()> {
        match self {
            StdConn::Tcp(s) => s.shutdown(how),
            StdConn::Unix(s) => s.shutdown(how),
        }
    }
}

impl io::Read for StdConn {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            StdConn::Tcp(s) => s.read(buf),
            StdConn::Unix(s) => s.read(buf),
        }
    }
}

impl io::Write for StdConn {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            StdConn::Tcp(s) => s.write(buf),
            StdConn::Unix(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Counts live connections so shutdown can wait for them to drain.
#[derive(Clone)]
pub struct ConnTracker {
    /// Never sent on: the channel closes when the last clone is dropped, which is the signal.
    _alive: mpsc::Sender<()>,
    slots: Arc<Semaphore>,
    /// The server-wide payload budget ([`IN_FLIGHT_BYTES_TOTAL_MAX`]).
    bytes: Arc<Semaphore>,
    /// [`REPLY_WRITE_TIMEOUT`]; shorter in tests.
    reply_timeout: Duration,
}

pub struct ConnWaiter {
    rx: mpsc::Receiver<()>,
}

impl ConnTracker {
    pub fn new() -> (ConnTracker, ConnWaiter) {
        let (tx, rx) = mpsc::channel(1);
        (
            ConnTracker {
                _alive: tx,
                slots: Arc::new(Semaphore::new(CONNECTIONS_MAX)),
                bytes: Arc::new(Semaphore::new(IN_FLIGHT_BYTES_TOTAL_MAX / BUDGET_UNIT)),
                reply_timeout: REPLY_WRITE_TIMEOUT,
            },
            ConnWaiter { rx },
        )
    }
}

impl ConnWaiter {
    /// Resolves when every tracker clone (each listener and each connection holds one) is gone.
    pub async fn wait(mut self) {
        while self.rx.recv().await.is_some() {}
    }
}

/// Serves a TCP listener until `stop` fires. Each connection drains and ends on its own.
pub async fn serve_tcp<X: ExportSet>(
    listener: TcpListener,
    exports: Arc<X>,
    stop: Stop,
    tracker: ConnTracker,
) {
    let mut stop_accept = stop.clone();
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = stop_accept.wait() => break,
        };
        match accepted {
            Ok((s, addr)) => {
                let _ = s.set_nodelay(true);
                if let Err(e) = keep_alive(&s) {
                    debug!("nbd {addr}: cannot turn on TCP keepalive: {e}");
                }
                spawn_conn(s, Peer(addr.to_string()), &exports, &stop, &tracker);
            }
            Err(e) => {
                warn!("nbd: accept on tcp failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Turns on TCP keepalive for a client connection, so one whose host died or dropped off the
/// network while idle ends within [`KEEPALIVE_IDLE`] plus [`KEEPALIVE_PROBES`] probes
/// [`KEEPALIVE_INTERVAL`] apart (two minutes). Otherwise it stays open for good: its volume
/// counts as attached (delete and relocate refuse it) and it holds a connection slot.
fn keep_alive(s: &impl std::os::fd::AsFd) -> io::Result<()> {
    let probes = socket2::TcpKeepalive::new()
        .with_time(KEEPALIVE_IDLE)
        .with_interval(KEEPALIVE_INTERVAL)
        .with_retries(KEEPALIVE_PROBES);
    socket2::SockRef::from(s).set_tcp_keepalive(&probes)
}

/// Serves a Unix socket listener until `stop` fires.
pub async fn serve_unix<X: ExportSet>(
    listener: UnixListener,
    exports: Arc<X>,
    stop: Stop,
    tracker: ConnTracker,
) {
    let mut stop_accept = stop.clone();
    let mut n: u64 = 0;
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = stop_accept.wait() => break,
        };
        match accepted {
            Ok((s, _)) => {
                n += 1;
                spawn_conn(s, Peer(format!("unix#{n}")), &exports, &stop, &tracker);
            }
            Err(e) => {
                warn!("nbd: accept on unix socket failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Binds a Unix socket, replacing a stale socket file left by a previous run (but never a
/// regular file someone put there).
pub fn bind_unix(path: &Path) -> io::Result<UnixListener> {
    use std::os::unix::fs::FileTypeExt;
    if let Ok(md) = std::fs::symlink_metadata(path) {
        if md.file_type().is_socket() {
            std::fs::remove_file(path)?;
        } else {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!(
                    "{} exists and is not a socket; remove it or choose another nbd.unix path",
                    path.display()
                ),
            ));
        }
    }
    UnixListener::bind(path)
}

fn spawn_conn<X: ExportSet, S: Stream>(
    s: S,
    peer: Peer,
    exports: &Arc<X>,
    stop: &Stop,
    tracker: &ConnTracker,
) {
    let Ok(slot) = tracker.slots.clone().try_acquire_owned() else {
        warn!("nbd {peer}: refusing connection: {CONNECTIONS_MAX} connections already open");
        return;
    };
    let exports = exports.clone();
    let stop = stop.clone();
    let tracker = tracker.clone();
    tokio::spawn(async move {
        let (bytes, timeout) = (tracker.bytes.clone(), tracker.reply_timeout);
        serve_connection(s, peer, exports, stop, bytes, timeout).await;
        drop(slot);
        drop(tracker);
    });
}

/// Serves one connection from negotiation to close.
///
/// Negotiation runs here, on the reactor. The transmission phase runs on a thread of its own
/// ([`transmission`]); this task only waits for it. When the server stops, the connection
/// thread answers new requests `ESHUTDOWN`, and this task waits until no request is in
/// flight, sends what replies are buffered and closes the connection ([`drain_and_close`]);
/// when the export is removed it shuts the socket down both ways at once, so not even a reply
/// blocked on a client that stopped reading keeps the connection alive.
pub async fn serve_connection<X: ExportSet, S: Stream>(
    mut s: S,
    peer: Peer,
    exports: Arc<X>,
    stop: Stop,
    total_bytes: Arc<Semaphore>,
    reply_timeout: Duration,
) {
    let negotiated = tokio::time::timeout(
        HANDSHAKE_TIMEOUT,
        negotiate(&mut s, &*exports, &peer, &stop),
    )
    .await;
    let (name, info, export) = match negotiated {
        Ok(Ok(Some(x))) => x,
        Ok(Ok(None)) => return, // client aborted or listed and left
        Ok(Err(e)) => {
            if e.kind() == io::ErrorKind::UnexpectedEof {
                debug!("nbd {peer}: client left during negotiation");
            } else {
                warn!("nbd {peer}: closing connection during negotiation: {e}");
            }
            return;
        }
        Err(_) => {
            warn!(
                "nbd {peer}: closing connection: negotiation not finished within {}s",
                HANDSHAKE_TIMEOUT.as_secs()
            );
            return;
        }
    };
    debug!("nbd {peer}: attached to export {name:?}");
    let conn = match s.into_blocking() {
        Ok(c) => c,
        Err(e) => {
            warn!("nbd {peer}: cannot hand the connection to a thread: {e}");
            return;
        }
    };
    let closer = match conn.try_clone() {
        Ok(c) => c,
        Err(e) => {
            warn!("nbd {peer}: cannot duplicate the socket: {e}");
            return;
        }
    };
    let wr = match conn
        .set_write_timeout(reply_timeout)
        .and_then(|_| conn.try_clone())
    {
        Ok(w) => w,
        Err(e) => {
            warn!("nbd {peer}: cannot duplicate the socket: {e}");
            return;
        }
    };
    let out = Arc::new(StdMutex::new(Out::new(wr, peer.clone(), reply_timeout)));
    let slots = Arc::new(Semaphore::new(IN_FLIGHT_REQUESTS_MAX));
    let stopping = Arc::new(StdMutex::new(false));
    let mut gone = export.stop_signal();
    let (done_tx, mut done_rx) = tokio::sync::oneshot::channel::<()>();
    let conn_thread = Conn {
        rd: conn,
        out: out.clone(),
        slots: slots.clone(),
        stopping: stopping.clone(),
        total_bytes,
        reply_timeout,
        handle: tokio::runtime::Handle::current(),
    };
    let p = peer.clone();
    let n = name.clone();
    let spawned = std::thread::Builder::new()
        .name("nbd-conn".into())
        .spawn(move || {
            transmission(conn_thread, p, n, info, export, exports);
            let _ = done_tx.send(());
        });
    if let Err(e) = spawned {
        warn!("nbd {peer}: cannot start a connection thread: {e}");
        return;
    }
    let mut stop = stop;
    tokio::select! {
        _ = &mut done_rx => return,
        _ = stop.wait() => {
            info!("nbd {peer}: closing connection to {name:?}: server stopping");
            tokio::select! {
                _ = &mut done_rx => return,
                _ = drain_and_close(&slots, &stopping, &out) => {
                    // Half-closed: the client reads the end of the stream and closes its side,
                    // which ends the connection thread; one that does not is cut off.
                    if tokio::time::timeout(CLOSE_LINGER, &mut done_rx).await.is_ok() {
                        return;
                    }
                    let _ = closer.shutdown(std::net::Shutdown::Both);
                }
                _ = gone.wait() => {
                    let _ = closer.shutdown(std::net::Shutdown::Both);
                }
            }
        }
        _ = gone.wait() => {
            info!("nbd {peer}: closing connection to {name:?}: export removed");
            let _ = closer.shutdown(std::net::Shutdown::Both);
        }
    };
    let _ = done_rx.await;
}

/// A stopping server's end of a connection: marks it `stopping` (its thread then answers each
/// new request `ESHUTDOWN`), waits until no request holds a slot, writes out the replies still
/// buffered, and shuts the socket's writing side ([`Out::close_write`]).
///
/// The connection thread takes a request's slot before it looks at `stopping`, and both
/// sides look under `stopping`'s lock: so a request either holds its slot when this finds
/// none held (and is waited for), or was taken after, saw `stopping` and did not run (it
/// gives its slot back at once). New requests are answered all along, not held up behind the
/// ones in flight.
///
/// Only the writing side: the client may still be sending (a request of its own, before it
/// has read the end of the stream), and the connection thread goes on reading it. With the
/// reading side shut too, such a send would fail with `EPIPE` on a Unix socket (libnbd and
/// QEMU then fail every request in flight, replies already received included), and on TCP
/// the unread bytes would reset the connection and drop replies not yet delivered.
async fn drain_and_close(
    slots: &Arc<Semaphore>,
    stopping: &Arc<StdMutex<bool>>,
    out: &Arc<StdMutex<Out>>,
) {
    *lock(stopping) = true;
    loop {
        if slots.available_permits() == IN_FLIGHT_REQUESTS_MAX {
            let _held = lock(stopping);
            if slots.available_permits() == IN_FLIGHT_REQUESTS_MAX {
                break;
            }
        }
        tokio::time::sleep(DRAIN_POLL).await;
    }
    // Every reply was put in the buffer before its slot came back; flushing may block on a
    // client slow to read (for at most the reply timeout), so not on a reactor thread.
    let out = out.clone();
    let _ = tokio::task::spawn_blocking(move || lock(&out).close_write()).await;
}

type Negotiated<E> = Option<(String, ExportInfo, E)>;

fn invalid(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// Reads are unbuffered (option traffic is tiny) so that no byte of the transmission phase is
/// left behind in a buffer when the socket moves to its connection thread.
async fn negotiate<X: ExportSet, S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    exports: &X,
    peer: &Peer,
    stop: &Stop,
) -> io::Result<Negotiated<X::Export>> {
    let mut out = BytesMut::with_capacity(256);
    {
        use bytes::BufMut;
        out.put_u64(proto::NBDMAGIC);
        out.put_u64(proto::IHAVEOPT);
        out.put_u16(proto::FLAG_FIXED_NEWSTYLE | proto::FLAG_NO_ZEROES);
    }
    s.write_all(&out).await?;
    s.flush().await?;
    let client_flags = s.read_u32().await?;
    if client_flags & !(proto::FLAG_C_FIXED_NEWSTYLE | proto::FLAG_C_NO_ZEROES) != 0 {
        return Err(invalid(format!("unknown client flags {client_flags:#x}")));
    }
    let no_zeroes = client_flags & proto::FLAG_C_NO_ZEROES != 0;

    let options_max = OPTIONS_MAX + 2 * exports.list().len();
    for _ in 0..options_max {
        let magic = s.read_u64().await?;
        if magic != proto::IHAVEOPT {
            return Err(invalid(format!("bad option magic {magic:#x}")));
        }
        let option = s.read_u32().await?;
        let len = s.read_u32().await?;
        if len > OPTION_LEN_MAX {
            return Err(invalid(format!(
                "option {option} carries {len} bytes, more than {OPTION_LEN_MAX}"
            )));
        }
        let mut data = vec![0u8; len as usize];
        s.read_exact(&mut data).await?;

        out.clear();
        let reply = |out: &mut BytesMut, kind: u32, payload: &[u8]| {
            proto::encode_option_reply(out, option, kind, payload)
        };
        if stop.is_stopped() && option == proto::OPT_EXPORT_NAME {
            // EXPORT_NAME has no error reply; closing is the only answer the spec allows.
            return Err(invalid(
                "NBD_OPT_EXPORT_NAME while the server is shutting down",
            ));
        }
        if stop.is_stopped() && option != proto::OPT_ABORT {
            reply(
                &mut out,
                proto::REP_ERR_SHUTDOWN,
                b"server is shutting down",
            );
            s.write_all(&out).await?;
            s.flush().await?;
            continue;
        }
        match option {
            proto::OPT_EXPORT_NAME => {
                let name =
                    String::from_utf8(data).map_err(|_| invalid("export name is not UTF-8"))?;
                let (info, export) = exports
                    .open(&name)
                    .map_err(|why| invalid(format!("NBD_OPT_EXPORT_NAME {name:?}: {why}")))?;
                {
                    use bytes::BufMut;
                    out.put_u64(info.size);
                    out.put_u16(info.transmission_flags());
                    if !no_zeroes {
                        out.put_bytes(0, 124);
                    }
                }
                s.write_all(&out).await?;
                s.flush().await?;
                return Ok(Some((name, info, export)));
            }
            proto::OPT_ABORT => {
                reply(&mut out, proto::REP_ACK, &[]);
                // The client may already have closed; a failed write here is not an error.
                let _ = s.write_all(&out).await;
                let _ = s.flush().await;
                return Ok(None);
            }
            proto::OPT_LIST => {
                if !data.is_empty() {
                    reply(
                        &mut out,
                        proto::REP_ERR_INVALID,
                        b"NBD_OPT_LIST takes no data",
                    );
                } else {
                    for (name, _) in exports.list() {
                        let mut p = Vec::with_capacity(4 + name.len());
                        p.extend_from_slice(&(name.len() as u32).to_be_bytes());
                        p.extend_from_slice(name.as_bytes());
                        reply(&mut out, proto::REP_SERVER, &p);
                    }
                    reply(&mut out, proto::REP_ACK, &[]);
                }
            }
            proto::OPT_INFO | proto::OPT_GO => {
                let Some(req) = InfoRequest::decode(&data) else {
                    reply(
                        &mut out,
                        proto::REP_ERR_INVALID,
                        b"malformed NBD_OPT_INFO/NBD_OPT_GO payload",
                    );
                    s.write_all(&out).await?;
                    s.flush().await?;
                    continue;
                };
                let opened = if option == proto::OPT_GO {
                    exports.open(&req.name).map(|(i, e)| (i, Some(e)))
                } else {
                    exports.info(&req.name).map(|i| (i, None))
                };
                match opened {
                    Err(why) => {
                        debug!("nbd {peer}: export {:?} refused: {why}", req.name);
                        reply(&mut out, proto::REP_ERR_UNKNOWN, why.as_bytes());
                    }
                    Ok((info, export)) => {
                        reply(
                            &mut out,
                            proto::REP_INFO,
                            &proto::info_export(info.size, info.transmission_flags()),
                        );
                        for r in &req.requests {
                            match *r {
                                proto::INFO_NAME => reply(
                                    &mut out,
                                    proto::REP_INFO,
                                    &proto::info_string(proto::INFO_NAME, &req.name),
                                ),
                                proto::INFO_DESCRIPTION if !info.description.is_empty() => reply(
                                    &mut out,
                                    proto::REP_INFO,
                                    &proto::info_string(proto::INFO_DESCRIPTION, &info.description),
                                ),
                                _ => {}
                            }
                        }
                        // Sent whether or not it was asked for, as qemu-nbd and nbdkit do:
                        // clients that understand it honour it, others ignore it.
                        reply(
                            &mut out,
                            proto::REP_INFO,
                            &proto::info_block_size(
                                proto::BLOCK_SIZE_MIN,
                                proto::BLOCK_SIZE_PREFERRED,
                                proto::BLOCK_SIZE_MAX,
                            ),
                        );
                        reply(&mut out, proto::REP_ACK, &[]);
                        if let Some(export) = export {
                            s.write_all(&out).await?;
                            s.flush().await?;
                            return Ok(Some((req.name, info, export)));
                        }
                    }
                }
            }
            proto::OPT_STARTTLS => {
                reply(&mut out, proto::REP_ERR_UNSUP, b"TLS is not supported");
            }
            _ => {
                reply(&mut out, proto::REP_ERR_UNSUP, b"option not supported");
            }
        }
        s.write_all(&out).await?;
        s.flush().await?;
    }
    Err(invalid(format!("more than {options_max} options")))
}

/// A request's share of the server-wide budget: from the connection's reserve
/// ([`IN_FLIGHT_BYTES_RESERVED`]) while that has room, else from the shared budget. A request
/// that has to wait takes whichever frees first (one larger than the reserve, only shared),
/// after `before_wait`.
fn reserved_or_shared(
    reserve: &Arc<Semaphore>,
    shared: &Arc<Semaphore>,
    units: u32,
    handle: &tokio::runtime::Handle,
    before_wait: impl FnOnce(),
) -> OwnedSemaphorePermit {
    if let Ok(p) = reserve.clone().try_acquire_many_owned(units) {
        return p;
    }
    if let Ok(p) = shared.clone().try_acquire_many_owned(units) {
        return p;
    }
    before_wait();
    let fits = units as usize * BUDGET_UNIT <= IN_FLIGHT_BYTES_RESERVED;
    handle
        .block_on(async {
            tokio::select! {
                p = reserve.clone().acquire_many_owned(units), if fits => p,
                p = shared.clone().acquire_many_owned(units) => p,
            }
        })
        .expect("never closed")
}

/// A reply ready for the wire, holding its request's budget until it is written.
struct Reply {
    header: [u8; proto::SIMPLE_REPLY_LEN],
    data: Option<Bytes>,
    _budget: Option<Budget>,
}

struct Budget {
    _slot: OwnedSemaphorePermit,
    _bytes: OwnedSemaphorePermit,
    _total: OwnedSemaphorePermit,
}

fn reply_header(errno: Errno, cookie: u64) -> [u8; proto::SIMPLE_REPLY_LEN] {
    let mut b = BytesMut::with_capacity(proto::SIMPLE_REPLY_LEN);
    proto::encode_simple_reply(&mut b, errno, cookie);
    let mut h = [0u8; proto::SIMPLE_REPLY_LEN];
    h.copy_from_slice(&b);
    h
}

impl Reply {
    fn error(errno: Errno, cookie: u64, budget: Option<Budget>) -> Reply {
        Reply {
            header: reply_header(errno, cookie),
            data: None,
            _budget: budget,
        }
    }
}

/// What the reply thread is handed: a reply to write, or a reply's remainder already in the
/// buffer to flush.
enum Outgoing {
    Reply(Reply),
    Flush,
}

/// The obligation to answer a request that moved to the runtime. If its task ends without
/// answering (a bug that panicked), dropping this answers EIO so the client never waits
/// forever.
struct Answer {
    tx: std_mpsc::Sender<Outgoing>,
    out: Arc<StdMutex<Out>>,
    cookie: u64,
    sent: bool,
}

impl Answer {
    /// Sends the reply from the task that completed it when that cannot block (see
    /// [`Out::send_now`]), which saves waking the reply thread; hands it to the reply thread
    /// otherwise.
    fn send(mut self, r: Reply) {
        self.sent = true;
        let r = match self.out.try_lock() {
            Ok(mut o) => match o.send_now(r) {
                Sent::All => return,
                Sent::Part => Outgoing::Flush,
                Sent::Not(r) => Outgoing::Reply(r),
            },
            Err(_) => Outgoing::Reply(r),
        };
        let _ = self.tx.send(r);
    }
}

impl Drop for Answer {
    fn drop(&mut self) {
        if !self.sent {
            let _ = self
                .tx
                .send(Outgoing::Reply(Reply::error(Errno::EIO, self.cookie, None)));
        }
    }
}

/// The socket's write side, shared by the connection thread (replies completed inline) and
/// the reply thread (replies completed on the runtime). A reply is always written whole under
/// the lock, so replies never interleave.
struct Out {
    w: std::io::BufWriter<StdConn>,
    broken: bool,
    peer: Peer,
    /// How long a reply may wait for the client to read (the socket's write timeout).
    timeout: Duration,
}

/// What [`Out::send_now`] did with a reply.
enum Sent {
    /// On the socket (or dropped, the connection being broken).
    All,
    /// Part on the socket, the rest in the buffer: someone must flush it.
    Part,
    /// Nothing sent: it would have blocked, or other replies are queued ahead of it.
    Not(Reply),
}

impl Out {
    fn new(conn: StdConn, peer: Peer, timeout: Duration) -> Out {
        Out {
            w: std::io::BufWriter::with_capacity(128 * 1024, conn),
            broken: false,
            peer,
            timeout,
        }
    }

    fn put(&mut self, r: &Reply) {
        if self.broken {
            return;
        }
        let res = self.w.write_all(&r.header).and_then(|_| match &r.data {
            Some(d) => self.w.write_all(d),
            None => Ok(()),
        });
        if let Err(e) = res {
            self.break_off(e);
        }
    }

    fn flush(&mut self) {
        if self.broken {
            return;
        }
        if let Err(e) = self.w.flush() {
            self.break_off(e);
        }
    }

    /// A reply could not be written: the client closed, or stopped reading for
    /// [`REPLY_WRITE_TIMEOUT`]. Later replies are dropped, so the socket is shut down both
    /// ways at once: the client sees the connection end (and reconnects) instead of waiting
    /// for ever on a reply cut short, and the connection thread reads the end of the stream
    /// and drains what is in flight.
    fn break_off(&mut self, e: io::Error) {
        if matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
        ) {
            warn!(
                "nbd {}: the client read no reply for {}s; closing the connection",
                self.peer,
                self.timeout.as_secs_f64()
            );
        } else {
            debug!("nbd {}: writing reply failed: {e}", self.peer);
        }
        self.broken = true;
        let _ = self.w.get_ref().shutdown(std::net::Shutdown::Both);
    }

    /// Sends what is buffered, then shuts the socket's writing side: the client reads the end
    /// of the stream after the last reply. Later replies are dropped.
    fn close_write(&mut self) {
        self.flush();
        if !self.broken {
            self.broken = true;
            let _ = self.w.get_ref().shutdown(std::net::Shutdown::Write);
        }
    }

    /// Writes a reply straight to the socket without blocking, for a caller that must not
    /// block (a runtime worker). Only when nothing is buffered ahead of it, and only a reply
    /// small enough that what the socket does not take fits in the buffer without a write.
    fn send_now(&mut self, r: Reply) -> Sent {
        if self.broken {
            return Sent::All;
        }
        let data = r.data.as_deref().unwrap_or_default();
        let total = r.header.len() + data.len();
        if !self.w.buffer().is_empty() || total > self.w.capacity() / 2 {
            return Sent::Not(r);
        }
        let mut iov = [
            libc::iovec {
                iov_base: r.header.as_ptr() as *mut libc::c_void,
                iov_len: r.header.len(),
            },
            libc::iovec {
                iov_base: data.as_ptr() as *mut libc::c_void,
                iov_len: data.len(),
            },
        ];
        // SAFETY: an all-zero msghdr is valid (no address, no control data); iov points at
        // two buffers that outlive the call, and sendmsg only reads them.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = if data.is_empty() { 1 } else { 2 };
        use std::os::fd::AsRawFd as _;
        let fd = self.w.get_ref().as_raw_fd();
        // SAFETY: fd is this connection's socket, open for as long as `self` is.
        let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Sent::Not(r),
                _ => {
                    self.break_off(e);
                    Sent::All
                }
            };
        }
        let n = n as usize;
        if n == total {
            return Sent::All;
        }
        self.keep_rest(&r.header, data, n)
    }

    /// Buffers what the socket did not take of a reply (`header` then `data`, of which it
    /// took `sent` bytes) for the reply thread to flush. It fits in the empty buffer
    /// (`send_now` takes only replies of at most half its capacity), so this copies, no IO.
    fn keep_rest(&mut self, header: &[u8], data: &[u8], sent: usize) -> Sent {
        let rest = if sent < header.len() {
            [&header[sent..], data].concat()
        } else {
            data[sent - header.len()..].to_vec()
        };
        if let Err(e) = self.w.write_all(&rest) {
            debug!("nbd {}: writing reply failed: {e}", self.peer);
            self.broken = true;
            return Sent::All;
        }
        Sent::Part
    }
}

fn lock<T>(m: &StdMutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Sends the replies the connection thread has buffered, if any: before it may block.
fn send_buffered(out: &StdMutex<Out>, unflushed: &mut bool) {
    if *unflushed {
        lock(out).flush();
        *unflushed = false;
    }
}

/// What the connection thread works with besides the export: the socket's reading side,
/// the writing side it shares ([`Out`]), the request slots the serving task waits for on a
/// stop and the flag it sets then ([`drain_and_close`]), the budget every connection shares,
/// and the runtime.
struct Conn {
    rd: StdConn,
    out: Arc<StdMutex<Out>>,
    slots: Arc<Semaphore>,
    stopping: Arc<StdMutex<bool>>,
    total_bytes: Arc<Semaphore>,
    reply_timeout: Duration,
    handle: tokio::runtime::Handle,
}

/// Why the connection thread stopped taking requests.
enum End {
    Disc,
    Eof,
    Violation(String),
    Io(io::Error),
}

/// Runs one request to its reply.
async fn execute<E: Export>(
    export: Arc<E>,
    req: Request,
    data: Option<Bytes>,
    budget: Budget,
) -> Reply {
    let fua = req.flags & proto::CMD_FLAG_FUA != 0;
    let done = |r: CmdResult<()>| match r {
        Ok(()) => Errno(0),
        Err(e) => e.errno,
    };
    let (errno, payload) = match req.kind {
        proto::CMD_READ => match export.read(req.offset, req.len).await {
            Ok(d) if d.len() == req.len as usize => (Errno(0), Some(d)),
            Ok(d) => {
                warn!(
                    "export returned {} bytes for a READ of {}; answering EIO",
                    d.len(),
                    req.len
                );
                (Errno::EIO, None)
            }
            Err(e) => (e.errno, None),
        },
        proto::CMD_WRITE => {
            let data = data.unwrap_or_default();
            (done(export.write(req.offset, data, fua).await), None)
        }
        proto::CMD_FLUSH => (done(export.flush().await), None),
        proto::CMD_TRIM => (done(export.trim(req.offset, req.len, fua).await), None),
        proto::CMD_WRITE_ZEROES => {
            let may_trim = req.flags & proto::CMD_FLAG_NO_HOLE == 0;
            (
                done(
                    export
                        .write_zeroes(req.offset, req.len, may_trim, fua)
                        .await,
                ),
                None,
            )
        }
        _ => (Errno::EINVAL, None),
    };
    Reply {
        header: reply_header(errno, req.cookie),
        data: payload,
        _budget: Some(budget),
    }
}

/// The transmission phase, on the connection's own thread.
///
/// This thread reads requests with blocking reads and polls each request once, inline, inside
/// [`ExportSet::on_connection_thread`] — where the export may do blocking file IO, because
/// this is not a reactor thread. A request that completes in that poll (a page-cache read or
/// write) is answered directly, with no thread hop at all; one that is still pending (network
/// IO, a wait) is handed to the runtime and answered by the reply thread when it completes, so
/// it never holds up the requests behind it.
///
/// Once the server stops, each request read is answered `ESHUTDOWN` instead (after its
/// request slot is taken, so that [`drain_and_close`] waits for every request that runs).
fn transmission<X: ExportSet>(
    conn: Conn,
    peer: Peer,
    name: String,
    info: ExportInfo,
    export: X::Export,
    exports: Arc<X>,
) {
    let Conn {
        rd,
        out,
        slots,
        stopping,
        total_bytes,
        reply_timeout,
        handle,
    } = conn;
    let _rt = handle.enter();
    let export = Arc::new(export);
    let (tx, rx) = std_mpsc::channel::<Outgoing>();
    let reply_thread = {
        let out = out.clone();
        std::thread::Builder::new()
            .name("nbd-reply".into())
            .spawn(move || {
                while let Ok(first) = rx.recv() {
                    let mut o = lock(&out);
                    for next in
                        std::iter::once(first).chain(std::iter::from_fn(|| rx.try_recv().ok()))
                    {
                        if let Outgoing::Reply(r) = next {
                            o.put(&r);
                        }
                    }
                    o.flush();
                }
            })
    };
    let reply_thread = match reply_thread {
        Ok(t) => t,
        Err(e) => {
            warn!("nbd {peer}: cannot start a reply thread: {e}");
            return;
        }
    };
    let bytes = Arc::new(Semaphore::new(IN_FLIGHT_BYTES_MAX / BUDGET_UNIT));
    let reserve = Arc::new(Semaphore::new(IN_FLIGHT_BYTES_RESERVED / BUDGET_UNIT));
    let mut rd = std::io::BufReader::with_capacity(128 * 1024, rd);
    let waker = std::task::Waker::noop();
    let mut unflushed = false;
    let mut rejected: u64 = 0;
    // Answers an invalid request with its error; logs the first few of a connection.
    let reject = |e: &CmdError, req: &Request, rejected: &mut u64, budget: Option<Budget>| {
        *rejected += 1;
        if *rejected <= REJECTIONS_LOGGED {
            warn!(
                "nbd {peer} export {name:?}: {} rejected with {}: {}{}",
                proto::command_name(req.kind),
                e.errno,
                e.msg,
                if *rejected == REJECTIONS_LOGGED {
                    "; further rejections on this connection are counted, not logged"
                } else {
                    ""
                }
            );
        }
        lock(&out).put(&Reply::error(e.errno, req.cookie, budget));
    };

    let end = loop {
        // Replies written inline are flushed before this thread could block on the socket,
        // and batched while the client keeps requests queued.
        if rd.buffer().len() < proto::REQUEST_LEN {
            send_buffered(&out, &mut unflushed);
        }
        let mut hdr = [0u8; proto::REQUEST_LEN];
        match read_header(&mut rd, &mut hdr) {
            Ok(true) => {}
            Ok(false) => break End::Eof,
            Err(e) => break End::Io(e),
        }
        let Some(req) = Request::decode(&hdr) else {
            break End::Violation(format!(
                "bad request magic {:#010x}",
                proto::be32(&hdr[0..4])
            ));
        };
        if req.kind == proto::CMD_DISC {
            break End::Disc;
        }
        if req.kind == proto::CMD_WRITE && req.len > proto::BLOCK_SIZE_MAX {
            break End::Violation(format!(
                "WRITE of {} bytes exceeds the maximum {} (cookie {:#x})",
                req.len,
                proto::BLOCK_SIZE_MAX,
                req.cookie
            ));
        }
        // A request with no payload to read is checked before it takes budget: an invalid
        // one is answered at once, not after a wait for budget that requests stalled on their
        // datastore may hold for as long as it is down. (A WRITE's payload is read first,
        // under budget, so the stream stays in step.)
        if req.kind != proto::CMD_WRITE {
            if let Err(e) = validate(&req, &info) {
                reject(&e, &req, &mut rejected, None);
                unflushed = true;
                continue;
            }
        }
        let payload_len = match req.kind {
            proto::CMD_READ | proto::CMD_WRITE => req.len.min(proto::BLOCK_SIZE_MAX) as usize,
            _ => 0,
        };
        let units = payload_len.div_ceil(BUDGET_UNIT).max(1) as u32;
        // Each wait for budget first sends the replies written so far: the requests holding
        // that budget may be stalled (a failed datastore), and the client waits for those.
        let slot = slots.clone().try_acquire_owned().unwrap_or_else(|_| {
            send_buffered(&out, &mut unflushed);
            handle
                .block_on(slots.clone().acquire_owned())
                .expect("never closed")
        });
        if *lock(&stopping) {
            // The server is stopping: nothing new runs, so the drain need not wait for this
            // request. Its answer goes out with the replies before the drain's end.
            drop(slot);
            if req.kind == proto::CMD_WRITE {
                let len = req.len as usize;
                if rd.buffer().len() < len {
                    send_buffered(&out, &mut unflushed);
                }
                let skipped = read_within(&mut rd, len, reply_timeout, |rd| {
                    let n = io::copy(&mut rd.take(len as u64), &mut io::sink())?;
                    if n < len as u64 {
                        return Err(io::ErrorKind::UnexpectedEof.into());
                    }
                    Ok(())
                });
                if let Err(e) = skipped {
                    break End::Io(e);
                }
            }
            lock(&out).put(&Reply::error(Errno::ESHUTDOWN, req.cookie, None));
            unflushed = true;
            continue;
        }
        let budget = Budget {
            _slot: slot,
            _bytes: bytes
                .clone()
                .try_acquire_many_owned(units)
                .unwrap_or_else(|_| {
                    send_buffered(&out, &mut unflushed);
                    let wait = bytes.clone().acquire_many_owned(units);
                    handle.block_on(wait).expect("never closed")
                }),
            _total: reserved_or_shared(&reserve, &total_bytes, units, &handle, || {
                send_buffered(&out, &mut unflushed)
            }),
        };
        let data = if req.kind == proto::CMD_WRITE {
            // A payload not here yet may take long to come (a large write on a slow link, a
            // client that sends it only once it has its answers): the replies written so far
            // go first, as before a header.
            // And one that stops coming ends the connection after the reply timeout: it holds
            // budget every connection shares, which a client frozen mid-payload would
            // otherwise keep for ever. (A payload already buffered, as small ones are, costs
            // no system call here.)
            let len = req.len as usize;
            if rd.buffer().len() < len {
                send_buffered(&out, &mut unflushed);
            }
            match read_within(&mut rd, len, reply_timeout, |rd| read_payload(rd, len)) {
                Ok(buf) => Some(Bytes::from(buf)),
                Err(e) => break End::Io(e),
            }
        } else {
            None
        };
        if let Err(e) = validate(&req, &info) {
            reject(&e, &req, &mut rejected, Some(budget));
            unflushed = true;
            continue;
        }
        // This request holds the only slot taken, no other one is read ahead, and the socket
        // holds nothing more (asked last: a syscall, made only when the rest holds).
        let alone = slots.available_permits() == IN_FLIGHT_REQUESTS_MAX - 1
            && rd.buffer().len() < proto::REQUEST_LEN
            && unread(rd.get_ref()) == 0;
        let mut fut = Box::pin(execute(export.clone(), req, data, budget));
        let polled = exports.on_connection_thread(alone, || {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                fut.as_mut()
                    .poll(&mut std::task::Context::from_waker(waker))
            }))
        });
        match polled {
            Ok(std::task::Poll::Ready(reply)) => {
                lock(&out).put(&reply);
                unflushed = true;
            }
            Ok(std::task::Poll::Pending) => {
                let answer = Answer {
                    tx: tx.clone(),
                    out: out.clone(),
                    cookie: req.cookie,
                    sent: false,
                };
                handle.spawn(async move {
                    let reply = fut.await;
                    answer.send(reply);
                });
            }
            Err(_) => {
                warn!(
                    "nbd {peer} export {name:?}: {} panicked; answering EIO",
                    proto::command_name(req.kind)
                );
                // Answered before the request's budget goes back (with `fut`), so a stopping
                // server's drain, which waits for the budget, sends the answer.
                lock(&out).put(&Reply::error(Errno::EIO, req.cookie, None));
                drop(fut);
                unflushed = true;
            }
        }
    };

    match &end {
        End::Disc => debug!("nbd {peer}: client disconnected from {name:?}"),
        End::Eof => debug!("nbd {peer}: connection to {name:?} closed"),
        End::Violation(why) => warn!("nbd {peer} export {name:?}: closing connection: {why}"),
        End::Io(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
            warn!("nbd {peer} export {name:?}: client disconnected in the middle of a request")
        }
        End::Io(e) => warn!("nbd {peer} export {name:?}: closing connection: {e}"),
    }
    if rejected > REJECTIONS_LOGGED {
        warn!("nbd {peer} export {name:?}: {rejected} requests were rejected on this connection");
    }
    // Stop taking requests; the reply thread ends once every in-flight request has replied.
    lock(&out).flush();
    drop(tx);
    let _ = reply_thread.join();
    let o = lock(&out);
    let _ = o.w.get_ref().shutdown(std::net::Shutdown::Both);
}

/// Bytes the client sent that the socket holds unread (`FIONREAD`); on error, as if some.
fn unread(conn: &StdConn) -> usize {
    use std::os::fd::AsRawFd as _;
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one c_int through the pointer, which points at `n`; the fd is
    // the connection's socket, open for as long as `conn` is.
    let r = unsafe { libc::ioctl(conn.as_raw_fd(), libc::FIONREAD, &mut n) };
    if r < 0 {
        return usize::MAX;
    }
    n.max(0) as usize
}

/// Runs `read`, which consumes a WRITE's payload of `len` bytes, with the socket's read timeout
/// set to `timeout` unless the whole payload is buffered already (no system call then). A
/// payload that stops coming for that long fails with `TimedOut`.
fn read_within<T>(
    rd: &mut std::io::BufReader<StdConn>,
    len: usize,
    timeout: Duration,
    read: impl FnOnce(&mut std::io::BufReader<StdConn>) -> io::Result<T>,
) -> io::Result<T> {
    if rd.buffer().len() >= len {
        return read(rd);
    }
    let _ = rd.get_ref().set_read_timeout(Some(timeout));
    let got = read(rd).map_err(|e| {
        if matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
        ) {
            io::Error::new(
                io::ErrorKind::TimedOut,
                format!("a WRITE's payload stopped coming for {timeout:?}"),
            )
        } else {
            e
        }
    });
    let _ = rd.get_ref().set_read_timeout(None);
    got
}

/// Reads a WRITE's payload of `len` bytes into a new buffer, without zeroing the buffer first
/// (the read fills it). `UnexpectedEof` if the stream ends before it does.
fn read_payload<R: std::io::Read>(rd: &mut R, len: usize) -> io::Result<Vec<u8>> {
    let mut buf = Vec::with_capacity(len);
    rd.take(len as u64).read_to_end(&mut buf)?;
    if buf.len() < len {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(buf)
}

/// Reads one request header. `Ok(false)` on a clean end of stream before any byte of it.
fn read_header<R: std::io::Read>(
    rd: &mut R,
    hdr: &mut [u8; proto::REQUEST_LEN],
) -> io::Result<bool> {
    let mut got = 0;
    while got < hdr.len() {
        let n = match rd.read(&mut hdr[got..]) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if n == 0 {
            if got == 0 {
                return Ok(false);
            }
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        got += n;
    }
    Ok(true)
}

/// Checks a request against the protocol and the export. Everything an [`Export`] may assume
/// is established here.
pub fn validate(req: &Request, info: &ExportInfo) -> CmdResult<()> {
    let allowed_flags = match req.kind {
        proto::CMD_READ | proto::CMD_WRITE | proto::CMD_TRIM | proto::CMD_FLUSH => {
            proto::CMD_FLAG_FUA
        }
        proto::CMD_WRITE_ZEROES => proto::CMD_FLAG_FUA | proto::CMD_FLAG_NO_HOLE,
        other => {
            return Err(CmdError::new(
                Errno::EINVAL,
                format!("unknown command {other}"),
            ))
        }
    };
    if req.flags & !allowed_flags != 0 {
        return Err(CmdError::new(
            Errno::EINVAL,
            format!("unsupported command flags {:#x}", req.flags),
        ));
    }
    if req.kind == proto::CMD_FLUSH {
        return Ok(());
    }
    let writes = req.kind != proto::CMD_READ;
    if writes && info.read_only {
        return Err(CmdError::new(Errno::EPERM, "export is read-only"));
    }
    if (req.kind == proto::CMD_READ || req.kind == proto::CMD_WRITE)
        && req.len > proto::BLOCK_SIZE_MAX
    {
        return Err(CmdError::new(
            Errno::EINVAL,
            format!(
                "length {} exceeds the maximum block size {}",
                req.len,
                proto::BLOCK_SIZE_MAX
            ),
        ));
    }
    if req.len == 0 {
        return Err(CmdError::new(Errno::EINVAL, "zero length"));
    }
    let min = u64::from(proto::BLOCK_SIZE_MIN);
    if !req.offset.is_multiple_of(min) || u64::from(req.len) % min != 0 {
        return Err(CmdError::new(
            Errno::EINVAL,
            format!(
                "offset {} or length {} is not a multiple of {min} bytes",
                req.offset, req.len
            ),
        ));
    }
    let end = req.offset.checked_add(u64::from(req.len));
    if end.is_none_or(|e| e > info.size) {
        let errno = if req.kind == proto::CMD_WRITE || req.kind == proto::CMD_WRITE_ZEROES {
            Errno::ENOSPC
        } else {
            Errno::EINVAL
        };
        return Err(CmdError::new(
            errno,
            format!(
                "range {}+{} is past the end of the export ({} bytes)",
                req.offset, req.len, info.size
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(size: u64, ro: bool) -> ExportInfo {
        ExportInfo {
            size,
            read_only: ro,
            can_multi_conn: true,
            description: String::new(),
        }
    }

    fn req(kind: u16, flags: u16, offset: u64, len: u32) -> Request {
        Request {
            flags,
            kind,
            cookie: 1,
            offset,
            len,
        }
    }

    #[test]
    fn validate_accepts_aligned_in_range_requests() {
        let i = info(1 << 20, false);
        for kind in [
            proto::CMD_READ,
            proto::CMD_WRITE,
            proto::CMD_TRIM,
            proto::CMD_WRITE_ZEROES,
        ] {
            assert!(validate(&req(kind, 0, 512, 4096), &i).is_ok());
            assert!(validate(&req(kind, proto::CMD_FLAG_FUA, (1 << 20) - 512, 512), &i).is_ok());
        }
        assert!(validate(&req(proto::CMD_FLUSH, 0, 0, 0), &i).is_ok());
        assert!(validate(
            &req(proto::CMD_WRITE_ZEROES, proto::CMD_FLAG_NO_HOLE, 0, 512),
            &i
        )
        .is_ok());
    }

    #[test]
    fn validate_maps_each_violation_to_the_spec_errno() {
        let i = info(1 << 20, false);
        let e = |r| validate(&r, &i).unwrap_err().errno;
        assert_eq!(e(req(proto::CMD_READ, 0, 1 << 20, 512)), Errno::EINVAL);
        assert_eq!(e(req(proto::CMD_WRITE, 0, 1 << 20, 512)), Errno::ENOSPC);
        assert_eq!(
            e(req(proto::CMD_WRITE_ZEROES, 0, 1 << 20, 512)),
            Errno::ENOSPC
        );
        assert_eq!(e(req(proto::CMD_TRIM, 0, 1 << 20, 512)), Errno::EINVAL);
        assert_eq!(
            e(req(proto::CMD_READ, 0, u64::MAX - 511, 1024)),
            Errno::EINVAL
        );
        assert_eq!(e(req(proto::CMD_READ, 0, 1, 512)), Errno::EINVAL);
        assert_eq!(e(req(proto::CMD_READ, 0, 0, 100)), Errno::EINVAL);
        assert_eq!(e(req(proto::CMD_READ, 0, 0, 0)), Errno::EINVAL);
        assert_eq!(
            e(req(proto::CMD_READ, 0, 0, proto::BLOCK_SIZE_MAX + 512)),
            Errno::EINVAL
        );
        assert_eq!(
            e(req(proto::CMD_READ, proto::CMD_FLAG_NO_HOLE, 0, 512)),
            Errno::EINVAL
        );
        assert_eq!(e(req(99, 0, 0, 512)), Errno::EINVAL);
        let ro = info(1 << 20, true);
        assert_eq!(
            validate(&req(proto::CMD_WRITE, 0, 0, 512), &ro)
                .unwrap_err()
                .errno,
            Errno::EPERM
        );
        assert!(validate(&req(proto::CMD_READ, 0, 0, 512), &ro).is_ok());
    }
}

#[cfg(test)]
mod send_now_tests {
    use super::*;
    use std::os::fd::AsRawFd as _;
    use std::os::unix::net::UnixStream as StdUnix;

    /// Fills the socket's send buffer without blocking; returns the bytes it took.
    fn fill(s: &StdUnix) -> Vec<u8> {
        let chunk: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
        let mut sent = Vec::new();
        loop {
            // SAFETY: a valid socket and a buffer that outlives the call.
            let n = unsafe {
                libc::send(
                    s.as_raw_fd(),
                    chunk.as_ptr().cast(),
                    chunk.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if n <= 0 {
                return sent;
            }
            sent.extend_from_slice(&chunk[..n as usize]);
        }
    }

    /// However much room the socket has (none, some, plenty), a reply offered to `send_now`
    /// and then finished the way `Answer::send` finishes it (flushed after `Part`, written by
    /// the reply thread after `Not`) reaches the client whole, after what was queued before it.
    #[test]
    fn a_reply_sent_now_arrives_whole_and_in_order_whatever_room_the_socket_has() {
        let mut outcomes = [0usize; 3];
        for room in [0usize, 1, 10, 700, 4096, 8192, 30_000, 200_000, 1 << 30] {
            let (a, mut b) = StdUnix::pair().unwrap();
            let queued = fill(&a);
            let drained = room.min(queued.len());
            let mut head = vec![0u8; drained];
            b.read_exact(&mut head).unwrap();
            let mut out = Out::new(StdConn::Unix(a), Peer("test".into()), REPLY_WRITE_TIMEOUT);
            let data: Vec<u8> = (0..60_000u32).map(|i| (i * 7 % 256) as u8).collect();
            let header = reply_header(Errno(0), 0xc00c1e + room as u64);
            let reply = Reply {
                header,
                data: Some(Bytes::from(data.clone())),
                _budget: None,
            };
            // Offered before anything reads the other end, so the room is what it was made.
            let sent = out.send_now(reply);
            let reader = std::thread::spawn(move || {
                let mut got = Vec::new();
                b.read_to_end(&mut got).unwrap();
                got
            });
            match sent {
                Sent::All => outcomes[0] += 1,
                Sent::Part => {
                    outcomes[1] += 1;
                    out.flush();
                }
                Sent::Not(r) => {
                    outcomes[2] += 1;
                    out.put(&r);
                    out.flush();
                }
            }
            assert!(!out.broken);
            drop(out);
            let got = reader.join().unwrap();
            let want = [&queued[drained..], &header[..], &data[..]].concat();
            assert!(got == want, "room {room}: the stream differs");
        }
        // A full socket takes nothing, an emptied one all. (Whether some room in between
        // gives a partial send is the kernel's accounting; `keep_rest` is tested below.)
        assert!(outcomes[0] > 0 && outcomes[2] > 0, "outcomes {outcomes:?}");
    }

    /// What a partial send left is buffered exactly, wherever the send stopped.
    #[test]
    fn the_rest_of_a_partly_sent_reply_is_buffered_exactly() {
        let header = reply_header(Errno(0), 7);
        let data: Vec<u8> = (0..5000u32).map(|i| (i % 249) as u8).collect();
        let whole = [&header[..], &data[..]].concat();
        for sent in [
            1,
            5,
            header.len() - 1,
            header.len(),
            header.len() + 1,
            whole.len() - 1,
        ] {
            let (a, _b) = StdUnix::pair().unwrap();
            let mut out = Out::new(StdConn::Unix(a), Peer("test".into()), REPLY_WRITE_TIMEOUT);
            assert!(matches!(out.keep_rest(&header, &data, sent), Sent::Part));
            assert_eq!(out.w.buffer(), &whole[sent..], "sent {sent}");
        }
    }

    /// Nothing jumps the queue: with bytes already buffered, `send_now` sends nothing.
    #[test]
    fn send_now_leaves_a_reply_behind_buffered_ones() {
        let (a, _b) = StdUnix::pair().unwrap();
        let mut out = Out::new(StdConn::Unix(a), Peer("test".into()), REPLY_WRITE_TIMEOUT);
        out.put(&Reply::error(Errno::EIO, 1, None));
        let r = Reply::error(Errno(0), 2, None);
        assert!(matches!(out.send_now(r), Sent::Not(_)));
        assert_eq!(out.w.buffer().len(), proto::SIMPLE_REPLY_LEN);
    }
}

#[cfg(test)]
mod payload_tests {
    use super::*;

    #[test]
    fn a_payload_is_read_exactly_and_a_short_one_is_an_unexpected_end() {
        let stream: Vec<u8> = (0..10_000u32).map(|i| (i % 253) as u8).collect();
        let mut rd = std::io::BufReader::with_capacity(4096, &stream[..]);
        assert_eq!(read_payload(&mut rd, 6000).unwrap(), &stream[..6000]);
        // What follows the payload is left for the next header.
        assert_eq!(read_payload(&mut rd, 1000).unwrap(), &stream[6000..7000]);
        let e = read_payload(&mut rd, 3001).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    }
}

#[cfg(test)]
mod budget_tests {
    use super::*;
    use crate::client::Client;
    use crate::stop::StopHandle;
    use crate::uri::NbdUri;
    use tokio::net::UnixListener;

    /// Writes to `stuck` never complete (a datastore that does not answer), nor do FLUSHes
    /// to `stuckflush` (which allows several connections), nor the first FLUSH to
    /// `firstflush` ([`FIRST_FLUSHES`] counts its FLUSHes); a write to `gated` waits for a
    /// permit of [`GATE`] and is counted in [`GATED_DONE`]; everything else completes at once.
    struct Exports {
        stop: StopHandle,
    }

    struct Exp {
        stuck: bool,
        stuck_flush: bool,
        first_flush: bool,
        gated: bool,
        stop: Stop,
    }

    /// What writes to the `gated` export wait for (one test uses it).
    static GATE: Semaphore = Semaphore::const_new(0);
    /// Writes to the `gated` export that started.
    static GATED_STARTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    /// Writes to the `gated` export that completed.
    static GATED_DONE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

    /// Exports the test server lists.
    const LISTED: usize = 300;

    /// The FLUSHes the `firstflush` export has received (one test uses it).
    static FIRST_FLUSHES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

    impl Export for Exp {
        async fn read(&self, _offset: u64, len: u32) -> CmdResult<Bytes> {
            Ok(Bytes::from(vec![0u8; len as usize]))
        }
        async fn write(&self, _offset: u64, _data: Bytes, _fua: bool) -> CmdResult<()> {
            if self.stuck {
                std::future::pending::<()>().await;
            }
            if self.gated {
                GATED_STARTED.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                GATE.acquire().await.unwrap().forget();
                GATED_DONE.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
            Ok(())
        }
        async fn flush(&self) -> CmdResult<()> {
            let first = self.first_flush
                && FIRST_FLUSHES.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0;
            if self.stuck_flush || first {
                std::future::pending::<()>().await;
            }
            Ok(())
        }
        async fn trim(&self, _offset: u64, _len: u32, _fua: bool) -> CmdResult<()> {
            Ok(())
        }
        async fn write_zeroes(&self, _o: u64, _l: u32, _t: bool, _f: bool) -> CmdResult<()> {
            Ok(())
        }
        fn stop_signal(&self) -> Stop {
            self.stop.clone()
        }
    }

    fn info(name: &str) -> ExportInfo {
        ExportInfo {
            size: 1 << 30,
            read_only: false,
            can_multi_conn: name == "stuckflush",
            description: String::new(),
        }
    }

    impl ExportSet for Exports {
        type Export = Exp;
        /// As many as a host with many volumes serves.
        fn list(&self) -> Vec<(String, String)> {
            (0..LISTED)
                .map(|i| (format!("v{i}"), String::new()))
                .collect()
        }
        fn info(&self, name: &str) -> Result<ExportInfo, String> {
            Ok(info(name))
        }
        fn open(&self, name: &str) -> Result<(ExportInfo, Exp), String> {
            let e = Exp {
                stuck: name == "stuck",
                stuck_flush: name == "stuckflush",
                first_flush: name == "firstflush",
                gated: name == "gated",
                stop: self.stop.subscribe(),
            };
            Ok((info(name), e))
        }
    }

    /// Serves [`Exports`] on a new unix socket; returns the socket's directory (to remove),
    /// a URI maker and the accept task.
    fn serve_exports(
        tag: &str,
        shared: Arc<Semaphore>,
    ) -> (
        std::path::PathBuf,
        impl Fn(&str) -> NbdUri,
        tokio::task::JoinHandle<()>,
    ) {
        serve_exports_with(tag, shared, REPLY_WRITE_TIMEOUT)
    }

    /// [`serve_exports`] with replies that time out after `reply_timeout`.
    fn serve_exports_with(
        tag: &str,
        shared: Arc<Semaphore>,
        reply_timeout: Duration,
    ) -> (
        std::path::PathBuf,
        impl Fn(&str) -> NbdUri,
        tokio::task::JoinHandle<()>,
    ) {
        serve_exports_until(tag, shared, reply_timeout, Stop::never())
    }

    /// [`serve_exports_with`], the server stopping when `stop` fires.
    fn serve_exports_until(
        tag: &str,
        shared: Arc<Semaphore>,
        reply_timeout: Duration,
        stop: Stop,
    ) -> (
        std::path::PathBuf,
        impl Fn(&str) -> NbdUri,
        tokio::task::JoinHandle<()>,
    ) {
        let dir = std::env::temp_dir().join(format!("nbd-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let sock = dir.join("s.sock");
        let _ = std::fs::remove_file(&sock);
        let listener = UnixListener::bind(&sock).unwrap();
        let exports = Arc::new(Exports {
            stop: StopHandle::new(),
        });
        let server = tokio::spawn(async move {
            loop {
                let (s, _) = listener.accept().await.unwrap();
                let (exports, shared) = (exports.clone(), shared.clone());
                tokio::spawn(serve_connection(
                    s,
                    Peer("test".into()),
                    exports,
                    stop.clone(),
                    shared,
                    reply_timeout,
                ));
            }
        });
        let uri = move |name: &str| {
            NbdUri::parse(&format!("nbd+unix:///{name}?socket={}", sock.display())).unwrap()
        };
        (dir, uri, server)
    }

    /// A raw client past the greeting (fixed newstyle, no zeroes), for what the crate's own
    /// client never sends.
    fn raw_hello(sock: &std::path::Path) -> std::os::unix::net::UnixStream {
        use std::io::{Read, Write};
        let mut s = std::os::unix::net::UnixStream::connect(sock).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut greeting = [0u8; 18];
        s.read_exact(&mut greeting).unwrap();
        s.write_all(&3u32.to_be_bytes()).unwrap();
        s
    }

    /// Sends `NBD_OPT_INFO` or `NBD_OPT_GO` for `name` and reads the replies to the last:
    /// its type (`REP_ACK` if the export is there).
    fn raw_option(s: &mut std::os::unix::net::UnixStream, opt: u32, name: &str) -> io::Result<u32> {
        use std::io::{Read, Write};
        let mut o = Vec::new();
        o.extend_from_slice(&proto::IHAVEOPT.to_be_bytes());
        o.extend_from_slice(&opt.to_be_bytes());
        o.extend_from_slice(&(4 + name.len() as u32 + 2).to_be_bytes());
        o.extend_from_slice(&(name.len() as u32).to_be_bytes());
        o.extend_from_slice(name.as_bytes());
        o.extend_from_slice(&0u16.to_be_bytes());
        s.write_all(&o)?;
        loop {
            let mut h = [0u8; 20];
            s.read_exact(&mut h)?;
            let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
            let mut d = vec![0u8; len];
            s.read_exact(&mut d)?;
            let kind = u32::from_be_bytes(h[12..16].try_into().unwrap());
            if kind != proto::REP_INFO {
                return Ok(kind);
            }
        }
    }

    /// A client listing a host's exports asks `NBD_OPT_INFO` of each on one connection
    /// (`nbdinfo --list`): with 300 exports it gets every answer, and its `NBD_OPT_GO` after.
    /// Before, the connection was cut after 256 options.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_client_may_ask_about_every_export_on_one_connection() {
        let shared = Arc::new(Semaphore::new(IN_FLIGHT_BYTES_TOTAL_MAX / BUDGET_UNIT));
        let (dir, _uri, server) = serve_exports("listing", shared);
        let sock = dir.join("s.sock");
        tokio::task::spawn_blocking(move || {
            let mut s = raw_hello(&sock);
            for i in 0..LISTED {
                let kind = raw_option(&mut s, proto::OPT_INFO, &format!("v{i}"))
                    .unwrap_or_else(|e| panic!("option {i}: {e}"));
                assert_eq!(kind, proto::REP_ACK, "option {i}");
            }
            assert_eq!(
                raw_option(&mut s, proto::OPT_GO, "v0").unwrap(),
                proto::REP_ACK
            );
        })
        .await
        .unwrap();
        server.abort();
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A raw request header.
    fn raw_request(kind: u16, cookie: u64, offset: u64, len: u32) -> Vec<u8> {
        let mut req = Vec::new();
        req.extend_from_slice(&proto::REQUEST_MAGIC.to_be_bytes());
        req.extend_from_slice(&0u16.to_be_bytes());
        req.extend_from_slice(&kind.to_be_bytes());
        req.extend_from_slice(&cookie.to_be_bytes());
        req.extend_from_slice(&offset.to_be_bytes());
        req.extend_from_slice(&len.to_be_bytes());
        req
    }

    /// Reads one simple reply: its error and cookie.
    fn raw_reply(s: &mut std::os::unix::net::UnixStream) -> io::Result<(u32, u64)> {
        use std::io::Read;
        let mut r = [0u8; proto::SIMPLE_REPLY_LEN];
        s.read_exact(&mut r)?;
        assert_eq!(proto::be32(&r[0..4]), proto::SIMPLE_REPLY_MAGIC);
        let cookie = u64::from_be_bytes(r[8..16].try_into().unwrap());
        Ok((proto::be32(&r[4..8]), cookie))
    }

    /// A server that stops does what the protocol asks (a client on a Unix socket used to
    /// fail its next send with `EPIPE`, the socket's reading side shut under it): a write in
    /// flight is served and answered OK; a write sent after the stop, payload and all, is
    /// answered `ESHUTDOWN` and never runs; and once nothing is in flight the client reads
    /// the end of the stream, with no `NBD_CMD_DISC` needed, and may still send one. A second
    /// connection that sends nothing is closed at the stop.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stopping_server_answers_what_is_in_flight_and_eshutdown_after() {
        use std::io::{Read, Write};
        use std::sync::atomic::Ordering::SeqCst;
        let shared = Arc::new(Semaphore::new(IN_FLIGHT_BYTES_TOTAL_MAX / BUDGET_UNIT));
        let stop = StopHandle::new();
        let (dir, _uri, server) =
            serve_exports_until("stopping", shared, REPLY_WRITE_TIMEOUT, stop.subscribe());
        let sock = dir.join("s.sock");
        let (mut s, mut idle) = tokio::task::spawn_blocking({
            let sock = sock.clone();
            move || {
                let mut s = raw_hello(&sock);
                assert_eq!(
                    raw_option(&mut s, proto::OPT_GO, "gated").unwrap(),
                    proto::REP_ACK
                );
                let mut idle = raw_hello(&sock);
                assert_eq!(
                    raw_option(&mut idle, proto::OPT_GO, "v1").unwrap(),
                    proto::REP_ACK
                );
                let mut w = raw_request(proto::CMD_WRITE, 1, 0, 4096);
                w.extend_from_slice(&[7u8; 4096]);
                s.write_all(&w).unwrap();
                (s, idle)
            }
        })
        .await
        .unwrap();
        while GATED_STARTED.load(SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        stop.stop();
        let ended = tokio::task::spawn_blocking(move || {
            // The idle connection closes at the stop: the server has seen it (and the other
            // connection's task, woken by the same signal, too).
            let mut b = [0u8; 16];
            let idle_end = idle.read(&mut b).map_err(|e| e.kind());
            std::thread::sleep(Duration::from_millis(50));
            // Sent after the stop: a 64 KiB write whose payload the server must skip, then a
            // FLUSH behind it, to show the stream stayed in step.
            let mut w = raw_request(proto::CMD_WRITE, 2, 0, 65536);
            w.extend_from_slice(&[8u8; 65536]);
            w.extend_from_slice(&raw_request(proto::CMD_FLUSH, 3, 0, 0));
            s.write_all(&w).expect("a send after the stop");
            let shut = Errno::ESHUTDOWN.0;
            assert_eq!(raw_reply(&mut s).unwrap(), (shut, 2));
            assert_eq!(raw_reply(&mut s).unwrap(), (shut, 3));
            // The write in flight runs to its end and is answered.
            assert_eq!(GATED_DONE.load(SeqCst), 0);
            GATE.add_permits(1);
            assert_eq!(raw_reply(&mut s).unwrap(), (0, 1));
            // Then the connection ends; the client can still say goodbye (the server shut only
            // its writing side, so this send does not fail with EPIPE).
            let end = s.read(&mut b).map_err(|e| e.kind());
            s.write_all(&raw_request(proto::CMD_DISC, 4, 0, 0))
                .expect("a send after the end of the replies");
            (end, idle_end)
        });
        let (end, idle_end) = ended.await.unwrap();
        assert_eq!(end, Ok(0), "the connection did not close");
        assert_eq!(idle_end, Ok(0), "the idle connection did not close");
        // Only the write that was in flight at the stop ran.
        assert_eq!(GATED_STARTED.load(SeqCst), 1);
        assert_eq!(GATED_DONE.load(SeqCst), 1);
        server.abort();
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A client that stops sending a WRITE's payload midway (frozen, or its link gone with
    /// no error) holds budget every connection shares: the connection ends once the payload
    /// has not come for the reply timeout (1 s here), and the budget goes back. Before, it
    /// waited for ever.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_whose_payload_stops_coming_ends_its_connection() {
        use std::io::{Read, Write};
        let total = IN_FLIGHT_BYTES_TOTAL_MAX / BUDGET_UNIT;
        let shared = Arc::new(Semaphore::new(total));
        let (dir, _uri, server) =
            serve_exports_with("payload", shared.clone(), Duration::from_secs(1));
        let sock = dir.join("s.sock");
        let ended = tokio::task::spawn_blocking(move || {
            let mut s = raw_hello(&sock);
            raw_option(&mut s, proto::OPT_GO, "slow").unwrap();
            // A 16 MiB WRITE, of which 1 MiB comes; then nothing, the socket open.
            let len = 16u32 << 20;
            let mut req = Vec::new();
            req.extend_from_slice(&proto::REQUEST_MAGIC.to_be_bytes());
            req.extend_from_slice(&0u16.to_be_bytes());
            req.extend_from_slice(&proto::CMD_WRITE.to_be_bytes());
            req.extend_from_slice(&7u64.to_be_bytes());
            req.extend_from_slice(&0u64.to_be_bytes());
            req.extend_from_slice(&len.to_be_bytes());
            s.write_all(&req).unwrap();
            s.write_all(&vec![1u8; 1 << 20]).unwrap();
            let t = std::time::Instant::now();
            let mut b = [0u8; 64];
            let r = s.read(&mut b);
            (r.map_err(|e| e.kind()), t.elapsed(), s)
        });
        let (r, took, _s) = ended.await.unwrap();
        assert!(
            matches!(r, Ok(0) | Err(io::ErrorKind::ConnectionReset)),
            "the connection did not end: {r:?} after {took:?}"
        );
        assert!(took < Duration::from_secs(10), "it ended after {took:?}");
        // Its budget is back.
        for _ in 0..100 {
            if shared.available_permits() == total {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(shared.available_permits(), total);
        server.abort();
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A FLUSH goes to every connection of the client's pool that holds unflushed writes; if
    /// none of them answers, it fails once the first request timeout has passed, not one
    /// timeout after another (a pool of two took twice as long). Run on tokio's paused clock
    /// once the writes are done: the wait costs no real time.
    #[tokio::test(flavor = "current_thread")]
    async fn a_flush_no_connection_answers_fails_after_one_timeout() {
        let shared = Arc::new(Semaphore::new(IN_FLIGHT_BYTES_TOTAL_MAX / BUDGET_UNIT));
        let (dir, uri, server) = serve_exports("flush", shared);
        let c = Client::connect(&uri("stuckflush"), 2).await.unwrap();
        assert_eq!(c.pool_size(), 2);
        // Requests take the pool's connections in turn: one write on each.
        for i in 0..2u64 {
            c.write(i << 12, Bytes::from(vec![3u8; 4096]), false)
                .await
                .unwrap();
        }
        tokio::time::pause();
        let started = tokio::time::Instant::now();
        let r = c.flush().await;
        let took = started.elapsed();
        assert!(r.is_err(), "a FLUSH no connection answered succeeded");
        assert!(
            took >= crate::client::REQUEST_TIMEOUT
                && took < crate::client::REQUEST_TIMEOUT + crate::client::REQUEST_TIMEOUT / 2,
            "the FLUSH failed after {took:?}, not one request timeout"
        );
        server.abort();
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A FLUSH answered OK while another FLUSH runs beside it on the connection is held until
    /// that one answers ([`crate::client`]). When that one never answers and its own waiter
    /// went away (nobody times it out), the held FLUSH fails one request timeout past its
    /// own deadline, failing the connection, instead of waiting forever. Paused clock.
    #[tokio::test(flavor = "current_thread")]
    async fn a_held_flush_whose_companion_is_abandoned_fails_after_two_timeouts() {
        use crate::client::REQUEST_TIMEOUT;
        let shared = Arc::new(Semaphore::new(IN_FLIGHT_BYTES_TOTAL_MAX / BUDGET_UNIT));
        let (dir, uri, server) = serve_exports("heldflush", shared);
        let c = Arc::new(Client::connect(&uri("firstflush"), 1).await.unwrap());
        // The first FLUSH reaches the server, which never answers it; then its waiter goes.
        let first = tokio::spawn({
            let c = c.clone();
            async move { c.flush().await }
        });
        while FIRST_FLUSHES.load(std::sync::atomic::Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        first.abort();
        assert!(first.await.unwrap_err().is_cancelled());
        // The second FLUSH is answered OK (the server runs on threads of its own: real time
        // until its answer is held), then the clock is paused.
        let sent = tokio::time::Instant::now();
        let second = tokio::spawn({
            let c = c.clone();
            async move { c.flush().await }
        });
        let held = async {
            while c.waiting().await != (1, 1) {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), held)
            .await
            .expect("the second FLUSH's answer was never held");
        assert_eq!(FIRST_FLUSHES.load(std::sync::atomic::Ordering::SeqCst), 2);
        tokio::time::pause();
        let r = tokio::time::timeout(5 * REQUEST_TIMEOUT, second)
            .await
            .expect("a FLUSH held for an abandoned one waited forever")
            .unwrap();
        let took = sent.elapsed();
        assert!(
            matches!(r, Err(crate::client::ClientError::Disconnected(_))),
            "the held FLUSH answered {r:?}"
        );
        assert!(
            took >= 2 * REQUEST_TIMEOUT && took < 2 * REQUEST_TIMEOUT + REQUEST_TIMEOUT / 2,
            "the held FLUSH failed after {took:?}, not two request timeouts"
        );
        server.abort();
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A server that sends a READ's reply header and then stalls in the middle of its data
    /// fails the read (and the connection) one request timeout after it was sent: the read
    /// is no longer pending once its header is in, but it is no held answer either. The
    /// stall is a proxy that stops passing the server's bytes on. Paused clock.
    #[tokio::test(flavor = "current_thread")]
    async fn a_read_whose_data_stalls_midway_fails_after_one_timeout() {
        use crate::client::REQUEST_TIMEOUT;
        use std::sync::atomic::{AtomicUsize, Ordering};
        let shared = Arc::new(Semaphore::new(IN_FLIGHT_BYTES_TOTAL_MAX / BUDGET_UNIT));
        let (dir, uri, server) = serve_exports("stalledread", shared);
        let crate::uri::Address::Unix(upstream) = uri("ok").address else {
            panic!("a unix socket URI");
        };
        // The proxy passes on at most `budget` more bytes from the server.
        let budget = Arc::new(AtomicUsize::new(usize::MAX));
        let front = dir.join("proxy.sock");
        let listener = UnixListener::bind(&front).unwrap();
        let proxy = tokio::spawn({
            let budget = budget.clone();
            async move {
                let (down, _) = listener.accept().await.unwrap();
                let up = UnixStream::connect(&upstream).await.unwrap();
                let (mut down_rd, mut down_wr) = down.into_split();
                let (mut up_rd, mut up_wr) = up.into_split();
                tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut down_rd, &mut up_wr).await;
                });
                let mut buf = vec![0u8; 64 << 10];
                loop {
                    let n = up_rd.read(&mut buf).await.unwrap();
                    assert!(n > 0, "the server closed");
                    let pass = n.min(
                        budget
                            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |b| {
                                Some(b.saturating_sub(n))
                            })
                            .unwrap(),
                    );
                    down_wr.write_all(&buf[..pass]).await.unwrap();
                }
            }
        });
        let via = NbdUri::parse(&format!("nbd+unix:///ok?socket={}", front.display())).unwrap();
        let c = Arc::new(Client::connect(&via, 1).await.unwrap());
        // The reply header and 100 bytes of the 4 KiB read's data, then nothing.
        budget.store(proto::SIMPLE_REPLY_LEN + 100, Ordering::SeqCst);
        let started = tokio::time::Instant::now();
        let read = tokio::spawn({
            let c = c.clone();
            async move { c.read(0, 4096).await }
        });
        // Real time until the client has the header (the read is pending no more), as the
        // server runs on threads of its own; then the clock is paused.
        let header_in = async {
            while budget.load(Ordering::SeqCst) > 0 || c.waiting().await != (0, 0) {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), header_in)
            .await
            .expect("the read's reply header never reached the client");
        assert!(!read.is_finished());
        tokio::time::pause();
        let r = tokio::time::timeout(5 * REQUEST_TIMEOUT, read)
            .await
            .expect("a read whose data stalled midway waited forever")
            .unwrap();
        let took = started.elapsed();
        assert!(
            matches!(r, Err(crate::client::ClientError::Disconnected(_))),
            "the stalled read answered {r:?}"
        );
        assert!(
            took >= REQUEST_TIMEOUT && took < REQUEST_TIMEOUT + REQUEST_TIMEOUT / 2,
            "the stalled read failed after {took:?}, not one request timeout"
        );
        proxy.abort();
        server.abort();
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Writes stalled on one export use up the whole shared budget (here 4 MiB, the stalled
    /// connections' reserves full too); a connection to another export still completes its
    /// writes, from its own reserve. With only a shared budget it would wait for the stalled
    /// writes forever.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn writes_stalled_on_one_export_do_not_hold_up_another() {
        let shared = Arc::new(Semaphore::new((4 << 20) / BUDGET_UNIT));
        let (dir, uri, server) = serve_exports("budget", shared.clone());
        // Two connections to the stalled export, each writing 1 MiB at a time until the
        // shared budget is gone: 2 MiB of reserve each, then 4 MiB shared between them.
        let mut stalled = Vec::new();
        for _ in 0..2 {
            let c = Arc::new(Client::connect(&uri("stuck"), 1).await.unwrap());
            for i in 0..6u64 {
                let c = c.clone();
                stalled.push(tokio::spawn(async move {
                    c.write(i << 20, Bytes::from(vec![7u8; 1 << 20]), false)
                        .await
                }));
            }
        }
        let used_up = async {
            while shared.available_permits() > 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), used_up)
            .await
            .expect("the stalled writes never took the shared budget");

        let ok = Client::connect(&uri("ok"), 1).await.unwrap();
        for i in 0..8u64 {
            let w = ok.write(i << 16, Bytes::from(vec![1u8; 64 << 10]), false);
            tokio::time::timeout(Duration::from_secs(5), w)
                .await
                .expect("a write to another export waited for the stalled ones")
                .unwrap();
        }
        assert!(stalled.iter().all(|t| !t.is_finished()));
        server.abort();
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A client of the export behind `uri` that speaks the transmission phase by hand, so a
    /// test can send requests without reading their replies.
    async fn raw_client(uri: &NbdUri) -> tokio::net::UnixStream {
        let crate::uri::Address::Unix(path) = &uri.address else {
            panic!("a unix socket URI");
        };
        let mut s = tokio::net::UnixStream::connect(path).await.unwrap();
        let (mut rd, mut wr) = s.split();
        crate::client::handshake(&mut rd, &mut wr, uri)
            .await
            .unwrap();
        s
    }

    fn request(kind: u16, cookie: u64, offset: u64, len: u32) -> BytesMut {
        let mut b = BytesMut::new();
        let r = Request {
            flags: 0,
            kind,
            cookie,
            offset,
            len,
        };
        r.encode(&mut b);
        if kind == proto::CMD_WRITE {
            b.extend_from_slice(&vec![5u8; len as usize]);
        }
        b
    }

    /// Reads one simple reply header (after `skip` bytes of an earlier reply's data) and
    /// returns its cookie and error.
    async fn reply_cookie(s: &mut tokio::net::UnixStream) -> (u64, u32) {
        use tokio::io::AsyncReadExt as _;
        let mut h = [0u8; proto::SIMPLE_REPLY_LEN];
        s.read_exact(&mut h).await.unwrap();
        assert_eq!(proto::be32(&h[0..4]), proto::SIMPLE_REPLY_MAGIC);
        (proto::be64(&h[8..16]), proto::be32(&h[4..8]))
    }

    /// A reply completed inline is sent before the connection waits for the rest of a
    /// WRITE's payload: a client may send it only once it has its earlier answers.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reply_is_sent_before_the_connection_waits_for_a_payload() {
        use tokio::io::AsyncWriteExt as _;
        let shared = Arc::new(Semaphore::new(IN_FLIGHT_BYTES_TOTAL_MAX / BUDGET_UNIT));
        let (dir, uri, server) = serve_exports("payload", shared);
        let mut s = raw_client(&uri("ok")).await;
        let mut reqs = request(proto::CMD_WRITE, 1, 0, 4096);
        let second = request(proto::CMD_WRITE, 2, 4096, 64 << 10);
        // The second WRITE's header and half its payload.
        let half = proto::REQUEST_LEN + (32 << 10);
        reqs.extend_from_slice(&second[..half]);
        s.write_all(&reqs).await.unwrap();
        let answer = tokio::time::timeout(Duration::from_secs(10), reply_cookie(&mut s))
            .await
            .expect(
                "the first WRITE's reply was held back while the connection waited for a payload",
            );
        assert_eq!(answer, (1, 0));
        s.write_all(&second[half..]).await.unwrap();
        let answer = tokio::time::timeout(Duration::from_secs(10), reply_cookie(&mut s))
            .await
            .expect("no reply to the second WRITE");
        assert_eq!(answer, (2, 0));
        server.abort();
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A client that stops reading its replies is disconnected once a reply has waited out
    /// the write timeout: the connection ends, so the client (qemu) sees it close and
    /// reconnects. Before, the server marked the connection broken, dropped every later
    /// reply and kept the socket open: the client waited for ever on a reply cut short.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_client_that_stops_reading_replies_is_disconnected() {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let shared = Arc::new(Semaphore::new(IN_FLIGHT_BYTES_TOTAL_MAX / BUDGET_UNIT));
        let (dir, uri, server) = serve_exports_with("unread", shared, Duration::from_secs(1));
        let mut s = raw_client(&uri("ok")).await;
        // Two 32 MiB READs: far more than the socket buffers hold, and nobody reads.
        let mut reqs = request(proto::CMD_READ, 1, 0, proto::BLOCK_SIZE_MAX);
        reqs.extend_from_slice(&request(proto::CMD_READ, 2, 0, proto::BLOCK_SIZE_MAX));
        s.write_all(&reqs).await.unwrap();
        tokio::time::sleep(Duration::from_secs(3)).await;
        // Reading now gets what was sent of the first reply, then the end of the stream.
        let mut got = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut got)).await;
        let n = read
            .expect("the connection stayed open after its reply timed out")
            .unwrap_or(got.len());
        assert!(
            n < 2 * (proto::SIMPLE_REPLY_LEN + proto::BLOCK_SIZE_MAX as usize),
            "both replies arrived whole ({n} bytes): the write never timed out"
        );
        server.abort();
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A request that is invalid is answered at once, even while the connection's budget is
    /// held by writes stalled on their datastore: it needs none. Before, a READ past the end
    /// waited for budget first, for as long as the datastore was stuck.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_invalid_request_is_answered_without_waiting_for_budget() {
        use tokio::io::AsyncWriteExt as _;
        let shared = Arc::new(Semaphore::new(IN_FLIGHT_BYTES_TOTAL_MAX / BUDGET_UNIT));
        let (dir, uri, server) = serve_exports("invalid", shared);
        let mut s = raw_client(&uri("stuck")).await;
        let max = proto::BLOCK_SIZE_MAX;
        let unit = BUDGET_UNIT as u32;
        // Two stalled writes hold all of the connection's budget but one unit; the READ, past
        // the end of the export, would need two.
        let mut reqs = request(proto::CMD_WRITE, 1, 0, max);
        reqs.extend_from_slice(&request(proto::CMD_WRITE, 2, 0, max - unit));
        reqs.extend_from_slice(&request(proto::CMD_READ, 3, 1 << 60, 2 * unit));
        s.write_all(&reqs).await.unwrap();
        let answer = tokio::time::timeout(Duration::from_secs(10), reply_cookie(&mut s))
            .await
            .expect("the invalid READ waited for budget");
        assert_eq!(answer, (3, proto::Errno::EINVAL.0));
        server.abort();
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Replies completed on the connection's thread are sent before that thread waits for
    /// budget. Here the connection's budget is held by two writes stalled on their datastore;
    /// a READ completes at once, and the next one, larger, waits for budget. The first READ's reply
    /// must reach the client meanwhile, not sit in the buffer for as long as the datastore
    /// is stuck.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reply_is_sent_before_the_connection_waits_for_budget() {
        use tokio::io::AsyncWriteExt as _;
        let shared = Arc::new(Semaphore::new(IN_FLIGHT_BYTES_TOTAL_MAX / BUDGET_UNIT));
        let (dir, uri, server) = serve_exports("wait", shared);
        let mut s = raw_client(&uri("stuck")).await;
        let max = proto::BLOCK_SIZE_MAX;
        // The two writes take all of the connection's budget but one unit: the first READ
        // fits in it (and gives it back once its reply is buffered), the second does not.
        let unit = BUDGET_UNIT as u32;
        let mut reqs = request(proto::CMD_WRITE, 1, 0, max);
        reqs.extend_from_slice(&request(proto::CMD_WRITE, 2, 0, max - unit));
        reqs.extend_from_slice(&request(proto::CMD_READ, 3, 0, unit));
        reqs.extend_from_slice(&request(proto::CMD_READ, 4, 0, 2 * unit));
        s.write_all(&reqs).await.unwrap();
        let answer = tokio::time::timeout(Duration::from_secs(10), reply_cookie(&mut s))
            .await
            .expect("the READ's reply was held back while the connection waited for budget");
        assert_eq!(answer, (3, 0));
        server.abort();
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[cfg(test)]
mod keepalive_tests {
    use super::*;

    fn get(fd: std::os::fd::RawFd, level: libc::c_int, name: libc::c_int) -> libc::c_int {
        let mut v: libc::c_int = 0;
        let mut n = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: fd is an open socket; v and n are valid for writes of their size.
        let r = unsafe {
            libc::getsockopt(fd, level, name, (&mut v as *mut libc::c_int).cast(), &mut n)
        };
        assert_eq!(r, 0, "getsockopt: {}", io::Error::last_os_error());
        v
    }

    /// A TCP client connection gets keepalive with the idle time, interval and probe count
    /// the constants say (the kernel's defaults would take over two hours to notice a dead
    /// client, and keepalive is off unless asked for).
    #[test]
    fn a_tcp_client_connection_is_probed_when_idle() {
        use std::os::fd::AsRawFd as _;
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let _c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        let fd = s.as_raw_fd();
        assert_eq!(get(fd, libc::SOL_SOCKET, libc::SO_KEEPALIVE), 0);
        keep_alive(&s).unwrap();
        assert_eq!(get(fd, libc::SOL_SOCKET, libc::SO_KEEPALIVE), 1);
        let secs = |d: Duration| d.as_secs() as libc::c_int;
        assert_eq!(
            get(fd, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE),
            secs(KEEPALIVE_IDLE)
        );
        assert_eq!(
            get(fd, libc::IPPROTO_TCP, libc::TCP_KEEPINTVL),
            secs(KEEPALIVE_INTERVAL)
        );
        assert_eq!(
            get(fd, libc::IPPROTO_TCP, libc::TCP_KEEPCNT),
            KEEPALIVE_PROBES as libc::c_int
        );
    }
}
