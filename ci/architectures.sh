#!/usr/bin/env bash
# The whole run (`fsdp-conformance run --model ...` and nothing else, `--input` where the forward
# takes no token ids) on each transformers architecture of fsdp_conformance/hf_models.py: the
# three reference models and ARCHITECTURES (decoders, tied decoders, an encoder, an
# encoder-decoder, a vision model, mixtures of experts). One report folder per model under
# $OUT (default fsdp-conformance-report/architectures), and a table: outcomes and wall seconds.
# The README's "Hugging Face models" figures come from this script.
# Usage: ci/architectures.sh [NAME ...] (default: every one); environment: PYTHON, OUT.
# Exit status: 0 when every run passed (no failure, no error), 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
OUT=${OUT:-fsdp-conformance-report/architectures}
mkdir -p "$OUT"
list=$("$PYTHON" -c '
import sys
from fsdp_conformance import hf_models as h
names = sys.argv[1:] or [*h.FACTORIES, *h.ARCHITECTURES]
for name in names:
    if name in h.FACTORIES:
        print(name, "-")
    elif name in h.ARCHITECTURES:
        print(name, h.ARCHITECTURES[name][1] or "-")
    else:
        sys.exit(f"architectures.sh: unknown model {name!r}; choose from "
                 + ", ".join([*h.FACTORIES, *h.ARCHITECTURES]))
' "$@") || exit 2
mapfile -t rows <<<"$list"
status=0
printf '%-10s %-72s %s\n' model "passed / failed / skipped / errors / expected failures" wall
for row in "${rows[@]}"; do
  read -r name input <<<"$row"
  args=(run --model "fsdp_conformance.hf_models:$name" --out "$OUT/$name")
  [[ $input != - ]] && args+=(--input "$input")
  start=$SECONDS
  "$PYTHON" -m fsdp_conformance.cli "${args[@]}" >"$OUT/$name.log" 2>&1 || status=1
  summary=$(grep -E '^[0-9]+ passed, ' "$OUT/$name.log" | tail -n 1)
  printf '%-10s %-72s %ss\n' "$name" "${summary:-no summary: see $OUT/$name.log}" \
    "$((SECONDS - start))"
done
exit $status
