#!/usr/bin/env bash
# The GPU lane on a CUDA runner: picks the torch, installs the package and its test
# dependencies beside it, then runs ci/gpu-check.sh (the gpu tests at world size 1 and every
# power of two up to the device count, the conformance report, the memory benchmark, the
# torchrun tests), which writes everything to $OUT whether the tests pass or fail.
#
# Usage: [TORCH_SPEC='torch==2.13.0'] [PYTHON=python3] [OUT=DIR] bash ci/gpu-lane.sh [PYTEST_ARGS...]
#
# Which torch:
#   - TORCH_SPEC unset: the runner's own, when $PYTHON (default python3) imports a torch that
#     sees a CUDA device. Nothing large is downloaded: a venv kept under $GPU_VENV_ROOT (one
#     per interpreter), which sees the runner's site-packages through a .pth file (also those
#     of a venv the runner's python lives in), gets the package and its small dependencies.
#     No such torch: refuses (exit 2, one line) and says to set TORCH_SPEC.
#   - TORCH_SPEC set (a pip requirement: torch==2.13.0; TORCH_INDEX_URL, when set, is given
#     to pip as --extra-index-url for the CUDA wheels): that torch, in a venv kept per spec
#     under $GPU_VENV_ROOT, so it is downloaded once, not on every run. Refused (exit 2)
#     before any download when nvidia-smi lists no GPU.
#   GPU_VENV_ROOT defaults to ${XDG_CACHE_HOME:-~/.cache}/fsdp-conformance: outside the
#   checkout, which CI cleans.
#
# OUT defaults to fsdp-conformance-report/gpu (what the workflow uploads). The exit status is
# the worst of the install's and gpu-check's (see ci/gpu-check.sh for what it writes).
set -uo pipefail
# PYTHON and OUT given as relative paths are the caller's, not the repository root's.
caller=$PWD
case "${PYTHON:-}" in /* | "") ;; */*) PYTHON="$caller/$PYTHON" ;; esac
case "${OUT:-}" in /* | "") ;; *) OUT="$caller/$OUT" ;; esac
cd "$(dirname "$0")/.." || exit 2

die() {  # one line on stderr, exit 2
  echo "gpu-lane: $*" >&2
  exit 2
}

PY="${PYTHON:-python3}"
export OUT="${OUT:-fsdp-conformance-report/gpu}"
venvs="${GPU_VENV_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/fsdp-conformance}"

if [ -n "${TORCH_SPEC:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    die "nvidia-smi lists no GPU; refusing to install $TORCH_SPEC for a lane that needs one"
  fi
  venv="$venvs/venv-$(printf %s "$TORCH_SPEC" | tr -c 'A-Za-z0-9._=-' '_')"
  runner_site=""
  requirements=("$TORCH_SPEC")
  if [ -n "${TORCH_INDEX_URL:-}" ]; then requirements+=(--extra-index-url "$TORCH_INDEX_URL"); fi
else
  probe=$("$PY" -c '
import hashlib, sys
version = f"{sys.version_info[0]}.{sys.version_info[1]}"
tag = f"{version} py{version}-" + hashlib.sha1(sys.prefix.encode()).hexdigest()[:8]
try:
    import torch
except BaseException as exc:
    text = (str(exc).splitlines() or [""])[0]
    print("no", f"cannot import torch ({type(exc).__name__}: {text})")
    sys.exit(0)
if not torch.cuda.is_available():
    print("no", f"its torch {torch.__version__} (CUDA build: {torch.version.cuda}) sees no CUDA "
          f"device, torch.cuda.device_count() is {torch.cuda.device_count()}")
else:
    print("ok", tag)
' 2>/dev/null | tail -n 1)
  case "$probe" in
    ok\ *) ;;
    no\ *) die "$PY: ${probe#no }; set TORCH_SPEC=torch==X.Y.Z (and TORCH_INDEX_URL for the" \
      "CUDA wheels) to install a pinned torch into a kept venv, or PYTHON to an interpreter" \
      "whose torch has CUDA" ;;
    *) die "could not run $PY to look for a torch with CUDA (it printed: ${probe:-nothing})" ;;
  esac
  read -r _ py_version tag <<<"$probe"
  venv="$venvs/venv-runner-$tag"
  # The runner's site folders as its interpreter sees them (its venv's, when it is in one,
  # which a venv made with --system-site-packages would not see), in a .pth of the new venv.
  runner_site=$("$PY" -c '
import site
dirs = list(site.getsitepackages())
if site.ENABLE_USER_SITE:
    dirs.append(site.getusersitepackages())
print("\n".join(dirs))
') || die "could not ask $PY for its site-packages folders"
  requirements=()
fi

mkdir -p "$venvs" || die "cannot make $venvs (GPU_VENV_ROOT)"
if [ ! -x "$venv/bin/python" ]; then
  "$PY" -m venv "$venv" || die "$PY could not make the venv $venv"
fi
if [ -n "$runner_site" ]; then
  pth="$venv/lib/python$py_version/site-packages/fsdp-conformance-runner-site.pth"
  if ! { mkdir -p "$(dirname "$pth")" && printf '%s\n' "$runner_site" >"$pth"; }; then
    die "could not write $pth"
  fi
fi
status=0
echo "gpu-lane: installing into $venv: ${requirements[*]} -e .[test,plot]"
"$venv/bin/python" -m pip install -q "${requirements[@]}" -e ".[test,plot]" || {
  status=$?
  echo "gpu-lane: pip install failed (exit $status); ci/gpu-check.sh says what is missing" >&2
}
PYTHON="$venv/bin/python" GPU_CHECK_INSTALL=0 bash ci/gpu-check.sh "$@"
rc=$?
if [ "$rc" -gt "$status" ]; then status=$rc; fi
exit "$status"
