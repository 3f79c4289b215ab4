"""``wrap.builders.size_boundary``: the size rule at its boundary.

A module whose not-yet-wrapped parameters number exactly ``min_num_params`` is a unit, its
sibling of one fewer is not: under torch's ``size_based_auto_wrap_policy`` and under the suite's
recommended policy, on the units FSDP1 built and FSDP2 built from the plan. Negative controls: a
torch comparing with ``>`` (fault ``strict_size_policy``) and the recommended policy off by one
(fault ``recommended_off_by_one``) both fail, naming the boundary modules.

Rank calls: one clean run per FSDP version (kept for the parent-side controls) and one per fault
and version: six, on a model of 6,918 parameters.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from fsdp_conformance.claims import all_checks
from fsdp_conformance.claims.check import run_check
from fsdp_conformance.claims.wrap import CHECKS
from fsdp_conformance.claims.wrap.builders import (
    FAULTS,
    builder_policy,
    documented_unit_modules,
    rank_builders_size_boundary,
    verdict_builders_size_boundary,
)
from fsdp_conformance.claims.wrap.common import expected_units
from fsdp_conformance.gate.suite import select_checks
from fsdp_conformance.harness import RankContext, Ranks
from fsdp_conformance.models import policies
from fsdp_conformance.models.reference_models import (
    BOUNDARY_MIN_PARAMS,
    DecoderLayer,
    SizeBoundaryModel,
)
from fsdp_conformance.models.units import plan_units

pytestmark = pytest.mark.cpu

NAME = "wrap.builders.size_boundary"
CHECK = {c.params["version"]: c for c in CHECKS if c.name == NAME}
BLOCKS = (DecoderLayer,)
CTX = RankContext(rank=0, world_size=2, local_rank=0, backend="gloo", device_type="cpu")


def _plans(model: SizeBoundaryModel) -> dict[str, set[str]]:
    """The units each rule plans on ``model`` (no process group), by FQN."""
    size = builder_policy("size", model, BLOCKS, BOUNDARY_MIN_PARAMS, model.head)
    recommended = policies.policy("recommended", model, BLOCKS, BOUNDARY_MIN_PARAMS)
    return {
        "size": {u.fqn for u in plan_units(model, size)},
        "recommended": {u.fqn for u in plan_units(model, recommended)},
    }


# --------------------------------------------------------------------------------------------
# The model and the expectations (no ranks)
# --------------------------------------------------------------------------------------------


def test_the_model_sits_on_the_boundary_and_runs() -> None:
    model = SizeBoundaryModel()
    own = {n: sum(p.numel() for p in m.parameters(recurse=False)) for n, m in model.named_modules()}
    assert BOUNDARY_MIN_PARAMS == 169
    assert (own["at"], own["below"]) == (169, 168)
    # The gated pair: what is left once its proj (a unit of its own) is wrapped.
    assert (own["gated_at"], own["gated_below"]) == (169, 168)
    assert own["gated_at.proj"] >= 169 and own["gated_below.proj"] >= 169
    # Nothing else is near the threshold: a off-by-one there would not be the boundary's.
    others = {n: v for n, v in own.items() if v and n not in {*model.AT, *model.BELOW}}
    assert all(abs(v - 169) > 10 for v in others.values()), others
    assert model(torch.randn(2, 8, 12)).shape == (2, 8, 3)


def test_expected_units_and_both_plans_put_the_exact_size_in_and_one_fewer_out() -> None:
    model = SizeBoundaryModel()
    documented, _ = documented_unit_modules("size", model, BLOCKS, BOUNDARY_MIN_PARAMS, model.head)
    claim = {u.fqn for u in expected_units(model, BLOCKS, BOUNDARY_MIN_PARAMS)}
    plans = _plans(model)
    for units in (set(documented), claim, *plans.values()):
        assert {"at", "gated_at"} <= units and not {"below", "gated_below"} & units, units
    assert plans["size"] == {"", *documented} and plans["recommended"] == claim


def test_the_faults_move_the_boundary_in_the_plan_and_are_restored() -> None:
    # In this process, no ranks: each fault moves exactly what it names, for its duration.
    with FAULTS.inject("strict_size_policy", CTX):
        strict = _plans(SizeBoundaryModel())
    with FAULTS.inject("recommended_off_by_one", CTX):
        off_by_one = _plans(SizeBoundaryModel())
    clean = _plans(SizeBoundaryModel())
    assert strict == {rule: units - {"at", "gated_at"} for rule, units in clean.items()}
    assert off_by_one == {
        "size": clean["size"],
        "recommended": clean["recommended"] - {"at", "gated_at"},
    }


def test_the_check_is_registered_for_both_versions_and_selected_by_run() -> None:
    assert sorted(CHECK) == ["fsdp1", "fsdp2"]
    chosen = select_checks(all_checks(), None, "size_boundary")
    assert [(c.name, p["version"]) for c, p in chosen] == [(NAME, "fsdp1"), (NAME, "fsdp2")]


# --------------------------------------------------------------------------------------------
# On ranks: what FSDP built
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared_runs() -> dict[tuple[Any, ...], list[Any]]:
    """Every rank's values of one clean run per (world size, version)."""
    return {}


def clean_values(ranks: Ranks, shared: dict[tuple[Any, ...], list[Any]], version: str) -> Any:
    key = (ranks.world_size, version)
    if key not in shared:
        shared[key] = ranks.run(rank_builders_size_boundary, version=version)
    return shared[key]


@pytest.mark.world_size(2)
@pytest.mark.parametrize("version", ["fsdp1", "fsdp2"])
def test_exact_size_wrapped_one_fewer_not_on_every_rank(
    ranks: Ranks, shared_runs: dict[tuple[Any, ...], list[Any]], version: str
) -> None:
    values = clean_values(ranks, shared_runs, version)
    verdict = verdict_builders_size_boundary(values, CHECK[version].params)
    assert verdict.passed, verdict.message
    assert verdict.message.startswith("at min_num_params 169: at, gated_at (exactly")
    assert dict(verdict.figures) == {"min_params": 169, "size_units": 8, "recommended_units": 7}
    for v in values:
        for rule in ("size", "recommended"):
            built = {u["fqn"]: u["numel"] for u in v["rules"][rule]["actual"]}
            assert built["at"] == 169 and built["gated_at"] == 169, built
            assert "below" not in built and "gated_below" not in built, built
            # What torch asked the rule: exactly the threshold, and one fewer.
            asked = v["rules"][rule]["asked"]
            assert asked == {"at": 169, "gated_at": 169, "below": 168, "gated_below": 168}
    # The check as `run` runs it, on the same ranks (warm): the same outcome.
    assert run_check(ranks, CHECK[version]).passed


@pytest.mark.world_size(2)
def test_negative_control_one_rank_reporting_the_wrong_side_fails(
    ranks: Ranks, shared_runs: dict[tuple[Any, ...], list[Any]]
) -> None:
    values = copy.deepcopy(clean_values(ranks, shared_runs, "fsdp1"))
    # Rank 1 says the recommended policy made the one-fewer sibling a unit.
    row = {"fqn": "below", "cls": "Linear", "numel": 168, "parent": "", "params": ["below.weight"]}
    values[1]["rules"]["recommended"]["actual"].append(row)
    verdict = verdict_builders_size_boundary(values, CHECK["fsdp1"].params)
    assert not verdict.passed
    assert "the size rule misses its boundary (recommended)" in verdict.message
    assert (
        "! boundary module below (168 parameters not yet wrapped, one fewer than min_num_params "
        "169) is a unit as torch built" in verdict.message
    )
    assert "rank 1 (fsdp1): the suite's recommended policy" in verdict.message
    assert "rank 0" not in verdict.message


@pytest.mark.world_size(2)
@pytest.mark.parametrize("version", ["fsdp1", "fsdp2"])
def test_negative_control_torch_comparing_strictly_above_fails_both_rules(
    ranks: Ranks, version: str
) -> None:
    values = ranks.run(rank_builders_size_boundary, version=version, fault="strict_size_policy")
    verdict = verdict_builders_size_boundary(values, CHECK[version].params)
    assert not verdict.passed
    message = verdict.message
    assert message.startswith("the size rule misses its boundary (size, recommended):")
    # Told once for both ranks (they agree), per rule.
    assert f"ranks 0, 1 ({version}): torch's size_based_auto_wrap_policy" in message
    assert f"ranks 0, 1 ({version}): the suite's recommended policy" in message
    assert message.count("expected units:") == 2
    assert (
        "! boundary module at (169 parameters not yet wrapped, exactly min_num_params 169) is "
        "not a unit as torch built: the size rule wraps when nonwrapped_numel >= min_num_params"
    ) in message
    assert "- missing unit at (Linear, 169 params)" in message
    assert "- missing unit gated_at (Gated, 169 params)" in message
    assert "expected units:" in message and "actual units:" in message  # the trees
    # Torch was still asked about exactly the threshold: the comparison moved, not the model.
    assert values[0]["rules"]["size"]["asked"]["at"] == 169


@pytest.mark.world_size(2)
def test_negative_control_the_recommended_policy_off_by_one_fails_it_alone(ranks: Ranks) -> None:
    values = ranks.run(rank_builders_size_boundary, version="fsdp2", fault="recommended_off_by_one")
    verdict = verdict_builders_size_boundary(values, CHECK["fsdp2"].params)
    assert not verdict.passed
    message = verdict.message
    assert message.startswith("the size rule misses its boundary (recommended):")
    assert "torch's size_based_auto_wrap_policy" not in message  # torch's builder still right
    assert "ranks 0, 1 (fsdp2): the suite's recommended policy (its size rule outside" in message
    assert "! boundary module gated_at (169 parameters not yet wrapped" in message
    assert "- missing unit at (Linear, 169 params)" in message
