"""``loop.buffers``: persistent buffers through training and every state-dict kind, FSDP1 and
FSDP2, against the slice-wise reference; the negative control (the user's getter pops a buffer)
that the check must catch naming the buffer and every kind, the verdict's other refusals judged
in the parent on a clean run's values, and a model with a non-persistent buffer (the reference
Llama's rotary ``inv_freq``), which no kind may carry.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from loop_runs import by_version, clean_run

from fsdp_conformance.claims.check import Check, Verdict
from fsdp_conformance.fsdp.state_dict_kinds import GET_ONLY, KINDS, RANK0_ONLY
from fsdp_conformance.harness import Ranks
from fsdp_conformance.models.model_spec import ModelSpec
from fsdp_conformance.models.reference_models import LlamaConfig

pytestmark = pytest.mark.cpu

CHECK: dict[str, Check] = by_version("loop.buffers")
#: The odd model's persistent buffers: batch norm's statistics and the registered scale.
PERSISTENT = ["scale", "norm.running_mean", "norm.running_var", "norm.num_batches_tracked"]


@pytest.fixture(scope="module")
def shared_runs() -> dict[tuple[Any, ...], list[Any]]:
    """Every rank's values of one clean run per (device type, world size, version)."""
    return {}


def judge(values: list, version: str) -> Verdict:
    return CHECK[version].verdict(values, CHECK[version].params)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("version", sorted(CHECK))
def test_buffers_follow_each_rank_and_every_kind_carries_and_restores_them(
    ranks: Ranks, shared_runs: dict, version: str
) -> None:
    verdict = judge(clean_run(ranks, shared_runs, CHECK[version]), version)
    assert verdict.passed, verdict.message
    assert verdict.data["persistent"] == PERSISTENT
    assert verdict.figures["kinds"] == list(KINDS[version])
    # Observed: FSDP never synchronises buffers; the ranks' statistics differ as the
    # reference's slices do.
    assert verdict.figures["differ_between_ranks"] == ["norm.running_mean", "norm.running_var"]
    assert verdict.figures["rank_spread"] > 0
    assert verdict.figures["rank_spread"] == pytest.approx(verdict.figures["reference_spread"])
    # Observed: FSDP2's rank-0 full dict, loaded with broadcast_from_rank0, gives every rank
    # rank 0's buffers.
    assert verdict.figures["broadcast_on_load"] == (["full_rank0"] if version == "fsdp2" else [])


@pytest.mark.world_size(2)
@pytest.mark.parametrize("version", sorted(CHECK))
def test_a_buffer_the_getter_drops_fails_every_kind_naming_it(ranks: Ranks, version: str) -> None:
    check = CHECK[version]
    verdict = judge(
        ranks.run(check.rank_fn, **{**check.params, "fault": "buffer_dropped"}), version
    )
    assert not verdict.passed
    assert verdict.figures["failed_kinds"] == sorted(KINDS[version]), verdict.message
    for kind in KINDS[version]:
        assert f"rank 0: {kind} state dict: lacks persistent buffer(s) scale" in verdict.message
        if kind not in GET_ONLY:
            after = f"after loading the {kind} state dict into a fresh sharded model"
            assert any(
                after in line and "scale differs" in line for line in verdict.message.splitlines()
            ), verdict.message
    assert "update" not in verdict.message, "training is untouched; only the state dicts differ"


@pytest.mark.world_size(2)
@pytest.mark.parametrize("version", sorted(CHECK))
def test_the_verdict_refuses_a_stale_value_a_non_persistent_buffer_and_a_rank0_dict_elsewhere(
    ranks: Ranks, shared_runs: dict, version: str
) -> None:
    # Parent side, on the clean run's values.
    values = copy.deepcopy(clean_run(ranks, shared_runs, CHECK[version]))
    rank0_kind = next(k for k in KINDS[version] if k in RANK0_ONLY)
    values[1]["kinds"][rank0_kind]["entries"] = 3
    values[1]["kinds"]["sharded"]["non_persistent"] = ["rotary.inv_freq"]
    values[0]["live"].update(max_rel=0.5, worst="norm.running_var")
    verdict = judge(values, version)
    assert not verdict.passed
    for line in (
        f"rank 1: {rank0_kind} state dict: 3 entries from a rank-0-only getter",
        "rank 1: sharded state dict: carries non-persistent buffer(s) rotary.inv_freq",
        "rank 0: buffers after 2 steps (against the reference's slice 0): norm.running_var",
    ):
        assert line in verdict.message, verdict.message


@pytest.mark.world_size(2)
def test_no_kind_carries_a_non_persistent_buffer(ranks: Ranks) -> None:
    check = CHECK["fsdp2"]
    spec = ModelSpec(
        reference="llama", config=LlamaConfig(num_layers=1, dim=32, num_heads=2, vocab_size=64)
    )
    verdict = check.verdict(
        ranks.run(check.rank_fn, **{**check.params, "spec": spec}), check.params
    )
    assert verdict.passed, verdict.message
    assert verdict.figures["non_persistent"] == ["layers.0.rotary.inv_freq"]
    assert "none of the non-persistent layers.0.rotary.inv_freq" in verdict.message
