#!/usr/bin/env bash
# Runs `fsdp-conformance run` under `torchrun --nproc-per-node 2` N times in a row and checks,
# for each run, what a torchrun user expects (docs/harness.md, "Under an external launcher"):
# exit 0 on every rank, exactly one table printed (rank 0's), one report.json and summary.md,
# and rank 1's progress in its own log. Prints one line per run and "N runs, K failures".
#
#   benchmarks/launcher_runs.sh [N] [extra `fsdp-conformance run` args...]
#
# N defaults to 10. The memory checks that need MALLOC_MMAP_THRESHOLD_ at process start run
# on child ranks started with it (the launch itself needs no such setting).
# Environment: PYTHON (default: python), RUNS_DIR (default: a new temporary folder).
# Exit status: 0 when every run passed, 1 otherwise, 2 on bad arguments.
set -u

runs=10
if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then
    runs=$1
    shift
fi
if [[ $runs -lt 1 ]]; then
    echo "launcher_runs.sh: error: the number of runs must be at least 1, got $runs" >&2
    exit 2
fi
python=${PYTHON:-python}
dir=${RUNS_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/launcher-runs.XXXXXX")}
echo "launcher runs: $runs x torchrun --nproc-per-node 2 fsdp-conformance run $* (logs: $dir)"
failures=0
for i in $(seq "$runs"); do
    run="$dir/run-$i"
    mkdir -p "$run"
    start=$SECONDS
    "$python" -m torch.distributed.run --standalone --nproc-per-node 2 \
        -m fsdp_conformance.cli run --out "$run/out" "$@" >"$run/stdout" 2>"$run/stderr"
    rc=$?
    tables=$(grep -c '^check  *outcome' "$run/stdout")
    reports=$(find "$run/out" -name report.json | wc -l)
    summary=$(grep -E '^[0-9]+ passed' "$run/stdout" | tail -n 1)
    problems=()
    [[ $rc -eq 0 ]] || problems+=("exit $rc")
    [[ $tables -eq 1 ]] || problems+=("$tables tables")
    [[ $reports -eq 1 ]] || problems+=("$reports reports")
    [[ -f $run/out/summary.md ]] || problems+=("no summary.md")
    [[ -s $run/out/rank1.log ]] || problems+=("no rank1.log")
    if [[ ${#problems[@]} -eq 0 ]]; then
        echo "run $i/$runs: pass ($((SECONDS - start)) s): $summary"
    else
        failures=$((failures + 1))
        echo "run $i/$runs: FAIL ($((SECONDS - start)) s): ${problems[*]}; $summary; logs: $run"
        grep -E 'failed|error' "$run/stderr" | grep -v '^\s*$' | head -n 5 | sed 's/^/    /'
    fi
done
echo "$runs runs, $failures failures"
[[ $failures -eq 0 ]]
