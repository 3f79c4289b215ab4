"""memory.mixed_precision_peak: the bf16 peak under the bound of the dtypes observed in the step.

One rank call per test: both mixed-precision cases (reduce dtype unset, and fp32) of a version
in one call, and the negative controls of both versions in another.
"""

from __future__ import annotations

from typing import Any

import pytest

from fsdp_conformance.claims import memory
from fsdp_conformance.claims.check import VERSIONS
from fsdp_conformance.harness import Ranks


def _params(version: str) -> dict[str, Any]:
    return {"spec": memory.DEFAULT_SPEC, "version": version}


@pytest.mark.parametrize("version", VERSIONS)
def test_bf16_peak_is_under_the_bound_of_the_observed_dtypes(ranks: Ranks, version: str) -> None:
    check = next(c for c in memory.MIXED_CHECKS if c.params["version"] == version)
    values = ranks.run(check.rank_fn, **check.params)
    verdict = memory.verdict_mixed_precision_peak(values, check.params)
    print(verdict.message, verdict.figures)
    assert verdict.passed, verdict.message


def _fp32_gathers(ctx: Any) -> dict[str, Any]:
    """Both versions' steps with ``param_dtype=fp32``: the all-gathers really carry fp32."""
    return {version: memory.rank_mixed_precision_peak(
        ctx, memory.DEFAULT_SPEC, version, cases=(("fp32_gathers", "fp32", None),))
        for version in VERSIONS}


def _as_if_bf16(value: dict[str, Any]) -> dict[str, Any]:
    """The rank's values with every all-gather's observed output dtype replaced by bf16."""
    case = value["cases"]["fp32_gathers"]
    records = [{**r, "out_dtype": "torch.bfloat16"} if r["op"] == "all_gather" else r
               for r in case["collectives"]]
    return {**value, "cases": {"fp32_gathers": {**case, "collectives": records}}}


@pytest.mark.world_size(2)
def test_a_bf16_bound_on_a_step_that_gathers_fp32_fails_on_every_rank(ranks: Ranks) -> None:
    values = ranks.run(_fp32_gathers)
    for version in VERSIONS:
        per_rank = [v[version] for v in values]
        honest = memory.verdict_mixed_precision_peak(per_rank, _params(version))
        assert honest.passed, honest.message
        assert honest.figures["fp32_gathers.all_gather_dtype"] == "torch.float32"
        faked = memory.verdict_mixed_precision_peak([_as_if_bf16(v) for v in per_rank],
                                                    _params(version))
        print(version, honest.figures, faked.figures)
        assert not faked.passed, faked.message
        for rank in range(ranks.world_size):
            assert f"fp32_gathers: rank {rank}: peak " in faked.message, faked.message
        assert "all-gather torch.bfloat16" in faked.message
        assert faked.figures["fp32_gathers.bound_bytes"] < honest.figures["fp32_gathers.bound_bytes"]
