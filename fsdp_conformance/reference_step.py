"""The single-process reference of a data-parallel training step, and a sharded model's tensors
seen whole: what the training-loop checks compare, tensor by tensor.

A rank trains on its slice of a global batch and FSDP averages the ranks' gradients, so the
gradient a sharded step applies is the mean over slices of each slice's own gradient.
:class:`SliceReference` computes exactly that in one process: one forward and backward per
slice, each loss divided by the world size, the gradients accumulating as on a rank. It keeps the
model's buffers per slice, so a module whose forward depends on its batch (batch norm's
statistics) or updates a buffer (running statistics) is modelled as each rank runs it, without
synchronisation: rank ``r``'s buffers are the reference's slice-``r`` buffers. For a model
without such modules this is one step on the whole batch.

The sharded side, whole: :func:`full_params` (FSDP1 ``summon_full_params``, FSDP2
``full_tensor``) and :func:`full_buffers`; :func:`compare_tensors` judges
one set against the other, each tensor on its own scale with a floor for rounding-level ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypedDict

import torch
from torch import nn

from fsdp_conformance import _compat
from fsdp_conformance.models import batch_rows, call_model, default_loss
from fsdp_conformance.units import clean_fqn

#: Below this share of the largest reference value in a set, a tensor is judged against that
#: floor, not against its own scale (a gradient whose true value is zero comes out at rounding
#: level on both sides). The same share as ``wrap.train``'s (its measurements: docs/wrapping.md).
NEGLIGIBLE_SHARE = 1e-5

#: A loss of one slice: ``loss(model, slice) -> scalar``; the default is the suite's loss on
#: the model's output (:func:`~fsdp_conformance.models.default_loss`).
LossFn = Callable[[nn.Module, Any], torch.Tensor]


def model_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The suite's loss of ``model`` on ``batch`` (one forward)."""
    return default_loss(call_model(model, batch))


def micro_batches(batch: Any, count: int, world_size: int, per_rank: int) -> list[list[Any]]:
    """``batch`` (``count * world_size * per_rank`` rows) cut into ``count`` micro-batches of
    ``world_size`` slices each: ``[micro][rank]``."""
    size = world_size * per_rank
    return [
        [
            batch_rows(batch, m * size + r * per_rank, m * size + (r + 1) * per_rank)
            for r in range(world_size)
        ]
        for m in range(count)
    ]


def _buffer_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers()}


class SliceReference:
    """A model trained in one process as ``world_size`` ranks train it under FSDP."""

    def __init__(self, model: nn.Module, world_size: int) -> None:
        self.model = model
        self.world_size = world_size
        start = _buffer_state(model)
        self._buffers = [{n: b.clone() for n, b in start.items()} for _ in range(world_size)]

    def _swap_in(self, rank: int) -> None:
        with torch.no_grad():
            for name, buffer in self.model.named_buffers():
                buffer.copy_(self._buffers[rank][name])

    def _swap_out(self, rank: int) -> None:
        self._buffers[rank] = _buffer_state(self.model)

    def forward_backward(self, slices: Sequence[Any], loss: LossFn = model_loss) -> list[float]:
        """One micro-batch: each slice's forward and backward with its loss divided by the
        world size, the gradients accumulating into ``.grad``; each slice's loss."""
        if len(slices) != self.world_size:
            raise ValueError(f"{len(slices)} slices for a world of {self.world_size}")
        losses = []
        for rank, part in enumerate(slices):
            self._swap_in(rank)
            value = loss(self.model, part)
            (value / self.world_size).backward()
            self._swap_out(rank)
            losses.append(float(value))
        return losses

    def buffers(self, rank: int) -> dict[str, torch.Tensor]:
        """Rank ``rank``'s buffers as the reference has them (clean FQNs)."""
        return {clean_fqn(n): b.clone() for n, b in self._buffers[rank].items()}


def sgd_update(params: Iterable[torch.Tensor], lr: float) -> None:
    """Plain SGD, written out, on each parameter that has a gradient: the same arithmetic on
    sharded (DTensor / flat) and full parameters, without torch.optim's first-use import cost
    on every rank. The gradients stay for the caller's ``zero_grad``."""
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.add_(p.grad, alpha=-lr)


def sgd_step(model: nn.Module, lr: float) -> None:
    """:func:`sgd_update` on every parameter of ``model``, then its gradients set to None."""
    params = list(model.parameters())
    sgd_update(params, lr)
    for p in params:
        p.grad = None


# --------------------------------------------------------------------------------------------
# The sharded model, whole
# --------------------------------------------------------------------------------------------


def _whole(value: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    dtensor = _compat.dtensor_cls()
    full = value.full_tensor() if isinstance(value, dtensor) else value
    return full.detach().to(dtype, copy=True)


def full_params(
    sharded: nn.Module, version: str, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Every parameter whole, as ``dtype`` copies, by its clean FQN (every alias of a tied one),
    on every rank (collectives: call on all)."""
    if version == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(sharded, writeback=False):
            return {
                clean_fqn(n): p.detach().to(dtype, copy=True)
                for n, p in sharded.named_parameters(remove_duplicate=False)
            }
    return {
        clean_fqn(n): _whole(p, dtype) for n, p in sharded.named_parameters(remove_duplicate=False)
    }


def full_buffers(sharded: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's buffers (FSDP never shards a buffer), by clean FQN."""
    return {clean_fqn(n): b.detach().clone() for n, b in sharded.named_buffers()}


def reference_params(
    model: nn.Module, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """The reference's parameters (every alias of a tied one), ``dtype`` copies by FQN."""
    return {
        n: p.detach().to(dtype, copy=True)
        for n, p in model.named_parameters(remove_duplicate=False)
    }


def reference_grads(
    model: nn.Module, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor | None]:
    """The reference's gradients by FQN (None where it has none)."""
    return {
        n: None if p.grad is None else p.grad.detach().to(dtype, copy=True)
        for n, p in model.named_parameters(remove_duplicate=False)
    }


# --------------------------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------------------------


class TensorComparison(TypedDict):
    """One set of tensors against the reference's, plain data."""

    #: The worst ``max |got - ref|`` over a tensor's scale (its own largest reference value,
    #: floored at ``NEGLIGIBLE_SHARE`` of the set's largest); 0.0 when every tensor is equal.
    max_rel: float
    #: The tensor it was measured on ("" when none differs).
    worst: str
    #: Names the reference has and the sharded side lacks, and the reverse.
    missing: list[str]
    extra: list[str]
    #: Names whose presence of a value differs (a gradient on one side only).
    none_mismatch: list[str]
    #: Tensors whose shapes differ.
    shape_mismatch: list[str]
    #: Tensors not bitwise equal.
    not_bitwise: list[str]


def _scale(ref: Mapping[str, torch.Tensor | None]) -> float:
    return max(
        (float(t.abs().max()) for t in ref.values() if t is not None and t.numel()), default=0.0
    )


def compare_tensors(
    got: Mapping[str, torch.Tensor | None],
    ref: Mapping[str, torch.Tensor | None],
    names: Sequence[str] | None = None,
    resolution: Mapping[str, torch.Tensor] | None = None,
    floor_share: float = NEGLIGIBLE_SHARE,
) -> TensorComparison:
    """``got`` against ``ref`` by name (``names``: only those, when given). ``resolution``: per
    tensor, elementwise, what a difference may be without meaning anything (an update observed
    as the difference of two stored parameters is known to their rounding:
    :func:`update_resolution`); only the excess counts. ``floor_share``: the share of the set's
    largest reference value below which a tensor is judged against that floor (a coarser
    dtype's rounding needs a higher one)."""
    keys = list(names) if names is not None else sorted(ref)
    floor = floor_share * _scale({k: ref.get(k) for k in keys})
    out: TensorComparison = {
        "max_rel": 0.0,
        "worst": "",
        "missing": [k for k in keys if k not in got],
        "extra": sorted(k for k in got if k not in ref) if names is None else [],
        "none_mismatch": [],
        "shape_mismatch": [],
        "not_bitwise": [],
    }
    for key in keys:
        a, b = got.get(key), ref.get(key)
        if key not in got:
            continue
        if (a is None) != (b is None):
            out["none_mismatch"].append(key)
            continue
        if a is None or b is None:
            continue
        if a.shape != b.shape:
            out["shape_mismatch"].append(key)
            continue
        a, b = a.double().cpu(), b.double().cpu()
        if torch.equal(a, b):
            continue
        out["not_bitwise"].append(key)
        own = float(b.abs().max()) if b.numel() else 0.0
        gap = (a - b).abs()
        if resolution is not None and key in resolution:
            gap = (gap - resolution[key].double().cpu()).clamp(min=0.0)
        diff = float(gap.max()) if gap.numel() else 0.0
        rel = diff / max(own, floor, 1e-30)
        if not math.isfinite(rel) or rel > out["max_rel"]:
            out["max_rel"], out["worst"] = (rel if math.isfinite(rel) else math.inf), key
    return out


def comparison_problems(label: str, c: TensorComparison, rtol: float) -> list[str]:
    """What a comparison shows beyond ``rtol``, one line each (empty: within it)."""
    problems = []
    if c["missing"]:
        problems.append(f"{label}: missing on the sharded side: {', '.join(c['missing'][:4])}")
    if c["extra"]:
        problems.append(f"{label}: not in the reference: {', '.join(c['extra'][:4])}")
    if c["none_mismatch"]:
        problems.append(
            f"{label}: a value on one side only (e.g. a gradient the reference has and the "
            f"sharded model lacks, or the reverse): {', '.join(c['none_mismatch'][:4])}"
        )
    if c["shape_mismatch"]:
        problems.append(f"{label}: shapes differ: {', '.join(c['shape_mismatch'][:4])}")
    if c["max_rel"] > rtol:
        problems.append(
            f"{label}: {c['worst']} differs from the reference by {c['max_rel']:.2e} of its "
            f"scale > {rtol:.0e}"
        )
    return problems


def updates(
    after: Mapping[str, torch.Tensor], before: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``after - before`` per tensor (the step's update)."""
    return {k: after[k] - before[k] for k in after if k in before}


def update_resolution(
    after: Mapping[str, torch.Tensor], before: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """What an update ``after - before`` of stored parameters is known to, elementwise: one
    rounding of each (half an ulp of each value, in the parameters' dtype), on each side of a
    comparison: 2 ulps in all. A gradient that differs by one rounding moves a parameter whose
    update is small beside its value by a whole ulp (measured on transformers' Mixtral in fp32:
    a q-projection update, 1e-5 of its weights, 2e-3 off its own scale after clipping, with the
    gradients equal to 1e-7)."""
    out = {}
    for key, value in after.items():
        if key in before and value.is_floating_point():
            eps = torch.finfo(value.dtype).eps
            out[key] = eps * (value.abs() + before[key].abs())
    return out


def norm_of(tensors: Mapping[str, torch.Tensor | None]) -> float:
    """The L2 norm of a set of tensors together (a figure ``compare`` can follow)."""
    total = sum(float(t.double().pow(2).sum()) for t in tensors.values() if t is not None)
    return math.sqrt(total)
