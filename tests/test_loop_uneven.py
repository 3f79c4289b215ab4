"""``loop.uneven``: parameters whose dimension 0 does not divide by the world size, against the
single-process reference, FSDP1 and FSDP2, at world sizes 2 and 4; the negative control (the last
rank's largest shard read one element off) that the check must catch naming the parameter, and
the size checks' controls judged in the parent on a clean run's values with one size changed.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from loop_runs import by_version, clean_run

from fsdp_conformance.claims.check import Check, Verdict
from fsdp_conformance.claims.loop import uneven
from fsdp_conformance.harness import Ranks

pytestmark = pytest.mark.cpu

CHECK: dict[str, Check] = by_version("loop.uneven")
#: Every parameter of the odd model: no dimension 0 divides by 2 or 4.
PARAMETERS = 19


@pytest.fixture(scope="module")
def shared_runs() -> dict[tuple[Any, ...], list[Any]]:
    """Every rank's values of one clean run per (device type, world size, version): the
    positive test and the parent-side negative controls judge the same values."""
    return {}


def judge(values: list, version: str) -> Verdict:
    return CHECK[version].verdict(values, CHECK[version].params)


def test_the_world_size_implies_torch_chunk_sizes() -> None:
    # 13 rows over 2: 7 and 6; the one-element gain over 2: 1 and 0; 5 over 4: the last none.
    assert [uneven.rows_held(13, 2, r) for r in range(2)] == [7, 6]
    assert [uneven.rows_held(1, 2, r) for r in range(2)] == [1, 0]
    assert [uneven.rows_held(31, 4, r) for r in range(4)] == [8, 8, 8, 7]
    assert [uneven.rows_held(5, 4, r) for r in range(4)] == [2, 2, 1, 0]
    assert uneven.expected_flat(209, 2, 1) == (105, 1)
    assert uneven.expected_local([27, 13], 2, 1) == [13, 13]
    assert uneven.expected_local([], 2, 1) == []


@pytest.mark.world_size(2)
@pytest.mark.parametrize("version", sorted(CHECK))
def test_uneven_shards_have_the_implied_sizes_and_read_back_as_the_reference(
    ranks: Ranks, shared_runs: dict, version: str
) -> None:
    verdict = judge(clean_run(ranks, shared_runs, CHECK[version]), version)
    assert verdict.passed, verdict.message
    assert verdict.figures["uneven_parameters"] == verdict.figures["parameters"] == PARAMETERS
    assert verdict.figures["steps"] == uneven.STEPS
    # Observed: the gain is on rank 0 alone (FSDP2's to_local and both sharded state dicts).
    assert verdict.data["empty_on_some_rank"] == ["gain"], verdict.data
    if version == "fsdp2":
        shapes = verdict.data["local_shapes"]
        assert (shapes[0]["gain"], shapes[1]["gain"]) == ([1], [0])
        assert (shapes[0]["head.weight"], shapes[1]["head.weight"]) == ([16, 13], [15, 13])
    else:
        # FSDP1 flattens each unit: only the root's 209 elements leave a rank short (padded).
        flat = verdict.data["flat_shards"]
        assert flat[0][""] == [105, 0, 209] and flat[1][""] == [105, 1, 209], flat
        assert all(padding == 0 for unit, (_, padding, _) in flat[1].items() if unit), flat


@pytest.mark.world_size(2)
@pytest.mark.parametrize("version", sorted(CHECK))
def test_a_shard_of_the_wrong_size_fails_naming_the_parameter_or_unit(
    ranks: Ranks, shared_runs: dict, version: str
) -> None:
    # Parent side, on the clean run's values: one size as a wrong cut would leave it.
    values = copy.deepcopy(clean_run(ranks, shared_runs, CHECK[version]))
    if version == "fsdp2":
        values[1]["local_shapes"]["head.weight"] = [16, 13]
        expected = "rank 1: head.weight [31, 13]: local shard [16, 13], expected [15, 13]"
    else:
        values[1]["flat_shards"][""] = [104, 0, 209]
        expected = "rank 1: unit '': flat parameter of 209 elements held as 104 with 0 padding"
    values[0]["sharded_state_shapes"]["gain"] = [0]
    verdict = judge(values, version)
    assert not verdict.passed
    assert expected in verdict.message, verdict.message
    assert "rank 0: gain [1]: sharded state dict's local piece [0], expected [1]" in verdict.message


@pytest.mark.world_size(2)
@pytest.mark.parametrize("version", sorted(CHECK))
def test_a_shard_read_at_the_wrong_offset_fails_naming_the_parameter(
    ranks: Ranks, version: str
) -> None:
    check = CHECK[version]
    verdict = judge(ranks.run(check.rank_fn, **{**check.params, "fault": "wrong_offset"}), version)
    assert not verdict.passed
    # The last rank's largest local shard: FSDP2's head.weight (15 x 13), FSDP1's flat parameter
    # of layers.0 (its second half: from mlp.0 on).
    name = "head.weight" if version == "fsdp2" else "layers.0.mlp.2.weight"
    before = [line for line in verdict.message.splitlines() if "before training" in line]
    assert len(before) == 2 and all(name in line for line in before), verdict.message
    # and the step trained from it (each step's update is judged from the parameters both sides
    # start it with: loop.common.observe_step)
    assert "step 0 update" in verdict.message, verdict.message


@pytest.mark.world_size(4)
@pytest.mark.parametrize("version", sorted(CHECK))
def test_uneven_shards_at_world_size_4(ranks: Ranks, shared_runs: dict, version: str) -> None:
    verdict = judge(clean_run(ranks, shared_runs, CHECK[version]), version)
    assert verdict.passed, verdict.message
    assert verdict.figures["world_size"] == 4
    assert verdict.figures["uneven_parameters"] == PARAMETERS
    assert verdict.data["empty_on_some_rank"] == ["gain"], verdict.data
    if version == "fsdp2":
        shapes = verdict.data["local_shapes"]
        assert [shapes[r]["head.weight"] for r in range(4)] == [[8, 13]] * 3 + [[7, 13]]
        assert [shapes[r]["gain"] for r in range(4)] == [[1], [0], [0], [0]]
    else:
        # 209 over 4: 53 each, the last 3 short; the head's 434: 109 each, the last 2 short.
        flat = verdict.data["flat_shards"]
        assert [flat[r][""][1] for r in range(4)] == [0, 0, 0, 3], flat
        assert [flat[r]["head"][:2] for r in range(4)] == [[109, 0]] * 3 + [[109, 2]], flat
