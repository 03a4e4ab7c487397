#!/usr/bin/env bash
# Write-back with peers (issue 4): FVP Table 2's rows wt, wb, wbp:1 and wbp:2, and online
# replay after the owner's death.
#
# Three vestad hosts on loopback (a on 127.0.0.2, b and c on .3 and .4), one etcd, and a LUN
# served by nbdkit with a 1 ms write delay (the shared datastore). Volumes are served by a;
# wbp volumes replicate to b (and c).
#
# 1. fio on each policy: 64 KiB sequential writes at QD8 (MiB/s), 4 KiB random writes at QD16
#    (IOPS) and at QD1 (mean latency), each run on a volume whose dirty data the run before
#    left has been destaged first. Targets: wbp:1 >= 85 % of wb's sequential throughput,
#    wbp:2 >= 75 %; wbp:1's QD1 latency <= wb's + 50 us. Then the round trip of a bare
#    4 KiB message over loopback TCP: no peer can add less than that to a write.
# 2. Replay: a wbp:1 volume with DIRTY MiB of dirty data (destaging held), a killed with
#    SIGKILL; the time until b has replayed it onto the datastore, and the replay's
#    throughput against the datastore's own bandwidth for the same job, measured just before
#    on a second LUN served the same way: fio writes DIRTY MiB once, 1 MiB at a time at QD16
#    (the datastore's queue_depth), then flushes (a replay ends with the datastore durable).
#    Target: >= 80 %. Both write over blocks written before (a VM's disk is mostly written):
#    the first write to a block of nbdkit's sparse file is several times slower than later
#    ones, and varies a lot, because the file system allocates it then.
#
#   bench/wbp.sh                       # 10 s per fio run; replays of 64, 256 and 1024 MiB
#   RUNTIME=30 DIRTY="128 512" bench/wbp.sh
#   ONLY=replay bench/wbp.sh           # part 2 only
#   ONLY=table bench/wbp.sh            # part 1 only
#   ONLY=table POLICIES="wb wbp:1" bench/wbp.sh   # some rows of part 1
#   PEER_CACHE=/dev/shm/wbp ONLY=table bench/wbp.sh  # b's and c's cache files in DIR (here
#                                      # RAM): peers with devices of their own, not a's disk
#
# Every host's cache file and the LUN's image share the disk that holds OUT, so the table
# also reports that disk's write rate during each 64 KiB run: wb writes each byte twice (log,
# LUN), wbp:P 2 + P times.
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
$([ "$name" != a ] && [ -n "${PEER_CACHE:-}" ] && echo "path = \"$PEER_CACHE/$name.img\"")

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

if [ -n "${PEER_CACHE:-}" ]; then
    # New cache files each run (a cache log of an earlier cluster would be reopened).
    mkdir -p "$PEER_CACHE"
    for h in b c; do
        rm -f "$PEER_CACHE/$h.img"
        images_elsewhere+=("$PEER_CACHE/$h.img")
    done
fi
host a 127.0.0.2 rack1
host b 127.0.0.3 rack2
host c 127.0.0.4 rack2
V="nbd+unix:///%s?socket=$OUT/a/data/nbd.sock"

# wait_cache VOLUME FIELD VALUE WHAT: until a's volume reports FIELD of its cache (`vesta
# volume show --json`) as VALUE, 5 min at most.
wait_cache() {
    for _ in $(seq 3000); do
        [ "$(vesta a --json volume show "$1" | python3 -c 'import json,sys;print((json.load(sys.stdin).get("cache") or {}).get(sys.argv[1], 0))' "$2")" = "$3" ] && return
        sleep 0.1
    done
    echo "volume $1 $4 within 5 min" >&2
    exit 1
}
# wait_mode VOLUME MODE: until a's volume runs in MODE (peers in place).
wait_mode() { wait_cache "$1" mode "$2" "never reached $2"; }
# wait_clean VOLUME: until a's volume has no dirty data, so that a run does not share the
# machine with the destaging of the run before it, nor inherit its flow control.
wait_clean() { wait_cache "$1" dirty_bytes 0 "still has dirty data"; }

if [ "${ONLY:-}" != replay ]; then
echo "### FVP Table 2 on loopback: a 1 ms datastore, peers on the same machine"
echo
echo "| policy | 64 KiB seq write QD8 (MiB/s) | 4 KiB rand write QD16 (IOPS) | 4 KiB rand write QD1 mean latency (us) |"
echo "|---|---:|---:|---:|"
declare -A SEQ QD1 DISK
for p in ${POLICIES:-wt wb wbp:1 wbp:2}; do
    n="v-${p/:/}"
    vesta a volume create "$n" --size 2G --policy "$p" >/dev/null
    [[ $p == wbp* ]] && wait_mode "$n" "$p"
    sync
    s0=$(disk_sectors "$OUT")
    t0=$(date +%s.%N)
    read -r _ _ mb < <(fio_run "$n-seq" "$(printf "$V" "$n")" write 64k 8)
    [ -n "$s0" ] && DISK[$p]=$(python3 -c "import time; print(f'{($(disk_sectors "$OUT")-$s0)*512/2**20/(time.time()-$t0):.0f}')")
    wait_clean "$n"
    read -r io _ _ < <(fio_run "$n-rand" "$(printf "$V" "$n")" randwrite 4k 16)
    wait_clean "$n"
    read -r _ lat _ < <(fio_run "$n-qd1" "$(printf "$V" "$n")" randwrite 4k 1)
    SEQ[$p]=$mb
    QD1[$p]=$lat
    echo "| $p | $mb | $io | $lat |"
    vesta a volume delete --force "$n" >/dev/null
done
if [ ${#DISK[@]} -gt 0 ]; then
    echo
    echo -n "Writes to the disk holding $OUT during each 64 KiB run (MiB/s, ramp included):"
    for p in ${POLICIES:-wt wb wbp:1 wbp:2}; do echo -n " $p ${DISK[$p]:-?}"; done
    echo "."
fi
if [ -n "${SEQ[wb]:-}" ] && [ -n "${SEQ[wbp:1]:-}" ] && [ -n "${SEQ[wbp:2]:-}" ]; then
python3 - <<EOF
wb, w1, w2 = ${SEQ[wb]}, ${SEQ[wbp:1]}, ${SEQ[wbp:2]}
print()
print(f"wbp:1 sequential throughput {w1 / wb * 100:.0f} % of wb (target >= 85 %), "
      f"wbp:2 {w2 / wb * 100:.0f} % (target >= 75 %); "
      f"wbp:1 QD1 latency wb + {${QD1[wbp:1]} - ${QD1[wb]}:.0f} us (target <= 50 us)")
EOF
fi
# The floor under what a peer adds to a write: one 4 KiB message and its acknowledgement over
# loopback TCP between two threads doing nothing else (crates/peer/examples/loopback_rtt.rs).
read -r rtt rtt50 _ < <(cargo run --release -q -p peer --example loopback_rtt -- 127.0.0.3)
echo
echo "Loopback TCP round trip with a 4 KiB message, nothing else: mean $rtt us, median $rtt50 us."
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
RAW="nbd+unix:///?socket=$OUT/raw.sock"
read -r _ _ raw < <(fio_run lun-raw "$RAW" write 1M 16)
echo "The LUN's write bandwidth, fio 1 MiB sequential writes at QD16 (the datastore's"
echo "queue_depth) over its first GiB for ${RUNTIME} s: $raw MiB/s. The baseline of each replay"
echo "below is the same LUN doing the replay's job: the same bytes written once, then flushed."
echo
echo "| dirty data (MiB) | death to datastore current (s) | of which replay (s) | replay throughput (MiB/s) | the LUN, same job (MiB/s) | replay / LUN |"
echo "|---:|---:|---:|---:|---:|---:|"
# lun_job MIB -> MiB/s: the baseline above (fio's runtime includes its final flush).
lun_job() {
    fio --name=job --ioengine=nbd --uri="$RAW" --rw=write --bs=1M --iodepth=16 --size="${1}M" \
        --end_fsync=1 --output-format=json --output="$OUT/lun-job-$1.json" >/dev/null
    python3 -c 'import json,sys; j=json.load(open(sys.argv[1]))["jobs"][0]; t = j["job_runtime"] / 1000; print(round(int(sys.argv[2]) / t))' \
        "$OUT/lun-job-$1.json" "$1"
}
# replays: how many online replays b and c have finished.
replays() { cat "$OUT/b/vestad.log" "$OUT/c/vestad.log" | { grep -c "online replay done" || true; }; }
# One volume for every replay, written through once first (so is the baseline's range).
most=$(printf '%s\n' $DIRTY | sort -n | tail -1)
vesta a volume create r --size 2G --policy wt >/dev/null
fio --name=warm --ioengine=nbd --uri="$(printf "$V" r)" --rw=write --bs=1M --iodepth=8 \
    --size="${most}M" --output=/dev/null
lun_job "$most" >/dev/null
vesta a volume policy r wbp:1 --hold 3600 --max-dirty-age 3600 >/dev/null
for mib in $DIRTY; do
    wait_mode r wbp:1
    fio --name=fill --ioengine=nbd --uri="$(printf "$V" r)" --rw=write --bs=1M --iodepth=8 \
        --size="${mib}M" --output=/dev/null
    # Here the hosts' cache devices and the LUNs are files on one disk and share one page
    # cache: write back the cache files' dirty pages first, or the writes to the LUN would
    # wait for them (on real hosts each cache is its own device).
    sync
    job=$(lun_job "$mib")
    done_before=$(replays)
    kill -9 "${PID[a]}"
    t0=$(date +%s.%N)
    for _ in $(seq 6000); do
        now=$(replays)
        [ "$now" -gt "$done_before" ] && break
        sleep 0.05
    done
    t1=$(date +%s.%N)
    # The replay: from the peer's "replaying" line to its "online replay done" line.
    python3 - "$OUT/b/vestad.log" "$OUT/c/vestad.log" <<EOF
import datetime, sys
def at(line):
    return datetime.datetime.fromisoformat(line.split()[0].rstrip("Z")).timestamp()
lines = [l for f in sys.argv[1:] for l in open(f)]
start = max(at(l) for l in lines if "is gone; replaying" in l)
end = max(at(l) for l in lines if "online replay done in" in l)
mib, total, replay, job = $mib, $t1 - $t0, end - start, $job
print(f"| {mib} | {total:.1f} | {replay:.2f} | {mib / replay:.0f} | {job} | {mib / replay / job * 100:.0f} % |")
EOF
    host a 127.0.0.2 rack1
done
