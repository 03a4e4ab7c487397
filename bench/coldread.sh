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
#   bench/coldread.sh                 # 5 s per run
#   RUNTIME=10 SIZE=8G bench/coldread.sh
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
BIN=${VESTA_BIN_DIR:-target/release}
RUNTIME=${RUNTIME:-5}
SIZE=${SIZE:-4G}
OUT=${OUT:-bench/out/coldread}
OUT=$(bench_out "$OUT")

side_by_side "$SIZE"
fill_side_by_side "$SIZE"
# The fills' writeback (16 GiB) done and settled before any run: it slows the disk's reads
# for a while after, and would fall on the first target.
sync
sleep "${SETTLE:-20}"

# evict FILE: written back, then dropped from the page cache (no root needed).
evict() {
    sync
    python3 -c 'import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)' "$1"
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
    read -r vi vl < <(run vestad "$VURI" "$VIMG" "$qd")
    read -r ki kl < <(run nbdkit "$KURI" "$OUT/nbdkit.img" "$qd")
    read -r qi ql < <(run qemu-nbd "$QURI" "$OUT/qemu-nbd.img" "$qd")
    read -r ri rl < <(run raw "$OUT/raw.img" "$OUT/raw.img" "$qd")
    python3 -c "print(f'| QD$qd | $vi / $vl | $ki / $kl | $qi / $ql | $ri / $rl | **{$vi/$ki:.2f}** |')"
done
