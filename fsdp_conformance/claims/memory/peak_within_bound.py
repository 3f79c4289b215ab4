"""``memory.peak_within_bound``: every rank's measured peak at or under the per-layer bound.

The bound is :func:`~fsdp_conformance.measure.bound.per_layer_bound` of the model's per-layer plan
on meta (docs/memory.md derives every term); the peak is one measured step of the user's per-layer
wrapping. The step with its bound is :func:`~fsdp_conformance.claims.memory.common.bounded_step`,
which ``memory.sawtooth`` also measures (the same step's timeline).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.memory.common import (
    DEFAULT_SPEC,
    FAULTS,
    PeakResult,
    bounded_step,
    check_label,
    mb,
)
from fsdp_conformance.harness import RankContext
from fsdp_conformance.measure.bound import Bound
from fsdp_conformance.measure.meters import meter_floor_problems
from fsdp_conformance.models.model_spec import ModelSpec
from fsdp_conformance.models.units import UnitInfo, format_unit_tree


def rank_peak_within_bound(
    ctx: RankContext,
    spec: ModelSpec = DEFAULT_SPEC,
    version: str = "fsdp2",
    optimizer: str | None = None,
    batch_size: int = 2,
    compare_with: str | None = None,
    fault: str | Sequence[str] | None = None,
) -> PeakResult:
    """One measured step plus the per-layer bound for this model and world size
    (:func:`~fsdp_conformance.claims.memory.common.bounded_step`).

    ``compare_with`` (e.g. "monolithic") also measures that wrapping's timeline, for the
    picture; reference models only, since a user's model may not fit unsharded. ``fault``:
    negative controls of :data:`~fsdp_conformance.claims.memory.common.FAULTS`.
    """
    with FAULTS.inject(fault, ctx):
        return bounded_step(ctx, spec, version, optimizer, batch_size, compare_with)


def verdict_peak_within_bound(values: Sequence[PeakResult], params: Mapping[str, Any]) -> Verdict:
    """Every rank's measured peak at or under the per-layer bound (with its tolerance)."""
    label = check_label(params, values[0]["wrapping"])
    rows = []
    for v in values:
        bound = Bound.from_dict(v["bound"])
        meter = v["meters"][0]
        rows.append((v["rank"], meter["peak"], bound, meter))
    over = [(r, p, b, m) for r, p, b, m in rows if p > b.limit]
    # Under the bound proves nothing from a meter blind to the rank's own shards (one reading 0
    # would pass): each rank's meter must see at least its parameter shards.
    blind = [
        line
        for v in values
        for line in meter_floor_problems(v["rank"], v["meters"][:1], v.get("param_bytes"))
    ]
    bound = rows[0][2]
    peak = max(p for _, p, _, _ in rows)
    figures = {
        "peak_bytes": peak,
        "bound_bytes": bound.total,
        "limit_bytes": bound.limit,
        "peak_over_bound": round(peak / bound.total, 3),
        "source": rows[0][3]["source"],
    }
    data: dict[str, Any] = {
        "bound": bound.to_dict(),
        "peaks": {r: p for r, p, _, _ in rows},
        "breakdown": {r: m["breakdown"] for r, _, _, m in rows},
    }
    if values[0]["timeline"]:
        # The picture's data where no sawtooth panel of the same run draws this step (a
        # sawtooth that skipped): gate/plots.py draws one panel per run, the sawtooth's first.
        data.update(
            timeline=values[0]["timeline"],
            wrapping=values[0]["wrapping"],
            limit_bytes=bound.limit,
            peak_bytes=values[0]["meters"][0]["peak"],
        )
    if blind:
        return Verdict(
            False,
            f"{label}: the peak cannot be judged, the meter reads less "
            "than the parameter shards:\n  " + "\n  ".join(blind),
            figures,
            data,
        )
    if not over:
        return Verdict(
            True,
            f"{label}: peak {mb(peak)} on the highest rank, at or under "
            f"the per-layer bound {mb(bound.total)} (limit {mb(bound.limit)}) on "
            f"all {len(rows)} ranks",
            figures,
            data,
        )
    lines = [
        f"{label}: peak exceeds the per-layer bound on rank(s) "
        f"{', '.join(str(r) for r, *_ in over)}"
    ]
    for r, p, b, m in over:
        lines.append(
            f"  rank {r}: peak {mb(p)} > limit {mb(b.limit)} (bound {mb(b.total)} + "
            f"{b.tolerance:.0%}), over by {mb(p - b.limit)} ({p / b.total:.2f}x the "
            f"bound); measured by {m['source']}"
        )
        if m["breakdown"]:
            parts = ", ".join(
                f"{k} {mb(x)}" for k, x in sorted(m["breakdown"].items(), key=lambda kv: -kv[1])
            )
            lines.append(f"    at the peak: {parts}")
    lines += [
        "expected (per-layer bound, term by term):",
        bound.format(),
        "",
        format_unit_tree(
            [UnitInfo.from_dict(u) for u in values[0]["plan"]], "expected units (per-layer plan):"
        ),
        "",
        format_unit_tree([UnitInfo.from_dict(u) for u in values[0]["units"]], "actual units:"),
    ]
    return Verdict(False, "\n".join(lines), figures, data)
