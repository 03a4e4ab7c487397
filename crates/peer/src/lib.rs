//! Peer replication between hosts (DESIGN §4, FVP §3 `wbp`).
//!
//! In `wbp:P` a volume's owner sends every write to P peers, which append it to their own
//! cache log and acknowledge; FLUSH is forwarded and completes when every peer has synced;
//! checkpoints are forwarded so peers drop what the datastore already holds.
//!
//! - [`auth`]: the handshake's proofs (pure): owner and peer each show they know the pod's
//!   peer key before a frame of data is taken.
//! - [`wire`]: the frames (pure): a checksummed header with the protocol version, a
//!   checksummed body. Any damage closes the connection.
//! - [`client`]: the owner's side, a pipelined [`Link`] per peer with a byte budget.
//! - [`server`]: the peer's side, one thread per connection applying requests in order to a
//!   [`Sink`] (the daemon's cache log).

pub mod auth;
pub mod client;
pub mod server;
pub mod wire;

pub use client::{Link, PeerError};
pub use server::{serve, Holding, Refusal, Sink};
pub use wire::{Body, WriteMsg};

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;
    use uuid::Uuid;

    /// A sink that records what it was given, and refuses stale generations like a real peer.
    #[derive(Default)]
    struct Memory {
        log: Mutex<Vec<String>>,
        gen: Mutex<u64>,
    }

    impl Sink for Memory {
        fn host(&self) -> String {
            "p1".into()
        }
        fn open(&self, from: &str, _v: Uuid, gen: u64, ckpt: u64) -> Result<(), Refusal> {
            let mut g = self.gen.lock().unwrap();
            if gen < *g {
                return Err(Refusal::Stale(format!("gen {gen} < {}", *g)));
            }
            *g = gen;
            self.log
                .lock()
                .unwrap()
                .push(format!("open {from} {gen} {ckpt}"));
            Ok(())
        }
        fn write(&self, _from: &str, w: WriteMsg) -> Result<(), Refusal> {
            if w.offset == u64::MAX {
                return Err(Refusal::Failed("no space".into()));
            }
            self.log.lock().unwrap().push(format!(
                "write {} {} {}",
                w.ser,
                w.offset,
                w.data.map_or(0, |d| d[0])
            ));
            Ok(())
        }
        fn write_at_once(&self, from: &str, w: &WriteMsg) -> Option<Result<(), Refusal>> {
            Some(self.write(from, w.clone()))
        }
        fn flush(&self) -> Result<(), Refusal> {
            self.log.lock().unwrap().push("flush".into());
            Ok(())
        }
        fn checkpoint(&self, _v: Uuid, _g: u64, ser: u64, end: u64) -> Result<(), Refusal> {
            if end == u64::MAX {
                return Err(Refusal::Failed("no space".into()));
            }
            self.log.lock().unwrap().push(if end == 0 {
                format!("ckpt {ser}")
            } else {
                format!("ckpt {ser} end {end}")
            });
            Ok(())
        }
        fn drop_replicas(&self, _v: Uuid, gen: u64) -> Result<(), Refusal> {
            self.log.lock().unwrap().push(format!("drop {gen}"));
            Ok(())
        }
        /// The highest write taken (this sink takes them in order, without gaps), and the
        /// newest checkpoint.
        fn held(&self, _v: Uuid, gen: u64, from: u64) -> Result<Holding, Refusal> {
            if gen != *self.gen.lock().unwrap() {
                return Err(Refusal::Absent(format!(
                    "holds no replicas of generation {gen}"
                )));
            }
            let log = self.log.lock().unwrap();
            let top = log
                .iter()
                .filter_map(|l| l.strip_prefix("write ")?.split(' ').next()?.parse().ok())
                .max()
                .unwrap_or(0u64);
            let checkpoint = log
                .iter()
                .filter_map(|l| l.strip_prefix("ckpt ")?.split(' ').next()?.parse().ok())
                .max()
                .unwrap_or(0u64);
            Ok(Holding {
                upto: top.max(from),
                checkpoint,
            })
        }
    }

    fn start(sink: Arc<Memory>) -> String {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        serve(l, sink, key()).unwrap();
        addr
    }

    /// The pod's key in these tests.
    fn key() -> auth::Key {
        auth::Key::from_bytes([7; 32])
    }

    async fn read_msg(s: &mut tokio::net::TcpStream) -> (u64, wire::Msg) {
        use tokio::io::AsyncReadExt;
        let mut head = [0u8; wire::HEADER_LEN];
        s.read_exact(&mut head).await.unwrap();
        let h = wire::decode_head(&head).unwrap();
        let mut body = vec![0u8; h.body_len as usize];
        s.read_exact(&mut body).await.unwrap();
        (h.seq, wire::decode_body(&h, Bytes::from(body)).unwrap())
    }

    /// The owner's side of the handshake, by hand, as `me` with `key`: the peer's final reply.
    async fn owner_handshake(
        s: &mut tokio::net::TcpStream,
        me: &str,
        key: &auth::Key,
    ) -> wire::Msg {
        use tokio::io::AsyncWriteExt;
        let nonce = [1; 16];
        let hello = wire::Msg::Hello {
            host: me.into(),
            nonce,
            proof: [0; 32],
        };
        s.write_all(&wire::encode(0, &hello)).await.unwrap();
        let wire::Msg::Hello {
            host,
            nonce: peer_nonce,
            ..
        } = read_msg(s).await.1
        else {
            panic!("no Hello back")
        };
        let x = auth::Exchange {
            owner: me,
            owner_nonce: &nonce,
            peer: &host,
            peer_nonce: &peer_nonce,
        };
        let proof = wire::Msg::Proof(key.prove(auth::Role::Owner, &x));
        s.write_all(&wire::encode(0, &proof)).await.unwrap();
        read_msg(s).await.1
    }

    /// The peer's side of the handshake, by hand, as `me` with `key`.
    async fn peer_handshake(s: &mut tokio::net::TcpStream, me: &str, key: &auth::Key) {
        use tokio::io::AsyncWriteExt;
        let (seq, wire::Msg::Hello { host, nonce, .. }) = read_msg(s).await else {
            panic!("no Hello")
        };
        let peer_nonce = [2; 16];
        let x = auth::Exchange {
            owner: &host,
            owner_nonce: &nonce,
            peer: me,
            peer_nonce: &peer_nonce,
        };
        let hello = wire::Msg::Hello {
            host: me.into(),
            nonce: peer_nonce,
            proof: key.prove(auth::Role::Peer, &x),
        };
        s.write_all(&wire::encode(seq, &hello)).await.unwrap();
        let (seq, wire::Msg::Proof(p)) = read_msg(s).await else {
            panic!("no Proof")
        };
        assert!(key.verify(auth::Role::Owner, &x, &p));
        let ok = wire::Msg::Reply {
            status: wire::Status::Ok,
            msg: String::new(),
        };
        s.write_all(&wire::encode(seq, &ok)).await.unwrap();
    }

    fn w(ser: u64, byte: u8) -> WriteMsg {
        WriteMsg {
            volume: Uuid::nil(),
            gen: 3,
            ser,
            offset: ser * 4096,
            len: 4096,
            data: Some(Bytes::from(vec![byte; 4096])),
            alloc: false,
        }
    }

    /// A sink that checks every byte of each write against [`pattern`] and records which
    /// writes it applied, in order. Every fourth write has no room at once
    /// ([`Sink::write_at_once`]), so the connection applies writes both on its reading thread
    /// and on its applying one; it counts how many each.
    #[derive(Default)]
    struct Checker {
        applied: Mutex<Vec<(Uuid, u64, bool)>>,
        at_once: std::sync::atomic::AtomicU64,
        waited: std::sync::atomic::AtomicU64,
    }

    impl Checker {
        /// How many writes were applied at once, and how many by [`Sink::write`].
        fn ways(&self) -> (u64, u64) {
            use std::sync::atomic::Ordering::SeqCst;
            (self.at_once.load(SeqCst), self.waited.load(SeqCst))
        }
        fn apply(&self, w: &WriteMsg) {
            let intact = w
                .data
                .as_ref()
                .is_some_and(|d| d.len() as u64 == w.len && *d == pattern(w.ser, w.len as usize));
            self.applied.lock().unwrap().push((w.volume, w.ser, intact));
        }
    }

    fn pattern(ser: u64, len: usize) -> Bytes {
        (0..len)
            .map(|i| (ser as usize * 7 + i / 4096) as u8)
            .collect::<Vec<u8>>()
            .into()
    }

    impl Sink for Checker {
        fn host(&self) -> String {
            "p1".into()
        }
        fn open(&self, _: &str, _: Uuid, _: u64, _: u64) -> Result<(), Refusal> {
            Ok(())
        }
        fn write(&self, _from: &str, w: WriteMsg) -> Result<(), Refusal> {
            self.apply(&w);
            self.waited
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok(())
        }
        fn write_at_once(&self, _from: &str, w: &WriteMsg) -> Option<Result<(), Refusal>> {
            if w.ser.is_multiple_of(4) {
                return None;
            }
            self.apply(w);
            self.at_once
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Some(Ok(()))
        }
        fn flush(&self) -> Result<(), Refusal> {
            Ok(())
        }
        fn checkpoint(&self, _: Uuid, _: u64, _: u64, _: u64) -> Result<(), Refusal> {
            Ok(())
        }
        fn drop_replicas(&self, _: Uuid, _: u64) -> Result<(), Refusal> {
            Ok(())
        }
        fn held(&self, _: Uuid, _: u64, from: u64) -> Result<Holding, Refusal> {
            Ok(Holding {
                upto: from,
                checkpoint: 0,
            })
        }
    }

    /// Sends `n` writes of `len` bytes for each of `volumes`, all in flight together,
    /// numbered in ser order per volume and issued round robin across the volumes: every
    /// future is polled once in that order before any is awaited.
    async fn write_all(link: &Link, volumes: &[Uuid], n: u64, len: usize) {
        use std::future::Future;
        use std::task::Poll;
        let mut futs: Vec<_> = (1..=n)
            .flat_map(|ser| volumes.iter().map(move |v| (*v, ser)))
            .map(|(volume, ser)| {
                let f = Box::pin(link.write(WriteMsg {
                    volume,
                    gen: 1,
                    ser,
                    offset: ser * len as u64,
                    len: len as u64,
                    data: Some(pattern(ser, len)),
                    alloc: false,
                }));
                (volume, ser, f)
            })
            .collect();
        let mut done: Vec<Option<Result<(), PeerError>>> = futs.iter().map(|_| None).collect();
        std::future::poll_fn(|cx| {
            let mut all = true;
            for ((_, _, f), d) in futs.iter_mut().zip(done.iter_mut()) {
                if d.is_none() {
                    match f.as_mut().poll(cx) {
                        Poll::Ready(r) => *d = Some(r),
                        Poll::Pending => all = false,
                    }
                }
            }
            if all {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await;
        for ((v, ser, _), d) in futs.iter().zip(done) {
            d.expect("done")
                .unwrap_or_else(|e| panic!("write {ser} of {v}: {e}"));
        }
    }

    /// What the sink applied of each volume, in order, with every byte checked.
    fn applied_in_order(sink: &Checker, volumes: &[Uuid], n: u64) -> Vec<(Uuid, u64, bool)> {
        let applied = sink.applied.lock().unwrap().clone();
        assert_eq!(applied.len() as u64, n * volumes.len() as u64);
        assert!(
            applied.iter().all(|(_, _, ok)| *ok),
            "a write arrived damaged"
        );
        for v in volumes {
            let sers: Vec<u64> = applied
                .iter()
                .filter(|(x, _, _)| x == v)
                .map(|(_, s, _)| *s)
                .collect();
            assert_eq!(sers, (1..=n).collect::<Vec<_>>(), "order of {v}'s writes");
        }
        applied
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn requests_overrunning_the_socket_keep_their_order_and_data() {
        // 240 writes of 256 KiB in flight, 60 MiB, far beyond what a socket buffer takes:
        // requests queue behind each other and the flush loop writes what the socket did not
        // take at once. They stay within the link's byte budget (64 MiB), so each is numbered
        // as soon as it is made: past the budget, a request made later may get its share
        // first (see `Link::send`), and order holds only between requests that wait for each
        // other.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let sink = Arc::new(Checker::default());
        serve(l, sink.clone(), key()).unwrap();
        let link = Link::connect("p1", &addr, "owner", &key()).await.unwrap();

        // One task, two volumes' writes issued alternately: 600 in flight at once, their
        // frames interleaved on the socket.
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        write_all(&link, &[a, b], 120, 256 << 10).await;
        link.flush().await.unwrap();
        let applied = applied_in_order(&sink, &[a, b], 120);
        let (at_once, waited) = sink.ways();
        assert!(
            at_once > 0 && waited > 0,
            "writes applied at once {at_once}, after a wait {waited}: both ways must be taken"
        );
        assert_eq!(applied[0].0, a);
        assert_eq!(applied[1].0, b, "issued alternately, applied alternately");

        // Two tasks at once on two threads, each with its own volume: the senders contend
        // for the link's queue (whether their writes interleave is up to the scheduler).
        sink.applied.lock().unwrap().clear();
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        let tasks: Vec<_> = [a, b]
            .into_iter()
            .map(|v| {
                let link = link.clone();
                tokio::spawn(async move { write_all(&link, &[v], 120, 256 << 10).await })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        link.flush().await.unwrap();
        applied_in_order(&sink, &[a, b], 120);
    }

    #[tokio::test]
    async fn pipelined_requests_are_applied_and_answered_in_order() {
        let sink = Arc::new(Memory::default());
        let addr = start(sink.clone());
        let link = Link::connect("p1", &addr, "owner", &key()).await.unwrap();
        link.open(Uuid::nil(), 3, 0).await.unwrap();
        // Many writes in flight at once, made in ser order.
        let futs: Vec<_> = (1..=200u64).map(|s| link.write(w(s, s as u8))).collect();
        let flush = link.flush();
        let mut all = Vec::new();
        for f in futs {
            all.push(f);
        }
        for (i, f) in all.into_iter().enumerate() {
            f.await.unwrap_or_else(|e| panic!("write {}: {e}", i + 1));
        }
        flush.await.unwrap();
        link.checkpoint(Uuid::nil(), 3, 150).await.unwrap();
        assert!(
            link.window_end(Uuid::nil(), 3, 150, 180).await.unwrap(),
            "a peer of this build says it holds the window end"
        );
        let log = sink.log.lock().unwrap().clone();
        assert_eq!(log[0], "open owner 3 0");
        for s in 1..=200u64 {
            assert_eq!(
                log[s as usize],
                format!("write {s} {} {}", s * 4096, s as u8)
            );
        }
        assert_eq!(log[201], "flush");
        assert_eq!(log[202], "ckpt 150");
        assert_eq!(log[203], "ckpt 150 end 180");
        // A window end the peer cannot hold breaks the link, as a refused write does: the
        // owner must take the peer out of the vault before its window goes.
        assert!(link
            .window_end(Uuid::nil(), 3, 150, u64::MAX)
            .await
            .is_err());
        assert!(link.broken().is_some(), "the link stayed up");
    }

    /// A host about to replay asks another peer, on a link of its own, how far that peer's
    /// copies go and the newest checkpoint it was sent; a refusal is an error that leaves
    /// the link usable.
    #[tokio::test]
    async fn a_replaying_host_learns_how_far_another_peer_holds_a_volume() {
        let sink = Arc::new(Memory::default());
        let addr = start(sink.clone());
        let owner = Link::connect("p1", &addr, "owner", &key()).await.unwrap();
        owner.open(Uuid::nil(), 3, 0).await.unwrap();
        for s in 1..=5u64 {
            owner.write(w(s, s as u8)).await.unwrap();
        }
        owner.checkpoint(Uuid::nil(), 3, 2).await.unwrap();
        let other = Link::connect("p1", &addr, "p2", &key()).await.unwrap();
        let held = |upto| Holding {
            upto,
            checkpoint: 2,
        };
        assert_eq!(other.held(Uuid::nil(), 3, 2).await.unwrap(), held(5));
        assert_eq!(other.held(Uuid::nil(), 3, 9).await.unwrap(), held(9));
        let e = other.held(Uuid::nil(), 2, 0).await.unwrap_err();
        assert!(
            matches!(&e, PeerError::Absent { peer, msg } if peer == "p1" && msg.contains("generation 2")),
            "{e}"
        );
        assert!(
            other.broken().is_none(),
            "a refused question breaks nothing"
        );
        assert_eq!(other.held(Uuid::nil(), 3, 0).await.unwrap(), held(5));
    }

    /// The answer to `held` as sent, and as an older peer sends it (no checkpoint).
    #[test]
    fn a_holding_answer_reads_back_and_an_older_one_too() {
        let h = Holding {
            upto: 17,
            checkpoint: 9,
        };
        assert_eq!(Holding::decode(&h.encode()), Some(h));
        assert_eq!(
            Holding::decode("17"),
            Some(Holding {
                upto: 17,
                checkpoint: 0
            })
        );
        for bad in ["", "x", "1 2 3", "1 x", " 1"] {
            assert_eq!(Holding::decode(bad), None, "{bad:?}");
        }
    }

    #[tokio::test]
    async fn refusals_come_back_as_errors_naming_the_peer() {
        let sink = Arc::new(Memory::default());
        let addr = start(sink.clone());
        let link = Link::connect("p1", &addr, "owner", &key()).await.unwrap();
        link.open(Uuid::nil(), 5, 0).await.unwrap();
        let e = link.open(Uuid::nil(), 4, 0).await.unwrap_err();
        assert!(
            matches!(&e, PeerError::Stale { peer, .. } if peer == "p1"),
            "{e}"
        );
        let mut bad = w(1, 1);
        bad.offset = u64::MAX;
        // A refused open is an answer, not a broken connection.
        assert!(link.broken().is_none());
        // Pipelined behind a write the peer refuses, a write it takes still fails: the peer
        // lacks the one before it.
        let (a, b) = tokio::join!(link.write(bad), link.write(w(2, 2)));
        let e = a.unwrap_err();
        assert!(
            matches!(&e, PeerError::Refused { msg, .. } if msg == "no space"),
            "{e}"
        );
        assert!(matches!(b, Err(PeerError::Broken { .. })), "{b:?}");
        assert!(link.broken().is_some());
    }

    #[tokio::test]
    async fn a_wrong_host_or_a_dead_address_is_refused_at_connect() {
        let sink = Arc::new(Memory::default());
        let addr = start(sink);
        let e = Link::connect("p2", &addr, "owner", &key())
            .await
            .err()
            .unwrap();
        assert!(e.to_string().contains("\"p1\", not \"p2\""), "{e}");
        let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let dead_addr = dead.local_addr().unwrap().to_string();
        drop(dead);
        let e = Link::connect("p1", &dead_addr, "owner", &key())
            .await
            .err()
            .unwrap();
        assert!(matches!(e, PeerError::Unreachable { .. }), "{e}");
    }

    #[tokio::test]
    async fn hosts_that_do_not_know_the_pods_key_are_refused_both_ways() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let sink = Arc::new(Memory::default());
        let addr = start(sink.clone());
        let other = auth::Key::from_bytes([8; 32]);

        // An owner of another pod: it finds the peer's proof wrong and goes no further.
        let e = Link::connect("p1", &addr, "owner", &other)
            .await
            .err()
            .unwrap();
        assert!(
            matches!(&e, PeerError::Unauthenticated { peer, .. } if peer == "p1"),
            "{e}"
        );

        // An owner that ignores the peer's proof and sends a proof made with another key,
        // then a write: the peer refuses the proof, applies nothing and closes.
        let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
        match owner_handshake(&mut s, "owner", &other).await {
            wire::Msg::Reply { status, msg } => {
                assert_eq!(status, wire::Status::Failed);
                assert!(msg.contains("peer key"), "{msg}");
            }
            m => panic!("{m:?}"),
        }
        let _ = s
            .write_all(&wire::encode(1, &wire::Msg::Write(w(1, 1))))
            .await;
        let mut rest = [0u8; 1];
        assert!(!matches!(s.read(&mut rest).await, Ok(n) if n > 0));

        // Frames before the handshake: an open, a flush, a proof or a write is not applied; a
        // Hello too large to be one is not even read. Every such connection is closed.
        for first in [
            wire::encode(
                0,
                &wire::Msg::Open {
                    volume: Uuid::nil(),
                    gen: 9,
                    checkpoint: 0,
                },
            ),
            wire::encode(0, &wire::Msg::Flush),
            wire::encode(0, &wire::Msg::Proof([0; 32])),
            wire::encode(0, &wire::Msg::Write(w(2, 2))),
            wire::encode(
                0,
                &wire::Msg::Hello {
                    host: "x".repeat(wire::HANDSHAKE_BODY_MAX as usize),
                    nonce: [0; 16],
                    proof: [0; 32],
                },
            ),
        ] {
            let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
            let _ = s.write_all(&first).await;
            assert!(!matches!(s.read(&mut rest).await, Ok(n) if n > 0));
        }

        // A stranger that sends the peer its own proof back: refused (the roles differ).
        let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let hello = wire::Msg::Hello {
            host: "owner".into(),
            nonce: [1; 16],
            proof: [0; 32],
        };
        s.write_all(&wire::encode(0, &hello)).await.unwrap();
        let (_, wire::Msg::Hello { proof, .. }) = read_msg(&mut s).await else {
            panic!("no Hello back")
        };
        s.write_all(&wire::encode(0, &wire::Msg::Proof(proof)))
            .await
            .unwrap();
        assert!(matches!(
            read_msg(&mut s).await.1,
            wire::Msg::Reply {
                status: wire::Status::Failed,
                ..
            }
        ));
        assert!(sink.log.lock().unwrap().is_empty(), "a stranger got in");

        // A peer of another pod: the owner refuses it before it sends anything.
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let fake = l.local_addr().unwrap().to_string();
        let server = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let (seq, wire::Msg::Hello { host, nonce, .. }) = read_msg(&mut s).await else {
                panic!("no Hello")
            };
            let x = auth::Exchange {
                owner: &host,
                owner_nonce: &nonce,
                peer: "p9",
                peer_nonce: &[3; 16],
            };
            let hello = wire::Msg::Hello {
                host: "p9".into(),
                nonce: [3; 16],
                proof: other.prove(auth::Role::Peer, &x),
            };
            s.write_all(&wire::encode(seq, &hello)).await.unwrap();
            // The owner closes instead of sending its proof.
            let mut rest = [0u8; 1];
            assert!(!matches!(s.read(&mut rest).await, Ok(n) if n > 0));
        });
        let e = Link::connect("p9", &fake, "owner", &key())
            .await
            .err()
            .unwrap();
        assert!(
            matches!(&e, PeerError::Unauthenticated { msg, .. } if msg.contains("peer key")),
            "{e}"
        );
        server.await.unwrap();
    }

    /// A connection to `addr` from the local address `src`.
    async fn connect_from(src: &str, addr: &str) -> tokio::net::TcpStream {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.bind(format!("{src}:0").parse().unwrap()).unwrap();
        sock.connect(addr.parse().unwrap()).await.unwrap()
    }

    /// What a peer that had no place for the connection `s` said before closing it.
    async fn busy_reply(s: &mut tokio::net::TcpStream) -> String {
        let r = tokio::time::timeout(Duration::from_secs(2), read_msg(s)).await;
        match r.expect("the connection was let in") {
            (
                0,
                wire::Msg::Reply {
                    status: wire::Status::Failed,
                    msg,
                },
            ) => msg,
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn strangers_cannot_hold_the_peer_port() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let sink = Arc::new(Memory::default());
        let addr = start(sink.clone());

        // One address holds at most HANDSHAKES_PER_SOURCE places; others still get in.
        let mut silent = Vec::new();
        for _ in 0..server::HANDSHAKES_PER_SOURCE {
            silent.push(connect_from("127.0.0.5", &addr).await);
        }
        let mut s = connect_from("127.0.0.5", &addr).await;
        let why = busy_reply(&mut s).await;
        assert!(why.contains("from 127.0.0.5"), "{why}");
        let mut s = connect_from("127.0.0.6", &addr).await;
        assert!(matches!(
            owner_handshake(&mut s, "owner", &key()).await,
            wire::Msg::Reply {
                status: wire::Status::Ok,
                ..
            }
        ));
        drop(s);

        // Silent connections from many addresses fill every place; the next is closed at once.
        for i in 1..server::HANDSHAKES_MAX / server::HANDSHAKES_PER_SOURCE {
            for _ in 0..server::HANDSHAKES_PER_SOURCE {
                silent.push(connect_from(&format!("127.0.1.{i}"), &addr).await);
            }
        }
        let mut s = connect_from("127.0.2.1", &addr).await;
        let why = busy_reply(&mut s).await;
        assert!(why.contains("64 connections"), "{why}");
        drop(silent);

        // A host that trickles its Hello, a byte every 100 ms: the frame would be whole after
        // about 8 s, past the handshake's deadline, so it is never answered.
        let hello = wire::encode(
            0,
            &wire::Msg::Hello {
                host: "slow".into(),
                nonce: [0; 16],
                proof: [0; 32],
            },
        );
        let mut s = loop {
            // Until the places of the silent connections are free again.
            let mut s = connect_from("127.0.0.7", &addr).await;
            s.write_all(&hello[..1]).await.unwrap();
            let mut b = [0u8; 1];
            match tokio::time::timeout(Duration::from_millis(200), s.read(&mut b)).await {
                Err(_) => break s,
                Ok(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        };
        for b in hello[1..].iter() {
            if s.write_all(&[*b]).await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let mut rest = [0u8; 1];
        assert!(
            !matches!(s.read(&mut rest).await, Ok(n) if n > 0),
            "a trickled Hello was answered"
        );

        // A host of the pod gets in, and only it reached the sink.
        let link = Link::connect("p1", &addr, "owner", &key()).await.unwrap();
        link.open(Uuid::nil(), 1, 0).await.unwrap();
        assert_eq!(sink.log.lock().unwrap().clone(), vec!["open owner 1 0"]);
    }

    #[tokio::test]
    async fn a_host_of_another_protocol_version_is_named_as_such() {
        // What a host of another version does with this one's Hello: it cannot decode the
        // header, logs why and closes.
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let server = tokio::spawn(async move {
            use tokio::io::AsyncReadExt;
            let (mut s, _) = l.accept().await.unwrap();
            let mut head = [0u8; wire::HEADER_LEN];
            s.read_exact(&mut head).await.unwrap();
        });
        let e = Link::connect("p1", &addr, "owner", &key())
            .await
            .err()
            .unwrap();
        assert!(
            matches!(&e, PeerError::Unreachable { msg, .. } if msg.contains("another Vesta version")),
            "{e}"
        );
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_peer_that_goes_away_breaks_the_link_and_fails_waiting_requests() {
        // A "peer" that answers Hello, then reads requests without answering, then closes.
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let server = tokio::spawn(async move {
            use tokio::io::AsyncReadExt;
            let (mut s, _) = l.accept().await.unwrap();
            peer_handshake(&mut s, "p1", &key()).await;
            let mut head = [0u8; wire::HEADER_LEN];
            s.read_exact(&mut head).await.unwrap();
            // Close with the write unanswered.
        });
        let link = Link::connect("p1", &addr, "owner", &key()).await.unwrap();
        let e = link.write(w(1, 1)).await.unwrap_err();
        assert!(matches!(e, PeerError::Broken { .. }), "{e}");
        assert!(link.broken().is_some());
        // Everything after fails at once: the peer may lack what was in flight.
        let e = link.flush().await.unwrap_err();
        assert!(matches!(e, PeerError::Broken { .. }), "{e}");
        server.await.unwrap();
    }

    async fn reply(s: &mut tokio::net::TcpStream) -> wire::Msg {
        read_msg(s).await.1
    }

    /// The owner counts nothing after a refused write, so the peer applies nothing after it
    /// either: it answers the refusal and closes, leaving the writes queued behind unapplied.
    #[tokio::test]
    async fn a_refused_write_is_the_last_request_a_connection_applies() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let sink = Arc::new(Memory::default());
        let addr = start(sink.clone());
        let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
        owner_handshake(&mut s, "x", &key()).await;
        let mut bad = w(1, 1);
        bad.offset = u64::MAX;
        let mut frames = Vec::new();
        for (seq, m) in [
            wire::Msg::Write(w(1, 1)),
            wire::Msg::Write(bad),
            wire::Msg::Write(w(2, 2)),
        ]
        .into_iter()
        .enumerate()
        {
            frames.extend_from_slice(&wire::encode(seq as u64, &m));
        }
        s.write_all(&frames).await.unwrap();
        for want in [wire::Status::Ok, wire::Status::Failed] {
            match reply(&mut s).await {
                wire::Msg::Reply { status, msg } => assert_eq!(status, want, "{msg}"),
                other => panic!("{other:?}"),
            }
        }
        let mut rest = [0u8; 1];
        assert!(
            !matches!(s.read(&mut rest).await, Ok(n) if n > 0),
            "the connection goes on after a refused write"
        );
        let log = sink.log.lock().unwrap().clone();
        assert_eq!(log, vec!["write 1 4096 1".to_string()]);
    }

    #[tokio::test]
    async fn a_damaged_frame_closes_the_connection() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let sink = Arc::new(Memory::default());
        let addr = start(sink.clone());
        let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
        owner_handshake(&mut s, "x", &key()).await;
        let mut f = wire::encode(2, &wire::Msg::Write(w(1, 7))).to_vec();
        let last = f.len() - 1;
        f[last] ^= 0x40; // payload bit flip
        s.write_all(&f).await.unwrap();
        match reply(&mut s).await {
            wire::Msg::Reply { status, msg } => {
                assert_eq!(status, wire::Status::Failed);
                assert!(msg.contains("checksum"), "{msg}");
            }
            other => panic!("{other:?}"),
        }
        // Then the connection ends (EOF, or a reset).
        let mut rest = [0u8; 1];
        assert!(!matches!(s.read(&mut rest).await, Ok(n) if n > 0));
        assert!(!sink
            .log
            .lock()
            .unwrap()
            .iter()
            .any(|l| l.starts_with("write")));
    }

    /// A sink whose writes need room that only a checkpoint frees, as a real peer's replica
    /// share: a write above `room_upto` waits (up to 3 s) for a checkpoint to raise it.
    #[derive(Default)]
    struct Share {
        room_upto: Mutex<u64>,
        /// How long an `Open` takes (frames sent meanwhile queue behind it).
        open_takes: Mutex<Duration>,
    }

    impl Sink for Share {
        fn host(&self) -> String {
            "p1".into()
        }
        fn open(&self, _f: &str, _v: Uuid, _g: u64, _c: u64) -> Result<(), Refusal> {
            std::thread::sleep(*self.open_takes.lock().unwrap());
            Ok(())
        }
        fn write(&self, _from: &str, w: WriteMsg) -> Result<(), Refusal> {
            let started = std::time::Instant::now();
            while w.ser > *self.room_upto.lock().unwrap() {
                if started.elapsed() > Duration::from_secs(3) {
                    return Err(Refusal::Failed("no checkpoint freed room".into()));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Ok(())
        }
        fn write_at_once(&self, _from: &str, w: &WriteMsg) -> Option<Result<(), Refusal>> {
            (w.ser <= *self.room_upto.lock().unwrap()).then_some(Ok(()))
        }
        fn flush(&self) -> Result<(), Refusal> {
            Ok(())
        }
        fn checkpoint(&self, _v: Uuid, _g: u64, ser: u64, _e: u64) -> Result<(), Refusal> {
            *self.room_upto.lock().unwrap() = ser + 1;
            Ok(())
        }
        fn drop_replicas(&self, _v: Uuid, _g: u64) -> Result<(), Refusal> {
            Ok(())
        }
        fn held(&self, _v: Uuid, _g: u64, from: u64) -> Result<Holding, Refusal> {
            Ok(Holding {
                upto: from,
                checkpoint: 0,
            })
        }
    }

    /// A link to a peer serving a [`Share`] with room for write 1 only, whose `Open` takes
    /// `open_takes`.
    async fn share_link(open_takes: Duration) -> Link {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let sink = Arc::new(Share::default());
        *sink.room_upto.lock().unwrap() = 1;
        *sink.open_takes.lock().unwrap() = open_takes;
        serve(l, sink, key()).unwrap();
        Link::connect("p1", &addr, "owner", &key()).await.unwrap()
    }

    /// Write `ser` of `len` bytes, at `ser × len`.
    fn share_write(ser: u64, len: u64) -> WriteMsg {
        WriteMsg {
            volume: Uuid::nil(),
            gen: 1,
            ser,
            offset: ser * len,
            len,
            data: Some(Bytes::from(vec![1u8; len as usize])),
            alloc: false,
        }
    }

    /// A write waiting for room in its share waits for the owner's next checkpoint, which the
    /// owner sends on the same connection, behind the write: the peer applies it as it reads
    /// it, so the write goes on. Applied in turn, the checkpoint stayed behind the write until
    /// the wait gave up, the write was refused and the owner dropped the peer. So it was with
    /// a FLUSH (the owner's destager sends one for the writes of a window before the window,
    /// and the checkpoint after it): it covers only writes this peer answered, and is
    /// answered without waiting for the write queued ahead of it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_checkpoint_reaches_a_write_waiting_for_room_behind_it() {
        let link = share_link(Duration::ZERO).await;
        let w = |ser| share_write(ser, 4096);
        link.write(w(1)).await.unwrap();
        let waiting = {
            let link = link.clone();
            tokio::spawn(async move { link.write(w(2)).await })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        let flush = {
            let link = link.clone();
            tokio::spawn(async move { link.flush().await })
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            !waiting.is_finished(),
            "write 2 had room before the checkpoint"
        );
        tokio::time::timeout(Duration::from_secs(2), flush)
            .await
            .expect("the FLUSH waited for the write waiting for room")
            .unwrap()
            .expect("the FLUSH failed");
        assert!(!waiting.is_finished());
        link.checkpoint(Uuid::nil(), 1, 1).await.unwrap();
        waiting
            .await
            .unwrap()
            .expect("the write waiting for room was refused");
        link.flush().await.unwrap();
    }

    /// A checkpoint is not held behind writes that wait for the owner's byte budget: with
    /// the budget full of writes the peer cannot take until a checkpoint frees room, it
    /// waited in line behind them, until the peer refused the write it held and the owner
    /// dropped the peer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_checkpoint_does_not_wait_behind_writes_that_fill_the_budget() {
        let link = share_link(Duration::ZERO).await;
        let n = (crate::client::IN_FLIGHT_BYTES >> 20) as u64 + 8;
        let writes: Vec<_> = (1..=n)
            .map(|ser| {
                let link = link.clone();
                tokio::spawn(async move { link.write(share_write(ser, 1 << 20)).await })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(300)).await;
        tokio::time::timeout(Duration::from_secs(2), link.checkpoint(Uuid::nil(), 1, n))
            .await
            .expect("the checkpoint waited behind the writes")
            .unwrap();
        for w in writes {
            w.await.unwrap().expect("a write was refused");
        }
    }

    /// Answers buffered ahead of a write that waits for room are sent before it waits: the
    /// owner needs them to complete the writes its next checkpoint covers. Here write 1 and
    /// write 2 queue behind a slow `Open`; write 1 has room, write 2 waits for a checkpoint.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn answers_ahead_of_a_write_waiting_for_room_are_not_held_back() {
        let link = share_link(Duration::from_millis(200)).await;
        let w = |ser| share_write(ser, 4096);
        let open = {
            let link = link.clone();
            tokio::spawn(async move { link.open(Uuid::nil(), 1, 0).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        let first = {
            let link = link.clone();
            tokio::spawn(async move { link.write(w(1)).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        let waiting = {
            let link = link.clone();
            tokio::spawn(async move { link.write(w(2)).await })
        };
        // Write 2 gives up after 3 s without a checkpoint: write 1's answer comes well before.
        tokio::time::timeout(Duration::from_millis(2500), first)
            .await
            .expect("write 1's answer waited behind write 2")
            .unwrap()
            .unwrap();
        open.await.unwrap().unwrap();
        assert!(!waiting.is_finished());
        link.checkpoint(Uuid::nil(), 1, 1).await.unwrap();
        waiting.await.unwrap().unwrap();
    }
}
