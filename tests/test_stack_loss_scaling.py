"""The stack claim's ``stack.loss_scaling``: fp16 with loss scaling, FSDP1 ``ShardedGradScaler``
and FSDP2 ``torch.amp.GradScaler``, against a single-process scaler; and its negative controls
(faults injected on the ranks, ``claims/stack/loss_scaling.py`` ``FAULTS``)."""

from __future__ import annotations

from typing import Any

import pytest

from fsdp_conformance.claims import stack
from fsdp_conformance.claims.check import Check, Verdict
from fsdp_conformance.claims.stack import loss_scaling
from fsdp_conformance.harness import Ranks

pytestmark = pytest.mark.cpu

CHECKS = {c.params["version"]: c for c in stack.CHECKS if c.name == "stack.loss_scaling"}


def run_with(ranks: Ranks, check: Check, fault: str | None = None) -> tuple[Verdict, list[Any]]:
    values = ranks.run(check.rank_fn, **{**check.params, "fault": fault})
    return check.verdict(values, check.params), values


@pytest.mark.parametrize("version", sorted(CHECKS))
def test_an_inf_step_is_skipped_everywhere_and_the_scale_agrees(ranks: Ranks, version: str) -> None:
    verdict, values = run_with(ranks, CHECKS[version])
    assert verdict.passed, verdict.message
    poisoned = [s["poisoned"] for s in values[0]["steps"]]
    assert verdict.figures["skipped_steps"] == [i for i, p in enumerate(poisoned) if p]
    assert verdict.figures["scales"] == loss_scaling.expected_scales(poisoned)
    for v in values:
        assert [s["scale"] for s in v["steps"]] == verdict.figures["scales"]
    assert verdict.figures["update_rel_diff"] < loss_scaling.UPDATE_RTOL


@pytest.mark.parametrize("version", sorted(CHECKS))
def test_an_unsynchronised_found_inf_makes_the_ranks_disagree(ranks: Ranks, version: str) -> None:
    verdict, _ = run_with(ranks, CHECKS[version], "found_inf_not_synchronised")
    assert not verdict.passed
    assert f"step {loss_scaling.INF_SHARD_STEP} (shard): ranks disagree on skipping it" in (
        verdict.message
    )
    assert "the scale differs across ranks" in verdict.message


def test_a_frozen_scale_leaves_the_scale_unchanged(ranks: Ranks) -> None:
    verdict, _ = run_with(ranks, CHECKS["fsdp2"], "scale_frozen")
    assert not verdict.passed
    scale = loss_scaling.INIT_SCALE
    assert f"step 1: scale {scale} after update() (the reference scaler's {2 * scale})" in (
        verdict.message
    ), "the growth after two finite steps is missing"
    assert f"step {loss_scaling.INF_SHARD_STEP}: scale {scale} after update()" in verdict.message
    assert "ranks disagree" not in verdict.message, (
        "the skips are the scaler's step's, not update's"
    )
