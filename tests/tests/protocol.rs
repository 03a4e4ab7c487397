//! Protocol negatives and ordering, with hand-driven connections: whatever one client sends,
//! it gets an error reply or a closed connection, the daemon logs one clear line, and other
//! clients are unaffected.

use std::io::Write;
use std::time::{Duration, Instant};

use vesta_tests::raw::*;
use vesta_tests::{nbdsh, qemu_io, wait_for, Nbdkit, Vestad};

/// A second, well-behaved client still gets correct service.
fn others_unaffected(v: &Vestad, vol: &str) {
    qemu_io(
        &v.url(vol),
        &["write -P 0x3c 0 4096", "read -P 0x3c 0 4096"],
    );
}

fn count(log: &str, needle: &str) -> usize {
    log.lines().filter(|l| l.contains(needle)).count()
}

fn wait_log(v: &Vestad, needle: &str) {
    wait_for(Duration::from_secs(10), needle, || {
        v.log().contains(needle).then_some(())
    });
}

#[test]
fn bad_request_magic_closes_only_that_connection_with_one_log_line() {
    let v = Vestad::start();
    v.create_volume("p", "1M");
    let (mut r, _) = Raw::go(&v.nbd_unix, "p");
    let mut h = Raw::header(0, CMD_READ, 1, 0, 512);
    h[3] ^= 0xff;
    r.s.write_all(&h).unwrap();
    assert!(
        r.closed(),
        "server must close a connection after a bad magic"
    );
    wait_log(&v, "bad request magic");
    assert_eq!(count(&v.log(), "bad request magic"), 1);
    others_unaffected(&v, "p");
}

#[test]
fn unknown_options_get_unsup_and_the_session_continues() {
    let v = Vestad::start();
    v.create_volume("p", "1M");
    let mut r = Raw::connect(&v.nbd_unix);
    r.hello();
    r.option(99, b"junk");
    assert_eq!(r.opt_reply().1, REP_ERR_UNSUP);
    r.option(8, b""); // NBD_OPT_STRUCTURED_REPLY: declined, simple replies it is
    assert_eq!(r.opt_reply().1, REP_ERR_UNSUP);
    r.option(5, b""); // NBD_OPT_STARTTLS
    assert_eq!(r.opt_reply().1, REP_ERR_UNSUP);
    // LIST with data is invalid; without, it names the export.
    r.option(OPT_LIST, b"x");
    assert_eq!(r.opt_reply().1, REP_ERR_INVALID);
    r.option(OPT_LIST, b"");
    let (_, kind, d) = r.opt_reply();
    assert_eq!(kind, REP_SERVER);
    assert_eq!(&d[4..], b"p");
    assert_eq!(r.opt_reply().1, REP_ACK);
    // INFO on an unknown export, and a malformed GO payload.
    r.option(OPT_INFO, &Raw::go_payload("nope"));
    let (_, kind, msg) = r.opt_reply();
    assert_eq!(kind, REP_ERR_UNKNOWN);
    let msg = String::from_utf8_lossy(&msg);
    assert!(
        msg.contains("nope") && msg.contains("volumes here: p"),
        "{msg}"
    );
    // No name at all (`nbd://HOST:PORT`): told to name the volume.
    r.option(OPT_INFO, &Raw::go_payload(""));
    let (_, kind, msg) = r.opt_reply();
    assert_eq!(kind, REP_ERR_UNKNOWN);
    let msg = String::from_utf8_lossy(&msg);
    assert!(msg.contains("no export name given"), "{msg}");
    r.option(OPT_GO, &[0, 0, 0, 9, b'p']);
    assert_eq!(r.opt_reply().1, REP_ERR_INVALID);
    // The session is still good: GO succeeds and IO works.
    r.option(OPT_GO, &Raw::go_payload("p"));
    loop {
        let (_, kind, _) = r.opt_reply();
        if kind == REP_ACK {
            break;
        }
        assert_eq!(kind, REP_INFO);
    }
    r.request(0, CMD_READ, 7, 0, 512);
    assert_eq!(r.reply().unwrap(), (0, 7));
    assert_eq!(r.read_n(512), vec![0u8; 512]);
    // ABORT before transmission is acknowledged.
    let mut a = Raw::connect(&v.nbd_unix);
    a.hello();
    a.option(OPT_ABORT, b"");
    assert_eq!(a.opt_reply().1, REP_ACK);
    assert!(a.closed());
}

#[test]
fn unknown_client_flags_close_the_connection() {
    let v = Vestad::start();
    let mut r = Raw::connect(&v.nbd_unix);
    let mut greeting = [0u8; 18];
    std::io::Read::read_exact(&mut r.s, &mut greeting).unwrap();
    r.s.write_all(&0x8000_0003u32.to_be_bytes()).unwrap();
    assert!(r.closed());
    wait_log(&v, "unknown client flags");
}

#[test]
fn invalid_requests_get_error_replies_and_the_connection_stays_usable() {
    let v = Vestad::start();
    v.create_volume("p", "1M");
    let (mut r, size) = Raw::go(&v.nbd_unix, "p");
    assert_eq!(size, 1 << 20);
    // Read past the end.
    r.request(0, CMD_READ, 1, size, 512);
    assert_eq!(r.reply().unwrap(), (EINVAL, 1));
    // Read straddling the end.
    r.request(0, CMD_READ, 2, size - 512, 1024);
    assert_eq!(r.reply().unwrap(), (EINVAL, 2));
    // Write past the end: payload consumed, ENOSPC.
    r.request(0, CMD_WRITE, 3, size, 512);
    r.s.write_all(&[1u8; 512]).unwrap();
    assert_eq!(r.reply().unwrap(), (ENOSPC, 3));
    // Unaligned offset and length.
    r.request(0, CMD_READ, 4, 1, 512);
    assert_eq!(r.reply().unwrap(), (EINVAL, 4));
    r.request(0, CMD_WRITE, 5, 0, 100);
    r.s.write_all(&[1u8; 100]).unwrap();
    assert_eq!(r.reply().unwrap(), (EINVAL, 5));
    // A read larger than the advertised maximum block size.
    r.request(0, CMD_READ, 6, 0, 64 << 20);
    assert_eq!(r.reply().unwrap(), (EINVAL, 6));
    // Unknown command and unknown flags.
    r.request(0, 42, 7, 0, 512);
    assert_eq!(r.reply().unwrap(), (EINVAL, 7));
    r.request(1 << 9, CMD_READ, 8, 0, 512);
    assert_eq!(r.reply().unwrap(), (EINVAL, 8));
    // Nothing was written by any of that, and the connection still serves.
    r.request(0, CMD_WRITE, 9, 512, 512);
    r.s.write_all(&[0x5au8; 512]).unwrap();
    assert_eq!(r.reply().unwrap(), (0, 9));
    r.request(0, CMD_READ, 10, 0, 1024);
    assert_eq!(r.reply().unwrap(), (0, 10));
    let d = r.read_n(1024);
    assert_eq!(&d[..512], &[0u8; 512][..]);
    assert_eq!(&d[512..], &[0x5au8; 512][..]);
    let log = v.log();
    assert!(count(&log, "past the end") >= 3, "{log}");
    assert!(count(&log, "not a multiple of 512") >= 2, "{log}");
}

#[test]
fn an_oversized_write_closes_the_connection_and_nothing_else() {
    let v = Vestad::start();
    v.create_volume("p", "128M");
    let (mut r, _) = Raw::go(&v.nbd_unix, "p");
    r.request(0, CMD_WRITE, 1, 0, 64 << 20);
    assert!(r.closed(), "an oversized WRITE must close the connection");
    wait_log(&v, "exceeds the maximum");
    assert_eq!(count(&v.log(), "exceeds the maximum"), 1);
    others_unaffected(&v, "p");
}

#[test]
fn a_client_vanishing_mid_request_is_logged_and_harmless() {
    let v = Vestad::start();
    v.create_volume("p", "1M");
    {
        let (mut r, _) = Raw::go(&v.nbd_unix, "p");
        r.request(0, CMD_WRITE, 1, 0, 65536);
        r.s.write_all(&[7u8; 1000]).unwrap();
        // dropped here: the socket closes with the payload incomplete
    }
    wait_log(&v, "disconnected in the middle of a request");
    others_unaffected(&v, "p");
    // The half-sent write was not applied.
    qemu_io(
        &v.url("p"),
        &["read -P 0x3c 0 4096", "read -P 0 4096 61440"],
    );
    // The connection's attachment is gone too.
    wait_for(Duration::from_secs(5), "detach", || {
        (v.vesta_json(&["volume", "show", "p"])["connections"] == 0).then_some(())
    });
}

#[test]
fn disc_finishes_in_flight_requests_before_closing() {
    let v = Vestad::start();
    v.create_volume("p", "1M");
    let (mut r, _) = Raw::go(&v.nbd_unix, "p");
    let mut b = Raw::header(0, CMD_WRITE, 1, 0, 4096);
    b.extend_from_slice(&[0x66u8; 4096]);
    b.extend_from_slice(&Raw::header(0, CMD_FLUSH, 2, 0, 0));
    b.extend_from_slice(&Raw::header(0, CMD_DISC, 3, 0, 0));
    r.s.write_all(&b).unwrap();
    let mut got = vec![r.reply().unwrap(), r.reply().unwrap()];
    got.sort();
    assert_eq!(got, vec![(0, 1), (0, 2)]);
    assert!(r.closed());
    qemu_io(&v.url("p"), &["read -P 0x66 0 4096"]);
}

#[test]
fn a_slow_request_does_not_hold_up_independent_ones() {
    // Reads from this LUN take 2 s; writes are immediate.
    let k = Nbdkit::start(64 << 20, &["--filter=delay"], &["delay-read=2"]);
    let v = Vestad::start();
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
    let start = Instant::now();
    r.request(0, CMD_READ, 1, 0, 4096);
    let mut w = Raw::header(0, CMD_WRITE, 2, 1 << 20, 4096);
    w.extend_from_slice(&[9u8; 4096]);
    r.s.write_all(&w).unwrap();
    let first = r.reply().unwrap();
    let first_at = start.elapsed();
    assert_eq!(
        first,
        (0, 2),
        "the write must complete before the slow read"
    );
    assert!(
        first_at < Duration::from_millis(1500),
        "write took {first_at:?}"
    );
    let second = r.reply().unwrap();
    assert_eq!(second, (0, 1));
    assert_eq!(r.read_n(4096), vec![0u8; 4096]);
    assert!(start.elapsed() >= Duration::from_secs(2));
    drop(r);
    nbdsh(
        &v.url("p"),
        "assert h.pread(4096, 1 << 20) == b'\\x09' * 4096",
    );
}
