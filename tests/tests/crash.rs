//! The crash campaign (issue 3): a checker writes versioned blocks to a `wb` volume on an nbdkit
//! LUN with a write delay, vestad is killed with SIGKILL at a random moment, restarted, and
//! every write that had completed must read back; after replay the LUN image must equal the
//! volume.
//!
//! `make test` runs 20 rounds; `VESTA_CRASH_ROUNDS=300 cargo test --release -p vesta-tests
//! --test crash` is the long mode. A failing round prints its seed; `VESTA_CRASH_SEED=S`
//! replays the campaign from it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nbd::client::Client;
use nbd::uri::NbdUri;
use vesta_tests::checker::{
    campaign, settle_to, write_until_killed, Known, Xorshift, BLOCK, BLOCKS,
};
use vesta_tests::{read_file, Nbdkit, Vestad, LUN_EXTENT};

#[test]
fn completed_writes_survive_kill_9_of_vestad() {
    let (rounds, seed0) = campaign("VESTA_CRASH_ROUNDS", 20);
    eprintln!("crash campaign: {rounds} rounds, VESTA_CRASH_SEED={seed0}");
    // A LUN whose writes take a millisecond, so dirty data piles up in the cache.
    let mut lun = Nbdkit::start(64 << 20, &["--filter=delay"], &["delay-write=1ms"]);
    let mut v = Vestad::start();
    v.add_lun("san", &lun, 8);
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
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let known = Arc::new(Mutex::new(vec![Known::default(); BLOCKS as usize]));
    let mut rng = Xorshift(seed0 | 1);
    for round in 0..rounds {
        let seed = rng.next_u64();
        let stop = Arc::new(AtomicBool::new(false));
        let writer = rt.spawn(write_until_killed(
            v.url("c"),
            known.clone(),
            seed,
            stop.clone(),
        ));
        // Kill at a random moment, 50–550 ms into the writes.
        std::thread::sleep(Duration::from_millis(50 + seed % 500));
        v.kill9();
        stop.store(true, Ordering::SeqCst);
        rt.block_on(writer).unwrap();
        // nbdkit 1.32 can abort once the killed vestad's requests leave its delay filter;
        // a SAN outlives its clients.
        lun.outlive_killed_client();
        v.launch();
        // Every completed write reads back; an in-flight one may or may not have landed.
        let got = rt.block_on(async {
            let c = Client::connect(&NbdUri::parse(&v.url("c")).unwrap(), 1)
                .await
                .unwrap();
            c.read(0, (BLOCKS * BLOCK) as u32).await.unwrap()
        });
        let completed = settle_to(&got, &known, round, seed);
        assert!(
            completed > 0,
            "round {round}: the checker completed no writes at all"
        );
        // After replay, the LUN holds exactly the volume.
        v.wait_clean("c");
        let img = read_file(&lun.image);
        assert!(
            img[LUN_EXTENT..LUN_EXTENT + got.len()] == got[..],
            "round {round} (seed {seed}): after replay the LUN image differs from the volume"
        );
    }
    // The campaign is only worth something if the kills found dirty data to replay.
    let replays = v.log().matches("replaying").count() as u64;
    eprintln!("crash campaign: {replays} of {rounds} restarts replayed dirty data");
    assert!(
        replays * 2 >= rounds,
        "only {replays} of {rounds} kills hit dirty data; the campaign is too gentle"
    );
}
