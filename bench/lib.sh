# Shared by the bench scripts (sourced, not run): the output directory, background processes
# stopped at exit, and waits for an NBD socket or a ready vestad.

# bench_out DIR: DIR emptied and created; prints its absolute path.
bench_out() { rm -rf "$1" && mkdir -p "$1" && (cd "$1" && pwd); }

# Background processes to stop at exit: `cmd & started`. They stop newest first, so vestad
# goes before the nbdkit it holds connections to (nbdkit waits for its clients on SIGTERM,
# so the other order hangs).
pids=()
# Images a bench keeps outside OUT (bench/wbp.sh's PEER_CACHE), deleted with the ones in it.
images_elsewhere=()
started() { pids+=("$!"); }
stop_started() {
    for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
        # `|| true`: the trap runs under `set -e`, and a process may be gone already.
        kill "${pids[i]}" 2>/dev/null || true
        wait "${pids[i]}" 2>/dev/null || true
    done
    # The disk images (cache files, LUNs, volumes) take GiBs each and a few benches fill a
    # small disk; the results, logs and fio JSON stay. KEEP_IMAGES=1 keeps them too.
    if [ -z "${KEEP_IMAGES:-}" ] && [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
        find "$OUT" -type f \( -name '*.img' -o -name '*.raw' \) -delete 2>/dev/null || true
    fi
    if [ -z "${KEEP_IMAGES:-}" ]; then
        for f in "${images_elsewhere[@]}"; do rm -f "$f"; done
    fi
}
trap stop_started EXIT

# wait_sock PATH: until the unix socket exists (10 s).
wait_sock() {
    for _ in $(seq 100); do [ -S "$1" ] && return; sleep 0.1; done
    echo "no socket $1" >&2
    exit 1
}

# vestad_api DATA_DIR: waits for vestad's ready file (30 s); prints its admin API's URL.
vestad_api() {
    for _ in $(seq 300); do [ -f "$1/vestad.json" ] && break; sleep 0.1; done
    [ -f "$1/vestad.json" ] || { echo "vestad did not become ready; see its log" >&2; exit 1; }
    echo "http://$(python3 -c 'import json,sys;print(json.load(open(sys.argv[1]))["api"])' "$1/vestad.json")"
}

# disk_sectors DIR -> 512-byte sectors written so far to the disk that holds DIR
# (/proc/diskstats), or nothing when DIR is not on a listed disk (tmpfs, overlay).
disk_sectors() {
    local dev
    dev=$(basename "$(readlink -f "$(df --output=source "$1" | tail -1)")")
    awk -v d="$dev" '$3 == d {print $10}' /proc/diskstats
}

# fio_run NAME URI RW BS QD -> "iops lat_us MiB/s": a timed fio write run (RUNTIME seconds after
# 2 s of ramp) on an NBD URI, its JSON kept as $OUT/NAME.json, over the first FIO_SIZE bytes
# (1G). FIO_EXTRA adds options.
# Each run starts with `sync`: the page cache's dirty data from the runs before it (nbdkit's
# in-place writes, vestad's cache log) is written back first, so no run pays for the
# writeback of another one.
fio_run() {
    local json="$OUT/$1.json"
    sync
    fio --name="$1" --ioengine=nbd --uri="$2" --rw="$3" --bs="$4" --iodepth="$5" ${FIO_EXTRA:-} \
        --size="${FIO_SIZE:-1G}" --runtime="$RUNTIME" --time_based --ramp_time=2 --randrepeat=0 \
        --output-format=json --output="$json"
    python3 - "$json" <<'EOF'
import json, sys
w = json.load(open(sys.argv[1]))["jobs"][0]["write"]
print(f'{w["iops"]:.0f} {w["lat_ns"]["mean"] / 1000:.1f} {w["bw"] / 1024:.1f}')
EOF
}

# side_by_side SIZE: what the uncached-path benches compare, each over SIZE bytes: an
# `uncached` volume `bench` on vestad's `default` datastore (VURI; its image file VIMG), and
# images in OUT served over unix sockets by nbdkit's file plugin (KURI) and by qemu-nbd
# (QURI; raw, writeback cache), plus OUT/raw.img for fio itself. Needs BIN and OUT.
side_by_side() {
    "$BIN/vestad" --data-dir "$OUT/vesta" --api 127.0.0.1:0 --nbd-tcp "" >"$OUT/vestad.log" 2>&1 & started
    API=$(vestad_api "$OUT/vesta")
    "$BIN/vesta" --api "$API" volume create bench --size "$1" --datastore default >/dev/null
    VURI="nbd+unix:///bench?socket=$OUT/vesta/nbd.sock"
    VIMG=$(find "$OUT/vesta" -name bench.raw | head -1)
    truncate -s "$1" "$OUT/nbdkit.img"
    nbdkit -f --unix "$OUT/nbdkit.sock" file "$OUT/nbdkit.img" >"$OUT/nbdkit.log" 2>&1 & started
    truncate -s "$1" "$OUT/qemu-nbd.img"
    qemu-nbd -f raw --cache=writeback --aio=threads --shared=4 --persistent -x bench \
        --socket="$OUT/qemu-nbd.sock" "$OUT/qemu-nbd.img" >"$OUT/qemu-nbd.log" 2>&1 & started
    truncate -s "$1" "$OUT/raw.img"
    wait_sock "$OUT/nbdkit.sock"
    wait_sock "$OUT/qemu-nbd.sock"
    KURI="nbd+unix:///?socket=$OUT/nbdkit.sock"
    QURI="nbd+unix:///bench?socket=$OUT/qemu-nbd.sock"
}

# fill_side_by_side SIZE: writes all SIZE bytes of each of side_by_side's targets once, so
# reads hit real blocks.
fill_side_by_side() {
    local uri
    for uri in "$VURI" "$KURI" "$QURI"; do
        fio --name=fill --ioengine=nbd --uri="$uri" --rw=write --bs=1M --iodepth=8 --size="$1" --output=/dev/null
    done
    fio --name=fill --ioengine=io_uring --filename="$OUT/raw.img" --rw=write --bs=1M --iodepth=8 --size="$1" --output=/dev/null
}
