"""State dicts of each kind, got and loaded as torch hands them to a user: FSDP1's
``state_dict_type`` kinds (full, full on rank 0 only, sharded, local) and FSDP2's
``get_model_state_dict`` / ``set_model_state_dict`` options (full on rank 0 with broadcast, full,
sharded). What the state claim round-trips and the loop claim's buffers and uneven families
read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

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
