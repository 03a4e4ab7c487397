#!/usr/bin/env bash
# Random reads of data not in the page cache, on the uncached data path, side by side.
#
# fio --ioengine=nbd, 4 KiB random reads at QD1 and QD32 over SIZE (4 GiB) images written
# once, each run starting with its image out of the page cache (synced, then
# POSIX_FADV_DONTNEED), against
#   - vestad, policy uncached, on a `dir` datastore,
#   - nbdkit's file plugin and qemu-nbd (raw, writeback cache) on images in the same
#     directory (same disk),
# all over a unix socket; and the raw image file itself through fio's io_uring engine
# (buffered, no NBD). A run reads about 1.6 GiB at 80 k IOPS, so the page cache warms as it
# goes, for every target alike.
#
# POLICY=wb (with SIZE small enough for the cache, 1 GiB by default) makes the volume `wb`
# before the fill, so vestad's reads are hits in its cache file, which is dropped from the
# page cache before each run along with the volume's image.
#
#   bench/coldread.sh                 # 5 s per run
#   RUNTIME=10 SIZE=8G bench/coldread.sh
#   POLICY=wb SIZE=640M bench/coldread.sh
#   EVICT=0 POLICY=wb SIZE=640M bench/coldread.sh   # the same reads with everything in memory
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
BIN=${VESTA_BIN_DIR:-target/release}
RUNTIME=${RUNTIME:-5}
SIZE=${SIZE:-4G}
OUT=${OUT:-bench/out/coldread}
OUT=$(bench_out "$OUT")

side_by_side "$SIZE"
# What to drop from the page cache before a run of vestad, ':' between files.
VFILES=$VIMG
if [ -n "${POLICY:-}" ]; then
    "$BIN/vesta" --api "$API" volume policy bench "$POLICY" >/dev/null
    VFILES=$VIMG:$OUT/vesta/cache.img
fi
fill_side_by_side "$SIZE"
# The fills' writeback (16 GiB) done and settled before any run: it slows the disk's reads
# for a while after, and would fall on the first target.
sync
sleep "${SETTLE:-20}"

# evict FILES: written back, then dropped from the page cache (no root needed); ':' between
# files.
evict() {
    [ "${EVICT:-1}" = 1 ] || return 0
    sync
    python3 -c 'import os, sys
for f in sys.argv[1].split(":"):
    fd = os.open(f, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)' "$1"
}

# run NAME TARGET IMAGE QD -> "iops lat_us"; a TARGET starting with / is a file for io_uring.
run() {
    local json="$OUT/$1-qd$4.json" target
    case "$2" in
        /*) target=(--ioengine=io_uring --filename="$2") ;;
        *) target=(--ioengine=nbd --uri="$2") ;;
    esac
    evict "$3"
    fio --name="$1" "${target[@]}" --rw=randread --bs=4k --iodepth="$4" \
        --size="$SIZE" --runtime="$RUNTIME" --time_based --randrepeat=0 \
        --output-format=json --output="$json"
    python3 - "$json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))["jobs"][0]["read"]
print(f'{r["iops"]:.0f} {r["lat_ns"]["mean"] / 1000:.1f}')
EOF
}

echo "| 4k randread, cold | vestad IOPS / lat (us) | nbdkit | qemu-nbd | raw file io_uring | **vestad / nbdkit IOPS** |"
echo "|---|---:|---:|---:|---:|---:|"
for qd in 1 32; do
    read -r vi vl < <(run vestad "$VURI" "$VFILES" "$qd")
    read -r ki kl < <(run nbdkit "$KURI" "$OUT/nbdkit.img" "$qd")
    read -r qi ql < <(run qemu-nbd "$QURI" "$OUT/qemu-nbd.img" "$qd")
    read -r ri rl < <(run raw "$OUT/raw.img" "$OUT/raw.img" "$qd")
    python3 -c "print(f'| QD$qd | $vi / $vl | $ki / $kl | $qi / $ql | $ri / $rl | **{$vi/$ki:.2f}** |')"
done
if [ -n "${POLICY:-}" ]; then
    # Hits are what this mode measures: say how many there were.
    "$BIN/vesta" --api "$API" volume show bench --json >"$OUT/volume.json"
    python3 - "$OUT/volume.json" <<'EOF'
import json, sys
v = json.load(open(sys.argv[1]))
print("vestad volume: policy", v.get("policy"), "read hit ratio", (v.get("cache") or {}).get("read_hit_ratio"))
EOF
fi
