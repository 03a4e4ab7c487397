#!/usr/bin/env bash
# FUA writes through an `uncached` volume to an NBD datastore, against the same client job on
# the datastore itself: what the NBD client's sync bookkeeping costs a guest that asks for
# FUA on every write (a VM with its disk cache off). Since 1997dae a FUA write's OK is held
# until the other syncs in flight on its connection when it was answered have answered (one
# of them may have taken a write-back error meant for it; docs/SAFETY.md), so at a queue depth
# of N the answers tend to come back in groups.
#
# The client is libnbd from Python (nbdsh): QD FUA writes of 4 KiB at random offsets kept in
# flight for RUNTIME seconds; it reports writes/s and the mean latency. nbdkit's `file`
# plugin syncs the image for each FUA write.
#
#   bench/fua.sh                  # QD="1 8 32", RUNTIME=8
#   VESTA_BIN_DIR=<build> QD="8 32" bench/fua.sh
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
BIN=${VESTA_BIN_DIR:-target/release}
RUNTIME=${RUNTIME:-8}
OUT=${OUT:-bench/out/fua}
OUT=$(bench_out "$OUT")

truncate -s 2G "$OUT/lun.img"
nbdkit -f --unix "$OUT/lun.sock" file "$OUT/lun.img" >"$OUT/nbdkit.log" 2>&1 & started
wait_sock "$OUT/lun.sock"
"$BIN/vestad" --data-dir "$OUT/vesta" --api 127.0.0.1:0 --nbd-tcp "" \
    >"$OUT/vestad.log" 2>&1 & started
API=$(vestad_api "$OUT/vesta")
vesta() { "$BIN/vesta" --api "$API" "$@"; }
vesta datastore add lun --lun "nbd+unix:///?socket=$OUT/lun.sock" --queue-depth 32 >/dev/null
vesta volume create f --size 1G --datastore lun --policy uncached >/dev/null

# fua_run URI QD -> "writes/s mean_us"
fua_run() {
    sync
    # nbdsh runs the system Python, which has libnbd's module (a Python earlier in PATH may not).
    PATH="/usr/bin:$PATH" nbdsh -u "$1" -c "
import random, time
qd, secs, n, lat = $2, $RUNTIME, 0, 0.0
buf = nbd.Buffer.from_bytearray(bytearray(b'\x5a' * 4096))
inflight = {}
def issue():
    off = random.randrange(0, (1 << 30) // 4096) * 4096
    c = h.aio_pwrite(buf, off, flags=nbd.CMD_FLAG_FUA)
    inflight[c] = time.perf_counter()
end = time.perf_counter() + secs
for _ in range(qd):
    issue()
while time.perf_counter() < end:
    h.poll(-1)
    for c in [c for c in inflight if h.aio_command_completed(c)]:
        lat += time.perf_counter() - inflight.pop(c)
        n += 1
        issue()
while inflight:
    h.poll(-1)
    for c in [c for c in inflight if h.aio_command_completed(c)]:
        inflight.pop(c)
print(f'{n / secs:.0f} {lat / max(n, 1) * 1e6:.0f}')
" 2>"$OUT/nbdsh.err" || { echo "failed on $1: $(tail -1 "$OUT/nbdsh.err")" >&2; echo "failed -"; }
}

echo "| QD | vesta uncached (writes/s) | mean (us) | nbdkit alone (writes/s) | mean (us) |"
echo "|---:|---:|---:|---:|---:|"
for qd in ${QD:-1 8 32}; do
    read -r vi vl < <(fua_run "nbd+unix:///f?socket=$OUT/vesta/nbd.sock" "$qd")
    read -r ki kl < <(fua_run "nbd+unix:///?socket=$OUT/lun.sock" "$qd")
    echo "| $qd | $vi | $vl | $ki | $kl |"
done
