"""``loop.clipping.l2`` / ``loop.clipping.inf``: gradient clipping by the global norm, as users
write it, equals the single-process reference's ``torch.nn.utils.clip_grad_norm_``.

Each optimizer step: one forward and backward on both sides, then the user's clip step
(:func:`clip_step`): FSDP1 the root's ``model.clip_grad_norm_(max_norm, norm_type)``, FSDP2
``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)`` on the DTensor
gradients (the total norm it returns is a DTensor, on torch 2.13 replicated for the L2 norm and
``Partial(max)`` for inf: ``full_tensor()`` as users do to log it), then SGD. ``max_norm`` is
:data:`CLIP_SHARE` of the reference's true norm, computed on every rank from the reference
before clipping, so the clipping acts on every step.

Observed: the total norm each rank got (identical on every rank, bitwise, and equal to the
reference's), each step's update against the reference's, each rank's losses, and the
collectives the clip call issued (an all-reduce of the norm: FSDP1 by its own call, FSDP2
through DTensor, recorded with ``record_collectives(dtensor=True)``). The user's code is
:func:`clip_step`, which the faults of :data:`FAULTS` patch.

FSDP1's ``clip_grad_norm_`` computes every local norm in float32 (``vector_norm(grad,
dtype=torch.float32)``), which refuses float64 gradients on torch 2.13 ("should be convertible
without narrowing"; docs/loop/clipping.md): the loop runs in the model's own dtype, fp32 for the
reference models. On torch 2.13 FSDP2's inf clip raises on a rank holding an empty shard: a
known defect (``expectations.toml``, measured in ``tests/test_loop_clipping.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
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
    apply_sgd,
    build_pair,
    failed_verdict,
    loop_result,
    observe_step,
    parity_figures,
    parity_problems,
    snapshot,
)
from fsdp_conformance.fsdp.collectives import record_collectives
from fsdp_conformance.fsdp.reference_step import model_loss
from fsdp_conformance.harness import RankContext
from fsdp_conformance.models.model_spec import ModelSpec

#: Optimizer steps per run.
STEPS = 2
#: ``max_norm`` as a share of the reference's true total norm: below it, so the clip acts.
CLIP_SHARE = 0.5
#: A rank's total norm against the reference's: the same gradients summed in another order, in
#: float32. Measured 0 to 8.3e-8 relative (FSDP1 and FSDP2, world sizes 2 and 4); the local-norm
#: control moves it by 0.02 to 0.76.
NORM_RTOL = 1e-5
#: The model's own reduction-order noise in its norm, measured on the reference at every step:
#: its fp32 gradients' norm taken in the groupings a sharded clip may use (all elements as one
#: vector; per tensor, then the norm of the norms, as ``clip_grad_norm_``; per rank's chunk of
#: the flattened gradients, then combined, as FSDP1's flat shards) against the fp64 norm
#: (:func:`norm_noise`). A sharded norm is one more such grouping, so it may differ from the
#: reference's by twice the noise; the tolerance is this factor times it where that exceeds
#: :data:`NORM_RTOL`, capped at :data:`NORM_CAP`.
NORM_NOISE_FACTOR = 4.0
#: The most a measured noise may widen the norm's tolerance: 50x below the smallest difference
#: a wrong norm was measured at (the local-norm control, 0.02 relative); a model noisier than
#: that is reported, not passed.
NORM_CAP = 4e-4

# --------------------------------------------------------------------------------------------
# The user's code
# --------------------------------------------------------------------------------------------


def clip_step(model: nn.Module, version: str, max_norm: float, norm_type: float) -> Any:
    """The user's clip step; returns the total norm as torch returned it (FSDP2: a DTensor)."""
    if version == "fsdp1":
        return model.clip_grad_norm_(max_norm, norm_type)  # type: ignore[operator]
    return torch.nn.utils.clip_grad_norm_(list(model.parameters()), max_norm, norm_type)


def norm_value(total: Any) -> float | None:
    """The user's logged norm: ``full_tensor()`` of a DTensor, then a float; None for none."""
    if total is None:
        return None
    if isinstance(total, _compat.dtensor_cls()):
        total = total.full_tensor()
    return float(total)


def true_norm(model: nn.Module, norm_type: float) -> float:
    """The total norm of the model's gradients, all of them as one vector (the reference's)."""
    grads = [p.grad.detach().flatten() for p in model.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.cat(grads), norm_type))


def norm_noise(model: nn.Module, norm_type: float, world_size: int) -> float:
    """How far the model's gradient norm, taken in the groupings a sharded clip may use, lies
    from its fp64 value (relative, the worst grouping): the reduction-order noise of this
    model's own norm (:data:`NORM_NOISE_FACTOR`)."""
    grads = [p.grad.detach().flatten() for p in model.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    flat = torch.cat(grads)
    exact = float(torch.linalg.vector_norm(flat.double(), norm_type))

    def combined(parts: Sequence[torch.Tensor]) -> float:
        norms = [torch.linalg.vector_norm(t, norm_type) for t in parts if t.numel()]
        return float(torch.linalg.vector_norm(torch.stack(norms), norm_type))

    ways = [float(torch.linalg.vector_norm(flat, norm_type)), combined(grads)]
    ways.append(combined(list(flat.chunk(world_size))))
    return max(abs(w - exact) for w in ways) / max(exact, 1e-30)


# --------------------------------------------------------------------------------------------
# Faults
# --------------------------------------------------------------------------------------------


def _local_grads(model: nn.Module) -> list[torch.Tensor]:
    """This rank's shard of each gradient: FSDP1 the flat parameters' sharded gradients (the
    root's ``parameters()``), FSDP2 each DTensor gradient's local tensor."""
    dtensor = _compat.dtensor_cls()
    return [
        p.grad.to_local() if isinstance(p.grad, dtensor) else p.grad
        for p in model.parameters()
        if p.grad is not None
    ]


def _local_clip(model: nn.Module, version: str, max_norm: float, norm_type: float) -> Any:
    """``clip_grad_norm_``'s arithmetic on this rank's shards only (an empty shard left out:
    the inf norm has no value on it)."""
    grads = [g for g in _local_grads(model) if g.numel()]
    with torch.no_grad():
        total = torch.nn.utils.get_total_norm(grads, norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)
    return total


def _no_clip(model: nn.Module, version: str, max_norm: float, norm_type: float) -> Any:
    return None


FAULTS = FaultTable(
    local_norm=Fault(
        "the user's clip step computes the norm from this rank's local gradient shards only "
        "(FSDP1 the flat parameters' gradients, FSDP2 each DTensor gradient's to_local()) and "
        "scales them by max_norm over it, as clip_grad_norm_ does",
        lambda ctx: patched_attr(__name__, "clip_step", lambda original: _local_clip),
    ),
    no_clip=Fault(
        "the user's clip step is skipped: the gradients are applied unclipped and no norm is "
        "returned",
        lambda ctx: patched_attr(__name__, "clip_step", lambda original: _no_clip),
    ),
)

# --------------------------------------------------------------------------------------------
# The rank function
# --------------------------------------------------------------------------------------------


class ClippingResult(LoopResult):
    """A rank's clipping loop: the shared fields, plus per step the ``max_norm`` used, the
    total norm the clip step returned (None: none) and the reference's, what type torch
    returned the norm as, and the collectives issued by each clip call (``clip <step>``)."""

    norm_type: float
    max_norms: list[float]
    total_norms: list[float | None]
    ref_total_norms: list[float]
    #: The reference's norm after its clip over before (what the clip kept; the sharded update
    #: equals the reference's, so the same share).
    clip_ratios: list[float]
    #: The model's own norm noise at each step (:func:`norm_noise`).
    norm_noise: list[float]
    returned: list[str]
    clip_collectives: dict[str, list[str]]


def _returned_type(total: Any) -> str:
    """What the clip call returned, in words (a DTensor with its placements)."""
    if total is None:
        return "None"
    if isinstance(total, _compat.dtensor_cls()):
        return f"DTensor({', '.join(repr(p) for p in total.placements)})"
    return f"{type(total).__name__}({total.dtype})"


def _step(pair: Pair, step: int, norm_type: float) -> dict[str, Any]:
    """One forward, backward and clip on both sides (the SGD step follows), the clip call's
    collectives recorded (DTensor's too)."""
    part = pair.batches[step]
    loss = model_loss(pair.sharded, part[pair.ctx.rank])
    loss.backward()
    ref_losses = pair.reference.forward_backward(part)
    max_norm = CLIP_SHARE * true_norm(pair.reference.model, norm_type)
    noise = norm_noise(pair.reference.model, norm_type, pair.ctx.world_size)
    with record_collectives(pair.sizes(), dtensor=True) as recorder:
        total = clip_step(pair.sharded, pair.version, max_norm, norm_type)
        value = norm_value(total)
    ref_total = torch.nn.utils.clip_grad_norm_(
        list(pair.reference.model.parameters()), max_norm, norm_type
    )
    clipped = true_norm(pair.reference.model, norm_type)
    return {
        "loss": float(loss),
        "ref_loss": ref_losses[pair.ctx.rank],
        "max_norm": max_norm,
        "total": value,
        "ref_total": float(ref_total),
        "clip_ratio": clipped / float(ref_total),
        "noise": noise,
        "returned": _returned_type(total),
        "collectives": [f"{r['op']} {r['in_dtype']} {r['in_bytes']}B" for r in recorder.records],
    }


def rank_clipping(
    ctx: RankContext,
    spec: ModelSpec,
    version: str = "fsdp1",
    norm_type: float = 2.0,
    fault: str | Sequence[str] | None = None,
) -> ClippingResult:
    """``STEPS`` optimizer steps, each clipped to half the reference's norm, on both sides."""
    with FAULTS.inject(fault, ctx):
        pair = build_pair(ctx, spec, version, micro=STEPS)
        steps: list[dict[str, Any]] = []
        observed = []
        for step in range(STEPS):
            before, ref_before = snapshot(pair)
            steps.append(_step(pair, step, norm_type))
            apply_sgd(pair.sharded, LR)
            apply_sgd(pair.reference.model, LR)
            observed.append(observe_step(pair, before, ref_before))
            pair.sharded.zero_grad(set_to_none=True)
            pair.reference.model.zero_grad(set_to_none=True)
        losses = [s["loss"] for s in steps]
        return {
            **loop_result(pair, losses, [s["ref_loss"] for s in steps], observed),
            "norm_type": norm_type,
            "max_norms": [s["max_norm"] for s in steps],
            "total_norms": [s["total"] for s in steps],
            "ref_total_norms": [s["ref_total"] for s in steps],
            "clip_ratios": [s["clip_ratio"] for s in steps],
            "norm_noise": [s["noise"] for s in steps],
            "returned": [s["returned"] for s in steps],
            "clip_collectives": {f"clip {i}": s["collectives"] for i, s in enumerate(steps)},
        }


# --------------------------------------------------------------------------------------------
# The verdict
# --------------------------------------------------------------------------------------------


def _across_ranks(values: Sequence[ClippingResult], step: int) -> list[str]:
    """The total norm and ``max_norm`` of ``step`` identical on every rank, bitwise."""
    problems = []
    for what, got in (
        ("total norm", [v["total_norms"][step] for v in values]),
        ("max_norm", [v["max_norms"][step] for v in values]),
    ):
        present = [x for x in got if x is not None]
        if len(present) == len(got) and len({x.hex() for x in present}) > 1:
            problems.append(
                f"step {step}: the {what} differs across ranks: "
                + ", ".join(f"rank {v['rank']} {x!r}" for v, x in zip(values, got))
                + " (every rank must clip by one global norm: reduce it across ranks)"
            )
    return problems


def norm_tolerance(values: Sequence[ClippingResult]) -> tuple[float, float]:
    """(the norm's relative tolerance, the measured noise it comes from): at least
    :data:`NORM_RTOL`, :data:`NORM_NOISE_FACTOR` times the noise, at most :data:`NORM_CAP`."""
    noise = max((x for v in values for x in v.get("norm_noise", [])), default=0.0)
    return min(max(NORM_RTOL, NORM_NOISE_FACTOR * noise), NORM_CAP), noise


def _noise_problems(values: Sequence[ClippingResult]) -> list[str]:
    rtol, noise = norm_tolerance(values)
    if NORM_NOISE_FACTOR * noise <= NORM_CAP:
        return []
    return [
        f"the model's gradient norm is too noisy in its dtype to judge a sharded norm: taken in "
        f"another grouping it moves by {noise:.1e} relative; {NORM_NOISE_FACTOR:g} x that "
        f"exceeds the cap {NORM_CAP:g} below which a wrong norm still shows (not a finding "
        "about FSDP: clip in float64, or check clipping on a model with smaller gradient range)"
    ]


def _norm_problems(values: Sequence[ClippingResult]) -> list[str]:
    """Each step's total norm: present, identical on every rank, equal to the reference's within
    the measured tolerance (:func:`norm_tolerance`); and the clip acted (``max_norm`` below the
    reference's norm)."""
    problems: list[str] = _noise_problems(values)
    rtol, noise = norm_tolerance(values)
    for step in range(len(values[0]["total_norms"])):
        problems += _across_ranks(values, step)
        for v in values:
            got, ref = v["total_norms"][step], v["ref_total_norms"][step]
            if got is None or not math.isfinite(got):
                problems.append(
                    f"rank {v['rank']}: step {step}: the clip step returned no total norm "
                    f"({got!r}; the reference's is {ref:.10g}): was the gradient clipped?"
                )
                continue
            rel = abs(got - ref) / max(abs(ref), 1e-30)
            if rel > rtol:
                problems.append(
                    f"rank {v['rank']}: step {step}: total norm {got:.10g} differs from the "
                    f"reference's {ref:.10g} (relative {rel:.1e} > {rtol:.1e}, the model's "
                    f"own norm noise {noise:.1e})"
                )
            if not v["clip_ratios"][step] < 1.0 - CLIP_SHARE / 2:
                problems.append(
                    f"rank {v['rank']}: step {step}: the reference's clip kept "
                    f"{v['clip_ratios'][step]:.3g} of its norm: max_norm "
                    f"{v['max_norms'][step]:.6g} did not clip (the check needs it below the norm)"
                )
    return problems


def _collective_problems(values: Sequence[ClippingResult]) -> list[str]:
    """Each clip phase issued an all-reduce on every rank (the norm reduced across ranks)."""
    return [
        f"rank {v['rank']}: {phase}: no all-reduce issued: the norm was not reduced across "
        f"ranks (issued: {', '.join(ops) or 'nothing'})"
        for v in values
        for phase, ops in v["clip_collectives"].items()
        if not any(op.startswith("all_reduce") for op in ops)
    ]


def _figures(values: Sequence[ClippingResult]) -> dict[str, Any]:
    first = values[0]
    rtol, noise = norm_tolerance(values)
    return {
        **parity_figures(values),
        "norm_rtol": rtol,
        "norm_noise": noise,
        "total_norm": [
            None if x is None or not math.isfinite(x) else round(x, 10)
            for x in first["total_norms"]
        ],
        "clip_ratio": [round(r, 6) for r in first["clip_ratios"]],
        "clip_collectives": max(len(ops) for ops in first["clip_collectives"].values()),
    }


def verdict_clipping(values: Sequence[ClippingResult], params: Mapping[str, Any]) -> Verdict:
    """Every rank's total norm identical and equal to the reference's, every step's update
    equal to the reference's clipped one, the norm all-reduced in the clip phase."""
    norm_type = float(params.get("norm_type", 2.0))
    problems = _norm_problems(values) + parity_problems(values) + _collective_problems(values)
    figures = _figures(values)
    data = {
        "returned": values[0]["returned"],
        "clip_collectives": {str(v["rank"]): v["clip_collectives"] for v in values},
        "max_norm": values[0]["max_norms"],
    }
    what = (
        f"{len(values[0]['steps'])} optimizer steps clipped to {CLIP_SHARE:g} x the reference's "
        f"{'inf' if math.isinf(norm_type) else f'L{norm_type:g}'} norm"
    )
    if problems:
        return failed_verdict(
            values,
            f"gradient clipping ({what}) differs from the reference",
            problems,
            figures,
            data,
        )
    return Verdict(
        True,
        f"{what}: the total norm is identical on every rank and equals the reference's "
        f"({', '.join(f'{x:.6g}' for x in figures['total_norm'])}; tolerance "
        f"{figures['norm_rtol']:.1e}, {NORM_NOISE_FACTOR:g} x the model's own norm noise "
        f"{figures['norm_noise']:.1e} and at least {NORM_RTOL:g}), every update equals the "
        f"reference's (worst {figures['update_rel_diff']:.1e}); the clip call returned "
        f"{values[0]['returned'][0]} and issued {figures['clip_collectives']} collective(s)",
        figures,
        data,
    )
