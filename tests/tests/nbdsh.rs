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
