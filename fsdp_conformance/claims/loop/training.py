"""What the loop families share: the sharded model and its slice-wise reference built side by side
from one spec, the user's sharding and optimizer steps, the collectives recorded per phase, the
fields every family's result carries, and the parity verdict they all start from.

A family's rank function builds a :class:`Pair`, runs its loop on the sharded model and the same
loop on :attr:`Pair.reference` (a :class:`~fsdp_conformance.reference_step.SliceReference`),
observes the update each optimizer step applied (:func:`observe_step`) and the collectives each
phase issued, and returns plain data; :func:`parity_problems` judges what every family shares.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypedDict

import torch
from torch import nn

from fsdp_conformance import _compat
from fsdp_conformance.collectives import CollectiveRecorder, record_collectives, unit_sizes
from fsdp_conformance.harness import RankContext, skip_rank
from fsdp_conformance.models import BuiltModel, ModelSpec
from fsdp_conformance.policies import PolicyName
from fsdp_conformance.reference_step import (
    SliceReference,
    TensorComparison,
    compare_tensors,
    comparison_problems,
    full_params,
    micro_batches,
    model_loss,
    norm_of,
    reference_params,
    updates,
)
from fsdp_conformance.sharding import check_fsdp_version, shard
from fsdp_conformance.step import DETERMINISM_RTOL, disable_dropout, forward_randomness
from fsdp_conformance.torch_errors import explain, parse_traceback
from fsdp_conformance.units import clean_fqn

#: The learning rate of every loop's SGD step: large enough that an update stands well above the
#: parameters' rounding (update / parameter ~ 1e-2 on the reference models).
LR = 0.1
#: The loops run in float64, both sides: what they test is the loop's logic (which gradients are
#: reduced, how often, clipped by which norm, what is frozen), and at fp32 a tensor whose true
#: gradient is zero (a bias right before batch norm) comes out at rounding level on each side
#: differently: 2e-5 to 5e-5 of the largest update on the odd model, summed in another order
#: by accumulation, above the floor a fixed share can keep without hiding real updates. In
#: float64 rounding is 1e-16 and every such tensor sits far below the floor. fp32 and bf16
#: arithmetic under FSDP is ``wrap.train``'s business. A model whose forward cannot run in
#: float64 (a kernel without it: transformers' grouped-mm experts) runs in float32, said in the
#: verdict, with ``wrap.train``'s fp32 tolerances.
DTYPE = torch.float64
FALLBACK_DTYPE = torch.float32
#: Each rank's rows per micro-batch.
PER_RANK = 2
#: Parity: the worst tensor's ``max |update - reference update|`` over its own largest
#: reference update (floored at ``reference_step.NEGLIGIBLE_SHARE`` of the set's). In float64
#: only the order of sums differs between the two sides (measured up to 1.4e-13 on
#: transformers' Llama, docs/loop.md); every negative control moves it by 0.3 or more. In the
#: float32 fallback, ``wrap.train``'s fp32 tolerance (measured 3.2e-4 there, docs/wrapping.md).
UPDATE_RTOL = {torch.float64: 1e-6, torch.float32: 1e-2}
#: A rank's loss against the reference's loss of the same slice: the same forward on the same
#: parameters, so only rounding differs.
LOSS_RTOL = {torch.float64: 1e-10, torch.float32: 1e-5}
#: The tolerance ``compare`` applies to the loop's numeric results (the ``*_norm(s)`` figures)
#: between two runs, stated in each verdict's figures as ``numeric_rtol``: float64 results move
#: by rounding only (1e-16, ``gate.compare.NUMERIC_RTOL``); float32 ones by a kernel's other
#: summation order, ~1e-7 relative.
NUMERIC_RTOL = {torch.float64: 1e-9, torch.float32: 1e-5}


def in_dtype(batch: Any, dtype: torch.dtype) -> Any:
    """``batch`` with its floating-point tensors in ``dtype`` (token ids stay integers)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(dtype) if batch.is_floating_point() else batch
    if isinstance(batch, Mapping):
        return {k: in_dtype(v, dtype) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(in_dtype(v, dtype) for v in batch)
    return batch


def shard_model(
    model: nn.Module, ctx: RankContext, version: str, policy: Any, **kwargs: Any
) -> nn.Module:
    """The user's sharding call (faults patch it): FSDP1 ``FullyShardedDataParallel`` with the
    policy, FSDP2 ``fully_shard`` on the units the policy chooses, then the root."""
    return shard(model, ctx, version, policy, **kwargs)


def apply_sgd(model: nn.Module, lr: float) -> None:
    """The user's optimizer step (SGD written out, on whatever the parameters are: flat,
    DTensor or plain); it leaves the gradients for the user's ``zero_grad``."""
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-lr)


@dataclasses.dataclass
class Pair:
    """A sharded model and its reference, built from one seed, with the batches of a loop."""

    ctx: RankContext
    version: str
    built: BuiltModel
    sharded: nn.Module
    reference: SliceReference
    #: ``[micro][rank]``: each micro-batch's slices (the same on every rank).
    batches: list[list[Any]]
    #: The dropout switched off on both sides (names), for the verdict's note.
    dropout: list[str]
    #: The dtype both sides run in, and why it is not :data:`DTYPE` ("" when it is).
    dtype: torch.dtype
    fallback: str

    @property
    def mine(self) -> list[Any]:
        """This rank's slice of each micro-batch."""
        return [micro[self.ctx.rank] for micro in self.batches]

    def sizes(self) -> dict[str, list[int]]:
        return unit_sizes(self.sharded, self.version, self.ctx.world_size)


def build_pair(
    ctx: RankContext,
    spec: ModelSpec,
    version: str,
    *,
    micro: int = 1,
    policy: PolicyName = "recommended",
    prepare: Callable[[nn.Module], None] | None = None,
    dtype: torch.dtype = DTYPE,
    sharded_kwargs: Callable[[nn.Module], Mapping[str, Any]] | None = None,
    **shard_kwargs: Any,
) -> Pair:
    """``spec``'s model from seed 0 on every rank, ``prepare`` applied (a freeze list), a copy
    sharded by :func:`shard_model` with ``policy``, ``shard_kwargs`` and
    ``sharded_kwargs(copy)`` (arguments naming the copy's own modules or parameters: an ignore
    list); the original is the reference. Dropout is off on both (``step.disable_dropout``); a
    forward that still draws random numbers skips the check on every rank, naming why."""
    check_fsdp_version(version)
    torch.manual_seed(0)
    built = spec.instantiate(ctx.device)
    model = built.model
    if prepare is not None:
        prepare(model)
    dropout = disable_dropout(model)
    rows = micro * ctx.world_size * PER_RANK
    batch, dtype, randomness, fallback = _in_loop_dtype(model, built.batch(rows, ctx.device), dtype)
    if randomness > DETERMINISM_RTOL:
        skip_rank(
            f"{type(model).__name__}'s forward in training mode still draws random numbers "
            f"after dropout was disabled: two calls differ by {randomness:.1e} (relative), so "
            "a sharded loop cannot be compared with the single-process reference"
        )
    batches = micro_batches(batch, micro, ctx.world_size, PER_RANK)
    twin = copy.deepcopy(model)
    # A policy is bound to the modules it was built on (block membership, ties): the copy's.
    policy_obj = BuiltModel(spec, twin).policy(policy)
    named = sharded_kwargs(twin) if sharded_kwargs is not None else {}
    sharded = shard_model(twin, ctx, version, policy_obj, **shard_kwargs, **named)
    return Pair(
        ctx,
        version,
        built,
        sharded,
        SliceReference(model, ctx.world_size),
        batches,
        dropout,
        dtype,
        fallback,
    )


def _in_loop_dtype(
    model: nn.Module, batch: Any, dtype: torch.dtype
) -> tuple[Any, torch.dtype, float, str]:
    """The model and batch in ``dtype``; for :data:`DTYPE`, in :data:`FALLBACK_DTYPE` where the
    model's forward cannot run in it (why, in words); and the forward's randomness (a forward
    on a copy, ``step.forward_randomness``, which is also what proves the dtype runs)."""
    if dtype != DTYPE:  # a family's own choice (clipping: the dtype FSDP1 clips in)
        model.to(dtype)
        chosen = in_dtype(batch, dtype)
        return chosen, dtype, forward_randomness(model, chosen), ""
    model.to(DTYPE)
    wide = in_dtype(batch, DTYPE)
    try:
        return wide, DTYPE, forward_randomness(model, wide), ""
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    model.to(FALLBACK_DTYPE)
    narrow = in_dtype(batch, FALLBACK_DTYPE)
    return narrow, FALLBACK_DTYPE, forward_randomness(model, narrow), why


# --------------------------------------------------------------------------------------------
# Observing a step
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def phases(pair: Pair) -> Iterator[CollectiveRecorder]:
    """Records every collective of the block; set ``recorder.phase`` as the loop goes."""
    with record_collectives(pair.sizes()) as recorder:
        yield recorder


def reduced_units(recorder: CollectiveRecorder) -> dict[str, list[str]]:
    """Per phase, the units whose gradients a reduce-scatter or an all-reduce carried (FSDP1's
    NO_SHARD all-reduces), in issue order; phases without any are present and empty only if
    the caller named them (``ensure_phases``)."""
    out: dict[str, list[str]] = {}
    for r in recorder.records:
        if r["op"] in ("reduce_scatter", "all_reduce") and r["phase"].startswith("micro"):
            out.setdefault(r["phase"], []).append(r["unit"])
    return out


def ensure_phases(reduced: dict[str, list[str]], names: Sequence[str]) -> dict[str, list[str]]:
    return {name: reduced.get(name, []) for name in names}


def trainable_units(pair: Pair) -> list[str]:
    """The units holding a parameter that requires a gradient, by the collectives' unit names
    (``""`` the root): FSDP1 a unit's flat parameter; FSDP2 each parameter goes to the unit of
    the longest FQN prefix."""
    units = set(pair.sizes())
    out: set[str] = set()
    if pair.version == "fsdp1":
        for name, module in pair.sharded.named_modules():
            flat = _compat.fsdp1_flat_param(module)
            if flat is not None and flat.requires_grad and clean_fqn(name) in units:
                out.add(clean_fqn(name))
        return sorted(out)
    for name, param in pair.sharded.named_parameters():
        if not param.requires_grad:
            continue
        owners = [u for u in units if not u or name == u or name.startswith(u + ".")]
        if owners:
            out.add(max(owners, key=len))
    return sorted(out)


def match_units(reduced: Sequence[str], expected: Sequence[str]) -> tuple[list[str], list[str]]:
    """The collectives' unit names (``a|b`` where units of equal size cannot be told apart)
    matched one to one against ``expected``: (expected units no collective served, collectives
    that served no expected unit). Equal-size units share one candidate set, so assigning the
    first free candidate, records with the fewest candidates first, is exact."""
    free = list(expected)
    unmatched = []
    for name in sorted(reduced, key=lambda n: (n.count("|"), n)):
        hit = next((u for u in name.split("|") if u in free), None)
        if hit is None:
            unmatched.append(name)
        else:
            free.remove(hit)
    return free, unmatched


class StepObservation(TypedDict):
    """One optimizer step on both sides."""

    update: TensorComparison
    #: The L2 norm of the update divided by the learning rate (the gradient's norm, for SGD).
    grad_norm: float
    ref_grad_norm: float


def observe_step(
    pair: Pair,
    before: Mapping[str, torch.Tensor],
    ref_before: Mapping[str, torch.Tensor],
    lr: float = LR,
    expected: Mapping[str, torch.Tensor] | None = None,
) -> StepObservation:
    """The update each side applied since ``before`` / ``ref_before`` (full parameters);
    ``expected``: updates that replace the reference's for those names (a per-rank reference
    for what FSDP leaves local).

    Then the reference takes the sharded model's parameters (``expected``'s names excepted),
    so every step starts both sides from the same values and proves its own update. Why: a
    tensor whose true gradient is zero (a bias right before batch norm) is rounding amplified
    by cancellation, and once the two sides' parameters differ by one rounding it no longer
    agrees at all: measured in float32 under clipping, 0.65 of its own scale at the second
    step, bitwise equal at the first. The difference that carried over is at most the step's
    tolerance, or the step failed."""
    after = full_params(pair.sharded, pair.version, pair.dtype)
    got = updates(after, before)
    ref = updates(reference_params(pair.reference.model, pair.dtype), ref_before)
    ref.update(expected or {})
    with torch.no_grad():
        for name, param in pair.reference.model.named_parameters(remove_duplicate=False):
            if name in after and name not in (expected or {}):
                param.copy_(after[name])
    return {
        "update": compare_tensors(got, ref),
        "grad_norm": norm_of(got) / lr,
        "ref_grad_norm": norm_of(ref) / lr,
    }


def snapshot(pair: Pair) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Both sides' full parameters now (call on every rank: FSDP gathers)."""
    return (
        full_params(pair.sharded, pair.version, pair.dtype),
        reference_params(pair.reference.model, pair.dtype),
    )


def train_plain(
    pair: Pair, steps: int, lr: float = LR
) -> tuple[list[float], list[float], list[StepObservation]]:
    """``steps`` plain optimizer steps on both sides, step ``s`` on micro-batch ``s`` (one
    forward and backward, SGD, ``zero_grad``): this rank's losses, the reference's of the same
    slices, and each step's observed update."""
    losses: list[float] = []
    ref_losses: list[float] = []
    observed: list[StepObservation] = []
    for step in range(steps):
        before, ref_before = snapshot(pair)
        loss = model_loss(pair.sharded, pair.mine[step])
        loss.backward()
        losses.append(float(loss))
        ref_losses.append(pair.reference.forward_backward(pair.batches[step])[pair.ctx.rank])
        for model in (pair.sharded, pair.reference.model):
            apply_sgd(model, lr)
        observed.append(observe_step(pair, before, ref_before, lr))
        for model in (pair.sharded, pair.reference.model):
            model.zero_grad(set_to_none=True)
    return losses, ref_losses, observed


class LoopResult(TypedDict):
    """What every loop family reports from a rank; each family's result adds its own fields."""

    rank: int
    version: str
    world_size: int
    #: This rank's loss per forward, and the reference's loss of the same slice.
    losses: list[float]
    ref_losses: list[float]
    #: One observation per optimizer step.
    steps: list[StepObservation]
    dropout_disabled: list[str]
    #: The dtype both sides ran in ("torch.float64"), and why not float64 ("" when it was).
    dtype: str
    fallback: str


def loop_result(
    pair: Pair, losses: list[float], ref_losses: list[float], steps: list[StepObservation]
) -> LoopResult:
    return {
        "rank": pair.ctx.rank,
        "version": pair.version,
        "world_size": pair.ctx.world_size,
        "losses": losses,
        "ref_losses": ref_losses,
        "steps": steps,
        "dropout_disabled": pair.dropout,
        "dtype": str(pair.dtype),
        "fallback": pair.fallback,
    }


def torch_raised(exc: BaseException) -> str | None:
    """torch's one line (``RuntimeError in torch/...py:function: message``) when ``exc`` was
    raised inside torch (its innermost frame), else None. A loop users write that torch refuses
    is a finding a family's verdict reports as a failure; an error of the suite's own code stays
    an error."""
    error = parse_traceback("".join(traceback.format_exception(exc)))
    if error is None or not error.frames or not error.frames[-1].in_torch:
        return None
    return explain(error, {})


# --------------------------------------------------------------------------------------------
# What every family's verdict starts from
# --------------------------------------------------------------------------------------------


def run_dtype(values: Sequence[LoopResult]) -> torch.dtype:
    """The dtype the loop ran in (float64 unless it says float32)."""
    return torch.float32 if values[0].get("dtype") == str(torch.float32) else DTYPE


def tolerances(values: Sequence[LoopResult]) -> tuple[float, float]:
    """(update, loss) relative tolerances of the dtype the loop ran in."""
    dtype = run_dtype(values)
    return UPDATE_RTOL[dtype], LOSS_RTOL[dtype]


def parity_problems(values: Sequence[LoopResult]) -> list[str]:
    """Every rank's losses and every step's update against the reference."""
    update_rtol, loss_rtol = tolerances(values)
    problems: list[str] = []
    for v in values:
        for i, (got, ref) in enumerate(zip(v["losses"], v["ref_losses"])):
            rel = abs(got - ref) / max(abs(ref), 1e-12)
            if rel > loss_rtol:
                problems.append(
                    f"rank {v['rank']}: forward {i}: loss {got:.6g} vs the reference's "
                    f"{ref:.6g} on the same slice (relative {rel:.1e} > {loss_rtol:.0e})"
                )
                break
        for i, step in enumerate(v["steps"]):
            problems += comparison_problems(
                f"rank {v['rank']}: step {i} update", step["update"], update_rtol
            )
    return problems


def parity_note(values: Sequence[LoopResult]) -> str:
    """What the comparison was of, for every verdict's message: the dtype when it is not
    float64 (and why), the dropout switched off."""
    note = ""
    if values[0].get("fallback"):
        note += (
            f"; in {values[0]['dtype']}, not float64 (the model's forward cannot run in "
            f"float64: {values[0]['fallback'][:160]}), with fp32 tolerances"
        )
    dropout = values[0].get("dropout_disabled", [])
    if dropout:
        note += f"; dropout disabled for the comparison: {len(dropout)} modules"
    return note


def parity_figures(values: Sequence[LoopResult]) -> dict[str, Any]:
    """The figures every family reports (and ``compare`` follows): the worst update difference,
    the gradient norms per step (rank 0's: all ranks hold the same full update), unrounded:
    compare holds a ``*_norms`` figure to ``numeric_rtol`` (:data:`NUMERIC_RTOL` of the dtype,
    :mod:`fsdp_conformance.gate.compare`), and a value rounded to six decimals could flip its
    last digit on a 1e-16 move."""
    worst = max((s["update"]["max_rel"] for v in values for s in v["steps"]), default=0.0)
    return {
        "update_rel_diff": worst,
        "grad_norms": [s["grad_norm"] for s in values[0]["steps"]],
        "steps": len(values[0]["steps"]),
        "dtype": values[0].get("dtype", str(DTYPE)),
        "numeric_rtol": NUMERIC_RTOL[run_dtype(values)],
    }
