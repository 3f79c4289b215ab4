"""``memory.depth_invariance``: more layers add only sharded state per rank under per-layer
wrapping, while monolithic wrapping adds the full layers.

Peaks at several depths (2, 4 and 8 layers of the reference model; a factory's depth keyword or
its transformers config otherwise), each against the per-layer bound of that depth, for the
user's per-layer step and the monolithic reference the check itself runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.memory import common
from fsdp_conformance.claims.memory.common import (
    DEFAULT_SPEC,
    FAULTS,
    PER_LAYER,
    MemoryCheckError,
    block_bytes,
    check_label,
    mb,
    require_sharding,
    wrapped_step,
)
from fsdp_conformance.harness import RankContext, skip_rank
from fsdp_conformance.measure.bound import Bound, per_layer_bound
from fsdp_conformance.measure.profile import plan_step
from fsdp_conformance.models.model_spec import NO_SETTABLE_DEPTH, ModelSpec
from fsdp_conformance.models.reference_models import LlamaConfig, ModelConfig

#: The per-layer working set may vary by this fraction of its smallest value.
DEPTH_TOLERANCE = 0.10
DEFAULT_DEPTHS = (2, 4, 8)


class DepthResult(TypedDict):
    """One rank's peaks at every depth, for the wrapping under test and its reference."""

    rank: int
    #: Per depth: ``depth``, ``bound`` (its per-layer bound), ``layer_bytes`` (one block
    #: unsharded), ``units`` (of the per-layer plan), and each wrapping's peak under its label.
    rows: list[dict[str, Any]]
    #: The wrapping under test (the user's: per-layer) and the reference (monolithic).
    wrapping: str
    reference: str
    #: How the depth was set (``ModelSpec.depth_setting``).
    depth_set_by: str


def with_depth(spec: ModelSpec, num_layers: int) -> ModelSpec:
    """The same model with ``num_layers`` blocks.

    A reference model: its config at that depth. A factory: the spec's ``depth``, which
    :meth:`~fsdp_conformance.models.model_spec.ModelSpec.build` passes as the factory's depth
    keyword or sets on a copy of its transformers config (:meth:`~ModelSpec.depth_setting`).
    """
    if spec.reference is None:
        if spec.depth_setting() is None:
            raise MemoryCheckError(
                f"depth invariance needs a model whose depth can be set; "
                f"{spec.name!r}: {NO_SETTABLE_DEPTH}"
            )
        return dataclasses.replace(spec, depth=num_layers)
    config = spec.config if spec.config is not None else spec.build("meta").config
    if not isinstance(config, (ModelConfig, LlamaConfig)):
        raise MemoryCheckError(f"reference model {spec.name!r} has no num_layers in its config")
    return dataclasses.replace(spec, config=dataclasses.replace(config, num_layers=num_layers))


def rank_depth_invariance(
    ctx: RankContext,
    spec: ModelSpec = DEFAULT_SPEC,
    version: str = "fsdp2",
    depths: Sequence[int] = DEFAULT_DEPTHS,
    reference: str = "monolithic",
    optimizer: str | None = None,
    batch_size: int = 2,
    fault: str | Sequence[str] | None = None,
) -> DepthResult:
    """Peaks at several depths for the user's per-layer step and the ``reference`` wrapping.

    ``reference`` is the wrapping the verdict expects to grow by whole layers (monolithic):
    without it a measurement blind to the wrapping would pass. ``fault``: negative controls of
    :data:`~fsdp_conformance.claims.memory.common.FAULTS`.
    """
    with FAULTS.inject(fault, ctx):
        how = spec.depth_setting()  # the same answer on every rank: from the spec alone
        if how is None:
            skip_rank(
                f"depth invariance needs a model whose depth can be set; {spec.name!r}: "
                f"{NO_SETTABLE_DEPTH}"
            )
            assert how is not None  # skip_rank raised
        if len(set(depths)) < 3:
            raise MemoryCheckError(
                f"depth invariance needs at least three depths, got {list(depths)}"
            )
        require_sharding(ctx, version)
        rows = []
        wrapping = PER_LAYER
        for depth in sorted(set(depths)):
            deep = with_depth(spec, depth)
            units, config = plan_step(
                deep, ctx.world_size, version, optimizer=optimizer, batch_size=batch_size
            )
            bound = per_layer_bound(units, config)
            row: dict[str, Any] = {
                "depth": depth,
                "bound": bound.to_dict(),
                "layer_bytes": block_bytes(units, config),
                "units": len(units),
            }
            step = common.per_layer_step(
                ctx, deep, version, optimizer=optimizer, batch_size=batch_size, timeline=False
            )
            wrapping = step["wrapping"]
            row[wrapping] = step["meters"][0]["peak"]
            if reference != wrapping:  # each wrapping measured once per depth
                row[reference] = wrapped_step(
                    ctx,
                    deep,
                    version,
                    reference,
                    optimizer=optimizer,
                    batch_size=batch_size,
                    timeline=False,
                )["meters"][0]["peak"]
            rows.append(row)
        return {
            "rank": ctx.rank,
            "rows": rows,
            "wrapping": wrapping,
            "reference": reference,
            "depth_set_by": how,
        }


def sharded_state(bound: Bound) -> int:
    """What per-layer FSDP may add per layer: sharded params, grads and optimizer state."""
    return sum(
        t.bytes for t in bound.terms if t.scales_with_depth and t.name != "saved activations"
    )


def saved_activations(bound: Bound) -> int:
    """The bound's saved activations (they grow with depth, but only part is alive at a peak)."""
    return sum(t.bytes for t in bound.terms if t.name == "saved activations")


def verdict_depth_invariance(values: Sequence[DepthResult], params: Mapping[str, Any]) -> Verdict:
    """The per-layer working set constant across depths on every rank; monolithic's grows.

    Working set = peak - sharded state (params, grads, optimizer state: what per-layer FSDP is
    allowed to add per layer). Saved activations also grow with depth but only part of them is
    alive at a backward peak, so each depth gives a range ``[ws - saved, ws]``; the ranges must
    meet within the tolerance: ``max(ws - saved) <= (1 + tolerance) * min(ws)``, plus what the
    deeper one's own bound adds for a layer at a time (its terms that do not scale with depth:
    a model whose deeper builds add a larger kind of layer), whichever depth
    is the larger one (more at fewer layers is not constant either; the measurement is
    deterministic, see :func:`~fsdp_conformance.measure.step.collectives_release_in_order`). The
    monolithic reference must grow by at least the added layers' unsharded bytes between depths,
    or the measurement could not tell the wrappings apart and the check fails rather than pass
    blindly. The per-layer plan must gain units at every deeper depth: a factory that takes a
    depth keyword but ignores it would otherwise measure one model three times and pass.
    """
    t = params.get("tolerance", DEPTH_TOLERANCE)
    label = check_label(params, values[0]["wrapping"])
    problems = []
    tables = {}
    for v in values:
        wrapping, reference = v["wrapping"], v["reference"]
        rows = v["rows"]
        counts = [row.get("units") for row in rows]
        known = [c for c in counts if c is not None]  # hand-made rows may have no unit counts
        if len(known) == len(counts) and any(b <= a for a, b in zip(known, known[1:])):
            problems.append(
                f"rank {v['rank']}: the model did not get deeper: its per-layer plan has "
                + ", ".join(f"{c} units at {row['depth']} layers" for c, row in zip(counts, rows))
                + f" (depth set by {v.get('depth_set_by', 'its config')}); make the factory "
                "build that many blocks"
            )
        bounds = [Bound.from_dict(row["bound"]) for row in rows]
        ws = [row[wrapping] - sharded_state(b) for row, b in zip(rows, bounds)]
        low = [w - saved_activations(b) for w, b in zip(ws, bounds)]
        # What the bound itself says one layer at a time costs at each depth (the gathered
        # units, their gradients, one layer's activations): constant over depth for a model of
        # one kind of layer. A model whose deeper builds add a larger kind (DeepSeek-V3's first
        # layers dense, the rest mixtures of experts) may grow its working set by that much.
        step = [b.total - b.depth_scaling for b in bounds]
        r = v["rank"]
        # Every pair of depths, both ways: the claim is "constant", so a shallow depth that
        # needs more is a failure too. (A late free on gloo's worker thread can make one
        # depth read ~1 MB high; the measured step frees in program order, so it does not.)
        apart = [
            (i, j)
            for j in range(len(rows))
            for i in range(len(rows))
            if i != j and low[j] > (1 + t) * ws[i] + max(0, step[j] - step[i])
        ]
        if apart:
            i, j = max(apart, key=lambda ij: low[ij[1]] - ws[ij[0]])
            steps = ", ".join(f"{row['depth']} layers: {mb(w)}" for row, w in zip(rows, ws))
            how = (
                "grows with depth"
                if j > i
                else "is not constant over depth (larger at fewer layers)"
            )
            grown = max(0, step[j] - step[i])
            larger = f" + {mb(grown)} (its bound's larger layers)" if grown else ""
            problems.append(
                f"rank {r}: the {wrapping} working set {how} ({steps}); at "
                f"{rows[j]['depth']} layers at least {mb(low[j])} (saved activations "
                f"discounted) > {mb(ws[i])} at {rows[i]['depth']} layers + {t:.0%}{larger}"
            )
        ref_ws = (
            [row[reference] - sharded_state(b) for row, b in zip(rows, bounds)]
            if reference != wrapping
            else ws
        )
        if reference != wrapping:
            for a, b, wa, wb in zip(rows, rows[1:], ref_ws, ref_ws[1:]):
                added = (b["depth"] - a["depth"]) * b["layer_bytes"]
                if wb - wa < (1 - t) * added:
                    problems.append(
                        f"rank {r}: the {reference} reference grew by only {mb(wb - wa)} from "
                        f"{a['depth']} to {b['depth']} layers, expected at least the added layers' "
                        f"{mb(added)}: the measurement cannot tell the wrappings apart"
                    )
        tables[r] = [
            (row["depth"], row[wrapping], sharded_state(b), w, row[reference], rw)
            for row, b, w, rw in zip(rows, bounds, ws, ref_ws)
        ]
    shown = next(
        (v["rank"] for v in values if any(p.startswith(f"rank {v['rank']}:") for p in problems)),
        values[0]["rank"],
    )
    table = tables[shown]
    lines = [
        f"rank {shown}:",
        f"{'layers':>6}  {'peak':>10}  {'sharded':>10}  {'working set':>11}  "
        f"{'monolithic peak':>15}  {'its working set':>15}",
    ]
    lines += [
        f"{d:>6}  {mb(p):>10}  {mb(s):>10}  {mb(w):>11}  {mb(m):>15}  {mb(mw):>15}"
        for d, p, s, w, m, mw in table
    ]
    figures = {
        "depths": [row[0] for row in table],
        "working_set_bytes": [row[3] for row in table],
        "peak_bytes": table[-1][1],
    }
    depths = (
        f"depths {', '.join(str(d) for d in figures['depths'])} (set by "
        f"{values[0].get('depth_set_by', 'its config')})"
    )
    data = {"rows_by_rank": {v["rank"]: v["rows"] for v in values}}
    if problems:
        return Verdict(
            False,
            f"{label}: depth invariance fails at {depths}:\n"
            + "\n".join(problems)
            + "\n"
            + "\n".join(lines),
            figures,
            data,
        )
    return Verdict(
        True,
        f"{label}: working set constant within {t:.0%} over "
        f"{depths} on all {len(values)} ranks\n" + "\n".join(lines),
        figures,
        data,
    )
