"""The planner on Llama 2 13B with the norm torchtitan's published 13B run used (docs/planning.md,
"Against published figures"): the suite's reference Llama with its eager RMSNorm (``--preset
13b``) against the same model whose RMSNorm saves only what a fused kernel saves (its input, the
weight and the reciprocal RMS), side by side, at torchtitan's settings (64 ranks, local batch 2,
sequence 4,096, 80 GiB devices, FSDP2 defaults, no activation checkpointing).

    python benchmarks/plan_fused_norm.py

Prints each plan's saved activations and total per rank, and what the planner says for 80 GiB.
The fused norm is emulated on meta (an autograd function), not a Triton kernel.
"""

from __future__ import annotations

import contextlib
import io
import sys
from typing import Any

import torch

from fsdp_conformance import cli, reference_models


class _FusedRMSNorm(torch.autograd.Function):
    """RMSNorm that saves its input, weight and rstd only (as a fused kernel does)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rstd = x.float().pow(2).mean(-1, keepdim=True).add(eps).rsqrt()
        ctx.save_for_backward(x, weight, rstd)
        return (x.float() * rstd).type_as(x) * weight

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight, rstd = ctx.saved_tensors
        n = x.float() * rstd
        grad_weight = (grad.float() * n).sum(tuple(range(grad.dim() - 1))).to(weight.dtype)
        gn = grad.float() * weight.float()
        grad_x = rstd * (gn - n * (gn * n).mean(-1, keepdim=True))
        return grad_x.type_as(x), grad_weight, None


class FusedRMSNorm(reference_models.RMSNorm):
    """The reference norm, run as the fused kernel would."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _FusedRMSNorm.apply(x, self.weight, self.eps)  # type: ignore[no-untyped-call]
        return out


def fused_13b() -> torch.nn.Module:
    """The reference Llama 2 13B with every RMSNorm (both per block, and the final one) fused."""
    model = reference_models.LlamaModel(reference_models.LLAMA_PRESETS["13b"])
    for module in list(model.modules()):
        if type(module) is reference_models.RMSNorm:
            module.__class__ = FusedRMSNorm
    return model


SETTINGS = [
    "--world-size",
    "64",
    "--batch-size",
    "2",
    "--seq-len",
    "4096",
    "--device-memory",
    "80GiB",
    "--no-verify",
]


def plan_lines(model_args: list[str]) -> list[str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli.main(["plan", *model_args, *SETTINGS])
    keep = ("saved activations", "  total", "85.90 GB:")
    return [
        line
        for line in out.getvalue().splitlines()
        if line.startswith(keep) or line.strip().startswith(keep)
    ]


def main() -> int:
    for label, args in (
        ("eager RMSNorm (--preset 13b)", ["--preset", "13b"]),
        (
            "fused RMSNorm (torchtitan's 13B)",
            ["--model", f"{__name__}:fused_13b", "--block-cls", "LlamaBlock"],
        ),
    ):
        print(label)
        for line in plan_lines(args):
            print("  " + line.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
