"""Tensor helpers every claim needs, written once: a rank's local shard, a tensor's raw bytes and
a digest of a state, and the short listing of names that failure messages use.

No claim imports another, so what two claims share lives here (a block), not in either.
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch


def local_tensor(value: Any) -> torch.Tensor | None:
    """The tensor of this rank's own data: a DTensor's local tensor (FSDP2), a ShardedTensor's
    first local shard (FSDP1's sharded state dicts), a plain tensor itself; None for anything
    else (or a ShardedTensor with no shard on this rank)."""
    found: Any = value
    if hasattr(value, "to_local"):  # DTensor
        found = value.to_local()
    elif hasattr(value, "local_shards"):  # FSDP1's ShardedTensor
        shards = value.local_shards()
        found = shards[0].tensor if shards else None
    return found if isinstance(found, torch.Tensor) else None


def local_shard(param: torch.Tensor) -> torch.Tensor:
    """:func:`local_tensor` of a parameter, which always has one."""
    found = local_tensor(param)
    if found is None:
        raise TypeError(f"{type(param).__name__} holds no local tensor on this rank")
    return found


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of ``t`` (copied to a contiguous CPU tensor first), without numpy (torch
    does not require it). A copy: a view of the model's own storage would pin it (FSDP1 then
    cannot free its unsharded parameters when ``summon_full_params`` ends)."""
    t = t.detach().to("cpu", copy=True).contiguous()
    if not t.numel():
        return b""
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def sha256_of(t: torch.Tensor) -> str:
    """SHA-256 of one tensor's raw bytes."""
    return hashlib.sha256(tensor_bytes(t)).hexdigest()


def state_digest(state: Mapping[str, torch.Tensor]) -> str:
    """One SHA-256 over every tensor's name, shape, dtype and bytes (bitwise identity)."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name]
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
        h.update(tensor_bytes(t))
    return h.hexdigest()


def listing(names: Sequence[str], shown: int = 3) -> str:
    """``a, b, c, and 2 more``: the first ``shown`` names and how many are left out."""
    more = f", and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
