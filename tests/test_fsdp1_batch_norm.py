"""FSDP1 mixed precision on a CNN with ``_BatchNorm`` modules: torch's own fp32 units.

FSDP1's ``MixedPrecision`` keeps ``_BatchNorm`` modules in full precision by default
(``_module_classes_to_ignore``): under an auto-wrap policy each is its own unit with mixed
precision off (fp32 parameters and collectives, inputs cast to fp32 and the output back). The
suite observes those units on the sharded model (``sharding.fsdp1_full_precision_units``) and
models them: the bf16 reference keeps their parameters, buffers and gradient reduction fp32,
the memory bounds count them apart, the mixed-precision peak reads the dtypes of the other
units' collectives; each verdict says so.

Negative controls: a training fault on the CNN still fails; a model without batch norm has no
such unit and its verdict says nothing of them; a bound without the fp32 units' term still
counts the mixed dtypes as a problem.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numerics_models
import pytest

from fsdp_conformance import _compat
from fsdp_conformance.claims import memory, wrap
from fsdp_conformance.claims.check import Check, Verdict
from fsdp_conformance.harness import Ranks
from fsdp_conformance.models.model_spec import ModelSpec
from fsdp_conformance.plan.estimate import plan_model
from fsdp_conformance.plan.model import ModelChoice, PlanSettings

MODELS = numerics_models.__name__
CNN = ModelSpec(
    reference=None,
    factory=f"{MODELS}:small_cnn",
    block_cls=("ConvBlock",),
    input_builder=f"{MODELS}:images",
)
SAID = "FSDP1's MixedPrecision keeps BatchNorm (its _module_classes_to_ignore) in fp32 by default"


def _check(checks: list[Check], name: str) -> Check:
    return next(c for c in checks if c.name == name and c.params.get("version") == "fsdp1")


def _judged(
    ranks: Ranks, check: Check, spec: ModelSpec = CNN, **extra: Any
) -> tuple[Verdict, list[Any]]:
    params = {**check.params, "spec": spec, **extra}
    values = ranks.run(check.rank_fn, **params)
    return check.verdict(values, params), values


@pytest.mark.world_size(2)
def test_fsdp1_bf16_training_of_a_batch_norm_cnn_models_the_fp32_batch_norm_units(
    ranks: Ranks,
) -> None:
    verdict, values = _judged(ranks, _check(wrap.CHECKS, "wrap.train.bf16"))
    assert verdict.passed, verdict.message
    assert SAID in verdict.message
    assert all(v["input_casts"] is None for v in values)
    units = verdict.data["full_precision_units"]
    assert units and all(".bn" in n for n in units), units


@pytest.mark.world_size(2)
@pytest.mark.parametrize("name", ["memory.mixed_precision_peak", "memory.plan_estimate_matches"])
def test_fsdp1_memory_checks_count_the_fp32_batch_norm_units(ranks: Ranks, name: str) -> None:
    verdict, _ = _judged(ranks, _check(memory.CHECKS, name))
    assert verdict.passed, verdict.message
    assert SAID in verdict.message
    assert verdict.data["full_precision_units"]


@pytest.mark.world_size(2)
def test_negative_control_mixed_dtypes_without_the_fp32_units_still_give_no_bound(
    ranks: Ranks,
) -> None:
    check = _check(memory.CHECKS, "memory.mixed_precision_peak")
    params = {**check.params, "spec": CNN}
    values = ranks.run(check.rank_fn, **params)
    for v in values:  # the same step, its fp32 units not known: both dtypes seen, no bound
        for case in v["cases"].values():
            case["full_units"] = {}
    verdict = check.verdict(values, params)
    assert not verdict.passed
    assert "no bound can be derived" in verdict.message
    assert SAID not in verdict.message


@pytest.mark.world_size(2)
def test_negative_control_a_training_fault_on_the_cnn_still_fails(ranks: Ranks) -> None:
    verdict, _ = _judged(ranks, _check(wrap.CHECKS, "wrap.train.bf16"), fault="summed_grads")
    assert not verdict.passed
    assert "bf16 training under FSDP differs from the reference" in verdict.message


@pytest.mark.world_size(2)
def test_a_model_without_batch_norm_has_no_fp32_unit(ranks: Ranks) -> None:
    verdict, values = _judged(ranks, _check(wrap.CHECKS, "wrap.train.bf16"), spec=ModelSpec())
    assert verdict.passed, verdict.message
    assert all(v["full_precision_units"] == {} for v in values)
    assert "full_precision_units" not in verdict.data
    assert "in fp32 by default" not in verdict.message


def test_the_fsdp1_plan_keeps_batch_norm_in_fp32_under_bf16(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The planner predicts FSDP1's default (no sharded model to observe): the batch norms'
    inputs are saved in fp32; without the ignored classes its estimate is smaller."""
    settings = PlanSettings(version="fsdp1", compute_dtype="bf16", optimizer="none", batch_size=4)

    def estimate() -> int:
        return plan_model(ModelChoice(CNN, CNN.name), settings).estimate(2).total

    with_fp32 = estimate()
    monkeypatch.setattr(_compat, "fsdp1_mixed_precision_ignored_classes", lambda: ())
    without = estimate()
    assert with_fp32 > without
    fsdp2 = dataclasses.replace(settings, version="fsdp2")
    monkeypatch.undo()
    assert plan_model(ModelChoice(CNN, CNN.name), fsdp2).estimate(2).total < with_fp32
