"""Meta-device init conformance: zero-memory build, correct weights, identical on every rank.

The phases a reader can follow (torchtitan's order):

1. **Build on meta** (:func:`build_on_meta`): shapes only, no storage.
2. **Shard**: FSDP1 wraps the meta model and materializes one unit at a time through a
   ``param_init_fn`` (or its default path, ``to_empty`` + ``reset_parameters``); FSDP2
   ``fully_shard``\\ s the meta model, then ``to_empty`` allocates only the local shards.
3. **Initialize deterministically** (:func:`deterministic_init_`, :class:`DeterministicParamInit`):
   each module's own state is generated *in full* on a CPU generator seeded from
   ``(seed, module FQN)`` by the module's own ``reset_parameters``, and each rank keeps its slice.
   The values are therefore the same on 1, 2 or 4 ranks, FSDP1 or FSDP2, CPU or GPU, and equal to
   a single-process :func:`reference_model` built from the same seed.

The checks (:data:`CHECKS`) compare what every rank holds against that single-process
reference: never "finite" (``to_empty`` memory can look finite) and never "identical across
ranks" (gathered weights are identical on every rank even when the ranks initialized
differently: docs/init.md, "Facts about meta-device init"). :data:`SEEDS_CHECKS` runs the
seeds' ``materialization_fn`` as written and turns what goes wrong into one-line findings
(:func:`describe_init_error`).
"""

from __future__ import annotations

import collections
import copy
import ctypes
import hashlib
import math
import os
import re
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn as nn

from fsdp_conformance import _compat, hf
from fsdp_conformance.bound import init_peak_bound
from fsdp_conformance.claims.check import Check, Verdict, variants
from fsdp_conformance.harness import CheckSkipped, RankContext, all_gather_objects, skip_rank
from fsdp_conformance.meters import MALLOC_ENV, host_or_cuda_peak, reset_peak_rss, status_bytes
from fsdp_conformance.models import BuiltModel, ModelSpec, call_model, default_loss, load_object
from fsdp_conformance.policies import PolicyName
from fsdp_conformance.reference_models import LlamaConfig, ModelConfig
from fsdp_conformance.sharding import check_fsdp_version, shard_fsdp1, shard_fsdp2
from fsdp_conformance.sizes import MiB
from fsdp_conformance.step import disable_dropout
from fsdp_conformance.units import clean_fqn, plan_units, planned_unit_modules

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import ValueType


#: How a sharded model gets its values.
#: - ``deterministic``: this module's per-FQN init (FSDP1 ``param_init_fn``; FSDP2 after
#:   ``to_empty``).
#: - ``reset_parameters``: FSDP1's default meta path (no ``param_init_fn``); for FSDP2 the naive
#:   equivalent, each module's ``reset_parameters()`` on its sharded parameters.
#: - ``seeds``: the seeds' ``materialization_fn`` as written (FSDP1 ``param_init_fn``; FSDP2:
#:   applied after ``fully_shard`` with no ``to_empty``, as the seeds would).
#: - ``seeds_to_empty``: the seeds' function with the minimal fix (``to_empty`` first).
METHODS = ("deterministic", "reset_parameters", "seeds", "seeds_to_empty")

#: What torch says when ``sync_module_states=True`` meets CPU tensors (FSDP1, by design).
SYNC_REFUSAL_SNIPPET = "requires them to be on GPU"

#: Meta build: allowed growth of the process's peak memory, as a fraction of the model's
#: bytes, plus a fixed allowance for Python objects (modules, dicts; ~KB per module).
META_GROWTH_FRACTION = 0.001
META_GROWTH_FIXED_MIB = 16.0

#: Peak while materializing: tolerance on the bound (allocator rounding, gloo and Python
#: objects; peaks vary up to ~8% run to run: docs/memory.md, "Facts about measuring memory on
#: CPU").
PEAK_TOLERANCE_FRACTION = 0.10
PEAK_TOLERANCE_FIXED_MIB = 4.0

#: Training step: after one step the sharded model and the reference differ only by the order
#: of floating-point reductions.
STEP_RTOL = 1e-4
STEP_ATOL = 1e-6

#: A small model with every kind of state (norm weights, a non-persistent rotary buffer).
DEFAULT_SPEC = ModelSpec(
    reference="llama", config=LlamaConfig(num_layers=2, dim=32, num_heads=4, vocab_size=128)
)
#: Large enough (45.5 MiB fp32, 5.1 MiB per block) that the peak bound is meaningful against
#: noise (~1 MiB with MALLOC_MMAP_THRESHOLD_), small enough for a 2-core CPU lane.
MEMORY_SPEC = ModelSpec(reference="massive", config=ModelConfig(num_layers=8, dim=384))


class InitError(ValueError):
    """A model cannot be initialized deterministically; the message names the module and fix."""


# --------------------------------------------------------------------------------------------
# Phase 1: build on meta
# --------------------------------------------------------------------------------------------


def tensors_on_meta(model: nn.Module) -> list[str]:
    """FQNs of every parameter and buffer (non-persistent included) still on meta."""
    names = [clean_fqn(n) for n, p in model.named_parameters() if p.is_meta]
    names += [clean_fqn(n) for n, b in model.named_buffers() if b.is_meta]
    return names


def build_on_meta(spec: ModelSpec) -> nn.Module:
    """Build ``spec``'s model under ``torch.device("meta")``: shapes only, no storage.

    Raises :class:`InitError` when the model's constructor allocates real tensors anyway
    (e.g. ``torch.tensor(...)`` with an explicit ``device=``), naming them.
    """
    model = spec.build("meta")
    real = [n for n, t in _named_state(model) if not t.is_meta]
    if real:
        raise InitError(
            f"{spec.name}: built under torch.device('meta') but {len(real)} tensor(s) are real: "
            f"{', '.join(real[:5])}; create them without an explicit device= (or register them "
            "in reset_parameters) so that meta init allocates nothing"
        )
    return model


def _named_state(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters()
    yield from model.named_buffers()


def state_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for _, t in _named_state(model))


# --------------------------------------------------------------------------------------------
# Phase 3: the deterministic, world-size-invariant init
# --------------------------------------------------------------------------------------------


def module_seed(seed: int, fqn: str) -> int:
    """A stable 63-bit seed for one module (Python's ``hash`` is salted per process)."""
    digest = hashlib.sha256(f"{seed}:{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _own_state(module: nn.Module) -> list[tuple[str, str, torch.Tensor]]:
    """``(kind, name, tensor)`` of the module's own parameters and buffers."""
    own: list[tuple[str, str, torch.Tensor]] = [
        ("param", n, p) for n, p in module._parameters.items() if p is not None
    ]
    own += [("buffer", n, b) for n, b in module._buffers.items() if b is not None]
    return own


def _global_shape(t: torch.Tensor) -> torch.Size:
    return t.shape  # a DTensor's shape is the global one


class ModuleInit:
    """How a model's modules get their values: a module's own state, filled in place.

    :meth:`target` is the module whose own tensors :func:`full_module_state` swaps for scratch
    tensors; :meth:`apply` fills them. Three contracts (docs/init.md, "What a model must
    provide"): each module's ``reset_parameters()`` (the default), the user's ``--init-fn``,
    and transformers' ``_init_weights`` for a ``PreTrainedModel``.
    """

    #: How messages name the init ("reset_parameters()", "init function 'pkg:fn'", ...).
    label = "reset_parameters()"

    def target(self, module: nn.Module, fqn: str) -> nn.Module:
        return module

    def apply(self, module: nn.Module, fqn: str) -> None:
        reset = getattr(module, "reset_parameters", None)
        if not callable(reset):
            raise InitError(
                f"module {fqn or '(root)'} ({type(module).__name__}) owns "
                f"{', '.join(n for _, n, _ in _own_state(module))} but has no "
                f"reset_parameters(); meta init cannot recreate its values: {WAYS_OUT}"
            )
        reset()

    def missing(self, model: nn.Module) -> list[str]:
        """Modules this init cannot initialize at all, as ``fqn (Class)``."""
        return _without_reset_parameters(model)


#: The default contract of a plain ``nn.Module``.
RESET_PARAMETERS = ModuleInit()

#: The three ways out for a module the init cannot recreate (one text for every message).
WAYS_OUT = (
    "define reset_parameters() on those classes (initializing the module's own parameters "
    "and buffers), or name a per-module init with --init-fn pkg.module:fn (--fsdp-init-fn "
    "under pytest, init_fn in [tool.fsdp_conformance]), or use a transformers "
    "PreTrainedModel whose _init_weights covers them"
)


def _without_reset_parameters(model: nn.Module) -> list[str]:
    return sorted(
        {
            f"{fqn or '(root)'} ({type(m).__name__})"
            for fqn, m in model.named_modules()
            if _own_state(m) and not callable(getattr(m, "reset_parameters", None))
        }
    )


class UserInit(ModuleInit):
    """``--init-fn pkg.module:fn``: ``fn(module)`` per module, as ``reset_parameters()`` is."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fn = load_object(path, "init function")
        self.label = f"init function {path!r}"

    def apply(self, module: nn.Module, fqn: str) -> None:
        self.fn(module)

    def missing(self, model: nn.Module) -> list[str]:
        return []  # the function is called on every module; what it leaves out is caught


class TransformersInit(ModuleInit):
    """A ``PreTrainedModel``: transformers' own per-module ``_init_weights``.

    transformers initializes a model by walking it children first and calling, on every
    module, the ``_init_weights`` of its nearest ``PreTrainedModel`` (``initialize_weights``);
    an ``_init_weights`` may write a child's tensors too (GPT-2's attention rescales its
    ``c_proj.weight`` after ``c_proj`` was initialized). So one module's values are its own
    ``_init_weights`` call followed by each ancestor's, nearest first. They are computed on a
    *shadow*: a second copy of the model on meta, never sharded, so the ancestors' writes to
    anything but this module's scratch tensors land on meta tensors (no storage, no effect)
    and never touch the real model, whatever FSDP has done to it. Non-persistent buffers (the
    rotary ``inv_freq`` and ``original_inv_freq``) are recomputed by ``_init_weights`` too.
    """

    label = "transformers' _init_weights"

    def __init__(self, shadow: nn.Module) -> None:
        self.fns = hf.init_weights_fns(shadow)
        self.by_fqn: dict[str, nn.Module] = dict(shadow.named_modules())

    def target(self, module: nn.Module, fqn: str) -> nn.Module:
        return self.by_fqn[fqn]

    def apply(self, module: nn.Module, fqn: str) -> None:
        self.fns[fqn](module)
        while fqn:
            fqn = fqn.rpartition(".")[0]
            self.fns[fqn](self.by_fqn[fqn])

    def missing(self, model: nn.Module) -> list[str]:
        return []


def init_contract(spec: ModelSpec | None, model: nn.Module) -> str:
    """Which init a model gets: ``init_fn`` (the user's, when named), ``transformers`` (a
    ``PreTrainedModel``) or ``reset_parameters`` (any other model)."""
    if spec is not None and spec.init_fn:
        return "init_fn"
    return "transformers" if hf.is_pretrained(model) else "reset_parameters"


def module_init_for(spec: ModelSpec | None, model: nn.Module) -> ModuleInit:
    """The :class:`ModuleInit` of ``spec``'s model (``model``: that model, on meta or not).

    Call it before sharding: a transformers model's shadow is a fresh meta build of ``spec``
    (or, without a spec, a meta copy of an unsharded ``model``).
    """
    contract = init_contract(spec, model)
    if contract == "init_fn":
        assert spec is not None and spec.init_fn  # init_contract checked both
        return UserInit(spec.init_fn)
    if contract == "transformers":
        return TransformersInit(build_on_meta(spec) if spec is not None else _meta_copy(model))
    return RESET_PARAMETERS


def _meta_copy(model: nn.Module) -> nn.Module:
    """A copy of an unsharded ``model`` whose every tensor is on meta (no storage copied)."""
    memo: dict[int, Any] = {}
    for _, t in _named_state(model):
        meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
        memo[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
    shadow: nn.Module = copy.deepcopy(model, memo)
    return shadow


class UninitializedError(InitError):
    """An init left tensors of one or more modules uninitialized.

    ``untouched``: ``(module FQN, class name, tensor names)`` per module, so that one error can
    name every module of a model (:func:`deterministic_init_`).
    """

    def __init__(self, label: str, untouched: Sequence[tuple[str, str, str]]) -> None:
        self.label = label
        self.untouched = list(untouched)
        fix = ("make it initialize every tensor the module owns (parameters and buffers, "
               "non-persistent ones included)")
        if len(self.untouched) == 1:
            ((fqn, cls, names),) = self.untouched
            text = f"{label} of {fqn} ({cls}) leaves {names} uninitialized; {fix}"
        else:
            modules = [f"{fqn} ({cls}: {names})" for fqn, cls, names in self.untouched]
            text = (f"{label} leaves tensors of {len(modules)} modules uninitialized: "
                    f"{_listing(modules)}; {fix}")
        super().__init__(text)


def full_module_state(module: nn.Module, fqn: str, seed: int,
                      init: ModuleInit = RESET_PARAMETERS) -> dict[str, torch.Tensor]:
    """The module's own state *in full*, on CPU, as ``init`` makes it (its reset_parameters).

    The module's own tensors (those of ``init.target``: the module itself, or its place in a
    transformers shadow) are swapped for full-size CPU scratch tensors (filled with NaN so that
    anything the init leaves untouched is caught), the init runs on the CPU generator seeded
    from ``(seed, fqn)``, and the originals are put back. The module's real tensors (meta, a
    device tensor or a DTensor shard) are never touched here.
    """
    if not _own_state(module):
        return {}
    target = init.target(module, fqn)
    own = _own_state(target)
    saved_params, saved_buffers = dict(target._parameters), dict(target._buffers)
    scratch: dict[str, torch.Tensor] = {}
    for kind, name, t in own:
        s = torch.full(_global_shape(t), float("nan"), dtype=t.dtype) if t.is_floating_point() \
            else torch.zeros(_global_shape(t), dtype=t.dtype)
        scratch[name] = s
        if kind == "param":
            target._parameters[name] = nn.Parameter(s, requires_grad=False)
        else:
            target._buffers[name] = s
    try:
        # fork_rng(devices=[]) restores the CPU generator afterwards and leaves CUDA alone.
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.default_generator.manual_seed(module_seed(seed, fqn))
            init.apply(target, fqn)
        # The scratch tensors are ours once the originals are back: no copy (peak memory).
        out = {name: scratch[name] for _, name, _ in own}
    finally:
        target._parameters.clear()
        target._parameters.update(saved_params)
        target._buffers.clear()
        target._buffers.update(saved_buffers)
    # A sum is NaN when any element is: no temporary the size of the tensor (peak memory).
    untouched = [n for n, t in out.items() if t.is_floating_point() and bool(t.sum().isnan())]
    if untouched:
        raise UninitializedError(
            init.label, [(fqn or "(root)", type(module).__name__, ", ".join(untouched))]
        )
    return out


def owners(model: nn.Module) -> dict[int, str]:
    """id(tensor) -> FQN of the module that initializes it: the first that holds it.

    A tied weight is initialized once, by its first holder in registration order, whatever
    order the modules are materialized in (FSDP1's breadth-first walk, or ours).
    """
    owner: dict[int, str] = {}
    for mfqn, module in model.named_modules(remove_duplicate=False):
        for _, _, t in _own_state(module):
            owner.setdefault(id(t), mfqn)
    return owner


def check_initializable(model: nn.Module, init: ModuleInit | None = None) -> None:
    """Raise one :class:`InitError` naming every module that owns state the init cannot make.

    ``init`` None: the model's own contract (a ``PreTrainedModel``'s ``_init_weights`` needs
    nothing more; any other model needs ``reset_parameters()`` on every module owning state).
    """
    if init is None:
        if hf.is_pretrained(model):
            return
        init = RESET_PARAMETERS
    missing = init.missing(model)
    if missing:
        raise InitError(
            f"{len(missing)} module(s) own parameters or buffers but have no reset_parameters(): "
            f"{', '.join(missing[:6])}; meta init cannot recreate their values: {WAYS_OUT}"
        )


def deterministic_init_(model: nn.Module, seed: int, init: ModuleInit | None = None) -> nn.Module:
    """Initialize a materialized model (plain, or FSDP2-sharded after ``to_empty``) in place.

    For a DTensor parameter the full tensor is generated and only the local chunk is kept
    (``distribute_tensor(..., src_data_rank=None)``: no communication), so every rank holds its
    slice of the same full tensor. ``init``: how modules get their values (None: the model's
    own contract, :func:`module_init_for`; pass it for a sharded transformers model). Every
    module an init leaves uninitialized is named in one :class:`UninitializedError`.
    """
    init = init if init is not None else module_init_for(None, model)
    check_initializable(model, init)
    dtensor = _compat.dtensor_cls()
    owner = owners(model)
    untouched: list[tuple[str, str, str]] = []
    for fqn, module in model.named_modules():
        try:
            _init_module_(module, fqn, seed, owner, dtensor, init)
        except UninitializedError as exc:
            untouched += exc.untouched
    if untouched:
        raise UninitializedError(init.label, untouched)
    return model


def _init_module_(
    module: nn.Module, fqn: str, seed: int, owner: Mapping[int, str], dtensor: type,
    init: ModuleInit = RESET_PARAMETERS,
) -> None:
    """One module's own state; its full values die on return (one module's worth at a time)."""
    full = full_module_state(module, fqn, seed, init)
    with torch.no_grad():
        for _, name, t in _own_state(module):
            if owner.get(id(t)) != fqn:
                continue  # a tied tensor, initialized by its first holder
            if isinstance(t, dtensor):
                _copy_to_dtensor(t, full.pop(name))
            else:
                t.copy_(full.pop(name).to(t.device))


def _copy_to_dtensor(t: Any, full: torch.Tensor) -> None:
    """Copy this rank's slice of ``full`` into the DTensor ``t``'s local shard.

    ``Shard(d)`` is DTensor's documented ``torch.chunk`` layout, taken as a view (no copy of
    the full tensor); any other layout goes through ``distribute_tensor(...,
    src_data_rank=None)``, which slices locally without communication.
    """
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    local_tensor = t.to_local()
    piece = full
    sliced = True  # False: a layout this function leaves to DTensor
    for mesh_dim, placement in enumerate(t.placements):
        if isinstance(placement, Replicate):
            continue
        if type(placement) is not Shard:  # e.g. _StridedShard: let DTensor slice it
            sliced = False
            break
        chunks = torch.chunk(piece, t.device_mesh.size(mesh_dim), dim=placement.dim)
        coordinate = t.device_mesh.get_local_rank(mesh_dim)
        piece = chunks[coordinate] if coordinate < len(chunks) else piece.narrow(
            placement.dim, 0, 0)
    if not sliced or piece.shape != local_tensor.shape:
        piece = distribute_tensor(
            full.to(t.device), t.device_mesh, t.placements, src_data_rank=None
        ).to_local()
    local_tensor.copy_(piece)


def reference_model(spec: ModelSpec, seed: int, device: str | torch.device = "cpu") -> nn.Module:
    """The single-process reference: the same meta build, ``to_empty``, the same init."""
    model = build_on_meta(spec)
    init = module_init_for(spec, model)
    to_empty_keeping_ties(model, device)
    return deterministic_init_(model, seed, init)


def to_empty_keeping_ties(model: nn.Module, device: str | torch.device) -> nn.Module:
    """``model.to_empty(device=...)``, with tied tensors still one tensor afterwards.

    ``to_empty`` allocates per module, so a weight two modules share (GPT-2's ``lm_head`` and
    ``wte``) comes out as two tensors: a reference that untied would be initialized twice and
    train two copies, unlike the sharded model (FSDP1's param_init_fn re-binds ties, FSDP2
    keeps one parameter). Every later holder is re-bound to its first holder's new tensor.
    """
    holders: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for kind, name, t in _own_state(module):
            holders.setdefault(id(t), []).append((module, kind, name))
    model.to_empty(device=device)
    for places in holders.values():
        if len(places) < 2:
            continue
        first, kind, name = places[0]
        store: dict[str, Any] = first._parameters if kind == "param" else first._buffers
        real = store[name]
        for module, kind, name in places[1:]:
            store = module._parameters if kind == "param" else module._buffers
            store[name] = real
    return model


def state_digest(state: Mapping[str, torch.Tensor]) -> str:
    """One SHA-256 over every tensor's name, shape, dtype and bytes (bitwise identity)."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
        h.update(tensor_bytes(t))
    return h.hexdigest()


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a contiguous CPU tensor, without numpy (torch does not require it)."""
    if not t.numel():
        return b""
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def reference_digest(spec: ModelSpec, seed: int) -> str:
    """The digest every sharded init of ``spec`` with ``seed`` must reproduce."""
    return state_digest(canonical_state(reference_model(spec, seed)))


def canonical_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer once, under its first name (as FSDP reports them)."""
    state: dict[str, torch.Tensor] = dict(model.named_parameters())
    state.update(dict(model.named_buffers()))
    return state


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter (tied ones under each name) and buffer, non-persistent included."""
    state: dict[str, torch.Tensor] = {
        n: p for n, p in model.named_parameters(remove_duplicate=False)
    }
    state.update({n: b for n, b in model.named_buffers(remove_duplicate=False)})
    return state


class DeterministicParamInit:
    """FSDP1 ``param_init_fn``: ``to_empty(recurse=False)``, then the module's own state.

    FSDP1 calls it once per not-yet-wrapped module of each unit, breadth-first from the unit's
    root (docs/init.md, "Facts about meta-device init"). The module's own tensors are
    materialized on ``device`` and filled with their full values from
    :func:`full_module_state`; FSDP1 shards them afterwards. A tied
    tensor materialized earlier (in another module) is re-bound rather than re-allocated, so
    the tie survives ``to_empty``. With ``broadcast_from`` set, each tensor is then broadcast
    from that rank: the explicit equivalent of ``sync_module_states=True``, which works on CPU.
    """

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        seed: int,
        *,
        broadcast_from: int | None = None,
        init: ModuleInit | None = None,
    ) -> None:
        self.init = init if init is not None else module_init_for(None, model)
        check_initializable(model, self.init)
        self.device = device
        self.seed = seed
        self.broadcast_from = broadcast_from
        self.names = {id(m): fqn for fqn, m in model.named_modules()}
        self.owner = owners(model)
        # id(meta tensor) -> the real tensor made for it. Weak: a strong reference would keep
        # every unit's unsharded tensors alive after FSDP1 shards them (the whole model!).
        self.materialized: dict[int, weakref.ref[torch.Tensor]] = {}
        self.calls: list[str] = []

    def __call__(self, module: nn.Module) -> None:
        fqn = self.names[id(module)]
        self.calls.append(fqn)
        before = {name: t for _, name, t in _own_state(module)}
        module.to_empty(device=self.device, recurse=False)
        full = full_module_state(module, fqn, self.seed, self.init)
        with torch.no_grad():
            for kind, name, t in _own_state(module):
                old = before[name]
                if id(old) in self.materialized:  # a tie: keep the one real tensor
                    real = self.materialized[id(old)]()
                    if real is None:
                        raise InitError(
                            f"{fqn}.{name} is tied to a tensor of another FSDP unit, which FSDP1 "
                            "has already flattened and sharded; keep tied modules in one unit "
                            "(recommended_policy does)"
                        )
                    if kind == "param":
                        module._parameters[name] = real  # type: ignore[assignment]
                    else:
                        module._buffers[name] = real
                    t = real
                else:
                    self.materialized[id(old)] = weakref.ref(t)
                # Only the owner writes, whichever holder FSDP1 reaches first: its walk is
                # breadth-first, so GPT-2's lm_head comes before transformer.wte, the owner.
                if self.owner.get(id(old)) != fqn:
                    continue
                t.copy_(full[name].to(t.device))
                if self.broadcast_from is not None:
                    import torch.distributed as dist

                    dist.broadcast(t.data, src=self.broadcast_from)


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
# Phase 2: shard a meta model and materialize it, by method
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
    eager: bool = False,
    **fsdp_kwargs: Any,
) -> nn.Module:
    """Build on meta, shard with ``version``, materialize with ``method``; the sharded model.

    ``seed`` is this rank's seed (ranks may be given different ones on purpose). ``eager``
    builds the model with real storage on the compute device instead of meta (a negative
    control for the memory check).
    """
    check_fsdp_version(version)
    check_method(method)
    model = spec.build(ctx.device) if eager else build_on_meta(spec)
    wrap_policy = BuiltModel(spec, model).policy(policy)
    # Before sharding: a transformers model's init reads an unsharded shadow of it.
    init = module_init_for(spec, model) if method == "deterministic" else RESET_PARAMETERS
    if eager:
        deterministic_init_(model, seed, init)
    torch.manual_seed(seed)  # the RNG the reset_parameters / seeds methods draw from
    if version == "fsdp1":
        if not eager:
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
    if eager:
        return model
    return _materialize_fsdp2(model, ctx.device, method, seed, init)


def _materialize_fsdp2(model: nn.Module, device: torch.device, method: str,
                       seed: int, init: ModuleInit = RESET_PARAMETERS) -> nn.Module:
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
                if not _own_state(module):
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
    spec: ModelSpec, method: str, seed: int, device: torch.device,
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
    model = build_on_meta(spec)
    wrap_policy = BuiltModel(spec, model).policy(policy)
    units = planned_unit_modules(model, wrap_policy) + [model]

    def poison_and(init: Callable[[nn.Module], None]) -> Callable[[nn.Module], None]:
        def run(module: nn.Module) -> None:
            if not _own_state(module):
                return
            module.to_empty(device=device, recurse=False)
            with torch.no_grad():
                for _, _, t in _own_state(module):
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
# Inspecting a sharded model against the reference
# --------------------------------------------------------------------------------------------


def _equal(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    a, e = actual.detach().cpu(), expected.detach().cpu()
    return a.shape == e.shape and a.dtype == e.dtype and torch.equal(a, e)


def _uninitialized(expected: torch.Tensor) -> bool:
    return expected.is_floating_point() and bool(expected.isnan().any())


def inspect_sharded(
    model: nn.Module, reference: nn.Module, ctx: RankContext, version: str
) -> dict[str, Any]:
    """Where every tensor is, and whether this rank's shards and the gathered tensors match.

    Collective (gathers full parameters): every rank must call it.
    """
    ref = full_state(reference)
    wrong_device = [
        f"{clean_fqn(n)} on {t.device}"
        for n, t in _named_state(model)
        if not t.is_meta and t.device != ctx.device
    ]
    report: dict[str, Any] = {
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
        local_bad, checked = _fsdp2_local_mismatches(model, ref, ctx)
    gathered = gathered_state(model, version)
    for name, t in gathered.items():
        expected = ref.get(name)
        if expected is None:
            full_bad.append(f"{name} (not in the reference)")
        elif not _equal(t, expected):
            (uninit if _uninitialized(expected) else full_bad).append(name)
    report.update(
        local_mismatch=local_bad,
        local_checked=checked,
        full_mismatch=full_bad,
        uninitialized=uninit,
        missing=sorted(set(ref) - set(gathered) - _aliases(reference)),
        digest=state_digest(gathered),
        reference_digest=state_digest({n: ref[n] for n in gathered if n in ref}),
    )
    return report


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
        fqns = [f"{prefix}.{clean_fqn(f)}" if prefix else clean_fqn(f)
                for f in _compat.fsdp1_param_fqns(flat)]
        reference_flat = torch.cat([ref[f].detach().cpu().reshape(-1) for f in fqns])
        local = flat.detach().cpu().reshape(-1)
        start = ctx.rank * local.numel() if local.numel() < reference_flat.numel() else 0
        expected = reference_flat[start : start + local.numel()]
        checked += 1
        if not torch.equal(local[: expected.numel()], expected):
            bad.append(f"{prefix or '(root)'} [flat shard {start}:{start + expected.numel()}]")
    return bad, checked


def _fsdp2_local_mismatches(
    model: nn.Module, ref: Mapping[str, torch.Tensor], ctx: RankContext
) -> tuple[list[str], int]:
    """Each DTensor's local shard against ``torch.chunk(reference, world_size)[rank]``."""
    dtensor = _compat.dtensor_cls()
    bad, checked = [], 0
    for name, p in model.named_parameters():
        if not isinstance(p, dtensor):
            continue
        chunks = torch.chunk(ref[name].detach().cpu(), ctx.world_size, dim=0)
        expected = chunks[ctx.rank] if ctx.rank < len(chunks) else ref[name][:0].cpu()
        checked += 1
        if not _equal(p.to_local(), expected):
            bad.append(name)
    return bad, checked


# --------------------------------------------------------------------------------------------
# Findings: what torch raised, in one line
# --------------------------------------------------------------------------------------------


_FINDINGS = (
    (
        ("Inconsistent compute device", "meta"),
        "the param_init_fn left the module's parameters on meta, so FSDP1 refused it ({msg}); "
        "the param_init_fn must call module.to_empty(device=..., recurse=False) before "
        "initializing (the seeds' materialization_fn never does)",
    ),
    (
        ("should be materialized from meta device",),
        "the sharded parameters were still on meta at the first forward ({msg}); call "
        "model.to_empty(device=...) after fully_shard, then initialize",
    ),
    (
        ("Cannot copy out of meta tensor",),
        "a tensor (often a buffer) was left on meta and failed at forward ({msg}); materialize "
        "buffers too (to_empty covers them)",
    ),
    (
        (SYNC_REFUSAL_SNIPPET,),
        "torch refuses sync_module_states=True with CPU tensors ({msg}); on CPU broadcast from "
        "rank 0 explicitly instead",
    ),
)


def describe_init_error(exc: BaseException) -> str:
    """One line a person can act on, instead of a traceback from inside torch."""
    if isinstance(exc, InitError):
        return str(exc)  # ours: already names the module and the fix
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    msg = f"{type(exc).__name__}: {first}"
    for needles, text in _FINDINGS:
        if all(n in str(exc) for n in needles):
            return text.format(msg=msg)
    return msg


def _preflight(ctx: RankContext, spec: ModelSpec) -> dict[str, Any] | None:
    """A model that cannot be meta-initialized at all: one finding instead of a traceback.

    The reset_parameters() contract is checked by looking at the modules; an init function or
    transformers' ``_init_weights`` only by running it, on the reference, so that the finding
    names every module it leaves uninitialized (FSDP1's param_init_fn stops at the first).
    """
    try:
        model = build_on_meta(spec)
        init = module_init_for(spec, model)
        check_initializable(model, init)
        if init is not RESET_PARAMETERS:
            reference_model(spec, 0)
    except ValueError as exc:  # InitError, ModelSpecError, PolicyError: messages say the fix
        return {"rank": ctx.rank, "error": str(exc), "errors": [str(exc)] * ctx.world_size,
                "device_type": ctx.device_type}
    return None


def _agree_on_failure(ctx: RankContext, error: str | None) -> list[str | None]:
    """Every rank's error (or None): all ranks decide together whether to go on."""
    if ctx.world_size == 1:
        return [error]
    return all_gather_objects(error, ctx.device_type)


# --------------------------------------------------------------------------------------------
# Rank functions (module level: pickled to the ranks) and verdicts
# --------------------------------------------------------------------------------------------


def rank_meta_build(ctx: RankContext, spec: ModelSpec, device: str = "meta") -> dict[str, Any]:
    """Build ``spec`` on ``device`` and measure how much the process's peak memory grew."""
    spec.build("meta")  # warm-up: imports and first-call caches are not the model's cost
    rss_before = reset_peak_rss()
    model = spec.build(device)
    peak = status_bytes("VmHWM")
    numel = sum(p.numel() for p in model.parameters())
    report = {
        "rank": ctx.rank,
        "device": device,
        "numel": numel,
        "model_bytes": sum(
            t.numel() * t.element_size() for _, t in _named_state(model)
        ),
        "growth_bytes": peak - rss_before,
        "not_on_meta": [n for n, t in _named_state(model) if not t.is_meta][:10],
    }
    del model
    return report


def verdict_meta_build(values: Sequence[Mapping[str, Any]], params: Mapping[str, Any]) -> Verdict:
    worst = max(values, key=lambda v: v["growth_bytes"])
    model_mib = worst["model_bytes"] / MiB
    allowed = META_GROWTH_FRACTION * worst["model_bytes"] + META_GROWTH_FIXED_MIB * MiB
    figures = {
        "params": worst["numel"],
        "model_MiB": round(model_mib, 1),
        "growth_MiB": round(worst["growth_bytes"] / MiB, 2),
        "allowed_MiB": round(allowed / MiB, 1),
    }
    real = [v for v in values if v["not_on_meta"]]
    if real:
        return Verdict(False, f"rank {real[0]['rank']}: built with storage (not on meta): "
                       f"{', '.join(real[0]['not_on_meta'])}", figures)
    if worst["growth_bytes"] > allowed:
        return Verdict(
            False,
            f"building {worst['numel']:,} parameters ({model_mib:,.0f} MiB) grew rank "
            f"{worst['rank']}'s peak memory by {worst['growth_bytes'] / MiB:,.1f} MiB, over the "
            f"{allowed / MiB:,.1f} MiB allowed for a meta build: the model allocated storage",
            figures,
        )
    return Verdict(
        True,
        f"{worst['numel']:,} parameters ({model_mib:,.0f} MiB) on meta; peak memory grew by "
        f"{worst['growth_bytes'] / MiB:,.2f} MiB at most (allowed {allowed / MiB:,.1f} MiB)",
        figures,
    )


def rank_materialize(
    ctx: RankContext,
    spec: ModelSpec = DEFAULT_SPEC,
    version: str = "fsdp2",
    method: str = "deterministic",
    seed: int = 0,
    rank_seed_offset: int = 0,
    policy: PolicyName = "recommended",
    forward: bool = True,
) -> dict[str, Any]:
    """Meta build, shard, materialize with ``method``; report against the reference.

    ``rank_seed_offset`` gives rank r the seed ``seed + r * offset`` (a negative control: ranks
    that initialized differently). The reference always uses ``seed``. A failure inside torch
    is caught on every rank and returned as a one-line finding, never a traceback.
    """
    my_seed = seed + ctx.rank * rank_seed_offset
    if method == "reset_parameters":
        reason = default_path_inapplicable(spec)
        if reason:
            skip_rank(reason)
    error, report = None, {}
    try:
        # The reference first: an init that leaves modules uninitialized is named for all
        # of them at once (the sharded path stops at the first).
        reference = reference_for(spec, method, seed, ctx.device, policy)
        model = materialize(ctx, spec, version, method, my_seed, policy=policy)
        if forward:  # FSDP2 and a buffer left on meta only fail here
            with torch.no_grad():
                call_model(model, spec.batch(unwrapped(model), batch_size=1,
                                             device=ctx.device))
    except CheckSkipped:
        raise  # a capability this torch lacks (every rank alike): a skip, not the finding
    except Exception as exc:  # noqa: BLE001 - torch's refusal (or InitError) is the finding
        error = describe_init_error(exc)
    errors = _agree_on_failure(ctx, error)
    if any(errors):
        return {"rank": ctx.rank, "error": error, "errors": errors}
    report = inspect_sharded(model, reference, ctx, version)
    report.update(error=None, method=method, version=version)
    return report


def default_path_inapplicable(spec: ModelSpec) -> str | None:
    """Why FSDP1's default meta path does not apply to ``spec``'s model (None: it does).

    The default path calls ``reset_parameters()`` on every module that owns state. A model
    initialized another way (transformers' ``_init_weights``, ``--init-fn``) whose modules
    lack it is outside that path: FSDP1 would raise on the first such module. A model with no
    contract at all is not skipped: its finding (no way to initialize it) is the check's.
    """
    model = build_on_meta(spec)
    contract = init_contract(spec, model)
    missing = _without_reset_parameters(model)
    if contract == "reset_parameters" or not missing:
        return None
    how = ("transformers' _init_weights" if contract == "transformers"
           else f"the init function {spec.init_fn!r}")
    return (
        f"FSDP1's default meta path (no param_init_fn) calls reset_parameters() on every module "
        f"that owns state, and {len(missing)} module(s) of {spec.name} have none "
        f"({_listing(missing, 3)}): FSDP1 would raise on them. This model is initialized by "
        f"{how} through a param_init_fn, which init.no_meta and init.weights check; to use the "
        "default path instead, define reset_parameters() on those classes"
    )


def unwrapped(model: nn.Module) -> nn.Module:
    """The user's module inside an FSDP1 root wrapper (FSDP2 keeps the module itself)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return model.module if isinstance(model, FSDP) else model


def _rank_errors(values: Sequence[Mapping[str, Any]]) -> str | None:
    """One line per distinct failure, with the ranks it happened on (None: no failure)."""
    errors = next((v["errors"] for v in values if v.get("errors")), None)
    if not errors or not any(errors):
        return None
    by_message: dict[str, list[int]] = {}
    for rank, error in enumerate(errors):
        if error:
            # "on rank 1" inside torch's message would split one finding into N.
            by_message.setdefault(re.sub(r"rank \d+", "rank N", error), []).append(rank)
    return "; ".join(
        f"{'all ranks' if len(r) == len(errors) else 'ranks ' + str(r)}: {m}"
        for m, r in by_message.items()
    )


def _listing(items: Sequence[str], limit: int = 6) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" (+{len(items) - limit} more)" if len(items) > limit else "")


def _error_verdict(values: Sequence[Mapping[str, Any]]) -> Verdict | None:
    """The failed verdict when a rank reported errors instead of values (None when none did)."""
    error = _rank_errors(values)
    return Verdict(False, error, {"error": error}) if error else None


def _no_meta_problems(v: Mapping[str, Any]) -> list[str]:
    """One rank's tensors left on meta, on another device, uninitialized or wrong."""
    r = v["rank"]
    problems = []
    if v["on_meta"]:
        problems.append(f"rank {r}: still on meta: {_listing(v['on_meta'])}")
    if v["wrong_device"]:
        problems.append(f"rank {r}: not on {v['device']}: {_listing(v['wrong_device'])}")
    if v.get("uninitialized"):
        problems.append(
            f"rank {r}: never initialized by the init (to_empty memory): "
            f"{_listing(v['uninitialized'])}"
        )
    if v.get("full_mismatch"):
        problems.append(
            f"rank {r}: values differ from the reference: {_listing(v['full_mismatch'])}"
        )
    if v.get("missing"):
        problems.append(f"rank {r}: missing from the model: {_listing(v['missing'])}")
    return problems


def _weights_problems(v: Mapping[str, Any]) -> list[str]:
    """One rank's shards or gathered weights that differ from the reference."""
    r = v["rank"]
    if v["on_meta"]:
        # Nothing to compare on meta: the values below would only repeat the finding.
        return [f"rank {r}: still on meta: {_listing(v['on_meta'])}"]
    problems = []
    if v["local_mismatch"]:
        problems.append(
            f"rank {r}: local shards differ from the reference's slices: "
            f"{_listing(v['local_mismatch'])}"
        )
    bad = v["full_mismatch"] + v["uninitialized"]
    if bad:
        problems.append(f"rank {r}: gathered weights differ from the reference: "
                        f"{_listing(bad)}")
    return problems


def verdict_no_meta(values: Sequence[Mapping[str, Any]], params: Mapping[str, Any]) -> Verdict:
    """Every tensor on the compute device, with values (= the reference's), on every rank."""
    failed = _error_verdict(values)
    if failed:
        return failed
    problems = [p for v in values for p in _no_meta_problems(v)]
    figures = {"ranks": len(values)}
    if problems:
        return Verdict(False, "not every tensor is materialized and initialized:\n  "
                       + "\n  ".join(problems), figures, {"ranks": list(values)})
    return Verdict(
        True,
        f"every parameter and buffer on {values[0]['device'].split(':')[0]} and equal to the "
        f"reference on all {len(values)} ranks",
        figures,
    )


def verdict_weights(values: Sequence[Mapping[str, Any]], params: Mapping[str, Any]) -> Verdict:
    """Local shards = slices of the reference; gathered = the reference; on every rank."""
    failed = _error_verdict(values)
    if failed:
        return failed
    problems = [p for v in values for p in _weights_problems(v)]
    digests: list[str] = sorted({v["digest"] for v in values if v.get("digest")})
    figures = {
        "digest": digests[0][:16] if len(digests) == 1 else "differs",
        "reference_digest": (values[0].get("reference_digest") or "")[:16],
        "ranks": len(values),
    }
    if problems:
        return Verdict(
            False,
            "weights do not match the single-process reference built from the same seed:\n  "
            + "\n  ".join(problems),
            figures,
            {"ranks": list(values)},
        )
    return Verdict(
        True,
        f"every rank's shards and the gathered weights equal the reference "
        f"(digest {figures['digest']}) on {len(values)} ranks",
        figures,
        {"digest": digests[0]},
    )


def require_a_receiver(ctx: RankContext, what: str) -> None:
    """Skip (on every rank alike) where rank 0 has no one to send its weights to.

    At world size 1 rank 0's weights are every rank's weights with or without ``what``: the
    check would pass without proving anything (a one-GPU machine runs the GPU lane at world
    size 1). On CPU FSDP1's refusal of ``sync_module_states`` is still a fact at any size.
    """
    if ctx.world_size == 1:
        skip_rank(f"at world size 1 there is no other rank to receive rank 0's weights: "
                  f"{what} cannot be told from its absence; run at world size >= 2 (two "
                  "devices on the GPU lane)")


def rank_sync_module_states(
    ctx: RankContext,
    spec: ModelSpec = DEFAULT_SPEC,
    seed: int = 0,
    rank_seed_offset: int = 1000,
    sync: bool = True,
) -> dict[str, Any]:
    """FSDP1 ``sync_module_states``: ranks initialize differently; rank 0 should win.

    On CPU torch refuses the option; the refusal is returned as data.
    """
    if ctx.device_type != "cpu":
        require_a_receiver(ctx, "sync_module_states")
    failed = _preflight(ctx, spec)
    if failed:
        return failed
    my_seed = seed + ctx.rank * rank_seed_offset
    model = build_on_meta(spec)
    init = DeterministicParamInit(model, ctx.device, my_seed, init=module_init_for(spec, model))
    error, refusal = None, None
    try:
        policy = BuiltModel(spec, model).policy("recommended")
        model = shard_fsdp1(model, ctx, policy, param_init_fn=init,
                            sync_module_states=sync)
    except ValueError as exc:
        if SYNC_REFUSAL_SNIPPET in str(exc):
            refusal = str(exc)
        else:
            error = describe_init_error(exc)
    errors = _agree_on_failure(ctx, error or refusal)
    if any(errors):
        return {"rank": ctx.rank, "device_type": ctx.device_type, "refusal": refusal,
                "error": error, "errors": errors if error else None}
    report = inspect_sharded(model, reference_model(spec, seed), ctx, "fsdp1")
    report.update(device_type=ctx.device_type, refusal=None, error=None, sync=sync)
    return report


def verdict_sync_module_states(
    values: Sequence[Mapping[str, Any]], params: Mapping[str, Any]
) -> Verdict:
    """CPU: torch's refusal, on every rank, is the expected fact. GPU: rank 0's weights win."""
    if any(v.get("error") for v in values):
        error = _rank_errors(values) or "a rank failed"
        return Verdict(False, error, {"error": error})
    if values[0]["device_type"] == "cpu":
        refused = [v for v in values if v.get("refusal")]
        if len(refused) == len(values):
            message = refused[0]["refusal"].splitlines()[0]
            return Verdict(
                True,
                f"conformance fact: torch refuses sync_module_states=True on CPU on all "
                f"{len(values)} ranks: {message!r}",
                {"refused": True},
                {"refusal": message},
            )
        weights = verdict_weights(values, params)
        if not params.get("sync", True):
            return Verdict(False, "sync_module_states was off: nothing refused and nothing "
                           f"synchronized; the weights: {weights.message}", {"refused": False})
        return Verdict(
            False,
            "torch no longer refuses sync_module_states=True on CPU (a change since 2.13: "
            f"update the conformance fact); the weights then: {weights.message}",
            {"refused": False},
        )
    verdict = verdict_weights(values, params)
    if not verdict.passed:
        return Verdict(False, "rank 0's weights did not reach every rank: " + verdict.message,
                       verdict.figures, verdict.data)
    return Verdict(True, "sync_module_states=True: rank 0's weights reached every rank; "
                   + verdict.message, verdict.figures, verdict.data)


def rank_broadcast_rank0(ctx: RankContext, spec: ModelSpec = DEFAULT_SPEC, version: str = "fsdp2",
                         seed: int = 0, rank_seed_offset: int = 1000,
                         broadcast: bool = True) -> dict[str, Any]:
    """The CPU-capable equivalents of ``sync_module_states``: rank 0's weights to every rank.

    FSDP2: ``set_model_state_dict(..., StateDictOptions(full_state_dict=True,
    broadcast_from_rank0=True))`` with rank 0's full state dict (the others pass ``{}``).
    FSDP1: a ``param_init_fn`` that broadcasts each module's state from rank 0 before FSDP1
    shards it. Ranks first initialize with different seeds, so only a working broadcast gives
    every rank the reference (built from ``seed``, rank 0's).
    """
    require_a_receiver(ctx, "the broadcast from rank 0")
    failed = _preflight(ctx, spec)
    if failed:
        return failed
    my_seed = seed + ctx.rank * rank_seed_offset
    mutated = None
    if version == "fsdp1":
        model = build_on_meta(spec)
        init = DeterministicParamInit(
            model, ctx.device, my_seed, broadcast_from=0 if broadcast else None,
            init=module_init_for(spec, model),
        )
        policy = BuiltModel(spec, model).policy("recommended")
        model = shard_fsdp1(model, ctx, policy, param_init_fn=init)
    else:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        model = materialize(ctx, spec, "fsdp2", "deterministic", my_seed)
        if broadcast:
            full: dict[str, torch.Tensor] = {}
            if ctx.rank == 0:
                full = {k: v.to(ctx.device) for k, v in reference_model(spec, seed)
                        .state_dict().items()}
            before = {k: (id(v), v.data_ptr()) for k, v in full.items()}
            set_model_state_dict(
                model, cast("dict[str, ValueType]", full),  # dict is invariant in its values
                options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
            )
            # Rank 0's dict is mutated in place (its values replaced by the model's own
            # tensors): a caller must not reuse it as "the checkpoint". Recorded per rank.
            mutated = set(before) != set(full) or any(
                (id(v), v.data_ptr()) != before[k] for k, v in full.items()
            )
    report = inspect_sharded(model, reference_model(spec, seed), ctx, version)
    report.update(error=None, version=version, broadcast=broadcast, dict_mutated=mutated)
    return report


def rank_train_step(ctx: RankContext, spec: ModelSpec = DEFAULT_SPEC, version: str = "fsdp2",
                    seed: int = 0, rank_seed_offset: int = 0, lr: float = 0.1) -> dict[str, Any]:
    """One SGD step after meta init, against the same step on the single-process reference.

    Every rank feeds the same batch, so the averaged gradient equals the reference's. Dropout
    is switched off on both sides (``step.disable_dropout``: p = 0, the models stay in training
    mode): the sharded step and the reference draw their masks at different points of the RNG
    stream, so with dropout they differ by the masks, not by the init (the report says so).
    """
    failed = _preflight(ctx, spec)
    if failed:
        return failed
    model = materialize(ctx, spec, version, "deterministic", seed + ctx.rank * rank_seed_offset)
    reference = reference_model(spec, seed, ctx.device)
    dropout = disable_dropout(reference, model)  # names from the unwrapped reference
    batch = spec.batch(reference, batch_size=2, device=ctx.device)
    losses = []
    for m in (model, reference):
        optimizer = torch.optim.SGD(m.parameters(), lr=lr)
        loss = default_loss(call_model(m, batch))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    after = gathered_state(model, version)
    expected = full_state(reference)
    worst_name, worst = "", 0.0
    bad = []
    for name, t in after.items():
        e = expected[name].detach().cpu()
        if not torch.allclose(t, e, rtol=STEP_RTOL, atol=STEP_ATOL):
            bad.append(name)
        diff = float((t - e).abs().max()) if t.numel() else 0.0
        if diff > worst:
            worst_name, worst = name, diff
    return {
        "rank": ctx.rank,
        "loss": losses[0],
        "reference_loss": losses[1],
        "mismatch": bad,
        "max_abs_diff": worst,
        "max_abs_diff_at": worst_name,
        "dropout_disabled": dropout,
    }


def verdict_train_step(values: Sequence[Mapping[str, Any]], params: Mapping[str, Any]) -> Verdict:
    failed = _error_verdict(values)
    if failed:
        return failed
    worst = max(values, key=lambda v: v["max_abs_diff"])
    figures = {
        "loss": values[0]["loss"],
        "reference_loss": values[0]["reference_loss"],
        "max_abs_diff": worst["max_abs_diff"],
    }
    problems = [
        f"rank {v['rank']}: loss {v['loss']:.6g} vs reference {v['reference_loss']:.6g}"
        for v in values
        if not math.isclose(v["loss"], v["reference_loss"], rel_tol=STEP_RTOL, abs_tol=STEP_ATOL)
    ]
    problems += [
        f"rank {v['rank']}: after the step, weights differ from the reference "
        f"(rtol {STEP_RTOL}, atol {STEP_ATOL}): {_listing(v['mismatch'])}"
        for v in values
        if v["mismatch"]
    ]
    dropout = values[0].get("dropout_disabled") or []
    note = (f"; dropout disabled for the comparison ({len(dropout)} dropout setting(s), e.g. "
            f"{dropout[0]}: p = 0 on both models)" if dropout else "")
    if problems:
        return Verdict(False, "the first training step after meta init does not match the "
                       "reference" + note + ":\n  " + "\n  ".join(problems), figures)
    return Verdict(True, f"step after meta init matches the reference on {len(values)} ranks "
                   f"(loss {values[0]['loss']:.6g}; largest weight difference "
                   f"{worst['max_abs_diff']:.2g} at {worst['max_abs_diff_at'] or '-'}){note}",
                   figures)


def rank_peak_memory(
    ctx: RankContext,
    spec: ModelSpec = MEMORY_SPEC,
    version: str = "fsdp2",
    seed: int = 0,
    eager: bool = False,
    policy: PolicyName = "recommended",
) -> dict[str, Any]:
    """Peak memory while building on meta, sharding and materializing, against the bound.

    CPU lane: the host's ``VmHWM``, meaningful in fresh rank processes started with
    ``MALLOC_MMAP_THRESHOLD_=65536`` (every large tensor its own mmap, so freed memory leaves
    RSS; docs/memory.md, "Facts about measuring memory on CPU"). GPU lane: the CUDA
    allocator's peak, where the parameters live.
    ``eager=True`` builds the model with storage first (the negative control).
    """
    failed = _preflight(ctx, spec)
    if failed:
        return failed
    meta = build_on_meta(spec)
    units = plan_units(meta, BuiltModel(spec, meta).policy(policy))
    element = next(meta.parameters()).element_size()
    total = sum(p.numel() for p in meta.parameters()) * element
    largest_unit = max(u.numel for u in units) * element
    largest_param = max(p.numel() for p in meta.parameters()) * element
    # Sharded model on this rank: each unit's flat/padded (FSDP1) or per-parameter (FSDP2)
    # shard, rounded up: what the rank keeps after materializing.
    if version == "fsdp1":
        sharded = sum(math.ceil(u.numel / ctx.world_size) for u in units) * element
    else:
        sharded = sum(
            math.ceil(p.shape[0] / ctx.world_size) * (p.numel() // max(p.shape[0], 1))
            if p.dim() else p.numel()
            for p in meta.parameters()
        ) * element
    del meta
    # Warm-up on a tiny model: imports, the device mesh, gloo's buffers, the CUDA context and
    # first-call caches are the process's fixed costs, not the model's.
    materialize(ctx, ModelSpec(reference="massive", config=ModelConfig(num_layers=1, dim=8)),
                version, "deterministic", seed)
    with host_or_cuda_peak(ctx) as reading:
        model = materialize(ctx, spec, version, "deterministic", seed, policy=policy,
                            eager=eager)
    del model
    return {
        "rank": ctx.rank,
        "version": version,
        "device_type": ctx.device_type,
        "meter": reading["meter"],
        "peak_bytes": reading["peak"],
        "kept_bytes": reading["kept"],
        "mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "model_bytes": total,
        "largest_unit_bytes": largest_unit,
        "largest_param_bytes": largest_param,
        "sharded_bytes": sharded,
    }


def peak_memory_bound(value: Mapping[str, Any]) -> tuple[float, str]:
    """The bound term by term (bytes, explanation).

    - the sharded model this rank keeps;
    - one unit's unsharded parameters: FSDP1 materializes a whole unit before sharding it;
      FSDP2 materializes only shards, and our init generates one full *parameter* at a time
      (at most one unit);
    - FSDP1 only: one more unit, the flat parameter FSDP1 concatenates the unit into while the
      materialized originals still exist (then it keeps only the shard);
    - a tolerance of PEAK_TOLERANCE_FRACTION of that plus PEAK_TOLERANCE_FIXED_MIB.
    """
    unit = value["largest_unit_bytes"]
    bound, flatten = init_peak_bound(value["sharded_bytes"], unit, value["version"],
                                     PEAK_TOLERANCE_FRACTION, PEAK_TOLERANCE_FIXED_MIB * MiB)
    terms = (f"sharded {value['sharded_bytes'] / MiB:.1f} + unit {unit / MiB:.1f}"
             + (f" + flat copy {flatten / MiB:.1f}" if flatten else "")
             + f" MiB, +{PEAK_TOLERANCE_FRACTION:.0%} +{PEAK_TOLERANCE_FIXED_MIB:.0f} MiB")
    return bound, terms


def verdict_peak_memory(values: Sequence[Mapping[str, Any]], params: Mapping[str, Any]) -> Verdict:
    failed = _error_verdict(values)
    if failed:
        return failed
    rows, over = [], []
    for v in values:
        bound, terms = peak_memory_bound(v)
        rows.append(
            f"rank {v['rank']}: peak {v['peak_bytes'] / MiB:.1f} MiB ({v['meter']}), "
            f"bound {bound / MiB:.1f} MiB ({terms}), full model {v['model_bytes'] / MiB:.1f} MiB"
        )
        if v["peak_bytes"] > bound:
            over.append(v["rank"])
    worst = max(values, key=lambda v: v["peak_bytes"])
    bound, _ = peak_memory_bound(worst)
    figures = {
        "peak_MiB": round(worst["peak_bytes"] / MiB, 1),
        "bound_MiB": round(bound / MiB, 1),
        "model_MiB": round(worst["model_bytes"] / MiB, 1),
    }
    note = ""
    if values[0]["device_type"] == "cpu" and not values[0]["mmap_threshold"]:
        note = ("\n  (MALLOC_MMAP_THRESHOLD_ was not set in the rank processes: freed heap is "
                "reused and the high-water mark is noise; run with the check's env)")
    if over:
        return Verdict(False, f"peak memory while materializing exceeds the bound on ranks "
                       f"{over}: a rank held more than its shards plus one unit\n  "
                       + "\n  ".join(rows) + note, figures, {"ranks": list(values)})
    return Verdict(True, "peak memory while materializing within the bound on every rank:\n  "
                   + "\n  ".join(rows) + note, figures, {"ranks": list(values)})


# --------------------------------------------------------------------------------------------
# The checks
# --------------------------------------------------------------------------------------------

CHECKS: tuple[Check, ...] = (
    variants(
        "init.meta_build",
        "building the model on meta allocates no storage (peak memory grows by almost nothing)",
        rank_meta_build, verdict_meta_build, versions=None, specs=(DEFAULT_SPEC,),
    )
    + variants(
        "init.no_meta",
        {"fsdp1": "FSDP1 + param_init_fn: every parameter and buffer on the compute device, "
                  "initialized",
         "fsdp2": "FSDP2 + to_empty + init: every parameter and buffer on the compute device, "
                  "initialized"},
        rank_materialize, verdict_no_meta, specs=(DEFAULT_SPEC,),
    )
    + variants(
        "init.weights",
        {v: f"{v.upper()}: each rank's shards and the gathered weights equal the single-process "
            "reference" for v in ("fsdp1", "fsdp2")},
        rank_materialize, verdict_weights, specs=(DEFAULT_SPEC,),
    )
    + variants(
        "init.weights.default_path",
        "FSDP1's default meta path (to_empty + reset_parameters per module, no param_init_fn) "
        "equals the same calls made single-process in FSDP1's order",
        rank_materialize, verdict_weights, versions=("fsdp1",), specs=(DEFAULT_SPEC,),
        method="reset_parameters",
    )
    + variants(
        "init.sync_module_states",
        "FSDP1 sync_module_states=True: refused on CPU (a fact); on GPU rank 0's weights win",
        rank_sync_module_states, verdict_sync_module_states, versions=None,
        specs=(DEFAULT_SPEC,),
    )
    + variants(
        "init.broadcast_rank0",
        {"fsdp1": "FSDP1: an explicit rank-0 broadcast in param_init_fn gives every rank rank "
                  "0's weights",
         "fsdp2": "FSDP2: set_model_state_dict(broadcast_from_rank0=True) gives every rank "
                  "rank 0's weights"},
        rank_broadcast_rank0, verdict_weights, specs=(DEFAULT_SPEC,),
    )
    + variants(
        "init.train_step",
        {v: f"{v.upper()}: the first training step after meta init matches the reference's"
         for v in ("fsdp1", "fsdp2")},
        rank_train_step, verdict_train_step, specs=(DEFAULT_SPEC,),
    )
    + variants(
        "init.peak_memory",
        {"fsdp1": "FSDP1: peak host memory while materializing stays within shards + one unit "
                  "(+ flat copy)",
         "fsdp2": "FSDP2: peak host memory while materializing stays within shards + one unit"},
        rank_peak_memory, verdict_peak_memory, specs=(MEMORY_SPEC,), env=MALLOC_ENV,
    )
)

#: The seeds' ``materialization_fn`` as written, through the same checks: expected to fail,
#: each with a one-line finding (docs/init.md). Not in CHECKS: they judge the seeds' code, not
#: the user's model.
SEEDS_CHECKS: tuple[Check, ...] = (
    variants(
        "init.seeds_fn",
        {"fsdp1": "the seeds' materialization_fn as FSDP1's param_init_fn (never calls "
                  "to_empty)",
         "fsdp2": "the seeds' materialization_fn after fully_shard, without to_empty"},
        rank_materialize, verdict_no_meta, specs=(DEFAULT_SPEC,), method="seeds",
    )
    + variants(
        "init.seeds_fn_to_empty",
        "the seeds' function with to_empty added: 1-D weights and buffers stay uninitialized",
        rank_materialize, verdict_no_meta, versions=("fsdp1",), specs=(DEFAULT_SPEC,),
        method="seeds_to_empty",
    )
)
