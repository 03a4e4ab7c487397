//! The `nbd` crate's client against a real server (nbdkit): pipelining, reconnects, and the
//! durability report when a connection dies holding acknowledged, unflushed writes.

use bytes::Bytes;
use nbd::client::{Client, ClientError};
use nbd::uri::NbdUri;
use vesta_tests::Nbdkit;

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

/// Every volume on a LUN shares one client: a lost write must fail the next flush of each
/// of them, not only of the first to flush (which may be another volume's destager, while
/// the one whose write was lost then tells its VM the write is durable).
#[test]
fn a_lost_write_fails_the_next_flush_of_every_user_of_the_client() {
    use std::sync::atomic::AtomicU64;
    let mut k = Nbdkit::start(16 << 20, &[], &[]);
    rt().block_on(async {
        let c = Client::connect(&NbdUri::parse(&k.uri()).unwrap(), 1)
            .await
            .unwrap();
        let (x, y) = (AtomicU64::new(c.losses()), AtomicU64::new(c.losses()));
        c.write(4096, Bytes::from(vec![2u8; 4096]), false)
            .await
            .unwrap();
        k.restart();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while c.read(0, 512).await.is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "the client should reconnect"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        for (who, seen) in [("y", &y), ("x", &x)] {
            match c.flush_for(seen).await {
                Err(ClientError::Server(nbd::Errno::EIO)) => {}
                other => panic!("{who}'s flush after the loss must fail with EIO: {other:?}"),
            }
        }
        // Once each.
        c.flush_for(&x).await.unwrap();
        c.flush_for(&y).await.unwrap();
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
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while c.read(0, 512).await.is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "the client should reconnect"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
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
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while c.read(0, 512).await.is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "the client should reconnect"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        c.flush().await.unwrap();
    });
}
