//! A real VM on a Vesta volume (DESIGN §2: "a VM disk" among the clients that must work
//! unmodified). QEMU boots a Linux guest (Debian's cloud kernel and a busybox initramfs,
//! built by `tests/vm/guest.sh`) with a `wb` volume as its virtio disk, served over NBD by
//! `vestad`, on an nbdkit LUN with a write delay. The guest's ext4 issues the FLUSH and FUA
//! writes a real file system does; its journal must come back intact after the host's
//! daemon dies.
//!
//! In `wbp` the owner host dies instead, and the guest boots twice more: from the datastore
//! image alone once a peer has replayed (a VM restarted where there is no Vesta), and on the
//! returned owner.
//!
//! QEMU runs under TCG (software emulation): nested KVM is not dependable on the machines
//! this runs on, and a busybox guest boots in a few seconds without it.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use vesta_tests::{
    read_file, run_ok, wait_for, Etcd, Host, Nbdkit, Scratch, Vestad, CLUSTER_TTL_S, LUN_EXTENT,
};

const VOLUME_SIZE: u64 = 256 << 20;
/// A TCG boot takes a few seconds alone; generous for a loaded CI machine.
const GUEST_LIMIT: Duration = Duration::from_secs(240);

/// The kernel and initramfs, built once per target directory (and once per test process:
/// the tests of this file run at once).
fn guest() -> PathBuf {
    static GUEST: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    GUEST
        .get_or_init(|| {
            let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("vm/guest.sh");
            // Named after the script's contents (FNV-1a), so a changed guest is rebuilt.
            let text = std::fs::read(&script).expect("read guest.sh");
            let hash = text.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
            });
            let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("vm-guest-{hash:016x}"));
            run_ok(Command::new("bash").arg(script).arg(&dir));
            dir
        })
        .clone()
}

/// One boot of the guest: QEMU with its serial console on a pipe, every line kept.
struct Boot {
    qemu: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Boot {
    /// Boots `phase` on `disk`: an NBD URL or an image file.
    fn start(guest: &Path, disk: &str, phase: &str) -> Boot {
        let mut qemu = Command::new("qemu-system-x86_64")
            .args([
                "-accel",
                "tcg",
                "-m",
                "256",
                "-nodefaults",
                "-display",
                "none",
            ])
            .args(["-serial", "stdio", "-no-reboot"])
            .arg("-kernel")
            .arg(guest.join("vmlinuz"))
            .arg("-initrd")
            .arg(guest.join("initrd.gz"))
            .arg("-append")
            .arg(format!("console=ttyS0 panic=-1 quiet vesta.phase={phase}"))
            // cache=writeback (QEMU's default) shows the guest a disk with a volatile write
            // cache, so its file system sends FLUSH and FUA as it would to real hardware.
            .arg("-drive")
            .arg(format!("file={disk},format=raw,if=virtio,cache=writeback"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start qemu-system-x86_64 (make deps installs qemu-system-x86)");
        let out = qemu.stdout.take().unwrap();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let keep = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).split(b'\n') {
                let Ok(line) = line else { break };
                let line = String::from_utf8_lossy(&line).trim_end().to_string();
                keep.lock().unwrap().push(line);
            }
        });
        Boot { qemu, lines }
    }

    fn has(&self, what: &str) -> bool {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .any(|l| l.ends_with(&format!("VESTA-VM {what}")))
    }

    /// Waits for one of `outcomes`; panics with the console if the guest stops first.
    fn wait(&mut self, outcomes: &[&str]) -> String {
        wait_for(
            GUEST_LIMIT,
            &format!("the guest to say one of {outcomes:?}"),
            || {
                if let Some(o) = outcomes.iter().find(|o| self.has(o)) {
                    return Some(o.to_string());
                }
                if let Ok(Some(st)) = self.qemu.try_wait() {
                    std::thread::sleep(Duration::from_millis(200));
                    if let Some(o) = outcomes.iter().find(|o| self.has(o)) {
                        return Some(o.to_string());
                    }
                    panic!(
                        "qemu exited ({st}) before the guest said one of {outcomes:?}:\n{}",
                        self.console()
                    );
                }
                None
            },
        )
    }

    /// The md5 sums the guest printed between its `sums-begin` and `sums-end` lines (only
    /// lines that look like `md5sum`'s: a kernel message may land in between).
    fn sums(&self) -> Vec<String> {
        let lines = self.lines.lock().unwrap();
        let begin = lines
            .iter()
            .position(|l| l.ends_with("VESTA-VM sums-begin"));
        let end = lines.iter().position(|l| l.ends_with("VESTA-VM sums-end"));
        match (begin, end) {
            (Some(b), Some(e)) if b < e => lines[b + 1..e]
                .iter()
                .filter(|l| {
                    l.len() > 34
                        && l[..32].bytes().all(|b| b.is_ascii_hexdigit())
                        && l[32..].starts_with("  file")
                })
                .cloned()
                .collect(),
            _ => panic!("the guest printed no sums:\n{}", lines.join("\n")),
        }
    }

    /// Lines where the guest said something failed (a module, a write, a mount).
    fn failures(&self) -> Vec<String> {
        let lines = self.lines.lock().unwrap();
        lines
            .iter()
            .filter(|l| l.contains("VESTA-VM") && l.contains("failed"))
            .cloned()
            .collect()
    }

    fn console(&self) -> String {
        self.lines.lock().unwrap().join("\n")
    }

    fn kill(&mut self) {
        let _ = self.qemu.kill();
        let _ = self.qemu.wait();
    }

    /// Waits for the guest to power off.
    fn wait_exit(&mut self) {
        wait_for(GUEST_LIMIT, "the guest to power off", || {
            self.qemu.try_wait().unwrap().map(|_| ())
        });
    }
}

impl Drop for Boot {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Boot 1: writes and syncs files on the volume, and is still writing when this returns.
/// Returns the boot and the sums of the synced files.
fn boot_writing(guest: &Path, url: &str) -> (Boot, Vec<String>) {
    let mut boot = Boot::start(guest, url, "write");
    let got = boot.wait(&["extra 2", "mount failed", "io error"]);
    assert_eq!(
        got,
        "extra 2",
        "the writing boot failed:\n{}",
        boot.console()
    );
    let synced = boot.sums();
    assert_eq!(
        synced.len(),
        8,
        "the writing boot printed sums:\n{}",
        boot.console()
    );
    assert!(
        boot.failures().is_empty(),
        "the writing boot failed a step:\n{}",
        boot.console()
    );
    (boot, synced)
}

/// A verifying boot on `disk`: ext4 replays its journal, and every synced file must read back
/// whole, with the same sums file.
fn boot_verifying(guest: &Path, disk: &str, synced: &[String], what: &str) {
    let mut boot = Boot::start(guest, disk, "verify");
    let got = boot.wait(&["verify ok", "verify FAILED", "mount failed"]);
    assert_eq!(
        got,
        "verify ok",
        "{what}: the guest's synced files are damaged:\n{}",
        boot.console()
    );
    assert_eq!(
        boot.sums(),
        synced,
        "{what}: the sums file the guest reads back differs from the one it synced"
    );
    boot.wait_exit();
}

/// A tool from /usr/sbin, which is not on a normal user's PATH on Debian.
fn sbin(name: &str) -> Command {
    let path = std::env::var("PATH").unwrap_or_default();
    let mut c = Command::new(name);
    c.env("PATH", format!("{path}:/usr/sbin:/sbin"));
    c
}

/// An ext4 file system made on the host, copied onto the volume at `url` by nbdcopy.
fn make_fs(scratch: &Scratch, url: &str) {
    let fs = scratch.join("fs.img");
    std::fs::File::create(&fs)
        .unwrap()
        .set_len(VOLUME_SIZE)
        .unwrap();
    run_ok(sbin("mkfs.ext4").args(["-q", "-F"]).arg(&fs));
    run_ok(Command::new("nbdcopy").arg(&fs).arg(url));
}

/// The file system on the volume checks clean, and the LUN holds exactly the volume (the
/// volume must be clean).
fn check_fs_and_lun(v: &Vestad, name: &str, lun: &Nbdkit, scratch: &Scratch) {
    let copy = copy_out(v, name, scratch);
    run_ok(sbin("e2fsck").args(["-f", "-n"]).arg(&copy));
    let img = read_file(&lun.image);
    let vol = read_file(&copy);
    assert!(
        img[LUN_EXTENT..LUN_EXTENT + vol.len()] == vol[..],
        "the LUN image differs from the volume"
    );
}

/// A vestad with a `wb` volume `vm` (with `hold`'s options) on an nbdkit LUN whose writes take
/// a millisecond, holding a fresh ext4 file system.
fn wb_vm(scratch: &Scratch, hold: &[&str]) -> (Nbdkit, Vestad) {
    let lun = Nbdkit::start(2 * VOLUME_SIZE, &["--filter=delay"], &["delay-write=1ms"]);
    let v = Vestad::start();
    v.add_lun("san", &lun, 8);
    let size = VOLUME_SIZE.to_string();
    let mut args = vec![
        "volume",
        "create",
        "vm",
        "--size",
        &size,
        "--datastore",
        "san",
        "--policy",
        "wb",
    ];
    args.extend_from_slice(hold);
    v.vesta_ok(&args);
    make_fs(scratch, &v.url("vm"));
    (lun, v)
}

/// The volume's contents through a second client (nbdcopy), as a file.
fn copy_out(v: &Vestad, name: &str, scratch: &Scratch) -> PathBuf {
    let out = scratch.join(&format!("{name}.copy"));
    let _ = std::fs::remove_file(&out);
    run_ok(Command::new("nbdcopy").arg(v.url(name)).arg(&out));
    out
}

#[test]
fn a_vms_synced_files_survive_kill_9_of_vestad() {
    let guest = guest();
    let scratch = Scratch::new("vm");
    // A LUN whose writes take a millisecond, and windows held for 5 s: the guest's synced
    // files are still dirty in the cache when vestad dies, so the restart must replay them.
    let (mut lun, mut v) = wb_vm(&scratch, &["--hold", "5"]);

    // Boot 1 writes and syncs files, then keeps writing while vestad is killed.
    let (mut boot, synced) = boot_writing(&guest, &v.url("vm"));
    v.kill9();
    // Give the guest a moment to see its disk fail mid-write, then pull the plug.
    std::thread::sleep(Duration::from_millis(500));
    boot.kill();
    lun.outlive_killed_client();
    v.launch();

    // Boot 2: ext4 replays its journal; every synced file must read back whole.
    boot_verifying(&guest, &v.url("vm"), &synced, "after kill -9 of vestad");
    let log = v.log();
    assert!(
        log.contains("replaying"),
        "the restart found no dirty data to replay, so this test proved nothing:\n{log}"
    );

    // The guest unmounted cleanly: the file system checks clean on the host, and once the
    // volume is destaged the LUN holds exactly the volume.
    v.wait_clean("vm");
    check_fs_and_lun(&v, "vm", &lun, &scratch);
}

/// A power cut of the host: the cache device loses every write no FLUSH or FUA made durable,
/// so only what the guest's ext4 waited for may survive, and that must, with its journal.
/// Destaging is held back (and the idle probe of the cache device does not sync while it
/// records), so no sync but those the guest's FLUSH and FUA writes ask for covers its writes.
#[test]
fn a_vms_synced_files_survive_a_power_cut_of_the_cache_device() {
    let guest = guest();
    let scratch = Scratch::new("vm-power");
    let (mut lun, mut v) = wb_vm(&scratch, &["--hold", "600", "--max-dirty-age", "600"]);
    v.record_power_cut();

    let (mut boot, synced) = boot_writing(&guest, &v.url("vm"));
    let lost = v.power_cut();
    boot.kill();
    assert!(
        lost > 0,
        "the power cut found no unsynced write to lose, so this test proved nothing"
    );
    lun.outlive_killed_client();
    v.launch();
    boot_verifying(&guest, &v.url("vm"), &synced, "after a power cut");
    assert!(
        v.log().contains("replaying"),
        "the restart found no dirty data to replay, so this test proved nothing"
    );
    // Leaving wb destages everything; then the LUN is exactly the volume.
    v.vesta_ok(&["volume", "policy", "vm", "wt"]);
    check_fs_and_lun(&v, "vm", &lun, &scratch);
}

/// A host of the etcd cluster on its own loopback address, with a cache that holds the
/// guest's writes.
fn host(etcd: &Etcd, name: &str, fault_domain: &str, ip: &str, lun: &Nbdkit) -> Vestad {
    etcd.host(
        lun,
        Host {
            cache: "512M",
            ..Host::new(name, fault_domain, ip)
        },
    )
}

fn replicating_to(v: &Vestad, name: &str, peer: &str) -> bool {
    let s: Value = v.vesta_json(&["volume", "show", name]);
    s["cache"]["mode"] == "wbp:1"
        && s["cache"]["peers"]
            .as_array()
            .is_some_and(|a| a.len() == 1 && a[0]["host"] == peer && a[0]["error"].is_null())
}

#[test]
fn a_vm_on_a_wbp_volume_finds_its_synced_files_after_its_host_dies() {
    let guest = guest();
    let scratch = Scratch::new("vm-wbp");
    let etcd = Etcd::start();
    let mut lun = Nbdkit::start(2 * VOLUME_SIZE, &[], &[]);
    let mut a = host(&etcd, "a", "rack1", "127.0.0.2", &lun);
    let b = host(&etcd, "b", "rack2", "127.0.0.3", &lun);
    // Destaging held back: what the guest writes stays in a's cache and b's replicas until
    // someone replays it.
    a.vesta_ok(&[
        "volume",
        "create",
        "vm",
        "--size",
        &VOLUME_SIZE.to_string(),
        "--policy",
        "wbp:1",
        "--hold",
        "600",
        "--max-dirty-age",
        "600",
    ]);
    wait_for(Duration::from_secs(30), "a to replicate to b", || {
        replicating_to(&a, "vm", "b").then_some(())
    });
    make_fs(&scratch, &a.url("vm"));

    // The guest writes and syncs files on a, and is still writing when a dies.
    let (mut boot, synced) = boot_writing(&guest, &a.url("vm"));
    a.kill9();
    std::thread::sleep(Duration::from_millis(500));
    boot.kill();
    lun.keep_running();
    wait_for(
        Duration::from_secs(CLUSTER_TTL_S + 30),
        "b to replay a's volume",
        || b.log().contains("online replay done").then_some(()),
    );

    // A VM restarted where there is no Vesta at all, on the datastore's bytes alone.
    let img = read_file(&lun.image);
    let on_datastore = scratch.join("datastore.img");
    std::fs::write(
        &on_datastore,
        &img[LUN_EXTENT..LUN_EXTENT + VOLUME_SIZE as usize],
    )
    .unwrap();
    drop(img);
    boot_verifying(
        &guest,
        &on_datastore.display().to_string(),
        &synced,
        "on the datastore after b's online replay",
    );

    // The owner returns: it drops its stale copy, serves from the datastore and takes b as
    // its peer again; the guest boots on it.
    a.launch();
    wait_for(Duration::from_secs(30), "a to replicate to b again", || {
        replicating_to(&a, "vm", "b").then_some(())
    });
    boot_verifying(&guest, &a.url("vm"), &synced, "on the returned owner");

    // Leaving wbp destages everything; then the LUN is exactly the volume.
    a.vesta_ok(&["volume", "policy", "vm", "wt"]);
    check_fs_and_lun(&a, "vm", &lun, &scratch);
    lun.assert_one_writer_at_a_time(LUN_EXTENT as u64..u64::MAX);
}
