#!/usr/bin/env bash
# What a write costs vestad: CPU time (user and system) and context switches per IO over one
# fio run on a `wb` volume (cache file and `dir` datastore on the local disk). Steadier than
# IOPS on a small VM for A/B runs of the write path: a change that adds a wake-up or a system
# call per write shows here even when the spread hides it in bench/policies.sh.
#
#   bench/cost.sh                         # 4 KiB random writes at QD32, 10 s
#   QD=1 RUNTIME=20 bench/cost.sh
#   POLICY=uncached bench/cost.sh         # any `vesta volume create` policy arguments
#   VESTA_BIN_DIR=/path/to/build bench/cost.sh   # another build, for an A/B
#   PERF=1 bench/cost.sh                  # also `perf record -g` of vestad: OUT/perf.data
#
# Needs perf (linux-perf) for the context switches.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
BIN=${VESTA_BIN_DIR:-target/release}
RUNTIME=${RUNTIME:-10}
QD=${QD:-32}
OUT=${OUT:-bench/out/cost}
OUT=$(bench_out "$OUT")

# A cache file whose blocks were all written before, as after the log has wrapped.
mkdir -p "$OUT/vesta"
printf '[cache]\nsize = "%s"\n' "${CACHE:-4G}" >"$OUT/vestad.toml"
dd if=/dev/zero of="$OUT/vesta/cache.img" bs=4M oflag=direct status=none \
    count=$(($(numfmt --from=iec "${CACHE:-4G}") / (4 << 20)))
"$BIN/vestad" -c "$OUT/vestad.toml" --data-dir "$OUT/vesta" --api 127.0.0.1:0 --nbd-tcp "" \
    >"$OUT/vestad.log" 2>&1 & started
P=$!
API=$(vestad_api "$OUT/vesta")
# shellcheck disable=SC2086 # POLICY is a list of arguments
"$BIN/vesta" --api "$API" volume create v --size 1G --datastore default ${POLICY:---policy wb} >/dev/null
sync

# utime and stime of the whole process (dead threads included), in clock ticks.
ticks() { cut -d' ' -f14,15 "/proc/$P/stat"; }
read -r u0 s0 < <(ticks)
perf stat -e context-switches,cpu-migrations -p "$P" -o "$OUT/perf-stat.txt" & ps=$!
if [ -n "${PERF:-}" ]; then
    perf record -F 2000 -g -p "$P" -o "$OUT/perf.data" -- sleep "$RUNTIME" 2>/dev/null & started
fi
fio --name=cost --ioengine=nbd --uri="nbd+unix:///v?socket=$OUT/vesta/nbd.sock" --rw=randwrite \
    --bs=4k --iodepth="$QD" --size=1G --runtime="$RUNTIME" --time_based --randrepeat=0 \
    --output-format=json --output="$OUT/fio.json" >/dev/null
read -r u1 s1 < <(ticks)
kill -INT "$ps"
wait "$ps" || true
python3 - "$OUT/fio.json" "$OUT/perf-stat.txt" $((u1 - u0)) $((s1 - s0)) "$(getconf CLK_TCK)" "$QD" <<'PY'
import json, sys
w = json.load(open(sys.argv[1]))["jobs"][0]["write"]
ev = {}
for line in open(sys.argv[2]):
    f = line.split()
    if len(f) >= 2 and f[1] in ("context-switches", "cpu-migrations"):
        ev[f[1]] = int(f[0].replace(",", ""))
n = w["total_ios"]
ut, st, hz, qd = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
us = lambda t: t / hz * 1e6 / n
print(f"4k randwrite QD{qd}: {w['iops']:.0f} IOPS; vestad per IO: user {us(ut):.1f} us, "
      f"system {us(st):.1f} us, {ev.get('context-switches', 0) / n:.2f} context switches, "
      f"{ev.get('cpu-migrations', 0) / n:.3f} migrations")
PY
