"""``defaults.state_dict``: what the state-dict APIs do when a user leaves their options unset,
observed.

One check per FSDP version. Its rank function builds the tiny model of
:mod:`~fsdp_conformance.claims.defaults.common` (its first layer frozen), takes one Adam
step, and calls the state-dict APIs as a user writes them, every option left out:

* ``torch.distributed.checkpoint.state_dict``: ``get_model_state_dict``,
  ``get_optimizer_state_dict`` and ``get_state_dict`` with no ``StateDictOptions``, and
  ``set_model_state_dict`` given a dict with a key missing;
* FSDP1: ``model.state_dict()`` with no ``state_dict_type`` set,
  ``FSDP.state_dict_type(model, FULL_STATE_DICT)`` with no config, ``FSDP.optim_state_dict``,
  and ``FSDP.summon_full_params`` with every option unset;
* the loaders: ``torch.load`` of what ``torch.save`` wrote (a state dict, and a dict holding an
  object of the user's class), ``dcp.save`` / ``dcp.load`` with a ``checkpoint_id`` only.

Each observable is derived from what came back: the tensor type of the values, whether each
rank holds a shard or the whole tensor, which ranks got anything, whether the values share
storage with the model's parameters, the keys, what a change inside ``summon_full_params``
leaves, whether a call raised. Nothing is read from a signature or an options object.

``EXPECTED`` holds what torch 2.13 does, measured; the check fails on any difference, expected vs
actual, and the report keeps every observed value, so ``compare`` shows what moved.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypedDict

import torch
from torch import nn

from fsdp_conformance import _compat
from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.defaults.common import TinyModel, differ, unexpected
from fsdp_conformance.claims.faults import Fault, FaultTable, patched, with_default
from fsdp_conformance.fsdp.sharding import check_fsdp_version, device_mesh
from fsdp_conformance.fsdp.tensors import local_tensor
from fsdp_conformance.harness import RankContext, all_gather_objects, skip_rank
from fsdp_conformance.models.units import clean_fqn

#: The frozen layer (``requires_grad=False``): a state dict includes it unless told otherwise.
FROZEN = "layers.0"
#: The tiny model's units (FSDP1: one per Linear, the root's norm).
UNITS = ("layers.0", "layers.1", "layers.2", "norm")
#: Every key of the tiny model's state dict, in sorted order.
KEYS = sorted(f"{m}.{p}" for m in UNITS for p in ("bias", "weight"))
#: The keys the optimizer holds state for (the trainable parameters).
TRAINABLE = [k for k in KEYS if not k.startswith(FROZEN + ".")]
#: The submodule whose state dict alone is asked for (``submodules=``).
SUBMODULE = "layers.1"
#: The key left out of the dict given to ``set_model_state_dict``.
DROPPED = "norm.bias"
#: The parameter changed inside ``summon_full_params`` (every rank adds :data:`WRITE_DELTA`).
WRITTEN = "layers.1.weight"
WRITE_DELTA = 1.0
#: The optimizer's state of one parameter after a step (Adam), sorted.
ADAM_STATE = ["exp_avg", "exp_avg_sq", "step"]
#: ``dcp.save``'s files with a ``checkpoint_id`` only (torch 2.13): one per rank and the
#: metadata, at any world size.
PER_RANK_FILES = "__<rank>_0.distcp per rank, .metadata"


def _described_as(api: str, value_type: str, layout: str, shares: bool) -> dict[str, Any]:
    return {
        f"{api}.value_type": value_type,
        f"{api}.layout": layout,
        f"{api}.on_compute_device": True,
        f"{api}.shares_storage": shares,
    }


def _dsd_expected(tensor: str, shares: bool) -> dict[str, Any]:
    """The ``torch.distributed.checkpoint.state_dict`` and loader figures of torch 2.13, given
    the type of a sharded value (``tensor``) and whether it shares the model's storage."""
    return {
        "get_model_state_dict.keys": KEYS,
        **_described_as("get_model_state_dict", tensor, "sharded", shares),
        "get_model_state_dict.ranks_holding": "every rank",
        # keep_submodule_prefixes unset: the model's FQNs; the argument deprecated since 2.4
        "get_model_state_dict.submodule_keys": [f"{SUBMODULE}.bias", f"{SUBMODULE}.weight"],
        "get_model_state_dict.submodules_deprecated": True,
        "get_optimizer_state_dict.layout": ["param_groups", "state"],
        "get_optimizer_state_dict.state_keys": TRAINABLE,
        "get_optimizer_state_dict.param_state": ADAM_STATE,
        "get_optimizer_state_dict.group_params": KEYS,
        **_described_as("get_optimizer_state_dict", tensor, "sharded", shares),
        "get_optimizer_state_dict.ranks_holding": "every rank",
        "get_state_dict.same_as_separate_calls": True,
        "set_model_state_dict.missing_key": "raises RuntimeError",
        "torch_load.foreign_object": "refused (UnpicklingError)",
        "dcp_save.files": PER_RANK_FILES,
        "dcp_load.in_place": True,
        "dcp_load.key_not_in_checkpoint": "raises CheckpointException",
    }


#: What torch 2.13 does with each option omitted (measured on CPU/gloo at world sizes 2 and 4).
#: Keys are the check's figures: ``<api>.<observable>``.
EXPECTED: dict[str, dict[str, Any]] = {
    "fsdp1": {
        # no state_dict_type set: FULL_STATE_DICT, whole on every rank, copies
        "state_dict.keys": KEYS,
        **_described_as("state_dict", "Tensor", "full", False),
        "state_dict.ranks_holding": "every rank",
        "torch_load.state_dict": "read",
        # FULL_STATE_DICT without a config: offload_to_cpu=False, rank0_only=False
        **_described_as("full_state_dict_type", "Tensor", "full", False),
        "full_state_dict_type.ranks_holding": "every rank",
        "optim_state_dict.state_keys": TRAINABLE,
        **_described_as("optim_state_dict", "Tensor", "full", False),
        "optim_state_dict.ranks_holding": "every rank",
        **_dsd_expected("ShardedTensor", False),
        # ShardedTensor is not in torch.load's weights_only allowlist
        "torch_load.get_model_state_dict": "refused (UnpicklingError)",
        "torch_load.get_optimizer_state_dict": "refused (UnpicklingError)",
        # the SHARDED_STATE_DICT type set for the failed load stays set
        **_described_as("state_dict_after_failed_set", "ShardedTensor", "sharded", False),
        # writeback=True, rank0_only=False, offload_to_cpu=False, with_grads=False, recurse=True
        "summon_full_params.whole_units": [*UNITS],
        "summon_full_params.ranks_whole": "every rank",
        "summon_full_params.on_compute_device": True,
        "summon_full_params.change_inside": "kept",
        "summon_full_params.grads_inside": "not gathered",
    },
    "fsdp2": {
        # the DTensors of the sharded dict are the parameters' own shards (no copy)
        **_dsd_expected("DTensor", True),
        "torch_load.get_model_state_dict": "read",
        "torch_load.get_optimizer_state_dict": "read",
    },
}


class UserNote:
    """An object of the user's own class in a checkpoint: not in ``torch.load``'s allowlist."""

    def __init__(self, text: str) -> None:
        self.text = text


# --------------------------------------------------------------------------------------------
# Faults: a changed default, injected into torch on the ranks (negative controls)
# --------------------------------------------------------------------------------------------


def _options_default(field: str, value: Any) -> Callable[[RankContext], Any]:
    """``StateDictOptions()`` with ``field`` defaulting to ``value``: a subclass in the class's
    place in ``torch.distributed.checkpoint.state_dict`` (where an unset ``options`` is built)."""

    def effect(ctx: RankContext) -> Any:
        from torch.distributed.checkpoint import state_dict as dsd

        def make(cls: Any) -> Any:
            return dataclasses.make_dataclass(
                cls.__name__, [(field, type(value), dataclasses.field(default=value))], bases=(cls,)
            )

        return patched(dsd, "StateDictOptions", make)

    return effect


@contextlib.contextmanager
def _static_default(name: str, key: str, make: Callable[[], Any]) -> Iterator[None]:
    """FSDP1's static method ``name`` with keyword ``key`` defaulting to ``make()``; replaced and
    restored as a static method, so FSDP's own calls bind no instance."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    original = FSDP.__dict__[name]
    setattr(FSDP, name, staticmethod(with_default(original.__func__, key, make())))
    try:
        yield
    finally:
        setattr(FSDP, name, original)


def _rank0_only_config() -> Any:
    from torch.distributed.fsdp import FullStateDictConfig

    return FullStateDictConfig(rank0_only=True)


#: Each fault changes what torch does when the user omits an option, as an upgrade could.
FAULTS = FaultTable(
    full_state_dict_default=Fault(
        "StateDictOptions' full_state_dict defaults to True (get_model_state_dict and "
        "get_optimizer_state_dict hand every rank whole tensors)",
        _options_default("full_state_dict", True),
    ),
    keep_submodule_prefixes_default=Fault(
        "StateDictOptions' keep_submodule_prefixes defaults to False (a submodule's keys lose "
        "its FQN prefix)",
        _options_default("keep_submodule_prefixes", False),
    ),
    strict_default=Fault(
        "StateDictOptions' strict defaults to False (set_model_state_dict returns missing keys)",
        _options_default("strict", False),
    ),
    summon_writeback_default=Fault(
        "FSDP1's summon_full_params defaults to writeback=False",
        lambda ctx: _static_default("summon_full_params", "writeback", lambda: False),
    ),
    full_state_dict_rank0_only=Fault(
        "FSDP1's state_dict_type(FULL_STATE_DICT) without a config gives rank 0 alone the dict",
        lambda ctx: _static_default("state_dict_type", "state_dict_config", _rank0_only_config),
    ),
    torch_load_weights_only_default=Fault(
        "torch.load defaults to weights_only=False",
        lambda ctx: patched(torch, "load", lambda fn: with_default(fn, "weights_only", False)),
    ),
)


# --------------------------------------------------------------------------------------------
# What a state dict holds
# --------------------------------------------------------------------------------------------


def _global_numel(value: Any) -> int:
    size = value.size() if callable(getattr(value, "size", None)) else value.shape
    n = 1
    for d in size:
        n *= int(d)
    return n


def _storages(tensors: Iterable[Any]) -> set[int]:
    """The storages (their addresses) of the local tensors of ``tensors``."""
    out = set()
    for value in tensors:
        t = local_tensor(value)
        if t is not None and t.numel():
            out.add(t.untyped_storage().data_ptr())
    return out


def _tensors(tree: Any) -> list[Any]:
    """The tensor leaves of a state dict (a ShardedTensor or a DTensor is one leaf)."""
    if isinstance(tree, Mapping):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, list | tuple):
        return [t for v in tree for t in _tensors(v)]
    if hasattr(tree, "local_shards"):
        return [tree]
    # a scalar (Adam's step) is whole everywhere: the layout is the other tensors'
    return [tree] if isinstance(tree, torch.Tensor) and tree.dim() > 0 else []


def describe(values: Sequence[Any], ctx: RankContext, owned: set[int]) -> dict[str, Any]:
    """What a state dict's tensors are on this rank: their types, ``full`` (each holds the whole
    tensor) or ``sharded`` (each a part), on the compute device, sharing storage with ``owned``
    (the model's parameters, or the optimizer's state)."""
    types = sorted({type(v).__name__ for v in values})
    parts = []
    devices = set()
    for v in values:
        t = local_tensor(v)
        parts.append((0 if t is None else t.numel()) < _global_numel(v))
        if t is not None:
            devices.add(t.device.type)
    layout = "full" if not any(parts) else "sharded" if all(parts) else "mixed"
    return {
        "value_type": "|".join(types),
        "layout": layout if values else "empty",
        "on_compute_device": devices == {ctx.device_type} if values else None,
        "shares_storage": bool(_storages(values) & owned),
    }


def _described(api: str, state: Any, ctx: RankContext, owned: set[int]) -> dict[str, Any]:
    return {f"{api}.{k}": v for k, v in describe(_tensors(state), ctx, owned).items()}


def _outcome(call: Callable[[], Any]) -> str:
    """``returned <value>`` or ``raises <error type>``: what a call did."""
    try:
        result = call()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # the observable (dcp's CheckpointException is no Exception)
        return f"raises {type(exc).__name__}"
    return "returned" if result is None else f"returned {result!r}"


# --------------------------------------------------------------------------------------------
# The model, sharded as a user writes it
# --------------------------------------------------------------------------------------------


def _batch(ctx: RankContext) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(4, 8, device=ctx.device)


def _build(ctx: RankContext, version: str, **options: Any) -> nn.Module:
    torch.manual_seed(0)
    model = TinyModel().to(ctx.device)
    model.get_submodule(FROZEN).requires_grad_(False)
    if version == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FSDP(
            model,
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
            device_id=ctx.device,
            **options,
        )
    import torch.distributed.fsdp as fsdp

    fully_shard = getattr(fsdp, "fully_shard", None) or _compat.fully_shard()
    mesh = device_mesh(ctx)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _trained(ctx: RankContext, version: str) -> tuple[nn.Module, Any]:
    """The model after one Adam step, and its optimizer (over ``model.parameters()``)."""
    model = _build(ctx, version)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(_batch(ctx)).sum().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def _param_storages(model: nn.Module) -> set[int]:
    return _storages(model.parameters())


def _optim_storages(optim: Any) -> set[int]:
    return _storages(_tensors(list(optim.state.values())))


# --------------------------------------------------------------------------------------------
# The observations, each returning figures and what this rank holds (for the ranks' labels)
# --------------------------------------------------------------------------------------------

Observed = tuple[dict[str, Any], dict[str, bool]]


def _dsd(ctx: RankContext, model: nn.Module, optim: Any) -> Observed:
    """``torch.distributed.checkpoint.state_dict`` with no options."""
    from torch.distributed.checkpoint import state_dict as dsd

    msd = dsd.get_model_state_dict(model)
    osd: dict[str, Any] = dict(dsd.get_optimizer_state_dict(model, optim))
    both = dsd.get_state_dict(model, optim)
    figures: dict[str, Any] = {
        "get_model_state_dict.keys": sorted(msd),
        **_described("get_model_state_dict", msd, ctx, _param_storages(model)),
        "get_optimizer_state_dict.layout": sorted(osd),
        "get_optimizer_state_dict.state_keys": sorted(map(str, osd.get("state", {}))),
        "get_optimizer_state_dict.param_state": sorted(
            {k for s in osd.get("state", {}).values() for k in s}
        ),
        "get_optimizer_state_dict.group_params": sorted(
            str(p) for g in osd.get("param_groups", []) for p in g["params"]
        ),
        **_described("get_optimizer_state_dict", osd.get("state"), ctx, _optim_storages(optim)),
        "get_state_dict.same_as_separate_calls": (
            sorted(both[0]) == sorted(msd)
            and sorted(both[1]) == sorted(osd)
            and [type(v).__name__ for v in both[0].values()]
            == [type(v).__name__ for v in msd.values()]
        ),
    }
    figures.update(_submodule_keys(model))
    missing = dict(msd)
    del missing[DROPPED]
    figures["set_model_state_dict.missing_key"] = _outcome(
        lambda: _missing_keys(dsd.set_model_state_dict(model, missing))
    )
    return figures, {
        "get_model_state_dict.ranks_holding": bool(msd),
        "get_optimizer_state_dict.ranks_holding": bool(osd.get("state")),
    }


def _submodule_keys(model: nn.Module) -> dict[str, Any]:
    """``get_model_state_dict(model, submodules={layers.1})``: its keys (``keep_submodule_prefixes``
    unset), and whether a warning calls the argument deprecated (torch 2.13 does)."""
    from torch.distributed.checkpoint import state_dict as dsd

    # FSDP1: the unit wrapping layers.1 (the first module of that clean name)
    sub = next(m for n, m in model.named_modules() if clean_fqn(n) == SUBMODULE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            keys: Any = sorted(dsd.get_model_state_dict(model, submodules={sub}))
        except Exception as exc:  # the observable: the argument refused (removed)
            keys = f"raises {type(exc).__name__}"
    return {
        "get_model_state_dict.submodule_keys": keys,
        "get_model_state_dict.submodules_deprecated": any(
            issubclass(w.category, DeprecationWarning | FutureWarning)
            and "submodules" in str(w.message)
            for w in caught
        ),
    }


def _missing_keys(result: Any) -> Any:
    # set_model_state_dict returns load_state_dict's (missing_keys, unexpected_keys)
    return None if result is None else sorted(getattr(result, "missing_keys", result))


def _fsdp1_state_dicts(ctx: RankContext, model: nn.Module, optim: Any) -> Observed:
    """FSDP1's ``model.state_dict()`` (no type set), ``state_dict_type(FULL_STATE_DICT)`` with
    no config, and ``FSDP.optim_state_dict`` with no options."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    owned = _param_storages(model)
    plain = model.state_dict()
    figures = {
        "state_dict.keys": sorted(plain),
        **_described("state_dict", plain, ctx, owned),
        "torch_load.state_dict": _loaded(plain),
    }
    holds = {"state_dict.ranks_holding": bool(plain)}
    try:
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            full = model.state_dict()
    except Exception as exc:  # offload_to_cpu=True on CPU parameters raises in torch 2.13
        figures["full_state_dict_type.error"] = (
            f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        )
        full = {}
    figures.update(_described("full_state_dict_type", full, ctx, owned))
    holds["full_state_dict_type.ranks_holding"] = bool(full)
    osd = FSDP.optim_state_dict(model, optim)
    figures.update(
        {
            "optim_state_dict.state_keys": sorted(map(str, osd.get("state", {}))),
            **_described("optim_state_dict", osd.get("state"), ctx, _optim_storages(optim)),
        }
    )
    holds["optim_state_dict.ranks_holding"] = bool(osd.get("state"))
    return figures, holds


def _unit_of(name: str) -> str:
    return name.rsplit(".", 1)[0]


def _after_failed_set(ctx: RankContext, model: nn.Module, optim: Any) -> Observed:
    """FSDP1's ``model.state_dict()`` (no type set) after ``set_model_state_dict`` raised: the
    type DSD entered for the load is left set (``FSDP.state_dict_type`` restores the previous
    one only when its body returns)."""
    state = model.state_dict()
    return _described("state_dict_after_failed_set", state, ctx, _param_storages(model)), {}


def _summon(ctx: RankContext, model: nn.Module, optim: Any) -> Observed:
    """FSDP1's ``summon_full_params`` with every option unset: which units are whole inside, on
    which ranks, on which device; whether a change inside stays; gradients inside (after a
    backward, on a model with ``use_orig_params=True``, which gradients need)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    numels = {n: p.numel() for n, p in TinyModel().named_parameters()}
    model = _build(ctx, "fsdp1")  # a fresh one: the trained one is left in another state

    with FSDP.summon_full_params(model):
        inside = {clean_fqn(n): p for n, p in model.named_parameters()}
        whole = sorted(
            {_unit_of(n) for n in numels}
            - {_unit_of(n) for n in numels if n not in inside or inside[n].numel() != numels[n]}
        )
        devices = {p.device.type for p in inside.values()}
        before = inside[WRITTEN].detach().clone() if WRITTEN in inside else None
        if WRITTEN in inside and inside[WRITTEN].numel() == numels[WRITTEN]:
            with torch.no_grad():
                inside[WRITTEN].add_(WRITE_DELTA)
    after = model.state_dict()[WRITTEN]
    kept = before is not None and bool(torch.equal(after.cpu(), (before + WRITE_DELTA).cpu()))
    figures = {
        "summon_full_params.whole_units": whole,
        "summon_full_params.on_compute_device": devices == {ctx.device_type},
        "summon_full_params.change_inside": "kept" if kept else "discarded",
        "summon_full_params.grads_inside": _summoned_grads(ctx, numels),
    }
    return figures, {"summon_full_params.ranks_whole": whole == list(UNITS)}


def _summoned_grads(ctx: RankContext, numels: Mapping[str, int]) -> str:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = _build(ctx, "fsdp1", use_orig_params=True)
    model(_batch(ctx)).sum().backward()
    with FSDP.summon_full_params(model):
        grads = {
            clean_fqn(n): p.grad
            for n, p in model.named_parameters()
            if p.requires_grad and clean_fqn(n) in numels
        }
    whole = [g is not None and g.numel() == numels[n] for n, g in grads.items()]
    # without with_grads a rank keeps its own gradient views: whole, part or none by parameter
    return "whole" if whole and all(whole) else "not gathered"


def _loaded(obj: Any) -> str:
    """``read`` or ``refused``: ``torch.load`` (options unset) of what ``torch.save`` wrote."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer)
    except Exception as exc:  # the observable: the loader refused the file
        return f"refused ({type(exc).__name__})"
    return "read"


def _loaders(ctx: RankContext, model: nn.Module, optim: Any, version: str) -> dict[str, Any]:
    """``torch.load`` and ``dcp.save`` / ``dcp.load`` with options unset."""
    from torch.distributed.checkpoint import state_dict as dsd

    msd = dsd.get_model_state_dict(model)
    figures: dict[str, Any] = {
        "torch_load.foreign_object": _loaded({"step": 1, "note": UserNote("user's")}),
        "torch_load.get_model_state_dict": _loaded(msd),
        "torch_load.get_optimizer_state_dict": _loaded(dsd.get_optimizer_state_dict(model, optim)),
    }
    figures.update(_dcp(ctx, model, msd))
    return figures


@contextlib.contextmanager
def _folder(ctx: RankContext) -> Iterator[str]:
    made = tempfile.mkdtemp(prefix="fsdp-defaults-") if ctx.rank == 0 else ""
    path = str(all_gather_objects(made, ctx.device_type)[0])
    try:
        yield path
    finally:
        all_gather_objects(None, ctx.device_type)  # every rank done with the folder
        if ctx.rank == 0:
            shutil.rmtree(path, ignore_errors=True)


def _file_layout(files: list[str], world_size: int) -> str | list[str]:
    """:data:`PER_RANK_FILES` where the files are that, else the names."""
    per_rank = sorted([".metadata", *(f"__{r}_0.distcp" for r in range(world_size))])
    return PER_RANK_FILES if files == per_rank else files


def _dcp(ctx: RankContext, model: nn.Module, msd: dict[str, Any]) -> dict[str, Any]:
    """``dcp.save`` then ``dcp.load`` with a ``checkpoint_id`` only: the files written, whether
    a key the checkpoint lacks raises, whether loading fills the given dict's tensors in place
    (and so the model, where they share its storage)."""
    # what users call dcp.save and dcp.load
    from torch.distributed.checkpoint.state_dict_loader import load
    from torch.distributed.checkpoint.state_dict_saver import save

    key = "layers.1.weight"
    with _folder(ctx) as path:
        save(msd, checkpoint_id=path)
        files = _file_layout(sorted(os.listdir(path)), ctx.world_size)
        saved = local_tensor(msd[key])
        want = None if saved is None else saved.detach().clone()
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        target = dict(msd)
        ids = {k: id(v) for k, v in target.items()}
        load(target, checkpoint_id=path)
        got = local_tensor(target[key])
        restored = want is not None and got is not None and bool(torch.equal(got, want))
        extra = {**msd, "extra.weight": torch.zeros(2, device=ctx.device)}
        missing = _outcome(lambda: load(extra, checkpoint_id=path))
    return {
        "dcp_save.files": files,
        "dcp_load.in_place": restored and ids == {k: id(v) for k, v in target.items()},
        "dcp_load.key_not_in_checkpoint": missing,
    }


# --------------------------------------------------------------------------------------------
# The check
# --------------------------------------------------------------------------------------------


class StateDictDefaults(TypedDict):
    """One rank's observed state-dict defaults."""

    rank: int
    #: Every observable, ``<api>.<observable>`` (the keys of :data:`EXPECTED`).
    figures: dict[str, Any]


def _ranks_label(flags: Sequence[bool]) -> str:
    if all(flags):
        return "every rank"
    if flags[0] and not any(flags[1:]):
        return "rank 0 only"
    return "ranks " + ", ".join(str(r) for r, f in enumerate(flags) if f) if any(flags) else "none"


def rank_state_dict(
    ctx: RankContext, version: str = "fsdp2", fault: str | Sequence[str] | None = None
) -> StateDictDefaults:
    """Every observable of the state-dict APIs' defaults on this rank (``version``'s model).

    ``fault``: defaults changed in torch for the duration (:data:`FAULTS`), negative controls.
    """
    check_fsdp_version(version)
    if ctx.world_size == 1:
        skip_rank(
            "at world size 1 a shard is the whole tensor: sharded and full state dicts cannot be "
            "told apart; run at world size >= 2"
        )
    with FAULTS.inject(fault, ctx):
        model, optim = _trained(ctx, version)
        figures: dict[str, Any] = {}
        holds: dict[str, bool] = {}
        # FSDP1's own APIs first: a failed set_model_state_dict leaves its type behind (below)
        steps = (
            (_fsdp1_state_dicts, _dsd, _after_failed_set, _summon)
            if version == "fsdp1"
            else (_dsd,)
        )
        for step in steps:
            more, more_holds = step(ctx, model, optim)
            figures.update(more)
            holds.update(more_holds)
        figures.update(_loaders(ctx, model, optim, version))
    every = all_gather_objects(holds, ctx.device_type)
    for key in holds:
        figures[key] = _ranks_label([h[key] for h in every])
    return {"rank": ctx.rank, "figures": figures}


def verdict_state_dict(values: Sequence[StateDictDefaults], params: Mapping[str, Any]) -> Verdict:
    """Every observable equals what the pinned torch does, on every rank."""
    version = params["version"]
    first = values[0]
    problems = [
        f"rank {v['rank']} observed other figures than rank {first['rank']}: "
        + ", ".join(
            sorted(
                k
                for k in {*v["figures"], *first["figures"]}
                if v["figures"].get(k) != first["figures"].get(k)
            )
        )
        for v in values[1:]
        if v["figures"] != first["figures"]
    ]
    expected = EXPECTED[version]
    observed = first["figures"]
    problems += unexpected(expected, observed, lambda key: "options unset")
    figures = dict(observed)
    if problems:
        return differ(f"{version} state-dict defaults", problems, figures, {"expected": expected})
    return Verdict(
        True,
        f"{len(expected)} state-dict default behaviours as expected",
        figures,
        {"expected": expected},
    )


__all__ = [
    "EXPECTED",
    "FAULTS",
    "StateDictDefaults",
    "UserNote",
    "describe",
    "rank_state_dict",
    "verdict_state_dict",
]
