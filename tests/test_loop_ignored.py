"""``loop.ignored``: a module kept out of FSDP stays local, unsharded, unreduced and in the
state dict, FSDP1 and FSDP2; its negative control (the ignore list not passed) is caught naming
the parameter. One clean run per version serves the positive test and the parent-side checks.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import pytest
from loop_runs import by_version, clean_run

from fsdp_conformance.claims.check import Check
from fsdp_conformance.claims.loop import ignored
from fsdp_conformance.fsdp import capabilities
from fsdp_conformance.harness import Ranks

pytestmark = pytest.mark.cpu

CHECK: dict[str, Check] = by_version("loop.ignored")
NORM = ["norm.weight", "norm.bias"]


@pytest.fixture(scope="module")
def shared_runs() -> dict[tuple[Any, ...], list[dict[str, Any]]]:
    """Every rank's values of one clean run per (world size, version)."""
    return {}


@pytest.mark.parametrize("version", sorted(CHECK))
def test_an_ignored_module_stays_local_unreduced_and_in_the_state_dict(
    ranks: Ranks, shared_runs: dict, version: str
) -> None:
    values = clean_run(ranks, shared_runs, CHECK[version])
    verdict = CHECK[version].verdict(values, CHECK[version].params)
    assert verdict.passed, verdict.message
    assert verdict.data["ignored_module"] == "norm"
    for v in values:
        assert sorted(v["params"]) == sorted(NORM)
        for p in v["params"].values():
            # Observed: a plain parameter of its full shape in no unit, as the state dict has it.
            assert p["type"] == "Parameter" and p["local_shape"] == p["shape"] == [13]
            assert p["unit"] is None and p["state_dict_is_param"], p
        assert v["unmatched"] == [] and v["reduced"]
    # Each rank's own gradient, far from the mean the other parameters get.
    assert verdict.figures["local_vs_mean"] > 0.1


@pytest.mark.parametrize("version", sorted(CHECK))
def test_an_ignore_list_not_passed_is_caught_naming_the_parameter(
    ranks: Ranks, version: str
) -> None:
    check = CHECK[version]
    verdict = check.verdict(
        ranks.run(check.rank_fn, **{**check.params, "fault": "ignored_sharded"}), check.params
    )
    assert not verdict.passed
    assert "ignored parameter norm.weight is sharded" in verdict.message, verdict.message
    assert "managed by FSDP unit ''" in verdict.message
    assert "update: norm" in verdict.message, "the averaged gradient is not this rank's own"


def test_a_rank_whose_state_dict_lacks_the_ignored_parameter_fails(
    ranks: Ranks, shared_runs: dict
) -> None:
    values = copy.deepcopy(clean_run(ranks, shared_runs, CHECK["fsdp2"]))
    values[-1]["params"]["norm.bias"]["state_dict_type"] = ""
    verdict = CHECK["fsdp2"].verdict(values, CHECK["fsdp2"].params)
    assert not verdict.passed
    assert (
        f"rank {values[-1]['rank']}: ignored parameter norm.bias is missing from the state dict"
        in verdict.message
    )


def test_the_fsdp2_ignore_probe_reads_the_fully_shard_signature(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert capabilities.FSDP2_IGNORED_PARAMS.present
    assert capabilities.FSDP2_GRADIENT_DIVIDE_FACTOR.present

    def old_fully_shard(module: Any, *, mesh: Any = None) -> Any:  # before ignored_params
        return module

    monkeypatch.setattr(capabilities._compat, "fully_shard", lambda: old_fully_shard)
    assert "ignored_params" not in inspect.signature(old_fully_shard).parameters
    assert not capabilities._fully_shard_ignores_params()


def test_a_model_without_the_named_module_ignores_its_last_normalisation_layer() -> None:
    from torch import nn

    model = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3), nn.Linear(3, 3), nn.LayerNorm(3))
    assert ignored.ignored_module(model, "norm")[0] == "3"
    assert ignored.ignored_module(model, "0")[0] == "0"
