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
one set against the other, each tensor on its own scale with a floor for rounding-level ones;
a tensor of exact values (a bool mask, an integer counter) is compared by equality, a complex
one by its real and imaginary parts (:mod:`~fsdp_conformance.fsdp.tensors`).

Running statistics are modelled here once for every check: a train-mode forward updates a
rank's buffers from its own slice only (:class:`RankBuffers`, which :class:`SliceReference`
uses), and a forward that only probes a model (an init check's) leaves its buffers as they were
(:func:`buffers_kept`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypedDict

import torch
from torch import nn

from fsdp_conformance import _compat
from fsdp_conformance.fsdp.tensors import is_exact, max_abs, max_abs_diff, real_view
from fsdp_conformance.harness import skip_rank
from fsdp_conformance.models.model_spec import batch_rows, call_model, default_loss
from fsdp_conformance.models.units import clean_fqn

#: Below this share of the largest reference value in a set, a tensor is judged against that
#: floor, not against its own scale (a gradient whose true value is zero comes out at rounding
#: level on both sides). The same share as ``wrap.train``'s (its measurements: docs/wrapping.md).
NEGLIGIBLE_SHARE = 1e-5

#: A loss of one slice: ``loss(model, slice) -> scalar``; the default is the suite's loss on
#: the model's output (:func:`~fsdp_conformance.models.model_spec.default_loss`).
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


def _load_buffers(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in state:
                buffer.copy_(state[name])


@contextlib.contextmanager
def buffers_kept(model: nn.Module) -> Iterator[None]:
    """Every buffer of ``model`` as it was before the block: a forward run only to prove the
    model runs (an init check's) leaves its running statistics, counters and caches unchanged,
    so that what is compared afterwards is the init, not one train-mode forward's update
    (FSDP never shards a buffer: the rank's own tensors, restored in place)."""
    saved = _buffer_state(model)
    try:
        yield
    finally:
        _load_buffers(model, saved)


class RankBuffers:
    """Each rank's buffers of one model in one process: FSDP never synchronises a buffer, so a
    train-mode forward (batch norm's running statistics, a step counter) updates rank ``r``'s
    from rank ``r``'s slice only, as DDP does without ``SyncBatchNorm``."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._start = _buffer_state(model)
        self._buffers: dict[int, dict[str, torch.Tensor]] = {}

    @contextlib.contextmanager
    def as_rank(self, rank: int) -> Iterator[None]:
        """The model holds rank ``rank``'s buffers for the block (the model's buffers as this
        object found them, for a rank not seen yet), and keeps what the block made of them as
        that rank's."""
        _load_buffers(self.model, self._buffers.get(rank, self._start))
        try:
            yield
        finally:
            self._buffers[rank] = _buffer_state(self.model)

    def of(self, rank: int) -> dict[str, torch.Tensor]:
        """Rank ``rank``'s buffers (clean FQNs)."""
        return {clean_fqn(n): b.clone() for n, b in self._buffers.get(rank, self._start).items()}


class SliceReference:
    """A model trained in one process as ``world_size`` ranks train it under FSDP."""

    def __init__(self, model: nn.Module, world_size: int) -> None:
        self.model = model
        self.world_size = world_size
        self._ranks = RankBuffers(model)

    def forward_backward(self, slices: Sequence[Any], loss: LossFn = model_loss) -> list[float]:
        """One micro-batch: each slice's forward and backward with its loss divided by the
        world size, the gradients accumulating into ``.grad``; each slice's loss."""
        if len(slices) != self.world_size:
            raise ValueError(f"{len(slices)} slices for a world of {self.world_size}")
        losses = []
        for rank, part in enumerate(slices):
            with self._ranks.as_rank(rank):
                value = loss(self.model, part)
                (value / self.world_size).backward()
            losses.append(float(value.detach()))
        return losses

    def buffers(self, rank: int) -> dict[str, torch.Tensor]:
        """Rank ``rank``'s buffers as the reference has them (clean FQNs)."""
        return self._ranks.of(rank)


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


def _copy_as(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A detached copy in ``dtype``; a complex tensor in the complex dtype of ``dtype``'s
    width (a cast to a real dtype would drop its imaginary part)."""
    if value.is_complex():
        dtype = torch.complex128 if dtype == torch.float64 else torch.complex64
    return value.detach().to(dtype, copy=True)


def _whole(value: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    dtensor = _compat.dtensor_cls()
    full = value.full_tensor() if isinstance(value, dtensor) else value
    return _copy_as(full, dtype)


def full_params(
    sharded: nn.Module, version: str, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Every parameter whole, as ``dtype`` copies, by its clean FQN (every alias of a tied one),
    on every rank (collectives: call on all)."""
    if version == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(sharded, writeback=False):
            return {
                clean_fqn(n): _copy_as(p, dtype)
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
    return {n: _copy_as(p, dtype) for n, p in model.named_parameters(remove_duplicate=False)}


def reference_grads(
    model: nn.Module, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor | None]:
    """The reference's gradients by FQN (None where it has none)."""
    return {
        n: None if p.grad is None else _copy_as(p.grad, dtype)
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
    #: Tensors of exact values (bool, integer) that are not equal: no tolerance applies.
    exact_mismatch: list[str]


def _scale(ref: Mapping[str, torch.Tensor | None]) -> float:
    return max((max_abs(t) for t in ref.values() if t is not None and not is_exact(t)), default=0.0)


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
        "exact_mismatch": [],
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
        if is_exact(a) or is_exact(b):
            if max_abs_diff(a, b):
                out["not_bitwise"].append(key)
                out["exact_mismatch"].append(key)
            continue
        a, b = real_view(a), real_view(b)
        if torch.equal(a, b):
            continue
        out["not_bitwise"].append(key)
        own = float(b.abs().max()) if b.numel() else 0.0
        gap = (a - b).abs()
        if resolution is not None and key in resolution:
            gap = (gap - real_view(resolution[key])).clamp(min=0.0)
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
    if c.get("exact_mismatch"):
        problems.append(
            f"{label}: exact values (bool or integer) differ: {', '.join(c['exact_mismatch'][:4])}"
        )
    if c["max_rel"] > rtol:
        problems.append(
            f"{label}: {c['worst']} differs from the reference by {c['max_rel']:.2e} of its "
            f"scale > {rtol:.0e}"
        )
    return problems


def updates(
    after: Mapping[str, torch.Tensor], before: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``after - before`` per floating or complex tensor (the step's update; a tensor of exact
    values has none)."""
    return {k: after[k] - before[k] for k in after if k in before and not is_exact(after[k])}


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
    total = sum(
        float(real_view(t).pow(2).sum())
        for t in tensors.values()
        if t is not None and not is_exact(t)
    )
    return math.sqrt(total)


# --------------------------------------------------------------------------------------------
# One training step against the reference (the loop's and the stack's checks)
# --------------------------------------------------------------------------------------------

#: The dtypes a sharded training step is compared with the reference in: the model's own, fp32
#: as users build it (or fp64); a model in another dtype skips (:func:`parameter_dtype`).
PARITY_DTYPES = (torch.float32, torch.float64)
#: Parity: the worst tensor's ``max |update - reference update|`` over its own largest
#: reference update (floored at :data:`NEGLIGIBLE_SHARE` of the set's). With both sides starting
#: each step from the same parameters (:func:`observe_update`) only the order of sums differs:
#: measured up to 8.5e-8 in fp32 on the odd model and 4.3e-6 on transformers' Mixtral
#: (docs/loop.md); every negative control moves it by 0.3 or more.
UPDATE_RTOL = {torch.float64: 1e-6, torch.float32: 1e-3}
#: A rank's loss against the reference's loss of the same slice: the same forward on the same
#: parameters, so only rounding differs.
LOSS_RTOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def parameter_dtype(model: nn.Module, checks: str, hint: str = "") -> torch.dtype:
    """The dtype of ``model``'s floating-point parameters; one outside :data:`PARITY_DTYPES`
    (or several) skips on this rank, naming ``checks`` (what cannot be compared), the dtypes
    found and the fix (``hint``: what else covers that dtype)."""
    found = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if len(found) == 1 and next(iter(found)) in PARITY_DTYPES:
        return next(iter(found))
    skip_rank(
        f"the {checks} compare a sharded step with the single-process reference at fp32 or "
        f"fp64 parameters; {type(model).__name__} builds its parameters in "
        f"{', '.join(sorted(str(d) for d in found)) or 'no floating dtype'}: pass a factory "
        f"that builds it in fp32{hint}"
    )
    raise AssertionError("unreachable")  # skip_rank raises


def reported_dtype(name: str) -> torch.dtype:
    """The parity dtype a rank reported as ``str(dtype)``: float32 unless it says float64."""
    return torch.float64 if name == str(torch.float64) else torch.float32


class ObservedUpdate(TypedDict):
    """One optimizer step seen on both sides: each side's update and their comparison."""

    got: dict[str, torch.Tensor]
    ref: dict[str, torch.Tensor]
    comparison: TensorComparison


def observe_update(
    after: Mapping[str, torch.Tensor],
    before: Mapping[str, torch.Tensor],
    reference: nn.Module,
    ref_before: Mapping[str, torch.Tensor],
    dtype: torch.dtype,
    expected: Mapping[str, torch.Tensor] | None = None,
    floor_share: float = NEGLIGIBLE_SHARE,
) -> ObservedUpdate:
    """The update the sharded side applied (its full parameters ``after`` minus ``before``)
    against the one ``reference`` applied since ``ref_before``; ``expected``: updates that
    replace the reference's for those names (a per-rank reference for what FSDP leaves local).

    Then ``reference`` takes the sharded side's parameters (``expected``'s names excepted), so
    every step starts both sides from the same values and proves its own update. Why: a tensor
    whose true gradient is zero (a bias right before batch norm) is rounding amplified by
    cancellation, and once the two sides' parameters differ by one rounding it no longer agrees
    at all: measured in float32 under clipping, 0.65 of its own scale at the second step,
    bitwise equal at the first. The difference that carried over is at most the step's
    tolerance, or the step failed. An update is known to its parameters' rounding
    (:func:`update_resolution`); ``floor_share`` as :func:`compare_tensors`'s."""
    got = updates(after, before)
    ref = updates(reference_params(reference, dtype), ref_before)
    ref.update(expected or {})
    with torch.no_grad():
        for name, param in reference.named_parameters(remove_duplicate=False):
            if name in after and name not in (expected or {}):
                param.copy_(after[name])
    comparison = compare_tensors(
        got, ref, resolution=update_resolution(after, before), floor_share=floor_share
    )
    return {"got": got, "ref": ref, "comparison": comparison}


def loss_problems(
    label: str,
    losses: Sequence[float],
    ref_losses: Sequence[float],
    rtol: float,
    what: str = "step",
) -> list[str]:
    """Each of a rank's losses against the reference's of the same slice beyond ``rtol``, one
    line each (``what``: how a loss is counted, "step" or "forward")."""
    out = []
    for i, (got, ref) in enumerate(zip(losses, ref_losses)):
        rel = abs(got - ref) / max(abs(ref), 1e-12)
        if rel > rtol:
            out.append(
                f"{label}: {what} {i}: loss {got:.6g} vs the reference's {ref:.6g} on the same "
                f"slice (relative {rel:.1e} > {rtol:.0e})"
            )
    return out


def update_problems(label: str, steps: Sequence[TensorComparison], rtol: float) -> list[str]:
    """Each step's update comparison beyond ``rtol`` (:func:`comparison_problems`)."""
    return [
        line
        for i, step in enumerate(steps)
        for line in comparison_problems(f"{label}: step {i} update", step, rtol)
    ]
