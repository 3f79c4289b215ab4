"""The step's activations profiled on meta, per module and then per unit, kept per process.

The planner's one forward: a meta model runs one step's forward in the compute dtype with the
chosen attention kernel (:func:`profile_step_activations`); every module is its own unit, and a
policy's units regroup those figures exactly (:func:`activations_by_unit`). A deep reference model
or preset runs three of its blocks (:data:`PROFILED_BLOCKS`); profiles are kept per model, or per
spec for reference models and presets, so several policies or commands in one process cost one
forward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeVar

from fsdp_conformance._compat import tree_map
from fsdp_conformance.measure.bound import ActivationProfile
from fsdp_conformance.measure.profile import profile_activations, unit_of
from fsdp_conformance.models.units import UnitInfo
from fsdp_conformance.plan.model import (
    POLICIES,
    MetaForwardError,
    ModelChoice,
    PlanError,
    PlanSettings,
    build_meta_model,
    meta_batch,
)

_V = TypeVar("_V")

#: Per-module activation profiles of a meta model (every module its own unit), by the choice's
#: label, the settings less those the forward on meta does not read (:data:`_NOT_IN_FORWARD`)
#: and the model's modules and parameter shapes (a model changed in place, e.g. sharded, is
#: profiled again): several policies, shard groups or offload choices planned on one model
#: (:func:`compare_policies`, the HSDP and offload alternatives) cost one forward.
_MODULE_PROFILES: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], ActivationProfile]] = (
    weakref.WeakKeyDictionary()
)
#: The same profiles of reference models and presets, by spec for the whole process: their spec
#: (a frozen config) names the model, its forward included, so another meta build of it (another
#: plan or command in one process) costs its build and not another forward. A user's factory
#: keeps its profiles on the model object: its spec names a path whose code may change.
_SPEC_PROFILES: dict[tuple[Any, ...], ActivationProfile] = {}


def _named_by_spec(choice: ModelChoice) -> bool:
    """A reference model or preset: its spec alone names the model and its forward."""
    spec = choice.spec
    return spec.reference is not None and spec.factory is None and spec.input_builder is None


def _profiles_of(model: Any, choice: ModelChoice) -> dict[tuple[Any, ...], ActivationProfile]:
    return _SPEC_PROFILES if _named_by_spec(choice) else _MODULE_PROFILES.setdefault(model, {})


#: Settings the profile's forward does not read (it reads the compute dtype, the batch, the
#: sequence and the attention kernel: :func:`profile_step_activations`), each set to one value
#: in the cache key; a setting not named here keeps its own profile.
_NOT_IN_FORWARD: dict[str, Any] = {
    "policy": POLICIES[0],
    "checkpointing": "none",
    "version": "fsdp2",
    "param_dtype": "fp32",
    "reduce_dtype": None,
    "optimizer": "none",
    "shard_group_size": None,
    "cpu_offload": False,
}


def activations_by_unit(
    model: Any, choice: ModelChoice, units: Sequence[UnitInfo], settings: PlanSettings
) -> ActivationProfile:
    """:func:`profile_step_activations` for ``units``, regrouped from the model's per-module
    profile. Exact: a tensor is counted for the innermost module running when it is made or
    saved, and a unit's share is that of the modules it owns (profile.profile_activations)."""
    modules = list(model.named_modules())
    shape = (
        tuple((name, type(m)) for name, m in modules),
        tuple((name, tuple(p.shape), p.dtype) for name, p in model.named_parameters()),
    )
    key = (choice.spec, choice.label, dataclasses.replace(settings, **_NOT_IN_FORWARD), shape)
    profiles = _profiles_of(model, choice)
    names = {id(m): name for name, m in modules}
    if key not in profiles:
        profiles[key] = _module_profile(model, choice, settings)
    fine = profiles[key]
    owner = unit_of(model, units)
    saved = {u.fqn: 0 for u in units}
    produced = {u.fqn: 0 for u in units}
    outputs: dict[str, list[tuple[int, str, int, int, int]]] = {}
    for module_id, unit in owner.items():
        saved[unit] += fine.saved_bytes[names[module_id]]
        produced[unit] += fine.produced_bytes[names[module_id]]
        outputs.setdefault(unit, []).extend(fine.op_outputs.get(names[module_id], ()))
    # A unit's working set while it runs: the most of its modules' (each the step's alive
    # bytes while that module is innermost), so regrouping is exact.
    working: tuple[dict[str, int], dict[str, int]] = ({}, {})
    for fine_map, by_unit in zip(
        (fine.working_forward_by_unit, fine.working_backward_by_unit), working, strict=True
    ):
        for module_id, unit in owner.items():
            value = fine_map.get(names[module_id])
            if value is not None and by_unit.get(unit, -1) < value:
                by_unit[unit] = value

    def own(figures: Mapping[str, _V]) -> dict[str, _V]:
        """A unit's own figure for checkpointing it: its module's (nested modules' included)."""
        return {u.fqn: figures[u.fqn] for u in units if u.fqn in figures}

    return ActivationProfile(
        input_bytes=fine.input_bytes,
        saved_bytes=saved,
        produced_bytes=produced,
        entry_bytes={u.fqn: fine.entry_bytes.get(u.fqn, 0) for u in units},
        forward_flops={
            u.fqn: fine.forward_flops[u.fqn] for u in units if u.fqn in fine.forward_flops
        },
        op_outputs={u: tuple(sorted(e)) for u, e in outputs.items() if e},
        working_forward_bytes=fine.working_forward_bytes,
        working_backward_bytes=fine.working_backward_bytes,
        working_forward_by_unit=working[0],
        working_backward_by_unit=working[1],
        forward_local_by_unit=own(fine.forward_local_by_unit),
        backward_entry_by_unit=own(fine.backward_entry_by_unit),
        backward_with_saved_by_unit=own(fine.backward_with_saved_by_unit),
    )


#: How many blocks of a deep reference model or preset the forward on meta runs: the first, one
#: in the middle and the last. The others are copies of the middle one (:func:`_module_profile`).
PROFILED_BLOCKS = 3


def _module_profile(model: Any, choice: ModelChoice, settings: PlanSettings) -> ActivationProfile:
    """The per-module profile of ``model`` (every module its own unit).

    A reference model or preset deeper than :data:`PROFILED_BLOCKS` is profiled at that depth
    and its other blocks take the middle block's figures: its blocks are one class with one
    config and see inputs of one shape, so each saves and makes what the middle one does; the
    first and the last keep their own (what only the first block saves, a tensor shared by every
    block, is counted there, as in the full forward). The 70B preset's 80 blocks cost three.
    Exact: ``tests/test_planning.py`` compares both ways per module. Any other model (a user's
    factory, whose blocks may differ) runs its whole forward.
    """
    import torch

    modules = list(model.named_modules())

    def whole() -> ActivationProfile:
        every = [UnitInfo(fqn=name, cls=type(m).__name__, numel=0) for name, m in modules]
        return profile_step_activations(model, choice, every, settings)

    spec = choice.spec
    config = spec.config
    depth = getattr(config, "num_layers", None)
    layers = getattr(model, "layers", None)
    if (
        not _named_by_spec(choice)
        or config is None
        or not isinstance(depth, int)
        or depth <= PROFILED_BLOCKS
        or not isinstance(layers, torch.nn.ModuleList)
        or len(layers) != depth
    ):
        return whole()
    short_config = dataclasses.replace(config, num_layers=PROFILED_BLOCKS)
    short = dataclasses.replace(choice, spec=dataclasses.replace(spec, config=short_config))
    short_model = build_meta_model(short)

    def source(name: str) -> str:
        parts = name.split(".")
        if len(parts) > 1 and parts[0] == "layers" and parts[1].isdigit():
            i = int(parts[1])
            parts[1] = str(0 if i == 0 else PROFILED_BLOCKS - 1 if i == depth - 1 else 1)
        return ".".join(parts)

    names = [name for name, _ in modules]
    if {source(n) for n in names} != {n for n, _ in short_model.named_modules()}:
        # more than the blocks changed with the depth
        return whole()
    fine = _module_profile(short_model, short, settings)
    # Bytes are counted for the innermost module running; FLOPs for a module and all it holds,
    # so the two modules holding every block (the model, its block list) count the blocks the
    # short model lacks.
    more = (depth - PROFILED_BLOCKS) * fine.forward_flops.get("layers.1", 0)

    def copied(figures: Mapping[str, _V], leave_out: Sequence[str] = ()) -> dict[str, _V]:
        """A per-unit figure of the short model for each module of the deep one."""
        return {n: figures[source(n)] for n in names if source(n) in figures and n not in leave_out}

    return ActivationProfile(
        input_bytes=fine.input_bytes,
        saved_bytes={n: fine.saved_bytes[source(n)] for n in names},
        produced_bytes={n: fine.produced_bytes[source(n)] for n in names},
        entry_bytes={n: fine.entry_bytes[source(n)] for n in names},
        forward_flops={
            n: fine.forward_flops[source(n)] + (more if n in ("", "layers") else 0)
            for n in names
            if source(n) in fine.forward_flops
        },
        op_outputs=_op_outputs_at_depth(fine, names, source, depth),
        working_forward_bytes=fine.working_forward_bytes,
        working_backward_bytes=fine.working_backward_bytes,
        working_forward_by_unit=copied(fine.working_forward_by_unit),
        working_backward_by_unit=copied(fine.working_backward_by_unit),
        forward_local_by_unit=copied(fine.forward_local_by_unit),
        backward_entry_by_unit=copied(fine.backward_entry_by_unit),
        # What a module holding the blocks saved grows with the depth: the root's and the block
        # list's are left out (never checkpointed: checkpointing takes blocks).
        backward_with_saved_by_unit=copied(fine.backward_with_saved_by_unit, ("", "layers")),
    )


def _block_index(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[1]) if len(parts) > 1 and parts[0] == "layers" and parts[1].isdigit() else None


def _op_outputs_at_depth(
    fine: ActivationProfile, names: Sequence[str], source: Any, depth: int
) -> dict[str, tuple[tuple[int, str, int, int, int], ...]]:
    """The short model's op outputs for the deep model's modules, in the deep forward's order:
    block i (a copy of block ``source``'s) runs (i - its source) blocks' worth of ops later, and
    what runs after the blocks (the head) the missing blocks' worth later."""
    by_block: dict[int, list[int]] = {}
    for name, events in fine.op_outputs.items():
        i = _block_index(name)
        if i is not None:
            by_block.setdefault(i, []).extend(e[0] for e in events)
    per_block = len(by_block.get(1, ()))
    first_end = max(by_block.get(0, [-1]))
    out = {}
    for n in names:
        events = fine.op_outputs.get(source(n), ())
        if not events:
            continue
        i, src = _block_index(n), _block_index(source(n))
        if i is not None and src is not None:
            shift = (i - src) * per_block
            out[n] = tuple((e[0] + shift, *e[1:]) for e in events)
        else:  # outside the blocks: the head runs after every block
            after = (depth - PROFILED_BLOCKS) * per_block
            out[n] = tuple((e[0] + (after if e[0] > first_end else 0), *e[1:]) for e in events)
    return out


def profile_step_activations(
    model: Any, choice: ModelChoice, units: Sequence[UnitInfo], settings: PlanSettings
) -> ActivationProfile:
    """profile.profile_activations in the compute dtype, with the chosen attention kernel.

    Parameters (not buffers: FSDP's mixed precision leaves them alone) and float inputs are
    cast to the compute dtype for the forward, as FSDP's mixed precision casts them.
    """
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[
        settings.compute_dtype
    ]
    batch = meta_batch(model, choice, settings)
    batch = tree_map(
        lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, batch
    )
    loss_fn = _loss(settings.loss, batch, choice)
    with (
        _params_in(model, dtype, _fsdp1_fp32_modules(model, settings)),
        _attention(settings.attention),
    ):
        try:
            return profile_activations(model, batch, units, loss_fn, backward=True)
        except PlanError:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's forward on meta: one clear line
            raise MetaForwardError(
                f"the forward of {choice.label} on meta failed ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}); planning needs a forward "
                "that runs on meta tensors (no .item(), no data-dependent shapes); pass "
                "--input pkg.module:builder if the default batch does not fit the model"
            ) from None


def _loss(kind: str, batch: Any, choice: ModelChoice) -> Any:
    """The step's loss: the suite's (``models.default_loss``) or torchtitan's cross-entropy
    (``F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))``) against the input
    tokens as targets (the same shape and dtype as the next-token labels)."""
    import torch
    import torch.nn.functional as F

    from fsdp_conformance.models.model_spec import default_loss

    if kind == "mse":
        return default_loss
    if not (isinstance(batch, torch.Tensor) and not batch.is_floating_point()):
        raise PlanError(
            f"--loss cross-entropy needs token inputs (an integer batch x seq tensor); "
            f"{choice.label} takes another input: use --loss mse"
        )

    def cross_entropy(output: Any) -> Any:
        logits = output[0] if isinstance(output, (tuple, list)) else output
        return F.cross_entropy(logits.flatten(0, -2).float(), batch.flatten())

    return cross_entropy


@contextlib.contextmanager
def _params_in(model: Any, dtype: Any, full: Sequence[Any] = ()) -> Iterator[None]:
    """``model``'s parameters in ``dtype`` for the forward, but those of the ``full`` modules:
    they keep theirs, fed fp32 inputs and handing back their inputs' dtype, as FSDP1 does
    (``sharding.fsdp1_full_precision_hooks``)."""
    from fsdp_conformance.fsdp.sharding import fsdp1_full_precision_hooks

    kept = {id(p) for m in full for p in m.parameters()}
    saved = {}
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype and id(p) not in kept:
            saved[p] = p.dtype
            p.data = p.data.to(dtype)  # meta: no storage, only the dtype changes
    handles = [h for m in full for h in fsdp1_full_precision_hooks(m)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for p, original in saved.items():
            p.data = p.data.to(original)


def _fsdp1_fp32_modules(model: Any, settings: PlanSettings) -> list[Any]:
    """The modules FSDP1's ``MixedPrecision`` keeps in fp32 by default (``_BatchNorm``) where
    the plan is FSDP1 in a lower compute dtype: their parameters, the inputs they save and
    their products are fp32 (measured: without them a bf16 ResNet's peak was 1.15 x the
    estimate); none otherwise (FSDP2 keeps none by default)."""
    from fsdp_conformance.fsdp.sharding import fsdp1_mixed_precision_ignored

    if settings.version != "fsdp1" or settings.compute_dtype == "fp32":
        return []
    return fsdp1_mixed_precision_ignored(model)


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
            raise PlanError(
                f"torch {torch.__version__} has no fused attention op with a meta "
                "kernel; rerun with --attention math (saves seq x seq weights)"
            )
        yield
        return

    fused = op  # narrowed to not-None for the class body below

    class FusedOnMeta(TorchFunctionMode):
        def __torch_function__(  # type: ignore[no-untyped-def]
            self, func, types, args=(), kwargs=None
        ):
            kwargs = dict(kwargs or {})
            if func is F.scaled_dot_product_attention and args and args[0].device.type == "meta":
                q, k, v, *rest = args
                names = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
                kwargs.update(zip(names, rest))
                mask = kwargs.get("attn_mask")
                # A mask that needs a gradient (T5's learned position bias) is one the fused
                # kernel cannot differentiate: torch runs the unfused path for it, and so do we.
                learned_mask = isinstance(mask, torch.Tensor) and mask.requires_grad
                if not kwargs.get("enable_gqa") and not learned_mask:
                    out = fused(
                        q,
                        k,
                        v,
                        dropout_p=kwargs.get("dropout_p", 0.0),
                        is_causal=kwargs.get("is_causal", False),
                        attn_mask=kwargs.get("attn_mask"),
                        scale=kwargs.get("scale"),
                    )
                    return out[0]
                return func(q, k, v, **kwargs)
            return func(*args, **kwargs)

    with FusedOnMeta():
        yield
