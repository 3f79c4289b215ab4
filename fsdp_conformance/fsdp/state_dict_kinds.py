"""State dicts of each kind, got and loaded as torch hands them to a user: FSDP1's
``state_dict_type`` kinds (full, full on rank 0 only, sharded, local) and FSDP2's
``get_model_state_dict`` / ``set_model_state_dict`` options (full on rank 0 with broadcast, full,
sharded); the optimizer's state dicts of each kind (``get_optim_state``, ``set_optim_state``) and
a model's and optimizer's whole state as copies (``whole_state``). What the state claim
round-trips and the loop claim's buffers and uneven families read.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

#: The state-dict kinds of each FSDP version, in the order they run.
KINDS: dict[str, tuple[str, ...]] = {
    "fsdp1": ("full", "full_rank0_only", "sharded", "local"),
    "fsdp2": ("full_rank0", "full", "sharded"),
}
#: Kinds whose getter hands rank 0 alone a state dict (the others get an empty one).
RANK0_ONLY = frozenset({"full_rank0_only", "full_rank0"})
#: Kinds only read, not loaded (FSDP1 loads a full state dict on every rank, not rank 0's).
GET_ONLY = frozenset({"full_rank0_only"})


def offload_to_cpu(model: nn.Module) -> bool:
    """FSDP1's ``offload_to_cpu``: on where the parameters are on a GPU, as users save. On the
    CPU they are there already, and torch 2.13's FSDP1 cannot unshard CPU parameters with it
    ("setStorage: ... out of bounds for storage of size 0")."""
    return next(model.parameters()).device.type != "cpu"


@contextlib.contextmanager
def _fsdp1_type(model: nn.Module, kind: str) -> Iterator[None]:
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if kind in ("full", "full_rank0_only"):
        config = FullStateDictConfig(
            offload_to_cpu=offload_to_cpu(model), rank0_only=kind == "full_rank0_only"
        )
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
            yield
    else:
        which = {
            "sharded": StateDictType.SHARDED_STATE_DICT,
            "local": StateDictType.LOCAL_STATE_DICT,
        }[kind]
        with FSDP.state_dict_type(model, which):
            yield


def fsdp2_options(kind: str, *, loading: bool = False) -> Any:
    """FSDP2's ``StateDictOptions`` of ``kind`` (``loading``: rank 0's full dict broadcast)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    if kind == "full_rank0":
        return StateDictOptions(
            full_state_dict=True, cpu_offload=True, broadcast_from_rank0=loading
        )
    if kind == "full":
        return StateDictOptions(full_state_dict=True)
    return StateDictOptions()


def get_state(model: nn.Module, version: str, kind: str) -> dict[str, Any]:
    """The model's state dict of ``kind`` (:data:`KINDS`), as torch hands it to a user."""
    if version == "fsdp1":
        with _fsdp1_type(model, kind):
            return dict(model.state_dict())
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return dict(get_model_state_dict(model, options=fsdp2_options(kind)))


def set_state(model: nn.Module, version: str, kind: str, state: dict[str, Any]) -> None:
    """Load ``state`` (of ``kind``) into ``model``, strictly (every key must match)."""
    if version == "fsdp1":
        with _fsdp1_type(model, kind):
            model.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state, options=fsdp2_options(kind, loading=True))


@contextlib.contextmanager
def _fsdp1_optim_type(model: nn.Module, kind: str) -> Iterator[None]:
    from torch.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        StateDictType,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if kind in ("full", "full_rank0_only"):
        offload = offload_to_cpu(model)
        with FSDP.state_dict_type(
            model,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(offload_to_cpu=offload),
            FullOptimStateDictConfig(offload_to_cpu=offload, rank0_only=kind == "full_rank0_only"),
        ):
            yield
    else:
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            yield


def get_optim_state(
    model: nn.Module, optim: torch.optim.Optimizer, version: str, kind: str
) -> dict[str, Any]:
    """The optimizer's state dict of ``kind``, as torch hands it to a user."""
    if version == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with _fsdp1_optim_type(model, kind):
            return dict(FSDP.optim_state_dict(model, optim))
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return dict(get_optimizer_state_dict(model, optim, options=fsdp2_options(kind)))


def set_optim_state(
    model: nn.Module, optim: torch.optim.Optimizer, version: str, kind: str, state: dict[str, Any]
) -> None:
    """Load an optimizer state dict of ``kind`` into ``optim``."""
    if version == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with _fsdp1_optim_type(model, kind):
            optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, state))
        return
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, optim, state, options=fsdp2_options(kind, loading=True))


def whole_state(
    model: nn.Module, optim: torch.optim.Optimizer, target: str
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The model's and the optimizer's whole state, as copies (collectives on a sharded
    ``target``): ``state_dict()`` and ``get_optimizer_state_dict`` (keyed by parameter name)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    if target == "unsharded":
        model_state = dict(model.state_dict())
        optim_state = get_optimizer_state_dict(model, optim)
    else:
        model_state = get_state(model, target, "full")
        optim_state = get_optimizer_state_dict(
            model, optim, options=StateDictOptions(full_state_dict=True)
        )
    # Copies: a state dict shares tensors with the live model and optimizer (AdamW's step).
    return {k: v.detach().clone() for k, v in model_state.items()}, copied(dict(optim_state))


def copied(value: Any) -> Any:
    """``value`` with every tensor cloned on its own: unlike ``copy.deepcopy``, two entries
    holding one tensor (FSDP1 hands every parameter of a flat parameter one AdamW ``step``)
    get a tensor each, as a fresh optimizer holds them."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: copied(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(copied(v) for v in value)
    return copy.deepcopy(value)


def shared_steps(optim_state: Mapping[str, Any]) -> list[str]:
    """The parameters of an optimizer state dict whose ``step`` is one tensor with another
    parameter's, sorted (observed: FSDP1's full dict hands every parameter of a flat parameter
    the flat parameter's one ``step``, and ``torch.save`` keeps the sharing)."""
    holders: dict[int, list[str]] = {}
    for name, entries in optim_state.get("state", {}).items():
        step = entries.get("step") if isinstance(entries, Mapping) else None
        if isinstance(step, torch.Tensor):
            holders.setdefault(id(step), []).append(str(name))
    return sorted(n for names in holders.values() if len(names) > 1 for n in names)
