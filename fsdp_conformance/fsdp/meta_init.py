"""Meta-device init, phases 1 and 3: build on meta, then give every tensor its deterministic value.

The phases of a meta init (torchtitan's order); this module holds the first and the third, and
:mod:`fsdp_conformance.fsdp.meta_materialize` the second (and the inspection of the sharded result):

1. **Build on meta** (:func:`build_on_meta`): shapes only, no storage.
2. **Shard, then** ``to_empty``/**materialize** (:mod:`~fsdp_conformance.fsdp.meta_materialize`):
   FSDP1 wraps the meta model and materializes one unit at a time through a ``param_init_fn``
   (:class:`DeterministicParamInit` here); FSDP2 ``fully_shard``\\ s the meta model, then
   ``to_empty`` allocates only the local shards.
3. **Initialize deterministically** (:func:`deterministic_init_`, :class:`DeterministicParamInit`):
   each module's own state is generated *in full* on a CPU generator seeded from
   ``(seed, module FQN)`` by the module's own init contract (:class:`ModuleInit`:
   ``reset_parameters()``, the user's ``--init-fn`` or transformers' ``_init_weights``), and
   each rank keeps its slice. The values are therefore the same on 1, 2 or 4 ranks, FSDP1 or
   FSDP2, CPU or GPU, and equal to a single-process :func:`reference_model` built from the same
   seed.

A block: the init claim's checks use it, and so could any claim that needs a meta-initialized
model.
"""

from __future__ import annotations

import copy
import hashlib
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn as nn

from fsdp_conformance import _compat
from fsdp_conformance.fsdp.model_init import (
    MODEL_LEVEL,
    ModelInit,
    check_model_init_,
    nan_fill_,
    run_model_init_,
)
from fsdp_conformance.fsdp.model_init import (
    InitError as InitError,  # the init errors' one class, used here and by the claims
)
from fsdp_conformance.fsdp.tensors import listing, state_digest
from fsdp_conformance.models import hf
from fsdp_conformance.models.model_spec import (
    BuiltModel,
    ModelSpec,
    load_object,
    root_init_weights,
    without_reset_parameters,
)
from fsdp_conformance.models.units import clean_fqn

# --------------------------------------------------------------------------------------------
# Phase 1: build on meta
# --------------------------------------------------------------------------------------------


def tensors_on_meta(model: nn.Module) -> list[str]:
    """FQNs of every parameter and buffer (non-persistent included) still on meta."""
    names = [clean_fqn(n) for n, p in model.named_parameters() if p.is_meta]
    names += [clean_fqn(n) for n, b in model.named_buffers() if b.is_meta]
    return names


def build_on_meta(spec: ModelSpec) -> BuiltModel:
    """Build ``spec``'s model under ``torch.device("meta")``: shapes only, no storage; with its
    policies at hand (:class:`~fsdp_conformance.models.model_spec.BuiltModel`).

    A tensor the constructor makes real anyway (an explicit ``device=``, the legacy
    ``torch.Tensor(n)`` constructor, which ignores the device context: pytorch#126533) stays
    real, as it does for a user: ``to_empty`` reallocates it with the rest and the model's init
    must cover it, which the init checks judge. ``init.meta_build`` names such tensors and
    judges their size (:func:`real_under_meta`).
    """
    return spec.instantiate("meta")


#: A meta build may leave real only what is negligible beside one layer: at most this fraction
#: of one layer's share of the model's bytes (the model's bytes over its blocks). Above it a
#: real tensor is a table, an embedding or a layer's weights: what meta init exists to avoid.
REAL_UNDER_META_FRACTION = 0.01


class RealUnderMeta(NamedTuple):
    """The tensors a meta build left real: names, their bytes, and the bytes allowed."""

    names: list[str]
    bytes: int
    allowed: int

    @property
    def too_large(self) -> bool:
        return self.bytes > self.allowed


def real_under_meta(model: nn.Module, blocks: int) -> RealUnderMeta:
    """The tensors of a model built on meta that are real anyway (:func:`build_on_meta`), and
    whether they are more than negligible: over :data:`REAL_UNDER_META_FRACTION` of one
    layer's share of the model (``blocks``: how many blocks it has; at least 1)."""
    real = [(clean_fqn(n), t) for n, t in named_state(model) if not t.is_meta]
    size = sum(t.numel() * t.element_size() for _, t in real)
    per_layer = state_bytes(model) / max(blocks, 1)
    return RealUnderMeta([n for n, _ in real], size, int(REAL_UNDER_META_FRACTION * per_layer))


def named_state(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter, then every buffer (non-persistent included), by name."""
    yield from model.named_parameters()
    yield from model.named_buffers()


def state_bytes(model: nn.Module) -> int:
    """The bytes of every parameter and buffer (what a build with storage allocates)."""
    return sum(t.numel() * t.element_size() for _, t in named_state(model))


# --------------------------------------------------------------------------------------------
# Phase 3: the deterministic, world-size-invariant init (phase 2, sharding and materializing,
# is meta_materialize's)
# --------------------------------------------------------------------------------------------


def module_seed(seed: int, fqn: str) -> int:
    """A stable 63-bit seed for one module (Python's ``hash`` is salted per process)."""
    digest = hashlib.sha256(f"{seed}:{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def own_state(module: nn.Module) -> list[tuple[str, str, torch.Tensor]]:
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
                f"{', '.join(n for _, n, _ in own_state(module))} but has no "
                f"reset_parameters(); meta init cannot recreate its values: {WAYS_OUT}"
            )
        reset()

    def missing(self, model: nn.Module) -> list[str]:
        """Modules this init cannot initialize at all, as ``fqn (Class)``."""
        return without_reset_parameters(model)


#: The default contract of a plain ``nn.Module``.
RESET_PARAMETERS = ModuleInit()

#: The three ways out for a module the init cannot recreate (one text for every message).
WAYS_OUT = (
    "define reset_parameters() on those classes (initializing the module's own parameters "
    "and buffers), or name a per-module init with --init-fn pkg.module:fn (--fsdp-init-fn "
    "under pytest, init_fn in [tool.fsdp_conformance]), or use a transformers "
    "PreTrainedModel whose _init_weights covers them"
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
    """Which init a model gets, in this order: ``init_fn`` (the user's per-module init, when
    named), ``model_init`` (the user's model-level init, when named), ``transformers`` (a
    ``PreTrainedModel``), ``init_weights`` (the root's own model-level ``init_weights()``,
    torchtitan's contract) or ``reset_parameters`` (any other model)."""
    if spec is not None and spec.init_fn:
        return "init_fn"
    if spec is not None and spec.model_init:
        return "model_init"
    if hf.is_pretrained(model):
        return "transformers"
    return "init_weights" if root_init_weights(model) is not None else "reset_parameters"


def model_init_for(spec: ModelSpec | None, model: nn.Module) -> ModelInit | None:
    """The model-level init of ``spec``'s model, or None when its init is per module."""
    contract = init_contract(spec, model)
    if contract not in MODEL_LEVEL:
        return None
    return ModelInit(contract, spec.model_init if spec is not None else None)


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
        return TransformersInit(
            build_on_meta(spec).model if spec is not None else _meta_copy(model)
        )
    return RESET_PARAMETERS


def _meta_copy(model: nn.Module) -> nn.Module:
    """A copy of an unsharded ``model`` whose every tensor is on meta (no storage copied)."""
    memo: dict[int, Any] = {}
    for _, t in named_state(model):
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
        fix = (
            "make it initialize every tensor the module owns (parameters and buffers, "
            "non-persistent ones included)"
        )
        if len(self.untouched) == 1:
            ((fqn, cls, names),) = self.untouched
            text = f"{label} of {fqn} ({cls}) leaves {names} uninitialized; {fix}"
        else:
            modules = [f"{fqn} ({cls}: {names})" for fqn, cls, names in self.untouched]
            text = (
                f"{label} leaves tensors of {len(modules)} modules uninitialized: "
                f"{listing(modules, 6)}; {fix}"
            )
        super().__init__(text)


def full_module_state(
    module: nn.Module, fqn: str, seed: int, init: ModuleInit = RESET_PARAMETERS
) -> dict[str, torch.Tensor]:
    """The module's own state *in full*, on CPU, as ``init`` makes it (its reset_parameters).

    The module's own tensors (those of ``init.target``: the module itself, or its place in a
    transformers shadow) are swapped for full-size CPU scratch tensors (filled with NaN so that
    anything the init leaves untouched is caught), the init runs on the CPU generator seeded
    from ``(seed, fqn)``, and the originals are put back. The module's real tensors (meta, a
    device tensor or a DTensor shard) are never touched here.
    """
    if not own_state(module):
        return {}
    target = init.target(module, fqn)
    own = own_state(target)
    saved_params, saved_buffers = dict(target._parameters), dict(target._buffers)
    scratch: dict[str, torch.Tensor] = {}
    for kind, name, t in own:
        s = (
            torch.full(_global_shape(t), float("nan"), dtype=t.dtype)
            if t.is_floating_point()
            else torch.zeros(_global_shape(t), dtype=t.dtype)
        )
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
        for _, _, t in own_state(module):
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
    module: nn.Module,
    fqn: str,
    seed: int,
    owner: Mapping[int, str],
    dtensor: type,
    init: ModuleInit = RESET_PARAMETERS,
) -> None:
    """One module's own state; its full values die on return (one module's worth at a time)."""
    full = full_module_state(module, fqn, seed, init)
    with torch.no_grad():
        for _, name, t in own_state(module):
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
        piece = (
            chunks[coordinate] if coordinate < len(chunks) else piece.narrow(placement.dim, 0, 0)
        )
    if not sliced or piece.shape != local_tensor.shape:
        piece = distribute_tensor(
            full.to(t.device), t.device_mesh, t.placements, src_data_rank=None
        ).to_local()
    local_tensor.copy_(piece)


def reference_model(spec: ModelSpec, seed: int, device: str | torch.device = "cpu") -> nn.Module:
    """The single-process reference: the same meta build, ``to_empty``, the same init (a
    model-level init on the whole unsharded model, from the global generator seeded with
    ``seed``)."""
    model = build_on_meta(spec).model
    whole = model_init_for(spec, model)
    init = module_init_for(spec, model) if whole is None else None
    to_empty_keeping_ties(model, device)
    if whole is None:
        return deterministic_init_(model, seed, init)
    nan_fill_(named_state(model))
    run_model_init_(model, whole, seed, device)
    check_model_init_(model, whole)
    return model


def to_empty_keeping_ties(model: nn.Module, device: str | torch.device) -> nn.Module:
    """``model.to_empty(device=...)``, with tied tensors still one tensor afterwards.

    ``to_empty`` allocates per module, so a weight two modules share (GPT-2's ``lm_head`` and
    ``wte``) comes out as two tensors: a reference that untied would be initialized twice and
    train two copies, unlike the sharded model (FSDP1's param_init_fn re-binds ties, FSDP2
    keeps one parameter). Every later holder is re-bound to its first holder's new tensor.
    """
    holders: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for kind, name, t in own_state(module):
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


def factory_model(spec: ModelSpec, seed: int) -> nn.Module:
    """``spec``'s model as its factory builds it for the user: on CPU, after
    ``torch.manual_seed(seed)`` (the global CPU generator restored afterwards).

    What a meta init must reproduce (``init.weights.faithful``): values where the factory's
    output does not depend on the seed, the distribution elsewhere (the meta path draws each
    module from its own generator, a different RNG order by design).
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return spec.build("cpu")


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
        model_level: bool = False,
    ) -> None:
        self.init = init if init is not None else module_init_for(None, model)
        #: A model-level init runs after wrapping: here each tensor only gets NaN (caught if
        #: the model-level init leaves it).
        self.model_level = model_level
        if not model_level:
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
        before = {name: t for _, name, t in own_state(module)}
        module.to_empty(device=self.device, recurse=False)
        full = {} if self.model_level else full_module_state(module, fqn, self.seed, self.init)
        with torch.no_grad():
            for kind, name, t in own_state(module):
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
                if self.model_level:
                    nan_fill_([(name, t)])
                    continue
                t.copy_(full[name].to(t.device))
                if self.broadcast_from is not None:
                    import torch.distributed as dist

                    dist.broadcast(t.data, src=self.broadcast_from)
