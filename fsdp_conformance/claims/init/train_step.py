"""``init.train_step``: the first training step after meta init matches the single-process
reference's (loss and updated weights), on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.init.common import (
    DEFAULT_SPEC,
    FAULTS,
    Failure,
    failed_on_ranks,
    model_level,
    preflight,
    preflight_failure,
)
from fsdp_conformance.fsdp.determinism import disable_dropout
from fsdp_conformance.fsdp.meta_init import full_state, reference_model
from fsdp_conformance.fsdp.meta_materialize import gathered_state, materialize
from fsdp_conformance.fsdp.tensors import is_exact, listing, max_abs, max_abs_diff
from fsdp_conformance.harness import RankContext
from fsdp_conformance.models.model_spec import ModelSpec, call_model, default_loss

#: Training step: after one step the sharded model and the reference differ only by the order
#: of floating-point reductions.
STEP_RTOL = 1e-4
STEP_ATOL = 1e-6


class TrainStepReport(Failure, total=False):
    """One rank's step against the reference's: losses, weights that differ, the largest
    difference, the dropout settings switched off for the comparison."""

    loss: float
    reference_loss: float
    mismatch: list[str]
    max_abs_diff: float
    max_abs_diff_at: str
    dropout_disabled: list[str]


def rank_train_step(
    ctx: RankContext,
    spec: ModelSpec = DEFAULT_SPEC,
    version: str = "fsdp2",
    seed: int = 0,
    lr: float = 0.1,
    fault: str | Sequence[str] | None = None,
) -> TrainStepReport:
    """One SGD step after meta init, against the same step on the single-process reference.

    Every rank feeds the same batch, so the averaged gradient equals the reference's. Dropout
    is switched off on both sides (``step.disable_dropout``: p = 0, the models stay in training
    mode): the sharded step and the reference draw their masks at different points of the RNG
    stream, so with dropout they differ by the masks, not by the init (the report says so).
    ``fault``: a negative control applied to the sharded build (``ranks_seeded_differently``).
    """
    failed = preflight(spec)
    if failed:
        return preflight_failure(TrainStepReport, ctx, failed)
    with FAULTS.inject(fault, ctx):
        model = materialize(ctx, spec, version, "deterministic", seed)
    reference = reference_model(spec, seed, ctx.device)
    if version == "fsdp2" and model_level(spec):
        # A model-level init draws FSDP2's shards per rank (init.weights judges them by
        # distribution): the reference steps from the values the sharded model holds.
        _load_values(reference, gathered_state(model, version))
    dropout = disable_dropout(reference, model)  # names from the unwrapped reference
    batch = spec.batch(reference, batch_size=2, device=ctx.device)
    losses = []
    for m in (model, reference):
        optimizer = torch.optim.SGD(m.parameters(), lr=lr)
        loss = default_loss(call_model(m, batch))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    after = gathered_state(model, version)
    expected = full_state(reference)
    worst_name, worst = "", 0.0
    bad = []
    for name, t in after.items():
        e = expected[name].detach().cpu()
        diff = max_abs_diff(t, e)
        if diff > STEP_ATOL + STEP_RTOL * max_abs(e) or (diff and is_exact(e)):
            bad.append(name)
        if diff > worst:
            worst_name, worst = name, diff
    return {
        "rank": ctx.rank,
        "loss": losses[0],
        "reference_loss": losses[1],
        "mismatch": bad,
        "max_abs_diff": worst,
        "max_abs_diff_at": worst_name,
        "dropout_disabled": dropout,
    }


def _load_values(model: torch.nn.Module, values: Mapping[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, t in full_state(model).items():
            if name in values:
                t.copy_(values[name].to(t.device))


def verdict_train_step(values: Sequence[TrainStepReport], params: Mapping[str, Any]) -> Verdict:
    failed = failed_on_ranks(values)
    if failed:
        return failed
    worst = max(values, key=lambda v: v["max_abs_diff"])
    figures = {
        "loss": values[0]["loss"],
        "reference_loss": values[0]["reference_loss"],
        "max_abs_diff": worst["max_abs_diff"],
    }
    problems = [
        f"rank {v['rank']}: loss {v['loss']:.6g} vs reference {v['reference_loss']:.6g}"
        for v in values
        if not math.isclose(v["loss"], v["reference_loss"], rel_tol=STEP_RTOL, abs_tol=STEP_ATOL)
    ]
    problems += [
        f"rank {v['rank']}: after the step, weights differ from the reference "
        f"(rtol {STEP_RTOL}, atol {STEP_ATOL}): {listing(v['mismatch'], 6)}"
        for v in values
        if v["mismatch"]
    ]
    dropout = values[0].get("dropout_disabled") or []
    note = (
        f"; dropout disabled for the comparison ({len(dropout)} dropout setting(s), e.g. "
        f"{dropout[0]}: p = 0 on both models)"
        if dropout
        else ""
    )
    if problems:
        return Verdict(
            False,
            "the first training step after meta init does not match the "
            "reference" + note + ":\n  " + "\n  ".join(problems),
            figures,
        )
    return Verdict(
        True,
        f"step after meta init matches the reference on {len(values)} ranks "
        f"(loss {values[0]['loss']:.6g}; largest weight difference "
        f"{worst['max_abs_diff']:.2g} at {worst['max_abs_diff_at'] or '-'}){note}",
        figures,
    )
