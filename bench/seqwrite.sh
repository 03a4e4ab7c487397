#!/usr/bin/env bash
# Large sequential writes through a cache the size of the embedded default (1 GiB), as a VM
# copying a big file writes them: fio 1 MiB sequential writes at QD8 over 4 GiB, on a `wb`
# and an `uncached` volume (cache file and `dir` datastore on the local disk), against
# `nbdkit file` on the same disk. Each run writes its 4 GiB once (or stops after RUNTIME
# seconds), so every target writes pages new to the page cache: a time-based run would let
# the fastest wrap around and overwrite pages it holds already, which is cheaper here. After the first seconds the log is full and every write
# needs segments that eviction or the destager frees; the `space waits` column counts the
# writes that had to wait for them (`vesta volume show`). Every run starts after a `sync`,
# so none inherits the dirty pages (and the kernel's write throttling) of the one before.
#
#   bench/seqwrite.sh                  # 10 s per run
#   CACHE=8G RUNTIME=20 bench/seqwrite.sh
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
BIN=${VESTA_BIN_DIR:-target/release}
RUNTIME=${RUNTIME:-10}
OUT=${OUT:-bench/out/seqwrite}
OUT=$(bench_out "$OUT")
export FIO_SIZE=4G FIO_EXTRA="--time_based=0 --ramp_time=0"

truncate -s 4G "$OUT/nbdkit.img"
nbdkit -f --unix "$OUT/nbdkit.sock" file "$OUT/nbdkit.img" >"$OUT/nbdkit.log" 2>&1 & started
wait_sock "$OUT/nbdkit.sock"
printf '[cache]\nsize = "%s"\n' "${CACHE:-1G}" >"$OUT/vestad.toml"
"$BIN/vestad" -c "$OUT/vestad.toml" --data-dir "$OUT/vesta" --api 127.0.0.1:0 --nbd-tcp "" \
    >"$OUT/vestad.log" 2>&1 & started
API=$(vestad_api "$OUT/vesta")
vesta() { "$BIN/vesta" --api "$API" "$@"; }
V="nbd+unix:///%s?socket=$OUT/vesta/nbd.sock"

echo "| target | 1 MiB seq write QD8 (MiB/s) | mean latency (ms) | space waits | flow control at the end |"
echo "|---|---:|---:|---:|---|"
sync
read -r _ lat mb < <(fio_run nbdkit "nbd+unix:///?socket=$OUT/nbdkit.sock" write 1M 8)
echo "| nbdkit file | $mb | $(python3 -c "print(f'{$lat / 1000:.1f}')") | | |"
for p in uncached wb; do
    vesta volume create "$p" --size 4G --policy "$p" >/dev/null
    sync
    read -r _ lat mb < <(fio_run "$p" "$(printf "$V" "$p")" write 1M 8)
    waits=- flow=-
    if [ "$p" = wb ]; then
        vesta volume show "$p" --json >"$OUT/$p-show.json"
        read -r waits flow < <(python3 - "$OUT/$p-show.json" <<'EOF'
import json, sys
c = json.load(open(sys.argv[1]))["cache"]
print(c.get("space_waits", "n/a"), f'{c["flow_control"]} (pressure {c["flow_pressure"]:.2f})')
EOF
)
    fi
    echo "| vestad $p | $mb | $(python3 -c "print(f'{$lat / 1000:.1f}')") | $waits | $flow |"
    vesta volume delete --force "$p" >/dev/null
done
