//! Flow control end to end (issue 3, FVP §6): a `wb` volume on a LUN whose writes take 2 ms,
//! and a sustained write rate well above what the destager can send on.
//!
//! - the share never fills: writes are throttled, never stalled;
//! - the client's write rate converges to the destage rate;
//! - after the burst, throttling releases and writes complete at cache speed again.
//!
//! The client's queue depth is 8. With each write held at most 4× the datastore latency, a
//! client keeping D writes in flight cannot be slowed below D / (4 × latency) writes/s: 1,000/s
//! at D = 8 and 2 ms, 2,000/s at D = 16. Convergence to the destage rate within the bound is
//! only possible when that floor is under the destage rate, which at D = 16 it is not on a
//! loaded 2-core machine (the destager then sends 800–1,400 writes/s): such a client runs at
//! the floor, which is "SAN speed" as FVP §6 puts it, and its backlog grows until the share
//! fills (`bench/sustained.sh` shows this case).
//!
//! No write is held more than 4× the datastore's write latency plus 1 ms by flow control
//! (`engine::flow::hold_bound`): vestad counts every `wb` write whose delay, with the time the
//! write had spent already, would take it past that bound, and the test asserts there are
//! none, with no stall and no wait for log space. What a write takes beyond what flow control
//! asks for is how late the timer that releases it fires, and the scheduling of vestad's,
//! nbdkit's and fio's threads on two shared cores; vestad's longest write and fio's are
//! reported, not asserted (measured here: fio's p99 3.8–4.3 ms; its slowest of ~35,000 writes
//! and vestad's both 6–21 ms against bounds of 10–12 ms, the excess in the timer's lateness
//! and, rarely, an append that took a few milliseconds).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use vesta_tests::{wait_for, Nbdkit, Vestad};

fn fio_json(out: &str) -> Value {
    serde_json::from_str(&out[out.find('{').expect("fio JSON")..]).expect("fio JSON")
}

#[test]
fn flow_control_throttles_tracks_the_destager_and_releases() {
    let lun = Nbdkit::start(256 << 20, &["--filter=delay"], &["delay-write=2ms"]);
    let v = Vestad::start();
    v.add_lun("san", &lun, 8);
    // An RPO of one second makes flow control start after about a second's worth of dirty data.
    v.vesta_ok(&[
        "volume",
        "create",
        "f",
        "--size",
        "128M",
        "--datastore",
        "san",
        "--policy",
        "wb",
        "--rpo",
        "1",
    ]);
    let burst_s = 12;
    let fio = Command::new("fio")
        .args([
            "--name=burst",
            "--ioengine=nbd",
            &format!("--uri={}", v.url("f")),
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=8",
            "--size=128M",
            "--time_based",
            &format!("--runtime={burst_s}"),
            "--randrepeat=0",
            "--output-format=json",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    // Sample the volume over the second half of the burst: client writes completed and
    // writes destaged, both counted by vestad.
    let sample = |v: &Vestad| {
        let j = v.vesta_json(&["volume", "show", "f"]);
        let s = v.vesta_json(&["stats", "f"]);
        (
            Instant::now(),
            s["volumes"][0]["io"]["writes_total"].as_u64().unwrap(),
            j["cache"]["destaged_writes"].as_u64().unwrap(),
            j,
        )
    };
    std::thread::sleep(
        Duration::from_secs(burst_s / 2) - start.elapsed().min(Duration::from_secs(1)),
    );
    let a = sample(&v);
    std::thread::sleep(Duration::from_secs(burst_s / 2 - 2));
    let b = sample(&v);
    let out = fio.wait_with_output().unwrap();
    assert!(out.status.success());
    let j = fio_json(&String::from_utf8_lossy(&out.stdout));
    let w = &j["jobs"][0]["write"];

    // The burst was throttled, not stalled.
    let cache = &b.3["cache"];
    assert!(
        cache["throttled_writes"].as_u64().unwrap() > 0,
        "flow control never engaged: {cache}"
    );
    assert_eq!(cache["stalls"], 0, "the share filled: {cache}");
    let ds_lat_us = cache["datastore_write_latency_us"].as_u64().unwrap() as f64;
    assert!(
        ds_lat_us >= 2000.0,
        "the datastore is slower than 2 ms: {ds_lat_us} us"
    );

    // Flow control held no write past its bound, and nothing else made writes wait for room.
    assert_eq!(
        cache["throttled_past_bound"], 0,
        "flow control held writes past 4x the datastore latency + 1 ms: {cache}"
    );
    assert_eq!(
        cache["space_waits"], 0,
        "writes waited for log space: {cache}"
    );
    let longest_us = cache["longest_write_us"].as_u64().unwrap();
    let max_us = w["clat_ns"]["max"].as_f64().unwrap() / 1000.0;
    let p99_us = w["clat_ns"]["percentile"]["99.000000"].as_f64().unwrap() / 1000.0;
    let bound_us = 4.0 * ds_lat_us + 1000.0;

    // The client's rate converged to the destage rate over the second half.
    let secs = (b.0 - a.0).as_secs_f64();
    let client = (b.1 - a.1) as f64 / secs;
    let destage = (b.2 - a.2) as f64 / secs;
    eprintln!(
        "flow: client {client:.0} writes/s, destager {destage:.0} writes/s, p99 wait {p99_us:.0} us, \
         max {max_us:.0} us, longest in vestad {longest_us} us (bound {bound_us:.0}), datastore \
         latency {ds_lat_us:.0} us, pressure {}",
        cache["flow_pressure"]
    );
    assert!(
        (client - destage).abs() <= 0.25 * destage,
        "the client's {client:.0} writes/s did not converge to the destager's {destage:.0}"
    );

    // After the burst, throttling releases: once the destager catches up, writes are fast.
    // "Off" comes first, as pressure falls under the onset; the backlog is still near the
    // trigger then, and a write or a slow window can lift it over the onset again (the curve
    // has no hysteresis: that would be a cliff). Caught up means nothing dirty is left.
    wait_for(Duration::from_secs(60), "flow control to release", || {
        let j = v.vesta_json(&["volume", "show", "f"]);
        (j["cache"]["flow_control"] == "off").then_some(())
    });
    wait_for(Duration::from_secs(60), "the destager to catch up", || {
        let j = v.vesta_json(&["volume", "show", "f"]);
        (j["cache"]["dirty_writes"] == 0).then_some(())
    });
    let before = v.vesta_json(&["volume", "show", "f"])["cache"]["throttled_writes"]
        .as_u64()
        .unwrap();
    let out = Command::new("fio")
        .args([
            "--name=after",
            "--ioengine=nbd",
            &format!("--uri={}", v.url("f")),
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=1",
            "--size=128M",
            "--number_ios=100",
            "--output-format=json",
        ])
        .output()
        .unwrap();
    let j = fio_json(&String::from_utf8_lossy(&out.stdout));
    let mean_us = j["jobs"][0]["write"]["clat_ns"]["mean"].as_f64().unwrap() / 1000.0;
    let after = v.vesta_json(&["volume", "show", "f"])["cache"]["throttled_writes"]
        .as_u64()
        .unwrap();
    assert_eq!(after, before, "writes after the burst were still throttled");
    assert!(
        mean_us < ds_lat_us,
        "after the burst writes take {mean_us:.0} us, no faster than the datastore's {ds_lat_us:.0}"
    );
}
