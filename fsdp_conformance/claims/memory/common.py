"""What the memory families share: the reference model, the user's per-layer step and its faults,
the step judged against the per-layer bound, and the user's model at a size the meters resolve.

Shared by the check families of :mod:`fsdp_conformance.claims.memory`:

* the reference model (:data:`DEFAULT_SPEC`) and the error a check raises when asked for what it
  cannot measure (:class:`MemoryCheckError`);
* the measured step: :func:`per_layer_step` is the user's training step, wrapped per layer as
  the claim says it should be (the step the faults replace); :func:`wrapped_step` measures a
  comparison wrapping that a check itself runs (monolithic, for the picture and for depth
  invariance's reference); both return a :class:`StepResult`; :func:`bounded_step` is the
  per-layer step with the bound it is judged against (``memory.peak_within_bound`` and
  ``memory.sawtooth``);
* the negative controls (:data:`FAULTS`, beside :func:`per_layer_step`, the step they patch):
  the user's code wrapping naively, or a tracker entered too late;
* the precondition that makes the per-layer claims measurable (:func:`require_sharding`), the
  largest unit's bytes, and how the verdicts write figures (:func:`mb`, :func:`check_label`).

The user's model at a size the meters resolve (``memory.sawtooth`` and ``memory.meter_agrees``
measure it when the model as configured is below the meters' resolution):

A model built at a small width (hidden 64, a few layers: what users point the suite at first)
has units of about 150 KB and a step that adds about 1 MB: under what the timeline tells apart
from activations (:data:`SAWTOOTH_MIN_UNIT_BYTES`) and under the OS figure's resolution
(:data:`~fsdp_conformance.measure.meters.METER_RESOLUTION_BYTES`). Instead of skipping, the two
checks measure a copy of the user's model scaled to the smallest size that resolves, and say so
(:class:`Scaling`, in the verdict's message and data). What is scaled, in this order, and why:

* **Width**, first and for the sawtooth only: a unit's gather is its parameters, which grow
  with the width (about its square); batch and sequence grow only the activations, which are
  what a gather must be told apart from. For the meter cross-check too: the width grows
  FSDP's own memory (unsharded parameters, gradients, gather and reduce-scatter buffers), which
  the tracker must see (a tracker blind to FSDP1's flat parameters is the check's negative
  control), not only activations. Set through the factory's width keyword
  (:data:`WIDTH_KEYWORDS`; whatever divided the default width divides its multiples, so widths
  are multiples of the default), else on a copy of a transformers model's config: ``hidden_size``
  and the fields that follow it (:data:`HF_WIDTH_FIELDS`, scaled by the same ratio; ``head_dim``
  where it is ``hidden_size / num_attention_heads``), in steps that keep every head's width an
  even integer (rotary embeddings need one).
* **Batch**, for the meter cross-check only, when the width cannot be set (or its largest
  factor is not enough): every model takes a batch size, an input builder included.
* **Sequence**: never. It grows the same activation bytes as the batch, but an input builder
  picks its own length, position limits cut it, and attention's score tensors grow with its
  square, so what is measured drifts further from the user's step.

The reference models are the suite's own and measured as configured (their default configs
resolve). A scaled model must still fit the host memory the cpu lane plans with
(:data:`~fsdp_conformance.models.user_model.CPU_BYTES_PER_PARAM` per parameter and rank).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypedDict, cast

import torch
from torch import nn

from fsdp_conformance.claims.faults import (
    Fault,
    FaultEffect,
    FaultTable,
    patched_attr,
    with_default,
)
from fsdp_conformance.fsdp.sharding import InputCasts
from fsdp_conformance.fsdp.tensors import listing
from fsdp_conformance.harness import CheckSkipped, RankContext, skip_rank
from fsdp_conformance.measure.bound import MeasureError, StepConfig, per_layer_bound
from fsdp_conformance.measure.meters import METER_RESOLUTION_BYTES
from fsdp_conformance.measure.profile import plan_step
from fsdp_conformance.measure.scaling import Candidates, smallest
from fsdp_conformance.measure.step import measure_step
from fsdp_conformance.models import hf
from fsdp_conformance.models.model_spec import (
    ModelSpec,
    ModelSpecError,
    call_model,
    depth_keyword,
    load_object,
)
from fsdp_conformance.models.reference_models import ModelConfig
from fsdp_conformance.models.units import ROOT, UnitInfo
from fsdp_conformance.models.user_model import CPU_BYTES_PER_PARAM, MEMORY_HEADROOM
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
    #: None: mixed precision ran as users write it. Else torch's defaults raised the version's
    #: known error and the step measured is the one with its fix (``sharding.with_known_fix``).
    input_casts: InputCasts | None
    #: FSDP2's batch-norm fix: its fp32 units by FQN, with their numel (empty otherwise).
    full_precision_units: dict[str, int]


def per_layer_step(ctx: RankContext, spec: ModelSpec, version: str, **options: Any) -> StepResult:
    """The user's training step: ``spec`` wrapped per layer, measured (``options``: of
    :func:`~fsdp_conformance.measure.step.measure_step`).

    The checks call it as ``common.per_layer_step``, looked up at call time: a fault of
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


#: Below this unsharded size of the largest unit, a unit's gather cannot be told apart from the
#: activations and allocator rounding between two hooks: the sawtooth is not measurable.
SAWTOOTH_MIN_UNIT_BYTES = 256 * 1024
#: The meter cross-check's step must be estimated (on meta) at this many times the meters'
#: resolution: the estimate (the per-layer bound less what exists before the step) is an upper
#: bound, and the OS figure of a step measured 0.33 to 0.62 of it (Llama and GPT-2 configs at
#: hidden 64 to 256, batch 2 and 8, FSDP1 and FSDP2, 2 ranks), so 4x leaves >= 1.3x.
METER_ESTIMATE_MARGIN = 4
#: A factory's keywords for its width, in the order looked for.
WIDTH_KEYWORDS = ("hidden_size", "d_model", "n_embd", "dim", "hidden_dim", "embed_dim", "width")
#: transformers config fields that grow with ``hidden_size`` (scaled by its ratio).
HF_WIDTH_FIELDS = (
    "intermediate_size",
    "n_inner",
    "ffn_dim",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
    "d_ff",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)
#: The widest a model is built at, as a multiple of its own width; the largest batch, as one
#: of its own batch size.
MAX_WIDTH_FACTOR = 16
MAX_BATCH_FACTOR = 32

#: ScaledSpec.width_keyword of a transformers model whose config is scaled.
CONFIG = "config"


class Scaling(TypedDict):
    """What a memory check scaled, from what to what, and why (the verdict's data)."""

    #: "width" or "batch".
    what: str
    #: How it was set: "config.hidden_size", "the factory's dim= keyword", "batch size".
    setting: str
    before: int
    after: int
    #: Other fields that followed it (config fields scaled by the same ratio): name -> [from, to].
    also: dict[str, list[int]]
    #: Why: the figure below the resolution at the user's size, and the resolution.
    why: str
    #: Widths the suite tried and the model could not run (on meta), each with the error: the
    #: suite's choice, not the model's fault; the measurement is at the next width that runs.
    skipped: list[str]


def describe(s: Scaling) -> str:
    """One sentence for a verdict's message."""
    also = "".join(f", {k} {a} -> {b}" for k, (a, b) in s["also"].items())
    skipped = (
        f"; the suite's widths {listing(s['skipped'], 3)} did not run on meta, so it took the "
        "next that does (the suite's choice, not the model's fault)"
        if s.get("skipped")
        else ""
    )
    return (
        f"measured at a scaled size: {s['setting']} {s['before']} -> {s['after']}{also} "
        f"(the smallest that resolves; as configured, {s['why']}{skipped})"
    )


def measured_at(s: Scaling | None) -> dict[str, str]:
    """The key figure a verdict leads with (the summary's table shows its first figures):
    ``{"measured_at": "config.hidden_size 88 (scaled from 64)"}``, empty when not scaled."""
    if not s:
        return {}
    return {"measured_at": f"{s['setting']} {s['after']} (scaled from {s['before']})"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScaledSpec(ModelSpec):
    """The user's model at another width: the factory's width keyword, or a copy of its
    transformers config (plain data, pickled to the ranks as a ModelSpec is)."""

    #: The width built at.
    width: int
    #: The factory's keyword for it, or :data:`CONFIG` (the transformers config's hidden_size).
    width_keyword: str

    def build(self, device: str | torch.device | None = None) -> nn.Module:
        if self.width_keyword == CONFIG:
            model = super().build(device)
            with torch.device(device) if device is not None else contextlib.nullcontext():
                return rebuild_with_width(model, self.width)
        assert self.factory is not None
        factory = load_object(self.factory, "model factory")
        kwargs: dict[str, Any] = {self.width_keyword: self.width}
        keyword = depth_keyword(factory) if self.depth is not None else None
        if keyword:
            kwargs[keyword] = self.depth
        called = ", ".join(f"{k}={v}" for k, v in kwargs.items())
        try:
            with torch.device(device) if device is not None else contextlib.nullcontext():
                model = factory(**kwargs)
                if self.depth is not None and keyword is None:
                    model = hf.rebuild_with_depth(model, self.depth)
        except Exception as exc:
            raise ModelSpecError(
                f"the memory checks' scaled copy of {self.factory!r} (called with {called}) "
                f"raised {type(exc).__name__}: {exc}; the factory must build at a multiple of "
                f"its default {self.width_keyword}=, or pass a larger config of the model"
            ) from exc
        if not isinstance(model, nn.Module):
            raise ModelSpecError(f"model factory {self.factory!r} returned no nn.Module")
        return model


# --------------------------------------------------------------------------------------------
# Width: a factory's keyword, or a transformers config
# --------------------------------------------------------------------------------------------


def width_keyword(factory: Callable[..., Any]) -> tuple[str, int] | None:
    """The factory's width keyword (:data:`WIDTH_KEYWORDS`) with its int default, or None."""
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return None
    for name in WIDTH_KEYWORDS:
        p = parameters.get(name)
        if (
            p is not None
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and isinstance(p.default, int)
            and not isinstance(p.default, bool)
            and p.default > 0
        ):
            return name, p.default
    return None


def _heads(config: Any) -> int:
    heads = getattr(config, "num_attention_heads", None)
    return heads if isinstance(heads, int) and heads > 0 else 1


def _config_width(model: nn.Module) -> int | None:
    if not hf.is_pretrained(model):
        return None
    width = getattr(model.config, "hidden_size", None)
    return width if isinstance(width, int) and not isinstance(width, bool) and width > 0 else None


def _width_fields(config: Any, width: int) -> dict[str, list[int]]:
    """The config fields that follow the width, and their values at ``width`` (hidden_size's
    ratio; ``head_dim`` where it is hidden_size / heads)."""
    old = int(config.hidden_size)
    out: dict[str, list[int]] = {}
    for name in HF_WIDTH_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            out[name] = [value, max(1, round(value * width / old))]
    head_dim = getattr(config, "head_dim", None)
    if isinstance(head_dim, int) and head_dim * _heads(config) == old:
        out["head_dim"] = [head_dim, width // _heads(config)]
    # A field computed from the others (Falcon's head_dim: a property without a setter)
    # follows hidden_size by itself.
    return {name: pair for name, pair in out.items() if _settable(config, name)}


def _settable(config: Any, name: str) -> bool:
    attr = getattr(type(config), name, None)
    return not (isinstance(attr, property) and attr.fset is None)


def rebuild_with_width(model: nn.Module, width: int) -> nn.Module:
    """The same transformers model class, built from a copy of its config at ``hidden_size``
    ``width`` (and the fields that follow it), as ``hf.rebuild_with_depth`` rebuilds at a depth."""
    config: Any = copy.deepcopy(model.config)
    for name, (_, new) in _width_fields(config, width).items():
        setattr(config, name, new)
    config.hidden_size = width
    rebuilt: nn.Module = type(model)(config)
    return rebuilt


def _width_candidates(spec: ModelSpec) -> tuple[str, int, int, Any] | None:
    """(keyword or CONFIG, the width as built, the step between candidate widths, the config),
    or None when the width cannot be set. Reference models are measured as configured."""
    if spec.factory is None:
        return None
    found = width_keyword(load_object(spec.factory, "model factory"))
    if found is not None:
        return found[0], found[1], found[1], None
    model = spec.build("meta")
    width = _config_width(model)
    if width is None:
        return None
    config: Any = model.config
    heads = _heads(config)
    if width % heads:
        return None
    # Every head's width stays an even integer: rotary embeddings split it in halves.
    return CONFIG, width, 2 * heads, config


@dataclasses.dataclass(frozen=True)
class Room:
    """What a scaled model may use: its ranks, and the host memory every rank has (the least
    over the ranks, agreed by :func:`room_of`; None where unknown)."""

    world_size: int
    available: int | None

    def fits(self, spec: ModelSpec) -> bool:
        numel = sum(p.numel() for p in spec.build("meta").parameters())
        need = numel * CPU_BYTES_PER_PARAM * self.world_size
        return not self.available or need <= MEMORY_HEADROOM * self.available


def room_of(ctx: RankContext) -> Room:
    """The ranks' :class:`Room`, the same on every rank (the least available memory of all):
    every rank must choose the same size, or their collectives would not match."""
    import torch.distributed as dist

    from fsdp_conformance.models.user_model import _available_host_bytes

    available = _available_host_bytes()
    least = torch.tensor([available or -1], dtype=torch.int64, device=ctx.device)
    if dist.is_initialized() and ctx.world_size > 1:
        dist.all_reduce(least, op=dist.ReduceOp.MIN)
    value = int(least.item())
    return Room(ctx.world_size, value if value > 0 else None)


def scale_width(
    spec: ModelSpec, resolves: Callable[[ModelSpec], bool], room: Room, why: str
) -> tuple[ModelSpec, Scaling] | str:
    """The spec at the smallest width that ``resolves``, or why it cannot be set (a reason)."""
    found = _width_candidates(spec)
    if found is None:
        return (
            "its width cannot be set: give the factory a width keyword ("
            + ", ".join(f"{k}=" for k in WIDTH_KEYWORDS)
            + ") or make it return a transformers model whose config has hidden_size"
        )
    keyword, width, step, config = found
    base = _fields(spec)

    def at(j: int) -> ScaledSpec:
        return ScaledSpec(**base, width=width + j * step, width_keyword=keyword)

    top = (MAX_WIDTH_FACTOR * width - width) // step
    # A width the model cannot run on meta is the suite's choice failing, where the model at
    # its own width runs there (a model whose forward meta cannot run at all, as Mixtral's
    # fp32 grouped matmul, is left to the measurement on real tensors).
    meta_tells = _runs_at_own_width(spec)
    tried = Candidates(
        lambda j: room.fits(at(j)) and resolves(at(j)) and (not meta_tells or runs_on_meta(at(j))),
        width,
        step,
    )
    j = smallest(tried.ok, top)
    if j is not None:
        j = tried.smallest_below(j)
    elif tried.failed:
        j = tried.first_ok(top)
    if j is None and tried.failed:
        return (
            f"the widths it was built at did not run on meta ({listing(tried.failed, 3)}): "
            "the suite's own choice of width, not the model's fault"
        )
    if j is None:
        biggest = at(top)
        if not room.fits(biggest):
            return (
                f"even the widest copy that fits the host memory (below {MAX_WIDTH_FACTOR}x its "
                "width) does not resolve: run on a larger config of the model, or the gpu lane"
            )
        return f"even at {MAX_WIDTH_FACTOR}x its width ({width + top * step}) it does not resolve"
    scaled = at(j)
    setting = "config.hidden_size" if keyword == CONFIG else f"the factory's {keyword}= keyword"
    also = _width_fields(config, scaled.width) if config is not None else {}
    skipped = [f for k, f in sorted(tried.failures.items()) if k < j]
    return scaled, Scaling(
        what="width",
        setting=setting,
        before=width,
        after=scaled.width,
        also=also,
        why=why,
        skipped=skipped,
    )


def runs_on_meta(spec: ModelSpec) -> bool:
    """``spec``'s model (at a width the suite chose) built and run forward on meta with its
    batch; raises what the model raises there (:class:`~fsdp_conformance.measure.scaling.
    Candidates` records it as the suite's choice failing)."""
    built = spec.instantiate("meta")
    with torch.no_grad():
        call_model(built.model, built.batch(batch_size=1, device="meta"))
    return True


def _runs_at_own_width(spec: ModelSpec) -> bool:
    try:
        return runs_on_meta(spec)
    except Exception:  # noqa: BLE001 - meta cannot tell for this model; the ranks will
        return False


def _fields(spec: ModelSpec) -> dict[str, Any]:
    """A ModelSpec's own fields (a ScaledSpec's too, less its width): to build a ScaledSpec."""
    names = {f.name for f in dataclasses.fields(ModelSpec)}
    return {n: getattr(spec, n) for n in names}


# --------------------------------------------------------------------------------------------
# The two checks' sizes
# --------------------------------------------------------------------------------------------


def unit_bytes(spec: ModelSpec) -> int:
    """Unsharded bytes (fp32) of the largest non-root unit of the per-layer plan, on meta."""
    from fsdp_conformance.models.units import plan_units

    built = spec.instantiate("meta")
    units = plan_units(built.model, built.policy("recommended"))
    return block_bytes(units, StepConfig(world_size=1))


def for_sawtooth(ctx: RankContext, spec: ModelSpec) -> tuple[ModelSpec, Scaling | None]:
    """The spec the sawtooth measures: ``spec``, or its smallest width whose largest unit is at
    least :data:`SAWTOOTH_MIN_UNIT_BYTES`; skips (every rank alike: from the spec alone) when
    the width cannot be set."""
    largest = unit_bytes(spec)
    if largest >= SAWTOOTH_MIN_UNIT_BYTES:
        return spec, None
    small = (
        f"the largest unit of {spec.name} is {largest / 1024:.0f} KiB unsharded, under "
        f"{SAWTOOTH_MIN_UNIT_BYTES // 1024} KiB: a gather that small cannot be told "
        "apart from activations in the timeline"
    )
    if spec.reference is not None:  # the suite's own models are measured as configured
        raise CheckSkipped(f"{small}; use a larger config of the model")
    out = scale_width(
        spec,
        lambda s: unit_bytes(s) >= SAWTOOTH_MIN_UNIT_BYTES,
        room_of(ctx),
        small,
    )
    if isinstance(out, str):
        raise CheckSkipped(
            f"{small}, and it cannot be scaled: {out} (batch and sequence grow only the "
            "activations a gather must be told apart from)"
        )
    return out


def step_estimate(spec: ModelSpec, world_size: int, version: str, batch_size: int) -> int:
    """What one step adds on a rank, estimated on meta: the per-layer bound less what exists
    before the step (sharded parameters, buffers, the batch; no optimizer state)."""
    from fsdp_conformance.measure.profile import plan_step

    units, config = plan_step(spec, world_size, version, batch_size=batch_size)
    bound = per_layer_bound(units, config)
    before = ("sharded params", "buffers", "input batch", "optimizer state")
    return bound.total - sum(t.bytes for t in bound.terms if t.name in before)


def for_meter(
    ctx: RankContext, spec: ModelSpec, version: str, batch_size: int
) -> tuple[ModelSpec, int, Scaling | None]:
    """The spec and batch size the meter cross-check measures: as given when the step is
    estimated at :data:`METER_ESTIMATE_MARGIN` x the resolution, else the smallest width, else
    the smallest batch that is; skips when neither resolves."""
    target = METER_ESTIMATE_MARGIN * METER_RESOLUTION_BYTES
    world_size = ctx.world_size
    if spec.reference is not None:  # the suite's own models are measured as configured
        return spec, batch_size, None
    seen = step_estimate(spec, world_size, version, batch_size)
    if seen >= target:
        return spec, batch_size, None
    why = (
        f"the step is estimated to add {mb(seen)}, under "
        f"{METER_ESTIMATE_MARGIN} x the meters' resolution of {mb(METER_RESOLUTION_BYTES)}"
    )
    out = scale_width(
        spec,
        lambda s: step_estimate(s, world_size, version, batch_size) >= target,
        room_of(ctx),
        why,
    )
    if not isinstance(out, str):
        return out[0], batch_size, out[1]
    j = smallest(
        lambda j: step_estimate(spec, world_size, version, batch_size * (1 + j)) >= target,
        MAX_BATCH_FACTOR - 1,
    )
    if j is None:
        raise CheckSkipped(
            f"{why}, and it cannot be scaled: {out}; at {MAX_BATCH_FACTOR}x the batch size "
            f"the step is still too small; use a larger config of the model"
        )
    after = batch_size * (1 + j)
    return (
        spec,
        after,
        Scaling(
            what="batch",
            setting="batch size",
            before=batch_size,
            after=after,
            also={},
            why=f"{why}; {out}, so the batch grows the activations instead and FSDP's own "
            "buffers are a smaller part of the step",
            skipped=[],
        ),
    )


# --------------------------------------------------------------------------------------------
# The per-layer step judged against its bound (memory.peak_within_bound, memory.sawtooth)
# --------------------------------------------------------------------------------------------


class PeakResult(StepResult):
    """One rank's measured step with the per-layer bound and plan it is judged against."""

    bound: dict[str, Any]
    #: The per-layer plan's units (``UnitInfo.to_dict``), the expected tree of a failure.
    plan: list[dict[str, Any]]
    compute_bytes: int
    #: Another wrapping's timeline and peak, for the picture (``compare_with``), or None.
    compare: dict[str, Any] | None


def bounded_step(
    ctx: RankContext,
    spec: ModelSpec,
    version: str,
    optimizer: str | None,
    batch_size: int,
    compare_with: str | None,
) -> PeakResult:
    """One measured step of the user's per-layer wrapping (:func:`per_layer_step`, looked up at
    call time: the faults replace it) plus the per-layer bound for this model and world size;
    ``compare_with`` also measures that wrapping's timeline (reference models only)."""
    require_sharding(ctx, version)
    units, config = plan_step(
        spec, ctx.world_size, version, optimizer=optimizer, batch_size=batch_size
    )
    step = per_layer_step(ctx, spec, version, optimizer=optimizer, batch_size=batch_size)
    result: PeakResult = {
        **step,
        "bound": per_layer_bound(units, config).to_dict(),
        "plan": [u.to_dict() for u in units],
        "compute_bytes": config.compute_bytes,
        "compare": None,
    }
    if compare_with and spec.reference is not None and compare_with != step["wrapping"]:
        other = wrapped_step(
            ctx, spec, version, compare_with, optimizer=optimizer, batch_size=batch_size
        )
        result["compare"] = {
            "wrapping": compare_with,
            "timeline": other["timeline"],
            "peak": other["meters"][0]["peak"],
        }
    return result
