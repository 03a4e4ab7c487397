//! `wbp`: write-back with peers (DESIGN §4, FVP §3 and §7, Table 1), with real processes:
//! `vestad` hosts on their own loopback addresses, one etcd, an nbdkit LUN as the shared
//! datastore. Writes are checked on the datastore image itself, so what a test sees is what
//! a VM restarted anywhere would see.

use std::sync::Mutex;
use std::time::Duration;

use serde_json::Value;
use vesta_tests::checker::{
    assert_holds_completed, assert_holds_durable, campaign, reset_to, settle_to, Checker, Known,
    PolicyChanger, Xorshift, BLOCK, BLOCKS,
};
use vesta_tests::{
    qemu_io, read_file, wait_for, Etcd, Host, Nbdkit, Vestad, CLUSTER_TTL_S, LUN_EXTENT,
};

const TTL_S: u64 = CLUSTER_TTL_S;

fn host(etcd: &Etcd, name: &str, fault_domain: &str, ip: &str, lun: &Nbdkit) -> Vestad {
    etcd.host(lun, Host::new(name, fault_domain, ip))
}

/// A host whose peer listener other hosts reach only through a fault proxy on `proxy_ip`.
fn host_behind_proxy(
    etcd: &Etcd,
    name: &str,
    fault_domain: &str,
    ip: &str,
    proxy_ip: &str,
    lun: &Nbdkit,
) -> (Vestad, vesta_tests::proxy::FaultProxy) {
    let listen = format!("{ip}:{}", vesta_tests::free_port());
    let proxy = vesta_tests::proxy::FaultProxy::start(proxy_ip, &listen);
    let cluster = format!(
        "peer_listen = \"{listen}\"\npeer_advertise = \"{}\"\n",
        proxy.addr
    );
    let v = etcd.host(
        lun,
        Host {
            cluster: &cluster,
            ..Host::new(name, fault_domain, ip)
        },
    );
    (v, proxy)
}

/// An 8 MiB volume whose destaging is held back (600 s): what it is written stays dirty in
/// the owner's cache and the peers' replicas until something forces it out.
fn create_held(v: &Vestad, name: &str, policy: &str) {
    create_held_sized(v, name, policy, "8M");
}

/// [`create_held`] of another size.
fn create_held_sized(v: &Vestad, name: &str, policy: &str, size: &str) {
    v.vesta_ok(&[
        "volume",
        "create",
        name,
        "--size",
        size,
        "--policy",
        policy,
        "--hold",
        "600",
        "--max-dirty-age",
        "600",
    ]);
}

fn show(v: &Vestad, name: &str) -> Value {
    v.vesta_json(&["volume", "show", name])
}

/// Waits until `name` on `v` replicates to `peers` (in any order).
fn wait_replicating(v: &Vestad, name: &str, peers: &[&str]) -> Value {
    wait_for(
        Duration::from_secs(30),
        "wbp with the expected peers",
        || {
            let s = show(v, name);
            let got: Vec<String> = s["cache"]["peers"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter(|p| p["error"].is_null())
                        .map(|p| p["host"].as_str().unwrap_or("").to_owned())
                        .collect()
                })
                .unwrap_or_default();
            let mode_ok = s["cache"]["mode"] == format!("wbp:{}", peers.len());
            (mode_ok
                && got.len() == peers.len()
                && peers.iter().all(|p| got.iter().any(|g| g == p)))
            .then_some(s)
        },
    )
}

/// No two hosts had writes to the volume area of the LUN in service at the same time (every
/// host reaches the LUN through its own door, whose log says what it wrote when).
fn one_writer_at_a_time(lun: &Nbdkit) {
    lun.assert_one_writer_at_a_time(LUN_EXTENT as u64..u64::MAX);
}

/// The volume's bytes as the datastore holds them (the first volume of a fresh LUN).
fn on_datastore(lun: &Nbdkit, len: usize) -> Vec<u8> {
    read_file(&lun.image)[LUN_EXTENT..LUN_EXTENT + len].to_vec()
}

fn expect(len: usize, writes: &[(usize, usize, u8)]) -> Vec<u8> {
    let mut v = vec![0u8; len];
    for (off, n, b) in writes {
        v[*off..off + n].fill(*b);
    }
    v
}

#[test]
fn a_peer_replays_online_when_the_owner_dies_and_the_owner_comes_back_in_wbp() {
    let etcd = Etcd::start();
    let lun = Nbdkit::start(128 << 20, &[], &[]);
    let mut a = host(&etcd, "a", "rack1", "127.0.0.2", &lun);
    let b = host(&etcd, "b", "rack2", "127.0.0.3", &lun);
    // Destaging held back: what the writes leave is in a's cache and b's replicas only.
    create_held(&a, "w", "wbp:1");
    let s = wait_replicating(&a, "w", &["b"]);
    let gen0 = s["cache"]["gen"].as_u64().unwrap();
    let writes = [
        (0, 2 << 20, 5u8),
        (1 << 20, 64 << 10, 6),
        (3 << 20, 4096, 7),
    ];
    qemu_io(
        &a.url("w"),
        &["write -P 5 0 2M", "write -P 6 1M 64k", "write -P 7 3M 4k"],
    );
    let s = show(&a, "w");
    assert_eq!(s["cache"]["checkpoint"], 0, "nothing destaged yet: {s}");
    let peer = &s["cache"]["peers"][0];
    assert_eq!(
        peer["lag_writes"], 0,
        "every completed write is on the peer: {s}"
    );
    assert_eq!(peer["acked_ser"], s["cache"]["last_ser"], "{s}");
    assert!(
        on_datastore(&lun, 8 << 20).iter().all(|b| *b == 0),
        "the datastore must not have the writes yet"
    );

    // The owner dies with all of it dirty. Its peer replays once a's lease is gone.
    a.kill9();
    wait_for(
        Duration::from_secs(TTL_S + 20),
        "b to replay a's volume",
        || b.log().contains("online replay done").then_some(()),
    );
    assert_eq!(
        on_datastore(&lun, 8 << 20),
        expect(8 << 20, &writes),
        "after online replay the datastore must hold every completed write"
    );
    assert!(
        b.log()
            .contains("its owner \"a\" is gone; replaying 3 write(s)"),
        "{}",
        b.log()
    );

    // The owner returns: its own dirty copy is older than the datastore now, so it is
    // dropped, not replayed; the volume serves in wt and goes back to wbp with a peer.
    a.launch();
    let s = wait_replicating(&a, "w", &["b"]);
    assert!(
        s["cache"]["gen"].as_u64().unwrap() > gen0 + 1,
        "the owner must start a generation above the replay's: {s}"
    );
    assert!(
        a.log()
            .contains("dropping the 3 write(s) this host's cache log still held"),
        "{}",
        a.log()
    );
    qemu_io(
        &a.url("w"),
        &[
            "read -P 5 0 1M",
            "read -P 6 1M 64k",
            "read -P 5 1088k 960k",
            "read -P 7 3M 4k",
        ],
    );
    // New writes replicate again, and b's old replicas are gone.
    qemu_io(&a.url("w"), &["write -P 8 4M 4k"]);
    let s = show(&a, "w");
    assert_eq!(s["cache"]["peers"][0]["lag_writes"], 0, "{s}");
    one_writer_at_a_time(&lun);
}

#[test]
fn a_failed_peer_is_replaced_and_no_completed_write_waits_on_it() {
    let etcd = Etcd::start();
    let lun = Nbdkit::start(128 << 20, &[], &[]);
    let a = host(&etcd, "a", "rack1", "127.0.0.2", &lun);
    let mut b = host(&etcd, "b", "rack1", "127.0.0.3", &lun);
    // Destaging held: b holds replicas when it dies, and the writes that complete
    // without it must not wait for the hold.
    create_held(&a, "w", "wbp:1:local");
    wait_replicating(&a, "w", &["b"]);
    qemu_io(&a.url("w"), &["write -P 1 0 1M"]);

    // The only peer dies: writes go on (completing on the datastore, as in wt) and the
    // volume falls back to wt, since no other host in rack1 can take its place.
    b.kill9();
    qemu_io(&a.url("w"), &["write -P 2 1M 1M", "flush"]);
    // The operator sees both the policy in effect and the one asked for (the volume's
    // policy follows its cache's mode once the switch completes).
    wait_for(Duration::from_secs(30), "wt without peers", || {
        let s = show(&a, "w");
        (s["cache"]["mode"] == "wt" && s["policy"] == "wt").then_some(())
    });
    let s = show(&a, "w");
    assert_eq!(s["policy_asked"], "wbp:1:local", "{s:#}");
    assert!(
        a.vesta_ok(&["volume", "list"])
            .contains("wt (wbp:1:local asked)"),
        "{}",
        a.vesta_ok(&["volume", "list"])
    );
    assert_eq!(
        on_datastore(&lun, 2 << 20),
        expect(2 << 20, &[(0, 1 << 20, 1), (1 << 20, 1 << 20, 2)]),
        "writes completed without a peer must be on the datastore"
    );
    // A new host in the same fault domain becomes the peer.
    let _c = host(&etcd, "c", "rack1", "127.0.0.4", &lun);
    wait_replicating(&a, "w", &["c"]);
    let s = wait_for(Duration::from_secs(10), "policy wbp:1:local again", || {
        let s = show(&a, "w");
        (s["policy"] == "wbp:1:local").then_some(s)
    });
    assert!(s.get("policy_asked").is_none(), "{s:#}");
    qemu_io(
        &a.url("w"),
        &["write -P 3 2M 1M", "read -P 1 0 1M", "read -P 2 1M 1M"],
    );
    // b returns with replicas of a generation the volume has left: it drops them.
    b.launch();
    wait_for(
        Duration::from_secs(20),
        "b to drop its stale replicas",
        || b.log().contains("dropping stale replicas").then_some(()),
    );
    qemu_io(&a.url("w"), &["read -P 3 2M 1M"]);
    one_writer_at_a_time(&lun);
}

/// A peer keeps another host's replicas to the share of its cache one of its own volumes
/// would get: an owner whose replicas outgrow it (here: destaging held) has its writes
/// refused, drops the peer and writes through, losing nothing, and the peer's own volumes
/// keep their room.
#[test]
fn a_peer_refuses_replicas_beyond_their_share_and_the_owner_writes_through() {
    let etcd = Etcd::start();
    let lun = Nbdkit::start(256 << 20, &[], &[]);
    // a's cache is large enough that its own flow control never ends the hold: 48 MiB is
    // under a third of the log space at which its writes would stall (pressure 1, which
    // sends a held window early, comes at half of that).
    let a = etcd.host(
        &lun,
        Host {
            cache: "512M",
            ..Host::new("a", "rack1", "127.0.0.2")
        },
    );
    let b = host(&etcd, "b", "rack2", "127.0.0.3", &lun);
    create_held_sized(&a, "w", "wbp:1", "64M");
    wait_replicating(&a, "w", &["b"]);
    // b serves three volumes of its own: with a's replicas, each has a quarter of its
    // 128 MiB cache, 32 MiB; a's own share of its cache is all of it.
    for n in ["b1", "b2", "b3"] {
        b.vesta_ok(&["volume", "create", n, "--size", "8M", "--policy", "wb"]);
    }
    qemu_io(&a.url("w"), &["write -P 7 0 48M", "flush"]);
    wait_for(Duration::from_secs(30), "b to refuse a's replicas", || {
        b.log().contains("fill their share").then_some(())
    });
    wait_for(Duration::from_secs(30), "a to write through", || {
        (show(&a, "w")["cache"]["mode"] == "wt").then_some(())
    });
    assert!(
        a.log().contains("peer refused a write"),
        "a should say why it dropped b:\n{}",
        a.log()
    );
    // In wt nothing stays dirty: every byte is on the datastore.
    wait_for(Duration::from_secs(60), "w clean", || {
        (show(&a, "w")["cache"]["dirty_bytes"] == 0).then_some(())
    });
    assert!(
        on_datastore(&lun, 48 << 20) == expect(48 << 20, &[(0, 48 << 20, 7)]),
        "every write the owner completed must be on the datastore"
    );
    // b's own volumes still have their room, and the owner's data reads back.
    qemu_io(
        &b.url("b1"),
        &["write -P 9 0 8M", "flush", "read -P 9 0 8M"],
    );
    qemu_io(&a.url("w"), &["read -P 7 0 48M"]);
    one_writer_at_a_time(&lun);
}

/// FVP Table 1's cascade: the peer replaying for a dead owner dies too, and the next peer
/// continues from the checkpoint the first one left in the vault.
#[test]
fn when_the_replaying_peer_dies_the_next_peer_finishes_the_replay() {
    let etcd = Etcd::start();
    // A slow datastore: the replay takes seconds, long enough to kill the replayer midway.
    let mut lun = Nbdkit::start(128 << 20, &["--filter=delay"], &["delay-write=40ms"]);
    let mut a = host(&etcd, "a", "rack1", "127.0.0.2", &lun);
    let mut b = host(&etcd, "b", "rack2", "127.0.0.3", &lun);
    let mut c = host(&etcd, "c", "rack2", "127.0.0.4", &lun);
    create_held(&a, "w", "wbp:2");
    wait_replicating(&a, "w", &["b", "c"]);
    // 64 separate 4 KiB writes far apart: 64 datastore writes of 40 ms, a window of at most
    // 4 queue depths (32 IOs) at a time, so the replay takes two windows and over 160 ms.
    let cmds: Vec<String> = (0..64u64)
        .map(|i| format!("write -P {} {} 4k", i + 1, i * 64 * 1024))
        .collect();
    let cmds: Vec<&str> = cmds.iter().map(|s| s.as_str()).collect();
    qemu_io(&a.url("w"), &cmds);
    a.kill9();
    let first = wait_for(
        Duration::from_secs(TTL_S + 20),
        "a peer to start replaying",
        || {
            [("b", &b), ("c", &c)]
                .into_iter()
                .find(|(_, h)| h.log().contains("is gone; replaying"))
                .map(|(n, _)| n)
        },
    );
    // Kill the replayer at once: it has done at most part of the work.
    let (dead, other) = if first == "b" {
        (&mut b, &mut c)
    } else {
        (&mut c, &mut b)
    };
    dead.kill9();
    assert!(
        !dead.log().contains("online replay done"),
        "the replay finished before it could be interrupted; slow the datastore down"
    );
    wait_for(
        Duration::from_secs(TTL_S + 30),
        "the other peer to finish the replay",
        || {
            lun.keep_running();
            other.log().contains("online replay done").then_some(())
        },
    );
    let mut want = vec![0u8; 8 << 20];
    for i in 0..64usize {
        want[i * 65536..i * 65536 + 4096].fill(i as u8 + 1);
    }
    assert!(
        on_datastore(&lun, 8 << 20) == want,
        "after the cascade the datastore must hold every completed write"
    );
    one_writer_at_a_time(&lun);
}

/// The same cascade with one peer (`wbp:1`): the owner dies, its only peer dies midway
/// through the replay and comes back (its cache file intact) while the owner stays down.
/// The peer's log is now the only copy of the writes the datastore lacks: it must finish
/// the replay, not drop them.
#[test]
fn a_replaying_peer_that_restarts_finishes_the_replay() {
    let etcd = Etcd::start();
    let mut lun = Nbdkit::start(128 << 20, &["--filter=delay"], &["delay-write=40ms"]);
    let mut a = host(&etcd, "a", "rack1", "127.0.0.2", &lun);
    let mut b = host(&etcd, "b", "rack2", "127.0.0.3", &lun);
    create_held(&a, "w", "wbp:1");
    wait_replicating(&a, "w", &["b"]);
    let cmds: Vec<String> = (0..64u64)
        .map(|i| format!("write -P {} {} 4k", i + 1, i * 64 * 1024))
        .collect();
    let cmds: Vec<&str> = cmds.iter().map(|s| s.as_str()).collect();
    qemu_io(&a.url("w"), &cmds);
    a.kill9();
    wait_for(
        Duration::from_secs(TTL_S + 20),
        "b to start replaying",
        || b.log().contains("is gone; replaying").then_some(()),
    );
    b.kill9();
    assert!(
        !b.log().contains("online replay done"),
        "the replay finished before it could be interrupted; slow the datastore down"
    );
    lun.keep_running();
    b.launch();
    wait_for(
        Duration::from_secs(TTL_S + 30),
        "b to finish the replay",
        || {
            lun.keep_running();
            b.log().contains("online replay done").then_some(())
        },
    );
    let mut want = vec![0u8; 8 << 20];
    for i in 0..64usize {
        want[i * 65536..i * 65536 + 4096].fill(i as u8 + 1);
    }
    assert!(
        on_datastore(&lun, 8 << 20) == want,
        "the datastore must hold every completed write"
    );
    // b named itself in the vault before its first write; resumed, it replayed for a still.
    let v = vault(&etcd);
    assert_eq!(
        (&v["owner"], &v["previous_owner"]),
        (&"b".into(), &"a".into()),
        "{v}"
    );
    // The owner comes back to a current datastore, and must not replay over it.
    a.launch();
    wait_for(Duration::from_secs(30), "a to serve w again", || {
        qemu_io_ok(&a.url("w")).then_some(())
    });
    qemu_io(&a.url("w"), &["read -P 1 0 4k", "read -P 64 4128768 4k"]);
    one_writer_at_a_time(&lun);
}

/// FVP Table 1's cascade, its hard case: the owner of a `wbp:2` volume dies with a write
/// sent to peer b but not yet to peer c, so it never completed. Whichever peer replays must
/// go no further than the other holds: if b replayed that write and died midway, c would
/// continue from the vault's checkpoint (up to a second old) without it, and its blocks
/// would stay beside older data, a state no prefix of the writes produces. Here c has lost
/// its path to the datastore, so b replays; the datastore must not get the write c lacks.
#[test]
fn a_replaying_peer_goes_no_further_than_the_peer_that_would_continue_it() {
    let etcd = Etcd::start();
    let lun = Nbdkit::start(128 << 20, &[], &[]);
    let mut a = host(&etcd, "a", "rack1", "127.0.0.2", &lun);
    let b = host(&etcd, "b", "rack2", "127.0.0.3", &lun);
    let (c, proxy) = host_behind_proxy(&etcd, "c", "rack2", "127.0.0.4", "127.0.0.5", &lun);
    create_held(&a, "w", "wbp:2");
    wait_replicating(&a, "w", &["b", "c"]);
    qemu_io(&a.url("w"), &["write -P 1 0 64k"]);
    // The second write reaches b; c's copy waits in the proxy, and so does the owner.
    proxy.blackhole();
    let second = std::process::Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -P 2 64k 64k", &a.url("w")])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn qemu-io");
    wait_for(
        Duration::from_secs(5),
        "the second write to be in flight",
        || {
            let s = show(&a, "w");
            let last = s["cache"]["last_ser"].as_u64()?;
            let c_acked = s["cache"]["peers"]
                .as_array()?
                .iter()
                .find(|p| p["host"] == "c")?["acked_ser"]
                .as_u64()?;
            (c_acked < last).then_some(())
        },
    );
    // b takes it within a millisecond or so (its log below says it had it).
    std::thread::sleep(Duration::from_millis(500));
    // c loses its path to the datastore, so it cannot be the one that replays.
    lun.close_door("c");
    a.kill9();
    let out = second.wait_with_output().expect("qemu-io");
    assert!(
        !out.status.success() || String::from_utf8_lossy(&out.stdout).contains("failed"),
        "the second write must not have completed: {out:?}"
    );
    // What the proxy held is lost with the owner's connection; c is reachable again.
    proxy.cut();
    proxy.heal();
    wait_for(Duration::from_secs(TTL_S + 30), "b to replay", || {
        b.log().contains("online replay done").then_some(())
    });
    assert!(
        !c.log().contains("online replay done"),
        "c cannot reach the LUN"
    );
    assert!(
        on_datastore(&lun, 128 << 10) == expect(128 << 10, &[(0, 64 << 10, 1)]),
        "the datastore must hold the first write and not the one c never got"
    );
    let log = b.log();
    assert!(
        log.contains("which peer(s) [\"c\"] hold too") && log.contains("are not replayed"),
        "b must have asked c how far it holds, and left the write c lacks:\n{log}"
    );
    one_writer_at_a_time(&lun);
}

/// The owner of a `wbp:1` volume dies and comes back at once (before its lease is gone, so
/// its peer does not replay) on a new, empty cache device: its dirty data is only in the
/// peer's replicas now. The owner must not take the volume over with nothing of its own and
/// drop the peer's copies; it hands the volume to the peer, which replays it, and then serves
/// it with every completed write there.
#[test]
fn an_owner_back_on_a_new_cache_device_lets_its_peer_replay_first() {
    let etcd = Etcd::start();
    let lun = Nbdkit::start(128 << 20, &[], &[]);
    let mut a = host(&etcd, "a", "rack1", "127.0.0.2", &lun);
    let b = host(&etcd, "b", "rack2", "127.0.0.3", &lun);
    create_held(&a, "w", "wbp:1");
    wait_replicating(&a, "w", &["b"]);
    qemu_io(&a.url("w"), &["write -P 5 0 1M", "write -P 6 2M 64k"]);
    a.kill9();
    let cache = a.data_dir.join("cache.img");
    std::fs::remove_file(&cache).expect("remove a's cache file");
    a.launch();
    wait_for(Duration::from_secs(TTL_S + 30), "b to replay", || {
        b.log().contains("online replay done").then_some(())
    });
    wait_for(Duration::from_secs(30), "a to serve w again", || {
        qemu_io_ok(&a.url("w")).then_some(())
    });
    qemu_io(&a.url("w"), &["read -P 5 0 1M", "read -P 6 2M 64k"]);
    assert!(
        on_datastore(&lun, 4 << 20) == expect(4 << 20, &[(0, 1 << 20, 5), (2 << 20, 64 << 10, 6)]),
        "the datastore must hold every completed write"
    );
    one_writer_at_a_time(&lun);
}

/// The owner above comes back on a new cache device, but its peer cannot replay (it cannot
/// reach the datastore): the volume does not open on the owner, and says why. The operator
/// accepts the loss of what the peer held: the vault gets a new generation and no peers,
/// the volume opens on the owner with the datastore's data, and the peer, once it reaches
/// the datastore again, drops its stale replicas instead of replaying them.
#[test]
fn an_owner_back_on_a_new_cache_device_can_accept_the_loss_its_peer_cannot_replay() {
    let etcd = Etcd::start();
    let mut lun = Nbdkit::start(128 << 20, &[], &[]);
    let mut a = host(&etcd, "a", "rack1", "127.0.0.2", &lun);
    let b = host(&etcd, "b", "rack2", "127.0.0.3", &lun);
    create_held(&a, "w", "wbp:1");
    wait_replicating(&a, "w", &["b"]);
    qemu_io(&a.url("w"), &["write -P 5 0 1M"]);
    lun.close_door("b");
    a.kill9();
    std::fs::remove_file(a.data_dir.join("cache.img")).expect("remove a's cache file");
    a.launch();
    let status = show(&a, "w")["status"].as_str().unwrap_or("").to_owned();
    assert!(
        status.contains("waiting for its peer(s)") && status.contains("accept-loss w"),
        "{status}"
    );
    let r = a.vesta_json(&["volume", "accept-loss", "w", "--yes"]);
    assert_eq!(r["accepted"], true, "{r}");
    assert_eq!(r["dirty_bytes"], Value::Null, "{r}");
    assert_eq!(r["peers"], serde_json::json!(["b"]), "{r}");
    wait_for(Duration::from_secs(30), "a to serve w again", || {
        qemu_io_ok(&a.url("w")).then_some(())
    });
    qemu_io(
        &a.url("w"),
        &["read -P 0 0 1M", "write -P 6 64k 4k", "flush"],
    );
    // b lets the old generation go: its round drops it, or a takes b as its peer again
    // first, and opening the new generation drops the older copies.
    wait_for(
        Duration::from_secs(30),
        "b to drop its stale replicas",
        || {
            let log = b.log();
            (log.contains("dropping stale replicas")
                || log.matches("replicating volume").count() >= 2)
                .then_some(())
        },
    );
    lun.restart();
    qemu_io(&a.url("w"), &["write -P 7 2M 4k", "flush"]);
    // a may have taken b as its peer again by now (wbp, its windows held for 600 s) or not
    // (wt): either way, a switch to wt puts every completed write on the datastore.
    a.vesta_ok(&["volume", "policy", "w", "wt"]);
    std::thread::sleep(Duration::from_secs(3));
    assert!(!b.log().contains("online replay done"), "{}", b.log());
    assert_eq!(
        on_datastore(&lun, 4 << 20),
        expect(4 << 20, &[(64 << 10, 4 << 10, 6), (2 << 20, 4 << 10, 7)]),
    );
    one_writer_at_a_time(&lun);
}

/// Whether a one-sector read of `url` works.
fn qemu_io_ok(url: &str) -> bool {
    let out = vesta_tests::run(std::process::Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        "read 0 512",
        url,
    ]));
    out.status.success() && !String::from_utf8_lossy(&out.stdout).contains("failed")
}

/// The LUN of the campaigns: its writes take a millisecond, so dirty data piles up in the
/// caches.
fn campaign_lun() -> Nbdkit {
    Nbdkit::start(64 << 20, &["--filter=delay"], &["delay-write=1ms"])
}

/// Creates the checker's volume `name` (its [`BLOCKS`] blocks) on `v` with `policy`.
fn create_checked(v: &Vestad, name: &str, policy: &str) {
    let size = (BLOCKS * BLOCK).to_string();
    v.vesta_ok(&[
        "volume", "create", name, "--size", &size, "--policy", policy,
    ]);
}

/// The checker's volume on the datastore image itself (the first volume of the LUN) holds
/// every completed write, and becomes the known state for the next round
/// ([`vesta_tests::checker::settle_to`]).
fn datastore_holds_completed_writes(
    lun: &Nbdkit,
    known: &Mutex<Vec<Known>>,
    round: u64,
    seed: u64,
) -> u64 {
    settle_to(
        &on_datastore(lun, (BLOCKS * BLOCK) as usize),
        known,
        round,
        seed,
    )
}

/// The check alone: the known state stays as it is, in-flight versions included, for a
/// check after more of the system has settled.
fn datastore_has_completed_writes(
    lun: &Nbdkit,
    known: &Mutex<Vec<Known>>,
    round: u64,
    seed: u64,
) -> u64 {
    assert_holds_completed(
        &on_datastore(lun, (BLOCKS * BLOCK) as usize),
        known,
        round,
        seed,
    )
}

/// The owner serves what the datastore holds.
fn owner_reads_the_datastore(
    ck: &Checker,
    owner: &Vestad,
    volume: &str,
    lun: &Nbdkit,
    round: u64,
    seed: u64,
) {
    let got = ck.read(&owner.url(volume));
    let img = read_file(&lun.image);
    assert!(
        img[LUN_EXTENT..LUN_EXTENT + got.len()] == got[..],
        "round {round} (seed {seed}): the owner reads other data than the datastore holds"
    );
}

/// The crash campaign of issue 3 with a peer: the owner of a `wbp:1` volume is killed at a
/// random moment under a checker's writes, its peer replays online, and the datastore image
/// itself (no daemon in between) must hold every completed write, each block as its last
/// completed version or the one in flight. Then the owner returns and goes back to `wbp`.
/// `VESTA_WBP_CRASH_ROUNDS` sets the rounds (default 5); a failing round prints its seed.
#[test]
fn completed_writes_survive_the_owner_dying_under_load() {
    let (rounds, seed0) = campaign("wbp crash", "VESTA_WBP_CRASH_ROUNDS", 5);
    let etcd = Etcd::start();
    let mut lun = campaign_lun();
    let mut a = host(&etcd, "a", "rack1", "127.0.0.2", &lun);
    let b = host(&etcd, "b", "rack2", "127.0.0.3", &lun);
    create_checked(&a, "c", "wbp:1");
    wait_replicating(&a, "c", &["b"]);
    let ck = Checker::new();
    let mut rng = Xorshift(seed0 | 1);
    let mut replayed_writes = 0u64;
    for round in 0..rounds {
        let seed = rng.next_u64();
        let writers = ck.write(a.url("c"), seed);
        std::thread::sleep(Duration::from_millis(100 + seed % 500));
        a.kill9();
        writers.stop();
        // a's door (nbdkit 1.32) can abort once a's requests leave its delay filter; it
        // must be there for a's return.
        lun.outlive_killed_client();
        wait_for(Duration::from_secs(TTL_S + 30), "b's online replay", || {
            (b.log().matches("online replay done").count() as u64 > round).then_some(())
        });
        let completed = datastore_holds_completed_writes(&lun, &ck.known, round, seed);
        assert!(
            completed > 0,
            "round {round}: the checker completed no writes"
        );
        a.launch();
        wait_replicating(&a, "c", &["b"]);
        owner_reads_the_datastore(&ck, &a, "c", &lun, round, seed);
    }
    for line in b
        .log()
        .lines()
        .filter(|l| l.contains("is gone; replaying "))
    {
        let n: u64 = line
            .split("is gone; replaying ")
            .nth(1)
            .and_then(|r| r.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        replayed_writes += n;
    }
    eprintln!(
        "wbp crash campaign: the peer replayed {replayed_writes} write(s) in {rounds} rounds"
    );
    assert!(
        replayed_writes > 0,
        "no kill left dirty data for the peer to replay; the campaign is too gentle"
    );
    one_writer_at_a_time(&lun);
}

/// FVP Table 1, flash failure in `wbp`: the owner's cache device fails with dirty data on it;
/// its peer replays that data from its replicas, and the owner goes on uncached with the
/// datastore current.
#[test]
fn when_the_owners_cache_device_fails_a_peer_replays_and_the_owner_goes_uncached() {
    let etcd = Etcd::start();
    let lun = Nbdkit::start(128 << 20, &[], &[]);
    let a = host(&etcd, "a", "rack1", "127.0.0.2", &lun);
    let b = host(&etcd, "b", "rack2", "127.0.0.3", &lun);
    create_held(&a, "w", "wbp:1");
    wait_replicating(&a, "w", &["b"]);
    qemu_io(&a.url("w"), &["write -P 4 0 1M", "write -P 9 2M 8k"]);
    assert!(on_datastore(&lun, 4 << 20).iter().all(|x| *x == 0));
    a.fail_cache_device();
    peer_replays_then_owner_goes_uncached(&a, &b, Duration::from_secs(30));
    assert_eq!(
        on_datastore(&lun, 4 << 20),
        expect(4 << 20, &[(0, 1 << 20, 4), (2 << 20, 8192, 9)]),
        "the peer's replay must put every completed write on the datastore"
    );
    qemu_io(
        &a.url("w"),
        &["read -P 4 0 1M", "read -P 9 2M 8k", "write -P 5 3M 4k"],
    );
    assert!(
        a.log().contains("its peers replay what it held"),
        "{}",
        a.log()
    );
    one_writer_at_a_time(&lun);
}

/// Waits for peer `b` to finish its online replay of `w` (within `within`), then for owner
/// `a`, whose cache device failed, to serve `w` uncached.
fn peer_replays_then_owner_goes_uncached(a: &Vestad, b: &Vestad, within: Duration) {
    wait_for(within, "b's online replay of w to end", || {
        b.log().contains("online replay done").then_some(())
    });
    wait_for(Duration::from_secs(30), "a to serve w uncached", || {
        let s = show(a, "w");
        (s["policy"] == "uncached" && s["cache"].is_null()).then_some(())
    });
}

/// The owner `a` of a `wbp:1` volume `w` (size `size`, destaging held back, peer `b`) on a
/// LUN with nbdkit `filters` and `args` writes `cmds`, is killed and restarts at once, and
/// takes the volume back before its peer replays it; returns the cluster and the vault's
/// generation before the kill. The restart and the peer race for the volume once the old
/// registration lapses: the peer sees the owner dead until it registers again (within 50 ms
/// of the lapse), and replays if it looks then. So a round the peer wins is tried again on
/// fresh processes, up to 5 times.
fn owner_back_before_its_peer_replays(
    filters: &[&str],
    args: &[&str],
    size: &str,
    cmds: &[&str],
) -> (Etcd, Nbdkit, Vestad, Vestad, u64) {
    for attempt in 1..=5 {
        let etcd = Etcd::start();
        let mut lun = Nbdkit::start(128 << 20, filters, args);
        let mut a = host(&etcd, "a", "rack1", "127.0.0.2", &lun);
        let b = host(&etcd, "b", "rack2", "127.0.0.3", &lun);
        create_held_sized(&a, "w", "wbp:1", size);
        wait_replicating(&a, "w", &["b"]);
        qemu_io(&a.url("w"), cmds);
        let gen = vault(&etcd)["gen"].as_u64().expect("vault gen");
        let before = a.log().len();
        a.kill9();
        lun.outlive_killed_client();
        a.launch();
        let a_won = wait_for(
            Duration::from_secs(TTL_S + 30),
            "a's restart or b's replay to take the volume",
            || {
                lun.keep_running();
                if a.log()[before..].contains("from the cache log before it takes writes") {
                    Some(true)
                } else {
                    b.log().contains("is gone; replaying").then_some(false)
                }
            },
        );
        if a_won {
            return (etcd, lun, a, b, gen);
        }
        eprintln!("attempt {attempt}: b replayed before a's restart took the volume; again");
    }
    panic!("in 5 attempts a's restart never took its volume before its peer replayed it");
}

/// The owner of a `wbp:1` volume is killed with dirty data and restarts at once, before its
/// peer replays: it replays offline from its own cache log, and its cache device fails
/// midway through. The peer must still hold its replicas (the vault names it until the
/// owner's replay ends) and replay the rest, so that the datastore holds every completed
/// write; the owner then serves the volume uncached. The owner used to record its vault
/// without peers as it opened, and the peer dropped the copies only it still had.
#[test]
fn a_restarted_owner_whose_cache_fails_during_its_replay_leaves_the_rest_to_its_peer() {
    restarted_owner_whose_cache_fails_during_its_replay(None);
}

/// The same, with the volume's policy set to `wt` during the replay (which the replay goes
/// on in already, so nothing switches): the peers still replay the rest. IO used to stall
/// for ever, the hand-off being looked after only for volumes wanted in `wbp`.
#[test]
fn a_restarted_owner_set_to_wt_during_its_replay_still_leaves_the_rest_to_its_peer() {
    restarted_owner_whose_cache_fails_during_its_replay(Some("wt"));
}

fn restarted_owner_whose_cache_fails_during_its_replay(set_midway: Option<&str>) {
    // Each datastore write takes 300 ms, so the replay's pieces take seconds.
    let (etcd, lun, a, b, gen) = owner_back_before_its_peer_replays(
        &["--filter=delay"],
        &["wdelay=300ms"],
        "64M",
        &["write -P 8 0 40M"],
    );
    wait_for(
        Duration::from_secs(30),
        "a's offline replay to begin writing the datastore",
        || {
            on_datastore(&lun, 1 << 20)
                .iter()
                .all(|x| *x == 8)
                .then_some(())
        },
    );
    let v = vault(&etcd);
    assert_eq!(
        (&v["owner"], &v["gen"], &v["peers"]),
        (&"a".into(), &gen.into(), &serde_json::json!(["b"])),
        "the replaying owner's vault must go on naming its peer: {v}"
    );
    assert!(
        !b.log().contains("dropped the replicas"),
        "b dropped its replicas while a replayed: {}",
        b.log()
    );
    assert!(
        !on_datastore(&lun, 40 << 20).iter().all(|x| *x == 8),
        "a's replay finished before its cache device could fail; slow the datastore down"
    );
    if let Some(policy) = set_midway {
        a.vesta_ok(&["volume", "policy", "w", policy]);
    }
    a.fail_cache_device();
    peer_replays_then_owner_goes_uncached(&a, &b, Duration::from_secs(60));
    assert!(
        on_datastore(&lun, 40 << 20).iter().all(|x| *x == 8),
        "the datastore must hold every completed write"
    );
    qemu_io(&a.url("w"), &["read -P 8 0 40M", "write -P 9 40M 4k"]);
    one_writer_at_a_time(&lun);
}

/// The owner of a `wbp:1` volume is killed with dirty data and restarts at once: it replays
/// offline from its own cache log (its peer, which sees it alive, waits), its writes wait
/// until the vault records the generation after the replay, and it goes back to `wbp` in a
/// newer generation, whose opening on the peer replaces the old replicas.
#[test]
fn a_restarted_owner_replays_by_itself_and_goes_back_to_wbp() {
    let (etcd, lun, a, b, gen) = owner_back_before_its_peer_replays(
        &[],
        &[],
        "8M",
        &["write -P 5 0 1M", "write -P 6 2M 64k"],
    );
    let s = wait_for(
        Duration::from_secs(30),
        "a to replay and go back to wbp with b",
        || {
            let s = show(&a, "w");
            (s["cache"]["mode"] == "wbp:1" && a.log().contains("offline replay complete"))
                .then_some(s)
        },
    );
    assert!(
        a.log()
            .contains("they stay in its vault until the replay ends"),
        "{}",
        a.log()
    );
    let now = s["cache"]["gen"].as_u64().unwrap();
    assert!(
        now > gen + 1,
        "wbp again in a generation after the replay's: {s}"
    );
    assert_eq!(
        on_datastore(&lun, 4 << 20),
        expect(4 << 20, &[(0, 1 << 20, 5), (2 << 20, 64 << 10, 6)]),
        "a's replay must put every completed write on the datastore"
    );
    let v = vault(&etcd);
    assert_eq!(
        (&v["gen"], &v["peers"]),
        (&now.into(), &serde_json::json!(["b"])),
        "{v}"
    );
    assert!(
        b.log().contains(&format!("for host a (generation {now}, ")),
        "{}",
        b.log()
    );
    assert!(!b.log().contains("online replay done"), "{}", b.log());
    qemu_io(
        &a.url("w"),
        &[
            "read -P 5 0 1M",
            "write -P 7 3M 4k",
            "flush",
            "read -P 7 3M 4k",
        ],
    );
    one_writer_at_a_time(&lun);
}

/// FVP Table 1, flash failure in `wbp` with nothing dirty: every completed write is on the
/// datastore, so no peer needs to replay. The owner's writes wait a moment and go on
/// uncached; its new generation makes the peer drop its (stale) replicas.
#[test]
fn a_wbp_volume_with_nothing_dirty_goes_on_uncached_without_a_replay() {
    let etcd = Etcd::start();
    let lun = Nbdkit::start(128 << 20, &[], &[]);
    let a = host(&etcd, "a", "rack1", "127.0.0.2", &lun);
    let b = host(&etcd, "b", "rack2", "127.0.0.3", &lun);
    a.vesta_ok(&["volume", "create", "w", "--size", "8M", "--policy", "wbp:1"]);
    wait_replicating(&a, "w", &["b"]);
    qemu_io(&a.url("w"), &["write -P 4 0 64k", "flush"]);
    a.wait_clean("w");
    let gen = vault(&etcd)["gen"].as_u64().unwrap();
    let dropped = b.log().matches("dropping stale replicas").count();
    a.fail_cache_device();
    // The write waits for a moment, then goes to the datastore.
    qemu_io(&a.url("w"), &["write -P 5 64k 64k", "read -P 4 0 64k"]);
    wait_for(Duration::from_secs(5), "a to say it went uncached", || {
        (show(&a, "w")["policy"] == "uncached" && a.log().contains("without a replay by its peers"))
            .then_some(())
    });
    assert_eq!(
        on_datastore(&lun, 256 << 10),
        expect(256 << 10, &[(0, 64 << 10, 4), (64 << 10, 64 << 10, 5)]),
    );
    let v = vault(&etcd);
    assert!(v["gen"].as_u64().unwrap() > gen, "{v}");
    assert_eq!(v["peers"], serde_json::json!([]), "{v}");
    wait_for(
        Duration::from_secs(10),
        "b to drop its stale replicas",
        || (b.log().matches("dropping stale replicas").count() > dropped).then_some(()),
    );
    assert!(!b.log().contains("online replay done"), "{}", b.log());
    one_writer_at_a_time(&lun);
}

/// FVP Table 1, datastore failure: with the datastore failing every IO, the owner's destager
/// stalls and loses nothing; the owner then dies, and its peer replays once the datastore
/// answers again.
#[test]
fn a_failing_datastore_stalls_with_no_loss_and_the_peer_replays_when_it_returns() {
    let etcd = Etcd::start();
    let (lun, errors) = Nbdkit::start_failing(128 << 20, "", &[], &[]);
    let mut a = host(&etcd, "a", "rack1", "127.0.0.2", &lun);
    let b = host(&etcd, "b", "rack2", "127.0.0.3", &lun);
    a.vesta_ok(&["volume", "create", "w", "--size", "8M", "--policy", "wbp:1"]);
    wait_replicating(&a, "w", &["b"]);
    errors.on();
    qemu_io(
        &a.url("w"),
        &["write -P 3 0 1M", "write -P 8 5M 64k", "flush"],
    );
    wait_for(
        Duration::from_secs(20),
        "destaging to fail and retry",
        || {
            let s = show(&a, "w");
            (!s["cache"]["destage_error"].is_null()).then_some(s)
        },
    );
    assert_eq!(
        show(&a, "w")["cache"]["dirty_bytes"],
        (1 << 20) + (64 << 10)
    );
    a.kill9();
    // b takes over but cannot reach the datastore yet: it keeps trying, nothing is dropped.
    std::thread::sleep(Duration::from_secs(TTL_S + 3));
    assert!(!b.log().contains("online replay done"));
    errors.off();
    wait_for(
        Duration::from_secs(60),
        "b's replay once the datastore is back",
        || b.log().contains("online replay done").then_some(()),
    );
    assert_eq!(
        on_datastore(&lun, 8 << 20),
        expect(8 << 20, &[(0, 1 << 20, 3), (5 << 20, 64 << 10, 8)]),
    );
    a.launch();
    qemu_io(&a.url("w"), &["read -P 3 0 1M", "read -P 8 5M 64k"]);
    one_writer_at_a_time(&lun);
}

/// FVP Table 1, network failure between owner and peer: the link to the peer goes silent
/// (a fault proxy drops every byte, the connection stays open). The owner's request times
/// out, it takes the peer out of the vault, and the volume goes back to wbp with a new peer
/// that holds everything needed: when the owner then dies, the new peer's replay makes the
/// datastore current. The old peer, reachable again, drops its stale replicas.
#[test]
fn a_partition_from_the_peer_moves_the_volume_to_a_new_peer_with_nothing_lost() {
    let etcd = Etcd::start();
    let lun = Nbdkit::start(128 << 20, &[], &[]);
    let mut a = host(&etcd, "a", "rack1", "127.0.0.2", &lun);
    let (b, proxy) = host_behind_proxy(&etcd, "b", "rack2", "127.0.0.3", "127.0.0.5", &lun);
    create_held(&a, "w", "wbp:1:remote");
    wait_replicating(&a, "w", &["b"]);
    qemu_io(&a.url("w"), &["write -P 1 0 1M"]);
    proxy.blackhole();
    let c = host(&etcd, "c", "rack2", "127.0.0.4", &lun);
    // This write waits for b until the link times out; then it completes on the datastore.
    qemu_io(&a.url("w"), &["write -P 2 1M 1M"]);
    wait_replicating(&a, "w", &["c"]);
    qemu_io(&a.url("w"), &["write -P 3 2M 1M"]);
    let s = show(&a, "w");
    assert!(
        s["cache"]["dirty_bytes"].as_u64().unwrap() >= 1 << 20,
        "{s}"
    );
    proxy.heal();
    wait_for(
        Duration::from_secs(20),
        "b to drop its stale replicas",
        || b.log().contains("dropping stale replicas").then_some(()),
    );
    // The new peer alone must be enough.
    a.kill9();
    wait_for(Duration::from_secs(TTL_S + 20), "c to replay", || {
        c.log().contains("online replay done").then_some(())
    });
    assert!(
        !b.log().contains("online replay done"),
        "the old peer must not replay"
    );
    assert_eq!(
        on_datastore(&lun, 4 << 20),
        expect(
            4 << 20,
            &[
                (0, 1 << 20, 1),
                (1 << 20, 1 << 20, 2),
                (2 << 20, 1 << 20, 3)
            ]
        ),
    );
    one_writer_at_a_time(&lun);
}

/// A peer whose host goes silent (it lost power, or the network to it drops everything)
/// while its owner writes nothing: the owner must not count on it for as long as it stays
/// idle, holding its dirty data alone. It pings idle links, finds the peer silent within
/// seconds, and moves to a new peer, destaging on the way the data only it and the silent
/// peer held. No write is made after the cut.
#[test]
fn an_idle_owner_finds_a_silent_peer_and_moves_to_a_new_one() {
    let etcd = Etcd::start();
    let lun = Nbdkit::start(128 << 20, &[], &[]);
    let a = host(&etcd, "a", "rack1", "127.0.0.2", &lun);
    let (_b, proxy) = host_behind_proxy(&etcd, "b", "rack2", "127.0.0.3", "127.0.0.5", &lun);
    create_held(&a, "w", "wbp:1:remote");
    wait_replicating(&a, "w", &["b"]);
    qemu_io(&a.url("w"), &["write -P 1 0 1M"]);
    proxy.blackhole();
    let _c = host(&etcd, "c", "rack2", "127.0.0.4", &lun);
    wait_for(Duration::from_secs(60), "a to replicate to c", || {
        let s = show(&a, "w");
        let peers: Vec<&str> = s["cache"]["peers"]
            .as_array()
            .map(|p| p.iter().filter_map(|x| x["host"].as_str()).collect())
            .unwrap_or_default();
        (s["cache"]["mode"] == "wbp:1" && peers == ["c"]).then_some(())
    });
    assert_eq!(vault(&etcd)["peers"], serde_json::json!(["c"]));
    assert!(
        on_datastore(&lun, 1 << 20).iter().all(|b| *b == 1),
        "the dirty data only a and the silent peer held must be on the datastore"
    );
    assert!(
        a.log().contains("link to peer b broken: no reply within"),
        "{}",
        a.log()
    );
}

/// Network failures between owner and peer at random moments under a checker's writes (FVP
/// Table 1, network row, with random timing): the link to the volume's peer is cut (reset)
/// or blackholed (silent), and the owner is killed either while it is still partitioned or
/// once it has moved to a new peer; the cut may heal before or after the kill. Whoever then
/// replays (a peer the vault names, or the owner itself when it returns) must leave every
/// completed write on the datastore image, and an old peer must never replay stale replicas
/// over newer data. `VESTA_PARTITION_ROUNDS` sets the rounds (default 2).
#[test]
fn completed_writes_survive_partitions_from_the_peer_and_the_owners_death() {
    let (rounds, seed0) = campaign("partition", "VESTA_PARTITION_ROUNDS", 2);
    let etcd = Etcd::start();
    let mut lun = campaign_lun();
    let mut a = host(&etcd, "a", "rack1", "127.0.0.2", &lun);
    let (b, pb) = host_behind_proxy(&etcd, "b", "rack2", "127.0.0.3", "127.0.0.5", &lun);
    let (c, pc) = host_behind_proxy(&etcd, "c", "rack2", "127.0.0.4", "127.0.0.6", &lun);
    create_checked(&a, "v", "wbp:1");
    let ck = Checker::new();
    let mut rng = Xorshift(seed0 | 1);
    let replays = || {
        (b.log().matches("online replay done").count()
            + c.log().matches("online replay done").count()) as u64
    };
    let (mut peer_replays, mut moved) = (0, 0);
    for round in 0..rounds {
        let seed = rng.next_u64();
        let mut r = Xorshift(seed | 1);
        let peer = wait_peer(&a, "v");
        let (proxy, other) = if peer == "b" { (&pb, "c") } else { (&pc, "b") };
        let blackhole = r.next_u64().is_multiple_of(2);
        let late = r.next_u64().is_multiple_of(2);
        let heal_first = r.next_u64().is_multiple_of(2);
        eprintln!(
            "round {round} (seed {seed}): {} the link to {peer}, kill the owner {}, heal {}",
            if blackhole { "blackhole" } else { "cut" },
            if late {
                "on its new peer"
            } else {
                "while partitioned"
            },
            if heal_first { "first" } else { "after" },
        );
        let writers = ck.write(a.url("v"), seed);
        std::thread::sleep(Duration::from_millis(100 + r.next_u64() % 500));
        if blackhole {
            proxy.blackhole();
        } else {
            proxy.cut();
        }
        if late {
            // A blackholed link is given up after the peer request timeout (10 s).
            wait_for(Duration::from_secs(40), "the owner's new peer", || {
                (wait_peer(&a, "v") == other).then_some(())
            });
            moved += 1;
            std::thread::sleep(Duration::from_millis(r.next_u64() % 500));
        } else {
            let within = if blackhole { 12_000 } else { 1_500 };
            std::thread::sleep(Duration::from_millis(r.next_u64() % within));
        }
        if heal_first {
            proxy.heal();
            std::thread::sleep(Duration::from_millis(r.next_u64() % 300));
        }
        let before = replays();
        a.kill9();
        writers.stop();
        proxy.heal();
        lun.outlive_killed_client();
        // A peer the vault names replays once a's lease is gone; what it leaves on the
        // datastore must already hold every completed write.
        let replayed = (0..(TTL_S + 10) * 10).any(|_| {
            std::thread::sleep(Duration::from_millis(100));
            replays() > before
        });
        if replayed {
            peer_replays += 1;
            datastore_has_completed_writes(&lun, &ck.known, round, seed);
        }
        // Then the owner returns (replaying its own log if no peer did), takes a peer and
        // destages: the datastore still holds every completed write, and the owner serves it.
        a.launch();
        wait_peer(&a, "v");
        a.wait_clean("v");
        let completed = datastore_holds_completed_writes(&lun, &ck.known, round, seed);
        assert!(
            completed > 0,
            "round {round}: the checker completed no writes"
        );
        owner_reads_the_datastore(&ck, &a, "v", &lun, round, seed);
    }
    eprintln!(
        "partition campaign: {rounds} rounds, {moved} moved to a new peer before the kill, \
         {peer_replays} replayed by a peer"
    );
    one_writer_at_a_time(&lun);
}

/// The one peer `name` on `v` replicates to, once it has one (`wbp:1`).
fn wait_peer(v: &Vestad, name: &str) -> String {
    wait_for(Duration::from_secs(40), "wbp:1 with a peer", || {
        let s = show(v, name);
        let peers: Vec<String> = s["cache"]["peers"]
            .as_array()?
            .iter()
            .filter(|p| p["error"].is_null())
            .filter_map(|p| p["host"].as_str().map(str::to_owned))
            .collect();
        (s["cache"]["mode"] == "wbp:1" && peers.len() == 1).then(|| peers[0].clone())
    })
}

/// Flash failure in `wbp` at a random moment under a checker's writes (FVP Table 1, flash
/// row, with random timing): the owner's cache device fails, its peer replays (or, if
/// nothing was dirty at that moment, the owner goes uncached at once), and the checker's
/// writes go on, uncached, without an error. The datastore holds every completed
/// write, and still does after the owner restarts on its old cache file, whose dirty
/// records of the volume are stale by then and must never be replayed over newer writes.
/// `VESTA_FLASH_ROUNDS` sets the rounds (default 2).
#[test]
fn completed_writes_survive_the_owners_cache_device_failing_under_load() {
    let (rounds, seed0) = campaign("flash failure", "VESTA_FLASH_ROUNDS", 2);
    let etcd = Etcd::start();
    let mut lun = campaign_lun();
    let mut a = host(&etcd, "a", "rack1", "127.0.0.2", &lun);
    let b = host(&etcd, "b", "rack2", "127.0.0.3", &lun);
    create_checked(&a, "v", "wbp:1");
    let ck = Checker::new();
    let mut rng = Xorshift(seed0 | 1);
    for round in 0..rounds {
        let seed = rng.next_u64();
        eprintln!("round {round} (seed {seed})");
        wait_peer(&a, "v");
        let before = b.log().matches("online replay done").count();
        let clean_before = a.log().matches("without a replay by its peers").count();
        let writers = ck.write(a.url("v"), seed);
        std::thread::sleep(Duration::from_millis(100 + seed % 500));
        a.fail_cache_device();
        // b replays, unless nothing was dirty when the device failed (rare under load).
        wait_for(Duration::from_secs(40), "b's replay for a", || {
            (b.log().matches("online replay done").count() > before
                || a.log().matches("without a replay by its peers").count() > clean_before)
                .then_some(())
        });
        wait_for(Duration::from_secs(30), "a to serve v uncached", || {
            let s = show(&a, "v");
            (s["policy"] == "uncached" && s["cache"].is_null()).then_some(())
        });
        // The checker's writers never saw an error: they are still writing.
        let then = ck.completed();
        wait_for(Duration::from_secs(10), "more writes, uncached", || {
            (ck.completed() > then).then_some(())
        });
        let failed = writers.stop();
        assert_eq!(
            failed, 0,
            "round {round} (seed {seed}): writers saw an error"
        );
        let completed = datastore_holds_completed_writes(&lun, &ck.known, round, seed);
        assert!(
            completed > 0,
            "round {round}: the checker completed no writes"
        );
        // The owner restarts on its cache file, as it was when the device "failed" (a
        // device back after a reset), and goes back to the volume's policy, wbp:1.
        a.kill9();
        lun.outlive_killed_client();
        a.launch();
        wait_peer(&a, "v");
        datastore_has_completed_writes(&lun, &ck.known, round, seed);
        owner_reads_the_datastore(&ck, &a, "v", &lun, round, seed);
    }
    one_writer_at_a_time(&lun);
}

/// FVP Table 1's cascade with random timing: the owner of a `wbp:2` volume is killed under a
/// checker's writes, and the peer that replays for it is killed at a random moment of its
/// replay (or after it); the other peer continues from the vault's checkpoint. Once the
/// vault says `wt`, the datastore image itself must hold every completed write; then the
/// owner and the killed peer return (the peer's replicas are stale by then) and the owner
/// serves what the datastore holds. `VESTA_CASCADE_ROUNDS` sets the rounds (default 2).
#[test]
fn completed_writes_survive_the_replaying_peer_dying_at_random() {
    let (rounds, seed0) = campaign("cascade", "VESTA_CASCADE_ROUNDS", 2);
    let etcd = Etcd::start();
    let mut lun = campaign_lun();
    let mut a = host(&etcd, "a", "rack1", "127.0.0.2", &lun);
    let mut b = host(&etcd, "b", "rack2", "127.0.0.3", &lun);
    let mut c = host(&etcd, "c", "rack2", "127.0.0.4", &lun);
    create_checked(&a, "v", "wbp:2");
    let ck = Checker::new();
    let mut rng = Xorshift(seed0 | 1);
    let starts = |h: &Vestad| h.log().matches("is gone; replaying").count();
    let dones = |h: &Vestad| h.log().matches("online replay done").count();
    let mut interrupted = 0;
    for round in 0..rounds {
        let seed = rng.next_u64();
        let mut r = Xorshift(seed | 1);
        wait_replicating(&a, "v", &["b", "c"]);
        let before = [starts(&b), starts(&c)];
        let writers = ck.write(a.url("v"), seed);
        std::thread::sleep(Duration::from_millis(300 + r.next_u64() % 500));
        a.kill9();
        writers.stop();
        lun.outlive_killed_client();
        let first = wait_for(
            Duration::from_secs(TTL_S + 20),
            "a peer to start replaying",
            || {
                if starts(&b) > before[0] {
                    Some("b")
                } else if starts(&c) > before[1] {
                    Some("c")
                } else {
                    None
                }
            },
        );
        let (dead, other) = if first == "b" {
            (&mut b, "c")
        } else {
            (&mut c, "b")
        };
        let done_before = dones(dead);
        std::thread::sleep(Duration::from_millis(r.next_u64() % 600));
        dead.kill9();
        lun.outlive_killed_client();
        let finished = dones(dead) > done_before;
        if !finished {
            interrupted += 1;
        }
        eprintln!(
            "round {round} (seed {seed}): {first} replayed and was killed {}; {} goes on",
            if finished {
                "after it finished"
            } else {
                "midway"
            },
            other
        );
        // The replay's end, by whichever peer: the vault says wt.
        wait_for(
            Duration::from_secs(TTL_S + 40),
            "the replay to end (vault: wt)",
            || {
                lun.keep_running();
                (vault(&etcd)["policy"] == "wt").then_some(())
            },
        );
        datastore_holds_completed_writes(&lun, &ck.known, round, seed);
        dead.launch();
        a.launch();
        wait_replicating(&a, "v", &["b", "c"]);
        owner_reads_the_datastore(&ck, &a, "v", &lun, round, seed);
    }
    eprintln!("cascade campaign: {rounds} rounds, {interrupted} replay(s) killed midway");
    one_writer_at_a_time(&lun);
}

/// The vault record of the one volume of the pod (etcd, default prefix).
fn vault(etcd: &Etcd) -> Value {
    let out = etcd.etcdctl_retrying(&["get", "--prefix", "/vesta/vaults/", "--print-value-only"]);
    assert!(out.status.success(), "etcdctl get: {out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.lines().next().unwrap_or("null")).unwrap_or(Value::Null)
}

/// A hand-off that cannot finish (the owner's cache device failed, and the peer cannot reach
/// the datastore to replay): the volume's IO stalls rather than fail, for as long as it
/// takes, and a SIGTERM of the owner still ends it (the stalled write fails with ESHUTDOWN,
/// vestad exits cleanly) instead of waiting for a replay nothing will reroute.
#[test]
fn a_stalled_hand_off_holds_io_and_does_not_hold_up_a_shutdown() {
    let etcd = Etcd::start();
    let lun = Nbdkit::start(128 << 20, &[], &[]);
    let mut a = host(&etcd, "a", "rack1", "127.0.0.2", &lun);
    let b = host(&etcd, "b", "rack2", "127.0.0.3", &lun);
    create_held(&a, "w", "wbp:1");
    wait_replicating(&a, "w", &["b"]);
    qemu_io(&a.url("w"), &["write -P 4 0 64k"]);
    lun.close_door("b");
    a.fail_cache_device();
    let url = a.url("w");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let out = vesta_tests::run(std::process::Command::new("qemu-io").args([
            "-f",
            "raw",
            "-c",
            "write -P 5 1M 4k",
            &url,
        ]));
        let _ = tx.send(String::from_utf8_lossy(&out.stdout).into_owned());
    });
    wait_for(Duration::from_secs(30), "the hand-off to b", || {
        a.log()
            .contains("its peers replay what it held")
            .then_some(())
    });
    // b keeps trying to reach the datastore; the write waits meanwhile.
    assert!(
        rx.recv_timeout(Duration::from_secs(3)).is_err(),
        "a write ended while the hand-off could not finish"
    );
    assert!(!b.log().contains("online replay done"));
    let status = show(&a, "w")["status"].as_str().unwrap_or("").to_owned();
    assert!(status.starts_with("IO stalled"), "{status}");
    // The owner asks its peers after a while, and says what they answered.
    wait_for(
        Duration::from_secs(15),
        "the peer's answer in the status",
        || {
            let s = show(&a, "w")["status"].as_str().unwrap_or("").to_owned();
            s.contains("(peers asked: b: holds its replicas (to write")
                .then_some(())
        },
    );
    let st = a.terminate();
    assert!(st.success(), "vestad exited with {st}:\n{}", a.log());
    // The stalled write ends with ESHUTDOWN: a planned stop, not a loss.
    let out = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the stalled write ends when vestad stops");
    assert!(
        out.contains("write failed: Cannot send after transport endpoint shutdown"),
        "{out}"
    );
}

/// A hand-off no peer can finish (the peer cannot reach the datastore) stalls the volume's
/// IO for as long as it takes, above. The operator may decide otherwise and accept the loss
/// (`vesta volume accept-loss`): the owner takes the vault lock back from between the peer's
/// tries, records the vault with no peers and a new generation, and serves the volume
/// uncached from the datastore. The stalled write goes on there. When the peer reaches the
/// datastore again, it drops its stale replicas instead of replaying them over what the
/// volume wrote since.
#[test]
fn an_accepted_loss_ends_a_hand_off_no_peer_can_finish() {
    let etcd = Etcd::start();
    let mut lun = Nbdkit::start(128 << 20, &[], &[]);
    let a = host(&etcd, "a", "rack1", "127.0.0.2", &lun);
    let b = host(&etcd, "b", "rack2", "127.0.0.3", &lun);
    create_held(&a, "w", "wbp:1");
    wait_replicating(&a, "w", &["b"]);
    qemu_io(&a.url("w"), &["write -P 4 0 64k", "write -P 4 1M 64k"]);
    let gen = vault(&etcd)["gen"].as_u64().expect("vault gen");
    lun.close_door("b");
    a.fail_cache_device();
    let url = a.url("w");
    let stalled = std::thread::spawn(move || {
        vesta_tests::run(std::process::Command::new("qemu-io").args([
            "-f",
            "raw",
            "-c",
            "write -P 5 2M 4k",
            &url,
        ]))
    });
    wait_for(Duration::from_secs(30), "the hand-off to b", || {
        a.log()
            .contains("its peers replay what it held")
            .then_some(())
    });
    // Without --yes: what would be lost, and the hand-off goes on.
    let out = a.vesta(&["volume", "accept-loss", "w"]);
    let said = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(!out.status.success(), "{said}");
    assert!(
        said.contains("128 KiB of dirty data (2 write(s))") && said.contains("peers b"),
        "{said}"
    );
    assert!(
        !stalled.is_finished(),
        "the stalled write ended on a dry run"
    );

    let r = a.vesta_json(&["volume", "accept-loss", "w", "--yes"]);
    assert_eq!(r["accepted"], true, "{r}");
    assert_eq!(r["peers"], serde_json::json!(["b"]), "{r}");
    let v = vault(&etcd);
    assert_eq!(v["peers"], serde_json::json!([]), "{v}");
    assert_ne!(v["handoff"], true, "{v}");
    assert_eq!(v["owner"], "a", "{v}");
    assert!(v["gen"].as_u64() > Some(gen), "{v}");
    let out = stalled.join().expect("the stalled write's thread");
    assert!(out.status.success(), "the stalled write failed: {out:?}");
    let s = show(&a, "w");
    assert_eq!(s["policy"], "uncached", "{s}");
    assert_eq!(s["status"], "ok", "{s}");
    qemu_io(
        &a.url("w"),
        &["read -P 0 0 64k", "write -P 6 1M 64k", "flush"],
    );
    wait_for(
        Duration::from_secs(30),
        "b to drop its stale replicas",
        || b.log().contains("dropping stale replicas").then_some(()),
    );
    // b reaches the datastore again; nothing of the old generation may land there.
    lun.restart();
    qemu_io(&a.url("w"), &["write -P 7 3M 4k", "flush"]);
    std::thread::sleep(Duration::from_secs(3));
    assert!(!b.log().contains("online replay done"), "{}", b.log());
    assert_eq!(
        on_datastore(&lun, 4 << 20),
        expect(
            4 << 20,
            &[
                (1 << 20, 64 << 10, 6),
                (2 << 20, 4 << 10, 5),
                (3 << 20, 4 << 10, 7)
            ]
        ),
    );
    one_writer_at_a_time(&lun);
}

/// A peer's replay that stops midway (its own cache device fails after it wrote some of the
/// datastore: the vault then names it owner, at the same generation, handed on) leaves the
/// owner of a `wbp:1` volume waiting for a replay nothing will finish. The operator can
/// accept the loss then too: the datastore keeps what the replay wrote, the owner serves it
/// uncached.
#[test]
fn an_accepted_loss_ends_a_replay_that_stopped_midway() {
    let etcd = Etcd::start();
    // Each datastore write takes 300 ms, so the replay's windows take seconds.
    let lun = Nbdkit::start(128 << 20, &["--filter=delay"], &["wdelay=300ms"]);
    let a = host(&etcd, "a", "rack1", "127.0.0.2", &lun);
    let b = host(&etcd, "b", "rack2", "127.0.0.3", &lun);
    create_held_sized(&a, "w", "wbp:1", "64M");
    wait_replicating(&a, "w", &["b"]);
    qemu_io(&a.url("w"), &["write -P 8 0 40M"]);
    let gen = vault(&etcd)["gen"].as_u64().expect("vault gen");
    a.fail_cache_device();
    // (A replay records its checkpoint once, at its end: its first writes show it began.)
    let v = wait_for(
        Duration::from_secs(60),
        "b to begin writing the datastore",
        || {
            let v = vault(&etcd);
            let began = on_datastore(&lun, 1 << 20).iter().all(|x| *x == 8);
            (v["owner"] == "b" && began).then_some(v)
        },
    );
    b.fail_cache_device();
    wait_for(Duration::from_secs(30), "b's replay to stop", || {
        b.log().contains("replay stopped").then_some(())
    });
    std::thread::sleep(Duration::from_secs(2));
    let now = vault(&etcd);
    assert_eq!(now["gen"], gen, "the replay ended: {now}");
    assert_eq!(now["owner"], "b", "{now}");
    let r = a.vesta_json(&["volume", "accept-loss", "w", "--yes"]);
    assert_eq!(r["accepted"], true, "{r}");
    let s = show(&a, "w");
    assert_eq!(s["policy"], "uncached", "{s}");
    // What b's first pieces wrote stays; the volume reads what the datastore holds. b's
    // replay recorded no checkpoint (only its end would have), so the report counts all
    // that was dirty above the vault's checkpoint as lost: a had 40 MiB dirty.
    let upto = now["checkpoint"].as_u64().unwrap();
    assert_eq!(upto, v["checkpoint"].as_u64().unwrap(), "{now}");
    assert!(r["checkpoint"].as_u64() >= Some(upto), "{r}");
    let lost = r["dirty_bytes"].as_u64().unwrap();
    assert!(lost > 0 && lost <= 40 << 20, "{r}");
    assert!(vault(&etcd)["checkpoint"].as_u64() >= Some(upto));
    qemu_io(&a.url("w"), &["read -P 8 0 1M", "write -P 9 0 4k", "flush"]);
    let img = on_datastore(&lun, 1 << 20);
    assert!(img[..4096].iter().all(|x| *x == 9) && img[4096..].iter().all(|x| *x == 8));
    assert!(!b.log().contains("online replay done"), "{}", b.log());
    one_writer_at_a_time(&lun);
}

/// A peer's replay that stops on a host that goes on running (its own cache device fails
/// midway) is handed on, and the next peer finishes it. The vault used to go on naming the
/// stopped replayer, alive, and the other peer waited for it for as long as it ran.
#[test]
fn a_replay_that_stops_on_a_live_peer_is_finished_by_the_next_peer() {
    let etcd = Etcd::start();
    // Each datastore write takes 300 ms, so the replay's windows take seconds.
    let lun = Nbdkit::start(128 << 20, &["--filter=delay"], &["wdelay=300ms"]);
    let a = host(&etcd, "a", "rack1", "127.0.0.2", &lun);
    let b = host(&etcd, "b", "rack2", "127.0.0.3", &lun);
    let c = host(&etcd, "c", "rack2", "127.0.0.4", &lun);
    create_held_sized(&a, "w", "wbp:2", "64M");
    wait_replicating(&a, "w", &["b", "c"]);
    qemu_io(&a.url("w"), &["write -P 8 0 40M"]);
    a.fail_cache_device();
    // (A replay records its checkpoint once, at its end: its first writes show it began.)
    let first = wait_for(
        Duration::from_secs(60),
        "a peer to begin writing the datastore",
        || {
            let v = vault(&etcd);
            let owner = v["owner"].as_str().unwrap_or("").to_owned();
            let began = on_datastore(&lun, 1 << 20).iter().all(|x| *x == 8);
            (owner != "a" && began).then_some(owner)
        },
    );
    let (stopped, other) = if first == "b" { (&b, &c) } else { (&c, &b) };
    stopped.fail_cache_device();
    wait_for(
        Duration::from_secs(120),
        "the other peer to finish the replay",
        || other.log().contains("online replay done").then_some(()),
    );
    assert!(
        !stopped.log().contains("online replay done"),
        "the replay finished before it could be stopped; slow the datastore down"
    );
    assert!(
        on_datastore(&lun, 40 << 20).iter().all(|x| *x == 8),
        "after the replay the datastore must hold every completed write"
    );
    one_writer_at_a_time(&lun);
}

/// A hand-off no peer can take (a double failure, beyond FVP Table 1): the peer's host dies
/// without a word while the owner's link to it is idle and comes back on an empty cache
/// device, and the owner's cache device fails with dirty data before the owner notices (its
/// keep-alive would within seconds; here it is set to an hour, so the test does not race
/// it), while the vault still names the peer. What the two caches held is gone. The owner must not
/// stall forever waiting for a replay nobody can do: it asks the peer, hears that it holds
/// nothing, and reports the loss as when no peer is named. Writes fail, a read of what was
/// lost fails rather than return older data, other reads go on from the datastore, and the
/// datastore is still the prefix it was.
#[test]
fn a_hand_off_to_a_peer_that_holds_nothing_reports_the_loss() {
    let etcd = Etcd::start();
    let lun = Nbdkit::start(128 << 20, &[], &[]);
    let a = etcd.host(
        &lun,
        Host {
            cluster: "peer_keepalive_s = 3600\n",
            ..Host::new("a", "rack1", "127.0.0.2")
        },
    );
    let (mut b, proxy) = host_behind_proxy(&etcd, "b", "rack2", "127.0.0.3", "127.0.0.5", &lun);
    create_held(&a, "w", "wbp:1");
    wait_replicating(&a, "w", &["b"]);
    qemu_io(&a.url("w"), &["write -P 4 0 1M"]);
    proxy.freeze();
    b.kill9();
    std::fs::remove_file(b.data_dir.join("cache.img")).expect("remove b's cache file");
    b.launch();
    let s = wait_replicating(&a, "w", &["b"]);
    assert_eq!(s["cache"]["dirty_bytes"], 1 << 20, "{s}");
    a.fail_cache_device();
    wait_for(Duration::from_secs(40), "a to report the loss", || {
        a.log()
            .contains("holds nothing of the volume")
            .then_some(())
    });
    let v = vault(&etcd);
    assert_eq!(v["peers"], serde_json::json!([]), "{v}");
    assert_ne!(v["handoff"], true, "{v}");
    assert_eq!(v["owner"], "a", "{v}");
    for (op, what) in [
        ("write -P 5 2M 64k", "a write"),
        ("read 0 64k", "a read of lost data"),
    ] {
        let out = vesta_tests::run(std::process::Command::new("qemu-io").args([
            "-f",
            "raw",
            "-c",
            op,
            &a.url("w"),
        ]));
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() || text.contains("failed"),
            "{what} must fail once the loss is reported: {text}"
        );
    }
    qemu_io(&a.url("w"), &["read -P 0 4M 64k"]);
    assert!(
        on_datastore(&lun, 4 << 20).iter().all(|x| *x == 0),
        "the datastore must still be the prefix it was (nothing destaged)"
    );
    assert!(!b.log().contains("online replay done"), "{}", b.log());
    one_writer_at_a_time(&lun);
}

/// An owner whose hand-off has not ended asks its peers whether any still holds the volume
/// (above), but not once the vault names a replaying peer: that peer names itself before it
/// writes anything. Should the owner ask a peer in the middle of its replay all the same
/// (before that record), the peer holds its replicas no longer as such but still says it
/// holds the volume (engine `wbp_replay.rs` checks it), it holds the vault lock, and the
/// vault write a loss needs is refused without that lock. This test checks the outcome with
/// real hosts: the LUN fails every write for a while, so the replay waits with the lock
/// held, for longer than the owner's asking interval, and the owner reports no loss.
#[test]
fn an_owner_reports_no_loss_while_its_peer_replays() {
    let etcd = Etcd::start();
    let (lun, errors) = Nbdkit::start_failing(128 << 20, "pwrite", &[], &[]);
    let a = host(&etcd, "a", "rack1", "127.0.0.2", &lun);
    let b = host(&etcd, "b", "rack2", "127.0.0.3", &lun);
    create_held(&a, "w", "wbp:1");
    wait_replicating(&a, "w", &["b"]);
    qemu_io(&a.url("w"), &["write -P 6 0 64k", "write -P 7 1M 64k"]);
    errors.on();
    a.fail_cache_device();
    wait_for(Duration::from_secs(30), "b to start replaying", || {
        b.log().contains("replaying 2 write(s)").then_some(())
    });
    assert_eq!(
        vault(&etcd)["owner"],
        "b",
        "the replaying peer names itself"
    );
    // Longer than the owner's interval between questions (5 s).
    std::thread::sleep(Duration::from_secs(7));
    assert!(
        !a.log().contains("holds nothing of the volume"),
        "{}",
        a.log()
    );
    errors.off();
    peer_replays_then_owner_goes_uncached(&a, &b, Duration::from_secs(60));
    let log = a.log();
    assert!(!log.contains("holds nothing of the volume"), "{log}");
    assert_eq!(
        on_datastore(&lun, 2 << 20),
        expect(2 << 20, &[(0, 64 << 10, 6), (1 << 20, 64 << 10, 7)]),
        "the replay must leave every completed write on the datastore"
    );
    qemu_io(&a.url("w"), &["read -P 6 0 64k", "write -P 8 64k 4k"]);
    one_writer_at_a_time(&lun);
}

/// A peer about to replay names itself in the vault before it writes the datastore. An
/// owner that comes back (cut off from etcd, its lease lapsed while it lived) must find that
/// another host wrote its volume even if the replay stopped before its first checkpoint
/// update: otherwise it took the lock back as its own and destaged on from its checkpoint,
/// over blocks the replay had set back. Here the LUN fails the replay's writes, so no
/// checkpoint update comes; the vault names b all the same, and the replay completes once
/// the LUN takes writes again.
#[test]
fn a_replaying_peer_names_itself_in_the_vault_before_it_writes() {
    let etcd = Etcd::start();
    let (lun, errors) = Nbdkit::start_failing(128 << 20, "pwrite", &[], &[]);
    let mut a = host(&etcd, "a", "rack1", "127.0.0.2", &lun);
    let b = host(&etcd, "b", "rack2", "127.0.0.3", &lun);
    create_held(&a, "w", "wbp:1");
    wait_replicating(&a, "w", &["b"]);
    qemu_io(&a.url("w"), &["write -P 6 0 64k", "write -P 7 1M 64k"]);
    errors.on();
    a.kill9();
    wait_for(
        Duration::from_secs(TTL_S + 20),
        "b to start replaying",
        || b.log().contains("replaying 2 write(s)").then_some(()),
    );
    let v = vault(&etcd);
    assert_eq!(
        v["owner"], "b",
        "the replay started with the vault naming a: {v}"
    );
    assert!(
        on_datastore(&lun, 2 << 20).iter().all(|x| *x == 0),
        "the LUN took none of the replay's writes"
    );
    errors.off();
    wait_for(Duration::from_secs(60), "b's replay to end", || {
        b.log().contains("online replay done").then_some(())
    });
    assert_eq!(
        on_datastore(&lun, 2 << 20),
        expect(2 << 20, &[(0, 64 << 10, 6), (1 << 20, 64 << 10, 7)])
    );
    one_writer_at_a_time(&lun);
}

/// FVP Table 1's last cascade: the owner and its only peer both die. The owner's cache file
/// survives; another host replays it (surrogate replay) and the datastore is current.
#[test]
fn when_owner_and_peers_all_die_another_host_replays_the_owners_cache_file() {
    let etcd = Etcd::start();
    let lun = Nbdkit::start(128 << 20, &[], &[]);
    let mut a = host(&etcd, "a", "rack1", "127.0.0.2", &lun);
    let mut b = host(&etcd, "b", "rack2", "127.0.0.3", &lun);
    create_held(&a, "w", "wbp:1:remote");
    wait_replicating(&a, "w", &["b"]);
    let c = host(&etcd, "c", "rack2", "127.0.0.4", &lun);
    qemu_io(
        &a.url("w"),
        &["write -P 6 0 1M", "write -P 7 6M 4k", "flush"],
    );
    a.kill9();
    b.kill9();
    // Both leases expire; nobody holds replicas to replay from.
    std::thread::sleep(Duration::from_secs(TTL_S + 1));
    assert!(on_datastore(&lun, 8 << 20).iter().all(|x| *x == 0));
    let cache = a.data_dir.join("cache.img");
    let out = c.vesta_ok(&["host", "replay-cache", &cache.display().to_string()]);
    assert!(out.contains("replayed 2 write(s)"), "{out}");
    assert_eq!(
        on_datastore(&lun, 8 << 20),
        expect(8 << 20, &[(0, 1 << 20, 6), (6 << 20, 4096, 7)]),
    );
    // The replay checkpointed the file: done twice, it finds nothing left to do.
    let out = c.vesta_ok(&["host", "replay-cache", &cache.display().to_string()]);
    assert!(out.contains("no dirty data"), "{out}");
    // The owner returns to a current datastore.
    a.launch();
    qemu_io(&a.url("w"), &["read -P 6 0 1M", "read -P 7 6M 4k"]);
    drop(b);
    one_writer_at_a_time(&lun);
}

/// The same cascade, but the peer had begun an online replay of the owner's volume and died
/// in it. Its replay started from the newest checkpoint the peers knew, which can be older
/// than the owner's own (the owner forwards checkpoints asynchronously), and may have set
/// blocks back to older data: a replay of the owner's file, which holds nothing below its
/// checkpoint, would not put them right. So the volume is left alone, the datastore and the
/// vault untouched, until the operator forces it.
#[test]
fn a_surrogate_replay_leaves_a_volume_whose_peer_replay_stopped_below_the_files_checkpoint() {
    let etcd = Etcd::start();
    let lun = Nbdkit::start(128 << 20, &[], &[]);
    let mut a = host(&etcd, "a", "rack1", "127.0.0.2", &lun);
    let mut b = host(&etcd, "b", "rack2", "127.0.0.3", &lun);
    a.vesta_ok(&[
        "volume",
        "create",
        "w",
        "--size",
        "8M",
        "--policy",
        "wbp:1:remote",
    ]);
    wait_replicating(&a, "w", &["b"]);
    let c = host(&etcd, "c", "rack2", "127.0.0.4", &lun);
    // A checkpoint in the owner's file above 0, then a write the datastore never sees.
    qemu_io(&a.url("w"), &["write -P 6 0 1M", "flush"]);
    let checkpoint = wait_for(Duration::from_secs(30), "the write destaged", || {
        let s = show(&a, "w");
        let c = s["cache"]["checkpoint"].as_u64().unwrap_or(0);
        (s["cache"]["dirty_bytes"] == 0 && c > 0).then_some(c)
    });
    lun.close_door("a");
    qemu_io(&a.url("w"), &["write -P 7 6M 4k", "flush"]);
    a.kill9();
    b.kill9();
    std::thread::sleep(Duration::from_secs(TTL_S + 1));
    // What b leaves when it names itself to replay from checkpoint 0 and dies.
    let mut v = vault(&etcd);
    assert_eq!(v["owner"], "a", "{v}");
    v["owner"] = "b".into();
    v["previous_owner"] = "a".into();
    v["checkpoint"] = 0.into();
    let key = format!("/vesta/vaults/{}", v["volume"].as_str().unwrap());
    let out = etcd.etcdctl_retrying(&["put", &key, &v.to_string()]);
    assert!(out.status.success(), "etcdctl put: {out:?}");
    let before = on_datastore(&lun, 8 << 20);
    assert_eq!(before, expect(8 << 20, &[(0, 1 << 20, 6)]));

    let cache = a.data_dir.join("cache.img").display().to_string();
    let refused = c.vesta(&["host", "replay-cache", &cache]);
    assert!(!refused.status.success(), "{refused:?}");
    let out = String::from_utf8_lossy(&refused.stdout);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(err.contains("1 volume(s) with dirty data"), "{err}");
    assert!(out.contains("not replayed"), "{out}");
    assert!(
        out.contains("\"b\" began replaying it")
            && out.contains("no further than write 0")
            && out.contains(&format!("checkpoint {checkpoint}"))
            && out.contains("--force"),
        "{out}"
    );
    assert_eq!(
        on_datastore(&lun, 8 << 20),
        before,
        "the datastore was written"
    );
    assert_eq!(vault(&etcd), v, "the vault was written");

    let out = c.vesta_ok(&["host", "replay-cache", &cache, "--force"]);
    assert!(
        out.contains("replayed 1 write(s)") && out.contains("forced"),
        "{out}"
    );
    assert_eq!(
        on_datastore(&lun, 8 << 20),
        expect(8 << 20, &[(0, 1 << 20, 6), (6 << 20, 4096, 7)]),
    );
    one_writer_at_a_time(&lun);
}

/// An owner that stalls past its lease (SIGSTOP: a frozen VM host, a long GC pause) while a
/// peer replays its volume and gives the lock back must not take the lock again as if
/// nothing happened: its copy of the volume is stale, and its fence stays closed until it
/// restarts.
#[test]
fn an_owner_that_stalled_past_its_lease_while_a_peer_replayed_stays_fenced() {
    let etcd = Etcd::start();
    let lun = Nbdkit::start(128 << 20, &[], &[]);
    let a = host(&etcd, "a", "rack1", "127.0.0.2", &lun);
    let b = host(&etcd, "b", "rack2", "127.0.0.3", &lun);
    create_held(&a, "w", "wbp:1");
    wait_replicating(&a, "w", &["b"]);
    a.vesta_ok(&["volume", "create", "u", "--size", "1M"]);
    qemu_io(&a.url("w"), &["write -P 5 0 1M"]);
    qemu_io(&a.url("u"), &["write -P 1 0 4k"]);

    vesta_tests::signal(a.pid(), libc::SIGSTOP);
    wait_for(
        Duration::from_secs(TTL_S + 20),
        "b to replay a's volume",
        || b.log().contains("online replay done").then_some(()),
    );
    assert_eq!(
        on_datastore(&lun, 1 << 20),
        expect(1 << 20, &[(0, 1 << 20, 5)])
    );
    vesta_tests::signal(a.pid(), libc::SIGCONT);
    wait_for(
        Duration::from_secs(30),
        "a to find its lock was taken over",
        || a.log().contains("lost the vault locks").then_some(()),
    );
    assert!(a.log().contains("host \"b\" took it over"), "{}", a.log());
    assert!(!a.log().contains("datastore writes resume"), "{}", a.log());
    // No datastore write from a any more, whatever the volume.
    assert!(
        !vesta_tests::try_write(&a.url("u"), 2, 0),
        "a wrote a datastore after losing a lock"
    );
}

/// The policy changes of the cluster's policy-change campaign.
const CLUSTER_CHANGES: [(&str, &[&str]); 4] =
    [("wbp:1", &[]), ("wt", &[]), ("wb", &[]), ("uncached", &[])];

/// Waits until `name` serves IO on `v` in `policy` (wbp with a working peer) with no dirty
/// data left.
fn wait_settled_in(v: &Vestad, name: &str, policy: &str) {
    wait_for(
        Duration::from_secs(TTL_S + 40),
        "the volume to settle",
        || {
            let s = show(v, name);
            let settled = match policy {
                "uncached" => s["cache"].is_null(),
                _ => s["cache"]["mode"] == policy && s["cache"]["dirty_bytes"] == 0,
            };
            (s["status"] == "ok" && s["policy"] == policy && settled).then_some(())
        },
    )
}

/// The policy-change campaign with a peer (FVP Table 1, host row, across policy switches):
/// under the checker's writes to a volume on `a`, a second client switches it at random
/// between `wbp:1`, `wt`, `wb` and `uncached`, and `a` is killed with SIGKILL at a random
/// moment or just after a switch starts (while it drains, or while it sets up its peer). `a`
/// comes back at once in some rounds (racing `b`'s online replay for the vault lock) and only
/// after `b` is done in others. Every completed write reads back through `a`, a completed
/// switch is never undone, and once the volume settles the datastore holds exactly what `a`
/// serves, with never two hosts writing it at a time. `VESTA_WBP_POLICY_ROUNDS` sets the
/// rounds (default 3).
#[test]
fn completed_writes_survive_the_owners_death_during_policy_changes() {
    let (rounds, seed0) = campaign("wbp policy change", "VESTA_WBP_POLICY_ROUNDS", 3);
    let etcd = Etcd::start();
    let mut lun = campaign_lun();
    let mut a = host(&etcd, "a", "rack1", "127.0.0.2", &lun);
    let b = host(&etcd, "b", "rack2", "127.0.0.3", &lun);
    create_checked(&a, "c", "wbp:1");
    wait_replicating(&a, "c", &["b"]);
    let ck = Checker::new();
    let mut rng = Xorshift(seed0 | 1);
    let mut last = "wbp:1".to_owned();
    let (mut changes, mut cut, mut replays_by_b) = (0, 0, 0);
    let replays = |h: &Vestad| h.log().matches("online replay done").count();
    for round in 0..rounds {
        let seed = rng.next_u64();
        let mut r = Xorshift(seed | 1);
        let writers = ck.write(a.url("c"), seed);
        let changer = PolicyChanger::start(&a.api, "c", &CLUSTER_CHANGES, r.next_u64());
        if round.is_multiple_of(2) {
            std::thread::sleep(Duration::from_millis(100 + r.next_u64() % 900));
        } else {
            let to = CLUSTER_CHANGES[(r.next_u64() % 4) as usize].0;
            changer.wait_for_a_change_to(&[to], Duration::from_secs(10));
            std::thread::sleep(Duration::from_millis(r.next_u64() % 60));
        }
        let replays_before = replays(&b);
        changer.killing();
        a.kill9();
        writers.stop();
        let did = changer.join();
        changes += did.completed;
        cut += u64::from(did.cut_short.is_some());
        lun.outlive_killed_client();
        let named_b = vault(&etcd)["peers"]
            .as_array()
            .is_some_and(|p| !p.is_empty());
        if named_b && r.next_u64().is_multiple_of(2) {
            // b replays what a held once a's lease is gone; a returns afterwards.
            wait_for(Duration::from_secs(TTL_S + 30), "b's online replay", || {
                lun.keep_running();
                (replays(&b) > replays_before).then_some(())
            });
            datastore_has_completed_writes(&lun, &ck.known, round, seed);
        }
        // Otherwise a comes back at once: it waits for its old lease to lapse, and then
        // either it or b gets the vault lock first.
        a.launch();
        replays_by_b += replays(&b) - replays_before;
        // A completed switch is never undone, one the kill cut short may or may not be
        // done; a wbp volume runs in wt until its peer is back in place.
        let expected = did.possible(&last);
        let now = wait_for(
            Duration::from_secs(TTL_S + 40),
            &format!("round {round} (seed {seed}): a to serve the volume in one of {expected:?}"),
            || {
                let s = show(&a, "c");
                let p = s["policy"].as_str().unwrap_or("");
                (s["status"] == "ok" && expected.contains(&p)).then(|| p.to_owned())
            },
        );
        let got = ck.read(&a.url("c"));
        let completed = settle_to(&got, &ck.known, round, seed);
        assert!(
            completed > 0,
            "round {round}: the checker completed no writes"
        );
        wait_settled_in(&a, "c", &now);
        owner_reads_the_datastore(&ck, &a, "c", &lun, round, seed);
        eprintln!(
            "round {round} (seed {seed}): killed after {} change(s) (cut short: {:?}), in \
             {now} after the restart",
            did.completed, did.cut_short
        );
        last = now;
    }
    eprintln!(
        "wbp policy change campaign: {changes} changes completed, {cut} cut short; b \
         replayed {replays_by_b} time(s) in {rounds} rounds"
    );
    assert!(
        changes + cut >= rounds,
        "only {changes} policy change(s) completed and {cut} cut short in {rounds} rounds; the \
         campaign is too gentle"
    );
    one_writer_at_a_time(&lun);
}

/// Power cuts of a `wbp:1` owner at random moments (DESIGN §2 with FVP §7): under the
/// checker's writes, a few with FUA and the rest made durable by FLUSHes sent as they go, the
/// owner's cache device loses every write no sync covered and the owner stops at once. In
/// some rounds the peer replays (from its replicas, which the cut did not touch) before the
/// owner returns, and the datastore image itself must then hold every durable write; in the
/// others the owner comes back at once and races the peer for the vault lock, replaying its
/// own log if it wins. Either way every durable write reads back through the owner, and once
/// the volume is back in `wbp` and clean the datastore holds exactly what it serves.
/// `VESTA_WBP_POWER_CUT_ROUNDS` sets the rounds (default 2).
#[test]
fn durable_writes_survive_the_owners_power_cut() {
    let (rounds, seed0) = campaign("wbp power cut", "VESTA_WBP_POWER_CUT_ROUNDS", 2);
    let etcd = Etcd::start();
    let mut lun = campaign_lun();
    let mut a = host(&etcd, "a", "rack1", "127.0.0.2", &lun);
    let b = host(&etcd, "b", "rack2", "127.0.0.3", &lun);
    create_checked(&a, "c", "wbp:1");
    let ck = Checker::new();
    let mut rng = Xorshift(seed0 | 1);
    let replays = |h: &Vestad| h.log().matches("online replay done").count();
    let (mut lost, mut by_b) = (0, 0);
    for round in 0..rounds {
        let seed = rng.next_u64();
        let mut r = Xorshift(seed | 1);
        wait_replicating(&a, "c", &["b"]);
        a.record_power_cut();
        let before = replays(&b);
        let writers = ck.write_flushing(a.url("c"), seed);
        std::thread::sleep(Duration::from_millis(100 + r.next_u64() % 500));
        lost += a.power_cut();
        writers.stop();
        lun.outlive_killed_client();
        if r.next_u64().is_multiple_of(2) {
            wait_for(Duration::from_secs(TTL_S + 30), "b's online replay", || {
                lun.keep_running();
                (replays(&b) > before).then_some(())
            });
            assert_holds_durable(
                &on_datastore(&lun, (BLOCKS * BLOCK) as usize),
                &ck.known,
                round,
                seed,
            );
        }
        a.launch();
        let got = {
            wait_for(Duration::from_secs(TTL_S + 40), "a to serve c", || {
                (show(&a, "c")["status"] == "ok").then_some(())
            });
            ck.read(&a.url("c"))
        };
        assert_holds_durable(&got, &ck.known, round, seed);
        reset_to(&got, &ck.known);
        wait_settled_in(&a, "c", "wbp:1");
        owner_reads_the_datastore(&ck, &a, "c", &lun, round, seed);
        let replayed = replays(&b) - before;
        by_b += replayed;
        eprintln!("round {round} (seed {seed}): b replayed {replayed} time(s)");
    }
    eprintln!(
        "wbp power cut campaign: the cuts undid {lost} unsynced write(s) in the owner's log; b \
         replayed in {by_b} of {rounds} rounds"
    );
    one_writer_at_a_time(&lun);
}
