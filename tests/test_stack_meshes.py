"""``stack.meshes.hsdp`` / ``stack.meshes.replicated``: HSDP on a 2-D device mesh, FSDP1 and
FSDP2, against the slice-wise reference on the odd model (fp32).

World size 2 runs the (1, 2) and (2, 1) meshes, world size 4 the 2 x 2 mesh (and (1, 4)). On
torch 2.13 FSDP1 on the (2, 1) mesh never all-reduces across the replicas
(``expectations.toml``, pytorch/pytorch#154888): it runs for real here and must fail exactly
so. The negative control drops torch's all-reduce on a named group; the verdict's rules are
also failed one at a time on a clean run's values, in the parent.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from fsdp_conformance.claims import stack
from fsdp_conformance.claims.check import Check, expectation_for, run_check
from fsdp_conformance.claims.stack.meshes import STEPS
from fsdp_conformance.harness import Ranks

pytestmark = pytest.mark.cpu


def check_of(name: str, version: str) -> Check:
    return next(c for c in stack.CHECKS if c.name == name and c.params["version"] == version)


HSDP = {v: check_of("stack.meshes.hsdp", v) for v in ("fsdp1", "fsdp2")}
REPLICATED = {v: check_of("stack.meshes.replicated", v) for v in ("fsdp1", "fsdp2")}


@pytest.fixture(scope="module")
def shared_runs() -> dict[tuple[Any, ...], list[dict[str, Any]]]:
    """Every rank's values of a clean run, by (check, version, world size): the positive test and
    the parent-side negative controls judge the same values."""
    return {}


def clean(ranks: Ranks, check: Check, shared: dict[tuple[Any, ...], Any]) -> Any:
    key = (check.name, check.params["version"], ranks.world_size)
    if key not in shared:
        shared[key] = ranks.run(check.rank_fn, **check.params)
    return copy.deepcopy(shared[key])


@pytest.mark.parametrize(
    "check",
    [HSDP["fsdp2"], REPLICATED["fsdp2"], HSDP["fsdp1"]],
    ids=["fsdp2-(1,2)", "fsdp2-(2,1)", "fsdp1-(1,2)"],
)
def test_hsdp_trains_as_the_reference_with_replicas_equal(
    ranks: Ranks, check: Check, shared_runs: dict
) -> None:
    verdict = check.verdict(clean(ranks, check, shared_runs), check.params)
    assert verdict.passed, verdict.message
    # measured 0.0 on torch 2.13.0: the same sums in the same order at world size 2
    assert verdict.figures["update_rel_diff"] <= 1e-6
    assert verdict.figures["steps"] == STEPS and verdict.figures["dtype"] == "torch.float32"
    for label, issued in verdict.data.items():
        if "(2, 1)" in label:
            # every unit's gradient all-reduced across the world, no reduce-scatter (a one-rank
            # shard group)
            assert issued == {"all_reduce [0, 1]": 4}, (label, issued)
        else:
            # every unit reduce-scattered across the world; torch also all-reduces on the
            # one-rank replicate group (a no-op)
            assert issued == {"reduce_scatter [0, 1]": 4, "all_reduce [0]": 4}, (label, issued)
    if check.params["version"] == "fsdp1":
        assert verdict.figures["meshes"] == [
            "mesh (1, 2) HYBRID_SHARD",
            "mesh (1, 2) _HYBRID_SHARD_ZERO2",
        ]


def test_fsdp1_on_a_replicate_only_mesh_fails_exactly_where_an_expectation_names_it(
    ranks: Ranks,
) -> None:
    """FSDP1 HYBRID_SHARD on a (2, 1) mesh: the gradients all-reduced on the one-rank shard group
    only, never across the replicas; on any torch no expectation names, the check must pass."""
    check = REPLICATED["fsdp1"]
    verdict = run_check(ranks.configured(xfail=None), check)
    if expectation_for(ranks, check, check.params) is None:
        assert verdict.passed, (
            "fails on a torch no expectation names: record it in "
            "fsdp_conformance/expectations.toml\n" + verdict.message
        )
        return
    assert not verdict.passed
    for strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
        assert verdict.data[f"mesh (2, 1) {strategy}"] == {"all_reduce [0]": 4}
        assert f"mesh (2, 1) {strategy}: step 0: the replicas diverged" in verdict.message
        assert (
            f"mesh (2, 1) {strategy}: rank 1: step 0 backward: 0 all-reduce(s) on group [0, 1] "
            "for 4 units: the gradients were not reduced across the replicas"
        ) in verdict.message
    assert verdict.figures["update_rel_diff"] >= 0.3


def test_a_dropped_replica_all_reduce_fails(ranks: Ranks) -> None:
    check = REPLICATED["fsdp2"]
    values = ranks.run(check.rank_fn, **{**check.params, "fault": "dropped_all_reduce"})
    verdict = check.verdict(values, check.params)
    assert not verdict.passed
    assert "step 0: the replicas diverged" in verdict.message
    assert "the gradients were not reduced across the replicas" in verdict.message
    assert "update: " in verdict.message and verdict.figures["update_rel_diff"] >= 0.3
    assert verdict.data == {"mesh (2, 1) fully_shard": {}}


def test_each_rule_of_the_verdict_fails_on_its_own(ranks: Ranks, shared_runs: dict) -> None:
    """Parent-side controls on a clean run's values: one rank's parameters one bit off after a
    step (replicas), one update off the reference, a reduction on a group HSDP never uses."""
    check = HSDP["fsdp2"]
    split = clean(ranks, check, shared_runs)
    split[-1]["runs"][0]["digests"][1] = "0" * 64
    verdict = check.verdict(split, check.params)
    assert not verdict.passed
    assert verdict.message.endswith(
        "mesh (1, 2) fully_shard: step 1: the replicas diverged: the full parameters differ "
        f"across ranks (ranks holding the same values: {list(range(ranks.world_size - 1))}, "
        f"[{ranks.world_size - 1}])"
    )

    off = clean(ranks, check, shared_runs)
    off[0]["runs"][0]["updates"][0].update(max_rel=0.5, worst="head.weight")
    verdict = check.verdict(off, check.params)
    assert not verdict.passed and "replicas" not in verdict.message
    assert "rank 0: step 0 update: head.weight differs from the reference by 5.00e-01" in (
        verdict.message
    )

    stray = clean(ranks, check, shared_runs)
    stray[0]["runs"][0]["reductions"][0].append("all_reduce [0, 1, 2]")
    verdict = check.verdict(stray, check.params)
    assert not verdict.passed
    assert "step 0 backward: gradient reductions on other groups: all_reduce [0, 1, 2]" in (
        verdict.message
    )


@pytest.mark.world_size(4)
def test_a_2x2_mesh_trains_as_the_reference_and_reduces_on_both_groups(ranks: Ranks) -> None:
    """FSDP2 on the 2 x 2 mesh (replicate x shard) and on (1, 4); then the same values with the
    replicas' all-reduces removed from one rank's record fail the collectives rule."""
    check = HSDP["fsdp2"]
    values = ranks.run(check.rank_fn, **check.params)
    verdict = check.verdict(values, check.params)
    assert verdict.passed, verdict.message
    # measured 6.6e-8 on torch 2.13.0 (the sums' order differs across two groups)
    assert verdict.figures["update_rel_diff"] <= 1e-6
    assert verdict.data == {
        "mesh (2, 2) fully_shard": {"reduce_scatter [0, 1]": 4, "all_reduce [0, 2]": 4},
        "mesh (1, 4) fully_shard": {"reduce_scatter [0, 1, 2, 3]": 4, "all_reduce [0]": 4},
    }
    run = values[3]["runs"][0]
    assert (run["shard_group"], run["replicate_group"]) == ([2, 3], [1, 3])
    run["reductions"][0] = [r for r in run["reductions"][0] if not r.startswith("all_reduce")]
    verdict = check.verdict(values, check.params)
    assert not verdict.passed
    assert verdict.message.endswith(
        "mesh (2, 2) fully_shard: rank 3: step 0 backward: 0 all-reduce(s) on group [1, 3] for 4 "
        "units: the gradients were not reduced across the replicas"
    )
