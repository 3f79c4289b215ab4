"""``loop.entry_points.<what>``: the model entered other than once through its root's forward,
as users write it, equals the single-process reference step for step.

* ``two_forwards``: a shared trunk run twice before one backward: the root's forward on two
  inputs (this rank's slices of two micro-batches), the two losses summed, one backward.
* ``non_root``: a block's own forward in the loss: the root's forward, then the block (an FSDP
  unit, ``layers.0`` on the odd model; on a model without it, its first block) called
  directly, outside the root's forward, on the input it saw there (captured, detached), and
  its output's loss added to the root's: an auxiliary loss or a trained probe.
* ``divide_factor`` (FSDP2; FSDP1 has no public call): ``set_gradient_divide_factor(f)`` on
  every FSDP module, ``f = FACTOR_TIMES_WORLD * world size``: the reduced gradient is the
  ranks' sum over ``f``, i.e. ``world / f`` times the mean, which the reference computes with
  its loss scaled by ``world / f`` (the losses are compared unscaled).

Every check runs ``STEPS`` optimizer steps with a ``torch.optim.SGD`` made after the first
backward (the model run before its optimizer exists, as a loop that builds the optimizer
lazily does; later steps reuse it): every step's update equals the reference's (the same loss,
through :meth:`~fsdp_conformance.fsdp.reference_step.SliceReference.forward_backward`'s ``loss``),
every unit that trains reduced in each backward. The collectives are reported per phase: the
all-gathers per unit of each forward and backward, the reductions per step.

A loop torch refuses (it raises inside torch) is a failure naming torch's line
(:func:`~fsdp_conformance.claims.loop.common.torch_raised`), not an error: users write these
loops. The user's code is this module's steps (:func:`user_loss`, :func:`set_divide_factor`,
:func:`make_optimizer`), which the faults of :data:`FAULTS` patch; the reference always runs
:data:`LOSSES`.
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fsdp_conformance import _compat
from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.faults import Fault, FaultTable, patched_attr
from fsdp_conformance.claims.loop.common import (
    LR,
    LoopResult,
    Pair,
    StepObservation,
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
    torch_raised,
    trainable_units,
    unreduced,
)
from fsdp_conformance.fsdp import capabilities
from fsdp_conformance.fsdp.collectives import CollectiveRecorder
from fsdp_conformance.fsdp.reference_step import model_loss
from fsdp_conformance.harness import RankContext, skip_rank
from fsdp_conformance.models.model_spec import ModelSpec, default_loss
from fsdp_conformance.models.units import clean_fqn

#: The checks' loops.
WHATS = ("two_forwards", "non_root", "divide_factor")
#: Optimizer steps per run (the optimizer made after the first backward, reused after).
STEPS = 2
#: The block ``non_root`` calls directly on the odd model.
BLOCK = "layers.0"
#: ``divide_factor``'s factor over the world size: 2, so the gradients are half the mean.
FACTOR_TIMES_WORLD = 2.0

# --------------------------------------------------------------------------------------------
# The user's code
# --------------------------------------------------------------------------------------------


def block_module(model: nn.Module, block: str) -> nn.Module:
    """The module at clean FQN ``block`` (FSDP1: the unit's wrapper, the outermost)."""
    for name, module in model.named_modules():
        if clean_fqn(name) == block:
            found: nn.Module = module
            return found
    raise KeyError(f"no module {block!r} in {type(model).__name__}")


def _detached(tree: Any) -> Any:
    """``tree`` with its tensors detached, copied as it is now: a block may be handed state it
    changes when it runs (a transformers ``Cache`` the layer appends its keys to: called again
    with the same object, Bloom's, Falcon's and Gemma-2's first layer saw 16 keys for a mask of
    8), so the block's own call gets the state the root's call gave it. An object that cannot
    be copied is passed as it is."""
    detached = _compat.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, tree)
    try:
        return copy.deepcopy(detached)
    except Exception:  # noqa: BLE001 - an uncopyable object (a lock, a handle): pass it as is
        return detached


def captured_forward(
    model: nn.Module, part: Any, block: str
) -> tuple[torch.Tensor, nn.Module, tuple[Any, ...], dict[str, Any]]:
    """The root's loss on ``part``, the block, and the input the block saw in that forward
    (detached: the probe's input comes from outside)."""
    module = block_module(model, block)
    seen: list[tuple[Any, Any]] = []

    def keep(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not seen:
            seen.append((_detached(args), _detached(kwargs)))

    handle = module.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        main = model_loss(model, part)
    finally:
        handle.remove()
    if not seen:
        raise RuntimeError(f"block {block!r} did not run in the root's forward")
    return main, module, seen[0][0], seen[0][1]


def two_forwards_loss(model: nn.Module, part: Any, block: str) -> torch.Tensor:
    """The root's forward on two inputs, the losses summed."""
    first, second = part
    return model_loss(model, first) + model_loss(model, second)


def non_root_loss(model: nn.Module, part: Any, block: str) -> torch.Tensor:
    """The root's loss plus the loss of the block's own forward on the input it saw."""
    main, module, args, kwargs = captured_forward(model, part, block)
    return main + default_loss(module(*args, **kwargs))


def divide_factor_loss(model: nn.Module, part: Any, block: str) -> torch.Tensor:
    return model_loss(model, part)


#: Each loop's loss of one rank's part; the reference runs these (faults never reach them).
LOSSES: dict[str, Callable[[nn.Module, Any, str], torch.Tensor]] = {
    "two_forwards": two_forwards_loss,
    "non_root": non_root_loss,
    "divide_factor": divide_factor_loss,
}


def user_loss(model: nn.Module, part: Any, what: str, block: str) -> torch.Tensor:
    """The user's forward(s) on the sharded model: the loss to backpropagate."""
    return LOSSES[what](model, part, block)


def set_divide_factor(model: nn.Module, factor: float, backend: str) -> None:
    """The user's ``set_gradient_divide_factor`` on every FSDP module (it acts on the module's
    own parameter groups only). On gloo also ``set_force_sum_reduction_for_comms(True)``: FSDP2
    reduces fp32 and bf16 gradients under a factor other than the world size with
    ``ReduceOp.PREMUL_SUM``, which gloo does not have (torch 2.13 raises "Cannot use
    ReduceOp.PREMUL_SUM with Gloo" on every rank, measured); the sum-only reductions are what
    FSDP2's own docstring offers for a backend that needs them. On NCCL, the factor alone."""
    fsdp_module = _compat.fsdp_module_cls()
    for module in model.modules():
        if isinstance(module, fsdp_module):
            module.set_gradient_divide_factor(factor)
            if backend == "gloo" and hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_force_sum_reduction_for_comms(True)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """The user's optimizer, made after the first backward."""
    return torch.optim.SGD(model.parameters(), lr=LR)


# --------------------------------------------------------------------------------------------
# Faults
# --------------------------------------------------------------------------------------------


def _second_lost(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def loss(model: nn.Module, part: Any, what: str, block: str) -> torch.Tensor:
        if what != "two_forwards":
            return original(model, part, what, block)
        first, second = part
        return model_loss(model, first) + model_loss(model, second).detach()

    return loss


def _probe_no_grad(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def loss(model: nn.Module, part: Any, what: str, block: str) -> torch.Tensor:
        if what != "non_root":
            return original(model, part, what, block)
        main, module, args, kwargs = captured_forward(model, part, block)
        with torch.no_grad():
            probe = default_loss(module(*args, **kwargs))
        return main + probe

    return loss


FAULTS = FaultTable(
    second_forward_lost=Fault(
        "two forwards: the second forward's loss is added detached, so only the first is "
        "backpropagated",
        lambda ctx: patched_attr(__name__, "user_loss", _second_lost),
    ),
    probe_no_grad=Fault(
        "non-root: the block's own forward runs under torch.no_grad(), so its loss adds a "
        "constant and never reaches the block's gradients",
        lambda ctx: patched_attr(__name__, "user_loss", _probe_no_grad),
    ),
    divide_factor_ignored=Fault(
        "the user's set_gradient_divide_factor is never applied: FSDP2 averages as by default",
        lambda ctx: patched_attr(__name__, "set_divide_factor", lambda original: lambda *a: None),
    ),
)

# --------------------------------------------------------------------------------------------
# The rank function
# --------------------------------------------------------------------------------------------


class EntryPointsResult(LoopResult):
    """A rank's loop: the shared fields, plus the collectives per phase."""

    what: str
    #: The block ``non_root`` called ("" for the others); the divide factor (0.0 unless set).
    block: str
    factor: float
    #: The process group's backend (on gloo the divide factor comes with sum-only reductions).
    backend: str
    #: Per phase (``micro <step>.forward`` / ``.backward``): collectives by op, and all-gathers
    #: by unit (the recorder's names: ``a|b`` for units of equal size).
    collectives: dict[str, dict[str, int]]
    gathers: dict[str, dict[str, int]]
    #: Per backward phase, the units reduced; and the units that train.
    reduced: dict[str, list[str]]
    trainable_units: list[str]
    #: torch's one line where it refused the loop ("" when it ran).
    torch_error: str


def resolve_block(model: nn.Module, kinds: tuple[type[nn.Module], ...], block: str) -> str:
    """``block`` when ``model`` has it; else its first module of the block classes ``kinds``;
    neither: the check skips, naming the parameter to set."""
    names = {clean_fqn(n) for n, _ in model.named_modules()}
    if block in names:
        return block
    for name, module in model.named_modules():
        if kinds and isinstance(module, kinds):
            return clean_fqn(name)
    skip_rank(
        f"does not apply to {type(model).__name__}: it has no module {block!r} and no block of "
        "its block classes to call on its own (pass --block-cls naming its block class)"
    )
    raise AssertionError("unreachable")  # skip_rank raises


def _block_classes(pair: Pair) -> tuple[type[nn.Module], ...]:
    try:
        return tuple(pair.built.blocks)
    except Exception:  # noqa: BLE001 - a model without block classes has no block to call
        return ()


def _parts(pair: Pair, what: str, step: int) -> list[Any]:
    """Each rank's part of one optimizer step (two slices for two forwards)."""
    if what == "two_forwards":
        return list(zip(pair.batches[2 * step], pair.batches[2 * step + 1]))
    return pair.batches[step]


def _reference_loss(what: str, block: str, scale: float) -> Callable[[nn.Module, Any], Any]:
    loss = LOSSES[what]
    return lambda model, part: loss(model, part, block) * scale


def _run(
    pair: Pair, what: str, block: str, scale: float, recorder: CollectiveRecorder
) -> tuple[list[float], list[float], list[StepObservation]]:
    losses: list[float] = []
    ref_losses: list[float] = []
    steps: list[StepObservation] = []
    optimizers: tuple[torch.optim.Optimizer, ...] = ()
    for step in range(STEPS):
        before, ref_before = snapshot(pair)
        parts = _parts(pair, what, step)
        recorder.phase = f"micro {step}.forward"
        loss = user_loss(pair.sharded, parts[pair.ctx.rank], what, block)
        recorder.phase = f"micro {step}.backward"
        loss.backward()
        ref = pair.reference.forward_backward(parts, _reference_loss(what, block, scale))
        losses.append(float(loss))
        ref_losses.append(ref[pair.ctx.rank] / scale)
        recorder.phase = f"optimizer {step}"
        optimizers = optimizers or (
            make_optimizer(pair.sharded),
            make_optimizer(pair.reference.model),
        )
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        recorder.phase = f"observe {step}"
        steps.append(observe_step(pair, before, ref_before))
    return losses, ref_losses, steps


def _counts(recorder: CollectiveRecorder) -> tuple[dict[str, dict[str, int]], ...]:
    by_op: dict[str, collections.Counter[str]] = {}
    gathers: dict[str, collections.Counter[str]] = {}
    for r in recorder.records:
        if not r["phase"].startswith("micro"):
            continue
        by_op.setdefault(r["phase"], collections.Counter())[r["op"]] += 1
        if r["op"] == "all_gather":
            gathers.setdefault(r["phase"], collections.Counter())[r["unit"]] += 1
    return (
        {p: dict(c) for p, c in by_op.items()},
        {p: dict(sorted(c.items())) for p, c in gathers.items()},
    )


def rank_entry_points(
    ctx: RankContext,
    spec: ModelSpec,
    version: str = "fsdp1",
    what: str = "two_forwards",
    block: str = BLOCK,
    fault: str | Sequence[str] | None = None,
) -> EntryPointsResult:
    """``STEPS`` optimizer steps of loop ``what``, sharded and on the reference."""
    if what not in WHATS:
        raise ValueError(f"what must be one of {', '.join(WHATS)}, got {what!r}")
    factor = FACTOR_TIMES_WORLD * ctx.world_size if what == "divide_factor" else 0.0
    if factor:
        capabilities.require(capabilities.FSDP2_GRADIENT_DIVIDE_FACTOR)
    with FAULTS.inject(fault, ctx):
        pair = build_pair(ctx, spec, version, micro=STEPS * (2 if what == "two_forwards" else 1))
        if what == "non_root":
            block = resolve_block(pair.reference.model, _block_classes(pair), block)
        else:
            block = ""
        if factor:
            set_divide_factor(pair.sharded, factor, ctx.backend)
        error = ""
        with phases(pair) as recorder:
            try:
                losses, ref_losses, steps = _run(
                    pair, what, block, ctx.world_size / factor if factor else 1.0, recorder
                )
            except Exception as exc:  # noqa: BLE001 - torch refusing the loop is the finding
                error = torch_raised(exc) or ""
                if not error:
                    raise
                losses, ref_losses, steps = [], [], []
        by_op, gathers = _counts(recorder)
        names = [f"micro {s}.backward" for s in range(STEPS)]
        return {
            **loop_result(pair, losses, ref_losses, steps),
            "what": what,
            "block": block,
            "factor": factor,
            "backend": ctx.backend,
            "collectives": by_op,
            "gathers": gathers,
            "reduced": ensure_phases(reduced_units(recorder), names),
            "trainable_units": trainable_units(pair),
            "torch_error": error,
        }


# --------------------------------------------------------------------------------------------
# The verdict
# --------------------------------------------------------------------------------------------


def _collective_problems(v: EntryPointsResult) -> list[str]:
    problems = []
    for phase, units in v["reduced"].items():
        missing, _ = match_units(units, v["trainable_units"])
        if missing:
            problems.append(unreduced(v["rank"], phase, missing))
    return problems


def _figures(values: Sequence[EntryPointsResult]) -> dict[str, Any]:
    first = values[0]
    per_phase = first["collectives"]
    ratios = [s["grad_norm"] / s["ref_grad_norm"] for s in first["steps"] if s["ref_grad_norm"] > 0]
    return {
        **parity_figures(values),
        "grad_norm_ratio": max(ratios, key=lambda r: abs(r - 1.0), default=1.0),
        "units_that_train": len(first["trainable_units"]),
        "forward_all_gathers": per_phase.get("micro 0.forward", {}).get("all_gather", 0),
        "backward_all_gathers": per_phase.get("micro 0.backward", {}).get("all_gather", 0),
        "reductions": len(first["reduced"].get("micro 0.backward", [])),
    }


def _what(params: Mapping[str, Any], values: Sequence[EntryPointsResult]) -> str:
    what = params.get("what", "two_forwards")
    if what == "two_forwards":
        return "two forwards (the root on two inputs, summed losses) before one backward"
    if what == "non_root":
        return f"block {values[0]['block']!r} called on its own beside the root's forward"
    force = " (with set_force_sum_reduction_for_comms(True): gloo has no PREMUL_SUM)"
    return f"set_gradient_divide_factor({values[0]['factor']:g}) on every FSDP module" + (
        force if values[0].get("backend") == "gloo" else ""
    )


def verdict_entry_points(values: Sequence[EntryPointsResult], params: Mapping[str, Any]) -> Verdict:
    """Every rank ran the loop (torch raised nowhere), every step's update equals the
    reference's, and every unit that trains was reduced in each backward."""
    what = _what(params, values)
    errors = [f"rank {v['rank']}: {v['torch_error']}" for v in values if v["torch_error"]]
    figures = _figures(values)
    data = {
        "collective_counts": values[0]["collectives"],
        "gathers": values[0]["gathers"],
        "reduced": values[0]["reduced"],
        "trainable_units": values[0]["trainable_units"],
    }
    if errors:
        return Verdict(
            False,
            f"{what}: torch refused this loop:\n  " + "\n  ".join(errors),
            figures,
            data,
        )
    problems = parity_problems(values)
    for v in values:
        problems += _collective_problems(v)
    counts = (
        f"step 0: {figures['forward_all_gathers']} all-gathers in the forward, "
        f"{figures['backward_all_gathers']} in the backward, {figures['reductions']} "
        f"reductions for {figures['units_that_train']} units that train"
    )
    if problems:
        return failed_verdict(
            values,
            f"{what}: differs from the reference (gradient norm "
            f"{figures['grad_norm_ratio']:.3g} x the reference's; {counts})",
            problems,
            figures,
            data,
        )
    return Verdict(
        True,
        f"{what}, {STEPS} steps, the optimizer made after the first backward: every update "
        f"equals the reference's (worst {figures['update_rel_diff']:.1e}); {counts}"
        + parity_note(values),
        figures,
        data,
    )
