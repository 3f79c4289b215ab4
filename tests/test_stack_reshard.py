"""``stack.reshard``: explicit resharding options (FSDP2 ``reshard_after_forward``, FSDP1
``sharding_strategy``) trained against the reference, with what torch did observed; and their
negative controls, faults injected on the ranks (``claims/stack/reshard.py`` ``FAULTS``)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from fsdp_conformance.claims import stack
from fsdp_conformance.claims.check import Check, Verdict, run_check
from fsdp_conformance.harness import Ranks

pytestmark = pytest.mark.cpu

AFTER_FORWARD = next(c for c in stack.CHECKS if c.name == "stack.reshard.after_forward")
STRATEGIES = next(c for c in stack.CHECKS if c.name == "stack.reshard.strategies")


#: The settings the FSDP2 faults are judged on (the run's cost is per setting): one that
#: reshards every unit, one that keeps every unit gathered.
FAULT_SETTINGS = ("root=True blocks=True", "root=False blocks=False")


def with_fault(ranks: Ranks, check: Check, fault: str, **params: Any) -> Verdict:
    params = {**check.params, **params}
    return check.verdict(ranks.run(check.rank_fn, **params, fault=fault), params)


@pytest.fixture(scope="module")
def shared_runs() -> dict[tuple[Any, ...], list[dict[str, Any]]]:
    """Every rank's values of one clean ``after_forward`` run per (device type, world size): the
    positive test and the parent-side negative control judge the same values."""
    return {}


def clean_values(ranks: Ranks, shared: dict[tuple[Any, ...], Any]) -> list[dict[str, Any]]:
    key = (ranks.device_type, ranks.world_size)
    if key not in shared:
        shared[key] = ranks.run(AFTER_FORWARD.rank_fn, **AFTER_FORWARD.params)
    return shared[key]


def test_reshard_after_forward_is_what_each_explicit_setting_says(
    ranks: Ranks, shared_runs: dict
) -> None:
    verdict = AFTER_FORWARD.verdict(clean_values(ranks, shared_runs), AFTER_FORWARD.params)
    assert verdict.passed, verdict.message
    world = ranks.world_size
    data = verdict.data
    # An explicit True on the root reshards it (torch 2.13): gathered again in backward.
    assert data["root=True blocks=True"]["held_after_forward"][""] == world
    assert data["root=True blocks=True"]["backward_gather_groups"][""] == [world]
    assert data["root=True blocks=None"]["backward_all_gathers"]
    # Not passed on the root: kept; False on the blocks: no all-gather in backward at all.
    assert data["root=False blocks=False"]["backward_all_gathers"] == {}
    # The integer 1 keeps parameters unsharded (False), the world size reshards (True).
    assert set(data["root=1 blocks=1"]["held_after_forward"].values()) == {1}
    assert set(data[f"root={world} blocks={world}"]["held_after_forward"].values()) == {world}


def test_a_backward_all_gather_over_another_group_than_the_reshard_fails(
    ranks: Ranks, shared_runs: dict
) -> None:
    # Parent side, on the clean run's values: the root's backward all-gather under root=True
    # made to span one rank fewer than it was resharded to (as a gather over the full world
    # after an integer reshard_after_forward would read at world size 4).
    values = copy.deepcopy(clean_values(ranks, shared_runs))
    for value in values:
        groups = value["runs"][0]["gather_groups"][0]
        assert groups[""] == [ranks.world_size], groups
        groups[""] = [ranks.world_size - 1]
    verdict = AFTER_FORWARD.verdict(values, AFTER_FORWARD.params)
    assert not verdict.passed
    assert (
        f"root=True blocks=True: backward 0: unit '' all-gathered over [{ranks.world_size - 1}] "
        f"rank(s), not the [{ranks.world_size}]"
    ) in verdict.message
    assert "update" not in verdict.message


def test_sharding_strategies_train_and_issue_their_own_collectives(ranks: Ranks) -> None:
    verdict = run_check(ranks, STRATEGIES)
    assert verdict.passed, verdict.message
    data = verdict.data
    assert data["SHARD_GRAD_OP"]["backward_all_gathers"] == {}
    assert data["NO_SHARD"]["backward_reductions"]["reduce_scatter"] == {}
    assert data["NO_SHARD"]["backward_reductions"]["all_reduce"]
    assert data["FULL_SHARD"]["backward_all_gathers"]


def test_a_dropped_reshard_option_fails_on_what_stays_gathered(ranks: Ranks) -> None:
    verdict = with_fault(ranks, AFTER_FORWARD, "option_dropped", only=FAULT_SETTINGS)
    assert not verdict.passed
    assert "after forward 0, unit '' is sharded over 1 rank(s), not 2" in verdict.message
    assert "all_gather(s)" in verdict.message
    assert "update" not in verdict.message, "the numbers agree; only what torch did differs"


def test_a_wrong_parameter_after_a_reshard_fails_on_the_updates(ranks: Ranks) -> None:
    verdict = with_fault(ranks, AFTER_FORWARD, "wrong_after_reshard", only=FAULT_SETTINGS)
    assert not verdict.passed
    assert "root=True blocks=True: step 0 update" in verdict.message
    assert "differs from the reference" in verdict.message
    # a setting that keeps every unit gathered is untouched by it
    assert "root=False blocks=False: step" not in verdict.message


def test_a_dropped_sharding_strategy_fails_on_the_collectives(ranks: Ranks) -> None:
    verdict = with_fault(ranks, STRATEGIES, "strategy_dropped")
    assert not verdict.passed
    assert "SHARD_GRAD_OP: backward 0:" in verdict.message
    assert "NO_SHARD: backward 0: 0 all_reduce(s)" in verdict.message
    assert "FULL_SHARD" not in verdict.message
    assert "update" not in verdict.message
