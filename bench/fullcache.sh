#!/usr/bin/env bash
# Write-back on a full cache (issue 3): the steady state of a host that has run a while.
#
# A `wb` volume of 2 GiB on the local disk and the embedded default cache of 1 GiB, against
# `nbdkit file` on the same disk: fio 4 KiB random writes at QD32 for RUNTIME seconds after
# WARMUP seconds of the same writes, which fill the cache, so that every segment the log
# takes during the measured run is one it evicts (clean data) or reuses. Reports IOPS and mean
# latency, with the segments evicted during the run.
#
#   bench/fullcache.sh              # WARMUP=20 RUNTIME=20
#   RUNTIME=60 bench/fullcache.sh
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
BIN=${VESTA_BIN_DIR:-target/release}
WARMUP=${WARMUP:-20}
RUNTIME=${RUNTIME:-20}
OUT=${OUT:-bench/out/fullcache}
OUT=$(bench_out "$OUT")

truncate -s 2G "$OUT/nbdkit.img"
nbdkit -f --unix "$OUT/nbdkit.sock" file "$OUT/nbdkit.img" >"$OUT/nbdkit.log" 2>&1 & started
wait_sock "$OUT/nbdkit.sock"
"$BIN/vestad" --data-dir "$OUT/vesta" --api 127.0.0.1:0 --nbd-tcp "" >"$OUT/vestad.log" 2>&1 & started
API=$(vestad_api "$OUT/vesta")
vesta() { "$BIN/vesta" --api "$API" "$@"; }
vesta volume create full --size 2G --policy wb >/dev/null
V="nbd+unix:///full?socket=$OUT/vesta/nbd.sock"
# Segments evicted so far ("-" from a vestad that does not report them).
evicted() { vesta volume show full --json | python3 -c 'import json,sys;print(json.load(sys.stdin)["cache"].get("evicted_segments", "-"))'; }

FIO_SIZE=2G RUNTIME=$WARMUP fio_run warmup "$V" randwrite 4k 32 >/dev/null
before=$(evicted)
read -r wi wl _ < <(FIO_SIZE=2G fio_run wb "$V" randwrite 4k 32)
after=$(evicted)
FIO_SIZE=2G RUNTIME=$WARMUP fio_run nbdkit-warmup "nbd+unix:///?socket=$OUT/nbdkit.sock" randwrite 4k 32 >/dev/null
read -r ki kl _ < <(FIO_SIZE=2G fio_run nbdkit "nbd+unix:///?socket=$OUT/nbdkit.sock" randwrite 4k 32)
echo "| target | 4k randwrite QD32 IOPS | mean latency (us) | segments evicted in the run |"
echo "|---|---:|---:|---:|"
n=-
[ "$before" != - ] && n=$((after - before))
echo "| vestad wb, 1 GiB cache full | $wi | $wl | $n |"
echo "| nbdkit file | $ki | $kl | |"
