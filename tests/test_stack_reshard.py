"""``stack.reshard``: explicit resharding options (FSDP2 ``reshard_after_forward``, FSDP1
``sharding_strategy``) trained against the reference, with what torch did observed; and their
negative controls, faults injected on the ranks (``claims/stack/reshard.py`` ``FAULTS``)."""

from __future__ import annotations

import pytest

from fsdp_conformance.claims import stack
from fsdp_conformance.claims.check import Check, Verdict, run_check
from fsdp_conformance.harness import Ranks

pytestmark = pytest.mark.cpu

AFTER_FORWARD = next(c for c in stack.CHECKS if c.name == "stack.reshard.after_forward")
STRATEGIES = next(c for c in stack.CHECKS if c.name == "stack.reshard.strategies")


def with_fault(ranks: Ranks, check: Check, fault: str) -> Verdict:
    return check.verdict(ranks.run(check.rank_fn, **{**check.params, "fault": fault}), check.params)


def test_reshard_after_forward_is_what_each_explicit_setting_says(ranks: Ranks) -> None:
    verdict = run_check(ranks, AFTER_FORWARD)
    assert verdict.passed, verdict.message
    world = ranks.world_size
    data = verdict.data
    # An explicit True on the root reshards it (torch 2.13): gathered again in backward.
    assert data["root=True blocks=True"]["held_after_forward"][""] == world
    assert data["root=True blocks=None"]["backward_all_gathers"]
    # Not passed on the root: kept; False on the blocks: no all-gather in backward at all.
    assert data["root=False blocks=False"]["backward_all_gathers"] == {}
    # The integer 1 keeps parameters unsharded (False), the world size reshards (True).
    assert set(data["root=1 blocks=1"]["held_after_forward"].values()) == {1}
    assert set(data[f"root={world} blocks={world}"]["held_after_forward"].values()) == {world}


def test_sharding_strategies_train_and_issue_their_own_collectives(ranks: Ranks) -> None:
    verdict = run_check(ranks, STRATEGIES)
    assert verdict.passed, verdict.message
    data = verdict.data
    assert data["SHARD_GRAD_OP"]["backward_all_gathers"] == {}
    assert data["NO_SHARD"]["backward_reductions"]["reduce_scatter"] == {}
    assert data["NO_SHARD"]["backward_reductions"]["all_reduce"]
    assert data["FULL_SHARD"]["backward_all_gathers"]


def test_a_dropped_reshard_option_fails_on_what_stays_gathered(ranks: Ranks) -> None:
    verdict = with_fault(ranks, AFTER_FORWARD, "option_dropped")
    assert not verdict.passed
    assert "after forward 0, unit '' is sharded over 1 rank(s), not 2" in verdict.message
    assert "all_gather(s)" in verdict.message
    assert "update" not in verdict.message, "the numbers agree; only what torch did differs"


def test_a_wrong_parameter_after_a_reshard_fails_on_the_updates(ranks: Ranks) -> None:
    verdict = with_fault(ranks, AFTER_FORWARD, "wrong_after_reshard")
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
