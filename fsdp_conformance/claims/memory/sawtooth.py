"""``memory.sawtooth``: the timeline rises by about one unit at each gather and falls back at
each release.

The step is :func:`~fsdp_conformance.claims.memory.common.bounded_step`'s,
its timeline sampled at every unit's hooks (:mod:`fsdp_conformance.measure.timeline`); the check's
own run also measures monolithic wrapping, for the picture (``compare_with``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.memory.common import (
    DEFAULT_SPEC,
    FAULTS,
    SAWTOOTH_MIN_UNIT_BYTES,
    PeakResult,
    Scaling,
    bounded_step,
    check_label,
    describe,
    for_sawtooth,
    mb,
    measured_at,
)
from fsdp_conformance.harness import RankContext
from fsdp_conformance.models.model_spec import ModelSpec
from fsdp_conformance.models.units import ROOT

#: A unit's gather (and release) must be within this fraction of its unsharded bytes.
SAWTOOTH_TOLERANCE = 0.25

__all__ = ["SAWTOOTH_MIN_UNIT_BYTES", "SawtoothResult", "rank_sawtooth", "verdict_sawtooth"]


class SawtoothResult(PeakResult):
    """The per-layer step of :func:`~.common.bounded_step`, and the size it was measured at."""

    #: None: the model as configured; else what was scaled to resolve
    #: (:func:`~.common.for_sawtooth`).
    scaled: Scaling | None


class Tooth(TypedDict):
    """One unit's forward in the timeline: the rise at its gather, the fall at its release."""

    unit: str
    rise: int
    fall: int


def rank_sawtooth(
    ctx: RankContext,
    spec: ModelSpec = DEFAULT_SPEC,
    version: str = "fsdp2",
    optimizer: str | None = None,
    batch_size: int = 2,
    compare_with: str | None = None,
    fault: str | Sequence[str] | None = None,
) -> SawtoothResult:
    """:func:`~.common.bounded_step` for the sawtooth, at a size whose units the timeline
    resolves: a user's model below it is measured at its smallest width that does
    (:func:`~.common.for_sawtooth`), and skipped (on every rank alike) only when its width
    cannot be set."""
    measured, scaled = for_sawtooth(ctx, spec)
    with FAULTS.inject(fault, ctx):
        step = bounded_step(ctx, measured, version, optimizer, batch_size, compare_with)
    return {**step, "scaled": scaled}


def sawtooth_teeth(timeline: Sequence[Mapping[str, Any]]) -> list[Tooth]:
    """Per unit, in forward order: the rise at its gather and the fall at its release."""
    at: dict[tuple[str, str], int] = {}
    order: list[str] = []
    for e in timeline:
        key = (e["unit"], e["phase"])
        if key not in at:  # the forward samples: the first of each phase
            at[key] = e["bytes"]
            if e["phase"] == "pre_forward":
                order.append(e["unit"])
    teeth: list[Tooth] = []
    for unit in order:
        try:
            rise = at[(unit, "forward")] - at[(unit, "pre_forward")]
            fall = at[(unit, "forward_done")] - at[(unit, "post_forward")]
        except KeyError:
            continue
        teeth.append({"unit": unit, "rise": rise, "fall": fall})
    return teeth


def verdict_sawtooth(values: Sequence[SawtoothResult], params: Mapping[str, Any]) -> Verdict:
    """Each unit's gather rises by about one unit and its release falls back, on every rank.

    Rise: at most the current plus the prefetched unit of the per-layer plan (FSDP2 prefetches
    the next unit in forward), within the tolerance. Fall: the unit's own unsharded bytes,
    within the tolerance (the root is exempt: FSDP keeps it gathered into backward). A sawtooth
    needs teeth: at least two non-root units.
    """
    t = params.get("tolerance", SAWTOOTH_TOLERANCE)
    problems: list[str] = []
    summary = []
    for v in values:
        cb = v["compute_bytes"]
        plan_max = max((u["numel"] for u in v["plan"] if u["fqn"] != ROOT), default=0) * cb
        own = {u["fqn"]: u["numel"] * cb for u in v["units"]}
        teeth = sawtooth_teeth(v["timeline"])
        nonroot = [x for x in teeth if x["unit"] != ROOT]
        r = v["rank"]
        if len(nonroot) < 2:
            whole = next((x["rise"] for x in teeth if x["unit"] == ROOT), 0)
            problems.append(
                f"rank {r}: no sawtooth: {len(nonroot)} non-root unit(s) ran in "
                f"forward; the root gathered {mb(whole)} at once"
            )
        for x in teeth:
            if x["rise"] > (1 + t) * 2 * plan_max:
                problems.append(
                    f"rank {r}: unit {x['unit'] or '(root)'} gathered {mb(x['rise'])} at once, "
                    f"more than the current + prefetched unit of the per-layer plan "
                    f"(2 x {mb(plan_max)} + {t:.0%})"
                )
            if x["unit"] != ROOT and x["fall"] < (1 - t) * own.get(x["unit"], 0):
                problems.append(
                    f"rank {r}: unit {x['unit']} kept its parameters after forward: released "
                    f"{mb(x['fall'])}, expected about {mb(own[x['unit']])} (its unsharded size, "
                    f"-{t:.0%})"
                )
        summary.append((r, nonroot))
    first = values[0]
    label = check_label(params, first["wrapping"])
    scaled = first.get("scaled")
    if scaled:  # the same on every rank: chosen from the spec alone
        label = f"{label} ({describe(scaled)})"
    data: dict[str, Any] = {
        "timeline": first["timeline"],
        "teeth": sawtooth_teeth(first["timeline"]),
        "wrapping": first["wrapping"],
        "limit_bytes": first["bound"]["limit"],
        "peak_bytes": first["meters"][0]["peak"],
        "timelines_by_rank": {v["rank"]: v["timeline"] for v in values},
    }
    if first["compare"] is not None:
        data["compare"] = first["compare"]
    if scaled:
        data["scaled"] = scaled
    teeth0 = summary[0][1]
    figures: dict[str, Any] = {
        **measured_at(scaled),
        "teeth": len(teeth0),
        "max_rise_bytes": max((x["rise"] for x in teeth0), default=0),
        "min_fall_bytes": min((x["fall"] for x in teeth0), default=0),
    }
    if problems:
        lines = [f"{label}: the timeline is not a per-unit sawtooth:", *problems[:12]]
        if len(problems) > 12:
            lines.append(f"... and {len(problems) - 12} more")
        lines.append("forward teeth on rank 0 (unit: rise / fall):")
        lines += [
            f"  {x['unit'] or '(root)'}: +{mb(x['rise'])} / -{mb(x['fall'])}"
            for x in sawtooth_teeth(first["timeline"])
        ]
        return Verdict(False, "\n".join(lines), figures, data)
    return Verdict(
        True,
        f"{label}: sawtooth on all {len(values)} ranks: "
        f"{len(teeth0)} units each rise by at most {mb(figures['max_rise_bytes'])} and "
        f"release their own parameters",
        figures,
        data,
    )
