//! Several hosts sharing one etcd (DESIGN §4, §10): registration with a lease and a fault
//! domain, volumes owned by one host and visible from all, a LUN's volume table shared safely,
//! self-fencing when the lease cannot be renewed, and a killed host taking its volumes back.
//!
//! Every host is a real `vestad` on its own loopback address (127.0.0.2, 127.0.0.3, …); the
//! etcd is a real one-member cluster; the shared datastore is an nbdkit LUN.

use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;
use vesta_tests::{
    pattern, qemu_io, read_file, run, run_ok, try_read, try_write, wait_for, Etcd, Host, Nbdkit,
    Scratch, Vestad, CLUSTER_TTL_S, LUN_EXTENT,
};

const TTL_S: u64 = CLUSTER_TTL_S;

fn host(etcd: &Etcd, name: &str, fault_domain: &str, ip: &str, lun: &Nbdkit) -> Vestad {
    etcd.host(lun, Host::new(name, fault_domain, ip))
}

fn hosts(v: &Vestad) -> Vec<Value> {
    v.vesta_json(&["host", "list"])
        .as_array()
        .expect("host list is an array")
        .clone()
}

fn host_named<'a>(list: &'a [Value], name: &str) -> &'a Value {
    list.iter()
        .find(|h| h["name"] == name)
        .unwrap_or_else(|| panic!("host {name} not in {list:?}"))
}

fn volumes(v: &Vestad) -> Vec<Value> {
    v.vesta_json(&["volume", "list"])
        .as_array()
        .expect("volume list is an array")
        .clone()
}

/// Writes 4 KiB at `offset` through qemu-io; returns whether it succeeded.
#[test]
fn hosts_register_and_each_volume_is_served_by_its_owner() {
    let etcd = Etcd::start();
    let lun = Nbdkit::start(256 << 20, &[], &[]);
    let a = host(&etcd, "a", "rack1", "127.0.0.2", &lun);
    let b = host(&etcd, "b", "rack2", "127.0.0.3", &lun);

    let list = hosts(&b);
    assert_eq!(list.len(), 2, "{list:?}");
    for (name, fd, ip) in [("a", "rack1", "127.0.0.2"), ("b", "rack2", "127.0.0.3")] {
        let h = host_named(&list, name);
        assert_eq!(h["fault_domain"], fd);
        assert_eq!(h["alive"], true);
        assert!(h["api"].as_str().unwrap().contains(ip), "{h}");
        assert!(h["cache_bytes"].as_u64().unwrap() > 0, "{h}");
    }
    let st = a.vesta_json(&["status"]);
    assert_eq!(st["coordinator"], "etcd");
    assert_eq!(st["host"], "a");

    a.vesta_ok(&["volume", "create", "x", "--size", "8M", "--policy", "wb"]);
    qemu_io(&a.url("x"), &["write -P 7 0 1M"]);
    // b sees the volume, served by a, and refuses to act on it, naming a.
    let x = volumes(&b)
        .into_iter()
        .find(|v| v["name"] == "x")
        .expect("x listed on b");
    assert_eq!(x["owner"], "a");
    assert!(
        x["status"].as_str().unwrap().contains("served by host a"),
        "{x}"
    );
    // The shared LUN holds it, whichever host lists the datastores.
    let ds = b.vesta_json(&["datastore", "list"]);
    assert_eq!(ds[0]["name"], "san");
    assert_eq!(ds[0]["volumes"], 1, "{ds}");
    assert!(
        x["urls"][0].as_str().unwrap().contains(&a.nbd_tcp),
        "{x} should point at a's NBD address {}",
        a.nbd_tcp
    );
    let e = b.vesta_err(&["volume", "policy", "x", "wt"]);
    assert!(e.contains("served by host a") && e.contains(&a.api), "{e}");
    let e = b.vesta_err(&["volume", "delete", "x"]);
    assert!(e.contains("served by host a"), "{e}");
    let e = b.vesta_err(&["volume", "create", "x", "--size", "8M"]);
    assert!(e.contains("already exists"), "{e}");
    // b cannot attach it either: it does not serve it.
    let out = run(Command::new("qemu-io").args(["-f", "raw", "-c", "read 0 4k", &b.url("x")]));
    assert!(!out.status.success(), "b must not serve a's volume");
    assert_eq!(
        host_named(&hosts(&b), "a")["volumes"],
        1,
        "a owns one volume"
    );
    // The vault record names the owner; its lock is held.
    let keys = etcd.keys("/vesta/");
    let id = x["id"].as_str().unwrap();
    assert!(
        keys.contains(&format!("/vesta/vault-locks/{id}")),
        "{keys:?}"
    );
    let vault = run_ok(
        Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .args(["--endpoints", &etcd.endpoint, "get", "--print-value-only"])
            .arg(format!("/vesta/vaults/{id}")),
    );
    let vault: Value = serde_json::from_str(vault.trim()).expect("vault is JSON");
    assert_eq!(vault["owner"], "a");
    assert_eq!(vault["policy"], "wb");
    qemu_io(&a.url("x"), &["read -P 7 0 1M"]);
}

#[test]
fn volumes_created_at_once_on_two_hosts_never_share_lun_space() {
    let etcd = Etcd::start();
    let lun = Nbdkit::start(512 << 20, &[], &[]);
    let a = host(&etcd, "a", "rack1", "127.0.0.2", &lun);
    let b = host(&etcd, "b", "rack1", "127.0.0.3", &lun);
    const EACH: usize = 5;
    // Both hosts allocate from one LUN table at the same time.
    std::thread::scope(|s| {
        for (v, tag) in [(&a, "a"), (&b, "b")] {
            s.spawn(move || {
                for i in 0..EACH {
                    v.vesta_ok(&["volume", "create", &format!("{tag}{i}"), "--size", "16M"]);
                }
            });
        }
    });
    // Each volume gets its own pattern through its owner; then every pattern must be intact.
    let dir = Scratch::new("cluster-lun");
    let all: Vec<(&Vestad, String, u64)> = (0..EACH)
        .flat_map(|i| {
            [
                (&a, format!("a{i}"), i as u64),
                (&b, format!("b{i}"), 100 + i as u64),
            ]
        })
        .collect();
    for (v, name, seed) in &all {
        let f = dir.join(name);
        std::fs::write(&f, pattern(*seed, 16 << 20)).unwrap();
        run_ok(
            Command::new("qemu-img")
                .args(["convert", "-n", "-f", "raw", "-O", "raw"])
                .arg(&f)
                .arg(v.url(name)),
        );
    }
    for (v, name, seed) in &all {
        let out = dir.join(&format!("{name}.back"));
        run_ok(
            Command::new("qemu-img")
                .args(["convert", "-f", "raw", "-O", "raw"])
                .arg(v.url(name))
                .arg(&out),
        );
        assert!(
            read_file(&out) == pattern(*seed, 16 << 20),
            "volume {name} was overwritten by another volume's data"
        );
    }
    // Both hosts list all ten, and each serves its own five.
    for v in [&a, &b] {
        let list = volumes(v);
        assert_eq!(list.len(), 2 * EACH, "{list:?}");
        let own = list.iter().filter(|x| x["status"] == "ok").count();
        assert_eq!(own, EACH, "{list:?}");
    }
}

#[test]
fn a_host_that_cannot_renew_its_lease_stops_datastore_writes_in_time() {
    let etcd = Etcd::start();
    let lun = Nbdkit::start(128 << 20, &[], &[]);
    let a = host(&etcd, "a", "rack1", "127.0.0.2", &lun);
    a.vesta_ok(&["volume", "create", "u", "--size", "8M"]);
    a.vesta_ok(&["volume", "create", "w", "--size", "8M", "--policy", "wb"]);
    assert!(try_write(&a.tcp_url("u"), 1, 0));

    // Short stalls of etcd (an election, a slow disk) leave renewals answered late. A late
    // answer must not count for a later renewal: a few of them would keep the fence open
    // past the lease after the cut below.
    for _ in 0..3 {
        etcd.pause();
        std::thread::sleep(Duration::from_millis(1200));
        etcd.resume();
        std::thread::sleep(Duration::from_millis(400));
    }
    wait_for(
        Duration::from_secs(10),
        "writes to go on after the stalls",
        || try_write(&a.tcp_url("u"), 1, 0).then_some(()),
    );

    // Cut the host off from etcd. The lease can expire TTL after the last renewal etcd
    // received, which was at most one renewal interval (TTL/6) before the cut.
    etcd.pause();
    let cut = Instant::now();
    let earliest_expiry = Duration::from_secs(TTL_S) - Duration::from_secs(TTL_S) / 6;
    let mut first_refused = None;
    // Each renewal opens the fence until TTL/2 after it was sent, and none was sent after
    // the cut: a write that started later than that and still went through was let through
    // by a renewal counted from the wrong send time.
    let fence_limit = Duration::from_secs(TTL_S) / 2 + Duration::from_millis(100);
    let mut i = 0u64;
    while cut.elapsed() < Duration::from_secs(TTL_S + 2) {
        i += 1;
        let started = cut.elapsed();
        if !try_write(&a.tcp_url("u"), 2, (i % 64) * 4096) {
            first_refused.get_or_insert(cut.elapsed());
        } else {
            assert!(
                first_refused.is_none(),
                "a write reached the datastore after the fence closed"
            );
            assert!(
                started < fence_limit,
                "a write that started {started:?} after the cut reached the datastore; the \
                 fence must close {fence_limit:?} after it"
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let refused = first_refused.expect("datastore writes never stopped without a lease");
    assert!(
        refused < earliest_expiry,
        "writes stopped {refused:?} after the cut; the lease may expire after {earliest_expiry:?}"
    );
    // Reads of the datastore stop too: by now another host may be replaying the volume,
    // setting blocks back for a while. (vestad logs at most 10 failed IOs a second, and the
    // writes above fail 17 a second: the read goes in a second of its own, or its line may
    // be one of those not logged.)
    std::thread::sleep(Duration::from_millis(1100));
    assert!(
        !try_read(&a.tcp_url("u"), 0),
        "a read of the datastore went through with the host's lease lapsed"
    );
    assert!(
        a.log().contains("datastore reads are fenced"),
        "{}",
        a.log()
    );
    // A write-back volume keeps taking writes into the cache; its destager, fenced, waits.
    qemu_io(&a.url("w"), &["write -P 9 0 1M"]);
    std::thread::sleep(Duration::from_secs(1));
    let w = a.vesta_json(&["volume", "show", "w"]);
    assert_eq!(
        w["cache"]["dirty_bytes"],
        1 << 20,
        "the destager must not write the datastore while fenced: {w}"
    );

    etcd.resume();
    wait_for(
        Duration::from_secs(20),
        "the host to register again",
        || a.log().contains("registered again").then_some(()),
    );
    wait_for(Duration::from_secs(20), "writes to resume", || {
        try_write(&a.tcp_url("u"), 3, 0).then_some(())
    });
    wait_for(Duration::from_secs(30), "dirty data to destage", || {
        let j = a.vesta_json(&["volume", "show", "w"]);
        (j["cache"]["dirty_bytes"] == 0).then_some(())
    });
    qemu_io(&a.url("w"), &["read -P 9 0 1M"]);
    qemu_io(&a.url("u"), &["read -P 3 0 4k"]);
    assert!(
        a.log().contains("fenced"),
        "the refused writes are logged as fenced"
    );
}

#[test]
fn a_killed_host_comes_back_to_its_volumes_and_a_duplicate_name_is_refused() {
    let etcd = Etcd::start();
    let lun = Nbdkit::start(128 << 20, &[], &[]);
    let mut a = host(&etcd, "a", "rack1", "127.0.0.2", &lun);
    let b = host(&etcd, "b", "rack2", "127.0.0.3", &lun);
    a.vesta_ok(&["volume", "create", "w", "--size", "8M", "--policy", "wb"]);
    // Hold destaging back so dirty data is in a's cache when it dies.
    a.vesta_ok(&[
        "volume",
        "policy",
        "w",
        "wb",
        "--hold",
        "60",
        "--max-dirty-age",
        "120",
    ]);
    qemu_io(&a.url("w"), &["write -P 5 0 2M", "flush"]);

    // A second daemon calling itself "a" while a lives is refused, naming the conflict.
    twin_is_refused(&etcd);

    a.kill9();
    wait_for(Duration::from_secs(TTL_S + 5), "b to see a as down", || {
        (host_named(&hosts(&b), "a")["alive"] == false).then_some(())
    });
    let w = volumes(&b)
        .into_iter()
        .find(|v| v["name"] == "w")
        .expect("w listed on b");
    assert!(w["status"].as_str().unwrap().contains("down"), "{w}");

    a.launch();
    // Offline replay brought the dirty data back; the volume serves it.
    qemu_io(&a.url("w"), &["read -P 5 0 2M"]);
    assert_eq!(host_named(&hosts(&b), "a")["alive"], true);
    assert_eq!(a.vesta_json(&["volume", "show", "w"])["status"], "ok");
}

/// Starting a second "a" must fail while the first lives: run directly, since the rig's
/// start waits for readiness.
fn twin_is_refused(etcd: &Etcd) {
    let scratch = Scratch::new("twin");
    let cfg = scratch.join("twin.toml");
    std::fs::write(
        &cfg,
        format!(
            "data_dir = \"{}\"\n[api]\nlisten = \"127.0.0.4:0\"\n[nbd]\ntcp = \"\"\nunix = \"\"\n\
             [cache]\npath = \"\"\n{}",
            scratch.join("data").display(),
            etcd.cluster_config("a", "rack1", TTL_S)
        ),
    )
    .unwrap();
    let started = Instant::now();
    let out = run(Command::new(vesta_tests::bin("vestad"))
        .arg("--config")
        .arg(&cfg));
    assert!(!out.status.success(), "a second vestad named \"a\" started");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("host name \"a\" is registered by another running vestad"),
        "{err}"
    );
    assert!(started.elapsed() < Duration::from_secs(TTL_S + 10));
}

/// A datastore's metadata lock held past one etcd request's timeout (5 s) by another host
/// is waited for, up to its 30 s wait, not failed. A second create on a LUN while the
/// first still zeroes its extent takes this wait. The client's own request timeout answers
/// `Cancelled`, not `DeadlineExceeded`, and only the latter was retried.
#[test]
fn a_datastore_lock_held_past_one_request_timeout_is_waited_for() {
    use cluster::etcd::{EtcdConfig, EtcdCoordinator};
    use cluster::{Coordinator, HostRecord};
    let etcd = Etcd::start();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let host = |name: &str| EtcdConfig {
            endpoints: vec![etcd.endpoint.clone()],
            prefix: "/vesta".into(),
            host: HostRecord {
                name: name.into(),
                fault_domain: "rack1".into(),
                ..Default::default()
            },
            lease_ttl: Duration::from_secs(6),
        };
        let a = EtcdCoordinator::connect(host("a")).await.unwrap();
        let b = EtcdCoordinator::connect(host("b")).await.unwrap();
        let held = a.lock_datastore("san").await.unwrap();
        let started = Instant::now();
        let waiting = tokio::spawn(async move {
            let r = b.lock_datastore("san").await;
            (r.map(|_| ()), started.elapsed())
        });
        tokio::time::sleep(Duration::from_secs(8)).await;
        assert!(
            !waiting.is_finished(),
            "b stopped waiting while a held the lock"
        );
        a.unlock_datastore(held).await.unwrap();
        let (got, after) = waiting.await.unwrap();
        assert!(got.is_ok(), "b's lock failed after {after:?}: {got:?}");
        assert!(
            after >= Duration::from_secs(8),
            "b got the lock a held: {after:?}"
        );
    });
}

/// A create cut short by a crash between its storage and its record leaves storage no record
/// knows, holding its name and its space. The host's next start imports it (listed, uncached,
/// deletable), as with the `local` coordinator; before, nothing in a cluster ever saw it
/// again. A create under way on another host at that moment holds the datastore's lock over
/// both of its steps, and the import waits for it: it never takes that volume.
#[test]
fn a_create_cut_short_in_a_cluster_is_imported_but_not_a_create_under_way() {
    use cluster::etcd::{EtcdConfig, EtcdCoordinator};
    use cluster::{Coordinator, HostRecord, Policy, VolumeRecord};
    let etcd = Etcd::start();
    let lun = Nbdkit::start(256 << 20, &[], &[]);
    let mut a = host(&etcd, "a", "rack1", "127.0.0.2", &lun);
    a.vesta_ok(&[
        "volume", "create", "cut", "--size", "8M", "--policy", "uncached",
    ]);
    qemu_io(&a.url("cut"), &["write -P 3 0 1M", "flush"]);
    a.kill9();
    wait_lease_gone(&etcd, "a");
    // What a crash between the create's two steps leaves: the storage, no record.
    let out = etcd.etcdctl(&["del", "/vesta/volumes/cut"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "1", "{out:?}");
    a.launch();
    wait_for(
        Duration::from_secs(20),
        "the cut-short volume to serve",
        || {
            let v = volumes(&a).into_iter().find(|v| v["name"] == "cut")?;
            (v["status"] == "ok").then_some(v)
        },
    );
    assert!(
        a.log().contains("a create cut short by a crash"),
        "not reported"
    );
    qemu_io(&a.url("cut"), &["read -P 3 0 1M"]);
    a.vesta_ok(&["volume", "delete", "cut"]);
    assert!(volumes(&a).iter().all(|v| v["name"] != "cut"));

    // Host c is between the two steps of a create (storage made, record not yet) when a
    // starts.
    a.kill9();
    wait_lease_gone(&etcd, "a");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let c = rt
        .block_on(EtcdCoordinator::connect(EtcdConfig {
            endpoints: vec![etcd.endpoint.clone()],
            prefix: "/vesta".into(),
            host: HostRecord {
                name: "c".into(),
                fault_domain: "rack2".into(),
                ..Default::default()
            },
            lease_ttl: Duration::from_secs(6),
        }))
        .unwrap();
    let held = rt.block_on(c.lock_datastore("san")).unwrap();
    let spec = datastore::DatastoreSpec {
        name: "san".into(),
        kind: datastore::Kind::Lun {
            target: lun.uri(),
            lun_id: None,
        },
        class: Default::default(),
        queue_depth: 4,
        direct: false,
    };
    let rec = VolumeRecord {
        id: uuid::Uuid::new_v4(),
        name: "busy".into(),
        size: 8 << 20,
        datastore: "san".into(),
        policy: Policy::Uncached,
        created_unix: 0,
        tuning: Default::default(),
        owner: Some("c".into()),
        moved: None,
    };
    let store = rt
        .block_on(datastore::open(&spec, datastore::OpenMode::Reopen))
        .unwrap();
    rt.block_on(store.create_volume(&rec.spec())).unwrap();
    std::thread::scope(|s| {
        let starting = s.spawn(|| a.launch());
        std::thread::sleep(Duration::from_secs(4));
        assert!(!starting.is_finished(), "a started without the lock");
        rt.block_on(c.create_volume(rec.clone()))
            .expect("a took the volume a create under way had made");
        rt.block_on(c.unlock_datastore(held)).unwrap();
        starting.join().unwrap();
    });
    let busy = volumes(&a)
        .into_iter()
        .find(|v| v["name"] == "busy")
        .expect("c's volume listed");
    assert_eq!(busy["owner"], "c", "{busy}");
    assert!(!a.log().contains("holds volume \"busy\""), "{}", a.log());
}

/// Waits until host `name`'s lease has expired (it was killed), so that it may register
/// again.
fn wait_lease_gone(etcd: &Etcd, name: &str) {
    let key = format!("/vesta/hosts/{name}");
    wait_for(
        Duration::from_secs(TTL_S + 10),
        "the lease to expire",
        || (!etcd.keys("/vesta/hosts/").contains(&key)).then_some(()),
    );
}

/// Two hosts of a pod add one blank LUN under one name at the same moment: one adds it, the
/// other finds it added (the datastore's metadata lock orders them). Before, each could
/// format it; the label written last named a LUN id the recorded datastore did not have, and
/// the LUN was shut out everywhere until removed and added again.
#[test]
fn one_blank_lun_added_at_once_on_two_hosts_is_formatted_once() {
    let etcd = Etcd::start();
    let lun = Nbdkit::start(256 << 20, &[], &[]);
    let a = host(&etcd, "a", "rack1", "127.0.0.2", &lun);
    let b = host(&etcd, "b", "rack1", "127.0.0.3", &lun);
    let blank = Nbdkit::start(256 << 20, &[], &[]);
    let uri = blank.uri();
    let outs: Vec<std::process::Output> = std::thread::scope(|s| {
        let adds: Vec<_> = [&a, &b]
            .into_iter()
            .map(|v| s.spawn(|| v.vesta(&["datastore", "add", "san2", "--lun", &uri])))
            .collect();
        adds.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let ok: Vec<bool> = outs.iter().map(|o| o.status.success()).collect();
    assert_eq!(
        ok.iter().filter(|x| **x).count(),
        1,
        "{:?}",
        outs.iter()
            .map(|o| String::from_utf8_lossy(&o.stderr).into_owned())
            .collect::<Vec<_>>()
    );
    let (winner, loser) = if ok[0] { (&a, 1) } else { (&b, 0) };
    let said = String::from_utf8_lossy(&outs[loser].stderr).into_owned();
    assert!(said.contains("san2") && said.contains("already"), "{said}");
    // The datastore works: a volume on it takes writes and reads them back.
    winner.vesta_ok(&[
        "volume",
        "create",
        "w",
        "--size",
        "16M",
        "--datastore",
        "san2",
    ]);
    qemu_io(
        &winner.url("w"),
        &["write -P 0x5c 0 64k", "read -P 0x5c 0 64k"],
    );
}

/// A clean stop (SIGTERM) lets the host's next start adopt its vault locks at once, so it
/// must leave no datastore write in service: a SAN finishes a write it has taken after its
/// client has gone, and one landing after the next start's writes puts old data over newer.
/// Before, vestad deregistered and exited with the destager's write still at the LUN; the
/// restart adopted the locks, destaged newer data, and the old write then landed over it: the
/// LUN held a version the volume had overwritten, while the volume counted itself clean.
#[test]
fn a_clean_stop_leaves_no_datastore_write_to_land_after_its_next_start() {
    let etcd = Etcd::start();
    let hold = Duration::from_secs(6);
    let (lun, slow) = Nbdkit::start_slow_writes(64 << 20, hold);
    let mut a = host(&etcd, "a", "rack1", "127.0.0.2", &lun);
    a.vesta_ok(&["volume", "create", "w", "--size", "4M", "--policy", "wb"]);
    qemu_io(&a.url("w"), &["write -P 1 0 4k", "flush"]);
    a.wait_clean("w");

    slow.on();
    qemu_io(&a.url("w"), &["write -P 2 0 4k", "flush"]);
    wait_for(
        Duration::from_secs(10),
        "the destager's write of version 2 to reach the LUN",
        || (lun.writes_in_service("a") > 0).then_some(()),
    );
    assert!(a.terminate().success(), "{}", a.log());
    slow.off();
    a.launch();
    qemu_io(&a.url("w"), &["write -P 3 0 4k", "flush"]);
    a.wait_clean("w");
    // Whatever the first incarnation left at the LUN has landed by now.
    wait_for(hold * 2, "the LUN to answer every write", || {
        (lun.writes_in_service("a") == 0).then_some(())
    });
    // One write of the block at a time: none of the restart's while the first
    // incarnation's was in service.
    let block_at = LUN_EXTENT as u64;
    let mut writes: Vec<_> = lun
        .door_writes("a")
        .into_iter()
        .filter(|r| r.offset < block_at + 4096 && r.offset + r.count > block_at)
        .collect();
    writes.sort_by(|x, y| x.start.total_cmp(&y.start));
    assert!(writes.len() >= 3, "versions 1, 2 and 3 written: {writes:?}");
    for w in writes.windows(2) {
        assert!(
            w[1].start >= w[0].end,
            "a write of the block began while another was in service: {:?} then {:?}",
            w[0],
            w[1]
        );
    }
    let image = read_file(&lun.image);
    let block = &image[LUN_EXTENT..LUN_EXTENT + 4096];
    assert!(
        block.iter().all(|&b| b == 3),
        "the LUN holds version {} of a block the volume overwrote with version 3 and \
         destaged\n--- vestad log ---\n{}",
        block[0],
        a.log()
    );
    // The volume's own reads agree once it reads the datastore.
    a.vesta_ok(&["volume", "policy", "w", "uncached"]);
    qemu_io(&a.url("w"), &["read -P 3 0 4k"]);
}
