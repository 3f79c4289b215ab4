#!/usr/bin/env bash
# The torch-upgrade gate: the same suite on two torch versions, two reports, one compare;
# a checkpoint the current torch saves is loaded by the candidate.
# Usage: ci/upgrade-gate.sh OLD_CONSTRAINT NEW_CONSTRAINT [extra args for `fsdp-conformance run`]
#   e.g. ci/upgrade-gate.sh ci/constraints-cpu.txt ci/constraints-torch-2.14.1.txt
# Exit status: compare's (0 no regression, 1 regression, 2 bad input).
set -euo pipefail
cd "$(dirname "$0")/.."
old=${1:?give the constraints file of the current torch}
new=${2:?give the constraints file of the candidate torch}
shift 2
out=fsdp-conformance-report/gate
mkdir -p "$out"
# The current torch saves a distributed checkpoint of each variant (state.checkpoint), the
# candidate loads it: the check has the same id on both sides, so compare shows its outcome.
rm -rf "$out/checkpoint"
declare -A checkpoint=([old]="--save-checkpoint" [new]="--load-checkpoint")
for side in old new; do
  constraints=${!side}
  python3 -m venv ".venv-gate-$side"
  ".venv-gate-$side/bin/pip" install -q -c "$constraints" -e ".[test]"
  # A failing check must not stop the gate: compare reports it as a regression.
  ".venv-gate-$side/bin/fsdp-conformance" run --lane cpu --out "$out/$side" \
    "${checkpoint[$side]}" "$out/checkpoint" "$@" || true
done
set +e
.venv-gate-new/bin/fsdp-conformance compare "$out/old/report.json" "$out/new/report.json" \
  | tee "$out/compare.txt"
status=${PIPESTATUS[0]}
.venv-gate-new/bin/fsdp-conformance compare --json "$out/old/report.json" \
  "$out/new/report.json" > "$out/compare.json"
exit "$status"
