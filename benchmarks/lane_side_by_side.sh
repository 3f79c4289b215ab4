#!/usr/bin/env bash
# Times a pytest selection (or an `fsdp-conformance` command) on this checkout and on an earlier
# commit, alternating (new, old, new,
# ...), and prints each run's wall and CPU seconds with the ratios new / old. This machine's
# speed can drift by 1.5x or more within an hour, so figures taken at different times do not
# compare code; runs taken in turn do. Before each run a fixed single-thread Python loop is timed
# ("loop"), so that a drift shows in the output.
#
#   benchmarks/lane_side_by_side.sh REF [ROUNDS] [-- pytest args...]
#   benchmarks/lane_side_by_side.sh REF [ROUNDS] -- --cli run --no-plot
#
# REF: the earlier commit (its tests and package run from a git worktree, put first on
# PYTHONPATH, so the editable install of this checkout does not shadow it). ROUNDS (default 1):
# how many old runs; there is one new run before each and one after the last. The pytest args
# default to `-m cpu -q -p no:cacheprovider`. `--cli ARGS...` times `python -m fsdp_conformance.cli
# ARGS... --out DIR` instead (each run its own report folder): the `fsdp-conformance run` budget.
# Example (this session's measurement):
#
#   benchmarks/lane_side_by_side.sh 537ccfe
#
# Environment: PYTHON (default: python). Exit status: 0 when every run passed, 1 otherwise,
# 2 on bad arguments.
set -u

if [[ $# -lt 1 || $1 == -* ]]; then
    echo "lane_side_by_side.sh: error: name the earlier commit" \
         "(usage: benchmarks/lane_side_by_side.sh REF [ROUNDS] [-- pytest args...])" >&2
    exit 2
fi
ref=$1
shift
rounds=1
if [[ $# -gt 0 && $1 != -- ]]; then
    if ! [[ $1 =~ ^[1-9][0-9]*$ ]]; then
        echo "lane_side_by_side.sh: error: ROUNDS must be a positive integer, got '$1'" >&2
        exit 2
    fi
    rounds=$1
    shift
fi
[[ $# -gt 0 && $1 == -- ]] && shift
args=("$@")
[[ ${#args[@]} -eq 0 ]] && args=(-m cpu -q -p no:cacheprovider)

python=${PYTHON:-python}
root=$(cd "$(dirname "$0")/.." && pwd)
if ! git -C "$root" rev-parse --verify --quiet "$ref^{commit}" >/dev/null; then
    echo "lane_side_by_side.sh: error: '$ref' is not a commit of $root" >&2
    exit 2
fi
work=$(mktemp -d)
old="$work/old"
trap 'git -C "$root" worktree remove --force "$old" >/dev/null 2>&1; rm -rf "$work"' EXIT
git -C "$root" worktree add --detach --quiet "$old" "$ref" || exit 2

loop() {
    "$python" -c 'import time
t = time.perf_counter(); s = 0
for i in range(20_000_000): s += i
print(f"{time.perf_counter() - t:.2f}")'
}

declare -A wall cpu
failed=0
run() {  # run NAME DIR [PYTHONPATH]
    local name=$1 dir=$2 path=${3:-} times
    times="$work/$name.time"
    echo "== $name (loop $(loop) s)"
    local command=(-m pytest "${args[@]}")
    [[ ${args[0]} == --cli ]] && command=(-m fsdp_conformance.cli "${args[@]:1}" --out "$work/$name")
    (cd "$dir" && PYTHONPATH=$path /usr/bin/time -f "%e %U %S" -o "$times" \
        "$python" "${command[@]}" >"$work/$name.log" 2>&1) || failed=1
    grep -E "passed|failed|error" "$work/$name.log" | tail -n 1
    read -r w u s <"$times"
    wall[$name]=$w
    cpu[$name]=$(awk -v u="$u" -v s="$s" 'BEGIN { printf "%.1f", u + s }')
    echo "   wall ${wall[$name]} s, CPU ${cpu[$name]} s"
}

for ((i = 1; i <= rounds; i++)); do
    run "new$i" "$root"
    run "old$i" "$old" "$old"
done
run "new$((rounds + 1))" "$root"

echo "== ratios new / old (wall, CPU)"
for ((i = 1; i <= rounds; i++)); do
    for n in "new$i" "new$((i + 1))"; do
        awk -v n="$n" -v o="old$i" -v nw="${wall[$n]}" -v ow="${wall[old$i]}" \
            -v nc="${cpu[$n]}" -v oc="${cpu[old$i]}" \
            'BEGIN { printf "%s / %s: %.2f, %.2f\n", n, o, nw / ow, nc / oc }'
    done
done
exit $failed
