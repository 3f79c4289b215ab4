#!/usr/bin/env bash
# One-shot GPU check for a session with a single CUDA device (e.g. one H200): the gpu lane's
# tests at world size 1, the memory benchmark's GPU figures and a conformance report, all
# written under $OUT (default: gpu-out). torch with CUDA must already be installed.
#
# Usage: OUT=/some/dir bash ci/gpu-check.sh
#
# At world size 1 the tests marked world_size(2, ...) skip with the reason "needs 2 CUDA
# devices"; FSDP1 memory claims skip because FSDP1 runs NO_SHARD at one rank. Every step runs
# even if an earlier one failed; the exit status is the first failure's.
set -o pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-out}"
mkdir -p "$OUT"
status=0
step() {  # step NAME CMD...: run, log to $OUT/NAME.txt, remember the first failure
  local name=$1
  shift
  echo "== $name: $*" | tee -a "$OUT/steps.txt"
  "$@" 2>&1 | tee "$OUT/$name.txt"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc" | tee -a "$OUT/steps.txt"
  if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
  return 0
}

{
  python -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'devices', torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-', \
'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else '-', 'python', sys.version.split()[0])"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
} 2>&1 | tee "$OUT/environment.txt"

# A machine without network: fall back to the package alone on what is installed (plots and
# the torch-free extras may then be missing; the report says so).
install() {
  pip install -q -e ".[test,plot]" \
    || { echo "full install failed; installing the package alone (no deps, no isolation)"; \
         pip install -q --no-deps --no-build-isolation -e .; }
}
step install install
# -rs: every skip with its reason (world size 2+ tests; FSDP1 memory claims at one rank).
step pytest-gpu python -m pytest -m gpu -q -rs -p no:cacheprovider --fsdp-world-sizes 1
step bench-memory python benchmarks/bench_memory.py --world-size 1 --plot "$OUT/memory_timeline.png"
step report fsdp-conformance run --lane gpu --world-sizes 1 --out "$OUT/report" --plot
exit "$status"
