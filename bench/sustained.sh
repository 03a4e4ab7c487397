#!/usr/bin/env bash
# Sustained write bursts under flow control, like FVP Fig. 6 (issue 3).
#
# The datastore is the small SAN LUN of bench/burst.sh: nbdkit with 4 threads and a 2 ms write
# delay (about 2,000 writes/s), queue depth 4. A `wb` volume with an RPO of RPO_S seconds
# takes a sustained burst of 8 KiB random writes at QD16 and BURST_IOPS writes/s — well above
# what the destager can send — for SUSTAIN_S seconds (FVP: 160): the cache absorbs it until the
# dirty data would take longer than the RPO to destage, then flow control slows the client to
# the destage rate. Then a quiet gap (GAP_S) in which the destager catches up, and a second,
# short burst (BURST2_S) that runs at cache speed again: flow control released the volume.
#
# Every second a sampler reads the volume's counters from the admin API: writes acknowledged
# to the client, writes the destager completed on the datastore, the injected delay, the
# pressure and dirty data. fio logs the client's latency.
#
# Writes $OUT/sustained.csv and $OUT/sustained.png (writes/s and latency over time) and prints
# a Markdown summary.
#
#   bench/sustained.sh                              # 160 s burst, 90 s gap, 30 s second burst
#   SUSTAIN_S=60 GAP_S=30 BURST2_S=15 bench/sustained.sh
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
BIN=${VESTA_BIN_DIR:-target/release}
SUSTAIN_S=${SUSTAIN_S:-160}
GAP_S=${GAP_S:-90}
BURST2_S=${BURST2_S:-30}
BURST_IOPS=${BURST_IOPS:-5000}
RPO_S=${RPO_S:-60}
OUT=${OUT:-bench/out/sustained}
OUT=$(bench_out "$OUT")
command -v gnuplot >/dev/null || scripts/apt.sh gnuplot-nox

truncate -s 16G "$OUT/lun.img"
nbdkit -f --unix "$OUT/lun.sock" --threads=4 --filter=delay file "$OUT/lun.img" delay-write=2ms \
    >"$OUT/nbdkit.log" 2>&1 & started
wait_sock "$OUT/lun.sock"

cat >"$OUT/vestad.toml" <<EOF
data_dir = "$OUT/vesta"
[nbd]
tcp = ""
[api]
listen = "127.0.0.1:0"
[cache]
size = "8G"
[[datastore]]
name = "san"
kind = "lun"
target = "nbd+unix:///?socket=$OUT/lun.sock"
queue_depth = 4
EOF
"$BIN/vestad" --config "$OUT/vestad.toml" >"$OUT/vestad.log" 2>&1 & started
API=$(vestad_api "$OUT/vesta")
"$BIN/vesta" --api "$API" volume create wb --size 4G --policy wb --rpo "$RPO_S" >/dev/null

# The sampler: one line a second until killed.
python3 - "$API" >"$OUT/samples.csv" <<'EOF' &
import json, sys, time, urllib.request
api = sys.argv[1]
print("t,acked,destaged,throttled,delay_us_total,pressure,dirty_bytes,flow", flush=True)
t0 = time.monotonic()
while True:
    c = json.load(urllib.request.urlopen(f"{api}/v1/volumes/wb"))["cache"]
    print(f'{time.monotonic() - t0:.2f},{c["last_ser"]},{c["destaged_writes"]},'
          f'{c["throttled_writes"]},{c["throttle_delay_us_total"]},{c["flow_pressure"]:.3f},'
          f'{c["dirty_bytes"]},{c["flow_control"]}', flush=True)
    time.sleep(1.0 - (time.monotonic() - t0) % 1.0)
EOF
started
SPID=$!

burst() { # NAME SECONDS
    fio --name="$1" --ioengine=nbd --uri="nbd+unix:///wb?socket=$OUT/vesta/nbd.sock" \
        --rw=randwrite --bs=8k --iodepth=16 --rate_iops="$BURST_IOPS" --size=4G \
        --time_based --runtime="$2" \
        --randrepeat=0 --write_lat_log="$OUT/$1" --log_avg_msec=1000 --output=/dev/null
}
T0=$(date +%s.%N)
burst burst1 "$SUSTAIN_S"
T1=$(date +%s.%N)
sleep "$GAP_S"
T2=$(date +%s.%N)
burst burst2 "$BURST2_S"
sleep 2
kill "$SPID" && wait "$SPID" 2>/dev/null || true

python3 - "$OUT" "$T0" "$T1" "$T2" "$BURST2_S" <<'EOF'
import csv, glob, sys
out, t0, t1, t2, b2 = sys.argv[1], *map(float, sys.argv[2:6])
s = list(csv.DictReader(open(f"{out}/samples.csv")))
# The sampler started a moment before the first burst; align both on the burst's start.
lat = {}
for name, start in (("burst1", t0), ("burst2", t2)):
    for line in open(glob.glob(f"{out}/{name}_lat.*.log")[0]):
        ms, ns = line.split(",")[:2]
        lat[round(start - t0 + int(ms) / 1000)] = int(ns) / 1000
rows = []
for a, b in zip(s, s[1:]):
    dt = float(b["t"]) - float(a["t"])
    acked = (int(b["acked"]) - int(a["acked"])) / dt
    destaged = (int(b["destaged"]) - int(a["destaged"])) / dt
    thr = int(b["throttled"]) - int(a["throttled"])
    delay = (int(b["delay_us_total"]) - int(a["delay_us_total"])) / thr if thr else 0
    t = round(float(b["t"]))
    rows.append((t, round(acked), round(destaged), lat.get(t, ""), round(delay),
                 b["pressure"], int(b["dirty_bytes"]) >> 20, b["flow"]))
with open(f"{out}/sustained.csv", "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["second", "acked_writes_per_s", "destaged_writes_per_s", "client_latency_us",
                "injected_delay_us", "pressure", "dirty_mib", "flow_control"])
    w.writerows(rows)
with open(f"{out}/sustained.dat", "w") as f:
    for r in rows:
        f.write(" ".join(str(x if x != "" else "NaN") for x in r[:5]) + "\n")

def phase(lo, hi):
    sel = [r for r in rows if lo <= r[0] < hi]
    return sel
first = [r for r in rows if r[0] < t1 - t0]
onset = next((r[0] for r in first if r[7] != "off"), None)
flow = [r for r in first if r[7] != "off"]
before = [r for r in first if onset is None or r[0] < onset]
second = phase(t2 - t0 + 1, t2 - t0 + b2)
mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")
print("| phase | seconds | client writes/s | destaged writes/s | client latency (us) | injected delay (us) |")
print("|---|---:|---:|---:|---:|---:|")
for name, sel in (("burst, before flow control", before), ("burst, under flow control", flow),
                  ("second burst (after the gap)", second)):
    lats = [r[3] for r in sel if r[3] != ""]
    print(f"| {name} | {len(sel)} | {mean([r[1] for r in sel]):.0f} | "
          f"{mean([r[2] for r in sel]):.0f} | {mean(lats):.0f} | {mean([r[4] for r in sel if r[4]]):.0f} |")
print()
print(f"flow control engaged at {onset} s" if onset is not None else "flow control never engaged")
print(f"seconds of the second burst under flow control: {sum(r[7] != 'off' for r in second)} of {len(second)}")
EOF

gnuplot <<EOF
set terminal pngcairo size 1200,800 noenhanced
set output "$OUT/sustained.png"
set multiplot layout 2,1 title "Sustained burst under flow control: 8 KiB writes, RPO ${RPO_S} s, 2,000 writes/s LUN (bench/sustained.sh)"
set ylabel "writes/s"
set logscale y
set key top right
plot "$OUT/sustained.dat" using 1:2 with lines title "acknowledged to the client", \
     "$OUT/sustained.dat" using 1:3 with lines title "destaged to the datastore"
set ylabel "microseconds"
set xlabel "seconds"
plot "$OUT/sustained.dat" using 1:4 with lines title "client write latency (mean)", \
     "$OUT/sustained.dat" using 1:5 with lines title "injected delay per throttled write"
unset multiplot
EOF
echo "wrote $OUT/sustained.csv and $OUT/sustained.png"
