"""What the loop families share: the sharded model and its slice-wise reference built side by side
from one spec, the user's sharding and optimizer steps, the collectives recorded per phase, the
fields every family's result carries, and the parity verdict they all start from.

A family's rank function builds a :class:`Pair`, runs its loop on the sharded model and the same
loop on :attr:`Pair.reference` (a :class:`~fsdp_conformance.fsdp.reference_step.SliceReference`),
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
from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.fsdp.collectives import CollectiveRecorder, record_collectives, unit_sizes
from fsdp_conformance.fsdp.determinism import disable_dropout, require_deterministic
from fsdp_conformance.fsdp.reference_step import (
    LOSS_RTOL,
    UPDATE_RTOL,
    SliceReference,
    TensorComparison,
    full_params,
    loss_problems,
    micro_batches,
    model_loss,
    norm_of,
    observe_update,
    parameter_dtype,
    reference_params,
    reported_dtype,
    sgd_update,
    update_problems,
)
from fsdp_conformance.fsdp.sharding import check_fsdp_version, fsdp1_options, shard
from fsdp_conformance.fsdp.torch_errors import explain, parse_traceback
from fsdp_conformance.harness import RankContext
from fsdp_conformance.models.model_spec import BuiltModel, ModelSpec
from fsdp_conformance.models.policies import PolicyName
from fsdp_conformance.models.units import clean_fqn, planned_unit_modules

#: The learning rate of every loop's SGD step: large enough that an update stands well above the
#: parameters' rounding (update / parameter ~ 1e-2 on the reference models).
LR = 0.1
#: The loops run in the dtype the model is built in (fp32, as users build and train it): FSDP's
#: paths depend on it (FSDP2 reduces fp32 gradients with ``ReduceOp.PREMUL_SUM`` under a divide
#: factor, float64 ones without; FSDP1 clips in float32), so a loop proven in another dtype is
#: not the loop users run. Rounding is kept out of the verdicts by starting every step from the
#: same parameters on both sides (:func:`observe_step`). Parameters in another dtype (a model
#: built in bf16) are outside these checks: they skip, naming why
#: (``reference_step.parameter_dtype``).
DTYPE = torch.float32
#: Each rank's rows per micro-batch.
PER_RANK = 2
#: The tolerance ``compare`` applies to the loop's numeric results (the ``*_norm(s)`` figures)
#: between two runs, stated in each verdict's figures as ``numeric_rtol``: float64 results move
#: by rounding only (1e-16, ``gate.compare.NUMERIC_RTOL``); float32 ones by a kernel's other
#: summation order, ~1e-7 relative.
NUMERIC_RTOL = {torch.float64: 1e-9, torch.float32: 1e-5}


def shard_model(
    model: nn.Module, ctx: RankContext, version: str, policy: Any, **kwargs: Any
) -> nn.Module:
    """The user's sharding call (faults patch it): FSDP1 ``FullyShardedDataParallel`` with the
    policy (``use_orig_params=True`` where a unit mixes frozen and trainable parameters, as
    FSDP1 requires: ``sharding.fsdp1_options``), FSDP2 ``fully_shard`` on the units the policy
    chooses, then the root."""
    if version == "fsdp1":
        kwargs = {**fsdp1_options(model, planned_unit_modules(model, policy)), **kwargs}
    return shard(model, ctx, version, policy, **kwargs)


def apply_sgd(model: nn.Module, lr: float) -> None:
    """The user's optimizer step (SGD written out, on whatever the parameters are: flat,
    DTensor or plain); it leaves the gradients for the user's ``zero_grad``."""
    sgd_update(model.parameters(), lr)


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
    #: The dtype both sides run in (the model's own).
    dtype: torch.dtype

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
    dtype = parameter_dtype(model, "loop checks", " (bf16 compute under FSDP is wrap.train.bf16's)")
    batch = built.batch(rows, ctx.device)
    require_deterministic(model, batch, dropout, "a sharded loop")
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
    )


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
    """The units holding a parameter FSDP manages that requires a gradient, by the collectives'
    unit names (``""`` the root): FSDP1 a unit's flat parameter; FSDP2 each DTensor parameter
    goes to the unit of the longest FQN prefix."""
    units = set(pair.sizes())
    out: set[str] = set()
    if pair.version == "fsdp1":
        for name, module in pair.sharded.named_modules():
            flat = _compat.fsdp1_flat_param(module)
            if flat is not None and flat.requires_grad and clean_fqn(name) in units:
                out.add(clean_fqn(name))
        return sorted(out)
    dtensor = _compat.dtensor_cls()
    for name, param in pair.sharded.named_parameters():
        if not param.requires_grad or not isinstance(param, dtensor):
            continue  # frozen, or left plain by fully_shard (ignored_params): no unit reduces it
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


def unreduced(rank: int, where: str, missing: Sequence[str], whose: str = "that train") -> str:
    """The line for units whose gradients no collective reduced (``match_units``' first list)."""
    return (
        f"rank {rank}: {where}: no reduction of the gradients of {len(missing)} unit(s) "
        f"{whose}: {', '.join(repr(u) for u in missing[:4])}"
    )


class StepObservation(TypedDict):
    """One optimizer step on both sides."""

    update: TensorComparison
    #: The L2 norm of the update divided by the learning rate (the gradient's norm, for SGD).
    grad_norm: float
    ref_grad_norm: float
    #: The L2 norm of the full parameters after the step (the sharded model's).
    param_norm: float


def observe_step(
    pair: Pair,
    before: Mapping[str, torch.Tensor],
    ref_before: Mapping[str, torch.Tensor],
    lr: float = LR,
    expected: Mapping[str, torch.Tensor] | None = None,
) -> StepObservation:
    """The update each side applied since ``before`` / ``ref_before`` (full parameters), and
    the norms ``compare`` follows; ``expected``: updates that replace the reference's for those
    names (a per-rank reference for what FSDP leaves local). The reference then takes the
    sharded model's parameters, so every step starts both sides from the same values
    (``reference_step.observe_update`` says why)."""
    after = full_params(pair.sharded, pair.version, pair.dtype)
    seen = observe_update(after, before, pair.reference.model, ref_before, pair.dtype, expected)
    return {
        "update": seen["comparison"],
        "grad_norm": norm_of(seen["got"]) / lr,
        "ref_grad_norm": norm_of(seen["ref"]) / lr,
        "param_norm": norm_of(after),
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
    #: The dtype both sides ran in ("torch.float32").
    dtype: str


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
    """The dtype the loop ran in (float32 unless it says float64)."""
    return reported_dtype(str(values[0].get("dtype", DTYPE)))


def tolerances(values: Sequence[LoopResult]) -> tuple[float, float]:
    """(update, loss) relative tolerances of the dtype the loop ran in."""
    dtype = run_dtype(values)
    return UPDATE_RTOL[dtype], LOSS_RTOL[dtype]


def parity_problems(values: Sequence[LoopResult]) -> list[str]:
    """Every rank's losses and every step's update against the reference."""
    update_rtol, loss_rtol = tolerances(values)
    problems: list[str] = []
    for v in values:
        label = f"rank {v['rank']}"
        problems += loss_problems(label, v["losses"], v["ref_losses"], loss_rtol, "forward")[:1]
        problems += update_problems(label, [s["update"] for s in v["steps"]], update_rtol)
    return problems


def parity_note(values: Sequence[LoopResult]) -> str:
    """What the comparison was of, for every verdict's message: the dropout switched off."""
    dropout = values[0].get("dropout_disabled", [])
    if dropout:
        return f"; dropout disabled for the comparison: {len(dropout)} settings"
    return ""


def failed_verdict(
    values: Sequence[LoopResult],
    failed: str,
    problems: Sequence[str],
    figures: Mapping[str, Any],
    data: Mapping[str, Any],
) -> Verdict:
    """A family's failed verdict: ``failed`` (what the loop was) with :func:`parity_note`, then
    each distinct problem on a line of its own."""
    lines = "\n  ".join(dict.fromkeys(problems))
    return Verdict(False, f"{failed}{parity_note(values)}:\n  {lines}", figures, data)


def parity_figures(values: Sequence[LoopResult]) -> dict[str, Any]:
    """The figures every family reports (and ``compare`` follows): the worst update difference,
    the gradient and parameter norms per step (rank 0's: all ranks hold the same full
    parameters), unrounded:
    compare holds a ``*_norms`` figure to ``numeric_rtol`` (:data:`NUMERIC_RTOL` of the dtype,
    :mod:`fsdp_conformance.gate.compare`), and a value rounded to six decimals could flip its
    last digit on a 1e-16 move."""
    worst = max((s["update"]["max_rel"] for v in values for s in v["steps"]), default=0.0)
    return {
        "update_rel_diff": worst,
        "grad_norms": [s["grad_norm"] for s in values[0]["steps"]],
        "param_norms": [s["param_norm"] for s in values[0]["steps"]],
        "steps": len(values[0]["steps"]),
        "dtype": values[0].get("dtype", str(DTYPE)),
        "numeric_rtol": NUMERIC_RTOL[run_dtype(values)],
    }
