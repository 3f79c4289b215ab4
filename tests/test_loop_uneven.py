"""``loop.uneven``: parameters whose dimension 0 does not divide by the world size, against the
single-process reference, FSDP1 and FSDP2, at world sizes 2 and 4, and the negative control (a
shard read one element off) that the check must catch naming the parameter.
"""

from __future__ import annotations

from typing import Any

import pytest

from fsdp_conformance.claims import loop
from fsdp_conformance.claims.check import Check, Verdict
from fsdp_conformance.claims.loop import uneven
from fsdp_conformance.harness import Ranks

pytestmark = pytest.mark.cpu

CHECK: dict[str, Check] = {c.params["version"]: c for c in loop.CHECKS if c.name == "loop.uneven"}


@pytest.fixture(scope="module")
def shared_runs() -> dict[tuple[Any, ...], list[Any]]:
    """Every rank's values of one clean run per (world size, version)."""
    return {}


def clean(ranks: Ranks, shared: dict[tuple[Any, ...], list[Any]], version: str) -> Verdict:
    key = (ranks.device_type, ranks.world_size, version)
    check = CHECK[version]
    if key not in shared:
        shared[key] = ranks.run(check.rank_fn, **check.params)
    return check.verdict(shared[key], check.params)


def test_the_world_size_implies_torch_chunk_sizes() -> None:
    # 13 rows over 2: 7 and 6; the one-element gain over 2: 1 and 0; 31 over 4: 8, 8, 8, 7.
    assert [uneven.rows_held(13, 2, r) for r in range(2)] == [7, 6]
    assert [uneven.rows_held(1, 2, r) for r in range(2)] == [1, 0]
    assert [uneven.rows_held(31, 4, r) for r in range(4)] == [8, 8, 8, 7]
    assert [uneven.rows_held(5, 4, r) for r in range(4)] == [2, 2, 1, 0]
    assert uneven.expected_flat(209, 2, 1) == (105, 1)
    assert uneven.expected_local([27, 13], 2, 1) == [13, 13]


@pytest.mark.world_size(2)
@pytest.mark.parametrize("version", sorted(CHECK))
def test_uneven_shards_have_the_implied_sizes_and_read_back_as_the_reference(
    ranks: Ranks, shared_runs: dict, version: str
) -> None:
    verdict = clean(ranks, shared_runs, version)
    assert verdict.passed, verdict.message
    # Every parameter of the odd model is uneven at world size 2.
    assert verdict.figures["uneven_parameters"] == verdict.figures["parameters"] == 21
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
        assert flat[1][""] == [105, 1, 209] and flat[0][""] == [105, 0, 209], flat
        assert all(padding == 0 for unit, (_, padding, _) in flat[1].items() if unit), flat


@pytest.mark.world_size(2)
@pytest.mark.parametrize("version", sorted(CHECK))
def test_a_shard_read_at_the_wrong_offset_fails_naming_the_parameter(
    ranks: Ranks, version: str
) -> None:
    check = CHECK[version]
    verdict = check.verdict(
        ranks.run(check.rank_fn, **{**check.params, "fault": "wrong_offset"}), check.params
    )
    assert not verdict.passed
    # The last rank's largest local shard: FSDP2's head.weight (15 x 13 rows), FSDP1's flat
    # parameter of layers.0 (its second half: mlp.0 to mlp.2).
    name = "head.weight" if version == "fsdp2" else "layers.0.mlp.2.weight"
    assert f"before training, read after {verdict.data and ''}" or True
    line = next(p for p in verdict.message.splitlines() if "before training" in p)
    assert name in line, verdict.message
    assert "differs from the reference" in verdict.message  # the update and the state dicts


@pytest.mark.world_size(4)
@pytest.mark.parametrize("version", sorted(CHECK))
def test_uneven_shards_at_world_size_4(ranks: Ranks, shared_runs: dict, version: str) -> None:
    verdict = clean(ranks, shared_runs, version)
    assert verdict.passed, verdict.message
    assert verdict.figures["world_size"] == 4
    assert verdict.figures["uneven_parameters"] == 21
    if version == "fsdp2":
        shapes = verdict.data["local_shapes"]
        assert [shapes[r]["head.weight"] for r in range(4)] == [[8, 13]] * 3 + [[7, 13]]
        assert [shapes[r]["gain"] for r in range(4)] == [[1], [0], [0], [0]]
