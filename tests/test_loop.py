"""The loop claim: the training loop users write, against the single-process reference.

Each family's positive run on the reference models, FSDP1 and FSDP2, and its negative controls:
faults injected on the ranks (``claims/loop/<family>.py`` ``FAULTS``) that the check must catch.
"""

from __future__ import annotations

import pytest
import torch
from loop_runs import by_version
from torch import nn

from fsdp_conformance.claims.check import run_check
from fsdp_conformance.harness import CheckSkipped, Ranks
from fsdp_conformance.models.model_spec import ModelSpec

pytestmark = pytest.mark.cpu


NO_SYNC = by_version("loop.accumulation.no_sync")
SYNCED = by_version("loop.accumulation.synced")


@pytest.mark.parametrize("version", sorted(NO_SYNC))
def test_accumulation_without_sync_equals_the_reference_and_reduces_only_in_the_last(
    ranks: Ranks, version: str
) -> None:
    verdict = run_check(ranks, NO_SYNC[version])
    assert verdict.passed, verdict.message
    reduced = verdict.data["reduced"]
    trainable = verdict.data["trainable_units"]
    assert trainable, "the reference model has units that train"
    assert all(units == [] for phase, units in reduced.items() if not phase.endswith(".2"))
    assert all(len(units) == len(trainable) for p, units in reduced.items() if p.endswith(".2"))


@pytest.mark.parametrize("version", sorted(SYNCED))
def test_accumulation_into_existing_gradients_equals_the_reference(
    ranks: Ranks, version: str
) -> None:
    verdict = run_check(ranks, SYNCED[version])
    assert verdict.passed, verdict.message
    trainable = verdict.data["trainable_units"]
    assert all(len(units) == len(trainable) for units in verdict.data["reduced"].values())


@pytest.mark.parametrize("version", sorted(NO_SYNC))
@pytest.mark.parametrize("mode", ["no_sync", "synced"])
def test_a_dropped_micro_batch_gradient_fails(ranks: Ranks, version: str, mode: str) -> None:
    check = (NO_SYNC if mode == "no_sync" else SYNCED)[version]
    verdict = check.verdict(
        ranks.run(check.rank_fn, **{**check.params, "fault": "dropped_micro_batch"}), check.params
    )
    assert not verdict.passed
    assert "update" in verdict.message and "differs from the reference" in verdict.message


@pytest.mark.parametrize("version", sorted(NO_SYNC))
def test_a_no_sync_that_does_not_switch_sync_off_fails_on_the_collectives(
    ranks: Ranks, version: str
) -> None:
    check = NO_SYNC[version]
    verdict = check.verdict(
        ranks.run(check.rank_fn, **{**check.params, "fault": "sync_never_off"}), check.params
    )
    assert not verdict.passed
    assert "(no sync): " in verdict.message and "not expected here" in verdict.message
    assert "update" not in verdict.message, "the numbers agree; only the collectives differ"


class Bf16Layer(nn.Linear):
    """A block of a model built in bf16 (pure bf16 training, no fp32 master weights)."""


def bf16_model() -> nn.Module:
    """Two bf16 blocks and a bf16 head."""
    return nn.Sequential(Bf16Layer(12, 12), Bf16Layer(12, 12), nn.Linear(12, 7)).to(torch.bfloat16)


def test_a_model_built_in_bf16_skips_naming_the_dtype_and_the_fix(ranks: Ranks) -> None:
    spec = ModelSpec(
        reference=None, factory=f"{__name__}:bf16_model", block_cls=(f"{__name__}.Bf16Layer",)
    )
    with pytest.raises(CheckSkipped) as skipped:
        run_check(ranks.configured(skip=None), NO_SYNC["fsdp2"], spec=spec)
    assert "builds its parameters in torch.bfloat16: pass a factory that builds it in fp32" in str(
        skipped.value
    )
