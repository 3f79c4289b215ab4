"""Apply FSDP to a model: FSDP1 with an auto-wrap policy, FSDP2 from the same plan.

FSDP2 has no auto-wrap: the same decisions are expressed by planning the units with the FSDP1
policy (:func:`fsdp_conformance.models.units.planned_unit_modules`) and calling ``fully_shard`` on
each chosen module bottom-up, then on the root. Both paths take a :class:`RankContext` for the
device.

The state dicts of each kind (:data:`KINDS`) are got and set here too (:func:`get_state`,
:func:`set_state`), as torch hands them to a user: the state claim and the loop claim both read
them.
"""

from __future__ import annotations

import gc
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypedDict, TypeVar

import torch
import torch.nn as nn

from fsdp_conformance import _compat
from fsdp_conformance.fsdp import capabilities
from fsdp_conformance.fsdp.tensors import listing
from fsdp_conformance.harness import RankContext
from fsdp_conformance.models.units import (
    clean_fqn,
    mixed_requires_grad_units,
    planned_unit_modules,
)

FSDP_VERSIONS = ("fsdp1", "fsdp2")


def check_fsdp_version(version: str) -> str:
    if version not in FSDP_VERSIONS:
        raise ValueError(f"FSDP version must be one of {FSDP_VERSIONS}, got {version!r}")
    return version


def shard_fsdp1(model: nn.Module, ctx: RankContext, policy: Any, **fsdp_kwargs: Any) -> nn.Module:
    """``FullyShardedDataParallel(model, auto_wrap_policy=policy, device_id=<rank's device>)``,
    with ``use_orig_params=True`` where the caller left it unset and a unit of the plan mixes
    frozen and trainable parameters (:func:`fsdp1_options`: FSDP1 cannot run such a unit
    without it; the preflight says so in one line, ``user_model.frozen_units_note``).

    ``device_id`` is mandatory on CPU ("FSDP needs a non-CPU accelerator device" without it).
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    fsdp_kwargs.setdefault("device_id", ctx.device)
    if "use_orig_params" not in fsdp_kwargs:
        units = planned_unit_modules(model, policy) if policy is not None else []
        ignored = fsdp_kwargs.get("ignored_modules") or ()
        fsdp_kwargs.update(fsdp1_options(model, units, ignored))
    return FSDP(model, auto_wrap_policy=policy, **fsdp_kwargs)


def device_mesh(ctx: RankContext) -> Any:
    """The 1-D mesh of FSDP2 over the world; a check about to use FSDP2 on a torch that cannot
    run it on this device skips here (:data:`~fsdp_conformance.fsdp.capabilities.FSDP2_ON_CPU`)."""
    from torch.distributed.device_mesh import init_device_mesh

    capabilities.require(capabilities.FSDP2_ON_CPU, ctx.device_type)

    return init_device_mesh(ctx.device_type, (ctx.world_size,))


def shard_fsdp2_modules(
    model: nn.Module,
    ctx: RankContext,
    unit_modules: Sequence[nn.Module],
    *,
    mesh: Any = None,
    per_unit_kwargs: Mapping[int, Mapping[str, Any]] | None = None,
    **shard_kwargs: Any,
) -> nn.Module:
    """``fully_shard`` each unit module bottom-up (deepest first), then the root. ``ctx`` None:
    the planner's cross-check on a fake process group (meta tensors: nothing runs)."""
    if ctx is not None:
        capabilities.require(capabilities.FSDP2_ON_CPU, ctx.device_type)
    fully_shard = _compat.fully_shard()
    mesh = mesh if mesh is not None else device_mesh(ctx)
    depth = {id(m): n.count(".") + 1 for n, m in model.named_modules() if n}
    overrides = per_unit_kwargs or {}
    for module in sorted(
        (m for m in unit_modules if m is not model), key=lambda m: -depth.get(id(m), 0)
    ):
        # A per-unit override may replace the mesh too (e.g. a replicated unit on a 2-D mesh).
        fully_shard(module, **{"mesh": mesh, **shard_kwargs, **overrides.get(id(module), {})})
    fully_shard(model, **{"mesh": mesh, **shard_kwargs, **overrides.get(id(model), {})})
    return model


def shard_fsdp2(
    model: nn.Module,
    ctx: RankContext,
    policy: Any,
    *,
    mesh: Any = None,
    fp32_batch_norm: bool = False,
    **shard_kwargs: Any,
) -> nn.Module:
    """FSDP2 with the units an FSDP1 ``policy`` would choose. ``fp32_batch_norm``: each
    ``_BatchNorm`` module its own unit too, with full-precision ``MixedPrecisionPolicy()``
    (:data:`BATCH_NORM_FIX`: what FSDP1's ``MixedPrecision`` does to them by default)."""
    units = planned_unit_modules(model, policy)
    overrides: dict[int, dict[str, Any]] = {}
    if fp32_batch_norm:
        norms = batch_norm_modules(model)
        units = [*units, *(m for m in norms if all(m is not u for u in units))]
        full = _compat.mixed_precision_policy_cls()()
        overrides = {id(m): {"mp_policy": full} for m in norms}
    return shard_fsdp2_modules(
        model, ctx, units, mesh=mesh, per_unit_kwargs=overrides, **shard_kwargs
    )


def named_batch_norms(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``model``'s ``_BatchNorm`` modules other than the root, by name (those
    :func:`shard_fsdp2`'s ``fp32_batch_norm`` makes units of)."""
    from torch.nn.modules.batchnorm import _BatchNorm

    return [(n, m) for n, m in model.named_modules() if n and isinstance(m, _BatchNorm)]


def batch_norm_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of :func:`named_batch_norms`."""
    return [m for _, m in named_batch_norms(model)]


def fsdp1_full_precision_units(model: nn.Module) -> dict[str, int]:
    """The units of an FSDP1 model that torch runs in full precision beside units it casts, by
    FQN (FSDP1's wrapper components left out) with their flat parameter's unsharded numel:
    observed, not assumed by class. A unit computes in its handle's dtype
    (``_compat.fsdp1_compute_dtype``); one whose compute dtype is its stored dtype while
    another unit of the model computes in a narrower one is full precision: FSDP1's
    ``MixedPrecision`` wraps each module of its ``_module_classes_to_ignore`` (``_BatchNorm`` by
    default) as its own unit with mixed precision off (fp32 parameters, inputs cast to fp32
    and its output back, fp32 collectives). Empty: no unit is cast, or none is left fp32."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    full: dict[str, int] = {}
    cast = False
    for name, module in model.named_modules():
        flat = _compat.fsdp1_flat_param(module) if isinstance(module, FSDP) else None
        dtype = _compat.fsdp1_compute_dtype(module) if flat is not None else None
        if flat is None or dtype is None:
            continue
        if dtype == flat.dtype:
            full[clean_fqn(name)] = _compat.fsdp1_unsharded_numel(flat)
        elif dtype.itemsize < flat.dtype.itemsize:
            cast = True
    return full if cast else {}


def fsdp1_mixed_precision_ignored(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP1's ``MixedPrecision`` would keep in full precision by default: those of
    its ``_module_classes_to_ignore`` (read from torch), the root aside. A prediction, for the
    planner, which has no sharded model; a check observes them
    (:func:`fsdp1_full_precision_units`)."""
    classes = _compat.fsdp1_mixed_precision_ignored_classes()
    return [m for n, m in model.named_modules() if n and classes and isinstance(m, classes)]


def fsdp1_full_precision_hooks(module: nn.Module) -> list[Any]:
    """What FSDP1 registers around a module it keeps in full precision
    (``_common_utils._override_module_mixed_precision``), registered on ``module``: floating
    inputs cast to fp32, floating outputs cast back to the inputs' dtype. The handles."""
    seen: dict[str, torch.dtype] = {}

    def to_fp32(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dtype == torch.float32:
            return t
        seen["dtype"] = t.dtype
        return t.to(torch.float32)

    def back(t: Any) -> Any:
        dtype = seen.get("dtype")
        if dtype is None or not isinstance(t, torch.Tensor) or not t.is_floating_point():
            return t
        return t.to(dtype)

    return [
        module.register_forward_pre_hook(lambda _, args: _compat.tree_map(to_fp32, args)),
        module.register_forward_hook(lambda _, args, out: _compat.tree_map(back, out)),
    ]


def full_precision_units_note(version: str, units: Mapping[str, int]) -> str:
    """The sentence a verdict adds when torch ran FSDP1 units in full precision under mixed
    precision (:func:`fsdp1_full_precision_units`); '' otherwise (FSDP2's are its fix's,
    said by :func:`input_casts_note`)."""
    if version != "fsdp1" or not units:
        return ""
    return (
        "; FSDP1's MixedPrecision keeps BatchNorm (its _module_classes_to_ignore) in fp32 by "
        f"default: {len(units)} unit(s) ran in fp32, modelled as such ({listing(list(units))})"
    )


def reshard_kwargs(version: str, reshard_after_forward: bool) -> dict[str, Any]:
    """The FSDP keyword arguments that keep parameters gathered after the forward, if asked.

    FSDP1 says it with ``sharding_strategy=SHARD_GRAD_OP``, FSDP2 with
    ``reshard_after_forward=False``; resharding is both versions' default (no arguments).
    """
    if reshard_after_forward:
        return {}
    if check_fsdp_version(version) == "fsdp1":
        from torch.distributed.fsdp import ShardingStrategy

        return {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP}
    return {"reshard_after_forward": False}


def param_dtype_kwargs(
    version: str,
    param_dtype: str | None,
    reduce_dtype: str | None = None,
    known_fix: bool = False,
) -> dict[str, Any]:
    """Mixed precision as a user writes it with only the compute dtype named: FSDP1
    ``MixedPrecision(param_dtype=...)``, FSDP2 ``MixedPrecisionPolicy(param_dtype=...)``, every
    other field left to torch (reduce dtype, buffers, input casts). ``None``: no policy.
    ``reduce_dtype``: that field named too (``None`` leaves it to torch).
    ``known_fix``: the version's fix of a known mixed-precision error (:func:`with_known_fix`
    asks for it after torch's defaults could not run the model): FSDP1's
    ``cast_forward_inputs=True``, FSDP2's ``_BatchNorm`` modules as fp32 units
    (:func:`shard_fsdp2`'s ``fp32_batch_norm``)."""
    if param_dtype is None:
        return {}
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    for name, value in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if value is not None and value not in dtypes:
            raise ValueError(f"{name} {value!r} is not one of {', '.join(dtypes)}")
    named: dict[str, Any] = {"param_dtype": dtypes[param_dtype]}
    if reduce_dtype is not None:
        named["reduce_dtype"] = dtypes[reduce_dtype]
    if check_fsdp_version(version) == "fsdp1":
        from torch.distributed.fsdp import MixedPrecision

        if known_fix:
            named["cast_forward_inputs"] = True
        return {"mixed_precision": MixedPrecision(**named)}
    mp = _compat.mixed_precision_policy_cls()
    return {"mp_policy": mp(**named), **({"fp32_batch_norm": True} if known_fix else {})}


# --------------------------------------------------------------------------------------------
# Known mixed-precision errors and their fixes: observed, not configured
# --------------------------------------------------------------------------------------------

_Result = TypeVar("_Result")


class InputCasts(TypedDict):
    """Why a check's mixed-precision run was judged with a version's known fix
    (:func:`with_known_fix`)."""

    #: torch's one line, as the version's defaults raised it (``RuntimeError: ...``).
    torch_error: str
    #: What the run used instead, as a user writes it.
    fix: str


#: FSDP1's fix (:func:`with_known_fix`), in the user's words.
INPUT_CASTS_FIX = "MixedPrecision(..., cast_forward_inputs=True)"
#: FSDP2's fix (:func:`with_known_fix`), in the user's words.
BATCH_NORM_FIX = "fully_shard(bn, mp_policy=MixedPrecisionPolicy()) on each _BatchNorm module"
#: Each version's known mixed-precision error (its ``torch_errors.KNOWN_ERRORS`` name) and fix.
_KNOWN_FIXES = {
    "fsdp1": ("fsdp1-input-dtype", INPUT_CASTS_FIX),
    "fsdp2": ("fsdp2-batch-norm-dtype", BATCH_NORM_FIX),
}


def known_mixed_precision_error(exc: BaseException, version: str) -> str | None:
    """torch's one line when ``exc`` is ``version``'s known mixed-precision error, else None:
    FSDP1's input-dtype error (``fsdp1-input-dtype`` of
    :data:`fsdp_conformance.fsdp.torch_errors.KNOWN_ERRORS`: a unit handed inputs not in its
    parameters' dtype, raised under ``FullyShardedDataParallel``'s forward), FSDP2's batch-norm
    error (``fsdp2-batch-norm-dtype``: ``F.batch_norm`` given low-precision weights beside fp32
    running statistics)."""
    from fsdp_conformance.fsdp import torch_errors

    error = torch_errors.parse_traceback("".join(traceback.format_exception(exc)))
    if error is None:
        return None
    entry = torch_errors.known_error(error)
    if entry is None or entry.name != _KNOWN_FIXES[check_fsdp_version(version)][0]:
        return None
    return f"{error.name}: {error.message}"


def fsdp1_input_dtype_error(exc: BaseException) -> str | None:
    """:func:`known_mixed_precision_error` for FSDP1."""
    return known_mixed_precision_error(exc, "fsdp1")


def with_known_fix(
    version: str, mixed: bool, run: Callable[[bool], _Result]
) -> tuple[_Result, InputCasts | None]:
    """``run(False)``: the check with mixed precision as users write it (torch's defaults);
    with it, None. Where (and only where) that is mixed precision and torch raised the
    version's known error (:func:`known_mixed_precision_error`), ``run(True)``: the check again
    with the version's fix (:func:`param_dtype_kwargs`' ``known_fix``), judged on that run,
    with torch's line and the fix.

    FSDP1's ``MixedPrecision`` casts the root unit's inputs only unless
    ``cast_forward_inputs=True``; a model that casts its input to a weight's dtype inside the
    root unit (ViT's patch embedding) reads the fp32 shard there and hands the bf16 unit fp32
    input. FSDP2's ``MixedPrecisionPolicy`` casts a ``_BatchNorm``'s weight and bias and not its
    fp32 running statistics, which CPU ``F.batch_norm`` refuses; FSDP1 keeps ``_BatchNorm``
    modules in full precision by default (``_module_classes_to_ignore``), FSDP2 needs each as
    its own fp32 unit. Any other error is raised as it was. Every rank raises the error at the
    same forward (the same model and batch shape on each), so every rank retries and the
    collectives stay matched. The failed run's model is freed (``gc.collect``) before the
    retry, so a memory check measures the retry alone.
    """
    try:
        return run(False), None
    except RuntimeError as exc:
        line = known_mixed_precision_error(exc, version) if mixed else None
        if line is None:
            raise
        casts: InputCasts = {"torch_error": line, "fix": _KNOWN_FIXES[version][1]}
    gc.collect()
    return run(True), casts


def known_fix_figure(casts: InputCasts) -> str:
    """The figure a verdict sets (to True) when its run needed ``casts``' fix."""
    return "fp32_batch_norm_units" if casts["fix"] == BATCH_NORM_FIX else "cast_forward_inputs"


def input_casts_note(casts: InputCasts | None) -> str:
    """The sentence a verdict adds when its run needed a version's known fix; '' otherwise."""
    if casts is None:
        return ""
    if casts["fix"] == BATCH_NORM_FIX:
        return (
            f"; FSDP2's MixedPrecisionPolicy could not run this model ({casts['torch_error']}): "
            "it casts each _BatchNorm's weight and bias but not its fp32 running statistics; "
            f"judged on a run with the fix, {casts['fix']} (FSDP1's MixedPrecision keeps "
            "_BatchNorm modules in full precision by default)"
        )
    return (
        f"; FSDP1's MixedPrecision defaults could not run this model ({casts['torch_error']}): "
        "its root casts an input to a weight's dtype while that weight is still the fp32 shard, "
        "and FSDP1 casts only the root unit's inputs; judged on a run with the fix, "
        f"{casts['fix']} (FSDP2 casts each unit's inputs by default)"
    )


def offload_kwargs(ctx: RankContext, version: str, offload: bool) -> dict[str, Any]:
    """CPU offload of the sharded state as users write it: FSDP1
    ``CPUOffload(offload_params=True)``, FSDP2 ``CPUOffloadPolicy()`` (its ``pin_memory``
    default on a GPU; off on a CPU device, where pinning needs an accelerator); ``{}`` off.
    FSDP1's needs pinned host memory: where there is none, a capability skip."""
    if not offload:
        return {}
    if check_fsdp_version(version) == "fsdp1":
        from torch.distributed.fsdp import CPUOffload

        capabilities.require(capabilities.PINNED_HOST_MEMORY)
        return {"cpu_offload": CPUOffload(offload_params=True)}
    policy = _compat.cpu_offload_policy_cls()
    return {"offload_policy": policy() if ctx.device_type == "cuda" else policy(pin_memory=False)}


def fsdp1_options(
    model: nn.Module, unit_modules: Sequence[nn.Module], ignored: Iterable[nn.Module] = ()
) -> dict[str, Any]:
    """FSDP1 keyword arguments a plan needs: ``use_orig_params=True`` for mixed requires_grad.

    With ``use_orig_params=False`` FSDP1 refuses to flatten a unit whose parameters mix
    frozen and trainable ones ("Must flatten tensors with uniform requires_grad"), which is the
    normal state of a LoRA block or a frozen norm inside a block
    (:func:`~fsdp_conformance.models.units.mixed_requires_grad_units`). FSDP2 has no flat
    parameter and needs nothing.
    """
    return (
        {"use_orig_params": True} if mixed_requires_grad_units(model, unit_modules, ignored) else {}
    )


def shard(
    model: nn.Module, ctx: RankContext, version: str, policy: Any, **kwargs: Any
) -> nn.Module:
    """Shard ``model`` with FSDP1 or FSDP2 under ``policy``; returns the sharded model."""
    if check_fsdp_version(version) == "fsdp1":
        return shard_fsdp1(model, ctx, policy, **kwargs)
    return shard_fsdp2(model, ctx, policy, **kwargs)


def op_sac_context() -> Any:
    """The context of op-level selective activation checkpointing, torchtitan's policy
    (``selective_ac_option = "op"``) through torch's public
    ``create_selective_checkpoint_contexts``: attention outputs saved, every other matmul's
    output saved (the 1st, 3rd, ... of each checkpointed call, counted apart in forward and in
    the recompute), everything else recomputed. The ops: ``_compat.op_sac_kinds``; what the
    planner counts of them: ``ActivationProfile.op_kept``."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    kinds = _compat.op_sac_kinds()
    matmuls = {False: 0, True: 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        kind = kinds.get(func)
        if kind == "mm":
            matmuls[ctx.is_recompute] += 1
            if matmuls[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if kind else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def checkpoint_blocks(
    model: nn.Module, block_classes: Sequence[type[nn.Module]], every: int, ops: bool = False
) -> list[str]:
    """Activation checkpointing on blocks 0, ``every``, 2 x ``every``, ... of a sharded model
    (``every`` 1: every block); returns their FQNs. ``ops``: op-level selective checkpointing
    (:func:`op_sac_context`, torch's ``context_fn``) in place of full checkpointing.

    Through torch's public APIs, as users apply it to a model already sharded, with FSDP's hooks
    outside the checkpointed region (so the recompute in backward runs on the parameters FSDP
    gathered for the block's backward):

    * FSDP1: ``apply_activation_checkpointing`` with ``checkpoint_wrapper``
      (``CheckpointImpl.NO_REENTRANT``) on the chosen blocks, after wrapping (accelerate's order):
      each wrapper goes inside its FSDP unit.
    * FSDP2 (and an unsharded model): each chosen block's ``forward`` runs under
      ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``, what ``checkpoint_wrapper``
      runs; FSDP2's hooks are on the block's ``__call__``, the checkpoint on its ``forward``.
      The wrapper module itself cannot go around an FSDP2 block once sharded: the recompute
      would run FSDP2's hooks again (``stack.checkpointing`` applies it before ``fully_shard``,
      torchtitan's order, and docs/stack/checkpointing.md says what that does).
    """
    import functools

    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.utils.checkpoint import checkpoint

    kinds = tuple(block_classes)
    blocks = [(name, m) for name, m in model.named_modules() if isinstance(m, kinds)]
    chosen = blocks[::every] if every > 0 else []
    more: dict[str, Any] = {"context_fn": op_sac_context} if ops else {}
    if chosen and any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        torch_ac = _compat.checkpoint_wrapper_module()
        ids = {id(m) for _, m in chosen}
        torch_ac.apply_activation_checkpointing(
            model,
            checkpoint_wrapper_fn=functools.partial(
                torch_ac.checkpoint_wrapper,
                checkpoint_impl=torch_ac.CheckpointImpl.NO_REENTRANT,
                **more,
            ),
            check_fn=lambda m: id(m) in ids,
        )
        return [name for name, _ in chosen]
    for _, module in chosen:
        inner = module.forward

        @functools.wraps(inner)
        def forward(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            return checkpoint(_inner, *args, use_reentrant=False, **more, **kwargs)

        module.forward = forward
    return [name for name, _ in chosen]


def hsdp_kwargs(ctx: RankContext, version: str, shard_group: int | None) -> dict[str, Any]:
    """The keyword arguments of HSDP with shard groups of ``shard_group`` ranks, as users write
    it: FSDP2 ``fully_shard(mesh=...)`` on a 2-D mesh (replicate x shard), FSDP1
    ``ShardingStrategy.HYBRID_SHARD`` with that mesh; ``{}`` for full sharding (None)."""
    if shard_group is None:
        return {}
    if shard_group < 1 or ctx.world_size % shard_group:
        raise ValueError(
            f"HSDP shard group of {shard_group} ranks does not divide world size "
            f"{ctx.world_size}; choose a divisor of it"
        )
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(
        ctx.device_type,
        (ctx.world_size // shard_group, shard_group),
        mesh_dim_names=("replicate", "shard"),
    )
    if check_fsdp_version(version) == "fsdp2":
        return {"mesh": mesh}
    from torch.distributed.fsdp import ShardingStrategy

    return {"sharding_strategy": ShardingStrategy.HYBRID_SHARD, "device_mesh": mesh}
