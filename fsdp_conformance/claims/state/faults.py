"""The state claim's negative controls: one :class:`~fsdp_conformance.claims.faults.FaultTable`.

Each fault changes, for the duration of one rank function, what a user's code or torch does
with a state dict: a value changed before it is loaded, the optimizer's state left out of a
resume, a checkpoint written with wrong shards or read with a wrong value, a ``torch.save`` file
``torch.load`` refuses, the step after a load changed, ``summon_full_params`` called without the
option a case needs. They patch torch's ``torch.distributed.checkpoint`` ``save`` and ``load``
(looked up at call time) or a module-level step of the family module that stands for the user's
code (``round_trip.set_state``, ``resume.set_optim_state`` and ``resume.load_train_state``,
``across_versions.load_dcp``, ``set_optimizer``, ``torch_load`` and ``next_step``,
``summon.summon_options``). The family modules import this table,
so an effect imports its family module when it is entered, not before.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from fsdp_conformance.claims.faults import Fault, FaultEffect, FaultTable, patched
from fsdp_conformance.claims.state.state_dicts import FULL
from fsdp_conformance.fsdp.tensors import local_tensor
from fsdp_conformance.harness import RankContext

#: Added to one value of a dict (the wrong shard or value a fault puts in).
PERTURBATION = 1e-3


def perturb_values(state: dict[str, Any], *, every: bool = False) -> list[str]:
    """Add :data:`PERTURBATION` to the first value of the first floating tensor this rank holds
    (by key order), or with ``every`` of each; returns their keys (none where it holds none).

    ``every`` is for a checkpoint: tied entries (GPT-2's head and embedding) are separate
    copies once written, and a loader takes either, so a wrong shard in one of them alone would
    go unnoticed by the loaders that read the other."""
    changed = []
    for key in sorted(state):
        t = local_tensor(state[key])
        if t is not None and t.is_floating_point() and t.numel():
            with torch.no_grad():
                t.view(-1)[0] += PERTURBATION
            changed.append(key)
            if not every:
                break
    return changed


def _perturb_first(value: Any, every: bool = False) -> bool:
    """Add :data:`PERTURBATION` to the first element of the first floating tensor (this rank's
    own data) found depth-first in ``value`` (mappings by sorted key), or with ``every`` of
    each; whether one was found."""
    if isinstance(value, (dict, list, tuple)):
        parts = [value[k] for k in sorted(value, key=str)] if isinstance(value, dict) else value
        found = [_perturb_first(v, every) for v in (parts if every else ())]
        return any(found) if every else any(_perturb_first(v) for v in parts)
    t = local_tensor(value)
    if t is None or not t.is_floating_point() or not t.numel():
        return False
    with torch.no_grad():
        t.view(-1)[0] += PERTURBATION
    return True


def perturb_read(state: dict[str, Any], every: bool = False) -> None:
    """A read's wrong value: :func:`perturb_values` for a flat state dict; for one of parts
    (``{"model": ..., "optim": ...}``, as training state is saved) one value of each part.
    ``every``: of each tensor (a full dict read by every rank, where each loads its own part)."""
    if any(local_tensor(v) is not None for v in state.values()):
        perturb_values(state, every=every)
        return
    for key in sorted(state):
        _perturb_first(state[key], every)


def _value_changed_before_loading(ctx: RankContext) -> contextlib.AbstractContextManager[Any]:
    from fsdp_conformance.claims.state import round_trip

    def make(load: Callable[..., None]) -> Callable[..., None]:
        def changed(model: nn.Module, version: str, kind: str, state: dict[str, Any]) -> None:
            # A full dict is the checkpoint itself: wrong on every rank that holds one. A sharded
            # or local dict: rank 0's shard alone is wrong.
            if kind in FULL or ctx.rank == 0:
                perturb_values(state)
            load(model, version, kind, state)

        return changed

    return patched(round_trip, "set_state", make)


def _not_loaded(*args: Any, **kwargs: Any) -> None:
    """An optimizer state dict's load that loads nothing."""


def _load_model_only(model: nn.Module, optim: torch.optim.Optimizer, path: str) -> None:
    """``resume.load_train_state`` without the optimizer: the model's state alone read from the
    files and set (the optimizer's state dict is still got, as the user's code gets both)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    model_state, _ = get_state_dict(model, optim)
    load({"model": model_state}, storage_reader=FileSystemReader(path))
    set_model_state_dict(model, model_state)


def _load_dcp_model_only(
    model: nn.Module, optim: torch.optim.Optimizer, path: str, *, no_dist: bool = False
) -> None:
    """``across_versions.load_dcp`` without the optimizer (its state dict still got)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    model_state, _ = get_state_dict(model, optim)
    load({"model": model_state}, storage_reader=FileSystemReader(path), no_dist=no_dist)
    set_model_state_dict(model, model_state)


@contextlib.contextmanager
def _optimizer_not_loaded(ctx: RankContext) -> Iterator[None]:
    from fsdp_conformance.claims.state import across_versions, resume

    with (
        patched(resume, "set_optim_state", lambda _: _not_loaded),
        patched(resume, "load_train_state", lambda _: _load_model_only),
        patched(across_versions, "set_optimizer", lambda _: _not_loaded),
        patched(across_versions, "load_dcp", lambda _: _load_dcp_model_only),
    ):
        yield


def _wrong_shards_written(ctx: RankContext) -> contextlib.AbstractContextManager[Any]:
    from torch.distributed.checkpoint import state_dict_saver

    def make(save: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(save)
        def written(state_dict: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            if ctx.rank == 0:
                # In place: the saved model is not used again. Not a snapshot: a ShardedTensor
                # read back belongs to the default group, no longer to a saving group of its
                # own (DCP then waits for ranks that do not save).
                perturb_values(state_dict, every=True)
            return save(state_dict, *args, **kwargs)

        return written

    return patched(state_dict_saver, "save", make)


@contextlib.contextmanager
def _wrong_value_read(ctx: RankContext) -> Iterator[None]:
    from torch.distributed.checkpoint import state_dict_loader

    from fsdp_conformance.claims.state import across_versions

    def make(load: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(load)
        def read(state_dict: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            out = load(state_dict, *args, **kwargs)
            if ctx.rank == 0:
                perturb_read(state_dict)
            return out

        return read

    def make_torch_load(load: Callable[[str], Any]) -> Callable[[str], Any]:
        def read(path: str) -> Any:
            out = load(path)
            if ctx.rank == 0:
                # Every tensor: FSDP1 loads each rank's part of a full dict from its own copy.
                perturb_read(out, every=True)
            return out

        return read

    with (
        patched(state_dict_loader, "load", make),
        patched(across_versions, "torch_load", make_torch_load),
    ):
        yield


def _torch_load_refused(ctx: RankContext) -> contextlib.AbstractContextManager[Any]:
    import pickle

    from fsdp_conformance.claims.state import across_versions

    def refuse(path: str) -> Any:
        raise pickle.UnpicklingError(
            "Weights only load failed. This file can still be loaded, to do so you have two "
            "options (simulated by the fault torch_load_refused)"
        )

    return patched(across_versions, "torch_load", lambda _: refuse)


def _next_step_perturbed(ctx: RankContext) -> contextlib.AbstractContextManager[Any]:
    from fsdp_conformance.claims.state import across_versions

    def make(step: Callable[..., float]) -> Callable[..., float]:
        def perturbed(model: nn.Module, optim: torch.optim.Optimizer, batch: Any) -> float:
            loss = step(model, optim, batch)
            if ctx.rank == 0:
                _perturb_first([p for _, p in sorted(model.named_parameters())])
            return loss

        return perturbed

    return patched(across_versions, "next_step", make)


def _summoned_with(option: str) -> FaultEffect:
    """An effect: ``summon.summon_options`` with ``option`` False in every case that sets it."""

    def effect(ctx: RankContext) -> contextlib.AbstractContextManager[Any]:
        from fsdp_conformance.claims.state import summon

        def make(
            options: Callable[[str, nn.Module], dict[str, Any]],
        ) -> Callable[[str, nn.Module], dict[str, Any]]:
            def without(case: str, model: nn.Module) -> dict[str, Any]:
                given = options(case, model)
                return {**given, option: False} if option in given else given

            return without

        return patched(summon, "summon_options", make)

    return effect


#: The negative controls of every state check (the ``fault=`` parameter of its rank function).
FAULTS = FaultTable(
    value_changed_before_loading=Fault(
        "one value of each state dict changed before it is loaded: in a full dict on every rank "
        "that holds one, in a sharded or local dict in rank 0's shard (state.round_trip)",
        _value_changed_before_loading,
    ),
    optimizer_not_loaded=Fault(
        "the optimizer's state not loaded into the resumed run, from a state dict or from the "
        "checkpoint files (state.resume, state.checkpoint.optimizer and .torch_save's load)",
        _optimizer_not_loaded,
    ),
    wrong_shards_written=Fault(
        "rank 0 writes its shards of a torch.distributed.checkpoint with one value of each "
        "tensor changed (state.dcp, state.reshard, state.checkpoint's save)",
        _wrong_shards_written,
    ),
    wrong_value_read=Fault(
        "rank 0's torch.distributed.checkpoint load, or torch.load, reads one wrong value (of "
        "the model and of the optimizer where both are read: state.checkpoint's load and "
        "state.checkpoint.optimizer and .torch_save's)",
        _wrong_value_read,
    ),
    torch_load_refused=Fault(
        "torch.load refuses every file, as weights_only=True refuses a file holding classes "
        "it does not allow (state.checkpoint.torch_save's load)",
        _torch_load_refused,
    ),
    next_step_perturbed=Fault(
        "rank 0's next step after a load changes one value of its parameters "
        "(state.checkpoint.optimizer and .torch_save)",
        _next_step_perturbed,
    ),
    writeback_ignored=Fault(
        "summon_full_params called with writeback=False in the case that asks for writeback "
        "(state.summon)",
        _summoned_with("writeback"),
    ),
    grads_not_summoned=Fault(
        "summon_full_params called without with_grads=True after the backward (state.summon)",
        _summoned_with("with_grads"),
    ),
)
