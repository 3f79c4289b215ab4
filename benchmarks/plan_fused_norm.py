"""The planner on Llama 2 13B with the norm torchtitan's published 13B run used (docs/planning.md,
"Against published runs"): the 13B preset with torchtitan's eager RMSNorm (``--norm eager``, the
presets' default) against its fused one (``--norm fused``), side by side, at torchtitan's
settings (64 ranks, local batch 2, sequence 4,096, reduce in fp32, its cross-entropy loss, 80
GiB devices, FSDP2 defaults, no activation checkpointing).

    python benchmarks/plan_fused_norm.py

Prints each plan's saved activations and total per rank, and what the planner says for 80 GiB.
The fused norm runs as an autograd function that saves what the Triton kernel saves (its input,
the weight and the reciprocal RMS: ``llama.RMSNorm(kind="fused")``).
"""

from __future__ import annotations

import contextlib
import io
import sys

from fsdp_conformance import cli

SETTINGS = [
    "--preset",
    "13b",
    "--world-size",
    "64",
    "--batch-size",
    "2",
    "--seq-len",
    "4096",
    "--reduce-dtype",
    "fp32",
    "--loss",
    "cross-entropy",
    "--device-memory",
    "80GiB",
    "--no-verify",
]


def plan_lines(norm: str) -> list[str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli.main(["plan", *SETTINGS, "--norm", norm])
    keep = ("saved activations", "activation working set", "total", "80.00 GiB:")
    return [line.strip() for line in out.getvalue().splitlines() if line.strip().startswith(keep)]


def main() -> int:
    for norm in ("eager", "fused"):
        print(f"Llama 2 13B, {norm} RMSNorm (--norm {norm})")
        for line in plan_lines(norm)[:4]:
            print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
