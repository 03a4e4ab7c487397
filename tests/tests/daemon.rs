//! The daemon's life: the embedded default, config files, restarts, SIGTERM draining
//! in-flight IO, one daemon per data directory, and a datastore that is down at start-up.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use vesta_tests::raw::{Raw, CMD_WRITE};
use vesta_tests::{bin, qemu_io, read_file, run, wait_for, Nbdkit, Scratch, Vestad, VestadOpts};

#[test]
fn sigterm_drains_in_flight_io_and_exits_cleanly() {
    // Writes to this LUN take one second, so the write is surely in flight at SIGTERM.
    let k = Nbdkit::start(64 << 20, &["--filter=delay"], &["delay-write=1"]);
    let mut v = Vestad::start();
    v.vesta_ok(&["datastore", "add", "slow", "--lun", &k.uri()]);
    v.vesta_ok(&[
        "volume",
        "create",
        "p",
        "--size",
        "8M",
        "--datastore",
        "slow",
    ]);
    let (mut r, _) = Raw::go(&v.nbd_unix, "p");
    let mut w = Raw::header(0, CMD_WRITE, 77, 8192, 4096);
    w.extend_from_slice(&[0xeeu8; 4096]);
    r.s.write_all(&w).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let start = Instant::now();
    vesta_tests::signal(v.pid(), libc::SIGTERM);
    // The client gets its reply, then the connection closes.
    assert_eq!(r.reply().unwrap(), (0, 77));
    assert!(r.closed());
    let status = v.terminate_wait();
    assert!(status.success(), "vestad exited with {status}");
    assert!(start.elapsed() < Duration::from_secs(10));
    let log = v.log();
    assert!(
        log.contains("SIGTERM: shutting down") && log.contains("stopped cleanly"),
        "{log}"
    );
    // The write is on the LUN, at the volume's extent (4 MiB into the device).
    let img = read_file(&k.image);
    let at = (4 << 20) + 8192;
    assert!(img[at..at + 4096].iter().all(|b| *b == 0xee));
}

#[test]
fn a_restart_keeps_datastores_volumes_and_data() {
    let k = Nbdkit::start(64 << 20, &[], &[]);
    let mut v = Vestad::start();
    v.vesta_ok(&["datastore", "add", "san", "--lun", &k.uri()]);
    v.create_volume("d", "8M");
    v.vesta_ok(&[
        "volume",
        "create",
        "l",
        "--size",
        "8M",
        "--datastore",
        "san",
    ]);
    qemu_io(&v.url("d"), &["write -P 0x11 0 64k"]);
    qemu_io(&v.url("l"), &["write -P 0x22 4096 64k"]);
    // The TCP port is chosen anew at each start (port 0), so URLs are left out.
    let records = |v: &Vestad| {
        let mut j = v.vesta_json(&["volume", "list"]);
        for vol in j.as_array_mut().unwrap() {
            vol.as_object_mut().unwrap().remove("urls");
        }
        j
    };
    let before = records(&v);
    assert!(v.terminate().success());
    v.launch();
    assert_eq!(records(&v), before);
    qemu_io(&v.url("d"), &["read -P 0x11 0 64k"]);
    qemu_io(&v.url("l"), &["read -P 0x22 4096 64k", "read -P 0 0 4096"]);
    // After a kill -9 too: uncached writes were on the datastore when they completed.
    qemu_io(&v.url("l"), &["write -P 0x33 1M 64k"]);
    v.kill9();
    v.launch();
    qemu_io(&v.url("l"), &["read -P 0x33 1M 64k"]);
}

#[test]
fn one_daemon_per_data_directory() {
    let v = Vestad::start();
    let out = run(Command::new(bin("vestad")).args([
        "--data-dir",
        &v.data_dir.display().to_string(),
        "--api",
        "127.0.0.1:0",
        "--nbd-tcp",
        "",
        "--nbd-unix",
        "other.sock",
    ]));
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        e.contains("another vestad") && e.contains(&v.pid().to_string()),
        "{e}"
    );
    // The first daemon is untouched.
    v.vesta_ok(&["status"]);
}

#[test]
fn bad_config_is_refused_naming_the_field() {
    let s = Scratch::new("badcfg");
    for (cfg, needle) in [
        ("[nbd]\ntcpp = \"127.0.0.1:1\"\n", "tcpp"),
        (
            "[[datastore]]\nname = \"x\"\nkind = \"lun\"\npath = \"/tmp\"\n",
            "target",
        ),
        ("[stats]\ninterval_s = 1\n", "interval_s"),
    ] {
        std::fs::write(s.join("v.toml"), cfg).unwrap();
        let out = run(Command::new(bin("vestad"))
            .args(["--config"])
            .arg(s.join("v.toml"))
            .args(["--data-dir"])
            .arg(s.join("data")));
        assert!(!out.status.success(), "{cfg} should be refused");
        let e = String::from_utf8_lossy(&out.stderr);
        assert!(e.contains(needle) && e.contains("v.toml"), "{cfg}: {e}");
    }
    // A refused config created no state.
    assert!(!s.join("data/state.json").exists());
}

#[test]
fn a_config_file_defines_datastores() {
    let k = Nbdkit::start(64 << 20, &[], &[]);
    let v = Vestad::start_with(VestadOpts {
        config: Some(format!(
            "[stats]\ninterval_s = 3\n\n[[datastore]]\nname = \"san\"\nkind = \"lun\"\ntarget = \"{}\"\nclass = \"ssd\"\nqueue_depth = 4\n",
            k.uri()
        )),
        ..Default::default()
    });
    let list = v.vesta_json(&["datastore", "list"]);
    assert_eq!(
        list.as_array().unwrap().len(),
        1,
        "the file replaces the default datastore"
    );
    assert_eq!(list[0]["name"], "san");
    assert_eq!(list[0]["class"], "ssd");
    assert_eq!(list[0]["queue_depth"], 4);
    // With one datastore, --datastore may be left out.
    v.create_volume("x", "1M");
    assert_eq!(v.vesta_json(&["volume", "show", "x"])["datastore"], "san");
}

#[test]
fn the_embedded_default_needs_no_config() {
    let s = Scratch::new("embedded");
    let mut child = Command::new(bin("vestad"))
        .current_dir(s.path())
        .args(["--api", "127.0.0.1:0", "--nbd-tcp", "127.0.0.1:0"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let ready = s.join("vesta-data/vestad.json");
    let info: serde_json::Value = wait_for(Duration::from_secs(20), "ready file", || {
        serde_json::from_str(&std::fs::read_to_string(&ready).ok()?).ok()
    });
    assert!(s.join("vesta-data/datastores/default").is_dir());
    assert!(s.join("vesta-data/nbd.sock").exists());
    let api = format!("http://{}", info["api"].as_str().unwrap());
    let out = run(Command::new(bin("vesta")).args(["--api", &api, "--json", "datastore", "list"]));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j[0]["name"], "default");
    assert_eq!(j[0]["kind"], "dir");
    vesta_tests::signal(child.id(), libc::SIGTERM);
    assert!(child.wait().unwrap().success());
    assert!(
        !s.join("vesta-data/nbd.sock").exists(),
        "socket removed at exit"
    );
}

#[test]
fn a_datastore_down_at_start_up_is_reported_and_the_rest_serve() {
    let mut k = Nbdkit::start(64 << 20, &[], &[]);
    let mut v = Vestad::start();
    v.vesta_ok(&["datastore", "add", "san", "--lun", &k.uri()]);
    v.vesta_ok(&[
        "volume",
        "create",
        "onsan",
        "--size",
        "1M",
        "--datastore",
        "san",
    ]);
    v.create_volume("local", "1M");
    assert!(v.terminate().success());
    k.stop();
    v.launch();
    let ds = v.vesta_json(&["datastore", "list"]);
    let san = ds
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["name"] == "san")
        .unwrap();
    assert!(
        san["status"].as_str().unwrap().contains("cannot reach"),
        "{san}"
    );
    let vol = v.vesta_json(&["volume", "show", "onsan"]);
    assert_ne!(vol["status"], "ok");
    let e = vesta_tests::run(
        Command::new("qemu-io")
            .args(["-f", "raw", "-c", "read 0 512"])
            .arg(v.url("onsan")),
    );
    assert!(
        !e.status.success(),
        "an unavailable volume must not be served"
    );
    qemu_io(&v.url("local"), &["write -P 1 0 512", "read -P 1 0 512"]);

    // When the LUN is back, its datastore and volume recover without a restart of vestad.
    k.restart();
    wait_for(Duration::from_secs(15), "the volume to recover", || {
        (v.vesta_json(&["volume", "show", "onsan"])["status"] == "ok").then_some(())
    });
    qemu_io(&v.url("onsan"), &["write -P 2 0 512", "read -P 2 0 512"]);
}

/// A restart of the NBD server under an uncached volume holds its clients' IO instead of
/// failing it (DESIGN §4: a volume whose datastore fails stalls): a write sent while the
/// server is down, and one in service at the server when it was killed, both complete once
/// it is back, and read back. The second goes out again only after the late-write grace
/// (the old server might still have carried it out).
#[test]
fn an_uncached_volumes_io_waits_out_a_restart_of_its_nbd_datastore() {
    let mut k = Nbdkit::start(64 << 20, &["--filter=delay"], &["delay-write=1"]);
    let v = Vestad::start_with(VestadOpts {
        config: Some("unreachable_wait_s = 60\n".into()),
        ..Default::default()
    });
    v.vesta_ok(&["datastore", "add", "san", "--lun", &k.uri()]);
    v.vesta_ok(&[
        "volume",
        "create",
        "w",
        "--size",
        "1M",
        "--datastore",
        "san",
    ]);
    qemu_io(&v.url("w"), &["write -P 1 0 4096", "flush"]);
    let write = |pattern: u8| {
        let url = v.url("w");
        std::thread::spawn(move || {
            run(Command::new("qemu-io")
                .args(["-f", "raw", "-c", &format!("write -P {pattern} 0 4096")])
                .args(["-c", "flush"])
                .arg(url))
        })
    };
    let done = |w: std::thread::JoinHandle<std::process::Output>| {
        let out = w.join().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && !text.contains("failed"),
            "the IO failed: {text}"
        );
    };

    // Down before the write is sent: no connection to send it on.
    k.stop();
    let w = write(2);
    std::thread::sleep(Duration::from_millis(1500));
    assert!(!w.is_finished(), "the write did not wait for the datastore");
    k.restart();
    done(w);
    qemu_io(&v.url("w"), &["read -P 2 0 4096"]);

    // Killed with the write in its delay filter: the write went unanswered.
    let w = write(3);
    std::thread::sleep(Duration::from_millis(500));
    k.stop();
    std::thread::sleep(Duration::from_millis(500));
    assert!(!w.is_finished(), "the write did not wait for the datastore");
    k.restart();
    done(w);
    qemu_io(&v.url("w"), &["read -P 3 0 4096"]);
    let log = v.log();
    assert!(log.contains("its datastore is unreachable"), "{log}");
    assert!(log.contains("its datastore answers again"), "{log}");
}

#[test]
fn a_volume_on_a_datastore_that_is_down_is_only_forgotten_with_force() {
    let mut k = Nbdkit::start(64 << 20, &[], &[]);
    let v = Vestad::start_with(VestadOpts {
        config: Some("unreachable_wait_s = 1\n".into()),
        ..Default::default()
    });
    v.vesta_ok(&["datastore", "add", "san", "--lun", &k.uri()]);
    v.vesta_ok(&[
        "volume",
        "create",
        "gone",
        "--size",
        "1M",
        "--datastore",
        "san",
    ]);
    k.stop();
    // The running daemon learns the datastore is down on its next IO to it, which waits the
    // configured second for it to come back, then fails.
    let t = Instant::now();
    let io = run(Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write 0 512"])
        .arg(v.url("gone")));
    assert!(!io.status.success());
    assert!(t.elapsed() >= Duration::from_secs(1), "{:?}", t.elapsed());
    let mut v = v;
    assert!(v.terminate().success());
    v.launch();
    let e = v.vesta_err(&["volume", "delete", "gone"]);
    assert!(
        e.contains("cannot be deleted now") && e.contains("--force"),
        "{e}"
    );
    assert_eq!(
        v.vesta_json(&["volume", "list"]).as_array().unwrap().len(),
        1
    );
    v.vesta_ok(&["volume", "delete", "gone", "--force"]);
    assert_eq!(
        v.vesta_json(&["volume", "list"]).as_array().unwrap().len(),
        0
    );
    assert!(v.log().contains("leaving its storage there"));
}
