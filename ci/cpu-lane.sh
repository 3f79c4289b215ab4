#!/usr/bin/env bash
# The CPU lane: the conformance run on the reference models (gloo, world size 2), then the tests
# (the CPU lane, then the process lane).
# Usage: ci/cpu-lane.sh [extra args for `fsdp-conformance run`]
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-cpu
. .venv-cpu/bin/activate
pip install -q -c ci/constraints-cpu.txt -e ".[test]"
fsdp-conformance run --lane cpu --out fsdp-conformance-report/cpu "$@"
python -m pytest -m cpu
python -m pytest -m process
