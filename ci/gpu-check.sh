#!/usr/bin/env bash
# The GPU check: the gpu lane's tests, the conformance report, the memory benchmark's GPU
# figures and the launched (torchrun) tests, on every visible CUDA device, all written under
# $OUT whether they pass or fail.
#
# Usage: [PYTHON=python3] [OUT=DIR] [GPU_CHECK_INSTALL=0] bash ci/gpu-check.sh [--tests-only] [PYTEST_ARGS...]
#
#   PYTHON   the interpreter that runs everything, pip included ("$PYTHON -m pip"); default:
#            `python` on PATH, else `python3`. It must import a torch with CUDA.
#   OUT      where everything is written; default: a new folder per run,
#            fsdp-conformance-report/gpu-check-<UTC time>. What an earlier run left in $OUT
#            under the names below is removed first, so nothing stale passes for this run's.
#   GPU_CHECK_INSTALL  1 (default): "$PYTHON -m pip install -e .[test,plot]" first (offline:
#            falls back to the package alone, --no-deps); 0: use what is installed.
#   FSDP_CONFORMANCE_WORLD_SIZES  replaces the world sizes derived from the devices.
#   --tests-only  only the tests (what `tox -e gpu` runs); PYTEST_ARGS go to that pytest.
#
# Refuses, with one line on stderr and exit 2, before installing or writing anything when
# $PYTHON cannot import torch or sees no CUDA device (torch.cuda.is_available() and
# torch.cuda.device_count()): without a device every gpu test would skip and the lane would
# pass having run nothing. Refuses (exit 2) after the install when a test dependency
# (pytest-timeout, pytest-xdist, ...) does not import, naming it and the pip command.
#
# World sizes: 1 and every power of two up to the device count (1 device: 1; 4: 1,2,4; 8:
# 1,2,4,8). The torchrun step launches the largest of them.
#
# $OUT: steps.txt (each step and its exit status), environment.txt, install.txt, deps.txt,
# pytest-gpu.txt and junit-gpu.xml (the tests), report/ (report.json, summary.md,
# memory_timeline.png), bench-memory.txt and memory_timeline.png, launched.txt and torchrun/
# (each launched rank's stdout and stderr).
#
# Every step runs even when an earlier one failed; the exit status is the worst (highest)
# step's, 0 only when every step passed. Ctrl-C or SIGTERM: no step starts after the running
# one, exit 130 or 143.
set -uo pipefail
# PYTHON and OUT given as relative paths are the caller's, not the repository root's.
caller=$PWD
case "${PYTHON:-}" in /* | "") ;; */*) PYTHON="$caller/$PYTHON" ;; esac
case "${OUT:-}" in /* | "") ;; *) OUT="$caller/$OUT" ;; esac
cd "$(dirname "$0")/.." || exit 2

die() {  # one line on stderr, exit 2
  echo "gpu-check: $*" >&2
  exit 2
}

tests_only=0
if [ "${1:-}" = "--tests-only" ]; then
  tests_only=1
  shift
fi

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  PY=$(command -v python || command -v python3) \
    || die "no python on PATH; set PYTHON to the interpreter whose torch has CUDA"
fi

# What this interpreter's torch sees, before anything is installed or written.
probe=$("$PY" -c '
import sys
try:
    import torch
except BaseException as exc:
    text = (str(exc).splitlines() or [""])[0]
    print("no-torch", f"{type(exc).__name__}: {text}")
    sys.exit(0)
available = torch.cuda.is_available()
count = torch.cuda.device_count()
state = "ok" if available and count > 0 else "no-gpu"
print(state, count, torch.__version__, torch.version.cuda or "none", int(available))
' 2>/dev/null | tail -n 1)
read -r state ngpu torch_version torch_cuda cuda_available <<<"$probe"
case "${state:-}" in
  ok) ;;
  no-torch)
    die "$PY cannot import torch (${probe#no-torch }); install a CUDA build of torch for it," \
      "or set PYTHON to an interpreter that has one" ;;
  no-gpu)
    die "no GPU visible to $PY: torch $torch_version (CUDA build: $torch_cuda)," \
      "torch.cuda.is_available() is $([ "$cuda_available" = 1 ] && echo True || echo False)," \
      "torch.cuda.device_count() is $ngpu, CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-<unset>};" \
      "refusing to run the gpu lane, whose tests would all skip" ;;
  *) die "could not run $PY to ask torch for CUDA devices (it printed: ${probe:-nothing})" ;;
esac

if [ -n "${FSDP_CONFORMANCE_WORLD_SIZES:-}" ]; then
  sizes=$FSDP_CONFORMANCE_WORLD_SIZES
else
  sizes=1
  for ((s = 2; s <= ngpu; s *= 2)); do sizes="$sizes,$s"; done
fi
launch_ws=1
for ((s = 2; s <= ngpu; s *= 2)); do launch_ws=$s; done

OUT="${OUT:-fsdp-conformance-report/gpu-check-$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$OUT" || die "cannot make the output folder $OUT"
# (report.json and summary.md: where the earlier gpu-lane.sh wrote its report.)
(cd "$OUT" && rm -rf steps.txt environment.txt install.txt deps.txt pytest-gpu.txt \
  junit-gpu.xml report report.txt bench-memory.txt memory_timeline.png launched.txt torchrun \
  report.json summary.md)

status=0
interrupted=0  # 130 after SIGINT, 143 after SIGTERM: no step starts after either
trap 'interrupted=130' INT
trap 'interrupted=143' TERM
step() {  # step NAME CMD...: run, log to $OUT/NAME.txt, keep the worst exit status
  local name=$1
  shift
  [ "$interrupted" -eq 0 ] || return 0
  echo "== $name: $*" | tee -a "$OUT/steps.txt"
  "$@" 2>&1 | tee "$OUT/$name.txt"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc" | tee -a "$OUT/steps.txt"
  if [ "$rc" -gt "$status" ]; then status=$rc; fi
  return 0
}

{
  echo "python $PY"
  "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "devices", torch.cuda.device_count(),
[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
"nccl", torch.cuda.nccl.version())'
  echo "world sizes $sizes; torchrun world size $launch_ws"
  env | grep -E '^(CUDA_VISIBLE_DEVICES|NCCL_|TORCH_NCCL_|TORCH_DISTRIBUTED_DEBUG|PYTORCH_CUDA_ALLOC_CONF|FSDP_CONFORMANCE_)' | sort
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
} 2>&1 | tee "$OUT/environment.txt"

# shellcheck disable=SC2317  # called through step
install_deps() {
  "$PY" -m pip install -q -e ".[test,plot]" && return 0
  echo "full install failed (offline?); installing the package alone (no deps, no isolation)"
  "$PY" -m pip install -q --no-deps --no-build-isolation -e .
}
if [ "${GPU_CHECK_INSTALL:-1}" != 0 ]; then
  step install install_deps
fi

# Every module the tests need, imported by the interpreter that runs them. pytest-timeout
# matters most: without it the `timeout` marker is unknown and --strict-markers fails the
# whole session.
deps_check='
import importlib, sys
need = [("pytest", "pytest>=8"), ("pytest_timeout", "pytest-timeout>=2.3"),
        ("xdist", "pytest-xdist>=3.5"), ("numpy", "numpy"), ("fsdp_conformance", "-e .")]
if sys.version_info < (3, 11):
    need.append(("tomli", "tomli>=2"))
missing = []
for module, requirement in need:
    try:
        importlib.import_module(module)
    except Exception as exc:
        missing.append((module, requirement, (str(exc).splitlines() or [""])[0]))
if not missing:
    try:
        from importlib.metadata import entry_points
        names = {e.name for e in entry_points(group="pytest11")}
    except Exception:
        names = {"fsdp_conformance"}
    if "fsdp_conformance" not in names:
        missing.append(("fsdp_conformance", "-e .", "not installed: its pytest plugin is unknown"))
if missing:
    what = ", ".join(f"{r} (import {m}: {e})" for m, r, e in missing)
    reqs = " ".join(f"{chr(39)}{r}{chr(39)}" if r != "-e ." else "-e ." for _, r, _ in missing)
    python = sys.argv[1]
    print(f"gpu-check: missing test dependencies for {python}: {what}; install them "
          f"with: {python} -m pip install {reqs} (offline: pip download them where "
          "the index is reachable, then pip install --no-index --find-links DIR)")
    sys.exit(2)
print("test dependencies: all import")
'
if ! "$PY" -c "$deps_check" "$PY" >"$OUT/deps.txt" 2>&1; then
  echo "== deps: exit 2" >>"$OUT/steps.txt"
  line=$(grep -m 1 '^gpu-check: ' "$OUT/deps.txt")
  echo "${line:-gpu-check: $PY could not check the test dependencies: $(tail -n 1 "$OUT/deps.txt")}" >&2
  exit 2
fi

# -rs: every skip with its reason (FSDP1 memory claims at one rank, world sizes of markers
# above the device count).
step pytest-gpu "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider --fsdp-world-sizes "$sizes" \
  --junitxml "$OUT/junit-gpu.xml" "$@"
if [ "$tests_only" -eq 0 ]; then
  step report "$PY" -m fsdp_conformance.cli run --lane gpu --world-sizes "$sizes" \
    --out "$OUT/report" --plot
  step bench-memory "$PY" benchmarks/bench_memory.py --world-size 1 \
    --plot "$OUT/memory_timeline.png"
  # The launcher path: every launched process runs pytest and supervises its rank's child,
  # which runs the checks on NCCL; each rank's output lands in
  # $OUT/torchrun/<run id>/attempt_0/<rank>/.
  step launched "$PY" -m torch.distributed.run --standalone --nproc-per-node "$launch_ws" \
    --log-dir "$OUT/torchrun" --tee 3 \
    -m pytest -m gpu -q -rs -p no:cacheprovider --fsdp-world-sizes "$launch_ws" \
    tests/test_wrapping.py
fi

if [ "$interrupted" -ne 0 ]; then
  echo "gpu-check: interrupted (exit $interrupted); what ran is in $OUT" >&2
  exit "$interrupted"
fi
echo "gpu-check: exit $status (the worst step's; steps in $OUT/steps.txt)"
exit "$status"
