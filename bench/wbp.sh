#!/usr/bin/env bash
# Write-back with peers (issue 4): FVP Table 2's rows wt, wb, wbp:1 and wbp:2, and online
# replay after the owner's death.
#
# Three vestad hosts on loopback (a on 127.0.0.2, b and c on .3 and .4), one etcd, and a LUN
# served by nbdkit with a 1 ms write delay (the shared datastore). Volumes are served by a;
# wbp volumes replicate to b (and c).
#
# 1. fio on each policy: 64 KiB sequential writes at QD8 (MiB/s), 4 KiB random writes at QD16
#    (IOPS) and at QD1 (mean latency). Targets: wbp:1 >= 85 % of wb's sequential throughput,
#    wbp:2 >= 75 %; wbp:1's QD1 latency <= wb's + 50 us.
# 2. Replay: a wbp:1 volume with DIRTY MiB of dirty data (destaging held), a killed with
#    SIGKILL; the time until b has replayed it onto the datastore, and the replay's
#    throughput against the datastore's own write bandwidth (fio 1 MiB writes QD8 straight
#    to the LUN). Target: >= 80 %. A replay leaves the datastore
#    durable (a FLUSH after each window), so the baseline flushes every 64 MiB too; the
#    one without flushes is printed alongside.
#
#   bench/wbp.sh                       # 10 s per fio run; replays of 64, 256 and 1024 MiB
#   RUNTIME=30 DIRTY="128 512" bench/wbp.sh
#   ONLY=replay bench/wbp.sh           # part 2 only
#   ONLY=table bench/wbp.sh            # part 1 only
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
BIN=${VESTA_BIN_DIR:-target/release}
RUNTIME=${RUNTIME:-10}
DIRTY=${DIRTY:-64 256 1024}
TTL=${TTL:-3}
OUT=${OUT:-bench/out/wbp}
OUT=$(bench_out "$OUT")

port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }
CP=$(port)
PP=$(port)
EP="http://127.0.0.1:$CP"
etcd --data-dir "$OUT/etcd" --listen-client-urls "$EP" --advertise-client-urls "$EP" \
    --listen-peer-urls "http://127.0.0.1:$PP" --initial-advertise-peer-urls "http://127.0.0.1:$PP" \
    --initial-cluster "default=http://127.0.0.1:$PP" >"$OUT/etcd.log" 2>&1 & started
for _ in $(seq 100); do ETCDCTL_API=3 etcdctl --endpoints "$EP" endpoint health >/dev/null 2>&1 && break; sleep 0.1; done

truncate -s 16G "$OUT/lun.img"
nbdkit -f --unix "$OUT/lun.sock" --threads=16 --filter=delay file "$OUT/lun.img" delay-write=1ms \
    >"$OUT/nbdkit.log" 2>&1 & started
wait_sock "$OUT/lun.sock"

# host NAME IP FAULT_DOMAIN: starts a vestad; sets API_<NAME>.
declare -A API PID
host() {
    local name=$1 ip=$2 fd=$3
    mkdir -p "$OUT/$name"
    cat >"$OUT/$name/vestad.toml" <<EOF
[cache]
size = "${CACHE:-4G}"

[cluster]
etcd = ["$EP"]
host = "$name"
fault_domain = "$fd"
lease_ttl_s = $TTL

[[datastore]]
name = "san"
kind = "lun"
target = "nbd+unix:///?socket=$OUT/lun.sock"
queue_depth = 16
EOF
    rm -f "$OUT/$name/data/vestad.json"
    "$BIN/vestad" -c "$OUT/$name/vestad.toml" --data-dir "$OUT/$name/data" --api "$ip:0" \
        --nbd-tcp "" >>"$OUT/$name/vestad.log" 2>&1 & started
    PID[$name]=$!
    API[$name]=$(vestad_api "$OUT/$name/data")
}
vesta() { local h=$1; shift; "$BIN/vesta" --api "${API[$h]}" "$@"; }

host a 127.0.0.2 rack1
host b 127.0.0.3 rack2
host c 127.0.0.4 rack2
V="nbd+unix:///%s?socket=$OUT/a/data/nbd.sock"

# wait_mode VOLUME MODE: until a's volume runs in MODE (peers in place).
wait_mode() {
    for _ in $(seq 300); do
        [ "$(vesta a --json volume show "$1" | python3 -c 'import json,sys;print((json.load(sys.stdin).get("cache") or {}).get("mode"))')" = "$2" ] && return
        sleep 0.1
    done
    echo "volume $1 never reached $2" >&2
    exit 1
}

if [ "${ONLY:-}" != replay ]; then
echo "### FVP Table 2 on loopback: a 1 ms datastore, peers on the same machine"
echo
echo "| policy | 64 KiB seq write QD8 (MiB/s) | 4 KiB rand write QD16 (IOPS) | 4 KiB rand write QD1 mean latency (us) |"
echo "|---|---:|---:|---:|"
declare -A SEQ QD1
for p in wt wb wbp:1 wbp:2; do
    n="v-${p/:/}"
    vesta a volume create "$n" --size 2G --policy "$p" >/dev/null
    [[ $p == wbp* ]] && wait_mode "$n" "$p"
    read -r _ _ mb < <(fio_run "$n-seq" "$(printf "$V" "$n")" write 64k 8)
    read -r io _ _ < <(fio_run "$n-rand" "$(printf "$V" "$n")" randwrite 4k 16)
    read -r _ lat _ < <(fio_run "$n-qd1" "$(printf "$V" "$n")" randwrite 4k 1)
    SEQ[$p]=$mb
    QD1[$p]=$lat
    echo "| $p | $mb | $io | $lat |"
    vesta a volume delete --force "$n" >/dev/null
done
python3 - <<EOF
wb, w1, w2 = ${SEQ[wb]}, ${SEQ[wbp:1]}, ${SEQ[wbp:2]}
print()
print(f"wbp:1 sequential throughput {w1 / wb * 100:.0f} % of wb (target >= 85 %), "
      f"wbp:2 {w2 / wb * 100:.0f} % (target >= 75 %); "
      f"wbp:1 QD1 latency wb + {${QD1[wbp:1]} - ${QD1[wb]}:.0f} us (target <= 50 us)")
EOF
fi

[ "${ONLY:-}" = table ] && exit 0
echo
echo "### Online replay after the owner's death"
echo
# The baseline on a second LUN served the same way (fio on the first would overwrite its label).
truncate -s 4G "$OUT/raw.img"
nbdkit -f --unix "$OUT/raw.sock" --threads=16 --filter=delay file "$OUT/raw.img" delay-write=1ms \
    >"$OUT/nbdkit-raw.log" 2>&1 & started
wait_sock "$OUT/raw.sock"
read -r _ _ raw < <(fio_run lun-raw "nbd+unix:///?socket=$OUT/raw.sock" write 1M 8)
# A replay must leave the datastore durable: it flushes after every window (up to 64 MiB).
# The same with a FLUSH every 64 writes is the bandwidth a replay can have.
read -r _ _ durable < <(FIO_EXTRA=--fsync=64 fio_run lun-durable "nbd+unix:///?socket=$OUT/raw.sock" write 1M 8)
echo "The same LUN's own write bandwidth, fio 1 MiB sequential writes QD8: $raw MiB/s;"
echo "with a FLUSH every 64 MiB, as a replay's windows do: $durable MiB/s."
echo
echo "| dirty data (MiB) | death to datastore current (s) | of which replay (s) | replay throughput (MiB/s) | of the LUN's durable bandwidth |"
echo "|---:|---:|---:|---:|---:|"
# replays: how many online replays b and c have finished.
replays() { cat "$OUT/b/vestad.log" "$OUT/c/vestad.log" | { grep -c "online replay done" || true; }; }
for mib in $DIRTY; do
    vesta a volume create r --size 2G --policy wbp:1 --hold 3600 --max-dirty-age 3600 >/dev/null
    wait_mode r wbp:1
    fio --name=fill --ioengine=nbd --uri="$(printf "$V" r)" --rw=write --bs=1M --iodepth=8 \
        --size="${mib}M" --output=/dev/null
    done_before=$(replays)
    kill -9 "${PID[a]}"
    t0=$(date +%s.%N)
    for _ in $(seq 6000); do
        now=$(replays)
        [ "$now" -gt "$done_before" ] && break
        sleep 0.05
    done
    t1=$(date +%s.%N)
    took=$(grep -h "online replay done in" "$OUT/b/vestad.log" "$OUT/c/vestad.log" | tail -1 | sed 's/.*done in \([0-9.]*\) s.*/\1/')
    python3 - <<EOF
mib, total, replay, raw = $mib, $t1 - $t0, $took, $durable
print(f"| {mib} | {total:.1f} | {replay:.1f} | {mib / replay:.0f} | {mib / replay / raw * 100:.0f} % |")
EOF
    host a 127.0.0.2 rack1
    vesta a volume delete --force r >/dev/null
done
