//! The `nbd` crate's client against a real server (nbdkit): pipelining, reconnects, and the
//! durability report when a connection dies holding acknowledged, unflushed writes.

use bytes::Bytes;
use nbd::client::{Client, ClientError};
use nbd::uri::NbdUri;
use vesta_tests::Nbdkit;

/// Waits (up to 5 s) until `read_works` says a read goes through again: requests notice a
/// restarted server's dead connection and reconnect once the new one accepts.
async fn reconnected<F: std::future::Future<Output = bool>>(mut read_works: impl FnMut() -> F) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while !read_works().await {
        assert!(
            std::time::Instant::now() < deadline,
            "the client should reconnect"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn pipelined_requests_complete_and_read_back() {
    let k = Nbdkit::start(64 << 20, &[], &[]);
    rt().block_on(async {
        let c = std::sync::Arc::new(
            Client::connect(&NbdUri::parse(&k.uri()).unwrap(), 2)
                .await
                .unwrap(),
        );
        assert_eq!(c.export().size, 64 << 20);
        let tasks: Vec<_> = (0..64u64)
            .map(|i| {
                let c = c.clone();
                tokio::spawn(async move {
                    c.write(i * 4096, Bytes::from(vec![i as u8; 4096]), i % 7 == 0)
                        .await
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap().unwrap();
        }
        c.flush().await.unwrap();
        for i in 0..64u64 {
            assert_eq!(c.read(i * 4096, 4096).await.unwrap(), vec![i as u8; 4096]);
        }
        // Larger than the 32 MiB request limit: split into several requests and reassembled.
        let big = vesta_tests::pattern(3, 40 << 20);
        c.write(1 << 20, Bytes::from(big.clone()), false)
            .await
            .unwrap();
        assert!(c.read(1 << 20, 40 << 20).await.unwrap() == big);
    });
}

/// Two FLUSHes of one volume in flight when a loss is found both fail: if only the first
/// to finish did, the VM would take the second as proof that the lost write is durable (a
/// journal commit waiting on it goes ahead). Both run on one extent, as two requests of a
/// VM's NBD connection do.
#[test]
fn two_flushes_in_flight_on_one_volume_both_hear_of_a_lost_write() {
    use datastore::device::NbdDevice;
    use datastore::{Extent, Gate};
    use std::sync::Arc;
    let mut k = Nbdkit::start(16 << 20, &[], &[]);
    rt().block_on(async {
        let uri = NbdUri::parse(&k.uri()).unwrap();
        let dev = Arc::new(NbdDevice::connect(&uri, 1).await.unwrap());
        let a = Extent::new(dev.clone(), 0, 1 << 20, Arc::new(Gate::new(4)));
        a.write(0, Bytes::from(vec![1u8; 4096]), false)
            .await
            .unwrap();
        k.restart();
        reconnected(|| async { a.read(0, 512).await.is_ok() }).await;
        let eio = |r: &std::io::Result<()>| {
            r.as_ref()
                .is_err_and(|e| e.raw_os_error() == Some(libc::EIO))
        };
        let (x, y) = tokio::join!(a.flush(), a.flush());
        assert!(
            eio(&x) && eio(&y),
            "both flushes must report the loss: {x:?} {y:?}"
        );
        a.flush().await.unwrap();
        // A write sent after the loss was counted is not reported.
        a.write(4096, Bytes::from(vec![2u8; 4096]), false)
            .await
            .unwrap();
        a.flush().await.unwrap();
    });
}

/// A unix-socket proxy in front of nbdkit whose connections a test can hold silent (no
/// byte through, no end: a server host that died) and then close, one by one, in the order
/// they were accepted.
struct UnixProxy {
    path: std::path::PathBuf,
    conns: std::sync::Arc<std::sync::Mutex<Vec<ProxyConn>>>,
}

struct ProxyConn {
    silent: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Bytes that arrived while the connection was silent (held back, never delivered).
    held: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    /// Chunks passed from the server to the client so far (counted before each is passed).
    answers: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    /// Ends the connection right after the chunk of this number reaches the client (0: never),
    /// as a server that answers and then shuts down does.
    end_after: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    sides: [std::os::unix::net::UnixStream; 2],
}

impl UnixProxy {
    fn start(path: std::path::PathBuf, upstream: std::path::PathBuf) -> UnixProxy {
        use std::os::unix::net::{UnixListener, UnixStream};
        use std::sync::atomic::{AtomicBool, Ordering};
        let l = UnixListener::bind(&path).unwrap();
        let conns = std::sync::Arc::new(std::sync::Mutex::new(Vec::<ProxyConn>::new()));
        let cs = conns.clone();
        std::thread::spawn(move || {
            for c in l.incoming() {
                let Ok(c) = c else { continue };
                let Ok(u) = UnixStream::connect(&upstream) else {
                    continue;
                };
                let silent = std::sync::Arc::new(AtomicBool::new(false));
                let held = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
                let answers = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
                let end = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
                cs.lock().unwrap().push(ProxyConn {
                    silent: silent.clone(),
                    held: held.clone(),
                    answers: answers.clone(),
                    end_after: end.clone(),
                    sides: [c.try_clone().unwrap(), u.try_clone().unwrap()],
                });
                let up = (c.try_clone().unwrap(), u.try_clone().unwrap());
                for (downstream, (mut from, mut to)) in [(false, up), (true, (u, c))] {
                    let (silent, held) = (silent.clone(), held.clone());
                    let (answers, end) = (answers.clone(), end.clone());
                    std::thread::spawn(move || {
                        use std::io::{Read, Write};
                        let mut buf = vec![0u8; 64 << 10];
                        while let Ok(n @ 1..) = from.read(&mut buf) {
                            if silent.load(Ordering::SeqCst) {
                                held.fetch_add(n, Ordering::SeqCst);
                            }
                            while silent.load(Ordering::SeqCst) {
                                std::thread::sleep(std::time::Duration::from_millis(10));
                            }
                            // Counted before the client can have it, so a test that saw an
                            // answer and then asks to end after the next one is not early.
                            let nth = if downstream {
                                answers.fetch_add(1, Ordering::SeqCst) + 1
                            } else {
                                0
                            };
                            if to.write_all(&buf[..n]).is_err() {
                                break;
                            }
                            let last = end.load(Ordering::SeqCst);
                            if downstream && last != 0 && nth >= last {
                                let _ = from.shutdown(std::net::Shutdown::Both);
                                break;
                            }
                        }
                        let _ = to.shutdown(std::net::Shutdown::Both);
                    });
                }
            }
        });
        UnixProxy { path, conns }
    }

    fn uri(&self) -> String {
        format!("nbd+unix:///?socket={}", self.path.display())
    }

    fn silence(&self, i: usize) {
        let c = &self.conns.lock().unwrap()[i];
        c.silent.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Ends connection `i` right after the server's next answer on it reaches the client.
    fn end_after_next_answer(&self, i: usize) {
        use std::sync::atomic::Ordering::SeqCst;
        let c = &self.conns.lock().unwrap()[i];
        c.end_after.store(c.answers.load(SeqCst) + 1, SeqCst);
    }

    fn close(&self, i: usize) {
        for s in &self.conns.lock().unwrap()[i].sides {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// nbdkit behind a [`UnixProxy`], and a 1 MiB extent on it through Vesta's NBD device.
struct ProxiedLun {
    proxy: UnixProxy,
    _dir: vesta_tests::Scratch,
    _lun: Nbdkit,
}

impl ProxiedLun {
    fn start(tag: &str) -> ProxiedLun {
        let lun = Nbdkit::start(16 << 20, &[], &[]);
        let dir = vesta_tests::Scratch::new(tag);
        let upstream = lun.uri().rsplit_once("socket=").unwrap().1.to_owned();
        let proxy = UnixProxy::start(dir.join("proxy.sock"), upstream.into());
        ProxiedLun {
            proxy,
            _dir: dir,
            _lun: lun,
        }
    }

    /// An extent on a device with a pool of `pool` connections through the proxy.
    async fn extent(&self, pool: usize) -> datastore::Extent {
        use std::sync::Arc;
        let uri = NbdUri::parse(&self.proxy.uri()).unwrap();
        let dev = Arc::new(
            datastore::device::NbdDevice::connect(&uri, pool)
                .await
                .unwrap(),
        );
        datastore::Extent::new(dev, 0, 1 << 20, Arc::new(datastore::Gate::new(4)))
    }
}

/// A pool of two connections: a write acknowledged on the first, then the server dies, and
/// the client notices on the second connection first (the first one hears nothing, as from a
/// host that crashed). A FLUSH answered on the second connection's replacement reaches a new
/// server, not the one that held the write: it must not count for it. Before, it did, and
/// the flush returned OK at once; the write was never reported. Now the first connection gets
/// a FLUSH of its own, which fails when that connection's end is found.
#[test]
fn a_flush_after_a_reconnect_covers_the_writes_of_every_connection() {
    let lun = ProxiedLun::start("unixproxy");
    let proxy = &lun.proxy;
    rt().block_on(async {
        let a = lun.extent(2).await;
        // Requests take the pool's connections in turn: 0 (opened by connect), then 1.
        a.write(0, Bytes::from(vec![1u8; 4096]), false)
            .await
            .unwrap();
        a.read(0, 4096).await.unwrap();
        a.read(0, 4096).await.unwrap();
        assert_eq!(proxy.conns.lock().unwrap().len(), 2, "a pool of two");
        proxy.silence(0);
        proxy.close(1);
        // Time for the client to notice the second connection's end, so that it is the
        // one replaced (the first stays silent, and is not).
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        // The silent connection ends once a request reached it (the FLUSH of its own the
        // flush must send it), not before: then the flush cannot be answered from it.
        let flushing = tokio::spawn({
            let a = a.clone();
            async move { a.flush().await }
        });
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while !flushing.is_finished() {
            assert!(std::time::Instant::now() < deadline, "the flush hangs");
            let held = proxy.conns.lock().unwrap()[0]
                .held
                .load(std::sync::atomic::Ordering::SeqCst);
            if held > 0 {
                proxy.close(0);
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        let r = flushing.await.unwrap();
        assert!(
            r.is_err(),
            "the write on the silent connection was taken as flushed"
        );
        // That flush failed without an answer, so its write is still owed a report: the
        // loss, once; then the client goes on with new connections.
        let r = a.flush().await;
        assert!(
            r.as_ref()
                .is_err_and(|e| e.raw_os_error() == Some(libc::EIO)),
            "{r:?}"
        );
        a.flush().await.unwrap();
        a.write(4096, Bytes::from(vec![2u8; 4096]), false)
            .await
            .unwrap();
        a.flush().await.unwrap();
    });
}

/// A server that answers a FLUSH and then closes the connection (a graceful restart) lost
/// nothing the FLUSH covered: the client must not count a loss (which would fail the next
/// flush with EIO, and make a VM's file system give up) just because the connection's end
/// was read before the flush's task took the answer.
#[test]
fn a_server_that_answers_a_flush_and_then_closes_lost_nothing() {
    let lun = ProxiedLun::start("unixproxy-end");
    let proxy = &lun.proxy;
    rt().block_on(async {
        let a = lun.extent(1).await;
        for round in 0..20u8 {
            a.write(0, Bytes::from(vec![round; 4096]), false)
                .await
                .unwrap();
            proxy.end_after_next_answer(usize::from(round));
            a.flush().await.unwrap();
            reconnected(|| async { a.read(0, 512).await.is_ok() }).await;
            a.flush().await.unwrap_or_else(|e| {
                panic!("round {round}: a loss was counted for a flushed write: {e}")
            });
        }
    });
}

/// A write answered right before the connection ends (answer and end in one read, as when a
/// server answers and then dies) was not flushed, so it may be lost: the next flush says so.
/// The reader numbers each write as it takes the answer, before it can read the end.
#[test]
fn a_write_answered_just_before_the_connection_ends_is_reported() {
    let lun = ProxiedLun::start("unixproxy-write");
    let proxy = &lun.proxy;
    rt().block_on(async {
        let a = lun.extent(1).await;
        for round in 0..10u8 {
            a.flush().await.unwrap();
            proxy.end_after_next_answer(usize::from(round));
            a.write(0, Bytes::from(vec![round; 4096]), false)
                .await
                .unwrap();
            reconnected(|| async { a.read(0, 512).await.is_ok() }).await;
            let r = a.flush().await;
            assert!(
                r.as_ref()
                    .is_err_and(|e| e.raw_os_error() == Some(libc::EIO)),
                "round {round}: {r:?}"
            );
        }
    });
}

/// The datastore layer's fence reaches into the client: a write that waited out a
/// reconnect is asked again right before it is sent, and one the guard refuses never
/// reaches the server (a host whose lease lapsed meanwhile must not write).
#[test]
fn a_write_the_guard_refuses_is_not_sent_even_after_a_reconnect() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let mut k = Nbdkit::start(16 << 20, &[], &[]);
    rt().block_on(async {
        let c = Client::connect(&NbdUri::parse(&k.uri()).unwrap(), 1)
            .await
            .unwrap();
        let open = std::sync::Arc::new(AtomicBool::new(true));
        let o = open.clone();
        c.set_write_guard(std::sync::Arc::new(move || {
            (!o.load(Ordering::SeqCst)).then(|| "fenced".to_string())
        }));
        c.write(0, Bytes::from(vec![1u8; 4096]), false)
            .await
            .unwrap();
        k.restart();
        open.store(false, Ordering::SeqCst);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            match c.write(4096, Bytes::from(vec![2u8; 4096]), false).await {
                Err(ClientError::Held(why)) => {
                    assert_eq!(why, "fenced");
                    break;
                }
                Ok(()) => panic!("a write went out while the guard said no"),
                Err(_) => {} // the old connection's end, noticed by this request
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the client should reconnect"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        assert!(matches!(
            c.write_zeroes(0, 4096, false).await,
            Err(ClientError::Held(_))
        ));
        assert!(c.read(0, 8192).await.unwrap()[..]
            .iter()
            .enumerate()
            .all(|(i, b)| *b == if i < 4096 { 1 } else { 0 }));
        open.store(true, Ordering::SeqCst);
        c.write(4096, Bytes::from(vec![2u8; 4096]), false)
            .await
            .unwrap();
    });
}

/// Two volumes' extents on one LUN. A lost write is reported to the extent that wrote it,
/// both to Vesta's own flushes (the destager's, a switch's) and, separately, to its clients:
/// Vesta's flush hearing first must not use up the report a VM's FLUSH is owed. An extent
/// whose writes were all flushed before the loss hears nothing: its data is safe, and an
/// EIO would only make its VM's file system give up.
#[test]
fn a_lost_write_reaches_the_volumes_clients_and_spares_a_volume_with_none_unflushed() {
    use datastore::device::NbdDevice;
    use datastore::{Extent, Gate};
    use std::sync::Arc;
    let mut k = Nbdkit::start(16 << 20, &[], &[]);
    rt().block_on(async {
        let uri = NbdUri::parse(&k.uri()).unwrap();
        let dev = Arc::new(NbdDevice::connect(&uri, 1).await.unwrap());
        let gate = Arc::new(Gate::new(4));
        let a = Extent::new(dev.clone(), 0, 1 << 20, gate.clone());
        let idle = Extent::new(dev.clone(), 1 << 20, 1 << 20, gate.clone());
        idle.write(0, Bytes::from(vec![9u8; 4096]), false)
            .await
            .unwrap();
        idle.flush().await.unwrap();
        idle.flush_internal().await.unwrap();
        a.write(0, Bytes::from(vec![1u8; 4096]), false)
            .await
            .unwrap();
        k.restart();
        reconnected(|| async { a.read(0, 512).await.is_ok() }).await;
        let eio = |r: std::io::Result<()>| r.is_err_and(|e| e.raw_os_error() == Some(libc::EIO));
        assert!(
            eio(a.flush_internal().await),
            "Vesta's own flush hears of the loss"
        );
        assert!(eio(a.flush().await), "and so does the VM's, after it");
        a.flush().await.unwrap();
        a.flush_internal().await.unwrap();
        idle.flush().await.unwrap();
        idle.flush_internal().await.unwrap();
    });
}

/// A FLUSH the server fails may have lost acknowledged writes (a write-back error), and a
/// server backed by a file hears of that in one `fsync` only: its next FLUSH answers OK. So
/// the failure is counted as a loss. Every volume on the LUN with writes the failed FLUSH
/// may have taken hears of it at its next flush (a destager would otherwise record a
/// checkpoint over them); one whose writes were all flushed before hears nothing.
#[test]
fn a_failed_flush_is_a_loss_every_volume_with_unflushed_writes_hears_of() {
    use datastore::device::NbdDevice;
    use datastore::{Extent, Gate};
    use std::sync::Arc;
    let (k, errors) = Nbdkit::start_failing_flushes(4 << 20);
    rt().block_on(async {
        let uri = NbdUri::parse(&k.uri()).unwrap();
        let dev = Arc::new(NbdDevice::connect(&uri, 1).await.unwrap());
        let gate = Arc::new(Gate::new(4));
        let a = Extent::new(dev.clone(), 0, 1 << 20, gate.clone());
        let b = Extent::new(dev.clone(), 1 << 20, 1 << 20, gate.clone());
        let idle = Extent::new(dev.clone(), 2 << 20, 1 << 20, gate.clone());
        idle.write(0, Bytes::from(vec![9u8; 4096]), false)
            .await
            .unwrap();
        idle.flush().await.unwrap();
        idle.flush_internal().await.unwrap();
        a.write(0, Bytes::from(vec![1u8; 4096]), false)
            .await
            .unwrap();
        b.write(0, Bytes::from(vec![2u8; 4096]), false)
            .await
            .unwrap();
        errors.on();
        let e = a.flush_internal().await.expect_err("the server fails it");
        assert_eq!(e.raw_os_error(), Some(libc::EIO));
        errors.off();
        let eio = |r: std::io::Result<()>| r.is_err_and(|e| e.raw_os_error() == Some(libc::EIO));
        assert!(
            eio(b.flush_internal().await),
            "b's write may be gone though the server now answers OK"
        );
        assert!(eio(b.flush().await), "and b's clients hear of it too");
        b.flush_internal().await.unwrap();
        idle.flush_internal().await.unwrap();
        idle.flush().await.unwrap();
        // The client alone: a failed FLUSH is followed by one EIO, then none.
        let c = Client::connect(&uri, 1).await.unwrap();
        c.write(0, Bytes::from(vec![3u8; 4096]), false)
            .await
            .unwrap();
        errors.on();
        assert!(c.flush().await.is_err());
        errors.off();
        match c.flush().await {
            Err(ClientError::Server(nbd::Errno::EIO)) => {}
            other => panic!("the flush after a failed one must report the loss: {other:?}"),
        }
        c.flush().await.unwrap();
        // A failed FLUSH counts even when a FLUSH covered every write answered before it:
        // a write not yet answered may have been in the pages its error took, and another
        // FLUSH may have taken the error meant for it.
        let before = c.losses();
        errors.on();
        assert!(c.flush().await.is_err());
        errors.off();
        assert_eq!(c.losses(), before + 1);
    });
}

/// Two FLUSHes run side by side on one connection (two volumes flush at once). The server's
/// write-back error goes to one of them, which answers late; the other answers OK first,
/// though the error it would have reported was taken: its OK waits for the other's answer
/// and becomes EIO. Without that the second volume's destager would record a checkpoint
/// over writes the server lost.
#[test]
fn a_flush_that_answers_ok_beside_a_failing_one_reports_the_loss() {
    use datastore::device::NbdDevice;
    use datastore::{Extent, Gate};
    use std::sync::Arc;
    use std::time::Duration;
    let (k, errors) = Nbdkit::start_failing_flushes(4 << 20);
    rt().block_on(async {
        let uri = NbdUri::parse(&k.uri()).unwrap();
        let dev = Arc::new(NbdDevice::connect(&uri, 1).await.unwrap());
        let a = Extent::new(dev.clone(), 0, 1 << 20, Arc::new(Gate::new(4)));
        let b = Extent::new(dev.clone(), 1 << 20, 1 << 20, Arc::new(Gate::new(4)));
        a.write(0, Bytes::from(vec![1u8; 4096]), false)
            .await
            .unwrap();
        b.write(0, Bytes::from(vec![2u8; 4096]), false)
            .await
            .unwrap();
        errors.once();
        let started = std::time::Instant::now();
        let (ra, rb) = tokio::join!(a.flush_internal(), async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let r = b.flush_internal().await;
            (r, started.elapsed())
        });
        let (rb, b_took) = rb;
        assert!(ra.is_err(), "a's FLUSH took the error");
        let eio = |r: &std::io::Result<()>| {
            r.as_ref()
                .is_err_and(|e| e.raw_os_error() == Some(libc::EIO))
        };
        assert!(
            eio(&rb),
            "b's FLUSH answered OK beside the one that took the error: {rb:?}"
        );
        assert!(
            b_took >= Duration::from_millis(450),
            "b's answer did not wait for a's ({b_took:?})"
        );
        // A failed flush answers for none of its writes, so each hears of the loss once
        // more at its next flush (as after any failed flush), and then no more.
        for x in [&a, &b] {
            assert!(eio(&x.flush_internal().await));
            x.flush_internal().await.unwrap();
        }
    });
}

/// Holding a sync's answer for the syncs beside it never turns a healthy server's OK into an
/// error: many FUA writes, plain writes and FLUSHes in flight at once on a pool of two
/// connections (nbdkit's `file` plugin runs them in parallel) all succeed, and no loss is
/// counted.
#[test]
fn syncs_in_flight_together_on_a_healthy_server_all_succeed() {
    let k = Nbdkit::start(64 << 20, &[], &[]);
    rt().block_on(async {
        let c = std::sync::Arc::new(
            Client::connect(&NbdUri::parse(&k.uri()).unwrap(), 2)
                .await
                .unwrap(),
        );
        let tasks: Vec<_> = (0..32u64)
            .map(|t| {
                let c = c.clone();
                tokio::spawn(async move {
                    for i in 0..100u64 {
                        let off = ((t * 100 + i) % 16384) * 4096;
                        let data = Bytes::from(vec![(t + i) as u8; 4096]);
                        match i % 4 {
                            0 => c.flush_acked().await?,
                            1 => c.write(off, data, false).await?,
                            _ => c.write(off, data, true).await?,
                        }
                    }
                    Ok::<(), ClientError>(())
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap().expect("every request succeeds");
        }
        c.flush().await.expect("no loss was counted");
        assert_eq!(c.losses(), 0);
    });
}

#[test]
fn a_lost_connection_with_unflushed_writes_fails_the_next_flush_once() {
    let mut k = Nbdkit::start(16 << 20, &[], &[]);
    rt().block_on(async {
        let c = Client::connect(&NbdUri::parse(&k.uri()).unwrap(), 1)
            .await
            .unwrap();
        c.write(0, Bytes::from(vec![1u8; 4096]), false)
            .await
            .unwrap();
        c.flush().await.unwrap();
        // Acknowledged but not flushed, then the server goes away.
        c.write(4096, Bytes::from(vec![2u8; 4096]), false)
            .await
            .unwrap();
        k.restart();
        // Requests notice the dead connection and reconnect (once the new server accepts).
        reconnected(|| async { c.read(0, 512).await.is_ok() }).await;
        match c.flush().await {
            Err(ClientError::Server(nbd::Errno::EIO)) => {}
            other => panic!("flush after losing unflushed writes must fail with EIO: {other:?}"),
        }
        // Reported once, like fsync; writes made since are covered normally.
        c.write(8192, Bytes::from(vec![3u8; 4096]), false)
            .await
            .unwrap();
        c.flush().await.unwrap();
        // A write with FUA needs no flush, so losing its connection loses nothing.
        c.write(12288, Bytes::from(vec![4u8; 4096]), true)
            .await
            .unwrap();
        k.restart();
        reconnected(|| async { c.read(0, 512).await.is_ok() }).await;
        c.flush().await.unwrap();
    });
}
