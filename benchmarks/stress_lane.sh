#!/usr/bin/env bash
# Runs a pytest selection N times in a row while a CPU load keeps every core busy, and prints
# pass/fail per run and "N runs, K failures". The memory checks must not flake under load
# (docs/memory.md, "Under CPU load"); this is how that is shown.
#
#   benchmarks/stress_lane.sh [N] [pytest args...]
#
# N defaults to 20; the pytest args default to every memory-measuring test (tests/test_memory.py,
# the init peak tests, the planner's trust test). Examples:
#
#   benchmarks/stress_lane.sh                 # 20 runs of the memory-measuring tests
#   benchmarks/stress_lane.sh 5 -m cpu        # 5 full CPU lanes
#
# Environment: PYTHON (default: python), STRESS_LOAD (load processes, default: one per core),
# STRESS_LOG_DIR (default: a new temporary folder; each run's output is kept there).
# Exit status: 0 when every run passed, 1 otherwise, 2 on bad arguments.
set -u

runs=20
if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then
    runs=$1
    shift
elif [[ $# -gt 0 && $1 != -* && $1 != */* && $1 != *.py* ]]; then
    echo "stress_lane.sh: error: the number of runs must be a positive integer, got '$1'" \
         "(usage: benchmarks/stress_lane.sh [N] [pytest args...])" >&2
    exit 2
fi
if [[ $runs -lt 1 ]]; then
    echo "stress_lane.sh: error: the number of runs must be at least 1, got $runs" >&2
    exit 2
fi
if [[ $# -eq 0 ]]; then
    set -- -m cpu tests/test_memory.py \
        "tests/test_init.py::test_peak_while_materializing_stays_within_shards_plus_one_unit" \
        "tests/test_init.py::test_eager_build_exceeds_the_materialization_bound" \
        "tests/test_planning.py::test_estimate_is_within_tolerance_of_measured_peaks_and_a_missing_term_is_caught"
fi

python=${PYTHON:-python}
load=${STRESS_LOAD:-$(nproc)}
logs=${STRESS_LOG_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/stress-lane.XXXXXX")}
mkdir -p "$logs"

# The load: busy loops started here, each killed by its own pid on any exit (and on a signal).
# pytest runs in the background and is waited for, so a signal reaches the trap at once (bash
# defers traps while a foreground child runs) and the trap interrupts that run too.
load_pids=()
test_pid=
stop_all() {
    if [[ -n $test_pid ]]; then
        # pytest tears its rank pools down on SIGINT; one that does not exit in 10 s is killed.
        kill -INT "$test_pid" 2>/dev/null
        for _ in $(seq 20); do
            kill -0 "$test_pid" 2>/dev/null || break
            sleep 0.5
        done
        kill -KILL "$test_pid" 2>/dev/null
        wait "$test_pid" 2>/dev/null
        test_pid=
    fi
    for pid in "${load_pids[@]}"; do
        kill "$pid" 2>/dev/null
    done
    for pid in "${load_pids[@]}"; do
        wait "$pid" 2>/dev/null
    done
    load_pids=()
}
# Interrupted: the runs finished so far still get their tally line.
interrupted() {
    stop_all
    echo "interrupted during run $i/$runs"
    echo "$((i - 1)) runs, $failures failures"
    exit "$1"
}
i=0
failures=0
trap stop_all EXIT
trap 'interrupted 130' INT
trap 'interrupted 143' TERM
for _ in $(seq "$load"); do
    "$python" -c 'while True: pass' &
    load_pids+=("$!")
done

echo "stress lane: $runs run(s) of: pytest $* (load: $load busy process(es); logs: $logs)"
for i in $(seq "$runs"); do
    log="$logs/run-$i.log"
    start=$SECONDS
    "$python" -m pytest -q -p no:cacheprovider "$@" >"$log" 2>&1 &
    test_pid=$!
    wait "$test_pid"
    rc=$?
    test_pid=
    summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|error)' "$log" | tail -n 1 | tr -d '=')
    if [[ $rc -eq 0 ]]; then
        echo "run $i/$runs: pass ($((SECONDS - start)) s)${summary:+: $summary}"
    else
        failures=$((failures + 1))
        echo "run $i/$runs: FAIL (exit $rc, $((SECONDS - start)) s)${summary:+: $summary}; log: $log"
        grep -E '^(FAILED|ERROR) ' "$log" | sed 's/^/    /'
    fi
done
echo "$runs runs, $failures failures"
[[ $failures -eq 0 ]]
