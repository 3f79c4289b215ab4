"""The collectives FSDP issues during a step, as it issued them: op, dtypes, bytes, unit, order.

Observed below FSDP and below ``torch.distributed``'s Python functions: a dispatch mode sees
every ``c10d`` op the process group runs (``c10d::_allgather_base_``, ``allgather_``,
``_reduce_scatter_base_``, ``allreduce_``, ``broadcast_``, their coalesced forms), whichever
FSDP version, Python wrapper or backend issued it. What a record holds is read from the op's
tensors, never from FSDP's configuration: a changed default (a reduce dtype, a prefetch order, a
sharding strategy) shows up as a changed record.

The unit a collective serves is the one torch issued it for: while recording, the torch
functions that issue one unit's collectives (FSDP1 ``FlatParamHandle.unshard`` and
``_reduce_grad``, FSDP2 ``FSDPParamGroup.unshard`` and ``post_backward``;
``_compat.unit_collective_scopes``) note the handle or param group they run for, and a
collective issued inside one is that unit's, whatever its size: FSDP2 reduce-scatters only the
parameters that have a gradient (a unit holding a frozen parameter reduces a part of itself), and
a prefetched all-gather runs inside another unit's forward or backward, where "the unit running
now" is not the unit served. Hooks on modules are not used for that reason.

A collective issued outside those functions (DTensor's, a state dict's gather, a compiled
model's, recorded from ``torch.distributed``'s functions) is matched by **size**: its full side
(an all-gather's output, a reduce-scatter's input, an all-reduce's or broadcast's tensor) against
each unit's parameter numel, unpadded and padded to a multiple of the world size the way each
FSDP version pads (FSDP1 pads its flat parameter, FSDP2 each parameter's first dimension). Units
of equal size cannot be told apart by size; such records name every candidate, ``a|b``.

DTensor's collectives (a ``full_tensor()``, the redistribution an op on a partial DTensor needs:
the norm ``clip_grad_norm_`` computes on FSDP2's gradients) are functional collectives
(``_c10d_functional``) that DTensor issues inside its own dispatch, out of a mode's sight;
``record_collectives(dtensor=True)`` lets DTensor run first, as torch's ``CommDebugMode`` does,
and records them too.
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from fsdp_conformance import _compat
from fsdp_conformance.models.units import clean_fqn

#: The collective kinds recorded, by the words in their ``c10d`` op names.
KINDS = (
    ("reduce_scatter", "reduce_scatter"),
    ("allgather", "all_gather"),
    ("all_gather", "all_gather"),  # the functional collectives' spelling
    ("allreduce", "all_reduce"),
    ("all_reduce", "all_reduce"),
    ("broadcast", "broadcast"),
)
#: The namespace of the functional collectives (DTensor's): their input comes first and their
#: output is the op's result.
FUNCTIONAL = "_c10d_functional"
#: The fields of one record (plain data; the report stores the list as it is).
FIELDS = ("op", "unit", "phase", "in_dtype", "out_dtype", "in_bytes", "out_bytes")
#: The unit of a collective whose size matches no unit.
UNKNOWN_UNIT = "?"


def _kind(op_name: str) -> str | None:
    for word, kind in KINDS:
        if word in op_name:
            return kind
    return None


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in _compat.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _side(tensors: Sequence[torch.Tensor]) -> tuple[str | None, int, int]:
    """(dtype, bytes, numel) of one side of a collective (several tensors: summed)."""
    if not tensors:
        return None, 0, 0
    dtypes = sorted({str(t.dtype) for t in tensors})
    return (
        "|".join(dtypes),
        sum(t.numel() * t.element_size() for t in tensors),
        sum(t.numel() for t in tensors),
    )


class UnitSizes(dict[str, list[int]]):
    """:func:`unit_sizes`' answer: per unit FQN the numels its collectives can have, and
    :attr:`owners`, the unit FQN of each of torch's per-unit objects (an FSDP1
    ``FlatParamHandle``, an FSDP2 ``FSDPParamGroup``) by identity, which names the unit of a
    collective torch issues for it."""

    def __init__(
        self,
        sizes: Mapping[str, list[int]] | None = None,
        owners: Mapping[int, str] | None = None,
    ) -> None:
        super().__init__(sizes or {})
        self.owners: dict[int, str] = dict(owners or {})
        #: The per-unit objects themselves (weakly): where something replaced a unit function
        #: on the object (FSDPMemTracker wraps each ``FSDPParamGroup.post_backward``), the
        #: scope is pushed around that replacement too (:func:`_unit_scopes`).
        self.objects: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()

    def __reduce__(self) -> tuple[Any, ...]:
        # Plain data across processes: the sizes and owners, never torch's objects.
        return (UnitSizes, (dict(self), self.owners))


class CollectiveRecorder:
    """Appends one record per collective to :attr:`records`; set :attr:`phase` as the step goes.

    ``unit_sizes`` maps each unit's FQN to the numels its collectives can have
    (:func:`unit_sizes`; a :class:`UnitSizes` also names the unit of each of torch's per-unit
    objects); ``phase`` is the caller's label for where the step is (``forward``,
    ``backward``, ``optimizer``).
    """

    def __init__(
        self, unit_sizes: Mapping[str, Sequence[int]] | None = None, *, groups: bool = False
    ) -> None:
        self.records: list[dict[str, Any]] = []
        self.phase = ""
        #: Whether each record names the global ranks of its process group (``group``).
        self.groups = groups
        self._by_size: dict[int, list[str]] = {}
        for fqn, sizes in (unit_sizes or {}).items():
            for size in set(sizes):
                self._by_size.setdefault(size, []).append(fqn)
        self._owners: dict[int, str] = dict(getattr(unit_sizes, "owners", {}))
        self.objects: list[Any] = list(getattr(unit_sizes, "objects", {}).values())
        #: The torch objects (by identity) whose unit function is running, innermost last.
        self.scope: list[int] = []

    def unit_of(self, numel: int) -> str:
        """The unit torch is issuing a collective for (:attr:`scope`), else the units of
        ``numel`` elements."""
        if self.scope and self.scope[-1] in self._owners:
            return self._owners[self.scope[-1]]
        units = self._by_size.get(numel)
        return "|".join(units) if units else UNKNOWN_UNIT  # the root's FQN is ""

    def add(self, op_name: str, args: Sequence[Any], result: Any = None) -> None:
        """One record of ``op_name`` called with ``args`` (a functional collective: and
        ``result``, its output)."""
        kind = _kind(op_name)
        if kind is None or not args:
            return  # barriers, point-to-point, alltoall: not what FSDP's step issues
        if op_name.startswith(FUNCTIONAL) and kind != "all_reduce":
            # functional: (input, ...) -> output
            inp, out = _tensors(args[0]), _tensors(result)
            full = out if kind == "all_gather" else inp
        elif kind in ("all_reduce", "broadcast"):
            out = _tensors(args[0])
            inp = out  # in place
            full = out
        else:
            # all-gather and reduce-scatter: (output, input, process group, ...)
            out, inp = _tensors(args[0]), _tensors(args[1] if len(args) > 1 else [])
            full = out if kind == "all_gather" else inp
        in_dtype, in_bytes, _ = _side(inp)
        out_dtype, out_bytes, _ = _side(out)
        numel = _side(full)[2]
        record: dict[str, Any] = {
            "op": kind,
            "unit": self.unit_of(numel),
            "phase": self.phase,
            "in_dtype": in_dtype,
            "out_dtype": out_dtype,
            "in_bytes": in_bytes,
            "out_bytes": out_bytes,
            # The elements of the unit's side (an all-gather's output, a reduce-scatter's
            # input): FSDP2 reduce-scatters only the parameters that got a gradient.
            "numel": numel,
        }
        if self.groups:
            found = (_compat.process_group_ranks(a) for a in args)
            record["group"] = next((g for g in found if g is not None), None)
        self.records.append(record)


@contextlib.contextmanager
def record_collectives(
    unit_sizes: Mapping[str, Sequence[int]] | None = None,
    *,
    dtensor: bool = False,
    groups: bool = False,
) -> Iterator[CollectiveRecorder]:
    """While inside, every ``c10d`` collective this process issues is recorded, in issue order;
    ``dtensor``: DTensor's functional collectives too (each op on a DTensor is left to DTensor
    first, so that the mode sees the collectives it issues); ``groups``: each record names the
    global ranks of its process group (``group``; HSDP's reduce-scatter and all-reduce run on
    different groups)."""
    dispatch_mode = _compat.torch_dispatch_mode_cls()
    recorder = CollectiveRecorder(unit_sizes, groups=groups)
    dtensor_cls = _compat.dtensor_cls() if dtensor else None

    class _Recorder(dispatch_mode):  # type: ignore[misc,valid-type]
        def __torch_dispatch__(  # type: ignore[no-untyped-def]
            self, func, types, args=(), kwargs=None
        ):
            if dtensor_cls is not None and any(issubclass(t, dtensor_cls) for t in types):
                return NotImplemented  # DTensor runs it and issues its collectives to this mode
            namespace = getattr(func, "namespace", None)
            if namespace == "c10d":
                recorder.add(str(func), args)
            out = func(*args, **(kwargs or {}))
            if namespace == FUNCTIONAL and dtensor_cls is not None:
                recorder.add(str(func), args, out)
            return out

    with _unit_scopes(recorder), _Recorder():
        yield recorder


@contextlib.contextmanager
def _unit_scopes(recorder: CollectiveRecorder) -> Iterator[None]:
    """While inside, each of torch's functions that issues one unit's collectives
    (``_compat.unit_collective_scopes``) pushes the handle or param group it runs for on
    ``recorder.scope``."""

    def scoped(fn: Any, position: int) -> Any:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            recorder.scope.append(id(args[position]) if len(args) > position else 0)
            try:
                return fn(*args, **kwargs)
            finally:
                recorder.scope.pop()

        return call

    def scoped_bound(fn: Any, obj: Any) -> Any:
        # A replacement on the object is called without the object as an argument.
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            recorder.scope.append(id(obj))
            try:
                return fn(*args, **kwargs)
            finally:
                recorder.scope.pop()

        return call

    patched: list[tuple[Any, str, Any]] = []
    try:
        for owner, attr, position in _compat.unit_collective_scopes():
            patched.append((owner, attr, vars(owner).get(attr)))
            setattr(owner, attr, scoped(getattr(owner, attr), position))
            if position != 0 or not isinstance(owner, type):
                continue
            # A method replaced on an instance (FSDPMemTracker wraps each param group's
            # post_backward, calling the method it found then) bypasses the class's.
            for obj in recorder.objects:
                if isinstance(obj, owner) and attr in vars(obj):
                    patched.append((obj, attr, vars(obj)[attr]))
                    setattr(obj, attr, scoped_bound(vars(obj)[attr], obj))
        yield
    finally:
        for owner, attr, original in reversed(patched):
            if original is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)


def _fsdp2_padded(shape: Sequence[int], world_size: int) -> int:
    # FSDP2 pads each parameter's dim 0 to a multiple of the world size (Shard(0) chunks).
    if not shape:
        return world_size
    rest = math.prod(shape[1:])
    return -(-shape[0] // world_size) * world_size * rest


def unit_sizes(model: nn.Module, version: str, world_size: int) -> UnitSizes:
    """Per unit FQN (``""`` the root): the numels a collective serving it can have, and the
    unit of each of torch's per-unit objects (:class:`UnitSizes`).

    FSDP1: the flat parameter's unpadded and padded unsharded numel. FSDP2: the sum of the
    unit's own sharded parameters' numels (a parameter it leaves plain, ignored, is in none of
    its collectives), unpadded and padded per parameter, and the same of its trainable ones
    where it also holds frozen ones (its reduce-scatter's). Units without parameters issue no
    collective and are left out.
    """
    out = UnitSizes()
    if version == "fsdp1":
        for name, module in model.named_modules():
            flat = _compat.fsdp1_flat_param(module)
            if flat is None:
                continue
            fqn = clean_fqn(name)
            handle = _compat.fsdp1_handle(module)
            out.owners[id(handle)] = fqn
            out.objects[id(handle)] = handle
            unpadded = _compat.fsdp1_unsharded_numel(flat)
            # NO_SHARD (a flat parameter kept whole) all-reduces it unpadded: a padded size
            # (here twice the whole) would name the unit for another unit's collective (T5
            # under NO_SHARD: one unit's all-reduce counted for two); sharded strategies pad it
            sharded = flat.numel() != unpadded
            out[fqn] = sorted({unpadded, flat.numel() * world_size} if sharded else {unpadded})
        return out
    fsdp_cls = _compat.fsdp_module_cls()
    dtensor = _compat.dtensor_cls()
    units = [(n, m) for n, m in model.named_modules() if isinstance(m, fsdp_cls)]
    for name, module in units:
        for group in _compat.fsdp2_param_groups(module):
            out.owners[id(group)] = name
            out.objects[id(group)] = group
        # A unit's own parameters: its parameters less those of the units nested in it.
        inner = {
            id(p)
            for n2, m2 in units
            if n2 != name and (not name or n2.startswith(name + "."))
            for p in m2.parameters()
        }
        own = [p for p in module.parameters() if id(p) not in inner]
        # A parameter fully_shard left plain (``ignored_params``) travels in none of the unit's
        # collectives: only its DTensors do (a unit without any: the unpadded sizes below).
        own = [p for p in own if isinstance(p, dtensor)] or own
        if not own:
            continue
        sizes = _fsdp2_sizes(own, world_size, dtensor)
        # FSDP2 reduces only the parameters that have a gradient: a unit holding frozen ones
        # reduce-scatters its trainable part.
        trainable = [p for p in own if p.requires_grad]
        if trainable and len(trainable) < len(own):
            sizes |= _fsdp2_sizes(trainable, world_size, dtensor)
        out[name] = sorted(sizes)
    return out


def _fsdp2_sizes(params: Sequence[torch.Tensor], world_size: int, dtensor: type[Any]) -> set[int]:
    """The numels of ``params`` in one FSDP2 collective, unpadded and padded per parameter."""
    shapes = [tuple(p.shape) for p in params]
    unpadded = sum(math.prod(s) for s in shapes)
    if not all(isinstance(p, dtensor) for p in params):
        return {unpadded}
    return {unpadded, sum(_fsdp2_padded(s, world_size) for s in shapes)}


#: ``torch.distributed``'s Python functions FSDP calls, with the record kind each issues.
DIST_FUNCTIONS = (
    "all_gather_single",  # FSDP2's (torch 2.13)
    "reduce_scatter_single",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
)


#: The tensor keywords of those functions, in their positional order (output, input).
_TENSOR_KWARGS = ("output", "output_tensor", "tensor", "input", "input_tensor")


@contextlib.contextmanager
def record_collective_calls(
    unit_sizes: Mapping[str, Sequence[int]] | None = None,
) -> Iterator[CollectiveRecorder]:
    """Like :func:`record_collectives`, but from ``torch.distributed``'s Python functions
    (patched for the duration, looked up at call time by both FSDP versions) instead of a
    dispatch mode: Dynamo compiles nothing while a dispatch mode is active (it runs the frame
    eager), so a compiled model is observed through this one."""
    import torch.distributed as dist

    recorder = CollectiveRecorder(unit_sizes)
    originals = {name: getattr(dist, name) for name in DIST_FUNCTIONS if hasattr(dist, name)}

    def wrap(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            named = [kwargs[k] for k in _TENSOR_KWARGS if k in kwargs]
            recorder.add(name, list(args) + named)
            return fn(*args, **kwargs)

        return call

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield recorder
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
