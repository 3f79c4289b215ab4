#!/usr/bin/env bash
# The reference run side by side: `fsdp-conformance run` under
# `torchrun --standalone --nproc-per-node 2` (each launched process supervises one child rank,
# docs/harness.md, "Under an external launcher"), then the same run on a warm pool, one after
# the other on the same machine. Prints each wall time, each report's summary, whether the
# launched report lists every check of the pool's, and the ratio launched / pool (target:
# at most 1.3).
#
#   benchmarks/launcher_vs_pool.sh [extra `fsdp-conformance run` args...]
#
# Environment: PYTHON (default: python), RUNS_DIR (default: a new temporary folder).
# Exit status: 0 when both runs exit 0 and the launched report has every check of the pool's,
# 1 otherwise.
set -u

python=${PYTHON:-python}
dir=${RUNS_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/launcher-vs-pool.XXXXXX")}
mkdir -p "$dir/launched" "$dir/pool"
echo "launcher vs pool: fsdp-conformance run $* (logs: $dir)"

start=$EPOCHREALTIME
"$python" -m torch.distributed.run --standalone --nproc-per-node 2 \
    -m fsdp_conformance.cli run --out "$dir/launched/out" "$@" \
    >"$dir/launched/stdout" 2>"$dir/launched/stderr"
launched_rc=$?
launched_s=$(echo "$EPOCHREALTIME $start" | awk "{print \$1 - \$2}")

start=$EPOCHREALTIME
"$python" -m fsdp_conformance.cli run --out "$dir/pool/out" "$@" \
    >"$dir/pool/stdout" 2>"$dir/pool/stderr"
pool_rc=$?
pool_s=$(echo "$EPOCHREALTIME $start" | awk "{print \$1 - \$2}")

"$python" - "$dir" "$launched_rc" "$launched_s" "$pool_rc" "$pool_s" <<'PY'
import json
import sys

folder, launched_rc, launched_s, pool_rc, pool_s = sys.argv[1:]
launched_s, pool_s = float(launched_s), float(pool_s)


def load(name):
    try:
        with open(f"{folder}/{name}/out/report.json", encoding="utf-8") as f:
            return json.load(f)
    except OSError:
        return None


def keys(report):
    return {(e["check"], e["variant"], e["lane"], e["world_size"]) for e in report["checks"]}


ok = launched_rc == "0" and pool_rc == "0"
for name, rc, wall in (("launched", launched_rc, launched_s), ("pool", pool_rc, pool_s)):
    report = load(name)
    summary = report["summary"] if report else "no report"
    print(f"{name:>8}: exit {rc}, {wall:.1f} s wall, {summary}")
launched, pool = load("launched"), load("pool")
if launched and pool:
    cpu = {k for k in keys(pool) if k[2] == "cpu"}
    missing = sorted(cpu - keys(launched))
    print(f"launched report: {len(cpu) - len(missing)} of the pool's {len(cpu)} cpu-lane checks")
    for key in missing[:10]:
        print(f"    missing: {key}")
    ok = ok and not missing
else:
    ok = False
ratio = launched_s / pool_s
print(f"ratio launched/pool: {ratio:.2f}x (target <= 1.3x: {'met' if ratio <= 1.3 else 'not met'})")
sys.exit(0 if ok else 1)
PY
