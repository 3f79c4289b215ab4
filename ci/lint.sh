#!/usr/bin/env bash
# The habits the tools enforce (docs/architecture.md), one list for .ci/run and `tox -e lint`:
# ruff's rules, ruff's formatting, mypy strict on the package, and pylint's repetition check
# (its only enabled rule, [tool.pylint] in pyproject.toml). Every step runs, so one CI log shows
# every broken habit; the exit status is non-zero when any step failed, and the last line names
# the failed steps. The tools are the ones of $PYTHON (default: the python on PATH, the active
# venv's), installed by `pip install -c ci/constraints-cpu.txt -e ".[lint]"`.
# Usage: ci/lint.sh
set -uo pipefail

cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python}
PATHS=(fsdp_conformance tests benchmarks conftest.py)
failed=()

step() {
    local name=$1 start=$SECONDS status=0
    shift
    echo "== lint: $name: $*"
    "$PYTHON" -m "$@" || status=$?
    echo "== lint: $name: exit $status in $((SECONDS - start)) s"
    if ((status)); then
        failed+=("$name")
    fi
}

step ruff-check ruff check "${PATHS[@]}"
step ruff-format ruff format --check "${PATHS[@]}"
step mypy mypy fsdp_conformance
step repetition pylint fsdp_conformance

if ((${#failed[@]})); then
    echo "lint failed: ${failed[*]}" >&2
    exit 1
fi
echo "lint passed: ruff-check ruff-format mypy repetition"
