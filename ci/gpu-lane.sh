#!/usr/bin/env bash
# The GPU lane on a CUDA runner: the tests (NCCL, one device per rank), then the same checks
# under torchrun so that multi-GPU runners use the launcher's env:// process group.
# Usage: ci/gpu-lane.sh            (torch from the runner's environment, unpinned)
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-gpu
. .venv-gpu/bin/activate
pip install -q -e ".[test,plot]"
ngpu=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$ngpu" -lt 1 ]; then
  echo "gpu lane: no CUDA device on this runner (torch.cuda.device_count() == 0)" >&2
  exit 1
fi
sizes=$(python -c "n=$ngpu; print(','.join(str(s) for s in (1, 2, 4, 8) if s <= n))")
python -m pytest -m gpu --fsdp-world-sizes "$sizes"
fsdp-conformance run --lane gpu --world-sizes "$sizes" --out fsdp-conformance-report/gpu --plot
# The launcher path: every rank runs pytest in-process on torchrun's process group.
python -m torch.distributed.run --standalone --nproc-per-node "$ngpu" \
  -m pytest -m gpu -p no:cacheprovider -q tests/test_wrapping.py
