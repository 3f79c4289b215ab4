"""The model-level init contract: one call on the whole model after ``to_empty``.

torchtitan's pattern, the most common with FSDP2: build on meta, shard, ``to_empty``, then the
root's ``init_weights(buffer_device=...)``, whose modules often have no ``reset_parameters()``.
:class:`ModelInit` runs it (or the user's ``--model-init pkg.module:fn``) where the user runs it;
:mod:`fsdp_conformance.fsdp.meta_init` decides when a model has one (``init_contract``) and builds
the single-process reference with it; :mod:`fsdp_conformance.fsdp.meta_materialize` runs it on the
sharded model (docs/init.md, "A model-level init").
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

import torch
import torch.nn as nn

from fsdp_conformance import _compat
from fsdp_conformance.fsdp.tensors import listing
from fsdp_conformance.models.model_spec import load_object, root_init_weights
from fsdp_conformance.models.units import clean_fqn


class InitError(ValueError):
    """A model cannot be initialized deterministically; the message names the module and fix."""


#: The contracts whose init runs once on the whole model (:class:`ModelInit`), not per module.
MODEL_LEVEL = ("model_init", "init_weights")


class ModelInit:
    """A model-level init: one call on the whole model after ``to_empty`` (torchtitan's
    ``model.init_weights(buffer_device=...)``, or the user's ``--model-init pkg.module:fn``
    called as ``fn(model)``), in place of per-module ``reset_parameters()``.

    It runs where the user runs it: on the unsharded model (the reference), on FSDP2's DTensor
    parameters after ``to_empty``, and on FSDP1's gathered parameters
    (``summon_full_params(writeback=True)``). The global generator is seeded first, the same
    on every rank, as a training script does.
    """

    def __init__(self, contract: str, path: str | None = None) -> None:
        self.contract = contract
        self.path = path
        self.fn = load_object(path, "model init function") if path else None
        self.label = f"model init function {path!r}" if path else "the model's init_weights()"

    def __call__(self, model: nn.Module, device: str | torch.device) -> None:
        if self.fn is not None:
            self.fn(model)
            return
        method = root_init_weights(model)
        if method is None:
            raise InitError(
                f"{type(model).__name__} has no init_weights() callable without arguments; "
                "name the model-level init with --model-init pkg.module:fn"
            )
        if "buffer_device" in inspect.signature(method).parameters:
            method(buffer_device=torch.device(device))
        else:
            method()


def nan_fill_(tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Fill floating tensors (a DTensor's local shard) with NaN: what an init leaves is caught."""
    dtensor = _compat.dtensor_cls()
    with torch.no_grad():
        for _, t in tensors:
            local = t.to_local() if isinstance(t, dtensor) else t
            if local.is_floating_point() or local.is_complex():
                local.fill_(float("nan"))


def left_uninitialized(model: nn.Module) -> list[str]:
    """Names of floating tensors with a NaN in this rank's part (after :func:`nan_fill_`)."""
    dtensor = _compat.dtensor_cls()
    names = []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        local = t.to_local() if isinstance(t, dtensor) else t
        if (local.is_floating_point() or local.is_complex()) and bool(local.isnan().any()):
            names.append(clean_fqn(name))
    return names


def run_model_init_(
    model: nn.Module, init: ModelInit, seed: int, device: str | torch.device
) -> None:
    """Seed the global generator (as a training script does, the same on every rank) and run
    the model-level init on a materialized model whose floating tensors were NaN-filled."""
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        init(model, device)


def check_model_init_(model: nn.Module, init: ModelInit) -> None:
    """Raise :class:`InitError` naming the tensors the model-level init left (NaN-filled)."""
    untouched = left_uninitialized(model)
    if untouched:
        raise InitError(
            f"{init.label} leaves {len(untouched)} tensor(s) of {type(model).__name__} "
            f"uninitialized: {listing(untouched, 8)}; make it initialize every parameter and "
            "buffer of the model (non-persistent ones included)"
        )
