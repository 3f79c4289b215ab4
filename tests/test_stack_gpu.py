"""The stack claim on the GPU lane: NCCL ranks, one CUDA device each (``pytest -m gpu``).

What a CPU cannot show (docs/stack.md, "What only a GPU shows"): FSDP2's all-gathers and
reduce-scatters on their own CUDA streams overlapping compute (``stack.reshard``: the state after
forward and the backward all-gathers observed under stream overlap, parity included), NCCL's
hierarchical collectives on a 2-D mesh (``stack.meshes``), the fp16 scaler's CUDA kernel for the
found-inf check and unscale (``stack.loss_scaling``), and every other family (checkpointing's
recompute under FSDP's streams, compile) on the device. Every stack check runs here as it does on
gloo, judged by the same verdicts; a check that needs more ranks than the machine has devices is
skipped by the lane with the reason (one H200: world size 1 only, where the checks that need two
ranks skip, saying so).

On a machine without CUDA every test here is skipped with the reason (the plugin's lane check).
"""

from __future__ import annotations

import pytest

from fsdp_conformance.claims import stack
from fsdp_conformance.claims.check import Check, run_check
from fsdp_conformance.harness import Ranks

pytestmark = pytest.mark.gpu


def _check_id(check: Check) -> str:
    extra = [str(v) for k, v in sorted(check.params.items()) if k not in ("spec",)]
    return "-".join([check.name, *extra])


@pytest.mark.world_size(1, 2, 4)
@pytest.mark.parametrize("check", stack.CHECKS, ids=_check_id)
def test_every_stack_check_passes_on_nccl(ranks: Ranks, check: Check) -> None:
    verdict = run_check(ranks, check)
    assert verdict.passed, verdict.message


@pytest.mark.world_size(2)
@pytest.mark.parametrize("version", ["fsdp1", "fsdp2"])
def test_an_unsynchronised_found_inf_is_caught_on_cuda(ranks: Ranks, version: str) -> None:
    # The negative control of stack.loss_scaling on the device whose unscale kernel users run:
    # each rank's scaler deciding on its own found-inf must make the ranks disagree.
    check = next(
        c for c in stack.CHECKS if c.name == "stack.loss_scaling" and c.params["version"] == version
    )
    values = ranks.run(check.rank_fn, **{**check.params, "fault": "found_inf_not_synchronised"})
    verdict = check.verdict(values, check.params)
    assert not verdict.passed
    assert "ranks disagree on skipping it" in verdict.message
