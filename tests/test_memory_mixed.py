"""memory.mixed_precision_peak: the bf16 peak under the bound of the dtypes observed in the step.

One rank call per test: both mixed-precision cases (reduce dtype unset, and fp32) of a version
in one call, and the negative controls of both versions in another.
"""

from __future__ import annotations

from typing import Any

import pytest

from fsdp_conformance.claims.check import VERSIONS
from fsdp_conformance.claims.memory import CHECKS
from fsdp_conformance.claims.memory.common import DEFAULT_SPEC, MemoryCheckError
from fsdp_conformance.claims.memory.mixed_precision_peak import (
    config_from,
    dtype_size_problems,
    observed_step_config,
    rank_mixed_precision_peak,
    verdict_mixed_precision_peak,
)
from fsdp_conformance.harness import Ranks
from fsdp_conformance.measure.profile import plan_step

#: The check's variants, one per FSDP version (fsdp1, fsdp2).
MIXED_CHECKS = tuple(c for c in CHECKS if c.name == "memory.mixed_precision_peak")


def _params(version: str) -> dict[str, Any]:
    return {"spec": DEFAULT_SPEC, "version": version}


@pytest.mark.parametrize("version", VERSIONS)
def test_bf16_peak_is_under_the_bound_of_the_observed_dtypes(ranks: Ranks, version: str) -> None:
    check = next(c for c in MIXED_CHECKS if c.params["version"] == version)
    values = ranks.run(check.rank_fn, **check.params)
    verdict = verdict_mixed_precision_peak(values, check.params)
    assert verdict.passed, verdict.message
    # The figures are the observed dtypes (what was configured, where the case names it) and
    # the peak and bound of each case.
    figures = verdict.figures
    assert figures["reduce_fp32.all_gather_dtype"] == "torch.bfloat16"
    assert figures["reduce_fp32.reduce_scatter_dtype"] == "torch.float32"
    for case in ("reduce_unset", "reduce_fp32"):
        assert 0 < figures[f"{case}.peak_bytes"] <= figures[f"{case}.limit_bytes"]
        assert set(verdict.data["collectives"][case][0]) >= {"op", "in_dtype", "out_bytes"}


def _fp32_gathers_and_a_leak(ctx: Any) -> dict[str, Any]:
    """Both versions, one rank call: a step with ``param_dtype=fp32`` (its all-gathers really
    carry fp32), and the bf16 cases with a fault: every step keeps 24 MB alive through its
    backward (a leak), which no per-layer bound allows."""
    import torch

    from fsdp_conformance.measure import step

    out: dict[str, Any] = {}
    for version in VERSIONS:
        out[version] = {
            "fp32": rank_mixed_precision_peak(
                ctx, DEFAULT_SPEC, version, cases=(("fp32_gathers", "fp32", None),)
            )
        }
    original = step.train_step

    def leaky(model: Any, batch: Any, optimizer: Any = None) -> None:
        held = torch.ones(LEAK_BYTES // 4, device=ctx.device)
        original(model, batch, optimizer)
        del held

    step.train_step = leaky  # type: ignore[assignment]
    try:
        for version in VERSIONS:
            out[version]["leak"] = rank_mixed_precision_peak(ctx, DEFAULT_SPEC, version)
    finally:
        step.train_step = original  # type: ignore[assignment]
    return out


#: The leak of the fault: more than any case's room under its limit (11.7 MB at most, FSDP2
#: with the reduce dtype unset: peak 23.7 MB, limit 35.4 MB).
LEAK_BYTES = 24 * 10**6


def _as_if_bf16(value: dict[str, Any]) -> dict[str, Any]:
    """The rank's values with every all-gather's observed output dtype replaced by bf16."""
    case = value["cases"]["fp32_gathers"]
    records = [
        {**r, "out_dtype": "torch.bfloat16"} if r["op"] == "all_gather" else r
        for r in case["collectives"]
    ]
    return {**value, "cases": {"fp32_gathers": {**case, "collectives": records}}}


@pytest.mark.world_size(2)
def test_dtypes_that_do_not_match_the_bytes_and_a_peak_over_the_bound_fail_on_every_rank(
    ranks: Ranks,
) -> None:
    values = ranks.run(_fp32_gathers_and_a_leak)
    for version in VERSIONS:
        # The bound is derived from what the collectives carried: an fp32 step gets the fp32
        # bound. The same step with its all-gathers recorded as bf16 would get a smaller bound
        # (less than the bound's slack at this size, so the peak alone would not catch it);
        # the recorded bytes, 4 per element, say the dtype is wrong: fails on every rank.
        per_rank = [v[version]["fp32"] for v in values]
        honest = verdict_mixed_precision_peak(per_rank, _params(version))
        assert honest.passed, honest.message
        assert honest.figures["fp32_gathers.all_gather_dtype"] == "torch.float32"
        faked = verdict_mixed_precision_peak([_as_if_bf16(v) for v in per_rank], _params(version))
        assert not faked.passed, faked.message
        for rank in range(ranks.world_size):
            assert (
                f"fp32_gathers: rank {rank}: the recorded dtypes do not describe the bytes "
                "moved" in faked.message
            ), faked.message
        assert "x 2 B of the recorded torch.bfloat16 (4 B per element)" in faked.message
        config = config_from(per_rank[0]["config"])
        as_bf16 = observed_step_config(
            config, {"all_gather_dtype": "torch.bfloat16", "reduce_scatter_dtype": "torch.float32"}
        )
        assert as_bf16.compute_bytes == 2 and as_bf16.reduce_bytes == 4
        # A peak over the bound of the observed dtypes fails, on every rank, in both cases.
        leak = verdict_mixed_precision_peak([v[version]["leak"] for v in values], _params(version))
        assert not leak.passed, leak.message
        for label in ("reduce_unset", "reduce_fp32"):
            for rank in range(ranks.world_size):
                assert f"{label}: rank {rank}: peak " in leak.message, leak.message
        assert "of the observed dtypes (all-gather torch.bfloat16, reduce-scatter " in leak.message


def test_a_bad_reduce_dtype_is_named_and_mixed_dtypes_derive_no_bound() -> None:
    from fsdp_conformance.fsdp.sharding import param_dtype_kwargs

    with pytest.raises(ValueError, match="reduce_dtype 'fp8' is not one of bf16, fp16, fp32"):
        param_dtype_kwargs("fsdp2", "bf16", "fp8")
    _, config = plan_step(DEFAULT_SPEC, 2, "fsdp2")
    with pytest.raises(MemoryCheckError, match="no single dtype observed"):
        observed_step_config(
            config,
            {
                "all_gather_dtype": "torch.bfloat16|torch.float32",
                "reduce_scatter_dtype": "torch.float32",
            },
        )
    records = [
        {
            "op": "all_gather",
            "unit": "",
            "out_dtype": "torch.float32",
            "out_bytes": 40,
            "in_dtype": "torch.float32",
            "in_bytes": 20,
        }
    ]
    assert dtype_size_problems(records, {"": [10]}) == []
    assert "not its numel (12) x 4 B" in dtype_size_problems(records, {"": [12]})[0]


@pytest.mark.world_size(1)
def test_the_check_skips_at_world_size_one_saying_why(ranks: Ranks) -> None:
    from fsdp_conformance.claims.check import run_check
    from fsdp_conformance.harness import CheckSkipped

    fsdp2 = next(c for c in MIXED_CHECKS if c.params["version"] == "fsdp2")
    with pytest.raises(CheckSkipped, match="FSDP2 issues no all-gather or reduce-scatter"):
        run_check(ranks.configured(skip=None), fsdp2)
