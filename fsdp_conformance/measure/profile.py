"""From a model to the bound's inputs, on meta tensors (nothing allocated).

:func:`plan_step` gives the per-layer unit plan and the
:class:`~fsdp_conformance.measure.bound.StepConfig` of a model; :func:`profile_activations` measures
its activations per unit with a forward on meta.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fsdp_conformance._compat import (
    flash_attention_cpu_op,
    grouped_mm_op,
    is_view,
    op_sac_kinds,
    storage_key,
    torch_dispatch_mode_cls,
    tree_leaves,
)
from fsdp_conformance.measure.bound import (
    BOUND_TOLERANCE,
    ActivationProfile,
    MeasureError,
    StepConfig,
)
from fsdp_conformance.models.model_spec import ModelSpec, call_model, default_loss
from fsdp_conformance.models.units import ROOT, UnitInfo


def unit_of(model: torch.nn.Module, units: Sequence[UnitInfo]) -> dict[int, str]:
    """id(module) -> fqn of the unit that owns it (the closest enclosing unit module)."""
    fqns = {u.fqn for u in units}
    owner: dict[int, str] = {}
    for name, module in model.named_modules():
        parts = name.split(".") if name else []
        unit = ROOT
        for i in range(len(parts), 0, -1):
            candidate = ".".join(parts[:i])
            if candidate in fqns:
                unit = candidate
                break
        owner[id(module)] = unit
    return owner


def _grouped_mm_on_meta() -> Any:
    """A dispatch mode that runs ``aten._grouped_mm`` on meta in any float dtype.

    torch's meta kernel accepts only bf16 (the CUDA rule) but the CPU kernel runs fp32, which
    transformers' mixture-of-experts layers use on CPU: without this, a meta forward of such a
    model raises where the real forward runs. The op is computed on bf16 copies of the meta
    inputs (shapes only, nothing allocated) and its result given the dtype the CPU kernel
    returns, so the output and what autograd saves are the real step's, byte for byte.
    """
    TorchDispatchMode = torch_dispatch_mode_cls()
    packet = grouped_mm_op()

    class GroupedMMOnMeta(TorchDispatchMode):  # type: ignore[misc,valid-type]
        def __torch_dispatch__(  # type: ignore[no-untyped-def]
            self, func, types, args=(), kwargs=None
        ):
            kwargs = kwargs or {}
            a, b = (args + (None, None))[:2]
            if (
                packet is not None
                and getattr(func, "overloadpacket", None) is packet
                and isinstance(a, torch.Tensor)
                and isinstance(b, torch.Tensor)
                and a.device.type == "meta"
                and a.dtype != torch.bfloat16
                and kwargs.get("out_dtype") is None
            ):
                out = func(a.to(torch.bfloat16), b.to(torch.bfloat16), *args[2:], **kwargs)
                return out.to(a.dtype)
            return func(*args, **kwargs)

    return GroupedMMOnMeta()


def profile_activations(
    model: torch.nn.Module,
    batch: Any,
    units: Sequence[UnitInfo],
    loss_fn: Callable[[Any], Any] = default_loss,
    *,
    count_flops: bool = True,
    backward: bool = False,
) -> ActivationProfile:
    """Activation bytes per unit for one forward + loss, measured on a meta model and batch.

    Saved tensors are those autograd keeps for backward (``saved_tensors_hooks``), deduplicated
    by storage; parameters are excluded (they are counted as parameters). Works on any device;
    on ``meta`` nothing is allocated, so it runs at full scale. ``count_flops``: each unit's
    forward FLOPs too (``forward_flops``: what recomputing a checkpointed unit costs, which only
    the planner reports); torch's ``FlopCounterMode`` is about a third of the forward's time
    (``benchmarks/bench_profile_flops.py``). ``backward``: run the backward too and measure
    the working set (``working_forward_bytes``, ``working_backward_bytes``): the peak of the
    tensors the step makes that are alive at once and are neither saved for backward nor
    gradients of parameters, in forward and in backward (:class:`_Liveness`), and the same
    peak while each unit runs (``working_forward_by_unit``, ``working_backward_by_unit``): in
    forward the unit whose forward is innermost, in backward the unit that saved the tensors
    the running node unpacks (a node that unpacks none keeps the unit before it).
    """
    TorchDispatchMode = torch_dispatch_mode_cls()

    owner = unit_of(model, units)
    param_storages = {storage_key(p.untyped_storage()) for p in model.parameters()}
    stack: list[str] = [ROOT]
    saved: dict[str, int] = {u.fqn: 0 for u in units}
    produced: dict[str, int] = {u.fqn: 0 for u in units}
    entry: dict[str, int] = {u.fqn: 0 for u in units}
    seen: set[int] = set()
    unit_modules = {id(m): name for name, m in model.named_modules() if name in entry}
    # Storages from before the step (parameters, buffers, the batch) are counted by their own
    # terms: a view of one an op returns (a transposed weight, a slice of a buffer) is not a
    # tensor the step makes.
    liveness = _Liveness(
        param_storages
        | {storage_key(b.untyped_storage()) for b in model.buffers()}
        | {
            storage_key(t.untyped_storage())
            for t in tree_leaves(batch)
            if isinstance(t, torch.Tensor)
        }
    )
    op_outputs = _OpOutputs(liveness)
    in_backward = [False]

    def pack(t: Any) -> Any:
        st = t.untyped_storage()
        liveness.saved(st)
        key = storage_key(st)
        if key not in param_storages and key not in seen:
            seen.add(key)
            saved[stack[-1]] += st.nbytes()
        # The unit that saved it: in backward, the node unpacking it runs that unit's backward.
        return stack[-1], t

    def unpack(packed: Any) -> Any:
        liveness.unit = packed[0]
        return packed[1]

    class Produced(TorchDispatchMode):  # type: ignore[misc,valid-type]
        def __torch_dispatch__(  # type: ignore[no-untyped-def]
            self, func, types, args=(), kwargs=None
        ):
            out = func(*args, **(kwargs or {}))
            if backward or func in op_outputs.kinds:
                liveness.made_all(out)
            if not in_backward[0]:
                produced[stack[-1]] += _new_bytes(out)
                op_outputs.record(stack[-1], func, args, out)
            return out

    def pre(module: Any, args: Any, kwargs: Any) -> None:
        stack.append(owner[id(module)])
        liveness.unit = stack[-1]
        name = unit_modules.get(id(module))
        if name is not None:  # what enters a unit: what checkpointing it would keep
            liveness.span(name, opened=True)
            entry[name] = max(entry[name], _storage_bytes((args, kwargs), param_storages))

    def post(module: Any, _args: Any, _out: Any) -> None:
        stack.pop()
        liveness.unit = stack[-1]
        liveness.span(unit_modules.get(id(module)), opened=False)

    handles = [
        handle
        for m in model.modules()
        for handle in (
            m.register_forward_pre_hook(pre, with_kwargs=True),
            m.register_forward_hook(post),
        )
    ]
    flops = _flop_counter(model) if count_flops else _NoFlops()
    try:
        with (
            torch.autograd.graph.saved_tensors_hooks(pack, unpack),
            _grouped_mm_on_meta(),
            Produced(),
            flops.mode,
        ):
            loss = loss_fn(call_model(model, batch))
        if backward:
            in_backward[0] = True
            with Produced():
                liveness.backward(model, loss, _grouped_mm_on_meta)
        del loss
    finally:
        for h in handles:
            h.remove()
        liveness.stop()
    leaves = tree_leaves(batch)
    input_bytes = sum(t.untyped_storage().nbytes() for t in leaves if isinstance(t, torch.Tensor))
    return ActivationProfile(
        input_bytes=input_bytes,
        saved_bytes=saved,
        produced_bytes=produced,
        entry_bytes=entry,
        forward_flops=flops.by_unit(entry),
        op_outputs=op_outputs.by_unit(),
        **liveness.peaks(backward),
    )


def _new_bytes(out: Any) -> int:
    """Bytes of an op's outputs that are not views (``produced_bytes``)."""
    return sum(
        t.untyped_storage().nbytes()
        for t in tree_leaves(out)
        if isinstance(t, torch.Tensor) and not is_view(t)
    )


class _Liveness:
    """Every storage the step makes (op outputs seen by the dispatch mode): when it is made and
    when it is freed (a weak reference's callback on the storage), and whether autograd saves it
    for backward or it becomes a parameter's gradient. Each storage made is one instance: a freed
    storage's address (``storage_key``) may be handed to a later one, an instance never is."""

    def __init__(self, before: set[int] | frozenset[int] = frozenset()) -> None:
        self.before = before  # storage keys that exist before the step: never made by it
        self.live: dict[int, int] = {}  # storage key -> its instance while alive
        self.sizes: list[int] = []  # instance -> bytes
        # (+1 made / -1 freed, instance, the unit running then)
        self.events: list[tuple[int, int, str]] = []
        self.unit = ROOT  # the unit running now (set by the forward's hooks, backward's unpack)
        # A unit module's forward opening or closing before event i: (i, +1 / -1, unit)
        self.spans: list[tuple[int, int, str]] = []
        self.open_spans: list[str] = []  # the unit modules whose forward runs now
        # A saved storage's instance -> the unit modules whose forward ran when it was saved
        self.saved_in: dict[int, tuple[str, ...]] = {}
        self.saved_instances: set[int] = set()
        self.gradients: set[int] = set()
        self.backward_from: int | None = None
        self.refs: list[Any] = []

    def made(self, storage: Any) -> None:
        key = storage_key(storage)
        if key in self.live or key in self.before:
            return
        instance = len(self.sizes)
        self.sizes.append(storage.nbytes())
        self.live[key] = instance
        self.events.append((1, instance, self.unit))
        self.refs.append(weakref.ref(storage, functools.partial(self._freed, key, instance)))

    def made_all(self, out: Any) -> None:
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.made(t.untyped_storage())

    def backward(self, model: Any, loss: Any, modes: Callable[[], Any]) -> None:
        """``loss.backward()`` under ``modes()``, its events marked as backward's; the
        parameters' gradients are noted as such and set back to None."""
        self.backward_from = len(self.events)
        with modes():
            loss.backward()
        for p in model.parameters():
            if p.grad is not None:
                self.gradient(p.grad.untyped_storage())
                p.grad = None

    def span(self, unit: str | None, *, opened: bool) -> None:
        """A unit module's forward starts (``opened``) or ends here (None: not a unit's)."""
        if unit is None:
            return
        self.spans.append((len(self.events), 1 if opened else -1, unit))
        _enter_or_leave(self.open_spans, unit, opened)

    def _freed(self, key: int, instance: int, _ref: Any = None) -> None:
        if self.live.get(key) == instance:
            del self.live[key]
        self.events.append((-1, instance, self.unit))

    def instance(self, storage: Any) -> int | None:
        return self.live.get(storage_key(storage))

    def saved(self, storage: Any) -> None:
        instance = self.instance(storage)
        if instance is not None:
            self.saved_instances.add(instance)
            self.saved_in.setdefault(instance, tuple(self.open_spans))

    def gradient(self, storage: Any) -> None:
        instance = self.instance(storage)
        if instance is not None:
            self.gradients.add(instance)

    def stop(self) -> None:
        """No more events: the weak references of storages still alive are dropped (a dead
        weak reference calls nothing)."""
        self.refs.clear()

    def peaks(self, measured: bool) -> dict[str, Any]:
        """The most bytes alive at once of storages neither saved nor gradients (the working
        set), in forward and in backward, for the step and while each unit runs (None and
        empty when the backward did not run). A unit's figure is the whole step's working set
        while it runs, not only what it made (in backward from the moment it starts). And per
        unit module, for checkpointing it: the most, during its backward, of the working set
        plus what it saved still alive (:attr:`ActivationProfile.backward_with_saved_by_unit`),
        the working set when its backward starts (the gradient flowing in) and the most alive
        at once of what its forward made (:meth:`_forward_local`).
        """
        if not measured:
            return {"working_forward_bytes": None, "working_backward_bytes": None}
        skip = self.saved_instances | self.gradients
        alive = 0
        start = self.backward_from if self.backward_from is not None else len(self.events)
        by_unit: tuple[dict[str, int], dict[str, int]] = ({}, {})
        own: dict[str, int] = {}  # unit module -> bytes it saved, alive now
        entry: dict[str, int] = {}
        with_saved: dict[str, tuple[int, int]] = {}
        spans = {name for _, _, name in self.spans}
        ancestors: dict[str, tuple[str, ...]] = {}
        for i, (sign, instance, unit) in enumerate(self.events):
            before = alive
            if instance in self.saved_in:
                for name in self.saved_in[instance]:
                    own[name] = own.get(name, 0) + sign * self.sizes[instance]
            elif instance not in skip:
                alive += sign * self.sizes[instance]
            if i < start:
                if by_unit[0].get(unit, -1) < alive:
                    by_unit[0][unit] = alive
                continue
            now = max(before, alive)
            if by_unit[1].get(unit, -1) < now:
                by_unit[1][unit] = now
            if unit not in ancestors:
                ancestors[unit] = _enclosing(unit, spans)
            for name in ancestors[unit]:
                entry.setdefault(name, before)
                mine = own.get(name, 0)
                if sum(with_saved.get(name, (0, -1))) < mine + now:
                    with_saved[name] = (mine, now)
        forward, back = by_unit
        return {
            "working_forward_bytes": max(forward.values(), default=0),
            "working_backward_bytes": max(back.values(), default=0),
            "working_forward_by_unit": forward,
            "working_backward_by_unit": back,
            "forward_local_by_unit": self._forward_local(skip, start),
            "backward_entry_by_unit": entry,
            "backward_with_saved_by_unit": with_saved,
        }

    def _forward_local(self, skip: set[int], start: int) -> dict[str, int]:
        """Per unit module, the most bytes alive at once during its forward of the storages
        made during it (nested modules' included), neither saved nor gradients."""
        # In the order they happened (a span with no event of its own opens and closes at one
        # event index: sorting would put its close first and leave it open).
        opens = self.spans
        local: dict[str, int] = {}
        peak: dict[str, int] = {}
        open_now: list[str] = []
        made_in: dict[int, tuple[str, ...]] = {}
        j = 0
        for i, (sign, instance, _unit) in enumerate(self.events[:start]):
            while j < len(opens) and opens[j][0] <= i:
                _, how, name = opens[j]
                _enter_or_leave(open_now, name, how > 0)
                if how > 0:
                    local[name] = 0
                    peak.setdefault(name, 0)
                j += 1
            if instance in skip:
                continue
            if sign > 0:
                made_in[instance] = tuple(open_now)
                for name in open_now:
                    local[name] += self.sizes[instance]
                    peak[name] = max(peak[name], local[name])
            else:
                for name in made_in.get(instance, ()):
                    if name in open_now:
                        local[name] -= self.sizes[instance]
        return peak


def _enter_or_leave(open_spans: list[str], unit: str, opened: bool) -> None:
    """A unit module's forward starts (pushed) or ends (the innermost span of that name
    popped: forwards nest, so it is the last unless a hook was missed)."""
    if opened:
        open_spans.append(unit)
    elif unit in open_spans:
        del open_spans[len(open_spans) - 1 - open_spans[::-1].index(unit)]


def _enclosing(unit: str, spans: set[str]) -> tuple[str, ...]:
    """``unit`` and the unit modules that hold it (by name), innermost first."""
    parts = unit.split(".") if unit else []
    names = [".".join(parts[:k]) for k in range(len(parts), -1, -1)]
    return tuple(n for n in names if n in spans)


class _OpOutputs:
    """The outputs of the ops op-level selective checkpointing decides on
    (``_compat.op_sac_kinds``), per unit in forward order (``ActivationProfile.op_outputs``)."""

    def __init__(self, liveness: _Liveness) -> None:
        self.kinds = op_sac_kinds()
        self.liveness = liveness
        # (owner, order, kind, {instance: bytes}, flops)
        self.events: list[tuple[str, int, str, dict[int, int], int]] = []

    def record(self, owner: str, func: Any, args: Any, out: Any) -> None:
        kind = self.kinds.get(func)
        if kind is None:
            return
        storages: dict[int, int] = {}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                instance = self.liveness.instance(t.untyped_storage())
                if instance is not None:
                    storages[instance] = t.untyped_storage().nbytes()
        self.events.append((owner, len(self.events), kind, storages, _op_flops(kind, args)))

    def by_unit(self) -> dict[str, tuple[tuple[int, str, int, int, int], ...]]:
        """Per unit: (order, kind, bytes, of them saved for backward, flops)."""
        saved = self.liveness.saved_instances
        outputs: dict[str, list[tuple[int, str, int, int, int]]] = {}
        for unit, order, kind, storages, flops in self.events:
            also = sum(v for k, v in storages.items() if k in saved)
            outputs.setdefault(unit, []).append((order, kind, sum(storages.values()), also, flops))
        return {k: tuple(v) for k, v in outputs.items()}


def _op_flops(kind: str, args: Any) -> int:
    """Forward FLOPs of an op op-level SAC keeps (what keeping it saves in recompute): a matmul
    ``(m, k) @ (k, n)`` is 2mkn; attention over q (b, h, s, d) and k (b, h, t, d) is two such
    products, 4bhstd (torch's ``flop_counter`` formulas)."""
    a, b = args[0], args[1]
    if kind == "mm":
        return int(2 * a.shape[0] * a.shape[1] * b.shape[1])
    *lead, s, d = a.shape
    lead_size = 1
    for n in lead:
        lead_size *= n
    return int(4 * lead_size * s * b.shape[-2] * d)


def _storage_bytes(tree: Any, exclude: set[int]) -> int:
    """Bytes of the distinct storages of the tensors in ``tree``, those in ``exclude`` left out."""
    storages: dict[int, int] = {}
    for t in tree_leaves(tree):
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            storages.setdefault(storage_key(st), st.nbytes())
    return sum(v for k, v in storages.items() if k not in exclude)


class _Flops:
    """torch's ``FlopCounterMode`` around one forward, read back per module FQN."""

    def __init__(self, model: torch.nn.Module) -> None:
        from torch.utils.flop_counter import FlopCounterMode, flop_registry

        self.root = type(model).__name__
        # The planner runs attention as the CPU flash op on meta (plan.activations._attention),
        # which torch's registry does not count: count it as the GPU flash op it stands for.
        mapping: dict[Any, Any] = {}
        cpu, gpu = (
            flash_attention_cpu_op(),
            getattr(torch.ops.aten, "_scaled_dot_product_flash_attention", None),
        )
        if cpu is not None and gpu in flop_registry:
            formula = flop_registry[gpu]

            def as_flash(*args: Any, **kwargs: Any) -> Any:
                return formula(*args, **kwargs)

            as_flash._get_raw = True  # type: ignore[attr-defined]  # formula shape-wraps itself
            mapping[getattr(cpu, "overloadpacket", cpu)] = as_flash
        self.mode = FlopCounterMode(display=False, custom_mapping=mapping)

    def by_unit(self, units: Sequence[str] | dict[str, int]) -> dict[str, int]:
        counts = self.mode.get_flop_counts()
        out = {}
        for fqn in units:
            ops = counts.get(f"{self.root}.{fqn}" if fqn else self.root)
            if ops is not None:
                out[fqn] = int(sum(ops.values()))
        return out


def _flop_counter(model: torch.nn.Module) -> Any:
    """A :class:`_Flops` or, where this torch has no usable ``FlopCounterMode``, one that counts
    nothing (recompute costs are then reported as unknown)."""
    try:
        return _Flops(model)
    except (ImportError, TypeError):  # pragma: no cover - depends on the torch version
        return _NoFlops()


class _NoFlops:
    """A FLOP counter that counts nothing (``forward_flops`` stays empty)."""

    def __init__(self) -> None:
        self.mode = contextlib.nullcontext()

    def by_unit(self, units: Any) -> dict[str, int]:
        return {}


#: The meta plan of each model and batch size this process has profiled: units, activation
#: profile, buffer bytes. They depend on the model and its input alone, not on the world size,
#: FSDP version, optimizer or byte widths of the step judged against them, so the memory checks
#: of one model (each FSDP version, each check; the depth check at three depths) profile it once
#: per process. A factory's key holds the factory and input builder objects themselves: a
#: module imported anew (another test's file of the same name) is another model.
_PLANS: dict[tuple[Any, ...], tuple[list[UnitInfo], ActivationProfile, int]] = {}


def _plan_key(spec: ModelSpec, batch_size: int) -> tuple[Any, ...]:
    from fsdp_conformance.models.model_spec import load_object

    callables = tuple(
        load_object(path, what) if path else None
        for path, what in ((spec.factory, "model factory"), (spec.input_builder, "input builder"))
    )
    return (spec, batch_size, *callables)


def plan_step(
    spec: ModelSpec,
    world_size: int,
    version: str,
    *,
    optimizer: str | None = None,
    batch_size: int = 2,
    compute_bytes: int = 4,
    param_bytes: int = 4,
    tolerance: float = BOUND_TOLERANCE,
) -> tuple[list[UnitInfo], StepConfig]:
    """The per-layer plan and step configuration of a model, on meta (nothing allocated)."""
    key = _plan_key(spec, batch_size)
    if key not in _PLANS:
        _PLANS[key] = _profile_on_meta(spec, batch_size)
    units, acts, buffers = _PLANS[key]
    config = StepConfig(
        world_size=world_size,
        version=version,
        param_bytes=param_bytes,
        compute_bytes=compute_bytes,
        optimizer=optimizer,
        buffer_bytes=buffers,
        activations=acts,
        tolerance=tolerance,
    )
    return list(units), config


#: The largest model (fp32 parameter bytes) whose activations are profiled on the CPU where its
#: forward cannot run on meta: a model the memory checks measure on CPU ranks fits there anyway.
PROFILE_ON_CPU_MAX_BYTES = 1 << 30


def _profile_on_meta(
    spec: ModelSpec, batch_size: int
) -> tuple[list[UnitInfo], ActivationProfile, int]:
    """The plan on meta; where the model's forward cannot run on meta (a data-dependent step
    such as ``Tensor.item()``), on the CPU instead, for a model of at most
    :data:`PROFILE_ON_CPU_MAX_BYTES`: the profile counts bytes, which are the same on either
    device, and a forward that needs real values gets them."""
    try:
        return _profile_on("meta", spec, batch_size)
    except _ForwardFailed as on_meta:
        if on_meta.param_bytes > PROFILE_ON_CPU_MAX_BYTES:
            raise MeasureError(
                f"{on_meta.line('meta')}, and at {on_meta.param_bytes:,} parameter bytes it is "
                "too large to profile on the CPU instead; the model's forward and its input "
                "builder must work with device='meta' (no data-dependent Python control flow "
                "on tensor values)"
            ) from on_meta.cause
        try:
            with torch.random.fork_rng(devices=[]):  # the rank's own draws stay as they were
                return _profile_on("cpu", spec, batch_size)
        except _ForwardFailed as on_cpu:
            raise MeasureError(
                f"{on_meta.line('meta')}, nor on the CPU ({on_cpu.line('cpu')}); the model's "
                "forward and its input builder must run on the default batch (--input names "
                "another)"
            ) from on_cpu.cause


class _ForwardFailed(Exception):
    """The profiling forward of a model failed on a device."""

    def __init__(self, name: str, cause: BaseException, param_bytes: int) -> None:
        super().__init__(name)
        self.name, self.cause, self.param_bytes = name, cause, param_bytes

    def line(self, device: str) -> str:
        first = str(self.cause).splitlines()[0] if str(self.cause) else ""
        return (
            f"cannot profile the activations of {self.name!r} on the {device} device "
            f"({type(self.cause).__name__}: {first})"
        )


def _profile_on(
    device: str, spec: ModelSpec, batch_size: int
) -> tuple[list[UnitInfo], ActivationProfile, int]:
    from fsdp_conformance.models.units import plan_units

    built = spec.instantiate(device)
    model = built.model
    units = plan_units(model, built.policy("recommended"))
    try:
        batch = built.batch(batch_size, device)
        # The memory checks' bounds read bytes only: no FLOPs (the planner counts them).
        acts = profile_activations(model, batch, units, count_flops=False)
    except Exception as exc:  # noqa: BLE001 - a user's model or input builder; say which
        param_bytes = sum(p.numel() * 4 for p in model.parameters())
        raise _ForwardFailed(spec.name, exc, param_bytes) from exc
    buffers = sum(b.untyped_storage().nbytes() for b in model.buffers())
    return units, acts, buffers
