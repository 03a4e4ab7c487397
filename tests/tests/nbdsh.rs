//! libnbd (`nbdsh`) checks of the commands beyond READ and WRITE: FLUSH, TRIM, WRITE_ZEROES
//! (with and without NO_HOLE), FUA, and multi-conn visibility.

use std::os::unix::fs::MetadataExt;

use vesta_tests::{nbdsh, read_file, Vestad};

#[test]
fn flush_fua_and_write_zeroes_behave_and_reach_the_datastore() {
    let v = Vestad::start();
    let url = v.create_volume("cmds", "16M");
    nbdsh(
        &url,
        r#"
assert h.can_flush() and h.can_fua() and h.can_zero() and h.can_trim()
a = b'\xab' * 65536
h.pwrite(a, 0)
h.flush()
assert h.pread(65536, 0) == a
h.pwrite(b'\xcd' * 4096, 8192, nbd.CMD_FLAG_FUA)
assert h.pread(4096, 8192) == b'\xcd' * 4096
# WRITE_ZEROES that may punch a hole, one that must not, and one with FUA.
h.zero(4096, 16384)
h.zero(4096, 32768, nbd.CMD_FLAG_NO_HOLE)
h.zero(512, 61440, nbd.CMD_FLAG_FUA)
exp = bytearray(a)
exp[8192:12288] = b'\xcd' * 4096
for off, n in [(16384, 4096), (32768, 4096), (61440, 512)]:
    exp[off:off + n] = bytes(n)
got = h.pread(65536, 0)
for i in range(0, 65536, 512):
    assert got[i:i + 512] == exp[i:i + 512], f"sector at {i} differs"
h.flush()
"#,
    );
    // The dir datastore's image holds exactly what the client saw.
    let img = read_file(&v.data_dir.join("datastores/default/cmds.raw"));
    assert!(img[..8192].iter().all(|b| *b == 0xab));
    assert!(img[16384..20480].iter().all(|b| *b == 0));
    assert!(img[8192..12288].iter().all(|b| *b == 0xcd));
    assert!(img[12288..16384].iter().all(|b| *b == 0xab));
}

/// Where the first hole at or after `offset` starts in `file` (its size if none).
fn hole_at(file: &std::path::Path, offset: u64) -> u64 {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(file).unwrap();
    let r = unsafe { libc::lseek(f.as_raw_fd(), offset as libc::off_t, libc::SEEK_HOLE) };
    assert!(r >= 0, "SEEK_HOLE: {}", std::io::Error::last_os_error());
    r as u64
}

/// WRITE_ZEROES with NO_HOLE must leave the range allocated on the datastore, whatever the
/// policy: a `wt` or `wb` volume keeps the flag through its cache log (and `wb` through the
/// destager) to the datastore. Without NO_HOLE the datastore may deallocate, and a `dir`
/// datastore does: the test checks both, so it sees the flag make the difference.
#[test]
fn write_zeroes_with_no_hole_stays_allocated_on_the_datastore_in_every_policy() {
    let v = Vestad::start();
    for policy in ["uncached", "wt", "wb"] {
        let name = format!("nh-{policy}");
        v.vesta_ok(&[
            "volume", "create", &name, "--size", "16M", "--policy", policy,
        ]);
        let file = v.data_dir.join(format!("datastores/default/{name}.raw"));
        nbdsh(
            &v.url(&name),
            r#"
h.pwrite(b'\x5a' * (8 << 20), 0)
h.flush()
h.zero(4 << 20, 0)
h.zero(4 << 20, 4 << 20, nbd.CMD_FLAG_NO_HOLE)
h.flush()
assert h.pread(8 << 20, 0) == bytes(8 << 20)
"#,
        );
        if policy == "wb" {
            v.wait_clean(&name);
        }
        let img = read_file(&file);
        assert!(
            img[..8 << 20].iter().all(|b| *b == 0),
            "{policy}: the datastore must read zeroes"
        );
        assert!(
            hole_at(&file, 4 << 20) >= 8 << 20,
            "{policy}: a NO_HOLE zeroing was deallocated on the datastore"
        );
        assert_eq!(
            hole_at(&file, 0),
            0,
            "{policy}: a zeroing without NO_HOLE was not deallocated (the test would not see \
             the flag make a difference)"
        );
    }
}

#[test]
fn trim_deallocates_space_on_the_datastore() {
    let v = Vestad::start();
    let url = v.create_volume("trim", "64M");
    let file = v.data_dir.join("datastores/default/trim.raw");
    nbdsh(&url, "h.pwrite(b'\\x77' * (8 << 20), 0)\nh.flush()");
    let before = std::fs::metadata(&file).unwrap().blocks();
    nbdsh(
        &url,
        "h.trim(8 << 20, 0)\nh.trim(4096, 0, nbd.CMD_FLAG_FUA)\nh.flush()",
    );
    let after = std::fs::metadata(&file).unwrap().blocks();
    assert!(
        before >= (8 << 20) / 512 && after * 8 < before,
        "trim should release the 8 MiB written: {before} -> {after} 512-byte blocks"
    );
}

#[test]
fn two_connections_see_each_others_flushed_writes() {
    let v = Vestad::start();
    let url = v.create_volume("mc", "16M");
    nbdsh(
        &url,
        &format!(
            r#"
assert h.can_multi_conn()
h2 = nbd.NBD()
h2.connect_uri({url:?})
assert h2.can_multi_conn()
for i in range(64):
    off = i * 65536
    d1 = bytes([i]) * 4096
    d2 = bytes([255 - i]) * 4096
    h.pwrite(d1, off)
    h2.pwrite(d2, off + 4096)
    # A flush on either connection covers writes completed on both.
    (h2 if i % 2 else h).flush()
    assert h2.pread(4096, off) == d1, f"conn 2 misses conn 1's write at {{off}}"
    assert h.pread(4096, off + 4096) == d2, f"conn 1 misses conn 2's write at {{off}}"
h2.shutdown()
"#
        ),
    );
}
