"""The loop claim: the training loop users write, against the single-process reference.

Each family's positive run on the reference models, FSDP1 and FSDP2, and its negative controls:
faults injected on the ranks (``claims/loop/<family>.py`` ``FAULTS``) that the check must catch.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdp_conformance.claims import loop
from fsdp_conformance.claims.check import Check, run_check
from fsdp_conformance.claims.loop import training
from fsdp_conformance.harness import Ranks
from fsdp_conformance.models import ModelSpec

pytestmark = pytest.mark.cpu


def by_version(name: str) -> dict[str, Check]:
    """The claim's check ``name``, one per FSDP version."""
    return {c.params["version"]: c for c in loop.CHECKS if c.name == name}


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


class Float32OnlyLayer(nn.Linear):
    """A layer whose kernel exists only in float32 (as transformers' grouped-mm experts)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float64:
            raise RuntimeError(
                "Expected mat_a to be Float32, BFloat16 or Float16 matrix, got Double"
            )
        return super().forward(x)


class Float32OnlyModel(nn.Module):
    """Two blocks of that layer and a head (the blocks: ``Float32OnlyLayer``)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Float32OnlyLayer(12, 12) for _ in range(2)])
        self.head = nn.Linear(12, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        out: torch.Tensor = self.head(x)
        return out


def test_a_model_without_float64_runs_the_loop_in_float32_and_says_why(ranks: Ranks) -> None:
    spec = ModelSpec(
        reference=None,
        factory=f"{__name__}:Float32OnlyModel",
        block_cls=(f"{__name__}.Float32OnlyLayer",),
    )
    check = NO_SYNC["fsdp2"]
    verdict = run_check(ranks, check, spec=spec)
    assert verdict.passed, verdict.message
    assert "in torch.float32, not float64" in verdict.message
    assert "got Double" in verdict.message
    assert verdict.figures["update_rel_diff"] <= training.UPDATE_RTOL[torch.float32]
