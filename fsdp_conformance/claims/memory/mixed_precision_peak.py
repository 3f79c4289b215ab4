"""``memory.mixed_precision_peak``: the bf16 peak at or under the per-layer bound of the dtypes
the step's collectives were observed to have.

Per mixed-precision case (bf16 ``param_dtype`` with the reduce dtype unset, as a user writes
it, and with fp32), one measured step with its collectives recorded
(:mod:`fsdp_conformance.fsdp.collectives`); the verdict derives the bound from the observed dtypes,
each tied to the bytes its collective moved (docs/memory.md, "Mixed precision").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict, cast

from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.memory import common
from fsdp_conformance.claims.memory.common import (
    DEFAULT_SPEC,
    FAULTS,
    MemoryCheckError,
    check_label,
    mb,
    require_sharding,
)
from fsdp_conformance.fsdp.sharding import (
    InputCasts,
    full_precision_units_note,
    input_casts_note,
    known_fix_figure,
)
from fsdp_conformance.harness import RankContext, skip_rank
from fsdp_conformance.measure.bound import (
    ActivationProfile,
    StepConfig,
    per_layer_bound,
    with_full_precision_units,
)
from fsdp_conformance.measure.meters import meter_floor_problems
from fsdp_conformance.measure.profile import plan_step
from fsdp_conformance.models.model_spec import ModelSpec
from fsdp_conformance.models.units import UnitInfo


class MixedCase(TypedDict):
    """One mixed-precision case's step on one rank."""

    param_dtype: str
    reduce_dtype: str | None
    #: The step's meter reading (``meters.meter_data``).
    meter: dict[str, Any]
    param_bytes: int
    #: The step's collectives as torch issued them (``collectives.record_collectives``).
    collectives: list[dict[str, Any]]
    #: Each unit's possible collective numels, by unit FQN.
    unit_sizes: dict[str, list[int]]
    #: None: the case ran as users write it. Else torch's defaults raised the version's known
    #: error and the step measured is the one with its fix (``step.measure_step``).
    input_casts: InputCasts | None
    #: The fix's fp32 units (FSDP2's ``_BatchNorm`` units), by FQN with their numel: their
    #: collectives are fp32 by the fix, and the bound counts them apart.
    full_units: dict[str, int]


class MixedResult(TypedDict):
    """Every case of one rank, with the per-layer plan and step config the bounds start from."""

    rank: int
    plan: list[dict[str, Any]]
    #: :func:`config_data` of the plan's step config; the verdict replaces its dtypes' bytes.
    config: dict[str, Any]
    #: By case label, in the order of ``cases``.
    cases: dict[str, MixedCase]


#: The mixed-precision cases of ``memory.mixed_precision_peak``: (label, param dtype, reduce
#: dtype). The first leaves the reduce dtype to torch, as a user writes it.
MIXED_CASES: tuple[tuple[str, str, str | None], ...] = (
    ("reduce_unset", "bf16", None),
    ("reduce_fp32", "bf16", "fp32"),
)


def rank_mixed_precision_peak(
    ctx: RankContext,
    spec: ModelSpec = DEFAULT_SPEC,
    version: str = "fsdp2",
    cases: Sequence[tuple[str, str, str | None]] = MIXED_CASES,
    batch_size: int = 2,
    fault: str | Sequence[str] | None = None,
) -> MixedResult:
    """Per mixed-precision case: one measured step with its collectives recorded, and the plan.

    The bound is not computed here: the verdict derives it from the dtypes the step's
    collectives had (:func:`observed_step_config`), not from the case's configuration.
    ``fault``: negative controls of :data:`~fsdp_conformance.claims.memory.common.FAULTS`.
    """
    with FAULTS.inject(fault, ctx):
        require_sharding(ctx, version)
        if ctx.world_size == 1:
            # torch 2.13's FSDP2 copies shards into the unsharded parameters on a mesh of one
            # (``_fsdp_param_group``, "world_size == 1"): no collective, so no dtype to observe.
            skip_rank(
                "at world size 1 FSDP2 issues no all-gather or reduce-scatter: there is "
                "no observed dtype to derive the bound from; run at world size >= 2"
            )
        units, config = plan_step(spec, ctx.world_size, version, batch_size=batch_size)
        out: MixedResult = {
            "rank": ctx.rank,
            "plan": [u.to_dict() for u in units],
            "config": config_data(config),
            "cases": {},
        }
        for label, param_dtype, reduce_dtype in cases:
            m = common.per_layer_step(
                ctx,
                spec,
                version,
                batch_size=batch_size,
                timeline=False,
                param_dtype=param_dtype,
                reduce_dtype=reduce_dtype,
                record=True,
            )
            # With record=True the step's data also has its collectives (not every step's).
            recorded = cast(Mapping[str, Any], m)
            out["cases"][label] = {
                "param_dtype": param_dtype,
                "reduce_dtype": reduce_dtype,
                "meter": m["meters"][0],
                "param_bytes": m["param_bytes"],
                "collectives": recorded["collective_records"],
                "unit_sizes": recorded["collective_unit_sizes"],
                "input_casts": m["input_casts"],
                "full_units": m["full_precision_units"],
            }
        return out


def config_data(config: StepConfig) -> dict[str, Any]:
    """``config`` as plain data across the pipe (:func:`config_from` rebuilds it)."""
    return dataclasses.asdict(config)


def config_from(data: Mapping[str, Any]) -> StepConfig:
    """The :class:`~fsdp_conformance.measure.bound.StepConfig` of :func:`config_data`'s data."""
    acts = data.get("activations")
    return StepConfig(
        **{**data, "activations": None if acts is None else ActivationProfile(**acts)}
    )


def observed_dtypes(records: Sequence[Mapping[str, Any]]) -> dict[str, str | None]:
    """The all-gather output and reduce-scatter input dtypes of one step's collectives
    (``a|b`` when they differ between collectives, None when none was issued)."""

    def of(op: str, side: str) -> str | None:
        seen = sorted({r[side] for r in records if r["op"] == op and r[side]})
        return "|".join(seen) if seen else None

    return {
        "all_gather_dtype": of("all_gather", "out_dtype"),
        "reduce_scatter_dtype": of("reduce_scatter", "in_dtype"),
    }


def _itemsize(dtype: str | None) -> int | None:
    """Bytes per element of one observed dtype (``torch.bfloat16``); None when not one dtype."""
    import torch

    if dtype is None or "|" in dtype:
        return None
    value = getattr(torch, dtype.removeprefix("torch."), None)
    return value.itemsize if isinstance(value, torch.dtype) else None


def _part_reduced(record: Mapping[str, Any], item: int, numels: Sequence[int]) -> bool:
    """A reduce-scatter of part of its unit, its bytes its own elements x the dtype's: FSDP2
    reduces only the parameters that got a gradient (a decoder layer's cross-attention, unused
    when a causal LM runs it without encoder states, gets none)."""
    numel = record.get("numel")
    return (
        record["op"] == "reduce_scatter"
        and isinstance(numel, int)
        and 0 < numel <= max(numels)
        and record["in_bytes"] == numel * item
    )


def dtype_size_problems(
    records: Sequence[Mapping[str, Any]], sizes: Mapping[str, Sequence[int]]
) -> list[str]:
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
            problems.append(
                f"collective {i} ({r['op']} of unit {r['unit'] or '(root)'}): "
                f"{side}put dtype {dtype}, unit sizes {numels or 'unknown'}: its "
                "bytes per element cannot be read"
            )
        elif nbytes not in {n * item for n in numels} and not _part_reduced(r, item, numels):
            problems.append(
                f"collective {i} ({r['op']} of unit {r['unit'] or '(root)'}): {nbytes:,} B "
                f"{side}put, not its numel ({' or '.join(f'{n:,}' for n in numels)}) x {item} B "
                f"of the recorded {dtype} ({nbytes / numels[0]:.3g} B per element)"
            )
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
    values: Sequence[MixedResult], params: Mapping[str, Any]
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
            full = case.get("full_units") or {}
            # The fix's fp32 units: their dtype is the fix's, counted apart in the bound.
            dtypes = observed_dtypes(
                [c for c in case["collectives"] if not set(c["unit"].split("|")) <= set(full)]
            )
            dtypes_by_rank[r] = dtypes
            meter = case["meter"]
            peaks[r] = meter["peak"]
            problems += [
                f"{label}: {line}"
                for line in meter_floor_problems(r, [meter], case.get("param_bytes"))
            ]
            mismatched = dtype_size_problems(case["collectives"], case["unit_sizes"])
            if mismatched:
                problems.append(
                    f"{label}: rank {r}: the recorded dtypes do not describe the "
                    f"bytes moved; no bound is derived from them:\n    "
                    + "\n    ".join(mismatched[:4])
                    + (f"\n    ... and {len(mismatched) - 4} more" if len(mismatched) > 4 else "")
                )
                continue
            try:
                config = observed_step_config(config_from(v["config"]), dtypes)
            except MemoryCheckError:
                problems.append(
                    f"{label}: rank {r}: no bound can be derived: the step issued all-gather "
                    f"output dtype(s) {dtypes['all_gather_dtype']} and reduce-scatter input "
                    f"dtype(s) {dtypes['reduce_scatter_dtype']} (one of each expected)"
                )
                continue
            bound = with_full_precision_units(
                per_layer_bound([UnitInfo.from_dict(u) for u in v["plan"]], config), full
            )
            bounds[r] = bound
            if meter["peak"] > bound.limit:
                problems.append(
                    f"{label}: rank {r}: peak {mb(meter['peak'])} > limit {mb(bound.limit)} "
                    f"(bound {mb(bound.total)} + {bound.tolerance:.0%}) of the observed dtypes "
                    f"(all-gather {dtypes['all_gather_dtype']}, reduce-scatter "
                    f"{dtypes['reduce_scatter_dtype']}), over by "
                    f"{mb(meter['peak'] - bound.limit)}; measured by {meter['source']}\n"
                    + bound.format()
                )
        first = values[0]["rank"]
        dtypes0 = dtypes_by_rank[first]
        if any(d != dtypes0 for d in dtypes_by_rank.values()):
            problems.append(
                f"{label}: the ranks observed different dtypes: "
                + "; ".join(f"rank {r} {d}" for r, d in dtypes_by_rank.items())
            )
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
            summary.append(
                f"{label} (all-gather {dtypes0['all_gather_dtype']}, reduce-scatter "
                f"{dtypes0['reduce_scatter_dtype']}): peak {mb(peak)}, bound "
                f"{mb(b.total)}"
            )
        figures[f"{label}.source"] = case0["meter"]["source"]
        data["collectives"][label] = case0["collectives"]
        data["peaks"][label] = peaks
        if case0.get("full_units"):  # fp32 units: FSDP2's fix or FSDP1's default
            data.setdefault("full_precision_units", {})[label] = case0["full_units"]
        fixed = case0.get("input_casts")
        if fixed is not None:  # torch's defaults could not run the model
            figures[known_fix_figure(fixed)] = True
            data.setdefault("input_casts", {})[label] = fixed
    casts = data.get("input_casts", {})
    note = (
        f"; case(s) {', '.join(casts)}: {input_casts_note(next(iter(casts.values())))[2:]}"
        if casts
        else ""
    )
    full = data.get("full_precision_units", {})
    note += full_precision_units_note(
        params.get("version", "fsdp2"), next(iter(full.values())) if full else {}
    )
    head = f"{check_label(params)}, bf16 mixed precision{note}"
    if problems:
        return Verdict(
            False,
            f"{head}: peak not within the bound of the observed dtypes:\n" + "\n".join(problems),
            figures,
            data,
        )
    return Verdict(
        True,
        f"{head}: on all {len(values)} ranks, every peak at or under the "
        f"per-layer bound of the dtypes its collectives had: " + "; ".join(summary),
        figures,
        data,
    )
