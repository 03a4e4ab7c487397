//! The sending side: one pipelined connection from an owner to one peer.
//!
//! Requests go out in the order they are made, any number at once within a byte budget
//! ([`IN_FLIGHT_BYTES`]: a slow peer holds its owner's writes back instead of falling
//! unboundedly behind), and each completes when the peer's reply arrives. A connection that
//! fails, or a peer that does not answer within [`REQUEST_TIMEOUT`], breaks the link: every
//! request in flight and after fails, and the owner replaces the link ([`Link::connect`]
//! again, or other peers). Nothing is retried on a broken link, because the peer may or may
//! not have taken what was in flight.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::TcpStream;
use tokio::sync::{oneshot, Notify, Semaphore};
use tokio::task::JoinHandle;

use crate::auth::{self, Exchange, Key, Role, PROOF_LEN};
use crate::wire::{self, Body, Msg, Status, HANDSHAKE_BODY_MAX, HEADER_LEN};

/// Longest a request may wait for its reply before the link is declared broken.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest a connection attempt may take, and then its handshake.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// Bytes of requests one link keeps in flight at most.
pub const IN_FLIGHT_BYTES: usize = 64 << 20;
const BUDGET_UNIT: usize = 4096;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PeerError {
    #[error("peer {peer} ({addr}) unreachable: {msg}")]
    Unreachable {
        peer: String,
        addr: String,
        msg: String,
    },
    /// The handshake failed: one side does not know the other's pod's peer key.
    #[error("peer {peer} ({addr}) not authenticated: {msg}")]
    Unauthenticated {
        peer: String,
        addr: String,
        msg: String,
    },
    #[error("link to peer {peer} broken: {msg}")]
    Broken { peer: String, msg: String },
    #[error("peer {peer} refused: {msg}")]
    Refused { peer: String, msg: String },
    #[error("peer {peer} knows a newer generation: {msg}")]
    Stale { peer: String, msg: String },
    /// An answer to [`Link::held`]: the peer holds nothing of the volume (so, certainly, no
    /// replicas of that generation).
    #[error("peer {peer} holds nothing: {msg}")]
    Absent { peer: String, msg: String },
}

/// A request's reply channel, and whether a refusal of it breaks the link: a peer that did
/// not take a write (or a flush) lacks something the writes after it would depend on.
type Waiter = (oneshot::Sender<Result<String, PeerError>>, bool);

struct Inner {
    peer: String,
    /// When the link was made, and when it last heard a reply (ms after that).
    born: std::time::Instant,
    heard_ms: AtomicU64,
    pending: Mutex<HashMap<u64, Waiter>>,
    broken: Mutex<Option<String>>,
    next: AtomicU64,
    out: Arc<Out>,
    budget: Semaphore,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

/// The sending half of the connection. A request with no other in flight goes onto the
/// socket from its sender's own thread (no task to wake: a hop less on a lone write's round
/// trip); the others, and whatever the socket does not take at once, wait in `queue` for
/// [`flush_loop`], which writes all that is queued at once, in vectored writes.
struct Out {
    wr: OwnedWriteHalf,
    /// Frame bytes not on the socket yet, in request order. Written only under this lock, so
    /// frames leave in the order they were queued.
    queue: Mutex<std::collections::VecDeque<Bytes>>,
    /// Wakes [`flush_loop`] when the queue has something the socket did not take.
    kick: Notify,
}

impl Out {
    /// Writes as much of `q` as the socket takes without waiting.
    fn write_now(&self, q: &mut std::collections::VecDeque<Bytes>) -> std::io::Result<()> {
        use bytes::Buf;
        while !q.is_empty() {
            let slices: Vec<std::io::IoSlice<'_>> = q
                .iter()
                .take(GATHER)
                .map(|c| std::io::IoSlice::new(c))
                .collect();
            let mut n = match self.wr.try_write_vectored(&slices) {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) => return Err(e),
            };
            drop(slices);
            while n > 0 {
                let front = q.front_mut().expect("wrote no more than queued");
                if front.len() <= n {
                    n -= front.len();
                    q.pop_front();
                } else {
                    front.advance(n);
                    n = 0;
                }
            }
        }
        Ok(())
    }
}

impl Inner {
    /// Breaks the link: fails every waiting request and stops the connection's tasks.
    fn fail(&self, why: String) {
        let mut b = self.broken.lock().expect("lock");
        if b.is_none() {
            tracing::warn!("link to peer {} broken: {why}", self.peer);
            *b = Some(why.clone());
        }
        drop(b);
        let waiting: Vec<Waiter> = self
            .pending
            .lock()
            .expect("lock")
            .drain()
            .map(|(_, w)| w)
            .collect();
        for (w, _) in waiting {
            let _ = w.send(Err(PeerError::Broken {
                peer: self.peer.clone(),
                msg: why.clone(),
            }));
        }
        for t in self.tasks.lock().expect("lock").iter() {
            t.abort();
        }
    }

    fn broken(&self) -> Option<String> {
        self.broken.lock().expect("lock").clone()
    }
}

/// A connection to one peer. Cheap to clone; all clones share the connection.
#[derive(Clone)]
pub struct Link {
    inner: Arc<Inner>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        for t in self.tasks.lock().expect("lock").iter() {
            t.abort();
        }
    }
}

impl Link {
    /// Connects to the peer `peer` at `addr` as this host (`me`); each side proves it knows
    /// the pod's peer `key` ([`crate::auth`]). Fails if the peer cannot be reached, does not
    /// answer, is another host, speaks another protocol version or does not know the key.
    pub async fn connect(peer: &str, addr: &str, me: &str, key: &Key) -> Result<Link, PeerError> {
        let unreachable = |msg: String| PeerError::Unreachable {
            peer: peer.to_owned(),
            addr: addr.to_owned(),
            msg,
        };
        let mut s = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr))
            .await
            .map_err(|_| unreachable(format!("no answer within {CONNECT_TIMEOUT:?}")))?
            .map_err(|e| unreachable(e.to_string()))?;
        s.set_nodelay(true)
            .map_err(|e| unreachable(e.to_string()))?;
        tokio::time::timeout(CONNECT_TIMEOUT, handshake(&mut s, peer, addr, me, key))
            .await
            .map_err(|_| unreachable(format!("no handshake within {CONNECT_TIMEOUT:?}")))??;
        let (rd, wr) = s.into_split();
        let out = Arc::new(Out {
            wr,
            queue: Mutex::new(Default::default()),
            kick: Notify::new(),
        });
        let inner = Arc::new(Inner {
            peer: peer.to_owned(),
            born: std::time::Instant::now(),
            heard_ms: AtomicU64::new(0),
            pending: Mutex::new(HashMap::new()),
            broken: Mutex::new(None),
            next: AtomicU64::new(1),
            out: out.clone(),
            budget: Semaphore::new(IN_FLIGHT_BYTES / BUDGET_UNIT),
            tasks: Mutex::new(Vec::new()),
        });
        let weak = Arc::downgrade(&inner);
        let writer = tokio::spawn(flush_loop(out, weak.clone()));
        let reader = tokio::spawn(read_loop(rd, weak));
        inner.tasks.lock().expect("lock").extend([writer, reader]);
        Ok(Link { inner })
    }

    pub fn peer(&self) -> &str {
        &self.inner.peer
    }

    /// Why the link is broken, if it is.
    pub fn broken(&self) -> Option<String> {
        self.inner.broken()
    }

    /// How long the link has been idle: no request waiting for its reply (a waiting one has
    /// its own timeout) and no reply heard. `None` while a request waits.
    pub fn idle_for(&self) -> Option<Duration> {
        if !self.inner.pending.lock().expect("lock").is_empty() {
            return None;
        }
        let heard = Duration::from_millis(self.inner.heard_ms.load(Ordering::Relaxed));
        Some(self.inner.born.elapsed().saturating_sub(heard))
    }

    /// Asks the peer for an answer and nothing else, so that a peer gone silent (its host
    /// lost power, the network to it drops everything) is found while the link is idle, not
    /// at the owner's next write: without an answer within [`REQUEST_TIMEOUT`] the link
    /// breaks. It is a `Checkpoint` of `volume` at write 0 of generation 0, which a peer of
    /// any build answers at once with no IO: no copy is below write 0.
    pub async fn ping(&self, volume: uuid::Uuid) -> Result<(), PeerError> {
        self.checkpoint(volume, 0, 0).await
    }

    /// Breaks the link on purpose (the owner gave the peer up).
    pub fn close(&self, why: &str) {
        self.inner.fail(why.to_owned());
    }

    /// Sends `msg` and waits for its reply. `bytes` is what it carries (for the budget).
    async fn request(&self, msg: Msg, bytes: usize) -> Result<String, PeerError> {
        self.send(Body::new(&msg), bytes).await
    }

    /// Sends an encoded body (a write encoded once for all of a volume's peers).
    async fn send(&self, body: Body, bytes: usize) -> Result<String, PeerError> {
        let inner = &self.inner;
        let broken = |msg: String| PeerError::Broken {
            peer: inner.peer.clone(),
            msg,
        };
        // Requests that carry no data (FLUSH, checkpoint, ping, Held) take none of the budget:
        // in line behind writes waiting for it, a checkpoint would wait for the very room it
        // frees at the peer, whose share holds the writes in flight.
        let _budget = match bytes {
            0 => None,
            n => {
                let units = (n / BUDGET_UNIT).clamp(1, IN_FLIGHT_BYTES / BUDGET_UNIT) as u32;
                Some(
                    inner
                        .budget
                        .acquire_many(units)
                        .await
                        .map_err(|_| broken("closed".into()))?,
                )
            }
        };
        let (tx, rx) = oneshot::channel();
        let sent = {
            // Numbered and queued under one lock, so frames leave in the order requests got
            // their share of the budget. That is the order they were made while they fit in
            // it; past it, a request made while an earlier one waits may find budget freed in
            // between and go first. Callers that need an order between two requests wait for
            // the first (the engine's gatekeeper does, for overlapping writes; a FLUSH or a
            // checkpoint is sent after the writes it covers were answered).
            let mut pending = inner.pending.lock().expect("lock");
            if let Some(why) = inner.broken() {
                return Err(broken(why));
            }
            let seq = inner.next.fetch_add(1, Ordering::SeqCst);
            let fatal = matches!(body.kind(), wire::Kind::Write | wire::Kind::Flush);
            pending.insert(seq, (tx, fatal));
            // Alone, the request goes out at once from here; with others in flight, the
            // flush loop gathers it with them into fewer, larger socket writes.
            let alone = pending.len() == 1;
            let out = &inner.out;
            let mut q = out.queue.lock().expect("lock");
            let direct = alone && q.is_empty();
            q.push_back(Bytes::copy_from_slice(&body.header(seq)));
            q.extend(body.parts.into_iter().filter(|p| !p.is_empty()));
            let sent = if direct {
                out.write_now(&mut q)
            } else {
                Ok(())
            };
            if sent.is_ok() && !q.is_empty() {
                out.kick.notify_one();
            }
            sent
        };
        if let Err(e) = sent {
            // Fails every request in flight, this one too.
            inner.fail(format!("send: {e}"));
        }
        match tokio::time::timeout(REQUEST_TIMEOUT, rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(broken(inner.broken().unwrap_or_else(|| "closed".into()))),
            Err(_) => {
                let why = format!("no reply within {REQUEST_TIMEOUT:?}");
                inner.fail(why.clone());
                Err(broken(why))
            }
        }
    }

    pub async fn open(
        &self,
        volume: uuid::Uuid,
        gen: u64,
        checkpoint: u64,
    ) -> Result<(), PeerError> {
        self.request(
            Msg::Open {
                volume,
                gen,
                checkpoint,
            },
            0,
        )
        .await
        .map(drop)
    }

    pub async fn write(&self, w: wire::WriteMsg) -> Result<(), PeerError> {
        self.write_encoded(Body::new(&Msg::Write(w))).await
    }

    /// Sends a write encoded with [`Body::new`] (once for all links).
    pub async fn write_encoded(&self, body: Body) -> Result<(), PeerError> {
        let bytes = body.len();
        self.send(body, bytes).await.map(drop)
    }

    pub async fn flush(&self) -> Result<(), PeerError> {
        self.request(Msg::Flush, 0).await.map(drop)
    }

    pub async fn checkpoint(
        &self,
        volume: uuid::Uuid,
        gen: u64,
        ser: u64,
    ) -> Result<(), PeerError> {
        self.request(
            Msg::Checkpoint {
                volume,
                gen,
                ser,
                window_end: 0,
            },
            0,
        )
        .await
        .map(drop)
    }

    /// The checkpoint `ser` and the end of the window about to go out (see the `Checkpoint`
    /// frame); answered once the peer holds both durably: `Ok(true)`. `Ok(false)`: a peer of
    /// an earlier build took the checkpoint alone. A peer that refuses it (its cache device
    /// failed, say) breaks the link, as a refused write or flush does: the owner then takes
    /// it out of the vault before the window goes.
    pub async fn window_end(
        &self,
        volume: uuid::Uuid,
        gen: u64,
        ser: u64,
        window_end: u64,
    ) -> Result<bool, PeerError> {
        let r = self
            .request(
                Msg::Checkpoint {
                    volume,
                    gen,
                    ser,
                    window_end,
                },
                0,
            )
            .await;
        match r {
            Ok(msg) => Ok(msg == wire::WINDOW_END_HELD),
            Err(e) => {
                self.close(&format!("window end not taken: {e}"));
                Err(e)
            }
        }
    }

    pub async fn drop_replicas(&self, volume: uuid::Uuid, gen: u64) -> Result<(), PeerError> {
        self.request(Msg::Drop { volume, gen }, 0).await.map(drop)
    }

    /// Asks the peer up to which `ser` it holds `volume`'s generation `gen` without a gap
    /// above `from`, durably (a host about to replay the volume asks its other peers).
    /// [`PeerError::Absent`] if it holds nothing of the volume at all.
    pub async fn held(
        &self,
        volume: uuid::Uuid,
        gen: u64,
        from: u64,
    ) -> Result<crate::server::Holding, PeerError> {
        let answer = self.request(Msg::Held { volume, gen, from }, 0).await?;
        crate::server::Holding::decode(&answer).ok_or_else(|| PeerError::Refused {
            peer: self.inner.peer.clone(),
            msg: format!("answered Held with {}, not numbers", quoted(&answer)),
        })
    }
}

/// The owner's side of the handshake ([`crate::auth`]) on a new connection to `peer`.
async fn handshake(
    s: &mut TcpStream,
    peer: &str,
    addr: &str,
    me: &str,
    key: &Key,
) -> Result<(), PeerError> {
    let unreachable = |msg: String| PeerError::Unreachable {
        peer: peer.to_owned(),
        addr: addr.to_owned(),
        msg,
    };
    let refused = |msg: String| PeerError::Unauthenticated {
        peer: peer.to_owned(),
        addr: addr.to_owned(),
        msg,
    };
    let owner_nonce = auth::nonce().map_err(|e| unreachable(format!("nonce: {e}")))?;
    let hello = Msg::Hello {
        host: me.to_owned(),
        nonce: owner_nonce,
        proof: [0; PROOF_LEN],
    };
    s.write_all(&wire::encode(0, &hello))
        .await
        .map_err(|e| unreachable(format!("send: {e}")))?;
    let (name, peer_nonce, proof) = match read_small(s).await.map_err(unreachable)? {
        Msg::Hello { host, nonce, proof } => (host, nonce, proof),
        // Before it checked anything (busy, say): not a matter of keys.
        Msg::Reply { msg, .. } => return Err(unreachable(quoted(&msg))),
        _ => return Err(unreachable("answered Hello with another frame".into())),
    };
    if name != peer {
        return Err(unreachable(format!(
            "the host at {addr} is {name:?}, not {peer:?}"
        )));
    }
    let x = Exchange {
        owner: me,
        owner_nonce: &owner_nonce,
        peer: &name,
        peer_nonce: &peer_nonce,
    };
    if !key.verify(Role::Peer, &x, &proof) {
        return Err(refused(
            "it did not prove it knows this pod's peer key (is it in another pod?)".into(),
        ));
    }
    s.write_all(&wire::encode(0, &Msg::Proof(key.prove(Role::Owner, &x))))
        .await
        .map_err(|e| unreachable(format!("send: {e}")))?;
    match read_small(s).await.map_err(unreachable)? {
        Msg::Reply {
            status: Status::Ok, ..
        } => Ok(()),
        Msg::Reply { msg, .. } => Err(refused(quoted(&msg))),
        _ => Err(unreachable("answered Proof with another frame".into())),
    }
}

/// What a host that has not proved itself said, fit for a log line: quoted, at most 200
/// characters.
fn quoted(msg: &str) -> String {
    let short: String = msg.chars().take(200).collect();
    format!("{short:?}")
}

/// Reads one handshake frame (small: a stranger's large body is not read).
async fn read_small(s: &mut TcpStream) -> Result<Msg, String> {
    let mut head = [0u8; HEADER_LEN];
    s.read_exact(&mut head).await.map_err(|e| {
        use std::io::ErrorKind::{ConnectionReset, UnexpectedEof};
        if matches!(e.kind(), UnexpectedEof | ConnectionReset) {
            // A peer closes at once on a frame of another protocol version (a reset when it
            // leaves the frame's body unread).
            format!(
                "closed the connection during the handshake (a host running another Vesta \
                 version, speaking other than peer protocol version {}, or not a Vesta peer \
                 port; its log says which)",
                wire::VERSION
            )
        } else {
            format!("receive: {e}")
        }
    })?;
    let h = wire::decode_head(&head).map_err(|e| e.to_string())?;
    if h.body_len > HANDSHAKE_BODY_MAX {
        return Err(wire::WireError::TooLong(h.body_len).to_string());
    }
    let mut body = vec![0u8; h.body_len as usize];
    s.read_exact(&mut body)
        .await
        .map_err(|e| format!("receive: {e}"))?;
    wire::decode_body(&h, Bytes::from(body)).map_err(|e| e.to_string())
}

/// Most frame parts gathered into one vectored write.
const GATHER: usize = 64;

/// Writes what the senders left queued (the socket did not take it at once), waiting for the
/// socket to take more, until the queue is empty again.
async fn flush_loop(out: Arc<Out>, link: std::sync::Weak<Inner>) {
    let fail = |e: std::io::Error| {
        if let Some(l) = link.upgrade() {
            l.fail(format!("send: {e}"));
        }
    };
    loop {
        out.kick.notified().await;
        loop {
            let left = {
                let mut q = out.queue.lock().expect("lock");
                if let Err(e) = out.write_now(&mut q) {
                    drop(q);
                    return fail(e);
                }
                !q.is_empty()
            };
            if !left {
                break;
            }
            if let Err(e) = out.wr.writable().await {
                return fail(e);
            }
        }
    }
}

async fn read_loop(rd: tokio::net::tcp::OwnedReadHalf, link: std::sync::Weak<Inner>) {
    // Buffered: a reply's header and body (and often the next replies) in one read, where
    // unbuffered reads took a syscall for each (strace: header, one-byte body, then EAGAIN).
    let mut rd = tokio::io::BufReader::with_capacity(16 * 1024, rd);
    let err = loop {
        let mut head = [0u8; HEADER_LEN];
        if let Err(e) = rd.read_exact(&mut head).await {
            break format!("receive: {e}");
        }
        let h = match wire::decode_head(&head) {
            Ok(h) => h,
            Err(e) => break e.to_string(),
        };
        let mut body = vec![0u8; h.body_len as usize];
        if let Err(e) = rd.read_exact(&mut body).await {
            break format!("receive: {e}");
        }
        let (status, msg) = match wire::decode_body(&h, Bytes::from(body)) {
            Ok(Msg::Reply { status, msg }) => (status, msg),
            Ok(other) => break format!("unexpected frame from peer: {other:?}"),
            Err(e) => break e.to_string(),
        };
        let Some(l) = link.upgrade() else { return };
        l.heard_ms
            .store(l.born.elapsed().as_millis() as u64, Ordering::Relaxed);
        let waiter = l.pending.lock().expect("lock").remove(&h.seq);
        let Some((waiter, fatal)) = waiter else {
            break format!("reply to unknown request {}", h.seq);
        };
        let peer = l.peer.clone();
        if status != Status::Ok && fatal {
            // The link breaks before the refusal is delivered: whoever sees the error also
            // sees the link broken (and excludes the peer), and nothing after a refused
            // write may count.
            l.fail(format!("peer refused a write: {msg}"));
            let _ = waiter.send(Err(match status {
                Status::Stale => PeerError::Stale { peer, msg },
                _ => PeerError::Refused { peer, msg },
            }));
            return;
        }
        let _ = waiter.send(match status {
            Status::Ok => Ok(msg),
            Status::Failed => Err(PeerError::Refused { peer, msg }),
            Status::Stale => Err(PeerError::Stale { peer, msg }),
            Status::Absent => Err(PeerError::Absent { peer, msg }),
        });
    };
    if let Some(l) = link.upgrade() {
        l.fail(err);
    }
}
