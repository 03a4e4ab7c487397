#!/usr/bin/env bash
# Write-back overhead and the policy throughput table (issue 3).
#
# 1. Overhead: a `wb` volume (cache file and `dir` datastore on the local disk) against
#    `nbdkit file` on the same disk: fio 4 KiB random writes, mean latency at QD1 and IOPS at
#    QD32. Targets: at most 1.2x nbdkit's latency, at least 0.8x its IOPS.
#    nbdkit overwrites one 1 GiB file in place, and after the first seconds every write lands
#    in a page the page cache holds already; the cache log appends, so each of its writes
#    lands in a page the kernel must allocate (and later write back). The rows marked "cold"
#    give the same fio job to nbdkit spread over 16 GiB of a file it never wrote, so its
#    writes too land in new pages: the cost of the log's layout on this machine, apart from
#    the rest of vestad's write path.
# 2. Throughput of `uncached`, `wt` and `wb` (FVP Table 2, the rows without peers) on a LUN
#    served by nbdkit with a 1 ms write delay: fio 64 KiB sequential writes at QD8 and 4 KiB
#    random writes at QD16.
#
#   bench/policies.sh            # 10 s per run
#   RUNTIME=30 bench/policies.sh
#   ONLY=overhead bench/policies.sh   # part 1 only (for A/B runs of the write path)
#   ONLY=table bench/policies.sh      # part 2 only (for A/B runs of the datastore path)
#   CACHE=6G bench/policies.sh        # cache file size (default 12G)
#   CACHE_PREP=written bench/policies.sh  # a cache file whose blocks were all written before,
#                                         # as after the log has wrapped (default: sparse)
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
BIN=${VESTA_BIN_DIR:-target/release}
RUNTIME=${RUNTIME:-10}
OUT=${OUT:-bench/out/policies}
OUT=$(bench_out "$OUT")

truncate -s 8G "$OUT/nbdkit.img"
nbdkit -f --unix "$OUT/nbdkit.sock" file "$OUT/nbdkit.img" >"$OUT/nbdkit.log" 2>&1 & started
truncate -s 8G "$OUT/slow.img"
nbdkit -f --unix "$OUT/slow.sock" --filter=delay file "$OUT/slow.img" delay-write=1ms \
    >"$OUT/slow.log" 2>&1 & started
truncate -s 16G "$OUT/cold.img"
nbdkit -f --unix "$OUT/cold.sock" file "$OUT/cold.img" >"$OUT/cold.log" 2>&1 & started
wait_sock "$OUT/nbdkit.sock"
wait_sock "$OUT/cold.sock"
wait_sock "$OUT/slow.sock"

# The cache is sized to absorb a run's writes, as FVP's flash is (the embedded default, 1 GiB,
# takes about 2 s of 4 KiB writes at QD32 before flow control starts).
printf '[cache]\nsize = "%s"\n' "${CACHE:-12G}" >"$OUT/vestad.toml"
if [ "${CACHE_PREP:-sparse}" = written ]; then
    mkdir -p "$OUT/vesta"
    dd if=/dev/zero of="$OUT/vesta/cache.img" bs=4M oflag=direct status=none \
        count=$(($(numfmt --from=iec "${CACHE:-12G}") / (4 << 20)))
fi
"$BIN/vestad" -c "$OUT/vestad.toml" --data-dir "$OUT/vesta" --api 127.0.0.1:0 --nbd-tcp "" \
    >"$OUT/vestad.log" 2>&1 & started
API=$(vestad_api "$OUT/vesta")
vesta() { "$BIN/vesta" --api "$API" "$@"; }
vesta datastore add slow --lun "nbd+unix:///?socket=$OUT/slow.sock" --queue-depth 16 >/dev/null
V="nbd+unix:///%s?socket=$OUT/vesta/nbd.sock"

# fresh NAME QD POLICY-ARGS...: a new volume on the local disk for one 4k randwrite run,
# deleted after it (each run starts with an empty cache share and has the cache to itself).
# Named explicitly: initial placement would put it on `slow` while `default` still holds the
# volume before it. Call it as `out=$(fresh ...)`, not in `< <(...)`, whose subshell would
# still be deleting the volume while the next one is created.
fresh() {
    local name=$1 qd=$2
    shift 2
    vesta volume create "$name" --size 1G --datastore default "$@" >/dev/null
    fio_run "$name" "$(printf "$V" "$name")" randwrite 4k "$qd"
    vesta volume delete --force "$name" >/dev/null
}

if [ "${ONLY:-}" != table ]; then
echo "### Write-back overhead (local disk)"
echo
echo "| workload | vestad wb | nbdkit file | **ratio** |"
echo "|---|---:|---:|---:|"
read -r _ kl _ < <(fio_run nbdkit-qd1 "nbd+unix:///?socket=$OUT/nbdkit.sock" randwrite 4k 1)
read -r ki _ _ < <(fio_run nbdkit-qd32 "nbd+unix:///?socket=$OUT/nbdkit.sock" randwrite 4k 32)
# Each cold run gets its own 8 GiB half of the file, never written before.
read -r _ cl _ < <(FIO_SIZE=8G fio_run cold-qd1 "nbd+unix:///?socket=$OUT/cold.sock" randwrite 4k 1)
read -r ci _ _ < <(FIO_SIZE=8G FIO_EXTRA=--offset=8G \
    fio_run cold-qd32 "nbd+unix:///?socket=$OUT/cold.sock" randwrite 4k 32)
out=$(fresh wb-qd1 1 --policy wb) && read -r _ wl _ <<<"$out"
out=$(fresh wb-qd32 32 --policy wb) && read -r wi _ _ <<<"$out"
# Destaging deferred (held longer than the run): the write path alone.
out=$(fresh held-qd1 1 --policy wb --hold 600) && read -r _ hl _ <<<"$out"
out=$(fresh held-qd32 32 --policy wb --hold 600) && read -r hi _ _ <<<"$out"
python3 - <<EOF
rows = [("4k randwrite QD1, mean latency (us)", $wl, $kl),
        ("4k randwrite QD32, IOPS", $wi, $ki),
        ("4k randwrite QD1, mean latency (us), destaging deferred", $hl, $kl),
        ("4k randwrite QD32, IOPS, destaging deferred", $hi, $ki),
        ("4k randwrite QD1, mean latency (us), against nbdkit cold", $wl, $cl),
        ("4k randwrite QD32, IOPS, against nbdkit cold", $wi, $ci)]
for what, v, k in rows:
    print(f"| {what} | {v} | {k} | **{v / k:.2f}** |")
EOF
fi
[ "${ONLY:-}" = overhead ] && exit 0
echo
echo "### Policies on a 1 ms datastore"
echo
echo "| policy | 64 KiB seq write QD8 (MiB/s) | 4 KiB rand write QD16 (IOPS) | 4 KiB rand write QD16 mean latency (us) |"
echo "|---|---:|---:|---:|"
for p in uncached wt wb; do vesta volume create "slow-$p" --size 2G --datastore slow --policy "$p" >/dev/null; done
for p in uncached wt wb; do
    read -r _ _ mb < <(fio_run "$p-seq" "$(printf "$V" "slow-$p")" write 64k 8)
    read -r io lat _ < <(fio_run "$p-rand" "$(printf "$V" "slow-$p")" randwrite 4k 16)
    echo "| $p | $mb | $io | $lat |"
done
