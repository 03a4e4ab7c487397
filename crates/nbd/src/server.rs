//! The server side: negotiation and a pipelined transmission phase.
//!
//! # Shape of a connection
//!
//! One task reads: it negotiates, then decodes request headers (and WRITE payloads) in a loop,
//! validates each against the export, and spawns one task per valid request. Request tasks run
//! concurrently, so a slow request never holds up independent ones; ordering between
//! overlapping requests is the export's business (the engine's gatekeeper), as the protocol
//! allows any completion order. Each request task hands its reply to a single writer task over
//! a channel; the writer batches whatever replies are ready into one socket write.
//!
//! Memory is bounded per connection: a request may not start (its payload is not even read)
//! until it holds a slot of [`IN_FLIGHT_REQUESTS_MAX`] and its share of
//! [`IN_FLIGHT_BYTES_MAX`]; both are released only after the reply is on the socket.
//!
//! # Ending a connection
//!
//! On `NBD_CMD_DISC`, end of stream, a protocol violation, or a stop signal (daemon shutdown,
//! volume deleted with `--force`), the reader stops taking requests and drops its side of the
//! reply channel; the writer keeps sending replies until every in-flight request has finished
//! and then closes the socket. In-flight writes are thus always completed, never abandoned.
//!
//! # Bad input
//!
//! Nothing a client sends can panic the server. A request that can be answered gets an error
//! reply (`EINVAL`, `ENOSPC`, `EPERM`); one after which the stream cannot be trusted (bad magic,
//! a WRITE payload over the maximum) closes the connection. Either way one line is logged with
//! the peer and the reason, and other connections are unaffected.

use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
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
/// Unit in which the byte budget is counted (semaphore permits are `u32`).
const BUDGET_UNIT: usize = 4096;
/// A client that has not finished negotiating by then is disconnected (slow-loris guard).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
/// Options one client may send before entering transmission; beyond that it is looping.
const OPTIONS_MAX: usize = 256;
/// Option payloads larger than this are not read (the longest legal one is a 4 KiB name).
const OPTION_LEN_MAX: u32 = 64 * 1024;
/// Connections the server accepts at once; beyond that new ones are closed with a log line.
pub const CONNECTIONS_MAX: usize = 4096;

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
    /// Information for `NBD_OPT_INFO`, without attaching.
    fn info(&self, name: &str) -> Option<ExportInfo>;
    /// Attaches a connection for `NBD_OPT_GO` / `NBD_OPT_EXPORT_NAME`. The error is a message
    /// for the client and the log.
    fn open(&self, name: &str) -> Result<(ExportInfo, Self::Export), String>;
}

/// Who is on the other end, for log lines.
#[derive(Debug, Clone)]
pub struct Peer(pub String);

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A stream the server can split into independently owned halves.
pub trait Stream: Send + 'static {
    type Read: AsyncRead + Unpin + Send + 'static;
    type Write: AsyncWrite + Unpin + Send + 'static;
    fn into_halves(self) -> (Self::Read, Self::Write);
}

impl Stream for TcpStream {
    type Read = tokio::net::tcp::OwnedReadHalf;
    type Write = tokio::net::tcp::OwnedWriteHalf;
    fn into_halves(self) -> (Self::Read, Self::Write) {
        self.into_split()
    }
}

impl Stream for UnixStream {
    type Read = tokio::net::unix::OwnedReadHalf;
    type Write = tokio::net::unix::OwnedWriteHalf;
    fn into_halves(self) -> (Self::Read, Self::Write) {
        self.into_split()
    }
}

/// Counts live connections so shutdown can wait for them to drain.
#[derive(Clone)]
pub struct ConnTracker {
    /// Never sent on: the channel closes when the last clone is dropped, which is the signal.
    _alive: mpsc::Sender<()>,
    slots: Arc<Semaphore>,
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
                spawn_conn(s, Peer(addr.to_string()), &exports, &stop, &tracker);
            }
            Err(e) => {
                warn!("nbd: accept on tcp failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
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
        serve_connection(s, peer, exports, stop).await;
        drop(slot);
        drop(tracker);
    });
}

/// Serves one connection from negotiation to close.
pub async fn serve_connection<X: ExportSet, S: Stream>(
    s: S,
    peer: Peer,
    exports: Arc<X>,
    stop: Stop,
) {
    let (rd, wr) = s.into_halves();
    let mut rd = BufReader::with_capacity(128 * 1024, rd);
    let mut wr = BufWriter::with_capacity(128 * 1024, wr);
    let negotiated = tokio::time::timeout(
        HANDSHAKE_TIMEOUT,
        negotiate(&mut rd, &mut wr, &*exports, &peer, &stop),
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
    transmission(rd, wr, peer, name, info, export, stop).await;
}

type Negotiated<E> = Option<(String, ExportInfo, E)>;

fn invalid(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

async fn negotiate<X: ExportSet, R, W>(
    rd: &mut R,
    wr: &mut W,
    exports: &X,
    peer: &Peer,
    stop: &Stop,
) -> io::Result<Negotiated<X::Export>>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut out = BytesMut::with_capacity(256);
    {
        use bytes::BufMut;
        out.put_u64(proto::NBDMAGIC);
        out.put_u64(proto::IHAVEOPT);
        out.put_u16(proto::FLAG_FIXED_NEWSTYLE | proto::FLAG_NO_ZEROES);
    }
    wr.write_all(&out).await?;
    wr.flush().await?;
    let client_flags = rd.read_u32().await?;
    if client_flags & !(proto::FLAG_C_FIXED_NEWSTYLE | proto::FLAG_C_NO_ZEROES) != 0 {
        return Err(invalid(format!("unknown client flags {client_flags:#x}")));
    }
    let no_zeroes = client_flags & proto::FLAG_C_NO_ZEROES != 0;

    for _ in 0..OPTIONS_MAX {
        let magic = rd.read_u64().await?;
        if magic != proto::IHAVEOPT {
            return Err(invalid(format!("bad option magic {magic:#x}")));
        }
        let option = rd.read_u32().await?;
        let len = rd.read_u32().await?;
        if len > OPTION_LEN_MAX {
            return Err(invalid(format!(
                "option {option} carries {len} bytes, more than {OPTION_LEN_MAX}"
            )));
        }
        let mut data = vec![0u8; len as usize];
        rd.read_exact(&mut data).await?;

        out.clear();
        let reply = |out: &mut BytesMut, kind: u32, payload: &[u8]| {
            proto::encode_option_reply(out, option, kind, payload)
        };
        if stop.is_stopped() && option != proto::OPT_ABORT {
            reply(
                &mut out,
                proto::REP_ERR_SHUTDOWN,
                b"server is shutting down",
            );
            wr.write_all(&out).await?;
            wr.flush().await?;
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
                wr.write_all(&out).await?;
                wr.flush().await?;
                return Ok(Some((name, info, export)));
            }
            proto::OPT_ABORT => {
                reply(&mut out, proto::REP_ACK, &[]);
                // The client may already have closed; a failed write here is not an error.
                let _ = wr.write_all(&out).await;
                let _ = wr.flush().await;
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
                    wr.write_all(&out).await?;
                    wr.flush().await?;
                    continue;
                };
                let opened = if option == proto::OPT_GO {
                    exports.open(&req.name).map(|(i, e)| (i, Some(e)))
                } else {
                    exports
                        .info(&req.name)
                        .map(|i| (i, None))
                        .ok_or_else(|| format!("no export named {:?}", req.name))
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
                            wr.write_all(&out).await?;
                            wr.flush().await?;
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
        wr.write_all(&out).await?;
        wr.flush().await?;
    }
    Err(invalid(format!("more than {OPTIONS_MAX} options")))
}

/// A reply on its way to the writer, holding the request's budget until it is written.
struct Reply {
    header: [u8; proto::SIMPLE_REPLY_LEN],
    data: Option<Bytes>,
    _budget: Budget,
}

struct Budget {
    _slot: Option<OwnedSemaphorePermit>,
    _bytes: Option<OwnedSemaphorePermit>,
}

fn reply_header(errno: Errno, cookie: u64) -> [u8; proto::SIMPLE_REPLY_LEN] {
    let mut b = BytesMut::with_capacity(proto::SIMPLE_REPLY_LEN);
    proto::encode_simple_reply(&mut b, errno, cookie);
    let mut h = [0u8; proto::SIMPLE_REPLY_LEN];
    h.copy_from_slice(&b);
    h
}

/// The obligation to answer one request. If a request task ends without answering (a bug that
/// panicked), dropping the slot answers EIO so the client is never left waiting.
struct ReplySlot {
    tx: mpsc::UnboundedSender<Reply>,
    cookie: u64,
    budget: Option<Budget>,
}

impl ReplySlot {
    fn send(mut self, errno: Errno, data: Option<Bytes>) {
        let budget = self.budget.take().expect("reply sent once");
        let _ = self.tx.send(Reply {
            header: reply_header(errno, self.cookie),
            data,
            _budget: budget,
        });
    }
}

impl Drop for ReplySlot {
    fn drop(&mut self) {
        if let Some(budget) = self.budget.take() {
            let _ = self.tx.send(Reply {
                header: reply_header(Errno::EIO, self.cookie),
                data: None,
                _budget: budget,
            });
        }
    }
}

async fn writer_loop<W: AsyncWrite + Unpin>(
    mut wr: BufWriter<W>,
    mut rx: mpsc::UnboundedReceiver<Reply>,
    peer: Peer,
) {
    let mut broken = false;
    while let Some(first) = rx.recv().await {
        if broken {
            continue; // keep draining so request tasks release their budgets
        }
        let mut next = Some(first);
        while let Some(r) = next {
            let res = async {
                wr.write_all(&r.header).await?;
                if let Some(d) = &r.data {
                    wr.write_all(d).await?;
                }
                io::Result::Ok(())
            }
            .await;
            if let Err(e) = res {
                debug!("nbd {peer}: writing reply failed: {e}");
                broken = true;
                break;
            }
            next = rx.try_recv().ok();
        }
        if !broken {
            if let Err(e) = wr.flush().await {
                debug!("nbd {peer}: writing reply failed: {e}");
                broken = true;
            }
        }
    }
    let _ = wr.shutdown().await;
}

/// Why the reader stopped taking requests.
enum End {
    Disc,
    Eof,
    Stopped,
    Violation(String),
    Io(io::Error),
}

async fn transmission<E: Export, R, W>(
    mut rd: BufReader<R>,
    wr: BufWriter<W>,
    peer: Peer,
    name: String,
    info: ExportInfo,
    export: E,
    mut stop: Stop,
) where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let export = Arc::new(export);
    let (tx, rx) = mpsc::unbounded_channel();
    let writer = tokio::spawn(writer_loop(wr, rx, peer.clone()));
    let slots = Arc::new(Semaphore::new(IN_FLIGHT_REQUESTS_MAX));
    let bytes = Arc::new(Semaphore::new(IN_FLIGHT_BYTES_MAX / BUDGET_UNIT));
    let mut export_gone = export.stop_signal();

    let end = loop {
        let mut hdr = [0u8; proto::REQUEST_LEN];
        let got = tokio::select! {
            biased;
            _ = stop.wait() => break End::Stopped,
            _ = export_gone.wait() => break End::Stopped,
            r = read_header(&mut rd, &mut hdr) => r,
        };
        match got {
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
        let payload_len = match req.kind {
            proto::CMD_READ | proto::CMD_WRITE => req.len.min(proto::BLOCK_SIZE_MAX) as usize,
            _ => 0,
        };
        let budget = Budget {
            _slot: Some(slots.clone().acquire_owned().await.expect("never closed")),
            _bytes: Some(
                bytes
                    .clone()
                    .acquire_many_owned(payload_len.div_ceil(BUDGET_UNIT).max(1) as u32)
                    .await
                    .expect("never closed"),
            ),
        };
        let data = if req.kind == proto::CMD_WRITE {
            let mut buf = BytesMut::with_capacity(req.len as usize);
            if let Err(e) = read_payload(&mut rd, &mut buf, req.len as usize).await {
                break End::Io(e);
            }
            Some(buf.freeze())
        } else {
            None
        };
        let slot = ReplySlot {
            tx: tx.clone(),
            cookie: req.cookie,
            budget: Some(budget),
        };
        if let Err(e) = validate(&req, &info) {
            warn!(
                "nbd {peer} export {name:?}: {} rejected with {}: {}",
                proto::command_name(req.kind),
                e.errno,
                e.msg
            );
            slot.send(e.errno, None);
            continue;
        }
        let export = export.clone();
        tokio::spawn(async move {
            let fua = req.flags & proto::CMD_FLAG_FUA != 0;
            match req.kind {
                proto::CMD_READ => match export.read(req.offset, req.len).await {
                    Ok(d) if d.len() == req.len as usize => slot.send(Errno(0), Some(d)),
                    Ok(d) => {
                        warn!(
                            "export returned {} bytes for a READ of {}; answering EIO",
                            d.len(),
                            req.len
                        );
                        slot.send(Errno::EIO, None)
                    }
                    Err(e) => slot.send(e.errno, None),
                },
                proto::CMD_WRITE => {
                    let data = data.unwrap_or_default();
                    answer(slot, export.write(req.offset, data, fua).await)
                }
                proto::CMD_FLUSH => answer(slot, export.flush().await),
                proto::CMD_TRIM => answer(slot, export.trim(req.offset, req.len, fua).await),
                proto::CMD_WRITE_ZEROES => {
                    let may_trim = req.flags & proto::CMD_FLAG_NO_HOLE == 0;
                    answer(
                        slot,
                        export
                            .write_zeroes(req.offset, req.len, may_trim, fua)
                            .await,
                    )
                }
                _ => unreachable!("validate admits only known commands"),
            }
        });
    };

    match &end {
        End::Disc => debug!("nbd {peer}: client disconnected from {name:?}"),
        End::Eof => debug!("nbd {peer}: connection to {name:?} closed by client"),
        End::Stopped => {
            info!("nbd {peer}: closing connection to {name:?}: export or server stopping")
        }
        End::Violation(why) => warn!("nbd {peer} export {name:?}: closing connection: {why}"),
        End::Io(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
            warn!("nbd {peer} export {name:?}: client disconnected in the middle of a request")
        }
        End::Io(e) => warn!("nbd {peer} export {name:?}: closing connection: {e}"),
    }
    // Stop taking requests; the writer ends once every in-flight request has replied.
    drop(tx);
    drop(rd);
    let _ = writer.await;
    drop(export);
}

fn answer(slot: ReplySlot, r: CmdResult<()>) {
    match r {
        Ok(()) => slot.send(Errno(0), None),
        Err(e) => slot.send(e.errno, None),
    }
}

/// Reads one request header. `Ok(false)` on a clean end of stream before any byte of it.
async fn read_header<R: AsyncRead + Unpin>(
    rd: &mut R,
    hdr: &mut [u8; proto::REQUEST_LEN],
) -> io::Result<bool> {
    let mut got = 0;
    while got < hdr.len() {
        let n = rd.read(&mut hdr[got..]).await?;
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

async fn read_payload<R: AsyncRead + Unpin>(
    rd: &mut R,
    buf: &mut BytesMut,
    len: usize,
) -> io::Result<()> {
    while buf.len() < len {
        // `read_buf` may overshoot into spare capacity; `take` limits it to this payload.
        let want = len - buf.len();
        let n = (&mut *rd).take(want as u64).read_buf(buf).await?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
    }
    Ok(())
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

/// Where a server listens.
#[derive(Debug, Clone)]
pub enum ListenAddr {
    Tcp(std::net::SocketAddr),
    Unix(PathBuf),
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
