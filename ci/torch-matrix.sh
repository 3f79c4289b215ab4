#!/usr/bin/env bash
# The supported torch range, measured: one environment per torch version, `fsdp-conformance
# run` in each, then one matrix of checks x versions (matrix.md, matrix.svg; and
# matrix-differing.md, only the checks that do not pass on every version, as the README shows
# it; matrix.json, the same as data, which ci/readme-matrix.py publishes). Not part of .ci/run:
# it installs a torch build per version (a CUDA wheel for all but the pinned CPU one).
# Usage: ci/torch-matrix.sh [VERSION...]
#   default versions: 2.6.0 2.8.0 2.10.0 2.12.1 2.13.0 2.14.1 2.15.0 (one per supported minor
#   that was measured; any version pip can install works)
# Environment: MATRIX_OUT (reports and matrix; default fsdp-conformance-report/matrix),
#   MATRIX_VENVS (one venv per version, kept for the next run; default .venv-matrix).
#   Extra `fsdp-conformance run` arguments go in MATRIX_RUN_ARGS (e.g. "--model pkg:build").
#   MATRIX_PUBLISH=1: when every version gave a report, publish the matrix as the README's and
#   docs/torch-matrix.md's table (ci/readme-matrix.py; tests/test_readme_figures.py holds them).
# Exit status: 0 when every version gave a report (whatever its outcomes: the matrix shows
# them), 1 when a version could not be installed or gave no report.
set -euo pipefail
cd "$(dirname "$0")/.."
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(2.6.0 2.8.0 2.10.0 2.12.1 2.13.0 2.14.1 2.15.0)
out=${MATRIX_OUT:-fsdp-conformance-report/matrix}
venvs=${MATRIX_VENVS:-.venv-matrix}
read -r -a run_args <<< "${MATRIX_RUN_ARGS:-}"
mkdir -p "$out" "$venvs"
reports=()
missing=()
renderer=""
for v in "${versions[@]}"; do
  env="$venvs/torch-$v"
  if ! "$env/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$v')" \
      2>/dev/null; then
    rm -rf "$env"
    python3 -m venv "$env"
    # This version only (the repository's constraints pin the CPU lane's 2.13.0): the suite is
    # installed against it, so pip never swaps the torch under test for another.
    echo "torch==$v" > "$env/constraints.txt"
    if ! PIP_CONSTRAINT="$env/constraints.txt" "$env/bin/pip" install -q -e . ; then
      echo "torch-matrix: torch $v could not be installed; its column is missing" >&2
      missing+=("$v")
      continue
    fi
  fi
  echo "torch-matrix: torch $v ..." >&2
  # A failing check must not stop the matrix: the report records it.
  "$env/bin/fsdp-conformance" run --lane cpu --no-plot --out "$out/torch-$v" \
    ${run_args[@]+"${run_args[@]}"} || true
  if [ -f "$out/torch-$v/report.json" ]; then
    reports+=("$out/torch-$v/report.json")
    renderer="$env/bin/fsdp-conformance"
  else
    echo "torch-matrix: torch $v wrote no report; its column is missing" >&2
    missing+=("$v")
  fi
done
[ ${#reports[@]} -gt 0 ] || { echo "torch-matrix: no report to render" >&2; exit 1; }
"$renderer" matrix "${reports[@]}" --out "$out" --differing > "$out/matrix-differing.md"
echo "torch-matrix: $out/matrix.md, $out/matrix.svg, $out/matrix-differing.md" \
  "(${#reports[@]} versions)" >&2
[ ${#missing[@]} -eq 0 ] || { echo "torch-matrix: missing: ${missing[*]}" >&2; exit 1; }
if [ "${MATRIX_PUBLISH:-0}" = 1 ]; then
  "$(dirname "$renderer")/python" ci/readme-matrix.py "$out/matrix.json"
fi
