#!/usr/bin/env bash
# Burst absorption, like FVP Fig. 5 (issue 3).
#
# The datastore is a small SAN LUN: nbdkit with 4 threads and a 2 ms write delay (about 2,000
# writes/s). The workload, run once on a `wb` volume and once on an `uncached` one: a burst of
# 8 KiB sequential writes at QD16 for BURST_S seconds, then a slow steady stream of 8 KiB
# random writes (STEADY_IOPS) for STEADY_S seconds, twice.
#
# Writes: $OUT/burst.csv (second, policy, phase, writes/s, mean latency us) and
# $OUT/burst.png, and prints a Markdown table of the burst phases.
#
#   bench/burst.sh                                   # 40 s bursts, 60 s steady phases
#   BURST_S=20 STEADY_S=30 bench/burst.sh            # shorter
#
# Target (issue 3): wb burst writes/s at least 10x uncached (FVP: 4x).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
BIN=${VESTA_BIN_DIR:-target/release}
BURST_S=${BURST_S:-40}
STEADY_S=${STEADY_S:-60}
STEADY_IOPS=${STEADY_IOPS:-500}
OUT=${OUT:-bench/out/burst}
OUT=$(bench_out "$OUT")
command -v gnuplot >/dev/null || scripts/apt.sh gnuplot-nox

truncate -s 32G "$OUT/lun.img"
nbdkit -f --unix "$OUT/lun.sock" --threads=4 --filter=delay file "$OUT/lun.img" delay-write=2ms \
    >"$OUT/nbdkit.log" 2>&1 & started
wait_sock "$OUT/lun.sock"

# The cache must hold both bursts: FVP's hosts had 120 GB of flash.
cat >"$OUT/vestad.toml" <<EOF
data_dir = "$OUT/vesta"
[nbd]
tcp = ""
[api]
listen = "127.0.0.1:0"
[cache]
size = "24G"
[[datastore]]
name = "san"
kind = "lun"
target = "nbd+unix:///?socket=$OUT/lun.sock"
queue_depth = 4
EOF
"$BIN/vestad" --config "$OUT/vestad.toml" >"$OUT/vestad.log" 2>&1 & started
API=$(vestad_api "$OUT/vesta")
vesta() { "$BIN/vesta" --api "$API" "$@"; }
# An RPO long enough that flow control leaves the bursts alone: this is about absorption.
vesta volume create wb --size 8G --policy wb --rpo 900 >/dev/null
vesta volume create uncached --size 8G --policy uncached >/dev/null

run() { # POLICY
    local uri="nbd+unix:///$1?socket=$OUT/vesta/nbd.sock" phase
    for round in 1 2; do
        for phase in burst steady; do
            local args=(--name="$1-$phase-$round" --ioengine=nbd --uri="$uri" --bs=8k
                --size=8G --time_based --write_iops_log="$OUT/$1-$phase-$round"
                --write_lat_log="$OUT/$1-$phase-$round" --log_avg_msec=1000 --output=/dev/null)
            if [ $phase = burst ]; then
                args+=(--rw=write --iodepth=16 --runtime="$BURST_S"
                    --offset=$(( (round - 1) * 4 ))G)
            else
                args+=(--rw=randwrite --iodepth=1 --runtime="$STEADY_S" --rate_iops="$STEADY_IOPS")
            fi
            fio "${args[@]}"
        done
    done
}
run wb
run uncached

python3 - "$OUT" "$BURST_S" "$STEADY_S" <<'EOF'
import csv, glob, os, sys
out, burst, steady = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rows, summary = [], {}
for policy in ("wb", "uncached"):
    t0 = 0
    for rnd in (1, 2):
        for phase, dur in (("burst", burst), ("steady", steady)):
            base = f"{out}/{policy}-{phase}-{rnd}"
            iops = [l.split(",") for l in open(glob.glob(base + "_iops.*.log")[0])]
            lat = [l.split(",") for l in open(glob.glob(base + "_lat.*.log")[0])]
            for (t, v, *_), (_, l, *_) in zip(iops, lat):
                rows.append((t0 + int(t) / 1000, policy, phase, int(v), int(l) / 1000))
            if phase == "burst":
                vals = [int(v) for _, v, *_ in iops]
                lats = [int(l) / 1000 for _, l, *_ in lat]
                summary.setdefault(policy, []).append((sum(vals) / len(vals), sum(lats) / len(lats)))
            t0 += dur
with open(f"{out}/burst.csv", "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["second", "policy", "phase", "writes_per_s", "mean_latency_us"])
    w.writerows(rows)
for policy in ("wb", "uncached"):
    with open(f"{out}/{policy}.dat", "w") as f:
        for r in rows:
            if r[1] == policy:
                f.write(f"{r[0]} {r[3]} {r[4]}\n")
print("| burst | wb writes/s | uncached writes/s | **ratio** | wb mean latency (us) | uncached mean latency (us) |")
print("|---|---:|---:|---:|---:|---:|")
for i in range(2):
    (wi, wl), (ui, ul) = summary["wb"][i], summary["uncached"][i]
    print(f"| {i + 1} | {wi:.0f} | {ui:.0f} | **{wi / ui:.1f}** | {wl:.0f} | {ul:.0f} |")
EOF

gnuplot <<EOF
set terminal pngcairo size 1200,800 noenhanced
set output "$OUT/burst.png"
set multiplot layout 2,1 title "Burst absorption: 8 KiB writes to a 2,000 writes/s LUN (bench/burst.sh)"
set ylabel "writes/s"
set logscale y
set key top right
plot "$OUT/wb.dat" using 1:2 with lines title "wb", "$OUT/uncached.dat" using 1:2 with lines title "uncached"
set ylabel "mean write latency (us)"
set xlabel "seconds"
plot "$OUT/wb.dat" using 1:3 with lines title "wb", "$OUT/uncached.dat" using 1:3 with lines title "uncached"
unset multiplot
EOF
echo "wrote $OUT/burst.csv and $OUT/burst.png"
