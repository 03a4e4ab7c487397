#!/usr/bin/env bash
# `make run`: starts vestad on the embedded default, makes sure a volume `demo` exists, prints
# how to reach it, and stays in the foreground until Ctrl-C (which stops vestad cleanly).
set -euo pipefail
bin=${VESTA_BIN_DIR:-target/release}
export VESTA_API=${VESTA_API:-http://127.0.0.1:7370}

"$bin/vestad" &
pid=$!
trap 'kill -TERM $pid 2>/dev/null; wait $pid' INT TERM

for _ in $(seq 1 100); do
    [ -f vesta-data/vestad.json ] && break
    kill -0 $pid 2>/dev/null || { wait $pid; exit $?; }
    sleep 0.1
done
[ -f vesta-data/vestad.json ] || { echo "run: vestad did not become ready" >&2; kill $pid; exit 1; }

if ! "$bin/vesta" volume show demo >/dev/null 2>&1; then
    "$bin/vesta" volume create demo --size 1G
fi
url=$("$bin/vesta" volume url demo)
cat <<MSG

Vesta is serving volume demo at
    $url

Try it from another terminal:
    nbdinfo '$url'
    qemu-io -f raw -c 'write -P 0xab 0 64k' -c 'read -P 0xab 0 64k' '$url'
    $bin/vesta volume list; $bin/vesta stats

Ctrl-C stops vestad.
MSG
wait $pid
