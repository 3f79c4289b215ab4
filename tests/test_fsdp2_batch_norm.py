"""FSDP2 mixed precision on a CNN whose ``_BatchNorm`` modules sit inside FSDP units.

FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)`` casts a ``_BatchNorm``'s weight and bias, not
its fp32 running statistics, and CPU ``F.batch_norm`` refuses the mix ("expected scalar type
BFloat16 but found Float"). FSDP1's ``MixedPrecision`` keeps ``_BatchNorm`` modules in full
precision by default; FSDP2 needs each as its own unit with ``MixedPrecisionPolicy()``. The
checks first run as users write them; only on that error (``torch_errors``'
``fsdp2-batch-norm-dtype``) they run again with the fix and say so
(``sharding.with_known_fix``).

Negative controls: another error raised in the same place stays an error; FSDP2 on a model
without batch norm never retries; a training fault on the CNN still fails after the retry.
"""

from __future__ import annotations

from typing import Any

import numerics_models
import pytest
import torch
import torch.nn as nn

from fsdp_conformance.claims import memory, stack, wrap
from fsdp_conformance.claims.check import Check, Verdict
from fsdp_conformance.claims.wrap.train import rank_train, verdict_train
from fsdp_conformance.fsdp.sharding import (
    BATCH_NORM_FIX,
    known_mixed_precision_error,
    with_known_fix,
)
from fsdp_conformance.harness import Ranks
from fsdp_conformance.models.model_spec import ModelSpec

MODELS = numerics_models.__name__


class InvertingNorm(nn.BatchNorm2d):
    """Scales by the inverse of a diagonal of its weight first: in bf16 (FSDP2's compute dtype)
    torch raises another RuntimeError ("Low precision dtypes not supported") inside a
    _BatchNorm's forward: that one stays an error."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.linalg.inv(torch.diag(self.weight)).diagonal()
        out: torch.Tensor = super().forward(x) * scale.view(1, -1, 1, 1)
        return out


class InvertingBlock(numerics_models.ConvBlock):
    def __init__(self, channels: int) -> None:
        super().__init__(channels)
        self.bn = InvertingNorm(channels)


class InvertingCNN(numerics_models.SmallCNN):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(InvertingBlock(8) for _ in range(2))


def inverting_cnn() -> nn.Module:
    return InvertingCNN()


def _spec(factory: str, block: str) -> ModelSpec:
    return ModelSpec(
        reference=None,
        factory=factory,
        block_cls=(block,),
        input_builder=f"{MODELS}:images",
    )


CNN = _spec(f"{MODELS}:small_cnn", "ConvBlock")
INVERTING = _spec(f"{__name__}:inverting_cnn", "InvertingBlock")


def _check(checks: list[Check], name: str) -> Check:
    return next(c for c in checks if c.name == name and c.params.get("version") == "fsdp2")


def _judged(ranks: Ranks, check: Check, **extra: Any) -> tuple[Verdict, list[Any]]:
    params = {**check.params, "spec": CNN, **extra}
    values = ranks.run(check.rank_fn, **params)
    return check.verdict(values, params), values


def _says_the_fix(verdict: Verdict, low: str) -> None:
    assert verdict.passed, verdict.message
    assert f"RuntimeError: expected scalar type {low} but found Float" in verdict.message
    assert BATCH_NORM_FIX in verdict.message
    assert "FSDP2's MixedPrecisionPolicy could not run this model" in verdict.message


@pytest.mark.world_size(2)
def test_fsdp2_bf16_training_of_a_batch_norm_cnn_is_judged_with_fp32_batch_norm_units(
    ranks: Ranks,
) -> None:
    verdict, values = _judged(ranks, _check(wrap.CHECKS, "wrap.train.bf16"))
    _says_the_fix(verdict, "BFloat16")
    assert verdict.data["input_casts"]["fix"] == BATCH_NORM_FIX
    # The convolutions and the head computed in bf16; the batch norms' parameters stay fp32.
    assert {w for v in values for _, w in v["compute_dtypes"].values()} == {"torch.bfloat16"}


@pytest.mark.world_size(2)
def test_fsdp2_fp16_loss_scaling_of_a_batch_norm_cnn_is_judged_with_the_fix(
    ranks: Ranks,
) -> None:
    verdict, _ = _judged(ranks, _check(stack.CHECKS, "stack.loss_scaling"))
    _says_the_fix(verdict, "Half")


@pytest.mark.world_size(2)
@pytest.mark.parametrize("name", ["memory.mixed_precision_peak", "memory.plan_estimate_matches"])
def test_fsdp2_memory_checks_measure_the_batch_norm_cnn_with_the_fix(
    ranks: Ranks, name: str
) -> None:
    verdict, _ = _judged(ranks, _check(memory.CHECKS, name))
    _says_the_fix(verdict, "BFloat16")


@pytest.mark.world_size(2)
def test_negative_control_a_training_fault_still_fails_after_the_retry(ranks: Ranks) -> None:
    verdict, _ = _judged(ranks, _check(wrap.CHECKS, "wrap.train.bf16"), fault="summed_grads")
    assert not verdict.passed
    assert "bf16 training under FSDP differs from the reference" in verdict.message


@pytest.mark.world_size(2)
def test_negative_control_another_error_in_a_batch_norm_stays_an_error(ranks: Ranks) -> None:
    params = {"spec": INVERTING, "version": "fsdp2", "precision": "bf16", "steps": 1}
    with pytest.raises(Exception) as raised:
        ranks.run(rank_train, **params)
    text = str(raised.value)
    assert "Low precision dtypes not supported" in text, text
    assert "batch_norm" not in text.splitlines()[-1]
    assert "return run(False), None" in text and "run(True)" not in text


@pytest.mark.world_size(2)
def test_fsdp2_on_a_model_without_batch_norm_never_retries(ranks: Ranks) -> None:
    params = {"spec": ModelSpec(), "version": "fsdp2", "precision": "bf16", "steps": 1}
    values = ranks.run(rank_train, **params)
    verdict = verdict_train(values, params)
    assert verdict.passed, verdict.message
    assert all(v["input_casts"] is None for v in values)
    assert "could not run this model" not in verdict.message


def _raised(error: Exception) -> BaseException:
    try:
        raise error
    except Exception as exc:  # what the rank function catches
        return exc


def test_only_the_batch_norm_dtype_error_under_fsdp2_mixed_precision_is_retried() -> None:
    bn = nn.BatchNorm2d(4)
    x = torch.randn(2, 4, 3, 3, dtype=torch.bfloat16)
    bn.weight.data, bn.bias.data = bn.weight.data.bfloat16(), bn.bias.data.bfloat16()
    with pytest.raises(RuntimeError) as raised:
        bn(x)
    torch_error = raised.value
    assert known_mixed_precision_error(torch_error, "fsdp2") == (
        "RuntimeError: expected scalar type BFloat16 but found Float"
    )
    # FSDP1 keeps batch norm in full precision: the same error is not its known one.
    assert known_mixed_precision_error(torch_error, "fsdp1") is None
    # The same words raised outside a _BatchNorm's forward: not the known error.
    same_words = _raised(RuntimeError("expected scalar type BFloat16 but found Float"))
    assert known_mixed_precision_error(same_words, "fsdp2") is None

    runs: list[bool] = []

    def run(fix: bool) -> str:
        runs.append(fix)
        if not fix:
            raise torch_error
        return "fixed"

    assert with_known_fix("fsdp2", True, run) == (
        "fixed",
        {
            "torch_error": "RuntimeError: expected scalar type BFloat16 but found Float",
            "fix": BATCH_NORM_FIX,
        },
    )
    assert runs == [False, True]
    with pytest.raises(RuntimeError):  # not mixed precision: never retried
        with_known_fix("fsdp2", False, run)
    assert runs == [False, True, False]
