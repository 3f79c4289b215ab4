"""``loop.accumulation.no_sync`` / ``loop.accumulation.synced``: gradient accumulation over
micro-batches, as users write it, equals the single-process reference step for step.

* ``no_sync``: ``MICRO`` micro-batches per optimizer step with gradient synchronisation off for
  all but the last (FSDP1 ``with model.no_sync():``, FSDP2
  ``model.set_requires_gradient_sync(False)`` then ``True``). Observed: no reduce-scatter (or
  all-reduce) in the unsynchronised micro-batches, each unit that trains reduced once in the
  last.
* ``synced``: synchronisation on for every micro-batch, the gradients accumulating into the
  existing sharded ones, and zeroed, not freed, between optimizer steps
  (``zero_grad(set_to_none=False)``). Observed: each unit that trains reduced once per
  micro-batch.

Both run ``STEPS`` optimizer steps; every step's update equals the reference's (the mean over
ranks of each micro-batch's gradient, summed over micro-batches). The user's code is this
module's steps (:func:`sync_off`, :func:`micro_step`, :func:`zero_grad`), which the faults of
:data:`FAULTS` patch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.faults import Fault, FaultTable, patched_attr
from fsdp_conformance.claims.loop.common import (
    LR,
    LoopResult,
    Pair,
    apply_sgd,
    build_pair,
    ensure_phases,
    failed_verdict,
    loop_result,
    match_units,
    observe_step,
    parity_figures,
    parity_note,
    parity_problems,
    phases,
    reduced_units,
    snapshot,
    trainable_units,
    unreduced,
)
from fsdp_conformance.fsdp.reference_step import model_loss
from fsdp_conformance.harness import RankContext
from fsdp_conformance.models.model_spec import ModelSpec

#: Micro-batches per optimizer step, and optimizer steps per run.
MICRO = 3
STEPS = 2

# --------------------------------------------------------------------------------------------
# The user's code
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def sync_off(model: nn.Module, version: str) -> Iterator[None]:
    """Gradient synchronisation off for the block, as users write it."""
    if version == "fsdp1":
        with model.no_sync():  # type: ignore[operator]
            yield
        return
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]


def micro_step(model: nn.Module, batch: Any, index: int) -> float:
    """One micro-batch's forward and backward (``index``: its place in the optimizer step)."""
    loss = model_loss(model, batch)
    loss.backward()
    return float(loss)


def zero_grad(model: nn.Module, set_to_none: bool) -> None:
    """The user's ``zero_grad`` after an optimizer step."""
    model.zero_grad(set_to_none=set_to_none)


# --------------------------------------------------------------------------------------------
# Faults
# --------------------------------------------------------------------------------------------


def _dropped(step: Callable[..., float]) -> Callable[..., float]:
    def dropping(model: nn.Module, batch: Any, index: int) -> float:
        if index == 0:  # the forward runs, its backward never does
            with torch.no_grad():
                return float(model_loss(model, batch))
        return step(model, batch, index)

    return dropping


@contextlib.contextmanager
def _never_off(model: nn.Module, version: str) -> Iterator[None]:
    yield


FAULTS = FaultTable(
    dropped_micro_batch=Fault(
        "the first micro-batch of each optimizer step runs its forward and never its backward: "
        "its gradient is missing from the accumulated one",
        lambda ctx: patched_attr(__name__, "micro_step", _dropped),
    ),
    sync_never_off=Fault(
        "the user's no_sync / set_requires_gradient_sync(False) does nothing: every micro-batch "
        "reduce-scatters (the numbers still agree; the collectives show it)",
        lambda ctx: patched_attr(__name__, "sync_off", lambda original: _never_off),
    ),
)

# --------------------------------------------------------------------------------------------
# The rank function
# --------------------------------------------------------------------------------------------


class AccumulationResult(LoopResult):
    """A rank's accumulation loop: the shared fields, plus per micro-batch phase the units
    reduced and the units that train."""

    mode: str
    reduced: dict[str, list[str]]
    trainable_units: list[str]


def _optimizer_step(pair: Pair, mode: str, step: int, recorder: Any) -> tuple[list[float], ...]:
    losses, ref_losses = [], []
    for m in range(MICRO):
        recorder.phase = f"micro {step}.{m}"
        part = pair.batches[step * MICRO + m]
        skip_sync = mode == "no_sync" and m < MICRO - 1
        with sync_off(pair.sharded, pair.version) if skip_sync else contextlib.nullcontext():
            losses.append(micro_step(pair.sharded, part[pair.ctx.rank], m))
        ref_losses.append(pair.reference.forward_backward(part)[pair.ctx.rank])
    recorder.phase = f"optimizer {step}"
    return losses, ref_losses


def rank_accumulation(
    ctx: RankContext,
    spec: ModelSpec,
    version: str = "fsdp1",
    mode: str = "no_sync",
    fault: str | Sequence[str] | None = None,
) -> AccumulationResult:
    """``STEPS`` optimizer steps of ``MICRO`` micro-batches each, sharded and on the reference."""
    if mode not in ("no_sync", "synced"):
        raise ValueError(f"mode must be 'no_sync' or 'synced', got {mode!r}")
    with FAULTS.inject(fault, ctx):
        pair = build_pair(ctx, spec, version, micro=MICRO * STEPS)
        losses: list[float] = []
        ref_losses: list[float] = []
        observed = []
        with phases(pair) as recorder:
            for step in range(STEPS):
                before, ref_before = snapshot(pair)
                got, ref = _optimizer_step(pair, mode, step, recorder)
                losses += got
                ref_losses += ref
                apply_sgd(pair.sharded, LR)
                apply_sgd(pair.reference.model, LR)
                recorder.phase = f"observe {step}"
                observed.append(observe_step(pair, before, ref_before))
                zero_grad(pair.sharded, set_to_none=mode == "no_sync")
                pair.reference.model.zero_grad(set_to_none=mode == "no_sync")
        names = [f"micro {s}.{m}" for s in range(STEPS) for m in range(MICRO)]
        return {
            **loop_result(pair, losses, ref_losses, observed),
            "mode": mode,
            "reduced": ensure_phases(reduced_units(recorder), names),
            "trainable_units": trainable_units(pair),
        }


# --------------------------------------------------------------------------------------------
# The verdict
# --------------------------------------------------------------------------------------------


def _collective_problems(v: AccumulationResult) -> list[str]:
    problems = []
    for phase, units in v["reduced"].items():
        synced = v["mode"] == "synced" or phase.endswith(f".{MICRO - 1}")
        missing, unexpected = match_units(units, v["trainable_units"] if synced else [])
        if missing:
            problems.append(unreduced(v["rank"], f"{phase} (synchronised)", missing))
        if unexpected:
            problems.append(
                f"rank {v['rank']}: {phase} ({'synchronised' if synced else 'no sync'}): "
                f"{len(unexpected)} gradient reduction(s) not expected here, of units "
                f"{', '.join(repr(u) for u in unexpected[:4])}"
            )
    return problems


def verdict_accumulation(
    values: Sequence[AccumulationResult], params: Mapping[str, Any]
) -> Verdict:
    """Every step's update equals the reference's on every rank, and the collectives were
    issued only where synchronisation was on, once per unit that trains."""
    mode = params.get("mode", "no_sync")
    problems = parity_problems(values)
    for v in values:
        problems += _collective_problems(v)
    figures = {
        **parity_figures(values),
        "micro_batches": MICRO,
        "reduced_per_step": sum(len(u) for u in values[0]["reduced"].values()) // STEPS,
    }
    data = {"reduced": values[0]["reduced"], "trainable_units": values[0]["trainable_units"]}
    what = f"{STEPS} optimizer steps of {MICRO} micro-batches, " + (
        "synchronisation off for all but the last" if mode == "no_sync" else "synchronised"
    )
    if problems:
        return failed_verdict(
            values,
            f"gradient accumulation ({what}) differs from the reference",
            problems,
            figures,
            data,
        )
    return Verdict(
        True,
        f"{what}: every update equals the reference's (worst {figures['update_rel_diff']:.1e}); "
        f"{figures['reduced_per_step']} unit reductions per optimizer step, "
        + ("in the last micro-batch only" if mode == "no_sync" else "one per unit per micro-batch")
        + parity_note(values),
        figures,
        data,
    )
