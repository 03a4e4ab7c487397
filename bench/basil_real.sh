#!/usr/bin/env bash
# BASIL on real IO (issue 5, like BASIL Tables 2-3): three `lun` datastores served by nbdkit
# with 3, 6 and 9 worker threads behind a fixed per-IO delay (latency grows with outstanding
# IOs over "spindles"), eight fio workloads shaped like BASIL Table 1 on uncached volumes,
# placed as in the paper's Table 2. Each round runs every workload for ROUND_S seconds (its
# queue depth redrawn from its Table 1 range every STEP_S seconds), then asks vestad for a plan
# and carries it out with `vesta volume relocate --offline`, until the plan has no moves.
#
#   make build && bench/basil_real.sh           # ROUND_S=60 STEP_S=5 DELAY=5ms ROUNDS=3
#
# Output: $OUT/rounds.json (per round: models, plan, per-workload IOPS and latency) and
# $OUT/table.md (the table for docs/BENCHMARKS.md).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
BIN=${VESTA_BIN_DIR:-target/release}
BIN=$(cd "$BIN" && pwd)
OUT=${OUT:-bench/out/basil_real}
ROUND_S=${ROUND_S:-60}
STEP_S=${STEP_S:-5}
DELAY=${DELAY:-5ms}
ROUNDS=${ROUNDS:-3}
OUT=$(bench_out "$OUT")

{
    printf '[stats]\ninterval_s = 2\n\n[cache]\npath = ""\n'
    for n in 3 6 9; do
        truncate -s 8G "$OUT/lun$n.img"
        nbdkit -f --unix "$OUT/lun$n.sock" --threads=$n --filter=delay file "$OUT/lun$n.img" \
            rdelay="$DELAY" wdelay="$DELAY" >"$OUT/nbdkit$n.log" 2>&1 & started
        printf '\n[[datastore]]\nname = "lun%s"\nkind = "lun"\ntarget = "nbd+unix:///?socket=%s"\nqueue_depth = 64\n' \
            "$n" "$OUT/lun$n.sock"
    done
} >"$OUT/vestad.toml"
for n in 3 6 9; do wait_sock "$OUT/lun$n.sock"; done
"$BIN/vestad" -c "$OUT/vestad.toml" --data-dir "$OUT/vesta" --api 127.0.0.1:0 --nbd-tcp "" \
    >"$OUT/vestad.log" 2>&1 & started
vestad_api "$OUT/vesta" >/dev/null

VESTA="$BIN/vesta" OUT="$OUT" ROUND_S="$ROUND_S" STEP_S="$STEP_S" ROUNDS="$ROUNDS" DELAY="$DELAY" \
    python3 - <<'EOF'
import json, os, random, subprocess, sys, time

out = os.environ["OUT"]
round_s, step_s, rounds = int(os.environ["ROUND_S"]), int(os.environ["STEP_S"]), int(os.environ["ROUNDS"])
info = json.load(open(f"{out}/vesta/vestad.json"))
api = "http://" + info["api"]
sock = info["nbd_unix"]

def vesta(*args):
    r = subprocess.run([os.environ["VESTA"], "--api", api, "--json", *args],
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"vesta {args}: {r.stderr}")
    return json.loads(r.stdout)

# BASIL Table 1 (OIO range, IO size KiB, read %, random %), placed as in Table 2.
TYPES = {
    "workstation": (4, 12, 8, 80, 80),
    "exchange": (4, 16, 4, 67, 100),
    "oltp": (12, 16, 8, 70, 100),
    "webserver": (1, 4, 4, 95, 75),
}
START = [
    ("oltp1", "oltp", "lun3"), ("oltp2", "oltp", "lun3"), ("ws1", "workstation", "lun3"),
    ("exch1", "exchange", "lun6"), ("exch2", "exchange", "lun6"), ("ws2", "workstation", "lun6"),
    ("web1", "webserver", "lun9"), ("web2", "webserver", "lun9"),
]
for name, _, ds in START:
    vesta("volume", "create", name, "--size", "2G", "--datastore", ds)

rng = random.Random(2010)

def run_round(tag):
    procs = []
    for name, kind, _ in START:
        lo, hi, bs, rd, rnd = TYPES[kind]
        job = [f"[global]\nioengine=nbd\nuri=nbd+unix:///{name}?socket={sock}\nrw=randrw\n"
               f"rwmixread={rd}\npercentage_random={rnd}\nbs={bs}k\ntime_based\n"
               f"runtime={step_s}\nrandrepeat=0\n"]
        for i in range(round_s // step_s):
            job.append(f"\n[s{i}]\niodepth={rng.randint(lo, hi)}\nstonewall\n")
        path = f"{out}/{tag}-{name}.fio"
        open(path, "w").write("".join(job))
        procs.append((name, subprocess.Popen(
            ["fio", "--output-format=json", f"--output={out}/{tag}-{name}.json", path])))
    res = {}
    for name, p in procs:
        if p.wait() != 0:
            sys.exit(f"fio {name} failed")
        text = open(f"{out}/{tag}-{name}.json").read()
        j = json.loads(text[text.index("{"):])
        ios = lat = secs = 0.0
        for job in j["jobs"]:
            secs += job["job_runtime"] / 1000.0
            for d in ("read", "write"):
                n = job[d]["total_ios"]
                ios += n
                lat += n * job[d]["lat_ns"]["mean"] / 1e6
        res[name] = {"iops": ios / secs, "latency_ms": lat / ios}
    return res

history = []
for r in range(rounds + 1):
    where = {v["name"]: v["datastore"] for v in vesta("volume", "list")}
    res = run_round(f"r{r}")
    time.sleep(3)  # one more stats interval
    models = vesta("stats", "--models")
    plan = vesta("balance", "plan")
    history.append({"round": r, "placement": where, "results": res, "models": models, "plan": plan})
    tot = sum(x["iops"] for x in res.values())
    wlat = sum(x["iops"] * x["latency_ms"] for x in res.values()) / tot
    print(f"round {r}: {tot:.0f} IOPS, {wlat:.1f} ms IOPS-weighted; "
          f"P = " + ", ".join(f"{d['name']} {d['model']['performance']:.2f}" if d["model"] else f"{d['name']} -"
                                for d in models["datastores"])
          + f"; plan: {len(plan['plan']['moves'])} move(s), f {plan['plan']['imbalance_before']:.2f} -> {plan['plan']['imbalance_after']:.2f}",
          flush=True)
    moves = plan["plan"]["moves"]
    if not moves or r == rounds:
        break
    for m in moves:
        t = time.time()
        vesta("volume", "relocate", m["workload"], "--datastore", m["to"], "--offline")
        print(f"  relocated {m['workload']} {m['from']} -> {m['to']} in {time.time() - t:.1f} s", flush=True)

json.dump(history, open(f"{out}/rounds.json", "w"), indent=1)

first, last = history[0], history[-1]
vols = {v["name"]: v for v in last["models"]["volumes"]}
lines = ["| workload | model [OIO, KiB, read %, random %] at p90 | before: ms | IOPS | on | after: ms | IOPS | on |",
         "|---|---|---:|---:|---|---:|---:|---|"]
for name, kind, _ in START:
    p = vols[name]["p90"]
    b, a = first["results"][name], last["results"][name]
    lines.append(f"| {kind} ({name}) | [{p['oio']:.0f}, {p['io_size_kib']:.0f}, {p['read_pct']:.0f}, {p['random_pct']:.0f}] "
                 f"| {b['latency_ms']:.1f} | {b['iops']:.0f} | {first['placement'][name]} "
                 f"| {a['latency_ms']:.1f} | {a['iops']:.0f} | {last['placement'][name]} |")
def totals(h):
    tot = sum(x["iops"] for x in h["results"].values())
    return tot, sum(x["iops"] * x["latency_ms"] for x in h["results"].values()) / tot
(bt, bl), (at, al) = totals(first), totals(last)
lines.append(f"| **IOPS-weighted latency / total IOPS** | | **{bl:.1f}** | **{bt:.0f}** | "
             f"| **{al:.1f} ({100*(al-bl)/bl:+.0f} %)** | **{at:.0f} ({100*(at-bt)/bt:+.0f} %)** | |")
lines.append("")
lines.append("| datastore | nbdkit threads | P = 1/slope (first round) | fit R² | P (last round) |")
lines.append("|---|---:|---:|---:|---:|")
for d0 in first["models"]["datastores"]:
    d1 = next(d for d in last["models"]["datastores"] if d["name"] == d0["name"])
    m0, m1 = d0["model"], d1["model"]
    lines.append(f"| {d0['name']} | {d0['name'][3:]} | {m0['performance']:.2f} | {m0['r_squared']:.2f} | {m1['performance']:.2f} |"
                 if m0 and m1 else f"| {d0['name']} | {d0['name'][3:]} | - | - | - |")
open(f"{out}/table.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
