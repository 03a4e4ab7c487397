//! The operator surface: `vesta` commands as written in the README, their `--json` forms, and
//! errors that name the problem and the fix.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use vesta_tests::raw::Raw;
use vesta_tests::{bin, qemu_io, run_ok, wait_for, Nbdkit, Scratch, Vestad};

#[test]
fn volume_lifecycle_through_the_cli() {
    let v = Vestad::start();
    let out = v.vesta_ok(&["volume", "create", "web01", "--size", "2G"]);
    assert!(
        out.contains("created volume web01 (2 GiB) on datastore default"),
        "{out}"
    );

    let list = v.vesta_ok(&["volume", "list"]);
    let row = list.lines().find(|l| l.starts_with("web01")).expect(&list);
    assert!(row.contains("2 GiB") && row.contains("default") && row.contains("uncached"));

    let j = v.vesta_json(&["volume", "show", "web01"]);
    assert_eq!(j["name"], "web01");
    assert_eq!(j["size"], 2u64 << 30);
    assert_eq!(j["datastore"], "default");
    assert_eq!(j["policy"], "uncached");
    assert_eq!(j["status"], "ok");
    assert_eq!(j["connections"], 0);

    let url = v.vesta_ok(&["volume", "url", "web01"]);
    assert_eq!(url.trim(), v.url("web01"));
    let tcp = v.vesta_ok(&["volume", "url", "web01", "--tcp"]);
    assert_eq!(tcp.trim(), v.tcp_url("web01"));
    let urls = v.vesta_json(&["volume", "url", "web01"]);
    assert_eq!(urls.as_array().unwrap().len(), 2);

    let out = v.vesta_ok(&["volume", "delete", "web01"]);
    assert!(out.contains("deleted volume web01"), "{out}");
    assert!(!v.data_dir.join("datastores/default/web01.raw").exists());
    let j = v.vesta_json(&["volume", "list"]);
    assert_eq!(j.as_array().unwrap().len(), 0);
}

#[test]
fn errors_name_the_problem_and_the_fix() {
    let v = Vestad::start();
    v.create_volume("a", "1M");

    let e = v.vesta_err(&[
        "volume",
        "create",
        "b",
        "--size",
        "1M",
        "--datastore",
        "nope",
    ]);
    assert!(
        e.contains("no datastore named \"nope\"") && e.contains("known datastores: default"),
        "{e}"
    );

    let e = v.vesta_err(&["volume", "create", "b", "--size", "10X"]);
    assert!(e.contains("bad size") && e.contains("e.g. 10G"), "{e}");

    let e = v.vesta_err(&["volume", "create", "a", "--size", "1M"]);
    assert!(e.contains("already exists"), "{e}");

    let e = v.vesta_err(&["volume", "create", "b/c", "--size", "1M"]);
    assert!(e.contains("not valid") && e.contains("e.g. web-01"), "{e}");

    let e = v.vesta_err(&["volume", "create", "b", "--size", "1000"]);
    assert!(e.contains("multiple of 512"), "{e}");

    // More than any Linux file can hold (2^63 bytes and up).
    let e = v.vesta_err(&["volume", "create", "b", "--size", "9000P"]);
    assert!(
        e.contains("larger than the file system of datastore \"default\"")
            && e.contains("choose a smaller size"),
        "{e}"
    );

    let e = v.vesta_err(&["volume", "create", "b", "--size", "1M", "--policy", "fast"]);
    assert!(
        e.contains("unknown policy") && e.contains("uncached"),
        "{e}"
    );

    let e = v.vesta_err(&["volume", "show", "zzz"]);
    assert!(
        e.contains("no volume named \"zzz\"") && e.contains("known volumes: a"),
        "{e}"
    );

    let e = v.vesta_err(&["datastore", "add", "default", "--dir", "/tmp"]);
    assert!(e.contains("already exists"), "{e}");

    // A name is sent as itself, never as part of the request: this one is not a volume's
    // name, so nothing is deleted (it used to delete `a`, with force).
    let e = v.vesta_err(&["volume", "delete", "a?force=true"]);
    assert!(e.contains("no volume named \"a?force=true\""), "{e}");
    let e = v.vesta_err(&["volume", "show", "a/../a"]);
    assert!(e.contains("no volume named \"a/../a\""), "{e}");

    let e = v.vesta_err(&["datastore", "add", "x", "--dir", "/nonexistent/vesta"]);
    assert!(e.contains("mkdir -p"), "{e}");

    // Nothing above changed anything.
    let j = v.vesta_json(&["volume", "list"]);
    assert_eq!(j.as_array().unwrap().len(), 1);
    let j = v.vesta_json(&["datastore", "list"]);
    assert_eq!(j.as_array().unwrap().len(), 1);

    // And a daemon that is not there is explained.
    let out = vesta_tests::run(Command::new(bin("vesta")).args([
        "--api",
        "http://127.0.0.1:9",
        "volume",
        "list",
    ]));
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        e.contains("cannot reach vestad") && e.contains("VESTA_API"),
        "{e}"
    );
}

#[test]
fn delete_is_refused_while_attached_unless_forced() {
    let v = Vestad::start();
    v.create_volume("busy", "1M");
    let (mut r, _) = Raw::go(&v.nbd_unix, "busy");
    assert_eq!(v.vesta_json(&["volume", "show", "busy"])["connections"], 1);
    let e = v.vesta_err(&["volume", "delete", "busy"]);
    assert!(
        e.contains("1 client connection(s) attached") && e.contains("--force"),
        "{e}"
    );
    assert!(v.data_dir.join("datastores/default/busy.raw").exists());
    // The connection still works after the refused delete.
    r.request(0, vesta_tests::raw::CMD_READ, 1, 0, 512);
    assert_eq!(r.reply().unwrap(), (0, 1));
    r.read_n(512);

    v.vesta_ok(&["volume", "delete", "busy", "--force"]);
    assert!(r.closed(), "a forced delete disconnects the client");
    assert!(!v.data_dir.join("datastores/default/busy.raw").exists());
    let e = v.vesta_err(&["volume", "show", "busy"]);
    assert!(e.contains("no volume named"), "{e}");
}

#[test]
fn dir_and_lun_datastores_are_added_and_listed() {
    let v = Vestad::start();
    let s = Scratch::new("dirds");
    std::fs::create_dir_all(s.join("ds2")).unwrap();
    // A relative --dir is made absolute by the CLI.
    let out = vesta_tests::run(Command::new(bin("vesta")).current_dir(s.path()).args([
        "--api",
        &v.api,
        "datastore",
        "add",
        "local2",
        "--dir",
        "ds2",
        "--class",
        "ssd",
    ]));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let k = Nbdkit::start(256 << 20, &[], &[]);
    let j = v.vesta_json(&[
        "datastore",
        "add",
        "san",
        "--lun",
        &k.uri(),
        "--queue-depth",
        "8",
    ]);
    assert_eq!(j["kind"], "lun");
    assert_eq!(j["queue_depth"], 8);
    assert_eq!(j["status"], "ok");
    assert!(j["lun_id"].is_string());
    // Capacity: the device minus Vesta's 4 MiB of label and tables.
    assert_eq!(j["total_bytes"], (256u64 << 20) - (4 << 20));

    let list = v.vesta_json(&["datastore", "list"]);
    let names: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["default", "local2", "san"]);
    let local2 = &list[1];
    assert_eq!(local2["location"], s.join("ds2").display().to_string());
    assert_eq!(local2["class"], "ssd");

    // So is a --lun given as a relative path.
    let img = std::fs::File::create(s.join("lun.img")).unwrap();
    img.set_len(64 << 20).unwrap();
    let out = vesta_tests::run(Command::new(bin("vesta")).current_dir(s.path()).args([
        "--api",
        &v.api,
        "--json",
        "datastore",
        "add",
        "filelun",
        "--lun",
        "lun.img",
    ]));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["location"], s.join("lun.img").display().to_string());
    let table = v.vesta_ok(&["datastore", "list"]);
    assert!(table.lines().next().unwrap().starts_with("NAME"), "{table}");

    v.vesta_ok(&[
        "volume",
        "create",
        "v1",
        "--size",
        "100M",
        "--datastore",
        "san",
    ]);
    v.vesta_ok(&[
        "volume",
        "create",
        "v2",
        "--size",
        "1M",
        "--datastore",
        "local2",
    ]);
    assert!(s.join("ds2/v2.raw").exists());
    let e = v.vesta_err(&[
        "volume",
        "create",
        "v3",
        "--size",
        "200M",
        "--datastore",
        "san",
    ]);
    assert!(
        e.contains("no room") && e.contains("largest free extent"),
        "{e}"
    );
    // The same LUN cannot be added twice.
    let e = v.vesta_err(&["datastore", "add", "san2", "--lun", &k.uri()]);
    assert!(e.contains("already datastore \"san\""), "{e}");
}

#[test]
fn a_lun_with_foreign_data_is_refused_without_force() {
    let k = Nbdkit::start(64 << 20, &[], &[]);
    {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(&k.image)
            .unwrap();
        use std::io::{Seek, SeekFrom, Write};
        f.seek(SeekFrom::Start(1234)).unwrap();
        f.write_all(b"an ext4 superblock, say").unwrap();
    }
    let v = Vestad::start();
    let e = v.vesta_err(&["datastore", "add", "old", "--lun", &k.uri()]);
    assert!(e.contains("offset 1234") && e.contains("--force"), "{e}");
    // Refusal changed nothing on the device.
    let img = std::fs::read(&k.image).unwrap();
    assert_eq!(&img[1234..1257], b"an ext4 superblock, say");
    assert!(img[..1234].iter().all(|b| *b == 0));
    assert_eq!(
        v.vesta_json(&["datastore", "list"])
            .as_array()
            .unwrap()
            .len(),
        1
    );

    v.vesta_ok(&["datastore", "add", "old", "--lun", &k.uri(), "--force"]);
    let img = std::fs::read(&k.image).unwrap();
    assert_eq!(&img[..8], b"VESTALUN");
}

#[test]
fn a_re_added_lun_brings_its_volumes_back() {
    let k = Nbdkit::start(64 << 20, &[], &[]);
    let (lun_id, pod);
    {
        let v = Vestad::start();
        lun_id = v.vesta_json(&["datastore", "add", "san", "--lun", &k.uri()])["lun_id"].clone();
        pod = v.vesta_json(&["status"])["pod"]
            .as_str()
            .unwrap()
            .to_owned();
        v.vesta_ok(&[
            "volume",
            "create",
            "keep",
            "--size",
            "4M",
            "--datastore",
            "san",
        ]);
        vesta_tests::qemu_io(&v.url("keep"), &["write -P 0x42 0 1M"]);
        // This host's state is then lost with it.
    }
    let v = Vestad::start();
    // Another pod's LUN, as far as the new host knows: refused, unless taken over.
    let e = v.vesta_err(&["datastore", "add", "san-again", "--lun", &k.uri()]);
    assert!(
        e.contains("a Vesta LUN of another pod") && e.contains("1 volume(s)"),
        "{e}"
    );
    let j = v.vesta_json(&[
        "datastore",
        "add",
        "san-again",
        "--lun",
        &k.uri(),
        "--take-over",
        &pod,
    ]);
    assert_eq!(j["lun_id"], lun_id, "the LUN is adopted, not reformatted");
    assert_eq!(j["volumes"], 1);
    let vol = v.vesta_json(&["volume", "show", "keep"]);
    assert_eq!(vol["datastore"], "san-again");
    assert_eq!(vol["size"], 4 << 20);
    vesta_tests::qemu_io(&v.url("keep"), &["read -P 0x42 0 1M"]);
}

/// Two pods (here two single hosts) must never allocate from one LUN's volume table: the
/// second is refused while the LUN carries the first pod's id (`--force`, which formats over
/// foreign data, does not change that), and once it takes the LUN over (`--take-over`) the
/// first can change its table no more, though it has it open, nor open it again. Before, the
/// second adopted it silently and both gave out the same extents.
#[test]
fn a_lun_of_another_pod_is_refused_and_a_take_over_shuts_that_pod_out() {
    let k = Nbdkit::start(64 << 20, &[], &[]);
    let mut first = Vestad::start();
    first.vesta_ok(&["datastore", "add", "san", "--lun", &k.uri()]);
    first.vesta_ok(&[
        "volume",
        "create",
        "x",
        "--size",
        "4M",
        "--datastore",
        "san",
    ]);
    vesta_tests::qemu_io(&first.url("x"), &["write -P 0x17 0 1M", "flush"]);
    first.vesta_ok(&[
        "volume",
        "create",
        "wb",
        "--size",
        "4M",
        "--datastore",
        "san",
        "--policy",
        "wb",
    ]);
    assert!(vesta_tests::try_write(&first.url("wb"), 0x21, 0));
    let pod = first.vesta_json(&["status"])["pod"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(!pod.is_empty());

    let second = Vestad::start();
    assert_ne!(second.vesta_json(&["status"])["pod"], pod.as_str());
    for force in [&[][..], &["--force"][..]] {
        let uri = k.uri();
        let mut args = vec!["datastore", "add", "san", "--lun", &uri];
        args.extend_from_slice(force);
        let e = second.vesta_err(&args);
        assert!(
            e.contains("a Vesta LUN of another pod") && e.contains(&pod),
            "{e}"
        );
    }
    // Refused, nothing changed: the first host goes on, and the second created nothing.
    vesta_tests::qemu_io(&first.url("x"), &["read -P 0x17 0 1M"]);
    assert!(second
        .vesta_err(&["volume", "show", "x"])
        .contains("no volume named"));

    // Only from the pod the label names: a pod id copied from elsewhere takes nothing.
    let uri = k.uri();
    let take_over = |pod| ["datastore", "add", "san", "--lun", &uri, "--take-over", pod];
    let e = second.vesta_err(&take_over("00000000-0000-4000-8000-000000000001"));
    assert!(e.contains("a Vesta LUN of another pod"), "{e}");
    second.vesta_ok(&take_over(&pod));
    // By the time the take-over returns, the first pod has seen it: the volume it still
    // serves does no more IO to the LUN, and what it was asked to write did not land.
    assert!(
        !vesta_tests::try_write(&first.url("x"), 0x99, 0),
        "the pod the LUN was taken from still wrote it"
    );
    // Its cache takes no write either: none would ever reach the LUN.
    assert!(
        !vesta_tests::try_write(&first.url("wb"), 0x99, 0),
        "a write-back volume of the pod the LUN was taken from still took a write"
    );
    vesta_tests::qemu_io(&second.url("x"), &["read -P 0x17 0 1M"]);
    let e = first.vesta_err(&[
        "volume",
        "create",
        "y",
        "--size",
        "4M",
        "--datastore",
        "san",
    ]);
    assert!(e.contains("now belongs to another Vesta pod"), "{e}");
    first.terminate();
    first.launch();
    let ds = first.vesta_json(&["datastore", "list"]);
    let san = ds
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["name"] == "san")
        .expect("san listed")
        .clone();
    assert!(
        san["status"]
            .as_str()
            .unwrap_or_default()
            .contains("now belongs to another Vesta pod"),
        "{san}"
    );
}

fn spawn_fio(uri: &str, seconds: u32) -> Child {
    Command::new("fio")
        .args([
            "--name=load",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randrw",
            "--bs=4k",
            "--iodepth=8",
            "--size=32M",
            "--time_based",
            &format!("--runtime={seconds}"),
            "--output=/dev/null",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn fio")
}

#[test]
fn stats_report_rates_latency_and_outstanding_ios() {
    let v = Vestad::start();
    v.create_volume("load", "64M");
    v.create_volume("idle", "1M");
    let mut fio = spawn_fio(&v.url("load"), 6);
    // Wait for an interval in which fio was running throughout.
    let j = wait_for(Duration::from_secs(20), "a stats interval with IO", || {
        let j = v.vesta_json(&["stats"]);
        (j["volumes"][1]["io"]["write_iops"].as_f64()? > 100.0
            && j["volumes"][1]["io"]["read_iops"].as_f64()? > 100.0)
            .then_some(j)
    });
    let _ = fio.wait();
    assert!(j["interval_s"].as_f64().unwrap() >= 1.5);
    let load = &j["volumes"][1];
    assert_eq!(load["name"], "load");
    assert!(load["io"]["read_latency_us_p50"].as_u64().is_some());
    assert!(
        load["io"]["write_latency_us_p99"].as_u64().unwrap()
            >= load["io"]["write_latency_us_p50"].as_u64().unwrap()
    );
    assert!(load["io"]["outstanding_mean"].as_f64().unwrap() > 0.0);
    assert!(load["io"]["writes_total"].as_u64().unwrap() > 0);
    let idle = &j["volumes"][0];
    assert_eq!(idle["name"], "idle");
    assert_eq!(idle["io"]["writes_total"], 0);
    let ds = &j["datastores"][0];
    assert_eq!(ds["name"], "default");
    assert!(ds["io"]["write_iops"].as_f64().unwrap() > 100.0);

    // One volume only, and the human table.
    let one = v.vesta_json(&["stats", "load"]);
    assert_eq!(one["volumes"].as_array().unwrap().len(), 1);
    let table = v.vesta_ok(&["stats"]);
    assert!(
        table.contains("VOLUME") && table.contains("R-P99") && table.contains("DATASTORE"),
        "{table}"
    );
    let e = v.vesta_err(&["stats", "nope"]);
    assert!(e.contains("no volume named"), "{e}");
}

#[test]
fn status_reports_addresses_and_counts() {
    let v = Vestad::start();
    v.create_volume("a", "1M");
    let j = v.vesta_json(&["status"]);
    assert_eq!(j["coordinator"], "local");
    assert_eq!(j["volumes"], 1);
    assert_eq!(j["datastores"], 1);
    assert_eq!(j["nbd_unix"], v.nbd_unix.display().to_string());
    assert_eq!(format!("http://{}", j["api"].as_str().unwrap()), v.api);
    let out = run_ok(Command::new(bin("vesta")).args(["--api", &v.api, "status"]));
    assert!(out.contains("coordinator  local"), "{out}");
    // The host's own cache use is as it is now, not as last published (every 10 s).
    let idle = v.vesta_json(&["host", "list"])[0]["cache_used_bytes"]
        .as_u64()
        .unwrap();
    v.vesta_ok(&["volume", "create", "w", "--size", "8M", "--policy", "wb"]);
    qemu_io(&v.url("w"), &["write -P 7 0 4M", "flush"]);
    let h = v.vesta_json(&["host", "list"]);
    let used = h[0]["cache_used_bytes"].as_u64().unwrap();
    assert!(
        used >= idle + (4 << 20),
        "4 MiB written, cache use {idle} -> {used}: {h}"
    );
}

/// An nbdkit LUN behind its pause filter: paused, it holds every request until resumed (a
/// SAN that stopped answering).
struct PausableLun {
    lun: Nbdkit,
    ctl: std::os::unix::net::UnixStream,
    _dir: Scratch,
}

impl PausableLun {
    fn start() -> PausableLun {
        let dir = Scratch::new("pausectl");
        let path = dir.join("pause.sock");
        let lun = Nbdkit::start(
            64 << 20,
            &["--filter=pause"],
            &[&format!("pause-control={}", path.display())],
        );
        let ctl = std::os::unix::net::UnixStream::connect(&path).unwrap();
        PausableLun {
            lun,
            ctl,
            _dir: dir,
        }
    }

    fn pause(&mut self) {
        self.say(b'p', b'P');
    }

    fn resume(&mut self) {
        self.say(b'r', b'R');
    }

    fn say(&mut self, ask: u8, answer: u8) {
        use std::io::{Read, Write};
        let mut said = [0u8; 1];
        self.ctl.write_all(&[ask]).unwrap();
        self.ctl.read_exact(&mut said).unwrap();
        assert_eq!(said[0], answer, "nbdkit's pause filter answered");
    }
}

/// Waits until datastore `ds` has an IO of `volume`'s outstanding (`vesta stats`).
fn wait_outstanding(v: &Vestad, volume: &str, ds: &str, what: &str) {
    wait_for(Duration::from_secs(10), what, || {
        let s = v.vesta_json(&["stats", volume]);
        let io = &s["datastores"]
            .as_array()?
            .iter()
            .find(|d| d["name"] == ds)?["io"];
        (io["outstanding"].as_u64()? >= 1).then_some(())
    });
}

/// A new 8 MiB volume `name` (created with `args` added) on the LUN "san" of a fresh vestad,
/// served by nbdkit's pause filter, paused: its next datastore IO waits for `lun.resume()`.
fn volume_on_a_paused_lun(name: &str, args: &[&str]) -> (PausableLun, Vestad) {
    let mut lun = PausableLun::start();
    let v = Vestad::start();
    v.add_lun("san", &lun.lun, 4);
    let mut create = vec![
        "volume",
        "create",
        name,
        "--size",
        "8M",
        "--datastore",
        "san",
    ];
    create.extend_from_slice(args);
    v.vesta_ok(&create);
    lun.pause();
    (lun, v)
}

/// A forced delete whose volume still has a write in flight at the datastore after the
/// wait (a SAN that stopped answering) frees nothing: the same volume goes back into service
/// and serves again, and a delete once the write is done frees the storage. nbdkit's pause
/// filter holds the write.
#[test]
fn a_delete_whose_io_does_not_drain_keeps_the_volume_in_service() {
    let (mut lun, v) = volume_on_a_paused_lun("stuck", &[]);
    let mut writer = Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -P 0x5a 0 4k", &v.url("stuck")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_outstanding(&v, "stuck", "san", "the write to be in flight");
    let e = v.vesta_err(&["volume", "delete", "stuck", "--force"]);
    assert!(
        e.contains("still has IO in flight") && e.contains("storage was kept"),
        "{e}"
    );
    lun.resume();
    let _ = writer.wait();
    // The same volume serves again, with its data.
    let s = v.vesta_json(&["volume", "show", "stuck"]);
    assert_eq!(s["status"], "ok", "{s:#}");
    vesta_tests::qemu_io(
        &v.url("stuck"),
        &["write -P 0x6b 4k 4k", "read -P 0x6b 4k 4k"],
    );
    v.vesta_ok(&["volume", "delete", "stuck"]);
    let e = v.vesta_err(&["volume", "show", "stuck"]);
    assert!(e.contains("no volume named"), "{e}");
}

/// The same for a `wb` volume, whose datastore IO in flight is its destager's: a window
/// writing to the paused LUN holds the destager, and the delete gives up after its wait as
/// above rather than wait for the datastore for ever (holding every other change). The volume
/// and its dirty data stay; once the LUN answers, the data reaches it and the delete works.
#[test]
fn a_delete_whose_destager_does_not_drain_keeps_the_volume_and_its_dirty_data() {
    let (mut lun, v) = volume_on_a_paused_lun("stuckwb", &["--policy", "wb"]);
    // Completes in the cache; its destaging is what waits at the LUN.
    vesta_tests::qemu_io(&v.url("stuckwb"), &["write -P 0x5a 0 64k"]);
    wait_outstanding(&v, "stuckwb", "san", "the destager's write in flight");
    std::thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::channel();
        let v = &v;
        s.spawn(move || {
            let _ = tx.send(v.vesta_err(&["volume", "delete", "stuckwb", "--force"]));
        });
        match rx.recv_timeout(Duration::from_secs(90)) {
            Ok(e) => assert!(
                e.contains("still has IO in flight") && e.contains("storage was kept"),
                "{e}"
            ),
            Err(_) => {
                lun.resume(); // lets the delete end, so the test does too
                panic!("the delete waited for the paused datastore past its limit");
            }
        }
    });
    let s = v.vesta_json(&["volume", "show", "stuckwb"]);
    assert_eq!(s["status"], "ok", "{s:#}");
    assert!(
        s["cache"]["dirty_bytes"].as_u64().unwrap() >= 65536,
        "{s:#}"
    );
    lun.resume();
    wait_for(Duration::from_secs(30), "the volume to be clean", || {
        let s = v.vesta_json(&["volume", "show", "stuckwb"]);
        (s["cache"]["dirty_bytes"] == 0).then_some(())
    });
    vesta_tests::qemu_io(&v.url("stuckwb"), &["read -P 0x5a 0 64k"]);
    v.vesta_ok(&["volume", "delete", "stuckwb"]);
    let e = v.vesta_err(&["volume", "show", "stuckwb"]);
    assert!(e.contains("no volume named"), "{e}");
}

/// A client that has hung up but whose connection still answers a request in flight (here a
/// read held at the paused LUN for half a second) is not an attached client: a delete right
/// after the hang-up waits for the connection to end instead of refusing, as an operator who
/// runs `qemu-io` and then `vesta volume delete` expects.
#[test]
fn a_delete_right_after_the_last_client_hung_up_waits_for_its_connection_to_end() {
    let (mut lun, v) = volume_on_a_paused_lun("gone", &[]);
    let (mut r, _) = Raw::go(&v.nbd_unix, "gone");
    r.request(0, vesta_tests::raw::CMD_READ, 1, 0, 4096);
    wait_outstanding(&v, "gone", "san", "the read to be in flight");
    r.request(0, vesta_tests::raw::CMD_DISC, 2, 0, 0);
    drop(r);
    assert_eq!(v.vesta_json(&["volume", "show", "gone"])["connections"], 1);
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(500));
            lun.resume();
        });
        v.vesta_ok(&["volume", "delete", "gone"]);
    });
    let e = v.vesta_err(&["volume", "show", "gone"]);
    assert!(e.contains("no volume named"), "{e}");
}

/// A policy change that drains dirty data, and an offline relocation, can take minutes: the
/// CLI says how far they are on stderr while it waits (here not a terminal: a line at the
/// first look, then at most every 10 s), and prints nothing of it with `--json`.
#[test]
fn a_draining_policy_change_reports_its_progress() {
    // Each datastore write takes 300 ms, one at a time: 12 scattered 4 KiB writes are a drain
    // of about 4 s, and the CLI looks every second.
    let k = Nbdkit::start(64 << 20, &["--filter=delay"], &["wdelay=300ms"]);
    let v = Vestad::start();
    v.add_lun("slow", &k, 1);
    for name in ["d", "j"] {
        v.vesta_ok(&[
            "volume",
            "create",
            name,
            "--size",
            "16M",
            "--datastore",
            "slow",
            "--policy",
            "wb",
            "--hold",
            "600",
        ]);
        let writes: Vec<String> = (0..12)
            .map(|i| format!("write -P {} {}k 4k", i + 1, i * 256))
            .collect();
        let writes: Vec<&str> = writes.iter().map(String::as_str).collect();
        vesta_tests::qemu_io(&v.url(name), &writes);
    }
    let out = v.vesta(&["volume", "policy", "d", "wt"]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("volume d now has policy wt"), "{stdout}");
    assert!(
        stderr.contains(" of dirty data left"),
        "no progress on stderr: {stderr}"
    );
    // Scripts get the JSON and no progress.
    let out = v.vesta(&["--json", "volume", "policy", "j", "wt"]);
    assert!(out.status.success());
    assert!(
        out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["policy"], "wt");
    // Drained: every write is on the datastore and reads back.
    for name in ["d", "j"] {
        let reads: Vec<String> = (0..12)
            .map(|i| format!("read -P {} {}k 4k", i + 1, i * 256))
            .collect();
        let reads: Vec<&str> = reads.iter().map(String::as_str).collect();
        vesta_tests::qemu_io(&v.url(name), &reads);
        let s = v.vesta_json(&["volume", "show", name]);
        assert_eq!(s["cache"]["dirty_bytes"], 0, "{s:#}");
    }
}
