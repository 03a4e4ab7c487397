#!/usr/bin/env bash
# Uncached data path against nbdkit, side by side (issue 2's benchmark).
#
# fio --ioengine=nbd, 4 KiB random writes and reads at QD1 and QD32, against
#   - vestad, policy uncached, on a `dir` datastore,
#   - nbdkit's file plugin, and qemu-nbd (raw, writeback cache), on images in the same
#     directory (same disk),
# all over a unix socket, all images preallocated with data first so reads hit real blocks;
# and the raw image file itself through fio's io_uring engine (no NBD at all).
# Prints a Markdown table with ratios (vestad / nbdkit) and writes raw fio JSON to $OUT.
#
#   bench/uncached.sh                 # 10 s per run
#   RUNTIME=30 bench/uncached.sh      # longer runs
#
# Targets (issue 2): vestad IOPS at QD32 >= 0.9x nbdkit; vestad mean latency at QD1 <= 1.1x.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
BIN=${VESTA_BIN_DIR:-target/release}
RUNTIME=${RUNTIME:-10}
SIZE=${SIZE:-1G}
OUT=${OUT:-bench/out/uncached}
OUT=$(bench_out "$OUT")

side_by_side "$SIZE"
fill_side_by_side "$SIZE"

# run NAME URI RW QD -> prints "iops lat_us"; a URI starting with / is a file for io_uring.
run() {
    local json="$OUT/$1-$3-qd$4.json" target
    case "$2" in
        /*) target=(--ioengine=io_uring --filename="$2") ;;
        *) target=(--ioengine=nbd --uri="$2") ;;
    esac
    fio --name="$1" "${target[@]}" --rw="$3" --bs=4k --iodepth="$4" \
        --size="$SIZE" --runtime="$RUNTIME" --time_based --ramp_time=2 --randrepeat=0 \
        --output-format=json --output="$json"
    python3 - "$json" "$3" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1]))["jobs"][0]
side = "write" if "write" in sys.argv[2] else "read"
print(f'{j[side]["iops"]:.0f} {j[side]["lat_ns"]["mean"] / 1000:.1f}')
EOF
}

echo "| workload | vestad IOPS | nbdkit IOPS | **IOPS ratio** | vestad lat (us) | nbdkit lat (us) | **lat ratio** | qemu-nbd IOPS / lat (us) | raw file io_uring IOPS / lat (us) |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
for rw in randwrite randread; do
    for qd in 1 32; do
        read -r vi vl < <(run vestad "$VURI" "$rw" "$qd")
        read -r ki kl < <(run nbdkit "$KURI" "$rw" "$qd")
        read -r qi ql < <(run qemu-nbd "$QURI" "$rw" "$qd")
        read -r ri rl < <(run raw "$OUT/raw.img" "$rw" "$qd")
        python3 -c "print(f'| 4k $rw QD$qd | $vi | $ki | **{$vi/$ki:.2f}** | $vl | $kl | **{$vl/$kl:.2f}** | $qi / $ql | $ri / $rl |')"
    done
done
