//! The crash campaigns (issue 3): a checker writes versioned blocks to a `wb` volume on an
//! nbdkit LUN with a write delay, and vestad dies at a random moment: killed with SIGKILL
//! (every completed write must read back), while the LUN fails, during policy changes, or in
//! a power cut of its cache device (every durable write must read back). After replay the LUN
//! image must equal the volume.
//!
//! `make test` runs a few rounds of each; environment variables set more (the README lists
//! them), e.g. `VESTA_CRASH_ROUNDS=300 cargo test --release -p vesta-tests --test crash`. A
//! failing round prints its seed; `VESTA_CRASH_SEED=S` replays the campaign from it.

use std::time::Duration;

use vesta_tests::checker::{
    assert_holds_completed, assert_holds_durable, campaign, reset_to, settle_to, Checker,
    PolicyChanger, Xorshift, BLOCK, BLOCKS,
};
use vesta_tests::{read_file, Nbdkit, Vestad, LUN_EXTENT};

/// A vestad with `lun` as datastore `san` and the checker's `wb` volume `c` on it.
fn wb_volume_on(lun: &Nbdkit) -> Vestad {
    let v = Vestad::start();
    v.add_lun("san", lun, 8);
    v.vesta_ok(&[
        "volume",
        "create",
        "c",
        "--size",
        &(BLOCKS * BLOCK).to_string(),
        "--datastore",
        "san",
        "--policy",
        "wb",
    ]);
    v
}

/// Every write the checker completed reads back from the restarted `v`'s volume `c`, which
/// becomes the known state for the next round; returns what was read.
fn completed_writes_read_back(ck: &Checker, v: &Vestad, round: u64, seed: u64) -> Vec<u8> {
    let got = ck.read(&v.url("c"));
    let completed = settle_to(&got, &ck.known, round, seed);
    assert!(
        completed > 0,
        "round {round}: the checker completed no writes"
    );
    got
}

/// The LUN's image holds exactly the volume's contents `got` (once nothing is dirty).
fn the_lun_holds_the_volume(lun: &Nbdkit, got: &[u8], round: u64, seed: u64) {
    let img = read_file(&lun.image);
    assert!(
        img[LUN_EXTENT..LUN_EXTENT + got.len()] == got[..],
        "round {round} (seed {seed}): once settled the LUN image differs from the volume"
    );
}

#[test]
fn completed_writes_survive_kill_9_of_vestad() {
    let (rounds, seed0) = campaign("crash", "VESTA_CRASH_ROUNDS", 20);
    // A LUN whose writes take a millisecond, so dirty data piles up in the cache.
    let mut lun = Nbdkit::start(64 << 20, &["--filter=delay"], &["delay-write=1ms"]);
    let mut v = wb_volume_on(&lun);
    let ck = Checker::new();
    let mut rng = Xorshift(seed0 | 1);
    for round in 0..rounds {
        let seed = rng.next_u64();
        let writers = ck.write(v.url("c"), seed);
        // Kill at a random moment, 50–550 ms into the writes.
        std::thread::sleep(Duration::from_millis(50 + seed % 500));
        v.kill9();
        writers.stop();
        // nbdkit 1.32 can abort once the killed vestad's requests leave its delay filter;
        // a SAN outlives its clients.
        lun.outlive_killed_client();
        v.launch();
        // Every completed write reads back; an in-flight one may or may not have landed.
        let got = completed_writes_read_back(&ck, &v, round, seed);
        // After replay, the LUN holds exactly the volume.
        v.wait_clean("c");
        the_lun_holds_the_volume(&lun, &got, round, seed);
    }
    // The campaign is only worth something if the kills found dirty data to replay.
    let replays = v.log().matches("replaying").count() as u64;
    eprintln!("crash campaign: {replays} of {rounds} restarts replayed dirty data");
    assert!(
        replays * 2 >= rounds,
        "only {replays} of {rounds} kills hit dirty data; the campaign is too gentle"
    );
}

/// The crash campaign with a failing datastore (FVP Table 1, datastore row, with random
/// timing): under a checker's writes to a `wb` volume, the LUN starts failing every write
/// (nbdkit's error filter, switched by its error file) at a random moment, vestad is killed
/// while it fails or after it healed, and restarts while it still fails or not. While the
/// LUN fails, the restarted volume's replay waits and its reads come from the cache; every
/// completed write reads back throughout, and once the LUN heals the replay brings it to
/// exactly the volume. `VESTA_DATASTORE_CRASH_ROUNDS` sets the rounds (default 4).
#[test]
fn completed_writes_survive_kill_9_while_the_datastore_fails() {
    let (rounds, seed0) = campaign("datastore failure", "VESTA_DATASTORE_CRASH_ROUNDS", 4);
    let (mut lun, errors) = Nbdkit::start_failing(
        64 << 20,
        "pwrite",
        &["--filter=delay"],
        &["delay-write=1ms"],
    );
    let mut v = wb_volume_on(&lun);
    let ck = Checker::new();
    let mut rng = Xorshift(seed0 | 1);
    let mut stalled_restarts = 0;
    for round in 0..rounds {
        let seed = rng.next_u64();
        let mut r = Xorshift(seed | 1);
        let writers = ck.write(v.url("c"), seed);
        std::thread::sleep(Duration::from_millis(50 + r.next_u64() % 300));
        errors.on();
        std::thread::sleep(Duration::from_millis(r.next_u64() % 400));
        let healed_before_kill = r.next_u64().is_multiple_of(3);
        if healed_before_kill {
            errors.off();
            std::thread::sleep(Duration::from_millis(r.next_u64() % 200));
        }
        v.kill9();
        writers.stop();
        lun.outlive_killed_client();
        v.launch();
        if errors.is_on() {
            // Still failing: the replay waits, and reads come from the cache meanwhile.
            stalled_restarts += 1;
            let got = ck.read(&v.url("c"));
            assert_holds_completed(&got, &ck.known, round, seed);
            std::thread::sleep(Duration::from_millis(r.next_u64() % 1000));
            errors.off();
        }
        let got = completed_writes_read_back(&ck, &v, round, seed);
        v.wait_clean("c");
        the_lun_holds_the_volume(&lun, &got, round, seed);
    }
    eprintln!(
        "datastore failure campaign: {stalled_restarts} of {rounds} restarts found the LUN failing"
    );
}

/// The policy each change names, and what `vesta volume policy` is given for it.
const CHANGES: [(&str, &[&str]); 5] = [
    ("wt", &[]),
    ("uncached", &[]),
    ("wb", &[]),
    ("wb", &["--hold", "2"]),
    ("wb", &["--rpo", "1"]),
];

/// Waits until the volume has no dirty data (or no cache at all: uncached).
fn wait_settled(v: &Vestad, name: &str) -> String {
    vesta_tests::wait_for(Duration::from_secs(60), "the volume to settle", || {
        let j = v.vesta_json(&["volume", "show", name]);
        (j["cache"].is_null() || j["cache"]["dirty_bytes"] == 0)
            .then(|| j["policy"].as_str().unwrap_or_default().to_owned())
    })
}

/// The crash campaign across policy changes: under the checker's writes, a second client
/// changes the volume's policy at random (wt, uncached, wb, wb holding its windows 2 s, wb
/// with an RPO), and vestad is killed with SIGKILL at a random moment: during a drain, just
/// after a switch, or between switches. After the restart every completed write reads back,
/// the volume has the policy of its last completed change (or of the one the kill cut short),
/// and once it settles the LUN holds exactly the volume. `VESTA_POLICY_CRASH_ROUNDS` sets the
/// rounds (default 8).
#[test]
fn completed_writes_survive_kill_9_during_policy_changes() {
    let (rounds, seed0) = campaign("policy change", "VESTA_POLICY_CRASH_ROUNDS", 8);
    let mut lun = Nbdkit::start(64 << 20, &["--filter=delay"], &["delay-write=1ms"]);
    let mut v = wb_volume_on(&lun);
    let ck = Checker::new();
    let mut rng = Xorshift(seed0 | 1);
    let mut last = "wb".to_owned();
    let (mut changes, mut cut, mut cut_in_effect) = (0, 0, 0);
    for round in 0..rounds {
        let seed = rng.next_u64();
        let mut r = Xorshift(seed | 1);
        let writers = ck.write(v.url("c"), seed);
        let changer = PolicyChanger::start(&v.api, "c", &CHANGES, r.next_u64());
        if round.is_multiple_of(2) {
            // Kill at a random moment, 50–800 ms into the writes and changes.
            std::thread::sleep(Duration::from_millis(50 + r.next_u64() % 750));
        } else {
            // Kill within 40 ms of the start of a change that drains (to wt or uncached).
            changer.wait_for_a_change_to(&["wt", "uncached"], Duration::from_secs(5));
            std::thread::sleep(Duration::from_millis(r.next_u64() % 40));
        }
        changer.killing();
        v.kill9();
        writers.stop();
        let did = changer.join();
        changes += did.completed;
        cut += u64::from(did.cut_short.is_some());
        lun.outlive_killed_client();
        v.launch();
        // Every completed write reads back, whatever the policy was when vestad died.
        let got = completed_writes_read_back(&ck, &v, round, seed);
        // A completed change is never undone; one the kill cut short may or may not be done.
        let now = wait_settled(&v, "c");
        let expected = did.possible(&last);
        assert!(
            expected.contains(&now.as_str()),
            "round {round} (seed {seed}): the volume is {now} after the restart; expected one \
             of {expected:?}"
        );
        if did.cut_short == Some(now.as_str()) && did.done != did.cut_short {
            cut_in_effect += 1;
        }
        last = now;
        the_lun_holds_the_volume(&lun, &got, round, seed);
    }
    let replays = v.log().matches("replaying").count();
    eprintln!(
        "policy change campaign: {changes} changes completed, {cut} cut short by the kill \
         ({cut_in_effect} of them in effect after the restart); {replays} of {rounds} restarts \
         replayed dirty data"
    );
    assert!(
        changes + cut >= rounds,
        "only {changes} policy change(s) completed and {cut} cut short in {rounds} rounds; the \
         campaign is too gentle"
    );
}

/// Power cuts of the host at random moments (FVP §7.2, DESIGN §2): under the checker's writes,
/// some with FUA and the rest made durable by FLUSHes sent as they go, the cache device loses
/// every write no sync covered and vestad stops at once. After the restart each block holds
/// a version that was written and no older than its last durable one, and once the replay is
/// done the LUN holds exactly the volume. Rounds alternate between destaging at once and
/// holding windows for 2 s, so cuts find both little and much dirty data in the cache; every
/// third round a second client changes the volume's policy meanwhile, and a change that
/// completed before the cut must be in effect after it.
/// `VESTA_POWER_CUT_ROUNDS` sets the rounds (default 6).
#[test]
fn durable_writes_survive_power_cuts() {
    let (rounds, seed0) = campaign("power cut", "VESTA_POWER_CUT_ROUNDS", 6);
    let mut lun = Nbdkit::start(64 << 20, &["--filter=delay"], &["delay-write=1ms"]);
    let mut v = wb_volume_on(&lun);
    let ck = Checker::new();
    let mut rng = Xorshift(seed0 | 1);
    let (mut lost, mut rolled_back, mut changes) = (0, 0, 0);
    for round in 0..rounds {
        let seed = rng.next_u64();
        let mut r = Xorshift(seed | 1);
        let hold = if round % 3 == 1 { "2" } else { "0" };
        v.vesta_ok(&["volume", "policy", "c", "wb", "--hold", hold]);
        v.record_power_cut();
        let writers = ck.write_flushing(v.url("c"), seed);
        // Every third round, policy changes go on meanwhile.
        let changer =
            (round % 3 == 2).then(|| PolicyChanger::start(&v.api, "c", &CHANGES, r.next_u64()));
        std::thread::sleep(Duration::from_millis(50 + r.next_u64() % 500));
        if let Some(c) = &changer {
            c.killing();
        }
        lost += v.power_cut();
        writers.stop();
        let did = changer.map(PolicyChanger::join);
        lun.outlive_killed_client();
        v.launch();
        let got = ck.read(&v.url("c"));
        rolled_back += assert_holds_durable(&got, &ck.known, round, seed);
        // What survived was recovered from stable media: durable from here.
        reset_to(&got, &ck.known);
        let now = wait_settled(&v, "c");
        // A completed policy change survives the cut too.
        let expected = did.map_or(vec!["wb"], |d| d.possible("wb"));
        assert!(
            expected.contains(&now.as_str()),
            "round {round} (seed {seed}): the volume is {now} after the power cut; expected one \
             of {expected:?}"
        );
        changes += did.map_or(0, |d| d.completed);
        the_lun_holds_the_volume(&lun, &got, round, seed);
    }
    eprintln!(
        "power cut campaign: the cuts undid {lost} unsynced write(s) in the cache log; \
         {rolled_back} block(s) went back to an older completed version; {changes} policy \
         change(s) completed before a cut"
    );
    assert!(
        lost > 0,
        "no power cut found an unsynced write to lose; the campaign is too gentle"
    );
}
