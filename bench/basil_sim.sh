#!/usr/bin/env bash
# BASIL's evaluation on simulated spindles (issue 5): load balancing from 500 random
# configurations (BASIL §6.4, Figure 10), new device provisioning (§6.3) and initial placement
# against random placement and an oracle (§6.5, Figure 11). Pure simulation: no daemon, no
# devices; a few seconds on two cores (about 40 s with saturating spindles).
#
# Writes the CSV files of `basil-sim` (see crates/balance/src/bin/basil-sim.rs) and
# $OUT/balance_cdf.png, $OUT/placement_cdf.png to $OUT, and prints a Markdown summary.
#
#   bench/basil_sim.sh                    # seed 2010
#   SEED=7 bench/basil_sim.sh             # another seed; the same seed gives the same numbers
#   QUEUEING=saturating bench/basil_sim.sh  # pooled spindles, as the nbdkit rig behaves
#
# The default physics is the one issue 5 specifies: latency linear in outstanding IOs over k.
#
# The summary opens with BASIL Table 2's start simulated under both physics, against the
# real-IO bench (bench/basil_real.sh).
#
# Targets (issue 5): >= 25 % throughput gain in >= 90 % of configurations; the best datastore
# chosen for a new disk >= 80 % of the time.
set -euo pipefail
cd "$(dirname "$0")/.."
SEED=${SEED:-2010}
QUEUEING=${QUEUEING:-linear}
OUT=${OUT:-bench/out/basil_sim}
rm -rf "$OUT" && mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
command -v gnuplot >/dev/null || scripts/apt.sh gnuplot-nox

cargo run --quiet --release -p balance --bin basil-sim -- "$OUT" --seed "$SEED" --queueing "$QUEUEING"

gnuplot <<GP
set terminal pngcairo size 1000,650 noenhanced
set datafile separator ","
set key bottom right
set grid
set ylabel "fraction of configurations"
set yrange [0:1]
set output "$OUT/balance_cdf.png"
set title "BASIL load balancing from random configurations (simulated, like Fig. 10; bench/basil_sim.sh)"
set xlabel "improvement over the initial placement (%)"
plot "$OUT/balance_cdf.csv" skip 1 using 2:1 with steps lw 2 title "throughput gain", \
     "$OUT/balance_cdf.csv" skip 1 using 3:1 with steps lw 2 title "latency reduction", \
     "$OUT/balance_cdf.csv" skip 1 using 4:1 with steps dt 2 title "throughput gain of the best placement (oracle)"
set output "$OUT/placement_cdf.png"
set title "BASIL initial placement against random placement (simulated, like Fig. 11; bench/basil_sim.sh)"
set xlabel "improvement over random placement (%)"
plot "$OUT/placement_random_cdf.csv" skip 1 using 2:1 with steps lw 2 title "throughput gain", \
     "$OUT/placement_random_cdf.csv" skip 1 using 3:1 with steps lw 2 title "latency reduction"
GP
echo "wrote $OUT/*.csv, $OUT/balance_cdf.png and $OUT/placement_cdf.png"
