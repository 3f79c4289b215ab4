#!/usr/bin/env bash
# The torch-upgrade gate: the same suite, on your model and settings, on the current torch and
# on the candidate; checkpoints carried both ways; one verdict (docs/upgrade-gate.md).
#
# Usage: ci/upgrade-gate.sh OLD_CONSTRAINT NEW_CONSTRAINT [run args ...]
#   e.g. ci/upgrade-gate.sh ci/constraints-cpu.txt ci/constraints-torch-2.14.1.txt
#        ci/upgrade-gate.sh old.txt new.txt --model mypkg.model:build --block-cls Block
# Environment:
#   GATE_PROJECT      your project's folder (default: the folder you run the script from). It is
#                     installed into both environments when it has a pyproject.toml or setup.py
#                     (so --model can import it), and `run` runs there, so its
#                     [tool.fsdp_conformance] table applies on both sides.
#   GATE_NOISE_RUNS   runs of the current torch that measure the noise of every measured figure
#                     (default 2; 1 skips it: drift is then judged only where a report carries
#                     its noise, the reference models').
#   GATE_LANE         the lane (default auto: the GPU lane too where the torch sees GPUs).
#   GATE_RESHARD_WORLD_SIZES  world sizes the candidate also loads the current torch's
#                     checkpoints at, resharded (default 4; empty: none).
#   GATE_OUT          where the reports go (default fsdp-conformance-report/gate in the project).
# Steps: each side's environment; the current torch runs (GATE_NOISE_RUNS times) and saves its
# checkpoints; the candidate runs, loading them and saving its own, and loads them again at
# GATE_RESHARD_WORLD_SIZES; the current torch loads the candidate's (rollback); compare,
# verdict first, in text, Markdown and JSON.
# Exit status: compare's (0 safe to upgrade, 1 not safe, 2 bad input).
set -euo pipefail
suite=$(cd "$(dirname "$0")/.." && pwd)
old=${1:?give the constraints file of the current torch}
new=${2:?give the constraints file of the candidate torch}
shift 2
old=$(realpath "$old")
new=$(realpath "$new")
project=$(realpath "${GATE_PROJECT:-$PWD}")
runs=${GATE_NOISE_RUNS:-2}
reshard=${GATE_RESHARD_WORLD_SIZES-4}
lane=${GATE_LANE:-auto}
out=$(realpath -m "${GATE_OUT:-$project/fsdp-conformance-report/gate}")
mkdir -p "$out"
rm -rf "$out/checkpoint-old" "$out/checkpoint-new"

for side in old new; do
  constraints=${!side}
  venv="$out/.venv-$side"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q -c "$constraints" -e "$suite[test]"
  if [[ "$project" != "$suite" && ( -f "$project/pyproject.toml" || -f "$project/setup.py" ) ]]; then
    "$venv/bin/python" -m pip install -q -c "$constraints" -e "$project"
  fi
done

conformance() {  # side, args...: fsdp-conformance in that side's environment
  local side=$1
  shift
  "$out/.venv-$side/bin/python" -m fsdp_conformance.cli "$@"
}

gate_run() {  # side, out dir, run args...: a failing check must not stop the gate
  local side=$1 dir=$2
  shift 2
  (cd "$project" && conformance "$side" run --lane "$lane" --no-plot --out "$dir" "$@") || true
}

# The current torch: its checkpoints for the candidate, and its noise.
gate_run old "$out/old" --save-checkpoint "$out/checkpoint-old" "$@"
noise_args=()
if (( runs > 1 )); then
  repeats=("$out/old/report.json")
  for ((i = 2; i <= runs; i++)); do
    gate_run old "$out/old-$i" "$@"
    repeats+=("$out/old-$i/report.json")
  done
  if conformance old noise "${repeats[@]}" --out "$out/noise.json"; then
    noise_args=(--noise "$out/noise.json")
  else
    echo "gate: the noise was not measured (above); drift is judged only where a report" \
      "carries its noise" >&2
  fi
fi
# The candidate: loads the current torch's checkpoints, saves its own.
gate_run new "$out/new" --load-checkpoint "$out/checkpoint-old" \
  --save-checkpoint "$out/checkpoint-new" "$@"
# Resharded: the candidate loads them at other world sizes too (one process is in every load).
load_args=()
if [[ -n "$reshard" ]]; then
  gate_run new "$out/new-resharded" --checks state.checkpoint --world-sizes "$reshard" \
    --load-checkpoint "$out/checkpoint-old" "$@"
  load_args=(--loads "$out/new-resharded/report.json")
fi
# Rollback: the current torch loads what the candidate saved.
gate_run old "$out/rollback" --checks state.checkpoint --load-checkpoint "$out/checkpoint-new" "$@"

compare=(compare "$out/old/report.json" "$out/new/report.json" "${noise_args[@]}"
  "${load_args[@]}" --rollback "$out/rollback/report.json")
set +e
conformance new "${compare[@]}" | tee "$out/compare.txt"
status=${PIPESTATUS[0]}
conformance new "${compare[@]}" --markdown > "$out/compare.md"
conformance new "${compare[@]}" --json > "$out/compare.json"
echo "gate: $out/compare.txt, compare.md, compare.json"
exit "$status"
