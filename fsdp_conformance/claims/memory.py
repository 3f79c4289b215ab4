"""Memory conformance: peak within the per-layer bound, depth invariance, the sawtooth, meters.

The claim only: rank functions, verdicts and ``CHECKS``. Its building blocks are modules of
their own, shared with init's peak check and the planner:

* **The bound** (:mod:`~fsdp_conformance.bound`): :func:`~fsdp_conformance.bound.per_layer_bound`,
  a pure function of a unit plan and a :class:`~fsdp_conformance.bound.StepConfig`;
  docs/memory.md derives every term. :mod:`~fsdp_conformance.profile` gets its inputs from a
  model on meta.
* **Measurement** (:mod:`~fsdp_conformance.meters`, :mod:`~fsdp_conformance.timeline`,
  :mod:`~fsdp_conformance.step`): torch's trackers, the OS high-water mark as ground truth, the
  CUDA allocator on GPU, a timeline sampled at every unit's hooks, and one measured step.
* **Checks** (``CHECKS``): peak within the bound on every rank, depth invariance, the sawtooth,
  and the meter's agreement with ground truth. Each fails on the seeds' naive wrappings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fsdp_conformance.bound import Bound, MeasureError, StepConfig, per_layer_bound
from fsdp_conformance.claims.check import Check, Verdict, variants
from fsdp_conformance.harness import RankContext, skip_rank
from fsdp_conformance.meters import (
    MALLOC_ENV,
    METER_RESOLUTION_BYTES,
    choose_meter,
    meter_floor_problems,
    torch_version_string,
)
from fsdp_conformance.models import NO_SETTABLE_DEPTH, ModelSpec
from fsdp_conformance.profile import plan_step
from fsdp_conformance.reference_models import LlamaConfig, ModelConfig
from fsdp_conformance.sizes import format_bytes
from fsdp_conformance.step import measure_step
from fsdp_conformance.units import ROOT, UnitInfo

#: Sawtooth: a unit's gather (and release) must be within this fraction of its unsharded bytes.
SAWTOOTH_TOLERANCE = 0.25
#: Depth invariance: the per-layer working set may vary by this fraction of its smallest value.
DEPTH_TOLERANCE = 0.10
#: Meter cross-check: tracker vs OS (or CUDA allocator) step increase, relative.
METER_TOLERANCE = 0.05


class MemoryCheckError(MeasureError):
    """A memory check was asked for something it cannot measure; the message says the fix."""


# ============================================================================================
# Rank functions (module level, picklable, plain data back)
# ============================================================================================

#: The reference model of the memory checks: the seeds' MassiveModel at dim 256 (2.4 MB per
#: layer in fp32, so allocator noise and small tensors do not dominate), 8 layers.
DEFAULT_SPEC = ModelSpec(reference="massive", config=ModelConfig(num_layers=8, dim=256))
DEFAULT_DEPTHS = (2, 4, 8)


#: Below this unsharded size of the largest unit, a unit's gather cannot be told apart from the
#: activations and allocator rounding between two hooks: the sawtooth is not measurable.
SAWTOOTH_MIN_UNIT_BYTES = 256 * 1024


def rank_sawtooth(ctx: RankContext, spec: ModelSpec = DEFAULT_SPEC, version: str = "fsdp2",
                  **kwargs: Any) -> dict[str, Any]:
    """:func:`rank_peak_within_bound` for the sawtooth, skipped (on every rank alike) when units
    are tiny."""
    units, config = plan_step(spec, ctx.world_size, version,
                              optimizer=kwargs.get("optimizer"),
                              batch_size=kwargs.get("batch_size", 2))
    largest = _block_bytes(units, config)
    if largest < SAWTOOTH_MIN_UNIT_BYTES:
        skip_rank(f"the largest unit of {spec.name} is {largest / 1024:.0f} KiB unsharded, under "
                  f"{SAWTOOTH_MIN_UNIT_BYTES // 1024} KiB: a gather that small cannot be told "
                  "apart from activations in the timeline; use a larger config of the model")
    return rank_peak_within_bound(ctx, spec, version, **kwargs)


def require_sharding(ctx: RankContext, version: str) -> None:
    """Skip (on every rank alike) where the wrapping cannot change memory: FSDP1 at one rank.

    FSDP1 clamps every sharding strategy to NO_SHARD at world size 1 (torch's
    ``_init_core_state`` warns "FSDP is switching to use `NO_SHARD`"): units never gather or
    release, so per-layer and monolithic wrapping hold the same memory and neither the bound's
    negative controls nor the sawtooth can be told apart. FSDP2 still shards over a mesh of one
    (it gathers into separate unsharded parameters), so it is measured at world size 1.
    """
    if version == "fsdp1" and ctx.world_size == 1:
        skip_rank("FSDP1 runs NO_SHARD at world size 1 (torch switches any sharding strategy to "
                  "NO_SHARD): nothing is gathered or released, so the per-layer memory claims "
                  "cannot be told apart from monolithic wrapping; run at world size >= 2")


def rank_peak_within_bound(ctx: RankContext, spec: ModelSpec = DEFAULT_SPEC,
                           version: str = "fsdp2", wrapping: str = "per_layer",
                           optimizer: str | None = None, batch_size: int = 2,
                           compare_with: str | None = None) -> dict[str, Any]:
    """One measured step plus the per-layer bound for this model and world size.

    ``compare_with`` (e.g. "monolithic") also measures that wrapping's timeline, for the
    picture; reference models only, since a user's model may not fit unsharded.
    """
    require_sharding(ctx, version)
    units, config = plan_step(spec, ctx.world_size, version, optimizer=optimizer,
                              batch_size=batch_size)
    result = measure_step(ctx, spec, version, wrapping, optimizer=optimizer,
                          batch_size=batch_size)
    result["bound"] = per_layer_bound(units, config).to_dict()
    result["plan"] = [u.to_dict() for u in units]
    result["compute_bytes"] = config.compute_bytes
    if compare_with and spec.reference is not None and compare_with != wrapping:
        other = measure_step(ctx, spec, version, compare_with, optimizer=optimizer,
                             batch_size=batch_size)
        result["compare"] = {"wrapping": compare_with, "timeline": other["timeline"],
                             "peak": other["meters"][0]["peak"]}
    return result


#: The mixed-precision cases of ``memory.mixed_precision_peak``: (label, param dtype, reduce
#: dtype). The first leaves the reduce dtype to torch, as a user writes it.
MIXED_CASES: tuple[tuple[str, str, str | None], ...] = (
    ("reduce_unset", "bf16", None), ("reduce_fp32", "bf16", "fp32"))


def rank_mixed_precision_peak(ctx: RankContext, spec: ModelSpec = DEFAULT_SPEC,
                              version: str = "fsdp2", wrapping: str = "per_layer",
                              cases: Sequence[tuple[str, str, str | None]] = MIXED_CASES,
                              batch_size: int = 2) -> dict[str, Any]:
    """Per mixed-precision case: one measured step with its collectives recorded, and the plan.

    The bound is not computed here: the verdict derives it from the dtypes the step's
    collectives had (:func:`observed_step_config`), not from the case's configuration.
    """
    require_sharding(ctx, version)
    if ctx.world_size == 1:
        # torch 2.13's FSDP2 copies shards into the unsharded parameters on a mesh of one
        # (``_fsdp_param_group``, "world_size == 1"): no collective, so no dtype to observe.
        skip_rank("at world size 1 FSDP2 issues no all-gather or reduce-scatter: there is no "
                  "observed dtype to derive the bound from; run at world size >= 2")
    units, config = plan_step(spec, ctx.world_size, version, batch_size=batch_size)
    out: dict[str, Any] = {"rank": ctx.rank, "plan": [u.to_dict() for u in units],
                           "config": _config_data(config), "cases": {}}
    for label, param_dtype, reduce_dtype in cases:
        m = measure_step(ctx, spec, version, wrapping, batch_size=batch_size, timeline=False,
                         param_dtype=param_dtype, reduce_dtype=reduce_dtype, record=True)
        out["cases"][label] = {"param_dtype": param_dtype, "reduce_dtype": reduce_dtype,
                               "meter": m["meters"][0], "param_bytes": m["param_bytes"],
                               "collectives": m["collective_records"],
                               "unit_sizes": m["collective_unit_sizes"]}
    return out


def _config_data(config: StepConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)  # plain data across the pipe; _config_from rebuilds it


def _config_from(data: Mapping[str, Any]) -> StepConfig:
    from fsdp_conformance.bound import ActivationProfile

    acts = data.get("activations")
    return StepConfig(**{**data, "activations": None if acts is None
                         else ActivationProfile(**acts)})


def with_depth(spec: ModelSpec, num_layers: int) -> ModelSpec:
    """The same model with ``num_layers`` blocks.

    A reference model: its config at that depth. A factory: the spec's ``depth``, which
    :meth:`~fsdp_conformance.models.ModelSpec.build` passes as the factory's depth keyword or
    sets on a copy of its transformers config (:meth:`~ModelSpec.depth_setting`).
    """
    if spec.reference is None:
        if spec.depth_setting() is None:
            raise MemoryCheckError(f"depth invariance needs a model whose depth can be set; "
                                   f"{spec.name!r}: {NO_SETTABLE_DEPTH}")
        return dataclasses.replace(spec, depth=num_layers)
    config = spec.config if spec.config is not None else spec.build("meta").config
    if not isinstance(config, (ModelConfig, LlamaConfig)):
        raise MemoryCheckError(f"reference model {spec.name!r} has no num_layers in its config")
    return dataclasses.replace(spec, config=dataclasses.replace(config, num_layers=num_layers))


def rank_depth_invariance(ctx: RankContext, spec: ModelSpec = DEFAULT_SPEC,
                          version: str = "fsdp2", depths: Sequence[int] = DEFAULT_DEPTHS,
                          wrapping: str = "per_layer", reference: str = "monolithic",
                          optimizer: str | None = None,
                          batch_size: int = 2) -> dict[str, Any]:
    """Peaks at several depths for ``wrapping`` and for the ``reference`` (monolithic) wrapping."""
    how = spec.depth_setting()  # the same answer on every rank: from the spec alone
    if how is None:
        skip_rank(f"depth invariance needs a model whose depth can be set; {spec.name!r}: "
                  f"{NO_SETTABLE_DEPTH}")
    if len(set(depths)) < 3:
        raise MemoryCheckError(f"depth invariance needs at least three depths, got {list(depths)}")
    require_sharding(ctx, version)
    rows = []
    for depth in sorted(set(depths)):
        deep = with_depth(spec, depth)
        units, config = plan_step(deep, ctx.world_size, version, optimizer=optimizer,
                                  batch_size=batch_size)
        bound = per_layer_bound(units, config)
        row: dict[str, Any] = {"depth": depth, "bound": bound.to_dict(),
                               "layer_bytes": _block_bytes(units, config), "units": len(units)}
        for w in dict.fromkeys((wrapping, reference)):
            m = measure_step(ctx, deep, version, w, optimizer=optimizer, batch_size=batch_size,
                             timeline=False)
            row[w] = m["meters"][0]["peak"]
        rows.append(row)
    return {"rank": ctx.rank, "rows": rows, "wrapping": wrapping, "reference": reference,
            "depth_set_by": how}


def _block_bytes(units: Sequence[UnitInfo], config: StepConfig) -> int:
    """Unsharded bytes of the largest non-root unit (one layer of the per-layer plan)."""
    others = [u.numel for u in units if u.fqn != ROOT] or [u.numel for u in units]
    return max(others) * config.compute_bytes


def rank_meter_agrees(ctx: RankContext, spec: ModelSpec = DEFAULT_SPEC,
                      version: str = "fsdp2", wrapping: str = "per_layer",
                      track_construction: bool = True, batch_size: int = 2) -> dict[str, Any]:
    """The tracker and the ground truth (OS on CPU, CUDA allocator on GPU) on the same step.

    The tracker is the meter the other checks read on this lane: on CPU ``FSDPMemTracker``
    for FSDP2 (the source of its figures), ``MemTracker`` for FSDP1; on GPU, where the
    allocator itself is the figure, ``MemTracker``.
    """
    truth = "cuda" if ctx.device_type == "cuda" else "os"
    meter = "auto" if truth == "os" else "tracker"
    if meter == "auto" and choose_meter(ctx, "auto", version) == truth:
        skip_rank(f"torch {torch_version_string()} moved its memory trackers: the {truth} "
                  "figure is the only meter, there is no tracker to cross-check")
    result = measure_step(ctx, spec, version, wrapping, meter=meter, also=truth,
                          batch_size=batch_size, timeline=False,
                          track_construction=track_construction)
    # A step the ground truth cannot resolve makes any tracker figure "agree": skip it, on
    # every rank alike (the smallest rank's step decides, so no rank skips alone).
    import torch
    import torch.distributed as dist

    seen = result["meters"][1]["peak"] - result["meters"][1]["start"]
    smallest = torch.tensor([int(seen)], dtype=torch.int64, device=ctx.device)
    dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
    if smallest.item() <= METER_RESOLUTION_BYTES:
        skip_rank(f"the step of {spec.name} adds {_mb(smallest.item())} by the "
                  f"{truth} figure, within the meters' resolution ({_mb(METER_RESOLUTION_BYTES)}):"
                  " tracker and truth cannot be compared; use a larger config of the model or "
                  "batch")
    return result


# ============================================================================================
# Verdicts (parent side, from every rank's values)
# ============================================================================================


def _mb(n: float) -> str:
    # The memory claim's unit (decimal MB), from the one formatter.
    return format_bytes(n, "MB")


def _label(params: Mapping[str, Any]) -> str:
    spec = params.get("spec", DEFAULT_SPEC)
    return (f"{params.get('wrapping', 'per_layer')} wrapping, {params.get('version', 'fsdp2')}, "
            f"{getattr(spec, 'name', spec)}")


def verdict_peak_within_bound(
    values: Sequence[Mapping[str, Any]], params: Mapping[str, Any]
) -> Verdict:
    """Every rank's measured peak at or under the per-layer bound (with its tolerance)."""
    rows = []
    for v in values:
        bound = Bound.from_dict(v["bound"])
        meter = v["meters"][0]
        rows.append((v["rank"], meter["peak"], bound, meter))
    over = [(r, p, b, m) for r, p, b, m in rows if p > b.limit]
    # Under the bound proves nothing from a meter blind to the rank's own shards (one reading 0
    # would pass): each rank's meter must see at least its parameter shards.
    blind = [line for v in values
             for line in meter_floor_problems(v["rank"], v["meters"][:1], v.get("param_bytes"))]
    bound = rows[0][2]
    peak = max(p for _, p, _, _ in rows)
    figures = {"peak_bytes": peak, "bound_bytes": bound.total, "limit_bytes": bound.limit,
               "peak_over_bound": round(peak / bound.total, 3), "source": rows[0][3]["source"]}
    data = {"bound": bound.to_dict(), "peaks": {r: p for r, p, _, _ in rows},
            "breakdown": {r: m["breakdown"] for r, _, _, m in rows}}
    if blind:
        return Verdict(False, f"{_label(params)}: the peak cannot be judged, the meter reads less "
                       "than the parameter shards:\n  " + "\n  ".join(blind), figures, data)
    if not over:
        return Verdict(True, f"{_label(params)}: peak {_mb(peak)} on the highest rank, at or under "
                       f"the per-layer bound {_mb(bound.total)} (limit {_mb(bound.limit)}) on "
                       f"all {len(rows)} ranks", figures, data)
    from fsdp_conformance.units import UnitInfo as _U
    from fsdp_conformance.units import format_unit_tree

    lines = [f"{_label(params)}: peak exceeds the per-layer bound on rank(s) "
             f"{', '.join(str(r) for r, *_ in over)}"]
    for r, p, b, m in over:
        lines.append(f"  rank {r}: peak {_mb(p)} > limit {_mb(b.limit)} (bound {_mb(b.total)} + "
                     f"{b.tolerance:.0%}), over by {_mb(p - b.limit)} ({p / b.total:.2f}x the "
                     f"bound); measured by {m['source']}")
        if m["breakdown"]:
            parts = ", ".join(f"{k} {_mb(x)}" for k, x in sorted(m["breakdown"].items(),
                                                                  key=lambda kv: -kv[1]))
            lines.append(f"    at the peak: {parts}")
    lines += ["expected (per-layer bound, term by term):", bound.format(), "",
              format_unit_tree([_U.from_dict(u) for u in values[0]["plan"]],
                               "expected units (per-layer plan):"), "",
              format_unit_tree([_U.from_dict(u) for u in values[0]["units"]], "actual units:")]
    return Verdict(False, "\n".join(lines), figures, data)


def sawtooth_teeth(timeline: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per unit, in forward order: the rise at its gather and the fall at its release."""
    at: dict[tuple[str, str], int] = {}
    order: list[str] = []
    for e in timeline:
        key = (e["unit"], e["phase"])
        if key not in at:  # the forward samples: the first of each phase
            at[key] = e["bytes"]
            if e["phase"] == "pre_forward":
                order.append(e["unit"])
    teeth = []
    for unit in order:
        try:
            rise = at[(unit, "forward")] - at[(unit, "pre_forward")]
            fall = at[(unit, "forward_done")] - at[(unit, "post_forward")]
        except KeyError:
            continue
        teeth.append({"unit": unit, "rise": rise, "fall": fall})
    return teeth


def verdict_sawtooth(values: Sequence[Mapping[str, Any]], params: Mapping[str, Any]) -> Verdict:
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
            problems.append(f"rank {r}: no sawtooth: {len(nonroot)} non-root unit(s) ran in "
                            f"forward; the root gathered {_mb(whole)} at once")
        for x in teeth:
            if x["rise"] > (1 + t) * 2 * plan_max:
                problems.append(
                    f"rank {r}: unit {x['unit'] or '(root)'} gathered {_mb(x['rise'])} at once, "
                    f"more than the current + prefetched unit of the per-layer plan "
                    f"(2 x {_mb(plan_max)} + {t:.0%})")
            if x["unit"] != ROOT and x["fall"] < (1 - t) * own.get(x["unit"], 0):
                problems.append(
                    f"rank {r}: unit {x['unit']} kept its parameters after forward: released "
                    f"{_mb(x['fall'])}, expected about {_mb(own[x['unit']])} (its unsharded size, "
                    f"-{t:.0%})")
        summary.append((r, nonroot))
    first = values[0]
    data: dict[str, Any] = {"timeline": first["timeline"],
                            "teeth": sawtooth_teeth(first["timeline"]),
                            "wrapping": first["wrapping"], "limit_bytes": first["bound"]["limit"],
                            "peak_bytes": first["meters"][0]["peak"],
                            "timelines_by_rank": {v["rank"]: v["timeline"] for v in values}}
    if "compare" in first:
        data["compare"] = first["compare"]
    teeth0 = summary[0][1]
    figures = {"teeth": len(teeth0),
               "max_rise_bytes": max((x["rise"] for x in teeth0), default=0),
               "min_fall_bytes": min((x["fall"] for x in teeth0), default=0)}
    if problems:
        lines = [f"{_label(params)}: the timeline is not a per-unit sawtooth:", *problems[:12]]
        if len(problems) > 12:
            lines.append(f"... and {len(problems) - 12} more")
        lines.append("forward teeth on rank 0 (unit: rise / fall):")
        lines += [f"  {x['unit'] or '(root)'}: +{_mb(x['rise'])} / -{_mb(x['fall'])}"
                  for x in sawtooth_teeth(first["timeline"])]
        return Verdict(False, "\n".join(lines), figures, data)
    return Verdict(True, f"{_label(params)}: sawtooth on all {len(values)} ranks: "
                   f"{len(teeth0)} units each rise by at most {_mb(figures['max_rise_bytes'])} and "
                   f"release their own parameters", figures, data)


def _sharded_state(bound: Bound) -> int:
    return sum(t.bytes for t in bound.terms
               if t.scales_with_depth and t.name != "saved activations")


def _saved_activations(bound: Bound) -> int:
    return sum(t.bytes for t in bound.terms if t.name == "saved activations")


def verdict_depth_invariance(
    values: Sequence[Mapping[str, Any]], params: Mapping[str, Any]
) -> Verdict:
    """The per-layer working set constant across depths on every rank; monolithic's grows.

    Working set = peak - sharded state (params, grads, optimizer state: what per-layer FSDP is
    allowed to add per layer). Saved activations also grow with depth but only part of them is
    alive at a backward peak, so each depth gives a range ``[ws - saved, ws]``; the ranges must
    meet within the tolerance: ``max(ws - saved) <= (1 + tolerance) * min(ws)``, whichever depth
    is the larger one (more at fewer layers is not constant either; the measurement is
    deterministic, see :func:`~fsdp_conformance.step.collectives_release_in_order`). The
    monolithic reference must grow by at least the added layers' unsharded bytes between depths,
    or the measurement could not tell the wrappings apart and the check fails rather than pass
    blindly. The per-layer plan must gain units at every deeper depth: a factory that takes a
    depth keyword but ignores it would otherwise measure one model three times and pass.
    """
    t = params.get("tolerance", DEPTH_TOLERANCE)
    problems = []
    tables = {}
    for v in values:
        wrapping, reference = v["wrapping"], v["reference"]
        rows = v["rows"]
        counts = [row.get("units") for row in rows]
        if None not in counts and any(b <= a for a, b in zip(counts, counts[1:])):
            problems.append(
                f"rank {v['rank']}: the model did not get deeper: its per-layer plan has "
                + ", ".join(f"{c} units at {row['depth']} layers" for c, row in zip(counts, rows))
                + f" (depth set by {v.get('depth_set_by', 'its config')}); make the factory "
                "build that many blocks")
        bounds = [Bound.from_dict(row["bound"]) for row in rows]
        ws = [row[wrapping] - _sharded_state(b) for row, b in zip(rows, bounds)]
        low = [w - _saved_activations(b) for w, b in zip(ws, bounds)]
        r = v["rank"]
        # Every pair of depths, both ways: the claim is "constant", so a shallow depth that
        # needs more is a failure too. (A late free on gloo's worker thread once made one
        # depth read ~1 MB high; frees now happen in program order, so it cannot.)
        apart = [(i, j) for j in range(len(rows)) for i in range(len(rows))
                 if i != j and low[j] > (1 + t) * ws[i]]
        if apart:
            i, j = max(apart, key=lambda ij: low[ij[1]] - ws[ij[0]])
            steps = ", ".join(f"{row['depth']} layers: {_mb(w)}" for row, w in zip(rows, ws))
            how = ("grows with depth" if j > i else
                   "is not constant over depth (larger at fewer layers)")
            problems.append(
                f"rank {r}: the {wrapping} working set {how} ({steps}); at "
                f"{rows[j]['depth']} layers at least {_mb(low[j])} (saved activations "
                f"discounted) > {_mb(ws[i])} at {rows[i]['depth']} layers + {t:.0%}")
        ref_ws = ([row[reference] - _sharded_state(b) for row, b in zip(rows, bounds)]
                  if reference != wrapping else ws)
        if reference != wrapping:
            for a, b, wa, wb in zip(rows, rows[1:], ref_ws, ref_ws[1:]):
                added = (b["depth"] - a["depth"]) * b["layer_bytes"]
                if wb - wa < (1 - t) * added:
                    problems.append(
                        f"rank {r}: the {reference} reference grew by only {_mb(wb - wa)} from "
                        f"{a['depth']} to {b['depth']} layers, expected at least the added layers' "
                        f"{_mb(added)}: the measurement cannot tell the wrappings apart")
        tables[r] = [(row["depth"], row[wrapping], _sharded_state(b), w, row[reference], rw)
                     for row, b, w, rw in zip(rows, bounds, ws, ref_ws)]
    shown = next((v["rank"] for v in values if any(p.startswith(f"rank {v['rank']}:")
                                                   for p in problems)), values[0]["rank"])
    table = tables[shown]
    lines = [f"rank {shown}:",
             f"{'layers':>6}  {'peak':>10}  {'sharded':>10}  {'working set':>11}  "
             f"{'monolithic peak':>15}  {'its working set':>15}"]
    lines += [f"{d:>6}  {_mb(p):>10}  {_mb(s):>10}  {_mb(w):>11}  {_mb(m):>15}  {_mb(mw):>15}"
              for d, p, s, w, m, mw in table]
    figures = {"depths": [row[0] for row in table], "working_set_bytes": [row[3] for row in table],
               "peak_bytes": table[-1][1]}
    depths = (f"depths {', '.join(str(d) for d in figures['depths'])} (set by "
              f"{values[0].get('depth_set_by', 'its config')})")
    data = {"rows_by_rank": {v["rank"]: v["rows"] for v in values}}
    if problems:
        return Verdict(False, f"{_label(params)}: depth invariance fails at {depths}:\n"
                       + "\n".join(problems)
                       + "\n" + "\n".join(lines), figures, data)
    return Verdict(True, f"{_label(params)}: working set constant within {t:.0%} over "
                   f"{depths} on all {len(values)} ranks\n" + "\n".join(lines),
                   figures, data)


def verdict_meter_agrees(values: Sequence[Mapping[str, Any]], params: Mapping[str, Any]) -> Verdict:
    """The tracker's step increase (peak - start) within the tolerance of the ground truth's."""
    t = params.get("tolerance", METER_TOLERANCE)
    problems, ratios = [], []
    for v in values:
        tracker, truth = v["meters"][0], v["meters"][1]
        got, want = tracker["peak"] - tracker["start"], truth["peak"] - truth["start"]
        ratio = got / want if want else float("inf")
        ratios.append(round(ratio, 3))
        if want <= METER_RESOLUTION_BYTES:
            # Within the resolution any tracker figure, 0 included, would "agree": no verdict.
            problems.append(f"rank {v['rank']}: {truth['source']} saw the step add only "
                            f"{_mb(want)}, below the meters' resolution "
                            f"({_mb(METER_RESOLUTION_BYTES)}): the tracker's {_mb(got)} cannot "
                            "be judged; use a larger config of the model or batch")
        elif abs(got - want) > max(t * want, METER_RESOLUTION_BYTES):
            problems.append(f"rank {v['rank']}: {tracker['source']} saw the step add {_mb(got)}, "
                            f"{truth['source']} {_mb(want)} (ratio {ratio:.3f}, tolerance {t:.0%} "
                            f"or {_mb(METER_RESOLUTION_BYTES)}, whichever is larger)")
        problems += meter_floor_problems(v["rank"], v["meters"], v.get("param_bytes"))
    truth_src = values[0]["meters"][1]["source"]
    figures = {"tracker_over_truth": ratios, "truth": truth_src,
               "tracker": values[0]["meters"][0]["source"]}
    if problems:
        return Verdict(False, f"{_label(params)}: the tracker disagrees with the {truth_src} "
                       "figure:\n" + "\n".join(problems), figures, {})
    return Verdict(True, f"{_label(params)}: {figures['tracker']} within {t:.0%} of the "
                   f"{truth_src} figure, and every meter at least the parameter shards, on "
                   f"all ranks (ratios {ratios})", figures, {})


def observed_dtypes(records: Sequence[Mapping[str, Any]]) -> dict[str, str | None]:
    """The all-gather output and reduce-scatter input dtypes of one step's collectives
    (``a|b`` when they differ between collectives, None when none was issued)."""
    def of(op: str, side: str) -> str | None:
        seen = sorted({r[side] for r in records if r["op"] == op and r[side]})
        return "|".join(seen) if seen else None

    return {"all_gather_dtype": of("all_gather", "out_dtype"),
            "reduce_scatter_dtype": of("reduce_scatter", "in_dtype")}


def _itemsize(dtype: str | None) -> int | None:
    """Bytes per element of one observed dtype (``torch.bfloat16``); None when not one dtype."""
    import torch

    if dtype is None or "|" in dtype:
        return None
    value = getattr(torch, dtype.removeprefix("torch."), None)
    return value.itemsize if isinstance(value, torch.dtype) else None


def dtype_size_problems(records: Sequence[Mapping[str, Any]],
                        sizes: Mapping[str, Sequence[int]]) -> list[str]:
    """Collectives whose bytes are not their unit's numel x the bytes of the dtype recorded.

    The bound takes its bytes per element from the recorded dtypes; this ties each dtype to the
    bytes the collective really moved (an all-gather's output, a reduce-scatter's input), so a
    dtype that does not describe the data (a recorder or a report that says bf16 where fp32 was
    gathered) fails instead of shrinking the bound.
    """
    problems = []
    for i, r in enumerate(records):
        if r["op"] not in ("all_gather", "reduce_scatter"):
            continue
        side = "out" if r["op"] == "all_gather" else "in"
        dtype, nbytes = r[f"{side}_dtype"], r[f"{side}_bytes"]
        item = _itemsize(dtype)
        numels = sorted({n for u in r["unit"].split("|") for n in sizes.get(u, ())})
        if item is None or not numels:
            problems.append(f"collective {i} ({r['op']} of unit {r['unit'] or '(root)'}): "
                            f"{side}put dtype {dtype}, unit sizes {numels or 'unknown'}: its "
                            "bytes per element cannot be read")
        elif nbytes not in {n * item for n in numels}:
            problems.append(
                f"collective {i} ({r['op']} of unit {r['unit'] or '(root)'}): {nbytes:,} B "
                f"{side}put, not its numel ({' or '.join(f'{n:,}' for n in numels)}) x {item} B "
                f"of the recorded {dtype} ({nbytes / numels[0]:.3g} B per element)")
    return problems


def observed_step_config(config: StepConfig, dtypes: Mapping[str, str | None]) -> StepConfig:
    """``config`` with the gathered-parameter bytes from the all-gather's output dtype and the
    reduction bytes from the reduce-scatter's input dtype, as observed."""
    gather = _itemsize(dtypes["all_gather_dtype"])
    reduce = _itemsize(dtypes["reduce_scatter_dtype"])
    if gather is None or reduce is None:
        raise MemoryCheckError(f"no single dtype observed: {dict(dtypes)}")
    return dataclasses.replace(config, compute_bytes=gather, reduce_bytes=reduce)


def verdict_mixed_precision_peak(
    values: Sequence[Mapping[str, Any]], params: Mapping[str, Any]
) -> Verdict:
    """Per case, every rank's peak at or under the per-layer bound of the dtypes it observed.

    The bound's unsharded-parameter and all-gather terms take the bytes per element of the
    all-gather's output, its reduce-scatter terms those of the reduce-scatter's input, each as
    the rank's own collectives had them (docs/memory.md, "Mixed precision").
    """
    problems: list[str] = []
    figures: dict[str, Any] = {}
    data: dict[str, Any] = {"collectives": {}, "bounds": {}, "peaks": {}}
    summary = []
    for label in values[0]["cases"]:
        peaks, dtypes_by_rank, bounds = {}, {}, {}
        for v in values:
            r, case = v["rank"], v["cases"][label]
            dtypes = observed_dtypes(case["collectives"])
            dtypes_by_rank[r] = dtypes
            meter = case["meter"]
            peaks[r] = meter["peak"]
            problems += [f"{label}: {line}" for line in
                         meter_floor_problems(r, [meter], case.get("param_bytes"))]
            mismatched = dtype_size_problems(case["collectives"], case["unit_sizes"])
            if mismatched:
                problems.append(f"{label}: rank {r}: the recorded dtypes do not describe the "
                                f"bytes moved; no bound is derived from them:\n    "
                                + "\n    ".join(mismatched[:4])
                                + (f"\n    ... and {len(mismatched) - 4} more"
                                   if len(mismatched) > 4 else ""))
                continue
            try:
                config = observed_step_config(_config_from(v["config"]), dtypes)
            except MemoryCheckError:
                problems.append(
                    f"{label}: rank {r}: no bound can be derived: the step issued all-gather "
                    f"output dtype(s) {dtypes['all_gather_dtype']} and reduce-scatter input "
                    f"dtype(s) {dtypes['reduce_scatter_dtype']} (one of each expected)")
                continue
            bound = per_layer_bound([UnitInfo.from_dict(u) for u in v["plan"]], config)
            bounds[r] = bound
            if meter["peak"] > bound.limit:
                problems.append(
                    f"{label}: rank {r}: peak {_mb(meter['peak'])} > limit {_mb(bound.limit)} "
                    f"(bound {_mb(bound.total)} + {bound.tolerance:.0%}) of the observed dtypes "
                    f"(all-gather {dtypes['all_gather_dtype']}, reduce-scatter "
                    f"{dtypes['reduce_scatter_dtype']}), over by "
                    f"{_mb(meter['peak'] - bound.limit)}; measured by {meter['source']}\n"
                    + bound.format())
        first = values[0]["rank"]
        dtypes0 = dtypes_by_rank[first]
        if any(d != dtypes0 for d in dtypes_by_rank.values()):
            problems.append(f"{label}: the ranks observed different dtypes: "
                            + "; ".join(f"rank {r} {d}" for r, d in dtypes_by_rank.items()))
        peak = max(peaks.values())
        case0 = values[0]["cases"][label]
        # Peak, bound and the observed dtypes first: the run's table shows the first figures.
        figures[f"{label}.peak_bytes"] = peak
        if bounds:
            b = max(bounds.values(), key=lambda x: x.total)
            figures[f"{label}.bound_bytes"] = b.total
        figures[f"{label}.all_gather_dtype"] = dtypes0["all_gather_dtype"]
        figures[f"{label}.reduce_scatter_dtype"] = dtypes0["reduce_scatter_dtype"]
        figures[f"{label}.param_dtype"] = case0["param_dtype"]
        figures[f"{label}.reduce_dtype"] = case0["reduce_dtype"] or "unset"
        if bounds:
            figures[f"{label}.limit_bytes"] = b.limit
            data["bounds"][label] = b.to_dict()
            summary.append(f"{label} (all-gather {dtypes0['all_gather_dtype']}, reduce-scatter "
                           f"{dtypes0['reduce_scatter_dtype']}): peak {_mb(peak)}, bound "
                           f"{_mb(b.total)}")
        figures[f"{label}.source"] = case0["meter"]["source"]
        data["collectives"][label] = case0["collectives"]
        data["peaks"][label] = peaks
    head = f"{_label(params)}, bf16 mixed precision"
    if problems:
        return Verdict(False, f"{head}: peak not within the bound of the observed dtypes:\n"
                       + "\n".join(problems), figures, data)
    return Verdict(True, f"{head}: on all {len(values)} ranks, every peak at or under the "
                   f"per-layer bound of the dtypes its collectives had: " + "; ".join(summary),
                   figures, data)


# ============================================================================================
# The checks
# ============================================================================================


#: Each memory check once per FSDP version on the reference model: name, rank function,
#: verdict, extra params, description.
_ROWS: tuple[tuple[str, Callable[..., Any], Callable[..., Verdict], dict[str, Any], str], ...] = (
    ("memory.peak_within_bound", rank_peak_within_bound, verdict_peak_within_bound, {},
     "per-layer wrapping: every rank's peak at or under the term-by-term per-layer bound"),
    ("memory.sawtooth", rank_sawtooth, verdict_sawtooth, {"compare_with": "monolithic"},
     "the timeline rises by about one unit at each gather and falls back at each release"),
    ("memory.depth_invariance", rank_depth_invariance, verdict_depth_invariance, {},
     "more layers add only sharded state per rank (per-layer); monolithic adds the full layers"),
    ("memory.meter_agrees", rank_meter_agrees, verdict_meter_agrees, {"env": MALLOC_ENV},
     "torch's tracker agrees with ground truth (OS high-water mark / CUDA allocator) on a step"),
)
PEAK_CHECKS, SAWTOOTH_CHECKS, DEPTH_CHECKS, METER_CHECKS = (
    variants(name, text, rank_fn, verdict, specs=(DEFAULT_SPEC,), **extra)
    for name, rank_fn, verdict, extra, text in _ROWS
)

MIXED_CHECKS = variants(
    "memory.mixed_precision_peak",
    "bf16 param_dtype (reduce dtype unset, and fp32): every rank's peak at or under the per-layer "
    "bound of the dtypes its collectives were observed to have",
    rank_mixed_precision_peak, verdict_mixed_precision_peak, specs=(DEFAULT_SPEC,))

CHECKS: tuple[Check, ...] = (PEAK_CHECKS + SAWTOOTH_CHECKS + DEPTH_CHECKS + METER_CHECKS
                             + MIXED_CHECKS)
