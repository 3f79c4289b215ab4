"""What every memory check measures: the reference model, the user's per-layer step and its faults.

Shared by the check families of :mod:`fsdp_conformance.claims.memory`:

* the reference model (:data:`DEFAULT_SPEC`) and the error a check raises when asked for what it
  cannot measure (:class:`MemoryCheckError`);
* the measured step: :func:`per_layer_step` is the user's training step, wrapped per layer as
  the claim says it should be (the step the faults replace); :func:`wrapped_step` measures a
  comparison wrapping that a check itself runs (monolithic, for the picture and for depth
  invariance's reference); both return a :class:`StepResult`;
* the negative controls (:data:`FAULTS`): the user's code wrapping naively, or a tracker
  entered too late;
* the precondition that makes the per-layer claims measurable (:func:`require_sharding`), the
  largest unit's bytes, and how the verdicts write figures (:func:`mb`, :func:`check_label`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict, cast

from fsdp_conformance.claims.faults import (
    Fault,
    FaultEffect,
    FaultTable,
    patched_attr,
    with_default,
)
from fsdp_conformance.fsdp.sharding import InputCasts
from fsdp_conformance.harness import RankContext, skip_rank
from fsdp_conformance.measure.bound import MeasureError, StepConfig
from fsdp_conformance.measure.step import measure_step
from fsdp_conformance.models.model_spec import ModelSpec
from fsdp_conformance.models.reference_models import ModelConfig
from fsdp_conformance.models.units import ROOT, UnitInfo
from fsdp_conformance.sizes import format_bytes

# step is imported at module top: a parent that loaded the memory claim has its ranks' fork
# server preload step (and torch's memory trackers with it), instead of every rank importing
# them at its first check.

#: The reference model of the memory checks: the seeds' MassiveModel at dim 256 (2.4 MB per
#: layer in fp32, so allocator noise and small tensors do not dominate), 8 layers.
DEFAULT_SPEC = ModelSpec(reference="massive", config=ModelConfig(num_layers=8, dim=256))

#: The wrapping the claim is about: one unit per block (``policies.WRAPPINGS``).
PER_LAYER = "per_layer"


class MemoryCheckError(MeasureError):
    """A memory check was asked for something it cannot measure; the message says the fix."""


class StepResult(TypedDict):
    """One measured step on one rank (:func:`fsdp_conformance.measure.step.measure_step`'s data)."""

    rank: int
    #: The wrapping label the step ran (``per_layer`` unless a fault or a comparison says).
    wrapping: str
    version: str
    seconds: float
    #: One reading per meter (``meters.meter_data``): source, start, peak, end, breakdown.
    meters: list[dict[str, Any]]
    #: What every meter must at least see: this rank's parameter shards.
    param_bytes: int
    timeline: list[dict[str, Any]]
    #: The actual units (``UnitInfo.to_dict``).
    units: list[dict[str, Any]]
    collectives: dict[str, int]
    checkpointed: list[str]
    #: None: mixed precision ran as users write it. Else FSDP1's defaults raised its input-dtype
    #: error and the step measured is the one with ``cast_forward_inputs=True``.
    input_casts: InputCasts | None


def per_layer_step(ctx: RankContext, spec: ModelSpec, version: str, **options: Any) -> StepResult:
    """The user's training step: ``spec`` wrapped per layer, measured (``options``: of
    :func:`~fsdp_conformance.measure.step.measure_step`).

    The checks call it as ``measurement.per_layer_step``, looked up at call time: a fault of
    :data:`FAULTS` replaces it for the duration of one rank function."""
    return wrapped_step(ctx, spec, version, PER_LAYER, **options)


def wrapped_step(
    ctx: RankContext, spec: ModelSpec, version: str, wrapping: str, **options: Any
) -> StepResult:
    """One measured step of ``spec`` wrapped as ``wrapping`` (a label of ``policies.WRAPPINGS``)."""
    return cast(StepResult, measure_step(ctx, spec, version, wrapping, **options))


# --------------------------------------------------------------------------------------------
# Faults: the user's step done wrong (negative controls)
# --------------------------------------------------------------------------------------------


def _wraps_as(label: str) -> FaultEffect:
    def step(ctx: RankContext, spec: ModelSpec, version: str, **options: Any) -> StepResult:
        return wrapped_step(ctx, spec, version, label, **options)

    def effect(ctx: RankContext) -> Any:
        return patched_attr(__name__, "per_layer_step", lambda _: step)

    return effect


def _tracker_entered_for_the_step(ctx: RankContext) -> Any:
    return patched_attr(
        __name__, "per_layer_step", lambda fn: with_default(fn, "track_construction", False)
    )


#: The memory claim's negative controls, each a step the user's code could take instead of the
#: per-layer one: the seeds' naive wrappings, per-layer without resharding, and a tracker that
#: never saw the model built.
FAULTS = FaultTable(
    monolithic=Fault(
        "the user wraps the whole model as one unit (the seeds' root-only wrapping)",
        _wraps_as("monolithic"),
    ),
    top_level=Fault(
        "the user wraps only the root's direct children (the seeds' top-level wrapping)",
        _wraps_as("top_level"),
    ),
    no_reshard=Fault(
        "the user wraps per layer but never reshards after forward (FSDP1 "
        "SHARD_GRAD_OP, FSDP2 reshard_after_forward=False)",
        _wraps_as("no_reshard"),
    ),
    untracked_construction=Fault(
        "torch's tracker is entered only for the step: it never sees FSDP1 allocate its flat "
        "parameters and gather buffers",
        _tracker_entered_for_the_step,
    ),
)


# --------------------------------------------------------------------------------------------
# Preconditions and figures
# --------------------------------------------------------------------------------------------


def require_sharding(ctx: RankContext, version: str) -> None:
    """Skip (on every rank alike) where the wrapping cannot change memory: FSDP1 at one rank.

    FSDP1 clamps every sharding strategy to NO_SHARD at world size 1 (torch's
    ``_init_core_state`` warns "FSDP is switching to use `NO_SHARD`"): units never gather or
    release, so per-layer and monolithic wrapping hold the same memory and neither the bound's
    negative controls nor the sawtooth can be told apart. FSDP2 still shards over a mesh of one
    (it gathers into separate unsharded parameters), so it is measured at world size 1.
    """
    if version == "fsdp1" and ctx.world_size == 1:
        skip_rank(
            "FSDP1 runs NO_SHARD at world size 1 (torch switches any sharding strategy to "
            "NO_SHARD): nothing is gathered or released, so the per-layer memory claims "
            "cannot be told apart from monolithic wrapping; run at world size >= 2"
        )


def block_bytes(units: Sequence[UnitInfo], config: StepConfig) -> int:
    """Unsharded bytes of the largest non-root unit (one layer of the per-layer plan)."""
    others = [u.numel for u in units if u.fqn != ROOT] or [u.numel for u in units]
    return max(others) * config.compute_bytes


def mb(n: float) -> str:
    """The memory claim's unit (decimal MB), from the one formatter."""
    return format_bytes(n, "MB")


def check_label(params: Mapping[str, Any], wrapping: str = PER_LAYER) -> str:
    """The head of a verdict's message: the wrapping measured, the FSDP version, the model."""
    spec = params.get("spec", DEFAULT_SPEC)
    return f"{wrapping} wrapping, {params.get('version', 'fsdp2')}, {getattr(spec, 'name', spec)}"
