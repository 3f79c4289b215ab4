#!/usr/bin/env bash
# The reference run side by side: `fsdp-conformance run` under
# `torchrun --standalone --nproc-per-node 2` (each launched process supervises one child rank,
# docs/harness.md, "Under an external launcher") and the same run on a warm pool, in turn on the
# same machine: ROUNDS rounds, the order swapped each round (launched first in odd rounds), so
# that a load that changes during the runs weighs on both. Prints each run's wall time and
# summary, whether each launched report lists every check of the pool's, and the ratio of the
# total wall times launched / pool (target: at most 1.3).
#
#   benchmarks/launcher_vs_pool.sh [extra `fsdp-conformance run` args...]
#
# Environment: PYTHON (default: python), RUNS_DIR (default: a new temporary folder), ROUNDS
# (default: 1).
# Exit status: 0 when every run exits 0 and every launched report has every check of the
# pool's, 1 otherwise, 2 on a bad ROUNDS.
set -u

python=${PYTHON:-python}
rounds=${ROUNDS:-1}
if ! [[ $rounds =~ ^[0-9]+$ ]] || [[ $rounds -lt 1 ]]; then
    echo "launcher_vs_pool.sh: error: ROUNDS must be a whole number of at least 1, got $rounds" >&2
    exit 2
fi
dir=${RUNS_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/launcher-vs-pool.XXXXXX")}
echo "launcher vs pool: $rounds round(s) of fsdp-conformance run $* (logs: $dir)"

run_one() { # run_one KIND FOLDER ARGS...: one run, its exit status and wall seconds to FOLDER
    local kind=$1 folder=$2
    shift 2
    mkdir -p "$folder"
    local start=$EPOCHREALTIME
    if [[ $kind == launched ]]; then
        "$python" -m torch.distributed.run --standalone --nproc-per-node 2 \
            -m fsdp_conformance.cli run --out "$folder/out" "$@" \
            >"$folder/stdout" 2>"$folder/stderr"
    else
        "$python" -m fsdp_conformance.cli run --out "$folder/out" "$@" \
            >"$folder/stdout" 2>"$folder/stderr"
    fi
    echo "$? $EPOCHREALTIME $start" | awk '{print $1, $2 - $3}' >"$folder/timing"
}

for round in $(seq "$rounds"); do
    if ((round % 2)); then order=(launched pool); else order=(pool launched); fi
    for kind in "${order[@]}"; do
        run_one "$kind" "$dir/round$round/$kind" "$@"
    done
done

"$python" - "$dir" "$rounds" <<'PY'
import json
import sys

folder, rounds = sys.argv[1], int(sys.argv[2])


def load(path):
    try:
        with open(f"{path}/out/report.json", encoding="utf-8") as f:
            return json.load(f)
    except OSError:
        return None


def keys(report):
    return {(e["check"], e["variant"], e["lane"], e["world_size"]) for e in report["checks"]}


ok = True
total = {"launched": 0.0, "pool": 0.0}
for r in range(1, rounds + 1):
    reports = {}
    for kind in ("launched", "pool"):
        path = f"{folder}/round{r}/{kind}"
        with open(f"{path}/timing", encoding="ascii") as f:
            rc, wall = f.read().split()
        total[kind] += float(wall)
        reports[kind] = report = load(path)
        ok = ok and rc == "0"
        summary = report["summary"] if report else "no report"
        print(f"round {r} {kind:>8}: exit {rc}, {float(wall):.1f} s wall, {summary}")
    launched, pool = reports["launched"], reports["pool"]
    if launched and pool:
        cpu = {k for k in keys(pool) if k[2] == "cpu"}
        missing = sorted(cpu - keys(launched))
        print(f"round {r} launched report: {len(cpu) - len(missing)} of the pool's {len(cpu)} "
              "cpu-lane checks")
        for key in missing[:10]:
            print(f"    missing: {key}")
        ok = ok and not missing
    else:
        ok = False
ratio = total["launched"] / total["pool"]
print(f"total wall: launched {total['launched']:.1f} s, pool {total['pool']:.1f} s")
print(f"ratio launched/pool: {ratio:.2f}x (target <= 1.3x: {'met' if ratio <= 1.3 else 'not met'})")
sys.exit(0 if ok else 1)
PY
