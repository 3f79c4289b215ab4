"""Tensor helpers every claim needs, written once: a rank's local shard, a tensor's raw bytes and
a digest of a state, every kind of tensor a model holds compared one way, and the short listing
of names that failure messages use.

A model may hold any dtype (a bool causal mask, an integer counter, a complex rotary table, a
half-precision buffer): :func:`is_exact` tensors (bool, integer) are compared by equality,
floating ones in fp64 whatever their width, complex ones as their (real, imaginary) pairs
(:func:`real_view`). Every difference, norm and sum a check takes goes through these.

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


def is_exact(t: torch.Tensor) -> bool:
    """Whether ``t`` holds exact values (bool, integer): equal or not, never "close"."""
    return not (t.is_floating_point() or t.is_complex())


def real_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as an fp64 CPU copy of real numbers: floating tensors of any width widened,
    complex ones as their (real, imaginary) pairs (``torch.view_as_real``, one more dimension),
    bool as 0/1 and integers as themselves."""
    t = t.detach().to("cpu")
    if t.is_complex():
        return torch.view_as_real(t.to(torch.complex128)).clone()
    return t.to(torch.float64, copy=True)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b|`` of two tensors of one shape, for every kind: exact tensors (bool,
    integer) 0.0 when equal and at least 1.0 when not (a large integer's fp64 view may round a
    difference away); floating ones in fp64; complex ones per real and imaginary part."""
    if not a.numel():
        return 0.0
    gap = float((real_view(a) - real_view(b)).abs().max())
    if is_exact(a) or is_exact(b):
        same = a.dtype == b.dtype and torch.equal(a.detach().cpu(), b.detach().cpu())
        return 0.0 if same else max(gap, 1.0)
    return gap


def max_abs(t: torch.Tensor) -> float:
    """``max |t|`` for every kind (:func:`real_view`); 0.0 for an empty tensor."""
    return float(real_view(t).abs().max()) if t.numel() else 0.0


def total(t: torch.Tensor) -> float | int:
    """The sum of ``t``'s elements as a plain number: an ``int`` for exact tensors, a
    ``float`` for floating ones (summed in fp64) and for complex ones (the sum of every real
    and imaginary part)."""
    if is_exact(t):
        return int(t.detach().cpu().to(torch.int64).sum())
    return float(real_view(t).sum())


def listing(names: Sequence[str], shown: int = 3) -> str:
    """``a, b, c, and 2 more``: the first ``shown`` names and how many are left out."""
    more = f", and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
