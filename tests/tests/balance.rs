//! Balancing end to end (issue 5, BASIL): three LUNs served by nbdkit with 3, 6 and 9 worker
//! threads behind a fixed per-IO delay, so latency grows with outstanding IOs over the number
//! of "spindles" (DESIGN §10).
//!
//! - the device models `vestad` fits from live statistics rank the LUNs in spindle order, and
//!   the workload models read fio's shape back (IO size, read share, randomness);
//! - a plan moves load off an overloaded LUN and predicts a lower imbalance; carrying a move
//!   out with `vesta volume relocate --offline` keeps every byte, and is refused while a
//!   client is attached;
//! - initial placement picks the datastore with the lowest predicted load and says why;
//! - `vesta calibrate` runs its fio sweep, stores constants, and the models use them;
//! - a relocation that fails halfway leaves the volume, its bytes and its datastore as they
//!   were, and a volume with dirty data is not relocated;
//! - hosts sharing a LUN (one etcd) model it from their outstanding reads together, and each
//!   host's models hold the other's volumes.

use std::fs;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;
use vesta_tests::{qemu_io, run_ok, wait_for, Etcd, Nbdkit, Scratch, Vestad, VestadOpts};

const DELAY: &str = "2ms";

fn spindles(threads: u32) -> Nbdkit {
    Nbdkit::start(
        1 << 30,
        &[&format!("--threads={threads}"), "--filter=delay"],
        &[&format!("rdelay={DELAY}"), &format!("wdelay={DELAY}")],
    )
}

fn config(luns: &[(&str, &Nbdkit)]) -> String {
    let mut c = String::from("[stats]\ninterval_s = 2\n\n[cache]\npath = \"\"\n");
    for (name, lun) in luns {
        c.push_str(&format!(
            "\n[[datastore]]\nname = \"{name}\"\nkind = \"lun\"\ntarget = \"{}\"\nqueue_depth = 64\n",
            lun.uri()
        ));
    }
    c
}

/// fio with one job per queue depth, run one after another (`stonewall`): the load on the
/// LUN changes every few seconds, which is what gives a device model spread in OIO.
fn fio_steps(dir: &Scratch, tag: &str, uri: &str, depths: &[u32], step_s: u32) -> Child {
    let mut job = format!(
        "[global]\nioengine=nbd\nuri={uri}\nrw=randrw\nrwmixread=70\nbs=8k\ntime_based\n\
         runtime={step_s}\nrandrepeat=0\n"
    );
    for (i, d) in depths.iter().enumerate() {
        job.push_str(&format!("\n[step{i}]\niodepth={d}\nstonewall\n"));
    }
    let path = dir.join(&format!("{tag}.fio"));
    fs::write(&path, job).expect("write fio job");
    Command::new("fio")
        .arg("--output=/dev/null")
        .arg(&path)
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn fio")
}

fn wait_all(children: Vec<Child>) {
    for mut c in children {
        let st = c.wait().expect("wait for fio");
        assert!(st.success(), "fio failed: {st}");
    }
}

fn by_name<'a>(list: &'a Value, name: &str) -> &'a Value {
    list.as_array()
        .expect("array")
        .iter()
        .find(|x| x["name"] == name)
        .unwrap_or_else(|| panic!("{name} not in {list}"))
}

/// The volume's whole contents, read through vestad.
fn contents(url: &str, dir: &Scratch, tag: &str) -> Vec<u8> {
    let out = dir.join(&format!("{tag}.img"));
    run_ok(Command::new("nbdcopy").arg(url).arg(&out));
    fs::read(&out).expect("read copy")
}

#[test]
fn models_rank_luns_by_spindles_and_a_plan_moves_load_off_the_slow_one() {
    let (l3, l6, l9) = (spindles(3), spindles(6), spindles(9));
    let v = Vestad::start_with(vesta_tests::VestadOpts {
        config: Some(config(&[("d3", &l3), ("d6", &l6), ("d9", &l9)])),
        ..Default::default()
    });
    let dir = Scratch::new("balance");
    for (vol, ds) in [("a3", "d3"), ("a6", "d6"), ("a9", "d9")] {
        v.vesta_ok(&["volume", "create", vol, "--size", "256M", "--datastore", ds]);
    }

    // Phase 1: the same stepped load on each LUN.
    let depths = [1, 2, 4, 8, 16, 32, 4, 12, 24];
    wait_all(
        ["a3", "a6", "a9"]
            .iter()
            .map(|n| fio_steps(&dir, &format!("{n}-1"), &v.url(n), &depths, 3))
            .collect(),
    );
    // One more interval so the last step is in the history.
    std::thread::sleep(Duration::from_secs(3));
    let m = v.vesta_json(&["stats", "--models"]);
    let perf = |ds: &str| -> f64 {
        let d = by_name(&m["datastores"], ds);
        d["model"]["performance"]
            .as_f64()
            .unwrap_or_else(|| panic!("datastore {ds} has no model: {m:#}"))
    };
    let (p3, p6, p9) = (perf("d3"), perf("d6"), perf("d9"));
    eprintln!("device models: P(d3) {p3:.2}, P(d6) {p6:.2}, P(d9) {p9:.2}");
    assert!(
        p3 < p6 && p6 < p9,
        "P should rank the LUNs by spindles: {p3} {p6} {p9}\n{m:#}"
    );
    for name in ["a3", "a6", "a9"] {
        let w = &by_name(&m["volumes"], name)["p90"];
        let size = w["io_size_kib"].as_f64().unwrap();
        let read = w["read_pct"].as_f64().unwrap();
        let random = w["random_pct"].as_f64().unwrap();
        assert!((7.9..=8.1).contains(&size), "{name}: IO size {size} KiB");
        assert!((60.0..=85.0).contains(&read), "{name}: read {read} %");
        assert!(random >= 95.0, "{name}: random {random} %");
        assert!(by_name(&m["volumes"], name)["load"].as_f64().unwrap() > 0.0);
    }
    // The human table shows the same.
    let table = v.vesta_ok(&["stats", "--models"]);
    assert!(
        table.contains("SLOPE-ms/OIO") && table.contains("a9"),
        "{table}"
    );

    // Phase 2: two more heavy volumes on the 3-spindle LUN.
    for vol in ["b1", "b2"] {
        v.vesta_ok(&[
            "volume",
            "create",
            vol,
            "--size",
            "256M",
            "--datastore",
            "d3",
        ]);
    }
    wait_all(
        ["a3", "b1", "b2"]
            .iter()
            .map(|n| fio_steps(&dir, &format!("{n}-2"), &v.url(n), &[16, 24, 16], 3))
            .collect(),
    );
    std::thread::sleep(Duration::from_secs(3));
    let p = v.vesta_json(&["balance", "plan"]);
    let plan = &p["plan"];
    let moves = plan["moves"].as_array().expect("moves");
    assert!(
        !moves.is_empty(),
        "d3 is overloaded; expected a move: {p:#}"
    );
    // The hottest datastore gives first; later moves may even out the others.
    assert_eq!(moves[0]["from"], "d3", "{p:#}");
    let f0 = plan["imbalance_before"].as_f64().unwrap();
    let mut f = f0;
    for mv in moves {
        assert_ne!(mv["to"], "d3", "{p:#}");
        assert_ne!(mv["from"], mv["to"]);
        let after = mv["imbalance_after"].as_f64().unwrap();
        assert!(after < f, "every move lowers f: {p:#}");
        f = after;
    }
    let n = |side: &str, ds: &str| {
        by_name_ds(&plan[side], ds)["normalized_load"]
            .as_f64()
            .unwrap()
    };
    assert!(n("after", "d3") < n("before", "d3"), "{p:#}");
    let human = v.vesta_ok(&["balance", "plan"]);
    assert!(human.contains("relocate"), "{human}");

    // Carry out the first move.
    let mv = &moves[0];
    let name = mv["workload"].as_str().unwrap().to_owned();
    let to = mv["to"].as_str().unwrap().to_owned();
    let url = v.url(&name);
    let before = contents(&url, &dir, "before");

    // Refused while a client is attached; nothing changes.
    let mut holder = vesta_tests::nbdsh_cmd()
        .arg("-u")
        .arg(&url)
        .arg("-c")
        .arg("import time; time.sleep(30)")
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn nbdsh");
    wait_for(Duration::from_secs(10), "the client to attach", || {
        let s = v.vesta_json(&["volume", "show", &name]);
        (s["connections"] == 1).then_some(())
    });
    let e = v.vesta_err(&["volume", "relocate", &name, "--datastore", &to, "--offline"]);
    assert!(e.contains("client connection"), "{e}");
    let _ = holder.kill();
    let _ = holder.wait();
    wait_for(Duration::from_secs(10), "the client to detach", || {
        let s = v.vesta_json(&["volume", "show", &name]);
        (s["connections"] == 0).then_some(())
    });
    let e = v.vesta_err(&["volume", "relocate", &name, "--datastore", &to]);
    assert!(e.contains("--offline"), "{e}");
    let e = v.vesta_err(&[
        "volume",
        "relocate",
        &name,
        "--datastore",
        "nowhere",
        "--offline",
    ]);
    assert!(e.contains("nowhere"), "{e}");
    assert_eq!(v.vesta_json(&["volume", "show", &name])["datastore"], "d3");

    let out = v.vesta_ok(&["volume", "relocate", &name, "--datastore", &to, "--offline"]);
    assert!(out.contains(&format!("to datastore {to}")), "{out}");
    let s = v.vesta_json(&["volume", "show", &name]);
    assert_eq!(s["datastore"], to.as_str());
    assert_eq!(s["status"], "ok");
    let after = contents(&url, &dir, "after");
    assert!(before == after, "relocation changed the volume's contents");
    let ds = v.vesta_json(&["datastore", "list"]);
    assert_eq!(by_name(&ds, "d3")["volumes"], 2);

    // Initial placement: the lowest normalized load after adding the new volume, with why.
    let c = v.vesta_json(&["volume", "create", "c1", "--size", "64M"]);
    let pl = &c["placement"];
    let best = pl["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|x| Some((x["normalized_load_after"].as_f64()?, x["datastore"].clone())))
        .min_by(|a, b| a.0.total_cmp(&b.0))
        .expect("an eligible datastore");
    assert_eq!(c["datastore"], best.1, "{c:#}");
    assert!(pl["reason"]
        .as_str()
        .unwrap()
        .contains("lowest normalized load"));
    let out = v.vesta_ok(&["volume", "create", "c2", "--size", "64M"]);
    assert!(out.contains("placed: "), "{out}");
}

fn by_name_ds<'a>(list: &'a Value, ds: &str) -> &'a Value {
    list.as_array()
        .expect("array")
        .iter()
        .find(|x| x["datastore"] == ds)
        .unwrap_or_else(|| panic!("{ds} not in {list}"))
}

#[test]
fn calibrate_stores_constants_the_models_then_use() {
    // Reads cost more than writes here, as on an array with a write cache.
    let lun = Nbdkit::start(
        1 << 30,
        &["--threads=4", "--filter=delay"],
        &["rdelay=3ms", "wdelay=1ms"],
    );
    let v = Vestad::start_with(vesta_tests::VestadOpts {
        config: Some(config(&[("l", &lun)])),
        ..Default::default()
    });
    let before = v.vesta_json(&["stats", "--models"]);
    assert_eq!(before["constants_from"], "defaults");
    let e = v.vesta_err(&["calibrate", "nowhere", "--runtime", "1"]);
    assert!(e.contains("nowhere"), "{e}");

    let c = v.vesta_json(&["calibrate", "l", "--runtime", "1", "--size", "64M"]);
    assert_eq!(c["datastore"], "l");
    assert_eq!(c["experiments"], 16);
    for k in ["k1", "k2", "k3", "k4"] {
        let x = c["constants"][k].as_f64().unwrap();
        assert!(x.is_finite() && x > 0.0, "{k} = {x}: {c:#}");
    }
    // Read share matters on this LUN: its constant is fitted, not set aside.
    let flat: Vec<&str> = c["insensitive"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|x| x.as_str())
        .collect();
    assert!(!flat.contains(&"read"), "{c:#}");
    assert!(!flat.contains(&"OIO"), "{c:#}");

    let after = v.vesta_json(&["stats", "--models"]);
    assert!(
        after["constants_from"]
            .as_str()
            .unwrap()
            .contains("calibrated on datastore l"),
        "{after:#}"
    );
    assert_eq!(after["constants"], c["constants"]);
    // The scratch volume is gone, and the constants survive a restart.
    let vols = v.vesta_json(&["volume", "list"]);
    assert_eq!(vols.as_array().unwrap().len(), 0, "{vols:#}");
    let mut v = v;
    assert!(v.terminate().success());
    v.launch();
    assert_eq!(
        v.vesta_json(&["stats", "--models"])["constants"],
        c["constants"]
    );
}

#[test]
fn a_failed_relocation_leaves_the_volume_where_it_was() {
    // The source fails reads while `on` exists: the copy is created on the target, then
    // the copy fails halfway.
    let (src, errors) = Nbdkit::start_failing(256 << 20, "pread", &[], &[]);
    let dst = Nbdkit::start(256 << 20, &[], &[]);
    let v = Vestad::start();
    v.add_lun("src", &src, 8);
    v.add_lun("dst", &dst, 8);
    for (name, policy) in [("r", "wt"), ("w", "wb")] {
        v.vesta_ok(&[
            "volume",
            "create",
            name,
            "--size",
            "32M",
            "--datastore",
            "src",
            "--policy",
            policy,
            "--hold",
            "600",
        ]);
    }
    let url = v.url("r");
    qemu_io(&url, &["write -P 0x5a 0 1M", "write -P 0xa5 8M 64k"]);

    // Dirty data is refused, with the way out.
    qemu_io(&v.url("w"), &["write -P 0x11 0 64k"]);
    let e = v.vesta_err(&["volume", "relocate", "w", "--datastore", "dst", "--offline"]);
    assert!(e.contains("dirty") && e.contains("wt"), "{e}");

    // A policy set at run time survives the failed relocation: the volume put back asks
    // for it, not for the one it was opened with.
    v.vesta_ok(&["volume", "policy", "r", "uncached"]);
    errors.on();
    let e = v.vesta_err(&["volume", "relocate", "r", "--datastore", "dst", "--offline"]);
    assert!(e.contains("stays on \"src\""), "{e}");
    errors.off();
    let s = v.vesta_json(&["volume", "show", "r"]);
    assert_eq!(
        (s["datastore"].as_str(), s["status"].as_str()),
        (Some("src"), Some("ok"))
    );
    assert_eq!(s["policy"], "uncached", "{s:#}");
    assert!(s.get("policy_asked").is_none(), "{s:#}");
    qemu_io(
        &url,
        &[
            "read -P 0x5a 0 1M",
            "read -P 0xa5 8M 64k",
            "write -P 0x33 2M 4k",
        ],
    );
    let dsts = v.vesta_json(&["datastore", "list"]);
    assert_eq!(by_name(&dsts, "dst")["volumes"], 0, "{dsts:#}");

    v.vesta_ok(&["volume", "relocate", "r", "--datastore", "dst", "--offline"]);
    assert_eq!(v.vesta_json(&["volume", "show", "r"])["datastore"], "dst");
    qemu_io(
        &url,
        &[
            "read -P 0x5a 0 1M",
            "read -P 0x33 2M 4k",
            "read -P 0xa5 8M 64k",
            "read -P 0 4M 1M",
        ],
    );
    // The bytes are on the new LUN, where its first volume starts.
    let img = vesta_tests::read_file(&dst.image);
    let at = vesta_tests::LUN_EXTENT;
    assert!(img[at..at + (1 << 20)].iter().all(|b| *b == 0x5a));
    assert!(img[at + (2 << 20)..at + (2 << 20) + 4096]
        .iter()
        .all(|b| *b == 0x33));

    // The wb volume, drained by a switch to wt, relocates; back in wb on its new datastore it
    // takes writes through the cache again (a new generation) and keeps the old ones.
    v.vesta_ok(&["volume", "policy", "w", "wt"]);
    v.vesta_ok(&["volume", "relocate", "w", "--datastore", "dst", "--offline"]);
    v.vesta_ok(&["volume", "policy", "w", "wb", "--hold", "600"]);
    qemu_io(&v.url("w"), &["read -P 0x11 0 64k", "write -P 0x22 1M 64k"]);
    let w = v.vesta_json(&["volume", "show", "w"]);
    assert_eq!(w["datastore"], "dst");
    assert!(
        w["cache"]["dirty_bytes"].as_u64().unwrap() >= 65536,
        "{w:#}"
    );
    v.vesta_ok(&["volume", "policy", "w", "wt"]);
    qemu_io(&v.url("w"), &["read -P 0x11 0 64k", "read -P 0x22 1M 64k"]);
}

#[test]
fn a_relocation_cut_by_a_crash_leaves_the_volume_whole_and_can_be_retried() {
    let mut src = Nbdkit::start(256 << 20, &[], &[]);
    // Each write to the target takes a second: 64 MiB in 1 MiB chunks, 8 at a time, is a
    // copy of about 8 s, and the kill lands well inside it.
    let mut dst = Nbdkit::start(256 << 20, &["--filter=delay"], &["wdelay=1000ms"]);
    let mut v = Vestad::start();
    v.add_lun("src", &src, 8);
    v.add_lun("dst", &dst, 8);
    v.vesta_ok(&[
        "volume",
        "create",
        "k",
        "--size",
        "64M",
        "--datastore",
        "src",
    ]);
    let url = v.url("k");
    qemu_io(&url, &["write -P 0x6b 0 64M"]);
    let dir = Scratch::new("crashcopy");
    let before = contents(&url, &dir, "before");

    let said = dir.path().join("relocate.err");
    let mut relocate = Command::new(vesta_tests::bin("vesta"))
        .args([
            "--api",
            &v.api,
            "volume",
            "relocate",
            "k",
            "--datastore",
            "dst",
            "--offline",
        ])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&said).unwrap())
        .spawn()
        .unwrap();
    wait_for(
        Duration::from_secs(10),
        "the volume to be out of service",
        || {
            let s = v.vesta_json(&["volume", "show", "k"]);
            s["status"]
                .as_str()
                .unwrap()
                .contains("relocating")
                .then_some(())
        },
    );
    // The copy exists on the target and is being filled.
    wait_for(Duration::from_secs(30), "the copy to start", || {
        v.log().contains("relocating volume \"k\"").then_some(())
    });
    // `volume show` says how far the copy is: some of it, not all, with the target's writes
    // taking a second each.
    wait_for(
        Duration::from_secs(30),
        "the copy's progress in the status",
        || {
            let s = v.vesta_json(&["volume", "show", "k"]);
            let st = s["status"].as_str()?.to_owned();
            (st.contains(" of 64 MiB copied, ") && !st.contains("(0 B of") && !st.contains("100 %"))
                .then_some(())
        },
    );
    // Meanwhile the volume refuses policy changes, a second relocation and a delete, saying
    // why, while other admin operations go on.
    let e = v.vesta_err(&["volume", "policy", "k", "wt"]);
    assert!(e.contains("under way") || e.contains("relocating"), "{e}");
    let e = v.vesta_err(&["volume", "relocate", "k", "--datastore", "src", "--offline"]);
    assert!(e.contains("under way") || e.contains("relocating"), "{e}");
    let e = v.vesta_err(&["volume", "delete", "k", "--force"]);
    assert!(e.contains("relocation under way"), "{e}");
    v.vesta_ok(&[
        "volume",
        "create",
        "other",
        "--size",
        "16M",
        "--datastore",
        "src",
    ]);
    std::thread::sleep(Duration::from_secs(2));
    v.kill9();
    let _ = relocate.wait();
    // The CLI said how far the copy was while it waited.
    let said = std::fs::read_to_string(&said).unwrap();
    assert!(said.contains(" of 64 MiB copied, "), "{said}");
    // nbdkit itself may abort when a client dies with requests in flight (an assertion in
    // its socket code, seen here); the SAN it stands for would still be there, so serve the
    // same images again before vestad comes back.
    src.restart();
    dst.restart();
    v.launch();

    // The record still names the source: the volume is there, whole.
    let s = v.vesta_json(&["volume", "show", "k"]);
    assert_eq!(
        (s["datastore"].as_str(), s["status"].as_str()),
        (Some("src"), Some("ok"))
    );
    assert!(before == contents(&url, &dir, "after-crash"));

    // The start freed the interrupted copy (the record never named it); the retry then
    // completes.
    assert!(
        v.log()
            .contains("left by a relocation that a crash cut short; the volume lives on \"src\""),
        "the start did not free the interrupted copy"
    );
    v.vesta_ok(&["volume", "relocate", "k", "--datastore", "dst", "--offline"]);
    assert!(!v
        .log()
        .contains("stale copy from an interrupted relocation"));
    assert_eq!(v.vesta_json(&["volume", "show", "k"])["datastore"], "dst");
    assert!(before == contents(&url, &dir, "after-retry"));
}

/// Steady random 8 KiB reads at `depth` for `secs`.
fn fio_reads(dir: &Scratch, tag: &str, uri: &str, depth: u32, secs: u32) -> Child {
    Command::new("fio")
        .args([
            &format!("--name={tag}"),
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randread",
            "--bs=8k",
            &format!("--iodepth={depth}"),
            "--time_based",
            &format!("--runtime={secs}"),
            "--randrepeat=0",
            &format!("--output={}", dir.join(&format!("{tag}.out")).display()),
        ])
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn fio")
}

/// BASIL §6.1: the device model of a datastore is fitted to what every host that uses it sees
/// together. Two hosts on one etcd read steadily from one LUN, 4 outstanding reads from a and
/// 8 from b: on either host the datastore's intervals hold about 12 (each alone sees 4 or 8),
/// and each host's models list the other's volume with the model its host published. When the
/// host that combines the statistics dies, the other takes that over and its history goes on,
/// and no plan is made while it is down.
#[test]
fn hosts_sharing_a_lun_model_it_from_their_reads_together() {
    let etcd = Etcd::start();
    let lun = spindles(4);
    let dir = Scratch::new("balance-hosts");
    let host = |name: &str, ip: &str| {
        Vestad::start_with(VestadOpts {
            config: Some(format!(
                "{}\n{}",
                etcd.cluster_config(name, "rack1", 3),
                config(&[("san", &lun)])
            )),
            ip: Some(ip.into()),
            ..Default::default()
        })
    };
    let mut hosts = [host("a", "127.0.0.2"), host("b", "127.0.0.3")];
    hosts[0].vesta_ok(&[
        "volume",
        "create",
        "va",
        "--size",
        "256M",
        "--datastore",
        "san",
    ]);
    hosts[1].vesta_ok(&[
        "volume",
        "create",
        "vb",
        "--size",
        "256M",
        "--datastore",
        "san",
    ]);
    wait_all(vec![
        fio_reads(&dir, "a", &hosts[0].url("va"), 4, 16),
        fio_reads(&dir, "b", &hosts[1].url("vb"), 8, 16),
    ]);
    // Two more intervals, for the last one to go round.
    std::thread::sleep(Duration::from_secs(4));
    for (v, other, theirs) in [(&hosts[0], "b", "vb"), (&hosts[1], "a", "va")] {
        let m = v.vesta_json(&["stats", "--models"]);
        let san = by_name(&m["datastores"], "san");
        assert_eq!(san["hosts"], serde_json::json!(["a", "b"]), "{m:#}");
        let oio = san["read_oio_median"].as_f64().expect("usable intervals");
        eprintln!("LUN median outstanding reads, as one host sees the pod: {oio:.1}");
        assert!(
            (9.5..13.0).contains(&oio),
            "the LUN's intervals should hold both hosts' reads (4 + 8): median OIO {oio}\n{m:#}"
        );
        // The other host's volume, with its model (published every few intervals).
        let w = wait_for(
            Duration::from_secs(15),
            "the other host's volume model",
            || {
                let m = v.vesta_json(&["stats", "--models"]);
                let w = by_name(&m["volumes"], theirs).clone();
                (w["samples"].as_u64().unwrap_or(0) > 0).then_some(w)
            },
        );
        assert_eq!(w["host"], other, "{w}");
        assert!(w["load"].as_f64().unwrap() > 0.0, "{w}");
        let read = w["p90"]["read_pct"].as_f64().unwrap();
        assert!(read > 99.0, "{theirs} only reads: {w}");
    }

    // The aggregator dies; the survivor's intervals go on, now its own alone.
    let out = etcd.etcdctl_retrying(&["get", "--print-value-only", "/vesta/stats/aggregator"]);
    let aggregator = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let (dead, survivor, vol) = match aggregator.as_str() {
        "a" => (0, 1, "vb"),
        "b" => (1, 0, "va"),
        other => panic!("no statistics aggregator in etcd: {other:?}"),
    };
    hosts[dead].kill9();
    let samples = |v: &Vestad| {
        by_name(&v.vesta_json(&["stats", "--models"])["datastores"], "san")["samples"]
            .as_u64()
            .unwrap()
    };
    let before = samples(&hosts[survivor]);
    let url = hosts[survivor].url(vol);
    wait_all(vec![fio_reads(&dir, "alone", &url, 4, 12)]);
    std::thread::sleep(Duration::from_secs(4));
    let m = hosts[survivor].vesta_json(&["stats", "--models"]);
    let san = by_name(&m["datastores"], "san");
    let after = san["samples"].as_u64().unwrap();
    assert!(
        after >= before + 3,
        "the survivor's history stopped with the aggregator: {before} -> {after}\n{m:#}"
    );
    let name = ["a", "b"][survivor];
    assert_eq!(san["hosts"], serde_json::json!([name]), "{m:#}");
    // Nothing is planned while a host is down (DESIGN §8): its volume's model went with its
    // lease, so the LUN it loads would look cooler than it is.
    let dead_name = ["a", "b"][dead];
    let e = hosts[survivor].vesta_err(&["balance", "plan"]);
    assert!(
        e.contains(&format!("host {dead_name} is down")),
        "a plan while a host is down: {e}"
    );
}
