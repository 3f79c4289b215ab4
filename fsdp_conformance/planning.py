"""Plan at full scale in one process: the wrap plan and the memory estimate, nothing allocated.

``fsdp-conformance plan`` answers "what does this policy do to my real model, and how many
devices of this size does it need?" before anyone books GPUs:

* **The plan**: the model is built on ``meta`` and the policy's units are computed with
  :func:`~fsdp_conformance.units.plan_units` (torch's own FSDP1 auto-wrap decisions, no
  process group).
* **The estimate**: the documented per-layer bound of :mod:`~fsdp_conformance.memory`
  (:func:`~fsdp_conformance.memory.per_layer_bound`, term by term, docs/memory.md), with the
  activations profiled by a forward on meta (:func:`~fsdp_conformance.memory.profile_activations`).
  There is no second formula here: this module only chooses the inputs (policy, dtypes,
  optimizer, batch) and searches world sizes.
* **The cross-check**: FSDP2 applied for real to the meta model on a fake process group of the
  requested world size (``fully_shard`` per unit, then the root), reading each unit's actual
  local shard on rank 0 and comparing it with the analytic ``ceil(dim0 / W)`` padding.
* **Trust** (:data:`CHECKS`): the estimate against measured peaks of real training steps at
  small scale (the memory checks' :func:`~fsdp_conformance.memory.measure_step`), on every rank.

docs/planning.md has the defaults, the 70B tables and the benchmark.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import re
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from fsdp_conformance.bound import (
    BOUND_TOLERANCE,
    OPTIMIZER_STATES,
    ActivationProfile,
    Bound,
    StepConfig,
    per_layer_bound,
)
from fsdp_conformance.claims.check import Check, Verdict
from fsdp_conformance.harness import RankContext
from fsdp_conformance.models import (
    LLAMA_PRESETS,
    REFERENCE_MODELS,
    LlamaConfig,
    ModelConfig,
    ModelSpec,
    ModelSpecError,
)
from fsdp_conformance.policies import SEED_MIN_PARAMS, PolicyError
from fsdp_conformance.profile import profile_activations
from fsdp_conformance.units import ROOT, UnitInfo

PROG = "fsdp-conformance plan"
#: Bytes per element of the dtypes a plan can use.
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
#: ``recommended`` = one unit per block (policies.recommended_policy); ``seeds`` = the seeds'
#: get_hybrid_policy (block type OR the size rule, which also fires inside the blocks);
#: ``monolithic`` = the root is the only unit.
POLICIES = ("recommended", "seeds", "monolithic")
#: ``--preset``: the Llama shapes of models.LLAMA_PRESETS, and the seeds' own MassiveModel at
#: the seeds' scale (dim 4096, 8 layers, vocab 32000).
PRESETS = (*LLAMA_PRESETS, "seeds")
OPTIMIZERS = tuple(k for k in OPTIMIZER_STATES if k) + ("none",)
#: flash: what fused attention saves for backward (q, k, v, output, logsumexp), as flash or
#: memory-efficient attention on GPU and the CPU flash kernel; math: the unfused path, which
#: also saves the seq x seq attention weights.
ATTENTION = ("flash", "math")
DEFAULT_DEVICE_MEMORY = "80GB,141GB"
#: World sizes of the seeds' claim table (and the default of --world-sizes).
CLAIM_WORLD_SIZES = (8, 64, 512, 1024)
#: The largest world size searched for "devices needed"; past it a plan "never fits".
MAX_WORLD_SIZE = 65536
#: Terms of the bound that shrink with the world size; the rest is the per-rank floor.
SHARDED_TERMS = ("sharded params", "sharded grads", "optimizer state")
#: The bound's transient terms of the unit being gathered (its working set).
UNIT_TERMS = ("unsharded params", "unsharded grads", "all-gather buffers",
              "reduce-scatter buffers")
ACTIVATION_TERMS = ("input batch", "saved activations", "activation working set")
#: The seeds' sentence, quoted by the claim table.
SEEDS_CLAIM = ("a generic 70B parameter model requires approximately 140GB of system RAM just to "
               "hold the float16 weights")

#: Trust: the estimate is an upper bound, checked with the memory checks' tolerance above it
#: (a measured peak may exceed it by at most 10%)...
TRUST_MAX_RATIO = 1 + BOUND_TOLERANCE
#: ...and it must not be loose beyond what was measured for each policy (docs/planning.md):
#: per-layer plans measured 0.49 to 1.08 of the estimate; monolithic 0.32 to 0.78 (its one
#: unit's forward products and both collective buffers are counted at full model size).
TRUST_MIN_RATIO = {"recommended": 0.45, "monolithic": 0.25}
#: measure_step builds its batch with models.make_batch, whose sequence length is 8.
MEASURED_SEQ_LEN = 8

UNITS_OF_BYTES = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
                  "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


class PlanError(ValueError):
    """Bad input to the planner; the message names the problem and the fix (exit code 2)."""


# ============================================================================================
# Settings and the model to plan
# ============================================================================================


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanSettings:
    """What one training step does, in the user's words (resolved to a StepConfig per W)."""

    #: One of :data:`POLICIES`.
    policy: str = "recommended"
    #: "fsdp1" or "fsdp2".
    version: str = "fsdp2"
    #: Sharded parameters, sharded gradients and optimizer state (the fp32 master copy).
    param_dtype: str = "fp32"
    #: Gathered parameters, unsharded gradients, all-gather/reduce-scatter and activations
    #: (bf16 mixed precision: FSDP2 ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``).
    compute_dtype: str = "bf16"
    #: One of :data:`OPTIMIZERS` ("none": forward and backward only).
    optimizer: str = "adamw"
    #: Per-rank micro-batch.
    batch_size: int = 1
    #: Tokens per sample (ignored when the model has its own input builder).
    seq_len: int = 4096
    #: One of :data:`ATTENTION`.
    attention: str = "flash"

    def __post_init__(self) -> None:
        for name, allowed in (("policy", POLICIES), ("version", ("fsdp1", "fsdp2")),
                              ("param_dtype", tuple(DTYPE_BYTES)),
                              ("compute_dtype", tuple(DTYPE_BYTES)),
                              ("optimizer", OPTIMIZERS), ("attention", ATTENTION)):
            if getattr(self, name) not in allowed:
                raise PlanError(f"{name.replace('_', '-')} {getattr(self, name)!r} is not one of "
                                f"{', '.join(allowed)}")
        for name in ("batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise PlanError(
                    f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")

    @property
    def optimizer_name(self) -> str | None:
        return None if self.optimizer == "none" else self.optimizer

    def describe(self) -> str:
        opt = "no optimizer" if self.optimizer == "none" else f"{self.optimizer} state"
        return (f"{self.version}; sharded params, grads and {opt} in {self.param_dtype}; "
                f"gathered params, unsharded grads, collectives and activations in "
                f"{self.compute_dtype}; per-rank batch {self.batch_size} x seq {self.seq_len}, "
                f"{self.attention} attention")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ModelChoice:
    """The model to plan and how to name it."""

    spec: ModelSpec
    label: str
    #: True for the full-scale presets: the seeds' policy then keeps its literal 2e7 threshold.
    full_scale: bool = False


def choose_model(*, preset: str | None = None, reference: str | None = None,
                 factory: str | None = None, block_cls: str | None = None,
                 min_params: int | None = None, layers: int | None = None,
                 dim: int | None = None, input_builder: str | None = None) -> ModelChoice:
    """A preset, a (small) reference model or the user's factory, with one clear error each."""
    given = [n for n, v in (("--preset", preset), ("--reference", reference), ("--model", factory))
             if v is not None]
    if len(given) != 1:
        problem = "name one model, not " + " and ".join(given) if given else "no model given"
        raise PlanError(
            f"{problem}: "
            f"pass --preset ({', '.join(PRESETS)}), --reference NAME "
            f"({', '.join(REFERENCE_MODELS)}) or --model pkg.module:factory --block-cls CLASS")
    if min_params is not None and min_params < 1:
        raise PlanError(f"--min-params must be >= 1, got {min_params}")
    if factory is None and (block_cls or input_builder):
        raise PlanError("--block-cls and --input go with --model pkg.module:factory")
    if preset is not None:
        if layers is not None or dim is not None:
            raise PlanError("--layers and --dim change a --reference model; a preset has its "
                            "own shape (use --reference llama --layers N --dim D instead)")
        if preset == "seeds":
            spec = ModelSpec(reference="massive", config=ModelConfig.seeds_full_scale(),
                             min_params=min_params)
            return ModelChoice(spec, "the seeds' MassiveModel at full scale", full_scale=True)
        if preset not in LLAMA_PRESETS:
            raise PlanError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
        spec = ModelSpec(reference="llama", config=LLAMA_PRESETS[preset], min_params=min_params)
        return ModelChoice(spec, f"Llama {preset} preset", full_scale=True)
    if reference is not None:
        if reference not in REFERENCE_MODELS:
            raise PlanError(f"unknown reference model {reference!r}; choose one of "
                            f"{', '.join(REFERENCE_MODELS)} (or --preset {', '.join(PRESETS)})")
        config: ModelConfig | LlamaConfig = (LlamaConfig() if reference == "llama"
                                             else ModelConfig())
        # Any: mypy's dataclasses.replace plugin checks **changes against every field of the
        # union's members (their field sets differ), so dict[str, int] reads as "Never".
        changes: dict[str, Any] = {
            k: v for k, v in (("num_layers", layers), ("dim", dim)) if v is not None
        }
        try:
            config = dataclasses.replace(config, **changes)
        except ValueError as exc:
            raise PlanError(f"--reference {reference}: {exc}") from None
        spec = ModelSpec(reference=reference, config=config, min_params=min_params)
        return ModelChoice(spec, f"reference {reference} ({_config_label(config)})")
    if layers is not None or dim is not None:
        raise PlanError("--layers and --dim change a --reference model, not a --model factory")
    blocks = tuple(b.strip() for b in block_cls.split(",") if b.strip()) if block_cls else None
    spec = ModelSpec(reference=None, factory=factory, block_cls=blocks, min_params=min_params,
                     input_builder=input_builder)
    return ModelChoice(spec, f"{factory}")


def _config_label(config: ModelConfig | LlamaConfig) -> str:
    return f"{config.num_layers} layers, dim {config.dim}"


# ============================================================================================
# The plan: units and activations on meta
# ============================================================================================


@dataclasses.dataclass
class ModelPlan:
    """A policy's units and the step's activations for one model: everything but the W."""

    choice: ModelChoice
    settings: PlanSettings
    model_class: str
    units: list[UnitInfo]
    activations: ActivationProfile
    buffer_bytes: int
    #: Parameter shapes by FQN (for FSDP2's dim-0 padding).
    param_shapes: dict[str, tuple[int, ...]]
    seconds: float = 0.0

    @property
    def total_numel(self) -> int:
        return sum(u.numel for u in self.units)

    def step_config(self, world_size: int) -> StepConfig:
        s = self.settings
        return StepConfig(world_size=world_size, version=s.version,
                          param_bytes=DTYPE_BYTES[s.param_dtype],
                          compute_bytes=DTYPE_BYTES[s.compute_dtype],
                          optimizer=s.optimizer_name, buffer_bytes=self.buffer_bytes,
                          activations=self.activations)

    def estimate(self, world_size: int) -> Bound:
        """The per-rank peak of one training step at ``world_size``: memory's per-layer bound."""
        if world_size < 1:
            raise PlanError(f"world size must be >= 1, got {world_size}")
        return per_layer_bound(self.units, self.step_config(world_size))


def wrap_policy_for(model: Any, choice: ModelChoice, policy: str) -> Any:
    """The auto-wrap policy named ``policy`` for this model (see :data:`POLICIES`)."""
    from fsdp_conformance.policies import seeds_hybrid_policy
    from fsdp_conformance.profile import wrap_policy

    spec = choice.spec
    if policy == "recommended":
        return wrap_policy(model, spec, "per_layer")
    if policy == "monolithic":
        return wrap_policy(model, spec, "monolithic")
    if policy == "seeds":
        # At full scale the seeds' literal threshold (2e7); on a scaled-down model the same
        # threshold scaled with dim**2, as the rest of the suite does.
        threshold = (spec.min_params if spec.min_params is not None
                     else SEED_MIN_PARAMS if choice.full_scale else spec.size_threshold(model))
        return seeds_hybrid_policy(spec.block_classes(model), threshold)
    raise PlanError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")


def build_meta_model(choice: ModelChoice) -> Any:
    """The model on ``meta``: shapes only, no storage, at any size."""
    return choice.spec.build("meta")


def plan_model(choice: ModelChoice, settings: PlanSettings, model: Any = None) -> ModelPlan:
    """Units of ``settings.policy`` and the activation profile of one step, all on meta.

    ``model`` (a meta model of ``choice``) is reused when given, so several policies cost one
    build; it is left as it was (parameter dtypes restored).
    """
    from fsdp_conformance.units import plan_units

    start = time.perf_counter()
    model = build_meta_model(choice) if model is None else model
    _require_meta(model, choice)
    units = plan_units(model, wrap_policy_for(model, choice, settings.policy))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    buffer_bytes = sum(b.untyped_storage().nbytes() for b in model.buffers())
    activations = profile_step_activations(model, choice, units, settings)
    return ModelPlan(choice=choice, settings=settings, model_class=type(model).__name__,
                     units=units, activations=activations, buffer_bytes=buffer_bytes,
                     param_shapes=shapes, seconds=time.perf_counter() - start)


def _require_meta(model: Any, choice: ModelChoice) -> None:
    where = {p.device.type for p in model.parameters()} | {b.device.type for b in model.buffers()}
    if where - {"meta"}:
        raise PlanError(
            f"{choice.label} builds tensors on {', '.join(sorted(where - {'meta'}))} even under "
            "torch.device('meta'); create parameters without an explicit device= in the factory "
            "so planning allocates nothing")


def meta_batch(model: Any, choice: ModelChoice, settings: PlanSettings) -> Any:
    """An input batch on meta: token ids or float features, ``batch_size x seq_len``."""
    import torch

    from fsdp_conformance.models import make_batch

    spec, b, s = choice.spec, settings.batch_size, settings.seq_len
    if spec.input_builder:
        return spec.batch(model, b, "meta")
    if spec.reference is not None:
        if REFERENCE_MODELS[spec.reference].input_kind == "tokens":
            return torch.empty((b, s), dtype=torch.long, device="meta")
        return torch.empty((b, s, model.config.dim), device="meta")
    return make_batch(model, b, s, device="meta")


def profile_step_activations(model: Any, choice: ModelChoice, units: Sequence[UnitInfo],
                             settings: PlanSettings) -> ActivationProfile:
    """memory.profile_activations in the compute dtype, with the chosen attention kernel.

    Parameters (not buffers: FSDP's mixed precision leaves them alone) and float inputs are
    cast to the compute dtype for the forward, as FSDP's mixed precision casts them.
    """
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[
        settings.compute_dtype]
    batch = meta_batch(model, choice, settings)
    batch = torch.utils._pytree.tree_map(
        lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
        batch)
    with _params_in(model, dtype), _attention(settings.attention):
        try:
            return profile_activations(model, batch, units)
        except PlanError:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's forward on meta: one clear line
            raise PlanError(
                f"the forward of {choice.label} on meta failed ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}); planning needs a forward "
                "that runs on meta tensors (no .item(), no data-dependent shapes); pass "
                "--input pkg.module:builder if the default batch does not fit the model") from None


@contextlib.contextmanager
def _params_in(model: Any, dtype: Any) -> Iterator[None]:
    saved = {}
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            saved[p] = p.dtype
            p.data = p.data.to(dtype)  # meta: no storage, only the dtype changes
    try:
        yield
    finally:
        for p, original in saved.items():
            p.data = p.data.to(original)


@contextlib.contextmanager
def _attention(kind: str) -> Iterator[None]:
    """On meta, run scaled_dot_product_attention as the fused kernel ("flash") or unfused.

    On meta torch falls back to the unfused math path, which saves the seq x seq weights; the
    fused op (via _compat) saves what flash attention saves on GPU and on CPU.
    """
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    from fsdp_conformance import _compat

    op = _compat.flash_attention_cpu_op() if kind == "flash" else None
    if op is None:
        if kind == "flash":
            raise PlanError(f"torch {torch.__version__} has no fused attention op with a meta "
                            "kernel; rerun with --attention math (saves seq x seq weights)")
        yield
        return

    class FusedOnMeta(TorchFunctionMode):
        def __torch_function__(  # type: ignore[no-untyped-def]
            self, func, types, args=(), kwargs=None
        ):
            kwargs = dict(kwargs or {})
            if func is F.scaled_dot_product_attention and args and args[0].device.type == "meta":
                q, k, v, *rest = args
                names = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
                kwargs.update(zip(names, rest))
                if not kwargs.get("enable_gqa"):
                    out = op(q, k, v, dropout_p=kwargs.get("dropout_p", 0.0),
                             is_causal=kwargs.get("is_causal", False),
                             attn_mask=kwargs.get("attn_mask"), scale=kwargs.get("scale"))
                    return out[0]
            return func(*args, **kwargs)

    with FusedOnMeta():
        yield


# ============================================================================================
# World sizes: the estimate per W, devices needed, and the FSDP2 cross-check
# ============================================================================================


def term_sum(bound: Bound, names: Sequence[str]) -> int:
    return sum(t.bytes for t in bound.terms if t.name in names)


def breakdown(bound: Bound) -> dict[str, int]:
    """The estimate in three parts: sharded state, the gathered unit, activations (+ rest)."""
    sharded = term_sum(bound, SHARDED_TERMS)
    unit = term_sum(bound, UNIT_TERMS)
    acts = term_sum(bound, ACTIVATION_TERMS)
    return {"sharded_state": sharded, "unit_working_set": unit, "activations": acts,
            "other": bound.total - sharded - unit - acts, "total": bound.total}


@dataclasses.dataclass(frozen=True)
class DevicesNeeded:
    """The smallest world size at which the estimate fits a device, or why none does."""

    device_bytes: int
    #: None: does not fit at any world size up to ``max_world_size``.
    world_size: int | None
    #: The estimate at ``world_size`` (or at ``max_world_size`` when it never fits).
    estimate_bytes: int
    #: What does not shrink with more ranks (every term but the sharded state).
    floor_bytes: int
    max_world_size: int
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def devices_needed(plan: ModelPlan, device_bytes: int,
                   max_world_size: int = MAX_WORLD_SIZE) -> DevicesNeeded:
    """Smallest W in 1..max_world_size with ``estimate(W).total <= device_bytes``.

    Bisection: the estimate falls with W (sharded state ~ 1/W); the only terms that can rise
    are FSDP's padding to a multiple of W (under W elements per unit), negligible next to a
    device. When even ``max_world_size`` does not fit, the floor (all but the sharded state)
    is what no number of devices can remove: say which part of it is too big.
    """
    def total(w: int) -> int:
        return plan.estimate(w).total

    top = plan.estimate(max_world_size)
    floor = top.total - term_sum(top, SHARDED_TERMS)
    if top.total > device_bytes:
        return DevicesNeeded(device_bytes, None, top.total, floor, max_world_size,
                             _never_fits_reason(plan, top, device_bytes, max_world_size))
    if total(1) <= device_bytes:
        w = 1
    else:
        lo, hi = 1, max_world_size
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if total(mid) <= device_bytes else (mid, hi)
        w = hi
    at = plan.estimate(w)
    reason = (f"{w:,} rank{'s' if w > 1 else ''}: {fmt_bytes(at.total)} per rank "
              f"<= {fmt_bytes(device_bytes)}"
              + (f" (at {w - 1:,} ranks: {fmt_bytes(total(w - 1))})" if w > 1 else ""))
    return DevicesNeeded(device_bytes, w, at.total, floor, max_world_size, reason)


def _never_fits_reason(plan: ModelPlan, top: Bound, device: int, max_w: int) -> str:
    unit = term_sum(top, UNIT_TERMS)
    acts = term_sum(top, ACTIVATION_TERMS)
    floor = top.total - term_sum(top, SHARDED_TERMS)
    largest = max(plan.units, key=lambda u: u.numel)
    name = largest.fqn or f"{plan.model_class} (root)"
    parts = (f"largest unit {name} gathered with its grads and collective buffers "
             f"{fmt_bytes(unit)}, activations {fmt_bytes(acts)}")
    if unit > device:
        head = f"never fits: one unit's working set alone is {fmt_bytes(unit)}"
        fix = "a policy with smaller units"
    else:
        head = f"never fits: {fmt_bytes(floor)} per rank does not shrink with more ranks"
        fix = ("a smaller per-rank batch or sequence, or activation checkpointing (not modelled)"
               if acts > unit else "a policy with smaller units")
    return f"{head} ({parts}) > {fmt_bytes(device)} even at {max_w:,} ranks; fix: {fix}"


def fsdp2_padded_local_numel(plan: ModelPlan, unit: UnitInfo, world_size: int) -> int:
    """FSDP2's per-rank shard of a unit: each parameter's dim 0 padded to a multiple of W."""
    total = 0
    for name in unit.params:
        shape = plan.param_shapes[name]
        rows = shape[0] if shape else 1
        rest = math.prod(shape[1:]) if len(shape) > 1 else 1
        total += -(-rows // world_size) * rest
    return total


def verify_fsdp2_shards(plan: ModelPlan, world_size: int, model: Any = None) -> dict[str, Any]:
    """Apply FSDP2 to the meta model on a fake process group of ``world_size`` ranks.

    Reads every unit's actual local shard on rank 0 (the largest: FSDP2 gives rank 0 a full
    chunk) and compares it with the analytic dim-0 padding and with the estimate's
    ``ceil(numel / W)``. Shards ``model`` in place (build a fresh one when not given). Needs
    this process to have no default process group of its own (it makes and destroys one).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_conformance import _compat
    from fsdp_conformance.sharding import shard_fsdp2_modules
    from fsdp_conformance.units import fsdp2_units, unit_differences

    if dist.is_available() and dist.is_initialized():
        return {"skipped": "this process already has a default process group; the fake one "
                           "needs its own (run the plan in a fresh process)"}
    start = time.perf_counter()
    model = build_meta_model(plan.choice) if model is None else model
    store = _compat.fake_store_cls()()  # importing its module registers the "fake" backend
    dist.init_process_group("fake", store=store, rank=0, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        modules = [model.get_submodule(u.fqn) for u in plan.units if u.fqn != ROOT]
        shard_fsdp2_modules(model, None, modules, mesh=mesh)  # type: ignore[arg-type]
        actual = fsdp2_units(model)
    finally:
        dist.destroy_process_group()
    by_fqn = {u.fqn: u for u in actual}
    rows: list[dict[str, Any]] = []
    mismatched: list[str] = []
    for u in plan.units:
        got = by_fqn.get(u.fqn)
        padded = fsdp2_padded_local_numel(plan, u, world_size)
        local = got.local_numel if got is not None else None
        rows.append({"fqn": u.fqn, "numel": u.numel, "local_numel": local,
                     "padded_numel": padded, "ceil_numel": -(-u.numel // world_size)})
        if local != padded:
            mismatched.append(u.fqn or "(root)")
    structure = unit_differences(plan.units, actual, compare=("cls", "numel"))
    ceil_total = sum(r["ceil_numel"] for r in rows)
    local_total = sum(r["local_numel"] or 0 for r in rows)
    return {
        "world_size": world_size, "rank": 0, "seconds": time.perf_counter() - start,
        "units": rows, "unit_differences": structure,
        "matches": not mismatched and not structure, "mismatched": mismatched,
        "local_numel": local_total, "ceil_numel": ceil_total,
        # What the padding adds per rank to every sharded-state term (params, grads, state).
        "padding_numel": local_total - ceil_total,
        "padding_bytes_per_state": (local_total - ceil_total)
        * DTYPE_BYTES[plan.settings.param_dtype],
    }


# ============================================================================================
# Reports: a table for people, JSON for tools
# ============================================================================================


def fmt_bytes(n: float) -> str:
    """Decimal units (1 GB = 10^9 B), as device memory is quoted."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def parse_bytes(text: str, what: str = "--device-memory") -> int:
    """``80GB``, ``141 GB``, ``80GiB``, ``8e10``: bytes (GB = 10^9 B, GiB = 2^30 B)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in UNITS_OF_BYTES:
        raise PlanError(f"{what} {text!r} is not a size; write e.g. 80GB, 141GB or 80GiB")
    value = float(m.group(1)) * UNITS_OF_BYTES[unit]
    if value <= 0:
        raise PlanError(f"{what} {text!r} must be positive")
    return int(value)


def parse_world_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise PlanError(f"--world-sizes {text!r} is not a comma-separated list of integers; "
                        "write e.g. 8,64,512,1024") from None
    if not sizes or any(w < 1 for w in sizes):
        raise PlanError(f"--world-sizes {text!r} needs integers >= 1, e.g. 8,64,512,1024")
    return sizes


def _group_siblings(children: Sequence[UnitInfo], subtree: Mapping[str, tuple[Any, ...]]
                    ) -> list[list[UnitInfo]]:
    """Runs of consecutive siblings that differ only by one index (layers.0, layers.1, ...)."""
    groups: list[list[UnitInfo]] = []
    for u in children:
        if groups and _next_in_run(groups[-1], u) and subtree[u.fqn] == subtree[groups[-1][0].fqn]:
            groups[-1].append(u)
        else:
            groups.append([u])
    return groups


def _next_in_run(run: Sequence[UnitInfo], u: UnitInfo) -> bool:
    a, b = run[-1].fqn.split("."), u.fqn.split(".")
    if len(a) != len(b) or run[-1].cls != u.cls or run[-1].numel != u.numel:
        return False
    diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    if len(diff) != 1 or not (a[diff[0]].isdigit() and b[diff[0]].isdigit()):
        return False
    if int(b[diff[0]]) != int(a[diff[0]]) + 1:
        return False
    if len(run) > 1:  # the run must vary the same component
        first = run[0].fqn.split(".")
        if [i for i, (x, y) in enumerate(zip(first, a)) if x != y] != diff:
            return False
    return True


def format_plan_tree(plan: ModelPlan, world_size: int, verification: Mapping[str, Any] | None
                     = None, collapse: bool = True) -> str:
    """The units as a tree with params, all-gather bytes and the per-rank shard.

    Identical consecutive siblings (``layers.0`` .. ``layers.79``) collapse into one line
    ``layers.{0..79} x80`` unless ``collapse`` is False.
    """
    s = plan.settings
    cb, pb = DTYPE_BYTES[s.compute_dtype], DTYPE_BYTES[s.param_dtype]
    local = {r["fqn"]: r["local_numel"] for r in (verification or {}).get("units", [])}
    by_parent: dict[str | None, list[UnitInfo]] = {}
    for u in plan.units:
        by_parent.setdefault(u.parent, []).append(u)

    subtree: dict[str, tuple[Any, ...]] = {}

    def signature(u: UnitInfo) -> tuple[Any, ...]:
        kids = tuple(signature(c) for c in by_parent.get(u.fqn, []))
        subtree[u.fqn] = (u.cls, u.numel, kids)
        return subtree[u.fqn]

    for root in by_parent.get(None, []):
        signature(root)
    head = (f"{'unit':<44} {'params':>15} {'all-gather ' + s.compute_dtype:>16} "
            f"{'shard/rank ' + s.param_dtype:>17}")
    if local:
        head += f" {'fsdp2 rank 0':>14}"
    lines = [head]

    def row(name: str, u: UnitInfo, count: int) -> str:
        each = " each" if count > 1 else ""
        text = (f"{name:<44} {u.numel:>15,} {fmt_bytes(u.numel * cb) + each:>16} "
                f"{fmt_bytes(-(-u.numel // world_size) * pb) + each:>17}")
        if local:
            got = local.get(u.fqn)
            text += f" {'-' if got is None else fmt_bytes(got * pb) + each:>14}"
        return text

    def walk(parent: UnitInfo | None, prefix: str) -> None:
        kids = by_parent.get(parent.fqn if parent else None, [])
        groups = _group_siblings(kids, subtree) if collapse else [[k] for k in kids]
        for i, group in enumerate(groups):
            u = group[0]
            last = i == len(groups) - 1
            branch = "" if parent is None else ("└── " if last else "├── ")
            if parent is None:
                name = f"{u.cls} (root)"
            else:
                rel = u.fqn[len(parent.fqn) + 1:] if parent.fqn else u.fqn
                if len(group) > 1:
                    rel = _range_name(rel, group, parent.fqn)
                name = f"{rel}  {u.cls}" + (f" x{len(group)}" if len(group) > 1 else "")
            lines.append(row(prefix + branch + name, u, len(group)))
            walk(u, prefix + ("" if parent is None else ("    " if last else "│   ")))

    walk(None, "")
    return "\n".join(lines)


def _range_name(rel: str, group: Sequence[UnitInfo], parent: str) -> str:
    first, last = group[0].fqn.split("."), group[-1].fqn.split(".")
    i = next(i for i, (x, y) in enumerate(zip(first, last)) if x != y)
    offset = len(parent.split(".")) if parent else 0
    parts = rel.split(".")
    parts[i - offset] = f"{{{first[i]}..{last[i]}}}"
    return ".".join(parts)


def format_bound(bound: Bound) -> str:
    """The estimate term by term, with how each term was computed."""
    width = max(len(t.name) for t in bound.terms)
    lines = [f"  {t.name:<{width}}  {fmt_bytes(t.bytes):>11}  {t.derivation}" for t in bound.terms]
    lines.append(f"  {'total':<{width}}  {fmt_bytes(bound.total):>11}  per rank")
    return "\n".join(lines)


def plan_report(plan: ModelPlan, world_size: int, device_bytes: Sequence[int],
                verification: Mapping[str, Any] | None = None,
                max_world_size: int = MAX_WORLD_SIZE) -> dict[str, Any]:
    """Everything ``plan`` prints, as plain data (the ``--json`` document)."""
    bound = plan.estimate(world_size)
    cb = DTYPE_BYTES[plan.settings.compute_dtype]
    pb = DTYPE_BYTES[plan.settings.param_dtype]
    return {
        "model": {"label": plan.choice.label, "name": plan.choice.spec.name,
                  "class": plan.model_class, "params": plan.total_numel},
        "settings": plan.settings.to_dict(),
        "world_size": world_size,
        "units": [{**u.to_dict(), "all_gather_bytes": u.numel * cb,
                   "shard_numel": -(-u.numel // world_size),
                   "shard_bytes": -(-u.numel // world_size) * pb} for u in plan.units],
        "sharded_param_bytes_per_rank": term_sum(bound, ("sharded params",)),
        "estimate": {**bound.to_dict(), "breakdown": breakdown(bound)},
        "activations": plan.activations.to_dict(),
        "devices_needed": [devices_needed(plan, d, max_world_size).to_dict() for d in device_bytes],
        "verification": dict(verification) if verification is not None else None,
        "plan_seconds": plan.seconds,
    }


def format_plan(plan: ModelPlan, report: Mapping[str, Any], collapse: bool = True) -> str:
    w = report["world_size"]
    s = plan.settings
    bound = Bound.from_dict(report["estimate"])
    lines = [f"{PROG}: {plan.choice.label} ({plan.model_class}, {plan.total_numel:,} params), "
             f"{s.policy} policy, world size {w:,}",
             f"settings: {s.describe()}", "",
             f"wrap plan: {len(plan.units)} units (GB = 10^9 B)",
             format_plan_tree(plan, w, report.get("verification"), collapse), "",
             f"sharded parameters per rank: {fmt_bytes(report['sharded_param_bytes_per_rank'])} "
             f"({s.param_dtype})", "",
             "estimated peak per rank of a training step (memory.per_layer_bound, "
             "docs/memory.md):", format_bound(bound), ""]
    lines.append("devices needed (smallest world size whose estimate fits the device):")
    for d in report["devices_needed"]:
        lines.append(f"  {fmt_bytes(d['device_bytes'])}: {d['reason']}")
    lines += _nested_note(plan)
    v = report.get("verification")
    if v:
        lines.append("")
        lines.append(_format_verification(v, s.param_dtype))
    return "\n".join(lines)


def _nested_note(plan: ModelPlan) -> list[str]:
    # memory.per_layer_bound counts the root plus the two largest other units as gathered; in
    # a nested plan (the seeds' policy) the enclosing unit stays gathered while its children
    # run, which the bound does not count. Say how much that is instead of hiding it.
    nested = [u for u in plan.units if u.parent not in (None, ROOT)]
    if not nested:
        return []
    parents = {u.parent for u in nested}
    biggest = max((u for u in plan.units if u.fqn in parents), key=lambda u: u.numel)
    cb = DTYPE_BYTES[plan.settings.compute_dtype]
    return [f"  note: {len(nested)} units are nested in other units; while one runs, its "
            f"enclosing unit stays gathered too (largest: {biggest.fqn}, "
            f"{fmt_bytes(biggest.numel * cb)}), which the per-layer bound does not count"]


def _format_verification(v: Mapping[str, Any], param_dtype: str) -> str:
    if "skipped" in v:
        return f"fsdp2 cross-check: skipped: {v['skipped']}"
    pb = DTYPE_BYTES[param_dtype]
    head = (f"fsdp2 cross-check (fully_shard on a {v['world_size']:,}-rank fake process group, "
            f"rank 0, {v['seconds']:.1f} s): ")
    if v["matches"]:
        text = (f"{head}every unit's local shard equals the analytic dim-0 padding "
                f"(ceil(dim0/W) rows per parameter): {v['local_numel']:,} elements per rank")
    else:
        text = (f"{head}MISMATCH in {', '.join(v['mismatched'][:8])}"
                + "".join(f"\n  {d}" for d in v["unit_differences"][:8]))
    pad = v["padding_numel"]
    return text + (f"\n  the estimate's ceil(numel/W) is {v['ceil_numel']:,}: FSDP2's padding "
                   f"adds {pad:,} elements ({fmt_bytes(pad * pb)} per sharded-state tensor "
                   f"kind) per rank" if pad else
                   "\n  equal to the estimate's ceil(numel/W): no padding at this world size")


# ============================================================================================
# The seeds' claim: fp16 weights of the 70B preset, per-rank memory per policy and W
# ============================================================================================


def compare_policies(choice: ModelChoice, settings: PlanSettings, world_sizes: Sequence[int],
                     device_bytes: Sequence[int], policies: Sequence[str] = POLICIES,
                     max_world_size: int = MAX_WORLD_SIZE) -> dict[str, Any]:
    """The estimate per policy and world size, and the devices each policy needs."""
    model = build_meta_model(choice)
    rows, needed, plans = [], {}, {}
    for policy in policies:
        plan = plan_model(choice, dataclasses.replace(settings, policy=policy), model)
        plans[policy] = plan
        largest = max(plan.units, key=lambda u: u.numel)
        for w in world_sizes:
            b = plan.estimate(w)
            rows.append({"policy": policy, "world_size": w, "units": len(plan.units),
                         "largest_unit": largest.fqn, "largest_unit_params": largest.numel,
                         **breakdown(b),
                         "fits": {str(d): b.total <= d for d in device_bytes}})
        needed[policy] = [devices_needed(plan, d, max_world_size).to_dict()
                          for d in device_bytes]
    total = next(iter(plans.values())).total_numel
    return {"model": {"label": choice.label, "params": total},
            "claim": {"text": SEEDS_CLAIM if choice.spec.config == LLAMA_PRESETS["70b"] else None,
                      "fp16_weight_bytes": total * DTYPE_BYTES["fp16"]},
            "settings": settings.to_dict(), "world_sizes": list(world_sizes),
            "device_bytes": list(device_bytes), "rows": rows, "devices_needed": needed}


def format_comparison(data: Mapping[str, Any]) -> str:
    m, claim = data["model"], data["claim"]
    settings = PlanSettings(**{**data["settings"], "policy": "recommended"})
    devices = data["device_bytes"]
    lines = [f'the seeds\' claim: "{claim["text"]}"'] if claim["text"] else []
    lines += [f"{m['label']}: {m['params']:,} params x 2 B (fp16) = "
             f"{fmt_bytes(claim['fp16_weight_bytes'])} of weights on one host", "",
             f"estimated peak per rank of a training step ({settings.describe()}):",
             f"{'policy':<12} {'units':>5} {'ranks':>6} {'sharded state':>14} "
             f"{'unit working set':>17} {'activations':>12} {'estimate':>11}  "
             + "  ".join(f"{'fits ' + fmt_bytes(d):>12}" for d in devices)]
    for r in data["rows"]:
        fits = "  ".join(f"{'yes' if r['fits'][str(d)] else 'no':>12}" for d in devices)
        lines.append(f"{r['policy']:<12} {r['units']:>5} {r['world_size']:>6,} "
                     f"{fmt_bytes(r['sharded_state']):>14} {fmt_bytes(r['unit_working_set']):>17} "
                     f"{fmt_bytes(r['activations']):>12} {fmt_bytes(r['total']):>11}  {fits}")
    lines += ["", "devices needed:"]
    for policy, items in data["devices_needed"].items():
        for d in items:
            lines.append(f"  {policy:<12} {fmt_bytes(d['device_bytes'])}: {d['reason']}")
    return "\n".join(lines)


# ============================================================================================
# Trust: the estimate against measured peaks of real steps at small scale
# ============================================================================================

#: The reference model of the trust check (the memory checks' shape, smaller).
DEFAULT_SPEC = ModelSpec(reference="massive", config=ModelConfig(num_layers=4, dim=128))
#: policy -> memory.measure_step's wrapping name.
MEASURED_WRAPPINGS = {"recommended": "per_layer", "monolithic": "monolithic"}


def default_cases(spec: ModelSpec, version: str) -> list[dict[str, Any]]:
    """Per-layer with and without AdamW; monolithic too on reference models (it fits there)."""
    cases = [{"spec": spec, "version": version, "policy": "recommended", "optimizer": "none"},
             {"spec": spec, "version": version, "policy": "recommended", "optimizer": "adamw"}]
    if spec.reference is not None:
        cases.append({"spec": spec, "version": version, "policy": "monolithic",
                      "optimizer": "none"})
    return cases


def rank_measure_peaks(ctx: RankContext, spec: ModelSpec = DEFAULT_SPEC, version: str = "fsdp2",
                       cases: Sequence[Mapping[str, Any]] | None = None,
                       batch_size: int = 2) -> dict[str, Any]:
    """The measured peak of one training step per case on this rank (memory.measure_step)."""
    from fsdp_conformance.step import measure_step

    peaks = []
    for case in cases if cases is not None else default_cases(spec, version):
        policy = case["policy"]
        if policy not in MEASURED_WRAPPINGS:
            raise PlanError(f"policy {policy!r} cannot be measured; choose one of "
                            f"{', '.join(MEASURED_WRAPPINGS)}")
        opt = case.get("optimizer", "none")
        m = measure_step(ctx, case["spec"], case["version"], MEASURED_WRAPPINGS[policy],
                         optimizer=None if opt == "none" else opt,
                         batch_size=case.get("batch_size", batch_size), timeline=False)
        peaks.append({"peak": m["meters"][0]["peak"], "source": m["meters"][0]["source"]})
    return {"rank": ctx.rank, "peaks": peaks}


def trust_settings(case: Mapping[str, Any], batch_size: int = 2) -> PlanSettings:
    """The plan settings of what measure_step runs: fp32 throughout, its batch, seq 8."""
    return PlanSettings(policy=case["policy"], version=case["version"], param_dtype="fp32",
                        compute_dtype="fp32", optimizer=case.get("optimizer", "none"),
                        batch_size=case.get("batch_size", batch_size), seq_len=MEASURED_SEQ_LEN,
                        attention="flash")


def estimate_for_case(case: Mapping[str, Any], world_size: int, batch_size: int = 2) -> Bound:
    spec: ModelSpec = case["spec"]
    choice = ModelChoice(spec, spec.name)
    return plan_model(choice, trust_settings(case, batch_size)).estimate(world_size)


def compare_to_measurement(estimate: Bound, peaks_by_rank: Mapping[int, int], *,
                           min_ratio: float, max_ratio: float = TRUST_MAX_RATIO,
                           label: str = "") -> tuple[bool, list[str]]:
    """Every rank's measured peak within ``[min_ratio, max_ratio] x estimate``.

    Above: the estimate misses something (a term too small or absent): planning would call a
    device big enough when it is not. Below: it counts something that is not there. Returns
    (ok, one line per rank).
    """
    lines, ok = [], True
    for rank, peak in sorted(peaks_by_rank.items()):
        ratio = peak / estimate.total if estimate.total else float("inf")
        if ratio > max_ratio:
            ok = False
            verdict = (f"ABOVE {max_ratio:.2f} x the estimate: the estimate misses "
                       f"{fmt_bytes(peak - estimate.total)}")
        elif ratio < min_ratio:
            ok = False
            verdict = f"BELOW {min_ratio:.2f} x the estimate: the estimate is too loose"
        else:
            verdict = "ok"
        lines.append(f"{label}rank {rank}: measured {fmt_bytes(peak)}, estimate "
                     f"{fmt_bytes(estimate.total)}, ratio {ratio:.3f}: {verdict}")
    return ok, lines


def _case_label(case: Mapping[str, Any]) -> str:
    spec: ModelSpec = case["spec"]
    cfg = spec.config
    shape = f" {cfg.num_layers}L d{cfg.dim}" if isinstance(cfg, (ModelConfig, LlamaConfig)) else ""
    return (f"{spec.name}{shape} {case['version']} {case['policy']} "
            f"opt={case.get('optimizer', 'none')}: ")


def trust_verdict(values: Sequence[Mapping[str, Any]], params: Mapping[str, Any]) -> Verdict:
    """The planning estimate of each case within the tolerance of every rank's measured peak."""
    spec = params.get("spec", DEFAULT_SPEC)
    version = params.get("version", "fsdp2")
    batch_size = params.get("batch_size", 2)
    cases = params.get("cases") or default_cases(spec, version)
    world_size = len(values)
    all_ok, lines, ratios, rows = True, [], [], []
    for i, case in enumerate(cases):
        # "estimates" (index -> Bound) replaces the planner's: the negative controls use it.
        bound = params.get("estimates", {}).get(i) or estimate_for_case(case, world_size,
                                                                         batch_size)
        peaks = {v["rank"]: v["peaks"][i]["peak"] for v in values}
        ok, case_lines = compare_to_measurement(
            bound, peaks, min_ratio=TRUST_MIN_RATIO[case["policy"]], label=_case_label(case))
        all_ok &= ok
        lines += case_lines
        ratios.append(round(max(peaks.values()) / bound.total, 3))
        rows.append({"case": _case_label(case).rstrip(": "), "estimate": bound.total,
                     "peaks": peaks, "terms": bound.to_dict()["terms"]})
    figures = {"cases": len(cases), "min_ratio": min(ratios), "max_ratio": max(ratios),
               "source": values[0]["peaks"][0]["source"]}
    head = (f"planning estimate vs measured peak ({values[0]['peaks'][0]['source']}), "
            f"{len(cases)} case(s) x {world_size} ranks; allowed ratio peak/estimate: "
            f"{', '.join(f'{p} {r:.2f}' for p, r in TRUST_MIN_RATIO.items())} to "
            f"{TRUST_MAX_RATIO:.2f}")
    if all_ok:
        return Verdict(True, f"{head}: all within (ratios {min(ratios):.3f} to "
                       f"{max(ratios):.3f})", figures, {"rows": rows})
    bad = [ln for ln in lines if not ln.endswith(": ok")]
    return Verdict(False, f"{head}: {len(bad)} outside:\n" + "\n".join(bad)
                   + "\nall cases:\n" + "\n".join(lines), figures, {"rows": rows})


CHECKS: tuple[Check, ...] = tuple(
    Check(name="memory.plan_estimate_matches", claim="memory",
          description="the planning estimate (per-layer bound on meta) against every rank's "
          "measured peak of a real step: at most 10% above it, and not too loose",
          rank_fn=rank_measure_peaks, verdict=trust_verdict,
          params={"spec": DEFAULT_SPEC, "version": version},
          # The CUDA allocator adds cuBLAS workspaces and block rounding, which the estimate
          # does not model; at the small sizes this check runs they would dominate.
          lanes=("cpu",))
    for version in ("fsdp1", "fsdp2")
)


# ============================================================================================
# The command line
# ============================================================================================


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # type: ignore[override]
        raise PlanError(f"{message}; see `{PROG} --help`")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=(
        "Wrap plan and per-rank memory estimate of one training step at full scale, in one "
        "process: the model is built on meta, nothing is allocated."))
    model = p.add_argument_group("model (exactly one)")
    model.add_argument("--preset", metavar="NAME",
                       help=f"a full-scale shape: {', '.join(PRESETS)} (seeds = the seeds' "
                       "MassiveModel, dim 4096, 8 layers)")
    model.add_argument("--reference", metavar="NAME",
                       help=f"a reference model at CPU size: {', '.join(REFERENCE_MODELS)}")
    model.add_argument("--model", dest="factory", metavar="PKG.MOD:FACTORY",
                       help="your model factory (called with no arguments under meta)")
    model.add_argument("--block-cls", metavar="CLASS[,CLASS]", help="your model's block class(es)")
    model.add_argument("--min-params", type=int, metavar="N",
                       help="size-rule threshold (default: 2e7 scaled with dim^2; the seeds' "
                       "policy on a preset keeps the literal 2e7)")
    model.add_argument("--input", dest="input_builder", metavar="PKG.MOD:BUILDER",
                       help="input builder(model, batch_size, device) for your model")
    model.add_argument("--layers", type=int, help="--reference only: number of blocks")
    model.add_argument("--dim", type=int, help="--reference only: width")
    step = p.add_argument_group("training step")
    step.add_argument("--policy", choices=POLICIES, default="recommended",
                      help="recommended (one unit per block), seeds (get_hybrid_policy), "
                      "monolithic (root only) [recommended]")
    step.add_argument("--fsdp-version", dest="version", choices=("fsdp1", "fsdp2"),
                      default="fsdp2", help="[fsdp2]")
    step.add_argument("--param-dtype", choices=tuple(DTYPE_BYTES), default="fp32",
                      help="sharded params, grads and optimizer state [fp32]")
    step.add_argument("--compute-dtype", choices=tuple(DTYPE_BYTES), default="bf16",
                      help="gathered params, unsharded grads, collectives, activations [bf16]")
    step.add_argument("--dtype", choices=tuple(DTYPE_BYTES),
                      help="both of the above (no mixed precision)")
    step.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="[adamw]")
    step.add_argument("--batch-size", type=int, default=1, help="per-rank micro-batch [1]")
    step.add_argument("--seq-len", type=int, default=4096, help="tokens per sample [4096]")
    step.add_argument("--attention", choices=ATTENTION, default="flash",
                      help="flash: fused kernel's saved set; math: also seq x seq weights "
                      "[flash]")
    scale = p.add_argument_group("scale")
    scale.add_argument("--world-size", type=int, default=8, help="ranks to plan for [8]")
    scale.add_argument("--device-memory", default=DEFAULT_DEVICE_MEMORY, metavar="SIZES",
                       help=f"device sizes for 'devices needed' (GB = 10^9 B, GiB = 2^30 B) "
                       f"[{DEFAULT_DEVICE_MEMORY}]")
    scale.add_argument("--max-world-size", type=int, default=MAX_WORLD_SIZE,
                       help=f"largest world size searched [{MAX_WORLD_SIZE}]")
    scale.add_argument("--no-verify", dest="verify", action="store_false",
                       help="skip the FSDP2 cross-check on the fake process group")
    out = p.add_argument_group("output")
    out.add_argument("--compare-policies", action="store_true",
                     help="the seeds' claim: fp16 weights, and the estimate of every policy at "
                     "--world-sizes")
    out.add_argument("--world-sizes", default=",".join(map(str, CLAIM_WORLD_SIZES)),
                     help="world sizes of --compare-policies [8,64,512,1024]")
    out.add_argument("--full-tree", action="store_true",
                     help="one line per unit (default: identical siblings collapsed)")
    out.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return p


def settings_from_args(args: argparse.Namespace) -> PlanSettings:
    param, compute = args.param_dtype, args.compute_dtype
    if args.dtype is not None:
        param = compute = args.dtype
    return PlanSettings(policy=args.policy, version=args.version, param_dtype=param,
                        compute_dtype=compute, optimizer=args.optimizer,
                        batch_size=args.batch_size, seq_len=args.seq_len,
                        attention=args.attention)


def run(argv: Sequence[str]) -> tuple[str, dict[str, Any], bool]:
    """Parse, plan and report: (text for people, data for tools, --json?). Raises PlanError."""
    args = build_parser().parse_args(list(argv))
    choice = choose_model(preset=args.preset, reference=args.reference, factory=args.factory,
                          block_cls=args.block_cls, min_params=args.min_params,
                          layers=args.layers, dim=args.dim, input_builder=args.input_builder)
    settings = settings_from_args(args)
    devices = [parse_bytes(x) for x in args.device_memory.split(",") if x.strip()]
    if not devices:
        raise PlanError("--device-memory is empty; write e.g. 80GB,141GB")
    if args.max_world_size < 1:
        raise PlanError(f"--max-world-size must be >= 1, got {args.max_world_size}")
    if args.compare_policies:
        data = compare_policies(choice, settings, parse_world_sizes(args.world_sizes), devices,
                                max_world_size=args.max_world_size)
        return format_comparison(data), data, args.json
    if args.world_size < 1:
        raise PlanError(f"--world-size must be >= 1, got {args.world_size}")
    model = build_meta_model(choice)
    plan = plan_model(choice, settings, model)
    verification = None
    if args.verify and settings.version == "fsdp2":
        verification = verify_fsdp2_shards(plan, args.world_size, model)
    report = plan_report(plan, args.world_size, devices, verification, args.max_world_size)
    return format_plan(plan, report, collapse=not args.full_tree), report, args.json


def main(argv: Sequence[str] | None = None) -> int:
    """``fsdp-conformance plan ARGS``: 0 ok, 2 bad input (one line on stderr naming the fix)."""
    try:
        text, data, as_json = run(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except (PlanError, ModelSpecError, PolicyError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(data, indent=2, default=str) if as_json else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
