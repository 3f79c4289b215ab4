"""Meta-device init, phase 2: shard a meta model and materialize it; then inspect the result.

The phases of a meta init (:mod:`fsdp_conformance.fsdp.meta_init` holds the first and the third):

1. Build on meta (:func:`~fsdp_conformance.fsdp.meta_init.build_on_meta`).
2. **Shard, then** ``to_empty``/**materialize** (:func:`materialize`, by method): FSDP1 wraps the
   meta model and materializes one unit at a time through a ``param_init_fn`` (or its default
   path, ``to_empty`` + ``reset_parameters``); FSDP2 ``fully_shard``\\ s the meta model, then
   ``to_empty`` allocates only the local shards.
3. Initialize (:mod:`~fsdp_conformance.fsdp.meta_init`'s deterministic init, or the method's own
   calls; :func:`reference_for` makes the same calls single-process).

Then **inspect** (:func:`inspect_sharded`): where every tensor is, and whether this rank's shards
and the gathered tensors equal the single-process reference. The seeds' ``materialization_fn``
is kept here verbatim, as one of the methods.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from typing import Any, TypedDict

import torch
import torch.nn as nn

from fsdp_conformance import _compat
from fsdp_conformance.fsdp.distributions import TensorStats, judge_tensor, tensor_stats
from fsdp_conformance.fsdp.meta_init import (
    RESET_PARAMETERS,
    DeterministicParamInit,
    ModuleInit,
    build_on_meta,
    deterministic_init_,
    full_state,
    model_init_for,
    module_init_for,
    named_state,
    own_state,
    reference_model,
    tensors_on_meta,
)
from fsdp_conformance.fsdp.model_init import (
    ModelInit,
    check_model_init_,
    nan_fill_,
    run_model_init_,
)
from fsdp_conformance.fsdp.sharding import check_fsdp_version, shard_fsdp1, shard_fsdp2
from fsdp_conformance.fsdp.tensors import state_digest
from fsdp_conformance.harness import RankContext
from fsdp_conformance.models.model_spec import ModelSpec
from fsdp_conformance.models.policies import PolicyName
from fsdp_conformance.models.units import clean_fqn, planned_unit_modules

#: How a sharded model gets its values.
#: - ``deterministic``: this module's per-FQN init (FSDP1 ``param_init_fn``; FSDP2 after
#:   ``to_empty``).
#: - ``reset_parameters``: FSDP1's default meta path (no ``param_init_fn``); for FSDP2 the naive
#:   equivalent, each module's ``reset_parameters()`` on its sharded parameters.
#: - ``seeds``: the seeds' ``materialization_fn`` as written (FSDP1 ``param_init_fn``; FSDP2:
#:   applied after ``fully_shard`` with no ``to_empty``, as the seeds would).
#: - ``seeds_to_empty``: the seeds' function with the minimal fix (``to_empty`` first).
METHODS = ("deterministic", "reset_parameters", "seeds", "seeds_to_empty")


# --------------------------------------------------------------------------------------------
# The seeds' materialization_fn, verbatim
# --------------------------------------------------------------------------------------------


def materialization_fn(module: nn.Module) -> None:
    """
    Called by FSDP for each module to initialize weights.
    This runs on the GPU after storage allocation.
    """
    # Only initialize parameters that are actually allocated
    for name, param in module.named_parameters(recurse=False):
        if hasattr(param, "_is_sharded"):
            # FSDP specific flag check might be needed depending on version
            pass
        # Standard initialization logic
        if "weight" in name and param.dim() > 1:
            torch.nn.init.kaiming_normal_(param)
        elif "bias" in name:
            torch.nn.init.zeros_(param)


def seeds_fn_with_to_empty(device: torch.device) -> Callable[[nn.Module], None]:
    """The minimal fix of the seeds' function: materialize the module's own state first."""

    def init(module: nn.Module) -> None:
        module.to_empty(device=device, recurse=False)
        with torch.no_grad():
            materialization_fn(module)

    return init


# --------------------------------------------------------------------------------------------
# Phase 2: shard a meta model, then to_empty and materialize it, by method
# --------------------------------------------------------------------------------------------


def check_method(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"init method must be one of {METHODS}, got {method!r}")
    return method


def materialize(
    ctx: RankContext,
    spec: ModelSpec,
    version: str,
    method: str = "deterministic",
    seed: int = 0,
    *,
    policy: PolicyName = "recommended",
    **fsdp_kwargs: Any,
) -> nn.Module:
    """Build on meta, shard with ``version``, materialize with ``method``; the sharded model.

    ``seed`` is this rank's seed. The build is looked up here at call time (``build_on_meta``),
    so that a negative control can swap it for a build with storage.
    """
    check_fsdp_version(version)
    check_method(method)
    built = build_on_meta(spec)
    model, wrap_policy = built.model, built.policy(policy)
    whole = model_init_for(spec, model) if method == "deterministic" else None
    if whole is not None:
        return _materialize_model_level(ctx, model, version, whole, seed, wrap_policy, fsdp_kwargs)
    # Before sharding: a transformers model's init reads an unsharded shadow of it.
    init = module_init_for(spec, model) if method == "deterministic" else RESET_PARAMETERS
    torch.manual_seed(seed)  # the RNG the reset_parameters / seeds methods draw from
    if version == "fsdp1":
        if method == "deterministic":
            fsdp_kwargs.setdefault(
                "param_init_fn", DeterministicParamInit(model, ctx.device, seed, init=init)
            )
        elif method == "seeds":
            fsdp_kwargs.setdefault("param_init_fn", materialization_fn)
        elif method == "seeds_to_empty":
            fsdp_kwargs.setdefault("param_init_fn", seeds_fn_with_to_empty(ctx.device))
        return shard_fsdp1(model, ctx, wrap_policy, **fsdp_kwargs)
    model = shard_fsdp2(model, ctx, wrap_policy, **fsdp_kwargs)
    return _materialize_fsdp2(model, ctx.device, method, seed, init)


def _materialize_model_level(
    ctx: RankContext,
    model: nn.Module,
    version: str,
    init: ModelInit,
    seed: int,
    wrap_policy: Any,
    fsdp_kwargs: dict[str, Any],
) -> nn.Module:
    """A model-level init where the user runs it, after sharding, every float NaN-filled first.

    FSDP2: ``fully_shard``, ``to_empty``, then the init on the DTensor parameters (each rank
    draws its own shards). FSDP1 has no step after ``to_empty`` on its own: its
    ``param_init_fn`` only materializes (keeping ties), then the init runs on the gathered
    parameters inside ``summon_full_params(writeback=True)``, each rank keeping its shard of
    what it wrote (docs/init.md, "A model-level init"). Every rank seeds the global generator
    with ``seed``, as a training script does.
    """
    if version == "fsdp2":
        model = shard_fsdp2(model, ctx, wrap_policy, **fsdp_kwargs)
        model.to_empty(device=ctx.device)
        nan_fill_(named_state(model))
        run_model_init_(model, init, seed, ctx.device)
        check_model_init_(model, init)
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    fsdp_kwargs.setdefault(
        "param_init_fn", DeterministicParamInit(model, ctx.device, seed, model_level=True)
    )
    model = shard_fsdp1(model, ctx, wrap_policy, **fsdp_kwargs)
    with FSDP.summon_full_params(model, writeback=True):
        run_model_init_(unwrapped(model), init, seed, ctx.device)
        check_model_init_(unwrapped(model), init)
    return model


def _materialize_fsdp2(
    model: nn.Module,
    device: torch.device,
    method: str,
    seed: int,
    init: ModuleInit = RESET_PARAMETERS,
) -> nn.Module:
    """Fill an FSDP2 model sharded on meta with ``method`` (FSDP2 has no ``param_init_fn``)."""
    if method == "seeds":
        model.apply(materialization_fn)  # as the seeds would: no to_empty
        return model
    model.to_empty(device=device)
    if method == "deterministic":
        deterministic_init_(model, seed, init)
    elif method == "reset_parameters":
        with torch.no_grad():
            for module in model.modules():
                if not own_state(module):
                    continue
                # getattr: nn.Module.__getattr__ is typed Tensor | Module, not a method
                reset = getattr(module, "reset_parameters", None)
                if callable(reset):
                    reset()
    else:  # seeds_to_empty
        with torch.no_grad():
            model.apply(materialization_fn)
    return model


def reference_for(
    spec: ModelSpec,
    method: str,
    seed: int,
    device: torch.device,
    policy: PolicyName = "recommended",
) -> nn.Module:
    """The single-process model each method must reproduce, built from the same seed.

    ``deterministic``: :func:`reference_model` (device-independent values). The other methods
    draw from the global RNG of ``device``; their reference applies the same calls in the order
    FSDP1 makes them (units bottom-up, breadth-first inside a unit) to a model whose
    ``to_empty`` memory is first filled with NaN, so anything the method leaves uninitialized
    shows up as NaN in the reference.
    """
    if method == "deterministic":
        return reference_model(spec, seed)
    built = build_on_meta(spec)
    model = built.model
    units = planned_unit_modules(model, built.policy(policy)) + [model]

    def poison_and(init: Callable[[nn.Module], None]) -> Callable[[nn.Module], None]:
        def run(module: nn.Module) -> None:
            if not own_state(module):
                return
            module.to_empty(device=device, recurse=False)
            with torch.no_grad():
                for _, _, t in own_state(module):
                    if t.is_floating_point():
                        t.fill_(float("nan"))
                init(module)

        return run

    if method == "reset_parameters":
        step = poison_and(lambda m: m.reset_parameters())  # type: ignore[operator]
    else:  # seeds, seeds_to_empty: the seeds' function, on materialized tensors
        step = poison_and(materialization_fn)
    torch.manual_seed(seed)
    done: set[int] = set()
    for unit in units:
        for module in _bfs_until(unit, done):
            step(module)
        done.add(id(unit))
    return model


def _bfs_until(root: nn.Module, stop: set[int]) -> list[nn.Module]:
    """FSDP1's ``_get_modules_to_materialize``: breadth-first, stopping at wrapped units."""
    order, queue, seen = [], collections.deque([root]), {id(root)}
    while queue:
        module = queue.popleft()
        order.append(module)
        for child in module.children():
            if id(child) not in seen and id(child) not in stop:
                seen.add(id(child))
                queue.append(child)
    return order


# --------------------------------------------------------------------------------------------
# Inspect: a sharded model against the reference
# --------------------------------------------------------------------------------------------


def _equal(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    a, e = actual.detach().cpu(), expected.detach().cpu()
    return a.shape == e.shape and a.dtype == e.dtype and torch.equal(a, e)


def _uninitialized(expected: torch.Tensor) -> bool:
    return expected.is_floating_point() and bool(expected.isnan().any())


class Ranked(TypedDict):
    """What every rank's report names: the rank."""

    rank: int


class ShardedReport(Ranked, total=False):
    """One rank's inspection (:func:`inspect_sharded`); the comparisons against the reference
    (from ``local_mismatch`` on) are absent while a tensor is still on meta."""

    device: str
    #: FQNs still on meta, and ``fqn on <device>`` for those on another device.
    on_meta: list[str]
    wrong_device: list[str]
    #: Units (FSDP1) or parameters (FSDP2) whose local shard differs from the reference's slice.
    local_mismatch: list[str]
    local_checked: int
    #: Gathered tensors that differ from the reference, and those the reference has NaN in
    #: (left uninitialized by the method); tensors the model lacks.
    full_mismatch: list[str]
    uninitialized: list[str]
    missing: list[str]
    digest: str
    reference_digest: str
    #: Tensors compared by distribution (a model-level init's per-shard draws on FSDP2).
    by_distribution: int


def inspect_sharded(
    model: nn.Module,
    reference: nn.Module,
    ctx: RankContext,
    version: str,
    drawn: nn.Module | None = None,
) -> ShardedReport:
    """Where every tensor is, and whether this rank's shards and the gathered tensors match.

    ``drawn``: for a model-level init on FSDP2, the reference built from another seed. The
    tensors that differ between the two are random draws, which FSDP2 makes per shard (on a
    CPU mesh each rank draws its shards from its own generator: docs/init.md), so they are
    compared by distribution (:func:`~fsdp_conformance.fsdp.distributions.judge_tensor`, the
    two references against the gathered tensor), the others by value.
    Collective (gathers full parameters): every rank must call it.
    """
    ref = full_state(reference)
    random = _random_draws(ref, drawn) if drawn is not None and version == "fsdp2" else {}
    wrong_device = [
        f"{clean_fqn(n)} on {t.device}"
        for n, t in named_state(model)
        if not t.is_meta and t.device != ctx.device
    ]
    report: ShardedReport = {
        "rank": ctx.rank,
        "device": str(ctx.device),
        "on_meta": tensors_on_meta(model),
        "wrong_device": wrong_device,
    }
    if report["on_meta"]:
        return report  # gathering meta shards would only raise inside torch
    local_bad: list[str] = []
    full_bad: list[str] = []
    uninit: list[str] = []
    if version == "fsdp1":
        local_bad, checked = _fsdp1_local_mismatches(model, ref, ctx)
    else:
        local_bad, checked = _fsdp2_local_mismatches(model, ref, ctx, set(random))
    gathered = gathered_state(model, version)
    for name, t in gathered.items():
        expected = ref.get(name)
        if expected is None:
            full_bad.append(f"{name} (not in the reference)")
        elif name in random:
            finding = judge_tensor(tensor_stats(expected), random[name], tensor_stats(t)) or (
                "" if t.shape == expected.shape else "shape differs"
            )
            if finding:
                sharded = finding.replace("meta init", "the sharded init").replace(
                    "as built", "unsharded"
                )
                full_bad.append(f"{name} ({sharded})")
        elif not _equal(t, expected):
            (uninit if _uninitialized(expected) else full_bad).append(name)
    report.update(
        {
            "local_mismatch": local_bad,
            "local_checked": checked,
            "full_mismatch": full_bad,
            "uninitialized": uninit,
            "missing": sorted(set(ref) - set(gathered) - _aliases(reference)),
            "digest": state_digest(gathered),
            "reference_digest": state_digest({n: ref[n] for n in gathered if n in ref}),
            "by_distribution": len(random),
        }
    )
    return report


def _random_draws(ref: Mapping[str, torch.Tensor], drawn: nn.Module) -> dict[str, TensorStats]:
    """The reference's tensors that another seed changes, with that seed's statistics."""
    other = full_state(drawn)
    return {
        name: tensor_stats(other[name])
        for name, t in ref.items()
        if name in other and not _equal(t, other[name]) and t.numel() > 1
    }


def _aliases(model: nn.Module) -> set[str]:
    """Names of tied tensors other than their first name (FSDP reports each tensor once)."""
    first = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    return set(full_state(model)) - first


def gathered_state(model: nn.Module, version: str) -> dict[str, torch.Tensor]:
    """The full (unsharded) parameters and the buffers, by clean FQN, as CPU copies."""
    out: dict[str, torch.Tensor] = {}
    if version == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model, writeback=False):
            for n, p in model.named_parameters():
                out[clean_fqn(n)] = p.detach().cpu().clone()
    else:
        dtensor = _compat.dtensor_cls()
        for n, p in model.named_parameters():
            full = p.full_tensor() if isinstance(p, dtensor) else p
            out[n] = full.detach().cpu().clone()
    for n, b in model.named_buffers():
        out[clean_fqn(n)] = b.detach().cpu().clone()
    return out


def _fsdp1_local_mismatches(
    model: nn.Module, ref: Mapping[str, torch.Tensor], ctx: RankContext
) -> tuple[list[str], int]:
    """Each unit's local flat shard against the same slice of the reference's flat unit."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    bad, checked = [], 0
    for name, unit in model.named_modules():
        if not isinstance(unit, FSDP):
            continue
        flat = _compat.fsdp1_flat_param(unit)
        if flat is None:
            continue
        prefix = clean_fqn(name)
        fqns = [
            f"{prefix}.{clean_fqn(f)}" if prefix else clean_fqn(f)
            for f in _compat.fsdp1_param_fqns(flat)
        ]
        reference_flat = torch.cat([ref[f].detach().cpu().reshape(-1) for f in fqns])
        local = flat.detach().cpu().reshape(-1)
        start = ctx.rank * local.numel() if local.numel() < reference_flat.numel() else 0
        expected = reference_flat[start : start + local.numel()]
        checked += 1
        if not torch.equal(local[: expected.numel()], expected):
            bad.append(f"{prefix or '(root)'} [flat shard {start}:{start + expected.numel()}]")
    return bad, checked


def _fsdp2_local_mismatches(
    model: nn.Module,
    ref: Mapping[str, torch.Tensor],
    ctx: RankContext,
    random: set[str] | None = None,
) -> tuple[list[str], int]:
    """Each DTensor's local shard against ``torch.chunk(reference, world_size)[rank]``
    (``random``: names drawn per shard, compared by distribution once gathered instead)."""
    dtensor = _compat.dtensor_cls()
    bad, checked = [], 0
    for name, p in model.named_parameters():
        if not isinstance(p, dtensor) or name in (random or ()):
            continue
        chunks = torch.chunk(ref[name].detach().cpu(), ctx.world_size, dim=0)
        expected = chunks[ctx.rank] if ctx.rank < len(chunks) else ref[name][:0].cpu()
        checked += 1
        if not _equal(p.to_local(), expected):
            bad.append(name)
    return bad, checked


def unwrapped(model: nn.Module) -> nn.Module:
    """The user's module inside an FSDP1 root wrapper (FSDP2 keeps the module itself)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return model.module if isinstance(model, FSDP) else model
