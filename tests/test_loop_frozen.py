"""The loop claim's ``frozen`` family: a freeze list (a wholly frozen block, a unit mixing frozen
and trainable parameters) and parameters a step leaves unused, FSDP1 (``use_orig_params=True``)
and FSDP2, against the single-process reference.

Each check's clean run per version is made once (``shared_runs``) and judged by several tests;
the negative controls are faults of ``claims/loop/frozen.py``'s ``FAULTS``, injected on the
ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
from loop_runs import by_version, clean_run

from fsdp_conformance.claims.check import Check, Verdict
from fsdp_conformance.claims.loop import frozen
from fsdp_conformance.harness import Ranks
from fsdp_conformance.models.reference_models import BranchModel

pytestmark = pytest.mark.cpu


FROZEN = by_version("loop.frozen")
UNUSED = by_version("loop.frozen.unused")
#: The odd model's freeze list: all of the first block, the first weight of the second.
ODD_FROZEN = [
    "layers.0.attn.weight",
    "layers.0.attn.bias",
    "layers.0.mlp.0.weight",
    "layers.0.mlp.0.bias",
    "layers.0.mlp.2.weight",
    "layers.0.mlp.2.bias",
    "layers.1.attn.weight",
]
EXTRA = sorted(f"extra.{n}" for n, _ in BranchModel().extra.named_parameters())


@pytest.fixture(scope="module")
def shared_runs() -> dict[tuple[Any, ...], list[Any]]:
    """Every rank's values of one clean run per (check, device type, world size, version)."""
    return {}


def faulted(ranks: Ranks, check: Check, fault: str) -> Verdict:
    return check.verdict(ranks.run(check.rank_fn, **{**check.params, "fault": fault}), check.params)


@pytest.mark.parametrize("version", sorted(FROZEN))
def test_frozen_parameters_stay_and_their_units_never_reduce(
    ranks: Ranks, shared_runs: dict, version: str
) -> None:
    check = FROZEN[version]
    values = clean_run(ranks, shared_runs, check)
    verdict = check.verdict(values, check.params)
    assert verdict.passed, verdict.message
    data = verdict.data
    assert data["frozen"] == ODD_FROZEN
    assert data["frozen_units"] == ["layers.0"]
    assert data["mixed_units"] == ["layers.1"]
    for value in values:  # observed on every rank: one reduction per unit that trains
        assert value["frozen_changed"] == [[]] * frozen.STEPS
        assert value["frozen_grads"] == [{}] * frozen.STEPS
        for units in value["reduced"].values():
            assert len(units) == len(value["training_units"]) == 3, units
    if version == "fsdp2":  # the mixed unit reduces its trainable parameters only, by name
        assert all("layers.1" in units for units in data["reduced"].values())


@pytest.mark.parametrize("version", sorted(FROZEN))
def test_frozen_parameters_turned_back_on_after_wrapping_fail(ranks: Ranks, version: str) -> None:
    verdict = faulted(ranks, FROZEN[version], "frozen_updated")
    assert not verdict.passed
    assert "7 frozen parameter(s) changed" in verdict.message
    assert "differs from the reference" in verdict.message
    assert "gradient reduction(s) beyond one per unit that trains" in verdict.message
    assert verdict.figures["reduced_per_step"] == 4


def test_a_freeze_in_the_optimizer_only_fails_on_the_collectives(ranks: Ranks) -> None:
    verdict = faulted(ranks, FROZEN["fsdp2"], "frozen_unit_reduced")
    assert not verdict.passed
    assert "a unit holding only frozen parameters (layers.0" in verdict.message
    assert "frozen parameter(s) hold a gradient" in verdict.message
    assert "update" not in verdict.message and "changed" not in verdict.message, (
        "the numbers agree; the collectives and the gradients show it"
    )


@pytest.mark.parametrize("version", sorted(UNUSED))
def test_unused_parameters_get_no_gradient_and_the_updates_equal_the_reference(
    ranks: Ranks, shared_runs: dict, version: str
) -> None:
    check = UNUSED[version]
    values = clean_run(ranks, shared_runs, check)
    verdict = check.verdict(values, check.params)
    assert verdict.passed, verdict.message
    for value in values:
        # Step 1: rank 0 alone takes the adapter, so the reference gives it a gradient.
        assert value["unused"] == [[], [], sorted(["adapter.weight", *EXTRA])]
    kinds = verdict.data["unused_grad_kinds"]
    assert set(kinds) == {"adapter.weight", *EXTRA}
    assert all(set(k) <= {"none", "zero", "empty"} for k in kinds.values()), kinds
    # Step 2 runs no extra: its units hold no used parameter.
    assert "extra" not in set(verdict.data["used_units"][2])


def test_stale_gradients_on_unused_parameters_fail(ranks: Ranks) -> None:
    verdict = faulted(ranks, UNUSED["fsdp1"], "stale_gradients")
    assert not verdict.passed
    assert "no rank used hold a nonzero gradient" in verdict.message
    assert "adapter.weight" in verdict.message
    assert "update" in verdict.message


def test_a_model_with_fewer_than_two_blocks_freezes_nothing() -> None:
    model = BranchModel()
    assert frozen.freeze_list(model, (BranchModel,)) == []
    names = frozen.freeze_list(model, (type(model.extra),))
    assert names[-1] == "extra.attn.weight" and all(n.startswith("layers.0.") for n in names[:-1])
