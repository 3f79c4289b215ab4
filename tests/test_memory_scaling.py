"""Memory claims at a resolvable scale.

A user's model at a small width (hidden 64) is below what the sawtooth and the meter
cross-check resolve; instead of skipping, the checks measure the user's model scaled to the
smallest size that resolves (``claims/memory/common.py``) and say so. Negative controls: the
monolithic fault on the scaled model still breaks the sawtooth; a tracker blind to FSDP1's
construction still disagrees with the OS figure at the scaled size; a model whose width cannot
be set skips, naming what it would need.
"""

from __future__ import annotations

import types
from typing import Any, cast

import pytest
import torch
from torch import nn

from fsdp_conformance.claims.check import run_check
from fsdp_conformance.claims.memory import CHECKS
from fsdp_conformance.claims.memory.common import (
    METER_ESTIMATE_MARGIN,
    SAWTOOTH_MIN_UNIT_BYTES,
    ScaledSpec,
    for_meter,
    step_estimate,
    unit_bytes,
)
from fsdp_conformance.gate.plots import report_panels
from fsdp_conformance.harness import CheckSkipped, Ranks
from fsdp_conformance.measure.meters import METER_RESOLUTION_BYTES
from fsdp_conformance.models.model_spec import ModelSpec

HF = "fsdp_conformance.hf_models"
SAWTOOTH = {c.params["version"]: c for c in CHECKS if c.name == "memory.sawtooth"}
PEAK = {c.params["version"]: c for c in CHECKS if c.name == "memory.peak_within_bound"}
METER = {c.params["version"]: c for c in CHECKS if c.name == "memory.meter_agrees"}


# ------------------------------------------------------------------------------------------
# Factories the ranks import by path (this module)
# ------------------------------------------------------------------------------------------


class WideBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    """Two blocks between an input and an output linear."""

    def __init__(self, width: int, num_layers: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.blocks = nn.ModuleList(WideBlock(width) for _ in range(num_layers))
        self.out = nn.Linear(width, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return cast(torch.Tensor, self.out(x))


class PairedHeadBlock(WideBlock):
    """A block whose kernel splits the width into heads of 32 and needs an even number of
    them (one head is fine): it runs at widths 32, 64, 128, not 96 or 160."""

    def __init__(self, width: int) -> None:
        super().__init__(width)
        self.width = width
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = self.width // 32
        assert heads == 1 or heads % 2 == 0, f"{heads} heads: the kernel pairs heads"
        return super().forward(x)


class PairedHeads(Stack):
    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.blocks = nn.ModuleList(PairedHeadBlock(dim) for _ in range(2))


def paired_heads(dim: int = 32) -> nn.Module:
    """Width 32 (one head): runs as configured; its smallest width that resolves the sawtooth
    (96, three heads) is one it cannot run."""
    return PairedHeads(dim)


def one_width_only(dim: int = 32) -> nn.Module:
    """Runs at its own width and at no other the suite may choose."""
    model = PairedHeads(dim)
    for block in model.blocks:
        block.width = 96 if dim != 32 else 32  # type: ignore[assignment]
    return model


def fixed_stack() -> nn.Module:
    """Width 32, nothing to set it with: neither a width keyword nor a transformers config."""
    return Stack(32)


def fixed_wide() -> nn.Module:
    """Width 256, not settable: units that resolve, a step whose activations grow with the
    batch."""
    return Stack(256)


def keyword_stack(hidden_size: int = 32, num_layers: int = 2) -> nn.Module:
    """Width 32 by default, settable through its ``hidden_size=`` keyword."""
    return Stack(hidden_size, num_layers)


def _spec(factory: str, **kwargs: Any) -> ModelSpec:
    return ModelSpec(reference=None, factory=factory, **kwargs)


def _ctx(world_size: int = 2) -> Any:
    """What the sizing reads of a rank (one process: no group to agree with)."""
    return types.SimpleNamespace(world_size=world_size, device="cpu", rank=0)


# ------------------------------------------------------------------------------------------
# The sawtooth
# ------------------------------------------------------------------------------------------


@pytest.mark.cpu
@pytest.mark.world_size(2)
@pytest.mark.parametrize("version", ["fsdp1", "fsdp2"])
def test_sawtooth_of_a_small_transformers_model_is_measured_at_a_scaled_width(
    ranks: Ranks, version: str
) -> None:
    # hf_models.llama: hidden 64, 2 layers; its largest unit is 144 KiB (under 256 KiB), so on
    # main the sawtooth skipped ("use a larger config of the model").
    spec = _spec(f"{HF}:llama")
    check = SAWTOOTH[version]
    verdict = run_check(ranks.configured(skip=None), check, spec=spec)
    assert verdict.passed, verdict.message
    scaled = verdict.data["scaled"]
    assert (scaled["what"], scaled["setting"], scaled["before"]) == (
        "width",
        "config.hidden_size",
        64,
    )
    # The smallest width that resolves, in steps keeping every head's width even (4 heads).
    width = scaled["after"]
    assert width > 64 and width % 8 == 0
    bigger = ScaledSpec(**_fields(spec), width=width, width_keyword="config")
    smaller = ScaledSpec(**_fields(spec), width=width - 8, width_keyword="config")
    assert unit_bytes(bigger) >= SAWTOOTH_MIN_UNIT_BYTES > unit_bytes(smaller)
    assert scaled["also"]["intermediate_size"] == [128, 2 * width]
    assert scaled["also"]["head_dim"] == [16, width // 4]
    assert f"measured at a scaled size: config.hidden_size 64 -> {width}" in verdict.message
    assert "the largest unit of fsdp_conformance.hf_models:llama is 144 KiB" in verdict.message
    assert verdict.figures["teeth"] >= 2 and verdict.data["timeline"]
    # The summary's table shows it: the first of the key figures.
    assert next(iter(verdict.figures.items())) == (
        "measured_at",
        f"config.hidden_size {width} (scaled from 64)",
    )
    # The plot names the size it shows.
    entry = {
        "check": "memory.sawtooth",
        "lane": "cpu",
        "world_size": 2,
        "variant": f"{version},{spec.name}",
        "outcome": "passed",
        "data": dict(verdict.data),
    }
    (panel,) = report_panels({"checks": [entry]})
    assert panel["title"] == (
        f"{version.upper()}: memory.sawtooth (model {spec.name}, cpu, world size 2, "
        f"at config.hidden_size {width} (scaled from 64)): passed"
    )

    # Negative control: the user's code wrapping the whole model as one unit, on the same
    # scaled model, is no sawtooth.
    broken = run_check(ranks.configured(skip=None), check, spec=spec, fault="monolithic")
    assert not broken.passed
    assert "the timeline is not a per-unit sawtooth" in broken.message
    assert f"config.hidden_size 64 -> {width}" in broken.message


def _fields(spec: ModelSpec) -> dict[str, Any]:
    return {n: getattr(spec, n) for n in ModelSpec.__dataclass_fields__}


@pytest.mark.cpu
@pytest.mark.world_size(2)
def test_sawtooth_scales_a_factory_through_its_width_keyword(ranks: Ranks) -> None:
    spec = _spec(f"{__name__}:keyword_stack", block_cls=("WideBlock",))
    verdict = run_check(ranks.configured(skip=None), SAWTOOTH["fsdp2"], spec=spec)
    assert verdict.passed, verdict.message
    scaled = verdict.data["scaled"]
    # Multiples of the default width (what divided 32 divides them): 4 x 32 x 32 fp32 per unit
    # at 32 (16 KiB), 256 KiB needs 4x the width.
    assert (scaled["setting"], scaled["before"], scaled["after"]) == (
        "the factory's hidden_size= keyword",
        32,
        128,
    )
    assert "the factory's hidden_size= keyword 32 -> 128" in verdict.message


@pytest.mark.cpu
@pytest.mark.world_size(2)
def test_a_model_whose_width_cannot_be_set_skips_the_sawtooth_naming_what_it_needs(
    ranks: Ranks,
) -> None:
    spec = _spec(f"{__name__}:fixed_stack", block_cls=("WideBlock",))
    with pytest.raises(CheckSkipped) as skipped:
        run_check(ranks.configured(skip=None), SAWTOOTH["fsdp2"], spec=spec)
    reason = str(skipped.value)
    assert "the largest unit of" in reason and "it cannot be scaled" in reason
    assert "give the factory a width keyword (hidden_size=, d_model=" in reason
    assert "or make it return a transformers model whose config has hidden_size" in reason
    # The run still measured a timeline (peak_within_bound's step): the plot draws it.
    peak = run_check(ranks, PEAK["fsdp2"], spec=spec)
    entries = [
        {"check": name, "lane": "cpu", "world_size": 2, "variant": "fsdp2,x", "data": data}
        for name, data in (("memory.peak_within_bound", dict(peak.data)), ("memory.sawtooth", {}))
    ]
    (panel,) = report_panels({"checks": entries})
    assert panel["timelines"]["per_layer"] == peak.data["timeline"]
    # Beside a sawtooth panel of the same run the step is not drawn twice.
    entries[1]["data"] = dict(peak.data)
    assert len(report_panels({"checks": entries})) == 1


# ------------------------------------------------------------------------------------------
# The meter cross-check
# ------------------------------------------------------------------------------------------


@pytest.mark.cpu
def test_meter_size_is_the_smallest_width_estimated_to_resolve_else_the_batch() -> None:
    target = METER_ESTIMATE_MARGIN * METER_RESOLUTION_BYTES
    spec = _spec(f"{HF}:llama")
    assert step_estimate(spec, 2, "fsdp2", 2) < target  # about 1.9 MB: unscaled, it skips
    measured, batch, scaled = for_meter(_ctx(), spec, "fsdp2", 2)
    assert batch == 2 and scaled is not None and scaled["setting"] == "config.hidden_size"
    assert isinstance(measured, ScaledSpec)
    width = measured.width
    smaller = ScaledSpec(**_fields(spec), width=width - 8, width_keyword="config")
    assert step_estimate(measured, 2, "fsdp2", 2) >= target > step_estimate(smaller, 2, "fsdp2", 2)
    # No width to set: the batch grows instead, and the reason says why not the width.
    fixed = _spec(f"{__name__}:fixed_wide", block_cls=("WideBlock",))
    same, batch, scaled = for_meter(_ctx(), fixed, "fsdp2", 2)
    assert same == fixed and scaled is not None
    assert (scaled["what"], scaled["before"], scaled["after"]) == ("batch", 2, batch)
    assert (
        step_estimate(fixed, 2, "fsdp2", batch)
        >= target
        > step_estimate(fixed, 2, "fsdp2", batch - 1)
    )
    assert "its width cannot be set" in scaled["why"]
    # Nothing resolves within 32x the batch: a skip naming what the model would need.
    tiny = _spec(f"{__name__}:fixed_stack", block_cls=("WideBlock",))
    with pytest.raises(CheckSkipped, match="give the factory a width keyword .* at 32x the batch"):
        for_meter(_ctx(), tiny, "fsdp2", 2)
    # The reference models are the suite's own: measured as configured.
    reference = next(iter(METER.values())).params["spec"]
    assert for_meter(_ctx(), reference, "fsdp2", 2) == (reference, 2, None)


@pytest.mark.process  # two meter steps in fresh ranks with the allocator setting: ~35 s
@pytest.mark.world_size(2)
def test_meter_check_agrees_at_the_scaled_width_and_still_catches_a_blind_tracker(
    ranks: Ranks,
) -> None:
    spec = _spec(f"{HF}:llama")
    verdict = run_check(ranks.configured(skip=None), METER["fsdp1"], spec=spec)
    assert verdict.passed, verdict.message
    assert "measured at a scaled size: config.hidden_size 64 -> " in verdict.message
    assert verdict.data["scaled"]["what"] == "width"
    assert verdict.figures["measured_at"].startswith("config.hidden_size ")
    blind = run_check(
        ranks.configured(skip=None), METER["fsdp1"], spec=spec, fault="untracked_construction"
    )
    assert not blind.passed
    assert "the tracker disagrees with the os figure" in blind.message


@pytest.mark.cpu
def test_a_wider_copy_keeps_what_the_config_computes_and_what_it_maps() -> None:
    import transformers

    from fsdp_conformance.claims.memory.common import rebuild_with_width

    # Falcon's head_dim is a property without a setter (hidden_size / heads): it follows.
    falcon = transformers.FalconConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=1, num_attention_heads=4
    )
    with torch.device("meta"):
        wide = rebuild_with_width(transformers.FalconForCausalLM(falcon), 96)
    config: Any = wide.config
    assert (config.hidden_size, config.head_dim) == (96, 24)
    # T5 maps head_dim to d_kv (d_kv x heads == d_model here): the attention widens with it.
    t5 = transformers.T5Config(
        vocab_size=256, d_model=64, d_ff=128, d_kv=16, num_layers=1, num_heads=4
    )
    with torch.device("meta"):
        wide = rebuild_with_width(transformers.T5ForConditionalGeneration(t5), 80)
    config = wide.config
    assert (config.d_model, config.d_ff, config.d_kv) == (80, 160, 20)
    q = wide.get_submodule("encoder.block.0.layer.0.SelfAttention.q")
    assert tuple(q.weight.shape) == (80, 80)


# ------------------------------------------------------------------------------------------
# A width the model cannot run: the suite's choice, never the model's fault
# ------------------------------------------------------------------------------------------


def _sawtooth_scaling(factory: str) -> Any:
    from fsdp_conformance.claims.memory.common import Room, scale_width

    spec = ModelSpec(
        reference=None, factory=f"{__name__}:{factory}", block_cls=("PairedHeadBlock",)
    )
    return scale_width(
        spec, lambda s: unit_bytes(s) >= SAWTOOTH_MIN_UNIT_BYTES, Room(2, None), "too small"
    )


def test_a_width_the_model_cannot_run_is_passed_over_and_said() -> None:
    from fsdp_conformance.claims.memory.common import describe

    spec = ModelSpec(
        reference=None, factory=f"{__name__}:paired_heads", block_cls=("PairedHeadBlock",)
    )
    assert unit_bytes(spec) < SAWTOOTH_MIN_UNIT_BYTES  # as configured: too small
    scaled, scaling = _sawtooth_scaling("paired_heads")
    # 96 is the smallest that resolves (4 x 96 x 96 x 2 weights); three heads fail there.
    assert scaled.width == 128
    assert scaling["skipped"] == ["96 (AssertionError: 3 heads: the kernel pairs heads)"]
    assert describe(scaling) == (
        "measured at a scaled size: the factory's dim= keyword 32 -> 128 (the smallest that "
        "resolves; as configured, too small; the suite's widths 96 (AssertionError: 3 heads: "
        "the kernel pairs heads) did not run on meta, so it took the next that does (the "
        "suite's choice, not the model's fault))"
    )


def test_no_width_that_runs_is_the_suites_reason_not_the_models() -> None:
    reason = _sawtooth_scaling("one_width_only")
    assert isinstance(reason, str)
    assert reason.startswith("the widths it was built at did not run on meta (96 (AssertionError")
    assert reason.endswith("the suite's own choice of width, not the model's fault")


def partial_rotary_phi(num_layers: int = 2) -> nn.Module:
    """transformers' Phi with half its head dimension rotated: at hidden 72 (heads of 18) the
    rotary part (9) is odd and the forward fails; at 64 and 80 it runs."""
    import transformers

    config = transformers.PhiConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        intermediate_size=128,
        partial_rotary_factor=0.5,
        max_position_embeddings=64,
    )
    return transformers.PhiForCausalLM(config)


def test_a_partial_rotary_transformers_model_is_measured_at_a_width_it_runs() -> None:
    from fsdp_conformance.claims.memory.common import Room, scale_width

    spec = ModelSpec(reference=None, factory=f"{__name__}:partial_rotary_phi")
    # Any width from 72 resolves: the suite's first choice (72) is one Phi cannot run.
    out = scale_width(spec, lambda s: getattr(s, "width", 0) >= 72, Room(2, None), "small")
    assert not isinstance(out, str), out
    scaled, scaling = out
    assert (scaling["before"], scaling["after"]) == (64, 80)
    assert [s.split(" (")[0] for s in scaling["skipped"]] == ["72"]
    assert "RuntimeError: Attempting to broadcast a dimension" in scaling["skipped"][0]
