"""FSDP1 in bf16 on a model whose root casts its input to a unit's weight dtype.

ViT's patch embedding casts the pixels to its projection's weight dtype inside the root unit,
where that weight is still the fp32 shard; FSDP1's ``MixedPrecision`` casts only the root unit's
inputs unless ``cast_forward_inputs=True``, so the bf16 patch unit gets fp32 input and torch
raises "Input type (float) and bias type (c10::BFloat16) should be the same" (FSDP2 casts every
unit's inputs by default). The check first runs with the defaults as users write them; only on
that error (``torch_errors``' ``fsdp1-input-dtype``) it runs again with the fix and says so
(``sharding.with_known_fix``).

Negative controls: a model raising a different error still errors; the reference model never
retries. Positive control: the casting model passes ``wrap.train.bf16`` on FSDP1 with the note.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_conformance.claims.wrap.train import rank_train, verdict_train
from fsdp_conformance.fsdp.sharding import INPUT_CASTS_FIX, fsdp1_input_dtype_error
from fsdp_conformance.harness import Ranks
from fsdp_conformance.models.model_spec import ModelSpec

DIM = 32


class Patch(nn.Module):
    """ViT's patch projection: a unit of its own."""

    def __init__(self, pixels: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, dim, kernel_size=2, stride=2)
        self.pixels = pixels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(x).flatten(2).transpose(1, 2)
        return out


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.fc(F.gelu(self.norm(x)))
        return out


class CastingViT(nn.Module):
    """A root that casts its input to the patch unit's weight dtype, as ViT's does."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.patch = Patch(8, dim)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(2)])
        self.head = nn.Linear(dim, 4)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.patch(pixel_values.to(self.patch.proj.weight.dtype))
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(x.mean(1))
        return out


class InvertingViT(CastingViT):
    """Inverts a root weight in its forward: in bf16 (FSDP1's compute dtype) torch raises
    another RuntimeError ("Low precision dtypes not supported"): that one stays an error."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(DIM, DIM, bias=False)
        with torch.no_grad():
            self.mix.weight.add_(torch.eye(DIM) * 4)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.patch(pixel_values)  # no cast of its own: FSDP1's root cast reaches the unit
        out: torch.Tensor = self.head(x.mean(1) @ torch.linalg.inv(self.mix.weight))
        return out


def casting_vit() -> nn.Module:
    return CastingViT()


def inverting_vit() -> nn.Module:
    return InvertingViT()


def pixels(model: Any, batch_size: int, device: Any) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, 3, 8, 8, generator=generator).to(device)


def _spec(factory: str) -> ModelSpec:
    return ModelSpec(
        reference=None,
        factory=f"{__name__}:{factory}",
        block_cls=("Patch", "Block"),
        input_builder=f"{__name__}:pixels",
    )


CASTING = _spec("casting_vit")
INVERTING = _spec("inverting_vit")


def _bf16(spec: ModelSpec, version: str = "fsdp1") -> dict[str, Any]:
    return {"spec": spec, "version": version, "precision": "bf16", "steps": 2}


@pytest.mark.world_size(2)
def test_fsdp1_defaults_that_cannot_run_the_model_are_retried_with_input_casts(
    ranks: Ranks,
) -> None:
    params = _bf16(CASTING)
    values = ranks.run(rank_train, **params)
    verdict = verdict_train(values, params)
    assert verdict.passed, verdict.message
    assert verdict.figures["cast_forward_inputs"] is True
    casts = verdict.data["input_casts"]
    assert casts["fix"] == INPUT_CASTS_FIX
    assert casts["torch_error"].startswith("RuntimeError: Input type (float) and bias type")
    assert "FSDP1's MixedPrecision defaults could not run this model" in verdict.message
    assert casts["torch_error"] in verdict.message and INPUT_CASTS_FIX in verdict.message
    # The exact comparison held: the reference cast every unit's inputs as FSDP1 then does.
    dtypes = {w for v in values for _, w in v["compute_dtypes"].values()}
    assert dtypes == {"torch.bfloat16"}


@pytest.mark.world_size(2)
def test_fsdp2_and_the_reference_model_run_with_the_defaults(ranks: Ranks) -> None:
    for params in (_bf16(CASTING, "fsdp2"), _bf16(ModelSpec(), "fsdp1")):
        values = ranks.run(rank_train, **params)
        verdict = verdict_train(values, params)
        assert verdict.passed, verdict.message
        assert all(v["input_casts"] is None for v in values)
        assert "cast_forward_inputs" not in verdict.figures
        assert "input_casts" not in verdict.data
        assert "could not run this model" not in verdict.message


@pytest.mark.world_size(2)
def test_negative_control_a_different_error_stays_an_error(ranks: Ranks) -> None:
    with pytest.raises(Exception) as raised:
        ranks.run(rank_train, **_bf16(INVERTING))
    text = str(raised.value)
    assert "Low precision dtypes not supported" in text, text
    assert "fully_sharded_data_parallel.py" in text  # raised under FSDP1's forward, as ViT's
    # Raised by the run with the defaults, never retried with the input casts.
    assert "return run(False), None" in text and "run(True)" not in text


def test_only_fsdp1s_input_dtype_error_is_recognised() -> None:
    def raise_in(error: Exception) -> BaseException:
        try:
            raise error
        except Exception as exc:  # noqa: BLE001: what the rank function catches
            return exc

    # Raised outside FullyShardedDataParallel.forward: not FSDP1's error, not retried.
    message = "Input type (float) and bias type (c10::BFloat16) should be the same"
    assert fsdp1_input_dtype_error(raise_in(RuntimeError(message))) is None
    assert fsdp1_input_dtype_error(raise_in(RuntimeError("shapes cannot be multiplied"))) is None


@pytest.mark.world_size(2)
def test_the_memory_checks_measure_the_retried_step_within_their_bound(ranks: Ranks) -> None:
    from fsdp_conformance.claims.memory.mixed_precision_peak import (
        rank_mixed_precision_peak,
        verdict_mixed_precision_peak,
    )

    params = {"spec": CASTING, "version": "fsdp1", "cases": (("reduce_unset", "bf16", None),)}
    verdict = verdict_mixed_precision_peak(ranks.run(rank_mixed_precision_peak, **params), params)
    assert verdict.passed, verdict.message
    assert verdict.figures["cast_forward_inputs"] is True
    assert verdict.data["input_casts"]["reduce_unset"]["fix"] == INPUT_CASTS_FIX
    assert "FSDP1's MixedPrecision defaults could not run this model" in verdict.message
