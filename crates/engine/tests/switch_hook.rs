//! A policy switch whose hook (the owner's vault write) fails must not let writes complete
//! until the new generation is recorded: the vault may still name peers of the old one, and
//! a replay of their replicas would go over anything written meanwhile. Reads go on.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use cachelog::device::SimDevice;
use cluster::Policy;
use datastore::device::MemDevice;
use uuid::Uuid;

mod common;
use common::{Yes, BLOCK, SEG, VOL};

fn failing_hook() -> engine::SwitchHook {
    Box::new(|_gen, _checkpoint| Box::pin(async { Err("etcd: unavailable".to_string()) }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_wait_after_a_failed_switch_hook_until_released() {
    let cache = Arc::new(SimDevice::new((1 << 20) + 16 * SEG));
    let store = Arc::new(MemDevice::new(VOL));
    let (host, vol) = common::open(cache, &store, Uuid::new_v4(), Policy::Wb);
    let vol = Arc::new(vol);
    vol.write(0, Bytes::from(vec![0x41; BLOCK]), false)
        .await
        .unwrap();
    let destager = {
        let h = host.clone();
        tokio::spawn(async move { h.run_destager(|| false).await })
    };

    // Without peers a failed hook holds nothing: no vault names anyone who could replay.
    let e = vol
        .set_policy_with(Policy::Wt, None, Some(failing_hook()))
        .await
        .unwrap_err();
    assert!(!vol.writes_held(), "{e}");
    vol.write(BLOCK as u64, Bytes::from(vec![0x40; BLOCK]), false)
        .await
        .unwrap();
    // In wbp, leaving it with a hook that fails.
    let wbp = Policy::Wbp {
        peers: 1,
        rule: cluster::PeerRule::default(),
    };
    vol.set_policy_with(wbp, Some(Arc::new(Yes)), None)
        .await
        .unwrap();
    let e = vol
        .set_policy_with(Policy::Wt, None, Some(failing_hook()))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("held"), "{e}");
    assert_eq!(vol.policy(), Policy::Wt);
    assert!(vol.writes_held());

    // A write waits; reads do not.
    let write = {
        let v = vol.clone();
        tokio::spawn(async move { v.write(0, Bytes::from(vec![0x42; BLOCK]), false).await })
    };
    let got = tokio::time::timeout(Duration::from_secs(5), vol.read(0, BLOCK as u32))
        .await
        .expect("a read waited on held writes")
        .unwrap();
    assert!(got[..] == [0x41; BLOCK]);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !write.is_finished(),
        "a write completed before the new generation was recorded"
    );
    assert_eq!(store.image()[..BLOCK], [0x41; BLOCK]);

    // Recorded: the write goes on, through to the datastore.
    assert!(vol.release_writes());
    tokio::time::timeout(Duration::from_secs(5), write)
        .await
        .expect("the write went on once released")
        .unwrap()
        .unwrap();
    assert_eq!(store.image()[..BLOCK], [0x42; BLOCK]);
    destager.abort();
}
