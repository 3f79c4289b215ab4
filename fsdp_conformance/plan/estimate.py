"""The estimate: a policy's units and the step's activations on meta, memory's per-layer bound
per world size, the devices needed, and the policies side by side (the seeds' claim)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from fsdp_conformance._files import PlainData
from fsdp_conformance.measure.bound import (
    ActivationProfile,
    Bound,
    StepConfig,
    host_bytes,
    per_layer_bound,
)
from fsdp_conformance.models import hf
from fsdp_conformance.models.block_classes import no_block_class
from fsdp_conformance.models.llama import LLAMA_PRESETS
from fsdp_conformance.models.model_spec import BuiltModel
from fsdp_conformance.models.policies import PolicyName
from fsdp_conformance.models.units import UnitInfo
from fsdp_conformance.plan.activations import activations_by_unit
from fsdp_conformance.plan.model import (
    DTYPE_BYTES,
    POLICIES,
    ModelChoice,
    PlanError,
    PlanSettings,
    _require_meta,
    build_meta_model,
    checkpoint_every,
    checkpoint_ops,
)
from fsdp_conformance.sizes import ByteStyle, format_bytes, size_style

#: Device sizes as the devices report them (``nvidia-smi``, ``torch.cuda.mem_get_info``): A100 /
#: H100 "80GB" parts have 80 GiB, H200 "141GB" parts 143,771 MiB (140.4 GiB).
DEFAULT_DEVICE_MEMORY = "80GiB,140GiB"


@dataclasses.dataclass(frozen=True)
class DeviceReserve(PlainData):
    """Device memory a GPU rank holds outside the estimate's terms, kept free on each device
    by "devices needed" (docs/planning.md, "Device reserve").

    Stated allowances, not measurements (this project's machines have no GPU): set
    ``--device-reserve`` to what your runs show (``torch.cuda.mem_get_info()`` against
    ``torch.cuda.memory_allocated()`` after a step). Every term but the cuBLAS workspaces is
    outside torch's caching allocator, so no tracker or allocator figure the suite measures
    sees it.
    """

    #: The CUDA context and the kernels it loads (outside the caching allocator).
    cuda_context: int = 1_000_000_000
    #: NCCL's communicator buffers (outside the allocator): ``NCCL_BUFFSIZE`` (4 MiB) per
    #: channel, protocol and peer, tens of channels on NVLink; NVLS buffers on NVSwitch systems.
    nccl: int = 1_000_000_000
    #: cuBLAS / cuBLASLt workspaces: 32 MiB per handle and stream on Hopper and newer (NVIDIA's
    #: recommendation, torch's default; 4 MiB before), allocated through the caching allocator
    #: at the first matmul of each (handle, stream): four of them.
    cublas_workspaces: int = 4 * 32 * 2**20

    @property
    def total(self) -> int:
        return self.cuda_context + self.nccl + self.cublas_workspaces

    def describe(self, style: ByteStyle = "iec") -> str:
        return (
            f"{format_bytes(self.total, style)} kept free per device (CUDA context "
            f"{format_bytes(self.cuda_context, style)}, NCCL "
            f"{format_bytes(self.nccl, style)}, cuBLAS workspaces "
            f"{format_bytes(self.cublas_workspaces, style)})"
        )

    @classmethod
    def of_total(cls, total: int) -> DeviceReserve:
        """A user's own figure (``--device-reserve``), as one term."""
        if total < 0:
            raise PlanError(f"--device-reserve must be >= 0 bytes, got {total}")
        return cls(cuda_context=total, nccl=0, cublas_workspaces=0)


def plan_style(device_bytes: Sequence[int]) -> ByteStyle:
    """How a plan shows its figures: in GB (10^9 B) where every device size was given in GB,
    else in GiB (2^30 B), as devices report their memory (each device size is shown as given:
    :func:`~fsdp_conformance.sizes.size_style`)."""
    styles = {size_style(d) for d in device_bytes}
    return "decimal" if styles == {"decimal"} else "iec"


#: The reserve "devices needed" keeps unless told otherwise.
DEFAULT_RESERVE = DeviceReserve()
#: World sizes of the seeds' claim table (and the default of --world-sizes).
CLAIM_WORLD_SIZES = (8, 64, 512, 1024)
#: The largest world size searched for "devices needed"; past it a plan "never fits".
MAX_WORLD_SIZE = 65536
#: Terms of the bound that shrink with the world size; the rest is the per-rank floor.
SHARDED_TERMS = ("sharded params", "sharded grads", "optimizer state")
#: The bound's transient terms of the unit being gathered (its working set).
UNIT_TERMS = ("unsharded params", "unsharded grads", "all-gather buffers", "reduce-scatter buffers")
ACTIVATION_TERMS = ("input batch", "saved activations", "activation working set")
#: The seeds' sentence, quoted by the claim table.
SEEDS_CLAIM = (
    "a generic 70B parameter model requires approximately 140GB of system RAM just to "
    "hold the float16 weights"
)


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

    #: Class names of the model's blocks (the units activation checkpointing applies to).
    block_names: tuple[str, ...] = ()

    @property
    def checkpointed(self) -> tuple[str, ...]:
        """The block units run under activation checkpointing: every K-th block, in order."""
        k = checkpoint_every(self.settings.checkpointing)
        if k == 0:
            return ()
        blocks = [u.fqn for u in self.units if u.cls in self.block_names]
        return tuple(blocks[::k])

    @property
    def recompute_flops(self) -> int | None:
        """Forward FLOPs run again in backward per step and rank; None where not counted."""
        flops = self.activations.forward_flops
        ckpt = self.checkpointed
        if any(u not in flops for u in ckpt):
            return None
        if checkpoint_ops(self.settings.checkpointing):  # the kept ops are not run again
            return sum(flops[u] - self.activations.op_kept(u)[2] for u in ckpt)
        return sum(flops[u] for u in ckpt)

    def step_config(self, world_size: int) -> StepConfig:
        s = self.settings
        return StepConfig(
            world_size=world_size,
            version=s.version,
            param_bytes=DTYPE_BYTES[s.param_dtype],
            compute_bytes=DTYPE_BYTES[s.compute_dtype],
            reduce_bytes=None if s.reduce_dtype is None else DTYPE_BYTES[s.reduce_dtype],
            optimizer=s.optimizer_name,
            buffer_bytes=self.buffer_bytes,
            activations=self.activations,
            checkpointed=self.checkpointed,
            checkpoint_ops=checkpoint_ops(s.checkpointing),
            shard_group=self._shard_group(world_size),
            offload=s.cpu_offload,
        )

    def host_bytes(self, world_size: int) -> int:
        """Host memory per rank under CPU offload (0 without)."""
        return host_bytes(self.units, self.step_config(world_size))

    def _shard_group(self, world_size: int) -> int | None:
        group = self.settings.shard_group_size
        if group is not None and (group > world_size or world_size % group):
            raise PlanError(
                f"world size {world_size:,} is not a multiple of the shard group "
                f"size {group:,} (HSDP: replicas x shard group); choose a world "
                f"size such as {group * max(1, world_size // group):,}"
            )
        return group

    def with_settings(self, **changes: Any) -> ModelPlan:
        """The same plan with settings that do not change its units or profile (activation
        checkpointing, shard group, offload): nothing is profiled again."""
        return dataclasses.replace(self, settings=dataclasses.replace(self.settings, **changes))

    def with_checkpointing(self, checkpointing: str) -> ModelPlan:
        """The same plan with other activation checkpointing (nothing profiled again)."""
        return self.with_settings(checkpointing=checkpointing)

    def estimate(self, world_size: int) -> Bound:
        """The per-rank peak of one training step at ``world_size``: memory's per-layer bound."""
        if world_size < 1:
            raise PlanError(f"world size must be >= 1, got {world_size}")
        return per_layer_bound(self.units, self.step_config(world_size))


def plan_model(choice: ModelChoice, settings: PlanSettings, model: Any = None) -> ModelPlan:
    """Units of ``settings.policy`` and the activation profile of one step, all on meta.

    ``model`` (a meta model of ``choice``) is reused when given, so several policies cost one
    build; it is left as it was (parameter dtypes restored).
    """
    from fsdp_conformance.models.units import plan_units

    start = time.perf_counter()
    model = build_meta_model(choice) if model is None else model
    _require_meta(model, choice)
    if choice.spec.factory and not choice.spec.block_cls and not hf.is_pretrained(model):
        # The plan command's own flag, and the classes the model repeats.
        raise PlanError(no_block_class(model, choice.spec.name, "--block-cls"))
    built = BuiltModel(choice.spec, model)
    units = plan_units(model, built.policy(settings.policy, full_scale=choice.full_scale))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    buffer_bytes = sum(b.untyped_storage().nbytes() for b in model.buffers())
    activations = activations_by_unit(model, choice, units, settings)
    blocks = tuple(c.__name__ for c in built.blocks)
    return ModelPlan(
        choice=choice,
        settings=settings,
        model_class=type(model).__name__,
        units=units,
        activations=activations,
        buffer_bytes=buffer_bytes,
        param_shapes=shapes,
        seconds=time.perf_counter() - start,
        block_names=blocks,
    )


# ============================================================================================
# World sizes: the estimate per W and devices needed
# ============================================================================================


def term_sum(bound: Bound, names: Sequence[str]) -> int:
    return sum(t.bytes for t in bound.terms if t.name in names)


def breakdown(bound: Bound) -> dict[str, int]:
    """The estimate in three parts: sharded state, the gathered unit, activations (+ rest)."""
    sharded = term_sum(bound, SHARDED_TERMS)
    unit = term_sum(bound, UNIT_TERMS)
    acts = term_sum(bound, ACTIVATION_TERMS)
    return {
        "sharded_state": sharded,
        "unit_working_set": unit,
        "activations": acts,
        "other": bound.total - sharded - unit - acts,
        "total": bound.total,
    }


@dataclasses.dataclass(frozen=True)
class DevicesNeeded(PlainData):
    """The smallest world size at which the estimate fits a device, or why none does."""

    device_bytes: int
    #: Of ``device_bytes``, what the estimate must leave free (:class:`DeviceReserve`).
    reserve_bytes: int
    #: None: does not fit at any world size up to ``max_world_size``.
    world_size: int | None
    #: The estimate at ``world_size`` (or at ``max_world_size`` when it never fits).
    estimate_bytes: int
    #: What does not shrink with more ranks (every term but the sharded state).
    floor_bytes: int
    max_world_size: int
    reason: str


def devices_needed(
    plan: ModelPlan,
    device_bytes: int,
    max_world_size: int = MAX_WORLD_SIZE,
    reserve: DeviceReserve = DEFAULT_RESERVE,
) -> DevicesNeeded:
    """Smallest W in 1..max_world_size with ``estimate(W).total <= device_bytes - reserve``.

    Bisection: the estimate falls with W (sharded state ~ 1/W); the only terms that can rise
    are FSDP's padding to a multiple of W (under W elements per unit), negligible next to a
    device. When even ``max_world_size`` does not fit, the floor (all but the sharded state)
    is what no number of devices can remove: say which part of it is too big.
    """

    def total(w: int) -> int:
        return plan.estimate(w).total

    style = size_style(device_bytes)
    if plan.settings.shard_group_size is not None:
        return _hsdp_needed(plan, device_bytes, max_world_size, reserve)
    usable = device_bytes - reserve.total
    top = plan.estimate(max_world_size)
    floor = top.total - term_sum(top, SHARDED_TERMS)
    if top.total > usable:
        return DevicesNeeded(
            device_bytes,
            reserve.total,
            None,
            top.total,
            floor,
            max_world_size,
            _never_fits_reason(plan, top, device_bytes, reserve, max_world_size),
        )
    if total(1) <= usable:
        w = 1
    else:
        lo, hi = 1, max_world_size
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if total(mid) <= usable else (mid, hi)
        w = hi
    at = plan.estimate(w)
    reason = (
        f"{w:,} rank{'s' if w > 1 else ''}: {format_bytes(at.total, style)} per rank "
        f"<= {format_bytes(usable, style)} ({_less_reserve(device_bytes, reserve)})"
        + (f" (at {w - 1:,} ranks: {format_bytes(total(w - 1), style)})" if w > 1 else "")
        + (
            f"; host memory {format_bytes(plan.host_bytes(w), style)} per rank (cpu offload)"
            if plan.settings.cpu_offload
            else ""
        )
    )
    return DevicesNeeded(device_bytes, reserve.total, w, at.total, floor, max_world_size, reason)


def _hsdp_needed(
    plan: ModelPlan, device_bytes: int, max_world_size: int, reserve: DeviceReserve
) -> DevicesNeeded:
    """Under HSDP the per-rank estimate follows the shard group, whatever the replicas: it fits
    at one shard group (and at every multiple of it) or at none; the smallest shard group that
    fits is full sharding's answer."""
    group = plan.settings.shard_group_size or 1
    style = size_style(device_bytes)
    at = plan.estimate(group)
    floor = at.total - term_sum(at, SHARDED_TERMS)
    usable = device_bytes - reserve.total
    full = devices_needed(
        plan.with_settings(shard_group_size=None), device_bytes, max_world_size, reserve
    )
    smallest = (
        f"the smallest shard group that fits is {full.world_size:,} ranks"
        if full.world_size is not None
        else "no shard group fits (" + full.reason + ")"
    )
    if at.total <= usable:
        reason = (
            f"shard groups of {group:,} ranks (HSDP): {format_bytes(at.total, style)} "
            f"per rank <= {format_bytes(usable, style)} "
            f"({_less_reserve(device_bytes, reserve)}) at any multiple of {group:,} ranks; "
            f"{smallest}"
        )
        return DevicesNeeded(device_bytes, reserve.total, group, at.total, floor, group, reason)
    reason = (
        f"never fits with shard groups of {group:,} ranks (HSDP): "
        f"{format_bytes(at.total, style)} per rank > {format_bytes(usable, style)} "
        f"({_less_reserve(device_bytes, reserve)}), and more replicas do not shrink it; "
        f"fix: a larger shard group ({smallest})"
    )
    return DevicesNeeded(device_bytes, reserve.total, None, at.total, floor, group, reason)


def _less_reserve(device_bytes: int, reserve: DeviceReserve) -> str:
    style = size_style(device_bytes)
    return (
        f"{format_bytes(device_bytes, style)} less the "
        f"{format_bytes(reserve.total, style)} device reserve"
    )


def _never_fits_reason(
    plan: ModelPlan, top: Bound, device_bytes: int, reserve: DeviceReserve, max_w: int
) -> str:
    style = size_style(device_bytes)
    device = device_bytes - reserve.total
    unit = term_sum(top, UNIT_TERMS)
    acts = term_sum(top, ACTIVATION_TERMS)
    floor = top.total - term_sum(top, SHARDED_TERMS)
    largest = max(plan.units, key=lambda u: u.numel)
    name = largest.fqn or f"{plan.model_class} (root)"
    parts = (
        f"largest unit {name} gathered with its grads and collective buffers "
        f"{format_bytes(unit, style)}, activations {format_bytes(acts, style)}"
    )
    if unit > device:
        head = f"never fits: one unit's working set alone is {format_bytes(unit, style)}"
        fix = "a policy with smaller units"
    else:
        head = f"never fits: {format_bytes(floor, style)} per rank does not shrink with more ranks"
        fix = (
            (
                "a smaller per-rank batch or sequence, or activation checkpointing "
                "(--activation-checkpointing full, op or every-K)"
                if plan.settings.checkpointing != "full"
                else "a smaller per-rank batch or sequence"
            )
            if acts > unit
            else "a policy with smaller units"
        )
    return (
        f"{head} ({parts}) > {format_bytes(max(device, 0), style)} "
        f"({_less_reserve(device_bytes, reserve)}) even at {max_w:,} ranks; fix: {fix}"
    )


#: Activation checkpointing choices, cheapest (least recompute) first.
CHECKPOINTING_OPTIONS = ("none", "every-4", "every-3", "every-2", "op", "full")


def checkpointing_options(
    plan: ModelPlan,
    world_size: int,
    device_bytes: Sequence[int],
    max_world_size: int = MAX_WORLD_SIZE,
    reserve: DeviceReserve = DEFAULT_RESERVE,
) -> list[dict[str, Any]]:
    """Each choice of :data:`CHECKPOINTING_OPTIONS` (and the plan's own): the estimate at
    ``world_size``, the recompute per step and the devices each device size needs."""
    names = dict.fromkeys((*CHECKPOINTING_OPTIONS, plan.settings.checkpointing))
    rows = []
    for name in names:
        option = plan.with_checkpointing(name)
        rows.append(
            {
                "checkpointing": name,
                "checkpointed_units": len(option.checkpointed),
                "estimate_bytes": option.estimate(world_size).total,
                "recompute_flops": option.recompute_flops,
                "devices_needed": [
                    devices_needed(option, d, max_world_size, reserve).to_dict()
                    for d in device_bytes
                ],
            }
        )
    return rows


def cheapest_fit(
    options: Sequence[dict[str, Any]],
    plan: ModelPlan | None = None,
    reserve: DeviceReserve = DEFAULT_RESERVE,
) -> list[dict[str, Any]]:
    """Per device size: the first option (least recompute) that fits at some world size, its
    smallest world size and the room left; given ``plan``, also the smallest HSDP shard group
    with the same per-rank estimate (that world size) and fewer ranks with the sharded state
    offloaded (``offload``: its world size and host bytes per rank; derived, not measured).
    Where no option fits, ``checkpointing`` is None."""
    answers = []
    for i, device in enumerate(options[0]["devices_needed"]):
        fitting = [o for o in options if o["devices_needed"][i]["world_size"] is not None]
        best = min(
            fitting,
            key=lambda o: (o["recompute_flops"] or 0, o["devices_needed"][i]["world_size"]),
            default=None,
        )
        if best is None:
            answers.append({"device_bytes": device["device_bytes"], "checkpointing": None})
            continue
        need = best["devices_needed"][i]
        answers.append(
            {
                "device_bytes": device["device_bytes"],
                "checkpointing": best["checkpointing"],
                "world_size": need["world_size"],
                "estimate_bytes": need["estimate_bytes"],
                "room_bytes": need["device_bytes"] - need["reserve_bytes"] - need["estimate_bytes"],
                "recompute_flops": best["recompute_flops"],
                "shard_group": (
                    need["world_size"]
                    if plan is not None and plan.settings.shard_group_size is None
                    else None
                ),
                "offload": _offload_fit(
                    plan, best["checkpointing"], device["device_bytes"], need["world_size"], reserve
                ),
            }
        )
    return answers


def _offload_fit(
    plan: ModelPlan | None,
    checkpointing: str,
    device_bytes: int,
    world_size: int,
    reserve: DeviceReserve,
) -> dict[str, int] | None:
    """With the same checkpointing and the sharded state offloaded to the host: the fewest
    ranks that fit, where that is fewer than ``world_size``, and the host bytes per rank then.
    Offload removes only what shrinks with more ranks, so it lowers the ranks needed, never the
    floor: it is an answer to "fewer devices", not to "nothing fits"."""
    if plan is None or plan.settings.cpu_offload or plan.settings.shard_group_size is not None:
        return None
    offloaded = plan.with_settings(cpu_offload=True, checkpointing=checkpointing)
    need = devices_needed(offloaded, device_bytes, world_size, reserve)
    if need.world_size is None or need.world_size >= world_size:
        return None
    return {"world_size": need.world_size, "host_bytes": offloaded.host_bytes(need.world_size)}


# ============================================================================================
# The seeds' claim: fp16 weights of the 70B preset, per-rank memory per policy and W
# ============================================================================================


def compare_policies(
    choice: ModelChoice,
    settings: PlanSettings,
    world_sizes: Sequence[int],
    device_bytes: Sequence[int],
    policies: Sequence[PolicyName] = POLICIES,
    max_world_size: int = MAX_WORLD_SIZE,
    model: Any = None,
    reserve: DeviceReserve = DEFAULT_RESERVE,
) -> dict[str, Any]:
    """The estimate per policy and world size, and the devices each policy needs. ``model``
    (a meta model of ``choice``) is reused when given, as by :func:`plan_model`."""
    model = build_meta_model(choice) if model is None else model
    rows, needed, plans = [], {}, {}
    for policy in policies:
        plan = plan_model(choice, dataclasses.replace(settings, policy=policy), model)
        plans[policy] = plan
        largest = max(plan.units, key=lambda u: u.numel)
        for w in world_sizes:
            b = plan.estimate(w)
            rows.append(
                {
                    "policy": policy,
                    "world_size": w,
                    "units": len(plan.units),
                    "largest_unit": largest.fqn,
                    "largest_unit_params": largest.numel,
                    **breakdown(b),
                    "fits": {str(d): b.total <= d - reserve.total for d in device_bytes},
                }
            )
        needed[policy] = [
            devices_needed(plan, d, max_world_size, reserve).to_dict() for d in device_bytes
        ]
    total = next(iter(plans.values())).total_numel
    return {
        "model": {"label": choice.label, "params": total},
        "claim": {
            "text": SEEDS_CLAIM if choice.spec.config == LLAMA_PRESETS["70b"] else None,
            "fp16_weight_bytes": total * DTYPE_BYTES["fp16"],
        },
        "settings": settings.to_dict(),
        "world_sizes": list(world_sizes),
        "device_bytes": list(device_bytes),
        "reserve": reserve.to_dict(),
        "reserve_text": reserve.describe(plan_style(device_bytes)),
        "style": plan_style(device_bytes),
        "rows": rows,
        "devices_needed": needed,
    }
